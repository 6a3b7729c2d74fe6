/*
 * The integer products' interface (linear_int8.c has the contract): rows of activations
 * quantized to 8-bit blocks, and the kernels that multiply them by packed GGUF blocks
 * (formats KVG_Q4_1_I8, KVG_Q8_0_I8 of linear_formats.h).
 */
#ifndef KVG_LINEAR_INT8_H
#define KVG_LINEAR_INT8_H
#include <stdint.h>

/* M rows of K values (K a multiple of QK) quantized: q [M][K] int8, and per block of QK
 * (b = 0 .. K/QK - 1) the scale d [M][K/QK] and s = d * (sum of the block's q) [M][K/QK]. */
struct kvg_qrows {
    int8_t *q;
    float *d, *s;
    int64_t M, K;
};

/* Room for M rows of K: 0, or -1 when memory ran out (kvg_qrows_free gives it back). */
int kvg_qrows_take(struct kvg_qrows *rows, int64_t M, int64_t K);
void kvg_qrows_free(struct kvg_qrows *rows);

/* Rows [m_begin, m_end) of x (row stride ldx) into `rows`, by the rule of linear_int8.c. */
void kvg_quantize_generic(const float *x, int64_t ldx, int64_t m_begin, int64_t m_end,
                          const struct kvg_qrows *rows);
void kvg_quantize_avx2(const float *x, int64_t ldx, int64_t m_begin, int64_t m_end,
                       const struct kvg_qrows *rows);

/* y's columns of panels [p_begin, p_end), every row of `rows`, by the contract. */
void kvg_linear_int8_generic(int format, const struct kvg_qrows *rows, const uint8_t *packed,
                             int64_t N, int64_t p_begin, int64_t p_end, float *y, int64_t ldy);
void kvg_linear_int8_avx2(int format, const struct kvg_qrows *rows, const uint8_t *packed,
                          int64_t N, int64_t p_begin, int64_t p_end, float *y, int64_t ldy);

#endif
