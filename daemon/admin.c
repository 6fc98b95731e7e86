/* admin.c: what operators can ask of kvcd besides the counters of status and the rows of
 * sessions: evict a session, drain, audit the accounting, metrics, budgets, and the parts of
 * status that are about budgets and kvcd's own memory (tenants against their quotas, RSS).
 * Handlers for the admin rows of handlers.c's table, and the deferred answer of a drain. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zmq.h>

#include "admin.h"
#include "clock.h"
#include "handlers.h"
#include "kvcd.h"
#include "log.h"
#include "pool.h"
#include "prefix.h"

/* Recomputes the accounting from the sessions' block tables and the pool's bitmaps. */
int kvcd_audit(struct kvcd *d, char *report, size_t cap, uint64_t *ret_used, uint64_t *ret_blocks) {
        char why[256];
        int r = pool_audit(d->pool, why, sizeof(why));
        size_t len = 0;
        uint64_t used = 0, blocks = 0, bad = 0;
        if (r < 0)
                len += (size_t)snprintf(report + len, cap - len, "pool: %s\n", why);
        const struct session *s;
        for (uint32_t it = 0; (s = idmap_next(&d->sessions, &it));) { /* clients', orphans', hand-offs' */
                uint64_t bytes = (uint64_t)s->plan_units * s->layout.block_bytes;
                if (s->plan_units && pool_owns(d->pool, session_pool_owner(s), s->plan_offset,
                                               (uint32_t)s->layout.block_bytes, s->plan_units) < 0)
                        bad++;
                for (uint32_t l = 0; l < s->n_layers; l++) {
                        const struct session_layer *L = &s->layers[l];
                        for (uint32_t q = 0; q < s->n_tiers; q++) {
                                const struct block_table *t = &L->t[q];
                                uint32_t unit = session_unit_bytes(s, q);
                                /* shared blocks are the prefix index's (below); prompt blocks it did not
                                 * get to share are in its prefix domain */
                                uint32_t first = q ? 0 : s->n_shared_blocks;
                                for (uint32_t b = first; b < t->n; b++)
                                        if (pool_owns(d->pool, session_pool_owner(s), t->blocks[b], unit, 1) <
                                                    0 &&
                                            (!s->prefix_domain ||
                                             pool_owns(d->pool, s->prefix_domain, t->blocks[b], unit, 1) < 0))
                                                bad++;
                                bytes += (uint64_t)(t->n - first) * unit;
                                blocks += t->n - first;
                        }
                        if (L->n_tokens > session_low_tokens(s, L, false) + L->t[0].n * s->layout.block_tokens &&
                            len + 128 < cap)
                                len += (size_t)snprintf(
                                        report + len, cap - len,
                                        "session %llu layer %u: %u tokens beyond its blocks\n",
                                        (unsigned long long)s->id, l, L->n_tokens);
                }
                if (bytes != s->bytes && len + 128 < cap)
                        len += (size_t)snprintf(report + len, cap - len,
                                                "session %llu: counts %llu bytes, its tables %llu\n",
                                                (unsigned long long)s->id, (unsigned long long)s->bytes,
                                                (unsigned long long)bytes);
                used += bytes + relocate_bytes(s); /* and its moves' destinations, in flight */
        }
        uint64_t shared = 0;
        if (prefix_audit(d, &shared) < 0 && len + 128 < cap)
                len += (size_t)snprintf(report + len, cap - len,
                                        "shared prefix blocks not in their domains' chunks\n");
        used += shared;
        struct pool_stats ps;
        pool_get_stats(d->pool, &ps);
        if (bad && len + 128 < cap)
                len += (size_t)snprintf(report + len, cap - len,
                                        "%llu blocks in sessions' tables are not theirs in the pool\n",
                                        (unsigned long long)bad);
        if (used != ps.used_bytes && len + 128 < cap)
                len += (size_t)snprintf(report + len, cap - len,
                                        "sessions hold %llu bytes, the pool counts %llu\n",
                                        (unsigned long long)used, (unsigned long long)ps.used_bytes);
        bool clean = len == 0;
        if (clean)
                snprintf(report, cap, "clean: %u sessions, %llu blocks, %llu bytes in use of %llu%s",
                         d->sessions.n, (unsigned long long)blocks, (unsigned long long)used,
                         (unsigned long long)ps.capacity_bytes,
                         used > ps.capacity_bytes ? " (above a lowered capacity)" : "");
        *ret_used = used;
        *ret_blocks = blocks;
        return clean ? 0 : -EUCLEAN;
}

int admin_audit(struct kvcd *d, Kvc__Envelope *reply) {
        char *report = wire_arena_alloc(d->out, 4096);
        Kvc__Audit *a = wire_arena_alloc(d->out, sizeof(*a));
        if (!report || !a)
                return -ENOMEM;
        kvc__audit__init(a);
        int r = kvcd_audit(d, report, 4096, &a->used_bytes, &a->blocks);
        a->clean = r == 0;
        a->report = report;
        a->sessions = d->sessions.n;
        if (r < 0)
                log_error("audit found a mismatch: %s", report);
        reply->body_case = KVC__ENVELOPE__BODY_AUDIT;
        reply->audit = a;
        return 0;
}

