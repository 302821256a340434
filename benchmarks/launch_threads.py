"""Threads of nodes that share a machine: which default serves best on few cores.

``pdserve launch`` 1P1D with the bundled model, four ways side by side in one run:

- split: each node ``--threads cores/2`` (launch's default before 2026-12-05);
- shared, spinning: each node every core, ``OMP_WAIT_POLICY=ACTIVE`` (OpenMP threads
  spin between parallel regions, also in the node that has nothing to do);
- shared, passive: each node every core, ``OMP_WAIT_POLICY=PASSIVE`` (launch's default
  now: idle threads sleep);
- decode first: shared, passive, and the prefill nodes reniced to 10 once started, so
  that a decode step takes the cores ahead of a prefill;
- colocated: one node that prefills and decodes, every core.

Each is driven by ``pdserve bench``: one request at a time (``--b1-prompts`` of 128
random tokens, 64 out: TPOT and TTFT medians), then 16 at once (32 prompts of 256, 64 out:
output tokens/s). EOS ignored, greedy.

    python benchmarks/launch_threads.py [--ways split,passive,...] [--rounds 1]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from datetime import datetime, timezone

from pdserve.bench.cluster import launched, machine

CORES = os.cpu_count() or 1
WAYS = {
    "split": (["--threads", str(max(1, CORES // 2))], {}),
    "spinning": (["--threads", str(CORES)], {"OMP_WAIT_POLICY": "ACTIVE"}),
    "passive": ([], {"OMP_WAIT_POLICY": "PASSIVE"}),
    "decode-first": ([], {"OMP_WAIT_POLICY": "PASSIVE"}),
    "colocated": (["--colocated"], {}),
}


def bench(url: str, n: int, concurrency: int, input_len: int, output_len: int) -> dict:
    host, port = url.rsplit("//", 1)[1].split(":")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "r.json")
        subprocess.run([sys.executable, "-m", "pdserve.cli", "bench", "--host", host, "--port",
                        port, "--dataset-name", "random", "--random-input-len", str(input_len),
                        "--random-output-len", str(output_len), "--num-prompts", str(n),
                        "--max-concurrency", str(concurrency), "--ignore-eos",
                        "--disable-tqdm", "--seed", "1", "--save-result", out],
                       check=True, stdout=subprocess.DEVNULL, timeout=1800)
        with open(out) as f:
            return json.load(f)


def renice_prefill(pgid: int) -> None:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from tests.cluster import node_pids  # the checkout's tests/

    for node_id, pid in node_pids(pgid).items():
        if node_id.startswith("prefill-"):
            for task in os.listdir(f"/proc/{pid}/task"):   # every thread of it
                os.setpriority(os.PRIO_PROCESS, int(task), 10)


def run(way: str, b1_prompts: int) -> dict:
    args, env = WAYS[way]
    saved = dict(os.environ)
    os.environ.pop("OMP_WAIT_POLICY", None)
    os.environ.update(env)   # the nodes inherit it through launch
    try:
        with launched(*args, ready_timeout_s=600) as cluster:
            if way == "decode-first":
                renice_prefill(cluster.proc.pid)
            one = bench(cluster.http_url, b1_prompts, 1, 128, 64)
            many = bench(cluster.http_url, 32, 16, 256, 64)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return {"way": way, "b1_tpot_ms": round(one["median_tpot_ms"], 1),
            "b1_ttft_ms": round(one["median_ttft_ms"], 1),
            "c16_out_tok_s": round(many["output_throughput"], 1),
            "c16_tpot_ms": round(many["median_tpot_ms"], 1),
            "c16_ttft_ms": round(many["median_ttft_ms"], 1)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ways", default=",".join(WAYS))
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--b1-prompts", type=int, default=6)
    a = ap.parse_args()
    ways = a.ways.split(",")
    unknown = [w for w in ways if w not in WAYS]
    if unknown:
        ap.error(f"unknown ways {unknown}; choose from {', '.join(WAYS)}")
    print(f"# {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, {machine()}")
    for r in range(a.rounds):
        for way in ways:
            print(json.dumps({"round": r, **run(way, a.b1_prompts)}), flush=True)


if __name__ == "__main__":
    main()
