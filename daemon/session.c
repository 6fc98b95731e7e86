/* session.c: sessions: their lifecycle (open, restore, close, hand-over), their blocks, their
 * steps, and the acknowledgement of their plans. Building a plan is plan.c's.
 *
 * Block accounting is driven by two messages. Grants add blocks at the end of a layer's table
 * (a Reserve, or kvcd keeping room for the next token after a step). Plans shrink it: kvcd
 * writes the keep-set of each layer into the session's plan buffer (plan.c); the client compacts and
 * answers PlanApplied with its new lengths and the tail blocks it no longer needs; only then are
 * those blocks free in the pool. At most one plan is outstanding per session, so a plan is
 * always built on the layout the client has.
 *
 * The precision ladder: a layer has one block table per tier of the session (the dtype's, then
 * OpenSession.tiers: q8, q4, q3, q2), laid out as kernels/ladder.h says, the lowest tier's slots
 * first. A plan may move tokens down (LayerPlan.tier_tokens); the blocks it needs in the lower
 * tiers are granted with the plan, at most one per tier and layer (plan.c cuts a larger demotion
 * into links, each sent as soon as the last one is acknowledged), and the client releases what it
 * no longer needs of every table with PlanApplied. So a session's charged bytes never exceed what
 * it held before a demotion by more than one block per tier and layer.
 *
 * Memory limits (budget.c): every block granted is first allowed by the budget (the session's
 * cap, its tenant's quota, the others' guaranteed minimums). Each step the policy's wish becomes
 * the session's demand; when the arbiter caps a session below it, the cap overrides the policy's
 * target: the layer is compacted to fit (the policy still chooses which tokens stay). A request
 * within a session's guaranteed minimum that finds the pool full waits (session.wait) while the
 * arbiter's plans free memory, and is answered when they have, or refused at its deadline.
 *
 * kvcd's own memory: a layer's block tables grow with use (doubling, up to the layer's limit, which
 * is bounded by what the whole pool could hold), and everything a session makes kvcd allocate
 * (its struct and layers, its policy's state, its prompt ids, masks, prefix entries, moves, and
 * the tables as they grow) is charged to its client's heap allowance, KVCD_CLIENT_HEAP_BYTES:
 * past it the request is refused with ENOSPC. Allocating the tables for max_tokens up front was
 * rejected: 256 layers x 2^20 tokens is 128 MiB of kvcd for 112 KiB of pool.
 *
 * Nothing a client says is taken on trust: lengths must fit the blocks granted, released blocks
 * must be exactly the tail of the layer's table, steps must move forward, and a session answers
 * only to the client that opened it.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>

#include "clock.h"
#include "events.h"
#include "kvcd.h"
#include "log.h"
#include "plan.h"
#include "policy/policy.h"
#include "pool.h"
#include "prefix.h"
#include "tier.h"

uint64_t session_pool_owner(const struct session *s) {
        return s->domain ? s->domain : s->owner->id;
}

uint64_t session_bytes(const struct session *s) {
        return s->bytes;
}

uint32_t session_tokens(const struct session *s) {
        uint32_t n = 0;
        for (uint32_t l = 0; l < s->n_layers; l++)
                if (s->layers[l].n_tokens > n)
                        n = s->layers[l].n_tokens;
        return n;
}

uint32_t session_blocks(const struct session *s) {
        uint32_t n = 0;
        for (uint32_t l = 0; l < s->n_layers; l++)
                for (uint32_t t = 0; t < s->n_tiers; t++)
                        n += s->layers[l].t[t].n;
        return n;
}

uint32_t session_shared_tokens(const struct session *s) {
        return s->n_shared_blocks * s->layout.block_tokens;
}

void session_add_tier_bytes(const struct session *s, uint64_t by_dtype[SESSION_DTYPES]) {
        for (uint32_t t = 0; t < s->n_tiers; t++) {
                uint64_t blocks = 0;
                for (uint32_t l = 0; l < s->n_layers; l++) /* shared prefix blocks: counted once, elsewhere */
                        blocks += s->layers[l].t[t].n - (t == 0 ? s->n_shared_blocks : 0);
                by_dtype[s->tiers[t].dtype % SESSION_DTYPES] += blocks * s->tiers[t].block_bytes;
        }
}

int session_tier_list(struct wire_arena *a, const uint64_t by_dtype[SESSION_DTYPES], Kvc__TierBytes ***ret,
                      size_t *ret_n) {
        Kvc__TierBytes **v = wire_arena_alloc(a, SESSION_DTYPES * sizeof(*v));
        if (!v)
                return -ENOMEM;
        size_t n = 0;
        for (uint32_t k = 0; k < SESSION_DTYPES; k++) {
                const struct tier_row *row = tier_row((enum block_dtype)k);
                if (!row || !by_dtype[k])
                        continue;
                if (!(v[n] = wire_arena_alloc(a, sizeof(**v))))
                        return -ENOMEM;
                kvc__tier_bytes__init(v[n]);
                v[n]->tier = (char *)row->name;
                v[n]->bytes = by_dtype[k];
                n++;
        }
        *ret = v;
        *ret_n = n;
        return 0;
}

float session_bits_per_value(const struct session *s, const uint64_t by_dtype[SESSION_DTYPES]) {
        uint64_t values = 0, bytes = 0;
        for (uint32_t l = 0; l < s->n_layers; l++)
                values += (uint64_t)s->layers[l].n_tokens * s->n_kv_heads * s->head_dim * 2;
        for (uint32_t k = 0; k < SESSION_DTYPES; k++)
                bytes += by_dtype[k];
        return values ? (float)((double)bytes * 8.0 / (double)values) : 0.0f;
}

int session_fill_stats(struct wire_arena *a, const struct session *s, Kvc__SessionStats *ret) {
        ret->steps = s->stats.steps;
        ret->plans = s->stats.plans;
        ret->peak_tokens = s->stats.peak_tokens;
        ret->peak_layer_blocks = s->stats.peak_layer_blocks;
        ret->peak_bytes = s->stats.peak_bytes;
        ret->bytes = session_bytes(s);
        uint64_t by_dtype[SESSION_DTYPES] = { 0 };
        session_add_tier_bytes(s, by_dtype);
        return session_tier_list(a, by_dtype, &ret->tier_bytes, &ret->n_tier_bytes);
}

uint32_t session_unit_bytes(const struct session *s, uint32_t t) {
        return (uint32_t)s->tiers[t].block_bytes;
}

uint32_t session_low_tokens(const struct session *s, const struct session_layer *L, bool planned) {
        uint32_t n = 0;
        for (uint32_t t = 1; t < s->n_tiers; t++)
                n += planned ? L->planned[t] : L->low[t];
        return n;
}

const char *session_tier_name(const struct session *s, uint32_t t) {
        return tier_row(s->tiers[t].dtype)->name;
}

/* Allocates n units of one class for the session, in owner's chunks (its client's, its own for a
 * hand-off, its prefix domain for the prompt blocks it may share); a chunk new to the client has
 * its fd sent first. */
