"""A fleet of simulated nodes on this machine: does it start, serve, and stay light?

``pdserve launch --compute simulated`` with P prefill and D decode nodes (a shipped
profile, --sim-kv-bytes-scale 1/128: one element per KV head), then: the time until
/health is 200; each node's memory (VmRSS, and PSS/USS from smaps_rollup: RSS counts the
shared libtorch pages of every process again); the nodes' CPU use while idle (does any
spin?) and while serving a burst of requests (streamed, concurrency C, max_tokens T,
prompts of L token ids, distinct); and how many of the requests succeeded.

    python benchmarks/sim_fleet.py [--prefill 8] [--decode 8] [--profile h100-llama3-8b]
        [--requests 256] [--concurrency 64] [--tokens 16] [--prompt-len 256]
        [--no-fork-nodes]

launch forks simulated nodes from one process that has imported torch (they share its
pages); --no-fork-nodes starts each as its own program, as before (to compare).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
import threading
import time
from datetime import datetime, timezone

import httpx

from pdserve.bench.cluster import launched, machine, memory_mib, processes


def cpu_s(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def burst(url: str, model: str, n: int, concurrency: int, tokens: int,
                prompt_len: int, errors: dict[str, int]) -> tuple[int, float]:
    sem = asyncio.Semaphore(concurrency)
    ok = 0

    async def one(client, i):
        nonlocal ok
        body = {"model": model, "max_tokens": tokens, "ignore_eos": True,
                "prompt": [1000 + (i * 7919 + k * 31) % 40000 for k in range(prompt_len)]}
        async with sem:
            try:
                r = await client.post(f"{url}/v1/completions", json=body, timeout=300)
            except httpx.TransportError as exc:   # counted as failed, by kind
                errors[type(exc).__name__] = errors.get(type(exc).__name__, 0) + 1
                return
            if r.status_code == 200 and r.json()["usage"]["completion_tokens"] == tokens:
                ok += 1
    start = time.perf_counter()
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=concurrency)) as client:
        await asyncio.gather(*(one(client, i) for i in range(n)))
    return ok, time.perf_counter() - start


def mem_available_mib() -> float:
    for line in open("/proc/meminfo"):
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 1024
    return float("inf")


def guard(pgid: int, floor_mib: float, tripped: list) -> None:
    """Kills the whole cluster (its process group) if the machine's free memory falls
    under ``floor_mib``: a shared machine's other processes must not meet the OOM killer."""
    while True:
        free = mem_available_mib()
        if free < floor_mib:
            tripped.append(free)
            print(f"sim_fleet: MemAvailable {free:.0f} MiB < {floor_mib:.0f}: killing the "
                  "cluster", file=sys.stderr, flush=True)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
            return
        time.sleep(0.25)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prefill", type=int, default=8)
    ap.add_argument("--decode", type=int, default=8)
    ap.add_argument("--profile", default="h100-llama3-8b")
    ap.add_argument("--kv-scale", default="0.0078125")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--idle-s", type=float, default=10.0)
    ap.add_argument("--no-fork-nodes", action="store_true",
                    help="Each node its own program (pdserve launch --no-fork-nodes).")
    ap.add_argument("--min-free-mib", type=float, default=3000.0,
                    help="Kill the cluster if the machine's MemAvailable falls below.")
    a = ap.parse_args()
    print(f"# {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, {machine()}")
    t0 = time.perf_counter()
    with launched("--prefill", str(a.prefill), "--decode", str(a.decode), "--compute",
                  "simulated", "--sim-profile", a.profile, "--sim-kv-bytes-scale",
                  a.kv_scale, "--threads", "1",
                  *(["--no-fork-nodes"] if a.no_fork_nodes else []),
                  ready_timeout_s=900) as cluster:
        tripped: list = []
        threading.Thread(target=guard, args=(cluster.proc.pid, a.min_free_mib, tripped),
                         daemon=True).start()
        cluster.wait_nodes(a.prefill + a.decode)
        ready = time.perf_counter() - t0
        pids = processes(cluster.proc.pid)
        nodes = {k: v for k, v in pids.items() if k != "router"}
        model = httpx.get(f"{cluster.http_url}/v1/models").json()["data"][0]["id"]
        time.sleep(2.0)   # start-up work (imports, first heartbeats) out of the idle window
        before = {k: cpu_s(p) for k, p in pids.items()}
        time.sleep(a.idle_s)
        idle = {k: cpu_s(p) - before[k] for k, p in pids.items()}
        before = {k: cpu_s(p) for k, p in pids.items()}
        errors: dict[str, int] = {}
        ok, wall = asyncio.run(burst(cluster.http_url, model, a.requests, a.concurrency,
                                     a.tokens, a.prompt_len, errors))
        busy = {k: cpu_s(p) - before[k] for k, p in pids.items()}
        mem = {k: memory_mib(p) for k, p in pids.items()}
        low = mem_available_mib()
        if tripped:
            raise SystemExit(f"stopped: MemAvailable fell to {tripped[0]:.0f} MiB")
    node_mem = [mem[k] for k in nodes]
    report = {
        "nodes": f"{a.prefill}P{a.decode}D", "forked": not a.no_fork_nodes,
        "profile": a.profile, "ready_s": round(ready, 1),
        "requests_ok": f"{ok}/{a.requests}", "transport_errors": errors, "burst_s": round(wall, 2),
        "node_rss_mib_mean": round(sum(m["rss"] for m in node_mem) / len(node_mem), 1),
        "node_pss_mib_mean": round(sum(m["pss"] for m in node_mem) / len(node_mem), 1),
        "node_uss_mib_mean": round(sum(m["uss"] for m in node_mem) / len(node_mem), 1),
        "nodes_pss_mib_total": round(sum(m["pss"] for m in node_mem)),
        "nodes_uss_mib_total": round(sum(m["uss"] for m in node_mem)),
        "router_rss_mib": round(mem["router"]["rss"], 1),
        "node_idle_cpu_pct_mean": round(100 * sum(idle[k] for k in nodes)
                                        / len(nodes) / a.idle_s, 2),
        "node_idle_cpu_pct_max": round(100 * max(idle[k] for k in nodes) / a.idle_s, 2),
        "router_idle_cpu_pct": round(100 * idle["router"] / a.idle_s, 2),
        "nodes_busy_cpu_s": round(sum(busy[k] for k in nodes), 2),
        "router_busy_cpu_s": round(busy["router"], 2),
        "machine_mem_available_mib_at_end": round(low),
    }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
