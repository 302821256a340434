"""Time per output token through ``pdserve launch`` against the bare model forward.

16 concurrent streamed requests (255-token prompts, ``--output-len`` tokens,
ignore_eos) through the HTTP API of a 1P1D cluster on the bundled default
model; their mean TPOT (vLLM's definition) against the bare forward + LM head
+ argmax of the same model on a batch of 16 at the mean context of the run
(prompt + half the output), inputs built once beforehand (as
engine_overhead.py does). Bare rounds run in this process before, between
and after the serving rounds, while the cluster idles, with the same number
of torch threads as the decode node; each serving round is divided by the
mean of the bare rounds on either side, and the figure is the median ratio.

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
from pdserve.bench.backends import OpenAIBackend
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
    tpots, medians, itls, ratios, failed = [], [], [], [], 0
    with launched(*launch) as c:
        from pdserve.model.default_model import default_model_dir
        tok = datasets.load_tokenizer(default_model_dir())
        backend_args = (c.http_url, "/v1/completions", default_model_dir().name,
                        {"temperature": 0.0, "ignore_eos": True}, args.batch)

        async def serve(n_out: int, seed: int):
            reqs = datasets.random_requests(tok, args.batch, args.prompt_len, n_out, seed=seed)
            backend = OpenAIBackend(*backend_args)
            records, duration = await runner.run_requests(backend, reqs, progress=False)
            await backend.aclose()
            return metrics.compute_metrics(records, duration, [50, 99])

        asyncio.run(serve(8, 99))  # warm-up: imports, first prefill, connections
        for r in range(args.rounds):
            m = asyncio.run(serve(args.output_len, r))
            failed += m.failed
            tpots.append(m.stats["tpot"].mean)
            medians.append(m.stats["tpot"].median)
            itls.append(m.stats["itl"].median)
            bare_ms.append(time_bare(args.bare_steps))
            # Each round against the bare rounds just before and after it: the machine is
            # shared, and its load drifts on the scale of a round.
            ratios.append(tpots[-1] / statistics.mean(bare_ms[-2:]))
            print(f"round {r + 1}: TPOT mean {tpots[-1]:.2f} ms, median {medians[-1]:.2f} ms, "
                  f"ITL median {itls[-1]:.2f} ms; bare forward {bare_ms[-1]:.2f} ms; ratio "
                  f"{ratios[-1]:.3f}", flush=True)

    tpot, bare = statistics.median(tpots), statistics.median(bare_ms)
    print(f"{datetime.now():%Y-%m-%d %H:%M}; {machine()}")
    print(f"pdserve launch {' '.join(launch)} (bundled default model, float32); "
          f"{args.batch} concurrent streamed requests over HTTP, {args.prompt_len}-token "
          f"prompts, {args.output_len} output tokens; torch threads {args.threads}; "
          f"failed requests {failed}")
    print(f"TPOT through launch (mean) : {tpot:8.2f} ms   (median TPOT "
          f"{statistics.median(medians):.2f}, median ITL {statistics.median(itls):.2f})")
    print(f"bare forward, batch {args.batch}, ctx {context}: {bare:8.2f} ms")
    print(f"ratio launch/bare           : {statistics.median(ratios):8.3f}  (median of the "
          f"rounds' ratios; goal <= 1.10)")


if __name__ == "__main__":
    main()
