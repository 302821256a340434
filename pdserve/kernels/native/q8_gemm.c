/* Q8_0 weights x int8 activations on AVX512-VNNI for the LM head (model/q8_head.py), and
 * the embedding lookup over the same bytes: llama.cpp's Q8_0 x Q8_0 dot product laid out
 * for a GEMM, as int4_gemm.c lays out Q4_1 x Q8_1.
 *
 * Weights w[n, k] = d[n, g] * q[n, k], g = k / 32, q int8, d float16 (GGUF's Q8_0).
 * Activations are quantized per call, per row and group of 32: xq = round(x * 127 / amax),
 * sx = amax / 127. Then
 *     out[r, n] = sum_g d[n, g] * sx[r, g] * dot(q[n, g], xq[r, g]),
 * the dot exact in int32, the scales applied in float32.
 *
 * vpdpbusd multiplies unsigned by signed bytes. The weights are stored as u = q + 128
 * (q ^ 0x80), the activations stay signed: dot(u, xq) = dot(q, xq) + 128 * sum(xq), and the
 * correction -128 * sum(xq[r, g]) is where each row's int32 sum starts, so it costs one
 * broadcast per row and group and no weight bytes (the other way, xq + 128 against signed
 * weights, would need a per-output sum of q stored beside the weights).
 *
 * One 512-bit int32 lane per output n: a block of 16 outputs x one group is eight vectors
 * w_j (j = 0..7), lane n holding u[n, 4j .. 4j + 3]; _mm512_dpbusd_epi32 with the row's 4
 * activations at 4j broadcast gives 16 outputs' partial dots at once, no horizontal sums.
 * Stored per block of 16 outputs, per group, 544 bytes, one stream per block:
 *     512 bytes: u, vector j at 64 j, lane n of it at 64 j + 4 n
 *      32 bytes: d, 16 float16
 * (8.5 bits a weight, as the file stores it.) A vocabulary not a multiple of 16 is padded
 * with zero rows at packing; outputs past N are never written.
 *
 * The quantized activations are laid out per tile of rows (q8_quantize_rows), so that a
 * tile reads them from one pointer at constant offsets: with a pointer per row, 8 rows'
 * pointers spilled to the stack, and 8-64 rows took 1.07-1.18 times as long.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "native.h"

#define GROUP 32
#define NB 16
#define BLOCK_BYTES 544
#define D_OFFSET 512
#define MAX_TILE 8
/* Software prefetch, bytes ahead in a block stream (0: none). On AVX2 (a Zen 3 EPYC) the
 * head's stream of ~30 MB read faster with it: the batch-1 decode step 0.87 times as long
 * at 16 blocks ahead, 0.91 at 8, 0.94 at 32, 0.93 at 64 (RESULTS.md). Not measured on
 * AVX-512, whose int4 GEMM found the hardware's prefetchers enough at one row. */
#ifndef Q8_PREFETCH
#ifdef PD_AVX512_EMULATED
#define Q8_PREFETCH (16 * BLOCK_BYTES)
#else
#define Q8_PREFETCH 0
#endif
#endif

/* The rows r0 .. r0 + MT - 1 one tile takes: tiles of 8 rows, then one of 4, 2 and 1 as M's
 * remainder has those bits (q8_mm's order). */
static inline void q8_tile_of(int r, int M, int *r0, int *mt) {
    const int full = M & ~7;
    if (r < full) {
        *r0 = r & ~7, *mt = 8;
        return;
    }
    int start = full;
    for (int size = 4; size >= 1; size >>= 1)
        if ((M - full) & size) {
            if (r < start + size) {
                *r0 = start, *mt = size;
                return;
            }
            start += size;
        }
}

/* x [M, K] (bfloat16 or float32) -> xq int8, sx float32 and corr int32 (-128 * the sum of
 * a group's xq) laid out per tile of MT rows from row r0, so that a tile reads each from one
 * pointer at constant offsets: xq + r0 * K holds [G][8 j][MT rows][4], sx + r0 * G and
 * corr + r0 * G hold [G][MT rows]. */
