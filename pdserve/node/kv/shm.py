"""Same-host KV: pages copied straight from the prefill node's shared segment.

The prefill node's KV pool *is* a shared-memory segment (``segment.py``), so a
chunk for a decode node on the same host names the segment, the byte offset of
each layer's K and V pool in it and the requests' pages (``shm_chunk``); the
message itself still goes over the KV socket, small. The decode node copies
those pages into the blocks it reserved (``KVReceiver.place``, reading them
through ``ShmSource``): the one memcpy end to end. Checksums stay as on the
wire: the sender's is XXH3 of each request's pages in its order (the bytes a
TCP frame would carry), and the receiver hashes what it placed, so a segment
changed in between is caught. The sender's pages stay allocated until the
KVAck, as for TCP.
"""
from __future__ import annotations

import logging
import time
from collections import OrderedDict

import torch

from pdserve.common import errors as E
from pdserve.common import protocol as P
from pdserve.engine.host_memory import SparseStorage
from pdserve.node.kv import segment as shm
from pdserve.node.kv.base import KVSender, KVTransferError, Outgoing, PageSource, make_chunk
from pdserve.node.kv.pages import KVCaches, pages_checksum, paired_runs, pool_bytes
from pdserve.node.kv.segment import Segment, SegmentError

log = logging.getLogger(__name__)

MAX_MAPPED = 64  # peer segments mapped at once; past it the least recently used goes


class ShmSender(KVSender):
    """Reaches the decode nodes that share this host's /dev/shm, once the KV cache lives
    in a segment of it (a CPU cache that /dev/shm had room for)."""
    path = "shm"
    segment: Segment | None = None

    def storage(self, nbytes: int) -> SparseStorage | None:
        try:
            self.segment = Segment.create(nbytes)
        except (SegmentError, OSError) as exc:
            log.warning("%s; KV to decode nodes on this host will go over TCP", exc)
            return None
        return SparseStorage(self.segment.data, self.segment.reserve)

    def reaches(self, req: P.PrefillRequest) -> bool:
        return (self.segment is not None and bool(self.host_id)
                and req.decode_host_id == self.host_id)

    def describe(self, req: P.PrefillRequest) -> str:
        return f"through shared memory ({self.segment.name})"

    def chunk(self, parts: list[Outgoing], start: int, end: int, last: bool) -> P.KVChunk:
        return shm_chunk(self.model, self.layout, self.kv_caches, parts, start, end,
                         checksums=self.checksums, last=last, segment=self.segment,
                         views=self.views)

    def close(self) -> None:
        if self.segment is not None:
            self.segment.close()


def shm_chunk(model: P.ModelIdentity, layout: P.KVLayout, kv_caches: KVCaches,
              parts: list[Outgoing], layer_start: int, layer_end: int, *, checksums: bool,
              last: bool, segment: Segment,
              views: list[list[memoryview | None]] | None = None) -> P.KVChunk:
    """The message naming, in ``segment`` (where ``kv_caches`` lie), the pages of layers
    [layer_start, layer_end) of ``parts``, with one checksum per tensor (as a frame's)."""
    ids = [b for p in parts for b in p.block_ids]
    runs = paired_runs(ids, ids)
    views = pool_bytes(kv_caches) if views is None else views
    pools = [kv_caches[layer][i] for layer in range(layer_start, layer_end) for i in (0, 1)]
    page = pools[0][0].nbytes
    sums = [pages_checksum(views[layer][kv], runs, page)
            for layer in (range(layer_start, layer_end) if checksums else ()) for kv in (0, 1)]
    return make_chunk(model, layout, parts, layer_start, layer_end, last, checksums=sums,
                      shm=shm_ref(segment, pools, ids))


def shm_ref(segment: Segment, pools: list[torch.Tensor], block_ids: list[int]) -> P.ShmKV:
    """Where pages ``block_ids`` of the page pools ``pools`` (tensors in ``segment``) lie."""
    base = segment.data.data_ptr()
    return P.ShmKV(segment=segment.name, offsets=[p.data_ptr() - base for p in pools],
                   block_ids=list(block_ids))


class ShmSource(PageSource):
    """The pages are in a same-host sender's segment, mapped read-only on first use."""

    def __init__(self):
        self.segments = PeerSegments()

    def carries(self, chunk: P.KVChunk) -> bool:
        return chunk.shm is not None

    def pages(self, chunk: P.KVChunk, names: list[str], page_nbytes: int
              ) -> tuple[list[memoryview], list[int]]:
        """Each tensor's page pool in the sender's segment, checked to lie inside it."""
        try:
            seg = self.segments.get(chunk.shm.segment)
        except SegmentError as exc:
            raise KVTransferError(E.BAD_MESSAGE, f"KV of {chunk.parts[0].req_id!r}.. is in "
                                  f"shared memory this node cannot read: {exc}") from None
        end = (max(chunk.shm.block_ids) + 1) * page_nbytes
        for name, offset in zip(names, chunk.shm.offsets):
            if offset + end > seg.size:
                raise KVTransferError(E.BAD_MESSAGE, (
                    f"KV {name} of {chunk.parts[0].req_id!r}..: {end} bytes of pages at "
                    f"offset {offset} do not lie inside segment {chunk.shm.segment} "
                    f"({seg.size} bytes)"))
        return ([seg.view[offset:offset + end] for offset in chunk.shm.offsets],
                chunk.shm.block_ids)

    def tick(self, now: float) -> None:
        self.segments.sweep(now)

    def close(self) -> None:
        self.segments.close()


class PeerSegments:
    """The prefill nodes' segments this decode node has mapped, by name (bounded)."""

    def __init__(self, limit: int = MAX_MAPPED):
        self.limit = limit
        self._mapped: OrderedDict[str, Segment] = OrderedDict()
        self._next_sweep = 0.0

    @property
    def names(self) -> list[str]:
        return list(self._mapped)

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
