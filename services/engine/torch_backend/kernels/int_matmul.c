/* Integer-dot matrix multiplies for quantized projections: int4 (Q4_1) or int8
 * weights times activations quantized to int16 per row and 32 inputs.
 *
 * Activations: each row, per block of 32 inputs, becomes a = da * qa with
 * da = max|x| / 32767 and qa = x / da rounded to nearest even (int16), and
 * sa = da * sum(qa). That is ~2^-15 of the block's largest value, finer than
 * the bf16 the projections are fed (the int8 of ggml's Q8_1, which llama.cpp
 * uses here, moved SmolLM2's logits ~2.5x further from fp32 than bf16
 * activations do and changed greedy answers).
 *
 * llmesh_q4_1_matmul, for the int4 projections of generated tokens:
 * y[rows, out] = x[rows, in] @ W[out, in].T with W in ggml's Q4_1 format (per
 * 32 inputs of an output row: w = d * q + m, q in 0..15, fp16 d and m). The
 * dot product of one block is
 *
 *     sum_i (d q_i + m) (da qa_i) = d da * sum_i q_i qa_i + m sa
 *
 * where sum_i q_i qa_i is an exact integer (|.| < 2^24, so exact in fp32 too):
 * AVX512-VNNI's vpdpwssd sums two int16 x int16 products per 32-bit lane; on
 * CPUs with AVX2 but not VNNI (AMD Zen 1-3, Intel before Ice Lake) vpmaddwd
 * does the same per 8-lane half of the tile, then vpaddd (the products of
 * int16 in +-32767 never meet vpmaddwd's one saturating case). The integer
 * sums are exact and the fp32 steps per feature are the same FMAs in the
 * same order on all three paths (VNNI, AVX2, portable), so every path gives
 * the same bits.
 *
 * Packed weights (quant.py's pack_q4_1): output features in tiles of 16
 * (zero-padded), and for each tile and block of 32 inputs one 320-byte record:
 *
 *     uint16 d[16]; uint16 m[16];  fp16 scale and minimum of the 16 features
 *     uint8  q[4][64];             chunk c: bytes 0-31 hold pair group 4c in
 *                                  their low nibbles and 4c + 2 in their high
 *                                  nibbles, bytes 32-63 groups 4c + 1 and 4c + 3
 *
 * where pair group g is 32 values, byte 2j + t = q[j][2g + t] (feature j,
 * inputs 2g and 2g + 1). Zero-extended to 16 bits (vpmovzxbw), a group is one
 * vector whose 32-bit lane j holds feature j's pair: one vpdpwssd against the
 * activation pair (qa[2g], qa[2g + 1]) broadcast to every lane.
 *
 * llmesh_q8_matmul, for int8 weights with one fp32 scale per output feature
 * (the LM head; the projections of --quantization int8): w = s * qw, a
 * 512-byte record per tile and block of the 16 pair groups as int8 (byte
 * 32 g + 2 j + t = qw[j][2g + t]), sign-extended to 16 bits (vpmovsxbw);
 * y = s * sum_b da_b * isum_b.
 *
 * Rows in chunks: a feature tile takes up to ROW_CHUNK rows at a time, and
 * each block's weights are loaded and widened once for all of them (a row's
 * accumulator waits on the stack between blocks). A prompt's rows then cost
 * their integer dot products, not a weight unpacking per 4 rows as with the
 * 4-row tiles before (~10 % of a 128-row call went to re-widening the same
 * weights). A call of 1 to 4 rows (decode) keeps its accumulators in
 * registers.
 *
 * Batch invariance by construction: a row's activation is quantized from that
 * row alone, its integer sums are exact, and its fp32 result is accumulated
 * block by block in input order with the same instructions for every row,
 * whatever the number of rows, the chunk it falls in or the thread that
 * computes the feature tile (an accumulator stored and reloaded between
 * blocks keeps its bits). The cost is nearly flat in rows up to ~4: the
 * weights are read once per call and the integer work per row is small next
 * to the memory traffic.
 */

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "llmesh_kernels.h"
#include "simd.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define LLMESH_INT_VNNI 1
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define LLMESH_INT_AVX2 1
#include <immintrin.h>
#endif

#define Q_BLOCK 32
#define TILE 16
#define GROUPS (Q_BLOCK / 2)                       /* pair groups per block */
#define RECORD (2 * TILE * 2 + TILE * Q_BLOCK / 2) /* 320 bytes */
#define RECORD8 (TILE * Q_BLOCK)                   /* 512 bytes */
/* Rows that share one widening of a block's weights (acc_out's rows). */
#define ROW_CHUNK 32
#define QMAX 32767.0f
/* Smallest block maximum quantized (1 / (amax / 32767) stays finite above it). */
#define MIN_AMAX 1e-30f

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

