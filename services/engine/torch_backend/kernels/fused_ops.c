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
 * batch-invariant. Vector helpers and exp() from simd.h.
 */

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "llmesh_kernels.h"
#include "simd.h"

static inline float widen(const void *data, int32_t is_bf16, int64_t index) {
    return is_bf16 ? bf16_to_float(((const uint16_t *)data)[index]) : ((const float *)data)[index];
}

static inline void narrow(void *data, int32_t to_bf16, int64_t index, float f) {
    if (to_bf16)
        ((uint16_t *)data)[index] = float_to_bf16(f);
    else
        ((float *)data)[index] = f;
}

int llmesh_add_rms_norm(float *hidden, const void *delta, int32_t delta_bf16, const float *weight,
                        int64_t rows, int64_t n, float eps, void *out, int32_t out_bf16,
                        int32_t num_threads) {
    if (n < 1) return -1;
#pragma omp parallel for schedule(static) num_threads(num_threads < 1 ? 1 : num_threads) if (rows > 4)
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
#pragma omp parallel for schedule(static) num_threads(num_threads < 1 ? 1 : num_threads) if (rows > 4)
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
