/* Decode attention on the CPU straight from the paged KV cache (kernels/attention_decode.py's
 * paged_decode_attention for bfloat16, float16 and float32 caches).
 *
 * One query token per sequence; its K/V are read where they lie, page by page through the
 * block table, with no copy into a contiguous buffer. A task is one sequence and a range of
 * its positions, every kv head: a page ([block_size, KVH, D]) is read in order, as one
 * stream, each K and V row once for the query heads that share it (GQA). Per query head it
 * keeps an online softmax (running max m, sum l) and a float32 accumulator over tiles of 16
 * positions. Loads convert to float32 (exact from bfloat16 and float16), every product and
 * sum is float32 (e^x: a polynomial within 2 ulp), the output is rounded once to the
 * cache's dtype (nearest even). bfloat16's q . k runs on AVX512-BF16's dot product, which
 * counts subnormal inputs (below 1e-38) as zeros.
 *
 * Threads: a batch of few sequences (batch 1) splits a long context into chunks whose
 * partial (m, l, acc) are combined afterwards (flash-decoding), so both cores get work. A
 * step with little work runs on the calling
 * thread alone: waking OpenMP's pool can cost 10-20 us on a shared machine, and gains
 * nothing on a short batch's attention (DA_PARALLEL_WORK).
 *
 * The new tokens' K/V can be stored into their slots by the same call (slots >= 0; -1
 * skips), before anything is read: a decode step then makes one call per layer instead of
 * two index_copy_ and the attention.
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "native.h"

#define DA_TILE 16          /* positions per softmax update: one 512-bit vector of scores */
#define DA_MIN_CHUNK 128    /* positions, at least, in a split context's chunk */
/* positions x kv heads a call attends over, below which it runs on one thread. Measured
 * on the 2-core EPYC, each call after a bfloat16 linear (as in a layer; benchmarks/
 * RESULTS.md): at 192-384 both take the same time, at 768 two threads save 3.4 us of 12 */
#ifndef DA_PARALLEL_WORK
#define DA_PARALLEL_WORK 512
#endif

static inline int64_t da_index(const void *p, int64_t i, int is64) {
    return is64 ? ((const int64_t *)p)[i] : ((const int32_t *)p)[i];
}

static inline __attribute__((always_inline)) __m512 da_load(const char *p, const int dtype) {
    if (dtype == DA_BF16) {
        __m512i u = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
        return _mm512_castsi512_ps(_mm512_slli_epi32(u, 16));
    }
    if (dtype == DA_F16)
        return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_loadu_ps(p);
}

static inline void da_store(char *p, __m512 x, int dtype) {
    if (dtype == DA_BF16)
        _mm256_storeu_si256((__m256i *)p, (__m256i)_mm512_cvtneps_pbh(x));
    else if (dtype == DA_F16)
        _mm256_storeu_si256((__m256i *)p,
                            _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    else
        _mm512_storeu_ps(p, x);
}

/* e^x for x <= 0 (Cephes' expf: a degree-6 polynomial on |r| <= ln2 / 2, 2^n by scalef),
 * within 2 ulp; below -87 it gives about 1e-38, which the callers mask or which vanishes in
 * a sum of terms >= 1 */
static inline __m512 da_exp(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

/* r[i] = the sum of v[i]'s 16 lanes, i < 16: a transposing tree, 15 adds and 30 shuffles
 * for 16 dot products instead of 16 reductions of about 10 instructions each */
static inline __m512 da_hsum16(const __m512 *v) {
    __m512 t[8], u[4];
    for (int k = 0; k < 8; k++)  /* per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3] */
        t[k] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * k], v[2 * k + 1]),
                             _mm512_unpackhi_ps(v[2 * k], v[2 * k + 1]));
    for (int k = 0; k < 4; k++)  /* per 128-bit lane: that lane's sums of v[4k .. 4k + 3] */
        u[k] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * k], t[2 * k + 1], 0x44),
                             _mm512_shuffle_ps(t[2 * k], t[2 * k + 1], 0xEE));
    __m512 w0 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x44),
                              _mm512_shuffle_f32x4(u[0], u[1], 0xEE));
    __m512 w1 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x44),
                              _mm512_shuffle_f32x4(u[2], u[3], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_f32x4(w0, w1, 0x88), _mm512_shuffle_f32x4(w0, w1, 0xDD));
}

