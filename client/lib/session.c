/* session.c: the client's side of a session. Owns struct kvc_session: opening one (its layouts
 * checked against kvcd's, tables and scratch sized for the session's limit), handing one over to
 * another process (export, import), closing it, and the per-token data path: kvc_append writes a
 * token's key, value and side arrays into the layer's last block, kvc_attend runs the CPU
 * attention over the layer (FP only, or FP and INT8), kvc_append_slots counts tokens a caller's
 * own kernels wrote (device pools).
 *
 * A layer asks kvcd for room itself (Reserve) only when the grants that follow each step did not
 * bring it. A session kvcd closed (an operator's evict) refuses further appends and steps with
 * the code kvcd gave.
 */
#define _GNU_SOURCE
#include "internal.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "attention.h"
#include "compact.h"
#include "lloyd.h"
#include "tier.h"

struct kvc_session *session_find(struct kvc_client *c, uint64_t id) {
        for (struct kvc_session *s = c->sessions; s; s = s->next)
                if (s->id == id)
                        return s;
        return NULL;
}

/* Layer l's masks of the shared prefix ([kv head][mask_stride]), or NULL without a prefix. */
static const uint8_t *mask_of(const struct kvc_session *s, uint32_t l) {
        return s->mask ? s->mask + (size_t)l * s->g.n_kv_heads * s->mask_stride : NULL;
}

uint32_t session_low_tokens(const struct kvc_session *s, const struct layer *L) {
        uint32_t n = 0;
        for (uint32_t t = 1; t < s->n_tiers; t++)
                n += L->low[t];
        return n;
}

/* The tier-0 part of a layer, for the kernels that know one dtype. */
struct block_layer session_fp_layer(const struct kvc_session *s, uint32_t l) {
        const struct layer *L = &s->layers[l];
        return (struct block_layer){ .layout = &s->layout,
                                     .blocks = L->t[0].ptrs,
                                     .n_blocks = L->t[0].n,
                                     .n_tokens = L->n_tokens - session_low_tokens(s, L),
                                     .n_shared = s->n_shared,
                                     .shared_mask = mask_of(s, l),
                                     .mask_stride = s->mask_stride };
}

struct ladder_layer session_ladder_layer(const struct kvc_session *s, uint32_t l) {
        const struct layer *L = &s->layers[l];
        struct ladder_layer M = { .n_tiers = s->n_tiers,
                                  .signs = s->signs ? s->signs + (size_t)l * s->g.n_kv_heads * s->g.head_dim
                                                    : NULL,
                                  .n_shared = s->n_shared,
                                  .shared_mask = mask_of(s, l),
                                  .mask_stride = s->mask_stride };
        for (uint32_t t = 0; t < s->n_tiers; t++) {
                M.layout[t] = &s->tiers[t];
                M.blocks[t] = L->t[t].ptrs;
                M.n_blocks[t] = L->t[t].n;
                M.n[t] = t ? L->low[t] : L->n_tokens - session_low_tokens(s, L);
        }
        return M;
}

struct kvc_session *session_free(struct kvc_session *s) {
        if (!s)
                return NULL;
        if (s->layers)
                for (uint32_t l = 0; l < s->g.n_layers; l++)
                        for (uint32_t t = 0; t < LADDER_TIERS; t++) {
                                free(s->layers[l].t[t].offs);
                                free(s->layers[l].t[t].ptrs);
                        }
        free(s->layers);
        free(s->signs);
        free(s->plan_tier);
        free(s->identity);
        if (s->awaiting_link)
                s->c->n_links--;
        free(s->plan_copy);
        free(s->mask);
        free(s->attn_scratch);
        free(s->rows_scratch);
        free(s->compact_scratch);
        free(s);
        return NULL;
}

static void session_unlink(struct kvc_session *s) {
        for (struct kvc_session **p = &s->c->sessions; *p; p = &(*p)->next) {
                if (*p == s) {
                        *p = s->next;
                        return;
                }
        }
}

static Kvc__Dtype wire_dtype(enum kvc_dtype d) {
        switch (d) {
        case KVC_DTYPE_F16: return KVC__DTYPE__DTYPE_F16;
        case KVC_DTYPE_BF16: return KVC__DTYPE__DTYPE_BF16;
        case KVC_DTYPE_F32: return KVC__DTYPE__DTYPE_F32;
        }
        return KVC__DTYPE__DTYPE_UNSPECIFIED;
}

