/* handlers.c: one row per request kind, one handler per row.
 *
 * handle_frame() decodes and validates a frame (wire.c), finds the row for its kind, checks the
 * row's conditions (the socket it may arrive on, whether the peer must have said Hello), runs the
 * handler and sends what it built: its reply, or an Error with the handler's code and reason.
 * Handlers build replies in the reply arena; nothing survives the frame.
 *
 * Every request gets exactly one reply, except PlanApplied, which is answered only when refused
 * (the client does not wait for it).
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zmq.h>

#include "admin.h"
#include "backend.h"
#include "clock.h"
#include "handlers.h"
#include "kvcd.h"
#include "log.h"
#include "policy/policy.h"
#include "pool.h"
#include "prefix.h"

struct request {
        struct kvcd *d;
        struct client *client; /* NULL before Hello and on the admin socket */
        const uint8_t *rid;
        size_t rid_len;
        const Kvc__Envelope *env;
        Kvc__Envelope reply;
        bool no_reply;
        char why[WIRE_MAX_MESSAGE];
};

static int handle_hello(struct request *rq) {
        struct kvcd *d = rq->d;
        const Kvc__Hello *m = rq->env->hello;
        if (rq->client) {
                snprintf(rq->why, sizeof(rq->why), "this peer already said hello");
                return -EALREADY;
        }
        struct client *c = client_by_token(d, m->token.data);
        if (!c || c->bound) {
                snprintf(rq->why, sizeof(rq->why), "unknown token: connect the fd channel first");
                return -EPERM;
        }
        if (rq->rid_len > KVCD_ROUTING_ID_MAX)
                return -EINVAL;
        memcpy(c->rid, rq->rid, rq->rid_len);
        c->rid_len = (uint8_t)rq->rid_len;
        c->bound = true;
        snprintf(c->name, sizeof(c->name), "%s", m->client_name ? m->client_name : "");

        Kvc__Welcome *w = wire_arena_alloc(d->out, sizeof(*w));
        if (!w)
                return -ENOMEM;
        kvc__welcome__init(w);
        w->client_id = c->id;
        w->chunk_bytes = pool_chunk_bytes(d->pool);
        w->pool_bytes = pool_va_bytes(d->pool);
        w->block_tokens = 16;
        w->backend = (char *)d->backend->name;
        w->daemon_version = KVCD_VERSION;
        w->resumable = restart_managed(d);
        rq->reply.body_case = KVC__ENVELOPE__BODY_WELCOME;
        rq->reply.welcome = w;
        return 0;
}

