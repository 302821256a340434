/* int4 weights x int8 activations on AVX512-VNNI (model/quant.py's Int4Linear at a decode
 * step's rows): llama.cpp's Q4_1 x Q8_1 dot product laid out for a GEMM.
 *
 * Weights w[n, k] = d[n, g] * q[n, k] + m[n, g], g = k / 32, q in 0..15, d and m float16.
 * Activations are quantized per call, per row and group of 32: xq = round(x * 127 / amax),
 * sx = amax / 127, sumx = the float sum of x. Then
 *     out[r, n] = sum_g d[n, g] * sx[r, g] * dot(q[n, g], xq[r, g]) + m[n, g] * sumx[r, g].
 *
 * One 512-bit int32 lane per output n: a block of 16 outputs x one group is eight vectors
 * w_j (j = 0..7), lane n holding q[n, 4j .. 4j + 3], and _mm512_dpbusd_epi32 with the row's
 * 4 activations at 4j broadcast gives 16 outputs' partial dots at once: no horizontal sums,
 * and the float work (scales) is one cvt, one mul and two fma per 16 outputs and group.
 * Stored per block of 16 outputs, per group, 320 bytes, one stream per block:
 *     256 bytes: nibbles, byte b of vector j (j < 4) = w_j[b] | w_{j+4}[b] << 4
 *      32 bytes: d, 16 float16
 *      32 bytes: m, 16 float16
 * (5 bits a weight: the same bytes as torch's int4 kernel with bfloat16 scales and zeros.)
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "native.h"

#define GROUP 32
#define NB 16
#define BLOCK_BYTES 320
#define MAX_TILE 8
#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 4096  /* ahead in a block stream */
#endif
#ifndef PREFETCH_MIN_ROWS
#ifdef PD_AVX512_EMULATED
#define PREFETCH_MIN_ROWS 1  /* AVX2: at one row too (tile()) */
#else
#define PREFETCH_MIN_ROWS 2  /* tiles of fewer rows leave the stream to the hardware */
#endif
#endif
#ifndef HI_IN_PLACE
#define HI_IN_PLACE 1  /* 0: tiles of 1-3 rows unpack as 4 rows and more do (benchmarks) */
#endif

/* x [M, K] (bfloat16 or float32) -> xq int8 [M, K], sx and sumx float32 [M, K / 32] */
void pd_int4_quantize(const void *x, int x_bf16, int M, int K, int8_t *xq, float *sx,
                      float *sumx) {
    const int G = K / GROUP, size = x_bf16 ? 2 : 4;
    const __m512 sign = _mm512_set1_ps(-0.0f);
    for (int i = 0; i < M * G; i++) {
        const char *p = (const char *)x + (size_t)i * GROUP * size;
        __m512 a = nat_load16(p, x_bf16), b = nat_load16(p + 16 * size, x_bf16);
        float amax = _mm512_reduce_max_ps(
            _mm512_max_ps(_mm512_andnot_ps(sign, a), _mm512_andnot_ps(sign, b)));
        /* below 1e-30 the group is zeros (127 / amax would overflow from 3.7e-37) */
        float id = amax > 1e-30f ? 127.0f / amax : 0.0f;
        __m512 vid = _mm512_set1_ps(id);
        /* round half to even (MXCSR's default), as torch.round in the reference */
        _mm_storeu_si128((__m128i *)(xq + (size_t)i * GROUP),
                         _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(a, vid))));
        _mm_storeu_si128((__m128i *)(xq + (size_t)i * GROUP + 16),
                         _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(b, vid))));
        sx[i] = amax / 127.0f;
        sumx[i] = _mm512_reduce_add_ps(_mm512_add_ps(a, b));
    }
}

#if defined(PD_AVX512_EMULATED) && AVX2_DOTS
/* A group's int32 dots on AVX2, the same integers as the dpbusd chains give: no vpdpbusd,
 * but vpmaddubsw's pair sums of a nibble (below 16) and an int8 cannot saturate, and the
 * eight of a group (16 products, |sum| <= 16 * 15 * 128 = 30720) add up in int16 before
 * one vpmaddwd widens them: 2 instructions a product pair, against 4 for the emulated
 * dpbusd. p: the group's packed weights, x: its activations in row 0 (row stride K). */
static inline __attribute__((always_inline)) void dots_avx2(
        const uint8_t *p, const int8_t *x, int K, const int MT, __m512i *s) {
    const __m256i lo4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    __m256i t[2][MAX_TILE];
    for (int h = 0; h < 2; h++) {  /* a half at a time: MT accumulators, not 2 MT, in the
                                    * 16 registers */
        for (int r = 0; r < MT; r++) t[h][r] = _mm256_setzero_si256();
        for (int j = 0; j < 4; j++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(p + 64 * j + 32 * h));
            const __m256i wl = _mm256_and_si256(v, lo4);
            const __m256i wh = _mm256_and_si256(_mm256_srli_epi16(v, 4), lo4);
            for (int r = 0; r < MT; r++) {
                int32_t a, b;  /* x at q[n, 4j ..] and, high nibbles, at q[n, 4j + 16 ..] */
                memcpy(&a, x + (size_t)r * K + 4 * j, 4);
                memcpy(&b, x + (size_t)r * K + 4 * j + 16, 4);
                t[h][r] = _mm256_add_epi16(t[h][r], _mm256_add_epi16(
                    _mm256_maddubs_epi16(wl, _mm256_set1_epi32(a)),
                    _mm256_maddubs_epi16(wh, _mm256_set1_epi32(b))));
            }
        }
        for (int r = 0; r < MT; r++) t[h][r] = _mm256_madd_epi16(t[h][r], ones);
    }
    for (int r = 0; r < MT; r++) s[r] = pd_si(t[0][r], t[1][r]);
}
#endif

