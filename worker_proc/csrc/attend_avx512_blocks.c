/* AVX512-BF16 paged attention for a block of consecutive queries of one member (a prefill chunk's)
 * against one KV head, bf16 KV only: both small matmuls of the block run on dpbf16, which multiplies
 * pairs of bf16 into fp32 sums. The block's R rows (queries x GQA group, at most WIDE_BLOCK_ROWS)
 * lie along the lanes of NV 16-lane vectors.
 *   q.k  The rows are held transposed by pairs of head_dim, [head_dim / 2][R] (a pair of bf16 is
 *        one 32-bit lane), and each K row's pair, broadcast, is multiplied into the R rows of PP
 *        positions at once: PP x NV accumulators, no horizontal sums. The scale is applied to the
 *        fp32 sums, so q is not rounded again.
 *   softmax  Down each position's row vectors, as the AVX2 block path (attend_avx2_blocks.c);
 *        the probabilities, rounded to bf16 as the torch reference rounds them, are stored as
 *        pairs of positions, [position / 2][R], over the scores they came from.
 *   p.v  PV_ROWS rows x all of head_dim per pass over a chunk of PV_POSITIONS positions: the V rows
 *        of two positions interleaved by unpack (which permutes the head_dim lanes, undone once
 *        per output row, as the AVX512 decode path does), each row's probability pair broadcast.
 * Every K and V row is read from memory once for the whole block. */
#include "paged_attention.h"

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#include <math.h>

#define ALWAYS_INLINE static inline __attribute__((always_inline))
#define WIDE_LANES 16                               /* fp32 lanes of a 512-bit vector */
#define WIDE_VECTORS (WIDE_BLOCK_ROWS / WIDE_LANES) /* 16-lane vectors per position's row */
#define PV_ROWS 6                                   /* p.v rows per pass at head_dim 64 (4 accumulators each) */
#define PV_POSITIONS 64                             /* p.v positions per chunk: 8 KB of V rows at head_dim 64 */

ALWAYS_INLINE __m512 dot_pairs(__m512 acc, __m512i x, __m512i y) {  /* acc + x.y over bf16 pairs */
    return _mm512_dpbf16_ps(acc, (__m512bh)x, (__m512bh)y);
}
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
/* Scaled scores of positions [0, npad) of NV * 16 rows: scores[p][NV * 16]. qt: [dim / 2][NV * 16]
 * pairs. Row offsets are in elements; C: 64-byte chunks (32 elements) per row. */
ALWAYS_INLINE void wide_scores(const uint16_t *keys, const int64_t *rows, int npad, const int32_t *qt,
                               float scale, float *scores, const int NV, const int PP, const int C) {
    const int pairs = 16 * C, width = WIDE_LANES * NV;
    for (int start = 0; start < npad; start += PP) {
        const int32_t *k[WIDE_BLOCK_TILE];
        for (int i = 0; i < PP; i++) k[i] = (const int32_t *)(keys + rows[start + i]);
        __m512 acc[WIDE_BLOCK_TILE][WIDE_VECTORS];
        for (int i = 0; i < PP; i++)
            for (int v = 0; v < NV; v++) acc[i][v] = _mm512_setzero_ps();
        for (int d = 0; d < pairs; d++) {
            __m512i column[WIDE_VECTORS];
            for (int v = 0; v < NV; v++) column[v] = _mm512_loadu_si512(qt + d * width + WIDE_LANES * v);
            for (int i = 0; i < PP; i++) {
                __m512i key = _mm512_set1_epi32(k[i][d]);
                for (int v = 0; v < NV; v++) acc[i][v] = dot_pairs(acc[i][v], column[v], key);
            }
        }
        for (int i = 0; i < PP; i++)
            for (int v = 0; v < NV; v++)
                _mm512_storeu_ps(scores + (start + i) * width + WIDE_LANES * v, _mm512_mul_ps(acc[i][v], _mm512_set1_ps(scale)));
    }
}
/* scores -> unnormalised bf16 probabilities over positions [0, n), zero past row r's n_of[r] (every
 * row sees its first n_min positions), written as pairs of positions: row pair j of the result,
 * [width] 32-bit lanes of (p = 2j, p = 2j + 1), overwrites scores row j. Each row's sum in total[r]. */
