/* Every decoder layer of a step in one call, for the CPU: the kernels a Llama-family layer is made of
 * (layer_kernels.h), called in the order worker_proc/model.py calls them one by one, on the same
 * values, so every output is the same bit for bit. What goes is the Python between the calls: a
 * layer makes about ten, each with its checks, views and allocations, which took a third of a
 * one-sequence decode step of SmolLM2-135M (docs/benchmarks.md, "Decoder layers in one call").
 *
 * One layer: h = norm(x + residual); qkv = h Wqkv; q, k rotated in place; k, v to the cache at the
 * step's slots; a = attention(q); o = a Wo; h = norm(o + residual); down(silu(gate) * up) of
 * h Wgate_up is the next layer's x. Every linear runs through the skinny kernel; the model computes
 * in fp32 or bf16, and an fp32 model's cache may be bf16 (the attention's mixed path). The last
 * layer runs its o projection and MLP only for the step's `rows` (the LM head's), as the model does.
 * The sums x + residual alternate between two buffers; the embeddings are only read.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "layer_kernels.h"

enum { DECODER_OK = 0, DECODER_FAILED = -1 };
/* What failed (DecoderStep.failure[0]): [1] the layer, [2] the kernel's status, [3] its index. */
enum Failure { NO_FAILURE = 0, BAD_SLOT = 1, BAD_ROW = 2, ATTENTION = 3, LINEAR = 4, NO_MEMORY = 5 };
enum { QKV = 0, O = 1, GATE_UP = 2, DOWN = 3, NUM_LINEARS = 4 };
enum { ALL_F32 = 0, ALL_BF16 = 1, F32_OVER_BF16 = 2 };  /* paged_attention.h's enum Dtypes */

typedef struct {  /* one layer's weights as the kernels read them (worker_proc/layers/native_decoder.py) */
    const void *input_norm, *post_norm;   /* [hidden] */
    const void *panels[NUM_LINEARS];      /* the skinny linear's layout of each weight */
    const void *bias[NUM_LINEARS];        /* [out_features], or NULL */
    int wide[NUM_LINEARS];                /* an fp32 model's weight kept as bf16 panels */
} DecoderLayer;

typedef struct {  /* the model: the same for every step */
    const DecoderLayer *layers; int num_layers;
    const void *final_norm;               /* [hidden] */
    int hidden, num_heads, num_kv_heads, head_dim, inter;
    float eps, scale;                     /* the norms' epsilon; the attention's 1 / sqrt(head_dim) */
    int bf16, cache_bf16;                 /* the model's dtype and the cache's: bf16, else fp32 */
    int block_size, split_positions;
} DecoderModel;

typedef struct {  /* one step; shapes as the attention's (paged_attention.h) */
    int64_t num_tokens;
    const void *embedded;                 /* [num_tokens, hidden], read only */
    const void *cos, *signed_sin;         /* [num_tokens, head_dim] */
    const int64_t *slot_mapping;          /* [num_tokens] */
    const int32_t *block_tables; int64_t num_seqs, max_blocks;
    const int32_t *token_members, *context_lens;  /* [num_tokens] */
    void *const *kv_caches; int64_t num_slots;    /* [num_layers][2]: K, V [num_kv_heads, num_slots, head_dim] */
    const int64_t *rows; int64_t num_rows;        /* the last layer's output rows, in order; -1: every token */
    void *out;                            /* [num_rows (or num_tokens), hidden]: the final norm's */
    int num_threads;
    int64_t failure[4];
} DecoderStep;

/* The step's scratch, in the model's dtype: two residual buffers, the norm's output and each
 * projection's, and the last layer's gathered rows. */
typedef struct { char *sums[2], *normed, *qkv, *attn, *gate_up, *act, *attn_rows, *residual_rows; } Buffers;

static int fail(DecoderStep *s, enum Failure what, int64_t layer, int64_t status, int64_t index) {
    s->failure[0] = what; s->failure[1] = layer; s->failure[2] = status; s->failure[3] = index;
    return DECODER_FAILED;
}

static int linear(const DecoderModel *m, const DecoderLayer *l, int which, const void *x, int64_t rows,
                  int64_t k, int64_t n, void *y, int threads) {
    if (m->bf16) return skinny_linear_bf16(x, k, l->panels[which], l->bias[which], y, rows, n, k, threads);
    if (l->wide[which]) return skinny_linear_f32_w16(x, k, l->panels[which], l->bias[which], y, rows, n, k, threads);
    return skinny_linear_f32(x, k, l->panels[which], l->bias[which], y, rows, n, k, threads);
}

