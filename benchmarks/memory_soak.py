"""Memory soak of issue 35's hostile cases, longer than the test's (tests/e2e/test_memory_soak.py):
``pdserve launch`` (1 prefill + 1 decode, a tiny random llama unless --model), --rounds of
each case in tests/e2e/memory_cases.py with a normal request after each, and each process's
RSS from /proc: before the case, after round 1, after the last round.

With --heap every process traces its Python allocations (pdserve/common/heap_dump.py) and,
per case, the lines that hold the most more after the last round than before the case are
written to --out/CASE/heap-PID.txt.

    python benchmarks/memory_soak.py [--rounds 30] [--case "vanishing producers"] [--heap]
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pdserve.common.heap_dump import ENV as HEAP_ENV  # noqa: E402
from pdserve.model.make_model import make_model  # noqa: E402
from tests.cluster import launched  # noqa: E402
from tests.e2e.memory_cases import CASES, MB, soak  # noqa: E402
from tests.e2e.test_attack import normal_text  # noqa: E402
from tests.e2e.test_memory import roles  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--case", action="append", choices=list(CASES))
    ap.add_argument("--model", help="a model folder (default: a tiny random llama)")
    ap.add_argument("--heap", action="store_true", help="tracemalloc in every process")
    ap.add_argument("--out", default=tempfile.mkdtemp(prefix="memory_soak-"))
    args = ap.parse_args()
    out = Path(args.out)
    model = Path(args.model or make_model(out / "llama", arch="llama", preset="tiny", seed=0))
    (out / "logs").mkdir(parents=True, exist_ok=True)
    heap_dir = out / "heap"
    if args.heap:
        heap_dir.mkdir(parents=True, exist_ok=True)
        os.environ[HEAP_ENV] = str(heap_dir)  # the launched processes inherit it
    with launched(model, 1, 1, log_dir=out / "logs") as c:
        c.model = model.name
        c.baseline = normal_text(c)
        pids = roles(c)
        for _ in range(5):
            normal_text(c)

        def serve():
            assert normal_text(c) == c.baseline

        print(f"{'case':22} {'process':10} {'before':>7} {'round 1':>8} {'last':>7} MB")
        for name in args.case or CASES:
            signal_all(pids)  # the reference snapshot
            seen = soak(c, pids, CASES[name], args.rounds, serve)
            if args.heap:
                signal_all(pids)
                time.sleep(2.0)
                case_dir = out / name.replace(" ", "_").replace("=", "")
                case_dir.mkdir(exist_ok=True)
                for f in heap_dir.glob("heap-*.txt"):
                    f.rename(case_dir / f.name)
            for proc, s in seen.items():
                print(f"{name:22} {proc:10} {s[0] // MB:7} {s[1] // MB:8} {s[-1] // MB:7}")
    print(f"logs and heap dumps under {out}")
    return 0


def signal_all(pids: dict[str, int]) -> None:
    if os.environ.get(HEAP_ENV):
        for pid in pids.values():
            os.kill(pid, signal.SIGUSR2)
        time.sleep(1.0)


if __name__ == "__main__":
    sys.exit(main())
