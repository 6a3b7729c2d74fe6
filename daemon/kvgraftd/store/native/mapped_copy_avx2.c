/* A page's copy and check for CPUs with AVX2 (chosen at run time by mapped_pages.c). */
#include "cpu_features.h"
#if KVG_X86_BUILDS
KVG_TARGET_AVX2
#include <immintrin.h>
#define XXH_VECTOR XXH_AVX2
#define KVG_SUFFIX avx2
#define KVG_STREAM_VECTOR __m256i
#define KVG_STREAM_BYTES 32
#define KVG_STREAM_LOAD _mm256_loadu_si256
#define KVG_STREAM_STORE _mm256_stream_si256
#include "mapped_copy.h"
KVG_TARGET_END
#endif
