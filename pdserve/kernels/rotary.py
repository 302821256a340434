"""Rotary position embedding in the rotate-half (GPT-NeoX / transformers Llama) layout.

The torch reference repeats transformers' apply_rotary_pos_emb operation for
operation (cos/sin cast to q's dtype, products and sum in q's dtype), so with
a cos/sin table built as transformers builds it the CPU path is bit-identical.
The Triton kernel loads into float32 but rounds cos/sin, each product and the
sum to q's dtype just as those torch ops do, so it gives the same bits too.
(Under TRITON_INTERPRET, float32 -> bfloat16 casts truncate instead of
rounding to nearest, so there bfloat16 results can be an ulp off.) ``rotate_`` on a
bfloat16 CPU tensor is one native call (kernels/native/decode_ops.c, where
``native.available()``) rounding each product and the sum as its torch ops do: the same
bits.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.kernels._dispatch import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_same_dtype,
    check_tensor,
    last_dim_contiguous,
    launch,
    pick_backend,
    tl,
    triton,
)
from pdserve.kernels.native import decode_ops


def apply_rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                 cos_sin_cache: torch.Tensor, backend: str | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, num_heads, head_dim] and k [T, num_kv_heads, head_dim] by their positions.

    positions int64 (or int32) [T]; cos_sin_cache [max_position, head_dim] holding
    cos(pos * inv_freq) in [:, :head_dim // 2] and sin in [:, head_dim // 2:]
    (float32, as transformers computes it). The whole head is rotated (no partial
    rotary). Returns new contiguous (q_out, k_out); q and k may have any strides.
    """
    dims: dict[str, tuple[int, str]] = {}
    check_tensor("q", q, "[T, num_heads, head_dim]", FLOAT_DTYPES, dims)
    check_tensor("k", k, "[T, num_kv_heads, head_dim]", FLOAT_DTYPES, dims, q.device)
    check_same_dtype("k", k, "q", q)
    check_tensor("positions", positions, "[T]", INDEX_DTYPES, dims, q.device)
    check_tensor("cos_sin_cache", cos_sin_cache, "[max_position, head_dim]", FLOAT_DTYPES, dims,
                 q.device)
    if q.shape[2] % 2:
        raise ValueError(f"head_dim must be even for rotary embedding, got {q.shape[2]}")
    if pick_backend(backend, q.device) == "torch":
        return _rotary_torch(q, k, positions, cos_sin_cache)
    return _rotary_triton(q, k, positions.contiguous(), cos_sin_cache.contiguous())


@dataclass(frozen=True)
class RotaryTables:
    """One step's rotation on the torch path, built once for every layer (``rotary_tables``):
    30 layers used to look up and cast the same cos/sin each. ``sin`` has rotate_half's
    sign folded in (negating is exact), so that ``x * cos + x.roll(D / 2, -1) * sin`` (the
    two halves of each head swapped) is transformers' ``x * cos + rotate_half(x) * sin``
    bit for bit."""
    cos: torch.Tensor   # [T, 1, D] in the activations' dtype
    sin: torch.Tensor   # [T, 1, D] in the activations' dtype: -sin in the first half


def rotary_tables(positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                  dtype: torch.dtype) -> RotaryTables | None:
    """The step's ``RotaryTables`` for ``rotate_``, or None where the Triton kernel runs
    (``apply_rotary``: it reads the cache itself). Arguments as ``apply_rotary``'s."""
    dims: dict[str, tuple[int, str]] = {}
    check_tensor("positions", positions, "[T]", INDEX_DTYPES, dims)
    check_tensor("cos_sin_cache", cos_sin_cache, "[max_position, head_dim]", FLOAT_DTYPES, dims,
                 positions.device)
    if pick_backend(None, positions.device) != "torch":
        return None
    cos, sin = cos_sin_cache.index_select(0, positions).chunk(2, dim=-1)  # [T, D/2] each
    return RotaryTables(torch.cat((cos, cos), dim=-1).to(dtype)[:, None, :],
                        torch.cat((-sin, sin), dim=-1).to(dtype)[:, None, :])


def rotate_(x: torch.Tensor, tables: RotaryTables) -> torch.Tensor:
    """x [T, N, D] rotated by its tokens' positions, in place (x is returned). N may hold
    a layer's q heads and k heads side by side (one call for both; x any strides with a
    unit last one): in place, they stay beside the layer's v in its fused qkv output.
    bfloat16 on the CPU: one native call (kernels/native/decode_ops.c), the same bits."""
    if decode_ops.runs(x) and tables.cos.dtype is torch.bfloat16:
        return decode_ops.rotate_(x, tables.cos, tables.sin)
    return _rotate_torch(x, tables)


