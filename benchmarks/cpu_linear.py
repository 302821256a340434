"""The model's linear layers through F.linear against oneDNN with reordered weights.

Every projection of every layer (fused q/k/v, o, fused gate/up, down) of the loaded
checkpoint, then the LM head, as one step runs them (F.linear is MKL's SGEMM in float32,
oneDNN without the reordered weight in bfloat16): one after the other, so the weights
come from memory as in a real step, not from the cache. Same inputs, same thread count,
the two paths alternating over rounds; medians and the ratio per row count. Rows 16 are
a decode step at batch 16, 2,048 a prefill step's token budget.

    python benchmarks/cpu_linear.py [--model DIR|FILE.gguf] [--threads 1] [--rounds 5]
        [--dtype float32|bfloat16]
"""
from __future__ import annotations

import argparse
import statistics
import time
from datetime import datetime

import torch

from pdserve.bench.cluster import machine
from pdserve.model.cpu_linear import OneDNNLinear, onednn_available, onednn_runs
from pdserve.model.default_model import default_model_dir
from pdserve.model.loader import load_model


def projections(model) -> list[torch.nn.Linear]:
    out = []
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        out += [attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj]
    return out


def timed(layers, inputs) -> float:
    t0 = time.perf_counter()
    with torch.inference_mode():
        for layer in layers:
            layer(inputs[layer.in_features])
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="checkpoint folder or .gguf file")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--rows", default="1,16,64,2048")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    a = ap.parse_args()
    if not onednn_available():
        raise SystemExit("this torch has no oneDNN: nothing to compare")
    if not onednn_runs(getattr(torch, a.dtype)):
        raise SystemExit(f"this CPU cannot reorder {a.dtype} weights for oneDNN (no AVX512 "
                         f"BW/VL/DQ or AVX-NE-CONVERT): nothing to compare")
    torch.set_num_threads(a.threads)
    model = load_model(a.model or default_model_dir(), a.dtype, "cpu")
    model.fuse_projections()
    mkl = {"layers": projections(model), "lm head": [model.lm_head]}
    dnn = {k: [OneDNNLinear(m) for m in v] for k, v in mkl.items()}
    print(f"{datetime.now():%Y-%m-%d %H:%M}; {machine()}; torch threads {a.threads}; "
          f"{len(mkl['layers'])} projections + LM head {tuple(model.lm_head.weight.shape)}, "
          f"{a.dtype}")
    print(f"{'part':>8} {'rows':>5} {'F.linear':>15} {'oneDNN':>10} {'ratio':>7}")
    sizes = {m.in_features for v in mkl.values() for m in v}
    for rows in [int(r) for r in a.rows.split(",")]:
        inputs = {n: torch.randn(rows, n, dtype=model.lm_head.weight.dtype) for n in sizes}
        for part in mkl:
            base, ours = [], []
            timed(mkl[part], inputs)  # warm-up
            timed(dnn[part], inputs)
            for _ in range(a.rounds):
                base.append(timed(mkl[part], inputs))
                ours.append(timed(dnn[part], inputs))
            b, o = statistics.median(base), statistics.median(ours)
            print(f"{part:>8} {rows:>5} {b * 1e3:12.1f} ms {o * 1e3:7.1f} ms {o / b:7.3f}")


if __name__ == "__main__":
    main()
