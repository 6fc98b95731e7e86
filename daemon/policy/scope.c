/* scope.c: SCOPE (Wu et al., arXiv 2412.13649, ACL 2025; reference Linking-ai/SCOPE
 * model/kv_utils.py): the prompt and the decoded tokens are compressed separately.
 *
 * Prefill: when the prompt is complete, each layer and KV head keeps alpha1 slots chosen by the
 * prefill scorer (SnapKV's pooled window attention by default, or H2O's summed attention, or
 * everything) plus the alpha2 newest prompt tokens. These P = alpha1 + alpha2 slots are never
 * touched again.
 *
 * Decode: the decoded tokens get a budget of beta1 + beta2: the beta2 newest always, and beta1
 * chosen by the current query's attention (the `last` score: SCOPE selects with the single
 * current query, nothing accumulated). Strategies:
 *   slide          re-select whenever the decode part exceeds beta1 + beta2 (+ slack);
 *   adaptive       the decode budget grows as beta2 + floor(t / delta) up to beta1 + beta2,
 *                  t = decode steps so far (SCOPE's counters, owned here by the session);
 *   discontinuous  the same growing budget, re-selected only every delta steps.
 * delta defaults to (context - prompt - beta2) / beta1, SCOPE's choice, so the budget reaches
 * beta1 + beta2 when the context is full. Without a prompt length the whole sequence is decode.
 */
#include <errno.h>
#include <stdio.h>
#include <string.h>

#include "prefill.h"

enum strategy {
        STRATEGY_SLIDE,
        STRATEGY_ADAPTIVE,
        STRATEGY_DISCONTINUOUS,
};

static const char *const strategy_words[] = { "slide", "adaptive", "discontinuous", NULL };

struct scope {
        uint32_t prefill_budget; /* alpha1 + alpha2 */
        uint32_t alpha2;
        uint32_t budget; /* beta1 + beta2 */
        uint32_t beta2;
        uint32_t strategy;
        uint32_t delta;
        uint32_t prefill;
        uint32_t kernel;
        uint32_t pool;
        uint32_t slack;
        uint32_t n_layers;
        uint32_t max_tokens;
        bool prefill_done;
        bool prompt_plan;     /* the plan decided this step is the prompt's */
        uint64_t next_due;    /* discontinuous: the decode step of the next re-selection */
        uint32_t kept_prompt; /* P */
        struct prefill_obs obs;
};

static const struct policy_param_spec scope_specs[] = {
        { "prefill_budget", POLICY_PARAM_U32, offsetof(struct scope, prefill_budget), 1, 1 << 20, NULL },
        { "alpha2", POLICY_PARAM_U32, offsetof(struct scope, alpha2), 0, 1 << 20, NULL },
        { "beta2", POLICY_PARAM_U32, offsetof(struct scope, beta2), 0, 1 << 20, NULL },
        { "strategy", POLICY_PARAM_ENUM, offsetof(struct scope, strategy), 0, 0, strategy_words },
        { "delta", POLICY_PARAM_U32, offsetof(struct scope, delta), 1, 1 << 20, NULL },
        { "prefill", POLICY_PARAM_ENUM, offsetof(struct scope, prefill), 0, 0, prefill_scorer_words },
        { "kernel", POLICY_PARAM_U32, offsetof(struct scope, kernel), 1, 255, NULL },
        { "pool", POLICY_PARAM_ENUM, offsetof(struct scope, pool), 0, 0, prefill_pool_words },
        { "slack", POLICY_PARAM_U32, offsetof(struct scope, slack), 1, 1 << 20, NULL },
};

static size_t scope_bytes(const struct policy_setup *s) {
        return sizeof(struct scope) + prefill_obs_bytes(s);
}

static uint32_t beta1(const struct scope *c) {
        return c->budget - c->beta2;
}

static int scope_init(void *state, const struct policy_setup *s, const struct policy_param *params, size_t n,
                      char *why, size_t why_len) {
        struct scope *c = state;
        c->budget = s->budget_tokens ? s->budget_tokens : 256;
        c->prefill_budget = c->budget;
        c->alpha2 = 8;
        c->beta2 = c->budget / 2;
        c->kernel = 7;
        c->slack = s->block_tokens;
        c->n_layers = s->n_layers;
        c->max_tokens = s->max_tokens;
        int r = policy_parse_params(c, scope_specs, sizeof(scope_specs) / sizeof(scope_specs[0]), params, n,
                                    why, why_len);
        if (r < 0)
                return r;
        if (c->beta2 >= c->budget || c->alpha2 > c->prefill_budget) {
                snprintf(why, why_len, "need beta2 < budget and alpha2 <= prefill_budget");
                return -EINVAL;
        }
        if (!c->delta) {
                uint32_t room = s->max_tokens > s->prompt_tokens + c->beta2
                                        ? s->max_tokens - s->prompt_tokens - c->beta2
                                        : 1;
                c->delta = room / beta1(c) ? room / beta1(c) : 1;
        }
        c->next_due = c->delta;
        prefill_obs_init(&c->obs, s, c->alpha2, (float *)(c + 1));
        c->prefill_done = s->prompt_tokens == 0;
        return 0;
}

