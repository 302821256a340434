"""Membership on etcd with several routers (issue #31), black-box over real processes:
etcd, 2 routers, prefill and decode nodes started with --discovery and no --router, each
a process the test signals by PID (tests/fleet.py). The routers run --policy cache_aware,
whose prefix index comes from the nodes' own KV events and dumps."""
from __future__ import annotations

import asyncio
import os
import re
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import msgpack
import pytest
import zmq

from pdserve.client import AsyncQueueClient, Done, QueueClient
from pdserve.common.sockets import free_port
from tests.e2e.test_metrics import eventually, scrape, value
from tests.fleet import fleet, healthy, wait_for

TTL_S = 3  # --discovery-ttl of every process in tests/fleet.py
STREAM_KEEP_S = 4  # decode-0's --stream-keep in the model fleet
DECODE_BLOCKS = 12  # decode-0's KV cache: 2 of the arbitration test's requests (5 blocks each)
# How a router says it dropped prefill-1: by its heartbeats, its socket or its lease.
DROPPED = re.compile(r"node prefill-1 (missed|is not connected|left etcd)")


def complete(router, model, prompt="Routers share nodes", max_tokens=6) -> dict:
    r = httpx.post(router.http_url + "/v1/completions", timeout=60, json={
        "model": os.path.basename(str(model)), "prompt": prompt, "max_tokens": max_tokens,
        "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()


def prefill_node(f, name: str):
    """A --compute none prefill node whose /metrics (its prefix-cache counters) is on
    ``.metrics_url``."""
    port = free_port()
    node = f.node("prefill", name, "--compute", "none", "--metrics-port", str(port))
    node.metrics_url = f"http://127.0.0.1:{port}/metrics"
    return node


@pytest.fixture(scope="module")
def cluster(tiny_model, tmp_path_factory):
    """etcd + 2 routers + 2 prefill + 1 decode, --compute none (the model is not under
    test here: membership and routing are)."""
    model = tiny_model("llama")
    with fleet(tmp_path_factory.mktemp("fleet"), model) as f:
        routers = [f.router(name, "--policy", "cache_aware")
                   for name in ("router-a", "router-b")]
        nodes = [prefill_node(f, "prefill-0"), prefill_node(f, "prefill-1"),
                 # Few blocks: the two routers' reservations compete for them.
                 f.node("decode", "decode-0", "--compute", "none", "--num-kv-blocks",
                        str(DECODE_BLOCKS))]
        for r in routers:
            wait_for(lambda r=r: healthy(r), 120, f"{r.name} not healthy", r, *nodes)
        wait_for(lambda: len(f.records("nodes")) == 3 and len(f.records("routers")) == 2,
                 60, "records missing from etcd", *routers, *nodes)
        # Every node serves both routers: each router's log has each node's Hello.
        for r in routers:
            for n in nodes:
                wait_for(lambda r=r, n=n: f"node {n.name} joined" in r.log(), 60,
                         f"{n.name} never joined {r.name}", r, n)
        yield f, model, routers, nodes


def test_both_routers_serve_the_same_nodes(cluster):
    f, model, routers, nodes = cluster
    for r in routers:
        out = complete(r, model)
        assert out["usage"]["completion_tokens"] == 6
    records = f.records("nodes")
    roles = sorted(rec["role"] for rec, _epoch in records.values())
    assert roles == ["decode", "prefill", "prefill"]
    decode = next(rec for rec, _ in records.values() if rec["role"] == "decode")
    assert decode["kv_address"].startswith("tcp://127.0.0.1:")
    assert decode["kv_layout"]["block_size"] > 0
    controls = {rec["control"] for rec, _ in f.records("routers").values()}
    assert len(controls) == 2


def test_the_decode_node_arbitrates_between_routers(cluster):
    """Both routers at once on one decode node with room for 2 such requests at a time:
    the node grants or refuses each reservation from its own free blocks, whoever asks,
    and every request completes, once."""
    f, model, routers, nodes = cluster
    jobs = [(routers[i % 2], f"request {i} " + "shared words " * 12) for i in range(24)]
    with ThreadPoolExecutor(12) as pool:
        outs = list(pool.map(lambda j: complete(j[0], model, j[1], 8), jobs))
    assert [o["usage"]["completion_tokens"] for o in outs] == [8] * len(jobs)
    assert all(o["usage"]["prompt_tokens"] > 16 * 3 for o in outs)  # 4+ blocks with output
    assert len({o["id"] for o in outs}) == len(jobs)


def test_etcd_stopped_for_5s_drops_no_node(cluster):
    f, model, routers, nodes = cluster
    epochs = {k: epoch for k, (_rec, epoch) in f.records("nodes").items()}
    # What each process logs from here on (a start on a loaded machine may have missed a
    # heartbeat: that is not this test's).
    start = {p.name: len(p.log()) for p in (*routers, *nodes)}
    os.kill(f.etcd.popen.pid, signal.SIGSTOP)
    try:
        stopped_at = time.monotonic()
        served = 0
        while time.monotonic() - stopped_at < 5.0:  # requests go on being served meanwhile
            complete(routers[served % 2], model, f"during the stop {served}")
            served += 1
    finally:
        os.kill(f.etcd.popen.pid, signal.SIGCONT)
    assert served >= 2
    for r in routers:
        since = r.log()[start[r.name]:]
        assert "missed" not in since and "left etcd (" not in since, since[-3000:]
        complete(r, model, "after the stop")
    # The stop outlasted the leases (3 s): etcd expired them on waking, and each node
    # wrote its record again under a new lease, a later epoch.
    wait_for(lambda: f.records("nodes").keys() == epochs.keys(), 30,
             "a node did not register again", *nodes)
    assert all(e >= epochs[k] for k, (_r, e) in f.records("nodes").items())
    wait_for(lambda: len(f.records("routers")) == 2, 30, "a router did not register again",
             *routers)
    for n in nodes:
        assert "left the cluster" not in n.log()[start[n.name]:], n.log()[-3000:]


def complete_ids(router, model, prompt: list[int]) -> dict:
    r = httpx.post(router.http_url + "/v1/completions", timeout=60, json={
        "model": os.path.basename(str(model)), "prompt": prompt, "max_tokens": 2,
        "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()


def prefix_tokens(prefill_nodes) -> tuple[float, float]:
    """(prompt tokens looked up, found) in the prefill nodes' prefix caches, summed."""
    samples = [scrape(n.metrics_url)[1] for n in prefill_nodes]
    return (sum(value(s, "pdserve_prefix_cache_queries_tokens_total") for s in samples),
            sum(value(s, "pdserve_prefix_cache_hits_tokens_total") for s in samples))


def index_blocks(router) -> float:
    return value(scrape(router.http_url + "/metrics")[1], "pdserve_prefix_index_blocks")


def follow_ups_hit(router, model, prefill_nodes, prefixes, tail) -> None:
    """Each prefix again, with ``tail``, one at a time through ``router``: the prefill node
    it goes to holds every one of the prefix's 4 blocks (64 tokens found, counted by the
    nodes' own prefix-cache hit counter)."""
    for p in prefixes:
        _, hits = prefix_tokens(prefill_nodes)
        complete_ids(router, model, p + tail)
        eventually(lambda: _assert_equal(prefix_tokens(prefill_nodes)[1] - hits, 64.0))


def _assert_equal(got, want) -> None:
    assert got == want, (got, want)


def test_cache_aware_routes_to_what_the_nodes_said_they_cached(cluster):
    """Prefixes sent through another router, W, are found through router B (which never
    sent them: its index is the nodes' KV events), and through router C, started after
    the caches were warm: it is not ready (503) until every node's index dump is in, then
    routes by the dumps."""
    f, model, routers, nodes = cluster
    b = routers[1]
    prefill = nodes[:2]
    prefixes = [[(37 * i + 101 * k) % 900 + 3 for i in range(64)] for k in range(6)]  # 4 blocks
    # W places them round robin, one after another: both prefill nodes hold some. (Sent at
    # once through a cache_aware router, the least loaded node took all six on a busy
    # machine, when each prefill ended before the next request came.)
    w = f.router("router-w", "--policy", "round_robin")
    try:
        for n in prefill:
            wait_for(lambda n=n: f"node {n.name} joined" in w.log(), 60,
                     f"{n.name} never joined {w.name}", w, n)
        wait_for(lambda: healthy(w), 60, "router W not healthy", w)
        queried = [prefix_tokens([n])[0] for n in prefill]
        for p in prefixes:
            complete_ids(w, model, p + [1])
        spread = [prefix_tokens([n])[0] - q for n, q in zip(prefill, queried)]
        assert all(spread), f"W sent every prefix to one node ({spread})"
    finally:
        os.kill(w.popen.pid, signal.SIGKILL)
        w.popen.wait()
    wait_for(lambda: index_blocks(b) >= 6 * 4, 10, "B's index lacks A's prefixes", b)
    follow_ups_hit(b, model, prefill, prefixes, [2, 3])
    # A late router: the nodes' dumps, not events it never saw, give it the warm caches.
    c = f.router("router-c", "--policy", "cache_aware")
    try:
        statuses, deadline = [], time.monotonic() + 120
        while not statuses or statuses[-1][0] != 200:
            assert c.popen.poll() is None and time.monotonic() < deadline, c.log()[-3000:]
            try:
                r = httpx.get(c.http_url + "/health", timeout=2)
                statuses.append((r.status_code, r.json().get("reason", "")))
            except httpx.HTTPError:
                pass
            time.sleep(0.02)
        for n in nodes:
            assert f"prefix index of node {n.name}: dump of" in c.log(), c.log()[-3000:]
        assert all(code == 503 for code, _ in statuses[:-1]), statuses
        # (Whether a poll fell in the ~0.1 s between the nodes' joining and their dumps
        # is the machine's timing; prefix_index.py's unit test holds the rule.)
        print("router C's /health before 200:", sorted({why for _, why in statuses[:-1]}))
        _, s = scrape(c.http_url + "/metrics")
        assert value(s, "pdserve_prefix_index_blocks") >= 6 * 4
        assert value(s, "pdserve_prefix_index_degraded") == 0
        assert value(s, "pdserve_prefix_index_dumps_total", reason="joined") >= len(nodes)
        queried, hits = prefix_tokens(prefill)
        follow_ups_hit(c, model, prefill, prefixes, [4, 5, 6])
        queried2, hits2 = prefix_tokens(prefill)
        print(f"router C's follow-ups: {hits2 - hits:.0f} of {queried2 - queried:.0f} prompt "
              f"tokens found in the prefill nodes' caches "
              f"({(hits2 - hits) / (queried2 - queried):.0%})")
    finally:
        os.kill(c.popen.pid, signal.SIGKILL)
        c.popen.wait()
    wait_for(lambda: len(f.records("routers")) == 2, 4 * TTL_S,
             "router C's record outlived its lease", f.etcd)


def test_a_node_sigkilled_leaves_etcd_within_its_lease(cluster):
    f, model, routers, nodes = cluster
    victim = nodes[1]  # prefill-1: prefill-0 and decode-0 go on serving
    os.kill(victim.popen.pid, signal.SIGKILL)
    victim.popen.wait()
    killed_at = time.monotonic()
    key = "/pdserve/default/nodes/prefill-1"
    wait_for(lambda: key not in f.records("nodes"), 4 * TTL_S,
             "the killed node's record outlived its lease", f.etcd)
    gone_after = time.monotonic() - killed_at
    assert gone_after < 4 * TTL_S  # the lease (3 s) and etcd's expiry check, not forever
    for r in routers:
        wait_for(lambda r=r: DROPPED.search(r.log()), 30,
                 f"{r.name} still counts the killed node", r)
        for i in range(4):  # round robin would pick the dead node every other request
            complete(r, model, f"after the kill {i}")


def test_a_router_sigkilled_the_other_keeps_serving(cluster):
    f, model, routers, nodes = cluster
    dead, alive = routers
    left = {n.name: n.log().count("left the cluster") for n in nodes}  # (router C's too)
    os.kill(dead.popen.pid, signal.SIGKILL)
    dead.popen.wait()
    wait_for(lambda: len(f.records("routers")) == 1, 4 * TTL_S,
             "the killed router's record outlived its lease", f.etcd)
    for n in (nodes[0], nodes[2]):
        wait_for(lambda n=n: n.log().count("left the cluster") > left[n.name], 30,
                 f"{n.name} kept the dead router", n)
    for i in range(6):
        assert complete(alive, model, f"new request {i}")["usage"]["completion_tokens"] == 6


@pytest.fixture(scope="module")
def model_fleet(tiny_model, tmp_path_factory):
    """etcd + 2 routers + 1 prefill + 1 decode running the real model (a tiny random
    checkpoint, float32); the decode node keeps streams STREAM_KEEP_S for a resume."""
    model = tiny_model("llama")
    with fleet(tmp_path_factory.mktemp("model_fleet"), model) as f:
        routers = [f.router("router-a"), f.router("router-b")]
        nodes = [f.node("prefill", "prefill-0"),
                 f.node("decode", "decode-0", "--stream-keep", str(STREAM_KEEP_S))]
        for r in routers:
            wait_for(lambda r=r: healthy(r), 120, f"{r.name} not healthy", r, *nodes)
        yield f, model, routers, nodes


def test_token_exact_through_either_router(model_fleet):
    """The real model: each router's greedy tokens are the offline engine's."""
    from pdserve import LLM, SamplingParams

    f, model, routers, nodes = model_fleet
    want = LLM(dtype="float32", model=model).generate(["Two routers"], SamplingParams(
        temperature=0, max_tokens=8, ignore_eos=True))[0].text
    for r in routers:
        got = complete(r, model, "Two routers", 8)
        assert got["usage"]["completion_tokens"] == 8
        assert got["choices"][0]["text"] == want, (r.name, got, want)


def producer(identity: bytes, endpoint: str):
    """A raw queue producer (docs/queue-protocol.md) with the socket identity given."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, identity)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    return sock


def answer(sock, message: dict, timeout_s: float = 30.0) -> dict:
    """Sends ``message``; the first answer about its id that ends it (error or done)."""
    sock.send(msgpack.packb(message))
    deadline = time.monotonic() + timeout_s
    while sock.poll(max(1, int((deadline - time.monotonic()) * 1000))):
        for frame in sock.recv_multipart():
            got = msgpack.unpackb(frame)
            if got.get("id") == message["id"] and got["type"] in ("error", "done"):
                return got
    pytest.fail(f"no answer to {message} in {timeout_s:g} s")


async def async_stream(routers, prompt, greedy, started, got) -> None:
    async with AsyncQueueClient(routers) as client:
        rid = await client.submit(prompt_token_ids=prompt, **greedy)
        ids, text, ends = [], [], []
        async for ev in client.stream(rid, timeout_s=120):
            if isinstance(ev, Done):
                ends.append(ev.finish_reason)
                continue
            ids += ev.token_ids
            text.append(ev.text)
            started.set()
        got.append((ids, "".join(text), ends))


def read_until(sock, rid: str, stop, timeout_s: float = 60.0) -> tuple[list[int], list[dict]]:
    """The token ids and the ends (error or done) ``sock`` gets about ``rid`` until
    ``stop(ids, ends)`` holds."""
    ids, ends, deadline = [], [], time.monotonic() + timeout_s
    while not stop(ids, ends):
        assert sock.poll(max(1, int((deadline - time.monotonic()) * 1000))), (ids, ends)
        for frame in sock.recv_multipart():
            got = msgpack.unpackb(frame)
            if got.get("id") == rid:
                ids += got.get("token_ids", [])
                if got["type"] in ("error", "done"):
                    ends.append(got)
    return ids, ends


def test_a_resume_refused_or_of_a_live_stream(model_fleet):
    """Both routers alive. A resume on B whose `chars` is more than its tokens' text is
    refused and the stream stays, for a resume that says what the producer holds; a
    resume of a stream that A still serves moves it: A ends its request at once with
    stream_moved (it used to wait for its deadline, then end it a second time), and B
    streams the rest, exactly the unfaulted run's tokens, and one done. A flood of
    resumes is answered, every one, and B serves on."""
    f, model, (a, b), nodes = model_fleet
    prompt, n = list(range(30, 50)), 600
    greedy = dict(max_tokens=n, temperature=0, ignore_eos=True)
    with QueueClient(b.ingress) as plain:
        want = plain.generate(prompt_token_ids=prompt, timeout_s=120, **greedy)
    on_a, on_b = producer(b"mover", a.ingress), producer(b"mover", b.ingress)
    try:
        on_a.send(msgpack.packb({"type": "submit", "id": "m1", "prompt_token_ids": prompt,
                                 **greedy}))
        held, _ = read_until(on_a, "m1", lambda ids, ends: len(ids) >= 5 or ends)
        refused = answer(on_b, {"type": "resume", "id": "m1", "tokens": len(held),
                                "chars": 10**6})
        assert refused["code"] == "bad_request" and "stream stays" in refused["message"]
        moved_at = time.monotonic()
        on_b.send(msgpack.packb({"type": "resume", "id": "m1", "tokens": len(held)}))
        rest, ends_b = read_until(on_b, "m1", lambda ids, ends: ends)
        more, ends_a = read_until(on_a, "m1", lambda ids, ends: ends)
        assert [e["type"] for e in ends_b] == ["done"] and ends_b[0]["finish_reason"] == \
            "length", ends_b
        assert [e.get("code") for e in ends_a] == ["stream_moved"], ends_a
        assert time.monotonic() - moved_at < 60  # not A's deadline (600 s)
        assert held + rest == want.token_ids
        assert held + more == want.token_ids[:len(held) + len(more)]  # A's, until it moved
        assert not on_a.poll(500) and not on_b.poll(0)  # no second end on either
        # A flood of resumes of ids nobody holds: each answered, the router serves on.
        for i in range(300):
            on_b.send(msgpack.packb({"type": "resume", "id": f"x{i}", "tokens": 0}))
        codes: dict[str, int] = {}
        while sum(codes.values()) < 300:
            assert on_b.poll(30_000), codes
            for frame in on_b.recv_multipart():
                got = msgpack.unpackb(frame)
                codes[got["code"]] = codes.get(got["code"], 0) + 1
        assert set(codes) <= {"stream_not_found", "overloaded"}, codes
        assert complete(b, model)["usage"]["completion_tokens"] == 6
    finally:
        on_a.close()
        on_b.close()


def test_a_stream_outlives_its_router(model_fleet):
    """Router A SIGKILLed mid-stream: a QueueClient given both routers resumes on B and
    gets exactly the remaining tokens, in order, equal to an unfaulted run, and one done.
    A stream nobody resumes is held (a resume claiming too much says how much it made),
    and freed after --stream-keep. A resume of an id no decode node holds, or by another
    producer, is a clear error."""
    f, model, (a, b), nodes = model_fleet
    prompt, n = list(range(5, 25)), 300
    greedy = dict(max_tokens=n, temperature=0, ignore_eos=True)
    with QueueClient(b.ingress) as plain:  # the unfaulted run (the single-router call)
        want = plain.generate(prompt_token_ids=prompt, timeout_s=120, **greedy)
    assert len(want.token_ids) == n
    orphan = producer(b"orphan-producer", a.ingress)  # never resumes
    orphan.send(msgpack.packb({"type": "submit", "id": "o1", "prompt_token_ids": prompt,
                               "max_tokens": 1000 - len(prompt), "ignore_eos": True}))
    assert orphan.poll(60_000), "no tokens for the orphan"
    started, async_got = threading.Event(), []  # the AsyncQueueClient's stream, meanwhile
    later = threading.Thread(target=asyncio.run, args=(async_stream(
        [a.ingress, b.ingress], prompt, greedy, started, async_got),))
    later.start()
    ids, text, dones = [], [], []
    try:
        with QueueClient([a.ingress, b.ingress]) as client:
            rid = client.submit(prompt_token_ids=prompt, **greedy)
            for ev in client.stream(rid, timeout_s=120):
                if isinstance(ev, Done):
                    dones.append(ev)
                    continue
                if not ids:  # both clients are streaming through A: A dies
                    assert started.wait(60), "the async client got no token"
                    os.kill(a.popen.pid, signal.SIGKILL)
                    a.popen.wait()
                ids += ev.token_ids
                text.append(ev.text)
    finally:
        later.join(150)
    assert ids == want.token_ids and "".join(text) == want.text
    assert [d.finish_reason for d in dones] == ["length"] and dones[0].usage == want.usage
    assert async_got == [(want.token_ids, want.text, ["length"])]
    resumed = re.search(rf"stream {rid} \(\S+\) resumed from token (\d+) of (\d+)(, ended)?",
                        nodes[1].log())
    assert resumed and int(resumed.group(1)) < n, nodes[1].log()[-3000:]
    orphan.close()
    again, other = producer(b"orphan-producer", b.ingress), producer(b"someone-else", b.ingress)
    try:
        too_many = answer(again, {"type": "resume", "id": "o1", "tokens": 2**31 - 1})
        assert too_many["code"] == "bad_request" and "the stream has made" in \
            too_many["message"], too_many
        for sock, rid_ in ((other, "o1"), (again, "never-submitted")):
            missing = answer(sock, {"type": "resume", "id": rid_, "tokens": 0})
            assert missing["code"] == "stream_not_found", missing
            assert "no decode node holds stream" in missing["message"], missing
        held_at = time.monotonic()
        wait_for(lambda: answer(again, {"type": "resume", "id": "o1", "tokens": 2**31 - 1})[
            "code"] == "stream_not_found", STREAM_KEEP_S + 30, "the orphan was never freed",
            nodes[1])
        assert time.monotonic() - held_at < STREAM_KEEP_S + 30
    finally:
        again.close()
        other.close()


def test_launch_routers_2_needs_no_etcd(tiny_model, tmp_path):
    """Static discovery: `pdserve launch --routers 2` starts two routers on one machine,
    every node connected to both, and no etcd anywhere."""
    from tests.cluster import launched

    model = tiny_model("llama")
    with launched(model, 1, 1, "--routers", "2", "--compute", "none",
                  log_dir=tmp_path) as c:
        c.metrics_urls()  # waits for the ready table
        second = re.search(r"router 1\s+(http://\S+)/v1, ingress (\S+), control", c.log())
        assert second, c.log()[-3000:]
        urls = [c.http_url, second.group(1)]
        assert urls[0] != urls[1]
        for url in urls:
            r = httpx.post(url + "/v1/completions", timeout=60, json={
                "model": os.path.basename(str(model)), "prompt": "Static routers",
                "max_tokens": 4, "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 4
        assert "etcd" not in c.log()


def test_a_colocated_node_serves_both_routers(tiny_model, tmp_path):
    model = tiny_model("llama")
    with fleet(tmp_path, model) as f:
        routers = [f.router("router-a"), f.router("router-b")]
        node = f.node("colocated", "colocated-0", "--compute", "none")
        for r in routers:
            wait_for(lambda r=r: healthy(r), 120, f"{r.name} not healthy", r, node)
            assert complete(r, model)["usage"]["completion_tokens"] == 6
        (record, epoch), = f.records("nodes").values()
        assert record["role"] == "colocated" and record["node_id"] == "colocated-0"
        assert epoch > 0
