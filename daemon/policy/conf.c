/* conf.c: CONF-KV (Li & Miao, arXiv 2605.24786) and CONF-KV-L, with the gates to compare.
 *
 * Confidence c = w_H (1 - H/log V) + w_m sigmoid(z1 - z2) + w_p p1 (kvcd computes it per step
 * with the session's weights, default 0.4, 0.3, 0.3; c >= 0.15 always).
 *
 * Ranking (the paper's "composite of accumulated attention mass and recency"; its exact formula
 * is not public, see notes/policies.md 1.3): S_j = w_att * A_j / max A + w_rec * exp(-(t - pos_j)
 * / lambda), A the EMA attention (score array `ema`, averaged over heads unless per_head), t the
 * newest position. The first `sinks` slots and the `protect` newest are always kept.
 *
 * Gates (what the budget does with c), `gate=`:
 *   fixed       budget B every step: the ranking alone, the baseline the gates must beat;
 *   naive       the paper's two levels: n_high (compact) when c >= tau, n_low (loose) otherwise,
 *               cutting whenever the cache exceeds the level of the step (defaults B/2, 3B/2);
 *   continuous  n_high + (1 - c') (n_low - n_high), c' = (c - 0.15) / 0.85;
 *   defer       gate *when* to evict: cut to B only on confident steps; on uncertain steps let
 *               the cache grow, up to n_low, so the context the model is reaching for is not
 *               thrown away at the moment it is needed. Eviction is irreversible and the cache
 *               regrows one token per step, so a level that drops on every confident step (naive)
 *               mostly throws context away; deferring keeps the cut for moments the model shows
 *               it does not need the context.
 *   attention   defer's levels, gated on what the cut would throw away instead of on c: every step
 *               a layer could be cut, the mass the newest query pays (the `last` side array,
 *               averaged over KV heads) to the slots a cut to B would evict, m. The layer is cut
 *               when m is at or below a running att_q-quantile of its own past m's (default 0.5:
 *               half the steps), and grows up to n_low otherwise. On SmolLM2 the full cache's
 *               attention beyond a window predicts the window's KL over the next 16 steps better
 *               than confidence does (docs/quality.md, "The mechanism"): this gate acts on it. The
 *               quantile is tracked in log m with a fixed step (the frugal estimator: up by
 *               eta q when m is above it, down by eta (1 - q) otherwise), so there is no threshold
 *               to fit on the test text and nothing is stored per step.
 * Mixed precision (int8=1): the kept tokens older than the newest fp_window go to INT8.
 * Pyramid (conf-l, or pyramid=1): every level is spread over the layers with PyramidKV's
 * arithmetic schedule (beta 20), deeper layers smaller.
 * Correction (correction=sink): the attention mass of the evicted tokens (by their EMA) is given
 * to the first sink through its log-weight, so survivors are not inflated by the renormalisation
 * (the softmax denominator keeps the evicted mass); see prob.c.
 */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "policy.h"

enum gate {
        GATE_FIXED,
        GATE_NAIVE,
        GATE_CONTINUOUS,
        GATE_DEFER,
        GATE_ATTENTION,
};

static const char *const gate_words[] = { "fixed", "naive", "continuous", "defer", "attention", NULL };

#define ATT_ETA 0.1f /* the quantile tracker's step in log mass: some 100 steps to settle */
static const char *const correction_words[] = { "none", "sink", "moment", NULL };

struct conf {
        uint32_t budget;
        uint32_t n_high;
        uint32_t n_low;
        float tau;
        uint32_t gate;
        uint32_t sinks;
        uint32_t protect;
        float w_att;
        float w_rec;
        float lambda;
        bool int8;
        uint32_t fp_window;
        bool pyramid;
        float beta;
        bool per_head;
        uint32_t slack;
        uint32_t correction;
        float att_q;
        uint32_t n_layers;
        /* gate=attention, per layer: the running att_q-quantile of log m (NaN before the first m)
         * and this step's answer (1 cut, 0 grow, -1 not measured) */
        float *level;
        int8_t *cut_now;
};

