/*
 * The row-wise operations of kvgraftd's row-invariant forward (loaded with ctypes by
 * kvgraftd.engine.model.rowwise): RMS norm with the residual add before it, rotary positions,
 * the gated products of the MLP (SiLU or GELU's tanh form), and the soft cap of logits.
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
 *   cos(angle) * scaling and sin(angle) * scaling, angle = inv_freq[i] * (float)position,
 *   cos and sin this file's own (rotary_cos_sin: no C library's), within 0.51 ulp.
 * kvg_rope(x, rows, row_stride, heads, dim, cos, sin): each of the first `heads` heads
 *   (dim floats each) of each row, rotated in place: for i < dim/2, with a = x[i],
 *   b = x[i + dim/2]: x[i] = a c - b s, x[i + dim/2] = b c + a s.
 * kvg_silu_mul(gate_up, rows, width, out): out[r][i] = silu(g) * u with g = gate_up[r][i],
 *   u = gate_up[r][width + i]; silu(g) = g * sigmoid(g), sigmoid from e = exp(-|g|)
 *   (1 / (1 + e), or e / (1 + e) for g < 0) with the exp of exp_neg8 below.
 * kvg_gelu_tanh_mul(gate_up, rows, width, out): the same with gelu(g) = (0.5 g) (1 + tanh(c (g
 *   + 0.044715 (g g) g))), c = sqrt(2 / pi) as a float, in that order (torch's tanh GELU).
 * kvg_softcap(x, n, cap): x[i] = tanh(x[i] / cap) * cap in place.
 * tanh(y) = (1 - e) / (1 + e) with e = exp(-2 |y|) (exp_neg8), y's sign.
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

/* cos and sin of a float angle, each rounded once from double (IEEE double operations in
 * a written order; nothing fused): the angle less n pi/2 (n the nearest integer to angle *
 * 2/pi, by the 1.5 * 2^52 shifter; pi/2 as a 25-bit head, so n * head is exact for |n| <
 * 2^28, and a 53-bit tail), then on [-pi/4, pi/4] sin(y) ~ y + y^3 (S1 + y^2 S2) + y^7 (S3 +
 * y^2 S4) and cos(y) ~ ((1 + y^2 C0) + y^4 C1) + y^6 (C2 + y^2 C3): the minimax polynomials
 * of FreeBSD's and musl's float kernels (errors below 2^-37.5 and 2^-34.1), the quadrant
 * n mod 4 choosing which and its sign. Angles past 2^28 pi/2 (a position past ~4e8) are
 * reduced the same way: deterministic, less accurate. */
static void rotary_cos_sin(float angle, float *cos_out, float *sin_out) {
    static const double two_over_pi = 6.36619772367581382433e-01;
    static const double pio2_head = 1.57079631090164184570e+00; /* 25 significant bits */
    static const double pio2_tail = 1.58932547735281966916e-08;
    static const double shifter = 6755399441055744.0; /* 1.5 * 2^52 */
    static const double S1 = -0.166666666416265235595, S2 = 0.0083333293858894631756,
                        S3 = -0.000198393348360966317347, S4 = 0.0000027183114939898219064;
    static const double C0 = -0.499999997251031003120, C1 = 0.0416666233237390631894,
                        C2 = -0.00138867637746099294692, C3 = 0.0000243904487962774090654;
    const double x = angle;
    const double n = (x * two_over_pi + shifter) - shifter;
    const double y = (x - n * pio2_head) - n * pio2_tail;
    const double z = y * y, w = z * z;
    const double sin_y = (y + (z * y) * (S1 + z * S2)) + ((z * y) * w) * (S3 + z * S4);
    const double cos_y = ((1.0 + z * C0) + w * C1) + (w * z) * (C2 + z * C3);
    switch ((int64_t)n & 3) {
    case 0: *cos_out = (float)cos_y, *sin_out = (float)sin_y; break;
    case 1: *cos_out = (float)-sin_y, *sin_out = (float)cos_y; break;
    case 2: *cos_out = (float)-cos_y, *sin_out = (float)-sin_y; break;
    default: *cos_out = (float)sin_y, *sin_out = (float)-cos_y; break;
    }
}

