/* test_policy.c - unit tests of daemon/policy: select_topk, policy_new and its parameters, the
 * full and window policies, and policy_confidence.
 *
 * Owns: select_topk against a sort-based oracle that states the contract directly (the k
 * largest, NaN equal to -inf, -0 equal to +0, ties to the larger index, output ascending) on
 * random inputs rich in ties and special values, and on large adversarial orders; the
 * construction errors of policy_new; the window policy's limits, trigger and keep-set; the full
 * policy's never planning; hand-computed confidences.
 *
 * Output and scratch buffers are allocated at exactly the documented size, so a write past
 * them is an AddressSanitizer error in `make check`.
 */
#include <errno.h>
#include <float.h>
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "testutil.h"

#include "policy/policy.h"


static float float_of(uint32_t b) {
        float f;
        memcpy(&f, &b, 4);
        return f;
}

/* ---- select_topk ---- */

static const float *oracle_score;

/* NaN is -inf; -0 == +0 falls out of float comparison. */
static float ranked(float f) {
        return isnan(f) ? -INFINITY : f;
}

/* Descending by score, ties by descending index: the first k are the ones to keep. */
static int oracle_cmp(const void *pa, const void *pb) {
        uint32_t a = *(const uint32_t *)pa, b = *(const uint32_t *)pb;
        float x = ranked(oracle_score[a]), y = ranked(oracle_score[b]);
        if (x != y)
                return x > y ? -1 : 1;
        return a > b ? -1 : a < b ? 1 : 0;
}

static int cmp_u32(const void *pa, const void *pb) {
        uint32_t a = *(const uint32_t *)pa, b = *(const uint32_t *)pb;
        return a < b ? -1 : a > b;
}

static int cmp_i32(const void *pa, const void *pb) {
        int32_t a = *(const int32_t *)pa, b = *(const int32_t *)pb;
        return a < b ? -1 : a > b;
}

/* The oracle's keep-set, ascending, in a new array of min(k, n) entries. */
static uint32_t *oracle_topk(const float *score, uint32_t n, uint32_t k) {
        uint32_t m = k < n ? k : n;
        uint32_t *idx = malloc((n ? n : 1) * sizeof(*idx));
        assert_non_null(idx);
        for (uint32_t i = 0; i < n; i++)
                idx[i] = i;
        oracle_score = score;
        qsort(idx, n, sizeof(*idx), oracle_cmp);
        qsort(idx, m, sizeof(*idx), cmp_u32);
        return idx;
}

/* Runs select_topk with exactly sized buffers and compares with the oracle. */
static void check_topk(const float *score, uint32_t n, uint32_t k, const char *what) {
        uint32_t m = k < n ? k : n;
        uint32_t *out = malloc((m ? m : 1) * sizeof(*out));
        uint32_t *scratch = malloc((n ? n : 1) * sizeof(*scratch));
        uint32_t *want = oracle_topk(score, n, k);

        assert_non_null(out);
        assert_non_null(scratch);
        select_topk(score, n, k, m ? out : NULL, scratch);
        for (uint32_t i = 0; i < m; i++) {
                if (out[i] != want[i])
                        fail_msg("%s (n %u, k %u): out[%u] = %u (score %a), want %u (score %a)", what, n, k,
                                 i, out[i], out[i] < n ? (double)score[out[i]] : 0.0, want[i],
                                 (double)score[want[i]]);
        }
        free(want);
        free(scratch);
        free(out);
}

/* A score drawn from a distribution heavy in ties and special values. */
static float nasty_float(uint32_t kind) {
        static const float specials[] = { 0.0f,    -0.0f,    INFINITY, -INFINITY, FLT_MAX, -FLT_MAX,
                                          FLT_MIN, -FLT_MIN, 1.0f,     -1.0f,     1e-45f,  -1e-45f };
        switch (kind % 6) {
        case 0: return specials[rng_below(sizeof(specials) / sizeof(specials[0]))];
        case 1: /* NaNs of both signs and several payloads */
                return float_of((rng_below(2) ? 0xff800000u : 0x7f800000u) | (1 + rng_below(0x7fffff)));
        case 2: /* a handful of values: many exact ties */ return (float)rng_below(4) - 1.5f;
        case 3: /* neighbours that differ only in the lowest byte */
                return float_of(0x3f800000u + rng_below(4));
        case 4: /* any bits but NaN */
        {
                float f = float_of((uint32_t)rng_next());
                return isnan(f) ? 2.0f : f;
        }
        default: return (float)(rng_next() >> 40) / (float)(1u << 24) - 0.5f;
        }
}

