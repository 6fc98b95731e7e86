/* plan.c: plan building: what turns a session's state and its policy's targets into a plan in
 * the session's plan buffer. Owns the plan buffer's layout, the plan scratch all sessions share
 * (kvcd.scratch), and the policy's view of a layer.
 *
 * For each layer whose target is below what the policy sees: the layer's side arrays (pos, sum,
 * ema, last, logw) are gathered from the pool into the scratch, the policy selects a keep-set (a
 * policy that cannot shrink when the arbiter's cap forces it keeps the newest tokens), the summary
 * slot goes in, and the keep-set is checked (compact_check_keep) before anything of it is written:
 * a layer without a valid keep-set is left out of the plan. Then the layer's tiers are set
 * (plan_tiers: their new blocks granted with the plan, through session.c), the policy's log-weight
 * increments are added in the pool, the keep-set is written at the layer's offset, and the layer
 * joins the Plan, which becomes the session's outstanding one (session.c takes its PlanApplied).
 *
 * Tiers (the precision ladder): a layer's tokens go down when the policy asks (policy_target.low:
 * the oldest kept ones to tier 1) or when the session's tier_window says (every kept token but the
 * newest tier_window at the lowest tier, a block's worth at a time); a layer with nothing to
 * evict may still be planned, to demote only. No token goes up. A plan grows each lower tier of
 * a layer by at most one block: the blocks a demotion needs are granted before the ones it frees
 * come back, so a larger demotion would raise the session's charge by all of them at once (the
 * 41% peak of conf+INT8 at a 29% average, issue 26). The rest of such a demotion waits in
 * session_layer.wanted and goes in links: plan_follow() builds the next one as soon as the client
 * acknowledges the last (Plan.more tells it to wait), until the layer reaches what was wanted.
 *
 * The plan buffer: n_layers keep-sets of keep_cap entries (per KV head when the policy plans per
 * head), 4 bytes each (a demotion's keep-set, every slot, is written only where it fits: the
 * client takes keep_count == base_tokens for the identity); then, 8-byte aligned at mask_offset, per layer and KV head the mask of the
 * shared slots the session evicted. kvcd writes it only while no plan is outstanding (the client
 * reads it while it applies one), and writes log-weights only into slots below the length the plan
 * was built on (the client appends beyond them): kvcd and the client never write the same word.
 *
 * A shared prefix (prefix.c) is other sessions' too: the policy sees the layer without the shared
 * slots the session masked (scratch.slot_of maps its view back to slots), a keep-set keeps every
 * shared slot in place and the mask says which of them the session dropped, and nothing is ever
 * written into a shared slot.
 *
 * Apart from session.c because it is the one part of a step that reads the pool's side arrays and
 * writes the plan buffer, and the largest; the session's lifecycle, its grants, the arbiter's caps
 * and the acknowledgement of a plan stay with the session.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "clock.h"
#include "compact.h"
#include "kvcd.h"
#include "log.h"
#include "plan.h"
#include "policy/policy.h"
#include "pool.h"
#include "handlers.h"
#include "summarize.h"

void plan_scratch_done(struct plan_scratch *sc) {
        free(sc->pos);
        free(sc->sum);
        free(sc->ema);
        free(sc->last);
        free(sc->logw);
        free(sc->keep);
        free(sc->work);
        free(sc->logw_delta);
        free(sc->slot_of);
        free(sc->keep2);
        free(sc->tier_now);
        free(sc->tier_new);
        memset(sc, 0, sizeof(*sc));
}

int plan_scratch_reserve(struct plan_scratch *sc, size_t entries) {
        if (entries <= sc->cap)
                return 0;
        struct plan_scratch n = { .cap = entries };
        n.pos = malloc(entries * sizeof(int32_t));
        n.sum = malloc(entries * sizeof(float));
        n.ema = malloc(entries * sizeof(float));
        n.last = malloc(entries * sizeof(float));
        n.logw = malloc(entries * sizeof(float));
        n.keep = malloc(entries * sizeof(uint32_t));
        n.work = malloc(6 * entries * sizeof(uint32_t));
        n.logw_delta = malloc(entries * sizeof(float));
        n.slot_of = malloc(entries * sizeof(uint32_t));
        n.keep2 = malloc(entries * sizeof(uint32_t));
        n.tier_now = malloc(entries);
        n.tier_new = malloc(entries);
        if (!n.pos || !n.sum || !n.ema || !n.last || !n.logw || !n.keep || !n.work || !n.logw_delta ||
            !n.slot_of || !n.keep2 || !n.tier_now || !n.tier_new) {
                plan_scratch_done(&n);
                return -ENOMEM;
        }
        plan_scratch_done(sc);
        *sc = n;
        return 0;
}

/* Blocks of the plan buffer: one keep-set entry (4 bytes) per layer, head and token kept. */
uint64_t plan_buffer_units(struct session *s) {
        if (!s->keep_cap)
                return 0;
        uint64_t entries = (uint64_t)s->n_layers * s->keep_cap * (s->per_head ? s->n_kv_heads : 1);
        s->mask_offset = (entries * 4 + 7) / 8 * 8; /* then the masks of shared slots, per layer and head */
        uint64_t bytes = s->mask_offset + (uint64_t)s->n_layers * s->n_kv_heads * s->mask_stride;
        s->tier_offset = bytes; /* then, with per-token tiers, a byte per entry */
        if (s->token_tiers)
                bytes += entries;
        return (bytes + s->layout.block_bytes - 1) / s->layout.block_bytes;
}

