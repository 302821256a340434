/* Causal attention of prompts on AVX512-BF16 (kernels/attention_prefill.py's CPU path for
 * bfloat16): sequences' new tokens packed back to back, the query at position p attending
 * to its sequence's keys 0..p, which are the new tokens themselves (a fresh prompt) or
 * its pages of the KV cache (a chunk after a cached prefix).
 *
 * Flash-style: a panel of R query rows walks the key blocks of BN keys up to its last
 * query's position, keeping a running max m, sum l and output O in float32 (online
 * softmax); blocks wholly above the diagonal are never touched. Both products run on
 * _mm512_dpbf16_ps (bf16 pairs, float32 accumulation):
 *     S = Q.K^T: lane n of a vector is key n, K packed per block as [D/2][BN][2] so a
 *                broadcast pair q[2j], q[2j+1] times one vector gives 16 keys' partial dots;
 *     O += P.V:  lane d is a head dimension, V packed per key pair as [D][2] so a broadcast
 *                pair p[2i], p[2i+1] times one vector adds two keys to 16 dimensions.
 * The products are exact in float32 and summed in float32; the softmax is float32 (exp2
 * by a degree-6 polynomial, relative error ~2e-7). The one rounding beyond torch's float32
 * path is P to bfloat16 before P.V (p_bf16 = 1); p_bf16 = 0 keeps P.V in float32 FMAs
 * over V widened to float32 (25-35% more time in all, a third less mean error; both in
 * benchmarks/RESULTS.md). A row's arithmetic does not depend on the other rows of its
 * panel (a block wholly masked for it leaves its m, l and O as they were, bit for bit), so
 * a prompt prefilled in chunks gets the bits it gets in one piece.
 *
 * GQA: a work item is one sequence's tile of BM query tokens times the GROUP query heads
 * that share a KV head, rows ordered token-major (row = token * GROUP + head), so every
 * K/V block is read once per panel for all heads of the group. Work items are handed out
 * largest first (a tile's cost grows with its position) for the causal load balance.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "native.h"

#define BN 64           /* keys per block: 4 vectors of 16 */
#define BM 32           /* query tokens per work item */
#define R_MAX 6         /* query rows per panel: 6 x 4 float32 accumulators + 4 loads */

typedef struct { int seq, kvh, tile, cost; } item_t;