static int alloc_units_in(struct kvcd *d, struct session *s, uint64_t owner, uint32_t tier, uint32_t n,
                          uint64_t *ret_off) {
        int64_t new_chunk;
        uint32_t unit = session_unit_bytes(s, tier);
        d->refusal[0] = '\0';
        d->refusal_own = false;
        d->refusal_reason = REFUSAL_CAPACITY; /* unless a budget limit says otherwise */
        int r = budget_may_grow(d, s, (uint64_t)n * unit, d->refusal, sizeof(d->refusal));
        if (r < 0)
                return r;
        uint32_t kept = tier == 0 && d->budget.n_lowering && pool_free_chunks(d->pool) ? budget_lowering_chunks(d) : 0;
        if (kept && pool_free_chunks(d->pool) <= kept) { /* growth at the dtype leaves them be */
                new_chunk = -1;
                r = pool_alloc_owned(d->pool, owner, unit, n, ret_off);
                if (r == -ENOSPC)
                        snprintf(d->refusal, sizeof(d->refusal),
                                 "the pool keeps its last %u chunks for sessions lowering precision", kept);
        } else {
                r = pool_alloc(d->pool, owner, unit, n, ret_off, &new_chunk);
        }
        /* the bytes were free, not the chunks (kept back, or carved for the lower tiers' block
         * sizes): worth_waiting squeezes the arbiter, whose cuts make those sessions lower
         * precision and give back blocks of this size */
        if (r == -ENOSPC && d->budget.n_lowering)
                d->budget.wanted_room += (uint64_t)n * unit;
        if (r < 0)
                return r;
        if (new_chunk >= 0) {
                restart_record_chunk_owner(d, (uint32_t)new_chunk, owner);
                r = client_send_chunk(d, s->owner, (uint32_t)new_chunk);
                if (r < 0) {
                        log_warning("client %llu: cannot send chunk %lld: %s",
                                    (unsigned long long)s->owner->id, (long long)new_chunk, strerror(-r));
                        pool_release(d->pool, owner, *ret_off, unit, n);
                        pool_disown_chunk(d->pool, (uint32_t)new_chunk);
                        return -EIO;
                }
        }
        budget_charge(d, s, (int64_t)n * unit);
        if (s->bytes > s->stats.peak_bytes)
                s->stats.peak_bytes = s->bytes;
        return 0;
}

static int alloc_units(struct kvcd *d, struct session *s, uint32_t tier, uint32_t n, uint64_t *ret_off) {
        return alloc_units_in(d, s, session_pool_owner(s), tier, n, ret_off);
}

static void free_units(struct kvcd *d, struct session *s, uint32_t tier, uint64_t off, uint32_t n) {
        uint32_t unit = session_unit_bytes(s, tier);
        /* its client's chunks, or (prompt blocks it did not get to share) its prefix domain's */
        uint64_t owner = pool_chunk_owner(d->pool, (uint32_t)(off / pool_chunk_bytes(d->pool)));
        if (owner != s->prefix_domain || !owner)
                owner = session_pool_owner(s);
        int r = pool_release(d->pool, owner, off, unit, n);
        if (r < 0) /* a bookkeeping bug of ours: say so loudly, keep serving */
                log_error("session %llu: releasing %u units at %llu failed: %s", (unsigned long long)s->id, n,
                          (unsigned long long)off, strerror(-r));
        budget_charge(d, s, -(int64_t)n * unit);
        d->freed = true;
}

static enum block_dtype dtype_of(Kvc__Dtype t) {
        switch (t) {
        case KVC__DTYPE__DTYPE_F16: return BLOCK_DTYPE_F16;
        case KVC__DTYPE__DTYPE_BF16: return BLOCK_DTYPE_BF16;
        default: return BLOCK_DTYPE_F32;
        }
}

static int capacity_error(struct kvcd *d, int r, char *why, size_t why_len, const char *what) {
        struct pool_stats ps;
        pool_get_stats(d->pool, &ps);
        if (r == -ENOSPC && d->refusal[0])
                snprintf(why, why_len, "%s: %s", what, d->refusal);
        else if (r == -ENOSPC && ps.chunks_owned * ps.chunk_bytes + ps.chunk_bytes > ps.capacity_bytes &&
                 ps.used_bytes < ps.capacity_bytes)
                snprintf(why, why_len,
                         "%s: no chunk free (%u owned by client processes, %llu of %llu bytes in use), and "
                         "none "
                         "of them can give one back now",
                         what, ps.chunks_owned, (unsigned long long)ps.used_bytes,
                         (unsigned long long)ps.capacity_bytes);
        else if (r == -ENOSPC)
                snprintf(why, why_len,
                         "%s: pool capacity exhausted (%llu of %llu bytes in use, %u of %u chunks owned)",
                         what, (unsigned long long)ps.used_bytes, (unsigned long long)ps.capacity_bytes,
                         ps.chunks_owned, ps.chunks_total);
        else
                snprintf(why, why_len, "%s: %s", what, strerror(-r));
        return r;
}

/* kvcd's heap for s grows by bytes (shrinks when negative), charged to its owner: -ENOSPC past
 * the owner's allowance, the reason in d->refusal (a refusal of its own: not worth waiting). */
static int heap_charge(struct kvcd *d, struct session *s, int64_t bytes) {
        struct client *c = s->owner;
        if (bytes > 0 && c->heap_bytes + (uint64_t)bytes > KVCD_CLIENT_HEAP_BYTES) {
                snprintf(d->refusal, sizeof(d->refusal),
                         "kvcd's bookkeeping for this client would take %llu bytes of its heap (at most "
                         "%llu per client)",
                         (unsigned long long)(c->heap_bytes + (uint64_t)bytes),
                         (unsigned long long)KVCD_CLIENT_HEAP_BYTES);
                d->refusal_own = true;
                return -ENOSPC;
        }
        c->heap_bytes += (uint64_t)bytes;
        s->heap_bytes += (uint64_t)bytes;
        return 0;
}

int session_table_reserve(struct kvcd *d, struct session *s, struct block_table *t, uint32_t n) {
        if (n <= t->cap)
                return 0;
        if (n > s->max_layer_blocks) {
                snprintf(d->refusal, sizeof(d->refusal), "%u blocks in a layer; at most %u", n,
                         s->max_layer_blocks);
                d->refusal_own = true;
                return -ENOSPC;
        }
        uint32_t cap = t->cap < 8 ? 8 : t->cap * 2; /* doubling: appends cost O(1) each */
        if (cap < n)
                cap = n;
        if (cap > s->max_layer_blocks)
                cap = s->max_layer_blocks;
        int r = heap_charge(d, s, (int64_t)(cap - t->cap) * (int64_t)sizeof(uint64_t));
        if (r < 0)
                return r;
        uint64_t *b = realloc(t->blocks, (size_t)cap * sizeof(uint64_t));
        if (!b) {
                heap_charge(d, s, -(int64_t)(cap - t->cap) * (int64_t)sizeof(uint64_t));
                return -ENOMEM;
        }
        t->blocks = b;
        t->cap = cap;
        return 0;
}

static struct session *session_free(struct session *s) {
        if (s->owner)
                s->owner->heap_bytes -= s->heap_bytes;
        free(s->shared);
        free(s->mask);
        free(s->mask_next);
        free(s->moves);
        if (s->layers)
                for (uint32_t l = 0; l < s->n_layers; l++)
                        for (uint32_t t = 0; t < LADDER_TIERS; t++)
                                free(s->layers[l].t[t].blocks);
        free(s->layers);
        policy_free(s->policy);
        free(s);
        return NULL;
}

