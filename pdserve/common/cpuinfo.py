"""What this machine's CPU is and which of its instructions pdserve chooses by: the model
name and flags of /proc/cpuinfo, read once. No torch."""
from __future__ import annotations

import functools
import platform

# A CPU with one of these computes bfloat16 natively, so `--dtype auto` serves bfloat16
# on it (model/loader.py auto_dtype); elsewhere bfloat16 is converted to float32 in every
# GEMM and is slower than float32 itself.
NATIVE_BF16_FLAGS = ("amx_bf16", "avx512_bf16")
# The wide vector extensions worth naming beside a figure.
SHOWN_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_int8")


@functools.lru_cache(maxsize=1)
def cpu_info() -> tuple[str, frozenset[str]]:
    """(model name, flags) of the first CPU in /proc/cpuinfo; the platform's processor
    and no flags where there is no such file."""
    name, flags = "", frozenset()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and not name:
                    name = value.strip()
                elif key == "flags" and not flags:
                    flags = frozenset(value.split())
                if name and flags:
                    break
    except OSError:
        pass
    return name or platform.processor() or platform.machine() or "unknown CPU", flags


def native_bf16() -> list[str]:
    """The flags by which this CPU computes bfloat16 natively (empty: it does not)."""
    return [f for f in NATIVE_BF16_FLAGS if f in cpu_info()[1]]


def describe() -> str:
    """The CPU's model name and its wide vector extensions, for a printed figure."""
    name, flags = cpu_info()
    shown = [f for f in SHOWN_FLAGS if f in flags]
    return f"{name} ({', '.join(shown) or 'no AVX2'})"
