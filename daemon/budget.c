/* budget.c: tenants, session limits, admission and the arbiter (see budget.h). */
#define _GNU_SOURCE
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "budget.h"
#include "kvcd.h"
#include "log.h"
#include "pool.h"

static uint64_t unmet(const struct session *s) {
        return s->min_bytes > s->bytes ? s->min_bytes - s->bytes : 0;
}

static uint64_t capacity(const struct kvcd *d) {
        struct pool_stats ps;
        pool_get_stats(d->pool, &ps);
        return ps.capacity_bytes;
}

static uint64_t used(const struct kvcd *d) {
        struct pool_stats ps;
        pool_get_stats(d->pool, &ps);
        return ps.used_bytes;
}

uint64_t budget_max(const struct kvcd *d, const struct session *s) {
        uint64_t m = s->max_bytes, q = s->ten ? budget_quota(&d->budget, s->ten) : BUDGET_NO_LIMIT,
                 c = capacity(d);
        if (m > q)
                m = q;
        if (m > c)
                m = c;
        return m > s->min_bytes ? m : s->min_bytes;
}

static double mib(uint64_t bytes) {
        return (double)bytes / (1024.0 * 1024.0);
}

void budget_init(struct budget *b) {
        memset(b, 0, sizeof(*b));
        b->default_quota = BUDGET_NO_LIMIT;
}

void budget_done(struct budget *b) {
        for (uint32_t i = 0; i < b->n_tenants; i++)
                free(b->tenants[i]);
        b->n_tenants = 0;
}

uint64_t budget_quota(const struct budget *b, const struct tenant *t) {
        return t->quota_bytes != BUDGET_NO_LIMIT ? t->quota_bytes : b->default_quota;
}

static struct tenant *find(const struct budget *b, const char *name) {
        for (uint32_t i = 0; i < b->n_tenants; i++)
                if (strcmp(b->tenants[i]->name, name) == 0)
                        return b->tenants[i];
        return NULL;
}

static struct tenant *add(struct budget *b, const char *name) {
        if (b->n_tenants == BUDGET_MAX_TENANTS || strlen(name) >= sizeof(b->tenants[0]->name))
                return NULL;
        struct tenant *t = calloc(1, sizeof(*t));
        if (!t)
                return NULL;
        snprintf(t->name, sizeof(t->name), "%s", name);
        t->uid = t->gid = -1;
        t->quota_bytes = BUDGET_NO_LIMIT;
        b->tenants[b->n_tenants++] = t;
        return t;
}

static void drop_if_unused(struct budget *b, struct tenant *t) {
        if (t->declared || t->n_sessions || t->shared_bytes)
                return;
        for (uint32_t i = 0; i < b->n_tenants; i++) {
                if (b->tenants[i] == t) {
                        b->tenants[i] = b->tenants[--b->n_tenants];
                        free(t);
                        return;
                }
        }
}

int budget_declare(struct budget *b, const char *spec, char *why, size_t why_len) {
        char buf[256];
        if (strlen(spec) >= sizeof(buf)) {
                snprintf(why, why_len, "tenant spec too long");
                return -EINVAL;
        }
        snprintf(buf, sizeof(buf), "%s", spec);
        char *save = NULL, *name = strtok_r(buf, ":", &save);
        if (!name || !*name || strlen(name) > 64) {
                snprintf(why, why_len, "%s: a tenant needs a name of 1 to 64 characters", spec);
                return -EINVAL;
        }
        int64_t uid = -1, gid = -1;
        uint64_t quota = BUDGET_NO_LIMIT;
        for (char *kv; (kv = strtok_r(NULL, ":", &save));) {
                char *end;
                if (strncmp(kv, "uid=", 4) == 0 || strncmp(kv, "gid=", 4) == 0) {
                        long long v = strtoll(kv + 4, &end, 10);
                        if (*end || end == kv + 4 || v < 0 || v > UINT32_MAX - 1ll) {
                                snprintf(why, why_len, "%s: %s is not an id", spec, kv);
                                return -EINVAL;
                        }
                        *(kv[0] == 'u' ? &uid : &gid) = v;
                } else if (strncmp(kv, "quota=", 6) == 0) {
                        if (wire_parse_bytes(kv + 6, &quota) < 0) {
                                snprintf(why, why_len, "%s: %s is not a size in bytes", spec, kv + 6);
                                return -EINVAL;
                        }
                } else {
                        snprintf(why, why_len, "%s: unknown field %s (uid=, gid=, quota=)", spec, kv);
                        return -EINVAL;
                }
        }
        if (strcmp(name, "default") == 0 && (uid >= 0 || gid >= 0)) {
                snprintf(why, why_len, "the default tenant cannot be bound to a uid or gid");
                return -EINVAL;
        }
        struct tenant *t = find(b, name);
        if (!t && !(t = add(b, name))) {
                snprintf(why, why_len, "too many tenants (%u)", BUDGET_MAX_TENANTS);
                return -ENOSPC;
        }
        t->declared = true;
        t->uid = uid;
        t->gid = gid;
        t->quota_bytes = quota;
        return 0;
}

