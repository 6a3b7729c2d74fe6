/*
 * The integer products (compute profile "int8-dot/1"): y = x W^T where W is packed GGUF
 * blocks (KVG_Q4_1_I8, KVG_Q8_0_I8: linear_formats.h) and x is first quantized to 8 bits
 * per block of 32, as llama.cpp computes on CPU, in an order fixed here so that every build
 * gives the same bits.
 *
 * Quantizing a row, block by block (b = 0 .. K/32 - 1, values v[0..31]):
 *   - a block holding a NaN or an infinity: d = s = NaN, every q = 0 (its products are NaN);
 *   - else amax = the largest |v|; below 2^-64 (zeros included) the block is zero: d = s = 0,
 *     every q = 0;
 *   - else d = amax / 127 and inv = 127 / amax (float divisions, correctly rounded), each
 *     q = v * inv (rounded to float) rounded to the nearest integer, ties to even (it lies
 *     in [-127, 127]: |v * inv| <= 127 * (1 + 2^-23)), and s = d * (float)(sum of q).
 * The product, for row m and column n: one float accumulator, +0.0 to start; for each block
 *   b in ascending order, isum = the sum of q_w * q_x over its 32 k (exact in int32), then
 *     acc = fmaf(d_w * d_x, (float)isum, acc)        (d_w * d_x rounded to float)
 *     acc = fmaf(m_w, s_x, acc)                       (Q4_1 only: its offset m)
 *   with d_w, m_w the block's float16 scales widened exactly. An integer sum is the same in
 *   any order, and each float operation rounds once, so y[m][n] depends on row m of x and
 *   column n of W alone: not on M, the threads, or the build (portable, AVX2).
 *
 * kvg_quantize_generic: the rule, plainly; kvg_linear_int8_generic: the product, plainly
 * (the portable build, and the reference of the tests).
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "linear_formats.h"
#include "linear_int8.h"

int kvg_qrows_take(struct kvg_qrows *rows, int64_t M, int64_t K) {
    const size_t blocks = (size_t)(M * (K / QK)) + 1; /* + 1: never malloc(0) */
    rows->M = M;
    rows->K = K;
    rows->q = malloc((size_t)(M * K) + 32);
    rows->d = malloc(blocks * sizeof(float));
    rows->s = malloc(blocks * sizeof(float));
    if (rows->q && rows->d && rows->s) return 0;
    kvg_qrows_free(rows);
    return -1;
}

void kvg_qrows_free(struct kvg_qrows *rows) {
    free(rows->q);
    free(rows->d);
    free(rows->s);
    rows->q = NULL;
    rows->d = rows->s = NULL;
}

static int finite_bits(float v) {
    uint32_t bits;
    memcpy(&bits, &v, sizeof bits);
    return (bits & 0x7f800000u) != 0x7f800000u;
}

void kvg_quantize_generic(const float *x, int64_t ldx, int64_t m_begin, int64_t m_end,
                          const struct kvg_qrows *rows) {
    const int64_t K = rows->K, blocks = K / QK;
    for (int64_t m = m_begin; m < m_end; m++)
        for (int64_t b = 0; b < blocks; b++) {
            const float *v = x + m * ldx + b * QK;
            int8_t *q = rows->q + m * K + b * QK;
            float *d = rows->d + m * blocks + b, *s = rows->s + m * blocks + b;
            float amax = 0.0f;
            int finite = 1;
            for (int i = 0; i < QK; i++) {
                finite &= finite_bits(v[i]);
                if (fabsf(v[i]) > amax) amax = fabsf(v[i]);
            }
            memset(q, 0, QK);
            if (!finite) {
                *d = *s = NAN;
                continue;
            }
            if (amax < 0x1p-64f) {
                *d = *s = 0.0f;
                continue;
            }
            const float inv = 127.0f / amax;
            int sum = 0;
            for (int i = 0; i < QK; i++) {
                const float scaled = v[i] * inv;
                q[i] = (int8_t)lrintf(scaled); /* ties to even: the default rounding mode */
                sum += q[i];
            }
            *d = amax / 127.0f;
            *s = *d * (float)sum;
        }
}

/* The packed weight's integer q of column j at k = 32b + i, and the block's scales. */
static int weight_q(int format, const uint8_t *blk, int j, int i) {
    int nibble;
    const uint8_t byte = blk[kvg_weight_byte(format, j, i, &nibble)];
    return kvg_is_q4(format) ? (byte >> (4 * nibble)) & 15 : (int8_t)byte;
}

static float scale(const uint8_t *blk, int at) {
    float value;
    memcpy(&value, blk + at * sizeof(float), sizeof value);
    return value;
}

void kvg_linear_int8_generic(int format, const struct kvg_qrows *rows, const uint8_t *packed,
                             int64_t N, int64_t p_begin, int64_t p_end, float *y, int64_t ldy) {
    const int64_t K = rows->K, blocks = K / QK, bytes = kvg_block_bytes(format);
    const int q4 = kvg_is_q4(format);
    for (int64_t n = p_begin * PANEL; n < p_end * PANEL && n < N; n++) {
        const int j = (int)(n % PANEL);
        const uint8_t *panel = packed + n / PANEL * kvg_panel_bytes(format, K);
        for (int64_t m = 0; m < rows->M; m++) {
            float acc = 0.0f;
            for (int64_t b = 0; b < blocks; b++) {
                const uint8_t *blk = panel + b * bytes;
                const int8_t *q = rows->q + m * K + b * QK;
                int32_t isum = 0;
                for (int i = 0; i < QK; i++) isum += weight_q(format, blk, j, i) * q[i];
                const float scales = scale(blk, j) * rows->d[m * blocks + b];
                acc = fmaf(scales, (float)isum, acc);
                if (q4) acc = fmaf(scale(blk, PANEL + j), rows->s[m * blocks + b], acc);
            }
            y[m * ldy + n] = acc;
        }
    }
}
