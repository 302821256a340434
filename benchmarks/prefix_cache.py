"""Prefix caching through `pdserve launch`: time to first token of a prompt whose
400-token prefix an earlier request computed, against a cold prompt of the same
length, with caching on and off; then `--policy cache_aware` against `least_loaded`
on two prefill nodes with several shared prefixes.

Part 1 (1P1D): each round sends a prompt with a fresh random prefix (cold) and then
one with the same prefix and another suffix (warm), one at a time, max_tokens=1 (the
reply comes at the first token: what is timed is the prefill). The same rounds run
on a cluster started with --no-enable-prefix-caching.

Part 2 (2P1D): --groups prefixes, --per-group requests each, shuffled, --concurrency
in flight; TTFT, requests/s and the prefill nodes' hit ratio, per policy.

Part 3 (1P1D, chat): --conversations chats in parallel, --turns turns each, over
/v1/chat/completions: every turn sends the whole conversation so far (a system
prompt, the earlier questions and the model's answers) plus a new question; TTFT of
the later turns with caching on and off.

    python benchmarks/prefix_cache.py [--rounds 8] [--prefix-len 400]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import statistics
import tempfile
import time
from datetime import datetime

import httpx

from pdserve.bench.cluster import launched, machine
from pdserve.model.make_model import make_model


def prefill_metrics(cluster) -> dict[str, float]:
    """Summed over the prefill nodes: hit and queried tokens, KV bytes sent."""
    log = cluster.log()
    totals = {"hits": 0.0, "queries": 0.0, "kv_bytes": 0.0}
    names = {"hits": "pdserve_prefix_cache_hits_tokens_total",
             "queries": "pdserve_prefix_cache_queries_tokens_total",
             "kv_bytes": "pdserve_kv_transfer_bytes_total"}
    for url in re.findall(r"(http://\S+/metrics)\s+\(prefill-\d+\)", log):
        text = httpx.get(url, timeout=10).text
        for key, name in names.items():
            totals[key] += sum(float(m) for m in re.findall(rf"^{name}{{[^}}]*}} (\S+)$",
                                                            text, re.M))
    return totals


def timed(client: httpx.Client, model: str, prompt: list[int], max_tokens: int = 1) -> float:
    start = time.perf_counter()
    r = client.post("/v1/completions", json={"model": model, "prompt": prompt,
                                             "max_tokens": max_tokens, "temperature": 0,
                                             "ignore_eos": True})
    r.raise_for_status()
    return time.perf_counter() - start


def cold_vs_warm(model_dir, a, caching: bool) -> dict:
    flags = ["--model", str(model_dir), "--prefill", "1", "--decode", "1", "--threads", "1"]
    if not caching:
        flags.append("--no-enable-prefix-caching")
    rng = random.Random(1)
    cold, warm = [], []
    with launched(*flags) as c, httpx.Client(base_url=c.http_url, timeout=120) as client:
        timed(client, model_dir.name, [5] * 40)  # warm-up
        for _ in range(a.rounds):
            prefix = [rng.randrange(3, 1000) for _ in range(a.prefix_len)]
            cold.append(timed(client, model_dir.name, prefix + [11, 12, 13, 14]))
            warm.append(timed(client, model_dir.name, prefix + [21, 22, 23, 24]))
        m = prefill_metrics(c)
    return {"cold": statistics.median(cold), "warm": statistics.median(warm), **m}


async def grouped_workload(url: str, model: str, prompts: list[list[int]],
                           concurrency: int) -> tuple[list[float], float]:
    sem = asyncio.Semaphore(concurrency)
    ttfts: list[float] = []

    async def one(client, prompt):
        async with sem:
            start = time.perf_counter()
            r = await client.post("/v1/completions", json={
                "model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0})
            r.raise_for_status()
            ttfts.append(time.perf_counter() - start)

    start = time.perf_counter()
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        await asyncio.gather(*(one(client, p) for p in prompts))
    return ttfts, time.perf_counter() - start


def policies(model_dir, a) -> dict[str, dict]:
    rng = random.Random(2)
    prefixes = [[rng.randrange(3, 1000) for _ in range(a.prefix_len)] for _ in range(a.groups)]
    prompts = [p + [rng.randrange(3, 1000) for _ in range(8)]
               for p in prefixes for _ in range(a.per_group)]
    rng.shuffle(prompts)
    out = {}
    for policy in ("least_loaded", "cache_aware"):
        flags = ["--model", str(model_dir), "--prefill", "2", "--decode", "1", "--threads", "1",
                 "--policy", policy]
        with launched(*flags) as c:
            httpx.post(f"{c.http_url}/v1/completions", timeout=60, json={
                "model": model_dir.name, "prompt": [5] * 40, "max_tokens": 1})  # warm-up
            ttfts, seconds = asyncio.run(grouped_workload(c.http_url, model_dir.name, prompts,
                                                          a.concurrency))
            m = prefill_metrics(c)
        out[policy] = {"ttft_mean": statistics.mean(ttfts),
                       "ttft_median": statistics.median(ttfts),
                       "rps": len(prompts) / seconds, **m}
    return out


def corpus_sentences() -> list[str]:
    from importlib.resources import files

    text = files("pdserve.model").joinpath("data/corpus.txt").read_text()
    return [s.strip() + "." for s in text.replace("\n", " ").split(".") if len(s.strip()) > 20]


async def conversation(client: httpx.AsyncClient, model: str, system: str, questions: list[str],
                       answer_tokens: int) -> list[float]:
    """One chat, turn after turn; the TTFT of each turn (streamed, first content chunk)."""
    messages = [{"role": "system", "content": system}]
    ttfts = []
    for q in questions:
        messages.append({"role": "user", "content": q})
        start, first, answer = time.perf_counter(), None, []
        async with client.stream("POST", "/v1/chat/completions", json={
                "model": model, "messages": messages, "max_tokens": answer_tokens,
                "temperature": 0, "stream": True}) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                delta = json.loads(line[6:])["choices"][0]["delta"].get("content")
                if delta:
                    first = first or time.perf_counter()
                    answer.append(delta)
        ttfts.append((first or time.perf_counter()) - start)
        messages.append({"role": "assistant", "content": "".join(answer)})
    return ttfts


def multi_turn(model_dir, a, caching: bool) -> dict:
    rng = random.Random(3)
    sentences = corpus_sentences()
    system = " ".join(rng.sample(sentences, 12))
    chats = [[" ".join(rng.sample(sentences, 2)) for _ in range(a.turns)]
             for _ in range(a.conversations)]
    flags = ["--model", str(model_dir), "--prefill", "1", "--decode", "1", "--threads", "1"]
    if not caching:
        flags.append("--no-enable-prefix-caching")

    async def go(url):
        async with httpx.AsyncClient(base_url=url, timeout=300) as client:
            return await asyncio.gather(*(conversation(client, model_dir.name, system, q,
                                                       a.answer_tokens) for q in chats))
    with launched(*flags) as c:
        per_chat = asyncio.run(go(c.http_url))
        m = prefill_metrics(c)
    first = [t[0] for t in per_chat]
    later = [x for t in per_chat for x in t[1:]]
    return {"first": statistics.median(first), "later": statistics.median(later), **m}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--prefix-len", type=int, default=400)
    ap.add_argument("--groups", type=int, default=6)
    ap.add_argument("--per-group", type=int, default=6)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--conversations", type=int, default=4)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--answer-tokens", type=int, default=24)
    ap.add_argument("--preset", default="small", choices=("tiny", "small"))
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_model(f"{tmp}/llama-{a.preset}", arch="llama", preset=a.preset)
        on = cold_vs_warm(model_dir, a, caching=True)
        off = cold_vs_warm(model_dir, a, caching=False)
        pol = policies(model_dir, a)
        chat = {on_off: multi_turn(model_dir, a, caching=on_off) for on_off in (True, False)}
    print(f"{datetime.now():%Y-%m-%d %H:%M}; {machine()}")
    print(f"random llama preset {a.preset}, float32, --threads 1 per node; prompts of "
          f"{a.prefix_len} + 4 tokens, max_tokens 1; medians of {a.rounds} rounds")
    for name, r in (("caching on ", on), ("caching off", off)):
        print(f"1P1D {name}: cold TTFT {r['cold'] * 1e3:7.1f} ms, warm {r['warm'] * 1e3:7.1f} ms,"
              f" warm/cold {r['warm'] / r['cold']:.3f}; prefill hit tokens {r['hits']:.0f} of "
              f"{r['queries']:.0f}; KV bytes shipped {r['kv_bytes']:.0f}")
    print(f"goal: warm/cold <= 0.5 with caching on -> {on['warm'] / on['cold']:.3f}")
    print(f"2P1D, {a.groups} prefixes x {a.per_group} requests, {a.concurrency} in flight:")
    for policy, r in pol.items():
        ratio = r["hits"] / r["queries"] if r["queries"] else 0.0
        print(f"  {policy:12}: TTFT mean {r['ttft_mean'] * 1e3:7.1f} ms, median "
              f"{r['ttft_median'] * 1e3:7.1f} ms, {r['rps']:6.2f} req/s, hit ratio {ratio:.3f}")
    ll, ca = pol["least_loaded"], pol["cache_aware"]
    print(f"cache_aware / least_loaded: TTFT mean {ca['ttft_mean'] / ll['ttft_mean']:.3f}, "
          f"req/s {ca['rps'] / ll['rps']:.3f}")
    print(f"1P1D chat, {a.conversations} conversations x {a.turns} turns, {a.answer_tokens}-token "
          f"answers, medians:")
    for on_off, r in chat.items():
        ratio = r["hits"] / r["queries"] if r["queries"] else 0.0
        print(f"  caching {'on ' if on_off else 'off'}: first turn TTFT {r['first'] * 1e3:7.1f} ms,"
              f" later turns {r['later'] * 1e3:7.1f} ms; hit ratio {ratio:.3f}; KV bytes shipped "
              f"{r['kv_bytes']:.0f}")
    print(f"later-turn TTFT, caching on / off: {chat[True]['later'] / chat[False]['later']:.3f}")


if __name__ == "__main__":
    main()
