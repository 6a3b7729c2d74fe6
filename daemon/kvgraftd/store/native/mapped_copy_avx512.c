/* A page's copy and check for CPUs with AVX-512 (chosen at run time by mapped_pages.c). */
#include "cpu_features.h"
#if KVG_X86_BUILDS
KVG_TARGET_AVX512
#define XXH_VECTOR XXH_AVX512
#define KVG_SUFFIX avx512
#include <immintrin.h>
#define KVG_STREAM_BYTES 64
static void kvg_stream_copy(char *dest, const char *source, size_t length) {
    for (size_t at = 0; at < length; at += 64) /* length: a multiple of 64 */
        _mm512_stream_si512((__m512i *)(dest + at), _mm512_loadu_si512((const __m512i *)(source + at)));
}
#include "mapped_copy.h"
KVG_TARGET_END
#endif