static inline __m512 exp2_ps(__m512 x) {
    /* 2^x = 2^n * 2^f, n = round(x), f in [-0.5, 0.5]: Taylor to degree 6 (error < 2e-7).
     * x below -126 (masked or negligible scores) comes out as 2^-126, which the callers
     * zero by mask or which vanishes against the row's 2^0. */
    x = _mm512_max_ps(x, _mm512_set1_ps(-126.0f));
    __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_sub_ps(x, n);
    __m512 p = _mm512_set1_ps(1.5403530393381606e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

static inline __m512 bcast_pair(const uint16_t *p) {
    int32_t two;
    memcpy(&two, p, 4);
    return _mm512_castsi512_ps(_mm512_set1_epi32(two));
}

#define DP(acc, a, b) nat_dpbf16(acc, a, b)

/* o[r][d0 .. d0 + 16 NV) = o * alpha[r] + P.V over key block b, R and NV constants at
 * each call site: the R x NV accumulators stay in registers. */
static inline __attribute__((always_inline)) void pv(
        float *o, const float *alpha, const int R, const int NV, int d0, int D, int b,
        int p_bf16, const uint16_t *pbuf, const uint16_t *vp, const float *pf, const float *vf) {
    __m512 acc[R_MAX][4];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < NV; j++)
            acc[r][j] = _mm512_mul_ps(_mm512_loadu_ps(o + r * D + d0 + 16 * j),
                                      _mm512_set1_ps(alpha[r]));
    if (p_bf16) {
        const uint16_t *vb = vp + (size_t)b * BN * D + 2 * d0;
        for (int i = 0; i < BN / 2; i++) {
            const uint16_t *vv = vb + (size_t)i * 2 * D;
            __m512 v[4];
            for (int j = 0; j < NV; j++) v[j] = _mm512_loadu_ps(vv + 32 * j);
            for (int r = 0; r < R; r++) {
                __m512 pp = bcast_pair(pbuf + r * BN + 2 * i);
                for (int j = 0; j < NV; j++) acc[r][j] = DP(acc[r][j], pp, v[j]);
            }
        }
    } else {
        const float *vb = vf + (size_t)b * BN * D + d0;
        for (int n = 0; n < BN; n++) {
            __m512 v[4];
            for (int j = 0; j < NV; j++) v[j] = _mm512_loadu_ps(vb + (size_t)n * D + 16 * j);
            for (int r = 0; r < R; r++) {
                __m512 pp = _mm512_set1_ps(pf[r * BN + n]);
                for (int j = 0; j < NV; j++) acc[r][j] = _mm512_fmadd_ps(pp, v[j], acc[r][j]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int j = 0; j < NV; j++) _mm512_storeu_ps(o + r * D + d0 + 16 * j, acc[r][j]);
}

/* One panel of R rows (R a constant at each call site: the accumulators stay in registers)
 * over key blocks 0..nblocks-1 of one sequence and KV head. */
static inline __attribute__((always_inline)) void panel(
        const uint16_t *const *qrow, const int *pos, uint16_t *const *orow, const int R,
        const uint16_t *kp, const uint16_t *vp, const float *vf, int D, float c,
        int p_bf16, float *o, uint16_t *pbuf, float *pf) {
    float m[R_MAX];
    __m512 l[R_MAX];
    for (int r = 0; r < R; r++) {
        m[r] = -INFINITY;
        l[r] = _mm512_setzero_ps();
    }
    memset(o, 0, sizeof(float) * R * D);
    const int nblocks = pos[R - 1] / BN + 1;
    for (int b = 0; b < nblocks; b++) {
        /* S = Q.K^T for keys b*BN .. b*BN + 63 */
        const uint16_t *kb = kp + (size_t)b * BN * D;
        __m512 s[R_MAX][4];
        for (int r = 0; r < R; r++)
            for (int j = 0; j < 4; j++) s[r][j] = _mm512_setzero_ps();
        for (int i = 0; i < D / 2; i++) {
            const uint16_t *kk = kb + (size_t)i * 2 * BN;
            __m512 k0 = _mm512_loadu_ps(kk), k1 = _mm512_loadu_ps(kk + 32),
                   k2 = _mm512_loadu_ps(kk + 64), k3 = _mm512_loadu_ps(kk + 96);
            for (int r = 0; r < R; r++) {
                __m512 qq = bcast_pair(qrow[r] + 2 * i);
                s[r][0] = DP(s[r][0], qq, k0);
                s[r][1] = DP(s[r][1], qq, k1);
                s[r][2] = DP(s[r][2], qq, k2);
                s[r][3] = DP(s[r][3], qq, k3);
            }
        }
        /* online softmax in base 2: c = scale * log2(e) */
        const int diagonal = b * BN + BN - 1 > pos[0];
        float alpha[R_MAX];
        for (int r = 0; r < R; r++) {
            __mmask16 vis[4] = {0xFFFF, 0xFFFF, 0xFFFF, 0xFFFF};
            for (int j = 0; j < 4; j++) s[r][j] = _mm512_mul_ps(s[r][j], _mm512_set1_ps(c));
            if (diagonal) {
                /* key n visible iff n <= pos: lanes 0 .. pos - first key of the vector */
                for (int j = 0; j < 4; j++) {
                    int last = pos[r] - (b * BN + 16 * j);
                    vis[j] = last >= 15 ? 0xFFFF : last < 0 ? 0 : (__mmask16)((2u << last) - 1);
                    s[r][j] = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), vis[j], s[r][j]);
                }
            }
            float mx = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(s[r][0], s[r][1]),
                                                          _mm512_max_ps(s[r][2], s[r][3])));
            float mnew = mx > m[r] ? mx : m[r];     /* finite: key 0 is in block 0 */
            /* 1 while the max stands (most blocks after the first), ~0 on the first block */
            alpha[r] = mnew == m[r] ? 1.0f
                       : _mm512_cvtss_f32(exp2_ps(_mm512_set1_ps(m[r] - mnew)));
            m[r] = mnew;
            __m512 vm = _mm512_set1_ps(mnew), sum = _mm512_setzero_ps();
            for (int j = 0; j < 4; j++) {
                s[r][j] = _mm512_maskz_mov_ps(vis[j], exp2_ps(_mm512_sub_ps(s[r][j], vm)));
                sum = _mm512_add_ps(sum, s[r][j]);
            }
            l[r] = _mm512_fmadd_ps(l[r], _mm512_set1_ps(alpha[r]), sum);
            if (p_bf16) {
                _mm512_storeu_si512(pbuf + r * BN,
                                    nat_bf16_pairs(s[r][1], s[r][0]));
                _mm512_storeu_si512(pbuf + r * BN + 32,
                                    nat_bf16_pairs(s[r][3], s[r][2]));
            } else {
                for (int j = 0; j < 4; j++) _mm512_storeu_ps(pf + r * BN + 16 * j, s[r][j]);
            }
        }
        /* O = O * alpha + P.V, 64 dimensions (4 vectors) at a time */
        int d0 = 0;
        for (; d0 + 64 <= D; d0 += 64)
            pv(o, alpha, R, 4, d0, D, b, p_bf16, pbuf, vp, pf, vf);
        switch ((D - d0) / 16) {
        case 3: pv(o, alpha, R, 3, d0, D, b, p_bf16, pbuf, vp, pf, vf); break;
        case 2: pv(o, alpha, R, 2, d0, D, b, p_bf16, pbuf, vp, pf, vf); break;
        case 1: pv(o, alpha, R, 1, d0, D, b, p_bf16, pbuf, vp, pf, vf); break;
        }
    }
    for (int r = 0; r < R; r++) {
        __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(l[r]));
        for (int d = 0; d < D; d += 16)
            _mm256_storeu_si256((__m256i *)(orow[r] + d),
                                (__m256i)_mm512_cvtneps_pbh(
                                    _mm512_mul_ps(_mm512_loadu_ps(o + r * D + d), inv)));
    }
}

