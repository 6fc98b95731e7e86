/* snapkv.c: SnapKV (Li et al., arXiv 2404.14469; reference snapkv_utils.py), PyramidKV as
 * published (`pyramid`: the same prompt compression with per-layer budgets), and the prompt
 * observation shared with SCOPE.
 *
 * When the prompt is complete (the step at which M = prompt_tokens tokens have been appended),
 * each layer and KV head keeps the top (B - window) prompt slots by the attention the last
 * `window` prompt queries paid them, pooled over neighbouring slots (kernel, max or avg, padding
 * kernel / 2), plus the window itself. Decoding is not compressed afterwards, as in SnapKV: the
 * cache grows from there (up to the model's context). Defaults follow SCOPE's runs of SnapKV
 * (window 8, kernel 7, max pooling); pyramid=1 gives PyramidKV's per-layer budgets (beta 20).
 */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "prefill.h"

const char *const prefill_scorer_words[] = { "snapkv", "h2o", "full", NULL };
const char *const prefill_pool_words[] = { "max", "avg", NULL };

size_t prefill_obs_bytes(const struct policy_setup *s) {
        uint32_t cap = s->prompt_tokens < s->max_tokens ? s->prompt_tokens : s->max_tokens;
        return (size_t)s->n_layers * s->n_kv_heads * cap * sizeof(float);
}

void prefill_obs_init(struct prefill_obs *o, const struct policy_setup *s, uint32_t window, float *storage) {
        o->prompt = s->prompt_tokens;
        o->window = window;
        o->n_layers = s->n_layers;
        o->n_kv_heads = s->n_kv_heads;
        o->cap = s->prompt_tokens < s->max_tokens ? s->prompt_tokens : s->max_tokens;
        o->acc = storage;
}

bool prefill_obs_wants(const struct prefill_obs *o, const struct policy_step *step) {
        return o->prompt > 0 && step->appended <= o->prompt && step->appended + o->window > o->prompt;
}

void prefill_obs_add(struct prefill_obs *o, const struct policy_layer *L) {
        uint32_t n = L->n_tokens < o->cap ? L->n_tokens : o->cap;
        if (L->layer >= o->n_layers)
                return;
        for (uint32_t h = 0; h < o->n_kv_heads && h < L->n_kv_heads; h++) {
                float *acc = o->acc + ((size_t)L->layer * o->n_kv_heads + h) * o->cap;
                const float *last = L->last + (size_t)h * L->n_tokens;
                for (uint32_t i = 0; i < n; i++)
                        if (isfinite(last[i]))
                                acc[i] += last[i];
        }
}

uint32_t prefill_keep(const struct prefill_obs *o, enum prefill_scorer scorer, uint32_t kernel, bool max_pool,
                      const struct policy_layer *L, uint32_t head, uint32_t top, uint32_t window,
                      uint32_t *keep, void *scratch) {
        uint32_t m = o->prompt < L->n_tokens ? o->prompt : L->n_tokens;
        if (window > m)
                window = m;
        uint32_t cand = m - window; /* slots [0, cand) compete */
        if (top > cand || scorer == PREFILL_FULL)
                top = cand;
        float *score = scratch;
        uint32_t *work = (uint32_t *)scratch + L->n_tokens;
        const float *raw = scorer == PREFILL_H2O
                                   ? L->sum + (size_t)head * L->n_tokens
                                   : o->acc + ((size_t)L->layer * o->n_kv_heads + head) * o->cap;
        int half = (int)kernel / 2;
        for (uint32_t i = 0; i < cand; i++) {
                if (scorer != PREFILL_SNAPKV || kernel <= 1) {
                        score[i] = raw[i];
                        continue;
                }
                float best = -INFINITY, sum = 0.0f; /* padding: -inf for max, zeros for avg */
                for (int j = (int)i - half; j <= (int)i + half; j++) {
                        if (j < 0 || (uint32_t)j >= cand)
                                continue;
                        best = raw[j] > best ? raw[j] : best;
                        sum += raw[j];
                }
                score[i] = max_pool ? best : sum / (float)kernel;
        }
        select_topk(score, cand, top, keep, work);
        for (uint32_t i = 0; i < window; i++)
                keep[top + i] = cand + i;
        return top + window;
}

struct snapkv {
        uint32_t budget;
        uint32_t window;
        uint32_t kernel;
        uint32_t pool;
        bool pyramid;
        float beta;
        bool done;
        uint32_t n_layers;
        uint32_t max_tokens;
        struct prefill_obs obs;
};

static const struct policy_param_spec snapkv_specs[] = {
        { "window", POLICY_PARAM_U32, offsetof(struct snapkv, window), 0, 1 << 20, NULL },
        { "kernel", POLICY_PARAM_U32, offsetof(struct snapkv, kernel), 1, 255, NULL },
        { "pool", POLICY_PARAM_ENUM, offsetof(struct snapkv, pool), 0, 0, prefill_pool_words },
        { "beta", POLICY_PARAM_FLOAT, offsetof(struct snapkv, beta), 1.0001, 1e6, NULL },
        { "pyramid", POLICY_PARAM_BOOL, offsetof(struct snapkv, pyramid), 0, 1,
          NULL }, /* last: `pyramid` omits it */
};
#define SNAPKV_N_SPECS (sizeof(snapkv_specs) / sizeof(snapkv_specs[0]))