/* The tenant a client's session is charged to (created when the name is new). */
static int resolve(struct budget *b, const struct client *c, const char *asked, bool check_creds,
                   struct tenant **ret, char *why, size_t why_len) {
        const char *name = asked && *asked ? asked : NULL;
        if (!name) {
                for (uint32_t i = 0; i < b->n_tenants && !name; i++)
                        if (b->tenants[i]->declared && b->tenants[i]->uid == (int64_t)c->uid)
                                name = b->tenants[i]->name;
                for (uint32_t i = 0; i < b->n_tenants && !name; i++)
                        if (b->tenants[i]->declared && b->tenants[i]->gid == (int64_t)c->gid)
                                name = b->tenants[i]->name;
                if (!name)
                        name = "default";
        }
        struct tenant *t = find(b, name);
        if (t) {
                bool bound = t->uid >= 0 || t->gid >= 0;
                if (check_creds && bound && c->uid != 0 && t->uid != (int64_t)c->uid &&
                    t->gid != (int64_t)c->gid) {
                        snprintf(why, why_len,
                                 "tenant %s is bound to %s %lld; this client runs as uid %u gid %u", name,
                                 t->uid >= 0 ? "uid" : "gid", (long long)(t->uid >= 0 ? t->uid : t->gid),
                                 c->uid, c->gid);
                        t->refusals++;
                        return -EACCES;
                }
        } else {
                if (!(t = add(b, name))) {
                        snprintf(why, why_len, "too many tenants (%u)", BUDGET_MAX_TENANTS);
                        return -ENOSPC;
                }
                if (check_creds && strcmp(name, "default") != 0)
                        t->uid = c->uid; /* nobody else may charge a name its first user made */
        }
        *ret = t;
        return 0;
}