static void add_rms_norm(const DecoderModel *m, void *x, const void *residual, const void *weight, void *out,
                         int64_t rows, int threads) {
    if (m->bf16) add_rms_norm_bf16(x, residual, weight, out, rows, m->hidden, m->eps, threads);
    else add_rms_norm_f32(x, residual, weight, out, rows, m->hidden, m->eps, threads);
}

/* This step's k and v (rows of qkv, after the rotation) into the layer's caches at slot_mapping,
 * rounded to nearest even where the cache is bf16 under an fp32 model (as torch's .to() rounds). */
static void write_kv(const DecoderModel *m, const DecoderStep *s, const char *qkv, void *k_cache, void *v_cache) {
    int64_t d = m->head_dim, width = (int64_t)(m->num_heads + 2 * m->num_kv_heads) * d;
    int bytes = m->bf16 ? 2 : 4, cache_bytes = m->cache_bf16 ? 2 : 4;
#pragma omp parallel for if (s->num_tokens >= 256) num_threads(s->num_threads)
    for (int64_t t = 0; t < s->num_tokens; t++) {
        for (int64_t h = 0; h < 2 * m->num_kv_heads; h++) {  /* K heads, then V heads */
            int64_t head = h % m->num_kv_heads;
            const char *src = qkv + (t * width + (m->num_heads + h) * d) * bytes;
            char *dst = (char *)(h < m->num_kv_heads ? k_cache : v_cache)
                        + ((head * s->num_slots) + s->slot_mapping[t]) * d * cache_bytes;
            if (bytes == cache_bytes) memcpy(dst, src, (size_t)(d * bytes));
            else for (int64_t i = 0; i < d; i++) ((uint16_t *)dst)[i] = f32_to_bf16(((const float *)src)[i]);
        }
    }
}

static void gather_rows(const char *src, char *dst, const int64_t *rows, int64_t num_rows, int64_t row_bytes) {
    for (int64_t r = 0; r < num_rows; r++) memcpy(dst + r * row_bytes, src + rows[r] * row_bytes, (size_t)row_bytes);
}

static int check_step(const DecoderModel *m, DecoderStep *s) {
    for (int64_t t = 0; t < s->num_tokens; t++)
        if (s->slot_mapping[t] < 0 || s->slot_mapping[t] >= s->num_slots) return fail(s, BAD_SLOT, -1, 0, t);
    for (int64_t r = 0; r < s->num_rows; r++)
        if (s->rows[r] < 0 || s->rows[r] >= s->num_tokens) return fail(s, BAD_ROW, m->num_layers - 1, 0, r);
    return DECODER_OK;
}

static char *allocate(const DecoderModel *m, const DecoderStep *s, Buffers *b) {
    int64_t t = s->num_tokens, bytes = m->bf16 ? 2 : 4, q = (int64_t)m->num_heads * m->head_dim;
    int64_t r = s->num_rows > 0 ? s->num_rows : 0, hidden = m->hidden * bytes;
    int64_t sizes[] = {t * hidden, t * hidden, t * hidden, t * (q + 2 * (int64_t)m->num_kv_heads * m->head_dim) * bytes,
                       t * q * bytes, t * 2 * m->inter * bytes, t * m->inter * bytes, r * q * bytes, r * hidden};
    char **slots[] = {&b->sums[0], &b->sums[1], &b->normed, &b->qkv, &b->attn, &b->gate_up, &b->act,
                      &b->attn_rows, &b->residual_rows};
    int count = (int)(sizeof sizes / sizeof sizes[0]);
    int64_t total = 0;
    for (int i = 0; i < count; i++) total += (sizes[i] + 63) / 64 * 64;
    char *base = aligned_alloc(64, (size_t)(total > 0 ? total : 64)), *at = base;
    for (int i = 0; i < count && base != NULL; i++) { *slots[i] = at; at += (sizes[i] + 63) / 64 * 64; }
    return base;
}

/* One layer. x: its input, the previous layer's MLP output in sums[1] (or the embeddings);
 * residual: the stream it is added to, in sums[0] (NULL for the first layer: x is the stream, and
 * is only read). The sum goes into x's buffer and is the stream until the o projection's output,
 * in sums[0], is added to it there; the MLP's output goes to sums[1]. *num_rows_out: the rows it
 * output (the step's rows on the last layer). */