static const struct policy_param_spec conf_specs[] = {
        { "n_high", POLICY_PARAM_U32, offsetof(struct conf, n_high), 1, 1 << 20, NULL },
        { "n_low", POLICY_PARAM_U32, offsetof(struct conf, n_low), 1, 1 << 20, NULL },
        { "tau", POLICY_PARAM_FLOAT, offsetof(struct conf, tau), 0, 1, NULL },
        { "gate", POLICY_PARAM_ENUM, offsetof(struct conf, gate), 0, 0, gate_words },
        { "sinks", POLICY_PARAM_U32, offsetof(struct conf, sinks), 0, 1 << 20, NULL },
        { "protect", POLICY_PARAM_U32, offsetof(struct conf, protect), 0, 1 << 20, NULL },
        { "w_att", POLICY_PARAM_FLOAT, offsetof(struct conf, w_att), 0, 1e6, NULL },
        { "w_rec", POLICY_PARAM_FLOAT, offsetof(struct conf, w_rec), 0, 1e6, NULL },
        { "lambda", POLICY_PARAM_FLOAT, offsetof(struct conf, lambda), 1e-3, 1e9, NULL },
        { "int8", POLICY_PARAM_BOOL, offsetof(struct conf, int8), 0, 1, NULL },
        { "fp_window", POLICY_PARAM_U32, offsetof(struct conf, fp_window), 0, 1 << 20, NULL },
        { "pyramid", POLICY_PARAM_BOOL, offsetof(struct conf, pyramid), 0, 1, NULL },
        { "beta", POLICY_PARAM_FLOAT, offsetof(struct conf, beta), 1.0001, 1e6, NULL },
        { "per_head", POLICY_PARAM_BOOL, offsetof(struct conf, per_head), 0, 1, NULL },
        { "slack", POLICY_PARAM_U32, offsetof(struct conf, slack), 1, 1 << 20, NULL },
        { "correction", POLICY_PARAM_ENUM, offsetof(struct conf, correction), 0, 0, correction_words },
        { "att_q", POLICY_PARAM_FLOAT, offsetof(struct conf, att_q), 0.01, 0.99, NULL },
};

static size_t conf_bytes(const struct policy_setup *s) {
        return sizeof(struct conf) + s->n_layers * (sizeof(float) + sizeof(int8_t));
}

static int conf_init_common(struct conf *c, const struct policy_setup *s, const struct policy_param *params,
                            size_t n, char *why, size_t why_len) {
        c->budget = s->budget_tokens ? s->budget_tokens : 128;
        if (c->budget > s->max_tokens)
                c->budget = s->max_tokens;
        c->tau = 0.8f; /* the median confidence of stories260K on the TinyStories validation text
                        * (bench/quality): half the steps count as confident */
        c->gate = GATE_DEFER;
        c->sinks = 4;
        c->protect = c->budget / 4 < 16 ? c->budget / 4 : 16; /* small budgets keep room to choose */
        c->w_att = 1.0f;
        c->w_rec = 0.1f; /* attention first, recency to break ties: measured best of w_rec in
                          * {0.1, 0.3, 1} x lambda in {B/4, B, 4B} (bench/RESULTS.md) */
        c->lambda = (float)c->budget;
        c->fp_window = 8; /* measured: 8 and 16 newest tokens in full precision give the same quality
                           * on stories260K, and 8 leaves more room in INT8 (bench/RESULTS.md) */
        if (!c->pyramid)
                c->beta = 20.0f;
        c->slack = s->block_tokens;
        c->att_q = 0.5f;
        c->n_layers = s->n_layers;
        c->level = (float *)(c + 1);
        c->cut_now = (int8_t *)(c->level + s->n_layers);
        for (uint32_t l = 0; l < s->n_layers; l++) {
                c->level[l] = NAN;
                c->cut_now[l] = -1;
        }
        int r = policy_parse_params(c, conf_specs, sizeof(conf_specs) / sizeof(conf_specs[0]), params, n, why,
                                    why_len);
        if (r < 0)
                return r;
        if (!c->n_high)
                c->n_high = c->budget / 2 ? c->budget / 2 : 1;
        if (!c->n_low)
                c->n_low = c->budget + c->budget / 2;
        if (c->n_low > s->max_tokens)
                c->n_low = s->max_tokens;
        /* the smallest level a layer is cut to must leave room to choose beyond the protected */
        uint32_t floor = c->gate == GATE_NAIVE || c->gate == GATE_CONTINUOUS ? c->n_high : c->budget;
        if (c->n_high > c->n_low || c->sinks + c->protect >= floor) {
                snprintf(why, why_len, "need sinks + protect (%u) < %s (%u), and n_high (%u) <= n_low (%u)",
                         c->sinks + c->protect, floor == c->budget ? "the budget" : "n_high", floor,
                         c->n_high, c->n_low);
                return -EINVAL;
        }
        if ((c->gate == GATE_DEFER || c->gate == GATE_ATTENTION) &&
            c->budget > c->n_low) { /* no plan to B could shrink n_low + slack */
                snprintf(why, why_len, "gate=%s needs budget (%u) <= n_low (%u)", gate_words[c->gate],
                         c->budget, c->n_low);
                return -EINVAL;
        }
        if (c->correction == 2 && (c->per_head || c->int8)) {
                snprintf(why, why_len, "correction=moment needs per-layer plans without INT8");
                return -EINVAL;
        }
        if (c->correction == 1 && c->sinks == 0) {
                snprintf(why, why_len, "correction=sink needs at least one sink");
                return -EINVAL;
        }
        return 0;
}

