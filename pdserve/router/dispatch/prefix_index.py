"""The router's picture of each node's prefix cache, built from the node's own KV events
(vLLM's format, common/kv_events.py) and, where those cannot say everything, from the
node's index dump (protocol/index.py). Pure Python: the sockets that feed it are
router/kv_index.py's; ``CacheAware`` (policies.py) reads it.

Per node, a set of block keys (the chained hashes of common/block_hash.py, the same keys
the router computes from a prompt) and the number of the last event batch applied. The
index of a node is *synced* once a dump is in and every batch after the dump's number
has been applied in order. It stops being synced, and a dump is wanted, when

- the node registers (a router that joins late, or a node that joins, knows nothing of
  what was cached before: vLLM's events have no initial sync);
- a batch's number skips (events lost: a high-water mark, a queue the node dropped, a
  subscription not yet in place);
- the node's heartbeat says it published a batch the router had still not seen a
  heartbeat later (lost at the tail, where no later batch shows the gap);
- a batch cannot be decoded.

Batches that arrive while a dump is on its way are kept (at most MAX_BUFFERED_BATCHES)
and applied on top of it. A dump that does not come is asked for again every
DUMP_RETRY_S; consecutive dumps of one node are spaced by a backoff (a node whose events
never reach this router, say a loopback address announced to another machine, must not
be asked for its whole cache every heartbeat).

Readiness: a node's first dump since it registered is *pending* for at most
DUMP_DEADLINE_S; the router is not ready while one is. Past the deadline the router
serves anyway (one silent node must not take a router out of its load balancer), and
the node's index counts as degraded until its dump arrives, as it does while any dump
is outstanding.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from pdserve.common.kv_events import ClearedEvent, EventBatch, RemovedEvent, StoredEvent
from pdserve.common.limits import MAX_INDEX_BLOCKS

DUMP_DEADLINE_S = 10.0       # a node's first dump holds the router's readiness this long
DUMP_RETRY_S = 3.0           # an unanswered dump request is sent again after this
MIN_DUMP_INTERVAL_S = 0.5    # between two dumps of one node, doubled per dump in a minute
MAX_DUMP_INTERVAL_S = 30.0
MAX_BUFFERED_BATCHES = 4096  # event batches kept while a dump is on its way


@dataclass
class NodeIndex:
    events: bool                   # the node publishes KV events (its Hello says where)
    blocks: set = field(default_factory=set)
    seq: int = -1                  # the last batch applied
    synced: bool = False
    first: bool = True             # no dump in yet since the node registered
    since: float | None = None     # when the first dump was first asked for
    want: str | None = "joined"    # why a dump is wanted (None: not wanted)
    asked_at: float | None = None  # the outstanding request (None: none)
    buffered: list = field(default_factory=list)   # (seq, EventBatch) while not synced
    reported: int = -1             # the node's kv_events_seq at its previous heartbeat
    dumps: deque = field(default_factory=lambda: deque(maxlen=8))  # times dumps came
    why: str = "it registered"     # what made the index of this node incomplete


class PrefixIndex:
    def __init__(self, deadline_s: float = DUMP_DEADLINE_S):
        self.nodes: dict[str, NodeIndex] = {}
        self.deadline_s = deadline_s
        self.num_dumps: dict[str, int] = {}    # by reason (what wanted it): for metrics
        self.num_over_cap = 0                  # keys not indexed: a node past MAX_INDEX_BLOCKS

    # -- membership -------------------------------------------------------------------------
    def add(self, node_id: str, events: bool) -> None:
        """A node registered (or came back as a new process): nothing is known of it."""
        self.nodes[node_id] = NodeIndex(events=events, want="joined" if events else None)

    def remove(self, node_id: str) -> None:
        self.nodes.pop(node_id, None)

    # -- reading ----------------------------------------------------------------------------
    def match(self, node_id: str, hashes: list[int]) -> int:
        """How many leading blocks of ``hashes`` the node is known to hold."""
        entry = self.nodes.get(node_id)
        if entry is None:
            return 0
        blocks, n = entry.blocks, 0
        for h in hashes:
            if h not in blocks:
                break
            n += 1
        return n

    def num_blocks(self, node_id: str) -> int:
        entry = self.nodes.get(node_id)
        return len(entry.blocks) if entry else 0

    def pending(self, now: float) -> list[str]:
        """Nodes whose first dump the router still waits for (its readiness)."""
        return sorted(n for n, e in self.nodes.items() if e.events and e.first
                      and (e.since is None or now - e.since < self.deadline_s))

    def degraded(self, node_id: str) -> bool:
        """The router's index of this node may lack blocks it holds."""
        entry = self.nodes.get(node_id)
        return entry is not None and not entry.synced

    # -- what feeds it ----------------------------------------------------------------------
    def batch(self, node_id: str, seq: int, batch: EventBatch | None) -> None:
        """A batch the node published (None: one that did not decode)."""
        entry = self.nodes.get(node_id)
        if entry is None or not entry.events or seq <= entry.seq:
            return  # not ours, or already applied (a dump covered it)
        if batch is None:
            self._lost(entry, f"a batch after {entry.seq} did not decode")
            return
        if not entry.synced:
            if len(entry.buffered) >= MAX_BUFFERED_BATCHES:
                entry.buffered.pop(0)  # the dump will not join up with what is kept: a gap
            entry.buffered.append((seq, batch))
            return
        if seq != entry.seq + 1:
            self._lost(entry, f"batches {entry.seq + 1}..{seq - 1} lost")
            entry.buffered.append((seq, batch))
            return
        self._apply(entry, seq, batch)

    def heartbeat(self, node_id: str, kv_events_seq: int) -> None:
        """The node's heartbeat says its last published batch is ``kv_events_seq``."""
        entry = self.nodes.get(node_id)
        if entry is None or not entry.events:
            return
        if entry.synced and entry.reported > entry.seq:
            self._lost(entry, f"the node published batch {entry.reported}, none came "
                              f"after {entry.seq}")
        entry.reported = kv_events_seq

    def dump(self, node_id: str, seq: int, hashes: list[int], now: float) -> bool:
        """The node's whole index as of batch ``seq``; False if it was not asked for."""
        entry = self.nodes.get(node_id)
        if entry is None or entry.want is None or entry.asked_at is None:
            return False
        entry.blocks = set(hashes[:MAX_INDEX_BLOCKS])
        entry.seq, entry.want, entry.asked_at = seq, None, None
        entry.synced, entry.first = True, False
        entry.dumps.append(now)
        kept, entry.buffered = entry.buffered, []
        for s, batch in kept:
            if s <= entry.seq:
                continue
            if s != entry.seq + 1:
                self._lost(entry, f"batches {entry.seq + 1}..{s - 1} lost during the dump")
                entry.buffered = [(t, b) for t, b in kept if t >= s]
                return True
            self._apply(entry, s, batch)
        return True

    def due(self, now: float) -> list[tuple[str, str]]:
        """(node id, reason) of each dump to ask for now; marks them asked."""
        out = []
        for node_id, entry in self.nodes.items():
            if entry.want is None:
                continue
            if entry.since is None:
                entry.since = now
            if entry.asked_at is not None and now - entry.asked_at < DUMP_RETRY_S:
                continue
            if entry.asked_at is None and now < self._next_dump(entry, now):
                continue
            entry.asked_at = now
            self.num_dumps[entry.want] = self.num_dumps.get(entry.want, 0) + 1
            out.append((node_id, entry.want))
        return out

    # -- inside -------------------------------------------------------------------------------
    def _next_dump(self, entry: NodeIndex, now: float) -> float:
        recent = [t for t in entry.dumps if now - t < 60.0]
        if not recent:
            return now
        gap = min(MAX_DUMP_INTERVAL_S, MIN_DUMP_INTERVAL_S * 2 ** (len(recent) - 1))
        return recent[-1] + gap

    def _lost(self, entry: NodeIndex, why: str) -> None:
        entry.synced = False
        if entry.want is None:
            entry.want, entry.why = "gap", why

    def _apply(self, entry: NodeIndex, seq: int, batch: EventBatch) -> None:
        blocks = entry.blocks
        for ev in batch.events:
            if isinstance(ev, StoredEvent):
                room = MAX_INDEX_BLOCKS - len(blocks)
                if room < len(ev.block_hashes):
                    self.num_over_cap += len(ev.block_hashes) - max(0, room)
                blocks.update(ev.block_hashes[:max(0, room)])
            elif isinstance(ev, RemovedEvent):
                blocks.difference_update(ev.block_hashes)
            elif isinstance(ev, ClearedEvent):
                blocks.clear()
        entry.seq = seq
