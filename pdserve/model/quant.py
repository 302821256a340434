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

The kernel takes the scales in the activations' dtype, and on an AVX2 CPU (torch 2.13)
only its bfloat16 path is fast: float32 and float16 activations take a path about 13
times slower than oneDNN's float32 GEMM over the dequantized weight, bfloat16 runs in
0.34-0.42 of its time at one row (benchmarks/quant_linear.py, benchmarks/RESULTS.md). In
bfloat16 the f16 scale loses 3 bits, ``m + 8 d`` is rounded, and at more rows the kernel
rounds each weight it forms to bfloat16 again: the file's weights to about bfloat16
precision, close to but not the same as a dequantized bfloat16 model's (greedy output
departs earlier: RESULTS.md). ``--quantization auto`` keeps the blocks only for a bfloat16
model (``plan``), and says so.

Q4_K (super-blocks of 256 with a 6-bit scale and min per 32) maps the same way: ``scale =
d sc``, ``zero = 8 d sc - dmin m``, exact in float32 where that zero is (checked).

Many rows at once (a prefill's chunk: ``DENSE_ROWS`` or more), the CPU forms the
weight instead, in the activations' dtype (from the packed blocks, in one pass of a few
vector operations: 0.1-0.6 ms for SmolLM2's projections) and runs a dense GEMM over it.
torch's int4 kernel forms each weight again for every few rows, and 2,048 rows of a
prefill took it 2.3 times as long as forming the weight plus a bfloat16 GEMM
(benchmarks/RESULTS.md). The weights are the same values the kernel forms (rounded
to bfloat16 once, from float32); only the order of the sums differs. Nothing dense is
kept: the weight lives for the one call.

Where the native CPU kernels run (``pdserve.kernels.native``: AVX512-VNNI and a C
compiler; the start-up log says whether), a bfloat16 model's blocks go to the VNNI int4
GEMM instead (kernels/native/int4_gemm.c), at every row count: ``w = d q + m`` with d and
m in float16 (Q4_1's own, 3 bits finer than the bfloat16 scales above), and the
activations rounded on each call to int8 per 32 inputs with a float32 scale, as llama.cpp
runs Q4_1 (x Q8_1). That rounding is its error: 1.2-10 times bfloat16 rounding's on
SmolLM2's projection inputs; how far greedy output departs is in benchmarks/RESULTS.md.
It ran 0.63 of torch's kernel's time at one row, 0.44 at 16 and 0.29 at 224, and 0.77 of
the dense path's at 2,048 rows (benchmarks/vnni_int4.py), so it takes the prefill too.

On CUDA the same blocks go to the Triton W4A16 kernel (kernels/quant_linear.py: the
same ``w = scale * (q - 8) + zero``, in any of the float dtypes), packed by ``pack``.

Which tensors: the projections (q, k, v, o, gate, up, down) of type Q4_0, Q4_1 or Q4_K.
The embedding is dequantized (a lookup needs rows), and with it a tied LM head, except a
Q8_0 one in bfloat16 on the CPU, which model/q8_head.py keeps as stored for pdserve's native
kernels (the loader asks it, not ``keeps``); other Q8_0 weights and the other K-quants are
dequantized (no torch kernel takes a scale per 32 int8 weights; Q5/Q6 have more than 4 bits).
"""
from __future__ import annotations

import logging

import numpy as np
import torch
from torch import nn

from pdserve.common.config import QUANTIZATION_MODES
from pdserve.kernels import native
from pdserve.kernels._dispatch import pick_backend
from pdserve.kernels.native import int4_gemm
from pdserve.kernels.quant_linear import GROUP, dequantize, pack_int4, quant_linear

log = logging.getLogger(__name__)

# Q4_0/Q4_1: f16 d [, f16 m], 16 bytes of 4-bit pairs (32 weights). Q4_K: a super-block
# of 256 weights: f16 d and dmin, 12 bytes of 6-bit scales and mins (one each per 32),
# 128 bytes of 4-bit pairs.
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q4_K": 144}
INT4_TYPES = tuple(BLOCK_BYTES)
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


# Rows from which the CPU forms the weight and runs a dense GEMM (module docstring). All
# 30 layers of SmolLM2 (benchmarks/quant_linear.py, 2 threads, AVX512-BF16): at 128 rows
# that took 1.32 times the int4 kernel's time, at 192 1.05, at 224 0.93, at 256 0.86,
# at 2,048 0.43.
DENSE_ROWS = 224
PACK_ROWS = (64, 32)  # torch's CPU int4 packing's row blocks: AVX-512's, AVX2's


class QuantError(ValueError):
    """A tensor that cannot be kept quantized exactly (the caller dequantizes it)."""


def plan(mode: str, is_gguf: bool, dtype: torch.dtype, device: torch.device | str) -> bool:
    """Whether a model loaded with ``--quantization mode`` keeps its Q4_0/Q4_1/Q4_K projections
    as int4. Raises ValueError, saying what is allowed, for a mode that cannot work."""
    if mode not in QUANTIZATION_MODES:
        raise ValueError(f"quantization must be one of {QUANTIZATION_MODES}, got {mode!r}")
    if mode == "none":
        return False
    if mode == "int8":
        raise ValueError("quantization 'int8' is not implemented: torch's int8 weight-only "
                         "GEMM takes one scale per output row, which no GGUF type has (Q8_0 "
                         "has one per 32 weights), and requantizing would change the "
                         "weights; use 'auto' or 'none'")
    why_not = None
    kind = torch.device(device).type
    if not is_gguf:
        why_not = "the checkpoint stores float weights (quantizing them is not implemented)"
    elif kind != "cpu" and pick_backend(None, torch.device(device)) != "triton":
        why_not = (f"on {kind} the int4 GEMM is a Triton kernel (kernels/quant_linear.py), "
                   "and Triton cannot run here")
    elif kind == "cpu" and dtype != torch.bfloat16:
        name = str(dtype).removeprefix("torch.")
        why_not = (f"torch's int4 CPU kernel is fast in bfloat16 only ({name} runs 13x "
                   "slower than the dequantized weight; pass --dtype bfloat16)")
    if why_not and mode == "int4":
        raise ValueError(f"quantization 'int4' cannot be served: {why_not}; use 'auto' or "
                         "'none'")
    if why_not:
        log.info("quantization auto: weights dequantized to %s: %s",
                 str(dtype).removeprefix("torch."), why_not)
    return why_not is None


def keeps(hf_name: str, type_name: str) -> str | None:
    """None if a tensor (Hugging Face name, GGUF type) stays int4, else why not."""
    module, _, kind = hf_name.rpartition(".")
    if module.rpartition(".")[2] not in PROJECTIONS:
        if module.endswith(("embed_tokens", "lm_head")):
            return (f"{type_name}: the embedding's lookup takes rows, and a tied LM head is "
                    "the embedding")
        return f"{type_name}: not a projection"
    if kind != "weight":
        return "a bias"
    if type_name not in INT4_TYPES:
        return f"{type_name}: no exact int4 mapping"
    return None


def summary(kept: list[tuple[int, int]], types: set[str], dtype: torch.dtype,
            dequantized: dict[str, list[str]]) -> str:
    """The start-up log line: what stayed int4 (shapes [N, K]), its bytes against the
    dequantized weights', and what was dequantized why."""
    size = torch.empty((), dtype=dtype).element_size()
    held = sum(n * k // 2 + n * k // GROUP * 2 * size for n, k in kept)
    dense = sum(n * k * size for n, k in kept)
    name = str(dtype).removeprefix("torch.")
    parts = [f"{len(kept)} projection weights kept as int4 ({', '.join(sorted(types))}): "
             f"{held / 2**20:.0f} MiB against {dense / 2**20:.0f} MiB in {name}"]
    for why, names in dequantized.items():
        shown = ", ".join(names[:2]) + (f" and {len(names) - 2} more" if len(names) > 2 else "")
        parts.append(f"dequantized {shown} ({why})")
    return "quantization auto: " + "; ".join(parts)


KERNELS = {  # Int4Linear.backend → what runs, for the start-up log
    "native": "the native int4 x int8 GEMM on {isa} (float16 scales; activations rounded "
              "to int8 per 32 inputs, as llama.cpp's Q4_1 x Q8_1)",
    "torch": "torch's int4 CPU kernel (bfloat16 scales and activations)",
    "triton": "the Triton W4A16 kernel",
}


def kernels_used(layers: list[Int4Linear]) -> str:
    """The start-up log line once packed: which kernel the int4 projections run on, and
    on a CPU without the native one, why not."""
    counts: dict[str, int] = {}
    for lin in layers:
        counts[lin.backend] = counts.get(lin.backend, 0) + 1
    line = "; ".join(f"{n} on {KERNELS[b].format(isa=native.isa())}" for b, n in counts.items())
    if "torch" in counts and native.why_unavailable() is not None:
        line += f" (native kernels unavailable: {native.why_unavailable()})"
    return f"int4 projections: {line}"


def unpack_q4(raw: np.ndarray, type_name: str, exact: bool = True
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A GGUF tensor's bytes [N, G * block bytes] → q uint8 [N, G * 32] in 0..15, scale and
    zero float32 [N, G] with ``w = scale * (q - 8) + zero``. With ``exact`` (float32
    activations: a bfloat16 zero is rounded far more anyway), raises QuantError where the
    zero does not fit float32 exactly."""
    if type_name == "Q4_K":
        return _unpack_q4_k(raw, exact)
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
        fits = zero.astype(np.float64) == m.astype(np.float64) + 8 * d.astype(np.float64)
        if exact and not fits.all():
            raise QuantError(f"{int((~fits).sum())} blocks' m + 8 d round in float32")
    return q, d, zero


def _unpack_q4_k(raw: np.ndarray, exact: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K: ``w = d sc q - dmin m`` per 32 weights (sc, m 6-bit): scale = d sc, zero =
    8 d sc - dmin m (exactness checked as for Q4_1)."""
    n = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(n, -1, 144)              # [N, S, 144]
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)     # [N, S]
    dmin = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    # the gguf package's unpacking of the 12 scale bytes: [N, S, 8] each
    b = blocks[..., 4:16].reshape(n, -1, 3, 4)
    lo, hi, mix = b[..., 0, :], b[..., 1, :], b[..., 2, :]
    sc = np.concatenate([lo & 0x3F, (mix & 0x0F) | ((lo >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([hi & 0x3F, (mix >> 4) | ((hi >> 2) & 0x30)], axis=-1)
    scale = (d[..., None] * sc.astype(np.float32)).reshape(n, -1)         # [N, G]
    dm = (dmin[..., None] * mn.astype(np.float32)).reshape(n, -1)
    zero = 8 * scale - dm
    fits = zero.astype(np.float64) == 8 * scale.astype(np.float64) - dm.astype(np.float64)
    if exact and not fits.all():
        raise QuantError(f"{int((~fits).sum())} groups' 8 d sc - dmin m round in float32")
    # 4 chunks of 32 bytes a super-block: low nibbles are group 2j, high ones group 2j + 1
    qs = blocks[..., 16:].reshape(n, -1, 4, 1, 32)
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-2).reshape(n, -1)    # [N, K]
    return q, scale, zero


class Int4Linear(nn.Module):
    """``nn.Linear``'s forward over 4-bit weights with a scale and a zero per 32 inputs:
    packed for the native VNNI GEMM (bfloat16 on a CPU that runs it) or torch's CPU int4
    GEMM on the CPU, for the Triton W4A16 kernel (kernels/quant_linear.py) on CUDA."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                 bias: torch.Tensor | None = None, dtype: torch.dtype = torch.float32):
        """q uint8 [N, K] in 0..15; scale, zero float32 [N, K / 32]; ``dtype``: the
        activations' (and the scales' once packed)."""
        super().__init__()
        self.dtype = dtype
        self.out_features, self.in_features = q.shape
        if self.in_features % GROUP:
            raise QuantError(f"input size {self.in_features} is not a multiple of {GROUP}")
        self.q, self.scale, self.zero = q, scale, zero  # kept for fusing, dropped by pack()
        self.bias = bias
        self.packed: torch.Tensor | None = None
        self.scales_and_zeros: torch.Tensor | None = None   # torch's CPU kernel: [G, N, 2]
        self.backend = "torch"      # which kernel pack() packed for: torch, native, triton
        self.dense_rows: int | None = None  # CPU: rows from which forward forms the weight
        self.pack_rows = PACK_ROWS[0]  # torch's packing's row blocks (``_packed_q_t``)

    @classmethod
    def from_gguf(cls, raw: np.ndarray, type_name: str,
                  dtype: torch.dtype = torch.float32) -> Int4Linear:
        q, scale, zero = unpack_q4(raw, type_name, exact=dtype == torch.float32)
        return cls(torch.from_numpy(q), torch.from_numpy(scale), torch.from_numpy(zero),
                   dtype=dtype)

    @classmethod
    def cat(cls, parts: list[Int4Linear]) -> Int4Linear:
        """One layer whose output is the parts' outputs side by side (before pack())."""
        bias = None if parts[0].bias is None else torch.cat([p.bias for p in parts])
        return cls(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]),
                   torch.cat([p.zero for p in parts]), bias, parts[0].dtype)

    def permute_rows(self, fn) -> None:
        """Applies ``fn`` (a row permutation of [N, ...] tensors) to the stored rows."""
        self.q, self.scale, self.zero = fn(self.q), fn(self.scale), fn(self.zero)

    def pack(self, device: torch.device | str = "cpu", backend: str | None = None
             ) -> Int4Linear:
        """Packs for the kernel that runs on ``device``: ``backend`` None picks Triton on
        CUDA and on the CPU the native VNNI kernel for bfloat16 where it runs, else
        torch's; "torch", "native" or "triton" ask for one. Scales and zeros in the
        activations' dtype (native: float16); the unpacked copies go."""
        if self.packed is not None:
            return self
        device = torch.device(device)
        if backend == "native" or (backend is None and device.type == "cpu"
                                   and self.dtype == torch.bfloat16 and native.available()):
            if self._pack_native(device, required=backend == "native"):
                return self
            backend = "torch"
        self.backend = pick_backend(backend, device)
        if self.backend == "triton":
            self.packed = pack_int4(self.q).to(device)                  # [N, K / 2] uint8
            self.scales_and_zeros = torch.stack(                        # [2, N, G]
                [self.scale, self.zero]).to(device=device, dtype=self.dtype)
        elif device.type != "cpu":
            raise ValueError(f"int4 weights on {device.type} need the Triton kernel")
        else:
            self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
                self.q.to(torch.int32).contiguous(), 1)                  # [N, K / 2] uint8
            self.scales_and_zeros = torch.stack(                        # [G, N, 2]
                [self.scale, self.zero], dim=-1).transpose(0, 1).to(self.dtype).contiguous()
            # the packing's layout is torch's, not a contract: read back and checked once
            want = self.q.t().reshape(-1, GROUP, self.out_features)
            self.pack_rows = next((rows for rows in PACK_ROWS if self.out_features % rows == 0
                                   and torch.equal(self._packed_q_t(rows), want)), None)
            self.dense_rows = DENSE_ROWS if self.pack_rows else None
            if self.pack_rows is None:
                log.warning("int4 %dx%d: torch's packing is not the layout expected; every "
                            "call runs the int4 kernel", self.out_features, self.in_features)
        self.q = self.scale = self.zero = None
        if self.bias is not None:
            self.bias = self.bias.to(device=device, dtype=self.dtype)
        return self

    def _pack_native(self, device: torch.device, required: bool) -> bool:
        """Packs for the VNNI kernel (``w = d q + m``: d = scale, m = zero - 8 scale).
        False, with the reason logged, where it cannot take this layer (``required``:
        raises ValueError instead)."""
        why = native.why_unavailable()
        if why is None and device.type != "cpu":
            why = f"the native kernels run on the CPU, not {device.type}"
        if why is None:
            try:
                self.packed = int4_gemm.pack(self.q, self.scale, self.zero - 8 * self.scale)
            except ValueError as e:
                why = str(e)
        if why is not None:
            if required:
                raise ValueError(f"int4 {self.out_features}x{self.in_features}: the native "
                                 f"kernel cannot take it: {why}")
            log.warning("int4 %dx%d: torch's int4 kernel, not the native one: %s",
                        self.out_features, self.in_features, why)
            return False
        self.backend = "native"
        self.q = self.scale = self.zero = None
        if self.bias is not None:
            self.bias = self.bias.to(dtype=self.dtype)
        return True

    def _packed_q_t(self, rows: int | None = None) -> torch.Tensor:
        """The 4-bit values out of torch's CPU packing, transposed and grouped: uint8
        [G, 32, N], [g, i, n] = q[n, 32 g + i]. Rows in blocks of R = ``rows`` (default: as
        found at pack), [N / R, K, R / 2] bytes: low nibbles the block's first R / 2 rows."""
        n, k, r = self.out_features, self.in_features, rows or self.pack_rows
        blocks = self.packed.view(n // r, k, r // 2)                           # [N/R, K, R/2]
        q_t = torch.cat([blocks & 0x0F, blocks >> 4], dim=-1)                # [N/R, K, R]
        return q_t.permute(1, 0, 2).reshape(k // GROUP, GROUP, n)            # [G, 32, N]

    def _weight_t(self) -> torch.Tensor:
        """W^T [K, N] in the activations' dtype: each weight formed in float32 from the
        packed blocks (``scale * (q - 8) + zero``, the scales as packed) and rounded once,
        the value torch's kernel forms."""
        scale = self.scales_and_zeros[..., 0].float()[:, None]             # [G, 1, N]
        zero = self.scales_and_zeros[..., 1].float()[:, None]
        w_t = (self._packed_q_t().float() - 8).mul_(scale).add_(zero)        # [G, 32, N]
        return w_t.to(self.dtype).view(self.in_features, self.out_features)

    def dequantized(self) -> torch.Tensor:
        """The float32 weight [N, K] the kernel computes with (tests, the embedding)."""
        if self.packed is None:
            return ((self.q.float() - 8) * self.scale.repeat_interleave(GROUP, 1)
                    + self.zero.repeat_interleave(GROUP, 1))
        if self.backend == "triton":
            return dequantize(self.packed, *self.scales_and_zeros, 4)
        if self.backend == "native":
            return int4_gemm.weight(self.packed, torch.float32)
        if self.dense_rows is not None:
            return self._weight_t().t().float()
        eye = torch.eye(self.in_features, dtype=self.dtype)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(
            eye, self.packed, GROUP, self.scales_and_zeros).t().contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        # The model's [T, hidden] goes as it is: a reshape and a view are two operations
        # dispatched per call, 240 of a batch-1 decode step's
        flat = x.dim() == 2
        x2 = x if flat else x.reshape(-1, shape[-1])
        if self.packed is None:
            self.pack(x.device)
        if self.backend == "native":
            out = int4_gemm.int4_mm(x2 if x2.is_contiguous() else x2.contiguous(),
                                    self.packed, self.out_features)
            if self.bias is not None:
                out += self.bias
        elif self.backend == "triton":
            out = quant_linear(x2, self.packed, *self.scales_and_zeros, 4, self.bias,
                               backend="triton")
        elif self.dense_rows is not None and x2.shape[0] >= self.dense_rows:
            out = torch.mm(x2, self._weight_t())                           # [T, N]
            if self.bias is not None:
                out += self.bias
        else:  # torch's CPU kernel refuses a strided input ("expect A to be contiguous")
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(
                x2 if x2.is_contiguous() else x2.contiguous(), self.packed, GROUP,
                self.scales_and_zeros)
            if self.bias is not None:
                out += self.bias
        return out if flat else out.view(*shape[:-1], self.out_features)

    @property
    def nbytes(self) -> int:
        """Bytes held once packed: the 4-bit values with their scales and zeros."""
        held = [self.packed, self.scales_and_zeros]
        return sum(t.nbytes for t in held if t is not None)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, " \
               f"bias={self.bias is not None}, int4 group {GROUP}"
