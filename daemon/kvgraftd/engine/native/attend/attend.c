/*
 * kvgraftd's native decode-step attention (loaded with ctypes by
 * kvgraftd.engine.model.decode_attention): the portable build of the kernel, the AVX2 and
 * AVX-512 ones where the CPU has them, and the merge of per-block partial results. Every
 * build gives the portable build's bits: the kernel's operations are IEEE operations in a
 * written order (FMAs where its contract says so, nothing else fused: -ffp-contract=off),
 * so the wider vector changes the speed only. Its exp is its own (attend_kernel.h's exp8), so
 * the attention's bits depend on no C library's transcendental functions (the portable build
 * calls fmaf, which IEEE 754 defines to the bit; glibc's and musl's are exact, and slow where
 * the CPU has no FMA).
 *
 * kvg_block_partial: see attend_kernel.h.
 * kvg_blocks_partial(n, q, blocks, checksums, checked, H, R, D, scores, out_max, out_sum,
 *   out_acc, failed): kvg_block_partial over n blocks in one call. Block i is
 *   blocks[4i..4i+3] = {address of K, address of V, head_stride, tokens}; it is
 *   checked against checksums[16i..16i+15] where checked[i] is nonzero. Its
 *   partial goes to out_max + i*H*R, out_sum + i*H*R, out_acc + i*H*R*D; scores
 *   holds H*R*(the most tokens of a block) floats. Stops at the first block that
 *   does not return 0: its index goes to *failed and its status is returned.
 * kvg_blocks_partial_guarded(same arguments): kvg_blocks_partial where the checked
 *   blocks are stored pages read where they lie, in a mapping of their segment file (K,
 *   then V of the same length: the page is [K, V + (V - K))): each is read under the
 *   store's fault guard (kvg_attend_set_fault_guard), so a page whose file was cut short
 *   or cannot be read returns KVG_FAULTED with its index in *failed instead of ending the
 *   process with SIGBUS. KVG_BAD_ARGS where no guard was set.
 * kvg_rows_partial_guarded(same arguments as kvg_rows_partial): the same for a pass's
 *   rows (KVG_FAULTED with *failed naming the block whose page faulted).
 * kvg_attend_set_fault_guard(arm, disarm): the guard (kvgraftd.store._mapped_pages's
 *   kvg_fault_guard_arm and kvg_fault_guard_disarm), set once when the library loads.
 * kvg_merge(rows, D, max, sum, acc, pmax, psum, pacc): folds one block's
 *   partial into the running state (the online softmax), row by row:
 *   m = pmax > max ? pmax : max; o = exp8(max - m) (0 where max = -inf: a state that holds
 *   nothing yet), p = exp8(pmax - m); sum = sum * o + psum * p, acc = acc * o + pacc * p
 *   lane by lane (each product and sum rounded once).
 * kvg_merge_blocks(n, rows, D, max, sum, acc, pmax, psum, pacc): kvg_merge of n
 *   partials laid out as kvg_blocks_partial writes them, in index order.
 * kvg_rows_partial(n, q, blocks, first, count, t0, t1, window, cap, checksums, checked, H,
 *   R, D, scores, out_max, out_sum, out_acc, used, failed): the partials of tokens [t0, t1) of
 *   `count` query tokens (a tile of up to KVG_TILE_TOKENS of them a call of the kernel's
 *   tile_partial; scores holds KVG_TILE_TOKENS * R * (the most tokens of a block)) at
 *   positions first, first + 1, ... (q: [count][H][R][D]) over n blocks, each token's
 *   exactly the one a decode step at its position computes: block i is
 *   blocks[5i..5i+4] = {K, V, head_stride, tokens, first position}, and token t sees
 *   its first min(tokens, first + t + 1 - block's first position) keys, less those before
 *   its sliding window where `window` is not 0 (the keys at positions p - window + 1 .. p
 *   of a token at p: tile_partial's Los), scores soft-capped at `cap` (0: not).
 *   used[i*count + t] says whether it saw any (a token before the block, or past it by a
 *   window, has no partial there). Partial
 *   (i, t) goes to out_max + (i*count + t)*H*R, ... A checked block (a whole stored
 *   page, before every token) is hashed once, with the first tile that sees it (one no token
 *   sees, past every token's window, is neither read nor hashed). Calls for disjoint
 *   token ranges may run at once (each with its own scores).
 * kvg_rows_merge(n, count, rows, D, max, sum, acc, pmax, psum, pacc, used): kvg_merge of
 *   each token's partials in block order, into its state (max + t*rows, ...).
 * kvg_decode_live(q, k, v, head_stride, H, R, D, total, block, scaling, window, cap, out):
 *   a whole decode step over positions [0, total) that one buffer holds (head h, position
 *   j at k + h * head_stride + j * D; v the same): q ([H][R][D], unscaled) times
 *   `scaling`, kvg_block_partial of each block of `block` positions, kvg_merge of them in
 *   order from an empty state, out [H][R][D] = acc / sum. The bits of those calls made
 *   one by one (what the blocks' own path does), without a round trip each. With a
 *   sliding `window` or a soft `cap` (0: none), each block a tile of this one token
 *   (tile_partial with the keys before the window left out), from the block where the
 *   window starts: what kvg_rows_partial and kvg_rows_merge do for a pass of one token.
 *   Returns 0, or the first failing status (KVG_BAD_ARGS; -1 when memory runs out).
 * kvg_kernel_name(): which build the calls run ("avx512", "avx2", "generic").
 * kvg_attend_builds(): a bit per build this CPU runs (1 << 1 generic, 1 << 2 avx2,
 *   1 << 3 avx512: linear_formats.h's numbering); each is exported as
 *   kvg_block_partial_NAME, kvg_tile_partial_NAME and kvg_merge_NAME.
 * kvg_decode_live_rows(n, layer, layers, qkv, qkv_stride, H, R, D, keys, values, head_strides,
 *   positions, rows, block, scaling, window, cap, out, out_stride, h0, h1): the decode steps
 *   of n contexts (`window` and `cap` as kvg_decode_live takes them)
 *   in one call, for the KV heads [h0, h1) of each (0 <= h0 < h1 <= H; the heads are
 *   independent, so calls for other heads may run at once). Context i's row of the pass is
 *   qkv + rows[i] * qkv_stride: its queries [H][R][D], then its keys [H][D] and values
 *   [H][D] (H the KV heads). The heads' K and V go to position positions[i] of its live
 *   buffers, keys[i * layers + layer] and values[...] (head h, position j at
 *   + h * head_strides[i] + j * D), then kvg_decode_live of those heads over positions
 *   [0, positions[i] + 1) writes their output to out + rows[i] * out_stride: what the
 *   context's own write and kvg_decode_live call would do, context by context.
 */