int admin_metrics(struct kvcd *d, Kvc__Envelope *reply) {
        size_t cap = METRICS_MAX_BYTES;
        char *text = wire_arena_alloc(d->out, cap);
        Kvc__Metrics *m = wire_arena_alloc(d->out, sizeof(*m));
        if (!text || !m)
                return -ENOMEM;
        int r = metrics_render(d, text, cap);
        if (r < 0)
                return r;
        kvc__metrics__init(m);
        m->text = text;
        reply->body_case = KVC__ENVELOPE__BODY_METRICS;
        reply->metrics = m;
        return 0;
}

/* The tenants as TenantBudget rows in d->out (a quota of "no limit" reads as the capacity). */
static int tenant_rows(struct kvcd *d, uint64_t capacity, Kvc__TenantBudget ***ret, size_t *ret_n) {
        const struct budget *bu = &d->budget;
        Kvc__TenantBudget **v = wire_arena_alloc(d->out, (bu->n_tenants + 1) * sizeof(*v));
        if (!v)
                return -ENOMEM;
        for (uint32_t i = 0; i < bu->n_tenants; i++) {
                const struct tenant *t = bu->tenants[i];
                Kvc__TenantBudget *tb = wire_arena_alloc(d->out, sizeof(*tb));
                if (!tb)
                        return -ENOMEM;
                kvc__tenant_budget__init(tb);
                tb->name = (char *)t->name;
                uint64_t q = budget_quota(bu, t);
                tb->quota_bytes = q == BUDGET_NO_LIMIT ? capacity : q;
                tb->used_bytes = t->used_bytes;
                tb->sessions = t->n_sessions;
                tb->reserved_bytes = t->reserved_bytes;
                tb->uid = t->uid;
                tb->gid = t->gid;
                tb->declared = t->declared;
                v[i] = tb;
        }
        *ret = v;
        *ret_n = bu->n_tenants;
        return 0;
}

/* VmRSS and RssAnon of /proc/self/status, in bytes; 0 where the kernel does not say. */
static void own_memory(uint64_t *ret_rss, uint64_t *ret_anon) {
        char line[128];
        unsigned long long kib;
        *ret_rss = *ret_anon = 0;
        FILE *f = fopen("/proc/self/status", "re");
        if (!f)
                return;
        while (fgets(line, sizeof(line), f)) {
                if (sscanf(line, "VmRSS: %llu kB", &kib) == 1)
                        *ret_rss = (uint64_t)kib * 1024u;
                else if (sscanf(line, "RssAnon: %llu kB", &kib) == 1)
                        *ret_anon = (uint64_t)kib * 1024u;
        }
        fclose(f);
}

int admin_status_extras(struct kvcd *d, Kvc__Status *s) {
        own_memory(&s->rss_bytes, &s->rss_anon_bytes);
        return tenant_rows(d, s->capacity_bytes, &s->tenants, &s->n_tenants);
}

int admin_budgets(struct kvcd *d, Kvc__Envelope *reply) {
        struct pool_stats ps;
        const struct budget *bu = &d->budget;
        Kvc__Budgets *b = wire_arena_alloc(d->out, sizeof(*b));
        if (!b)
                return -ENOMEM;
        pool_get_stats(d->pool, &ps);
        kvc__budgets__init(b);
        b->capacity_bytes = ps.capacity_bytes;
        b->used_bytes = ps.used_bytes;
        b->default_quota_bytes = bu->default_quota == BUDGET_NO_LIMIT ? ps.capacity_bytes : bu->default_quota;
        int r = tenant_rows(d, ps.capacity_bytes, &b->tenants, &b->n_tenants);
        if (r < 0)
                return r;
        reply->body_case = KVC__ENVELOPE__BODY_BUDGETS;
        reply->budgets = b;
        return 0;
}

int admin_budget_set(struct kvcd *d, const Kvc__BudgetSet *m, Kvc__Envelope *reply, char *why,
                     size_t why_len) {
        int r;
        struct session *s = NULL;
        if (m->set_session && !(s = idmap_get(&d->sessions, m->session_id))) {
                snprintf(why, why_len, "no session %llu", (unsigned long long)m->session_id);
                return -ENOENT;
        }
        /* changes are made in order (capacity, tenant, session); the first refused stops the rest */
        if (m->set_capacity && (r = budget_check_capacity(d, m->capacity_bytes, why, why_len)) < 0)
                return r;
        if (m->set_capacity) {
                r = pool_set_capacity(d->pool, m->capacity_bytes);
                if (r < 0) {
                        snprintf(why, why_len,
                                 "capacity must be between one chunk (%llu) and the pool's maximum (%llu)",
                                 (unsigned long long)pool_chunk_bytes(d->pool),
                                 (unsigned long long)pool_va_bytes(d->pool));
                        return r;
                }
                log_notice("capacity set to %llu bytes", (unsigned long long)m->capacity_bytes);
                budget_limits_changed(d); /* shrinking below use makes plans, growing lets waits through */
                d->freed = true;
        }
        if (m->set_quota || m->set_binding) {
                r = budget_set_tenant(d, m->tenant ? m->tenant : "", m->set_quota, m->quota_bytes,
                                      m->set_binding, m->tenant_uid, m->tenant_gid, why, why_len);
                if (r < 0)
                        return r;
                log_notice("tenant %s: quota %llu bytes%s", m->tenant && *m->tenant ? m->tenant : "(default)",
                           (unsigned long long)m->quota_bytes, m->set_binding ? ", binding changed" : "");
        }
        if (s) {
                r = budget_set_session(d, s, m->set_min, m->session_min_bytes, m->set_max,
                                       m->session_max_bytes, m->set_priority, m->priority, why, why_len);
                if (r < 0)
                        return r;
                log_notice("session %llu: limits %llu..%llu bytes, priority %d", (unsigned long long)s->id,
                           (unsigned long long)s->min_bytes, (unsigned long long)s->max_bytes, s->priority);
        }
        budget_arbitrate(d);
        return admin_budgets(d, reply);
}

