/* cpu.c: the CPU detector of cpu.h, run once per process from a constructor (or by the first
 * cpu_features() that comes before it). The fast paths never call it: they read the global.
 *
 * AVX2 counts only with F16C (every AVX2 CPU has it; the kernels convert f16 scales with it) and
 * with the YMM state enabled in XCR0; AVX-512 only with F, BW, VL and DQ (what the engine's
 * kernels use) and the opmask, ZMM upper and high-register state enabled.
 */
#include "cpu.h"

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

struct cpu_features cpu_features_detected;
static unsigned long detect_count;

#if defined(__x86_64__) || defined(__i386__)
static unsigned long long xcr0(void) {
        unsigned lo, hi;

        __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
        return ((unsigned long long)hi << 32) | lo;
}
#endif

void cpu_detect(void) {
        struct cpu_features f = { .detected = true };

#if defined(__x86_64__) || defined(__i386__)
        unsigned a, b, c, d;
        if (__get_cpuid(1, &a, &b, &c, &d) && (c & bit_OSXSAVE) && (c & bit_AVX) && (c & bit_F16C)) {
                unsigned long long x = xcr0();
                bool ymm = (x & 0x6) == 0x6, zmm = (x & 0xe6) == 0xe6;
                unsigned b7 = 0, c7 = 0;
                if (__get_cpuid_count(7, 0, &a, &b7, &c7, &d)) {
                        f.avx2_f16c = ymm && (b7 & bit_AVX2);
                        f.avx512 = f.avx2_f16c && zmm && (b7 & bit_AVX512F) && (b7 & bit_AVX512BW) &&
                                   (b7 & bit_AVX512VL) && (b7 & bit_AVX512DQ);
                        f.avx512_vnni = f.avx512 && (c7 & bit_AVX512VNNI);
                }
        }
#endif
        __atomic_add_fetch(&detect_count, 1, __ATOMIC_RELAXED);
        cpu_features_detected.avx2_f16c = f.avx2_f16c;
        cpu_features_detected.avx512 = f.avx512;
        cpu_features_detected.avx512_vnni = f.avx512_vnni;
        __atomic_store_n(&cpu_features_detected.detected, true, __ATOMIC_RELEASE);
}

unsigned long cpu_detect_count(void) {
        return __atomic_load_n(&detect_count, __ATOMIC_RELAXED);
}

__attribute__((constructor)) static void cpu_detect_at_start(void) {
        cpu_detect();
}
