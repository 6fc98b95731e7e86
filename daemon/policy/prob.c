/* prob.c: eviction as sampling, with decode-time correction (the probabilistic view of KV
 * eviction, Geh et al., arXiv 2608.28293; formulas in notes/policies.md 2.2 and 2.4, our
 * derivation since the paper's text is not available).
 *
 * Attention over the kept tokens estimates attention over all of them. Deterministic top-k is a
 * zero-variance but biased estimator; sampling token i with a known inclusion probability pi_i
 * makes Horvitz-Thompson weights 1/pi_i available. Here:
 *   - the first `sinks` and the `protect` newest slots are always kept (pi = 1);
 *   - the other m = k - sinks - protect are drawn from the rest with inclusion probabilities
 *     pi_i = min(1, c w_i), w_i = exp((s_i / max s - 1) / temperature), c set so the pi sum to m
 *     (capping iterated), by systematic sampling in slot order: exactly m tokens, each with
 *     probability exactly pi_i, one uniform draw from the session's own generator (seed=);
 *   - temperature 0 is the deterministic scorer: top m by score, exactly.
 * The score s is `scorer=`: ema (default), sum, last.
 *
 * Corrections (`correction=`), through the log-weight the client's attention adds to each logit:
 *   ht    survivors get b_i += -log pi_i (Horvitz-Thompson: every kept weight inflated by 1/pi);
 *   sink  the evicted tokens' attention mass (their EMA share) is added to the first sink's
 *         weight instead: the softmax denominator keeps the evicted mass, survivors are not
 *         inflated, and the output moves toward the sink's value (a near no-op for attention
 *         sinks) rather than toward the survivors';
 *   moment  the evicted tokens are merged into one summary slot per layer and head (mean key,
 *         mean value, log-weight log n: kernels/summarize.h): a lower bound of their true weight
 *         for every query, instead of none at all;
 *   none  plain renormalised eviction.
 */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "policy.h"

enum prob_correction {
        CORRECTION_HT,
        CORRECTION_SINK,
        CORRECTION_NONE,
        CORRECTION_MOMENT,
};

static const char *const correction_words[] = { "ht", "sink", "none", "moment", NULL };
static const char *const prob_scorer_words[] = { "ema", "sum", "last", NULL };

struct prob {
        uint32_t budget;
        float temperature;
        uint32_t sinks;
        uint32_t protect;
        uint32_t scorer;
        uint32_t correction;
        uint32_t seed;
        uint32_t slack;
        uint32_t n_layers;
        uint64_t rng;
};

static const struct policy_param_spec prob_specs[] = {
        { "temperature", POLICY_PARAM_FLOAT, offsetof(struct prob, temperature), 0, 1e6, NULL },
        { "sinks", POLICY_PARAM_U32, offsetof(struct prob, sinks), 0, 1 << 20, NULL },
        { "protect", POLICY_PARAM_U32, offsetof(struct prob, protect), 0, 1 << 20, NULL },
        { "scorer", POLICY_PARAM_ENUM, offsetof(struct prob, scorer), 0, 0, prob_scorer_words },
        { "correction", POLICY_PARAM_ENUM, offsetof(struct prob, correction), 0, 0, correction_words },
        { "seed", POLICY_PARAM_U32, offsetof(struct prob, seed), 0, 4294967295.0, NULL },
        { "slack", POLICY_PARAM_U32, offsetof(struct prob, slack), 1, 1 << 20, NULL },
};

static size_t prob_bytes(const struct policy_setup *s) {
        (void)s;
        return sizeof(struct prob);
}

static int prob_init(void *state, const struct policy_setup *s, const struct policy_param *params, size_t n,
                     char *why, size_t why_len) {
        struct prob *p = state;
        p->budget = s->budget_tokens ? s->budget_tokens : 128;
        if (p->budget > s->max_tokens)
                p->budget = s->max_tokens;
        p->temperature = 0.1f;
        p->sinks = 4;
        p->protect = 16;
        p->seed = 1;
        p->slack = s->block_tokens;
        p->n_layers = s->n_layers;
        int r = policy_parse_params(p, prob_specs, sizeof(prob_specs) / sizeof(prob_specs[0]), params, n, why,
                                    why_len);
        if (r < 0)
                return r;
        if (p->sinks + p->protect >= p->budget) {
                snprintf(why, why_len, "sinks + protect (%u) leave no room in a budget of %u",
                         p->sinks + p->protect, p->budget);
                return -EINVAL;
        }
        if (p->correction == CORRECTION_SINK && p->sinks == 0) {
                snprintf(why, why_len, "correction=sink needs at least one sink");
                return -EINVAL;
        }
        p->rng = ((uint64_t)p->seed << 1) | 1; /* never zero */
        return 0;
}

static void prob_limits(const void *state, struct policy_limits *ret) {
        const struct prob *p = state;
        *ret = (struct policy_limits){ .budget = p->budget,
                                       .max_layer_tokens = p->budget + p->slack,
                                       .max_keep = p->budget,
                                       .summarize = p->correction == CORRECTION_MOMENT };
}

static void prob_decide(void *state, const struct policy_step *step, struct policy_target *t) {
        const struct prob *p = state;
        for (uint32_t l = 0; l < p->n_layers; l++)
                if (step->layer_tokens[l] >= p->budget + p->slack)
                        t[l].keep = p->budget;
}

/* xorshift64*, the session's own: a uniform in [0, 1). */
static double next_uniform(uint64_t *s) {
        *s ^= *s >> 12;
        *s ^= *s << 25;
        *s ^= *s >> 27;
        return (double)((*s * 0x2545f4914f6cdd1dull) >> 11) * (1.0 / 9007199254740992.0);
}

