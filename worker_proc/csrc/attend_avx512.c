/* AVX512 paged attention (fp32: AVX512F + BW; bf16: also AVX512-BF16). Each K/V row is read once for the
 * KV head's whole GQA group. q.k gives per position a vector of 16 partial sums; a tile of 16
 * positions is reduced together by a transpose-add tree (15 adds for 16 scores instead of 16
 * horizontal sums). On bf16, q.k and p.v run on dpbf16: p.v over pairs of positions whose V rows
 * are interleaved by unpack (which permutes the head_dim lanes; undone once per output row). */
#include "paged_attention.h"

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <math.h>

#include "avx512_lanes.h"

#define MAX_CHUNKS 8 /* 64-byte chunks per head row */
#define PV_GROUP 4   /* query heads per p.v pass */
ALWAYS_INLINE __m512i interleave(__m512i x, __m512i y, int high) {  /* x0 y0 x1 y1 .. per 128-bit lane */
    return high ? _mm512_unpackhi_epi16(x, y) : _mm512_unpacklo_epi16(x, y);
}
/* One level of the transpose-add tree: lane l with l % 2w < w sums a's lanes l and l + w, the
 * others sum b's lanes l - w and l. Four levels (w = 8, 4, 2, 1) leave lane i = position i. */
ALWAYS_INLINE __m512 fold(__m512 a, __m512 b, int w) {
    int32_t index[16];
    for (int l = 0; l < 16; l++) index[l] = l % (2 * w) < w ? l + w : 16 + l - w;
    __mmask16 take_b = w == 8 ? 0xFF00 : w == 4 ? 0xF0F0 : w == 2 ? 0xCCCC : 0xAAAA;
    __m512 moved = _mm512_permutex2var_ps(a, _mm512_loadu_si512(index), b);
    return _mm512_add_ps(_mm512_mask_blend_ps(take_b, a, b), moved);
}
ALWAYS_INLINE __m512 reduce_tile(const __m512 v[TILE]) {
    __m512 a[8], b[4], c[2];
    for (int i = 0; i < 8; i++) a[i] = fold(v[i], v[i + 8], 8);
    for (int i = 0; i < 4; i++) b[i] = fold(a[i], a[i + 4], 4);
    for (int i = 0; i < 2; i++) c[i] = fold(b[i], b[i + 2], 2);
    return fold(c[0], c[1], 1);
}
ALWAYS_INLINE __mmask16 valid_lanes(int start, int n) {
    return n - start >= TILE ? 0xFFFF : (__mmask16)((1u << (n - start)) - 1);
}
/* 16 scaled q.k scores of one query head: query holds C 64-byte chunks (bf16 pairs or fp32). */
ALWAYS_INLINE __m512 qk_tile(const char *keys, const int64_t rows[TILE], const __m512i *query,
                             const int C, const int BF16) {
    __m512 v[TILE];
    for (int i = 0; i < TILE; i++) {
        const char *row = keys + rows[i] * (BF16 ? 2 : 4);
        __m512 acc = _mm512_setzero_ps();
        for (int c = 0; c < C; c++) {
            if (BF16) acc = dot_pairs_at(acc, row + 64 * c, &query[c]);
            else acc = _mm512_fmadd_ps(_mm512_loadu_ps(row + 64 * c), _mm512_castsi512_ps(query[c]), acc);
        }
        v[i] = acc;
    }
    return reduce_tile(v);
}
/* p.v for G query heads over positions [begin, n) (position p's probability at p - begin) and
 * head_dim chunks [c0, c0 + CB): out = sum_p probs[p] * V[p] / total, in the cache's dtype or
 * (F32_OUT) fp32 */