static void select_topk_matches_sort_oracle_on_random_scores(void **state) {
        (void)state;
        rng_state = 0x70b4;
        for (int iter = 0; iter < 3000; iter++) {
                uint32_t n = 1 + rng_below(iter < 1000 ? 12 : 400);
                uint32_t mix = rng_below(64); /* which kinds of float this array draws from */
                float *score = malloc(n * sizeof(*score));
                assert_non_null(score);
                for (uint32_t i = 0; i < n; i++) {
                        uint32_t kind;
                        do
                                kind = rng_below(6);
                        while (!(mix >> kind & 1) && mix != 0);
                        score[i] = nasty_float(kind);
                }
                uint32_t ks[] = { 0, 1, n / 2, n - 1, n, n + 1, rng_below(n + 3) };
                for (size_t ki = 0; ki < sizeof(ks) / sizeof(ks[0]); ki++)
                        check_topk(score, n, ks[ki], "random scores");
                free(score);
        }
}

static void select_topk_handles_the_edges_of_k_and_n(void **state) {
        const float one[] = { NAN };
        const float s[] = { 3, 1, 2 };
        uint32_t out[3] = { 77, 77, 77 }, scratch[3];
        (void)state;

        check_topk(one, 1, 0, "n 1, k 0");
        check_topk(one, 1, 1, "n 1, k 1");
        check_topk(one, 1, 5, "n 1, k 5");
        /* k = 0 writes nothing */
        select_topk(s, 3, 0, out, scratch);
        assert_int_equal(out[0], 77);
        /* k >= n keeps everything, in order */
        select_topk(s, 3, 3, out, scratch);
        assert_int_equal(out[0], 0);
        assert_int_equal(out[1], 1);
        assert_int_equal(out[2], 2);
        select_topk(s, 3, UINT32_MAX, out, scratch);
        assert_int_equal(out[2], 2);
        /* n = 0 */
        select_topk(s, 0, 0, out, scratch);
        select_topk(s, 0, 4, out, scratch);
        /* the largest, and the two largest */
        select_topk(s, 3, 1, out, scratch);
        assert_int_equal(out[0], 0);
        select_topk(s, 3, 2, out, scratch);
        assert_int_equal(out[0], 0);
        assert_int_equal(out[1], 2);
}

/* The contract's special cases, one by one. */
static void select_topk_ranks_nan_as_minus_inf_and_ties_to_the_larger_index(void **state) {
        uint32_t out[2], scratch[4];
        (void)state;

        const float nan_vs_inf[] = { -INFINITY, NAN };
        select_topk(nan_vs_inf, 2, 1, out, scratch);
        assert_int_equal(out[0], 1); /* a tie: the more recent slot */
        const float inf_vs_nan[] = { NAN, -INFINITY };
        select_topk(inf_vs_nan, 2, 1, out, scratch);
        assert_int_equal(out[0], 1);
        const float nan_vs_low[] = { -FLT_MAX, NAN, -INFINITY };
        select_topk(nan_vs_low, 3, 1, out, scratch);
        assert_int_equal(out[0], 0);
        const float zeros[] = { 0.0f, -0.0f };
        select_topk(zeros, 2, 1, out, scratch);
        assert_int_equal(out[0], 1);
        const float zeros2[] = { -0.0f, 0.0f, -0.0f, -1e-45f };
        select_topk(zeros2, 4, 2, out, scratch);
        assert_int_equal(out[0], 1);
        assert_int_equal(out[1], 2);
        const float infs[] = { INFINITY, FLT_MAX, INFINITY, 5 };
        select_topk(infs, 4, 2, out, scratch);
        assert_int_equal(out[0], 0);
        assert_int_equal(out[1], 2);
        const float ties[] = { 7, 7, 7, 7 };
        select_topk(ties, 4, 2, out, scratch);
        assert_int_equal(out[0], 2);
        assert_int_equal(out[1], 3);
}

