/* Shared by the paged attention driver (paged_attention.c) and its per-ISA paths (attend_*.c).
 *
 * Every token of the step is a query: token t (q's row t) attends to the first context_lens[t]
 * positions of its member's block table (its causal prefix, this step's K/V already written to the
 * cache). A decode is a member with one token; a prefill chunk's tokens see one position more each.
 *   q             [num_tokens, num_heads, head_dim], token rows q_token_stride elements apart
 *   out           [num_tokens, num_heads, head_dim] contiguous, q's dtype
 *   k_cache, v_cache [num_kv_heads, num_slots, head_dim] contiguous, bf16 or fp32
 * The dtypes (enum Dtypes): all fp32, all bf16, or fp32 q and out over a bf16 cache (an fp32 model
 * keeping its K/V in bf16: the K/V rows are widened as they load, exactly, and everything else is
 * fp32, as in the torch reference's mixed mode).
 *   block_tables  int32 [num_seqs, max_blocks]; slot of position p = table[p / bs] * bs + p % bs
 *   token_members int32 [num_tokens]: each token's row of block_tables
 *   context_lens  int32 [num_tokens]: positions each token attends to, >= 1
 */
#ifndef CONVEYOR_PAGED_ATTENTION_H
#define CONVEYOR_PAGED_ATTENTION_H

#include <stdint.h>
#include <string.h>

#include "bf16.h"

#define TILE 16       /* positions per score tile; the scores buffer is padded to it */
#define MAX_GROUP 16  /* vectorised paths: query heads per KV head */
#define BLOCK_ROWS 24 /* AVX2 block path: queries x query heads per KV head */
#define BLOCK_TILE 12 /* AVX2 block path: q.k positions per register tile at most; each tile's width divides it */
#define WIDE_BLOCK_ROWS 32 /* AVX512 block path: queries x query heads per KV head */
#define WIDE_BLOCK_TILE 24 /* AVX512 block path: q.k positions per tile at most; each tile's width divides it */
#define MAX_HEAD_DIM 128

typedef struct {
    const void *q; int64_t q_token_stride; void *out; const void *k_cache, *v_cache; int64_t num_slots;
    const int32_t *block_tables; int64_t max_blocks;
    const int32_t *token_members, *context_lens;  /* [num_tokens] each */
    int num_heads, num_kv_heads, head_dim, block_size;
    int bf16, q_bf16;  /* the caches' dtype, and q's and out's */
    float scale;
} Args;
/* The order is the rows of each path's variant table (AVX2_VARIANT_TABLE) and the values Python
 * passes (native_kernel._DTYPES). */
enum Dtypes { ALL_F32 = 0, ALL_BF16 = 1, F32_OVER_BF16 = 2 };

/* Which positions of a query's context one work item attends, [begin, end), and where it writes.
 * partial NULL: the whole context, into out. Else a part of a decode's long context (begin a
 * multiple of TILE): its group's rows normalised over the part alone, fp32 [group][head_dim], then
 * each row's largest score [group] and sum of exp(score - largest) [group]: part_floats() in all,
 * which the driver merges into out once every part is done. */
typedef struct { int begin, end; float *partial; } Part;
static inline int64_t part_floats(int group, int head_dim) { return (int64_t)group * (head_dim + 2); }
/* One (query, KV head, part) work item. scores: float [group][stride] then bf16 [group][stride],
 * stride = the part's positions rounded up to TILE. */
typedef void (*Attend)(const Args *, int64_t query, int kv_head, Part part, float *scores);
/* One (block of count consecutive queries of one member, KV head) work item, count * group <=
 * BLOCK_ROWS: each K/V row is read from memory once for the whole block rather than once per query (a
 * prefill chunk's queries share their prefix). scratch: block_scratch_bytes(the block's longest
 * context). */
typedef void (*AttendBlock)(const Args *, int64_t first_query, int count, int kv_head, float *scratch);

