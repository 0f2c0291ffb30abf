/* y = x W^T (+ bias) on the CPU's fp32 vector units: the rows of a decode step, and on a CPU
 * whose widest fp32 vectors are AVX2's, every step.
 *
 * oneDNN's and MKL's fp32 GEMMs are tuned for many rows; at 1-64 rows (a decode step) they reach a
 * fraction of what this CPU computes, and at 1-16 a fraction of what streaming the weight allows.
 * Here W is stored once in panels of PANEL output features, k-major: panel p holds W[16p..16p+15, :]
 * as [k][16], so one k of a panel is two 8-lane vectors (skinny_pack in layers/skinny.py writes it).
 * Each tile keeps MR rows x 16 outputs in 12 registers and broadcasts one x element per row and k:
 * 12 FMAs per two weight loads (skinny_tiles.h; the rows split into tiles as evenly as they divide,
 * and one or two rows take two panels at once, so that few tiles keep fewer than 8 FMA chains: a
 * tile of 3 rows keeps 6, and a lone panel of one or two rows 2 or 4).
 *
 * Up to PACK_ROWS rows: x is packed once as [k][MR] per tile (one k of a tile is one 24-byte
 * read), then the threads claim panels two at a time; for each block of KC inputs, the panel's
 * block (at most 48 KB) stays in L1 or L2 while every tile of x passes over it. W is read from
 * memory once per call. More rows: the threads claim blocks of at most MC rows, copy each block of
 * KC inputs of them into their own buffer as [k][MR] per tile (one k of a tile is then one 24-byte
 * read, and the block stays in L2), and run every panel over it. Both paths sum a row's products
 * over the same blocks of KC inputs, each in order, so a row's output is the same bit for bit
 * whatever the number of rows beside it: a request's logits do not depend on the rest of its step
 * (blocks of 256 inputs for the first path cost 2-7% at 65-256 rows in the second, and 1536 in
 * both measured the same as 256 did at 1-64 rows). Claimed work, not fixed shares: a
 * thread whose core another process takes holds the call up by a block, not by half of it
 * (docs/benchmarks.md, "Work the threads claim as they go"). On the default model's shapes at 2048
 * rows this runs at 1.1-1.3x oneDNN's fp32 rate on an AVX2-only CPU (docs/benchmarks.md, "Prompt
 * linears"). Layouts: x [m, k] with rows x_stride apart, panels [ceil(n / 16), k, 16] (the last
 * panel's missing features zero), y [m, n] contiguous, all fp32; or, through skinny_linear_f32_w16,
 * the panels bf16 with each panel's features in the order skinny.WIDE_ORDER gives them.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "layer_kernels.h"

enum { SKINNY_OK = 0, SKINNY_BAD_SHAPE = -1, SKINNY_UNSUPPORTED = -2, SKINNY_NO_MEMORY = -3 };

#if defined(__AVX2__) && defined(__FMA__)
#include "skinny_tiles.h"

enum { KC = 1536, PACK_ROWS = 64, MC = 96 };

/* The rows of tile g of m rows: ceil(m / MR) tiles as even as they divide (7 rows: 3 + 4, 8: 4 + 4,
 * 13: 4 + 4 + 5), not MR each and the rest last. A tile of r rows keeps 2r FMA chains, and 2-6
 * chains leave the FMA units waiting on their latency: 6 + 1 rows took 1.7x as long as 6 rows, 3 + 4
 * take 1.3x (docs/benchmarks.md, "Decode linears"). The tile a row lands in never changes a bit of
 * its output. Returns the tile's row count; *r0 is its first row. */
static inline int tile_of(int64_t m, int64_t g, int64_t *r0) {
    int64_t tiles = (m + MR - 1) / MR;
    *r0 = m * g / tiles;
    return (int)(m * (g + 1) / tiles - *r0);
}

/* Every row of x against one k block of one panel, tile by tile (tile_of); x packed as in tile,
 * tile g at x + g * mr_step. */
