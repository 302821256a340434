"""A node's links to its routers: one control socket per router, and whose request is whose.

A node serves every router of its cluster (--router A,B or --discovery): each router
says Hello/Welcome and heartbeats with it on a socket of its own, and gives it work. A
message about a request goes back to the router that sent the request (``owner``);
one about the node (Hello, Heartbeat, Drain, Bye) goes to every router. The compute
loop sees one stream of work and never names a router: arbitration between routers is
what it does already (a decode node's Reserve says yes or no from its free blocks,
whoever asks; a prefill node batches what it has).

A router that leaves (or restarts) takes its requests with it, except on a decode node,
whose streams outlive their router (node/streams.py): they become orphans (owner "",
their tokens go nowhere) and the compute loop keeps them for a resume, which moves a
stream to the router that asked (``Resumed``; a router that then does not want it hands
it back, ``Release``). A router may abort only its own requests.

Used under the node's I/O lock (node/io.py), by its I/O thread or by a send from the
compute thread, except ``set_wanted``, which any thread may call (the etcd watch does): it
replaces the wanted list whole and wakes the I/O thread.
"""
from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import zmq

from pdserve.common import errors as E
from pdserve.common import protocol as P
from pdserve.common.transport import EVENTS, POLLIN, SendError, send_message

log = logging.getLogger(__name__)

MAX_OWNED = 200_000  # requests whose router is remembered; past it the oldest are forgotten
ITEMS = (P.FirstTokens, P.ReserveReply, P.TokenBatch)  # one message, many requests
ORPHAN = ""  # the owner of a stream whose router is gone: what is about it goes nowhere


@dataclass(frozen=True)
class Orphaned:
    """I/O thread -> a decode node's compute loop: nobody reads these streams now (their
    router left or restarted); keep them for a resume, within the bound."""
    req_ids: list[str]
    reason: str


@dataclass
class Link:
    endpoint: str
    sock: zmq.Socket
    welcome: P.Welcome | None = None
    last_message: float = 0.0   # anything heard from the router
    next_hello: float = 0.0     # a silent router is said Hello again once per window
    owned: set = field(default_factory=set)

    @property
    def fd(self) -> int:
        return self.sock.getsockopt(zmq.FD)

    @property
    def readable(self) -> bool:
        """Whether the router's socket holds a message. ZeroMQ's descriptor signals an
        arrival only once this (or a receive) found the socket empty, and any operation on
        the socket may take that signal: read it last before waiting on the descriptor."""
        return bool(self.sock.getsockopt(EVENTS) & POLLIN)


