/* wire.c: the only caller of protobuf-c. Size caps, a bounded unpack arena, and one validator
 * per message kind, selected from a table by the envelope's body case.
 *
 * Why an arena: protobuf-c's unpack trusts the lengths inside a frame and allocates per
 * repeated element, so a 200 KB frame can cost 9 MB of heap. Unpacking into a capped bump
 * arena makes the cost of one message bounded and its release O(1); an exhausted arena makes
 * unpack fail cleanly (NULL), which we report as EMSGSIZE.
 *
 * Why validate everything here: handlers in kvcd and libkvc then work with numbers they can
 * trust (finite floats, counts under the protocol limits, ids non-zero), and each check is
 * written once. Checks that need session state (a layer index against the session's geometry)
 * belong to the handlers.
 */
#include "wire.h"

#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct wire_arena {
        ProtobufCAllocator allocator;
        size_t cap;
        size_t used;
        int exhausted; /* an allocation failed since the last reset */
        uint8_t *buf;
};

static void *arena_alloc(void *data, size_t size) {
        struct wire_arena *a = data;
        size_t aligned = (size + 15u) & ~(size_t)15u;

        if (aligned < size || aligned > a->cap - a->used) {
                a->exhausted = 1;
                return NULL;
        }
        void *p = a->buf + a->used;
        a->used += aligned;
        return p;
}

static void arena_free(void *data, void *ptr) {
        (void)data;
        (void)ptr;
}

int wire_arena_new(size_t cap_bytes, struct wire_arena **ret) {
        struct wire_arena *a = calloc(1, sizeof(*a));
        if (!a)
                return -ENOMEM;
        a->buf = malloc(cap_bytes);
        if (!a->buf) {
                free(a);
                return -ENOMEM;
        }
        a->cap = cap_bytes;
        a->allocator.alloc = arena_alloc;
        a->allocator.free = arena_free;
        a->allocator.allocator_data = a;
        *ret = a;
        return 0;
}

struct wire_arena *wire_arena_free(struct wire_arena *a) {
        if (a) {
                free(a->buf);
                free(a);
        }
        return NULL;
}

void wire_arena_reset(struct wire_arena *a) {
        a->used = 0;
        a->exhausted = 0;
}

void *wire_arena_alloc(struct wire_arena *a, size_t bytes) {
        void *p = arena_alloc(a, bytes ? bytes : 1);
        if (p)
                memset(p, 0, bytes);
        return p;
}

char *wire_arena_strdup(struct wire_arena *a, const char *s) {
        size_t n = strlen(s) + 1;
        char *p = arena_alloc(a, n);
        if (p)
                memcpy(p, s, n);
        return p;
}

static int fail(int code, char *why, size_t why_len, const char *fmt, ...)
        __attribute__((format(printf, 4, 5)));

static int fail(int code, char *why, size_t why_len, const char *fmt, ...) {
        if (why && why_len) {
                va_list ap;
                va_start(ap, fmt);
                vsnprintf(why, why_len, fmt, ap);
                va_end(ap);
        }
        return code;
}

#define BAD(...) fail(-EINVAL, why, why_len, __VA_ARGS__)

/* Printable ASCII without spaces or quotes: names, keys, tenants. */
static int check_name(const char *s, size_t max, int allow_empty, const char *what, char *why,
                      size_t why_len) {
        size_t n = s ? strnlen(s, max + 1) : 0;
        if (n == 0 && !allow_empty)
                return BAD("%s is empty", what);
        if (n > max)
                return BAD("%s longer than %zu bytes", what, max);
        for (size_t i = 0; i < n; i++) {
                unsigned char c = (unsigned char)s[i];
                if (c <= 0x20 || c >= 0x7f || c == '"' || c == '\\')
                        return BAD("%s has a byte 0x%02x that is not allowed", what, c);
        }
        return 0;
}

/* Free text for humans: any bytes but control characters, bounded. */
static int check_text(const char *s, size_t max, const char *what, char *why, size_t why_len) {
        size_t n = s ? strnlen(s, max + 1) : 0;
        if (n > max)
                return BAD("%s longer than %zu bytes", what, max);
        for (size_t i = 0; i < n; i++)
                if ((unsigned char)s[i] < 0x20 || s[i] == 0x7f)
                        return BAD("%s has a control character", what);
        return 0;
}

static int check_unit(float x, const char *what, char *why, size_t why_len) {
        if (!(x >= 0.0f && x <= 1.0f)) /* also false for NaN */
                return BAD("%s %g is not a number in [0, 1]", what, (double)x);
        return 0;
}

static int check_layer_blocks(Kvc__LayerBlocks *const *v, size_t n, size_t *ref_count, const char *what,
                              char *why, size_t why_len) {
        if (n > WIRE_MAX_LAYERS)
                return BAD("%s lists %zu layers (max %u)", what, n, WIRE_MAX_LAYERS);
        for (size_t i = 0; i < n; i++) {
                if (v[i]->layer >= WIRE_MAX_LAYERS)
                        return BAD("%s layer %u out of range", what, v[i]->layer);
                if (v[i]->tier > WIRE_MAX_TIERS)
                        return BAD("%s tier %u out of range", what, v[i]->tier);
                *ref_count += v[i]->n_blocks;
                if (*ref_count > WIRE_MAX_BLOCK_REFS)
                        return BAD("%s lists more than %u blocks", what, WIRE_MAX_BLOCK_REFS);
        }
        return 0;
}

