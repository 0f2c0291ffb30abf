/* Portable paged attention: any head_dim and GQA group, any of enum Dtypes; what the vectorised
 * paths (attend_avx2.c, attend_avx512.c) do not cover. */
#include <math.h>

#include "paged_attention.h"

static inline float element(const void *base, int64_t index, int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t *)base)[index]) : ((const float *)base)[index];
}

void attend_portable(const Args *a, int64_t query, int kv_head, Part part, float *scores) {
    int group = a->num_heads / a->num_kv_heads, dim = a->head_dim;
    int bf16 = a->bf16, q_bf16 = a->q_bf16, bs = a->block_size, begin = part.begin, end = part.end;
    int64_t head = kv_head * a->num_slots * dim;
    int64_t q_offset = query * a->q_token_stride + kv_head * group * dim;
    const int32_t *table = table_of(a, query);
    float acc[dim], q[dim];
    for (int g = 0; g < group; g++) {
        float *s = scores + g * padded(end - begin), top = -INFINITY, sum = 0.0f;  /* s[p - begin]: position p's */
        for (int d = 0; d < dim; d++) q[d] = element(a->q, q_offset + g * dim + d, q_bf16) * a->scale;
        for (int p = begin; p < end; p++) {
            int64_t offset = head + ((int64_t)table[p / bs] * bs + p % bs) * dim;
            float dot = 0.0f;
            for (int d = 0; d < dim; d++) dot += q[d] * element(a->k_cache, offset + d, bf16);
            s[p - begin] = dot;
            top = dot > top ? dot : top;
        }
        memset(acc, 0, sizeof acc);
        for (int p = begin; p < end; p++) {
            int64_t offset = head + ((int64_t)table[p / bs] * bs + p % bs) * dim;
            float weight = expf(s[p - begin] - top);
            sum += weight;
            for (int d = 0; d < dim; d++) acc[d] += weight * element(a->v_cache, offset + d, bf16);
        }
        if (part.partial != NULL) {
            for (int d = 0; d < dim; d++) part.partial[g * dim + d] = acc[d] / sum;
            part.partial[group * dim + g] = top, part.partial[group * dim + group + g] = sum;
            continue;
        }
        int64_t dst = (query * a->num_heads + kv_head * group + g) * dim;
        for (int d = 0; d < dim; d++) {
            if (q_bf16) ((uint16_t *)a->out)[dst + d] = f32_to_bf16(acc[d] / sum);
            else ((float *)a->out)[dst + d] = acc[d] / sum;
        }
    }
}
