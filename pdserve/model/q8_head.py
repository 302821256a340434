"""A Q8_0 token embedding kept as GGUF stores it, serving both the lookup and the LM head.

SmolLM2's GGUFs store ``token_embd.weight`` as Q8_0 (per 32 weights an f16 scale ``d`` and
32 int8 ``q``: ``w = d * q``), tied to the LM head. Dequantized to bfloat16 it is 56.6 MB
the LM head reads every decode step (about 1.5 ms of a 9 ms batch-1 step), and at 16 rows
a compute-bound bfloat16 GEMM. Kept as stored it is 30 MB (8.5 bits a weight), and the
head runs kernels/native/q8_gemm.c: the hidden states quantized per call to int8 per 32
(llama.cpp's Q8_0 x Q8_0), exact int32 dots on AVX512-VNNI, float32 logits. The lookup
forms each row it is asked for from the same bytes, d * q rounded once to the model's
dtype: the rows a model dequantized at load holds, bit for bit. No dense copy is kept.

When: a GGUF loaded in bfloat16 on the CPU whose quantized projections stay quantized
(``quant.plan``: ``--quantization auto`` or ``int4``), where the native kernels run
(``kernels.native.available()``). Float32 models and ``--quantization none`` keep the
dequantized embedding and torch's (or oneDNN's) LM head, exactly as before. An untied
head stored Q8_0 stays Q8_0 the same way.

Numerics: the logits carry the int8 rounding of the hidden states: 5.0e-3 of their size
against the exact GEMM over the dequantized weight, where bfloat16's GEMM is 2.1e-3 (random
normal rows, benchmarks/q8_head.py). That moves near-ties: greedy departures from the
dequantized head in benchmarks/RESULTS.md. The lookup is exact (rows as dequantized).
"""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

from pdserve.kernels import native
from pdserve.kernels.native import q8_gemm

NAMES = ("model.embed_tokens.weight", "lm_head.weight")


def why_not(hf_name: str, type_name: str, dtype: torch.dtype) -> str | None:
    """None if a tensor (Hugging Face name, GGUF type) stays Q8_0 for a bfloat16 CPU model
    that keeps its quantized weights, else why not; the loader asks only for ``NAMES``."""
    if type_name != "Q8_0":
        return f"{type_name}: only a Q8_0 embedding or head stays as stored"
    if dtype != torch.bfloat16:
        return f"Q8_0: the native LM head serves bfloat16 models, not {dtype}"
    why = native.why_unavailable()
    if why is not None:
        return f"Q8_0: the native LM head cannot run here ({why})"
    return None


def summary(kept: list[tuple[str, Q8Embedding]], dtype: torch.dtype, tied: bool) -> str:
    """The start-up log line's part for what stayed Q8_0 (GGUF name, table), and its
    bytes against the dense weight's; empty if nothing did."""
    name = str(dtype).removeprefix("torch.")
    size = torch.empty((), dtype=dtype).element_size()
    parts = []
    for gguf_name, table in kept:
        role = "the embedding and the tied LM head" if tied and gguf_name == "token_embd.weight" \
            else "the LM head" if gguf_name == "output.weight" else "the embedding"
        dense = table.num_embeddings * table.embedding_dim * size
        parts.append(f"{gguf_name} kept as Q8_0 for {role} (native kernels, {native.isa()}): "
                     f"{table.nbytes / 2**20:.1f} MiB against {dense / 2**20:.1f} MiB in {name}")
    return "".join(f"; {p}" for p in parts)


class Q8Embedding(nn.Module):
    """``nn.Embedding``'s forward over Q8_0 blocks packed for q8_gemm.c; ``logits`` is the
    tied LM head over the same bytes."""

    def __init__(self, packed: torch.Tensor, num_embeddings: int,
                 dtype: torch.dtype = torch.bfloat16):
        """packed: ``q8_gemm.pack``'s [ceil(V / 16), H / 32, 544] uint8; ``dtype``: the
        rows' (the model's)."""
        super().__init__()
        self.packed = packed
        self.num_embeddings = num_embeddings
        self.embedding_dim = packed.shape[1] * q8_gemm.GROUP
        self.dtype = dtype

    @classmethod
    def from_gguf(cls, raw: np.ndarray, dtype: torch.dtype = torch.bfloat16) -> Q8Embedding:
        """A Q8_0 tensor's bytes [V, H / 32 * 34] as the GGUF reader gives them."""
        q, d = q8_gemm.unpack_gguf(raw)
        return cls(q8_gemm.pack(q, d), q.shape[0], dtype)

    @property
    def nbytes(self) -> int:
        return self.packed.numel()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] → [T, H] in the model's dtype."""
        return q8_gemm.rows(self.packed, input_ids, self.num_embeddings, self.dtype)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] → float32 logits [N, V]."""
        return q8_gemm.q8_mm(hidden, self.packed, self.num_embeddings)

    def dequantized(self) -> torch.Tensor:
        """The float32 weight [V, H], exactly d * q (tests)."""
        return q8_gemm.weight(self.packed, self.num_embeddings)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, Q8_0 ({self.nbytes} bytes)"


class Q8Head(nn.Module):
    """The LM head over a Q8Embedding's bytes (the embedding's own when tied, not a copy):
    hidden [N, H] → float32 logits [N, V]."""

    def __init__(self, table: Q8Embedding):
        super().__init__()
        # a plain attribute, not a submodule: the embedding is the model's, listed once
        object.__setattr__(self, "table", table)
        self.in_features, self.out_features = table.embedding_dim, table.num_embeddings
        self.bias = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.table.logits(hidden)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, Q8_0"
