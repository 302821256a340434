"""Where the dispatch has put requests: per node, the attempts placed there and the prompt
tokens queued there for prefill.

The dispatch owns this record and is its only writer; the registry knows members only.
These counts run ahead of the nodes' heartbeat stats (which lag by up to an interval), so
the policies rank nodes by them first (``load``). A node's entry goes when the dispatch
is told the node is gone (``drop``), returning what was placed there to move.
"""
from __future__ import annotations

from pdserve.router.dispatch.registry import NodeInfo


class Placement:
    def __init__(self) -> None:
        self._requests: dict[str, set[str]] = {}   # node id -> wire ids placed there
        self._queued: dict[str, int] = {}          # node id -> prompt tokens queued there

    def place(self, node_id: str, wire_id: str) -> None:
        self._requests.setdefault(node_id, set()).add(wire_id)

    def unplace(self, node_id: str, wire_id: str) -> None:
        placed = self._requests.get(node_id)
        if placed is not None:
            placed.discard(wire_id)

    def queue(self, node_id: str, num_tokens: int) -> None:
        """``num_tokens`` of prompt now wait for ``node_id``'s prefill (negative: no more)."""
        self._queued[node_id] = self._queued.get(node_id, 0) + num_tokens

    def requests(self, node_id: str) -> frozenset[str]:
        return frozenset(self._requests.get(node_id, ()))

    def num_requests(self, node_id: str) -> int:
        return len(self._requests.get(node_id, ()))

    def queued_tokens(self, node_id: str) -> int:
        return self._queued.get(node_id, 0)

    def drop(self, node_id: str) -> list[str]:
        """Forgets the node; the wire ids that were placed there (to move elsewhere)."""
        self._queued.pop(node_id, None)
        return sorted(self._requests.pop(node_id, ()))

    def load(self, role: str, node: NodeInfo) -> tuple:
        """Prefill: fewest queued prompt tokens. Decode: fewest sequences placed there, then
        most free KV blocks. The router's own counts go first: heartbeat stats lag."""
        if role == "prefill":
            return self.queued_tokens(node.node_id), node.stats.queued_prompt_tokens, \
                node.node_id
        return self.num_requests(node.node_id), -node.stats.num_free_blocks, node.node_id
