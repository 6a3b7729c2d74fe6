/* The attention kernel for CPUs with AVX-512 (chosen at run time by attend.c). */
#if defined(__x86_64__)
#pragma GCC target("avx512f,avx512dq,avx512bw,avx512vl,avx2,fma,bmi2")
#define XXH_VECTOR XXH_AVX512
#define KVG_SUFFIX avx512
#include "attend_kernel.h"
#endif
