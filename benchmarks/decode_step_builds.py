"""Two builds of the native CPU kernels side by side in one engine: the library as shipped
against one built with ``-D`` flags that switch a piece of it off (issue 34, item 4).

On a shared 2-core machine the step moves by tens of percent from one minute to the next,
so two runs one after the other cannot tell a few percent apart. Here one Engine (the
default model, bfloat16, its int4 projections: launch's defaults on this CPU) serves
``--batch`` greedy sequences, and its native decode step is switched between the two
libraries every ``--segment`` steps, in ABBA order (the context grows through a round: the
build that runs second would otherwise always see the longer one). Printed per build: the
step's median and mean; then the median of the paired differences between segments of a
round, how many rounds the build as shipped won, and the ratio of the medians.

``--beside N`` runs N processes beside the engine, each busy ``--busy-us`` of every
``--period-us``: a stand-in for the router, a client and the I/O threads that share a
node's cores through launch, which take a thread of the step's team off its core for a
while (``--define TAKE_OVER=0`` against the step that goes past such a thread).
``--asleep-us N`` makes that preemption exact instead: in every step of both builds the
team's second thread sleeps N microseconds before its first chunk of layer 5's q/k/v
(decode_step.c's pd_decode_step_stall, which the tests use; while it is set each step
also fills its scratch with NaNs first, in both builds alike).

    python benchmarks/decode_step_builds.py --define KV_AHEAD=0 [--batch 1,16]
        [--rounds 40] [--segment 20] [--prompt-len 32] [--max-len 400]
        [--beside 2 --busy-us 350 --period-us 5000] [--asleep-us 900]
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path


def build(defines: list[str], out: Path) -> ctypes.CDLL:
    """The native library built as the nodes build it, plus ``-D`` defines."""
    from pdserve.kernels import native

    native.compile_library(out, tuple(defines))
    return ctypes.CDLL(str(out))


STALL_ARGS = [ctypes.c_int] * 4 + [ctypes.c_int64]

BUSY = """import sys, time
busy, period = float(sys.argv[1]) * 1e-6, float(sys.argv[2]) * 1e-6
while True:
    t = time.perf_counter()
    while time.perf_counter() - t < busy:
        pass
    time.sleep(period - busy)