static Kvc__SessionOpened *opened_reply(struct kvcd *d, struct session *s) {
        Kvc__SessionOpened *o = wire_arena_alloc(d->out, sizeof(*o));
        if (!o)
                return NULL;
        kvc__session_opened__init(o);
        o->session_id = s->id;
        o->token.data = s->token;
        o->token.len = sizeof(s->token);
        o->block_bytes = s->layout.block_bytes;
        o->block_tokens = s->layout.block_tokens;
        o->plan_offset = s->plan_offset;
        o->plan_bytes = (uint64_t)s->plan_units * s->layout.block_bytes;
        o->ema_gamma = s->policy->ema_gamma;
        o->max_layer_tokens = s->max_layer_tokens;
        o->policy = s->policy_name;
        o->budget_tokens = s->budget_tokens;
        o->budget_bytes = s->budget_bytes;
        o->q8_block_bytes = s->n_tiers == 2 && s->tiers[1].dtype == BLOCK_DTYPE_Q8 ? s->tiers[1].block_bytes : 0;
        if (s->n_tiers > 1) {
                char **names = wire_arena_alloc(d->out, (s->n_tiers - 1) * sizeof(*names));
                uint64_t *bytes = wire_arena_alloc(d->out, (s->n_tiers - 1) * sizeof(*bytes));
                if (!names || !bytes)
                        return NULL;
                for (uint32_t t = 1; t < s->n_tiers; t++) {
                        names[t - 1] = (char *)session_tier_name(s, t);
                        bytes[t - 1] = s->tiers[t].block_bytes;
                }
                o->tiers = names;
                o->n_tiers = s->n_tiers - 1;
                o->tier_block_bytes = bytes;
                o->n_tier_block_bytes = s->n_tiers - 1;
        }
        o->rotation_seed = s->rotation_seed;
        o->min_bytes = s->min_bytes;
        o->max_bytes = budget_max(d, s);
        o->priority = s->priority;
        o->tenant = s->tenant;
        if (s->n_shared_blocks) { /* the prefix it attached: the first blocks of every layer */
                Kvc__LayerBlocks **lb = wire_arena_alloc(d->out, s->n_layers * sizeof(*lb));
                if (!lb)
                        return NULL;
                for (uint32_t l = 0; l < s->n_layers; l++) {
                        if (!(lb[l] = wire_arena_alloc(d->out, sizeof(**lb))))
                                return NULL;
                        kvc__layer_blocks__init(lb[l]);
                        lb[l]->layer = l;
                        lb[l]->n_blocks = s->n_shared_blocks;
                        lb[l]->blocks = s->layers[l].t[0].blocks;
                }
                o->attached = lb;
                o->n_attached = s->n_layers;
                o->shared_tokens = s->n_shared_blocks * s->layout.block_tokens;
        }
        o->mask_offset = s->mask_offset;
        o->mask_stride = s->mask_stride;
        return o;
}

static void log_opened(const struct kvcd *d, const struct session *s) {
        log_info(
                "session %llu opened by client %llu: policy %s budget %u, %u layers x %u kv heads x %u dims, "
                "tenant %s, %llu..%llu bytes, priority %d%s",
                (unsigned long long)s->id, (unsigned long long)s->owner->id, s->policy_name, s->budget_tokens,
                s->n_layers, s->n_kv_heads, s->head_dim, s->tenant, (unsigned long long)s->min_bytes,
                (unsigned long long)budget_max(d, s), s->priority,
                s->model_key ? ", sharing its prefix" : "");
}

/* A request for memory refused: counted by reason (metrics.h), and for its tenant when known. */
static void count_refusal(struct kvcd *d, struct tenant *t, enum refusal_reason reason) {
        d->n.refusals[reason]++;
        if (t)
                t->refusals++;
}

static int handle_open_session(struct request *rq) {
        struct kvcd *d = rq->d;
        struct session *s;
        if (d->draining) {
                d->n.admission_refusals++;
                count_refusal(d, NULL, REFUSAL_DRAINING);
                snprintf(rq->why, sizeof(rq->why), "kvcd is draining: no new sessions");
                return -ESHUTDOWN;
        }
        d->refusal_reason = REFUSAL_CAPACITY;
        int r = session_open(d, rq->client, rq->env->open_session, &s, rq->why, sizeof(rq->why));
        if (r == -ENOSPC || r == -EACCES) { /* budget_admit counted it for the tenant */
                d->n.admission_refusals++;
                count_refusal(d, NULL, r == -EACCES ? REFUSAL_TENANT : d->refusal_reason);
        }
        if (r < 0)
                return r;
        if (r == 1) { /* answered when its plan buffer is there */
                s->wait.request_id = rq->env->request_id;
                rq->no_reply = true;
                return 0;
        }
        Kvc__SessionOpened *o = opened_reply(d, s);
        if (!o) {
                session_close(d, s);
                return -ENOMEM;
        }
        rq->reply.body_case = KVC__ENVELOPE__BODY_SESSION_OPENED;
        rq->reply.session_opened = o;
        log_opened(d, s);
        return 0;
}

/* The session id names, if it is this client's. Another client's session is answered exactly as a
 * missing one (ENOENT, the same message): a different answer would tell a client which ids exist
 * (docs/protocol.md, docs/security.md). */
