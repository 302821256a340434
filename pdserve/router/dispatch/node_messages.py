"""What nodes send the router about requests, and who may say what.

A ``NodeMessages`` is held by dispatch.Dispatch (pure: no sockets, no clock). It reads
the registry and the placement, and acts on a request only through the ``Attempts`` it
is given (the dispatch): the verbs it may use are listed there. The rules:

- A reservation's reply counts only from the decode node asked, for the current attempt,
  while the request waits for it; a grant nobody wants any more is handed back (Abort).
- A first token is taken only from the prefill node of the request's current attempt,
  while the request waits for it; later tokens only from its decode node (held back
  while they beat the first token there). Anything else (another node, an earlier
  attempt, a duplicate) is dropped and reported in ``Output.dropped``, never shown to a
  client. Token ids must lie inside the vocabulary, logprobs fit what was asked.
- An Error naming a request counts only from a node serving that request.

Membership (Hello, Heartbeat, Drain, Bye) is control.py's; so is how much each peer may
send (the budgets below).
"""
from __future__ import annotations

import logging
from typing import Protocol

from pdserve.common import errors as E
from pdserve.common import protocol as P
from pdserve.common.logprobs import problem as logprobs_problem
from pdserve.router import streams as S
from pdserve.router.dispatch.flight import Flight, State
from pdserve.router.dispatch.placement import Placement
from pdserve.router.dispatch.registry import Registry

log = logging.getLogger(__name__)

CONTROL_IN = (P.Hello, P.Heartbeat, P.FirstTokens, P.ReserveReply, P.TokenBatch, P.Error,
              P.Drain, P.Bye, P.IndexDump, P.Resumed)
# Node errors another attempt can fix (a lost or corrupted transfer, a node gone quiet).
RETRYABLE = (E.LEASE_EXPIRED, E.TIMEOUT, E.CHECKSUM_MISMATCH, E.NO_CAPACITY, E.UNREACHABLE)
MAX_EARLY_TOKENS = 256     # decode-node tokens held while the first token is on its way
# Message budgets on the control socket (rate_limit.py). A registered node sends a few
# messages per engine step: its own bucket is far above that. Unregistered peers share one
# small bucket: Hellos, and the odd message of a node the router has forgotten.
NODE_MSGS_PER_S, NODE_BURST = 20_000.0, 40_000.0
STRANGER_MSGS_PER_S, STRANGER_BURST = 200.0, 400.0


class Attempts(Protocol):
    """What the rules may do to a request (dispatch.Dispatch is one)."""

    flights: dict[str, Flight]   # by the current attempt's wire id

    def send(self, node_id: str, msg: P.Message) -> None: ...
    def drop(self, node_id: str, what: str, req_id: str, why: str) -> None: ...
    def to_prefill(self, flight: Flight, now: float) -> None: ...
    def refused(self, flight: Flight, node_id: str, reason: str, now: float) -> None: ...
    def retry(self, flight: Flight, why: str, now: float) -> None: ...
    def fail_flight(self, flight: Flight, code: str, message: str) -> None: ...
    def deliver(self, flight: Flight, token_ids: list[int], node_reason: str | None,
                nodes_done: bool = True, logprobs: P.Logprobs | None = None,
                prompt_logprobs: P.Logprobs | None = None) -> None: ...