"""


@contextlib.contextmanager
def busy_beside(n: int, busy_us: float, period_us: float):
    """n processes, each busy busy_us of every period_us, while the block runs; killed
    after it, on success and failure alike"""
    procs = [subprocess.Popen([sys.executable, "-c", BUSY, str(busy_us), str(period_us)])
             for _ in range(n)]
    try:
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


def compare(engine, steps: list, batch: int, rounds: int, segment: int, prompt_len: int,
            max_len: int) -> tuple[list[list[float]], list[list[float]]]:
    """Per build: every step's seconds, and each round's segment median."""
    import torch

    from pdserve.common.sampling import SamplingParams
    from pdserve.kernels.native import decode_step

    gen = torch.Generator().manual_seed(batch)
    live: list[str] = []

    def restart():
        for req_id in live:
            engine.finish(req_id)
        while engine.has_unfinished():
            engine.step()
        live.clear()
        for _ in range(batch):
            req_id = f"{batch}-{time.monotonic_ns()}-{len(live)}"
            prompt = torch.randint(3, 40000, (prompt_len,), generator=gen).tolist()
            engine.add_request(req_id, prompt, SamplingParams(
                max_tokens=max_len, temperature=0, ignore_eos=True))
            live.append(req_id)
        for _ in range(2):  # the prefill, and a decode step
            engine.step()

    times: list[list[float]] = [[], []]
    medians: list[list[float]] = [[], []]
    restart()
    decoded = 0
    for r in range(rounds):
        if decoded + 2 * segment > max_len - 8:
            restart()
            decoded = 0
        for which in ((0, 1) if r % 2 == 0 else (1, 0)):
            decode_step._fn = steps[which]
            seg = []
            for _ in range(segment):
                t0 = time.perf_counter()
                engine.step()
                seg.append(time.perf_counter() - t0)
            decoded += segment
            times[which] += seg
            medians[which].append(statistics.median(seg))
    return times, medians


def report(engine, steps: list, names: list[str], batches: list[int], a) -> None:
    """compare() at each batch size (``a``: the rounds, segment, prompt and length), then
    per build the step's median and mean, and the median of the paired differences (the
    first build's segment less the second's), the rounds the first was faster in and the
    ratio of the medians (first / second)."""
    for batch in batches:
        times, medians = compare(engine, steps, batch, a.rounds, a.segment, a.prompt_len,
                                 a.max_len)
        for name, ts in zip(names, times):
            print(f"batch {batch:3d} {name:>16}: step median {statistics.median(ts) * 1e3:7.3f}"
                  f" ms, mean {statistics.mean(ts) * 1e3:7.3f}")
        diffs = [x - y for x, y in zip(medians[0], medians[1])]
        print(f"batch {batch:3d} {names[0]} - other: median paired difference "
              f"{statistics.median(diffs) * 1e3:+.3f} ms, faster in "
              f"{sum(d < 0 for d in diffs)}/{len(diffs)} rounds; ratio of medians "
              f"{statistics.median(times[0]) / statistics.median(times[1]):.3f}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--define", action="append", required=True,
                    help="a -D flag for the other build (repeatable): KV_AHEAD=0")
    ap.add_argument("--batch", default="1,16", help="sequences decoded at once, comma-separated")
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--segment", type=int, default=20, help="steps before switching builds")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--max-len", type=int, default=400, help="tokens a sequence decodes")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--beside", type=int, default=0,
                    help="processes busy beside the engine (a node's neighbours)")
    ap.add_argument("--busy-us", type=float, default=350.0)
    ap.add_argument("--period-us", type=float, default=5000.0)
    ap.add_argument("--asleep-us", type=int, default=0,
                    help="the second thread asleep this long in every step (layer 5)")
    a = ap.parse_args()
    try:
        batches = [int(b) for b in a.batch.split(",")]
    except ValueError:
        ap.error(f"--batch {a.batch!r}: whole numbers, comma-separated")
    if min(batches) < 1 or a.rounds < 1 or a.segment < 1 or a.prompt_len < 1:
        ap.error("--batch, --rounds, --segment and --prompt-len must be at least 1")
    if a.beside < 0 or not 0 < a.busy_us < a.period_us:
        ap.error("--beside must be at least 0, --busy-us between 0 and --period-us")
    if a.asleep_us and (a.asleep_us < 0 or a.threads < 2):
        ap.error("--asleep-us must be at least 0 and needs --threads 2 or more")
    if a.max_len < 2 * a.segment + 8:  # a round's two segments must fit in one sequence
        ap.error(f"--max-len must be at least 2 * --segment + 8 ({2 * a.segment + 8})")

    from pdserve.bench.cluster import machine
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.engine import Engine
    from pdserve.kernels import native
    from pdserve.kernels.native import decode_step

    engine = Engine(EngineConfig(dtype="bfloat16", quantization="auto", threads=a.threads,
                                 kv_cache_memory_gb=0.5), detokenize=False)
    if engine.model.native_step is None:
        raise SystemExit("the native decode step does not serve this model here")
    shipped = decode_step._fn()  # the library the node loaded
    with tempfile.TemporaryDirectory() as tmp:
        lib = build(a.define, Path(tmp) / "other.so")
        other = lib.pd_decode_step
        other.argtypes, other.restype = shipped.argtypes, shipped.restype
        steps = [lambda: shipped, lambda: other]
        names = ["as shipped", " ".join(f"-D{d}" for d in a.define)]
        beside = f"; beside {a.beside} x busy {a.busy_us:g} us of {a.period_us:g}" \
            if a.beside else ""
        asleep = f"; thread 1 asleep {a.asleep_us} us a step" if a.asleep_us else ""
        print(f"{datetime.now():%Y-%m-%d %H:%M}; {machine()}; threads {a.threads}; "
              f"{a.rounds} rounds of 2 x {a.segment} steps, ABBA{beside}{asleep}")
        stalls = [native.function("pd_decode_step_stall", STALL_ARGS),
                  lib.pd_decode_step_stall]
        stalls[1].argtypes = STALL_ARGS
        try:
            for stall in stalls:  # (thread, layer, phase: q/k/v, before its chunk, us)
                stall(1, 5, 0, 0, a.asleep_us)
            with busy_beside(a.beside, a.busy_us, a.period_us):
                report(engine, steps, names, batches, a)
        finally:
            for stall in stalls:
                stall(-1, -1, -1, -1, 0)


if __name__ == "__main__":
    main()
