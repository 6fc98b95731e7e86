/* plan.c: what kvcd sends to change a session's memory. Owns applying grants (blocks added to a
 * layer's tables) and plans: block moves (relocation, docs/gpu.md), compaction of each layer it
 * names (kernels/compact.h, or ladder.h for a layer with tiers below its dtype, or the compactor
 * a device pool's caller registered), the release of the tail blocks no longer needed, and the
 * PlanApplied that acknowledges it. A plan with `more` is one link of a demotion: the session
 * waits for the next one (kvc_flush does) before it steps again.
 *
 * The daemon is trusted no more than a client is by the daemon: every grant and plan is checked
 * whole before it touches memory (offsets inside mapped chunks, keep-sets sorted and inside the
 * cache, plan entries inside the plan buffer, which is copied out before use, moves to distinct
 * writable places), so a faulty kvcd cannot make a client write out of bounds. A plan that fails
 * the checks changes nothing and is refused in its PlanApplied.
 */
#define _GNU_SOURCE
#include "internal.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "compact.h"
#include "ladder.h"
#include "devpool.h"
#include "summarize.h"

/* The table a LayerBlocks or BlockMove names: its tier field, or q8 (tier 1) from a kvcd before the
 * ladder. */
static uint32_t tier_of(uint32_t tier, bool q8) {
        return tier ? tier : q8 ? 1u : 0u;
}

int plan_grant(struct kvc_client *c, const Kvc__Grant *g) {
        struct kvc_session *s = session_find(c, g->session_id);
        if (!s)
                return client_error(c, -EPROTO, "grant for unknown session %llu",
                                    (unsigned long long)g->session_id);
        /* check all, then apply */
        for (size_t i = 0; i < g->n_layers; i++) {
                const Kvc__LayerBlocks *lb = g->layers[i];
                uint32_t t = tier_of(lb->tier, lb->q8);
                if (lb->layer >= s->g.n_layers || t >= s->n_tiers)
                        return client_error(c, -EPROTO, "grant for a layer or tier the session lacks");
                const struct block_layout *lay = &s->tiers[t];
                const struct layer *L = &s->layers[lb->layer];
                if (L->t[t].n + lb->n_blocks > s->max_layer_blocks)
                        return client_error(c, -EPROTO, "grant beyond the session's limit");
                for (size_t b = 0; b < lb->n_blocks; b++) {
                        int r = mapping_check_region(c, lb->blocks[b], lay->block_bytes);
                        if (r < 0)
                                return r;
                        if (lb->blocks[b] % c->chunk_bytes % lay->block_bytes)
                                return client_error(c, -EPROTO,
                                                    "granted block not aligned to the block size");
                }
        }
        for (size_t i = 0; i < g->n_layers; i++) {
                const Kvc__LayerBlocks *lb = g->layers[i];
                struct table *t = &s->layers[lb->layer].t[tier_of(lb->tier, lb->q8)];
                for (size_t b = 0; b < lb->n_blocks; b++) {
                        t->offs[t->n] = lb->blocks[b];
                        t->ptrs[t->n] = c->base + lb->blocks[b];
                        t->n++;
                }
        }
        return 0;
}

/* released[t][l] blocks of tier t of layer l were given back: they sit just past the tables' new
 * ends. */
