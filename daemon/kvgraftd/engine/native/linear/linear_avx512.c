/* The AVX-512 build of the row-invariant linear product (see linear.c for the contract). */
#include "cpu_features.h"
#if KVG_X86_BUILDS /* the vector builds; elsewhere the portable one alone */
#include <immintrin.h>
#include <stdint.h>

#include "linear_formats.h"

KVG_TARGET_AVX512

#define LANES 16
typedef __m512 vec;
#define VZERO() _mm512_setzero_ps()
#define VLOAD(p) _mm512_loadu_ps(p)
#define VSET1(x) _mm512_set1_ps(x)
#define VFMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define VSTORE(p, v) _mm512_storeu_ps(p, v)
#define VSTORE_FIRST(p, v, n) _mm512_mask_storeu_ps(p, (__mmask16)((1u << (n)) - 1u), v)
#define VLOAD_FIRST(p, n) _mm512_maskz_loadu_ps((__mmask16)((1u << (n)) - 1u), p)
#define VMUL(a, b) _mm512_mul_ps(a, b)
#define VADD(a, b) _mm512_add_ps(a, b)
#define VCVT(i) _mm512_cvtepi32_ps(i)
#define VBYTES(p) _mm_loadu_si128((const __m128i *)(p))     /* a register's 16 bytes */
#define VWIDEN_U8(b) _mm512_cvtepu8_epi32(b)
#define VWIDEN_I8(b) _mm512_cvtepi8_epi32(b)
#define KVG_BUILD avx512
#include "linear_kernel.h"
KVG_TARGET_END
#endif
