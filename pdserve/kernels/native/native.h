/* What the native kernels share: small helpers (static inline: each translation unit its own
 * copy), and the pieces of one kernel that decode_step.c runs inside its own thread team. */
#ifndef PDSERVE_NATIVE_H
#define PDSERVE_NATIVE_H

#include <immintrin.h>
#if !(defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) \
      && defined(__AVX512VNNI__) && defined(__AVX512BF16__))
#include "avx512_on_avx2.h"  /* the same kernels on an AVX2 CPU */
#else
/* acc + the products of a's and b's bfloat16 pairs; 32 bfloat16 from two float32 vectors */
#define nat_dpbf16(acc, a, b) _mm512_dpbf16_ps((acc), (__m512bh)(a), (__m512bh)(b))
#define nat_bf16_pairs(hi, lo) ((__m512i)_mm512_cvtne2ps_pbh((hi), (lo)))
#endif
#include <stddef.h>
#include <stdint.h>

/* 16 values, bfloat16 (exact in float32) or float32, as float32 */
static inline __m512 nat_load16(const void *x, int x_bf16) {
    if (x_bf16) {
        __m512i u = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)x));
        return _mm512_castsi512_ps(_mm512_slli_epi32(u, 16));
    }
    return _mm512_loadu_ps(x);
}

/* 16 float32 values stored as float32, or as bfloat16 rounded to nearest even */
static inline void nat_store16(void *out, __m512 v, int out_bf16) {
    if (out_bf16)
        _mm256_storeu_si256((__m256i *)out, (__m256i)_mm512_cvtneps_pbh(v));
    else
        _mm512_storeu_ps(out, v);
}

/* ---- int4_gemm.c: quantize the activations once, then any range of output blocks ---- */
void pd_int4_quantize(const void *x, int x_bf16, int M, int K, int8_t *xq, float *sx,
                      float *sumx);
void pd_int4_blocks(const uint8_t *w, int K, int nb0, int nb1, const int8_t *xq,
                    const float *sx, const float *sumx, int M, char *out, size_t out_row,
                    int out_bf16);

/* ---- q8_gemm.c: the embedding's rows (0, or the index + 1 of the first id out of range) */
int q8_rows(const uint8_t *w, int K, int N, const int64_t *ids, int count, void *out,
            int out_bf16);

/* ---- q8_gemm.c: the LM head's activations quantized once, then a greedy pick over any
 * range of output blocks ---- */
void pd_q8_quantize(const void *x, int x_bf16, int M, int K, int8_t *xq, float *sx,
                    int32_t *corr);
void pd_q8_argmax_blocks(const uint8_t *w, int K, int N, int nb0, int nb1, const int8_t *xq,
                         const float *sx, const int32_t *corr, int M, float *best,
                         int64_t *at);

/* ---- decode_ops.c: one row (or head) of each operation, bfloat16 ---- */
void pd_rms_norm_row(const uint16_t *x, const uint16_t *res, uint16_t *sum_out,
                     const uint16_t *w, uint16_t *out, int n, float eps);
void pd_rotate_head(uint16_t *p, int D, const uint16_t *c, const uint16_t *s);
void pd_silu_mul_row(const uint16_t *g, const uint16_t *u, uint16_t *o, int n);

/* ---- decode_attention.c: a call's plan, its tasks, and combining a sequence's chunks ---- */
enum { DA_F32 = 0, DA_BF16 = 1, DA_F16 = 2 };
#define DA_MAX_GROUP 16     /* query heads per kv head */
#define DA_MAX_DV 16        /* head_dim / 16: head_dim up to 256 */

typedef struct {
    const char *q;                  /* [B, H, D], strides q_s, q_h (elements), last dim 1 */
    int64_t q_s, q_h;
    const char *k, *v;              /* [num_blocks, block_size, KVH, D] contiguous */
    const void *tables;             /* [B, max_blocks], row stride bt_s */
    int64_t bt_s;
    int tables64;
    char *out;                      /* [B, H, D] contiguous */
    int H, KVH, D, bs, dtype;
    float scale;
} da_args;

typedef struct { int b, t0, t1; } da_task;  /* sequence b, positions [t0, t1) */

/* The slot (row index) of a sequence's position pos in a paged K or V cache
 * [num_blocks, bs, KVH, D], blk the block its block table names for it */
static inline int64_t pd_kv_slot(int64_t blk, int64_t pos, int bs) {
    return blk * bs + pos % bs;
}

/* the shapes the kernel's per-task stack arrays hold */
static inline int pd_da_shape_ok(int H, int KVH, int D) {
    return KVH > 0 && H % KVH == 0 && H / KVH <= DA_MAX_GROUP && D > 0 && D % 16 == 0
           && D <= 16 * DA_MAX_DV;
}

int pd_da_split(int num_seqs, const void *seq_lens, int lens64, int KVH, int threads,
                int *parallel);
int pd_da_tasks(int num_seqs, const void *seq_lens, int lens64, int split, da_task *tasks);
/* one task, kv heads [k0, k1) (each kv head's sums are its own: a task split by heads gives
 * the same bits): m, l [H] and acc [H, D] of its positions, those heads' entries; qb: the
 * sequence's bfloat16 queries [H, D] (bfloat16 caches), qf: its float32 ones, scaled */
void pd_da_run(const da_args *a, const da_task *tk, int k0, int k1, const float *qf,
               const uint16_t *qb, float *m, float *l, float *acc);
void pd_da_write(const da_args *a, int64_t b, int h0, int h1, const float *l,
                 const float *acc);
void pd_da_combine(const da_args *a, const da_task *tasks, int i, int j, const float *parts,
                   int64_t per_task, float *l, float *acc);

#endif
