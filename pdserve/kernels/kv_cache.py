"""Moving K/V into, out of and between the paged cache.

``store_kv`` runs in every layer of every step, writing the new tokens' K/V
into their slots. ``gather_kv`` / ``scatter_kv`` copy whole pages to and from
a contiguous buffer: that buffer is what a prefill node sends and a decode
node receives, so the wire never sees the cache's scattered layout.

All three only copy, so both backends give the same bits. Slot and block ids
are not range-checked on the Triton path (that would need a device sync);
the torch path raises on out-of-range ids.
"""
from __future__ import annotations

import torch

from pdserve.kernels._dispatch import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_contiguous,
    check_same_dtype,
    check_tensor,
    last_dim_contiguous,
    launch,
    pick_backend,
    tl,
    triton,
)

_CACHE_SHAPE = "[num_blocks, block_size, num_kv_heads, head_dim]"


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, backend: str | None = None,
             all_slots: bool = False, check: bool = True) -> None:
    """Write token t's K/V to slot ``slot_mapping[t]`` (= block * block_size + offset), in place.

    k, v [T, num_kv_heads, head_dim], any strides (views of a fused qkv are fine);
    k_cache, v_cache [num_blocks, block_size, num_kv_heads, head_dim], contiguous,
    of k's dtype; slot_mapping int32/int64 [T], -1 skips the token. ``all_slots``: the
    caller knows that no entry is -1 (a model step's, AttentionMetadata.all_slots): the
    torch path then skips looking for one, a host sync in every layer. A slot past the
    cache still raises there (index_copy_ checks). ``check``: False skips the argument
    checks (the package docstring).
    """
    if check:
        dims: dict[str, tuple[int, str]] = {}
        check_tensor("k", k, "[T, num_kv_heads, head_dim]", FLOAT_DTYPES, dims)
        check_tensor("v", v, "[T, num_kv_heads, head_dim]", FLOAT_DTYPES, dims, k.device)
        check_tensor("k_cache", k_cache, _CACHE_SHAPE, FLOAT_DTYPES, dims, k.device)
        check_tensor("v_cache", v_cache, _CACHE_SHAPE, FLOAT_DTYPES, dims, k.device)
        check_tensor("slot_mapping", slot_mapping, "[T]", INDEX_DTYPES, dims, k.device)
        for name, t in (("v", v), ("k_cache", k_cache), ("v_cache", v_cache)):
            check_same_dtype(name, t, "k", k)
        check_contiguous("k_cache", k_cache)
        check_contiguous("v_cache", v_cache)
    if pick_backend(backend, k.device) == "torch":
        slots = slot_mapping if slot_mapping.dtype == torch.int64 else slot_mapping.long()
        if not all_slots:
            keep = slot_mapping >= 0  # [T]
            if not bool(keep.all()):  # no boolean-mask copies when every token has a slot
                slots, k, v = slots[keep], k[keep], v[keep]  # [T']
        num_kv_heads, head_dim = k.shape[1:]
        k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, k)
        v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, v)
        return
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    k, v = last_dim_contiguous(k), last_dim_contiguous(v)
    slot_mapping = slot_mapping.contiguous()
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(3) == 1
    launch(_store_kv_kernel, (num_tokens,),
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(1), k_cache.stride(2), num_kv_heads, head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
    )