/* Where slot i of layer L lives: its block (a pool offset), its layout, its slot there and (ret_end,
 * optional) the end of its tier's slots. The lowest tier's slots come first (kernels/ladder.h). */
static uint64_t slot_block(const struct session *s, const struct session_layer *L, uint32_t i,
                           const struct block_layout **lay, uint32_t *in_block, uint32_t *ret_end) {
        uint32_t T = s->layout.block_tokens, first = 0, t = s->n_tiers - 1;
        for (; t > 0 && i >= first + L->low[t]; t--)
                first += L->low[t];
        *lay = &s->tiers[t];
        *in_block = (i - first) % T;
        if (ret_end)
                *ret_end = t ? first + L->low[t] : UINT32_MAX;
        return L->t[t].blocks[(i - first) / T];
}

static bool is_masked(const uint8_t *mask, uint32_t j) {
        return mask[j / 8] >> (j % 8) & 1;
}

/* A shared prefix's slots this session has evicted (masked) in layer l, as applied. */
static uint32_t masked_count(const struct session *s, uint32_t l) {
        uint32_t n = 0, S = session_shared_tokens(s);
        const uint8_t *m = s->mask + (size_t)l * s->mask_stride;
        for (uint32_t i = 0; i < S / 8; i++)
                n += (uint32_t)__builtin_popcount(m[i]);
        return n;
}

/* The tokens a policy sees in layer l: all but the shared slots the session masked. */
uint32_t plan_live_tokens(const struct session *s, uint32_t l) {
        return s->layers[l].n_tokens - (s->n_shared_blocks ? masked_count(s, l) : 0);
}

/* A device pool: slots [at, at + cnt) of block blk, which are slots [i, i + cnt) of an n-slot
 * layer, in one read of the block's side arrays (pos to the block's end: five [head][slot] arrays)
 * staged in the scratch's work area (free until the policy selects). false when they do not fit
 * there: the caller reads them array by array. */
static bool gather_block(struct kvcd *d, const struct session *s, const struct block_layout *lay,
                         uint64_t blk, uint32_t at, uint32_t cnt, uint32_t i, uint32_t n) {
        struct plan_scratch *sc = &d->scratch;
        uint64_t bytes = lay->block_bytes - lay->pos_offset;
        if (bytes > 6 * sc->cap * sizeof(uint32_t))
                return false;
        uint8_t *stage = (uint8_t *)sc->work;
        if (pool_read(d->pool, blk + lay->pos_offset, stage, bytes) < 0)
                memset(stage, 0, bytes); /* plans on zeros, as a failed pool_read leaves its target */
        const struct {
                void *to;
                uint64_t offset;
        } arrays[5] = { { sc->pos, lay->pos_offset },
                        { sc->sum, lay->sum_offset },
                        { sc->ema, lay->ema_offset },
                        { sc->last, lay->last_offset },
                        { sc->logw, lay->logw_offset } };
        for (int a = 0; a < 5; a++)
                for (uint32_t h = 0; h < s->n_kv_heads; h++)
                        memcpy((uint32_t *)arrays[a].to + (size_t)h * n + i,
                               stage + (arrays[a].offset - lay->pos_offset) +
                                       ((uint64_t)h * lay->block_tokens + at) * 4u,
                               cnt * 4u);
        return true;
}

/* Copies the side arrays of layer l that reads names (POLICY_READS_*) out of the pool into the
 * scratch, [head][slot]; the view's other arrays are NULL. Runs of slots in one block are copied
 * at once. */
