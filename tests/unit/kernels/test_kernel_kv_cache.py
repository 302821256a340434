"""store_kv / gather_kv / scatter_kv: both backends against a plain loop, and each other."""
from __future__ import annotations

import pytest
import torch

from pdserve.kernels import (
    gather_kv,
    paged_decode_attention,
    prefill_attention,
    scatter_kv,
    store_kv,
)

BACKENDS = ["torch", "triton"]


def fused_kv(num_tokens, num_kv_heads, head_dim, dtype, seed=0):
    """k, v as the model has them: strided views into one fused projection output."""
    gen = torch.Generator().manual_seed(seed)
    kv = torch.randn(num_tokens, 3 * num_kv_heads * head_dim, generator=gen).to(dtype)
    _, k, v = kv.split(num_kv_heads * head_dim, dim=-1)
    return k.view(num_tokens, num_kv_heads, head_dim), v.view(num_tokens, num_kv_heads, head_dim)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype,slot_dtype", [(torch.float32, torch.int64),
                                              (torch.bfloat16, torch.int32)])
@pytest.mark.parametrize("slot_list", [[0, 5, -1, 19, 8, -1], [3, 5, 2, 19, 8, 9]])
def test_store_kv_matches_loop_and_skips_minus_one(backend, dtype, slot_dtype, slot_list):
    num_blocks, block_size, num_kv_heads, head_dim = 5, 4, 2, 64
    k, v = fused_kv(6, num_kv_heads, head_dim, dtype)
    assert not k.is_contiguous()
    slots = torch.tensor(slot_list, dtype=slot_dtype)
    k_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), 7.0, dtype=dtype)
    v_cache = k_cache.clone()
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expected_k[slot // block_size, slot % block_size] = k[t]
            expected_v[slot // block_size, slot % block_size] = v[t]
    store_kv(k, v, k_cache, v_cache, slots, backend=backend)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)
    if -1 not in slot_list:  # the model step's fast path stores the same
        k_cache.fill_(7.0), v_cache.fill_(7.0)
        store_kv(k, v, k_cache, v_cache, slots, backend=backend, all_slots=True)
        assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64])
def test_gather_scatter_roundtrip(backend, ids_dtype):
    gen = torch.Generator().manual_seed(1)
    k_cache = torch.randn(8, 16, 2, 64, generator=gen).bfloat16()
    v_cache = torch.randn(8, 16, 2, 64, generator=gen).bfloat16()
    ids = torch.tensor([6, 0, 3], dtype=ids_dtype)
    k, v = gather_kv(k_cache, v_cache, ids, backend=backend)
    assert k.shape == (3, 16, 2, 64) and k.is_contiguous() and v.is_contiguous()
    assert torch.equal(k, k_cache[ids.long()]) and torch.equal(v, v_cache[ids.long()])

    other_k, other_v = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    new_ids = torch.tensor([1, 7, 2], dtype=ids_dtype)
    scatter_kv(other_k, other_v, new_ids, k, v, backend=backend)
    assert torch.equal(other_k[new_ids.long()], k) and torch.equal(other_v[new_ids.long()], v)
    untouched = torch.ones(8, dtype=torch.bool)
    untouched[new_ids.long()] = False
    assert not other_k[untouched].any() and not other_v[untouched].any()


def test_empty_inputs_are_no_ops():
    cache = torch.randn(2, 4, 1, 16)
    for backend in BACKENDS:
        store_kv(cache[0, :0], cache[0, :0], cache, cache.clone(),
                 torch.zeros(0, dtype=torch.int64), backend=backend)
        k, v = gather_kv(cache, cache, torch.zeros(0, dtype=torch.int64), backend=backend)
        assert k.shape == (0, 4, 1, 16)


@pytest.mark.parametrize("backend", BACKENDS)
def test_stored_pages_serve_decode_like_contiguous_attention(backend):
    # The engine's path: store a prompt's K/V through a slot mapping, then decode over it.
    num_kv_heads, head_dim, block_size, num_tokens = 2, 64, 4, 11
    k, v = fused_kv(num_tokens, num_kv_heads, head_dim, torch.float32)
    blocks = torch.tensor([5, 2, 7], dtype=torch.int32)
    pos = torch.arange(num_tokens)
    slots = blocks.long()[pos // block_size] * block_size + pos % block_size
    k_cache = torch.randn(8, block_size, num_kv_heads, head_dim)
    v_cache = torch.randn(8, block_size, num_kv_heads, head_dim)
    store_kv(k, v, k_cache, v_cache, slots, backend=backend)
    q = torch.randn(num_tokens, 4, head_dim)
    out = paged_decode_attention(q[-1:], k_cache, v_cache, blocks[None],
                                 torch.tensor([num_tokens], dtype=torch.int32), 0.125,
                                 backend=backend)
    full = prefill_attention(q, k, v, torch.tensor([0, num_tokens], dtype=torch.int32), 0.125)
    torch.testing.assert_close(out, full[-1:], atol=2e-5, rtol=1e-5)


def test_errors():
    k = torch.randn(3, 2, 64)
    cache = torch.randn(4, 8, 2, 64)
    slots = torch.arange(3)
    with pytest.raises(ValueError, match=r"k_cache must be contiguous .*written in place"):
        store_kv(k, k, cache.transpose(0, 1).contiguous().transpose(0, 1), cache, slots)
    with pytest.raises(ValueError, match="k_cache must have the dtype of k"):
        store_kv(k, k, cache.bfloat16(), cache.bfloat16(), slots)
    with pytest.raises(ValueError, match="slot_mapping must have dtype int32 or int64, got float"):
        store_kv(k, k, cache, cache, slots.float())
    with pytest.raises(ValueError, match="slot_mapping must have shape .*T=3"):
        store_kv(k, k, cache, cache, torch.arange(4))
    with pytest.raises(ValueError, match=r"block_ids must have shape \[n\], got \(1, 2\)"):
        gather_kv(cache, cache, torch.zeros(1, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match="k must have shape .*num_blocks=2 .*from block_ids"):
        scatter_kv(cache, cache, torch.tensor([0, 1]), cache[:3], cache[:3])
    with pytest.raises(ValueError, match="k must have shape .*block_size=8 .*from k_cache"):
        scatter_kv(cache, cache, torch.tensor([0, 1]), cache[:2, :4], cache[:2, :4])