static int send_plan_applied(struct kvc_client *c, struct kvc_session *s, uint64_t plan_id, int status,
                             uint32_t (*released)[WIRE_MAX_LAYERS]) {
        Kvc__PlanApplied pa = KVC__PLAN_APPLIED__INIT;
        static __thread Kvc__LayerBlocks lbs[LADDER_TIERS * WIRE_MAX_LAYERS];
        static __thread Kvc__LayerBlocks *lbp[LADDER_TIERS * WIRE_MAX_LAYERS];
        static __thread uint32_t tiers[WIRE_MAX_TIERS * WIRE_MAX_LAYERS];
        uint32_t lengths[WIRE_MAX_LAYERS], q8s[WIRE_MAX_LAYERS];
        pa.session_id = s->id;
        pa.plan_id = plan_id;
        pa.status = status;
        if (status == 0) {
                pa.n_layer_tokens = s->g.n_layers;
                pa.layer_tokens = lengths;
                pa.n_layer_q8_tokens = s->g.n_layers;
                pa.layer_q8_tokens = q8s;
                if (s->n_tiers > 1) {
                        pa.n_layer_tier_tokens = (size_t)s->g.n_layers * (s->n_tiers - 1);
                        pa.layer_tier_tokens = tiers;
                }
                pa.released = lbp;
                for (uint32_t l = 0; l < s->g.n_layers; l++) {
                        lengths[l] = s->layers[l].n_tokens;
                        q8s[l] = s->n_tiers > 1 ? s->layers[l].low[1] : 0;
                        for (uint32_t t = 1; t < s->n_tiers; t++)
                                tiers[(size_t)l * (s->n_tiers - 1) + t - 1] = s->layers[l].low[t];
                        for (uint32_t q = 0; q < s->n_tiers; q++) {
                                const struct table *t = &s->layers[l].t[q];
                                if (!released[q][l])
                                        continue;
                                kvc__layer_blocks__init(&lbs[pa.n_released]);
                                lbs[pa.n_released].layer = l;
                                lbs[pa.n_released].tier = q;
                                lbs[pa.n_released].q8 = q == 1;
                                lbs[pa.n_released].n_blocks = released[q][l];
                                lbs[pa.n_released].blocks = t->offs + t->n;
                                lbp[pa.n_released] = &lbs[pa.n_released];
                                pa.n_released++;
                        }
                }
        }
        Kvc__Envelope env = KVC__ENVELOPE__INIT;
        env.request_id = ++c->next_request_id;
        env.body_case = KVC__ENVELOPE__BODY_PLAN_APPLIED;
        env.plan_applied = &pa;
        return client_send(c, &env);
}

/* A plan's block moves (relocation): each names a block of ours by its table entry, and a
 * destination in a chunk we map writable, aligned, used by no other move; the shared prefix's
 * blocks never move. 0, or an errno with the reason set. */
static int check_moves(struct kvc_client *c, const struct kvc_session *s, const Kvc__Plan *p) {
        uint32_t first_fp = s->n_shared / s->layout.block_tokens;
        for (size_t i = 0; i < p->n_moves; i++) {
                const Kvc__BlockMove *m = p->moves[i];
                uint32_t tier = tier_of(m->tier, m->q8);
                const struct block_layout *lay = &s->tiers[tier < s->n_tiers ? tier : 0];
                const struct table *t =
                        m->layer < s->g.n_layers && tier < s->n_tiers ? &s->layers[m->layer].t[tier] : NULL;
                bool ok = t && m->index < t->n && t->offs[m->index] == m->from &&
                          (tier || m->index >= first_fp) && m->to % c->chunk_bytes % lay->block_bytes == 0 &&
                          mapping_check_region(c, m->to, lay->block_bytes) == 0 &&
                          c->mapped[m->to / c->chunk_bytes] == MAPPED_RW;
                for (size_t j = 0; ok && j < i; j++)
                        ok = p->moves[j]->to != m->to &&
                             !(p->moves[j]->layer == m->layer &&
                               tier_of(p->moves[j]->tier, p->moves[j]->q8) == tier && p->moves[j]->index == m->index);
                if (!ok) {
                        client_error(c, -EPROTO, "plan %llu: block move %zu (layer %u, entry %u) is invalid",
                                     (unsigned long long)p->plan_id, i, m->layer, m->index);
                        return EPROTO;
                }
        }
        return 0;
}