static int conf_init(void *state, const struct policy_setup *s, const struct policy_param *params, size_t n,
                     char *why, size_t why_len) {
        return conf_init_common(state, s, params, n, why, why_len);
}

static int conf_l_init(void *state, const struct policy_setup *s, const struct policy_param *params, size_t n,
                       char *why, size_t why_len) {
        struct conf *c = state;
        c->pyramid = true;
        c->beta = 2.0f; /* CONF-KV-L's schedule is not public: a mild slope (layers from 1.5B to 0.5B)
                         * rather than PyramidKV's beta 20, which leaves a 5-layer model's last layer 3
                         * tokens of a 64-token budget; beta= sets it */
        return conf_init_common(c, s, params, n, why, why_len);
}

/* A level (a budget in tokens) as layer l sees it. */
static uint32_t at_layer(const struct conf *c, uint32_t level, uint32_t l) {
        return c->pyramid ? policy_pyramid_budget(level, l, c->n_layers, c->beta) : level;
}

static void conf_limits(const void *state, struct policy_limits *ret) {
        const struct conf *c = state;
        uint32_t top = c->gate == GATE_FIXED ? c->budget : c->n_low, most = 0;
        for (uint32_t l = 0; l < c->n_layers; l++)
                most = at_layer(c, top, l) > most ? at_layer(c, top, l) : most;
        *ret = (struct policy_limits){ .budget = c->budget,
                                       .max_layer_tokens = most + c->slack,
                                       .max_keep = most,
                                       .per_head = c->per_head,
                                       .lower = c->int8,
                                       .summarize = c->correction == 2 };
}

/* Whether a plan could cut layer l this step, and whether the gate has a choice (gate=attention):
 * at or past B + slack, below n_low + slack (where the cut is due whatever the signal). */
static bool gate_may_defer(const struct conf *c, const struct policy_step *step, uint32_t l) {
        uint32_t n = step->layer_tokens[l], target = at_layer(c, c->budget, l);
        return target < n && n >= target + c->slack && n < at_layer(c, c->n_low, l) + c->slack;
}

static bool conf_observes(const void *state, const struct policy_step *step) {
        const struct conf *c = state;
        for (uint32_t l = 0; c->gate == GATE_ATTENTION && l < c->n_layers; l++)
                if (gate_may_defer(c, step, l))
                        return true;
        return false;
}

static void conf_decide(void *state, const struct policy_step *step, struct policy_target *t) {
        struct conf *c = state;
        bool confident = step->confidence >= c->tau;
        float c01 = (step->confidence - 0.15f) / 0.85f;
        c01 = c01 < 0 ? 0 : c01 > 1 ? 1 : c01;
        for (uint32_t l = 0; l < c->n_layers; l++) {
                uint32_t n = step->layer_tokens[l], target, trigger;
                switch ((enum gate)c->gate) {
                case GATE_NAIVE:
                        target = at_layer(c, confident ? c->n_high : c->n_low, l);
                        trigger = target + c->slack;
                        break;
                case GATE_CONTINUOUS:
                        target = at_layer(
                                c, c->n_high + (uint32_t)((1.0f - c01) * (float)(c->n_low - c->n_high)), l);
                        trigger = target + c->slack;
                        break;
                case GATE_DEFER:
                        target = at_layer(c, c->budget, l);
                        trigger = confident ? target + c->slack : at_layer(c, c->n_low, l) + c->slack;
                        break;
                case GATE_ATTENTION:
                        target = at_layer(c, c->budget, l);
                        trigger =
                                c->cut_now[l] != 0 ? target + c->slack : at_layer(c, c->n_low, l) + c->slack;
                        c->cut_now[l] = -1; /* measured for this step only */
                        break;
                case GATE_FIXED:
                default:
                        target = at_layer(c, c->budget, l);
                        trigger = target + c->slack;
                        break;
                }
                if (n < trigger || target >= n)
                        continue;
                t[l].keep = target;
                t[l].low = c->int8 && target > c->fp_window ? target - c->fp_window : 0;
        }
}

/* S = w_att A / max A + w_rec exp(-(t - pos) / lambda) for one head's (or the mean) arrays. */
static void composite(const struct conf *c, const float *ema, const int32_t *pos, uint32_t n, float *out) {
        float amax = 0.0f;
        int32_t newest = n ? pos[n - 1] : 0;
        for (uint32_t i = 0; i < n; i++)
                if (isfinite(ema[i]) && ema[i] > amax)
                        amax = ema[i];
        for (uint32_t i = 0; i < n; i++) {
                float a = isfinite(ema[i]) && amax > 0 ? ema[i] / amax : 0.0f;
                float age = (float)((int64_t)newest - pos[i]);
                out[i] = c->w_att * a + c->w_rec * expf(-(age > 0 ? age : 0) / c->lambda);
        }
}

