"""Batch-1 TPOT through ``pdserve launch`` against the decode node's own step time: where
a token's time goes outside the forward (issue 34, item 4, launch path).

Starts ``pdserve launch ARGS`` (1P1D by default), sends one short request to warm it up,
then one streamed completion at a time (``--input-len`` random token ids, ``--output-len``
tokens, EOS ignored, greedy), and prints per stream: the median gap between the client's
SSE events (TPOT), the decode node's mean step over the same window (its
pdserve_decode_step_seconds histogram), their difference, and the CPU seconds each process
of the cluster used while streaming.

    python benchmarks/launch_tpot.py [--args "--dtype float32"] [--streams 3]
        [--input-len 128] [--output-len 128] [--spy ROLE --spy-out FILE]

The node timed is the one that decodes: decode-0, or colocated-0 where launch (``--args
""`` on a machine of few cores) starts one colocated node. ``--spy decode-0`` (or router,
prefill-0, colocated-0) records that process with py-spy (--native, --threads, raw folded
stacks) during the last stream.
"""
from __future__ import annotations

import argparse
import json
import random
import shlex
import statistics
import subprocess
import time

import httpx

from pdserve.bench.cluster import launched, metric_totals, processes

STEP = ("pdserve_decode_step_seconds_sum", "pdserve_decode_step_seconds_count")


def stream(url: str, prompt: list[int], n: int) -> list[float]:
    """Arrival time of each SSE event that carries text."""
    model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
    body = {"model": model, "prompt": prompt, "max_tokens": n, "ignore_eos": True,
            "temperature": 0, "stream": True}
    times = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                if json.loads(line[6:])["choices"]:
                    times.append(time.perf_counter())
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--args", default="--dtype float32", help="pdserve launch's arguments")
    p.add_argument("--streams", type=int, default=3)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--spy", default="", help="process to record with py-spy (decode-0...)")
    p.add_argument("--spy-out", default="/tmp/launch_tpot.spy.txt")
    p.add_argument("--spy-rate", type=int, default=200, help="py-spy's samples a second")
    a = p.parse_args()
    rng = random.Random(1)
    with launched(*shlex.split(a.args)) as cluster:
        urls = cluster.metrics_urls()
        nodes = [name for name in urls if name != "router"]
        cluster.wait_nodes(len(nodes))
        decode_metrics = urls["decode-0" if "decode-0" in urls else "colocated-0"]
        pids = processes(cluster.proc.pid)
        stream(cluster.http_url, [rng.randrange(1000, 20000) for _ in range(16)], 8)
        for i in range(a.streams):
            prompt = [rng.randrange(1000, 20000) for _ in range(a.input_len)]
            spy = None
            if a.spy and i == a.streams - 1:
                # (--native on the router slowed its stream to 9.0 ms a token at 1,000
                # samples a second, against 5.0 without native frames, 3.7 unrecorded)
                native = ["--native"] if a.spy != "router" else []
                spy = subprocess.Popen(["py-spy", "record", *native, "--threads", "-r",
                                        str(a.spy_rate), "--format", "raw", "-o", a.spy_out, "-p",
                                        str(pids[a.spy])], stdout=subprocess.DEVNULL,
                                       stderr=subprocess.DEVNULL)
                time.sleep(1.0)
            cpu0, step0 = cluster.cpu_seconds(), metric_totals(decode_metrics, STEP)
            cpu0["client"] = time.process_time()  # this process: the streaming client
            times = stream(cluster.http_url, prompt, a.output_len)
            cpu1, step1 = cluster.cpu_seconds(), metric_totals(decode_metrics, STEP)
            cpu1["client"] = time.process_time()
            if spy is not None:
                spy.send_signal(2)
                spy.wait(timeout=60)
            gaps = [b - t for t, b in zip(times[1:], times[2:])]
            tpot = statistics.median(gaps) * 1e3
            steps = step1[STEP[1]] - step0[STEP[1]]
            step_ms = (step1[STEP[0]] - step0[STEP[0]]) / max(steps, 1) * 1e3
            wall = times[-1] - times[0]
            cpu = {k: round((cpu1[k] - cpu0.get(k, 0.0)) / wall, 2) for k in cpu1}
            print(json.dumps({"args": a.args, "tpot_ms": round(tpot, 2),
                              "mean_gap_ms": round(statistics.mean(gaps) * 1e3, 2),
                              "step_ms": round(step_ms, 2), "outside_ms": round(
                                  tpot - step_ms, 2), "steps": steps, "events": len(times),
                              "cpu_per_wall_s": cpu}), flush=True)


if __name__ == "__main__":
    main()