static int check_layer_tokens(size_t n, const uint32_t *v, char *why, size_t why_len) {
        if (n > WIRE_MAX_LAYERS)
                return BAD("%zu layer lengths (max %u)", n, WIRE_MAX_LAYERS);
        for (size_t i = 0; i < n; i++)
                if (v[i] > WIRE_MAX_TOKENS)
                        return BAD("layer %zu length %u exceeds %u", i, v[i], WIRE_MAX_TOKENS);
        return 0;
}

static int check_error(const Kvc__Error *e, char *why, size_t why_len) {
        if (e->code <= 0 || e->code > WIRE_MAX_ERRNO)
                return BAD("error code %d out of range", e->code);
        return check_text(e->message, WIRE_MAX_MESSAGE, "error message", why, why_len);
}

static int v_hello(const Kvc__Envelope *env, char *why, size_t why_len) {
        const Kvc__Hello *m = env->hello;
        if (m->token.len != WIRE_TOKEN_BYTES)
                return BAD("hello token has %zu bytes, not %u", m->token.len, WIRE_TOKEN_BYTES);
        return check_text(m->client_name, WIRE_MAX_NAME, "client name", why, why_len);
}

static int v_welcome(const Kvc__Envelope *env, char *why, size_t why_len) {
        const Kvc__Welcome *m = env->welcome;
        if (m->chunk_bytes == 0 || m->chunk_bytes % 4096 || m->chunk_bytes > (1ull << 32))
                return BAD("chunk size %llu invalid", (unsigned long long)m->chunk_bytes);
        if (m->pool_bytes == 0 || m->pool_bytes % m->chunk_bytes || m->pool_bytes > (1ull << 46))
                return BAD("pool size %llu invalid", (unsigned long long)m->pool_bytes);
        if (m->block_tokens == 0 || m->block_tokens > WIRE_MAX_BLOCK_TOKENS)
                return BAD("block_tokens %u out of range", m->block_tokens);
        int r = check_text(m->backend, WIRE_MAX_NAME, "backend", why, why_len);
        return r < 0 ? r : check_text(m->daemon_version, WIRE_MAX_NAME, "version", why, why_len);
}

static int v_geometry(const Kvc__Geometry *g, char *why, size_t why_len) {
        if (!g)
                return BAD("geometry missing");
        if (g->n_layers == 0 || g->n_layers > WIRE_MAX_LAYERS)
                return BAD("n_layers %u out of range [1, %u]", g->n_layers, WIRE_MAX_LAYERS);
        if (g->n_heads == 0 || g->n_heads > WIRE_MAX_HEADS)
                return BAD("n_heads %u out of range [1, %u]", g->n_heads, WIRE_MAX_HEADS);
        if (g->n_kv_heads == 0 || g->n_kv_heads > WIRE_MAX_KV_HEADS)
                return BAD("n_kv_heads %u out of range [1, %u]", g->n_kv_heads, WIRE_MAX_KV_HEADS);
        if (g->n_heads % g->n_kv_heads)
                return BAD("n_kv_heads %u does not divide n_heads %u", g->n_kv_heads, g->n_heads);
        if (g->head_dim == 0 || g->head_dim > WIRE_MAX_HEAD_DIM)
                return BAD("head_dim %u out of range [1, %u]", g->head_dim, WIRE_MAX_HEAD_DIM);
        if (g->dtype != KVC__DTYPE__DTYPE_F32 && g->dtype != KVC__DTYPE__DTYPE_F16 &&
            g->dtype != KVC__DTYPE__DTYPE_BF16)
                return BAD("dtype %d unknown", (int)g->dtype);
        if (g->max_tokens == 0 || g->max_tokens > WIRE_MAX_TOKENS)
                return BAD("max_tokens %u out of range [1, %u]", g->max_tokens, WIRE_MAX_TOKENS);
        return 0;
}

static int v_open_session(const Kvc__Envelope *env, char *why, size_t why_len) {
        const Kvc__OpenSession *m = env->open_session;
        int r = v_geometry(m->geometry, why, why_len);
        if (r < 0)
                return r;
        if ((r = check_name(m->policy, WIRE_MAX_NAME, 0, "policy", why, why_len)) < 0)
                return r;
        if (m->budget_tokens > WIRE_MAX_TOKENS)
                return BAD("budget %u exceeds %u", m->budget_tokens, WIRE_MAX_TOKENS);
        if (m->n_prompt_token_ids > WIRE_MAX_TOKENS || m->n_prompt_token_ids > m->geometry->max_tokens)
                return BAD("%zu prompt token ids exceed the context", m->n_prompt_token_ids);
        if (m->prompt_tokens > m->geometry->max_tokens)
                return BAD("prompt of %u tokens exceeds the context of %u", m->prompt_tokens,
                           m->geometry->max_tokens);
        if (m->n_params > WIRE_MAX_PARAMS)
                return BAD("%zu params (max %u)", m->n_params, WIRE_MAX_PARAMS);
        for (size_t i = 0; i < m->n_params; i++) {
                const Kvc__Param *p = m->params[i];
                if ((r = check_name(p->key, WIRE_MAX_NAME, 0, "param key", why, why_len)) < 0)
                        return r;
                if (p->value_case == KVC__PARAM__VALUE_NUMBER) {
                        if (!isfinite(p->number))
                                return BAD("param %s is not a finite number", p->key);
                } else if (p->value_case == KVC__PARAM__VALUE_TEXT) {
                        if ((r = check_name(p->text, WIRE_MAX_NAME, 0, "param text", why, why_len)) < 0)
                                return r;
                } else {
                        return BAD("param %s has no value", p->key);
                }
        }
        if ((r = check_name(m->model_id, WIRE_MAX_NAME, 1, "model id", why, why_len)) < 0)
                return r;
        if (m->n_tiers > WIRE_MAX_TIERS)
                return BAD("%zu tiers (max %u)", m->n_tiers, WIRE_MAX_TIERS);
        for (size_t i = 0; i < m->n_tiers; i++)
                if ((r = check_name(m->tiers[i], WIRE_MAX_NAME, 0, "tier", why, why_len)) < 0)
                        return r;
        return check_name(m->tenant, WIRE_MAX_NAME, 1, "tenant", why, why_len);
}

