"""A linear layer over weights kept as 4-bit or 8-bit integers with a scale and a zero per
32 inputs (W4A16 / W8A16): GGUF's Q4_0, Q4_1 and Q4_K blocks (model/quant.py) and Q8_0's.

    w[n, k] = scale[n, k // 32] * q[n, k] + zero[n, k // 32]

- 4 bits: ``q`` is stored biased, 0..15 for -8..7: ``qweight`` uint8 [N, K / 2] holds input
  2j in the low nibble and 2j + 1 in the high one (``pack_int4`` makes it), and the kernel
  subtracts the 8. Q4_0's ``zero`` is 0, Q4_1's ``m + 8 d``.
- 8 bits: ``qweight`` int8 [N, K] holds ``q`` itself; Q8_0's ``zero`` is 0.

``scales`` and ``zeros`` [N, K / 32] are in the activations' dtype (the A16 of the name:
float32 works too). Each weight is formed in float32 and rounded to that dtype, then the
products are summed in float32, so the torch reference (dequantize, round, one float32
GEMM) and the Triton kernel differ only in the order of the sum. The Triton kernel reads
a weight's half byte or byte once from memory and never writes the dequantized weight:
at a decode step's few rows the GEMM's time is the weights' bytes over the bandwidth, a
quarter (8 bits: a half) of bfloat16's.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from pdserve.kernels._dispatch import (
    FLOAT_DTYPES,
    INTERPRET_AT_IMPORT,
    check_same_dtype,
    check_tensor,
    last_dim_contiguous,
    launch,
    pick_backend,
    tl,
    triton,
)

GROUP = 32                      # inputs per scale and zero
QWEIGHT_DTYPES = {4: torch.uint8, 8: torch.int8}


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K] of 4-bit values 0..15 → uint8 [N, K / 2], input 2j in the low nibble."""
    if q.dim() != 2 or q.shape[1] % 2:
        raise ValueError(f"q must have shape [N, K] with K even, got {tuple(q.shape)}")
    q = q.to(torch.uint8)
    return q[:, 0::2] | (q[:, 1::2] << 4)


def quant_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                 zeros: torch.Tensor, bits: int, bias: torch.Tensor | None = None,
                 backend: str | None = None) -> torch.Tensor:
    """x [M, K] @ w.T (+ bias [N]) → [M, N] in x's dtype, w as the module docstring says."""
    if bits not in QWEIGHT_DTYPES:
        raise ValueError(f"bits must be 4 or 8, got {bits!r}")
    dims: dict[str, tuple[int, str]] = {}
    check_tensor("x", x, "[M, K]", FLOAT_DTYPES, dims)
    check_tensor("qweight", qweight, "[N, packed K]", (QWEIGHT_DTYPES[bits],), dims, x.device)
    check_tensor("scales", scales, "[N, groups]", FLOAT_DTYPES, dims, x.device)
    check_tensor("zeros", zeros, "[N, groups]", FLOAT_DTYPES, dims, x.device)
    check_same_dtype("scales", scales, "x", x)
    check_same_dtype("zeros", zeros, "x", x)
    k = x.shape[1]
    if k % GROUP or qweight.shape[1] * (8 // bits) != k or scales.shape[1] * GROUP != k:
        raise ValueError(f"with {bits} bits and K={k} (a multiple of {GROUP}), qweight must "
                         f"have K * {bits} / 8 columns and scales K / {GROUP}; got qweight "
                         f"{tuple(qweight.shape)}, scales {tuple(scales.shape)}")
    if bias is not None:
        check_tensor("bias", bias, "[N]", FLOAT_DTYPES, dims, x.device)
        check_same_dtype("bias", bias, "x", x)
    if pick_backend(backend, x.device) == "torch":
        return _quant_linear_torch(x, qweight, scales, zeros, bits, bias)
    return _quant_linear_triton(x, qweight, scales, zeros, bits, bias)


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
               bits: int) -> torch.Tensor:
    """The weight [N, K] in float32, each value as the kernel forms it before rounding."""
    if bits == 4:
        q = torch.stack([qweight & 0x0F, qweight >> 4], dim=-1).flatten(1).float() - 8
    else:
        q = qweight.float()
    return (scales.float().repeat_interleave(GROUP, 1) * q
            + zeros.float().repeat_interleave(GROUP, 1))


def _quant_linear_torch(x, qweight, scales, zeros, bits, bias):
    w = dequantize(qweight, scales, zeros, bits).to(x.dtype).float()
    return F.linear(x.float(), w, None if bias is None else bias.float()).to(x.dtype)


def _quant_linear_triton(x, qweight, scales, zeros, bits, bias):
    m, k = x.shape
    n = qweight.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    x, qweight = last_dim_contiguous(x), last_dim_contiguous(qweight)
    scales, zeros = last_dim_contiguous(scales), last_dim_contiguous(zeros)
    block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
    block_n = 64
    block_k = 64 if k % 64 == 0 else GROUP
    has_bias = bias is not None
    launch(_quant_linear_kernel, (triton.cdiv(m, block_m), triton.cdiv(n, block_n)),
           x, qweight, scales, zeros, bias if has_bias else scales, out,
           m, n, k, x.stride(0), qweight.stride(0), scales.stride(0), zeros.stride(0),
           out.stride(0),
           BITS=bits, HAS_BIAS=has_bias, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
           # float32 activations: a full-precision dot, not TF32. The interpreter's bfloat16
           # arithmetic is wrong, so there every dtype takes the float32 dot (of the same
           # rounded values: the products are exact in float32 either way).
           DOT_F32=x.dtype == torch.float32 or INTERPRET_AT_IMPORT,
           num_warps=4)
    return out


if triton is not None:

    @triton.jit
    def _quant_linear_kernel(x_ptr, q_ptr, s_ptr, z_ptr, b_ptr, out_ptr, M, N, K,
                             stride_x, stride_q, stride_s, stride_z, stride_out,
                             BITS: tl.constexpr, HAS_BIAS: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr):
        rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok, col_ok = rows < M, cols < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < K
            x = tl.load(x_ptr + rows[:, None] * stride_x + ks[None, :],
                        mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
            w_mask = col_ok[:, None] & k_ok[None, :]
            if BITS == 4:
                byte = tl.load(q_ptr + cols[:, None] * stride_q + (ks // 2)[None, :],
                               mask=w_mask, other=0).to(tl.int32)
                q = ((byte >> ((ks % 2) * 4)[None, :]) & 0xF).to(tl.float32) - 8.0
            else:
                q = tl.load(q_ptr + cols[:, None] * stride_q + ks[None, :],
                            mask=w_mask, other=0).to(tl.float32)
            groups = (ks // 32)[None, :]
            s = tl.load(s_ptr + cols[:, None] * stride_s + groups, mask=w_mask,
                        other=0.0).to(tl.float32)
            z = tl.load(z_ptr + cols[:, None] * stride_z + groups, mask=w_mask,
                        other=0.0).to(tl.float32)
            w = (s * q + z).to(x_ptr.dtype.element_ty)                       # [BN, BK]
            if DOT_F32:
                acc += tl.dot(x, tl.trans(w.to(tl.float32)), input_precision="ieee")
            else:
                acc += tl.dot(x.to(x_ptr.dtype.element_ty), tl.trans(w))
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])
