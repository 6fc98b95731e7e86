/* ladder.c: the precision ladder's policy (issue 27): a byte budget filled by lowering precision
 * before anything is evicted.
 *
 *   ladder   the first `sinks` tokens and the newest `window` at the session's dtype; every other
 *            token ranked by an importance score (`score`: sum, the accumulated attention or what
 *            the client wrote there (docs/policies.md, "Importance without the question"), or ema)
 *            and given a tier by ladder_allocate: the most important highest, the bulk at 4 bits
 *            (`bulk`), the least important lowest, and evicted only what does not fit the budget
 *            even at the session's lowest tier. The session's tiers (OpenSession.tiers) are the
 *            ones it accepts: the lowest of them is as far as the arbiter may push it.
 *
 * The budget is bytes as kvcd charges them (OpenSession.budget_bytes), or budget_tokens tokens
 * per layer at the dtype when none is given; kvcd lowers it to the arbiter's cap while the node
 * or the tenant is short (policy_step.budget_bytes), so the same arithmetic answers both. Each
 * tier's blocks are whole, so a layer's budget gives up one block of every tier before the
 * allocation (what rounding up can cost), and the dtype one more (the block the newest tokens
 * fill until the next plan): the layer never holds more than its share, at any step.
 *
 * CONF-KV's confidence moves the split: `high` (a fraction of the candidates) plus `conf_gain`
 * times (1 - confidence) of them are held a tier above the bulk while the budget is below the
 * bulk's cost, so an unsure model keeps more at high precision (docs/quality.md measures it).
 *
 * Hysteresis: a layer is planned when it has grown by a block since its last plan, or the budget
 * fell; the allocation is linear in the tokens (one radix select per tier) and deterministic.
 */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "policy.h"

enum ladder_score {
        SCORE_SUM,
        SCORE_EMA,
};

static const char *const score_words[] = { "sum", "ema", NULL };

#define MAX_LAYERS     256u /* proto/wire.h's WIRE_MAX_LAYERS */
#define DEFAULT_BUDGET 256u
#define DEFAULT_SINKS  4u
#define DEFAULT_WINDOW 32u

struct ladder {
        uint32_t budget; /* tokens per layer at the dtype, when no bytes are given */
        uint64_t budget_bytes;
        uint32_t sinks, window, score, bulk_bits;
        float high, conf_gain;
        uint32_t n_layers, block_tokens, max_tokens;
        uint32_t planned_n[MAX_LAYERS]; /* the layer's length at its last plan */
        uint64_t planned_budget;        /* the layer budget of the last plans */
};

static const struct policy_param_spec ladder_specs[] = {
        { "sinks", POLICY_PARAM_U32, offsetof(struct ladder, sinks), 0, 1 << 20, NULL },
        { "window", POLICY_PARAM_U32, offsetof(struct ladder, window), 0, 1 << 20, NULL },
        { "score", POLICY_PARAM_ENUM, offsetof(struct ladder, score), 0, 0, score_words },
        { "bulk", POLICY_PARAM_U32, offsetof(struct ladder, bulk_bits), 2, 8, NULL },
        { "high", POLICY_PARAM_FLOAT, offsetof(struct ladder, high), 0, 1, NULL },
        { "conf_gain", POLICY_PARAM_FLOAT, offsetof(struct ladder, conf_gain), 0, 1, NULL },
};

static size_t ladder_bytes(const struct policy_setup *s) {
        (void)s;
        return sizeof(struct ladder);
}

static int ladder_init(void *state, const struct policy_setup *s, const struct policy_param *params, size_t n,
                       char *why, size_t why_len) {
        struct ladder *p = state;
        if (s->n_layers > MAX_LAYERS) {
                snprintf(why, why_len, "%u layers (at most %u)", s->n_layers, MAX_LAYERS);
                return -EINVAL;
        }
        p->budget = s->budget_tokens ? s->budget_tokens : DEFAULT_BUDGET;
        if (p->budget > s->max_tokens)
                p->budget = s->max_tokens;
        p->budget_bytes = s->budget_bytes;
        p->sinks = DEFAULT_SINKS;
        p->window = DEFAULT_WINDOW;
        p->bulk_bits = 4;
        p->high = 0.0f;
        p->n_layers = s->n_layers;
        p->block_tokens = s->block_tokens;
        p->max_tokens = s->max_tokens;
        return policy_parse_params(p, ladder_specs, sizeof(ladder_specs) / sizeof(ladder_specs[0]), params, n,
                                   why, why_len);
}

