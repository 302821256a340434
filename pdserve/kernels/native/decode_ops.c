/* A bfloat16 decode step's small operations, each one call where torch dispatches several
 * (decode_ops.py): RMSNorm with the residual add fused, the rotary in place on a layer's q
 * and k heads, and silu(gate) * up. At a batch-1 step each is a few hundred elements, so
 * torch's cost was its dispatch (2-3 us an operation, about 1,600 a step), not the maths.
 *
 * Each repeats the torch path's arithmetic in its order, rounding to bfloat16 where torch
 * rounds (round to nearest even, as torch's conversion; not VCVTNEPS2BF16, which flushes
 * subnormals):
 *   rms_norm   sum = bf16(x + res); v = the float32 sum of sum^2 in the order of torch's
 *              cascade_sum (below); out = bf16(bf16(sum * (1 / sqrt(v / n + eps))) * w).
 *              Bit-identical to the torch path (torch 2.13; a torch whose sum changes
 *              order would differ by a rounding now and then: the tests would say).
 *   rotate     x[j] = bf16(bf16(x[j] * cos[j]) + bf16(x[j + D/2 mod D] * sin[j])), sin with
 *              rotate_half's sign folded in (RotaryTables). Bit-identical.
 *   silu_mul   out = bf16(bf16(g / (1 + exp(-g))) * u), exp as torch's vectorised one
 *              (SLEEF's expf u10, reimplemented here). Bit-identical where torch runs
 *              its 32-wide vectors (rows of a multiple of 32: every Llama's); past them
 *              torch uses std::exp, and silu can differ by one bfloat16 rounding.
 *
 * Rows split over torch's OpenMP threads from PARALLEL_MIN elements (8,192) up. Measured on
 * a 2-core EPYC, both threads warm (benchmarks/RESULTS.md): at one row the team costs
 * 0.2 us more than it saves; at 16 rows (9,216 to 24,576 elements) it saves 0.9 us of 3.7
 * (norm), 0.6 of 5.1 (rotary), 5.2 of 12.5 (silu * up); at 2,048 rows half (rotary 14 %).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "native.h"

#ifndef PARALLEL_MIN
#define PARALLEL_MIN 8192        /* elements */
#endif

typedef uint16_t bf16;

/* 16 bfloat16 (the first n of them, n < 16 masked) as float32 */
static inline __m512 load_bf16(const bf16 *p, int n) {
    __m256i v = n >= 16 ? _mm256_loadu_si256((const __m256i *)p)
                        : _mm256_maskz_loadu_epi16((__mmask16)((1u << n) - 1), p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

/* float32 rounded to the nearest bfloat16 (ties to even, as c10's conversion; a NaN stays a
 * NaN), still as float32: the value a torch operation in bfloat16 keeps */
static inline __m512 bf16_value(__m512 f) {
    __m512i u = _mm512_castps_si512(f);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    r = _mm512_and_si512(r, _mm512_set1_epi32((int)0xffff0000u));
    __mmask16 nan = _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q);
    return _mm512_castsi512_ps(_mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7fc00000)));
}

/* the upper halves of 16 bfloat16-valued floats */
static inline __m256i pack_bf16(__m512 v) {
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(v), 16));
}

/* f rounded to bfloat16 into p[0..n) (n < 16 masked) */
static inline void store_bf16(bf16 *p, __m512 f, int n) {
    __m256i v = pack_bf16(bf16_value(f));
    if (n >= 16)
        _mm256_storeu_si256((__m256i *)p, v);
    else
        _mm256_mask_storeu_epi16(p, (__mmask16)((1u << n) - 1), v);
}

/* ---------------------------------------------------------------------------------------
 * The sum of h[0..n) in the order of torch's cascade_sum (ATen/native/cpu/SumKernel.cpp)
 * over a contiguous row. torch registers that kernel for AVX2, not AVX512, so its vectors
 * are TORCH_LANES = 8 floats on this CPU too (and under ATEN_CPU_CAPABILITY=default). Vector
 * i of the row goes to accumulator i % 4 (ilp 4), through 4 cascade levels of 2^p vectors
 * each (p = max(4, ceil(log2(n / 32)) / 4)); vectors short of a multiple of 4 add to
 * accumulator 0; the accumulators sum 0 + 1 + 2 + 3; then the scalar tail, then the lanes,
 * one by one. Written with arrays: the compiler vectorises the lanes, and without
 * -ffast-math it keeps each lane's order.
 * ------------------------------------------------------------------------------------- */