/* Inputs that make a naive quickselect quadratic, or stress one radix bucket: correct and
 * linear (no time is measured; a quadratic pass over 200000 entries would be felt). */
static void select_topk_handles_adversarial_orders(void **state) {
        enum { N = 200000 };
        float *score = malloc(N * sizeof(*score));
        (void)state;
        assert_non_null(score);

        for (uint32_t i = 0; i < N; i++)
                score[i] = 0.25f;
        check_topk(score, N, N / 2, "all equal");
        check_topk(score, N, 1, "all equal, k 1");
        for (uint32_t i = 0; i < N; i++)
                score[i] = (float)i;
        check_topk(score, N, N / 3, "ascending");
        for (uint32_t i = 0; i < N; i++)
                score[i] = (float)(N - i);
        check_topk(score, N, N / 3, "descending");
        /* organ pipe: up then down */
        for (uint32_t i = 0; i < N; i++)
                score[i] = (float)(i < N / 2 ? i : N - i);
        check_topk(score, N, 1000, "organ pipe");
        /* every value in the same top three bytes: the last radix pass decides */
        for (uint32_t i = 0; i < N; i++)
                score[i] = float_of(0x3f800000u + (i * 37u) % 256u);
        check_topk(score, N, N / 2 + 1, "one bucket");
        /* all NaN but a few */
        for (uint32_t i = 0; i < N; i++)
                score[i] = NAN;
        score[N / 3] = -INFINITY;
        score[17] = 1.0f;
        check_topk(score, N, 5, "mostly NaN");
        /* a median-of-three killer for a textbook quickselect */
        for (uint32_t i = 0; i < N; i++)
                score[i] = (float)(i % 2 ? i : N + i / 2);
        check_topk(score, N, N / 2, "median-of-three killer");
        free(score);
}

/* ---- policy_new ---- */

static struct policy_setup setup_default(void) {
        return (struct policy_setup){ .n_layers = 4,
                                      .n_heads = 8,
                                      .n_kv_heads = 2,
                                      .head_dim = 64,
                                      .max_tokens = 4096,
                                      .block_tokens = 16,
                                      .budget_tokens = 256 };
}

static struct policy *policy_make(const char *name, const struct policy_setup *s,
                                  const struct policy_param *params, size_t n) {
        struct policy *p = NULL;
        char why[128] = "";
        int r = policy_new(name, s, params, n, &p, why, sizeof(why));
        if (r != 0)
                fail_msg("policy_new(%s) = %d (%s)", name, r, why);
        assert_non_null(p);
        return p;
}

#define EXPECT_POLICY_ERROR(name, params, n, code, word)                                                     \
        expect_policy_error((name), (params), (n), (code), (word), __LINE__)

static void expect_policy_error(const char *name, const struct policy_param *params, size_t n, int code,
                                const char *word, int line) {
        struct policy_setup s = setup_default();
        struct policy *sentinel = (struct policy *)&s, *p = sentinel;
        char why[128] = "";
        int r = policy_new(name, &s, params, n, &p, why, sizeof(why));
        if (r != code || !strstr(why, word) || p != sentinel)
                fail_msg("line %d: policy_new(%s) = %d (%s), want %d mentioning '%s'%s", line, name, r, why,
                         code, word, p != sentinel ? ", and *ret was written" : "");
}

static void policy_new_rejects_unknown_names(void **state) {
        (void)state;
        EXPECT_POLICY_ERROR("lru", NULL, 0, -ENOENT, "unknown policy 'lru'");
        EXPECT_POLICY_ERROR("", NULL, 0, -ENOENT, "unknown policy");
        EXPECT_POLICY_ERROR("Window", NULL, 0, -ENOENT, "'Window'");
        EXPECT_POLICY_ERROR("window ", NULL, 0, -ENOENT, "unknown policy");
}

