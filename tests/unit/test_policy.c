/* test_policy.c - unit tests of daemon/policy: the shared helpers (select_topk, policy_keep_ranked,
 * the pyramid schedule, confidence, parameter parsing) and every policy driven through its real
 * interface, with this file playing kvcd's part as daemon/session.c does: targets initialized to
 * {POLICY_NO_PLAN, 0}, observe before decide when the policy asks, select into exactly sized
 * buffers, log-weight deltas added at the kept slots, the layers compacted to the keep-sets.
 *
 * Owns: select_topk against a sort-based oracle; hand-computed cases from each policy's formula
 * (budgets at given confidences and steps, the pyramid and SCOPE schedules, planted heavy
 * hitters, sinks and windows, pooled observation spikes, conf's ranking); prob's sampling (its
 * deterministic limit on random cases, its log-weights against prob_inclusion, its inclusion
 * frequencies within five sigma, its seeds, its corrections); parameter validation for every
 * policy; and a seeded simulation of whole sessions per policy on wild scores (NaN, inf,
 * negative), checking after every plan that keep-sets are strictly ascending, in range, exactly
 * target.keep long per set, keep what the policy promises, and that no layer ever needs more than
 * limits.max_layer_tokens nor any plan more than limits.max_keep.
 *
 * Output and scratch buffers are allocated at exactly the documented sizes (scratch: 4 *
 * n_kv_heads * n_tokens words, as policy.h states; kvcd gives 6), so a write past them is an
 * AddressSanitizer error in `make check`.
 */
#include <errno.h>
#include <float.h>
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "testutil.h"

#include "policy/policy.h"

#define N_OF(a) (sizeof(a) / sizeof((a)[0]))
#define NUM(k, v)                                                                                            \
        { .key = (k), .number = (v) }
#define TEXT(k, v)                                                                                           \
        { .key = (k), .is_text = true, .text = (v) }

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

/* ---- kvcd's part: setups, policies, steps, layers, plans ---- */

static struct policy_setup setup_of(uint32_t n_layers, uint32_t n_kv_heads, uint32_t max_tokens,
                                    uint32_t block_tokens, uint32_t budget, uint32_t prompt) {
        return (struct policy_setup){ .n_layers = n_layers,
                                      .n_heads = 2 * n_kv_heads,
                                      .n_kv_heads = n_kv_heads,
                                      .head_dim = 8,
                                      .max_tokens = max_tokens,
                                      .block_tokens = block_tokens,
                                      .budget_tokens = budget,
                                      .prompt_tokens = prompt,
                                      .session_id = 77 };
}

static struct policy_setup setup_default(void) {
        return setup_of(4, 2, 4096, 16, 256, 0);
}

static struct policy *policy_make(const char *name, const struct policy_setup *s,
                                  const struct policy_param *params, size_t n) {
        struct policy *p = NULL;
        char why[160] = "";
        int r = policy_new(name, s, params, n, &p, why, sizeof(why));
        if (r != 0)
                fail_msg("policy_new(%s) = %d (%s)", name, r, why);
        assert_non_null(p);
        return p;
}

static struct policy_limits limits_of(const struct policy *p) {
        struct policy_limits lim;
        memset(&lim, 0xa5, sizeof(lim));
        p->ops->limits(p->state, &lim);
        return lim;
}

#define EXPECT_POLICY_ERROR(name, params, n, code, word)                                                     \
        expect_policy_error_in(setup_default(), (name), (params), (n), (code), (word), __LINE__)
#define EXPECT_POLICY_ERROR_IN(setup, name, params, n, code, word)                                           \
        expect_policy_error_in((setup), (name), (params), (n), (code), (word), __LINE__)

/* policy_new must fail with code, say `word` in why, and leave *ret alone. */
static void expect_policy_error_in(struct policy_setup s, const char *name, const struct policy_param *params,
                                   size_t n, int code, const char *word, int line) {
        struct policy *sentinel = (struct policy *)&s, *p = sentinel;
        char why[160] = "";
        int r = policy_new(name, &s, params, n, &p, why, sizeof(why));
        if (r != code || !strstr(why, word) || p != sentinel)
                fail_msg("at %d: policy_new(%s) = %d (%s), want %d mentioning '%s'%s", line, name, r, why,
                         code, word, p != sentinel ? ", and *ret was written" : "");
}

static struct policy_step step_of(uint64_t appended, const uint32_t *lens, float confidence) {
        return (struct policy_step){ .step = appended,
                                     .entropy = 0.5f,
                                     .top1_prob = 0.5f,
                                     .margin = 1.0f,
                                     .confidence = confidence,
                                     .appended = appended,
                                     .layer_tokens = lens };
}

/* decide() as kvcd calls it: targets[n_layers] start at {POLICY_NO_PLAN, 0}; one more entry past
 * them must stay untouched. */
static void decide_into(struct policy *p, const struct policy_step *st, struct policy_target *t) {
        uint32_t L = p->setup.n_layers;
        for (uint32_t l = 0; l <= L; l++)
                t[l] = (struct policy_target){ .keep = POLICY_NO_PLAN, .low = 0 };
        p->ops->decide(p->state, st, t);
        assert_int_equal(t[L].keep, POLICY_NO_PLAN);
        assert_int_equal(t[L].low, 0);
}

/* The target of layer 0 for one step with every layer at n tokens. */
static uint32_t keep_at(struct policy *p, uint64_t appended, uint32_t n, float confidence) {
        uint32_t lens[64];
        struct policy_target t[65];
        assert_true(p->setup.n_layers < 64);
        for (uint32_t l = 0; l < p->setup.n_layers; l++)
                lens[l] = n;
        struct policy_step st = step_of(appended, lens, confidence);
        decide_into(p, &st, t);
        return t[0].keep;
}

/* One layer's side arrays, [heads][n] each; positions 0..n-1, scores and log-weights 0. */
struct arrays {
        uint32_t heads, n;
        int32_t *pos;
        float *sum, *ema, *last, *logw;
};

static struct arrays arrays_new(uint32_t heads, uint32_t n) {
        size_t m = (size_t)heads * n > 0 ? (size_t)heads * n : 1;
        struct arrays a = { .heads = heads,
                            .n = n,
                            .pos = calloc(m, sizeof(int32_t)),
                            .sum = calloc(m, sizeof(float)),
                            .ema = calloc(m, sizeof(float)),
                            .last = calloc(m, sizeof(float)),
                            .logw = calloc(m, sizeof(float)) };
        assert_true(a.pos && a.sum && a.ema && a.last && a.logw);
        for (uint32_t h = 0; h < heads; h++)
                for (uint32_t i = 0; i < n; i++)
                        a.pos[(size_t)h * n + i] = (int32_t)i;
        return a;
}

static void arrays_free(struct arrays *a) {
        free(a->pos);
        free(a->sum);
        free(a->ema);
        free(a->last);
        free(a->logw);
        memset(a, 0, sizeof(*a));
}

static struct policy_layer view_of(const struct arrays *a, uint32_t layer) {
        return (struct policy_layer){ .layer = layer,
                                      .n_tokens = a->n,
                                      .n_kv_heads = a->heads,
                                      .pos = a->pos,
                                      .sum = a->sum,
                                      .ema = a->ema,
                                      .last = a->last,
                                      .logw = a->logw };
}

/* A plan of one layer: select() into buffers of exactly the sizes kvcd promises. */
struct selection {
        int r;
        uint32_t sets, k, n;
        uint32_t *keep;
        float *delta;
};

static struct selection select_layer(struct policy *p, const struct policy_step *st,
                                     const struct policy_layer *L, struct policy_target t) {
        struct policy_limits lim = limits_of(p);
        struct selection s = { .sets = lim.per_head ? L->n_kv_heads : 1, .k = t.keep, .n = L->n_tokens };
        size_t entries = (size_t)s.sets * t.keep, words = 4 * (size_t)L->n_kv_heads * L->n_tokens;
        s.keep = malloc((entries ? entries : 1) * sizeof(uint32_t));
        s.delta = malloc((entries ? entries : 1) * sizeof(float));
        void *scratch = malloc((words ? words : 1) * sizeof(uint32_t));
        assert_true(s.keep && s.delta && scratch);
        for (size_t i = 0; i < entries; i++) {
                s.keep[i] = UINT32_MAX;
                s.delta[i] = NAN;
        }
        s.r = p->ops->select(p->state, st, L, &t, s.keep, s.delta, scratch);
        free(scratch);
        if (s.r < 0)
                return s;
        assert_true(s.r == 0 || s.r == 1);
        for (uint32_t h = 0; h < s.sets; h++) {
                const uint32_t *kh = s.keep + (size_t)h * s.k;
                for (uint32_t i = 0; i < s.k; i++) {
                        if (kh[i] >= s.n || (i > 0 && kh[i] <= kh[i - 1]))
                                fail_msg("%s: set %u: keep[%u] = %u after %u (n %u, k %u)", p->ops->name, h,
                                         i, kh[i], i ? kh[i - 1] : 0, s.n, s.k);
                }
        }
        for (size_t i = 0; s.r == 1 && i < entries; i++)
                if (!isfinite(s.delta[i]))
                        fail_msg("%s: log-weight delta %zu not written (or not finite)", p->ops->name, i);
        return s;
}

static void selection_free(struct selection *s) {
        free(s->keep);
        free(s->delta);
        s->keep = NULL;
        s->delta = NULL;
}

/* Compares set h of a selection with slots written as "0-3,20,22-47". */
static void expect_slots_at(const struct selection *s, uint32_t h, const char *want, int line) {
        uint32_t exp[4096], m = 0;
        for (const char *c = want; *c;) {
                char *end;
                unsigned long a = strtoul(c, &end, 10), b = a;
                if (*end == '-')
                        b = strtoul(end + 1, &end, 10);
                for (unsigned long i = a; i <= b; i++) {
                        assert_true(m < N_OF(exp));
                        exp[m++] = (uint32_t)i;
                }
                c = *end == ',' ? end + 1 : end;
        }
        const uint32_t *kh = s->keep + (size_t)h * s->k;
        bool same = m == s->k;
        for (uint32_t i = 0; same && i < m; i++)
                same = kh[i] == exp[i];
        if (same)
                return;
        char got[2048] = "";
        for (uint32_t i = 0; i < s->k && strlen(got) < sizeof(got) - 16; i++)
                snprintf(got + strlen(got), sizeof(got) - strlen(got), "%s%u", i ? "," : "", kh[i]);
        fail_msg("line %d: set %u keeps {%s} (%u), want {%s} (%u)", line, h, got, s->k, want, m);
}

#define EXPECT_SLOTS(sel, h, want) expect_slots_at(&(sel), (h), (want), __LINE__)

static bool keeps(const struct selection *s, uint32_t h, uint32_t slot) {
        const uint32_t *kh = s->keep + (size_t)h * s->k;
        for (uint32_t i = 0; i < s->k; i++)
                if (kh[i] == slot)
                        return true;
        return false;
}

/* ---- helpers every policy shares ---- */

static void keep_ranked_keeps_sinks_recent_and_the_best_between(void **state) {
        float score[10] = { 0, 0, 9, 1, INFINITY, NAN, 5, 0, 0, 0 };
        uint32_t keep[6], scratch[10];
        (void)state;

        /* sinks 2, recent 2: the client's +inf in the middle is clamped below the protected ones */
        policy_keep_ranked(score, 10, 6, 2, 2, keep, scratch);
        assert_int_equal(keep[0], 0);
        assert_int_equal(keep[1], 1);
        assert_int_equal(keep[2], 2);
        assert_int_equal(keep[3], 4);
        assert_int_equal(keep[4], 8);
        assert_int_equal(keep[5], 9);
}

static void keep_ranked_shrinks_recent_then_sinks_when_k_is_small(void **state) {
        float score[8];
        uint32_t keep[8], scratch[8];
        (void)state;

        for (int i = 0; i < 8; i++)
                score[i] = (float)(10 - i);
        policy_keep_ranked(score, 8, 3, 2, 4, keep, scratch); /* recent shrinks to 1 */
        assert_int_equal(keep[0], 0);
        assert_int_equal(keep[1], 1);
        assert_int_equal(keep[2], 7);
        for (int i = 0; i < 8; i++)
                score[i] = (float)(10 - i);
        policy_keep_ranked(score, 8, 2, 5, 4, keep, scratch); /* sinks shrink to k, no recent */
        assert_int_equal(keep[0], 0);
        assert_int_equal(keep[1], 1);
        for (int i = 0; i < 8; i++)
                score[i] = (float)i;
        policy_keep_ranked(score, 8, 20, 1, 1, keep, scratch); /* k beyond n keeps everything */
        for (uint32_t i = 0; i < 8; i++)
                assert_int_equal(keep[i], i);
}

static void mean_over_heads_averages_each_slot(void **state) {
        const float in[] = { 1, 2, 3, 3, 6, -3 };
        float out[3], six[6];
        (void)state;
        policy_mean_over_heads(in, 2, 3, out);
        assert_true(out[0] == 2.0f && out[1] == 4.0f && out[2] == 0.0f);
        policy_mean_over_heads(in, 1, 6, six);
        assert_true(six[0] == 1.0f && six[2] == 3.0f && six[5] == -3.0f);
}

/* B = 64, L = 5, beta = 20: min 3.2, max 124.8, step 30.4: 124.8, 94.4, 64, 33.6, 3.2, rounded. */
static void pyramid_budget_matches_the_hand_computed_schedule(void **state) {
        const uint32_t want[] = { 125, 94, 64, 34, 3 };
        (void)state;
        for (uint32_t l = 0; l < 5; l++)
                assert_int_equal(policy_pyramid_budget(64, l, 5, 20.0f), want[l]);
        /* B = 96: min 4.8, max 187.2, step 45.6 */
        const uint32_t want96[] = { 187, 142, 96, 50, 5 };
        for (uint32_t l = 0; l < 5; l++)
                assert_int_equal(policy_pyramid_budget(96, l, 5, 20.0f), want96[l]);
        /* one layer, or beta <= 1: the average itself; never 0 */
        assert_int_equal(policy_pyramid_budget(64, 0, 1, 20.0f), 64);
        assert_int_equal(policy_pyramid_budget(64, 3, 5, 1.0f), 64);
        assert_int_equal(policy_pyramid_budget(4, 4, 5, 20.0f), 1);
}

/* The layers average B: exactly when no layer's budget is rounded from a half (or up from 0), and
 * otherwise each symmetric pair of layers holds at most one token more than 2B. */
static void pyramid_budget_averages_to_the_budget(void **state) {
        const float betas[] = { 1.5f, 2.0f, 5.0f, 20.0f, 100.0f };
        (void)state;
        assert_int_equal(125 + 94 + 64 + 34 + 3, 5 * 64);
        for (uint32_t avg = 1; avg <= 300; avg += 7) {
                for (uint32_t L = 2; L <= 40; L++) {
                        for (size_t b = 0; b < N_OF(betas); b++) {
                                uint64_t sum = 0;
                                bool half = false;
                                double min = avg / (double)betas[b], max = 2.0 * avg - min;
                                for (uint32_t l = 0; l < L; l++) {
                                        double x = max - l * (max - min) / (L - 1);
                                        half |= fabs(x - floor(x) - 0.5) < 1e-9 || x < 0.5;
                                        uint32_t got = policy_pyramid_budget(avg, l, L, betas[b]);
                                        assert_true(l == 0 ||
                                                    got <= policy_pyramid_budget(avg, l - 1, L, betas[b]));
                                        sum += got;
                                }
                                if (sum < (uint64_t)L * avg || sum > (uint64_t)L * avg + L / 2 ||
                                    (!half && sum != (uint64_t)L * avg))
                                        fail_msg("avg %u, %u layers, beta %g: sum %llu", avg, L,
                                                 (double)betas[b], (unsigned long long)sum);
                        }
                }
        }
}

static void confidence_matches_hand_computed_values(void **state) {
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
        assert_true(policy_default_conf_weights[0] == 0.4f && policy_default_conf_weights[1] == 0.3f &&
                    policy_default_conf_weights[2] == 0.3f);
        for (size_t i = 0; i < N_OF(rows); i++) {
                float c = policy_confidence(policy_default_conf_weights, rows[i].entropy, rows[i].top1,
                                            rows[i].margin);
                if (!(fabs(c - rows[i].want) <= 1e-6))
                        fail_msg("row %zu: confidence %.9g, want %.9g", i, (double)c, rows[i].want);
        }
        /* inside [0.15, 1] over the inputs kvcd accepts (entropy, top1 in [0, 1], margin >= 0) */
        rng_state = 0xc0f;
        for (int i = 0; i < 10000; i++) {
                float e = (float)rng_below(1001) / 1000, p1 = (float)rng_below(1001) / 1000;
                float m = float_of((uint32_t)rng_next() & 0x7f7fffffu);
                float c = policy_confidence(policy_default_conf_weights, e, p1, m);
                assert_true(c >= 0.15f - 1e-6f && c <= 1.0f + 1e-6f);
        }
}

