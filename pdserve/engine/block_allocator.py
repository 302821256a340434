"""Pure-Python allocator of KV cache blocks with automatic prefix caching (no torch).

Every block has a reference count. A full block whose tokens are computed can be
registered under its chained hash (``pdserve.common.block_hash``); when its last
reference goes, it stays cached in the free list, least recently freed first out,
until an allocation needs it (eviction). A later sequence with the same prefix
takes a reference on it instead of recomputing it.

With caching on, what the cache stores and evicts is also recorded as events
(``drain_events``), the source of the vLLM-format KV-cache events a node publishes.
"""
from __future__ import annotations

from collections import OrderedDict

from pdserve.common.block_hash import BlockRemoved, BlockStored


class BlockAllocatorError(RuntimeError):
    pass


class BlockAllocator:
    def __init__(self, num_blocks: int, enable_caching: bool = False):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        # Unreferenced blocks, eviction order first; cached ones keep their hash until evicted.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._refs = [0] * num_blocks
        self._hash_of: dict[int, int] = {}                   # block -> hash
        self._cached: dict[int, tuple[int, tuple]] = {}      # hash -> (block, token ids)
        self._events: list | None = None   # None: nobody listens, nothing is recorded

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take now: never used, or cached and unreferenced."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise BlockAllocatorError(
                f"cannot allocate {n} KV blocks: {len(self._free)} of {self.num_blocks} free")
        blocks = []
        for _ in range(n):
            block, _ = self._free.popitem(last=False)
            self._evict(block)
            self._refs[block] = 1
            blocks.append(block)
        # Ascending: blocks freed together come back last-first (see free), and a sequence
        # whose blocks are consecutive moves its KV as one run per tensor, not one per block.
        blocks.sort()
        return blocks

    def free(self, blocks: list[int]) -> None:
        """Drops one reference on each block. The last blocks of a sequence are freed
        first, so that a prefix's tail is evicted before its head."""
        for b in reversed(blocks):
            if not 0 <= b < self.num_blocks or self._refs[b] <= 0:
                raise BlockAllocatorError(f"block {b} freed twice or never allocated")
            self._refs[b] -= 1
            if self._refs[b] == 0:
                self._free[b] = None

    # -- prefix caching ---------------------------------------------------------------
    def match_prefix(self, hashes: list[int], token_ids: list[int],
                     block_size: int) -> list[int]:
        """Takes a reference on each cached block of the longest cached prefix of
        ``hashes`` (checked against ``token_ids``) and returns those blocks."""
        blocks = self.cached_prefix(hashes, token_ids, block_size)
        for block in blocks:
            if self._refs[block] == 0:
                del self._free[block]
            self._refs[block] += 1
        return blocks

    def cached_prefix(self, hashes: list[int], token_ids: list[int],
                      block_size: int) -> list[int]:
        """The blocks ``match_prefix`` would take, without taking them."""
        if not self.enable_caching:
            return []
        blocks = []
        for i, h in enumerate(hashes):
            entry = self._cached.get(h)
            if entry is None or entry[1] != tuple(token_ids[i * block_size:(i + 1) * block_size]):
                break
            blocks.append(entry[0])
        return blocks

    def num_unreferenced(self, blocks: list[int]) -> int:
        """How many of ``blocks`` no one holds (cached in the free list: taking them
        leaves fewer free blocks)."""
        return sum(1 for b in blocks if self._refs[b] == 0)

    def register(self, block: int, block_hash: int, parent_hash: int | None,
                 token_ids: list[int]) -> None:
        """Marks a full, computed, referenced block as reusable under ``block_hash``."""
        if not self.enable_caching or block_hash in self._cached or block in self._hash_of:
            return  # the same prefix computed twice at once: the first copy serves
        tokens = tuple(token_ids)
        self._cached[block_hash] = (block, tokens)
        self._hash_of[block] = block_hash
        if self._events is not None:
            self._events.append(BlockStored(block_hash, parent_hash, tokens))

    def cached_hashes(self) -> list[int]:
        """The keys of every cached block, in the order they were stored."""
        return list(self._cached)

    def record_events(self) -> None:
        """From now on, what the cache stores and evicts is kept for ``drain_events``."""
        if self.enable_caching and self._events is None:
            self._events = []

    def drain_events(self) -> list:
        events, self._events = self._events, [] if self._events is not None else None
        return events or []

    def _evict(self, block: int) -> None:
        h = self._hash_of.pop(block, None)
        if h is not None:
            del self._cached[h]
            if self._events is not None:
                self._events.append(BlockRemoved(h))
