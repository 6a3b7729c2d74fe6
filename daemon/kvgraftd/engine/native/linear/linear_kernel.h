/*
 * One vector build of the row-invariant linear product, for the LANES, vec and V*
 * macros its includer defines (linear_avx512.c: 16 lanes, linear_avx2.c: 8).
 *
 * A register holds LANES consecutive columns of one row of y; for k = 0 .. K-1 in
 * order, it takes one FMA of x[m][k] (broadcast) and the packed W[n..][k]. Each
 * lane is thus exactly the scalar chain acc = fmaf(x[m][k], W[n][k], acc) of
 * linear.c. A block of R rows x C registers keeps R*C chains in flight: at least
 * 8 where the rows allow, so one row (a decode step) is not latency-bound.
 */
#define KVG_CAT2(a, b) a##_##b
#define KVG_CAT(a, b) KVG_CAT2(a, b)
#define REGS (PANEL / LANES)     /* registers per panel (PANEL: linear_formats.h) */
#define MAX_ROWS 6
#define MAX_PANELS 8
#define MAX_QUANT_PANELS 4
#define QUANT_DIRECT_ROWS 18     /* rows up to which GGUF blocks are dequantized in registers */
#define SCRATCH_PANELS 2         /* panels_for(MAX_ROWS): dequantized GGUF panels of a k block */
_Static_assert(QUANT_DIRECT_ROWS >= MAX_ROWS, "GGUF blocks of few rows skip the scratch");
#define K_BLOCK 256              /* k per pass when rows are many: 2 panels' slice is 32 KiB */

static inline __attribute__((always_inline)) void store_rows(
    vec acc[MAX_ROWS][MAX_PANELS * REGS], float *y, int64_t ldy, int64_t cols, const int R,
    const int P) {
    for (int r = 0; r < R; r++)
        for (int c = 0; c < P * REGS; c++) {
            const int64_t col = (int64_t)c * LANES;
            if (col + LANES <= cols)
                VSTORE(y + r * ldy + col, acc[r][c]);
            else if (col < cols)
                VSTORE_FIRST(y + r * ldy + col, acc[r][c], (int)(cols - col));
        }
}

/* R rows of x (stride ldx) times P panels (at w, panel stride `stride` floats; k-major,
 * PANEL floats per k) for `kn` values of k, into y (stride ldy), whose first column is
 * panel 0's; `cols` columns of y are valid. With `resume` the chains go on from the
 * values y holds: a float stored and loaded back is the same float, so cutting k into
 * blocks (for the caches) keeps every chain's order, and its bits. */
static inline __attribute__((always_inline)) void block(
    const float *x, int64_t ldx, const float *w, int64_t stride, int64_t kn, int resume,
    float *y, int64_t ldy, int64_t cols, const int R, const int P) {
    vec acc[MAX_ROWS][MAX_PANELS * REGS];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < P * REGS; c++) {
            const int64_t col = (int64_t)c * LANES;
            if (!resume || col >= cols)
                acc[r][c] = VZERO();
            else if (col + LANES <= cols)
                acc[r][c] = VLOAD(y + r * ldy + col);
            else
                acc[r][c] = VLOAD_FIRST(y + r * ldy + col, (int)(cols - col));
        }
    for (int64_t k = 0; k < kn; k++) {
        vec wv[MAX_PANELS * REGS];
        for (int p = 0; p < P; p++)
            for (int h = 0; h < REGS; h++)
                wv[p * REGS + h] = VLOAD(w + (int64_t)p * stride + k * PANEL + h * LANES);
        for (int r = 0; r < R; r++) {
            const vec xv = VSET1(x[r * ldx + k]);
            for (int c = 0; c < P * REGS; c++) acc[r][c] = VFMA(xv, wv[c], acc[r][c]);
        }
    }
    store_rows(acc, y, ldy, cols, R, P);
}

#define CASE_P(R, P) \
    case P: block(x, ldx, w, stride, kn, resume, y, ldy, cols, R, P); break;
