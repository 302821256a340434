"""Greedy output of pdserve's offline ``LLM`` against transformers' ``generate``, float32.

Both on ``--device`` (CUDA: pdserve runs its Triton kernels, transformers its
SDPA; TF32 off on both), the bundled default model unless ``--model``;
prompts of lengths that straddle block boundaries, all in one continuous
batch on pdserve's side, one by one through ``generate`` (no padding) on
transformers'. Prints the first divergence of each prompt that differs and
exits 1 if any does.

    python benchmarks/gpu_check_greedy.py [--device cuda] [--new-tokens 32]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

LENGTHS = [1, 5, 15, 16, 17, 31, 33, 48, 70, 127, 128, 129, 255, 300, 511, 700]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--model", default=None)
    ap.add_argument("--new-tokens", type=int, default=32)
    args = ap.parse_args()
    # Run from a checkout: its root instead of benchmarks/, where kernels.py would shadow
    # the `kernels` package that transformers imports when it is installed.
    here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != here]
    sys.path.insert(0, str(here.parent))
    import transformers

    from pdserve import LLM, SamplingParams
    from pdserve.model.default_model import random_model_dir

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    # The random model by default: its weights are scaled for clear greedy margins, where a
    # real model's near-ties on random-token prompts would flip on a rounding difference.
    model_dir = args.model or str(random_model_dir())
    llm = LLM(model=model_dir, device=args.device, dtype="float32")
    vocab = llm.engine.model_config.vocab_size
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in LENGTHS]
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0, ignore_eos=True)
    ours = [o.token_ids for o in llm.generate(prompts, params)]
    del llm

    hf = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="sdpa").to(args.device).eval()
    hf.generation_config.eos_token_id = None  # no early stop: compare raw argmax chains
    hf.generation_config.pad_token_id = 0
    bad = 0
    for ids, mine in zip(prompts, ours):
        x = torch.tensor([ids], device=args.device)
        with torch.no_grad():
            seq = hf.generate(x, attention_mask=torch.ones_like(x),
                              max_new_tokens=args.new_tokens, do_sample=False)
        theirs = seq[0, len(ids):].tolist()
        if mine != theirs:
            bad += 1
            at = next(i for i, (a, b) in enumerate(zip(mine + [-1], theirs + [-2])) if a != b)
            print(f"FAIL prompt of {len(ids)} tokens: first difference at output token {at}: "
                  f"pdserve {mine[at:at + 4]}, transformers {theirs[at:at + 4]}")
    print(f"greedy vs transformers on {args.device}, float32, {Path(model_dir).name}: "
          f"{len(prompts) - bad} of {len(prompts)} prompts token-exact over "
          f"{args.new_tokens} tokens")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
