"""How far greedy output departs from the dequantized float32 reference, per way of holding
the default model's weights.

The reference is pdserve in float32 with ``--quantization none``, token for token
transformers' output on the same GGUF file (tests/e2e/test_smollm2.py). Each other
configuration generates greedily from the same chat prompts (those of test_smollm2.py);
per prompt: the first position where its tokens differ from the reference's (or "=" when
all are equal), and the texts where they differ.

    python benchmarks/quant_greedy.py [--max-tokens 64] [--threads 2]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

from pdserve import LLM, SamplingParams

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests.chat_prompts import CONVERSATIONS  # noqa: E402 (the checkout's tests/)

CONFIGS = [("float32", "none"), ("bfloat16", "none"), ("bfloat16", "auto")]


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first position where a and b differ (a length counts), None when equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    params = SamplingParams(max_tokens=a.max_tokens, temperature=0)
    outputs = {}
    for dtype, quant in CONFIGS:
        llm = LLM(dtype=dtype, quantization=quant, threads=a.threads)
        prompts = [llm.tokenizer.encode(llm.tokenizer.apply_chat_template(m),
                                        add_special_tokens=False) for m in CONVERSATIONS]
        outputs[dtype, quant] = [(o.token_ids, o.text) for o in llm.generate(prompts, params)]
        del llm
    ref = outputs[CONFIGS[0]]
    print(f"greedy, {a.max_tokens} new tokens at most, {len(CONVERSATIONS)} chat prompts; "
          f"first differing position against float32 --quantization none "
          f"(transformers' tokens); '=': all equal")
    for (dtype, quant), outs in outputs.items():
        firsts = [first_difference(o[0], r[0]) for o, r in zip(outs, ref)]
        shown = " ".join("=" if f is None else str(f) for f in firsts)
        print(f"{dtype:>9} --quantization {quant:<5} {shown}   "
              f"(lengths {' '.join(str(len(o[0])) for o in outs)})")
    for (dtype, quant), outs in list(outputs.items())[1:]:
        for i, (o, r) in enumerate(zip(outs, ref)):
            if o[0] != r[0]:
                print(f"\n[{dtype} {quant}, prompt {i}]\n  ref:  {r[1]!r}\n  ours: {o[1]!r}")


if __name__ == "__main__":
    main()
