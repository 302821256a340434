"""SmolLM2-135M's projections as stored (Q4_1) against float32, through torch's CPU kernels.

Per layer the model's fused projections (q/k/v 960x576, o 576x576, gate/up 3072x576, down
576x1536), built from the default GGUF file's Q4_1 blocks, one layer after the other as a
step runs them (so the weights stream from memory), and the LM head (49152x576, tied to
the Q8_0 embedding). Paths, in one run, alternating over rounds, medians:

    f32 F.linear   the dequantized float32 weight through F.linear (MKL)
    f32 oneDNN     the same weight reordered once for oneDNN (cpu_linear "auto" today)
    bf16 F.linear  the weight in bfloat16 (AVX2: no oneDNN reorder)
    int4 f32       _weight_int4pack_mm_for_cpu, float32 activations, the file's blocks
                   (exact: every weight is the reference dequantization's, tested)
    int4 bf16 kernel  the same kernel in bfloat16 (scales rounded to bfloat16: not exact)
    int4 bf16      pdserve's int4 layer in bfloat16: that kernel below DENSE_ROWS rows,
                   from there the weight formed in bfloat16 and a dense GEMM (quant.py)
    int8 f32/bf16  _weight_int8pack_mm, one scale per output row, requantized from the
                   float32 weight (NOT exact for Q4_1 or Q8_0: per-row scales)

Rows 1 is a batch-1 decode step, 16 a batch-16 one, 256 a prefill piece. Large row counts
run over ``--big-layers`` layers and are scaled to 30 (the int4 kernel is slow there).

    python benchmarks/quant_linear.py [--threads 1,2] [--rows 1,16,256] [--rounds 5]
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time
from datetime import datetime

import torch
import torch.nn.functional as F

from pdserve.bench.cluster import machine
from pdserve.model import gguf
from pdserve.model.cpu_linear import OneDNNLinear
from pdserve.model.default_model import default_model_dir
from pdserve.model.quant import Int4Linear

PROJ = (("attn_q", "attn_k", "attn_v"), ("attn_output",), ("ffn_gate", "ffn_up"),
        ("ffn_down",))


class Dense(torch.nn.Module):
    def __init__(self, w):
        super().__init__()
        self.w, self.in_features = w, w.shape[1]

    def forward(self, x):
        return F.linear(x, self.w)


class Int8(torch.nn.Module):
    """Per-row symmetric int8 of a float32 weight."""

    def __init__(self, w, dtype):
        super().__init__()
        scale = w.abs().amax(1).clamp_min(1e-12) / 127
        self.q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
        self.scale, self.in_features = scale.to(dtype), w.shape[1]

    def forward(self, x):
        return torch.ops.aten._weight_int8pack_mm(x, self.q, self.scale)


def build(layers: int):
    """{path: ([projection modules], lm head module)} and the activation dtype of each."""
    r = gguf.reader(default_model_dir())
    by_name = {t.name: t for t in r.tensors}
    q4, q4_bf, dense = [], [], []
    for i in range(layers):
        for group in PROJ:
            parts = [Int4Linear.from_gguf(by_name[f"blk.{i}.{n}.weight"].data, "Q4_1")
                     for n in group]
            lin = Int4Linear.cat(parts)
            dense.append(lin.dequantized())
            q4_bf.append(Int4Linear(lin.q, lin.scale, lin.zero, dtype=torch.bfloat16).pack())
            q4.append(lin.pack())
    t = by_name["token_embd.weight"]
    head = torch.from_numpy(gguf._gguf_module().quants.dequantize(t.data, t.tensor_type))
    bf = torch.bfloat16
    paths = {
        "f32 F.linear": ([Dense(w) for w in dense], Dense(head), torch.float32),
        "f32 oneDNN": ([_onednn(w) for w in dense], _onednn(head), torch.float32),
        "bf16 F.linear": ([Dense(w.to(bf)) for w in dense], Dense(head.to(bf)), bf),
        "int4 f32": (q4, _int4_head(head, torch.float32), torch.float32),
        "int4 bf16 kernel": ([_kernel_only(m) for m in q4_bf], _int4_head(head, bf), bf),
        "int4 bf16": (q4_bf, _int4_head(head, bf), bf),
        "int8 f32": ([Int8(w, torch.float32) for w in dense], Int8(head, torch.float32),
                     torch.float32),
        "int8 bf16": ([Int8(w, bf) for w in dense], Int8(head, bf), bf),
    }
    return paths, sum(w.numel() for w in dense), head.numel()


def _onednn(w):
    lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
    lin.weight = torch.nn.Parameter(w, requires_grad=False)
    return OneDNNLinear(lin)


def _int4_head(w, dtype):
    """The head requantized to Q4_0-style groups (NOT exact: only its speed matters)."""
    g = w.reshape(w.shape[0], -1, 32)
    d = g.abs().amax(-1).clamp_min(1e-12) / 8                           # [N, G]
    q = (torch.round(g / d[..., None]).clamp(-8, 7) + 8).to(torch.uint8).reshape(w.shape)
    return Int4Linear(q, d, torch.zeros_like(d), dtype=dtype).pack()


def _kernel_only(m: Int4Linear) -> Int4Linear:
    """The layer with torch's int4 kernel at every row count."""
    out = copy.copy(m)
    out.dense_rows = None
    return out


def timed(mods, rows, dtype) -> float:
    inputs = {m.in_features: torch.randn(rows, m.in_features, dtype=dtype) for m in mods}
    t0 = time.perf_counter()
    with torch.inference_mode():
        for m in mods:
            m(inputs[m.in_features])
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rows", default="1,16,256")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--big-layers", type=int, default=1)
    ap.add_argument("--paths", default=None, help="comma-separated subset")
    a = ap.parse_args()
    paths, layer_weights, head_weights = build(30)
    if a.paths:
        paths = {k: v for k, v in paths.items() if k in a.paths.split(",")}
    print(f"{datetime.now():%Y-%m-%d %H:%M}; {machine()}; torch {torch.__version__}, "
          f"{torch.backends.cpu.get_cpu_capability()}; 30 layers x 4 fused projections "
          f"({layer_weights / 1e6:.1f} M weights), LM head {head_weights / 1e6:.1f} M")
    print(f"{'threads':>7} {'rows':>5} {'part':>8} " + " ".join(f"{k:>13}" for k in paths)
          + "   (ms; ratio to f32 oneDNN)")
    for threads in [int(t) for t in a.threads.split(",")]:
        torch.set_num_threads(threads)
        for rows in [int(r) for r in a.rows.split(",")]:
            layers = 30 if rows <= 16 else a.big_layers
            for part in ("layers", "lm head"):
                times = {}
                for name, (mods, head, dtype) in paths.items():
                    sel = mods[:4 * layers] if part == "layers" else [head]
                    timed(sel, rows, dtype)  # warm-up
                    times[name] = sel
                med = {}
                samples = {k: [] for k in times}
                for _ in range(a.rounds):
                    for name, sel in times.items():
                        samples[name].append(timed(sel, rows, paths[name][2]))
                for name, s in samples.items():
                    med[name] = statistics.median(s) * (30 / layers if part == "layers" else 1)
                ref = med.get("f32 oneDNN") or next(iter(med.values()))
                print(f"{threads:>7} {rows:>5} {part:>8} "
                      + " ".join(f"{med[k] * 1e3:7.2f} {med[k] / ref:5.2f}" for k in med),
                      flush=True)


if __name__ == "__main__":
    main()
