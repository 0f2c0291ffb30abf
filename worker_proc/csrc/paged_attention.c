/* Paged attention for the CPU, the driver: checks every read against the cache and block tables,
 * picks the widest path compiled for (AVX512, AVX2, else portable C), groups consecutive queries of
 * one member into blocks where the path attends blocks, and has the OpenMP threads (torch's own
 * pool once torch is loaded: the same libgomp soname) claim the step's work items, (query block,
 * KV head) pairs, one at a time. Shapes and layouts: paged_attention.h. */
#include <stdlib.h>

#include "paged_attention.h"

#define MAX_THREADS 64

enum Status { OK = 0, BAD_SHAPE = -1, BAD_CONTEXT = -2, SHORT_TABLE = -3, NO_MEMORY = -4,
              BAD_MEMBER = -5, BAD_BLOCK = -6, BAD_DTYPES = -7 };
enum Path { PORTABLE = 0, AVX2 = 1, AVX512 = 2 };

static enum Path path_for(enum Dtypes dtypes, int group, int head_dim, Attend *attend) {
    if ((*attend = avx512_variant(dtypes, group, head_dim)) != NULL) return AVX512;
    if ((*attend = avx2_variant(dtypes, group, head_dim)) != NULL) return AVX2;
    *attend = attend_portable;
    return PORTABLE;
}

static int valid_dtypes(int dtypes) { return dtypes == ALL_F32 || dtypes == ALL_BF16 || dtypes == F32_OVER_BF16; }

/* Which path paged_attend takes for these dtypes (enum Dtypes) and this shape on this build: enum
 * Path, or -1 for dtypes outside the enum. */
int paged_attention_path(int dtypes, int group, int head_dim) {
    Attend attend;
    return valid_dtypes(dtypes) ? (int)path_for((enum Dtypes)dtypes, group, head_dim, &attend) : -1;
}

/* The kernel for blocks of a prefill chunk's queries, at most *per_block queries each (NULL: every
 * query on its own): it reads each K/V row once per block, where the per-query paths read it once
 * per query. The AVX512 block kernel where it covers the dtypes (bf16 needs AVX512-BF16; fp32 q over
 * a bf16 cache it leaves to AVX2) and shape, else the AVX2 one, on AVX512 builds too. */
static AttendBlock block_for(enum Path path, enum Dtypes dtypes, int group, int head_dim, int *per_block) {
    AttendBlock block = NULL;
    if (path == PORTABLE) return NULL;
    if ((block = avx512_block_variant(dtypes, group, head_dim)) != NULL) *per_block = WIDE_BLOCK_ROWS / group;
    else if ((block = avx2_block_variant(dtypes, group, head_dim)) != NULL) *per_block = BLOCK_ROWS / group;
    return block;
}

/* Which block path paged_attend takes for a prefill chunk: 0 none, 1 AVX2, 2 AVX512; -1 for dtypes
 * outside enum Dtypes. */
int paged_attention_block_path(int dtypes, int group, int head_dim) {
    Attend attend;
    int per_block = 1;
    if (!valid_dtypes(dtypes)) return -1;
    enum Dtypes d = (enum Dtypes)dtypes;
    AttendBlock block = block_for(path_for(d, group, head_dim, &attend), d, group, head_dim, &per_block);
    return block == NULL ? 0 : block == avx512_block_variant(d, group, head_dim) ? 2 : 1;
}

/* Every block a query reads names a block of the cache: each member's table is checked once, up to
 * the longest context any of its queries reads. On failure *where is the token (BAD_MEMBER,
 * BAD_CONTEXT, SHORT_TABLE) or the member (BAD_BLOCK) at fault. */
static int check_reads(const Args *a, int64_t num_tokens, int64_t num_seqs, int64_t *where) {
    int32_t *longest = calloc(num_seqs > 0 ? (size_t)num_seqs : 1, sizeof *longest);
    if (longest == NULL) return NO_MEMORY;
    int status = OK;
    for (int64_t t = 0; t < num_tokens && status == OK; t++) {
        int32_t member = a->token_members[t], n = a->context_lens[t];
        if (member < 0 || member >= num_seqs) status = BAD_MEMBER;
        else if (n < 1) status = BAD_CONTEXT;
        else if ((n - 1) / a->block_size >= a->max_blocks) status = SHORT_TABLE;
        else if (n > longest[member]) longest[member] = n;
        *where = t;
    }
    int64_t num_blocks = a->num_slots / a->block_size;
    for (int64_t m = 0; m < num_seqs && status == OK; m++)
        for (int64_t b = 0; b * a->block_size < longest[m]; b++) {
            int32_t block = a->block_tables[m * a->max_blocks + b];
            if (block < 0 || block >= num_blocks) { status = BAD_BLOCK, *where = m; break; }
        }
    free(longest);
    return status;
}

