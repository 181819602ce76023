/* Integer-dot matrix multiplies for quantized projections: int4 (Q4_1) or int8
 * weights times activations quantized to int8 per row and 32 inputs.
 *
 * llmesh_q4_1_matmul, for the int4 projections of generated tokens:
 * y[rows, out] = x[rows, in] @ W[out, in].T with W in ggml's Q4_1 format (per
 * 32 inputs of an output row: w = d * q + m, q in 0..15, fp16 d and m) and x
 * quantized per row and per 32 inputs to int8 (ggml's Q8_1: a = da * qa,
 * da = max|x| / 127, qa rounded to nearest even; sa = da * sum(qa)). The dot
 * product of one block is then
 *
 *     sum_i (d q_i + m) (da qa_i) = d da * sum_i q_i qa_i + m sa
 *
 * and sum_i q_i qa_i is an exact integer: AVX512-VNNI's vpdpbusd takes 4 u8 x
 * s8 products per 32-bit lane. This is the scheme llama.cpp uses for Q4_1 on
 * CPUs (ggml_vec_dot_q4_1_q8_1); the packed layout and the loops are ours.
 *
 * Packed weights (llmesh_q4_1_pack's layout, built in Python by quant.py):
 * output features in tiles of 16 (zero-padded), and for each tile and block
 * of 32 inputs one 320-byte record:
 *
 *     uint16 d[16]; uint16 m[16];  fp16 scale and minimum of the 16 features
 *     uint8  q[4][16][4];          chunk c, feature j, byte i: low nibble
 *                                  q[j][4c + i], high nibble q[j][16 + 4c + i]
 *
 * so one 64-byte load holds, per 32-bit lane j, four consecutive inputs of
 * feature j in its low nibbles and four more in its high nibbles: two
 * vpdpbusd against the activation's 4 bytes broadcast to every lane.
 *
 * Batch invariance by construction: a row's activation is quantized from that
 * row alone, its integer sums are exact, and its fp32 result is accumulated
 * block by block in input order with the same instruction sequence for every
 * row, whatever the number of rows, the row tile (1 to 4 rows share the
 * weight loads) or the thread that computes the feature tile. The cost is
 * nearly flat in rows up to ~8: the weights are read once per call and the
 * integer work per row is small next to the memory traffic.
 *
 * llmesh_q8_matmul, for int8 weights with one fp32 scale per output row (the
 * LM head; the projections of --quantization int8): w = s * qw, qw in
 * -128..127, stored as qw + 128 (u8, for vpdpbusd) in the same tile/block
 * order (a 512-byte record: chunk c of 8, feature j, byte i holds
 * qw[j][4c + i] + 128), so sum_i qw_i qa_i = sum_i (qw_i + 128) qa_i -
 * 128 sum_i qa_i, exact. y = s * sum_b da_b * isum_b, accumulated block by
 * block in input order as above.
 */

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "llmesh_kernels.h"
#include "simd.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define LLMESH_Q4_VNNI 1
#include <immintrin.h>
#endif

#define Q_BLOCK 32
#define TILE 16
#define RECORD (2 * TILE * 2 + TILE * Q_BLOCK / 2) /* 320 bytes */
#define RECORD8 (TILE * Q_BLOCK)                   /* 512 bytes */
#define ROW_TILE 4
/* Smallest block maximum quantized (1 / (amax / 127) stays finite above it). */
#define MIN_AMAX 1e-35f

