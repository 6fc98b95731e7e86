/* test_budget.c - unit tests of daemon/budget.c through the daemon's own session code.
 *
 * Owns: admission (a minimum the node or the tenant cannot guarantee is refused with ENOSPC and a
 * message naming the limit, and nothing else changes), tenant bindings (EACCES for a foreign
 * uid), the arbiter's order (lowest priority first, then highest confidence, never below a
 * minimum, and sessions grow back when memory frees up), runtime limits (a session maximum or a
 * capacity below use makes plans, not errors), and a seeded simulation of 1,000 sessions opening,
 * stepping, applying plans late or at once, closing and dying with their clients, checked after
 * every event: a clean kvcd_audit(), no over-commit of the capacity or of any quota, the
 * sessions' bytes adding up to the pool's and each tenant's, and nothing left at the end.
 *
 * The daemon runs in process: a struct kvcd with the real host pool, clients whose side channel
 * is one end of a socketpair (the test reads and drops the chunk fds sent to them), and the
 * client's part played here: it appends while it has room, asks for room when it has none, and
 * applies plans by keeping the tokens the plan keeps and releasing the blocks it no longer needs.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cmocka.h>

#include "admin.h"
#include "log.h"
#include "kvcd.h"

#define MIB   (1ull << 20)
#define CHUNK (2 * MIB)

struct sim {
        struct kvcd d;
        int peer[KVCD_MAX_CLIENTS]; /* the client's end of each side channel, by client id % max */
        uint64_t step[4096];        /* the next step number per session id (ids stay small here) */
};

static struct sim *sim_new(uint64_t capacity) {
        struct sim *m = calloc(1, sizeof(*m));
        assert_non_null(m);
        struct kvcd *d = &m->d;
        budget_init(&d->budget);
        assert_int_equal(backend_find("host", &d->backend), 0);
        assert_int_equal(pool_new(d->backend, capacity, CHUNK, &d->pool), 0);
        assert_int_equal(idmap_init(&d->sessions, 64), 0);
        assert_int_equal(wire_arena_new(WIRE_REQUEST_MAX_BYTES, &d->in), 0);
        assert_int_equal(wire_arena_new(WIRE_REPLY_MAX_BYTES, &d->out), 0);
        d->events_fd = d->fd_listen = d->act_client_fd = d->act_admin_fd = d->sig_fd = d->lock_fd = -1;
        for (size_t i = 0; i < KVCD_MAX_CLIENTS; i++)
                m->peer[i] = -1;
        return m;
}

/* Reads and drops what kvcd sent on every side channel (chunk fds included). */
static void drain(struct sim *m) {
        for (size_t i = 0; i < KVCD_MAX_CLIENTS; i++) {
                if (m->peer[i] < 0)
                        continue;
                for (;;) {
                        char buf[256];
                        union {
                                struct cmsghdr align;
                                char b[CMSG_SPACE(sizeof(int) * 4)];
                        } ctl;
                        struct iovec iov = { .iov_base = buf, .iov_len = sizeof(buf) };
                        struct msghdr mh = { .msg_iov = &iov,
                                             .msg_iovlen = 1,
                                             .msg_control = ctl.b,
                                             .msg_controllen = sizeof(ctl.b) };
                        if (recvmsg(m->peer[i], &mh, MSG_DONTWAIT | MSG_CMSG_CLOEXEC) <= 0)
                                break;
                        for (struct cmsghdr *c = CMSG_FIRSTHDR(&mh); c; c = CMSG_NXTHDR(&mh, c)) {
                                if (c->cmsg_type != SCM_RIGHTS)
                                        continue;
                                for (size_t k = 0; k < (c->cmsg_len - CMSG_LEN(0)) / sizeof(int); k++) {
                                        int fd;
                                        memcpy(&fd, CMSG_DATA(c) + k * sizeof(int), sizeof(int));
                                        close(fd);
                                }
                        }
                }
        }
}

