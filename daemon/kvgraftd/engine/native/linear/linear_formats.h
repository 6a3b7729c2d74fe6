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
 */
#ifndef KVG_LINEAR_FORMATS_H
#define KVG_LINEAR_FORMATS_H
#include <stdint.h>

enum { KVG_BUILD_BEST = 0, KVG_BUILD_GENERIC = 1, KVG_BUILD_AVX2 = 2, KVG_BUILD_AVX512 = 3 };
enum { KVG_F32 = 0, KVG_Q4_1 = 1, KVG_Q8_0 = 2 };

#define PANEL 16                       /* columns per packed panel */
#define QK 32                          /* weights per GGUF block, along k */
#define GGUF_BLOCK_Q4 (2 + 2 + QK / 2) /* a GGUF file's Q4_1 block: d, m, nibbles */
#define GGUF_BLOCK_Q8 (2 + QK)         /* a GGUF file's Q8_0 block: d, int8 */
#define QUANT_SCALES_Q4 (2 * PANEL * 4) /* d[16], m[16] */
#define QUANT_SCALES_Q8 (PANEL * 4)     /* d[16] */
#define QUANT_BLOCK_Q4 (QUANT_SCALES_Q4 + QK / 2 * PANEL)
#define QUANT_BLOCK_Q8 (QUANT_SCALES_Q8 + QK * PANEL)

/* Bytes of one packed panel (16 columns, all of k). */
static inline int64_t kvg_panel_bytes(int format, int64_t K) {
    switch (format) {
        case KVG_Q4_1: return K / QK * QUANT_BLOCK_Q4;
        case KVG_Q8_0: return K / QK * QUANT_BLOCK_Q8;
        default: return K * PANEL * (int64_t)sizeof(float);
    }
}

#endif