static void confidence_uses_the_given_weights(void **state) {
        const float entropy_only[3] = { 1, 0, 0 }, margin_only[3] = { 0, 1, 0 }, top1_only[3] = { 0, 0, 1 };
        const float mix[3] = { 0.5f, 0.25f, 0.25f };
        (void)state;
        assert_float_equal(policy_confidence(entropy_only, 0.3f, 0.9f, 2.0f), 0.7, 1e-6);
        assert_float_equal(policy_confidence(margin_only, 0.3f, 0.9f, 0.0f), 0.5, 1e-6);
        assert_float_equal(policy_confidence(margin_only, 0.3f, 0.9f, 1.0986123f), 0.75, 1e-6);
        assert_float_equal(policy_confidence(top1_only, 0.3f, 0.9f, 2.0f), 0.9, 1e-6);
        /* 0.5 * 0.8 + 0.25 * 0.75 + 0.25 * 0.4 */
        assert_float_equal(policy_confidence(mix, 0.2f, 0.4f, 1.0986123f), 0.6875, 1e-6);
}

/* ---- policy_new and the parameters ---- */

static void policy_names_lists_every_policy_once(void **state) {
        const char *want[] = { "full",    "window", "streaming", "h2o",   "tova", "snapkv",
                               "pyramid", "conf",   "conf-l",    "scope", "prob", "pyramid-taper",
                               "ladder" };
        const char *const *names = policy_names();
        (void)state;
        for (size_t i = 0; i < N_OF(want); i++) {
                assert_non_null(names[i]);
                assert_string_equal(names[i], want[i]);
        }
        assert_null(names[N_OF(want)]);
}

static void policy_new_rejects_unknown_names(void **state) {
        (void)state;
        EXPECT_POLICY_ERROR("lru", NULL, 0, -ENOENT, "unknown policy 'lru'");
        EXPECT_POLICY_ERROR("", NULL, 0, -ENOENT, "unknown policy");
        EXPECT_POLICY_ERROR("Window", NULL, 0, -ENOENT, "'Window'");
        EXPECT_POLICY_ERROR("window ", NULL, 0, -ENOENT, "unknown policy");
}

static void policy_new_rejects_more_than_the_most_parameters(void **state) {
        struct policy_param many[POLICY_MAX_PARAMS + 1];
        (void)state;
        for (size_t i = 0; i < N_OF(many); i++)
                many[i] = (struct policy_param)NUM("slack", 4);
        EXPECT_POLICY_ERROR("window", many, N_OF(many), -EINVAL, "at most 32");
        struct policy_setup s = setup_default();
        policy_free(policy_make("window", &s, many, POLICY_MAX_PARAMS));
}

static void policy_new_checks_ema_gamma(void **state) {
        const double bad[] = { -0.001, 1.001, -1, 2, NAN, INFINITY, -INFINITY };
        const double good[] = { 0, 0.5, 0.95, 1 };
        const struct policy_param text[] = { TEXT("ema_gamma", "high") };
        struct policy_setup s = setup_default();
        (void)state;

        for (size_t i = 0; i < N_OF(bad); i++) {
                const struct policy_param p[] = { NUM("ema_gamma", bad[i]) };
                EXPECT_POLICY_ERROR("window", p, 1, -EINVAL, "ema_gamma");
                EXPECT_POLICY_ERROR("full", p, 1, -EINVAL, "in [0, 1]");
        }
        EXPECT_POLICY_ERROR("window", text, 1, -EINVAL, "ema_gamma must be a number");

        for (size_t i = 0; i < N_OF(good); i++) {
                const struct policy_param p[] = { NUM("ema_gamma", good[i]) };
                struct policy *pol = policy_make("window", &s, p, 1);
                assert_true(pol->ema_gamma == (float)good[i]);
                policy_free(pol);
        }
        /* the default; and full, which takes no parameter of its own, takes the common ones */
        struct policy *pol = policy_make("full", &s, NULL, 0);
        assert_true(pol->ema_gamma == 0.9f);
        assert_ptr_equal(pol->ops, &policy_full_ops);
        assert_int_equal(pol->setup.max_tokens, 4096);
        assert_null(policy_free(pol));
        assert_null(policy_free(NULL));
}

static void policy_new_reads_the_confidence_weights(void **state) {
        const struct policy_param w[] = { NUM("w_entropy", 1), NUM("w_margin", 0), NUM("w_top1", 0.25) };
        struct policy_setup s = setup_default();
        (void)state;
        struct policy *p = policy_make("conf", &s, w, N_OF(w));
        assert_true(p->conf_weights[0] == 1.0f && p->conf_weights[1] == 0.0f && p->conf_weights[2] == 0.25f);
        policy_free(p);
        p = policy_make("full", &s, NULL, 0);
        assert_memory_equal(p->conf_weights, policy_default_conf_weights, sizeof(p->conf_weights));
        policy_free(p);
        const struct policy_param bad[] = { NUM("w_top1", 1.5) };
        EXPECT_POLICY_ERROR("prob", bad, 1, -EINVAL, "w_top1");
}