def gather_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, block_ids: torch.Tensor,
              backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Copy pages ``block_ids`` out: (k, v), each [len(block_ids), block_size, num_kv_heads,
    head_dim], contiguous. block_ids int32/int64 [n]."""
    _check_pages(k_cache, v_cache, block_ids)
    if pick_backend(backend, k_cache.device) == "torch":
        return k_cache.index_select(0, block_ids), v_cache.index_select(0, block_ids)
    k = k_cache.new_empty((block_ids.shape[0], *k_cache.shape[1:]))
    v = v_cache.new_empty((block_ids.shape[0], *v_cache.shape[1:]))
    _copy_pages(k_cache, v_cache, k, v, block_ids.contiguous(), gather=True)
    return k, v


def scatter_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, block_ids: torch.Tensor,
               k: torch.Tensor, v: torch.Tensor, backend: str | None = None) -> None:
    """Inverse of ``gather_kv``: write page i of k/v into cache page ``block_ids[i]``, in place.

    k, v [len(block_ids), block_size, num_kv_heads, head_dim] of the cache's dtype
    (made contiguous if they are not). block_ids must not repeat.
    """
    dims = _check_pages(k_cache, v_cache, block_ids)
    dims["num_blocks"] = (block_ids.shape[0], "block_ids")
    check_tensor("k", k, _CACHE_SHAPE, FLOAT_DTYPES, dims, k_cache.device)
    check_tensor("v", v, _CACHE_SHAPE, FLOAT_DTYPES, dims, k_cache.device)
    check_same_dtype("k", k, "k_cache", k_cache)
    check_same_dtype("v", v, "k_cache", k_cache)
    if pick_backend(backend, k_cache.device) == "torch":
        ids = block_ids.long()
        k_cache.index_copy_(0, ids, k)
        v_cache.index_copy_(0, ids, v)
        return
    _copy_pages(k.contiguous(), v.contiguous(), k_cache, v_cache, block_ids.contiguous(),
                gather=False)


def _check_pages(k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_ids: torch.Tensor) -> dict[str, tuple[int, str]]:
    dims: dict[str, tuple[int, str]] = {}
    check_tensor("k_cache", k_cache, _CACHE_SHAPE, FLOAT_DTYPES, dims)
    check_tensor("v_cache", v_cache, _CACHE_SHAPE, FLOAT_DTYPES, dims, k_cache.device)
    check_same_dtype("v_cache", v_cache, "k_cache", k_cache)
    check_contiguous("k_cache", k_cache)
    check_contiguous("v_cache", v_cache)
    check_tensor("block_ids", block_ids, "[n]", INDEX_DTYPES, {}, k_cache.device)
    return {name: dims[name] for name in ("block_size", "num_kv_heads", "head_dim")}


def _copy_pages(src_k: torch.Tensor, src_v: torch.Tensor, dst_k: torch.Tensor, dst_v: torch.Tensor,
                block_ids: torch.Tensor, *, gather: bool) -> None:
    if block_ids.shape[0] == 0:
        return
    page_numel = src_k[0].numel()
    block = min(4096, triton.next_power_of_2(page_numel))
    grid = (block_ids.shape[0], triton.cdiv(page_numel, block))
    launch(_copy_pages_kernel, grid, src_k, src_v, dst_k, dst_v, block_ids, page_numel,
           GATHER=gather, BLOCK=block)


if triton is not None:

    @triton.jit
    def _store_kv_kernel(
        k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
        stride_kt, stride_kh, stride_vt, stride_vh,
        stride_cs, stride_ch,  # slot and head strides of the (contiguous) caches
        num_kv_heads, head_dim,
        BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        token = tl.program_id(0).to(tl.int64)
        slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
        offs_h = tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, BLOCK_D)
        num_heads_to_write = tl.where(slot >= 0, num_kv_heads, 0)  # slot -1: write nothing
        mask = (offs_h < num_heads_to_write)[:, None] & (offs_d < head_dim)[None, :]
        # Pages are contiguous, so slot * slot stride lands on (block, offset).
        dst = slot * stride_cs + offs_h[:, None] * stride_ch + offs_d[None, :]
        k = tl.load(k_ptr + token * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :],
                    mask=mask)
        tl.store(k_cache_ptr + dst, k, mask=mask)
        v = tl.load(v_ptr + token * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :],
                    mask=mask)
        tl.store(v_cache_ptr + dst, v, mask=mask)

    @triton.jit
    def _copy_pages_kernel(src_k_ptr, src_v_ptr, dst_k_ptr, dst_v_ptr, block_ids_ptr, page_numel,
                           GATHER: tl.constexpr, BLOCK: tl.constexpr):
        i = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < page_numel
        page = tl.load(block_ids_ptr + i).to(tl.int64)
        if GATHER:  # cache page -> row i of the buffer
            src = page * page_numel + offs
            dst = i * page_numel + offs
        else:  # row i of the buffer -> cache page
            src = i * page_numel + offs
            dst = page * page_numel + offs
        tl.store(dst_k_ptr + dst, tl.load(src_k_ptr + src, mask=mask), mask=mask)
        tl.store(dst_v_ptr + dst, tl.load(src_v_ptr + src, mask=mask), mask=mask)
