"""Which node gets a request. Pure functions of the registry's view."""
from __future__ import annotations

import itertools

from pdserve.router.registry import NodeInfo


class RoundRobin:
    def __init__(self):
        self._counters = {"prefill": itertools.count(), "decode": itertools.count()}

    def pick(self, role: str, nodes: list[NodeInfo], num_tokens: int) -> NodeInfo:
        nodes = sorted(nodes, key=lambda n: n.node_id)
        return nodes[next(self._counters[role]) % len(nodes)]


class LeastLoaded:
    """Prefill: fewest queued prompt tokens. Decode: fewest sequences placed there, then
    most free KV blocks. The router's own counts go first: heartbeat stats lag."""

    def pick(self, role: str, nodes: list[NodeInfo], num_tokens: int) -> NodeInfo:
        if role == "prefill":
            return min(nodes, key=lambda n: (n.queued_prompt_tokens, n.stats.queued_prompt_tokens,
                                             n.node_id))
        return min(nodes, key=lambda n: (len(n.requests), -n.stats.num_free_blocks,
                                         n.node_id))


def make_policy(name: str):
    return {"round_robin": RoundRobin, "least_loaded": LeastLoaded}[name]()
