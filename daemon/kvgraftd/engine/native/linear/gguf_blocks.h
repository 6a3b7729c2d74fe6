/*
 * GGUF's tensor types as a file stores them: their numbers (ggml's, which GGUF's tensor
 * infos name), the weights and bytes of one block, and the exact widening of their float16
 * and bfloat16 scales. Shared by gguf_blocks.c (every format dequantized to float32) and
 * linear_quant.c (Q4_1 and Q8_0 packed for the products); linear.c exports the numbers and
 * sizes to Python in kvg_linear_constants.
 *
 * Layouts (QK_K = 256 weights per k-quant block; little-endian):
 *   Q4_0  18: f16 d, 16 bytes of nibbles        Q4_1  20: f16 d, f16 m, 16 bytes
 *   Q5_0  22: f16 d, u32 high bits, 16 bytes    Q5_1  24: f16 d, f16 m, u32, 16 bytes
 *   Q8_0  34: f16 d, 32 int8                    IQ4_NL 18: f16 d, 16 bytes (codebook)
 *   Q2_K  84: 16 scales, 64 bytes of 2-bit q, f16 d, f16 dmin
 *   Q3_K 110: 32 bytes of high bits, 64 bytes of 2-bit q, 12 bytes of 6-bit scales, f16 d
 *   Q4_K 144: f16 d, f16 dmin, 12 bytes of 6-bit scales and mins, 128 bytes of nibbles
 *   Q5_K 176: as Q4_K with 32 bytes of high bits before the nibbles
 *   Q6_K 210: 128 bytes of low nibbles, 64 bytes of 2-bit highs, 16 int8 scales, f16 d
 *   IQ4_XS 136: f16 d, u16 high scale bits, 4 bytes of low scale nibbles, 128 bytes
 *   F32, F16, BF16: one weight a "block".
 */
#ifndef KVG_GGUF_BLOCKS_H
#define KVG_GGUF_BLOCKS_H
#include <math.h>
#include <stdint.h>
#include <string.h>

enum {
    GGUF_F32 = 0, GGUF_F16 = 1, GGUF_Q4_0 = 2, GGUF_Q4_1 = 3, GGUF_Q5_0 = 6, GGUF_Q5_1 = 7,
    GGUF_Q8_0 = 8, GGUF_Q2_K = 10, GGUF_Q3_K = 11, GGUF_Q4_K = 12, GGUF_Q5_K = 13,
    GGUF_Q6_K = 14, GGUF_IQ4_NL = 20, GGUF_IQ4_XS = 23, GGUF_BF16 = 30,
};

#define QK_K 256 /* weights per k-quant block */

/* Weights in one block of `type` (0: a type not read here). */
static inline int64_t gguf_block_weights(int type) {
    switch (type) {
    case GGUF_F32: case GGUF_F16: case GGUF_BF16: return 1;
    case GGUF_Q4_0: case GGUF_Q4_1: case GGUF_Q5_0: case GGUF_Q5_1: case GGUF_Q8_0:
    case GGUF_IQ4_NL: return 32;
    case GGUF_Q2_K: case GGUF_Q3_K: case GGUF_Q4_K: case GGUF_Q5_K: case GGUF_Q6_K:
    case GGUF_IQ4_XS: return QK_K;
    default: return 0;
    }
}

/* Bytes of one block of `type` (0: a type not read here). */
static inline int64_t gguf_block_bytes(int type) {
    switch (type) {
    case GGUF_F32: return 4;
    case GGUF_F16: case GGUF_BF16: return 2;
    case GGUF_Q4_0: case GGUF_IQ4_NL: return 18;
    case GGUF_Q4_1: return 20;
    case GGUF_Q5_0: return 22;
    case GGUF_Q5_1: return 24;
    case GGUF_Q8_0: return 34;
    case GGUF_Q2_K: return 84;
    case GGUF_Q3_K: return 110;
    case GGUF_Q4_K: return 144;
    case GGUF_Q5_K: return 176;
    case GGUF_Q6_K: return 210;
    case GGUF_IQ4_XS: return 136;
    default: return 0;
    }
}

/* An IEEE half's value as a float, exactly (subnormals, infinities and NaNs too). */
static inline float gguf_half(const uint8_t *p) {
    const uint16_t h = (uint16_t)(p[0] | (p[1] << 8));
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    const uint32_t exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff;
    uint32_t bits;
    if (exponent == 0) { /* zero or subnormal: mantissa * 2^-24, exact in float */
        const float magnitude = ldexpf((float)mantissa, -24);
        return sign ? -magnitude : magnitude;
    }
    if (exponent == 31)
        bits = sign | 0x7f800000u | (mantissa << 13);
    else
        bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* A bfloat16's value: its bits are a float's top half. */
static inline float gguf_bf16(const uint8_t *p) {
    const uint32_t bits = (uint32_t)(p[0] | (p[1] << 8)) << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* Blocks `blocks` of `type` as their float32 weights, each computed as gguf-py's
 * gguf.quants.dequantize computes it (gguf_blocks.c). 0, or -1 for a type not read here. */
int kvg_gguf_dequantize(int type, const uint8_t *blocks, int64_t count, float *out);

/* The weights and bytes of one block of `type`, for Python (0 and 0: not read here). */
void kvg_gguf_block_size(int type, int64_t *weights, int64_t *bytes);

#endif
