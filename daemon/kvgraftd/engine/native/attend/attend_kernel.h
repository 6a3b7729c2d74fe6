/*
 * Decode-step attention over one block of keys and values: the kernel, written once in
 * attend_vectors.h's vectors and compiled three times (attend.c's portable build,
 * attend_avx2.c, attend_avx512.c), each copy named with KVG_SUFFIX. Every float operation
 * is written (an FMA where the contract says so, compiled with -ffp-contract=off), so each
 * copy makes the same IEEE operations and gives the same bits. The checksum is xxHash's
 * own XXH3 (the packaged xxhash.h, Debian's libxxhash-dev), inlined into each build
 * (XXH_INLINE_ALL): nothing to link.
 *
 * The arithmetic (profile "kvgraft-blockwise-online-softmax/2"), for a query row q and the
 * block's keys k_j and values v_j, j < T, D = 16 L:
 *   score   a = q[0:16] * k_j[0:16], then a = fma(q[16l:16l+16], k_j[16l:16l+16], a) for
 *           l = 1 .. L-1; x_i = a_i + a_(i+8); s_j = ((x0+x1)+(x2+x3)) + ((x4+x5)+(x6+x7))
 *   max     m_i = max over j = i mod 8 of s_j in ascending j (running m > s ? m : s, from
 *           -inf; a last group of fewer than 8 tokens pads its lanes with -inf), then
 *           m = max of m_0 .. m_7 in that order
 *   weight  w_j = exp(s_j - m) by exp8 below (FMA steps)
 *   sum     t_i = sum over j = i mod 8 of w_j in ascending j (from 0), then
 *           ((t0+t1)+(t2+t3)) + ((t4+t5)+(t6+t7))
 *   values  acc = 0, then acc = fma(w_j, v_j, acc) for j = 0 .. T-1, lane by lane
 * Two variants of the models that have them (tile_partial's lo and cap; 0 for neither):
 *   softcap s_j = tanh8(s_j / cap) * cap (tanh8 below), before the max
 *   window  the keys j < lo (those before a sliding window) count as s_j = -inf in the max
 *           and weigh exactly 0: left out of the sum and the values' chain (the lanes are
 *           still j mod 8 from the block's first key, so a key's place in the
 *           arithmetic depends on its position alone)
 * Each value is defined; a NaN's payload is not (an add's operand order may differ by build).
 *
 * block_partial(q, k, v, head_stride, H, R, D, T, scores, out_max, out_sum,
 *               out_acc, expected)
 *   q        [H][R][D]  query rows of each KV head, already scaled
 *   k, v     head h, token j at k + h * head_stride + j * D (same for v)
 *   scores   scratch of H * R * T floats
 *   out_max  [H][R]     m
 *   out_sum  [H][R]     the sum of the weights
 *   out_acc  [H][R][D]  acc
 *   expected NULL, or the xxh3-128 (canonical, 16 bytes) of the block as one
 *            page: k points at the page, head_stride == T * D and
 *            v == k + H * T * D. The bytes are hashed in the same pass that
 *            reads them for attention, in order (K of every head, then V).
 * returns 0, KVG_MISMATCH when the page's bytes do not hash to `expected`
 * (the outputs must then be thrown away), KVG_BAD_ARGS for a shape it does
 * not take (D not a multiple of 16 or over 256, R outside 1..KVG_MAX_ROWS):
 * attend_limits.h.
 *
 * tile_partial(q, k, v, head_stride, H, R, D, G, Ts, Los, cap, scores, out_max, out_sum,
 *              out_acc, expected)
 *   G (1..KVG_TILE_TOKENS) tokens of a prefill over the same block: token g's rows at
 *   q + g*H*R*D, its first Ts[g] (>= 1) keys less the first Los[g] (0 <= Los[g] < Ts[g];
 *   Los NULL: none) of them, with scores soft-capped at `cap` (0: not), its outputs at
 *   out_max + g*H*R, out_sum + g*H*R,
 *   out_acc + g*H*R*D; scores holds G*R*(the largest Ts) floats. Each token's outputs are
 *   block_partial's bits for (its q, Ts[g]) where Los[g] and cap are 0 (block_partial has
 *   neither: a model with a window or a softcap attends through tiles alone, a decode step
 *   as a tile of one token): every row makes the same operations in the
 *   same order; only the loops are nested otherwise (a head at a time, a chunk of keys read
 *   once for every token of the tile, not once a token), and a checked page is hashed in
 *   one pass of its own before it is read.
 *
 * merge(rows, D, max, sum, acc, pmax, psum, pacc): one block's partial folded into the
 *   running state, row by row (attend.c's kvg_merge): m = pmax > max ? pmax : max, the two
 *   factors by exp8, each product and sum rounded once (as written there).
 *
 * Every sum runs in one fixed order, so the result is a function of the
 * inputs' values alone (not of strides, threads or where the bytes live).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define XXH_INLINE_ALL
#include <xxhash.h>

#include "attend_limits.h"
#include "attend_vectors.h"

#define KVG_CHUNK_TOKENS 64 /* tokens hashed, then attended, while they are in L1 */