/* Copies each moved block to its new place and puts it in the table; all or nothing. */
static int apply_moves(struct kvc_client *c, struct kvc_session *s, const Kvc__Plan *p) {
        for (size_t i = 0; i < p->n_moves; i++) {
                const Kvc__BlockMove *m = p->moves[i];
                size_t bytes = s->tiers[tier_of(m->tier, m->q8)].block_bytes;
                struct table *t = &s->layers[m->layer].t[tier_of(m->tier, m->q8)];
                int r = 0;
                if (c->dev)
                        r = devpool_copy(c->dev, m->to, m->from, bytes);
                else
                        memcpy(c->base + m->to, c->base + m->from, bytes);
                if (r < 0) { /* the blocks moved so far go back: their old copies are untouched */
                        while (i-- > 0) {
                                m = p->moves[i];
                                t = &s->layers[m->layer].t[tier_of(m->tier, m->q8)];
                                t->offs[m->index] = m->from;
                                t->ptrs[m->index] = c->base + m->from;
                        }
                        client_error(c, r, "plan %llu: cannot copy a block on the GPU",
                                     (unsigned long long)p->plan_id);
                        return EIO;
                }
                t->offs[m->index] = m->to;
                t->ptrs[m->index] = c->base + m->to;
        }
        s->stats.blocks_moved += p->n_moves;
        return 0;
}

/* Validates a plan completely, moves the blocks it moves, then compacts every layer it names and
 * gives back the blocks the layers no longer need (keeping room for one more token). */
/* The tokens of each lower tier a layer plan leaves (ret[1 .. n_tiers - 1]): its tier counts, or
 * the INT8 count of a kvcd before the ladder. false when they do not fit the session's tiers. */
static bool plan_tier_counts(const struct kvc_session *s, const Kvc__LayerPlan *lp, uint32_t ret[LADDER_TIERS]) {
        memset(ret, 0, LADDER_TIERS * sizeof(uint32_t));
        if (lp->n_tier_tokens) {
                for (uint32_t t = 1; t < s->n_tiers; t++)
                        ret[t] = lp->tier_tokens[t - 1];
                return lp->n_tier_tokens == s->n_tiers - 1;
        }
        if (lp->q8_tokens && (s->n_tiers != 2 || s->tiers[1].dtype != BLOCK_DTYPE_Q8))
                return false;
        if (s->n_tiers > 1)
                ret[1] = lp->q8_tokens;
        return true;
}