static void ladder_limits(const void *state, struct policy_limits *ret) {
        const struct ladder *p = state;
        *ret = (struct policy_limits){ .budget = p->budget,
                                       .max_layer_tokens = p->max_tokens,
                                       .max_keep = p->max_tokens,
                                       .token_tiers = true };
}

void ladder_allocate(const uint64_t *cost, uint32_t n_tiers, uint32_t T, uint64_t budget, uint32_t m,
                     uint32_t bulk, uint32_t high, uint32_t ret[POLICY_MAX_TIERS]) {
        memset(ret, 0, POLICY_MAX_TIERS * sizeof(uint32_t));
        if (!m || !n_tiers)
                return;
        /* in bytes times T: a tier's cost per token is then cost[t], exactly */
        uint32_t last = n_tiers - 1;
        uint64_t B = budget > UINT64_MAX / T ? UINT64_MAX : budget * T;
        if (bulk > last)
                bulk = last;
        if (high > m)
                high = m;
        if (B / m >= cost[0]) {
                ret[0] = m;
                return;
        }
        if (B / cost[last] < m) { /* even the lowest tier cannot hold them all */
                ret[last] = (uint32_t)(B / cost[last]);
                return;
        }
        if (B / m >= cost[bulk]) { /* lift the most important, a tier at a time */
                uint64_t spare = B - (uint64_t)m * cost[bulk];
                ret[bulk] = m;
                for (uint32_t t = bulk; t >= 1; t--) {
                        uint64_t step = cost[t - 1] - cost[t], y = step ? spare / step : ret[t];
                        if (y > ret[t])
                                y = ret[t];
                        ret[t] -= (uint32_t)y;
                        ret[t - 1] += (uint32_t)y;
                        spare -= y * step;
                        if (ret[t])
                                break;
                }
                return;
        }
        /* below the bulk: `high` a tier above it when that still fits, the least important lowered */
        uint32_t up = bulk ? bulk - 1 : 0;
        for (int with_high = high && up < bulk ? 1 : 0; with_high >= 0; with_high--) {
                uint32_t h = with_high ? high : 0;
                uint64_t fixed = (uint64_t)h * cost[up];
                if (fixed > B || (B - fixed) / cost[last] < m - h)
                        continue; /* the rest does not fit even at the lowest tier with them */
                memset(ret, 0, POLICY_MAX_TIERS * sizeof(uint32_t));
                ret[up] = h;
                ret[bulk] = m - h;
                uint64_t need = fixed + (uint64_t)(m - h) * cost[bulk] - B; /* > 0 here */
                for (uint32_t t = bulk; t < last && need; t++) {
                        uint64_t step = cost[t] - cost[t + 1];
                        uint64_t y = step ? (need + step - 1) / step : ret[t];
                        if (y > ret[t])
                                y = ret[t];
                        ret[t] -= (uint32_t)y;
                        ret[t + 1] += (uint32_t)y;
                        need = y * step >= need ? 0 : need - y * step;
                }
                return;
        }
}

/* The tier of the bulk: the highest with at most bulk_bits bits a value, else the lowest. */
static uint32_t bulk_tier(const struct ladder *p, const struct policy_step *st) {
        for (uint32_t t = 1; st->tier_bits && t < st->n_tiers; t++)
                if (st->tier_bits[t] <= p->bulk_bits)
                        return t;
        return st->n_tiers - 1;
}

/* The bytes layer l's blocks may hold (before rounding). */
static uint64_t layer_budget(const struct ladder *p, const struct policy_step *st) {
        uint64_t b = st->budget_bytes == UINT64_MAX ? UINT64_MAX : st->budget_bytes / p->n_layers;
        if (!p->budget_bytes) {
                uint64_t tok = (uint64_t)p->budget * st->tier_block_bytes[0] / p->block_tokens;
                b = tok < b ? tok : b;
        }
        return b;
}

