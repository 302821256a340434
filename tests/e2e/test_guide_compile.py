"""Structured-output guides compile off the nodes' compute loops (issue 35, item 4).

A node compiled a request's guide inside its compute loop, at admission: while it did,
every stream on that node stood still. Guides now compile on worker threads
(llguidance releases the GIL) and the request waits beside the loop; a guide that takes
longer than --guide-timeout fails its own request (a 400), and nothing else.

A guide can also fail after it compiled: llguidance builds its lexer lazily, and the
guides here hit its budget ("too many expressions constructed") at the first token. That
raised out of the decode step and failed every request on the node (500s all round); it
now fails its own request only, with a 400 saying why.

The guides here are inside every limit (common/guides.py) and slow on purpose: thousands of
alternatives, each distinct, so that no compile cache helps.
"""
from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import httpx
import pytest

from tests.cluster import launched
from tests.e2e.test_attack import NORMAL, process_tree


def slow_regex(seed: int, alternatives: int = 5000) -> str:
    """About 200 KB (under MAX_GUIDE_BYTES); a few tenths of a second to compile on the
    tiny model's vocabulary."""
    return "(" + "|".join(f"(x{seed}_{i}|y{i})[a-z]{{2,40}}[0-9]{{1,30}}"
                          for i in range(alternatives)) + ")"


@pytest.fixture(scope="module")
def cluster(tiny_model, tmp_path_factory):
    model_dir = Path(tiny_model("llama"))
    # One node of each role times guides out at 0.05 s: every slow guide fails there.
    with launched(model_dir, 1, 1, "--node-arg=--guide-timeout=0.05",
                  log_dir=tmp_path_factory.mktemp("guides")) as c:
        c.model = model_dir.name
        c.pids = process_tree(c.proc.pid)
        yield c


@pytest.fixture(scope="module")
def default_cluster(tiny_model, tmp_path_factory):
    """--guide-timeout at its default (10 s): the slow guides compile."""
    model_dir = Path(tiny_model("llama"))
    with launched(model_dir, 1, 1, log_dir=tmp_path_factory.mktemp("guides10")) as c:
        c.model = model_dir.name
        c.pids = process_tree(c.proc.pid)
        yield c


async def stream_gaps(client: httpx.AsyncClient, model: str,
                      max_tokens: int = 32) -> tuple[str, float, float]:
    """A normal streamed request: (text, its longest wait between chunks, its time)."""
    text, worst, started = "", 0.0, time.monotonic()
    last = started
    async with client.stream("POST", "/v1/completions", json={
            "model": model, **NORMAL, "max_tokens": max_tokens, "stream": True}) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            now = time.monotonic()
            worst, last = max(worst, now - last), now
            if line.startswith("data: {"):
                text += json.loads(line[6:])["choices"][0]["text"]
    return text, worst, time.monotonic() - started


def fast_guide(c) -> httpx.Response:
    return httpx.post(c.http_url + "/v1/completions", timeout=60, json={
        "model": c.model, **NORMAL, "ignore_eos": False, "max_tokens": 16,
        "structured_outputs": {"regex": "(yes|no)"}})


def test_a_fast_guide_is_served_under_the_timeout(cluster):
    r = fast_guide(cluster)
    assert r.status_code == 200, r.text[:500]
    assert r.json()["choices"][0]["text"] in ("yes", "no")


def test_slow_guides_fail_alone_past_the_timeout_while_streams_go_on(cluster):
    async def go():
        async with httpx.AsyncClient(base_url=cluster.http_url, timeout=120) as client:
            baseline = (await stream_gaps(client, cluster.model))[0]
            guided = [client.post("/v1/completions", json={
                "model": cluster.model, **NORMAL, "ignore_eos": False,
                "structured_outputs": {"regex": slow_regex(k)}}) for k in range(8)]
            streams = [stream_gaps(client, cluster.model) for _ in range(3)]
            results = await asyncio.gather(*guided, *streams)
            return baseline, results[:8], results[8:]

    baseline, guided, streams = asyncio.run(go())
    for r in guided:
        assert r.status_code == 400, (r.status_code, r.text[:500])
        message = r.json()["error"]["message"]
        assert "did not compile within 0.05 s" in message, message
        assert "Traceback" not in r.text
    for text, worst, took in streams:
        assert text == baseline
        assert took < 5.0, f"a normal stream took {took:.1f} s beside slow guides"
    assert "did not compile within" in cluster.log()
    # The compiles that had started run on (a thread cannot be stopped), those queued
    # were cancelled: a fast guide is served again once the workers are free.
    deadline = time.monotonic() + 30
    while True:
        r = fast_guide(cluster)
        if r.status_code == 200 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert r.status_code == 200, r.text[:500]
    assert cluster.pids <= process_tree(cluster.proc.pid), "a process died"


def test_a_guide_that_fails_while_decoding_fails_alone(default_cluster):
    """Streams run on both nodes while guides that compile, then fail at their first
    token, arrive: each guided request is a 400 naming the grammar's failure, every
    stream completes with its usual text."""
    c = default_cluster

    async def go():
        async with httpx.AsyncClient(base_url=c.http_url, timeout=120) as client:
            baseline = (await stream_gaps(client, c.model, 128))[0]
            streams = [asyncio.ensure_future(stream_gaps(client, c.model, 128))
                       for _ in range(3)]
            await asyncio.sleep(0.2)  # decoding when the guides come
            guided = await asyncio.gather(*(client.post("/v1/completions", json={
                "model": c.model, **NORMAL, "ignore_eos": False,
                "structured_outputs": {"regex": slow_regex(k)}}) for k in range(4)))
            return baseline, guided, await asyncio.gather(*streams)

    baseline, guided, streams = asyncio.run(go())
    for r in guided:
        assert r.status_code == 400, (r.status_code, r.text[:500])
        assert "structured output" in r.json()["error"]["message"], r.text[:500]
        assert "Traceback" not in r.text
    for text, _, _ in streams:
        assert text == baseline
    assert c.pids <= process_tree(c.proc.pid), "a process died"