/* Tells the session's client that kvcd closed it, then closes it. */
int admin_evict(struct kvcd *d, uint64_t id, Kvc__Envelope *reply, char *why, size_t why_len) {
        struct session *s = idmap_get(&d->sessions, id);
        if (!s) {
                snprintf(why, why_len, "no session %llu", (unsigned long long)id);
                return -ENOENT;
        }
        Kvc__SessionClosed *c = wire_arena_alloc(d->out, sizeof(*c));
        Kvc__SessionStats *st = wire_arena_alloc(d->out, sizeof(*st));
        if (!c || !st)
                return -ENOMEM;
        kvc__session_closed__init(c);
        kvc__session_stats__init(st);
        c->session_id = s->id;
        if (session_fill_stats(d->out, s, st) < 0)
                return -ENOMEM;
        c->stats = st;

        Kvc__Error e = KVC__ERROR__INIT;
        e.code = ESHUTDOWN;
        e.session_id = s->id;
        e.message = "the session was evicted by an operator";
        Kvc__Envelope note = KVC__ENVELOPE__INIT;
        note.version = WIRE_VERSION;
        note.body_case = KVC__ENVELOPE__BODY_ERROR;
        note.error = &e;
        if (s->owner->bound)
                send_envelope(d, d->zclient, s->owner->rid, s->owner->rid_len, &note);
        log_notice("session %llu of client %llu (pid %d) evicted", (unsigned long long)s->id,
                   (unsigned long long)s->owner->id, (int)s->owner->pid);
        session_close(d, s);
        d->n.evictions++;
        reply->body_case = KVC__ENVELOPE__BODY_SESSION_CLOSED;
        reply->session_closed = c;
        return 0;
}

static void drain_answer(struct kvcd *d, bool timed_out) {
        Kvc__Drained dr = KVC__DRAINED__INIT;
        dr.sessions_left = d->sessions.n;
        dr.timed_out = timed_out;
        Kvc__Envelope env = KVC__ENVELOPE__INIT;
        env.version = WIRE_VERSION;
        env.request_id = d->drain.request_id;
        env.body_case = KVC__ENVELOPE__BODY_DRAINED;
        env.drained = &dr;
        send_envelope(d, d->zadmin, d->drain.rid, d->drain.rid_len, &env);
        d->drain.active = false;
}

int admin_drain(struct kvcd *d, const Kvc__Drain *m, const uint8_t *rid, size_t rid_len, uint64_t request_id,
                Kvc__Envelope *reply, bool *deferred) {
        if (m->resume) {
                d->draining = false;
                log_notice("drain ended: sessions are admitted again");
        } else if (!d->draining) {
                d->draining = true;
                log_notice("draining: new sessions are refused (%u open)", d->sessions.n);
        }
        if (!m->resume && m->timeout_ms && d->sessions.n) {
                if (d->drain.active)
                        drain_answer(d, true); /* one waiter at a time: the previous one is answered now */
                d->drain =
                        (struct drain_wait){ .active = true,
                                             .rid_len = (uint8_t)rid_len,
                                             .request_id = request_id,
                                             .deadline_usec = now_usec() + (uint64_t)m->timeout_ms * 1000u };
                memcpy(d->drain.rid, rid, rid_len);
                *deferred = true;
                return 0;
        }
        Kvc__Drained *dr = wire_arena_alloc(d->out, sizeof(*dr));
        if (!dr)
                return -ENOMEM;
        kvc__drained__init(dr);
        dr->sessions_left = d->sessions.n;
        reply->body_case = KVC__ENVELOPE__BODY_DRAINED;
        reply->drained = dr;
        return 0;
}

void admin_tick(struct kvcd *d, uint64_t now) {
        if (!d->drain.active)
                return;
        if (d->sessions.n == 0)
                drain_answer(d, false);
        else if (now >= d->drain.deadline_usec)
                drain_answer(d, true);
}

uint64_t admin_next_deadline(const struct kvcd *d) {
        return d->drain.active ? d->drain.deadline_usec : UINT64_MAX;
}
