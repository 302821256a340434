"""The answers a queue client (client.py) reads, and what it keeps to resume its streams
on another router.

Given a list of routers, a client says who it is by one socket identity on every router
(the ingress keys a producer's requests by it, and so does a decode node that keeps a
stream for a resume), and learns that its router stopped answering from its socket:
ZeroMQ's own heartbeats (ZMTP PING every HEARTBEAT_IVL_S, the connection dropped after
HEARTBEAT_TIMEOUT_S without an answer) and a socket monitor that reports the
connection's end (at once when the router process dies: the kernel closes its TCP
connections; after the heartbeat timeout when its machine or the network went). Not an
answer timeout: a request may be silent for long (queued, a long prompt) while its
router is fine. Then the client connects to the next router and sends, for each request
in flight, a ``resume`` with the token and character counts it holds
(docs/queue-protocol.md); a request it holds nothing of whose resume fails (no router
had got it, or its stream never reached a decode node) is submitted again, as it was.
"""
from __future__ import annotations

import os

import msgspec
import zmq

from pdserve.common.protocol import queue as Q

HEARTBEAT_IVL_S = 1.0
HEARTBEAT_TIMEOUT_S = 3.0
ENDED = zmq.EVENT_DISCONNECTED  # the monitor event that says: this router is gone


class QueueError(Exception):
    """An ``error`` answer: ``code`` (bad_request, duplicate_id, overloaded, ...) and why."""

    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


def event(data: bytes) -> tuple[str | None, Q.Tokens | Q.Done | QueueError | None]:
    """(id, what the answer means); (None, None) for one this client cannot use (another
    type, a malformed one). Keys it does not know are ignored: answers may grow."""
    try:
        msg = Q.ANSWER_DECODER.decode(data)
    except (msgspec.ValidationError, msgspec.DecodeError):
        return None, None
    if isinstance(msg, Q.Error):
        return msg.id, QueueError(msg.code, msg.message)
    return msg.id, msg


def endpoints_of(address: str | list[str] | tuple[str, ...]) -> tuple[list[str], bool]:
    """The routers, and whether to resume on another one (a list given, even of one)."""
    if isinstance(address, str):
        return [address], False
    routers = [a for a in address if a]
    if not routers or not all(isinstance(a, str) for a in routers):
        raise ValueError(f"routers must be a non-empty list of endpoints, got {address!r}")
    return routers, True


def close_sockets(sock: zmq.Socket, monitor: zmq.Socket | None) -> None:
    """A client's socket to a router, and its monitor if it has one."""
    if monitor is not None:
        sock.disable_monitor()
        monitor.close(linger=0)
    sock.close(linger=0)


class Streams:
    """Per request in flight: its submit frame and what of it this client holds."""

    def __init__(self, endpoints: list[str], resumes: bool):
        self.endpoints, self.resumes = endpoints, resumes
        self.turn = 0
        # One identity on every router: a resume is its producer's only by it.
        self.identity = b"pdq-" + os.urandom(12).hex().encode() if resumes else None
        self.submits: dict[str, bytes] = {}
        self.held: dict[str, list[int]] = {}     # id -> [tokens, chars] received
        self.resuming: set[str] = set()          # resumes sent, not answered yet

    @property
    def endpoint(self) -> str:
        return self.endpoints[self.turn]

    def socket_options(self) -> dict:
        """make_socket's options for a connection to the current router."""
        if not self.resumes:
            return {}
        return dict(identity=self.identity, heartbeat_ivl_ms=int(HEARTBEAT_IVL_S * 1000),
                    heartbeat_timeout_ms=int(HEARTBEAT_TIMEOUT_S * 1000))

    def sent(self, rid: str, data: bytes) -> None:
        self.submits[rid] = data
        self.held[rid] = [0, 0]

    def ended(self, rid: str) -> None:
        self.submits.pop(rid, None)
        self.held.pop(rid, None)
        self.resuming.discard(rid)

    def failover(self) -> list[bytes]:
        """The next router, and the frames to send it: a resume per request in flight."""
        self.turn = (self.turn + 1) % len(self.endpoints)
        self.resuming = set(self.submits)
        return [Q.ENCODER.encode(Q.Resume(id=rid, tokens=self.held[rid][0],
                                          chars=self.held[rid][1])) for rid in self.submits]

    def answer(self, rid: str | None, ev) -> tuple[object, bytes | None]:
        """(the event to hand on, or None; a frame to send instead): a resume that failed
        for a request this client holds nothing of is submitted again (its stream never
        reached a decode node, or not in time: whatever ran of it nobody reads); anything
        else counts toward what is held."""
        if rid not in self.held:
            return ev, None
        if rid in self.resuming:
            self.resuming.discard(rid)
            if isinstance(ev, QueueError) and self.held[rid][0] == 0:
                return None, self.submits[rid]
        if isinstance(ev, Q.Tokens):
            self.held[rid][0] += len(ev.token_ids)
            self.held[rid][1] += len(ev.text)
        return ev, None