static int lookup(struct request *rq, uint64_t id, struct session **ret) {
        int r = session_lookup(rq->d, rq->client, id, ret);
        if (r == -ENOENT || r == -EPERM) {
                snprintf(rq->why, sizeof(rq->why), "no session %llu", (unsigned long long)id);
                return -ENOENT;
        }
        return r;
}

static int handle_reserve(struct request *rq) {
        const Kvc__Reserve *m = rq->env->reserve;
        struct session *s;
        Kvc__Grant *g;
        int r = lookup(rq, m->session_id, &s);
        if (r < 0)
                return r;
        if (s->wait.kind != WAIT_NONE) {
                snprintf(rq->why, sizeof(rq->why), "session %llu already waits for memory",
                         (unsigned long long)s->id);
                return -EBUSY;
        }
        rq->d->refusal_reason = REFUSAL_CAPACITY;
        r = session_reserve(rq->d, s, m->n_tokens, &g, rq->why, sizeof(rq->why));
        if (r == -EINPROGRESS) { /* answered when the arbiter's plans have freed memory */
                session_wait_for_memory(rq->d, s, WAIT_RESERVE, m->n_tokens, rq->env->request_id);
                rq->no_reply = true;
                return 0;
        }
        if (r == -ENOSPC)
                count_refusal(rq->d, s->ten, rq->d->refusal_reason);
        if (r < 0)
                return r;
        rq->reply.body_case = KVC__ENVELOPE__BODY_GRANT;
        rq->reply.grant = g;
        return 0;
}

static Kvc__Error *error_new(struct kvcd *d, int code, uint64_t session_id, const char *why) {
        Kvc__Error *e = wire_arena_alloc(d->out, sizeof(*e));
        if (!e)
                return NULL;
        kvc__error__init(e);
        e->code = code;
        e->session_id = session_id;
        e->message = wire_arena_strdup(d->out, why);
        if (!e->message)
                e->message = "";
        return e;
}

static int handle_step_batch(struct request *rq) {
        struct kvcd *d = rq->d;
        const Kvc__StepBatch *m = rq->env->step_batch;
        Kvc__PlanBatch *pb = wire_arena_alloc(d->out, sizeof(*pb));
        Kvc__Plan **plans = wire_arena_alloc(d->out, m->n_steps * sizeof(*plans));
        Kvc__Grant **grants = wire_arena_alloc(d->out, m->n_steps * sizeof(*grants));
        Kvc__Error **errors = wire_arena_alloc(d->out, m->n_steps * sizeof(*errors));
        Kvc__SessionShared **shared = wire_arena_alloc(d->out, m->n_steps * sizeof(*shared));
        if (!pb || !plans || !grants || !errors || !shared)
                return -ENOMEM;
        kvc__plan_batch__init(pb);
        d->n.step_batches++;
        pb->plans = plans;
        pb->grants = grants;
        pb->errors = errors;
        pb->shared = shared;

        for (size_t i = 0; i < m->n_steps; i++) {
                const Kvc__Step *st = m->steps[i];
                struct session *s;
                Kvc__Plan *p;
                Kvc__Grant *g;
                char why[WIRE_MAX_MESSAGE] = "";
                int r = lookup(rq, st->session_id, &s);
                if (r == 0)
                        r = session_step(d, s, st, &p, &g, why, sizeof(why));
                else
                        snprintf(why, sizeof(why), "%s", rq->why);
                if (r < 0) {
                        d->n.errors++;
                        Kvc__Error *e = error_new(d, -r, st->session_id, why);
                        if (e)
                                pb->errors[pb->n_errors++] = e;
                        continue;
                }
                if (p)
                        pb->plans[pb->n_plans++] = p;
                if (g)
                        pb->grants[pb->n_grants++] = g;
                if (s->just_published) {
                        Kvc__SessionShared *sh = wire_arena_alloc(d->out, sizeof(*sh));
                        if (!sh)
                                return -ENOMEM;
                        kvc__session_shared__init(sh);
                        sh->session_id = s->id;
                        sh->shared_tokens = s->n_shared_blocks * s->layout.block_tokens;
                        pb->shared[pb->n_shared++] = sh;
                        s->just_published = false;
                }
        }
        rq->reply.body_case = KVC__ENVELOPE__BODY_PLAN_BATCH;
        rq->reply.plan_batch = pb;
        return 0;
}

