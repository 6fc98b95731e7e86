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
 * The daemon runs in process (tests/unit/sim.h): a struct kvcd with the real host pool, and the
 * clients' part played by the test.
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
#include "pool.h"

#include "sim.h"

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
        struct client *c = sim_client_new(m, 1000, 1000);
        struct session *a, *b;
        char why[512];
        struct open_args big = { .policy = "window", .budget = 64, .min = 3 * MIB };
        int r = sim_open_session(m, c, &big, &a, why, sizeof(why));
        if (r != 0)
                fail_msg("open: %s", why);
        uint64_t used = a->bytes, reserved = m->d.budget.reserved_bytes;
        struct open_args more = { .policy = "window", .budget = 64, .min = 2 * MIB };
        assert_int_equal(sim_open_session(m, c, &more, &b, why, sizeof(why)), -ENOSPC);
        assert_non_null(strstr(why, "node capacity"));
        /* nothing else moved */
        assert_int_equal(a->bytes, used);
        assert_int_equal(m->d.budget.reserved_bytes, reserved);
        assert_int_equal(m->d.sessions.n, 1);

        assert_int_equal(budget_declare(&m->d.budget, "team:uid=1000:quota=1M", why, sizeof(why)), 0);
        struct open_args t0 = { .policy = "window", .budget = 64, .min = 1200 * 1024, .tenant = "team" };
        assert_int_equal(sim_open_session(m, c, &t0, &b, why, sizeof(why)), -ENOSPC);
        assert_non_null(strstr(why, "node capacity")); /* 3 MiB + 1.2 MiB: the node bites first */
        struct open_args t1 = { .policy = "window", .budget = 64, .min = 600 * 1024, .tenant = "team" };
        session_close(&m->d, a);
        assert_int_equal(sim_open_session(m, c, &t1, &a, why, sizeof(why)), 0);
        assert_string_equal(a->tenant, "team");
        assert_int_equal(sim_open_session(m, c, &t1, &b, why, sizeof(why)), -ENOSPC);
        assert_non_null(strstr(why, "quota of tenant team"));
        /* a maximum below what a session needs at all, and a minimum above a maximum */
        struct open_args tiny = { .policy = "window", .budget = 64, .max = 1024 };
        assert_int_equal(sim_open_session(m, c, &tiny, &b, why, sizeof(why)), -EINVAL);
        struct open_args crossed = { .policy = "window", .budget = 64, .min = 512 * 1024, .max = 256 * 1024 };
        assert_int_equal(sim_open_session(m, c, &crossed, &b, why, sizeof(why)), -EINVAL);
        check_invariants(m);
        sim_free(m);
}

/* A table that cannot grow all the way takes nothing: plan_build grows INT8 tables this way and
 * drops the grant entry on failure, so blocks left in the table would be charged and never told
 * to the client. Here the tenant's quota stops the growth one block and a half in. */
