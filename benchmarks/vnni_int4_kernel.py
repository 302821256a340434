"""PROTOTYPE, not part of pdserve (so it lives beside its benchmark): an AVX512-VNNI int4
x int8 GEMM in plain C (vnni_int4_kernel.c), to measure against torch's
``_weight_int4pack_mm_for_cpu`` at a decode step's few rows (benchmarks/vnni_int4.py,
tests/unit/test_vnni_int4.py).

Weights are Q4_1's blocks (``w = d * q + m`` per 32 inputs, d and m float16, as GGUF stores
them); activations are quantized per call to int8 per 32 (llama.cpp's Q8_1), which is
where its error against the exact GEMM comes from. The C file is compiled on first use
with the system's ``cc`` (``-O3 -march=native -fopenmp``) into a temporary directory and
loaded with ctypes: the call releases the GIL, and the library's libgomp is the one torch
already loaded (same soname), so it shares torch's OpenMP threads and thread count.
"""
from __future__ import annotations

import ctypes
import functools
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

GROUP = 32
BLOCK_ROWS = 16         # outputs per block: one per 512-bit int32 lane
SOURCE = Path(__file__).with_name("vnni_int4_kernel.c")
CPU_FLAGS = ("avx512f", "avx512bw", "avx512_vnni", "avx512_bf16")


def why_unavailable() -> str | None:
    """None if the kernel can be built and run here, else why not."""
    if shutil.which("cc") is None:
        return "no C compiler (cc) on PATH"
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith("flags")).split()
    except (OSError, StopIteration):
        return "cannot read /proc/cpuinfo"
    missing = [f for f in CPU_FLAGS if f not in flags]
    return f"this CPU lacks {', '.join(missing)}" if missing else None


@functools.cache
def library() -> ctypes.CDLL:
    """Compiles vnni_int4_kernel.c once per process and loads it (after torch: its libgomp)."""
    out = Path(tempfile.mkdtemp(prefix="pdserve-vnni-")) / "vnni_int4.so"
    subprocess.run(["cc", "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-o",
                    str(out), str(SOURCE)], check=True, capture_output=True, text=True)
    lib = ctypes.CDLL(str(out))
    lib.vnni_int4_mm.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                 ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    lib.vnni_int4_mm.restype = ctypes.c_int
    return lib


def pack(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """q uint8 [N, K] in 0..15, d and m [N, K / 32] (rounded to float16) → the kernel's
    uint8 [N / 16, K / 32, 320]: per block of 16 outputs and group, 256 bytes of nibbles
    (byte b of vector j < 4 = lane bytes of j | of j + 4 << 4, lane n of vector j holding
    q[n, 4j .. 4j + 3]), then d and m as 16 float16 each."""
    n, k = q.shape
    if n % BLOCK_ROWS or k % GROUP:
        raise ValueError(f"shape {n}x{k}: outputs must be a multiple of {BLOCK_ROWS}, "
                         f"inputs of {GROUP}")
    nb, g = n // BLOCK_ROWS, k // GROUP
    v = q.view(nb, BLOCK_ROWS, g, 8, 4).permute(0, 2, 3, 1, 4)        # [NB, G, 8 j, 16 n, 4]
    v = v.reshape(nb, g, 8, 64)
    nibbles = (v[:, :, :4] | (v[:, :, 4:] << 4)).reshape(nb, g, 256)
    halves = [t.to(torch.float16).view(nb, BLOCK_ROWS, g).transpose(1, 2)   # [NB, G, 16]
              .contiguous().view(torch.uint8) for t in (d, m)]
    return torch.cat([nibbles, *halves], dim=-1).contiguous()          # [NB, G, 320]


def int4_mm(x: torch.Tensor, packed: torch.Tensor, out_features: int,
            out: torch.Tensor | None = None, out_dtype: torch.dtype | None = None
            ) -> torch.Tensor:
    """x [M, K] bfloat16 or float32 @ the packed weight.T → [M, N] in ``out_dtype``
    (default x's)."""
    assert x.dim() == 2 and x.is_contiguous() and x.dtype in (torch.bfloat16, torch.float32)
    rows, k = x.shape
    assert packed.shape == (out_features // BLOCK_ROWS, k // GROUP, 320)
    if out is None:
        out = torch.empty(rows, out_features, dtype=out_dtype or x.dtype)
    assert out.shape == (rows, out_features) and out.is_contiguous()
    assert out.dtype in (torch.bfloat16, torch.float32)
    rc = library().vnni_int4_mm(x.data_ptr(), x.dtype == torch.bfloat16, rows, k,
                                out_features, packed.data_ptr(), out.data_ptr(),
                                out.dtype == torch.bfloat16)
    if rc:
        raise MemoryError("vnni_int4_mm: no memory for the quantized activations")
    return out


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel's activation quantization in torch (for references): x [M, K] → xq
    [M, G, 32] (integer values, float32), sx and sumx float32 [M, G]."""
    xg = x.float().view(x.shape[0], -1, GROUP)                       # [M, G, 32]
    amax = xg.abs().amax(-1)
    inv = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros(()))
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
