/* Paged attention for the CPU, the driver: checks every read against the cache and block tables,
 * picks the widest path compiled for (AVX512, AVX2, else portable C), groups consecutive queries of
 * one member into blocks where the path attends blocks, and has the OpenMP threads (torch's own
 * pool once torch is loaded: the same libgomp soname) claim the step's work items, (query block,
 * KV head, part) triples, one at a time; a decode's long context is split into parts that are
 * merged at the end. Shapes and layouts: paged_attention.h. */
#include <math.h>
#include <stdlib.h>

#include "paged_attention.h"
#include "layer_kernels.h"

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

/* The step's work. Query block b is queries starts[b] .. starts[b + 1]; a decode (its member's only
 * query in the step) over more than split_positions positions is parts_of[b] > 1 parts of
 * part_positions() each (the last one shorter), the partials of its KV head h's part p at partials
 * + partial_at[b] + (h * parts_of[b] + p) * part_floats(), remaining[b] of its items not done yet.
 * items: one per (block, KV head, part). */
typedef struct { int64_t block; int kv_head, part; } Item;
typedef struct {
    int64_t *starts, num_blocks;             /* [num_blocks + 1] */
    int *parts_of, *remaining;               /* [num_blocks] each */
    int64_t *partial_at;                     /* [num_blocks] */
    Item *items;
    int64_t num_items;
    float *partials;
    int split_positions;
} Work;

/* Positions per part of a decode over n positions (n itself: one part): a multiple of TILE, for the
 * fewest parts of at most split_positions; the last part holds the rest (n 70, 32: 32 + 32 + 6). */
static int part_positions(int n, int split_positions) {
    if (split_positions == 0 || n <= split_positions) return n;
    int parts = (n + split_positions - 1) / split_positions;
    return padded((n + parts - 1) / parts);
}

/* Whether query t is its member's only one in the step (a member's queries are consecutive). */
static int is_decode(const Args *a, int64_t t, int64_t num_tokens) {
    int32_t member = a->token_members[t];
    return (t == 0 || a->token_members[t - 1] != member) && (t == num_tokens - 1 || a->token_members[t + 1] != member);
}

static void free_work(Work *w) {
    free(w->starts), free(w->parts_of), free(w->remaining), free(w->partial_at), free(w->items), free(w->partials);
}

/* Fills w (free_work frees it, on failure too). A block's items run from its last part to its first,
 * so that the threads, claiming from the end, take the full parts before the short last one. */
static int plan_work(const Args *a, int64_t num_tokens, int per_block, int split_positions, Work *w) {
    w->split_positions = split_positions;
    if ((w->starts = malloc(((size_t)num_tokens + 1) * sizeof *w->starts)) == NULL) return NO_MEMORY;
    int64_t blocks = w->num_blocks = make_blocks(a, num_tokens, per_block, w->starts), floats = 0;
    w->parts_of = malloc((size_t)blocks * sizeof *w->parts_of + 1);
    w->partial_at = malloc((size_t)blocks * sizeof *w->partial_at + 1);
    w->remaining = malloc((size_t)blocks * sizeof *w->remaining + 1);
    if (w->parts_of == NULL || w->partial_at == NULL || w->remaining == NULL) return NO_MEMORY;
    const int64_t per_part = part_floats(a->num_heads / a->num_kv_heads, a->head_dim);
    for (int64_t b = 0; b < blocks; b++) {
        int64_t t = w->starts[b];
        int n = a->context_lens[t], size = is_decode(a, t, num_tokens) ? part_positions(n, split_positions) : n;
        int parts = (n + size - 1) / size;
        w->parts_of[b] = parts, w->partial_at[b] = floats, w->remaining[b] = parts * a->num_kv_heads;
        if (parts > 1) floats += (int64_t)parts * a->num_kv_heads * per_part;
        w->num_items += (int64_t)parts * a->num_kv_heads;
    }
    w->items = malloc((size_t)w->num_items * sizeof *w->items + 1);
    w->partials = malloc((size_t)floats * sizeof *w->partials + 1);
    if (w->items == NULL || w->partials == NULL) return NO_MEMORY;
    int64_t i = 0;
    for (int64_t b = 0; b < blocks; b++)
        for (int part = w->parts_of[b] - 1; part >= 0; part--)
            for (int h = 0; h < a->num_kv_heads; h++) w->items[i++] = (Item){b, h, part};
    return OK;
}