ALWAYS_INLINE void wide_softmax(float *scores, int n, int n_min, const int *n_of, float *total, const int NV) {
    const int width = WIDE_LANES * NV;
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
    const __m512i order = _mm512_loadu_si512(pairing);
    for (int p = 0; p < n; p += 2)
        for (int v = 0; v < NV; v++) {
            __m512 e[2];
            for (int j = 0; j < 2; j++) {
                int q = p + j;
                __mmask16 seen = q >= n ? 0 : q < n_min ? 0xFFFF : _mm512_cmpgt_epi32_mask(limit[v], _mm512_set1_epi32(q));
                __m512 s = _mm512_loadu_ps(scores + (q < n ? q : p) * width + WIDE_LANES * v);
                e[j] = _mm512_maskz_mov_ps(seen, exp512(_mm512_sub_ps(s, top[v])));
                sum[v] = _mm512_add_ps(sum[v], e[j]);
            }
            __m512i packed = (__m512i)_mm512_cvtne2ps_pbh(e[1], e[0]);  /* e[0] in elements 0..15 */
            _mm512_storeu_si512(scores + (p / 2) * width + WIDE_LANES * v, _mm512_permutexvar_epi16(order, packed));
        }
    for (int v = 0; v < NV; v++) _mm512_storeu_ps(total + WIDE_LANES * v, sum[v]);
}
/* out rows [r0, r0 + RG) (stride MAX_HEAD_DIM, head_dim lanes permuted by unpack) += sum over the
 * position pairs [j0, j1) of pairs[j][r] . (V[2j], V[2j + 1]) */
ALWAYS_INLINE void wide_values(const uint16_t *values, const int64_t *rows, int j0, int j1, const int32_t *pairs,
                               float *out, int r0, const int RG, const int NV, const int C) {
    const int width = WIDE_LANES * NV;
    __m512 lo[PV_ROWS][4], hi[PV_ROWS][4];
    for (int i = 0; i < RG; i++)
        for (int c = 0; c < C; c++) {
            lo[i][c] = _mm512_loadu_ps(out + (r0 + i) * MAX_HEAD_DIM + 32 * c);
            hi[i][c] = _mm512_loadu_ps(out + (r0 + i) * MAX_HEAD_DIM + 32 * c + WIDE_LANES);
        }
    for (int j = j0; j < j1; j++) {
        __m512i even[4], odd[4];
        for (int c = 0; c < C; c++) {
            __m512i r0v = _mm512_loadu_si512(values + rows[2 * j] + 32 * c);
            __m512i r1v = _mm512_loadu_si512(values + rows[2 * j + 1] + 32 * c);
            even[c] = _mm512_unpacklo_epi16(r0v, r1v), odd[c] = _mm512_unpackhi_epi16(r0v, r1v);
        }
        for (int i = 0; i < RG; i++) {
            __m512i weight = _mm512_set1_epi32(pairs[j * width + r0 + i]);
            for (int c = 0; c < C; c++) {
                lo[i][c] = dot_pairs(lo[i][c], even[c], weight);
                hi[i][c] = dot_pairs(hi[i][c], odd[c], weight);
            }
        }
    }
    for (int i = 0; i < RG; i++)
        for (int c = 0; c < C; c++) {
            _mm512_storeu_ps(out + (r0 + i) * MAX_HEAD_DIM + 32 * c, lo[i][c]);
            _mm512_storeu_ps(out + (r0 + i) * MAX_HEAD_DIM + 32 * c + WIDE_LANES, hi[i][c]);
        }
}
ALWAYS_INLINE void wide_values_tile(const uint16_t *values, const int64_t *rows, int j0, int j1, const int32_t *pairs,
                                    float *out, int r0, int rg, const int NV, const int C) {
    switch (rg) {
    case 1: wide_values(values, rows, j0, j1, pairs, out, r0, 1, NV, C); break;
    case 2: wide_values(values, rows, j0, j1, pairs, out, r0, 2, NV, C); break;
    case 3: wide_values(values, rows, j0, j1, pairs, out, r0, 3, NV, C); break;
    case 4: wide_values(values, rows, j0, j1, pairs, out, r0, 4, NV, C); break;
    case 5: wide_values(values, rows, j0, j1, pairs, out, r0, 5, NV, C); break;
    default: wide_values(values, rows, j0, j1, pairs, out, r0, PV_ROWS, NV, C);
    }
}
/* count consecutive queries of one member against one KV head: R = count x group rows in NV vectors,
 * rows of C 64-byte chunks. scratch: block_scratch_bytes(the block's longest context). */
