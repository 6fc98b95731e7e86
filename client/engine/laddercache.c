/* laddercache.c - the in-process ladder cache (laddercache.h): per layer a struct ladder_layer
 * (kernels/ladder.h) of two tiers over blocks allocated as the layer grows, demoted with
 * ladder_compact and attended with the fast kernel. */
#include "laddercache.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "attention.h"
#include "ladder.h"
#include "lloyd.h"
#include "tier.h"

#define LC_BLOCK_TOKENS 16u

struct lc_layer {
        struct ladder_layer L;
        uint8_t **blocks[2]; /* allocated as needed, never more than max_blocks each */
        uint32_t allocated[2];
        float *signs; /* [n_kv_heads][head_dim] */
};

struct ladder_cache {
        struct block_layout lay[2];
        uint32_t n_tiers, window, n_layers, n_heads, H, D, max_tokens, max_blocks;
        struct lc_layer *layers;
        uint32_t *keep; /* [max_tokens]: the identity, for demotions */
        uint8_t *tier;  /* [max_tokens] */
        float *scratch; /* attention's and compaction's */
        uint64_t bytes, peak;
};

static uint64_t layer_bytes(const struct ladder_cache *c, const struct lc_layer *y) {
        uint64_t b = 0;
        for (uint32_t t = 0; t < c->n_tiers; t++)
                b += (uint64_t)((y->L.n[t] + LC_BLOCK_TOKENS - 1) / LC_BLOCK_TOKENS) * c->lay[t].block_bytes;
        return b;
}

uint64_t ladder_cache_bytes(const struct ladder_cache *c) {
        return c ? c->bytes : 0;
}

uint64_t ladder_cache_peak_bytes(const struct ladder_cache *c) {
        return c ? c->peak : 0;
}

uint64_t ladder_cache_full_bytes(const struct ladder_cache *c) {
        uint64_t b = 0;
        for (uint32_t l = 0; c && l < c->n_layers; l++)
                b += (uint64_t)((ladder_tokens(&c->layers[l].L) + LC_BLOCK_TOKENS - 1) / LC_BLOCK_TOKENS) *
                     c->lay[0].block_bytes;
        return b;
}

struct ladder_cache *ladder_cache_free(struct ladder_cache *c) {
        if (!c)
                return NULL;
        for (uint32_t l = 0; c->layers && l < c->n_layers; l++) {
                struct lc_layer *y = &c->layers[l];
                for (uint32_t t = 0; t < 2; t++) {
                        for (uint32_t b = 0; b < y->allocated[t]; b++)
                                free(y->blocks[t][b]);
                        free(y->blocks[t]);
                }
                free(y->signs);
        }
        free(c->layers);
        free(c->keep);
        free(c->tier);
        free(c->scratch);
        free(c);
        return NULL;
}