ALWAYS_INLINE void pv_columns(const Args *a, const int32_t *table, int begin, int n, int stride, const char *values,
                              const float *scores, const uint16_t *probs, const float *total, void *out_row,
                              const int G, const int C, const int c0, const int CB, const int BF16, const int F32_OUT) {
    const int dim = BF16 ? 32 * C : 16 * C, step = BF16 ? 2 : 1;
    __m512 lo[PV_GROUP][MAX_CHUNKS], hi[PV_GROUP][MAX_CHUNKS];
    int64_t rows[TILE];
    for (int g = 0; g < G; g++)
        for (int c = 0; c < CB; c++) lo[g][c] = hi[g][c] = _mm512_setzero_ps();
    for (int start = begin; start < n; start += TILE) {
        tile_rows(table, a->block_size, start, n, dim, TILE, rows);
        for (int i = 0; i < TILE && start + i < n; i += step) {
            __m512i weight[MAX_GROUP];
            for (int g = 0; g < G; g++) {  /* bf16: the pair (p[i], p[i + 1]), zero past n */
                int32_t bits = 0;
                if (BF16) memcpy(&bits, probs + g * stride + start - begin + i, sizeof bits);
                weight[g] = BF16 ? _mm512_set1_epi32(bits)
                                 : _mm512_castps_si512(_mm512_set1_ps(scores[g * stride + start - begin + i]));
            }
            for (int c = c0; c < c0 + CB; c++) {
                __m512i r0 = _mm512_loadu_si512(values + rows[i] * (BF16 ? 2 : 4) + 64 * c);
                if (BF16) {
                    __m512i r1 = _mm512_loadu_si512(values + rows[i + 1] * 2 + 64 * c);
                    __m512i even = interleave(r0, r1, 0), odd = interleave(r0, r1, 1);
                    for (int g = 0; g < G; g++) {
                        lo[g][c - c0] = dot_pairs(lo[g][c - c0], even, weight[g]);
                        hi[g][c - c0] = dot_pairs(hi[g][c - c0], odd, weight[g]);
                    }
                } else {
                    for (int g = 0; g < G; g++)
                        lo[g][c - c0] = _mm512_fmadd_ps(_mm512_castsi512_ps(weight[g]),
                                                        _mm512_castsi512_ps(r0), lo[g][c - c0]);
                }
            }
        }
    }
    for (int g = 0; g < G; g++) {
        __m512 inverse = _mm512_set1_ps(1.0f / total[g]);
        char *dst = (char *)out_row + g * dim * (BF16 && !F32_OUT ? 2 : 4);
        for (int c = c0; c < c0 + CB; c++) {
            __m512 x = lo[g][c - c0], y = hi[g][c - c0];
            if (BF16) {
                __m512 d0, d1;
                unpermute_pairs(x, y, &d0, &d1);
                if (F32_OUT) {  /* chunk c: dims 32c .. 32c + 31 */
                    _mm512_storeu_ps(dst + 128 * c, _mm512_mul_ps(d0, inverse));
                    _mm512_storeu_ps(dst + 128 * c + 64, _mm512_mul_ps(d1, inverse));
                } else {
                    _mm512_storeu_si512(dst + 64 * c, round_pairs(_mm512_mul_ps(d1, inverse), _mm512_mul_ps(d0, inverse)));
                }
            } else {
                _mm512_storeu_ps(dst + 64 * c, _mm512_mul_ps(x, inverse));
            }
        }
    }
}
/* All of head_dim in passes of at most 16 accumulators, so that they stay in registers. */
ALWAYS_INLINE void pv_heads(
        const Args *a, const int32_t *table, int begin, int n, int stride, const char *values, const float *scores,
        const uint16_t *probs, const float *total, void *out_row, const int G, const int C, const int BF16,
        const int F32_OUT) {
    const int per_chunk = BF16 ? 2 * G : G;
    const int CB = per_chunk * C <= 16 ? C : per_chunk * (C / 2) <= 16 ? C / 2
                   : per_chunk * (C / 4) <= 16 ? C / 4 : 1;
    for (int c0 = 0; c0 < C; c0 += CB)
        pv_columns(a, table, begin, n, stride, values, scores, probs, total, out_row, G, C, c0, CB, BF16, F32_OUT);
}
/* The G heads' rows in passes of at most PV_GROUP heads, in the cache's dtype or (F32_OUT) fp32. */
ALWAYS_INLINE void pv_rows(const Args *a, const int32_t *table, int begin, int n, int stride, const char *values,
                           const float *scores, const uint16_t *probs, const float *total, char *out, const int G,
                           const int C, const int BF16, const int F32_OUT) {
    const int row_bytes = 64 * C * (BF16 && F32_OUT ? 2 : 1);
    for (int g0 = 0; g0 < G; g0 += PV_GROUP) {
        int heads = G - g0 < PV_GROUP ? G - g0 : PV_GROUP;
        const float *s = scores + g0 * stride;
        const uint16_t *p = probs + g0 * stride;
        char *o = out + g0 * row_bytes;
        if (heads == 1) pv_heads(a, table, begin, n, stride, values, s, p, total + g0, o, 1, C, BF16, F32_OUT);
        else if (heads == 2) pv_heads(a, table, begin, n, stride, values, s, p, total + g0, o, 2, C, BF16, F32_OUT);
        else if (heads == 3) pv_heads(a, table, begin, n, stride, values, s, p, total + g0, o, 3, C, BF16, F32_OUT);
        else pv_heads(a, table, begin, n, stride, values, s, p, total + g0, o, 4, C, BF16, F32_OUT);
    }
}
/* One part of one member's context against one KV head: G query heads, rows of C 64-byte chunks,
 * bf16 or fp32. */
