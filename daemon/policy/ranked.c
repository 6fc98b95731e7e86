/* ranked.c: policies that keep the recent tokens and the best of the rest by one attention score.
 *
 *   h2o      Heavy-Hitter Oracle (Zhang et al., arXiv 2306.14048): the `recent` newest tokens and
 *            the top (B - recent) by accumulated attention (the score array `sum`), per KV head
 *            as in the reference code (hh_score is heads x tokens). recent defaults to B / 2, the
 *            paper's equal heavy and recent ratios.
 *   tova     Token Omission Via Attention (Oren et al., arXiv 2401.06104): the top B by the
 *            current query's attention averaged over heads (`last`), one keep-set per layer, no
 *            protected tokens. The reference drops one token per step; `slack=1` does exactly
 *            that, the default drops a block's worth at once.
 *   pyramid-taper  PyramidKV's per-layer budgets applied at decode time (not the published
 *            method: that is `pyramid`, in snapkv.c): layer l keeps max - l (max - min) / (L - 1)
 *            tokens, min = B / beta, max = 2B - min, beta = 20, so the layers average B; around any
 *            scorer (sum, ema, last), with recent_frac of each layer's budget protected as the
 *            newest tokens. Its last layer keeps B / 20 tokens (3 of 64) and no recent window of
 *            its own: a variant to measure, under its own name so that no table calls it PyramidKV.
 */
#include <errno.h>
#include <stdio.h>
#include <string.h>

#include "policy.h"

enum scorer {
        SCORER_SUM,
        SCORER_EMA,
        SCORER_LAST,
};

static const char *const scorer_words[] = { "sum", "ema", "last", NULL };

struct ranked {
        uint32_t budget;
        uint32_t slack;
        uint32_t sinks;
        uint32_t recent; /* tokens; 0: recent_frac of the layer's budget */
        float recent_frac;
        bool per_head;
        uint32_t scorer;
        bool pyramid;
        float beta;
        uint32_t n_layers;
        uint32_t n_kv_heads;
};

static const struct policy_param_spec ranked_specs[] = {
        { "slack", POLICY_PARAM_U32, offsetof(struct ranked, slack), 1, 1 << 20, NULL },
        { "sinks", POLICY_PARAM_U32, offsetof(struct ranked, sinks), 0, 1 << 20, NULL },
        { "recent", POLICY_PARAM_U32, offsetof(struct ranked, recent), 0, 1 << 20, NULL },
        { "recent_frac", POLICY_PARAM_FLOAT, offsetof(struct ranked, recent_frac), 0, 1, NULL },
        { "per_head", POLICY_PARAM_BOOL, offsetof(struct ranked, per_head), 0, 1, NULL },
        { "scorer", POLICY_PARAM_ENUM, offsetof(struct ranked, scorer), 0, 0, scorer_words },
        { "beta", POLICY_PARAM_FLOAT, offsetof(struct ranked, beta), 1.0001, 1e6, NULL },
};

#define DEFAULT_BUDGET 256u

static size_t ranked_bytes(const struct policy_setup *s) {
        (void)s;
        return sizeof(struct ranked);
}

static int ranked_init(struct ranked *r, const struct policy_setup *s, const struct policy_param *params,
                       size_t n, char *why, size_t why_len) {
        r->budget = s->budget_tokens ? s->budget_tokens : DEFAULT_BUDGET;
        if (r->budget > s->max_tokens)
                r->budget = s->max_tokens;
        r->slack = s->block_tokens;
        r->beta = 20.0f;
        r->n_layers = s->n_layers;
        r->n_kv_heads = s->n_kv_heads;
        int e = policy_parse_params(r, ranked_specs, sizeof(ranked_specs) / sizeof(ranked_specs[0]), params,
                                    n, why, why_len);
        if (e == 0 && r->sinks + r->recent > r->budget) {
                snprintf(why, why_len, "sinks + recent (%u) exceed the budget %u", r->sinks + r->recent,
                         r->budget);
                e = -EINVAL;
        }
        return e;
}

