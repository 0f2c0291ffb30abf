/* Paged attention for the CPU: one query token per work item, K/V read straight from the
 * heads-major paged KV cache (no gather copy), softmax in fp32.
 *   q             [num_tokens, num_heads, head_dim], token rows q_token_stride elements apart
 *   out           [num_tokens, num_heads, head_dim] contiguous, q's dtype; only the queries' rows written
 *   k_cache, v_cache [num_kv_heads, num_slots, head_dim] contiguous, q's dtype (bf16 or fp32)
 *   block_tables  int32 [num_seqs, max_blocks]; slot of position p = table[p / bs] * bs + p % bs
 *   cu_seqlens_q  int32 [num_seqs + 1]; a decode member's query row is cu_seqlens_q[member]
 *   context_lens  int32 [num_seqs], each decode member's >= 1
 *   members       int64 [num_members]: which batch members are decodes
 * paged_attend_queries takes, instead of the last three, per query (prefill chunks as decodes):
 *   query_rows, table_rows int64 [num_queries]: q's row and the block table's row of each query
 *   context_lens  int32 [num_queries]: positions it attends to (its causal prefix), each >= 1
 * Work items are (query, KV head) pairs; num_threads OpenMP threads (torch's own runtime once
 * torch is loaded: same soname) take contiguous runs of about equal context.
 *
 * The AVX512 paths (fp32: AVX512F; bf16: also AVX512-BF16) read each K/V row once for the KV
 * head's whole GQA group. q.k gives per position a vector of 16 partial sums; a tile of 16
 * positions is reduced together by a transpose-add tree (15 adds for 16 scores instead of 16
 * horizontal sums). On bf16, q.k and p.v run on dpbf16: p.v over pairs of positions whose V rows
 * are interleaved by unpack (which permutes the head_dim lanes; undone once per output row). The
 * portable path covers every other case.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#if defined(_OPENMP)
#include <omp.h>
#endif

#define TILE 16     /* positions per q.k reduction tree */
#define AHEAD 2     /* tiles of K prefetched ahead */
#define MAX_GROUP 16 /* vectorised paths: query heads per KV head */
#define MAX_CHUNKS 8 /* vectorised paths: 64-byte chunks per head row */
#define PV_GROUP 4  /* query heads per p.v pass */

enum Status { OK = 0, BAD_SHAPE = -1, BAD_CONTEXT = -2, SHORT_TABLE = -3, NO_MEMORY = -4 };

typedef struct {
    const void *q; int64_t q_token_stride; void *out; const void *k_cache, *v_cache; int64_t num_slots;
    const int32_t *block_tables; int64_t max_blocks;
    const int64_t *query_rows, *table_rows; const int32_t *context_lens;  /* [num_queries] each */
    int num_heads, num_kv_heads, head_dim, block_size, bf16; float scale;
} Args;

/* scores: float [group][stride] then bf16 [group][stride], stride = context rounded up to TILE */
typedef void (*Attend)(const Args *, int64_t query, int kv_head, float *scores);

static inline float bf16_to_f32(uint16_t x) {
    uint32_t bits = (uint32_t)x << 16; float f; memcpy(&f, &bits, sizeof f); return f;
}
static inline uint16_t f32_to_bf16(float f) {  /* round to nearest even, NaN stays NaN */
    uint32_t bits; memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40u);
    bits += 0x7fffu + ((bits >> 16) & 1u); return (uint16_t)(bits >> 16);
}
static inline int padded(int n) { return (n + TILE - 1) / TILE * TILE; }
/* Element offsets (within a head) of the rows of positions [start, start + TILE); positions past n
 * repeat the last one, so every read stays inside the member's context. */
static inline void tile_rows(const int32_t *table, int block_size, int start, int n, int head_dim,
                             int64_t rows[TILE]) {
    if (block_size % TILE == 0) {  /* the tile lies inside one block */
        int64_t first = (int64_t)table[start / block_size] * block_size + start % block_size;
        for (int i = 0; i < TILE; i++) rows[i] = (first + (start + i < n ? i : n - 1 - start)) * head_dim;
        return;
    }
    for (int i = 0; i < TILE; i++) {
        int p = start + i < n ? start + i : n - 1;
        rows[i] = ((int64_t)table[p / block_size] * block_size + p % block_size) * head_dim;
    }
}