static void panel_any(const uint16_t *const *qrow, const int *pos, uint16_t *const *orow, int R,
                      const uint16_t *kp, const uint16_t *vp, const float *vf, int D, float c,
                      int p_bf16, float *o, uint16_t *pbuf, float *pf) {
    switch (R) {
    case 6: panel(qrow, pos, orow, 6, kp, vp, vf, D, c, p_bf16, o, pbuf, pf); break;
    case 5: panel(qrow, pos, orow, 5, kp, vp, vf, D, c, p_bf16, o, pbuf, pf); break;
    case 4: panel(qrow, pos, orow, 4, kp, vp, vf, D, c, p_bf16, o, pbuf, pf); break;
    case 3: panel(qrow, pos, orow, 3, kp, vp, vf, D, c, p_bf16, o, pbuf, pf); break;
    case 2: panel(qrow, pos, orow, 2, kp, vp, vf, D, c, p_bf16, o, pbuf, pf); break;
    default: panel(qrow, pos, orow, 1, kp, vp, vf, D, c, p_bf16, o, pbuf, pf); break;
    }
}

static int cmp_cost(const void *a, const void *b) {
    return ((const item_t *)b)->cost - ((const item_t *)a)->cost;
}

/* Where one sequence's keys are: token rows from ``first`` (a fresh prompt), or pages. */
typedef struct {
    int64_t first;              /* fresh: the sequence's first token row */
    const int64_t *table;       /* paged: its block table row, else NULL */
    int block_size;
} keys_t;

static inline int64_t key_row(const keys_t *kr, int n) {
    if (!kr->table) return kr->first + n;
    return pd_kv_slot(kr->table[n / kr->block_size], n, kr->block_size);
}

