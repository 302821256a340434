"""The native decode attention (kernels/native/decode_attention.c) against the torch path it
replaces on bfloat16 and float16 caches (``native=False``: float32 SDPA, rounded once), on
random paged caches: pages scattered, unused block-table entries garbage, lengths 0, 1,
odd, past a block, long enough for the threaded and the split (flash-decoding) paths; and
an engine that decodes with it."""
import pytest
import torch

from pdserve.kernels import (
    attention_prefill,
    native,
    native_decode_why_not,
    paged_decode_attention,
    store_kv,
)

WHY = native.why_unavailable()
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"native kernels: {WHY}")

# One rounding each, of nearly the same float32 value: at most one ulp apart
ULP = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10, torch.float32: 2.0**-20}


def paged_case(lens: list[int], num_heads: int, num_kv_heads: int, head_dim: int,
               dtype: torch.dtype, block_size: int = 16, seed: int = 0):
    """q [B, H, D], caches with every sequence's pages scattered over a cache twice the size
    needed, block tables whose unused entries are garbage (never read)."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-n // block_size) for n in lens]
    width = max(need) + 2
    num_blocks = 2 * sum(need) + 3
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = (torch.randn(shape, generator=gen).to(dtype) for _ in range(2))
    pages = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.randint(-(2**30), 2**30, (len(lens), width), generator=gen,
                           dtype=torch.int32)                           # garbage
    for b, n in enumerate(need):
        tables[b, :n] = torch.tensor([pages.pop() for _ in range(n)], dtype=torch.int32)
    q = (torch.randn(len(lens), num_heads, head_dim, generator=gen) * 2).to(dtype)
    return q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32)


def assert_one_ulp(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), rtol=ULP[got.dtype], atol=1e-6)


LENS = {1: [[37]], 16: [[0, 1, 2, 15, 16, 17, 33, 64, 100, 129, 255, 256, 257, 320, 5, 0]]}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group", [1, 3, 4, 5, 8])  # 5: the generic copy
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("batch", [1, 16])
def test_native_matches_the_torch_path(dtype, group, head_dim, batch):
    for lens in LENS[batch]:
        case = paged_case(lens, 3 * group, 3, head_dim, dtype)
        scale = head_dim**-0.5
        got = paged_decode_attention(*case, scale, backend="torch", native=True)
        want = paged_decode_attention(*case, scale, backend="torch", native=False)
        assert_one_ulp(got, want)
        # the default on these dtypes is the native kernel: the same bits
        assert torch.equal(paged_decode_attention(*case, scale), got)
        for b, n in enumerate(lens):
            if n == 0:
                assert not got[b].any()  # batch padding: zeros


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("batch,length,block_size", [(1, 3001, 16), (1, 700, 5), (2, 1500, 16),
                                                     (8, 1100, 16)])
def test_threaded_and_split_contexts(threads, batch, length, block_size):
    """Long contexts: the threaded path, and at few (sequence, kv head) pairs the chunks
    combined by their max and sum (flash-decoding); one thread runs them whole."""
    lens = [length - 7 * b for b in range(batch)]
    case = paged_case(lens, 8, 2, 64, torch.bfloat16, block_size=block_size, seed=batch)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = paged_decode_attention(*case, 0.125, native=True)
    finally:
        torch.set_num_threads(before)
    assert_one_ulp(got, paged_decode_attention(*case, 0.125, native=False))


def test_float32_keeps_sdpa_unless_asked():
    """float32 serves transformers' bits through SDPA; the kernel takes it when asked."""
    case = paged_case([5, 40, 0, 17], 6, 2, 64, torch.float32)
    sdpa = paged_decode_attention(*case, 0.125, native=False)
    assert torch.equal(paged_decode_attention(*case, 0.125), sdpa)
    assert native_decode_why_not(torch.float32, 6, 2, 64, "cpu") is not None
    assert_one_ulp(paged_decode_attention(*case, 0.125, native=True), sdpa)


def test_storing_the_new_tokens_in_the_same_call():
    """new_kv: the same cache bytes as store_kv, then the same attention as after it."""
    lens = [1, 17, 40, 0]
    q, k_cache, v_cache, tables, seq_lens = paged_case(lens, 9, 3, 64, torch.bfloat16)
    gen = torch.Generator().manual_seed(1)
    kv = torch.randn(4, 6, 64, generator=gen).bfloat16()             # [B, 2 KVH, D]
    k, v = kv[:, :3], kv[:, 3:]                                      # views, as the model's
    slots = torch.tensor([int(tables[b, (n - 1) // 16]) * 16 + (n - 1) % 16 if n else -1
                          for b, n in enumerate(lens)])
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    store_kv(k, v, ref_k, ref_v, slots)
    want = paged_decode_attention(q, ref_k, ref_v, tables, seq_lens, 0.125, native=False)
    got = paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, 0.125, native=True,
                                 new_kv=(k, v, slots))
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)
    assert_one_ulp(got, want)