ALWAYS_INLINE void attend_vector(const Args *a, int64_t query, int kv_head, Part part, float *scores,
                                 const int C, const int BF16) {
    const int G = a->num_heads / a->num_kv_heads;
    const int bytes = BF16 ? 2 : 4, dim = 64 * C / bytes, begin = part.begin, n = part.end;
    const int stride = padded(n - begin);
    int64_t row = query, head = kv_head * a->num_slots * dim * bytes;
    const char *keys = (const char *)a->k_cache + head, *values = (const char *)a->v_cache + head;
    const char *q = (const char *)a->q + (row * a->q_token_stride + kv_head * G * dim) * bytes;
    const int32_t *table = table_of(a, query);
    __m512i query_chunks[MAX_GROUP][MAX_CHUNKS];
    __m512 top[MAX_GROUP];
    float total[MAX_GROUP];
    for (int g = 0; g < G; g++) {
        for (int c = 0; c < C; c++) query_chunks[g][c] = _mm512_loadu_si512(q + g * dim * bytes + 64 * c);
        top[g] = _mm512_set1_ps(-INFINITY);
    }
    int64_t rows[TILE];
    const int row_bytes = dim * bytes;
    prefetch_positions(a, table, begin, AHEAD, n, keys, row_bytes);
    prefetch_positions(a, table, begin, AHEAD, n, values, row_bytes);
    for (int start = begin; start < n; start += TILE) {
        tile_rows(table, a->block_size, start, n, dim, TILE, rows);
        prefetch_positions(a, table, start + AHEAD, TILE, n, keys, row_bytes);
        prefetch_positions(a, table, start + AHEAD, TILE, n, values, row_bytes);
        for (int g = 0; g < G; g++) {
            __m512 s = _mm512_mul_ps(qk_tile(keys, rows, query_chunks[g], C, BF16), _mm512_set1_ps(a->scale));
            top[g] = _mm512_mask_max_ps(top[g], valid_lanes(start, n), top[g], s);
            _mm512_storeu_ps(scores + g * stride + start - begin, s);
        }
    }
    uint16_t *probs = (uint16_t *)(scores + G * stride);
    for (int g = 0; g < G; g++) {  /* unnormalised probabilities, zero past n; p.v divides by total */
        __m512 max = _mm512_set1_ps(_mm512_reduce_max_ps(top[g])), sum = _mm512_setzero_ps();
        for (int start = 0; start < n - begin; start += TILE) {
            float *s = scores + g * stride + start;
            __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(s), max));
            e = _mm512_maskz_mov_ps(valid_lanes(start, n - begin), e);
            sum = _mm512_add_ps(sum, e);
            _mm512_storeu_ps(s, e);
            if (BF16) {
                __m256i half = round_half(e);
                memcpy(probs + g * stride + start, &half, sizeof half);
            }
        }
        total[g] = _mm512_reduce_add_ps(sum);
        if (part.partial != NULL)
            part.partial[G * dim + g] = _mm512_reduce_max_ps(top[g]), part.partial[G * dim + G + g] = total[g];
    }
    if (part.partial != NULL)
        pv_rows(a, table, begin, n, stride, values, scores, probs, total, (char *)part.partial, G, C, BF16, 1);
    else
        pv_rows(a, table, begin, n, stride, values, scores, probs, total,
                (char *)a->out + (row * a->num_heads + kv_head * G) * dim * bytes, G, C, BF16, 0);
}
#define VARIANT(C, B) \
    static void attend_##B##_##C(const Args *a, int64_t m, int h, Part part, float *s) {   \
        attend_vector(a, m, h, part, s, C, B);                                               \
    }
VARIANT(1, 0) VARIANT(2, 0) VARIANT(4, 0) VARIANT(8, 0)
#if defined(__AVX512BF16__)
VARIANT(1, 1) VARIANT(2, 1) VARIANT(4, 1) VARIANT(8, 1)
#define BF16_VARIANTS {attend_1_1, attend_1_2, NULL, attend_1_4, NULL, NULL, NULL, attend_1_8}
#else
#define BF16_VARIANTS {NULL}
#endif
static const Attend vector_variants[2][MAX_CHUNKS] = {
    {attend_0_1, attend_0_2, NULL, attend_0_4, NULL, NULL, NULL, attend_0_8}, BF16_VARIANTS};

/* The kernel for these dtypes (q in the cache's: fp32 q over a bf16 cache would lose dpbf16) and
 * this shape: head rows of 64, 128, 256 or 512 bytes. */
Attend avx512_variant(enum Dtypes dtypes, int group, int head_dim) {
    int bf16 = dtypes == ALL_BF16, row_bytes = head_dim * (bf16 ? 2 : 4);
    if (dtypes != F32_OVER_BF16 && group >= 1 && group <= MAX_GROUP && row_bytes % 64 == 0
            && row_bytes / 64 <= MAX_CHUNKS)
        return vector_variants[bf16][row_bytes / 64 - 1];
    return NULL;
}
#else
Attend avx512_variant(enum Dtypes dtypes, int group, int head_dim) {
    (void)dtypes, (void)group, (void)head_dim;
    return NULL;
}
#endif
