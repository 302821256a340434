"""The ZAP handler and handshake watcher of a ZeroMQ context (one per context).

sockets.py registers every CURVE socket here; security.py reads keys and allow-lists.
Neither imports the other through this module: it imports no pdserve module but logs.
"""
from __future__ import annotations

import logging
import queue
import struct
import threading
import weakref
from typing import Optional

import zmq
from zmq.auth.base import Authenticator
from zmq.utils import z85

from pdserve.common.logs import LogThrottle

log = logging.getLogger(__name__)

CONTROL_DOMAIN, INGRESS_DOMAIN, KV_DOMAIN = b"pdserve/control", b"pdserve/ingress", b"pdserve/kv"
_SOCKET_NAMES = {CONTROL_DOMAIN: "control", INGRESS_DOMAIN: "ingress", KV_DOMAIN: "KV"}


def _z85(key: bytes) -> str:
    return (key if len(key) == 40 else z85.encode(key)).decode()


_FAILED = {zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "no detail",
           zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "protocol", zmq.EVENT_HANDSHAKE_FAILED_AUTH: "auth"}
_WHY = {zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
        "security mechanism mismatch: one side has no CURVE keys",
        zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC:
        "cryptographic error: wrong server public key or corrupt keys",
        zmq.PROTOCOL_ERROR_ZMTP_KEY_EXCHANGE: "key exchange failed"}


_WATCHED_EVENTS = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                   | zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_MONITOR_STOPPED)


class CurveGuard(threading.Thread):
    """Per context: answers ZAP requests of its CURVE servers from per-domain allow-lists
    (pyzmq's Authenticator speaks the protocol) and logs failed CURVE handshakes of every
    watched socket. Exits when its context is terminated."""

    def __init__(self, ctx: zmq.Context):
        super().__init__(name="pdserve-curve-guard", daemon=True)
        self.ctx = ctx
        self._allowed: dict[str, frozenset] = {}   # z85 keys by domain
        self._auth: Optional[Authenticator] = None
        self._peer = "?"
        self._new: queue.Queue = queue.Queue()   # sockets handed over to this thread
        self._lock = threading.Lock()
        self._throttle = LogThrottle()

    def allow(self, domain: bytes, keys) -> None:
        """Serve ZAP for ``domain`` (replacing its list); call before the server socket binds."""
        with self._lock:
            self._allowed[domain.decode()] = frozenset(_z85(k).encode() for k in keys)
            if self._auth is None:  # bound now: a handshake must never find it missing
                self._auth = Authenticator(self.ctx, log=logging.getLogger("zmq.auth"))
                self._auth.start()
                self._new.put((self._auth.zap_socket, None))
            self._auth.configure_curve_callback(domain.decode(), self)

    def watch(self, sock: zmq.Socket, curve) -> None:
        """Log this socket's failed handshakes; call from the socket's own thread."""
        what = f"{_SOCKET_NAMES.get(curve.zap_domain, curve.zap_domain.decode())} socket" \
            if curve.is_server else f"client socket (public key {_z85(curve.public_key)})"
        addr = f"inproc://pdserve-monitor-{id(self)}-{id(sock)}"
        sock.monitor(addr, _WATCHED_EVENTS)
        mon = zmq.Socket(self.ctx, zmq.PAIR)
        mon.linger = 0
        mon.connect(addr)
        self._new.put((mon, (what, curve.is_server)))

    # -- pyzmq's Authenticator calls this for every CURVE client of a domain
    def callback(self, domain: str, client_key: bytes) -> bool:
        ok = client_key in self._allowed.get(domain, ())
        name = _SOCKET_NAMES.get(domain.encode(), domain)
        if ok:
            log.debug("CURVE: client %s (key %s) admitted on the %s socket", self._peer,
                      client_key.decode(), name)
        elif (n := self._throttle(("zap", domain, client_key))) is not None:
            log.warning("CURVE: refused client %s on the %s socket: public key %s is not on "
                        "its allow-list%s", self._peer, name, client_key.decode(),
                        f" ({n} more refusals)" if n else "")
        return ok

    def run(self) -> None:
        poller, handlers = zmq.Poller(), {}
        try:
            while True:
                if not handlers and not self._take(poller, handlers):
                    if self.ctx.closed:
                        return
                    continue
                while not self._new.empty():
                    self._take(poller, handlers, block=False)
                for sock, _ in poller.poll(100):
                    if handlers[sock] is None:
                        self._zap(sock.recv_multipart())
                    elif self._event(sock.recv_multipart(), handlers[sock]):
                        poller.unregister(sock)
                        del handlers[sock]
                        sock.close()
        except zmq.ContextTerminated:
            pass
        except Exception:  # never take the process down; new handshakes then fail closed
            log.exception("CURVE guard failed")
        finally:  # every socket closed, or terminating the context would hang
            while not self._new.empty():
                handlers[self._new.get()[0]] = None
            for sock in handlers:
                sock.close(linger=0)

    def _take(self, poller: zmq.Poller, handlers: dict, block: bool = True) -> bool:
        """Registers one handed-over socket. With nothing to poll, waits for one on the queue:
        zmq_poll over no sockets returns at once, and a loop around it would spin, holding the
        GIL against every other thread of the process."""
        try:
            sock, what = self._new.get(timeout=0.1) if block else self._new.get_nowait()
        except queue.Empty:
            return False
        poller.register(sock, zmq.POLLIN)
        handlers[sock] = what
        return True

    def _zap(self, msg: list) -> None:
        self._peer = msg[3].decode(errors="replace") if len(msg) > 3 else "?"
        coro = self._auth.handle_zap_message(msg)
        try:  # it never suspends: our callback answers at once
            coro.send(None)
        except StopIteration:
            pass
        finally:
            coro.close()

    def _event(self, frames: list, watched: tuple) -> bool:
        """Logs a failed handshake; True when the watched socket is gone."""
        if len(frames) != 2 or len(frames[0]) != 6:
            return False
        (what, is_server), (event, value) = watched, struct.unpack("=hi", frames[0])
        if event == zmq.EVENT_MONITOR_STOPPED:
            return True
        if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            if is_server:
                return False  # the ZAP callback has logged it, naming the key
            why = f"the server refused this key (ZAP status {value}): not on its allow-list"
        elif event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL and not is_server:
            why = "the server dropped the handshake: a wrong server public key?"
        else:
            why = _WHY.get(value, f"{_FAILED.get(event, event)} error {value}")
        endpoint = frames[1].decode(errors="replace")
        if (n := self._throttle(("hs", what, endpoint, why))) is not None:
            log.warning("CURVE handshake failed on the %s %s: %s%s", what, endpoint, why,
                        f" ({n} more)" if n else "")
        return False


_GUARDS: "weakref.WeakKeyDictionary[zmq.Context, CurveGuard]" = weakref.WeakKeyDictionary()
_GUARDS_LOCK = threading.Lock()


def curve_guard(ctx: zmq.Context) -> CurveGuard:
    """The context's one guard, started on first use (libzmq takes one ZAP handler per
    context, so this registry mirrors state libzmq already keeps per context)."""
    with _GUARDS_LOCK:
        guard = _GUARDS.get(ctx)
        if guard is None or not guard.is_alive():
            guard = _GUARDS[ctx] = CurveGuard(ctx)
            guard.start()
        return guard
