"""Causal attention over many new tokens: fresh prompts, prompt chunks, mixed batches.

One Triton kernel serves both public functions: ``prefill_attention`` reads
K/V straight from the packed new tokens, ``paged_prefill_attention`` reads
them from the paged cache, where a sequence's cached prefix sits in front of
its new tokens (chunked prefill). Tiles of queries never straddle two
sequences: sequence s owns tiles ``cu[s] // BLOCK_M + s`` onwards, so the
grid comes from the token count alone and the host never reads the offsets
(no device sync on CUDA).

Numerics: the torch references call torch's SDPA on the input dtype once per
sequence, exactly as transformers' "sdpa" attention does for one unpadded
sequence (``is_causal=True`` when there is no cached prefix, a bottom-right
causal mask otherwise), so each sequence gets the bits transformers gives it
on its own, whatever else is in the batch. The Triton kernel computes as the
decode kernel does (float32, tf32 tensor cores for bf16/fp16 inputs).

One exception on the CPU: bfloat16 (both functions, ``native=None``) runs the native
kernel (kernels/native/prefill_attention.c) where ``native.available()``, about 5x faster
than SDPA at 1024 tokens: flash-style, Q.K^T and P.V on AVX512-BF16 with float32 accumulation,
float32 online softmax, P rounded to bfloat16 for P.V. Not SDPA's bits, but the same
error against float32 (about one bfloat16 rounding of the output; benchmarks/RESULTS.md).
A query's output does not depend on which other queries share its call, so a prompt
prefilled in chunks over its cached pages gets the bits it gets in one piece.
``native=False`` and float32 keep SDPA, so float32 greedy output stays token-exact against
transformers.
"""
from __future__ import annotations

import torch

from pdserve.kernels._dispatch import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_contiguous,
    check_cu_seqlens,
    check_cu_values,
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
from pdserve.kernels.native import prefill_attention as native_prefill

_LOG2E = 1.4426950408889634
# Offsets read per step of the kernel's search for a tile's sequence: a constant, so one
# compiled kernel serves every batch size (no compile stall at a new power of two).
_SEQ_CHUNK = 64


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      cu_seqlens: torch.Tensor, scale: float,
                      backend: str | None = None, native: bool | None = None) -> torch.Tensor:
    """Causal attention within each of several sequences packed back to back.

    q [T, num_heads, head_dim]; k, v [T, num_kv_heads, head_dim] (any strides);
    cu_seqlens int32/int64 [num_seqs + 1], sequence i is tokens
    cu_seqlens[i]:cu_seqlens[i+1]. Returns [T, num_heads, head_dim] in q's dtype.

    ``native`` (torch backend): the C kernel (``kernels.native.prefill_attention``). None:
    for bfloat16 where it runs (``native_prefill_why_not``), torch's SDPA otherwise (float32:
    transformers' bits); False: SDPA; True: the kernel, raising where it cannot run.
    """
    dims: dict[str, tuple[int, str]] = {}
    check_tensor("q", q, "[T, num_heads, head_dim]", FLOAT_DTYPES, dims)
    check_tensor("k", k, "[T, num_kv_heads, head_dim]", FLOAT_DTYPES, dims, q.device)
    check_tensor("v", v, "[T, num_kv_heads, head_dim]", FLOAT_DTYPES, dims, q.device)
    check_same_dtype("k", k, "q", q)
    check_same_dtype("v", v, "q", q)
    num_seqs = check_cu_seqlens("cu_seqlens", cu_seqlens, q.device)
    check_gqa(q.shape[1], k.shape[1])
    scale = check_scale(scale)
    if pick_backend(backend, q.device) == "torch":
        return _prefill_torch(q, k, v, cu_seqlens, scale, _use_native(native, q, k))
    k, v = last_dim_contiguous(k), last_dim_contiguous(v)
    cu = cu_seqlens.contiguous()
    # K/V rows are token rows: "page" = token, offset stride 0, block size 1.
    return _prefill_triton(q, k, v, cu, cu, cu, num_seqs, scale, paged=False,
                           kv_strides=(k.stride(0), 0, k.stride(1)),
                           v_strides=(v.stride(0), 0, v.stride(1)), block_size=1)


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor,
                            block_tables: torch.Tensor, scale: float,
                            backend: str | None = None, native: bool | None = None
                            ) -> torch.Tensor:
    """Causal attention of new tokens over their sequence's whole paged KV cache.

    Sequence i's ``q_len = cu_seqlens_q[i+1] - cu_seqlens_q[i]`` queries are the
    last q_len of its ``seq_lens[i]`` tokens, all of whose K/V are already in the
    cache; the query at position p sees keys 0..p. Decode is q_len 1.
    q [T, num_heads, head_dim] (any strides); k_cache, v_cache [num_blocks,
    block_size, num_kv_heads, head_dim] (contiguous); block_tables int32/int64
    [num_seqs, max_blocks_per_seq]. Returns [T, num_heads, head_dim].
    ``native``: as ``prefill_attention``'s.
    """
    dims: dict[str, tuple[int, str]] = {}
    check_tensor("q", q, "[T, num_heads, head_dim]", FLOAT_DTYPES, dims)
    check_paged_cache(q, k_cache, v_cache, dims)
    num_seqs = check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.device)
    dims["num_seqs"] = (num_seqs, "cu_seqlens_q")
    check_tensor("seq_lens", seq_lens, "[num_seqs]", INDEX_DTYPES, dims, q.device)
    check_tensor("block_tables", block_tables, "[num_seqs, max_blocks_per_seq]", INDEX_DTYPES,
                 dims, q.device)
    check_gqa(q.shape[1], k_cache.shape[2])
    check_contiguous("k_cache", k_cache)
    check_contiguous("v_cache", v_cache)
    scale = check_scale(scale)
    if pick_backend(backend, q.device) == "torch":
        return _paged_prefill_torch(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables,
                                    scale, _use_native(native, q, k_cache))
    strides = (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2))
    return _prefill_triton(q, k_cache, v_cache, cu_seqlens_q.contiguous(), seq_lens.contiguous(),
                           block_tables.contiguous(), num_seqs, scale, paged=True,
                           kv_strides=strides, v_strides=strides, block_size=k_cache.shape[1])


