/*
 * A decoder layer's work between its attentions, and a whole decode step's layers, each in
 * one call (loaded with ctypes by kvgraftd.engine.model.layer_kernels): a fixed sequence of
 * products (kvg_linear_parallel, best build), bias adds and row-wise operations (rowwise.c),
 * each row's the same whatever the rows (their contracts), without the interpreter's
 * microseconds between the calls (a decode step would make about 270 of them).
 *
 * A layer is a row of LAYER_ENTRIES integers (addresses as integers; 0: the family has
 * none): {qkv format, qkv packed, out format, out packed, gate-up format, gate-up packed,
 * down format, down packed, post norm (the MLP's input norm), next norm (the next layer's
 * input norm; the last layer's is the model's final one), qkv bias, q head norm, k head
 * norm, out bias, attention-out norm, gate-up bias, down bias, MLP-out norm, sliding
 * window (0: every position), rotary table (0 or 1)}: kvg_layer_constants names each
 * column (and LAYER_ENTRIES, the activations' numbers), so Python repeats none. Norms'
 * weights are as multiplied by (Gemma's 1 + w already added); a bias is added once an
 * element after its product.
 *
 * kvg_layer_qkv(entries, normed, rows, dim, n, cos, sin, heads, kv_heads, head_dim, eps, qkv,
 *   threads): qkv [rows][n] = normed [rows][dim] times the packed q, k and v weights
 *   (n columns), plus the bias, then each query head's and each key head's RMS norm where
 *   the layer has them (kvg_add_rmsnorm over the head's values), then the first heads +
 *   kv_heads heads of each row (the queries' and the keys') rotated in place by the table
 *   cos/sin [rows][head_dim / 2] (kvg_rope).
 * kvg_layer_mlp(attended, rows, width, hidden, dim, entries, inter, eps, activation, normed,
 *   threads): the attention's output product, the residual add and RMS norm, the
 *   gated MLP and its residual add, then the next norm:
 *     o = attended [rows][width] x out^T + out bias; o = rmsnorm(o) * attention-out norm
 *     h = hidden += o; x = rmsnorm(h) * post_norm
 *     a = act(x gate^T + b) * (x up^T + b)          (act: silu, or gelu_tanh for activation 1)
 *     d = a down^T + down bias; d = rmsnorm(d) * MLP-out norm
 *     hidden += d; normed = rmsnorm(hidden) * next_norm
 *   (each step where the layer has it); hidden [rows][dim] is updated in place, as the
 *   residual stream is.
 * kvg_decode_layers(shape, layers, table, scalings, eps, cap, hidden, normed, cos, sin,
 *   attend, rows_of): every layer of a step whose rows are all decode steps over live
 *   positions (normed: layer 0's normed input; on return, the final norm's output): for each
 *   layer, kvg_layer_qkv with its rotary table (cos[t], sin[t]: addresses), then `attend`
 *   (attend.c's kvg_decode_live_rows, handed over by address) with that layer's index, its
 *   window and the scores' soft cap `cap` (0: none), its (row, KV head) pairs split between
 *   the products' threads (kvg_parallel: each head's bits are its own), then kvg_layer_mlp.
 *   shape = {rows, dim, heads, kv_heads, head_dim, inter, qkv columns, threads, activation};
 *   table [layers][LAYER_ENTRIES]; scalings [layers]; rows_of = the attend call's own
 *   arguments for the rows: {keys, values, head strides, positions, row index, block}.
 * All return 0, -1 when memory runs out, or the failing call's status.
 */
#include <stdint.h>
#include <stdlib.h>

#include "constants_table.h"
#include "linear_formats.h"

int kvg_linear_parallel(int build, int format, const float *x, int64_t M, int64_t K,
                        int64_t ldx, const void *packed, int64_t N, float *y, int64_t ldy,
                        int threads);
void kvg_add_rmsnorm(float *hidden, const float *delta, const float *weight, int64_t rows,
                     int64_t dim, float eps, float *out);
void kvg_rope(float *x, int64_t rows, int64_t row_stride, int64_t heads, int64_t dim,
              const float *cos, const float *sin);
void kvg_silu_mul(const float *gate_up, int64_t rows, int64_t width, float *out);
void kvg_gelu_tanh_mul(const float *gate_up, int64_t rows, int64_t width, float *out);
int kvg_parallel(int (*run)(const void *arg, int part, int parts), const void *arg, int parts);

typedef int (*attend_rows)(int32_t n, int32_t layer, int32_t layers, const float *qkv,
                           int64_t qkv_stride, int32_t H, int32_t R, int32_t D,
                           const int64_t *keys, const int64_t *values,
                           const int64_t *head_strides, const int64_t *positions,
                           const int64_t *rows, int64_t block, float scaling, int64_t window,
                           float cap, float *out, int64_t out_stride, int32_t h0, int32_t h1);

enum {
    LAYER_ENTRIES = 20,
    POST_NORM = 8, NEXT_NORM, QKV_BIAS, Q_NORM, K_NORM, OUT_BIAS, ATTENTION_OUT_NORM,
    GATE_UP_BIAS, DOWN_BIAS, MLP_OUT_NORM, WINDOW, ROPE_TABLE
};

