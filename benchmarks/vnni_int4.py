"""The AVX512-VNNI int4 x int8 GEMM (pdserve/kernels/native/int4_gemm.c)
against torch's ``_weight_int4pack_mm_for_cpu`` with bfloat16 activations (what
model/quant.py's Int4Linear runs below DENSE_ROWS rows), at a decode step's rows.

SmolLM2-135M's fused projections, N x K: qkv 960x576, o 576x576, gate_up 3072x576, down
576x1536; 30 layers of each, every one its own random weight (so the 66 MB stream from
memory as in a decode step), run layer after layer. Both sides hold 5 bits a weight
(4-bit values plus a 16-bit scale and zero per 32: bfloat16 for torch, float16 for the
native kernel). Both are called as lean as they go: torch's op directly (it allocates its
output), the native kernel through ctypes with pointers taken once and outputs allocated
once; activations bfloat16 [M, K], outputs bfloat16. Rounds alternate the two sides;
medians.

    python benchmarks/vnni_int4.py [--rows 1,4,16] [--rounds 7] [--layers 30]
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import time

import torch

from pdserve.kernels import native
from pdserve.kernels.native import int4_gemm as vnni_int4
from pdserve.model.quant import Int4Linear

SHAPES = (("qkv", 960, 576), ("o", 576, 576), ("gate_up", 3072, 576), ("down", 576, 1536))


def cpu_model() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    return next((line.split(":", 1)[1].strip() for line in out.splitlines()
                 if line.startswith("Model name")), "unknown")


def build(layers: int, seed: int = 0):
    """[(N, K, torch packed, torch scales_and_zeros, native kernel packed)] in a step's order."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(layers):
        for _, n, k in SHAPES:
            q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen)
            # Q4_1's d and m are float16 in the file: drawn so, zero = m + 8 d as quant.py
            d = (torch.rand(n, k // 32, generator=gen) * 0.02 + 1e-3).half().float()
            m = (-8 * d * torch.rand(n, k // 32, generator=gen)).half().float()
            lin = Int4Linear(q, d, m + 8 * d, dtype=torch.bfloat16).pack(backend="torch")
            out.append((n, k, lin.packed, lin.scales_and_zeros, vnni_int4.pack(q, d, m)))
    return out


def run_torch(layers, xs):
    mm = torch.ops.aten._weight_int4pack_mm_for_cpu
    for n, k, packed, sz, _ in layers:
        mm(xs[k], packed, 32, sz)


def run_dense(layers, xs):
    for n, k, _, _, packed in layers:
        torch.mm(xs[k], vnni_int4.weight(packed).t())


def run_vnni(calls):
    for call in calls:
        call()


def accuracy(rows: int = 16, seed: int = 1) -> None:
    """Relative error (Frobenius) against the exact float64 GEMM over the dequantized weight
    with the same bfloat16 activations: the native kernel (int8 activations) and torch's kernel
    (bfloat16 scales and zeros, bfloat16 output)."""
    gen = torch.Generator().manual_seed(seed)
    print(f"accuracy at {rows} rows, random normal activations in bfloat16:")
    print("| shape | vnni f32 out | vnni bf16 out | torch int4 bf16 |")
    print("|---|---|---|---|")
    for name, n, k in SHAPES:
        q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen)
        d = (torch.rand(n, k // 32, generator=gen) * 0.02 + 1e-3).half().float()
        m = (-8 * d * torch.rand(n, k // 32, generator=gen)).half().float()
        x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
        w = (d.repeat_interleave(32, 1).double() * q.double()
             + m.repeat_interleave(32, 1).double())
        exact = x.double() @ w.T
        lin = Int4Linear(q, d, m + 8 * d, dtype=torch.bfloat16).pack(backend="torch")
        packed = vnni_int4.pack(q, d, m)
        got = [vnni_int4.int4_mm(x, packed, n, torch.float32),
               vnni_int4.int4_mm(x, packed, n),
               torch.ops.aten._weight_int4pack_mm_for_cpu(x, lin.packed, 32,
                                                          lin.scales_and_zeros)]
        errs = [((g.double() - exact).norm() / exact.norm()).item() for g in got]
        print(f"| {name} {n}x{k} | " + " | ".join(f"{e:.2e}" for e in errs) + " |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,4,16,64,128,224,256")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--layers", type=int, default=30)
    args = ap.parse_args()
    why = native.why_unavailable()
    if why:
        raise SystemExit(f"cannot run the native kernel: {why}")
    fn = vnni_int4._mm()
    print(f"CPU: {cpu_model()}; torch {torch.__version__}, {torch.get_num_threads()} threads")
    layers = build(args.layers)
    weight_bytes = sum(n * k // 2 + n * k // 32 * 4 for n, k, *_ in layers)
    proto_bytes = sum(p.numel() for *_, p in layers)
    print(f"{args.layers} layers x {len(SHAPES)} projections: weights {weight_bytes / 1e6:.1f}"
          f" MB (torch), {proto_bytes / 1e6:.1f} MB (native kernel)")
    accuracy()
    print("dense: the weight formed in bfloat16 from the VNNI blocks, then torch.mm (a "
          "prefill's path)")
    print("| M | torch ms | vnni ms | vnni / torch | dense ms | torch GB/s | vnni GB/s |")
    print("|---|---|---|---|---|---|---|")
    for rows in (int(r) for r in args.rows.split(",")):
        xs = {k: torch.randn(rows, k).to(torch.bfloat16) for k in {k for _, _, k in SHAPES}}
        outs = [torch.empty(rows, n, dtype=torch.bfloat16) for n, *_ in layers]
        calls = [(lambda a=(xs[k].data_ptr(), 1, rows, k, n, p.data_ptr(), o.data_ptr(), 1):
                  fn(*a)) for (n, k, _, _, p), o in zip(layers, outs)]
        run_torch(layers, xs)
        run_vnni(calls)
        times = ([], [], [])
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            run_torch(layers, xs)
            t1 = time.perf_counter()
            run_vnni(calls)
            t2 = time.perf_counter()
            run_dense(layers, xs)
            t3 = time.perf_counter()
            for t, dt in zip(times, (t1 - t0, t2 - t1, t3 - t2)):
                t.append(dt)
        a, b, c = (statistics.median(t) for t in times)
        print(f"| {rows} | {a * 1e3:.2f} | {b * 1e3:.2f} | {b / a:.2f} | {c * 1e3:.2f} | "
              f"{weight_bytes / a / 1e9:.1f} | {proto_bytes / b / 1e9:.1f} |")


if __name__ == "__main__":
    main()
