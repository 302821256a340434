"""The second round of attacks over the real sockets (issue 35).

A stranger who claims a node's name on a named socket (item 1):
A ZeroMQ ROUTER with ROUTER_HANDOVER gives an identity to the newest connection that
claims it: a DEALER that says it is ``prefill-0`` on a decode node's KV socket, or
``decode-0`` on the router's control socket, took the real node's traffic for good.
Each test claims a live node's name as a stranger, leaves, and shows that a normal
request is served within 5 s, twice (the first after the stranger leaves, and one more).

Guide bombs (items 2-4): a grammar or schema that crashed the router (3,000 chained
rules), answered 500 (a schema 1,000 deep) or stalled every loop (10,000 properties) is a
400 naming the limit, quickly, and serving goes on.
"""
from __future__ import annotations

import os
import re
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest
import zmq

from pdserve.common.transport import make_socket
from tests.cluster import launched
from tests.e2e.test_attack import NORMAL, normal_text, process_tree


@pytest.fixture(scope="module")
def cluster(tiny_model, tmp_path_factory):
    model_dir = Path(tiny_model("llama"))
    with launched(model_dir, 1, 1, log_dir=tmp_path_factory.mktemp("names")) as c:
        c.model = model_dir.name
        c.pids = process_tree(c.proc.pid)
        c.baseline = normal_text(c)  # the prefill node has connected to the KV socket now
        yield c


def claim(address: str, identity: str, hold_s: float = 1.0, send: bytes | None = None):
    """Connects as ``identity``, optionally sends one frame, holds, and leaves."""
    ctx = zmq.Context()
    try:
        sock = make_socket(ctx, zmq.DEALER, connect=address, identity=identity)
        if send is not None:
            sock.send(send)
        time.sleep(hold_s)
        sock.close(0)
    finally:
        ctx.term()


def served_within(c, seconds: float) -> None:
    for _ in range(2):
        started = time.monotonic()
        assert normal_text(c, timeout_s=seconds + 5) == c.baseline
        assert time.monotonic() - started < seconds
    # The router's guide-check workers (router/guide_check.py) come and go; its
    # processes do not.
    assert c.pids <= process_tree(c.proc.pid), "a process of the cluster died or restarted"


@pytest.mark.parametrize("send", [None, b"hello"])
def test_a_stranger_claiming_the_prefill_nodes_name_on_a_kv_socket(cluster, send):
    address = re.search(r"KV socket (tcp://\S+)", cluster.log()).group(1)
    claim(address, "prefill-0", send=send)
    served_within(cluster, 5.0)


@pytest.mark.parametrize("send", [None, b"hello"])
def test_a_stranger_claiming_a_nodes_name_on_the_control_socket(cluster, send):
    for name in ("decode-0", "prefill-0"):
        claim(cluster.control, name, send=send)
        served_within(cluster, 5.0)


# ------------------------------------------------------------------ guide bombs (items 2-4)

def chained_lark(n: int) -> str:
    return "start: r0\n" + "".join(f'r{i}: r{i + 1} "a"\n' for i in range(n)) + f'r{n}: "b"\n'


def chained_gbnf(n: int) -> str:
    return "root ::= r0\n" + "".join(f'r{i} ::= r{i + 1} "a"\n' for i in range(n)) \
        + f'r{n} ::= "b"\n'


def nested_schema(depth: int) -> str:
    return '{"type":"object","properties":{"a":' * depth + '{"type":"string"}' + "}}" * depth


def wide_schema(n: int) -> str:
    props = ",".join(f'"p{i}":{{}}' for i in range(n))
    return '{"type":"object","properties":{' + props + "}}"


@pytest.mark.parametrize("guide, limit", [
    ({"grammar": chained_lark(3000)}, "MAX_GRAMMAR_RULES"),
    ({"grammar": chained_gbnf(3000)}, "MAX_GRAMMAR_RULES"),
    ({"grammar": "start: " + "(" * 5000 + '"a"' + ")" * 5000}, "MAX_GUIDE_DEPTH"),
    ({"json": nested_schema(1000)}, "MAX_GUIDE_DEPTH"),
    ({"json": wide_schema(10_000)}, "MAX_SCHEMA_OBJECTS"),
    ({"regex": "(" * 5000 + "a" + ")" * 5000}, "MAX_GUIDE_DEPTH"),
], ids=["lark-3000-rules", "gbnf-3000-rules", "lark-5000-parens", "schema-1000-deep",
        "schema-10000-properties", "regex-5000-parens"])
def test_a_guide_bomb_is_a_400_naming_the_limit(cluster, guide, limit):
    started = time.monotonic()
    r = httpx.post(cluster.http_url + "/v1/completions", timeout=60, json={
        "model": cluster.model, **NORMAL, "structured_outputs": guide})
    assert r.status_code == 400, (r.status_code, r.text[:500])
    assert limit in r.json()["error"]["message"], r.text[:500]
    assert "Traceback" not in r.text
    assert time.monotonic() - started < 2.0
    served_within(cluster, 5.0)


