/* common.h: what the benchmarks share: a clock, CPU pinning, statistics over samples, /proc
 * readings, and a kvcd started for one run.
 *
 * The machines the benchmarks run on are shared and noisy, so every benchmark measures its
 * baseline in the same run, interleaved with what it compares, and reports ratios; nothing here
 * asserts an absolute time. Statistics are order statistics (median, p99, best) because the noise
 * is one-sided: another process can only make a run slower.
 */
#pragma once

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

uint64_t bench_now_ns(void);

/* The CPUs this process may run on (at most max), in order; the count. */
int bench_cpus(int *ret, int max);
/* Pins pid (0: the caller) to one CPU; -errno. A cpu < 0 leaves it free. */
int bench_pin(pid_t pid, int cpu);
/* The CPUs a client and a server should use: different ones when there are two, else -1 (free). */
void bench_pick_cpus(int *ret_client, int *ret_server);

/* Sorts v[0..n) ascending and returns the q-quantile (nearest rank); NAN when n is 0. */
double bench_quantile(double *v, size_t n, double q);
double bench_mean(const double *v, size_t n);

/* A field of /proc/PID/status in KiB (VmRSS, RssAnon, RssShmem, VmHWM, ...); -1 when absent. */
long bench_status_kib(pid_t pid, const char *field);
/* User + system CPU seconds pid has used (/proc/PID/stat). */
double bench_cpu_seconds(pid_t pid);

/* A kvcd started for the run: a private runtime directory under $TMPDIR, READY=1 on a private
 * NOTIFY_SOCKET (bounded wait), pinned to cpu (< 0: free), stderr to /dev/null. */
struct bench_kvcd {
        pid_t pid;
        char root[128];
        char dir[160];
};
int bench_kvcd_start(const char *path, int cpu, struct bench_kvcd *k);
/* SIGTERM, wait (a second SIGTERM after 3 s: stop at once), remove the directory. */
void bench_kvcd_stop(struct bench_kvcd *k);

/* In a child after fork: sig when the parent dies (a failed benchmark leaves no server). */
void bench_die_with_parent(int sig);

/* A private temporary directory for the run (removed by bench_rmtree). */
int bench_tmpdir(char *buf, size_t len, const char *tag);
void bench_rmtree(const char *dir);

/* splitmix64: deterministic inputs for every benchmark. */
static inline uint64_t bench_rng(uint64_t *state) {
        uint64_t z = (*state += 0x9e3779b97f4a7c15ull);
        z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
        z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
        return z ^ (z >> 31);
}

/* In [0, 1). */
static inline float bench_rng_float(uint64_t *state) {
        return (float)(bench_rng(state) >> 40) / 16777216.0f;
}
