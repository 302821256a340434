"""Linear layers on the CPU through oneDNN, with each weight reordered once at load.

torch's ``F.linear`` on a float32 CPU tensor calls MKL's SGEMM, which repacks the weight
on every call. With a decode step's few rows the weights stream from memory for every
layer of every step, and the repacking makes that pass twice as slow as it need be. oneDNN
(bundled with torch) takes a weight reordered once into its own blocked layout
(``torch.ops.mkldnn._reorder_linear_weight``, the format torch.compile's CPU freezing
uses) and streams it once. On the 2-core AMD EPYC dev machine, 1 thread, SmolLM2-135M's
120 projections as a step runs them take 0.61 of F.linear's time at 16 rows, 0.90 at 1
row and 0.77 at 2,048; its LM head 0.44 at 16 rows (benchmarks/cpu_linear.py,
benchmarks/RESULTS.md).

Numerics: in float32, the products are still summed in float32, but in oneDNN's order, so
results differ from ``F.linear``'s (and transformers') in the last bits: about 1e-6
relative. In bfloat16 ``F.linear`` already calls oneDNN, without the reordered weight:
the bits are the same (tested), the 30 layers' projections at 16 rows in 0.59 of the time.
bfloat16 needs AVX512 (BW, VL, DQ) or AVX-NE-CONVERT; on an AVX2-only CPU "auto" keeps
``F.linear`` for bfloat16. Rows do not depend on the other rows of the batch from 2 rows
up (as with MKL, one row takes another kernel). ``EngineConfig.cpu_linear = "torch"`` keeps
``F.linear``, bit for bit transformers' CPU path in float32.

Memory: oneDNN keeps, per weight shape and row count, a primitive (oneDNN's own cache) and
a computation that holds buffers growing with its rows (ideep's cache, in torch): 540 KiB
for 2 rows of a 576 -> 1536 projection, 12 MiB for 2,000. Both caches hold 1,024 entries
by default, and a node sees a new row count in most batches: 3 such projections run at
row counts 1 to 299 grew a process by 541 MiB. ``bound_onednn_caches`` caps both at
``CACHE_ENTRIES`` (set in the environment before the first oneDNN call, which reads it;
the same run: +41-53 MiB), and ``OneDNNLinear`` takes at most ``MAX_ROWS`` rows a call (a
prefill's longer input in pieces), which bounds each entry. A batch of a row count not
among the last few makes its primitives again: a decode step cycling through 10 batch
sizes took 91 ms at 32 entries against 84 at 64 (4 rows), the same at 16 and 48 rows
(benchmarks/RESULTS.md).
"""
from __future__ import annotations

import os

import torch
from torch import nn

# oneDNN's primitive cache, and ideep's computation cache (its older name in torch)
CACHE_ENV = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")
CACHE_ENTRIES = 32
MAX_ROWS = 256  # rows of one oneDNN call: a piece keeps the GEMM compute-bound

# float16 keeps F.linear: its reorder needs AVX-NE-CONVERT or AVX512-FP16
_DTYPES = (torch.float32, torch.bfloat16)


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn,
                                                            "_linear_pointwise")


def onednn_runs(dtype: torch.dtype) -> bool:
    """Whether this CPU can reorder a ``dtype`` weight. bfloat16's reorder needs AVX512-BW/VL/DQ
    or AVX-NE-CONVERT: an AVX2-only CPU (seen on the dev machine's AMD EPYC days) raises at
    load, while F.linear still runs bfloat16 there through its own path."""
    if dtype not in _DTYPES or not onednn_available():
        return False
    return dtype != torch.bfloat16 or torch.ops.mkldnn._is_mkldnn_bf16_supported()


def resolve_cpu_linear(mode: str, device: torch.device, dtype: torch.dtype) -> str:
    """"onednn" or "torch": what the linear layers of a model on ``device`` in ``dtype``
    run through, for ``mode`` "auto", "onednn" or "torch" (EngineConfig.cpu_linear).
    Raises ValueError when "onednn" is asked for and cannot be had."""
    if mode not in ("auto", "onednn", "torch"):
        raise ValueError(f"cpu_linear must be 'auto', 'onednn' or 'torch', got {mode!r}")
    usable = device.type == "cpu" and dtype in _DTYPES
    if mode == "onednn":
        if not usable:
            raise ValueError(f"cpu_linear 'onednn' is for float32 and bfloat16 models on the "
                             f"CPU, not {str(dtype).removeprefix('torch.')} on {device}; "
                             f"use 'auto'")
        if not onednn_available():
            raise ValueError("cpu_linear 'onednn' needs a torch built with oneDNN (mkldnn), "
                             "and this one is not; use 'torch' or 'auto'")
        if not onednn_runs(dtype):
            raise ValueError("cpu_linear 'onednn' in bfloat16 needs a CPU with AVX512-BW, "
                             "-VL and -DQ or AVX-NE-CONVERT, and this one has neither; use "
                             "'torch' or 'auto'")
    if mode == "auto":
        return "onednn" if usable and onednn_runs(dtype) else "torch"
    return mode


def bound_onednn_caches() -> None:
    """Caps oneDNN's caches at ``CACHE_ENTRIES`` each, unless the environment sets them
    (``DNNL_PRIMITIVE_CACHE_CAPACITY`` too). Only takes effect before the process's first
    oneDNN call."""
    if "DNNL_PRIMITIVE_CACHE_CAPACITY" in os.environ:
        os.environ.setdefault(CACHE_ENV[1], str(CACHE_ENTRIES))
        return
    for name in CACHE_ENV:
        os.environ.setdefault(name, str(CACHE_ENTRIES))


class OneDNNLinear(nn.Module):
    """``nn.Linear``'s forward over a weight held in oneDNN's layout. The weight is no
    parameter any more (an opaque tensor: no state dict, no ``.to()``): made after loading,
    for inference."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        weight = linear.weight.detach()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        # The row count is a hint for the layout; the result does not depend on it.
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), 16)
        self.bias = None if linear.bias is None else linear.bias.detach().contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if x.dim() != 2 or rows <= MAX_ROWS:
            return self._call(x)
        cuts = [*range(0, rows, MAX_ROWS), rows]
        if cuts[-1] - cuts[-2] == 1:  # no piece of one row: it would take another kernel
            cuts[-2] -= 1
        return torch.cat([self._call(x[a:b]) for a, b in zip(cuts, cuts[1:])])

    def _call(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, " \
               f"bias={self.bias is not None}"
