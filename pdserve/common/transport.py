"""Sending and receiving protocol.py's messages on sockets made by sockets.py.

Why one place: the zero-copy rules and routed-send errors decide whether a slow or
dead peer can stall a node or lose messages silently; getting them right once beats
getting them right in every role.

Rules the helpers enforce:
- A ROUTER never drops a message silently: ROUTER_MANDATORY is on, and a send to
  an unknown or full peer raises ``SendError`` (routed sends default to NOBLOCK,
  so one slow peer cannot stall the sender's loop).
- Frames of ``copy_threshold`` bytes or more go out with ``copy=False``: pyzmq
  holds a reference to the buffer (and so to the tensor) until ZeroMQ is done.
  The tensor's *memory* must not be reused before then; pass ``track=True`` and
  wait for ``tracker.done`` when it will be.
- Receives use ``copy=False`` so tensors are rebuilt over the received frames.
- Malformed input raises ``ProtocolError``; on a ROUTER its ``peer`` is set so
  the caller can answer with ``err.to_message()``.

Sockets belong to one thread (or one asyncio loop); never share them.
"""
import asyncio
import errno
import logging
from typing import Callable, Optional

import zmq
import zmq.asyncio

from pdserve.common.codec import decode, encode
from pdserve.common.protocol import Message, ProtocolError
from pdserve.common.sockets import (  # noqa: F401 (transport's API since the start)
    COPY_THRESHOLD,
    DEFAULT_LINGER_MS,
    DEFAULT_RCVHWM,
    DEFAULT_SNDHWM,
    NAMED_ROUTER_HEARTBEAT_MS,
    ZAP_DOMAIN,
    CurveConfig,
    Endpoints,
    endpoint_of,
    make_socket,
    start_zap_authenticator,
)

log = logging.getLogger(__name__)


class SendError(Exception):
    """A message that could not be queued: ``reason`` is "unreachable" or "full"."""

    def __init__(self, peer: Optional[bytes], reason: str, detail: str = ""):
        super().__init__(f"cannot send to {peer!r}: {reason}" + (f" ({detail})" if detail else ""))
        self.peer = peer
        self.reason = reason


class Throttled(Exception):
    """A routed message dropped unread: its peer is over its budget (rate_limit.py)."""

    def __init__(self, peer: bytes):
        super().__init__(f"peer {peer!r} is over its message budget")
        self.peer = peer


# ---------------------------------------------------------------- send

def _frames(msg: Message, copy_threshold: int, track: bool):
    """zmq Frames for msg: big ones share the tensor memory; and their tracker."""
    frames, tracked = [], []
    for buf in encode(msg):
        big = memoryview(buf).nbytes >= copy_threshold
        frame = zmq.Frame(buf, copy=not big, track=track and big)
        frames.append(frame)
        if track and big:
            tracked.append(frame)
    return frames, (zmq.MessageTracker(*tracked) if track else None)


def _send_error(peer: Optional[bytes], e: zmq.ZMQError) -> Exception:
    if e.errno == errno.EHOSTUNREACH:
        return SendError(peer, "unreachable", "no connected peer with this identity")
    if e.errno == errno.EAGAIN:
        return SendError(peer, "full", "high-water mark reached, or no peer connected")
    return e


def send_message(sock: zmq.Socket, msg: Message, *, flags: int = 0,
                 copy_threshold: int = COPY_THRESHOLD,
                 track: bool = False) -> Optional[zmq.MessageTracker]:
    """Send on a DEALER-like socket; with track=True, the tracker of the zero-copy frames."""
    frames, tracker = _frames(msg, copy_threshold, track)
    try:
        sock.send_multipart(frames, flags=flags, copy=False)
    except zmq.ZMQError as e:
        raise _send_error(None, e) from None
    return tracker


def send_routed(sock: zmq.Socket, peer: bytes, msg: Message, *, flags: int = zmq.NOBLOCK,
                copy_threshold: int = COPY_THRESHOLD,
                track: bool = False) -> Optional[zmq.MessageTracker]:
    """Send to one peer of a ROUTER; SendError if it is unknown or full (never silent)."""
    frames, tracker = _frames(msg, copy_threshold, track)
    try:
        sock.send_multipart([peer, *frames], flags=flags, copy=False)
    except zmq.ZMQError as e:
        raise _send_error(peer, e) from None
    return tracker


async def async_send_message(sock: zmq.asyncio.Socket, msg: Message, *, flags: int = 0,
                             copy_threshold: int = COPY_THRESHOLD,
                             track: bool = False) -> Optional[zmq.MessageTracker]:
    """Twin of send_message for zmq.asyncio sockets."""
    frames, tracker = _frames(msg, copy_threshold, track)
    try:
        await sock.send_multipart(frames, flags=flags, copy=False)
    except zmq.ZMQError as e:
        raise _send_error(None, e) from None
    return tracker


async def async_send_routed(sock: zmq.asyncio.Socket, peer: bytes, msg: Message, *,
                            flags: int = zmq.NOBLOCK, copy_threshold: int = COPY_THRESHOLD,
                            track: bool = False) -> Optional[zmq.MessageTracker]:
    """Twin of send_routed for zmq.asyncio sockets."""
    frames, tracker = _frames(msg, copy_threshold, track)
    try:
        await sock.send_multipart([peer, *frames], flags=flags, copy=False)
    except zmq.ZMQError as e:
        raise _send_error(peer, e) from None
    return tracker


