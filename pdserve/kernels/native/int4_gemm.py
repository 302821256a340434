"""int4 weights x int8 activations on AVX512-VNNI (int4_gemm.c), for Int4Linear on the CPU.

Weights are Q4_1's blocks, ``w = d * q + m`` per 32 inputs with d and m float16, as GGUF
stores Q4_1 (Q4_0 is ``m = -8 d``). Activations are quantized on each call to int8 per 32
inputs with a float32 scale, and the row sums kept (llama.cpp's Q8_1): the error against
the exact GEMM is that rounding's (benchmarks/RESULTS.md), the products and sums are exact
in int32 and the scales applied in float32.
"""
from __future__ import annotations

import ctypes
import functools

import torch

from pdserve.kernels.native import function

GROUP = 32
BLOCK_ROWS = 16         # outputs per block: one per 512-bit int32 lane
BLOCK_BYTES = 320       # per block of 16 outputs and group: 256 of nibbles, 32 of d, 32 of m

FLOAT_DTYPES = (torch.bfloat16, torch.float32)   # activations and outputs it takes
_P, _I = ctypes.c_void_p, ctypes.c_int


@functools.cache  # declaring the signature costs more than a batch-1 call's arguments
def _mm():
    return function("vnni_int4_mm", [_P, _I, _I, _I, _I, _P, _P, _I])


@functools.cache
def _weight():
    return function("vnni_int4_weight", [_P, _I, _I, _P, _I], None)


def pack(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """q uint8 [N, K] in 0..15, d and m [N, K / 32] (rounded to float16 here) → the kernel's
    uint8 [N / 16, K / 32, 320]: per block of 16 outputs and group, 256 bytes of nibbles
    (byte b of vector j < 4 = that byte of vector j | of vector j + 4 << 4, lane n of
    vector j holding q[n, 4j .. 4j + 3]), then d and m as 16 float16 each. Raises
    ValueError for a shape the kernel cannot take or a scale float16 cannot hold."""
    n, k = q.shape
    if n % BLOCK_ROWS or k % GROUP:
        raise ValueError(f"shape {n}x{k}: outputs must be a multiple of {BLOCK_ROWS}, "
                         f"inputs of {GROUP}")
    halves = [t.to(torch.float16) for t in (d, m)]
    if not all(torch.isfinite(t).all() for t in halves):
        raise ValueError("a scale or minimum overflows float16")
    nb, g = n // BLOCK_ROWS, k // GROUP
    v = q.view(nb, BLOCK_ROWS, g, 8, 4).permute(0, 2, 3, 1, 4)        # [NB, G, 8 j, 16 n, 4]
    v = v.reshape(nb, g, 8, 64)
    nibbles = (v[:, :, :4] | (v[:, :, 4:] << 4)).reshape(nb, g, 256)
    halves = [t.view(nb, BLOCK_ROWS, g).transpose(1, 2).contiguous().view(torch.uint8)
              for t in halves]                                          # [NB, G, 32] each
    return torch.cat([nibbles, *halves], dim=-1).contiguous()          # [NB, G, 320]


def int4_mm(x: torch.Tensor, packed: torch.Tensor, out_features: int,
            out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [M, K] bfloat16 or float32, contiguous, @ the packed weight.T → [M, N] in
    ``out_dtype`` (default x's). The caller checks shapes (Int4Linear built both)."""
    rows, k = x.shape
    out_dtype = out_dtype or x.dtype
    if x.dtype not in FLOAT_DTYPES or out_dtype not in FLOAT_DTYPES or not x.is_cpu \
            or k != packed.shape[1] * GROUP or out_features > packed.shape[0] * BLOCK_ROWS:
        raise ValueError(f"int4_mm: x {str(x.dtype).removeprefix('torch.')} {list(x.shape)} "
                         f"on {x.device.type} into {str(out_dtype).removeprefix('torch.')}, "
                         f"for a weight of {packed.shape[0] * BLOCK_ROWS} x "
                         f"{packed.shape[1] * GROUP}: it takes bfloat16 or float32 on the "
                         f"CPU, K equal to the weight's")
    out = torch.empty(rows, out_features, dtype=out_dtype)
    if rows and _mm()(x.data_ptr(), x.dtype == torch.bfloat16, rows, k, out_features,
                      packed.data_ptr(), out.data_ptr(), out.dtype == torch.bfloat16):
        raise MemoryError("vnni_int4_mm: no memory for the quantized activations")
    return out


def weight(packed: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The weight [N, K] in ``dtype`` (bfloat16: each d * q + m rounded once; float32:
    exact where d * q + m is)."""
    nb, g, _ = packed.shape
    out = torch.empty(nb * BLOCK_ROWS, g * GROUP, dtype=dtype)
    _weight()(packed.data_ptr(), g * GROUP, nb * BLOCK_ROWS, out.data_ptr(),
              dtype == torch.bfloat16)
    return out


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel's activation quantization in torch (the reference's): x [M, K] → xq
    [M, G, 32] (integer values, float32), sx and sumx float32 [M, G]."""
    xg = x.float().view(x.shape[0], -1, GROUP)                       # [M, G, 32]
    amax = xg.abs().amax(-1)
    inv = torch.where(amax > 1e-30, torch.tensor(127.0) / amax, torch.zeros(()))
    xq = torch.round(xg * inv[..., None])
    return xq, amax / 127.0, xg.sum(-1)


def reference(x: torch.Tensor, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor
              ) -> torch.Tensor:
    """What the kernel computes, in float64: the same int8 activations, float16 d and m."""
    xq, sx, sumx = (t.double() for t in quantize_activations(x))
    n, k = q.shape
    qg = q.double().view(n, k // GROUP, GROUP)                        # [N, G, 32]
    dots = torch.einsum("rgk,ngk->rng", xq, qg)                       # [M, N, G]
    d64, m64 = d.half().double(), m.half().double()
    return (dots * sx[:, None] * d64).sum(-1) + sumx @ m64.T
