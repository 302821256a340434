"""A node's membership on etcd (--discovery): which routers to serve, and its own record.

The routers come from a watch of the cluster's routers prefix: each change replaces the
I/O thread's wanted set (a socket opened to each new router, closed to each gone). The
record is written once the node has a KV address (after its first Welcome), under a key
bound to a lease its own thread keeps alive; its create revision is the node's epoch.
None of this runs on the compute loop or the I/O thread (common/discovery.py).
"""
from __future__ import annotations

import logging

from pdserve.common import discovery as D

log = logging.getLogger(__name__)


class Membership:
    def __init__(self, node):
        self.node = node
        config = node.config
        self.url, self.cluster = config.discovery, config.cluster
        self.watch = D.Watch(self.url, D.prefix(self.cluster, "routers"), self._routers)
        self.watch.start()
        self.registration: D.Registration | None = None

    def _routers(self, records: dict) -> None:
        endpoints = [rec["control"] for rec, _epoch in records.values()
                     if isinstance(rec, dict) and isinstance(rec.get("control"), str)]
        log.info("routers of cluster %s in etcd: %s", self.cluster, endpoints or "none")
        self.node.io.set_routers(endpoints)

    def record(self) -> dict:
        node, hello = self.node, self.node.io.hello
        kv_events = node.kv_events
        return {"role": node.role, "node_id": node.node_id, "incarnation": hello.incarnation,
                "model": {"name": hello.model.name, "config_hash": hello.model.config_hash},
                "kv_layout": {"num_layers": hello.kv_layout.num_layers,
                              "num_kv_heads": hello.kv_layout.num_kv_heads,
                              "head_dim": hello.kv_layout.head_dim,
                              "dtype": hello.kv_layout.dtype,
                              "block_size": hello.kv_layout.block_size},
                "kv_address": hello.kv_address,
                "kv_events": D.advertised(kv_events.endpoint, node.config.advertise_host)
                if kv_events is not None else None,
                "capacity": {"num_total_blocks": node.io.stats.num_total_blocks},
                "host_id": hello.host_id, "pid": hello.pid}

    def register(self) -> None:
        key = D.prefix(self.cluster, "nodes") + self.node.node_id
        self.registration = D.Registration(self.url, key, self.record,
                                           self.node.config.discovery_ttl_s)
        self.registration.start()

    def stop(self) -> None:
        self.watch.stop()
        if self.registration is not None:
            self.registration.stop()
            self.registration.join(timeout=2)