class NodeMessages:
    def __init__(self, registry: Registry, placement: Placement, vocab_size: int,
                 attempts: Attempts):
        self.registry, self.placement, self.vocab_size = registry, placement, vocab_size
        self.attempts = attempts
        self.flights = attempts.flights

    def handle(self, node_id: str, msg: P.Message, now: float) -> None:
        """A ReserveReply, FirstTokens, TokenBatch or Error from ``node_id``."""
        if node_id not in self.registry.nodes:
            self._drop(node_id, type(msg).__name__, "-", "the node is not registered")
        elif isinstance(msg, P.ReserveReply):
            for result in msg.items:
                self._reserve_reply(node_id, result, now)
        elif isinstance(msg, P.FirstTokens):
            for item in msg.items:
                self._first_token(node_id, item)
        elif isinstance(msg, P.TokenBatch):
            for item in msg.items:
                self._tokens(node_id, item)
        elif isinstance(msg, P.Error):
            self._node_error(node_id, msg, now)
        elif isinstance(msg, P.Resumed):  # (a stream whose router died: resume.py)
            self.attempts.resumes.reply(node_id, msg, now)
        else:
            self._drop(node_id, type(msg).__name__, "-", "not a message about requests")

    def _drop(self, node_id: str, what: str, req_id: str, why: str) -> None:
        self.attempts.drop(node_id, what, req_id, why)

    def _reserve_reply(self, node_id: str, msg: P.ReserveResult, now: float) -> None:
        flight = self.flights.get(msg.req_id)
        if flight is None or flight.decode_node != node_id or flight.state is not State.RESERVING:
            # (a reply for an earlier attempt, or for a request already gone)
            if msg.ok:  # nobody wants it any more: give the blocks back
                self.attempts.send(node_id, P.Abort(req_ids=[msg.req_id], reason="not needed"))
            return
        if msg.ok:
            # Blocks the decode node holds need not be sent; never more than the prompt has.
            block_size = self.registry.nodes[node_id].hello.kv_layout.block_size
            most = (len(flight.wire_prompt) - 1) // block_size
            flight.skip_blocks = min(max(0, msg.cached_blocks), most)
            self.attempts.to_prefill(flight, now)
        elif msg.reason.startswith(E.BAD_MESSAGE):  # no node will take it: say why now
            self.attempts.fail_flight(flight, S.BAD_REQUEST, f"decode node {node_id} refused "
                                      f"the request: {msg.reason.split(': ', 1)[-1]}")
        else:
            self.attempts.refused(flight, node_id, msg.reason, now)

    def _bad_tokens(self, node_id: str, flight: Flight, token_ids: list[int]) -> bool:
        """Fails the request when a node sent token ids outside the vocabulary."""
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            self.attempts.fail_flight(flight, S.NODE_ERROR, f"node {node_id} sent token id "
                                      f"{bad[0]}, outside the vocabulary [0, {self.vocab_size})")
        return bool(bad)

    def _bad_logprobs(self, node_id: str, flight: Flight, lp: P.Logprobs | None,
                      num_tokens: int, k: int | None) -> bool:
        """Fails the request when logprobs it asked for (k alternatives) are missing or do
        not fit ``num_tokens`` tokens."""
        why = None if k is None else logprobs_problem(lp, num_tokens, k, self.vocab_size)
        if why:
            self.attempts.fail_flight(flight, S.NODE_ERROR, f"node {node_id}: {why}")
        return bool(why)

    def _first_token(self, node_id: str, item: P.FirstToken) -> None:
        flight = self.flights.get(item.req_id)
        if flight is None:
            return  # an earlier attempt's, or a request already gone
        if flight.prefill_node != node_id or flight.state is not State.PREFILLING:
            why = "a first token was already taken" if flight.state is State.DECODING \
                else f"the request is {flight.state.value} on other nodes"
            self._drop(node_id, "FirstToken", item.req_id, why)
            return
        if self._bad_tokens(node_id, flight, [item.token_id]) or self._bad_logprobs(
                node_id, flight, item.logprobs, 1, flight.spec.logprobs) \
                or self._bad_logprobs(node_id, flight, item.prompt_logprobs,
                                      len(flight.wire_prompt) - 1, flight.spec.prompt_logprobs):
            return
        self.placement.queue(node_id, -len(flight.wire_prompt))
        if flight.decode_node != node_id:  # a colocated node serves it on
            self.placement.unplace(node_id, item.req_id)
        flight.state = State.DECODING
        # A first token that ends the request leaves a decode reservation to release.
        self.attempts.deliver(flight, [item.token_id], item.finish_reason, nodes_done=False,
                              logprobs=item.logprobs, prompt_logprobs=item.prompt_logprobs)
        for early in flight.early_tokens:
            if item.req_id in self.flights:  # (not ended by the tokens before)
                self.attempts.deliver(flight, early.token_ids, early.finish_reason,
                                      logprobs=early.logprobs)
        flight.early_tokens.clear()

    def _tokens(self, node_id: str, item: P.TokenItem) -> None:
        flight = self.flights.get(item.req_id)
        if flight is None:
            return
        if flight.decode_node != node_id or \
                flight.state not in (State.PREFILLING, State.DECODING):
            self._drop(node_id, "TokenItem", item.req_id,
                       f"the node does not decode it (state {flight.state.value})")
            return
        if self._bad_tokens(node_id, flight, item.token_ids) or self._bad_logprobs(
                node_id, flight, item.logprobs, len(item.token_ids), flight.spec.logprobs):
            return
        if flight.state is State.DECODING:
            self.attempts.deliver(flight, item.token_ids, item.finish_reason,
                                  logprobs=item.logprobs)
        elif len(flight.early_tokens) < MAX_EARLY_TOKENS:
            flight.early_tokens.append(item)
        else:
            self.attempts.fail_flight(flight, S.NODE_ERROR, (
                f"decode node {node_id} sent more than {MAX_EARLY_TOKENS} token batches "
                "before the first token arrived"))

    def _node_error(self, node_id: str, msg: P.Error, now: float) -> None:
        flight = self.flights.get(msg.req_id) if msg.req_id else None
        if flight is None:
            log.warning("error from node %s: %s %s", node_id, msg.code, msg.message)
        elif node_id not in (flight.prefill_node, flight.decode_node):
            self._drop(node_id, "Error", msg.req_id, "the node does not serve it")
        elif msg.code in RETRYABLE:
            self.attempts.retry(flight, f"node {node_id}: {msg.message} ({msg.code})", now)
        elif msg.code == E.BAD_GUIDE:  # the request's own grammar: no node will do better
            self.attempts.fail_flight(flight, S.BAD_REQUEST, f"node {node_id}: {msg.message}")
        elif msg.code == E.STREAM_MOVED and node_id == flight.decode_node:
            # Its producer resumed it on another router, which streams the rest.
            self.attempts.fail_flight(flight, S.STREAM_MOVED, f"decode node {node_id}: "
                                      f"{msg.message}; its tokens and its end go there")
        else:
            self.attempts.fail_flight(flight, S.NODE_ERROR,
                                      f"node {node_id}: {msg.message} ({msg.code})")
