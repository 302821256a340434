"""Which node gets a request. Pure functions of the registry's view (and, for
``cache_aware``, of what the router itself sent where)."""
from __future__ import annotations

import itertools
from collections import OrderedDict

from pdserve.common.block_hash import block_hashes
from pdserve.router.dispatch.registry import NodeInfo, Registry

MAX_INDEX_BLOCKS = 1 << 20  # per node, whatever its cache claims: bounds the router's memory


class RoundRobin:
    def __init__(self, registry: Registry | None = None):
        self._counters = {"prefill": itertools.count(), "decode": itertools.count()}

    def pick(self, role: str, nodes: list[NodeInfo], tokens: list[int]) -> NodeInfo:
        nodes = sorted(nodes, key=lambda n: n.node_id)
        return nodes[next(self._counters[role]) % len(nodes)]


def load(role: str, node: NodeInfo) -> tuple:
    """Prefill: fewest queued prompt tokens. Decode: fewest sequences placed there, then
    most free KV blocks. The router's own counts go first: heartbeat stats lag."""
    if role == "prefill":
        return node.queued_prompt_tokens, node.stats.queued_prompt_tokens, node.node_id
    return len(node.requests), -node.stats.num_free_blocks, node.node_id


class LeastLoaded:
    def __init__(self, registry: Registry | None = None):
        pass

    def pick(self, role: str, nodes: list[NodeInfo], tokens: list[int]) -> NodeInfo:
        return min(nodes, key=lambda n: load(role, n))


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

    def __init__(self, registry: Registry):
        self.registry = registry
        self._index: dict[str, tuple[object, OrderedDict]] = {}

    def pick(self, role: str, nodes: list[NodeInfo], tokens: list[int]) -> NodeInfo:
        self._forget_departed()
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

    def _forget_departed(self) -> None:
        for node_id in [n for n in self._index if n not in self.registry.nodes]:
            del self._index[node_id]


POLICIES = {"round_robin": RoundRobin, "least_loaded": LeastLoaded, "cache_aware": CacheAware}


def make_policy(name: str, registry: Registry):
    return POLICIES[name](registry)