/* The evicted mass, by EMA, handed to the first kept slot (a sink) through its log-weight. */
static void sink_correction(const float *ema, uint32_t n, const uint32_t *keep, uint32_t k, float *delta) {
        double kept = 0, all = 0;
        for (uint32_t i = 0; i < n; i++)
                all += isfinite(ema[i]) && ema[i] > 0 ? ema[i] : 0;
        for (uint32_t i = 0; i < k; i++) {
                kept += isfinite(ema[keep[i]]) && ema[keep[i]] > 0 ? ema[keep[i]] : 0;
                delta[i] = 0.0f;
        }
        double sink = isfinite(ema[keep[0]]) && ema[keep[0]] > 0 ? ema[keep[0]] : 0;
        double evicted = all - kept;
        if (k == 0 || evicted <= 0 || sink <= 1e-12)
                return;
        double d = log((sink + evicted) / sink);
        delta[0] = (float)(d < 10.0 ? d : 10.0);
}

/* The keep-set of k slots of set h (a KV head, or the layer's mean when !per_head) into keep; the
 * EMA it ranked by is returned (in scratch for the mean). scratch: 3 n words. */
static const float *rank_keep(const struct conf *c, const struct policy_layer *L, uint32_t h, uint32_t k,
                              uint32_t *keep, void *scratch) {
        uint32_t n = L->n_tokens;
        float *score = scratch, *mean = score + n;
        uint32_t *work = (uint32_t *)(mean + n);
        const float *ema = L->ema + (size_t)h * n;
        if (!c->per_head) {
                policy_mean_over_heads(L->ema, L->n_kv_heads, n, mean);
                ema = mean;
        }
        composite(c, ema, L->pos + (size_t)h * n, n, score);
        policy_keep_ranked(score, n, k, c->sinks, c->protect, keep, work);
        return ema;
}

/* gate=attention: m, the mass of `last` a cut of this layer to B would evict (the mean over KV
 * heads; per head its own keep-set when per_head), against the layer's running quantile. */
static void conf_observe(void *state, const struct policy_step *step, const struct policy_layer *L,
                         void *scratch) {
        struct conf *c = state;
        uint32_t l = L->layer, n = L->n_tokens, k = at_layer(c, c->budget, l);
        if (l >= c->n_layers || !gate_may_defer(c, step, l) || k >= n)
                return;
        uint32_t *keep = (uint32_t *)scratch + 3 * (size_t)n, sets = c->per_head ? L->n_kv_heads : 1;
        double m = 0;
        for (uint32_t s = 0; s < sets; s++) {
                rank_keep(c, L, s, k, keep, scratch);
                for (uint32_t h = c->per_head ? s : 0; h < (c->per_head ? s + 1 : L->n_kv_heads); h++) {
                        const float *last = L->last + (size_t)h * n;
                        double all = 0, kept = 0;
                        for (uint32_t i = 0; i < n; i++)
                                all += isfinite(last[i]) && last[i] > 0 ? last[i] : 0;
                        for (uint32_t i = 0; i < k; i++)
                                kept += isfinite(last[keep[i]]) && last[keep[i]] > 0 ? last[keep[i]] : 0;
                        m += (all > kept ? all - kept : 0) / L->n_kv_heads;
                }
        }
        float x = logf((float)m + 1e-6f);
        if (isnan(c->level[l]))
                c->level[l] = x;
        bool cut = x <= c->level[l];
        c->level[l] += cut ? -ATT_ETA * (1.0f - c->att_q) : ATT_ETA * c->att_q;
        c->cut_now[l] = cut;
}

static int conf_select(void *state, const struct policy_step *step, const struct policy_layer *L,
                       const struct policy_target *t, uint32_t *keep, float *logw, void *scratch) {
        const struct conf *c = state;
        (void)step;
        uint32_t n = L->n_tokens, k = t->keep, heads = c->per_head ? L->n_kv_heads : 1;
        for (uint32_t h = 0; h < heads; h++) {
                const float *ema = rank_keep(c, L, h, k, keep + (size_t)h * k, scratch);
                if (c->correction == 1)
                        sink_correction(ema, n, keep + (size_t)h * k, k, logw + (size_t)h * k);
        }
        return c->correction == 1 ? 1 : 0;
}

const struct policy_ops policy_conf_ops = {
        .name = "conf",
        .state_bytes = conf_bytes,
        .init = conf_init,
        .limits = conf_limits,
        .observes = conf_observes,
        .observe = conf_observe,
        .decide = conf_decide,
        .select = conf_select,
};

const struct policy_ops policy_conf_l_ops = {
        .name = "conf-l",
        .state_bytes = conf_bytes,
        .init = conf_l_init,
        .limits = conf_limits,
        .observes = conf_observes,
        .observe = conf_observe,
        .decide = conf_decide,
        .select = conf_select,
};
