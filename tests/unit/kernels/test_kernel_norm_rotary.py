"""rms_norm and apply_rotary: torch references bit for bit against transformers' formulas,
Triton (interpreted) against the references.

Under TRITON_INTERPRET, float32 -> bfloat16 casts truncate rather than round to
nearest, so bfloat16 Triton results are compared within an ulp or two; float16
casts round correctly there and are compared exactly.
"""
from __future__ import annotations

import pytest
import torch

from pdserve.kernels import apply_rotary, rms_norm, rotary_tables, rotate_

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def hf_rms_norm(x, weight, eps):  # transformers' LlamaRMSNorm.forward, inline
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def hf_cos_sin_cache(head_dim, max_position, base=10000.0):
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    freqs = torch.arange(max_position).float()[:, None] * inv_freq[None, :]  # [P, D/2]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


def close_or_equal(out, expected):
    """Triton against torch: float16 exact, float32 up to the order of a sum."""
    assert out.dtype == expected.dtype and out.shape == expected.shape
    if out.dtype == torch.float16:
        assert torch.equal(out, expected)
    elif out.dtype == torch.bfloat16:
        torch.testing.assert_close(out, expected, atol=5e-2, rtol=2e-2)
    else:
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm(dtype):
    gen = torch.Generator().manual_seed(0)
    wide = torch.randn(5, 2 * 96, generator=gen).to(dtype)
    x = wide[:, :96]  # strided rows, hidden not a power of two
    residual = torch.randn(5, 96, generator=gen).to(dtype)
    weight = (1 + 0.1 * torch.randn(96, generator=gen)).to(dtype)
    eps = 1e-6

    out = rms_norm(x, weight, eps, backend="torch")
    assert torch.equal(out, hf_rms_norm(x, weight, eps))
    out_r, new_res = rms_norm(x, weight, eps, residual, backend="torch")
    assert torch.equal(new_res, x + residual)
    assert torch.equal(out_r, hf_rms_norm(x + residual, weight, eps))
    assert torch.equal(residual, residual.clone()) and new_res.data_ptr() != residual.data_ptr()

    close_or_equal(rms_norm(x, weight, eps, backend="triton"), out)
    tri_out, tri_res = rms_norm(x, weight, eps, residual, backend="triton")
    close_or_equal(tri_res, new_res)
    close_or_equal(tri_out, out_r)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_adds_into_the_residual_when_asked(dtype):
    gen = torch.Generator().manual_seed(1)
    x, residual = (torch.randn(3, 64, generator=gen).to(dtype) for _ in range(2))
    weight = (1 + 0.1 * torch.randn(64, generator=gen)).to(dtype)
    x_before, expected = x.clone(), rms_norm(x, weight, 1e-6, residual.clone())
    out, new_res = rms_norm(x, weight, 1e-6, residual, add_in_place=True)
    assert new_res.data_ptr() == residual.data_ptr() and torch.equal(x, x_before)
    assert torch.equal(out, expected[0]) and torch.equal(new_res, expected[1])


def test_rms_norm_matches_transformers_module():
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    norm = llama.LlamaRMSNorm(64, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(64))
    norm = norm.bfloat16()
    x = torch.randn(7, 64).bfloat16()
    with torch.no_grad():
        assert torch.equal(rms_norm(x, norm.weight, 1e-5), norm(x))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(8, 2, 64), (4, 4, 128)])
