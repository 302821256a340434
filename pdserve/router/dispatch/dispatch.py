"""The router's dispatch: every request in flight, as a pure state machine.

No sockets, no asyncio, no clock reads: each event is a method call that takes the time
as ``now`` and returns an ``Output`` (flight.py): the messages to send to nodes and the
events for clients. router/control.py feeds it from the control socket and the clock and
sends what it returns; router/core.py is the asyncio shell the front ends call.

    d = Dispatch(registry, "round_robin", metrics, config, vocab_size, eos_ids, max_len)
    req_id, out = d.submit(GenerationRequest, now)     # RequestError if refused
    out = d.node_message(node_id, msg, now)  # ReserveReply, FirstTokens, TokenBatch, Error
    out = d.flush(now)       # one PrefillBatch per prefill node for what was queued since
    out = d.tick(now)        # deadlines, retries
    out = d.node_gone(node, why, now) / d.send_failed(node_id, msg, now) / d.cancel(id, now)

A request's way (``State``)::

    submit --> RESERVING (one Reserve per decode node per flush; refused: the next node; every node
      refused, or no live prefill node: WAITING, tried again by tick) --> PREFILLING
      (joins its prefill node's batch; one PrefillBatch per node per flush) --> first
      token from the prefill node --> DECODING (TokenBatch per decode step) --> done
      event; or error / cancel / deadline: Abort to its nodes, error event. A colocated
      node does both: no Reserve, straight to PREFILLING. Text, stop strings and usage
      are the router's: nodes only see token ids.

Failover: when a node dies or leaves, or a transfer fails in a way another try can fix,
the request goes round again under a new wire id (``<id>~<attempt>``): its prompt plus
every token already streamed go to a prefill node, and decoding continues on a decode
node. Messages for an earlier attempt's wire id are ignored, so no token is seen twice
or lost, and a greedy (or seeded) output equals a run without the failure. After
MAX_ATTEMPTS failures the request fails.
"""
from __future__ import annotations

import itertools
import logging
import os

import msgspec

from pdserve.common import protocol as P
from pdserve.common.logprobs import head
from pdserve.common.metrics import RouterMetrics
from pdserve.model.text import RequestOutputState
from pdserve.router import streams as S
from pdserve.router.config import RouterConfig
from pdserve.router.dispatch.batching import Batcher, prefill_timeout
from pdserve.router.dispatch.flight import Flight, Output, State, merge_aborts  # noqa: F401 (API)
from pdserve.router.dispatch.node_messages import NodeMessages
from pdserve.router.dispatch.placement import Placement
from pdserve.router.dispatch.policies import make_policy
from pdserve.router.dispatch.registry import LIVE, NodeInfo, Registry
from pdserve.router.dispatch.resume import Resumes, stream_origin

log = logging.getLogger(__name__)

RETRY_RESERVE_S = 0.05     # how soon a request no decode node had room for tries again
MAX_ATTEMPTS = 4           # dispatches of one request before its failure is final
RETRY_WAIT_S = 0.05        # the first pause before looking for a prefill node again
MAX_WAIT_RETRY_S = 1.0     # the longest pause between looks for a prefill node