static int handle_plan_applied(struct request *rq) {
        const Kvc__PlanApplied *m = rq->env->plan_applied;
        struct session *s;
        int r = lookup(rq, m->session_id, &s);
        if (r == 0)
                r = session_plan_applied(rq->d, s, m, rq->why, sizeof(rq->why));
        rq->no_reply = r == 0;
        if (r == 0) { /* the next link of a demotion, or blocks left to move out of a chunk being
                         drained: the next plan of moves */
                plan_follow(rq->d, s);
                relocate_kick(rq->d, s);
        }
        return r;
}

static int handle_close_session(struct request *rq) {
        struct kvcd *d = rq->d;
        struct session *s;
        int r = lookup(rq, rq->env->close_session->session_id, &s);
        if (r < 0)
                return r;
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
        log_info("session %llu closed: %llu steps, %llu plans, peak %u tokens per layer",
                 (unsigned long long)s->id, (unsigned long long)s->stats.steps,
                 (unsigned long long)s->stats.plans, s->stats.peak_tokens);
        session_close(d, s);
        rq->reply.body_case = KVC__ENVELOPE__BODY_SESSION_CLOSED;
        rq->reply.session_closed = c;
        return 0;
}

static int handle_status(struct request *rq) {
        struct kvcd *d = rq->d;
        struct pool_stats ps;
        Kvc__Status *s = wire_arena_alloc(d->out, sizeof(*s));
        if (!s)
                return -ENOMEM;
        pool_get_stats(d->pool, &ps);
        kvc__status__init(s);
        s->version = KVCD_VERSION;
        s->backend = (char *)d->backend->name;
        s->uptime_usec = now_usec() - d->started_usec;
        s->capacity_bytes = ps.capacity_bytes;
        s->used_bytes = ps.used_bytes;
        s->chunk_bytes = ps.chunk_bytes;
        s->chunks_total = ps.chunks_total;
        s->chunks_in_use = ps.chunks_owned;
        s->chunks_reclaiming = ps.chunks_reclaiming;
        s->chunks_held = client_held_chunks(d);
        s->clients = d->n_clients;
        s->sessions = d->sessions.n;
        s->steps_total = d->n.steps;
        s->plans_total = d->n.plans;
        s->client_deaths = d->n.client_deaths;
        s->errors_total = d->n.errors;
        s->draining = d->draining;
        uint64_t by_dtype[SESSION_DTYPES] = { 0 };
        const struct session *x;
        for (uint32_t it = 0; (x = idmap_next(&d->sessions, &it));)
                session_add_tier_bytes(x, by_dtype);
        s->int8_bytes = by_dtype[BLOCK_DTYPE_Q8];
        if (session_tier_list(d->out, by_dtype, &s->tier_bytes, &s->n_tier_bytes) < 0)
                return -ENOMEM;
        prefix_totals(d, &s->shared_blocks, &s->shared_bytes);
        s->step_batches_total = d->n.step_batches;
        int r = admin_status_extras(d, s);
        if (r < 0)
                return r;
        rq->reply.body_case = KVC__ENVELOPE__BODY_STATUS;
        rq->reply.status = s;
        return 0;
}

static int by_session_id(const void *a, const void *b) {
        uint64_t x = (*(Kvc__SessionInfo *const *)a)->session_id,
                 y = (*(Kvc__SessionInfo *const *)b)->session_id;
        return x < y ? -1 : x > y;
}

