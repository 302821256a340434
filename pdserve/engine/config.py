"""The engine's frozen configuration, checked where a user sets it."""
from __future__ import annotations

import math
from dataclasses import dataclass

from pdserve.common.config import MODEL_DTYPES

DTYPES = (*MODEL_DTYPES, "auto")   # auto: the checkpoint's own
COMPUTE_MODES = ("model", "none")
CPU_LINEAR_MODES = ("auto", "onednn", "torch")


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None             # checkpoint folder or .gguf; None = the default model
    dtype: str = "float32"               # float32 | bfloat16 | float16 | auto
    device: str = "cpu"
    block_size: int = 16
    num_kv_blocks: int | None = None     # None: sized from kv_cache_memory_gb
    kv_cache_memory_gb: float = 0.5
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048   # token budget of one step; longer prompts are chunked
    max_model_len: int | None = None     # None: the model's own limit
    threads: int | None = None           # torch CPU threads; None: torch's default
    compute: str = "model"               # "none": skip the forward, emit a fixed token
                                         # (benchmarks of everything around the model)
    enable_prefix_caching: bool = True   # reuse the KV of full blocks of earlier prompts
    # CPU decode windows (engine/decode_window.py): at most this much memory; None: half
    # the KV cache's size; 0: off (every decode step gathers the context from the pages)
    decode_window_memory_gb: float | None = None
    # float32 and bfloat16 linear layers on the CPU (model/cpu_linear.py): "onednn" (each
    # weight reordered once: ~1.6x faster GEMMs at decode rows), "torch" (F.linear:
    # transformers' bits), "auto": onednn where torch has it
    cpu_linear: str = "auto"

    def __post_init__(self):
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if not 0 < self.kv_cache_memory_gb < math.inf:
            raise ValueError(f"kv_cache_memory_gb must be > 0 and finite, got "
                             f"{self.kv_cache_memory_gb}")
        if self.decode_window_memory_gb is not None and not (
                0 <= self.decode_window_memory_gb < math.inf):
            raise ValueError(f"decode_window_memory_gb must be >= 0 and finite, got "
                             f"{self.decode_window_memory_gb}")
        if self.cpu_linear not in CPU_LINEAR_MODES:
            raise ValueError(f"cpu_linear must be one of {CPU_LINEAR_MODES}, got "
                             f"{self.cpu_linear!r}")
        if self.compute not in COMPUTE_MODES:
            raise ValueError(f"compute must be one of {COMPUTE_MODES}, got {self.compute!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
