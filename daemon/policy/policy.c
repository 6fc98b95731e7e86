/* policy.c: the policy table (one row per policy, selected by name), construction, and the
 * helpers every policy shares: confidence and parameter lookup. */
#include "policy.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const struct policy_ops *const policies[] = {
        &policy_full_ops,
        &policy_window_ops,
};

/* The EMA decay the client's attention applies to the score arrays (CONF-KV ranks by it). */
#define POLICY_DEFAULT_EMA_GAMMA 0.9f

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

        struct policy *p = calloc(1, sizeof(*p));
        if (!p)
                return -ENOMEM;
        p->state = calloc(1, ops->state_bytes ? ops->state_bytes : 1);
        if (!p->state) {
                free(p);
                return -ENOMEM;
        }
        p->ops = ops;
        p->setup = *setup;
        p->ema_gamma = POLICY_DEFAULT_EMA_GAMMA;

        double g = p->ema_gamma;
        int r = policy_param_number(params, n_params, "ema_gamma", &g);
        if (r == -ENOENT)
                r = 0;
        else if (r < 0)
                snprintf(why, why_len, "ema_gamma must be a number");
        if (r == 0 && !(g >= 0.0 && g <= 1.0)) {
                snprintf(why, why_len, "ema_gamma %g not in [0, 1]", g);
                r = -EINVAL;
        }
        p->ema_gamma = (float)g;

        /* the policy sees its own parameters; ema_gamma is everybody's */
        struct policy_param own[32];
        size_t n_own = 0;
        if (n_params > 32) {
                snprintf(why, why_len, "%zu parameters (at most 32)", n_params);
                r = -EINVAL;
        }
        for (size_t i = 0; i < n_params && n_own < 32; i++)
                if (strcmp(params[i].key, "ema_gamma") != 0)
                        own[n_own++] = params[i];
        if (r == 0)
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

float policy_confidence(float entropy, float top1_prob, float margin) {
        return 0.4f * (1.0f - entropy) + 0.3f / (1.0f + expf(-margin)) + 0.3f * top1_prob;
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
