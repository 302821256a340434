"""Decode attention straight from the paged KV cache (decode_attention.c), for the CPU.

``kernels.paged_decode_attention`` calls it on bfloat16 and float16 caches where it runs
(``why_not``): no window of the context, no gather copy, no float32 conversion of the
cache. Loads are exact in float32, every sum is float32, the output is rounded once
(module docstring of the C file). float32 caches keep torch's SDPA, which matches
transformers bit for bit; the kernel takes them when asked (tests).
"""
from __future__ import annotations

import ctypes
import functools

import torch

from pdserve.kernels import native

DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
MAX_GROUP = 16          # query heads per kv head (DA_MAX_GROUP)
MAX_HEAD_DIM = 256      # (16 * DA_MAX_DV), a multiple of 16

_P, _I, _L = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64


@functools.cache  # declaring the signature costs more than the call at batch 1
def _fn():
    return native.function("pdserve_decode_attention", [
        _P, _L, _L,                         # q, its sequence and head strides
        _P, _P, _I, _I, _I,                 # k_cache, v_cache, block_size, kv heads, head_dim
        _P, _L, _I, _P, _I,                 # block_tables, row stride, int64?, seq_lens, int64?
        _P, _I, _I, ctypes.c_float, _I,     # out, num_seqs, num_heads, scale, dtype
        _P, _L, _L, _P, _L, _L, _P,         # k_new, strides, v_new, strides, slots
    ])


def why_not(dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int,
            device: torch.device | str = "cpu") -> str | None:
    """None if the kernel can serve these shapes, else why not (one phrase)."""
    return native.attention_why_not(dtype, tuple(DTYPES), num_heads, num_kv_heads, head_dim,
                                    device, MAX_HEAD_DIM, MAX_GROUP)


def check_pages(k_cache: torch.Tensor, block_tables: torch.Tensor,
                seq_lens: torch.Tensor) -> None:
    """What the C kernel does not check, since it would cost a pass over the tables: every
    page a sequence reads lies in the cache, and no length is negative or past its table."""
    block_size, num_blocks = k_cache.shape[1], k_cache.shape[0]
    lens = seq_lens.long()
    if lens.numel() == 0:
        return
    if bool((lens < 0).any()):
        raise ValueError("seq_lens must not be negative")
    need = (lens + block_size - 1) // block_size                    # [B] pages read
    if int(need.max()) > block_tables.shape[1]:
        raise ValueError(f"seq_lens needs {int(need.max())} blocks of {block_size} tokens, "
                         f"but block_tables has {block_tables.shape[1]} columns")
    used = torch.arange(block_tables.shape[1])[None, :] < need[:, None]  # [B, max_blocks]
    pages = block_tables[used]
    if pages.numel() and (int(pages.min()) < 0 or int(pages.max()) >= num_blocks):
        raise IndexError(f"a block table names a block outside the cache's {num_blocks}")


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                     new_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
                     ) -> torch.Tensor:
    """kernels.paged_decode_attention's contract on CPU tensors, checked by the caller
    (``why_not`` and ``check_pages`` included): q [B, H, D] of the cache's dtype, any
    strides; returns [B, H, D] in that dtype, contiguous. ``new_kv``: (k, v [B, KVH, D]
    with a contiguous last dim, slot_mapping int64 [B], contiguous, -1 skips), stored into
    the cache first as ``store_kv`` would. (Every Python call here is counted: at batch 1
    the wrapper costs about as much as the kernel.)"""
    num_seqs, num_heads, head_dim = q.shape
    out = torch.empty(q.shape, dtype=q.dtype)                       # [B, H, D]
    if num_seqs == 0:
        return out
    q_strides = q.stride()
    if q_strides[2] != 1:
        q = q.contiguous()
        q_strides = q.stride()
    tables = block_tables if block_tables.stride(1) == 1 else block_tables.contiguous()
    if seq_lens.stride(0) != 1:
        seq_lens = seq_lens.contiguous()
    if new_kv is None:
        store = (None, 0, 0, None, 0, 0, None)
    else:
        k, v, slots = new_kv
        (k_s, k_h, _), (v_s, v_h, _) = k.stride(), v.stride()
        store = (k.data_ptr(), k_s, k_h, v.data_ptr(), v_s, v_h, slots.data_ptr())
    _, block_size, num_kv_heads, _ = k_cache.shape
    rc = _fn()(q.data_ptr(), q_strides[0], q_strides[1],
               k_cache.data_ptr(), v_cache.data_ptr(), block_size, num_kv_heads, head_dim,
               tables.data_ptr(), tables.stride(0), tables.dtype == torch.int64,
               seq_lens.data_ptr(), seq_lens.dtype == torch.int64, out.data_ptr(), num_seqs,
               num_heads, scale, DTYPES[q.dtype], *store)
    if rc == -2:
        raise ValueError(f"native decode attention: "
                         f"{why_not(q.dtype, num_heads, num_kv_heads, head_dim)}")
    if rc:
        raise MemoryError("pdserve_decode_attention: no memory for its task list")
    return out
