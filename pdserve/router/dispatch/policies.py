"""Which node gets a request. Pure functions of the live nodes and the dispatch's
placement (placement.py: its own counts per node); ``cache_aware`` also reads a prefix
index of every node's cache, built from the nodes' own KV events (prefix_index.py), its
own state, made when the registry says a node registered and dropped when it says the
node was removed."""
from __future__ import annotations

import itertools

from pdserve.common.block_hash import block_hashes
from pdserve.router.dispatch.placement import Placement
from pdserve.router.dispatch.prefix_index import PrefixIndex
from pdserve.router.dispatch.registry import REGISTERED, REMOVED, NodeInfo, Registry


class RoundRobin:
    def __init__(self, registry: Registry | None = None, placement: Placement | None = None):
        self._counters = {"prefill": itertools.count(), "decode": itertools.count()}

    def pick(self, role: str, nodes: list[NodeInfo], tokens: list[int]) -> NodeInfo:
        nodes = sorted(nodes, key=lambda n: n.node_id)
        return nodes[next(self._counters[role]) % len(nodes)]


class LeastLoaded:
    def __init__(self, registry: Registry | None = None, placement: Placement | None = None):
        self.load = (placement or Placement()).load

    def pick(self, role: str, nodes: list[NodeInfo], tokens: list[int]) -> NodeInfo:
        return min(nodes, key=lambda n: self.load(role, n))


class CacheAware:
    """The node holding the longest cached prefix of the prompt, unless its load exceeds
    the least loaded node's by more than a threshold (then the least loaded): SGLang's
    cache-aware policy, on the engine's own block keys.

    The index is the router's picture of each node's prefix cache, built from what the
    node says it stored and evicted (its KV events, and its dump when they cannot say
    everything), not from what this router sent: every router on the same nodes sees
    what the others' requests cached. It is forgotten when the node leaves or comes back
    as a new process (a new registration)."""

    PREFILL_SLACK_TOKENS = 2048   # one step's default token budget
    DECODE_SLACK_REQUESTS = 16

    def __init__(self, registry: Registry, placement: Placement | None = None):
        self.load = (placement or Placement()).load
        self.index = PrefixIndex()
        registry.subscribe(self._membership)
        for node in registry.nodes.values():   # (registered before this policy was made)
            self._membership(REGISTERED, node)

    def _membership(self, event: str, node: NodeInfo) -> None:
        if event == REGISTERED:
            self.index.add(node.node_id, events=node.hello.kv_events is not None)
        elif event == REMOVED:
            self.index.remove(node.node_id)

    def pick(self, role: str, nodes: list[NodeInfo], tokens: list[int]) -> NodeInfo:
        load = self.load
        hashes = block_hashes(tokens, nodes[0].hello.kv_layout.block_size)
        hits = {n.node_id: self.index.match(n.node_id, hashes) for n in nodes}
        least = min(nodes, key=lambda n: load(role, n))
        best = max(nodes, key=lambda n: (hits[n.node_id], [-x for x in load(role, n)[:2]]))
        slack = self.PREFILL_SLACK_TOKENS if role == "prefill" else self.DECODE_SLACK_REQUESTS
        chosen = best if hits[best.node_id] and \
            load(role, best)[0] - load(role, least)[0] <= slack else least
        return chosen

    def num_indexed_blocks(self, node_id: str) -> int:
        return self.index.num_blocks(node_id)


POLICIES = {"round_robin": RoundRobin, "least_loaded": LeastLoaded, "cache_aware": CacheAware}


def make_policy(name: str, registry: Registry, placement: Placement):
    """The policy ``name``, ranking nodes by ``placement``'s counts."""
    return POLICIES[name](registry, placement)
