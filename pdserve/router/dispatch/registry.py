"""Which nodes are in the cluster, whether they fit together, and whether they are alive.

Pure Python (no sockets): the router's control loop feeds it hellos, heartbeats
and the clock, and acts on what it answers. Members only, as smg's worker registry: what
the router placed on a node is the dispatch's (placement.py), and whoever keeps state per
node (a policy's prefix index) subscribes to the registry's events and drops it on
``removed``::

    registry.subscribe(lambda event, node: ...)   # REGISTERED, REMOVED, DRAINING
"""
from __future__ import annotations

import ipaddress
import re
import time
from dataclasses import dataclass
from typing import Callable

from pdserve.common import protocol as P
from pdserve.common.config import HELD_WEIGHTS, ROLES

LIVE, DRAINING = "live", "draining"
REGISTERED, REMOVED = "registered", "removed"   # events (and DRAINING: a status change)
MAX_NODES = 1024   # registered at once: a peer cycling through identities cannot grow it
_HOSTNAME = re.compile(r"^(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9-]{0,62})(\.[A-Za-z0-9-]{1,63})*$")


def kv_address_problem(address: str | None) -> str | None:
    """Why a decode node's announced KV address cannot be connected to, or None.
    Accepted: ``tcp://HOST:PORT`` (a host name, IPv4 or [IPv6]; port 1..65535)."""
    if not address:
        return "a decode node must announce its kv_address"
    m = re.fullmatch(r"tcp://(\[[0-9A-Fa-f:.]+\]|[^:/\[\]]+):(\d{1,5})", address)
    if m is None or len(address) > 300:
        return f"kv_address {address[:80]!r} is not tcp://HOST:PORT"
    host, port = m.group(1), int(m.group(2))
    if not 0 < port < 65536:
        return f"kv_address {address!r}: port {port} is not in [1, 65535]"
    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        if host.startswith("[") or not _HOSTNAME.match(host) or host.replace(".", "").isdigit():
            return f"kv_address {address!r}: {host!r} is neither an IP address nor a host name"
    return None


@dataclass
class NodeInfo:
    node_id: str
    role: str
    hello: P.Hello
    stats: P.NodeStats
    last_seen: float
    state: str = LIVE


