"""The receiving half every decode node runs, whichever way the KV came.

``KVReceiver`` checks each part of an arriving chunk against its own model identity,
layout and reservation, reads the pages from the source the chunk names (its tensor
frames, a same-host segment, ...: ``PageSource``), copies all the placed parts' pages
into the blocks reserved for them, one copy call per tensor, checking the checksums,
and moves each request's ``TransferState`` on. Its answers go back by ``reply``.
"""
from __future__ import annotations

import itertools
from typing import Callable

import torch
import xxhash

from pdserve.common import protocol as P
from pdserve.common.errors import BAD_MESSAGE, CHECKSUM_MISMATCH, LAYOUT_MISMATCH, MODEL_MISMATCH
from pdserve.node.kv.base import InboundTransfer, KVTransferError, PageSource, TransferState
from pdserve.node.kv.pages import (
    KVCaches,
    bytes_of,
    copy_pages,
    page_bytes,
    pages_checksum,
    paired_runs,
    pool_bytes,
)
from pdserve.node.kv.shm import ShmSource
from pdserve.node.kv.tcp import FrameSource

# How a KVAck reaches the sender (the socket identity it came from): NodeIO.send_kv_reply.
Reply = Callable[[bytes, P.KVAck], None]


def default_sources() -> list[PageSource]:
    """Every way this node reads KV: tensor frames and same-host segments (a GPU-direct
    backend adds its source here)."""
    return [FrameSource(), ShmSource()]


class KVReceiver:
    """Checks and places arriving chunks; one per decode node."""

    def __init__(self, model: P.ModelIdentity, layout: P.KVLayout, kv_caches: KVCaches,
                 sources: list[PageSource] | None = None, reply: Reply | None = None):
        self.model = model
        self.layout = layout
        self.kv_caches = kv_caches
        self.sources = default_sources() if sources is None else sources
        self.reply = reply
        self._pool_bytes = pool_bytes(kv_caches)
        self._page_bytes = page_bytes(layout)

    def source(self, kind: type) -> PageSource | None:
        """The source of this kind (ShmSource, ...), if the receiver has one."""
        return next((s for s in self.sources if isinstance(s, kind)), None)

    def ack(self, peer: bytes, results: list[P.KVResult]) -> None:
        """Tells the sender (``peer``: its identity) how the settled parts went."""
        self.reply(peer, P.KVAck(results=results))

    def tick(self, now: float) -> None:
        for src in self.sources:
            src.tick(now)

    def close(self) -> None:
        for src in self.sources:
            src.close()

    def check(self, chunk: P.KVChunk, part: P.KVPart, transfer: InboundTransfer) -> None:
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

    def place(self, chunk: P.KVChunk, transfers: dict[int, InboundTransfer]
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
        names = P.kv_tensor_names(chunk.layer_start, chunk.layer_end)
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

    def _place_tensors(self, chunk: P.KVChunk, names: list[str], sources: list[memoryview],
                       src_ids: list[int], src_sel: list[int], dst_sel: list[int],
                       whole: bool) -> KVTransferError | None:
        """Copies source pages src_sel (of the chunk's src_ids) to this node's pages
        dst_sel in every tensor, one call per tensor, checking each tensor's checksum:
        while placing when every part is placed (the pieces land in the frame's order),
        over all src_ids first when some part is not. The error that fails them all, if a
        tensor is corrupt."""
        page_nbytes = self._page_bytes
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
            got = None if all_runs is None else pages_checksum(src, all_runs, page_nbytes)
            if dst_index is None:
                copy_pages(dst, src, runs, page_nbytes, h)
            else:
                staged = torch.empty((len(dst_sel), *cache.shape[1:]), dtype=cache.dtype)
                copy_pages(bytes_of(staged), src, staged_runs, page_nbytes, h)
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

    def _advance(self, chunk: P.KVChunk, part: P.KVPart, transfer: InboundTransfer,
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
            transfer.state = TransferState.SUCCESS

    def _sources(self, chunk: P.KVChunk, names: list[str]) -> tuple[list[memoryview], list[int]]:
        """Each tensor's pages as bytes, and the source page index of each block of the
        chunk, from the source the chunk names."""
        for src in self.sources:
            if src.carries(chunk):
                return src.pages(chunk, names, self._page_bytes)
        raise KVTransferError(BAD_MESSAGE, f"KV of {chunk.parts[0].req_id!r}.. comes in a "
                              "way this node does not read")


def _fmt(layout: P.KVLayout) -> str:
    return (f"{layout.num_layers} layers x {layout.num_kv_heads} kv heads x head_dim "
            f"{layout.head_dim}, {layout.dtype}, block_size {layout.block_size}")
