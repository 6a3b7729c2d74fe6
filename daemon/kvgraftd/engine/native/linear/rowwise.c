/*
 * The row-wise operations of kvgraftd's row-invariant forward (loaded with ctypes by
 * kvgraftd.engine.model.rowwise): RMS norm with the residual add before it, rotary positions,
 * and the SiLU-gated product of the MLP.
 *
 * The contract: each output row comes from its own input row by one fixed sequence of
 * float operations, each rounded once (compiled with -ffp-contract=off: nothing fused),
 * so a row's bits depend on that row alone: not on the number of rows, nor on the
 * vector width a build's loops run at (every lane does the scalar sequence).
 *
 * kvg_add_rmsnorm(hidden, delta, weight, rows, dim, eps, out): hidden += delta (where
 *   delta is not NULL), then out = weight * (hidden * r), r = 1 / sqrtf(ss / dim + eps),
 *   ss the sum of squares in 16 interleaved partial sums (element i into sum i % 16,
 *   ascending i), folded pairwise (sum j + sum j + w, for w = 8, 4, 2, 1).
 * kvg_rope_table(positions, rows, inv_freq, half, scaling, cos, sin): [rows][half] of
 *   cosf(angle) * scaling and sinf(angle) * scaling, angle = inv_freq[i] * (float)position.
 * kvg_rope(x, rows, row_stride, heads, dim, cos, sin): each of the first `heads` heads
 *   (dim floats each) of each row, rotated in place: for i < dim/2, with a = x[i],
 *   b = x[i + dim/2]: x[i] = a c - b s, x[i + dim/2] = b c + a s.
 * kvg_silu_mul(gate_up, rows, width, out): out[r][i] = silu(g) * u with g = gate_up[r][i],
 *   u = gate_up[r][width + i]; silu(g) = g * sigmoid(g), sigmoid from e = exp(-|g|)
 *   (1 / (1 + e), or e / (1 + e) for g < 0) with exp_nonpositive below.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define PARTIALS 16

/* The loops below are cloned per instruction set and chosen when the library loads; the
 * arithmetic (and so the bits) is the same in each. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define VECTOR_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define VECTOR_CLONES
#endif

VECTOR_CLONES
void kvg_add_rmsnorm(float *hidden, const float *delta, const float *weight, int64_t rows,
                     int64_t dim, float eps, float *out) {
    for (int64_t r = 0; r < rows; r++) {
        float *x = hidden + r * dim;
        if (delta)
            for (int64_t i = 0; i < dim; i++) x[i] = x[i] + delta[r * dim + i];
        float partial[PARTIALS] = {0};
        int64_t i = 0;
        for (; i + PARTIALS <= dim; i += PARTIALS)
            for (int j = 0; j < PARTIALS; j++) partial[j] = partial[j] + x[i + j] * x[i + j];
        for (int j = 0; i < dim; i++, j++) partial[j] = partial[j] + x[i] * x[i];
        for (int width = PARTIALS / 2; width >= 1; width /= 2)
            for (int j = 0; j < width; j++) partial[j] = partial[j] + partial[j + width];
        const float scale = 1.0f / sqrtf(partial[0] / (float)dim + eps);
        for (i = 0; i < dim; i++) out[r * dim + i] = weight[i] * (x[i] * scale);
    }
}

void kvg_rope_table(const int64_t *positions, int64_t rows, const float *inv_freq, int64_t half,
                    float scaling, float *cos_out, float *sin_out) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t i = 0; i < half; i++) {
            const float angle = inv_freq[i] * (float)positions[r];
            cos_out[r * half + i] = cosf(angle) * scaling;
            sin_out[r * half + i] = sinf(angle) * scaling;
        }
}

VECTOR_CLONES
void kvg_rope(float *x, int64_t rows, int64_t row_stride, int64_t heads, int64_t dim,
              const float *cos_table, const float *sin_table) {
    const int64_t half = dim / 2;
    for (int64_t r = 0; r < rows; r++) {
        const float *c = cos_table + r * half, *s = sin_table + r * half;
        for (int64_t h = 0; h < heads; h++) {
            float *head = x + r * row_stride + h * dim;
            for (int64_t i = 0; i < half; i++) {
                const float a = head[i], b = head[i + half];
                head[i] = a * c[i] - b * s[i];
                head[i + half] = b * c[i] + a * s[i];
            }
        }
    }
}

/* exp(x) for x <= 0, about 1 ulp (the attention kernel's: x = n ln2 + r, the Cephes
 * polynomial for exp(r), 2^n built in the exponent bits); below -87, exp(-87). */
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    const float shifter = 12582912.0f; /* 1.5 * 2^23: rounds to nearest */
    const float n = (x * 1.44269504088896341f + shifter) - shifter;
    float r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + r + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23;
    float power;
    memcpy(&power, &bits, sizeof power);
    return p * power;
}

VECTOR_CLONES
void kvg_silu_mul(const float *gate_up, int64_t rows, int64_t width, float *out) {
    for (int64_t r = 0; r < rows; r++) {
        const float *gate = gate_up + r * 2 * width, *up = gate + width;
        for (int64_t i = 0; i < width; i++) {
            const float g = gate[i];
            const float e = exp_nonpositive(g < 0.0f ? g : -g);
            const float sigmoid = (g < 0.0f ? e : 1.0f) / (1.0f + e);
            out[r * width + i] = g * sigmoid * up[i];
        }
    }
}
