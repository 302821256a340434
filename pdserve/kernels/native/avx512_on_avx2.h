/* The AVX-512 intrinsics the kernels use, on a CPU without AVX512-VNNI and AVX512-BF16 (an
 * AVX2 one: AMD Zen 2 and 3, Intel's client cores): each 512-bit operation as two on the
 * 256-bit halves, so one source serves both and the AVX-512 build compiles exactly as it
 * did. native.h includes this after <immintrin.h> where the compiler's target lacks them;
 * it needs AVX2, FMA and F16C (kernels/native/__init__.py checks the flags).
 *
 * GCC's intrinsics only inline into AVX-512 code: each name below, and each 512-bit type,
 * is redirected to a pd512_ function or pd_ type of the same meaning (C casts no struct, so
 * the kernels cast between bfloat16 and other vectors through nat_dpbf16 and
 * nat_bf16_pairs, which native.h also defines for the AVX-512 build). Each gives the bits
 * the instruction gives, the reductions adding and comparing in GCC's own order, with three
 * exceptions no kernel meets: vdpbf16ps and vcvtneps2bf16 flush denormals to zero, these
 * do not; scalef is exact for the integral exponents the kernels pass, not for fractions. */
#ifndef PDSERVE_AVX512_ON_AVX2_H
#define PDSERVE_AVX512_ON_AVX2_H

#if !defined(__AVX2__) || !defined(__FMA__) || !defined(__F16C__)
#error "pdserve's native kernels need AVX-512 (VNNI, BF16) or AVX2 with FMA and F16C"
#endif

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define PD_AVX512_EMULATED 1  /* a kernel's own AVX2 path where it has a faster one */
#ifndef AVX2_DOTS
#define AVX2_DOTS 1  /* 0: the int4 and Q8_0 GEMMs on the emulated vpdpbusd (benchmarks) */
#endif
#define PD_INLINE static inline __attribute__((always_inline))

/* A 512-bit value as its two 256-bit halves, which the compiler keeps in two registers
 * (GCC's own 64-byte vector types would live in memory on this target) */
typedef struct { __m256 lo, hi; } pd_m512;
typedef struct { __m256i lo, hi; } pd_m512i;  /* integers, and 32 bfloat16 */
PD_INLINE __m256 pd_lo(pd_m512 v) { return v.lo; }
PD_INLINE __m256 pd_hi(pd_m512 v) { return v.hi; }
PD_INLINE pd_m512 pd_ps(__m256 lo, __m256 hi) { return (pd_m512){lo, hi}; }
PD_INLINE __m256i pd_lo_i(pd_m512i v) { return v.lo; }
PD_INLINE __m256i pd_hi_i(pd_m512i v) { return v.hi; }
PD_INLINE pd_m512i pd_si(__m256i lo, __m256i hi) { return (pd_m512i){lo, hi}; }
#define __m512 pd_m512
#define __m512i pd_m512i
#define __m512bh pd_m512i

#define PD_PS2(name, op)                                                                   \
    PD_INLINE __m512 name(__m512 a, __m512 b) {                                            \
        return pd_ps(op(pd_lo(a), pd_lo(b)), op(pd_hi(a), pd_hi(b)));                      \
    }
#define PD_PS3(name, op)                                                                   \
    PD_INLINE __m512 name(__m512 a, __m512 b, __m512 c) {                                  \
        return pd_ps(op(pd_lo(a), pd_lo(b), pd_lo(c)), op(pd_hi(a), pd_hi(b), pd_hi(c)));  \
    }
#define PD_SI2(name, op)                                                                   \
    PD_INLINE __m512i name(__m512i a, __m512i b) {                                         \
        return pd_si(op(pd_lo_i(a), pd_lo_i(b)), op(pd_hi_i(a), pd_hi_i(b)));              \
    }

