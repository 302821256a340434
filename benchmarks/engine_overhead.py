"""Decode step time through the engine against the bare model forward, same batch
(and, with ``--transformers``, against transformers' own decode step).

The engine's step = schedule + build inputs + forward + sample + detokenize +
stop checks. The bare forward = the model's forward and LM head on the inputs
of the engine's next step, built beforehand (each round, so both attend over
the same context). Both run on the same 16 sequences (255-token prompts),
interleaved round by round so machine noise hits both alike. ``--transformers`` adds
a third: transformers' model on the same checkpoint and prompts, stepping with its own
KV cache (greedy, its forward and argmax), as many steps per round, so that its
context grows with the engine's.

    python benchmarks/engine_overhead.py [--model DIR|FILE.gguf] [--rounds 10] [--steps 8]
        [--transformers] [--no-decode-windows] [--cpu-linear auto|onednn|torch]
"""
from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

from pdserve.bench.reference import DecodeStepper, transformers_model
from pdserve.common.sampling import SamplingParams
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import Engine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None,
                    help="checkpoint folder or .gguf file (default: the bundled model)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=255)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--steps", type=int, default=8, help="decode steps per round")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--no-decode-windows", action="store_true",
                    help="gather the context from the KV pages in every decode step "
                         "(--decode-window-memory-gb 0)")
    ap.add_argument("--cpu-linear", default="auto", choices=("auto", "onednn", "torch"),
                    help="the engine's CPU linear layers (EngineConfig.cpu_linear)")
    ap.add_argument("--transformers", action="store_true",
                    help="also time transformers' decode step on the same prompts")
    args = ap.parse_args()

    engine = Engine(EngineConfig(model=args.model, dtype=args.dtype, threads=args.threads,
                                 decode_window_memory_gb=0 if args.no_decode_windows else None,
                                 cpu_linear=args.cpu_linear))
    vocab = engine.model_config.vocab_size
    gen = torch.Generator().manual_seed(0)
    total_steps = args.rounds * args.steps + 4
    params = SamplingParams(max_tokens=total_steps + 8, temperature=0, ignore_eos=True)
    prompts = torch.randint(3, vocab, (args.batch, args.prompt_len), generator=gen)
    for i, prompt in enumerate(prompts.tolist()):
        engine.add_request(str(i), prompt, params)
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running) \
            or engine.scheduler.waiting:
        engine.step()  # prefill (in chunks) until every sequence decodes
    engine.step()
    hf = None
    if args.transformers:
        hf = DecodeStepper(transformers_model(engine.model_dir), prompts)
        hf.step()  # the engine's context: the prompts and one decoded token

    def bare_inputs():
        """Inputs of the engine's next decode step, built outside the timing: the bare
        forward attends over the same context the engine's steps of this round do."""
        batch = engine.scheduler.schedule()
        assert len(batch) == args.batch and set(batch.num_new_tokens) == {1}
        inputs = engine.runner.prepare(batch)
        engine.scheduler.postprocess(batch, [0] * len(batch))  # keep the engine consistent
        return inputs

    engine_ms, bare_ms, hf_ms = [], [], []
    with torch.inference_mode():
        for _ in range(args.rounds):
            inputs = bare_inputs()
            if hf is not None:
                hf.step()  # bare_inputs advanced the engine's context by one token
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    hf.step()
                hf_ms.append((time.perf_counter() - t0) / args.steps * 1e3)
            t0 = time.perf_counter()
            for _ in range(args.steps):
                engine.runner.forward(inputs).argmax(-1)
            bare_ms.append((time.perf_counter() - t0) / args.steps * 1e3)
            t0 = time.perf_counter()
            for _ in range(args.steps):
                engine.step()
            engine_ms.append((time.perf_counter() - t0) / args.steps * 1e3)

    cfg = engine.model_config
    e, b = statistics.median(engine_ms), statistics.median(bare_ms)
    print(f"model: {engine.model_dir.name} ({cfg.num_hidden_layers} layers, hidden "
          f"{cfg.hidden_size}, {args.dtype}); batch {args.batch} x {args.prompt_len}-token "
          f"prompts; torch threads {torch.get_num_threads()}; {platform.processor() or 'cpu'}; "
          f"decode attention {engine.runner.describe_decode_attention()}; "
          f"linear layers {engine.runner.linear}")
    print(f"engine decode step : {e:8.3f} ms (median of {args.rounds} rounds x {args.steps})")
    print(f"bare model forward : {b:8.3f} ms")
    print(f"ratio engine/bare  : {e / b:8.3f}  (goal < 1.10)")
    if hf_ms:
        h = statistics.median(hf_ms)
        print(f"transformers step  : {h:8.3f} ms (its KV cache, same prompts and context)")
        print(f"ratio engine/transformers: {e / h:.3f}  (goal <= 1.0)")


if __name__ == "__main__":
    main()
