/* test_ladder_policy.c: the ladder policy (daemon/policy/ladder.c): the allocation's arithmetic and
 * its edges (a budget below the sinks and window, above the full cache, ties), the keep-set and
 * tiers select_tiers gives, and when decide plans. */
#include <errno.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "policy/policy.h"

#define N_OF(a) (sizeof(a) / sizeof((a)[0]))
#define T       16u

/* Block costs of an f16 dtype and q8, q4, q2 tiers for one KV head of 64 dims (bytes per 16
 * tokens, side arrays included): the shape of kernels/tier.h's, exactly as the policy sees them. */
static const uint64_t cost4[] = { 4416, 2496, 1536, 1024 };
static const uint8_t bits4[] = { 16, 8, 4, 2 };

static uint64_t spent(const uint64_t *cost, const uint32_t *n, uint32_t tiers) {
        uint64_t b = 0;
        for (uint32_t t = 0; t < tiers; t++)
                b += (uint64_t)n[t] * cost[t];
        return b; /* times T */
}

static uint32_t kept(const uint32_t *n) {
        uint32_t k = 0;
        for (uint32_t t = 0; t < POLICY_MAX_TIERS; t++)
                k += n[t];
        return k;
}

static void allocate_edges(void **state) {
        uint32_t n[POLICY_MAX_TIERS];
        (void)state;
        /* nothing to place, or nothing to place it in */
        ladder_allocate(cost4, 4, T, 1000000, 0, 2, 0, n);
        assert_int_equal(kept(n), 0);
        ladder_allocate(cost4, 4, T, 0, 100, 2, 0, n);
        assert_int_equal(kept(n), 0);
        /* a budget at or above the full cache: all at the dtype */
        ladder_allocate(cost4, 4, T, 100 * cost4[0] / T, 100, 2, 10, n);
        assert_int_equal(n[0], 100);
        ladder_allocate(cost4, 4, T, UINT64_MAX, 100, 2, 10, n);
        assert_int_equal(n[0], 100);
        /* exactly the bulk's cost: all at the bulk */
        ladder_allocate(cost4, 4, T, 160 * cost4[2] / T, 160, 2, 0, n);
        assert_int_equal(n[2], 160);
        assert_int_equal(kept(n), 160);
        /* below even the lowest tier: what fits there, the rest evicted */
        ladder_allocate(cost4, 4, T, 100 * cost4[3] / T - 1, 100, 2, 5, n);
        assert_int_equal(n[3], 99);
        assert_int_equal(kept(n), 99);
}

/* Between the bulk and the dtype: the most important lifted a tier at a time, as far as the budget
 * goes, and not one token more. */
static void allocate_lifts_the_top_a_tier_at_a_time(void **state) {
        uint32_t n[POLICY_MAX_TIERS];
        (void)state;
        uint32_t m = 320;
        uint64_t B = (uint64_t)m * cost4[2] / T + 50 * (cost4[1] - cost4[2]) / T; /* 50 lifts to q8 */
        ladder_allocate(cost4, 4, T, B, m, 2, 0, n);
        assert_int_equal(n[1], 50);
        assert_int_equal(n[2], 270);
        assert_int_equal(n[0] + n[3], 0);
        /* enough for all at q8 and some at the dtype: q8 fills before any goes higher */
        B = (uint64_t)m * cost4[1] / T + 7 * (cost4[0] - cost4[1]) / T;
        ladder_allocate(cost4, 4, T, B, m, 2, 0, n);
        assert_int_equal(n[0], 7);
        assert_int_equal(n[1], m - 7);
}

/* Below the bulk: `high` a tier above it, the least important lowered, within the budget and as few
 * as the budget needs. */
static void allocate_lowers_the_least_important_first(void **state) {
        uint32_t n[POLICY_MAX_TIERS];
        (void)state;
        for (uint32_t m = 1; m < 700; m += 37)
                for (uint32_t high = 0; high <= m; high += m / 3 + 1)
                        for (uint64_t B = m * cost4[3] / T; B < m * cost4[2] / T; B += 997) {
                                ladder_allocate(cost4, 4, T, B, m, 2, high, n);
                                assert_int_equal(kept(n), m);
                                assert_true(spent(cost4, n, 4) <= B * T);
                                assert_int_equal(n[0], 0);
                                /* with high: they are there, or could not be */
                                if (n[1] != high)
                                        assert_int_equal(n[1], 0);
                                /* one token fewer lowered would not fit */
                                if (n[3]) {
                                        uint32_t less[POLICY_MAX_TIERS];
                                        memcpy(less, n, sizeof(less));
                                        less[3]--;
                                        less[2]++;
                                        assert_true(spent(cost4, less, 4) > B * T);
                                }
                        }
}