#define DISPATCH_P(R)                                                           \
    switch (P) {                                                                \
        CASE_P(R, 1) CASE_P(R, 2) CASE_P(R, 3) CASE_P(R, 4) CASE_P(R, 5)      \
        CASE_P(R, 6) CASE_P(R, 7) CASE_P(R, 8)                                  \
    }

static void any_block(const float *x, int64_t ldx, const float *w, int64_t stride, int64_t kn,
                      int resume, float *y, int64_t ldy, int64_t cols, int R, int P) {
    switch (R) {
        case 1: DISPATCH_P(1) break;
        case 2: DISPATCH_P(2) break;
        case 3: DISPATCH_P(3) break;
        case 4: DISPATCH_P(4) break;
        case 5: DISPATCH_P(5) break;
        case 6: DISPATCH_P(6) break;
    }
}

/* Panels per block for R rows: 8 chains in flight where the rows allow, and the
 * accumulators, the panel's registers and the broadcast within the 32 (16) registers. */
static int panels_for(int R) {
#if LANES == 16
    static const int best[MAX_ROWS + 1] = {0, 8, 4, 3, 2, 2, 2};
#else
    static const int best[MAX_ROWS + 1] = {0, 4, 2, 1, 1, 1, 1};
#endif
    return best[R];
}

/* ---- GGUF blocks (linear_quant.c has the layout): each weight is dequantized in a
 * register with the arithmetic of the dequantized model, w = d * q (+ m), one rounding
 * per operation, then fused into the chain as an fp32 weight would be. ---- */

/* The weights of k = 2i and 2i + 1 (q4) or k = i (q8) of one packed block's panel, LANES
 * columns from h * LANES. */
static inline __attribute__((always_inline)) void q4_weights(const uint8_t *blk, int i, int h,
                                                            vec d, vec m, vec *even, vec *odd) {
    const __m128i bytes = VBYTES(blk + QUANT_SCALES_Q4 + i * PANEL + h * LANES);
    const __m128i low = _mm_set1_epi8(15);
    *even = VADD(VMUL(VCVT(VWIDEN_U8(_mm_and_si128(bytes, low))), d), m);
    *odd = VADD(VMUL(VCVT(VWIDEN_U8(_mm_and_si128(_mm_srli_epi16(bytes, 4), low))), d), m);
}

static inline __attribute__((always_inline)) vec q8_weight(const uint8_t *blk, int i, int h,
                                                          vec d) {
    const __m128i bytes = VBYTES(blk + QUANT_SCALES_Q8 + i * PANEL + h * LANES);
    return VMUL(VCVT(VWIDEN_I8(bytes)), d);
}

static inline __attribute__((always_inline)) void fma_rows(vec acc[MAX_ROWS][MAX_PANELS * REGS],
                                                          const float *x, int64_t ldx,
                                                          const vec *wv, const int R,
                                                          const int C) {
    for (int r = 0; r < R; r++) {
        const vec xv = VSET1(x[r * ldx]);
        for (int c = 0; c < C; c++) acc[r][c] = VFMA(xv, wv[c], acc[r][c]);
    }
}

/* As block() over all of k, for R <= MAX_ROWS rows and P panels of packed GGUF blocks
 * (panel stride `stride` bytes): the weights stream once, each dequantized once for the
 * R rows. */
