"""Memory that returns (issue 35): a prompt that cannot fit is refused before it is
tokenized, and what the router holds after odd input comes back.

A 3 MB chat message, or a chat of 100,000 messages, was templated and tokenized whole
before the context check refused it; the router kept hundreds of MB. Now a text longer
than the context times the longest token's characters (router/limits.PromptBound), or
more messages than the context has tokens, is a 400 at once. The soak test sends 10
rounds of each case, then normal requests, and reads every process's RSS from /proc.
"""
from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from pdserve.model.config import ModelConfig
from pdserve.model.tokenizer import Tokenizer
from tests.cluster import child_config, launched
from tests.e2e.memory_cases import rss
from tests.e2e.test_attack import normal_text, process_tree

MB = 1 << 20


@pytest.fixture(scope="module")
def cluster(tiny_model, tmp_path_factory):
    model_dir = Path(tiny_model("llama"))
    with launched(model_dir, 1, 1, log_dir=tmp_path_factory.mktemp("memory")) as c:
        c.model = model_dir.name
        c.context = ModelConfig.from_dir(model_dir).max_model_len
        # The most characters one token spells (here, not the router's own reckoning).
        c.longest = max(map(len, Tokenizer(model_dir)._tok.get_vocab(with_added_tokens=True)))
        c.pids = process_tree(c.proc.pid)
        c.baseline = normal_text(c)
        yield c


def chat(c, messages, timeout_s: float = 120) -> httpx.Response:
    return httpx.post(c.http_url + "/v1/chat/completions", timeout=timeout_s, json={
        "model": c.model, "messages": messages, "max_tokens": 4})


CASES = {
    "3 MB message": lambda c: [{"role": "user", "content": "ab " * (MB)}],
    "100,000 messages": lambda c: [{"role": "user", "content": "x"}] * 100_000,
    "just over the bound": lambda c: [{"role": "user",
                                       "content": "y" * (c.context * c.longest + 1)}],
}


@pytest.mark.parametrize("case", CASES)
def test_a_prompt_that_cannot_fit_is_refused_before_tokenizing(cluster, case):
    started = time.monotonic()
    r = chat(cluster, CASES[case](cluster))
    assert r.status_code == 400, (r.status_code, r.text[:300])
    message = r.json()["error"]["message"]
    assert f"context of {cluster.context} tokens" in message, message
    assert time.monotonic() - started < 5.0  # no tokenizing of megabytes first
    assert normal_text(cluster) == cluster.baseline


def test_a_prompt_under_the_bound_is_still_tokenized_and_checked(cluster):
    """Under the bound the context check is the tokenizer's, as before."""
    r = chat(cluster, [{"role": "user", "content": "ab " * (cluster.context * 2)}])
    assert r.status_code == 400, r.text[:300]
    assert "tokens but the model's context" in r.json()["error"]["message"]


def roles(c) -> dict[str, int]:
    """{"router": pid, "prefill-0": pid, "decode-0": pid} of the cluster."""
    found = {}
    for pid in process_tree(c.proc.pid):
        handed = child_config(pid)
        if handed is not None:
            cfg = handed["config"]
            found[cfg.get("node_id") or "router"] = pid
    return found


@pytest.mark.soak
@pytest.mark.timeout(240)
def test_rss_is_flat_across_rounds_of_odd_input(cluster):
    """Rounds of every case above, and a normal request after each: each process's RSS
    stays within 50 MB of what it was before any, and each node's after 10 rounds is within
    5 % of its RSS before them (after 3 warm rounds).

    The router parses the 100,000 messages before refusing them (about 30 MB of Python
    objects, freed), and its allocator keeps part of that: measured on the 2-core dev
    machine (2026-12-05), 200 such requests in a row took its RSS from 87-88 MB to a level
    of 107-111 MB, reached by about the 100th (tracemalloc: +0.0 MiB of live Python
    objects). That settles within the 50 MB bound but not within 5 % of round 3."""
    pids = roles(cluster)
    assert {"router", "prefill-0", "decode-0"} <= set(pids), pids
    def round_of_cases():
        for make in CASES.values():
            assert chat(cluster, make(cluster)).status_code == 400
        assert normal_text(cluster) == cluster.baseline

    for _ in range(5):  # warm: the first requests fill caches that stay
        normal_text(cluster)
    before = {name: rss(pid) for name, pid in pids.items()}
    # The first rounds take the allocator to the peak of one case (parsing the body of
    # 100,000 messages: about 30 MB of Python objects, freed, whose arenas are reused);
    # RSS levels off there, and must stay flat from then on.
    for _ in range(3):
        round_of_cases()
    warm = {name: rss(pid) for name, pid in pids.items()}
    for _ in range(10):
        round_of_cases()
    last = {name: rss(pid) for name, pid in pids.items()}
    for name in pids:
        assert last[name] - before[name] < 50 * MB, (name, before, last)
        if name != "router":
            assert last[name] <= warm[name] * 1.05, (name, warm, last)
    assert cluster.pids <= process_tree(cluster.proc.pid)