/* The session's tiers from OpenSession: tier 0 its layout, then the tiers named, each with fewer
 * bits than the one before and a layout this geometry allows, or q8 when the client can store INT8
 * (int8) and int8_used (its policy keeps tokens below the dtype). -EINVAL with a reason. */
static int session_tiers(struct session *s, const Kvc__OpenSession *m, bool int8_used, char *why,
                         size_t why_len) {
        s->tiers[0] = s->layout;
        s->n_tiers = 1;
        s->rotation_seed = m->rotation_seed;
        if (m->int8 && m->n_tiers && !(m->n_tiers == 1 && strcmp(m->tiers[0], "q8") == 0)) {
                snprintf(why, why_len, "int8 is tiers [q8]; it cannot go with other tiers");
                return -EINVAL;
        }
        size_t n = m->n_tiers ? m->n_tiers : m->int8 && int8_used ? 1 : 0;
        for (size_t i = 0; i < n; i++) {
                const char *name = m->n_tiers ? m->tiers[i] : "q8";
                const struct tier_row *row = tier_by_name(name);
                if (!row || !row->quantized) {
                        snprintf(why, why_len, "tier %s unknown (q8, q4, q3, q2)", name);
                        return -EINVAL;
                }
                if (block_dtype_bits(row->dtype) >= block_dtype_bits(s->tiers[s->n_tiers - 1].dtype)) {
                        snprintf(why, why_len, "tier %s does not have fewer bits than %s", name,
                                 session_tier_name(s, s->n_tiers - 1));
                        return -EINVAL;
                }
                if (block_layout_init(&s->tiers[s->n_tiers], s->layout.block_tokens, s->n_kv_heads, s->head_dim,
                                      row->dtype) < 0) {
                        snprintf(why, why_len, "tier %s needs a head_dim that is a power of 2 >= 8 (%u)", name,
                                 s->head_dim);
                        return -EINVAL;
                }
                s->n_tiers++;
        }
        return 0;
}

/* A session of client c from its parameters: geometry, layout, policy, tables. No id, no memory
 * from the pool yet, not in any index. */
static int session_create(struct kvcd *d, struct client *c, const Kvc__OpenSession *m, struct session **ret,
                          char *why, size_t why_len) {
        const Kvc__Geometry *g = m->geometry;
        int r;

        if (d->sessions.n >= KVCD_MAX_SESSIONS || c->n_sessions >= KVCD_MAX_SESSIONS_PER_CLIENT) {
                snprintf(why, why_len, "session limit reached (%u per daemon, %u per client)",
                         KVCD_MAX_SESSIONS, KVCD_MAX_SESSIONS_PER_CLIENT);
                return -ENOSPC;
        }
        struct session *s = calloc(1, sizeof(*s));
        if (!s)
                return -ENOMEM;
        s->owner = c;
        s->state_slot = -1;
        s->n_layers = g->n_layers;
        s->n_heads = g->n_heads;
        s->n_kv_heads = g->n_kv_heads;
        s->head_dim = g->head_dim;
        s->max_tokens = g->max_tokens;
        s->dtype = g->dtype;
        snprintf(s->tenant, sizeof(s->tenant), "%s", m->tenant && *m->tenant ? m->tenant : "default");
        snprintf(s->policy_name, sizeof(s->policy_name), "%s", m->policy);
        snprintf(s->model_id, sizeof(s->model_id), "%s", m->model_id ? m->model_id : "");
        s->opened_usec = now_usec();

        r = block_layout_init(&s->layout, WIRE_BLOCK_TOKENS, g->n_kv_heads, g->head_dim, dtype_of(g->dtype));
        if (r == 0 && s->layout.block_bytes > pool_chunk_bytes(d->pool))
                r = -EINVAL;
        if (r < 0) {
                snprintf(why, why_len, "a block of this geometry does not fit a %llu-byte chunk",
                         (unsigned long long)pool_chunk_bytes(d->pool));
                session_free(s);
                return -EINVAL;
        }

        /* a byte budget buys a token policy the tokens per layer whose blocks and keep-set entries
         * (4 bytes each) fit it, a block of slack included (the policies plan a block late) */
        uint32_t budget_tokens = m->budget_tokens;
        s->budget_bytes = m->budget_bytes;
        if (m->budget_bytes && !budget_tokens) {
                uint64_t T = s->layout.block_tokens, bb = s->layout.block_bytes, per = m->budget_bytes / g->n_layers;
                uint64_t tok = per > bb ? (per - bb) * T / (bb + 4 * T) : 0;
                budget_tokens = tok < 1 ? 1 : tok > g->max_tokens ? g->max_tokens : (uint32_t)tok;
        }
        struct policy_setup setup = {
                .n_layers = g->n_layers,
                .n_heads = g->n_heads,
                .n_kv_heads = g->n_kv_heads,
                .head_dim = g->head_dim,
                .max_tokens = g->max_tokens,
                .block_tokens = s->layout.block_tokens,
                .budget_tokens = budget_tokens,
                .budget_bytes = m->budget_bytes,
                .prompt_tokens = m->prompt_tokens,
                .session_id = d->next_session_id + 1,
        };
        struct policy_param params[WIRE_MAX_PARAMS];
        size_t n_params = 0;
        for (size_t i = 0; i < m->n_params; i++) {
                const Kvc__Param *p = m->params[i];
                if (strcmp(p->key, "tier_window") == 0) { /* the session's, not the policy's */
                        if (p->value_case != KVC__PARAM__VALUE_NUMBER || !(p->number >= 1) ||
                            p->number > WIRE_MAX_TOKENS || p->number != (uint32_t)p->number) {
                                snprintf(why, why_len, "tier_window must be a whole number of tokens >= 1");
                                session_free(s);
                                return -EINVAL;
                        }
                        s->tier_window = (uint32_t)p->number;
                        continue;
                }
                params[n_params++] = (struct policy_param){
                        .key = p->key,
                        .is_text = p->value_case == KVC__PARAM__VALUE_TEXT,
                        .number = p->value_case == KVC__PARAM__VALUE_NUMBER ? p->number : 0,
                        .text = p->value_case == KVC__PARAM__VALUE_TEXT ? p->text : NULL,
                };
        }
        r = policy_new(m->policy, &setup, params, n_params, &s->policy, why, why_len);
        if (r < 0) {
                session_free(s);
                return r == -ENOENT ? -EINVAL : r;
        }
        struct policy_limits lim;
        s->policy->ops->limits(s->policy->state, &lim);
        uint32_t T = s->layout.block_tokens;
        /* a shared prefix: the prompt's whole blocks but the last token's, for the same model */
        if (m->share_prefix && m->n_prompt_token_ids > T && T == PREFIX_BLOCK_TOKENS)
                s->model_key = prefix_model_key(m->model_id, g->n_layers, g->n_kv_heads, g->head_dim,
                                                (int)g->dtype, T);
        /* shared slots are full precision and stay where they are: the int8 flag (a client that can
         * store INT8) gives no tier then, named tiers are refused */
        if ((r = session_tiers(s, m, lim.lower && !s->model_key, why, why_len)) < 0) {
                session_free(s);
                return r;
        }
        if (s->model_key && m->n_tiers) {
                snprintf(why, why_len, "a session that shares its prefix keeps every token at its dtype (no tiers)");
                session_free(s);
                return -EINVAL;
        }
        if (lim.lower && s->n_tiers < 2 && !s->model_key) {
                snprintf(why, why_len,
                         "policy %s keeps tokens at a lower precision, and this client stores no tier below "
                         "its dtype (OpenSession.tiers or int8)",
                         s->policy_name);
                session_free(s);
                return -EINVAL;
        }
        if (lim.token_tiers && (s->n_tiers < 2 || !m->token_tiers || lim.per_head)) {
                snprintf(why, why_len,
                         "policy %s gives each token its tier: it needs tiers below the dtype (OpenSession.tiers), "
                         "and a client that applies them (OpenSession.token_tiers), one keep-set a layer",
                         s->policy_name);
                session_free(s);
                return -EINVAL;
        }
        s->token_tiers = lim.token_tiers;
        for (uint32_t t = 0; t < s->n_tiers; t++) {
                s->tier_block_bytes[t] = s->tiers[t].block_bytes;
                s->tier_bits[t] = (uint8_t)block_dtype_bits(s->tiers[t].dtype);
        }
        if (s->tier_window && s->n_tiers < 2) {
                snprintf(why, why_len, "tier_window needs a tier below the dtype (OpenSession.tiers)");
                session_free(s);
                return -EINVAL;
        }
        if (s->model_key && m->handoff) {
                snprintf(why, why_len, "a session cannot both share its prefix and be handed off");
                session_free(s);
                return -EINVAL;
        }
        if (s->model_key)
                s->share_blocks = (uint32_t)((m->n_prompt_token_ids - 1) / T);
        uint32_t shared_max = s->share_blocks * T;
        s->budget_tokens = lim.budget;
        s->max_keep = lim.max_keep;
        s->keep_cap = lim.max_keep ? lim.max_keep + shared_max : 0;
        s->per_head = lim.per_head;
        s->summarize = lim.summarize && !lim.per_head && s->n_tiers == 1 && !s->model_key;
        s->prompt_tokens = m->prompt_tokens;
        uint64_t max_layer = (uint64_t)lim.max_layer_tokens + shared_max; /* masked shared slots stay */
        s->max_layer_tokens = max_layer < g->max_tokens ? (uint32_t)max_layer : g->max_tokens;
        s->max_layer_blocks = (s->max_layer_tokens + T - 1) / T;
        uint64_t pool_blocks = pool_va_bytes(d->pool) / s->layout.block_bytes; /* all the pool could hold */
        if (s->max_layer_blocks > pool_blocks) {
                s->max_layer_blocks = (uint32_t)pool_blocks;
                s->max_layer_tokens = s->max_layer_blocks * T;
        }
        if (s->model_key) {
                s->mask_stride = (shared_max + 63) / 64 * 8;
                s->shared = calloc(s->share_blocks ? s->share_blocks : 1, sizeof(*s->shared));
                s->mask = calloc((size_t)s->n_layers * s->mask_stride + 1, 1);
                s->mask_next = calloc((size_t)s->n_layers * s->mask_stride + 1, 1);
                if (!s->shared || !s->mask || !s->mask_next) {
                        session_free(s);
                        return -ENOMEM;
                }
        }

        /* kvcd's own heap for it, all but the block tables (they grow with use): refused past the
         * client's allowance before the tables take any */
        uint64_t prompt_blocks = m->n_prompt_token_ids / 16; /* events.c's 16-token blocks */
        uint64_t heap = sizeof(*s) + sizeof(*s->policy) + s->policy->ops->state_bytes(&s->policy->setup) +
                        (uint64_t)s->n_layers * sizeof(*s->layers) +
                        prompt_blocks * (16 * sizeof(uint32_t) + sizeof(uint64_t)) + /* events.c */
                        (uint64_t)WIRE_MAX_MOVES * sizeof(struct block_move) +       /* relocate.c */
                        (s->model_key ? (uint64_t)s->share_blocks *
                                                        (sizeof(*s->shared) + sizeof(struct prefix_block) +
                                                         s->n_layers * sizeof(uint64_t)) +
                                                2 * ((uint64_t)s->n_layers * s->mask_stride + 1)
                                      : 0);
        if ((r = heap_charge(d, s, (int64_t)heap)) < 0) {
                snprintf(why, why_len, "%s", d->refusal);
                session_free(s);
                return r;
        }
        s->layers = calloc(s->n_layers, sizeof(*s->layers));
        if (!s->layers) {
                session_free(s);
                return -ENOMEM;
        }
        for (uint32_t l = 0; s->share_blocks && l < s->n_layers; l++) { /* prefix_attach() fills them */
                if ((r = session_table_reserve(d, s, &s->layers[l].t[0], s->share_blocks)) < 0) {
                        snprintf(why, why_len, "%s", d->refusal);
                        session_free(s);
                        return r;
                }
        }
        r = plan_scratch_reserve(&d->scratch, (size_t)s->n_kv_heads * s->max_layer_blocks * T);
        if (r < 0) {
                session_free(s);
                return r;
        }

        *ret = s;
        return 0;
}