static inline __attribute__((always_inline)) void quant_block(
    const int format, const float *x, int64_t ldx, const uint8_t *w, int64_t stride, int64_t K,
    float *y, int64_t ldy, int64_t cols, const int R, const int P) {
    vec acc[MAX_ROWS][MAX_PANELS * REGS];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < P * REGS; c++) acc[r][c] = VZERO();
    const int64_t bytes = format == KVG_Q4_1 ? QUANT_BLOCK_Q4 : QUANT_BLOCK_Q8;
    for (int64_t b = 0; b < K / QK; b++) {
        const uint8_t *blk[MAX_QUANT_PANELS];
        vec d[MAX_QUANT_PANELS * REGS], m[MAX_QUANT_PANELS * REGS];
        for (int p = 0; p < P; p++) {
            blk[p] = w + p * stride + b * bytes;
            for (int h = 0; h < REGS; h++) {
                d[p * REGS + h] = VLOAD((const float *)blk[p] + h * LANES);
                m[p * REGS + h] = format == KVG_Q4_1
                                      ? VLOAD((const float *)blk[p] + PANEL + h * LANES)
                                      : d[p * REGS + h];
            }
        }
        const float *xb = x + b * QK;
        if (format == KVG_Q4_1) {
            for (int i = 0; i < QK / 2; i++) {
                vec even[MAX_QUANT_PANELS * REGS], odd[MAX_QUANT_PANELS * REGS];
                for (int c = 0; c < P * REGS; c++)
                    q4_weights(blk[c / REGS], i, c % REGS, d[c], m[c], &even[c], &odd[c]);
                fma_rows(acc, xb + 2 * i, ldx, even, R, P * REGS);
                fma_rows(acc, xb + 2 * i + 1, ldx, odd, R, P * REGS);
            }
        } else {
            for (int i = 0; i < QK; i++) {
                vec wv[MAX_QUANT_PANELS * REGS];
                for (int c = 0; c < P * REGS; c++) wv[c] = q8_weight(blk[c / REGS], i, c % REGS, d[c]);
                fma_rows(acc, xb + i, ldx, wv, R, P * REGS);
            }
        }
    }
    store_rows(acc, y, ldy, cols, R, P);
}

#define CASE_Q(F, R, P) \
    case P: quant_block(F, x, ldx, w, stride, K, y, ldy, cols, R, P); break;
#define DISPATCH_Q(F, R) \
    switch (P) { CASE_Q(F, R, 1) CASE_Q(F, R, 2) CASE_Q(F, R, 3) CASE_Q(F, R, 4) }
#define DISPATCH_QR(F)                                    \
    switch (R) {                                          \
        case 1: DISPATCH_Q(F, 1) break;                   \
        case 2: DISPATCH_Q(F, 2) break;                   \
        case 3: DISPATCH_Q(F, 3) break;                   \
        case 4: DISPATCH_Q(F, 4) break;                   \
        case 5: DISPATCH_Q(F, 5) break;                   \
        case 6: DISPATCH_Q(F, 6) break;                   \
    }

static void any_quant_block(int format, const float *x, int64_t ldx, const uint8_t *w,
                            int64_t stride, int64_t K, float *y, int64_t ldy, int64_t cols,
                            int R, int P) {
    if (format == KVG_Q4_1) {
        DISPATCH_QR(KVG_Q4_1)
    } else {
        DISPATCH_QR(KVG_Q8_0)
    }
}

static int quant_panels_for(int R) {
#if LANES == 16
    static const int best[MAX_ROWS + 1] = {0, 4, 4, 3, 2, 2, 2};
#else
    static const int best[MAX_ROWS + 1] = {0, 2, 2, 1, 1, 1, 1};
#endif
    return best[R];
}

/* Panels [p, p + P) of packed GGUF blocks, k in [k0, k0 + kn) (multiples of QK), as fp32
 * panels at out (panel stride kn * PANEL): the same floats quant_block computes. */
static void dequantize_panels(int format, const uint8_t *w, int64_t stride, int64_t k0,
                              int64_t kn, int P, float *out) {
    const int64_t bytes = format == KVG_Q4_1 ? QUANT_BLOCK_Q4 : QUANT_BLOCK_Q8;
    for (int p = 0; p < P; p++)
        for (int64_t b = k0 / QK; b < (k0 + kn) / QK; b++) {
            const uint8_t *blk = w + p * stride + b * bytes;
            float *o = out + (int64_t)p * kn * PANEL + (b * QK - k0) * PANEL;
            for (int h = 0; h < REGS; h++) {
                const vec d = VLOAD((const float *)blk + h * LANES);
                if (format == KVG_Q4_1) {
                    const vec m = VLOAD((const float *)blk + PANEL + h * LANES);
                    for (int i = 0; i < QK / 2; i++) {
                        vec even, odd;
                        q4_weights(blk, i, h, d, m, &even, &odd);
                        VSTORE(o + 2 * i * PANEL + h * LANES, even);
                        VSTORE(o + (2 * i + 1) * PANEL + h * LANES, odd);
                    }
                } else {
                    for (int i = 0; i < QK; i++) VSTORE(o + i * PANEL + h * LANES, q8_weight(blk, i, h, d));
                }
            }
        }
}

