"""The router's dispatch driven directly: events in, messages and client events out.

No process, no socket, no sleep: a ``Rig`` plays the nodes (it reads the messages the
dispatch returns and answers them as a node would) and the client (it collects each
request's events and checks that nothing follows a terminal one). Time is a number the
test moves on.
"""
from __future__ import annotations

import msgpack
import pytest

from pdserve.common import errors as E
from pdserve.common import protocol as P
from pdserve.common.block_hash import block_hashes
from pdserve.common.kv_events import decode_batch
from pdserve.common.metrics import RouterMetrics
from pdserve.common.sampling import SamplingParams
from pdserve.router import streams as S
from pdserve.router.config import RouterConfig
from pdserve.router.dispatch import batching
from pdserve.router.dispatch.batching import request_bytes
from pdserve.router.dispatch.dispatch import MAX_ATTEMPTS, RETRY_RESERVE_S, Dispatch
from pdserve.router.dispatch.flight import State
from pdserve.router.dispatch.node_messages import MAX_EARLY_TOKENS
from pdserve.router.dispatch.registry import Registry

MODEL = P.ModelIdentity(name="m", config_hash="h")
BLOCK = 4
VOCAB = 1000
EOS = 2


def hello(role: str, node_id: str, pid: int = 1) -> P.Hello:
    stats = P.NodeStats(num_free_blocks=64, num_total_blocks=64, num_running=0,
                        num_waiting=0, queued_prompt_tokens=0)
    return P.Hello(node_id=node_id, role=role, protocol_version=P.PROTOCOL_VERSION,
                   model=MODEL, kv_layout=P.KVLayout(num_layers=2, num_kv_heads=2,
                                                     head_dim=16, dtype="float32",
                                                     block_size=BLOCK),
                   capacity=stats, pid=pid, kv_events="tcp://127.0.0.1:6999",
                   kv_address=f"tcp://127.0.0.1:{7000 + len(node_id)}"
                   if role == "decode" else None)


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, **kw)


class Rig:
    """A dispatch over a registry of the given (role, node id) nodes, the nodes' inboxes
    and the clients' streams."""

    def __init__(self, *nodes: tuple[str, str], policy: str = "least_loaded", **config):
        self.registry = Registry(MODEL, 2, 2, 16, heartbeat_interval_s=1.0, liveness=3)
        self.now = 100.0
        for role, node_id in nodes:
            self.join(role, node_id)
        self.metrics = RouterMetrics("m", error_codes=S.HTTP_STATUS)
        self.d = Dispatch(self.registry, policy, self.metrics, RouterConfig(**config), VOCAB,
                          (EOS,), max_model_len=1 << 22)
        self.inbox: list[tuple[str, P.Message]] = []    # sent, not yet read by a test
        self.tokens: dict[str, list[int]] = {}          # what each client has seen
        self.end: dict[str, S.StreamEvent] = {}         # each client's terminal event
        self.dropped: list[tuple[str, str, str, str]] = []

    # -- the world -----------------------------------------------------------------------
    def join(self, role: str, node_id: str) -> None:
        ok, why = self.registry.admit(hello(role, node_id), now=self.now)
        assert ok, why

    def apply(self, out):
        self.inbox += out.sends
        self.dropped += out.dropped
        for req_id, ev in out.events:
            assert req_id not in self.end, f"{req_id}: an event after its terminal one"
            self.tokens.setdefault(req_id, []).extend(ev.token_ids)
            if ev.is_last:
                self.end[req_id] = ev
        return out

    def submit(self, prompt=(5, 6, 7, 8, 9), params=None, **kw) -> str:
        req = S.GenerationRequest(list(prompt), params or greedy(10), **kw)
        req_id, out = self.d.submit(req, self.now)
        self.tokens.setdefault(req_id, [])
        self.apply(out)
        return req_id

    def flush(self):
        return self.apply(self.d.flush(self.now))

    def tick(self, dt: float = 0.0):
        self.now += dt
        return self.apply(self.d.tick(self.now))

    def gone(self, node_id: str):
        return self.apply(self.d.node_gone(self.registry.remove(node_id), f"{node_id} died",
                                           self.now))

    def cancel(self, req_id: str):
        return self.apply(self.d.cancel(req_id, self.now))

    def say(self, node_id: str, msg: P.Message):
        return self.apply(self.d.node_message(node_id, msg, self.now))

    # -- what the nodes got ----------------------------------------------------------------
    def read(self, node_id: str | None = None, kind: type | None = None) -> list[P.Message]:
        """The messages for ``node_id`` (any node: None) of ``kind``, removed from the
        inbox."""
        got = [(n, m) for n, m in self.inbox
               if (node_id is None or n == node_id) and (kind is None or isinstance(m, kind))]
        self.inbox = [x for x in self.inbox if x not in got]
        return [m for _, m in got]

    def one(self, node_id: str, kind: type) -> P.Message:
        got = self.read(node_id, kind)
        assert len(got) == 1, (node_id, kind.__name__, got, self.inbox)
        return got[0]

    def reserves(self, node_id: str | None = None) -> list[P.ReserveRequest]:
        """The reservations sent to ``node_id`` (any: None) once the turn ended (a flush),
        taken out of their Reserve messages."""
        self.flush()
        return [r for m in self.read(node_id, P.Reserve) for r in m.items]

    def one_reserve(self, node_id: str) -> P.ReserveRequest:
        got = self.reserves(node_id)
        assert len(got) == 1, (node_id, got, self.inbox)
        return got[0]

    def aborted(self) -> dict[str, set[str]]:
        """Node id -> wire ids aborted there (read from the inbox)."""
        out: dict[str, set[str]] = {}
        for n, m in [(n, m) for n, m in self.inbox if isinstance(m, P.Abort)]:
            out.setdefault(n, set()).update(m.req_ids)
        self.inbox = [(n, m) for n, m in self.inbox if not isinstance(m, P.Abort)]
        return out

    # -- a node's answers ------------------------------------------------------------------
    def grant(self, node_id: str, wire_id: str, cached: int = 0):
        return self.say(node_id, P.ReserveReply(items=[P.ReserveResult(
            req_id=wire_id, ok=True, reason="", num_blocks=4, cached_blocks=cached)]))

    def refuse(self, node_id: str, wire_id: str, reason: str = "no_capacity: full"):
        return self.say(node_id, P.ReserveReply(items=[P.ReserveResult(
            req_id=wire_id, ok=False, reason=reason, num_blocks=0)]))

    def first(self, node_id: str, wire_id: str, token: int, finish: str | None = None):
        return self.say(node_id, P.FirstTokens(items=[P.FirstToken(
            req_id=wire_id, token_id=token, finish_reason=finish)]))

    def stream(self, node_id: str, wire_id: str, ids: list[int], finish: str | None = None):
        return self.say(node_id, P.TokenBatch(items=[P.TokenItem(
            req_id=wire_id, token_ids=list(ids), finish_reason=finish)]))

    def to_prefill(self, decode: str, prefill: str, wire_id: str) -> P.PrefillRequest:
        """Grants ``wire_id``'s Reserve on ``decode``, flushes, and returns its request in
        the PrefillBatch ``prefill`` got."""
        reserve = self.one_reserve(decode)
        assert reserve.req_id == wire_id and reserve.prefill_node_id == prefill
        self.grant(decode, wire_id)
        self.flush()
        (req,) = self.one(prefill, P.PrefillBatch).requests
        assert req.req_id == wire_id and req.decode_node_id == decode
        return req


