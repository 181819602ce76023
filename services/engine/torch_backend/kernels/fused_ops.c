/* Fused row-wise ops of a decoder layer, for the native path (one call instead
 * of three to five PyTorch ops each, which at one token a step cost more in
 * dispatch than in arithmetic).
 *
 *   llmesh_add_rms_norm: hidden += delta (the residual add); out = RMSNorm(hidden)
 *     * weight (Zhang & Sennrich, 2019), cast to the projection's input dtype.
 *   llmesh_silu_mul: out = SiLU(gate) * up (SwiGLU, Shazeer 2020) from the fused
 *     gate/up projection output [rows, 2 n], cast likewise.
 *
 * fp32 arithmetic; bf16 inputs are widened exactly, bf16 outputs rounded to
 * nearest even (as PyTorch). Every row is computed by one thread in a fixed
 * order (the sum of squares in 16 lanes, then a fixed tree), so rows are
 * batch-invariant. exp() as in paged_attention.c (Cephes expf).
 */

#include <math.h>
#include <stdint.h>
#include <string.h>

typedef float v16f __attribute__((vector_size(64), aligned(4), may_alias));
typedef int32_t v16i __attribute__((vector_size(64), aligned(4), may_alias));

#define LANES 16

static inline v16f splat(float x) { return (v16f){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }

static inline v16f select16(v16i mask, v16f a, v16f b) {
    return (v16f)(((v16i)a & mask) | ((v16i)b & ~mask));
}

static inline float widen(const void *data, int32_t is_bf16, int64_t index) {
    if (!is_bf16) return ((const float *)data)[index];
    const uint32_t bits = (uint32_t)((const uint16_t *)data)[index] << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline void narrow(void *data, int32_t to_bf16, int64_t index, float f) {
    if (!to_bf16) {
        ((float *)data)[index] = f;
        return;
    }
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) {
        ((uint16_t *)data)[index] = (uint16_t)((bits >> 16) | 0x40);
        return;
    }
    bits += 0x7fffu + ((bits >> 16) & 1u);
    ((uint16_t *)data)[index] = (uint16_t)(bits >> 16);
}

/* exp(x) for x <= 0 (Cephes expf), 0 below -87.3. */
static inline v16f exp16(v16f x) {
    const v16f lo = splat(-87.33654475f);
    const v16i underflow = x < lo;
    x = select16(underflow, lo, x);
    v16f fx = x * splat(1.44269504088896341f);
    const v16f magic = splat(12582912.0f);
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
    y = y * (v16f)((n + 127) << 23);
    return select16(underflow, splat(0.0f), y);
}

int llmesh_add_rms_norm(float *hidden, const void *delta, int32_t delta_bf16, const float *weight,
                        int64_t rows, int64_t n, float eps, void *out, int32_t out_bf16,
                        int32_t num_threads) {
    if (n < 1) return -1;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows > 4)
    for (int64_t r = 0; r < rows; r++) {
        float *h = hidden + r * n;
        if (delta != NULL)
            for (int64_t i = 0; i < n; i++) h[i] += widen(delta, delta_bf16, r * n + i);
        float lanes[LANES] = {0};
        for (int64_t i = 0; i < n; i++) lanes[i % LANES] += h[i] * h[i];
        for (int width = LANES / 2; width >= 1; width /= 2)
            for (int i = 0; i < width; i++) lanes[i] += lanes[i + width];
        const float inverse = 1.0f / sqrtf(lanes[0] / (float)n + eps);
        for (int64_t i = 0; i < n; i++) narrow(out, out_bf16, r * n + i, h[i] * inverse * weight[i]);
    }
    return 0;
}

int llmesh_silu_mul(const void *gate_up, int32_t in_bf16, int64_t rows, int64_t n, void *out,
                    int32_t out_bf16, int32_t num_threads) {
    if (n < 1) return -1;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows > 4)
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t i0 = 0; i0 < n; i0 += LANES) {
            float gate[LANES] = {0}, up[LANES] = {0}, result[LANES];
            const int64_t count = n - i0 < LANES ? n - i0 : LANES;
            for (int64_t i = 0; i < count; i++) {
                gate[i] = widen(gate_up, in_bf16, r * 2 * n + i0 + i);
                up[i] = widen(gate_up, in_bf16, r * 2 * n + n + i0 + i);
            }
            v16f g, u;
            memcpy(&g, gate, sizeof g);
            memcpy(&u, up, sizeof u);
            /* SiLU(g) = g * sigmoid(g); e = exp(-|g|) keeps exp's argument <= 0. */
            const v16i negative = g < splat(0.0f);
            const v16f e = exp16(select16(negative, g, -g));
            const v16f sigmoid = select16(negative, e, splat(1.0f)) / (splat(1.0f) + e);
            const v16f v = g * sigmoid * u;
            memcpy(result, &v, sizeof result);
            for (int64_t i = 0; i < count; i++) narrow(out, out_bf16, r * n + i0 + i, result[i]);
        }
    }
    return 0;
}
