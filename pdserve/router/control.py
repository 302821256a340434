"""The router's control socket: node membership, heartbeats, the clock, and the I/O of
dispatch.

One ROUTER socket, bound; nodes connect (DEALER), say Hello and heartbeat. ``Control``
owns the socket (the receive loop and every send), the registry's membership (Hello,
Bye, Drain, heartbeats, expiry), the clock (every TICK_S: a stall of the router itself,
dead nodes, heartbeats, then ``dispatch.tick``) and the flush of prefill batches once
per event-loop turn. Node messages about requests go to the Dispatch; what it returns is
applied here (``apply``): its messages sent, its client events pushed into the request
streams (``streams``, the table the core registers each request's stream in). The way is
one way: core -> control -> dispatch, and back only as return values.

Membership rules: a node id belongs to the connection (socket identity) whose Hello
registered it, and a message speaks for the node its connection registered, never for the
id it names. Another connection claiming a registered id is refused (``name_taken``) while
the holder is still connected, and with CURVE whenever its key (ZAP's User-Id) differs
from the holder's; a node that restarted (its old connection is gone) takes its id back.
The same node id with the same ``incarnation`` again (the router stalled, the node said
Hello once more) is a resync: the node keeps its work. A new incarnation is a restart:
its work moves. No
failure of one message or one tick stops a loop, and a router that was itself stalled
(SIGSTOP, swapped out) does not blame the nodes for its own silence.
"""
from __future__ import annotations

import asyncio
import logging
import os
import time

import zmq

from pdserve.common import errors as E
from pdserve.common import protocol as P
from pdserve.common.logs import LogThrottle
from pdserve.common.metrics import RouterMetrics
from pdserve.common.rate_limit import PeerBudgets
from pdserve.common.security import CONTROL_DOMAIN, server_curve
from pdserve.common.transport import (
    NAMED_ROUTER_HEARTBEAT_MS,
    PlainTwin,
    SendError,
    Throttled,
    make_socket,
    split_routed,
)
from pdserve.router import streams as S
from pdserve.router.config import RouterConfig
from pdserve.router.dispatch.dispatch import Dispatch
from pdserve.router.dispatch.flight import Output
from pdserve.router.dispatch.node_messages import (
    CONTROL_IN,
    NODE_BURST,
    NODE_MSGS_PER_S,
    STRANGER_BURST,
    STRANGER_MSGS_PER_S,
)
from pdserve.router.dispatch.registry import Registry

log = logging.getLogger(__name__)

TICK_S = 0.05              # deadlines, heartbeats and dead nodes are checked this often


