/* basic.c: the policies without a score.
 *
 *   full       keeps everything: the quality reference, and a session kvcd only accounts.
 *   window     keeps the budget B most recent tokens (by their original positions).
 *   streaming  StreamingLLM: the first `sinks` tokens (attention sinks) and the B - sinks most
 *              recent (Xiao et al., arXiv 2309.17453, §3; kvpress StreamingLLMPress n_sink = 4).
 *
 * Hysteresis: a plan is due when a layer reaches B + slack tokens (slack defaults to one block),
 * so plans come once per block of decoding rather than every step, and the cache never holds
 * more than one block beyond its budget.
 */
#include <errno.h>
#include <stdio.h>
#include <string.h>

#include "policy.h"

struct budgeted {
        uint32_t budget;
        uint32_t slack;
        uint32_t sinks;
        uint32_t n_layers;
        uint32_t max_tokens;
};

static size_t budgeted_bytes(const struct policy_setup *s) {
        (void)s;
        return sizeof(struct budgeted);
}

static const struct policy_param_spec budgeted_specs[] = {
        { "slack", POLICY_PARAM_U32, offsetof(struct budgeted, slack), 1, 1 << 20, NULL },
        { "sinks", POLICY_PARAM_U32, offsetof(struct budgeted, sinks), 0, 1 << 20, NULL },
};

#define DEFAULT_BUDGET 256u
#define DEFAULT_SINKS  4u

static int budgeted_init(void *state, const struct policy_setup *s, const struct policy_param *params,
                         size_t n, char *why, size_t why_len, size_t n_specs) {
        struct budgeted *b = state;
        b->budget = s->budget_tokens ? s->budget_tokens : DEFAULT_BUDGET;
        if (b->budget > s->max_tokens)
                b->budget = s->max_tokens;
        b->slack = s->block_tokens;
        b->n_layers = s->n_layers;
        b->max_tokens = s->max_tokens;
        int r = policy_parse_params(b, budgeted_specs, n_specs, params, n, why, why_len);
        if (r == 0 && b->sinks >= b->budget) {
                snprintf(why, why_len, "%u sinks leave no room in a budget of %u", b->sinks, b->budget);
                r = -EINVAL;
        }
        return r;
}

static void budgeted_limits(const void *state, struct policy_limits *ret) {
        const struct budgeted *b = state;
        *ret = (struct policy_limits){ .budget = b->budget,
                                       .max_layer_tokens = b->budget + b->slack,
                                       .max_keep = b->budget };
}

static void budgeted_decide(void *state, const struct policy_step *step, struct policy_target *t) {
        const struct budgeted *b = state;
        for (uint32_t l = 0; l < b->n_layers; l++)
                if (step->layer_tokens[l] >= b->budget + b->slack)
                        t[l].keep = b->budget;
}

/* ---- full ---- */

static int full_init(void *state, const struct policy_setup *s, const struct policy_param *params, size_t n,
                     char *why, size_t why_len) {
        struct budgeted *b = state;
        b->budget = s->max_tokens;
        b->max_tokens = s->max_tokens;
        if (n == 0)
                return 0;
        snprintf(why, why_len, "unknown parameter '%s' (full takes none)", params[0].key);
        return -EINVAL;
}

static void full_limits(const void *state, struct policy_limits *ret) {
        const struct budgeted *b = state;
        *ret = (struct policy_limits){ .budget = b->max_tokens, .max_layer_tokens = b->max_tokens };
}

static void full_decide(void *state, const struct policy_step *step, struct policy_target *t) {
        (void)state, (void)step, (void)t; /* never plans */
}

static int never_selects(void *state, const struct policy_step *step, const struct policy_layer *layer,
                         const struct policy_target *t, uint32_t *keep, float *logw, void *scratch) {
        (void)state, (void)step, (void)layer, (void)t, (void)keep, (void)logw, (void)scratch;
        return -EINVAL;
}

const struct policy_ops policy_full_ops = {
        .name = "full",
        .state_bytes = budgeted_bytes,
        .init = full_init,
        .limits = full_limits,
        .decide = full_decide,
        .select = never_selects,
};

/* ---- window ---- */

static int window_init(void *state, const struct policy_setup *s, const struct policy_param *params, size_t n,
                       char *why, size_t why_len) {
        return budgeted_init(state, s, params, n, why, why_len, 1); /* slack only */
}

static int window_select(void *state, const struct policy_step *step, const struct policy_layer *layer,
                         const struct policy_target *t, uint32_t *keep, float *logw, void *scratch) {
        (void)state, (void)step, (void)logw;
        /* the most recent by original position; all heads hold the same tokens (per-layer plans),
         * so head 0's positions speak for the layer. Slots are in position order when clients
         * behave (appends go at the end, compaction keeps the order): then the last slots are the
         * answer, found in one pass; anything else gets the selection. */
        uint32_t n = layer->n_tokens;
        bool ordered = true;
        for (uint32_t i = 1; i < n && ordered; i++)
                ordered = layer->pos[i - 1] < layer->pos[i];
        if (ordered) {
                for (uint32_t i = 0; i < t->keep; i++)
                        keep[i] = n - t->keep + i;
                return 0;
        }
        float *score = scratch;
        uint32_t *work = (uint32_t *)scratch + n;
        for (uint32_t i = 0; i < n; i++)
                score[i] = (float)layer->pos[i];
        select_topk(score, n, t->keep, keep, work);
        return 0;
}

const struct policy_ops policy_window_ops = {
        .name = "window",
        .reads = POLICY_READS_POS,
        .state_bytes = budgeted_bytes,
        .init = window_init,
        .limits = budgeted_limits,
        .decide = budgeted_decide,
        .select = window_select,
};

/* ---- streaming ---- */

static int streaming_init(void *state, const struct policy_setup *s, const struct policy_param *params,
                          size_t n, char *why, size_t why_len) {
        struct budgeted *b = state;
        b->sinks = DEFAULT_SINKS;
        return budgeted_init(state, s, params, n, why, why_len, 2);
}

static int streaming_select(void *state, const struct policy_step *step, const struct policy_layer *layer,
                            const struct policy_target *t, uint32_t *keep, float *logw, void *scratch) {
        const struct budgeted *b = state;
        (void)step, (void)logw;
        float *score = scratch;
        uint32_t *work = (uint32_t *)scratch + layer->n_tokens;
        for (uint32_t i = 0; i < layer->n_tokens; i++)
                score[i] = 0.0f;
        policy_keep_ranked(score, layer->n_tokens, t->keep, b->sinks, t->keep - b->sinks, keep, work);
        return 0;
}

const struct policy_ops policy_streaming_ops = {
        .name = "streaming",
        .reads = POLICY_READS_POS, /* none, in fact: the least that can be said */
        .state_bytes = budgeted_bytes,
        .init = streaming_init,
        .limits = budgeted_limits,
        .decide = budgeted_decide,
        .select = streaming_select,
};
