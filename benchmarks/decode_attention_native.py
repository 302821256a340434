"""Decode attention per layer, bfloat16 KV cache, SmolLM2's heads (9 query, 3 kv, head_dim
64): the native kernel over the pages (kernels/native/decode_attention.c, storing the new
K/V in the same call) against the path it replaces (store_kv, then the new token appended
to a float32 decode window and float32 SDPA over it, rounded to bfloat16).

Each pass runs one decode step's attention over ``--layers`` layers, each with its own
cache and window (a step's working set, not one layer's left in the caches); the
today's-path pass builds the step's ``decode_gather`` once, as the model does. Rounds
alternate the two paths; the figures are medians over rounds of the per-layer mean.

    python benchmarks/decode_attention_native.py [--shapes 1x256,16x320,8x1100]
        [--layers 30] [--rounds 7] [--threads 2]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from datetime import datetime, timezone

import torch

from pdserve.kernels import (
    DecodeWindow,
    WindowFill,
    decode_gather,
    paged_decode_attention,
    store_kv,
)

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16


def setup(batch: int, length: int, layers: int, gen: torch.Generator):
    """Per layer: scattered bf16 pages holding ``length`` positions of each sequence, and
    its float32 window refilled from them (today's steady state)."""
    per_seq = -(-length // BLOCK)
    num_blocks = batch * per_seq + 8
    tables = torch.randperm(num_blocks, generator=gen)[:batch * per_seq].view(batch, per_seq)
    tables = tables.int()
    lens = torch.full((batch,), length, dtype=torch.int32)
    slots = (tables[:, (length - 1) // BLOCK].long() * BLOCK + (length - 1) % BLOCK)
    cap = -(-(length + 64) // BLOCK) * BLOCK
    pages = torch.zeros(batch, cap // BLOCK, dtype=torch.int64)
    pages[:, :per_seq] = tables
    shape = (num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    caches, windows = [], []
    for _ in range(layers):
        k_cache, v_cache = (torch.randn(shape, generator=gen).bfloat16() for _ in "kv")
        win = torch.empty(batch, 2, KV_HEADS, cap, HEAD_DIM)
        q = torch.randn(batch, HEADS, HEAD_DIM, generator=gen).bfloat16()
        paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.125, native=False,
                               gather=decode_gather(tables, lens, BLOCK),
                               window=DecodeWindow(win, WindowFill(pages=pages.flatten())))
        caches.append((k_cache, v_cache))
        windows.append(win)
    rows = (torch.arange(batch * 2 * KV_HEADS).view(batch, -1) * cap + length - 1).flatten()
    return tables, lens, slots, caches, windows, rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="1x256,16x320,8x1100", help="BATCHxLENGTH, ...")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    from pdserve.bench.cluster import machine

    torch.set_num_threads(a.threads)
    print(f"# {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, {machine()}, "
          f"{a.threads} threads")
    print(f"# {' '.join(sys.argv)}")
    gen = torch.Generator().manual_seed(0)
    for shape in a.shapes.split(","):
        batch, length = map(int, shape.split("x"))
        tables, lens, slots, caches, windows, rows = setup(batch, length, a.layers, gen)
        qs = [torch.randn(batch, HEADS, HEAD_DIM, generator=gen).bfloat16()
              for _ in range(a.layers)]
        kvs = [torch.randn(batch, 2 * KV_HEADS, HEAD_DIM, generator=gen).bfloat16()
               for _ in range(a.layers)]  # the fused qkv's K and V, side by side

        def native_pass():
            for q, kv, (k_cache, v_cache) in zip(qs, kvs, caches):
                paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.125, native=True,
                                       new_kv=(kv[:, :KV_HEADS], kv[:, KV_HEADS:], slots),
                                       check=False)

        def window_pass():
            gather = decode_gather(tables, lens, BLOCK)
            fill = WindowFill(rows=rows)
            for q, kv, (k_cache, v_cache), win in zip(qs, kvs, caches, windows):
                store_kv(kv[:, :KV_HEADS], kv[:, KV_HEADS:], k_cache, v_cache, slots,
                         all_slots=True, check=False)
                paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.125, native=False,
                                       gather=gather, window=DecodeWindow(win, fill), kv=kv,
                                       check=False)

        repeats = max(2, int(2000 // (batch * length / 64)))
        times: dict[str, list[float]] = {"native": [], "window": []}
        for fn in (native_pass, window_pass):
            fn()  # warm up
        for _ in range(a.rounds):
            for name, fn in (("native", native_pass), ("window", window_pass)):
                t0 = time.perf_counter()
                for _ in range(repeats):
                    fn()
                times[name].append((time.perf_counter() - t0) / repeats / a.layers * 1e6)
        native_us, window_us = (statistics.median(times[n]) for n in ("native", "window"))
        print(f"B={batch:<3} L={length:<5} per layer: native {native_us:8.1f} us, "
              f"window + float32 SDPA {window_us:8.1f} us ({window_us / native_us:.1f}x); "
              f"{repeats} passes x {a.rounds} rounds")


if __name__ == "__main__":
    main()