/* fp16 -> fp32 (exact), for the portable path. */
static inline float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu, bits;
    if (exponent == 0x1f) {
        bits = sign | 0x7f800000u | (mantissa << 13);
    } else if (exponent != 0) {
        bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
    } else if (mantissa == 0) {
        bits = sign;
    } else { /* subnormal: normalize */
        exponent = 113;
        while (!(mantissa & 0x400u)) {
            mantissa <<= 1;
            exponent--;
        }
        bits = sign | (exponent << 23) | ((mantissa & 0x3ffu) << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* One row's Q8_1 quantization: qa [in] int8, da and sa [in / 32], and the
 * integer sums sum_i qa_i [in / 32] (NULL: not wanted). */
static void quantize_row(const void *x, int32_t x_bf16, int64_t row, int64_t in, int8_t *qa,
                         float *da, float *sa, int32_t *isum) {
    for (int64_t b = 0; b < in / Q_BLOCK; b++) {
        float v[Q_BLOCK], amax = 0.0f;
        int finite = 1;
        for (int i = 0; i < Q_BLOCK; i++) {
            const int64_t index = row * in + b * Q_BLOCK + i;
            v[i] = x_bf16 ? bf16_to_float(((const uint16_t *)x)[index]) : ((const float *)x)[index];
            const float a = fabsf(v[i]);
            finite &= a <= FLT_MAX; /* false for inf and NaN */
            amax = a > amax ? a : amax;
        }
        /* A block below MIN_AMAX (where 1 / d would overflow) counts as zeros;
         * a NaN or inf makes d NaN, so every output of the row is NaN. */
        const float d = !finite ? NAN : amax < MIN_AMAX ? 0.0f : amax / 127.0f;
        const float id = finite && d != 0.0f ? 1.0f / d : 0.0f;
        int32_t sum = 0;
        for (int i = 0; i < Q_BLOCK; i++) {
            const int32_t q = (int32_t)nearbyintf(v[i] * id);
            qa[b * Q_BLOCK + i] = (int8_t)q;
            sum += q;
        }
        da[b] = d;
        sa[b] = d * (float)sum;
        if (isum != NULL) isum[b] = sum;
    }
}

static inline void store_row(void *out, int32_t out_bf16, int64_t offset, int64_t count,
                             const float *values) {
    for (int64_t j = 0; j < count; j++) {
        if (out_bf16)
            ((uint16_t *)out)[offset + j] = float_to_bf16(values[j]);
        else
            ((float *)out)[offset + j] = values[j];
    }
}

#ifdef LLMESH_Q4_VNNI

/* The feature tile `tile` for `nr` (1..4, a constant after inlining) rows
 * starting at `row`: identical per-row instruction sequence for any nr. */
static inline __attribute__((always_inline)) void tile_rows(
    const uint8_t *records, int64_t blocks, const int8_t *qa, const float *da, const float *sa,
    int64_t in, int64_t row, const int nr, float acc_out[ROW_TILE][TILE]) {
    const __m512i low = _mm512_set1_epi8(0x0f);
    __m512 acc[ROW_TILE];
    for (int r = 0; r < nr; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *record = records + b * RECORD;
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)record));
        const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(record + 32)));
        __m512i lo[4], hi[4];
        for (int c = 0; c < 4; c++) {
            const __m512i p = _mm512_loadu_si512((const void *)(record + 64 + 64 * c));
            lo[c] = _mm512_and_si512(p, low);
            hi[c] = _mm512_and_si512(_mm512_srli_epi16(p, 4), low);
        }
        for (int r = 0; r < nr; r++) {
            const int64_t at = (row + r) * in + b * Q_BLOCK;
            const int32_t *words = (const int32_t *)(qa + at);
            __m512i s[4];
            for (int c = 0; c < 4; c++) {
                s[c] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo[c],
                                           _mm512_set1_epi32(words[c]));
                s[c] = _mm512_dpbusd_epi32(s[c], hi[c], _mm512_set1_epi32(words[c + 4]));
            }
            const __m512i sum = _mm512_add_epi32(_mm512_add_epi32(s[0], s[1]),
                                                 _mm512_add_epi32(s[2], s[3]));
            const int64_t scale_at = (row + r) * (in / Q_BLOCK) + b;
            const __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(da[scale_at]));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), scale, acc[r]);
            acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(sa[scale_at]), acc[r]);
        }
    }
    for (int r = 0; r < nr; r++) _mm512_storeu_ps(acc_out[r], acc[r]);
}


