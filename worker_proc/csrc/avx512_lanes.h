/* AVX-512 helpers shared by the AVX512 attention paths (attend_avx512.c: one query;
 * attend_avx512_blocks.c: a block of a prefill chunk's queries): 16 fp32 lanes, and the bf16-pair
 * instructions of AVX512-BF16. Without AVX512-BF16 only the fp32 variants exist, whose BF16 = 0 never
 * calls the bf16 ones. Include only where __AVX512F__ and __AVX512BW__ are defined. */
#ifndef CONVEYOR_AVX512_LANES_H
#define CONVEYOR_AVX512_LANES_H

#include <immintrin.h>
#include <string.h>

#define ALWAYS_INLINE static inline __attribute__((always_inline))

#if defined(__AVX512BF16__)
ALWAYS_INLINE __m512 dot_pairs(__m512 acc, __m512i x, __m512i y) {  /* acc + x.y over bf16 pairs */
    return _mm512_dpbf16_ps(acc, (__m512bh)x, (__m512bh)y);
}
ALWAYS_INLINE __m512 dot_pairs_at(__m512 acc, const void *x, const void *y) {  /* the same, in memory */
    __m512bh a, b;  /* memcpy, not a load and a cast: gcc 12 round-trips that via the stack */
    memcpy(&a, x, sizeof a), memcpy(&b, y, sizeof b);
    return _mm512_dpbf16_ps(acc, a, b);
}
/* bf16 of hi in elements 16..31, of lo in 0..15, rounded to nearest even */
ALWAYS_INLINE __m512i round_pairs(__m512 hi, __m512 lo) { return (__m512i)_mm512_cvtne2ps_pbh(hi, lo); }
ALWAYS_INLINE __m256i round_half(__m512 x) { return (__m256i)_mm512_cvtneps_pbh(x); }
#else
ALWAYS_INLINE __m512 dot_pairs(__m512 acc, __m512i x, __m512i y) { (void)x, (void)y; return acc; }
ALWAYS_INLINE __m512 dot_pairs_at(__m512 acc, const void *x, const void *y) { (void)x, (void)y; return acc; }
ALWAYS_INLINE __m512i round_pairs(__m512 hi, __m512 lo) { (void)hi; return _mm512_castps_si512(lo); }
ALWAYS_INLINE __m256i round_half(__m512 x) { return _mm512_castsi512_si256(_mm512_castps_si512(x)); }
#endif
ALWAYS_INLINE __m512 exp512(__m512 x) {  /* e^x for x <= 0: Cephes polynomial, exponent by scalef */
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    static const float c[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f,
                               1.6666665459e-1f, 5.0000001201e-1f};
    __m512 p = _mm512_set1_ps(c[0]);
    for (int i = 1; i < 6; i++) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c[i]));
    p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}
/* Undo the lane order that unpacking two V rows into bf16 pairs leaves in a 32-dim p.v sum: lo lane
 * 4j + k holds dim 8j + k, hi lane 4j + k dim 8j + 4 + k. *d0 gets dims 0..15, *d1 dims 16..31. */
ALWAYS_INLINE void unpermute_pairs(__m512 lo, __m512 hi, __m512 *d0, __m512 *d1) {
    static const int32_t first[16] = {0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23};
    static const int32_t second[16] = {8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31};
    *d0 = _mm512_permutex2var_ps(lo, _mm512_loadu_si512(first), hi);
    *d1 = _mm512_permutex2var_ps(lo, _mm512_loadu_si512(second), hi);
}

#endif
