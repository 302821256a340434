"""Batch-1 decode with the default model's weights dequantized against held as stored:
TPOT and the process's RSS per (dtype, --quantization), and the memory floor.

Each configuration runs in a child process of its own (its RSS is its own), in rounds,
the configurations alternating; medians over rounds. A child loads the engine in-process
(pdserve.LLM, the default model, SmolLM2-135M-Instruct Q4_1), warms up, then times
greedy generation of 1 and of 1 + N tokens from one short prompt (ignore_eos): TPOT is
the difference over N. RSS: VmRSS after the runs (the GGUF file's mapped pages it read
count too; the KV cache is held to 64 MiB), and the bare interpreter with torch imported.

The floor: the weight bytes a decode step reads over a read bandwidth measured here in
the same run (torch.sum over 512 MiB, same threads).

    python benchmarks/quant_decode.py [--threads 1,2] [--rounds 2] [--tokens 64]
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from datetime import datetime

CONFIGS = [("float32", "none"), ("float32", "auto"), ("bfloat16", "none"),
           ("bfloat16", "auto")]
KV_GB = 1 / 16
PROMPT = "The history of the printing press begins"


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def child(dtype: str, quant: str, threads: int, tokens: int) -> None:
    import torch

    from pdserve import LLM, SamplingParams
    from pdserve.bench.floor import step_weight_bytes

    bare = rss_mib()
    # A small KV cache, so that the RSS is mostly the weights (the default takes 512 MiB)
    llm = LLM(dtype=dtype, quantization=quant, threads=threads, kv_cache_memory_gb=KV_GB)
    loaded = rss_mib()
    int4, dense = step_weight_bytes(llm.engine.model, getattr(torch, dtype))

    def run(n):
        params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
        t0 = time.perf_counter()
        llm.generate([PROMPT], params)
        return time.perf_counter() - t0

    run(4)
    one, many = [], []
    for _ in range(3):
        one.append(run(1))
        many.append(run(1 + tokens))
    tpot = (statistics.median(many) - statistics.median(one)) / tokens
    print(json.dumps({"tpot_ms": tpot * 1e3, "rss_bare": bare, "rss_loaded": loaded,
                      "rss_end": rss_mib(), "int4_bytes": int4, "dense_bytes": dense,
                      "threads": torch.get_num_threads()}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--child", nargs=2, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        return child(*a.child, int(a.threads), a.tokens)
    from pdserve.bench.cluster import machine
    from pdserve.bench.floor import floor_ms, read_bandwidth_gbs

    print(f"{datetime.now():%Y-%m-%d %H:%M}; {machine()}")
    for threads in [int(t) for t in a.threads.split(",")]:
        results = {c: [] for c in CONFIGS}
        bw = []
        for _ in range(a.rounds):
            bw.append(read_bandwidth_gbs(threads))
            for dtype, quant in CONFIGS:
                out = subprocess.run(
                    [sys.executable, __file__, "--child", dtype, quant, "--threads",
                     str(threads), "--tokens", str(a.tokens)],
                    capture_output=True, text=True, check=True)
                results[dtype, quant].append(json.loads(out.stdout.strip().splitlines()[-1]))
        gbs = statistics.median(bw)
        print(f"\nthreads {threads}; read bandwidth {gbs:.1f} GB/s (torch.sum, 512 MiB in "
              "the weights' pages)")
        print(f"{'dtype':>9} {'quant':>5} {'TPOT ms':>8} {'ratio':>6} {'RSS MiB':>8} "
              f"{'(bare)':>7} {'weights MB':>10} {'floor ms':>8} {'TPOT/floor':>10}")
        base = None
        for (dtype, quant), runs in results.items():
            med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
            weights = med["int4_bytes"] + med["dense_bytes"]
            floor = floor_ms(weights, gbs)
            base = base or med["tpot_ms"]
            print(f"{dtype:>9} {quant:>5} {med['tpot_ms']:8.1f} {med['tpot_ms'] / base:6.2f} "
                  f"{med['rss_end']:8.0f} {med['rss_bare']:7.0f} {weights / 1e6:10.0f} "
                  f"{floor:8.1f} {med['tpot_ms'] / floor:10.2f}", flush=True)


if __name__ == "__main__":
    main()