/* ---- float32 lanes ---- */
PD_INLINE __m512 pd512_set1_ps(float x) { __m256 h = _mm256_set1_ps(x); return pd_ps(h, h); }
PD_INLINE __m512 pd512_setzero_ps(void) { return pd512_set1_ps(0.0f); }
PD_INLINE __m512 pd512_loadu_ps(const void *p) {
    return pd_ps(_mm256_loadu_ps((const float *)p), _mm256_loadu_ps((const float *)p + 8));
}
PD_INLINE void pd512_storeu_ps(void *p, __m512 v) {
    _mm256_storeu_ps((float *)p, pd_lo(v));
    _mm256_storeu_ps((float *)p + 8, pd_hi(v));
}
PD_PS2(pd512_add_ps, _mm256_add_ps)
PD_PS2(pd512_sub_ps, _mm256_sub_ps)
PD_PS2(pd512_mul_ps, _mm256_mul_ps)
PD_PS2(pd512_div_ps, _mm256_div_ps)
PD_PS2(pd512_max_ps, _mm256_max_ps)
PD_PS2(pd512_xor_ps, _mm256_xor_ps)
PD_PS2(pd512_andnot_ps, _mm256_andnot_ps)
PD_PS2(pd512_unpacklo_ps, _mm256_unpacklo_ps)
PD_PS2(pd512_unpackhi_ps, _mm256_unpackhi_ps)
PD_PS3(pd512_fmadd_ps, _mm256_fmadd_ps)
PD_PS3(pd512_fnmadd_ps, _mm256_fnmadd_ps)
PD_INLINE __m512 pd512_castsi512_ps(__m512i v) {
    return pd_ps(_mm256_castsi256_ps(v.lo), _mm256_castsi256_ps(v.hi));
}
PD_INLINE __m512i pd512_castps_si512(__m512 v) {
    return pd_si(_mm256_castps_si256(v.lo), _mm256_castps_si256(v.hi));
}
PD_INLINE float pd512_cvtss_f32(__m512 v) { return _mm256_cvtss_f32(v.lo); }

/* within each 128-bit lane, as the 256-bit forms do */
#define pd512_shuffle_ps(a, b, imm)                                                         \
    pd_ps(_mm256_shuffle_ps(pd_lo(a), pd_lo(b), (imm)),                                     \
          _mm256_shuffle_ps(pd_hi(a), pd_hi(b), (imm)))
/* rounding to an integer only (imm's high nibble, the scale, is 0 at every call) */
#define pd512_roundscale_ps(a, imm)                                                         \
    pd_ps(_mm256_round_ps(pd_lo(a), (imm) & 0xF), _mm256_round_ps(pd_hi(a), (imm) & 0xF))

/* 128-bit lanes: two of a (imm's bits 0-3), then two of b (bits 4-7) */
PD_INLINE __m512 pd512_shuffle_f32x4(__m512 a, __m512 b, const int imm) {
    const __m128 q[8] = {_mm256_castps256_ps128(a.lo), _mm256_extractf128_ps(a.lo, 1),
                         _mm256_castps256_ps128(a.hi), _mm256_extractf128_ps(a.hi, 1),
                         _mm256_castps256_ps128(b.lo), _mm256_extractf128_ps(b.lo, 1),
                         _mm256_castps256_ps128(b.hi), _mm256_extractf128_ps(b.hi, 1)};
    return pd_ps(_mm256_set_m128(q[(imm >> 2) & 3], q[imm & 3]),
                 _mm256_set_m128(q[4 + ((imm >> 6) & 3)], q[4 + ((imm >> 4) & 3)]));
}

/* a * 2^n for n integral: n clamped to [-252, 254] (beyond, the product is 0 or infinite
 * as it is anyway for the kernels' a, within [0.5, 2]) and applied as two powers of two */
PD_INLINE __m256 pd_scalef8(__m256 a, __m256 n) {
    const __m256 nan = _mm256_cmp_ps(n, n, _CMP_UNORD_Q);
    __m256 c = _mm256_min_ps(_mm256_max_ps(n, _mm256_set1_ps(-252.0f)), _mm256_set1_ps(254.0f));
    __m256i k = _mm256_cvtps_epi32(c), k1 = _mm256_srai_epi32(k, 1);
    __m256i k2 = _mm256_sub_epi32(k, k1), bias = _mm256_set1_epi32(127);
    a = _mm256_mul_ps(a, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(k1, bias), 23)));
    a = _mm256_mul_ps(a, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(k2, bias), 23)));
    /* a NaN exponent (a NaN input) gives a NaN, as vscalefps does */
    return _mm256_blendv_ps(a, n, nan);
}
PD_PS2(pd512_scalef_ps, pd_scalef8)