/* Puts a created session under its id and into its client's list. */
static int session_register(struct kvcd *d, struct session *s, uint64_t id) {
        s->id = id;
        int r = idmap_put(&d->sessions, s->id, s);
        if (r < 0)
                return r;
        struct client *c = s->owner;
        s->next = c->sessions;
        if (c->sessions)
                c->sessions->prev = s;
        c->sessions = s;
        c->n_sessions++;
        return 0;
}

/* Whether a request refused for lack of memory is worth waiting for: it was not the session's
 * own cap, and memory is being taken back: by the arbiter from other sessions, or chunks from
 * other clients (asked for now, when every chunk is owned: an empty one, or one emptied by
 * moving its blocks). Nothing being taken back: refused at once. */
static bool worth_waiting(struct kvcd *d, int r) {
        if (r != -ENOSPC || d->refusal_own)
                return false;
        struct budget *b = &d->budget;
        if (b->wanted_room) { /* the pool's chunks are short though its bytes are not: the arbiter
                                 counts the capacity as what is in use less what was asked */
                b->squeeze = budget_squeeze_for(d, b->wanted_room);
                b->wanted_room = 0;
                b->dirty = true;
        }
        budget_arbitrate(d); /* always: the caps follow the demand this request added */
        if (d->budget.pressure) {
                plan_shrink_all(d, NULL); /* the ladders give back what they can at once */
                return true;
        }
        if (!pool_short_of_chunks(d->pool))
                return false;
        struct pool_stats ps;
        client_reclaim(d);
        pool_get_stats(d->pool, &ps);
        return ps.chunks_reclaiming > 0;
}

void session_wait_for_memory(struct kvcd *d, struct session *s, int kind, uint32_t n_tokens,
                             uint64_t request_id) {
        if (s->wait.kind == WAIT_NONE)
                d->n_waiting++;
        s->wait = (struct session_wait){ .kind = kind,
                                         .n_tokens = n_tokens,
                                         .request_id = request_id,
                                         .deadline_usec = now_usec() + KVCD_WAIT_USEC };
}

void session_wait_done(struct kvcd *d, struct session *s) {
        if (s->wait.kind != WAIT_NONE && --d->n_waiting == 0 && d->budget.squeeze) {
                d->budget.squeeze = 0; /* nobody waits: the capacity is the arbiter's again, */
                budget_limits_changed(d);
                budget_arbitrate(d); /* and the caps it set under the squeeze go at once */
        }
        s->wait.kind = WAIT_NONE;
}