static int session_new(struct kvc_client *c, const struct kvc_geometry *geo, const Kvc__SessionOpened *o,
                       struct kvc_session **ret);

uint64_t kvc_full_cache_bytes(const struct kvc_geometry *g, uint32_t n_tokens) {
        struct block_layout layout;
        if (!g || block_layout_init(&layout, WIRE_BLOCK_TOKENS, g->n_kv_heads, g->head_dim, (enum block_dtype)g->dtype) < 0)
                return 0;
        return (uint64_t)g->n_layers * ((n_tokens + WIRE_BLOCK_TOKENS - 1) / WIRE_BLOCK_TOKENS) * layout.block_bytes;
}

int kvc_session_open(struct kvc_client *c, const struct kvc_session_config *cfg, struct kvc_session **ret) {
        Kvc__Geometry g = KVC__GEOMETRY__INIT;
        Kvc__OpenSession os = KVC__OPEN_SESSION__INIT;
        Kvc__Param params[WIRE_MAX_PARAMS], *pp[WIRE_MAX_PARAMS];
        if (cfg->n_params > WIRE_MAX_PARAMS)
                return client_error(c, -EINVAL, "more than %u parameters", WIRE_MAX_PARAMS);
        g.n_layers = cfg->geometry.n_layers;
        g.n_heads = cfg->geometry.n_heads;
        g.n_kv_heads = cfg->geometry.n_kv_heads;
        g.head_dim = cfg->geometry.head_dim;
        g.dtype = wire_dtype(cfg->geometry.dtype);
        g.max_tokens = cfg->geometry.max_tokens;
        os.geometry = &g;
        os.policy = (char *)(cfg->policy ? cfg->policy : "full");
        os.budget_tokens = cfg->budget_tokens;
        os.tenant = (char *)(cfg->tenant ? cfg->tenant : "");
        os.min_bytes = cfg->min_bytes;
        os.max_bytes = cfg->max_bytes;
        os.priority = cfg->priority;
        os.prompt_tokens = cfg->prompt_tokens;
        os.prompt_token_ids = (uint32_t *)cfg->prompt_token_ids;
        os.n_prompt_token_ids = cfg->n_prompt_token_ids;
        os.int8 = true; /* libkvc stores INT8 blocks (kernels/mixed.h) */
        char tier_text[64], *tier_names[WIRE_MAX_TIERS], *save = NULL;
        if (cfg->tiers && *cfg->tiers) { /* "q4", "q8,q4", ...: kvcd checks the names */
                if (strlen(cfg->tiers) >= sizeof(tier_text))
                        return client_error(c, -EINVAL, "tiers \"%s\" too long", cfg->tiers);
                strcpy(tier_text, cfg->tiers);
                for (char *w = strtok_r(tier_text, ",", &save); w; w = strtok_r(NULL, ",", &save)) {
                        if (os.n_tiers == WIRE_MAX_TIERS)
                                return client_error(c, -EINVAL, "more than %u tiers", WIRE_MAX_TIERS);
                        tier_names[os.n_tiers++] = w;
                }
                os.tiers = tier_names;
                os.int8 = false;
                if (c->dev)
                        return client_error(c, -ENOTSUP, "tiers need a host pool (the CUDA compactor knows INT8 alone)");
        }
        os.rotation_seed = cfg->rotation_seed;
        os.budget_bytes = cfg->budget_bytes;
        os.token_tiers = os.n_tiers > 0; /* plan.c applies LayerPlan.tier_offset */
        os.params = pp;
        for (size_t i = 0; i < cfg->n_params; i++) {
                char *end;
                double v = strtod(cfg->params[i].value, &end);
                kvc__param__init(&params[i]);
                params[i].key = (char *)cfg->params[i].key;
                if (*cfg->params[i].value && !*end) {
                        params[i].value_case = KVC__PARAM__VALUE_NUMBER;
                        params[i].number = v;
                } else {
                        params[i].value_case = KVC__PARAM__VALUE_TEXT;
                        params[i].text = (char *)cfg->params[i].value;
                }
                pp[i] = &params[i];
        }
        os.n_params = cfg->n_params;

        struct block_layout layout;
        if (block_layout_init(&layout, c->block_tokens, g.n_kv_heads, g.head_dim,
                              (enum block_dtype)cfg->geometry.dtype) < 0)
                return client_error(c, -EINVAL, "geometry has a zero or unknown field");
        os.handoff = cfg->handoff;
        if (cfg->share_prefix && c->dev)
                return client_error(c, -EINVAL, "shared prefixes need a host pool");
        os.share_prefix = cfg->share_prefix;
        os.model_id = (char *)(cfg->model_id ? cfg->model_id : "");

        Kvc__Envelope env = KVC__ENVELOPE__INIT, *in;
        env.body_case = KVC__ENVELOPE__BODY_OPEN_SESSION;
        env.open_session = &os;
        int r = client_call(c, &env, KVC__ENVELOPE__BODY_SESSION_OPENED, &in);
        if (r < 0)
                return r;
        return session_new(c, &cfg->geometry, in->session_opened, ret);
}