/* Positions [t0, t1) of sequence b, every kv head, reading each page's K and V rows in
 * order (a page is [block_size, KVH, D]: one stream, not KVH strided ones). qf: the
 * sequence's queries [H, D], float32 and scaled; qb: bfloat16 ones as given, whose scores
 * are scaled (a bfloat16 cache: q . k by _mm512_dpbf16_ps, pairs of exact products summed in
 * float32, with no conversion of K). Per query head h: m[h], l[h] and
 * acc[h * D ..] (unnormalised). DTYPE, DV (= D / 16) and G (query heads per kv head) are
 * constants at the common call sites (da_run's switch): the loops over them unroll and
 * the accumulators and queries stay in registers. */
static inline __attribute__((always_inline)) void da_chunk(
        const da_args *a, int64_t b, int t0, int t1, int k0, int k1, const float *qf,
        const uint16_t *qb, const int DTYPE, const int DV, const int G, float *m, float *l,
        float *acc) {
    const int KVH = a->KVH, D = DV * 16;
    const int esize = DTYPE == DA_F32 ? 4 : 2;
    const int64_t row = (int64_t)KVH * D;
    for (int h = k0 * G; h < k1 * G; h++) {
        m[h] = -INFINITY;
        l[h] = 0.0f;
    }
    memset(acc + (int64_t)k0 * G * D, 0, sizeof(float) * (k1 - k0) * G * D);
    const char *table = (const char *)a->tables + b * a->bt_s * (a->tables64 ? 8 : 4);
    __m512 dots[DA_MAX_GROUP][DA_TILE];
    float p[DA_MAX_GROUP][DA_TILE];
    int64_t off[DA_TILE];
    for (int t = t0; t < t1; t += DA_TILE) {
        const int n = t1 - t < DA_TILE ? t1 - t : DA_TILE;
        for (int i = 0; i < n; i++) {  /* this tile's rows: (page, offset) -> bytes */
            int64_t blk = da_index(table, (t + i) / a->bs, a->tables64);
            off[i] = pd_kv_slot(blk, t + i, a->bs) * row * esize;
        }
        const __mmask16 valid = (__mmask16)((1u << n) - 1);
        /* the next tile's K and V rows, one page or two anywhere in memory: the hardware
         * prefetchers only learn a stream after its first misses, and a page is one short
         * stream (a few KiB) */
        for (int i = t + DA_TILE; i < t1 && i < t + 2 * DA_TILE; i++) {
            int64_t blk = da_index(table, i / a->bs, a->tables64);
            const char *kp = a->k + (pd_kv_slot(blk, i, a->bs) * row + k0 * D) * esize;
            const char *vp = a->v + (kp - a->k);
            for (int64_t x = 0; x < (int64_t)(k1 - k0) * D * esize; x += 64) {
                _mm_prefetch(kp + x, _MM_HINT_T0);
                _mm_prefetch(vp + x, _MM_HINT_T0);
            }
        }
        for (int kvh = k0; kvh < k1; kvh++) {
            const int64_t head = (int64_t)kvh * D * esize;
            if (DTYPE == DA_BF16) {  /* q . k in pairs of bfloat16 (exact products) */
                const uint16_t *qk = qb + (int64_t)kvh * G * D;
                const int DW = (DV + 1) / 2;  /* 32 bf16 a vector; an odd DV's last is half */
                const __mmask32 last = DV % 2 ? 0xFFFFu : 0xFFFFFFFFu;
                __m512i q[DA_MAX_GROUP][DA_MAX_DV / 2];
                for (int g = 0; g < G; g++)
                    for (int c = 0; c < DW; c++)
                        q[g][c] = _mm512_maskz_loadu_epi16(c == DW - 1 ? last : 0xFFFFFFFFu,
                                                           qk + g * D + c * 32);
                for (int i = 0; i < DA_TILE; i++) {
                    __m512i k[DA_MAX_DV / 2];
                    for (int c = 0; c < DW; c++)
                        k[c] = i < n ? _mm512_maskz_loadu_epi16(
                                           c == DW - 1 ? last : 0xFFFFFFFFu,
                                           a->k + off[i] + head + c * 64)
                                     : _mm512_setzero_si512();
                    for (int g = 0; g < G; g++) {
                        __m512 d = _mm512_setzero_ps();
                        for (int c = 0; c < DW; c++)
                            d = nat_dpbf16(d, q[g][c], k[c]);
                        dots[g][i] = d;
                    }
                }
            } else {  /* float16, float32: q . k in float32 */
                const float *qk = qf + (int64_t)kvh * G * D;
                __m512 q[DA_MAX_GROUP][DA_MAX_DV];
                for (int g = 0; g < G; g++)
                    for (int c = 0; c < DV; c++) q[g][c] = _mm512_loadu_ps(qk + g * D + c * 16);
                for (int i = 0; i < DA_TILE; i++) {  /* q . k, lane-wise, per head of the group */
                    __m512 k[DA_MAX_DV];
                    if (i < n)
                        for (int c = 0; c < DV; c++)
                            k[c] = da_load(a->k + off[i] + head + c * 16 * esize, DTYPE);
                    else
                        for (int c = 0; c < DV; c++) k[c] = _mm512_setzero_ps();
                    for (int g = 0; g < G; g++) {
                        __m512 d = _mm512_mul_ps(q[g][0], k[0]);
                        for (int c = 1; c < DV; c++) d = _mm512_fmadd_ps(q[g][c], k[c], d);
                        dots[g][i] = d;
                    }
                }
            }
            for (int g = 0; g < G; g++) {  /* online softmax: scores become e^(s - m) */
                const int h = kvh * G + g;
                __m512 sv = da_hsum16(dots[g]);
                if (DTYPE == DA_BF16) sv = _mm512_mul_ps(sv, _mm512_set1_ps(a->scale));
                sv = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), valid, sv);
                float mx = _mm512_reduce_max_ps(sv);
                float m_new = m[h] > mx ? m[h] : mx;
                float alpha = expf(m[h] - m_new);  /* 0 on the first tile: m[h] = -inf */
                __m512 e = _mm512_maskz_mov_ps(
                    valid, da_exp(_mm512_sub_ps(sv, _mm512_set1_ps(m_new))));
                l[h] = l[h] * alpha + _mm512_reduce_add_ps(e);
                m[h] = m_new;
                if (alpha != 1.0f)
                    for (int c = 0; c < DV; c++)
                        _mm512_storeu_ps(acc + h * D + c * 16,
                                         _mm512_mul_ps(_mm512_loadu_ps(acc + h * D + c * 16),
                                                       _mm512_set1_ps(alpha)));
                _mm512_storeu_ps(p[g], e);
            }
            /* acc += p . v, each V row read once for the group */
            float *acc_k = acc + (int64_t)kvh * G * D;
            __m512 r[DA_MAX_GROUP][DA_MAX_DV];
            for (int g = 0; g < G; g++)
                for (int c = 0; c < DV; c++) r[g][c] = _mm512_loadu_ps(acc_k + g * D + c * 16);
            for (int i = 0; i < n; i++) {
                __m512 v[DA_MAX_DV];
                for (int c = 0; c < DV; c++)
                    v[c] = da_load(a->v + off[i] + head + c * 16 * esize, DTYPE);
                for (int g = 0; g < G; g++) {
                    __m512 pg = _mm512_set1_ps(p[g][i]);
                    for (int c = 0; c < DV; c++) r[g][c] = _mm512_fmadd_ps(pg, v[c], r[g][c]);
                }
            }
            for (int g = 0; g < G; g++)
                for (int c = 0; c < DV; c++) _mm512_storeu_ps(acc_k + g * D + c * 16, r[g][c]);
        }
    }
}

