/* session.c: sessions: their blocks, their steps, and their plans.
 *
 * Block accounting is driven by two messages. Grants add blocks at the end of a layer's table
 * (a Reserve, or kvcd keeping room for the next token after a step). Plans shrink it: kvcd
 * writes the keep-set of each layer into the session's plan buffer; the client compacts and
 * answers PlanApplied with its new lengths and the tail blocks it no longer needs; only then are
 * those blocks free in the pool. At most one plan is outstanding per session, so a plan is
 * always built on the layout the client has.
 *
 * Nothing a client says is taken on trust: lengths must fit the blocks granted, released blocks
 * must be exactly the tail of the layer's table, steps must move forward, and a session answers
 * only to the client that opened it.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>

#include "compact.h"
#include "kvcd.h"
#include "log.h"

void plan_scratch_done(struct plan_scratch *sc) {
        free(sc->pos);
        free(sc->sum);
        free(sc->ema);
        free(sc->last);
        free(sc->logw);
        free(sc->keep);
        free(sc->work);
        free(sc->logw_delta);
        memset(sc, 0, sizeof(*sc));
}

static int plan_scratch_reserve(struct plan_scratch *sc, size_t entries) {
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
        if (!n.pos || !n.sum || !n.ema || !n.last || !n.logw || !n.keep || !n.work || !n.logw_delta) {
                plan_scratch_done(&n);
                return -ENOMEM;
        }
        plan_scratch_done(sc);
        *sc = n;
        return 0;
}

uint64_t session_bytes(const struct session *s) {
        return s->units * s->layout.block_bytes;
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
                n += s->layers[l].n_blocks;
        return n;
}

void session_fill_stats(const struct session *s, Kvc__SessionStats *ret) {
        ret->steps = s->stats.steps;
        ret->plans = s->stats.plans;
        ret->peak_tokens = s->stats.peak_tokens;
        ret->peak_layer_blocks = s->stats.peak_layer_blocks;
        ret->peak_bytes = s->stats.peak_bytes;
        ret->bytes = session_bytes(s);
}

static void account_units(struct session *s, int64_t delta) {
        s->units = (uint64_t)((int64_t)s->units + delta);
        if (session_bytes(s) > s->stats.peak_bytes)
                s->stats.peak_bytes = session_bytes(s);
}

/* Allocates n units for the session; a chunk new to the client has its fd sent first. */
static int alloc_units(struct kvcd *d, struct session *s, uint32_t n, uint64_t *ret_off) {
        int64_t new_chunk;
        int r = pool_alloc(d->pool, s->owner->id, (uint32_t)s->layout.block_bytes, n, ret_off, &new_chunk);
        if (r < 0)
                return r;
        if (new_chunk >= 0) {
                r = client_send_chunk(d, s->owner, (uint32_t)new_chunk);
                if (r < 0) {
                        log_warning("client %llu: cannot send chunk %lld: %s",
                                    (unsigned long long)s->owner->id, (long long)new_chunk, strerror(-r));
                        pool_release(d->pool, s->owner->id, *ret_off, (uint32_t)s->layout.block_bytes, n);
                        pool_disown_chunk(d->pool, (uint32_t)new_chunk);
                        return -EIO;
                }
        }
        account_units(s, n);
        return 0;
}

static void free_units(struct kvcd *d, struct session *s, uint64_t off, uint32_t n) {
        int r = pool_release(d->pool, s->owner->id, off, (uint32_t)s->layout.block_bytes, n);
        if (r < 0) /* a bookkeeping bug of ours: say so loudly, keep serving */
                log_error("session %llu: releasing %u units at %llu failed: %s", (unsigned long long)s->id, n,
                          (unsigned long long)off, strerror(-r));
        account_units(s, -(int64_t)n);
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
        if (r == -ENOSPC)
                snprintf(why, why_len,
                         "%s: pool capacity exhausted (%llu of %llu bytes in use, %u of %u chunks owned)",
                         what, (unsigned long long)ps.used_bytes, (unsigned long long)ps.capacity_bytes,
                         ps.chunks_owned, ps.chunks_total);
        else
                snprintf(why, why_len, "%s: %s", what, strerror(-r));
        return r;
}

