"""Structured-output guides checked off the router's event loop, in child processes.

llguidance is native code: a guide it cannot handle may crash it (3,000 chained Lark rules
segfaulted the router, and ``pdserve launch`` with it) or take seconds. The size limits
(common/guides.py ``check_guide_size``) keep the known cases out; this keeps the unknown
ones from costing more than their own request: each check runs in a worker process
(``python -m pdserve.router.guide_check``, one JSON line each way) under a deadline,
from a thread, so the event loop never waits. A worker that crashes or overruns is killed
and replaced; only the request it was checking fails, with a 400 that says so.

Workers start on the first structured request: a router nobody asks for structured output
runs none.
"""
from __future__ import annotations

import asyncio
import json
import logging
import queue
import select
import subprocess
import sys

from pdserve.common.guides import check_guide_size

log = logging.getLogger(__name__)

CHECK_DEADLINE_S = 10.0   # one guide's check, well above any guide under the limits
START_DEADLINE_S = 60.0   # a worker's start: a Python and llguidance, on a busy host
NUM_WORKERS = 2           # checks at once; more wait their turn, off the event loop


class _Worker:
    """One child process that answers guide_problem for one guide at a time."""

    def __init__(self):
        self.died = False
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pdserve.router.guide_check"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        if self._line(START_DEADLINE_S) != "ready":
            self.close()
            raise RuntimeError("the guide-check worker did not start")

    def _line(self, timeout_s: float) -> str | None:
        """The worker's next line, or None if it died or said nothing in time."""
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        if not ready:
            return None
        line = self.proc.stdout.readline()
        if not line:
            self.died = True  # EOF: it exited (its exit code may not be reaped yet)
            return None
        return line.rstrip("\n")

    def check(self, kind: str, spec: str) -> tuple[bool, str | None]:
        """(answered, problem): answered False when the worker crashed or overran."""
        try:
            self.proc.stdin.write(json.dumps([kind, spec]) + "\n")
            self.proc.stdin.flush()
        except OSError:
            self.died = True
            return False, None
        line = self._line(CHECK_DEADLINE_S)
        if line is None:
            return False, None
        return True, json.loads(line)

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


class GuideChecker:
    """``await problem(kind, spec)``: why a guide cannot be served, or None."""

    def __init__(self, num_workers: int = NUM_WORKERS):
        self._idle: queue.Queue = queue.Queue()
        for _ in range(num_workers):
            self._idle.put(None)  # a slot: its worker starts when first needed

    async def problem(self, kind: str, spec: str) -> str | None:
        try:
            check_guide_size(kind, spec)  # linear and in-process: bombs never reach a worker
        except ValueError as exc:
            return str(exc)
        return await asyncio.to_thread(self._check, kind, spec)

    def _check(self, kind: str, spec: str) -> str | None:
        worker = self._idle.get()
        try:
            if worker is None or worker.proc.poll() is not None:
                worker = _Worker()  # first use, or the last one died between checks
            answered, problem = worker.check(kind, spec)
            if answered:
                return problem
            try:
                code = worker.proc.wait(5) if worker.died else worker.proc.poll()
            except subprocess.TimeoutExpired:  # closed its output but lives: a hang
                code = None
            worker.close()
            worker = None
            log.warning("a %s guide of %d bytes %s its check; the worker is replaced", kind,
                        len(spec), f"crashed (exit {code})" if code is not None
                        else f"took over {CHECK_DEADLINE_S} s")
            return (f"checking this {kind} guide crashed the grammar compiler"
                    if code is not None else
                    f"checking this {kind} guide took over {CHECK_DEADLINE_S} s "
                    f"(CHECK_DEADLINE_S)")
        finally:
            self._idle.put(worker)

    def close(self) -> None:
        while not self._idle.empty():
            worker = self._idle.get_nowait()
            if worker is not None:
                worker.close()


def _serve() -> None:
    """The worker: one ``[kind, spec]`` JSON line in, one problem (or null) line out."""
    from pdserve.common.guides import guide_problem

    guide_problem("json_object", "")  # load llguidance before saying ready
    print("ready", flush=True)
    for line in sys.stdin:
        kind, spec = json.loads(line)
        try:
            problem = guide_problem(kind, spec)
        except Exception as exc:  # noqa: BLE001 (any failure is this guide's problem)
            problem = f"the {kind} guide cannot be read: {exc}"
        print(json.dumps(problem), flush=True)


if __name__ == "__main__":
    _serve()