int budget_admit(struct kvcd *d, struct session *s, struct client *c, const Kvc__OpenSession *m,
                 bool check_creds, uint64_t floor, char *why, size_t why_len) {
        struct budget *b = &d->budget;
        struct tenant *t;
        int r = resolve(b, c, m->tenant, check_creds, &t, why, why_len);
        if (r < 0)
                return r;
        uint64_t cap = capacity(d), quota = budget_quota(b, t);
        uint64_t min = m->min_bytes > floor ? m->min_bytes : floor;
        uint64_t max = m->max_bytes ? m->max_bytes : BUDGET_NO_LIMIT;
        if (max < floor) {
                snprintf(why, why_len,
                         "a maximum of %llu bytes is below the %llu this session needs to run at all",
                         (unsigned long long)max, (unsigned long long)floor);
                r = -EINVAL;
        } else if (min > max) {
                snprintf(why, why_len, "minimum %llu bytes above maximum %llu", (unsigned long long)min,
                         (unsigned long long)max);
                r = -EINVAL;
        } else if (b->reserved_bytes + min > cap) {
                snprintf(why, why_len,
                         "node capacity: %.1f MiB, of which %.1f MiB are guaranteed to other sessions; this "
                         "session's minimum of %.2f MiB does not fit",
                         mib(cap), mib(b->reserved_bytes), mib(min));
                r = -ENOSPC;
                d->refusal_reason = REFUSAL_CAPACITY;
        } else if (t->reserved_bytes + min > quota) {
                snprintf(why, why_len,
                         "quota of tenant %s: %.1f MiB, of which %.1f MiB are guaranteed to its %u other "
                         "sessions; this session's minimum of %.2f MiB does not fit",
                         t->name, mib(quota), mib(t->reserved_bytes), t->n_sessions, mib(min));
                r = -ENOSPC;
                d->refusal_reason = REFUSAL_QUOTA;
        }
        if (r < 0) {
                if (r == -ENOSPC)
                        t->refusals++;
                drop_if_unused(b, t);
                return r;
        }
        s->ten = t;
        snprintf(s->tenant, sizeof(s->tenant), "%s", t->name);
        s->floor_bytes = floor;
        s->min_bytes = min;
        s->max_bytes = max;
        s->cap_bytes = budget_max(d, s);
        s->priority = m->priority;
        s->demand_bytes = min;
        t->n_sessions++;
        t->reserved_bytes += min;
        b->reserved_bytes += min;
        t->unmet_bytes += unmet(s);
        b->unmet_bytes += unmet(s);
        t->demand_bytes += s->demand_bytes;
        b->demand_bytes += s->demand_bytes;
        b->n_lowering += s->token_tiers;
        b->dirty = true;
        return 0;
}

void budget_leave(struct kvcd *d, struct session *s) {
        struct budget *b = &d->budget;
        struct tenant *t = s->ten;
        if (!t)
                return;
        t->unmet_bytes -= unmet(s);
        b->unmet_bytes -= unmet(s);
        t->used_bytes -= s->bytes; /* 0 once its blocks are freed */
        t->reserved_bytes -= s->min_bytes;
        b->reserved_bytes -= s->min_bytes;
        t->demand_bytes -= s->demand_bytes;
        b->demand_bytes -= s->demand_bytes;
        b->n_lowering -= s->token_tiers;
        t->n_sessions--;
        s->ten = NULL;
        b->dirty = true;
        drop_if_unused(b, t);
}

int budget_may_grow(struct kvcd *d, const struct session *s, uint64_t n, char *why, size_t why_len) {
        const struct budget *b = &d->budget;
        const struct tenant *t = s->ten;
        if (!t)
                return 0;
        /* a session that lowers precision meets the arbiter's cap at its next plan: its tokens come
         * in at the dtype first (the node's capacity still holds the line) */
        if (s->bytes + n > (s->token_tiers ? budget_max(d, s) : s->cap_bytes)) {
                bool arbiter = s->cap_bytes < budget_max(d, s);
                d->refusal_own = true;
                d->refusal_reason = REFUSAL_SESSION_MAX;
                snprintf(why, why_len, "session %llu holds %llu bytes; %s is %llu", (unsigned long long)s->id,
                         (unsigned long long)s->bytes,
                         arbiter ? "the arbiter's cap while memory is short" : "its maximum",
                         (unsigned long long)s->cap_bytes);
                return -ENOSPC;
        }
        /* what this growth takes from its own minimum is guaranteed, but it waits while the tenant's
         * quota is full (the arbiter is taking memory back from its other sessions); the rest must
         * also leave the others' minimums whole */
        uint64_t own = unmet(s), quota = budget_quota(b, t);
        if (t->used_bytes + n + (n <= own ? 0 : t->unmet_bytes - own) > quota) {
                snprintf(why, why_len,
                         "quota of tenant %s: %.1f MiB, %.1f MiB in use, %.1f MiB guaranteed to its other "
                         "sessions",
                         t->name, mib(quota), mib(t->used_bytes), mib(t->unmet_bytes - own));
                d->refusal_reason = REFUSAL_QUOTA;
                return -ENOSPC;
        }
        if (n <= own)
                return 0; /* the node's capacity: the pool itself holds the line */
        uint64_t cap = capacity(d), u = used(d);
        if (u + n + (b->unmet_bytes - own) > cap) {
                snprintf(why, why_len,
                         "node capacity: %.1f MiB, %.1f MiB in use, %.1f MiB guaranteed to other sessions",
                         mib(cap), mib(u), mib(b->unmet_bytes - own));
                d->refusal_reason = REFUSAL_CAPACITY;
                return -ENOSPC;
        }
        return 0;
}

