"""The int4 GEMM alone (int4_gemm.c's vnni_int4_mm) in two builds side by side: the library
as shipped against one built with ``-D`` flags (decode_step_builds.py does the same for
the whole decode step, where the memory's speed hides the kernel's own).

SmolLM2-135M's projections at ``--rows`` rows, ``--layers`` layers of them (vnni_int4.py's
weights), called layer after layer through ctypes; the builds alternate ABBA, each run
repeated to about 200 MB of weights. With 3 layers (6.6 MB) the weights stay in the L3
cache and the kernel's compute is what is timed; with 30 (66 MB) they come from memory,
as in a decode step; either way in one arena of 2 MiB pages, where a node puts them
(engine/host_memory.py's into_huge_pages). Both builds must give the same outputs, bit
for bit; the script checks that first. Printed: each build's median time and GB/s of
weights, the ratio (other / as shipped) and how many rounds the build as shipped won.

    python benchmarks/int4_builds.py --define HI_IN_PLACE=0 [--layers 3,30] [--rows 1,2]
        [--rounds 15] [--threads 1,2]
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from datetime import datetime
from pathlib import Path

import torch
from decode_step_builds import build
from vnni_int4 import build as weights

from pdserve.bench.cluster import machine
from pdserve.engine.host_memory import into_huge_pages
from pdserve.kernels.native import int4_gemm


def compare(fns, layers: int, rows: int, rounds: int) -> tuple[list[float], list[float], int]:
    """Seconds a pass over every layer takes, per round, for each build; and the bytes."""
    ws = [(n, k, p) for n, k, _, _, p in weights(layers)]
    into_huge_pages([p for _, _, p in ws])  # as a node places them
    xs = {k: torch.randn(rows, k).to(torch.bfloat16) for _, k, _ in ws}
    outs = [[torch.empty(rows, n, dtype=torch.bfloat16) for n, _, _ in ws] for _ in fns]
    calls = [[(xs[k].data_ptr(), 1, rows, k, n, p.data_ptr(), o.data_ptr(), 1)
              for (n, k, p), o in zip(ws, out)] for out in outs]
    for f, cs in zip(fns, calls):
        for c in cs:
            f(*c)
    if not all(torch.equal(a, b) for a, b in zip(*outs)):
        raise SystemExit("the two builds give different outputs")
    nbytes = sum(p.numel() for _, _, p in ws)
    reps = max(1, int(200e6 // nbytes))
    times: tuple[list[float], list[float]] = ([], [])
    for r in range(rounds):
        for i in ((0, 1) if r % 2 == 0 else (1, 0)):
            t = time.perf_counter()
            for _ in range(reps):
                for c in calls[i]:
                    fns[i](*c)
            times[i].append((time.perf_counter() - t) / reps)
    return *times, nbytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--define", action="append", required=True,
                    help="NAME=VALUE for the other build's cc -D (repeatable)")
    ap.add_argument("--layers", default="3,30", help="comma-separated")
    ap.add_argument("--rows", default="1,2", help="comma-separated")
    ap.add_argument("--threads", default="1,2", help="torch's threads, comma-separated")
    ap.add_argument("--rounds", type=int, default=15)
    a = ap.parse_args()
    shipped = int4_gemm._mm()  # the library the nodes load, its signature declared there
    with tempfile.TemporaryDirectory() as tmp:
        other = build(a.define, Path(tmp) / "other.so").vnni_int4_mm
        other.argtypes, other.restype = shipped.argtypes, shipped.restype
        fns = [shipped, other]
        print(f"{datetime.now():%Y-%m-%d %H:%M}; {machine()}; {a.rounds} rounds, ABBA; "
              f"other: -D{' -D'.join(a.define)}")
        print("| threads | layers (MB) | rows | as shipped ms | GB/s | other ms | GB/s "
              "| other / shipped | shipped faster |")
        print("|---|---|---|---|---|---|---|---|---|")
        for threads in map(int, a.threads.split(",")):
            torch.set_num_threads(threads)  # the kernel's OpenMP team is torch's
            for layers in map(int, a.layers.split(",")):
                for rows in map(int, a.rows.split(",")):
                    ta, tb, nbytes = compare(fns, layers, rows, a.rounds)
                    ma, mb = statistics.median(ta), statistics.median(tb)
                    won = sum(x < y for x, y in zip(ta, tb))
                    print(f"| {threads} | {layers} ({nbytes / 1e6:.1f}) | {rows} | "
                          f"{ma * 1e3:.3f} | {nbytes / ma / 1e9:.1f} | {mb * 1e3:.3f} | "
                          f"{nbytes / mb / 1e9:.1f} | {mb / ma:.3f} | {won}/{a.rounds} |")


if __name__ == "__main__":
    main()