/* y[M x N] (row stride ldy) = x[M x K] (row stride ldx) times the packed W (format
 * KVG_F32, or GGUF blocks), for the panels [p_begin, p_end) only: the columns a thread
 * takes. */
void KVG_CAT(kvg_linear, KVG_BUILD)(int format, const float *x, int64_t M, int64_t K,
                                     int64_t ldx, const void *packed, int64_t N,
                                     int64_t p_begin, int64_t p_end, float *y, int64_t ldy) {
    const int R_main = M < MAX_ROWS ? (int)M : MAX_ROWS;
    if (R_main == 0) return;
    const int64_t stride = kvg_panel_bytes(format, K);
    if (format != KVG_F32 && M <= QUANT_DIRECT_ROWS) {
        /* decode steps (of a few contexts): the weights dequantized in registers, once per
         * block of MAX_ROWS rows, rather than through an L1 scratch */
        const int P_main = quant_panels_for(R_main);
        for (int64_t p = p_begin; p < p_end; p += P_main) {
            const int P = (int)(p_end - p < P_main ? p_end - p : P_main);
            int64_t cols = N - p * PANEL;
            if (cols > (int64_t)P * PANEL) cols = (int64_t)P * PANEL;
            for (int64_t m = 0; m < M; m += MAX_ROWS) {
                const int R = (int)(M - m < MAX_ROWS ? M - m : MAX_ROWS);
                any_quant_block(format, x + m * ldx, ldx, (const uint8_t *)packed + p * stride,
                                stride, K, y + m * ldy + p * PANEL, ldy, cols, R, P);
            }
        }
        return;
    }
    /* GGUF panels go through the scratch: never more of them than it holds */
    const int P_fit = panels_for(R_main) < SCRATCH_PANELS ? panels_for(R_main) : SCRATCH_PANELS;
    const int P_main = format == KVG_F32 ? panels_for(R_main) : P_fit;
    /* one row: the weights stream once, k whole; more rows: k in blocks whose panels
     * stay in L1 while every row block passes (GGUF blocks dequantized there first) */
    const int64_t kc = M <= MAX_ROWS ? K : K_BLOCK;
    float scratch[SCRATCH_PANELS * K_BLOCK * PANEL] __attribute__((aligned(64)));
    for (int64_t k0 = 0; k0 < K; k0 += kc) {
        const int64_t kn = K - k0 < kc ? K - k0 : kc;
        for (int64_t p = p_begin; p < p_end; p += P_main) {
            const int P = (int)(p_end - p < P_main ? p_end - p : P_main);
            const int64_t col = p * PANEL;
            int64_t cols = N - col;
            if (cols > (int64_t)P * PANEL) cols = (int64_t)P * PANEL;
            const float *w;
            int64_t w_stride;
            if (format == KVG_F32) {
                w = (const float *)packed + p * K * PANEL + k0 * PANEL;
                w_stride = K * PANEL;
            } else {
                dequantize_panels(format, (const uint8_t *)packed + p * stride, stride, k0, kn, P,
                                  scratch);
                w = scratch;
                w_stride = kn * PANEL;
            }
            for (int64_t m = 0; m < M; m += MAX_ROWS) {
                const int R = (int)(M - m < MAX_ROWS ? M - m : MAX_ROWS);
                any_block(x + m * ldx + k0, ldx, w, w_stride, kn, k0 > 0, y + m * ldy + col, ldy,
                          cols, R, P);
            }
        }
    }
}