/* The plan buffer: 0 when there, -EINPROGRESS when the session waits for it. */
static int alloc_plan_buffer(struct kvcd *d, struct session *s, char *why, size_t why_len) {
        uint64_t units = plan_buffer_units(s);
        if (!units || s->plan_units)
                return 0;
        int r = alloc_units(d, s, 0, (uint32_t)units, &s->plan_offset);
        if (r < 0 && worth_waiting(d, r))
                return -EINPROGRESS;
        if (r < 0)
                return capacity_error(d, r, why, why_len, "plan buffer");
        s->plan_units = (uint32_t)units;
        restart_record_plan(d, s);
        return 0;
}

int session_open(struct kvcd *d, struct client *c, const Kvc__OpenSession *m, struct session **ret, char *why,
                 size_t why_len) {
        struct session *s;
        int r = session_create(d, c, m, &s, why, why_len);
        if (r < 0)
                return r;
        uint64_t units = plan_buffer_units(s);
        if (units > UINT32_MAX) {
                snprintf(why, why_len, "a plan buffer of %llu blocks", (unsigned long long)units);
                session_free(s);
                return -EINVAL;
        }
        uint64_t floor = (units + s->n_layers) * s->layout.block_bytes;
        if ((r = budget_admit(d, s, c, m, true, floor, why, why_len)) < 0) {
                session_free(s);
                return r;
        }
        if (getrandom(s->token, sizeof(s->token), 0) != (ssize_t)sizeof(s->token)) {
                budget_leave(d, s);
                session_free(s);
                return -EIO;
        }
        if ((r = session_register(d, s, d->next_session_id + 1)) < 0) {
                budget_leave(d, s);
                session_free(s);
                return r;
        }
        d->next_session_id++;
        if (m->handoff)
                s->domain = SESSION_DOMAIN | s->id;
        if (s->model_key)
                s->prefix_domain = PREFIX_DOMAIN | s->id;
        r = events_session_opened(d, s, m->prompt_token_ids, m->n_prompt_token_ids);
        if (r == 0)
                prefix_attach(d, s);
        /* a hand-off session lives in chunks of its own, a sharing one in others' too: not kept
         * across a restart */
        if (r == 0 && !s->domain && !s->model_key)
                r = restart_record_session(d, s, m);
        if (r == 0)
                r = alloc_plan_buffer(d, s, why, why_len);
        if (r == -EINPROGRESS) {
                session_wait_for_memory(d, s, WAIT_OPEN, 0, 0);
                log_info("session %llu waits for its plan buffer: the arbiter is reclaiming memory",
                         (unsigned long long)s->id);
        } else if (r < 0) {
                session_close(d, s);
                return r;
        }
        d->n.sessions_opened++;
        *ret = s;
        return r == -EINPROGRESS ? 1 : 0;
}

int session_retry_open(struct kvcd *d, struct session *s, char *why, size_t why_len) {
        return alloc_plan_buffer(d, s, why, why_len);
}

int session_restore(struct kvcd *d, struct client *orphan, const Kvc__OpenSession *m, uint64_t id,
                    const uint8_t *token, uint64_t plan_offset, uint32_t plan_units, struct session **ret,
                    char *why, size_t why_len) {
        struct session *s;
        int r = session_create(d, orphan, m, &s, why, why_len);
        if (r < 0)
                return r;
        memcpy(s->token, token, sizeof(s->token));
        uint64_t floor = ((uint64_t)plan_units + s->n_layers) * s->layout.block_bytes;
        if ((r = budget_admit(d, s, orphan, m, false, floor, why, why_len)) < 0) {
                session_free(s);
                return r;
        }
        if ((r = session_register(d, s, id)) < 0) {
                budget_leave(d, s);
                session_free(s);
                return r;
        }
        if (plan_units) {
                r = pool_claim(d->pool, orphan->id, plan_offset, (uint32_t)s->layout.block_bytes, plan_units);
                if (r < 0) {
                        snprintf(why, why_len, "its plan buffer is not in its client's chunks");
                        session_close(d, s);
                        return r;
                }
                s->plan_offset = plan_offset;
                s->plan_units = plan_units;
                budget_charge(d, s, (int64_t)plan_units * s->layout.block_bytes);
        }
        *ret = s;
        return 0;
}

int session_retry_reserve(struct kvcd *d, struct session *s, Kvc__Grant **ret_g, char *why, size_t why_len) {
        return session_reserve(d, s, s->wait.n_tokens, ret_g, why, why_len);
}

void session_close(struct kvcd *d, struct session *s) {
        session_wait_done(d, s);
        events_session_closed(d, s);
        restart_forget_session(d, s);
        relocate_undo(d, s); /* moves in flight: their destinations */
        for (uint32_t l = 0; l < s->n_layers; l++) {
                for (uint32_t b = s->n_shared_blocks; b < s->layers[l].t[0].n; b++) /* shared ones: below */
                        free_units(d, s, 0, s->layers[l].t[0].blocks[b], 1);
                for (uint32_t t = 1; t < s->n_tiers; t++)
                        for (uint32_t b = 0; b < s->layers[l].t[t].n; b++)
                                free_units(d, s, t, s->layers[l].t[t].blocks[b], 1);
        }
        if (s->plan_units)
                free_units(d, s, 0, s->plan_offset, s->plan_units);
        if (s->domain) /* its own chunks go back, scrubbed */
                pool_release_owner(d->pool, s->domain);
        prefix_release(d, s); /* its references to shared blocks, and its prefix domain if empty */
        budget_leave(d, s);
        idmap_del(&d->sessions, s->id);
        if (s->prev)
                s->prev->next = s->next;
        else
                s->owner->sessions = s->next;
        if (s->next)
                s->next->prev = s->prev;
        s->owner->n_sessions--;
        session_free(s);
}

void session_move(struct session *s, struct client *to) {
        struct client *from = s->owner;
        from->heap_bytes -= s->heap_bytes; /* its bookkeeping goes with it */
        to->heap_bytes += s->heap_bytes;
        if (s->prev)
                s->prev->next = s->next;
        else
                from->sessions = s->next;
        if (s->next)
                s->next->prev = s->prev;
        from->n_sessions--;
        s->owner = to;
        s->prev = NULL;
        s->next = to->sessions;
        if (to->sessions)
                to->sessions->prev = s;
        to->sessions = s;
        to->n_sessions++;
}

int session_lookup(struct kvcd *d, struct client *c, uint64_t id, struct session **ret) {
        struct session *s = idmap_get(&d->sessions, id);
        if (!s)
                return -ENOENT;
        if (s->owner != c)
                return -EPERM;
        *ret = s;
        return 0;
}

