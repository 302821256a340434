"""KV as tensor frames of the KV message, over the decode node's KV socket (TCP).

Sender: the pages of all the requests of one prefill step bound for one decode node,
layer range by layer range, one tensor per layer's K and V (zero-copy where the pages
are consecutive in the pool, gathered otherwise), with one checksum per frame.
Receiver: the frames themselves are the pages to copy from.
"""
from __future__ import annotations

import itertools

import torch
import xxhash

from pdserve import kernels
from pdserve.common import protocol as P
from pdserve.common.codec import checksum_of
from pdserve.node.kv.base import KVSender, Outgoing, PageSource, make_chunk
from pdserve.node.kv.pages import KVCaches, bytes_of, copy_pages, paired_runs, pool_bytes


class TcpSender(KVSender):
    """Reaches every decode node; the way of last resort."""
    path = "tcp"

    def describe(self, req: P.PrefillRequest) -> str:
        if self.host_id and req.decode_host_id == self.host_id:
            return ("over TCP although it is on this host: the KV cache is not in a shared "
                    "segment (--no-kv-shm, a non-CPU device, or /dev/shm refused it)")
        return "over TCP: it is not on this host (or its host is not known)"

    def chunk(self, parts: list[Outgoing], start: int, end: int, last: bool) -> P.KVChunk:
        return frames_chunk(self.model, self.layout, self.kv_caches, parts, start, end,
                            checksums=self.checksums, last=last, views=self.views)


def frames_chunk(model: P.ModelIdentity, layout: P.KVLayout, kv_caches: KVCaches,
                 parts: list[Outgoing], layer_start: int, layer_end: int, *, checksums: bool,
                 last: bool, views: list[list[memoryview | None]] | None = None) -> P.KVChunk:
    """The message carrying layers [layer_start, layer_end) of several requests' blocks to
    one decode node: per tensor, the parts' pages one after the other, and (with
    ``checksums``) one checksum of them. ``views``: ``pool_bytes(kv_caches)``, which a node
    makes once (made here if None)."""
    ids = [b for p in parts for b in p.block_ids]
    runs = paired_runs(ids, ids)  # the same for every tensor
    views = pool_bytes(kv_caches) if views is None else views
    sums: list[int] = []
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(layer_start, layer_end):
        k_cache, v_cache = kv_caches[layer]
        if k_cache.device.type != "cpu":
            k, v = kernels.gather_kv(k_cache, v_cache, torch.tensor(ids, dtype=torch.int64,
                                                                    device=k_cache.device))
            frames = [(f, checksum_of(f) if checksums else None)   # [nb, bs, KVH, D] each
                      for f in (k.cpu(), v.cpu())]
        else:
            frames = [_frame_of(pool, views[layer][kv], ids, runs, checksums)
                      for kv, pool in enumerate((k_cache, v_cache))]
        for kv, (frame, frame_sum) in zip("kv", frames):
            tensors[f"{kv}{layer}"] = frame
            if checksums:
                sums.append(frame_sum)
    return make_chunk(model, layout, parts, layer_start, layer_end, last, checksums=sums,
                      tensors=tensors)


def _frame_of(pool: torch.Tensor, src: memoryview, ids: list[int], runs, checksum: bool
              ) -> tuple[torch.Tensor, int | None]:
    """The frame of pages ``ids`` (in ``runs``, see frames_chunk) of a CPU pool whose bytes
    are ``src``, and its checksum (None when off). Pages consecutive in the pool are one
    slice of it: that memory itself goes on the wire (the blocks stay allocated until the
    decode node acknowledges). Others are gathered into a new frame, hashed piece by piece
    as they land."""
    n = len(ids)
    if len(runs) <= 1:
        first = runs[0][0] if runs else 0
        view = pool[first:first + n]
        return view, checksum_of(view) if checksum else None
    frame = torch.empty((n, *pool.shape[1:]), dtype=pool.dtype)  # [nb, bs, KVH, D]
    h = xxhash.xxh3_64() if checksum else None
    at = itertools.accumulate((r[2] for r in runs[:-1]), initial=0)
    copy_pages(bytes_of(frame), src, [(s, d, k) for (s, _, k), d in zip(runs, at)],
               pool[0].nbytes, h)
    return frame, h.intdigest() if checksum else None


class FrameSource(PageSource):
    """The pages are the chunk's own tensor frames, one after the other."""

    def carries(self, chunk: P.KVChunk) -> bool:
        return chunk.shm is None

    def pages(self, chunk: P.KVChunk, names: list[str], page_nbytes: int
              ) -> tuple[list[memoryview], list[int]]:
        total = len(next(iter(chunk.tensors.values())))
        return [bytes_of(chunk.tensors[name]) for name in names], list(range(total))