def test_a_guide_under_the_limits_is_served(cluster):
    r = httpx.post(cluster.http_url + "/v1/completions", timeout=60, json={
        "model": cluster.model, **NORMAL, "ignore_eos": False, "max_tokens": 64,
        "structured_outputs": {"grammar": chained_lark(20)}})
    assert r.status_code == 200, r.text[:500]
    text = r.json()["choices"][0]["text"]
    assert text and ("b" + "a" * 20).startswith(text), text


def test_a_guide_check_worker_that_dies_costs_the_router_nothing(cluster):
    """The router checks guides in child processes: one that segfaults is replaced."""
    test_a_guide_under_the_limits_is_served(cluster)
    workers = guide_workers(cluster)
    assert workers
    for pid in workers:
        os.kill(pid, signal.SIGSEGV)
    test_a_guide_under_the_limits_is_served(cluster)
    served_within(cluster, 5.0)
    assert guide_workers(cluster) and not set(guide_workers(cluster)) & set(workers)


def guide_workers(c) -> list[int]:
    """The cluster's guide-check workers (started from a thread: /proc's children lists
    of the main thread do not name them, their PPid does)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/status") as f:
                    ppid = int(next(line for line in f if line.startswith("PPid:")).split()[1])
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    cmdline = f.read()
            except (OSError, StopIteration):
                continue
            if ppid in c.pids and b"pdserve.router.guide_check" in cmdline:
                found.append(int(entry))
    return found


# ------------------------------------------------------------------ a producer's flood (item 5)

def test_a_producers_flood_meets_back_pressure_not_a_stalled_clock(cluster):
    """One producer sends 30,000 submits as fast as it can: it gets `overloaded` with a
    retry hint (never `no_nodes`), its refusals take a few log lines, not one each, and
    /health and a normal request are answered throughout."""
    import msgpack

    n, codes, done, no_hint = 30_000, {}, threading.Event(), []

    def flood():
        ctx = zmq.Context()
        sock = make_socket(ctx, zmq.DEALER, connect=cluster.ingress, sndhwm=0)
        try:
            for i in range(n):
                sock.send(msgpack.packb({"type": "submit", "id": str(i),
                                         "prompt_token_ids": [1, 2, 3], "max_tokens": 1}))
            answered, deadline = 0, time.monotonic() + 120
            while answered < n and time.monotonic() < deadline:
                if not sock.poll(1000):
                    continue
                for frame in sock.recv_multipart():
                    reply = msgpack.unpackb(frame)
                    if reply["type"] in ("done", "error"):
                        answered += 1
                        code = reply.get("code", "done")
                        codes[code] = codes.get(code, 0) + 1
                        if code == "overloaded" and "retry after" not in reply["message"]:
                            no_hint.append(reply["message"])
        finally:
            sock.close(0)
            ctx.term()
            done.set()

    lines_before = cluster.log().count("ingress: overloaded")
    thread = threading.Thread(target=flood, daemon=True)
    thread.start()
    worst = 0.0
    while not done.wait(0.2):
        started = time.monotonic()
        assert httpx.get(cluster.http_url + "/health", timeout=30).status_code == 200
        worst = max(worst, time.monotonic() - started)
    thread.join()
    assert "no_nodes" not in codes, codes
    assert codes.get("overloaded") and not no_hint, (codes, no_hint[:3])
    assert sum(codes.values()) == n, codes
    assert worst < 2.0, f"/health waited {worst:.1f} s during the flood"
    assert cluster.log().count("ingress: overloaded") - lines_before < 20
    served_within(cluster, 5.0)


def test_a_flood_on_the_control_socket_lets_the_router_keep_time(cluster):
    """Strangers send to the control socket as fast as they can (past their budget each
    message is dropped unread, so the socket never runs dry). The receive loop yields to
    the event loop every few hundred messages: /health, normal requests and the
    heartbeats go on, and no node is dropped for silence."""
    stop, sent = threading.Event(), [0]

    def flood(k: int) -> None:
        ctx = zmq.Context()
        sock = make_socket(ctx, zmq.DEALER, connect=cluster.control, identity=f"flood-{k}")
        try:
            while not stop.is_set():
                try:
                    for _ in range(1000):
                        sock.send(b"x", zmq.NOBLOCK)
                        sent[0] += 1
                except zmq.Again:  # the router's queue is full: it is being flooded
                    time.sleep(0.001)
        finally:
            sock.close(0)
            ctx.term()

    log_before = cluster.log()
    threads = [threading.Thread(target=flood, args=(k,), daemon=True) for k in range(2)]
    for t in threads:
        t.start()
    try:
        time.sleep(2.0)  # longer than a node's liveness (1.5 s): a starved clock drops it
        for _ in range(3):
            started = time.monotonic()
            assert httpx.get(cluster.http_url + "/health", timeout=30).status_code == 200
            assert time.monotonic() - started < 2.0
            served_within(cluster, 5.0)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=10)
    assert sent[0] > 10_000, sent
    new = cluster.log()[len(log_before):]
    for dropped in ("missed", "restarted", "stalled"):
        assert dropped not in new, new[-3000:]