static void a_table_that_cannot_grow_all_the_way_takes_nothing(void **state) {
        (void)state;
        struct sim *m = sim_new(4 * MIB);
        struct client *c = sim_client_new(m, 1000, 1000);
        struct session *s;
        char why[512];
        assert_int_equal(budget_declare(&m->d.budget, "team:uid=1000:quota=1M", why, sizeof(why)), 0);
        struct open_args a = {
                .policy = "conf", .budget = 48, .param = "int8", .value = 1, .tenant = "team"
        };
        if (sim_open_session(m, c, &a, &s, why, sizeof(why)) != 0)
                fail_msg("open: %s", why);
        assert_int_equal(s->n_tiers, 2);
        for (int q8 = 0; q8 < 2; q8++) {
                uint32_t unit = session_unit_bytes(s, q8);
                s->ten->quota_bytes = s->bytes + unit + unit / 2;
                struct block_table *t = &s->layers[1].t[q8];
                uint32_t n = t->n, want = n + 3;
                assert_true(want <= s->max_layer_blocks);
                struct pool_stats before, after;
                pool_get_stats(m->d.pool, &before);
                uint64_t bytes = s->bytes;
                Kvc__Grant g = KVC__GRANT__INIT;
                Kvc__LayerBlocks *layers[2];
                g.layers = layers;
                Kvc__LayerBlocks *lb = session_grant_layer(m->d.out, &g, 1, q8, want - n);
                assert_non_null(lb);
                assert_true(session_grow_table(&m->d, s, 1, q8, want, lb) < 0);
                assert_int_equal(t->n, n);
                assert_int_equal(lb->n_blocks, 0);
                pool_get_stats(m->d.pool, &after);
                assert_int_equal(after.used_bytes, before.used_bytes);
                assert_int_equal(s->bytes, bytes);
                wire_arena_reset(m->d.out);
        }
        s->ten->quota_bytes = 1 * MIB;
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
        struct client *alice = sim_client_new(m, 1000, 1000), *bob = sim_client_new(m, 1001, 500),
                      *root = sim_client_new(m, 0, 0);
        struct session *s;
        struct open_args a = { .policy = "window", .budget = 64, .tenant = "alice" };
        assert_int_equal(sim_open_session(m, bob, &a, &s, why, sizeof(why)), -EACCES);
        assert_non_null(strstr(why, "bound to uid 1000"));
        assert_int_equal(sim_open_session(m, alice, &a, &s, why, sizeof(why)), 0);
        assert_int_equal(sim_open_session(m, root, &a, &s, why, sizeof(why)), 0);
        /* by group; and with no name, the tenant bound to the uid, else the gid, else default */
        struct open_args ml = { .policy = "window", .budget = 64, .tenant = "ml" };
        assert_int_equal(sim_open_session(m, bob, &ml, &s, why, sizeof(why)), 0);
        struct open_args none = { .policy = "window", .budget = 64 };
        assert_int_equal(sim_open_session(m, alice, &none, &s, why, sizeof(why)), 0);
        assert_string_equal(s->tenant, "alice");
        assert_int_equal(sim_open_session(m, bob, &none, &s, why, sizeof(why)), 0);
        assert_string_equal(s->tenant, "ml");
        assert_int_equal(sim_open_session(m, root, &none, &s, why, sizeof(why)), 0);
        assert_string_equal(s->tenant, "default");
        /* a name nobody declared belongs to its first user, and goes with its last session */
        struct open_args mine = { .policy = "window", .budget = 64, .tenant = "scratch" };
        assert_int_equal(sim_open_session(m, bob, &mine, &s, why, sizeof(why)), 0);
        struct session *other;
        assert_int_equal(sim_open_session(m, alice, &mine, &other, why, sizeof(why)), -EACCES);
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
        struct client *c = sim_client_new(m, 1000, 1000);
        char why[512];
        struct session *s[3];
        const float conf[3] = { 0.9f, 0.5f, 0.1f };
        for (int i = 0; i < 3; i++) {
                struct open_args a = {
                        .policy = "window", .budget = 500, .min = 64 * 1024, .kv_heads = 2, .head_dim = 128
                };
                assert_int_equal(sim_open_session(m, c, &a, &s[i], why, sizeof(why)), 0);
        }
        uint64_t row = (uint64_t)s[0]->n_layers * s[0]->layout.block_bytes; /* one block in each layer */
        /* grow all three until the arbiter has to cut */
        for (int t = 0; t < 480 && !m->d.budget.pressure; t++)
                for (int i = 0; i < 3; i++)
                        sim_step(m, s[i], conf[i], true, NULL);
        assert_true(m->d.budget.pressure);
        for (int t = 0; t < 600; t++) {
                for (int i = 0; i < 3; i++)
                        sim_step(m, s[i], conf[i], true, NULL);
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
                        sim_step(m, s[i], conf[i], true, NULL);
        assert_true(s[0]->bytes > s[1]->bytes);
        assert_true(s[0]->bytes > s[2]->bytes);
        check_invariants(m);

        /* one leaves: the rest grow back */
        uint64_t before = s[1]->bytes + s[2]->bytes;
        session_close(&m->d, s[0]);
        for (int t = 0; t < 600; t++)
                for (int i = 1; i < 3; i++)
                        sim_step(m, s[i], conf[i], true, NULL);
        assert_true(s[1]->bytes + s[2]->bytes > before + row);
        check_invariants(m);
        sim_free(m);
}

/* kvcctl budget set below use: plans follow, never errors; the capacity may not go under the
 * guaranteed minimums. */
static void lowering_limits_below_use_makes_plans(void **state) {
        (void)state;
        struct sim *m = sim_new(2 * CHUNK);
        struct client *c = sim_client_new(m, 1000, 1000);
        char why[512];
        struct session *s;
        struct open_args a = { .policy = "h2o", .budget = 400, .kv_heads = 2, .head_dim = 64 };
        assert_int_equal(sim_open_session(m, c, &a, &s, why, sizeof(why)), 0);
        for (int t = 0; t < 300; t++)
                sim_step(m, s, 0.5f, true, NULL);
        uint64_t held = s->bytes;
        assert_int_equal(budget_set_session(&m->d, s, false, 0, true, held / 2, false, 0, why, sizeof(why)),
                         0);
        for (int t = 0; t < 4; t++)
                sim_step(m, s, 0.5f, true, NULL);
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
                clients[i] = sim_client_new(m, 1000, 1000);
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
                        int r = sim_open_session(m, clients[rand() % 6], &a, &s, why, sizeof(why));
                        opened++;
                        if (r == 1) { /* waits for its plan buffer: tried again below, or given up */
                                waited++;
                                for (int j = 0; j < n_live; j++)
                                        if (held[j]) {
                                                sim_apply(m, live[j], held[j]);
                                                held[j] = NULL;
                                        }
                                for (int k = 0; k < 8 && (r = session_retry_open(d, s, why, sizeof(why))) ==
                                                                 -EINPROGRESS;
                                     k++)
                                        for (int j = 0; j < n_live; j++)
                                                sim_step(m, live[j], 0.5f, true, NULL);
                                sim_drain(m);
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
                        sim_client_die(m, clients[k]);
                        clients[k] = sim_client_new(m, 1000, 1000);
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
                                        sim_apply(m, live[j], held[j]);
                                        held[j] = NULL;
                                }
                        if (held[i]) {
                                sim_apply(m, live[i], held[i]);
                                held[i] = NULL;
                        }
                        sim_step(m, live[i], (float)(rand() % 100) / 100.0f, rand() % 4 != 0, &held[i]);
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
                cmocka_unit_test(a_table_that_cannot_grow_all_the_way_takes_nothing),
                cmocka_unit_test(a_bound_tenant_refuses_other_users),
                cmocka_unit_test(the_arbiter_shrinks_confident_low_priority_sessions_first),
                cmocka_unit_test(lowering_limits_below_use_makes_plans),
                cmocka_unit_test(a_thousand_sessions_never_overcommit_nor_leak),
        };
        return cmocka_run_group_tests(tests, NULL, NULL);
}
