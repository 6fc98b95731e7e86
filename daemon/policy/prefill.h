/* prefill.h: what the prefill-aware policies (snapkv, scope) share: watching the attention the
 * last prompt queries pay (SnapKV's observation window), and choosing the prompt's keep-set.
 *
 * kvc-run feeds a prompt one token per step, so the observation window is built from the `last`
 * score array over the final `window` prompt steps: the accumulator adds it up per layer, head
 * and slot. Slots are stable during the prompt because these policies plan nothing before the
 * prompt is complete. A client that writes the whole prompt and sends one PREFILL summary gets
 * one observed step: the last query's attention.
 */
#pragma once

#include "policy.h"

enum prefill_scorer {
        PREFILL_SNAPKV, /* pooled attention of the observation window */
        PREFILL_H2O,    /* attention summed over every prompt query (the `sum` array) */
        PREFILL_FULL,   /* keep the whole prompt */
};

extern const char *const prefill_scorer_words[];
extern const char *const prefill_pool_words[];

struct prefill_obs {
        uint32_t prompt; /* M: prompt tokens (0: unknown, nothing is observed) */
        uint32_t window; /* queries observed */
        uint32_t n_layers, n_kv_heads;
        uint32_t cap; /* slots per (layer, head) in acc */
        float *acc;   /* [n_layers][n_kv_heads][cap] */
};

/* Bytes of accumulator for this setup (the state's tail). */
size_t prefill_obs_bytes(const struct policy_setup *s);
void prefill_obs_init(struct prefill_obs *o, const struct policy_setup *s, uint32_t window, float *storage);
/* Whether step is one of the last `window` prompt steps. */
bool prefill_obs_wants(const struct prefill_obs *o, const struct policy_step *step);
void prefill_obs_add(struct prefill_obs *o, const struct policy_layer *L);

/* The prompt's keep-set for one layer and head: the top `top` slots of [0, M - window) by the
 * scorer, then the window [M - window, M). M = min(prompt, n). Writes top + window indices
 * ascending; returns how many. scratch holds 2n words. */
uint32_t prefill_keep(const struct prefill_obs *o, enum prefill_scorer scorer, uint32_t kernel, bool max_pool,
                      const struct policy_layer *L, uint32_t head, uint32_t top, uint32_t window,
                      uint32_t *keep, void *scratch);