enum { QKV = 0, OUT = 2, GATE_UP = 4, DOWN = 6, SILU = 0, GELU_TANH = 1 };

#define ENTRY(entries, name) ((const float *)(intptr_t)(entries)[name])

/* A layer row's columns, and the activations' numbers, for kvgraftd.engine.model.layer_kernels */
const struct kvg_constant kvg_layer_constants[] = {
    {"LAYER_ENTRIES", LAYER_ENTRIES}, {"QKV", QKV}, {"OUT", OUT}, {"GATE_UP", GATE_UP},
    {"DOWN", DOWN}, {"POST_NORM", POST_NORM}, {"NEXT_NORM", NEXT_NORM}, {"QKV_BIAS", QKV_BIAS},
    {"Q_NORM", Q_NORM}, {"K_NORM", K_NORM}, {"OUT_BIAS", OUT_BIAS},
    {"ATTENTION_OUT_NORM", ATTENTION_OUT_NORM}, {"GATE_UP_BIAS", GATE_UP_BIAS},
    {"DOWN_BIAS", DOWN_BIAS}, {"MLP_OUT_NORM", MLP_OUT_NORM}, {"WINDOW", WINDOW},
    {"ROPE_TABLE", ROPE_TABLE}, {"ACTIVATION_SILU", SILU}, {"ACTIVATION_GELU_TANH", GELU_TANH},
    {NULL, 0},
};

/* a layer's attention of a step's rows, its (row, KV head) pairs split between the pool's
 * threads, so one context's heads spread over the cores too (each head's bits are its own:
 * the split changes none) */
struct attention {
    attend_rows attend;
    int32_t rows, layer, layers, H, R, D;
    const float *qkv;
    int64_t qkv_stride, block, out_stride;
    const int64_t *keys, *values, *head_strides, *positions, *row_index;
    float scaling;
    float *out;
    int64_t window;
    float cap;
};

static int attention_part(const void *arg, int part, int parts) {
    const struct attention *a = arg;
    const int64_t pairs = (int64_t)a->rows * a->H;
    const int64_t begin = pairs * part / parts, end = pairs * (part + 1) / parts;
    int status = 0;
    for (int64_t pair = begin; pair < end && !status;) {
        const int32_t row = (int32_t)(pair / a->H), h0 = (int32_t)(pair % a->H);
        const int64_t past = end - (int64_t)row * a->H; /* the part's end, in this row's heads */
        const int32_t h1 = past < a->H ? (int32_t)past : a->H;
        const int64_t at = (int64_t)row * a->layers;
        status = a->attend(1, a->layer, a->layers, a->qkv, a->qkv_stride, a->H, a->R, a->D,
                           a->keys + at, a->values + at, a->head_strides + row,
                           a->positions + row, a->row_index + row, a->block, a->scaling,
                           a->window, a->cap, a->out, a->out_stride, h0, h1);
        pair = (int64_t)row * a->H + h1;
    }
    return status;
}

static int product(int format, const float *x, int64_t rows, int64_t k, const void *packed,
                   int64_t n, float *y, int threads) {
    return kvg_linear_parallel(KVG_BUILD_BEST, format, x, rows, k, k, packed, n, y, n, threads);
}

/* y [rows][n] += bias [n], one rounded add an element (none where bias is NULL) */
static void add_bias(float *y, int64_t rows, int64_t n, const float *bias) {
    if (!bias) return;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t i = 0; i < n; i++) y[r * n + i] = y[r * n + i] + bias[i];
}

/* x [rows][dim] = rmsnorm(x) * weight in place (none where weight is NULL) */
static void norm_in_place(float *x, int64_t rows, int64_t dim, const float *weight, float eps) {
    if (weight) kvg_add_rmsnorm(x, NULL, weight, rows, dim, eps, x);
}

int kvg_layer_qkv(const int64_t *entries, const float *normed, int64_t rows, int64_t dim,
                  int64_t n, const float *cos, const float *sin, int64_t heads, int64_t kv_heads,
                  int64_t head_dim, float eps, float *qkv, int threads) {
    const int status = product((int)entries[QKV], normed, rows, dim,
                               (const void *)(intptr_t)entries[QKV + 1], n, qkv, threads);
    if (status) return status;
    add_bias(qkv, rows, n, ENTRY(entries, QKV_BIAS));
    for (int64_t r = 0; r < rows && (entries[Q_NORM] || entries[K_NORM]); r++) { /* a head a row */
        norm_in_place(qkv + r * n, heads, head_dim, ENTRY(entries, Q_NORM), eps);
        norm_in_place(qkv + r * n + heads * head_dim, kv_heads, head_dim, ENTRY(entries, K_NORM),
                      eps);
    }
    kvg_rope(qkv, rows, n, heads + kv_heads, head_dim, cos, sin);
    return 0;
}

/* the MLP's scratch: o (or the down product), x, gate_up, act */
struct scratch {
    float *delta, *x, *gate_up, *act;
};

