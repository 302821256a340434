"""Decode attention: one new query token per sequence over its paged KV cache.

This is the step that runs every token, so the Triton kernel gives each
(sequence, kv head) pair one program that reads every K/V page once for all
the query heads that share it (GQA), with an online softmax over tiles of
positions. Each position's page is looked up on its own, so any block size
works and pages can lie anywhere in the cache.

Numerics: the torch reference gathers the pages into one padded batch and
calls torch's SDPA with a padding mask (none when no sequence is shorter than
the longest), the call transformers' "sdpa" attention makes for a decode step.
In float32, when every sequence has the batch's longest length (a batch of
one, say) that is bit for bit what transformers computes; padding changes the
blocking inside SDPA, so shorter sequences can differ by an ulp (about 1e-7).
bfloat16 and float16 are computed in float32 and rounded once, like the
Triton kernel, not in the input dtype as transformers does. On the CPU they go to the
native kernel over the pages where it runs (``native``; kernels/native/decode_attention.c:
the window and SDPA below take 1.9-2.9 times as long a layer, benchmarks/RESULTS.md), and
the SDPA path serves float32 and CPUs without it. There torch's CPU SDPA
kernel runs 5-8 times slower in bfloat16 than in float32 at a decode step's
shapes (0.32 ms against 1.83 a layer for 16 sequences of 320 tokens, AVX512-BF16
EPYC; benchmarks/RESULTS.md), and the float32 copies cost a fraction of that. A decode
window (``DecodeWindow``) is held in float32 for that reason, so that only each step's new
token is converted, not the whole context in every layer. The Triton kernel
loads in the input dtype and computes in float32: Q.K^T with exact products
(tf32 holds bf16/fp16 values exactly), the softmax in float32, P@V with P
rounded to tf32 (full float32 for float32 inputs), one rounding on store.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.kernels._dispatch import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_contiguous,
    check_gqa,
    check_paged_cache,
    check_same_dtype,
    check_scale,
    check_tensor,
    head_block,
    last_dim_contiguous,
    launch,
    pick_backend,
    sdpa,
    tl,
    triton,
)
from pdserve.kernels.kv_cache import store_kv
from pdserve.kernels.native import decode_attention as native_decode

_LOG2E = 1.4426950408889634


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           backend: str | None = None,
                           gather: DecodeGather | None = None,
                           window: DecodeWindow | None = None,
                           kv: torch.Tensor | None = None, native: bool | None = None,
                           new_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                           check: bool = True) -> torch.Tensor:
    """Attention of each sequence's newest token over its first ``seq_lens[i]`` cached tokens.

    q [num_seqs, num_heads, head_dim]; k_cache, v_cache [num_blocks, block_size,
    num_kv_heads, head_dim] (contiguous); block_tables int32/int64 [num_seqs,
    max_blocks_per_seq]; seq_lens int32/int64 [num_seqs], counting the new token,
    whose K/V must already be in the cache. Block-table entries past a
    sequence's last block are never read (any value). A sequence with
    seq_lens 0 (batch padding) gets zeros. Returns [num_seqs, num_heads, head_dim]
    in q's dtype. q may have any strides.

    ``gather``: ``decode_gather(block_tables, seq_lens, block_size)``, built once for
    all the layers of a step; the torch backend builds it per call without it, and the
    Triton kernel reads the tables itself.

    ``window`` (torch backend, with ``gather``): this layer's context kept contiguous
    across steps (``DecodeWindow``), brought up to date and attended over instead of
    gathering every page again. The Triton kernel reads the pages and ignores it.
    ``kv`` [num_seqs, 2 * num_kv_heads, head_dim] (K's heads, then V's; any strides): the
    new tokens' K and V as they were stored, which a window that appends (``WindowFill``'s
    ``rows``) takes from here rather than reading its cache slots back.

    ``native`` (torch backend): the C kernel that reads the pages itself
    (``kernels.native.decode_attention``; ``gather``, ``window`` and ``kv`` unused). None:
    for bfloat16 and float16 where it runs (``native_decode_why_not``) and no ``window`` is
    given, torch's SDPA otherwise (float32: transformers' bits); False: SDPA; True: the
    kernel (a window then stays as it was), raising where it cannot run (not asked with
    ``check=False``: the caller asked ``native_decode_why_not`` once).
    ``new_kv``: (k, v [num_seqs, num_kv_heads, head_dim], slot_mapping [num_seqs], -1
    skips): the new tokens' K/V, stored into their slots first, as ``store_kv`` would; the
    native kernel does it in the same call.

    ``check``: False skips the argument checks, the window's too (the package docstring).
    """
    if check:
        dims: dict[str, tuple[int, str]] = {}
        check_tensor("q", q, "[num_seqs, num_heads, head_dim]", FLOAT_DTYPES, dims)
        check_paged_cache(q, k_cache, v_cache, dims)
        check_tensor("block_tables", block_tables, "[num_seqs, max_blocks_per_seq]",
                     INDEX_DTYPES, dims, q.device)
        check_tensor("seq_lens", seq_lens, "[num_seqs]", INDEX_DTYPES, dims, q.device)
        check_gqa(q.shape[1], k_cache.shape[2])
        check_contiguous("k_cache", k_cache)
        check_contiguous("v_cache", v_cache)
        scale = check_scale(scale)
        if new_kv is not None:
            _check_new_kv(new_kv, k_cache, v_cache, dims)
    torch_backend = pick_backend(backend, q.device) == "torch"
    if torch_backend and _use_native(native if window is None else bool(native), q, k_cache,
                                     check):
        if check:
            native_decode.check_pages(k_cache, block_tables, seq_lens)
        if new_kv is not None:
            k, v, slots = new_kv
            new_kv = (last_dim_contiguous(k), last_dim_contiguous(v),
                      slots if slots.dtype == torch.int64 else slots.long())
            if check:
                new_kv = (*new_kv[:2], new_kv[2].contiguous())
        return native_decode.decode_attention(q, k_cache, v_cache, block_tables, seq_lens,
                                              scale, new_kv)
    if new_kv is not None:
        store_kv(*new_kv[:2], k_cache, v_cache, new_kv[2], check=False)
    if torch_backend:
        if gather is None:
            gather = decode_gather(block_tables, seq_lens, k_cache.shape[1])
        if window is not None and check:
            window.check(q, k_cache, gather.max_len, kv)
        return _decode_torch(q, k_cache, v_cache, gather, scale, window, kv)
    return _decode_triton(q, k_cache, v_cache, block_tables.contiguous(), seq_lens.contiguous(),
                          scale)


def native_decode_why_not(dtype: torch.dtype, num_heads: int, num_kv_heads: int,
                          head_dim: int, device: torch.device | str) -> str | None:
    """None if ``paged_decode_attention(native=None)`` runs the native kernel for a cache of
    ``dtype`` on ``device``, else why not (one phrase, for the start-up log)."""
    if dtype == torch.float32:
        return "float32 keeps torch's SDPA (transformers' bits)"
    return native_decode.why_not(dtype, num_heads, num_kv_heads, head_dim, device)


def _use_native(native: bool | None, q: torch.Tensor, k_cache: torch.Tensor,
                check: bool) -> bool:
    if native is False:
        return False
    if native and not check:
        return True
    num_kv_heads, head_dim = k_cache.shape[2:]
    if native is None:
        return native_decode_why_not(q.dtype, q.shape[1], num_kv_heads, head_dim,
                                     q.device) is None
    why = native_decode.why_not(q.dtype, q.shape[1], num_kv_heads, head_dim, q.device)
    if why is not None:
        raise RuntimeError(f"native decode attention cannot run: {why}")
    return True


def _check_new_kv(new_kv: object, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  dims: dict[str, tuple[int, str]]) -> None:
    if not isinstance(new_kv, tuple) or len(new_kv) != 3:
        raise ValueError("new_kv must be a tuple (k, v, slot_mapping)")
    k, v, slots = new_kv
    check_tensor("k", k, "[num_seqs, num_kv_heads, head_dim]", FLOAT_DTYPES, dims,
                 k_cache.device)
    check_tensor("v", v, "[num_seqs, num_kv_heads, head_dim]", FLOAT_DTYPES, dims,
                 k_cache.device)
    check_tensor("slot_mapping", slots, "[num_seqs]", INDEX_DTYPES, dims, k_cache.device)
    check_same_dtype("k", k, "k_cache", k_cache)
    check_same_dtype("v", v, "v_cache", v_cache)
    slots = slots.long()
    if slots.numel() and (int(slots.min()) < -1 or int(slots.max()) >= k_cache.shape[0]
                          * k_cache.shape[1]):
        raise IndexError(f"slot_mapping must hold -1 or slots below the cache's "
                         f"{k_cache.shape[0] * k_cache.shape[1]}")


@dataclass(frozen=True)
class DecodeGather:
    """What the torch decode attention derives from the block tables and lengths. It is
    the same in every layer of a step, so a model builds it once per step
    (``decode_gather``) and hands it to each layer's call: 30 layers used to redo these
    few small ops and a host sync each."""
    blocks: torch.Tensor        # int64 [B * NB]: each sequence's pages, unused ones → block 0
    max_len: int                # L: the longest sequence's tokens
    mask: torch.Tensor | None   # bool [B, 1, 1, L]; None when every sequence has L tokens
    empty: torch.Tensor | None  # bool [B]: sequences of length 0; None when there are none


@dataclass(frozen=True)
class WindowFill:
    """How one decode step brings every layer's window up to date (the same for all
    layers). Either ``pages`` [B * cap / block_size] int64: refill the window from these
    cache pages (sequence b's context is its pages in order; the batch changed), or ``rows``
    [B * 2 * KVH] int64 (= (b * 2 * KVH + j) * cap + seq_lens[b] - 1: the window seen as
    [B * 2 * KVH * cap, head_dim]): write each sequence's new K and V there, the rest of the
    window being the earlier steps'."""
    pages: torch.Tensor | None = None
    rows: torch.Tensor | None = None


@dataclass(frozen=True)
class DecodeWindow:
    """One layer's decode window: ``kv`` float32 [B, 2, num_kv_heads, cap, head_dim],
    contiguous, [b, 0, h] holding K head h of sequence b at positions 0..seq_lens[b]-1 and
    [b, 1, h] its V (what lies past it is never attended), head-major as SDPA reads it.
    float32 whatever the activations' dtype: SDPA runs in float32 (module docstring). A
    decode step on the CPU otherwise copies every sequence's whole context out of its
    pages in every layer; a window kept across steps takes one new token per sequence
    instead. ``pdserve.engine.decode_window`` decides when that is valid."""
    kv: torch.Tensor
    fill: WindowFill

    def check(self, q: torch.Tensor, k_cache: torch.Tensor, max_len: int,
              kv: torch.Tensor | None) -> None:
        cap = self.kv.shape[3] if self.kv.dim() == 5 else -1
        num_kv_heads, head_dim = k_cache.shape[2:]
        shape = (q.shape[0], 2, num_kv_heads, cap, head_dim)
        if tuple(self.kv.shape) != shape or self.kv.dtype != torch.float32 \
                or not self.kv.is_contiguous():
            raise ValueError(f"a decode window must be float32 [num_seqs, 2, num_kv_heads, cap, "
                             f"head_dim] = {list(shape)}, contiguous; got "
                             f"{str(self.kv.dtype).removeprefix('torch.')} "
                             f"{list(self.kv.shape)}")
        if cap < max_len or cap % k_cache.shape[1]:
            raise ValueError(f"decode window holds {cap} positions: it must be a multiple "
                             f"of the block size {k_cache.shape[1]} and at least the longest "
                             f"sequence's {max_len}")
        if (self.fill.pages is None) == (self.fill.rows is None):
            raise ValueError("a window fill takes either pages or rows")
        if self.fill.rows is not None:
            check_tensor("kv", kv, "[num_seqs, 2 * num_kv_heads, head_dim]", FLOAT_DTYPES,
                         {"num_seqs": (q.shape[0], "q"),
                          "2 * num_kv_heads": (2 * num_kv_heads, "k_cache"),
                          "head_dim": (head_dim, "k_cache")}, q.device)
            check_same_dtype("kv", kv, "q", q)


def decode_gather(block_tables: torch.Tensor, seq_lens: torch.Tensor,
                  block_size: int) -> DecodeGather:
    """block_tables [B, max_blocks], seq_lens [B] (checked by the caller) → DecodeGather."""
    lens = seq_lens.long()
    max_len = int(lens.max()) if lens.numel() else 0
    num_blocks = -(-max_len // block_size)
    if num_blocks > block_tables.shape[1]:
        raise ValueError(f"seq_lens needs {num_blocks} blocks of {block_size} tokens for "
                         f"{max_len} tokens, but block_tables has {block_tables.shape[1]} columns")
    blocks = page_list(block_tables, lens, block_size, num_blocks)  # [B * NB]
    mask = empty = None
    if max_len and bool((lens < max_len).any()):
        mask = (torch.arange(max_len, device=lens.device)[None, :]
                < lens[:, None])[:, None, None, :]  # [B, 1, 1, L]
        empty = lens == 0
        if not bool(empty.any()):
            empty = None
    return DecodeGather(blocks, max_len, mask, empty)


def page_list(block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int,
              per_row: int) -> torch.Tensor:
    """Each sequence's first ``per_row`` pages in order, int64 [B * per_row]. Entries past
    its last block (any value in a block table, or past the table's width) become block
    0, which is never attended."""
    lens = seq_lens.long()
    width = min(per_row, block_tables.shape[1])
    cols = torch.arange(per_row, device=lens.device)
    used = cols[None, :] < (lens[:, None] + block_size - 1) // block_size  # [B, per_row]
    table = block_tables[:, :width].long()
    if width < per_row:
        table = torch.nn.functional.pad(table, (0, per_row - width))
    return torch.where(used, table, 0).flatten()


def _fill_window(k_cache: torch.Tensor, v_cache: torch.Tensor, window: DecodeWindow,
                 kv: torch.Tensor | None) -> None:
    win, fill = window.kv, window.fill  # [B, 2, KVH, cap, D]
    num_seqs, _, num_kv_heads, cap, head_dim = win.shape
    if fill.pages is not None:  # the pages in token order, then head-major into the window
        for i, cache in enumerate((k_cache, v_cache)):
            pages = cache.index_select(0, fill.pages)  # [B * cap / bs, bs, KVH, D]
            win[:, i].copy_(pages.view(num_seqs, cap, num_kv_heads, head_dim).transpose(1, 2))
    else:  # rows (b, j) of the new tokens' [B * 2 * KVH, D], converted to float32 here
        win.view(-1, head_dim).index_copy_(0, fill.rows, _float32(kv).reshape(-1, head_dim))


def _float32(t: torch.Tensor) -> torch.Tensor:
    # A dtype test in Python, not a .float() dispatched to return t itself in float32
    return t if t.dtype == torch.float32 else t.float()


def _like(t: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == other.dtype else t.to(other.dtype)


def _decode_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  gather: DecodeGather, scale: float, window: DecodeWindow | None = None,
                  kv: torch.Tensor | None = None) -> torch.Tensor:
    num_seqs = q.shape[0]
    if gather.max_len == 0:
        return q.new_zeros(q.shape)
    if window is not None:
        _fill_window(k_cache, v_cache, window, kv)
        k, v = window.kv[:, :, :, :gather.max_len].unbind(1)  # [B, KVH, L, D] float32 each
    else:
        # index_select on the flat table: ~4x faster on CPU than advanced indexing (same bits)
        k = k_cache.index_select(0, gather.blocks).view(num_seqs, -1, *k_cache.shape[2:])
        v = v_cache.index_select(0, gather.blocks).view(num_seqs, -1, *v_cache.shape[2:])
        k = k[:, :gather.max_len].transpose(1, 2)  # [B, KVH, L, D]
        v = v[:, :gather.max_len].transpose(1, 2)
    # Without padding the mask is left out: same bits, and SDPA skips adding it. bfloat16
    # and float16 in float32 (module docstring), rounded once.
    out = sdpa(_float32(q[:, :, None, :]), _float32(k), _float32(v), scale,
               attn_mask=gather.mask)[:, :, 0, :]  # [B, H, D]
    out = _like(out, q)
    if gather.empty is not None:
        out = out.masked_fill(gather.empty[:, None, None], 0.0)
    return out


def _decode_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   block_tables: torch.Tensor, seq_lens: torch.Tensor,
                   scale: float) -> torch.Tensor:
    num_seqs, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # [B, H, D]
    if num_seqs == 0:
        return out
    q = last_dim_contiguous(q)
    group = num_heads // num_kv_heads
    block_d = head_block(head_dim)
    assert out.stride(2) == 1 and q.stride(2) == 1 and k_cache.stride(3) == 1
    assert v_cache.stride() == k_cache.stride() and block_tables.stride(1) == 1
    launch(_decode_kernel, (num_seqs, num_kv_heads),
        q, k_cache, v_cache, block_tables, seq_lens, out,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        scale * _LOG2E, block_size, head_dim,
        GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_N=64 if block_d <= 128 else 32, BLOCK_D=block_d,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=4,
    )
    return out


if triton is not None:

    @triton.jit
    def _decode_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, out_ptr,
        stride_qs, stride_qh,
        stride_cb, stride_cs, stride_ch,  # the same for k_cache and v_cache
        stride_bt, stride_os, stride_oh,
        qk_scale,  # scale * log2(e): the softmax runs in base 2
        block_size, head_dim,
        GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
    ):
        seq = tl.program_id(0).to(tl.int64)
        kv_head = tl.program_id(1)
        seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
        offs_g = tl.arange(0, BLOCK_G)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        heads = kv_head * GROUP + offs_g
        mask_gd = (offs_g < GROUP)[:, None] & (offs_d < head_dim)[None, :]
        q = tl.load(q_ptr + seq * stride_qs + heads[:, None] * stride_qh + offs_d[None, :],
                    mask=mask_gd, other=0.0).to(tl.float32)  # [G, D]
        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        table = block_tables_ptr + seq * stride_bt
        for start in range(0, seq_len, BLOCK_N):
            pos = start + offs_n
            mask_n = pos < seq_len
            page = tl.load(table + pos // block_size, mask=mask_n, other=0).to(tl.int64)
            row = page * stride_cb + (pos % block_size).to(tl.int64) * stride_cs
            kv_off = row[:, None] + kv_head * stride_ch + offs_d[None, :]  # [N, D]
            mask_nd = mask_n[:, None] & (offs_d < head_dim)[None, :]
            k = tl.load(k_cache_ptr + kv_off, mask=mask_nd, other=0.0).to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [G, N]
            s = tl.where(mask_n[None, :], s, float("-inf"))
            # Every tile holds at least one valid position, so m_new is finite.
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])  # [G, N]
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_cache_ptr + kv_off, mask=mask_nd, other=0.0).to(tl.float32)
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
            m_i = m_new
        l_i = tl.where(l_i == 0.0, 1.0, l_i)  # seq_len 0: zeros, not NaN
        out = acc / l_i[:, None]
        tl.store(out_ptr + seq * stride_os + heads[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=mask_gd)