static int v_session_opened(const Kvc__Envelope *env, char *why, size_t why_len) {
        const Kvc__SessionOpened *m = env->session_opened;
        if (m->session_id == 0)
                return BAD("session id 0");
        if (m->token.len != WIRE_TOKEN_BYTES)
                return BAD("session token has %zu bytes", m->token.len);
        if (m->block_bytes == 0 || m->block_bytes > (1ull << 32))
                return BAD("block_bytes %llu invalid", (unsigned long long)m->block_bytes);
        if (m->block_tokens == 0 || m->block_tokens > WIRE_MAX_BLOCK_TOKENS)
                return BAD("block_tokens %u out of range", m->block_tokens);
        if (m->q8_block_bytes > (1ull << 32))
                return BAD("q8_block_bytes %llu invalid", (unsigned long long)m->q8_block_bytes);
        if (m->n_tiers > WIRE_MAX_TIERS || m->n_tier_block_bytes != m->n_tiers)
                return BAD("%zu tiers with %zu block sizes", m->n_tiers, m->n_tier_block_bytes);
        for (size_t i = 0; i < m->n_tiers; i++) {
                int r = check_name(m->tiers[i], WIRE_MAX_NAME, 0, "tier", why, why_len);
                if (r < 0)
                        return r;
                if (m->tier_block_bytes[i] == 0 || m->tier_block_bytes[i] > (1ull << 32))
                        return BAD("tier %zu: block_bytes %llu invalid", i,
                                   (unsigned long long)m->tier_block_bytes[i]);
        }
        if (m->plan_bytes > (1ull << 32) || m->plan_bytes % 4)
                return BAD("plan buffer size %llu invalid", (unsigned long long)m->plan_bytes);
        if (!(m->ema_gamma >= 0.0f && m->ema_gamma <= 1.0f))
                return BAD("ema_gamma %g not in [0, 1]", (double)m->ema_gamma);
        if (m->max_layer_tokens == 0 || m->max_layer_tokens > WIRE_MAX_TOKENS + WIRE_MAX_BLOCK_TOKENS)
                return BAD("max_layer_tokens %u out of range", m->max_layer_tokens);
        if (m->budget_tokens > WIRE_MAX_TOKENS)
                return BAD("budget %u out of range", m->budget_tokens);
        if (m->shared_tokens % 16 || m->shared_tokens > WIRE_MAX_TOKENS ||
            (m->shared_tokens && !m->n_attached))
                return BAD("shared prefix of %u tokens invalid", m->shared_tokens);
        size_t refs = 0;
        int r = check_layer_blocks(m->attached, m->n_attached, &refs, "attached prefix", why, why_len);
        if (r < 0)
                return r;
        return check_name(m->policy, WIRE_MAX_NAME, 0, "policy", why, why_len);
}

static int v_reserve(const Kvc__Envelope *env, char *why, size_t why_len) {
        const Kvc__Reserve *m = env->reserve;
        if (m->session_id == 0)
                return BAD("session id 0");
        if (m->n_tokens == 0 || m->n_tokens > WIRE_MAX_TOKENS)
                return BAD("reserve of %u tokens out of range [1, %u]", m->n_tokens, WIRE_MAX_TOKENS);
        return 0;
}

static int check_grant(const Kvc__Grant *g, size_t *refs, char *why, size_t why_len) {
        if (g->session_id == 0)
                return BAD("grant for session id 0");
        return check_layer_blocks(g->layers, g->n_layers, refs, "grant", why, why_len);
}

static int v_grant(const Kvc__Envelope *env, char *why, size_t why_len) {
        size_t refs = 0;
        return check_grant(env->grant, &refs, why, why_len);
}

