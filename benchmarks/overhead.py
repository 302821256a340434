"""Time per output token through ``pdserve launch`` against the bare model forward.

16 concurrent streamed requests (255-token prompts, ``--output-len`` tokens,
ignore_eos) through a 1P1D cluster on the bundled default model. The figure
is the time per output token while all 16 decode at once: the window from
the last request's second token to the first request's last token, measured
over the queue ingress, whose messages carry exact token counts (HTTP chunks
may merge tokens). It is compared with the bare forward + LM head + argmax
of the same model on a batch of 16 at the run's mean context (prompt + half
the output), inputs built once beforehand (as engine_overhead.py does). The
HTTP TPOT (vLLM's definition, over each whole request, so also over steps
with fewer requests) is printed beside it. Bare rounds run in this process
before, between and after the serving rounds, while the cluster idles, with
the decode node's torch threads; each round is divided by the mean of the
bare rounds on either side, and the figure is the median ratio.

    python benchmarks/overhead.py [--threads 1] [--output-len 96] [--rounds 3]
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from datetime import datetime

import torch

from pdserve.bench import datasets, metrics, runner
from pdserve.bench.backends import IngressBackend, OpenAIBackend
from pdserve.bench.cluster import launched, machine
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams


def bare_forward(batch: int, context: int, threads: int):
    """A function timing ``steps`` bare forwards (ms each) on ``batch`` sequences that have
    ``context`` tokens in the cache."""
    engine = LLMEngine(EngineConfig(model=None, threads=threads))
    vocab = engine.model_config.vocab_size
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(str(i), torch.randint(3, vocab, (context,), generator=gen).tolist(),
                           params)
    while engine.scheduler.waiting or any(
            s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running):
        engine.step()
    step = engine.scheduler.schedule()
    assert len(step) == batch and set(step.num_new_tokens) == {1}
    inputs = engine.runner.prepare(step)

    def time_it(steps: int) -> float:
        with torch.inference_mode():
            engine.runner.forward(inputs).argmax(-1)
            t0 = time.perf_counter()
            for _ in range(steps):
                engine.runner.forward(inputs).argmax(-1)
        return (time.perf_counter() - t0) / steps * 1e3
    return time_it


def steady_ms_per_token(records) -> tuple[float, int] | None:
    """Time per output token while every request is decoding (the window from the last
    request's second token to the first request's last one), from exact per-message token
    counts: (ms, fewest tokens a request made in the window); None if there is no window."""
    t0 = max(r.chunk_times[1] for r in records)
    t1 = min(r.chunk_times[-1] for r in records)
    if t1 <= t0:
        return None  # the router dispatched one request ahead, and it finished first
    per = []
    for r in records:
        inside = [(t, n) for t, n in zip(r.chunk_times, r.chunk_tokens) if t0 <= t <= t1]
        tokens = sum(n for _, n in inside[1:])
        if tokens:
            per.append(((inside[-1][0] - inside[0][0]) / tokens, tokens))
    if not per:
        return None
    return statistics.mean(p for p, _ in per) * 1e3, min(n for _, n in per)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=255)
    ap.add_argument("--output-len", type=int, default=96)
    ap.add_argument("--threads", type=int, default=1, help="torch threads, per node and bare")
    ap.add_argument("--rounds", type=int, default=3, help="serving rounds")
    ap.add_argument("--bare-steps", type=int, default=24)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    context = args.prompt_len + args.output_len // 2
    time_bare = bare_forward(args.batch, context, args.threads)
    bare_ms = [time_bare(args.bare_steps)]
    launch = ["--prefill", "1", "--decode", "1", "--threads", str(args.threads)]
    steady, tpots, windows, ratios, failed = [], [], [], [], 0
    with launched(*launch) as c:
        from pdserve.model.default_model import default_model_dir
        from pdserve.model.loader import model_name
        tok = datasets.load_tokenizer(default_model_dir())
        sampling = {"temperature": 0.0, "ignore_eos": True}

        async def serve(backend, n_out: int, seed: int):
            reqs = datasets.random_requests(tok, args.batch, args.prompt_len, n_out, seed=seed)
            records, duration = await runner.run_requests(backend, reqs, progress=False)
            await backend.aclose()
            return records, metrics.compute_metrics(records, duration, [50, 99])

        def http():
            return OpenAIBackend(c.http_url, "/v1/completions", model_name(default_model_dir()),
                                 sampling, args.batch)

        asyncio.run(serve(http(), 8, 99))  # warm-up: imports, first prefill, connections
        asyncio.run(serve(IngressBackend(c.ingress, sampling), 8, 98))
        for r in range(args.rounds):
            _, m = asyncio.run(serve(http(), args.output_len, r))
            for attempt in range(3):
                records, mi = asyncio.run(serve(IngressBackend(c.ingress, sampling),
                                                args.output_len, 10 * r + attempt))
                failed += mi.failed
                if steady_ms_per_token(records) is not None:
                    break
                print("  (no moment with every request decoding: one ran ahead; again)")
            else:
                raise SystemExit("never had every request decoding at once: raise --output-len")
            failed += m.failed
            tpots.append(m.stats["tpot"].mean)
            ms, window = steady_ms_per_token(records)
            steady.append(ms)
            windows.append(window)
            bare_ms.append(time_bare(args.bare_steps))
            # Each round against the bare rounds just before and after it: the machine is
            # shared, and its load drifts on the scale of a round.
            ratios.append(ms / statistics.mean(bare_ms[-2:]))
            print(f"round {r + 1}: HTTP TPOT mean {tpots[-1]:.2f} ms; ingress, all "
                  f"{args.batch} decoding: {ms:.2f} ms/token ({window} tokens each); bare "
                  f"forward {bare_ms[-1]:.2f} ms; ratio {ratios[-1]:.3f}", flush=True)

    bare = statistics.median(bare_ms)
    print(f"{datetime.now():%Y-%m-%d %H:%M}; {machine()}")
    print(f"pdserve launch {' '.join(launch)} (bundled default model, float32); "
          f"{args.batch} concurrent streamed requests, {args.prompt_len}-token prompts, "
          f"{args.output_len} output tokens; torch threads {args.threads}; medians of "
          f"{args.rounds} rounds; failed requests {failed}")
    print(f"through launch, all {args.batch} decoding : {statistics.median(steady):8.2f} "
          f"ms/token (ingress; >= {min(windows)} tokens per request in the window)")
    print(f"through launch, HTTP TPOT mean    : {statistics.median(tpots):8.2f} ms "
          f"(includes steps with fewer than {args.batch} requests)")
    print(f"bare forward, batch {args.batch}, ctx {context} : {bare:8.2f} ms")
    print(f"ratio launch/bare                 : {statistics.median(ratios):8.3f}  (median of "
          f"the rounds' ratios; goal <= 1.10)")


if __name__ == "__main__":
    main()
