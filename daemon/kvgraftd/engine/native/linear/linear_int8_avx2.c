/*
 * The AVX2 build of the integer products and of the activations' quantization (linear_int8.c
 * has the contract; every lane does exactly the scalar rule's operations, so the bits are
 * the portable build's). AVX-512 CPUs run this build too, until their own is written.
 *
 * A register holds 8 columns, 4 consecutive k each (the packed layout of linear_formats.h).
 * vpmaddubsw multiplies the weights' unsigned q (Q4: 0..15) by the activations' signed q
 * broadcast to every column, adding pairs into 16 bits; vpmaddwd by ones adds the pairs of
 * pairs into a 32-bit lane: a column's four products. Q4: a block's eight such 16-bit sums
 * are added before widening (|sum| <= 8 * 2 * 15 * 127 = 30480: no overflow). Q8_0 (signed
 * weights): |w| times x carrying w's sign (vpsignb), widened at once (2 * 128 * 127 fits 16
 * bits, two of them do not).
 */
#include "cpu_features.h"
#if KVG_X86_BUILDS /* the vector builds; elsewhere the portable one alone */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "linear_formats.h"
#include "linear_int8.h"

KVG_TARGET_AVX2

#define ROWS_I8 3    /* rows of a block: 3 x 4 registers measured best (2-6 x 1-4 tried) */
#define REGS_I8 4    /* registers of 8 columns of a block, at most (2 panels) */

static inline __m256i broadcast_quad(const int8_t *q) {
    int32_t quad;
    memcpy(&quad, q, sizeof quad);
    return _mm256_set1_epi32(quad);
}

/* R rows from `m` x C registers of columns (C / 2 panels at w, `stride` bytes apart), over
 * all of k, into y (first column: the first panel's; `cols` columns valid). */
static inline __attribute__((always_inline)) void int8_block(
    const int format, const struct kvg_qrows *x, int64_t m, const uint8_t *w, int64_t stride,
    float *y, int64_t ldy, int64_t cols, const int R, const int C) {
    const int64_t K = x->K, blocks = K / QK, bytes = kvg_block_bytes(format);
    const int q4 = format == KVG_Q4_1_I8;
    const int scales = q4 ? QUANT_SCALES_Q4 : QUANT_SCALES_Q8;
    const __m256i ones = _mm256_set1_epi16(1), low = _mm256_set1_epi8(15);
    __m256 acc[ROWS_I8][REGS_I8];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) acc[r][c] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *blk[REGS_I8]; /* register c's block, at its first column */
        for (int c = 0; c < C; c++) blk[c] = w + c / 2 * stride + b * bytes;
        __m256i sum[ROWS_I8][REGS_I8];
        for (int r = 0; r < R; r++)
            for (int c = 0; c < C; c++) sum[r][c] = _mm256_setzero_si256();
        if (q4) {
            for (int s = 0; s < 4; s++) {
                __m256i first[ROWS_I8], second[ROWS_I8]; /* k = 4s.., 16 + 4s.. */
                for (int r = 0; r < R; r++) {
                    const int8_t *q = x->q + (m + r) * K + b * QK + 4 * s;
                    first[r] = broadcast_quad(q);
                    second[r] = broadcast_quad(q + 16);
                }
                for (int c = 0; c < C; c++) {
                    const __m256i raw = _mm256_loadu_si256(
                        (const __m256i *)(blk[c] + scales + 4 * (s * PANEL + c % 2 * 8)));
                    const __m256i lo = _mm256_and_si256(raw, low);
                    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
                    for (int r = 0; r < R; r++) {
                        const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(lo, first[r]),
                                                               _mm256_maddubs_epi16(hi, second[r]));
                        sum[r][c] = _mm256_add_epi16(sum[r][c], pairs);
                    }
                }
            }
            for (int r = 0; r < R; r++)
                for (int c = 0; c < C; c++) sum[r][c] = _mm256_madd_epi16(sum[r][c], ones);
        } else {
            for (int s = 0; s < QK / 4; s++) {
                __m256i quad[ROWS_I8];
                for (int r = 0; r < R; r++) quad[r] = broadcast_quad(x->q + (m + r) * K + b * QK + 4 * s);
                for (int c = 0; c < C; c++) {
                    const __m256i q = _mm256_loadu_si256(
                        (const __m256i *)(blk[c] + scales + 4 * (s * PANEL + c % 2 * 8)));
                    const __m256i magnitude = _mm256_abs_epi8(q);
                    for (int r = 0; r < R; r++) {
                        const __m256i pairs =
                            _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(quad[r], q));
                        sum[r][c] = _mm256_add_epi32(sum[r][c], _mm256_madd_epi16(pairs, ones));
                    }
                }
            }
        }
        for (int c = 0; c < C; c++) {
            const __m256 d = _mm256_loadu_ps((const float *)blk[c] + c % 2 * 8);
            const __m256 offset = _mm256_loadu_ps((const float *)blk[c] + PANEL + c % 2 * 8);
            for (int r = 0; r < R; r++) {
                const int64_t at = (m + r) * blocks + b;
                const __m256 product = _mm256_mul_ps(d, _mm256_set1_ps(x->d[at]));
                acc[r][c] = _mm256_fmadd_ps(product, _mm256_cvtepi32_ps(sum[r][c]), acc[r][c]);
                if (q4) acc[r][c] = _mm256_fmadd_ps(offset, _mm256_set1_ps(x->s[at]), acc[r][c]);
            }
        }
    }
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) {
            float *out = y + (m + r) * ldy + c * 8;
            if ((c + 1) * 8 <= cols)
                _mm256_storeu_ps(out, acc[r][c]);
            else if (c * 8 < cols)
                _mm256_maskstore_ps(out, _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(cols - c * 8)), lanes),
                                    acc[r][c]);
        }
}

