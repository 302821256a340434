"""A decode step of many sequences, per dtype, and the attention inside it (issue 34: the
rates under load).

1. torch's SDPA at a decode step's shapes (one query token per sequence over its context,
   GQA), per layer: in the input dtype, and through float32 copies rounded back (what
   kernels/attention_decode.py's SDPA path does for bfloat16 and float16 where the native
   kernel does not run; benchmarks/decode_attention_native.py compares the two).
2. The default model's engine in-process (an Engine as a decode node holds it) with
   ``--batch`` sequences of ``--prompt-len`` random tokens, prefilled (all added at once:
   the prefill's seconds and prompt tokens a second are printed too), then ``--steps``
   decode steps timed one by one, for each ``dtype:quantization`` in ``--configs``, each in
   a child process of its own; with ``--profile`` the commonest operations of five steps.

    python benchmarks/decode_batch.py [--batch 16] [--prompt-len 256] [--steps 20]
        [--configs float32:none,bfloat16:none,bfloat16:auto] [--threads 2] [--profile]
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone

CONFIGS = "float32:none,bfloat16:none,bfloat16:auto"


def median_ms(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def sdpa_rows(batch: int, context: int, threads: int) -> list[str]:
    """One line per dtype: SDPA in it and through float32, ms a layer, the model's heads."""
    import torch
    import torch.nn.functional as F

    from pdserve.model.default_model import default_model_dir
    from pdserve.model.loader import load_config

    torch.set_num_threads(threads)
    cfg = load_config(default_model_dir())
    h, kvh, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    gen = torch.Generator().manual_seed(0)
    lines = []
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        q = torch.randn(batch, h, 1, d, generator=gen).to(dtype)
        k, v = (torch.randn(batch, kvh, context, d, generator=gen).to(dtype) for _ in "kv")
        own = median_ms(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True), 30)
        via = median_ms(lambda: F.scaled_dot_product_attention(
            q.float(), k.float(), v.float(), enable_gqa=True).to(dtype), 30)
        name = str(dtype).removeprefix("torch.")
        lines.append(f"SDPA {name:>8}: {own:7.3f} ms a layer in {name}, {via:7.3f} through "
                     f"float32 ({own / via:.2f}x)")
    return lines


def child(dtype: str, quant: str, a) -> None:
    import torch

    from pdserve import LLM, SamplingParams

    torch.set_num_threads(a.threads)
    engine = LLM(dtype=dtype, quantization=quant, kv_cache_memory_gb=0.5).engine
    rng = random.Random(0)
    for i in range(a.batch):
        prompt = [rng.randrange(100, engine.model_config.vocab_size - 100)
                  for _ in range(a.prompt_len)]
        engine.add_request(str(i), prompt, SamplingParams(
            max_tokens=a.steps + 64, temperature=0, ignore_eos=True))
    t0 = time.perf_counter()
    while engine.scheduler.waiting or any(  # prefill every prompt
            s.num_computed_tokens < a.prompt_len for s in engine.scheduler.running):
        engine.step()
    prefill_s = time.perf_counter() - t0
    for _ in range(5):
        engine.step()
    times = []
    for _ in range(a.steps):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    top = ""
    if a.profile:
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(5):
                engine.step()
        top = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=8)
    print(json.dumps({"prefill_s": prefill_s, "median_ms": 1e3 * statistics.median(times),
                      "min_ms": 1e3 * min(times), "top": top}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--configs", default=CONFIGS, help="dtype:quantization, comma-separated")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--child", nargs=2, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(*a.child, a)
        return
    from pdserve.bench.cluster import machine

    print(f"# {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, {machine()}")
    print(f"# {' '.join(sys.argv)}")
    for line in sdpa_rows(a.batch, a.prompt_len + 16, a.threads):
        print(line)
    flags = ["--batch", str(a.batch), "--prompt-len", str(a.prompt_len), "--steps",
             str(a.steps), "--threads", str(a.threads)] + (["--profile"] if a.profile else [])
    for config in a.configs.split(","):
        dtype, quant = config.split(":")
        out = subprocess.run([sys.executable, __file__, "--child", dtype, quant, *flags],
                             capture_output=True, text=True, check=True)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        rate = a.batch * a.prompt_len / r["prefill_s"]
        print(f"{dtype:>9} --quantization {quant:<5} {a.batch} sequences at ~{a.prompt_len} "
              f"tokens: prefill {r['prefill_s']:5.2f} s ({rate:.0f} tokens/s), decode step "
              f"{r['median_ms']:6.1f} ms median, {r['min_ms']:6.1f} min")
        if r["top"]:
            print(r["top"])


if __name__ == "__main__":
    main()
