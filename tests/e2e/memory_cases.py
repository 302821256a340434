"""One round of each hostile case of issue 35, for the memory soak (tests/e2e/test_memory_soak.py)
and its longer benchmark (benchmarks/memory_soak.py): the same definitions for both.

Each case is a function ``(cluster, round_no) -> None`` that sends one round over the real
sockets and asserts what a user would see (refused or served, nothing lost). Rounds are
sized so that 11 rounds of every case take a couple of minutes on a shared 2-core machine.
"""
from __future__ import annotations

import re
import time

import httpx
import msgpack
import zmq

from pdserve.common.transport import make_socket
from tests.e2e.test_attack import NORMAL
from tests.e2e.test_attack_round2 import chained_gbnf, chained_lark, nested_schema, wide_schema

MB = 1 << 20


def rss(pid: int) -> int:
    """Resident bytes of ``pid`` less its shared-memory pages, from /proc. Those are the
    /dev/shm KV pool (node/kv/segment.py): a cache bounded by --kv-cache-memory-gb that
    grows as blocks are first used (a flood of new prompts takes new blocks while never-used
    ones are left), not what a leak would hold."""
    with open(f"/proc/{pid}/status") as f:
        fields = dict(line.split(":", 1) for line in f)
    return (int(fields["VmRSS"].split()[0]) - int(fields["RssShmem"].split()[0])) * 1024


def completion(c, body: dict, timeout_s: float = 120) -> httpx.Response:
    return httpx.post(c.http_url + "/v1/completions", timeout=timeout_s,
                      json={"model": c.model, **NORMAL, **body})


BOMBS = [
    {"grammar": chained_lark(3000)}, {"grammar": chained_gbnf(3000)},
    {"grammar": "start: " + "(" * 5000 + '"a"' + ")" * 5000},
    {"json": nested_schema(1000)}, {"json": wide_schema(10_000)},
    {"regex": "(" * 5000 + "a" + ")" * 5000},
]


def guide_bombs(c, _round: int) -> None:
    """Guides past a limit: a 400 naming it, before any compiler sees them."""
    for guide in BOMBS:
        r = completion(c, {"structured_outputs": guide})
        assert r.status_code == 400 and "MAX_" in r.text, (r.status_code, r.text[:300])


def hostile_guides(c, round_no: int) -> None:
    """Guides just under the limits, new each round (no cache hit): the router's guide
    check and both nodes' compile threads compile them, and the request is served."""
    props = ",".join(f'"r{round_no}p{i}":{{"type":"integer"}}' for i in range(400))
    for guide in ({"json": '{"type":"object","properties":{' + props + "}}"},
                  {"grammar": chained_lark(400).replace('"b"', f'"b{round_no}"')}):
        r = completion(c, {"structured_outputs": guide, "max_tokens": 4, "ignore_eos": False})
        assert r.status_code == 200, (r.status_code, r.text[:300])


def ingress_flood(c, round_no: int, n: int = 5000) -> None:
    """One producer's submits as fast as they go: every one answered, `overloaded` past
    its budget, never `no_nodes`."""
    ctx = zmq.Context()
    sock = make_socket(ctx, zmq.DEALER, connect=c.ingress, sndhwm=0)
    codes: dict[str, int] = {}
    try:
        for i in range(n):
            sock.send(msgpack.packb({"type": "submit", "id": f"{round_no}-{i}",
                                     "prompt_token_ids": [1, 2, 3], "max_tokens": 1}))
        answered, deadline = 0, time.monotonic() + 120
        while answered < n and time.monotonic() < deadline:
            if sock.poll(1000):
                for frame in sock.recv_multipart():
                    reply = msgpack.unpackb(frame)
                    if reply["type"] in ("done", "error"):
                        answered += 1
                        code = reply.get("code", "done")
                        codes[code] = codes.get(code, 0) + 1
    finally:
        sock.close(0)
        ctx.term()
    assert sum(codes.values()) == n and "no_nodes" not in codes, codes


def kv_address(c) -> str:
    return re.search(r"KV socket (tcp://\S+)", c.log()).group(1)


def socket_floods(c, _round: int, n: int = 10_000) -> None:
    """Bad messages from strangers on the router's control socket and a decode node's KV
    socket, as fast as they go (past the strangers' budget they are dropped unread)."""
    for address in (c.control, kv_address(c)):
        ctx = zmq.Context()
        try:
            sock = make_socket(ctx, zmq.DEALER, connect=address, identity="flooder", sndhwm=0)
            for _ in range(n):
                sock.send(b"not msgpack")
            while sock.poll(300):  # the few answers the budget allows
                sock.recv_multipart()
            sock.close(0)
        finally:
            ctx.term()


def strangers(c, _round: int) -> None:
    """Strangers claim the nodes' names on the KV and control sockets, say one frame,
    and leave."""
    claims = [(kv_address(c), "prefill-0"), (c.control, "decode-0"), (c.control, "prefill-0")]
    ctx = zmq.Context()
    try:
        socks = [make_socket(ctx, zmq.DEALER, connect=a, identity=name) for a, name in claims]
        for s in socks:
            s.send(b"hello")
        time.sleep(0.3)
        for s in socks:
            s.close(0)
    finally:
        ctx.term()


def vanishing_producers(c, round_no: int, n: int = 200) -> None:
    """Producers that send one submit and are gone before the answer."""
    ctx = zmq.Context()
    try:
        for i in range(n):
            sock = make_socket(ctx, zmq.DEALER, connect=c.ingress)
            sock.send(msgpack.packb({"type": "submit", "id": f"v{round_no}-{i}",
                                     "prompt_token_ids": [5, 6, 7, 8], "max_tokens": 8}))
            sock.close(linger=100)  # the submit leaves, the producer does not wait
    finally:
        ctx.term()


def many_logprobs(c, _round: int) -> None:
    """n=64 choices with 20 logprobs per token."""
    r = completion(c, {"n": 64, "logprobs": 20, "max_tokens": 16, "temperature": 1.0})
    assert r.status_code == 200, (r.status_code, r.text[:300])
    choices = r.json()["choices"]
    assert len(choices) == 64 and all(len(ch["logprobs"]["top_logprobs"]) == 16
                                      for ch in choices)


CASES = {
    "guide bombs": guide_bombs,
    "hostile guides": hostile_guides,
    "ingress flood": ingress_flood,
    "socket floods": socket_floods,
    "strangers": strangers,
    "vanishing producers": vanishing_producers,
    "n=64 logprobs=20": many_logprobs,
}


def soak(c, pids: dict[str, int], case, rounds: int, serve) -> dict[str, list[int]]:
    """{process: [RSS before, after round 1, ..., after round ``rounds``]}; ``serve`` (a
    normal request) runs after every round and must be answered as before."""
    seen = {name: [rss(pid)] for name, pid in pids.items()}
    for k in range(rounds):
        case(c, k)
        serve()
        for name, pid in pids.items():
            seen[name].append(rss(pid))
    return seen

