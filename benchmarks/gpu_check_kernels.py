"""Every pdserve Triton kernel against its torch reference, on one device.

On CUDA the cases include serving shapes (Llama-3-8B heads, long contexts);
on the CPU (``--device cpu``, under TRITON_INTERPRET=1, which must be set
before this runs) only small cases, to check the script itself. Prints one
line per case with the largest difference and exits 1 if any case is off by
more than the tolerance the kernel tests use.

    python benchmarks/gpu_check_kernels.py [--device cuda]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

TOL = {torch.float32: dict(atol=2e-5, rtol=1e-5), torch.bfloat16: dict(atol=3e-2, rtol=3e-2),
       torch.float16: dict(atol=3e-3, rtol=3e-3)}


class Checker:
    def __init__(self, device: str):
        self.device = device
        self.failed = 0
        self.gen = torch.Generator(device="cpu").manual_seed(0)

    def randn(self, *shape, dtype=torch.float32):
        return torch.randn(*shape, generator=self.gen).to(device=self.device, dtype=dtype)

    def compare(self, name: str, out, ref, dtype) -> None:
        outs, refs = (out, ref) if isinstance(out, tuple) else ((out,), (ref,))
        worst, ok = 0.0, True
        for o, r in zip(outs, refs):
            if o.shape != r.shape or o.dtype != r.dtype:
                ok, worst = False, float("inf")
                continue
            worst = max(worst, (o.float() - r.float()).abs().max().item() if o.numel() else 0.0)
            ok &= torch.allclose(o.float(), r.float(), **TOL[dtype])
        self.failed += not ok
        print(f"{'ok  ' if ok else 'FAIL'} {name:<58} max |diff| {worst:.3g}", flush=True)

    def paged(self, lens, block_size, kvh, d, dtype):
        """Per-sequence K and V written into shuffled pages: (k_cache, v_cache, tables)."""
        counts = [-(-n // block_size) for n in lens]
        num_blocks = sum(counts) + 3
        order = torch.randperm(num_blocks, generator=self.gen).tolist()
        k_cache = self.randn(num_blocks, block_size, kvh, d, dtype=dtype)
        v_cache = self.randn(num_blocks, block_size, kvh, d, dtype=dtype)
        tables = torch.full((len(lens), max(counts) + 1), 10**6, dtype=torch.int32)
        used = 0
        for i, n in enumerate(counts):
            tables[i, :n] = torch.tensor(order[used:used + n])
            used += n
        return k_cache, v_cache, tables.to(self.device)


def attention_cases(c: Checker, K, big: bool) -> None:
    decode = [([1, 16, 17, 50], 8, 1, 64, 16), ([64, 5], 4, 2, 64, 8), ([70, 1], 8, 2, 128, 32)]
    prefill = [([1, 64, 65], [1, 64, 65], 4, 1, 64, 16), ([1, 40, 17], [33, 100, 17], 8, 1, 64, 16),
               ([0, 33, 2], [5, 96, 2], 4, 4, 128, 32)]
    if big:
        decode += [([1024 + i * 37 for i in range(16)], 32, 8, 128, 16),
                   ([4096, 3, 2000, 17] * 4, 32, 8, 128, 16)]
        prefill += [([512, 1024, 7], [512, 1024, 7], 32, 8, 128, 16),
                    ([128, 1, 300], [2048, 900, 300], 32, 8, 128, 16)]
    dtypes = [torch.float32, torch.bfloat16] + ([torch.float16] if big else [])
    for dtype in dtypes:
        for lens, h, kvh, d, bs in decode:
            k_cache, v_cache, tables = c.paged(lens, bs, kvh, d, dtype)
            q = c.randn(len(lens), h, d, dtype=dtype)
            args = (q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32,
                                                              device=c.device), d ** -0.5)
            c.compare(f"paged_decode_attention {dtype} H{h}/{kvh} D{d} bs{bs} n{len(lens)}",
                      K.paged_decode_attention(*args, backend="triton"),
                      K.paged_decode_attention(*args, backend="torch"), dtype)
        for q_lens, lens, h, kvh, d, bs in prefill:
            q = c.randn(sum(q_lens), h, d, dtype=dtype)
            cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32,
                              device=c.device)
            if q_lens == lens:
                k = c.randn(sum(lens), kvh, d, dtype=dtype)
                v = c.randn(sum(lens), kvh, d, dtype=dtype)
                c.compare(f"prefill_attention {dtype} H{h}/{kvh} D{d} q{q_lens[:3]}",
                          K.prefill_attention(q, k, v, cu, d ** -0.5, backend="triton"),
                          K.prefill_attention(q, k, v, cu, d ** -0.5, backend="torch"), dtype)
            k_cache, v_cache, tables = c.paged(lens, bs, kvh, d, dtype)
            args = (q, k_cache, v_cache, cu, torch.tensor(lens, dtype=torch.int32,
                                                          device=c.device), tables, d ** -0.5)
            c.compare(f"paged_prefill_attention {dtype} H{h}/{kvh} D{d} q{q_lens[:3]}",
                      K.paged_prefill_attention(*args, backend="triton"),
                      K.paged_prefill_attention(*args, backend="torch"), dtype)


def cache_cases(c: Checker, K, big: bool) -> None:
    for dtype in (torch.float32, torch.bfloat16):
        nb, bs, kvh, d = (4096, 16, 8, 128) if big else (12, 16, 2, 64)
        t = 3000 if big else 37
        slots = torch.randperm(nb * bs, generator=c.gen)[:t]
        slots[::7] = -1  # skipped tokens
        slots = slots.to(c.device)
        k, v = c.randn(t, kvh, d, dtype=dtype), c.randn(t, kvh, d, dtype=dtype)
        caches = []
        for backend in ("triton", "torch"):
            kc, vc = c.randn(nb, bs, kvh, d, dtype=dtype), c.randn(nb, bs, kvh, d, dtype=dtype)
            kc.zero_(), vc.zero_()
            K.store_kv(k, v, kc, vc, slots, backend=backend)
            caches.append((kc, vc))
        c.compare(f"store_kv {dtype} T{t}", caches[0], caches[1], dtype)
        ids = torch.randperm(nb, generator=c.gen)[:nb // 3].to(c.device)
        kc, vc = caches[1]
        c.compare(f"gather_kv {dtype} n{len(ids)}", K.gather_kv(kc, vc, ids, backend="triton"),
                  K.gather_kv(kc, vc, ids, backend="torch"), dtype)
        pk, pv = c.randn(len(ids), bs, kvh, d, dtype=dtype), c.randn(len(ids), bs, kvh, d,
                                                                     dtype=dtype)
        outs = []
        for backend in ("triton", "torch"):
            kc2, vc2 = kc.clone(), vc.clone()
            K.scatter_kv(kc2, vc2, ids, pk, pv, backend=backend)
            outs.append((kc2, vc2))
        c.compare(f"scatter_kv {dtype} n{len(ids)}", outs[0], outs[1], dtype)


def norm_rotary_cases(c: Checker, K, big: bool) -> None:
    t, hidden, h, kvh, d = (4096, 4096, 32, 8, 128) if big else (37, 256, 4, 2, 64)
    for dtype in (torch.float32, torch.bfloat16):
        x, res, w = c.randn(t, hidden, dtype=dtype), c.randn(t, hidden, dtype=dtype), \
            c.randn(hidden, dtype=dtype)
        c.compare(f"rms_norm {dtype} {t}x{hidden}", K.rms_norm(x, w, 1e-5, backend="triton"),
                  K.rms_norm(x, w, 1e-5, backend="torch"), dtype)
        c.compare(f"rms_norm + residual {dtype} {t}x{hidden}",
                  K.rms_norm(x, w, 1e-5, res, backend="triton"),
                  K.rms_norm(x, w, 1e-5, res, backend="torch"), dtype)
        q, k = c.randn(t, h, d, dtype=dtype), c.randn(t, kvh, d, dtype=dtype)
        positions = torch.randint(0, 8192, (t,), generator=c.gen).to(c.device)
        inv = 1.0 / (500000.0 ** (torch.arange(0, d, 2).float() / d))
        freqs = torch.arange(8192).float()[:, None] * inv[None, :]
        cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(c.device)
        c.compare(f"apply_rotary {dtype} T{t} H{h}/{kvh} D{d}",
                  K.apply_rotary(q, k, positions, cache, backend="triton"),
                  K.apply_rotary(q, k, positions, cache, backend="torch"), dtype)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout
    import pdserve.kernels as K
    from pdserve.kernels._dispatch import triton

    if triton is None:
        print("FAIL triton is not installed: no kernel to check")
        return 1
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: nothing checked")
        return 1
    c = Checker(args.device)
    big = args.device == "cuda"
    attention_cases(c, K, big)
    cache_cases(c, K, big)
    norm_rotary_cases(c, K, big)
    print(f"kernels: {c.failed} case(s) failed")
    return 1 if c.failed else 0


if __name__ == "__main__":
    sys.exit(main())