/* MT rows x one block of 16 outputs over all groups. MT is a constant at each call site,
 * so acc[] lives in registers (8 rows: 8 accumulators + 8 weight vectors + temporaries). */
static inline __attribute__((always_inline)) void tile(
        const uint8_t *wb, int G, const int8_t *xq, const float *sx, const float *sumx,
        int K, const int MT, char *out, size_t out_row, int out_bf16) {
    __m512 acc[MAX_TILE];
    for (int r = 0; r < MT; r++) acc[r] = _mm512_setzero_ps();
    const __m512i lo4 = _mm512_set1_epi8(0x0F);
    for (int g = 0; g < G; g++) {
        const uint8_t *p = wb + (size_t)g * BLOCK_BYTES;
        /* a thread's blocks are one stream of a few hundred KiB between two barriers of a
         * decode step: prefetching ahead keeps the misses in flight from its start (batch 1
         * over SmolLM2's 30 layers: 63-64 -> 66-72 GB/s on the 2-core EPYC, weights in
         * 4 KiB pages). At one row, with the weights in 2 MiB pages (host_memory.py), the
         * hardware's prefetchers keep up alone and the five prefetches a group cost more
         * than they bring: the decode step 0.90-0.92 times as long without them; at 8 rows
         * and more it is 1.13-1.17 times as long (benchmarks/RESULTS.md). On AVX2 (a Zen 3
         * EPYC) they pay at one row too: the step 0.94 times as long with them */
        if (MT >= PREFETCH_MIN_ROWS)
            for (int c = 0; c < BLOCK_BYTES; c += 64)
                _mm_prefetch((const char *)p + PREFETCH_BYTES + c, _MM_HINT_T0);
        __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 256)));
        __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 288)));
        __m512i s[MAX_TILE];  /* each row's int32 dots for the block's 16 outputs */
#if defined(PD_AVX512_EMULATED) && AVX2_DOTS
        dots_avx2(p, xq + g * GROUP, K, MT, s);
#else
#if HI_IN_PLACE
        if (MT < 4) {
            /* Few rows: the high nibbles stay where they are, as 16 q. Their dots are 16
             * times the dot, exact in int32, and one shift brings the sum back: one and a
             * vector instead of a shift and an and, and two independent dpbusd chains a
             * row: 3-6% less time on weights hot in L3 at one row (RESULTS.md). */
            __m512i shi[MAX_TILE];
            for (int r = 0; r < MT; r++) s[r] = shi[r] = _mm512_setzero_si512();
            for (int j = 0; j < 4; j++) {
                __m512i v = _mm512_loadu_si512(p + 64 * j);
                __m512i wl = _mm512_and_si512(v, lo4), wh = _mm512_andnot_si512(lo4, v);
                for (int r = 0; r < MT; r++) {
                    int32_t a, b;  /* x at q[n, 4j ..] and, high nibbles, at q[n, 4j + 16 ..] */
                    memcpy(&a, xq + (size_t)r * K + g * GROUP + 4 * j, 4);
                    memcpy(&b, xq + (size_t)r * K + g * GROUP + 4 * j + 16, 4);
                    s[r] = _mm512_dpbusd_epi32(s[r], wl, _mm512_set1_epi32(a));
                    shi[r] = _mm512_dpbusd_epi32(shi[r], wh, _mm512_set1_epi32(b));
                }
            }
            for (int r = 0; r < MT; r++)
                s[r] = _mm512_add_epi32(s[r], _mm512_srai_epi32(shi[r], 4));
        } else
#endif
        {
            __m512i w[8];
            for (int j = 0; j < 4; j++) {
                __m512i v = _mm512_loadu_si512(p + 64 * j);
                w[j] = _mm512_and_si512(v, lo4);
                w[j + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), lo4);
            }
            /* rows innermost: MT independent dpbusd chains in flight, not one chain of 8 */
            for (int r = 0; r < MT; r++) s[r] = _mm512_setzero_si512();
            for (int j = 0; j < 8; j++)
                for (int r = 0; r < MT; r++) {
                    int32_t four;
                    memcpy(&four, xq + (size_t)r * K + g * GROUP + 4 * j, 4);
                    s[r] = _mm512_dpbusd_epi32(s[r], w[j], _mm512_set1_epi32(four));
                }
        }