#define KVG_CAT2(a, b) a##_##b
#define KVG_CAT(a, b) KVG_CAT2(a, b)
#define KVG_NAME(name) KVG_CAT(name, KVG_SUFFIX)

_Static_assert(KVG_LANE_FLOATS == 16 && sizeof(v16) == 16 * sizeof(float), "a v16 is 16 floats");
_Static_assert(KVG_CHUNK_TOKENS % 8 == 0, "scores are made 8 tokens at a time");
_Static_assert(sizeof(XXH128_canonical_t) == KVG_CHECKSUM_BYTES, "a checksum is an xxh3-128");

/* exp(x) for x <= 0 (scores minus their max), about 1 ulp: x (at least -87, so 2^n stays
 * normal) = n ln2 + r, n = x log2(e) rounded to nearest (the 1.5 * 2^23 shifter), |r| <=
 * ln2/2 in two FMA steps, exp(r) by the Cephes polynomial in FMA steps, times 2^n. */
static inline v8 KVG_NAME(exp8)(v8 x) {
    x = v8_max(v8_splat(-87.0f), x);
    const v8 shifter = v8_splat(12582912.0f);
    const v8 n = v8_sub(v8_fma(x, v8_splat(1.44269504088896341f), shifter), shifter);
    v8 r = v8_fma(n, v8_splat(-0.693359375f), x);
    r = v8_fma(n, v8_splat(2.12194440e-4f), r);
    v8 p = v8_splat(1.9875691500e-4f);
    p = v8_fma(p, r, v8_splat(1.3981999507e-3f));
    p = v8_fma(p, r, v8_splat(8.3334519073e-3f));
    p = v8_fma(p, r, v8_splat(4.1665795894e-2f));
    p = v8_fma(p, r, v8_splat(1.6666665459e-1f));
    p = v8_fma(p, r, v8_splat(5.0000001201e-1f));
    p = v8_add(v8_fma(p, v8_mul(r, r), r), v8_splat(1.0f));
    return v8_mul(p, v8_pow2(n));
}

/* tanh(y) = (1 - e) / (1 + e) with e = exp8(-2 |y|), y's sign (|y| > 43.5: exp8's floor, 1) */
static inline v8 KVG_NAME(tanh8)(v8 y) {
    const v8 one = v8_splat(1.0f);
    const v8 e = KVG_NAME(exp8)(v8_mul(v8_splat(-2.0f), v8_abs(y)));
    return v8_copysign(v8_div(v8_sub(one, e), v8_add(one, e)), y);
}

/* x of one token's score (the 16-lane FMA chain over the row, folded to 8 lanes) */
static inline __attribute__((always_inline)) v8 KVG_NAME(dot)(
    const v16 *q, const float *row, int lanes) {
    v16 acc = v16_mul(q[0], v16_load(row));
    for (int l = 1; l < lanes; l++) acc = v16_fma(q[l], v16_load(row + 16 * l), acc);
    return v16_fold(acc);
}

/* the scores of 8 tokens from row `first` (rows past `n` repeat the first: their lanes are
 * dropped by the caller), each x summed by the tree as the pairs are made */
