"""The default model's LM head kept Q8_0 (model/q8_head.py, kernels/native/q8_gemm.c)
against today's bfloat16 heads over the dequantized weight, side by side in one process.

SmolLM2-135M-Instruct's tied head (49,152 x 576) from the bundled GGUF: "q8" runs the native
kernel over the stored blocks; "torch" is ``LlamaForCausalLM.compute_logits`` over the
bfloat16 weight (``--cpu-linear torch``: MKL in blocks of 1,024 vocabulary rows); "onednn"
the same weight reordered for oneDNN (``--cpu-linear auto`` on this CPU: what a bfloat16
node runs today). Rounds alternate the three at each row count; each figure is the median
over rounds of a round's median call. Also: the bytes each holds, and the error of each
against the float64 GEMM over the exact weight, on random normal hidden states.

The Q8_0 weight (28.7 MiB) fits a 32 MiB L3 and the bfloat16 one (54 MiB) does not: called
back to back, the Q8_0 head reads from L3. In a decode step the layers' weights pass
through the cache in between; ``--cold`` reads 128 MiB (untimed) before each call to time
that case.

    python benchmarks/q8_head.py [--rows 1,4,16,64] [--rounds 7] [--calls 20] [--threads 2]
        [--cold]
"""
from __future__ import annotations

import argparse
import statistics
import time
import types

import torch
from torch import nn


def heads(path) -> tuple[dict, dict, torch.Tensor]:
    """({name: hidden → float32 logits}, {name: bytes held}, the exact float32 weight)."""
    from pdserve.model.cpu_linear import OneDNNLinear, onednn_runs
    from pdserve.model.llama import LlamaForCausalLM
    from pdserve.model.loader import load_model
    from pdserve.model.q8_head import Q8Head

    model = load_model(path, "bfloat16", quantization="auto")
    head = model.lm_head
    if not isinstance(head, Q8Head):
        raise SystemExit("the model did not load with a Q8_0 head (native kernels unavailable?)")
    exact = head.table.dequantized()                                    # [V, H] float32
    dense = nn.Linear(exact.shape[1], exact.shape[0], bias=False, device="meta")
    dense.weight = nn.Parameter(exact.to(torch.bfloat16), requires_grad=False)
    plain = types.SimpleNamespace(lm_head=dense)
    fns = {"q8": head, "torch": lambda h: LlamaForCausalLM.compute_logits(plain, h)}
    size = dense.weight.nbytes
    held = {"q8": head.table.nbytes, "torch": size}
    if onednn_runs(torch.bfloat16):
        reordered = OneDNNLinear(dense)
        fns["onednn"] = lambda h: reordered(h).float()
        held["onednn"] = size + reordered.packed.nbytes  # the lookup keeps the embedding
    return fns, held, exact


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,4,16,64")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=20, help="timed calls per round")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cold", action="store_true", help="evict the caches before each call")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from pdserve.model.default_model import default_model_dir

    fns, held, exact = heads(default_model_dir())
    rows = [int(r) for r in a.rows.split(",")]
    gen = torch.Generator().manual_seed(0)
    inputs = {m: torch.randn(m, exact.shape[1], generator=gen).to(torch.bfloat16) for m in rows}
    times = {(m, name): [] for m in rows for name in fns}
    evict = torch.ones(32 * 2**20) if a.cold else None                  # 128 MiB
    with torch.inference_mode():
        for fn in fns.values():          # warm: the library's build, oneDNN's primitives
            for x in inputs.values():
                fn(x)
        for _ in range(a.rounds):
            for m, x in inputs.items():
                for name, fn in fns.items():
                    calls = []
                    for _ in range(a.calls):
                        if evict is not None:
                            evict.sum()
                        t0 = time.perf_counter()
                        fn(x)
                        calls.append(time.perf_counter() - t0)
                    times[m, name].append(statistics.median(calls))
        errors = {}
        for name, fn in fns.items():
            x = inputs[max(rows)]
            ref = x.double() @ exact.double().T
            errors[name] = ((fn(x).double() - ref).norm() / ref.norm()).item()
    names = list(fns)
    print(f"LM head {exact.shape[0]} x {exact.shape[1]}, bfloat16 hidden states, "
          f"{torch.get_num_threads()} threads, {a.rounds} rounds x {a.calls} calls"
          f"{', caches evicted before each call' if a.cold else ''}")
    print("| rows | " + " | ".join(f"{n} ms" for n in names) + " | "
          + " | ".join(f"q8 / {n}" for n in names[1:]) + " |")
    print("|---" * (2 * len(names)) + "|")
    for m in rows:
        ms = {n: statistics.median(times[m, n]) * 1e3 for n in names}
        print(f"| {m} | " + " | ".join(f"{ms[n]:.3f}" for n in names) + " | "
              + " | ".join(f"{ms['q8'] / ms[n]:.2f}" for n in names[1:]) + " |")
    print("bytes held: " + ", ".join(f"{n} {held[n] / 2**20:.1f} MiB" for n in names))
    print(f"relative error against float64 over the exact weight ({max(rows)} random rows): "
          + ", ".join(f"{n} {errors[n]:.2e}" for n in names))


if __name__ == "__main__":
    main()
