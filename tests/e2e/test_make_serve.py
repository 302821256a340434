"""`make serve MODEL=... ARGS=...` serves that model, and a SIGINT sent to make's own PID
(not to its process group, as Ctrl-C does) stops make, the launcher and every node."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.cluster import alive, free_port

ROOT = Path(__file__).resolve().parents[2]


def descendants(pid: int) -> set[int]:
    out = subprocess.run(["ps", "-e", "-o", "pid=,ppid="], capture_output=True, text=True)
    children: dict[int, list[int]] = {}
    for line in out.stdout.splitlines():
        p, pp = map(int, line.split())
        children.setdefault(pp, []).append(p)
    found, todo = set(), [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            found.add(c)
            todo.append(c)
    return found


def test_make_serve_model_and_sigint_to_makes_pid(tiny_model, tmp_path):
    venv = Path(sys.prefix)
    model = tiny_model()
    http = free_port()
    args = (f"--http-port {http} --control tcp://127.0.0.1:{free_port()} "
            f"--ingress tcp://127.0.0.1:{free_port()} --threads 1")
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL")}
    # -o: the venv counts as installed (this test must never reinstall it).
    # Output to a file, not a pipe: an unread pipe that fills would stall the nodes' logging.
    log = tmp_path / "make-serve.log"
    started: set[int] = set()
    with open(log, "w") as out:
        # SIGINT at its default, as a terminal's foreground job has it: a background job
        # of a non-interactive shell (a CI script's `&`) inherits it ignored, and make
        # then ignores it too.
        make = subprocess.Popen(["make", "-s", "-o", f"{venv}/.installed", "serve",
                                 f"VENV={venv}", f"MODEL={model}", f"ARGS={args}"], cwd=ROOT,
                                env=env, stdout=out, stderr=subprocess.STDOUT, text=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT,
                                                                 signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 180
        while True:
            assert make.poll() is None, log.read_text()
            try:
                if httpx.get(f"http://127.0.0.1:{http}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "make serve not healthy in 180 s"
            time.sleep(0.3)
        models = httpx.get(f"http://127.0.0.1:{http}/v1/models", timeout=10).json()
        assert [m["id"] for m in models["data"]] == [model.name]
        started |= descendants(make.pid)
        assert len(started) >= 3  # the launcher, the router, the nodes
        os.kill(make.pid, signal.SIGINT)
        try:
            make.wait(timeout=60)
        except subprocess.TimeoutExpired:
            alive_now = [p for p in started if alive(p)]
            raise AssertionError(f"make still running 60 s after SIGINT; alive: {alive_now}; "
                                 f"output:\n{log.read_text()[-4000:]}") from None
        deadline = time.monotonic() + 10
        while any(alive(p) for p in started) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [p for p in started if alive(p)], log.read_text()
    finally:
        if make.poll() is None:
            make.kill()
        for p in started:
            if alive(p):
                os.kill(p, signal.SIGKILL)