#define CASE_C(F, R, C) \
    case C: int8_block(F, x, m, w, stride, y, ldy, cols, R, C); break;
#define DISPATCH_C(F, R) \
    switch (C) { CASE_C(F, R, 1) CASE_C(F, R, 2) CASE_C(F, R, 3) CASE_C(F, R, 4) }
#define DISPATCH_R(F)                   \
    switch (R) {                        \
        case 1: DISPATCH_C(F, 1) break; \
        case 2: DISPATCH_C(F, 2) break; \
        case 3: DISPATCH_C(F, 3) break; \
    }

static void any_block(int format, const struct kvg_qrows *x, int64_t m, const uint8_t *w,
                      int64_t stride, float *y, int64_t ldy, int64_t cols, int R, int C) {
    if (format == KVG_Q4_1_I8) {
        DISPATCH_R(KVG_Q4_1_I8)
    } else {
        DISPATCH_R(KVG_Q8_0_I8)
    }
}

void kvg_linear_int8_avx2(int format, const struct kvg_qrows *x, const uint8_t *packed,
                          int64_t N, int64_t p_begin, int64_t p_end, float *y, int64_t ldy) {
    const int64_t stride = kvg_panel_bytes(format, x->K);
    const int R_main = x->M < ROWS_I8 ? (int)x->M : ROWS_I8;
    const int P_main = REGS_I8 / 2; /* panels of a block */
    for (int64_t p = p_begin; p < p_end; p += P_main) {
        const int P = (int)(p_end - p < P_main ? p_end - p : P_main);
        int64_t cols = N - p * PANEL;
        if (cols > (int64_t)P * PANEL) cols = (int64_t)P * PANEL;
        const int C = (int)((cols + 7) / 8);
        for (int64_t m = 0; m < x->M; m += R_main) {
            const int R = (int)(x->M - m < R_main ? x->M - m : R_main);
            any_block(format, x, m, packed + p * stride, stride, y + p * PANEL, ldy, cols, R, C);
        }
    }
}

/* ---- quantization: the rule of linear_int8.c, a block of 32 in four registers ---- */

void kvg_quantize_avx2(const float *x, int64_t ldx, int64_t m_begin, int64_t m_end,
                       const struct kvg_qrows *rows) {
    const int64_t K = rows->K, blocks = K / QK;
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256i exponent = _mm256_set1_epi32(0x7f800000);
    for (int64_t m = m_begin; m < m_end; m++)
        for (int64_t b = 0; b < blocks; b++) {
            const float *v = x + m * ldx + b * QK;
            int8_t *q = rows->q + m * K + b * QK;
            float *d = rows->d + m * blocks + b, *s = rows->s + m * blocks + b;
            __m256 value[4], amax = _mm256_setzero_ps();
            __m256i special = _mm256_setzero_si256();
            for (int i = 0; i < 4; i++) {
                value[i] = _mm256_loadu_ps(v + 8 * i);
                const __m256i bits = _mm256_castps_si256(value[i]);
                special = _mm256_or_si256(
                    special, _mm256_cmpeq_epi32(_mm256_and_si256(bits, exponent), exponent));
                amax = _mm256_max_ps(amax, _mm256_and_ps(value[i], magnitude));
            }
            memset(q, 0, QK);
            if (!_mm256_testz_si256(special, special)) {
                *d = *s = __builtin_nanf("");
                continue;
            }
            __m128 half = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
            half = _mm_max_ps(half, _mm_movehl_ps(half, half));
            half = _mm_max_ss(half, _mm_shuffle_ps(half, half, 1));
            const float largest = _mm_cvtss_f32(half); /* a max: the same in any order */
            if (largest < 0x1p-64f) {
                *d = *s = 0.0f;
                continue;
            }
            const __m256 inv = _mm256_set1_ps(127.0f / largest);
            __m256i quant[4], total = _mm256_setzero_si256();
            for (int i = 0; i < 4; i++) {
                quant[i] = _mm256_cvtps_epi32(_mm256_mul_ps(value[i], inv)); /* ties to even */
                total = _mm256_add_epi32(total, quant[i]);
            }
            /* 32 int32 in [-127, 127] to int8, in order (packs work within 128-bit halves) */
            const __m256i words = _mm256_packs_epi32(quant[0], quant[1]);
            const __m256i words2 = _mm256_packs_epi32(quant[2], quant[3]);
            const __m256i bytes = _mm256_packs_epi16(words, words2);
            const __m256i ordered =
                _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            _mm256_storeu_si256((__m256i *)q, ordered);
            int32_t parts[8], sum = 0;
            _mm256_storeu_si256((__m256i *)parts, total);
            for (int i = 0; i < 8; i++) sum += parts[i];
            *d = largest / 127.0f;
            *s = *d * (float)sum;
        }
}

KVG_TARGET_END
#endif