#include <math.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdlib.h>
#include <stdint.h>
#include <string.h>

#include "cpu_features.h"
#define KVG_VECTORS_GENERIC
#define KVG_SUFFIX generic
#include "attend_kernel.h"
#undef KVG_SUFFIX

typedef int (*block_partial)(const float *, const float *, const float *, int64_t, int32_t,
                             int32_t, int32_t, int32_t, float *, float *, float *, float *,
                             const uint8_t *);
typedef int (*tile_partial)(const float *, const float *, const float *, int64_t, int32_t,
                            int32_t, int32_t, int32_t, const int32_t *, const int32_t *, float,
                            float *, float *, float *, float *, const uint8_t *);
typedef void (*merge)(int32_t, int32_t, float *, float *, float *, const float *, const float *,
                      const float *);

/* the builds for x86-64 (attend_avx2.c, attend_avx512.c) */
#define KVG_DECLARE_BUILD(suffix)                                                              \
    int kvg_block_partial_##suffix(const float *, const float *, const float *, int64_t,      \
                                   int32_t, int32_t, int32_t, int32_t, float *, float *,      \
                                   float *, float *, const uint8_t *);                        \
    int kvg_tile_partial_##suffix(const float *, const float *, const float *, int64_t,       \
                                  int32_t, int32_t, int32_t, int32_t, const int32_t *,        \
                                  const int32_t *, float, float *, float *, float *, float *, \
                                  const uint8_t *);                                           \
    void kvg_merge_##suffix(int32_t, int32_t, float *, float *, float *, const float *,       \
                            const float *, const float *);