static int v_step_batch(const Kvc__Envelope *env, char *why, size_t why_len) {
        const Kvc__StepBatch *m = env->step_batch;
        if (m->n_steps == 0 || m->n_steps > WIRE_MAX_STEPS)
                return BAD("%zu steps in a batch (allowed 1..%u)", m->n_steps, WIRE_MAX_STEPS);
        for (size_t i = 0; i < m->n_steps; i++) {
                const Kvc__Step *s = m->steps[i];
                int r;
                if (s->session_id == 0)
                        return BAD("step %zu: session id 0", i);
                if (s->phase != KVC__PHASE__PHASE_DECODE && s->phase != KVC__PHASE__PHASE_PREFILL)
                        return BAD("step %zu: phase %d unknown", i, (int)s->phase);
                if (s->n_layer_tokens == 0)
                        return BAD("step %zu: no layer lengths", i);
                if ((r = check_layer_tokens(s->n_layer_tokens, s->layer_tokens, why, why_len)) < 0)
                        return r;
                if ((r = check_unit(s->entropy, "entropy", why, why_len)) < 0 ||
                    (r = check_unit(s->top1_prob, "top1_prob", why, why_len)) < 0)
                        return r;
                if (!(s->margin >= 0.0f) || isinf(s->margin))
                        return BAD("step %zu: margin %g is not a finite number >= 0", i, (double)s->margin);
                if (s->n_topk_logprobs > WIRE_MAX_TOPK)
                        return BAD("step %zu: %zu top-k entries (max %u)", i, s->n_topk_logprobs,
                                   WIRE_MAX_TOPK);
                for (size_t k = 0; k < s->n_topk_logprobs; k++) {
                        float lp = s->topk_logprobs[k];
                        if (!(lp <= 0.0f) || isinf(lp))
                                return BAD("step %zu: top-k log-probability %g invalid", i, (double)lp);
                        if (k > 0 && lp > s->topk_logprobs[k - 1])
                                return BAD("step %zu: top-k log-probabilities not descending", i);
                }
        }
        return 0;
}

static int v_plan_batch(const Kvc__Envelope *env, char *why, size_t why_len) {
        const Kvc__PlanBatch *m = env->plan_batch;
        size_t refs = 0;
        int r;
        if (m->n_plans > WIRE_MAX_STEPS || m->n_grants > WIRE_MAX_STEPS || m->n_errors > WIRE_MAX_STEPS)
                return BAD("plan batch too long");
        for (size_t i = 0; i < m->n_plans; i++) {
                const Kvc__Plan *p = m->plans[i];
                if (p->session_id == 0 || p->plan_id == 0)
                        return BAD("plan %zu: zero id", i);
                if (p->n_layers > WIRE_MAX_LAYERS) /* an empty plan ends a demotion's links */
                        return BAD("plan %zu: %zu layers", i, p->n_layers);
                if (p->n_moves > WIRE_MAX_MOVES)
                        return BAD("plan %zu: %zu block moves", i, p->n_moves);
                for (size_t k = 0; k < p->n_moves; k++) {
                        const Kvc__BlockMove *mv = p->moves[k];
                        if (mv->layer >= WIRE_MAX_LAYERS || mv->index >= WIRE_MAX_TOKENS || mv->from % 64 ||
                            mv->to % 64 || mv->from == mv->to || mv->tier > WIRE_MAX_TIERS)
                                return BAD("plan %zu: block move %zu invalid", i, k);
                }
                for (size_t l = 0; l < p->n_layers; l++) {
                        const Kvc__LayerPlan *lp = p->layers[l];
                        if (lp->layer >= WIRE_MAX_LAYERS || lp->base_tokens > WIRE_MAX_TOKENS ||
                            lp->keep_count > lp->base_tokens || lp->q8_tokens > WIRE_MAX_TOKENS ||
                            lp->summary_slot > lp->base_tokens || lp->shared_tokens > lp->keep_count ||
                            lp->shared_tokens % 16 ||
                            (lp->shared_tokens && (lp->q8_tokens || lp->summary_slot || lp->n_tier_tokens)) ||
                            lp->n_tier_tokens > WIRE_MAX_TIERS)
                                return BAD("plan %zu: layer entry %zu out of range", i, l);
                        uint64_t low = 0;
                        for (size_t k = 0; k < lp->n_tier_tokens; k++)
                                low += lp->tier_tokens[k];
                        if (low > WIRE_MAX_TOKENS)
                                return BAD("plan %zu: layer entry %zu has %llu tokens in its tiers", i, l,
                                           (unsigned long long)low);
                }
        }
        for (size_t i = 0; i < m->n_grants; i++)
                if ((r = check_grant(m->grants[i], &refs, why, why_len)) < 0)
                        return r;
        if (m->n_shared > WIRE_MAX_STEPS)
                return BAD("plan batch too long");
        for (size_t i = 0; i < m->n_shared; i++)
                if (m->shared[i]->session_id == 0 || m->shared[i]->shared_tokens % 16 ||
                    m->shared[i]->shared_tokens > WIRE_MAX_TOKENS)
                        return BAD("shared prefix entry %zu invalid", i);
        for (size_t i = 0; i < m->n_errors; i++)
                if ((r = check_error(m->errors[i], why, why_len)) < 0)
                        return r;
        return 0;
}

