/* metrics.c: histograms and the Prometheus rendering of kvcd's state and counters, the one
 * renderer behind both GET /metrics (http.c) and kvcctl metrics (admin.c).
 *
 * Rendering walks the sessions (to split pool bytes by precision, policy and model) and is
 * therefore O(sessions): it runs on a scrape or a `kvcctl metrics`, never on the hot path.
 *
 * Series are chosen so that sums mean something: kvcd_pool_bytes{state,precision} adds up to the
 * capacity (or to what is in use, when an operator lowered the capacity below it), and the
 * capacity is a gauge of its own. Labels have bounded values: tenants (at most BUDGET_MAX_TENANTS),
 * policies (the policy table), refusal reasons (enum refusal_reason), and models, the one label a
 * client names, cut at METRICS_MAX_LABEL_VALUES values with the rest as "other". No session id is
 * ever a label. process_* follow the Prometheus client libraries' names, read from /proc/self.
 */
#define _GNU_SOURCE
#include "metrics.h"

#include <dirent.h>
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>

#include "backend.h"
#include "clock.h"
#include "kvcd.h"
#include "pool.h"
#include "prefix.h"

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

static const char *const refusal_names[REFUSAL_N] = {
        [REFUSAL_CAPACITY] = "capacity",         [REFUSAL_QUOTA] = "quota",
        [REFUSAL_SESSION_MAX] = "session_max",   [REFUSAL_TENANT] = "tenant_access",
        [REFUSAL_DRAINING] = "draining",         [REFUSAL_WAIT_TIMEOUT] = "wait_timeout",
        [REFUSAL_POLICY_LIMIT] = "policy_limit",
};

/* A label value, escaped as the exposition format wants (backslash, quote, newline). */
static void put_value(struct out *o, const char *v) {
        for (; *v; v++) {
                if (*v == '\\' || *v == '"')
                        put(o, "\\%c", *v);
                else if (*v == '\n')
                        put(o, "\\n");
                else
                        put(o, "%c", *v);
        }
}

/* One sample with one label: name{label="value"} v. */
static void labelled(struct out *o, const char *name, const char *label, const char *value, double v) {
        put(o, "%s{%s=\"", name, label);
        put_value(o, value);
        put(o, "\"} %.17g\n", v);
}

/* Sessions and bytes per value of a label, at most METRICS_MAX_LABEL_VALUES values plus "other". */
struct tally {
        uint32_t n;
        struct {
                const char *value;
                uint64_t sessions, bytes;
        } row[METRICS_MAX_LABEL_VALUES + 1];
};

static void tally_add(struct tally *t, const char *value, uint64_t bytes) {
        uint32_t i = 0;
        while (i < t->n && strcmp(t->row[i].value, value) != 0)
                i++;
        if (i == t->n && t->n >= METRICS_MAX_LABEL_VALUES) { /* full: the rest is "other", one row more */
                value = "other";
                for (i = 0; i < t->n && strcmp(t->row[i].value, value) != 0; i++)
                        ;
        }
        if (i == t->n) {
                t->row[i].value = value;
                t->row[i].sessions = t->row[i].bytes = 0;
                t->n++;
        }
        t->row[i].sessions++;
        t->row[i].bytes += bytes;
}

static void put_tally(struct out *o, const struct tally *t, const char *what, const char *label) {
        char name[64];
        snprintf(name, sizeof(name), "kvcd_%s_sessions", what);
        put(o, "# HELP %s Open sessions by %s.\n# TYPE %s gauge\n", name, label, name);
        for (uint32_t i = 0; i < t->n; i++)
                labelled(o, name, label, t->row[i].value, (double)t->row[i].sessions);
        snprintf(name, sizeof(name), "kvcd_%s_used_bytes", what);
        put(o, "# HELP %s Pool bytes the sessions hold, by %s.\n# TYPE %s gauge\n", name, label, name);
        for (uint32_t i = 0; i < t->n; i++)
                labelled(o, name, label, t->row[i].value, (double)t->row[i].bytes);
}

