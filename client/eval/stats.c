/* stats.c: clustered intervals, the paired difference and a bootstrap (stats.h). */
#include "stats.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

double stats_t95(uint32_t df) {
        static const double t[31] = { 0,     12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365,
                                      2.306, 2.262,  2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
                                      2.120, 2.110,  2.101, 2.093, 2.086, 2.080, 2.074, 2.069,
                                      2.064, 2.060,  2.056, 2.052, 2.048, 2.045, 2.042 };
        if (df == 0)
                return INFINITY;
        return df <= 30 ? t[df] : 1.96;
}

int stats_ratio_ci(const double *y, const double *w, uint32_t n, struct stats_ci *ret) {
        double sy = 0, sw = 0;
        for (uint32_t i = 0; i < n; i++)
                sy += y[i], sw += w[i];
        if (n < 2 || sw <= 0)
                return -EINVAL;
        double r = sy / sw, v = 0;
        for (uint32_t i = 0; i < n; i++) {
                double e = y[i] - r * w[i];
                v += e * e;
        }
        double se = sqrt(v * (double)n / (double)(n - 1)) / sw, t = stats_t95(n - 1);
        *ret = (struct stats_ci){ .mean = r, .se = se, .lo = r - t * se, .hi = r + t * se, .n = n };
        return 0;
}

int stats_paired_ci(const double *a, const double *b, const double *w, uint32_t n, struct stats_ci *ret) {
        if (n < 2)
                return -EINVAL;
        double *d = malloc((size_t)n * sizeof(double));
        if (!d)
                return -ENOMEM;
        for (uint32_t i = 0; i < n; i++)
                d[i] = a[i] - b[i];
        int r = stats_ratio_ci(d, w, n, ret);
        free(d);
        return r;
}

static uint64_t xorshift(uint64_t *s) {
        uint64_t x = *s;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        return *s = x;
}

static int cmp_double(const void *a, const void *b) {
        double x = *(const double *)a, y = *(const double *)b;
        return (x > y) - (x < y);
}

int stats_bootstrap_mean(const double *x, uint32_t n, uint32_t reps, uint64_t seed, struct stats_ci *ret) {
        if (n < 2 || reps < 100)
                return -EINVAL;
        double *means = malloc((size_t)reps * sizeof(double)), sum = 0;
        if (!means)
                return -ENOMEM;
        uint64_t s = seed ? seed : 0x9e3779b97f4a7c15ull;
        for (uint32_t i = 0; i < n; i++)
                sum += x[i];
        for (uint32_t r = 0; r < reps; r++) {
                double m = 0;
                for (uint32_t i = 0; i < n; i++)
                        m += x[xorshift(&s) % n];
                means[r] = m / n;
        }
        qsort(means, reps, sizeof(double), cmp_double);
        *ret = (struct stats_ci){ .mean = sum / n,
                                  .lo = means[(size_t)(0.025 * (reps - 1))],
                                  .hi = means[(size_t)ceil(0.975 * (reps - 1))],
                                  .n = n };
        free(means);
        return 0;
}

const char *stats_verdict(const struct stats_ci *d, double need, bool lower_is_better) {
        if (isnan(d->lo) || isnan(d->hi))
                return "not measured";
        if (d->lo <= 0 && d->hi >= 0)
                return "no difference";
        double lo = lower_is_better ? -d->hi : d->lo, hi = lower_is_better ? -d->lo : d->hi;
        if (lo >= need)
                return "holds";
        if (hi < need)
                return "does not hold";
        return "not resolved (the interval spans the target)";
}

const char *stats_compare(const struct stats_ci *d, bool lower_is_better) {
        const char *v = stats_verdict(d, 0, lower_is_better);
        return strcmp(v, "holds") == 0 ? "better" : strcmp(v, "does not hold") == 0 ? "worse" : v;
}