static struct client *client_new(struct sim *m, uid_t uid, gid_t gid) {
        struct kvcd *d = &m->d;
        int sv[2];
        assert_int_equal(socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0, sv), 0);
        struct client *c = calloc(1, sizeof(*c));
        assert_non_null(c);
        c->id = ++d->next_client_id;
        c->fd = sv[0];
        c->uid = uid;
        c->gid = gid;
        c->pid = 0; /* no process kvcd could watch: a dead client's chunks are scrubbed at once */
        c->bound = true;
        assert_true(d->n_clients < KVCD_MAX_CLIENTS);
        d->clients[d->n_clients++] = c;
        assert_int_equal(m->peer[c->id % KVCD_MAX_CLIENTS], -1);
        m->peer[c->id % KVCD_MAX_CLIENTS] = sv[1];
        return c;
}

/* The client dies: kvcd sees its side channel hang up. */
static void client_die(struct sim *m, struct client *c) {
        int *peer = &m->peer[c->id % KVCD_MAX_CLIENTS];
        drain(m);
        close(*peer);
        *peer = -1;
        client_destroy(&m->d, c, true);
}

static void sim_free(struct sim *m) {
        struct kvcd *d = &m->d;
        while (d->n_clients)
                client_die(m, d->clients[0]);
        idmap_done(&d->sessions);
        pool_free(d->pool);
        plan_scratch_done(&d->scratch);
        wire_arena_free(d->in);
        wire_arena_free(d->out);
        budget_done(&d->budget);
        free(m);
}

struct open_args {
        const char *policy;
        uint32_t budget;
        uint64_t min, max;
        int32_t priority;
        const char *tenant;
        uint32_t kv_heads, head_dim; /* default 1 x 16: 2.5 KiB blocks; 2 x 128: 32 KiB */
};

static int open_session(struct sim *m, struct client *c, const struct open_args *a, struct session **ret,
                        char *why, size_t why_len) {
        Kvc__Geometry g = KVC__GEOMETRY__INIT;
        g.n_layers = 2;
        g.n_heads = 2;
        g.n_kv_heads = a->kv_heads ? a->kv_heads : 1;
        g.head_dim = a->head_dim ? a->head_dim : 16;
        g.dtype = KVC__DTYPE__DTYPE_F32;
        g.max_tokens = 512;
        Kvc__OpenSession o = KVC__OPEN_SESSION__INIT;
        o.geometry = &g;
        o.policy = (char *)a->policy;
        o.budget_tokens = a->budget;
        o.tenant = (char *)(a->tenant ? a->tenant : "");
        o.int8 = true;
        o.min_bytes = a->min;
        o.max_bytes = a->max;
        o.priority = a->priority;
        why[0] = '\0';
        int r = session_open(&m->d, c, &o, ret, why, why_len);
        drain(m);
        return r;
}

/* The client's side of a plan: keep what it keeps, release the blocks no longer needed. */
static void apply(struct sim *m, struct session *s, const Kvc__Plan *p) {
        uint32_t T = s->layout.block_tokens, tokens[WIRE_MAX_LAYERS], q8[WIRE_MAX_LAYERS];
        Kvc__LayerBlocks lbs[2 * WIRE_MAX_LAYERS], *rel[2 * WIRE_MAX_LAYERS];
        size_t n_rel = 0;
        for (uint32_t l = 0; l < s->n_layers; l++) {
                tokens[l] = s->layers[l].n_tokens;
                q8[l] = s->layers[l].n_q8;
        }
        for (size_t i = 0; i < p->n_layers; i++) {
                tokens[p->layers[i]->layer] = p->layers[i]->keep_count;
                q8[p->layers[i]->layer] = p->layers[i]->q8_tokens;
        }
        for (uint32_t l = 0; l < s->n_layers; l++) {
                struct session_layer *L = &s->layers[l];
                uint32_t need[2] = { (tokens[l] - q8[l] + T - 1) / T, (q8[l] + T - 1) / T };
                struct block_table *t[2] = { &L->fp, &L->q8 };
                for (int k = 0; k < 2; k++) {
                        if (t[k]->n <= need[k])
                                continue;
                        Kvc__LayerBlocks *lb = &lbs[n_rel];
                        kvc__layer_blocks__init(lb);
                        lb->layer = l;
                        lb->q8 = k == 1;
                        lb->n_blocks = t[k]->n - need[k];
                        lb->blocks = t[k]->blocks + need[k];
                        rel[n_rel++] = lb;
                }
        }
        Kvc__PlanApplied a = KVC__PLAN_APPLIED__INIT;
        a.session_id = s->id;
        a.plan_id = p->plan_id;
        a.n_layer_tokens = s->n_layers;
        a.layer_tokens = tokens;
        a.n_layer_q8_tokens = s->n_layers;
        a.layer_q8_tokens = q8;
        a.n_released = n_rel;
        a.released = rel;
        char why[256];
        int r = session_plan_applied(&m->d, s, &a, why, sizeof(why));
        if (r < 0)
                fail_msg("plan %llu of session %llu not accepted: %s", (unsigned long long)p->plan_id,
                         (unsigned long long)s->id, why);
}