def test_what_it_refuses():
    case = paged_case([5, 20], 4, 2, 64, torch.bfloat16)
    q, k_cache, v_cache, tables, lens = case
    bad = tables.clone()
    bad[1, 1] = k_cache.shape[0]  # a used entry past the cache
    with pytest.raises(IndexError, match="outside the cache"):
        paged_decode_attention(q, k_cache, v_cache, bad, lens, 0.125, native=True)
    with pytest.raises(ValueError, match="block_tables has"):
        paged_decode_attention(q, k_cache, v_cache, tables[:, :1], lens, 0.125, native=True)
    odd = paged_case([5], 4, 2, 24, torch.bfloat16)
    with pytest.raises(RuntimeError, match="head_dim 24"):
        paged_decode_attention(*odd, 0.125, native=True)
    # a caller that skipped why_not (native=True, check=False) gets an error, not a write
    # past the kernel's per-task arrays: 17 query heads over one kv head, head_dim 272
    from pdserve.kernels.native.decode_attention import decode_attention
    for shape in ((17, 1, 64), (2, 1, 272)):
        wide = paged_case([5], *shape, torch.bfloat16)
        with pytest.raises(ValueError, match="native decode attention"):
            decode_attention(*wide, 0.125)
    # where it cannot run, the default is the torch path, not an error
    assert native_decode_why_not(torch.bfloat16, 4, 2, 24, "cpu") is not None
    assert torch.equal(paged_decode_attention(*odd, 0.125),
                       paged_decode_attention(*odd, 0.125, native=False))


def test_an_engine_decodes_with_it(tiny_model, monkeypatch):
    """A bfloat16 engine runs the native attention (no windows, no gather) and samples
    the greedy tokens of the SDPA path on this workload. (The kernels differ in summation
    order, so a near tie in bfloat16 logits could flip a token: none here.)"""
    from pdserve.common.sampling import SamplingParams
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.engine import Engine

    def run() -> tuple[Engine, dict[str, list[int]]]:
        engine = Engine(EngineConfig(model=str(tiny_model("llama")), dtype="bfloat16",
                                     block_size=4, num_kv_blocks=256, max_num_seqs=4),
                        detokenize=False)
        for i, n in enumerate((3, 9, 17, 30)):
            prompt = [(5 * i + 3 * j) % 90 + 3 for j in range(n)]
            engine.add_request(str(i), prompt, SamplingParams(max_tokens=24, temperature=0,
                                                              ignore_eos=True))
        got: dict[str, list[int]] = {}
        while engine.has_unfinished():
            for out in engine.step():
                got.setdefault(out.req_id, []).extend(out.new_token_ids)
        return engine, got

    # the prefill's attention on SDPA in both runs: the native one has other bits of its own
    monkeypatch.setattr(attention_prefill, "native_prefill_why_not", lambda *a: "pinned")
    engine, tokens = run()
    assert engine.runner.native_decode and engine.runner.decode_windows is None
    assert "native" in engine.runner.describe_decode_attention()
    monkeypatch.setenv(native.ENV, "0")
    native.why_unavailable.cache_clear()
    try:
        reference, want = run()
    finally:
        monkeypatch.undo()
        native.why_unavailable.cache_clear()
    assert not reference.runner.native_decode
    assert "SDPA" in reference.runner.describe_decode_attention()
    assert tokens == want


def test_int64_indices_and_a_strided_query():
    """q a view of a fused qkv output (strided), int64 block tables and lengths."""
    q, k_cache, v_cache, tables, lens = paged_case([3, 50, 17], 9, 3, 64, torch.bfloat16)
    qkv = torch.randn(3, 15, 64).bfloat16()
    qkv[:, :9] = q
    view = qkv[:, :9]                                                 # [B, H, D], strided
    got = paged_decode_attention(view, k_cache, v_cache, tables.long(), lens.long(), 0.125,
                                 native=True)
    want = paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.125, native=False)
    assert_one_ulp(got, want)