/* Portable path: any head_dim and group, bf16 or fp32. */
static inline float element(const void *base, int64_t index, int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t *)base)[index]) : ((const float *)base)[index];
}
static inline float exp_nonpositive(float x) {  /* Cephes expf polynomial */
    x = x < -87.0f ? -87.0f : x;
    float n = floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f; p = p * r + 8.3334519073e-3f; p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f; p = p * r + 5.0000001201e-1f; p = p * r * r + r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23; float scale; memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}
static void attend_portable(const Args *a, int64_t item, int kv_head, float *scores) {
    int n = a->context_lens[item], group = a->num_heads / a->num_kv_heads, dim = a->head_dim;
    int stride = padded(n), bf16 = a->bf16, bs = a->block_size;
    int64_t row = a->query_rows[item], head = kv_head * a->num_slots * dim;
    int64_t q_offset = row * a->q_token_stride + kv_head * group * dim;
    const int32_t *table = a->block_tables + a->table_rows[item] * a->max_blocks;
    float acc[dim], query[dim];
    for (int g = 0; g < group; g++) {
        float *s = scores + g * stride, top = -INFINITY, sum = 0.0f;
        for (int d = 0; d < dim; d++) query[d] = element(a->q, q_offset + g * dim + d, bf16) * a->scale;
        for (int p = 0; p < n; p++) {
            int64_t offset = head + ((int64_t)table[p / bs] * bs + p % bs) * dim;
            float dot = 0.0f;
            for (int d = 0; d < dim; d++) dot += query[d] * element(a->k_cache, offset + d, bf16);
            s[p] = dot;
            top = dot > top ? dot : top;
        }
        memset(acc, 0, sizeof acc);
        for (int p = 0; p < n; p++) {
            int64_t offset = head + ((int64_t)table[p / bs] * bs + p % bs) * dim;
            float weight = exp_nonpositive(s[p] - top);
            sum += weight;
            for (int d = 0; d < dim; d++) acc[d] += weight * element(a->v_cache, offset + d, bf16);
        }
        int64_t dst = (row * a->num_heads + kv_head * group + g) * dim;
        for (int d = 0; d < dim; d++) {
            if (bf16) ((uint16_t *)a->out)[dst + d] = f32_to_bf16(acc[d] / sum);
            else ((float *)a->out)[dst + d] = acc[d] / sum;
        }
    }
}

#if defined(__AVX512F__)
#define ALWAYS_INLINE static inline __attribute__((always_inline))
/* The bf16-only instructions; without AVX512-BF16 only the fp32 variants exist, whose BF16 = 0
 * never calls these. */