static int handle_list_sessions(struct request *rq) {
        struct kvcd *d = rq->d;
        Kvc__SessionList *l = wire_arena_alloc(d->out, sizeof(*l));
        Kvc__SessionInfo **v = wire_arena_alloc(d->out, d->sessions.n * sizeof(*v));
        if (!l || !v)
                return -ENOMEM;
        kvc__session_list__init(l);
        l->sessions = v;
        uint64_t now = now_usec();
        struct session *s;
        for (uint32_t it = 0; (s = idmap_next(&d->sessions, &it));) { /* parked and orphaned ones too */
                Kvc__SessionInfo *i = wire_arena_alloc(d->out, sizeof(*i));
                if (!i)
                        return -ENOMEM;
                kvc__session_info__init(i);
                i->session_id = s->id;
                i->pid = (uint32_t)s->owner->pid;
                i->uid = s->owner->uid;
                i->tenant = s->tenant;
                i->policy = s->policy_name;
                i->budget_tokens = s->budget_tokens;
                i->tokens = session_tokens(s);
                i->blocks = session_blocks(s);
                i->bytes = session_bytes(s);
                i->confidence = s->confidence;
                i->steps = s->stats.steps;
                i->plans = s->stats.plans;
                i->age_usec = now - s->opened_usec;
                i->peak_tokens = s->stats.peak_tokens;
                i->n_layers = s->n_layers;
                i->client_name = s->owner->name;
                i->min_bytes = s->min_bytes;
                i->max_bytes = budget_max(d, s);
                i->cap_bytes = s->cap_bytes;
                i->priority = s->priority;
                uint64_t last = s->stepped && s->last_step_usec ? s->last_step_usec : s->opened_usec;
                i->idle_usec = now > last ? now - last : 0;
                uint64_t by_dtype[SESSION_DTYPES] = { 0 };
                session_add_tier_bytes(s, by_dtype);
                i->int8_bytes = by_dtype[BLOCK_DTYPE_Q8];
                i->bits_per_value = session_bits_per_value(s, by_dtype);
                if (session_tier_list(d->out, by_dtype, &i->tier_bytes, &i->n_tier_bytes) < 0)
                        return -ENOMEM;
                l->sessions[l->n_sessions++] = i;
        }
        qsort(l->sessions, l->n_sessions, sizeof(*l->sessions), by_session_id);
        rq->reply.body_case = KVC__ENVELOPE__BODY_SESSION_LIST;
        rq->reply.session_list = l;
        return 0;
}

static int handle_resume(struct request *rq) {
        struct kvcd *d = rq->d;
        int r = restart_resume(d, rq->client, rq->env->resume, rq->why, sizeof(rq->why));
        if (r < 0)
                return r;
        Kvc__Resumed *m = wire_arena_alloc(d->out, sizeof(*m));
        if (!m)
                return -ENOMEM;
        kvc__resumed__init(m);
        m->session_id = rq->env->resume->session_id;
        rq->reply.body_case = KVC__ENVELOPE__BODY_RESUMED;
        rq->reply.resumed = m;
        return 0;
}

static int handle_handoff_export(struct request *rq) {
        struct kvcd *d = rq->d;
        Kvc__HandoffTicket *t = wire_arena_alloc(d->out, sizeof(*t));
        uint8_t *ticket = wire_arena_alloc(d->out, WIRE_TOKEN_BYTES);
        if (!t || !ticket)
                return -ENOMEM;
        int r = handoff_export(d, rq->client, rq->env->handoff_export, ticket, rq->why, sizeof(rq->why));
        if (r < 0)
                return r;
        kvc__handoff_ticket__init(t);
        t->session_id = rq->env->handoff_export->session_id;
        t->ticket.data = ticket;
        t->ticket.len = WIRE_TOKEN_BYTES;
        rq->reply.body_case = KVC__ENVELOPE__BODY_HANDOFF_TICKET;
        rq->reply.handoff_ticket = t;
        return 0;
}

