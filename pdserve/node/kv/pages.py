"""KV pages between page pools and byte buffers: runs, copies, checksums.

Pure memory work on CPU tensors (no messages, no sockets): the backends build
frames and describe pages with it, ``KVReceiver`` places arriving ones with it.
Pages move as runs consecutive on both sides, by memoryview slice assignment (a
plain memcpy), in pieces small enough that each is hashed while still in cache.
"""
from __future__ import annotations

import torch
import xxhash

from pdserve.common.codec import TORCH_DTYPES

# Each layer's (K, V) page pools, [num_blocks, block_size, num_kv_heads, head_dim] each.
KVCaches = list[tuple[torch.Tensor, torch.Tensor]]

PIECE_BYTES = 1 << 20    # copy then hash this much at a time: the hash reads from cache


def bytes_of(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous tensor as a flat memoryview (writable if the tensor is)."""
    if not t.is_contiguous():  # reshape would copy: writes would land in the copy
        raise ValueError(f"bytes_of: tensor {list(t.shape)} is not contiguous")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def pool_bytes(kv_caches) -> list[list[memoryview | None]]:
    """Each layer's [K, V] pool as bytes (None for a device pool), made once per process: a
    view per pool per message cost as much as checksumming a short prompt's pages."""
    return [[bytes_of(c) if c.device.type == "cpu" else None for c in pair] for pair in kv_caches]


def copy_pages(dst: memoryview, src: memoryview, runs, page_bytes: int,
               hasher=None) -> None:
    """Copies runs (first source page, first destination page, n) of pages of page_bytes
    from src to dst, in pieces of about PIECE_BYTES; ``hasher`` (if any) is updated with
    each piece as placed, while it is still in cache, so the checksum costs little more
    than the copy. Slice assignment of memoryviews is a plain memcpy with far less
    per-call cost than a torch op: scattered 32 KiB pages copy near memcpy speed."""
    piece = max(1, PIECE_BYTES // page_bytes)
    for s, d, n in runs:
        while n:  # most runs are a page or two: one pass, no generator per run
            k = n if n <= piece else piece
            a, b, c = d * page_bytes, (d + k) * page_bytes, s * page_bytes
            dst[a:b] = src[c:c + b - a]
            if hasher is not None:
                hasher.update(dst[a:b])
            s, d, n = s + k, d + k, n - k


def paired_runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """Runs consecutive on both sides: (first source block, first destination block, n)."""
    runs: list[list[int]] = []
    for s, d in zip(src, dst):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1][2] += 1
        else:
            runs.append([s, d, 1])
    return [tuple(r) for r in runs]


def pages_checksum(src: memoryview, runs, page_bytes: int) -> int:
    """XXH3 of the pages of a pool's bytes ``src`` that ``runs`` (first page, _, n) name,
    in that order: the same value as checksum_of their gathered copy, computed without
    gathering (one update per run). ``paired_runs(ids, ids)`` makes the runs of a list of
    pages; a chunk makes them once for all its tensors."""
    h = xxhash.xxh3_64()
    for first, _, n in runs:
        h.update(src[first * page_bytes:(first + n) * page_bytes])
    return h.intdigest()


def page_bytes(layout) -> int:
    """Bytes of one block of one tensor (a K or V page) of a KVLayout."""
    return (layout.block_size * layout.num_kv_heads * layout.head_dim
            * TORCH_DTYPES[layout.dtype].itemsize)
