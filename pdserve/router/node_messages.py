"""What nodes send the router, and who may say what.

Mixed into RouterCore (it shares the core's flights and registry). The rules:

- Hello: a node speaks only for its own socket identity. The same node id with the
  same ``incarnation`` again (the router stalled, the node said Hello once more) is a
  resync: the node keeps its work. A new incarnation is a restart: its work moves.
- A first token is taken only from the prefill node of the request's current attempt,
  while the request waits for it; later tokens only from its decode node. Anything else
  (another node, an earlier attempt, a duplicate) is dropped and logged, never shown to
  a client. Token ids must lie inside the vocabulary.
- An Error naming a request counts only from a node serving that request.
"""
from __future__ import annotations

import logging

from pdserve.common import errors as E
from pdserve.common import protocol as P
from pdserve.common.rate_limit import PeerBudgets
from pdserve.common.transport import Throttled, async_recv_routed
from pdserve.engine.logprobs import problem as logprobs_problem
from pdserve.router import streams as S

log = logging.getLogger(__name__)

RESERVING, PREFILLING, DECODING = "reserving", "prefilling", "decoding"
CONTROL_IN = (P.Hello, P.Heartbeat, P.FirstTokens, P.ReserveReply, P.TokenBatch, P.Error,
              P.Drain, P.Bye)
# Node errors another attempt can fix (a lost or corrupted transfer, a node gone quiet).
RETRYABLE = (E.LEASE_EXPIRED, E.TIMEOUT, E.CHECKSUM_MISMATCH, E.NO_CAPACITY, E.UNREACHABLE)
MAX_EARLY_TOKENS = 256     # decode-node tokens held while the first token is on its way
# Message budgets on the control socket (rate_limit.py). A registered node sends a few
# messages per engine step: its own bucket is far above that. Unregistered peers share one
# small bucket: Hellos, and the odd message of a node the router has forgotten.
NODE_MSGS_PER_S, NODE_BURST = 20_000.0, 40_000.0
STRANGER_MSGS_PER_S, STRANGER_BURST = 200.0, 400.0


