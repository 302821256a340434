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

from pdserve.common import protocol as P
from pdserve.common import shm
from pdserve.common.shm import Segment

log = logging.getLogger(__name__)

MAX_MAPPED = 64  # peer segments mapped at once; past it the least recently used goes


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
