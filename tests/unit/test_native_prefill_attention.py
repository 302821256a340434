"""The native bfloat16 prefill attention (pdserve/kernels/native/prefill_attention.c) against a
float64 reference and torch's SDPA, on views of a fused qkv projection as the model passes
them (token stride = the qkv row, not contiguous).

Error bound, per element, against float64 on the same bfloat16 inputs:
    |out - ref| <= 2^-8 |ref| + 2^-8 max|v| + 1e-5
2^-8 |ref|: the output's rounding to bfloat16 (half an ulp, 8 significant bits);
2^-8 max|v|: P rounded to bfloat16 for P.V (each p off by at most 2^-8 p, and the p sum to
one); 1e-5: float32 sums and exp2. With P kept in float32 the middle term goes. Beside it,
the criterion the kernel was accepted on: its largest error at most twice SDPA's.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve.kernels import native, paged_prefill_attention, prefill_attention
from pdserve.kernels.native import prefill_attention as native_prefill

WHY = native.why_unavailable()
pytestmark = pytest.mark.skipif(WHY is not None, reason=WHY or "")

ROUND = 2.0 ** -8


def fused_qkv(lens, num_heads, num_kv_heads, head_dim, seed=0):
    """q [T, H, D], k/v [T, KVH, D] bfloat16: views of one [T, (H + 2 KVH) D] projection."""
    gen = torch.Generator().manual_seed(seed)
    t = sum(lens)
    qkv = torch.randn(t, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen)
    q, k, v = qkv.bfloat16().split([num_heads * head_dim, num_kv_heads * head_dim,
                                    num_kv_heads * head_dim], dim=-1)
    return (q.view(t, num_heads, head_dim), k.view(t, num_kv_heads, head_dim),
            v.view(t, num_kv_heads, head_dim))


def cu(lens):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


def reference(q, k, v, lens, scale):
    """float64 causal attention per sequence: [T, H, D]."""
    out, start = [], 0
    for n in lens:
        qq, kk, vv = (x[start:start + n].double() for x in (q, k, v))
        group = qq.shape[1] // kk.shape[1]
        kk, vv = kk.repeat_interleave(group, 1), vv.repeat_interleave(group, 1)  # [n, H, D]
        scores = torch.einsum("shd,lhd->hsl", qq, kk) * scale  # [H, n, n]
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        out.append(torch.einsum("hsl,lhd->shd", scores.softmax(-1), vv))
        start += n
    return torch.cat(out)


def sdpa(q, k, v, lens, scale):
    out, start = torch.empty(q.shape, dtype=q.dtype), 0
    for n in lens:
        if n:
            qq, kk, vv = (x[start:start + n].transpose(0, 1)[None] for x in (q, k, v))
            out[start:start + n] = F.scaled_dot_product_attention(
                qq, kk, vv, scale=scale, is_causal=True, enable_gqa=True)[0].transpose(0, 1)
        start += n
    return out


def check(lens, num_heads, num_kv_heads, head_dim, p_bf16=True):
    q, k, v = fused_qkv(lens, num_heads, num_kv_heads, head_dim, seed=sum(lens) + head_dim)
    assert sum(lens) == 1 or k.stride(0) == (num_heads + 2 * num_kv_heads) * head_dim
    scale = head_dim ** -0.5
    out = native_prefill.prefill_attention(q, k, v, cu(lens), scale, p_bf16=p_bf16)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    ref = reference(q, k, v, lens, scale)
    err = (out.double() - ref).abs()
    bound = ROUND * ref.abs() + (ROUND * v.double().abs().max() if p_bf16 else 0) + 1e-5
    assert (err <= bound).all(), f"error {err.max():.3e}, over by {(err - bound).max():.3e}"
    sdpa_err = (sdpa(q, k, v, lens, scale).double() - ref).abs().max().item()
    assert err.max().item() <= max(2 * sdpa_err, 1e-6)
    return out


@pytest.mark.parametrize("seq_len", [1, 2, 17, 64, 300, 1024])
def test_one_sequence_smollm2_heads(seq_len):
    check([seq_len], 9, 3, 64)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (9, 3), (8, 2)])  # GQA 1, 3, 4
@pytest.mark.parametrize("head_dim", [64, 128])
def test_packed_sequences(num_heads, num_kv_heads, head_dim):
    check([5, 0, 64, 129, 1, 33], num_heads, num_kv_heads, head_dim)


@pytest.mark.parametrize("head_dim", [16, 48, 80, 96])  # P.V's last chunk of 1-3 vectors
def test_head_dims_past_a_multiple_of_64(head_dim):
    check([70, 3], 9, 3, head_dim)


@pytest.mark.parametrize("lens", [[17], [300, 0, 65]])
def test_p_in_float32(lens):
    check(lens, 9, 3, 64, p_bf16=False)


def test_prefill_attention_takes_it_for_bfloat16_only(monkeypatch):
    lens, scale = [40, 0, 70], 0.125
    q, k, v = fused_qkv(lens, 9, 3, 64)
    want = native_prefill.prefill_attention(q, k, v, cu(lens), scale)
    assert torch.equal(prefill_attention(q, k, v, cu(lens), scale), want)
    # float32 keeps SDPA's bits (token-exact greedy output against transformers)
    q32, k32, v32 = q.float(), k.float(), v.float()
    assert torch.equal(prefill_attention(q32, k32, v32, cu(lens), scale),
                       sdpa(q32, k32, v32, lens, scale))
    with pytest.raises(RuntimeError, match="it takes bfloat16"):
        prefill_attention(q32, k32, v32, cu(lens), scale, native=True)
    # a head_dim the kernel does not take keeps SDPA
    q, k, v = fused_qkv(lens, 4, 2, 40)
    assert "head_dim 40" in native_prefill.why_not(torch.bfloat16, 4, 2, 40)
    assert torch.equal(prefill_attention(q, k, v, cu(lens), scale), sdpa(q, k, v, lens, scale))
    # native=False asks for SDPA; turned off (PDSERVE_NATIVE_KERNELS=0 read anew): SDPA from
    # the next call
    q, k, v = fused_qkv(lens, 9, 3, 64)
    assert torch.equal(prefill_attention(q, k, v, cu(lens), scale, native=False),
                       sdpa(q, k, v, lens, scale))
    monkeypatch.setattr(native, "why_unavailable", lambda: "off for this test")
    assert torch.equal(prefill_attention(q, k, v, cu(lens), scale), sdpa(q, k, v, lens, scale))


def paged(kv, block_size, seed=0):
    """[L, KVH, D] of each sequence → cache [num_blocks, block_size, KVH, D] in shuffled
    pages (the rest noise) and int32 block_tables, padded with -1."""
    gen = torch.Generator().manual_seed(seed)
    counts = [-(-t.shape[0] // block_size) for t in kv]
    order = torch.randperm(sum(counts) + 2, generator=gen)
    cache = torch.randn(len(order), block_size, *kv[0].shape[1:], generator=gen).bfloat16()
    tables = torch.full((len(kv), max(counts) + 1), -1, dtype=torch.int32)
    used = 0
    for i, (t, n) in enumerate(zip(kv, counts)):
        ids, used = order[used:used + n], used + n
        tables[i, :n] = ids.int()
        flat = torch.zeros(n * block_size, *t.shape[1:], dtype=t.dtype)
        flat[:t.shape[0]] = t
        cache[ids] = flat.view(n, block_size, *t.shape[1:])
    return cache, tables


@pytest.mark.parametrize("block_size", [16, 64])
def test_chunks_over_pages_give_the_bits_of_one_piece(block_size):
    # prompts of 70, 1, 200 and 0 tokens, of which 30, 1, 64 and 0 are new in this step
    lens, new = [70, 1, 200, 0], [30, 1, 64, 0]
    q, k, v = fused_qkv(lens, 9, 3, 64, seed=5)
    whole = prefill_attention(q, k, v, cu(lens), 0.125)
    starts = cu(lens)[:-1].tolist()
    seqs = [slice(s, s + n) for s, n in zip(starts, lens)]
    k_cache, tables = paged([k[s] for s in seqs], block_size)
    v_cache, _ = paged([v[s] for s in seqs], block_size)
    last = torch.cat([torch.arange(s.stop - n, s.stop) for s, n in zip(seqs, new)])
    out = paged_prefill_attention(q[last], k_cache, v_cache, cu(new),
                                  torch.tensor(lens, dtype=torch.int32), tables, 0.125)
    assert torch.equal(out, whole[last])
    ref = reference(q, k, v, lens, 0.125)[last]
    bound = ROUND * ref.abs() + ROUND * v.double().abs().max() + 1e-5
    assert ((out.double() - ref).abs() <= bound).all()


def test_paged_refuses_a_page_that_does_not_exist():
    q, k, v = fused_qkv([20], 9, 3, 64)
    k_cache, tables = paged([k], 16)
    tables[0, 1] = k_cache.shape[0]
    with pytest.raises(ValueError, match=r"block_tables\[0, 1\]"):
        paged_prefill_attention(q, k_cache, k_cache, cu([20]),
                                torch.tensor([20], dtype=torch.int32), tables, 0.125)


def test_the_wrapper_refuses_what_the_kernel_would_misread():
    """Checks, not asserts (``python -O`` drops those): float16, a head_dim the kernel's
    buffers do not hold."""
    from pdserve.kernels.native.prefill_attention import prefill_attention as native_call
    cu = torch.tensor([0, 4])
    for dtype, d in ((torch.float16, 64), (torch.bfloat16, 272), (torch.bfloat16, 24)):
        q, k, v = (torch.randn(4, n, d).to(dtype) for n in (4, 2, 2))
        with pytest.raises(ValueError, match="native prefill attention"):
            native_call(q, k, v, cu, 0.125)