/* One decode step of s at the given confidence (0..1): the client appends a token when it has
 * room (asking kvcd for some when it has none), steps, and applies the plan now or leaves it
 * pending (*ret_plan, for the caller to apply later). */
static int step(struct sim *m, struct session *s, float confidence, bool apply_now, Kvc__Plan **ret_plan) {
        struct kvcd *d = &m->d;
        uint32_t T = s->layout.block_tokens, tokens[WIRE_MAX_LAYERS];
        char why[256];
        if (ret_plan)
                *ret_plan = NULL;
        for (uint32_t l = 0; l < s->n_layers; l++) {
                const struct session_layer *L = &s->layers[l];
                tokens[l] = L->n_tokens;
        }
        bool room = true;
        for (uint32_t l = 0; l < s->n_layers && room; l++) {
                const struct session_layer *L = &s->layers[l];
                room = L->n_tokens + 1 <= L->n_q8 + L->fp.n * T && L->n_tokens + 1 <= s->max_layer_tokens;
        }
        if (!room && s->pending_plan_id == 0 && s->layers[0].n_tokens + 1 <= s->max_layer_tokens) {
                Kvc__Grant *g;
                wire_arena_reset(d->out);
                int r = session_reserve(d, s, s->layers[0].n_tokens + 1, &g, why, sizeof(why));
                drain(m);
                room = r == 0;
                if (r < 0 && r != -ENOSPC && r != -EINPROGRESS)
                        fail_msg("reserve: %s", why);
        }
        if (room)
                for (uint32_t l = 0; l < s->n_layers; l++)
                        tokens[l]++;
        Kvc__Step st = KVC__STEP__INIT;
        st.session_id = s->id;
        st.step = m->step[s->id]++;
        st.phase = KVC__PHASE__PHASE_DECODE;
        st.n_layer_tokens = s->n_layers;
        st.layer_tokens = tokens;
        st.entropy = 1.0f - confidence;
        st.top1_prob = confidence;
        st.margin = 0;
        Kvc__Plan *p;
        Kvc__Grant *g;
        wire_arena_reset(d->out);
        int r = session_step(d, s, &st, &p, &g, why, sizeof(why));
        drain(m);
        if (r < 0)
                fail_msg("step of session %llu: %s", (unsigned long long)s->id, why);
        if (p && apply_now)
                apply(m, s, p);
        else if (p && ret_plan)
                *ret_plan = p; /* lives in d->out until the next reset: the caller applies it first */
        return 0;
}

/* Everything the budget promises, checked against the sessions themselves. */
static void check_invariants(struct sim *m) {
        struct kvcd *d = &m->d;
        char report[2048];
        uint64_t used, blocks;
        int r = kvcd_audit(d, report, sizeof(report), &used, &blocks);
        if (r < 0)
                fail_msg("audit: %s", report);
        struct pool_stats ps;
        pool_get_stats(d->pool, &ps);
        assert_true(ps.used_bytes <= ps.capacity_bytes);
        uint64_t sum = 0, reserved = 0, t_used[BUDGET_MAX_TENANTS] = { 0 }, t_res[BUDGET_MAX_TENANTS] = { 0 };
        for (uint32_t c = 0; c < d->n_clients; c++) {
                for (struct session *s = d->clients[c]->sessions; s; s = s->next) {
                        sum += s->bytes;
                        reserved += s->min_bytes;
                        assert_true(s->min_bytes <= budget_max(d, s));
                        uint32_t i = 0;
                        while (i < d->budget.n_tenants && d->budget.tenants[i] != s->ten)
                                i++;
                        assert_true(i < d->budget.n_tenants);
                        t_used[i] += s->bytes;
                        t_res[i] += s->min_bytes;
                }
        }
        assert_int_equal(sum, ps.used_bytes);
        assert_int_equal(reserved, d->budget.reserved_bytes);
        assert_true(reserved <= ps.capacity_bytes);
        for (uint32_t i = 0; i < d->budget.n_tenants; i++) {
                const struct tenant *t = d->budget.tenants[i];
                assert_int_equal(t_used[i], t->used_bytes);
                assert_int_equal(t_res[i], t->reserved_bytes);
                assert_true(t->used_bytes <= budget_quota(&d->budget, t));
                assert_true(t->reserved_bytes <= budget_quota(&d->budget, t));
        }
}