void plan_gather_some(struct kvcd *d, const struct session *s, uint32_t l, uint32_t reads,
                      struct policy_layer *out) {
        const struct session_layer *L = &s->layers[l];
        struct plan_scratch *sc = &d->scratch;
        uint32_t n = L->n_tokens, T = s->layout.block_tokens;
        uint32_t *to[5] = { (uint32_t *)sc->pos, (uint32_t *)sc->sum, (uint32_t *)sc->ema, (uint32_t *)sc->last,
                            (uint32_t *)sc->logw };

        for (uint32_t i = 0; i < n;) {
                const struct block_layout *lay;
                uint32_t at, end;
                uint64_t blk = slot_block(s, L, i, &lay, &at, &end);
                uint32_t cnt = T - at < n - i ? T - at : n - i;
                if (cnt > end - i)
                        cnt = end - i; /* the tier ends inside this block */
                if (d->backend->device && gather_block(d, s, lay, blk, at, cnt, i, n)) {
                        i += cnt; /* one copy off the GPU per block, not 5 per KV head */
                        continue;
                }
                const uint64_t off[5] = { lay->pos_offset, lay->sum_offset, lay->ema_offset, lay->last_offset,
                                          lay->logw_offset };
                for (int a = 0; a < 5; a++)
                        for (uint32_t h = 0; reads >> a & 1 && h < s->n_kv_heads; h++)
                                pool_read(d->pool, blk + off[a] + ((uint64_t)h * T + at) * 4u,
                                          to[a] + (size_t)h * n + i, cnt * 4u);
                i += cnt;
        }
        /* a shared prefix: the masked slots leave the view, the rest close up (stable, in place:
         * every token moves down or stays); slot_of maps the view back */
        uint32_t w = n;
        if (s->n_shared_blocks && masked_count(s, l)) {
                const uint8_t *m = s->mask + (size_t)l * s->mask_stride;
                uint32_t S = session_shared_tokens(s);
                w = 0;
                for (uint32_t j = 0; j < n; j++)
                        if (j >= S || !is_masked(m, j))
                                sc->slot_of[w++] = j;
                for (int a = 0; a < 5; a++)
                        for (uint32_t h = 0; reads >> a & 1 && h < s->n_kv_heads; h++)
                                for (uint32_t v = 0; v < w; v++)
                                        to[a][(size_t)h * w + v] = to[a][(size_t)h * n + sc->slot_of[v]];
        } else {
                for (uint32_t j = 0; j < n; j++)
                        sc->slot_of[j] = j;
        }
        const uint8_t *tier = NULL;
        if (s->n_tiers > 1) { /* lowest tier first (kernels/ladder.h) */
                uint32_t at = 0;
                for (uint32_t t = s->n_tiers - 1; t >= 1; t--)
                        for (uint32_t j = 0; j < L->low[t] && at < n; j++)
                                sc->tier_now[at++] = (uint8_t)t;
                memset(sc->tier_now + at, 0, n - at);
                tier = sc->tier_now;
        }
        *out = (struct policy_layer){ .layer = l,
                                      .tier = tier,
                                      .n_tokens = w,
                                      .n_kv_heads = s->n_kv_heads,
                                      .n_low = session_low_tokens(s, L, false),
                                      .pos = reads & POLICY_READS_POS ? sc->pos : NULL,
                                      .sum = reads & POLICY_READS_SUM ? sc->sum : NULL,
                                      .ema = reads & POLICY_READS_EMA ? sc->ema : NULL,
                                      .last = reads & POLICY_READS_LAST ? sc->last : NULL,
                                      .logw = reads & POLICY_READS_LOGW ? sc->logw : NULL };
}

void plan_gather(struct kvcd *d, const struct session *s, uint32_t l, struct policy_layer *out) {
        plan_gather_some(d, s, l, POLICY_READS_ALL, out);
}

static bool adds_logw(const float *delta, uint32_t slot, uint32_t shared) {
        return *delta != 0.0f && isfinite(*delta) && slot >= shared;
}

/* Adds the policy's log-weight increments into the pool, at the kept slots (every head when the
 * plan is per layer): one read and one write per block and head, of the run from its first to its
 * last slot with an increment (a device pool pays per copy). kvcd writes only slots below the
 * length it planned on: the client appends beyond them, so the two never write the same word. */
static void add_logw(struct kvcd *d, const struct session *s, uint32_t l, const uint32_t *keep, uint32_t k,
                     const float *delta) {
        const struct session_layer *L = &s->layers[l];
        uint32_t S = session_shared_tokens(s); /* shared slots are other sessions' too: never written */
        float run[WIRE_MAX_BLOCK_TOKENS];
        for (uint32_t h = 0; h < s->n_kv_heads; h++) {
                const uint32_t *kh = keep + (size_t)(s->per_head ? h : 0) * k;
                const float *dh = delta + (size_t)(s->per_head ? h : 0) * k;
                for (uint32_t i = 0; i < k;) {
                        if (!adds_logw(&dh[i], kh[i], S)) {
                                i++;
                                continue;
                        }
                        const struct block_layout *lay, *lay_j;
                        uint32_t first, at;
                        uint64_t blk = slot_block(s, L, kh[i], &lay, &first, NULL), last_i = i;
                        for (uint32_t j = i + 1; j < k && slot_block(s, L, kh[j], &lay_j, &at, NULL) == blk; j++)
                                if (adds_logw(&dh[j], kh[j], S))
                                        last_i = j;
                        slot_block(s, L, kh[last_i], &lay_j, &at, NULL);
                        uint32_t len = at - first + 1;
                        uint64_t where =
                                blk + lay->logw_offset + ((uint64_t)h * lay->block_tokens + first) * 4u;
                        if (pool_read(d->pool, where, run, len * sizeof(float)) == 0) {
                                for (uint32_t j = i; j <= last_i; j++)
                                        if (adds_logw(&dh[j], kh[j], S))
                                                run[kh[j] - kh[i]] += dh[j];
                                pool_write(d->pool, where, run, len * sizeof(float));
                        }
                        i = (uint32_t)last_i + 1;
                }
        }
}

/* The tiers a plan leaves in a layer that keeps k tokens per head (keep, per head when the session
 * plans per head): ret_n[t] kept tokens in tier t >= 1, the oldest kept ones in the lowest tier.
 * wanted[t] is how many kept tokens should be at tier t or lower (cumulative, so falling with t).
 * The answer never takes a token up (the kept tokens now at tier >= t stay at >= t), never gives a
 * tier more than one new block (the cap of a link), and never holds more than k. true when the
 * cap cut it short of what was wanted (the rest goes in the next link). */
