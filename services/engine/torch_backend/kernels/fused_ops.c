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

int llmesh_add_rms_norm(float *hidden, const void *delta, int32_t delta_bf16, const float *weight,
                        int64_t rows, int64_t n, float eps, void *out, int32_t out_bf16,
                        int32_t num_threads) {
    if (n < 1) return -1;
#pragma omp parallel for schedule(static) num_threads(num_threads < 1 ? 1 : num_threads) if (rows > 4)
    for (int64_t r = 0; r < rows; r++) {
        float *h = hidden + r * n;
        v16f squares = splat(0.0f);
        for (int64_t i0 = 0; i0 < n; i0 += LANES) {
            const int64_t count = n - i0 < LANES ? n - i0 : LANES;
            v16f x = load16_any(h, 0, i0, count);
            if (delta != NULL) {
                x += load16_any(delta, delta_bf16, r * n + i0, count);
                store16_any(h, 0, i0, count, x);
            }
            squares += x * x; /* lane i sums the squares of elements i mod 16, in order */
        }
        const float inverse = 1.0f / sqrtf(hsum16(squares) / (float)n + eps);
        for (int64_t i0 = 0; i0 < n; i0 += LANES) {
            const int64_t count = n - i0 < LANES ? n - i0 : LANES;
            const v16f y = load16_any(h, 0, i0, count) * splat(inverse) *
                           load16_any(weight, 0, i0, count);
            store16_any(out, out_bf16, r * n + i0, count, y);
        }
    }
    return 0;
}

int llmesh_silu_mul(const void *gate_up, int32_t in_bf16, int64_t rows, int64_t n, void *out,
                    int32_t out_bf16, int32_t num_threads) {
    if (n < 1) return -1;
#pragma omp parallel for schedule(static) num_threads(num_threads < 1 ? 1 : num_threads) if (rows > 4)
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t i0 = 0; i0 < n; i0 += LANES) {
            const int64_t count = n - i0 < LANES ? n - i0 : LANES;
            const v16f g = load16_any(gate_up, in_bf16, r * 2 * n + i0, count);
            const v16f u = load16_any(gate_up, in_bf16, r * 2 * n + n + i0, count);
            /* SiLU(g) = g * sigmoid(g); e = exp(-|g|) keeps exp's argument <= 0. */
            const v16i negative = g < splat(0.0f);
            const v16f e = exp16(select16(negative, g, -g));
            const v16f sigmoid = select16(negative, e, splat(1.0f)) / (splat(1.0f) + e);
            store16_any(out, out_bf16, r * n + i0, count, g * sigmoid * u);
        }
    }
    return 0;
}