/* The client's side of a session kvcd opened (or handed over): layouts checked against kvcd's,
 * tables and scratch allocated, empty. */
static int session_new(struct kvc_client *c, const struct kvc_geometry *geo, const Kvc__SessionOpened *o,
                       struct kvc_session **ret) {
        struct block_layout layout;
        int r;
        if (block_layout_init(&layout, c->block_tokens, geo->n_kv_heads, geo->head_dim,
                              (enum block_dtype)geo->dtype) < 0)
                return client_error(c, -EINVAL, "geometry has a zero or unknown field");
        if (o->block_bytes != layout.block_bytes || o->block_tokens != c->block_tokens)
                return client_error(c, -EPROTO, "kvcd's block layout (%llu bytes) differs from ours (%llu)",
                                    (unsigned long long)o->block_bytes,
                                    (unsigned long long)layout.block_bytes);
        if (o->plan_bytes && (r = mapping_check_region(c, o->plan_offset, o->plan_bytes)) < 0)
                return r;
        struct block_layout tiers[LADDER_TIERS] = { layout };
        uint32_t n_tiers = 1;
        bool rotated = false;
        if (o->q8_block_bytes && !o->n_tiers) { /* a kvcd before the ladder: INT8 alone */
                if (block_layout_init(&tiers[1], c->block_tokens, geo->n_kv_heads, geo->head_dim, BLOCK_DTYPE_Q8) < 0 ||
                    tiers[1].block_bytes != o->q8_block_bytes)
                        return client_error(c, -EPROTO, "kvcd's INT8 block layout differs from ours");
                n_tiers = 2;
        }
        for (size_t i = 0; i < o->n_tiers; i++) {
                const struct tier_row *row = tier_by_name(o->tiers[i]);
                if (!row || n_tiers == LADDER_TIERS ||
                    block_layout_init(&tiers[n_tiers], c->block_tokens, geo->n_kv_heads, geo->head_dim, row->dtype) < 0 ||
                    tiers[n_tiers].block_bytes != o->tier_block_bytes[i])
                        return client_error(c, -EPROTO, "kvcd's tier %s differs from ours", o->tiers[i]);
                rotated |= row->rotated != 0;
                n_tiers++;
        }

        struct kvc_session *s = calloc(1, sizeof(*s));
        if (!s)
                return -ENOMEM;
        s->c = c;
        s->id = o->session_id;
        memcpy(s->token, o->token.data, sizeof(s->token));
        s->g = *geo;
        s->layout = layout;
        s->n_tiers = n_tiers;
        memcpy(s->tiers, tiers, sizeof(tiers));
        s->budget = o->budget_tokens;
        s->budget_bytes = o->budget_bytes;
        s->max_layer_tokens = o->max_layer_tokens;
        s->max_layer_blocks = (o->max_layer_tokens + layout.block_tokens - 1) / layout.block_tokens;
        s->ema_gamma = o->ema_gamma;
        s->plan_offset = o->plan_offset;
        s->plan_bytes = o->plan_bytes;
        s->layers = calloc(geo->n_layers, sizeof(*s->layers));
        s->plan_copy = malloc(o->plan_bytes ? o->plan_bytes : 4);
        /* a keep-set of every slot, or of the plan buffer's entries: the larger, in every head */
        size_t identity_slots = ((size_t)s->max_layer_blocks * layout.block_tokens + 1) * geo->n_kv_heads;
        if (identity_slots < o->plan_bytes / 4)
                identity_slots = o->plan_bytes / 4;
        s->plan_tier = malloc(identity_slots);
        s->identity = malloc(identity_slots * sizeof(uint32_t));
        size_t slots = (size_t)s->max_layer_blocks * layout.block_tokens + 1;
        struct ladder_layer probe = { .n_tiers = n_tiers };
        for (uint32_t t = 0; t < n_tiers; t++)
                probe.layout[t] = &s->tiers[t];
        probe.n[0] = (uint32_t)slots;
        size_t attn = 2 * slots;
        if (n_tiers > 1 && ladder_attn_scratch_floats(&probe, geo->n_heads) > attn)
                attn = ladder_attn_scratch_floats(&probe, geo->n_heads);
        size_t fast = attn_fast_scratch_floats((uint32_t)slots, geo->n_heads, geo->n_kv_heads, geo->head_dim,
                                               layout.block_tokens);
        attn = fast > attn ? fast : attn;
        s->attn_scratch = malloc(attn * sizeof(float));
        size_t cs = 2 * (size_t)geo->head_dim; /* summarize_evicted */
        if (n_tiers > 1 && ladder_compact_scratch_floats(&probe) > cs)
                cs = ladder_compact_scratch_floats(&probe);
        s->compact_scratch = malloc(cs * sizeof(float));
        bool ok = s->layers && s->plan_copy && s->plan_tier && s->identity && s->attn_scratch && s->compact_scratch;
        if (ok && rotated) { /* the rotation kvcd recorded with the session (lloyd.h) */
                size_t per = (size_t)geo->n_kv_heads * geo->head_dim;
                ok = (s->signs = malloc(geo->n_layers * per * sizeof(float))) != NULL;
                for (uint32_t l = 0; ok && l < geo->n_layers; l++)
                        for (uint32_t h = 0; h < geo->n_kv_heads; h++)
                                lloyd_signs(o->rotation_seed, l, h, geo->head_dim,
                                            s->signs + l * per + (size_t)h * geo->head_dim);
        }
        for (uint32_t l = 0; ok && l < geo->n_layers; l++) {
                struct layer *L = &s->layers[l];
                for (uint32_t t = 0; ok && t < n_tiers; t++) {
                        L->t[t].offs = calloc(s->max_layer_blocks + 1, sizeof(uint64_t));
                        L->t[t].ptrs = calloc(s->max_layer_blocks + 1, sizeof(uint8_t *));
                        ok = L->t[t].offs && L->t[t].ptrs;
                }
        }
        uint64_t mask_bytes = (uint64_t)geo->n_layers * geo->n_kv_heads * o->mask_stride;
        if (ok && o->mask_stride) {
                s->mask = calloc(mask_bytes, 1);
                s->mask_offset = o->mask_offset;
                s->mask_stride = o->mask_stride;
                ok = s->mask != NULL;
        }
        s->next = c->sessions;
        c->sessions = s;
        if (!ok) {
                kvc_session_close(s, NULL);
                return -ENOMEM;
        }
        r = 0;
        if (o->mask_stride && o->plan_bytes &&
            (o->mask_offset > o->plan_bytes || mask_bytes > o->plan_bytes - o->mask_offset))
                r = client_error(c, -EPROTO, "kvcd's masks lie outside the session's plan buffer");
        if (r == 0 && o->shared_tokens) { /* a prefix attached: the first blocks of every layer */
                uint32_t nb = o->shared_tokens / layout.block_tokens;
                if (o->n_attached != geo->n_layers || nb > s->max_layer_blocks ||
                    (uint64_t)o->mask_stride * 8 < o->shared_tokens || !s->mask)
                        r = client_error(c, -EPROTO, "kvcd's shared prefix does not fit the session");
                for (uint32_t l = 0; r == 0 && l < geo->n_layers; l++) {
                        const Kvc__LayerBlocks *lb = o->attached[l];
                        struct layer *L = &s->layers[l];
                        if (lb->layer != l || lb->n_blocks != nb || lb->q8 || lb->tier) {
                                r = client_error(c, -EPROTO, "kvcd's shared prefix names layer %u wrongly",
                                                 l);
                                break;
                        }
                        for (uint32_t b = 0; r == 0 && b < nb; b++) {
                                r = mapping_check_region(c, lb->blocks[b], layout.block_bytes);
                                L->t[0].offs[b] = lb->blocks[b];
                                L->t[0].ptrs[b] = c->base + lb->blocks[b];
                        }
                        L->t[0].n = nb;
                        L->n_tokens = o->shared_tokens;
                }
                s->n_shared = o->shared_tokens;
        }
        if (r < 0) {
                kvc_session_close(s, NULL);
                return r;
        }
        *ret = s;
        return 0;
}

