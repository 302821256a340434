"""The I/O side of a node: one thread owns its sockets (the compute loop may send on one).

The compute loop never waits on a socket: it reads decoded messages from
``inbox`` and hands messages to send to ``send_*``, which queue them and wake
this thread through a pipe. Heartbeats are sent from here on their own clock,
so they keep flowing while a long forward runs (torch releases the GIL).

One exception, for speed: a message to the routers leaves from the compute
thread itself (``send_control``, NOBLOCK; that thread only) when this thread
is between turns and has sent every control message queued before it (a KV
message queued earlier may leave later: no peer relies on that order). Waking
this thread for each token cost up to ~0.1 ms of a batch-1 token (RESULTS.md).
``_lock`` guards the control sockets and routers.py's state. This thread polls
those sockets' descriptors, not the sockets (``Link.readable`` in routers.py
says why), and a sender wakes it when a message waits unread.

Channels (the first item of each inbox entry):
- ``control``: a DEALER to each router's control socket (routers.py); entries carry the
               router's endpoint as the peer.
- ``kv_in``:   the ROUTER a decode node binds for KV; entries carry the peer.
- ``kv_out``:  DEALERs a prefill node opens to decode nodes' KV sockets;
               entries carry the decode node's KV address as the peer.
"""
from __future__ import annotations

import logging
import os
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable

import msgspec
import zmq

from pdserve.common import errors as E
from pdserve.common import protocol as P
from pdserve.common.discovery import advertised
from pdserve.common.logs import LogThrottle
from pdserve.common.rate_limit import PeerBudgets
from pdserve.common.security import CONTROL_MAX_MSG_BYTES, NodeCurves, kv_max_msg_size
from pdserve.common.transport import (
    NAMED_ROUTER_HEARTBEAT_MS,
    NOBLOCK,
    SendError,
    Throttled,
    endpoint_of,
    make_socket,
    recv_message,
    recv_routed,
    send_message,
    send_routed,
)
from pdserve.node.kv_out import KVOut
from pdserve.node.routers import Link, RouterLinks

log = logging.getLogger(__name__)

CONTROL, KV_IN, KV_OUT = "control", "kv_in", "kv_out"
INBOX_MAX = 10_000        # received messages not yet taken: past it, sockets are not read
OUTBOX_MAX = 100_000      # messages to send: past it, the compute loop waits (backpressure)
POLL_MAX_MS = 500         # the longest the thread sleeps between turns with nothing to do
# Message budgets on a decode node's KV socket (rate_limit.py): a prefill node that an open
# reservation names sends at full speed; every other peer shares one small budget.
KV_PEER_MSGS_PER_S, KV_PEER_BURST = 20_000.0, 40_000.0
KV_STRANGER_MSGS_PER_S, KV_STRANGER_BURST = 200.0, 400.0
# What each channel may carry to a node; anything else is answered with an Error.
CONTROL_IN = (P.Welcome, P.Heartbeat, P.PrefillBatch, P.Reserve, P.Abort, P.Drain, P.Error,
              P.IndexDumpRequest, P.Resume, P.Release)
KV_IN_TYPES = (P.KVChunk,)
KV_OUT_TYPES = (P.KVAck, P.Error)


@dataclass(frozen=True)
class InboxItem:
    channel: str
    peer: bytes | str | None
    msg: P.Message