#if KVG_X86_BUILDS
KVG_DECLARE_BUILD(avx2)
KVG_DECLARE_BUILD(avx512)
#endif

/* attend.c's numbering of builds: linear_formats.h's */
enum { BUILD_GENERIC = 1, BUILD_AVX2 = 2, BUILD_AVX512 = 3 };

int kvg_attend_builds(void) {
    return 1 << BUILD_GENERIC | (kvg_cpu_has_avx2_fma() ? 1 << BUILD_AVX2 : 0) |
           (kvg_cpu_has_avx512() ? 1 << BUILD_AVX512 : 0);
}

static int best_build(void) {
    if (kvg_cpu_has_avx512()) return BUILD_AVX512;
    if (kvg_cpu_has_avx2_fma()) return BUILD_AVX2;
    return BUILD_GENERIC;
}

const char *kvg_kernel_name(void) {
    switch (best_build()) {
    case BUILD_AVX512: return "avx512";
    case BUILD_AVX2: return "avx2";
    default: return "generic";
    }
}

/* The best build's entry points, chosen once. */
static struct {
    block_partial partial;
    tile_partial tile;
    merge merge;
} best;

static void choose_best(void) {
    best.partial = kvg_block_partial_generic;
    best.tile = kvg_tile_partial_generic;
    best.merge = kvg_merge_generic;
#if KVG_X86_BUILDS
    if (best_build() == BUILD_AVX512) {
        best.partial = kvg_block_partial_avx512;
        best.tile = kvg_tile_partial_avx512;
        best.merge = kvg_merge_avx512;
    } else if (best_build() == BUILD_AVX2) {
        best.partial = kvg_block_partial_avx2;
        best.tile = kvg_tile_partial_avx2;
        best.merge = kvg_merge_avx2;
    }
#endif
}

static pthread_once_t chosen = PTHREAD_ONCE_INIT;

int kvg_block_partial(const float *q, const float *k, const float *v, int64_t head_stride,
                      int32_t H, int32_t R, int32_t D, int32_t T, float *scores, float *out_max,
                      float *out_sum, float *out_acc, const uint8_t *expected) {
    pthread_once(&chosen, choose_best);
    return best.partial(q, k, v, head_stride, H, R, D, T, scores, out_max, out_sum, out_acc, expected);
}

int kvg_blocks_partial(int32_t n, const float *q, const int64_t *blocks, const uint8_t *checksums,
                       const uint8_t *checked, int32_t H, int32_t R, int32_t D, float *scores,
                       float *out_max, float *out_sum, float *out_acc, int32_t *failed) {
    for (int32_t i = 0; i < n; i++) {
        const int64_t *block = blocks + 4 * (int64_t)i;
        if (block[3] < 1 || block[3] > INT32_MAX) {
            *failed = i;
            return KVG_BAD_ARGS;
        }
        int64_t rows = (int64_t)i * H * R;
        int status = kvg_block_partial(q, (const float *)(uintptr_t)block[0],
                                       (const float *)(uintptr_t)block[1], block[2], H, R, D,
                                       (int32_t)block[3], scores, out_max + rows, out_sum + rows,
                                       out_acc + rows * D, checked[i] ? checksums + 16 * i : NULL);
        if (status) {
            *failed = i;
            return status;
        }
    }
    return 0;
}

typedef void (*kvg_guard_arm)(sigjmp_buf *jump, const void *from, const void *to);
typedef void (*kvg_guard_disarm)(void);
static kvg_guard_arm guard_arm;
static kvg_guard_disarm guard_disarm;

void kvg_attend_set_fault_guard(kvg_guard_arm arm, kvg_guard_disarm disarm) {
    guard_arm = arm;
    guard_disarm = disarm;
}

/* One block of a batch, computed by the unguarded entry (for guarded_blocks). */
typedef int (*one_block_fn)(const void *call, int32_t i);