def counted(metrics: RouterMetrics, name: str, **labels) -> float:
    value = metrics.registry.get_sample_value(name, {"model_name": "m", **labels})
    return value or 0.0


# -- the way through ------------------------------------------------------------------------
def test_reserve_before_prefill_then_tokens_reach_the_client_once_in_order():
    rig = Rig(("prefill", "p0"), ("decode", "d0"))
    rid = rig.submit(params=greedy(4))
    reserve = rig.one_reserve("d0")
    assert reserve.req_id == rid and reserve.prompt_token_ids == [5, 6, 7, 8, 9]
    rig.flush()
    assert not rig.read("p0"), "prefill must wait for the reservation"
    rig.grant("d0", rid, cached=9)       # more than the prompt has: capped
    rig.flush()
    (req,) = rig.one("p0", P.PrefillBatch).requests
    assert (req.decode_node_id, req.kv_address) == ("d0", rig.registry.nodes["d0"].hello.
                                                     kv_address)
    assert req.skip_blocks == (5 - 1) // BLOCK   # never the block holding the last token
    rig.first("p0", rid, 11)
    assert rig.tokens[rid] == [11] and rig.d.requests[rid].state is State.DECODING
    rig.stream("d0", rid, [12, 13])
    rig.stream("d0", rid, [14], finish="length")
    assert rig.tokens[rid] == [11, 12, 13, 14]
    end = rig.end[rid]
    assert end.finish_reason == "length" and end.error is None
    assert (end.prompt_tokens, end.completion_tokens) == (5, 4)
    assert not rig.aborted(), "the nodes finished it themselves: nothing to abort"
    assert not rig.d.flights and not rig.d.requests
    assert not rig.d.placement.requests("d0") and not rig.d.placement.requests("p0")
    assert rig.d.placement.queued_tokens("p0") == 0
    assert counted(rig.metrics, "pdserve_requests_total", finish_reason="length") == 1
    assert counted(rig.metrics, "pdserve_generation_tokens_total") == 4


def test_the_router_stops_at_max_tokens_and_aborts_what_the_nodes_still_hold():
    rig = Rig(("prefill", "p0"), ("decode", "d0"))
    rid = rig.submit(params=greedy(2))
    rig.to_prefill("d0", "p0", rid)
    rig.first("p0", rid, 11)
    rig.stream("d0", rid, [12, 13, 14])      # a node that overshoots: the router cuts
    assert rig.tokens[rid] == [11, 12] and rig.end[rid].finish_reason == "length"
    assert rig.aborted() == {"p0": {rid}, "d0": {rid}}


