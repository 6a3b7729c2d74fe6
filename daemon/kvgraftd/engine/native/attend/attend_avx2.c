/* The attention kernel for CPUs with AVX2 and FMA (chosen at run time by attend.c). */
#include "cpu_features.h"
#if KVG_X86_BUILDS
KVG_TARGET_AVX2
#define XXH_VECTOR XXH_AVX2
#define KVG_VECTORS_AVX2
#define KVG_SUFFIX avx2
#include "attend_kernel.h"
KVG_TARGET_END
#endif
