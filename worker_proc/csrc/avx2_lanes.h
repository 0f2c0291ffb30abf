/* AVX2 + FMA helpers shared by the AVX2 attention paths (attend_avx2.c: one query; attend_avx2_blocks.c:
 * a block of a prefill chunk's queries): 8 fp32 lanes. AVX2 has no bf16 arithmetic, so bf16 rows are
 * widened to fp32 as they are loaded (a shift: bf16 is the top half of an fp32). Include only where
 * __AVX2__ and __FMA__ are defined. */
#ifndef CONVEYOR_AVX2_LANES_H
#define CONVEYOR_AVX2_LANES_H

#include <immintrin.h>

#define LANES 8       /* fp32 lanes */
#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* The variants each AVX2 path is built in: V(C, B, Q) for C 8-element chunks per head row (head_dim
 * 16-128), bf16 K/V (B) and bf16 q and output (Q), the three dtype pairs of enum Dtypes; and the
 * table of a path's variants named prefix##BQ_C, indexed [enum Dtypes][head_dim_index]. */
#define FOR_EACH_AVX2_VARIANT(V) \
    V(2, 0, 0) V(4, 0, 0) V(8, 0, 0) V(16, 0, 0) \
    V(2, 1, 1) V(4, 1, 1) V(8, 1, 1) V(16, 1, 1) \
    V(2, 1, 0) V(4, 1, 0) V(8, 1, 0) V(16, 1, 0)
#define AVX2_VARIANT_TABLE(prefix) {{prefix##00_2, prefix##00_4, prefix##00_8, prefix##00_16}, \
                                    {prefix##11_2, prefix##11_4, prefix##11_8, prefix##11_16}, \
                                    {prefix##10_2, prefix##10_4, prefix##10_8, prefix##10_16}}

static inline int head_dim_index(int head_dim) {  /* the vector paths' variant: 16, 32, 64, 128 -> 0..3; else -1 */
    for (int i = 0, dim = 16; i < 4; i++, dim *= 2)
        if (head_dim == dim) return i;
    return -1;
}
ALWAYS_INLINE __m256 load8(const char *p, const int BF16) {  /* 8 elements as fp32 */
    if (!BF16) return _mm256_loadu_ps((const float *)p);
    __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
ALWAYS_INLINE __m256 round_to_bf16(__m256 x) {  /* nearest even; finite inputs */
    __m256i bits = _mm256_castps_si256(x);
    __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    bits = _mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), odd));
    return _mm256_castsi256_ps(_mm256_and_si256(bits, _mm256_set1_epi32((int)0xffff0000u)));
}
ALWAYS_INLINE void store8(char *p, __m256 x, const int BF16) {
    if (!BF16) { _mm256_storeu_ps((float *)p, x); return; }
    __m256i halves = _mm256_srli_epi32(_mm256_castps_si256(round_to_bf16(x)), 16);
    __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(halves, halves), 0x08);
    _mm_storeu_si128((__m128i *)p, _mm256_castsi256_si128(packed));
}
/* e^x within 2 ulp (Cephes: Cody-Waite range reduction, degree-5 polynomial, exponent by shift);
 * under -87.3 it is 2^-126, over 88.4 it saturates to +inf. */
ALWAYS_INLINE __m256 exp256(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3365447505531f)), _mm256_set1_ps(88.3762626647949f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    static const float c[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f,
                               1.6666665459e-1f, 5.0000001201e-1f};
    __m256 p = _mm256_set1_ps(c[0]);
    for (int i = 1; i < 6; i++) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c[i]));
    p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i exponent = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(exponent));
}
ALWAYS_INLINE void transpose8(__m256 x[LANES]) {  /* x[i] lane j -> x[j] lane i */
    __m256 t[LANES], u[LANES];
    for (int i = 0; i < LANES; i += 2) {
        t[i] = _mm256_unpacklo_ps(x[i], x[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(x[i], x[i + 1]);
    }
    for (int i = 0; i < LANES; i += 4) {
        u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44), u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xee);
        u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44), u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xee);
    }
    for (int i = 0; i < 4; i++) {
        x[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
        x[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
    }
}
ALWAYS_INLINE float sum_lanes(__m256 x) {
    float lanes[LANES], total = 0.0f;
    _mm256_storeu_ps(lanes, x);
    for (int i = 0; i < LANES; i++) total += lanes[i];
    return total;
}

#endif