static int v_plan_applied(const Kvc__Envelope *env, char *why, size_t why_len) {
        const Kvc__PlanApplied *m = env->plan_applied;
        size_t refs = 0;
        int r;
        if (m->session_id == 0 || m->plan_id == 0)
                return BAD("plan applied: zero id");
        if (m->status < 0 || m->status > WIRE_MAX_ERRNO)
                return BAD("plan applied: status %d out of range", m->status);
        if ((r = check_layer_tokens(m->n_layer_tokens, m->layer_tokens, why, why_len)) < 0)
                return r;
        if (m->n_layer_q8_tokens && m->n_layer_q8_tokens != m->n_layer_tokens)
                return BAD("plan applied: %zu INT8 counts for %zu layers", m->n_layer_q8_tokens,
                           m->n_layer_tokens);
        for (size_t i = 0; i < m->n_layer_q8_tokens; i++)
                if (m->layer_q8_tokens[i] > m->layer_tokens[i])
                        return BAD("plan applied: layer %zu has more INT8 tokens than tokens", i);
        size_t per = m->n_layer_tokens ? m->n_layer_tier_tokens / m->n_layer_tokens : 0;
        if (m->n_layer_tier_tokens && (per * m->n_layer_tokens != m->n_layer_tier_tokens || per > WIRE_MAX_TIERS))
                return BAD("plan applied: %zu tier counts for %zu layers", m->n_layer_tier_tokens,
                           m->n_layer_tokens);
        for (size_t i = 0; i < m->n_layer_tokens && per; i++) {
                uint64_t low = 0;
                for (size_t k = 0; k < per; k++)
                        low += m->layer_tier_tokens[i * per + k];
                if (low > m->layer_tokens[i])
                        return BAD("plan applied: layer %zu has more tokens in its tiers than tokens", i);
        }
        return check_layer_blocks(m->released, m->n_released, &refs, "release", why, why_len);
}

static int v_session_id(uint64_t id, char *why, size_t why_len) {
        return id == 0 ? BAD("session id 0") : 0;
}

static int v_close_session(const Kvc__Envelope *env, char *why, size_t why_len) {
        return v_session_id(env->close_session->session_id, why, why_len);
}

static int v_session_closed(const Kvc__Envelope *env, char *why, size_t why_len) {
        return v_session_id(env->session_closed->session_id, why, why_len);
}

static int v_error(const Kvc__Envelope *env, char *why, size_t why_len) {
        return check_error(env->error, why, why_len);
}

static int v_empty(const Kvc__Envelope *env, char *why, size_t why_len) {
        (void)env;
        (void)why;
        (void)why_len;
        return 0;
}

static int v_status(const Kvc__Envelope *env, char *why, size_t why_len) {
        const Kvc__Status *m = env->status;
        int r = check_text(m->version, WIRE_MAX_NAME, "version", why, why_len);
        if (r == 0)
                r = check_text(m->backend, WIRE_MAX_NAME, "backend", why, why_len);
        for (size_t i = 0; r == 0 && i < m->n_tenants; i++)
                r = check_text(m->tenants[i]->name, WIRE_MAX_NAME, "tenant", why, why_len);
        for (size_t i = 0; r == 0 && i < m->n_tier_bytes; i++)
                r = check_text(m->tier_bytes[i]->tier, WIRE_MAX_NAME, "tier", why, why_len);
        return r;
}

static int v_session_list(const Kvc__Envelope *env, char *why, size_t why_len) {
        const Kvc__SessionList *m = env->session_list;
        for (size_t i = 0; i < m->n_sessions; i++) {
                const Kvc__SessionInfo *s = m->sessions[i];
                int r;
                if ((r = check_text(s->tenant, WIRE_MAX_NAME, "tenant", why, why_len)) < 0 ||
                    (r = check_text(s->policy, WIRE_MAX_NAME, "policy", why, why_len)) < 0)
                        return r;
                for (size_t k = 0; k < s->n_tier_bytes; k++)
                        if ((r = check_text(s->tier_bytes[k]->tier, WIRE_MAX_NAME, "tier", why, why_len)) < 0)
                                return r;
        }
        return 0;
}

static int v_evict(const Kvc__Envelope *env, char *why, size_t why_len) {
        return v_session_id(env->evict->session_id, why, why_len);
}

/* Reports and metrics are multi-line text for humans and scrapers, bounded by the frame. */
static int v_text_reply(const Kvc__Envelope *env, char *why, size_t why_len) {
        (void)env, (void)why, (void)why_len;
        return 0;
}

static int v_budget_set(const Kvc__Envelope *env, char *why, size_t why_len) {
        const Kvc__BudgetSet *m = env->budget_set;
        if (!m->set_capacity && !m->set_quota && !m->set_session && !m->set_binding)
                return BAD("budget set changes nothing");
        if (m->set_session && m->session_id == 0)
                return BAD("budget set: session id 0");
        if (m->set_session && !m->set_min && !m->set_max && !m->set_priority)
                return BAD("budget set: a session change names none of min, max, priority");
        if (m->set_min && m->set_max && m->session_max_bytes && m->session_min_bytes > m->session_max_bytes)
                return BAD("budget set: session min above max");
        if (m->set_binding && (!m->tenant || !*m->tenant))
                return BAD("budget set: a binding needs a tenant");
        if (m->set_binding && (m->tenant_uid < -1 || m->tenant_uid >= UINT32_MAX || m->tenant_gid < -1 ||
                               m->tenant_gid >= UINT32_MAX))
                return BAD("budget set: uid or gid out of range");
        return check_name(m->tenant, WIRE_MAX_NAME, 1, "tenant", why, why_len);
}

static int v_budgets(const Kvc__Envelope *env, char *why, size_t why_len) {
        const Kvc__Budgets *m = env->budgets;
        for (size_t i = 0; i < m->n_tenants; i++) {
                int r = check_text(m->tenants[i]->name, WIRE_MAX_NAME, "tenant", why, why_len);
                if (r < 0)
                        return r;
        }
        return 0;
}

/* A client's account of one layer (Resume, HandoffImported): lengths within range, blocks counted
 * into *refs. */
