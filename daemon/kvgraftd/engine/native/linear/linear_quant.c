/*
 * GGUF's quantized blocks for the row-invariant linear product (linear_formats.h has
 * the packed layout): packing from the GGUF file's rows, unpacking to the float32
 * weights they stand for, and the portable kernel.
 *
 * kvg_quant_pack(format, blocks, row_bytes, order, N, K, packed): any packed format of
 *   Q4_1 or Q8_0 blocks (for the float or the integer products); output column n is
 *   the GGUF row order[n] (transformers permutes some rows of q and k when it reads a
 *   GGUF; the caller gives that permutation). blocks holds the file's rows, row_bytes
 *   apart. Returns 0, or -1 when K is not a multiple of 32 or the format is unknown.
 * kvg_quant_unpack(format, packed, N, K, W): W [N x K] as float32, each weight the
 *   float the kernels compute (the engine checks them against the model's own).
 * kvg_quant_rows(format, packed, K, rows, count, out): out [count x K] = the rows
 *   rows[0..count) of that W (an embedding lookup from the blocks of a tied output
 *   product); the caller checks each is below N.
 * kvg_linear_quant_generic(...): the contract of linear.c as a plain fmaf loop over
 *   weights dequantized one at a time.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "gguf_blocks.h"
#include "linear_formats.h"


/* q of GGUF row `row` at k (its raw block bytes: Q4_1 d, m, 16 bytes; Q8_0 d, 32 bytes) */
static int gguf_q(int format, const uint8_t *row, int64_t k) {
    const int64_t b = k / QK, i = k % QK;
    if (kvg_is_q4(format)) {
        const uint8_t byte = row[b * GGUF_BLOCK_Q4 + 4 + i % 16];
        return i < 16 ? byte & 15 : byte >> 4;
    }
    return (int8_t)row[b * GGUF_BLOCK_Q8 + 2 + i];
}

int kvg_quant_pack(int format, const uint8_t *blocks, int64_t row_bytes, const int64_t *order,
                   int64_t N, int64_t K, uint8_t *packed) {
    const int64_t bytes = kvg_block_bytes(format);
    if (!bytes || format > KVG_Q8_0_I8 || K % QK) return -1;
    const int64_t panels = (N + PANEL - 1) / PANEL, per_panel = kvg_panel_bytes(format, K);
    memset(packed, 0, (size_t)(panels * per_panel));
    const int q4 = kvg_is_q4(format);
    const int64_t source_block = q4 ? GGUF_BLOCK_Q4 : GGUF_BLOCK_Q8;
    for (int64_t n = 0; n < N; n++) {
        const uint8_t *row = blocks + order[n] * row_bytes;
        const int j = (int)(n % PANEL);
        for (int64_t b = 0; b < K / QK; b++) {
            uint8_t *blk = packed + (n / PANEL) * per_panel + b * bytes;
            const float d = gguf_half(row + b * source_block);
            memcpy(blk + j * sizeof(float), &d, sizeof d);
            if (q4) {
                const float m = gguf_half(row + b * source_block + 2);
                memcpy(blk + (PANEL + j) * sizeof(float), &m, sizeof m);
            }
            for (int i = 0; i < QK; i++) {
                int nibble;
                const int at = kvg_weight_byte(format, j, i, &nibble);
                const int q = gguf_q(format, row, b * QK + i);
                blk[at] |= q4 ? (uint8_t)(q << (4 * nibble)) : (uint8_t)(int8_t)q;
            }
        }
    }
    return 0;
}

/* The weight of column n at k, as every kernel computes it. */
static float packed_weight(int format, const uint8_t *packed, int64_t K, int64_t n, int64_t k) {
    const int j = (int)(n % PANEL);
    const int i = (int)(k % QK);
    const uint8_t *blk =
        packed + (n / PANEL) * kvg_panel_bytes(format, K) + k / QK * kvg_block_bytes(format);
    float d, m;
    memcpy(&d, blk + j * sizeof(float), sizeof d);
    int nibble;
    const uint8_t byte = blk[kvg_weight_byte(format, j, i, &nibble)];
    if (kvg_is_q4(format)) {
        memcpy(&m, blk + (PANEL + j) * sizeof(float), sizeof m);
        const float q = (float)((byte >> (4 * nibble)) & 15);
        const float scaled = q * d; /* rounded: -ffp-contract=off keeps this from fusing */
        return scaled + m;
    }
    return (float)(int8_t)byte * d;
}

/* the K weights of column n */
static void unpack_row(int format, const uint8_t *packed, int64_t K, int64_t n, float *out) {
    for (int64_t k = 0; k < K; k++) out[k] = packed_weight(format, packed, K, n, k);
}

void kvg_quant_unpack(int format, const uint8_t *packed, int64_t N, int64_t K, float *W) {
    for (int64_t n = 0; n < N; n++) unpack_row(format, packed, K, n, W + n * K);
}

void kvg_quant_rows(int format, const uint8_t *packed, int64_t K, const int64_t *rows,
                    int64_t count, float *out) {
    for (int64_t c = 0; c < count; c++) unpack_row(format, packed, K, rows[c], out + c * K);
}

void kvg_linear_quant_generic(int format, const float *x, int64_t M, int64_t K, int64_t ldx,
                              const uint8_t *packed, int64_t N, int64_t p_begin, int64_t p_end,
                              float *y, int64_t ldy) {
    for (int64_t n = p_begin * PANEL; n < p_end * PANEL && n < N; n++)
        for (int64_t m = 0; m < M; m++) {
            float acc = 0.0f;
            for (int64_t k = 0; k < K; k++)
                acc = fmaf(x[m * ldx + k], packed_weight(format, packed, K, n, k), acc);
            y[m * ldy + n] = acc;
        }
}