class RouterLinks:
    def __init__(self, wanted: list[str], keeps_streams: bool = False):
        self.keeps_streams = keeps_streams  # a decode node's: orphaned, not aborted
        self.wanted: tuple[str, ...] = tuple(wanted)
        self.links: dict[str, Link] = {}
        self.by_sock: dict[zmq.Socket, Link] = {}
        self.owner: OrderedDict[str, str] = OrderedDict()  # req_id -> router endpoint
        self._turn = 0  # round-robin start between routers' sockets

    def set_wanted(self, endpoints: list[str]) -> None:
        self.wanted = tuple(sorted(set(endpoints)))

    def stale(self) -> bool:
        return set(self.wanted) != set(self.links)

    # -- the set of sockets ------------------------------------------------------------------
    def added(self) -> list[str]:
        return [e for e in self.wanted if e not in self.links]

    def open(self, endpoint: str, sock: zmq.Socket, now: float) -> Link:
        link = Link(endpoint, sock, last_message=now)
        self.links[endpoint] = link
        self.by_sock[sock] = link
        log.info("connected to router %s", endpoint)
        return link

    def removed(self, interval_s: float) -> list[Link]:
        """Links to routers no longer wanted and silent past their liveness window, taken
        out; the caller closes their sockets and ends the requests they owned (nobody
        waits for them now). A router whose record left etcd but which still talks to
        this node keeps its link: etcd says who exists, the heartbeats on the socket say
        who is alive, and etcd stalled past the leases' TTL (whose records then vanish
        until re-registered) must not cut a node off from routers that serve."""
        now = time.monotonic()
        gone = [link for e, link in self.links.items() if e not in self.wanted and (
            link.welcome is None or now - link.last_message > link.welcome.liveness * interval_s)]
        for link in gone:
            del self.links[link.endpoint]
            del self.by_sock[link.sock]
            log.info("router %s left the cluster: %d of its requests %s", link.endpoint,
                     len(link.owned), "are orphans" if self.keeps_streams else "end")
        return gone

    def in_turn(self) -> list[Link]:
        """Every link, starting one further each call: reading sockets in this order, one
        message from each in turn, no router's backlog starves another's (prefill fairness)."""
        links = list(self.links.values())
        if not links:
            return links
        self._turn = (self._turn + 1) % len(links)
        return links[self._turn:] + links[:self._turn]

    def sync(self, open_control, poller, socks, hello: P.Hello,
             interval_s: float) -> list[tuple[str, P.Abort]]:
        """Closes the sockets of routers no longer wanted and opens (and says Hello on) one
        to each router newly wanted. What the compute loop is told of the requests the
        routers gone gave (``orphan``): nobody waits for them now."""
        aborts = []
        for link in self.removed(interval_s):
            told = self.orphan(link, "its router left the cluster")
            if told is not None:
                aborts.append((link.endpoint, told))
            poller.unregister(link.fd)
            socks.remove(link.sock)
            link.sock.close(linger=0)
        for endpoint in self.added():
            sock = open_control(endpoint)
            socks.append(sock)
            link = self.open(endpoint, sock, time.monotonic())
            poller.register(link.fd, zmq.POLLIN)  # its descriptor: see node/io.py
            self.send(link, hello)
        return aborts

    def send(self, link: Link, msg: P.Message) -> None:
        try:
            send_message(link.sock, msg, flags=zmq.NOBLOCK)
        except SendError as exc:
            log.warning("%s to router %s not sent: %s", type(msg).__name__, link.endpoint, exc)

    def broadcast(self, msg: P.Message) -> None:
        for link in self.links.values():
            self.send(link, msg)

    def check(self, hello: P.Hello, interval_s: float) -> None:
        """A router silent for ``liveness`` intervals is gone (or restarted): say Hello
        again, once per such window, so a restarted router gets this node back by itself."""
        now = time.monotonic()
        for link in self.links.values():
            if link.welcome is None:
                continue
            silent, window = now - link.last_message, link.welcome.liveness * interval_s
            if silent > window and now >= link.next_hello:
                log.warning("router %s silent for %.1f s; saying hello again", link.endpoint,
                            silent)
                link.next_hello = now + window
                self.send(link, hello)

    # -- whose request -------------------------------------------------------------------------
    def orphan(self, link: Link, reason: str) -> P.Abort | Orphaned | None:
        """The router of ``link`` is gone (left, or restarted): what the compute loop is
        told of the requests it gave (None: it gave none). A decode node keeps them as
        orphans; every other role drops them."""
        owned, link.owned = sorted(link.owned), set()
        for req_id in owned:
            if self.keeps_streams:
                self.owner[req_id] = ORPHAN
            else:
                self.owner.pop(req_id, None)
        if not owned:
            return None
        return Orphaned(owned, reason) if self.keeps_streams else P.Abort(req_ids=owned,
                                                                          reason=reason)

    def took(self, link: Link, msg: P.Message) -> P.Message | None:
        """Records the requests a router's message gives this node; what the compute loop
        gets of it (an Abort keeps only the requests that router gave: another router may
        have taken a stream over, and an orphan is nobody's to end)."""
        if isinstance(msg, P.PrefillBatch):
            ids = [r.req_id for r in msg.requests]
        elif isinstance(msg, P.Reserve):
            ids = [r.req_id for r in msg.items]
        elif isinstance(msg, P.Resume):  # the answer goes to the router that asked
            self.owner[msg.req_id] = link.endpoint
            return msg
        elif isinstance(msg, P.Release):  # handed over, not wanted: nobody's again
            mine = [r for r in msg.req_ids if self.owner.get(r) == link.endpoint]
            for req_id in mine:
                link.owned.discard(req_id)
                self.owner[req_id] = ORPHAN
            return P.Release(req_ids=mine, reason=msg.reason) if mine else None
        elif isinstance(msg, P.Abort):
            mine = [r for r in msg.req_ids if self.owner.get(r, link.endpoint) == link.endpoint]
            for req_id in mine:
                self._forget(req_id)
            if len(mine) == len(msg.req_ids):
                return msg
            log.info("router %s aborted %d requests it does not own: ignored", link.endpoint,
                     len(msg.req_ids) - len(mine))
            return P.Abort(req_ids=mine, reason=msg.reason) if mine else None
        else:
            return msg
        for req_id in ids:
            self._forget(req_id)  # an id a router reuses moves to the end
            self.owner[req_id] = link.endpoint
            link.owned.add(req_id)
        while len(self.owner) > MAX_OWNED:
            self._forget(next(iter(self.owner)))
        return msg

    def owned_by(self, endpoint: str) -> list[str]:
        link = self.links.get(endpoint)
        return list(link.owned) if link else []

    def _forget(self, req_id: str) -> None:
        endpoint = self.owner.pop(req_id, None)
        link = self.links.get(endpoint) if endpoint else None
        if link is not None:
            link.owned.discard(req_id)

    def route(self, msg: P.Message) -> list[tuple[Link, P.Message]]:
        """Where a message from the compute loop goes: about requests, to their routers
        (a batch split by router); about the node, to every router."""
        if isinstance(msg, P.Resumed):
            return self._resumed(msg)
        if isinstance(msg, ITEMS):
            parts: dict[str, list] = {}
            for item in msg.items:
                parts.setdefault(self._owner_of(item.req_id), []).append(item)
                if getattr(item, "finish_reason", None) is not None and \
                        isinstance(msg, P.TokenBatch):
                    self._forget(item.req_id)
            return [(self.links[e], type(msg)(items=items)) for e, items in parts.items()
                    if e in self.links]
        req_id = getattr(msg, "req_id", None)
        if isinstance(msg, P.Error) and req_id is not None:
            endpoint = self._owner_of(req_id)
            return [(self.links[endpoint], msg)] if endpoint in self.links else []
        return [(link, msg) for link in self.links.values()]

    def _resumed(self, msg: P.Resumed) -> list[tuple[Link, P.Message]]:
        """A Resume's answer goes to the router that asked; a stream handed over is that
        router's from here on: every message about it queued after this one goes there
        (messages are routed in the order they leave), every one before went to its old
        owner.
        An old owner still linked (the producer resumed while its router still served the
        stream) is told it moved, after the last of its tokens, so that it ends its
        request now rather than at its deadline."""
        link = self.links.get(self.owner.pop(msg.req_id, None) or ORPHAN)
        if link is None:
            return []
        out: list[tuple[Link, P.Message]] = [(link, msg)]
        if msg.ok:
            old = self.links.get(self.owner.get(msg.wire_id) or ORPHAN)
            if old is not None and old is not link:
                out.append((old, P.Error(req_id=msg.wire_id, code=E.STREAM_MOVED,
                                         message="a resume on another router took the "
                                                 "stream over")))
            self._forget(msg.wire_id)
            self.owner[msg.wire_id] = link.endpoint
            link.owned.add(msg.wire_id)
        return out

    def _owner_of(self, req_id: str) -> str:
        """The router that gave this request; one we forgot (or never knew): the first."""
        endpoint = self.owner.get(req_id)
        if endpoint is None and self.links:
            return next(iter(self.links))
        return endpoint or ""
