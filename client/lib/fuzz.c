/* fuzz.c: the entry points of kvc_fuzz.h. libkvc without a daemon: a client with a private,
 * fully mapped pool and one session, fed raw frames as if kvcd sent them, so a fuzzer (and
 * tests/unit/test_moves.c) can drive grants, plans and moves through the real checks.
 */
#define _GNU_SOURCE
#include "internal.h"
#include "lloyd.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "attention.h"
#include "compact.h"
#include "kvc_fuzz.h"

#define FUZZ_CHUNK_BYTES (64u * 1024u)
#define FUZZ_CHUNKS      8u

int kvc_fuzz_client_new(const struct kvc_geometry *g, uint32_t max_layer_tokens, uint64_t plan_bytes,
                        struct kvc_client **ret_c, struct kvc_session **ret_s) {
        struct kvc_client *c = calloc(1, sizeof(*c));
        struct kvc_session *s = calloc(1, sizeof(*s));
        int r = -ENOMEM;
        if (!c || !s)
                goto fail;
        c->fd = -1;
        c->base = MAP_FAILED;
        c->timeout_ms = 1;
        c->chunk_bytes = FUZZ_CHUNK_BYTES;
        c->pool_bytes = (uint64_t)FUZZ_CHUNKS * FUZZ_CHUNK_BYTES;
        c->n_chunks = FUZZ_CHUNKS;
        c->block_tokens = 16;
        c->mapped = malloc(FUZZ_CHUNKS);
        c->mapped_gen = calloc(FUZZ_CHUNKS, sizeof(*c->mapped_gen));
        c->base = mmap(NULL, c->pool_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (!c->mapped || !c->mapped_gen || c->base == MAP_FAILED ||
            wire_arena_new(WIRE_REPLY_MAX_BYTES * 2, &c->arena) < 0)
                goto fail;
        memset(c->mapped, 1, FUZZ_CHUNKS); /* every chunk "arrived" */

        r = -EINVAL;
        s->c = c;
        s->id = 1;
        s->g = *g;
        /* tiers {dtype, q8}, and q4 below them where the head allows (a power of 2 >= 8): the plans
         * the fuzzer makes up may name both */
        if (block_layout_init(&s->layout, 16, g->n_kv_heads, g->head_dim, (enum block_dtype)g->dtype) < 0 ||
            block_layout_init(&s->tiers[1], 16, g->n_kv_heads, g->head_dim, BLOCK_DTYPE_Q8) < 0 ||
            plan_bytes > FUZZ_CHUNK_BYTES || s->layout.block_bytes > FUZZ_CHUNK_BYTES)
                goto fail;
        s->tiers[0] = s->layout;
        s->n_tiers = block_layout_init(&s->tiers[2], 16, g->n_kv_heads, g->head_dim, BLOCK_DTYPE_Q4) == 0 ? 3 : 2;
        s->max_layer_tokens = max_layer_tokens;
        s->max_layer_blocks = (max_layer_tokens + 15) / 16;
        s->ema_gamma = 0.9f;
        s->plan_offset = 0; /* chunk 0 is the plan buffer; blocks come in the others */
        s->plan_bytes = plan_bytes;
        s->layers = calloc(g->n_layers, sizeof(*s->layers));
        s->plan_copy = malloc(plan_bytes ? plan_bytes : 4);
        size_t identity_slots = ((size_t)s->max_layer_blocks * 16 + 1) * g->n_kv_heads;
        if (identity_slots < plan_bytes / 4)
                identity_slots = plan_bytes / 4;
        s->plan_tier = malloc(identity_slots);
        s->identity = malloc(identity_slots * sizeof(uint32_t));
        s->signs = malloc((size_t)g->n_layers * g->n_kv_heads * g->head_dim * sizeof(float));
        for (uint32_t l = 0; s->signs && l < g->n_layers; l++)
                for (uint32_t h = 0; h < g->n_kv_heads; h++)
                        lloyd_signs(0, l, h, g->head_dim, s->signs + ((size_t)l * g->n_kv_heads + h) * g->head_dim);
        size_t slots = (size_t)s->max_layer_blocks * 16 + 1;
        struct ladder_layer probe = { .n_tiers = s->n_tiers };
        for (uint32_t t = 0; t < s->n_tiers; t++)
                probe.layout[t] = &s->tiers[t];
        probe.n[0] = (uint32_t)slots;
        size_t attn = ladder_attn_scratch_floats(&probe, g->n_heads),
               cs = ladder_compact_scratch_floats(&probe),
               fast = attn_fast_scratch_floats((uint32_t)slots, g->n_heads, g->n_kv_heads, g->head_dim, 16);
        attn = fast > attn ? fast : attn;
        s->attn_scratch = malloc((attn > 2 * slots ? attn : 2 * slots) * sizeof(float));
        s->compact_scratch =
                malloc((cs > 2 * (size_t)g->head_dim ? cs : 2 * (size_t)g->head_dim) * sizeof(float));
        r = -ENOMEM;
        if (!s->layers || !s->plan_copy || !s->plan_tier || !s->identity || !s->signs || !s->attn_scratch || !s->compact_scratch)
                goto fail;
        for (uint32_t l = 0; l < g->n_layers; l++) {
                struct layer *L = &s->layers[l];
                for (uint32_t t = 0; t < s->n_tiers; t++) {
                        L->t[t].offs = calloc(s->max_layer_blocks + 1, sizeof(uint64_t));
                        L->t[t].ptrs = calloc(s->max_layer_blocks + 1, sizeof(uint8_t *));
                        if (!L->t[t].offs || !L->t[t].ptrs)
                                goto fail;
                }
        }
        c->sessions = s;
        *ret_c = c;
        *ret_s = s;
        return 0;
fail:
        if (s && s->layers)
                for (uint32_t l = 0; l < g->n_layers; l++)
                        for (uint32_t t = 0; t < LADDER_TIERS; t++) {
                                free(s->layers[l].t[t].offs);
                                free(s->layers[l].t[t].ptrs);
                        }
        if (s) {
                free(s->layers);
                free(s->plan_copy);
                free(s->plan_tier);
                free(s->identity);
                free(s->signs);
                free(s->attn_scratch);
                free(s->rows_scratch);
                free(s->compact_scratch);
        }
        free(s);
        if (c) {
                c->sessions = NULL;
                kvc_disconnect(c);
        }
        return r;
}

uint8_t *kvc_fuzz_pool(struct kvc_client *c, uint64_t *ret_bytes) {
        *ret_bytes = c->pool_bytes;
        return c->base;
}

int kvc_fuzz_feed(struct kvc_client *c, const void *data, size_t len) {
        Kvc__Envelope *env;
        char why[WIRE_MAX_MESSAGE];
        int r = wire_decode(c->arena, data, len, WIRE_REPLY_MAX_BYTES, &env, why, sizeof(why));
        return r < 0 ? r : step_dispatch(c, env);
}

int kvc_fuzz_step(struct kvc_session *s, uint64_t step, const float *kv, const float *q, float *out) {
        for (uint32_t l = 0; l < s->g.n_layers; l++) {
                int r = kvc_append(s, l, (int32_t)step, kv, kv);
                if (r < 0)
                        return r;
                if ((r = kvc_attend(s, l, q, out)) < 0)
                        return r;
        }
        s->last_step = step;
        s->stepped = true;
        return 0;
}

int kvc_fuzz_tier(const struct kvc_session *s, uint32_t layer, uint32_t tier, struct kvc_fuzz_tier *ret) {
        if (layer >= s->g.n_layers || tier >= s->n_tiers)
                return -EINVAL;
        const struct layer *L = &s->layers[layer];
        *ret = (struct kvc_fuzz_tier){ .n_tokens = kvc_layer_tier_tokens(s, layer, tier),
                                       .n_blocks = L->t[tier].n,
                                       .block_tokens = s->tiers[tier].block_tokens,
                                       .block_bytes = s->tiers[tier].block_bytes,
                                       .blocks = L->t[tier].ptrs };
        return 0;
}