/* out[b] = acc / l for query heads [h0, h1), rounded once */
void pd_da_write(const da_args *a, int64_t b, int h0, int h1, const float *l,
                 const float *acc) {
    const int D = a->D, esize = a->dtype == DA_F32 ? 4 : 2;
    for (int h = h0; h < h1; h++) {
        char *o = a->out + ((b * a->H + h) * (int64_t)D) * esize;
        __m512 inv = _mm512_set1_ps(l[h] > 0.0f ? 1.0f / l[h] : 0.0f);
        for (int c = 0; c < D / 16; c++)
            da_store(o + c * 16 * esize, _mm512_mul_ps(_mm512_loadu_ps(acc + h * D + c * 16), inv),
                     a->dtype);
    }
}

/* The common shapes get their own copy of da_chunk: bfloat16 (the CPU's serving dtype) at
 * head_dim 64 and 128 and groups of 1 to 4 and 8, float16 at those head_dims; every other
 * one runs the generic copy of its dtype. (Each copy costs about 0.3 s of the library's
 * one-off build: all of float16's would double it.) */
#define DA_CHUNK(DT, DV_, G_) \
    da_chunk(a, tk->b, tk->t0, tk->t1, k0, k1, qf, qb, DT, DV_, G_, m, l, acc)
#define DA_GROUPS(DT, DV_)                                                            \
    switch (g) {                                                                      \
    case 1: DA_CHUNK(DT, DV_, 1); return;                                             \
    case 2: DA_CHUNK(DT, DV_, 2); return;                                             \
    case 3: DA_CHUNK(DT, DV_, 3); return;                                             \
    case 4: DA_CHUNK(DT, DV_, 4); return;                                             \
    case 8: DA_CHUNK(DT, DV_, 8); return;                                             \
    }