void budget_charge(struct kvcd *d, struct session *s, int64_t delta) {
        struct budget *b = &d->budget;
        uint64_t before = unmet(s);
        s->bytes += (uint64_t)delta;
        if (!s->ten)
                return;
        uint64_t after = unmet(s);
        s->ten->used_bytes += (uint64_t)delta;
        s->ten->unmet_bytes += after - before;
        b->unmet_bytes += after - before;
}

void budget_charge_shared(struct kvcd *d, struct tenant *t, int64_t delta) {
        if (!t)
                return;
        t->used_bytes += (uint64_t)delta;
        t->shared_bytes += (uint64_t)delta;
        d->budget.dirty = true;
        drop_if_unused(&d->budget, t);
}

static void set_demand(struct kvcd *d, struct session *s, uint64_t bytes) {
        struct budget *b = &d->budget;
        uint64_t max = budget_max(d, s);
        if (bytes > max)
                bytes = max;
        if (bytes < s->min_bytes)
                bytes = s->min_bytes;
        if (bytes == s->demand_bytes)
                return;
        if (s->ten)
                s->ten->demand_bytes += bytes - s->demand_bytes;
        b->demand_bytes += bytes - s->demand_bytes;
        s->demand_bytes = bytes;
        b->dirty = true;
}

void budget_demand(struct kvcd *d, struct session *s, uint64_t bytes) {
        set_demand(d, s, bytes);
}

/* Every live session: clients', orphans' and hand-offs'. */
static uint32_t all_sessions(struct kvcd *d, struct session **out, uint32_t max) {
        uint32_t n = 0;
        struct session *s;
        for (uint32_t it = 0; n < max && (s = idmap_next(&d->sessions, &it));)
                out[n++] = s;
        return n;
}

/* The order in which sessions give memory back: lowest priority first, then highest confidence. */
static int shrink_order(const void *a, const void *b) {
        const struct session *x = *(struct session *const *)a, *y = *(struct session *const *)b;
        if (x->priority != y->priority)
                return x->priority < y->priority ? -1 : 1;
        if (x->confidence != y->confidence)
                return x->confidence > y->confidence ? -1 : 1;
        return x->id < y->id ? -1 : x->id > y->id;
}

/* How far the arbiter may lower a session's cap: to its minimum when it must evict; before that
 * (evict false), only as far as lowering precision takes it: a session whose policy gives each
 * token its tier holds every token at the lowest tier its policy would use at lowest_bytes, and
 * one that cannot lower precision gives nothing in that round. */
static uint64_t floor_of(const struct session *s, bool evict) {
        if (evict)
                return s->min_bytes;
        uint64_t low = s->token_tiers ? s->lowest_bytes : UINT64_MAX;
        return low > s->min_bytes ? low : s->min_bytes;
}

/* Cuts excess bytes from the caps of v (sorted), never below floor_of, only from sessions whose
 * policy can shrink (a policy that never plans cannot give memory back). Returns what is left of
 * the excess. */
static uint64_t cut(struct budget *b, struct session **v, uint32_t n, const struct tenant *only, uint64_t excess,
                    bool evict) {
        for (uint32_t i = 0; i < n && excess; i++) {
                struct session *s = v[i];
                uint64_t floor = floor_of(s, evict);
                if ((only && s->ten != only) || !s->plan_units || s->cap_bytes <= floor)
                        continue;
                uint64_t give = s->cap_bytes - floor;
                if (give > excess)
                        give = excess;
                if (s->cap_bytes == s->demand_bytes)
                        evict ? b->cuts++ : b->demotions++;
                s->cap_bytes -= give;
                excess -= give;
        }
        return excess;
}