class Registry:
    def __init__(self, model: P.ModelIdentity, num_layers: int, num_kv_heads: int,
                 head_dim: int, heartbeat_interval_s: float, liveness: int):
        self.model = model
        self.shape = (num_layers, num_kv_heads, head_dim)
        self.timeout_s = heartbeat_interval_s * liveness
        self.nodes: dict[str, NodeInfo] = {}
        # dtype and block size are the nodes' choice, but every node must make the same one
        # (KV moves between them page for page): the first node admitted sets them.
        self.cluster_kv: tuple[str, int, str] | None = None  # and the weights' form
        self._listeners: list[Callable[[str, NodeInfo], None]] = []

    def subscribe(self, listener: Callable[[str, NodeInfo], None]) -> None:
        """``listener(event, node)`` after each change of membership or status."""
        self._listeners.append(listener)

    def _emit(self, event: str, node: NodeInfo) -> None:
        for listener in self._listeners:
            listener(event, node)

    def admit(self, hello: P.Hello, now: float | None = None,
              keep: bool = False) -> tuple[bool, str]:
        """Checks a node's Hello; on success the node is registered (or re-registered).
        ``keep``: a resync of a node already here: it keeps its state (draining)."""
        if hello.node_id not in self.nodes and len(self.nodes) >= MAX_NODES:
            return False, f"the cluster has {len(self.nodes)} nodes, the most this router takes"
        if hello.protocol_version != P.PROTOCOL_VERSION:
            return False, (f"protocol version {hello.protocol_version} is not this router's "
                           f"{P.PROTOCOL_VERSION}")
        if hello.role not in ROLES:
            return False, (f"role {hello.role!r} is not served by this router "
                           f"({', '.join(ROLES)})")
        # A node holding the file's int4 blocks (--quantization) says so with a suffix: the
        # same file, so the router's hash, but outputs that differ from a dequantized
        # node's: the cluster's first node sets which, as for the KV dtype below.
        file_hash, _, weights = hello.model.config_hash.partition("+")
        if weights not in HELD_WEIGHTS:
            return False, (f"model identity {hello.model.config_hash[:200]!r}: after its hash "
                           f"only {'+' + HELD_WEIGHTS[1]!r} may follow (weights held as int4)")
        if file_hash != self.model.config_hash:
            hint = ("; a simulated node: give the router the same --sim-profile and "
                    "--sim-kv-bytes-scale") if hello.compute == "simulated" else ""
            return False, (f"model {hello.model.name!r} ({hello.model.config_hash}) differs from "
                           f"the router's {self.model.name!r} ({self.model.config_hash}){hint}")
        lay = hello.kv_layout
        shape = (lay.num_layers, lay.num_kv_heads, lay.head_dim)
        if shape != self.shape:
            return False, (f"KV shape {shape} (layers, kv heads, head dim) is not the model's "
                           f"{self.shape}")
        problem = kv_address_problem(hello.kv_address) if hello.role == "decode" else None
        if problem:
            return False, problem
        others = [n for n in self.nodes.values() if n.node_id != hello.node_id]
        kv = (lay.dtype, lay.block_size, weights)
        if self.cluster_kv is not None and others and kv[:2] != self.cluster_kv[:2]:
            return False, (f"KV dtype {lay.dtype} / block_size {lay.block_size} differs from the "
                           f"cluster's {self.cluster_kv[0]} / {self.cluster_kv[1]}: KV could not "
                           "move between this node and the others")
        if self.cluster_kv is not None and others and weights != self.cluster_kv[2]:
            def held(w):
                return f"as {w} (--quantization)" if w else "dequantized"
            return False, (f"this node holds the model's weights {held(weights)}, the cluster's "
                           f"nodes {held(self.cluster_kv[2])}: their outputs differ; start "
                           "every node with the same --dtype and --quantization")
        self.cluster_kv = kv
        now = time.monotonic() if now is None else now
        old = self.nodes.get(hello.node_id)
        node = NodeInfo(hello.node_id, hello.role, hello, hello.capacity, now)
        if keep and old is not None and old.role == hello.role:
            node.state = old.state
        self.nodes[hello.node_id] = node
        if old is None or not keep:
            self._emit(REGISTERED, node)
        return True, ""

    def seen(self, node_id: str, stats: P.NodeStats | None = None,
             now: float | None = None) -> NodeInfo | None:
        node = self.nodes.get(node_id)
        if node is not None:
            node.last_seen = time.monotonic() if now is None else now
            if stats is not None:
                node.stats = stats
        return node

    def remove(self, node_id: str) -> NodeInfo | None:
        node = self.nodes.pop(node_id, None)
        if node is not None:
            self._emit(REMOVED, node)
        return node

    def drain(self, node_id: str) -> None:
        """The node finishes what it has and takes nothing new: no policy picks it."""
        node = self.nodes.get(node_id)
        if node is not None and node.state != DRAINING:
            node.state = DRAINING
            self._emit(DRAINING, node)

    def expire(self, now: float | None = None) -> list[NodeInfo]:
        """Removes and returns the nodes silent for longer than liveness intervals."""
        now = time.monotonic() if now is None else now
        dead = [n for n in self.nodes.values() if now - n.last_seen > self.timeout_s]
        for n in dead:
            del self.nodes[n.node_id]
            self._emit(REMOVED, n)
        return dead

    def live(self, role: str) -> list[NodeInfo]:
        return [n for n in self.nodes.values() if n.role == role and n.state == LIVE]

    def health(self) -> tuple[bool, str]:
        p, d, c = len(self.live("prefill")), len(self.live("decode")), len(self.live("colocated"))
        colocated = f", {c} colocated" if c else ""
        modes = {n.hello.compute for n in self.nodes.values()}
        if "none" in modes:
            colocated += " (COMPUTE NONE benchmark nodes: outputs are fixed tokens)"
        if "simulated" in modes:
            colocated += " (COMPUTE SIMULATED nodes: simulated GPUs, outputs a token stream)"
        if (p and d) or c:
            return True, f"{p} prefill and {d} decode nodes live{colocated}"
        return False, (f"{p} prefill and {d} decode nodes live{colocated}; needed: at least one "
                       "of each, or a colocated node")