static void policy_new_rejects_unknown_parameters(void **state) {
        const struct policy_param foo[] = { { .key = "foo", .number = 1 } };
        const struct policy_param gamma_then_foo[] = { { .key = "ema_gamma", .number = 0.5 },
                                                       { .key = "bar", .is_text = true, .text = "x" } };
        (void)state;
        EXPECT_POLICY_ERROR("window", foo, 1, -EINVAL, "unknown parameter 'foo'");
        EXPECT_POLICY_ERROR("full", foo, 1, -EINVAL, "unknown parameter 'foo'");
        EXPECT_POLICY_ERROR("window", gamma_then_foo, 2, -EINVAL, "unknown parameter 'bar'");
}

static void policy_new_checks_ema_gamma(void **state) {
        const double bad[] = { -0.001, 1.001, -1, 2, NAN, INFINITY, -INFINITY };
        const double good[] = { 0, 0.5, 0.95, 1 };
        const struct policy_param text[] = { { .key = "ema_gamma", .is_text = true, .text = "high" } };
        struct policy_setup s = setup_default();
        (void)state;

        for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
                const struct policy_param p[] = { { .key = "ema_gamma", .number = bad[i] } };
                EXPECT_POLICY_ERROR("window", p, 1, -EINVAL, "ema_gamma");
                EXPECT_POLICY_ERROR("full", p, 1, -EINVAL, "not in [0, 1]");
        }
        EXPECT_POLICY_ERROR("window", text, 1, -EINVAL, "ema_gamma must be a number");

        for (size_t i = 0; i < sizeof(good) / sizeof(good[0]); i++) {
                const struct policy_param p[] = { { .key = "ema_gamma", .number = good[i] } };
                struct policy *pol = policy_make("window", &s, p, 1);
                assert_true(pol->ema_gamma == (float)good[i]);
                policy_free(pol);
        }
        /* the default */
        struct policy *pol = policy_make("full", &s, NULL, 0);
        assert_true(pol->ema_gamma == 0.9f);
        assert_ptr_equal(pol->ops, &policy_full_ops);
        assert_int_equal(pol->setup.max_tokens, 4096);
        assert_null(policy_free(pol));
        assert_null(policy_free(NULL));
}

static void policy_param_number_finds_numbers_only(void **state) {
        const struct policy_param p[] = { { .key = "a", .number = 1.5 },
                                          { .key = "b", .is_text = true, .text = "x" },
                                          { .key = "a", .number = 2.5 } };
        double v = 42;
        (void)state;
        assert_int_equal(policy_param_number(p, 3, "a", &v), 0);
        assert_true(v == 1.5); /* the first one */
        v = 42;
        assert_int_equal(policy_param_number(p, 3, "b", &v), -EINVAL);
        assert_true(v == 42);
        assert_int_equal(policy_param_number(p, 3, "c", &v), -ENOENT);
        assert_int_equal(policy_param_number(p, 0, "a", &v), -ENOENT);
        assert_true(v == 42);
}

/* ---- full and window ---- */

static void policy_full_keeps_everything_and_never_plans(void **state) {
        struct policy_setup s = setup_default();
        struct policy *p = policy_make("full", &s, NULL, 0);
        uint32_t budget, max_layer, max_keep, targets[5];
        bool per_head = true;
        (void)state;

        p->ops->limits(p->state, 0, &budget, &max_layer, &max_keep, &per_head);
        assert_int_equal(budget, 4096);
        assert_int_equal(max_layer, 4096);
        assert_int_equal(max_keep, 0);
        assert_false(per_head);
        const uint32_t lens[][4] = { { 0, 0, 0, 0 }, { 272, 273, 4096, 4096 }, { UINT32_MAX, 1, 2, 3 } };
        for (size_t i = 0; i < 3; i++) {
                struct policy_step st = { .step = i + 1, .layer_tokens = lens[i] };
                for (int l = 0; l < 5; l++)
                        targets[l] = POLICY_NO_PLAN;
                p->ops->decide(p->state, &st, targets);
                for (int l = 0; l < 5; l++)
                        assert_int_equal(targets[l], POLICY_NO_PLAN);
        }
        uint32_t keep[1];
        assert_int_equal(p->ops->select(p->state, &(struct policy_layer){ .n_tokens = 1, .n_kv_heads = 2 }, 1,
                                        keep, NULL),
                         -EINVAL);
        policy_free(p);
}