static int layer(const DecoderModel *m, DecoderStep *s, Buffers *b, int i, void *x, const void *residual,
                 int64_t *num_rows_out) {
    const DecoderLayer *l = &m->layers[i];
    int threads = s->num_threads, bytes = m->bf16 ? 2 : 4;
    int64_t t = s->num_tokens, d = m->head_dim, q = (int64_t)m->num_heads * d;
    int64_t width = q + 2 * (int64_t)m->num_kv_heads * d;
    add_rms_norm(m, x, residual, l->input_norm, b->normed, t, threads);  /* writes x only under a residual */
    residual = x;
    int status = linear(m, l, QKV, b->normed, t, m->hidden, width, b->qkv, threads);
    if (status != 0) return fail(s, LINEAR, i, status, QKV);
    if (m->bf16) rotary_bf16((uint16_t *)b->qkv, width, s->cos, s->signed_sin, t, m->num_heads + m->num_kv_heads, d, threads);
    else rotary_f32((float *)b->qkv, width, s->cos, s->signed_sin, t, m->num_heads + m->num_kv_heads, d, threads);
    write_kv(m, s, b->qkv, s->kv_caches[2 * i], s->kv_caches[2 * i + 1]);
    int64_t where = -1;
    status = paged_attend(b->qkv, width, b->attn, s->kv_caches[2 * i], s->kv_caches[2 * i + 1], s->num_slots,
                          s->block_tables, s->num_seqs, s->max_blocks, s->token_members, s->context_lens, t,
                          m->num_heads, m->num_kv_heads, (int)d, m->block_size, m->scale,
                          m->bf16 ? ALL_BF16 : m->cache_bf16 ? F32_OVER_BF16 : ALL_F32, m->split_positions,
                          threads, &where);
    if (status != 0) return fail(s, ATTENTION, i, status, where);
    const char *attn = b->attn;
    if (i == m->num_layers - 1 && s->num_rows >= 0) {  /* every token's K and V are cached by now */
        gather_rows(b->attn, b->attn_rows, s->rows, s->num_rows, q * bytes);
        gather_rows(residual, b->residual_rows, s->rows, s->num_rows, (int64_t)m->hidden * bytes);
        attn = b->attn_rows;
        residual = b->residual_rows;
        t = s->num_rows;
        if (t == 0) { *num_rows_out = 0; return DECODER_OK; }
    }
    status = linear(m, l, O, attn, t, q, m->hidden, b->sums[0], threads);
    if (status != 0) return fail(s, LINEAR, i, status, O);
    add_rms_norm(m, b->sums[0], residual, l->post_norm, b->normed, t, threads);
    status = linear(m, l, GATE_UP, b->normed, t, m->hidden, 2 * (int64_t)m->inter, b->gate_up, threads);
    if (status != 0) return fail(s, LINEAR, i, status, GATE_UP);
    if (m->bf16) silu_mul_bf16((const uint16_t *)b->gate_up, (uint16_t *)b->act, t, m->inter, threads);
    else silu_mul_f32((const float *)b->gate_up, (float *)b->act, t, m->inter, threads);
    status = linear(m, l, DOWN, b->act, t, m->inter, m->hidden, b->sums[1], threads);
    if (status != 0) return fail(s, LINEAR, i, status, DOWN);
    *num_rows_out = t;
    return DECODER_OK;
}

int decoder_layers(const DecoderModel *m, DecoderStep *s) {
    memset(s->failure, 0, sizeof s->failure);
    if (check_step(m, s) != DECODER_OK) return DECODER_FAILED;
    Buffers b;
    char *base = allocate(m, s, &b);
    if (base == NULL) return fail(s, NO_MEMORY, -1, 0, 0);
    int64_t num_rows = s->num_tokens;
    for (int i = 0; i < m->num_layers && num_rows > 0; i++) {
        /* the first layer only reads the embeddings: add_rms_norm writes x under a residual alone */
        void *x = i == 0 ? (void *)s->embedded : b.sums[1];
        if (layer(m, s, &b, i, x, i == 0 ? NULL : b.sums[0], &num_rows) != DECODER_OK) {
            free(base);
            return DECODER_FAILED;
        }
    }
    if (num_rows > 0) add_rms_norm(m, b.sums[1], b.sums[0], m->final_norm, s->out, num_rows, s->num_threads);
    free(base);
    return DECODER_OK;
}
