/* The native library's entry points that a decoder layer is made of, declared once: the files that
 * define them include this, and so does decoder_layers.c, which calls them in a layer's order.
 * Layouts and rounding: each defining file's header comment. Every call splits its work over
 * num_threads OpenMP threads; the linears and the attention return 0 or a negative status. */
#ifndef CONVEYOR_LAYER_KERNELS_H
#define CONVEYOR_LAYER_KERNELS_H

#include <stdint.h>

/* fused_ops.c */
void add_rms_norm_f32(float *x, const float *residual, const float *weight, float *out, int64_t rows,
                      int64_t dim, float eps, int num_threads);
void add_rms_norm_bf16(uint16_t *x, const uint16_t *residual, const uint16_t *weight, uint16_t *out,
                       int64_t rows, int64_t dim, float eps, int num_threads);
void silu_mul_f32(const float *gate_up, float *out, int64_t rows, int64_t inter, int num_threads);
void silu_mul_bf16(const uint16_t *gate_up, uint16_t *out, int64_t rows, int64_t inter, int num_threads);
void rotary_f32(float *x, int64_t x_stride, const float *cos, const float *signed_sin, int64_t tokens,
                int64_t heads, int64_t head_dim, int num_threads);
void rotary_bf16(uint16_t *x, int64_t x_stride, const uint16_t *cos, const uint16_t *signed_sin, int64_t tokens,
                 int64_t heads, int64_t head_dim, int num_threads);

/* skinny_linear.c, skinny_bf16.c */
int skinny_linear_f32(const float *x, int64_t x_stride, const float *panels, const float *bias, float *y,
                      int64_t m, int64_t n, int64_t k, int num_threads);
int skinny_linear_f32_w16(const float *x, int64_t x_stride, const uint16_t *panels, const float *bias,
                          float *y, int64_t m, int64_t n, int64_t k, int num_threads);
int skinny_linear_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *panels, const uint16_t *bias,
                       uint16_t *y, int64_t m, int64_t n, int64_t k, int num_threads);

/* paged_attention.c */
int paged_attend(const void *q, int64_t q_token_stride, void *out, const void *k_cache, const void *v_cache,
                 int64_t num_slots, const int32_t *block_tables, int64_t num_seqs, int64_t max_blocks,
                 const int32_t *token_members, const int32_t *context_lens, int64_t num_tokens,
                 int num_heads, int num_kv_heads, int head_dim, int block_size, float scale, int dtypes,
                 int split_positions, int num_threads, int64_t *where);

#endif
