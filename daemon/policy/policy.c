/* policy.c: the policy table (one row per policy, selected by name), construction, and what
 * every policy shares: the common parameters, confidence, table-driven parameter parsing, the
 * pyramid schedule and the usual keep-set shape. */
#include "policy.h"

#include <errno.h>
#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const struct policy_ops *const policies[] = {
        &policy_full_ops,   &policy_window_ops, &policy_streaming_ops, &policy_h2o_ops,
        &policy_tova_ops,   &policy_snapkv_ops, &policy_pyramid_ops,   &policy_conf_ops,
        &policy_conf_l_ops, &policy_scope_ops,  &policy_prob_ops,      &policy_pyramid_taper_ops, &policy_ladder_ops,
};

const char *const *policy_names(void) {
        static const char *names[sizeof(policies) / sizeof(policies[0]) + 1];
        for (size_t i = 0; i < sizeof(policies) / sizeof(policies[0]); i++)
                names[i] = policies[i]->name;
        return names;
}

/* The EMA decay the client's attention applies to the score arrays (CONF-KV ranks by it). */
#define POLICY_DEFAULT_EMA_GAMMA 0.9f

const float policy_default_conf_weights[3] = { 0.4f, 0.3f, 0.3f };

/* Parameters every policy takes; they configure kvcd and the client, not the policy. */
struct common_params {
        float ema_gamma;
        float w[3];
};

static const struct policy_param_spec common_specs[] = {
        { "ema_gamma", POLICY_PARAM_FLOAT, offsetof(struct common_params, ema_gamma), 0, 1, NULL },
        { "w_entropy", POLICY_PARAM_FLOAT, offsetof(struct common_params, w[0]), 0, 1, NULL },
        { "w_margin", POLICY_PARAM_FLOAT, offsetof(struct common_params, w[1]), 0, 1, NULL },
        { "w_top1", POLICY_PARAM_FLOAT, offsetof(struct common_params, w[2]), 0, 1, NULL },
};

static bool is_common(const char *key) {
        for (size_t i = 0; i < sizeof(common_specs) / sizeof(common_specs[0]); i++)
                if (strcmp(common_specs[i].key, key) == 0)
                        return true;
        return false;
}

int policy_new(const char *name, const struct policy_setup *setup, const struct policy_param *params,
               size_t n_params, struct policy **ret, char *why, size_t why_len) {
        const struct policy_ops *ops = NULL;
        for (size_t i = 0; i < sizeof(policies) / sizeof(policies[0]); i++)
                if (strcmp(policies[i]->name, name) == 0)
                        ops = policies[i];
        if (!ops) {
                snprintf(why, why_len, "unknown policy '%s'", name);
                return -ENOENT;
        }
        if (n_params > POLICY_MAX_PARAMS) {
                snprintf(why, why_len, "%zu parameters (at most %d)", n_params, POLICY_MAX_PARAMS);
                return -EINVAL;
        }

        /* split the common parameters from the policy's own */
        struct policy_param common[POLICY_MAX_PARAMS], own[POLICY_MAX_PARAMS];
        size_t n_common = 0, n_own = 0;
        for (size_t i = 0; i < n_params; i++) {
                if (is_common(params[i].key))
                        common[n_common++] = params[i];
                else
                        own[n_own++] = params[i];
        }
        struct common_params cp = { .ema_gamma = POLICY_DEFAULT_EMA_GAMMA };
        memcpy(cp.w, policy_default_conf_weights, sizeof(cp.w));
        int r = policy_parse_params(&cp, common_specs, sizeof(common_specs) / sizeof(common_specs[0]), common,
                                    n_common, why, why_len);
        if (r < 0)
                return r;

        struct policy *p = calloc(1, sizeof(*p));
        size_t bytes = ops->state_bytes(setup);
        if (!p || !(p->state = calloc(1, bytes ? bytes : 1))) {
                free(p);
                return -ENOMEM;
        }
        p->ops = ops;
        p->setup = *setup;
        p->ema_gamma = cp.ema_gamma;
        memcpy(p->conf_weights, cp.w, sizeof(cp.w));
        r = ops->init(p->state, setup, own, n_own, why, why_len);
        if (r < 0) {
                policy_free(p);
                return r;
        }
        *ret = p;
        return 0;
}

struct policy *policy_free(struct policy *p) {
        if (p) {
                free(p->state);
                free(p);
        }
        return NULL;
}