int session_resume_layer(struct wire_arena *a, const struct session *s, uint32_t l, Kvc__ResumeLayer *out) {
        const struct session_layer *L = &s->layers[l];
        kvc__resume_layer__init(out);
        out->n_tokens = L->n_tokens;
        out->n_fp_blocks = L->t[0].n;
        out->fp_blocks = L->t[0].blocks;
        if (s->n_tiers == 1)
                return 0;
        if (s->n_tiers == 2 && s->tiers[1].dtype == BLOCK_DTYPE_Q8) { /* as clients before the ladder read it */
                out->n_q8 = L->low[1];
                out->n_q8_blocks = L->t[1].n;
                out->q8_blocks = L->t[1].blocks;
        }
        uint32_t k = s->n_tiers - 1;
        uint32_t *tokens = wire_arena_alloc(a, k * sizeof(*tokens));
        Kvc__LayerBlocks *lbs = wire_arena_alloc(a, k * sizeof(*lbs));
        Kvc__LayerBlocks **lbp = wire_arena_alloc(a, k * sizeof(*lbp));
        if (!tokens || !lbs || !lbp)
                return -ENOMEM;
        for (uint32_t t = 1; t < s->n_tiers; t++) {
                tokens[t - 1] = L->low[t];
                kvc__layer_blocks__init(&lbs[t - 1]);
                lbs[t - 1].layer = l;
                lbs[t - 1].tier = t;
                lbs[t - 1].n_blocks = L->t[t].n;
                lbs[t - 1].blocks = L->t[t].blocks;
                lbp[t - 1] = &lbs[t - 1];
        }
        out->tier_tokens = tokens;
        out->n_tier_tokens = k;
        out->tier_blocks = lbp;
        out->n_tier_blocks = k;
        return 0;
}

void session_shrink_table(struct kvcd *d, struct session *s, uint32_t l, uint32_t tier, uint32_t n_blocks) {
        struct block_table *t = &s->layers[l].t[tier];
        for (uint32_t b = 0; b < n_blocks && t->n; b++)
                free_units(d, s, tier, t->blocks[--t->n], 1);
}

/* Grows one table of layer l to n_blocks blocks, recording the new ones in out (arena memory). */
int session_grow_table(struct kvcd *d, struct session *s, uint32_t l, uint32_t tier, uint32_t n_blocks,
                       Kvc__LayerBlocks *out) {
        struct session_layer *L = &s->layers[l];
        struct block_table *t = &L->t[tier];
        size_t first = out->n_blocks;
        int r = session_table_reserve(d, s, t, n_blocks);
        if (r < 0)
                return r;
        while (t->n < n_blocks) {
                uint64_t off;
                /* the prompt blocks it may share come from its prefix domain, until it published */
                bool prefix = tier == 0 && s->prefix_domain && t->n < s->share_blocks && !s->publish_tried;
                r = alloc_units_in(d, s, prefix ? s->prefix_domain : session_pool_owner(s), tier, 1, &off);
                if (r < 0) { /* all or nothing: the blocks this call took go back */
                        for (; out->n_blocks > first; out->n_blocks--)
                                free_units(d, s, tier, t->blocks[--t->n], 1);
                        return r;
                }
                t->blocks[t->n++] = off;
                out->blocks[out->n_blocks++] = off;
                d->n.grants++;
        }
        uint32_t held = 0;
        for (uint32_t u = 0; u < s->n_tiers; u++)
                held += L->t[u].n;
        if (held > s->stats.peak_layer_blocks)
                s->stats.peak_layer_blocks = held;
        return 0;
}

static Kvc__Grant *grant_new(struct kvcd *d, struct session *s) {
        Kvc__Grant *g = wire_arena_alloc(d->out, sizeof(*g));
        Kvc__LayerBlocks **layers = wire_arena_alloc(d->out, LADDER_TIERS * s->n_layers * sizeof(*layers));
        if (!g || !layers)
                return NULL;
        kvc__grant__init(g);
        g->session_id = s->id;
        g->layers = layers;
        return g;
}

Kvc__LayerBlocks *session_grant_layer(struct wire_arena *a, Kvc__Grant *g, uint32_t l, uint32_t t,
                                      uint32_t max_blocks) {
        Kvc__LayerBlocks *lb = wire_arena_alloc(a, sizeof(*lb));
        uint64_t *blocks = wire_arena_alloc(a, max_blocks * sizeof(uint64_t));
        if (!lb || !blocks)
                return NULL;
        kvc__layer_blocks__init(lb);
        lb->layer = l;
        lb->tier = t;
        lb->q8 = t == 1; /* what clients before the ladder read (their sessions' only tier is q8) */
        lb->blocks = blocks;
        g->layers[g->n_layers++] = lb;
        return lb;
}

/* Bytes the session holds when every layer has want(l) tokens: its plan buffer, its lower tiers'
 * blocks as they are, and tier 0's blocks for the rest. */
static uint64_t bytes_for(const struct session *s, const struct policy_target *targets, uint32_t n_tokens) {
        uint32_t T = s->layout.block_tokens;
        uint64_t bytes = (uint64_t)s->plan_units * s->layout.block_bytes;
        for (uint32_t l = 0; l < s->n_layers; l++) {
                const struct session_layer *L = &s->layers[l];
                uint32_t want = n_tokens;
                if (targets) /* and room for the next step's tokens, as many as the last step's */
                        want = targets[l].keep < L->n_tokens ? targets[l].keep
                                                              : L->n_tokens + (s->last_growth > 1 ? s->last_growth : 1);
                if (want > s->max_layer_tokens)
                        want = s->max_layer_tokens;
                uint32_t low = session_low_tokens(s, L, false), fp = want > low ? want - low : 0;
                for (uint32_t t = 1; t < s->n_tiers; t++)
                        bytes += (uint64_t)L->t[t].n * s->tiers[t].block_bytes;
                bytes += (uint64_t)((fp + T - 1) / T) * s->layout.block_bytes;
        }
        return bytes;
}

/* What a per-token-tier session's blocks may hold after a plan: its byte budget or the arbiter's
 * cap, the lower, less its plan buffer and the room the next step's tokens take at the dtype (as
 * many whole blocks as the last step brought: a prompt's chunk; decoding's token is the policy's
 * slack), so that the budget bounds what it holds at any time (UINT64_MAX: no bound). */
static uint64_t aside_bytes(const struct session *s) {
        return ((uint64_t)s->plan_units + (uint64_t)s->n_layers * (s->last_growth / s->layout.block_tokens)) *
               s->layout.block_bytes;
}

uint64_t session_blocks_budget(const struct session *s) {
        uint64_t b = s->budget_bytes ? s->budget_bytes : UINT64_MAX;
        if (s->cap_bytes && s->cap_bytes < b)
                b = s->cap_bytes;
        return b == UINT64_MAX ? b : b > aside_bytes(s) ? b - aside_bytes(s) : 0;
}

/* A per-token-tier session's demand: its plan buffer and every token (and the next) at its
 * dtype, within its byte budget. */
static uint64_t ladder_demand(const struct session *s) {
        uint32_t T = s->layout.block_tokens;
        uint64_t full = (uint64_t)s->plan_units * s->layout.block_bytes;
        uint32_t next = s->last_growth > 1 ? s->last_growth : 1; /* the next step's room, as bytes_for */
        for (uint32_t l = 0; l < s->n_layers; l++)
                full += (uint64_t)((s->layers[l].n_tokens + next + T - 1) / T) * s->layout.block_bytes;
        return s->budget_bytes && s->budget_bytes < full ? s->budget_bytes : full;
}

/* The arbiter's cap overrides the policy: a layer that would outgrow it is compacted, leaving
 * half a block of room so that the next plans are not one token apart. */
