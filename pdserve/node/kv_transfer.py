"""Moving requests' KV from a prefill node's pages into a decode node's pages.

Sender side: ``kv_chunk`` gathers a layer range of the blocks of all the requests
of one prefill step bound for one decode node into one tensor per layer's K and V
(the frames that go on the wire; zero-copy where the pages are consecutive), with
a checksum per request per frame. Receiver side: ``KVReceiver`` checks each part
against its own model identity, layout and reservation, then copies it into the
blocks reserved for its request, checking its checksums. Each request's transfer
has an explicit state so that nothing is left half-done in silence::

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
from pdserve.engine.kv_pages import bytes_of, copy_pages, pages_checksum, paired_runs
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
             last: bool, segment: Segment | None = None) -> KVChunk:
    """The one message carrying layers [layer_start, layer_end) of several requests' blocks
    to one decode node: per tensor, the parts' pages one after the other, and per part a
    checksum of its own pages. With ``segment`` (the shared segment ``kv_caches`` lie in;
    the decode node is on this host) the message names the pages in it instead."""
    spans = [p.block_ids for p in parts]
    ids = [b for span in spans for b in span]
    sums: list[list[int]] = [[] for _ in parts]
    tensors: dict[str, torch.Tensor] = {}
    ref = None
    if segment is not None:
        pools = _pools(kv_caches, layer_start, layer_end)
        ref = shm_ref(segment, pools, ids)
        for pool in pools if checksums else ():
            mv = bytes_of(pool)
            for part_sums, span in zip(sums, spans):
                part_sums.append(pages_checksum(pool, span, mv))
    for layer in range(layer_start, layer_end) if segment is None else ():
        k_cache, v_cache = kv_caches[layer]
        if k_cache.device.type != "cpu":
            k, v = kernels.gather_kv(k_cache, v_cache, torch.tensor(ids, dtype=torch.int64,
                                                                    device=k_cache.device))
            frames = [(k.cpu(), None), (v.cpu(), None)]  # [nb, bs, KVH, D] each
        else:
            frames = [_frame_of(k_cache, spans, checksums), _frame_of(v_cache, spans, checksums)]
        for kv, (frame, frame_sums) in zip("kv", frames):
            tensors[f"{kv}{layer}"] = frame
            if checksums:
                for part_sums, s in zip(sums, frame_sums or _span_checksums(frame, spans)):
                    part_sums.append(s)
    wire_parts = [KVPart(req_id=p.req_id, num_tokens=p.num_tokens, first_block=p.first_block,
                         first_token=p.first_token, checksums=s) for p, s in zip(parts, sums)]
    return KVChunk(model=model, kv_layout=layout, layer_start=layer_start, layer_end=layer_end,
                   last=last, parts=wire_parts, shm=ref, tensors=tensors)


def _pools(kv_caches: KVCaches, layer_start: int, layer_end: int) -> list[torch.Tensor]:
    """The page pools of layers [layer_start, layer_end), in tensor-name order."""
    return [kv_caches[layer][i] for layer in range(layer_start, layer_end) for i in (0, 1)]


def _span_checksums(frame: torch.Tensor, spans: list[list[int]]) -> list[int]:
    """The checksum of each part's pages of a gathered frame."""
    out, at = [], 0
    for span in spans:
        out.append(checksum_of(frame[at:at + len(span)]))
        at += len(span)
    return out


def _frame_of(pool: torch.Tensor, spans: list[list[int]], checksum: bool
              ) -> tuple[torch.Tensor, list[int] | None]:
    """The frame of the parts' pages (``spans``) of a CPU pool, and each part's checksum
    (None when off). Pages consecutive across all parts are one slice of the pool: that
    memory itself goes on the wire (the blocks stay allocated until the decode node
    acknowledges). Others are gathered into a new frame, hashed piece by piece as they land."""
    ids = [b for span in spans for b in span]
    first, n = (ids[0] if ids else 0), len(ids)
    if ids == list(range(first, first + n)):
        view, mv = pool[first:first + n], bytes_of(pool)
        return view, [pages_checksum(pool, span, mv) for span in spans] if checksum else None
    frame = torch.empty((n, *pool.shape[1:]), dtype=pool.dtype)  # [nb, bs, KVH, D]
    dst, src, page_bytes = bytes_of(frame), bytes_of(pool), pool[0].nbytes
    sums, at = [], 0
    for span in spans:
        h = xxhash.xxh3_64() if checksum else None
        copy_pages(dst, src, paired_runs(span, range(at, at + len(span))), page_bytes, h)
        at += len(span)
        if h is not None:
            sums.append(h.intdigest())
    return frame, sums if checksum else None


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
        # The CPU pools' bytes, made once: a view per pool per part of every chunk cost more
        # than copying a short prompt's pages.
        self._pool_bytes = [[bytes_of(c) if c.device.type == "cpu" else None for c in pair]
                            for pair in kv_caches]

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
        copies their pages into the transfers' blocks, checking each part's checksums over
        what was placed. Returns the parts that failed, and why; each failure is its own
        part's alone (a failed transfer's blocks hold partial KV, but they are only ever
        freed, never read)."""
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
        where = f" (read from shared segment {chunk.shm.segment})" if chunk.shm else ""
        starts = list(itertools.accumulate(
            (p.num_blocks(self.layout.block_size) for p in chunk.parts), initial=0))
        runs = {i: paired_runs(src_ids[starts[i]:starts[i + 1]], t.block_ids.tolist())
                for i, t in todo.items()}
        page_bytes = _page_bytes(self.layout)
        for t in todo.values():
            t.state = TransferState.TRANSFERRING
        for k, (name, src) in enumerate(zip(names, sources)):
            layer, kv = int(name[1:]), 0 if name[0] == "k" else 1
            cache, dst = self.kv_caches[layer][kv], self._pool_bytes[layer][kv]
            for i, transfer in todo.items():
                if i in failed:
                    continue
                part = chunk.parts[i]
                h = xxhash.xxh3_64() if part.checksums else None
                if cache.device.type == "cpu":
                    copy_pages(dst, src, runs[i], page_bytes, h)
                else:  # pages arrive in host memory: stage them there, then one device copy
                    n = len(transfer.block_ids)
                    staged = torch.empty((n, *cache.shape[1:]), dtype=cache.dtype)
                    copy_pages(bytes_of(staged), src, paired_runs(
                        src_ids[starts[i]:starts[i + 1]], range(n)), page_bytes, h)
                    cache.index_copy_(0, transfer.block_ids.to(cache.device),
                                      staged.to(cache.device))
                if h is not None and h.intdigest() != part.checksums[k]:
                    failed[i] = KVTransferError(CHECKSUM_MISMATCH, (
                        f"KV frame {name}{where} of {part.req_id!r} is corrupt: checksum "
                        f"{h.intdigest():#018x}, sender said {part.checksums[k]:#018x}"))
        for i, transfer in todo.items():
            if i not in failed:
                self._advance(chunk, chunk.parts[i], transfer, failed, i)
        return failed

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