/* ---- masks: bit i of a __mmask16 is lane i ---- */
PD_INLINE __m256 pd_lanes8(unsigned bits) {  /* lane i all ones where bit i is set */
    const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    __m256i k = _mm256_set1_epi32((int)bits);
    return _mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_and_si256(k, bit), bit));
}
PD_INLINE __m512 pd512_mask_mov_ps(__m512 src, __mmask16 k, __m512 a) {
    return pd_ps(_mm256_blendv_ps(pd_lo(src), pd_lo(a), pd_lanes8(k & 0xFF)),
                 _mm256_blendv_ps(pd_hi(src), pd_hi(a), pd_lanes8(k >> 8)));
}
PD_INLINE __m512 pd512_maskz_mov_ps(__mmask16 k, __m512 a) {
    return pd512_mask_mov_ps(pd512_setzero_ps(), k, a);
}
PD_INLINE __m512i pd512_mask_mov_epi32(__m512i src, __mmask16 k, __m512i a) {
    return pd512_castps_si512(pd512_mask_mov_ps(pd512_castsi512_ps(src), k,
                                                pd512_castsi512_ps(a)));
}
#define pd512_cmp_ps_mask(a, b, pred)                                                       \
    ((__mmask16)(_mm256_movemask_ps(_mm256_cmp_ps(pd_lo(a), pd_lo(b), (pred)))              \
                 | _mm256_movemask_ps(_mm256_cmp_ps(pd_hi(a), pd_hi(b), (pred))) << 8))
#define pd512_mask_cmp_ps_mask(k, a, b, pred) ((__mmask16)((k) & pd512_cmp_ps_mask(a, b, pred)))
PD_INLINE void pd512_mask_storeu_ps(void *p, __mmask16 k, __m512 v) {
    _mm256_maskstore_ps((float *)p, _mm256_castps_si256(pd_lanes8(k & 0xFF)), pd_lo(v));
    _mm256_maskstore_ps((float *)p + 8, _mm256_castps_si256(pd_lanes8(k >> 8)), pd_hi(v));
}

/* ---- reductions, in the order of GCC's own (avx512fintrin.h) ---- */
PD_INLINE float pd512_reduce_add_ps(__m512 a) {
    __m256 t3 = pd_hi(a) + pd_lo(a);
    __m128 t6 = _mm256_extractf128_ps(t3, 1) + _mm256_extractf128_ps(t3, 0);
    __m128 t8 = t6 + _mm_shuffle_ps(t6, t6, _MM_SHUFFLE(1, 0, 3, 2));
    return t8[0] + t8[1];
}
PD_INLINE float pd512_reduce_max_ps(__m512 a) {
    __m256 t3 = _mm256_max_ps(pd_hi(a), pd_lo(a));
    __m128 t6 = _mm_max_ps(_mm256_extractf128_ps(t3, 1), _mm256_extractf128_ps(t3, 0));
    __m128 t8 = _mm_max_ps(t6, _mm_shuffle_ps(t6, t6, _MM_SHUFFLE(1, 0, 3, 2)));
    __m128 t10 = _mm_max_ps(t8, _mm_shuffle_ps(t8, t8, _MM_SHUFFLE(0, 1, 0, 1)));
    return t10[0];
}
PD_INLINE float pd512_mask_reduce_max_ps(__mmask16 k, __m512 a) {
    return pd512_reduce_max_ps(pd512_mask_mov_ps(pd512_set1_ps(-__builtin_inff()), k, a));
}

/* ---- int32 lanes and bits ---- */
PD_INLINE __m512i pd512_set1_epi32(int x) { __m256i h = _mm256_set1_epi32(x); return pd_si(h, h); }
PD_INLINE __m512i pd512_set1_epi8(char x) { __m256i h = _mm256_set1_epi8(x); return pd_si(h, h); }
PD_INLINE __m512i pd512_setzero_si512(void) { return pd512_set1_epi32(0); }
PD_INLINE __m512i pd512_loadu_si512(const void *p) {
    return pd_si(_mm256_loadu_si256((const __m256i *)p),
                 _mm256_loadu_si256((const __m256i *)p + 1));
}
PD_INLINE void pd512_storeu_si512(void *p, __m512i v) {
    _mm256_storeu_si256((__m256i *)p, pd_lo_i(v));
    _mm256_storeu_si256((__m256i *)p + 1, pd_hi_i(v));
}
PD_SI2(pd512_and_si512, _mm256_and_si256)
PD_SI2(pd512_andnot_si512, _mm256_andnot_si256)
PD_SI2(pd512_or_si512, _mm256_or_si256)
PD_SI2(pd512_add_epi32, _mm256_add_epi32)
PD_SI2(pd512_sub_epi32, _mm256_sub_epi32)
#define PD_SHIFT(name, op)                                                                  \
    PD_INLINE __m512i name(__m512i a, const unsigned n) {                                   \
        return pd_si(op(pd_lo_i(a), n), op(pd_hi_i(a), n));                                 \
    }
