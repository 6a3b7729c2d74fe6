/*
 * kvgraftd's row-invariant fp32 linear product (loaded with ctypes by
 * kvgraftd.engine.model.linear): y = x W^T with x [M x K] and W [N x K], as torch's
 * F.linear without bias.
 *
 * The contract of every build: y[m][n] is one accumulator, +0.0 to start, into
 * which x[m][k] * W[n][k] is fused-multiply-added for k = 0 .. K-1 in that order
 * (fmaf's single rounding). Its bits therefore depend on row m of x and row n of W
 * alone: not on M, on how rows are blocked, on which columns a thread took, nor on
 * the build (portable fmaf, AVX2 + FMA, AVX-512), since FMA is correctly rounded.
 * NaN and inf propagate as fmaf's do (which NaN's payload survives when several
 * meet is the hardware's choice).
 *
 * kvg_linear_pack(W, N, K, packed): W into panels of 16 columns; panel p holds
 *   W[16p + j][k] at packed[(p*K + k)*16 + j], zero past column N. packed holds
 *   ceil(N/16)*K*16 floats.
 * kvg_linear(build, format, x, M, K, ldx, packed, N, p_begin, p_end, y, ldy): y's
 *   columns of panels [p_begin, p_end) for all M rows; build KVG_BUILD_BEST is the
 *   best this CPU runs (linear_formats.h names the others); format KVG_F32 (the panels
 *   above) or GGUF blocks (linear_formats.h, packed by linear_quant.c: W is then the weights
 *   they dequantize to, and the contract is unchanged). Returns 0, or -1 for a build
 *   this CPU lacks.
 * kvg_linear_parallel(build, format, x, M, K, ldx, packed, N, y, ldy, threads): all of y, the
 *   panels split in `threads` contiguous runs: the caller computes the first, the
 *   library's own workers the others (started on first use; they spin briefly for
 *   the next product, then sleep). Returns as kvg_linear. One product at a time
 *   uses the workers; a call that finds them busy computes alone (the same bits).
 * kvg_parallel(run, arg, parts): run(arg, part, parts) for every part, the caller taking
 *   part 0 and the workers (the products' pool, one for the whole library) the others;
 *   parts run on the caller alone where the workers are busy. Returns 0, or -1 when a part
 *   returned nonzero. kvg_decode_layers (layer.c) splits a step's attention with it.
 * kvg_linear_rest(): the workers sleep now instead of spinning for the next product (the
 *   caller has no product for a while: the cores are the other threads' meanwhile); the
 *   next kvg_linear_parallel wakes them.
 * kvg_linear_reference(x, M, K, W, N, y): the contract as a plain loop over the
 *   unpacked W (the tests' reference).
 * kvg_linear_builds(): a bit per build this CPU runs (1 << build; cpu_features.h asks it).
 * kvg_linear_name(build): "generic", "avx2", "avx512".
 * kvg_linear_constants: the values of linear_formats.h, by name (constants_table.h).
 */
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__)
#include <immintrin.h>
#define CPU_RELAX() _mm_pause()
#else
#define CPU_RELAX() ((void)0)
#endif

#include "constants_table.h"
#include "cpu_features.h"
#include "gguf_blocks.h"
#include "linear_formats.h"
#include "linear_int8.h"

/* Every value Python shares with this library (kvgraftd.engine.model.linear reads the table). */
const struct kvg_constant kvg_linear_constants[] = {
    {"PANEL", PANEL},
    {"QK", QK},
    {"BUILD_BEST", KVG_BUILD_BEST},
    {"BUILD_GENERIC", KVG_BUILD_GENERIC},
    {"BUILD_AVX2", KVG_BUILD_AVX2},
    {"BUILD_AVX512", KVG_BUILD_AVX512},
    {"FORMAT_F32", KVG_F32},
    {"FORMAT_Q4_1", KVG_Q4_1},
    {"FORMAT_Q8_0", KVG_Q8_0},
    {"FORMAT_Q4_1_I8", KVG_Q4_1_I8},
    {"FORMAT_Q8_0_I8", KVG_Q8_0_I8},
    {"GGUF_BLOCK_BYTES_Q4_1", GGUF_BLOCK_Q4},
    {"GGUF_BLOCK_BYTES_Q8_0", GGUF_BLOCK_Q8},
    {"PACKED_BLOCK_BYTES_Q4_1", QUANT_BLOCK_Q4},
    {"PACKED_BLOCK_BYTES_Q8_0", QUANT_BLOCK_Q8},
    {"PACKED_BLOCK_BYTES_Q4_1_I8", QUANT_BLOCK_Q4},
    {"PACKED_BLOCK_BYTES_Q8_0_I8", QUANT_BLOCK_Q8},
    /* GGUF's tensor types the engine reads (gguf_blocks.h; their block sizes:
     * kvg_gguf_block_size) */
#define GGUF_TYPE(name) {"GGUF_TYPE_" #name, GGUF_##name}
    GGUF_TYPE(F32), GGUF_TYPE(F16), GGUF_TYPE(BF16), GGUF_TYPE(Q4_0), GGUF_TYPE(Q4_1),
    GGUF_TYPE(Q5_0), GGUF_TYPE(Q5_1), GGUF_TYPE(Q8_0), GGUF_TYPE(Q2_K), GGUF_TYPE(Q3_K),
    GGUF_TYPE(Q4_K), GGUF_TYPE(Q5_K), GGUF_TYPE(Q6_K), GGUF_TYPE(IQ4_NL), GGUF_TYPE(IQ4_XS),
#undef GGUF_TYPE
    {NULL, 0},
};

