"""``pdserve plan --workload``: the P:D advisor runs simulated clusters of each ratio side
by side and recommends one. Prefill-heavy work (512-token prompts, 4 tokens answered)
offered at 7 requests/s to 3 nodes of a slow test GPU (175 ms a prefill, one prompt a
step): one prefill node serves about 5.7 a second, so with 1P2D the requests queue and
their TTFTs miss the SLO, while 2P1D keeps up. The advisor must see that queue wait at
the client, print the goodput of both ratios, and recommend 2P1D.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.cluster import sim_test_profile


@pytest.fixture(scope="module")
def slow_profile(tmp_path_factory):
    return sim_test_profile(tmp_path_factory.mktemp("plan") / "slow.json", "plan-test-gpu",
                            1.2e14, 0.25e12)


def test_advisor_recommends_the_ratio_without_a_queue(slow_profile):
    out = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "plan", "--sim-profile", str(slow_profile),
         "--workload", "random", "--request-rate", "7", "--prompt-len", "512",
         "--output-len", "4", "--num-prompts", "40", "--slo-ttft", "600", "--slo-itl", "150",
         "--nodes", "3", "--max-num-batched-tokens", "512", "--target", "0.8", "--json"],
        capture_output=True, text=True, timeout=600,
        # without the interpreter the command imports no triton, whose ~600 "leaked" lines
        # at exit would bury a failure's message in the last 3000 characters
        env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"})
    assert out.returncode == 0, out.stderr[-3000:]
    advice = json.loads(out.stdout)
    trials = {(t["prefill"], t["decode"]): t for t in advice["trials"]}
    print(json.dumps(advice, indent=1))
    assert set(trials) == {(1, 2), (2, 1)}
    for t in trials.values():   # every request answered in both trials
        assert t["completed"] == 40 and t["failed"] == 0
    one, two = trials[(1, 2)], trials[(2, 1)]
    # one prefill node cannot keep up: its requests wait, the TTFTs miss the SLO
    assert one["queue_ms"] > 300 and one["p50_ttft_ms"] > 600
    assert two["goodput_req_s"] > 2 * one["goodput_req_s"]
    assert advice["recommended"] == {"prefill": 2, "decode": 1,
                                     "goodput_req_s": two["goodput_req_s"],
                                     "meets_target": True}


@pytest.mark.parametrize("args, message", [
    ([], "give either --show"),
    (["--workload", "random"], "--workload needs --request-rate, --slo-ttft, --slo-itl"),
    (["--workload", "random", "--request-rate", "1", "--slo-ttft", "1", "--slo-itl", "1",
      "--nodes", "1"], "each count must be 2..64"),
    (["--show", "--workload", "random"], "give either --show"),
])
def test_advisor_refuses_what_it_cannot_plan(args, message):
    out = subprocess.run([sys.executable, "-m", "pdserve.cli", "plan", "--sim-profile",
                          "h100-llama3-8b", *args], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and message in out.stderr, out.stderr
