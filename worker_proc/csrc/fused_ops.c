/* The elementwise steps of a decoder layer, each one pass over its rows, fp32, for the CPU:
 *   add_rms_norm: residual = x + residual (in x's buffer), out = residual * rsqrt(mean(residual^2)
 *                 + eps) * weight, as Hugging Face's LlamaRMSNorm computes it in fp32;
 *   silu_mul:     out = silu(gate) * up over a fused gate_up projection's two halves;
 *   rotary:       q and k heads rotated in place by each token's cos / signed sin
 *                 (x * cos + swap_halves(x) * signed_sin, HF's rotate_half form).
 * torch runs each as two to four kernels, each a full pass over memory (the 2048-row step of a
 * prefill chunk moves 25 MB per silu pass), with a temporary in between; here a row stays in L1
 * from its first read to its last write. Rows are split over OpenMP threads.
 */
#include <math.h>
#include <stdint.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* exp(x) for 8 lanes within 2 ulp (Cody-Waite range reduction, degree-5 minimax polynomial);
 * under -87.3 it is 2^-126, over 88 it saturates to +inf. */
static inline __m256 exp8(__m256 x) {
    const __m256 hi = _mm256_set1_ps(88.3762626647949f), lo = _mm256_set1_ps(-87.3365447505531f);
    x = _mm256_min_ps(_mm256_max_ps(x, lo), hi);
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#define VECTOR 1
#else
#define VECTOR 0
#endif

int fused_ops_vectorised(void) { return VECTOR; }

void add_rms_norm_f32(float *x, const float *residual, const float *weight, float *out, int64_t rows,
                      int64_t dim, float eps, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t r = 0; r < rows; r++) {
        float *h = x + r * dim;
        const float *res = residual ? residual + r * dim : 0;
        float *o = out + r * dim;
        float squares = 0.0f;
        int64_t i = 0;
#if VECTOR
        __m256 acc = _mm256_setzero_ps();
        for (; i + 8 <= dim; i += 8) {
            __m256 v = _mm256_loadu_ps(h + i);
            if (res) {
                v = _mm256_add_ps(v, _mm256_loadu_ps(res + i));
                _mm256_storeu_ps(h + i, v);
            }
            acc = _mm256_fmadd_ps(v, v, acc);
        }
        squares = hsum8(acc);
#endif
        for (; i < dim; i++) {
            float v = res ? h[i] + res[i] : h[i];
            h[i] = v;
            squares += v * v;
        }
        float scale = 1.0f / sqrtf(squares / (float)dim + eps);
        i = 0;
#if VECTOR
        __m256 s = _mm256_set1_ps(scale);
        for (; i + 8 <= dim; i += 8)
            _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(h + i), s),
                                                  _mm256_loadu_ps(weight + i)));
#endif
        for (; i < dim; i++)
            o[i] = (h[i] * scale) * weight[i];
    }
}

void silu_mul_f32(const float *gate_up, float *out, int64_t rows, int64_t inter, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gate_up + r * 2 * inter, *u = g + inter;
        float *o = out + r * inter;
        int64_t i = 0;
#if VECTOR
        const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
        for (; i + 8 <= inter; i += 8) {
            __m256 v = _mm256_loadu_ps(g + i);
            __m256 silu = _mm256_div_ps(v, _mm256_add_ps(one, exp8(_mm256_sub_ps(zero, v))));
            _mm256_storeu_ps(o + i, _mm256_mul_ps(silu, _mm256_loadu_ps(u + i)));
        }
#endif
        for (; i < inter; i++)
            o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}

/* x: [tokens][heads][head_dim], token rows x_stride floats apart; cos, signed_sin: [tokens][head_dim]. */
void rotary_f32(float *x, int64_t x_stride, const float *cos, const float *signed_sin, int64_t tokens,
                int64_t heads, int64_t head_dim, int num_threads) {
    int64_t half = head_dim / 2;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t t = 0; t < tokens; t++) {
        const float *c = cos + t * head_dim, *s = signed_sin + t * head_dim;
        for (int64_t h = 0; h < heads; h++) {
            float *a = x + t * x_stride + h * head_dim, *b = a + half;
            int64_t i = 0;
#if VECTOR
            for (; i + 8 <= half; i += 8) {
                __m256 va = _mm256_loadu_ps(a + i), vb = _mm256_loadu_ps(b + i);
                __m256 na = _mm256_add_ps(_mm256_mul_ps(va, _mm256_loadu_ps(c + i)),
                                          _mm256_mul_ps(vb, _mm256_loadu_ps(s + i)));
                __m256 nb = _mm256_add_ps(_mm256_mul_ps(vb, _mm256_loadu_ps(c + half + i)),
                                          _mm256_mul_ps(va, _mm256_loadu_ps(s + half + i)));
                _mm256_storeu_ps(a + i, na);
                _mm256_storeu_ps(b + i, nb);
            }
#endif
            for (; i < half; i++) {
                float va = a[i], vb = b[i];
                a[i] = va * c[i] + vb * s[i];
                b[i] = vb * c[half + i] + va * s[half + i];
            }
        }
    }
}
