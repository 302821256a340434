"""glibc malloc settings for a process that runs the model on the CPU.

A CPU forward allocates and frees tensors of a few MB in every layer of every
step (page gathers, attention and MLP temporaries). With glibc's defaults such
a block is either mmap'ed and munmap'ed each time, or taken from the heap top,
which is trimmed back to the kernel as soon as it is freed: either way every
layer page-faults its memory in again, and the copies into it (the decode
attention's page gather above all) run at page-fault speed. Measured on the
decode node (``benchmarks/overhead.py``): 54 % of a step's samples in the
gather's memcpy, the step 1.5x the same engine's step in a process whose
heap happened to stay warm.

``tune_malloc`` keeps freed blocks under 32 MiB in the process for reuse: the
mmap threshold is fixed at 32 MiB (glibc's largest; bigger blocks such as the
KV cache are still mapped and returned on free) and the heap is trimmed only
when 1 GiB lies free at its top. The price is RSS: the heap keeps the peak of
one step's temporaries. Settings given in the environment (MALLOC_*_ or
GLIBC_TUNABLES) are left alone, and PDSERVE_MALLOC_TUNING=0 turns this off (to
measure its effect); on other C libraries this does nothing.

The same settings keep what loading the model freed (the GGUF's dequantized float32
copies, the weights oneDNN reordered) in the heap: ``trim_malloc`` hands it back once,
after loading. ``lazy_buffer`` is memory the OS maps only as it is written: the KV cache,
of which a node uses a part, reads as zeros without taking any memory for the rest.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import mmap
import os
import sys
from dataclasses import dataclass
from typing import Callable

import torch

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20   # glibc's maximum on 64-bit (HEAP_MAX_SIZE / 2)
TRIM_THRESHOLD = 1 << 30

_done: bool | None = None


def _libc():
    """glibc, or None (another C library, another OS)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def _user_set() -> bool:
    env = os.environ
    return ("MALLOC_MMAP_THRESHOLD_" in env or "MALLOC_TRIM_THRESHOLD_" in env
            or "glibc.malloc" in env.get("GLIBC_TUNABLES", ""))


def tune_malloc() -> bool:
    """Applies the settings once per process; True if they are in force."""
    global _done
    if _done is not None:
        return _done
    _done = False
    if _user_set() or os.environ.get("PDSERVE_MALLOC_TUNING", "1") == "0":
        return _done
    mallopt = getattr(_libc(), "mallopt", None)
    if mallopt is None:  # not Linux, or musl and others: no mallopt
        return _done
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    _done = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)
                 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    if not _done:
        log.warning("mallopt refused the malloc settings: CPU steps may run slower")
    return _done


def trim_malloc() -> bool:
    """Hands the heap's free memory back to the kernel (glibc's ``malloc_trim(0)``, which
    also releases free pages inside the heap, not only at its top). True if it released
    any; False where there is no glibc."""
    trim = getattr(_libc(), "malloc_trim", None)
    if trim is None:
        return False
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return bool(trim(0))


def lazy_buffer(nbytes: int, reserve: bool = False) -> tuple[mmap.mmap, torch.Tensor]:
    """(the mapping, a uint8 tensor of ``nbytes`` over it): anonymous memory that reads as
    zeros and that the OS maps page by page as it is written. Keep the mapping as long as
    the tensor. ``reserve``: counted against the machine's commit limit now (a size the
    machine can never hold is refused here, not met by the OOM killer later); without it
    (MAP_NORESERVE) a simulated GPU's whole KV capacity can be addressed."""
    flags = mmap.MAP_PRIVATE | getattr(mmap, "MAP_ANONYMOUS", 0x20)
    if not reserve:
        flags |= getattr(mmap, "MAP_NORESERVE", 0x4000)
    mm = mmap.mmap(-1, max(1, nbytes), flags=flags)
    return mm, torch.frombuffer(mm, dtype=torch.uint8)[:nbytes]


@dataclass(frozen=True)
class SparseStorage:
    """A KV cache's bytes (``data``, uint8, reading as zeros) that are backed only where
    ``reserve(offset, nbytes)`` has been called; reserve raises OSError when the memory
    cannot be had. A prefill node's /dev/shm segment (node/kv/segment.py): writing an
    unreserved page would take memory that may not be there, a SIGBUS when it is not."""
    data: torch.Tensor
    reserve: Callable[[int, int], None]
