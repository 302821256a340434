"""Where a decode step's time goes, phase by phase (issue 34, item 4).

Builds the native library with ``-DSTEP_PROFILE=1``: decode_step.c then counts, per thread,
the time-stamp counter's ticks in each phase's chunks and in its wait for the other
threads, in the norms and quantizing, the wait for a ring slot, the LM head, and the whole
of the team's work. An Engine of the default model (bfloat16, its int4 projections:
launch's defaults on this CPU) has its native step bound to that build. Per round: --batch
greedy sequences after a --prompt-len prompt, a reading of the read bandwidth (torch.sum,
pdserve/bench/floor.py), --steps steps timed, the counters read. Printed per round: the
reading and the step's median; then, over the rounds, the median of each part in µs a
step (the mean of the threads) and each projection's weights in GB/s.

With ``--define NAME=VALUE`` (repeatable) a second profiled build with those flags runs
beside the first, the two alternating round by round (ABBA), and the paired difference of
their step medians is printed: decode_step_builds.py's comparison, with the parts.

    python benchmarks/decode_step_phases.py [--batch 1] [--rounds 12] [--steps 30]
        [--prompt-len 128] [--threads 2] [--define W_AHEAD=0]

Ticks are converted at the TSC's rate, measured against time.perf_counter.
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import tempfile
import time
from datetime import datetime
from pathlib import Path

from decode_step_builds import build

# decode_step.c's parts, in its order (PH_* phases, their waits, then the rest)
PHASES = ["q/k/v", "attention", "combine", "o", "gate/up", "down"]
PARTS = PHASES + [f"wait {p}" for p in PHASES] + ["norms", "ring", "head", "team"]
MAX_THREADS = 64  # decode_step.c's PROFILE_THREADS


def weight_bytes(model) -> dict[str, int]:
    """Bytes of weights each projection phase reads in a step, and the LM head's"""
    from pdserve.model.q8_head import Q8Head

    sums = dict.fromkeys(["q/k/v", "o", "gate/up", "down", "head"], 0)
    for layer in model.model.layers:
        a, m = layer.self_attn, layer.mlp
        sums["q/k/v"] += a.qkv_proj.nbytes
        sums["o"] += a.o_proj.nbytes
        sums["gate/up"] += m.gate_up_proj.nbytes
        sums["down"] += m.down_proj.nbytes
    head = next((x for x in model.modules() if isinstance(x, Q8Head)), None)
    sums["head"] = head.table.nbytes if head is not None else 0
    return sums


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--steps", type=int, default=30, help="steps timed a round")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--define", action="append", default=[],
                    help="NAME=VALUE for a second build's cc -D (repeatable)")
    a = ap.parse_args()
    if min(a.batch, a.rounds, a.steps, a.prompt_len, a.threads) < 1:
        ap.error("--batch, --rounds, --steps, --prompt-len and --threads must be at least 1")
    if a.threads > MAX_THREADS:
        ap.error(f"--threads: at most {MAX_THREADS} are counted")

    from pdserve.bench.cluster import machine
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.engine import Engine
    from pdserve.kernels.native import decode_step

    engine = Engine(EngineConfig(dtype="bfloat16", quantization="auto", threads=a.threads,
                                 kv_cache_memory_gb=0.5), detokenize=False)
    if engine.model.native_step is None:
        raise SystemExit("the native decode step does not serve this model here")
    shipped = decode_step._fn()
    nbytes = weight_bytes(engine.model)
    builds = [["STEP_PROFILE=1"]] + ([["STEP_PROFILE=1", *a.define]] if a.define else [])
    names = ["as in the tree"] + (["-D" + " -D".join(a.define)] if a.define else [])
    with tempfile.TemporaryDirectory() as tmp:
        libs = [build(d, Path(tmp) / f"profiled{i}.so") for i, d in enumerate(builds)]
        for lib in libs:
            fn = lib.pd_decode_step
            fn.argtypes, fn.restype = shipped.argtypes, shipped.restype
            lib.pd_step_profile.argtypes = [ctypes.POINTER(ctypes.c_uint64)]
        print(f"{datetime.now():%Y-%m-%d %H:%M}; {machine()}; threads {a.threads}; batch "
              f"{a.batch}; {a.rounds} rounds of {a.steps} steps" +
              (", builds ABBA" if len(libs) > 1 else ""))
        hz = tsc_hz(libs[0])
        try:
            rows = run_rounds(a, engine, libs, names)
        finally:
            decode_step._fn = lambda: shipped  # the library the node loaded
        report(rows, names, nbytes, hz)


