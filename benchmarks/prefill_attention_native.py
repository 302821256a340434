"""One layer's causal prefill attention in bfloat16 on the CPU: the native AVX512-BF16 kernel
(pdserve/kernels/native/prefill_attention.c, P rounded to bfloat16 for P.V, and with P kept
in float32) against torch's SDPA as kernels.prefill_attention called it before (one
``is_causal`` call per sequence, ``enable_gqa``), side by side in one process.

SmolLM2-135M's attention: 9 query heads, 3 KV heads, head_dim 64; q, k and v are views of
one fused qkv projection (token stride 960, as the model passes them). One sequence of S
tokens; rounds alternate the three sides; medians. Error: the largest and the mean absolute
difference from SDPA in float32 on the same bfloat16 inputs (its own error is ~4e-7).

    python benchmarks/prefill_attention_native.py [--lens 256,1024,2048] [--rounds 9]
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import time

import torch
import torch.nn.functional as F

from pdserve.kernels import native
from pdserve.kernels.native import prefill_attention as native_prefill

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64


def cpu_model() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    return next((line.split(":", 1)[1].strip() for line in out.splitlines()
                 if line.startswith("Model name")), "unknown")


def fused(seq_len: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(seq_len, (HEADS + 2 * KV_HEADS) * HEAD_DIM, generator=gen).bfloat16()
    q, k, v = qkv.split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=-1)
    return (q.view(seq_len, HEADS, HEAD_DIM), k.view(seq_len, KV_HEADS, HEAD_DIM),
            v.view(seq_len, KV_HEADS, HEAD_DIM))


def sdpa(q, k, v, scale):
    # [S, H, D] -> [1, H, S, D] strided, as attention_prefill's torch path hands it over
    o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                       v.transpose(0, 1)[None], scale=scale, is_causal=True,
                                       enable_gqa=True)
    return o[0].transpose(0, 1)  # [S, H, D]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lens", default="256,1024,2048")
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    if native.why_unavailable() is not None:
        raise SystemExit(f"native kernels unavailable: {native.why_unavailable()}")
    scale = HEAD_DIM ** -0.5
    print(f"{cpu_model()}, {torch.get_num_threads()} threads, torch {torch.__version__}; "
          f"H={HEADS} KVH={KV_HEADS} D={HEAD_DIM}, {args.rounds} rounds, medians")
    print("| S | SDPA ms | native ms | native P f32 ms | SDPA / native | "
          "max err SDPA / native / P f32 | mean err SDPA / native / P f32 |")
    print("|---|---|---|---|---|---|---|")
    for seq_len in map(int, args.lens.split(",")):
        q, k, v = fused(seq_len, seq_len)
        cu = torch.tensor([0, seq_len])
        sides = {
            "sdpa": lambda: sdpa(q, k, v, scale),
            "native": lambda: native_prefill.prefill_attention(q, k, v, cu, scale),
            "native_f32": lambda: native_prefill.prefill_attention(q, k, v, cu, scale,
                                                                    p_bf16=False),
        }
        ref = sdpa(q.float(), k.float(), v.float(), scale)
        errs = {}
        for name, fn in sides.items():
            diff = (fn().float() - ref).abs()
            errs[name] = (diff.max().item(), diff.mean().item())
        times = {name: [] for name in sides}
        for _ in range(args.rounds):
            for name, fn in sides.items():
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
        ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
        print(f"| {seq_len} | {ms['sdpa']:.2f} | {ms['native']:.2f} | {ms['native_f32']:.2f} | "
              f"{ms['sdpa'] / ms['native']:.2f} | "
              + " / ".join(f"{errs[n][0]:.2e}" for n in sides) + " | "
              + " / ".join(f"{errs[n][1]:.2e}" for n in sides) + " |")


if __name__ == "__main__":
    main()