/* Takes excess bytes from the caps of v: by lowering precision first, in every session that can,
 * and only then by eviction. */
static void cut_both(struct budget *b, struct session **v, uint32_t n, const struct tenant *only,
                     uint64_t excess) {
        cut(b, v, n, only, cut(b, v, n, only, excess, false), true);
}

uint32_t budget_lowering_chunks(struct kvcd *d) {
        struct session *s;
        uint32_t n = 0;
        if (!d->budget.n_lowering) /* the common case: no session lowers precision per token */
                return 0;
        for (uint32_t it = 0; (s = idmap_next(&d->sessions, &it));)
                for (uint32_t t = 1; s->token_tiers && t < s->n_tiers; t++) {
                        uint64_t owner = session_pool_owner(s);
                        uint32_t unit = session_unit_bytes(s, t);
                        if (pool_owner_carved(d->pool, owner, unit))
                                continue;
                        /* counted once per owner and size: a session before it with the same */
                        bool seen = false;
                        struct session *x;
                        for (uint32_t it2 = 0; !seen && (x = idmap_next(&d->sessions, &it2)) && x != s;)
                                for (uint32_t u = 1; x->token_tiers && u < x->n_tiers && !seen; u++)
                                        seen = session_pool_owner(x) == owner && session_unit_bytes(x, u) == unit;
                        n += !seen;
                }
        return n;
}

/* The capacity the arbiter counts: the pool's, less what no unit can use, the chunks kept back
 * for lowering precision and the squeeze. */
static uint64_t arbiter_capacity(struct kvcd *d) {
        uint64_t cap = capacity(d), off = pool_waste_bytes(d->pool) + d->budget.squeeze +
                                          (uint64_t)budget_lowering_chunks(d) * pool_chunk_bytes(d->pool);
        return cap > off ? cap - off : 0;
}

uint64_t budget_squeeze_for(struct kvcd *d, uint64_t wanted) {
        uint64_t keep = d->budget.squeeze, u = used(d);
        d->budget.squeeze = 0;
        uint64_t eff = arbiter_capacity(d), target = u > wanted ? u - wanted : 0;
        d->budget.squeeze = keep;
        return eff > target ? eff - target : 0;
}

void budget_limits_changed(struct kvcd *d) {
        d->budget.dirty = true;
        d->budget.pressure = true; /* even when nothing is short: caps that were a maximum change */
}

void budget_arbitrate(struct kvcd *d) {
        struct budget *b = &d->budget;
        if (!b->dirty)
                return;
        b->dirty = false;
        uint64_t cap = arbiter_capacity(d);
        bool short_ = b->demand_bytes > cap;
        for (uint32_t i = 0; i < b->n_tenants && !short_; i++)
                short_ = b->tenants[i]->demand_bytes > budget_quota(b, b->tenants[i]);
        if (!short_ && !b->pressure)
                return; /* nothing was cut, nothing to cut: every cap is its maximum */

        uint32_t n = d->sessions.n;
        struct session **v = malloc((n ? n : 1) * sizeof(*v));
        if (!v) {
                b->dirty = true; /* try again at the next event */
                return;
        }
        n = all_sessions(d, v, n);
        b->arbitrations++;
        b->pressure = short_;
        for (uint32_t i = 0; i < n; i++)
                v[i]->cap_bytes = short_ ? v[i]->demand_bytes : budget_max(d, v[i]);
        if (short_) {
                qsort(v, n, sizeof(*v), shrink_order);
                uint64_t total = 0;
                for (uint32_t i = 0; i < b->n_tenants; i++) {
                        struct tenant *t = b->tenants[i];
                        uint64_t q = budget_quota(b, t);
                        if (t->demand_bytes > q)
                                cut_both(b, v, n, t, t->demand_bytes - q);
                }
                for (uint32_t i = 0; i < n; i++)
                        total += v[i]->cap_bytes;
                if (total > cap)
                        cut_both(b, v, n, NULL, total - cap);
        }
        free(v);
}

