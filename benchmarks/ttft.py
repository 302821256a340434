"""Time to first token through ``pdserve launch`` against the bare prefill of the same prompts.

A 1P1D ``pdserve launch`` (1 torch thread per node) on the bundled default
model; ``N`` prompts of ``--prompt-len`` random tokens sent at once over the
queue ingress (each wants 4 tokens, greedy); TTFT = submit to the first token
at the client. The bare side runs in this process, same thread count, while
the cluster idles: the model forward + LM head + argmax of the same prompts
through an in-process ``Engine``'s scheduler (the same chunked-prefill
budget the prefill node has), all added at once, each prompt's first token
timed from the start. For N = 1 that is one bare prefill forward. Rounds
alternate cluster, bare; medians of the rounds; the ratio compares mean TTFTs.

    python benchmarks/ttft.py [--concurrency 1 8 32] [--rounds 3]
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from datetime import datetime

import torch

from pdserve.bench.cluster import launched, machine
from pdserve.client import AsyncQueueClient
from pdserve.common.sampling import SamplingParams
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.engine.sequence import Sequence

SAMPLING = {"temperature": 0.0, "ignore_eos": True}


async def client_ttfts(ingress: str, prompts: list[list[int]]) -> list[float]:
    """Seconds from submit to first token, per prompt, all submitted at once."""
    async with AsyncQueueClient(ingress) as client:
        async def one(p: list[int]) -> float:
            t0 = time.perf_counter()
            rid = await client.submit(prompt_token_ids=p, max_tokens=4, **SAMPLING)
            first = None
            async for ev in client.stream(rid, timeout_s=600):
                if first is None and getattr(ev, "token_ids", None):
                    first = time.perf_counter() - t0
            return first
        return list(await asyncio.gather(*(one(p) for p in prompts)))


def bare_ttfts(engine: Engine, prompts: list[list[int]]) -> list[float]:
    """Seconds from the start to each prompt's first token, prefilled in this process."""
    runner, sched = engine.runner, engine.scheduler
    params = SamplingParams(max_tokens=1, **SAMPLING)
    seqs = [Sequence(f"b{time.monotonic_ns()}-{i}", p, params) for i, p in enumerate(prompts)]
    done: dict[str, float] = {}
    t0 = time.perf_counter()
    for s in seqs:
        sched.add(s)
    while len(done) < len(seqs):
        batch = sched.schedule()
        inputs = runner.prepare(batch)
        logits = runner.forward(inputs)
        tokens = logits.argmax(-1).tolist()
        now = time.perf_counter() - t0
        sampled = [None] * len(batch)
        for row, tok in zip(inputs.sample_rows, tokens):
            sampled[row] = tok
            done[batch.seqs[row].seq_id] = now
        sched.postprocess(batch, sampled)
        for s, tok in zip(batch.seqs, sampled):
            if tok is not None:
                sched.finish(s, "length")
    return [done[s.seq_id] for s in seqs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()

    engine = Engine(EngineConfig(model=None, threads=args.threads))
    vocab = engine.model_config.vocab_size
    gen = torch.Generator().manual_seed(0)

    def prompts(n: int) -> list[list[int]]:
        return [torch.randint(3, vocab, (args.prompt_len,), generator=gen).tolist()
                for _ in range(n)]

    launch = ["--prefill", "1", "--decode", "1", "--threads", str(args.threads)]
    results = {}
    with launched(*launch) as c, torch.inference_mode():
        asyncio.run(client_ttfts(c.ingress, prompts(2)))  # warm-up both sides
        bare_ttfts(engine, prompts(2))
        for n in args.concurrency:
            served, bare, ratios = [], [], []
            for r in range(args.rounds):
                ps = prompts(n)
                served.append(statistics.mean(asyncio.run(client_ttfts(c.ingress, ps))))
                bare.append(statistics.mean(bare_ttfts(engine, ps)))
                ratios.append(served[-1] / bare[-1])
                print(f"{n} prompts, round {r + 1}: mean TTFT {served[-1] * 1e3:.1f} ms, bare "
                      f"{bare[-1] * 1e3:.1f} ms, ratio {ratios[-1]:.3f}", flush=True)
            results[n] = (statistics.median(served), statistics.median(bare),
                          statistics.median(ratios), min(ratios), max(ratios))
    print(f"{datetime.now():%Y-%m-%d %H:%M}; {machine()}")
    print(f"pdserve launch {' '.join(launch)} (bundled default model, float32); "
          f"{args.prompt_len}-token prompts sent at once over the ingress; torch threads "
          f"{args.threads}; medians of {args.rounds} rounds")
    print("concurrent | mean TTFT (client) | bare prefill, same prompts | ratio (rounds)")
    for n, (s, b, r, lo, hi) in results.items():
        print(f"{n:10d} | {s * 1e3:15.1f} ms | {b * 1e3:23.1f} ms | {r:.3f} ({lo:.3f}-{hi:.3f})")


if __name__ == "__main__":
    main()
