"""Inter-token latency of streaming requests while long prompts arrive: 1P1D vs colocated.

The same cores serve both setups: ``pdserve launch`` with one prefill and one
decode node (``--threads`` each), then ``pdserve launch --colocated`` (one node
that prefills and decodes with one engine, ``2 x --threads``). In each, short
requests stream (``--short-concurrency`` in flight, short prompts, long
outputs) while long prompts arrive as a Poisson stream; the figure is the
p99 inter-token latency of the short requests. A colocated engine must stop
decoding while it prefills a long prompt (chunked to its token budget); a
decode node never prefills. Setups alternate over ``--rounds``.

    python benchmarks/disagg_vs_colocated.py [--rounds 2] [--long-len 1536]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
from datetime import datetime

from pdserve.bench import datasets, metrics, runner
from pdserve.bench.backends import OpenAIBackend
from pdserve.bench.cluster import launched, machine


async def mixed(c, tok, model: str, a, seed: int):
    """Short streams and long prompts at once; returns (short metrics, long metrics)."""
    sampling = {"temperature": 0.0, "ignore_eos": True}
    short = datasets.random_requests(tok, a.short_requests, a.short_len, a.short_output,
                                     seed=seed)
    long = datasets.random_requests(tok, a.long_requests, a.long_len, a.long_output,
                                    seed=seed + 1000)
    b_short = OpenAIBackend(c.http_url, "/v1/completions", model, sampling)
    b_long = OpenAIBackend(c.http_url, "/v1/completions", model, sampling)

    async def longs():
        await asyncio.sleep(a.long_delay)  # let the short streams reach steady decoding
        return await runner.run_requests(b_long, long, a.long_rate, seed=seed, progress=False)

    (rs, ds), (rl, dl) = await asyncio.gather(
        runner.run_requests(b_short, short, max_concurrency=a.short_concurrency,
                            progress=False), longs())
    await b_short.aclose()
    await b_long.aclose()
    return metrics.compute_metrics(rs, ds, [50, 99]), metrics.compute_metrics(rl, dl, [50, 99])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) // 2),
                    help="torch threads per node of 1P1D (the colocated node gets twice)")
    ap.add_argument("--short-requests", type=int, default=24)
    ap.add_argument("--short-concurrency", type=int, default=8)
    ap.add_argument("--short-len", type=int, default=32)
    ap.add_argument("--short-output", type=int, default=96)
    ap.add_argument("--long-requests", type=int, default=6)
    ap.add_argument("--long-len", type=int, default=1536)
    ap.add_argument("--long-output", type=int, default=4)
    ap.add_argument("--long-rate", type=float, default=1.0, help="long prompts per second")
    ap.add_argument("--long-delay", type=float, default=0.5, help="s before the first long")
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()

    setups = {"1P1D": ["--prefill", "1", "--decode", "1", "--threads", str(a.threads)],
              "colocated": ["--colocated", "--threads", str(2 * a.threads)]}
    from pdserve.model.default_model import default_model_dir
    from pdserve.model.loader import model_name
    tok = datasets.load_tokenizer(default_model_dir())
    model = model_name(default_model_dir())
    res: dict[str, list] = {k: [] for k in setups}
    for r in range(a.rounds):
        for name, flags in setups.items():
            with launched(*flags) as c:
                asyncio.run(mixed(c, tok, model, argparse.Namespace(
                    **{**vars(a), "short_requests": 4, "long_requests": 1, "short_output": 8}),
                    seed=99))  # warm-up
                ms, ml = asyncio.run(mixed(c, tok, model, a, seed=r))
            res[name].append((ms, ml))
            print(f"round {r + 1} {name:9}: short p99 ITL {ms.stats['itl'].percentiles[1][1]:8.1f}"
                  f" ms, median ITL {ms.stats['itl'].median:6.1f} ms, failed "
                  f"{ms.failed + ml.failed}; long TTFT median {ml.stats['ttft'].median:7.1f} ms",
                  flush=True)

    def med(name, f):
        return statistics.median(f(ms, ml) for ms, ml in res[name])
    print(f"{datetime.now():%Y-%m-%d %H:%M}; {machine()}")
    print(f"bundled default model; short: {a.short_requests} requests, {a.short_concurrency} "
          f"in flight, {a.short_len}-token prompts, {a.short_output} output tokens; long: "
          f"{a.long_requests} x {a.long_len}-token prompts at {a.long_rate}/s (Poisson), "
          f"{a.long_output} output tokens; medians of {a.rounds} rounds")
    p99 = {}
    for name, flags in setups.items():
        p99[name] = med(name, lambda s, _: s.stats["itl"].percentiles[1][1])
        print(f"{name:9} (pdserve launch {' '.join(flags)}): short ITL p99 {p99[name]:8.1f} ms,"
              f" median {med(name, lambda s, _: s.stats['itl'].median):6.1f} ms, TPOT mean "
              f"{med(name, lambda s, _: s.stats['tpot'].mean):6.1f} ms; long TTFT median "
              f"{med(name, lambda _, lg: lg.stats['ttft'].median):7.1f} ms")
    print(f"ratio p99 ITL 1P1D/colocated: {p99['1P1D'] / p99['colocated']:.3f}  (goal <= 0.5)")


if __name__ == "__main__":
    main()
