"""The load generator: requests leave on a schedule, at most ``max_concurrency`` at once.

Arrivals as vLLM makes them: all at t=0 for an infinite rate; otherwise gaps
drawn from a gamma distribution of shape ``burstiness`` (1 = Poisson) and
mean ``1/rate``, then scaled so the last request leaves at ``n/rate`` exactly
(the same total span whatever the seed). A request waiting for a free slot
leaves when one frees, later than its arrival.

Conversations (the multi-turn workload) take the same schedule: each arrival
sends the next turn of a conversation that is ready for one (every conversation
at the start; one whose last turn has finished later), in the order they became
ready; with no conversation ready, the arrival waits for one. So turns of one
conversation go in order, each after the answer to the one before.
"""
from __future__ import annotations

import asyncio
import math
import sys
import time

import numpy as np

from pdserve.bench.datasets import SampleRequest
from pdserve.bench.metrics import RequestRecord
from pdserve.bench.multi_turn import Conversation


def arrival_times(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Seconds after the start at which each of ``n`` requests is due."""
    if burstiness <= 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    if math.isinf(rate):
        return [0.0] * n
    if math.isinf(burstiness):
        gaps = np.full(n, 1.0 / rate)
    else:
        gaps = np.random.default_rng(seed).gamma(burstiness, 1.0 / (rate * burstiness), size=n)
    times = np.cumsum(gaps)
    if times[-1] > 0:
        times *= (n / rate) / times[-1]
    return times.tolist()


class Progress:
    """One line on stderr, rewritten at most 10 times a second: done/total, elapsed, eta."""

    def __init__(self, total: int, enabled: bool = True, stream=None):
        self.total, self.done, self.enabled = total, 0, enabled
        self.stream = stream or sys.stderr
        self.t0 = time.perf_counter()
        self._shown = 0.0

    def update(self, n: int = 1) -> None:
        self.done += n
        now = time.perf_counter()
        if self.enabled and (now - self._shown >= 0.1 or self.done == self.total):
            self._shown = now
            elapsed = now - self.t0
            eta = elapsed / self.done * (self.total - self.done) if self.done else 0.0
            width = 30
            fill = int(width * self.done / max(1, self.total))
            self.stream.write(f"\r{100 * self.done // max(1, self.total):3d}%|"
                              f"{'#' * fill}{' ' * (width - fill)}| {self.done}/{self.total} "
                              f"[{elapsed:6.1f}s<{eta:6.1f}s]")
            self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\n")
            self.stream.flush()


async def run_requests(backend, requests: list[SampleRequest], request_rate: float = math.inf,
                       burstiness: float = 1.0, max_concurrency: int | None = None,
                       seed: int = 0, progress: bool = True
                       ) -> tuple[list[RequestRecord], float]:
    """Sends every request; returns the records (times relative to the start, in request
    order) and the benchmark's duration in seconds."""
    due = arrival_times(len(requests), request_rate, burstiness, seed)
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = Progress(len(requests), progress)

    async def one(req: SampleRequest) -> RequestRecord:
        if slots is None:
            rec = await backend.send(req)
        else:
            async with slots:
                rec = await backend.send(req)
        bar.update()
        return rec

    t0 = time.perf_counter()
    tasks = []
    for req, at in zip(requests, due):
        wait = t0 + at - time.perf_counter()
        if wait > 0:
            await asyncio.sleep(wait)
        tasks.append(asyncio.create_task(one(req)))
    records = await asyncio.gather(*tasks)
    duration = time.perf_counter() - t0
    bar.close()
    return _relative(list(records), t0), duration


def _relative(records: list[RequestRecord], t0: float) -> list[RequestRecord]:
    for rec in records:  # relative times: nothing else in a result depends on the clock
        rec.start -= t0
        rec.end -= t0
        rec.chunk_times = [t - t0 for t in rec.chunk_times]
    return records


async def run_conversations(backend, convs: list[Conversation], encode,
                            request_rate: float = math.inf, burstiness: float = 1.0,
                            max_concurrency: int | None = None, seed: int = 0,
                            progress: bool = True
                            ) -> tuple[list[RequestRecord], list[tuple[int, int]], float]:
    """Sends every turn of every conversation, each turn after the answer to the one
    before (``encode(text)``: an answer's ids, for the next prompt). Returns the records
    in conversation order (its turns in order), the (conversation, turn) of each, and the
    duration in seconds."""
    n = sum(len(c.users) for c in convs)
    due = arrival_times(n, request_rate, burstiness, seed)
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    ready: asyncio.Queue[Conversation] = asyncio.Queue()
    for c in convs:
        ready.put_nowait(c)
    records: dict[tuple[int, int], RequestRecord] = {}
    bar = Progress(n, progress)

    async def turn(conv: Conversation) -> None:
        req = conv.next_request()
        if slots is None:
            rec = await backend.send(req)
        else:
            async with slots:
                rec = await backend.send(req)
        records[conv.index, conv.turn] = rec
        conv.add_answer(req, rec.generated_text, rec.output_ids, encode)
        bar.update()
        if not conv.done:
            ready.put_nowait(conv)

    t0 = time.perf_counter()
    tasks = []
    for at in due:
        wait = t0 + at - time.perf_counter()
        if wait > 0:
            await asyncio.sleep(wait)
        tasks.append(asyncio.create_task(turn(await ready.get())))
    await asyncio.gather(*tasks)
    duration = time.perf_counter() - t0
    bar.close()
    keys = sorted(records)
    return _relative([records[k] for k in keys], t0), keys, duration