void pd_da_run(const da_args *a, const da_task *tk, int k0, int k1, const float *qf,
               const uint16_t *qb, float *m, float *l, float *acc) {
    const int dv = a->D / 16, g = a->H / a->KVH;
    if (a->dtype == DA_BF16) {
        if (dv == 4) DA_GROUPS(DA_BF16, 4)
        if (dv == 8) DA_GROUPS(DA_BF16, 8)
        DA_CHUNK(DA_BF16, dv, g);
    } else if (a->dtype == DA_F16) {
        if (dv == 4) {
            DA_CHUNK(DA_F16, 4, g);
            return;
        }
        if (dv == 8) {
            DA_CHUNK(DA_F16, 8, g);
            return;
        }
        DA_CHUNK(DA_F16, dv, g);
    } else {
        DA_CHUNK(DA_F32, dv, g);
    }
}

/* The new tokens' K and V (token t's head h at k_new + t * kn_s + h * kn_h elements, head
 * dims contiguous) into cache slot slots[t]; -1 skips */
static void da_store_new(const da_args *a, int T, const char *k_new, int64_t kn_s,
                         int64_t kn_h, const char *v_new, int64_t vn_s, int64_t vn_h,
                         const int64_t *slots) {
    const int esize = a->dtype == DA_F32 ? 4 : 2;
    const size_t bytes = (size_t)a->D * esize;
    for (int t = 0; t < T; t++) {
        if (slots[t] < 0) continue;
        for (int h = 0; h < a->KVH; h++) {
            int64_t dst = ((slots[t] * a->KVH + h) * (int64_t)a->D) * esize;
            memcpy((char *)a->k + dst, k_new + (t * kn_s + h * kn_h) * esize, bytes);
            memcpy((char *)a->v + dst, v_new + (t * vn_s + h * vn_h) * esize, bytes);
        }
    }
}

