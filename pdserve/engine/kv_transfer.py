"""Moving one request's KV from a prefill node's pages into a decode node's pages.

Sender side: ``kv_chunk`` gathers a layer range of a request's blocks into
contiguous tensors (the frames that go on the wire, zero-copy) with a checksum
per frame. Receiver side: ``KVReceiver`` checks each chunk against its own
model identity and layout and the checksums, then scatters it into the blocks
reserved for the request. A transfer has an explicit state so that nothing
is left half-done in silence::

    RESERVED --chunk--> TRANSFERRING --last chunk--> DONE
        \\------------------+---- mismatch / bad checksum / lease expiry --> FAILED
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch
import xxhash

from pdserve import kernels
from pdserve.common.codec import checksum_of
from pdserve.common.errors import BAD_MESSAGE, CHECKSUM_MISMATCH, LAYOUT_MISMATCH, MODEL_MISMATCH
from pdserve.common.protocol import (
    DTYPES,
    KVChunk,
    KVLayout,
    ModelIdentity,
    kv_tensor_names,
)
from pdserve.common.shm import Segment, SegmentError
from pdserve.engine.kv_shm import (
    PeerSegments,
    bytes_of,
    copy_pages,
    pages_checksum,
    paired_runs,
    shm_ref,
)

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


def kv_chunk(req_id: str, model: ModelIdentity, layout: KVLayout, kv_caches: KVCaches,
             block_ids: torch.Tensor, num_tokens: int, layer_start: int, layer_end: int,
             *, checksums: bool, last: bool, first_token: int | None = None,
             first_block: int = 0, segment: Segment | None = None) -> KVChunk:
    """The message carrying layers [layer_start, layer_end) of one request's blocks from
    its block ``first_block`` on (``block_ids``: those blocks). With ``segment`` (the
    shared segment ``kv_caches`` lie in; the decode node is on this host) the message
    names the pages in it instead of carrying them."""
    ids = block_ids.tolist()
    fields = dict(req_id=req_id, model=model, kv_layout=layout, layer_start=layer_start,
                  layer_end=layer_end, num_tokens=num_tokens, first_block=first_block,
                  last=last, first_token=first_token)
    if segment is not None:
        ref, sums = shm_ref(segment, kv_caches, ids, layer_start, layer_end, checksums)
        return KVChunk(**fields, checksums=sums, shm=ref)
    tensors: dict[str, torch.Tensor] = {}
    sums = []
    for layer in range(layer_start, layer_end):
        k_cache, v_cache = kv_caches[layer]
        if k_cache.device.type != "cpu":
            k, v = kernels.gather_kv(k_cache, v_cache, block_ids)  # [nb, bs, KVH, D] each
            pairs = [(k.cpu(), None), (v.cpu(), None)]
        else:
            pairs = [_frame_of(k_cache, ids, checksums), _frame_of(v_cache, ids, checksums)]
        for kv, (t, sum_) in zip("kv", pairs):
            tensors[f"{kv}{layer}"] = t
            if checksums:
                sums.append(checksum_of(t) if sum_ is None else sum_)
    return KVChunk(**fields, checksums=sums, tensors=tensors)


def _frame_of(pool: torch.Tensor, ids: list[int], checksum: bool) -> tuple[torch.Tensor,
                                                                          int | None]:
    """The frame of pages ``ids`` of a CPU pool, and its checksum (None when off).
    Consecutive pages are one slice of the pool: that memory itself goes on the wire (the
    blocks stay allocated until the decode node acknowledges). Others are gathered into a
    new frame, hashed piece by piece as they land."""
    n = len(ids)
    first = ids[0] if ids else 0
    if ids == list(range(first, first + n)):
        view = pool[first:first + n]
        return view, pages_checksum(pool, ids) if checksum else None
    frame = torch.empty((n, *pool.shape[1:]), dtype=pool.dtype)  # [nb, bs, KVH, D]
    h = xxhash.xxh3_64() if checksum else None
    copy_pages(bytes_of(frame), bytes_of(pool), paired_runs(ids, range(n)), pool[0].nbytes, h)
    return frame, h.intdigest() if checksum else None


def payload_bytes(chunk: KVChunk) -> int:
    """The KV bytes a chunk moves, in frames or through shared memory."""
    if chunk.shm is None:
        return sum(t.nbytes for t in chunk.tensors.values())
    return len(chunk.shm.offsets) * len(chunk.shm.block_ids) * _page_bytes(chunk.kv_layout)


def _page_bytes(lay: KVLayout) -> int:
    return lay.block_size * lay.num_kv_heads * lay.head_dim * DTYPES[lay.dtype].itemsize


def layer_groups(num_layers: int, layers_per_chunk: int) -> list[tuple[int, int]]:
    return [(s, min(s + layers_per_chunk, num_layers))
            for s in range(0, num_layers, layers_per_chunk)]


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

    def check(self, chunk: KVChunk, transfer: InboundTransfer) -> None:
        """Raises KVTransferError when the chunk must not be placed. (Checksums are
        checked while placing: each piece is hashed as it lands, still in cache.)"""
        if chunk.model != self.model:
            raise KVTransferError(MODEL_MISMATCH, (
                f"KV for {chunk.req_id!r} comes from model {chunk.model.name!r} "
                f"({chunk.model.config_hash}); this decode node serves {self.model.name!r} "
                f"({self.model.config_hash})"))
        if chunk.kv_layout != self.layout:
            raise KVTransferError(LAYOUT_MISMATCH, (
                f"KV layout of {chunk.req_id!r} is {_fmt(chunk.kv_layout)}; this decode node's "
                f"is {_fmt(self.layout)}"))
        if chunk.num_tokens != transfer.num_tokens:
            raise KVTransferError(LAYOUT_MISMATCH, (
                f"KV for {chunk.req_id!r} covers {chunk.num_tokens} tokens, the reservation "
                f"{transfer.num_tokens}"))
        if chunk.first_block != transfer.first_block:
            raise KVTransferError(LAYOUT_MISMATCH, (
                f"KV for {chunk.req_id!r} starts at block {chunk.first_block}; this decode "
                f"node holds {transfer.first_block} leading blocks and expects the rest"))

    def place(self, chunk: KVChunk, transfer: InboundTransfer) -> None:
        """Checks the chunk, then copies its pages into the transfer's blocks, checking
        each tensor's checksum over what was placed. On a mismatch the transfer fails
        (its blocks hold partial KV, but they are only ever freed, never read)."""
        self.check(chunk, transfer)
        transfer.state = TransferState.TRANSFERRING
        names = kv_tensor_names(chunk.layer_start, chunk.layer_end)
        dst_ids = transfer.block_ids.tolist()
        if chunk.shm is not None:
            src_ids, sources = chunk.shm.block_ids, self._shm_sources(chunk, names)
            where = f" (read from shared segment {chunk.shm.segment})"
        else:
            src_ids = range(len(dst_ids))
            sources = [bytes_of(chunk.tensors[name]) for name in names]
            where = ""
        runs = paired_runs(src_ids, dst_ids)
        page_bytes = _page_bytes(self.layout)
        for i, (name, src) in enumerate(zip(names, sources)):
            cache = self.kv_caches[int(name[1:])][0 if name[0] == "k" else 1]
            h = xxhash.xxh3_64() if chunk.checksums else None
            if cache.device.type == "cpu":
                copy_pages(bytes_of(cache), src, runs, page_bytes, h)
            else:  # pages arrive in host memory: stage them there, then one device copy
                staged = torch.empty((len(dst_ids), *cache.shape[1:]), dtype=cache.dtype)
                copy_pages(bytes_of(staged), src, paired_runs(src_ids, range(len(dst_ids))),
                           page_bytes, h)
                cache.index_copy_(0, transfer.block_ids.to(cache.device),
                                  staged.to(cache.device))
            if h is not None and h.intdigest() != chunk.checksums[i]:
                raise KVTransferError(CHECKSUM_MISMATCH, (
                    f"KV frame {name}{where} of {chunk.req_id!r} is corrupt: checksum "
                    f"{h.intdigest():#018x}, sender said {chunk.checksums[i]:#018x}"))
        transfer.layers_done.update(range(chunk.layer_start, chunk.layer_end))
        if chunk.last:
            if len(transfer.layers_done) != self.layout.num_layers:
                missing = sorted(set(range(self.layout.num_layers)) - transfer.layers_done)
                raise KVTransferError(LAYOUT_MISMATCH, (
                    f"last KV chunk of {chunk.req_id!r} arrived with layers {missing[:8]} "
                    "never sent"))
            transfer.state = TransferState.DONE

    def _shm_sources(self, chunk: KVChunk, names: list[str]) -> list[memoryview]:
        """Each tensor's page pool in the sender's segment, checked to lie inside it."""
        try:
            segment = self.segments.get(chunk.shm.segment)
        except SegmentError as exc:
            raise KVTransferError(BAD_MESSAGE, f"KV of {chunk.req_id!r} is in shared memory "
                                  f"this node cannot read: {exc}") from None
        page_bytes = _page_bytes(self.layout)
        end = (max(chunk.shm.block_ids) + 1) * page_bytes
        for name, offset in zip(names, chunk.shm.offsets):
            if offset + end > segment.size:
                raise KVTransferError(BAD_MESSAGE, (
                    f"KV {name} of {chunk.req_id!r}: {end} bytes of pages at offset {offset} "
                    f"do not lie inside segment {chunk.shm.segment} ({segment.size} bytes)"))
        return [segment.view[offset:offset + end] for offset in chunk.shm.offsets]


def _fmt(layout: KVLayout) -> str:
    return (f"{layout.num_layers} layers x {layout.num_kv_heads} kv heads x head_dim "
            f"{layout.head_dim}, {layout.dtype}, block_size {layout.block_size}")