/* nearbyintf of each lane (nearest, ties to even, in the default rounding mode). */
static inline v16f round_even16(v16f p) {
#if defined(__AVX512F__)
    return (v16f)_mm512_roundscale_ps((__m512)p, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#elif defined(__AVX2__) && defined(__FMA__)
    v16f r;
    const __m256 *pp = (const __m256 *)&p;
    __m256 *pr = (__m256 *)&r;
    for (int h = 0; h < 2; h++)
        pr[h] = _mm256_round_ps(pp[h], _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    return r;
#else
    float a[LANES];
    memcpy(a, &p, sizeof a);
    for (int i = 0; i < LANES; i++) a[i] = nearbyintf(a[i]);
    memcpy(&p, a, sizeof a);
    return p;
#endif
}

/* One row's quantization: qa [in] int16, da and sa [in / 32]. A block below
 * MIN_AMAX counts as zeros; a NaN or inf makes the block's da NaN, so every
 * output of the row is NaN. In 16-lane vectors (simd.h), rounding as
 * nearbyintf and an exact integer sum: the bits of the scalar loop this
 * replaced (which took ~10 % of a prefill's time on one thread). */
static void quantize_row(const void *x, int32_t x_bf16, int64_t row, int64_t in, int16_t *qa,
                         float *da, float *sa) {
    for (int64_t b = 0; b < in / Q_BLOCK; b++) {
        const int64_t at = row * in + b * Q_BLOCK;
        const v16f v[2] = {load16_any(x, x_bf16, at, LANES),
                           load16_any(x, x_bf16, at + LANES, LANES)};
        const v16f a[2] = {(v16f)((v16i)v[0] & 0x7fffffff), (v16f)((v16i)v[1] & 0x7fffffff)};
        const v16i finite = (a[0] <= splat(FLT_MAX)) & (a[1] <= splat(FLT_MAX)); /* no NaN, inf */
        int all_finite = 1;
        for (int i = 0; i < LANES; i++) all_finite &= finite[i] != 0;
        const float amax = all_finite ? hmax16(max16(a[0], a[1])) : 0.0f;
        const float d = !all_finite ? NAN : amax < MIN_AMAX ? 0.0f : amax / QMAX;
        const float id = all_finite && d != 0.0f ? 1.0f / d : 0.0f; /* inf * 0 would be NaN */
        v16i sum = {0};
        for (int h = 0; h < 2; h++) {
            v16f q = all_finite ? round_even16(v[h] * splat(id)) : splat(0.0f);
            q = select16(q > splat(QMAX), splat(QMAX), q);
            q = select16(q < splat(-QMAX), splat(-QMAX), q);
            const v16i qi = __builtin_convertvector(q, v16i);
            for (int i = 0; i < LANES; i++) qa[b * Q_BLOCK + h * LANES + i] = (int16_t)qi[i];
            sum += qi;
        }
        int32_t total = 0;
        for (int i = 0; i < LANES; i++) total += sum[i];
        da[b] = d;
        sa[b] = d * (float)total;
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

#ifdef LLMESH_INT_VNNI

/* sum over the 16 pair groups of w[g] (16-bit pairs per lane) x the row's
 * activation pair g, as 4 exact partial sums added at the end. */
static inline __attribute__((always_inline)) __m512i dot_groups(const __m512i *w,
                                                                const int16_t *qa) {
    const int32_t *pairs = (const int32_t *)qa;
    __m512i s[4];
    for (int i = 0; i < 4; i++)
        s[i] = _mm512_dpwssd_epi32(_mm512_setzero_si512(), w[i], _mm512_set1_epi32(pairs[i]));
    for (int g = 4; g < GROUPS; g++)
        s[g % 4] = _mm512_dpwssd_epi32(s[g % 4], w[g], _mm512_set1_epi32(pairs[g]));
    return _mm512_add_epi32(_mm512_add_epi32(s[0], s[1]), _mm512_add_epi32(s[2], s[3]));
}

/* The feature tile for `nr` (1..ROW_CHUNK) rows starting at `row`, each row's
 * accumulator in acc_out between blocks: the same per-row instruction
 * sequence for any nr. */
static inline __attribute__((always_inline)) void tile_rows(
    const uint8_t *records, int64_t blocks, const int16_t *qa, const float *da, const float *sa,
    int64_t in, int64_t row, const int nr, float acc_out[][TILE]) {
    const __m512i low = _mm512_set1_epi8(0x0f);
    __m512 acc[ROW_CHUNK];
    for (int r = 0; r < nr; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *record = records + b * RECORD;
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)record));
        const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(record + 32)));
        __m512i w[GROUPS];
        for (int c = 0; c < 4; c++) {
            const __m512i p = _mm512_loadu_si512((const void *)(record + 64 + 64 * c));
            const __m512i lo = _mm512_and_si512(p, low);
            const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(p, 4), low);
            w[4 * c] = _mm512_cvtepu8_epi16(_mm512_castsi512_si256(lo));
            w[4 * c + 1] = _mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(lo, 1));
            w[4 * c + 2] = _mm512_cvtepu8_epi16(_mm512_castsi512_si256(hi));
            w[4 * c + 3] = _mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(hi, 1));
        }
        for (int r = 0; r < nr; r++) {
            const __m512i sum = dot_groups(w, qa + (row + r) * in + b * Q_BLOCK);
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
    const uint8_t *records, int64_t blocks, const int16_t *qa, const float *da, int64_t in,
    int64_t row, const int nr, float acc_out[][TILE]) {
    __m512 acc[ROW_CHUNK];
    for (int r = 0; r < nr; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *record = records + b * RECORD8;
        __m512i w[GROUPS];
        for (int g = 0; g < GROUPS; g++)
            w[g] = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(record + 32 * g)));
        for (int r = 0; r < nr; r++) {
            const __m512i sum = dot_groups(w, qa + (row + r) * in + b * Q_BLOCK);
            const int64_t scale_at = (row + r) * (in / Q_BLOCK) + b;
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_set1_ps(da[scale_at]), acc[r]);
        }
    }
    for (int r = 0; r < nr; r++) _mm512_storeu_ps(acc_out[r], acc[r]);
}