void kvg_linear_avx512(int, const float *, int64_t, int64_t, int64_t, const void *, int64_t,
                       int64_t, int64_t, float *, int64_t);
void kvg_linear_avx2(int, const float *, int64_t, int64_t, int64_t, const void *, int64_t,
                     int64_t, int64_t, float *, int64_t);
void kvg_linear_quant_generic(int, const float *, int64_t, int64_t, int64_t, const uint8_t *,
                              int64_t, int64_t, int64_t, float *, int64_t);

int kvg_linear_builds(void) {
    int builds = 1 << KVG_BUILD_GENERIC;
    if (kvg_cpu_has_avx2_fma()) builds |= 1 << KVG_BUILD_AVX2;
    if (kvg_cpu_has_avx512()) builds |= 1 << KVG_BUILD_AVX512;
    return builds;
}

static int best_build(void) {
    static int best = -1;
    if (best < 0) {
        const int builds = kvg_linear_builds();
        best = builds & (1 << KVG_BUILD_AVX512) ? KVG_BUILD_AVX512
               : builds & (1 << KVG_BUILD_AVX2) ? KVG_BUILD_AVX2
                                                : KVG_BUILD_GENERIC;
    }
    return best;
}

const char *kvg_linear_name(int build) {
    switch (build == KVG_BUILD_BEST ? best_build() : build) {
        case KVG_BUILD_AVX512: return "avx512";
        case KVG_BUILD_AVX2: return "avx2";
        default: return "generic";
    }
}

void kvg_linear_pack(const float *W, int64_t N, int64_t K, float *packed) {
    const int64_t panels = (N + PANEL - 1) / PANEL;
    memset(packed, 0, (size_t)(panels * K * PANEL) * sizeof(float));
    for (int64_t n = 0; n < N; n++)
        for (int64_t k = 0; k < K; k++)
            packed[((n / PANEL) * K + k) * PANEL + n % PANEL] = W[n * K + k];
}

static void linear_generic(const float *x, int64_t M, int64_t K, int64_t ldx,
                           const float *packed, int64_t N, int64_t p_begin, int64_t p_end,
                           float *y, int64_t ldy) {
    for (int64_t p = p_begin; p < p_end; p++)
        for (int64_t m = 0; m < M; m++)
            for (int64_t j = 0; j < PANEL && p * PANEL + j < N; j++) {
                float acc = 0.0f;
                for (int64_t k = 0; k < K; k++)
                    acc = fmaf(x[m * ldx + k], packed[(p * K + k) * PANEL + j], acc);
                y[m * ldy + p * PANEL + j] = acc;
            }
}

/* `build` as it runs here (KVG_BUILD_BEST resolved), or -1 for a build this CPU lacks. */
static int runnable(int build) {
    if (build == KVG_BUILD_BEST) build = best_build();
    return kvg_linear_builds() & (1 << build) ? build : -1;
}

/* The integer products' build for `build` (AVX-512 CPUs run the AVX2 one). */
static void quantize(int build, const float *x, int64_t ldx, int64_t m_begin, int64_t m_end,
                     const struct kvg_qrows *rows) {
#if KVG_X86_BUILDS
    if (build != KVG_BUILD_GENERIC) {
        kvg_quantize_avx2(x, ldx, m_begin, m_end, rows);
        return;
    }
#endif
    kvg_quantize_generic(x, ldx, m_begin, m_end, rows);
}