/* The vectorised path for this dtype and shape on the ISA compiled for, or NULL. */
Attend avx512_variant(enum Dtypes dtypes, int group, int head_dim);
Attend avx2_variant(enum Dtypes dtypes, int group, int head_dim);
AttendBlock avx2_block_variant(enum Dtypes dtypes, int group, int head_dim);
AttendBlock avx512_block_variant(enum Dtypes dtypes, int group, int head_dim);
static inline size_t block_scratch_bytes(int max_context) {  /* scores, output rows, row offsets: either path's */
    size_t positions = ((size_t)max_context + WIDE_BLOCK_TILE - 1) / WIDE_BLOCK_TILE * WIDE_BLOCK_TILE;  /* a multiple of both tiles */
    return (positions * WIDE_BLOCK_ROWS + WIDE_BLOCK_ROWS * MAX_HEAD_DIM) * sizeof(float) + positions * sizeof(int64_t);
}
void attend_portable(const Args *a, int64_t query, int kv_head, Part part, float *scores);

static inline int padded(int n) { return (n + TILE - 1) / TILE * TILE; }
static inline const int32_t *table_of(const Args *a, int64_t query) {
    return a->block_tables + (int64_t)a->token_members[query] * a->max_blocks;
}
/* Element offsets (within a head) of the rows of positions [start, start + count); positions past n
 * repeat the last one, so every read stays inside the member's context. */
static inline void tile_rows(const int32_t *table, int block_size, int start, int n, int head_dim,
                             int count, int64_t *rows) {
    if (block_size % count == 0) {  /* the tile lies inside one block */
        int64_t first = (int64_t)table[start / block_size] * block_size + start % block_size;
        for (int i = 0; i < count; i++) rows[i] = (first + (start + i < n ? i : n - 1 - start)) * head_dim;
        return;
    }
    for (int i = 0; i < count; i++) {
        int p = start + i < n ? start + i : n - 1;
        rows[i] = ((int64_t)table[p / block_size] * block_size + p % block_size) * head_dim;
    }
}

#define AHEAD 32 /* positions of K and V the vector paths ask for ahead of the tile at hand */
/* Asks for the K or V rows (row_bytes each from base) of positions [p, p + count), clipped to n, one
 * block's run at a time. A decode's blocks lie anywhere in a cache far larger than L3, and each is a
 * run of memory where the hardware prefetcher starts over; the vector paths ask for the K and V
 * rows of the positions a few tiles ahead while q.k works on the tile at hand. Into L2 (locality 2:
 * prefetcht1), so the requests do not hold the L1 miss buffers that the tile's own loads need:
 * decodes read from memory 1.1-1.45x faster as the scheduler places their blocks, and up to 1.7x
 * from shuffled ones, than when only K was asked for, into L1 (docs/benchmarks.md, "Decode attention
 * from memory"). */
static inline void prefetch_positions(const Args *a, const int32_t *table, int p, int count, int n,
                                      const char *base, int row_bytes) {
    for (int end = p + count < n ? p + count : n; p < end;) {
        int in_block = a->block_size - p % a->block_size, rows = end - p < in_block ? end - p : in_block;
        const char *row = base + ((int64_t)table[p / a->block_size] * a->block_size + p % a->block_size) * row_bytes;
        for (int offset = 0; offset < rows * row_bytes; offset += 64) __builtin_prefetch(row + offset, 0, 2);
        p += rows;
    }
}

/* A block of count consecutive queries from first, R = count x group rows laid along width >= R
 * lanes: returns the longest context; *n_min the shortest (every row sees that many positions);
 * n_of[r] row r's context (lanes past R: the longest, so they mask nothing). */
static inline int block_contexts(const Args *a, int64_t first, int count, int width, int *n_of, int *n_min) {
    const int G = a->num_heads / a->num_kv_heads, R = count * G;
    int n = 1;
    *n_min = a->context_lens[first];
    for (int j = 0; j < count; j++) {
        int lens = a->context_lens[first + j];
        n = lens > n ? lens : n, *n_min = lens < *n_min ? lens : *n_min;
    }
    for (int r = 0; r < width; r++) n_of[r] = r < R ? a->context_lens[first + r / G] : n;
    return n;
}
/* rows[p]: element offset (within a head) of position p of first's member, p in [0, npad); past n
 * the last position again, so padded tiles read inside the context. */
static inline void block_row_offsets(const Args *a, int64_t first, int n, int npad, int dim, int64_t *rows) {
    const int32_t *table = table_of(a, first);
    for (int p = 0, block = 0, offset = 0; p < npad; p++) {
        rows[p] = p < n ? ((int64_t)table[block] * a->block_size + offset) * dim : rows[n - 1];
        if (++offset == a->block_size) offset = 0, block++;
    }
}

#endif