static void admission_names_the_limit_that_bit(void **state) {
        (void)state;
        struct sim *m = sim_new(4 * MIB);
        struct client *c = client_new(m, 1000, 1000);
        struct session *a, *b;
        char why[512];
        struct open_args big = { .policy = "window", .budget = 64, .min = 3 * MIB };
        int r = open_session(m, c, &big, &a, why, sizeof(why));
        if (r != 0)
                fail_msg("open: %s", why);
        uint64_t used = a->bytes, reserved = m->d.budget.reserved_bytes;
        struct open_args more = { .policy = "window", .budget = 64, .min = 2 * MIB };
        assert_int_equal(open_session(m, c, &more, &b, why, sizeof(why)), -ENOSPC);
        assert_non_null(strstr(why, "node capacity"));
        /* nothing else moved */
        assert_int_equal(a->bytes, used);
        assert_int_equal(m->d.budget.reserved_bytes, reserved);
        assert_int_equal(m->d.sessions.n, 1);

        assert_int_equal(budget_declare(&m->d.budget, "team:uid=1000:quota=1M", why, sizeof(why)), 0);
        struct open_args t0 = { .policy = "window", .budget = 64, .min = 1200 * 1024, .tenant = "team" };
        assert_int_equal(open_session(m, c, &t0, &b, why, sizeof(why)), -ENOSPC);
        assert_non_null(strstr(why, "node capacity")); /* 3 MiB + 1.2 MiB: the node bites first */
        struct open_args t1 = { .policy = "window", .budget = 64, .min = 600 * 1024, .tenant = "team" };
        session_close(&m->d, a);
        assert_int_equal(open_session(m, c, &t1, &a, why, sizeof(why)), 0);
        assert_string_equal(a->tenant, "team");
        assert_int_equal(open_session(m, c, &t1, &b, why, sizeof(why)), -ENOSPC);
        assert_non_null(strstr(why, "quota of tenant team"));
        /* a maximum below what a session needs at all, and a minimum above a maximum */
        struct open_args tiny = { .policy = "window", .budget = 64, .max = 1024 };
        assert_int_equal(open_session(m, c, &tiny, &b, why, sizeof(why)), -EINVAL);
        struct open_args crossed = { .policy = "window", .budget = 64, .min = 512 * 1024, .max = 256 * 1024 };
        assert_int_equal(open_session(m, c, &crossed, &b, why, sizeof(why)), -EINVAL);
        check_invariants(m);
        sim_free(m);
}