int kvc_session_export(struct kvc_session *s, struct kvc_handoff *ret) {
        struct kvc_client *c = s->c;
        int r;
        if (s->closed_by_kvcd)
                return client_error(c, -s->closed_by_kvcd, "kvcd closed session %llu",
                                    (unsigned long long)s->id);
        if (c->n_queue && (r = kvc_flush(c)) < 0)
                return r;
        while (c->n_pending) /* every answer in, every plan applied */
                if ((r = kvc_poll(c, c->timeout_ms)) < 0)
                        return r;
        Kvc__HandoffExport m = KVC__HANDOFF_EXPORT__INIT;
        uint32_t lengths[WIRE_MAX_LAYERS];
        for (uint32_t l = 0; l < s->g.n_layers; l++)
                lengths[l] = s->layers[l].n_tokens;
        m.session_id = s->id;
        m.n_layer_tokens = s->g.n_layers;
        m.layer_tokens = lengths;
        Kvc__Envelope env = KVC__ENVELOPE__INIT, *in;
        env.body_case = KVC__ENVELOPE__BODY_HANDOFF_EXPORT;
        env.handoff_export = &m;
        if ((r = client_call(c, &env, KVC__ENVELOPE__BODY_HANDOFF_TICKET, &in)) < 0)
                return r;
        ret->session_id = in->handoff_ticket->session_id;
        memcpy(ret->ticket, in->handoff_ticket->ticket.data, sizeof(ret->ticket));
        /* ours no more: kvcd asks for the chunks back (UNMAP) once the importer has them */
        session_unlink(s);
        session_free(s);
        return 0;
}