def test_apply_rotary(dtype, num_heads, num_kv_heads, head_dim):
    gen = torch.Generator().manual_seed(0)
    num_tokens = 6
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen)
    q, k, _ = qkv.to(dtype).split([num_heads * head_dim, num_kv_heads * head_dim,
                                   num_kv_heads * head_dim], dim=-1)
    q = q.view(num_tokens, num_heads, head_dim)  # strided views, as the model has them
    k = k.view(num_tokens, num_kv_heads, head_dim)
    positions = torch.tensor([0, 1, 2, 500, 4095, 7])
    cache = hf_cos_sin_cache(head_dim, 4096)

    q_out, k_out = apply_rotary(q, k, positions, cache, backend="torch")
    # transformers' apply_rotary_pos_emb with [T, 1, D] cos/sin, written out
    cos, sin = cache[positions].chunk(2, dim=-1)
    cos = torch.cat((cos, cos), -1).to(dtype)[:, None]
    sin = torch.cat((sin, sin), -1).to(dtype)[:, None]
    for x, out in ((q, q_out), (k, k_out)):
        rotated = torch.cat((-x[..., head_dim // 2:], x[..., :head_dim // 2]), dim=-1)
        assert torch.equal(out, x * cos + rotated * sin)
        assert out.is_contiguous()

    tq, tk = apply_rotary(q, k, positions, cache, backend="triton")
    close_or_equal(tq, q_out)
    close_or_equal(tk, k_out)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotate_with_step_tables_is_apply_rotary_on_q_and_k_at_once(dtype):
    """The model's CPU path: tables once per step, q's and k's heads rotated together as
    they lie in the fused qkv output, in place; bit for bit what apply_rotary gives."""
    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, d = 9, 3, 64
    qkv = torch.randn(5, (heads + 2 * kv_heads) * d, generator=gen).to(dtype)
    positions = torch.tensor([0, 7, 300, 2047, 5])
    cache = hf_cos_sin_cache(d, 2048)
    q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    q_ref, k_ref = apply_rotary(q.view(5, heads, d), k.view(5, kv_heads, d), positions, cache,
                                backend="torch")
    v_before = v.clone()
    qk = qkv[:, :(heads + kv_heads) * d].view(5, -1, d)
    assert rotate_(qk, rotary_tables(positions, cache, dtype)) is qk  # in place
    assert torch.equal(qk[:, :heads], q_ref) and torch.equal(qk[:, heads:], k_ref)
    assert torch.equal(v, v_before)  # v, beside them, is left as it was


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_rotary_matches_transformers_rotary_embedding(dtype):
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    config = llama.LlamaConfig(hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                               max_position_embeddings=2048)
    rope = llama.LlamaRotaryEmbedding(config)
    positions = torch.tensor([3, 0, 1000, 2047, 517])
    q, k = torch.randn(5, 4, 64).to(dtype), torch.randn(5, 2, 64).to(dtype)
    cos, sin = rope(q, positions[None])  # [1, T, D] each, q's dtype
    # transformers: [B, H, T, D] with cos/sin unsqueezed at dim 1
    hf_q, hf_k = llama.apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                            cos, sin)
    q_out, k_out = apply_rotary(q, k, positions, hf_cos_sin_cache(64, 2048))
    assert torch.equal(q_out, hf_q[0].transpose(0, 1))
    assert torch.equal(k_out, hf_k[0].transpose(0, 1))


def test_errors():
    x, w = torch.randn(4, 32), torch.randn(32)
    with pytest.raises(ValueError, match=r"x must have shape \[T, hidden\], got \(2, 2, 32\)"):
        rms_norm(x.view(2, 2, 32), w, 1e-6)
    with pytest.raises(ValueError, match="weight must have the dtype of x"):
        rms_norm(x, w.bfloat16(), 1e-6)
    with pytest.raises(ValueError, match="residual must have shape .*hidden=32"):
        rms_norm(x, w, 1e-6, torch.randn(4, 16))
    q, k, cache = torch.randn(3, 4, 64), torch.randn(3, 2, 64), hf_cos_sin_cache(64, 16)
    with pytest.raises(ValueError, match="positions must have dtype int32 or int64, got float32"):
        apply_rotary(q, k, torch.zeros(3), cache)
    with pytest.raises(ValueError, match="cos_sin_cache must have shape .*head_dim=64"):
        apply_rotary(q, k, torch.zeros(3, dtype=torch.int64), hf_cos_sin_cache(32, 16))
    with pytest.raises(ValueError, match="k must have the dtype of q"):
        apply_rotary(q, k.half(), torch.zeros(3, dtype=torch.int64), cache)
