/*
 * Every GGUF tensor type the engine reads, dequantized to float32 (gguf_blocks.h has the
 * layouts).
 *
 * kvg_gguf_dequantize(type, blocks, count, out): `count` blocks of `type`, their weights in
 *   order in `out` (count x gguf_block_weights(type) floats). Each weight is computed with
 *   gguf-py's operations in gguf-py's order (gguf.quants, an implementation no one here
 *   wrote: tests/engine/test_gguf_blocks.py holds every type to it bit for bit): a scale
 *   times a quantized value, then the block's minimum added or subtracted, each operation
 *   rounded to float (built with -ffp-contract=off: nothing fused). Returns 0, or -1 for a
 *   type not read here.
 * kvg_gguf_block_size(type, weights, bytes): one block's weights and bytes (0: not read).
 */
#include <stdint.h>

#include "gguf_blocks.h"

static const int8_t IQ4_VALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                      1,    13,   25,  38,  53,  69,  89,  113};

static uint32_t read_u32(const uint8_t *p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) |
           ((uint32_t)p[3] << 24);
}

/* Weights j and 16 + j of a 32-weight block are the low and high nibble of byte j. */
static int nibble(const uint8_t *qs, int index) {
    return index < 16 ? qs[index] & 0x0f : qs[index - 16] >> 4;
}

static void legacy_block(int type, const uint8_t *b, float *y) {
    const float d = gguf_half(b);
    for (int i = 0; i < 32; i++) {
        switch (type) {
        case GGUF_Q4_0: y[i] = d * (float)(nibble(b + 2, i) - 8); break;
        case GGUF_Q4_1: y[i] = (d * (float)nibble(b + 4, i)) + gguf_half(b + 2); break;
        case GGUF_Q5_0: {
            const int high = (int)((read_u32(b + 2) >> i) & 1) << 4;
            y[i] = d * (float)((nibble(b + 6, i) | high) - 16);
            break;
        }
        case GGUF_Q5_1: {
            const int high = (int)((read_u32(b + 4) >> i) & 1) << 4;
            y[i] = (d * (float)(nibble(b + 8, i) | high)) + gguf_half(b + 2);
            break;
        }
        case GGUF_Q8_0: y[i] = (float)(int8_t)b[2 + i] * d; break;
        default: y[i] = d * (float)IQ4_VALUES[nibble(b + 2, i)]; break; /* IQ4_NL */
        }
    }
}

/* Q4_K's and Q5_K's eight 6-bit scales and mins, from their 12 bytes. */
static void scales_and_mins(const uint8_t *s, int sc[8], int mn[8]) {
    for (int j = 0; j < 4; j++) {
        sc[j] = s[j] & 63;
        mn[j] = s[4 + j] & 63;
        sc[4 + j] = (s[8 + j] & 0x0f) | ((s[j] >> 2) & 0x30);
        mn[4 + j] = (s[8 + j] >> 4) | ((s[4 + j] >> 2) & 0x30);
    }
}

static void q2_k(const uint8_t *b, float *y) {
    const uint8_t *scales = b, *qs = b + 16;
    const float d = gguf_half(b + 80), dmin = gguf_half(b + 82);
    for (int e = 0; e < QK_K; e++) { /* e = (half * 4 + shift) * 32 + l */
        const int half = e / 128, shift = (e / 32) % 4, l = e % 32, group = e / 16;
        const float dl = d * (float)(scales[group] & 0x0f);
        const float ml = dmin * (float)(scales[group] >> 4);
        y[e] = dl * (float)((qs[half * 32 + l] >> (2 * shift)) & 3) - ml;
    }
}

