/*
 * Decode-step attention over one block of keys and values: the kernel, written
 * once and compiled twice (attend.c's portable build, attend_avx512.c), each copy
 * named with KVG_SUFFIX. GCC vector extensions, lowered to
 * the instruction set of the including file; compiled with -ffp-contract=off, so each
 * copy makes the same IEEE operations and gives the same bits. The checksum is xxHash's own XXH3 (the packaged xxhash.h,
 * Debian's libxxhash-dev), inlined into each build (XXH_INLINE_ALL): nothing to link.
 *
 * block_partial(q, k, v, head_stride, H, R, D, T, scores, out_max, out_sum,
 *               out_acc, expected)
 *   q        [H][R][D]  query rows of each KV head, already scaled
 *   k, v     head h, token j at k + h * head_stride + j * D (same for v)
 *   scores   scratch of H * R * T floats
 *   out_max  [H][R]     max_j s_j             with s_j = q . k_j
 *   out_sum  [H][R]     sum_j exp(s_j - max)
 *   out_acc  [H][R][D]  sum_j exp(s_j - max) v_j
 *   expected NULL, or the xxh3-128 (canonical, 16 bytes) of the block as one
 *            page: k points at the page, head_stride == T * D and
 *            v == k + H * T * D. The bytes are hashed in the same pass that
 *            reads them for attention, in order (K of every head, then V).
 * returns 0, KVG_MISMATCH when the page's bytes do not hash to `expected`
 * (the outputs must then be thrown away), KVG_BAD_ARGS for a shape it does
 * not take (D not a multiple of 16 or over 256, R outside 1..KVG_MAX_ROWS):
 * attend_limits.h.
 *
 * tile_partial(q, k, v, head_stride, H, R, D, G, Ts, scores, out_max, out_sum, out_acc,
 *              expected)
 *   G (1..KVG_TILE_TOKENS) tokens of a prefill over the same block: token g's rows at
 *   q + g*H*R*D, its first Ts[g] (>= 1) keys, its outputs at out_max + g*H*R, out_sum + g*H*R,
 *   out_acc + g*H*R*D; scores holds G*R*(the largest Ts) floats. Each token's outputs are
 *   block_partial's bits for (its q, Ts[g]): every row makes the same operations in the
 *   same order; only the loops are nested otherwise (a head at a time, a chunk of keys read
 *   once for every token of the tile, not once a token), and a checked page is hashed in
 *   one pass of its own before it is read.
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

#define KVG_CHUNK_TOKENS 64 /* tokens hashed, then attended, while they are in L1 */

#define KVG_CAT2(a, b) a##_##b
#define KVG_CAT(a, b) KVG_CAT2(a, b)
#define KVG_NAME(name) KVG_CAT(name, KVG_SUFFIX)

typedef float v16sf __attribute__((vector_size(64)));
typedef float v8sf __attribute__((vector_size(32)));
typedef float v4sf __attribute__((vector_size(16)));
typedef int32_t v16si __attribute__((vector_size(64)));
_Static_assert(sizeof(v16sf) == KVG_LANE_FLOATS * sizeof(float), "a lane is a vector of floats");
_Static_assert(sizeof(XXH128_canonical_t) == KVG_CHECKSUM_BYTES, "a checksum is an xxh3-128");