static enum kvc_dtype dtype_of_wire(Kvc__Dtype d) {
        switch (d) {
        case KVC__DTYPE__DTYPE_F16: return KVC_DTYPE_F16;
        case KVC__DTYPE__DTYPE_BF16: return KVC_DTYPE_BF16;
        default: return KVC_DTYPE_F32;
        }
}

/* Fills one table of a session handed over, checking every block kvcd names. */
static int import_table(struct kvc_client *c, struct table *t, const uint64_t *blocks, size_t n,
                        uint64_t block_bytes, uint32_t max_blocks) {
        if (n > max_blocks)
                return client_error(c, -EPROTO, "kvcd handed over %zu blocks for a layer of at most %u", n,
                                    max_blocks);
        for (size_t b = 0; b < n; b++) {
                int r = mapping_check_region(c, blocks[b], block_bytes);
                if (r < 0)
                        return r;
                t->offs[b] = blocks[b];
                t->ptrs[b] = c->base + blocks[b];
        }
        t->n = (uint32_t)n;
        return 0;
}

int kvc_session_import(struct kvc_client *c, const struct kvc_handoff *h, struct kvc_session **ret) {
        Kvc__HandoffImport m = KVC__HANDOFF_IMPORT__INIT;
        m.session_id = h->session_id;
        m.ticket.data = (uint8_t *)h->ticket;
        m.ticket.len = sizeof(h->ticket);
        Kvc__Envelope env = KVC__ENVELOPE__INIT, *in;
        env.body_case = KVC__ENVELOPE__BODY_HANDOFF_IMPORT;
        env.handoff_import = &m;
        int r = client_call(c, &env, KVC__ENVELOPE__BODY_HANDOFF_IMPORTED, &in);
        if (r < 0)
                return r;
        const Kvc__HandoffImported *hi = in->handoff_imported;
        const Kvc__Geometry *g = hi->geometry;
        struct kvc_geometry geo = { .n_layers = g->n_layers,
                                    .n_heads = g->n_heads,
                                    .n_kv_heads = g->n_kv_heads,
                                    .head_dim = g->head_dim,
                                    .dtype = dtype_of_wire(g->dtype),
                                    .max_tokens = g->max_tokens };
        struct kvc_session *s;
        if ((r = session_new(c, &geo, hi->opened, &s)) < 0)
                return r;
        uint32_t T = s->layout.block_tokens;
        for (uint32_t l = 0; l < geo.n_layers && r == 0; l++) {
                const Kvc__ResumeLayer *L = hi->layers[l];
                struct layer *SL = &s->layers[l];
                r = import_table(c, &SL->t[0], L->fp_blocks, L->n_fp_blocks, s->layout.block_bytes,
                                 s->max_layer_blocks);
                uint64_t low = 0;
                bool fits = true;
                for (uint32_t t = 1; r == 0 && t < LADDER_TIERS; t++) {
                        uint32_t n;
                        const uint64_t *b;
                        size_t nb;
                        wire_resume_tier(L, t, &n, &b, &nb);
                        if (t >= s->n_tiers && (n || nb)) {
                                r = client_error(c, -EPROTO, "tier %u handed over for a session without it", t);
                                break;
                        }
                        if (t < s->n_tiers)
                                r = import_table(c, &SL->t[t], b, nb, s->tiers[t].block_bytes, s->max_layer_blocks);
                        SL->low[t] = t < s->n_tiers ? n : 0;
                        fits &= t >= s->n_tiers || n <= SL->t[t].n * T;
                        low += n;
                }
                if (r == 0 && (!fits || L->n_tokens > s->max_layer_tokens || low > L->n_tokens ||
                               L->n_tokens - low > SL->t[0].n * T))
                        r = client_error(c, -EPROTO, "layer %u: %u tokens do not fit the blocks handed over",
                                         l, L->n_tokens);
                SL->n_tokens = L->n_tokens;
        }
        if (r < 0) { /* the session is ours in kvcd: close it there too */
                kvc_session_close(s, NULL);
                return r;
        }
        s->last_step = hi->last_step;
        s->stepped = hi->stepped;
        s->last_plan_id = hi->last_plan_id;
        *ret = s;
        return 0;
}