#endif
        for (int r = 0; r < MT; r++) {
            __m512 dx = _mm512_mul_ps(_mm512_cvtepi32_ps(s[r]), _mm512_set1_ps(sx[r * G + g]));
            acc[r] = _mm512_fmadd_ps(dx, d, acc[r]);
            acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(sumx[r * G + g]), acc[r]);
        }
    }
    for (int r = 0; r < MT; r++) nat_store16(out + r * out_row, acc[r], out_bf16);
}

/* out rows [0, M) x output blocks [nb0, nb1) (outputs 16 nb0 .. 16 nb1) from the quantized
 * activations (pd_int4_quantize's); out_row: the bytes between output rows. Each output is
 * the same sum, in the same order, whatever the row tile it falls in. */
void pd_int4_blocks(const uint8_t *w, int K, int nb0, int nb1, const int8_t *xq,
                    const float *sx, const float *sumx, int M, char *out, size_t out_row,
                    int out_bf16) {
    const int G = K / GROUP, out_size = out_bf16 ? 2 : 4;
    for (int nb = nb0; nb < nb1; nb++) {
        const uint8_t *wb = w + (size_t)nb * G * BLOCK_BYTES;
        char *o = out + (size_t)nb * NB * out_size;
        int r = 0;
        for (; r + 8 <= M; r += 8)
            tile(wb, G, xq + (size_t)r * K, sx + r * G, sumx + r * G, K, 8, o + r * out_row,
                 out_row, out_bf16);
        if (r + 4 <= M) {
            tile(wb, G, xq + (size_t)r * K, sx + r * G, sumx + r * G, K, 4, o + r * out_row,
                 out_row, out_bf16);
            r += 4;
        }
        if (r + 2 <= M) {
            tile(wb, G, xq + (size_t)r * K, sx + r * G, sumx + r * G, K, 2, o + r * out_row,
                 out_row, out_bf16);
            r += 2;
        }
        if (r < M)
            tile(wb, G, xq + (size_t)r * K, sx + r * G, sumx + r * G, K, 1, o + r * out_row,
                 out_row, out_bf16);
    }
}

/* out [M, N] = x [M, K] @ w.T, w packed as above ([N / 16, K / 32, 320] bytes). N a multiple
 * of 16, K of 32. Threads: OpenMP's default for the calling thread (torch's, when torch
 * loaded the same libgomp). Returns 0, or -1 if the scratch could not be allocated. */
int vnni_int4_mm(const void *x, int x_bf16, int M, int K, int N, const uint8_t *w,
                 void *out, int out_bf16) {
    const int G = K / GROUP, out_size = out_bf16 ? 2 : 4;
    char *scratch = malloc((size_t)M * K + 2 * sizeof(float) * (size_t)M * G + 64);
    if (!scratch) return -1;
    float *sx = (float *)scratch, *sumx = sx + (size_t)M * G;
    int8_t *xq = (int8_t *)(sumx + (size_t)M * G);
    pd_int4_quantize(x, x_bf16, M, K, xq, sx, sumx);
    const size_t out_row = (size_t)N * out_size;
#pragma omp parallel for schedule(static)
    for (int nb = 0; nb < N / NB; nb++)
        pd_int4_blocks(w, K, nb, nb + 1, xq, sx, sumx, M, out, out_row, out_bf16);
    free(scratch);
    return 0;
}

/* The weight itself, w [N, K] row-major = d * q + m in float32, stored as float32 or
 * bfloat16 (rounded once, to nearest even): a prefill's many rows run a dense GEMM over it
 * (Int4Linear.forward), and the tests read it. */
void vnni_int4_weight(const uint8_t *w, int K, int N, void *out, int out_bf16) {
    const int G = K / GROUP, size = out_bf16 ? 2 : 4;
#pragma omp parallel for schedule(static)
    for (int nb = 0; nb < N / NB; nb++) {
        for (int g = 0; g < G; g++) {
            const uint8_t *p = w + ((size_t)nb * G + g) * BLOCK_BYTES;
            float d[NB], m[NB];
            _mm512_storeu_ps(d, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 256))));
            _mm512_storeu_ps(m, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 288))));
            for (int n = 0; n < NB; n++) {
                /* vector j < 8 holds q[n, 4j .. 4j + 3] in lane n: low nibbles of bytes
                 * 64 (j % 4) + 4n .. + 3 for j < 4, high nibbles for j >= 4 */
                float row[GROUP];
                for (int j = 0; j < 8; j++)
                    for (int b = 0; b < 4; b++) {
                        uint8_t byte = p[64 * (j % 4) + 4 * n + b];
                        int q = j < 4 ? byte & 0x0F : byte >> 4;
                        row[4 * j + b] = d[n] * (float)q + m[n];
                    }
                char *o = (char *)out + (((size_t)nb * NB + n) * K + (size_t)g * GROUP) * size;
                nat_store16(o, _mm512_loadu_ps(row), out_bf16);
                nat_store16(o + 16 * size, _mm512_loadu_ps(row + 16), out_bf16);
            }
        }
    }
}
