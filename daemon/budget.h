/* budget.h: who may hold how much of the pool. Owns the tenants, each session's limits, and the
 * arbiter that decides what each session may hold while memory is short.
 *
 * Three limits nest: the node's capacity (the pool's), a quota per tenant, and per session a
 * minimum, a maximum and a priority. A session's minimum is guaranteed: admission refuses a
 * session whose minimum does not fit beside the minimums already guaranteed (in the node and in
 * its tenant), and no session grows into memory another session's minimum still needs. Above
 * their minimums sessions share what is left.
 *
 * Each step a session's policy demands bytes (what it wants to hold after this step). While the
 * demands fit, every session may grow to its maximum. When they do not, the arbiter cuts demands,
 * first from the sessions of lowest priority and, among equals, highest confidence (the ones that
 * lose least by forgetting), never below a minimum, until they fit. It lowers precision before it
 * makes anyone evict: a first round cuts only the sessions whose policy gives each token its tier
 * (the ladder), each no lower than the bytes it needs with every token at its lowest tier, and a
 * second round, only if that was not enough, cuts every session towards its minimum (the ladder
 * then evicts, the others as ever). A cut session's cap becomes
 * the tokens its policy must compact to, so it is shrunk by ordinary plans, and its memory counts
 * as free once the client acknowledged the plan. Caps are recomputed whenever demands change, so
 * sessions grow back as soon as memory frees up.
 *
 * Tenants: a tenant is a name the operator binds to a uid or a gid (kvcd --tenant, kvcctl budget
 * set --tenant). A session names its tenant; a client may charge a bound tenant only when its uid,
 * or its primary gid, is the binding (root may charge any). A session that names none is charged
 * to the tenant bound to its uid, else its gid, else "default". A name nobody declared becomes a
 * tenant with the default quota, bound to the uid of the client that used it first, and goes away
 * with its last session.
 */
#pragma once

#include <stdbool.h>
#include <stdint.h>

#include "kvc.pb-c.h"

struct kvcd;
struct client;
struct session;

#define BUDGET_NO_LIMIT    UINT64_MAX
#define BUDGET_MAX_TENANTS 256u

struct tenant {
        char name[65];
        bool declared;
        int64_t uid, gid;     /* the binding; -1: none */
        uint64_t quota_bytes; /* BUDGET_NO_LIMIT: the default quota applies */
        uint64_t used_bytes;
        uint64_t reserved_bytes; /* sum of its sessions' minimums */
        uint64_t unmet_bytes;    /* sum over its sessions of what their minimums still lack */
        uint64_t demand_bytes;   /* sum of its sessions' demands */
        uint64_t shared_bytes;   /* shared prefix blocks its sessions published (in used_bytes too) */
        uint32_t n_sessions;
        uint64_t refusals; /* its sessions' opens and reservations refused (kvcd_tenant_refusals_total) */
};

struct budget {
        struct tenant *tenants[BUDGET_MAX_TENANTS];
        uint32_t n_tenants;
        uint64_t default_quota; /* BUDGET_NO_LIMIT: none */
        uint64_t reserved_bytes;
        uint64_t unmet_bytes;
        uint64_t demand_bytes;
        bool pressure; /* the last arbitration cut something */
        bool dirty;    /* demands or limits changed since the last arbitration */
        uint64_t arbitrations;
        uint64_t cuts;       /* sessions given a cap that makes them evict, over all arbitrations */
        uint64_t demotions;  /* sessions given a cap they meet by lowering precision (the ladder) */
        /* Growth the pool refused though the bytes were free (the chunks kept back for lowering
         * precision, or carved for the lower tiers' sizes), while sessions that lower precision
         * are open: the arbiter takes squeeze off the capacity while requests wait, so that
         * sessions give back blocks of the size wanted; 0 once nobody waits. */
        uint64_t wanted_room, squeeze;
        uint32_t n_lowering; /* sessions whose policy gives each token its tier */
};

void budget_init(struct budget *b);
void budget_done(struct budget *b);

/* "NAME[:uid=N][:gid=N][:quota=BYTES]" (kvcd --tenant). -EINVAL with a reason. */
int budget_declare(struct budget *b, const char *spec, char *why, size_t why_len);
/* kvcctl budget set --tenant: quota and/or binding of a tenant, declared if it was not. */
int budget_set_tenant(struct kvcd *d, const char *name, bool set_quota, uint64_t quota, bool set_binding,
                      int64_t uid, int64_t gid, char *why, size_t why_len);
/* kvcctl budget set --session: -EBUSY (nothing changes) when a new minimum does not fit. */
int budget_set_session(struct kvcd *d, struct session *s, bool set_min, uint64_t min, bool set_max,
                       uint64_t max, bool set_priority, int32_t priority, char *why, size_t why_len);
/* Whether the capacity may go down to bytes: -EBUSY when the guaranteed minimums need more. */
int budget_check_capacity(const struct kvcd *d, uint64_t bytes, char *why, size_t why_len);

uint64_t budget_quota(const struct budget *b, const struct tenant *t);
/* The most the session may hold: its own maximum, its tenant's quota, the capacity. */
uint64_t budget_max(const struct kvcd *d, const struct session *s);

/* Admission: resolves the session's tenant for client c (check_creds false after a restart,
 * when the client was checked at open), clamps its limits, and guarantees its minimum. -ENOSPC
 * naming the limit that bit, -EACCES for a tenant bound to someone else; nothing changes then. */
int budget_admit(struct kvcd *d, struct session *s, struct client *c, const Kvc__OpenSession *m,
                 bool check_creds, uint64_t floor, char *why, size_t why_len);
/* The session goes: its minimum and its tenant's share are given back. */
void budget_leave(struct kvcd *d, struct session *s);

/* Whether the session may take n more bytes now: its cap, its tenant's quota, and the minimums
 * of the others. -ENOSPC with the limit that bit (d->refusal_own set when it was its own cap). */
int budget_may_grow(struct kvcd *d, const struct session *s, uint64_t n, char *why, size_t why_len);
/* The chunks the pool keeps back from growth at the dtype: one for each owner and lower tier's
 * block size of the sessions that lower precision per token that has no chunk carved for it yet
 * (the pool carves a chunk for one block size, and a demotion's blocks come before the ones it
 * frees: without a chunk to put them in, a full pool could not lower precision at all). */
uint32_t budget_lowering_chunks(struct kvcd *d);
/* The squeeze that makes the arbiter count the capacity as the bytes in use less wanted (growth
 * the pool refused for want of chunks of its block size, though bytes were free). */
uint64_t budget_squeeze_for(struct kvcd *d, uint64_t wanted);
/* The tenant's published prefix blocks change by delta (prefix.c): they count in its use. */
void budget_charge_shared(struct kvcd *d, struct tenant *t, int64_t delta);
/* The session's bytes change by delta (blocks granted, or freed after PlanApplied). */
void budget_charge(struct kvcd *d, struct session *s, int64_t delta);
/* The session demands bytes from now on (clamped to its limits). */
void budget_demand(struct kvcd *d, struct session *s, uint64_t bytes);
/* A capacity, quota or session limit changed: every cap is recomputed at the next arbitration. */
void budget_limits_changed(struct kvcd *d);
/* Recomputes every cap when something changed. */
void budget_arbitrate(struct kvcd *d);
