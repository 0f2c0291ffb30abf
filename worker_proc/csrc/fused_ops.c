/* The elementwise steps of a decoder layer, each one pass over its rows, fp32 or bf16, for the CPU:
 *   add_rms_norm: residual = x + residual (in x's buffer), out = residual * rsqrt(mean(residual^2)
 *                 + eps) * weight, as Hugging Face's LlamaRMSNorm computes it in fp32;
 *   silu_mul:     out = silu(gate) * up over a fused gate_up projection's two halves;
 *   rotary:       q and k heads rotated in place by each token's cos / signed sin
 *                 (x * cos + swap_halves(x) * signed_sin, HF's rotate_half form).
 * torch runs each as two to four kernels, each a full pass over memory (the 2048-row step of a
 * prefill chunk moves 25 MB per silu pass), with a temporary in between; here a row stays in L1
 * from its first read to its last write. Rows are split over OpenMP threads.
 * bf16 rows are widened to fp32 as they are loaded and rounded (to nearest even) where torch's bf16
 * kernels round, so the results are torch's own: the sum x + residual, the norm once at the end,
 * silu(gate) before the product, x * cos before the rotation's sum.
 */
#include <math.h>
#include <stdint.h>

#include "bf16.h"
#include "layer_kernels.h"

#if defined(__AVX2__) && defined(__FMA__)
#include "avx2_lanes.h"

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* 8 elements from element i of p, as fp32; stored back rounded to p's dtype */
ALWAYS_INLINE __m256 load_at(const void *p, int64_t i, const int BF16) {
    return load8((const char *)p + i * (BF16 ? 2 : 4), BF16);
}
ALWAYS_INLINE void store_at(void *p, int64_t i, __m256 v, const int BF16) {
    store8((char *)p + i * (BF16 ? 2 : 4), v, BF16);
}
ALWAYS_INLINE __m256 rounded8(__m256 v, const int BF16) { return BF16 ? round_to_bf16(v) : v; }
#define VECTOR 1
#else
#define ALWAYS_INLINE static inline __attribute__((always_inline))
#define VECTOR 0
#endif

int fused_ops_vectorised(void) { return VECTOR; }

/* one element of p (fp32 or bf16) as fp32, and back */
ALWAYS_INLINE float get(const void *p, int64_t i, const int BF16) {
    return BF16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}
ALWAYS_INLINE void put(void *p, int64_t i, float v, const int BF16) {
    if (BF16) ((uint16_t *)p)[i] = f32_to_bf16(v);
    else ((float *)p)[i] = v;
}
ALWAYS_INLINE float rounded(float v, const int BF16) { return BF16 ? bf16_to_f32(f32_to_bf16(v)) : v; }

ALWAYS_INLINE void add_rms_norm(void *x, const void *residual, const void *weight, void *out, int64_t rows,
                                int64_t dim, float eps, int num_threads, const int BF16) {
    const int bytes = BF16 ? 2 : 4;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t r = 0; r < rows; r++) {
        char *h = (char *)x + r * dim * bytes, *o = (char *)out + r * dim * bytes;
        const char *res = residual ? (const char *)residual + r * dim * bytes : 0;
        float squares = 0.0f;
        int64_t i = 0;
#if VECTOR
        __m256 acc = _mm256_setzero_ps();
        for (; i + 8 <= dim; i += 8) {
            __m256 v = load_at(h, i, BF16);
            if (res) {
                v = rounded8(_mm256_add_ps(v, load_at(res, i, BF16)), BF16);
                store_at(h, i, v, BF16);
            }
            acc = _mm256_fmadd_ps(v, v, acc);
        }
        squares = hsum8(acc);
#endif
        for (; i < dim; i++) {
            float v = res ? rounded(get(h, i, BF16) + get(res, i, BF16), BF16) : get(h, i, BF16);
            put(h, i, v, BF16);
            squares += v * v;
        }
        float scale = 1.0f / sqrtf(squares / (float)dim + eps);
        i = 0;
#if VECTOR
        __m256 s = _mm256_set1_ps(scale);
        for (; i + 8 <= dim; i += 8)
            store_at(o, i, _mm256_mul_ps(_mm256_mul_ps(load_at(h, i, BF16), s), load_at(weight, i, BF16)), BF16);
#endif
        for (; i < dim; i++)
            put(o, i, (get(h, i, BF16) * scale) * get(weight, i, BF16), BF16);
    }
}