#elif defined(LLMESH_INT_AVX2)

/* As the VNNI dot_groups for one 8-feature half of the tile: w[g] holds the
 * half's 16-bit pairs of group g; 4 exact partial sums added at the end. */
static inline __attribute__((always_inline)) __m256i dot_groups8(const __m256i *w,
                                                                 const int16_t *qa) {
    const int32_t *pairs = (const int32_t *)qa;
    __m256i s[4];
    for (int i = 0; i < 4; i++) s[i] = _mm256_madd_epi16(w[i], _mm256_set1_epi32(pairs[i]));
    for (int g = 4; g < GROUPS; g++)
        s[g % 4] = _mm256_add_epi32(s[g % 4],
                                    _mm256_madd_epi16(w[g], _mm256_set1_epi32(pairs[g])));
    return _mm256_add_epi32(_mm256_add_epi32(s[0], s[1]), _mm256_add_epi32(s[2], s[3]));
}

/* 32 bytes of one pair group (2 bytes per feature) -> its two 8-feature halves. */
static inline __attribute__((always_inline)) void widen_u8(__m256i bytes, __m256i *lo,
                                                           __m256i *hi) {
    *lo = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(bytes));
    *hi = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(bytes, 1));
}

static inline __attribute__((always_inline)) void tile_rows(
    const uint8_t *records, int64_t blocks, const int16_t *qa, const float *da, const float *sa,
    int64_t in, int64_t row, const int nr, float acc_out[][TILE]) {
    const __m256i low = _mm256_set1_epi8(0x0f);
    __m256 acc[ROW_CHUNK][2];
    for (int r = 0; r < nr; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *record = records + b * RECORD;
        __m256 d[2], m[2];
        for (int h = 0; h < 2; h++) {
            d[h] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(record + 16 * h)));
            m[h] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(record + 32 + 16 * h)));
        }
        __m256i w[2][GROUPS];
        for (int c = 0; c < 4; c++)
            for (int k = 0; k < 2; k++) { /* bytes 32k..32k+31: groups 4c+k, 4c+k+2 */
                const uint8_t *bytes = record + 64 + 64 * c + 32 * k;
                const __m256i p = _mm256_loadu_si256((const __m256i *)bytes);
                widen_u8(_mm256_and_si256(p, low), &w[0][4 * c + k], &w[1][4 * c + k]);
                widen_u8(_mm256_and_si256(_mm256_srli_epi16(p, 4), low), &w[0][4 * c + k + 2],
                         &w[1][4 * c + k + 2]);
            }
        for (int r = 0; r < nr; r++) {
            const int64_t scale_at = (row + r) * (in / Q_BLOCK) + b;
            for (int h = 0; h < 2; h++) {
                const __m256i sum = dot_groups8(w[h], qa + (row + r) * in + b * Q_BLOCK);
                const __m256 scale = _mm256_mul_ps(d[h], _mm256_set1_ps(da[scale_at]));
                acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), scale, acc[r][h]);
                acc[r][h] = _mm256_fmadd_ps(m[h], _mm256_set1_ps(sa[scale_at]), acc[r][h]);
            }
        }
    }
    for (int r = 0; r < nr; r++)
        for (int h = 0; h < 2; h++) _mm256_storeu_ps(acc_out[r] + 8 * h, acc[r][h]);
}

