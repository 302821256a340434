"""Routing at fleet scale on simulated GPUs: goodput under an SLO, router CPU per request
and the prefix-cache hit rate of each policy, and what a quarter of the nodes dying at
once does.

For each policy, ``pdserve launch --compute simulated`` with P prefill and D decode nodes
and R routers (``--routers``, 1-4: static discovery, every node serving each router), then
one ``pdserve bench`` per router, all at once, each with 1/R of the prompts and of the
concurrency and its own seed (its own conversations), their results merged
(report.merge_results). Workloads (``--workload``): ``random`` prompts sharing a prefix of
``--prefix-len`` tokens, or ``multi-turn`` conversations (``--turns`` turns, a system
prompt of ``--system-len`` tokens shared by ``--shared-system`` conversations, user
messages of ``--user-len``; each turn resends the history, so a policy that sends a
conversation back to the prefill node holding it gets prefix hits). Every request is
``ignore_eos`` with ``--output-len`` tokens. A request is good when its TTFT and the 99th
percentile of its own inter-token gaps are within the SLO; goodput is good requests per
second (pdserve.bench.metrics.goodput). Router CPU is user + system time of every router
process over the run, less their idle rate (measured over ``--idle-s`` before) times the
run's wall time, per completed request. The hit rate is the prefill nodes' prefix-cache
hits over lookups (tokens). With ``--kill-quarter`` a second run per policy SIGKILLs a
quarter of the prefill and of the decode nodes, by PID, ``--kill-after`` seconds after
the first prompt reaches a prefill node, and counts what completed.

    python benchmarks/scale.py [--prefill 8] [--decode 8] [--routers 1]
        [--profile h100-llama3-8b] [--policies round_robin,least_loaded,cache_aware]
        [--workload random|multi-turn] [--num-prompts 512] [--concurrency 64]
        [--input-len 512] [--prefix-len 384]                       (random)
        [--turns 4] [--system-len 256] [--user-len 128] [--shared-system 1]  (multi-turn)
        [--output-len 64] [--slo-ttft-ms 1000] [--slo-itl-ms 100] [--kill-quarter]

At concurrency 4,096 on 2 shared cores the routers refuse some requests with HTTP 429
(their overload guard: the event loop starved for 2 s); ``errors`` in the output counts
each failure's kind (benchmarks/RESULTS.md).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from datetime import datetime, timezone

from pdserve.bench.cluster import launched, machine, metric_totals, processes
from pdserve.bench.metrics import goodput
from pdserve.bench.report import merge_results

HITS = ("pdserve_prefix_cache_queries_tokens_total", "pdserve_prefix_cache_hits_tokens_total")


def workload_args(a) -> list[str]:
    if a.workload == "random":
        return ["--dataset-name", "random", "--random-input-len", str(a.input_len),
                "--random-prefix-len", str(a.prefix_len)]
    return ["--dataset-name", "multi-turn", "--multi-turn-turns", str(a.turns),
            "--multi-turn-system-len", str(a.system_len), "--multi-turn-user-len",
            str(a.user_len), "--multi-turn-shared-system", str(a.shared_system)]


def bench(urls: list[str], a, tmp: str) -> dict:
    """One ``pdserve bench`` per router URL, all at once, each with its share of the
    prompts and of the concurrency and a seed of its own; their results merged."""
    procs, outs = [], []
    for i, url in enumerate(urls):
        host, port = url.rsplit("//", 1)[1].split(":")
        out = os.path.join(tmp, f"r{i}.json")
        share = len(range(i, a.num_prompts, len(urls)))
        cmd = [sys.executable, "-m", "pdserve.cli", "bench", "--host", host, "--port", port,
               *workload_args(a), "--random-output-len", str(a.output_len), "--num-prompts",
               str(share), "--max-concurrency", str(max(1, a.concurrency // len(urls))),
               "--ignore-eos", "--disable-tqdm", "--seed", str(i),
               "--ready-check-timeout-sec", "0", "--save-result", out]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL))
        outs.append(out)
    for p in procs:
        if p.wait(timeout=1800) != 0:
            raise RuntimeError(f"pdserve bench exited with {p.returncode}: {p.args}")
    results = []
    for out in outs:
        with open(out) as f:
            results.append(json.load(f))
    return results[0] if len(results) == 1 else merge_results(results)


def prefix_totals(urls: dict[str, str]) -> tuple[float, float]:
    q = h = 0.0
    for name, url in urls.items():
        if name.startswith("prefill-"):
            m = scrape(name, url)
            q, h = q + m[HITS[0]], h + m[HITS[1]]
    return q, h


def scrape(name: str, url: str, tries: int = 5) -> dict[str, float]:
    """A node's counters; a refused connection is retried (seen once in a few runs on
    this loaded machine, cause not found), then named."""
    for i in range(tries):
        try:
            return metric_totals(url, HITS)
        except OSError as exc:
            if i == tries - 1:
                raise RuntimeError(f"{name}'s /metrics at {url}: {exc}") from exc
            time.sleep(0.5)
    raise AssertionError("unreachable")


def error_kinds(result: dict) -> dict[str, int]:
    """How many failed requests ended with each error (its first 100 characters)."""
    return dict(Counter(e[:100] for e in result.get("errors") or [] if e))


def run(a, policy: str, kill: bool) -> dict:
    with launched("--prefill", str(a.prefill), "--decode", str(a.decode), "--routers",
                  str(a.routers), "--compute", "simulated", "--sim-profile", a.profile,
                  "--sim-kv-bytes-scale", a.kv_scale, "--policy", policy,
                  "--heartbeat-interval", "0.5", ready_timeout_s=900) as cluster:
        cluster.wait_nodes(a.prefill + a.decode)
        pids = processes(cluster.proc.pid)
        urls = cluster.metrics_urls()  # launch is ready: every node is on every router
        routers = [cluster.http_url] + [urls[f"router-{i}"].removesuffix("/metrics")
                                        for i in range(1, a.routers)]
        # The routers' idle CPU (heartbeats, metrics), measured here and taken off the
        # run's: each client takes seconds to start on a loaded machine, and that wait
        # would otherwise count against the requests of a short run.
        idle0, t_idle = cluster.cpu_seconds()["router"], time.monotonic()
        time.sleep(a.idle_s)
        cpu0, t0 = cluster.cpu_seconds()["router"], time.monotonic()
        idle_rate = (cpu0 - idle0) / (t0 - t_idle)
        q0, h0 = prefix_totals(urls)
        killed: list[str] = []
        if kill:
            victims = [f"prefill-{i}" for i in range(a.prefill // 4)] + \
                [f"decode-{i}" for i in range(a.decode // 4)]

            def killer():
                # from the first prompt a prefill node sees, not from the clients' start:
                # they take seconds to start on a loaded machine
                while prefix_totals(urls)[0] == q0:
                    time.sleep(0.1)
                time.sleep(a.kill_after)
                for name in victims:
                    os.kill(pids[name], signal.SIGKILL)
                    killed.append(name)
            threading.Thread(target=killer, daemon=True).start()
        with tempfile.TemporaryDirectory() as tmp:
            result = bench(routers, a, tmp)
        # every router's, summed, less what they would have used idle meanwhile
        router_cpu = cluster.cpu_seconds()["router"] - cpu0 - \
            idle_rate * (time.monotonic() - t0)
        # a killed node's counters are gone with it: the hit rate is of runs without kills
        q1, h1 = (q0, h0) if kill else prefix_totals(urls)
    done = result["completed"]
    return {"policy": policy, "killed": len(killed), "completed": done,
            "failed": result["failed"], "errors": error_kinds(result),
            "duration_s": round(result["duration"], 2),
            "goodput_req_s": round(goodput(result, a.slo_ttft_ms / 1e3, a.slo_itl_ms / 1e3),
                                   2),
            "p99_ttft_ms": round(result.get("p99_ttft_ms") or 0, 1),
            "p99_itl_ms": round(result.get("p99_itl_ms") or 0, 1),
            "router_cpu_ms_per_req": round(1e3 * router_cpu / max(1, done), 3),
            "routers_idle_cpu_pct": round(100 * idle_rate, 2),
            "prefix_hit_rate": None if kill else round((h1 - h0) / max(1.0, q1 - q0), 3)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prefill", type=int, default=8)
    ap.add_argument("--decode", type=int, default=8)
    ap.add_argument("--routers", type=int, default=1, choices=range(1, 5), metavar="1-4")
    ap.add_argument("--profile", default="h100-llama3-8b")
    ap.add_argument("--kv-scale", default="0.0078125")
    ap.add_argument("--policies", default="round_robin,least_loaded,cache_aware")
    ap.add_argument("--num-prompts", type=int, default=512)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--workload", choices=("random", "multi-turn"), default="random")
    ap.add_argument("--input-len", type=int, default=512, help="random")
    ap.add_argument("--prefix-len", type=int, default=384, help="random")
    ap.add_argument("--turns", type=int, default=4, help="multi-turn")
    ap.add_argument("--system-len", type=int, default=256, help="multi-turn")
    ap.add_argument("--user-len", type=int, default=128, help="multi-turn")
    ap.add_argument("--shared-system", type=int, default=1, help="multi-turn")
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    ap.add_argument("--slo-itl-ms", type=float, default=100.0)
    ap.add_argument("--idle-s", type=float, default=3.0,
                    help="seconds of the routers' idle CPU measured, to take off the run's")
    ap.add_argument("--kill-quarter", action="store_true")
    ap.add_argument("--kill-after", type=float, default=3.0)
    a = ap.parse_args()
    print(f"# {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, {machine()}")
    load = f"prompts of {a.input_len} tokens ({a.prefix_len} shared)" \
        if a.workload == "random" else \
        (f"multi-turn turns: {a.turns} a conversation, system prompt {a.system_len} (one "
         f"per {a.shared_system}), user messages {a.user_len}")
    print(f"# {a.prefill}P{a.decode}D, {a.routers} router(s), {a.profile}, {a.num_prompts} "
          f"{load}, {a.output_len} out, concurrency {a.concurrency}, SLO TTFT "
          f"{a.slo_ttft_ms:g} ms, ITL p99 {a.slo_itl_ms:g} ms")
    for policy in a.policies.split(","):
        for kill in (False, True) if a.kill_quarter else (False,):
            print(json.dumps(run(a, policy, kill)), flush=True)


if __name__ == "__main__":
    main()
