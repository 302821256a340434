"""Batch-1 decode step of the default model against its memory floor, and where the rest
of the step goes (issue 34, item 4).

Each configuration (dtype, --quantization) runs in a child process of its own: an Engine
in-process (the decode node's: no detokenizing), the default model (SmolLM2-135M-Instruct,
GGUF Q4_1), one greedy sequence after a 32-token prompt, ``--steps`` engine steps timed one
by one. Per step: ms (median, min); torch operations dispatched (a dispatch-mode counter
over one step: matmuls, views, host syncs, the rest); and the step split into the
projections (every layer's and the LM head, timed alone on one row, in the same order),
the rest of the layers' forward (norms, rotary, KV store, attention: small operations),
the LM head's call and the engine around the forward (inputs, sampling, scheduler).
The floor: the weight bytes a step reads over the read bandwidth measured in the same run
(torch.sum over 512 MiB, same threads), before each child.

    python benchmarks/decode_step.py [--configs float32:none,bfloat16:none,bfloat16:auto]
        [--threads 2] [--steps 64] [--rounds 2]

A third field ``layers`` (``bfloat16:auto:layers``) turns the native decode step off
(kernels/native/decode_step.py): the same kernels called layer by layer from Python.
``logits`` keeps the native step but on the runner's general path: the step fed the
torch lookups' tensors (ModelInputs), the logits formed and sampled, where by default a
greedy decode batch goes to the step as token ids and comes back as tokens
(ModelRunner._decode_greedy).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from datetime import datetime

CONFIGS = "float32:none,bfloat16:none,bfloat16:auto"
PROMPT_LEN = 32
WARMUP = 8


def timed(fn, into: list[float]):
    """fn, appending each call's seconds to ``into``."""
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        into.append(time.perf_counter() - t0)
        return out
    return wrapper


def projections(model) -> list:
    """Every weight-reading module a decode step calls, in its order (unfused ones too)."""
    mods = []
    for layer in model.model.layers:
        a, m = layer.self_attn, layer.mlp
        mods += [a.qkv_proj] if a.qkv_proj is not None else [a.q_proj, a.k_proj, a.v_proj]
        mods.append(a.o_proj)
        mods += [m.gate_up_proj] if m.gate_up_proj is not None else [m.gate_proj, m.up_proj]
        mods.append(m.down_proj)
    return mods


def projections_ms(model, dtype, repeats: int = 15) -> tuple[float, float]:
    """One row through every layer's projections, as a step calls them, and through the
    LM head: (layers ms, head ms), medians."""
    import torch

    mods = projections(model)
    rows = [torch.randn(1, m.in_features, dtype=dtype) for m in mods]
    head_in = torch.randn(1, model.config.hidden_size, dtype=dtype)
    layers, head = [], []
    with torch.inference_mode():
        for _ in range(repeats):
            t0 = time.perf_counter()
            for m, x in zip(mods, rows):
                m(x)
            t1 = time.perf_counter()
            model.compute_logits(head_in)
            layers.append(t1 - t0)
            head.append(time.perf_counter() - t1)
    return statistics.median(layers) * 1e3, statistics.median(head) * 1e3