float policy_confidence(const float w[3], float entropy, float top1_prob, float margin) {
        return w[0] * (1.0f - entropy) + w[1] / (1.0f + expf(-margin)) + w[2] * top1_prob;
}

int policy_param_number(const struct policy_param *params, size_t n, const char *key, double *ret) {
        for (size_t i = 0; i < n; i++) {
                if (strcmp(params[i].key, key) != 0)
                        continue;
                if (params[i].is_text)
                        return -EINVAL;
                *ret = params[i].number;
                return 0;
        }
        return -ENOENT;
}

static int parse_one(void *cfg, const struct policy_param_spec *s, const struct policy_param *p, char *why,
                     size_t why_len) {
        uint8_t *at = (uint8_t *)cfg + s->offset;
        if (s->kind == POLICY_PARAM_ENUM) {
                if (!p->is_text) {
                        snprintf(why, why_len, "parameter %s takes a word", s->key);
                        return -EINVAL;
                }
                for (uint32_t i = 0; s->words[i]; i++) {
                        if (strcmp(s->words[i], p->text) == 0) {
                                memcpy(at, &i, sizeof(i));
                                return 0;
                        }
                }
                snprintf(why, why_len, "parameter %s: '%s' is not one of its words", s->key, p->text);
                return -EINVAL;
        }
        if (p->is_text || !(p->number >= s->min && p->number <= s->max)) {
                snprintf(why, why_len, "parameter %s must be a number in [%g, %g]", s->key, s->min, s->max);
                return -EINVAL;
        }
        switch (s->kind) {
        case POLICY_PARAM_U32: {
                if (p->number != floor(p->number)) {
                        snprintf(why, why_len, "parameter %s must be a whole number", s->key);
                        return -EINVAL;
                }
                uint32_t v = (uint32_t)p->number;
                memcpy(at, &v, sizeof(v));
                return 0;
        }
        case POLICY_PARAM_FLOAT: {
                float v = (float)p->number;
                memcpy(at, &v, sizeof(v));
                return 0;
        }
        case POLICY_PARAM_BOOL: {
                bool v = p->number != 0;
                memcpy(at, &v, sizeof(v));
                return 0;
        }
        case POLICY_PARAM_ENUM: break;
        }
        return -EINVAL;
}

int policy_parse_params(void *cfg, const struct policy_param_spec *specs, size_t n_specs,
                        const struct policy_param *params, size_t n, char *why, size_t why_len) {
        for (size_t i = 0; i < n; i++) {
                const struct policy_param_spec *s = NULL;
                for (size_t j = 0; j < n_specs && !s; j++)
                        if (strcmp(specs[j].key, params[i].key) == 0)
                                s = &specs[j];
                if (!s) {
                        snprintf(why, why_len, "unknown parameter '%s'", params[i].key);
                        return -EINVAL;
                }
                int r = parse_one(cfg, s, &params[i], why, why_len);
                if (r < 0)
                        return r;
        }
        return 0;
}

uint32_t policy_pyramid_budget(uint32_t avg, uint32_t layer, uint32_t n_layers, float beta) {
        if (n_layers <= 1 || beta <= 1.0f)
                return avg;
        double min = (double)avg / beta, max = 2.0 * avg - min;
        double b = max - (double)layer * (max - min) / (double)(n_layers - 1);
        uint32_t r = (uint32_t)lround(b);
        return r ? r : 1;
}

void policy_keep_ranked(float *score, uint32_t n, uint32_t k, uint32_t sinks, uint32_t recent, uint32_t *keep,
                        uint32_t *scratch) {
        if (k > n)
                k = n;
        if (sinks > k)
                sinks = k;
        if (recent > k - sinks)
                recent = k - sinks;
        for (uint32_t i = sinks; i + recent < n; i++) /* a client's +inf must not outrank the protected */
                if (score[i] > FLT_MAX)
                        score[i] = FLT_MAX;
        for (uint32_t i = 0; i < sinks && i < n; i++)
                score[i] = INFINITY;
        for (uint32_t i = 0; i < recent; i++)
                score[n - 1 - i] = INFINITY;
        select_topk(score, n, k, keep, scratch);
}

void policy_mean_over_heads(const float *in, uint32_t n_heads, uint32_t n, float *out) {
        for (uint32_t i = 0; i < n; i++)
                out[i] = 0.0f;
        for (uint32_t h = 0; h < n_heads; h++)
                for (uint32_t i = 0; i < n; i++)
                        out[i] += in[(size_t)h * n + i];
        for (uint32_t i = 0; i < n; i++)
                out[i] /= (float)n_heads;
}