static bool plan_tiers(const struct session *s, const struct session_layer *L, const uint32_t *keep, uint32_t k,
                       const uint32_t wanted[LADDER_TIERS], uint32_t ret_n[LADDER_TIERS]) {
        uint32_t T = s->layout.block_tokens, C = 0; /* C: kept tokens at the tiers below t */
        bool capped = false;
        memset(ret_n, 0, LADDER_TIERS * sizeof(uint32_t));
        uint32_t floor[LADDER_TIERS] = { 0 }, now = 0;
        for (uint32_t t = s->n_tiers - 1; t >= 1; t--) { /* kept tokens at tier >= t now, most of any head */
                now += L->low[t];
                for (uint32_t h = 0; h < (s->per_head ? s->n_kv_heads : 1u); h++) {
                        uint32_t kept = 0;
                        while (kept < k && keep[(size_t)h * k + kept] < now)
                                kept++;
                        floor[t] = kept > floor[t] ? kept : floor[t];
                }
        }
        for (uint32_t t = s->n_tiers - 1; t >= 1; t--) {
                uint32_t want = wanted[t] > C ? wanted[t] : C;
                want = floor[t] > want ? floor[t] : want;
                want = want < k ? want : k;
                uint64_t cap = (uint64_t)C + ((uint64_t)L->t[t].n + 1) * T;
                if (want > cap) {
                        want = (uint32_t)cap;
                        capped = true;
                }
                ret_n[t] = want - C;
                C = want;
        }
        return capped;
}

/* What layer l wants of its tiers after keeping k of its n tokens (cumulative, as plan_tiers takes
 * them): the policy's low (tier 1), the tier_window (the lowest tier: every kept token but the
 * newest window, once a block's worth is due), and what an earlier link did not reach. */
static void plan_wanted(const struct session *s, const struct session_layer *L, uint32_t k, uint32_t low,
                        uint32_t ret[LADDER_TIERS]) {
        uint32_t T = s->layout.block_tokens, last = s->n_tiers - 1;
        memset(ret, 0, LADDER_TIERS * sizeof(uint32_t));
        if (last == 0)
                return;
        ret[1] = low;
        if (s->tier_window && k > s->tier_window) {
                uint32_t at_last = L->low[last] < k ? L->low[last] : k;
                if (k - s->tier_window >= at_last + T)
                        ret[last] = k - s->tier_window;
        }
        for (uint32_t t = 1; t <= last; t++)
                if (L->wanted[t] > ret[t])
                        ret[t] = L->wanted[t] < k ? L->wanted[t] : k;
        for (uint32_t t = last; t > 1; t--) /* cumulative: falling with t */
                if (ret[t] > ret[t - 1])
                        ret[t - 1] = ret[t];
}

/* Per-token tiers: the counts ret_n[t] of the kept tokens' tiers (tier, one per keep entry) after
 * the cap of a link: a lower tier grows by at most one block in a plan, the newest of the tokens
 * sent there beyond it staying a tier higher (never above their tier now: now, per slot). true
 * when the cap cut the demotion short (the policy is asked again in the next link). */
static bool token_tiers_cap(const struct session *s, const struct session_layer *L, const uint32_t *keep,
                            uint32_t k, const uint8_t *now, uint8_t *tier, uint32_t ret_n[LADDER_TIERS]) {
        uint32_t T = s->layout.block_tokens;
        bool capped = false;
        memset(ret_n, 0, LADDER_TIERS * sizeof(uint32_t));
        for (uint32_t i = 0; i < k; i++)
                ret_n[tier[i]]++;
        for (uint32_t t = s->n_tiers - 1; t >= 1; t--) {
                uint64_t cap = ((uint64_t)L->t[t].n + 1) * T;
                for (uint32_t i = k; i-- > 0 && ret_n[t] > cap;)
                        if (tier[i] == t && now[keep[i]] < t) {
                                tier[i] = (uint8_t)(t - 1);
                                ret_n[t]--;
                                ret_n[t - 1]++;
                                capped = true;
                        }
        }
        return capped;
}

/* Whether a per-token plan keeping k of the layer's n slots changes anything. */
static bool token_tiers_change(uint32_t n, const uint32_t *keep, uint32_t k, const uint8_t *now,
                               const uint8_t *tier) {
        if (k != n)
                return true;
        for (uint32_t i = 0; i < k; i++)
                if (tier[i] != now[keep[i]])
                        return true;
        return false;
}

/* Whether the tiers after a plan differ from the layer's now. */
static bool tiers_change(const struct session *s, const struct session_layer *L, const uint32_t n[LADDER_TIERS]) {
        for (uint32_t t = 1; t < s->n_tiers; t++)
                if (n[t] != L->low[t])
                        return true;
        return false;
}

/* Grants into g the blocks the lower tiers of layer l need for n[t] tokens each. All or nothing:
 * -ENOSPC (or -ENOMEM) gives back what this call took. */
static int grant_tiers(struct kvcd *d, struct wire_arena *a, struct session *s, uint32_t l,
                       const uint32_t n[LADDER_TIERS], Kvc__Grant *g) {
        struct session_layer *L = &s->layers[l];
        uint32_t T = s->layout.block_tokens;
        size_t first = g->n_layers;
        for (uint32_t t = 1; t < s->n_tiers; t++) {
                uint32_t need = (n[t] + T - 1) / T;
                if (need <= L->t[t].n)
                        continue;
                Kvc__LayerBlocks *lb = session_grant_layer(a, g, l, t, need - L->t[t].n);
                int r = lb ? session_grow_table(d, s, l, t, need, lb) : -ENOMEM;
                if (r < 0) { /* the failed tier took nothing; the ones before it give theirs back */
                        if (lb)
                                g->n_layers--;
                        while (g->n_layers > first) {
                                const Kvc__LayerBlocks *done = g->layers[--g->n_layers];
                                session_shrink_table(d, s, l, done->tier, (uint32_t)done->n_blocks);
                        }
                        return r;
                }
        }
        return 0;
}

