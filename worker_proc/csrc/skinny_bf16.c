/* y = x W^T (+ bias) in bf16 on AVX512-BF16, for the rows of a decode step.
 *
 * oneDNN's bf16 GEMM reaches a fraction of what streaming the weight allows at 1-16 rows, and of
 * what the dot-product unit computes at 32-64 (docs/benchmarks.md, "Decode linears in bf16").
 * Here W is stored once in panels of 16 output features as bf16 pairs, k-major: panel p holds
 * W[16p..16p+15, :] as [k / 2][16][2], so one pair of inputs of a panel is one 64-byte vector, the
 * operand of one dpbf16 (16 lanes, each the dot product of two inputs with two weights, added to an
 * fp32 sum). x's rows are read as pairs too: one 4-byte broadcast per row and pair. A tile keeps
 * MR rows x 32 outputs (two panels) in 12 accumulators: 12 dot products per two weight loads.
 * The threads claim tiles one at a time; every row group passes over a tile while it is in L1/L2,
 * so W is read from memory once per call. Sums stay fp32 until the output, rounded to nearest even
 * (as oneDNN rounds its bf16 output); the bias, if any, is added before that rounding.
 * Layouts: x [m, k] bf16 with rows x_stride elements apart, k even; panels [ceil(n / 16), k / 2,
 * 16, 2] (the last panel's missing features zero); bias bf16 [n] or NULL; y [m, n] contiguous bf16.
 */
#include <stdint.h>
#include <string.h>
#include "layer_kernels.h"

enum { BF16_OK = 0, BF16_BAD_SHAPE = -1, BF16_UNSUPPORTED = -2 };

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#include <immintrin.h>

/* PREFETCH_BYTES: how far ahead of its loads a tile asks for a panel's next weights into L2, so that
 * they stream in while the rows compute on the ones loaded (as in skinny_tiles.h): 1.04-1.09x on
 * one decode step's linears at 1-32 rows, 1.02-1.04x at 64-128 (docs/benchmarks.md, "Decode
 * linears: the next weights while computing"). */
enum { MR = 6, PANEL = 16, TILE_PANELS = 2, PREFETCH_BYTES = 4096 };

/* The first n_valid of 16 fp32 lanes to dst as bf16, plus bias (bf16, or NULL) before rounding. */
static inline void store_row(uint16_t *dst, const uint16_t *bias, int n_valid, __m512 sum) {
    __mmask16 valid = n_valid >= PANEL ? 0xFFFF : (__mmask16)((1u << n_valid) - 1);
    if (bias) {
        __m256i b = _mm256_maskz_loadu_epi16(valid, bias);
        sum = _mm512_add_ps(sum, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16)));
    }
    _mm256_mask_storeu_epi16(dst, valid, (__m256i)_mm512_cvtneps_pbh(sum));
}

/* Rows [0, mr) of x against panels p0 .. p0 + panels - 1 (1 or 2) over all k / 2 pairs. mr and
 * panels are constants at each call, so the accumulators stay in registers. */
static inline __attribute__((always_inline)) void tile(const uint16_t *x, int64_t x_stride, int mr,
                                                       const uint16_t *panel0, int64_t pairs, int panels,
                                                       uint16_t *y, int64_t y_stride, int64_t n0, int64_t n,
                                                       const uint16_t *bias) {
    __m512 acc[MR][TILE_PANELS];
#pragma GCC unroll 6
    for (int i = 0; i < mr; i++)
        acc[i][0] = acc[i][1] = _mm512_setzero_ps();
    const uint16_t *panel1 = panel0 + pairs * 2 * PANEL;
    for (int64_t t = 0; t < pairs; t++) {
        __m512bh w0, w1;
        memcpy(&w0, panel0 + t * 2 * PANEL, sizeof w0);
        /* a hint, which never faults; the address is made as an integer, as it may lie past W */
        _mm_prefetch((const char *)((uintptr_t)(panel0 + t * 2 * PANEL) + PREFETCH_BYTES), _MM_HINT_T1);
        if (panels == 2) {
            memcpy(&w1, panel1 + t * 2 * PANEL, sizeof w1);
            _mm_prefetch((const char *)((uintptr_t)(panel1 + t * 2 * PANEL) + PREFETCH_BYTES), _MM_HINT_T1);
        }
#pragma GCC unroll 6
        for (int i = 0; i < mr; i++) {
            int32_t pair;
            memcpy(&pair, x + i * x_stride + 2 * t, sizeof pair);
            __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
            acc[i][0] = _mm512_dpbf16_ps(acc[i][0], xv, w0);
            if (panels == 2) acc[i][1] = _mm512_dpbf16_ps(acc[i][1], xv, w1);
        }
    }
#pragma GCC unroll 6
    for (int i = 0; i < mr; i++)
        for (int p = 0; p < panels; p++) {
            int64_t first = n0 + p * PANEL;
            int n_valid = n - first < PANEL ? (int)(n - first) : PANEL;
            store_row(y + i * y_stride + first, bias ? bias + first : NULL, n_valid, acc[i][p]);
        }
}