/* llmesh_q8_matmul's tile: as tile_rows, for 512-byte int8 records. */
static inline __attribute__((always_inline)) void tile_rows8(
    const uint8_t *records, int64_t blocks, const int8_t *qa, const float *da,
    const int32_t *qsum, int64_t in, int64_t row, const int nr, float acc_out[ROW_TILE][TILE]) {
    __m512 acc[ROW_TILE];
    for (int r = 0; r < nr; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *record = records + b * RECORD8;
        __m512i w[8];
        for (int c = 0; c < 8; c++) w[c] = _mm512_loadu_si512((const void *)(record + 64 * c));
        for (int r = 0; r < nr; r++) {
            const int64_t at = (row + r) * in + b * Q_BLOCK;
            const int32_t *words = (const int32_t *)(qa + at);
            __m512i s[4];
            for (int c = 0; c < 4; c++) {
                s[c] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[c],
                                           _mm512_set1_epi32(words[c]));
                s[c] = _mm512_dpbusd_epi32(s[c], w[c + 4], _mm512_set1_epi32(words[c + 4]));
            }
            const int64_t scale_at = (row + r) * (in / Q_BLOCK) + b;
            const __m512i sum = _mm512_sub_epi32(
                _mm512_add_epi32(_mm512_add_epi32(s[0], s[1]), _mm512_add_epi32(s[2], s[3])),
                _mm512_set1_epi32(128 * qsum[scale_at]));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_set1_ps(da[scale_at]), acc[r]);
        }
    }
    for (int r = 0; r < nr; r++) _mm512_storeu_ps(acc_out[r], acc[r]);
}
#else

/* Portable path: the same arithmetic, one feature at a time. */
static inline void tile_rows(const uint8_t *records, int64_t blocks, const int8_t *qa,
                             const float *da, const float *sa, int64_t in, int64_t row,
                             const int nr, float acc_out[ROW_TILE][TILE]) {
    for (int r = 0; r < nr; r++)
        for (int j = 0; j < TILE; j++) acc_out[r][j] = 0.0f;
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *record = records + b * RECORD;
        for (int j = 0; j < TILE; j++) {
            uint16_t dh, mh;
            memcpy(&dh, record + 2 * j, 2);
            memcpy(&mh, record + 32 + 2 * j, 2);
            const float d = half_to_float(dh), m = half_to_float(mh);
            for (int r = 0; r < nr; r++) {
                const int8_t *a = qa + (row + r) * in + b * Q_BLOCK;
                int32_t sum = 0;
                for (int c = 0; c < 4; c++)
                    for (int i = 0; i < 4; i++) {
                        const uint8_t byte = record[64 + 64 * c + 4 * j + i];
                        sum += (int32_t)(byte & 0x0f) * a[4 * c + i];
                        sum += (int32_t)(byte >> 4) * a[16 + 4 * c + i];
                    }
                const int64_t scale_at = (row + r) * (in / Q_BLOCK) + b;
                const float scale = d * da[scale_at];
                acc_out[r][j] = fmaf((float)sum, scale, acc_out[r][j]);
                acc_out[r][j] = fmaf(m, sa[scale_at], acc_out[r][j]);
            }
        }
    }
}

static inline void tile_rows8(const uint8_t *records, int64_t blocks, const int8_t *qa,
                              const float *da, const int32_t *qsum, int64_t in, int64_t row,
                              const int nr, float acc_out[ROW_TILE][TILE]) {
    for (int r = 0; r < nr; r++)
        for (int j = 0; j < TILE; j++) acc_out[r][j] = 0.0f;
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *record = records + b * RECORD8;
        for (int j = 0; j < TILE; j++)
            for (int r = 0; r < nr; r++) {
                const int8_t *a = qa + (row + r) * in + b * Q_BLOCK;
                int32_t sum = 0;
                for (int c = 0; c < 8; c++)
                    for (int i = 0; i < 4; i++)
                        sum += (int32_t)record[64 * c + 4 * j + i] * a[4 * c + i];
                const int64_t scale_at = (row + r) * (in / Q_BLOCK) + b;
                sum -= 128 * qsum[scale_at];
                acc_out[r][j] = fmaf((float)sum, da[scale_at], acc_out[r][j]);
            }
    }
}

#endif