/* Each block of a batch by a call of its own, the guard armed over each checked block's page
 * (K, then V of the same length, as `blocks` row i of `stride` entries names them): the first
 * status that is not 0, its block in *failed; KVG_FAULTED for a page whose read faulted,
 * KVG_BAD_ARGS where no guard was set. */
static int guarded_blocks(int32_t n, const int64_t *blocks, int32_t stride,
                          const uint8_t *checked, one_block_fn one, const void *call,
                          int32_t *failed) {
    if (guard_arm == NULL || guard_disarm == NULL) {
        *failed = 0;
        return KVG_BAD_ARGS;
    }
    sigjmp_buf jump;
    volatile int32_t block = 0; /* read again after a jump back: kept in memory */
    if (sigsetjmp(jump, 1)) {   /* the guard jumped back: this block's page faulted */
        *failed = block;
        return KVG_FAULTED;
    }
    for (; block < n; block++) {
        const int32_t i = block;
        if (checked[i]) {
            const int64_t *at = blocks + (int64_t)stride * i;
            const char *keys = (const char *)(uintptr_t)at[0];
            const char *values = (const char *)(uintptr_t)at[1];
            guard_arm(&jump, keys, values + (values - keys));
        }
        int status = one(call, i);
        if (checked[i]) guard_disarm();
        if (status) {
            *failed = i;
            return status;
        }
    }
    return 0;
}

/* The arguments of a batch call of either entry, for its blocks' calls one by one. */
struct batch_call {
    const float *q;
    const int64_t *blocks;
    int64_t first, window;
    int32_t count, t0, t1, H, R, D;
    float cap;
    const uint8_t *checksums, *checked;
    float *scores, *out_max, *out_sum, *out_acc;
    uint8_t *used;
};

static int one_blocks_partial(const void *call, int32_t i) {
    const struct batch_call *c = call;
    const int64_t rows = (int64_t)i * c->H * c->R;
    int32_t ignored;
    return kvg_blocks_partial(1, c->q, c->blocks + 4 * (int64_t)i, c->checksums + 16 * (int64_t)i,
                              c->checked + i, c->H, c->R, c->D, c->scores, c->out_max + rows,
                              c->out_sum + rows, c->out_acc + rows * c->D, &ignored);
}

int kvg_blocks_partial_guarded(int32_t n, const float *q, const int64_t *blocks,
                               const uint8_t *checksums, const uint8_t *checked, int32_t H,
                               int32_t R, int32_t D, float *scores, float *out_max,
                               float *out_sum, float *out_acc, int32_t *failed) {
    const struct batch_call call = {.q = q, .blocks = blocks, .H = H, .R = R, .D = D,
                                    .checksums = checksums, .checked = checked,
                                    .scores = scores, .out_max = out_max, .out_sum = out_sum,
                                    .out_acc = out_acc};
    return guarded_blocks(n, blocks, 4, checked, one_blocks_partial, &call, failed);
}

void kvg_merge(int32_t rows, int32_t D, float *max, float *sum, float *acc, const float *pmax,
               const float *psum, const float *pacc) {
    pthread_once(&chosen, choose_best);
    best.merge(rows, D, max, sum, acc, pmax, psum, pacc);
}

void kvg_merge_blocks(int32_t n, int32_t rows, int32_t D, float *max, float *sum, float *acc,
                      const float *pmax, const float *psum, const float *pacc) {
    for (int32_t i = 0; i < n; i++)
        kvg_merge(rows, D, max, sum, acc, pmax + (int64_t)i * rows, psum + (int64_t)i * rows,
                  pacc + (int64_t)i * rows * D);
}