static void q8_quantize_rows(const void *x, int x_bf16, int M, int K, int8_t *xq, float *sx,
                             int32_t *corr) {
    const int G = K / GROUP, size = x_bf16 ? 2 : 4;
    const __m512 sign = _mm512_set1_ps(-0.0f);
    for (int r = 0; r < M; r++) {
        int r0, mt;
        q8_tile_of(r, M, &r0, &mt);
        const int lane = r - r0;
        int8_t *xt = xq + (size_t)r0 * K;
        for (int g = 0; g < G; g++) {
            const char *p = (const char *)x + ((size_t)r * K + (size_t)g * GROUP) * size;
            __m512 a = nat_load16(p, x_bf16), b = nat_load16(p + 16 * size, x_bf16);
            float amax = _mm512_reduce_max_ps(
                _mm512_max_ps(_mm512_andnot_ps(sign, a), _mm512_andnot_ps(sign, b)));
            /* below 1e-30 the group is zeros (127 / amax would overflow from 3.7e-37) */
            float id = amax > 1e-30f ? 127.0f / amax : 0.0f;
            __m512 vid = _mm512_set1_ps(id);
            /* round half to even (MXCSR's default), as torch.round in the reference */
            __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, vid));
            __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, vid));
            int8_t q[GROUP];
            _mm_storeu_si128((__m128i *)q, _mm512_cvtsepi32_epi8(qa));
            _mm_storeu_si128((__m128i *)(q + 16), _mm512_cvtsepi32_epi8(qb));
            for (int j = 0; j < 8; j++)
                memcpy(xt + (((size_t)g * 8 + j) * mt + lane) * 4, q + 4 * j, 4);
            /* the correction from the bytes as stored (saturated): a NaN converts to
             * INT_MIN, which must not reach the sum; a group holding a NaN or an infinity
             * gets a NaN scale instead, so its logits are NaN as torch's head makes them */
            int32_t sum = 0;
            for (int j = 0; j < GROUP; j++)
                sum += q[j];
            float total = _mm512_reduce_add_ps(_mm512_add_ps(a, b));
            sx[(size_t)r0 * G + (size_t)g * mt + lane] =
                isfinite(total) ? amax / 127.0f : NAN;
            corr[(size_t)r0 * G + (size_t)g * mt + lane] = -128 * sum;
        }
    }
}

#if defined(PD_AVX512_EMULATED) && AVX2_DOTS
/* A group's int32 dots on AVX2: the same integers as corr plus the dpbusd chains, the sum
 * of q x (the activations), by the signed weights q = u - 128 (u ^ 0x80) instead: vpmaddubsw
 * of |q| and the activations given q's sign cannot saturate (|q| <= 128, and the
 * activations, rounded from at most 127 times their scale, |x| <= 127), against the 7
 * instructions a row of an exact emulated dpbusd. p: the group's packed weights, xg: its
 * activations as q8_quantize_rows lays them out. */
static inline __attribute__((always_inline)) void q8_dots_avx2(
        const uint8_t *p, const int8_t *xg, const int MT, __m512i *s) {
    const __m256i flip = _mm256_set1_epi8((char)0x80), ones = _mm256_set1_epi16(1);
    __m256i t[2][MAX_TILE];
    for (int h = 0; h < 2; h++) {  /* a half at a time: MT accumulators, not 2 MT, in the
                                    * 16 registers */
        for (int r = 0; r < MT; r++) t[h][r] = _mm256_setzero_si256();
        for (int j = 0; j < 8; j++) {
            const __m256i q = _mm256_xor_si256(
                _mm256_loadu_si256((const __m256i *)(p + 64 * j + 32 * h)), flip);
            const __m256i mag = _mm256_abs_epi8(q);
            for (int r = 0; r < MT; r++) {
                int32_t four;
                memcpy(&four, xg + (j * MT + r) * 4, 4);
                const __m256i x = _mm256_sign_epi8(_mm256_set1_epi32(four), q);
                t[h][r] = _mm256_add_epi32(t[h][r],
                                           _mm256_madd_epi16(_mm256_maddubs_epi16(mag, x), ones));
            }
        }
    }
    for (int r = 0; r < MT; r++) s[r] = pd_si(t[0][r], t[1][r]);
}
#endif

/* MT rows x one block of 16 outputs over all groups, the rows' activations as
 * q8_quantize_rows lays out a tile; MT is a constant at each call site, so the accumulators
 * live in registers (8 rows: 8 float + 8 int32 accumulators + the weight vectors + the
 * scales). ``mask``: which of the 16 outputs exist (the padded tail). */