/* Puts the summary slot into a keep-set of k - 1 slots (ascending, of n): the slot already marked
 * as the summary (position -1 in head 0), else the first slot the keep-set drops, which becomes
 * the summary. Returns the new count; *ret_slot is the summary's slot. */
static uint32_t keep_summary(const struct policy_layer *view, uint32_t *keep, uint32_t k,
                             uint32_t *ret_slot) {
        uint32_t slot = UINT32_MAX;
        for (uint32_t i = 0; i < view->n_tokens && slot == UINT32_MAX; i++)
                if (view->pos[i] == SUMMARY_POS)
                        slot = i;
        if (slot == UINT32_MAX) /* the first dropped slot carries the summary from now on */
                for (uint32_t i = 0, j = 0; i < view->n_tokens && slot == UINT32_MAX; i++, j++)
                        if (j >= k || keep[j] != i)
                                slot = i;
        *ret_slot = slot;
        uint32_t at = 0;
        while (at < k && keep[at] < slot)
                at++;
        if (at < k && keep[at] == slot)
                return k;
        memmove(keep + at + 1, keep + at, (k - at) * sizeof(uint32_t));
        keep[at] = slot;
        return k + 1;
}

/* A keep-set of the policy's view (k per head, view indices) rewritten for a shared prefix of S
 * slots: the slots it keeps, every shared slot first and in place (keep2, k2 per head), with the
 * shared slots no head keeps added to the layer's mask (mask, updated). Heads keep equally many:
 * one that kept fewer private slots keeps its newest others too. */
static uint32_t keep_with_prefix(struct kvcd *d, const struct session *s, uint32_t n, uint32_t S,
                                 uint32_t heads, const uint32_t *keep, uint32_t k, uint8_t *mask,
                                 uint32_t *keep2) {
        const uint32_t *slot_of = d->scratch.slot_of;
        uint8_t *in = (uint8_t *)d->scratch.work; /* one byte per slot: this head keeps it */
        uint32_t p_max = 0;
        for (uint32_t h = 0; h < heads; h++) {
                uint32_t p = 0;
                for (uint32_t i = 0; i < k; i++)
                        p += slot_of[keep[(size_t)h * k + i]] >= S;
                p_max = p > p_max ? p : p_max;
        }
        for (uint32_t j = 0; j < S; j++) { /* masked unless some head keeps it */
                bool kept = false;
                for (uint32_t h = 0; h < heads && !kept; h++)
                        for (uint32_t i = 0; i < k && !kept; i++)
                                kept = slot_of[keep[(size_t)h * k + i]] == j;
                if (!kept)
                        mask[j / 8] |= (uint8_t)(1u << (j % 8));
        }
        uint32_t k2 = S + p_max;
        for (uint32_t h = 0; h < heads; h++) {
                memset(in, 0, n);
                uint32_t p = 0;
                for (uint32_t i = 0; i < k; i++) {
                        uint32_t j = slot_of[keep[(size_t)h * k + i]];
                        if (j >= S) {
                                in[j] = 1;
                                p++;
                        }
                }
                for (uint32_t j = n; j-- > S && p < p_max;) /* even the heads out: the newest */
                        if (!in[j]) {
                                in[j] = 1;
                                p++;
                        }
                uint32_t *out = keep2 + (size_t)h * k2, w = 0;
                for (uint32_t j = 0; j < S; j++)
                        out[w++] = j;
                for (uint32_t j = S; j < n; j++)
                        if (in[j])
                                out[w++] = j;
        }
        (void)s;
        return k2;
}

/* The keep-set of layer l (k per head) into the scratch, chosen by the policy: the keep-set's
 * address and its count (the summary slot and a shared prefix included), or NULL to leave the layer
 * out (no valid keep-set, or a shared prefix's plan that would change nothing). *ret_deltas: the
 * policy's log-weight increments are still to be added. */
