/* cpu.h: what the CPU kvcd's fast paths run on can do, detected once per process, at start.
 *
 * Owns: the one copy of the answer (struct cpu_features) that every fast path of the kernels and
 * the engine reads, and the detector that fills it (kernels/cpu.c).
 *
 * The detector executes CPUID and XGETBV. On a virtual machine each CPUID traps to the hypervisor
 * (about 7 us on the shared machines), and when the engine asked it for every matrix product (211
 * a token) it cost 15% of decode (issue 29). So it runs once: from a constructor of cpu.c before
 * main, or, if something asks before that constructor ran, on that first call. After that the
 * accessors below are a load of a global and a branch that is never taken. cpu_detect_count says
 * how many times the detector ran (always 1 after start); tests/unit/test_qtype.c asserts that a
 * decode step of the engine and the products do not raise it. It is compiled in every build (one
 * increment per process costs nothing), so the test runs wherever `make test` does.
 *
 * What is detected, and why by hand: F16C and AVX-512 are read from CPUID leaves 1 and 7 and the
 * OS's saved state from XGETBV, because clang 14's __builtin_cpu_supports (the fuzz targets are
 * built with clang) knows neither "f16c" nor "avx512vnni". Rejected: a detector call per product
 * cached by each caller (attention.c had its own static, matmul.c had none, which is how the
 * regression came in); an init function each program must call (a library user would forget it).
 */
#pragma once

#include <stdbool.h>

struct cpu_features {
        bool detected;
        bool avx2_f16c;   /* AVX2 and F16C, YMM state enabled by the OS */
        bool avx512;      /* AVX-512 F, BW, VL and DQ, ZMM and opmask state enabled by the OS */
        bool avx512_vnni; /* avx512 and AVX-512 VNNI (vpdpbusd) */
};

extern struct cpu_features cpu_features_detected;

/* Runs the detector (CPUID, XGETBV) and fills cpu_features_detected. Idempotent. */
void cpu_detect(void);

/* How many times cpu_detect ran in this process. */
unsigned long cpu_detect_count(void);

/* The features of this CPU, detected once (off x86: all false). */
static inline const struct cpu_features *cpu_features(void) {
        if (__builtin_expect(!__atomic_load_n(&cpu_features_detected.detected, __ATOMIC_ACQUIRE), 0))
                cpu_detect();
        return &cpu_features_detected;
}

/* 1 when the CPU has AVX2 and F16C (and the OS enabled AVX), else 0 (always 0 off x86). */
static inline int cpu_has_avx2_f16c(void) {
        return cpu_features()->avx2_f16c;
}
