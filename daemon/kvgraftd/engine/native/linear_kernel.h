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
#define PANEL 16                 /* columns per packed panel */
#define REGS (PANEL / LANES)     /* registers per panel */
#define MAX_ROWS 6
#define MAX_PANELS 8
#define K_BLOCK 256              /* k per pass when rows are many: 2 panels' slice is 32 KiB */

/* R rows of x (stride ldx) times P panels (packed at w, panel stride K*PANEL floats),
 * for k in [k0, k1), into y (stride ldy), whose first column is panel 0's; `cols`
 * columns of y are valid. With k0 > 0 the chains go on from the values y holds: a
 * float stored and loaded back is the same float, so cutting k into blocks (for the
 * caches) keeps every chain's order, and its bits. */
static inline __attribute__((always_inline)) void block(
    const float *x, int64_t ldx, const float *w, int64_t K, int64_t k0, int64_t k1, float *y,
    int64_t ldy, int64_t cols, const int R, const int P) {
    vec acc[MAX_ROWS][MAX_PANELS * REGS];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < P * REGS; c++) {
            const int64_t col = (int64_t)c * LANES;
            if (k0 == 0 || col >= cols)
                acc[r][c] = VZERO();
            else if (col + LANES <= cols)
                acc[r][c] = VLOAD(y + r * ldy + col);
            else
                acc[r][c] = VLOAD_FIRST(y + r * ldy + col, (int)(cols - col));
        }
    for (int64_t k = k0; k < k1; k++) {
        vec wv[MAX_PANELS * REGS];
        for (int p = 0; p < P; p++)
            for (int h = 0; h < REGS; h++)
                wv[p * REGS + h] = VLOAD(w + ((int64_t)p * K + k) * PANEL + h * LANES);
        for (int r = 0; r < R; r++) {
            const vec xv = VSET1(x[r * ldx + k]);
            for (int c = 0; c < P * REGS; c++) acc[r][c] = VFMA(xv, wv[c], acc[r][c]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < P * REGS; c++) {
            const int64_t col = (int64_t)c * LANES;
            if (col + LANES <= cols)
                VSTORE(y + r * ldy + col, acc[r][c]);
            else if (col < cols)
                VSTORE_FIRST(y + r * ldy + col, acc[r][c], (int)(cols - col));
        }
}

#define CASE_P(R, P) \
    case P: block(x, ldx, w, K, k0, k1, y, ldy, cols, R, P); break;
#define DISPATCH_P(R)                                                           \
    switch (P) {                                                                \
        CASE_P(R, 1) CASE_P(R, 2) CASE_P(R, 3) CASE_P(R, 4) CASE_P(R, 5)      \
        CASE_P(R, 6) CASE_P(R, 7) CASE_P(R, 8)                                  \
    }

static void any_block(const float *x, int64_t ldx, const float *w, int64_t K, int64_t k0,
                      int64_t k1, float *y, int64_t ldy, int64_t cols, int R, int P) {
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

/* y[M x N] (row stride ldy) = x[M x K] (row stride ldx) times the packed W, for the
 * panels [p_begin, p_end) only: the columns a thread takes. */
void KVG_CAT(kvg_linear, KVG_BUILD)(const float *x, int64_t M, int64_t K, int64_t ldx,
                                     const float *packed, int64_t N, int64_t p_begin,
                                     int64_t p_end, float *y, int64_t ldy) {
    const int R_main = M < MAX_ROWS ? (int)M : MAX_ROWS;
    if (R_main == 0) return;
    const int P_main = panels_for(R_main);
    /* one row: the weights stream once, k whole; more rows: k in blocks whose panels
     * stay in L1 while every row block passes */
    const int64_t kc = M <= MAX_ROWS ? K : K_BLOCK;
    for (int64_t k0 = 0; k0 < K; k0 += kc) {
        const int64_t k1 = K - k0 < kc ? K : k0 + kc;
        for (int64_t p = p_begin; p < p_end; p += P_main) {
            const int P = (int)(p_end - p < P_main ? p_end - p : P_main);
            const int64_t col = p * PANEL;
            int64_t cols = N - col;
            if (cols > (int64_t)P * PANEL) cols = (int64_t)P * PANEL;
            const float *w = packed + p * K * PANEL;
            for (int64_t m = 0; m < M; m += MAX_ROWS) {
                const int R = (int)(M - m < MAX_ROWS ? M - m : MAX_ROWS);
                any_block(x + m * ldx, ldx, w, K, k0, k1, y + m * ldy + col, ldy, cols, R, P);
            }
        }
    }
}
