/* policy.h: the eviction policy interface. Policies are pure C: no I/O, no clock, no allocation
 * (policy_new() allocates each policy's state once, sized by the policy), deterministic given
 * their inputs and, for the sampling policy, the seed it owns. kvcd calls them; they never call
 * kvcd.
 *
 * Per step kvcd hands the policy the step's summary. A policy that watches attention during
 * some steps (SnapKV's observation window) says so through observes(), and then sees every
 * layer's side arrays (observe) before it decides. decide() answers, per layer, how many tokens
 * to keep if a plan is due now (POLICY_NO_PLAN otherwise) and how many of the kept ones, the
 * oldest, to hold in the session's first tier below its dtype (INT8 for CONF-KV). For each layer with a plan kvcd copies the layer's side arrays out of
 * the pool into flat arrays and asks for the keep-set (select), which it writes into the
 * session's plan buffer. A select may also return log-weight increments for the kept tokens
 * (decode-time correction); kvcd adds them into the pool before it sends the plan.
 *
 * A policy states its limits: its budget, the most tokens a layer may ever hold (kvcd stops
 * granting blocks there) and the largest keep-set it returns (the plan buffer is sized by it).
 *
 * Slot order is position order: appends come in increasing position and compaction keeps the
 * relative order. Policies may therefore take "the first S slots" as the sinks and "the last R
 * slots" as the most recent tokens without sorting positions.
 */
#pragma once

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define POLICY_NO_PLAN    UINT32_MAX
#define POLICY_MAX_PARAMS 32

struct policy_setup {
        uint32_t n_layers;
        uint32_t n_heads;
        uint32_t n_kv_heads;
        uint32_t head_dim;
        uint32_t max_tokens;    /* the model's context */
        uint32_t block_tokens;  /* slots per block: the natural hysteresis */
        uint32_t budget_tokens; /* requested; 0 = the policy's default */
        uint32_t prompt_tokens; /* the prompt's length if the client said (0: unknown) */
        uint64_t budget_bytes;  /* OpenSession.budget_bytes (0: none; the ladder reads it) */
        uint64_t session_id;    /* for a default seed */
};

/* A parameter as it came in OpenSession; its text is valid only during init(). */
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
        float confidence;             /* with the session's weights */
        uint64_t appended;            /* tokens appended to layer 0 since the session opened */
        const uint32_t *layer_tokens; /* n_layers lengths after the step */
        /* The session's tiers and what its blocks may hold (the ladder policy's inputs): n_tiers
         * (1: the dtype alone), each tier's bytes per block of block_tokens tokens in one layer
         * (falling), and the bytes all its layers' blocks may hold now: its byte budget or the
         * arbiter's cap, the lower, less its plan buffer (UINT64_MAX: no limit in bytes). */
        uint32_t n_tiers;
        const uint64_t *tier_block_bytes;
        const uint8_t *tier_bits; /* each tier's bits per value (tier 0: the dtype's) */
        uint64_t budget_bytes;
};

/* One layer's side arrays, [n_kv_heads][n_tokens] each, copied out of the pool. */
struct policy_layer {
        uint32_t layer;
        uint32_t n_tokens;
        uint32_t n_kv_heads;
        uint32_t n_low; /* slots [0, n_low) are held below the dtype now (any lower tier) */
        const uint8_t *tier; /* each slot's tier now (NULL: every slot at the dtype) */
        const int32_t *pos;
        const float *sum;
        const float *ema;
        const float *last;
        const float *logw;
};

struct policy_target {
        uint32_t keep; /* tokens to keep per layer (and head), or POLICY_NO_PLAN */
        uint32_t low;  /* of those, the oldest to hold in a lower tier after the plan (at least the
                          session's first; kvcd's tier_window may send them lower) */
};

struct policy_limits {
        uint32_t budget;           /* for display: tokens per layer the policy aims at */
        uint32_t max_layer_tokens; /* a layer never holds more */
        uint32_t max_keep;         /* the largest keep-set of a layer (per head if per_head) */
        bool per_head;             /* keep-sets per KV head */
        bool lower;                /* plans may move tokens to a lower tier (the session must have one) */
        bool summarize;            /* evicted tokens go into a summary slot (kernels/summarize.h):
                                      kvcd keeps that slot beside the policy's keep-set */
        bool token_tiers;          /* select_tiers gives each kept token its tier (the session
                                      must have tiers and a client that applies them) */
};