static void a_bound_tenant_refuses_other_users(void **state) {
        (void)state;
        struct sim *m = sim_new(8 * MIB);
        char why[512];
        assert_int_equal(budget_declare(&m->d.budget, "alice:uid=1000", why, sizeof(why)), 0);
        assert_int_equal(budget_declare(&m->d.budget, "ml:gid=500:quota=2M", why, sizeof(why)), 0);
        assert_int_equal(budget_declare(&m->d.budget, "x:color=red", why, sizeof(why)), -EINVAL);
        assert_int_equal(budget_declare(&m->d.budget, "default:uid=3", why, sizeof(why)), -EINVAL);
        struct client *alice = client_new(m, 1000, 1000), *bob = client_new(m, 1001, 500),
                      *root = client_new(m, 0, 0);
        struct session *s;
        struct open_args a = { .policy = "window", .budget = 64, .tenant = "alice" };
        assert_int_equal(open_session(m, bob, &a, &s, why, sizeof(why)), -EACCES);
        assert_non_null(strstr(why, "bound to uid 1000"));
        assert_int_equal(open_session(m, alice, &a, &s, why, sizeof(why)), 0);
        assert_int_equal(open_session(m, root, &a, &s, why, sizeof(why)), 0);
        /* by group; and with no name, the tenant bound to the uid, else the gid, else default */
        struct open_args ml = { .policy = "window", .budget = 64, .tenant = "ml" };
        assert_int_equal(open_session(m, bob, &ml, &s, why, sizeof(why)), 0);
        struct open_args none = { .policy = "window", .budget = 64 };
        assert_int_equal(open_session(m, alice, &none, &s, why, sizeof(why)), 0);
        assert_string_equal(s->tenant, "alice");
        assert_int_equal(open_session(m, bob, &none, &s, why, sizeof(why)), 0);
        assert_string_equal(s->tenant, "ml");
        assert_int_equal(open_session(m, root, &none, &s, why, sizeof(why)), 0);
        assert_string_equal(s->tenant, "default");
        /* a name nobody declared belongs to its first user, and goes with its last session */
        struct open_args mine = { .policy = "window", .budget = 64, .tenant = "scratch" };
        assert_int_equal(open_session(m, bob, &mine, &s, why, sizeof(why)), 0);
        struct session *other;
        assert_int_equal(open_session(m, alice, &mine, &other, why, sizeof(why)), -EACCES);
        uint32_t n = m->d.budget.n_tenants;
        session_close(&m->d, s);
        assert_int_equal(m->d.budget.n_tenants, n - 1);
        check_invariants(m);
        sim_free(m);
}

/* Three sessions grow until the node is short: the one with the highest confidence gives first,
 * a higher priority protects a session, nobody goes below its minimum, and when one closes the
 * others grow back. */
static void the_arbiter_shrinks_confident_low_priority_sessions_first(void **state) {
        (void)state;
        struct sim *m = sim_new(2 * CHUNK);
        struct client *c = client_new(m, 1000, 1000);
        char why[512];
        struct session *s[3];
        const float conf[3] = { 0.9f, 0.5f, 0.1f };
        for (int i = 0; i < 3; i++) {
                struct open_args a = {
                        .policy = "window", .budget = 500, .min = 64 * 1024, .kv_heads = 2, .head_dim = 128
                };
                assert_int_equal(open_session(m, c, &a, &s[i], why, sizeof(why)), 0);
        }
        uint64_t row = (uint64_t)s[0]->n_layers * s[0]->layout.block_bytes; /* one block in each layer */
        /* grow all three until the arbiter has to cut */
        for (int t = 0; t < 480 && !m->d.budget.pressure; t++)
                for (int i = 0; i < 3; i++)
                        step(m, s[i], conf[i], true, NULL);
        assert_true(m->d.budget.pressure);
        for (int t = 0; t < 600; t++) {
                for (int i = 0; i < 3; i++)
                        step(m, s[i], conf[i], true, NULL);
                check_invariants(m);
        }
        for (int i = 0; i < 3; i++)
                print_message("session %d: conf %.1f bytes %llu cap %llu demand %llu min %llu tokens %u\n", i,
                              (double)conf[i], (unsigned long long)s[i]->bytes,
                              (unsigned long long)s[i]->cap_bytes, (unsigned long long)s[i]->demand_bytes,
                              (unsigned long long)s[i]->min_bytes, s[i]->layers[0].n_tokens);
        /* the most confident is cut the most; the least confident the least */
        assert_true(s[0]->cap_bytes <= s[1]->cap_bytes);
        assert_true(s[1]->cap_bytes <= s[2]->cap_bytes);
        assert_true(s[0]->bytes < s[2]->bytes);
        for (int i = 0; i < 3; i++)
                assert_true(s[i]->cap_bytes >= s[i]->min_bytes);
        assert_true(m->d.budget.cuts > 0);

        /* priority beats confidence: the confident one is now protected */
        assert_int_equal(budget_set_session(&m->d, s[0], false, 0, false, 0, true, 5, why, sizeof(why)), 0);
        for (int t = 0; t < 600; t++)
                for (int i = 0; i < 3; i++)
                        step(m, s[i], conf[i], true, NULL);
        assert_true(s[0]->bytes > s[1]->bytes);
        assert_true(s[0]->bytes > s[2]->bytes);
        check_invariants(m);

        /* one leaves: the rest grow back */
        uint64_t before = s[1]->bytes + s[2]->bytes;
        session_close(&m->d, s[0]);
        for (int t = 0; t < 600; t++)
                for (int i = 1; i < 3; i++)
                        step(m, s[i], conf[i], true, NULL);
        assert_true(s[1]->bytes + s[2]->bytes > before + row);
        check_invariants(m);
        sim_free(m);
}

