/* AVX2 + FMA paged attention for one query (a decode), fp32 or bf16 KV, q and out in the cache's
 * dtype or fp32 over a bf16 cache (enum Dtypes): 8 fp32 lanes (shared
 * helpers: avx2_lanes.h; blocks of a prefill chunk's queries: attend_avx2_blocks.c). A tile of 8 K
 * rows is read once for the KV head's whole GQA group (bf16 tiles widened once into a small fp32
 * buffer); each row's q.k gives 8 partial sums and the tile's 8 vectors are reduced together by two
 * hadd levels and one cross-lane add. Probabilities are rounded to bf16 before p.v on bf16 models,
 * as the torch reference rounds them. The q.k pass asks for the K and V rows of the positions AHEAD
 * of its tile (prefetch_positions): every block is a separate run of memory, where the hardware
 * prefetcher would start over, and p.v then finds its V rows in L2. */
#include "paged_attention.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <math.h>

#include "avx2_lanes.h"

#define MAX_CHUNKS 16 /* 8-element chunks per head row (head_dim <= 128) */
#define PV_GROUP 4    /* query heads per p.v pass */
#define PV_REGISTERS 12 /* p.v accumulators kept live */

/* v[i] holds 8 partial sums of position i; returns lane i = their sum. */
ALWAYS_INLINE __m256 reduce_tile(const __m256 v[LANES]) {
    __m256 a0 = _mm256_hadd_ps(v[0], v[1]), a1 = _mm256_hadd_ps(v[2], v[3]);
    __m256 a2 = _mm256_hadd_ps(v[4], v[5]), a3 = _mm256_hadd_ps(v[6], v[7]);
    __m256 b0 = _mm256_hadd_ps(a0, a1), b1 = _mm256_hadd_ps(a2, a3);  /* lane halves: 0-3 | 4-7 */
    return _mm256_add_ps(_mm256_permute2f128_ps(b0, b1, 0x20), _mm256_permute2f128_ps(b0, b1, 0x31));
}
ALWAYS_INLINE __m256 valid_lanes(int start, int n) {  /* all-ones in lanes start + i < n */
    __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(n - start), lane));
}

/* Scaled scores of G query rows (query: [G][C] fp32 chunks) over positions [begin, n), position p's
 * at p - begin, and each row's max; asks for the V rows that p.v reads next as it goes. */
ALWAYS_INLINE void qk_scores(const Args *a, const int32_t *table, const char *keys, const char *values, int begin,
                             int n, int stride, const __m256 *query, float *scores, float *top, const int G, const int C,
                             const int BF16) {
    const int dim = LANES * C, bytes = BF16 ? 2 : 4;
    float widened[LANES][LANES * MAX_CHUNKS];
    __m256 max[MAX_GROUP];
    for (int g = 0; g < G; g++) max[g] = _mm256_set1_ps(-INFINITY);
    for (int start = begin; start < n; start += LANES) {
        int64_t rows[LANES];
        const float *k[LANES];
        prefetch_positions(a, table, start + AHEAD, LANES, n, keys, dim * bytes);
        prefetch_positions(a, table, start + AHEAD, LANES, n, values, dim * bytes);
        tile_rows(table, a->block_size, start, n, dim, LANES, rows);
        for (int i = 0; i < LANES; i++) {
            k[i] = (const float *)(keys + rows[i] * bytes);
            if (BF16) {
                for (int c = 0; c < C; c++)
                    _mm256_storeu_ps(widened[i] + LANES * c, load8(keys + (rows[i] + LANES * c) * 2, 1));
                k[i] = widened[i];
            }
        }
        for (int g = 0; g < G; g++) {
            __m256 v[LANES];
            for (int i = 0; i < LANES; i++) {
                __m256 acc = _mm256_mul_ps(_mm256_loadu_ps(k[i]), query[g * C]);
                for (int c = 1; c < C; c++) acc = _mm256_fmadd_ps(_mm256_loadu_ps(k[i] + LANES * c), query[g * C + c], acc);
                v[i] = acc;
            }
            __m256 s = reduce_tile(v);  /* lanes past n repeat position n - 1: a real score */
            max[g] = _mm256_max_ps(max[g], s);
            _mm256_storeu_ps(scores + g * stride + start - begin, s);
        }
    }
    for (int g = 0; g < G; g++) {
        float lanes[LANES];
        _mm256_storeu_ps(lanes, max[g]);
        top[g] = lanes[0];
        for (int i = 1; i < LANES; i++) top[g] = lanes[i] > top[g] ? lanes[i] : top[g];
    }
}
/* scores -> unnormalised probabilities in place (zero past n, bf16-rounded where q is bf16: a bf16
 * model); their sums. */