/* Chunks per sequence for a call over these lengths on `threads` threads: enough tasks for
 * 4 a thread when sequences are few, each chunk at least DA_MIN_CHUNK positions; 1 (whole
 * sequences) where the work is too little to go parallel (*parallel = 0). */
int pd_da_split(int num_seqs, const void *seq_lens, int lens64, int KVH, int threads,
                int *parallel) {
    int64_t work = 0, max_len = 0;
    for (int b = 0; b < num_seqs; b++) {
        int64_t n = da_index(seq_lens, b, lens64);
        work += n;
        if (n > max_len) max_len = n;
    }
    work *= KVH;
    *parallel = work >= DA_PARALLEL_WORK && threads > 1;
    int split = 1;
    if (*parallel && num_seqs < 4 * threads) {
        split = (4 * threads + num_seqs - 1) / num_seqs;
        int most = (int)((max_len + DA_MIN_CHUNK - 1) / DA_MIN_CHUNK);
        if (split > most) split = most;
        if (split < 1) split = 1;
    }
    return split;
}

/* Each sequence's chunks as tasks, in order (a sequence's are consecutive); a sequence of
 * length 0 (batch padding) gets none. Returns the count (at most num_seqs * split). */
int pd_da_tasks(int num_seqs, const void *seq_lens, int lens64, int split, da_task *tasks) {
    int count = 0;
    for (int b = 0; b < num_seqs; b++) {
        int len = (int)da_index(seq_lens, b, lens64);
        /* chunks of whole tiles, the nearest to an even split (rounded up, 130 positions in
         * two were 80 and 50: one thread's share of the items 1.6 times the other's); the
         * last takes the rest */
        int chunk = ((len + split - 1) / split + DA_TILE / 2) / DA_TILE * DA_TILE;
        if (chunk < DA_TILE) chunk = DA_TILE;
        for (int t0 = 0, k = 1; t0 < len; t0 += chunk, k++) {
            const int t1 = k == split || t0 + chunk >= len ? len : t0 + chunk;
            tasks[count++] = (da_task){b, t0, t1};
            if (t1 == len) break;
        }
    }
    return count;
}

/* Tasks [i, j), one sequence's chunks, combined (one max for all) and written. parts: each
 * task's m [H], l [H], acc [H, D] at per_task floats apart; l and acc: [H] and [H, D] of
 * scratch. */
void pd_da_combine(const da_args *a, const da_task *tasks, int i, int j, const float *parts,
                   int64_t per_task, float *l, float *acc) {
    const int H = a->H, D = a->D;
    for (int h = 0; h < H; h++) {
        float mx = -INFINITY, sum = 0.0f;
        for (int c = i; c < j; c++) {
            float mc = parts[c * per_task + h];
            if (mc > mx) mx = mc;
        }
        memset(acc + h * D, 0, sizeof(float) * D);
        for (int c = i; c < j; c++) {
            const float *p = parts + c * per_task;
            float w = expf(p[h] - mx);
            sum += p[H + h] * w;
            __m512 vw = _mm512_set1_ps(w);
            for (int e = 0; e < D; e += 16)
                _mm512_storeu_ps(acc + h * D + e,
                                 _mm512_fmadd_ps(_mm512_loadu_ps(p + 2 * H + h * D + e), vw,
                                                 _mm512_loadu_ps(acc + h * D + e)));
        }
        l[h] = sum;
    }
    pd_da_write(a, tasks[i].b, 0, H, l, acc);
}

/* Attention of num_seqs query tokens q [B, H, D] over their first seq_lens[b] cached
 * positions; out [B, H, D] contiguous, q's dtype (the cache's). dtype: 0 float32,
 * 1 bfloat16, 2 float16. block_tables int32 or int64 (tables64), seq_lens likewise
 * (lens64). D a multiple of 16 up to 256, H / KVH up to 16; the caller checks (and that
 * every page a sequence uses lies in the cache). k_new: NULL, or the new tokens' K/V to
 * store first (da_store_new). Returns 0, or -1 if the scratch could not be allocated. */
