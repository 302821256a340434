"""n choices of one prompt share its prefill, through `pdserve launch` (1P1D).

Each round, side by side on one cluster: (a) one /v1/completions request with n=8 of a
fresh random --prompt-len prompt, and (b) eight concurrent requests of eight different
fresh prompts of the same length, each max_tokens=--max-tokens. Both make 8 sequences of
the same lengths; (a) prefills the prompt once (the siblings wait for its blocks and take
them from the prefix cache), (b) must prefill eight prompts. Wall time per round
(medians) and the prefill node's prefix-cache hits.

    python benchmarks/n_choices.py [--rounds 5] [--prompt-len 1000] [--max-tokens 4]
"""
from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
import time
from datetime import datetime
from pathlib import Path

import httpx

from pdserve.bench.cluster import launched, machine
from pdserve.model.make_model import make_model

N = 8


async def one_round(client: httpx.AsyncClient, model: str, prompts: list[list[int]],
                    n: int, max_tokens: int) -> float:
    body = {"model": model, "max_tokens": max_tokens, "temperature": 1.0, "seed": 1,
            "ignore_eos": True}
    start = time.perf_counter()
    rs = await asyncio.gather(*(client.post("/v1/completions",
                                            json={**body, "prompt": p, "n": n})
                                for p in prompts))
    elapsed = time.perf_counter() - start
    for r in rs:
        r.raise_for_status()
        assert len(r.json()["choices"]) == n
    return elapsed


def hits(cluster) -> float:
    import re

    url = re.search(r"(http://\S+/metrics)\s+\(prefill-0\)", cluster.log()).group(1)
    text = httpx.get(url, timeout=10).text
    return sum(float(v) for v in re.findall(
        r"^pdserve_prefix_cache_hits_tokens_total{[^}]*} (\S+)$", text, re.M))


async def run(a, url: str, model: str, cluster) -> dict:
    rng = random.Random(7)

    def fresh():
        return [rng.randrange(3, 1000) for _ in range(a.prompt_len)]

    shared, separate, hit = [], [], {"shared": 0.0, "separate": 0.0}
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        await one_round(client, model, [fresh()], 1, 1)  # warm-up
        for _ in range(a.rounds):
            before = hits(cluster)
            shared.append(await one_round(client, model, [fresh()], N, a.max_tokens))
            middle = hits(cluster)
            separate.append(await one_round(client, model, [fresh() for _ in range(N)], 1,
                                            a.max_tokens))
            hit["shared"] += middle - before
            hit["separate"] += hits(cluster) - middle
    return {"shared": statistics.median(shared), "separate": statistics.median(separate),
            **{f"hits_{k}": v / a.rounds for k, v in hit.items()}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--prompt-len", type=int, default=1000)
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args()
    model_dir = make_model(Path(tempfile.mkdtemp()) / "small", preset="small", seed=0)
    with launched("--model", str(model_dir), "--prefill", "1", "--decode", "1",
                  "--threads", str(a.threads)) as c:
        r = asyncio.run(run(a, c.http_url, model_dir.name, c))
    print(f"{datetime.now():%Y-%m-%d %H:%M} {machine()}")
    print(f"n={N} of one {a.prompt_len}-token prompt: {r['shared'] * 1e3:.0f} ms "
          f"(prefix-cache hits {r['hits_shared']:.0f} tokens)")
    print(f"{N} prompts of {a.prompt_len} tokens:       {r['separate'] * 1e3:.0f} ms "
          f"(prefix-cache hits {r['hits_separate']:.0f} tokens)")
    print(f"ratio separate / shared: {r['separate'] / r['shared']:.2f}")


if __name__ == "__main__":
    main()