void kvg_rope_table(const int64_t *positions, int64_t rows, const float *inv_freq, int64_t half,
                    float scaling, float *cos_out, float *sin_out) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t i = 0; i < half; i++) {
            float c, s;
            rotary_cos_sin(inv_freq[i] * (float)positions[r], &c, &s);
            cos_out[r * half + i] = c * scaling;
            sin_out[r * half + i] = s * scaling;
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

/* The activations 8 lanes at once, each lane's operations those of the contract (GCC
 * vectors: the compiler left a scalar loop unvectorized). exp(x) for x <= 0, about 1 ulp (the
 * attention kernel's steps without FMA): x = n ln2 + r, the Cephes polynomial for exp(r), 2^n
 * built in the exponent bits; below -87, exp(-87). */
typedef float v8sf __attribute__((vector_size(32)));
typedef int32_t v8si __attribute__((vector_size(32)));

static inline v8sf splat8(float x) { return (v8sf){x, x, x, x, x, x, x, x}; }

static inline v8sf select8(v8si mask, v8sf yes, v8sf no) {
    return (v8sf)((mask & (v8si)yes) | (~mask & (v8si)no));
}

static inline v8sf exp_neg8(v8sf x) {
    x = select8(x < -87.0f, splat8(-87.0f), x);
    const v8sf shifter = splat8(12582912.0f);
    const v8sf n = (x * 1.44269504088896341f + shifter) - shifter;
    v8sf r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    v8sf p = splat8(1.9875691500e-4f);
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + r + 1.0f;
    return p * (v8sf)((__builtin_convertvector(n, v8si) + 127) << 23);
}

static inline v8sf silu_mul8(v8sf g, v8sf u) {
    const v8si negative = g < 0.0f;
    const v8sf e = exp_neg8(select8(negative, g, -g));
    const v8sf sigmoid = select8(negative, e, splat8(1.0f)) / (1.0f + e);
    return g * sigmoid * u;
}

static inline v8sf tanh8(v8sf y) {
    const v8si magnitude = (v8si)y & 0x7fffffff;
    const v8sf e = exp_neg8(-2.0f * (v8sf)magnitude);
    const v8sf t = (1.0f - e) / (1.0f + e);
    return (v8sf)((v8si)t | ((v8si)y & (int32_t)0x80000000));
}

static inline v8sf gelu_tanh_mul8(v8sf g, v8sf u) {
    const float c = 0.7978845608028654f; /* sqrt(2 / pi) */
    const v8sf inner = c * (g + 0.044715f * ((g * g) * g));
    return ((0.5f * g) * (1.0f + tanh8(inner))) * u;
}

/* out[r][i] = activation(gate) * up over rows [gate | up], 8 lanes at a time (the tail in lanes
 * padded with zeros, through the same code) */
#define GATED_PRODUCT(name, gated8)                                                           \
    VECTOR_CLONES                                                                             \
    void name(const float *gate_up, int64_t rows, int64_t width, float *out) {               \
        for (int64_t r = 0; r < rows; r++) {                                                  \
            const float *gate = gate_up + r * 2 * width, *up = gate + width;                  \
            for (int64_t i = 0; i < width; i += 8) {                                          \
                const size_t n = (size_t)(width - i < 8 ? width - i : 8);                     \
                v8sf g = splat8(0.0f), u = splat8(0.0f);                                      \
                memcpy(&g, gate + i, sizeof(float) * n);                                      \
                memcpy(&u, up + i, sizeof(float) * n);                                        \
                const v8sf y = gated8(g, u);                                                  \
                memcpy(out + r * width + i, &y, sizeof(float) * n);                           \
            }                                                                                 \
        }                                                                                     \
    }
GATED_PRODUCT(kvg_silu_mul, silu_mul8)
GATED_PRODUCT(kvg_gelu_tanh_mul, gelu_tanh_mul8)

VECTOR_CLONES
void kvg_softcap(float *x, int64_t n, float cap) {
    for (int64_t i = 0; i < n; i += 8) {
        const size_t count = (size_t)(n - i < 8 ? n - i : 8);
        v8sf y = splat8(0.0f);
        memcpy(&y, x + i, sizeof(float) * count);
        y = tanh8(y / cap) * cap;
        memcpy(x + i, &y, sizeof(float) * count);
    }
}