int budget_set_tenant(struct kvcd *d, const char *name, bool set_quota, uint64_t quota, bool set_binding,
                      int64_t uid, int64_t gid, char *why, size_t why_len) {
        struct budget *b = &d->budget;
        if (!*name) {
                if (set_binding) {
                        snprintf(why, why_len, "the default quota has no binding");
                        return -EINVAL;
                }
                b->default_quota = quota ? quota : BUDGET_NO_LIMIT;
                b->dirty = true;
                return 0;
        }
        struct tenant *t = find(b, name);
        if (set_binding && strcmp(name, "default") == 0 && (uid >= 0 || gid >= 0)) {
                snprintf(why, why_len, "the default tenant cannot be bound to a uid or gid");
                return -EINVAL;
        }
        if (set_quota && quota && t && quota < t->reserved_bytes) {
                snprintf(why, why_len,
                         "tenant %s: a quota of %.1f MiB is below the %.1f MiB guaranteed to its sessions",
                         name, mib(quota), mib(t->reserved_bytes));
                return -EBUSY;
        }
        if (!t && !(t = add(b, name))) {
                snprintf(why, why_len, "too many tenants, or a name over 64 characters");
                return -ENOSPC;
        }
        t->declared = true;
        if (set_quota)
                t->quota_bytes = quota ? quota : BUDGET_NO_LIMIT;
        if (set_binding) {
                t->uid = uid;
                t->gid = gid;
        }
        budget_limits_changed(d);
        return 0;
}

int budget_set_session(struct kvcd *d, struct session *s, bool set_min, uint64_t min, bool set_max,
                       uint64_t max, bool set_priority, int32_t priority, char *why, size_t why_len) {
        struct budget *b = &d->budget;
        struct tenant *t = s->ten;
        uint64_t new_min = set_min ? (min > s->floor_bytes ? min : s->floor_bytes) : s->min_bytes;
        uint64_t new_max = set_max ? (max ? max : BUDGET_NO_LIMIT) : s->max_bytes;
        uint64_t quota = budget_quota(b, t), cap = capacity(d);
        if (new_max < new_min) {
                snprintf(why, why_len, "maximum %llu bytes below the minimum %llu",
                         (unsigned long long)new_max, (unsigned long long)new_min);
                return -EINVAL;
        }
        if (b->reserved_bytes - s->min_bytes + new_min > cap) {
                snprintf(why, why_len,
                         "node capacity: a minimum of %.2f MiB does not fit beside the %.1f MiB guaranteed "
                         "to others",
                         mib(new_min), mib(b->reserved_bytes - s->min_bytes));
                return -EBUSY;
        }
        if (t->reserved_bytes - s->min_bytes + new_min > quota) {
                snprintf(why, why_len,
                         "quota of tenant %s: a minimum of %.2f MiB does not fit beside the %.1f MiB "
                         "guaranteed to its other sessions",
                         t->name, mib(new_min), mib(t->reserved_bytes - s->min_bytes));
                return -EBUSY;
        }
        uint64_t before = unmet(s);
        t->reserved_bytes += new_min - s->min_bytes;
        b->reserved_bytes += new_min - s->min_bytes;
        s->min_bytes = new_min;
        s->max_bytes = new_max;
        uint64_t after = unmet(s);
        t->unmet_bytes += after - before;
        b->unmet_bytes += after - before;
        if (set_priority)
                s->priority = priority;
        set_demand(d, s, s->demand_bytes);
        if (s->cap_bytes > budget_max(d, s))
                s->cap_bytes = budget_max(d, s); /* shrinks at its next step */
        budget_limits_changed(d);
        return 0;
}

int budget_check_capacity(const struct kvcd *d, uint64_t bytes, char *why, size_t why_len) {
        if (bytes < d->budget.reserved_bytes) {
                snprintf(why, why_len,
                         "a capacity of %.1f MiB is below the %.1f MiB guaranteed to the sessions' minimums",
                         mib(bytes), mib(d->budget.reserved_bytes));
                return -EBUSY;
        }
        return 0;
}