static struct session *session_free(struct session *s) {
        if (s->layers)
                for (uint32_t l = 0; l < s->n_layers; l++)
                        free(s->layers[l].blocks);
        free(s->layers);
        policy_free(s->policy);
        free(s);
        return NULL;
}

int session_open(struct kvcd *d, struct client *c, const Kvc__OpenSession *m, struct session **ret, char *why,
                 size_t why_len) {
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
        s->n_layers = g->n_layers;
        s->n_heads = g->n_heads;
        s->n_kv_heads = g->n_kv_heads;
        s->head_dim = g->head_dim;
        s->max_tokens = g->max_tokens;
        snprintf(s->tenant, sizeof(s->tenant), "%s", m->tenant && *m->tenant ? m->tenant : "default");
        snprintf(s->policy_name, sizeof(s->policy_name), "%s", m->policy);
        s->opened_usec = now_usec();

        r = block_layout_init(&s->layout, 16, g->n_kv_heads, g->head_dim, dtype_of(g->dtype));
        if (r == 0 && s->layout.block_bytes > pool_chunk_bytes(d->pool))
                r = -EINVAL;
        if (r < 0) {
                snprintf(why, why_len, "a block of this geometry does not fit a %llu-byte chunk",
                         (unsigned long long)pool_chunk_bytes(d->pool));
                session_free(s);
                return -EINVAL;
        }

        struct policy_setup setup = {
                .n_layers = g->n_layers,
                .n_heads = g->n_heads,
                .n_kv_heads = g->n_kv_heads,
                .head_dim = g->head_dim,
                .max_tokens = g->max_tokens,
                .block_tokens = s->layout.block_tokens,
                .budget_tokens = m->budget_tokens,
                .prompt_tokens = m->prompt_tokens,
                .session_id = d->next_session_id + 1,
        };
        struct policy_param params[WIRE_MAX_PARAMS];
        for (size_t i = 0; i < m->n_params; i++) {
                const Kvc__Param *p = m->params[i];
                params[i] = (struct policy_param){
                        .key = p->key,
                        .is_text = p->value_case == KVC__PARAM__VALUE_TEXT,
                        .number = p->value_case == KVC__PARAM__VALUE_NUMBER ? p->number : 0,
                        .text = p->value_case == KVC__PARAM__VALUE_TEXT ? p->text : NULL,
                };
        }
        r = policy_new(m->policy, &setup, params, m->n_params, &s->policy, why, why_len);
        if (r < 0) {
                session_free(s);
                return r == -ENOENT ? -EINVAL : r;
        }
        struct policy_limits lim;
        s->policy->ops->limits(s->policy->state, &lim);
        if (lim.int8) {
                snprintf(why, why_len, "int8=1: this kvcd's clients do not store INT8 yet");
                session_free(s);
                return -EINVAL;
        }
        uint32_t T = s->layout.block_tokens;
        s->budget_tokens = lim.budget;
        s->max_keep = lim.max_keep;
        s->per_head = lim.per_head;
        s->prompt_tokens = m->prompt_tokens;
        s->max_layer_tokens = lim.max_layer_tokens < g->max_tokens ? lim.max_layer_tokens : g->max_tokens;
        s->max_layer_blocks = (s->max_layer_tokens + T - 1) / T;

        s->layers = calloc(s->n_layers, sizeof(*s->layers));
        if (!s->layers) {
                session_free(s);
                return -ENOMEM;
        }
        for (uint32_t l = 0; l < s->n_layers; l++) {
                s->layers[l].blocks = calloc(s->max_layer_blocks, sizeof(uint64_t));
                if (!s->layers[l].blocks) {
                        session_free(s);
                        return -ENOMEM;
                }
        }
        r = plan_scratch_reserve(&d->scratch, (size_t)s->n_kv_heads * s->max_layer_blocks * T);
        if (r < 0) {
                session_free(s);
                return r;
        }

        if (getrandom(s->token, sizeof(s->token), 0) != (ssize_t)sizeof(s->token)) {
                session_free(s);
                return -EIO;
        }
        s->id = ++d->next_session_id;
        r = idmap_put(&d->sessions, s->id, s);
        if (r < 0) {
                session_free(s);
                return r;
        }
        s->next = c->sessions;
        if (c->sessions)
                c->sessions->prev = s;
        c->sessions = s;
        c->n_sessions++;

        if (s->max_keep > 0) {
                uint64_t entries = (uint64_t)s->n_layers * s->max_keep * (s->per_head ? s->n_kv_heads : 1);
                uint64_t units = (entries * 4 + s->layout.block_bytes - 1) / s->layout.block_bytes;
                r = units > UINT32_MAX ? -EINVAL : alloc_units(d, s, (uint32_t)units, &s->plan_offset);
                if (r < 0) {
                        session_close(d, s);
                        return capacity_error(d, r, why, why_len, "plan buffer");
                }
                s->plan_units = (uint32_t)units;
        }
        d->n.sessions_opened++;
        *ret = s;
        return 0;
}