int pdserve_decode_attention(const void *q, int64_t q_s, int64_t q_h,
                             void *k_cache, void *v_cache, int block_size, int num_kv_heads,
                             int head_dim, const void *block_tables, int64_t bt_s,
                             int tables64, const void *seq_lens, int lens64, void *out,
                             int num_seqs, int num_heads, float scale, int dtype,
                             const void *k_new, int64_t kn_s, int64_t kn_h,
                             const void *v_new, int64_t vn_s, int64_t vn_h,
                             const int64_t *slots) {
    if (!pd_da_shape_ok(num_heads, num_kv_heads, head_dim)) return -2;
    const da_args a = {(const char *)q, q_s, q_h, (const char *)k_cache, (const char *)v_cache,
                       block_tables, bt_s, tables64, (char *)out, num_heads, num_kv_heads,
                       head_dim, block_size, dtype, scale};
    if (k_new)
        da_store_new(&a, num_seqs, k_new, kn_s, kn_h, v_new, vn_s, vn_h, slots);
    const int H = num_heads, D = head_dim, esize = dtype == DA_F32 ? 4 : 2;
    int parallel;
    const int split = pd_da_split(num_seqs, seq_lens, lens64, num_kv_heads,
                                  omp_get_max_threads(), &parallel);
    const int64_t per_task = (int64_t)H * (D + 2);  /* m, l, acc */
    const size_t ntasks = (size_t)num_seqs * split;
    char *scratch = malloc(ntasks * (sizeof(da_task) + per_task * sizeof(float)) +
                           ((size_t)num_seqs * H * D + (size_t)H * (D + 1)) * sizeof(float)
                           + 128);
    if (!scratch) return -1;
    float *parts = (float *)scratch;
    float *qf = parts + ntasks * per_task;
    uint16_t *qb = (uint16_t *)qf;  /* bfloat16 queries, in the same place */
    float *l = qf + (size_t)num_seqs * H * D, *acc = l + H;  /* combining chunks */
    da_task *tasks = (da_task *)(acc + (size_t)H * D);
    for (int b = 0; b < num_seqs; b++) {
        if (da_index(seq_lens, b, lens64) == 0) {  /* batch padding: zeros */
            memset((char *)out + (size_t)b * H * D * esize, 0, (size_t)H * D * esize);
            continue;
        }
        for (int h = 0; h < H; h++) {  /* the queries: bfloat16 as they are, else float32 */
            const char *qp = (const char *)q + (b * q_s + h * q_h) * esize;
            if (dtype == DA_BF16) {
                memcpy(qb + ((int64_t)b * H + h) * D, qp, (size_t)D * 2);
                continue;
            }
            for (int c = 0; c < D; c += 16)  /* scaled here; bfloat16's scores are scaled */
                _mm512_storeu_ps(qf + ((int64_t)b * H + h) * D + c,
                                 _mm512_mul_ps(da_load(qp + c * esize, dtype),
                                               _mm512_set1_ps(scale)));
        }
    }
    const int count = pd_da_tasks(num_seqs, seq_lens, lens64, split, tasks);
    const int whole = split == 1;
#pragma omp parallel for schedule(dynamic, 1) if (parallel)
    for (int i = 0; i < count; i++) {
        const da_task *tk = &tasks[i];
        float *p = parts + i * per_task;
        pd_da_run(&a, tk, 0, num_kv_heads, qf + (int64_t)tk->b * H * D,
                  qb + (int64_t)tk->b * H * D, p, p + H, p + 2 * H);
        if (whole) pd_da_write(&a, tk->b, 0, H, p + H, p + 2 * H);
    }
    if (!whole)  /* combine each sequence's chunks (consecutive tasks) */
        for (int i = 0, j; i < count; i = j) {
            for (j = i; j < count && tasks[j].b == tasks[i].b; j++) {}
            pd_da_combine(&a, tasks, i, j, parts, per_task, l, acc);
        }
    free(scratch);
    return 0;
}