PD_SHIFT(pd512_slli_epi32, _mm256_slli_epi32)
PD_SHIFT(pd512_srli_epi32, _mm256_srli_epi32)
PD_SHIFT(pd512_srai_epi32, _mm256_srai_epi32)
PD_SHIFT(pd512_srli_epi16, _mm256_srli_epi16)

/* ---- conversions ---- */
PD_INLINE __m512i pd512_cvtps_epi32(__m512 a) {
    return pd_si(_mm256_cvtps_epi32(pd_lo(a)), _mm256_cvtps_epi32(pd_hi(a)));
}
PD_INLINE __m512 pd512_cvtepi32_ps(__m512i a) {
    return pd_ps(_mm256_cvtepi32_ps(pd_lo_i(a)), _mm256_cvtepi32_ps(pd_hi_i(a)));
}
PD_INLINE __m512i pd512_cvtepu16_epi32(__m256i a) {
    return pd_si(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(a)),
                 _mm256_cvtepu16_epi32(_mm256_extracti128_si256(a, 1)));
}
PD_INLINE __m512i pd512_cvtepi8_epi32(__m128i a) {
    return pd_si(_mm256_cvtepi8_epi32(a), _mm256_cvtepi8_epi32(_mm_srli_si128(a, 8)));
}
/* 16 int32 to int8, saturated (packs saturates int32 to int16, then int16 to int8; packs
 * interleaves the 128-bit lanes, which the permute puts back in order) */
PD_INLINE __m128i pd512_cvtsepi32_epi8(__m512i a) {
    __m256i w = _mm256_permute4x64_epi64(_mm256_packs_epi32(pd_lo_i(a), pd_hi_i(a)), 0xD8);
    return _mm_packs_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
}
/* 16 int32 to int16, truncated (the low halves, then an unsigned pack that cannot saturate) */
PD_INLINE __m256i pd512_cvtepi32_epi16(__m512i a) {
    const __m256i low = _mm256_set1_epi32(0xFFFF);
    return _mm256_permute4x64_epi64(
        _mm256_packus_epi32(_mm256_and_si256(pd_lo_i(a), low), _mm256_and_si256(pd_hi_i(a), low)),
        0xD8);
}
PD_INLINE __m512 pd512_cvtph_ps(__m256i a) {
    return pd_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(a)),
                 _mm256_cvtph_ps(_mm256_extracti128_si256(a, 1)));
}
#define pd512_cvtps_ph(a, imm)                                                              \
    _mm256_set_m128i(_mm256_cvtps_ph(pd_hi(a), (imm)), _mm256_cvtps_ph(pd_lo(a), (imm)))

/* float32 to bfloat16, rounded to nearest even; a NaN stays a (quiet) NaN */
PD_INLINE __m256i pd_bf16_of8(__m256 f) {
    __m256i u = _mm256_castps_si256(f);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(
        _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
    __m256i nan = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
    return _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(r), _mm256_castsi256_ps(nan),
                                                _mm256_cmp_ps(f, f, _CMP_UNORD_Q)));
}
/* 16 float32 to 16 bfloat16 */
PD_INLINE __m256i pd512_cvtneps_pbh(__m512 a) {
    __m512i both = pd_si(pd_bf16_of8(pd_lo(a)), pd_bf16_of8(pd_hi(a)));
    return pd512_cvtepi32_epi16(both);
}
/* 32 bfloat16: b's 16 below, a's above */
PD_INLINE __m512i pd512_cvtne2ps_pbh(__m512 a, __m512 b) {
    return pd_si(pd512_cvtneps_pbh(b), pd512_cvtneps_pbh(a));
}

