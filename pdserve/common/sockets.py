"""The one socket factory: every ZeroMQ socket pdserve makes is configured here.

High-water marks, linger, ROUTER_MANDATORY, size limits and CURVE keys decide whether a
slow or dead peer can stall a process or lose messages silently; getting them right once
beats getting them right in every role. This module knows no message type (and so no
torch): the queue-ingress client starts fast. Sending and receiving protocol messages is
``transport.py``'s.
"""
import dataclasses
import random
import socket
from typing import Iterable, Optional, Union

import zmq
import zmq.asyncio

from pdserve.common.curve_guard import curve_guard

DEFAULT_SNDHWM = 1000  # messages, not bytes; with NOBLOCK a full queue raises SendError
DEFAULT_RCVHWM = 1000
DEFAULT_LINGER_MS = 0  # data sockets drop unsent messages on close; pass more to flush a Bye
COPY_THRESHOLD = 64 * 1024  # pyzmq copies smaller frames anyway; zero-copy pays above this
ZAP_DOMAIN = b"pdserve"
_MAX_HEARTBEAT_TTL_MS = 6_553_599  # ZMQ_HEARTBEAT_TTL limit
# ZMTP PINGs on a ROUTER that holds names (control, KV): without handover a name stays
# with its connection, so a half-open one (a peer's host gone) must be found and closed
# for a restarted node to get its name back.
NAMED_ROUTER_HEARTBEAT_MS = 2000

Endpoints = Union[str, Iterable[str], None]


@dataclasses.dataclass(frozen=True)
class CurveConfig:
    """CurveZMQ keys (Z85 text or 32 raw bytes) for one socket.

    Server: its own keys plus ``allowed_client_keys`` (an empty list refuses every
    client), enforced on ``zap_domain`` by the context's ZAP handler: see
    ``start_zap_authenticator``. Client: its own keys plus ``server_public_key``.
    """

    secret_key: bytes
    public_key: bytes
    server_public_key: Optional[bytes] = None
    allowed_client_keys: frozenset = frozenset()
    zap_domain: bytes = ZAP_DOMAIN  # one allow-list per domain (security.py: one per socket kind)

    @property
    def is_server(self) -> bool:
        return self.server_public_key is None

    @classmethod
    def server(cls, secret_key: bytes, public_key: bytes,
               allowed_client_keys: Iterable[bytes] = (),
               zap_domain: bytes = ZAP_DOMAIN) -> "CurveConfig":
        return cls(secret_key, public_key, None, frozenset(allowed_client_keys), zap_domain)

    @classmethod
    def client(cls, secret_key: bytes, public_key: bytes,
               server_public_key: bytes) -> "CurveConfig":
        return cls(secret_key, public_key, server_public_key)


def start_zap_authenticator(ctx: zmq.Context, curve: CurveConfig):
    """Enforces ``curve.allowed_client_keys`` on ``curve.zap_domain`` for every socket of
    ``ctx``: starts the context's one ZAP handler (curve_guard.CurveGuard) on first use. Must run
    before the server socket binds; make_socket calls it for every CURVE server socket."""
    guard = curve_guard(ctx)
    guard.allow(curve.zap_domain, curve.allowed_client_keys)
    return guard


def _endpoints(value: Endpoints) -> list[str]:
    if value is None:
        return []
    return [value] if isinstance(value, str) else list(value)


