/* The C interface of the native kernels (paged_attention.c, fused_ops.c,
 * int_matmul.c);
 * native.py and native_attention.py mirror it with ctypes, and
 * tests/engine/kernels/kernel_harness.c calls it directly. */

#ifndef LLMESH_KERNELS_H
#define LLMESH_KERNELS_H

#include <stdint.h>

/* The step's plan: fixed for every layer of one step. */
typedef struct {
    int64_t num_tokens;      /* rows that carry a token (the rest are padding) */
    int64_t num_seqs;
    const int64_t *seq_first_row; /* [num_seqs] first row of the sequence's tokens */
    const int64_t *seq_num_tokens; /* [num_seqs] its tokens in this step */
    const int64_t *seq_start;      /* [num_seqs] its tokens already cached (position of the first) */
    const int64_t *seq_table;      /* [num_seqs] offset of its block table in block_tables */
    const int64_t *block_tables;   /* block ids, each sequence's back to back */
    const int64_t *slots;          /* [num_tokens] slot of each new token */
    int64_t num_heads;
    int64_t num_kv_heads;
    int64_t head_dim;
    int64_t block_size;
    int64_t cache_head_stride;     /* floats between KV heads in a layer's cache */
    const float *rope_cos;         /* [max_positions, head_dim] */
    const float *rope_sin;         /* [max_positions, head_dim], first half negated */
    int32_t qkv_bf16;              /* qkv is bf16 (else fp32) */
    int32_t out_bf16;              /* write out as bf16 (else fp32) */
    float scale;
    int32_t num_threads;
} step_plan;

/* Returns 0, or a negative code for a plan this kernel does not take:
 * -1 head_dim not even or not in [2, 256]; -2 num_heads not a multiple of
 * num_kv_heads, or more than 32 query heads per KV head; -3 out of memory;
 * -4 block_size below 1. */
int llmesh_paged_attention(const step_plan *plan, const void *qkv, float *k_cache, float *v_cache,
                           void *out);

/* hidden += delta (skipped for NULL); out = RMSNorm(hidden) * weight. Returns
 * 0, or -1 for n < 1. */
int llmesh_add_rms_norm(float *hidden, const void *delta, int32_t delta_bf16, const float *weight,
                        int64_t rows, int64_t n, float eps, void *out, int32_t out_bf16,
                        int32_t num_threads);

/* out = SiLU(gate_up[:, :n]) * gate_up[:, n:]. Returns 0, or -1 for n < 1. */
int llmesh_silu_mul(const void *gate_up, int32_t in_bf16, int64_t rows, int64_t n, void *out,
                    int32_t out_bf16, int32_t num_threads);

/* out[rows, out_features] = x[rows, in_features] @ W.T, W in the packed Q4_1
 * layout of int_matmul.c, x quantized per row and 32 inputs to int16. Returns
 * 0, -1 for in_features not a positive multiple of 32, out_features < 1 or
 * rows < 0, -3 out of memory. */
int llmesh_q4_1_matmul(const void *x, int32_t x_bf16, int64_t rows, int64_t in_features,
                       const uint8_t *packed, int64_t out_features, void *out, int32_t out_bf16,
                       int32_t num_threads);

/* out = x @ W.T, W int8 with a scale per output feature (scales [out_features]
 * fp32; the packed int8 layout of int_matmul.c), x quantized as above. Returns
 * as llmesh_q4_1_matmul, and -1 for NULL scales with rows > 0. */
int llmesh_q8_matmul(const void *x, int32_t x_bf16, int64_t rows, int64_t in_features,
                     const uint8_t *packed, const float *scales, int64_t out_features, void *out,
                     int32_t out_bf16, int32_t num_threads);

/* Rows of one call that share each widening of a block's weights in both
 * integer matmuls (int_matmul.c's ROW_CHUNK). */
int32_t llmesh_int_matmul_row_chunk(void);

#endif