int kvc_session_close(struct kvc_session *s, struct kvc_session_stats *ret_stats) {
        struct kvc_client *c = s->c;
        Kvc__CloseSession cs = KVC__CLOSE_SESSION__INIT;
        Kvc__Envelope env = KVC__ENVELOPE__INIT, *in;
        cs.session_id = s->id;
        env.body_case = KVC__ENVELOPE__BODY_CLOSE_SESSION;
        env.close_session = &cs;
        int r = client_call(c, &env, KVC__ENVELOPE__BODY_SESSION_CLOSED, &in);
        if (r == 0 && ret_stats) {
                struct kvc_session_stats st = s->stats;
                const Kvc__SessionStats *k = in->session_closed->stats;
                if (k) {
                        st.steps = k->steps;
                        st.plans = k->plans;
                        st.peak_tokens = k->peak_tokens;
                        st.peak_layer_blocks = k->peak_layer_blocks;
                        st.peak_bytes = k->peak_bytes;
                        st.bytes = k->bytes;
                }
                *ret_stats = st;
        }
        session_unlink(s);
        session_free(s);
        return r;
}

uint64_t kvc_session_last_step(const struct kvc_session *s, int *ret_stepped) {
        if (ret_stepped)
                *ret_stepped = s->stepped;
        return s->last_step;
}

uint32_t kvc_session_shared_tokens(const struct kvc_session *s) {
        return s->n_shared;
}

uint64_t kvc_session_id(const struct kvc_session *s) {
        return s->id;
}

uint32_t kvc_session_budget(const struct kvc_session *s) {
        return s->budget;
}

uint32_t kvc_session_max_tokens(const struct kvc_session *s) {
        return s->max_layer_tokens;
}

int kvc_session_reserve(struct kvc_session *s, uint32_t n_tokens) {
        struct kvc_client *c = s->c;
        Kvc__Reserve rs = KVC__RESERVE__INIT;
        Kvc__Envelope env = KVC__ENVELOPE__INIT, *in;
        rs.session_id = s->id;
        rs.n_tokens = n_tokens;
        env.body_case = KVC__ENVELOPE__BODY_RESERVE;
        env.reserve = &rs;
        int r = client_call(c, &env, KVC__ENVELOPE__BODY_GRANT, &in);
        return r < 0 ? r : plan_grant(c, in->grant);
}

#define DEVICE_POOL_HINT                                                                                     \
        "the pool is GPU memory: write and read it with CUDA kernels (kernels/cuda.h) at the blocks "        \
        "kvc_layer_view shows, and count tokens with kvc_append_slots"