/* ---- masked loads and stores of 16-bit elements (prefixes at every call); the lanes
 * masked off are not read or written, as the instructions' are not ---- */
PD_INLINE __m256i pd256_maskz_loadu_epi16(__mmask16 k, const void *p) {
    if (k == 0xFFFF) return _mm256_loadu_si256((const __m256i *)p);
    uint16_t v[16] = {0};
    for (int i = 0; i < 16; i++)
        if (k >> i & 1) memcpy(v + i, (const uint16_t *)p + i, 2);
    return _mm256_loadu_si256((const __m256i *)v);
}
PD_INLINE void pd256_mask_storeu_epi16(void *p, __mmask16 k, __m256i a) {
    uint16_t v[16];
    _mm256_storeu_si256((__m256i *)v, a);
    for (int i = 0; i < 16; i++)
        if (k >> i & 1) memcpy((uint16_t *)p + i, v + i, 2);
}
PD_INLINE __m512i pd512_maskz_loadu_epi16(__mmask32 k, const void *p) {
    return pd_si(pd256_maskz_loadu_epi16((__mmask16)k, p),
                 pd256_maskz_loadu_epi16((__mmask16)(k >> 16), (const uint16_t *)p + 16));
}

/* ---- dot products ---- */
/* vpdpbusd: each int32 lane plus the four products of a's unsigned and b's signed bytes,
 * exactly (vpmaddubsw would saturate at 2 * 255 * 127: even and odd bytes apart, widened to
 * int16, pairs summed by vpmaddwd) */
PD_INLINE __m256i pd_dpbusd8(__m256i s, __m256i a, __m256i b) {
    __m256i ae = _mm256_and_si256(a, _mm256_set1_epi16(0xFF)), ao = _mm256_srli_epi16(a, 8);
    __m256i be = _mm256_srai_epi16(_mm256_slli_epi16(b, 8), 8), bo = _mm256_srai_epi16(b, 8);
    return _mm256_add_epi32(s, _mm256_add_epi32(_mm256_madd_epi16(ae, be),
                                                _mm256_madd_epi16(ao, bo)));
}
PD_INLINE __m512i pd512_dpbusd_epi32(__m512i s, __m512i a, __m512i b) {
    return pd_si(pd_dpbusd8(pd_lo_i(s), pd_lo_i(a), pd_lo_i(b)),
                 pd_dpbusd8(pd_hi_i(s), pd_hi_i(a), pd_hi_i(b)));
}
/* vdpbf16ps: each float32 lane plus the products of its odd bfloat16 pair, then of its
 * even pair, each added with one rounding (a product of two bfloat16 is exact in float32) */
PD_INLINE __m256 pd_dpbf16_8(__m256 s, __m256i a, __m256i b) {
    const __m256i high = _mm256_set1_epi32((int)0xFFFF0000u);
    s = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_and_si256(a, high)),
                        _mm256_castsi256_ps(_mm256_and_si256(b, high)), s);
    return _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(a, 16)),
                           _mm256_castsi256_ps(_mm256_slli_epi32(b, 16)), s);
}
PD_INLINE __m512 pd512_dpbf16_ps(__m512 s, __m512bh a, __m512bh b) {
    return pd_ps(pd_dpbf16_8(s.lo, a.lo, b.lo), pd_dpbf16_8(s.hi, a.hi, b.hi));
}
/* the kernels' bfloat16 pairs, which the AVX-512 build casts to and from __m512bh */
PD_INLINE pd_m512i pd_same_i(pd_m512i v) { return v; }
#define pd_bits(x) _Generic((x), pd_m512: pd512_castps_si512, default: pd_same_i)(x)
#define nat_dpbf16(acc, a, b) pd512_dpbf16_ps((acc), pd_bits(a), pd_bits(b))
#define nat_bf16_pairs(hi, lo) pd512_cvtne2ps_pbh((hi), (lo))

