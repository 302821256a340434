"""Issue 32's second validation: with a profile of this CPU measured here
(``python -m pdserve.sim.calibrate``, the real engine's step times fitted to the roofline),
a simulated 1P1D cluster shows, at the client and at low load, the time to first token and
the inter-token latency of the real CPU 1P1D cluster serving the same model, within 20 %.

Same shape for both (1P1D: this machine has 2 cores; each node is given cores / nodes
torch threads, and the calibration as many: a core each, so that the router and the
client do not take the cores a step was measured with), requests one at a time, after one
to warm up.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

import httpx
import pytest

from pdserve.bench.cluster import launched
from pdserve.sim import roofline as R
from pdserve.sim.profile import load_profile

PROMPT_LEN, MAX_TOKENS, REQUESTS = 64, 12, 4
TOLERANCE = 0.20


def stream_times(url: str, model: str, prompt: list[int]) -> tuple[float, list[float]]:
    """(time to first token, the gaps between tokens) of one streamed completion. On a
    busy machine the router may send two tokens in one event: each event's tokens (from
    the usage every chunk carries) share its gap, so the gaps still sum to the time
    from the first token to the last."""
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "stream": True,
            "ignore_eos": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    start, arrivals, done = time.perf_counter(), [], 0   # arrivals: (time, tokens)
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                usage = json.loads(line[6:]).get("usage") or {}
                new = usage.get("completion_tokens", done) - done
                if new > 0:
                    arrivals.append((time.perf_counter(), new))
                    done += new
    assert done == MAX_TOKENS, done
    gaps = [(b - a) / n for (a, _), (b, n) in zip(arrivals, arrivals[1:]) for _ in range(n)]
    return arrivals[0][0] - start, gaps


def low_load(threads: int, *args: str) -> tuple[float, float]:
    """(median TTFT, median ITL) at the client of a 1P1D cluster launched with ``args``:
    one request to warm up, then REQUESTS one at a time, distinct prompts (no prefix
    hits), the same prompts for every cluster."""
    with launched("--prefill", "1", "--decode", "1", "--threads", str(threads), *args,
                  ready_timeout_s=180) as cluster:
        cluster.wait_nodes(2, timeout_s=180)
        url = cluster.http_url
        model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
        ttfts, gaps = [], []
        for i in range(REQUESTS + 1):
            ttft, g = stream_times(url, model, [12288 + (i * 7919 + k * 31) % 24576
                                                for k in range(PROMPT_LEN)])
            if i:
                ttfts.append(ttft)
                gaps += g
    return statistics.median(ttfts), statistics.median(gaps)


def compare(threads: int, path) -> list[tuple[str, float, float]]:
    """Calibrates this CPU into ``path``, then measures the real cluster and one simulated
    from that profile: (what, simulated, real) for TTFT and ITL."""
    out = subprocess.run([sys.executable, "-m", "pdserve.sim.calibrate", "--threads",
                          str(threads), "--repeats", "3", "--out", str(path)],
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    p = load_profile(str(path))
    predicted = (R.prefill_seconds(p, PROMPT_LEN),
                 R.decode_step_seconds(p, 1, PROMPT_LEN + MAX_TOKENS // 2))
    real = low_load(threads)
    simulated = low_load(threads, "--compute", "simulated", "--sim-profile", str(path),
                         "--sim-kv-bytes-scale", "1")
    print(f"{threads} thread(s) a node; TTFT / ITL in ms: predicted "
          f"{predicted[0] * 1e3:.1f} / {predicted[1] * 1e3:.1f}, simulated "
          f"{simulated[0] * 1e3:.1f} / {simulated[1] * 1e3:.1f}, real "
          f"{real[0] * 1e3:.1f} / {real[1] * 1e3:.1f}; simulated / real "
          f"{simulated[0] / real[0]:.3f} / {simulated[1] / real[1]:.3f}")
    return list(zip(("TTFT", "ITL"), simulated, real))


@pytest.mark.alone   # calibrates this machine and times it: no other test's load beside it
def test_a_simulated_cluster_on_this_cpu_s_profile_matches_the_real_one(tmp_path):
    """The calibration and the real cluster run a few seconds apart, and this shared host
    changes speed within seconds: once (2026-12-07) the real ITL came out 0.78 of the
    simulated one where runs before and after it agreed within 0.2. So a miss is measured
    again, calibration included, and the second comparison is the one asserted."""
    threads = max(1, (os.cpu_count() or 1) // 2)
    for attempt in range(2):
        pairs = compare(threads, tmp_path / f"cpu-{attempt}.json")
        if all(abs(sim / got - 1) <= TOLERANCE for _, sim, got in pairs):
            break
    for what, sim, got in pairs:
        assert abs(sim / got - 1) <= TOLERANCE, (what, sim, got)