/* Every row of x against one tile, in groups of at most MR rows as even as they divide (8 rows are
 * two groups of 4, not 6 and 2: a group of few rows has too few sums in flight to hide dpbf16's
 * latency). */
static inline __attribute__((always_inline)) void rows_by_tile(const uint16_t *x, int64_t x_stride, int64_t m,
                                                               const uint16_t *panel0, int64_t pairs,
                                                               int panels, uint16_t *y, int64_t n0, int64_t n,
                                                               const uint16_t *bias) {
    int64_t groups = (m + MR - 1) / MR;
    for (int64_t g = 0, m0 = 0; g < groups; g++) {
        int64_t m1 = m * (g + 1) / groups;
        const uint16_t *xr = x + m0 * x_stride;
        uint16_t *yr = y + m0 * n;
        int mr = (int)(m1 - m0);
        m0 = m1;
        switch (mr) {
        case 1: tile(xr, x_stride, 1, panel0, pairs, panels, yr, n, n0, n, bias); break;
        case 2: tile(xr, x_stride, 2, panel0, pairs, panels, yr, n, n0, n, bias); break;
        case 3: tile(xr, x_stride, 3, panel0, pairs, panels, yr, n, n0, n, bias); break;
        case 4: tile(xr, x_stride, 4, panel0, pairs, panels, yr, n, n0, n, bias); break;
        case 5: tile(xr, x_stride, 5, panel0, pairs, panels, yr, n, n0, n, bias); break;
        default: tile(xr, x_stride, MR, panel0, pairs, panels, yr, n, n0, n, bias); break;
        }
    }
}

int skinny_linear_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *panels, const uint16_t *bias,
                       uint16_t *y, int64_t m, int64_t n, int64_t k, int num_threads) {
    if (m < 1 || n < 1 || k < 2 || k % 2 || x_stride < k)
        return BF16_BAD_SHAPE;
    num_threads = num_threads < 1 ? 1 : num_threads;
    int64_t num_panels = (n + PANEL - 1) / PANEL, pairs = k / 2;
    int64_t tiles = (num_panels + TILE_PANELS - 1) / TILE_PANELS;
    /* tiles claimed one at a time: a thread whose core another process takes holds the call up by
     * one tile, not by half of the call (docs/benchmarks.md, "Work the threads claim as they go") */
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t t = 0; t < tiles; t++) {
        int64_t p0 = t * TILE_PANELS;
        const uint16_t *panel0 = panels + p0 * pairs * 2 * PANEL;
        if (num_panels - p0 >= 2) rows_by_tile(x, x_stride, m, panel0, pairs, 2, y, p0 * PANEL, n, bias);
        else rows_by_tile(x, x_stride, m, panel0, pairs, 1, y, p0 * PANEL, n, bias);
    }
    return BF16_OK;
}

int skinny_linear_bf16_supported(void) { return 1; }

#else

int skinny_linear_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *panels, const uint16_t *bias,
                       uint16_t *y, int64_t m, int64_t n, int64_t k, int num_threads) {
    (void)x; (void)x_stride; (void)panels; (void)bias; (void)y; (void)m; (void)n; (void)k; (void)num_threads;
    return BF16_UNSUPPORTED;
}

int skinny_linear_bf16_supported(void) { return 0; }

#endif
