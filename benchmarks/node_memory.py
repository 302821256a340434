"""A node's memory with the default model (issue 34): RSS, PSS and USS of each process of
``pdserve launch`` (1 prefill + 1 decode, or with --colocated one colocated node) once it
is healthy and again after serving a few requests, for each --dtype/--quantization pair,
one cluster after the other.

    python benchmarks/node_memory.py [--dtype float32 --quantization none]
        [--dtype bfloat16 --quantization auto] [--in-process] [--json OUT] [--compare OLD]

Each --dtype pairs with the --quantization at the same place (default: float32 + none,
then bfloat16 + auto); both go to the nodes as they are. RSS counts the libraries' pages
that every process maps again (libtorch alone is about 400 MiB); PSS shares them out.
--in-process also builds the engine in a child process of its own (``pdserve.LLM``, the
same Engine a node holds) and reads its memory after construction and after generating.
Ratios: each figure against the first pair's; with --compare, against the same figure of
an earlier run's --json (another checkout, say: ``PYTHONPATH`` and the working directory
pick the tree measured).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pdserve.bench.cluster import launched, machine, memory_mib, processes  # noqa: E402

PROMPTS = ["The capital of France is", "Write a haiku about the sea.",
           "List three prime numbers.", "Why is the sky blue?"]
CPU_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_bf16",
             "avx_vnni", "avx_ne_convert")


def cpu() -> str:
    """lscpu's model name and the flags that pick CPU kernels (bfloat16, int4)."""
    model = "?"
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        model = next(line.split(":", 1)[1].strip() for line in out.splitlines()
                     if line.startswith("Model name"))
    except (OSError, StopIteration):
        pass
    flags: set[str] = set()
    for line in open("/proc/cpuinfo"):
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    return f"{model}; flags: {' '.join(f for f in CPU_FLAGS if f in flags) or 'none'}"


def serve(url: str, model: str, tokens: int) -> None:
    import httpx

    for prompt in PROMPTS:
        r = httpx.post(f"{url}/v1/completions", timeout=300, json={
            "model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0,
            "ignore_eos": True})
        r.raise_for_status()


def node_figures(dtype: str, quant: str, a) -> dict[str, dict[str, float]]:
    """{"prefill-0 loaded": {"rss", "pss", "uss"}, ..., "decode-0 served": ...}."""
    extra = ["--kv-cache-memory-gb", str(a.kv_cache_memory_gb)] if a.kv_cache_memory_gb else []
    nodes = ["--colocated"] if a.colocated else ["--prefill", "1", "--decode", "1"]
    args = [*nodes, "--threads", str(a.threads), "--dtype", dtype,
            "--quantization", quant, *extra, *(["--model", a.model] if a.model else [])]
    print(f"pdserve launch {' '.join(args)}", flush=True)
    with launched(*args) as cluster:
        cluster.wait_nodes(1 if a.colocated else 2)
        time.sleep(2.0)  # the start-up's last work (first heartbeats) out of the figures
        pids = processes(cluster.proc.pid)
        import httpx
        model = httpx.get(f"{cluster.http_url}/v1/models").json()["data"][0]["id"]
        loaded = {name: memory_mib(pid) for name, pid in pids.items()}
        serve(cluster.http_url, model, a.tokens)
        served = {name: memory_mib(pid) for name, pid in pids.items()}
    return {f"{name} {when}": m for name in sorted(pids)
            for when, m in (("loaded", loaded[name]), ("served", served[name]))}


def engine_child(dtype: str, quant: str, a) -> None:
    """In this process: an Engine as a node builds it, its memory printed as JSON."""
    from pdserve import LLM, SamplingParams

    extra = {"kv_cache_memory_gb": a.kv_cache_memory_gb} if a.kv_cache_memory_gb else {}
    llm = LLM(a.model, dtype=dtype, quantization=quant, threads=a.threads, **extra)
    out = {"engine loaded": memory_mib(os.getpid())}
    llm.generate(PROMPTS, SamplingParams(max_tokens=a.tokens, temperature=0, ignore_eos=True))
    out["engine served"] = memory_mib(os.getpid())
    print(json.dumps(out))


def engine_figures(dtype: str, quant: str, a) -> dict[str, dict[str, float]]:
    cmd = [sys.executable, __file__, "--engine-child", "--dtype", dtype, "--quantization",
           quant, "--threads", str(a.threads), "--tokens", str(a.tokens),
           *(["--model", a.model] if a.model else []),
           *(["--kv-cache-memory-gb", str(a.kv_cache_memory_gb)]
             if a.kv_cache_memory_gb else [])]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def table(results: dict, old: dict | None) -> None:
    """One row per (pair, process, moment): RSS, PSS, USS, each against the first pair's
    and, with ``old``, against the earlier run's."""
    first = next(iter(results.values()))
    head = f"{'dtype/quantization':20} {'process':18} {'RSS':>7} {'PSS':>7} {'USS':>7} " \
           f"{'RSS/first':>9} {'PSS/first':>9}"
    print(head + (f" {'RSS/old':>8} {'PSS/old':>8}  (old RSS, PSS)" if old else "") + "  MiB")
    for pair, rows in results.items():
        for where, m in rows.items():
            f = first[where]
            line = (f"{pair:20} {where:18} {m['rss']:7.0f} {m['pss']:7.0f} {m['uss']:7.0f} "
                    f"{m['rss'] / f['rss']:9.2f} {m['pss'] / f['pss']:9.2f}")
            o = (old or {}).get(pair, {}).get(where)
            if o:
                line += (f" {m['rss'] / o['rss']:8.2f} {m['pss'] / o['pss']:8.2f}"
                         f"  ({o['rss']:.0f}, {o['pss']:.0f})")
            print(line)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", action="append", help="--dtype of the nodes (repeatable)")
    ap.add_argument("--quantization", action="append",
                    help="--quantization of the nodes, paired with --dtype (repeatable)")
    ap.add_argument("--model", help="default: the bundled SmolLM2-135M-Instruct Q4_1 GGUF")
    ap.add_argument("--threads", type=int, default=1, help="torch threads a node")
    ap.add_argument("--tokens", type=int, default=32, help="max_tokens of each request")
    ap.add_argument("--kv-cache-memory-gb", type=float, help="default: the nodes' own")
    ap.add_argument("--colocated", action="store_true",
                    help="one colocated node (launch's default on 2 cores) instead of 1P1D")
    ap.add_argument("--in-process", action="store_true",
                    help="also the Engine alone, in a child process")
    ap.add_argument("--no-nodes", action="store_true", help="only --in-process")
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--compare", help="an earlier run's --json: ratios against it")
    ap.add_argument("--engine-child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    dtypes = a.dtype or ["float32", "bfloat16"]
    quants = a.quantization or ["none", "auto"][:len(dtypes)]
    if len(dtypes) != len(quants):
        ap.error(f"{len(dtypes)} --dtype against {len(quants)} --quantization: pair them")
    if a.engine_child:
        return engine_child(dtypes[0], quants[0], a)
    print(f"# {datetime.now():%Y-%m-%d %H:%M}; {machine()}")
    print(f"# {cpu()}")
    import pdserve
    print(f"# python {' '.join(sys.argv)}; pdserve from {Path(pdserve.__file__).parent}")
    results = {}
    for dtype, quant in zip(dtypes, quants):
        figures = {} if a.no_nodes else node_figures(dtype, quant, a)
        if a.in_process:
            figures |= engine_figures(dtype, quant, a)
        results[f"{dtype}/{quant}"] = figures
    old = json.loads(Path(a.compare).read_text()) if a.compare else None
    table(results, old)
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
