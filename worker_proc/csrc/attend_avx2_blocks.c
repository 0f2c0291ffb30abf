/* AVX2 + FMA paged attention for a block of consecutive queries of one member (a prefill chunk's)
 * against one KV head, fp32 or bf16 KV, q and out in the cache's dtype or fp32 over a bf16 cache
 * (enum Dtypes): the block's R rows (queries x GQA group, at most BLOCK_ROWS)
 * are one small matmul each way, tiled in registers.
 *   q.k  The rows are held transposed, [head_dim][R] (R rows in NV vectors of 8 lanes), and each
 *        K element, broadcast, is multiplied into the R rows of PP positions at once: PP x NV
 *        accumulators, no horizontal sums. Scores come out position-major, [position][R].
 *   softmax  Runs down each position's row vector, so a row's max, numerators and sum are lane-wise;
 *        a row's positions past its own context (its causal prefix) are masked out.
 *   p.v  6 rows x 16 dims of the output per pass over a chunk of PV_POSITIONS positions, whose V
 *        rows stay in L1 for every pass: 12 FMAs per two V loads and six broadcasts.
 * Every K and V row is read from memory once for the whole block. Probabilities are rounded to bf16
 * before p.v on bf16 models (Q16), as the torch reference rounds them. */
#include "paged_attention.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <math.h>

#include "avx2_lanes.h"

#define MAX_VECTORS (BLOCK_ROWS / LANES)   /* 8-lane vectors per position's row of scores */
#define PV_ROWS 6                          /* p.v rows per register tile (x 16 dims: 12 accumulators) */
#define PV_POSITIONS 64                    /* p.v positions per chunk: 16 KB of fp32 V rows at head_dim 64 */

/* Scaled scores of positions [0, npad) of NV * 8 rows: scores[p][NV * 8]. qt: [dim][NV * 8]. */
ALWAYS_INLINE void block_scores(const char *keys, const int64_t *rows, int npad, const float *qt, float *scores,
                                const int NV, const int PP, const int C, const int BF16) {
    const int dim = LANES * C, width = LANES * NV;
    float widened[BLOCK_TILE][MAX_HEAD_DIM];
    for (int start = 0; start < npad; start += PP) {
        const float *k[BLOCK_TILE];
        for (int i = 0; i < PP; i++) {
            if (!BF16) {
                k[i] = (const float *)keys + rows[start + i];
                continue;
            }
            for (int c = 0; c < C; c++)
                _mm256_storeu_ps(widened[i] + LANES * c, load8(keys + (rows[start + i] + LANES * c) * 2, 1));
            k[i] = widened[i];
        }
        __m256 acc[BLOCK_TILE][MAX_VECTORS];
        for (int i = 0; i < PP; i++)
            for (int v = 0; v < NV; v++) acc[i][v] = _mm256_setzero_ps();
        for (int d = 0; d < dim; d++) {
            __m256 column[MAX_VECTORS];
            for (int v = 0; v < NV; v++) column[v] = _mm256_loadu_ps(qt + d * width + LANES * v);
            for (int i = 0; i < PP; i++) {
                __m256 key = _mm256_broadcast_ss(k[i] + d);
                for (int v = 0; v < NV; v++) acc[i][v] = _mm256_fmadd_ps(key, column[v], acc[i][v]);
            }
        }
        for (int i = 0; i < PP; i++)
            for (int v = 0; v < NV; v++) _mm256_storeu_ps(scores + (start + i) * width + LANES * v, acc[i][v]);
    }
}
/* scores -> unnormalised probabilities in place over positions [0, n): zero past row r's n_of[r]
 * (every row sees its first n_min positions), bf16-rounded where q is bf16 (a bf16 model); each
 * row's sum in total[r]. */
