"""Which node gets a request. Pure functions of the live nodes and the dispatch's
placement (placement.py: its own counts per node); ``cache_aware`` also keeps an index of
what the router itself sent where, its own state, dropped when the registry says a node
was removed."""
from __future__ import annotations

import itertools
from collections import OrderedDict

from pdserve.common.block_hash import block_hashes
from pdserve.router.dispatch.placement import Placement
from pdserve.router.dispatch.registry import REMOVED, NodeInfo, Registry

MAX_INDEX_BLOCKS = 1 << 20  # per node, whatever its cache claims: bounds the router's memory


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

    The index is the router's picture of each node's prefix cache, built from what it
    routed there: every block key of every prompt it sent, in least-recently-used order,
    bounded by the node's cache size (a node evicts in the same order). It is forgotten
    when the node leaves or comes back as a new process."""

    PREFILL_SLACK_TOKENS = 2048   # one step's default token budget
    DECODE_SLACK_REQUESTS = 16

    def __init__(self, registry: Registry, placement: Placement | None = None):
        self.load = (placement or Placement()).load
        self._index: dict[str, tuple[object, OrderedDict]] = {}
        registry.subscribe(self._membership)

    def _membership(self, event: str, node: NodeInfo) -> None:
        if event == REMOVED:
            self._index.pop(node.node_id, None)

    def pick(self, role: str, nodes: list[NodeInfo], tokens: list[int]) -> NodeInfo:
        load = self.load
        hashes = block_hashes(tokens, nodes[0].hello.kv_layout.block_size)
        hits = {n.node_id: self._match(n, hashes) for n in nodes}
        least = min(nodes, key=lambda n: load(role, n))
        best = max(nodes, key=lambda n: (hits[n.node_id], [-x for x in load(role, n)[:2]]))
        slack = self.PREFILL_SLACK_TOKENS if role == "prefill" else self.DECODE_SLACK_REQUESTS
        chosen = best if hits[best.node_id] and \
            load(role, best)[0] - load(role, least)[0] <= slack else least
        self._remember(chosen, hashes)
        return chosen

    def num_indexed_blocks(self, node_id: str) -> int:
        entry = self._index.get(node_id)
        return len(entry[1]) if entry else 0

    def _blocks(self, node: NodeInfo) -> OrderedDict:
        entry = self._index.get(node.node_id)
        process = (node.hello.pid, node.hello.kv_address)
        if entry is None or entry[0] != process:  # new, or a new process: an empty cache
            entry = (process, OrderedDict())
            self._index[node.node_id] = entry
        return entry[1]

    def _match(self, node: NodeInfo, hashes: list[int]) -> int:
        blocks = self._blocks(node)
        n = 0
        for h in hashes:
            if h not in blocks:
                break
            n += 1
        return n

    def _remember(self, node: NodeInfo, hashes: list[int]) -> None:
        blocks = self._blocks(node)
        for h in hashes:
            blocks[h] = None
            blocks.move_to_end(h)
        cap = min(MAX_INDEX_BLOCKS, max(1, node.stats.num_total_blocks))
        while len(blocks) > cap:
            blocks.popitem(last=False)


POLICIES = {"round_robin": RoundRobin, "least_loaded": LeastLoaded, "cache_aware": CacheAware}


def make_policy(name: str, registry: Registry, placement: Placement):
    """The policy ``name``, ranking nodes by ``placement``'s counts."""
    return POLICIES[name](registry, placement)
