/* AVX-512 paged attention for a block of consecutive queries of one member (a prefill chunk's)
 * against one KV head: fp32 on FMA, bf16 on AVX512-BF16's dpbf16, which multiplies pairs of bf16
 * into fp32 sums. The block's R rows (queries x GQA group, at most WIDE_BLOCK_ROWS) lie along the
 * lanes of NV 16-lane vectors.
 *   q.k  The rows are held transposed, [head_dim][R] in fp32 and [head_dim / 2][R] in bf16 (a pair
 *        of bf16 is one 32-bit lane), and each K row's element (pair), broadcast, is multiplied into
 *        the R rows of PP positions at once: PP x NV accumulators, no horizontal sums. The scale is
 *        applied to the fp32 sums, so a bf16 q is not rounded again.
 *   softmax  Down each position's row vectors, as the AVX2 block path (attend_avx2_blocks.c); bf16
 *        probabilities, rounded as the torch reference rounds them, are stored as pairs of
 *        positions, [position / 2][R], over the scores they came from.
 *   p.v  PV_ROWS rows x all of head_dim per pass over a chunk of PV_POSITIONS positions. In bf16 the
 *        V rows of two positions are interleaved by unpack (which permutes the head_dim lanes,
 *        undone once per output row, as the AVX512 decode path does) and each row's probability
 *        pair is broadcast; in fp32 each row's probability.
 * Every K and V row is read from memory once for the whole block. */
#include "paged_attention.h"

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <math.h>

#include "avx512_lanes.h"

#define WIDE_LANES 16                               /* fp32 lanes of a 512-bit vector */
#define WIDE_VECTORS (WIDE_BLOCK_ROWS / WIDE_LANES) /* 16-lane vectors per position's row */
#define MAX_SUMS (MAX_HEAD_DIM / WIDE_LANES)        /* p.v accumulators per row */
#define PV_ROWS 6                                   /* p.v rows per pass up to head_dim 64 (24 accumulators) */
#define PV_POSITIONS 64                             /* p.v positions per chunk: 8 KB of bf16 V at head_dim 64 */

/* Scaled scores of positions [0, npad) of NV * 16 rows: scores[p][NV * 16]. qt: [steps][NV * 16] lanes
 * of q, one element (fp32) or one pair (bf16) of head_dim per step. Row offsets are in elements. */
ALWAYS_INLINE void wide_scores(const char *keys, const int64_t *rows, int npad, const int32_t *qt, float scale,
                               float *scores, const int NV, const int PP, const int steps, const int BF16) {
    const int width = WIDE_LANES * NV, bytes = BF16 ? 2 : 4;
    for (int start = 0; start < npad; start += PP) {
        const int32_t *k[WIDE_BLOCK_TILE];
        for (int i = 0; i < PP; i++) k[i] = (const int32_t *)(keys + rows[start + i] * bytes);
        __m512 acc[WIDE_BLOCK_TILE][WIDE_VECTORS];
        for (int i = 0; i < PP; i++)
            for (int v = 0; v < NV; v++) acc[i][v] = _mm512_setzero_ps();
        for (int d = 0; d < steps; d++) {
            __m512i column[WIDE_VECTORS];
            for (int v = 0; v < NV; v++) column[v] = _mm512_loadu_si512(qt + d * width + WIDE_LANES * v);
            for (int i = 0; i < PP; i++) {
                __m512i key = _mm512_set1_epi32(k[i][d]);  /* a pair of bf16, or one fp32's bits */
                for (int v = 0; v < NV; v++)
                    acc[i][v] = BF16 ? dot_pairs(acc[i][v], column[v], key)
                                     : _mm512_fmadd_ps(_mm512_castsi512_ps(column[v]), _mm512_castsi512_ps(key), acc[i][v]);
            }
        }
        for (int i = 0; i < PP; i++)
            for (int v = 0; v < NV; v++)
                _mm512_storeu_ps(scores + (start + i) * width + WIDE_LANES * v, _mm512_mul_ps(acc[i][v], _mm512_set1_ps(scale)));
    }
}
/* scores -> unnormalised probabilities over positions [0, n), zero past row r's n_of[r] (every row
 * sees its first n_min positions); each row's sum in total[r]. fp32: in place. bf16: rounded, as
 * pairs of positions: row pair j, [width] 32-bit lanes of (p = 2j, p = 2j + 1), overwrites scores
 * row j. */
