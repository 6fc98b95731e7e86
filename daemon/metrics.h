/* metrics.h: kvcd's measurements, and their Prometheus text rendering (exposition format
 * 0.0.4). Counters live in struct kvcd_counters; the two histograms here: how long a plan takes
 * from being built to being acknowledged, and the confidence of every step. */
#pragma once

#include <stddef.h>
#include <stdint.h>

#define METRICS_MAX_BUCKETS 16
/* The most the rendered text may take (the HTTP endpoint and kvcctl metrics alike): room for every
 * family with BUDGET_MAX_TENANTS tenants and METRICS_MAX_LABEL_VALUES policies and models. */
#define METRICS_MAX_BYTES (256u * 1024u)
/* Distinct values of a label that comes from clients (the model id): beyond them, "other". */
#define METRICS_MAX_LABEL_VALUES 16u

/* Why a request for memory was refused (kvcd_refusals_total{reason}); metrics.c names them. */
enum refusal_reason {
        REFUSAL_CAPACITY,     /* the node's capacity, or no chunk to be had */
        REFUSAL_QUOTA,        /* the tenant's quota */
        REFUSAL_SESSION_MAX,  /* the session's own maximum, or the arbiter's cap */
        REFUSAL_TENANT,       /* a tenant bound to another uid or gid */
        REFUSAL_DRAINING,     /* kvcd is draining (kvcctl drain, SIGTERM) */
        REFUSAL_WAIT_TIMEOUT, /* waited KVCD_WAIT_USEC for memory being taken back, in vain */
        REFUSAL_POLICY_LIMIT, /* more tokens a layer than the session's policy allows */
        REFUSAL_N
};

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
 * -ENOSPC when cap is too small. The one renderer of GET /metrics (http.c) and of the admin
 * MetricsRequest (kvcctl metrics, admin.c). */
int metrics_render(const struct kvcd *d, char *buf, size_t cap);