#if defined(__AVX512BF16__)
ALWAYS_INLINE __m512 dot_pairs(__m512 acc, __m512i x, __m512i y) {  /* acc + x.y over bf16 pairs */
    return _mm512_dpbf16_ps(acc, (__m512bh)x, (__m512bh)y);
}
ALWAYS_INLINE __m512 dot_pairs_at(__m512 acc, const void *x, const void *y) {  /* the same, in memory */
    __m512bh a, b;  /* memcpy, not a load and a cast: gcc 12 round-trips that via the stack */
    memcpy(&a, x, sizeof a), memcpy(&b, y, sizeof b);
    return _mm512_dpbf16_ps(acc, a, b);
}
ALWAYS_INLINE __m512i interleave(__m512i x, __m512i y, int high) {  /* x0 y0 x1 y1 .. per 128-bit lane */
    return high ? _mm512_unpackhi_epi16(x, y) : _mm512_unpacklo_epi16(x, y);
}
ALWAYS_INLINE __m512i round_pairs(__m512 hi, __m512 lo) { return (__m512i)_mm512_cvtne2ps_pbh(hi, lo); }
ALWAYS_INLINE __m256i round_half(__m512 x) { return (__m256i)_mm512_cvtneps_pbh(x); }
#else
ALWAYS_INLINE __m512 dot_pairs(__m512 acc, __m512i x, __m512i y) { (void)x, (void)y; return acc; }
ALWAYS_INLINE __m512 dot_pairs_at(__m512 acc, const void *x, const void *y) { (void)x, (void)y; return acc; }
ALWAYS_INLINE __m512i interleave(__m512i x, __m512i y, int high) { (void)y, (void)high; return x; }
ALWAYS_INLINE __m512i round_pairs(__m512 hi, __m512 lo) { (void)hi; return _mm512_castps_si512(lo); }
ALWAYS_INLINE __m256i round_half(__m512 x) { return _mm512_castsi512_si256(_mm512_castps_si512(x)); }
#endif
static inline void prefetch_rows(const char *base, const int64_t rows[TILE], int element_bytes,
                                 int row_bytes) {
    for (int i = 0; i < TILE; i++)
        for (int b = 0; b < row_bytes; b += 64) _mm_prefetch(base + rows[i] * element_bytes + b, _MM_HINT_T0);
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
/* p.v for G query heads over head_dim chunks [c0, c0 + CB): out = sum_p probs[p] * V[p] / total */
ALWAYS_INLINE void pv_columns(const Args *a, const int32_t *table, int n, int stride, const char *values,
                              const float *scores, const uint16_t *probs, const float *total, void *out_row,
                              const int G, const int C, const int c0, const int CB, const int BF16) {
    const int dim = BF16 ? 32 * C : 16 * C, step = BF16 ? 2 : 1;
    __m512 lo[PV_GROUP][MAX_CHUNKS], hi[PV_GROUP][MAX_CHUNKS];
    int64_t rows[TILE];
    for (int g = 0; g < G; g++)
        for (int c = 0; c < CB; c++) lo[g][c] = hi[g][c] = _mm512_setzero_ps();
    for (int start = 0; start < n; start += TILE) {
        tile_rows(table, a->block_size, start, n, dim, rows);
        for (int i = 0; i < TILE && start + i < n; i += step) {
            __m512i weight[MAX_GROUP];
            for (int g = 0; g < G; g++) {  /* bf16: the pair (p[i], p[i + 1]), zero past n */
                int32_t bits = 0;
                if (BF16) memcpy(&bits, probs + g * stride + start + i, sizeof bits);
                weight[g] = BF16 ? _mm512_set1_epi32(bits)
                                 : _mm512_castps_si512(_mm512_set1_ps(scores[g * stride + start + i]));
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
    /* bf16: lo lane 4j + k holds dim 8j + k, hi lane 4j + k holds dim 8j + 4 + k */
    static const int32_t first[16] = {0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23};
    static const int32_t second[16] = {8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31};
    for (int g = 0; g < G; g++) {
        __m512 inverse = _mm512_set1_ps(1.0f / total[g]);
        char *dst = (char *)out_row + g * dim * (BF16 ? 2 : 4);
        for (int c = c0; c < c0 + CB; c++) {
            __m512 x = lo[g][c - c0], y = hi[g][c - c0];
            if (BF16) {
                __m512 d0 = _mm512_mul_ps(_mm512_permutex2var_ps(x, _mm512_loadu_si512(first), y), inverse);
                __m512 d1 = _mm512_mul_ps(_mm512_permutex2var_ps(x, _mm512_loadu_si512(second), y), inverse);
                _mm512_storeu_si512(dst + 64 * c, round_pairs(d1, d0));
            } else {
                _mm512_storeu_ps(dst + 64 * c, _mm512_mul_ps(x, inverse));
            }
        }
    }
}
/* All of head_dim in passes of at most 16 accumulators, so that they stay in registers. */
ALWAYS_INLINE void pv_heads(
        const Args *a, const int32_t *table, int n, int stride, const char *values, const float *scores,
        const uint16_t *probs, const float *total, void *out_row, const int G, const int C, const int BF16) {
    const int per_chunk = BF16 ? 2 * G : G;
    const int CB = per_chunk * C <= 16 ? C : per_chunk * (C / 2) <= 16 ? C / 2
                   : per_chunk * (C / 4) <= 16 ? C / 4 : 1;
    for (int c0 = 0; c0 < C; c0 += CB)
        pv_columns(a, table, n, stride, values, scores, probs, total, out_row, G, C, c0, CB, BF16);
}
/* One KV head of one member: G query heads, rows of C 64-byte chunks, bf16 or fp32. */
ALWAYS_INLINE void attend_vector(const Args *a, int64_t query, int kv_head, float *scores,
                                 const int C, const int BF16) {
    const int G = a->num_heads / a->num_kv_heads;
    const int bytes = BF16 ? 2 : 4, dim = 64 * C / bytes, n = a->context_lens[query], stride = padded(n);
    int64_t row = a->query_rows[query], head = kv_head * a->num_slots * dim * bytes;
    const char *keys = (const char *)a->k_cache + head, *values = (const char *)a->v_cache + head;
    const char *q = (const char *)a->q + (row * a->q_token_stride + kv_head * G * dim) * bytes;
    const int32_t *table = a->block_tables + a->table_rows[query] * a->max_blocks;
    __m512i query_chunks[MAX_GROUP][MAX_CHUNKS];
    __m512 top[MAX_GROUP];
    float total[MAX_GROUP];
    for (int g = 0; g < G; g++) {
        for (int c = 0; c < C; c++) query_chunks[g][c] = _mm512_loadu_si512(q + g * dim * bytes + 64 * c);
        top[g] = _mm512_set1_ps(-INFINITY);
    }
    int64_t rows[TILE], ahead[TILE];
    for (int start = 0; start < n && start < AHEAD * TILE; start += TILE) {
        tile_rows(table, a->block_size, start, n, dim, ahead);
        prefetch_rows(keys, ahead, bytes, dim * bytes);
    }
    for (int start = 0; start < n; start += TILE) {
        tile_rows(table, a->block_size, start, n, dim, rows);
        if (start + AHEAD * TILE < n) {
            tile_rows(table, a->block_size, start + AHEAD * TILE, n, dim, ahead);
            prefetch_rows(keys, ahead, bytes, dim * bytes);
        }
        prefetch_rows(values, rows, bytes, dim * bytes);
        for (int g = 0; g < G; g++) {
            __m512 s = _mm512_mul_ps(qk_tile(keys, rows, query_chunks[g], C, BF16), _mm512_set1_ps(a->scale));
            top[g] = _mm512_mask_max_ps(top[g], valid_lanes(start, n), top[g], s);
            _mm512_storeu_ps(scores + g * stride + start, s);
        }
    }
    uint16_t *probs = (uint16_t *)(scores + G * stride);
    for (int g = 0; g < G; g++) {  /* unnormalised probabilities, zero past n; p.v divides by total */
        __m512 max = _mm512_set1_ps(_mm512_reduce_max_ps(top[g])), sum = _mm512_setzero_ps();
        for (int start = 0; start < n; start += TILE) {
            float *s = scores + g * stride + start;
            __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(s), max));
            e = _mm512_maskz_mov_ps(valid_lanes(start, n), e);
            sum = _mm512_add_ps(sum, e);
            _mm512_storeu_ps(s, e);
            if (BF16) {
                __m256i half = round_half(e);
                memcpy(probs + g * stride + start, &half, sizeof half);
            }
        }
        total[g] = _mm512_reduce_add_ps(sum);
    }
    for (int g0 = 0; g0 < G; g0 += PV_GROUP) {
        int heads = G - g0 < PV_GROUP ? G - g0 : PV_GROUP;
        void *out_row = (char *)a->out + (row * a->num_heads + kv_head * G + g0) * dim * bytes;
        const float *s = scores + g0 * stride;
        const uint16_t *p = probs + g0 * stride;
        if (heads == 1) pv_heads(a, table, n, stride, values, s, p, total + g0, out_row, 1, C, BF16);
        else if (heads == 2) pv_heads(a, table, n, stride, values, s, p, total + g0, out_row, 2, C, BF16);
        else if (heads == 3) pv_heads(a, table, n, stride, values, s, p, total + g0, out_row, 3, C, BF16);
        else pv_heads(a, table, n, stride, values, s, p, total + g0, out_row, 4, C, BF16);
    }
}
#define VARIANT(C, B) \
    static void attend_##B##_##C(const Args *a, int64_t m, int h, float *s) {   \
        attend_vector(a, m, h, s, C, B);                                          \
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
#endif

/* The vectorised kernel for this dtype and shape, or NULL where only the portable path applies. */
static Attend vector_variant(int bf16, int group, int head_dim) {
#if defined(__AVX512F__)
    int row_bytes = head_dim * (bf16 ? 2 : 4);
    if (group >= 1 && group <= MAX_GROUP && row_bytes % 64 == 0 && row_bytes / 64 <= MAX_CHUNKS)
        return vector_variants[bf16 ? 1 : 0][row_bytes / 64 - 1];
#endif
    (void)bf16; (void)group; (void)head_dim;
    return NULL;
}

/* 1 when paged_decode has a vectorised path for this dtype and shape (else it runs portable C). */
int paged_decode_vectorised(int bf16, int group, int head_dim) {
    return vector_variant(bf16, group, head_dim) != NULL;
}

/* Every query of a.query_rows/table_rows/context_lens [num_queries], each against its KV heads.
 * Work items are (query, KV head) pairs, split into contiguous runs of about equal context. */
static int attend_queries(const Args *a, int64_t num_queries, int num_threads) {
    int group = a->num_heads / a->num_kv_heads, max_context = 1, num_kv_heads = a->num_kv_heads;
    int64_t total = 0, items = num_queries * num_kv_heads;
    for (int64_t i = 0; i < num_queries; i++) {
        int n = a->context_lens[i];
        if (n < 1) return BAD_CONTEXT;
        if ((n - 1) / a->block_size >= a->max_blocks) return SHORT_TABLE;
        total += n;
        max_context = n > max_context ? n : max_context;
    }
    Attend attend = vector_variant(a->bf16, group, a->head_dim);
    if (attend == NULL) attend = attend_portable;
    num_threads = num_threads < 1 ? 1 : num_threads > 64 ? 64 : num_threads;
    if (num_threads > items) num_threads = items > 0 ? (int)items : 1;
    int64_t bounds[65] = {0}, done = 0, item = 0;  /* thread t takes items [bounds[t], bounds[t + 1]) */
    for (int t = 0; t < num_threads; t++) {
        int64_t goal = total * num_kv_heads * (t + 1) / num_threads;
        for (; item < items; item++) {
            int n = a->context_lens[item / num_kv_heads];
            if (t < num_threads - 1 && done + n / 2 >= goal) break;
            done += n;
        }
        bounds[t + 1] = item;
    }
    size_t scores_bytes = (size_t)group * (size_t)padded(max_context) * (sizeof(float) + sizeof(uint16_t));
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        int first = 0, step = 1;  /* the runtime may grant fewer threads than asked */
#if defined(_OPENMP)
        first = omp_get_thread_num(), step = omp_get_num_threads();
#endif
        float *scores = malloc(scores_bytes);
        failed |= scores == NULL;
        for (int t = first; scores != NULL && t < num_threads; t += step)
            for (int64_t i = bounds[t]; i < bounds[t + 1]; i++)
                attend(a, i / num_kv_heads, (int)(i % num_kv_heads), scores);
        free(scores);
    }
    return failed ? NO_MEMORY : OK;
}

/* Returns OK, NO_MEMORY (out incomplete) or, with nothing written: BAD_SHAPE (heads, head_dim or
 * block_size), BAD_CONTEXT (a context < 1) or SHORT_TABLE (a context past its block table). */
int paged_decode(const void *q, int64_t q_token_stride, void *out, const void *k_cache, const void *v_cache,
                 int64_t num_slots, const int32_t *block_tables, int64_t max_blocks,
                 const int32_t *cu_seqlens_q, const int32_t *context_lens, const int64_t *members,
                 int num_members, int num_heads, int num_kv_heads, int head_dim, int block_size,
                 float scale, int bf16, int num_threads) {
    if (num_kv_heads < 1 || num_heads % num_kv_heads || head_dim < 1 || block_size < 1) return BAD_SHAPE;
    size_t count = num_members > 0 ? (size_t)num_members : 1;
    int64_t *query_rows = malloc(count * sizeof *query_rows);
    int32_t *lens = malloc(count * sizeof *lens);
    int status = NO_MEMORY;
    if (query_rows != NULL && lens != NULL) {
        for (int i = 0; i < num_members; i++)
            query_rows[i] = cu_seqlens_q[members[i]], lens[i] = context_lens[members[i]];
        Args args = {q, q_token_stride, out, k_cache, v_cache, num_slots, block_tables, max_blocks,
                     query_rows, members, lens, num_heads, num_kv_heads, head_dim, block_size, bf16, scale};
        status = attend_queries(&args, num_members, num_threads);
    }
    free(query_rows), free(lens);
    return status;
}

/* Prefill chunks as decodes: query i (q's row query_rows[i], of the member whose block table is row
 * table_rows[i]) attends causally to its member's first context_lens[i] positions, this step's K/V
 * included (written to the cache before attention). Returns as paged_decode. */
int paged_attend_queries(const void *q, int64_t q_token_stride, void *out, const void *k_cache,
                         const void *v_cache, int64_t num_slots, const int32_t *block_tables,
                         int64_t max_blocks, const int64_t *query_rows, const int64_t *table_rows,
                         const int32_t *context_lens, int64_t num_queries, int num_heads, int num_kv_heads,
                         int head_dim, int block_size, float scale, int bf16, int num_threads) {
    if (num_kv_heads < 1 || num_heads % num_kv_heads || head_dim < 1 || block_size < 1) return BAD_SHAPE;
    Args args = {q, q_token_stride, out, k_cache, v_cache, num_slots, block_tables, max_blocks,
                 query_rows, table_rows, context_lens, num_heads, num_kv_heads, head_dim, block_size,
                 bf16, scale};
    return attend_queries(&args, num_queries, num_threads);
}