static inline __attribute__((always_inline)) v8 KVG_NAME(scores8)(
    const v16 *q, const float *first, int lanes, int D, int n) {
    v8 quads[2];
    for (int half = 0; half < 2; half++) {
        v8 pairs[2];
        for (int pair = 0; pair < 2; pair++) {
            const int t = 4 * half + 2 * pair;
            const float *a = first + (int64_t)(t < n ? t : 0) * D;
            const float *b = first + (int64_t)(t + 1 < n ? t + 1 : 0) * D;
            pairs[pair] = v8_hadd(KVG_NAME(dot)(q, a, lanes), KVG_NAME(dot)(q, b, lanes));
        }
        quads[half] = v8_hadd(pairs[0], pairs[1]);
    }
    return v8_halves(quads[0], quads[1]);
}

/* scores of tokens [j0, j1) of one head (j0 a multiple of 8; those before lo left out, as
 * the contract says), soft-capped where cap is not 0: s[r][j] = q[r] . k_j, and their
 * running max per lane (a tail of fewer than 8 tokens, and keys before lo, count as -inf) */
static inline __attribute__((always_inline)) void KVG_NAME(scores)(
    const v16 *q, const float *k, int R, int lanes, int D, int j0, int j1, int T, int lo,
    float cap, float *scores, v8 *max) {
    const int start = j0 > (lo & ~7) ? j0 : (lo & ~7);
    for (int r = 0; r < R; r++) {
        for (int j = start; j < j1; j += 8) {
            const int n = j1 - j < 8 ? j1 - j : 8;
            const float *first = k + (int64_t)j * D;
            v8 s = n == 8 ? KVG_NAME(scores8)(q + r * lanes, first, lanes, D, 8)
                          : KVG_NAME(scores8)(q + r * lanes, first, lanes, D, n);
            if (cap != 0.0f)
                s = v8_mul(KVG_NAME(tanh8)(v8_div(s, v8_splat(cap))), v8_splat(cap));
            if (n < 8 || j < lo) {
                float lanes_of[8];
                v8_store(lanes_of, s);
                for (int i = 0; i < 8; i++)
                    if (i >= n || j + i < lo) lanes_of[i] = -INFINITY;
                s = v8_load(lanes_of);
                memcpy(scores + (int64_t)r * T + j, lanes_of, (size_t)n * sizeof(float));
            } else {
                v8_store(scores + (int64_t)r * T + j, s);
            }
            max[r] = v8_max(max[r], s);
        }
    }
}

/* acc[r] = fma(w[r][j], v_j, acc[r]) for the tokens [j0, j1), one after the other; a row's
 * accumulators stay in registers while the tokens stream through */
static inline __attribute__((always_inline)) void KVG_NAME(values)(
    const float *w, const float *v, int R, int lanes, int D, int j0, int j1, int T, int lo,
    v16 *acc) {
    for (int r = 0; r < R; r++) {
        v16 row[KVG_MAX_LANES];
        for (int l = 0; l < lanes; l++) row[l] = acc[r * lanes + l];
        for (int j = j0 > lo ? j0 : lo; j < j1; j++) {
            const v16 weight = v16_splat(w[(int64_t)r * T + j]);
            for (int l = 0; l < lanes; l++)
                row[l] = v16_fma(weight, v16_load(v + (int64_t)j * D + 16 * l), row[l]);
        }
        for (int l = 0; l < lanes; l++) acc[r * lanes + l] = row[l];
    }
}

/* the lanes of the running max, folded in lane order */
static inline float KVG_NAME(lanes_max)(v8 lane_max) {
    float lanes[8], m = -INFINITY;
    v8_store(lanes, lane_max);
    for (int i = 0; i < 8; i++) m = lanes[i] > m ? lanes[i] : m;
    return m;
}

/* weights in place of the scores, and their sum (8 lanes, then one fixed tree); the keys
 * before lo weigh 0 */