/* The positions an item of a decode attends, and where it writes (Part). */
static Part part_of(const Work *w, Item item, int n, int group, int head_dim) {
    int parts = w->parts_of[item.block], size = part_positions(n, w->split_positions), begin = item.part * size;
    if (parts == 1) return (Part){0, n, NULL};
    float *partial = w->partials + w->partial_at[item.block]
                     + ((int64_t)item.kv_head * parts + item.part) * part_floats(group, head_dim);
    return (Part){begin, begin + size < n ? begin + size : n, partial};
}

/* Counts one finished item of split block b: true for its last, whose thread then merges the parts
 * (seq_cst: the partials the other threads wrote are visible to it). */
static int last_of_block(Work *w, int64_t b) {
    int left;
#pragma omp atomic capture seq_cst
    left = --w->remaining[b];
    return left == 0;
}

/* Writes out's rows of split block b's query: per query head, its parts' rows weighted by each
 * part's sum of exp(score - the largest score of all parts). */
static void merge_parts(const Args *a, const Work *w, int64_t b) {
    const int G = a->num_heads / a->num_kv_heads, dim = a->head_dim, parts = w->parts_of[b];
    const int64_t query = w->starts[b], per_part = part_floats(G, dim);
    float acc[dim];
    for (int h = 0; h < a->num_kv_heads; h++) {
        const float *first = w->partials + w->partial_at[b] + (int64_t)h * parts * per_part;
        for (int g = 0; g < G; g++) {
            float top = -INFINITY, total = 0.0f;
            for (int p = 0; p < parts; p++) top = fmaxf(top, first[p * per_part + G * dim + g]);
            memset(acc, 0, sizeof acc);
            for (int p = 0; p < parts; p++) {
                const float *part = first + p * per_part;
                float weight = part[G * dim + G + g] * expf(part[G * dim + g] - top);
                total += weight;
                for (int d = 0; d < dim; d++) acc[d] += weight * part[g * dim + d];
            }
            int64_t dst = (query * a->num_heads + h * G + g) * dim;
            for (int d = 0; d < dim; d++) {
                if (a->q_bf16) ((uint16_t *)a->out)[dst + d] = f32_to_bf16(acc[d] / total);
                else ((float *)a->out)[dst + d] = acc[d] / total;
            }
        }
    }
}

/* Whether this build takes split_positions (bench_attention loads builds of older checkouts too). */
int paged_attention_splits(void) { return 1; }

/* The next item for this thread (-1: none left), last first. */
static int64_t claim(int64_t *claimed, int64_t num_items) {
    int64_t i;
#pragma omp atomic capture
    i = (*claimed)++;
    return num_items - 1 - i;
}

/* Asks for the K and V rows of the first AHEAD positions an item reads, into L2, so that its first
 * tiles do not wait on memory as the item before it on this thread computes. */
static void prefetch_item(const Args *a, const Work *w, Item item) {
    int64_t query = w->starts[item.block];
    int n = a->context_lens[query], begin = part_of(w, item, n, a->num_heads / a->num_kv_heads, a->head_dim).begin;
    int row_bytes = a->head_dim * (a->bf16 ? 2 : 4);
    int64_t head = (int64_t)item.kv_head * a->num_slots * row_bytes;
    const int32_t *table = table_of(a, query);
    prefetch_positions(a, table, begin, AHEAD, n, (const char *)a->k_cache + head, row_bytes);
    prefetch_positions(a, table, begin, AHEAD, n, (const char *)a->v_cache + head, row_bytes);
}

