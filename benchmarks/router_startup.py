"""The router's own cost: import time, start-up until /health answers with nodes, and RSS.

1. ``import pdserve.router.main`` in a fresh interpreter, ``--runs`` times: seconds, and
   whether torch or triton came with it.
2. ``--runs`` times: a prefill and a decode node (``--compute none``) are started and
   left to come up (their /metrics answers); then ``pdserve router`` (``python -m
   pdserve.cli router``) is started, and the times until its /health first answers
   (any status: the router is up) and until it says 200 (nodes registered) are taken.
   Then the router's VmRSS (/proc/PID/status) and whether libtorch or triton is mapped
   into it (/proc/PID/maps). Everything is stopped.

    PYTHONPATH=. python benchmarks/router_startup.py [--runs 5] [--model DIR|FILE.gguf]

Without --model, the bundled default (a GGUF file, whose metadata takes gguf's reader
about 3 s to parse: that, not the imports, is most of the start-up then).

PYTHONPATH picks the code measured (another checkout's path for "before"); children
inherit it, and run in a temporary folder so that the current one (first on their
sys.path) cannot shadow it.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

from pdserve.common.sockets import free_port

CWD = tempfile.gettempdir()
IMPORT = ("import time, sys; t = time.perf_counter(); import pdserve.router.main; "
          "print(time.perf_counter() - t, 'torch' in sys.modules, 'triton' in sys.modules)")


def status(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=1) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return None


def wait_for(url: str, timeout_s: float, procs, want=(200,)) -> float:
    start = time.monotonic()
    while status(url) not in want:
        if any(p.poll() is not None for p in procs):
            raise SystemExit(f"a process exited while waiting for {url}")
        if time.monotonic() - start > timeout_s:
            raise SystemExit(f"{url} not ready after {timeout_s} s")
        time.sleep(0.02)
    return time.monotonic() - start


def import_runs(runs: int) -> list[tuple[float, bool, bool]]:
    out = []
    for _ in range(runs):
        line = subprocess.run([sys.executable, "-c", IMPORT], check=True, capture_output=True,
                              text=True, cwd=CWD).stdout.split()
        out.append((float(line[0]), line[1] == "True", line[2] == "True"))
    return out


def rss_and_maps(pid: int) -> tuple[int, bool, bool]:
    with open(f"/proc/{pid}/status") as f:
        rss_kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    with open(f"/proc/{pid}/maps") as f:
        maps = f.read()
    return rss_kb, "libtorch" in maps, "triton" in maps


def startup_run(model: list[str]) -> tuple[float, float, int, bool, bool]:
    control, http = free_port(), free_port()
    cli = [sys.executable, "-m", "pdserve.cli"]
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL, "cwd": CWD}
    nodes, metrics = [], []
    for role in ("prefill", "decode"):
        port = free_port()
        metrics.append(f"http://127.0.0.1:{port}/metrics")
        nodes.append(subprocess.Popen(
            [*cli, role, *model, "--compute", "none", "--router", f"tcp://127.0.0.1:{control}",
             "--metrics-port", str(port), "--threads", "1", "--log-level", "warning"],
            **quiet))
    router = None
    try:
        for url in metrics:
            wait_for(url, 180, nodes)
        t0 = time.monotonic()
        router = subprocess.Popen(
            [*cli, "router", *model, "--http-port", str(http), "--control",
             f"tcp://127.0.0.1:{control}", "--ingress", "none", "--log-level", "warning"],
            **quiet)
        health = f"http://127.0.0.1:{http}/health"
        wait_for(health, 180, [router, *nodes], want=(200, 503))
        answers = time.monotonic() - t0
        wait_for(health, 180, [router, *nodes])
        return (answers, time.monotonic() - t0, *rss_and_maps(router.pid))
    finally:
        for p in [router, *nodes]:
            if p is not None:
                p.terminate()
        for p in [router, *nodes]:
            if p is not None:
                p.wait(timeout=30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--model", help="checkpoint folder or .gguf file [default: the bundled]")
    args = ap.parse_args()
    model = ["--model", args.model] if args.model else []
    print(f"code: {os.environ.get('PYTHONPATH', '(installed)')}, model "
          f"{args.model or '(bundled)'}, load {os.getloadavg()[0]:.2f}")
    imports = import_runs(args.runs)
    secs = [s for s, _, _ in imports]
    print(f"import pdserve.router.main: median {statistics.median(secs):.3f} s, "
          f"min {min(secs):.3f}, max {max(secs):.3f}; torch loaded {imports[0][1]}, "
          f"triton loaded {imports[0][2]}")
    runs = [startup_run(model) for _ in range(args.runs)]
    first = [r[0] for r in runs]
    up = [r[1] for r in runs]
    rss = [r[2] / 1024 for r in runs]
    print(f"router start-up to its first /health answer: median "
          f"{statistics.median(first):.3f} s, min {min(first):.3f}, max {max(first):.3f}")
    print(f"router start-up to /health 200 with nodes: median {statistics.median(up):.3f} s, "
          f"min {min(up):.3f}, max {max(up):.3f}")
    print(f"router VmRSS when healthy: median {statistics.median(rss):.1f} MiB, "
          f"min {min(rss):.1f}, max {max(rss):.1f}; libtorch mapped {runs[0][3]}, "
          f"triton mapped {runs[0][4]}")
    print(f"load at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