static void integer_product(int build, int format, const struct kvg_qrows *rows,
                            const void *packed, int64_t N, int64_t p_begin, int64_t p_end,
                            float *y, int64_t ldy) {
#if KVG_X86_BUILDS
    if (build != KVG_BUILD_GENERIC) {
        kvg_linear_int8_avx2(format, rows, packed, N, p_begin, p_end, y, ldy);
        return;
    }
#endif
    kvg_linear_int8_generic(format, rows, packed, N, p_begin, p_end, y, ldy);
}

int kvg_quantize(int build, const float *x, int64_t M, int64_t K, int64_t ldx, int8_t *q,
                 float *d, float *s) {
    build = runnable(build);
    if (build < 0 || K % QK) return -1;
    const struct kvg_qrows rows = {q, d, s, M, K};
    quantize(build, x, ldx, 0, M, &rows);
    return 0;
}

int kvg_linear(int build, int format, const float *x, int64_t M, int64_t K, int64_t ldx,
               const void *packed, int64_t N, int64_t p_begin, int64_t p_end, float *y,
               int64_t ldy) {
    build = runnable(build);
    if (build < 0) return -1;
    if (kvg_is_integer(format)) {
        struct kvg_qrows rows;
        if (K % QK || kvg_qrows_take(&rows, M, K)) return -1;
        quantize(build, x, ldx, 0, M, &rows);
        integer_product(build, format, &rows, packed, N, p_begin, p_end, y, ldy);
        kvg_qrows_free(&rows);
        return 0;
    }
    if (K == 0) { /* an empty sum: +0.0, as every build's first accumulator */
        for (int64_t m = 0; m < M; m++)
            for (int64_t n = p_begin * PANEL; n < p_end * PANEL && n < N; n++) y[m * ldy + n] = 0.0f;
        return 0;
    }
#if KVG_X86_BUILDS
    if (build == KVG_BUILD_AVX512) {
        kvg_linear_avx512(format, x, M, K, ldx, packed, N, p_begin, p_end, y, ldy);
        return 0;
    }
    if (build == KVG_BUILD_AVX2) {
        kvg_linear_avx2(format, x, M, K, ldx, packed, N, p_begin, p_end, y, ldy);
        return 0;
    }
#endif
    if (format == KVG_F32)
        linear_generic(x, M, K, ldx, packed, N, p_begin, p_end, y, ldy);
    else
        kvg_linear_quant_generic(format, x, M, K, ldx, packed, N, p_begin, p_end, y, ldy);
    return 0;
}

void kvg_linear_reference(const float *x, int64_t M, int64_t K, const float *W, int64_t N,
                          float *y) {
    for (int64_t m = 0; m < M; m++)
        for (int64_t n = 0; n < N; n++) {
            float acc = 0.0f;
            for (int64_t k = 0; k < K; k++) acc = fmaf(x[m * K + k], W[n * K + k], acc);
            y[m * N + n] = acc;
        }
}

/* ---- the workers: the compute pool of the products, and of whatever else splits in parts ---- */

#define MAX_WORKERS 63
#define SPIN_ROUNDS 50000 /* pauses (~1-5 ms) a worker waits for the next task, then sleeps */

struct task {
    int (*run)(const void *arg, int part, int parts); /* nonzero: the part failed */
    const void *arg;
    int parts;
};

static struct task job;
static atomic_uint generation;  /* bumped for each task handed to the workers */
static atomic_int unfinished;   /* parts the workers have yet to finish */
static atomic_int status;       /* nonzero when a part failed */
static atomic_int resting;      /* the workers sleep instead of spinning (kvg_linear_rest) */
static int workers;             /* started so far */
static pthread_mutex_t pool_lock = PTHREAD_MUTEX_INITIALIZER;   /* one task at a time */
static pthread_mutex_t sleep_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t wake = PTHREAD_COND_INITIALIZER;

static void run_part(const struct task *t, int part) {
    if (t->run(t->arg, part, t->parts)) atomic_store(&status, 1);
}

static void *worker(void *arg) {
    /* the part it computes is index + 1; `seen` is the generation before it started, so a
     * task handed out while the thread was starting is not missed */
    const int index = (int)((uintptr_t)arg & 0xff);
    unsigned seen = (unsigned)((uintptr_t)arg >> 8);
    for (;;) {
        unsigned now;
        int spins = 0;
        while ((now = atomic_load_explicit(&generation, memory_order_acquire)) == seen) {
            if (++spins < SPIN_ROUNDS && !atomic_load_explicit(&resting, memory_order_relaxed)) {
                CPU_RELAX();
                continue;
            }
            pthread_mutex_lock(&sleep_lock);
            while ((now = atomic_load(&generation)) == seen) pthread_cond_wait(&wake, &sleep_lock);
            pthread_mutex_unlock(&sleep_lock);
            break;
        }
        seen = now;
        const struct task t = job;
        if (index + 1 < t.parts) run_part(&t, index + 1);
        /* every worker acknowledges every task, part or none: the caller hands out the
         * next one (and overwrites `job`) only once all of them are done with this one */
        atomic_fetch_sub_explicit(&unfinished, 1, memory_order_release);
    }
    return NULL;
}