def _prefill_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                   scale: float, use_native: bool = False) -> torch.Tensor:
    cu = cu_seqlens.tolist()
    check_cu_values("cu_seqlens", cu, q.shape[0])
    if use_native:
        return native_prefill.prefill_attention(last_dim_contiguous(q), last_dim_contiguous(k),
                                                last_dim_contiguous(v), cu_seqlens.cpu(), scale)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # [T, H, D]
    for start, end in zip(cu, cu[1:]):
        if end == start:
            continue
        # [S, H, D] -> [1, H, S, D], the (strided) layout transformers hands to SDPA
        o = sdpa(q[start:end].transpose(0, 1)[None], k[start:end].transpose(0, 1)[None],
                 v[start:end].transpose(0, 1)[None], scale, is_causal=True)
        out[start:end] = o[0].transpose(0, 1)
    return out


def native_prefill_why_not(dtype: torch.dtype, num_heads: int, num_kv_heads: int,
                           head_dim: int, device: torch.device | str) -> str | None:
    """None if ``prefill_attention(native=None)`` (and the paged one) runs the native kernel
    for ``dtype`` on ``device``, else why not (one phrase, for a start-up log)."""
    if dtype == torch.float32:
        return "float32 keeps torch's SDPA (transformers' bits)"
    return native_prefill.why_not(dtype, num_heads, num_kv_heads, head_dim, device)


def _use_native(native: bool | None, q: torch.Tensor, k: torch.Tensor) -> bool:
    """Asked on every call: a caller that turns the kernels off mid-process
    (``PDSERVE_NATIVE_KERNELS=0`` and a cache_clear) gets SDPA from the next one."""
    if native is False:
        return False
    args = (q.dtype, q.shape[-2], k.shape[-2], q.shape[-1], q.device)
    if native is None:
        return native_prefill_why_not(*args) is None
    why = native_prefill.why_not(*args)
    if why is not None:
        raise RuntimeError(f"native prefill attention cannot run: {why}")
    return True