/* process_*: CPU time, memory and fds of kvcd itself, from /proc/self (0 where it cannot tell). */
static void process_metrics(struct out *o, const struct kvcd *d) {
        double cpu = 0, rss = 0, vsize = 0;
        FILE *f = fopen("/proc/self/stat", "re");
        if (f) {
                char buf[1024];
                size_t n = fread(buf, 1, sizeof(buf) - 1, f);
                buf[n] = '\0';
                fclose(f);
                /* after the command's ")": state is field 3; utime 14, stime 15, vsize 23, rss 24 */
                const char *p = strrchr(buf, ')');
                unsigned long long ut = 0, st = 0, vs = 0;
                long long rs = 0;
                if (p &&
                    sscanf(p + 2,
                           "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %llu %llu %*d %*d %*d %*d %*d %*d "
                           "%*u %llu %lld",
                           &ut, &st, &vs, &rs) == 4) {
                        long tck = sysconf(_SC_CLK_TCK), page = sysconf(_SC_PAGESIZE);
                        cpu = tck > 0 ? (double)(ut + st) / (double)tck : 0;
                        vsize = (double)vs;
                        rss = (double)rs * (double)(page > 0 ? page : 4096);
                }
        }
        uint64_t fds = 0;
        DIR *dir = opendir("/proc/self/fd");
        if (dir) {
                for (struct dirent *e; (e = readdir(dir));)
                        fds += e->d_name[0] != '.';
                fds--; /* the directory's own */
                closedir(dir);
        }
        struct rlimit rl = { 0 };
        getrlimit(RLIMIT_NOFILE, &rl);
        family(o, "process_cpu_seconds_total", "counter", "User and system CPU time kvcd spent, in seconds.");
        put(o, "process_cpu_seconds_total %.17g\n", cpu);
        gauge(o, "process_resident_memory_bytes", "Resident memory of kvcd, in bytes.", rss);
        gauge(o, "process_virtual_memory_bytes", "Virtual memory of kvcd, in bytes.", vsize);
        gauge(o, "process_open_fds", "Open file descriptors (pool chunks and client connections among them).",
              (double)fds);
        gauge(o, "process_max_fds", "The most file descriptors kvcd may open (RLIMIT_NOFILE).",
              rl.rlim_cur == RLIM_INFINITY ? 1e308 : (double)rl.rlim_cur);
        gauge(o, "process_start_time_seconds", "When kvcd started, in seconds since the epoch.",
              (double)d->started_unix_usec / 1e6);
}