int ladder_cache_new(const struct model_config *cfg, int max_tokens, const struct ladder_cache_config *lc,
                     struct ladder_cache **ret) {
        if (!cfg || !lc || !ret || cfg->n_layers <= 0 || cfg->n_heads <= 0 || cfg->n_kv_heads <= 0 ||
            cfg->dim <= 0 || cfg->dim % cfg->n_heads || cfg->n_heads % cfg->n_kv_heads || max_tokens <= 0 ||
            max_tokens > (1 << 24) || lc->window == 0 || block_dtype_quantized(lc->dtype))
                return -EINVAL;
        const struct tier_row *low = lc->tier && *lc->tier ? tier_by_name(lc->tier) : NULL;
        if (lc->tier && *lc->tier && (!low || !low->quantized))
                return -EINVAL;
        struct ladder_cache *c = calloc(1, sizeof(*c));
        if (!c)
                return -ENOMEM;
        c->n_tiers = low ? 2 : 1;
        c->window = lc->window;
        c->n_layers = (uint32_t)cfg->n_layers;
        c->n_heads = (uint32_t)cfg->n_heads;
        c->H = (uint32_t)cfg->n_kv_heads;
        c->D = (uint32_t)(cfg->dim / cfg->n_heads);
        c->max_tokens = (uint32_t)max_tokens;
        c->max_blocks = (c->max_tokens + LC_BLOCK_TOKENS - 1) / LC_BLOCK_TOKENS + 1;
        int e = block_layout_init(&c->lay[0], LC_BLOCK_TOKENS, c->H, c->D, lc->dtype);
        if (e == 0 && low)
                e = block_layout_init(&c->lay[1], LC_BLOCK_TOKENS, c->H, c->D, low->dtype);
        if (e < 0) {
                free(c);
                return e;
        }
        c->layers = calloc(c->n_layers, sizeof(*c->layers));
        c->keep = malloc(c->max_tokens * sizeof(*c->keep));
        c->tier = malloc(c->max_tokens);
        if (!c->layers || !c->keep || !c->tier)
                return ladder_cache_free(c), -ENOMEM;
        for (uint32_t i = 0; i < c->max_tokens; i++)
                c->keep[i] = i;
        for (uint32_t l = 0; l < c->n_layers; l++) {
                struct lc_layer *y = &c->layers[l];
                y->signs = malloc((size_t)c->H * c->D * sizeof(float));
                for (uint32_t t = 0; t < c->n_tiers; t++)
                        y->blocks[t] = calloc(c->max_blocks, sizeof(uint8_t *));
                if (!y->signs || !y->blocks[0] || (c->n_tiers > 1 && !y->blocks[1]))
                        return ladder_cache_free(c), -ENOMEM;
                for (uint32_t h = 0; h < c->H; h++)
                        lloyd_signs(lc->seed, l, h, c->D, y->signs + (size_t)h * c->D);
                y->L = (struct ladder_layer){ .n_tiers = c->n_tiers, .signs = y->signs };
                for (uint32_t t = 0; t < c->n_tiers; t++) {
                        y->L.layout[t] = &c->lay[t];
                        y->L.blocks[t] = y->blocks[t];
                }
        }
        /* scratch for the longest layer: attention's (at most max_tokens) or a demotion's */
        struct ladder_layer probe = c->layers[0].L;
        probe.n[0] = c->max_tokens;
        size_t a = attn_fast_scratch_floats(c->max_tokens, c->n_heads, c->H, c->D, LC_BLOCK_TOKENS);
        size_t k = ladder_compact_scratch_floats(&probe);
        c->scratch = malloc((a > k ? a : k) * sizeof(float));
        if (!c->scratch || !a)
                return ladder_cache_free(c), -ENOMEM;
        *ret = c;
        return 0;
}

void ladder_cache_reset(struct ladder_cache *c) {
        for (uint32_t l = 0; c && l < c->n_layers; l++)
                memset(c->layers[l].L.n, 0, sizeof(c->layers[l].L.n));
        if (c)
                c->bytes = 0;
}

/* Tier t of layer y holds n tokens: blocks allocated (zeroed) as needed. */
static int lc_room(struct ladder_cache *c, struct lc_layer *y, uint32_t t, uint32_t n) {
        uint32_t need = (n + LC_BLOCK_TOKENS - 1) / LC_BLOCK_TOKENS;
        if (need > c->max_blocks)
                return -ERANGE;
        while (y->allocated[t] < need) {
                uint8_t *b = aligned_alloc(64, c->lay[t].block_bytes);
                if (!b)
                        return -ENOMEM;
                memset(b, 0, c->lay[t].block_bytes);
                y->blocks[t][y->allocated[t]++] = b;
        }
        y->L.n_blocks[t] = y->allocated[t];
        return 0;
}

/* The layer's oldest full-precision tokens beyond the window go to tier 1, a block's worth at a
 * time: every token kept (the identity keep-set), tiers given by slot. */