/* The side arrays of a layer view (struct policy_layer), as bits of policy_ops.reads. */
enum {
        POLICY_READS_POS = 1u << 0,
        POLICY_READS_SUM = 1u << 1,
        POLICY_READS_EMA = 1u << 2,
        POLICY_READS_LAST = 1u << 3,
        POLICY_READS_LOGW = 1u << 4,
        POLICY_READS_ALL = (1u << 5) - 1,
};

struct policy_ops {
        const char *name;
        /* The side arrays select() reads (POLICY_READS_*); 0 means all. kvcd copies only these out
         * of the pool when it builds a plan (the copy, of lines the client's core wrote, was the
         * largest cost of a plan: issue 29); the others are NULL in select's view. */
        uint32_t reads;
        /* Bytes of state for this setup (arrays included); policy_new() zeroes them. */
        size_t (*state_bytes)(const struct policy_setup *setup);
        /* Reads the parameters into state. Unknown keys and bad values: -EINVAL with a reason. */
        int (*init)(void *state, const struct policy_setup *setup, const struct policy_param *params,
                    size_t n_params, char *why, size_t why_len);
        void (*limits)(const void *state, struct policy_limits *ret);
        /* Optional: whether observe() wants this step's layers. */
        bool (*observes)(const void *state, const struct policy_step *step);
        /* scratch as select's (4 * n_kv_heads * n_tokens words), free to use until it returns. */
        void (*observe)(void *state, const struct policy_step *step, const struct policy_layer *layer,
                        void *scratch);
        /* Fills targets[n_layers] (kvcd initializes them to POLICY_NO_PLAN, low 0). */
        void (*decide)(void *state, const struct policy_step *step, struct policy_target *targets);
        /* Writes the keep-set of one layer: target->keep indices, sorted ascending (per head: one
         * set per KV head, head after head). May write logw_delta[] (same shape as keep) and then
         * returns 1; returns 0 when it wrote no deltas. scratch holds 4 * n_kv_heads * n_tokens
         * words, aligned for a double. */
        int (*select)(void *state, const struct policy_step *step, const struct policy_layer *layer,
                      const struct policy_target *target, uint32_t *keep, float *logw_delta, void *scratch);
        /* Instead of select, for a policy with limits.token_tiers: the keep-set as select writes
         * it (target->keep slots, ascending, per layer) and tier[i], the tier kept slot keep[i] is
         * to hold after the plan (never above its tier now: layer->tier). 0 or -EINVAL. A target of
         * every slot may come without a decide (a link of a demotion: kvcd caps what one plan
         * demotes, and asks again once the client has applied it). */
        int (*select_tiers)(void *state, const struct policy_step *step, const struct policy_layer *layer,
                            const struct policy_target *target, uint32_t *keep, uint8_t *tier, void *scratch);
        /* Optional, with token_tiers: the bytes the session's blocks need to keep every token of
         * step->layer_tokens, each at the lowest tier the policy would send it to (the arbiter
         * lowers a session's cap to there before it makes anyone evict). */
        uint64_t (*lowest_bytes)(const void *state, const struct policy_step *step);
};

struct policy {
        const struct policy_ops *ops;
        struct policy_setup setup;
        float ema_gamma;
        float conf_weights[3]; /* entropy, margin, top-1 */
        void *state;
};

/* Creates the policy called name. -ENOENT for an unknown name, -EINVAL for bad parameters (with
 * a reason in why). The common parameters (ema_gamma, w_entropy, w_margin, w_top1) are read here;
 * the rest go to the policy. */
int policy_new(const char *name, const struct policy_setup *setup, const struct policy_param *params,
               size_t n_params, struct policy **ret, char *why, size_t why_len);
struct policy *policy_free(struct policy *p);

/* The names of all policies, NULL-terminated (for messages and docs). */
const char *const *policy_names(void);

/* CONF-KV's confidence: c = w0 (1 - entropy) + w1 sigmoid(margin) + w2 top1_prob. With the
 * defaults (0.4, 0.3, 0.3) it lies in [0.15, 1] (sigmoid of a margin >= 0 is >= 0.5). */
float policy_confidence(const float w[3], float entropy, float top1_prob, float margin);
extern const float policy_default_conf_weights[3];

/* Looks up a numeric parameter; *ret untouched when absent (-ENOENT). -EINVAL when it is text. */
int policy_param_number(const struct policy_param *params, size_t n, const char *key, double *ret);

/* Table-driven parameter parsing: each spec names a key, where its value goes in the config
 * struct, its kind and range (for an enum, its words). Unknown keys are refused. */