def child(dtype_name: str, quant: str, path: str, threads: int, steps: int) -> None:
    import torch

    from pdserve.bench.floor import step_weight_bytes
    from pdserve.bench.op_count import OpCounter
    from pdserve.common.sampling import SamplingParams
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.engine import Engine

    engine = Engine(EngineConfig(dtype=dtype_name, quantization=quant, threads=threads,
                                 kv_cache_memory_gb=1 / 16), detokenize=False)
    dtype = getattr(torch, dtype_name)
    runner, model = engine.runner, engine.model
    if path == "layers":
        model.native_step = None
    elif path == "logits":
        runner._decode_greedy = lambda batch: None
    hidden_s, head_s, prepare_s, picked = [], [], [], []
    runner._hidden = timed(runner._hidden, hidden_s)
    decode_greedy = model.decode_greedy

    def greedy(*args):  # a step that picks its tokens: the head runs inside the forward
        t0 = time.perf_counter()
        out = decode_greedy(*args)
        if out is not None:  # (None: the runner's general path runs the step)
            hidden_s.append(time.perf_counter() - t0)
            picked.append(out[1] is not None)
        return out

    model.decode_greedy = greedy
    runner.prepare = timed(runner.prepare, prepare_s)
    compute_logits = model.compute_logits
    model.compute_logits = timed(compute_logits, head_s)
    prompt = torch.randint(3, model.config.vocab_size, (PROMPT_LEN,),
                           generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(max_tokens=steps + WARMUP + 8, temperature=0, ignore_eos=True)
    engine.add_request("0", prompt, params)
    for _ in range(WARMUP):  # the prefill, then decode steps
        engine.step()
    with OpCounter() as ops:
        engine.step()
    for acc in (hidden_s, head_s, prepare_s, picked):
        acc.clear()
    step_s = []
    step = timed(engine.step, step_s)
    for _ in range(steps):
        step()
    model.compute_logits = compute_logits  # projections_ms times it alone
    int4, dense = step_weight_bytes(model, dtype)

    def ms(xs):
        return statistics.median(xs) * 1e3 if xs else 0.0

    top = ops.counts.most_common(12)
    print(json.dumps({
        "step_ms": ms(step_s), "min_ms": min(step_s) * 1e3, "hidden_ms": ms(hidden_s),
        "head_ms": ms(head_s), "prepare_ms": ms(prepare_s),
        "proj_ms": projections_ms(model, dtype), "picked": bool(picked) and all(picked),
        "ops": ops.total, "split": ops.split(),
        "top": top, "weight_bytes": int4 + dense, "linear": runner.linear,
        "threads": torch.get_num_threads()}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default=CONFIGS, help="dtype:quantization, comma-separated")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=64, help="decode steps timed per child")
    ap.add_argument("--rounds", type=int, default=2, help="children per configuration")
    ap.add_argument("--top", action="store_true", help="print each one's commonest operations")
    ap.add_argument("--child", nargs=3, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        return child(*a.child, a.threads, a.steps)
    from pdserve.bench.cluster import machine
    from pdserve.bench.floor import floor_ms, read_bandwidth_gbs

    print(f"{datetime.now():%Y-%m-%d %H:%M}; {machine()}; threads {a.threads}")
    configs = [tuple((c + "::").split(":")[:3]) for c in a.configs.split(",")]
    runs = {c: [] for c in configs}
    bw = []
    for _ in range(a.rounds):
        for dtype, quant, path in configs:
            bw.append(read_bandwidth_gbs(a.threads))
            out = subprocess.run([sys.executable, __file__, "--child", dtype, quant, path,
                                  "--threads", str(a.threads), "--steps", str(a.steps)],
                                 capture_output=True, text=True, check=True)
            runs[dtype, quant, path].append(json.loads(out.stdout.strip().splitlines()[-1]))
    gbs = statistics.median(bw)
    print(f"read bandwidth {gbs:.1f} GB/s (torch.sum, 512 MiB in the weights' pages; "
          f"median of {len(bw)})")
    print(f"{'dtype':>9} {'quant':>12} {'step ms':>7} {'min':>6} {'floor':>6} {'/floor':>6} "
          f"{'proj':>6} {'small':>6} {'head':>5} {'engine':>6} {'ops':>5} "
          f"{'matmul':>6} {'view':>5} {'sync':>4} {'other':>5}")
    for (dtype, quant, path), rs in runs.items():
        quant = f"{quant}:{path}" if path else quant
        med = {k: statistics.median(r[k] for r in rs) for k in
               ("step_ms", "hidden_ms", "head_ms", "weight_bytes")}
        layers_proj = statistics.median(r["proj_ms"][0] for r in rs)
        head_alone = statistics.median(r["proj_ms"][1] for r in rs)
        floor = floor_ms(med["weight_bytes"], gbs)
        best = min(r["min_ms"] for r in rs)
        # a step that picks its tokens runs the head inside the forward
        small = med["hidden_ms"] - layers_proj - (head_alone if rs[-1]["picked"] else 0.0)
        engine = med["step_ms"] - med["hidden_ms"] - med["head_ms"]
        split = rs[-1]["split"]
        print(f"{dtype:>9} {quant:>12} {med['step_ms']:7.2f} {best:6.2f} {floor:6.2f} "
              f"{med['step_ms'] / floor:6.2f} {layers_proj + head_alone:6.2f} {small:6.2f} "
              f"{med['head_ms']:5.2f} {engine:6.2f} {rs[-1]['ops']:5d} {split['matmul']:6d} "
              f"{split['view']:5d} {split['sync']:4d} {split['other']:5d}", flush=True)
        if a.top:
            print("    " + ", ".join(f"{name.split('::')[1]} {n}" for name, n in rs[-1]["top"]))
    print("proj: projections + LM head timed alone; small: layers' forward less their "
          "projections; head: the LM head's call (0 where the native step picks greedy "
          "tokens itself, the head inside the forward); engine: the step less the forward")


if __name__ == "__main__":
    main()
