"""Same-host KV: pages copied straight from the prefill node's shared segment.

The prefill node's KV pool *is* a shared-memory segment (``common/shm.py``), so
a chunk for a decode node on the same host names the segment, the byte offset
of each layer's K and V pool in it and the requests' pages (``shm_ref``). The
decode node copies those pages into the blocks it reserved (``KVReceiver.place``
in kv_transfer.py): the one memcpy end to end. Checksums stay as on the wire: the
sender's is XXH3 of each request's pages in its order (the bytes a TCP frame would
carry), and the receiver hashes what it placed, so a segment changed in between is
caught.
The sender's pages stay allocated until the KVAck, as for TCP.
"""
from __future__ import annotations

import logging
import time
from collections import OrderedDict

import torch
import xxhash

from pdserve.common import protocol as P
from pdserve.common import shm
from pdserve.common.shm import Segment

log = logging.getLogger(__name__)

MAX_MAPPED = 64          # peer segments mapped at once; past it the least recently used goes
PIECE_BYTES = 1 << 20    # copy then hash this much at a time: the hash reads from cache


def bytes_of(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous tensor as a flat memoryview (writable if the tensor is)."""
    if not t.is_contiguous():  # reshape would copy: writes would land in the copy
        raise ValueError(f"bytes_of: tensor {list(t.shape)} is not contiguous")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def copy_pages(dst: memoryview, src: memoryview, runs, page_bytes: int,
               hasher=None) -> None:
    """Copies runs (first source page, first destination page, n) of pages of page_bytes
    from src to dst, in pieces of about PIECE_BYTES; ``hasher`` (if any) is updated with
    each piece as placed, while it is still in cache, so the checksum costs little more
    than the copy. Slice assignment of memoryviews is a plain memcpy with far less
    per-call cost than a torch op: scattered 32 KiB pages copy near memcpy speed."""
    piece = max(1, PIECE_BYTES // page_bytes)
    for s, d, n in split_runs(runs, piece):
        a, b = d * page_bytes, (d + n) * page_bytes
        dst[a:b] = src[s * page_bytes:(s + n) * page_bytes]
        if hasher is not None:
            hasher.update(dst[a:b])


def paired_runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """Runs consecutive on both sides: (first source block, first destination block, n)."""
    runs: list[list[int]] = []
    for s, d in zip(src, dst):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1][2] += 1
        else:
            runs.append([s, d, 1])
    return [tuple(r) for r in runs]


def split_runs(runs, piece_blocks: int):
    """Runs cut into pieces of at most piece_blocks blocks."""
    for s, d, n in runs:
        for i in range(0, n, piece_blocks):
            yield s + i, d + i, min(piece_blocks, n - i)


def pages_checksum(pool: torch.Tensor, block_ids: list[int]) -> int:
    """XXH3 of pages ``block_ids`` of a [num_blocks, ...] pool, in that order: the same
    value as checksum_of their gathered copy, computed without gathering."""
    mv, page_bytes = bytes_of(pool), pool[0].nbytes
    h = xxhash.xxh3_64()
    for first, _, n in paired_runs(block_ids, block_ids):
        h.update(mv[first * page_bytes:(first + n) * page_bytes])
    return h.intdigest()


def shm_ref(segment: Segment, pools: list[torch.Tensor], block_ids: list[int]) -> P.ShmKV:
    """Where pages ``block_ids`` of the page pools ``pools`` (tensors in ``segment``) lie."""
    base = segment.data.data_ptr()
    return P.ShmKV(segment=segment.name, offsets=[p.data_ptr() - base for p in pools],
                   block_ids=list(block_ids))


class PeerSegments:
    """The prefill nodes' segments this decode node has mapped, by name (bounded)."""

    def __init__(self, limit: int = MAX_MAPPED):
        self.limit = limit
        self._mapped: OrderedDict[str, Segment] = OrderedDict()
        self._next_sweep = 0.0

    def get(self, name: str) -> Segment:
        """The mapped segment; SegmentError if it cannot be mapped."""
        seg = self._mapped.get(name)
        if seg is not None:
            self._mapped.move_to_end(name)
            return seg
        seg = Segment.open(name)
        log.info("mapped KV segment %s (%.0f MiB): same-host KV is copied from it",
                 name, seg.size / 2**20)
        self._mapped[name] = seg
        while len(self._mapped) > self.limit:
            self._mapped.popitem(last=False)[1].close()
        return seg

    def sweep(self, now: float | None = None) -> None:
        """Every shm.SWEEP_INTERVAL_S: unmap segments whose owner exited and unlink every
        dead owner's segment in /dev/shm (one killed with SIGKILL could not)."""
        now = time.monotonic() if now is None else now
        if now < self._next_sweep:
            return
        self._next_sweep = now + shm.SWEEP_INTERVAL_S
        for name in [n for n, s in self._mapped.items() if not s.owner_alive()]:
            log.info("KV segment %s: its owner exited; unmapped", name)
            self._mapped.pop(name).close()
        shm.sweep()

    def close(self) -> None:
        for seg in self._mapped.values():
            seg.close()
        self._mapped.clear()