def _rotate_torch(x: torch.Tensor, tables: RotaryTables) -> torch.Tensor:
    # roll, not index_select: the same copy, 16x faster at a prefill's 2,048 tokens
    rotated = x.roll(x.shape[-1] // 2, -1).mul_(tables.sin)              # [T, N, D]
    return x.mul_(tables.cos).add_(rotated)  # x * cos + that: the sum commutes, same bits


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _rotary_torch(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                  cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = cos_sin_cache.index_select(0, positions).chunk(2, dim=-1)  # [T, D/2] each
    cos = torch.cat((cos, cos), dim=-1).to(q.dtype)[:, None, :]  # [T, 1, D]
    sin = torch.cat((sin, sin), dim=-1).to(q.dtype)[:, None, :]  # [T, 1, D]
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotary_triton(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                   cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # [T, H, D]
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)  # [T, KVH, D]
    if num_tokens == 0:
        return q_out, k_out
    q, k = last_dim_contiguous(q), last_dim_contiguous(k)
    launch(_rotary_kernel, (num_tokens,),
        q, k, positions, cos_sin_cache, q_out, k_out,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin_cache.stride(0),
        num_heads, num_kv_heads, head_dim // 2,
        BLOCK_H=triton.next_power_of_2(max(num_heads, num_kv_heads)),
        BLOCK_HALF=triton.next_power_of_2(head_dim // 2),
        # No fused multiply-adds: the products are rounded as torch's separate ops round
        # them, so float32 keeps transformers' bits on the GPU too.
        enable_fp_fusion=False,
    )
    return q_out, k_out


if triton is not None:

    @triton.jit
    def _rotate(x_ptr, out_ptr, stride_t, stride_h, stride_ot, stride_oh, token, num_heads, half,
                cos, sin, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
        offs_h = tl.arange(0, BLOCK_H)
        offs = tl.arange(0, BLOCK_HALF)
        mask = (offs_h < num_heads)[:, None] & (offs < half)[None, :]
        src = x_ptr + token * stride_t + offs_h[:, None] * stride_h + offs[None, :]
        x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)  # [H, D/2]
        x2 = tl.load(src + half, mask=mask, other=0.0).to(tl.float32)  # [H, D/2]
        dst = out_ptr + token * stride_ot + offs_h[:, None] * stride_oh + offs[None, :]
        # Round each product to the output dtype before the sum, as torch's ops in
        # that dtype do: the same bits as transformers in bf16/fp16 too.
        ty = out_ptr.dtype.element_ty
        x1_cos = (x1 * cos[None, :]).to(ty).to(tl.float32)
        x2_sin = (x2 * sin[None, :]).to(ty).to(tl.float32)
        x2_cos = (x2 * cos[None, :]).to(ty).to(tl.float32)
        x1_sin = (x1 * sin[None, :]).to(ty).to(tl.float32)
        tl.store(dst, (x1_cos - x2_sin).to(ty), mask=mask)
        tl.store(dst + half, (x2_cos + x1_sin).to(ty), mask=mask)

    @triton.jit
    def _rotary_kernel(q_ptr, k_ptr, positions_ptr, cache_ptr, q_out_ptr, k_out_ptr,
                       stride_qt, stride_qh, stride_kt, stride_kh, stride_cache,
                       num_heads, num_kv_heads, half,
                       BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
        token = tl.program_id(0).to(tl.int64)
        pos = tl.load(positions_ptr + token).to(tl.int64)
        offs = tl.arange(0, BLOCK_HALF)
        mask = offs < half
        # transformers casts cos/sin to the activation dtype before using them.
        ty = q_out_ptr.dtype.element_ty
        cos = tl.load(cache_ptr + pos * stride_cache + offs, mask=mask, other=0.0)
        sin = tl.load(cache_ptr + pos * stride_cache + half + offs, mask=mask, other=0.0)
        cos = cos.to(ty).to(tl.float32)
        sin = sin.to(ty).to(tl.float32)
        # Outputs are new contiguous tensors: [T, H, D] strides (H * D, D, 1).
        _rotate(q_ptr, q_out_ptr, stride_qt, stride_qh, num_heads * half * 2, half * 2, token,
                num_heads, half, cos, sin, BLOCK_H, BLOCK_HALF)
        _rotate(k_ptr, k_out_ptr, stride_kt, stride_kh, num_kv_heads * half * 2, half * 2, token,
                num_kv_heads, half, cos, sin, BLOCK_H, BLOCK_HALF)
