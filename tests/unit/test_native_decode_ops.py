"""The native bfloat16 norm, rotary and silu * up (pdserve/kernels/native/decode_ops.c) against
the torch path they replace: bit for bit on random inputs, with the strides the model passes
(rows of a wider tensor, q and k heads of a fused qkv output, halves of a fused gate_up
output), at 1 row and at 16 and more; and a bfloat16 model's greedy tokens with and without
them."""
from __future__ import annotations

import pytest
import torch

from pdserve import kernels
from pdserve.common.sampling import SamplingParams
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.kernels import attention_prefill, native
from pdserve.kernels.native import decode_ops
from pdserve.kernels.rotary import _rotate_torch

WHY = native.why_unavailable()
pytestmark = pytest.mark.skipif(WHY is not None, reason=WHY or "")

BF16 = torch.bfloat16


def wide(rows: int, cols: int, gen: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    """[rows, cols] bfloat16 whose rows are strided: the first cols of a wider tensor."""
    return (torch.randn(rows, cols + 40, generator=gen) * scale).to(BF16)[:, :cols]


@pytest.mark.parametrize("rows", [1, 3, 16, 64])
@pytest.mark.parametrize("hidden", [576, 2048, 64, 100])
def test_rms_norm_with_the_residual_add_is_the_torch_path_bit_for_bit(rows, hidden):
    gen = torch.Generator().manual_seed(rows * 1000 + hidden)
    x, weight = wide(rows, hidden, gen, 4.0), (torch.rand(hidden, generator=gen) * 2).to(BF16)
    residual = (torch.randn(rows, hidden, generator=gen) * 8).to(BF16)
    eps = 1e-5
    assert decode_ops.runs(x)

    assert torch.equal(kernels.rms_norm(x, weight, eps),
                       kernels.rms_norm(x, weight, eps, backend="torch"))

    # a new sum: the residual is left as it was
    before = residual.clone()
    out, new_res = kernels.rms_norm(x, weight, eps, residual)
    ref_out, ref_res = kernels.rms_norm(x, weight, eps, residual, backend="torch")
    assert torch.equal(residual, before)
    assert torch.equal(new_res, ref_res) and torch.equal(out, ref_out)

    # the model's call: the sum into the residual, unchecked
    ref_res = before.clone()
    ref_out, _ = kernels.rms_norm(x, weight, eps, ref_res, backend="torch", add_in_place=True)
    out, new_res = kernels.rms_norm(x, weight, eps, residual, add_in_place=True, check=False)
    assert new_res is residual
    assert torch.equal(residual, ref_res) and torch.equal(out, ref_out)


def test_rms_norm_keeps_its_argument_checks_in_bfloat16():
    x, w = torch.randn(4, 32, dtype=BF16), torch.ones(32, dtype=BF16)
    with pytest.raises(ValueError):
        kernels.rms_norm(x.view(2, 2, 32), w, 1e-6)
    with pytest.raises(ValueError):
        kernels.rms_norm(x, w.float(), 1e-6)
    with pytest.raises(ValueError):
        kernels.rms_norm(x, w, -1.0)


@pytest.mark.parametrize("tokens", [1, 16, 33])
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(9, 3, 64), (4, 2, 16), (2, 1, 128)])
def test_rotate_of_q_and_k_in_the_fused_qkv_output_is_the_torch_path_bit_for_bit(
        tokens, heads, kv_heads, head_dim):
    gen = torch.Generator().manual_seed(tokens * 100 + head_dim)
    cache = torch.randn(4096, head_dim, generator=gen)     # any float32 cos/sin table
    positions = torch.randint(0, 4096, (tokens,), generator=gen)
    tables = kernels.rotary_tables(positions, cache, BF16)
    qkv = (torch.randn(tokens, heads + 2 * kv_heads, head_dim, generator=gen) * 3).to(BF16)
    expected = qkv.clone()
    _rotate_torch(expected[:, :heads + kv_heads], tables)
    qk = qkv[:, :heads + kv_heads]                         # strided: v's heads beside
    assert kernels.rotate_(qk, tables) is qk
    assert torch.equal(qkv, expected)                      # v untouched too