def test_one_prefill_batch_per_prefill_node_per_flush():
    rig = Rig(("prefill", "p0"), ("prefill", "p1"), ("decode", "d0"), ("decode", "d1"))
    # Six submitted in one turn: each counts as its prefill node's load from its pick, so
    # they spread over both prefill nodes before any reply came (and over both decode
    # nodes: one Reserve each).
    rids = [rig.submit(prompt=[10 + i] * 6) for i in range(6)]
    reserves = {n: rig.read(n, P.Reserve) for n in ("d0", "d1")} if rig.flush() else {}
    assert [[len(m.items) for m in r] for r in reserves.values()] == [[3], [3]]
    for node, msgs in reserves.items():
        for r in msgs[0].items:
            rig.grant(node, r.req_id)
    rig.flush()
    batches = {n: rig.read(n, P.PrefillBatch) for n in ("p0", "p1")}
    assert [[len(m.requests) for m in b] for b in batches.values()] == [[3], [3]]
    sent = sorted(r.req_id for b in batches.values() for r in b[0].requests)
    assert sent == sorted(rids)
    assert not rig.flush().sends, "a second flush has nothing left to send"


def test_messages_per_request_at_concurrency_64():
    """64 requests in flight through one prefill and one decode node: what the router sends
    per request. A regression to per-request sends of a batched message fails here."""
    rig = Rig(("prefill", "p0"), ("decode", "d0"))
    ids = [rig.submit(params=greedy(3)) for _ in range(64)]
    assert not rig.inbox, "nothing leaves before the turn ends"
    rig.flush()
    (reserve,) = rig.read("d0", P.Reserve)          # one message for all 64
    assert [r.req_id for r in reserve.items] == ids
    rig.say("d0", P.ReserveReply(items=[P.ReserveResult(req_id=i, ok=True, reason="",
                                                        num_blocks=2) for i in ids]))
    rig.flush()
    (batch,) = rig.read("p0", P.PrefillBatch)        # one message for all 64
    assert [r.req_id for r in batch.requests] == ids
    rig.say("p0", P.FirstTokens(items=[P.FirstToken(req_id=i, token_id=11) for i in ids]))
    rig.say("d0", P.TokenBatch(items=[P.TokenItem(req_id=i, token_ids=[12, 13],
                                                  finish_reason="length") for i in ids]))
    assert all(rig.tokens[i] == [11, 12, 13] and rig.end[i].finish_reason == "length"
               for i in ids)
    assert not rig.inbox, f"nothing else is sent: {rig.inbox[:3]}"
    # 64 more, each ended by the router in one event (an end-of-sequence token the node
    # did not stop at): one Abort per node for all of them.
    ids = [rig.submit(params=SamplingParams(max_tokens=8, temperature=0)) for _ in range(64)]
    rig.flush()
    rig.say("d0", P.ReserveReply(items=[P.ReserveResult(req_id=i, ok=True, reason="",
                                                        num_blocks=2) for i in ids]))
    rig.flush()
    rig.one("d0", P.Reserve)
    rig.one("p0", P.PrefillBatch)
    rig.say("p0", P.FirstTokens(items=[P.FirstToken(req_id=i, token_id=11) for i in ids]))
    rig.say("d0", P.TokenBatch(items=[P.TokenItem(req_id=i, token_ids=[EOS]) for i in ids]))
    assert all(rig.end[i].finish_reason == "stop" for i in ids)
    assert rig.one("d0", P.Abort).req_ids == ids and rig.one("p0", P.Abort).req_ids == ids
    assert not rig.inbox, f"nothing else is sent: {rig.inbox[:3]}"


def test_prefill_load_counts_from_the_pick_and_returns_to_zero():
    """A request counts as its prefill node's load from the moment it is picked (so one
    turn's requests spread), and every way out takes it off again: refusal and re-pick,
    a failover, the first token, cancellation."""
    rig = Rig(("prefill", "p0"), ("prefill", "p1"), ("decode", "d0"), ("decode", "d1"))
    rids = [rig.submit(prompt=[7] * 8) for _ in range(8)]

    def loads():
        return [rig.d.placement.queued_tokens(p) for p in ("p0", "p1")]
    assert loads() == [32, 32]
    reserves = rig.reserves()
    for r in reserves[:2]:                  # refused: picked again, counted once
        rig.refuse(rig.d.flights[r.req_id].decode_node, r.req_id)
    assert sum(loads()) == 64
    rig.cancel(rids[7])
    assert sum(loads()) == 56
    pending = {r.req_id for r in reserves[2:7]} | {r.req_id for r in rig.reserves()}
    for wire_id in pending:
        flight = rig.d.flights[wire_id]
        rig.grant(flight.decode_node, wire_id)
    rig.flush()
    rig.gone("d1")                          # its requests move: counted again, not twice
    assert sum(loads()) == 56
    while rig.d.flights:
        for r in rig.reserves():
            rig.grant(rig.d.flights[r.req_id].decode_node, r.req_id)
        rig.flush()
        for node in ("p0", "p1"):
            for batch in rig.read(node, P.PrefillBatch):
                for req in batch.requests:
                    rig.first(node, req.req_id, 11)
                    rig.stream(req.decode_node_id, req.req_id, [12] * 9, "length")
    assert loads() == [0, 0]
    assert all(rig.end[r].finish_reason in ("length", "abort") for r in rids)