static inline __attribute__((always_inline)) void KVG_NAME(weights)(
    float *s, int T, float max, float *sum, int lo) {
    v8 total = v8_splat(0.0f);
    const v8 top = v8_splat(max);
    int j = lo & ~7;
    for (int i = 0; i < j; i++) s[i] = 0.0f;
    for (; j + 8 <= T; j += 8) {
        v8 w = KVG_NAME(exp8)(v8_sub(v8_load(s + j), top));
        if (j < lo) {
            float lanes[8];
            v8_store(lanes, w);
            for (int i = 0; i < lo - j; i++) lanes[i] = 0.0f;
            w = v8_load(lanes);
        }
        v8_store(s + j, w);
        total = v8_add(total, w);
    }
    if (j < T) { /* the tail, padded with weights of 0 */
        float lanes[8];
        for (int i = 0; i < 8; i++) lanes[i] = j + i < T && j + i >= lo ? s[j + i] : max;
        v8_store(lanes, KVG_NAME(exp8)(v8_sub(v8_load(lanes), top)));
        for (int i = 0; i < 8; i++)
            if (j + i >= T || j + i < lo) lanes[i] = 0.0f;
        memcpy(s + j, lanes, (size_t)(T - j) * sizeof(float));
        total = v8_add(total, v8_load(lanes));
    }
    float t[8];
    v8_store(t, total);
    *sum = ((t[0] + t[1]) + (t[2] + t[3])) + ((t[4] + t[5]) + (t[6] + t[7]));
}

static inline __attribute__((always_inline)) int KVG_NAME(partial_shaped)(
    const float *q, const float *k, const float *v, int64_t head_stride, int H, int R, int D,
    int T, float *scores, float *out_max, float *out_sum, float *out_acc,
    const uint8_t *expected) {
    const int lanes = D / 16;
    XXH3_state_t state;
    if (expected) XXH3_128bits_reset(&state);
    for (int h = 0; h < H; h++) { /* K of every head, in page order */
        v16 qv[KVG_MAX_ROWS * KVG_MAX_LANES];
        for (int i = 0; i < R * lanes; i++) qv[i] = v16_load(q + ((int64_t)h * R * D) + 16 * i);
        const float *kh = k + h * head_stride;
        float *sh = scores + (int64_t)h * R * T, *max = out_max + h * R;
        v8 lane_max[KVG_MAX_ROWS];
        for (int r = 0; r < R; r++) lane_max[r] = v8_splat(-INFINITY);
        for (int j0 = 0; j0 < T; j0 += KVG_CHUNK_TOKENS) {
            int j1 = j0 + KVG_CHUNK_TOKENS < T ? j0 + KVG_CHUNK_TOKENS : T;
            if (expected)
                XXH3_128bits_update(&state, kh + (int64_t)j0 * D, (size_t)(j1 - j0) * D * 4);
            KVG_NAME(scores)(qv, kh, R, lanes, D, j0, j1, T, 0, 0.0f, sh, lane_max);
        }
        for (int r = 0; r < R; r++) max[r] = KVG_NAME(lanes_max)(lane_max[r]);
        for (int r = 0; r < R; r++)
            KVG_NAME(weights)(sh + (int64_t)r * T, T, max[r], out_sum + h * R + r, 0);
    }
    for (int h = 0; h < H; h++) { /* then V of every head */
        v16 acc[KVG_MAX_ROWS * KVG_MAX_LANES];
        for (int i = 0; i < R * lanes; i++) acc[i] = v16_splat(0.0f);
        const float *vh = v + h * head_stride;
        for (int j0 = 0; j0 < T; j0 += KVG_CHUNK_TOKENS) {
            int j1 = j0 + KVG_CHUNK_TOKENS < T ? j0 + KVG_CHUNK_TOKENS : T;
            if (expected)
                XXH3_128bits_update(&state, vh + (int64_t)j0 * D, (size_t)(j1 - j0) * D * 4);
            KVG_NAME(values)(scores + (int64_t)h * R * T, vh, R, lanes, D, j0, j1, T, 0, acc);
        }
        for (int i = 0; i < R * lanes; i++) v16_store(out_acc + (int64_t)h * R * D + 16 * i, acc[i]);
    }
    if (expected) {
        XXH128_canonical_t canonical;
        XXH128_canonicalFromHash(&canonical, XXH3_128bits_digest(&state));
        if (memcmp(canonical.digest, expected, KVG_CHECKSUM_BYTES) != 0) return KVG_MISMATCH;
    }
    return 0;
}