static void apply_cap(struct kvcd *d, struct session *s, struct policy_target *targets, uint64_t wanted) {
        memset(d->scratch.forced, 0, s->n_layers * sizeof(d->scratch.forced[0]));
        if (wanted <= s->cap_bytes || !s->max_keep)
                return;
        uint32_t T = s->layout.block_tokens;
        uint64_t fixed = (uint64_t)s->plan_units * s->layout.block_bytes,
                 row = (uint64_t)s->n_layers * s->layout.block_bytes;
        for (uint32_t l = 0; l < s->n_layers; l++)
                for (uint32_t t = 1; t < s->n_tiers; t++)
                        fixed += (uint64_t)s->layers[l].t[t].n * s->tiers[t].block_bytes;
        uint64_t rows = s->cap_bytes > fixed ? (s->cap_bytes - fixed) / row : 0;
        if (rows < 1)
                rows = 1;
        for (uint32_t l = 0; l < s->n_layers; l++) {
                const struct session_layer *L = &s->layers[l];
                uint64_t limit = session_low_tokens(s, L, false) + rows * T;
                uint32_t want = targets[l].keep < L->n_tokens ? targets[l].keep : L->n_tokens + 1;
                if (want <= limit)
                        continue;
                uint32_t keep = limit > T / 2 ? (uint32_t)(limit - T / 2) : 1;
                if (keep > s->max_keep)
                        keep = s->max_keep;
                if (keep >= L->n_tokens)
                        continue;
                targets[l].keep = keep;
                if (targets[l].low > keep)
                        targets[l].low = keep;
                d->scratch.forced[l] = true;
        }
}

int session_reserve(struct kvcd *d, struct session *s, uint32_t n_tokens, Kvc__Grant **ret_g, char *why,
                    size_t why_len) {
        uint32_t T = s->layout.block_tokens;
        if (n_tokens > s->max_layer_tokens) {
                snprintf(why, why_len, "room for %u tokens asked; policy %s allows %u per layer", n_tokens,
                         s->policy_name, s->max_layer_tokens);
                d->refusal_reason = REFUSAL_POLICY_LIMIT;
                return -ENOSPC;
        }
        budget_demand(d, s, bytes_for(s, NULL, n_tokens));
        /* a session that lowers precision may have a plan in flight kvcd sent unasked (the
         * arbiter's): its client releases the tails of its tables as it knows them, so no block is
         * granted under it; the request waits for its PlanApplied */
        if (s->token_tiers && s->pending_plan_id)
                return -EINPROGRESS;
        Kvc__Grant *g = grant_new(d, s);
        if (!g)
                return -ENOMEM;
        for (uint32_t l = 0; l < s->n_layers; l++) {
                struct session_layer *L = &s->layers[l];
                uint32_t low = session_low_tokens(s, L, false);
                uint32_t want = n_tokens > low ? (n_tokens - low + T - 1) / T : 0;
                if (L->t[0].n >= want)
                        continue;
                Kvc__LayerBlocks *lb = session_grant_layer(d->out, g, l, 0, want - L->t[0].n);
                int r = lb ? session_grow_table(d, s, l, 0, want, lb) : -ENOMEM;
                if (r < 0) { /* all or nothing: undo this request's blocks (the failed layer took none) */
                        for (size_t i = 0; i < g->n_layers; i++) {
                                struct block_table *t = &s->layers[g->layers[i]->layer].t[0];
                                for (size_t b = 0; b < g->layers[i]->n_blocks; b++)
                                        free_units(d, s, 0, t->blocks[--t->n], 1);
                        }
                        if (worth_waiting(d, r))
                                return -EINPROGRESS;
                        return capacity_error(d, r, why, why_len, "reserve");
                }
        }
        *ret_g = g;
        return 0;
}

int session_step(struct kvcd *d, struct session *s, const Kvc__Step *st, Kvc__Plan **ret_plan,
                 Kvc__Grant **ret_grant, char *why, size_t why_len) {
        uint32_t T = s->layout.block_tokens;

        if (s->stepped && st->step <= s->last_step) {
                snprintf(why, why_len, "step %llu is not after step %llu", (unsigned long long)st->step,
                         (unsigned long long)s->last_step);
                return -EPROTO;
        }
        if (st->n_layer_tokens != s->n_layers) {
                snprintf(why, why_len, "%zu layer lengths for a %u-layer session", st->n_layer_tokens,
                         s->n_layers);
                return -EINVAL;
        }
        for (uint32_t l = 0; l < s->n_layers; l++) {
                const struct session_layer *L = &s->layers[l];
                uint32_t low = session_low_tokens(s, L, false);
                if (st->layer_tokens[l] > low + L->t[0].n * T || st->layer_tokens[l] < low) {
                        snprintf(why, why_len, "layer %u: %u tokens, but %u in lower tiers and %u other slots granted",
                                 l, st->layer_tokens[l], low, L->t[0].n * T);
                        return -EPROTO;
                }
                if (st->layer_tokens[l] < session_shared_tokens(s)) {
                        snprintf(why, why_len, "layer %u: %u tokens, fewer than its shared prefix of %u", l,
                                 st->layer_tokens[l], session_shared_tokens(s));
                        return -EPROTO;
                }
        }
        s->last_growth = st->layer_tokens[0] > s->layers[0].n_tokens ? st->layer_tokens[0] - s->layers[0].n_tokens : 0;
        s->appended += s->last_growth;
        for (uint32_t l = 0; l < s->n_layers; l++) {
                s->layers[l].n_tokens = st->layer_tokens[l];
                if (st->layer_tokens[l] > s->stats.peak_tokens)
                        s->stats.peak_tokens = st->layer_tokens[l];
        }
        s->last_step = st->step;
        s->last_step_usec = now_usec();
        s->stepped = true;
        s->stats.steps++;
        events_session_progress(d, s);
        s->confidence = policy_confidence(s->policy->conf_weights, st->entropy, st->top1_prob, st->margin);
        histogram_observe(&d->confidence, s->confidence);
        d->n.steps++;

        *ret_plan = NULL;
        *ret_grant = NULL;
        Kvc__Grant *g = grant_new(d, s);
        if (!g)
                return -ENOMEM;
        struct policy_target *targets = d->scratch.targets;
        for (uint32_t l = 0; l < s->n_layers; l++)
                targets[l] = (struct policy_target){ .keep = POLICY_NO_PLAN };
        if (s->model_key) /* once its prefill has passed the prompt it may share */
                prefix_publish(d, s);
        uint32_t live[WIRE_MAX_LAYERS]; /* a shared prefix: the policy counts only unmasked tokens */
        for (uint32_t l = 0; l < s->n_layers; l++)
                live[l] = plan_live_tokens(s, l);
        if (s->pending_plan_id == 0) {
                struct policy_step ps = {
                        .step = st->step,
                        .prefill = st->phase == KVC__PHASE__PHASE_PREFILL,
                        .entropy = st->entropy,
                        .top1_prob = st->top1_prob,
                        .margin = st->margin,
                        .confidence = s->confidence,
                        .appended = s->appended,
                        .layer_tokens = live,
                        .n_tiers = s->n_tiers,
                        .tier_block_bytes = s->tier_block_bytes,
                        .tier_bits = s->tier_bits,
                        .budget_bytes = session_blocks_budget(s),
                };
                const struct policy_ops *ops = s->policy->ops;
                if (ops->observes && ops->observes(s->policy->state, &ps)) {
                        for (uint32_t l = 0; l < s->n_layers; l++) {
                                struct policy_layer view;
                                plan_gather(d, s, l, &view);
                                ops->observe(s->policy->state, &ps, &view, d->scratch.work);
                        }
                }
                uint64_t want;
                if (s->token_tiers) { /* the policy fits the cap itself, lowering precision first */
                        s->lowest_bytes = aside_bytes(s) + (ops->lowest_bytes ? ops->lowest_bytes(s->policy->state, &ps) : 0);
                        budget_demand(d, s, ladder_demand(s));
                        budget_arbitrate(d);
                        ps.budget_bytes = session_blocks_budget(s);
                        ops->decide(s->policy->state, &ps, targets);
                        memset(d->scratch.forced, 0, s->n_layers * sizeof(d->scratch.forced[0]));
                        s->link_step = ps;
                } else {
                        ops->decide(s->policy->state, &ps, targets);
                        want = bytes_for(s, targets, 0);
                        budget_demand(d, s, want);
                        budget_arbitrate(d);
                        apply_cap(d, s, targets, want);
                }
                *ret_plan = plan_build(d, s, &ps, g);
                /* after this session's plan: the scratch its targets are in is the others' now */
                plan_shrink_all(d, s);
        }

        /* keep room for the next token in the layers no plan is about to shrink */
        for (uint32_t l = 0; l < s->n_layers; l++) {
                struct session_layer *L = &s->layers[l];
                bool planned = targets[l].keep < L->n_tokens;
                uint32_t fp_tokens = L->n_tokens - session_low_tokens(s, L, false);
                if (planned || L->n_tokens + 1 > s->max_layer_tokens || fp_tokens + 1 <= L->t[0].n * T)
                        continue;
                Kvc__LayerBlocks *lb = session_grant_layer(d->out, g, l, 0, 1);
                if (!lb || session_grow_table(d, s, l, 0, L->t[0].n + 1, lb) < 0) {
                        if (lb)
                                g->n_layers--; /* no room now: the client will ask, and hear why */
                        break;
                }
        }
        if (g->n_layers)
                *ret_grant = g;
        return 0;
}