def test_a_batch_over_the_size_limit_is_split_and_a_request_too_big_alone_fails(
        monkeypatch):
    limit = 3000   # the real limit (MAX_BATCH_BYTES) needs million-token prompts
    monkeypatch.setattr(batching, "MAX_BATCH_BYTES", limit)
    rig = Rig(("prefill", "p0"), ("decode", "d0"))
    n = (limit // 2 - 600) // 5                # two of these fit under the limit, not three
    rids = [rig.submit(prompt=[7] * n, params=greedy(1)) for _ in range(3)]
    huge = rig.submit(prompt=[7] * (limit // 5), params=greedy(1))
    for m in rig.reserves("d0"):
        rig.grant("d0", m.req_id)
    rig.flush()
    batches = rig.read("p0", P.PrefillBatch)
    assert [[r.req_id for r in b.requests] for b in batches] == [rids[:2], rids[2:]]
    assert all(sum(request_bytes(r) for r in b.requests) <= limit for b in batches)
    assert rig.end[huge].error.code == S.BAD_REQUEST and "limit" in rig.end[huge].error.message
    assert huge in rig.aborted()["d0"]     # its reservation is given back


def test_colocated_node_needs_no_reservation():
    rig = Rig(("colocated", "c0"))
    rid = rig.submit(params=greedy(3))
    assert not rig.reserves("c0")
    rig.flush()
    (req,) = rig.one("c0", P.PrefillBatch).requests
    assert req.decode_node_id == "c0" and req.req_id == rid
    rig.stream("c0", rid, [12])              # its decode step beat its own first token
    assert rig.tokens[rid] == []
    rig.first("c0", rid, 11)
    rig.stream("c0", rid, [13], finish="length")
    assert rig.tokens[rid] == [11, 12, 13] and rig.end[rid].finish_reason == "length"
    assert not rig.d.placement.requests("c0")


# -- failover at every stage ----------------------------------------------------------------
def test_decode_node_gone_while_reserving_moves_the_request():
    rig = Rig(("prefill", "p0"), ("decode", "d0"), ("decode", "d1"))
    rid = rig.submit()
    first = rig.reserves(None)[0]
    dead = "d0" if rig.d.requests[rid].decode_node == "d0" else "d1"
    alive = {"d0": "d1", "d1": "d0"}[dead]
    assert first.req_id == rid
    rig.gone(dead)
    rig.grant(dead, rid)                     # a late word from the dead: not registered
    assert rig.dropped[-1][3] == "the node is not registered"
    req = rig.to_prefill(alive, "p0", f"{rid}~1")
    assert req.prompt_token_ids == [5, 6, 7, 8, 9]
    rig.first("p0", f"{rid}~1", 11)
    rig.stream(alive, f"{rid}~1", [12] * 9)
    assert rig.tokens[rid] == [11] + [12] * 9 and rig.end[rid].finish_reason == "length"


def test_decode_node_gone_while_prefilling_aborts_the_prefill_and_goes_again():
    rig = Rig(("prefill", "p0"), ("decode", "d0"))
    rid = rig.submit()
    rig.to_prefill("d0", "p0", rid)
    rig.join("decode", "d1")
    rig.gone("d0")
    assert rig.aborted() == {"p0": {rid}}
    # the new attempt's prompt alone counts as p0's load (the old one's was taken off)
    assert rig.d.placement.queued_tokens("p0") == 5
    rig.to_prefill("d1", "p0", f"{rid}~1")
    rig.first("p0", rid, 99)                 # the old attempt's first token: ignored
    assert rig.tokens[rid] == []
    rig.first("p0", f"{rid}~1", 11)
    assert rig.tokens[rid] == [11]


def test_decode_node_gone_mid_stream_resumes_with_the_streamed_tokens():
    """A seeded sampled request: the new attempt carries prompt + streamed tokens, the
    same seed and where its random stream stopped; the client sees each token once."""
    rig = Rig(("prefill", "p0"), ("decode", "d0"), ("decode", "d1"))
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=1234, ignore_eos=True,
                            min_tokens=4)
    rid = rig.submit(prompt=[5, 6, 7], params=params)
    serving = rig.d.requests[rid].decode_node
    other = {"d0": "d1", "d1": "d0"}[serving]
    rig.to_prefill(serving, "p0", rid)
    rig.first("p0", rid, 11)
    rig.stream(serving, rid, [12, 13])
    rig.gone(serving)
    assert rig.aborted() == {"p0": {rid}}     # the prefill node may still be sending KV
    reserve = rig.one_reserve(other)
    assert reserve.req_id == f"{rid}~1" and reserve.prompt_token_ids == [5, 6, 7, 11, 12, 13]
    spec = reserve.sampling
    assert (spec.seed, spec.seed_offset, spec.max_tokens, spec.min_tokens) == (1234, 3, 3, 1)
    rig.grant(other, f"{rid}~1")
    rig.flush()
    (req,) = rig.one("p0", P.PrefillBatch).requests
    assert req.prompt_token_ids == [5, 6, 7, 11, 12, 13] and req.sampling == spec
    rig.stream(serving, rid, [77])           # the dead node's last words
    rig.stream(other, rid, [78])             # the new node, under the old wire id
    rig.first("p0", f"{rid}~1", 14)
    rig.stream(other, f"{rid}~1", [15, 16], finish="length")
    assert rig.tokens[rid] == [11, 12, 13, 14, 15, 16]
    assert rig.end[rid].finish_reason == "length" and rig.end[rid].completion_tokens == 6


def test_prefill_node_gone_releases_the_reservation_and_uses_another():
    rig = Rig(("prefill", "p0"), ("decode", "d0"))
    rid = rig.submit()
    rig.to_prefill("d0", "p0", rid)
    rig.join("prefill", "p1")
    rig.gone("p0")
    assert rig.aborted() == {"d0": {rid}}     # its blocks were held for p0's KV only
    rig.to_prefill("d0", "p1", f"{rid}~1")


def test_prefill_node_gone_during_the_reservation_goes_round_again():
    rig = Rig(("prefill", "p0"), ("decode", "d0"))
    rid = rig.submit()
    rig.one_reserve("d0")
    rig.join("prefill", "p1")
    rig.gone("p0")
    assert not rig.aborted()  # p0 holds nothing of it yet; d0 is asked to hold KV for p0
    rig.grant("d0", rid)      # but KV only from p0: the reservation is useless
    assert rig.aborted() == {"d0": {rid}}
    reserve = rig.one_reserve("d0")
    assert reserve.req_id == f"{rid}~1" and reserve.prefill_node_id == "p1"
    assert rig.d.requests[rid].failures == 0, "nobody failed: no attempt used up"
    rig.grant("d0", rid)                     # the old reservation's grant again: given back
    assert rig.aborted() == {"d0": {rid}}


def test_colocated_node_gone_sends_prompt_and_tokens_to_another():
    rig = Rig(("colocated", "c0"), ("colocated", "c1"))
    rid = rig.submit(prompt=[5, 6], params=greedy(4))
    rig.flush()
    (dead, batch), = [(n, m) for n, m in rig.inbox if isinstance(m, P.PrefillBatch)]
    alive = {"c0": "c1", "c1": "c0"}[dead]
    rig.read(dead)
    rig.first(dead, rid, 11)
    rig.stream(dead, rid, [12])
    rig.gone(dead)
    assert not rig.aborted(), "nothing to tell: the only node serving it is gone"
    rig.flush()
    (req,) = rig.one(alive, P.PrefillBatch).requests
    assert (req.req_id, req.prompt_token_ids, req.decode_node_id) == (
        f"{rid}~1", [5, 6, 11, 12], alive)
    rig.first(alive, f"{rid}~1", 13)
    rig.stream(alive, f"{rid}~1", [14], finish="length")
    assert rig.tokens[rid] == [11, 12, 13, 14]


def test_unsent_messages_count_as_a_refusal_or_a_failed_attempt():
    rig = Rig(("prefill", "p0"), ("decode", "d0"), ("decode", "d1"))
    rid = rig.submit()
    (reserve,) = rig.reserves(None)
    first = rig.d.requests[rid].decode_node
    rig.apply(rig.d.send_failed(first, P.Reserve(items=[reserve]), rig.now))
    other = rig.d.requests[rid].decode_node
    assert other not in (first, None)
    req = rig.to_prefill(other, "p0", rid)    # a refusal: the same attempt, the same id
    rig.apply(rig.d.send_failed("p0", P.PrefillBatch(requests=[req]), rig.now))
    assert rig.aborted() == {"p0": {rid}, other: {rid}}
    assert rig.reserves(None)[0].req_id == f"{rid}~1"
    assert rig.d.requests[rid].failures == 1


# -- deadlines and retries ------------------------------------------------------------------
def test_without_a_prefill_node_the_request_waits_then_times_out_saying_so():
    rig = Rig(("decode", "d0"))
    rid = rig.submit(timeout_s=5.0)
    assert not rig.inbox and rig.d.requests[rid].state is State.WAITING
    for _ in range(49):                      # 4.9 s of ticks: looking, with pauses
        rig.tick(0.1)
    assert rid not in rig.end and not rig.inbox
    looks = rig.d.requests[rid].waits
    assert 3 <= looks < 49, "it looks again, less and less often"
    rig.tick(0.2)
    err = rig.end[rid].error
    assert err.code == S.TIMEOUT and "deadline (5 s)" in err.message
    assert f"looked {looks} times for a live prefill node" in err.message
    assert not rig.d.flights and not rig.d.placement.requests("d0")
    assert counted(rig.metrics, "pdserve_request_errors_total", code=S.TIMEOUT) == 1


def test_a_prefill_node_that_joins_in_time_takes_the_waiting_request():
    rig = Rig(("decode", "d0"))
    rid = rig.submit(timeout_s=5.0)
    rig.tick(0.1)
    rig.join("prefill", "p0")
    for _ in range(20):
        rig.tick(0.1)
    (reserve,) = rig.reserves("d0")
    assert reserve.prefill_node_id == "p0" and reserve.req_id.startswith(f"{rid}~")
    assert rig.d.requests[rid].failures == 0, "waiting is not a failure"
    assert reserve.timeout_s <= 5.0 - 0.1


def test_a_request_nobody_answers_times_out_and_is_aborted_where_it_was():
    rig = Rig(("prefill", "p0"), ("decode", "d0"))
    rid = rig.submit(timeout_s=2.0)
    assert rig.one_reserve("d0").timeout_s == 2.0
    rig.tick(1.9)
    assert rid not in rig.end
    rig.tick(0.2)
    assert rig.end[rid].error.code == S.TIMEOUT and "while reserving" in rig.end[rid].error.message
    assert rig.aborted() == {"d0": {rid}}
    rig.grant("d0", rid)                     # too late: handed back
    assert rig.aborted() == {"d0": {rid}} and not rig.read("p0")


def test_refused_by_every_decode_node_then_retried_until_one_has_room():
    rig = Rig(("prefill", "p0"), ("decode", "d0"), ("decode", "d1"))
    rid = rig.submit()
    for _ in range(2):
        (reserve,) = rig.reserves(None)
        rig.refuse(rig.d.requests[rid].decode_node, reserve.req_id)
    assert not rig.inbox and rig.d.requests[rid].state is State.WAITING
    rig.tick(RETRY_RESERVE_S / 2)
    assert not rig.inbox
    rig.tick(RETRY_RESERVE_S)
    (reserve,) = rig.reserves(None)
    assert reserve.req_id == rid, "a refusal uses up no attempt: same wire id"
    rig.grant(rig.d.requests[rid].decode_node, rid)
    rig.flush()
    assert rig.one("p0", P.PrefillBatch).requests[0].req_id == rid


def test_rejected_as_malformed_by_a_decode_node_fails_at_once():
    rig = Rig(("prefill", "p0"), ("decode", "d0"), ("decode", "d1"))
    rid = rig.submit()
    (reserve,) = rig.reserves(None)
    rig.refuse(rig.d.requests[rid].decode_node, rid, f"{E.BAD_MESSAGE}: stop ids too many")
    err = rig.end[rid].error
    assert err.code == S.BAD_REQUEST and err.message.endswith("stop ids too many")
    assert not rig.reserves(None), "no other node is asked"


def test_retryable_node_errors_move_the_request_up_to_max_attempts():
    rig = Rig(("prefill", "p0"), ("decode", "d0"))
    rid = rig.submit()
    for attempt in range(MAX_ATTEMPTS):
        wire = rid if attempt == 0 else f"{rid}~{attempt}"
        rig.to_prefill("d0", "p0", wire)
        rig.say("p0", P.Error(req_id=wire, code=E.LEASE_EXPIRED, message="KV never acked"))
        assert rig.aborted() == {"p0": {wire}, "d0": {wire}}
    err = rig.end[rid].error
    assert err.code == S.NODE_ERROR and f"gave up after {MAX_ATTEMPTS} attempts" in err.message
    assert not rig.reserves(None) and not rig.d.flights


def test_a_node_error_no_retry_fixes_fails_the_request():
    rig = Rig(("prefill", "p0"), ("decode", "d0"))
    rid = rig.submit()
    rig.to_prefill("d0", "p0", rid)
    rig.say("d0", P.Error(req_id=rid, code=E.INTERNAL, message="boom"))
    assert rig.end[rid].error.code == S.NODE_ERROR and "boom" in rig.end[rid].error.message
    assert rig.aborted() == {"p0": {rid}, "d0": {rid}}


# -- who may say what -------------------------------------------------------------------------
def test_duplicate_and_out_of_order_tokens_reach_the_client_once_in_order():
    rig = Rig(("prefill", "p0"), ("decode", "d0"), ("decode", "d1"))
    rid = rig.submit(params=greedy(5))
    serving = rig.d.requests[rid].decode_node
    other = {"d0": "d1", "d1": "d0"}[serving]
    rig.to_prefill(serving, "p0", rid)
    rig.stream(serving, rid, [12])            # decode beat the first token: held
    rig.stream(serving, rid, [13])
    rig.first(serving, rid, 50)               # a first token from the decode node: no
    assert rig.tokens[rid] == [] and rig.dropped[-1][:2] == (serving, "FirstToken")
    rig.first("p0", rid, 11)
    assert rig.tokens[rid] == [11, 12, 13]
    rig.first("p0", rid, 11)                  # the same first token again
    assert rig.dropped[-1][3] == "a first token was already taken"
    rig.stream(other, rid, [66])              # a node not serving it
    rig.stream("p0", rid, [67])               # nor the prefill node, after its token
    assert [d[0] for d in rig.dropped[-2:]] == [other, "p0"]
    rig.say(other, P.Error(req_id=rid, code=E.INTERNAL, message="not yours"))
    assert rig.dropped[-1][1:] == ("Error", rid, "the node does not serve it")
    rig.stream(serving, rid, [14, 15], finish="length")
    assert rig.tokens[rid] == [11, 12, 13, 14, 15] and rig.end[rid].finish_reason == "length"
    rig.stream(serving, rid, [16])            # after the end: nothing more
    assert rig.tokens[rid] == [11, 12, 13, 14, 15]


def test_tokens_before_the_reservation_is_granted_are_refused():
    rig = Rig(("prefill", "p0"), ("decode", "d0"))
    rid = rig.submit()
    rig.stream("d0", rid, [12])
    rig.first("p0", rid, 11)
    assert rig.tokens[rid] == []
    assert [d[1] for d in rig.dropped] == ["TokenItem", "FirstToken"]


def test_token_ids_outside_the_vocabulary_fail_only_that_request():
    rig = Rig(("prefill", "p0"), ("decode", "d0"))
    bad, good = rig.submit(prompt=[5, 6]), rig.submit(prompt=[7, 8])
    for rid in (bad, good):
        rig.grant("d0", rid)
    rig.flush()
    rig.say("p0", P.FirstTokens(items=[P.FirstToken(req_id=bad, token_id=VOCAB),
                                       P.FirstToken(req_id=good, token_id=11)]))
    assert rig.end[bad].error.code == S.NODE_ERROR and "vocabulary" in rig.end[bad].error.message
    assert rig.tokens[good] == [11] and good not in rig.end


def test_too_many_early_token_batches_fail_the_request():
    rig = Rig(("prefill", "p0"), ("decode", "d0"))
    rid = rig.submit(params=greedy(10_000))
    rig.to_prefill("d0", "p0", rid)
    for _ in range(MAX_EARLY_TOKENS):
        rig.stream("d0", rid, [12])
    assert rid not in rig.end
    rig.stream("d0", rid, [12])
    assert rig.end[rid].error.code == S.NODE_ERROR and rig.tokens[rid] == []


def test_messages_from_an_unregistered_node_are_dropped():
    rig = Rig(("prefill", "p0"), ("decode", "d0"))
    rid = rig.submit()
    rig.say("intruder", P.ReserveReply(items=[P.ReserveResult(req_id=rid, ok=True, reason="",
                                                              num_blocks=1)]))
    assert rig.dropped == [("intruder", "ReserveReply", "-", "the node is not registered")]
    assert rig.d.requests[rid].state is State.RESERVING and not rig.inbox[1:]


# -- cancellation ------------------------------------------------------------------------------
@pytest.mark.parametrize("stage", ["reserving", "queued", "prefilling", "decoding"])
def test_cancel_aborts_on_the_nodes_holding_the_request(stage):
    rig = Rig(("prefill", "p0"), ("decode", "d0"))
    rid = rig.submit()
    holders = {"d0"}
    if stage != "reserving":
        rig.one_reserve("d0")
        rig.grant("d0", rid)
        holders.add("p0")
    if stage in ("prefilling", "decoding"):
        rig.flush()
        rig.one("p0", P.PrefillBatch)
    if stage == "decoding":
        rig.first("p0", rid, 11)
    rig.cancel(rid)
    assert rig.end[rid].finish_reason == "abort"
    assert rig.aborted() == {n: {rid} for n in holders}
    rig.flush()
    assert not rig.read("p0", P.PrefillBatch), "a cancelled request is never prefilled"
    rig.first("p0", rid, 12)
    rig.stream("d0", rid, [13])
    assert rig.tokens[rid] == ([11] if stage == "decoding" else [])
    assert rig.d.placement.queued_tokens("p0") == 0
    assert not rig.d.placement.requests("d0") and not rig.d.placement.requests("p0")
    assert counted(rig.metrics, "pdserve_requests_total", finish_reason="abort") == 1


def test_cancel_on_a_colocated_node_sends_one_abort():
    rig = Rig(("colocated", "c0"))
    rid = rig.submit()
    rig.flush()
    rig.first("c0", rid, 11)
    rig.cancel(rid)
    assert rig.read("c0", P.Abort) == [P.Abort(req_ids=[rid], reason=
                                               "finished or cancelled at the router")]


# -- submit, membership, policies ----------------------------------------------------------
def test_submit_refuses_over_the_limit_and_a_repeated_id():
    rig = Rig(("prefill", "p0"), ("decode", "d0"), max_pending_requests=2)
    rig.submit(request_id="a")
    with pytest.raises(S.RequestError) as err:
        rig.submit(request_id="a")
    assert err.value.code == S.BAD_REQUEST
    rig.submit()
    with pytest.raises(S.RequestError) as err:
        rig.submit()
    assert err.value.code == S.OVERLOADED and len(rig.d.requests) == 2


def test_a_draining_node_keeps_its_requests_and_gets_no_new_ones():
    rig = Rig(("prefill", "p0"), ("decode", "d0"), ("decode", "d1"))
    rid = rig.submit(params=greedy(3))
    serving = rig.d.requests[rid].decode_node
    other = {"d0": "d1", "d1": "d0"}[serving]
    rig.to_prefill(serving, "p0", rid)
    rig.first("p0", rid, 11)
    rig.registry.drain(serving)
    late = [rig.submit() for _ in range(3)]
    assert {rig.d.requests[r].decode_node for r in late} == {other}
    rig.stream(serving, rid, [12, 13], finish="length")
    assert rig.tokens[rid] == [11, 12, 13] and rig.end[rid].finish_reason == "length"


def test_cache_aware_sends_a_shared_prefix_back_to_the_nodes_that_said_they_hold_it():
    rig = Rig(("prefill", "p0"), ("prefill", "p1"), ("decode", "d0"), ("decode", "d1"),
              policy="cache_aware")
    index = rig.d.policy.index
    for node_id, _ in index.due(rig.now):   # every node's dump: empty caches
        assert index.dump(node_id, 0, [], rig.now)
    shared = list(range(100, 100 + 4 * BLOCK))
    placed = []
    for tail in ([1, 2], [3], [4, 5, 6]):
        rid = rig.submit(prompt=shared + tail)
        (reserve,) = rig.reserves(None)
        flight = rig.d.requests[rid]
        placed.append((reserve.prefill_node_id, flight.decode_node))
        rig.grant(flight.decode_node, rid)
        if len(placed) == 1:  # the two nodes say they stored the prefix (their KV events)
            batch = msgpack.packb([0.0, [["BlockStored", block_hashes(shared, BLOCK), None,
                                          shared, BLOCK, None, "CPU"]], 0])
            for node_id in placed[0]:
                index.batch(node_id, 1, decode_batch(batch))
    assert len(set(placed)) == 1, placed


def test_least_loaded_spreads_decode_work():
    rig = Rig(("prefill", "p0"), ("decode", "d0"), ("decode", "d1"))
    rids = [rig.submit() for _ in range(4)]
    assert sorted(rig.d.requests[r].decode_node for r in rids) == ["d0", "d0", "d1", "d1"]


def test_a_failure_inside_one_request_is_contained():
    class Exploding:
        def decode(self, ids, skip_special_tokens=True):
            if 777 in ids:
                raise RuntimeError("injected detokenizer fault")
            return "x" * len(ids)

    rig = Rig(("prefill", "p0"), ("decode", "d0"))
    rig.d.tokenizer = Exploding()
    bad, good = rig.submit(prompt=[5, 6]), rig.submit(prompt=[7, 8])
    for rid in (bad, good):
        rig.grant("d0", rid)
    rig.flush()
    rig.say("p0", P.FirstTokens(items=[P.FirstToken(req_id=bad, token_id=777),
                                       P.FirstToken(req_id=good, token_id=11)]))
    assert rig.end[bad].error.code == S.INTERNAL
    assert "injected detokenizer fault" in rig.end[bad].error.message
    assert rig.tokens[good] == [11] and good not in rig.end


def test_aborts_merge_only_into_a_nodes_latest_message():
    """Aborts for one node and reason join while nothing else for that node lies between
    them; a message between keeps them apart, so the node sees everything in order."""
    from pdserve.router.dispatch.dispatch import merge_aborts

    def abort(i, reason="x"):
        return P.Abort(req_ids=[i], reason=reason)
    sends = [("p0", abort("a")), ("d0", abort("a")), ("p0", abort("b")), ("d0", abort("b")),
             ("p0", P.Drain(reason="d")), ("p0", abort("c")), ("p0", abort("e", "y"))]
    assert merge_aborts(sends) == [
        ("p0", P.Abort(req_ids=["a", "b"], reason="x")),
        ("d0", P.Abort(req_ids=["a", "b"], reason="x")),
        ("p0", P.Drain(reason="d")), ("p0", abort("c")), ("p0", abort("e", "y"))]


def test_a_resume_needs_no_answer_from_a_decode_node_that_died():
    """A lookup asks every decode node; one that dies meanwhile held nothing any more, so
    the lookup ends on the others' answers, at once, not at its timeout."""
    rig = Rig(("prefill", "p0"), ("decode", "d0"), ("decode", "d1"))
    req_id = rig.d.resumes.start("70726f64", "job-1", 3, None, rig.now)
    rig.apply(rig.d.take())
    assert {node for node, msg in rig.inbox if isinstance(msg, P.Resume)} == {"d0", "d1"}
    rig.gone("d0")
    assert req_id not in rig.end
    rig.apply(rig.d.node_message("d1", P.Resumed(req_id=req_id, ok=False,
                                                 code=E.STREAM_NOT_FOUND), rig.now))
    assert rig.end[req_id].error.code == E.STREAM_NOT_FOUND