static void policy_param_number_finds_numbers_only(void **state) {
        const struct policy_param p[] = { NUM("a", 1.5), TEXT("b", "x"), NUM("a", 2.5) };
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

/* Each row: a policy, one bad parameter, and a word the reason must contain. */
static void every_policy_refuses_unknown_keys_wrong_kinds_and_out_of_range_values(void **state) {
        static const struct {
                const char *policy;
                struct policy_param param;
                const char *word;
        } rows[] = {
                { "full", NUM("slack", 4), "unknown parameter 'slack'" },
                { "window", NUM("sinks", 4), "unknown parameter 'sinks'" },
                { "window", TEXT("slack", "big"), "slack must be a number" },
                { "window", NUM("slack", 0), "slack must be a number in [1," },
                { "window", NUM("slack", 1.5), "slack must be a whole number" },
                { "streaming", NUM("budget", 4), "unknown parameter 'budget'" },
                { "streaming", TEXT("sinks", "four"), "sinks must be a number" },
                { "streaming", NUM("sinks", -1), "sinks must be a number in [0," },
                { "streaming", NUM("sinks", NAN), "sinks must be a number" },
                { "h2o", NUM("heavy", 4), "unknown parameter 'heavy'" },
                { "h2o", NUM("recent_frac", 1.5), "recent_frac must be a number in [0, 1]" },
                { "h2o", NUM("scorer", 1), "scorer takes a word" },
                { "h2o", TEXT("scorer", "max"), "'max' is not one of its words" },
                { "h2o", NUM("per_head", 2), "per_head must be a number in [0, 1]" },
                { "tova", TEXT("slack", "1"), "slack must be a number" },
                { "tova", NUM("recent", 1e9), "recent must be a number in [0," },
                { "pyramid", NUM("beta", 1), "beta must be a number" },
                { "pyramid", TEXT("beta", "20"), "beta must be a number" },
                { "snapkv", NUM("window_size", 8), "unknown parameter 'window_size'" },
                { "snapkv", NUM("kernel", 0), "kernel must be a number in [1, 255]" },
                { "snapkv", NUM("kernel", 256), "kernel must be a number in [1, 255]" },
                { "snapkv", TEXT("pool", "maxpool"), "'maxpool' is not one of its words" },
                { "snapkv", NUM("pool", 0), "pool takes a word" },
                { "snapkv", TEXT("window", "eight"), "window must be a number" },
                { "conf", NUM("alpha", 1), "unknown parameter 'alpha'" },
                { "conf", NUM("tau", 1.5), "tau must be a number in [0, 1]" },
                { "conf", NUM("tau", -0.1), "tau must be a number in [0, 1]" },
                { "conf", TEXT("gate", "sometimes"), "'sometimes' is not one of its words" },
                { "conf", NUM("gate", 2), "gate takes a word" },
                { "conf", NUM("lambda", 0), "lambda must be a number" },
                { "conf", NUM("w_att", -1), "w_att must be a number" },
                { "conf", TEXT("n_high", "64"), "n_high must be a number" },
                { "conf", NUM("n_low", 0), "n_low must be a number in [1," },
                { "conf", TEXT("correction", "ht"), "'ht' is not one of its words" },
                { "conf-l", NUM("fp_window", -4), "fp_window must be a number" },
                { "conf-l", NUM("int8", 0.5e1), "int8 must be a number in [0, 1]" },
                { "scope", NUM("beta1", 8), "unknown parameter 'beta1'" },
                { "scope", TEXT("strategy", "greedy"), "'greedy' is not one of its words" },
                { "scope", NUM("strategy", 0), "strategy takes a word" },
                { "scope", NUM("delta", 0), "delta must be a number in [1," },
                { "scope", TEXT("prefill", "pyramid"), "'pyramid' is not one of its words" },
                { "scope", NUM("prefill_budget", 0), "prefill_budget must be a number in [1," },
                { "scope", TEXT("alpha2", "8"), "alpha2 must be a number" },
                { "prob", NUM("temp", 1), "unknown parameter 'temp'" },
                { "prob", NUM("temperature", -0.5), "temperature must be a number in [0," },
                { "prob", NUM("temperature", INFINITY), "temperature must be a number" },
                { "prob", TEXT("temperature", "hot"), "temperature must be a number" },
                { "prob", NUM("seed", -1), "seed must be a number in [0," },
                { "prob", NUM("seed", 4294967296.0), "seed must be a number in [0," },
                { "prob", NUM("seed", 0.5), "seed must be a whole number" },
                { "prob", TEXT("correction", "bias"), "'bias' is not one of its words" },
                { "prob", TEXT("scorer", "h2o"), "'h2o' is not one of its words" },
        };
        (void)state;
        for (size_t i = 0; i < N_OF(rows); i++) {
                struct policy_setup s = setup_default();
                s.prompt_tokens = 100;
                expect_policy_error_in(s, rows[i].policy, &rows[i].param, 1, -EINVAL, rows[i].word, (int)i);
        }
}

static void every_policy_refuses_inconsistent_combinations(void **state) {
        static const struct {
                const char *policy;
                uint32_t budget;
                struct policy_param params[3];
                size_t n;
                const char *word;
        } rows[] = {
                { "streaming", 32, { NUM("sinks", 32) }, 1, "32 sinks leave no room in a budget of 32" },
                { "h2o",
                  32,
                  { NUM("sinks", 4), NUM("recent", 29) },
                  2,
                  "sinks + recent (33) exceed the budget" },
                { "tova", 16, { NUM("recent", 17) }, 1, "exceed the budget 16" },
                { "pyramid-taper", 16, { NUM("sinks", 17) }, 1, "exceed the budget" },
                { "snapkv", 8, { NUM("window", 8) }, 1, "window 8 leaves no room in a budget of 8" },
                { "snapkv", 64, { NUM("window", 100) }, 1, "leaves no room" },
                { "scope", 64, { NUM("beta2", 64) }, 1, "need beta2 < budget" },
                { "scope",
                  64,
                  { NUM("alpha2", 33), NUM("prefill_budget", 32) },
                  2,
                  "alpha2 <= prefill_budget" },
                { "conf",
                  100,
                  { NUM("sinks", 30), NUM("protect", 20), TEXT("gate", "naive") },
                  3,
                  "sinks + protect (50) < n_high (50)" },
                { "conf",
                  100,
                  { NUM("sinks", 60), NUM("protect", 40) },
                  2,
                  "sinks + protect (100) < the budget (100)" },
                { "conf", 100, { NUM("n_high", 200) }, 1, "n_high (200) <= n_low (150)" },
                { "conf", 100, { NUM("correction", 0), NUM("sinks", 0) }, 2, "takes a word" },
                { "conf", 100, { TEXT("correction", "sink"), NUM("sinks", 0) }, 2, "correction=sink needs" },
                { "conf", 100, { NUM("n_low", 60) }, 1, "budget (100) <= n_low (60)" },
                { "conf",
                  100,
                  { TEXT("correction", "moment"), NUM("per_head", 1) },
                  2,
                  "correction=moment needs per-layer plans" },
                { "conf",
                  100,
                  { TEXT("correction", "moment"), NUM("int8", 1) },
                  2,
                  "correction=moment needs" },
                { "conf-l", 8, { NUM("protect", 4) }, 1, "< the budget (8)" },
                { "prob",
                  20,
                  { NUM("sinks", 4), NUM("protect", 16) },
                  2,
                  "sinks + protect (20) leave no room" },
                { "prob", 64, { TEXT("correction", "sink"), NUM("sinks", 0) }, 2, "correction=sink needs" },
        };
        (void)state;
        for (size_t i = 0; i < N_OF(rows); i++) {
                struct policy_setup s = setup_default();
                s.budget_tokens = rows[i].budget;
                s.prompt_tokens = 100;
                expect_policy_error_in(s, rows[i].policy, rows[i].params, rows[i].n, -EINVAL, rows[i].word,
                                       (int)i);
        }
}

/* ---- full, window, streaming ---- */

static void full_keeps_everything_and_never_plans(void **state) {
        struct policy_setup s = setup_default();
        struct policy *p = policy_make("full", &s, NULL, 0);
        struct policy_target t[5];
        (void)state;

        struct policy_limits lim = limits_of(p);
        assert_int_equal(lim.budget, 4096);
        assert_int_equal(lim.max_layer_tokens, 4096);
        assert_int_equal(lim.max_keep, 0);
        assert_false(lim.per_head);
        assert_false(lim.lower);
        assert_null(p->ops->observes);
        const uint32_t lens[][4] = { { 0, 0, 0, 0 }, { 272, 273, 4096, 4096 }, { UINT32_MAX, 1, 2, 3 } };
        for (size_t i = 0; i < 3; i++) {
                struct policy_step st = step_of(i + 1, lens[i], 0.15f);
                decide_into(p, &st, t);
                for (int l = 0; l < 4; l++)
                        assert_int_equal(t[l].keep, POLICY_NO_PLAN);
        }
        struct arrays a = arrays_new(2, 4);
        struct policy_layer L = view_of(&a, 0);
        uint32_t keep[1];
        float delta[1];
        uint32_t scratch[32];
        struct policy_target one = { .keep = 1 };
        assert_int_equal(p->ops->select(p->state, NULL, &L, &one, keep, delta, scratch), -EINVAL);
        arrays_free(&a);
        policy_free(p);
}

static void window_states_its_limits(void **state) {
        const struct {
                uint32_t budget, max_tokens, want_budget;
        } rows[] = {
                { 256, 4096, 256 },    { 0, 4096, 256 }, /* the default */
                { 0, 100, 100 },                         /* the default, clamped to the context */
                { 10000, 4096, 4096 }, { 1, 4096, 1 },
        };
        (void)state;
        for (size_t i = 0; i < N_OF(rows); i++) {
                struct policy_setup s = setup_default();
                s.budget_tokens = rows[i].budget;
                s.max_tokens = rows[i].max_tokens;
                struct policy *p = policy_make("window", &s, NULL, 0);
                struct policy_limits lim = limits_of(p);
                assert_int_equal(lim.budget, rows[i].want_budget);
                assert_int_equal(lim.max_layer_tokens, rows[i].want_budget + s.block_tokens);
                assert_int_equal(lim.max_keep, rows[i].want_budget);
                assert_false(lim.per_head);
                assert_false(lim.lower);
                policy_free(p);
        }
}

/* A plan is due for exactly the layers that reached budget + slack (one block by default). */
static void window_plans_only_at_budget_plus_slack(void **state) {
        struct policy_setup s = setup_default();
        struct policy *p = policy_make("window", &s, NULL, 0);
        struct policy_target t[5];
        (void)state;

        const uint32_t lens[] = { 271, 272, 300, 0 };
        struct policy_step st = step_of(9, lens, 0.5f);
        decide_into(p, &st, t);
        assert_int_equal(t[0].keep, POLICY_NO_PLAN);
        assert_int_equal(t[1].keep, 256);
        assert_int_equal(t[2].keep, 256);
        assert_int_equal(t[3].keep, POLICY_NO_PLAN);
        assert_int_equal(t[1].low, 0);

        /* decoding one token at a time from the budget: one plan per block of tokens */
        uint32_t plans = 0;
        for (uint32_t step = 0, n = 256; step < 160; step++) {
                uint32_t k = keep_at(p, step, n, 0.5f);
                if (k != POLICY_NO_PLAN) {
                        assert_int_equal(n, 272);
                        assert_int_equal(k, 256);
                        plans++;
                        n = k;
                }
                n++;
        }
        assert_int_equal(plans, 9); /* at steps 16, 32, ..., 144 */
        policy_free(p);

        /* slack=1: one token over the budget is enough */
        const struct policy_param slack[] = { NUM("slack", 1) };
        p = policy_make("window", &s, slack, 1);
        assert_int_equal(keep_at(p, 1, 256, 0.5f), POLICY_NO_PLAN);
        assert_int_equal(keep_at(p, 2, 257, 0.5f), 256);
        assert_int_equal(limits_of(p).max_layer_tokens, 257);
        policy_free(p);
}

/* The keep-set is the slots of the `budget` largest original positions, ascending. */
static void window_keeps_the_most_recent_positions(void **state) {
        struct policy_setup s = setup_default();
        struct policy *p = policy_make("window", &s, NULL, 0);
        (void)state;
        rng_state = 0x3d;
        for (int iter = 0; iter < 20; iter++) {
                uint32_t n = 272 + rng_below(200), H = s.n_kv_heads, target = 256;
                struct arrays a = arrays_new(H, n);
                /* positions: gaps from earlier evictions, then shuffled (as after per-head moves) */
                for (uint32_t i = 0, v = 5; i < n; i++, v += 1 + rng_below(3))
                        a.pos[i] = (int32_t)v;
                for (uint32_t i = n; i > 1; i--) {
                        uint32_t j = rng_below(i);
                        int32_t x = a.pos[i - 1];
                        a.pos[i - 1] = a.pos[j];
                        a.pos[j] = x;
                }
                for (uint32_t i = 0; i < n; i++)
                        a.pos[n + i] = a.pos[i]; /* head 1 holds the same tokens */
                struct policy_layer L = view_of(&a, 2);
                struct selection sel = select_layer(p, NULL, &L, (struct policy_target){ .keep = target });
                assert_int_equal(sel.r, 0);

                int32_t *sorted = malloc(n * sizeof(*sorted));
                assert_non_null(sorted);
                memcpy(sorted, a.pos, n * sizeof(*sorted));
                qsort(sorted, n, sizeof(*sorted), cmp_i32);
                int32_t threshold = sorted[n - target];
                for (uint32_t i = 0; i < target; i++)
                        assert_true(a.pos[sel.keep[i]] >= threshold);
                free(sorted);
                selection_free(&sel);
                arrays_free(&a);
        }
        policy_free(p);
}

/* A policy that declares the side arrays it reads (policy_ops.reads) selects the same keep-set from
 * a view that has only those (kvcd then copies only those out of the pool: the others are NULL), in
 * order and shuffled. */
static void policies_read_only_the_arrays_they_declare(void **state) {
        struct policy_setup s = setup_default();
        (void)state;
        rng_state = 0x3e;
        for (const char *const *name = policy_names(); *name; name++) {
                struct policy *p = NULL;
                char why[160];
                if (policy_new(*name, &s, NULL, 0, &p, why, sizeof(why)) < 0)
                        continue;
                if (!p->ops->reads || p->ops->reads == POLICY_READS_ALL || !p->ops->select) {
                        policy_free(p); /* the ladder's select_tiers: test_ladder_policy */
                        continue;
                }
                for (int shuffled = 0; shuffled < 2; shuffled++) {
                        uint32_t n = 300, H = s.n_kv_heads;
                        struct arrays a = arrays_new(H, n);
                        for (uint32_t i = 0; shuffled && i < n; i++) {
                                uint32_t j = rng_below(n);
                                int32_t x = a.pos[i];
                                a.pos[i] = a.pos[j];
                                a.pos[j] = x;
                        }
                        for (size_t i = 0; i < (size_t)H * n; i++)
                                a.sum[i] = a.ema[i] = a.last[i] = (float)rng_below(1000);
                        struct policy_layer full = view_of(&a, 1), part = full;
                        uint32_t r = p->ops->reads;
                        part.pos = r & POLICY_READS_POS ? part.pos : NULL;
                        part.sum = r & POLICY_READS_SUM ? part.sum : NULL;
                        part.ema = r & POLICY_READS_EMA ? part.ema : NULL;
                        part.last = r & POLICY_READS_LAST ? part.last : NULL;
                        part.logw = r & POLICY_READS_LOGW ? part.logw : NULL;
                        struct policy_target t = { .keep = 200 };
                        struct selection x = select_layer(p, NULL, &full, t), y = select_layer(p, NULL, &part, t);
                        assert_int_equal(x.r, y.r);
                        assert_memory_equal(x.keep, y.keep, (size_t)x.sets * x.k * sizeof(uint32_t));
                        selection_free(&x);
                        selection_free(&y);
                        arrays_free(&a);
                }
                policy_free(p);
        }
}

/* B = 32, a block of 16: the plan at 48 tokens keeps the 4 sinks and the 28 newest. */
static void streaming_keeps_its_sinks_and_the_newest_tokens(void **state) {
        struct policy_setup s = setup_of(2, 2, 4096, 16, 32, 0);
        struct policy *p = policy_make("streaming", &s, NULL, 0);
        (void)state;

        struct policy_limits lim = limits_of(p);
        assert_int_equal(lim.budget, 32);
        assert_int_equal(lim.max_layer_tokens, 48);
        assert_int_equal(lim.max_keep, 32);
        assert_false(lim.per_head);
        assert_int_equal(keep_at(p, 47, 47, 0.5f), POLICY_NO_PLAN);
        assert_int_equal(keep_at(p, 48, 48, 0.5f), 32);

        struct arrays a = arrays_new(2, 48);
        for (uint32_t i = 0; i < 96; i++) /* scores do not matter */
                a.sum[i] = a.ema[i] = a.last[i] = (float)(i % 7);
        struct policy_layer L = view_of(&a, 1);
        struct selection sel = select_layer(p, NULL, &L, (struct policy_target){ .keep = 32 });
        assert_int_equal(sel.r, 0);
        EXPECT_SLOTS(sel, 0, "0-3,20-47");
        selection_free(&sel);
        policy_free(p);

        const struct policy_param one_sink[] = { NUM("sinks", 1) };
        p = policy_make("streaming", &s, one_sink, 1);
        sel = select_layer(p, NULL, &L, (struct policy_target){ .keep = 32 });
        EXPECT_SLOTS(sel, 0, "0,17-47");
        selection_free(&sel);
        policy_free(p);
        arrays_free(&a);
}

/* ---- h2o, tova, pyramid ---- */

/* B = 32: recent = 16 newest, heavy = 16 by accumulated attention, per KV head. The sums rise
 * with the slot, so without the planted hitters [16, 32) would win; each head's hitter (slot 5 in
 * head 0, slot 9 in head 1) displaces slot 16 of that head only. */
static void h2o_keeps_each_heads_heavy_hitter_and_the_recent_half(void **state) {
        struct policy_setup s = setup_of(1, 2, 4096, 16, 32, 0);
        struct policy *p = policy_make("h2o", &s, NULL, 0);
        (void)state;

        struct policy_limits lim = limits_of(p);
        assert_true(lim.per_head);
        assert_int_equal(lim.max_keep, 32);
        assert_int_equal(lim.max_layer_tokens, 48);
        assert_int_equal(keep_at(p, 48, 48, 0.5f), 32);

        struct arrays a = arrays_new(2, 48);
        for (uint32_t h = 0; h < 2; h++)
                for (uint32_t i = 0; i < 48; i++)
                        a.sum[h * 48 + i] = i < 32 ? (float)i : 0.0f; /* the recent ones have no mass */
        a.sum[0 * 48 + 5] = 1000;
        a.sum[1 * 48 + 9] = 1000;
        a.ema[0 * 48 + 1] = a.last[0 * 48 + 1] = 1e9f; /* other scores do not count */
        struct policy_layer L = view_of(&a, 0);
        struct selection sel = select_layer(p, NULL, &L, (struct policy_target){ .keep = 32 });
        assert_int_equal(sel.r, 0);
        assert_int_equal(sel.sets, 2);
        EXPECT_SLOTS(sel, 0, "5,17-47");
        EXPECT_SLOTS(sel, 1, "9,17-47");
        selection_free(&sel);
        policy_free(p);

        /* per_head=0: one set from the mean over heads; recent=4, sinks=2 */
        const struct policy_param pl[] = { NUM("per_head", 0), NUM("recent", 4), NUM("sinks", 2) };
        p = policy_make("h2o", &s, pl, N_OF(pl));
        assert_false(limits_of(p).per_head);
        sel = select_layer(p, NULL, &L, (struct policy_target){ .keep = 32 });
        assert_int_equal(sel.sets, 1);
        EXPECT_SLOTS(sel, 0, "0,1,5,7-31,44-47"); /* 5 and 9 by their means, then 31 down to 7 */
        selection_free(&sel);
        policy_free(p);
        arrays_free(&a);
}

/* B = 4 of 8 slots by the current query's attention averaged over the two heads (no recent, no
 * sinks): means 0.45, 0.45, 0.1, 0.35, 0.3, 0.1, 0.1, 0.15. Head 0 alone would keep 0, 4, 6, 7. */
static void tova_keeps_the_top_by_last_attention_averaged_over_heads(void **state) {
        struct policy_setup s = setup_of(1, 2, 4096, 16, 4, 0);
        struct policy *p = policy_make("tova", &s, NULL, 0);
        const float head0[] = { 0.9f, 0.1f, 0.1f, 0.1f, 0.5f, 0.1f, 0.1f, 0.1f };
        const float head1[] = { 0.0f, 0.8f, 0.1f, 0.6f, 0.1f, 0.1f, 0.1f, 0.2f };
        (void)state;

        struct policy_limits lim = limits_of(p);
        assert_false(lim.per_head);
        assert_int_equal(lim.max_keep, 4);
        struct arrays a = arrays_new(2, 8);
        memcpy(a.last, head0, sizeof(head0));
        memcpy(a.last + 8, head1, sizeof(head1));
        for (uint32_t i = 0; i < 16; i++)
                a.sum[i] = a.ema[i] = (float)(16 - i); /* not tova's score */
        struct policy_layer L = view_of(&a, 0);
        struct selection sel = select_layer(p, NULL, &L, (struct policy_target){ .keep = 4 });
        assert_int_equal(sel.r, 0);
        EXPECT_SLOTS(sel, 0, "0,1,3,4");
        selection_free(&sel);
        policy_free(p);
        arrays_free(&a);
}

/* The reference drops one token per step once the cache is full: slack=1. */
static void tova_with_slack_one_drops_one_token_per_step(void **state) {
        struct policy_setup s = setup_of(3, 1, 4096, 16, 64, 0);
        const struct policy_param slack[] = { NUM("slack", 1) };
        struct policy *p = policy_make("tova", &s, slack, 1);
        (void)state;
        assert_int_equal(limits_of(p).max_layer_tokens, 65);
        for (uint32_t n = 1; n <= 64; n++)
                assert_int_equal(keep_at(p, n, n, 0.5f), POLICY_NO_PLAN);
        for (uint32_t step = 65; step < 100; step++)
                assert_int_equal(keep_at(p, step, 65, 0.5f), 64);
        policy_free(p);
}

/* pyramid-taper (the schedule at decode time): B = 64 over 5 layers, beta 20: budgets 125, 94, 64,
 * 34, 3, each planned at its budget + slack. */
static void pyramid_taper_budgets_follow_the_schedule_per_layer(void **state) {
        struct policy_setup s = setup_of(5, 2, 4096, 16, 64, 0);
        struct policy *p = policy_make("pyramid-taper", &s, NULL, 0);
        const uint32_t want[] = { 125, 94, 64, 34, 3 };
        struct policy_target t[6];
        (void)state;

        struct policy_limits lim = limits_of(p);
        assert_int_equal(lim.budget, 64);
        assert_int_equal(lim.max_keep, 125);
        assert_int_equal(lim.max_layer_tokens, 141);
        assert_true(lim.per_head);

        const uint32_t due[] = { 141, 110, 80, 50, 19 };
        struct policy_step st = step_of(200, due, 0.5f);
        decide_into(p, &st, t);
        for (uint32_t l = 0; l < 5; l++)
                assert_int_equal(t[l].keep, want[l]);
        const uint32_t early[] = { 140, 109, 79, 49, 18 };
        st = step_of(201, early, 0.5f);
        decide_into(p, &st, t);
        for (uint32_t l = 0; l < 5; l++)
                assert_int_equal(t[l].keep, POLICY_NO_PLAN);
        const uint32_t mixed[] = { 141, 109, 80, 49, 19 };
        st = step_of(202, mixed, 0.5f);
        decide_into(p, &st, t);
        assert_int_equal(t[0].keep, 125);
        assert_int_equal(t[1].keep, POLICY_NO_PLAN);
        assert_int_equal(t[2].keep, 64);
        assert_int_equal(t[3].keep, POLICY_NO_PLAN);
        assert_int_equal(t[4].keep, 3);

        /* the last layer's 3: the newest one (recent_frac 0.5 of 3) and the two heaviest */
        struct arrays a = arrays_new(2, 19);
        for (uint32_t i = 0; i < 38; i++)
                a.sum[i] = 1.0f;
        a.sum[7] = 5;
        a.sum[2] = 4;
        a.sum[19 + 11] = 6;
        a.sum[19 + 12] = 6;
        struct policy_layer L = view_of(&a, 4);
        struct selection sel = select_layer(p, &st, &L, (struct policy_target){ .keep = 3 });
        EXPECT_SLOTS(sel, 0, "2,7,18");
        EXPECT_SLOTS(sel, 1, "11,12,18");
        selection_free(&sel);
        arrays_free(&a);
        policy_free(p);

        /* beta is a parameter: beta 4 gives min 16, max 112, step 24 */
        const struct policy_param b4[] = { NUM("beta", 4) };
        p = policy_make("pyramid-taper", &s, b4, 1);
        const uint32_t want4[] = { 112, 88, 64, 40, 16 };
        const uint32_t big[] = { 500, 500, 500, 500, 500 };
        st = step_of(500, big, 0.5f);
        decide_into(p, &st, t);
        for (uint32_t l = 0; l < 5; l++)
                assert_int_equal(t[l].keep, want4[l]);
        policy_free(p);
}
/* ---- snapkv and scope: the prompt ---- */

/* The attention the query of step `appended` (the layer then holds `appended` slots) pays slot. */
typedef float (*attention_fn)(uint32_t appended, uint32_t head, uint32_t slot);

/* Feeds a prompt of M tokens one per step to every layer, as kvc-run does: observe() whenever the
 * policy asks, decide() from step first_decide on (kvcd skips decide while a plan is pending). No
 * plan may come before the prompt is complete. Returns a bitmask of the observed steps (bit a for
 * step a, a < 64); t holds the last decide's targets. */
static uint64_t feed_prompt(struct policy *p, uint32_t M, uint32_t first_decide, attention_fn attn,
                            struct policy_target *t) {
        uint32_t L = p->setup.n_layers, H = p->setup.n_kv_heads, lens[8];
        uint64_t observed = 0;
        assert_true(L <= 8 && M < 64);
        for (uint32_t a = 1; a <= M; a++) {
                for (uint32_t l = 0; l < L; l++)
                        lens[l] = a;
                struct policy_step st = step_of(a, lens, 0.5f);
                st.prefill = true;
                if (p->ops->observes && p->ops->observes(p->state, &st)) {
                        observed |= 1ull << a;
                        struct arrays arr = arrays_new(H, a);
                        for (uint32_t h = 0; h < H; h++)
                                for (uint32_t i = 0; i < a; i++)
                                        arr.last[(size_t)h * a + i] = attn(a, h, i);
                        uint32_t *scratch = malloc(4 * (size_t)H * a * sizeof(uint32_t));
                        assert_non_null(scratch);
                        for (uint32_t l = 0; l < L; l++) {
                                struct policy_layer view = view_of(&arr, l);
                                p->ops->observe(p->state, &st, &view, scratch);
                        }
                        free(scratch);
                        arrays_free(&arr);
                }
                if (a < first_decide)
                        continue;
                decide_into(p, &st, t);
                for (uint32_t l = 0; a < M && l < L; l++)
                        if (t[l].keep != POLICY_NO_PLAN)
                                fail_msg("%s planned layer %u at prompt step %u of %u", p->ops->name, l, a,
                                         M);
        }
        return observed;
}

static uint64_t steps_between(uint32_t first, uint32_t last) {
        uint64_t m = 0;
        for (uint32_t a = first; a <= last; a++)
                m |= 1ull << a;
        return m;
}

/* Observed steps 37..40 of a 40-token prompt (window 4): head 0 pays slot 10 a single spike (4 in
 * all) and slots 25, 26 a double one (3 each); head 1 slot 5, and 15, 16. The steps outside the
 * window pay slot 30 heavily: observing them would show. */
static float snapkv_attention(uint32_t appended, uint32_t head, uint32_t slot) {
        uint32_t single = head ? 5 : 10, pair = head ? 15 : 25;
        if (appended < 37)
                return slot == 30 ? 100.0f : 0.0f;
        if (slot >= 36)
                return 50.0f; /* the window itself: kept, never ranked */
        if (slot == single)
                return 1.0f;
        return slot == pair || slot == pair + 1 ? 0.75f : 0.0f;
}

static void snapkv_observes_exactly_the_last_window_prompt_steps(void **state) {
        struct policy_setup s = setup_of(2, 2, 128, 16, 7, 40);
        const struct policy_param params[] = { NUM("window", 4), NUM("kernel", 3) };
        struct policy *p = policy_make("snapkv", &s, params, N_OF(params));
        struct policy_target t[3];
        uint32_t lens[2] = { 0, 0 };
        (void)state;

        for (uint32_t a = 0; a < 100; a++) {
                struct policy_step st = step_of(a, lens, 0.5f);
                assert_int_equal(p->ops->observes(p->state, &st), a >= 37 && a <= 40);
        }
        uint64_t observed = feed_prompt(p, 40, 1, snapkv_attention, t);
        assert_true(observed == steps_between(37, 40));
        /* planned: nothing is observed again */
        for (uint32_t a = 0; a < 100; a++) {
                struct policy_step st = step_of(a, lens, 0.5f);
                assert_false(p->ops->observes(p->state, &st));
        }
        policy_free(p);
}

/* Budget 7 = window 4 + the top 3 pooled slots [0, 36). Max pooling (kernel 3) spreads head 0's
 * single spike over 9, 10, 11 (4 each) above the pair's 24..27 (3): {9, 10, 11}. Average pooling
 * gives the pair 25, 26 two thirds of 6 = 2 against the single's 4/3 (9, 10, 11 tie; ties go to
 * the newest): {11, 25, 26}. */
static void snapkv_keeps_the_window_and_the_pooled_spikes(void **state) {
        const struct {
                const char *pool;
                const char *want[2];
        } rows[] = {
                { "max", { "9-11,36-39", "4-6,36-39" } },
                { "avg", { "11,25,26,36-39", "6,15,16,36-39" } },
        };
        (void)state;
        for (size_t i = 0; i < N_OF(rows); i++) {
                struct policy_setup s = setup_of(2, 2, 128, 16, 7, 40);
                const struct policy_param params[] = { NUM("window", 4), NUM("kernel", 3),
                                                       TEXT("pool", rows[i].pool) };
                struct policy *p = policy_make("snapkv", &s, params, N_OF(params));
                struct policy_target t[3];
                struct policy_limits lim = limits_of(p);
                assert_int_equal(lim.budget, 7);
                assert_int_equal(lim.max_keep, 7);
                assert_int_equal(lim.max_layer_tokens, 128); /* decoding is not compressed */
                assert_true(lim.per_head);

                feed_prompt(p, 40, 1, snapkv_attention, t);
                assert_int_equal(t[0].keep, 7);
                assert_int_equal(t[1].keep, 7);
                struct arrays a = arrays_new(2, 40);
                for (uint32_t j = 0; j < 80; j++) /* the arrays' own scores play no part */
                        a.sum[j] = a.ema[j] = a.last[j] = (float)j;
                uint32_t lens[] = { 40, 40 };
                struct policy_step st = step_of(40, lens, 0.5f);
                for (uint32_t l = 0; l < 2; l++) {
                        struct policy_layer L = view_of(&a, l);
                        struct selection sel = select_layer(p, &st, &L, t[l]);
                        assert_int_equal(sel.r, 0);
                        EXPECT_SLOTS(sel, 0, rows[i].want[0]);
                        EXPECT_SLOTS(sel, 1, rows[i].want[1]);
                        selection_free(&sel);
                }
                arrays_free(&a);
                policy_free(p);
        }
}

/* Once the prompt is in, one plan; decoding then grows the cache untouched. */
static void snapkv_plans_once_when_the_prompt_is_complete(void **state) {
        struct policy_setup s = setup_of(2, 2, 128, 16, 7, 40);
        const struct policy_param params[] = { NUM("window", 4) };
        struct policy *p = policy_make("snapkv", &s, params, N_OF(params));
        struct policy_target t[3];
        (void)state;

        feed_prompt(p, 40, 1, snapkv_attention, t);
        assert_int_equal(t[0].keep, 7);
        for (uint32_t a = 41; a <= 128; a++) {
                assert_int_equal(keep_at(p, a, 7 + a - 40, 0.5f), POLICY_NO_PLAN);
                assert_int_equal(keep_at(p, a, 128, 0.1f), POLICY_NO_PLAN);
        }
        policy_free(p);

        /* a prompt no longer than the budget is kept whole: no plan */
        s = setup_of(1, 1, 128, 16, 48, 40);
        p = policy_make("snapkv", &s, NULL, 0);
        feed_prompt(p, 40, 1, snapkv_attention, t);
        assert_int_equal(t[0].keep, POLICY_NO_PLAN);
        assert_int_equal(keep_at(p, 41, 41, 0.5f), POLICY_NO_PLAN);
        policy_free(p);
}

/* A plan that comes two tokens late (decide first runs at step 42) keeps those two as well:
 * budget 10 = window 4 + 2 followers + the top 4 (head 0: 9, 10, 11, then 27 of the 3s). */
static void snapkv_keeps_what_followed_a_late_prompt_plan(void **state) {
        struct policy_setup s = setup_of(1, 2, 128, 16, 10, 40);
        const struct policy_param params[] = { NUM("window", 4), NUM("kernel", 3) };
        struct policy *p = policy_make("snapkv", &s, params, N_OF(params));
        struct policy_target t[2];
        uint32_t lens[] = { 42 };
        (void)state;

        assert_true(feed_prompt(p, 40, 41, snapkv_attention, t) == steps_between(37, 40));
        struct policy_step st = step_of(42, lens, 0.5f);
        decide_into(p, &st, t);
        assert_int_equal(t[0].keep, 10);
        struct arrays a = arrays_new(2, 42);
        struct policy_layer L = view_of(&a, 0);
        struct selection sel = select_layer(p, &st, &L, t[0]);
        assert_int_equal(sel.r, 0);
        EXPECT_SLOTS(sel, 0, "9-11,27,36-41");
        EXPECT_SLOTS(sel, 1, "4-6,17,36-41");
        selection_free(&sel);
        arrays_free(&a);
        policy_free(p);
}

static void snapkv_without_a_prompt_length_never_plans(void **state) {
        struct policy_setup s = setup_of(2, 2, 128, 16, 16, 0);
        struct policy *p = policy_make("snapkv", &s, NULL, 0);
        uint32_t lens[] = { 0, 0 };
        (void)state;
        for (uint32_t a = 1; a <= 128; a++) {
                lens[0] = lens[1] = a;
                struct policy_step st = step_of(a, lens, 0.5f);
                assert_false(p->ops->observes(p->state, &st));
                assert_int_equal(keep_at(p, a, a, 0.5f), POLICY_NO_PLAN);
        }
        policy_free(p);
}

/* pyramid=1: PyramidKV spreads B - window over the layers and keeps the window on each. B 64,
 * window 8, 5 layers, beta 20: 56 -> 109, 83, 56, 29, 3 (min 2.8, max 109.2), plus 8 each. */
static void snapkv_pyramid_spreads_the_selected_part_and_keeps_every_window(void **state) {
        struct policy_setup s = setup_of(5, 1, 4096, 16, 64, 200);
        const struct policy_param pyr[] = { NUM("pyramid", 1) };
        struct policy *p = policy_make("snapkv", &s, pyr, 1);
        const uint32_t want[] = { 117, 91, 64, 37, 11 }, lens[] = { 200, 200, 200, 200, 200 };
        struct policy_target t[6];
        (void)state;

        struct policy_limits lim = limits_of(p);
        assert_int_equal(lim.budget, 64);
        assert_int_equal(lim.max_keep, 117);
        struct policy_step st = step_of(200, lens, 0.5f);
        decide_into(p, &st, t);
        for (uint32_t l = 0; l < 5; l++)
                assert_int_equal(t[l].keep, want[l]);
        struct arrays a = arrays_new(1, 200);
        struct policy_layer L = view_of(&a, 4);
        struct selection sel = select_layer(p, &st, &L, t[4]);
        assert_int_equal(sel.r, 0);
        EXPECT_SLOTS(sel, 0, "189-199"); /* nothing observed: ties go to the newest of [0, 192) */
        selection_free(&sel);
        arrays_free(&a);
        policy_free(p);
}

/* `pyramid` is PyramidKV as published: exactly snapkv pyramid=1 (prompt compression, the window
 * kept in every layer: no layer below it), decoding not compressed; the decode-time schedule is
 * pyramid-taper, and `pyramid` takes no `pyramid` key (it is not optional there). */
static void pyramid_is_published_pyramidkv_with_a_window_in_every_layer(void **state) {
        struct policy_setup s = setup_of(5, 1, 4096, 16, 64, 200);
        struct policy *p = policy_make("pyramid", &s, NULL, 0);
        const uint32_t want[] = { 117, 91, 64, 37, 11 }, lens[] = { 200, 200, 200, 200, 200 };
        struct policy_target t[6];
        (void)state;

        struct policy_limits lim = limits_of(p);
        assert_int_equal(lim.budget, 64);
        assert_int_equal(lim.max_keep, 117);
        assert_int_equal(lim.max_layer_tokens, 4096); /* decoding grows the cache, as in the paper */
        struct policy_step st = step_of(200, lens, 0.5f);
        decide_into(p, &st, t);
        for (uint32_t l = 0; l < 5; l++) {
                assert_int_equal(t[l].keep, want[l]);
                assert_true(t[l].keep >= 8); /* the window */
        }
        const uint32_t later[] = { 300, 300, 300, 300, 300 };
        st = step_of(300, later, 0.5f);
        decide_into(p, &st, t);
        for (uint32_t l = 0; l < 5; l++)
                assert_int_equal(t[l].keep, POLICY_NO_PLAN); /* planned once */
        policy_free(p);

        struct policy *q;
        char why[128] = "";
        const struct policy_param pyr[] = { NUM("pyramid", 0) };
        assert_int_equal(policy_new("pyramid", &s, pyr, 1, &q, why, sizeof(why)), -EINVAL);
}

/* SCOPE with a 40-token prompt: prefill_budget 12 = alpha1 8 + alpha2 4 (the observation window
 * is alpha2), kernel 1 (no pooling); decode budget 20 = beta1 12 + beta2 8; a block of 4. */
static const struct policy_param scope_base[] = { NUM("prefill_budget", 12), NUM("alpha2", 4),
                                                  NUM("beta2", 8), NUM("kernel", 1) };

static struct policy *scope_make(const char *strategy, const struct policy_param *extra, size_t n_extra) {
        struct policy_param params[8];
        size_t n = 0;
        for (size_t i = 0; i < N_OF(scope_base); i++)
                params[n++] = scope_base[i];
        if (strategy)
                params[n++] = (struct policy_param)TEXT("strategy", strategy);
        for (size_t i = 0; i < n_extra; i++)
                params[n++] = extra[i];
        struct policy_setup s = setup_of(1, 2, 256, 4, 20, 40);
        return policy_make("scope", &s, params, n);
}

/* Past the prompt's plan without observing: decode budgets do not depend on the scores. */
static struct policy *scope_past_prompt(const char *strategy, const struct policy_param *extra,
                                        size_t n_extra) {
        struct policy *p = scope_make(strategy, extra, n_extra);
        assert_int_equal(keep_at(p, 39, 39, 0.5f), POLICY_NO_PLAN);
        assert_int_equal(keep_at(p, 40, 40, 0.5f), 12);
        return p;
}

/* Eight slots per head get 1 from each observed query (4 in all), slot 33 gets 0.5: alpha1 = 8
 * takes the eight. Unobserved steps pay slot 30. */
static float scope_attention(uint32_t appended, uint32_t head, uint32_t slot) {
        static const uint32_t top[2][8] = { { 2, 5, 7, 11, 13, 17, 23, 31 },
                                            { 0, 1, 3, 20, 21, 22, 34, 35 } };
        if (appended < 37)
                return slot == 30 ? 100.0f : 0.0f;
        for (int i = 0; i < 8; i++)
                if (slot == top[head][i])
                        return 1.0f;
        return slot == 33 ? 0.5f : 0.0f;
}

static void scope_prefill_plan_keeps_alpha1_plus_alpha2(void **state) {
        struct policy *p = scope_make(NULL, NULL, 0);
        struct policy_target t[2];
        uint32_t lens[] = { 40 };
        (void)state;

        assert_true(feed_prompt(p, 40, 1, scope_attention, t) == steps_between(37, 40));
        assert_int_equal(t[0].keep, 12);
        assert_int_equal(t[0].low, 0);
        struct arrays a = arrays_new(2, 40);
        struct policy_layer L = view_of(&a, 0);
        struct policy_step st = step_of(40, lens, 0.5f);
        struct selection sel = select_layer(p, &st, &L, t[0]);
        assert_int_equal(sel.r, 0);
        EXPECT_SLOTS(sel, 0, "2,5,7,11,13,17,23,31,36-39");
        EXPECT_SLOTS(sel, 1, "0,1,3,20-22,34-39");
        selection_free(&sel);
        arrays_free(&a);
        policy_free(p);

        /* prefill=full keeps the whole prompt: no plan, and the prompt part P is the prompt */
        const struct policy_param full[] = { TEXT("prefill", "full") };
        p = scope_make(NULL, full, 1);
        assert_int_equal(keep_at(p, 40, 40, 0.5f), POLICY_NO_PLAN);
        assert_int_equal(keep_at(p, 63, 63, 0.5f), POLICY_NO_PLAN); /* d = 23 < 20 + 4 */
        assert_int_equal(keep_at(p, 64, 64, 0.5f), 60);             /* P 40 + 20 */
        policy_free(p);
}

/* The layer must hold the whole prompt before its plan: 40 tokens, more than P + budget + slack
 * (12 + 20 + 4 = 36). */
static void scope_limits_let_the_whole_prompt_in(void **state) {
        struct policy *p = scope_make(NULL, NULL, 0);
        (void)state;
        struct policy_limits lim = limits_of(p);
        assert_int_equal(lim.budget, 32);
        assert_true(lim.max_layer_tokens >= 40);
        assert_true(lim.max_keep >= 12 + 20);
        assert_true(lim.per_head);
        policy_free(p);

        /* a long prompt: the layer takes it whole, but the keep-set (the plan buffer) does not grow
         * with it: SmolLM2's 8K context, a prompt of 8,000, budgets of 1,024 */
        struct policy_setup big = setup_of(30, 3, 8192, 16, 1024, 8000);
        p = policy_make("scope", &big, NULL, 0);
        lim = limits_of(p);
        assert_true(lim.max_layer_tokens >= 8000);
        assert_true(lim.max_keep <= 2 * 1024 + 16);
        uint32_t lens[30];
        for (uint32_t l = 0; l < 30; l++)
                lens[l] = 8000;
        struct policy_target t[31];
        struct policy_step st = step_of(8000, lens, 0.5f);
        decide_into(p, &st, t);
        assert_true(t[0].keep != POLICY_NO_PLAN && t[0].keep <= lim.max_keep); /* the prompt's plan */
        policy_free(p);

        /* prefill=full: the prompt part is the prompt */
        const struct policy_param full[] = { TEXT("prefill", "full") };
        p = scope_make(NULL, full, 1);
        lim = limits_of(p);
        assert_int_equal(lim.budget, 60);
        assert_int_equal(lim.max_layer_tokens, 64);
        policy_free(p);
}

/* Decode budgets at given t (decode steps = appended - 40), with the decoded part d = 40 past
 * any trigger. delta defaults to (context 256 - prompt 40 - beta2 8) / beta1 12 = 17.
 * discontinuous re-selects at the first consulted step at or after each multiple of delta, so
 * the sparse steps 100 and 203 (multiples 51..85 and 119..187 were never consulted) plan too. */
static void scope_decode_budgets_at_given_steps(void **state) {
        const struct {
                uint32_t t, slide, adaptive, discontinuous; /* 0: no plan */
        } rows[] = {
                { 1, 20, 8, 0 },     { 16, 20, 8, 0 },    { 17, 20, 9, 9 },    { 18, 20, 9, 0 },
                { 33, 20, 9, 0 },    { 34, 20, 10, 10 },  { 100, 20, 13, 13 }, { 102, 20, 14, 14 },
                { 203, 20, 19, 19 }, { 204, 20, 20, 20 }, { 216, 20, 20, 0 },  { 221, 20, 20, 20 },
        };
        const char *strategies[] = { "slide", "adaptive", "discontinuous" };
        (void)state;
        for (int s = 0; s < 3; s++) {
                struct policy *p = scope_past_prompt(strategies[s], NULL, 0);
                for (size_t i = 0; i < N_OF(rows); i++) {
                        uint32_t want = s == 0   ? rows[i].slide
                                        : s == 1 ? rows[i].adaptive
                                                 : rows[i].discontinuous;
                        uint32_t got = keep_at(p, 40 + rows[i].t, 12 + 40, 0.5f);
                        if (got != (want ? 12 + want : POLICY_NO_PLAN))
                                fail_msg("%s at t %u: keep %u, want 12 + %u", strategies[s], rows[i].t, got,
                                         want);
                }
                policy_free(p);
        }
}

/* When a plan is due: slide and adaptive at d >= budget(t) + slack, discontinuous every delta
 * steps when d exceeds budget(t). */
static void scope_plans_when_the_decoded_part_outgrows_its_budget(void **state) {
        (void)state;
        struct policy *p = scope_past_prompt("slide", NULL, 0);
        assert_int_equal(keep_at(p, 140, 12 + 23, 0.5f), POLICY_NO_PLAN);
        assert_int_equal(keep_at(p, 141, 12 + 24, 0.5f), 32);
        policy_free(p);

        p = scope_past_prompt("adaptive", NULL, 0);
        assert_int_equal(keep_at(p, 40 + 17, 12 + 12, 0.5f), POLICY_NO_PLAN); /* 12 < 9 + 4 */
        assert_int_equal(keep_at(p, 40 + 17, 12 + 13, 0.5f), 12 + 9);
        policy_free(p);

        p = scope_past_prompt("discontinuous", NULL, 0);
        assert_int_equal(keep_at(p, 40 + 34, 12 + 10, 0.5f), POLICY_NO_PLAN); /* d must exceed 10 */
        assert_int_equal(keep_at(p, 40 + 35, 12 + 11, 0.5f), POLICY_NO_PLAN); /* 34 was the due step */
        assert_int_equal(keep_at(p, 40 + 51, 12 + 12, 0.5f), 12 + 11);        /* the next multiple */
        policy_free(p);
        p = scope_past_prompt("discontinuous", NULL, 0);
        assert_int_equal(keep_at(p, 40 + 34, 12 + 11, 0.5f), 12 + 10);
        struct policy_limits lim = limits_of(p); /* the cache grows by up to delta between plans */
        assert_true(lim.max_layer_tokens >= 12 + 20 + 17);
        policy_free(p);

        /* delta is a parameter: 5 */
        const struct policy_param d5[] = { NUM("delta", 5) };
        p = scope_past_prompt("adaptive", d5, 1);
        assert_int_equal(keep_at(p, 40 + 10, 12 + 40, 0.5f), 12 + 10);
        assert_int_equal(keep_at(p, 40 + 59, 12 + 40, 0.5f), 12 + 19);
        assert_int_equal(keep_at(p, 40 + 60, 12 + 40, 0.5f), 12 + 20);
        policy_free(p);
        p = scope_past_prompt("discontinuous", d5, 1);
        assert_int_equal(keep_at(p, 40 + 10, 12 + 40, 0.5f), 12 + 10);
        assert_int_equal(keep_at(p, 40 + 11, 12 + 40, 0.5f), POLICY_NO_PLAN);
        policy_free(p);
}

/* A decode plan at d = 24 keeps [0, P = 12), the beta2 = 8 newest [28, 36), and beta1 = 12 of the
 * 16 decoded slots [12, 28) by the current query's attention: the four with 0.01 go. The prompt
 * part and the newest have the least attention of all and stay. */
static void scope_decode_plans_never_touch_the_prompt_part(void **state) {
        struct policy *p = scope_make(NULL, NULL, 0);
        struct policy_target t[2];
        uint32_t lens[1];
        (void)state;

        feed_prompt(p, 40, 1, scope_attention, t);
        assert_int_equal(t[0].keep, 12);
        for (uint32_t a = 41; a < 64; a++)
                assert_int_equal(keep_at(p, a, 12 + a - 40, 0.5f), POLICY_NO_PLAN);
        lens[0] = 36;
        struct policy_step st = step_of(64, lens, 0.5f);
        decide_into(p, &st, t);
        assert_int_equal(t[0].keep, 32);

        struct arrays a = arrays_new(2, 36);
        const uint32_t low[2][4] = { { 13, 17, 20, 25 }, { 12, 14, 26, 27 } };
        for (uint32_t h = 0; h < 2; h++) {
                for (uint32_t i = 12; i < 28; i++)
                        a.last[h * 36 + i] = 1.0f;
                for (int j = 0; j < 4; j++)
                        a.last[h * 36 + low[h][j]] = 0.01f;
                for (uint32_t i = 0; i < 12; i++)
                        a.sum[h * 36 + i] = a.ema[h * 36 + i] = 1e9f; /* not SCOPE's decode score */
        }
        struct policy_layer L = view_of(&a, 0);
        struct selection sel = select_layer(p, &st, &L, t[0]);
        assert_int_equal(sel.r, 0);
        EXPECT_SLOTS(sel, 0, "0-12,14-16,18,19,21-24,26-35");
        EXPECT_SLOTS(sel, 1, "0-11,13,15-25,28-35");
        selection_free(&sel);
        arrays_free(&a);

        /* the next plans keep [0, 12) too, whatever the scores */
        rng_state = 0x5c09e;
        for (uint32_t a2 = 65, n = 33; a2 < 256; a2++, n++) {
                lens[0] = n;
                st = step_of(a2, lens, 0.5f);
                decide_into(p, &st, t);
                if (t[0].keep == POLICY_NO_PLAN)
                        continue;
                struct arrays b = arrays_new(2, n);
                for (uint32_t i = 0; i < 2 * n; i++)
                        b.last[i] = (float)rng_below(1000) - (i % n < 12 ? 2000.0f : 0.0f);
                struct policy_layer Lb = view_of(&b, 0);
                sel = select_layer(p, &st, &Lb, t[0]);
                assert_int_equal(sel.r, 0);
                for (uint32_t h = 0; h < 2; h++)
                        for (uint32_t i = 0; i < 12; i++)
                                assert_int_equal(sel.keep[h * sel.k + i], i);
                n = t[0].keep;
                selection_free(&sel);
                arrays_free(&b);
        }
        policy_free(p);
}

/* Without a prompt length the whole sequence is decode: t counts from the first token. */
static void scope_without_a_prompt_length_treats_everything_as_decode(void **state) {
        struct policy_setup s = setup_of(1, 1, 256, 4, 20, 0);
        const struct policy_param params[] = { NUM("beta2", 8), TEXT("strategy", "adaptive"),
                                               NUM("delta", 10) };
        struct policy *p = policy_make("scope", &s, params, N_OF(params));
        (void)state;
        assert_false(p->ops->observes(p->state, &(struct policy_step){ .appended = 1 }));
        assert_int_equal(keep_at(p, 11, 11, 0.5f), POLICY_NO_PLAN); /* 11 < 9 + 4 */
        assert_int_equal(keep_at(p, 13, 13, 0.5f), 9);
        assert_int_equal(keep_at(p, 200, 40, 0.5f), 20);
        policy_free(p);
}
/* ---- conf, conf-l ---- */

/* Budget 100: n_high 50, n_low 150, tau 0.7 (set: the default is 0.8), a block of 16. The continuous gate's
 * target is 50 + floor((1 - c') 100) with c' = (c - 0.15) / 0.85 clamped to [0, 1]: c 0.9 -> 61, c 0.5 ->
 * 108. Each row: the confidence, the layer's length, and the plan's keep (0: none). */
static void conf_budgets_at_given_confidences_for_each_gate(void **state) {
        static const struct {
                const char *gate;
                float confidence;
                uint32_t n, want;
        } rows[] = {
                { "fixed", 0.2f, 115, 0 },         { "fixed", 0.2f, 116, 100 },
                { "fixed", 0.99f, 116, 100 },      { "fixed", 0.99f, 400, 100 },
                { "fixed", 0.15f, 100, 0 },        { "naive", 0.7f, 65, 0 },
                { "naive", 0.7f, 66, 50 },         { "naive", 0.69f, 66, 0 },
                { "naive", 0.69f, 165, 0 },        { "naive", 0.69f, 166, 150 },
                { "naive", 1.0f, 166, 50 },        { "naive", 0.7f, 50, 0 },
                { "continuous", 1.0f, 65, 0 },     { "continuous", 1.0f, 66, 50 },
                { "continuous", 0.9f, 76, 0 },     { "continuous", 0.9f, 77, 61 },
                { "continuous", 0.5f, 123, 0 },    { "continuous", 0.5f, 124, 108 },
                { "continuous", 0.1f, 166, 150 },  { "continuous", 0.15f, 165, 0 },
                { "continuous", 0.15f, 166, 150 }, { "continuous", 3.0f, 66, 50 },
                { "defer", 0.7f, 116, 100 },       { "defer", 0.69f, 116, 0 },
                { "defer", 0.69f, 165, 0 },        { "defer", 0.69f, 166, 100 },
                { "defer", 0.99f, 115, 0 },        { "defer", 0.15f, 400, 100 },
        };
        struct policy_setup s = setup_of(1, 2, 4096, 16, 100, 0);
        (void)state;
        for (size_t i = 0; i < N_OF(rows); i++) {
                const struct policy_param gate[] = { TEXT("gate", rows[i].gate), NUM("tau", 0.7) };
                struct policy *p = policy_make("conf", &s, gate, 2);
                uint32_t got = keep_at(p, rows[i].n, rows[i].n, rows[i].confidence);
                if (got != (rows[i].want ? rows[i].want : POLICY_NO_PLAN))
                        fail_msg("row %zu: gate %s at c %g, %u tokens: keep %u, want %u", i, rows[i].gate,
                                 (double)rows[i].confidence, rows[i].n, got, rows[i].want);
                struct policy_limits lim = limits_of(p);
                bool fixed = strcmp(rows[i].gate, "fixed") == 0;
                assert_int_equal(lim.budget, 100);
                assert_int_equal(lim.max_keep, fixed ? 100 : 150);
                assert_int_equal(lim.max_layer_tokens, fixed ? 116 : 166);
                assert_false(lim.per_head);
                assert_false(lim.lower);
                policy_free(p);
        }
        /* the default gate is defer */
        struct policy *p = policy_make("conf", &s, NULL, 0);
        assert_int_equal(keep_at(p, 120, 120, 0.9f), 100);
        assert_int_equal(keep_at(p, 120, 120, 0.5f), POLICY_NO_PLAN);
        policy_free(p);
}

/* int8=1: of the kept tokens all but the newest fp_window (32, set: the default is 8) go to INT8. */
static void conf_int8_marks_all_but_the_fp_window(void **state) {
        struct policy_setup s = setup_of(2, 2, 4096, 16, 100, 0);
        struct policy_target t[3];
        const uint32_t lens[] = { 166, 100 };
        (void)state;

        const struct policy_param fixed[] = { NUM("int8", 1), TEXT("gate", "fixed"), NUM("fp_window", 32) };
        struct policy *p = policy_make("conf", &s, fixed, N_OF(fixed));
        assert_true(limits_of(p).lower);
        struct policy_step st = step_of(166, lens, 0.9f);
        decide_into(p, &st, t);
        assert_int_equal(t[0].keep, 100);
        assert_int_equal(t[0].low, 68);
        assert_int_equal(t[1].keep, POLICY_NO_PLAN);
        assert_int_equal(t[1].low, 0);
        policy_free(p);

        const struct policy_param naive[] = { NUM("int8", 1), TEXT("gate", "naive"), NUM("fp_window", 32) };
        p = policy_make("conf", &s, naive, N_OF(naive));
        decide_into(p, &st, t);
        assert_int_equal(t[0].keep, 50);
        assert_int_equal(t[0].low, 18);
        policy_free(p);

        const struct policy_param wide[] = { NUM("int8", 1), TEXT("gate", "naive"), NUM("fp_window", 64) };
        p = policy_make("conf", &s, wide, N_OF(wide));
        decide_into(p, &st, t);
        assert_int_equal(t[0].keep, 50);
        assert_int_equal(t[0].low, 0);
        policy_free(p);

        p = policy_make("conf", &s, NULL, 0); /* int8 off: never any */
        assert_false(limits_of(p).lower);
        decide_into(p, &st, t);
        assert_int_equal(t[0].keep, 100);
        assert_int_equal(t[0].low, 0);
        policy_free(p);
}

/* conf-l: B 64 over 5 layers (n_high 32, n_low 96), every level spread by the pyramid schedule
 * with conf-l's default beta 2 (min = level / 2, max = 1.5 level): B -> 96, 80, 64, 48, 32;
 * n_low -> 144, 120, 96, 72, 48; n_high -> 48, 40, 32, 24, 16. */
static void conf_l_spreads_every_level_over_the_layers(void **state) {
        struct policy_setup s = setup_of(5, 1, 4096, 16, 64, 0);
        struct policy *p = policy_make("conf-l", &s, NULL, 0);
        const uint32_t budget[] = { 96, 80, 64, 48, 32 };
        struct policy_target t[6];
        (void)state;

        struct policy_limits lim = limits_of(p);
        assert_int_equal(lim.budget, 64);
        assert_int_equal(lim.max_keep, 144);
        assert_int_equal(lim.max_layer_tokens, 160);

        const uint32_t at_budget[] = { 112, 96, 80, 64, 48 }, at_low[] = { 160, 136, 112, 88, 64 };
        struct policy_step st = step_of(300, at_budget, 0.9f); /* confident: cut to B per layer */
        decide_into(p, &st, t);
        for (int l = 0; l < 5; l++)
                assert_int_equal(t[l].keep, budget[l]);
        st = step_of(301, at_budget, 0.3f); /* uncertain: grow up to n_low per layer */
        decide_into(p, &st, t);
        for (int l = 0; l < 5; l++)
                assert_int_equal(t[l].keep, POLICY_NO_PLAN);
        st = step_of(302, at_low, 0.3f);
        decide_into(p, &st, t);
        for (int l = 0; l < 5; l++)
                assert_int_equal(t[l].keep, budget[l]);
        policy_free(p);

        const struct policy_param naive[] = { TEXT("gate", "naive") };
        p = policy_make("conf-l", &s, naive, 1);
        const uint32_t big[] = { 500, 500, 500, 500, 500 }, high[] = { 48, 40, 32, 24, 16 };
        const uint32_t low[] = { 144, 120, 96, 72, 48 };
        st = step_of(500, big, 0.95f);
        decide_into(p, &st, t);
        for (int l = 0; l < 5; l++)
                assert_int_equal(t[l].keep, high[l]);
        st = step_of(501, big, 0.2f);
        decide_into(p, &st, t);
        for (int l = 0; l < 5; l++)
                assert_int_equal(t[l].keep, low[l]);
        policy_free(p);

        /* beta is a parameter; conf with pyramid=1 takes PyramidKV's 20 (B -> 125, 94, 64, 34, 3) */
        const uint32_t steep[] = { 125, 94, 64, 34, 3 };
        const struct policy_param b20[] = { NUM("beta", 20) }, pyr[] = { NUM("pyramid", 1) };
        p = policy_make("conf-l", &s, b20, 1);
        assert_int_equal(limits_of(p).max_keep, 187);
        st = step_of(300, big, 0.9f);
        decide_into(p, &st, t);
        for (int l = 0; l < 5; l++)
                assert_int_equal(t[l].keep, steep[l]);
        policy_free(p);
        p = policy_make("conf", &s, pyr, 1);
        decide_into(p, &st, t);
        for (int l = 0; l < 5; l++)
                assert_int_equal(t[l].keep, steep[l]);
        policy_free(p);
}

/* Eight slots, k 4, sink 1, protect 1, lambda 4; EMA 9 1 8 2 4 0 3 5, positions 0..7. S = w_att
 * A / 9 + w_rec exp(-(7 - pos) / 4) over slots 1..6: attention alone picks 2 and 4, recency alone
 * 5 and 6, both (1.175, 1.112 for 2 and 6 against 0.917 for 4) pick 2 and 6. */
static void conf_ranks_by_ema_attention_and_recency_per_their_weights(void **state) {
        const struct {
                double w_att, w_rec, lambda;
                const char *want;
        } rows[] = {
                { 1, 0, 4, "0,2,4,7" }, { 0, 1, 4, "0,5-7" },
                { 1, 1, 4, "0,2,6,7" }, { 1, 1, 100, "0,2,4,7" }, /* a long lambda flattens recency */
                { 1, 2, 4, "0,2,6,7" },
        };
        const float ema[] = { 9, 1, 8, 2, 4, 0, 3, 5 };
        struct policy_setup s = setup_of(1, 1, 4096, 16, 8, 0);
        (void)state;
        for (size_t i = 0; i < N_OF(rows); i++) {
                const struct policy_param params[] = { NUM("sinks", 1), NUM("protect", 1),
                                                       NUM("w_att", rows[i].w_att),
                                                       NUM("w_rec", rows[i].w_rec),
                                                       NUM("lambda", rows[i].lambda) };
                struct policy *p = policy_make("conf", &s, params, N_OF(params));
                struct arrays a = arrays_new(1, 8);
                memcpy(a.ema, ema, sizeof(ema));
                for (uint32_t j = 0; j < 8; j++)
                        a.sum[j] = a.last[j] = (float)(8 - j); /* not conf's score */
                struct policy_layer L = view_of(&a, 0);
                struct selection sel = select_layer(p, NULL, &L, (struct policy_target){ .keep = 4 });
                assert_int_equal(sel.r, 0);
                EXPECT_SLOTS(sel, 0, rows[i].want);
                selection_free(&sel);
                arrays_free(&a);
                policy_free(p);
        }
}

/* 40 slots, k 24: the 4 sinks and 16 newest stay though their EMA is 0 or NaN; the 4 others are
 * the heavy 10..13 (lambda = B = 64: recency adds at most 0.79 to the light ones). */
static void conf_always_keeps_the_sinks_and_the_protected_window(void **state) {
        struct policy_setup s = setup_of(1, 2, 4096, 16, 64, 0);
        struct policy *p = policy_make("conf", &s, NULL, 0);
        (void)state;
        struct arrays a = arrays_new(2, 40);
        for (uint32_t h = 0; h < 2; h++) {
                for (uint32_t i = 0; i < 40; i++)
                        a.ema[h * 40 + i] = i < 4 ? 0.0f : i >= 24 ? (i % 2 ? NAN : -1.0f) : 1.0f;
                for (uint32_t i = 10; i < 14; i++)
                        a.ema[h * 40 + i] = 100.0f;
        }
        struct policy_layer L = view_of(&a, 0);
        struct selection sel = select_layer(p, NULL, &L, (struct policy_target){ .keep = 24 });
        assert_int_equal(sel.r, 0);
        EXPECT_SLOTS(sel, 0, "0-3,10-13,24-39");
        selection_free(&sel);
        arrays_free(&a);
        policy_free(p);
}

/* correction=sink: the evicted EMA mass goes to the first sink's log-weight. Head 0 keeps 0, 2, 4,
 * 7 (19 of 25): log((2 + 6) / 2) = log 4; per head, head 1 keeps 0, 1, 6, 7 (12 of 16): log 5. */
static void conf_sink_correction_gives_the_evicted_mass_to_the_first_sink(void **state) {
        const float ema0[] = { 2, 1, 8, 2, 4, 0, 3, 5 }, ema1[] = { 1, 9, 1, 1, 1, 1, 1, 1 };
        struct policy_setup s = setup_of(1, 2, 4096, 16, 8, 0);
        (void)state;

        const struct policy_param layer[] = { NUM("sinks", 1), NUM("protect", 1), NUM("w_rec", 0),
                                              TEXT("correction", "sink") };
        struct policy *p = policy_make("conf", &s, layer, N_OF(layer));
        struct arrays a = arrays_new(2, 8);
        memcpy(a.ema, ema0, sizeof(ema0));
        memcpy(a.ema + 8, ema0, sizeof(ema0));
        struct policy_layer L = view_of(&a, 0);
        struct selection sel = select_layer(p, NULL, &L, (struct policy_target){ .keep = 4 });
        assert_int_equal(sel.r, 1);
        EXPECT_SLOTS(sel, 0, "0,2,4,7");
        assert_float_equal(sel.delta[0], log(4.0), 1e-6);
        for (int i = 1; i < 4; i++)
                assert_true(sel.delta[i] == 0.0f);
        selection_free(&sel);
        policy_free(p);

        const struct policy_param heads[] = { NUM("sinks", 1), NUM("protect", 1), NUM("w_rec", 0),
                                              TEXT("correction", "sink"), NUM("per_head", 1) };
        p = policy_make("conf", &s, heads, N_OF(heads));
        assert_true(limits_of(p).per_head);
        memcpy(a.ema + 8, ema1, sizeof(ema1));
        sel = select_layer(p, NULL, &L, (struct policy_target){ .keep = 4 });
        assert_int_equal(sel.r, 1);
        assert_int_equal(sel.sets, 2);
        EXPECT_SLOTS(sel, 0, "0,2,4,7");
        EXPECT_SLOTS(sel, 1, "0,1,6,7");
        assert_float_equal(sel.delta[0], log(4.0), 1e-6);
        assert_float_equal(sel.delta[4], log(5.0), 1e-6);
        for (int i = 1; i < 8; i++)
                assert_true(i == 4 || sel.delta[i] == 0.0f);
        selection_free(&sel);
        policy_free(p);

        /* correction=none (the default) writes none */
        p = policy_make("conf", &s, layer, 3);
        sel = select_layer(p, NULL, &L, (struct policy_target){ .keep = 4 });
        assert_int_equal(sel.r, 0);
        selection_free(&sel);
        policy_free(p);
        arrays_free(&a);
}

/* Under defer, B is where confident steps cut and n_low where uncertain ones stop growing: B above
 * n_low cannot be met (the layer stops at n_low + slack and a plan to B would not shrink it). The
 * other gates do not use B. */
static void conf_refuses_a_budget_above_n_low_when_deferring(void **state) {
        struct policy_setup s = setup_of(1, 1, 4096, 16, 100, 0);
        const struct policy_param low[] = { NUM("n_low", 60) };
        (void)state;
        EXPECT_POLICY_ERROR_IN(s, "conf", low, 1, -EINVAL, "budget (100) <= n_low (60)");
        const struct policy_param naive[] = { NUM("n_low", 60), TEXT("gate", "naive") };
        struct policy *p = policy_make("conf", &s, naive, N_OF(naive));
        assert_int_equal(keep_at(p, 76, 76, 0.2f), 60);
        policy_free(p);
        const struct policy_param equal[] = { NUM("n_low", 100) };
        p = policy_make("conf", &s, equal, 1);
        assert_int_equal(keep_at(p, 116, 116, 0.2f), 100);
        policy_free(p);
}

/* gate=attention, budget 100 (n_low 150, 4 sinks, 16 protected), one layer of 116 slots: slots 4..99
 * ranked by EMA (1, recency breaking the ties) so a cut to 100 evicts exactly slots 4..19. One step:
 * the newest query pays `evicted` of its attention to slot 10 (evicted by a cut) and the rest to the
 * newest slot (protected); observe when asked, then decide. Returns layer 0's keep (POLICY_NO_PLAN: none). */
static uint32_t attention_step(struct policy *p, uint32_t n, float evicted, bool *observed) {
        uint32_t H = p->setup.n_kv_heads, lens[1] = { n };
        struct arrays a = arrays_new(H, n);
        uint32_t *scratch = malloc(4 * (size_t)H * n * sizeof(uint32_t));
        struct policy_target t[2];
        assert_non_null(scratch);
        for (uint32_t h = 0; h < H; h++) {
                for (uint32_t i = 4; i < 100; i++)
                        a.ema[(size_t)h * n + i] = 1.0f;
                a.last[(size_t)h * n + 10] = evicted;
                a.last[(size_t)h * n + n - 1] = 1.0f - evicted;
        }
        struct policy_step st = step_of(n, lens, 0.9f);
        *observed = p->ops->observes && p->ops->observes(p->state, &st);
        if (*observed) {
                struct policy_layer view = view_of(&a, 0);
                p->ops->observe(p->state, &st, &view, scratch);
        }
        decide_into(p, &st, t);
        free(scratch);
        arrays_free(&a);
        return t[0].keep;
}

/* The attention gate cuts when the cut would evict little attention and grows the layer (up to
 * n_low) when it would evict much, against a running quantile of its own past; past n_low + slack it
 * cuts whatever the attention; confidence plays no part. */
static void conf_attention_gate_defers_when_a_cut_would_evict_attention(void **state) {
        struct policy_setup s = setup_of(1, 2, 4096, 16, 100, 0);
        const struct policy_param gate[] = { TEXT("gate", "attention") };
        bool seen;
        (void)state;
        struct policy *p = policy_make("conf", &s, gate, 1);
        struct policy_limits lim = limits_of(p);
        assert_int_equal(lim.max_keep, 150);
        assert_int_equal(lim.max_layer_tokens, 166);
        assert_int_equal(attention_step(p, 115, 0.0f, &seen), POLICY_NO_PLAN); /* below B + slack */
        assert_false(seen);
        assert_int_equal(attention_step(p, 116, 0.1f, &seen), 100); /* the first: at its own level */
        assert_true(seen);
        assert_int_equal(attention_step(p, 116, 0.9f, &seen), POLICY_NO_PLAN); /* would evict 0.9 */
        assert_true(seen);
        assert_int_equal(attention_step(p, 140, 0.0f, &seen), 100); /* would evict nothing */
        assert_int_equal(attention_step(p, 165, 0.9f, &seen), POLICY_NO_PLAN);
        assert_int_equal(attention_step(p, 166, 0.9f, &seen), 100); /* n_low + slack: due */
        assert_false(seen);
        policy_free(p);

        /* the share of steps cut follows att_q: masses spread over [0, 1), 2,000 steps in the band */
        const float qs[] = { 0.5f, 0.2f, 0.8f };
        for (size_t qi = 0; qi < N_OF(qs); qi++) {
                const struct policy_param qp[] = { TEXT("gate", "attention"), NUM("att_q", qs[qi]) };
                p = policy_make("conf", &s, qp, 2);
                uint32_t cuts = 0, steps = 2000;
                for (uint32_t k = 0; k < steps; k++) {
                        float u = (float)fmod(0.5 + k * 0.6180339887498949, 1.0); /* a Weyl sequence */
                        cuts += attention_step(p, 130, u, &seen) == 100;
                }
                double share = (double)cuts / steps;
                if (fabs(share - qs[qi]) > 0.05)
                        fail_msg("att_q %g: %u of %u steps cut (%.3f)", (double)qs[qi], cuts, steps, share);
                policy_free(p);
        }
        const struct policy_param bad[] = { TEXT("gate", "attention"), NUM("att_q", 1) };
        EXPECT_POLICY_ERROR_IN(s, "conf", bad, 2, -EINVAL, "att_q must be a number in [0.01, 0.99]");
        const struct policy_param low[] = { TEXT("gate", "attention"), NUM("n_low", 60) };
        EXPECT_POLICY_ERROR_IN(s, "conf", low, 2, -EINVAL, "gate=attention needs budget (100) <= n_low (60)");
}

/* ---- prob ---- */

static float wild_score(void) {
        switch (rng_below(24)) {
        case 0: return NAN;
        case 1: return INFINITY;
        case 2: return -INFINITY;
        case 3: return -(float)(1 + rng_below(1000));
        case 4: return 1e30f;
        case 5: return 0.0f;
        case 6: return 1.0f;
        default: return (float)(rng_next() >> 40) / (float)(1u << 24);
        }
}

static void fill_wild(struct arrays *a) {
        for (size_t i = 0; i < (size_t)a->heads * a->n; i++) {
                a->sum[i] = wild_score();
                a->ema[i] = wild_score();
                a->last[i] = wild_score();
        }
}

static void prob_inclusion_probabilities_sum_to_m_and_lie_in_zero_one(void **state) {
        const float temps[] = { 1e-3f, 0.01f, 0.1f, 1.0f, 10.0f, 1e6f };
        enum { N = 2000 };
        float *score = malloc(N * sizeof(*score));
        double *pi = malloc(N * sizeof(*pi));
        (void)state;
        assert_true(score && pi);

        assert_int_equal(prob_inclusion(score, 4, 2, 0.0f, pi), -EINVAL);
        assert_int_equal(prob_inclusion(score, 4, 2, -1.0f, pi), -EINVAL);
        assert_int_equal(prob_inclusion(score, 4, 2, NAN, pi), -EINVAL);
        assert_int_equal(prob_inclusion(score, 4, 5, 1.0f, pi), -EINVAL);

        rng_state = 0x9e0b;
        for (int iter = 0; iter < 1500; iter++) {
                uint32_t n = 1 + rng_below(iter < 1000 ? 64 : N), m = rng_below(n + 1), shape = rng_below(5);
                float temperature = temps[rng_below(N_OF(temps))];
                for (uint32_t i = 0; i < n; i++) {
                        switch (shape) {
                        case 0: score[i] = wild_score(); break;
                        case 1: score[i] = powf(0.97f, (float)(n - i)); break; /* an EMA: decays with age */
                        case 2: score[i] = 0.25f; break;                       /* all equal */
                        case 3: score[i] = 1.0f - 0.6931472f * temperature * (float)i; break; /* w halves */
                        default: score[i] = (float)(rng_next() >> 40) / (float)(1u << 24);
                        }
                }
                assert_int_equal(prob_inclusion(score, n, m, temperature, pi), 0);
                double sum = 0;
                for (uint32_t i = 0; i < n; i++) {
                        /* pi > 0 where the weights' spread is bounded: elsewhere a weight below
                         * double precision beside m capped ones is rightly 0 */
                        bool bounded = (shape == 1 || shape == 2 || shape == 4) && temperature >= 0.1f;
                        if (!(pi[i] >= 0.0 && pi[i] <= 1.0) || (m > 0 && bounded && !(pi[i] > 0.0)) ||
                            (m == 0 && pi[i] != 0.0))
                                fail_msg("iter %d (shape %u, n %u, m %u, t %g): pi[%u] = %g", iter, shape, n,
                                         m, (double)temperature, i, pi[i]);
                        sum += pi[i];
                }
                if (!(fabs(sum - m) <= 1e-9 * (m + 1)))
                        fail_msg("iter %d (shape %u, n %u, m %u, t %g): the pi sum to %.12g", iter, shape, n,
                                 m, (double)temperature, sum);
                if (shape == 2) /* equal scores: equal chances */
                        for (uint32_t i = 0; i < n; i++)
                                assert_float_equal(pi[i], (double)m / n, 1e-12);
        }
        free(score);
        free(pi);
}

struct prob_case {
        uint32_t heads, n, k, sinks, protect;
        const char *scorer;
        struct arrays a;
};

static struct prob_case prob_case_random(void) {
        static const char *scorers[] = { "ema", "sum", "last" };
        struct prob_case c = { .heads = 1 + rng_below(3),
                               .n = 30 + rng_below(300),
                               .sinks = rng_below(6),
                               .protect = rng_below(20),
                               .scorer = scorers[rng_below(3)] };
        c.k = c.sinks + c.protect + 1 + rng_below(c.n - c.sinks - c.protect - 1);
        c.a = arrays_new(c.heads, c.n);
        fill_wild(&c.a);
        return c;
}

static struct policy *prob_make(const struct prob_case *c, double temperature, const char *correction,
                                uint32_t seed) {
        struct policy_setup s = setup_of(1, c->heads, 4096, 16, c->k, 0);
        const struct policy_param params[] = { NUM("temperature", temperature), NUM("sinks", c->sinks),
                                               NUM("protect", c->protect),      TEXT("scorer", c->scorer),
                                               TEXT("correction", correction),  NUM("seed", seed) };
        return policy_make("prob", &s, params, N_OF(params));
}

/* The layer's scores as prob sees them: the mean over heads of its scorer's array. */
static float *prob_scores(const struct prob_case *c) {
        float *mean = malloc(c->n * sizeof(float));
        const float *src = strcmp(c->scorer, "sum") == 0    ? c->a.sum
                           : strcmp(c->scorer, "last") == 0 ? c->a.last
                                                            : c->a.ema;
        assert_non_null(mean);
        policy_mean_over_heads(src, c->heads, c->n, mean);
        return mean;
}

static void prob_at_temperature_zero_equals_keep_ranked_on_1000_random_cases(void **state) {
        static const char *corrections[] = { "ht", "none", "sink" };
        (void)state;
        rng_state = 0x7e40;
        for (int iter = 0; iter < 1000; iter++) {
                struct prob_case c = prob_case_random();
                const char *correction = corrections[rng_below(3)];
                if (strcmp(correction, "sink") == 0 && c.sinks == 0)
                        correction = "none";
                struct policy *p = prob_make(&c, 0.0, correction, rng_below(100));
                struct policy_limits lim = limits_of(p);
                assert_false(lim.per_head);
                assert_int_equal(lim.max_keep, c.k);

                float *score = prob_scores(&c);
                uint32_t *want = malloc(c.k * sizeof(uint32_t)), *scratch = malloc(c.n * sizeof(uint32_t));
                assert_true(want && scratch);
                policy_keep_ranked(score, c.n, c.k, c.sinks, c.protect, want, scratch);

                struct policy_layer L = view_of(&c.a, 0);
                struct selection sel = select_layer(p, NULL, &L, (struct policy_target){ .keep = c.k });
                assert_int_equal(sel.r, strcmp(correction, "none") == 0 ? 0 : 1);
                for (uint32_t i = 0; i < c.k; i++)
                        if (sel.keep[i] != want[i])
                                fail_msg("case %d (n %u, k %u, sinks %u, protect %u, %s): keep[%u] = %u, "
                                         "want %u",
                                         iter, c.n, c.k, c.sinks, c.protect, c.scorer, i, sel.keep[i],
                                         want[i]);
                for (uint32_t i = 0; strcmp(correction, "ht") == 0 && i < c.k; i++)
                        assert_true(sel.delta[i] == 0.0f); /* deterministic: every pi is 1 */
                selection_free(&sel);
                free(want);
                free(scratch);
                free(score);
                arrays_free(&c.a);
                policy_free(p);
        }
}

/* temperature > 0: the sinks and protected slots kept with no delta; exactly m = k - sinks -
 * protect of the others, each with the delta -log pi from prob_inclusion over the same scores. */
static void prob_log_weights_are_minus_log_of_the_inclusion_probabilities(void **state) {
        const double temps[] = { 0.001, 0.05, 0.1, 0.5, 2, 50 };
        (void)state;
        rng_state = 0x106b;
        for (int iter = 0; iter < 400; iter++) {
                struct prob_case c = prob_case_random();
                double temperature = temps[rng_below(N_OF(temps))];
                struct policy *p = prob_make(&c, temperature, "ht", iter);
                float *score = prob_scores(&c);
                uint32_t cand = c.n - c.sinks - c.protect, m = c.k - c.sinks - c.protect;
                double *pi = malloc(cand * sizeof(double));
                assert_non_null(pi);
                assert_int_equal(prob_inclusion(score + c.sinks, cand, m, (float)temperature, pi), 0);

                struct policy_layer L = view_of(&c.a, 0);
                struct selection sel = select_layer(p, NULL, &L, (struct policy_target){ .keep = c.k });
                if (sel.r != 1)
                        fail_msg("case %d (n %u, k %u, sinks %u, protect %u, t %g): select = %d", iter, c.n,
                                 c.k, c.sinks, c.protect, temperature, sel.r);
                for (uint32_t i = 0; i < c.k; i++) {
                        uint32_t slot = sel.keep[i];
                        if (i < c.sinks || i >= c.k - c.protect) {
                                assert_int_equal(slot, i < c.sinks ? i : c.n - (c.k - i));
                                assert_true(sel.delta[i] == 0.0f);
                                continue;
                        }
                        assert_true(slot >= c.sinks && slot < c.n - c.protect);
                        double want = -log(pi[slot - c.sinks]);
                        if (!(pi[slot - c.sinks] > 0) || sel.delta[i] != (float)want)
                                fail_msg("case %d: slot %u kept with delta %g, pi %g", iter, slot,
                                         (double)sel.delta[i], pi[slot - c.sinks]);
                }
                selection_free(&sel);
                free(pi);
                free(score);
                arrays_free(&c.a);
                policy_free(p);
        }
}

/* Systematic sampling keeps slot i with probability exactly pi_i: over 20000 draws each count is
 * within five standard deviations of 20000 pi_i (and a pi of 1 is always kept). */
static void prob_inclusion_frequencies_match_pi_within_five_sigma(void **state) {
        enum { DRAWS = 20000, N = 40, K = 16, SINKS = 2, PROTECT = 4 };
        const uint32_t cand = N - SINKS - PROTECT, m = K - SINKS - PROTECT;
        uint32_t count[N] = { 0 };
        double pi[N];
        (void)state;

        struct prob_case c = {
                .heads = 2, .n = N, .k = K, .sinks = SINKS, .protect = PROTECT, .scorer = "ema"
        };
        c.a = arrays_new(2, N);
        rng_state = 0xf7e9;
        for (uint32_t i = 0; i < 2 * N; i++)
                c.a.ema[i] = (float)(rng_next() >> 40) / (float)(1u << 24);
        c.a.ema[10] = c.a.ema[N + 10] = 3.0f; /* sure to be kept */
        c.a.ema[11] = c.a.ema[N + 11] = 2.5f;
        struct policy *p = prob_make(&c, 0.3, "ht", 12345);
        float *score = prob_scores(&c);
        assert_int_equal(prob_inclusion(score + SINKS, cand, m, 0.3f, pi), 0);
        uint32_t sure = 0;
        for (uint32_t i = 0; i < cand; i++)
                sure += pi[i] == 1.0;
        assert_true(sure >= 1 && sure < m);

        struct policy_layer L = view_of(&c.a, 0);
        for (int d = 0; d < DRAWS; d++) {
                struct selection sel = select_layer(p, NULL, &L, (struct policy_target){ .keep = K });
                assert_int_equal(sel.r, 1);
                for (uint32_t i = 0; i < K; i++)
                        count[sel.keep[i]]++;
                selection_free(&sel);
        }
        for (uint32_t i = 0; i < N; i++) {
                if (i < SINKS || i >= N - PROTECT) {
                        assert_int_equal(count[i], DRAWS);
                        continue;
                }
                double q = pi[i - SINKS], mean = DRAWS * q, sigma = sqrt(DRAWS * q * (1 - q));
                if (fabs(count[i] - mean) > 5 * sigma + 1e-9)
                        fail_msg("slot %u: kept %u times in %d, pi %.4f (expected %.1f +- %.1f)", i, count[i],
                                 DRAWS, q, mean, sigma);
        }
        free(score);
        arrays_free(&c.a);
        policy_free(p);
}

static void prob_same_seed_gives_the_same_keep_sets_and_another_seed_others(void **state) {
        (void)state;
        rng_state = 0x5eed;
        struct prob_case c = prob_case_random();
        c.k = c.sinks + c.protect + (c.n - c.sinks - c.protect) / 2;
        struct policy *a = prob_make(&c, 1.0, "ht", 7), *b = prob_make(&c, 1.0, "ht", 7);
        struct policy *other = prob_make(&c, 1.0, "ht", 8);
        struct policy_layer L = view_of(&c.a, 0);
        uint32_t differ = 0;
        for (int d = 0; d < 50; d++) {
                struct selection x = select_layer(a, NULL, &L, (struct policy_target){ .keep = c.k });
                struct selection y = select_layer(b, NULL, &L, (struct policy_target){ .keep = c.k });
                struct selection z = select_layer(other, NULL, &L, (struct policy_target){ .keep = c.k });
                assert_memory_equal(x.keep, y.keep, c.k * sizeof(uint32_t));
                assert_memory_equal(x.delta, y.delta, c.k * sizeof(float));
                differ += memcmp(x.keep, z.keep, c.k * sizeof(uint32_t)) != 0;
                selection_free(&x);
                selection_free(&y);
                selection_free(&z);
        }
        assert_true(differ > 25);
        arrays_free(&c.a);
        policy_free(a);
        policy_free(b);
        policy_free(other);
}

/* correction=sink: one positive delta, on the first slot, log((a_sink + evicted) / a_sink) with
 * the EMA averaged over heads. Hand case (temperature 0): mean EMA 2, 5, then ten 1s; k 8 keeps 0,
 * 1, 6..11 and evicts 2..5 (mass 4): log((2 + 4) / 2) = log 3. */
static void prob_sink_correction_writes_only_the_first_slot(void **state) {
        struct prob_case c = { .heads = 2, .n = 12, .k = 8, .sinks = 1, .protect = 1, .scorer = "ema" };
        (void)state;
        c.a = arrays_new(2, 12);
        for (uint32_t i = 0; i < 24; i++)
                c.a.ema[i] = 1.0f;
        c.a.ema[0] = 1.0f;
        c.a.ema[12] = 3.0f;
        c.a.ema[1] = c.a.ema[13] = 5.0f;
        struct policy *p = prob_make(&c, 0.0, "sink", 1);
        struct policy_layer L = view_of(&c.a, 0);
        struct selection sel = select_layer(p, NULL, &L, (struct policy_target){ .keep = 8 });
        assert_int_equal(sel.r, 1);
        EXPECT_SLOTS(sel, 0, "0,1,6-11");
        assert_float_equal(sel.delta[0], log(3.0), 1e-6);
        for (int i = 1; i < 8; i++)
                assert_true(sel.delta[i] == 0.0f);
        selection_free(&sel);
        policy_free(p);
        arrays_free(&c.a);

        /* sampled keep-sets: the same formula on whatever was kept */
        rng_state = 0x51e4;
        for (int iter = 0; iter < 200; iter++) {
                c = prob_case_random();
                c.sinks = 1 + c.sinks;
                c.k = c.k + 1 < c.n ? c.k + 1 : c.k;
                for (size_t i = 0; i < (size_t)c.heads * c.n; i++)
                        c.a.ema[i] = (float)(1 + rng_below(100)) / 64.0f; /* positive: a real EMA */
                p = prob_make(&c, 0.5, "sink", iter);
                L = view_of(&c.a, 0);
                sel = select_layer(p, NULL, &L, (struct policy_target){ .keep = c.k });
                assert_int_equal(sel.r, 1);
                float *mean = malloc(c.n * sizeof(float));
                assert_non_null(mean);
                policy_mean_over_heads(c.a.ema, c.heads, c.n, mean);
                double all = 0, kept = 0;
                for (uint32_t i = 0; i < c.n; i++)
                        all += mean[i];
                for (uint32_t i = 0; i < c.k; i++)
                        kept += mean[sel.keep[i]];
                assert_int_equal(sel.keep[0], 0);
                double want = log((mean[0] + all - kept) / mean[0]);
                assert_true(want > 0);
                assert_float_equal(sel.delta[0], fmin(want, 10.0), 1e-5);
                for (uint32_t i = 1; i < c.k; i++)
                        assert_true(sel.delta[i] == 0.0f);
                free(mean);
                selection_free(&sel);
                policy_free(p);
                arrays_free(&c.a);
        }
}

static void prob_without_correction_writes_no_deltas(void **state) {
        (void)state;
        rng_state = 0x40c0;
        for (int iter = 0; iter < 50; iter++) {
                struct prob_case c = prob_case_random();
                struct policy *p = prob_make(&c, iter % 2 ? 0.2 : 0.0, "none", iter);
                struct policy_layer L = view_of(&c.a, 0);
                struct selection sel = select_layer(p, NULL, &L, (struct policy_target){ .keep = c.k });
                assert_int_equal(sel.r, 0);
                selection_free(&sel);
                policy_free(p);
                arrays_free(&c.a);
        }
}

/* correction=moment: kvcd merges the evicted tokens into a summary slot beside the keep-set
 * (limits.summarize); the policy itself writes no log-weights. */
static void moment_correction_asks_kvcd_for_a_summary_and_writes_no_deltas(void **state) {
        const char *policies[] = { "conf", "conf-l", "prob" };
        const struct policy_param moment[] = { TEXT("correction", "moment") };
        struct policy_setup s = setup_of(1, 2, 4096, 16, 64, 0);
        (void)state;
        rng_state = 0x30e7;
        for (size_t i = 0; i < N_OF(policies); i++) {
                struct policy *p = policy_make(policies[i], &s, NULL, 0);
                assert_false(limits_of(p).summarize);
                policy_free(p);
                p = policy_make(policies[i], &s, moment, 1);
                assert_true(limits_of(p).summarize);
                assert_false(limits_of(p).per_head);
                struct arrays a = arrays_new(2, 90);
                fill_wild(&a);
                struct policy_layer L = view_of(&a, 0);
                struct selection sel = select_layer(p, NULL, &L, (struct policy_target){ .keep = 63 });
                assert_int_equal(sel.r, 0);
                selection_free(&sel);
                arrays_free(&a);
                policy_free(p);
        }
}

/* prob plans like window: at B + slack, to B; defaults B 128, sinks 4, protect 16, t 0.1. */
static void prob_plans_at_budget_plus_slack(void **state) {
        struct policy_setup s = setup_of(2, 2, 4096, 16, 0, 0);
        struct policy *p = policy_make("prob", &s, NULL, 0);
        (void)state;
        struct policy_limits lim = limits_of(p);
        assert_int_equal(lim.budget, 128);
        assert_int_equal(lim.max_layer_tokens, 144);
        assert_int_equal(lim.max_keep, 128);
        assert_int_equal(keep_at(p, 143, 143, 0.5f), POLICY_NO_PLAN);
        assert_int_equal(keep_at(p, 144, 144, 0.5f), 128);
        policy_free(p);
}
/* ---- whole sessions on wild scores: the properties every policy keeps ---- */

/* What a policy promises to keep in every plan, beyond a valid keep-set. */
enum promise {
        PROMISE_NOTHING,      /* tova: the top by score, nothing protected */
        PROMISE_NEWEST,       /* window: exactly the k newest */
        PROMISE_SINKS_RECENT, /* the first `sinks` and the `recent` newest (clipped to k) */
        PROMISE_HALF_RECENT,  /* h2o, pyramid: the floor(k / 2) newest */
        PROMISE_PROMPT,       /* snapkv: the window [M - window, M) and all that followed */
        PROMISE_SCOPE,        /* scope: see check_scope */
};

#define MAX_CASE_PARAMS 5

struct sim_case {
        const char *policy;
        struct policy_param params[MAX_CASE_PARAMS];
        size_t n_params;
        enum promise promise;
        uint32_t sinks, recent; /* PROMISE_SINKS_RECENT (recent UINT32_MAX: k - sinks); snapkv's window */
        bool full_prompt;       /* scope prefill=full */
        bool deltas;            /* select returns log-weight deltas */
};

#define SINKS_RECENT(s, r) .promise = PROMISE_SINKS_RECENT, .sinks = (s), .recent = (r)
#define CONF_PROTECT       (UINT32_MAX - 1) /* conf's default protect: min(B / 4, 16) */

static const struct sim_case sim_cases[] = {
        { .policy = "full" },
        { .policy = "window", .promise = PROMISE_NEWEST },
        { .policy = "window", .params = { NUM("slack", 1) }, .n_params = 1, .promise = PROMISE_NEWEST },
        { .policy = "streaming", SINKS_RECENT(4, UINT32_MAX) },
        { .policy = "streaming",
          .params = { NUM("sinks", 1), NUM("slack", 3) },
          .n_params = 2,
          SINKS_RECENT(1, UINT32_MAX) },
        { .policy = "h2o", .promise = PROMISE_HALF_RECENT },
        { .policy = "h2o",
          .params = { NUM("recent", 8), NUM("sinks", 2), NUM("per_head", 0) },
          .n_params = 3,
          SINKS_RECENT(2, 8) },
        { .policy = "tova" },
        { .policy = "tova", .params = { NUM("slack", 1), NUM("per_head", 1) }, .n_params = 2 },
        { .policy = "pyramid-taper", .promise = PROMISE_HALF_RECENT },
        { .policy = "pyramid-taper",
          .params = { TEXT("scorer", "ema"), NUM("beta", 4), NUM("sinks", 3) },
          .n_params = 3,
          SINKS_RECENT(3, 0) },
        { .policy = "snapkv", .promise = PROMISE_PROMPT, .recent = 8 },
        { .policy = "snapkv",
          .params = { TEXT("pool", "avg"), NUM("kernel", 4), NUM("window", 2) },
          .n_params = 3,
          .promise = PROMISE_PROMPT,
          .recent = 2 },
        { .policy = "snapkv",
          .params = { NUM("pyramid", 1), NUM("kernel", 1) },
          .n_params = 2,
          .promise = PROMISE_PROMPT,
          .recent = 8 },
        { .policy = "pyramid", .promise = PROMISE_PROMPT, .recent = 8 },
        { .policy = "conf", SINKS_RECENT(4, CONF_PROTECT) },
        { .policy = "conf",
          .params = { TEXT("gate", "fixed") },
          .n_params = 1,
          SINKS_RECENT(4, CONF_PROTECT) },
        { .policy = "conf",
          .params = { TEXT("gate", "naive"), NUM("sinks", 2), NUM("protect", 5) },
          .n_params = 3,
          SINKS_RECENT(2, 5) },
        { .policy = "conf",
          .params = { TEXT("gate", "continuous"), NUM("per_head", 1), TEXT("correction", "sink") },
          .n_params = 3,
          SINKS_RECENT(4, CONF_PROTECT),
          .deltas = true },
        { .policy = "conf",
          .params = { NUM("int8", 1), NUM("fp_window", 8), NUM("tau", 0.5) },
          .n_params = 3,
          SINKS_RECENT(4, CONF_PROTECT) },
        { .policy = "conf",
          .params = { TEXT("gate", "attention") },
          .n_params = 1,
          SINKS_RECENT(4, CONF_PROTECT) },
        { .policy = "conf",
          .params = { TEXT("gate", "attention"), NUM("per_head", 1), NUM("int8", 1), NUM("att_q", 0.2) },
          .n_params = 4,
          SINKS_RECENT(4, CONF_PROTECT) },
        { .policy = "conf-l",
          .params = { TEXT("gate", "attention"), TEXT("correction", "sink") },
          .n_params = 2,
          SINKS_RECENT(4, CONF_PROTECT),
          .deltas = true },
        { .policy = "conf",
          .params = { TEXT("correction", "moment"), NUM("protect", 3) },
          .n_params = 2,
          SINKS_RECENT(4, 3) },
        { .policy = "conf-l", SINKS_RECENT(4, CONF_PROTECT) },
        { .policy = "conf-l",
          .params = { TEXT("gate", "naive"), TEXT("correction", "sink") },
          .n_params = 2,
          SINKS_RECENT(4, CONF_PROTECT),
          .deltas = true },
        { .policy = "scope", .promise = PROMISE_SCOPE },
        { .policy = "scope",
          .params = { TEXT("strategy", "adaptive") },
          .n_params = 1,
          .promise = PROMISE_SCOPE },
        { .policy = "scope",
          .params = { TEXT("strategy", "discontinuous") },
          .n_params = 1,
          .promise = PROMISE_SCOPE },
        { .policy = "scope",
          .params = { TEXT("strategy", "discontinuous"), NUM("delta", 3) },
          .n_params = 2,
          .promise = PROMISE_SCOPE },
        { .policy = "scope",
          .params = { TEXT("prefill", "h2o"), TEXT("pool", "avg") },
          .n_params = 2,
          .promise = PROMISE_SCOPE },
        { .policy = "scope",
          .params = { TEXT("prefill", "full"), TEXT("strategy", "adaptive") },
          .n_params = 2,
          .promise = PROMISE_SCOPE,
          .full_prompt = true },
        { .policy = "prob", SINKS_RECENT(4, 16), .deltas = true },
        { .policy = "prob",
          .params = { NUM("temperature", 0) },
          .n_params = 1,
          SINKS_RECENT(4, 16),
          .deltas = true },
        { .policy = "prob",
          .params = { TEXT("correction", "sink"), NUM("temperature", 0.001) },
          .n_params = 2,
          SINKS_RECENT(4, 16),
          .deltas = true },
        { .policy = "prob", .params = { TEXT("correction", "moment") }, .n_params = 1, SINKS_RECENT(4, 16) },
        { .policy = "prob",
          .params = { TEXT("correction", "none"), TEXT("scorer", "last"), NUM("temperature", 10),
                      NUM("protect", 0) },
          .n_params = 4,
          SINKS_RECENT(4, 0) },
};

struct sim_totals {
        uint64_t runs, refused, plans, deltas;
};

/* kvcd and a client in one: per layer and head the positions and log-weights of the slots. The
 * client's scores are drawn afresh whenever the policy looks (no policy may rely on them). */
struct sim {
        struct policy *p;
        const struct sim_case *c;
        struct policy_limits lim;
        uint32_t L, H, cap, prompt, budget, setup_budget;
        uint32_t *n;
        int32_t *pos; /* [L][H][cap] */
        float *logw;  /* [L][H][cap] */
        struct arrays view;
        uint64_t plans, deltas;
};

static void sim_gather(struct sim *s, uint32_t l) {
        uint32_t n = s->n[l];
        arrays_free(&s->view);
        s->view = arrays_new(s->H, n);
        for (uint32_t h = 0; h < s->H; h++) {
                size_t from = ((size_t)l * s->H + h) * s->cap, to = (size_t)h * n;
                memcpy(s->view.pos + to, s->pos + from, n * sizeof(int32_t));
                memcpy(s->view.logw + to, s->logw + from, n * sizeof(float));
        }
        fill_wild(&s->view);
}

/* The slots [from, to) of set h must all be kept. */
static void sim_expect_kept(const struct sim *s, const struct selection *sel, uint32_t h, uint32_t from,
                            uint32_t to, const char *what, uint64_t appended) {
        for (uint32_t i = from; i < to; i++)
                if (!keeps(sel, h, i))
                        fail_msg("%s (case %s): step %llu: slot %u of [%u, %u) (%s) evicted; n %u, k %u",
                                 s->c->policy, s->p->ops->name, (unsigned long long)appended, i, from, to,
                                 what, sel->n, sel->k);
}

static void sim_check_promise(const struct sim *s, const struct selection *sel, uint64_t appended) {
        uint32_t n = sel->n, k = sel->k, M = s->prompt;
        for (uint32_t h = 0; h < sel->sets; h++) {
                switch (s->c->promise) {
                case PROMISE_NOTHING: break;
                case PROMISE_NEWEST: sim_expect_kept(s, sel, h, n - k, n, "newest", appended); break;
                case PROMISE_SINKS_RECENT: {
                        uint32_t sinks = s->c->sinks < k ? s->c->sinks : k;
                        uint32_t recent = s->c->recent == UINT32_MAX ? k - sinks : s->c->recent;
                        if (recent == CONF_PROTECT) {
                                uint32_t B = s->setup_budget ? s->setup_budget : 128;
                                B = B < s->cap ? B : s->cap;
                                recent = B / 4 < 16 ? B / 4 : 16;
                        }
                        recent = recent < k - sinks ? recent : k - sinks;
                        sim_expect_kept(s, sel, h, 0, sinks, "sinks", appended);
                        sim_expect_kept(s, sel, h, n - recent, n, "recent", appended);
                        break;
                }
                case PROMISE_HALF_RECENT:
                        sim_expect_kept(s, sel, h, n - k / 2, n, "recent half", appended);
                        break;
                case PROMISE_PROMPT: {
                        uint32_t w = s->c->recent < M ? s->c->recent : M;
                        assert_true(M > 0 && appended == M);
                        sim_expect_kept(s, sel, h, M - w, n, "window and what followed", appended);
                        break;
                }
                case PROMISE_SCOPE: {
                        /* defaults: prefill_budget B, alpha2 8, beta2 B / 2 (B: the setup's, or 256) */
                        uint32_t B = s->budget, beta2 = B / 2;
                        uint32_t P = M == 0 ? 0 : s->c->full_prompt || M <= B ? M : B;
                        if (M > 0 && appended == M) { /* the prompt's plan */
                                sim_expect_kept(s, sel, h, M - (8 < M ? 8 : M), n, "alpha2 window", appended);
                                break;
                        }
                        sim_expect_kept(s, sel, h, 0, P, "prompt part", appended);
                        sim_expect_kept(s, sel, h, n - (beta2 < k - P ? beta2 : k - P), n, "beta2", appended);
                        break;
                }
                }
        }
}

/* Compacts layer l to the keep-set and adds the deltas, as the client and kvcd do. */
static void sim_apply(struct sim *s, uint32_t l, const struct selection *sel) {
        for (uint32_t h = 0; h < s->H; h++) {
                const uint32_t *kh = sel->keep + (size_t)(sel->sets > 1 ? h : 0) * sel->k;
                const float *dh = sel->delta + (size_t)(sel->sets > 1 ? h : 0) * sel->k;
                int32_t *pos = s->pos + ((size_t)l * s->H + h) * s->cap;
                float *logw = s->logw + ((size_t)l * s->H + h) * s->cap;
                for (uint32_t i = 0; i < sel->k; i++) { /* ascending: kh[i] >= i */
                        pos[i] = pos[kh[i]];
                        logw[i] = logw[kh[i]] + (sel->r == 1 ? dh[i] : 0.0f);
                }
        }
        s->n[l] = sel->k;
}

/* One session from the first token to the context's end, one token per step. */
static void sim_run(const struct sim_case *c, const struct policy_setup *setup, struct sim_totals *tot) {
        struct sim s = { .c = c,
                         .L = setup->n_layers,
                         .H = setup->n_kv_heads,
                         .cap = setup->max_tokens,
                         .prompt = setup->prompt_tokens,
                         .budget = setup->budget_tokens ? setup->budget_tokens : 256,
                         .setup_budget = setup->budget_tokens };
        char why[160] = "";
        if (policy_new(c->policy, setup, c->params, c->n_params, &s.p, why, sizeof(why)) < 0) {
                tot->refused++;
                return;
        }
        s.lim = limits_of(s.p);
        uint32_t room =
                s.lim.max_layer_tokens < setup->max_tokens ? s.lim.max_layer_tokens : setup->max_tokens;
        s.n = calloc(s.L, sizeof(uint32_t));
        s.pos = calloc((size_t)s.L * s.H * s.cap, sizeof(int32_t));
        s.logw = calloc((size_t)s.L * s.H * s.cap, sizeof(float));
        uint32_t *lens = calloc(s.L, sizeof(uint32_t));
        struct policy_target *t = calloc(s.L + 1, sizeof(*t));
        assert_true(s.n && s.pos && s.logw && lens && t);

        for (uint64_t appended = 1; appended <= setup->max_tokens; appended++) {
                for (uint32_t l = 0; l < s.L; l++) {
                        if (s.n[l] + 1 > room)
                                fail_msg("%s: step %llu: layer %u holds %u, and max_layer_tokens is %u",
                                         c->policy, (unsigned long long)appended, l, s.n[l],
                                         s.lim.max_layer_tokens);
                        for (uint32_t h = 0; h < s.H; h++)
                                s.pos[((size_t)l * s.H + h) * s.cap + s.n[l]] = (int32_t)appended - 1;
                        lens[l] = ++s.n[l];
                }
                float entropy = (float)rng_below(1001) / 1000, top1 = (float)rng_below(1001) / 1000;
                float margin = rng_below(4) ? (float)rng_below(2000) / 100 : 0.0f;
                struct policy_step st = { .step = appended + 7,
                                          .prefill = appended <= s.prompt,
                                          .entropy = entropy,
                                          .top1_prob = top1,
                                          .margin = margin,
                                          .confidence =
                                                  policy_confidence(s.p->conf_weights, entropy, top1, margin),
                                          .appended = appended,
                                          .layer_tokens = lens };
                if (s.p->ops->observes && s.p->ops->observes(s.p->state, &st)) {
                        for (uint32_t l = 0; l < s.L; l++) {
                                sim_gather(&s, l);
                                struct policy_layer view = view_of(&s.view, l);
                                uint32_t *scratch = malloc((4 * (size_t)s.H * s.n[l] + 1) * sizeof(uint32_t));
                                assert_non_null(scratch);
                                s.p->ops->observe(s.p->state, &st, &view, scratch);
                                free(scratch);
                        }
                }
                decide_into(s.p, &st, t);
                for (uint32_t l = 0; l < s.L; l++) {
                        uint32_t k = t[l].keep;
                        if (k == POLICY_NO_PLAN)
                                continue;
                        if (k >= s.n[l] || k > s.lim.max_keep || t[l].low > k || (t[l].low && !s.lim.lower))
                                fail_msg("%s: step %llu: layer %u of %u tokens: target %u (q8 %u), max_keep "
                                         "%u",
                                         c->policy, (unsigned long long)appended, l, s.n[l], k, t[l].low,
                                         s.lim.max_keep);
                        struct policy_target tl = t[l];
                        if (s.lim.summarize && !s.lim.per_head && !s.lim.lower && k >= 2)
                                tl.keep = k - 1; /* kvcd keeps a slot for the summary */
                        sim_gather(&s, l);
                        struct policy_layer view = view_of(&s.view, l);
                        struct selection sel = select_layer(s.p, &st, &view, tl);
                        if (sel.r < 0)
                                fail_msg("%s: step %llu: layer %u: no keep-set (%d) for target %u of %u",
                                         c->policy, (unsigned long long)appended, l, sel.r, k, s.n[l]);
                        sim_check_promise(&s, &sel, appended);
                        sim_apply(&s, l, &sel);
                        s.plans++;
                        s.deltas += sel.r == 1;
                        selection_free(&sel);
                }
        }
        tot->runs++;
        tot->plans += s.plans;
        tot->deltas += s.deltas;
        arrays_free(&s.view);
        free(s.n);
        free(s.pos);
        free(s.logw);
        free(lens);
        free(t);
        policy_free(s.p);
}

static void every_policy_keeps_valid_sets_within_its_limits_on_wild_scores(void **state) {
        (void)state;
        rng_state = 0xa11;
        for (size_t ci = 0; ci < N_OF(sim_cases); ci++) {
                const struct sim_case *c = &sim_cases[ci];
                struct sim_totals tot = { 0 };
                for (int run = 0; run < 6; run++) {
                        static const uint32_t blocks[] = { 1, 4, 16 };
                        uint32_t max_tokens = 96 + rng_below(400);
                        struct policy_setup s = setup_of(1 + rng_below(4), 1 + rng_below(3), max_tokens,
                                                         blocks[rng_below(3)], 48 + rng_below(120), 0);
                        if (run % 3 != 0)
                                s.prompt_tokens = 1 + rng_below(max_tokens - 1);
                        if (run == 5)
                                s.budget_tokens = 0; /* the policy's default */
                        s.session_id = rng_next();
                        sim_run(c, &s, &tot);
                }
                bool planned = strcmp(c->policy, "full") != 0;
                if (tot.runs < 4 || (tot.plans > 0) != planned || (tot.deltas > 0) != c->deltas)
                        fail_msg("case %zu (%s): %llu runs (%llu refused), %llu plans, %llu with deltas", ci,
                                 c->policy, (unsigned long long)tot.runs, (unsigned long long)tot.refused,
                                 (unsigned long long)tot.plans, (unsigned long long)tot.deltas);
        }
}

int main(void) {
        const struct CMUnitTest tests[] = {
                cmocka_unit_test(select_topk_matches_sort_oracle_on_random_scores),
                cmocka_unit_test(select_topk_handles_the_edges_of_k_and_n),
                cmocka_unit_test(select_topk_ranks_nan_as_minus_inf_and_ties_to_the_larger_index),
                cmocka_unit_test(select_topk_handles_adversarial_orders),
                cmocka_unit_test(keep_ranked_keeps_sinks_recent_and_the_best_between),
                cmocka_unit_test(keep_ranked_shrinks_recent_then_sinks_when_k_is_small),
                cmocka_unit_test(mean_over_heads_averages_each_slot),
                cmocka_unit_test(pyramid_budget_matches_the_hand_computed_schedule),
                cmocka_unit_test(pyramid_budget_averages_to_the_budget),
                cmocka_unit_test(confidence_matches_hand_computed_values),
                cmocka_unit_test(confidence_uses_the_given_weights),
                cmocka_unit_test(policy_names_lists_every_policy_once),
                cmocka_unit_test(pyramid_is_published_pyramidkv_with_a_window_in_every_layer),
                cmocka_unit_test(policy_new_rejects_unknown_names),
                cmocka_unit_test(policy_new_rejects_more_than_the_most_parameters),
                cmocka_unit_test(policy_new_checks_ema_gamma),
                cmocka_unit_test(policy_new_reads_the_confidence_weights),
                cmocka_unit_test(policy_param_number_finds_numbers_only),
                cmocka_unit_test(every_policy_refuses_unknown_keys_wrong_kinds_and_out_of_range_values),
                cmocka_unit_test(every_policy_refuses_inconsistent_combinations),
                cmocka_unit_test(full_keeps_everything_and_never_plans),
                cmocka_unit_test(window_states_its_limits),
                cmocka_unit_test(window_plans_only_at_budget_plus_slack),
                cmocka_unit_test(window_keeps_the_most_recent_positions),
                cmocka_unit_test(policies_read_only_the_arrays_they_declare),
                cmocka_unit_test(streaming_keeps_its_sinks_and_the_newest_tokens),
                cmocka_unit_test(h2o_keeps_each_heads_heavy_hitter_and_the_recent_half),
                cmocka_unit_test(tova_keeps_the_top_by_last_attention_averaged_over_heads),
                cmocka_unit_test(tova_with_slack_one_drops_one_token_per_step),
                cmocka_unit_test(pyramid_taper_budgets_follow_the_schedule_per_layer),
                cmocka_unit_test(snapkv_observes_exactly_the_last_window_prompt_steps),
                cmocka_unit_test(snapkv_keeps_the_window_and_the_pooled_spikes),
                cmocka_unit_test(snapkv_plans_once_when_the_prompt_is_complete),
                cmocka_unit_test(snapkv_keeps_what_followed_a_late_prompt_plan),
                cmocka_unit_test(snapkv_without_a_prompt_length_never_plans),
                cmocka_unit_test(snapkv_pyramid_spreads_the_selected_part_and_keeps_every_window),
                cmocka_unit_test(scope_prefill_plan_keeps_alpha1_plus_alpha2),
                cmocka_unit_test(scope_limits_let_the_whole_prompt_in),
                cmocka_unit_test(scope_decode_budgets_at_given_steps),
                cmocka_unit_test(scope_plans_when_the_decoded_part_outgrows_its_budget),
                cmocka_unit_test(scope_decode_plans_never_touch_the_prompt_part),
                cmocka_unit_test(scope_without_a_prompt_length_treats_everything_as_decode),
                cmocka_unit_test(conf_budgets_at_given_confidences_for_each_gate),
                cmocka_unit_test(conf_int8_marks_all_but_the_fp_window),
                cmocka_unit_test(conf_l_spreads_every_level_over_the_layers),
                cmocka_unit_test(conf_ranks_by_ema_attention_and_recency_per_their_weights),
                cmocka_unit_test(conf_always_keeps_the_sinks_and_the_protected_window),
                cmocka_unit_test(conf_sink_correction_gives_the_evicted_mass_to_the_first_sink),
                cmocka_unit_test(conf_refuses_a_budget_above_n_low_when_deferring),
                cmocka_unit_test(conf_attention_gate_defers_when_a_cut_would_evict_attention),
                cmocka_unit_test(prob_inclusion_probabilities_sum_to_m_and_lie_in_zero_one),
                cmocka_unit_test(prob_at_temperature_zero_equals_keep_ranked_on_1000_random_cases),
                cmocka_unit_test(prob_log_weights_are_minus_log_of_the_inclusion_probabilities),
                cmocka_unit_test(prob_inclusion_frequencies_match_pi_within_five_sigma),
                cmocka_unit_test(prob_same_seed_gives_the_same_keep_sets_and_another_seed_others),
                cmocka_unit_test(prob_sink_correction_writes_only_the_first_slot),
                cmocka_unit_test(prob_without_correction_writes_no_deltas),
                cmocka_unit_test(prob_plans_at_budget_plus_slack),
                cmocka_unit_test(moment_correction_asks_kvcd_for_a_summary_and_writes_no_deltas),
                cmocka_unit_test(every_policy_keeps_valid_sets_within_its_limits_on_wild_scores),
        };
        return cmocka_run_group_tests(tests, NULL, NULL);
}
