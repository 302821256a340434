"""A hostile client and a hostile peer against one real `pdserve launch` cluster.

Every input found to stop a loop, inject tokens or wedge the router (issue 12) is sent
over the real sockets: HTTP, the queue ingress, the control socket (as a fake node
that registers like a real one) and a decode node's KV socket. After each one:
every process is still the one started, the router's loops still turn (/health shows
their counters moving) and a normal request streams the same text as before.
"""
from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from pathlib import Path

import httpx
import msgpack
import msgspec
import pytest
import torch
import zmq

from pdserve.common import codec
from pdserve.common import errors as E
from pdserve.common import protocol as P
from pdserve.common.transport import make_socket, recv_message, send_message
from pdserve.model.config import ModelConfig
from pdserve.model.loader import model_identity_hash
from pdserve.router.dispatch.batching import MAX_BATCH_BYTES, split_by_size
from tests.cluster import launched

PROMPT = "After the storm"
NORMAL = {"prompt": PROMPT, "temperature": 0, "max_tokens": 8, "ignore_eos": True}


# ------------------------------------------------------------------ the cluster

@pytest.fixture(scope="module")
def model_dir(tiny_model):
    return Path(tiny_model("llama"))


@pytest.fixture(scope="module")
def cluster(model_dir, tmp_path_factory):
    with launched(model_dir, 1, 1, "--reserve-lease", "3",
                  log_dir=tmp_path_factory.mktemp("attack")) as c:
        c.model = model_dir.name
        c.pids = process_tree(c.proc.pid)
        assert len(c.pids) == 4, c.pids  # launcher, router, prefill, decode
        c.baseline = normal_text(c)
        yield c


def process_tree(pid: int) -> set[int]:
    out, todo = set(), [pid]
    while todo:
        p = todo.pop()
        out.add(p)
        try:
            with open(f"/proc/{p}/task/{p}/children") as f:
                todo += [int(c) for c in f.read().split()]
        except FileNotFoundError:
            pass
    return out


def normal_text(c, timeout_s: float = 30.0) -> str:
    """The text of a greedy streamed request."""
    text = ""
    with httpx.Client(base_url=c.http_url, timeout=timeout_s) as client:
        with client.stream("POST", "/v1/completions",
                           json={"model": c.model, **NORMAL, "stream": True}) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    text += json.loads(line[6:])["choices"][0]["text"]
    return text


def loops(c) -> dict:
    r = httpx.get(c.http_url + "/health", timeout=5)
    assert r.status_code == 200, r.text
    return r.json()["loops"]


def still_serving(c) -> None:
    """What must hold after every attack."""
    assert process_tree(c.proc.pid) == c.pids, "a process of the cluster died or restarted"
    before = loops(c)
    started = time.monotonic()
    assert normal_text(c) == c.baseline
    assert time.monotonic() - started < 30
    # both loops turn on: the clock every 50 ms, which a fast request can fall between
    deadline = time.monotonic() + 5
    while True:
        after = loops(c)
        turned = after["tick"] > before["tick"] and after["receive"] > before["receive"]
        if turned or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert turned, (before, after)


def post(c, body: dict, path: str = "/v1/completions", **kw) -> httpx.Response:
    return httpx.post(c.http_url + path, json={"model": c.model, **body}, timeout=60, **kw)


# ------------------------------------------------------------------ a fake node