int metrics_render(const struct kvcd *d, char *buf, size_t cap) {
        struct out o = { .buf = buf, .cap = cap };
        struct pool_stats ps;
        struct tally policies = { 0 }, models = { 0 };
        uint64_t by_dtype[SESSION_DTYPES] = { 0 }, low = 0;
        pool_get_stats(d->pool, &ps);
        for (uint32_t c = 0; c < d->n_clients; c++) {
                for (const struct session *s = d->clients[c]->sessions; s; s = s->next) {
                        session_add_tier_bytes(s, by_dtype);
                        tally_add(&policies, s->policy_name, s->bytes);
                        tally_add(&models, s->model_id[0] ? s->model_id : "none", s->bytes);
                }
        }
        /* every used byte that is not in a lower tier's block is the model's precision: its blocks,
         * plan buffers, shared prefix blocks */
        static const struct {
                enum block_dtype dtype;
                const char *label;
        } lower[] = { { BLOCK_DTYPE_Q8, "int8" }, { BLOCK_DTYPE_Q4, "q4" }, { BLOCK_DTYPE_Q3, "q3" },
                      { BLOCK_DTYPE_Q2, "q2" } };
        for (size_t i = 0; i < sizeof(lower) / sizeof(lower[0]); i++)
                low += by_dtype[lower[i].dtype];
        uint64_t used = ps.used_bytes, fp = used > low ? used - low : 0;
        uint64_t free_bytes = ps.capacity_bytes > used ? ps.capacity_bytes - used : 0;
        uint32_t prefix_blocks = 0;
        uint64_t prefix_bytes = 0;
        prefix_totals(d, &prefix_blocks, &prefix_bytes);

        family(&o, "kvcd_build_info", "gauge", "kvcd's version (the value is 1).");
        put(&o, "kvcd_build_info{version=\"%s\",compiler=\"", KVCD_VERSION);
        put_value(&o, __VERSION__);
        put(&o, "\"} 1\n");
        family(&o, "kvcd_backend_info", "gauge", "The pool's backend (the value is 1).");
        put(&o, "kvcd_backend_info{backend=\"%s\"} 1\n", d->backend ? d->backend->name : "none");
        gauge(&o, "kvcd_start_time_seconds", "When kvcd started, in seconds since the epoch.",
              (double)d->started_unix_usec / 1e6);

        gauge(&o, "kvcd_pool_capacity_bytes", "The node's capacity: the most the pool may hold.",
              (double)ps.capacity_bytes);
        gauge(&o, "kvcd_pool_max_bytes", "The most the capacity may be raised to at run time (--pool-max).",
              (double)(d->cfg.pool_max_bytes > ps.capacity_bytes ? d->cfg.pool_max_bytes
                                                                 : ps.capacity_bytes));
        family(&o, "kvcd_pool_bytes", "gauge",
               "Pool bytes, used by precision and free: the series add up to the capacity (to what is in "
               "use, when that is more).");
        put(&o, "kvcd_pool_bytes{state=\"used\",precision=\"fp\"} %llu\n", (unsigned long long)fp);
        for (size_t i = 0; i < sizeof(lower) / sizeof(lower[0]); i++)
                put(&o, "kvcd_pool_bytes{state=\"used\",precision=\"%s\"} %llu\n", lower[i].label,
                    (unsigned long long)by_dtype[lower[i].dtype]);
        put(&o, "kvcd_pool_bytes{state=\"free\"} %llu\n", (unsigned long long)free_bytes);
        gauge(&o, "kvcd_pool_usage_ratio",
              "Pool bytes in use over the capacity, 0 to 1 (vLLM's kv_cache_usage_perc); above 1 after "
              "the capacity was lowered below the use.",
              ps.capacity_bytes ? (double)used / (double)ps.capacity_bytes : 0);
        family(&o, "kvcd_pool_chunks", "gauge",
               "Pool chunks: the most the capacity allows, and those owned by clients.");
        put(&o, "kvcd_pool_chunks{state=\"total\"} %u\nkvcd_pool_chunks{state=\"owned\"} %u\n",
            ps.chunks_total, ps.chunks_owned);
        put(&o, "kvcd_pool_chunks{state=\"held_for_exit\"} %u\n", client_held_chunks(d));

        gauge(&o, "kvcd_sessions", "Open sessions.", d->sessions.n);
        put_tally(&o, &policies, "policy", "policy");
        put_tally(&o, &models, "model", "model");
        gauge(&o, "kvcd_clients", "Connected client processes.", d->n_clients);
        gauge(&o, "kvcd_draining", "1 while kvcd refuses new sessions (kvcctl drain).", d->draining);
        gauge(&o, "kvcd_requests_waiting_for_memory",
              "Opens and reservations waiting for memory the arbiter is taking back.", d->n_waiting);

        family(&o, "kvcd_tenant_used_bytes", "gauge", "Pool bytes charged to each tenant.");
        for (uint32_t i = 0; i < d->budget.n_tenants; i++)
                labelled(&o, "kvcd_tenant_used_bytes", "tenant", d->budget.tenants[i]->name,
                         (double)d->budget.tenants[i]->used_bytes);
        family(&o, "kvcd_tenant_quota_bytes", "gauge", "Each tenant's quota (tenants without one: none).");
        for (uint32_t i = 0; i < d->budget.n_tenants; i++) {
                uint64_t q = budget_quota(&d->budget, d->budget.tenants[i]);
                if (q != BUDGET_NO_LIMIT)
                        labelled(&o, "kvcd_tenant_quota_bytes", "tenant", d->budget.tenants[i]->name,
                                 (double)q);
        }
        family(&o, "kvcd_tenant_sessions", "gauge", "Open sessions of each tenant.");
        for (uint32_t i = 0; i < d->budget.n_tenants; i++)
                labelled(&o, "kvcd_tenant_sessions", "tenant", d->budget.tenants[i]->name,
                         d->budget.tenants[i]->n_sessions);
        family(&o, "kvcd_tenant_refusals_total", "counter",
               "Opens and reservations of each tenant refused for memory or by its binding (while the "
               "tenant exists).");
        for (uint32_t i = 0; i < d->budget.n_tenants; i++)
                labelled(&o, "kvcd_tenant_refusals_total", "tenant", d->budget.tenants[i]->name,
                         (double)d->budget.tenants[i]->refusals);
        family(&o, "kvcd_refusals_total", "counter",
               "Opens and reservations refused, by reason: capacity, quota, session_max, tenant_access, "
               "draining, wait_timeout, policy_limit.");
        for (int i = 0; i < REFUSAL_N; i++)
                labelled(&o, "kvcd_refusals_total", "reason", refusal_names[i], (double)d->n.refusals[i]);

        gauge(&o, "kvcd_prefix_shared_bytes", "Pool bytes of published shared prefix blocks (counted once).",
              (double)prefix_bytes);
        gauge(&o, "kvcd_prefix_shared_blocks", "Published shared prefix blocks (one per layer each).",
              prefix_blocks);
        counter(&o, "kvcd_prefix_lookups_total", "Sessions that looked for a shared prefix at open.",
                d->n.prefix_lookups);
        counter(&o, "kvcd_prefix_hits_total", "Sessions that attached a shared prefix at open.",
                d->n.prefix_hits);
        counter(&o, "kvcd_prefix_hit_tokens_total",
                "Prompt tokens attached from shared prefixes (not computed).", d->n.prefix_hit_tokens);

        family(&o, "kvcd_arbiter_cuts_total", "counter",
               "Sessions the arbiter gave a cap below their demand, by how they meet it: round lower, by "
               "lowering precision (the ladder); round evict, by evicting.");
        labelled(&o, "kvcd_arbiter_cuts_total", "round", "lower", (double)d->budget.demotions);
        labelled(&o, "kvcd_arbiter_cuts_total", "round", "evict", (double)d->budget.cuts);
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
        process_metrics(&o, d);
        return o.full ? -ENOSPC : (int)o.len;
}
