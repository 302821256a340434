"""Attention: torch references against a float64 formula and transformers, Triton
(under TRITON_INTERPRET=1, about 10 ms per program) against the references.

Cases cover across them: length 1, exact block multiples and one past, many pages
in shuffled order, GQA 1/2/4/8, head_dim 64 and 128, float32 and bfloat16.
"""
from __future__ import annotations

import pytest
import torch

from pdserve.kernels import paged_decode_attention, paged_prefill_attention, prefill_attention

BF16_TOL = dict(atol=3e-2, rtol=3e-2)  # bf16 output ulp at |x| < 4, plus P rounding in SDPA
F32_TOL = dict(atol=2e-5, rtol=1e-5)


def naive_attention(q, k, v, scale, q_pos):
    """One sequence in float64: q [S, H, D], k/v [L, KVH, D], q_pos [S] absolute positions."""
    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)  # [L, H, D]
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("shd,lhd->hsl", q.double(), k) * scale  # [H, S, L]
    visible = torch.arange(k.shape[0])[None, :] <= q_pos[:, None]  # [S, L]
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hsl,lhd->shd", scores.softmax(-1), v)  # [S, H, D]


def paged(kv_per_seq, block_size, extra_blocks=3, seed=0):
    """Write each sequence's [L, KVH, D] K or V into pages given in shuffled order.

    Returns cache [num_blocks, block_size, KVH, D] (other pages hold noise) and
    block_tables int32 [num_seqs, max_blocks] padded with an id that does not exist.
    """
    gen = torch.Generator().manual_seed(seed)
    counts = [-(-t.shape[0] // block_size) for t in kv_per_seq]
    num_blocks = sum(counts) + extra_blocks
    order = torch.randperm(num_blocks, generator=gen)
    cache = torch.randn(num_blocks, block_size, *kv_per_seq[0].shape[1:], generator=gen)
    cache = cache.to(kv_per_seq[0].dtype)
    tables = torch.full((len(kv_per_seq), max(counts) + 1), 10**6, dtype=torch.int32)
    used = 0
    for i, (t, n) in enumerate(zip(kv_per_seq, counts)):
        ids = order[used:used + n]
        used += n
        tables[i, :n] = ids
        flat = torch.zeros(n * block_size, *t.shape[1:], dtype=t.dtype)
        flat[:t.shape[0]] = t
        cache[ids] = flat.view(n, block_size, *t.shape[1:])
    return cache, tables


def random_seqs(kv_lens, num_heads, num_kv_heads, head_dim, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ks = [torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype) for n in kv_lens]
    vs = [torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype) for n in kv_lens]
    return ks, vs, gen


def cu(lens):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


# ---- torch references against the float64 formula -------------------------------

@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(4, 4, 64), (8, 2, 128), (8, 1, 64)])
def test_references_match_float64_formula(num_heads, num_kv_heads, head_dim):
    lens, q_lens, block_size = [1, 16, 17, 50], [1, 16, 5, 50], 16
    ks, vs, gen = random_seqs(lens, num_heads, num_kv_heads, head_dim, torch.float32)
    scale = head_dim ** -0.5
    k_cache, tables = paged(ks, block_size)
    v_cache, _ = paged(vs, block_size)
    qs = [torch.randn(n, num_heads, head_dim, generator=gen) for n in q_lens]
    expected = [naive_attention(q, k, v, scale, torch.arange(n - len(q), n))
                for q, k, v, n in zip(qs, ks, vs, lens)]
    seq_lens = torch.tensor(lens, dtype=torch.int32)

    out = paged_prefill_attention(torch.cat(qs), k_cache, v_cache, cu(q_lens), seq_lens, tables,
                                  scale)
    torch.testing.assert_close(out.double(), torch.cat(expected), **F32_TOL)

    decode_q = torch.stack([q[-1] for q in qs])  # [B, H, D]
    out = paged_decode_attention(decode_q, k_cache, v_cache, tables, seq_lens, scale)
    torch.testing.assert_close(out.double(), torch.stack([e[-1] for e in expected]), **F32_TOL)

    fresh = [0, 1, 3]  # sequences whose queries are all their tokens: a plain prefill
    out = prefill_attention(torch.cat([qs[i] for i in fresh]), torch.cat([ks[i] for i in fresh]),
                            torch.cat([vs[i] for i in fresh]), cu([lens[i] for i in fresh]), scale)
    torch.testing.assert_close(out.double(), torch.cat([expected[i] for i in fresh]), **F32_TOL)


