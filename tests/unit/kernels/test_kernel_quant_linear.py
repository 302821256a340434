"""quant_linear (W4A16 / W8A16): the torch reference against the weights computed here in
float64 from GGUF's formulas, the interpreted Triton kernel against the reference, and
the 4-bit layout against model/quant.py's reading of the same blocks."""
from __future__ import annotations

import pytest
import torch

from pdserve.kernels.quant_linear import dequantize, pack_int4, quant_linear
from pdserve.model.quant import Int4Linear

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def blocks(n: int, k: int, bits: int, seed: int = 0):
    """Random (q as stored, scale, zero float32 [N, K / 32]) like Q4_1 (4 bits) or Q8_0."""
    gen = torch.Generator().manual_seed(seed)
    if bits == 4:
        q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
        zero = (torch.randn(n, k // 32, generator=gen) * 0.05).half().float()
    else:
        q = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
        zero = torch.zeros(n, k // 32)
    scale = (torch.rand(n, k // 32, generator=gen) * 0.02 + 0.001).half().float()
    return q, scale, zero


def weight64(q, scale, zero, bits):
    """GGUF's dequantization, in float64: Q4 ``d (q - 8) + zero``, Q8_0 ``d q``."""
    qf = q.double() - (8 if bits == 4 else 0)
    return scale.double().repeat_interleave(32, 1) * qf + zero.double().repeat_interleave(32, 1)


def stored(q, bits):
    return pack_int4(q) if bits == 4 else q


@pytest.mark.parametrize("bits", [4, 8])
def test_the_reference_is_ggufs_formula(bits):
    q, scale, zero = blocks(48, 96, bits)
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(1))
    assert torch.equal(dequantize(stored(q, bits), scale, zero, bits).double(),
                       weight64(q, scale, zero, bits))  # every weight exact in float32
    out = quant_linear(x, stored(q, bits), scale, zero, bits, backend="torch")
    torch.testing.assert_close(out.double(), x.double() @ weight64(q, scale, zero, bits).T,
                               atol=1e-5, rtol=1e-5)


def test_the_4_bit_layout_reads_as_model_quant_does():
    q, scale, zero = blocks(64, 128, 4)
    assert torch.equal(dequantize(pack_int4(q), scale, zero, 4),
                       Int4Linear(q, scale, zero).dequantized())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("m,n,k,bias", [(1, 96, 128, False), (3, 64, 96, True),
                                        (40, 130, 64, True), (70, 64, 64, False)])
def test_triton_matches_the_reference(dtype, bits, m, n, k, bias):
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    q, scale, zero = blocks(n, k, bits, seed=n + k)
    wide = torch.randn(m, 2 * k, generator=gen).to(dtype)
    x = wide[:, :k]                                    # rows with a stride: any works
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    args = (stored(q, bits), scale.to(dtype), zero.to(dtype), bits, b)
    ref = quant_linear(x, *args, backend="torch")
    out = quant_linear(x, *args, backend="triton")
    assert out.dtype == dtype and out.shape == (m, n)
    # float32: the order of the sum; bfloat16: the interpreter truncates where a GPU
    # rounds the formed weight (an ulp of bfloat16 in some weights), and the output
    tol = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 3e-2}[dtype]
    scale_of = ref.float().abs().max().item()
    torch.testing.assert_close(out.float(), ref.float(), atol=tol * scale_of, rtol=0)


@pytest.mark.parametrize("bad,words", [
    (dict(bits=3), "bits must be 4 or 8"),
    (dict(k=48), "a multiple of 32"),
    (dict(qdtype=torch.int8), "qweight must have dtype uint8"),
    (dict(sdtype=torch.float16), "scales must have the dtype of x"),
    (dict(x=[[1.0]]), "x must be a torch.Tensor"),
])
def test_bad_inputs_are_named(bad, words):
    k = bad.get("k", 64)
    q, scale, zero = blocks(32, 64, 4)
    qweight = pack_int4(q).to(bad.get("qdtype", torch.uint8))
    scales = scale.to(bad.get("sdtype", torch.float32))
    x = bad.get("x", torch.randn(2, k))
    if k != 64:
        qweight, scales, zero = qweight[:, : k // 2], scales[:, :1], zero[:, :1]
    with pytest.raises(ValueError, match=words):
        quant_linear(x, qweight, scales, zero, bad.get("bits", 4), backend="torch")
