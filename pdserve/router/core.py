"""The router's core: node registry, dispatcher and per-request streams, in one asyncio loop.

    core = RouterCore(config)            # reads config.json + tokenizer of config.model
    core.check(req)                      # RequestError(BAD_REQUEST, message, param)
    stream = core.submit(req)            # never waits on a socket
    async for event in stream: ...       # StreamEvent; the last one is terminal
    stream.cancel()                      # the client went away: abort on the nodes

A request's way::

    submit --> RESERVING (Reserve to a decode node; refused: the next node, or wait)
      --> PREFILLING (joins its prefill node's batch; one PrefillBatch per node per
          loop turn) --> first token from the prefill node --> DECODING (TokenBatch
          per decode step) --> finished: done event; or error / cancel / deadline:
          Abort to the nodes, terminal event. Text, stop strings and usage are the
          router's: nodes only see token ids.

Failover: when a node dies or leaves, or a transfer fails in a way another try
can fix, the request goes round again under a new wire id (``<id>~<attempt>``):
its prompt plus every token already streamed go to a prefill node, and decoding
continues on a decode node. The client's stream just continues: tokens from an
earlier attempt's wire id are ignored, so none is seen twice or lost, and a
greedy request's output equals a run without the failure.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import zmq
import zmq.asyncio

from pdserve.common import protocol as P
from pdserve.common.logs import LogThrottle
from pdserve.common.metrics import RouterMetrics
from pdserve.common.security import CONTROL_DOMAIN, server_curve
from pdserve.common.transport import SendError, make_socket, send_routed_nowait
from pdserve.engine.logprobs import head
from pdserve.engine.output import RequestOutputState
from pdserve.engine.sampling_params import to_spec
from pdserve.model.config import ModelConfig
from pdserve.model.loader import model_identity_hash, model_name
from pdserve.model.tokenizer import Tokenizer
from pdserve.router import streams as S
from pdserve.router.batching import PrefillDispatch
from pdserve.router.clock import Clock
from pdserve.router.config import RouterConfig
from pdserve.router.limits import check_request
from pdserve.router.node_messages import (  # noqa: F401 (CONTROL_IN: part of this API)
    CONTROL_IN,
    DECODING,
    PREFILLING,
    RESERVING,
    NodeMessages,
)
from pdserve.router.policies import make_policy
from pdserve.router.registry import NodeInfo, Registry
from pdserve.router.tokenizing import TokenizerPool

log = logging.getLogger(__name__)

RETRY_RESERVE_S = 0.05     # how soon a request no decode node had room for tries again
MAX_ATTEMPTS = 4           # dispatches of one request before its failure is final


@dataclass
class Flight:
    req_id: str                 # the client's id
    wire_id: str                # this attempt's id on the wire
    prompt: list[int]           # the client's prompt
    spec: P.SamplingSpec
    out: RequestOutputState
    stream: S.RequestStream
    deadline: float
    created: float = field(default_factory=time.monotonic)
    state: str = RESERVING
    prefill_node: str | None = None
    decode_node: str | None = None
    refused_by: set[str] = field(default_factory=set)
    retry_at: float = 0.0
    early_tokens: list[P.TokenItem] = field(default_factory=list)  # decode before prefill's
    attempt: int = 0            # dispatches so far, for wire ids
    failures: int = 0           # of them, the ones that failed (MAX_ATTEMPTS caps these)
    wire_prompt: list[int] = field(default_factory=list)  # prompt + tokens of earlier attempts
    skip_blocks: int = 0        # leading KV blocks the reserving decode node has cached
    waits: int = 0              # looks for a live prefill node that found none


class RouterCore(NodeMessages, Clock, PrefillDispatch):
    def __init__(self, config: RouterConfig):
        from pdserve.model.default_model import default_model_dir

        self.config = config
        model_dir = Path(config.model) if config.model else default_model_dir()
        self.model_config = ModelConfig.from_dir(model_dir)
        self.tokenizer = Tokenizer(model_dir)
        self.model_name = config.served_model_name or model_name(model_dir)
        self.max_model_len = self.model_config.max_model_len
        identity = P.ModelIdentity(name=model_name(model_dir),
                                   config_hash=model_identity_hash(model_dir))
        cfg = self.model_config
        self.registry = Registry(identity, cfg.num_hidden_layers, cfg.num_key_value_heads,
                                 cfg.head_dim, config.heartbeat_interval_s, config.liveness)
        self.policy = make_policy(config.policy, self.registry)
        self.metrics = RouterMetrics(self.model_name, error_codes=S.HTTP_STATUS)
        self.metrics.watch(lambda: len(self.requests), lambda: [
            (n.role, n.state) for n in list(self.registry.nodes.values())])
        self.flights: dict[str, Flight] = {}    # by wire id
        self.requests: dict[str, Flight] = {}   # by the client's request id
        self._ids = itertools.count()
        self._batches: dict[str, list[P.PrefillRequest]] = {}
        self._flush_scheduled = False
        self._ctx: zmq.asyncio.Context | None = None
        self._sock = None
        self._tasks: list[asyncio.Task] = []
        self.incarnation = os.urandom(8).hex()
        self.loop_ticks = {"receive": 0, "tick": 0}   # turns of each loop (/health reads them)
        self.last_tick = time.monotonic()
        self._refusal_log = LogThrottle(period_s=10.0)
        self.tokenizing = TokenizerPool(config.tokenizer_threads, config.max_tokenizing)

    # -- front-end API ------------------------------------------------------------------------
    def check(self, req: S.GenerationRequest) -> None:
        """RequestError(BAD_REQUEST) naming the field, for what this model and config refuse."""
        check_request(req, self.model_config.vocab_size, self.max_model_len, self.config)

    def submit(self, req: S.GenerationRequest) -> S.RequestStream:
        try:
            return self._submit(req)
        except S.RequestError as exc:  # refused: counted, then answered by the front-end
            self.metrics.refused(exc.code)
            raise

    def _submit(self, req: S.GenerationRequest) -> S.RequestStream:
        self.check(req)
        if len(self.requests) >= self.config.max_pending_requests:
            raise S.RequestError(S.OVERLOADED, (
                f"{len(self.requests)} requests in flight, the limit is "
                f"{self.config.max_pending_requests}: retry later"))
        ok, reason = self.health()
        if not ok:
            raise S.RequestError(S.NO_NODES, reason)
        req_id = req.request_id or f"req-{next(self._ids)}"
        if req_id in self.requests:
            raise S.RequestError(S.BAD_REQUEST, f"request id {req_id!r} is already in flight")
        stream = S.RequestStream(req_id, list(req.prompt_token_ids))
        stream._cancel = self.cancel
        out = RequestOutputState(self.tokenizer, req.prompt_token_ids, req.params,
                                 self.model_config.eos_token_ids, self.max_model_len)
        timeout = req.timeout_s or self.config.request_timeout_s
        # Everything that can fail runs before the flight is registered.
        flight = Flight(req_id, req_id, list(req.prompt_token_ids), to_spec(req.params), out,
                        stream, time.monotonic() + timeout,
                        wire_prompt=list(req.prompt_token_ids))
        self.flights[req_id] = self.requests[req_id] = flight
        self.metrics.submitted(req_id)
        self._reserve(flight)
        return stream

    def cancel(self, req_id: str) -> None:
        flight = self.requests.get(req_id)
        if flight is not None:
            log.info("request %s cancelled by its client after %d tokens", req_id,
                     len(flight.out.token_ids))
            self._finish(flight, S.StreamEvent([], "", finish_reason="abort"), abort=True)

    def health(self) -> tuple[bool, str]:
        dead = [t.get_name() for t in self._tasks if t.done()]
        if dead:
            return False, f"the router's loop(s) {', '.join(dead)} stopped; see its log"
        if self._tasks and time.monotonic() - self.last_tick > 2.0:
            return False, (f"the router's clock has not ticked for "
                           f"{time.monotonic() - self.last_tick:.1f} s")
        return self.registry.health()

    # -- lifecycle -----------------------------------------------------------------------------
    async def start(self) -> None:
        self._ctx = zmq.asyncio.Context()
        self._sock = make_socket(self._ctx, zmq.ROUTER, bind=self.config.control,
                                 max_msg_size=64 * 2**20,
                                 curve=server_curve(self.config.curve_dir, CONTROL_DOMAIN))
        self.last_tick = time.monotonic()
        self._tasks = [asyncio.create_task(self._receive_loop(), name="receive"),
                       asyncio.create_task(self._tick_loop(), name="tick")]
        log.info("router control socket on %s, model %s", self.config.control, self.model_name)

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.tokenizing.close()
        for flight in list(self.requests.values()):
            self._fail(flight, S.NO_NODES, "the router is shutting down")
        if self._sock is not None:
            self._sock.close(0)
            self._ctx.term()

    # -- dispatch ------------------------------------------------------------------------------
    def _send(self, node_id: str | bytes, msg: P.Message) -> bool:
        """``node_id``: a registered node's id, or a raw socket identity (answering a peer
        that never registered, whose identity need not be text)."""
        peer = node_id if isinstance(node_id, bytes) else node_id.encode()
        node_id = peer.decode(errors="replace")
        try:
            send_routed_nowait(self._sock, peer, msg)
            return True
        except P.ProtocolError as exc:  # cannot be encoded: the caller fails what it carried
            log.error("%s to node %s not sent: %s", type(msg).__name__, node_id, exc)
            return False
        except SendError as exc:
            log.warning("send of %s to node %s failed: %s", type(msg).__name__, node_id, exc)
            if exc.reason == "unreachable":
                # No connection with that identity: the node is gone. Nobody may pick it
                # from now on; its other requests move once the caller has dealt with this one.
                node = self.registry.remove(node_id)
                if node is not None:
                    asyncio.get_running_loop().call_soon(
                        self._node_gone, node, f"node {node_id} is not connected any more")
            return False

    def _reserve(self, flight: Flight) -> None:
        flight.retry_at, flight.skip_blocks = 0.0, 0
        colocated = self.registry.live("colocated")
        if colocated:  # one engine does both: no reservation, no KV transfer
            node = self.policy.pick("prefill", colocated, flight.wire_prompt)
            flight.decode_node = node.node_id
            node.requests.add(flight.wire_id)
            self._to_prefill(flight, node)
            return
        prefill = self._pick_prefill(flight)  # first: the reservation names it
        if prefill is None:
            return
        candidates = [n for n in self.registry.live("decode")
                      if n.node_id not in flight.refused_by]
        if not candidates:
            flight.refused_by.clear()   # every node said no: try them all again shortly
            flight.retry_at = time.monotonic() + RETRY_RESERVE_S
            return
        node = self.policy.pick("decode", candidates, flight.wire_prompt)
        flight.decode_node, flight.prefill_node = node.node_id, prefill.node_id
        flight.state = RESERVING
        node.requests.add(flight.wire_id)
        if not self._send(node.node_id, P.Reserve(
                req_id=flight.wire_id, prompt_token_ids=flight.wire_prompt, sampling=flight.spec,
                prefill_node_id=prefill.node_id, lease_s=self.config.reserve_lease_s,
                timeout_s=max(1.0, flight.deadline - time.monotonic()))):
            self._refused(flight, node.node_id, "unreachable")

    def _refused(self, flight: Flight, node_id: str, reason: str) -> None:
        node = self.registry.nodes.get(node_id)
        if node is not None:
            node.requests.discard(flight.wire_id)
        flight.refused_by.add(node_id)
        flight.decode_node = None
        log.debug("decode node %s refused %s: %s", node_id, flight.req_id, reason)
        self._reserve(flight)

    def _deliver(self, flight: Flight, token_ids: list[int], node_reason: str | None,
                 nodes_done: bool = True, logprobs: P.Logprobs | None = None,
                 prompt_logprobs: P.Logprobs | None = None) -> None:
        """Hands tokens (and their logprobs, when asked) to the client's stream.
        ``nodes_done``: when the node says the request finished, whether every node has
        already let go of it (no Abort needed)."""
        try:
            self._deliver_unguarded(flight, token_ids, node_reason, nodes_done, logprobs,
                                    prompt_logprobs)
        except Exception as exc:  # this request fails; the rest of the batch goes on
            log.exception("serving request %s failed", flight.req_id)
            self._fail(flight, S.INTERNAL, f"internal error while serving the request: "
                       f"{type(exc).__name__}: {exc}")

    def _deliver_unguarded(self, flight: Flight, token_ids: list[int],
                           node_reason: str | None, nodes_done: bool,
                           logprobs: P.Logprobs | None,
                           prompt_logprobs: P.Logprobs | None) -> None:
        delta = flight.out.add(token_ids, node_reason)
        self.metrics.delivered(flight.req_id, len(delta.token_ids), len(flight.prompt))
        event = S.StreamEvent(delta.token_ids, delta.text, finish_reason=delta.finish_reason,
                              prompt_tokens=len(flight.prompt),
                              completion_tokens=len(flight.out.token_ids),
                              logprobs=head(logprobs, len(delta.token_ids)),
                              prompt_logprobs=prompt_logprobs)
        if delta.finish_reason is None:
            if delta.token_ids or delta.text:
                flight.stream.push(event)
            return
        # Finished by the router (a stop string) or at the first token: nodes still hold it.
        self._finish(flight, event, abort=node_reason is None or not nodes_done)

    def _finish(self, flight: Flight, event: S.StreamEvent, abort: bool) -> None:
        self.requests.pop(flight.req_id, None)
        self.metrics.finished(flight.req_id, event.finish_reason,
                              event.error.code if event.error else None)
        self._release(flight, abort, "finished or cancelled at the router")
        flight.stream.push(event)

    def _release(self, flight: Flight, abort: bool, reason: str) -> None:
        """Forgets the flight's current attempt, telling its nodes to drop it if asked."""
        self.flights.pop(flight.wire_id, None)
        for node_id in {flight.prefill_node, flight.decode_node} - {None}:
            node = self.registry.nodes.get(node_id)
            if node is None:
                continue
            if node_id == flight.prefill_node and flight.state == PREFILLING:
                node.queued_prompt_tokens -= len(flight.wire_prompt)  # no first token came
            node.requests.discard(flight.wire_id)
            if abort:
                self._send(node_id, P.Abort(req_ids=[flight.wire_id], reason=reason))

    def _retry(self, flight: Flight, why: str, delay: float = 0.0, count: bool = True) -> None:
        """Dispatches the request again: its prompt plus every token already streamed.
        ``count``: whether this is a failure that uses up one of MAX_ATTEMPTS."""
        flight.failures += count
        if flight.failures >= MAX_ATTEMPTS:
            self._fail(flight, S.NODE_ERROR, f"{why}; gave up after {MAX_ATTEMPTS} attempts")
            return
        if count:
            log.warning("request %s moves to other nodes (attempt %d): %s", flight.req_id,
                        flight.failures + 1, why)
        self._release(flight, abort=True, reason=f"moved elsewhere: {why}")
        done = len(flight.out.token_ids)
        flight.attempt += 1
        flight.wire_id = f"{flight.req_id}~{flight.attempt}"
        flight.wire_prompt = flight.prompt + flight.out.token_ids
        flight.spec = msgspec.structs.replace(
            flight.spec, max_tokens=flight.out.params.max_tokens - done, seed_offset=done,
            min_tokens=max(0, flight.out.params.min_tokens - done),
            # the first attempt's first token brought the prompt's logprobs
            prompt_logprobs=None if done else flight.spec.prompt_logprobs)
        flight.prefill_node = flight.decode_node = None
        flight.refused_by.clear()
        flight.early_tokens.clear()
        flight.state = RESERVING
        self.flights[flight.wire_id] = flight
        if delay:
            flight.retry_at = time.monotonic() + delay
        else:
            self._reserve(flight)

    def _fail(self, flight: Flight, code: str, message: str) -> None:
        log.warning("request %s failed (%s): %s", flight.req_id, code, message)
        self._finish(flight, S.StreamEvent([], "", error=S.RequestError(code, message),
                                           prompt_tokens=len(flight.prompt),
                                           completion_tokens=len(flight.out.token_ids)),
                     abort=True)

    def _node_gone(self, node: NodeInfo | None, why: str) -> None:
        """Moves the requests placed on a node that left or died to other nodes."""
        if node is None:
            return
        log.warning("%s", why)
        for wire_id in list(node.requests):
            flight = self.flights.get(wire_id)
            if flight is not None:
                self._retry(flight, why)