int prob_inclusion(const float *score, uint32_t n, uint32_t m, float temperature, double *pi) {
        if (!(temperature > 0) || m > n)
                return -EINVAL;
        double smax = 0;
        for (uint32_t i = 0; i < n; i++)
                if (isfinite(score[i]) && score[i] > smax)
                        smax = score[i];
        for (uint32_t i = 0; i < n; i++) {
                double z = isfinite(score[i]) && smax > 0 ? score[i] / smax : 0;
                /* the pi array holds w for now, in (0, 0.5]: 1 marks a capped entry, and a floor of
                 * e^-700 keeps every weight positive (no underflow at small temperatures) */
                pi[i] = 0.5 * exp(fmax((z - 1.0) / temperature, -700.0));
        }
        /* water-filling: scale the uncapped weights to the remaining mass, cap at 1, repeat. Every
         * round but the last caps at least one entry, and at most m are capped: m + 1 rounds. */
        double need = m;
        for (uint32_t round = 0; round <= m; round++) {
                double w = 0;
                for (uint32_t i = 0; i < n; i++)
                        if (pi[i] < 1.0)
                                w += pi[i];
                double scale = w > 0 && need > 0 ? need / w : 0;
                bool capped = false;
                for (uint32_t i = 0; i < n; i++) {
                        if (pi[i] < 1.0 && pi[i] * scale >= 1.0) {
                                pi[i] = 1.0;
                                need -= 1.0;
                                capped = true;
                        }
                }
                if (!capped) {
                        for (uint32_t i = 0; i < n; i++)
                                if (pi[i] < 1.0)
                                        pi[i] *= scale;
                        break;
                }
        }
        return 0;
}

/* Systematic sampling in slot order: exactly m of n, each i with probability pi[i]. */
static uint32_t systematic(const double *pi, uint32_t n, uint32_t m, double u, uint32_t *out) {
        double cum = 0, next = u;
        uint32_t got = 0;
        for (uint32_t i = 0; i < n && got < m; i++) {
                cum += pi[i];
                if (cum > next) {
                        out[got++] = i;
                        next += 1.0;
                }
        }
        return got;
}

static const float *scores_of(const struct prob *p, const struct policy_layer *L) {
        switch (p->scorer) {
        case 1: return L->sum;
        case 2: return L->last;
        }
        return L->ema;
}

static int prob_select(void *state, const struct policy_step *step, const struct policy_layer *L,
                       const struct policy_target *t, uint32_t *keep, float *logw, void *scratch) {
        struct prob *p = state;
        (void)step;
        uint32_t n = L->n_tokens, k = t->keep;
        uint32_t sinks = p->sinks < k ? p->sinks : k;
        uint32_t protect = p->protect < k - sinks ? p->protect : k - sinks;
        /* scratch: score [0, n), ema_mean [n, 2n), then either keep_ranked's work [2n, 3n) or the
         * candidates' pi (doubles, 8-aligned at word 2n) [2n, 2n + 2 cand): 4n words at most */
        float *score = scratch, *ema_mean = score + n; /* ema_mean: for the sink correction */
        uint32_t *work = (uint32_t *)scratch + 2 * (size_t)n;
        policy_mean_over_heads(scores_of(p, L), L->n_kv_heads, n, score);
        policy_mean_over_heads(L->ema, L->n_kv_heads, n, ema_mean);

        if (p->temperature == 0.0f || n <= k) {
                policy_keep_ranked(score, n, k, sinks, protect, keep, work);
                for (uint32_t i = 0; i < k; i++)
                        logw[i] = 0.0f;
        } else {
                /* candidates: slots [sinks, n - protect); m of them are kept */
                uint32_t cand = n - sinks - protect, m = k - sinks - protect;
                double *pi = (double *)work;
                prob_inclusion(score + sinks, cand, m, p->temperature, pi);
                for (uint32_t i = 0; i < sinks; i++)
                        keep[i] = i;
                /* u below 1 - 1e-9: the pi sum to m within ~1e-12, so exactly m are drawn */
                double u = next_uniform(&p->rng) * (1.0 - 1e-9);
                if (systematic(pi, cand, m, u, keep + sinks) != m)
                        return -EINVAL;
                for (uint32_t i = 0; i < k; i++)
                        logw[i] = 0.0f;
                for (uint32_t i = 0; i < m; i++) {
                        keep[sinks + i] += sinks;
                        if (p->correction == CORRECTION_HT)
                                logw[sinks + i] = (float)-log(pi[keep[sinks + i] - sinks]);
                }
                for (uint32_t i = 0; i < protect; i++)
                        keep[sinks + m + i] = n - protect + i;
        }
        if (p->correction == CORRECTION_SINK && k > 0) {
                double kept = 0, all = 0;
                for (uint32_t i = 0; i < n; i++)
                        all += ema_mean[i] > 0 && isfinite(ema_mean[i]) ? ema_mean[i] : 0;
                for (uint32_t i = 0; i < k; i++)
                        kept += ema_mean[keep[i]] > 0 && isfinite(ema_mean[keep[i]]) ? ema_mean[keep[i]] : 0;
                double sink = ema_mean[keep[0]] > 0 && isfinite(ema_mean[keep[0]]) ? ema_mean[keep[0]] : 0;
                if (all > kept && sink > 1e-12)
                        logw[0] = (float)fmin(log((sink + all - kept) / sink), 10.0);
        }
        return p->correction == CORRECTION_HT || p->correction == CORRECTION_SINK ? 1 : 0;
}

const struct policy_ops policy_prob_ops = {
        .name = "prob",
        .state_bytes = prob_bytes,
        .init = prob_init,
        .limits = prob_limits,
        .decide = prob_decide,
        .select = prob_select,
};