static void policy_window_states_its_limits(void **state) {
        const struct {
                uint32_t budget, max_tokens, want_budget;
        } rows[] = {
                { 256, 4096, 256 },    { 0, 4096, 256 }, /* the default */
                { 0, 100, 100 },                         /* the default, clamped to the context */
                { 10000, 4096, 4096 }, { 1, 4096, 1 },
        };
        (void)state;
        for (size_t i = 0; i < sizeof(rows) / sizeof(rows[0]); i++) {
                struct policy_setup s = setup_default();
                s.budget_tokens = rows[i].budget;
                s.max_tokens = rows[i].max_tokens;
                struct policy *p = policy_make("window", &s, NULL, 0);
                uint32_t budget, max_layer, max_keep;
                bool per_head = true;
                p->ops->limits(p->state, 3, &budget, &max_layer, &max_keep, &per_head);
                assert_int_equal(budget, rows[i].want_budget);
                assert_int_equal(max_layer, rows[i].want_budget + s.block_tokens);
                assert_int_equal(max_keep, rows[i].want_budget);
                assert_false(per_head);
                policy_free(p);
        }
}

/* A plan is due for exactly the layers that reached budget + block_tokens. */
static void policy_window_plans_only_at_budget_plus_a_block(void **state) {
        struct policy_setup s = setup_default();
        struct policy *p = policy_make("window", &s, NULL, 0);
        uint32_t targets[5];
        (void)state;

        const uint32_t lens[] = { 271, 272, 300, 0 };
        struct policy_step st = { .step = 9, .entropy = 0.5f, .top1_prob = 0.5f, .layer_tokens = lens };
        for (int l = 0; l < 5; l++)
                targets[l] = POLICY_NO_PLAN;
        p->ops->decide(p->state, &st, targets);
        assert_int_equal(targets[0], POLICY_NO_PLAN);
        assert_int_equal(targets[1], 256);
        assert_int_equal(targets[2], 256);
        assert_int_equal(targets[3], POLICY_NO_PLAN);
        assert_int_equal(targets[4], POLICY_NO_PLAN); /* past n_layers: untouched */

        /* decoding one token at a time from the budget: one plan per block of tokens */
        uint32_t len[4], plans = 0;
        for (uint32_t step = 0, n = 256; step < 160; step++) {
                for (int l = 0; l < 4; l++)
                        len[l] = n;
                for (int l = 0; l < 4; l++)
                        targets[l] = POLICY_NO_PLAN;
                st.layer_tokens = len;
                p->ops->decide(p->state, &st, targets);
                if (targets[0] != POLICY_NO_PLAN) {
                        assert_int_equal(n, 272);
                        for (int l = 1; l < 4; l++)
                                assert_int_equal(targets[l], 256);
                        plans++;
                        n = targets[0];
                }
                n++;
        }
        assert_int_equal(plans, 9); /* at steps 16, 32, ..., 144 */
        policy_free(p);
}

