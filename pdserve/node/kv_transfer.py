"""Moving requests' KV from a prefill node's pages into a decode node's pages.

Sender side: ``kv_chunk`` gathers a layer range of the blocks of all the requests
of one prefill step bound for one decode node into one tensor per layer's K and V
(the frames that go on the wire; zero-copy where the pages are consecutive), with
one checksum per frame. Receiver side: ``KVReceiver`` checks each part against its
own model identity, layout and reservation, then copies all the parts' pages into
the blocks reserved for them, one copy call per tensor, checking the checksums.
Each request's transfer has an explicit state so that nothing is left half-done in
silence::

    RESERVED --chunk--> TRANSFERRING --last chunk--> DONE
        \\------------------+---- mismatch / bad checksum / lease expiry --> FAILED
"""
from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

import torch
import xxhash

from pdserve import kernels
from pdserve.common.codec import TORCH_DTYPES, checksum_of
from pdserve.common.errors import BAD_MESSAGE, CHECKSUM_MISMATCH, LAYOUT_MISMATCH, MODEL_MISMATCH
from pdserve.common.protocol import (
    KVChunk,
    KVLayout,
    KVPart,
    ModelIdentity,
    kv_tensor_names,
)
from pdserve.common.shm import Segment, SegmentError
from pdserve.engine.kv_pages import bytes_of, copy_pages, pages_checksum, paired_runs, pool_bytes
from pdserve.node.kv_shm import PeerSegments, shm_ref

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


class TransferState(enum.Enum):
    RESERVED = "reserved"
    TRANSFERRING = "transferring"
    DONE = "done"
    FAILED = "failed"


class KVTransferError(Exception):
    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass
class Outgoing:
    """One request's pages for ``kv_chunk``."""
    req_id: str
    block_ids: list[int]      # its blocks that travel: those after the decode node's cached
    num_tokens: int
    first_block: int = 0      # leading blocks of the prompt the decode node has cached
    first_token: int | None = None  # on the last chunk


def kv_chunk(model: ModelIdentity, layout: KVLayout, kv_caches: KVCaches,
             parts: list[Outgoing], layer_start: int, layer_end: int, *, checksums: bool,
             last: bool, segment: Segment | None = None,
             views: list[list[memoryview | None]] | None = None) -> KVChunk:
    """The one message carrying layers [layer_start, layer_end) of several requests' blocks
    to one decode node: per tensor, the parts' pages one after the other, and (with
    ``checksums``) one checksum of them. With ``segment`` (the shared segment ``kv_caches``
    lie in; the decode node is on this host) the message names the pages in it instead.
    ``views``: ``pool_bytes(kv_caches)``, which a node makes once (made here if None)."""
    ids = [b for p in parts for b in p.block_ids]
    runs = paired_runs(ids, ids)  # the same for every tensor
    views = pool_bytes(kv_caches) if views is None else views
    sums: list[int] = []
    tensors: dict[str, torch.Tensor] = {}
    ref = None
    if segment is not None:
        pools = _pools(kv_caches, layer_start, layer_end)
        ref = shm_ref(segment, pools, ids)
        page = pools[0][0].nbytes
        sums = [pages_checksum(views[layer][kv], runs, page)
                for layer in (range(layer_start, layer_end) if checksums else ()) for kv in (0, 1)]
    for layer in range(layer_start, layer_end) if segment is None else ():
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
    wire_parts = [KVPart(req_id=p.req_id, num_tokens=p.num_tokens, first_block=p.first_block,
                         first_token=p.first_token) for p in parts]
    return KVChunk(model=model, kv_layout=layout, layer_start=layer_start, layer_end=layer_end,
                   last=last, parts=wire_parts, shm=ref, checksums=sums, tensors=tensors)


def _pools(kv_caches: KVCaches, layer_start: int, layer_end: int) -> list[torch.Tensor]:
    """The page pools of layers [layer_start, layer_end), in tensor-name order."""
    return [kv_caches[layer][i] for layer in range(layer_start, layer_end) for i in (0, 1)]