static int start_workers(int wanted) {
    while (workers < wanted) {
        pthread_t thread;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        const uintptr_t arg = ((uintptr_t)atomic_load(&generation) << 8) | (uintptr_t)workers;
        const int failed = pthread_create(&thread, &attr, worker, (void *)arg);
        pthread_attr_destroy(&attr);
        if (failed) break;
        workers++;
    }
    return workers;
}

void kvg_linear_rest(void) { atomic_store(&resting, 1); }

int kvg_parallel(int (*run)(const void *arg, int part, int parts), const void *arg, int parts) {
    if (parts > MAX_WORKERS + 1) parts = MAX_WORKERS + 1;
    if (parts <= 1 || pthread_mutex_trylock(&pool_lock) != 0) {
        int failed = 0;
        for (int part = 0; part < parts; part++) failed |= run(arg, part, parts);
        return failed ? -1 : 0;
    }
    if (start_workers(parts - 1) + 1 < parts) parts = workers + 1; /* as many as started */
    job = (struct task){run, arg, parts};
    atomic_store(&status, 0);
    /* every worker wakes for every task; those past the parts only acknowledge */
    atomic_store(&unfinished, workers);
    pthread_mutex_lock(&sleep_lock);
    atomic_store(&resting, 0);
    atomic_fetch_add_explicit(&generation, 1, memory_order_release);
    pthread_cond_broadcast(&wake);
    pthread_mutex_unlock(&sleep_lock);
    run_part(&job, 0);
    while (atomic_load_explicit(&unfinished, memory_order_acquire) > 0) CPU_RELAX();
    const int failed = atomic_load(&status);
    pthread_mutex_unlock(&pool_lock);
    return failed ? -1 : 0;
}

struct product {
    int build, format;
    const float *x;
    const struct kvg_qrows *rows; /* x quantized, for the integer products */
    const void *packed;
    float *y;
    int64_t M, K, ldx, N, ldy, panels;
};

static int product_part(const void *arg, int part, int parts) {
    const struct product *p = arg;
    const int64_t begin = p->panels * part / parts, end = p->panels * (part + 1) / parts;
    if (begin >= end) return 0;
    if (p->rows) {
        integer_product(p->build, p->format, p->rows, p->packed, p->N, begin, end, p->y, p->ldy);
        return 0;
    }
    return kvg_linear(p->build, p->format, p->x, p->M, p->K, p->ldx, p->packed, p->N, begin, end,
                      p->y, p->ldy);
}

static int quantize_part(const void *arg, int part, int parts) {
    const struct product *p = arg;
    quantize(p->build, p->x, p->ldx, p->M * part / parts, p->M * (part + 1) / parts, p->rows);
    return 0;
}

int kvg_linear_parallel(int build, int format, const float *x, int64_t M, int64_t K,
                        int64_t ldx, const void *packed, int64_t N, float *y, int64_t ldy,
                        int threads) {
    const int64_t panels = (N + PANEL - 1) / PANEL;
    if (threads > panels) threads = (int)panels;
    if (threads <= 1) return kvg_linear(build, format, x, M, K, ldx, packed, N, 0, panels, y, ldy);
    if (!kvg_is_integer(format)) {
        const struct product p = {build, format, x, NULL, packed, y, M, K, ldx, N, ldy, panels};
        return kvg_parallel(product_part, &p, threads);
    }
    /* the integer products: x quantized once (its rows split between the threads), then
     * the panels split as for the float ones */
    build = runnable(build);
    if (build < 0) return -1;
    struct kvg_qrows rows;
    if (K % QK || kvg_qrows_take(&rows, M, K)) return -1;
    const struct product p = {build, format, x, &rows, packed, y, M, K, ldx, N, ldy, panels};
    int status = kvg_parallel(quantize_part, &p, M < threads ? (int)M : threads);
    if (!status) status = kvg_parallel(product_part, &p, threads);
    kvg_qrows_free(&rows);
    return status;
}