/* Random costs and budgets: within the budget, and a larger budget never keeps less or lower. */
static void allocate_is_monotone_in_the_budget(void **state) {
        uint64_t x = 0x9e3779b97f4a7c15ull;
        (void)state;
        for (int trial = 0; trial < 2000; trial++) {
                x ^= x << 13, x ^= x >> 7, x ^= x << 17;
                uint32_t tiers = 2 + (uint32_t)(x % 4), m = (uint32_t)(x >> 8) % 900, bulk = (uint32_t)(x >> 20) % tiers;
                uint64_t cost[POLICY_MAX_TIERS];
                cost[0] = 3000 + (x >> 24) % 3000;
                for (uint32_t t = 1; t < tiers; t++)
                        cost[t] = cost[t - 1] - 1 - (x >> (28 + t)) % (cost[t - 1] / tiers);
                uint64_t B1 = (x >> 33) % (m * cost[0] / T + 2), B2 = B1 + (x >> 40) % 5000;
                uint32_t a[POLICY_MAX_TIERS], b[POLICY_MAX_TIERS];
                ladder_allocate(cost, tiers, T, B1, m, bulk, 0, a);
                ladder_allocate(cost, tiers, T, B2, m, bulk, 0, b);
                assert_true(spent(cost, a, tiers) <= B1 * T);
                assert_true(spent(cost, b, tiers) <= B2 * T);
                assert_true(kept(b) >= kept(a));
                if (kept(a) == m) /* the cost of what the larger budget keeps is never lower */
                        assert_true(spent(cost, b, tiers) >= spent(cost, a, tiers));
        }
}

/* ---- the policy ---- */

static struct policy *make(uint64_t budget_bytes, const struct policy_param *params, size_t n) {
        struct policy_setup s = { .n_layers = 2,
                                  .n_heads = 2,
                                  .n_kv_heads = 1,
                                  .head_dim = 64,
                                  .max_tokens = 4096,
                                  .block_tokens = T,
                                  .budget_bytes = budget_bytes,
                                  .session_id = 5 };
        struct policy *p = NULL;
        char why[160] = "";
        if (policy_new("ladder", &s, params, n, &p, why, sizeof(why)) < 0)
                fail_msg("policy_new(ladder): %s", why);
        return p;
}

static struct policy_step step_of(const uint32_t *tokens, uint64_t budget_bytes) {
        return (struct policy_step){ .step = 1,
                                     .confidence = 1.0f,
                                     .layer_tokens = tokens,
                                     .n_tiers = 4,
                                     .tier_block_bytes = cost4,
                                     .tier_bits = bits4,
                                     .budget_bytes = budget_bytes };
}

struct layer_arrays {
        int32_t pos[1024];
        float sum[1024], ema[1024];
        uint8_t tier[1024];
};

static struct policy_layer view(struct layer_arrays *a, uint32_t n) {
        return (struct policy_layer){ .n_tokens = n, .n_kv_heads = 1, .pos = a->pos, .sum = a->sum, .ema = a->ema,
                                      .tier = a->tier };
}

/* n tokens at positions 0.., every one at the dtype, all with the score `score` (sum and ema). */
static void layer_init(struct layer_arrays *a, uint32_t n, float score) {
        for (uint32_t i = 0; i < n; i++) {
                a->pos[i] = (int32_t)i;
                a->sum[i] = a->ema[i] = score;
                a->tier[i] = 0;
        }
}

/* Layer 0's target after the policy's decide on step st. */
static struct policy_target decide_layer0(struct policy *p, const struct policy_step *st) {
        struct policy_target targets[2] = { { POLICY_NO_PLAN, 0 }, { POLICY_NO_PLAN, 0 } };
        p->ops->decide(p->state, st, targets);
        return targets[0];
}