@pytest.mark.parametrize("rows", [1, 16, 40])
@pytest.mark.parametrize("inter", [1536, 192])
@pytest.mark.parametrize("fused", [True, False])
def test_silu_times_up_is_the_torch_path_bit_for_bit(rows, inter, fused):
    gen = torch.Generator().manual_seed(rows + inter)
    # a range wide enough to reach exp's overflow and underflow (|x| > 100)
    gate_up = (torch.randn(rows, 2 * inter, generator=gen) * 30).to(BF16)
    if fused:                                 # the halves of the fused output (int4 path)
        gate, up = gate_up.chunk(2, dim=-1)
    else:                                     # two GEMMs' outputs
        gate, up = gate_up[:, :inter].contiguous(), gate_up[:, inter:].contiguous()
    expected = torch.nn.functional.silu(gate) * up
    out = decode_ops.silu_mul(gate.clone() if not fused else gate, up)
    assert torch.equal(out, expected)


def test_silu_times_up_with_a_short_last_vector_is_within_one_rounding():
    """torch computes the elements past its last 32-wide vector with std::exp, not SLEEF's
    expf: there the two can differ by one bfloat16 rounding of silu (widths of 16 and more
    that are not a multiple of 32; every Llama-family model's is)."""
    gen = torch.Generator().manual_seed(7)
    gate, up = (torch.randn(2, 2, 1000, generator=gen) * 6).to(BF16).unbind(1)
    expected = torch.nn.functional.silu(gate) * up
    out = decode_ops.silu_mul(gate.clone(), up)
    # one rounding of silu, carried through the product, and the product's own: 2 ulps
    diff = (out.float() - expected.float()).abs()
    assert (diff <= expected.float().abs() * 2.0 ** -6).all()


def test_float32_and_the_switch_keep_torch_ops(monkeypatch):
    assert not decode_ops.runs(torch.zeros(2, 8))
    assert not decode_ops.runs(torch.zeros(8, 2, dtype=BF16).t())  # no unit last stride
    monkeypatch.setenv(native.ENV, "0")
    native.why_unavailable.cache_clear()
    try:
        assert not decode_ops.runs(torch.zeros(2, 8, dtype=BF16))
    finally:
        monkeypatch.undo()
        native.why_unavailable.cache_clear()


def greedy_tokens(model_dir, prompts: list[list[int]], n: int) -> list[list[int]]:
    engine = Engine(EngineConfig(model=str(model_dir), dtype="bfloat16", block_size=4,
                                 num_kv_blocks=128, max_num_batched_tokens=64,
                                 enable_prefix_caching=False), detokenize=False)
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.req_id] += out.new_token_ids
    return [tokens[str(i)] for i in range(len(prompts))]


def test_bfloat16_greedy_tokens_are_the_same_with_and_without_the_native_ops(
        tiny_model, monkeypatch):
    model_dir = tiny_model("llama")
    prompts = [list(range(5 + i, 19 + 3 * i)) for i in range(5)]
    calls = {name: 0 for name in ("rms_norm", "rotate_", "silu_mul")}

    def counted(name):
        fn = getattr(decode_ops, name)

        def call(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return call

    for name in calls:
        monkeypatch.setattr(decode_ops, name, counted(name))
    # the prefill's attention on SDPA in both runs: the native one has other bits of its own
    monkeypatch.setattr(attention_prefill, "native_prefill_why_not", lambda *a: "pinned")
    with_native = greedy_tokens(model_dir, prompts, 12)
    assert all(calls.values()), calls        # each ran, in prefill and in decode steps
    monkeypatch.setenv(native.ENV, "0")
    native.why_unavailable.cache_clear()
    try:
        without = greedy_tokens(model_dir, prompts, 12)
    finally:
        monkeypatch.undo()
        native.why_unavailable.cache_clear()
    assert with_native == without