static uint32_t *plan_select(struct kvcd *d, struct session *s, const struct policy_step *ps, uint32_t l,
                             uint32_t *ret_k, uint32_t *ret_summary, bool *ret_deltas) {
        struct policy_target *targets = d->scratch.targets;
        uint32_t heads = s->per_head ? s->n_kv_heads : 1, S = session_shared_tokens(s);
        uint32_t n = s->layers[l].n_tokens, live = plan_live_tokens(s, l), k = targets[l].keep;
        struct policy_layer view;
        uint32_t reads = s->policy->ops->reads ? s->policy->ops->reads : POLICY_READS_ALL;
        plan_gather_some(d, s, l, reads | (s->summarize ? POLICY_READS_POS : 0), &view);
        uint32_t *keep = d->scratch.keep, summary = UINT32_MAX;
        struct policy_target t = targets[l];
        if (s->summarize && k >= 2)
                t.keep = k - 1; /* one slot for the summary */
        int r = s->token_tiers ? s->policy->ops->select_tiers(s->policy->state, ps, &view, &t, keep,
                                                              d->scratch.tier_new, d->scratch.work)
                               : s->policy->ops->select(s->policy->state, ps, &view, &t, keep,
                                                        d->scratch.logw_delta, d->scratch.work);
        if (r < 0 && d->scratch.forced[l]) { /* a policy that cannot shrink on demand: the newest stay */
                for (uint32_t h = 0; h < heads; h++)
                        for (uint32_t i = 0; i < t.keep; i++)
                                keep[(size_t)h * t.keep + i] = live - t.keep + i;
                r = 0;
        }
        bool deltas = r == 1;
        if (r >= 0 && s->summarize && k >= 2)
                k = keep_summary(&view, keep, t.keep, &summary);
        for (uint32_t h = 0; r >= 0 && h < heads; h++)
                r = compact_check_keep(keep + (size_t)h * k, k, live);
        if (r < 0) {
                log_error("session %llu: policy %s gave no valid keep-set for layer %u", (unsigned long long)s->id,
                          s->policy_name, l);
                return NULL;
        }
        if (S) {              /* a shared prefix: slots kept in place, the evicted ones masked */
                if (deltas) { /* the increments go with the policy's own keep-set, as slots */
                        for (size_t i = 0; i < (size_t)k * heads; i++)
                                d->scratch.keep2[i] = d->scratch.slot_of[keep[i]];
                        add_logw(d, s, l, d->scratch.keep2, k, d->scratch.logw_delta);
                        deltas = false;
                }
                uint8_t *mask = s->mask_next + (size_t)l * s->mask_stride;
                k = keep_with_prefix(d, s, n, S, heads, keep, k, mask, d->scratch.keep2);
                keep = d->scratch.keep2;
                /* all private slots kept: a plan that only masks (the compaction moves nothing) */
                if (k > s->keep_cap ||
                    (k >= n && memcmp(mask, s->mask + (size_t)l * s->mask_stride, s->mask_stride) == 0))
                        return NULL;
                for (uint32_t h = 0; h < s->n_kv_heads; h++)
                        pool_write(d->pool,
                                   s->plan_offset + s->mask_offset +
                                           ((uint64_t)l * s->n_kv_heads + h) * s->mask_stride,
                                   mask, s->mask_stride);
        }
        *ret_k = k;
        *ret_summary = summary;
        *ret_deltas = deltas;
        return keep;
}

/* The prompt blocks a keep-set (k per head, heads of them) leaves whole: s->plan_intact. */
static void note_intact(struct session *s, const uint32_t *keep, uint32_t k, uint32_t heads) {
        for (uint32_t h = 0; h < heads && s->prompt_alive; h++) {
                uint32_t same = 0;
                while (same < k && keep[(size_t)h * k + same] == same)
                        same++;
                if (same / 16 < s->plan_intact)
                        s->plan_intact = same / 16;
        }
}

/* A layer's entry in the plan *pp (made on the first): layer l, built on n tokens, keeping k, with
 * tiers[t] of them in each lower tier after it. NULL when the arena is full. */
static Kvc__LayerPlan *layer_plan_add(const struct session *s, struct wire_arena *a, Kvc__Plan **pp, uint32_t l,
                                      uint32_t n, uint32_t k, const uint32_t tiers[LADDER_TIERS]) {
        Kvc__Plan *p = *pp;
        if (!p) {
                p = wire_arena_alloc(a, sizeof(*p));
                Kvc__LayerPlan **layers = wire_arena_alloc(a, s->n_layers * sizeof(*layers));
                if (!p || !layers)
                        return NULL;
                kvc__plan__init(p);
                p->layers = layers;
                *pp = p;
        }
        Kvc__LayerPlan *lp = wire_arena_alloc(a, sizeof(*lp));
        uint32_t *tt = s->n_tiers > 1 ? wire_arena_alloc(a, (s->n_tiers - 1) * sizeof(uint32_t)) : NULL;
        if (!lp || (s->n_tiers > 1 && !tt))
                return NULL;
        kvc__layer_plan__init(lp);
        lp->layer = l;
        lp->base_tokens = n;
        lp->keep_count = k;
        lp->per_head = s->per_head;
        if (s->n_tiers > 1) {
                memcpy(tt, tiers + 1, (s->n_tiers - 1) * sizeof(uint32_t));
                lp->tier_tokens = tt;
                lp->n_tier_tokens = s->n_tiers - 1;
        }
        /* clients before the ladder: their only tier is INT8 */
        lp->q8_tokens = s->n_tiers == 2 && s->tiers[1].dtype == BLOCK_DTYPE_Q8 ? tiers[1] : 0;
        p->layers[p->n_layers++] = lp;
        return lp;
}

/* A layer of a session whose policy gives each kept token its tier (the ladder): asks the policy
 * when its target (or a link: ps NULL) says, caps the demotion to a block per tier (the rest in
 * the next link: L->relink), grants the lower tiers' blocks into g, writes the keep-set and the
 * tiers into the plan buffer and adds the layer to *pp. 0, or -ENOMEM when the arena is full. */
