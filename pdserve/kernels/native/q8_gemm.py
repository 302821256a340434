"""Q8_0 weights x int8 activations on AVX512-VNNI (q8_gemm.c), for the LM head and the
embedding lookup of a model whose token embedding GGUF stores as Q8_0 (model/q8_head.py).

Weights are Q8_0's blocks, ``w = d * q`` per 32 inputs with q int8 and d float16. The
activations are quantized on each call to int8 per 32 inputs with a float32 scale (llama.cpp's
Q8_0 x Q8_0): the products are exact in int32, the scales applied in float32, and the error
against the exact GEMM is that rounding's. Logits come out in float32.
"""
from __future__ import annotations

import ctypes
import functools

import numpy as np
import torch

from pdserve.kernels.native import function

GROUP = 32
BLOCK_ROWS = 16         # outputs per block: one per 512-bit int32 lane
BLOCK_BYTES = 544       # per block of 16 outputs and group: 512 of q + 128, 32 of d
GGUF_BLOCK_BYTES = 34   # Q8_0 in the file: f16 d, then 32 int8

_P, _I = ctypes.c_void_p, ctypes.c_int


@functools.cache   # once: the decode step calls both, and a lookup is a few microseconds
def _mm():
    return function("q8_mm", [_P, _I, _I, _I, _I, _P, _P])


@functools.cache
def _rows():
    return function("q8_rows", [_P, _I, _I, _P, _I, _P, _I])


def unpack_gguf(raw: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """A Q8_0 tensor's bytes [N, G * 34] → q int8 [N, G * 32], d float16 [N, G]."""
    n = raw.shape[0]
    blocks = np.asarray(raw).reshape(n, -1, GGUF_BLOCK_BYTES)               # [N, G, 34]
    # copies out of the file's (read-only) mapping
    d = np.ascontiguousarray(blocks[..., :2]).view(np.float16)[..., 0]      # [N, G]
    q = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(n, -1)  # [N, K]
    return torch.from_numpy(q), torch.from_numpy(d)


def pack(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """q int8 [N, K], d [N, K / 32] (rounded to float16 here) → the kernel's uint8
    [ceil(N / 16), K / 32, 544]: per block of 16 outputs and group, 512 bytes of q + 128
    (lane n of vector j holding q[n, 4j .. 4j + 3]), then d as 16 float16. Rows past N are
    zeros. Raises ValueError for inputs not a multiple of 32 or a scale float16 cannot hold."""
    n, k = q.shape
    if k % GROUP:
        raise ValueError(f"shape {n}x{k}: inputs must be a multiple of {GROUP}")
    d = d.to(torch.float16)
    if not torch.isfinite(d).all():
        raise ValueError("a scale overflows float16")
    pad = -n % BLOCK_ROWS
    if pad:
        q = torch.cat([q, q.new_zeros(pad, k)])
        d = torch.cat([d, d.new_zeros(pad, d.shape[1])])
    nb, g = (n + pad) // BLOCK_ROWS, k // GROUP
    u = q.view(torch.uint8) ^ 0x80                                         # q + 128
    v = u.view(nb, BLOCK_ROWS, g, 8, 4).permute(0, 2, 3, 1, 4)             # [NB, G, 8 j, 16 n, 4]
    v = v.reshape(nb, g, 512)
    scales = d.view(nb, BLOCK_ROWS, g).transpose(1, 2).contiguous().view(torch.uint8)
    return torch.cat([v, scales], dim=-1).contiguous()                     # [NB, G, 544]


def q8_mm(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """x [M, K] bfloat16 or float32 @ the packed weight.T → float32 [M, out_features]."""
    if x.dtype not in (torch.bfloat16, torch.float32):
        x = x.float()
    x = x.contiguous()
    rows, k = x.shape
    if not x.is_cpu or k != packed.shape[1] * GROUP \
            or out_features > packed.shape[0] * BLOCK_ROWS:
        raise ValueError(f"q8_mm: x {list(x.shape)} on {x.device.type} for a weight of "
                         f"{packed.shape[0] * BLOCK_ROWS} x {packed.shape[1] * GROUP}: it "
                         f"takes CPU rows of the weight's K")
    out = torch.empty(rows, out_features, dtype=torch.float32)
    if rows and _mm()(x.data_ptr(), x.dtype == torch.bfloat16, rows, k, out_features,
                      packed.data_ptr(), out.data_ptr()):
        raise MemoryError("q8_mm: no memory for the quantized activations")
    return out


def rows(packed: torch.Tensor, ids: torch.Tensor, out_features: int,
         dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The weight's rows ``ids`` (any shape of integers) → [*ids.shape, K] in ``dtype``
    (bfloat16 or float32): each d * q rounded once. Raises IndexError, as nn.Embedding does,
    for an id outside 0 .. out_features - 1."""
    if dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"rows come as bfloat16 or float32, not {dtype}")
    k = packed.shape[1] * GROUP
    flat = ids.reshape(-1).to(torch.int64).contiguous()
    out = torch.empty(flat.numel(), k, dtype=dtype)
    bad = _rows()(packed.data_ptr(), k, out_features, flat.data_ptr(), flat.numel(),
                  out.data_ptr(), dtype == torch.bfloat16)
    if bad:
        raise IndexError(f"index {int(flat[bad - 1])} is out of range for an embedding of "
                         f"{out_features} rows")
    return out.view(*ids.shape, k)


def weight(packed: torch.Tensor, out_features: int,
           dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The whole weight [N, K] in ``dtype`` (float32: exact)."""
    return rows(packed, torch.arange(out_features), out_features, dtype)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's activation quantization in torch (the reference's): x [M, K] → xq
    [M, G, 32] (integer values, float32), sx float32 [M, G]."""
    xg = x.float().view(x.shape[0], -1, GROUP)                       # [M, G, 32]
    amax = xg.abs().amax(-1)
    inv = torch.where(amax > 1e-30, torch.tensor(127.0) / amax, torch.zeros(()))
    return torch.round(xg * inv[..., None]), amax / 127.0


def reference(x: torch.Tensor, q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """What the kernel computes, in float64: the same int8 activations, float16 d."""
    xq, sx = (t.double() for t in quantize_activations(x))
    n, k = q.shape
    qg = q.double().view(n, k // GROUP, GROUP)                        # [N, G, 32]
    dots = torch.einsum("rgk,ngk->rng", xq, qg)                       # [M, N, G]
    return (dots * sx[:, None] * d.half().double()).sum(-1)