/* The bytes a layer keeps aside from the allocation: a block of every tier for the rounding, and
 * one more of the dtype for the newest tokens (file header). */
static uint64_t layer_slack(const struct policy_step *st) {
        uint64_t slack = st->tier_block_bytes[0];
        for (uint32_t t = 0; t < st->n_tiers; t++)
                slack += st->tier_block_bytes[t];
        return slack;
}

/* A layer of n tokens: how many are protected (sinks and window), and the candidates' split
 * (counts[t]); returns the tokens kept. */
static uint32_t plan_counts(const struct ladder *p, const struct policy_step *st, uint32_t n,
                            uint32_t counts[POLICY_MAX_TIERS], uint32_t *ret_protected) {
        uint32_t T = p->block_tokens, P = p->sinks + p->window < n ? p->sinks + p->window : n;
        uint64_t B = layer_budget(p, st), c0 = st->tier_block_bytes[0], slack = layer_slack(st);
        B = B > slack ? B - slack : 0;
        memset(counts, 0, POLICY_MAX_TIERS * sizeof(uint32_t));
        uint64_t protected_cost = ((uint64_t)P * c0 + T - 1) / T;
        if (protected_cost > B) { /* a budget below the sinks and the window: what fits of them */
                uint64_t fit = B * T / c0;
                *ret_protected = fit < 1 ? 1 : (uint32_t)fit;
                return *ret_protected;
        }
        *ret_protected = P;
        uint32_t high = (uint32_t)lroundf((float)(n - P) *
                                          fminf(1.0f, p->high + p->conf_gain * (1.0f - st->confidence)));
        ladder_allocate(st->tier_block_bytes, st->n_tiers, T, B - protected_cost, n - P, bulk_tier(p, st), high,
                        counts);
        uint32_t kept = P;
        for (uint32_t t = 0; t < st->n_tiers; t++)
                kept += counts[t];
        return kept;
}

static void ladder_decide(void *state, const struct policy_step *st, struct policy_target *targets) {
        struct ladder *p = state;
        if (st->n_tiers < 2)
                return;
        uint64_t budget = layer_budget(p, st);
        bool fell = budget < p->planned_budget;
        for (uint32_t l = 0; l < p->n_layers; l++) {
                uint32_t n = st->layer_tokens[l], counts[POLICY_MAX_TIERS], P;
                if (!fell && n < p->planned_n[l] + p->block_tokens)
                        continue;
                uint32_t kept = plan_counts(p, st, n, counts, &P);
                if (kept == n && counts[0] == n - P)
                        continue; /* all of it at the dtype: nothing to do (no token goes up) */
                targets[l].keep = kept;
                p->planned_n[l] = kept;
        }
        p->planned_budget = budget;
}

/* Compacts the first m entries of (slot, score) to those not yet given a tier. */
static uint32_t unassigned(uint32_t *slot, float *score, uint32_t m, const uint8_t *tier_of) {
        uint32_t w = 0;
        for (uint32_t i = 0; i < m; i++)
                if (tier_of[slot[i]] == UINT8_MAX) {
                        slot[w] = slot[i];
                        score[w++] = score[i];
                }
        return w;
}

