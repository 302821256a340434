"""The memory floor of a batch-1 decode step: the bytes of the weights it reads over the
memory's read bandwidth, measured on this machine (torch.sum over a large tensor in the
pages the weights lie in).

A step reads every weight once: each layer's projections and norms, and the LM head. With
tied embeddings the LM head is the embedding, read whole; an untied model's embedding is
read a row at a time, so it does not count.
"""
from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Iterable

EMBEDDING = "token_embd.weight"
LM_HEAD = "output.weight"


def read_bandwidth_gbs(threads: int | None = None, mib: int = 512, repeats: int = 5) -> float:
    """GB/s reading ``mib`` MiB of float32 with torch.sum, median of ``repeats``. The tensor
    lies in 2 MiB pages where the system has transparent huge pages, as a node's packed
    weights do (engine/host_memory.py's into_huge_pages): over 4 KiB pages every page is a
    TLB miss and the same reading is 10-30% lower (benchmarks/RESULTS.md, "the packed
    weights in 2 MiB pages"), a floor that the weights' own reading would beat."""
    import torch

    from pdserve.engine.host_memory import into_huge_pages

    if threads:
        torch.set_num_threads(threads)
    x = torch.ones(mib * 2**20 // 4)
    into_huge_pages([x])
    x.sum()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - t0)
    return x.nbytes / statistics.median(times) / 1e9


def floor_ms(weight_bytes: float, gbs: float) -> float:
    """Milliseconds to read ``weight_bytes`` at ``gbs`` GB/s."""
    if gbs <= 0:
        raise ValueError(f"bandwidth must be positive, got {gbs} GB/s")
    return weight_bytes / (gbs * 1e9) * 1e3


def step_bytes(tensors: Iterable[tuple[str, int, int]], itemsize: int | None = None) -> int:
    """The bytes a decode step reads, from (GGUF tensor name, element count, stored bytes)
    of every tensor: as stored, or at ``itemsize`` bytes a weight (the file dequantized)."""
    tensors = list(tensors)
    untied = any(name == LM_HEAD for name, _, _ in tensors)
    return sum(n * itemsize if itemsize else nbytes for name, n, nbytes in tensors
               if not (untied and name == EMBEDDING))


def gguf_step_bytes(path: str | Path, itemsize: int | None = None) -> int:
    """step_bytes of a GGUF file's tensors."""
    from pdserve.model.gguf import reader

    return step_bytes(((t.name, int(t.n_elements), int(t.n_bytes)) for t in reader(path).tensors),
                      itemsize)


def step_weight_bytes(model, dtype) -> tuple[int, int]:
    """(quantized bytes, dense bytes) a loaded model's decode step reads: every projection
    and the LM head, as ``step_bytes`` counts them from a file. int4 layers and a Q8_0 LM
    head (model/q8_head.py) count their packed bytes; dense layers ``in x out`` weights of
    ``dtype``, whatever their layout (oneDNN's too)."""
    from pdserve.model.q8_head import Q8Head
    from pdserve.model.quant import Int4Linear

    int4 = dense = 0
    for m in model.modules():
        if isinstance(m, Int4Linear):
            int4 += m.nbytes
        elif isinstance(m, Q8Head):
            int4 += m.table.nbytes
        elif hasattr(m, "in_features"):
            dense += m.in_features * m.out_features * dtype.itemsize
    return int4, dense