/* The slack the policy leaves a layer: a block of every tier, and one more of the dtype. */
static uint64_t slack(void) {
        return 2 * cost4[0] + cost4[1] + cost4[2] + cost4[3];
}

static void select_keeps_sinks_and_window_high_and_ranks_the_rest(void **state) {
        const struct policy_param params[] = { { .key = "sinks", .number = 4 }, { .key = "window", .number = 32 } };
        struct policy *p = make(1, params, N_OF(params));
        struct layer_arrays a;
        uint32_t n = 400, tokens[2] = { n, n }, keep[1024];
        uint8_t tier[1024];
        uint32_t words[4 * 1024];
        (void)state;
        layer_init(&a, n, 0.0f);
        for (uint32_t i = 0; i < n; i++)
                a.sum[i] = (float)((i * 7919u) % 1000); /* distinct scores, spread over the sequence */
        a.sum[200] = 5000.0f; /* the needle */
        /* per layer: the protected tokens at f16, 364 candidates at about the bulk's cost */
        uint64_t layer = slack() + 36 * cost4[0] / T + 364 * cost4[2] / T - 1;
        struct policy_step st = step_of(tokens, 2 * layer);
        struct policy_target target = decide_layer0(p, &st);
        assert_int_equal(target.keep, n); /* nothing evicted: only demoted */
        struct policy_layer L = view(&a, n);
        assert_int_equal(p->ops->select_tiers(p->state, &st, &L, &target, keep, tier, words), 0);
        for (uint32_t i = 0; i < n; i++) {
                assert_int_equal(keep[i], i);
                if (i < 4 || i >= n - 32)
                        assert_int_equal(tier[i], 0);
        }
        assert_int_equal(tier[200], 2); /* the best of a budget just below the bulk's: still at q4 */
        uint32_t counts[4] = { 0 };
        for (uint32_t i = 0; i < n; i++)
                counts[tier[i]]++;
        assert_int_equal(counts[0], 36);
        assert_true(counts[3] >= 1); /* one lowered */
        for (uint32_t i = 4; i < n - 32; i++) /* the lowered are the least important */
                if (tier[i] == 3)
                        for (uint32_t j = 4; j < n - 32; j++)
                                if (tier[j] == 2)
                                        assert_true(a.sum[i] <= a.sum[j]);
        /* a token already lower stays there */
        a.tier[200] = 3;
        assert_int_equal(p->ops->select_tiers(p->state, &st, &L, &target, keep, tier, words), 0);
        assert_int_equal(tier[200], 3);
        policy_free(p);
}

static void select_below_the_sinks_and_window_keeps_the_sinks_then_the_newest(void **state) {
        const struct policy_param params[] = { { .key = "sinks", .number = 4 }, { .key = "window", .number = 64 } };
        struct policy *p = make(1, params, N_OF(params));
        struct layer_arrays a;
        uint32_t n = 300, tokens[2] = { n, n }, keep[1024];
        uint8_t tier[1024];
        uint32_t words[4 * 1024];
        (void)state;
        layer_init(&a, n, 1.0f);
        uint64_t layer = slack() + 20 * cost4[0] / T; /* room for 20 at f16 */
        struct policy_step st = step_of(tokens, 2 * layer);
        struct policy_target target = decide_layer0(p, &st);
        assert_int_equal(target.keep, 20);
        struct policy_layer L = view(&a, n);
        assert_int_equal(p->ops->select_tiers(p->state, &st, &L, &target, keep, tier, words), 0);
        for (uint32_t i = 0; i < 4; i++)
                assert_int_equal(keep[i], i);
        for (uint32_t i = 4; i < 20; i++)
                assert_int_equal(keep[i], n - 16 + (i - 4));
        for (uint32_t i = 0; i < 20; i++)
                assert_int_equal(tier[i], 0);
        policy_free(p);
}

/* Equal scores: the newer token wins (select_topk's ties), so the result does not depend on the
 * order the scores were computed in. */