int llmesh_q4_1_matmul(const void *x, int32_t x_bf16, int64_t rows, int64_t in_features,
                       const uint8_t *packed, int64_t out_features, void *out, int32_t out_bf16,
                       int32_t num_threads) {
    if (in_features < Q_BLOCK || in_features % Q_BLOCK || out_features < 1 || rows < 0) return -1;
    if (rows == 0) return 0;
    const int64_t blocks = in_features / Q_BLOCK, tiles = (out_features + TILE - 1) / TILE;
    int8_t *qa = malloc((size_t)(rows * in_features));
    float *scales = malloc(sizeof(float) * (size_t)(2 * rows * blocks));
    if (qa == NULL || scales == NULL) {
        free(qa);
        free(scales);
        return -3;
    }
    float *da = scales, *sa = scales + rows * blocks;
    const int threads = num_threads < 1 ? 1 : num_threads;
#pragma omp parallel for schedule(static) num_threads(threads) if (rows > 16)
    for (int64_t r = 0; r < rows; r++)
        quantize_row(x, x_bf16, r, in_features, qa + r * in_features, da + r * blocks,
                     sa + r * blocks, NULL);
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t t = 0; t < tiles; t++) {
        const uint8_t *records = packed + t * blocks * RECORD;
        const int64_t count = out_features - t * TILE < TILE ? out_features - t * TILE : TILE;
        float acc[ROW_TILE][TILE];
        for (int64_t row = 0; row < rows; row += ROW_TILE) {
            const int nr = rows - row < ROW_TILE ? (int)(rows - row) : ROW_TILE;
            switch (nr) {
            case 4: tile_rows(records, blocks, qa, da, sa, in_features, row, 4, acc); break;
            case 3: tile_rows(records, blocks, qa, da, sa, in_features, row, 3, acc); break;
            case 2: tile_rows(records, blocks, qa, da, sa, in_features, row, 2, acc); break;
            default: tile_rows(records, blocks, qa, da, sa, in_features, row, 1, acc); break;
            }
            for (int r = 0; r < nr; r++)
                store_row(out, out_bf16, (row + r) * out_features + t * TILE, count, acc[r]);
        }
    }
    free(qa);
    free(scales);
    return 0;
}

int llmesh_q8_matmul(const void *x, int32_t x_bf16, int64_t rows, int64_t in_features,
                     const uint8_t *packed, const float *scales, int64_t out_features, void *out,
                     int32_t out_bf16, int32_t num_threads) {
    if (in_features < Q_BLOCK || in_features % Q_BLOCK || out_features < 1 || rows < 0) return -1;
    if (rows == 0) return 0;
    const int64_t blocks = in_features / Q_BLOCK, tiles = (out_features + TILE - 1) / TILE;
    int8_t *qa = malloc((size_t)(rows * in_features));
    float *row_scales = malloc(sizeof(float) * (size_t)(2 * rows * blocks));
    int32_t *qsum = malloc(sizeof(int32_t) * (size_t)(rows * blocks));
    if (qa == NULL || row_scales == NULL || qsum == NULL) {
        free(qa);
        free(row_scales);
        free(qsum);
        return -3;
    }
    float *da = row_scales, *sa = row_scales + rows * blocks;
    const int threads = num_threads < 1 ? 1 : num_threads;
#pragma omp parallel for schedule(static) num_threads(threads) if (rows > 16)
    for (int64_t r = 0; r < rows; r++)
        quantize_row(x, x_bf16, r, in_features, qa + r * in_features, da + r * blocks,
                     sa + r * blocks, qsum + r * blocks);
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t t = 0; t < tiles; t++) {
        const uint8_t *records = packed + t * blocks * RECORD8;
        const int64_t count = out_features - t * TILE < TILE ? out_features - t * TILE : TILE;
        float acc[ROW_TILE][TILE];
        for (int64_t row = 0; row < rows; row += ROW_TILE) {
            const int nr = rows - row < ROW_TILE ? (int)(rows - row) : ROW_TILE;
            switch (nr) {
            case 4: tile_rows8(records, blocks, qa, da, qsum, in_features, row, 4, acc); break;
            case 3: tile_rows8(records, blocks, qa, da, qsum, in_features, row, 3, acc); break;
            case 2: tile_rows8(records, blocks, qa, da, qsum, in_features, row, 2, acc); break;
            default: tile_rows8(records, blocks, qa, da, qsum, in_features, row, 1, acc); break;
            }
            for (int r = 0; r < nr; r++) {
                for (int64_t j = 0; j < count; j++) acc[r][j] *= scales[t * TILE + j];
                store_row(out, out_bf16, (row + r) * out_features + t * TILE, count, acc[r]);
            }
        }
    }
    free(qa);
    free(row_scales);
    free(qsum);
    return 0;
}
