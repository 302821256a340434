"""The one place that decides torch or Triton, and checks what the kernels are given.

Triton is optional: on a machine without it (macOS, CPU-only installs) the
torch references still serve, and asking for Triton says why it can't run.
Triton reads TRITON_INTERPRET when a kernel is *defined*, so whether the
interpreter is usable is decided at import time and checked again at launch.

Every Triton launch goes through ``launch``. Inside ``record_launches()`` the
host wrappers take the Triton path for tensors on the meta device and their
launches are recorded instead of run: a model's forward on meta tensors then
yields exactly the kernels, block sizes and argument layouts it would launch
on CUDA, which ``pdserve kernels compile`` compiles ahead of time.
"""
from __future__ import annotations

import importlib.util
import math
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch
import torch.nn.functional as F

BACKENDS = ("torch", "triton")
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INDEX_DTYPES = (torch.int32, torch.int64)
# Set (to 1) by pdserve/aot.py (`pdserve kernels compile`): it compiles for GPUs off a GPU.
LOAD_TRITON_ENV = "PDSERVE_LOAD_TRITON"
_TRUE = ("1", "true", "on", "yes")


def _interpret_env() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in _TRUE


def triton_usable() -> bool:
    """Whether a Triton kernel can launch in this process: a CUDA device, the interpreter
    (TRITON_INTERPRET), or an ahead-of-time compile (PDSERVE_LOAD_TRITON).

    Anywhere else triton is not imported at all: a CPU node then neither pays its import
    nor prints nanobind's ~30 "leaked type/function" lines when it exits.
    """
    return (_interpret_env() or os.environ.get(LOAD_TRITON_ENV, "0").lower() in _TRUE
            or torch.cuda.is_available())


# Decided once, here, because the kernel modules define their @triton.jit functions at
# import (Triton reads TRITON_INTERPRET when a kernel is defined).
TRITON_INSTALLED = importlib.util.find_spec("triton") is not None
triton: Any = None
tl: Any = None
if triton_usable():
    try:
        import triton
        import triton.language as tl
    except ImportError:  # optional dependency
        triton = tl = None
        TRITON_INSTALLED = False


# Kernels below this package were (or will be) defined as interpreted functions.
INTERPRET_AT_IMPORT = triton is not None and _interpret_env()


def keep_triton_out() -> None:
    """For a process that serves or generates: where no Triton kernel can launch, make
    ``import triton`` fail for the rest of the process.

    torch imports triton on its own (building a module on the meta device imports
    torch._dynamo, which probes for triton), and triton's nanobind bindings print ~30
    "leaked" lines when the process exits. torch takes the ImportError as "no triton",
    which on a CPU is true for all it does. A process-wide switch, so only the commands
    call it, never the library (``LLM()`` in someone's program).
    """
    if triton is None and not triton_usable():
        sys.modules.setdefault("triton", None)  # type: ignore[assignment]


@dataclass(frozen=True)
class Launch:
    """One kernel launch as its host wrapper chose it."""
    kernel: Any                # the @triton.jit function
    grid: tuple[int, ...]
    args: tuple                # positional arguments: tensors, ints, floats
    kwargs: dict[str, Any]     # constexprs (the kernel's parameters) and compiler options


# A context variable, not a module global: recording is scoped to one `with` block (and
# one thread), like torch.no_grad, and never leaks into serving.
_RECORDED: ContextVar[list[Launch] | None] = ContextVar("pdserve_recorded_launches",
                                                        default=None)


@contextmanager
def record_launches() -> Iterator[list[Launch]]:
    """Within: Triton for meta tensors, and each launch appended to the list, not run."""
    if triton is None:
        raise RuntimeError("recording kernel launches needs the triton package, loaded with "
                           f"{LOAD_TRITON_ENV}=1 set before pdserve.kernels is imported")
    recorded: list[Launch] = []
    token = _RECORDED.set(recorded)
    try:
        yield recorded
    finally:
        _RECORDED.reset(token)