/* Writes every row of out. dtypes: enum Dtypes. A decode (its member's only query in the step)
 * over more than split_positions positions (a multiple of TILE; 0: never) is split into parts of
 * at most that many (part_positions), each its own work item, and the thread that finishes its
 * last part merges them: a lone long decode keeps every thread busy. The split depends on the
 * query's context alone, so a query's output depends neither on the step's other queries nor on
 * the thread count. Returns OK, NO_MEMORY (out incomplete) or, with nothing written: BAD_DTYPES,
 * BAD_SHAPE (heads, head_dim, block_size or split_positions), BAD_MEMBER (a token's member is not
 * a row of block_tables), BAD_CONTEXT (a context < 1), SHORT_TABLE (a context past its block
 * table) or BAD_BLOCK (a table names a block outside the cache), with *where the token or member
 * at fault. */
int paged_attend(const void *q, int64_t q_token_stride, void *out, const void *k_cache, const void *v_cache,
                 int64_t num_slots, const int32_t *block_tables, int64_t num_seqs, int64_t max_blocks,
                 const int32_t *token_members, const int32_t *context_lens, int64_t num_tokens,
                 int num_heads, int num_kv_heads, int head_dim, int block_size, float scale, int dtypes,
                 int split_positions, int num_threads, int64_t *where) {
    if (!valid_dtypes(dtypes)) return BAD_DTYPES;
    if (num_kv_heads < 1 || num_heads % num_kv_heads || head_dim < 1 || block_size < 1 || split_positions < 0
            || split_positions % TILE)
        return BAD_SHAPE;
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
    Work work = {0};
    if (plan_work(&args, num_tokens, per_block, split_positions, &work) != OK) {
        free_work(&work);
        return NO_MEMORY;
    }
    num_threads = num_threads < 1 ? 1 : num_threads > MAX_THREADS ? MAX_THREADS : num_threads;
    if (num_threads > work.num_items) num_threads = work.num_items > 0 ? (int)work.num_items : 1;
    size_t scores_bytes = (size_t)group * (size_t)padded(max_context) * (sizeof(float) + sizeof(uint16_t));
    if (attend_block != NULL && block_scratch_bytes(max_context) > scores_bytes) scores_bytes = block_scratch_bytes(max_context);
    /* The threads claim items one at a time, last first: a chunk's later queries attend to more
     * positions, so the heaviest go first and the short ones even out the end; and a thread whose
     * core another process takes for a while (the frontend, the scheduler) holds up the call by
     * the item it runs and the one it claimed next (whose first rows it asked for meanwhile). A
     * split query's parts are merged by the thread that finishes its last one. */
    int64_t claimed = 0;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        float *scores = malloc(scores_bytes);
        failed |= scores == NULL;
        for (int64_t i = scores != NULL ? claim(&claimed, work.num_items) : -1, next; i >= 0; i = next) {
            next = claim(&claimed, work.num_items);
            if (next >= 0) prefetch_item(&args, &work, work.items[next]);
            Item item = work.items[i];
            int64_t query = work.starts[item.block];
            int count = (int)(work.starts[item.block + 1] - query);
            /* every query of a prompt chunk takes the block path, one alone in its block too: a
             * query's output does not depend on where the step's token budget cut its prompt */
            if (attend_block != NULL && !is_decode(&args, query, num_tokens))
                attend_block(&args, query, count, item.kv_head, scores);
            else attend(&args, query, item.kv_head, part_of(&work, item, context_lens[query], group, head_dim), scores);
            if (work.parts_of[item.block] > 1 && last_of_block(&work, item.block)) merge_parts(&args, &work, item.block);
        }
        free(scores);
    }
    free_work(&work);
    return failed ? NO_MEMORY : OK;
}
