"""Causal attention of fresh prompts in bfloat16 on AVX512-BF16 (prefill_attention.c).

The CPU path of ``kernels.prefill_attention`` for bfloat16: flash-style (online softmax in
float32, blocks above the diagonal skipped), Q.K^T and P.V on ``_mm512_dpbf16_ps`` with
float32 accumulation. P is rounded to bfloat16 for P.V (``p_bf16=True``, the default) or
kept in float32 (``p_bf16=False``); the error of each against float32 is in
benchmarks/RESULTS.md and bounded in tests/unit/test_native_prefill_attention.py.
"""
from __future__ import annotations

import ctypes

import torch

from pdserve.kernels.native import function

MAX_HEAD_DIM = 256

_P, _I, _L = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64


def _attention():
    return function("bf16_prefill_attention",
                    [_P, _L, _L, _P, _L, _L, _P, _L, _L, _P, _L, _L, _P, _I, _I, _I, _I,
                     ctypes.c_float, _I])


def supports(head_dim: int, num_heads: int, num_kv_heads: int) -> bool:
    """Whether the kernel takes these shapes (else the caller keeps torch's SDPA)."""
    return head_dim % 16 == 0 and head_dim <= MAX_HEAD_DIM and num_heads % num_kv_heads == 0


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                      scale: float, p_bf16: bool = True) -> torch.Tensor:
    """q [T, H, D], k/v [T, KVH, D] bfloat16 with unit stride along D (any token and head
    strides: views of the fused qkv projection), cu_seqlens [num_seqs + 1] → [T, H, D]
    bfloat16. The caller has checked shapes, dtypes and offsets (``supports`` holds)."""
    assert q.dtype == k.dtype == v.dtype == torch.bfloat16
    assert q.stride(2) == 1 and k.stride(2) == 1 and v.stride(2) == 1
    out = torch.empty(q.shape, dtype=q.dtype)  # [T, H, D]
    cu = cu_seqlens.to(torch.int64).contiguous()
    num_seqs = cu.numel() - 1
    if q.shape[0] == 0 or num_seqs == 0:
        return out
    if _attention()(q.data_ptr(), q.stride(0), q.stride(1), k.data_ptr(), k.stride(0),
                    k.stride(1), v.data_ptr(), v.stride(0), v.stride(1), out.data_ptr(),
                    out.stride(0), out.stride(1), cu.data_ptr(), num_seqs, q.shape[1],
                    k.shape[1], q.shape[2], scale, int(p_bf16)):
        raise MemoryError("bf16_prefill_attention: no memory for the packed K/V")
    return out