static int check_resume_layer(const Kvc__ResumeLayer *L, size_t l, size_t *refs, const char *what, char *why,
                              size_t why_len) {
        uint64_t low = L->n_q8;
        for (size_t k = 0; k < L->n_tier_tokens && k < WIRE_MAX_TIERS; k++)
                low += L->tier_tokens[k];
        if (L->n_tokens > WIRE_MAX_TOKENS || low > L->n_tokens || L->n_tier_tokens > WIRE_MAX_TIERS ||
            L->n_tier_blocks > WIRE_MAX_TIERS)
                return BAD("%s: layer %zu lengths out of range", what, l);
        *refs += L->n_fp_blocks + L->n_q8_blocks;
        for (size_t k = 0; k < L->n_tier_blocks; k++) {
                if (L->tier_blocks[k]->tier == 0 || L->tier_blocks[k]->tier > WIRE_MAX_TIERS)
                        return BAD("%s: layer %zu names tier %u", what, l, L->tier_blocks[k]->tier);
                *refs += L->tier_blocks[k]->n_blocks;
        }
        if (*refs > WIRE_MAX_BLOCK_REFS)
                return BAD("%s: more than %u blocks", what, WIRE_MAX_BLOCK_REFS);
        return 0;
}

static int v_resume(const Kvc__Envelope *env, char *why, size_t why_len) {
        const Kvc__Resume *m = env->resume;
        size_t refs = 0;
        if (m->session_id == 0 || m->token.len != WIRE_TOKEN_BYTES)
                return BAD("resume: session id 0 or a token of %zu bytes", m->token.len);
        if (m->n_layers == 0 || m->n_layers > WIRE_MAX_LAYERS)
                return BAD("resume: %zu layers", m->n_layers);
        for (size_t l = 0; l < m->n_layers; l++) {
                int r = check_resume_layer(m->layers[l], l, &refs, "resume", why, why_len);
                if (r < 0)
                        return r;
        }
        return 0;
}

static int v_resumed(const Kvc__Envelope *env, char *why, size_t why_len) {
        return v_session_id(env->resumed->session_id, why, why_len);
}

static int v_handoff_export(const Kvc__Envelope *env, char *why, size_t why_len) {
        const Kvc__HandoffExport *m = env->handoff_export;
        if (m->n_layer_tokens == 0 || m->n_layer_tokens > WIRE_MAX_LAYERS)
                return BAD("hand-off: %zu layer lengths", m->n_layer_tokens);
        return v_session_id(m->session_id, why, why_len);
}

static int v_ticket(uint64_t session_id, ProtobufCBinaryData ticket, char *why, size_t why_len) {
        if (ticket.len != WIRE_TOKEN_BYTES)
                return BAD("hand-off ticket of %zu bytes", ticket.len);
        return v_session_id(session_id, why, why_len);
}

static int v_handoff_ticket(const Kvc__Envelope *env, char *why, size_t why_len) {
        return v_ticket(env->handoff_ticket->session_id, env->handoff_ticket->ticket, why, why_len);
}

static int v_handoff_import(const Kvc__Envelope *env, char *why, size_t why_len) {
        return v_ticket(env->handoff_import->session_id, env->handoff_import->ticket, why, why_len);
}

static int v_handoff_imported(const Kvc__Envelope *env, char *why, size_t why_len) {
        const Kvc__HandoffImported *m = env->handoff_imported;
        if (!m->opened)
                return BAD("hand-off: no session");
        Kvc__Envelope inner = { .session_opened = m->opened };
        int r = v_session_opened(&inner, why, why_len);
        if (r == 0)
                r = v_geometry(m->geometry, why, why_len);
        if (r < 0)
                return r;
        if (m->n_layers != m->geometry->n_layers)
                return BAD("hand-off: %zu layer tables for %u layers", m->n_layers, m->geometry->n_layers);
        size_t refs = 0;
        for (size_t l = 0; l < m->n_layers && r == 0; l++)
                r = check_resume_layer(m->layers[l], l, &refs, "hand-off", why, why_len);
        return r;
}

/* The client's account of tier t >= 1 of a layer: its tokens and blocks (the tier fields, or the
 * INT8 ones of a client before the ladder). */
void wire_resume_tier(const Kvc__ResumeLayer *L, uint32_t t, uint32_t *ret_tokens, const uint64_t **ret_blocks,
                        size_t *ret_n) {
        *ret_tokens = 0;
        *ret_blocks = NULL;
        *ret_n = 0;
        if (!L->n_tier_tokens && !L->n_tier_blocks) {
                if (t == 1) {
                        *ret_tokens = L->n_q8;
                        *ret_blocks = L->q8_blocks;
                        *ret_n = L->n_q8_blocks;
                }
                return;
        }
        if (t - 1 < L->n_tier_tokens)
                *ret_tokens = L->tier_tokens[t - 1];
        for (size_t i = 0; i < L->n_tier_blocks; i++)
                if (L->tier_blocks[i]->tier == t) {
                        *ret_blocks = L->tier_blocks[i]->blocks;
                        *ret_n = L->tier_blocks[i]->n_blocks;
                }
}

/* The OpenSession kvcd keeps in its restart record. */
int wire_open_session_pack(const Kvc__OpenSession *m, uint8_t *out, size_t cap, size_t *ret_len) {
        size_t n = kvc__open_session__get_packed_size(m);
        if (n > cap)
                return -EMSGSIZE;
        *ret_len = kvc__open_session__pack(m, out);
        return 0;
}