static inline __attribute__((always_inline)) void rows_by_panel(const float *x, int64_t mr_step, int64_t m,
                                                                const void *panel,
                                                                int64_t kc, float *y, int64_t y_stride,
                                                                int n_valid, int first, const float *bias,
                                                                const int W16) {
    for (int64_t g = 0; g * MR < m; g++) {
        int64_t r0;
        int mr = tile_of(m, g, &r0);
        const float *xr = x + g * mr_step;
        float *yr = y + r0 * y_stride;
        switch (mr) {
        case 1: tile(xr, 1, panel, 0, kc, yr, y_stride, n_valid, first, bias, W16, 1); break;
        case 2: tile(xr, 2, panel, 0, kc, yr, y_stride, n_valid, first, bias, W16, 1); break;
        case 3: tile(xr, 3, panel, 0, kc, yr, y_stride, n_valid, first, bias, W16, 1); break;
        case 4: tile(xr, 4, panel, 0, kc, yr, y_stride, n_valid, first, bias, W16, 1); break;
        case 5: tile(xr, 5, panel, 0, kc, yr, y_stride, n_valid, first, bias, W16, 1); break;
        default: tile(xr, MR, panel, 0, kc, yr, y_stride, n_valid, first, bias, W16, 1); break;
        }
    }
}

/* Tile g of rows [m0, m1) of x, inputs [k0, k0 + kc), into dst as [kc][MR] (a short tile keeps the
 * stride; its missing rows are never read). */
static void pack_tile(const float *x, int64_t x_stride, int64_t m0, int64_t m1, int64_t g, int64_t k0,
                      int64_t kc, float *dst) {
    int64_t r0;
    int mr = tile_of(m1 - m0, g, &r0);
    for (int i = 0; i < mr; i++) {
        const float *src = x + (m0 + r0 + i) * x_stride + k0;
        for (int64_t t = 0; t < kc; t++)
            dst[t * MR + i] = src[t];
    }
}

/* Rows [m0, m1) of x, inputs [k0, k0 + kc), into buf tile by tile, tile g at buf + g * MR * kc. */
static void pack_rows(const float *x, int64_t x_stride, int64_t m0, int64_t m1, int64_t k0, int64_t kc,
                      float *buf) {
    for (int64_t g = 0; g * MR < m1 - m0; g++)
        pack_tile(x, x_stride, m0, m1, g, k0, kc, buf + g * MR * kc);
}

/* The path for more than PACK_ROWS rows (see the top of the file). The threads claim blocks of at
 * most MC rows one at a time, so that one whose core another process takes for a while (the
 * frontend, the scheduler) holds up the call by a block instead of half of it; the block count is
 * a multiple of the thread count (unless there are fewer groups of MR rows than that) and the
 * blocks' group counts differ by at most one, so that on a quiet machine each thread gets about as
 * many rows (2048 rows: 22 blocks of 90-96, not 21 of 96 and one of 32). */
static inline __attribute__((always_inline)) int packed_rows(const float *x, int64_t x_stride,
                                                             const void *panels, const float *bias,
                                                             float *y, int64_t m, int64_t n, int64_t k,
                                                             int num_threads, const int W16) {
    const int bytes = W16 ? 2 : 4;
    int64_t num_panels = (n + PANEL - 1) / PANEL, groups = (m + MR - 1) / MR, claimed = 0;
    int64_t blocks = (m + MC - 1) / MC;
    blocks = (blocks + num_threads - 1) / num_threads * num_threads;
    blocks = blocks < groups ? blocks : groups;  /* block b: groups [b * groups / blocks, (b + 1) * ...) */
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        float *buf = aligned_alloc(64, (size_t)MC * KC * sizeof(float));
        failed = buf == NULL;
        while (buf != NULL) {
            int64_t b;
#pragma omp atomic capture
            b = claimed++;
            if (b >= blocks) break;
            int64_t m0 = b * groups / blocks * MR, m1 = (b + 1) * groups / blocks * MR;
            m1 = m1 < m ? m1 : m;
            for (int64_t k0 = 0; k0 < k; k0 += KC) {
                int64_t kc = k - k0 < KC ? k - k0 : KC;
                pack_rows(x, x_stride, m0, m1, k0, kc, buf);
                for (int64_t p = 0; p < num_panels; p++) {
                    int64_t n0 = p * PANEL;
                    int n_valid = n - n0 < PANEL ? (int)(n - n0) : PANEL;
                    const float *b = bias && k0 + kc == k ? bias + n0 : 0;
                    rows_by_panel(buf, MR * kc, m1 - m0, (const char *)panels + (p * k + k0) * PANEL * bytes,
                                  kc, y + m0 * n + n0, n, n_valid, k0 == 0, b, W16);
                }
            }
        }
        free(buf);
    }
    return failed ? SKINNY_NO_MEMORY : SKINNY_OK;
}

