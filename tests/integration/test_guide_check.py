"""The router's guide checks in child processes (router/guide_check.py): a worker that
crashes or hangs during a check fails that check only, and the next one is served by a
fresh worker. Real worker processes; the crash and the hang are real signals."""
from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from pdserve.router import guide_check
from pdserve.router.guide_check import GuideChecker

GOOD = ("json", '{"type": "object", "properties": {"a": {"type": "integer"}}}')
BAD = ("regex", "(unclosed")


@pytest.fixture
def checker():
    c = GuideChecker(num_workers=1)
    yield c
    c.close()


def worker_pid(c: GuideChecker) -> int:
    worker = c._idle.queue[0]
    assert worker is not None and worker.proc.poll() is None
    return worker.proc.pid


def test_answers_as_the_library_does(checker):
    assert asyncio.run(checker.problem(*GOOD)) is None
    assert asyncio.run(checker.problem(*BAD))
    assert "MAX_GUIDE_DEPTH" in asyncio.run(checker.problem("regex", "(" * 100 + ")" * 100))


def test_a_worker_that_crashes_mid_check_fails_that_check_only(checker):
    assert asyncio.run(checker.problem(*GOOD)) is None
    pid = worker_pid(checker)
    os.kill(pid, signal.SIGSTOP)  # it takes the next check, then dies holding it

    async def crash_during_check():
        check = asyncio.create_task(checker.problem(*GOOD))
        await asyncio.sleep(0.5)
        os.kill(pid, signal.SIGSEGV)
        os.kill(pid, signal.SIGCONT)
        return await check

    problem = asyncio.run(crash_during_check())
    assert problem and "crashed" in problem, problem
    assert asyncio.run(checker.problem(*GOOD)) is None  # a fresh worker
    assert worker_pid(checker) != pid


def test_a_worker_that_hangs_is_replaced_after_the_deadline(checker, monkeypatch):
    assert asyncio.run(checker.problem(*GOOD)) is None
    pid = worker_pid(checker)
    monkeypatch.setattr(guide_check, "CHECK_DEADLINE_S", 1.0)
    os.kill(pid, signal.SIGSTOP)
    started = time.monotonic()
    problem = asyncio.run(checker.problem(*GOOD))
    assert problem and "CHECK_DEADLINE_S" in problem, problem
    assert time.monotonic() - started < 5
    assert asyncio.run(checker.problem(*GOOD)) is None
    assert worker_pid(checker) != pid


def test_the_event_loop_turns_during_a_check(checker):
    async def ticks_while_checking():
        n = 0
        check = asyncio.create_task(checker.problem(*GOOD))  # includes the worker's start
        while not check.done():
            await asyncio.sleep(0.01)
            n += 1
        return n, check.result()

    n, problem = asyncio.run(ticks_while_checking())
    assert problem is None and n > 5, n