int wire_open_session_decode(struct wire_arena *a, const void *data, size_t len, Kvc__OpenSession **ret,
                             char *why, size_t why_len) {
        Kvc__Envelope env = KVC__ENVELOPE__INIT;
        wire_arena_reset(a);
        Kvc__OpenSession *m = kvc__open_session__unpack(&a->allocator, len, data);
        if (!m)
                return fail(-EPROTO, why, why_len, "not an OpenSession");
        env.version = WIRE_VERSION;
        env.body_case = KVC__ENVELOPE__BODY_OPEN_SESSION;
        env.open_session = m;
        int r = wire_validate(&env, why, why_len);
        if (r == 0)
                *ret = m;
        return r;
}

/* One row per message kind: its name for logs, its validator, and whether kvcd takes it as a
 * request (the rest are its replies and plans: wire_decode_request refuses them before their
 * fields are looked at). */
#define REQ true
static const struct {
        Kvc__Envelope__BodyCase body;
        const char *name;
        int (*validate)(const Kvc__Envelope *env, char *why, size_t why_len);
        bool request;
} kinds[] = {
        { KVC__ENVELOPE__BODY_HELLO, "hello", v_hello, REQ },
        { KVC__ENVELOPE__BODY_WELCOME, "welcome", v_welcome },
        { KVC__ENVELOPE__BODY_OPEN_SESSION, "open_session", v_open_session, REQ },
        { KVC__ENVELOPE__BODY_SESSION_OPENED, "session_opened", v_session_opened },
        { KVC__ENVELOPE__BODY_RESERVE, "reserve", v_reserve, REQ },
        { KVC__ENVELOPE__BODY_GRANT, "grant", v_grant },
        { KVC__ENVELOPE__BODY_STEP_BATCH, "step_batch", v_step_batch, REQ },
        { KVC__ENVELOPE__BODY_PLAN_BATCH, "plan_batch", v_plan_batch },
        { KVC__ENVELOPE__BODY_PLAN_APPLIED, "plan_applied", v_plan_applied, REQ },
        { KVC__ENVELOPE__BODY_CLOSE_SESSION, "close_session", v_close_session, REQ },
        { KVC__ENVELOPE__BODY_SESSION_CLOSED, "session_closed", v_session_closed },
        { KVC__ENVELOPE__BODY_ERROR, "error", v_error },
        { KVC__ENVELOPE__BODY_STATUS_REQUEST, "status_request", v_empty, REQ },
        { KVC__ENVELOPE__BODY_STATUS, "status", v_status },
        { KVC__ENVELOPE__BODY_LIST_SESSIONS, "list_sessions", v_empty, REQ },
        { KVC__ENVELOPE__BODY_SESSION_LIST, "session_list", v_session_list },
        { KVC__ENVELOPE__BODY_EVICT, "evict", v_evict, REQ },
        { KVC__ENVELOPE__BODY_DRAIN, "drain", v_empty, REQ },
        { KVC__ENVELOPE__BODY_DRAINED, "drained", v_empty },
        { KVC__ENVELOPE__BODY_AUDIT_REQUEST, "audit_request", v_empty, REQ },
        { KVC__ENVELOPE__BODY_AUDIT, "audit", v_text_reply },
        { KVC__ENVELOPE__BODY_METRICS_REQUEST, "metrics_request", v_empty, REQ },
        { KVC__ENVELOPE__BODY_METRICS, "metrics", v_text_reply },
        { KVC__ENVELOPE__BODY_BUDGET_REQUEST, "budget_request", v_empty, REQ },
        { KVC__ENVELOPE__BODY_BUDGET_SET, "budget_set", v_budget_set, REQ },
        { KVC__ENVELOPE__BODY_BUDGETS, "budgets", v_budgets },
        { KVC__ENVELOPE__BODY_RESUME, "resume", v_resume, REQ },
        { KVC__ENVELOPE__BODY_RESUMED, "resumed", v_resumed },
        { KVC__ENVELOPE__BODY_HANDOFF_EXPORT, "handoff_export", v_handoff_export, REQ },
        { KVC__ENVELOPE__BODY_HANDOFF_TICKET, "handoff_ticket", v_handoff_ticket },
        { KVC__ENVELOPE__BODY_HANDOFF_IMPORT, "handoff_import", v_handoff_import, REQ },
        { KVC__ENVELOPE__BODY_HANDOFF_IMPORTED, "handoff_imported", v_handoff_imported },
};

const char *wire_body_name(Kvc__Envelope__BodyCase c) {
        for (size_t i = 0; i < sizeof(kinds) / sizeof(kinds[0]); i++)
                if (kinds[i].body == c)
                        return kinds[i].name;
        return "unknown";
}

int wire_validate(const Kvc__Envelope *env, char *why, size_t why_len) {
        if (env->version != WIRE_VERSION)
                return fail(-EPROTO, why, why_len, "protocol version %u, this side speaks %u", env->version,
                            WIRE_VERSION);
        for (size_t i = 0; i < sizeof(kinds) / sizeof(kinds[0]); i++) {
                if (kinds[i].body != env->body_case)
                        continue;
                /* protobuf-c leaves the member NULL only if the body is unset, but a message
                 * sub-field of an oneof is always allocated when present: check anyway. */
                if (!env->hello) /* any member of the union: they share storage */
                        return fail(-EPROTO, why, why_len, "empty %s", kinds[i].name);
                return kinds[i].validate(env, why, why_len);
        }
        return fail(-EPROTO, why, why_len, "unknown message kind %d", (int)env->body_case);
}