# ---------------------------------------------------------------- receive

def split_routed(frames: list, expected: Optional[tuple],
                  admit: Optional[Callable[[bytes], bool]] = None) -> tuple[bytes, Message]:
    peer = frames[0].bytes
    if admit is not None and not admit(peer):
        raise Throttled(peer)
    try:
        return peer, decode(frames[1:], expected)
    except ProtocolError as e:
        e.peer = peer
        raise


def recv_message(sock: zmq.Socket, expected: Optional[tuple] = None, *,
                 flags: int = 0) -> Message:
    """Receive one message (zero-copy tensors). ProtocolError if malformed or unexpected."""
    return decode(sock.recv_multipart(flags, copy=False), expected)


def recv_routed(sock: zmq.Socket, expected: Optional[tuple] = None, *, flags: int = 0,
                admit: Optional[Callable[[bytes], bool]] = None) -> tuple[bytes, Message]:
    """(peer identity, message) from a ROUTER; a ProtocolError carries ``.peer``.
    ``admit(peer)`` False: Throttled, raised before the message is decoded."""
    return split_routed(sock.recv_multipart(flags, copy=False), expected, admit)


async def async_recv_message(sock: zmq.asyncio.Socket, expected: Optional[tuple] = None, *,
                             flags: int = 0) -> Message:
    """Twin of recv_message for zmq.asyncio sockets."""
    return decode(await sock.recv_multipart(flags, copy=False), expected)


async def async_recv_routed(sock: zmq.asyncio.Socket, expected: Optional[tuple] = None, *,
                            flags: int = 0, admit: Optional[Callable[[bytes], bool]] = None,
                            ) -> tuple[bytes, Message]:
    """Twin of recv_routed for zmq.asyncio sockets."""
    return split_routed(await sock.recv_multipart(flags, copy=False), expected, admit)


# ---------------------------------------------------------------- asyncio without futures

# Plain ints of the constants a per-message path passes: pyzmq's enum members cost an
# object (a Flag operation) each time they are tested or combined.
EVENTS, POLLIN, NOBLOCK = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.NOBLOCK)
DRAIN_MAX = 256  # messages received without an await before the event loop gets a turn


class PlainTwin:
    """NOBLOCK sends and drained receives of a socket on the asyncio loop, without pyzmq's
    Futures.

    Every operation of a zmq.asyncio socket goes through a Future and pyzmq's event
    bookkeeping: ~50 us per small message received on the 2-core dev machine, against
    ~13 us on a plain socket over the same handle (a /tmp test of 50,000 messages under
    uvloop). The twin reads the socket's descriptor with a reader of its own and receives
    by plain non-blocking calls. Give it a plain socket: the first operation of an asyncio
    socket would have pyzmq watch the same descriptor in place of ``received``.

    The catch is ZeroMQ's edge-triggered notification: the descriptor signals a change,
    and any operation on the socket (a send too) may take the signal of a message that
    arrives meanwhile. So a drain ends only when the socket's events say nothing is
    queued, read after the last receive; and after plain sends ``rearm`` has the receiver
    read them again."""

    def __init__(self, sock: zmq.Socket):
        self.plain = zmq.Socket.shadow(sock.underlying)
        self._fd = self.plain.getsockopt(zmq.FD)
        self._waiter: asyncio.Future | None = None  # the receiver, waiting for a signal
        self._loop: asyncio.AbstractEventLoop | None = None  # whose reader watches the fd

    def send_routed(self, peer: bytes, msg: Message) -> None:
        """A NOBLOCK send to one peer; SendError at once if it is unknown or full (never a
        silent drop). Call ``rearm`` after the turn's sends."""
        send_routed(self.plain, peer, msg)

    def rearm(self) -> None:
        """After plain sends: the receiver reads the socket's events again."""
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def close(self) -> None:
        """Stops watching the descriptor; call it before the socket closes."""
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._fd)
        self._loop = None

    async def received(self, *, copy: bool = True, limit: int = DRAIN_MAX):
        """Every multipart message, as it comes: what is queued, by plain non-blocking
        receives, then a wait for the descriptor's signal (or ``rearm``). After ``limit``
        messages in a row the event loop gets a turn. One receiver at a time; a receive
        error (the socket closed, its context terminated) ends it."""
        loop = asyncio.get_running_loop()
        if self._loop is not loop:  # watched until close(), whatever receiver reads
            loop.add_reader(self._fd, self._wake)
            self._loop = loop
        sock = self.plain
        events, pollin, noblock = EVENTS, POLLIN, NOBLOCK
        while True:
            for _ in range(limit):
                if not sock.getsockopt(events) & pollin:
                    break
                yield sock.recv_multipart(noblock, copy=copy)
            else:
                # Under a flood this loop would never yield: the clock (heartbeats,
                # deadlines) and HTTP would starve.
                await asyncio.sleep(0)
                continue
            self._waiter = loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
