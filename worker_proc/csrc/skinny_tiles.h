/* The register tiles of the fp32 skinny linear (skinny_linear.c): MR rows of packed x against one
 * or two panels of 16 output features over a block of k, the products summed over k in order, so
 * that a row's output does not depend on the tile it lands in. Include only where __AVX2__ and
 * __FMA__ are defined. */
#ifndef CONVEYOR_SKINNY_TILES_H
#define CONVEYOR_SKINNY_TILES_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

/* PREFETCH_BYTES: how far ahead of its loads a tile asks for a panel's next weights into L2. A decode
 * step of a few rows reads each weight from memory once and then computes on it from cache; without
 * the prefetch the two take turns, with it the next block streams in while this one computes:
 * 1.1-1.3x on one decode step's linears at 1-16 rows, 1.05x at 64, prompt steps unchanged
 * (docs/benchmarks.md, "Decode linears: the next weights while computing"). */
enum { PANEL = 16, MR = 6, PREFETCH_BYTES = 4096 };

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

/* One k of a panel as two 8-lane vectors: fp32, or bf16 widened (bf16 is the top half of an fp32:
 * each is interleaved under a zero half, in the feature order skinny.WIDE_ORDER packs). */
static inline __attribute__((always_inline)) void panel_row(const void *panel, int64_t t, __m256 *w0,
                                                            __m256 *w1, const int W16) {
    if (W16) {
        __m256i w = _mm256_loadu_si256((const __m256i *)((const uint16_t *)panel + t * PANEL));
        *w0 = _mm256_castsi256_ps(_mm256_unpacklo_epi16(_mm256_setzero_si256(), w));
        *w1 = _mm256_castsi256_ps(_mm256_unpackhi_epi16(_mm256_setzero_si256(), w));
    } else {
        *w0 = _mm256_loadu_ps((const float *)panel + t * PANEL);
        *w1 = _mm256_loadu_ps((const float *)panel + t * PANEL + 8);
    }
}

/* Adds (first: stores) the mr x 16 NP block of x[0..mr) . panels[0..kc) to y, for NP panels (1, or 2
 * with mr <= MR / 2: the second one panel_step bytes after the first, its outputs 16 columns on;
 * n_valid: of the last panel's features). bias (at the last k block only) is added too. x is a
 * packed group: row i's input t at x[t * MR + i]. mr and NP are constants at each call, so the
 * accumulators stay in registers. A tile of r rows keeps 2 r NP chains of FMAs: with fewer than 8
 * the FMA units wait on their latency, hence two panels for one or two rows (docs/benchmarks.md,
 * "Decode linears"). */
static inline __attribute__((always_inline)) void tile(const float *x, int mr, const void *panel,
                                                       int64_t panel_step, int64_t kc, float *y,
                                                       int64_t y_stride, int n_valid, int first,
                                                       const float *bias, const int W16, const int NP) {
    __m256 lo[MR][2], hi[MR][2];
#pragma GCC unroll 6
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < NP; j++)
            lo[i][j] = hi[i][j] = _mm256_setzero_ps();
    const int64_t row_bytes = PANEL * (W16 ? 2 : 4);
    for (int64_t t = 0; t < kc; t++) {
        __m256 w0[2], w1[2];
        for (int j = 0; j < NP; j++) {
            const char *at = (const char *)panel + j * panel_step;
            panel_row(at, t, &w0[j], &w1[j], W16);
            /* a hint, which never faults; the address is made as an integer, as it may lie past W */
            _mm_prefetch((const char *)((uintptr_t)at + t * row_bytes + PREFETCH_BYTES), _MM_HINT_T1);
        }
#pragma GCC unroll 6
        for (int i = 0; i < mr; i++) {
            __m256 xv = _mm256_broadcast_ss(x + t * MR + i);
            for (int j = 0; j < NP; j++) {
                lo[i][j] = _mm256_fmadd_ps(xv, w0[j], lo[i][j]);
                hi[i][j] = _mm256_fmadd_ps(xv, w1[j], hi[i][j]);
            }
        }
    }
#pragma GCC unroll 6
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < NP; j++) {
            float *out = y + i * y_stride + j * PANEL;
            int valid = j == NP - 1 ? n_valid : PANEL;
            __m256 add_lo, add_hi;
            if (!first) {
                load16(out, valid, &add_lo, &add_hi);
                lo[i][j] = _mm256_add_ps(lo[i][j], add_lo);
                hi[i][j] = _mm256_add_ps(hi[i][j], add_hi);
            }
            if (bias) {
                load16(bias + j * PANEL, valid, &add_lo, &add_hi);
                lo[i][j] = _mm256_add_ps(lo[i][j], add_lo);
                hi[i][j] = _mm256_add_ps(hi[i][j], add_hi);
            }
            store16(out, valid, lo[i][j], hi[i][j]);
        }
}

#endif