#define W 8

static int ceil_log2(int64_t x) {
    int r = 0;
    while (((int64_t)1 << r) < x) r++;
    return r;
}

static inline float square(const bf16 *p, int64_t e) {
    union { uint32_t u; float f; } c = {.u = (uint32_t)p[e] << 16};
    return c.f * c.f;
}

/* the float32 sum of p[e]^2 (torch's pow(2), then its sum) */
static float torch_sum_of_squares(const bf16 *p, int n) {
    float acc[4][4][W] = {{{0}}};           /* [level][ilp][lane] */
    const int vec_size = n / W, size_ilp = vec_size / 4;
    const int level_power = ceil_log2(size_ilp) / 4 > 4 ? ceil_log2(size_ilp) / 4 : 4;
    const int64_t level_step = (int64_t)1 << level_power, level_mask = level_step - 1;
    int64_t i = 0;
    while (i + level_step <= size_ilp) {
        for (int64_t j = 0; j < level_step; j++, i++)
            for (int k = 0; k < 4; k++)
                for (int l = 0; l < W; l++) acc[0][k][l] += square(p, (i * 4 + k) * W + l);
        for (int j = 1; j < 4; j++) {
            for (int k = 0; k < 4; k++)
                for (int l = 0; l < W; l++) {
                    acc[j][k][l] += acc[j - 1][k][l];
                    acc[j - 1][k][l] = 0.0f;
                }
            if (i & (level_mask << (j * level_power))) break;
        }
    }
    for (; i < size_ilp; i++)
        for (int k = 0; k < 4; k++)
            for (int l = 0; l < W; l++) acc[0][k][l] += square(p, (i * 4 + k) * W + l);
    for (int j = 1; j < 4; j++)
        for (int k = 0; k < 4; k++)
            for (int l = 0; l < W; l++) acc[0][k][l] += acc[j][k][l];
    for (int v = size_ilp * 4; v < vec_size; v++)
        for (int l = 0; l < W; l++) acc[0][0][l] += square(p, v * W + l);
    for (int k = 1; k < 4; k++)
        for (int l = 0; l < W; l++) acc[0][0][l] += acc[0][k][l];
    float total = 0.0f;
    for (int e = vec_size * W; e < n; e++) total += square(p, e);
    for (int l = 0; l < W; l++) total += acc[0][0][l];
    return total;
}

void pd_rms_norm_row(const bf16 *x, const bf16 *res, bf16 *sum_out, const bf16 *w, bf16 *out,
                     int n, float eps) {
    if (res) {
        for (int j = 0; j < n; j += 16) {
            int m = n - j < 16 ? n - j : 16;
            store_bf16(sum_out + j, _mm512_add_ps(load_bf16(x + j, m), load_bf16(res + j, m)),
                       m);
        }
        x = sum_out;
    }
    /* mean = sum / n, then + eps, then rsqrt as 1 / sqrt: torch's ops, each rounded */
    __m512 inv = _mm512_set1_ps(1.0f / sqrtf(torch_sum_of_squares(x, n) / (float)n + eps));
    for (int j = 0; j < n; j += 16) {
        int m = n - j < 16 ? n - j : 16;
        __m512 normed = bf16_value(_mm512_mul_ps(load_bf16(x + j, m), inv));
        store_bf16(out + j, _mm512_mul_ps(normed, load_bf16(w + j, m)), m);
    }
}

/* RMSNorm of rows [rows, n] bfloat16, each with its row stride (elements). res NULL: of x.
 * Else of sum = x + res, written to sum_out (res itself for the in-place add). */
void pd_rms_norm_bf16(const bf16 *x, int64_t sx, const bf16 *res, int64_t sres, bf16 *sum_out,
                      int64_t ssum, const bf16 *w, bf16 *out, int64_t sout, int rows, int n,
                      float eps) {
    #pragma omp parallel for if ((int64_t)rows * n >= PARALLEL_MIN) schedule(static)
    for (int r = 0; r < rows; r++)
        pd_rms_norm_row(x + r * sx, res ? res + r * sres : 0, sum_out ? sum_out + r * ssum : 0,
                     w, out + r * sout, n, eps);
}

/* ---------------------------------------------------------------------------------------
 * Rotary in place: x [T, N, D] (strides st, sh, 1), cos and sin [T, D] (row stride stab).
 * ------------------------------------------------------------------------------------- */
