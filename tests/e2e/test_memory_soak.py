"""Memory that returns under every hostile case of issue 35 (the prompt cases are in
test_memory.py): WARM + ROUNDS = 12 rounds of each case (tests/e2e/memory_cases.py), a
normal request after each, and each process's RSS read from /proc.

Per case and process: RSS after the last round is within 5 % of RSS after the first
WARM rounds, 8 rounds later (the first rounds fill what stays: a compiled guide in the
caches, the decode heap's peak for a batch of 64, the allocator's high-water mark; an
ingress flood's router went 73, 86, 88, 88, 88, 91, then 91 to the end, and in another run
73, 86, 87, 87, 90, 90, 90, 92, then 92 to the end: measured from the second round, 5.6 %),
and within 50 MB of RSS before the case. The figures go to the log
directory as memory_soak.json (benchmarks/memory_soak.py runs more rounds).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.cluster import launched
from tests.e2e.memory_cases import CASES, MB, soak
from tests.e2e.test_attack import normal_text, process_tree
from tests.e2e.test_memory import roles

WARM, ROUNDS = 4, 8
# Slow to level (issue 35): the router grows 0.5-1 MB a round in anonymous memory that is not
# Python's (tracemalloc, benchmarks/memory_soak.py --heap, sees under 10 MB, all in bounded
# structures); not strict, RSS is noisy. The nodes' growth under vanishing producers was
# oneDNN's caches (one set of buffers per batch size), capped since (model/cpu_linear.py).
SLOW_TO_LEVEL = {
    "vanishing producers": "the router's RSS climbs ~15 % over 20 rounds (72 -> 85 MB), then "
                           "stays level (100 rounds)",
    "n=64 logprobs=20": "the router's RSS climbs over 30 rounds (72 -> 100 MB), then stays "
                        "level (150 rounds)"}
PARAMS = [pytest.param(case, marks=pytest.mark.xfail(reason=SLOW_TO_LEVEL[case], strict=False))
          if case in SLOW_TO_LEVEL else case for case in CASES]
FIGURES: dict[str, dict[str, list[int]]] = {}


@pytest.fixture(scope="module")
def cluster(tiny_model, tmp_path_factory):
    model_dir = Path(tiny_model("llama"))
    log_dir = tmp_path_factory.mktemp("memory_soak")
    with launched(model_dir, 1, 1, log_dir=log_dir) as c:
        c.model = model_dir.name
        c.pids = process_tree(c.proc.pid)
        c.baseline = normal_text(c)
        c.roles = roles(c)
        for _ in range(5):  # warm: the first requests fill caches that stay
            normal_text(c)
        yield c
        (log_dir / "memory_soak.json").write_text(json.dumps(FIGURES, indent=1))


@pytest.mark.soak
@pytest.mark.timeout(180)
@pytest.mark.parametrize("case", PARAMS)
def test_rss_returns_and_is_flat_across_rounds(cluster, case):
    assert {"router", "prefill-0", "decode-0"} <= set(cluster.roles), cluster.roles

    def serve():
        assert normal_text(cluster) == cluster.baseline

    seen = soak(cluster, cluster.roles, CASES[case], WARM + ROUNDS, serve)
    FIGURES[case] = seen
    print(case, {name: [v // MB for v in s] for name, s in seen.items()})
    for name, s in seen.items():
        assert s[-1] <= s[WARM] * 1.05, (case, name, [v // MB for v in s])
        assert s[-1] - s[0] < 50 * MB, (case, name, [v // MB for v in s])
    assert cluster.pids <= process_tree(cluster.proc.pid), "a process died or restarted"