/* The keep-set is the slots of the `budget` largest original positions, ascending. */
static void policy_window_keeps_the_most_recent_positions(void **state) {
        struct policy_setup s = setup_default();
        struct policy *p = policy_make("window", &s, NULL, 0);
        (void)state;
        rng_state = 0x3d;
        for (int iter = 0; iter < 20; iter++) {
                uint32_t n = 272 + rng_below(200), H = s.n_kv_heads, target = 256;
                int32_t *pos = malloc((size_t)H * n * sizeof(*pos));
                uint32_t *keep = malloc(target * sizeof(*keep));
                uint32_t *scratch = malloc((size_t)n * H * 2 * sizeof(*scratch));
                assert_true(pos && keep && scratch);
                /* positions: gaps from earlier evictions, then shuffled (as after per-head moves) */
                for (uint32_t i = 0, v = 5; i < n; i++, v += 1 + rng_below(3))
                        pos[i] = (int32_t)v;
                for (uint32_t i = n; i > 1; i--) {
                        uint32_t j = rng_below(i);
                        int32_t x = pos[i - 1];
                        pos[i - 1] = pos[j];
                        pos[j] = x;
                }
                for (uint32_t i = 0; i < n; i++)
                        pos[n + i] = pos[i]; /* head 1 holds the same tokens */
                struct policy_layer L = { .layer = 2, .n_tokens = n, .n_kv_heads = H, .pos = pos };
                assert_int_equal(p->ops->select(p->state, &L, target, keep, scratch), 0);

                int32_t *sorted = malloc(n * sizeof(*sorted));
                assert_non_null(sorted);
                memcpy(sorted, pos, n * sizeof(*sorted));
                qsort(sorted, n, sizeof(*sorted), cmp_i32);
                int32_t threshold = sorted[n - target];
                for (uint32_t i = 0; i < target; i++) {
                        assert_true(keep[i] < n);
                        if (i > 0)
                                assert_true(keep[i] > keep[i - 1]);
                        assert_true(pos[keep[i]] >= threshold);
                }
                free(sorted);
                free(pos);
                free(keep);
                free(scratch);
        }
        policy_free(p);
}

/* ---- confidence ---- */

static void policy_confidence_matches_hand_computed_values(void **state) {
        const struct {
                float entropy, top1, margin;
                double want;
        } rows[] = {
                { 0, 1, 0, 0.4 + 0.15 + 0.3 },                   /* 0.85 */
                { 1, 0, 0, 0.15 },                               /* the floor */
                { 0, 1, 100, 1.0 },                              /* sigmoid saturates */
                { 0.25f, 0.5f, 1.0986123f, 0.3 + 0.225 + 0.15 }, /* sigmoid(ln 3) = 3/4 */
                { 0.5f, 0.6f, 2, 0.2 + 0.3 * 0.8807970779778823 + 0.18 },
                { 0.5f, 0.5f, 1e30f, 0.2 + 0.3 + 0.15 },
                { 1, 0, 3e38f, 0.3 },
        };
        (void)state;
        for (size_t i = 0; i < sizeof(rows) / sizeof(rows[0]); i++) {
                float c = policy_confidence(rows[i].entropy, rows[i].top1, rows[i].margin);
                if (!(fabs(c - rows[i].want) <= 1e-6))
                        fail_msg("row %zu: confidence %.9g, want %.9g", i, (double)c, rows[i].want);
        }
        /* inside [0.15, 1] over the valid inputs */
        rng_state = 0xc0f;
        for (int i = 0; i < 10000; i++) {
                float e = (float)rng_below(1001) / 1000, p1 = (float)rng_below(1001) / 1000;
                float m = float_of((uint32_t)rng_next() & 0x7f7fffffu);
                float c = policy_confidence(e, p1, m);
                assert_true(c >= 0.15f - 1e-6f && c <= 1.0f + 1e-6f);
        }
}

int main(void) {
        const struct CMUnitTest tests[] = {
                cmocka_unit_test(select_topk_matches_sort_oracle_on_random_scores),
                cmocka_unit_test(select_topk_handles_the_edges_of_k_and_n),
                cmocka_unit_test(select_topk_ranks_nan_as_minus_inf_and_ties_to_the_larger_index),
                cmocka_unit_test(select_topk_handles_adversarial_orders),
                cmocka_unit_test(policy_new_rejects_unknown_names),
                cmocka_unit_test(policy_new_rejects_unknown_parameters),
                cmocka_unit_test(policy_new_checks_ema_gamma),
                cmocka_unit_test(policy_param_number_finds_numbers_only),
                cmocka_unit_test(policy_full_keeps_everything_and_never_plans),
                cmocka_unit_test(policy_window_states_its_limits),
                cmocka_unit_test(policy_window_plans_only_at_budget_plus_a_block),
                cmocka_unit_test(policy_window_keeps_the_most_recent_positions),
                cmocka_unit_test(policy_confidence_matches_hand_computed_values),
        };
        return cmocka_run_group_tests(tests, NULL, NULL);
}
