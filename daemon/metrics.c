/* metrics.c: histograms and the Prometheus rendering of kvcd's state and counters.
 *
 * Rendering walks the sessions (to split pool bytes by precision) and is therefore O(sessions):
 * it runs on a scrape or a `kvcctl metrics`, never on the hot path.
 */
#include "metrics.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>

#include "clock.h"
#include "kvcd.h"
#include "pool.h"

void histogram_init(struct histogram *h, const double *bounds, uint32_t n_bounds) {
        *h = (struct histogram){ .bounds = bounds,
                                 .n_bounds =
                                         n_bounds < METRICS_MAX_BUCKETS ? n_bounds : METRICS_MAX_BUCKETS };
}

void histogram_observe(struct histogram *h, double v) {
        uint32_t i = 0;
        while (i < h->n_bounds && v > h->bounds[i])
                i++;
        h->counts[i]++;
        h->sum += v;
        h->count++;
}

struct out {
        char *buf;
        size_t cap, len;
        bool full;
};

static void put(struct out *o, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

static void put(struct out *o, const char *fmt, ...) {
        if (o->full)
                return;
        va_list ap;
        va_start(ap, fmt);
        int n = vsnprintf(o->buf + o->len, o->cap - o->len, fmt, ap);
        va_end(ap);
        if (n < 0 || (size_t)n >= o->cap - o->len)
                o->full = true;
        else
                o->len += (size_t)n;
}

static void family(struct out *o, const char *name, const char *type, const char *help) {
        put(o, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
}

static void counter(struct out *o, const char *name, const char *help, uint64_t v) {
        family(o, name, "counter", help);
        put(o, "%s %llu\n", name, (unsigned long long)v);
}

static void gauge(struct out *o, const char *name, const char *help, double v) {
        family(o, name, "gauge", help);
        put(o, "%s %.17g\n", name, v);
}

static void histogram(struct out *o, const char *name, const char *help, const struct histogram *h) {
        family(o, name, "histogram", help);
        uint64_t cum = 0;
        for (uint32_t i = 0; i < h->n_bounds; i++) {
                cum += h->counts[i];
                put(o, "%s_bucket{le=\"%g\"} %llu\n", name, h->bounds[i], (unsigned long long)cum);
        }
        put(o, "%s_bucket{le=\"+Inf\"} %llu\n%s_sum %.17g\n%s_count %llu\n", name,
            (unsigned long long)h->count, name, h->sum, name, (unsigned long long)h->count);
}

int metrics_render(const struct kvcd *d, char *buf, size_t cap) {
        struct out o = { .buf = buf, .cap = cap };
        struct pool_stats ps;
        uint64_t q8 = 0, fp = 0;
        pool_get_stats(d->pool, &ps);
        for (uint32_t c = 0; c < d->n_clients; c++) {
                for (const struct session *s = d->clients[c]->sessions; s; s = s->next) {
                        for (uint32_t l = 0; l < s->n_layers; l++)
                                q8 += (uint64_t)s->layers[l].q8.n * s->q8_layout.block_bytes;
                        fp += s->bytes;
                }
        }
        fp -= q8;

        family(&o, "kvcd_pool_bytes", "gauge", "Pool bytes by state (and, in use, by precision).");
        put(&o, "kvcd_pool_bytes{state=\"capacity\"} %llu\n", (unsigned long long)ps.capacity_bytes);
        put(&o, "kvcd_pool_bytes{state=\"used\",precision=\"fp\"} %llu\n", (unsigned long long)fp);
        put(&o, "kvcd_pool_bytes{state=\"used\",precision=\"int8\"} %llu\n", (unsigned long long)q8);
        put(&o, "kvcd_pool_bytes{state=\"free\"} %llu\n",
            (unsigned long long)(ps.capacity_bytes > ps.used_bytes ? ps.capacity_bytes - ps.used_bytes : 0));
        family(&o, "kvcd_pool_chunks", "gauge",
               "Pool chunks: the most the capacity allows, and those owned by clients.");
        put(&o, "kvcd_pool_chunks{state=\"total\"} %u\nkvcd_pool_chunks{state=\"owned\"} %u\n",
            ps.chunks_total, ps.chunks_owned);
        put(&o, "kvcd_pool_chunks{state=\"held_for_exit\"} %u\n", client_held_chunks(d));
        gauge(&o, "kvcd_sessions", "Open sessions.", d->sessions.n);
        gauge(&o, "kvcd_clients", "Connected client processes.", d->n_clients);
        gauge(&o, "kvcd_draining", "1 while kvcd refuses new sessions (kvcctl drain).", d->draining);
        gauge(&o, "kvcd_uptime_seconds", "Seconds since kvcd started.",
              (double)(now_usec() - d->started_usec) / 1e6);
        counter(&o, "kvcd_steps_total", "Step summaries taken.", d->n.steps);
        counter(&o, "kvcd_plans_total", "Compaction plans sent.", d->n.plans);
        counter(&o, "kvcd_plans_applied_total", "Compaction plans clients acknowledged.", d->n.plans_applied);
        counter(&o, "kvcd_grants_total", "Blocks granted.", d->n.grants);
        counter(&o, "kvcd_sessions_opened_total", "Sessions opened.", d->n.sessions_opened);
        counter(&o, "kvcd_admission_refusals_total",
                "OpenSession requests refused for lack of room or by a drain.", d->n.admission_refusals);
        counter(&o, "kvcd_evictions_total", "Sessions closed by an operator (kvcctl evict).", d->n.evictions);
        counter(&o, "kvcd_chunk_drains_total",
                "Chunks kvcd set out to empty by moving their blocks, to take them back (cooperative "
                "shrink).",
                d->n.chunks_drained);
        counter(&o, "kvcd_blocks_relocated_total", "Blocks clients moved for kvcd (cooperative shrink).",
                d->n.blocks_relocated);
        counter(&o, "kvcd_client_deaths_total", "Clients that went away with sessions open.",
                d->n.client_deaths);
        counter(&o, "kvcd_errors_total", "Requests and steps refused with an error.", d->n.errors);
        counter(&o, "kvcd_replies_dropped_total", "Replies dropped: the client left or stopped reading.",
                d->n.dropped_replies);
        histogram(&o, "kvcd_plan_latency_seconds", "From a plan built to its acknowledgement.",
                  &d->plan_latency);
        histogram(&o, "kvcd_confidence", "Confidence of each step (CONF-KV's c).", &d->confidence);
        return o.full ? -ENOSPC : (int)o.len;
}