int KVG_CAT(kvg_block_partial, KVG_SUFFIX)(
    const float *q, const float *k, const float *v, int64_t head_stride, int32_t H, int32_t R,
    int32_t D, int32_t T, float *scores, float *out_max, float *out_sum, float *out_acc,
    const uint8_t *expected) {
    if (D % KVG_LANE_FLOATS || D <= 0 || D > KVG_LANE_FLOATS * KVG_MAX_LANES || R < 1 ||
        R > KVG_MAX_ROWS || T < 1 || H < 1)
        return KVG_BAD_ARGS;
    if (expected && (head_stride != (int64_t)T * D || v != k + (int64_t)H * T * D))
        return KVG_BAD_ARGS;
    /* the shapes of the models this project serves, with every loop bound known */
    if (R == 3 && D == 64)
        return KVG_NAME(partial_shaped)(q, k, v, head_stride, H, 3, 64, T, scores, out_max,
                                        out_sum, out_acc, expected);
    if (R == 2 && D == 16)
        return KVG_NAME(partial_shaped)(q, k, v, head_stride, H, 2, 16, T, scores, out_max,
                                        out_sum, out_acc, expected);
    return KVG_NAME(partial_shaped)(q, k, v, head_stride, H, R, D, T, scores, out_max, out_sum,
                                    out_acc, expected);
}

/* tile_partial's work, its arguments checked; R and D constants where the caller knows them */
static inline __attribute__((always_inline)) void KVG_NAME(tile_shaped)(
    const float *q, const float *k, const float *v, int64_t head_stride, int H, int R, int D,
    int G, const int32_t *Ts, const int32_t *Los, float cap, int32_t most, float *scores,
    float *out_max, float *out_sum, float *out_acc) {
    const int lanes = D / 16;
    const int64_t rows = (int64_t)H * R;
    for (int h = 0; h < H; h++) {
        const float *kh = k + h * head_stride, *vh = v + h * head_stride;
        v8 lane_max[KVG_TILE_TOKENS * KVG_MAX_ROWS];
        for (int i = 0; i < G * R; i++) lane_max[i] = v8_splat(-INFINITY);
        for (int j0 = 0; j0 < most; j0 += KVG_CHUNK_TOKENS) { /* the scores, chunk by chunk */
            const int j1 = j0 + KVG_CHUNK_TOKENS < most ? j0 + KVG_CHUNK_TOKENS : most;
            for (int g = 0; g < G; g++) {
                if (Ts[g] <= j0 || j1 <= (Los[g] & ~7)) continue;
                v16 qv[KVG_MAX_ROWS * KVG_MAX_LANES];
                const float *qg = q + g * rows * D + (int64_t)h * R * D;
                for (int i = 0; i < R * lanes; i++) qv[i] = v16_load(qg + 16 * i);
                KVG_NAME(scores)(qv, kh, R, lanes, D, j0, j1 < Ts[g] ? j1 : Ts[g], Ts[g], Los[g],
                                 cap, scores + (int64_t)g * R * most, lane_max + g * R);
            }
        }
        for (int g = 0; g < G; g++) { /* the weights, row by row */
            float *max = out_max + g * rows + h * R, *sum = out_sum + g * rows + h * R;
            for (int r = 0; r < R; r++) {
                const float m = KVG_NAME(lanes_max)(lane_max[g * R + r]);
                max[r] = m;
                KVG_NAME(weights)(scores + (int64_t)g * R * most + (int64_t)r * Ts[g], Ts[g], m,
                                  sum + r, Los[g]);
            }
            float *acc = out_acc + (g * rows + (int64_t)h * R) * D;
            memset(acc, 0, sizeof(float) * (size_t)(R * D));
        }
        for (int j0 = 0; j0 < most; j0 += KVG_CHUNK_TOKENS) { /* the values, chunk by chunk */
            const int j1 = j0 + KVG_CHUNK_TOKENS < most ? j0 + KVG_CHUNK_TOKENS : most;
            for (int g = 0; g < G; g++) {
                if (Ts[g] <= j0 || j1 <= Los[g]) continue;
                float *acc_g = out_acc + (g * rows + (int64_t)h * R) * D;
                v16 acc[KVG_MAX_ROWS * KVG_MAX_LANES];
                memcpy(acc, acc_g, sizeof(float) * (size_t)(R * D));
                KVG_NAME(values)(scores + (int64_t)g * R * most, vh, R, lanes, D, j0,
                                 j1 < Ts[g] ? j1 : Ts[g], Ts[g], Los[g], acc);
                memcpy(acc_g, acc, sizeof(float) * (size_t)(R * D));
            }
        }
    }
}

