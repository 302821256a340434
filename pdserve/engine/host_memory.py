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
``into_huge_pages`` moves the weights a decode step streams into memory the kernel maps
with 2 MiB pages.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import mmap
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20   # glibc's maximum on 64-bit (HEAP_MAX_SIZE / 2)
TRIM_THRESHOLD = 1 << 30
MADV_HUGEPAGE = 14
HUGE_PAGE = 2 << 20
ALIGN = 64                  # each tensor in the arena starts on a cache line
THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"

_done: bool | None = None


def _libc():
    """glibc, or None (another C library, another OS)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
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


def thp_mode() -> str | None:
    """The kernel's transparent huge page mode ("always", "madvise" or "never"), or None
    where it has none (not Linux, or a kernel built without them)."""
    try:
        text = Path(THP_ENABLED).read_text()
    except OSError:
        return None
    found = re.search(r"\[(\w+)\]", text)
    return found.group(1) if found else None


def _huge_bytes(start: int, end: int) -> int:
    """Bytes of [start, end) in this process that the kernel maps with huge pages (the
    AnonHugePages of /proc/self/smaps's mappings that lie inside it)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            if line[0] in "0123456789abcdef" and "-" in line.split(" ", 1)[0]:
                lo, hi = (int(x, 16) for x in line.split(" ", 1)[0].split("-"))
                inside = lo >= start and hi <= end
            elif inside and line.startswith("AnonHugePages:"):
                total += int(line.split()[1]) * 1024
    return total


def into_huge_pages(tensors: list[torch.Tensor]) -> str:
    """Moves ``tensors`` (CPU, contiguous, each the whole of its storage; any other is
    left where it is, and the sentence returned counts it) into one arena the kernel
    backs with 2 MiB pages (madvise MADV_HUGEPAGE), one after another in
    the order given; each tensor stays the same object (``set_``), so whoever holds it
    reads the new memory, but an address taken before (a native kernel's bound pointers)
    is stale: LlamaForCausalLM.place_streamed_weights rebinds its step. Returns what was
    done, for the start-up log.

    Why: a batch-1 decode step streams every weight once, ~97 MB for the default model,
    over 4 KiB pages a miss in the TLB each: the default model's batch-1 step, these
    weights in 2 MiB pages against 4 KiB ones in one engine, ABBA, 2.87 against 3.13 ms,
    shorter in 28/30 rounds (benchmarks/huge_pages.py; RESULTS.md "the packed weights in
    2 MiB pages"). PDSERVE_HUGE_PAGES=0 leaves them in place (to measure it)."""
    tensors = list({id(t): t for t in tensors}.values())
    if not tensors:
        return "none to place"
    mode, libc = thp_mode(), _libc()
    why = ("PDSERVE_HUGE_PAGES=0" if os.environ.get("PDSERVE_HUGE_PAGES", "1") == "0"
           else "no transparent huge pages on this system" if mode is None or libc is None
           else "the kernel's transparent huge pages are off (never)" if mode == "never"
           else None)
    if why is not None:
        return f"{_mib(tensors)} in 4 KiB pages: {why}"
    whole = [t for t in tensors if t.device.type == "cpu" and t.is_contiguous()
             and t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.nbytes]
    if not whole:
        return f"{_mib(tensors)} left in place: none is a whole contiguous CPU storage"
    left = "" if len(whole) == len(tensors) else (
        f"; {len(tensors) - len(whole)} left in place (not a whole contiguous CPU storage)")
    offsets, at = [], 0
    for t in whole:
        offsets.append(at)
        at += -(-t.nbytes // ALIGN) * ALIGN
    span = -(-at // HUGE_PAGE) * HUGE_PAGE
    # a mapping of its own, never touched before the advice: memory from malloc can be
    # reused heap (glibc serves blocks below its adaptive mmap threshold, up to 32 MiB,
    # from there) whose pages are already 4 KiB ones. The storage frombuffer made holds
    # the mapping: it lives as long as a tensor placed in it.
    _, raw = lazy_buffer(span + HUGE_PAGE, reserve=True)
    base = raw.data_ptr() + (-raw.data_ptr()) % HUGE_PAGE
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.madvise.restype = ctypes.c_int
    if libc.madvise(base, span, MADV_HUGEPAGE) != 0:
        return (f"{_mib(tensors)} in 4 KiB pages: madvise(MADV_HUGEPAGE) failed: "
                f"{os.strerror(ctypes.get_errno())}")
    storage, first = raw.untyped_storage(), base - raw.data_ptr()
    for t, offset in zip(whole, offsets):
        raw[first + offset:first + offset + t.nbytes].copy_(t.view(-1).view(torch.uint8))
        t.set_(storage, (first + offset) // t.element_size(), t.shape)
    huge = min(_huge_bytes(base, base + span), sum(t.nbytes for t in whole))
    return (f"{_mib(whole)} in one arena, {huge / 2**20:.1f} MiB of it in 2 MiB pages "
            f"(transparent huge pages: {mode}){left}")


def _mib(tensors: list[torch.Tensor]) -> str:
    return f"{sum(t.nbytes for t in tensors) / 2**20:.1f} MiB"


@dataclass(frozen=True)
class SparseStorage:
    """A KV cache's bytes (``data``, uint8, reading as zeros) that are backed only where
    ``reserve(offset, nbytes)`` has been called; reserve raises OSError when the memory
    cannot be had. A prefill node's /dev/shm segment (node/kv/segment.py): writing an
    unreserved page would take memory that may not be there, a SIGBUS when it is not."""
    data: torch.Tensor
    reserve: Callable[[int, int], None]
