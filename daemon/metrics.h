/* metrics.h: kvcd's measurements, and their Prometheus text rendering (exposition format
 * 0.0.4). Counters live in struct kvcd_counters; the two histograms here: how long a plan takes
 * from being built to being acknowledged, and the confidence of every step. */
#pragma once

#include <stddef.h>
#include <stdint.h>

#define METRICS_MAX_BUCKETS 16

struct histogram {
        const double *bounds; /* upper bounds, ascending; +Inf is implicit */
        uint32_t n_bounds;
        uint64_t counts[METRICS_MAX_BUCKETS + 1];
        double sum;
        uint64_t count;
};

void histogram_init(struct histogram *h, const double *bounds, uint32_t n_bounds);
void histogram_observe(struct histogram *h, double v);

struct kvcd;

/* Renders every metric into buf (at most cap bytes, NUL-terminated); returns the length, or
 * -ENOSPC when cap is too small. */
int metrics_render(const struct kvcd *d, char *buf, size_t cap);