/* Query blocks: starts[b]..starts[b + 1] are block b's queries, at most per_block consecutive
 * queries of one member. Returns the number of blocks. */
static int64_t make_blocks(const Args *a, int64_t num_tokens, int per_block, int64_t *starts) {
    int64_t num_blocks = 0;
    for (int64_t t = 0; t < num_tokens; t++)
        if (t == 0 || t - starts[num_blocks - 1] == per_block || a->token_members[t] != a->token_members[t - 1])
            starts[num_blocks++] = t;
    starts[num_blocks] = num_tokens;
    return num_blocks;
}

/* Writes every row of out. dtypes: enum Dtypes. Returns OK, NO_MEMORY (out incomplete) or, with
 * nothing written: BAD_DTYPES, BAD_SHAPE (heads, head_dim or block_size), BAD_MEMBER (a token's member is not a row of
 * block_tables), BAD_CONTEXT (a context < 1), SHORT_TABLE (a context past its block table) or
 * BAD_BLOCK (a table names a block outside the cache), with *where the token or member at fault. */
int paged_attend(const void *q, int64_t q_token_stride, void *out, const void *k_cache, const void *v_cache,
                 int64_t num_slots, const int32_t *block_tables, int64_t num_seqs, int64_t max_blocks,
                 const int32_t *token_members, const int32_t *context_lens, int64_t num_tokens,
                 int num_heads, int num_kv_heads, int head_dim, int block_size, float scale, int dtypes,
                 int num_threads, int64_t *where) {
    if (!valid_dtypes(dtypes)) return BAD_DTYPES;
    if (num_kv_heads < 1 || num_heads % num_kv_heads || head_dim < 1 || block_size < 1) return BAD_SHAPE;
    Args args = {q, q_token_stride, out, k_cache, v_cache, num_slots, block_tables, max_blocks,
                 token_members, context_lens, num_heads, num_kv_heads, head_dim, block_size,
                 dtypes != ALL_F32, dtypes == ALL_BF16, scale};
    int status = check_reads(&args, num_tokens, num_seqs, where);
    if (status != OK) return status;
    int group = num_heads / num_kv_heads, max_context = 1;
    for (int64_t t = 0; t < num_tokens; t++) max_context = context_lens[t] > max_context ? context_lens[t] : max_context;
    Attend attend;
    int per_block = 1;
    AttendBlock attend_block = block_for(path_for((enum Dtypes)dtypes, group, head_dim, &attend), (enum Dtypes)dtypes,
                                         group, head_dim, &per_block);
    int64_t *starts = malloc(((size_t)num_tokens + 1) * sizeof *starts);
    if (starts == NULL) return NO_MEMORY;
    int64_t items = make_blocks(&args, num_tokens, per_block, starts) * num_kv_heads;
    num_threads = num_threads < 1 ? 1 : num_threads > MAX_THREADS ? MAX_THREADS : num_threads;
    if (num_threads > items) num_threads = items > 0 ? (int)items : 1;
    size_t scores_bytes = (size_t)group * (size_t)padded(max_context) * (sizeof(float) + sizeof(uint16_t));
    if (attend_block != NULL && block_scratch_bytes(max_context) > scores_bytes) scores_bytes = block_scratch_bytes(max_context);
    /* The threads claim items one at a time (item i: query block i / num_kv_heads, KV head
     * i % num_kv_heads), last first: a chunk's later queries attend to more positions, so the
     * heaviest go first and the short ones even out the end; and a thread whose core another
     * process takes for a while (the frontend, the scheduler) holds up the call by one item. */
    int64_t claimed = 0;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        float *scores = malloc(scores_bytes);
        failed |= scores == NULL;
        while (scores != NULL) {
            int64_t i;
#pragma omp atomic capture
            i = claimed++;
            i = items - 1 - i;
            if (i < 0) break;
            int64_t b = i / num_kv_heads, query = starts[b];
            int count = (int)(starts[b + 1] - query);
            if (count > 1) attend_block(&args, query, count, (int)(i % num_kv_heads), scores);
            else attend(&args, query, (int)(i % num_kv_heads), scores);
        }
        free(scores);
    }
    free(starts);
    return failed ? NO_MEMORY : OK;
}
