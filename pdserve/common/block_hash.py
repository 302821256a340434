"""Prefix-cache block keys and events, the same in every process (engine, nodes, router).

A full block of ``block_size`` tokens is keyed by a 64-bit hash chained over its
parent block's hash and its own token ids, so equal keys mean equal prefixes up to
and including the block. XXH3-64 with no seed: stable across processes and runs,
which lets the router predict which blocks a node holds.
"""
from __future__ import annotations

from array import array
from dataclasses import dataclass

import xxhash

NO_PARENT = 0  # the parent hash of a prompt's first block


@dataclass(frozen=True)
class BlockStored:
    """A full block became reusable (the allocator's event)."""
    block_hash: int
    parent_hash: int | None   # None: the prompt's first block
    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class BlockRemoved:
    """A cached block was evicted."""
    block_hash: int


def hash_block(parent: int, token_ids) -> int:
    data = parent.to_bytes(8, "little") + array("q", token_ids).tobytes()
    return xxhash.xxh3_64_intdigest(data)


def block_hashes(token_ids: list[int], block_size: int, limit: int | None = None,
                 parent: int = NO_PARENT) -> list[int]:
    """Chained hashes of the full blocks of ``token_ids`` (at most ``limit`` blocks)."""
    n = len(token_ids) // block_size
    if limit is not None:
        n = min(n, limit)
    out = []
    for i in range(n):
        parent = hash_block(parent, token_ids[i * block_size:(i + 1) * block_size])
        out.append(parent)
    return out