ALWAYS_INLINE void wide_rows(const Args *a, int64_t first, int count, int kv_head, float *scratch,
                             const int NV, const int C) {
    const int G = a->num_heads / a->num_kv_heads, R = count * G, width = WIDE_LANES * NV, dim = 32 * C;
    const int PP = WIDE_BLOCK_TILE / NV;  /* 24 or 12 positions: 24 accumulators */
    int n = 1, n_min = a->context_lens[first], n_of[WIDE_BLOCK_ROWS];
    for (int j = 0; j < count; j++) {
        int lens = a->context_lens[first + j];
        n = lens > n ? lens : n, n_min = lens < n_min ? lens : n_min;
    }
    for (int r = 0; r < width; r++) n_of[r] = r < R ? a->context_lens[first + r / G] : n;
    const int npad = (n + PP - 1) / PP * PP;  /* even: PP is */
    float *scores = scratch, *out = scores + (int64_t)npad * width, total[WIDE_BLOCK_ROWS];
    int64_t *rows = (int64_t *)(out + WIDE_BLOCK_ROWS * MAX_HEAD_DIM);
    const int32_t *table = table_of(a, first);
    for (int p = 0, block = 0, offset = 0; p < npad; p++) {  /* past n: the last position again */
        rows[p] = p < n ? ((int64_t)table[block] * a->block_size + offset) * dim : rows[n - 1];
        if (++offset == a->block_size) offset = 0, block++;
    }
    const int64_t head = (int64_t)kv_head * a->num_slots * dim;
    const uint16_t *keys = (const uint16_t *)a->k_cache + head, *values = (const uint16_t *)a->v_cache + head;
    int32_t qt[MAX_HEAD_DIM / 2 * WIDE_BLOCK_ROWS];
    for (int r = 0; r < width; r++) {
        const int32_t *q = NULL;
        if (r < R)
            q = (const int32_t *)((const uint16_t *)a->q + (first + r / G) * a->q_token_stride
                                  + ((int64_t)kv_head * G + r % G) * dim);
        for (int d = 0; d < dim / 2; d++) qt[d * width + r] = q == NULL ? 0 : q[d];
    }
    wide_scores(keys, rows, npad, qt, a->scale, scores, NV, PP, C);
    wide_softmax(scores, n, n_min, n_of, total, NV);
    for (int r = 0; r < R; r++) memset(out + r * MAX_HEAD_DIM, 0, dim * sizeof *out);
    const int32_t *pairs = (const int32_t *)scores;
    const int num_pairs = (n + 1) / 2, step = C <= 2 ? PV_ROWS : PV_ROWS / 2;  /* at most 24 accumulators */
    for (int j0 = 0; j0 < num_pairs; j0 += PV_POSITIONS / 2)
        for (int r0 = 0; r0 < R; r0 += step) {
            int j1 = j0 + PV_POSITIONS / 2 < num_pairs ? j0 + PV_POSITIONS / 2 : num_pairs;
            wide_values_tile(values, rows, j0, j1, pairs, out, r0, R - r0 < step ? R - r0 : step, NV, C);
        }
    /* per 32 dims: lo lane 4j + k holds dim 8j + k, hi lane 4j + k holds dim 8j + 4 + k */
    static const int32_t first_half[16] = {0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23};
    static const int32_t second_half[16] = {8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31};
    for (int r = 0; r < R; r++) {
        uint16_t *o = (uint16_t *)a->out + ((first + r / G) * a->num_heads + (int64_t)kv_head * G + r % G) * dim;
        __m512 inverse = _mm512_set1_ps(1.0f / total[r]);
        for (int c = 0; c < C; c++) {
            __m512 x = _mm512_loadu_ps(out + r * MAX_HEAD_DIM + 32 * c);
            __m512 y = _mm512_loadu_ps(out + r * MAX_HEAD_DIM + 32 * c + WIDE_LANES);
            __m512 d0 = _mm512_mul_ps(_mm512_permutex2var_ps(x, _mm512_loadu_si512(first_half), y), inverse);
            __m512 d1 = _mm512_mul_ps(_mm512_permutex2var_ps(x, _mm512_loadu_si512(second_half), y), inverse);
            _mm512_storeu_si512(o + 32 * c, (__m512i)_mm512_cvtne2ps_pbh(d1, d0));
        }
    }
}
#define VARIANT(C) \
    static void wide_##C(const Args *a, int64_t f, int k, int h, float *s) {                \
        if (k * (a->num_heads / a->num_kv_heads) <= WIDE_LANES) wide_rows(a, f, k, h, s, 1, C); \
        else wide_rows(a, f, k, h, s, 2, C);                                                  \
    }
VARIANT(1) VARIANT(2) VARIANT(4)

/* The block kernel for this dtype and shape (blocks of at most WIDE_BLOCK_ROWS / group queries), or
 * NULL: bf16 with head_dim 32, 64 or 128. */
AttendBlock avx512_block_variant(int bf16, int group, int head_dim) {
    if (!bf16 || group < 1 || 2 * group > WIDE_BLOCK_ROWS) return NULL;
    return head_dim == 32 ? wide_1 : head_dim == 64 ? wide_2 : head_dim == 128 ? wide_4 : NULL;
}
#else
AttendBlock avx512_block_variant(int bf16, int group, int head_dim) {
    (void)bf16, (void)group, (void)head_dim;
    return NULL;
}
#endif