static int handle_handoff_import(struct request *rq) {
        struct kvcd *d = rq->d;
        struct session *s;
        /* the reply's room first: once imported, the session is the importer's */
        Kvc__HandoffImported *m = wire_arena_alloc(d->out, sizeof(*m));
        Kvc__Geometry *g = wire_arena_alloc(d->out, sizeof(*g));
        Kvc__ResumeLayer *layers = wire_arena_alloc(d->out, WIRE_MAX_LAYERS * sizeof(*layers));
        Kvc__ResumeLayer **lp = wire_arena_alloc(d->out, WIRE_MAX_LAYERS * sizeof(*lp));
        if (!m || !g || !layers || !lp)
                return -ENOMEM;
        int r = handoff_import(d, rq->client, rq->env->handoff_import, &s, rq->why, sizeof(rq->why));
        if (r < 0)
                return r;
        kvc__handoff_imported__init(m);
        if (!(m->opened = opened_reply(d, s)))
                return -ENOMEM; /* not with a reply arena sized for the largest reply */
        kvc__geometry__init(g);
        g->n_layers = s->n_layers;
        g->n_heads = s->n_heads;
        g->n_kv_heads = s->n_kv_heads;
        g->head_dim = s->head_dim;
        g->dtype = s->dtype;
        g->max_tokens = s->max_tokens;
        m->geometry = g;
        for (uint32_t l = 0; l < s->n_layers; l++) {
                if (session_resume_layer(d->out, s, l, &layers[l]) < 0)
                        return -ENOMEM;
                lp[l] = &layers[l];
        }
        m->n_layers = s->n_layers;
        m->layers = lp;
        m->last_step = s->last_step;
        m->stepped = s->stepped;
        m->last_plan_id = s->next_plan_id;
        m->prompt_tokens = s->prompt_tokens;
        rq->reply.body_case = KVC__ENVELOPE__BODY_HANDOFF_IMPORTED;
        rq->reply.handoff_imported = m;
        return 0;
}

static int handle_evict(struct request *rq) {
        return admin_evict(rq->d, rq->env->evict->session_id, &rq->reply, rq->why, sizeof(rq->why));
}

static int handle_drain(struct request *rq) {
        return admin_drain(rq->d, rq->env->drain, rq->rid, rq->rid_len, rq->env->request_id, &rq->reply,
                           &rq->no_reply);
}

static int handle_audit(struct request *rq) {
        return admin_audit(rq->d, &rq->reply);
}

static int handle_metrics(struct request *rq) {
        return admin_metrics(rq->d, &rq->reply);
}

static int handle_budget_get(struct request *rq) {
        return admin_budgets(rq->d, &rq->reply);
}

static int handle_budget_set(struct request *rq) {
        return admin_budget_set(rq->d, rq->env->budget_set, &rq->reply, rq->why, sizeof(rq->why));
}

