"""Pure-Python allocator of KV cache blocks with automatic prefix caching (no torch).

Every block has a reference count. A full block whose tokens are computed can be
registered under its chained hash (``pdserve.common.block_hash``); when its last
reference goes, it stays cached in the free list, least recently freed first out,
until an allocation needs it (eviction). A later sequence with the same prefix
takes a reference on it instead of recomputing it.

With caching on, what the cache stores and evicts is also recorded as events
(``drain_events``), the source of the vLLM-format KV-cache events a node publishes.

A pool that grows with use (a prefill node's /dev/shm segment: engine/host_memory.py
SparseStorage) is backed block by block as allocations first reach them, through
``reserve``. Blocks never used lie at the front of the free list in ascending order (a
freed block goes to its end), so the first allocations take 0, 1, 2, ... and the
backed blocks are always a prefix [0, backed). When the memory behind the next blocks
cannot be had, the pool stops at the backed prefix: it serves on, smaller.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Callable

from pdserve.common.block_hash import BlockRemoved, BlockStored

log = logging.getLogger(__name__)

RESERVE_STEP = 64  # blocks a growing pool is backed by at a time, at least


class BlockAllocatorError(RuntimeError):
    pass


class BlockAllocator:
    def __init__(self, num_blocks: int, enable_caching: bool = False,
                 reserve: Callable[[int, int], None] | None = None):
        """``reserve(start, stop)``: backs blocks [start, stop) of a pool that grows with
        use, raising OSError when it cannot; None: every block is backed already."""
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
        self._reserve = reserve
        self._fresh = 0  # blocks [0, _fresh) have been handed out at least once
        self.num_backed = num_blocks if reserve is None else 0  # blocks [0, num_backed)
        if reserve is not None:
            self._back(1)  # a pool that cannot back its first blocks fails at start

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
        self._back(n)
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        self._back(n)
        if n > len(self._free):
            raise BlockAllocatorError(
                f"cannot allocate {n} KV blocks: {len(self._free)} of {self.num_blocks} free")
        blocks = []
        for _ in range(n):
            block, _ = self._free.popitem(last=False)
            self._fresh = max(self._fresh, block + 1)
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

    def _back(self, n: int) -> None:
        """Backs the never-used blocks an allocation of ``n`` would take (the front of the
        free list: [_fresh, _fresh + n)), then up to RESERVE_STEP more if the memory is
        there. Where even the blocks asked for cannot be backed, the pool stops at those
        backed: the never-used ones past them leave the free list, and it is logged."""
        need = min(self.num_blocks, self._fresh + n)
        if need <= self.num_backed:
            return
        try:
            self._reserve(self.num_backed, need)
        except OSError as exc:
            self._stop_growing(exc)
            return
        self.num_backed = need
        ahead = min(self.num_blocks, self.num_backed + RESERVE_STEP)
        if ahead > need:
            try:
                self._reserve(need, ahead)
                self.num_backed = ahead
            except OSError:
                pass  # what is asked for is backed; the next allocation tries again

    def _stop_growing(self, error: OSError) -> None:
        if self.num_backed == 0:
            raise BlockAllocatorError(f"cannot back any KV block: {error}")
        lost = self.num_blocks - self.num_backed
        for block in range(self.num_backed, self.num_blocks):
            del self._free[block]  # never used, so free
        self.num_blocks = self.num_backed
        self._refs = self._refs[:self.num_blocks]
        log.error("the KV pool stops at %d blocks: the memory for %d more cannot be had "
                  "(%s)", self.num_blocks, lost, error)

    def _evict(self, block: int) -> None:
        h = self._hash_of.pop(block, None)
        if h is not None:
            del self._cached[h]
            if self._events is not None:
                self._events.append(BlockRemoved(h))
