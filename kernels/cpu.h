/* cpu.h: what the CPU kvcd's fast paths run on can do, asked once at run time.
 *
 * The AVX2 paths (matmul.c's products, attention's tiles) also convert FP16 with F16C. GCC's
 * __builtin_cpu_supports knows "f16c", clang 14's does not (the fuzz targets are built with
 * clang), so F16C is read from CPUID leaf 1 directly; AVX2 keeps the builtin, which also checks
 * that the OS saves the YMM registers.
 */
#pragma once

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

/* 1 when the CPU has AVX2 and F16C (and the OS enabled AVX), else 0 (always 0 off x86). */
static inline int cpu_has_avx2_f16c(void) {
#if defined(__x86_64__) || defined(__i386__)
        unsigned a, b, c, d;
        if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & bit_F16C))
                return 0;
        return __builtin_cpu_supports("avx2") ? 1 : 0;
#else
        return 0;
#endif
}