static int build_token_tiers(struct kvcd *d, struct session *s, const struct policy_step *ps, uint32_t l,
                             Kvc__Grant *g, struct wire_arena *a, Kvc__Plan **pp) {
        struct session_layer *L = &s->layers[l];
        uint32_t n = L->n_tokens, tiers[LADDER_TIERS], summary;
        bool link = !ps, deltas;
        if (link) {
                if (!L->relink)
                        return 0;
                d->scratch.targets[l] = (struct policy_target){ .keep = n };
                s->link_step.layer_tokens = NULL; /* a link decides nothing: select reads its layer */
                ps = &s->link_step;
        }
        L->relink = false;
        if (d->scratch.targets[l].keep == POLICY_NO_PLAN || d->scratch.targets[l].keep > n)
                return 0;
        uint32_t k;
        uint32_t *keep = plan_select(d, s, ps, l, &k, &summary, &deltas);
        if (!keep)
                return 0;
        uint8_t *tier = d->scratch.tier_new, *now = d->scratch.tier_now;
        bool capped = token_tiers_cap(s, L, keep, k, now, tier, tiers);
        if (!token_tiers_change(n, keep, k, now, tier))
                return 0;
        if (grant_tiers(d, a, s, l, tiers, g) < 0) { /* no room below: demote nothing new */
                for (uint32_t i = 0; i < k; i++)
                        tier[i] = now[keep[i]];
                capped = token_tiers_cap(s, L, keep, k, now, tier, tiers);
                if (k == n || grant_tiers(d, a, s, l, tiers, g) < 0)
                        return 0;
        }
        L->relink = capped;
        memcpy(L->planned, tiers, sizeof(L->planned));
        note_intact(s, keep, k, 1);
        uint64_t at = (uint64_t)l * s->keep_cap;
        pool_write(d->pool, s->plan_offset + at * 4u, keep, (size_t)k * sizeof(uint32_t));
        pool_write(d->pool, s->plan_offset + s->tier_offset + at, tier, k);
        Kvc__LayerPlan *lp = layer_plan_add(s, a, pp, l, n, k, tiers);
        if (!lp)
                return -ENOMEM;
        lp->keep_offset = (uint32_t)at;
        lp->tier_offset = (uint32_t)(1 + s->tier_offset + at);
        return 0;
}

/* Builds the plan for the layers with a target below their length, or tiers to lower; NULL when
 * none has. The lower tiers' blocks the plan needs are granted into g. With ps NULL: a link of a
 * demotion (plan_follow), the policy not asked. */
static Kvc__Plan *build(struct kvcd *d, struct session *s, const struct policy_step *ps, uint64_t base_step,
                        Kvc__Grant *g, struct wire_arena *a) {
        struct policy_target *targets = d->scratch.targets;
        uint32_t heads = s->per_head ? s->n_kv_heads : 1, S = session_shared_tokens(s);
        uint64_t per_layer = (uint64_t)s->keep_cap * heads;
        Kvc__Plan *p = NULL;
        bool more = false;
        s->plan_intact = s->prompt_alive;
        if (s->mask)
                memcpy(s->mask_next, s->mask, (size_t)s->n_layers * s->mask_stride);

        for (uint32_t l = 0; l < s->n_layers; l++) {
                struct session_layer *L = &s->layers[l];
                if (s->token_tiers) {
                        if (build_token_tiers(d, s, ps, l, g, a, &p) < 0)
                                return NULL;
                        more |= L->relink;
                        continue;
                }
                uint32_t n = L->n_tokens, live = plan_live_tokens(s, l), k = ps ? targets[l].keep : POLICY_NO_PLAN;
                bool evicts = k != POLICY_NO_PLAN && k < live && k <= s->max_keep;
                uint32_t wanted[LADDER_TIERS], tiers[LADDER_TIERS];
                plan_wanted(s, L, evicts ? k : n, ps ? targets[l].low : 0, wanted);
                bool demotes = false; /* some tier >= t is to hold more than it does */
                for (uint32_t t = s->n_tiers - 1, now = 0; t >= 1; t--) {
                        now += L->low[t];
                        demotes |= wanted[t] > now;
                }
                /* a demotion alone keeps every slot: the identity, which a client infers from
                 * keep_count == base_tokens; a device pool's compactor reads it from the buffer */
                bool written = evicts || n <= s->keep_cap;
                if (!evicts && (!demotes || (d->backend->device && !written)))
                        continue;
                uint32_t *keep = d->scratch.keep, summary = UINT32_MAX;
                bool deltas = false;
                if (evicts) {
                        keep = plan_select(d, s, ps, l, &k, &summary, &deltas);
                        if (!keep)
                                continue;
                } else { /* a demotion alone: every token kept (no shared prefix: tiers exclude it) */
                        k = n;
                        for (uint32_t h = 0; h < heads; h++)
                                for (uint32_t i = 0; i < n; i++)
                                        keep[(size_t)h * n + i] = i;
                }
                bool capped = plan_tiers(s, L, keep, k, wanted, tiers);
                if (!evicts && !tiers_change(s, L, tiers)) {
                        memset(L->wanted, 0, sizeof(L->wanted));
                        continue;
                }
                if (grant_tiers(d, a, s, l, tiers, g) < 0) { /* no room below: demote nothing new */
                        uint32_t none[LADDER_TIERS] = { 0 };
                        capped = false;
                        plan_tiers(s, L, keep, k, none, tiers);
                        if (!evicts || grant_tiers(d, a, s, l, tiers, g) < 0)
                                continue;
                }
                if (capped) {
                        memcpy(L->wanted, wanted, sizeof(L->wanted));
                        more = true;
                } else {
                        memset(L->wanted, 0, sizeof(L->wanted));
                }
                memcpy(L->planned, tiers, sizeof(L->planned));
                note_intact(s, keep, k, heads);
                if (deltas)
                        add_logw(d, s, l, keep, k, d->scratch.logw_delta);
                if (written) /* for a device pool's compactor, and clients before the ladder */
                        pool_write(d->pool, s->plan_offset + l * per_layer * 4u, keep,
                                   (size_t)k * heads * sizeof(uint32_t));

                Kvc__LayerPlan *lp = layer_plan_add(s, a, &p, l, n, k, tiers);
                if (!lp)
                        return NULL;
                lp->keep_offset = written ? (uint32_t)(l * per_layer) : 0;
                lp->summary_slot = summary == UINT32_MAX ? 0 : summary + 1;
                lp->shared_tokens = S;
        }
        if (p) {
                p->session_id = s->id;
                p->plan_id = ++s->next_plan_id;
                p->base_step = base_step;
                p->more = more;
                s->pending_plan_id = p->plan_id;
                s->pending_since_usec = now_usec();
                s->stats.plans++;
                d->n.plans++;
        }
        return p;
}