static inline v16sf KVG_NAME(load)(const float *p) {
    v16sf v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline v16sf KVG_NAME(splat)(float x) {
    return (v16sf){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x};
}

static inline float KVG_NAME(sum16)(v16sf v) {
    v8sf a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
             __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
    v4sf b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
    return (b[0] + b[2]) + (b[1] + b[3]);
}

/* exp(x) for x <= 0 (scores minus their max), about 1 ulp: x = n ln2 + r, |r| <= ln2/2,
 * exp(r) by the Cephes polynomial, 2^n built in the exponent bits. */
static inline v16sf KVG_NAME(exp16)(v16sf x) {
    const v16sf lowest = KVG_NAME(splat)(-87.0f); /* 2^n stays a normal float */
    v16si below = x < lowest;
    x = (v16sf)((below & (v16si)lowest) | (~below & (v16si)x));
    const v16sf shifter = KVG_NAME(splat)(12582912.0f); /* 1.5 * 2^23: rounds to nearest */
    v16sf n = (x * KVG_NAME(splat)(1.44269504088896341f) + shifter) - shifter;
    v16sf r = x - n * KVG_NAME(splat)(0.693359375f);
    r = r - n * KVG_NAME(splat)(-2.12194440e-4f);
    v16sf p = KVG_NAME(splat)(1.9875691500e-4f);
    p = p * r + KVG_NAME(splat)(1.3981999507e-3f);
    p = p * r + KVG_NAME(splat)(8.3334519073e-3f);
    p = p * r + KVG_NAME(splat)(4.1665795894e-2f);
    p = p * r + KVG_NAME(splat)(1.6666665459e-1f);
    p = p * r + KVG_NAME(splat)(5.0000001201e-1f);
    p = p * (r * r) + r + KVG_NAME(splat)(1.0f);
    v16si bits = (__builtin_convertvector(n, v16si) + 127) << 23;
    return p * (v16sf)bits;
}

/* Lanes of a and b summed pairwise, keeping `width` lanes of each: one level of the tree that
 * turns 16 vectors into one vector of their 16 sums. */
static inline v16sf KVG_NAME(level8)(v16sf a, v16sf b) {
    return __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30,
                                   31);
}
static inline v16sf KVG_NAME(level4)(v16sf a, v16sf b) {
    return __builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30,
                                   31);
}
static inline v16sf KVG_NAME(level2)(v16sf a, v16sf b) {
    return __builtin_shufflevector(a, b, 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
           __builtin_shufflevector(a, b, 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30,
                                   31);
}
static inline v16sf KVG_NAME(level1)(v16sf a, v16sf b) {
    return __builtin_shufflevector(a, b, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28,
                                   30) +
           __builtin_shufflevector(a, b, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

static inline v16sf KVG_NAME(vmax)(v16sf a, v16sf b) {
    v16si greater = a > b;
    return (v16sf)((greater & (v16si)a) | (~greater & (v16si)b));
}

/* scores of tokens [j0, j1) of one head: s[r][j] = q[r] . k_j, and their running max (16
 * lanes; a tail of fewer than 16 tokens is padded with -inf) */
/* the 16 lanes of q[r] * k_j summed lane-wise over the row: one vector per token */
static inline __attribute__((always_inline)) v16sf KVG_NAME(dot)(
    const v16sf *q, const float *row, int lanes) {
    v16sf acc = q[0] * KVG_NAME(load)(row);
    for (int l = 1; l < lanes; l++) acc += q[l] * KVG_NAME(load)(row + 16 * l);
    return acc;
}

/* scores of 16 tokens from row `first` (rows past `n` repeat the first: their lanes are
 * dropped later), reduced level by level as they are made, so few registers are live */
static inline __attribute__((always_inline)) v16sf KVG_NAME(scores16)(
    const v16sf *q, const float *first, int lanes, int D, int n) {
    v16sf halves[2];
    for (int half = 0; half < 2; half++) {
        v16sf quarters[2];
        for (int quarter = 0; quarter < 2; quarter++) {
            v16sf pairs[2];
            for (int pair = 0; pair < 2; pair++) {
                int t = 8 * half + 4 * quarter + 2 * pair;
                const float *a = first + (int64_t)(t < n ? t : 0) * D;
                const float *b = first + (int64_t)(t + 1 < n ? t + 1 : 0) * D;
                pairs[pair] = KVG_NAME(level8)(KVG_NAME(dot)(q, a, lanes), KVG_NAME(dot)(q, b, lanes));
            }
            quarters[quarter] = KVG_NAME(level4)(pairs[0], pairs[1]);
        }
        halves[half] = KVG_NAME(level2)(quarters[0], quarters[1]);
    }
    return KVG_NAME(level1)(halves[0], halves[1]);
}

/* scores of tokens [j0, j1) of one head: s[r][j] = q[r] . k_j, and their running max per
 * lane (a tail of fewer than 16 tokens counts as -inf) */
static inline __attribute__((always_inline)) void KVG_NAME(scores)(
    const v16sf *q, const float *k, int R, int lanes, int D, int j0, int j1, int T,
    float *scores, v16sf *max) {
    for (int r = 0; r < R; r++) {
        for (int j = j0; j < j1; j += 16) {
            int n = j1 - j < 16 ? j1 - j : 16;
            v16sf s = KVG_NAME(scores16)(q + r * lanes, k + (int64_t)j * D, lanes, D, n);
            if (n < 16) {
                v16si live = (v16si){0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15} < n;
                s = (v16sf)((live & (v16si)s) | (~live & (v16si)KVG_NAME(splat)(-INFINITY)));
                memcpy(scores + (int64_t)r * T + j, &s, (size_t)n * sizeof(float));
            } else {
                memcpy(scores + (int64_t)r * T + j, &s, sizeof s);
            }
            max[r] = KVG_NAME(vmax)(max[r], s);
        }
    }
}

/* acc[r] += sum over tokens [j0, j1) of w[r][j] v_j, one token after the other */
static inline __attribute__((always_inline)) void KVG_NAME(values)(
    const float *w, const float *v, int R, int lanes, int D, int j0, int j1, int T, v16sf *acc) {
    for (int j = j0; j < j1; j++) {
        v16sf vv[KVG_MAX_LANES];
        for (int l = 0; l < lanes; l++) vv[l] = KVG_NAME(load)(v + (int64_t)j * D + 16 * l);
        for (int r = 0; r < R; r++) {
            v16sf weight = KVG_NAME(splat)(w[(int64_t)r * T + j]);
            for (int l = 0; l < lanes; l++) acc[r * lanes + l] += weight * vv[l];
        }
    }
}

/* weights in place of the scores, and their sums (16 lanes, then one fixed tree) */
static inline __attribute__((always_inline)) void KVG_NAME(weights)(
    float *s, int T, float max, float *sum) {
    v16sf total = KVG_NAME(splat)(0.0f), top = KVG_NAME(splat)(max);
    int j = 0;
    for (; j + 16 <= T; j += 16) {
        v16sf w = KVG_NAME(exp16)(KVG_NAME(load)(s + j) - top);
        memcpy(s + j, &w, sizeof w);
        total += w;
    }
    if (j < T) { /* the tail, padded with weights of 0 */
        v16sf tail = KVG_NAME(splat)(-INFINITY);
        memcpy(&tail, s + j, (size_t)(T - j) * sizeof(float));
        v16sf w = KVG_NAME(exp16)(tail - top);
        v16si live = (v16si){0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15} < (T - j);
        w = (v16sf)((v16si)w & live);
        memcpy(s + j, &w, (size_t)(T - j) * sizeof(float));
        total += w;
    }
    *sum = KVG_NAME(sum16)(total);
}

static inline __attribute__((always_inline)) int KVG_NAME(partial_shaped)(
    const float *q, const float *k, const float *v, int64_t head_stride, int H, int R, int D,
    int T, float *scores, float *out_max, float *out_sum, float *out_acc,
    const uint8_t *expected) {
    const int lanes = D / 16;
    XXH3_state_t state;
    if (expected) XXH3_128bits_reset(&state);
    for (int h = 0; h < H; h++) { /* K of every head, in page order */
        v16sf qv[KVG_MAX_ROWS * KVG_MAX_LANES];
        for (int i = 0; i < R * lanes; i++) qv[i] = KVG_NAME(load)(q + ((int64_t)h * R * D) + 16 * i);
        const float *kh = k + h * head_stride;
        float *sh = scores + (int64_t)h * R * T, *max = out_max + h * R;
        v16sf lane_max[KVG_MAX_ROWS];
        for (int r = 0; r < R; r++) lane_max[r] = KVG_NAME(splat)(-INFINITY);
        for (int j0 = 0; j0 < T; j0 += KVG_CHUNK_TOKENS) {
            int j1 = j0 + KVG_CHUNK_TOKENS < T ? j0 + KVG_CHUNK_TOKENS : T;
            if (expected)
                XXH3_128bits_update(&state, kh + (int64_t)j0 * D, (size_t)(j1 - j0) * D * 4);
            KVG_NAME(scores)(qv, kh, R, lanes, D, j0, j1, T, sh, lane_max);
        }
        for (int r = 0; r < R; r++) {
            float m = -INFINITY;
            for (int i = 0; i < 16; i++) m = lane_max[r][i] > m ? lane_max[r][i] : m;
            max[r] = m;
        }
        for (int r = 0; r < R; r++)
            KVG_NAME(weights)(sh + (int64_t)r * T, T, max[r], out_sum + h * R + r);
    }
    for (int h = 0; h < H; h++) { /* then V of every head */
        v16sf acc[KVG_MAX_ROWS * KVG_MAX_LANES];
        for (int i = 0; i < R * lanes; i++) acc[i] = KVG_NAME(splat)(0.0f);
        const float *vh = v + h * head_stride;
        for (int j0 = 0; j0 < T; j0 += KVG_CHUNK_TOKENS) {
            int j1 = j0 + KVG_CHUNK_TOKENS < T ? j0 + KVG_CHUNK_TOKENS : T;
            if (expected)
                XXH3_128bits_update(&state, vh + (int64_t)j0 * D, (size_t)(j1 - j0) * D * 4);
            KVG_NAME(values)(scores + (int64_t)h * R * T, vh, R, lanes, D, j0, j1, T, acc);
        }
        memcpy(out_acc + (int64_t)h * R * D, acc, (size_t)R * D * sizeof(float));
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
    int G, const int32_t *Ts, int32_t most, float *scores, float *out_max, float *out_sum,
    float *out_acc) {
    const int lanes = D / 16;
    const int64_t rows = (int64_t)H * R;
    for (int h = 0; h < H; h++) {
        const float *kh = k + h * head_stride, *vh = v + h * head_stride;
        v16sf lane_max[KVG_TILE_TOKENS * KVG_MAX_ROWS];
        for (int i = 0; i < G * R; i++) lane_max[i] = KVG_NAME(splat)(-INFINITY);
        for (int j0 = 0; j0 < most; j0 += KVG_CHUNK_TOKENS) { /* the scores, chunk by chunk */
            const int j1 = j0 + KVG_CHUNK_TOKENS < most ? j0 + KVG_CHUNK_TOKENS : most;
            for (int g = 0; g < G; g++) {
                if (Ts[g] <= j0) continue;
                v16sf qv[KVG_MAX_ROWS * KVG_MAX_LANES];
                const float *qg = q + g * rows * D + (int64_t)h * R * D;
                for (int i = 0; i < R * lanes; i++) qv[i] = KVG_NAME(load)(qg + 16 * i);
                KVG_NAME(scores)(qv, kh, R, lanes, D, j0, j1 < Ts[g] ? j1 : Ts[g], Ts[g],
                                 scores + (int64_t)g * R * most, lane_max + g * R);
            }
        }
        for (int g = 0; g < G; g++) { /* the weights, row by row */
            float *max = out_max + g * rows + h * R, *sum = out_sum + g * rows + h * R;
            for (int r = 0; r < R; r++) {
                float m = -INFINITY;
                for (int i = 0; i < 16; i++) m = lane_max[g * R + r][i] > m ? lane_max[g * R + r][i] : m;
                max[r] = m;
                KVG_NAME(weights)(scores + (int64_t)g * R * most + (int64_t)r * Ts[g], Ts[g], m, sum + r);
            }
            float *acc = out_acc + (g * rows + (int64_t)h * R) * D;
            memset(acc, 0, sizeof(float) * (size_t)(R * D));
        }
        for (int j0 = 0; j0 < most; j0 += KVG_CHUNK_TOKENS) { /* the values, chunk by chunk */
            const int j1 = j0 + KVG_CHUNK_TOKENS < most ? j0 + KVG_CHUNK_TOKENS : most;
            for (int g = 0; g < G; g++) {
                if (Ts[g] <= j0) continue;
                float *acc_g = out_acc + (g * rows + (int64_t)h * R) * D;
                v16sf acc[KVG_MAX_ROWS * KVG_MAX_LANES];
                memcpy(acc, acc_g, sizeof(float) * (size_t)(R * D));
                KVG_NAME(values)(scores + (int64_t)g * R * most, vh, R, lanes, D, j0,
                                 j1 < Ts[g] ? j1 : Ts[g], Ts[g], acc);
                memcpy(acc_g, acc, sizeof(float) * (size_t)(R * D));
            }
        }
    }
}

int KVG_CAT(kvg_tile_partial, KVG_SUFFIX)(
    const float *q, const float *k, const float *v, int64_t head_stride, int32_t H, int32_t R,
    int32_t D, int32_t G, const int32_t *Ts, float *scores, float *out_max, float *out_sum,
    float *out_acc, const uint8_t *expected) {
    if (D % KVG_LANE_FLOATS || D <= 0 || D > KVG_LANE_FLOATS * KVG_MAX_LANES || R < 1 ||
        R > KVG_MAX_ROWS || H < 1 || G < 1 || G > KVG_TILE_TOKENS)
        return KVG_BAD_ARGS;
    int32_t most = 0;
    for (int g = 0; g < G; g++) {
        if (Ts[g] < 1) return KVG_BAD_ARGS;
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
        KVG_NAME(tile_shaped)(q, k, v, head_stride, H, 3, 64, G, Ts, most, scores, out_max,
                              out_sum, out_acc);
    else if (R == 2 && D == 16)
        KVG_NAME(tile_shaped)(q, k, v, head_stride, H, 2, 16, G, Ts, most, scores, out_max,
                              out_sum, out_acc);
    else
        KVG_NAME(tile_shaped)(q, k, v, head_stride, H, R, D, G, Ts, most, scores, out_max,
                              out_sum, out_acc);
    return 0;
}
