"""CPU kernels in C that torch does not have, compiled on first use and called through ctypes.

Every ``*.c`` file in this folder is one part of one shared library, built with the
system's C compiler (``cc -O3 -march=native -fopenmp``) and cached under
``$XDG_CACHE_HOME/pdserve/native`` (default ``~/.cache``), keyed by the sources, the
compiler's version and this CPU's model and flags: a node builds it once per machine
(about 5 s on the 2-core AVX-512 EPYC, 25 s on the AVX2 one: compile_library) and loads
it afterwards. ctypes releases the GIL for the call. The library links the same
``libgomp.so.1`` torch has loaded, so its OpenMP threads are torch's: same pool, same
thread count (``torch.set_num_threads``).

They run where ``why_unavailable()`` is None: an x86-64 CPU with AVX512-VNNI and
AVX512-BF16, or with AVX2, FMA and F16C (``avx512_on_avx2.h`` gives the same kernels each
512-bit operation as two 256-bit ones), a C compiler that built the library, and
``PDSERVE_NATIVE_KERNELS`` not set to 0. Elsewhere the callers keep torch's kernels, and
say so once at start-up (``describe``): never a silent difference in what runs, and never
a request that fails because a build did.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

log = logging.getLogger(__name__)

ENV = "PDSERVE_NATIVE_KERNELS"      # 0: torch's kernels only (comparisons, a broken cc)
CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16")
AVX2_FLAGS = ("avx2", "fma", "f16c")  # without CPU_FLAGS: built on avx512_on_avx2.h
SOURCES = tuple(sorted(Path(__file__).parent.glob("*.c")))
HEADERS = tuple(sorted(Path(__file__).parent.glob("*.h")))   # included by the sources
# -Wno-psabi: the AVX2 build passes 512-bit vectors between inlined functions only
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-Wno-psabi")
BUILD_TIMEOUT_S = 300   # a compiler that hangs must not hold a node's start-up for ever


def _cpu() -> tuple[str, list[str]]:
    model, flags = "", []
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and not model:
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = value.split()
    except OSError:
        pass
    return model, flags


def isa() -> str | None:
    """The instructions the kernels are built for on this CPU: "AVX-512" (VNNI, BF16),
    "AVX2" (the same kernels on avx512_on_avx2.h), or None (neither)."""
    _, flags = _cpu()
    if all(f in flags for f in CPU_FLAGS):
        return "AVX-512"
    if all(f in flags for f in AVX2_FLAGS):
        return "AVX2"
    return None


def _static_reason() -> str | None:
    if os.environ.get(ENV, "1").strip().lower() in ("0", "false", "off", "no"):
        return f"{ENV}=0"
    if platform.machine() not in ("x86_64", "AMD64"):
        return f"the CPU is {platform.machine()}, not x86-64"
    if isa() is None:
        _, flags = _cpu()
        missing = [f for f in AVX2_FLAGS if f not in flags]
        return (f"this CPU lacks {', '.join(missing)} (the kernels take AVX512-VNNI and "
                f"-BF16, or AVX2 with FMA and F16C)")
    if shutil.which("cc") is None:
        return "no C compiler (cc) on PATH"
    if not SOURCES:
        return f"the C sources are not installed beside {Path(__file__).name}"
    return None


@functools.cache
def why_unavailable() -> str | None:
    """None if the native kernels run here, else why not (one phrase). The first call
    builds the library if this machine has none cached: a build that fails makes them
    unavailable, with the compiler's message, logged once, and the torch paths serve."""
    why = _static_reason()
    if why is None:
        try:
            _load()
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            log.error("%s", e)
            why = str(e)
    return why


def available() -> bool:
    return why_unavailable() is None


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "pdserve" / "native"


def _key() -> str:
    h = hashlib.sha256()
    for src in (*SOURCES, *HEADERS):
        h.update(src.name.encode() + b"\0" + src.read_bytes() + b"\0")
    version = subprocess.run(["cc", "--version"], capture_output=True, text=True,
                             errors="replace", timeout=60).stdout
    model, flags = _cpu()
    h.update("\0".join([*CFLAGS, version, model, *flags]).encode())
    return h.hexdigest()[:20]