/* K of one sequence and KV head (k, v: that head's column), keys n of block b →
 * kp[b][D/2][BN][2]; keys past len 0. V → vp[key pair][D][2] (p_bf16) or vf[key][D]
 * float32. */
static void pack_block(const uint16_t *k, const uint16_t *v, int64_t sk, int64_t sv,
                       const keys_t *kr, int len, int b, int D, int p_bf16, uint16_t *kp,
                       uint16_t *vp, float *vf) {
    uint32_t *kb = (uint32_t *)(kp + (size_t)b * BN * D);
    for (int n = 0; n < BN; n++) {
        int key = b * BN + n;
        if (key < len) {
            const uint32_t *row = (const uint32_t *)(k + key_row(kr, key) * sk);
            for (int i = 0; i < D / 2; i++) kb[i * BN + n] = row[i];
        } else {
            for (int i = 0; i < D / 2; i++) kb[i * BN + n] = 0;
        }
    }
    if (p_bf16) {
        for (int n = 0; n < BN; n += 2) {
            int key = b * BN + n;
            uint16_t *dst = vp + ((size_t)b * BN + n) * D;
            for (int d = 0; d < D; d += 16) {
                __m512i lo = _mm512_setzero_si512(), hi = _mm512_setzero_si512();
                if (key < len)
                    lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256(
                        (const __m256i *)(v + key_row(kr, key) * sv + d)));
                if (key + 1 < len)
                    hi = _mm512_cvtepu16_epi32(_mm256_loadu_si256(
                        (const __m256i *)(v + key_row(kr, key + 1) * sv + d)));
                _mm512_storeu_si512(dst + 2 * d, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
            }
        }
    } else {
        for (int n = 0; n < BN; n++) {
            int key = b * BN + n;
            float *dst = vf + ((size_t)b * BN + n) * D;
            for (int d = 0; d < D; d += 16) {
                __m512i u = _mm512_setzero_si512();
                if (key < len)
                    u = _mm512_cvtepu16_epi32(_mm256_loadu_si256(
                        (const __m256i *)(v + key_row(kr, key) * sv + d)));
                _mm512_storeu_ps(dst + d, _mm512_castsi512_ps(_mm512_slli_epi32(u, 16)));
            }
        }
    }
}

/* out = causal attention of each sequence's new queries over its keys, all bfloat16.
 * q [T, H, D] with strides (sqt, sqh) in elements, unit stride along D, likewise out; the
 * queries of sequence s are rows cu[s] .. cu[s + 1] - 1 (cu int64 [num_seqs + 1]).
 * Fresh prompts (kv_lens NULL): k/v [T, KVH, D], strides (skt, skh), (svt, svh); sequence
 * s's keys are its queries' rows. Paged (kv_lens int64 [num_seqs]): k/v are the caches
 * [num_blocks, block_size, KVH, D] contiguous, (skt, skh) = (KVH D, D), token n of
 * sequence s at page tables[s * table_stride + n / block_size]; its q_len queries are the
 * last of its kv_lens[s] tokens. The caller has checked every length and page index.
 * D a multiple of 16, at most 256; H a multiple of KVH. scale: the softmax's. Threads:
 * OpenMP's default for the calling thread (torch's). Returns 0, or -1 if the scratch could
 * not be allocated. */