class Dispatch:
    """The state machine. It holds its parts: the ``placement`` (what it put on which
    node), the ``policy`` named (ranking nodes by the placement), the ``batcher`` (what
    leaves at the next flush) and the ``node_messages`` rules (who may say what; they act
    on requests through this object's verbs, listed in node_messages.Attempts), and the
    ``resumes`` (streams whose router died, resumed here). The ``registry`` is read for
    members only: who is one is control's business. ``tokenizer`` None: token ids only."""

    def __init__(self, registry: Registry, policy: str, metrics: RouterMetrics,
                 config: RouterConfig, vocab_size: int, eos_token_ids: tuple[int, ...],
                 max_model_len: int, tokenizer=None):
        self.registry, self.metrics, self.config = registry, metrics, config
        self.max_model_len, self.tokenizer = max_model_len, tokenizer
        self.eos_token_ids = tuple(eos_token_ids)
        self.flights: dict[str, Flight] = {}    # by wire id (the current attempt's)
        self.requests: dict[str, Flight] = {}   # by the client's request id
        self.placement = Placement()
        self.policy = make_policy(policy, registry, self.placement)
        self.batcher = Batcher()
        self.node_messages = NodeMessages(registry, self.placement, vocab_size, self)
        self.resumes = Resumes(self)
        # Nodes serve several routers: an id made here must not be another router's too.
        self._ids = map(f"req-{os.urandom(4).hex()}-{{}}".format, itertools.count())
        self._out = Output()

    def take(self) -> Output:
        """What was decided since the last take. Every event returns it; after an event
        raised, what it decided before the failure is still here to be sent."""
        out, self._out = self._out, Output()
        out.sends = merge_aborts(out.sends)
        return out

    # -- the verbs of the parts (node_messages.Attempts) -------------------------------------
    def send(self, node_id: str | bytes, msg: P.Message) -> None:
        self._out.sends.append((node_id, msg))

    def drop(self, node_id: str, what: str, req_id: str, why: str) -> None:
        self._out.dropped.append((node_id, what, req_id, why))

    def _emit(self, flight: Flight, event: S.StreamEvent) -> None:
        self._out.events.append((flight.req_id, event))

    # -- events from nodes and the event loop ------------------------------------------------
    def node_message(self, node_id: str, msg: P.Message, now: float) -> Output:
        """A ReserveReply, FirstTokens, TokenBatch or Error from ``node_id``."""
        self.node_messages.handle(node_id, msg, now)
        return self.take()

    def has_batches(self) -> bool:
        """Whether reservations or requests wait for ``flush``."""
        return self.batcher.has_batches()

    def flush(self, now: float) -> Output:
        """Everything queued for one node since the last flush leaves as one message
        (several when that would pass the batch limit): reservations first, then prefill
        batches. Requests that ended or moved meanwhile (cancelled, failed over) are left
        out; one too big for any message fails."""
        messages, too_big = self.batcher.take(self.flights)
        for wire_id, why in too_big:
            self.fail_flight(self.flights[wire_id], S.BAD_REQUEST, why)
        for node_id, msg in messages:
            try:
                if isinstance(msg, P.PrefillBatch):
                    self.metrics.dispatched(self.flights[r.req_id].req_id for r in msg.requests)
                self.send(node_id, msg)
            except Exception:  # these requests fail; the other batches still leave
                self.metrics.internal_error("router.flush", log)
                for r in getattr(msg, "requests", ()):
                    if r.req_id in self.flights:
                        self.fail_flight(self.flights[r.req_id], S.INTERNAL,
                                         "internal error while dispatching; see the router's log")
        return self.take()

    # -- events from clients --------------------------------------------------------------
    def submit(self, req: S.GenerationRequest, now: float) -> tuple[str, Output]:
        """Registers the request and starts its first attempt; its id and the output.
        RequestError (OVERLOADED, BAD_REQUEST) when it cannot be taken: nothing changed."""
        if len(self.requests) >= self.config.max_pending_requests:
            raise S.RequestError(S.OVERLOADED, f"{len(self.requests)} requests in flight, the "
                                 f"limit is {self.config.max_pending_requests}: retry later")
        req_id = req.request_id or next(self._ids)
        if req_id in self.requests or req_id in self.flights:
            raise S.RequestError(S.BAD_REQUEST, f"request id {req_id!r} is already in flight")
        out = RequestOutputState(self.tokenizer, req.prompt_token_ids, req.params,
                                 self.eos_token_ids, self.max_model_len)
        timeout = req.timeout_s or self.config.request_timeout_s
        # Everything that can fail runs before the flight is registered.
        flight = Flight(req_id, req_id, list(req.prompt_token_ids), req.params.for_nodes(), out,
                        deadline=now + timeout, created=now,
                        wire_prompt=list(req.prompt_token_ids), origin=req.origin)
        self.flights[req_id] = self.requests[req_id] = flight
        self.metrics.submitted(req_id)
        try:
            self._reserve(flight, now)
        except Exception as exc:  # registered: it must end with an event, not vanish
            self.metrics.internal_error("router.submit", log)
            self.fail_flight(flight, S.INTERNAL, f"internal error while dispatching: {exc}")
        return req_id, self.take()

    def cancel(self, req_id: str, now: float) -> Output:
        """The client went away: abort on its nodes, end its stream with "abort"."""
        self.resumes.cancel(req_id)
        if (flight := self.requests.get(req_id)) is not None:
            log.info("request %s cancelled by its client after %d tokens", req_id,
                     len(flight.out.token_ids))
            self._finish(flight, S.StreamEvent([], "", finish_reason="abort"), abort=True)
        return self.take()

    def fail(self, req_id: str, code: str, message: str) -> Output:
        if (flight := self.requests.get(req_id)) is not None:
            self.fail_flight(flight, code, message)
        return self.take()

    def fail_all(self, code: str, message: str) -> Output:
        for flight in list(self.requests.values()):
            self.fail_flight(flight, code, message)
        return self.take()

    # -- events from the clock and the membership -----------------------------------------
    def tick(self, now: float) -> Output:
        """Deadlines, and the retries of WAITING requests whose time has come."""
        for flight in list(self.requests.values()):
            self._guarded("router.tick.request", self._tick_flight, flight, now)
        self.resumes.tick(now)
        return self.take()

    def _guarded(self, where: str, step, flight: Flight, *args) -> None:
        """``step(flight, *args)`` for one of many requests: a failure fails this one only."""
        try:
            step(flight, *args)
        except Exception:
            self.metrics.internal_error(where, log)
            self.fail_flight(flight, S.INTERNAL, "internal error; see the router's log")

    def _tick_flight(self, flight: Flight, now: float) -> None:
        if now > flight.deadline:
            waiting = "no node could take it" if flight.state is State.WAITING \
                else flight.state.value
            if flight.waits:
                waiting += f" (looked {flight.waits} times for a live prefill node)"
            self.fail_flight(flight, S.TIMEOUT, f"the request passed its deadline "
                       f"({flight.deadline - flight.created:.0f} s) while {waiting}")
        elif flight.state is State.WAITING and now >= flight.retry_at:
            self._reserve(flight, now)

    def node_gone(self, node: NodeInfo | None, why: str, now: float) -> Output:
        """A node left or died (already out of the registry): its requests move."""
        if node is not None:
            log.warning("%s", why)
            self.resumes.node_gone(node.node_id)
            for wire_id in self.placement.drop(node.node_id):
                if (flight := self.flights.get(wire_id)) is not None:
                    self._guarded("router.node_gone.request", self.retry, flight, why, now)
        return self.take()

    def send_failed(self, node_id: str | bytes, msg: P.Message, now: float) -> Output:
        """A message this dispatch returned could not be sent (the node is gone, its queue
        is full, or the message would not encode)."""
        if isinstance(msg, P.Reserve):
            for r in msg.items:
                flight = self.flights.get(r.req_id)
                if flight is not None and flight.state is State.RESERVING \
                        and flight.decode_node == node_id:
                    self.refused(flight, node_id, "unreachable", now)
        elif isinstance(msg, P.PrefillBatch):
            for r in msg.requests:
                flight = self.flights.get(r.req_id)
                if flight is not None and flight.state is State.PREFILLING \
                        and flight.prefill_node == node_id:
                    self.retry(flight, f"prefill node {node_id} could not be reached", now)
        return self.take()

    # -- an attempt -----------------------------------------------------------------------
    def _reserve(self, flight: Flight, now: float) -> None:
        flight.retry_at, flight.skip_blocks = 0.0, 0
        colocated = self.registry.live("colocated")
        if colocated:  # one engine does both: no reservation, no KV transfer
            node = self.policy.pick("prefill", colocated, flight.wire_prompt)
            flight.decode_node = node.node_id
            self.placement.place(node.node_id, flight.wire_id)
            self.to_prefill(flight, now, node)
            return
        prefill = self._pick_prefill(flight, now)  # first: the reservation names it
        if prefill is None:
            return
        candidates = [n for n in self.registry.live("decode")
                      if n.node_id not in flight.refused_by]
        if not candidates:
            flight.refused_by.clear()   # every node said no: try them all again shortly
            flight.state, flight.retry_at = State.WAITING, now + RETRY_RESERVE_S
            return
        node = self.policy.pick("decode", candidates, flight.wire_prompt)
        flight.decode_node, flight.prefill_node = node.node_id, prefill.node_id
        # Its prompt counts as the prefill node's load from now: requests picked in the
        # same turn (before any reply) must not all go to one node.
        self.placement.queue(prefill.node_id, len(flight.wire_prompt))
        flight.state = State.RESERVING
        self.placement.place(node.node_id, flight.wire_id)
        self.batcher.reserve(node.node_id, P.ReserveRequest(
            req_id=flight.wire_id, prompt_token_ids=flight.wire_prompt, sampling=flight.spec,
            prefill_node_id=prefill.node_id, prefill_incarnation=prefill.hello.incarnation,
            lease_s=self.config.reserve_lease_s,
            timeout_s=max(1.0, flight.deadline - now), origin=stream_origin(flight)))

    def _pick_prefill(self, flight: Flight, now: float) -> NodeInfo | None:
        """The prefill node for this attempt; None: there is none, and the flight waits
        (one may join) until the deadline, looking less often the longer it takes."""
        nodes = self.registry.live("prefill")
        if nodes:
            return self.policy.pick("prefill", nodes, flight.wire_prompt)
        flight.waits += 1
        self.retry(flight, "no live prefill node", now, count=False,
                   delay=min(MAX_WAIT_RETRY_S, RETRY_WAIT_S * 2 ** flight.waits))
        return None

    def to_prefill(self, flight: Flight, now: float, node: NodeInfo | None = None) -> None:
        """The reservation was granted (or none is needed): the request joins its prefill
        node's batch."""
        decode = self.registry.nodes.get(flight.decode_node)
        node = node or self.registry.nodes.get(flight.prefill_node)
        if node is None or decode is None or node.state != LIVE:
            # The decode node takes KV only from the node its reservation names.
            self.retry(flight, "its prefill node left during the reservation", now,
                       count=False)
            return
        if flight.prefill_node is None:  # colocated: no reservation counted it yet
            self.placement.queue(node.node_id, len(flight.wire_prompt))
        flight.prefill_node, flight.state = node.node_id, State.PREFILLING
        self.placement.place(node.node_id, flight.wire_id)
        self.batcher.prefill(node.node_id, P.PrefillRequest(
            req_id=flight.wire_id, prompt_token_ids=flight.wire_prompt, sampling=flight.spec,
            decode_node_id=decode.node_id, kv_address=decode.hello.kv_address or "",
            timeout_s=prefill_timeout(flight.deadline, now, self.config.reserve_lease_s,
                                      colocated=node is decode),
            skip_blocks=flight.skip_blocks, decode_host_id=decode.hello.host_id))

    def refused(self, flight: Flight, node_id: str, reason: str, now: float) -> None:
        self.placement.unplace(node_id, flight.wire_id)
        flight.refused_by.add(node_id)
        self._unqueue(flight)
        flight.decode_node = flight.prefill_node = None
        log.debug("decode node %s refused %s: %s", node_id, flight.req_id, reason)
        self._reserve(flight, now)

    def retry(self, flight: Flight, why: str, now: float, delay: float = 0.0,
               count: bool = True) -> None:
        """Dispatches the request again: its prompt plus every token already streamed.
        ``count``: whether this is a failure that uses up one of MAX_ATTEMPTS."""
        flight.failures += count
        if flight.failures >= MAX_ATTEMPTS:
            self.fail_flight(flight, S.NODE_ERROR, f"{why}; gave up after {MAX_ATTEMPTS} attempts")
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
        flight.state = State.RESERVING
        self.flights[flight.wire_id] = flight
        if delay:
            flight.state, flight.retry_at = State.WAITING, now + delay
        else:
            self._reserve(flight, now)

    # -- the end of an attempt, and of a request --------------------------------------------
    def deliver(self, flight: Flight, token_ids: list[int], node_reason: str | None,
                 nodes_done: bool = True, logprobs: P.Logprobs | None = None,
                 prompt_logprobs: P.Logprobs | None = None) -> None:
        """Hands tokens (and their logprobs, when asked) to the client's stream.
        ``nodes_done``: when the node says the request finished, whether every node has
        already let go of it (no Abort needed)."""
        try:
            delta = flight.out.add(token_ids, node_reason)
            self.metrics.delivered(flight.req_id, len(delta.token_ids), len(flight.prompt))
            event = S.StreamEvent(delta.token_ids, delta.text,
                                  finish_reason=delta.finish_reason,
                                  prompt_tokens=len(flight.prompt),
                                  completion_tokens=len(flight.out.token_ids),
                                  logprobs=head(logprobs, len(delta.token_ids)),
                                  prompt_logprobs=prompt_logprobs, stop_str=delta.stop_str)
        except Exception as exc:  # this request fails; the rest of the batch goes on
            log.exception("serving request %s failed", flight.req_id)
            self.fail_flight(flight, S.INTERNAL, f"internal error while serving the request: "
                       f"{type(exc).__name__}: {exc}")
            return
        if delta.finish_reason is None:
            if delta.token_ids or delta.text:
                self._emit(flight, event)
            return
        # Finished by the router (a stop string) or at the first token: nodes still hold it.
        self._finish(flight, event, abort=node_reason is None or not nodes_done)

    def _finish(self, flight: Flight, event: S.StreamEvent, abort: bool) -> None:
        if self.requests.get(flight.req_id) is not flight:
            return  # already ended: a request has exactly one terminal event
        del self.requests[flight.req_id]
        self.metrics.finished(flight.req_id, event.finish_reason,
                              event.error.code if event.error else None)
        self._release(flight, abort, "finished or cancelled at the router")
        self._emit(flight, event)

    def _release(self, flight: Flight, abort: bool, reason: str) -> None:
        """Forgets the flight's current attempt, telling its nodes to drop it if asked."""
        self.flights.pop(flight.wire_id, None)
        for node_id in {flight.prefill_node, flight.decode_node} - {None}:
            if node_id not in self.registry.nodes:
                continue  # gone: nothing to tell it, nothing placed there any more
            if node_id == flight.prefill_node:
                self._unqueue(flight)
            self.placement.unplace(node_id, flight.wire_id)
            # A prefill node hears of a request only once it is queued for its batch.
            told = node_id == flight.decode_node or flight.state in (State.PREFILLING,
                                                                     State.DECODING)
            if abort and told:
                self.send(node_id, P.Abort(req_ids=[flight.wire_id], reason=reason))

    def _unqueue(self, flight: Flight) -> None:
        """Its prompt no longer counts as its prefill node's load (no first token came)."""
        if flight.prefill_node in self.registry.nodes \
                and flight.state in (State.RESERVING, State.PREFILLING):
            self.placement.queue(flight.prefill_node, -len(flight.wire_prompt))

    def fail_flight(self, flight: Flight, code: str, message: str) -> None:
        log.warning("request %s failed (%s): %s", flight.req_id, code, message)
        self._finish(flight, S.StreamEvent([], "", error=S.RequestError(code, message),
                                           prompt_tokens=len(flight.prompt),
                                           completion_tokens=len(flight.out.token_ids)),
                     abort=True)
