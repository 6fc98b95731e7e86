/* policy.h: the eviction policy interface. Policies are pure C: no I/O, no clock, no allocation
 * after policy_new(), deterministic given their inputs (and, for sampling policies, a seed they
 * own). kvcd calls them; they never call kvcd.
 *
 * Per step kvcd hands the policy the step's summary (decide): the policy answers, per layer,
 * how many tokens to keep if a plan is due now, or POLICY_NO_PLAN. For each layer that needs a
 * plan, kvcd copies the layer's side arrays out of the pool into flat arrays and asks for the
 * keep-set (select), which it writes into the session's plan buffer.
 *
 * A policy also states its limits: the most tokens a layer may ever hold (kvcd stops granting
 * blocks there) and the largest keep-set it can return (the plan buffer is sized from it).
 */
#pragma once

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define POLICY_NO_PLAN UINT32_MAX

struct policy_setup {
        uint32_t n_layers;
        uint32_t n_heads;
        uint32_t n_kv_heads;
        uint32_t head_dim;
        uint32_t max_tokens;    /* the model's context */
        uint32_t block_tokens;  /* slots per block: the natural hysteresis */
        uint32_t budget_tokens; /* requested; 0 = the policy's default */
};

struct policy_param {
        const char *key;
        bool is_text;
        double number;
        const char *text;
};

struct policy_step {
        uint64_t step;
        bool prefill;
        float entropy; /* normalized */
        float top1_prob;
        float margin;
        float confidence;
        const uint32_t *layer_tokens; /* n_layers lengths after the step */
};

/* One layer's side arrays, [n_kv_heads][n_tokens] each, copied out of the pool. */
struct policy_layer {
        uint32_t layer;
        uint32_t n_tokens;
        uint32_t n_kv_heads;
        const int32_t *pos;
        const float *sum;
        const float *ema;
        const float *last;
        const float *logw;
};

struct policy_ops {
        const char *name;
        size_t state_bytes;
        /* Reads the parameters into state. Unknown keys and bad values: -EINVAL with a reason. */
        int (*init)(void *state, const struct policy_setup *setup, const struct policy_param *params,
                    size_t n_params, char *why, size_t why_len);
        /* Budget in force (tokens per layer, for display), the most tokens layer may hold, and the
         * largest keep-set of one layer (per head when the policy plans per head). */
        void (*limits)(const void *state, uint32_t layer, uint32_t *ret_budget,
                       uint32_t *ret_max_layer_tokens, uint32_t *ret_max_keep, bool *ret_per_head);
        /* Fills targets[n_layers]: tokens to keep per layer, or POLICY_NO_PLAN. */
        void (*decide)(void *state, const struct policy_step *step, uint32_t *targets);
        /* Writes the keep-set of one layer, target indices sorted ascending (per head: one set per
         * KV head, head after head). scratch holds n_tokens * n_kv_heads * 2 words. */
        int (*select)(void *state, const struct policy_layer *layer, uint32_t target, uint32_t *keep,
                      void *scratch);
};

struct policy {
        const struct policy_ops *ops;
        struct policy_setup setup;
        float ema_gamma;
        void *state;
};

/* Creates the policy called name. -ENOENT for an unknown name, -EINVAL for bad parameters (with
 * a reason in why). */
int policy_new(const char *name, const struct policy_setup *setup, const struct policy_param *params,
               size_t n_params, struct policy **ret, char *why, size_t why_len);
struct policy *policy_free(struct policy *p);

/* CONF-KV's confidence with the default weights (0.4, 0.3, 0.3):
 * c = 0.4 (1 - entropy) + 0.3 sigmoid(margin) + 0.3 top1_prob, in [0.15, 1]. */
float policy_confidence(float entropy, float top1_prob, float margin);

/* Looks up a numeric parameter; *ret untouched when absent. -EINVAL when it is text. */
int policy_param_number(const struct policy_param *params, size_t n, const char *key, double *ret);

/* Selection: the indices of the k largest scores of n, written ascending into out. Ties go to the
 * larger index (the more recent slot), NaN counts as -inf. Linear time (a radix select over the
 * float bits), no allocation: scratch holds n words. */
void select_topk(const float *score, uint32_t n, uint32_t k, uint32_t *out, uint32_t *scratch);

extern const struct policy_ops policy_full_ops;
extern const struct policy_ops policy_window_ops;