static inline __attribute__((always_inline)) void tile_rows8(
    const uint8_t *records, int64_t blocks, const int16_t *qa, const float *da, int64_t in,
    int64_t row, const int nr, float acc_out[][TILE]) {
    __m256 acc[ROW_CHUNK][2];
    for (int r = 0; r < nr; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *record = records + b * RECORD8;
        __m256i w[2][GROUPS];
        for (int g = 0; g < GROUPS; g++)
            for (int h = 0; h < 2; h++)
                w[h][g] = _mm256_cvtepi8_epi16(
                    _mm_loadu_si128((const __m128i *)(record + 32 * g + 16 * h)));
        for (int r = 0; r < nr; r++) {
            const int64_t scale_at = (row + r) * (in / Q_BLOCK) + b;
            for (int h = 0; h < 2; h++) {
                const __m256i sum = dot_groups8(w[h], qa + (row + r) * in + b * Q_BLOCK);
                acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum),
                                            _mm256_set1_ps(da[scale_at]), acc[r][h]);
            }
        }
    }
    for (int r = 0; r < nr; r++)
        for (int h = 0; h < 2; h++) _mm256_storeu_ps(acc_out[r] + 8 * h, acc[r][h]);
}

#else

/* Portable path: the same arithmetic, one feature at a time. Value of pair
 * group g, feature j, member t in a Q4_1 record. */
static inline int32_t q4_value(const uint8_t *record, int g, int j, int t) {
    const int c = g / 4, k = g % 4;
    const uint8_t byte = record[64 + 64 * c + 32 * (k % 2) + 2 * j + t];
    return k < 2 ? byte & 0x0f : byte >> 4;
}

static inline void tile_rows(const uint8_t *records, int64_t blocks, const int16_t *qa,
                             const float *da, const float *sa, int64_t in, int64_t row,
                             const int nr, float acc_out[][TILE]) {
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
                const int16_t *a = qa + (row + r) * in + b * Q_BLOCK;
                int32_t sum = 0;
                for (int g = 0; g < GROUPS; g++)
                    for (int t = 0; t < 2; t++) sum += q4_value(record, g, j, t) * a[2 * g + t];
                const int64_t scale_at = (row + r) * (in / Q_BLOCK) + b;
                const float scale = d * da[scale_at];
                acc_out[r][j] = fmaf((float)sum, scale, acc_out[r][j]);
                acc_out[r][j] = fmaf(m, sa[scale_at], acc_out[r][j]);
            }
        }
    }
}

static inline void tile_rows8(const uint8_t *records, int64_t blocks, const int16_t *qa,
                              const float *da, int64_t in, int64_t row, const int nr,
                              float acc_out[][TILE]) {
    for (int r = 0; r < nr; r++)
        for (int j = 0; j < TILE; j++) acc_out[r][j] = 0.0f;
    for (int64_t b = 0; b < blocks; b++) {
        const int8_t *record = (const int8_t *)(records + b * RECORD8);
        for (int j = 0; j < TILE; j++)
            for (int r = 0; r < nr; r++) {
                const int16_t *a = qa + (row + r) * in + b * Q_BLOCK;
                int32_t sum = 0;
                for (int g = 0; g < GROUPS; g++)
                    for (int t = 0; t < 2; t++)
                        sum += (int32_t)record[32 * g + 2 * j + t] * a[2 * g + t];
                const int64_t scale_at = (row + r) * (in / Q_BLOCK) + b;
                acc_out[r][j] = fmaf((float)sum, da[scale_at], acc_out[r][j]);
            }
    }
}

#endif

/* Quantizes x (rows > 16: in parallel); 0, or -3 out of memory (then nothing
 * is left allocated). */