int kvg_rows_partial(int32_t n, const float *q, const int64_t *blocks, int64_t first,
                     int32_t count, int32_t t0, int32_t t1, int64_t window, float cap,
                     const uint8_t *checksums,
                     const uint8_t *checked, int32_t H, int32_t R, int32_t D, float *scores,
                     float *out_max, float *out_sum, float *out_acc, uint8_t *used,
                     int32_t *failed) {
    const int64_t rows = (int64_t)H * R;
    if (window < 0) return KVG_BAD_ARGS;
    pthread_once(&chosen, choose_best);
    for (int32_t i = 0; i < n; i++) {
        const int64_t *block = blocks + 5 * (int64_t)i;
        const int64_t tokens = block[3], begin = block[4];
        if (tokens < 1 || tokens > INT32_MAX || (checked[i] && begin + tokens > first + 1)) {
            *failed = i;
            return KVG_BAD_ARGS;
        }
        /* the tokens that see the block, KVG_TILE_TOKENS at a time: consecutive, as their
         * partials lie */
        int32_t t = t0, end = t1; /* [t, end): the tokens that see some of the block */
        for (; t < t1 && first + t + 1 - begin < 1; t++) used[(int64_t)i * count + t] = 0;
        while (window && end > t && first + end - window - begin >= tokens)
            used[(int64_t)i * count + --end] = 0; /* the block lies before its window */
        for (int32_t tile = t; tile < end; tile += KVG_TILE_TOKENS) {
            const int32_t G = end - tile < KVG_TILE_TOKENS ? end - tile : KVG_TILE_TOKENS;
            int32_t Ts[KVG_TILE_TOKENS], Los[KVG_TILE_TOKENS];
            for (int32_t g = 0; g < G; g++) {
                const int64_t seen = first + tile + g + 1 - begin;
                const int64_t before = window ? seen - window : 0; /* keys before the window */
                Ts[g] = (int32_t)(seen < tokens ? seen : tokens);
                Los[g] = (int32_t)(before > 0 ? before : 0);
                used[(int64_t)i * count + tile + g] = 1;
            }
            const int64_t at = (int64_t)i * count + tile;
            int status = best.tile(
                q + (int64_t)tile * rows * D, (const float *)(uintptr_t)block[0],
                (const float *)(uintptr_t)block[1], block[2], H, R, D, G, Ts, Los, cap, scores,
                out_max + at * rows, out_sum + at * rows, out_acc + at * rows * D,
                checked[i] && tile == t ? checksums + 16 * (int64_t)i : NULL);
            if (status) {
                *failed = i;
                return status;
            }
        }
    }
    return 0;
}

static int one_rows_partial(const void *call, int32_t i) { /* kvg_rows_partial's layout */
    const struct batch_call *c = call;
    const int64_t rows = (int64_t)i * c->count * c->H * c->R;
    int32_t ignored;
    return kvg_rows_partial(1, c->q, c->blocks + 5 * (int64_t)i, c->first, c->count, c->t0, c->t1,
                            c->window, c->cap, c->checksums + 16 * (int64_t)i, c->checked + i,
                            c->H, c->R, c->D, c->scores, c->out_max + rows, c->out_sum + rows,
                            c->out_acc + rows * c->D, c->used + (int64_t)i * c->count, &ignored);
}

int kvg_rows_partial_guarded(int32_t n, const float *q, const int64_t *blocks, int64_t first,
                             int32_t count, int32_t t0, int32_t t1, int64_t window, float cap,
                             const uint8_t *checksums, const uint8_t *checked, int32_t H,
                             int32_t R, int32_t D, float *scores, float *out_max, float *out_sum,
                             float *out_acc, uint8_t *used, int32_t *failed) {
    const struct batch_call call = {.q = q, .blocks = blocks, .first = first, .window = window,
                                    .count = count, .t0 = t0, .t1 = t1, .H = H, .R = R, .D = D,
                                    .cap = cap, .checksums = checksums, .checked = checked,
                                    .scores = scores, .out_max = out_max, .out_sum = out_sum,
                                    .out_acc = out_acc, .used = used};
    return guarded_blocks(n, blocks, 5, checked, one_rows_partial, &call, failed);
}

void kvg_rows_merge(int32_t n, int32_t count, int32_t rows, int32_t D, float *max, float *sum,
                    float *acc, const float *pmax, const float *psum, const float *pacc,
                    const uint8_t *used) {
    for (int32_t i = 0; i < n; i++)
        for (int32_t t = 0; t < count; t++) {
            const int64_t at = (int64_t)i * count + t;
            if (!used[at]) continue;
            kvg_merge(rows, D, max + (int64_t)t * rows, sum + (int64_t)t * rows,
                      acc + (int64_t)t * rows * D, pmax + at * rows, psum + at * rows,
                      pacc + at * rows * D);
        }
}

