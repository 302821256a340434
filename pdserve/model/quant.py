"""GGUF's 4-bit blocks kept as they are stored, run through torch's weight-only int4 GEMM.

llama.cpp's Q4_0 and Q4_1 quantize each row in blocks of 32 weights along the input
dimension: a block is an f16 scale ``d`` (Q4_1: and an f16 minimum ``m``) and 32 4-bit
values ``q`` in 0..15, and stands for ``w = d * (q - 8)`` (Q4_0) or ``w = d * q + m``
(Q4_1). torch's CPU kernel ``_weight_int4pack_mm_for_cpu`` takes the same 4-bit values,
packed (``_convert_weight_to_int4pack_for_cpu``), with a scale and a zero per group of 32
in ``scales_and_zeros`` [K / 32, N, 2] and computes ``w = scale * (q - 8) + zero``. So
``scale = d`` and ``zero = 0`` (Q4_0) or ``zero = m + 8 d`` (Q4_1). In float32 both
sides are exact: ``d * (q - 8)`` and ``d * q`` need at most 11 + 4 bits, ``m + 8 d`` is
exact where the two exponents are within 13 of each other (checked at load for every
block, not assumed), so each weight the kernel forms is the float32 value the gguf
package's reference dequantization gives, bit for bit (tests/unit/test_quant.py). The
products are then summed in the kernel's order: results differ from F.linear's over the
dequantized weight in the last bits.

The kernel takes the scales in the activations' dtype. In bfloat16 an f16 scale loses 3
bits, so the weights are no longer the file's: only float32 keeps them (``supported``).
"""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

GROUP = 32                            # weights per block, along the input dimension
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20}  # f16 d [, f16 m], 16 bytes of 4-bit pairs
INT4_TYPES = tuple(BLOCK_BYTES)


class QuantError(ValueError):
    """A tensor that cannot be kept quantized exactly (the caller dequantizes it)."""


def supported(type_name: str, dtype: torch.dtype) -> str | None:
    """None if a tensor of GGUF type ``type_name`` can be kept as int4 for activations
    in ``dtype``, else why not (for the start-up log)."""
    if type_name not in INT4_TYPES:
        return f"{type_name} has no exact weight-only GEMM in torch"
    if dtype != torch.float32:
        return f"{str(dtype).removeprefix('torch.')} scales would round the file's f16 ones"
    return None


def unpack_q4(raw: np.ndarray, type_name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A GGUF tensor's bytes [N, G * block bytes] → q uint8 [N, G * 32] in 0..15, scale and
    zero float32 [N, G] with ``w = scale * (q - 8) + zero``. Raises QuantError where
    ``m + 8 d`` does not fit float32 exactly."""
    nbytes = BLOCK_BYTES[type_name]
    n = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(n, -1, nbytes)            # [N, G, bytes]
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)  # [N, G]
    packed = blocks[..., nbytes - 16:]                                   # [N, G, 16]
    # low nibbles are a block's weights 0..15, high nibbles 16..31
    q = np.concatenate([packed & 0x0F, packed >> 4], axis=-1).reshape(n, -1)  # [N, K]
    if type_name == "Q4_0":
        zero = np.zeros_like(d)
    else:
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        zero = m + 8 * d
        exact = zero.astype(np.float64) == m.astype(np.float64) + 8 * d.astype(np.float64)
        if not exact.all():
            raise QuantError(f"{int((~exact).sum())} blocks' m + 8 d round in float32")
    return q, d, zero


class Int4Linear(nn.Module):
    """``nn.Linear``'s forward over 4-bit weights with a scale and a zero per 32 inputs,
    packed for torch's CPU int4 GEMM; float32 activations."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                 bias: torch.Tensor | None = None):
        """q uint8 [N, K] in 0..15; scale, zero float32 [N, K / 32]."""
        super().__init__()
        self.out_features, self.in_features = q.shape
        if self.in_features % GROUP:
            raise QuantError(f"input size {self.in_features} is not a multiple of {GROUP}")
        self.q, self.scale, self.zero = q, scale, zero  # kept for fusing, dropped by pack()
        self.bias = bias
        self.packed: torch.Tensor | None = None
        self.scales_and_zeros: torch.Tensor | None = None

    @classmethod
    def from_gguf(cls, raw: np.ndarray, type_name: str) -> Int4Linear:
        q, scale, zero = unpack_q4(raw, type_name)
        return cls(torch.from_numpy(q), torch.from_numpy(scale), torch.from_numpy(zero))

    @classmethod
    def cat(cls, parts: list[Int4Linear]) -> Int4Linear:
        """One layer whose output is the parts' outputs side by side (before pack())."""
        bias = None if parts[0].bias is None else torch.cat([p.bias for p in parts])
        return cls(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]),
                   torch.cat([p.zero for p in parts]), bias)

    def permute_rows(self, fn) -> None:
        """Applies ``fn`` (a row permutation of [N, ...] tensors) to the stored rows."""
        self.q, self.scale, self.zero = fn(self.q), fn(self.scale), fn(self.zero)

    def pack(self) -> Int4Linear:
        """Packs for the kernel; the unpacked copies go."""
        if self.packed is None:
            self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
                self.q.to(torch.int32).contiguous(), 1)                  # [N, K / 2] uint8
            self.scales_and_zeros = torch.stack(
                [self.scale, self.zero], dim=-1).transpose(0, 1).contiguous()  # [G, N, 2]
            self.q = self.scale = self.zero = None
        return self

    def dequantized(self) -> torch.Tensor:
        """The float32 weight [N, K] the kernel computes with (tests, the embedding)."""
        if self.packed is None:
            return ((self.q.float() - 8) * self.scale.repeat_interleave(GROUP, 1)
                    + self.zero.repeat_interleave(GROUP, 1))
        eye = torch.eye(self.in_features)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(
            eye, self.packed, GROUP, self.scales_and_zeros).t().contiguous()

    def nbytes(self) -> int:
        self.pack()
        return self.packed.nbytes + self.scales_and_zeros.nbytes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.reshape(-1, shape[-1]), self.pack().packed, GROUP, self.scales_and_zeros)
        if self.bias is not None:
            out += self.bias
        return out.view(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, " \
               f"bias={self.bias is not None}, int4 group {GROUP}"
