"""A router's membership on etcd (--discovery): its own record, and the nodes' records.

The record (control, ingress and HTTP endpoints) is what nodes watch to find every
router of the cluster and connect to each. The nodes' records are watched too: a node
whose key left etcd (its lease expired: dead, or cut off from etcd longer than its TTL),
whose incarnation is the one registered here and which has missed a heartbeat is
dropped at once, its requests moved, rather than after ``liveness`` missed heartbeats.
A node that only lost etcd but still heartbeats keeps serving: the heartbeats on the
control socket are the router's liveness, etcd only says who exists (so etcd stopped for
a while, or a node's path to it cut, drops no one).
"""
from __future__ import annotations

import asyncio
import logging
import os
import socket
import time

from pdserve.common import discovery as D

log = logging.getLogger(__name__)

SILENT_BEATS = 2  # heartbeat intervals without a word before a node whose record left is gone


class RouterMembership:
    def __init__(self, config, core, loop: asyncio.AbstractEventLoop):
        self.config, self.core, self.loop = config, core, loop
        self.router_id = f"router-{socket.gethostname()}-{os.getpid()}"
        self.known: dict[str, str] = {}  # node id -> incarnation of its record in etcd
        key = D.prefix(config.cluster, "routers") + self.router_id
        self.registration = D.Registration(config.discovery, key, self.record,
                                           config.discovery_ttl_s)
        self.watch = D.Watch(config.discovery, D.prefix(config.cluster, "nodes"), self._nodes)

    def record(self) -> dict:
        c = self.config
        host = None if c.host in ("0.0.0.0", "::") else c.host
        return {"role": "router", "router_id": self.router_id,
                "incarnation": self.core.control.incarnation,
                "control": D.advertised(c.control, None),
                "ingress": D.advertised(c.ingress, None) if c.ingress else None,
                "http": f"http://{host or socket.gethostname()}:{c.http_port}"}

    def start(self) -> None:
        self.registration.start()
        self.watch.start()

    def stop(self) -> None:
        self.watch.stop()
        self.registration.stop()
        self.registration.join(timeout=2)

    def _nodes(self, records: dict) -> None:  # on the watch's thread
        now = {rec.get("node_id"): rec.get("incarnation", "")
               for rec, _epoch in records.values() if isinstance(rec, dict)}
        gone = {n: inc for n, inc in self.known.items() if n not in now}
        self.known = now
        if gone:
            self.loop.call_soon_threadsafe(self._drop, gone)

    def _drop(self, gone: dict[str, str]) -> None:  # on the router's loop
        control, registry = self.core.control, self.core.registry
        for node_id, incarnation in gone.items():
            node = registry.nodes.get(node_id)
            if node is None or node.hello.incarnation != incarnation:
                continue  # not ours, or registered again since (a newer epoch)
            silent = time.monotonic() - node.last_seen
            if silent < SILENT_BEATS * self.config.heartbeat_interval_s:
                # Alive on its socket (a heartbeat a little late is not silence): only its
                # path to etcd is broken, and it writes its record again once it can.
                log.info("node %s left etcd but still heartbeats (%.1f s ago): kept",
                         node_id, silent)
                continue
            registry.remove(node_id)
            control.apply(self.core.dispatch.node_gone(
                node, f"node {node_id} left etcd (its lease expired)", time.monotonic()))