def _paged_prefill_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor,
                         block_tables: torch.Tensor, scale: float, use_native: bool = False
                         ) -> torch.Tensor:
    cu, lens = cu_seqlens_q.tolist(), seq_lens.tolist()
    check_cu_values("cu_seqlens_q", cu, q.shape[0])
    block_size = k_cache.shape[1]
    num_blocks = [0] * len(lens)  # pages each sequence reads
    for i, (start, end) in enumerate(zip(cu, cu[1:])):
        q_len, kv_len = end - start, lens[i]
        if q_len == 0:
            continue
        if kv_len < q_len:
            raise ValueError(f"sequence {i} has {q_len} new tokens but seq_lens[{i}] is only "
                             f"{kv_len}; seq_lens counts cached and new tokens")
        num_blocks[i] = -(-kv_len // block_size)
        if num_blocks[i] > block_tables.shape[1]:
            raise ValueError(f"sequence {i} needs {num_blocks[i]} blocks for {kv_len} tokens, "
                             f"but block_tables has {block_tables.shape[1]} columns")
    if use_native:
        # C reads the pages unchecked: every id a sequence reads must exist
        used = torch.arange(block_tables.shape[1])[None, :] < torch.tensor(num_blocks)[:, None]
        bad = used & ((block_tables < 0) | (block_tables >= k_cache.shape[0]))
        if bad.any():
            i, j = bad.nonzero()[0].tolist()
            raise ValueError(f"block_tables[{i}, {j}] is {block_tables[i, j].item()}, not a "
                             f"page of the cache's {k_cache.shape[0]}")
        return native_prefill.paged_prefill_attention(
            last_dim_contiguous(q), k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # [T, H, D]
    for i, (start, end) in enumerate(zip(cu, cu[1:])):
        q_len, kv_len = end - start, lens[i]
        if q_len == 0:
            continue
        blocks = block_tables[i, :num_blocks[i]].long()
        k = k_cache[blocks].flatten(0, 1)[:kv_len]  # [L, KVH, D]
        v = v_cache[blocks].flatten(0, 1)[:kv_len]  # [L, KVH, D]
        mask = None
        if q_len < kv_len:  # causal, aligned to the bottom right: query j is at kv_len - q_len + j
            q_pos = torch.arange(kv_len - q_len, kv_len, device=q.device)
            mask = torch.arange(kv_len, device=q.device)[None, :] <= q_pos[:, None]  # [S, L]
        o = sdpa(q[start:end].transpose(0, 1)[None], k.transpose(0, 1)[None],
                 v.transpose(0, 1)[None], scale, attn_mask=mask, is_causal=mask is None)
        out[start:end] = o[0].transpose(0, 1)  # [S, H, D]
    return out


def _prefill_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                    seq_lens: torch.Tensor, block_tables: torch.Tensor, num_seqs: int, scale: float,
                    *, paged: bool, kv_strides: tuple[int, int, int],
                    v_strides: tuple[int, int, int], block_size: int) -> torch.Tensor:
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[-2]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # [T, H, D]
    if num_tokens == 0 or num_seqs == 0:
        return out
    q = last_dim_contiguous(q)
    assert q.stride(2) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1 and out.stride(2) == 1
    assert block_tables.stride(-1) == 1 and cu_seqlens_q.stride(0) == 1
    block_d = head_block(head_dim)
    # Untuned; sized so that float32 tiles also fit 99 KB of shared memory (sm_86/89).
    wide = q.dtype == torch.float32
    block_m = 64 if block_d <= 128 and not wide else 32
    block_n = 64 if block_d <= 64 else (16 if block_d > 128 and wide else 32)
    # A sequence of q_len tokens needs at most q_len // BLOCK_M + 1 tiles.
    grid = (num_tokens // block_m + num_seqs, num_heads)
    launch(_prefill_kernel, grid,
        q, k, v, out, cu_seqlens_q, seq_lens, block_tables,
        q.stride(0), q.stride(1), *kv_strides, *v_strides,
        block_tables.stride(0) if paged else 0, out.stride(0), out.stride(1),
        scale * _LOG2E, num_seqs, block_size, head_dim,
        GROUP=num_heads // num_kv_heads, PAGED=paged, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_D=block_d, SEQ_CHUNK=_SEQ_CHUNK,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=4 if block_d <= 64 else 8,
    )
    return out


if triton is not None:

    # num_seqs changes every step: specialised (== 1, % 16) it would compile anew mid-serving.
    @triton.jit(do_not_specialize=["num_seqs"])
    def _prefill_kernel(
        q_ptr, k_ptr, v_ptr, out_ptr, cu_q_ptr, seq_lens_ptr, block_tables_ptr,
        stride_qt, stride_qh,
        stride_kb, stride_ks, stride_kh,  # page, offset in page, head (PAGED=False: token, 0, head)
        stride_vb, stride_vs, stride_vh,
        stride_bt, stride_ot, stride_oh,
        qk_scale,  # scale * log2(e): the softmax runs in base 2
        num_seqs, block_size, head_dim,
        GROUP: tl.constexpr, PAGED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr, SEQ_CHUNK: tl.constexpr, PRECISION: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        head = tl.program_id(1)
        kv_head = head // GROUP
        # The owner of tile pid_m is the last sequence whose first tile is <= pid_m:
        # count those, SEQ_CHUNK sequences at a time.
        seq = tl.full([], -1, tl.int32)
        for chunk in range(0, num_seqs, SEQ_CHUNK):
            offs_s = chunk + tl.arange(0, SEQ_CHUNK)
            cu = tl.load(cu_q_ptr + offs_s, mask=offs_s < num_seqs, other=0).to(tl.int32)
            first_tile = tl.where(offs_s < num_seqs, cu // BLOCK_M + offs_s, 2147483647)
            seq += tl.sum((first_tile <= pid_m).to(tl.int32), 0)
        q_start = tl.load(cu_q_ptr + seq).to(tl.int32)
        q_len = tl.load(cu_q_ptr + seq + 1).to(tl.int32) - q_start
        tile = pid_m - (q_start // BLOCK_M + seq)
        if tile * BLOCK_M >= q_len:
            return
        if PAGED:
            kv_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
        else:
            kv_len = q_len
        offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        mask_d = offs_d < head_dim
        mask_md = (offs_m < q_len)[:, None] & mask_d[None, :]
        q_rows = (q_start + offs_m).to(tl.int64)
        q = tl.load(q_ptr + q_rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                    mask=mask_md, other=0.0).to(tl.float32)  # [M, D]
        q_pos = kv_len - q_len + offs_m  # absolute positions of this tile's queries
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        # Keys past this tile's last query are masked for every row: stop before them.
        kv_end = tl.minimum(kv_len, kv_len - q_len + (tile + 1) * BLOCK_M)
        for start in range(0, kv_end, BLOCK_N):
            pos = start + offs_n
            mask_n = pos < kv_len
            if PAGED:
                page = tl.load(block_tables_ptr + seq.to(tl.int64) * stride_bt + pos // block_size,
                               mask=mask_n, other=0).to(tl.int64)
                in_page = (pos % block_size).to(tl.int64)
                k_row = page * stride_kb + in_page * stride_ks
                v_row = page * stride_vb + in_page * stride_vs
            else:
                k_row = (q_start + pos).to(tl.int64) * stride_kb
                v_row = (q_start + pos).to(tl.int64) * stride_vb
            mask_nd = mask_n[:, None] & mask_d[None, :]
            k = tl.load(k_ptr + k_row[:, None] + kv_head * stride_kh + offs_d[None, :],
                        mask=mask_nd, other=0.0).to(tl.float32)  # [N, D]
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [M, N]
            s = tl.where((q_pos[:, None] >= pos[None, :]) & mask_n[None, :], s, float("-inf"))
            # Key 0 is in the first tile and visible to every row, so m_new is finite.
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])  # [M, N]
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_ptr + v_row[:, None] + kv_head * stride_vh + offs_d[None, :],
                        mask=mask_nd, other=0.0).to(tl.float32)  # [N, D]
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
            m_i = m_new
        out = acc / l_i[:, None]
        tl.store(out_ptr + q_rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=mask_md)