def test_paged_agrees_with_contiguous_and_decode():
    lens, block_size, scale = [7, 33, 1], 8, 0.125
    ks, vs, gen = random_seqs(lens, 8, 2, 64, torch.float32)
    k_cache, tables = paged(ks, block_size)
    v_cache, _ = paged(vs, block_size)
    q = torch.randn(sum(lens), 8, 64, generator=gen)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    whole = paged_prefill_attention(q, k_cache, v_cache, cu(lens), seq_lens, tables, scale)
    # Same SDPA call on the same values: equal bits, not just close.
    assert torch.equal(whole, prefill_attention(q, torch.cat(ks), torch.cat(vs), cu(lens), scale))
    last = cu(lens)[1:].long() - 1
    decode = paged_decode_attention(q[last], k_cache, v_cache, tables, seq_lens, scale)
    torch.testing.assert_close(decode, whole[last], atol=1e-6, rtol=1e-6)
    single = paged_prefill_attention(q[last], k_cache, v_cache, cu([1, 1, 1]), seq_lens, tables,
                                     scale)
    torch.testing.assert_close(decode, single, atol=1e-6, rtol=1e-6)


def test_decode_zero_length_gives_zeros():
    ks, vs, gen = random_seqs([5, 1], 4, 2, 64, torch.float32)
    k_cache, tables = paged(ks, 4)
    v_cache, _ = paged(vs, 4)
    q = torch.randn(2, 4, 64, generator=gen)
    seq_lens = torch.tensor([5, 0], dtype=torch.int32)
    for backend in ("torch", "triton"):
        out = paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, 0.1, backend=backend)
        assert torch.equal(out[1], torch.zeros(4, 64)) and out[0].abs().sum() > 0