int bf16_prefill_attention(const uint16_t *q, int64_t sqt, int64_t sqh, const uint16_t *k,
                           int64_t skt, int64_t skh, const uint16_t *v, int64_t svt,
                           int64_t svh, uint16_t *out, int64_t sot, int64_t soh,
                           const int64_t *cu, int num_seqs, const int64_t *kv_lens,
                           const int64_t *tables, int64_t table_stride, int block_size,
                           int H, int KVH, int D, float scale, int p_bf16) {
    const int G = H / KVH;
    const float c = scale * 1.4426950408889634f;
#define KV_LEN(s) (kv_lens ? (int)kv_lens[s] : (int)(cu[(s) + 1] - cu[s]))
    /* per sequence: first padded key block, so packed K/V of (seq, kvh) start at
     * ((blk0[s] * KVH + kvh * blocks of s) * BN) keys */
    int *blk0 = malloc(sizeof(int) * (num_seqs + 1));
    if (!blk0) return -1;
    int num_items = 0;
    blk0[0] = 0;
    for (int s = 0; s < num_seqs; s++) {
        int q_len = (int)(cu[s + 1] - cu[s]);
        blk0[s + 1] = blk0[s] + (q_len ? (KV_LEN(s) + BN - 1) / BN : 0);
        num_items += KVH * ((q_len + BM - 1) / BM);
    }
    const size_t keys = (size_t)blk0[num_seqs] * KVH * BN;
    item_t *items = malloc(sizeof(item_t) * (num_items + 1));
    uint16_t *kp = aligned_alloc(64, keys * D * 2 + 64);
    void *vbuf = aligned_alloc(64, keys * D * (p_bf16 ? 2 : 4) + 64);
    if (!items || !kp || !vbuf) {
        free(blk0); free(items); free(kp); free(vbuf);
        return -1;
    }
    uint16_t *vp = vbuf;
    float *vf = vbuf;
    int n = 0;
    for (int s = 0; s < num_seqs; s++) {
        int q_len = (int)(cu[s + 1] - cu[s]), past = KV_LEN(s) - q_len;
        for (int t = 0; t < (q_len + BM - 1) / BM; t++)
            for (int h = 0; h < KVH; h++)
                items[n++] = (item_t){s, h, t, past + t * BM + BM};
    }
    qsort(items, num_items, sizeof(item_t), cmp_cost);
    const int num_blocks = blk0[num_seqs] * KVH;
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int i = 0; i < num_blocks; i++) {
            /* (block index over all sequences) x kvh → sequence by search */
            int h = i % KVH, bb = i / KVH, s = 0;
            while (blk0[s + 1] <= bb) s++;
            const keys_t kr = {cu[s], tables ? tables + s * table_stride : NULL, block_size};
            size_t base = ((size_t)blk0[s] * KVH + (size_t)h * (blk0[s + 1] - blk0[s])) * BN;
            pack_block(k + h * skh, v + h * svh, skt, svt, &kr, KV_LEN(s), bb - blk0[s], D,
                       p_bf16, kp + base * D, vp + base * D, vf + base * D);
        }
        float o[R_MAX * 256];
        uint16_t pbuf[R_MAX * BN];
        float pf[R_MAX * BN];
#pragma omp for schedule(dynamic, 1)
        for (int it = 0; it < num_items; it++) {
            const item_t w = items[it];
            const int s = w.seq, q_len = (int)(cu[s + 1] - cu[s]), past = KV_LEN(s) - q_len;
            const size_t base = ((size_t)blk0[s] * KVH + (size_t)w.kvh * (blk0[s + 1] - blk0[s]))
                                * BN;
            const int t0 = w.tile * BM, t1 = t0 + BM < q_len ? t0 + BM : q_len;
            const int rows = (t1 - t0) * G;
            for (int r0 = 0; r0 < rows; r0 += R_MAX) {
                const int R = rows - r0 < R_MAX ? rows - r0 : R_MAX;
                const uint16_t *qrow[R_MAX];
                uint16_t *orow[R_MAX];
                int pos[R_MAX];
                for (int r = 0; r < R; r++) {
                    int tok = t0 + (r0 + r) / G, h = w.kvh * G + (r0 + r) % G;
                    pos[r] = past + tok;
                    qrow[r] = q + (cu[s] + tok) * sqt + h * sqh;
                    orow[r] = out + (cu[s] + tok) * sot + h * soh;
                }
                panel_any(qrow, pos, orow, R, kp + base * D, vp + base * D, vf + base * D, D,
                          c, p_bf16, o, pbuf, pf);
            }
        }
    }
#undef KV_LEN
    free(blk0); free(items); free(kp); free(vbuf);
    return 0;
}
