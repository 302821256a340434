"""Time each pdserve Triton kernel against torch's own way of doing the same work.

Baselines: SDPA on contiguous K/V for attention (the pages already gathered,
which flatters torch: the paged kernels pay for their gather), index_copy_ /
index_select for the cache copies, the torch references for norm and rotary.
Each row also prints the largest difference from the torch reference, as a
first check of kernels that are tested on the CPU only under the interpreter.

    python benchmarks/kernels.py [--dtype bfloat16|float16|float32]

Needs CUDA; elsewhere it says so and exits 0.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F


def bench_ms(fn, warmup: int = 10, iters: int = 50) -> float:
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def report(name: str, triton_fn, torch_fn, *, bytes_moved: float = 0.0, flops: float = 0.0,
           check=None) -> None:
    t_ms, ref_ms = bench_ms(triton_fn), bench_ms(torch_fn)
    rate = (f"{flops / t_ms / 1e9:8.1f} TFLOP/s" if flops
            else f"{bytes_moved / t_ms / 1e6:8.0f} GB/s   ")
    diff = f"{check():.2e}" if check is not None else "-"
    print(f"{name:<44} {t_ms:9.3f} {ref_ms:9.3f} {ref_ms / t_ms:7.2f}x  {rate}  {diff}")


def paged_cache(num_seqs, seq_len, num_kv_heads, head_dim, block_size, dtype):
    blocks_per_seq = -(-seq_len // block_size)
    num_blocks = num_seqs * blocks_per_seq
    order = torch.randperm(num_blocks, device="cuda").int()
    tables = order.view(num_seqs, blocks_per_seq)  # scattered pages
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, device="cuda", dtype=dtype)
    v_cache = torch.randn(shape, device="cuda", dtype=dtype)
    return k_cache, v_cache, tables


def contiguous_kv(cache, tables, seq_len):
    # [B, NB, BS, KVH, D] -> [B, KVH, L, D]
    return cache[tables.long()].flatten(1, 2)[:, :seq_len].transpose(1, 2).contiguous()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("benchmarks/kernels.py needs a CUDA device; none found, nothing measured.")
        return 0
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout
    import pdserve.kernels as K

    dtype = getattr(torch, args.dtype)
    size = torch.tensor([], dtype=dtype).element_size()
    dev = "cuda"
    H, KVH, D, BS = 32, 8, 128, 16
    scale = D ** -0.5
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()}, {args.dtype}, heads {H}/{KVH}, head_dim {D}, "
          f"block_size {BS}")
    print(f"{'kernel':<44} {'triton ms':>9} {'torch ms':>9} {'speedup':>8}  {'achieved':>15}"
          f"  max|diff|")

    def maxdiff(a, b):
        return lambda: (a().float() - b().float()).abs().max().item()

    # Decode: every sequence one query over L cached tokens.
    for num_seqs, seq_len in ((64, 1024), (8, 8192)):
        k_cache, v_cache, tables = paged_cache(num_seqs, seq_len, KVH, D, BS, dtype)
        q = torch.randn(num_seqs, H, D, device=dev, dtype=dtype)
        lens = torch.full((num_seqs,), seq_len, dtype=torch.int32, device=dev)
        k, v = contiguous_kv(k_cache, tables, seq_len), contiguous_kv(v_cache, tables, seq_len)
        tri = lambda: K.paged_decode_attention(  # noqa: E731
            q, k_cache, v_cache, tables, lens, scale)
        ref = lambda: F.scaled_dot_product_attention(  # noqa: E731
            q[:, :, None], k, v, scale=scale, enable_gqa=True)[:, :, 0]
        report(f"paged_decode_attention B={num_seqs} L={seq_len}", tri, ref,
               bytes_moved=2 * k.numel() * size, check=maxdiff(tri, ref))

    # Prefill: 4 fresh sequences of 2048 tokens.
    num_seqs, seq_len = 4, 2048
    T = num_seqs * seq_len
    q = torch.randn(T, H, D, device=dev, dtype=dtype)
    k = torch.randn(T, KVH, D, device=dev, dtype=dtype)
    v = torch.randn(T, KVH, D, device=dev, dtype=dtype)
    cu = torch.arange(0, T + 1, seq_len, dtype=torch.int32, device=dev)
    causal_flops = 4 * num_seqs * (seq_len * seq_len / 2) * H * D  # QK^T and PV, half masked
    tri = lambda: K.prefill_attention(q, k, v, cu, scale)  # noqa: E731
    qb, kb, vb = (x.view(num_seqs, seq_len, -1, D).transpose(1, 2) for x in (q, k, v))
    ref = lambda: F.scaled_dot_product_attention(  # noqa: E731
        qb, kb, vb, is_causal=True, scale=scale, enable_gqa=True).transpose(1, 2).reshape(T, H, D)
    report(f"prefill_attention {num_seqs}x{seq_len}", tri, ref, flops=causal_flops,
           check=maxdiff(tri, ref))

    # Chunked prefill: 4 sequences, a 512-token chunk after a 1536-token cached prefix.
    num_seqs, chunk, total = 4, 512, 2048
    k_cache, v_cache, tables = paged_cache(num_seqs, total, KVH, D, BS, dtype)
    q = torch.randn(num_seqs * chunk, H, D, device=dev, dtype=dtype)
    cu = torch.arange(0, num_seqs * chunk + 1, chunk, dtype=torch.int32, device=dev)
    lens = torch.full((num_seqs,), total, dtype=torch.int32, device=dev)
    kc, vc = contiguous_kv(k_cache, tables, total), contiguous_kv(v_cache, tables, total)
    mask = (torch.arange(total, device=dev)[None, :]
            <= torch.arange(total - chunk, total, device=dev)[:, None])  # [S, L]
    qb = q.view(num_seqs, chunk, H, D).transpose(1, 2)
    tri = lambda: K.paged_prefill_attention(  # noqa: E731
        q, k_cache, v_cache, cu, lens, tables, scale)
    ref = lambda: F.scaled_dot_product_attention(  # noqa: E731
        qb, kc, vc, attn_mask=mask, scale=scale, enable_gqa=True
    ).transpose(1, 2).reshape(-1, H, D)
    flops = 4 * num_seqs * chunk * (total - chunk / 2) * H * D
    report(f"paged_prefill_attention {num_seqs}x{chunk} after {total - chunk}", tri, ref,
           flops=flops, check=maxdiff(tri, ref))

    # KV cache copies.
    T = 8192
    k_cache, v_cache, _ = paged_cache(1, T * 2, KVH, D, BS, dtype)
    kv = torch.randn(T, 3 * KVH * D, device=dev, dtype=dtype)
    k_new = kv[:, :KVH * D].view(T, KVH, D)  # strided, as the model has them
    v_new = kv[:, KVH * D:2 * KVH * D].view(T, KVH, D)
    slots = torch.randperm(T * 2, device=dev)[:T]
    flat_k, flat_v = k_cache.view(-1, KVH, D), v_cache.view(-1, KVH, D)
    report(f"store_kv T={T}", lambda: K.store_kv(k_new, v_new, k_cache, v_cache, slots),
           lambda: (flat_k.index_copy_(0, slots, k_new), flat_v.index_copy_(0, slots, v_new)),
           bytes_moved=4 * k_new.numel() * size)
    ids = torch.randperm(k_cache.shape[0], device=dev)[:512]
    page_bytes = 2 * 512 * k_cache[0].numel() * size
    report("gather_kv 512 pages", lambda: K.gather_kv(k_cache, v_cache, ids),
           lambda: (k_cache.index_select(0, ids), v_cache.index_select(0, ids)),
           bytes_moved=2 * page_bytes)
    k_pages, v_pages = K.gather_kv(k_cache, v_cache, ids)
    report("scatter_kv 512 pages", lambda: K.scatter_kv(k_cache, v_cache, ids, k_pages, v_pages),
           lambda: (k_cache.index_copy_(0, ids, k_pages), v_cache.index_copy_(0, ids, v_pages)),
           bytes_moved=2 * page_bytes)

    # Norm and rotary.
    T, hidden = 8192, 4096
    x = torch.randn(T, hidden, device=dev, dtype=dtype)
    res = torch.randn(T, hidden, device=dev, dtype=dtype)
    w = torch.randn(hidden, device=dev, dtype=dtype)
    tri = lambda: K.rms_norm(x, w, 1e-6, res)[0]  # noqa: E731
    ref = lambda: K.rms_norm(x, w, 1e-6, res, backend="torch")[0]  # noqa: E731
    report(f"rms_norm + residual {T}x{hidden}", tri, ref, bytes_moved=4 * x.numel() * size,
           check=maxdiff(tri, ref))
    q = torch.randn(T, H, D, device=dev, dtype=dtype)
    k = torch.randn(T, KVH, D, device=dev, dtype=dtype)
    positions = torch.randint(0, 32768, (T,), device=dev)
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, D, 2, device=dev).float() / D))
    freqs = torch.arange(32768, device=dev).float()[:, None] * inv_freq[None, :]
    cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
    tri = lambda: K.apply_rotary(q, k, positions, cache)[0]  # noqa: E731
    ref = lambda: K.apply_rotary(q, k, positions, cache, backend="torch")[0]  # noqa: E731
    report(f"apply_rotary T={T}", tri, ref, bytes_moved=2 * (q.numel() + k.numel()) * size,
           check=maxdiff(tri, ref))
    return 0


if __name__ == "__main__":
    sys.exit(main())