ALWAYS_INLINE void softmax_numerators(float *scores, int n, int stride, const float *top, float *total,
                                      const int G, const int Q16) {
    for (int g = 0; g < G; g++) {
        __m256 max = _mm256_set1_ps(top[g]), sum = _mm256_setzero_ps();
        for (int start = 0; start < n; start += LANES) {
            float *s = scores + g * stride + start;
            __m256 e = _mm256_and_ps(exp256(_mm256_sub_ps(_mm256_loadu_ps(s), max)), valid_lanes(start, n));
            sum = _mm256_add_ps(sum, e);
            _mm256_storeu_ps(s, Q16 ? round_to_bf16(e) : e);
        }
        total[g] = sum_lanes(sum);
    }
}
/* Rows of G heads over positions [begin, n) (position p's probability at p - begin), chunks [c0, c0
 * + CB): sum_p probs[p] * V[p] / total, in q's dtype (Q16) or fp32 */
ALWAYS_INLINE void pv_columns(const Args *a, const int32_t *table, const char *values, int begin, int n,
                              int stride, const float *probs, const float *total, char *out_row, const int G,
                              const int C, const int c0, const int CB, const int BF16, const int Q16) {
    const int dim = LANES * C, bytes = BF16 ? 2 : 4, out_bytes = Q16 ? 2 : 4;
    __m256 acc[PV_GROUP][MAX_CHUNKS];
    for (int g = 0; g < G; g++)
        for (int c = 0; c < CB; c++) acc[g][c] = _mm256_setzero_ps();
    for (int start = begin; start < n; start += LANES) {
        int64_t rows[LANES];
        tile_rows(table, a->block_size, start, n, dim, LANES, rows);
        for (int i = 0; i < LANES && start + i < n; i++) {
            __m256 weight[PV_GROUP];
            for (int g = 0; g < G; g++) weight[g] = _mm256_broadcast_ss(probs + g * stride + start - begin + i);
            for (int c = 0; c < CB; c++) {
                __m256 v = load8(values + (rows[i] + LANES * (c0 + c)) * bytes, BF16);
                for (int g = 0; g < G; g++) acc[g][c] = _mm256_fmadd_ps(weight[g], v, acc[g][c]);
            }
        }
    }
    for (int g = 0; g < G; g++) {
        __m256 inverse = _mm256_set1_ps(1.0f / total[g]);
        for (int c = 0; c < CB; c++)
            store8(out_row + (g * dim + LANES * (c0 + c)) * out_bytes, _mm256_mul_ps(acc[g][c], inverse), Q16);
    }
}
ALWAYS_INLINE void pv_heads(const Args *a, const int32_t *table, const char *values, int begin, int n,
                            int stride, const float *probs, const float *total, char *out_row,
                            const int G, const int C, const int BF16, const int Q16) {
    const int CB = G * C <= PV_REGISTERS ? C : G * (C / 2) <= PV_REGISTERS ? C / 2
                   : G * (C / 4) <= PV_REGISTERS ? C / 4 : G * (C / 8) <= PV_REGISTERS ? C / 8 : 1;
    for (int c0 = 0; c0 < C; c0 += CB)
        pv_columns(a, table, values, begin, n, stride, probs, total, out_row, G, C, c0, CB, BF16, Q16);
}
/* The G heads' rows in passes of at most PV_GROUP heads: rows of C 8-element chunks, bf16 (Q16) or fp32. */
ALWAYS_INLINE void pv_rows(const Args *a, const int32_t *table, const char *values, int begin, int n, int stride,
                           const float *scores, const float *total, char *out, const int G, const int C,
                           const int BF16, const int Q16) {
    for (int g0 = 0; g0 < G; g0 += PV_GROUP) {
        int heads = G - g0 < PV_GROUP ? G - g0 : PV_GROUP;
        const float *p = scores + g0 * stride;
        char *o = out + g0 * LANES * C * (Q16 ? 2 : 4);
        if (heads == 1) pv_heads(a, table, values, begin, n, stride, p, total + g0, o, 1, C, BF16, Q16);
        else if (heads == 2) pv_heads(a, table, values, begin, n, stride, p, total + g0, o, 2, C, BF16, Q16);
        else if (heads == 3) pv_heads(a, table, values, begin, n, stride, p, total + g0, o, 3, C, BF16, Q16);
        else pv_heads(a, table, values, begin, n, stride, p, total + g0, o, 4, C, BF16, Q16);
    }
}
/* One query's part against one KV head: G query heads, rows of C 8-element chunks; K/V bf16 (BF16)
 * or fp32, q and out bf16 (Q16) or fp32 (and a part's partial rows fp32). */