Kvc__Plan *plan_build(struct kvcd *d, struct session *s, const struct policy_step *ps, Kvc__Grant *g) {
        return build(d, s, ps, ps->step, g, d->out);
}

/* Whether a layer of s has a demotion cut into links still to go. */
static bool links_pending(const struct session *s) {
        for (uint32_t l = 0; l < s->n_layers; l++) {
                if (s->layers[l].relink)
                        return true;
                for (uint32_t t = 1; t < s->n_tiers; t++)
                        if (s->layers[l].wanted[t])
                                return true;
        }
        return false;
}

/* The arena and the empty grant of a plan kvcd sends unasked: its own arena, as relocate_kick's,
 * since it may come in the middle of a request. NULL when the arena is full. */
static Kvc__Grant *unasked_grant(struct kvcd *d, const struct session *s, struct wire_arena **ret_a) {
        struct wire_arena *a = d->notes ? d->notes : d->out;
        if (d->notes)
                wire_arena_reset(d->notes);
        Kvc__Grant *g = wire_arena_alloc(a, sizeof(*g));
        Kvc__LayerBlocks **lbs = wire_arena_alloc(a, LADDER_TIERS * s->n_layers * sizeof(*lbs));
        if (!g || !lbs)
                return NULL;
        kvc__grant__init(g);
        g->session_id = s->id;
        g->layers = lbs;
        *ret_a = a;
        return g;
}

/* A session whose policy gives each token its tier and holds more than the arbiter's cap now:
 * its policy asked at once, on its last step's summary, and the plan sent unasked, so that the
 * memory comes back without waiting for the session's next step (another session may be waiting
 * for it). */
static void shrink_now(struct kvcd *d, struct session *s) {
        /* not one waiting for memory: its grant would cross the plan (the client releases the
         * tails of its tables as it knows them) */
        if (!s->token_tiers || !s->stepped || s->pending_plan_id || !s->owner->bound || s->bytes <= s->cap_bytes ||
            s->wait.kind != WAIT_NONE)
                return;
        struct wire_arena *a;
        Kvc__Grant *g = unasked_grant(d, s, &a);
        if (!g)
                return;
        uint32_t live[WIRE_MAX_LAYERS];
        for (uint32_t l = 0; l < s->n_layers; l++) {
                live[l] = plan_live_tokens(s, l);
                d->scratch.targets[l] = (struct policy_target){ .keep = POLICY_NO_PLAN };
        }
        struct policy_step ps = s->link_step;
        ps.layer_tokens = live;
        ps.budget_bytes = session_blocks_budget(s);
        s->policy->ops->decide(s->policy->state, &ps, d->scratch.targets);
        s->link_step = ps;
        Kvc__Plan *p = build(d, s, &ps, s->last_step, g, a);
        if (p && send_unasked_plan(d, s, p, g) < 0)
                log_warning("session %llu: cannot send the plan that meets the arbiter's cap (its client is gone?)",
                            (unsigned long long)s->id);
}

void plan_shrink_all(struct kvcd *d, const struct session *except) {
        if (!d->budget.pressure)
                return;
        struct session *s;
        for (uint32_t it = 0; (s = idmap_next(&d->sessions, &it));)
                if (s != except)
                        shrink_now(d, s);
}

void plan_follow(struct kvcd *d, struct session *s) {
        if (s->pending_plan_id || !s->owner->bound || !links_pending(s))
                return;
        struct wire_arena *a;
        Kvc__Grant *g = unasked_grant(d, s, &a);
        if (!g)
                return;
        Kvc__Plan *p = build(d, s, NULL, s->last_step, g, a);
        if (!p) { /* the chain ends here (no room, or nothing left): the client hears so */
                for (uint32_t l = 0; l < s->n_layers; l++) {
                        memset(s->layers[l].wanted, 0, sizeof(s->layers[l].wanted));
                        s->layers[l].relink = false;
                }
                p = wire_arena_alloc(a, sizeof(*p));
                if (!p)
                        return;
                kvc__plan__init(p);
                p->session_id = s->id;
                p->plan_id = ++s->next_plan_id;
                p->base_step = s->last_step;
                s->pending_plan_id = p->plan_id;
                s->pending_since_usec = now_usec();
        }
        if (send_unasked_plan(d, s, p, g) < 0)
                log_warning("session %llu: cannot send the next link of its demotion (its client is gone?)",
                            (unsigned long long)s->id);
}
