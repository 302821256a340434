"""The decode node's step against the in-process engine's step: same batch, context, threads.

A 1P1D ``pdserve launch`` (1 torch thread per node) on the bundled default
model serves ``--batch`` requests (random ``--prompt-len``-token prompts,
``--output-len`` tokens, greedy, ignore_eos) over the queue ingress. Once
every request has its ``--skip``-th token the benchmark reads the decode
node's ``pdserve_decode_step_seconds`` and ``pdserve_decode_batch_size``
from its /metrics, and again before the first request is ``--skip`` tokens
from its end: the difference is the node's mean step over that window, and
the batch-size sums prove every step in it ran the whole batch.

The same prompts then run through an in-process ``Engine`` in this
process (same thread count) while the cluster idles: its whole
``Engine.step`` (schedule, forward, sampling, detokenization, stop checks)
is timed for the steps whose context lies in the node's window. The node
runs the same ``Engine.step`` without detokenizing (text is the router's);
its metric times it from the scheduled batch to the outputs: a subset. Rounds
alternate node, engine; the figure is the median of the rounds' ratios.

    python benchmarks/overhead.py [--rounds 5] [--batch 16] [--threads 1]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from datetime import datetime

import torch

from pdserve.bench.cluster import launched, machine, metric_totals
from pdserve.client import AsyncQueueClient, Done
from pdserve.common.sampling import SamplingParams
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import Engine

SAMPLING = {"temperature": 0.0, "ignore_eos": True}


STEP_SAMPLES = ("pdserve_decode_step_seconds_sum", "pdserve_decode_step_seconds_count",
                "pdserve_decode_batch_size_sum")


def scrape(url: str) -> dict[str, float]:
    """The decode step histogram's sum and count and the batch-size histogram's sum."""
    return metric_totals(url, STEP_SAMPLES)


async def node_round(ingress: str, url: str, prompts: list[list[int]], output_len: int,
                     skip: int) -> tuple[float, int, tuple[int, int]]:
    """(mean step ms, steps, (first, last) context) over the window where all decode."""
    counts = [0] * len(prompts)
    marks: dict[str, dict] = {}
    ctx = {}
    loop = asyncio.get_running_loop()

    async def mark(name: str) -> None:
        if name not in marks:
            marks[name] = {}  # claimed before the await: scraped once
            ctx[name] = (min(counts), max(counts))
            marks[name] = await loop.run_in_executor(None, scrape, url)

    async with AsyncQueueClient(ingress) as client:
        async def one(i: int) -> None:
            rid = await client.submit(prompt_token_ids=prompts[i], max_tokens=output_len,
                                      **SAMPLING)
            async for ev in client.stream(rid, timeout_s=600):
                if isinstance(ev, Done):
                    return
                counts[i] += len(ev.token_ids)
                if min(counts) >= skip:
                    await mark("start")
                if counts[i] >= output_len - skip and marks.get("start"):
                    await mark("end")
        await asyncio.gather(*(one(i) for i in range(len(prompts))))
    if not marks.get("end"):
        raise RuntimeError("no window with every request decoding: raise --output-len")
    a, b = marks["start"], marks["end"]
    steps = int(b["pdserve_decode_step_seconds_count"] - a["pdserve_decode_step_seconds_count"])
    seqs = b["pdserve_decode_batch_size_sum"] - a["pdserve_decode_batch_size_sum"]
    if steps <= 0 or seqs != steps * len(prompts):
        raise RuntimeError(f"the window held {steps} steps with {seqs} sequences, not all "
                           f"{len(prompts)} in each: raise --output-len")
    ms = (b["pdserve_decode_step_seconds_sum"] - a["pdserve_decode_step_seconds_sum"]) \
        / steps * 1e3
    plen = len(prompts[0])
    return ms, steps, (plen + ctx["start"][0], plen + ctx["end"][1])


def engine_round(engine: Engine, prompts: list[list[int]], output_len: int,
                 context: tuple[int, int]) -> tuple[float, int]:
    """(median step ms, steps) of the in-process engine over the same context range."""
    params = SamplingParams(max_tokens=output_len, **SAMPLING)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{time.monotonic_ns()}-{i}", p, params)
    times = []
    while engine.has_unfinished():
        running = engine.scheduler.running
        batch_ok = len(running) == len(prompts) and not engine.scheduler.waiting and all(
            s.num_computed_tokens == s.num_tokens - 1 for s in running)
        ctx = min(s.num_tokens for s in running) if running else 0
        t0 = time.perf_counter()
        engine.step()
        if batch_ok and context[0] <= ctx <= context[1]:
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), len(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=255)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--skip", type=int, default=8,
                    help="tokens left out at each end of the node's window")
    ap.add_argument("--threads", type=int, default=1, help="torch threads, node and engine")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--node-arg", action="append", default=[],
                    help="extra flag for the nodes (pdserve launch --node-arg)")
    ap.add_argument("--no-malloc-tuning", action="store_true",
                    help="PDSERVE_MALLOC_TUNING=0 for the nodes and this process: glibc's "
                         "defaults, to measure what the tuning does")
    args = ap.parse_args()
    if args.no_malloc_tuning:
        os.environ["PDSERVE_MALLOC_TUNING"] = "0"  # inherited by pdserve launch's nodes

    engine = Engine(EngineConfig(model=None, threads=args.threads))
    vocab = engine.model_config.vocab_size
    gen = torch.Generator().manual_seed(0)
    launch = ["--prefill", "1", "--decode", "1", "--threads", str(args.threads),
              *[f"--node-arg={a}" for a in args.node_arg]]
    rows = []
    with launched(*launch) as c:
        url = c.metrics_urls()["decode-0"]
        warm = [torch.randint(3, vocab, (args.prompt_len,), generator=gen).tolist()
                for _ in range(args.batch)]
        try:  # warm-up: first prefill, connections, allocator
            asyncio.run(node_round(c.ingress, url, warm, args.output_len, args.skip))
        except RuntimeError as exc:
            print(f"warm-up: {exc}")
        engine_round(engine, warm, args.output_len, (0, 1 << 30))
        for r in range(args.rounds):
            prompts = [torch.randint(3, vocab, (args.prompt_len,), generator=gen).tolist()
                       for _ in range(args.batch)]
            node_ms, node_steps, ctx = asyncio.run(
                node_round(c.ingress, url, prompts, args.output_len, args.skip))
            eng_ms, eng_steps = engine_round(engine, prompts, args.output_len, ctx)
            rows.append((node_ms, eng_ms, node_ms / eng_ms))
            print(f"round {r + 1}: context {ctx[0]}-{ctx[1]}: decode node {node_ms:.2f} ms "
                  f"(mean of {node_steps} steps), in-process engine {eng_ms:.2f} ms (median "
                  f"of {eng_steps}), ratio {rows[-1][2]:.3f}", flush=True)
    print(f"{datetime.now():%Y-%m-%d %H:%M}; {machine()}")
    print(f"pdserve launch {' '.join(launch)} (bundled default model, float32); batch "
          f"{args.batch}, {args.prompt_len}-token prompts, {args.output_len} output tokens; "
          f"torch threads {args.threads}; medians of {args.rounds} rounds; malloc tuning "
          f"{'off' if args.no_malloc_tuning else 'on'}")
    print(f"decode node step     : {statistics.median(r[0] for r in rows):8.2f} ms")
    print(f"in-process engine step: {statistics.median(r[1] for r in rows):8.2f} ms")
    print(f"ratio node/engine    : {statistics.median(r[2] for r in rows):8.3f}  (rounds "
          f"{min(r[2] for r in rows):.3f}-{max(r[2] for r in rows):.3f}; goal <= 1.10)")


if __name__ == "__main__":
    main()