int kvc_append(struct kvc_session *s, uint32_t layer, int32_t pos, const float *k, const float *v) {
        if (layer >= s->g.n_layers)
                return client_error(s->c, -EINVAL, "layer %u of %u", layer, s->g.n_layers);
        if (s->c->dev)
                return client_error(s->c, -ENOTSUP, "kvc_append: " DEVICE_POOL_HINT);
        if (s->closed_by_kvcd)
                return client_error(s->c, -s->closed_by_kvcd, "kvcd closed session %llu",
                                    (unsigned long long)s->id);
        struct layer *L = &s->layers[layer];
        const struct block_layout *l = &s->layout;
        uint32_t T = l->block_tokens, fp = L->n_tokens - session_low_tokens(s, L);
        /* with a plan lag, the answers still on their way may bring room (grants, or plans that
         * compact the layer): take them before asking kvcd for more than the policy allows */
        while ((fp >= L->t[0].n * T || L->n_tokens >= s->max_layer_tokens) && s->c->n_pending) {
                int r = kvc_poll(s->c, s->c->timeout_ms);
                if (r < 0)
                        return r;
                if (s->closed_by_kvcd)
                        return client_error(s->c, -s->closed_by_kvcd, "kvcd closed session %llu",
                                            (unsigned long long)s->id);
                fp = L->n_tokens - session_low_tokens(s, L);
        }
        if (L->n_tokens >= s->max_layer_tokens) /* the scratch is sized for it, whatever kvcd granted */
                return client_error(s->c, -ENOSPC, "layer %u holds the %u tokens the session allows", layer,
                                    s->max_layer_tokens);
        if (fp >= L->t[0].n * T) {
                int r = kvc_session_reserve(s, L->n_tokens + 1);
                if (r < 0)
                        return r;
                fp = L->n_tokens - session_low_tokens(s, L); /* a plan may have been applied meanwhile */
                if (fp >= L->t[0].n * T)
                        return client_error(s->c, -EPROTO, "kvcd granted no room for the next token");
        }
        uint32_t slot = fp % T, D = s->g.head_dim;
        uint8_t *b = L->t[0].ptrs[fp / T];
        for (uint32_t h = 0; h < s->g.n_kv_heads; h++) {
                block_store_row(l->dtype, k + (size_t)h * D, block_key(l, b, h, slot), D);
                block_store_row(l->dtype, v + (size_t)h * D, block_value(l, b, h, slot), D);
                *(int32_t *)block_side(l, b, l->pos_offset, h, slot) = pos;
                *(float *)block_side(l, b, l->sum_offset, h, slot) = 0.0f;
                *(float *)block_side(l, b, l->ema_offset, h, slot) = 0.0f;
                *(float *)block_side(l, b, l->last_offset, h, slot) = 0.0f;
                *(float *)block_side(l, b, l->logw_offset, h, slot) = 0.0f;
        }
        L->n_tokens++;
        return 0;
}

int kvc_attend(struct kvc_session *s, uint32_t layer, const float *q, float *out) {
        return kvc_attend_rows(s, layer, 1, q, out);
}

/* The scratch of n_rows rows at once: the session's own for one, a lazily made one for a chunk. */
static float *rows_scratch(struct kvc_session *s, uint32_t n_rows) {
        if (n_rows == 1)
                return s->attn_scratch;
        if (!s->rows_scratch) {
                uint32_t slots = s->max_layer_blocks * s->layout.block_tokens + 1;
                s->rows_scratch =
                        malloc(attn_rows_scratch_floats(slots, ATTN_ROWS_GROUP, s->g.n_heads, s->g.n_kv_heads,
                                                        s->g.head_dim, s->layout.block_tokens) *
                               sizeof(float));
        }
        return s->rows_scratch;
}

int kvc_attend_rows(struct kvc_session *s, uint32_t layer, uint32_t n_rows, const float *q, float *out) {
        if (layer >= s->g.n_layers)
                return client_error(s->c, -EINVAL, "layer %u of %u", layer, s->g.n_layers);
        if (s->c->dev)
                return client_error(s->c, -ENOTSUP, "kvc_attend: " DEVICE_POOL_HINT);
        const struct layer *L = &s->layers[layer];
        if (L->n_tokens == 0)
                return client_error(s->c, -EINVAL, "attention over an empty layer %u", layer);
        /* the rows are the layer's newest tokens, at the dtype (tier 0) */
        uint32_t low = session_low_tokens(s, L);
        if (n_rows == 0 || n_rows > L->n_tokens || low > L->n_tokens - n_rows)
                return client_error(s->c, -EINVAL, "layer %u: %u rows to attend over %u tokens (%u in lower tiers)",
                                    layer, n_rows, L->n_tokens, low);
        float *scratch = rows_scratch(s, n_rows);
        if (!scratch)
                return client_error(s->c, -ENOMEM, "attention scratch for %u rows", n_rows);
        int r;
        /* the fast kernel (attention.h): the references are attn_decode_ref and attn_decode_mixed */
        if (low == 0) { /* bit for bit what kvc-run --local computes, at f32 */
                struct block_layer bl = session_fp_layer(s, layer);
                r = attn_prefill_fast(&bl, n_rows, q, out, s->g.n_heads, s->ema_gamma, 1, scratch,
                                      ATTN_ISA_BEST);
        } else {
                struct ladder_layer M = session_ladder_layer(s, layer);
                r = attn_prefill_fast_ladder(&M, n_rows, q, out, s->g.n_heads, s->ema_gamma, 1, scratch,
                                             ATTN_ISA_BEST);
        }
        return r < 0 ? client_error(s->c, r, "attention over layer %u", layer) : 0;
}