int kvg_decode_live(const float *q, const float *k, const float *v, int64_t head_stride,
                    int32_t H, int32_t R, int32_t D, int64_t total, int64_t block, float scaling,
                    int64_t window, float cap, float *out) {
    if (total < 1 || block < 1 || block > INT32_MAX || H < 1 || R < 1 || D < 1 || window < 0 ||
        !(cap >= 0.0f))
        return KVG_BAD_ARGS;
    pthread_once(&chosen, choose_best);
    const int tiles = window || cap != 0.0f;
    const int64_t start = window && total > window ? total - window : 0; /* the window's first */
    const int64_t rows = (int64_t)H * R, span = total < block ? total : block;
    float *scaled = malloc(sizeof(float) * (size_t)(rows * D));
    float *scores = malloc(sizeof(float) * (size_t)(rows * span));
    float *state = malloc(sizeof(float) * (size_t)(2 * rows * (D + 2)));
    int status = scaled && scores && state ? 0 : -1;
    if (!status) {
        for (int64_t i = 0; i < rows * D; i++) scaled[i] = q[i] * scaling;
        float *max = state, *sum = max + rows, *acc = sum + rows;
        float *pmax = acc + rows * D, *psum = pmax + rows, *pacc = psum + rows;
        for (int64_t r = 0; r < rows; r++) max[r] = -INFINITY, sum[r] = 0.0f;
        for (int64_t i = 0; i < rows * D; i++) acc[i] = 0.0f;
        for (int64_t begin = start / block * block; begin < total && !status; begin += block) {
            const int32_t T = (int32_t)(total - begin < block ? total - begin : block);
            const int32_t lo = (int32_t)(start > begin ? start - begin : 0);
            status = tiles ? best.tile(scaled, k + begin * D, v + begin * D, head_stride, H, R, D,
                                       1, &T, &lo, cap, scores, pmax, psum, pacc, NULL)
                           : kvg_block_partial(scaled, k + begin * D, v + begin * D, head_stride,
                                               H, R, D, T, scores, pmax, psum, pacc, NULL);
            if (!status) kvg_merge((int32_t)rows, D, max, sum, acc, pmax, psum, pacc);
        }
        for (int64_t r = 0; !status && r < rows; r++)
            for (int32_t d = 0; d < D; d++) out[r * D + d] = acc[r * D + d] / sum[r];
    }
    free(scaled);
    free(scores);
    free(state);
    return status;
}

int kvg_decode_live_rows(int32_t n, int32_t layer, int32_t layers, const float *qkv,
                         int64_t qkv_stride, int32_t H, int32_t R, int32_t D, const int64_t *keys,
                         const int64_t *values, const int64_t *head_strides,
                         const int64_t *positions, const int64_t *rows, int64_t block,
                         float scaling, int64_t window, float cap, float *out, int64_t out_stride,
                         int32_t h0, int32_t h1) {
    if (h0 < 0 || h1 > H || h0 >= h1) return KVG_BAD_ARGS;
    int status = 0;
    for (int32_t i = 0; i < n && !status; i++) {
        const float *q = qkv + rows[i] * qkv_stride, *k = q + (int64_t)H * R * D, *v = k + H * D;
        float *K = (float *)(intptr_t)keys[(int64_t)i * layers + layer];
        float *V = (float *)(intptr_t)values[(int64_t)i * layers + layer];
        const int64_t at = positions[i] * D, stride = head_strides[i];
        for (int32_t h = h0; h < h1; h++) {
            memcpy(K + h * stride + at, k + h * D, sizeof(float) * (size_t)D);
            memcpy(V + h * stride + at, v + h * D, sizeof(float) * (size_t)D);
        }
        status = kvg_decode_live(q + (int64_t)h0 * R * D, K + h0 * stride, V + h0 * stride, stride,
                                 h1 - h0, R, D, positions[i] + 1, block, scaling, window, cap,
                                 out + rows[i] * out_stride + (int64_t)h0 * R * D);
    }
    return status;
}
