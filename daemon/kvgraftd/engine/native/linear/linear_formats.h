/*
 * The interface of the row-invariant linear product: its builds, its weight formats and
 * their packed layouts (shared by linear.c, linear_quant.c, the vector builds and layer.c;
 * linear.c exports every value here to Python as kvg_linear_constants, so
 * kvgraftd.engine.model.linear repeats none).
 *
 * Builds: KVG_BUILD_BEST (the best this CPU runs), _GENERIC (portable fmaf), _AVX2,
 *   _AVX512; every one gives the same bits (linear.c's contract).
 * KVG_F32: panels of PANEL (16) columns, k-major: W[16p + j][k] at float
 *   (p*K + k)*16 + j; zero past column N.
 * KVG_Q4_1, KVG_Q8_0: GGUF's blocks of QK (32) weights along k (GGUF_BLOCK_Q4, 20 bytes:
 *   float16 d and m, 16 bytes of nibbles; GGUF_BLOCK_Q8, 34 bytes: float16 d, 32 int8),
 *   repacked per panel of 16 columns. Panel p is K/32 packed blocks; the packed block b
 *   holds, for its 16 columns j and k = 32b + i:
 *     Q4_1 (QUANT_BLOCK_Q4, 384 bytes): float d[16], float m[16], then byte [i/2][j] whose
 *       low nibble is q(j, 2i') and high nibble q(j, 2i'+1) for i' = i/2;
 *       the weight is (d[j] * q) + m[j], each operation rounded to float;
 *     Q8_0 (QUANT_BLOCK_Q8, 576 bytes): float d[16], then int8 [i][j]; the weight is q * d[j].
 *   d and m are GGUF's float16 scales, widened exactly; columns past N are zero.
 *   That is gguf-py's (and so transformers') dequantization, bit for bit.
 * KVG_Q4_1_I8, KVG_Q8_0_I8: the same blocks, scales first as above, laid out for the integer
 *   products of linear_int8.c: the weights of four consecutive k of one column side by side
 *   (one 32-bit lane of a vector register), the lanes column by column:
 *     Q4_1_I8: byte 4 (s PANEL + j) + t, for s = 0..3 and t = 0..3, holds q(j, 4s + t) in its
 *       low nibble and q(j, 16 + 4s + t) in its high one;
 *     Q8_0_I8: int8 at 4 (s PANEL + j) + t, for s = 0..7, is q(j, 4s + t).
 *   They stand for the same float weights (kvg_quant_unpack gives them); the products differ.
 */
#ifndef KVG_LINEAR_FORMATS_H
#define KVG_LINEAR_FORMATS_H
#include <stdint.h>

enum { KVG_BUILD_BEST = 0, KVG_BUILD_GENERIC = 1, KVG_BUILD_AVX2 = 2, KVG_BUILD_AVX512 = 3 };
enum { KVG_F32 = 0, KVG_Q4_1 = 1, KVG_Q8_0 = 2, KVG_Q4_1_I8 = 3, KVG_Q8_0_I8 = 4 };

#define PANEL 16                       /* columns per packed panel */
#define QK 32                          /* weights per GGUF block, along k */
#define GGUF_BLOCK_Q4 (2 + 2 + QK / 2) /* a GGUF file's Q4_1 block: d, m, nibbles */
#define GGUF_BLOCK_Q8 (2 + QK)         /* a GGUF file's Q8_0 block: d, int8 */
#define QUANT_SCALES_Q4 (2 * PANEL * 4) /* d[16], m[16] */
#define QUANT_SCALES_Q8 (PANEL * 4)     /* d[16] */
#define QUANT_BLOCK_Q4 (QUANT_SCALES_Q4 + QK / 2 * PANEL)
#define QUANT_BLOCK_Q8 (QUANT_SCALES_Q8 + QK * PANEL)

/* Whether a format's products are integer dot products (linear_int8.c). */
static inline int kvg_is_integer(int format) {
    return format == KVG_Q4_1_I8 || format == KVG_Q8_0_I8;
}

/* Whether a format holds 4-bit (Q4_1) blocks; else 8-bit (Q8_0) ones, or floats. */
static inline int kvg_is_q4(int format) { return format == KVG_Q4_1 || format == KVG_Q4_1_I8; }

/* Bytes of one packed block (16 columns, QK values of k); 0 for KVG_F32. */
static inline int64_t kvg_block_bytes(int format) {
    if (format == KVG_F32) return 0;
    return kvg_is_q4(format) ? QUANT_BLOCK_Q4 : QUANT_BLOCK_Q8;
}

/* Bytes of one packed panel (16 columns, all of k). */
static inline int64_t kvg_panel_bytes(int format, int64_t K) {
    if (format == KVG_F32) return K * PANEL * (int64_t)sizeof(float);
    return K / QK * kvg_block_bytes(format);
}

/* Where column j's weight at k = 32b + i lies in its packed block (i = 0..31): the byte, and
 * for Q4 formats the nibble (0 low, 1 high). */
static inline int kvg_weight_byte(int format, int j, int i, int *nibble) {
    *nibble = 0;
    switch (format) {
        case KVG_Q4_1:
            *nibble = i % 2;
            return QUANT_SCALES_Q4 + i / 2 * PANEL + j;
        case KVG_Q8_0: return QUANT_SCALES_Q8 + i * PANEL + j;
        case KVG_Q4_1_I8:
            *nibble = i / 16;
            return QUANT_SCALES_Q4 + 4 * ((i % 16) / 4 * PANEL + j) + i % 4;
        default: return QUANT_SCALES_Q8 + 4 * (i / 4 * PANEL + j) + i % 4;
    }
}

#endif