enum policy_param_kind {
        POLICY_PARAM_U32,
        POLICY_PARAM_FLOAT,
        POLICY_PARAM_BOOL,
        POLICY_PARAM_ENUM, /* stored as uint32_t: the index of the word */
};

struct policy_param_spec {
        const char *key;
        enum policy_param_kind kind;
        size_t offset;
        double min, max;
        const char *const *words; /* POLICY_PARAM_ENUM: NULL-terminated */
};

int policy_parse_params(void *cfg, const struct policy_param_spec *specs, size_t n_specs,
                        const struct policy_param *params, size_t n, char *why, size_t why_len);

/* PyramidKV's arithmetic schedule: layer l of L gets max - l (max - min) / (L - 1) tokens with
 * min = avg / beta and max = 2 avg - min (rounded), so the average over layers is avg. */
uint32_t policy_pyramid_budget(uint32_t avg, uint32_t layer, uint32_t n_layers, float beta);

/* Selection: the indices of the k largest scores of n, written ascending into out. Ties go to the
 * larger index (the more recent slot), NaN counts as -inf. Linear time (a radix select over the
 * float bits), no allocation: scratch holds n words. */
void select_topk(const float *score, uint32_t n, uint32_t k, uint32_t *out, uint32_t *scratch);

/* The usual keep-set shape: the first `sinks` slots, the last `recent` slots, and the best of the
 * others by score, k in all (sinks and recent shrink if k is smaller). score is modified.
 * scratch holds n words. */
void policy_keep_ranked(float *score, uint32_t n, uint32_t k, uint32_t sinks, uint32_t recent, uint32_t *keep,
                        uint32_t *scratch);

/* Per-layer scores from per-head ones: out[i] = mean over heads of in[h * n + i]. */
void policy_mean_over_heads(const float *in, uint32_t n_heads, uint32_t n, float *out);

/* prob's inclusion probabilities: pi[i] = min(1, c exp((s_i / max s - 1) / temperature)) with c
 * set so that they sum to m over the n candidates. -EINVAL for temperature 0 or m > n. */
int prob_inclusion(const float *score, uint32_t n, uint32_t m, float temperature, double *pi);

extern const struct policy_ops policy_full_ops;
extern const struct policy_ops policy_window_ops;
extern const struct policy_ops policy_streaming_ops;
extern const struct policy_ops policy_h2o_ops;
extern const struct policy_ops policy_tova_ops;
extern const struct policy_ops policy_snapkv_ops;
extern const struct policy_ops policy_pyramid_ops;       /* PyramidKV as published (snapkv.c) */
extern const struct policy_ops policy_pyramid_taper_ops; /* its schedule at decode time (ranked.c) */
extern const struct policy_ops policy_conf_ops;
extern const struct policy_ops policy_conf_l_ops;
extern const struct policy_ops policy_scope_ops;
extern const struct policy_ops policy_prob_ops;
extern const struct policy_ops policy_ladder_ops;

/* ---- the ladder's allocation (ladder.c) ---- */

#define POLICY_MAX_TIERS 5u /* the dtype and four below it (kernels/ladder.h's LADDER_TIERS) */

/* How the ladder splits a layer's candidates (the tokens neither sinks nor the recent window)
 * among the tiers, in whole tokens and exact integer arithmetic on the tiers' costs. cost[t] is
 * tier t's bytes per block of T tokens (falling with t); budget the bytes the candidates may hold
 * (the block rounding already taken out); m the candidates; bulk the tier most of them hold when
 * the budget is about that tier's cost; high how many of the most important to hold one tier
 * above the bulk when the budget is below the bulk's. ret[t] is how many of the ranked candidates
 * go to tier t, the most important first (ret[0] to the dtype, and so on down); their sum is the
 * candidates kept: m, or fewer when even the lowest tier cannot hold them all (eviction).
 *
 *   budget >= m cost[0]:        all at the dtype;
 *   m cost[bulk] <= budget:     all at the bulk, then the most important lifted a tier at a time
 *                               (all to bulk - 1 before any goes to bulk - 2) with what is left;
 *   else:                       `high` at bulk - 1, the rest at the bulk with the least important
 *                               lowered a tier at a time (all to bulk + 1 before any to bulk + 2);
 *                               without `high` if it does not fit with it;
 *   m cost[last] > budget:      floor(budget / cost[last]) at the lowest tier, the rest evicted. */
void ladder_allocate(const uint64_t *cost, uint32_t n_tiers, uint32_t T, uint64_t budget, uint32_t m,
                     uint32_t bulk, uint32_t high, uint32_t ret[POLICY_MAX_TIERS]);