def compile_library(out: Path, defines: tuple[str, ...] = ()) -> None:
    """The library at ``out``, built from SOURCES with CFLAGS (and ``-D`` ``defines``, for
    the benchmarks' builds): each source compiled on its own, as many at once as this
    process may use CPUs, the longest first, then linked. (One ``cc`` call compiled them one
    after another; on the 2-core AVX2 EPYC their compiles add up to 33 s, 19 of them
    decode_attention.c's, and side by side the build takes 25.)
    Raises RuntimeError with the compiler's message, or past BUILD_TIMEOUT_S."""
    deadline = time.monotonic() + BUILD_TIMEOUT_S
    flags = ["cc", *CFLAGS, *(f"-D{d}" for d in defines)]
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        objects = {src: Path(tmp) / f"{src.stem}.o" for src in sorted(
            SOURCES, key=lambda src: src.stat().st_size, reverse=True)}
        pending = [[*flags, "-c", "-o", str(obj), str(src)] for src, obj in objects.items()]
        running: list[tuple[subprocess.Popen, Path]] = []
        try:
            while pending or running:
                while pending and len(running) < len(os.sched_getaffinity(0)):
                    running.append(_start(pending.pop(0), Path(tmp)))
                _finish(*running.pop(0), deadline)
            _finish(*_start([*flags, "-o", str(out), *map(str, objects.values())], Path(tmp)),
                    deadline)
        finally:
            for proc, _ in running:
                proc.kill()
                proc.wait()


def _start(cmd: list[str], tmp: Path) -> tuple[subprocess.Popen, Path]:
    """cmd started, its stderr to a file in tmp (a pipe left unread while another job is
    waited for could fill and stall it)"""
    err = tmp / f"{Path(cmd[-1]).name}.err"  # a source (compiling) or an object (linking)
    with err.open("w") as f:
        return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=f), err


def _finish(proc: subprocess.Popen, err: Path, deadline: float) -> None:
    try:
        code = proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise RuntimeError(f"building pdserve's native CPU kernels took over "
                           f"{BUILD_TIMEOUT_S} s; set {ENV}=0 to serve without them")
    if code:
        raise RuntimeError(f"building pdserve's native CPU kernels failed (cc exit {code}; "
                           f"set {ENV}=0 to serve without them):\n"
                           f"{err.read_text(errors='replace').strip()}")


def _build(target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    # built beside the target and renamed: a concurrent builder (another node starting on
    # the same machine) never loads a half-written file
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        compile_library(Path(tmp))
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@functools.cache
def _load() -> ctypes.CDLL:
    target = _cache_dir() / f"pdserve-native-{_key()}.so"
    if not target.exists():
        log.info("building pdserve's native CPU kernels into %s", target)
        _build(target)
    return ctypes.CDLL(str(target))


def library() -> ctypes.CDLL:
    """The shared library (import torch first: its libgomp). Raises RuntimeError saying
    why where ``why_unavailable()`` is not None."""
    why = why_unavailable()
    if why is not None:
        raise RuntimeError(f"pdserve's native CPU kernels cannot run here: {why}")
    return _load()


def function(name: str, argtypes: list, restype=ctypes.c_int):
    """One of the library's functions with its ctypes signature declared."""
    fn = getattr(library(), name)
    fn.argtypes, fn.restype = argtypes, restype
    return fn


def attention_why_not(dtype, dtypes: tuple, num_heads: int, num_kv_heads: int,
                      head_dim: int, device, max_head_dim: int,
                      max_group: int | None = None) -> str | None:
    """What the attention kernels share: None if one that takes ``dtypes``, head dims that
    are multiples of 16 up to ``max_head_dim`` and at most ``max_group`` query heads per kv
    head can serve these shapes on ``device``, else why not (one phrase)."""
    import torch

    why = why_unavailable()
    if why is not None:
        return f"native kernels unavailable: {why}"
    if torch.device(device).type != "cpu":
        return f"tensors on {torch.device(device).type}"
    if dtype not in dtypes:
        takes = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        return f"dtype {str(dtype).removeprefix('torch.')} (it takes {takes})"
    if head_dim % 16 or head_dim > max_head_dim:
        return f"head_dim {head_dim} (it takes multiples of 16 up to {max_head_dim})"
    if num_heads % num_kv_heads or (max_group and num_heads // num_kv_heads > max_group):
        most = f" (at most {max_group})" if max_group else ""
        return f"{num_heads} query heads over {num_kv_heads} kv heads{most}"
    return None


def describe() -> str:
    """For the start-up log: which CPU kernels run and, if not the native ones, why."""
    why = why_unavailable()
    return f"native CPU kernels ({isa()})" if why is None else \
        f"torch's CPU kernels only (native ones unavailable: {why})"