/* kvcctl budget set below use: plans follow, never errors; the capacity may not go under the
 * guaranteed minimums. */
static void lowering_limits_below_use_makes_plans(void **state) {
        (void)state;
        struct sim *m = sim_new(2 * CHUNK);
        struct client *c = client_new(m, 1000, 1000);
        char why[512];
        struct session *s;
        struct open_args a = { .policy = "h2o", .budget = 400, .kv_heads = 2, .head_dim = 64 };
        assert_int_equal(open_session(m, c, &a, &s, why, sizeof(why)), 0);
        for (int t = 0; t < 300; t++)
                step(m, s, 0.5f, true, NULL);
        uint64_t held = s->bytes;
        assert_int_equal(budget_set_session(&m->d, s, false, 0, true, held / 2, false, 0, why, sizeof(why)),
                         0);
        for (int t = 0; t < 4; t++)
                step(m, s, 0.5f, true, NULL);
        assert_true(s->bytes <= held / 2);
        check_invariants(m);
        /* a minimum the node cannot hold is refused, and nothing changes */
        uint64_t min = s->min_bytes;
        assert_int_equal(budget_set_session(&m->d, s, true, 64 * MIB, true, 0, false, 0, why, sizeof(why)),
                         -EBUSY);
        assert_int_equal(s->min_bytes, min);
        assert_int_equal(budget_check_capacity(&m->d, min - 1, why, sizeof(why)), -EBUSY);
        assert_int_equal(budget_check_capacity(&m->d, CHUNK, why, sizeof(why)), 0);
        sim_free(m);
}