static inline __attribute__((always_inline)) void q8_tile(
        const uint8_t *wb, int G, const int8_t *xq, const float *sx, const int32_t *corr,
        const int MT, float *out, size_t N, __mmask16 mask) {
    __m512 acc[MAX_TILE];
    for (int r = 0; r < MT; r++) acc[r] = _mm512_setzero_ps();
    for (int g = 0; g < G; g++) {
        const uint8_t *p = wb + (size_t)g * BLOCK_BYTES;
        const int8_t *xg = xq + (size_t)g * 32 * MT;
#if Q8_PREFETCH
        for (int c = 0; c < BLOCK_BYTES; c += 64)
            _mm_prefetch((const char *)p + Q8_PREFETCH + c, _MM_HINT_T0);
#endif
        __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + D_OFFSET)));
        __m512i s[MAX_TILE];
#if defined(PD_AVX512_EMULATED) && AVX2_DOTS
        q8_dots_avx2(p, xg, MT, s);
#else
        /* rows innermost: MT independent dpbusd chains in flight */
        for (int r = 0; r < MT; r++) s[r] = _mm512_set1_epi32(corr[g * MT + r]);
        for (int j = 0; j < 8; j++) {
            const __m512i w = _mm512_loadu_si512(p + 64 * j);
            for (int r = 0; r < MT; r++) {
                int32_t four;
                memcpy(&four, xg + (j * MT + r) * 4, 4);
                s[r] = _mm512_dpbusd_epi32(s[r], w, _mm512_set1_epi32(four));
            }
        }
#endif
        for (int r = 0; r < MT; r++) {
            __m512 dx = _mm512_mul_ps(d, _mm512_set1_ps(sx[g * MT + r]));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[r]), dx, acc[r]);
        }
    }
    for (int r = 0; r < MT; r++) _mm512_mask_storeu_ps(out + r * N, mask, acc[r]);
}

/* out float32 [M, N] = x [M, K] @ w.T, w packed as above ([ceil(N / 16), K / 32, 544]
 * bytes). K a multiple of 32. Threads: OpenMP's default for the calling thread (torch's,
 * when torch loaded the same libgomp). Returns 0, or -1 if the scratch could not be
 * allocated. */
int q8_mm(const void *x, int x_bf16, int M, int K, int N, const uint8_t *w, float *out) {
    const int G = K / GROUP, blocks = (N + NB - 1) / NB;
    char *scratch = malloc((size_t)M * K + 2 * sizeof(float) * (size_t)M * G + 64);
    if (!scratch) return -1;
    float *sx = (float *)scratch;
    int32_t *corr = (int32_t *)(sx + (size_t)M * G);
    int8_t *xq = (int8_t *)(corr + (size_t)M * G);
    q8_quantize_rows(x, x_bf16, M, K, xq, sx, corr);
#pragma omp parallel for schedule(static)
    for (int nb = 0; nb < blocks; nb++) {
        const uint8_t *wb = w + (size_t)nb * G * BLOCK_BYTES;
        const int valid = N - nb * NB < NB ? N - nb * NB : NB;
        const __mmask16 mask = (__mmask16)((1u << valid) - 1);
        float *o = out + (size_t)nb * NB;
        int r = 0;
        for (; r + 8 <= M; r += 8)
            q8_tile(wb, G, xq + (size_t)r * K, sx + r * G, corr + r * G, 8, o + (size_t)r * N,
                    N, mask);
        if (r + 4 <= M) {
            q8_tile(wb, G, xq + (size_t)r * K, sx + r * G, corr + r * G, 4, o + (size_t)r * N,
                    N, mask);
            r += 4;
        }
        if (r + 2 <= M) {
            q8_tile(wb, G, xq + (size_t)r * K, sx + r * G, corr + r * G, 2, o + (size_t)r * N,
                    N, mask);
            r += 2;
        }
        if (r < M)
            q8_tile(wb, G, xq + (size_t)r * K, sx + r * G, corr + r * G, 1, o + (size_t)r * N,
                    N, mask);
    }
    free(scratch);
    return 0;
}

/* decode_step.c's pieces: quantize M rows once (xq [M * K], sx and corr [M * K / 32]), then
 * per block of 16 outputs in [nb0, nb1) the same logits q8_mm computes, folded into each
 * row's largest and its index (the first on ties, as torch's max gives): best[r], at[r]
 * hold the running result (start: -inf and INT64_MAX) and are updated in place, blocks
 * taken in any order.
 * A NaN logit sets at[r] to -1 for good: the caller then takes the logits the long way
 * (torch's max puts a NaN first; this does not try to). */
void pd_q8_quantize(const void *x, int x_bf16, int M, int K, int8_t *xq, float *sx,
                    int32_t *corr) {
    q8_quantize_rows(x, x_bf16, M, K, xq, sx, corr);
}