class Control:
    def __init__(self, config: RouterConfig, registry: Registry, dispatch: Dispatch,
                 metrics: RouterMetrics, streams: dict[str, S.RequestStream]):
        self.config, self.registry, self.dispatch = config, registry, dispatch
        self.metrics, self.streams = metrics, streams
        self.incarnation = os.urandom(8).hex()
        self.loop_ticks = {"receive": 0, "tick": 0}   # turns of each loop (/health reads them)
        self.last_tick = time.monotonic()
        self._next_beat = 0.0
        self._refusal_log = LogThrottle(period_s=10.0)
        self._flush_scheduled = False
        # Who is who: each registered node id and the connection its Hello came on (both
        # ways), with that connection's CURVE key ("" when plain). Pruned on every tick.
        self._routes: dict[str, bytes] = {}
        self._names: dict[bytes, str] = {}
        self._keys: dict[str, str] = {}
        self._ctx: zmq.Context | None = None
        self._sock = None
        # cache_aware's index feed (kv_index.py), which takes the nodes' index dumps and
        # the event numbers their heartbeats carry; None with any other policy.
        self.index_feed = None

    def open(self) -> None:
        self._ctx = zmq.Context()
        self._sock = make_socket(self._ctx, zmq.ROUTER, bind=self.config.control,
                                 max_msg_size=64 * 2**20,
                                 heartbeat_ivl_ms=NAMED_ROUTER_HEARTBEAT_MS,
                                 curve=server_curve(self.config.curve_dir, CONTROL_DOMAIN))
        self._twin = PlainTwin(self._sock)  # every send and receive goes through it
        self.last_tick = time.monotonic()

    def close(self) -> None:
        if self._sock is not None:
            self._twin.close()
            self._sock.close(0)
            self._ctx.term()
            self._sock = self._ctx = None

    # -- sending what dispatch decided ------------------------------------------------------
    def apply(self, out: Output) -> None:
        """Sends ``out``'s messages, then hands its client events over (a client that
        cancels on an event must find its Abort sent after what it aborts). A send that
        fails goes back to dispatch (which picks another node or retries); a node found
        not connected leaves the registry at once (nobody may pick it) and its other
        requests move once the failed sends are dealt with."""
        todo, sent = [out], False
        try:
            while todo:
                out = todo.pop(0)
                gone = []
                for node_id, msg in out.sends:
                    sent = True
                    why = self._send(node_id, msg)
                    if why is None:
                        continue
                    if why == "unreachable":
                        node = self.registry.remove(_text(node_id))
                        if node is not None:
                            gone.append(node)
                    todo.append(self.dispatch.send_failed(node_id, msg, time.monotonic()))
                for node in gone:
                    todo.append(self.dispatch.node_gone(
                        node, f"node {node.node_id} is not connected any more",
                        time.monotonic()))
                for node_id, what, req_id, why in out.dropped:
                    self._refuse(node_id, what, req_id, why)
                if out.events:
                    todo.extend(self._deliver(out.events))
        finally:
            if sent:
                self._twin.rearm()
        if self.dispatch.has_batches() and not self._flush_scheduled:
            self._flush_scheduled = True  # what comes in this loop turn leaves together
            asyncio.get_running_loop().call_soon(self._flush)

    def _deliver(self, events: list[tuple[str, S.StreamEvent]]) -> list[Output]:
        """Pushes each event into its request's stream (a stream whose request ended is
        forgotten); what dispatch decided for requests whose sink failed."""
        failed = []
        for req_id, event in events:
            stream = self.streams.get(req_id)
            if stream is None:
                continue
            if event.is_last:
                del self.streams[req_id]
            try:
                stream.push(event)
            except Exception:  # a front end's sink failed: that request ends, no other
                self.metrics.internal_error("router.deliver", log)
                if not event.is_last:
                    failed.append(self.dispatch.fail(
                        req_id, S.INTERNAL, "internal error while delivering; see the log"))
        return failed

    def _send(self, node_id: str | bytes, msg: P.Message) -> str | None:
        """None when sent, else why not ("unreachable", "full", "unencodable"). A str is a
        node id (sent on the connection that registered it), bytes a socket identity."""
        peer = node_id if isinstance(node_id, bytes) else self._routes.get(node_id)
        if peer is None:
            return "unreachable"
        try:
            self._twin.send_routed(peer, msg)
            return None
        except P.ProtocolError as exc:  # cannot be encoded: dispatch fails what it carried
            log.error("%s to node %s not sent: %s", type(msg).__name__, _text(node_id), exc)
            return "unencodable"
        except SendError as exc:
            log.warning("send of %s to node %s failed: %s", type(msg).__name__,
                        _text(node_id), exc)
            return exc.reason

    def _flush(self) -> None:
        self._flush_scheduled = False
        try:
            self.apply(self.dispatch.flush(time.monotonic()))
        except Exception:  # the next flush must still come
            self.metrics.internal_error("router.flush", log)
            self._salvage("router.flush")

    def _salvage(self, where: str) -> None:
        """After a handler raised: what dispatch decided before the failure still goes out
        (tokens already counted as the client's must reach it)."""
        try:
            self.apply(self.dispatch.take())
        except Exception:
            self.metrics.internal_error(where, log)

    # -- receiving ------------------------------------------------------------------------
    def _message_budgets(self) -> PeerBudgets:
        nodes, names = self.registry.nodes, self._names
        return PeerBudgets(lambda peer: names.get(peer) in nodes,
                           rate=NODE_MSGS_PER_S, burst=NODE_BURST,
                           stranger_rate=STRANGER_MSGS_PER_S, stranger_burst=STRANGER_BURST)

    async def receive_loop(self) -> None:
        """Feeds each message to ``self.handle`` (node id, message), looked up per message
        (a wrapper set later is used: tests inject faults that way)."""
        budgets = self._message_budgets()
        while True:
            try:
                async for frames in self._twin.received(copy=False):
                    self._receive(frames, budgets)
            except Exception:  # a socket failure: count it, keep the loop
                self.metrics.internal_error("router.receive", log)

    def _receive(self, frames: list, budgets: PeerBudgets) -> None:
        try:
            peer, msg = split_routed(frames, CONTROL_IN, budgets.admit)
        except Throttled as err:
            self.metrics.dropped("rate_limit")
            if self._refusal_log(("throttled", err.peer)) is not None:
                log.warning("messages from %r dropped: %s", err.peer, err)
            return
        except P.ProtocolError as err:
            if self._refusal_log(("bad", err.peer, err.code)) is not None:
                log.warning("bad message from node %r: %s", err.peer, err)
            if err.peer is not None:
                self.apply(Output(sends=[(err.peer, err.to_message())]))
            return
        self.loop_ticks["receive"] += 1
        try:
            if isinstance(msg, P.Hello):
                self._hello(peer, _user_id(frames[1]), msg, time.monotonic())
            else:  # a connection that registered no node speaks for nobody
                self.handle(self._names.get(peer, f"(unregistered {_text(peer)})"), msg)
        except Exception:  # one bad message must not stop the router
            where = f"router.receive.{type(msg).__name__}"
            self.metrics.internal_error(where, log)
            self._salvage(where)

    def _refuse(self, node_id: str, what: str, req_id: str, why: str) -> None:
        if self._refusal_log((node_id, what, why)) is not None:
            log.warning("%s for %s from node %s dropped: %s", what, req_id, node_id, why)

    def handle(self, node_id: str, msg: P.Message) -> None:
        """A message from the node ``node_id`` (that of its connection; not a Hello)."""
        now = time.monotonic()
        node = self.registry.seen(node_id, getattr(msg, "stats", None), now)
        if node is None:
            if not isinstance(msg, (P.Heartbeat, P.Bye)):
                self._refuse(node_id, type(msg).__name__, "-", "the node is not registered")
        elif isinstance(msg, P.Drain):
            self.registry.drain(node_id)
            log.info("node %s is draining: %s", node_id, msg.reason)
        elif isinstance(msg, P.Bye):
            self.apply(self.dispatch.node_gone(self.registry.remove(node_id),
                                               f"node {node_id} left: {msg.reason}", now))
        elif isinstance(msg, P.Heartbeat):  # alive (its stats are the registry's now)
            if self.index_feed is not None and msg.stats is not None:
                self.index_feed.heartbeat(node_id, msg.stats)
        elif isinstance(msg, P.IndexDump):
            if self.index_feed is not None:
                self.index_feed.dump(node_id, msg)
            else:
                self._refuse(node_id, "IndexDump", "-", "this router keeps no prefix index")
        else:
            self.apply(self.dispatch.node_message(node_id, msg, now))

    def _hello(self, peer: bytes, user: str, msg: P.Hello, now: float) -> None:
        node_id = msg.node_id

        def welcome(ok: bool, reason: str, code: str = "") -> None:
            self.apply(Output(sends=[(peer, P.Welcome(
                accepted=ok, reason=reason, liveness=self.config.liveness,
                heartbeat_interval_s=self.config.heartbeat_interval_s,
                router_incarnation=self.incarnation, code=code))]))

        taken = self._claim_refused(peer, user, node_id)
        if taken is not None:
            if self._refusal_log(("hello", peer, node_id)) is not None:
                log.warning("hello from %r refused: %s", peer, taken)
            welcome(False, taken, E.NAME_TAKEN)
            return
        old = self._routes.get(node_id)
        if old is not None and old != peer:
            self._names.pop(old, None)  # the node's old connection is gone: it speaks no more
        self._routes[node_id], self._names[peer], self._keys[node_id] = peer, node_id, user
        known = self.registry.nodes.get(node_id)
        resync = known is not None and bool(msg.incarnation) \
            and known.hello.incarnation == msg.incarnation
        if known is not None and not resync:  # restarted: its old work is gone with it
            self.apply(self.dispatch.node_gone(self.registry.remove(node_id),
                                               f"node {node_id} restarted", now))
        ok, reason = self.registry.admit(msg, now=now, keep=resync)
        if resync and ok:
            log.info("%s node %s said hello again (same incarnation): resynced, its %d "
                     "requests stay", msg.role, node_id,
                     self.dispatch.placement.num_requests(node_id))
        else:
            (log.info if ok else log.warning)("%s node %s %s%s", msg.role, node_id,
                                              "joined" if ok else "refused: ", reason)
        if resync and not ok:
            self.apply(self.dispatch.node_gone(
                known, f"node {node_id} is not admitted any more: {reason}", now))
        welcome(ok, reason)

    def _claim_refused(self, peer: bytes, user: str, node_id: str) -> str | None:
        """Why the connection ``peer`` (CURVE key ``user``) may not register ``node_id``;
        None if it may."""
        mine = self._names.get(peer)
        if mine is not None and mine != node_id and mine in self.registry.nodes:
            return (f"this connection registered node {mine!r}; it cannot also be "
                    f"{node_id!r}")
        holder = self._routes.get(node_id)
        if holder is None or holder == peer or node_id not in self.registry.nodes:
            return None
        if user != self._keys.get(node_id, ""):
            return (f"node id {node_id!r} is registered with another CURVE key; it is free "
                    "once that node leaves or misses its heartbeats")
        try:  # is the holder still connected? (ROUTER_MANDATORY: a send says so at once)
            self._twin.send_routed(holder, P.Heartbeat(node_id="router", stats=None))
        except SendError as exc:
            if exc.reason == "unreachable":  # it has gone (restarted): the id is free
                return None
        finally:
            self._twin.rearm()
        return (f"node id {node_id!r} is held by another connection that is still "
                "connected; it is free once that one leaves or misses its heartbeats")

    # -- the clock --------------------------------------------------------------------------
    async def tick_loop(self) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            try:
                self.tick(time.monotonic())
            except Exception:  # the clock must keep going: deadlines, liveness, heartbeats
                self.metrics.internal_error("router.tick", log)
                self._salvage("router.tick")
            self.loop_ticks["tick"] += 1

    def tick(self, now: float) -> None:
        stalled, self.last_tick = now - self.last_tick, now
        if stalled > self.registry.timeout_s / 2:
            # This process was stalled (stopped, swapped out): the nodes' silence is ours.
            # Their heartbeats wait unread in the socket; give them a fresh window.
            log.warning("the router's loop stalled for %.1f s: no node is blamed for it",
                        stalled)
            for node in self.registry.nodes.values():
                node.last_seen = max(node.last_seen, now)
        for name in [n for n in self._routes if n not in self.registry.nodes]:
            self._names.pop(self._routes.pop(name), None)  # bindings of nodes gone
            self._keys.pop(name, None)
        for node in self.registry.expire(now):
            self.apply(self.dispatch.node_gone(
                node, f"node {node.node_id} missed {self.config.liveness} heartbeats", now))
        if now >= self._next_beat:
            self._next_beat = now + self.config.heartbeat_interval_s
            beat = P.Heartbeat(node_id="router", stats=None)
            self.apply(Output(sends=[(node_id, beat) for node_id in self.registry.nodes]))
        self.apply(self.dispatch.tick(now))


def _user_id(frame) -> str:
    """The ZAP User-Id of a received frame (with CURVE, the peer's public key, Z85); ""
    on a plain socket."""
    try:
        return frame.get("User-Id") or ""
    except (zmq.ZMQError, AttributeError):
        return ""


def _text(node_id: str | bytes) -> str:
    return node_id.decode(errors="replace") if isinstance(node_id, bytes) else node_id
