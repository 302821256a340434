"""Output tokens/s of pdserve against transformers' ``generate``, same model, same prompts.

Greedy, float32, random token-id prompts, EOS ignored on both sides, same torch
threads. pdserve is measured two ways: the offline ``pdserve.LLM`` in this
process, and through ``pdserve launch`` (1P1D with launch's default threads,
every core to each node, shared; every request at once over HTTP, the load generator in
this process). transformers runs ``generate`` on
the whole batch with its KV cache. Two workloads:

- equal: ``--batch`` prompts of ``--prompt-len`` tokens, ``--output-len`` new
  tokens each: transformers' best case (no padding); tokens are compared.
- mixed: ``--mixed-batch`` prompts of 32..512 tokens wanting 16..128 tokens
  each, as requests come: transformers left-pads the batch and generates the
  longest output for all; only the tokens asked for count, on both sides.

The three alternate over ``--rounds``; figures are medians. Each round has fresh
prompts of the same lengths, so that no round is served from pdserve's prefix cache.

    python benchmarks/vs_transformers.py [--model DIR|FILE.gguf] [--rounds 3] [--no-launch]
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import time
from datetime import datetime

import numpy as np
import torch

from pdserve import LLM, SamplingParams
from pdserve.bench import datasets, metrics, runner
from pdserve.bench.backends import OpenAIBackend
from pdserve.bench.cluster import launched, machine
from pdserve.bench.reference import transformers_model
from pdserve.model.default_model import default_model_dir
from pdserve.model.loader import model_name

# Issue 13's goals, as ratios to transformers' tokens/s.
GOALS = {("equal", "pdserve LLM"): 1.1, ("equal", "pdserve launch"): 1.0,
         ("mixed", "pdserve launch"): 2.0}


def workload(tok, n: int, in_lens, out_lens, seed: int) -> list[datasets.SampleRequest]:
    base = datasets.random_requests(tok, n, max(in_lens), 1, seed=seed)
    return [datasets.SampleRequest(r.prompt[:i], i, o)
            for r, i, o in zip(base, in_lens, out_lens)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None,
                    help="checkpoint folder or .gguf file (default: the bundled model)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--mixed-batch", type=int, default=32)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-launch", action="store_true", help="only the offline LLM")
    a = ap.parse_args()

    torch.set_num_threads(a.threads)
    model_dir = a.model or str(default_model_dir())
    tok = datasets.load_tokenizer(model_dir)
    rng = np.random.default_rng(0)
    lengths = {"equal": ([a.prompt_len] * a.batch, [a.output_len] * a.batch),
               "mixed": (rng.integers(32, 513, a.mixed_batch).tolist(),
                         rng.integers(16, 129, a.mixed_batch).tolist())}

    def loads_of(seed: int) -> dict[str, list[datasets.SampleRequest]]:
        """The workloads with fresh token ids (same lengths): pdserve's prefix cache must
        not serve a round from an earlier one, since transformers keeps nothing."""
        return {w: workload(tok, len(ins), ins, outs, 2 * seed + i)
                for i, (w, (ins, outs)) in enumerate(lengths.items())}
    loads = loads_of(0)

    llm = LLM(model=model_dir, dtype="float32", threads=a.threads)  # transformers' dtype
    hf = transformers_model(model_dir)
    pad = hf.config.pad_token_id if hf.config.pad_token_id is not None else 0

    def run_pdserve(reqs):
        params = [SamplingParams(max_tokens=r.output_len, temperature=0, ignore_eos=True)
                  for r in reqs]
        t0 = time.perf_counter()
        outs = llm.generate([r.prompt for r in reqs], params)
        return time.perf_counter() - t0, [o.token_ids for o in outs]

    def run_hf(reqs):
        width, new = max(r.prompt_len for r in reqs), max(r.output_len for r in reqs)
        ids = torch.full((len(reqs), width), pad)          # [B, width], padded on the left
        mask = torch.zeros_like(ids)
        for i, r in enumerate(reqs):
            ids[i, width - r.prompt_len:] = torch.tensor(r.prompt)
            mask[i, width - r.prompt_len:] = 1
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = hf.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=new,
                              min_new_tokens=new, pad_token_id=pad)
        return time.perf_counter() - t0, [row[width:width + r.output_len].tolist()
                                          for row, r in zip(out, reqs)]

    async def run_launch(c, reqs):
        backend = OpenAIBackend(c.http_url, "/v1/completions", model_name(model_dir),
                                {"temperature": 0.0, "ignore_eos": True})
        records, duration = await runner.run_requests(backend, reqs, progress=False)
        await backend.aclose()
        m = metrics.compute_metrics(records, duration)
        assert m.failed == 0, [r.error for r in records if r.error][:3]
        return duration, None

    times = {(w, k): [] for w in loads for k in ("pdserve LLM", "transformers",
                                                 "pdserve launch")}
    same = 0
    # launch's own default threads: every core to each node, idle threads sleeping.
    launch = ["--model", model_dir, "--prefill", "1", "--decode", "1"]
    with launched(*launch) if not a.no_launch else contextlib.nullcontext() as c:
        small = loads_of(a.rounds)["equal"][:2]
        run_pdserve(small), run_hf(small)  # warm-up
        if c is not None:
            asyncio.run(run_launch(c, small))
        for r in range(a.rounds):
            for w, reqs in loads_of(r).items():
                t, ours = run_pdserve(reqs)
                times[w, "pdserve LLM"].append(t)
                t, theirs = run_hf(reqs)
                times[w, "transformers"].append(t)
                if w == "equal":
                    same += sum(o == t for o, t in zip(ours, theirs))
                if c is not None:
                    times[w, "pdserve launch"].append(asyncio.run(run_launch(c, reqs))[0])
                print(f"round {r + 1} {w}: " + ", ".join(
                    f"{k} {v[-1]:.2f} s" for (w2, k), v in times.items() if w2 == w and v),
                    flush=True)

    print(f"{datetime.now():%Y-%m-%d %H:%M}; {machine()}")
    print(f"model {os.path.basename(model_dir)}, float32, greedy, torch threads {a.threads}; "
          f"medians of {a.rounds} rounds")
    for w, reqs in loads.items():
        n_tokens = sum(r.output_len for r in reqs)
        desc = (f"{a.batch} prompts x {a.prompt_len} tokens, {a.output_len} new each; outputs "
                f"identical to transformers: {same}/{a.batch * a.rounds}") if w == "equal" else \
            (f"{len(reqs)} prompts of {min(r.prompt_len for r in reqs)}.."
             f"{max(r.prompt_len for r in reqs)} tokens, {min(r.output_len for r in reqs)}.."
             f"{max(r.output_len for r in reqs)} new each ({n_tokens} in all)")
        print(f"[{w}] {desc}")
        hf_tps = n_tokens / statistics.median(times[w, "transformers"])
        print(f"  transformers generate : {hf_tps:9.1f} output tokens/s")
        for k in ("pdserve LLM", "pdserve launch"):
            if times[w, k]:
                tps = n_tokens / statistics.median(times[w, k])
                goal = f" (goal >= {GOALS[w, k]}x)" if (w, k) in GOALS else ""
                print(f"  {k:<22}: {tps:9.1f} output tokens/s  ratio {tps / hf_tps:.2f}x{goal}")


if __name__ == "__main__":
    main()