ALWAYS_INLINE void silu_mul(const void *gate_up, void *out, int64_t rows, int64_t inter, int num_threads,
                            const int BF16) {
    const int bytes = BF16 ? 2 : 4;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t r = 0; r < rows; r++) {
        const char *g = (const char *)gate_up + r * 2 * inter * bytes, *u = g + inter * bytes;
        char *o = (char *)out + r * inter * bytes;
        int64_t i = 0;
#if VECTOR
        const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
        for (; i + 8 <= inter; i += 8) {
            __m256 v = load_at(g, i, BF16);
            __m256 silu = _mm256_div_ps(v, _mm256_add_ps(one, exp256(_mm256_sub_ps(zero, v))));
            store_at(o, i, _mm256_mul_ps(rounded8(silu, BF16), load_at(u, i, BF16)), BF16);
        }
#endif
        for (; i < inter; i++) {
            float v = get(g, i, BF16);
            put(o, i, rounded(v / (1.0f + expf(-v)), BF16) * get(u, i, BF16), BF16);
        }
    }
}

/* x: [tokens][heads][head_dim], token rows x_stride elements apart; cos, signed_sin: [tokens][head_dim]. */
ALWAYS_INLINE void rotary(void *x, int64_t x_stride, const void *cos, const void *signed_sin, int64_t tokens,
                          int64_t heads, int64_t head_dim, int num_threads, const int BF16) {
    const int bytes = BF16 ? 2 : 4;
    int64_t half = head_dim / 2;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t t = 0; t < tokens; t++) {
        const char *c = (const char *)cos + t * head_dim * bytes, *s = (const char *)signed_sin + t * head_dim * bytes;
        for (int64_t h = 0; h < heads; h++) {
            char *a = (char *)x + (t * x_stride + h * head_dim) * bytes, *b = a + half * bytes;
            int64_t i = 0;
#if VECTOR
            for (; i + 8 <= half; i += 8) {
                __m256 va = load_at(a, i, BF16), vb = load_at(b, i, BF16);
                __m256 na = _mm256_add_ps(rounded8(_mm256_mul_ps(va, load_at(c, i, BF16)), BF16),
                                          _mm256_mul_ps(vb, load_at(s, i, BF16)));
                __m256 nb = _mm256_add_ps(rounded8(_mm256_mul_ps(vb, load_at(c, half + i, BF16)), BF16),
                                          _mm256_mul_ps(va, load_at(s, half + i, BF16)));
                store_at(a, i, na, BF16);
                store_at(b, i, nb, BF16);
            }
#endif
            for (; i < half; i++) {
                float va = get(a, i, BF16), vb = get(b, i, BF16);
                put(a, i, rounded(va * get(c, i, BF16), BF16) + vb * get(s, i, BF16), BF16);
                put(b, i, rounded(vb * get(c, half + i, BF16), BF16) + va * get(s, half + i, BF16), BF16);
            }
        }
    }
}

void add_rms_norm_f32(float *x, const float *residual, const float *weight, float *out, int64_t rows,
                      int64_t dim, float eps, int num_threads) {
    add_rms_norm(x, residual, weight, out, rows, dim, eps, num_threads, 0);
}
void add_rms_norm_bf16(uint16_t *x, const uint16_t *residual, const uint16_t *weight, uint16_t *out,
                       int64_t rows, int64_t dim, float eps, int num_threads) {
    add_rms_norm(x, residual, weight, out, rows, dim, eps, num_threads, 1);
}
void silu_mul_f32(const float *gate_up, float *out, int64_t rows, int64_t inter, int num_threads) {
    silu_mul(gate_up, out, rows, inter, num_threads, 0);
}
void silu_mul_bf16(const uint16_t *gate_up, uint16_t *out, int64_t rows, int64_t inter, int num_threads) {
    silu_mul(gate_up, out, rows, inter, num_threads, 1);
}
void rotary_f32(float *x, int64_t x_stride, const float *cos, const float *signed_sin, int64_t tokens,
                int64_t heads, int64_t head_dim, int num_threads) {
    rotary(x, x_stride, cos, signed_sin, tokens, heads, head_dim, num_threads, 0);
}
void rotary_bf16(uint16_t *x, int64_t x_stride, const uint16_t *cos, const uint16_t *signed_sin, int64_t tokens,
                 int64_t heads, int64_t head_dim, int num_threads) {
    rotary(x, x_stride, cos, signed_sin, tokens, heads, head_dim, num_threads, 1);
}