/* Tier k of layer l after an applied plan, as the client says (k >= 1): its tier counts, or
 * (clients before the ladder) its INT8 count. */
static uint32_t applied_low(const struct session *s, const Kvc__PlanApplied *m, uint32_t l, uint32_t k) {
        size_t per = s->n_tiers - 1;
        if (m->n_layer_tier_tokens == (size_t)s->n_layers * per)
                return m->layer_tier_tokens[(size_t)l * per + k - 1];
        return k == 1 && m->n_layer_q8_tokens ? m->layer_q8_tokens[l] : 0;
}

/* Whether the client's account of an applied plan fits the plan: release[t][l] is how many blocks
 * of each table it gave back (its tail). */
static int check_applied(const struct session *s, const Kvc__PlanApplied *m,
                         uint32_t release[LADDER_TIERS][WIRE_MAX_LAYERS], char *why, size_t why_len) {
        uint32_t T = s->layout.block_tokens;
        if (m->n_layer_tokens != s->n_layers) {
                snprintf(why, why_len, "%zu layer lengths for a %u-layer session", m->n_layer_tokens,
                         s->n_layers);
                return -EINVAL;
        }
        for (size_t i = 0; i < m->n_released; i++) {
                const Kvc__LayerBlocks *lb = m->released[i];
                uint32_t k = lb->tier ? lb->tier : lb->q8 ? 1u : 0u;
                const struct block_table *t =
                        lb->layer < s->n_layers && k < s->n_tiers ? &s->layers[lb->layer].t[k] : NULL;
                if (!t || release[k][lb->layer] || lb->n_blocks > t->n) {
                        snprintf(why, why_len, "release entry %zu (layer %u) is invalid", i, lb->layer);
                        return -EPROTO;
                }
                for (size_t b = 0; b < lb->n_blocks; b++) {
                        if (lb->blocks[b] != t->blocks[t->n - lb->n_blocks + b]) {
                                snprintf(why, why_len,
                                         "layer %u: released blocks are not the table's last %zu", lb->layer,
                                         lb->n_blocks);
                                return -EPROTO;
                        }
                }
                release[k][lb->layer] = (uint32_t)lb->n_blocks;
        }
        for (uint32_t l = 0; l < s->n_layers; l++) {
                const struct session_layer *L = &s->layers[l];
                uint32_t n = m->layer_tokens[l], low = 0;
                bool ok = n >= session_shared_tokens(s) && L->t[0].n - release[0][l] >= s->n_shared_blocks;
                for (uint32_t k = 1; k < s->n_tiers && ok; k++) {
                        uint32_t c = applied_low(s, m, l, k);
                        ok = c == L->planned[k] && c <= (L->t[k].n - release[k][l]) * T;
                        low += c;
                }
                if (!ok || n < low || n - low > (L->t[0].n - release[0][l]) * T) {
                        snprintf(why, why_len,
                                 "layer %u: %u tokens (%u in lower tiers) do not fit the blocks kept, or "
                                 "not in the tiers the plan left",
                                 l, n, low);
                        return -EPROTO;
                }
        }
        return 0;
}

int session_plan_applied(struct kvcd *d, struct session *s, const Kvc__PlanApplied *m, char *why,
                         size_t why_len) {
        if (s->pending_plan_id == 0 || m->plan_id != s->pending_plan_id) {
                bool old = m->plan_id <= s->next_plan_id;
                snprintf(why, why_len, "plan %llu is %s", (unsigned long long)m->plan_id,
                         old ? "not outstanding (applied or refused before)" : "unknown");
                return old ? -EALREADY : -ENOENT;
        }
        if (m->status != 0) {
                for (uint32_t l = 0; l < s->n_layers; l++) { /* nothing moved */
                        memcpy(s->layers[l].planned, s->layers[l].low, sizeof(s->layers[l].low));
                        memset(s->layers[l].wanted, 0, sizeof(s->layers[l].wanted));
                        s->layers[l].relink = false;
                }
                if (s->mask) /* nor was anything masked */
                        memcpy(s->mask_next, s->mask, (size_t)s->n_layers * s->mask_stride);
                relocate_refused(d, s, m->status); /* nor any block moved */
                log_notice("session %llu: client refused plan %llu: %s", (unsigned long long)s->id,
                           (unsigned long long)m->plan_id, wire_errno_name(m->status));
                s->pending_plan_id = 0;
                return 0;
        }
        /* check everything before changing anything (the tables as the plan's moves leave them) */
        uint32_t release[LADDER_TIERS][WIRE_MAX_LAYERS] = { { 0 } };
        relocate_swap(s, true);
        int r = check_applied(s, m, release, why, why_len);
        if (r < 0) {
                relocate_swap(s, false);
                return r;
        }
        relocate_commit(d, s);
        for (uint32_t l = 0; l < s->n_layers; l++) {
                struct session_layer *L = &s->layers[l];
                for (uint32_t t = 0; t < s->n_tiers; t++)
                        for (uint32_t b = 0; b < release[t][l]; b++)
                                free_units(d, s, t, L->t[t].blocks[--L->t[t].n], 1);
                L->n_tokens = m->layer_tokens[l];
                memcpy(L->low, L->planned, sizeof(L->low));
        }
        s->pending_plan_id = 0;
        if (s->mask)
                memcpy(s->mask, s->mask_next, (size_t)s->n_layers * s->mask_stride);
        events_session_evicted(d, s, s->plan_intact);
        histogram_observe(&d->plan_latency, (double)(now_usec() - s->pending_since_usec) / 1e6);
        d->n.plans_applied++;
        return 0;
}
