/*
 * The instruction sets kvgraftd's native kernels are built for, and how the CPU is asked
 * which it runs: one detection and one way of compiling a build, for every kernel
 * (attend*.c, linear*.c, store/native/sha256_lanes.c).
 *
 * A build for an instruction set is a .c file of its own (attend_avx2.c, attend_avx512.c,
 * linear_avx2.c, linear_avx512.c, linear_int8_avx2.c) or a section of one (sha256_lanes.c) that opens with
 * KVG_TARGET_AVX512 or KVG_TARGET_AVX2 (closed by KVG_TARGET_END) before its kernel: every
 * function defined in between is compiled for that set, and is called only where
 * kvg_cpu_has_avx512() or kvg_cpu_has_avx2_fma() says the CPU runs it. The portable
 * build is compiled without a target; it runs everywhere.
 *
 * A build changes speed, never bits: each kernel's contract fixes its order of float
 * operations, and -ffp-contract=off (or explicit FMAs) leaves the compiler nothing to fuse
 * or reorder, whatever the target.
 */
#ifndef KVG_CPU_FEATURES_H
#define KVG_CPU_FEATURES_H

#if defined(__x86_64__) && defined(__GNUC__)
#define KVG_X86_BUILDS 1

/* AVX-512 as every such server CPU since Skylake-SP has it (F, DQ, BW, VL), with FMA and
 * BMI2; the AVX2 build needs FMA as well */
#define KVG_TARGET_AVX512                                                                  \
    _Pragma("GCC push_options")                                                            \
        _Pragma("GCC target(\"avx512f,avx512dq,avx512bw,avx512vl,avx2,fma,bmi2\")")
#define KVG_TARGET_AVX2 _Pragma("GCC push_options") _Pragma("GCC target(\"avx2,fma\")")
#define KVG_TARGET_END _Pragma("GCC pop_options")

static inline int kvg_cpu_has_avx512(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("fma") && __builtin_cpu_supports("bmi2");
}

static inline int kvg_cpu_has_avx2_fma(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

#else
#define KVG_X86_BUILDS 0
static inline int kvg_cpu_has_avx512(void) { return 0; }
static inline int kvg_cpu_has_avx2_fma(void) { return 0; }
#endif

#endif