static uint32_t layer_budget(const struct ranked *r, uint32_t l) {
        return r->pyramid ? policy_pyramid_budget(r->budget, l, r->n_layers, r->beta) : r->budget;
}

static void ranked_limits(const void *state, struct policy_limits *ret) {
        const struct ranked *r = state;
        uint32_t most = 0;
        for (uint32_t l = 0; l < r->n_layers; l++)
                if (layer_budget(r, l) > most)
                        most = layer_budget(r, l);
        *ret = (struct policy_limits){ .budget = r->budget,
                                       .max_layer_tokens = most + r->slack,
                                       .max_keep = most,
                                       .per_head = r->per_head };
}

static void ranked_decide(void *state, const struct policy_step *step, struct policy_target *t) {
        const struct ranked *r = state;
        for (uint32_t l = 0; l < r->n_layers; l++) {
                uint32_t b = layer_budget(r, l);
                if (step->layer_tokens[l] >= b + r->slack)
                        t[l].keep = b;
        }
}

static const float *scores_of(const struct ranked *r, const struct policy_layer *L) {
        switch ((enum scorer)r->scorer) {
        case SCORER_EMA: return L->ema;
        case SCORER_LAST: return L->last;
        case SCORER_SUM: break;
        }
        return L->sum;
}

static int ranked_select(void *state, const struct policy_step *step, const struct policy_layer *L,
                         const struct policy_target *t, uint32_t *keep, float *logw, void *scratch) {
        const struct ranked *r = state;
        (void)step, (void)logw;
        uint32_t n = L->n_tokens, k = t->keep;
        uint32_t recent = r->recent ? r->recent : (uint32_t)(r->recent_frac * (float)k);
        const float *src = scores_of(r, L);
        float *score = scratch;
        uint32_t *work = (uint32_t *)scratch + n;
        if (!r->per_head) {
                policy_mean_over_heads(src, L->n_kv_heads, n, score);
                policy_keep_ranked(score, n, k, r->sinks, recent, keep, work);
                return 0;
        }
        for (uint32_t h = 0; h < L->n_kv_heads; h++) {
                memcpy(score, src + (size_t)h * n, n * sizeof(float));
                policy_keep_ranked(score, n, k, r->sinks, recent, keep + (size_t)h * k, work);
        }
        return 0;
}

static int h2o_init(void *state, const struct policy_setup *s, const struct policy_param *params, size_t n,
                    char *why, size_t why_len) {
        struct ranked *r = state;
        r->scorer = SCORER_SUM;
        r->per_head = true;
        r->recent_frac = 0.5f;
        return ranked_init(r, s, params, n, why, why_len);
}

static int tova_init(void *state, const struct policy_setup *s, const struct policy_param *params, size_t n,
                     char *why, size_t why_len) {
        struct ranked *r = state;
        r->scorer = SCORER_LAST;
        return ranked_init(r, s, params, n, why, why_len);
}

static int pyramid_init(void *state, const struct policy_setup *s, const struct policy_param *params,
                        size_t n, char *why, size_t why_len) {
        struct ranked *r = state;
        r->scorer = SCORER_SUM;
        r->per_head = true;
        r->recent_frac = 0.5f;
        r->pyramid = true;
        return ranked_init(r, s, params, n, why, why_len);
}

const struct policy_ops policy_h2o_ops = {
        .name = "h2o",
        .state_bytes = ranked_bytes,
        .init = h2o_init,
        .limits = ranked_limits,
        .decide = ranked_decide,
        .select = ranked_select,
};

const struct policy_ops policy_tova_ops = {
        .name = "tova",
        .state_bytes = ranked_bytes,
        .init = tova_init,
        .limits = ranked_limits,
        .decide = ranked_decide,
        .select = ranked_select,
};

const struct policy_ops policy_pyramid_taper_ops = {
        .name = "pyramid-taper",
        .state_bytes = ranked_bytes,
        .init = pyramid_init,
        .limits = ranked_limits,
        .decide = ranked_decide,
        .select = ranked_select,
};
