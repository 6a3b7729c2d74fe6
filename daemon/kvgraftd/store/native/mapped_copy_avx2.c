/* A page's copy and check for CPUs with AVX2 (chosen at run time by mapped_pages.c). */
#include "cpu_features.h"
#if KVG_X86_BUILDS
KVG_TARGET_AVX2
#define XXH_VECTOR XXH_AVX2
#define KVG_SUFFIX avx2
#include <immintrin.h>
#define KVG_STREAM_BYTES 32
static void kvg_stream_copy(char *dest, const char *source, size_t length) {
    for (size_t at = 0; at < length; at += 32) /* length: a multiple of 32 */
        _mm256_stream_si256((__m256i *)(dest + at), _mm256_loadu_si256((const __m256i *)(source + at)));
}
#include "mapped_copy.h"
KVG_TARGET_END
#endif