int kvc_append_slots(struct kvc_session *s, uint32_t layer, uint32_t n) {
        if (layer >= s->g.n_layers)
                return client_error(s->c, -EINVAL, "layer %u of %u", layer, s->g.n_layers);
        if (s->closed_by_kvcd)
                return client_error(s->c, -s->closed_by_kvcd, "kvcd closed session %llu",
                                    (unsigned long long)s->id);
        struct layer *L = &s->layers[layer];
        uint32_t T = s->layout.block_tokens;
        if (n > s->max_layer_tokens || L->n_tokens > s->max_layer_tokens - n)
                return client_error(s->c, -ENOSPC, "layer %u: %u more tokens pass the session's limit of %u",
                                    layer, n, s->max_layer_tokens);
        if (L->n_tokens - session_low_tokens(s, L) + n > L->t[0].n * T) {
                int r = kvc_session_reserve(s, L->n_tokens + n);
                if (r < 0)
                        return r;
                if (L->n_tokens - session_low_tokens(s, L) + n > L->t[0].n * T)
                        return client_error(s->c, -EPROTO, "kvcd granted no room for %u more tokens", n);
        }
        L->n_tokens += n;
        return 0;
}

uint32_t kvc_layer_tokens(const struct kvc_session *s, uint32_t layer) {
        return layer < s->g.n_layers ? s->layers[layer].n_tokens : 0;
}

uint32_t kvc_layer_q8_tokens(const struct kvc_session *s, uint32_t layer) {
        return layer < s->g.n_layers ? session_low_tokens(s, &s->layers[layer]) : 0;
}

uint32_t kvc_session_tiers(const struct kvc_session *s) {
        return s->n_tiers;
}

const char *kvc_session_tier_name(const struct kvc_session *s, uint32_t tier) {
        return tier < s->n_tiers ? tier_row(s->tiers[tier].dtype)->name : NULL;
}

uint32_t kvc_layer_tier_tokens(const struct kvc_session *s, uint32_t layer, uint32_t tier) {
        if (layer >= s->g.n_layers || tier >= s->n_tiers)
                return 0;
        const struct layer *L = &s->layers[layer];
        return tier ? L->low[tier] : L->n_tokens - session_low_tokens(s, L);
}

uint64_t kvc_session_bytes(const struct kvc_session *s) {
        uint64_t b = s->plan_bytes;
        for (uint32_t l = 0; l < s->g.n_layers; l++)
                for (uint32_t t = 0; t < s->n_tiers; t++)
                        b += (uint64_t)s->layers[l].t[t].n * s->tiers[t].block_bytes;
        return b;
}

uint64_t kvc_session_budget_bytes(const struct kvc_session *s) {
        return s->budget_bytes;
}

int kvc_layer_view(const struct kvc_session *s, uint32_t layer, struct kvc_layer_view *ret) {
        if (layer >= s->g.n_layers)
                return -EINVAL;
        const struct layer *L = &s->layers[layer];
        *ret = (struct kvc_layer_view){ .n_tokens = L->n_tokens,
                                        .n_blocks = L->t[0].n,
                                        .block_tokens = s->layout.block_tokens,
                                        .block_bytes = s->layout.block_bytes,
                                        .blocks = L->t[0].ptrs };
        if (s->n_tiers > 2 || (s->n_tiers == 2 && s->tiers[1].dtype != BLOCK_DTYPE_Q8))
                return client_error(s->c, -ENOTSUP,
                                    "kvc_layer_view describes the dtype's and INT8 blocks; layer %u holds tiers "
                                    "of the ladder (kvc_layer_gather reads them)",
                                    layer);
        if (s->n_tiers > 1) { /* INT8, as mixed.h lays it out */
                ret->n_q8 = L->low[1];
                ret->n_q8_blocks = L->t[1].n;
                ret->q8_block_bytes = s->tiers[1].block_bytes;
                ret->q8_blocks = L->t[1].ptrs;
        }
        return 0;
}

void kvc_session_get_stats(const struct kvc_session *s, struct kvc_session_stats *ret) {
        *ret = s->stats;
}
