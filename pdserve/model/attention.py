"""Attention over the paged KV cache, routed through ``pdserve.kernels``.

The metadata is built once per step by ``pdserve.engine.inputs.build_model_inputs``
and handed to every layer as an argument (no module global), so a step's
inputs are a plain value that can be prepared while another step runs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve import kernels

# What the whole batch is; decides which kernel runs.
DECODE = "decode"          # one new token per sequence, all with cached context
PREFILL = "prefill"        # every sequence starts at position 0: no cached context
MIXED = "mixed"            # prefill chunks with cached prefixes, maybe decode tokens


@dataclass(frozen=True)
class AttentionMetadata:
    kind: str
    cu_seqlens_q: torch.Tensor   # int32 [B + 1]: new-token offsets of each sequence
    seq_lens: torch.Tensor       # int32 [B]: tokens each sequence attends to (cached + new)
    slot_mapping: torch.Tensor   # int64 [T]: cache slot of each new token, -1 to skip
    block_tables: torch.Tensor   # int32 [B, max_blocks]
    # DECODE on the CPU: the native kernel reads the pages and stores the new K/V itself
    # (kernels.native.decode_attention); no gather, no windows
    decode_native: bool = False
    # DECODE on the CPU: the torch decode attention's page list and mask, once per step
    decode_gather: kernels.DecodeGather | None = None
    # DECODE on the CPU: each layer's window of the batch's context, kept across steps
    # (engine/decode_window.py); None: gather the pages
    decode_windows: tuple[kernels.DecodeWindow, ...] | None = None
    # No slot_mapping entry is -1 (a model step's inputs): storing K/V need not look
    all_slots: bool = False


class PagedAttention(torch.nn.Module):
    """Stores the new tokens' K/V into the layer's pages, then attends."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, layer: int = 0):
        super().__init__()
        self.layer = layer  # picks this layer's decode window
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim ** -0.5

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata, kv_cache: tuple[torch.Tensor, torch.Tensor] | None,
                kv: torch.Tensor | None = None) -> torch.Tensor:
        """q [T, H, D]; k, v [T, KVH, D]; ``kv``: k and v side by side, [T, 2 KVH, D], where
        the caller holds them so (the fused qkv output on the CPU): a decode window appends
        them in one copy, else they are put side by side for it."""
        if kv_cache is None:
            if meta.kind != PREFILL:
                raise ValueError("attention without a KV cache can only run a fresh prefill")
            return kernels.prefill_attention(q, k, v, meta.cu_seqlens_q, self.scale)
        k_cache, v_cache = kv_cache
        # The model and the step's inputs built every argument of the calls made in every
        # layer of every step: not checked again (kernels' docstring)
        if meta.decode_native:  # stores the new K/V and attends in one call
            return kernels.paged_decode_attention(
                q, k_cache, v_cache, meta.block_tables, meta.seq_lens, self.scale,
                native=True, new_kv=(k, v, meta.slot_mapping), check=False)
        kernels.store_kv(k, v, k_cache, v_cache, meta.slot_mapping, all_slots=meta.all_slots,
                         check=False)
        if meta.kind == PREFILL:
            return kernels.prefill_attention(q, k, v, meta.cu_seqlens_q, self.scale)
        if meta.kind == DECODE:
            if kv is None and meta.decode_windows is not None:
                kv = torch.cat([k, v], dim=1)                             # [T, 2 KVH, D]
            return kernels.paged_decode_attention(
                q, k_cache, v_cache, meta.block_tables, meta.seq_lens, self.scale,
                gather=meta.decode_gather,
                window=None if meta.decode_windows is None else meta.decode_windows[self.layer],
                kv=kv, check=False)
        return kernels.paged_prefill_attention(
            q, k_cache, v_cache, meta.cu_seqlens_q, meta.seq_lens, meta.block_tables, self.scale)
