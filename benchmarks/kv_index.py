"""Two routers on the same nodes: the prefill nodes' prefix-cache hit ratio when each
router's cache_aware index comes from the nodes' own KV events, against least_loaded.

`pdserve launch --routers 2 --prefill 2 --decode 1 --compute none` (the forward is
skipped: what is measured is where requests go, and the nodes' own counters of prompt
tokens looked up and found in their caches). --groups prefixes of --prefix-len tokens,
--per-group requests each with a fresh suffix, shuffled, sent alternately through the
two routers, --concurrency in flight. A request routed to a node that lacks its prefix
computes it again (a miss); one routed to the node that cached it, whichever router
sent the first, finds it.

    python benchmarks/kv_index.py [--groups 16] [--per-group 8] [--prefix-len 256]
"""
from __future__ import annotations

import argparse
import asyncio
import random
import re
import time
from datetime import datetime

import httpx
from prefix_cache import prefill_metrics  # (beside this script: run it as a script)

from pdserve.bench.cluster import launched, machine


async def workload(urls: list[str], model: str, prompts: list[list[int]],
                   concurrency: int) -> float:
    sem = asyncio.Semaphore(concurrency)

    async def one(client, url, prompt):
        async with sem:
            r = await client.post(url + "/v1/completions", json={
                "model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0})
            r.raise_for_status()

    start = time.perf_counter()
    async with httpx.AsyncClient(timeout=300) as client:
        await asyncio.gather(*(one(client, urls[i % len(urls)], p)
                               for i, p in enumerate(prompts)))
    return time.perf_counter() - start


def run(policy: str, prompts: list[list[int]], a) -> dict:
    flags = ["--routers", "2", "--prefill", "2", "--decode", "1", "--compute", "none",
             "--threads", "1", "--policy", policy]
    with launched(*flags) as c:
        c.metrics_urls(timeout_s=120)  # the ready table, which names router 1
        second = re.search(r"router 1\s+(http://\S+)/v1", c.log())
        urls = [c.http_url, second.group(1)]
        model = httpx.get(c.http_url + "/v1/models", timeout=10).json()["data"][0]["id"]
        for url in urls:  # warm-up, and both routers ready (cache_aware: the dumps are in)
            httpx.post(url + "/v1/completions", timeout=60, json={
                "model": model, "prompt": [5] * 8, "max_tokens": 1}).raise_for_status()
        before = prefill_metrics(c)
        seconds = asyncio.run(workload(urls, model, prompts, a.concurrency))
        after = prefill_metrics(c)
    hits, queries = after["hits"] - before["hits"], after["queries"] - before["queries"]
    return {"hits": hits, "queries": queries, "rps": len(prompts) / seconds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--groups", type=int, default=16)
    ap.add_argument("--per-group", type=int, default=8)
    ap.add_argument("--prefix-len", type=int, default=256)
    ap.add_argument("--concurrency", type=int, default=4)
    a = ap.parse_args()
    rng = random.Random(7)
    prefixes = [[rng.randrange(3, 1000) for _ in range(a.prefix_len)] for _ in range(a.groups)]
    prompts = [p + [rng.randrange(3, 1000) for _ in range(8)]
               for p in prefixes for _ in range(a.per_group)]
    rng.shuffle(prompts)
    results = {policy: run(policy, prompts, a) for policy in ("least_loaded", "cache_aware")}
    best = a.prefix_len // 16 * 16 * (a.per_group - 1) * a.groups  # every repeat a full hit
    print(f"{datetime.now():%Y-%m-%d %H:%M}; {machine()}")
    print(f"2 routers, 2 prefill + 1 decode, --compute none; {a.groups} prefixes of "
          f"{a.prefix_len} tokens x {a.per_group} requests (+8 tokens each), alternating "
          f"routers, {a.concurrency} in flight; at best {best} hit tokens")
    for policy, r in results.items():
        print(f"  {policy:12}: prefill hit tokens {r['hits']:.0f} of {r['queries']:.0f} "
              f"(ratio {r['hits'] / r['queries']:.3f}; {r['hits'] / best:.3f} of the best), "
              f"{r['rps']:.1f} req/s")


if __name__ == "__main__":
    main()
