/* y = x W^T (+ bias) for a few rows of x: the decode steps of a small batch.
 *
 * oneDNN's and MKL's fp32 GEMMs are tuned for many rows; at 1-16 rows (a decode step with few
 * sequences running) they reach a fraction of what streaming the weight allows. Here each thread
 * takes a slice of W's rows (output features), NR at a time, and for every MR rows of x keeps the
 * NR x MR dot products in registers while it walks K: every weight vector is loaded once per MR
 * rows of x and used MR times, and the NR weight rows (a few KB) stay in L1 for the next MR rows.
 * W is read from memory once per call. Layouts: x [m, k] with rows x_stride apart, W [n, k] and y
 * [m, n] contiguous, all fp32.
 */
#include <stdint.h>

enum { SKINNY_OK = 0, SKINNY_BAD_SHAPE = -1, SKINNY_UNSUPPORTED = -2 };

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

enum { MR = 4, NR = 3 };

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* The mr x NR block of y at rows x[0..mr) and weight rows w[0..NR) (mr is a constant at each call,
 * so the accumulators stay in registers); weight rows past n_valid alias valid ones (their sums are
 * computed and dropped). */
static inline __attribute__((always_inline)) void block(const float *const *x, int mr,
                                                        const float *const w[NR], int64_t k, float *y,
                                                        int64_t y_stride, int n_valid, const float *bias) {
    __m256 acc[MR][NR];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < NR; j++)
            acc[i][j] = _mm256_setzero_ps();
    int64_t kk = 0;
    for (; kk + 8 <= k; kk += 8) {
        __m256 w0 = _mm256_loadu_ps(w[0] + kk), w1 = _mm256_loadu_ps(w[1] + kk),
               w2 = _mm256_loadu_ps(w[2] + kk);
        for (int i = 0; i < mr; i++) {
            __m256 xv = _mm256_loadu_ps(x[i] + kk);
            acc[i][0] = _mm256_fmadd_ps(xv, w0, acc[i][0]);
            acc[i][1] = _mm256_fmadd_ps(xv, w1, acc[i][1]);
            acc[i][2] = _mm256_fmadd_ps(xv, w2, acc[i][2]);
        }
    }
    for (int i = 0; i < mr; i++) {
        for (int j = 0; j < n_valid; j++) {
            float sum = hsum(acc[i][j]);
            for (int64_t t = kk; t < k; t++)
                sum += x[i][t] * w[j][t];
            y[i * y_stride + j] = bias ? sum + bias[j] : sum;
        }
    }
}

int skinny_linear_f32(const float *x, int64_t x_stride, const float *w, const float *bias, float *y,
                      int64_t m, int64_t n, int64_t k, int num_threads) {
    if (m < 1 || n < 1 || k < 1 || x_stride < k)
        return SKINNY_BAD_SHAPE;
    int64_t num_tiles = (n + NR - 1) / NR;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t tile = 0; tile < num_tiles; tile++) {
        int64_t n0 = tile * NR;
        int n_valid = n - n0 < NR ? (int)(n - n0) : NR;
        const float *wr[NR];
        for (int j = 0; j < NR; j++)
            wr[j] = w + (n0 + (j < n_valid ? j : 0)) * k;
        const float *b = bias ? bias + n0 : 0;
        int64_t m0 = 0;
        for (; m0 < m; ) {  /* rows in blocks of 4, then 2, then 1 */
            const float *xr[MR];
            for (int i = 0; i < MR; i++)
                xr[i] = x + (m0 + i) * x_stride;
            if (m - m0 >= 4) {
                block(xr, 4, wr, k, y + m0 * n + n0, n, n_valid, b);
                m0 += 4;
            } else if (m - m0 >= 2) {
                block(xr, 2, wr, k, y + m0 * n + n0, n, n_valid, b);
                m0 += 2;
            } else {
                block(xr, 1, wr, k, y + m0 * n + n0, n, n_valid, b);
                m0 += 1;
            }
        }
    }
    return SKINNY_OK;
}

int skinny_linear_supported(void) { return 1; }

#else

int skinny_linear_f32(const float *x, int64_t x_stride, const float *w, const float *bias, float *y,
                      int64_t m, int64_t n, int64_t k, int num_threads) {
    (void)x; (void)x_stride; (void)w; (void)bias; (void)y; (void)m; (void)n; (void)k; (void)num_threads;
    return SKINNY_UNSUPPORTED;
}

int skinny_linear_supported(void) { return 0; }

#endif