ALWAYS_INLINE void wide_softmax(float *scores, int n, int n_min, const int *n_of, float *total, const int NV,
                                const int BF16) {
    const int width = WIDE_LANES * NV, step = BF16 ? 2 : 1;
    __m512i limit[WIDE_VECTORS];
    __m512 top[WIDE_VECTORS], sum[WIDE_VECTORS];
    for (int v = 0; v < NV; v++) {
        limit[v] = _mm512_loadu_si512(n_of + WIDE_LANES * v);
        top[v] = _mm512_set1_ps(-INFINITY), sum[v] = _mm512_setzero_ps();
    }
    for (int p = 0; p < n; p++)
        for (int v = 0; v < NV; v++) {
            __mmask16 seen = p < n_min ? 0xFFFF : _mm512_cmpgt_epi32_mask(limit[v], _mm512_set1_epi32(p));
            top[v] = _mm512_mask_max_ps(top[v], seen, top[v], _mm512_loadu_ps(scores + p * width + WIDE_LANES * v));
        }
    /* bf16 element 2l is lane l of position 2j, element 2l + 1 lane l of position 2j + 1 */
    static const int16_t pairing[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                        8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
    for (int p = 0; p < n; p += step)
        for (int v = 0; v < NV; v++) {
            __m512 e[2];
            for (int j = 0; j < step; j++) {
                int q = p + j;
                __mmask16 seen = q >= n ? 0 : q < n_min ? 0xFFFF : _mm512_cmpgt_epi32_mask(limit[v], _mm512_set1_epi32(q));
                __m512 s = _mm512_loadu_ps(scores + (q < n ? q : p) * width + WIDE_LANES * v);
                e[j] = _mm512_maskz_mov_ps(seen, exp512(_mm512_sub_ps(s, top[v])));
                sum[v] = _mm512_add_ps(sum[v], e[j]);
            }
            if (BF16)
                _mm512_storeu_si512(scores + (p / 2) * width + WIDE_LANES * v,
                                    _mm512_permutexvar_epi16(_mm512_loadu_si512(pairing), round_pairs(e[1], e[0])));
            else
                _mm512_storeu_ps(scores + p * width + WIDE_LANES * v, e[0]);
        }
    for (int v = 0; v < NV; v++) _mm512_storeu_ps(total + WIDE_LANES * v, sum[v]);
}
/* out rows [r0, r0 + RG) (stride MAX_HEAD_DIM; in bf16 head_dim's lanes permuted by unpack) += the
 * probability-weighted V rows of steps [j0, j1): positions in fp32, pairs of positions in bf16. A
 * sums per row: head_dim / 16. */
ALWAYS_INLINE void wide_values(const char *values, const int64_t *rows, int j0, int j1, const int32_t *probs,
                               float *out, int r0, const int RG, const int NV, const int A, const int BF16) {
    const int width = WIDE_LANES * NV;
    __m512 acc[PV_ROWS][MAX_SUMS];
    for (int i = 0; i < RG; i++)
        for (int a = 0; a < A; a++) acc[i][a] = _mm512_loadu_ps(out + (r0 + i) * MAX_HEAD_DIM + WIDE_LANES * a);
    for (int j = j0; j < j1; j++) {
        __m512i row[MAX_SUMS];
        for (int a = 0; a < A; a += 1 + BF16) {
            if (!BF16) {
                row[a] = _mm512_loadu_si512(values + (rows[j] + WIDE_LANES * a) * 4);
                continue;
            }  /* bf16: 32 dims of positions 2j and 2j + 1 into lo (row[a]) and hi (row[a + 1]) pairs */
            __m512i x = _mm512_loadu_si512(values + (rows[2 * j] + WIDE_LANES * a) * 2);
            __m512i y = _mm512_loadu_si512(values + (rows[2 * j + 1] + WIDE_LANES * a) * 2);
            row[a] = _mm512_unpacklo_epi16(x, y), row[a + 1] = _mm512_unpackhi_epi16(x, y);
        }
        for (int i = 0; i < RG; i++) {
            __m512i weight = _mm512_set1_epi32(probs[j * width + r0 + i]);  /* a bf16 pair, or an fp32's bits */
            for (int a = 0; a < A; a++)
                acc[i][a] = BF16 ? dot_pairs(acc[i][a], row[a], weight)
                                 : _mm512_fmadd_ps(_mm512_castsi512_ps(weight), _mm512_castsi512_ps(row[a]), acc[i][a]);
        }
    }
    for (int i = 0; i < RG; i++)
        for (int a = 0; a < A; a++) _mm512_storeu_ps(out + (r0 + i) * MAX_HEAD_DIM + WIDE_LANES * a, acc[i][a]);
}
ALWAYS_INLINE void wide_values_tile(const char *values, const int64_t *rows, int j0, int j1, const int32_t *probs,
                                    float *out, int r0, int rg, const int NV, const int A, const int BF16) {
    switch (rg) {
    case 1: wide_values(values, rows, j0, j1, probs, out, r0, 1, NV, A, BF16); break;
    case 2: wide_values(values, rows, j0, j1, probs, out, r0, 2, NV, A, BF16); break;
    case 3: wide_values(values, rows, j0, j1, probs, out, r0, 3, NV, A, BF16); break;
    case 4: wide_values(values, rows, j0, j1, probs, out, r0, 4, NV, A, BF16); break;
    case 5: wide_values(values, rows, j0, j1, probs, out, r0, 5, NV, A, BF16); break;
    default: wide_values(values, rows, j0, j1, probs, out, r0, PV_ROWS, NV, A, BF16);
    }
}
/* count consecutive queries of one member against one KV head: R = count x group rows in NV vectors,
 * head_dim = 16 * A. scratch: block_scratch_bytes(the block's longest context). */
ALWAYS_INLINE void wide_rows(const Args *a, int64_t first, int count, int kv_head, float *scratch,
                             const int NV, const int A, const int BF16) {
    const int G = a->num_heads / a->num_kv_heads, R = count * G, width = WIDE_LANES * NV, dim = WIDE_LANES * A;
    const int bytes = BF16 ? 2 : 4, steps = BF16 ? dim / 2 : dim, PP = WIDE_BLOCK_TILE / NV;  /* 24 accumulators */
    int n_min, n_of[WIDE_BLOCK_ROWS];
    const int n = block_contexts(a, first, count, width, n_of, &n_min);
    const int npad = (n + PP - 1) / PP * PP;  /* even: PP is */
    float *scores = scratch, *out = scores + (int64_t)npad * width, total[WIDE_BLOCK_ROWS];
    int64_t *rows = (int64_t *)(out + WIDE_BLOCK_ROWS * MAX_HEAD_DIM);
    block_row_offsets(a, first, n, npad, dim, rows);
    const int64_t head = (int64_t)kv_head * a->num_slots * dim * bytes;
    const char *keys = (const char *)a->k_cache + head, *values = (const char *)a->v_cache + head;
    int32_t qt[MAX_HEAD_DIM * WIDE_BLOCK_ROWS];
    for (int r = 0; r < width; r++) {
        const int32_t *q = NULL;  /* a row's elements (fp32) or pairs (bf16) as 32-bit lanes */
        if (r < R)
            q = (const int32_t *)((const char *)a->q + ((first + r / G) * a->q_token_stride
                                                        + ((int64_t)kv_head * G + r % G) * dim) * bytes);
        for (int d = 0; d < steps; d++) qt[d * width + r] = q == NULL ? 0 : q[d];
    }
    wide_scores(keys, rows, npad, qt, a->scale, scores, NV, PP, steps, BF16);
    wide_softmax(scores, n, n_min, n_of, total, NV, BF16);
    for (int r = 0; r < R; r++) memset(out + r * MAX_HEAD_DIM, 0, dim * sizeof *out);
    const int32_t *probs = (const int32_t *)scores;
    const int num_steps = BF16 ? (n + 1) / 2 : n, chunk = BF16 ? PV_POSITIONS / 2 : PV_POSITIONS;
    const int pass = A <= 4 ? PV_ROWS : PV_ROWS / 2;  /* at most 24 accumulators */
    for (int j0 = 0; j0 < num_steps; j0 += chunk)
        for (int r0 = 0; r0 < R; r0 += pass) {
            int j1 = j0 + chunk < num_steps ? j0 + chunk : num_steps;
            wide_values_tile(values, rows, j0, j1, probs, out, r0, R - r0 < pass ? R - r0 : pass, NV, A, BF16);
        }
    for (int r = 0; r < R; r++) {
        char *o = (char *)a->out + ((first + r / G) * a->num_heads + (int64_t)kv_head * G + r % G) * dim * bytes;
        __m512 inverse = _mm512_set1_ps(1.0f / total[r]);
        for (int c = 0; c < A; c += 1 + BF16) {
            __m512 x = _mm512_loadu_ps(out + r * MAX_HEAD_DIM + WIDE_LANES * c);
            if (!BF16) {
                _mm512_storeu_ps(o + WIDE_LANES * c * 4, _mm512_mul_ps(x, inverse));
                continue;
            }
            __m512 d0, d1;
            unpermute_pairs(x, _mm512_loadu_ps(out + r * MAX_HEAD_DIM + WIDE_LANES * (c + 1)), &d0, &d1);
            _mm512_storeu_si512(o + WIDE_LANES * c * 2, round_pairs(_mm512_mul_ps(d1, inverse), _mm512_mul_ps(d0, inverse)));
        }
    }
}
#define VARIANT(A, B) \
    static void wide_##B##_##A(const Args *a, int64_t f, int k, int h, float *s) {                \
        if (k * (a->num_heads / a->num_kv_heads) <= WIDE_LANES) wide_rows(a, f, k, h, s, 1, A, B); \
        else wide_rows(a, f, k, h, s, 2, A, B);                                                  \
    }