static int decode(struct wire_arena *a, const void *data, size_t len, size_t max_bytes, bool request,
                  Kvc__Envelope **ret, uint64_t *ret_request_id, char *why, size_t why_len) {
        if (len > max_bytes)
                return fail(-EMSGSIZE, why, why_len, "frame of %zu bytes exceeds %zu", len, max_bytes);
        wire_arena_reset(a);
        Kvc__Envelope *env = kvc__envelope__unpack(&a->allocator, len, data);
        if (!env) {
                if (a->exhausted)
                        return fail(-EMSGSIZE, why, why_len, "message needs more than %zu bytes to unpack",
                                    a->cap);
                return fail(-EPROTO, why, why_len, "not a kvc envelope (%zu bytes)", len);
        }
        int r = 0;
        if (request) /* a reply sent back at kvcd: refused as one, whatever its fields say */
                for (size_t i = 0; i < sizeof(kinds) / sizeof(kinds[0]) && r == 0; i++)
                        if (kinds[i].body == env->body_case && !kinds[i].request)
                                r = fail(-EPROTO, why, why_len, "%s is a reply, not a request", kinds[i].name);
        if (r == 0)
                r = wire_validate(env, why, why_len);
        if (r < 0) {
                *ret_request_id = env->request_id;
                return r;
        }
        *ret = env;
        return 0;
}

int wire_decode_request(struct wire_arena *a, const void *data, size_t len, size_t max_bytes,
                        Kvc__Envelope **ret, uint64_t *ret_request_id, char *why, size_t why_len) {
        return decode(a, data, len, max_bytes, true, ret, ret_request_id, why, why_len);
}

int wire_decode(struct wire_arena *a, const void *data, size_t len, size_t max_bytes, Kvc__Envelope **ret,
                char *why, size_t why_len) {
        uint64_t ignored;
        return decode(a, data, len, max_bytes, false, ret, &ignored, why, why_len);
}

size_t wire_event_packed_size(const Kvc__KvEventBatch *b) {
        return kvc__kv_event_batch__get_packed_size(b);
}

size_t wire_event_pack(const Kvc__KvEventBatch *b, uint8_t *out) {
        return kvc__kv_event_batch__pack(b, out);
}

int wire_event_decode(struct wire_arena *a, const void *data, size_t len, Kvc__KvEventBatch **ret) {
        if (len > WIRE_REPLY_MAX_BYTES)
                return -EMSGSIZE;
        wire_arena_reset(a);
        Kvc__KvEventBatch *b = kvc__kv_event_batch__unpack(&a->allocator, len, data);
        if (!b)
                return a->exhausted ? -EMSGSIZE : -EPROTO;
        for (size_t i = 0; i < b->n_events; i++) {
                const Kvc__KvEvent *e = b->events[i];
                if (e->event_case == KVC__KV_EVENT__EVENT__NOT_SET || !e->stored)
                        return -EPROTO;
        }
        *ret = b;
        return 0;
}

size_t wire_packed_size(const Kvc__Envelope *env) {
        return kvc__envelope__get_packed_size(env);
}

size_t wire_pack(const Kvc__Envelope *env, uint8_t *out) {
        return kvc__envelope__pack(env, out);
}

const char *wire_errno_name(int code) {
        static const struct {
                int code;
                const char *name;
        } names[] = {
                { EPERM, "EPERM" },         { ENOENT, "ENOENT" },       { EIO, "EIO" },
                { ENOMEM, "ENOMEM" },       { EBUSY, "EBUSY" },         { EEXIST, "EEXIST" },
                { EINVAL, "EINVAL" },       { ENOSPC, "ENOSPC" },       { EPROTO, "EPROTO" },
                { EMSGSIZE, "EMSGSIZE" },   { ESTALE, "ESTALE" },       { EALREADY, "EALREADY" },
                { ETIMEDOUT, "ETIMEDOUT" }, { ENOTCONN, "ENOTCONN" },   { ECONNREFUSED, "ECONNREFUSED" },
                { EAGAIN, "EAGAIN" },       { ENOTSUP, "ENOTSUP" },     { EMFILE, "EMFILE" },
                { ESHUTDOWN, "ESHUTDOWN" }, { EOVERFLOW, "EOVERFLOW" }, { ERANGE, "ERANGE" },
        };
        for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++)
                if (names[i].code == code)
                        return names[i].name;
        return "E?";
}

int wire_parse_bytes(const char *s, uint64_t *ret) {
        char *end;
        errno = 0;
        unsigned long long v = strtoull(s, &end, 10);
        if (errno || end == s || s[0] == '-')
                return -EINVAL;
        uint64_t mul = 1;
        switch (*end) {
        case 'K':
        case 'k': mul = 1ull << 10; break;
        case 'M':
        case 'm': mul = 1ull << 20; break;
        case 'G':
        case 'g': mul = 1ull << 30; break;
        case 'T':
        case 't': mul = 1ull << 40; break;
        }
        if (mul > 1)
                end++;
        if (*end == 'i')
                end++;
        if (*end == 'B')
                end++;
        if (*end || v > UINT64_MAX / mul)
                return -EINVAL;
        *ret = v * mul;
        return 0;
}