void session_close(struct kvcd *d, struct session *s) {
        for (uint32_t l = 0; l < s->n_layers; l++)
                for (uint32_t b = 0; b < s->layers[l].n_blocks; b++)
                        free_units(d, s, s->layers[l].blocks[b], 1);
        if (s->plan_units)
                free_units(d, s, s->plan_offset, s->plan_units);
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

int session_lookup(struct kvcd *d, struct client *c, uint64_t id, struct session **ret) {
        struct session *s = idmap_get(&d->sessions, id);
        if (!s)
                return -ENOENT;
        if (s->owner != c)
                return -EPERM;
        *ret = s;
        return 0;
}

/* Grows layer l to n_blocks blocks, recording the new ones in out (arena memory). */
static int grow_layer(struct kvcd *d, struct session *s, uint32_t l, uint32_t n_blocks,
                      Kvc__LayerBlocks *out) {
        struct session_layer *L = &s->layers[l];
        while (L->n_blocks < n_blocks) {
                uint64_t off;
                int r = alloc_units(d, s, 1, &off);
                if (r < 0)
                        return r;
                L->blocks[L->n_blocks++] = off;
                out->blocks[out->n_blocks++] = off;
                d->n.grants++;
        }
        if (L->n_blocks > s->stats.peak_layer_blocks)
                s->stats.peak_layer_blocks = L->n_blocks;
        return 0;
}

static Kvc__Grant *grant_new(struct kvcd *d, struct session *s) {
        Kvc__Grant *g = wire_arena_alloc(d->out, sizeof(*g));
        Kvc__LayerBlocks **layers = wire_arena_alloc(d->out, s->n_layers * sizeof(*layers));
        if (!g || !layers)
                return NULL;
        kvc__grant__init(g);
        g->session_id = s->id;
        g->layers = layers;
        return g;
}

static Kvc__LayerBlocks *grant_layer(struct kvcd *d, Kvc__Grant *g, uint32_t l, uint32_t max_blocks) {
        Kvc__LayerBlocks *lb = wire_arena_alloc(d->out, sizeof(*lb));
        uint64_t *blocks = wire_arena_alloc(d->out, max_blocks * sizeof(uint64_t));
        if (!lb || !blocks)
                return NULL;
        kvc__layer_blocks__init(lb);
        lb->layer = l;
        lb->blocks = blocks;
        g->layers[g->n_layers++] = lb;
        return lb;
}

int session_reserve(struct kvcd *d, struct session *s, uint32_t n_tokens, Kvc__Grant **ret_g, char *why,
                    size_t why_len) {
        uint32_t T = s->layout.block_tokens;
        if (n_tokens > s->max_layer_tokens) {
                snprintf(why, why_len, "room for %u tokens asked; policy %s allows %u per layer", n_tokens,
                         s->policy_name, s->max_layer_tokens);
                return -ENOSPC;
        }
        Kvc__Grant *g = grant_new(d, s);
        if (!g)
                return -ENOMEM;
        uint32_t want = (n_tokens + T - 1) / T;
        for (uint32_t l = 0; l < s->n_layers; l++) {
                if (s->layers[l].n_blocks >= want)
                        continue;
                Kvc__LayerBlocks *lb = grant_layer(d, g, l, want - s->layers[l].n_blocks);
                int r = lb ? grow_layer(d, s, l, want, lb) : -ENOMEM;
                if (r < 0) { /* all or nothing: undo this request's blocks */
                        for (size_t i = 0; i < g->n_layers; i++) {
                                struct session_layer *L = &s->layers[g->layers[i]->layer];
                                for (size_t b = 0; b < g->layers[i]->n_blocks; b++)
                                        free_units(d, s, L->blocks[--L->n_blocks], 1);
                        }
                        return capacity_error(d, r, why, why_len, "reserve");
                }
        }
        *ret_g = g;
        return 0;
}

/* Copies layer l's side arrays out of the pool into the scratch, [head][slot]. */
static void gather_layer(struct kvcd *d, const struct session *s, uint32_t l, struct policy_layer *out) {
        const struct block_layout *lay = &s->layout;
        const struct session_layer *L = &s->layers[l];
        struct plan_scratch *sc = &d->scratch;
        uint32_t n = L->n_tokens, T = lay->block_tokens;

        for (uint32_t h = 0; h < s->n_kv_heads; h++) {
                size_t base = (size_t)h * n;
                for (uint32_t b = 0; b * T < n; b++) {
                        uint8_t *blk = pool_ptr(d->pool, L->blocks[b]);
                        uint32_t cnt = n - b * T < T ? n - b * T : T;
                        size_t at = base + (size_t)b * T;
                        memcpy(sc->pos + at, block_side(lay, blk, lay->pos_offset, h, 0), cnt * 4u);
                        memcpy(sc->sum + at, block_side(lay, blk, lay->sum_offset, h, 0), cnt * 4u);
                        memcpy(sc->ema + at, block_side(lay, blk, lay->ema_offset, h, 0), cnt * 4u);
                        memcpy(sc->last + at, block_side(lay, blk, lay->last_offset, h, 0), cnt * 4u);
                        memcpy(sc->logw + at, block_side(lay, blk, lay->logw_offset, h, 0), cnt * 4u);
                }
        }
        *out = (struct policy_layer){ .layer = l,
                                      .n_tokens = n,
                                      .n_kv_heads = s->n_kv_heads,
                                      .pos = sc->pos,
                                      .sum = sc->sum,
                                      .ema = sc->ema,
                                      .last = sc->last,
                                      .logw = sc->logw };
}

/* Adds the policy's log-weight increments into the pool, at the kept slots (every head when the
 * plan is per layer). kvcd writes only slots below the length it planned on: the client appends
 * beyond them, so the two never write the same word. */
static void add_logw(struct kvcd *d, const struct session *s, uint32_t l, const uint32_t *keep, uint32_t k,
                     const float *delta) {
        const struct block_layout *lay = &s->layout;
        const struct session_layer *L = &s->layers[l];
        uint32_t T = lay->block_tokens, heads = s->per_head ? s->n_kv_heads : 1;
        for (uint32_t h = 0; h < s->n_kv_heads; h++) {
                const uint32_t *kh = keep + (size_t)(s->per_head ? h : 0) * k;
                const float *dh = delta + (size_t)(heads > 1 ? h : 0) * k;
                for (uint32_t i = 0; i < k; i++) {
                        if (dh[i] == 0.0f || !isfinite(dh[i]))
                                continue;
                        uint8_t *blk = pool_ptr(d->pool, L->blocks[kh[i] / T]);
                        *(float *)block_side(lay, blk, lay->logw_offset, h, kh[i] % T) += dh[i];
                }
        }
}

/* Builds the plan for the layers with a target below their length; NULL when none has. */
static Kvc__Plan *build_plan(struct kvcd *d, struct session *s, const struct policy_step *ps) {
        struct policy_target *targets = d->scratch.targets;
        uint32_t heads = s->per_head ? s->n_kv_heads : 1;
        uint64_t per_layer = (uint64_t)s->max_keep * heads;
        Kvc__Plan *p = NULL;

        for (uint32_t l = 0; l < s->n_layers; l++) {
                uint32_t n = s->layers[l].n_tokens, k = targets[l].keep;
                if (k == POLICY_NO_PLAN || k >= n || k > s->max_keep)
                        continue;
                struct policy_layer view;
                gather_layer(d, s, l, &view);
                uint32_t *keep = d->scratch.keep;
                int r = s->policy->ops->select(s->policy->state, ps, &view, &targets[l], keep, d->scratch.logw_delta,
                                               d->scratch.work);
                bool deltas = r == 1;
                for (uint32_t h = 0; r >= 0 && h < heads; h++)
                        r = compact_check_keep(keep + (size_t)h * k, k, n);
                if (r < 0) {
                        log_error("session %llu: policy %s gave no valid keep-set for layer %u",
                                  (unsigned long long)s->id, s->policy_name, l);
                        continue;
                }
                if (deltas)
                        add_logw(d, s, l, keep, k, d->scratch.logw_delta);
                memcpy(pool_ptr(d->pool, s->plan_offset) + l * per_layer * 4u, keep,
                       (size_t)k * heads * sizeof(uint32_t));

                if (!p) {
                        p = wire_arena_alloc(d->out, sizeof(*p));
                        Kvc__LayerPlan **layers = wire_arena_alloc(d->out, s->n_layers * sizeof(*layers));
                        if (!p || !layers)
                                return NULL;
                        kvc__plan__init(p);
                        p->layers = layers;
                }
                Kvc__LayerPlan *lp = wire_arena_alloc(d->out, sizeof(*lp));
                if (!lp)
                        return NULL;
                kvc__layer_plan__init(lp);
                lp->layer = l;
                lp->base_tokens = n;
                lp->keep_offset = (uint32_t)(l * per_layer);
                lp->keep_count = k;
                lp->per_head = s->per_head;
                lp->q8_tokens = targets[l].q8 < k ? targets[l].q8 : k;
                p->layers[p->n_layers++] = lp;
        }
        if (p) {
                p->session_id = s->id;
                p->plan_id = ++s->next_plan_id;
                p->base_step = ps->step;
                s->pending_plan_id = p->plan_id;
                s->stats.plans++;
                d->n.plans++;
        }
        return p;
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
                if (st->layer_tokens[l] > s->layers[l].n_blocks * T) {
                        snprintf(why, why_len, "layer %u: %u tokens, but %u slots granted", l,
                                 st->layer_tokens[l], s->layers[l].n_blocks * T);
                        return -EPROTO;
                }
        }
        if (st->layer_tokens[0] > s->layers[0].n_tokens)
                s->appended += st->layer_tokens[0] - s->layers[0].n_tokens;
        for (uint32_t l = 0; l < s->n_layers; l++) {
                s->layers[l].n_tokens = st->layer_tokens[l];
                if (st->layer_tokens[l] > s->stats.peak_tokens)
                        s->stats.peak_tokens = st->layer_tokens[l];
        }
        s->last_step = st->step;
        s->stepped = true;
        s->stats.steps++;
        s->confidence = policy_confidence(s->policy->conf_weights, st->entropy, st->top1_prob, st->margin);
        d->n.steps++;

        *ret_plan = NULL;
        *ret_grant = NULL;
        struct policy_target *targets = d->scratch.targets;
        for (uint32_t l = 0; l < s->n_layers; l++)
                targets[l] = (struct policy_target){ .keep = POLICY_NO_PLAN };
        if (s->pending_plan_id == 0) {
                struct policy_step ps = {
                        .step = st->step,
                        .prefill = st->phase == KVC__PHASE__PHASE_PREFILL,
                        .entropy = st->entropy,
                        .top1_prob = st->top1_prob,
                        .margin = st->margin,
                        .confidence = s->confidence,
                        .appended = s->appended,
                        .layer_tokens = st->layer_tokens,
                };
                const struct policy_ops *ops = s->policy->ops;
                if (ops->observes && ops->observes(s->policy->state, &ps)) {
                        for (uint32_t l = 0; l < s->n_layers; l++) {
                                struct policy_layer view;
                                gather_layer(d, s, l, &view);
                                ops->observe(s->policy->state, &ps, &view);
                        }
                }
                ops->decide(s->policy->state, &ps, targets);
                *ret_plan = build_plan(d, s, &ps);
        }

        /* keep room for the next token in the layers no plan is about to shrink */
        Kvc__Grant *g = NULL;
        for (uint32_t l = 0; l < s->n_layers; l++) {
                struct session_layer *L = &s->layers[l];
                bool planned = targets[l].keep < L->n_tokens;
                if (planned || L->n_tokens + 1 > s->max_layer_tokens || L->n_tokens + 1 <= L->n_blocks * T)
                        continue;
                if (!g && !(g = grant_new(d, s)))
                        break;
                Kvc__LayerBlocks *lb = grant_layer(d, g, l, 1);
                if (!lb || grow_layer(d, s, l, L->n_blocks + 1, lb) < 0) {
                        if (lb)
                                g->n_layers--; /* no room now: the client will ask, and hear why */
                        break;
                }
        }
        if (g && g->n_layers)
                *ret_grant = g;
        return 0;
}