VARIANT(1, 0) VARIANT(2, 0) VARIANT(4, 0) VARIANT(8, 0)
#if defined(__AVX512BF16__)
VARIANT(2, 1) VARIANT(4, 1) VARIANT(8, 1)
#define BF16_BLOCKS {NULL, wide_1_2, wide_1_4, wide_1_8}
#else
#define BF16_BLOCKS {NULL, NULL, NULL, NULL}
#endif

/* The block kernel for these dtypes (q in the cache's) and this shape (blocks of at most
 * WIDE_BLOCK_ROWS / group queries), or NULL: head_dim 16 (fp32 only), 32, 64 or 128; bf16 needs
 * AVX512-BF16. */
AttendBlock avx512_block_variant(enum Dtypes dtypes, int group, int head_dim) {
    static const AttendBlock variants[2][4] = {{wide_0_1, wide_0_2, wide_0_4, wide_0_8}, BF16_BLOCKS};
    int i = head_dim == 16 ? 0 : head_dim == 32 ? 1 : head_dim == 64 ? 2 : head_dim == 128 ? 3 : -1;
    if (dtypes == F32_OVER_BF16 || group < 1 || 2 * group > WIDE_BLOCK_ROWS || i < 0) return NULL;
    return variants[dtypes == ALL_BF16][i];
}
#else
AttendBlock avx512_block_variant(enum Dtypes dtypes, int group, int head_dim) {
    (void)dtypes, (void)group, (void)head_dim;
    return NULL;
}
#endif