class NodeMessages:
    """The control socket's receiving side of RouterCore (which sets ``_refusal_log``, a
    LogThrottle, ``incarnation`` and ``loop_ticks``)."""

    def _message_budgets(self) -> PeerBudgets:
        nodes = self.registry.nodes
        return PeerBudgets(lambda peer: peer.decode(errors="replace") in nodes,
                           rate=NODE_MSGS_PER_S, burst=NODE_BURST,
                           stranger_rate=STRANGER_MSGS_PER_S, stranger_burst=STRANGER_BURST)

    async def _receive_loop(self) -> None:
        budgets = self._message_budgets()
        while True:
            try:
                peer, msg = await async_recv_routed(self._sock, CONTROL_IN, admit=budgets.admit)
            except Throttled as err:
                self.metrics.dropped("rate_limit")
                if self._refusal_log(("throttled", err.peer)) is not None:
                    log.warning("messages from %r dropped: %s", err.peer, err)
                continue
            except P.ProtocolError as err:
                if self._refusal_log(("bad", err.peer, err.code)) is not None:
                    log.warning("bad message from node %r: %s", err.peer, err)
                if err.peer is not None:
                    self._send(err.peer, err.to_message())
                continue
            except Exception:  # a socket failure: count it, keep the loop
                self.metrics.internal_error("router.receive", log)
                continue
            self.loop_ticks["receive"] += 1
            try:
                self._handle(peer.decode(errors="replace"), msg)
            except Exception:  # one bad message must not stop the router
                self.metrics.internal_error(f"router.receive.{type(msg).__name__}", log)

    def _refuse(self, node_id: str, what: str, req_id: str, why: str) -> None:
        if self._refusal_log((node_id, what, why)) is not None:
            log.warning("%s for %s from node %s dropped: %s", what, req_id, node_id, why)

    def _handle(self, node_id: str, msg: P.Message) -> None:
        if isinstance(msg, P.Hello):
            self._hello(node_id, msg)
            return
        node = self.registry.seen(node_id, getattr(msg, "stats", None))
        if node is None:
            if not isinstance(msg, (P.Heartbeat, P.Bye)):
                self._refuse(node_id, type(msg).__name__, "-", "the node is not registered")
            return
        if isinstance(msg, P.ReserveReply):
            self._reserve_reply(node_id, msg)
        elif isinstance(msg, P.FirstTokens):
            for item in msg.items:
                self._first_token(node, item)
        elif isinstance(msg, P.TokenBatch):
            for item in msg.items:
                self._tokens(node_id, item)
        elif isinstance(msg, P.Error):
            self._node_error(node_id, msg)
        elif isinstance(msg, P.Drain):
            node.state = "draining"
            log.info("node %s is draining: %s", node_id, msg.reason)
        elif isinstance(msg, P.Bye):
            self._node_gone(self.registry.remove(node_id), f"node {node_id} left: {msg.reason}")

    def _hello(self, node_id: str, msg: P.Hello) -> None:
        def welcome(ok: bool, reason: str) -> None:
            self._send(node_id, P.Welcome(
                accepted=ok, reason=reason, liveness=self.config.liveness,
                heartbeat_interval_s=self.config.heartbeat_interval_s,
                router_incarnation=self.incarnation))

        if msg.node_id != node_id:  # one node may not speak for another
            log.warning("hello refused: node_id %r differs from its socket identity %r",
                        msg.node_id, node_id)
            welcome(False, f"node_id {msg.node_id!r} must equal the socket identity "
                    f"{node_id!r}")
            return
        known = self.registry.nodes.get(node_id)
        resync = known is not None and bool(msg.incarnation) \
            and known.hello.incarnation == msg.incarnation
        if known is not None and not resync:  # restarted: its old work is gone with it
            self._node_gone(self.registry.remove(node_id), f"node {node_id} restarted")
        ok, reason = self.registry.admit(msg, keep=resync)
        if resync and ok:
            log.info("%s node %s said hello again (same incarnation): resynced, its %d "
                     "requests stay", msg.role, node_id, len(known.requests))
        else:
            (log.info if ok else log.warning)("%s node %s %s%s", msg.role, node_id,
                                              "joined" if ok else "refused: ", reason)
        if resync and not ok:
            self._node_gone(known, f"node {node_id} is not admitted any more: {reason}")
        welcome(ok, reason)

    def _reserve_reply(self, node_id: str, msg: P.ReserveReply) -> None:
        flight = self.flights.get(msg.req_id)
        if flight is None or flight.decode_node != node_id or flight.state != RESERVING:
            # (a reply for an earlier attempt, or for a request already gone)
            if msg.ok:  # nobody wants it any more: give the blocks back
                self._send(node_id, P.Abort(req_ids=[msg.req_id], reason="not needed"))
            return
        if msg.ok:
            # Blocks the decode node holds need not be sent; never more than the prompt has.
            block_size = self.registry.nodes[node_id].hello.kv_layout.block_size
            most = (len(flight.wire_prompt) - 1) // block_size
            flight.skip_blocks = min(max(0, msg.cached_blocks), most)
            self._to_prefill(flight)
        elif msg.reason.startswith(E.BAD_MESSAGE):  # no node will take it: say why now
            self._fail(flight, S.BAD_REQUEST, f"decode node {node_id} refused the "
                       f"request: {msg.reason.split(': ', 1)[-1]}")
        else:
            self._refused(flight, node_id, msg.reason)

    def _bad_tokens(self, node_id: str, flight, token_ids: list[int]) -> bool:
        """Fails the request when a node sent token ids outside the vocabulary."""
        vocab = self.model_config.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            self._fail(flight, S.NODE_ERROR, f"node {node_id} sent token id {bad[0]}, outside "
                       f"the vocabulary [0, {vocab})")
        return bool(bad)

    def _bad_logprobs(self, node_id: str, flight, lp: P.Logprobs | None, num_tokens: int,
                      k: int | None) -> bool:
        """Fails the request when logprobs it asked for (k alternatives) are missing or do
        not fit ``num_tokens`` tokens."""
        why = None if k is None else logprobs_problem(lp, num_tokens, k,
                                                      self.model_config.vocab_size)
        if why:
            self._fail(flight, S.NODE_ERROR, f"node {node_id}: {why}")
        return bool(why)

    def _first_token(self, node, item: P.FirstToken) -> None:
        flight = self.flights.get(item.req_id)
        if flight is None:
            return  # an earlier attempt's, or a request already gone
        if flight.prefill_node != node.node_id or flight.state != PREFILLING:
            why = "a first token was already taken" if flight.state == DECODING \
                else f"the request is {flight.state} on other nodes"
            self._refuse(node.node_id, "FirstToken", item.req_id, why)
            return
        if self._bad_tokens(node.node_id, flight, [item.token_id]) or self._bad_logprobs(
                node.node_id, flight, item.logprobs, 1, flight.spec.logprobs) \
                or self._bad_logprobs(node.node_id, flight, item.prompt_logprobs,
                                      len(flight.wire_prompt) - 1, flight.spec.prompt_logprobs):
            return
        node.queued_prompt_tokens -= len(flight.wire_prompt)
        if flight.decode_node != node.node_id:  # a colocated node serves it on
            node.requests.discard(item.req_id)
        flight.state = DECODING
        # A first token that ends the request leaves a decode reservation to release.
        self._deliver(flight, [item.token_id], item.finish_reason, nodes_done=False,
                      logprobs=item.logprobs, prompt_logprobs=item.prompt_logprobs)
        for early in flight.early_tokens:
            if item.req_id in self.flights:
                self._deliver(flight, early.token_ids, early.finish_reason,
                              logprobs=early.logprobs)
        flight.early_tokens.clear()

    def _tokens(self, node_id: str, item: P.TokenItem) -> None:
        flight = self.flights.get(item.req_id)
        if flight is None:
            return
        if flight.decode_node != node_id or flight.state not in (PREFILLING, DECODING):
            self._refuse(node_id, "TokenItem", item.req_id,
                         f"the node does not decode it (state {flight.state})")
            return
        if self._bad_tokens(node_id, flight, item.token_ids) or self._bad_logprobs(
                node_id, flight, item.logprobs, len(item.token_ids), flight.spec.logprobs):
            return
        if flight.state == DECODING:
            self._deliver(flight, item.token_ids, item.finish_reason, logprobs=item.logprobs)
        elif len(flight.early_tokens) < MAX_EARLY_TOKENS:
            flight.early_tokens.append(item)
        else:
            self._fail(flight, S.NODE_ERROR, f"decode node {node_id} sent more than "
                       f"{MAX_EARLY_TOKENS} token batches before the first token arrived")

    def _node_error(self, node_id: str, msg: P.Error) -> None:
        flight = self.flights.get(msg.req_id) if msg.req_id else None
        if flight is None:
            log.warning("error from node %s: %s %s", node_id, msg.code, msg.message)
        elif node_id not in (flight.prefill_node, flight.decode_node):
            self._refuse(node_id, "Error", msg.req_id, "the node does not serve it")
        elif msg.code in RETRYABLE:
            self._retry(flight, f"node {node_id}: {msg.message} ({msg.code})")
        else:
            self._fail(flight, S.NODE_ERROR, f"node {node_id}: {msg.message} ({msg.code})")