static const struct {
        Kvc__Envelope__BodyCase body;
        enum channel channel;
        bool needs_hello;
        int (*handle)(struct request *rq);
} handlers[] = {
        { KVC__ENVELOPE__BODY_HELLO, CHANNEL_CLIENT, false, handle_hello },
        { KVC__ENVELOPE__BODY_OPEN_SESSION, CHANNEL_CLIENT, true, handle_open_session },
        { KVC__ENVELOPE__BODY_RESERVE, CHANNEL_CLIENT, true, handle_reserve },
        { KVC__ENVELOPE__BODY_STEP_BATCH, CHANNEL_CLIENT, true, handle_step_batch },
        { KVC__ENVELOPE__BODY_PLAN_APPLIED, CHANNEL_CLIENT, true, handle_plan_applied },
        { KVC__ENVELOPE__BODY_CLOSE_SESSION, CHANNEL_CLIENT, true, handle_close_session },
        { KVC__ENVELOPE__BODY_RESUME, CHANNEL_CLIENT, true, handle_resume },
        { KVC__ENVELOPE__BODY_HANDOFF_EXPORT, CHANNEL_CLIENT, true, handle_handoff_export },
        { KVC__ENVELOPE__BODY_HANDOFF_IMPORT, CHANNEL_CLIENT, true, handle_handoff_import },
        { KVC__ENVELOPE__BODY_STATUS_REQUEST, CHANNEL_ADMIN, false, handle_status },
        { KVC__ENVELOPE__BODY_LIST_SESSIONS, CHANNEL_ADMIN, false, handle_list_sessions },
        { KVC__ENVELOPE__BODY_EVICT, CHANNEL_ADMIN, false, handle_evict },
        { KVC__ENVELOPE__BODY_DRAIN, CHANNEL_ADMIN, false, handle_drain },
        { KVC__ENVELOPE__BODY_AUDIT_REQUEST, CHANNEL_ADMIN, false, handle_audit },
        { KVC__ENVELOPE__BODY_METRICS_REQUEST, CHANNEL_ADMIN, false, handle_metrics },
        { KVC__ENVELOPE__BODY_BUDGET_REQUEST, CHANNEL_ADMIN, false, handle_budget_get },
        { KVC__ENVELOPE__BODY_BUDGET_SET, CHANNEL_ADMIN, false, handle_budget_set },
};

/* One waiting request (session.wait) tried again: answered when done, refused at its deadline. */
static void retry_wait(struct kvcd *d, struct session *s, uint64_t now) {
        char why[WIRE_MAX_MESSAGE] = "";
        Kvc__Envelope env = KVC__ENVELOPE__INIT;
        Kvc__Grant *g = NULL;
        bool open = s->wait.kind == WAIT_OPEN;
        d->refusal_reason = REFUSAL_CAPACITY;
        int r = open ? session_retry_open(d, s, why, sizeof(why))
                     : session_retry_reserve(d, s, &g, why, sizeof(why));
        if (r == -EINPROGRESS && now < s->wait.deadline_usec)
                return;
        env.version = WIRE_VERSION;
        env.request_id = s->wait.request_id;
        if (r == -ENOSPC)
                count_refusal(d, s->ten, d->refusal_reason);
        if (r == -EINPROGRESS) {
                count_refusal(d, s->ten, REFUSAL_WAIT_TIMEOUT);
                r = -ENOSPC;
                snprintf(why, sizeof(why),
                         "%s: waited %.1f s for memory being taken back (from other sessions, or other "
                         "clients' chunks)",
                         open ? "open" : "reserve", KVCD_WAIT_USEC / 1e6);
        }
        if (r == 0 && open) {
                env.body_case = KVC__ENVELOPE__BODY_SESSION_OPENED;
                if (!(env.session_opened = opened_reply(d, s)))
                        r = -ENOMEM;
        } else if (r == 0) {
                env.body_case = KVC__ENVELOPE__BODY_GRANT;
                env.grant = g;
        }
        if (r < 0) {
                d->n.errors++;
                env.body_case = KVC__ENVELOPE__BODY_ERROR;
                if (!(env.error = error_new(d, -r, s->id, why[0] ? why : strerror(-r))))
                        return;
        }
        session_wait_done(d, s);
        struct client *c = s->owner;
        if (r == 0 && open)
                log_opened(d, s);
        else if (r < 0 && open) {
                log_notice("session %llu could not open: %s", (unsigned long long)s->id, why);
                d->n.admission_refusals++;
                session_close(d, s);
        }
        send_envelope(d, d->zclient, c->rid, c->rid_len, &env);
}

void handlers_retry_waits(struct kvcd *d, uint64_t now) {
        if (!d->n_waiting)
                return;
        d->freed = false;
        for (uint32_t i = 0; i < d->n_clients && d->n_waiting; i++) {
                struct session *next;
                for (struct session *s = d->clients[i]->sessions; s; s = next) {
                        next = s->next; /* retry_wait may close s */
                        if (s->wait.kind != WAIT_NONE) {
                                wire_arena_reset(d->out);
                                retry_wait(d, s, now);
                        }
                }
        }
}

