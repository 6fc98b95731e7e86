/* plan.h: plan building (plan.c): the shared scratch it builds in, and what the session's step
 * asks of it: the policy's view of a layer, and the plan for the layers a policy shrinks. */
#pragma once

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "policy/policy.h"
#include "wire.h"

struct kvcd;
struct session;

/* Plan-building scratch, shared by all sessions (one thread builds one plan at a time), grown
 * when a session opens to fit its largest layer: n_kv_heads * max_layer_blocks * block_tokens. */
struct plan_scratch {
        size_t cap; /* entries per array */
        int32_t *pos;
        float *sum, *ema, *last, *logw;
        uint32_t *keep;
        uint32_t *work; /* 6 * cap */
        float *logw_delta;
        uint32_t *slot_of; /* a shared prefix's view: the slot of each token the policy sees */
        uint32_t *keep2;   /* the keep-set rewritten for a shared prefix */
        uint8_t *tier_now; /* each slot's tier (the policy's view) */
        uint8_t *tier_new; /* each kept slot's tier after the plan (per-token tiers) */
        struct policy_target targets[WIRE_MAX_LAYERS];
        bool forced[WIRE_MAX_LAYERS]; /* the arbiter's cap, not the policy, asked for this layer's plan */
};

/* Grows the scratch to entries per array; -ENOMEM leaves it as it was. */
int plan_scratch_reserve(struct plan_scratch *sc, size_t entries);
void plan_scratch_done(struct plan_scratch *sc);

/* Blocks of the session's plan buffer (0 when its policy never plans); sets s->mask_offset. */
uint64_t plan_buffer_units(struct session *s);

/* The tokens a policy sees in layer l: all but the shared slots the session masked. */
uint32_t plan_live_tokens(const struct session *s, uint32_t l);
/* The policy's view of layer l: its side arrays gathered from the pool into d->scratch,
 * [head][slot], without the shared slots the session masked. Valid until the next gather. */
void plan_gather(struct kvcd *d, const struct session *s, uint32_t l, struct policy_layer *out);
/* plan_gather of the arrays reads names (POLICY_READS_*) only; the view's others are NULL. */
void plan_gather_some(struct kvcd *d, const struct session *s, uint32_t l, uint32_t reads,
                      struct policy_layer *out);
/* Builds the plan for the layers whose target (d->scratch.targets) is below their length, writing
 * their keep-sets (and masks, and log-weight increments) into the pool; NULL when no layer has
 * one. INT8 blocks the plan needs are granted into g. The plan becomes s's outstanding one. */
Kvc__Plan *plan_build(struct kvcd *d, struct session *s, const struct policy_step *ps, Kvc__Grant *g);
/* After a PlanApplied: when a demotion of s was cut into links (plan.c's header), builds the next
 * link and sends it unasked with its grant; when it cannot (no room), an empty plan that ends the
 * chain. Nothing when no link is due or a plan is outstanding. */
void plan_follow(struct kvcd *d, struct session *s);
/* While memory is short: every session but except whose policy gives each token its tier and
 * that holds more than the arbiter's cap gets a plan that meets it, sent unasked (the ladder lowers
 * precision without waiting for its client's next step). */
void plan_shrink_all(struct kvcd *d, const struct session *except);