static inline __m512 rot_half(__m512 x, __m512 c, __m512 xo, __m512 s) {
    return _mm512_add_ps(bf16_value(_mm512_mul_ps(x, c)), bf16_value(_mm512_mul_ps(xo, s)));
}

/* one head p[0..D) of one token, by its token's cos and sin [D] */
void pd_rotate_head(bf16 *p, int D, const bf16 *c, const bf16 *s) {
    const int half = D / 2;
    for (int j = 0; j < half; j += 16) {
        int m = half - j < 16 ? half - j : 16;
        __m512 x1 = load_bf16(p + j, m), x2 = load_bf16(p + half + j, m);
        __m512 r1 = rot_half(x1, load_bf16(c + j, m), x2, load_bf16(s + j, m));
        __m512 r2 = rot_half(x2, load_bf16(c + half + j, m), x1, load_bf16(s + half + j, m));
        store_bf16(p + j, r1, m);
        store_bf16(p + half + j, r2, m);
    }
}

void pd_rotate_bf16(bf16 *x, int T, int N, int D, int64_t st, int64_t sh, const bf16 *cos,
                    const bf16 *sin, int64_t stab) {
    #pragma omp parallel for if ((int64_t)T * N * D >= PARALLEL_MIN) schedule(static)
    for (int t = 0; t < T; t++)
        for (int h = 0; h < N; h++)
            pd_rotate_head(x + t * st + h * sh, D, cos + t * stab, sin + t * stab);
}

/* ---------------------------------------------------------------------------------------
 * silu(gate) * up. exp as SLEEF's xexpf (u10), which torch's Vectorized<float>::exp calls.
 * ------------------------------------------------------------------------------------- */
static inline __m512 sleef_expf(__m512 d) {
    __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(d, _mm512_set1_ps(1.442695040888963407359924681001892137426645954152985934135449406931f)));
    __m512 qf = _mm512_cvtepi32_ps(q);
    __m512 s = _mm512_fmadd_ps(qf, _mm512_set1_ps(-0.693145751953125f), d);
    s = _mm512_fmadd_ps(qf, _mm512_set1_ps(-1.428606765330187045e-06f), s);
    __m512 u = _mm512_set1_ps(0.000198527617612853646278381f);
    u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.00139304355252534151077271f));
    u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.00833336077630519866943359f));
    u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.0416664853692054748535156f));
    u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.166666671633720397949219f));
    u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.5f));
    u = _mm512_add_ps(_mm512_set1_ps(1.0f), _mm512_fmadd_ps(_mm512_mul_ps(s, s), u, s));
    /* u * 2^q as two powers of two (q >> 1, q - (q >> 1)): no overflow in the exponent */
    __m512i q1 = _mm512_srai_epi32(q, 1), q2 = _mm512_sub_epi32(q, q1);
    __m512i bias = _mm512_set1_epi32(0x7f);
    u = _mm512_mul_ps(u, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(q1, bias), 23)));
    u = _mm512_mul_ps(u, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(q2, bias), 23)));
    u = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(d, _mm512_set1_ps(-104.0f), _CMP_NLT_US), u);
    return _mm512_mask_mov_ps(u, _mm512_cmp_ps_mask(_mm512_set1_ps(100.0f), d, _CMP_LT_OQ),
                              _mm512_set1_ps(INFINITY));
}

/* o[0..n) = silu(g) * u over one row's span (o may be g) */
void pd_silu_mul_row(const bf16 *g, const bf16 *u, bf16 *o, int n) {
    const __m512 one = _mm512_set1_ps(1.0f), sign = _mm512_set1_ps(-0.0f);
    for (int j = 0; j < n; j += 16) {
        int m = n - j < 16 ? n - j : 16;
        __m512 x = load_bf16(g + j, m);
        __m512 act = bf16_value(_mm512_div_ps(
            x, _mm512_add_ps(one, sleef_expf(_mm512_xor_ps(x, sign)))));
        store_bf16(o + j, _mm512_mul_ps(act, load_bf16(u + j, m)), m);
    }
}

/* out [rows, n] = silu(gate) * up, each with its row stride; out may be gate itself */
void pd_silu_mul_bf16(const bf16 *gate, int64_t sg, const bf16 *up, int64_t su, bf16 *out,
                      int64_t so, int rows, int n) {
    #pragma omp parallel for if ((int64_t)rows * n >= PARALLEL_MIN) schedule(static)
    for (int r = 0; r < rows; r++)
        pd_silu_mul_row(gate + r * sg, up + r * su, out + r * so, n);
}