static int scratch_take(struct scratch *s, int64_t rows, int64_t dim, int64_t inter) {
    s->delta = malloc(sizeof(float) * (size_t)(rows * dim));
    s->x = malloc(sizeof(float) * (size_t)(rows * dim));
    s->gate_up = malloc(sizeof(float) * (size_t)(rows * 2 * inter));
    s->act = malloc(sizeof(float) * (size_t)(rows * inter));
    return s->delta && s->x && s->gate_up && s->act ? 0 : -1;
}

static void scratch_give(struct scratch *s) {
    free(s->delta);
    free(s->x);
    free(s->gate_up);
    free(s->act);
}

static int mlp(const struct scratch *s, const float *attended, int64_t rows, int64_t width,
               float *hidden, int64_t dim, const int64_t *e, int64_t inter, float eps,
               int activation, float *normed, int threads) {
    const void *weights[3] = {(const void *)(intptr_t)e[OUT + 1],
                              (const void *)(intptr_t)e[GATE_UP + 1],
                              (const void *)(intptr_t)e[DOWN + 1]};
    int status = product((int)e[OUT], attended, rows, width, weights[0], dim, s->delta, threads);
    if (!status) {
        add_bias(s->delta, rows, dim, ENTRY(e, OUT_BIAS));
        norm_in_place(s->delta, rows, dim, ENTRY(e, ATTENTION_OUT_NORM), eps);
        kvg_add_rmsnorm(hidden, s->delta, ENTRY(e, POST_NORM), rows, dim, eps, s->x);
        status = product((int)e[GATE_UP], s->x, rows, dim, weights[1], 2 * inter, s->gate_up,
                         threads);
    }
    if (!status) {
        add_bias(s->gate_up, rows, 2 * inter, ENTRY(e, GATE_UP_BIAS));
        (activation == GELU_TANH ? kvg_gelu_tanh_mul : kvg_silu_mul)(s->gate_up, rows, inter,
                                                                     s->act);
        status = product((int)e[DOWN], s->act, rows, inter, weights[2], dim, s->delta, threads);
    }
    if (!status) {
        add_bias(s->delta, rows, dim, ENTRY(e, DOWN_BIAS));
        norm_in_place(s->delta, rows, dim, ENTRY(e, MLP_OUT_NORM), eps);
        kvg_add_rmsnorm(hidden, s->delta, ENTRY(e, NEXT_NORM), rows, dim, eps, normed);
    }
    return status;
}

int kvg_layer_mlp(const float *attended, int64_t rows, int64_t width, float *hidden, int64_t dim,
                  const int64_t *entries, int64_t inter, float eps, int activation, float *normed,
                  int threads) {
    struct scratch s;
    int status = scratch_take(&s, rows, dim, inter);
    if (!status)
        status = mlp(&s, attended, rows, width, hidden, dim, entries, inter, eps, activation,
                     normed, threads);
    scratch_give(&s);
    return status;
}

int kvg_decode_layers(const int64_t *shape, int32_t layers, const int64_t *table,
                      const float *scalings, float eps, float cap, float *hidden, float *normed,
                      const int64_t *cos, const int64_t *sin, attend_rows attend,
                      const int64_t *rows_of) {
    const int64_t rows = shape[0], dim = shape[1], heads = shape[2], kv_heads = shape[3];
    const int64_t head_dim = shape[4], inter = shape[5], n = shape[6];
    const int threads = (int)shape[7], activation = (int)shape[8];
    const int64_t width = heads * head_dim;
    struct scratch s;
    float *qkv = malloc(sizeof(float) * (size_t)(rows * n));
    float *out = malloc(sizeof(float) * (size_t)(rows * width));
    int status = scratch_take(&s, rows, dim, inter) || !qkv || !out ? -1 : 0;
    for (int32_t layer = 0; layer < layers && !status; layer++) {
        const int64_t *t = table + (int64_t)layer * LAYER_ENTRIES;
        const float *layer_cos = (const float *)(intptr_t)cos[t[ROPE_TABLE]];
        const float *layer_sin = (const float *)(intptr_t)sin[t[ROPE_TABLE]];
        status = kvg_layer_qkv(t, normed, rows, dim, n, layer_cos, layer_sin, heads, kv_heads,
                               head_dim, eps, qkv, threads);
        if (!status) {
            const struct attention a = {
                attend, (int32_t)rows, layer, layers, (int32_t)kv_heads,
                (int32_t)(heads / kv_heads), (int32_t)head_dim, qkv, n, rows_of[5], width,
                (const int64_t *)(intptr_t)rows_of[0], (const int64_t *)(intptr_t)rows_of[1],
                (const int64_t *)(intptr_t)rows_of[2], (const int64_t *)(intptr_t)rows_of[3],
                (const int64_t *)(intptr_t)rows_of[4], scalings[layer], out, t[WINDOW], cap};
            const int64_t pairs = rows * kv_heads;
            status = kvg_parallel(attention_part, &a, pairs < threads ? (int)pairs : threads);
        }
        if (!status)
            status = mlp(&s, out, rows, width, hidden, dim, t, inter, eps, activation, normed,
                         threads);
    }
    scratch_give(&s);
    free(qkv);
    free(out);
    return status;
}
