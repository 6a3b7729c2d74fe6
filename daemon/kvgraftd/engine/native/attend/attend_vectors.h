/*
 * The vectors the attention kernel (attend_kernel.h) is written in, one definition per
 * build: v8 holds 8 floats, v16 holds 16 (two v8 halves where the CPU's registers are 8
 * wide). Every operation is an IEEE operation per lane, rounded once (v8_fma and v16_fma:
 * a * b + c rounded once), so each build computes the same bits:
 *
 *   v8_hadd(a, b)      [a0+a1, a2+a3, b0+b1, b2+b3, a4+a5, a6+a7, b4+b5, b6+b7]
 *   v8_halves(a, b)    [a0+a4, a1+a5, a2+a6, a3+a7, b0+b4, b1+b5, b2+b6, b3+b7]
 *   v8_max(a, b)       a > b ? a : b, lane by lane (b where either is NaN)
 *   v8_pow2(n)         2^n for integral n in [-126, 127], built in the exponent bits
 *   v8_abs(a)          a with its sign bit cleared
 *   v8_copysign(a, b)  a's magnitude with b's sign bit
 *   v16_fold(v)        [v0+v8, v1+v9, ..., v7+v15]
 *
 * The including file says which build with KVG_VECTORS_GENERIC (GCC vector extensions,
 * __builtin_fmaf per lane: what every CPU runs), KVG_VECTORS_AVX2 or KVG_VECTORS_AVX512
 * (intrinsics; included between KVG_TARGET_* and KVG_TARGET_END).
 */
#include <stdint.h>
#include <string.h>

#if defined(KVG_VECTORS_GENERIC)

typedef float v8 __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

static inline v8 v8_load(const float *p) {
    v8 v;
    memcpy(&v, p, sizeof v);
    return v;
}
static inline void v8_store(float *p, v8 v) { memcpy(p, &v, sizeof v); }
static inline v8 v8_splat(float x) { return (v8){x, x, x, x, x, x, x, x}; }
static inline v8 v8_add(v8 a, v8 b) { return a + b; }
static inline v8 v8_sub(v8 a, v8 b) { return a - b; }
static inline v8 v8_mul(v8 a, v8 b) { return a * b; }
static inline v8 v8_div(v8 a, v8 b) { return a / b; }
static inline v8 v8_abs(v8 a) { return (v8)((v8i)a & 0x7fffffff); }
static inline v8 v8_copysign(v8 a, v8 b) {
    return (v8)(((v8i)a & 0x7fffffff) | ((v8i)b & (int32_t)0x80000000));
}
static inline v8 v8_fma(v8 a, v8 b, v8 c) {
    v8 r;
    for (int i = 0; i < 8; i++) r[i] = __builtin_fmaf(a[i], b[i], c[i]);
    return r;
}
static inline v8 v8_max(v8 a, v8 b) {
    v8i greater = a > b;
    return (v8)((greater & (v8i)a) | (~greater & (v8i)b));
}
static inline v8 v8_pow2(v8 n) { return (v8)((__builtin_convertvector(n, v8i) + 127) << 23); }
static inline v8 v8_hadd(v8 a, v8 b) {
    return __builtin_shufflevector(a, b, 0, 2, 8, 10, 4, 6, 12, 14) +
           __builtin_shufflevector(a, b, 1, 3, 9, 11, 5, 7, 13, 15);
}
static inline v8 v8_halves(v8 a, v8 b) {
    return __builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15);
}
#elif defined(KVG_VECTORS_AVX2) || defined(KVG_VECTORS_AVX512)
#include <immintrin.h>

typedef __m256 v8;

static inline v8 v8_load(const float *p) { return _mm256_loadu_ps(p); }
static inline void v8_store(float *p, v8 v) { _mm256_storeu_ps(p, v); }
static inline v8 v8_splat(float x) { return _mm256_set1_ps(x); }
static inline v8 v8_add(v8 a, v8 b) { return _mm256_add_ps(a, b); }
static inline v8 v8_sub(v8 a, v8 b) { return _mm256_sub_ps(a, b); }
static inline v8 v8_mul(v8 a, v8 b) { return _mm256_mul_ps(a, b); }
static inline v8 v8_div(v8 a, v8 b) { return _mm256_div_ps(a, b); }
static inline v8 v8_abs(v8 a) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), a); }
static inline v8 v8_copysign(v8 a, v8 b) {
    const v8 sign = _mm256_set1_ps(-0.0f);
    return _mm256_or_ps(_mm256_andnot_ps(sign, a), _mm256_and_ps(sign, b));
}
static inline v8 v8_fma(v8 a, v8 b, v8 c) { return _mm256_fmadd_ps(a, b, c); }
static inline v8 v8_max(v8 a, v8 b) { return _mm256_max_ps(a, b); }
static inline v8 v8_pow2(v8 n) {
    __m256i exponent = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
    return _mm256_castsi256_ps(_mm256_slli_epi32(exponent, 23));
}
static inline v8 v8_hadd(v8 a, v8 b) { return _mm256_hadd_ps(a, b); }
static inline v8 v8_halves(v8 a, v8 b) {
    return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

#else
#error "say which build: KVG_VECTORS_GENERIC, KVG_VECTORS_AVX2 or KVG_VECTORS_AVX512"
#endif

#if defined(KVG_VECTORS_AVX512)
typedef __m512 v16;
static inline v16 v16_load(const float *p) { return _mm512_loadu_ps(p); }
static inline void v16_store(float *p, v16 v) { _mm512_storeu_ps(p, v); }
static inline v16 v16_splat(float x) { return _mm512_set1_ps(x); }
static inline v16 v16_add(v16 a, v16 b) { return _mm512_add_ps(a, b); }
static inline v16 v16_mul(v16 a, v16 b) { return _mm512_mul_ps(a, b); }
static inline v16 v16_fma(v16 a, v16 b, v16 c) { return _mm512_fmadd_ps(a, b, c); }
static inline v8 v16_fold(v16 v) {
    return _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
}
#else /* 16 floats as two halves (the portable and AVX2 builds) */
typedef struct {
    v8 lo, hi;
} v16;
static inline v16 v16_load(const float *p) { return (v16){v8_load(p), v8_load(p + 8)}; }
static inline void v16_store(float *p, v16 v) {
    v8_store(p, v.lo);
    v8_store(p + 8, v.hi);
}
static inline v16 v16_splat(float x) { return (v16){v8_splat(x), v8_splat(x)}; }
static inline v16 v16_add(v16 a, v16 b) { return (v16){v8_add(a.lo, b.lo), v8_add(a.hi, b.hi)}; }
static inline v16 v16_mul(v16 a, v16 b) { return (v16){v8_mul(a.lo, b.lo), v8_mul(a.hi, b.hi)}; }
static inline v16 v16_fma(v16 a, v16 b, v16 c) {
    return (v16){v8_fma(a.lo, b.lo, c.lo), v8_fma(a.hi, b.hi, c.hi)};
}
static inline v8 v16_fold(v16 v) { return v8_add(v.lo, v.hi); }
#endif