int plan_apply(struct kvc_client *c, const Kvc__Plan *p) {
        struct kvc_session *s = session_find(c, p->session_id);
        if (!s)
                return client_error(c, -EPROTO, "plan for unknown session %llu",
                                    (unsigned long long)p->session_id);
        int status = 0;
        uint64_t entries_cap = s->plan_bytes / 4, used = 0;
        bool seen[WIRE_MAX_LAYERS] = { false };
        const uint32_t *keeps[WIRE_MAX_LAYERS]; /* entry i's keep-set: copied out, or the identity */
        const uint8_t *tiers[WIRE_MAX_LAYERS];  /* entry i's per-token tiers, copied out, or NULL */
        if (s->awaiting_link) { /* the link kvcd said would come */
                s->awaiting_link = false;
                c->n_links--;
        }

        if (p->plan_id <= s->last_plan_id) {
                status = ESTALE;
                client_error(c, -ESTALE, "plan %llu is older than plan %llu, already applied",
                             (unsigned long long)p->plan_id, (unsigned long long)s->last_plan_id);
        } else if (p->n_layers && (!s->stepped || p->base_step > s->last_step)) {
                status = EPROTO;
                client_error(c, -EPROTO, "plan %llu is based on step %llu, which this session has not taken",
                             (unsigned long long)p->plan_id, (unsigned long long)p->base_step);
        }
        for (size_t i = 0; status == 0 && i < p->n_layers; i++) {
                const Kvc__LayerPlan *lp = p->layers[i];
                uint64_t n = (uint64_t)lp->keep_count * (lp->per_head ? s->g.n_kv_heads : 1);
                /* a keep-set of every slot is the identity: kvcd need not write it (a demotion's);
                 * a device pool's compactor reads it from the buffer all the same */
                bool identity = lp->keep_count == lp->base_tokens && !c->dev;
                if (lp->layer >= s->g.n_layers || seen[lp->layer] ||
                    lp->base_tokens > s->layers[lp->layer].n_tokens ||
                    (!identity && ((uint64_t)lp->keep_offset + n > entries_cap || used + n > entries_cap)) ||
                    (lp->n_tier_tokens && lp->n_tier_tokens != s->n_tiers - 1) ||
                    (lp->summary_slot && (lp->per_head || s->n_tiers > 1)) ||
                    (lp->tier_offset && (s->n_tiers < 2 || lp->per_head || c->dev ||
                                         lp->tier_offset - 1ull + lp->keep_count > s->plan_bytes))) {
                        status = EPROTO;
                        client_error(c, -EPROTO, "plan %llu: layer entry %zu out of range",
                                     (unsigned long long)p->plan_id, i);
                        break;
                }
                seen[lp->layer] = true;
                const struct layer *L = &s->layers[lp->layer];
                uint32_t T = s->layout.block_tokens, want[LADDER_TIERS];
                uint64_t low = 0;
                bool fits = plan_tier_counts(s, lp, want);
                for (uint32_t t = 1; fits && t < s->n_tiers; t++) {
                        fits = (want[t] + T - 1) / T <= L->t[t].n;
                        low += want[t];
                }
                if (!fits || low > lp->keep_count) {
                        status = EPROTO;
                        client_error(c, -EPROTO, "plan %llu: layer %u asks for tiers it cannot hold",
                                     (unsigned long long)p->plan_id, lp->layer);
                        break;
                }
                tiers[i] = NULL;
                if (lp->tier_offset) { /* after the keep-sets in the copy: a byte a kept token */
                        uint64_t words = (lp->keep_count + 3u) / 4u;
                        uint8_t *tier = (uint8_t *)(s->plan_copy + used);
                        uint32_t count[LADDER_TIERS] = { 0 };
                        if (used + words > entries_cap ||
                            mapping_copy_out(c, s->plan_offset + lp->tier_offset - 1, tier, lp->keep_count) < 0) {
                                status = EPROTO;
                                client_error(c, -EPROTO, "plan %llu: layer %u's tiers do not fit the plan buffer",
                                             (unsigned long long)p->plan_id, lp->layer);
                                break;
                        }
                        used += words;
                        for (uint32_t j = 0; j < lp->keep_count; j++)
                                if (tier[j] < s->n_tiers)
                                        count[tier[j]]++;
                                else
                                        status = EPROTO;
                        for (uint32_t t = 1; t < s->n_tiers && status == 0; t++)
                                if (count[t] != want[t])
                                        status = EPROTO;
                        if (status) {
                                client_error(c, -EPROTO, "plan %llu: layer %u's tiers do not match its counts",
                                             (unsigned long long)p->plan_id, lp->layer);
                                break;
                        }
                        tiers[i] = tier;
                }
                if (identity) {
                        keeps[i] = NULL; /* filled in when applied */
                        continue;
                }
                /* copy out of the shared buffer, then check the copy */
                uint32_t *keep = s->plan_copy + used;
                keeps[i] = keep;
                if (mapping_copy_out(c, s->plan_offset + (uint64_t)lp->keep_offset * 4, keep, n * 4) < 0) {
                        status = EIO;
                        client_error(c, -EIO, "plan %llu: cannot copy the plan buffer off the GPU",
                                     (unsigned long long)p->plan_id);
                        break;
                }
                for (uint32_t h = 0; h < (lp->per_head ? s->g.n_kv_heads : 1u); h++) {
                        if (compact_check_keep(keep + (uint64_t)h * lp->keep_count, lp->keep_count,
                                               lp->base_tokens) < 0) {
                                status = EPROTO;
                                client_error(c, -EPROTO,
                                             "plan %llu: layer %u keep-set not ascending or past the cache",
                                             (unsigned long long)p->plan_id, lp->layer);
                                break;
                        }
                        /* a shared prefix stays where it is: the keep-set starts with it, whole */
                        for (uint32_t j = 0; j < lp->shared_tokens && status == 0; j++)
                                if (keep[(uint64_t)h * lp->keep_count + j] != j) {
                                        status = EPROTO;
                                        client_error(c, -EPROTO,
                                                     "plan %llu: layer %u moves its shared prefix",
                                                     (unsigned long long)p->plan_id, lp->layer);
                                }
                }
                if (status == 0 && lp->shared_tokens &&
                    (lp->shared_tokens != s->n_shared || lp->keep_count < lp->shared_tokens ||
                     low || lp->summary_slot || s->n_tiers > 1 || !s->mask ||
                     lp->shared_tokens / T > L->t[0].n)) {
                        status = EPROTO;
                        client_error(c, -EPROTO,
                                     "plan %llu: layer %u's shared prefix of %u does not match ours (%u)",
                                     (unsigned long long)p->plan_id, lp->layer, lp->shared_tokens,
                                     s->n_shared);
                }
                used += n;
        }
        if (status == 0)
                status = check_moves(c, s, p);
        if (status == 0 && p->n_layers && c->dev && !c->compactor) {
                status = ENOTSUP;
                client_error(c, -ENOTSUP,
                             "plan %llu: the pool is GPU memory and no compactor is registered "
                             "(kvc_set_compactor)",
                             (unsigned long long)p->plan_id);
        }
        if (status == 0)
                status = apply_moves(c, s, p);
        if (status != 0) {
                int r = send_plan_applied(c, s, p->plan_id, status, NULL);
                return r < 0 ? r : -status;
        }

        static __thread uint32_t released[LADDER_TIERS][WIRE_MAX_LAYERS];
        memset(released, 0, sizeof(released));
        uint32_t T = s->layout.block_tokens;
        for (size_t i = 0; i < p->n_layers; i++) {
                const Kvc__LayerPlan *lp = p->layers[i];
                struct layer *L = &s->layers[lp->layer];
                uint32_t new_len, heads = lp->per_head ? s->g.n_kv_heads : 1;
                uint32_t *keep = (uint32_t *)keeps[i];
                if (!keep) { /* every slot, in every head */
                        keep = s->identity;
                        for (uint32_t h = 0; h < heads; h++)
                                for (uint32_t j = 0; j < lp->keep_count; j++)
                                        keep[(size_t)h * lp->keep_count + j] = j;
                }
                int r;
                if (c->dev) {
                        struct kvc_compaction job = {
                                .layer = lp->layer,
                                .keep = keep,
                                .keep_device = (const uint32_t *)(c->base + s->plan_offset +
                                                                  (uint64_t)lp->keep_offset * 4),
                                .keep_count = lp->keep_count,
                                .per_head = lp->per_head,
                                .base_tokens = lp->base_tokens,
                                .q8_tokens = lp->q8_tokens, /* n_tiers <= 2: tier 1 is q8 (session.c) */
                                .summary_slot = lp->summary_slot,
                                .new_tokens = lp->keep_count + (L->n_tokens - lp->base_tokens),
                        };
                        kvc_layer_view(s, lp->layer, &job.view);
                        r = c->compactor(c->compactor_ctx, s, &job);
                        new_len = job.new_tokens;
                } else if (lp->shared_tokens) {
                        /* the private part compacts on its own; the shared prefix only gets masks */
                        uint32_t S = lp->shared_tokens, kp = lp->keep_count - S, H = s->g.n_kv_heads;
                        uint32_t private_len = 0;
                        for (uint32_t h = 0; h < (lp->per_head ? H : 1u); h++)
                                for (uint32_t j = 0; j < kp; j++)
                                        keep[(uint64_t)h * kp + j] =
                                                keep[(uint64_t)h * lp->keep_count + S + j] - S;
                        struct block_layer bl = { .layout = &s->layout,
                                                  .blocks = L->t[0].ptrs + S / T,
                                                  .n_blocks = L->t[0].n - S / T,
                                                  .n_tokens = L->n_tokens - S };
                        r = compact_layer(&bl, keep, kp, lp->per_head, lp->base_tokens - S, &private_len);
                        new_len = S + private_len;
                        uint64_t at = (uint64_t)lp->layer * H * s->mask_stride;
                        if (r == 0)
                                r = mapping_copy_out(c, s->plan_offset + s->mask_offset + at, s->mask + at,
                                                     (size_t)H * s->mask_stride);
                } else if (s->n_tiers == 1) {
                        struct block_layer bl = session_fp_layer(s, lp->layer);
                        r = lp->summary_slot ? summarize_evicted(&bl, keep, lp->keep_count,
                                                                 lp->base_tokens, lp->summary_slot - 1,
                                                                 s->compact_scratch)
                                             : 0;
                        if (r == 0)
                                r = compact_layer(&bl, keep, lp->keep_count, lp->per_head,
                                                  lp->base_tokens, &new_len);
                } else {
                        uint32_t want[LADDER_TIERS], got[LADDER_TIERS];
                        plan_tier_counts(s, lp, want);
                        if (tiers[i])
                                memcpy(s->plan_tier, tiers[i], lp->keep_count);
                        for (uint32_t h = 0; h < heads && !tiers[i]; h++) { /* the oldest kept go lowest */
                                uint8_t *tier = s->plan_tier + (size_t)h * lp->keep_count;
                                uint32_t at = 0;
                                for (uint32_t t = s->n_tiers - 1; t >= 1; t--)
                                        for (uint32_t j = 0; j < want[t]; j++)
                                                tier[at++] = (uint8_t)t;
                                memset(tier + at, 0, lp->keep_count - at);
                        }
                        struct ladder_layer M = session_ladder_layer(s, lp->layer);
                        r = ladder_compact(&M, keep, s->plan_tier, lp->keep_count, lp->per_head,
                                           lp->base_tokens, s->compact_scratch, got);
                        new_len = 0;
                        for (uint32_t t = 0; r == 0 && t < s->n_tiers; t++) {
                                if (t)
                                        L->low[t] = got[t];
                                new_len += got[t];
                        }
                }
                if (r < 0) /* the kernel checks what only it can (a kept token sent up a tier) */
                        return client_error(c, r, "compaction refused plan %llu on layer %u",
                                            (unsigned long long)p->plan_id, lp->layer);
                if (c->dev && s->n_tiers > 1)
                        L->low[1] = lp->q8_tokens;
                L->n_tokens = new_len;
                /* keep room for one more token; give back the rest of each table */
                for (uint32_t t = 0; t < s->n_tiers; t++) {
                        uint32_t n = t ? L->low[t] : new_len - session_low_tokens(s, L) + 1;
                        uint32_t need = (n + T - 1) / T;
                        if (need < L->t[t].n) {
                                released[t][lp->layer] = L->t[t].n - need;
                                L->t[t].n = need;
                        }
                }
        }
        s->last_plan_id = p->plan_id;
        s->stats.plans_applied++;
        int r = send_plan_applied(c, s, p->plan_id, 0, released);
        if (r == 0 && p->more) { /* the next link comes unasked: kvc_flush waits for it */
                s->awaiting_link = true;
                c->n_links++;
        }
        return r;
}

void kvc_set_compactor(struct kvc_client *c, kvc_compactor fn, void *ctx) {
        c->compactor = fn;
        c->compactor_ctx = ctx;
}