static int quantize(const void *x, int32_t x_bf16, int64_t rows, int64_t in, int threads,
                    int16_t **qa, float **da, float **sa) {
    const int64_t blocks = in / Q_BLOCK;
    *qa = malloc(sizeof(int16_t) * (size_t)(rows * in));
    *da = malloc(sizeof(float) * (size_t)(2 * rows * blocks));
    if (*qa == NULL || *da == NULL) {
        free(*qa);
        free(*da);
        return -3;
    }
    *sa = *da + rows * blocks;
#pragma omp parallel for schedule(static) num_threads(threads) if (rows > 16)
    for (int64_t r = 0; r < rows; r++)
        quantize_row(x, x_bf16, r, in, *qa + r * in, *da + r * blocks, *sa + r * blocks);
    return 0;
}

/* Both kernels: Q4_1 records, or (int8) int8 records with `scales` per output
 * feature. */
static int int_matmul(const void *x, int32_t x_bf16, int64_t rows, int64_t in_features,
                      const uint8_t *packed, int int8, const float *scales, int64_t out_features,
                      void *out, int32_t out_bf16, int32_t num_threads) {
    if (in_features < Q_BLOCK || in_features % Q_BLOCK || out_features < 1 || rows < 0) return -1;
    if (rows == 0) return 0;
    if (int8 && scales == NULL) return -1;
    const int64_t blocks = in_features / Q_BLOCK, tiles = (out_features + TILE - 1) / TILE;
    const int64_t record = int8 ? RECORD8 : RECORD;
    const int threads = num_threads < 1 ? 1 : num_threads;
    int16_t *qa;
    float *da, *sa;
    if (quantize(x, x_bf16, rows, in_features, threads, &qa, &da, &sa) != 0) return -3;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t t = 0; t < tiles; t++) {
        const uint8_t *records = packed + t * blocks * record;
        const int64_t count = out_features - t * TILE < TILE ? out_features - t * TILE : TILE;
        float acc[ROW_CHUNK][TILE];
        for (int64_t row = 0; row < rows; row += ROW_CHUNK) {
            const int nr = rows - row < ROW_CHUNK ? (int)(rows - row) : ROW_CHUNK;
            if (!int8) {
                switch (nr) { /* a constant count keeps the accumulators in registers */
                case 1: tile_rows(records, blocks, qa, da, sa, in_features, row, 1, acc); break;
                case 2: tile_rows(records, blocks, qa, da, sa, in_features, row, 2, acc); break;
                case 3: tile_rows(records, blocks, qa, da, sa, in_features, row, 3, acc); break;
                case 4: tile_rows(records, blocks, qa, da, sa, in_features, row, 4, acc); break;
                default: tile_rows(records, blocks, qa, da, sa, in_features, row, nr, acc); break;
                }
            } else {
                switch (nr) {
                case 1: tile_rows8(records, blocks, qa, da, in_features, row, 1, acc); break;
                case 2: tile_rows8(records, blocks, qa, da, in_features, row, 2, acc); break;
                case 3: tile_rows8(records, blocks, qa, da, in_features, row, 3, acc); break;
                case 4: tile_rows8(records, blocks, qa, da, in_features, row, 4, acc); break;
                default: tile_rows8(records, blocks, qa, da, in_features, row, nr, acc); break;
                }
                for (int r = 0; r < nr; r++)
                    for (int64_t j = 0; j < count; j++) acc[r][j] *= scales[t * TILE + j];
            }
            for (int r = 0; r < nr; r++)
                store_row(out, out_bf16, (row + r) * out_features + t * TILE, count, acc[r]);
        }
    }
    free(qa);
    free(da);
    return 0;
}

int llmesh_q4_1_matmul(const void *x, int32_t x_bf16, int64_t rows, int64_t in_features,
                       const uint8_t *packed, int64_t out_features, void *out, int32_t out_bf16,
                       int32_t num_threads) {
    return int_matmul(x, x_bf16, rows, in_features, packed, 0, NULL, out_features, out, out_bf16,
                      num_threads);
}

int llmesh_q8_matmul(const void *x, int32_t x_bf16, int64_t rows, int64_t in_features,
                     const uint8_t *packed, const float *scales, int64_t out_features, void *out,
                     int32_t out_bf16, int32_t num_threads) {
    return int_matmul(x, x_bf16, rows, in_features, packed, 1, scales, out_features, out, out_bf16,
                      num_threads);
}

int32_t llmesh_int_matmul_row_chunk(void) { return ROW_CHUNK; }