static void select_breaks_ties_towards_the_newest(void **state) {
        const struct policy_param params[] = { { .key = "sinks", .number = 0 }, { .key = "window", .number = 0 } };
        struct policy *p = make(1, params, N_OF(params));
        struct layer_arrays a;
        uint32_t n = 64, tokens[2] = { n, n }, keep[1024];
        uint8_t tier[1024];
        uint32_t words[4 * 1024];
        (void)state;
        layer_init(&a, n, 1.0f);
        uint64_t layer = slack() + 32 * cost4[1] / T + 32 * cost4[2] / T; /* 32 at q8, 32 at q4 */
        struct policy_step st = step_of(tokens, 2 * layer);
        struct policy_target target = decide_layer0(p, &st);
        struct policy_layer L = view(&a, n);
        assert_int_equal(p->ops->select_tiers(p->state, &st, &L, &target, keep, tier, words), 0);
        for (uint32_t i = 0; i < n; i++)
                assert_int_equal(tier[i], i < 32 ? 2 : 1);
        policy_free(p);
}

/* decide: nothing while every token fits at the dtype; a plan once a block has grown past what
 * fits; none again until another block has come; one at once when the budget falls. */
static void decide_plans_a_block_at_a_time_and_when_the_budget_falls(void **state) {
        struct policy *p = make(1, NULL, 0);
        uint32_t tokens[2];
        uint64_t budget = 2 * (slack() + 200 * cost4[0] / T);
        struct policy_target t[2];
        (void)state;
        for (uint32_t n = 1; n <= 600; n++) {
                tokens[0] = tokens[1] = n;
                struct policy_step st = step_of(tokens, budget);
                t[0] = t[1] = (struct policy_target){ POLICY_NO_PLAN, 0 };
                p->ops->decide(p->state, &st, t);
                bool fits = n <= 200;
                if (fits)
                        assert_int_equal(t[0].keep, POLICY_NO_PLAN);
                if (n == 201)
                        assert_int_equal(t[0].keep, n);
                if (n > 201 && n < 201 + T)
                        assert_int_equal(t[0].keep, POLICY_NO_PLAN);
                if (n == 201 + T)
                        assert_int_equal(t[0].keep, n);
        }
        tokens[0] = tokens[1] = 600;
        struct policy_step st = step_of(tokens, budget / 2);
        t[0] = t[1] = (struct policy_target){ POLICY_NO_PLAN, 0 };
        p->ops->decide(p->state, &st, t);
        assert_int_not_equal(t[0].keep, POLICY_NO_PLAN);
        assert_int_not_equal(t[1].keep, POLICY_NO_PLAN);
        policy_free(p);
}

static void refuses_bad_parameters(void **state) {
        const struct policy_param bad[][1] = { { { .key = "bulk", .number = 9 } },
                                               { { .key = "high", .number = 1.5 } },
                                               { { .key = "score", .is_text = true, .text = "last" } },
                                               { { .key = "budget_bytes", .number = 3 } } };
        struct policy_setup s = { .n_layers = 2, .n_heads = 2, .n_kv_heads = 1, .head_dim = 64, .max_tokens = 4096,
                                  .block_tokens = T };
        (void)state;
        for (size_t i = 0; i < N_OF(bad); i++) {
                struct policy *p = NULL;
                char why[160] = "";
                assert_int_equal(policy_new("ladder", &s, bad[i], 1, &p, why, sizeof(why)), -EINVAL);
                assert_null(p);
        }
        struct policy *p = make(0, NULL, 0);
        struct policy_limits lim;
        p->ops->limits(p->state, &lim);
        assert_true(lim.token_tiers);
        assert_false(lim.per_head);
        assert_int_equal(lim.max_keep, 4096);
        policy_free(p);
}

int main(void) {
        const struct CMUnitTest tests[] = {
                cmocka_unit_test(allocate_edges),
                cmocka_unit_test(allocate_lifts_the_top_a_tier_at_a_time),
                cmocka_unit_test(allocate_lowers_the_least_important_first),
                cmocka_unit_test(allocate_is_monotone_in_the_budget),
                cmocka_unit_test(select_keeps_sinks_and_window_high_and_ranks_the_rest),
                cmocka_unit_test(select_below_the_sinks_and_window_keeps_the_sinks_then_the_newest),
                cmocka_unit_test(select_breaks_ties_towards_the_newest),
                cmocka_unit_test(decide_plans_a_block_at_a_time_and_when_the_budget_falls),
                cmocka_unit_test(refuses_bad_parameters),
        };
        return cmocka_run_group_tests(tests, NULL, NULL);
}
