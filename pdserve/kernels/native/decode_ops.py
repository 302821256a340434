"""A bfloat16 CPU step's small operations in one call each (decode_ops.c): RMSNorm with the
residual add, the rotary in place, silu(gate) * up.

The torch path dispatches 4-9 operations for each, at 2-3 us apiece on a 2-core EPYC: 667
of the 1,595 a batch-1 decode step of SmolLM2-135M dispatched. One ctypes call here (1.7 us
with its arguments) does the same arithmetic in the same order, so the bits are the torch
path's (decode_ops.c says where they could differ). ``runs(t)``: whether these take tensor
t (bfloat16 on the CPU where the native library runs); callers keep torch's operations
elsewhere, float32 included.

Every function takes the model's tensors as they are: rows with any stride, a unit stride
inside a row (the caller's contract, not checked here).
"""
from __future__ import annotations

import ctypes
import functools

import torch

from pdserve.kernels import native

_P, _I, _L, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float


def runs(t: torch.Tensor) -> bool:
    """Whether these kernels take t: bfloat16 on the CPU with a unit stride in its last
    dimension, native kernels available."""
    return t.dtype is torch.bfloat16 and t.is_cpu and t.stride(-1) == 1 and native.available()


@functools.cache
def _fns():
    lib_norm = native.function("pd_rms_norm_bf16",
                               [_P, _L, _P, _L, _P, _L, _P, _P, _L, _I, _I, _F], None)
    lib_rotate = native.function("pd_rotate_bf16", [_P, _I, _I, _I, _L, _L, _P, _P, _L], None)
    lib_silu = native.function("pd_silu_mul_bf16", [_P, _L, _P, _L, _P, _L, _I, _I], None)
    return lib_norm, lib_rotate, lib_silu


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None, sum_out: torch.Tensor | None = None
             ) -> torch.Tensor:
    """RMSNorm of x [T, hidden], or of x + residual written into ``sum_out`` (the caller's:
    ``residual`` itself for the in-place add) → out [T, hidden], a new tensor. weight
    [hidden] contiguous; all bfloat16."""
    fn = _fns()[0]
    rows, n = x.shape
    out = torch.empty(rows, n, dtype=torch.bfloat16)                    # [T, hidden]
    if residual is None:
        fn(x.data_ptr(), x.stride(0), None, 0, None, 0, weight.data_ptr(), out.data_ptr(), n,
           rows, n, eps)
    else:
        fn(x.data_ptr(), x.stride(0), residual.data_ptr(), residual.stride(0),
           sum_out.data_ptr(), sum_out.stride(0), weight.data_ptr(), out.data_ptr(), n, rows, n,
           eps)
    return out


def rotate_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, N, D] rotated in place (returned) by cos and sin [T, 1, D] (RotaryTables', in
    x's dtype), rows of D contiguous."""
    t, n, d = x.shape
    _fns()[1](x.data_ptr(), t, n, d, x.stride(0), x.stride(1), cos.data_ptr(), sin.data_ptr(),
              cos.stride(0))
    return x


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate and up [T, I]: into gate where it is a whole contiguous
    tensor (the caller's own, as the torch path's in-place silu), else into a new one."""
    rows, n = gate.shape
    out = gate if gate.is_contiguous() else torch.empty(rows, n, dtype=torch.bfloat16)
    _fns()[2](gate.data_ptr(), gate.stride(0), up.data_ptr(), up.stride(0), out.data_ptr(),
              out.stride(0), rows, n)
    return out
