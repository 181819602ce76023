/* Shared helpers of the native kernels: 16-float vectors (GCC vector
 * extensions; AVX-512 registers where the build machine has them), a lane
 * select, fixed-order horizontal reductions, exp() for arguments <= 0 (Cephes
 * expf, S. L. Moshier, Cephes Math Library), and bf16 <-> fp32 as PyTorch
 * converts them (bf16 -> fp32 exact; fp32 -> bf16 rounded to nearest even).
 */

#ifndef LLMESH_KERNELS_SIMD_H
#define LLMESH_KERNELS_SIMD_H

#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__FMA__)
#include <immintrin.h>
#endif

typedef float v16f __attribute__((vector_size(64), aligned(4), may_alias));
typedef int32_t v16i __attribute__((vector_size(64), aligned(4), may_alias));

#define LANES 16

/* a * b + c rounded once, as one instruction where the CPU has one: an explicit
 * FMA, so that the compiler's contraction choices (which differ between code
 * paths) cannot change a result's bits. */
static inline v16f fma16(v16f a, v16f b, v16f c) {
#if defined(__AVX512F__)
    return (v16f)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__FMA__)
    v16f r;
    const __m256 *pa = (const __m256 *)&a, *pb = (const __m256 *)&b, *pc = (const __m256 *)&c;
    __m256 *pr = (__m256 *)&r;
    pr[0] = _mm256_fmadd_ps(pa[0], pb[0], pc[0]);
    pr[1] = _mm256_fmadd_ps(pa[1], pb[1], pc[1]);
    return r;
#else
    float x[16], y[16], z[16];
    memcpy(x, &a, sizeof x);
    memcpy(y, &b, sizeof y);
    memcpy(z, &c, sizeof z);
    for (int i = 0; i < 16; i++) z[i] = fmaf(x[i], y[i], z[i]);
    memcpy(&c, z, sizeof z);
    return c;
#endif
}

static inline v16f splat(float x) { return (v16f){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }

static inline v16f load16(const float *p) { return *(const v16f *)p; }

static inline void store16(float *p, v16f v) { *(v16f *)p = v; }

/* Lane-wise mask ? a : b (mask lanes are all ones or all zeros). */
static inline v16f select16(v16i mask, v16f a, v16f b) {
    return (v16f)(((v16i)a & mask) | ((v16i)b & ~mask));
}

static inline v16f max16(v16f a, v16f b) { return select16(a > b, a, b); }

/* A fixed pairwise tree over the 16 lanes. */
static inline float hsum16(v16f v) {
    float a[LANES];
    memcpy(a, &v, sizeof a);
    for (int width = LANES / 2; width >= 1; width /= 2)
        for (int i = 0; i < width; i++) a[i] = a[i] + a[i + width];
    return a[0];
}

static inline float hmax16(v16f v) {
    float a[LANES];
    memcpy(a, &v, sizeof a);
    float m = a[0];
    for (int i = 1; i < LANES; i++) m = a[i] > m ? a[i] : m;
    return m;
}

/* exp(x) for x <= 0 (Cephes expf); 0 below -87.3 and for -inf. */
static inline v16f exp16(v16f x) {
    const v16f lo = splat(-87.33654475f);
    const v16i underflow = x < lo;
    x = select16(underflow, lo, x);
    v16f fx = x * splat(1.44269504088896341f);
    const v16f magic = splat(12582912.0f); /* 1.5 * 2^23: round to nearest */
    fx = (fx + magic) - magic;
    x = x - fx * splat(0.693359375f);
    x = x - fx * splat(-2.12194440e-4f);
    v16f z = x * x;
    v16f y = splat(1.9875691500E-4f);
    y = y * x + splat(1.3981999507E-3f);
    y = y * x + splat(8.3334519073E-3f);
    y = y * x + splat(4.1665795894E-2f);
    y = y * x + splat(1.6666665459E-1f);
    y = y * x + splat(5.0000001201E-1f);
    y = y * z + x + splat(1.0f);
    v16i n = __builtin_convertvector(fx, v16i);
    v16i bits = (n + 127) << 23;
    y = y * (v16f)bits;
    return select16(underflow, splat(0.0f), y);
}

static inline float bf16_to_float(uint16_t x) {
    uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* Round to nearest even, as PyTorch's float -> bfloat16 (a NaN stays a quiet
 * NaN, its payload bits may differ from PyTorch's). */
static inline uint16_t float_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40);
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

typedef uint16_t v16h __attribute__((vector_size(32), aligned(2), may_alias));
typedef uint32_t v16u __attribute__((vector_size(64), aligned(4), may_alias));

/* 16 values from `data` (bf16 when is_bf16, else fp32) at `index`, widened
 * exactly; lanes from `count` on are 0. */
static inline v16f load16_any(const void *data, int32_t is_bf16, int64_t index, int64_t count) {
    if (count == LANES) {
        if (!is_bf16) return load16((const float *)data + index);
        const v16u bits = __builtin_convertvector(*(const v16h *)((const uint16_t *)data + index),
                                                  v16u) << 16;
        return (v16f)bits;
    }
    float values[LANES] = {0};
    for (int64_t i = 0; i < count; i++)
        values[i] = is_bf16 ? bf16_to_float(((const uint16_t *)data)[index + i])
                            : ((const float *)data)[index + i];
    v16f v;
    memcpy(&v, values, sizeof v);
    return v;
}

/* Stores the first `count` lanes of `v` at `index` of `data`: bf16 (rounded as
 * float_to_bf16) when to_bf16, else fp32. */
static inline void store16_any(void *data, int32_t to_bf16, int64_t index, int64_t count, v16f v) {
    if (count == LANES && !to_bf16) {
        store16((float *)data + index, v);
        return;
    }
    if (count == LANES) {
        const v16u bits = (v16u)v;
        const v16u nan = (v16u)((bits & 0x7fffffffu) > 0x7f800000u);
        const v16u rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
        const v16u quiet = (bits >> 16) | 0x40u;
        *(v16h *)((uint16_t *)data + index) =
            __builtin_convertvector((rounded & ~nan) | (quiet & nan), v16h);
        return;
    }
    float values[LANES];
    memcpy(values, &v, sizeof values);
    for (int64_t i = 0; i < count; i++) {
        if (to_bf16)
            ((uint16_t *)data)[index + i] = float_to_bf16(values[i]);
        else
            ((float *)data)[index + i] = values[i];
    }
}

#endif
