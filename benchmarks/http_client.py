"""What a streaming HTTP client costs: pdserve.bench's OpenAI backend (aiohttp) against
the same requests through httpx (the backend's library until 2026-12-03), side by side,
against control_plane.py's stand-in server (answers each completion at once with 8 SSE
chunks, a usage chunk and [DONE]). Prints requests/s and the client's CPU per request;
the stand-in runs in a process of its own.

    python benchmarks/http_client.py [--requests 3000] [--concurrency 128] [--rounds 2]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import resource
import statistics
import time
from datetime import datetime

from control_plane import fake_http

from pdserve.bench.backends import OpenAIBackend
from pdserve.bench.cluster import free_port, machine
from pdserve.bench.datasets import SampleRequest

TOKENS = 8


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


async def drive(one, n: int, concurrency: int) -> tuple[float, float]:
    """(requests/s, client CPU ms per request) of n calls of ``one`` at ``concurrency``."""
    todo = iter(range(n))

    async def worker():
        for _ in todo:
            await one()
    await one()  # connect, warm
    c0, t0 = cpu_s(), time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    dt, cpu = time.perf_counter() - t0, cpu_s() - c0
    return n / dt, 1000 * cpu / n


async def with_backend(url: str, n: int, concurrency: int) -> tuple[float, float]:
    backend = OpenAIBackend(url, "/v1/completions", "m", {"temperature": 0.0})
    req = SampleRequest("hello " * 30, 32, TOKENS)

    async def one():
        rec = await backend.send(req)
        if not rec.success:
            raise RuntimeError(rec.error)
    try:
        return await drive(one, n, concurrency)
    finally:
        await backend.aclose()


async def with_httpx(url: str, n: int, concurrency: int) -> tuple[float, float]:
    """The same request and the same reading of the stream, through httpx."""
    import httpx

    body = {"model": "m", "prompt": "hello " * 30, "max_tokens": TOKENS, "stream": True,
            "stream_options": {"include_usage": True}, "temperature": 0.0}
    client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=60.0),
                               limits=httpx.Limits(max_connections=None,
                                                   max_keepalive_connections=1024))

    async def one():
        async with client.stream("POST", url + "/v1/completions", json=body) as resp:
            async for line in resp.aiter_lines():
                if line.startswith("data:"):
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    json.loads(data)
    try:
        return await drive(one, n, concurrency)
    finally:
        await client.aclose()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--concurrency", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    print(f"{datetime.now():%Y-%m-%d %H:%M}; {machine()}")
    port = free_port()
    server = mp.get_context("spawn").Process(target=fake_http, args=(port, TOKENS),
                                             daemon=True)
    server.start()
    url = f"http://127.0.0.1:{port}"
    results: dict[str, list[tuple[float, float]]] = {"aiohttp (pdserve.bench)": [],
                                                     "httpx": []}
    try:
        time.sleep(2.0)  # the stand-in's start
        for r in range(args.rounds):
            for name, fn in (("aiohttp (pdserve.bench)", with_backend), ("httpx", with_httpx)):
                rate, cpu = asyncio.run(fn(url, args.requests, args.concurrency))
                results[name].append((rate, cpu))
                print(f"round {r + 1}: {name}: {rate:,.0f} req/s, {cpu:.2f} ms CPU/request")
    finally:
        server.kill()
        server.join(5)
    print(f"concurrency {args.concurrency}, {TOKENS} SSE chunks/request; medians of "
          f"{args.rounds} rounds")
    med = {k: (statistics.median(x for x, _ in v), statistics.median(c for _, c in v))
           for k, v in results.items()}
    for name, (rate, cpu) in med.items():
        print(f"{name:24s}: {rate:8,.0f} requests/s  {cpu:.2f} ms client CPU per request")
    (a_rate, a_cpu), (h_rate, h_cpu) = med.values()
    print(f"aiohttp / httpx: {a_rate / h_rate:.2f}x the requests/s, "
          f"{a_cpu / h_cpu:.2f} of the CPU per request")


if __name__ == "__main__":
    main()