ALWAYS_INLINE void block_softmax(float *scores, int n, int n_min, const int *n_of, float *total,
                                 const int NV, const int Q16) {
    const int width = LANES * NV;
    __m256i limit[MAX_VECTORS];
    __m256 top[MAX_VECTORS], sum[MAX_VECTORS];
    for (int v = 0; v < NV; v++) {
        limit[v] = _mm256_loadu_si256((const __m256i *)(n_of + LANES * v));
        top[v] = _mm256_set1_ps(-INFINITY), sum[v] = _mm256_setzero_ps();
    }
    for (int p = 0; p < n; p++)
        for (int v = 0; v < NV; v++) {
            __m256 s = _mm256_loadu_ps(scores + p * width + LANES * v);
            if (p >= n_min)
                s = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), s,
                                     _mm256_castsi256_ps(_mm256_cmpgt_epi32(limit[v], _mm256_set1_epi32(p))));
            top[v] = _mm256_max_ps(top[v], s);
        }
    for (int p = 0; p < n; p++)
        for (int v = 0; v < NV; v++) {
            float *s = scores + p * width + LANES * v;
            __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(s), top[v]));  /* > 0 input only where masked next */
            if (p >= n_min) e = _mm256_and_ps(e, _mm256_castsi256_ps(_mm256_cmpgt_epi32(limit[v], _mm256_set1_epi32(p))));
            sum[v] = _mm256_add_ps(sum[v], e);
            _mm256_storeu_ps(s, Q16 ? round_to_bf16(e) : e);
        }
    for (int v = 0; v < NV; v++) _mm256_storeu_ps(total + LANES * v, sum[v]);
}
/* out rows [r0, r0 + RG) (stride MAX_HEAD_DIM) += sum over positions [p0, p1) of probs[p][r] * V[p] */
ALWAYS_INLINE void block_values(const char *values, const int64_t *rows, int p0, int p1, const float *probs,
                                float *out, int r0, const int RG, const int NV, const int C, const int BF16) {
    const int dim = LANES * C, width = LANES * NV, bytes = BF16 ? 2 : 4;
    for (int d0 = 0; d0 < dim; d0 += 2 * LANES) {
        __m256 acc[PV_ROWS][2];
        for (int i = 0; i < RG; i++)
            for (int j = 0; j < 2; j++) acc[i][j] = _mm256_loadu_ps(out + (r0 + i) * MAX_HEAD_DIM + d0 + LANES * j);
        for (int p = p0; p < p1; p++) {
            const char *v = values + (rows[p] + d0) * bytes;
            __m256 low = load8(v, BF16), high = load8(v + LANES * bytes, BF16);
            for (int i = 0; i < RG; i++) {
                __m256 weight = _mm256_broadcast_ss(probs + p * width + r0 + i);
                acc[i][0] = _mm256_fmadd_ps(weight, low, acc[i][0]);
                acc[i][1] = _mm256_fmadd_ps(weight, high, acc[i][1]);
            }
        }
        for (int i = 0; i < RG; i++)
            for (int j = 0; j < 2; j++) _mm256_storeu_ps(out + (r0 + i) * MAX_HEAD_DIM + d0 + LANES * j, acc[i][j]);
    }
}
ALWAYS_INLINE void values_tile(const char *values, const int64_t *rows, int p0, int p1, const float *probs,
                               float *out, int r0, int rg, const int NV, const int C, const int BF16) {
    switch (rg) {
    case 1: block_values(values, rows, p0, p1, probs, out, r0, 1, NV, C, BF16); break;
    case 2: block_values(values, rows, p0, p1, probs, out, r0, 2, NV, C, BF16); break;
    case 3: block_values(values, rows, p0, p1, probs, out, r0, 3, NV, C, BF16); break;
    case 4: block_values(values, rows, p0, p1, probs, out, r0, 4, NV, C, BF16); break;
    case 5: block_values(values, rows, p0, p1, probs, out, r0, 5, NV, C, BF16); break;
    default: block_values(values, rows, p0, p1, probs, out, r0, PV_ROWS, NV, C, BF16);
    }
}
/* count consecutive queries of one member against one KV head: R = count x group rows in NV vectors,
 * rows of C 8-element chunks; K/V bf16 (BF16) or fp32, q and out bf16 (Q16) or fp32. scratch:
 * block_scratch_bytes(the block's longest context). */
