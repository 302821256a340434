"""Where a process's Python memory goes, on demand: with ``PDSERVE_HEAP_DUMP=DIR`` in its
environment a process starts tracemalloc and, on each SIGUSR2, writes the 25 source lines
that hold the most more than at the first signal to ``DIR/heap-PID.txt`` (the first signal
only takes the reference snapshot). For finding retained memory under hostile input
(benchmarks/memory_soak.py --heap); off, and free, unless the variable is set.
"""
from __future__ import annotations

import os
import signal
import tracemalloc
from pathlib import Path

ENV = "PDSERVE_HEAP_DUMP"
TOP = 25


def install() -> None:
    """Starts tracing and handles SIGUSR2 when ``PDSERVE_HEAP_DUMP`` names a folder."""
    folder = os.environ.get(ENV)
    if not folder:
        return
    tracemalloc.start(8)
    first: list[tracemalloc.Snapshot] = []

    def dump(_signum, _frame) -> None:
        snap = tracemalloc.take_snapshot().filter_traces(
            [tracemalloc.Filter(False, tracemalloc.__file__)])
        if not first:
            first.append(snap)
            return
        stats = snap.compare_to(first[0], "lineno")
        total = sum(s.size_diff for s in stats)
        lines = [f"total {total / 2**20:+.1f} MiB of Python allocations since the first signal"]
        lines += [str(s) for s in stats[:TOP]]
        path = Path(folder) / f"heap-{os.getpid()}.txt"
        path.write_text("\n".join(lines) + "\n")

    signal.signal(signal.SIGUSR2, dump)
