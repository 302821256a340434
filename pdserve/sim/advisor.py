"""The P:D advisor of ``pdserve plan``: it runs the workload against simulated clusters of
each ratio (and node count) asked for, side by side, and recommends the one with the most
goodput.

Each trial is ``pdserve launch --compute simulated`` with P prefill and D decode nodes on
the profile, driven by ``pdserve bench`` at the offered request rate (Poisson arrivals)
until every request is answered. A request is good when its TTFT and the 99th percentile
of its own inter-token gaps are within the SLO (pdserve/bench/metrics.py: goodput).
Because the load is offered open-loop at the rate asked for, a ratio whose prefill nodes
cannot keep up queues the requests, and the queue wait shows in the TTFTs measured at the
client: the advisor sees it without modelling it. ``queue_ms`` is the median TTFT beyond
the roofline's prefill of one prompt: queue wait, plus the cluster's own few milliseconds.

The recommendation: the smallest node count tried at which some ratio serves at least
``target`` of the requests within the SLO; at that count, the ratio with the most goodput.
If no count reaches it, the trial with the most goodput, and the advice says so. (The
share of good requests, not goodput over the offered rate: a run lasts past its last
arrival by the last requests' latency, so goodput stays under the rate offered even when
every request is good.)
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass

from pdserve.bench.cluster import launched
from pdserve.bench.metrics import goodput, stat_ms
from pdserve.sim import roofline as R
from pdserve.sim.profile import Profile

WORKLOADS = ("random", "multi-turn")


@dataclass(frozen=True)
class Workload:
    kind: str                # one of WORKLOADS
    num_prompts: int
    prompt_len: int          # random: each prompt; multi-turn: each new user message
    output_len: int          # tokens answered per request (EOS ignored)
    prefix_len: int          # random: tokens every prompt shares ahead of its own
    turns: int               # multi-turn: turns per conversation
    request_rate: float      # offered requests/s (Poisson)
    seed: int = 0

    def bench_args(self) -> list[str]:
        args = ["--num-prompts", str(self.num_prompts), "--request-rate",
                str(self.request_rate), "--random-output-len", str(self.output_len),
                "--ignore-eos", "--seed", str(self.seed)]
        if self.kind == "random":
            return args + ["--dataset-name", "random", "--random-input-len",
                           str(self.prompt_len), "--random-prefix-len", str(self.prefix_len)]
        return args + ["--dataset-name", "multi-turn", "--multi-turn-turns", str(self.turns),
                       "--multi-turn-user-len", str(self.prompt_len),
                       "--multi-turn-system-len", str(self.prefix_len)]


@dataclass(frozen=True)
class Slo:
    ttft_s: float
    itl_s: float


@dataclass(frozen=True)
class Trial:
    prefill: int
    decode: int
    completed: int
    failed: int
    duration_s: float
    goodput_req_s: float
    good_share: float        # good requests over all requests sent
    p50_ttft_ms: float
    p99_ttft_ms: float
    p99_itl_ms: float
    queue_ms: float          # median TTFT beyond the roofline's prefill of one prompt

    @property
    def nodes(self) -> int:
        return self.prefill + self.decode


def ratios(counts: list[int]) -> list[tuple[int, int]]:
    """Every P:D split of each node count: (1, N-1) ... (N-1, 1)."""
    return [(p, n - p) for n in counts for p in range(1, n)]


def run_trial(profile_arg: str, profile: Profile, prefill: int, decode: int,
              workload: Workload, slo: Slo, launch_args: tuple[str, ...] = (),
              chunk_tokens: int | None = None) -> Trial:
    """One simulated cluster of ``prefill`` + ``decode`` nodes, driven by the workload."""
    with launched("--prefill", str(prefill), "--decode", str(decode), "--compute",
                  "simulated", "--sim-profile", profile_arg, *launch_args,
                  ready_timeout_s=900) as cluster:
        cluster.wait_nodes(prefill + decode)
        host, port = cluster.http_url.rsplit("//", 1)[1].split(":")
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "result.json")
            cmd = [sys.executable, "-m", "pdserve.cli", "bench", "--host", host, "--port",
                   port, *workload.bench_args(), "--disable-tqdm", "--save-result", out]
            done = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                  text=True, timeout=3600)
            if done.returncode != 0:
                raise RuntimeError(f"pdserve bench against {prefill}P{decode}D failed: "
                                   f"{done.stderr[-2000:]}")
            with open(out) as f:
                result = json.load(f)
    ttft = stat_ms([t for t, e in zip(result["ttfts"], result["errors"]) if t and not e],
                   (50, 99))
    itl = stat_ms([g for gaps in result["itls"] for g in gaps], (99,))
    rate = goodput(result, slo.ttft_s, slo.itl_s)
    prefill_ms = 1e3 * R.prefill_seconds(profile, workload.prompt_len + workload.prefix_len,
                                         chunk_tokens)
    (_, p50), (_, p99) = ttft.percentiles
    return Trial(prefill, decode, result["completed"], result["failed"],
                 round(result["duration"], 2), round(rate, 3),
                 round(rate * result["duration"] / workload.num_prompts, 3),
                 round(p50, 1), round(p99, 1), round(itl.percentiles[0][1], 1),
                 round(max(0.0, p50 - prefill_ms), 1))


def recommend(trials: list[Trial], target: float) -> tuple[Trial, bool]:
    """(the trial recommended, whether its share of good requests reaches ``target``)."""
    enough = [t for t in trials if t.good_share >= target]
    if enough:
        fewest = min(t.nodes for t in enough)
        return max((t for t in trials if t.nodes == fewest),
                   key=lambda t: (t.goodput_req_s, -t.p99_ttft_ms)), True
    return max(trials, key=lambda t: (t.goodput_req_s, -t.nodes)), False


def report(trials: list[Trial], best: Trial, met: bool, offered_rate: float,
           target: float) -> dict:
    return {"recommended": {"prefill": best.prefill, "decode": best.decode,
                            "goodput_req_s": best.goodput_req_s, "meets_target": met},
            "offered_req_s": offered_rate, "target": target,
            "trials": [asdict(t) for t in trials]}
