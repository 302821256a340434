"""Tokenization and chat templating off the router's event loop, in a bounded pool.

A 4 MiB prompt takes seconds to tokenize; on the loop it would stall every stream,
heartbeat and deadline (and a stalled router looks like a dead one to its nodes).
``run`` hands the work to a few threads; past ``max_jobs`` running or waiting, new
requests get "overloaded" (429) at once instead of queueing without bound.
"""
from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from pdserve.router import streams as S


class TokenizerPool:
    def __init__(self, threads: int, max_jobs: int):
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="tokenize")
        self.max_jobs = max_jobs
        self.num_jobs = 0

    async def run(self, fn, *args):
        if self.num_jobs >= self.max_jobs:
            raise S.RequestError(S.OVERLOADED, f"{self.num_jobs} prompts are being tokenized, "
                                 f"the limit is {self.max_jobs}: retry later")
        self.num_jobs += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)
        finally:
            self.num_jobs -= 1

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
