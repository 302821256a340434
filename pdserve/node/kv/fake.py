"""An in-process KV wire, for node tests without sockets.

Nodes of one process are joined by a ``FakeLink``: a prefill node's ``FakeSender``
posts its chunks to it, a decode node replies through ``link.reply(address)``, and
``deliver`` hands each message to the node it is for, as the node's I/O thread
would (an ``InboxItem`` on the channel it would have come in on, the sender named
by its socket identity). Every message is encoded and decoded on the way, so the
receiving node sees exactly what its socket would have given it, and a
``tamper`` function can do to the frames what a faulty or hostile peer does.
"""
from __future__ import annotations

import logging
from collections import deque
from typing import Callable

from pdserve.common import codec
from pdserve.common import protocol as P
from pdserve.node.io import KV_IN, KV_OUT, InboxItem
from pdserve.node.kv.receiver import Reply
from pdserve.node.kv.tcp import TcpSender

log = logging.getLogger(__name__)

Frames = list[bytes]


class FakeSender(TcpSender):
    """Tensor frames, as over TCP, posted to a FakeLink; reaches every node on the link."""
    path = "fake"

    def describe(self, req: P.PrefillRequest) -> str:
        return "in process (a fake link)"


class FakeLink:
    def __init__(self, tamper: Callable[[P.Message, Frames], Frames] | None = None):
        self.tamper = tamper
        self.num_dropped = 0  # messages for nobody on the link (a socket would drop them too)
        self._posted: deque[tuple[str, str, object, Frames]] = deque()
        self._nodes: dict[str, Callable[[InboxItem], None]] = {}

    def connect(self, name: str, handle: Callable[[InboxItem], None]) -> None:
        """``handle`` takes what is for ``name``: a decode node's KV address, or a prefill
        node's id (the identity its KV socket has)."""
        self._nodes[name] = handle

    def sender(self, node_id: str, checksums: bool = True) -> FakeSender:
        """A prefill node's sender onto this link."""
        def post(address: str, chunk: P.KVChunk) -> None:
            self._post(address, KV_IN, node_id.encode(), chunk)
        return FakeSender(post, checksums)

    def reply(self, address: str) -> Reply:
        """How the decode node at ``address`` answers a sender."""
        def reply(peer: bytes, msg: P.Message) -> None:
            self._post(peer.decode(), KV_OUT, address, msg)
        return reply

    def _post(self, to: str, channel: str, peer, msg: P.Message) -> None:
        frames = [bytes(f) for f in codec.encode(msg)]  # the bytes as sent, copied now
        if self.tamper is not None:
            frames = self.tamper(msg, frames)
        self._posted.append((to, channel, peer, frames))

    def deliver(self) -> int:
        """Hands every message posted so far to its node; returns how many went."""
        done = 0
        for _ in range(len(self._posted)):
            to, channel, peer, frames = self._posted.popleft()
            handle = self._nodes.get(to)
            if handle is None:
                self.num_dropped += 1
                continue
            expected = (P.KVChunk,) if channel == KV_IN else (P.KVAck, P.Error)
            try:
                msg = codec.decode(frames, expected)
            except P.ProtocolError as err:  # what the node's I/O thread answers with
                log.warning("bad message on the fake link for %s: %s", to, err)
                if channel == KV_IN:
                    self._post(peer.decode(), KV_OUT, to, err.to_message())
                continue
            handle(InboxItem(channel, peer, msg))
            done += 1
        return done
