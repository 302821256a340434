"""``pdserve bench``'s multi-turn workload without a server: conversations built from a
seed, each turn's prompt grown from the last prompt, the answer the server gave and a new
user message; and the scale benchmarks' per-request goodput."""
from __future__ import annotations

import pytest

from pdserve.bench import metrics


def test_goodput_per_request_slo():
    result = {"duration": 2.0,
              "ttfts": [0.1, 0.5, 0.1, 0.1, 0.0],
              # the third's p99 gap is 0.01 + 0.99 * 0.99 s: over a 0.05 s SLO
              "itls": [[0.01, 0.02], [0.01], [0.01, 1.0], [], []],
              "errors": ["", "", "", "", "HTTP 500"]}
    # good: the first (all within) and the fourth (one chunk: no gap to judge)
    assert metrics.goodput(result, 0.2, 0.05) == pytest.approx(2 / 2.0)
    assert metrics.goodput(result, 1.0, 2.0) == pytest.approx(4 / 2.0)
    assert metrics.goodput({**result, "duration": 0.0}, 1.0, 1.0) == 0.0