class FakeNode:
    """Registers with the router as a real node would (right model, right KV layout) and
    then says whatever a test makes it say. A thread answers heartbeats; a fake decode
    node grants every reservation."""

    def __init__(self, c, model_dir: Path, node_id: str, role: str,
                 kv_address: str | None = None, incarnation: str = "fake",
                 grant: bool = True):
        cfg = ModelConfig.from_dir(model_dir)
        self.layout = P.KVLayout(num_layers=cfg.num_hidden_layers,
                                 num_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
                                 dtype="float32", block_size=16)
        self.identity = P.ModelIdentity(name=model_dir.name,
                                        config_hash=model_identity_hash(model_dir))
        self.hello = P.Hello(
            node_id=node_id, role=role, protocol_version=P.PROTOCOL_VERSION,
            model=self.identity, kv_layout=self.layout, kv_address=kv_address, pid=1,
            capacity=P.NodeStats(num_free_blocks=1000, num_total_blocks=1000, num_running=0,
                                 num_waiting=0, queued_prompt_tokens=0),
            incarnation=incarnation)
        self.node_id = node_id
        self.peer = P.peer_identity(node_id, incarnation)  # its KV sockets' identity
        self.grant = grant
        self.ctx = zmq.Context()
        self.sock = make_socket(self.ctx, zmq.DEALER, connect=c.control, identity=node_id)
        self.inbox: list[P.Message] = []
        self.outbox: list[P.Message] = [self.hello]
        self.lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        next_beat = 0.0
        while not self._stop.is_set():
            with self.lock:
                out, self.outbox = self.outbox, []
            for msg in out:
                send_message(self.sock, msg, flags=zmq.NOBLOCK)
            if time.monotonic() > next_beat:
                next_beat = time.monotonic() + 0.2
                send_message(self.sock, P.Heartbeat(node_id=self.node_id, stats=None))
            if self.sock.poll(10):
                msg = recv_message(self.sock)
                if isinstance(msg, P.Reserve):
                    self.send(P.ReserveReply(items=[P.ReserveResult(
                        req_id=r.req_id, ok=self.grant, num_blocks=1,
                        reason="" if self.grant else "no_capacity: fake") for r in msg.items]))
                with self.lock:
                    self.inbox.append(msg)

    def send(self, msg: P.Message) -> None:
        with self.lock:
            self.outbox.append(msg)

    def wait_for(self, kind, timeout_s: float = 30.0):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self.lock:
                for i, msg in enumerate(self.inbox):
                    if isinstance(msg, kind):
                        return self.inbox.pop(i)
            time.sleep(0.01)
        raise TimeoutError(f"{self.node_id}: no {kind.__name__}")

    def close(self, bye: bool = True) -> None:
        if bye:
            self.send(P.Bye(node_id=self.node_id, reason="attack over"))
            time.sleep(0.3)
        self._stop.set()
        self._thread.join(5)
        self.sock.close(0)
        self.ctx.term()

    def last_chunk(self, req: P.PrefillRequest, first_token) -> P.KVChunk:
        lay = self.layout
        blocks = -(-len(req.prompt_token_ids) // lay.block_size)
        shape = (blocks, lay.block_size, lay.num_kv_heads, lay.head_dim)
        tensors = {f"{kv}{i}": torch.zeros(shape) for i in range(lay.num_layers) for kv in "kv"}
        return P.KVChunk(model=self.identity, kv_layout=lay, layer_start=0,
                         layer_end=lay.num_layers, last=True, tensors=tensors,
                         parts=[P.KVPart(req_id=req.req_id, num_tokens=len(req.prompt_token_ids),
                                         first_token=first_token)])


def kv_send(address: str, identity: str | bytes, msg: P.Message) -> P.Message:
    """Sends to a decode node's KV socket as ``identity`` (a prefill node's is
    P.peer_identity(node_id, incarnation)); its answer."""
    ctx = zmq.Context()
    sock = make_socket(ctx, zmq.DEALER, connect=address, identity=identity)
    try:
        send_message(sock, msg)
        assert sock.poll(30_000), "the decode node did not answer"
        return recv_message(sock)
    finally:
        sock.close(0)
        ctx.term()


def ingress_run(c, msg: dict, timeout_s: float = 60.0) -> tuple[list[int], dict]:
    """One ingress request: (its token ids, its final message)."""
    ctx = zmq.Context()
    sock = make_socket(ctx, zmq.DEALER, connect=c.ingress)
    try:
        sock.send(msgpack.packb({"type": "submit", "id": "x", **msg}))
        tokens = []
        while True:
            assert sock.poll(int(timeout_s * 1000)), "no answer from the ingress"
            reply = msgpack.unpackb(sock.recv())
            if reply["type"] == "tokens":
                tokens += reply["token_ids"]
            else:
                return tokens, reply
    finally:
        sock.close(0)
        ctx.term()


# ------------------------------------------------------------------ the attacks

HUGE = [2**64, 2**63, 10**30]


@pytest.mark.parametrize("field, make", [
    ("seed", lambda v: v), ("max_tokens", lambda v: v), ("top_k", lambda v: v),
    ("stop_token_ids", lambda v: [v]), ("prompt", lambda v: [1, v])])
def test_huge_integers_are_a_400_naming_the_field(cluster, field, make):
    for v in HUGE:
        r = post(cluster, {**NORMAL, field: make(v)})
        assert r.status_code == 400, (field, v, r.text)
        assert r.json()["error"]["param"] == field, r.json()
    if field != "top_k":  # (top_k -1 means "off")
        r = post(cluster, {**NORMAL, field: make(-1)})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    # The model's own bounds: context, vocabulary.
    r = post(cluster, {**NORMAL, "max_tokens": 10**6})
    assert r.status_code == 400 and "context" in r.json()["error"]["message"]
    r = post(cluster, {**NORMAL, "top_k": 10**6})
    assert r.status_code == 400 and "vocabulary" in r.json()["error"]["message"]
    # The same through the ingress (msgpack carries up to 2^64 - 1).
    _, reply = ingress_run(cluster, {"prompt": PROMPT, "max_tokens": 4, field: make(2**64 - 1)}
                           if field != "prompt" else
                           {"prompt_token_ids": make(2**64 - 1), "max_tokens": 4})
    assert reply["type"] == "error" and reply["code"] == "bad_request", reply
    assert field in reply["message"], reply
    still_serving(cluster)


def test_edge_limits_are_4xx(cluster):
    r = post(cluster, {**NORMAL, "stop": [f"s{i}" for i in range(50_000)]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop"
    r = post(cluster, {**NORMAL, "stop": ["x" * 257]})
    assert r.status_code == 400 and "257 bytes" in r.json()["error"]["message"]
    deep = {"prompt": PROMPT, "extra": json.loads("[" * 40 + "]" * 40)}
    r = post(cluster, deep)
    assert r.status_code == 400 and "deeper than" in r.json()["error"]["message"]
    r = httpx.post(cluster.http_url + "/v1/completions", content=b"[" * 100_000, timeout=30)
    assert r.status_code == 400
    r = httpx.post(cluster.http_url + "/v1/completions", content=b" " * (5 << 20), timeout=30)
    assert r.status_code == 413
    still_serving(cluster)


def test_a_4mib_prompt_does_not_stall_the_router(cluster):
    big = {**NORMAL, "prompt": "hello world, this is a long prompt. " * 110_000}

    async def go():
        async with httpx.AsyncClient(base_url=cluster.http_url, timeout=120) as client:
            slow = asyncio.create_task(client.post("/v1/completions",
                                                   json={"model": cluster.model, **big}))
            await asyncio.sleep(0.5)  # the big prompt is being tokenized now
            started = time.monotonic()
            r = await client.post("/v1/completions", json={"model": cluster.model, **NORMAL})
            took = time.monotonic() - started
            return took, r, await slow
    took, normal, slow = asyncio.run(go())
    assert normal.status_code == 200 and normal.json()["choices"][0]["text"] == cluster.baseline
    assert took < 2.0, f"a normal request took {took:.2f} s while a big prompt was tokenized"
    assert slow.status_code == 400 and slow.json()["error"]["param"] == "prompt", slow.text
    still_serving(cluster)


def test_hostile_frames_on_control_and_ingress(cluster):
    ctx = zmq.Context()
    try:
        # A 2 MiB header of empty maps (it would grow 64x in memory): refused as too large.
        sock = make_socket(ctx, zmq.DEALER, connect=cluster.control, identity="hostile")
        sock.send(msgpack.packb([P.PROTOCOL_VERSION, ["hello", [{}] * (2 << 20)]]))
        assert sock.poll(10_000)
        err = recv_message(sock)
        assert isinstance(err, P.Error) and err.code == E.TOO_LARGE, err
        sock.close(0)
        ing = make_socket(ctx, zmq.DEALER, connect=cluster.ingress)
        ing.send(msgpack.packb({"type": "submit", "id": "m", "x": [{}] * (1 << 20)}))
        assert ing.poll(10_000)
        reply = msgpack.unpackb(ing.recv())
        assert reply["type"] == "error" and "MessagePack" in reply["message"], reply
        ing.close(0)
    finally:
        ctx.term()
    still_serving(cluster)


def flood(address: str, n: int = 20_000) -> tuple[int, float]:
    """``n`` bad messages as fast as they go from a peer nobody knows: (answers, seconds)."""
    ctx = zmq.Context()
    try:
        sock = make_socket(ctx, zmq.DEALER, connect=address, identity="flooder")
        started = time.monotonic()
        for _ in range(n):
            sock.send(b"not msgpack")
        answers, quiet_since = 0, time.monotonic()
        while time.monotonic() - quiet_since < 1.0:
            if sock.poll(100):
                recv_message(sock)
                answers += 1
                quiet_since = time.monotonic()
        elapsed = time.monotonic() - started
        sock.close(0)
    finally:
        ctx.term()
    return answers, elapsed


@pytest.mark.parametrize("where", ["router control", "decode KV"])
def test_a_flooding_stranger_is_held_to_its_budget(cluster, where):
    """20,000 bad messages from a peer the receiver does not know, as fast as they go: it
    answers only as many as the strangers' shared budget allows (each answer is a decode
    and a reply it would otherwise owe), drops the rest unread and counts them."""
    from pdserve.node.io import KV_STRANGER_BURST, KV_STRANGER_MSGS_PER_S
    from pdserve.router.dispatch.node_messages import STRANGER_BURST, STRANGER_MSGS_PER_S
    from tests.e2e.test_metrics import scrape, value

    if where == "router control":
        address, url = cluster.control, cluster.metrics_urls()["router"]
        burst, rate = STRANGER_BURST, STRANGER_MSGS_PER_S
    else:
        address = re.search(r"KV socket (tcp://\S+)", cluster.log()).group(1)
        url = cluster.metrics_urls()["decode-0"]
        burst, rate = KV_STRANGER_BURST, KV_STRANGER_MSGS_PER_S
    dropped = value(scrape(url)[1], "pdserve_messages_dropped_total", reason="rate_limit")
    answers, elapsed = flood(address)
    assert 0 < answers <= burst + rate * elapsed + 1, (answers, elapsed)
    after = value(scrape(url)[1], "pdserve_messages_dropped_total", reason="rate_limit")
    assert after - dropped >= 20_000 - answers, (dropped, after, answers)
    still_serving(cluster)


def test_bad_kv_address_is_refused_at_hello(cluster, model_dir):
    for address in ("garbage", "tcp://999.1.1.1:5600", "tcp://127.0.0.1:0", "tcp://a b:5"):
        fake = FakeNode(cluster, model_dir, "fake-d", "decode", kv_address=address)
        try:
            welcome = fake.wait_for(P.Welcome)
            assert not welcome.accepted and "kv_address" in welcome.reason, welcome
        finally:
            fake.close(bye=False)
    still_serving(cluster)


def test_unreachable_decode_node_costs_no_process(cluster, model_dir):
    """A decode node that announces an address nobody listens on gets a request: its KV
    cannot be sent, the request moves to the real decode node and completes."""
    fake = FakeNode(cluster, model_dir, "fake-d2", "decode",
                    kv_address="tcp://no-such-host.invalid:5600")
    try:
        assert fake.wait_for(P.Welcome).accepted
        texts = [post(cluster, NORMAL).json()["choices"][0]["text"] for _ in range(3)]
        assert texts == [cluster.baseline] * 3
    finally:
        fake.close()
    still_serving(cluster)


def test_bad_first_token_in_an_open_reservation(cluster, model_dir):
    """A fake prefill node gets a request (and so the decode node's reservation for it),
    then sends the last KV chunk with first_token None or outside the vocabulary."""
    fake = FakeNode(cluster, model_dir, "fake-p", "prefill")
    vocab = ModelConfig.from_dir(model_dir).vocab_size
    try:
        assert fake.wait_for(P.Welcome).accepted
        for first_token in (None, vocab + 5):
            async def go():
                async with httpx.AsyncClient(base_url=cluster.http_url, timeout=60) as client:
                    # Round robin: one of two requests is the fake node's.
                    return await asyncio.gather(*(client.post("/v1/completions", json={
                        "model": cluster.model, **NORMAL}) for _ in range(2)))

            async def attack():
                replies = asyncio.create_task(go())
                batch = await asyncio.to_thread(fake.wait_for, P.PrefillBatch)
                req = batch.requests[0]
                ack = await asyncio.to_thread(kv_send, req.kv_address, fake.peer,
                                              fake.last_chunk(req, first_token))
                return ack, await replies
            ack, replies = asyncio.run(attack())
            (result,) = ack.results
            assert not result.ok and "first_token" in result.reason, ack
            codes = sorted(r.status_code for r in replies)
            assert codes == [200, 500], [r.text for r in replies]
            failed = next(r for r in replies if r.status_code == 500).json()["error"]
            assert "first_token" in failed["message"], failed
    finally:
        fake.close()
    still_serving(cluster)


def _mutations(fake, vocab):
    """(name, make(req) -> KVChunk, what the decode node must say, whether the request
    then fails): a reference of the KV contract (docs/protocol.md) written here, not
    derived from the node's checks. A checksum mismatch is a transfer fault another try
    can fix: the router retries the request, which completes."""
    from pdserve.common.codec import checksum_of

    def valid(req, first_token=7):
        return fake.last_chunk(req, first_token)

    def with_layout(req, **kw):
        chunk = valid(req)
        lay = msgspec.structs.replace(chunk.kv_layout, **kw)
        dtype = codec.TORCH_DTYPES[lay.dtype]
        return msgspec.structs.replace(chunk, kv_layout=lay, tensors={
            n: t.to(dtype) for n, t in chunk.tensors.items()})

    def with_part(chunk, **kw):
        return msgspec.structs.replace(chunk, parts=[msgspec.structs.replace(chunk.parts[0], **kw)])

    def tokens(req):
        chunk = valid(req)
        n = chunk.parts[0].num_tokens + chunk.kv_layout.block_size  # one block more
        return msgspec.structs.replace(with_part(chunk, num_tokens=n), tensors={
            k: torch.zeros(t.shape[0] + 1, *t.shape[1:]) for k, t in chunk.tensors.items()})

    def checksums(req):
        chunk = valid(req)
        sums = [checksum_of(t) for t in chunk.tensors.values()]
        return msgspec.structs.replace(chunk, checksums=[sums[0] ^ 1, *sums[1:]])

    def missing_layers(req):
        chunk = valid(req)
        return msgspec.structs.replace(chunk, layer_start=1, tensors={
            k: t for k, t in chunk.tensors.items() if k[1:] != "0"})

    other_model = P.ModelIdentity(name=fake.identity.name, config_hash="0" * 16)
    return [
        ("model", lambda r: msgspec.structs.replace(valid(r), model=other_model), "model", True),
        ("dtype", lambda r: with_layout(r, dtype="float16"), "layout", True),
        ("num_tokens", tokens, "tokens", True),
        ("checksum", checksums, "checksum", False),
        ("missing layers", missing_layers, "never sent", True),
        ("first_token -1", lambda r: valid(r, -1), "first_token", True),
        ("first_token = vocab", lambda r: valid(r, vocab), "first_token", True),
        ("valid", valid, None, False),
    ]


def test_kv_inside_an_open_reservation(cluster, model_dir):
    """Malformed KV for a request the decode node holds blocks for: each refused with its
    reason (the request fails with it), the valid one placed (the request completes)."""
    fake = FakeNode(cluster, model_dir, "fake-kv", "prefill")
    vocab = ModelConfig.from_dir(model_dir).vocab_size
    try:
        assert fake.wait_for(P.Welcome).accepted
        for name, make, refusal, fails in _mutations(fake, vocab):
            async def attack():
                async with httpx.AsyncClient(base_url=cluster.http_url, timeout=60) as client:
                    replies = asyncio.gather(*(client.post("/v1/completions", json={
                        "model": cluster.model, **NORMAL}) for _ in range(2)))
                    batch = await asyncio.to_thread(fake.wait_for, P.PrefillBatch)
                    req = batch.requests[0]
                    if refusal is None:  # a prefill node says its first token first
                        fake.send(P.FirstTokens(items=[P.FirstToken(req_id=req.req_id,
                                                                    token_id=7)]))
                    ack = await asyncio.to_thread(kv_send, req.kv_address, fake.peer,
                                                  make(req))
                    return ack, await replies
            ack, replies = asyncio.run(attack())
            assert isinstance(ack, P.KVAck) and len(ack.results) == 1, (name, ack)
            (result,) = ack.results
            assert result.ok == (refusal is None), (name, ack)
            assert refusal is None or refusal in result.reason, (name, result.reason)
            codes = sorted(r.status_code for r in replies)
            assert codes == ([200, 500] if fails else [200, 200]), (name, codes)
            if not fails:
                continue
            failed = next(r for r in replies if r.status_code == 500).json()["error"]
            assert refusal in failed["message"], (name, failed)
    finally:
        fake.close()
    still_serving(cluster)


def test_kv_only_from_the_prefill_node_the_reservation_names(cluster, model_dir):
    """Another peer sends a valid last chunk for a reservation it was not named in: refused,
    and the reservation stands, so the named prefill node's KV is then placed and the
    request completes."""
    fake = FakeNode(cluster, model_dir, "fake-named", "prefill")
    try:
        assert fake.wait_for(P.Welcome).accepted

        async def attack():
            async with httpx.AsyncClient(base_url=cluster.http_url, timeout=60) as client:
                replies = asyncio.gather(*(client.post("/v1/completions", json={
                    "model": cluster.model, **NORMAL}) for _ in range(2)))
                req = (await asyncio.to_thread(fake.wait_for, P.PrefillBatch)).requests[0]
                intruder = await asyncio.to_thread(kv_send, req.kv_address, "intruder",
                                                   fake.last_chunk(req, 7))
                fake.send(P.FirstTokens(items=[P.FirstToken(req_id=req.req_id, token_id=7)]))
                named = await asyncio.to_thread(kv_send, req.kv_address, fake.peer,
                                                fake.last_chunk(req, 7))
                return intruder, named, await replies
        intruder, named, replies = asyncio.run(attack())
        ((intruder,), (named,)) = intruder.results, named.results
        assert not intruder.ok and "only from prefill node 'fake-named'" in intruder.reason
        assert named.ok, named.reason
        assert sorted(r.status_code for r in replies) == [200, 200], [r.text for r in replies]
    finally:
        fake.close()
    still_serving(cluster)


def test_injected_tokens_never_reach_a_client(cluster, model_dir):
    """A registered node sends tokens for requests it does not serve (ingress request ids
    on the wire are guessable: req-N), and a first token twice for one it does."""
    prompt = [5, 6, 7, 8, 9]
    want, _ = ingress_run(cluster, {"prompt_token_ids": prompt, "max_tokens": 40,
                                    "temperature": 0, "ignore_eos": True})
    fake = FakeNode(cluster, model_dir, "fake-inj", "decode", kv_address="tcp://127.0.0.1:9",
                    grant=False)  # registered, yet never serves a request
    try:
        assert fake.wait_for(P.Welcome).accepted
        stop = threading.Event()

        def spam():
            ids = [f"req-{i}" for i in range(300)] + [f"req-{i}~1" for i in range(300)]
            while not stop.is_set():
                fake.send(P.FirstTokens(items=[P.FirstToken(req_id=r, token_id=3) for r in ids]))
                fake.send(P.TokenBatch(items=[P.TokenItem(req_id=r, token_ids=[3, 3])
                                              for r in ids]))
                fake.send(P.Error(req_id=ids[0], code=E.INTERNAL, message="injected"))
                time.sleep(0.02)
        spammer = threading.Thread(target=spam)
        spammer.start()
        try:
            got = [ingress_run(cluster, {"prompt_token_ids": prompt, "max_tokens": 40,
                                         "temperature": 0, "ignore_eos": True})
                   for _ in range(2)]
        finally:
            stop.set()
            spammer.join()
        assert all(t == want and end["type"] == "done" for t, end in got), got
    finally:
        fake.close()
    still_serving(cluster)


def test_duplicate_first_token_is_delivered_once(cluster, model_dir):
    prompt = [11, 12, 13, 14]
    fake = FakeNode(cluster, model_dir, "fake-dup", "prefill")
    try:
        assert fake.wait_for(P.Welcome).accepted

        async def attack():
            first = asyncio.create_task(asyncio.to_thread(ingress_run, cluster, {
                "prompt_token_ids": prompt, "max_tokens": 12, "temperature": 0,
                "ignore_eos": True}))
            second = asyncio.create_task(asyncio.to_thread(ingress_run, cluster, {
                "prompt_token_ids": prompt, "max_tokens": 12, "temperature": 0,
                "ignore_eos": True}))
            batch = await asyncio.to_thread(fake.wait_for, P.PrefillBatch)
            req = batch.requests[0]
            for _ in range(3):  # its first token, then twice again, then tokens it may not
                fake.send(P.FirstTokens(items=[P.FirstToken(req_id=req.req_id, token_id=42)]))
            fake.send(P.TokenBatch(items=[P.TokenItem(req_id=req.req_id, token_ids=[43])]))
            await asyncio.sleep(0.5)
            fake.send(P.Bye(node_id="fake-dup", reason="gone"))  # the rest moves elsewhere
            return await first, await second
        results = asyncio.run(attack())
    finally:
        fake.close(bye=False)
    rest, _ = ingress_run(cluster, {"prompt_token_ids": prompt + [42], "max_tokens": 11,
                                    "temperature": 0, "ignore_eos": True})
    normal, _ = ingress_run(cluster, {"prompt_token_ids": prompt, "max_tokens": 12,
                                      "temperature": 0, "ignore_eos": True})
    got = sorted(tokens for tokens, end in results)
    assert all(end["type"] == "done" for _, end in results), results
    assert got == sorted([[42] + rest, normal]), got
    still_serving(cluster)


def test_a_batch_over_the_frame_limit_is_split():
    """The router's cut of one node's requests: every part encodes under the limit."""
    spec = P.SamplingParams(max_tokens=1, temperature=0.0)
    reqs = [P.PrefillRequest(req_id=f"r{i}", prompt_token_ids=[70_000 + i] * 2000,
                             sampling=spec, decode_node_id="d", kv_address="tcp://h:1",
                             timeout_s=1.0) for i in range(2000)]
    with pytest.raises(P.ProtocolError):  # what used to strand them all
        codec.encode(P.PrefillBatch(requests=reqs))
    parts = split_by_size(reqs, MAX_BATCH_BYTES)
    assert [r for part in parts for r in part] == reqs and len(parts) > 1
    for part in parts:
        assert len(codec.encode(P.PrefillBatch(requests=part))[0]) <= MAX_BATCH_BYTES


def test_no_attack_reached_a_handler_failure(cluster):
    """Every input above was refused by a check: none needed the containment net."""
    from tests.e2e.test_metrics import scrape, value

    for name, url in cluster.metrics_urls().items():
        assert value(scrape(url)[1], "pdserve_internal_errors_total") == 0, name
    assert "Traceback" not in cluster.log(), cluster.log()[-3000:]
    still_serving(cluster)
