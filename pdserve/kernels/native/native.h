/* Helpers the native kernels share (static inline: each translation unit its own copy). */
#ifndef PDSERVE_NATIVE_H
#define PDSERVE_NATIVE_H

#include <immintrin.h>

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

#endif