int send_envelope(struct kvcd *d, void *zsock, const uint8_t *rid, size_t rid_len, const Kvc__Envelope *env) {
        size_t n = wire_packed_size(env);
        zmq_msg_t msg;
        int r = 0;
        if (zmq_msg_init_size(&msg, n) != 0)
                return -ENOMEM;
        wire_pack(env, zmq_msg_data(&msg));
        if (zmq_send(zsock, rid, rid_len, ZMQ_SNDMORE | ZMQ_DONTWAIT) < 0 ||
            zmq_msg_send(&msg, zsock, ZMQ_DONTWAIT) < 0) {
                /* unroutable (the peer left) or its queue is full (it stopped reading): drop */
                r = -zmq_errno();
                d->n.dropped_replies++;
                log_debug("reply dropped: %s", zmq_strerror(-r));
        }
        zmq_msg_close(&msg);
        return r;
}

int send_unasked_plan(struct kvcd *d, const struct session *s, Kvc__Plan *p, Kvc__Grant *g) {
        Kvc__PlanBatch pb = KVC__PLAN_BATCH__INIT;
        pb.plans = &p;
        pb.n_plans = 1;
        if (g && g->n_layers) {
                pb.grants = &g;
                pb.n_grants = 1;
        }
        Kvc__Envelope env = KVC__ENVELOPE__INIT;
        env.version = WIRE_VERSION;
        env.request_id = 0; /* unasked */
        env.body_case = KVC__ENVELOPE__BODY_PLAN_BATCH;
        env.plan_batch = &pb;
        return send_envelope(d, d->zclient, s->owner->rid, s->owner->rid_len, &env);
}

void handle_frame(struct kvcd *d, enum channel ch, void *zsock, const uint8_t *rid, size_t rid_len,
                  const uint8_t *data, size_t len) {
        struct request rq = { .d = d, .rid = rid, .rid_len = rid_len };
        Kvc__Envelope *env = NULL;
        int r;

        wire_arena_reset(d->out);
        kvc__envelope__init(&rq.reply);
        rq.reply.version = WIRE_VERSION;

        /* a request whose fields do not validate is answered under its own id: its sender's wait ends */
        r = wire_decode_request(d->in, data, len, WIRE_REQUEST_MAX_BYTES, &env, &rq.reply.request_id, rq.why,
                                sizeof(rq.why));
        if (r == 0) {
                rq.env = env;
                rq.reply.request_id = env->request_id;
                rq.client = ch == CHANNEL_CLIENT ? client_by_rid(d, rid, rid_len) : NULL;
                r = -EPROTO;
                snprintf(rq.why, sizeof(rq.why), "%s is not a request kvcd takes on this socket",
                         wire_body_name(env->body_case));
                for (size_t i = 0; i < sizeof(handlers) / sizeof(handlers[0]); i++) {
                        if (handlers[i].body != env->body_case || handlers[i].channel != ch)
                                continue;
                        if (handlers[i].needs_hello && !rq.client) {
                                r = -EPERM;
                                snprintf(rq.why, sizeof(rq.why), "say hello first");
                                break;
                        }
                        rq.why[0] = '\0';
                        r = handlers[i].handle(&rq);
                        break;
                }
        }
        if (r < 0) {
                d->n.errors++;
                if (!rq.why[0])
                        snprintf(rq.why, sizeof(rq.why), "%s", strerror(-r));
                log_debug("request from client %llu refused: %s: %s",
                          rq.client ? (unsigned long long)rq.client->id : 0ull, wire_errno_name(-r), rq.why);
                Kvc__Error *e = error_new(d, -r, 0, rq.why);
                if (!e)
                        return;
                rq.reply.body_case = KVC__ENVELOPE__BODY_ERROR;
                rq.reply.error = e;
        } else if (rq.no_reply) {
                return;
        }
        send_envelope(d, zsock, rid, rid_len, &rq.reply);
}