ALWAYS_INLINE void attend_one(const Args *a, int64_t query, int kv_head, Part part, float *scores, const int C,
                              const int BF16, const int Q16) {
    const int G = a->num_heads / a->num_kv_heads, bytes = BF16 ? 2 : 4, q_bytes = Q16 ? 2 : 4, dim = LANES * C;
    const int begin = part.begin, n = part.end, stride = padded(n - begin);
    const int64_t head = (int64_t)kv_head * a->num_slots * dim * bytes;
    const char *keys = (const char *)a->k_cache + head, *values = (const char *)a->v_cache + head;
    const int32_t *table = table_of(a, query);
    __m256 query_chunks[MAX_GROUP * MAX_CHUNKS];
    float top[MAX_GROUP], total[MAX_GROUP];
    const char *q = (const char *)a->q + (query * a->q_token_stride + (int64_t)kv_head * G * dim) * q_bytes;
    for (int r = 0; r < G * C; r++)
        query_chunks[r] = _mm256_mul_ps(load8(q + LANES * r * q_bytes, Q16), _mm256_set1_ps(a->scale));
    prefetch_positions(a, table, begin, AHEAD, n, keys, dim * bytes);
    prefetch_positions(a, table, begin, AHEAD, n, values, dim * bytes);
    qk_scores(a, table, keys, values, begin, n, stride, query_chunks, scores, top, G, C, BF16);
    softmax_numerators(scores, n - begin, stride, top, total, G, Q16);
    if (part.partial != NULL) {
        for (int g = 0; g < G; g++) part.partial[G * dim + g] = top[g], part.partial[G * dim + G + g] = total[g];
        pv_rows(a, table, values, begin, n, stride, scores, total, (char *)part.partial, G, C, BF16, 0);
        return;
    }
    char *out = (char *)a->out + (query * a->num_heads + (int64_t)kv_head * G) * dim * q_bytes;
    pv_rows(a, table, values, begin, n, stride, scores, total, out, G, C, BF16, Q16);
}
#define VARIANT(C, B, Q) \
    static void attend_##B##Q##_##C(const Args *a, int64_t m, int h, Part part, float *s) { \
        attend_one(a, m, h, part, s, C, B, Q);                                                \
    }
FOR_EACH_AVX2_VARIANT(VARIANT)

/* The kernel for these dtypes and this shape (head_dim 16, 32, 64 or 128, group <= MAX_GROUP), or
 * NULL. */
Attend avx2_variant(enum Dtypes dtypes, int group, int head_dim) {
    static const Attend variants[3][4] = AVX2_VARIANT_TABLE(attend_);
    int i = head_dim_index(head_dim);
    return group < 1 || group > MAX_GROUP || i < 0 ? NULL : variants[dtypes][i];
}
#else
Attend avx2_variant(enum Dtypes dtypes, int group, int head_dim) {
    (void)dtypes, (void)group, (void)head_dim;
    return NULL;
}
#endif