def launch(kernel: Any, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> None:
    """``kernel[grid](*args, **kwargs)``, or its record inside ``record_launches()``."""
    recorded = _RECORDED.get()
    if recorded is None:
        kernel[grid](*args, **kwargs)
    else:
        recorded.append(Launch(kernel, tuple(grid), args, kwargs))


def pick_backend(backend: str | None, device: torch.device) -> str:
    """Return "torch" or "triton" for tensors on ``device``; raise if it can't run.

    None means Triton on CUDA, torch elsewhere, and torch also when the kernels
    were defined under TRITON_INTERPRET (the test suite sets it): interpreting
    every layer of a model on a GPU would be slow beyond use. Meta tensors take
    Triton while launches are being recorded (``record_launches``).
    """
    if device.type == "meta" and _RECORDED.get() is not None:
        return "triton"
    if backend is None:
        use_triton = device.type == "cuda" and triton is not None and not INTERPRET_AT_IMPORT
        return "triton" if use_triton else "torch"
    if backend not in BACKENDS:
        raise ValueError(f"backend must be None, 'torch' or 'triton', got {backend!r}")
    if backend == "torch":
        return backend
    if not TRITON_INSTALLED:
        raise RuntimeError("backend='triton' needs the triton package, which is not installed")
    if device.type == "cuda" and triton is not None:
        return backend
    if device.type != "cpu":
        raise RuntimeError(f"backend='triton' runs on CUDA tensors (or CPU under the "
                           f"interpreter), got tensors on {device.type}")
    if not _interpret_env():
        raise RuntimeError("backend='triton' on CPU tensors needs TRITON_INTERPRET=1 "
                           "(no CUDA device)")
    if not INTERPRET_AT_IMPORT:
        raise RuntimeError("backend='triton' on CPU tensors needs TRITON_INTERPRET=1 set before "
                           "pdserve.kernels is imported (Triton reads it when kernels are defined)")
    return backend


def _dtype_names(dtypes: tuple[torch.dtype, ...]) -> str:
    return " or ".join(str(d).removeprefix("torch.") for d in dtypes)


def check_tensor(name: str, t: object, shape: str, dtypes: tuple[torch.dtype, ...],
                 dims: dict[str, tuple[int, str]], device: torch.device | None = None) -> None:
    """Check ``t`` against a shape such as "[num_seqs, num_heads, head_dim]".

    ``dims`` maps each dimension name already seen to (size, tensor it came from);
    names met for the first time are bound there, so later tensors must agree.
    """
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    names = _dim_names(shape)
    if t.dim() != len(names):
        raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")
    if t.dtype not in dtypes:
        raise ValueError(f"{name} must have dtype {_dtype_names(dtypes)}, got "
                         f"{str(t.dtype).removeprefix('torch.')}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device} but the other tensors are on {device}")
    for dim_name, size in zip(names, t.shape):
        seen = dims.get(dim_name)
        if seen is None:
            dims[dim_name] = (size, name)
        elif seen[0] != size:
            raise ValueError(f"{name} must have shape {shape} with {dim_name}={seen[0]} "
                             f"(from {seen[1]}), got {tuple(t.shape)}")


@lru_cache(maxsize=None)
def _dim_names(shape: str) -> tuple[str, ...]:
    """"[T, num_heads, head_dim]" -> its names, parsed once per shape: the checks run in
    every layer of every step (a few hundred a decode step)."""
    return tuple(shape.strip("[]").split(", "))


def check_same_dtype(name: str, t: torch.Tensor, other_name: str, other: torch.Tensor) -> None:
    if t.dtype != other.dtype:
        raise ValueError(f"{name} must have the dtype of {other_name} "
                         f"({str(other.dtype).removeprefix('torch.')}), got "
                         f"{str(t.dtype).removeprefix('torch.')}")


def check_paged_cache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      dims: dict[str, tuple[int, str]]) -> None:
    """The K/V page tensors attention reads: [num_blocks, block_size, num_kv_heads, head_dim]
    of q's dtype and device."""
    cache_shape = "[num_blocks, block_size, num_kv_heads, head_dim]"
    check_tensor("k_cache", k_cache, cache_shape, FLOAT_DTYPES, dims, q.device)
    check_tensor("v_cache", v_cache, cache_shape, FLOAT_DTYPES, dims, q.device)
    check_same_dtype("k_cache", k_cache, "q", q)
    check_same_dtype("v_cache", v_cache, "q", q)


def check_contiguous(name: str, t: torch.Tensor) -> None:
    """For tensors written in place (the caches): a copy would lose the writes."""
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (it is written in place), got strides "
                         f"{t.stride()} for shape {tuple(t.shape)}")


def check_gqa(num_heads: int, num_kv_heads: int) -> None:
    if num_kv_heads == 0 or num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads "
                         f"({num_kv_heads})")


def check_scale(scale: object) -> float:
    if (isinstance(scale, bool) or not isinstance(scale, (int, float))
            or not math.isfinite(scale) or scale <= 0):
        raise ValueError(f"scale must be a positive finite number, got {scale!r}")
    return float(scale)


def check_cu_seqlens(name: str, t: object, device: torch.device) -> int:
    """Check a [num_seqs + 1] offsets tensor; return num_seqs. Values are not read."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 1 or t.shape[0] < 1:
        raise ValueError(f"{name} must have shape [num_seqs + 1], got {tuple(t.shape)}")
    if t.dtype not in INDEX_DTYPES:
        raise ValueError(f"{name} must have dtype {_dtype_names(INDEX_DTYPES)}, got "
                         f"{str(t.dtype).removeprefix('torch.')}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but the other tensors are on {device}")
    return t.shape[0] - 1


def check_cu_values(name: str, cu: list[int], num_tokens: int) -> None:
    """Value checks, done only where the offsets are on the host anyway (torch path)."""
    if cu[0] != 0 or cu[-1] != num_tokens or any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"{name} must start at 0, never decrease and end at the number of "
                         f"tokens ({num_tokens}), got {cu}")


_SDPA_HAS_GQA = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
         attn_mask: torch.Tensor | None = None, is_causal: bool = False) -> torch.Tensor:
    """torch SDPA with GQA, called the way transformers' "sdpa" attention calls it.

    q [B, H, S, D], k/v [B, KVH, L, D] -> [B, H, S, D]. Same call, same bits:
    for an unpadded sequence the torch references agree with a transformers
    model run with attn_implementation="sdpa" exactly, not within a tolerance.
    """
    if q.shape[1] == k.shape[1]:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal,
                                              scale=scale)
    if _SDPA_HAS_GQA:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal,
                                              scale=scale, enable_gqa=True)
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal,
                                          scale=scale)


def last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    """Kernels take any outer strides but need unit stride along head_dim / hidden."""
    return t if t.stride(-1) == 1 else t.contiguous()


def head_block(head_dim: int) -> int:
    """Padded head_dim tile: a power of two, at least 16 (the smallest tl.dot size)."""
    if head_dim > 256:
        raise ValueError(f"head_dim must be at most 256 for the Triton kernels, got {head_dim}")
    return max(16, triton.next_power_of_2(head_dim))
