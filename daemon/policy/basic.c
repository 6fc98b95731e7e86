/* basic.c: the reference policies.
 *
 *   full    keeps everything: the quality reference, and a session kvcd only accounts.
 *   window  keeps the budget B most recent tokens (by their original positions). A plan is due
 *           when a layer reaches B + block_tokens tokens, so plans come once per block of
 *           decoding rather than every step and the cache holds at most one block more than B.
 */
#include <errno.h>
#include <stdio.h>
#include <string.h>

#include "policy.h"

/* Rejects any parameter: these policies take none (beyond the budget). */
static int no_params(const struct policy_param *params, size_t n, char *why, size_t why_len) {
        if (n == 0)
                return 0;
        snprintf(why, why_len, "unknown parameter '%s'", params[0].key);
        return -EINVAL;
}

struct full_state {
        uint32_t max_tokens;
};

static int full_init(void *state, const struct policy_setup *s, const struct policy_param *params, size_t n,
                     char *why, size_t why_len) {
        struct full_state *st = state;
        st->max_tokens = s->max_tokens;
        return no_params(params, n, why, why_len);
}

static void full_limits(const void *state, uint32_t layer, uint32_t *budget, uint32_t *max_layer,
                        uint32_t *max_keep, bool *per_head) {
        const struct full_state *st = state;
        (void)layer;
        *budget = st->max_tokens;
        *max_layer = st->max_tokens;
        *max_keep = 0;
        *per_head = false;
}

static void full_decide(void *state, const struct policy_step *step, uint32_t *targets) {
        (void)state;
        (void)step;
        (void)targets; /* kvcd initializes targets to POLICY_NO_PLAN */
}

static int full_select(void *state, const struct policy_layer *layer, uint32_t target, uint32_t *keep,
                       void *scratch) {
        (void)state, (void)layer, (void)target, (void)keep, (void)scratch;
        return -EINVAL; /* never asked: decide plans nothing */
}

const struct policy_ops policy_full_ops = {
        .name = "full",
        .state_bytes = sizeof(struct full_state),
        .init = full_init,
        .limits = full_limits,
        .decide = full_decide,
        .select = full_select,
};

struct window_state {
        uint32_t budget;
        uint32_t slack;
        uint32_t n_layers;
};

#define WINDOW_DEFAULT_BUDGET 256u

static int window_init(void *state, const struct policy_setup *s, const struct policy_param *params, size_t n,
                       char *why, size_t why_len) {
        struct window_state *st = state;
        st->budget = s->budget_tokens ? s->budget_tokens : WINDOW_DEFAULT_BUDGET;
        st->slack = s->block_tokens;
        st->n_layers = s->n_layers;
        if (st->budget > s->max_tokens)
                st->budget = s->max_tokens;
        return no_params(params, n, why, why_len);
}

static void window_limits(const void *state, uint32_t layer, uint32_t *budget, uint32_t *max_layer,
                          uint32_t *max_keep, bool *per_head) {
        const struct window_state *st = state;
        (void)layer;
        *budget = st->budget;
        *max_layer = st->budget + st->slack;
        *max_keep = st->budget;
        *per_head = false;
}

static void window_decide(void *state, const struct policy_step *step, uint32_t *targets) {
        const struct window_state *st = state;
        for (uint32_t l = 0; l < st->n_layers; l++)
                if (step->layer_tokens[l] >= st->budget + st->slack)
                        targets[l] = st->budget;
}

static int window_select(void *state, const struct policy_layer *layer, uint32_t target, uint32_t *keep,
                         void *scratch) {
        (void)state;
        /* the most recent by original position; all heads hold the same tokens (per-layer plans),
         * so head 0's positions speak for the layer */
        float *score = scratch;
        uint32_t *work = (uint32_t *)scratch + layer->n_tokens;
        for (uint32_t i = 0; i < layer->n_tokens; i++)
                score[i] = (float)layer->pos[i];
        select_topk(score, layer->n_tokens, target, keep, work);
        return 0;
}

const struct policy_ops policy_window_ops = {
        .name = "window",
        .state_bytes = sizeof(struct window_state),
        .init = window_init,
        .limits = window_limits,
        .decide = window_decide,
        .select = window_select,
};