class NodeIO(threading.Thread):
    def __init__(self, routers: list[str], hello: P.Hello, *, kv_bind: str | None = None,
                 advertise_host: str | None = None, heartbeat_interval_s: float = 1.0,
                 welcome_timeout_s: float = 30.0, curve: NodeCurves | None = None,
                 dropped: Callable[[str], None] | None = None):
        super().__init__(name=f"io-{hello.node_id}", daemon=True)
        self.curve = curve  # CURVE keys of every socket below; None: plain
        self.dropped = dropped  # counts a message dropped unread, by reason
        # Prefill nodes (socket identities) whose KV this decode node expects: replaced
        # whole by the compute loop, read here.
        self.expected_kv_peers: frozenset[bytes] = frozenset()
        self._kv_budgets = PeerBudgets(
            lambda peer: peer in self.expected_kv_peers, rate=KV_PEER_MSGS_PER_S,
            burst=KV_PEER_BURST, stranger_rate=KV_STRANGER_MSGS_PER_S,
            stranger_burst=KV_STRANGER_BURST)
        self._throttled_log = LogThrottle(period_s=10.0)
        self.links = RouterLinks(routers, keeps_streams=hello.role == "decode")
        self.hello = hello
        self.kv_bind = kv_bind
        self.advertise_host = advertise_host
        self.heartbeat_interval_s = heartbeat_interval_s
        self.welcome_timeout_s = welcome_timeout_s
        self.inbox: queue.Queue[InboxItem] = queue.Queue(INBOX_MAX)
        self.stats: P.NodeStats = hello.capacity   # replaced (atomically) by the compute loop
        self.welcome: P.Welcome | None = None
        self.welcomed = threading.Event()
        self.failure: BaseException | None = None
        self._outbox: queue.Queue[tuple[str, object, P.Message]] = queue.Queue(OUTBOX_MAX)
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._pipe_lock = threading.Lock()   # no write to the pipe once it is closed
        self._woken = False  # the pipe was written since the thread last read it
        self._lock = threading.Lock()  # the control sockets, self.links (the docstring)
        self._open = False    # the control sockets are there to send on (under _lock)
        self._queued = self._flushed = 0  # control messages queued; of those, sent
        self._stopping = threading.Event()

    # -- called from the compute thread ------------------------------------------------
    def send_control(self, msg: P.Message, to: str | None = None) -> None:
        """To the routers the message concerns (routers.py), or only to the router ``to``
        (its control endpoint). Sent from here when the I/O thread is between turns and
        has sent every one queued before it (the order is kept); queued otherwise."""
        if self._queued == self._flushed and self._lock.acquire(blocking=False):
            try:
                if self._open and self._queued == self._flushed:
                    self._send_control(to, msg)
                    return
            finally:
                if self._open and not self.inbox.full() and \
                        any(link.readable for link in self.links.links.values()):
                    self._wake()  # a message to read (its signal this send may have taken)
                self._lock.release()
        self._queued += 1
        self._put(CONTROL, to, msg)

    def send_kv_reply(self, peer: bytes, msg: P.Message) -> None:
        self._put(KV_IN, peer, msg)

    def send_kv(self, address: str, msg: P.Message) -> None:
        self._put(KV_OUT, address, msg)

    def peer_identity(self) -> bytes:
        """This node's identity on every socket it connects (the router's control socket,
        decode nodes' KV sockets): what the router names it by to decode nodes."""
        return P.peer_identity(self.hello.node_id, self.hello.incarnation)

    def set_routers(self, endpoints: list[str]) -> None:
        """The routers to serve from now on (any thread: the etcd watch calls it)."""
        self.links.set_wanted(endpoints)
        self._wake()

    def stop(self) -> None:
        self._stopping.set()
        self._wake()

    def _put(self, channel: str, peer, msg: P.Message) -> None:
        while True:
            try:
                self._outbox.put((channel, peer, msg), timeout=0.5)
                break
            except queue.Full:  # the I/O thread is behind: wait for it, unless it is gone
                self._wake()
                if not self.is_alive():
                    return
        if not self._woken:  # one pipe write per wake-up, not per message (a syscall each)
            self._woken = True
            self._wake()

    def _wake(self) -> None:
        with self._pipe_lock:
            if self._wake_w is None:
                return  # the thread has ended and closed the pipe
            try:
                os.write(self._wake_w, b"x")
            except BlockingIOError:
                pass  # the pipe is full: the thread is awake already

    # -- the thread ----------------------------------------------------------------------
    def run(self) -> None:
        ctx = zmq.Context()
        socks: list[zmq.Socket] = []
        try:
            kv_in = None
            if self.kv_bind:
                limit = kv_max_msg_size(self.hello.kv_layout,
                                        self.hello.capacity.num_total_blocks)
                kv_in = make_socket(ctx, zmq.ROUTER, bind=self.kv_bind, max_msg_size=limit,
                                    heartbeat_ivl_ms=NAMED_ROUTER_HEARTBEAT_MS,
                                    curve=self.curve.kv_server if self.curve else None)
                socks.append(kv_in)
                address = advertised(endpoint_of(kv_in), self.advertise_host)
                self.hello = msgspec.structs.replace(self.hello, kv_address=address)
            poller = zmq.Poller()
            kv_out = KVOut(ctx, poller, socks, self.peer_identity(),
                           self.curve.kv_client if self.curve else None)
            if kv_in is not None:
                poller.register(kv_in, zmq.POLLIN)
            poller.register(self._wake_r, zmq.POLLIN)
            with self._lock:
                self._sync_links(ctx, poller, socks)
                self._open = True
            next_beat = time.monotonic() + self.heartbeat_interval_s
            paused = zmq.Poller()  # while the inbox is full: only the wake pipe
            paused.register(self._wake_r, zmq.POLLIN)
            while not self._stopping.is_set():
                with self._lock:  # read last before the poll, for its descriptor to signal
                    unread = any(link.readable for link in self.links.links.values())
                timeout_ms = max(0, int((next_beat - time.monotonic()) * 1000))
                if self.inbox.full():  # backpressure: peers meet their high-water marks
                    events = dict(paused.poll(min(timeout_ms, 10)))
                else:
                    events = dict(poller.poll(0 if unread else min(timeout_ms, POLL_MAX_MS)))
                # The KV sockets are this thread's alone: read outside the lock.
                if kv_in is not None and kv_in in events:
                    self._drain(kv_in, KV_IN, KV_IN_TYPES, routed=True)
                for address, sock in list(kv_out.by_address.items()):
                    if sock in events:
                        self._drain(sock, KV_OUT, KV_OUT_TYPES, peer=address)
                with self._lock:  # (a direct send waits for none of it: see send_control)
                    if self._wake_r in events:
                        # Read, then clear, then flush. Cleared before the read, a put in
                        # between writes a byte this read takes too, leaving the flag set
                        # with the pipe empty: every later put skips its write and waits
                        # for some socket event (or the poll's timeout) to be sent.
                        os.read(self._wake_r, 4096)
                        self._woken = False
                        if self.links.stale():
                            self._sync_links(ctx, poller, socks)
                    self._drain_controls()
                    self._flush(kv_in, kv_out)
                    if time.monotonic() >= next_beat:
                        self.links.broadcast(P.Heartbeat(node_id=self.hello.node_id,
                                                         stats=self.stats))
                        next_beat = time.monotonic() + self.heartbeat_interval_s
                        self.links.check(self.hello, self.heartbeat_interval_s)
                        if self.links.stale():  # a router etcd dropped may have gone silent
                            self._sync_links(ctx, poller, socks)
                        kv_out.close_idle()
            # Tell the routers we are going, if they are still there.
            with self._lock:
                self._open = False
                self.links.broadcast(P.Bye(node_id=self.hello.node_id, reason="shutdown"))
        except BaseException as exc:  # surfaced to the compute loop, which stops the node
            log.exception("node I/O thread failed")
            self.failure = exc
            self.welcomed.set()
        finally:
            with self._lock:
                self._open = False
                for s in socks:
                    s.close()
            ctx.term()
            with self._pipe_lock:
                os.close(self._wake_r)
                os.close(self._wake_w)
                self._wake_w = None

    def _sync_links(self, ctx, poller, socks) -> None:
        """Opens a control socket to each router newly wanted (and says Hello on it);
        closes those of routers gone, ending the requests they gave (nobody waits now)."""
        def open_control(endpoint: str) -> zmq.Socket:
            # The control queue holds what the outbox holds: a step's burst of messages
            # (a thousand requests' tokens, say) sent NOBLOCK must not meet libzmq's
            # default high-water mark of 1,000 and fail requests while the router reads.
            return make_socket(ctx, zmq.DEALER, connect=endpoint,
                               identity=self.peer_identity(), linger_ms=1000,
                               sndhwm=OUTBOX_MAX, max_msg_size=CONTROL_MAX_MSG_BYTES,
                               curve=self.curve.control if self.curve else None)

        for endpoint, abort in self.links.sync(open_control, poller, socks, self.hello,
                                           self.heartbeat_interval_s):
            self._inbox_put(InboxItem(CONTROL, endpoint, abort))

    def _drain_controls(self) -> None:
        """One message from each router with something to read (its events say, whatever
        the poll said), in turn, until none has more or the inbox is full: fair shares."""
        ready = [link for link in self.links.in_turn() if link.readable]
        while ready and not self.inbox.full():
            ready = [link for link in ready if self._drain(link.sock, CONTROL, CONTROL_IN,
                                                           link=link, one=True)]

    def _drain(self, sock, channel, expected, routed=False, peer=None, link=None,
               one=False) -> bool:
        """Reads what ``sock`` holds (one message, with ``one``); True when it may hold
        more."""
        if link is not None:
            peer = link.endpoint
        while True:
            try:
                if routed:
                    peer, msg = recv_routed(sock, expected, flags=zmq.NOBLOCK,
                                            admit=self._kv_budgets.admit)
                else:
                    msg = recv_message(sock, expected, flags=zmq.NOBLOCK)
            except zmq.Again:
                return False
            except Throttled as err:
                if self.dropped is not None:
                    self.dropped("rate_limit")
                if self._throttled_log(err.peer) is not None:
                    log.warning("messages on %s from %r dropped: %s", channel, err.peer, err)
                continue
            except P.ProtocolError as err:
                log.warning("bad message on %s from %r: %s", channel, err.peer or peer, err)
                self._answer_error(sock, channel, err)
                if one:
                    return True
                continue
            if link is not None:
                msg = self._from_router(link, msg)
            if msg is not None:
                self._inbox_put(InboxItem(channel, peer, msg))
            if one or self.inbox.full():
                return True  # the rest waits in the socket (backpressure, or its turn)

    def _from_router(self, link: Link, msg: P.Message) -> P.Message | None:
        """What the compute loop gets of a router's message (None: nothing)."""
        link.last_message = time.monotonic()
        if isinstance(msg, P.Welcome):
            before = link.welcome
            link.welcome = msg
            if self.welcome is None or not self.welcome.accepted:
                self.welcome = msg  # the node's own: the first router's answer
            self.welcomed.set()
            if before is None or (msg.accepted and msg.router_incarnation
                                  and msg.router_incarnation == before.router_incarnation):
                return None  # first welcome, or the same router after a stall: resync
            # Registered anew (the router restarted): the old router's work, which nobody
            # waits for now, is dropped (a decode node's streams are kept for a resume);
            # other routers' goes on.
            log.warning("router %s restarted: its %d requests are gone with it",
                        link.endpoint, len(link.owned))
            return self.links.orphan(link, "router restarted")
        if isinstance(msg, P.Heartbeat):
            return None
        return self.links.took(link, msg)

    def _inbox_put(self, item: InboxItem) -> None:
        """Never blocks the I/O thread: the bound is kept by not reading the sockets while
        the inbox is full, so the few items past it (send failures) are let in."""
        with self.inbox.mutex:
            self.inbox.queue.append(item)
            self.inbox.unfinished_tasks += 1
            self.inbox.not_empty.notify()

    def _answer_error(self, sock, channel, err: P.ProtocolError) -> None:
        try:
            if channel == KV_IN and err.peer is not None:
                send_routed(sock, err.peer, err.to_message())
            elif channel != KV_IN:
                send_message(sock, err.to_message(), flags=zmq.NOBLOCK)
        except SendError:
            pass

    def _flush(self, kv_in, kv_out: KVOut) -> None:
        while True:
            try:
                channel, peer, msg = self._outbox.get_nowait()
            except queue.Empty:
                return
            if channel == CONTROL:
                self._send_control(peer, msg)
                self._flushed += 1
                continue
            try:
                if channel == KV_IN:
                    send_routed(kv_in, peer, msg)
                    continue
                send_message(kv_out.socket(peer), msg, flags=NOBLOCK)
            except zmq.ZMQError as exc:  # e.g. an address that cannot be connected to
                log.warning("cannot connect to %r for %s: %s", peer, type(msg).__name__, exc)
                self._inbox_put(InboxItem(channel, peer, P.Error(
                    req_id=getattr(msg, "req_id", None), code=E.UNREACHABLE,
                    message=f"cannot connect to {peer!r}: {exc}")))
            except (SendError, P.ProtocolError) as exc:
                self._send_failed(channel, peer, msg, exc)

    def _send_control(self, to: str | None, msg: P.Message) -> None:
        """Sends to the routers ``msg`` concerns (or to ``to``), under ``_lock``."""
        routes = self.links.route(msg) if to is None else \
            [(link, msg) for link in [self.links.links.get(to)] if link is not None]
        for link, part in routes:
            try:
                send_message(link.sock, part, flags=NOBLOCK)
            except (SendError, P.ProtocolError) as exc:  # full, gone, or cannot be encoded
                self._send_failed(CONTROL, to, part, exc)

    def _send_failed(self, channel: str, peer, msg: P.Message,
                     exc: SendError | P.ProtocolError) -> None:
        """Never silent: the compute loop learns the send failed and ends the request."""
        log.warning("send on %s to %r failed: %s", channel, peer, exc)
        self._inbox_put(InboxItem(channel, peer, P.Error(
            req_id=getattr(msg, "req_id", None),
            code=E.TIMEOUT if getattr(exc, "reason", None) == "full" else E.INTERNAL,
            message=f"send to {peer or 'router'} failed: {exc}")))