int KVG_CAT(kvg_tile_partial, KVG_SUFFIX)(
    const float *q, const float *k, const float *v, int64_t head_stride, int32_t H, int32_t R,
    int32_t D, int32_t G, const int32_t *Ts, const int32_t *Los, float cap, float *scores,
    float *out_max, float *out_sum, float *out_acc, const uint8_t *expected) {
    if (D % KVG_LANE_FLOATS || D <= 0 || D > KVG_LANE_FLOATS * KVG_MAX_LANES || R < 1 ||
        R > KVG_MAX_ROWS || H < 1 || G < 1 || G > KVG_TILE_TOKENS)
        return KVG_BAD_ARGS;
    int32_t most = 0, none[KVG_TILE_TOKENS] = {0};
    if (!Los) Los = none;
    if (!(cap >= 0.0f)) return KVG_BAD_ARGS;
    for (int g = 0; g < G; g++) {
        if (Ts[g] < 1 || Los[g] < 0 || Los[g] >= Ts[g]) return KVG_BAD_ARGS;
        most = Ts[g] > most ? Ts[g] : most;
    }
    if (expected) {
        if (head_stride != (int64_t)most * D || v != k + (int64_t)H * most * D) return KVG_BAD_ARGS;
        XXH128_canonical_t canonical;
        XXH128_canonicalFromHash(&canonical,
                                 XXH3_128bits(k, (size_t)2 * H * most * D * sizeof(float)));
        if (memcmp(canonical.digest, expected, KVG_CHECKSUM_BYTES) != 0) return KVG_MISMATCH;
    }
    /* the shapes of the models this project serves, with every loop bound known */
    if (R == 3 && D == 64)
        KVG_NAME(tile_shaped)(q, k, v, head_stride, H, 3, 64, G, Ts, Los, cap, most, scores,
                              out_max, out_sum, out_acc);
    else if (R == 2 && D == 16)
        KVG_NAME(tile_shaped)(q, k, v, head_stride, H, 2, 16, G, Ts, Los, cap, most, scores,
                              out_max, out_sum, out_acc);
    else
        KVG_NAME(tile_shaped)(q, k, v, head_stride, H, R, D, G, Ts, Los, cap, most, scores,
                              out_max, out_sum, out_acc);
    return 0;
}

void KVG_CAT(kvg_merge, KVG_SUFFIX)(int32_t rows, int32_t D, float *max, float *sum, float *acc,
                                    const float *pmax, const float *psum, const float *pacc) {
    for (int32_t r0 = 0; r0 < rows; r0 += 8) { /* the factors of 8 rows at a time */
        const int n = rows - r0 < 8 ? rows - r0 : 8;
        float top[8], to_old[8] = {0}, to_new[8] = {0}, old[8], new[8];
        for (int i = 0; i < n; i++) {
            const float had = max[r0 + i], got = pmax[r0 + i];
            top[i] = got > had ? got : had;
            to_old[i] = had == -INFINITY ? 0.0f : had - top[i];
            to_new[i] = got - top[i];
        }
        v8_store(old, KVG_NAME(exp8)(v8_load(to_old)));
        v8_store(new, KVG_NAME(exp8)(v8_load(to_new)));
        for (int i = 0; i < n; i++) {
            const int64_t r = r0 + i;
            if (max[r] == -INFINITY) old[i] = 0.0f; /* an empty state holds nothing */
            sum[r] = sum[r] * old[i] + psum[r] * new[i];
            const v16 o = v16_splat(old[i]), w = v16_splat(new[i]);
            int32_t d = 0;
            for (; d + 16 <= D; d += 16) {
                float *a = acc + r * D + d;
                v16_store(a, v16_add(v16_mul(v16_load(a), o), v16_mul(v16_load(pacc + r * D + d), w)));
            }
            for (; d < D; d++) acc[r * D + d] = acc[r * D + d] * old[i] + pacc[r * D + d] * new[i];
            max[r] = top[i];
        }
    }
}