static int ladder_select_tiers(void *state, const struct policy_step *st, const struct policy_layer *L,
                               const struct policy_target *target, uint32_t *keep, uint8_t *tier,
                               void *scratch) {
        const struct ladder *p = state;
        uint32_t n = L->n_tokens, k = target->keep, counts[POLICY_MAX_TIERS], P;
        if (k > n || !k || !L->pos || st->n_tiers < 2)
                return -EINVAL;
        float *score = scratch;                       /* the candidates' scores, compacted */
        uint8_t *tier_of = (uint8_t *)(score + n);    /* each slot's new tier, UINT8_MAX: none yet */
        uint32_t *slot = (uint32_t *)(score + 2 * n); /* the candidates' slots, compacted */
        uint32_t *work = slot + n;
        memset(tier_of, UINT8_MAX, n);
        plan_counts(p, st, n, counts, &P);
        /* the protected tokens: sinks (by position) and the newest window, at the dtype */
        uint32_t sinks = 0, recent = P > p->sinks ? P - p->sinks : 0;
        for (uint32_t i = 0; i < n; i++)
                if (L->pos[i] >= 0 && (uint32_t)L->pos[i] < p->sinks)
                        sinks++;
        if (k < P) { /* below the sinks and window: the sinks first, then the newest */
                sinks = sinks < k ? sinks : k;
                recent = k - sinks;
                memset(counts, 0, sizeof(counts));
        }
        uint32_t s_left = sinks;
        for (uint32_t i = 0; i < n && s_left; i++)
                if (L->pos[i] >= 0 && (uint32_t)L->pos[i] < p->sinks && tier_of[i] == UINT8_MAX) {
                        tier_of[i] = 0;
                        s_left--;
                }
        for (uint32_t i = n, r = 0; i-- > 0 && r < recent;)
                if (tier_of[i] == UINT8_MAX) {
                        tier_of[i] = 0;
                        r++;
                }
        /* the rest by score, the mean over KV heads */
        policy_mean_over_heads(p->score == SCORE_EMA ? L->ema : L->sum, L->n_kv_heads, n, score + 0);
        uint32_t m = 0;
        for (uint32_t i = 0; i < n; i++)
                if (tier_of[i] == UINT8_MAX) {
                        score[m] = score[i];
                        slot[m++] = i;
                }
        /* a target that differs from this arithmetic (a link, or the arbiter's cap moved since the
         * decision): the counts follow the target, the difference taken at the lowest tier */
        uint32_t want = k - (sinks + recent < k ? sinks + recent : k), got = 0;
        for (uint32_t t = 0; t < st->n_tiers; t++)
                got += counts[t];
        if (got > want) {
                for (uint32_t t = st->n_tiers; t-- > 0 && got > want;) {
                        uint32_t d = counts[t] < got - want ? counts[t] : got - want;
                        counts[t] -= d;
                        got -= d;
                }
        } else {
                counts[st->n_tiers - 1] += want - got;
        }
        if (want > m)
                return -EINVAL;
        for (uint32_t t = 0; t < st->n_tiers; t++) {
                if (!counts[t])
                        continue;
                select_topk(score, m, counts[t], keep, work);
                for (uint32_t i = 0; i < counts[t]; i++)
                        tier_of[slot[keep[i]]] = (uint8_t)t;
                m = unassigned(slot, score, m, tier_of);
        }
        uint32_t w = 0;
        for (uint32_t i = 0; i < n; i++) {
                if (tier_of[i] == UINT8_MAX)
                        continue;
                uint8_t now = L->tier ? L->tier[i] : 0;
                keep[w] = i;
                tier[w++] = tier_of[i] > now ? tier_of[i] : now; /* no token goes up */
        }
        return w == k ? 0 : -EINVAL;
}

static uint64_t ladder_lowest_bytes(const void *state, const struct policy_step *st) {
        const struct ladder *p = state;
        uint32_t T = p->block_tokens, last = st->n_tiers - 1;
        uint64_t bytes = 0;
        for (uint32_t l = 0; l < p->n_layers; l++) {
                uint32_t n = st->layer_tokens[l], P = p->sinks + p->window < n ? p->sinks + p->window : n;
                bytes += layer_slack(st) + ((uint64_t)P * st->tier_block_bytes[0] + T - 1) / T +
                         ((uint64_t)(n - P) * st->tier_block_bytes[last] + T - 1) / T;
        }
        return bytes;
}

const struct policy_ops policy_ladder_ops = {
        .name = "ladder",
        .reads = POLICY_READS_POS | POLICY_READS_SUM | POLICY_READS_EMA,
        .state_bytes = ladder_bytes,
        .init = ladder_init,
        .limits = ladder_limits,
        .decide = ladder_decide,
        .select_tiers = ladder_select_tiers,
        .lowest_bytes = ladder_lowest_bytes,
};
