/*
 * A decoder layer's work between its attentions, one call each (loaded with ctypes by
 * kvgraftd.engine.model.layer_kernels): the sequence of products (kvg_linear_parallel, best
 * build) and row-wise operations (rowwise.c) that the row-invariant forward made one
 * Python call at a time, made here in the same order on the same bytes, so every output
 * has the bits it had, without the interpreter's microseconds between the calls (a
 * decode step made about 270 of them).
 *
 * kvg_layer_qkv(format, normed, rows, dim, packed, n, cos, sin, heads, head_dim, qkv,
 *   threads): qkv [rows][n] = normed [rows][dim] times the packed q, k and v weights
 *   (n columns), then the first `heads` heads of each row (the queries' and the keys')
 *   rotated in place by the table cos/sin [rows][head_dim / 2] (kvg_rope).
 * kvg_layer_mlp(attended, rows, width, hidden, dim, w, post_norm, gate_up_inter, eps,
 *   next_norm, normed, threads): the attention's output product, the residual add and
 *   RMS norm, the gated MLP and its residual add, then the next norm:
 *     o = attended [rows][width] x out^T              (w[0]: format, w[1]: packed out)
 *     h = hidden += o; x = rmsnorm(h) * post_norm
 *     a = silu(x gate^T) * (x up^T)                   (w[2], w[3]: gate and up, 2 * inter)
 *     hidden += a down^T; normed = rmsnorm(hidden) * next_norm   (w[4], w[5]: down)
 *   hidden [rows][dim] is updated in place, as the residual stream is.
 * Both return 0, -1 when memory runs out, or kvg_linear_parallel's failure.
 */
#include <stdint.h>
#include <stdlib.h>

int kvg_linear_parallel(int build, int format, const float *x, int64_t M, int64_t K,
                        int64_t ldx, const void *packed, int64_t N, float *y, int64_t ldy,
                        int threads);
void kvg_add_rmsnorm(float *hidden, const float *delta, const float *weight, int64_t rows,
                     int64_t dim, float eps, float *out);
void kvg_rope(float *x, int64_t rows, int64_t row_stride, int64_t heads, int64_t dim,
              const float *cos, const float *sin);
void kvg_silu_mul(const float *gate_up, int64_t rows, int64_t width, float *out);

#define BEST_BUILD 0

static int product(int format, const float *x, int64_t rows, int64_t k, const void *packed,
                   int64_t n, float *y, int threads) {
    return kvg_linear_parallel(BEST_BUILD, format, x, rows, k, k, packed, n, y, n, threads);
}

int kvg_layer_qkv(int format, const float *normed, int64_t rows, int64_t dim, const void *packed,
                  int64_t n, const float *cos, const float *sin, int64_t heads, int64_t head_dim,
                  float *qkv, int threads) {
    const int status = product(format, normed, rows, dim, packed, n, qkv, threads);
    if (!status) kvg_rope(qkv, rows, n, heads, head_dim, cos, sin);
    return status;
}

int kvg_layer_mlp(const float *attended, int64_t rows, int64_t width, float *hidden, int64_t dim,
                  const int64_t *w, const float *post_norm, int64_t inter, float eps,
                  const float *next_norm, float *normed, int threads) {
    float *delta = malloc(sizeof(float) * (size_t)(rows * dim));
    float *x = malloc(sizeof(float) * (size_t)(rows * dim));
    float *gate_up = malloc(sizeof(float) * (size_t)(rows * 2 * inter));
    float *act = malloc(sizeof(float) * (size_t)(rows * inter));
    int status = delta && x && gate_up && act ? 0 : -1;
    if (!status) status = product((int)w[0], attended, rows, width, (const void *)w[1], dim, delta,
                                  threads);
    if (!status) {
        kvg_add_rmsnorm(hidden, delta, post_norm, rows, dim, eps, x);
        status = product((int)w[2], x, rows, dim, (const void *)w[3], 2 * inter, gate_up, threads);
    }
    if (!status) {
        kvg_silu_mul(gate_up, rows, inter, act);
        status = product((int)w[4], act, rows, inter, (const void *)w[5], dim, delta, threads);
    }
    if (!status) kvg_add_rmsnorm(hidden, delta, next_norm, rows, dim, eps, normed);
    free(delta);
    free(x);
    free(gate_up);
    free(act);
    return status;
}