ALWAYS_INLINE void attend_rows(const Args *a, int64_t first, int count, int kv_head, float *scratch,
                               const int NV, const int C, const int BF16, const int Q16) {
    const int G = a->num_heads / a->num_kv_heads, R = count * G, width = LANES * NV, dim = LANES * C;
    const int bytes = BF16 ? 2 : 4, q_bytes = Q16 ? 2 : 4, PP = BLOCK_TILE / NV;  /* 12, 6 or 4 positions */
    int n_min, n_of[BLOCK_ROWS];
    const int n = block_contexts(a, first, count, width, n_of, &n_min);
    const int npad = (n + PP - 1) / PP * PP;
    float *scores = scratch, *out = scores + (int64_t)npad * width, total[BLOCK_ROWS];
    int64_t *rows = (int64_t *)(out + BLOCK_ROWS * MAX_HEAD_DIM);
    block_row_offsets(a, first, n, npad, dim, rows);
    const int64_t head = (int64_t)kv_head * a->num_slots * dim * bytes;
    const char *keys = (const char *)a->k_cache + head, *values = (const char *)a->v_cache + head;
    float qt[MAX_HEAD_DIM * BLOCK_ROWS];
    for (int r0 = 0; r0 < width; r0 += LANES)
        for (int c = 0; c < C; c++) {  /* 8 rows x 8 dims at a time, transposed in registers */
            __m256 x[LANES];
            for (int i = 0, r = r0; i < LANES; i++, r++) {
                x[i] = _mm256_setzero_ps();
                if (r >= R) continue;
                int64_t q = (first + r / G) * a->q_token_stride + ((int64_t)kv_head * G + r % G) * dim + LANES * c;
                x[i] = _mm256_mul_ps(load8((const char *)a->q + q * q_bytes, Q16), _mm256_set1_ps(a->scale));
            }
            transpose8(x);
            for (int i = 0; i < LANES; i++) _mm256_storeu_ps(qt + (LANES * c + i) * width + r0, x[i]);
        }
    block_scores(keys, rows, npad, qt, scores, NV, PP, C, BF16);
    block_softmax(scores, n, n_min, n_of, total, NV, Q16);
    for (int r = 0; r < R; r++) memset(out + r * MAX_HEAD_DIM, 0, dim * sizeof *out);
    for (int p0 = 0; p0 < n; p0 += PV_POSITIONS)
        for (int r0 = 0; r0 < R; r0 += PV_ROWS) {
            int p1 = p0 + PV_POSITIONS < n ? p0 + PV_POSITIONS : n, rg = R - r0 < PV_ROWS ? R - r0 : PV_ROWS;
            values_tile(values, rows, p0, p1, scores, out, r0, rg, NV, C, BF16);
        }
    for (int r = 0; r < R; r++) {
        char *o = (char *)a->out + (((first + r / G) * a->num_heads + (int64_t)kv_head * G + r % G) * dim) * q_bytes;
        __m256 inverse = _mm256_set1_ps(1.0f / total[r]);
        for (int c = 0; c < C; c++)
            store8(o + LANES * c * q_bytes, _mm256_mul_ps(_mm256_loadu_ps(out + r * MAX_HEAD_DIM + LANES * c), inverse), Q16);
    }
}
#define VARIANT(C, B, Q) \
    static void rows_##B##Q##_##C(const Args *a, int64_t f, int k, int h, float *s) { \
        int vectors = (k * (a->num_heads / a->num_kv_heads) + LANES - 1) / LANES; \
        if (vectors == 1) attend_rows(a, f, k, h, s, 1, C, B, Q); \
        else if (vectors == 2) attend_rows(a, f, k, h, s, 2, C, B, Q); \
        else attend_rows(a, f, k, h, s, 3, C, B, Q); \
    }
FOR_EACH_AVX2_VARIANT(VARIANT)

/* The block kernel for these dtypes and this shape (blocks of at most BLOCK_ROWS / group queries),
 * or NULL. */
AttendBlock avx2_block_variant(enum Dtypes dtypes, int group, int head_dim) {
    static const AttendBlock variants[3][4] = AVX2_VARIANT_TABLE(rows_);
    int i = head_dim_index(head_dim);  /* groups past BLOCK_ROWS / 2: blocks of one query, the decode path */
    return group < 1 || 2 * group > BLOCK_ROWS || i < 0 ? NULL : variants[dtypes][i];
}
#else
AttendBlock avx2_block_variant(enum Dtypes dtypes, int group, int head_dim) {
    (void)dtypes, (void)group, (void)head_dim;
    return NULL;
}
#endif