def test_decode_gather_built_once_per_step_gives_the_same_bits():
    """A model builds the page list and mask once per step (decode_gather) and passes it
    to every layer; the attention must be what the call without it computes."""
    from pdserve.kernels import decode_gather
    from pdserve.kernels._dispatch import sdpa
    for lens in ([5, 17, 9, 0], [17, 17, 17]):  # padded (a mask), equal (no mask needed)
        ks, vs, gen = random_seqs(lens, 6, 2, 64, torch.float32)
        k_cache, tables = paged(ks, 8)
        v_cache, _ = paged(vs, 8)
        q = torch.randn(len(lens), 6, 64, generator=gen)
        seq_lens = torch.tensor(lens, dtype=torch.int32)
        gather = decode_gather(tables, seq_lens, 8)
        assert (gather.mask is None) == (len(set(lens)) == 1)
        with_plan = paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, 0.125,
                                           gather=gather)
        assert torch.equal(with_plan, paged_decode_attention(q, k_cache, v_cache, tables,
                                                             seq_lens, 0.125))
        if gather.mask is None:  # left out as all-true: the masked call gives the same bits
            k = k_cache[tables[:, :3].long()].flatten(1, 2)[:, :17].transpose(1, 2)
            v = v_cache[tables[:, :3].long()].flatten(1, 2)[:, :17].transpose(1, 2)
            masked = sdpa(q[:, :, None], k, v, 0.125,
                          attn_mask=torch.ones(len(lens), 1, 1, 17, dtype=torch.bool))
            assert torch.equal(with_plan, masked[:, :, 0])
        # and the padded rows' masking really applies: the answer is the float64 formula's
        expected = torch.stack([naive_attention(q[i:i + 1], k, v, 0.125, torch.tensor([n - 1]))[0]
                                if n else torch.zeros(6, 64, dtype=torch.float64)
                                for i, (k, v, n) in enumerate(zip(ks, vs, lens))])
        torch.testing.assert_close(with_plan.double(), expected, **F32_TOL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_window_refilled_then_appended_gives_the_bits_of_the_gather(dtype):
    """A decode window (the batch's context kept contiguous across steps, in float32) is
    refilled from the pages, then takes one new token per sequence: each step must attend
    exactly as the gather from the pages does, bit for bit, in bfloat16 too."""
    from pdserve.kernels import DecodeWindow, WindowFill, decode_gather
    lens, block, cap = [5, 17, 9, 16], 8, 32  # 16: the next token opens a new page
    ks, vs, gen = random_seqs([n + 1 for n in lens], 6, 2, 64, dtype)
    k_cache, tables = paged(ks, block)
    v_cache, _ = paged(vs, block)
    num_seqs = len(lens)
    # An uninitialised window: a position the refill left out would poison the output.
    win = torch.full((num_seqs, 2, 2, cap, 64), float("nan"))
    pages = torch.zeros(num_seqs, cap // block, dtype=torch.int64)
    for i, n in enumerate(lens):
        used = -(-(n + 1) // block)
        pages[i, :used] = tables[i, :used]

    def both(seq_lens, fill, kv=None):
        q = torch.randn(num_seqs, 6, 64, generator=gen).to(dtype)
        seq_lens = torch.tensor(seq_lens, dtype=torch.int32)
        gather = decode_gather(tables, seq_lens, block)
        windowed = paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, 0.125,
                                          gather=gather, window=DecodeWindow(win, fill), kv=kv)
        return windowed, paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, 0.125,
                                                native=False)  # SDPA, the window's too

    windowed, gathered = both(lens, WindowFill(pages=pages.flatten()))
    assert torch.equal(windowed, gathered)
    # The next step: each sequence's new token is stored (fresh values), then appended
    # from the values stored (a [B, 2 KVH, D] view with strides, as the model's qkv gives).
    slots = torch.tensor([int(tables[i, n // block]) * block + n % block
                          for i, n in enumerate(lens)])
    new = torch.randn(num_seqs, 9, 64, generator=gen).to(dtype)[:, 5:]  # [B, 2 KVH, D]
    k_cache.view(-1, 2, 64)[slots] = new[:, :2]
    v_cache.view(-1, 2, 64)[slots] = new[:, 2:]
    # row (b, j) of the window seen as [B * 2 KVH * cap, D] takes position lens[b]
    rows = (torch.arange(num_seqs * 4).view(num_seqs, 4) * cap
            + torch.tensor(lens)[:, None]).flatten()
    windowed, gathered = both([n + 1 for n in lens], WindowFill(rows=rows), new)
    assert torch.equal(windowed, gathered)
    # and the appended token is really read: appending other values shows
    windowed, gathered = both([n + 1 for n in lens], WindowFill(rows=rows), new.flip(0))
    assert not torch.equal(windowed, gathered)


def test_decode_window_of_the_wrong_size_is_refused():
    from pdserve.kernels import DecodeWindow, WindowFill
    ks, vs, gen = random_seqs([20], 4, 2, 64, torch.float32)
    k_cache, tables = paged(ks, 8)
    v_cache, _ = paged(vs, 8)
    q = torch.randn(1, 4, 64, generator=gen)
    fill = WindowFill(pages=torch.zeros(2, dtype=torch.int64))

    def attend(win, fill=fill, kv=None):
        return paged_decode_attention(q, k_cache, v_cache, tables, torch.tensor([20]), 0.125,
                                      window=DecodeWindow(win, fill), kv=kv)

    for cap, match in ((16, "at least the longest"), (20, "multiple of the block size")):
        with pytest.raises(ValueError, match=match):
            attend(torch.zeros(1, 2, 2, cap, 64))
    shape = r"float32 \[num_seqs, 2, num_kv_heads, cap, head_dim\]"
    for win in (torch.zeros(1, 2, 4, 24, 64), torch.zeros(1, 2, 2, 24, 64, dtype=torch.bfloat16),
                torch.zeros(1, 2, 2, 24, 64)[..., :1, :, :].expand(1, 2, 2, 24, 64)):
        with pytest.raises(ValueError, match=shape):
            attend(win)
    rows = WindowFill(rows=torch.zeros(4, dtype=torch.int64))
    with pytest.raises(ValueError, match="kv must be a torch.Tensor"):
        attend(torch.zeros(1, 2, 2, 24, 64), rows)
    with pytest.raises(ValueError, match=r"kv must have shape"):
        attend(torch.zeros(1, 2, 2, 24, 64), rows, torch.zeros(1, 2, 64))


# ---- torch references against transformers (same SDPA call, same bits) ------------

class _Attn(torch.nn.Module):
    def __init__(self, group):
        super().__init__()
        self.num_key_value_groups, self.is_causal = group, True


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_references_are_bitwise_transformers_sdpa(dtype):
    hf = pytest.importorskip("transformers.integrations.sdpa_attention")
    num_heads, num_kv_heads, head_dim, scale = 8, 2, 64, 0.125
    ks, vs, gen = random_seqs([37], num_heads, num_kv_heads, head_dim, dtype)
    q = torch.randn(37, num_heads, head_dim, generator=gen).to(dtype)
    # transformers: [B, S, H, D] -> transpose(1, 2) -> [B, H, S, D]
    def to_hf(x):
        return x[None].transpose(1, 2)
    expected, _ = hf.sdpa_attention_forward(_Attn(4), to_hf(q), to_hf(ks[0]), to_hf(vs[0]), None,
                                            scaling=scale)  # [1, S, H, D]
    out = prefill_attention(q, ks[0], vs[0], cu([37]), scale,
                            native=False)  # SDPA (bf16: native kernel's tests)
    assert torch.equal(out, expected[0])

    k_cache, tables = paged(ks, 16)
    v_cache, _ = paged(vs, 16)
    expected, _ = hf.sdpa_attention_forward(_Attn(4), to_hf(q[-1:]), to_hf(ks[0]), to_hf(vs[0]),
                                            None, scaling=scale)
    out = paged_decode_attention(q[-1:], k_cache, v_cache, tables,
                                 torch.tensor([37], dtype=torch.int32), scale,
                                 native=False)  # SDPA (bf16: native kernel's tests)
    if dtype == torch.float32:
        assert torch.equal(out, expected[0])
    else:  # decode computes bfloat16 in float32 (attention_decode's docstring)
        want, _ = hf.sdpa_attention_forward(_Attn(4), *(to_hf(x).float() for x in (
            q[-1:], ks[0], vs[0])), None, scaling=scale)
        assert torch.equal(out, want[0].to(dtype))
        torch.testing.assert_close(out, expected[0], atol=2e-2, rtol=2e-2)


# ---- Triton (interpreted) against the torch references ---------------------------

DECODE_CASES = [
    # seq lens, heads, kv heads, head_dim, block_size, dtype
    ([1, 16, 17, 50], 8, 1, 64, 16, torch.float32),
    ([3, 32, 33], 4, 4, 128, 16, torch.bfloat16),
    ([64, 5], 4, 2, 64, 8, torch.bfloat16),
    ([70, 1], 8, 2, 128, 32, torch.float32),
]


@pytest.mark.parametrize("lens,num_heads,num_kv_heads,head_dim,block_size,dtype", DECODE_CASES)
def test_triton_decode_matches_torch(lens, num_heads, num_kv_heads, head_dim, block_size, dtype):
    ks, vs, gen = random_seqs(lens, num_heads, num_kv_heads, head_dim, dtype)
    k_cache, tables = paged(ks, block_size)
    v_cache, _ = paged(vs, block_size)
    q = torch.randn(len(lens), num_heads, head_dim, generator=gen).to(dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    args = (q, k_cache, v_cache, tables, seq_lens, head_dim ** -0.5)
    expected = paged_decode_attention(*args, backend="torch")
    out = paged_decode_attention(*args, backend="triton")
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out, expected, **(F32_TOL if dtype == torch.float32 else BF16_TOL))


PREFILL_CASES = [
    # q lens, seq lens (cached + new), heads, kv heads, head_dim, block_size, dtype
    ([1, 64, 65], [1, 64, 65], 4, 1, 64, 16, torch.float32),
    ([70, 3], [70, 3], 4, 2, 128, 16, torch.bfloat16),
    ([1, 40, 17], [33, 100, 17], 8, 1, 64, 16, torch.bfloat16),
    ([0, 33, 2], [5, 96, 2], 4, 4, 128, 32, torch.float32),
    # more sequences than the kernel's search reads at once (64), empty ones among them
    ([(i * 7) % 5 for i in range(70)], [(i * 7) % 5 + i % 3 for i in range(70)],
     2, 1, 16, 16, torch.float32),
]


@pytest.mark.parametrize("q_lens,lens,num_heads,num_kv_heads,head_dim,block_size,dtype",
                         PREFILL_CASES)
def test_triton_prefill_matches_torch(q_lens, lens, num_heads, num_kv_heads, head_dim,
                                      block_size, dtype):
    tol = F32_TOL if dtype == torch.float32 else BF16_TOL
    ks, vs, gen = random_seqs(lens, num_heads, num_kv_heads, head_dim, dtype)
    q = torch.randn(sum(q_lens), num_heads, head_dim, generator=gen).to(dtype)
    scale = head_dim ** -0.5
    if q_lens == lens:  # no cached prefix: the contiguous kernel applies too
        k, v = torch.cat(ks), torch.cat(vs)
        expected = prefill_attention(q, k, v, cu(q_lens), scale, backend="torch")
        torch.testing.assert_close(
            prefill_attention(q, k, v, cu(q_lens), scale, backend="triton"), expected, **tol)
    k_cache, tables = paged(ks, block_size)
    v_cache, _ = paged(vs, block_size)
    args = (q, k_cache, v_cache, cu(q_lens), torch.tensor(lens, dtype=torch.int32), tables, scale)
    expected = paged_prefill_attention(*args, backend="torch")
    torch.testing.assert_close(paged_prefill_attention(*args, backend="triton"), expected, **tol)


def test_triton_prefill_takes_strided_views_of_fused_qkv():
    num_heads, num_kv_heads, head_dim, lens = 4, 2, 64, [9, 20]
    qkv = torch.randn(sum(lens), (num_heads + 2 * num_kv_heads) * head_dim)
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim,
                         num_kv_heads * head_dim], dim=-1)
    q = q.view(-1, num_heads, head_dim)  # [T, H, D], row stride of qkv
    k = k.view(-1, num_kv_heads, head_dim)
    v = v.view(-1, num_kv_heads, head_dim)
    expected = prefill_attention(q.contiguous(), k.contiguous(), v.contiguous(), cu(lens), 0.125)
    out = prefill_attention(q, k, v, cu(lens), 0.125, backend="triton")
    torch.testing.assert_close(out, expected, **F32_TOL)


# ---- errors -----------------------------------------------------------------------

def _decode_args():
    q = torch.randn(2, 4, 64)
    k_cache = torch.randn(6, 16, 2, 64)
    return dict(q=q, k_cache=k_cache, v_cache=k_cache.clone(),
                block_tables=torch.zeros(2, 3, dtype=torch.int32),
                seq_lens=torch.ones(2, dtype=torch.int32), scale=0.125)


@pytest.mark.parametrize("change,message", [
    (dict(q=torch.randn(3, 4)),
     r"q must have shape \[num_seqs, num_heads, head_dim\], got \(3, 4\)"),
    (dict(q=torch.randn(2, 4, 64, dtype=torch.float64)), "q must have dtype float32 or bfloat16"),
    (dict(q=torch.randn(2, 3, 64)), r"num_heads \(3\) must be a multiple of num_kv_heads \(2\)"),
    (dict(q=torch.randn(2, 4, 32)), "k_cache must have shape .* head_dim=32 .*from q"),
    (dict(v_cache=torch.randn(6, 16, 2, 64).bfloat16()), "v_cache must have the dtype of q"),
    (dict(k_cache=torch.randn(6, 2, 16, 64).transpose(1, 2)), "k_cache must be contiguous"),
    (dict(block_tables=torch.zeros(2, 3)), "block_tables must have dtype int32 or int64"),
    (dict(seq_lens=torch.ones(3, dtype=torch.int32)), "seq_lens must have shape .*num_seqs=2"),
    (dict(scale=-1.0), "scale must be a positive finite number"),
])
def test_decode_errors(change, message):
    with pytest.raises(ValueError, match=message):
        paged_decode_attention(**{**_decode_args(), **change})


def test_prefill_errors():
    q, k = torch.randn(5, 4, 64), torch.randn(5, 2, 64)
    with pytest.raises(ValueError, match=r"cu_seqlens must have shape \[num_seqs \+ 1\]"):
        prefill_attention(q, k, k, torch.zeros(2, 1, dtype=torch.int32), 0.1)
    with pytest.raises(ValueError, match="must start at 0, never decrease and end at the number"):
        prefill_attention(q, k, k, cu([2, 2]), 0.1)
    with pytest.raises(ValueError, match="k must have shape .*T=5"):
        prefill_attention(q, k[:4], k[:4], cu([5]), 0.1)
    k_cache = torch.randn(4, 4, 2, 64)
    tables = torch.arange(4, dtype=torch.int32)[None]
    with pytest.raises(ValueError, match=r"has 5 new tokens but seq_lens\[0\] is only 3"):
        paged_prefill_attention(q, k_cache, k_cache, cu([5]), torch.tensor([3]), tables, 0.1)
    with pytest.raises(ValueError, match="needs 5 blocks for 17 tokens"):
        paged_prefill_attention(q, k_cache, k_cache, cu([5]), torch.tensor([17]), tables, 0.1)