static void scope_limits(const void *state, struct policy_limits *ret) {
        const struct scope *c = state;
        uint32_t prompt = c->obs.prompt < c->prefill_budget || c->prefill == PREFILL_FULL ? c->obs.prompt
                                                                                          : c->prefill_budget;
        uint32_t grow = c->strategy == STRATEGY_DISCONTINUOUS ? c->delta : c->slack;
        uint32_t most = prompt + c->budget + (grow > c->slack ? grow : c->slack);
        /* The prompt's own plan keeps the kept prompt and what followed the prompt: at most `most`
         * (the layer holds at most max(M, most) tokens, and the plan fires once M are in), so the
         * keep-set (the plan buffer, one chunk) does not grow with the prompt; only the layer must
         * take the whole prompt before its plan. */
        *ret = (struct policy_limits){
                .budget = prompt + c->budget, .max_layer_tokens = most, .max_keep = most, .per_head = true
        };
        if (c->obs.prompt > ret->max_layer_tokens)
                ret->max_layer_tokens = c->obs.prompt;
}

static bool scope_observes(const void *state, const struct policy_step *step) {
        const struct scope *c = state;
        return !c->prefill_done && c->prefill == PREFILL_SNAPKV && prefill_obs_wants(&c->obs, step);
}

static void scope_observe(void *state, const struct policy_step *step, const struct policy_layer *L,
                          void *scratch) {
        (void)step, (void)scratch;
        prefill_obs_add(&((struct scope *)state)->obs, L);
}

/* The decode budget after t decode steps. */
static uint32_t decode_budget(const struct scope *c, uint64_t t) {
        if (c->strategy == STRATEGY_SLIDE)
                return c->budget;
        uint64_t b = c->beta2 + t / c->delta;
        return b < c->budget ? (uint32_t)b : c->budget;
}

static void scope_decide(void *state, const struct policy_step *step, struct policy_target *tg) {
        struct scope *c = state;
        uint32_t m = c->obs.prompt;
        c->prompt_plan = false;
        if (!c->prefill_done) {
                if (step->appended < m)
                        return;
                c->prefill_done = true;
                c->prompt_plan = true;
                c->kept_prompt = c->prefill == PREFILL_FULL || m <= c->prefill_budget ? m : c->prefill_budget;
                if (c->kept_prompt == m)
                        return;
                for (uint32_t l = 0; l < c->n_layers; l++) {
                        uint32_t n = step->layer_tokens[l];
                        tg[l].keep = c->kept_prompt + (n > m ? n - m : 0);
                }
                return;
        }
        uint64_t t = step->appended > m ? step->appended - m : 0;
        uint32_t d_budget = decode_budget(c, t);
        for (uint32_t l = 0; l < c->n_layers; l++) {
                uint32_t n = step->layer_tokens[l], d = n > c->kept_prompt ? n - c->kept_prompt : 0;
                /* discontinuous re-selects at the first step at or after each multiple of delta that
                 * kvcd consults the policy (a step with a plan pending is not consulted) */
                bool due = c->strategy == STRATEGY_DISCONTINUOUS ? (t >= c->next_due && d > d_budget)
                                                                 : d >= d_budget + c->slack;
                if (due)
                        tg[l].keep = c->kept_prompt + d_budget;
        }
        if (c->strategy == STRATEGY_DISCONTINUOUS && t >= c->next_due)
                c->next_due = (t / c->delta + 1) * c->delta;
}

static int scope_select(void *state, const struct policy_step *step, const struct policy_layer *L,
                        const struct policy_target *t, uint32_t *keep, float *logw, void *scratch) {
        const struct scope *c = state;
        (void)step, (void)logw;
        uint32_t n = L->n_tokens, m = c->obs.prompt, p = c->kept_prompt;
        float *score = scratch;
        uint32_t *work = (uint32_t *)scratch + n;
        for (uint32_t h = 0; h < L->n_kv_heads; h++) {
                uint32_t *kh = keep + (size_t)h * t->keep;
                if (c->prompt_plan) {
                        /* the prompt's plan: its keep-set, then whatever followed the prompt */
                        uint32_t got = prefill_keep(&c->obs, (enum prefill_scorer)c->prefill, c->kernel,
                                                    c->pool == 0, L, h, p - (c->alpha2 < m ? c->alpha2 : m),
                                                    c->alpha2, kh, scratch);
                        for (uint32_t i = m; i < n; i++)
                                kh[got++] = i;
                        if (got != t->keep)
                                return -EINVAL;
                        continue;
                }
                /* a decode plan: the prompt part, the best of the decoded, the newest beta2 */
                uint32_t d_keep = t->keep - p;
                uint32_t recent = c->beta2 < d_keep ? c->beta2 : d_keep;
                memcpy(score, L->last + (size_t)h * n + p, (n - p) * sizeof(float));
                policy_keep_ranked(score, n - p, d_keep, 0, recent, kh + p, work);
                for (uint32_t i = 0; i < p; i++)
                        kh[i] = i;
                for (uint32_t i = p; i < t->keep; i++)
                        kh[i] += p;
        }
        return 0;
}

const struct policy_ops policy_scope_ops = {
        .name = "scope",
        .state_bytes = scope_bytes,
        .init = scope_init,
        .limits = scope_limits,
        .observes = scope_observes,
        .observe = scope_observe,
        .decide = scope_decide,
        .select = scope_select,
};
