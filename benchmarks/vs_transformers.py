"""Output tokens/s of pdserve against transformers' ``generate``, same model, same prompts.

Greedy, float32, ``--batch`` prompts of ``--prompt-len`` random token ids (equal
lengths, so transformers needs no padding), ``--output-len`` new tokens each
(EOS ignored on both sides). pdserve is measured two ways: the offline
``pdserve.LLM`` in this process, and through ``pdserve launch`` (1P1D, every
request at once over HTTP, the load generator in this process). transformers
runs ``model.generate`` on the whole batch with its KV cache. All use the same
torch threads; the three alternate over ``--rounds``; tokens are compared.

    python benchmarks/vs_transformers.py [--batch 16] [--output-len 64] [--no-launch]
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import time
from datetime import datetime

import torch

from pdserve import LLM, SamplingParams
from pdserve.bench import datasets, metrics, runner
from pdserve.bench.backends import OpenAIBackend
from pdserve.bench.cluster import launched, machine
from pdserve.model.default_model import default_model_dir


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="checkpoint folder (default: bundled model)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--no-launch", action="store_true", help="only the offline LLM")
    a = ap.parse_args()
    import transformers

    torch.set_num_threads(a.threads)
    model_dir = a.model or str(default_model_dir())
    tok = datasets.load_tokenizer(model_dir)
    prompts = [r.prompt for r in datasets.random_requests(tok, a.batch, a.prompt_len,
                                                          a.output_len, seed=0)]
    n_tokens = a.batch * a.output_len

    llm = LLM(model=model_dir, threads=a.threads)
    params = SamplingParams(max_tokens=a.output_len, temperature=0, ignore_eos=True)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor(prompts)  # [B, prompt_len]

    def run_pdserve():
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        return time.perf_counter() - t0, [o.token_ids for o in outs]

    def run_hf():
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                              max_new_tokens=a.output_len, min_new_tokens=a.output_len,
                              pad_token_id=hf.config.pad_token_id)
        return time.perf_counter() - t0, out[:, ids.shape[1]:].tolist()

    async def run_launch(c):
        reqs = datasets.random_requests(tok, a.batch, a.prompt_len, a.output_len, seed=0)
        backend = OpenAIBackend(c.http_url, "/v1/completions", os.path.basename(model_dir),
                                {"temperature": 0.0, "ignore_eos": True})
        records, duration = await runner.run_requests(backend, reqs, progress=False)
        await backend.aclose()
        m = metrics.compute_metrics(records, duration)
        assert m.failed == 0, [r.error for r in records if r.error][:3]
        return duration

    times = {"pdserve LLM": [], "transformers": [], "pdserve launch": []}
    launch = ["--model", model_dir, "--prefill", "1", "--decode", "1", "--threads",
              str(a.threads)]
    with launched(*launch) if not a.no_launch else contextlib.nullcontext() as c:
        run_pdserve(), run_hf()  # warm-up
        if c is not None:
            asyncio.run(run_launch(c))
        for r in range(a.rounds):
            t, ours = run_pdserve()
            times["pdserve LLM"].append(t)
            t, theirs = run_hf()
            times["transformers"].append(t)
            if c is not None:
                times["pdserve launch"].append(asyncio.run(run_launch(c)))
            print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in times.items()
                                                if v), flush=True)
    same = sum(o == t for o, t in zip(ours, theirs))
    print(f"{datetime.now():%Y-%m-%d %H:%M}; {machine()}")
    print(f"model {os.path.basename(model_dir)}, float32, greedy; {a.batch} prompts x "
          f"{a.prompt_len} tokens, {a.output_len} new tokens each; torch threads {a.threads}; "
          f"medians of {a.rounds} rounds; outputs identical to transformers: {same}/{a.batch}")
    hf_tps = n_tokens / statistics.median(times["transformers"])
    print(f"transformers generate : {hf_tps:9.1f} output tokens/s")
    for k in ("pdserve LLM", "pdserve launch"):
        if times[k]:
            tps = n_tokens / statistics.median(times[k])
            print(f"{k:<22}: {tps:9.1f} output tokens/s  ratio {tps / hf_tps:.2f}x (goal >= 2x)")


if __name__ == "__main__":
    main()