def _frame_of(pool: torch.Tensor, src: memoryview, ids: list[int], runs, checksum: bool
              ) -> tuple[torch.Tensor, int | None]:
    """The frame of pages ``ids`` (in ``runs``, see kv_chunk) of a CPU pool whose bytes
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


def payload_bytes(chunk: KVChunk) -> int:
    """The KV bytes a chunk moves, in frames or through shared memory."""
    if chunk.shm is None:
        return sum(t.nbytes for t in chunk.tensors.values())
    return len(chunk.shm.offsets) * len(chunk.shm.block_ids) * _page_bytes(chunk.kv_layout)


def _page_bytes(lay: KVLayout) -> int:
    return lay.block_size * lay.num_kv_heads * lay.head_dim * TORCH_DTYPES[lay.dtype].itemsize


@dataclass
class InboundTransfer:
    req_id: str
    block_ids: torch.Tensor      # the blocks the KV goes to: those after the cached ones
    num_tokens: int
    first_block: int = 0         # leading blocks of the prompt already cached here
    state: TransferState = TransferState.RESERVED
    layers_done: set[int] = field(default_factory=set)


class KVReceiver:
    """Checks and places arriving chunks; one per decode node."""

    def __init__(self, model: ModelIdentity, layout: KVLayout, kv_caches: KVCaches):
        self.model = model
        self.layout = layout
        self.kv_caches = kv_caches
        self.segments = PeerSegments()  # same-host senders' segments, mapped on first use
        self._pool_bytes = pool_bytes(kv_caches)

    def check(self, chunk: KVChunk, part: KVPart, transfer: InboundTransfer) -> None:
        """Raises KVTransferError when a part must not be placed. (Checksums are checked
        while placing: each piece is hashed as it lands, still in cache.)"""
        if chunk.model != self.model:
            raise KVTransferError(MODEL_MISMATCH, (
                f"KV for {part.req_id!r} comes from model {chunk.model.name!r} "
                f"({chunk.model.config_hash}); this decode node serves {self.model.name!r} "
                f"({self.model.config_hash})"))
        if chunk.kv_layout != self.layout:
            raise KVTransferError(LAYOUT_MISMATCH, (
                f"KV layout of {part.req_id!r} is {_fmt(chunk.kv_layout)}; this decode node's "
                f"is {_fmt(self.layout)}"))
        if part.num_tokens != transfer.num_tokens:
            raise KVTransferError(LAYOUT_MISMATCH, (
                f"KV for {part.req_id!r} covers {part.num_tokens} tokens, the reservation "
                f"{transfer.num_tokens}"))
        if part.first_block != transfer.first_block:
            raise KVTransferError(LAYOUT_MISMATCH, (
                f"KV for {part.req_id!r} starts at block {part.first_block}; this decode "
                f"node holds {transfer.first_block} leading blocks and expects the rest"))

    def place(self, chunk: KVChunk, transfers: dict[int, InboundTransfer]
              ) -> dict[int, KVTransferError]:
        """Checks the parts ``transfers`` names (part index -> its reservation's transfer),
        copies their pages into the transfers' blocks, checking each tensor's checksum.
        Returns the parts that failed, and why: a part's own check fails it alone, a
        corrupt tensor fails every part placed (a failed transfer's blocks hold partial KV,
        but they are only ever freed, never read)."""
        failed: dict[int, KVTransferError] = {}
        for i, transfer in transfers.items():
            try:
                self.check(chunk, chunk.parts[i], transfer)
            except KVTransferError as exc:
                failed[i] = exc
        todo = {i: t for i, t in transfers.items() if i not in failed}
        if not todo:
            return failed
        names = kv_tensor_names(chunk.layer_start, chunk.layer_end)
        try:
            sources, src_ids = self._sources(chunk, names)
        except KVTransferError as exc:
            return failed | {i: exc for i in todo}
        starts = list(itertools.accumulate(
            (p.num_blocks(self.layout.block_size) for p in chunk.parts), initial=0))
        src_sel, dst_sel = [], []  # the placed parts' pages, in the chunk's order
        for i, t in todo.items():
            src_sel += src_ids[starts[i]:starts[i + 1]]
            dst_sel += t.block_ids.tolist()
        for t in todo.values():
            t.state = TransferState.TRANSFERRING
        bad = self._place_tensors(chunk, names, sources, src_ids, src_sel, dst_sel,
                                  whole=len(todo) == len(chunk.parts))
        if bad is not None:
            return failed | {i: bad for i in todo}
        for i, transfer in todo.items():
            if i not in failed:
                self._advance(chunk, chunk.parts[i], transfer, failed, i)
        return failed

    def _place_tensors(self, chunk: KVChunk, names: list[str], sources: list[memoryview],
                       src_ids: list[int], src_sel: list[int], dst_sel: list[int],
                       whole: bool) -> KVTransferError | None:
        """Copies source pages src_sel (of the chunk's src_ids) to this node's pages
        dst_sel in every tensor, one call per tensor, checking each tensor's checksum:
        while placing when every part is placed (the pieces land in the frame's order),
        over all src_ids first when some part is not. The error that fails them all, if a
        tensor is corrupt."""
        page_bytes = _page_bytes(self.layout)
        runs = paired_runs(src_sel, dst_sel)
        staged_runs, dst_index = None, None  # for a device pool: stage in host memory first
        if self.kv_caches[0][0].device.type != "cpu":
            staged_runs = paired_runs(src_sel, range(len(dst_sel)))
            dst_index = torch.tensor(dst_sel, dtype=torch.int64,
                                     device=self.kv_caches[0][0].device)
        # Some part is left out: the hash covers all the chunk's pages, in a pass of its own.
        all_runs = None if whole or not chunk.checksums else paired_runs(src_ids, src_ids)
        for k, (name, src) in enumerate(zip(names, sources)):
            layer, kv = int(name[1:]), 0 if name[0] == "k" else 1
            cache, dst = self.kv_caches[layer][kv], self._pool_bytes[layer][kv]
            h = xxhash.xxh3_64() if chunk.checksums and whole else None
            got = None if all_runs is None else pages_checksum(src, all_runs, page_bytes)
            if dst_index is None:
                copy_pages(dst, src, runs, page_bytes, h)
            else:
                staged = torch.empty((len(dst_sel), *cache.shape[1:]), dtype=cache.dtype)
                copy_pages(bytes_of(staged), src, staged_runs, page_bytes, h)
                cache.index_copy_(0, dst_index, staged.to(cache.device))
            got = h.intdigest() if h is not None else got
            if got is not None and got != chunk.checksums[k]:
                where = f" (read from shared segment {chunk.shm.segment})" if chunk.shm else ""
                reqs = ", ".join(repr(p.req_id) for p in chunk.parts[:4])
                return KVTransferError(CHECKSUM_MISMATCH, (
                    f"KV frame {name}{where} of {len(chunk.parts)} request(s) ({reqs}"
                    f"{', ..' if len(chunk.parts) > 4 else ''}) is corrupt: checksum "
                    f"{got:#018x}, sender said {chunk.checksums[k]:#018x}"))
        return None

    def _advance(self, chunk: KVChunk, part: KVPart, transfer: InboundTransfer,
                 failed: dict[int, KVTransferError], i: int) -> None:
        transfer.layers_done.update(range(chunk.layer_start, chunk.layer_end))
        if not chunk.last:
            return
        if len(transfer.layers_done) != self.layout.num_layers:
            missing = sorted(set(range(self.layout.num_layers)) - transfer.layers_done)
            failed[i] = KVTransferError(LAYOUT_MISMATCH, (
                f"last KV chunk of {part.req_id!r} arrived with layers {missing[:8]} "
                "never sent"))
        else:
            transfer.state = TransferState.DONE

    def _sources(self, chunk: KVChunk, names: list[str]) -> tuple[list[memoryview], list[int]]:
        """Each tensor's pages as bytes, and the source page index of each block of the
        chunk (the parts' blocks one after the other)."""
        if chunk.shm is None:
            total = len(next(iter(chunk.tensors.values())))
            return [bytes_of(chunk.tensors[name]) for name in names], list(range(total))
        return self._shm_sources(chunk, names), chunk.shm.block_ids

    def _shm_sources(self, chunk: KVChunk, names: list[str]) -> list[memoryview]:
        """Each tensor's page pool in the sender's segment, checked to lie inside it."""
        try:
            segment = self.segments.get(chunk.shm.segment)
        except SegmentError as exc:
            raise KVTransferError(BAD_MESSAGE, f"KV of {chunk.parts[0].req_id!r}.. is in "
                                  f"shared memory this node cannot read: {exc}") from None
        page_bytes = _page_bytes(self.layout)
        end = (max(chunk.shm.block_ids) + 1) * page_bytes
        for name, offset in zip(names, chunk.shm.offsets):
            if offset + end > segment.size:
                raise KVTransferError(BAD_MESSAGE, (
                    f"KV {name} of {chunk.parts[0].req_id!r}..: {end} bytes of pages at "
                    f"offset {offset} do not lie inside segment {chunk.shm.segment} "
                    f"({segment.size} bytes)"))
        return [segment.view[offset:offset + end] for offset in chunk.shm.offsets]


def _fmt(layout: KVLayout) -> str:
    return (f"{layout.num_layers} layers x {layout.num_kv_heads} kv heads x head_dim "
            f"{layout.head_dim}, {layout.dtype}, block_size {layout.block_size}")