static size_t snapkv_bytes(const struct policy_setup *s) {
        return sizeof(struct snapkv) + prefill_obs_bytes(s);
}

static int snapkv_setup(struct snapkv *k, const struct policy_setup *s, const struct policy_param *params,
                        size_t n, size_t n_specs, char *why, size_t why_len) {
        k->budget = s->budget_tokens ? s->budget_tokens : 256;
        k->window = 8;
        k->kernel = 7;
        k->beta = 20.0f;
        k->n_layers = s->n_layers;
        k->max_tokens = s->max_tokens;
        int r = policy_parse_params(k, snapkv_specs, n_specs, params, n, why, why_len);
        if (r < 0)
                return r;
        if (k->window >= k->budget) {
                snprintf(why, why_len, "window %u leaves no room in a budget of %u", k->window, k->budget);
                return -EINVAL;
        }
        prefill_obs_init(&k->obs, s, k->window, (float *)(k + 1));
        return 0;
}

static int snapkv_init(void *state, const struct policy_setup *s, const struct policy_param *params, size_t n,
                       char *why, size_t why_len) {
        return snapkv_setup(state, s, params, n, SNAPKV_N_SPECS, why, why_len);
}

/* PyramidKV (Cai et al., arXiv 2406.02069) as KVCache-Factory's PyramidKVCluster runs it: SnapKV's
 * prompt compression (window 8, kernel 7, max pooling) with B - window spread over the layers by
 * the pyramid schedule and the window kept whole in every layer; decoding uncompressed. */
static int pyramid_init(void *state, const struct policy_setup *s, const struct policy_param *params,
                        size_t n, char *why, size_t why_len) {
        struct snapkv *k = state;
        k->pyramid = true;
        return snapkv_setup(k, s, params, n, SNAPKV_N_SPECS - 1, why, why_len);
}

/* PyramidKV spreads the selected part (B - window) over the layers; every layer keeps the window
 * beside it (pyramidkv_utils.py), so no layer's budget falls below its window. */
static uint32_t snapkv_budget(const struct snapkv *k, uint32_t l) {
        return k->pyramid ? k->window + policy_pyramid_budget(k->budget - k->window, l, k->n_layers, k->beta)
                          : k->budget;
}

static void snapkv_limits(const void *state, struct policy_limits *ret) {
        const struct snapkv *k = state;
        uint32_t most = 0;
        for (uint32_t l = 0; l < k->n_layers; l++)
                most = snapkv_budget(k, l) > most ? snapkv_budget(k, l) : most;
        *ret = (struct policy_limits){
                .budget = k->budget, .max_layer_tokens = k->max_tokens, .max_keep = most, .per_head = true
        };
}

static bool snapkv_observes(const void *state, const struct policy_step *step) {
        const struct snapkv *k = state;
        return !k->done && prefill_obs_wants(&k->obs, step);
}

static void snapkv_observe(void *state, const struct policy_step *step, const struct policy_layer *L,
                           void *scratch) {
        (void)step, (void)scratch;
        prefill_obs_add(&((struct snapkv *)state)->obs, L);
}

static void snapkv_decide(void *state, const struct policy_step *step, struct policy_target *t) {
        struct snapkv *k = state;
        if (k->done || k->obs.prompt == 0 || step->appended < k->obs.prompt)
                return;
        k->done = true; /* the prompt is in: compress it once */
        for (uint32_t l = 0; l < k->n_layers; l++)
                if (step->layer_tokens[l] > snapkv_budget(k, l))
                        t[l].keep = snapkv_budget(k, l);
}

static int snapkv_select(void *state, const struct policy_step *step, const struct policy_layer *L,
                         const struct policy_target *t, uint32_t *keep, float *logw, void *scratch) {
        const struct snapkv *k = state;
        (void)step, (void)logw;
        uint32_t tail = L->n_tokens > k->obs.prompt ? L->n_tokens - k->obs.prompt : 0; /* appended since */
        if (tail + k->window > t->keep)
                return -EINVAL;
        uint32_t top = t->keep - k->window - tail;
        for (uint32_t h = 0; h < L->n_kv_heads; h++) { /* per KV head, as kvpress does */
                uint32_t *kh = keep + (size_t)h * t->keep;
                uint32_t m = prefill_keep(&k->obs, PREFILL_SNAPKV, k->kernel, k->pool == 0, L, h, top,
                                          k->window, kh, scratch);
                for (uint32_t i = 0; i < tail; i++)
                        kh[m + i] = k->obs.prompt + i;
                if (m + tail != t->keep)
                        return -EINVAL;
        }
        return 0;
}

const struct policy_ops policy_pyramid_ops = {
        .name = "pyramid",
        .state_bytes = snapkv_bytes,
        .init = pyramid_init,
        .limits = snapkv_limits,
        .observes = snapkv_observes,
        .observe = snapkv_observe,
        .decide = snapkv_decide,
        .select = snapkv_select,
};

const struct policy_ops policy_snapkv_ops = {
        .name = "snapkv",
        .state_bytes = snapkv_bytes,
        .init = snapkv_init,
        .limits = snapkv_limits,
        .observes = snapkv_observes,
        .observe = snapkv_observe,
        .decide = snapkv_decide,
        .select = snapkv_select,
};
