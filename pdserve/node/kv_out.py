"""The DEALERs a prefill node opens to decode nodes' KV sockets, one per decode node, on
first use; owned by the node's I/O thread (node/io.py). A decode node gone leaves its
socket idle: it is closed after KV_OUT_IDLE_S, and past MAX_KV_OUT open sockets the least
recently used closes."""
from __future__ import annotations

import logging
import time

import zmq

from pdserve.common.security import KV_ACK_MAX_MSG_BYTES
from pdserve.common.transport import make_socket

log = logging.getLogger(__name__)

KV_OUT_IDLE_S = 120.0     # a KV socket to a decode node unused this long is closed
MAX_KV_OUT = 256          # KV sockets open at once; past it, the least recently used closes


class KVOut:
    def __init__(self, ctx: zmq.Context, poller: zmq.Poller, socks: list, identity: bytes,
                 curve=None):
        self.ctx, self.poller, self.socks = ctx, poller, socks  # socks: the node's, to close
        self.identity, self.curve = identity, curve
        self.by_address: dict[str, zmq.Socket] = {}
        self._used: dict[str, float] = {}  # KV address -> last send

    def socket(self, address: str) -> zmq.Socket:
        """The socket to ``address``, opened now if none is (zmq.ZMQError if it cannot be);
        marked used."""
        sock = self.by_address.get(address)
        if sock is None:
            self.close_idle(keep=MAX_KV_OUT - 1)
            sock = make_socket(self.ctx, zmq.DEALER, connect=address, identity=self.identity,
                               max_msg_size=KV_ACK_MAX_MSG_BYTES, curve=self.curve)
            self.by_address[address] = sock
            self.socks.append(sock)
            self.poller.register(sock, zmq.POLLIN)
        self._used[address] = time.monotonic()
        return sock

    def close_idle(self, keep: int = MAX_KV_OUT) -> None:
        """Closes the sockets of decode nodes not sent to for KV_OUT_IDLE_S (gone, most
        likely), and the least recently used past ``keep`` open ones."""
        now = time.monotonic()
        by_age = sorted(self.by_address, key=lambda a: self._used.get(a, 0.0))
        for i, address in enumerate(by_age):
            if now - self._used.get(address, 0.0) > KV_OUT_IDLE_S or len(by_age) - i > keep:
                sock = self.by_address.pop(address)
                self._used.pop(address, None)
                self.poller.unregister(sock)
                self.socks.remove(sock)
                sock.close()
                log.info("closed the idle KV socket to %s", address)