static inline __attribute__((always_inline)) int linear(const float *x, int64_t x_stride, const void *panels,
                                                        const float *bias, float *y, int64_t m, int64_t n,
                                                        int64_t k, int num_threads, const int W16) {
    if (m < 1 || n < 1 || k < 1 || x_stride < k)
        return SKINNY_BAD_SHAPE;
    num_threads = num_threads < 1 ? 1 : num_threads;
    if (m > PACK_ROWS)
        return packed_rows(x, x_stride, panels, bias, y, m, n, k, num_threads, W16);
    const int bytes = W16 ? 2 : 4;
    int64_t num_panels = (n + PANEL - 1) / PANEL, groups = (m + MR - 1) / MR;
    /* x packed once as [group][k][MR]: one k of a tile is one 24-byte read, for every panel */
    float *packed = aligned_alloc(64, ((size_t)groups * MR * k * sizeof(float) + 63) / 64 * 64);
    if (packed == NULL) return SKINNY_NO_MEMORY;
#pragma omp parallel num_threads(num_threads)
    {
#pragma omp for schedule(static)
        for (int64_t g = 0; g < groups; g++)
            pack_tile(x, x_stride, 0, m, g, 0, k, packed + g * MR * k);
        /* (the loop's barrier: every group packed) panels claimed two at a time: see packed_rows */
#pragma omp for schedule(dynamic, 1)
        for (int64_t p0 = 0; p0 < num_panels; p0 += 2) {
            const int pair = m <= 2 && p0 + 1 < num_panels;  /* one or two rows: both panels in one tile */
            for (int64_t p = p0; p < p0 + 2 && p < num_panels; p += 1 + pair) {
                int64_t n0 = p * PANEL, n1 = n0 + (1 + pair) * PANEL;
                int n_valid = n < n1 ? (int)(n - n1 + PANEL) : PANEL;  /* of the last panel */
                for (int64_t k0 = 0; k0 < k; k0 += KC) {
                    int64_t kc = k - k0 < KC ? k - k0 : KC;
                    const float *b = bias && k0 + kc == k ? bias + n0 : 0, *xk = packed + k0 * MR;
                    const char *panel = (const char *)panels + (p * k + k0) * PANEL * bytes;
                    if (!pair) rows_by_panel(xk, MR * k, m, panel, kc, y + n0, n, n_valid, k0 == 0, b, W16);
                    else if (m == 1) tile(xk, 1, panel, k * PANEL * bytes, kc, y + n0, n, n_valid, k0 == 0, b, W16, 2);
                    else tile(xk, 2, panel, k * PANEL * bytes, kc, y + n0, n, n_valid, k0 == 0, b, W16, 2);
                }
            }
        }
    }
    free(packed);
    return SKINNY_OK;
}

int skinny_linear_f32(const float *x, int64_t x_stride, const float *panels, const float *bias, float *y,
                      int64_t m, int64_t n, int64_t k, int num_threads) {
    return linear(x, x_stride, panels, bias, y, m, n, k, num_threads, 0);
}

/* The same product from bf16 panels (pack_panels of a weight whose every value bf16 holds
 * exactly): each weight is widened exactly as it loads, so y equals skinny_linear_f32's bit for
 * bit, from half the bytes. */
int skinny_linear_f32_w16(const float *x, int64_t x_stride, const uint16_t *panels, const float *bias,
                          float *y, int64_t m, int64_t n, int64_t k, int num_threads) {
    return linear(x, x_stride, panels, bias, y, m, n, k, num_threads, 1);
}

int skinny_linear_supported(void) { return 1; }

/* 1 when no wider fp32 vectors than AVX2's were compiled for (-march of an AVX2-only CPU, or an
 * avx2 cap): oneDNN has nothing wider either, and this kernel then serves steps of every size. */
int skinny_linear_all_rows(void) {
#ifdef __AVX512F__
    return 0;
#else
    return 1;
#endif
}

#else

int skinny_linear_f32(const float *x, int64_t x_stride, const float *panels, const float *bias, float *y,
                      int64_t m, int64_t n, int64_t k, int num_threads) {
    (void)x; (void)x_stride; (void)panels; (void)bias; (void)y; (void)m; (void)n; (void)k; (void)num_threads;
    return SKINNY_UNSUPPORTED;
}

int skinny_linear_f32_w16(const float *x, int64_t x_stride, const uint16_t *panels, const float *bias,
                          float *y, int64_t m, int64_t n, int64_t k, int num_threads) {
    (void)x; (void)x_stride; (void)panels; (void)bias; (void)y; (void)m; (void)n; (void)k; (void)num_threads;
    return SKINNY_UNSUPPORTED;
}

int skinny_linear_supported(void) { return 0; }

int skinny_linear_all_rows(void) { return 0; }

#endif
