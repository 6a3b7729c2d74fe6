/* The attention kernel for CPUs with AVX-512 (chosen at run time by attend.c). */
#include "cpu_features.h"
#if KVG_X86_BUILDS
KVG_TARGET_AVX512
#define XXH_VECTOR XXH_AVX512
#define KVG_VECTORS_AVX512
#define KVG_SUFFIX avx512
#include "attend_kernel.h"
KVG_TARGET_END
#endif