/* The seeded simulation of the issue: 1,000 sessions, every event checked. */
static void a_thousand_sessions_never_overcommit_nor_leak(void **state) {
        (void)state;
        struct sim *m = sim_new(12 * CHUNK);
        struct kvcd *d = &m->d;
        char why[512];
        static const char *const policies[] = { "window", "h2o", "conf", "streaming", "tova", "full" };
        static const char *const tenants[] = { "a", "b", "c", "" };
        assert_int_equal(budget_declare(&d->budget, "a:quota=6M", why, sizeof(why)), 0);
        assert_int_equal(budget_declare(&d->budget, "b:quota=10M", why, sizeof(why)), 0);
        d->budget.default_quota = 16 * MIB;
        srand(20261130);
        struct client *clients[6];
        for (int i = 0; i < 6; i++)
                clients[i] = client_new(m, 1000, 1000);
        struct session *live[64];
        Kvc__Plan *held[64]; /* a plan the client has not applied yet (it lives in d->out: applied or
                                forgotten before the next request) */
        int n_live = 0, opened = 0, refused = 0, died = 0, closed = 0, waited = 0;
        uint64_t events = 0, peak = 0;
        while (opened < 1000 || n_live) {
                /* per 10,000: 1% opens, 0.6% closes, 0.03% deaths, 0.2% limit changes, the rest steps */
                int what = rand() % 10000;
                if (opened < 1000 && n_live < 64 && (what < 100 || n_live == 0)) {
                        struct open_args a = {
                                .policy = policies[rand() % 6],
                                .budget = 32 + (uint32_t)(rand() % 8) * 32,
                                .min = rand() % 3 ? 0 : (uint64_t)(rand() % 512) * 1024,
                                .max = rand() % 4 ? 0 : (uint64_t)(256 + rand() % 2048) * 1024,
                                .priority = rand() % 3,
                                .tenant = tenants[rand() % 4],
                                .kv_heads = 2,
                                .head_dim = 128,
                        };
                        struct session *s;
                        int r = open_session(m, clients[rand() % 6], &a, &s, why, sizeof(why));
                        opened++;
                        if (r == 1) { /* waits for its plan buffer: tried again below, or given up */
                                waited++;
                                for (int j = 0; j < n_live; j++)
                                        if (held[j]) {
                                                apply(m, live[j], held[j]);
                                                held[j] = NULL;
                                        }
                                for (int k = 0; k < 8 && (r = session_retry_open(d, s, why, sizeof(why))) ==
                                                                 -EINPROGRESS;
                                     k++)
                                        for (int j = 0; j < n_live; j++)
                                                step(m, live[j], 0.5f, true, NULL);
                                drain(m);
                                session_wait_done(d, s);
                                if (r < 0) {
                                        session_close(d, s);
                                        refused++;
                                } else {
                                        held[n_live] = NULL;
                                        live[n_live++] = s;
                                }
                        } else if (r == 0) {
                                held[n_live] = NULL;
                                live[n_live++] = s;
                        } else {
                                assert_true(r == -ENOSPC || r == -EINVAL);
                                refused++;
                        }
                } else if (what < 160 && n_live) { /* a session ends */
                        int i = rand() % n_live;
                        session_close(d, live[i]);
                        live[i] = live[--n_live];
                        held[i] = held[n_live];
                        closed++;
                } else if (what < 163) { /* a client dies with its sessions */
                        int k = rand() % 6;
                        for (int i = 0; i < n_live; i++) {
                                if (live[i]->owner == clients[k]) {
                                        live[i] = live[--n_live];
                                        held[i] = held[n_live];
                                        i--;
                                }
                        }
                        client_die(m, clients[k]);
                        clients[k] = client_new(m, 1000, 1000);
                        died++;
                } else if (what < 183 && n_live) { /* the operator changes a session's limits */
                        struct session *s = live[rand() % n_live];
                        uint64_t max = rand() % 2 ? 0 : (uint64_t)(128 + rand() % 2048) * 1024;
                        int r = budget_set_session(d, s, rand() % 2, (uint64_t)(rand() % 256) * 1024, true,
                                                   max, true, rand() % 3, why, sizeof(why));
                        assert_true(r == 0 || r == -EBUSY || r == -EINVAL);
                } else if (n_live) { /* a step, its plan applied at once or one step late */
                        int i = rand() % n_live;
                        for (int j = 0; j < n_live;
                             j++) /* plans held past another request are applied first */
                                if (held[j] && j != i) {
                                        /* d->out is reset by the next request: apply before it */
                                        apply(m, live[j], held[j]);
                                        held[j] = NULL;
                                }
                        if (held[i]) {
                                apply(m, live[i], held[i]);
                                held[i] = NULL;
                        }
                        step(m, live[i], (float)(rand() % 100) / 100.0f, rand() % 4 != 0, &held[i]);
                }
                events++;
                check_invariants(m);
                struct pool_stats now;
                pool_get_stats(d->pool, &now);
                if (now.used_bytes > peak)
                        peak = now.used_bytes;
        }
        /* the end: nothing held, nothing guaranteed, no tenant left but the declared ones */
        struct pool_stats ps;
        pool_get_stats(d->pool, &ps);
        assert_int_equal(ps.used_bytes, 0);
        assert_int_equal(d->budget.reserved_bytes, 0);
        assert_int_equal(d->budget.unmet_bytes, 0);
        assert_int_equal(d->budget.demand_bytes, 0);
        for (uint32_t i = 0; i < d->budget.n_tenants; i++)
                assert_true(d->budget.tenants[i]->declared);
        print_message("simulation: peak %llu of %llu bytes in use; %d sessions (%d refused at admission, %d "
                      "waited for memory), %d closed, %d "
                      "clients died, %llu events, %llu arbitrations, %llu cuts\n",
                      (unsigned long long)peak, (unsigned long long)ps.capacity_bytes, opened, refused,
                      waited, closed, died, (unsigned long long)events,
                      (unsigned long long)d->budget.arbitrations, (unsigned long long)d->budget.cuts);
        assert_true(d->budget.cuts > 0); /* the run did put the arbiter to work */
        sim_free(m);
}

int main(void) {
        log_set_level(LOG_WARNING);
        const struct CMUnitTest tests[] = {
                cmocka_unit_test(admission_names_the_limit_that_bit),
                cmocka_unit_test(a_bound_tenant_refuses_other_users),
                cmocka_unit_test(the_arbiter_shrinks_confident_low_priority_sessions_first),
                cmocka_unit_test(lowering_limits_below_use_makes_plans),
                cmocka_unit_test(a_thousand_sessions_never_overcommit_nor_leak),
        };
        return cmocka_run_group_tests(tests, NULL, NULL);
}