static inline __attribute__((always_inline)) void q8_best_of_tile(
        const float *tile, const int MT, int r0, int nb, __mmask16 mask, float *best,
        int64_t *at) {
    for (int r = 0; r < MT; r++) {
        if (at[r0 + r] < 0) continue;
        const __m512 v = _mm512_loadu_ps(tile + r * NB);
        if (_mm512_mask_cmp_ps_mask(mask, v, v, _CMP_UNORD_Q)) {
            at[r0 + r] = -1;
            continue;
        }
        const float mx = _mm512_mask_reduce_max_ps(mask, v);
        if (mx >= best[r0 + r]) {
            const __mmask16 eq = _mm512_mask_cmp_ps_mask(mask, v, _mm512_set1_ps(mx), _CMP_EQ_OQ);
            const int64_t i = (int64_t)nb * NB + __builtin_ctz((unsigned)eq);
            if (mx > best[r0 + r] || i < at[r0 + r]) best[r0 + r] = mx, at[r0 + r] = i;
        }
    }
}

void pd_q8_argmax_blocks(const uint8_t *w, int K, int N, int nb0, int nb1, const int8_t *xq,
                         const float *sx, const int32_t *corr, int M, float *best,
                         int64_t *at) {
    const int G = K / GROUP;
    float tile[MAX_TILE * NB];
    for (int nb = nb0; nb < nb1; nb++) {
        const uint8_t *wb = w + (size_t)nb * G * BLOCK_BYTES;
        const int valid = N - nb * NB < NB ? N - nb * NB : NB;
        const __mmask16 mask = (__mmask16)((1u << valid) - 1);
        int r = 0;
        for (; r + 8 <= M; r += 8) {
            q8_tile(wb, G, xq + (size_t)r * K, sx + r * G, corr + r * G, 8, tile, NB, mask);
            q8_best_of_tile(tile, 8, r, nb, mask, best, at);
        }
        if (r + 4 <= M) {
            q8_tile(wb, G, xq + (size_t)r * K, sx + r * G, corr + r * G, 4, tile, NB, mask);
            q8_best_of_tile(tile, 4, r, nb, mask, best, at);
            r += 4;
        }
        if (r + 2 <= M) {
            q8_tile(wb, G, xq + (size_t)r * K, sx + r * G, corr + r * G, 2, tile, NB, mask);
            q8_best_of_tile(tile, 2, r, nb, mask, best, at);
            r += 2;
        }
        if (r < M) {
            q8_tile(wb, G, xq + (size_t)r * K, sx + r * G, corr + r * G, 1, tile, NB, mask);
            q8_best_of_tile(tile, 1, r, nb, mask, best, at);
        }
    }
}

/* The embedding lookup: out [count, K] = rows ids of w, each weight d * q formed in float32
 * (exact) and stored as float32 or bfloat16 (rounded once, to nearest even: the value a
 * model dequantized to bfloat16 at load holds). Returns 0, or the index + 1 of the first id
 * outside 0 .. N - 1 (nothing is read for it). */
int q8_rows(const uint8_t *w, int K, int N, const int64_t *ids, int count, void *out,
            int out_bf16) {
    const int G = K / GROUP, size = out_bf16 ? 2 : 4;
    for (int i = 0; i < count; i++)
        if (ids[i] < 0 || ids[i] >= N) return i + 1;
#pragma omp parallel for schedule(static) if (count >= 64)
    for (int i = 0; i < count; i++) {
        const int64_t n = ids[i];
        const int lane = (int)(n % NB);
        const uint8_t *wb = w + (size_t)(n / NB) * G * BLOCK_BYTES;
        char *o = (char *)out + (size_t)i * K * size;
        for (int g = 0; g < G; g++) {
            const uint8_t *p = wb + (size_t)g * BLOCK_BYTES;
            uint16_t half;
            memcpy(&half, p + D_OFFSET + 2 * lane, 2);
            const __m512 d = _mm512_set1_ps(_cvtsh_ss(half));
            /* the row's 32 bytes: 4 at 64 j + 4 lane for j = 0..7 */
            uint8_t u[GROUP];
            for (int j = 0; j < 8; j++) memcpy(u + 4 * j, p + 64 * j + 4 * lane, 4);
            const __m128i flip = _mm_set1_epi8((char)0x80);
            for (int h = 0; h < 2; h++) {
                __m128i q = _mm_xor_si128(_mm_loadu_si128((const __m128i *)(u + 16 * h)), flip);
                __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), d);
                nat_store16(o + ((size_t)g * GROUP + 16 * h) * size, v, out_bf16);
            }
        }
    }
    return 0;
}
