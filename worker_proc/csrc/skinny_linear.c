/* y = x W^T (+ bias) for the rows of a decode step: 1 to a few dozen rows of x.
 *
 * oneDNN's and MKL's fp32 GEMMs are tuned for many rows; at 1-64 rows (a decode step) they reach a
 * fraction of what this CPU computes, and at 1-16 a fraction of what streaming the weight allows.
 * Here W is stored once in panels of PANEL output features, k-major: panel p holds W[16p..16p+15, :]
 * as [k][16], so one k of a panel is two 8-lane vectors (skinny_pack in layers/skinny.py writes it).
 * Each thread takes a range of panels; for each block of KC inputs, the panel's block (16 KB) stays
 * in L1 while every MR rows of x pass over it, keeping their MR x 16 outputs in 12 registers and
 * broadcasting one x element per row and k: 12 FMAs per two weight loads. W is read from memory once
 * per call. Layouts: x [m, k] with rows x_stride apart, panels [ceil(n / 16), k, 16] (the last
 * panel's missing features zero), y [m, n] contiguous, all fp32.
 */
#include <stdint.h>
#include <string.h>

enum { SKINNY_OK = 0, SKINNY_BAD_SHAPE = -1, SKINNY_UNSUPPORTED = -2 };
enum { PANEL = 16 };

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

enum { MR = 6, KC = 256 };

/* 16 floats from src, of which the first n_valid exist (the rest read as zero). */
static inline void load16(const float *src, int n_valid, __m256 *lo, __m256 *hi) {
    float row[PANEL] = {0};
    if (n_valid < PANEL)
        src = memcpy(row, src, (size_t)n_valid * sizeof(float));
    *lo = _mm256_loadu_ps(src);
    *hi = _mm256_loadu_ps(src + 8);
}

/* The first n_valid of 16 floats to dst. */
static inline void store16(float *dst, int n_valid, __m256 lo, __m256 hi) {
    if (n_valid == PANEL) {
        _mm256_storeu_ps(dst, lo);
        _mm256_storeu_ps(dst + 8, hi);
        return;
    }
    float row[PANEL];
    _mm256_storeu_ps(row, lo);
    _mm256_storeu_ps(row + 8, hi);
    memcpy(dst, row, (size_t)n_valid * sizeof(float));
}

/* Adds (first: stores) the mr x 16 block of x[0..mr) . panel[0..kc) to y; bias (at the last k
 * block only) is added too. mr is a constant at each call, so the accumulators stay in registers;
 * only n_valid of the 16 features are written. */
static inline __attribute__((always_inline)) void tile(const float *x, int64_t x_stride, int mr,
                                                       const float *panel, int64_t kc, float *y,
                                                       int64_t y_stride, int n_valid, int first,
                                                       const float *bias) {
    __m256 lo[MR], hi[MR];
#pragma GCC unroll 6
    for (int i = 0; i < mr; i++)
        lo[i] = hi[i] = _mm256_setzero_ps();
    for (int64_t t = 0; t < kc; t++) {
        __m256 w0 = _mm256_loadu_ps(panel + t * PANEL), w1 = _mm256_loadu_ps(panel + t * PANEL + 8);
#pragma GCC unroll 6
        for (int i = 0; i < mr; i++) {
            __m256 xv = _mm256_broadcast_ss(x + i * x_stride + t);
            lo[i] = _mm256_fmadd_ps(xv, w0, lo[i]);
            hi[i] = _mm256_fmadd_ps(xv, w1, hi[i]);
        }
    }
#pragma GCC unroll 6
    for (int i = 0; i < mr; i++) {
        float *out = y + i * y_stride;
        __m256 add_lo, add_hi;
        if (!first) {
            load16(out, n_valid, &add_lo, &add_hi);
            lo[i] = _mm256_add_ps(lo[i], add_lo);
            hi[i] = _mm256_add_ps(hi[i], add_hi);
        }
        if (bias) {
            load16(bias, n_valid, &add_lo, &add_hi);
            lo[i] = _mm256_add_ps(lo[i], add_lo);
            hi[i] = _mm256_add_ps(hi[i], add_hi);
        }
        store16(out, n_valid, lo[i], hi[i]);
    }
}

/* Every row of x against one k block of one panel, MR rows at a time (the last block shorter). */
static void rows_by_panel(const float *x, int64_t x_stride, int64_t m, const float *panel, int64_t kc,
                          float *y, int64_t y_stride, int n_valid, int first, const float *bias) {
    for (int64_t m0 = 0; m0 < m; m0 += MR) {
        const float *xr = x + m0 * x_stride;
        float *yr = y + m0 * y_stride;
        switch (m - m0 < MR ? (int)(m - m0) : MR) {
        case 1: tile(xr, x_stride, 1, panel, kc, yr, y_stride, n_valid, first, bias); break;
        case 2: tile(xr, x_stride, 2, panel, kc, yr, y_stride, n_valid, first, bias); break;
        case 3: tile(xr, x_stride, 3, panel, kc, yr, y_stride, n_valid, first, bias); break;
        case 4: tile(xr, x_stride, 4, panel, kc, yr, y_stride, n_valid, first, bias); break;
        case 5: tile(xr, x_stride, 5, panel, kc, yr, y_stride, n_valid, first, bias); break;
        default: tile(xr, x_stride, MR, panel, kc, yr, y_stride, n_valid, first, bias); break;
        }
    }
}

int skinny_linear_f32(const float *x, int64_t x_stride, const float *panels, const float *bias, float *y,
                      int64_t m, int64_t n, int64_t k, int num_threads) {
    if (m < 1 || n < 1 || k < 1 || x_stride < k)
        return SKINNY_BAD_SHAPE;
    int64_t num_panels = (n + PANEL - 1) / PANEL;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t p = 0; p < num_panels; p++) {
        int64_t n0 = p * PANEL;
        int n_valid = n - n0 < PANEL ? (int)(n - n0) : PANEL;
        for (int64_t k0 = 0; k0 < k; k0 += KC) {
            int64_t kc = k - k0 < KC ? k - k0 : KC;
            const float *b = bias && k0 + kc == k ? bias + n0 : 0;
            rows_by_panel(x + k0, x_stride, m, panels + (p * k + k0) * PANEL, kc, y + n0, n, n_valid,
                          k0 == 0, b);
        }
    }
    return SKINNY_OK;
}

int skinny_linear_supported(void) { return 1; }

#else

int skinny_linear_f32(const float *x, int64_t x_stride, const float *panels, const float *bias, float *y,
                      int64_t m, int64_t n, int64_t k, int num_threads) {
    (void)x; (void)x_stride; (void)panels; (void)bias; (void)y; (void)m; (void)n; (void)k; (void)num_threads;
    return SKINNY_UNSUPPORTED;
}

int skinny_linear_supported(void) { return 0; }

#endif