int session_plan_applied(struct kvcd *d, struct session *s, const Kvc__PlanApplied *m, char *why,
                         size_t why_len) {
        uint32_t T = s->layout.block_tokens;

        if (s->pending_plan_id == 0 || m->plan_id != s->pending_plan_id) {
                bool old = m->plan_id <= s->next_plan_id;
                snprintf(why, why_len, "plan %llu is %s", (unsigned long long)m->plan_id,
                         old ? "not outstanding (applied or refused before)" : "unknown");
                return old ? -EALREADY : -ENOENT;
        }
        if (m->status != 0) {
                log_notice("session %llu: client refused plan %llu: %s", (unsigned long long)s->id,
                           (unsigned long long)m->plan_id, wire_errno_name(m->status));
                s->pending_plan_id = 0;
                return 0;
        }
        if (m->n_layer_tokens != s->n_layers) {
                snprintf(why, why_len, "%zu layer lengths for a %u-layer session", m->n_layer_tokens,
                         s->n_layers);
                return -EINVAL;
        }
        /* check everything before changing anything */
        uint32_t release[WIRE_MAX_LAYERS] = { 0 };
        for (size_t i = 0; i < m->n_released; i++) {
                const Kvc__LayerBlocks *lb = m->released[i];
                if (lb->layer >= s->n_layers || release[lb->layer] ||
                    lb->n_blocks > s->layers[lb->layer].n_blocks) {
                        snprintf(why, why_len, "release entry %zu (layer %u) is invalid", i, lb->layer);
                        return -EPROTO;
                }
                const struct session_layer *L = &s->layers[lb->layer];
                for (size_t b = 0; b < lb->n_blocks; b++) {
                        if (lb->blocks[b] != L->blocks[L->n_blocks - lb->n_blocks + b]) {
                                snprintf(why, why_len,
                                         "layer %u: released blocks are not the layer's last %zu", lb->layer,
                                         lb->n_blocks);
                                return -EPROTO;
                        }
                }
                release[lb->layer] = (uint32_t)lb->n_blocks;
        }
        for (uint32_t l = 0; l < s->n_layers; l++) {
                if (m->layer_tokens[l] > (s->layers[l].n_blocks - release[l]) * T) {
                        snprintf(why, why_len, "layer %u: %u tokens do not fit the %u blocks kept", l,
                                 m->layer_tokens[l], s->layers[l].n_blocks - release[l]);
                        return -EPROTO;
                }
        }
        for (uint32_t l = 0; l < s->n_layers; l++) {
                struct session_layer *L = &s->layers[l];
                for (uint32_t b = 0; b < release[l]; b++)
                        free_units(d, s, L->blocks[--L->n_blocks], 1);
                L->n_tokens = m->layer_tokens[l];
        }
        s->pending_plan_id = 0;
        d->n.plans_applied++;
        return 0;
}
