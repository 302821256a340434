"""`pdserve launch` with no topology flag on a CPU machine of 2 cores or fewer (CI's, the
dev machine's): one colocated node, said in the ready table, and it serves; asked for,
1P1D is kept."""
from __future__ import annotations

import os

import httpx
import pytest

from pdserve.bench.cluster import launched, processes

pytestmark = pytest.mark.skipif((os.cpu_count() or 1) > 2,
                                reason="launch colocates by default on 2 cores or fewer only")


def complete(url: str) -> None:
    r = httpx.post(url + "/v1/completions", timeout=60, json={
        "model": "m", "prompt": "The quick brown fox", "max_tokens": 4, "temperature": 0,
        "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4


def test_a_small_machine_gets_one_colocated_node_unless_it_asks_for_1p1d(tiny_model):
    model = str(tiny_model())
    with launched("--model", model, "--threads", "1", "--served-model-name", "m",
                  ready_timeout_s=180) as cluster:
        complete(cluster.http_url)
        assert set(processes(cluster.proc.pid)) == {"router", "colocated-0"}
        table = cluster.ready_log()
        assert "(1 colocated node: chosen for" in table
        assert "--prefill 1 --decode 1 starts them apart" in table
    with launched("--model", model, "--threads", "1", "--served-model-name", "m",
                  "--prefill", "1", "--decode", "1", ready_timeout_s=180) as cluster:
        complete(cluster.http_url)
        assert set(processes(cluster.proc.pid)) == {"router", "prefill-0", "decode-0"}
        assert "(1 prefill, 1 decode nodes)" in cluster.ready_log()
