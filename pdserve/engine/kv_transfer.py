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

from pdserve import kernels
from pdserve.common.protocol import (
    CHECKSUM_MISMATCH,
    LAYOUT_MISMATCH,
    MODEL_MISMATCH,
    KVChunk,
    KVLayout,
    ModelIdentity,
    checksum_of,
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
             first_block: int = 0) -> KVChunk:
    """The message carrying layers [layer_start, layer_end) of one request's blocks from
    its block ``first_block`` on (``block_ids``: those blocks)."""
    tensors: dict[str, torch.Tensor] = {}
    run = _contiguous_run(block_ids)
    for layer in range(layer_start, layer_end):
        k_cache, v_cache = kv_caches[layer]
        if run is not None:
            # Consecutive blocks are already one contiguous slice of the pages: send that
            # memory itself. The blocks stay allocated until the decode node acknowledges.
            k, v = k_cache[run[0]:run[1]], v_cache[run[0]:run[1]]
        else:
            k, v = kernels.gather_kv(k_cache, v_cache, block_ids)  # [nb, bs, KVH, D] each
        tensors[f"k{layer}"] = k if k.device.type == "cpu" else k.cpu()
        tensors[f"v{layer}"] = v if v.device.type == "cpu" else v.cpu()
    sums = [checksum_of(t) for t in tensors.values()] if checksums else []
    return KVChunk(req_id=req_id, model=model, kv_layout=layout, layer_start=layer_start,
                   layer_end=layer_end, num_tokens=num_tokens, first_block=first_block,
                   checksums=sums, last=last,
                   first_token=first_token, tensors=tensors)


def _contiguous_run(block_ids: torch.Tensor) -> tuple[int, int] | None:
    """(first, last + 1) when the block ids are consecutive and ascending, else None."""
    if block_ids.numel() == 0:
        return None
    first = int(block_ids[0])
    n = block_ids.numel()
    expected = torch.arange(first, first + n, dtype=block_ids.dtype, device=block_ids.device)
    return (first, first + n) if torch.equal(block_ids, expected) else None


def block_runs(block_ids: torch.Tensor) -> list[tuple[int, int, int]]:
    """Runs of consecutive ascending block ids: (index in block_ids, first block, length)."""
    ids = block_ids.tolist()
    runs: list[tuple[int, int, int]] = []
    for i, b in enumerate(ids):
        if runs and runs[-1][1] + runs[-1][2] == b:
            at, first, n = runs[-1]
            runs[-1] = (at, first, n + 1)
        else:
            runs.append((i, b, 1))
    return runs


# Place by slice copies when the runs average at least this many blocks; index_copy_ else.
MIN_MEAN_RUN = 4


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
    runs: list[tuple[int, int, int]] | None = None  # block_runs(block_ids), when worth it

    def __post_init__(self):
        runs = block_runs(self.block_ids)
        if runs and len(runs) * MIN_MEAN_RUN <= self.block_ids.numel():
            self.runs = runs


class KVReceiver:
    """Checks and places arriving chunks; one per decode node."""

    def __init__(self, model: ModelIdentity, layout: KVLayout, kv_caches: KVCaches):
        self.model = model
        self.layout = layout
        self.kv_caches = kv_caches

    def check(self, chunk: KVChunk, transfer: InboundTransfer) -> None:
        """Raises KVTransferError when the chunk must not be placed."""
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
        if chunk.checksums:
            for (name, tensor), want in zip(chunk.tensors.items(), chunk.checksums):
                got = checksum_of(tensor)
                if got != want:
                    raise KVTransferError(CHECKSUM_MISMATCH, (
                        f"KV frame {name} of {chunk.req_id!r} is corrupt: checksum {got:#018x}, "
                        f"sender said {want:#018x}"))

    def place(self, chunk: KVChunk, transfer: InboundTransfer) -> None:
        """Checks the chunk, then scatters it into the transfer's blocks."""
        self.check(chunk, transfer)
        transfer.state = TransferState.TRANSFERRING
        for layer in range(chunk.layer_start, chunk.layer_end):
            k_cache, v_cache = self.kv_caches[layer]
            k = chunk.tensors[f"k{layer}"].to(k_cache.device, non_blocking=True)
            v = chunk.tensors[f"v{layer}"].to(v_cache.device, non_blocking=True)
            if transfer.runs is not None:
                # Consecutive pages are one slice: one memcpy per run, no index arithmetic.
                for at, first, n in transfer.runs:
                    k_cache[first:first + n].copy_(k[at:at + n])
                    v_cache[first:first + n].copy_(v[at:at + n])
            else:
                kernels.scatter_kv(k_cache, v_cache, transfer.block_ids, k, v)
            transfer.layers_done.add(layer)
        if chunk.last:
            if len(transfer.layers_done) != self.layout.num_layers:
                missing = sorted(set(range(self.layout.num_layers)) - transfer.layers_done)
                raise KVTransferError(LAYOUT_MISMATCH, (
                    f"last KV chunk of {chunk.req_id!r} arrived with layers {missing[:8]} "
                    "never sent"))
            transfer.state = TransferState.DONE


def _fmt(layout: KVLayout) -> str:
    return (f"{layout.num_layers} layers x {layout.num_kv_heads} kv heads x head_dim "
            f"{layout.head_dim}, {layout.dtype}, block_size {layout.block_size}")