def run_rounds(a, engine, libs: list, names: list[str]) -> list[list[tuple[float, list[float]]]]:
    """Per build, per round: the step's median seconds and each part's ticks a step (the
    threads' mean); each round printed as it ends"""
    import torch

    from pdserve.bench.floor import read_bandwidth_gbs
    from pdserve.common.sampling import SamplingParams
    from pdserve.kernels.native import decode_step

    counts = (ctypes.c_uint64 * (MAX_THREADS * len(PARTS)))()
    gen = torch.Generator().manual_seed(a.batch)
    rows: list[list[tuple[float, list[float]]]] = [[] for _ in libs]
    for r in range(a.rounds):
        for i in range(a.batch):
            prompt = torch.randint(3, 40000, (a.prompt_len,), generator=gen).tolist()
            engine.add_request(f"{r}-{i}", prompt, SamplingParams(
                max_tokens=4 + a.steps * len(libs), temperature=0, ignore_eos=True))
        for _ in range(3):  # the prefill, and decode steps before the counted ones
            engine.step()
        line = [f"round {r:2d}: {read_bandwidth_gbs(a.threads, repeats=3):5.1f} GB/s"]
        for which in (range(len(libs)) if r % 2 == 0 else reversed(range(len(libs)))):
            lib = libs[which]
            decode_step._fn = (lambda f: lambda: f)(lib.pd_decode_step)
            lib.pd_step_profile(counts)  # cleared
            ts = []
            for _ in range(a.steps):
                t0 = time.perf_counter()
                engine.step()
                ts.append(time.perf_counter() - t0)
            lib.pd_step_profile(counts)
            ticks = [statistics.mean(counts[t * len(PARTS) + p] for t in range(a.threads))
                     / a.steps for p in range(len(PARTS))]
            rows[which].append((statistics.median(ts), ticks))
            line.append(f"{names[which]} {statistics.median(ts) * 1e3:.3f} ms")
        while engine.has_unfinished():
            engine.step()
        print("; ".join(line), flush=True)
    return rows


def report(rows: list, names: list[str], nbytes: dict[str, int], hz: float) -> None:
    """Each build's medians over the rounds, and the paired difference of two builds"""
    for name, rs in zip(names, rows):
        part = [statistics.median(x[1][p] for x in rs) / hz * 1e6 for p in range(len(PARTS))]
        print(f"\n{name}: step median {statistics.median(x[0] for x in rs) * 1e3:.3f} ms; "
              "µs a step (median of rounds, the threads' mean):")
        print("  " + ", ".join(f"{n} {v:.0f}" for n, v in zip(PARTS, part) if v >= 0.5))
        rate = {n: nbytes[n] / (part[PARTS.index(n)] * 1e-6) / 1e9
                for n in ("q/k/v", "o", "gate/up", "down", "head")
                if nbytes[n] and part[PARTS.index(n)] > 0}
        print("  weights' GB/s: " + ", ".join(f"{n} {v:.1f}" for n, v in rate.items()))
    if len(rows) > 1:
        diffs = [x[0] - y[0] for x, y in zip(rows[0], rows[1])]
        print(f"\n{names[0]} - {names[1]}: median paired difference "
              f"{statistics.median(diffs) * 1e3:+.3f} ms, faster in "
              f"{sum(d < 0 for d in diffs)}/{len(diffs)} rounds")


def tsc_hz(lib) -> float:
    """The time-stamp counter's ticks a second, read through the profiled library over
    half a second"""
    lib.pd_step_ticks.restype = ctypes.c_uint64
    t0, k0 = time.perf_counter(), lib.pd_step_ticks()
    time.sleep(0.5)
    return (lib.pd_step_ticks() - k0) / (time.perf_counter() - t0)


if __name__ == "__main__":
    main()
