/* The AVX2 + FMA build of the row-invariant linear product (see linear.c for the contract).
 * A panel of 16 columns is two registers of 8. */
#include "cpu_features.h"
#if KVG_X86_BUILDS /* the vector builds; elsewhere the portable one alone */
#include <immintrin.h>
#include <stdint.h>

#include "linear_formats.h"

KVG_TARGET_AVX2

#define LANES 8
typedef __m256 vec;
#define VZERO() _mm256_setzero_ps()
#define VLOAD(p) _mm256_loadu_ps(p)
#define VSET1(x) _mm256_set1_ps(x)
#define VFMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define VSTORE(p, v) _mm256_storeu_ps(p, v)
#define VSTORE_FIRST(p, v, n) \
    _mm256_maskstore_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32(n), \
                        _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)), v)
#define VLOAD_FIRST(p, n) \
    _mm256_maskload_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32(n), \
                       _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)))
#define VMUL(a, b) _mm256_mul_ps(a, b)
#define VADD(a, b) _mm256_add_ps(a, b)
#define VCVT(i) _mm256_cvtepi32_ps(i)
#define VBYTES(p) _mm_loadl_epi64((const __m128i *)(p))     /* a register's 8 bytes */
#define VWIDEN_U8(b) _mm256_cvtepu8_epi32(b)
#define VWIDEN_I8(b) _mm256_cvtepi8_epi32(b)
#define KVG_BUILD avx2
#include "linear_kernel.h"
KVG_TARGET_END
#endif