/* The kernels' names for them */
#define _mm512_set1_ps pd512_set1_ps
#define _mm512_setzero_ps pd512_setzero_ps
#define _mm512_loadu_ps pd512_loadu_ps
#define _mm512_storeu_ps pd512_storeu_ps
#define _mm512_add_ps pd512_add_ps
#define _mm512_sub_ps pd512_sub_ps
#define _mm512_mul_ps pd512_mul_ps
#define _mm512_div_ps pd512_div_ps
#define _mm512_max_ps pd512_max_ps
#define _mm512_xor_ps pd512_xor_ps
#define _mm512_andnot_ps pd512_andnot_ps
#define _mm512_unpacklo_ps pd512_unpacklo_ps
#define _mm512_unpackhi_ps pd512_unpackhi_ps
#define _mm512_fmadd_ps pd512_fmadd_ps
#define _mm512_fnmadd_ps pd512_fnmadd_ps
#define _mm512_castsi512_ps pd512_castsi512_ps
#define _mm512_castps_si512 pd512_castps_si512
#define _mm512_cvtss_f32 pd512_cvtss_f32
#undef _mm512_shuffle_ps
#define _mm512_shuffle_ps pd512_shuffle_ps
#undef _mm512_roundscale_ps
#define _mm512_roundscale_ps pd512_roundscale_ps
#undef _mm512_shuffle_f32x4
#define _mm512_shuffle_f32x4 pd512_shuffle_f32x4
#define _mm512_scalef_ps pd512_scalef_ps
#define _mm512_mask_mov_ps pd512_mask_mov_ps
#define _mm512_maskz_mov_ps pd512_maskz_mov_ps
#define _mm512_mask_mov_epi32 pd512_mask_mov_epi32
#undef _mm512_cmp_ps_mask
#define _mm512_cmp_ps_mask pd512_cmp_ps_mask
#undef _mm512_mask_cmp_ps_mask
#define _mm512_mask_cmp_ps_mask pd512_mask_cmp_ps_mask
#define _mm512_mask_storeu_ps pd512_mask_storeu_ps
#define _mm512_reduce_add_ps pd512_reduce_add_ps
#define _mm512_reduce_max_ps pd512_reduce_max_ps
#define _mm512_mask_reduce_max_ps pd512_mask_reduce_max_ps
#define _mm512_set1_epi32 pd512_set1_epi32
#define _mm512_set1_epi8 pd512_set1_epi8
#define _mm512_setzero_si512 pd512_setzero_si512
#define _mm512_loadu_si512 pd512_loadu_si512
#define _mm512_storeu_si512 pd512_storeu_si512
#define _mm512_and_si512 pd512_and_si512
#define _mm512_andnot_si512 pd512_andnot_si512
#define _mm512_or_si512 pd512_or_si512
#define _mm512_add_epi32 pd512_add_epi32
#define _mm512_sub_epi32 pd512_sub_epi32
#undef _mm512_slli_epi32
#define _mm512_slli_epi32 pd512_slli_epi32
#undef _mm512_srli_epi32
#define _mm512_srli_epi32 pd512_srli_epi32
#undef _mm512_srai_epi32
#define _mm512_srai_epi32 pd512_srai_epi32
#undef _mm512_srli_epi16
#define _mm512_srli_epi16 pd512_srli_epi16
#define _mm512_cvtps_epi32 pd512_cvtps_epi32
#define _mm512_cvtepi32_ps pd512_cvtepi32_ps
#define _mm512_cvtepu16_epi32 pd512_cvtepu16_epi32
#define _mm512_cvtepi8_epi32 pd512_cvtepi8_epi32
#define _mm512_cvtsepi32_epi8 pd512_cvtsepi32_epi8
#define _mm512_cvtepi32_epi16 pd512_cvtepi32_epi16
#define _mm512_cvtph_ps pd512_cvtph_ps
#undef _mm512_cvtps_ph
#define _mm512_cvtps_ph pd512_cvtps_ph
#define _mm512_cvtneps_pbh pd512_cvtneps_pbh
#define _mm512_cvtne2ps_pbh pd512_cvtne2ps_pbh
#define _mm512_maskz_loadu_epi16 pd512_maskz_loadu_epi16
#define _mm256_maskz_loadu_epi16 pd256_maskz_loadu_epi16
#define _mm256_mask_storeu_epi16 pd256_mask_storeu_epi16
#define _mm512_dpbusd_epi32 pd512_dpbusd_epi32
#define _mm512_dpbf16_ps pd512_dpbf16_ps

#endif