def make_socket(
    ctx: Union[zmq.Context, zmq.asyncio.Context],
    kind: int,
    *,
    bind: Endpoints = None,
    connect: Endpoints = None,
    identity: Union[str, bytes, None] = None,
    sndhwm: int = DEFAULT_SNDHWM,
    rcvhwm: int = DEFAULT_RCVHWM,
    linger_ms: int = DEFAULT_LINGER_MS,
    sndtimeo_ms: Optional[int] = None,
    router_mandatory: Optional[bool] = None,
    router_handover: Optional[bool] = None,
    max_msg_size: Optional[int] = None,
    heartbeat_ivl_ms: Optional[int] = None,
    heartbeat_timeout_ms: Optional[int] = None,
    curve: Optional[CurveConfig] = None,
) -> zmq.Socket:
    """Create, configure, then bind/connect a socket; the only way pdserve makes one.

    - ROUTER: ``router_mandatory`` defaults to True (unknown/full peer -> error, not
      a silent drop) and ``router_handover`` to False: an identity stays bound to the
      connection that claimed it first, and another connection claiming it is refused.
      A name is no proof: with handover on, any stranger who says ``prefill-0`` took
      that node's traffic for good. A node that restarts gets its name back once its
      old connection is gone (closed by its process's exit, or by ZMTP heartbeats).
    - ``sndtimeo_ms``: a blocking send gives up (SendError "full") after this long.
    - ``max_msg_size``: ZMQ_MAXMSGSIZE, checked per *frame*; a peer that sends a
      bigger frame is disconnected and the message never arrives.
    - ``heartbeat_ivl_ms``: ZMTP-level PINGs (detect dead TCP peers);
      ``heartbeat_timeout_ms`` and the TTL default to 3 intervals. These are not
      the application Heartbeat messages.
    - Bind to ``tcp://127.0.0.1:*`` and read ``endpoint_of(sock)`` for a free port.
    """
    sock = ctx.socket(kind)
    try:
        sock.setsockopt(zmq.LINGER, linger_ms)
        sock.setsockopt(zmq.SNDHWM, sndhwm)
        sock.setsockopt(zmq.RCVHWM, rcvhwm)
        if sndtimeo_ms is not None:
            sock.setsockopt(zmq.SNDTIMEO, sndtimeo_ms)
        if identity is not None:
            sock.setsockopt(zmq.IDENTITY,
                            identity.encode() if isinstance(identity, str) else identity)
        if kind == zmq.ROUTER:
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1 if router_mandatory in (None, True) else 0)
            sock.setsockopt(zmq.ROUTER_HANDOVER, 1 if router_handover else 0)
        elif router_mandatory or router_handover:
            raise ValueError("router_mandatory/router_handover apply to ROUTER sockets only")
        if max_msg_size is not None:
            sock.setsockopt(zmq.MAXMSGSIZE, max_msg_size)
        if heartbeat_ivl_ms is not None:
            timeout = heartbeat_timeout_ms if heartbeat_timeout_ms is not None \
                else 3 * heartbeat_ivl_ms
            sock.setsockopt(zmq.HEARTBEAT_IVL, heartbeat_ivl_ms)
            sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, timeout)
            sock.setsockopt(zmq.HEARTBEAT_TTL, min(timeout, _MAX_HEARTBEAT_TTL_MS))
        if curve is not None:
            _apply_curve(sock, curve)
        for how, endpoints in (("bind", bind), ("connect", connect)):
            for endpoint in _endpoints(endpoints):
                try:
                    getattr(sock, how)(endpoint)
                except zmq.ZMQError as e:
                    raise zmq.ZMQError(e.errno, f"{how} {endpoint!r}: {e.strerror}") from None
    except BaseException:
        sock.close(linger=0)
        raise
    return sock


def _apply_curve(sock: zmq.Socket, curve: CurveConfig) -> None:
    if not zmq.has("curve"):
        raise RuntimeError("this libzmq was built without CURVE; install pyzmq with libsodium")
    sock.setsockopt(zmq.CURVE_SECRETKEY, curve.secret_key)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, curve.public_key)
    if curve.is_server:
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.ZAP_DOMAIN, curve.zap_domain)
        sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)  # no ZAP handler: refuse, never admit
        guard = start_zap_authenticator(sock.context, curve)
    else:
        sock.setsockopt(zmq.CURVE_SERVERKEY, curve.server_public_key)
        guard = curve_guard(sock.context)
    guard.watch(sock, curve)  # logs this socket's failed handshakes


def endpoint_of(sock: zmq.Socket) -> str:
    """The endpoint the socket last bound or connected (the real port after ``:*``)."""
    return sock.getsockopt(zmq.LAST_ENDPOINT).decode()


class PortPicker:
    """Free TCP ports on ``host``, chosen at random under the kernel's ephemeral range
    (ip_local_port_range) and never twice. A socket bound to port 0, or connecting out,
    never gets such a port, so none is taken between the pick and the bind by whoever
    asked for it. Seen when ports came from that range: 64 forked simulated nodes,
    starting within seconds and opening hundreds of sockets, found 2 of their /metrics
    ports taken; and a node of test_fleet's found its /metrics port, free_port's pick
    then, in use when it bound it."""

    LOW = 20000  # under Linux's default range (32768-60999), above the well-known ports

    def __init__(self, host: str = "127.0.0.1"):
        try:
            with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
                self.high = int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            self.high = 0
        # Its own generator: a caller's random.seed() must not make two processes pick
        # the same ports in the same order.
        self.host, self.taken, self._random = host, set(), random.SystemRandom()

    def __call__(self) -> int:
        for _ in range(1000 if self.high - self.LOW >= 1000 else 0):
            port = self._random.randrange(self.LOW, self.high)
            if port not in self.taken and _bindable(self.host, port):
                self.taken.add(port)
                return port
        with socket.socket() as s:  # no room under the range: the kernel's pick
            s.bind((self.host, 0))
            return s.getsockname()[1]


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
            return True
        except OSError:
            return False


_PICKERS: dict[str, PortPicker] = {}


def port_picker(host: str = "127.0.0.1") -> PortPicker:
    """This process's one PortPicker for ``host``: every caller shares its "never twice"."""
    return _PICKERS.get(host) or _PICKERS.setdefault(host, PortPicker(host))


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now, for endpoints picked at start (launch, benchmarks,
    tests), from this process's PortPicker for ``host``: no outgoing connection can take
    it before it is bound; another process binding that very port still can."""
    return port_picker(host)()
