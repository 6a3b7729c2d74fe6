/* A page's copy and check for CPUs with AVX-512 (chosen at run time by mapped_pages.c). */
#include "cpu_features.h"
#if KVG_X86_BUILDS
KVG_TARGET_AVX512
#include <immintrin.h>
#define XXH_VECTOR XXH_AVX512
#define KVG_SUFFIX avx512
#define KVG_STREAM_VECTOR __m512i
#define KVG_STREAM_BYTES 64
#define KVG_STREAM_LOAD _mm512_loadu_si512
#define KVG_STREAM_STORE _mm512_stream_si512
#include "mapped_copy.h"
KVG_TARGET_END
#endif