static int lc_demote(struct ladder_cache *c, struct lc_layer *y) {
        uint32_t n = ladder_tokens(&y->L), n_low = y->L.n[1], go = y->L.n[0] - c->window, got[LADDER_TIERS];
        int e = lc_room(c, y, 1, n_low + go);
        if (e < 0)
                return e;
        for (uint32_t i = 0; i < n; i++)
                c->tier[i] = i < n_low + go;
        if ((e = ladder_compact(&y->L, c->keep, c->tier, n, 0, n, c->scratch, got)) < 0)
                return e;
        y->L.n[0] = got[0];
        y->L.n[1] = got[1];
        return 0;
}

static int lc_store(void *ctx, int layer, int pos, const float *k, const float *v) {
        struct ladder_cache *c = ctx;
        if (!c || !k || !v || layer < 0 || (uint32_t)layer >= c->n_layers || pos < 0)
                return -EINVAL;
        if ((uint32_t)pos >= c->max_tokens)
                return -ERANGE;
        struct lc_layer *y = &c->layers[layer];
        uint32_t n = ladder_tokens(&y->L);
        if ((uint32_t)pos != n && pos != 0)
                return -EINVAL;
        uint64_t before = layer_bytes(c, y);
        if (pos == 0 && n)
                memset(y->L.n, 0, sizeof(y->L.n));
        int e = lc_room(c, y, 0, y->L.n[0] + 1);
        if (e < 0)
                return e;
        uint32_t s = y->L.n[0], T = LC_BLOCK_TOKENS;
        uint8_t *b = y->blocks[0][s / T];
        const struct block_layout *l = &c->lay[0];
        for (uint32_t h = 0; h < c->H; h++) {
                int32_t p = pos;
                float zero = 0.0f;
                block_store_row(l->dtype, k + (size_t)h * c->D, block_key(l, b, h, s % T), c->D);
                block_store_row(l->dtype, v + (size_t)h * c->D, block_value(l, b, h, s % T), c->D);
                memcpy(block_side(l, b, l->pos_offset, h, s % T), &p, 4);
                memcpy(block_side(l, b, l->sum_offset, h, s % T), &zero, 4);
                memcpy(block_side(l, b, l->ema_offset, h, s % T), &zero, 4);
                memcpy(block_side(l, b, l->last_offset, h, s % T), &zero, 4);
                memcpy(block_side(l, b, l->logw_offset, h, s % T), &zero, 4);
        }
        y->L.n[0]++;
        /* the layer's most: its full-precision blocks as they are now, beside its low blocks as
         * they are after a demotion (the new low blocks are written before the full-precision
         * ones are given back) */
        uint64_t fp_now = layer_bytes(c, y) -
                          (c->n_tiers > 1 ? (uint64_t)((y->L.n[1] + T - 1) / T) * c->lay[1].block_bytes : 0);
        if (c->n_tiers > 1 && y->L.n[0] >= c->window + T && (e = lc_demote(c, y)) < 0)
                return e;
        uint64_t end = layer_bytes(c, y);
        uint64_t low_end = c->n_tiers > 1 ? (uint64_t)((y->L.n[1] + T - 1) / T) * c->lay[1].block_bytes : 0;
        uint64_t most = fp_now + low_end > end ? fp_now + low_end : end;
        c->bytes = c->bytes - before + end;
        if (c->bytes - end + most > c->peak)
                c->peak = c->bytes - end + most;
        return 0;
}

static int lc_attend(void *ctx, int layer, int pos, const float *q, float *out) {
        struct ladder_cache *c = ctx;
        (void)pos;
        if (!c || !q || !out || layer < 0 || (uint32_t)layer >= c->n_layers)
                return -EINVAL;
        return attn_decode_fast_ladder(&c->layers[layer].L, q, out, c->n_heads, 0.0f, 0, c->scratch,
                                       ATTN_ISA_BEST);
}

const struct model_cache_ops ladder_cache_ops = { .store = lc_store, .attend = lc_attend };