static void q3_k(const uint8_t *b, float *y) {
    const uint8_t *hmask = b, *qs = b + 32, *s = b + 96;
    const float d = gguf_half(b + 108);
    float dl[16];
    for (int i = 0; i < 16; i++) {
        const int low = (s[i % 8] >> (4 * (i / 8))) & 0x0f;
        const int high = (s[8 + i % 4] >> (2 * (i / 4))) & 3;
        dl[i] = d * (float)((int8_t)(low | (high << 4)) - 32);
    }
    for (int e = 0; e < QK_K; e++) {
        const int half = e / 128, shift = (e / 32) % 4, l = e % 32;
        const int q = (qs[half * 32 + l] >> (2 * shift)) & 3;
        const int h = ((hmask[l] >> (e / 32)) & 1) ^ 1; /* a set bit: no offset */
        y[e] = dl[e / 16] * (float)(q - (h << 2));
    }
}

static void q45_k(int type, const uint8_t *b, float *y) {
    const float d = gguf_half(b), dmin = gguf_half(b + 2);
    const uint8_t *qh = b + 16, *qs = type == GGUF_Q5_K ? b + 48 : b + 16;
    int sc[8], mn[8];
    scales_and_mins(b + 4, sc, mn);
    for (int e = 0; e < QK_K; e++) { /* sub-block e / 32 = chunk * 2 + nibble */
        const int sub = e / 32, l = e % 32;
        int q = (qs[(sub / 2) * 32 + l] >> (4 * (sub % 2))) & 0x0f;
        if (type == GGUF_Q5_K) q |= ((qh[l] >> sub) & 1) << 4;
        const float ds = d * (float)sc[sub], dm = dmin * (float)mn[sub];
        y[e] = ds * (float)q - dm;
    }
}

static void q6_k(const uint8_t *b, float *y) {
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *scales = (const int8_t *)(b + 192);
    const float d = gguf_half(b + 208);
    for (int e = 0; e < QK_K; e++) { /* e = half * 128 + (nibble * 64 + m) = half * 128 + ... */
        const int half = e / 128, within = e % 128;
        const int low = (ql[half * 64 + within % 64] >> (4 * (within / 64))) & 0x0f;
        const int high = (qh[half * 32 + within % 32] >> (2 * (within / 32))) & 3;
        const float dg = d * (float)scales[e / 16];
        y[e] = dg * (float)((int8_t)(low | (high << 4)) - 32);
    }
}

static void iq4_xs(const uint8_t *b, float *y) {
    const float d = gguf_half(b);
    const unsigned scales_h = (unsigned)(b[2] | (b[3] << 8));
    const uint8_t *scales_l = b + 4, *qs = b + 8;
    for (int sub = 0; sub < 8; sub++) {
        const int low = (scales_l[sub / 2] >> (4 * (sub % 2))) & 0x0f;
        const int high = (scales_h >> (2 * sub)) & 3;
        const float dl = d * (float)((int8_t)(low | (high << 4)) - 32);
        for (int e = 0; e < 32; e++) {
            const int q = (qs[sub * 16 + e % 16] >> (4 * (e / 16))) & 0x0f;
            y[sub * 32 + e] = dl * (float)IQ4_VALUES[q];
        }
    }
}

void kvg_gguf_block_size(int type, int64_t *weights, int64_t *bytes) {
    *weights = gguf_block_weights(type);
    *bytes = gguf_block_bytes(type);
}

int kvg_gguf_dequantize(int type, const uint8_t *blocks, int64_t count, float *out) {
    const int64_t size = gguf_block_bytes(type), weights = gguf_block_weights(type);
    if (size == 0) return -1;
    for (int64_t i = 0; i < count; i++) {
        const uint8_t *b = blocks + i * size;
        float *y = out + i * weights;
        switch (type) {
        case GGUF_F32: memcpy(y, b, 4); break;
        case GGUF_F16: *y = gguf_half(b); break;
        case GGUF_BF16: *y = gguf_bf16(b); break;
        case GGUF_Q2_K: q2_k(b, y); break;
        case GGUF_Q3_K: q3_k(b, y); break;
        case GGUF_Q4_K: case GGUF_Q5_K: q45_k(type, b, y); break;
        case GGUF_Q6_K: q6_k(b, y); break;
        case GGUF_IQ4_XS: iq4_xs(b, y); break;
        default: legacy_block(type, b, y); break;
        }
    }
    return 0;
}
