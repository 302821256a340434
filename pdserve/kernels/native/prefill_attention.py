"""Causal attention of prompts in bfloat16 on AVX512-BF16 (prefill_attention.c).

The CPU path of ``kernels.prefill_attention`` and ``kernels.paged_prefill_attention`` for
bfloat16 (``backend=None``): flash-style (online softmax in float32, blocks above the
diagonal skipped), Q.K^T and P.V on ``_mm512_dpbf16_ps`` with float32 accumulation. P is
rounded to bfloat16 for P.V (``p_bf16=True``, the default: the same error against float32
as torch's bfloat16 SDPA) or kept in float32 (``p_bf16=False``: a third less mean error,
25-35% more time); figures in benchmarks/RESULTS.md, the bound in
tests/unit/test_native_prefill_attention.py.
"""
from __future__ import annotations

import ctypes
import functools

import torch

from pdserve.kernels import native
from pdserve.kernels.native import function

MAX_HEAD_DIM = 256

_P, _I, _L = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64


@functools.cache
def _attention():
    return function("bf16_prefill_attention",
                    [_P, _L, _L, _P, _L, _L, _P, _L, _L, _P, _L, _L, _P, _I, _P, _P, _L, _I,
                     _I, _I, _I, ctypes.c_float, _I])


def why_not(dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int,
            device: torch.device | str = "cpu") -> str | None:
    """None if the kernel can serve these shapes, else why not (one phrase)."""
    return native.attention_why_not(dtype, (torch.bfloat16,), num_heads, num_kv_heads,
                                    head_dim, device, MAX_HEAD_DIM)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                      scale: float, p_bf16: bool = True) -> torch.Tensor:
    """Fresh prompts: q [T, H, D], k/v [T, KVH, D] bfloat16 with unit stride along D (any
    token and head strides: views of the fused qkv projection), cu_seqlens [num_seqs + 1]
    → [T, H, D] bfloat16. The caller has checked shapes, dtypes and offsets (``why_not``
    is None)."""
    _check(q, k, v)
    return _run(q, k, (k.stride(0), k.stride(1)), v, (v.stride(0), v.stride(1)), cu_seqlens,
                None, None, 0, scale, p_bf16)


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor,
                            block_tables: torch.Tensor, scale: float,
                            p_bf16: bool = True) -> torch.Tensor:
    """New tokens over their sequences' paged KV cache (``kernels.paged_prefill_attention``'s
    contract): q [T, H, D] unit stride along D, caches [num_blocks, block_size, KVH, D]
    contiguous, bfloat16. The caller has checked every length against the table and every
    page index the sequences use."""
    _check(q, k_cache, v_cache)
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("native paged prefill attention: the caches must be contiguous")
    kvh, d = k_cache.shape[2], k_cache.shape[3]
    return _run(q, k_cache, (kvh * d, d), v_cache, (kvh * d, d), cu_seqlens_q, seq_lens,
                block_tables, k_cache.shape[1], scale, p_bf16)


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """What the C kernel relies on and ``why_not`` promised (not an assert: ``python -O``
    must not turn a wrong call into a read past a buffer)."""
    d = q.shape[-1]
    if not (q.dtype == k.dtype == v.dtype == torch.bfloat16) \
            or not (q.stride(-1) == k.stride(-1) == v.stride(-1) == 1) \
            or d % 16 or d > MAX_HEAD_DIM or k.shape[-1] != d or v.shape[-1] != d \
            or q.shape[-2] % k.shape[-2]:
        raise ValueError(f"native prefill attention takes bfloat16 q, k, v with unit stride "
                         f"along a head_dim that is a multiple of 16 up to {MAX_HEAD_DIM}, "
                         f"and whole query groups per kv head; got q "
                         f"{str(q.dtype).removeprefix('torch.')} {list(q.shape)}, k "
                         f"{list(k.shape)}, v {list(v.shape)}")


def _run(q, k, k_strides, v, v_strides, cu_seqlens, seq_lens, block_tables, block_size,
         scale, p_bf16) -> torch.Tensor:
    out = torch.empty(q.shape, dtype=q.dtype)  # [T, H, D]
    cu = cu_seqlens.to(torch.int64).contiguous()
    num_seqs = cu.numel() - 1
    if q.shape[0] == 0 or num_seqs == 0:
        return out
    kv_lens = tables = None
    if seq_lens is not None:
        kv_lens = seq_lens.to(torch.int64).contiguous()
        tables = block_tables.to(torch.int64).contiguous()
    if _attention()(q.data_ptr(), q.stride(0), q.stride(1), k.data_ptr(), *k_strides,
                    v.data_ptr(), *v_strides, out.data_ptr(), out.stride(0), out.stride(1),
                    cu.data_ptr(), num_seqs,
                    None if kv_lens is None else kv_lens.data_ptr(),
                    None if tables is None else tables.data_ptr(),
                    0 if tables is None else tables.stride(0), block_size,
                    q.shape[1], k.shape[-2], q.shape[2], scale, int(p_bf16)):
        raise MemoryError("bf16_prefill_attention: no memory for the packed K/V")
    return out
