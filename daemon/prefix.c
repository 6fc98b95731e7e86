/* prefix.c: shared prompt prefixes: the index of published blocks and their references (see
 * prefix.h). */
#define _GNU_SOURCE
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>

#include "kvcd.h"
#include "log.h"
#include "pool.h"
#include "prefix.h"

/* SipHash-2-4 (Aumasson and Bernstein) of len bytes under the key k. */
#define ROTL(x, b) (uint64_t)(((x) << (b)) | ((x) >> (64 - (b))))
#define SIPROUND                                                                                             \
        do {                                                                                                 \
                v0 += v1, v1 = ROTL(v1, 13), v1 ^= v0, v0 = ROTL(v0, 32);                                    \
                v2 += v3, v3 = ROTL(v3, 16), v3 ^= v2;                                                       \
                v0 += v3, v3 = ROTL(v3, 21), v3 ^= v0;                                                       \
                v2 += v1, v1 = ROTL(v1, 17), v1 ^= v2, v2 = ROTL(v2, 32);                                    \
        } while (0)
static uint64_t siphash(const uint64_t k[2], const uint8_t *in, size_t len) {
        uint64_t v0 = k[0] ^ 0x736f6d6570736575ull, v1 = k[1] ^ 0x646f72616e646f6dull,
                 v2 = k[0] ^ 0x6c7967656e657261ull, v3 = k[1] ^ 0x7465646279746573ull;
        uint64_t b = (uint64_t)len << 56, m;
        size_t i = 0;
        for (; i + 8 <= len; i += 8) {
                memcpy(&m, in + i, 8); /* little-endian hosts only, as the pool's layout */
                v3 ^= m;
                SIPROUND;
                SIPROUND;
                v0 ^= m;
        }
        for (size_t j = 0; i + j < len; j++)
                b |= (uint64_t)in[i + j] << (8 * j);
        v3 ^= b;
        SIPROUND;
        SIPROUND;
        v0 ^= b;
        v2 ^= 0xff;
        SIPROUND;
        SIPROUND;
        SIPROUND;
        SIPROUND;
        return v0 ^ v1 ^ v2 ^ v3;
}

/* Who may attach s's blocks: its uid, or its tenant (the name, keyed: tenants come and go). */
static uint64_t scope_of(const struct kvcd *d, const struct session *s) {
        if (d->cfg.share_scope == PREFIX_SCOPE_TENANT)
                return siphash(d->prefix_secret, (const uint8_t *)s->tenant, strlen(s->tenant)) | 1ull << 63;
        return (uint64_t)s->owner->uid;
}

/* The index key of block i of s's prompt, after the key of block i - 1 (0 for the first). */
static uint64_t prefix_key(const struct kvcd *d, const struct session *s, uint64_t scope, uint32_t i,
                           uint64_t prev) {
        uint8_t buf[3 * sizeof(uint64_t) + PREFIX_BLOCK_TOKENS * sizeof(uint32_t)];
        memcpy(buf, &prev, 8);
        memcpy(buf + 8, &s->model_key, 8);
        memcpy(buf + 16, &scope, 8);
        memcpy(buf + 24, s->prompt_ids + (size_t)i * PREFIX_BLOCK_TOKENS, PREFIX_BLOCK_TOKENS * sizeof(uint32_t));
        uint64_t k = siphash(d->prefix_secret, buf, sizeof(buf));
        return k ? k : 1;
}

int prefix_scope_parse(const char *name) {
        if (strcmp(name, "uid") == 0)
                return PREFIX_SCOPE_UID;
        if (strcmp(name, "tenant") == 0)
                return PREFIX_SCOPE_TENANT;
        return -EINVAL;
}

int prefix_init(struct kvcd *d) {
        if (getrandom(d->prefix_secret, sizeof(d->prefix_secret), 0) != (ssize_t)sizeof(d->prefix_secret))
                return -EIO;
        return idmap_init(&d->prefixes, 64);
}

void prefix_done(struct kvcd *d) {
        struct prefix_block *b;
        for (uint32_t it = 0; (b = idmap_next(&d->prefixes, &it));)
                free(b); /* by now every session has let go; the pool goes with kvcd */
        if (d->prefixes.keys)
                idmap_done(&d->prefixes);
}

uint64_t prefix_model_key(const char *model_id, uint32_t n_layers, uint32_t n_kv_heads, uint32_t head_dim,
                          int dtype, uint32_t block_tokens) {
        if (!model_id || !*model_id)
                return 0;
        uint64_t h = 0xcbf29ce484222325ull; /* FNV-1a 64 over the id, then the shape */
        for (const char *p = model_id; *p; p++)
                h = (h ^ (uint8_t)*p) * 0x100000001b3ull;
        const uint32_t shape[] = { n_layers, n_kv_heads, head_dim, (uint32_t)dtype, block_tokens };
        for (size_t i = 0; i < sizeof(shape) / sizeof(shape[0]); i++)
                for (int k = 0; k < 4; k++)
                        h = (h ^ (uint8_t)(shape[i] >> (8 * k))) * 0x100000001b3ull;
        return h ? h : 1;
}

/* The published block i of s's prompt under the key, if it is there: the same ids after the same
 * block, in the same scope, of the same model and shape. The key only finds it. */
static struct prefix_block *lookup(const struct kvcd *d, const struct session *s, uint64_t scope, uint32_t i,
                                   uint64_t key) {
        struct prefix_block *b = idmap_get(&d->prefixes, key);
        if (!b || b->key != key || b->model != s->model_key || b->scope != scope || b->index != i ||
            b->parent != (i ? s->shared[i - 1] : NULL) || b->n_layers != s->n_layers ||
            b->unit_bytes != s->layout.block_bytes ||
            memcmp(b->ids, s->prompt_ids + (size_t)i * PREFIX_BLOCK_TOKENS, sizeof(b->ids)) != 0)
                return NULL;
        return b;
}

/* A domain whose units are all gone gives its chunks back. */
static void domain_gc(struct kvcd *d, uint64_t domain) {
        if (domain && pool_owner_units(d->pool, domain) == 0)
                pool_release_owner(d->pool, domain);
}

uint32_t prefix_attach(struct kvcd *d, struct session *s) {
        if (!s->model_key || !s->share_blocks || !s->prompt_ids || s->share_blocks > s->prompt_blocks)
                return 0;
        d->n.prefix_lookups++;
        uint32_t n = 0, T = s->layout.block_tokens;
        uint64_t chunk = pool_chunk_bytes(d->pool);
        uint8_t *sent = calloc((pool_n_chunks(d->pool) + 7) / 8, 1); /* each chunk once */
        if (!sent)
                return 0;
        uint64_t scope = scope_of(d, s), key = 0;
        for (uint32_t i = 0; i < s->share_blocks; i++) {
                key = prefix_key(d, s, scope, i, key);
                struct prefix_block *b = lookup(d, s, scope, i, key);
                if (!b)
                        break;
                int r = 0;
                for (uint32_t l = 0; l < s->n_layers && r == 0; l++) {
                        uint64_t idx = b->offs[l] / chunk;
                        if (sent[idx / 8] >> (idx % 8) & 1)
                                continue;
                        r = client_send_chunk_as(d, s->owner, (uint32_t)idx, true);
                        sent[idx / 8] |= (uint8_t)(1u << (idx % 8));
                }
                if (r < 0)
                        break; /* attach fewer: the rest the client computes */
                b->refs++;
                s->shared[i] = b;
                for (uint32_t l = 0; l < s->n_layers; l++) {
                        s->layers[l].t[0].blocks[i] = b->offs[l];
                        s->layers[l].t[0].n = i + 1;
                }
                n++;
        }
        free(sent);
        s->n_shared_blocks = n;
        for (uint32_t l = 0; l < s->n_layers; l++)
                s->layers[l].n_tokens = n * T;
        if (n) {
                d->n.prefix_hits++;
                d->n.prefix_hit_tokens += (uint64_t)n * T;
                log_info("session %llu attached a shared prefix of %u tokens", (unsigned long long)s->id,
                         n * T);
        }
        return n;
}

uint32_t prefix_publish(struct kvcd *d, struct session *s) {
        uint32_t T = s->layout.block_tokens;
        if (!s->model_key || s->publish_tried || s->n_shared_blocks >= s->share_blocks || s->pending_plan_id ||
            !s->prompt_ids || s->share_blocks > s->prompt_blocks)
                return 0;
        for (uint32_t l = 0; l < s->n_layers; l++)
                if (s->layers[l].n_tokens < s->share_blocks * T || s->layers[l].t[0].n < s->share_blocks)
                        return 0; /* the prefill has not passed them yet */
        s->publish_tried = true;
        /* only the prompt's leading blocks no plan has touched hold what the chain says */
        uint32_t upto = s->prompt_alive < s->share_blocks ? s->prompt_alive : s->share_blocks, n = 0;
        uint64_t chunk = pool_chunk_bytes(d->pool), scope = scope_of(d, s);
        uint64_t key = s->n_shared_blocks ? s->shared[s->n_shared_blocks - 1]->key : 0;
        for (uint32_t i = s->n_shared_blocks; i < upto; i++) {
                bool own = true;
                for (uint32_t l = 0; l < s->n_layers && own; l++)
                        own = pool_chunk_owner(d->pool, s->layers[l].t[0].blocks[i] / chunk) ==
                              s->prefix_domain;
                key = prefix_key(d, s, scope, i, key);
                if (!own || idmap_get(&d->prefixes, key))
                        break; /* someone published it first: the shared part stays contiguous */
                struct prefix_block *b = calloc(1, sizeof(*b) + s->n_layers * sizeof(uint64_t));
                if (!b || idmap_put(&d->prefixes, key, b) < 0) {
                        free(b);
                        break;
                }
                b->model = s->model_key;
                b->key = key;
                b->scope = scope;
                b->parent = i ? s->shared[i - 1] : NULL;
                memcpy(b->ids, s->prompt_ids + (size_t)i * PREFIX_BLOCK_TOKENS, sizeof(b->ids));
                b->index = i;
                b->refs = 1;
                b->domain = s->prefix_domain;
                b->ten = s->ten;
                b->n_layers = s->n_layers;
                b->unit_bytes = (uint32_t)s->layout.block_bytes;
                b->bytes = (uint64_t)s->n_layers * s->layout.block_bytes;
                for (uint32_t l = 0; l < s->n_layers; l++)
                        b->offs[l] = s->layers[l].t[0].blocks[i];
                /* the tenant keeps paying for it, as the prefix's now, not the session's */
                budget_charge(d, s, -(int64_t)b->bytes);
                budget_charge_shared(d, b->ten, (int64_t)b->bytes);
                s->shared[i] = b;
                s->n_shared_blocks = i + 1;
                n++;
        }
        if (n) {
                s->just_published = true;
                log_info("session %llu published %u prompt blocks (%u tokens shared)",
                         (unsigned long long)s->id, n, s->n_shared_blocks * T);
        }
        return n;
}

static void unref(struct kvcd *d, struct prefix_block *b) {
        if (--b->refs)
                return;
        for (uint32_t l = 0; l < b->n_layers; l++)
                if (pool_release(d->pool, b->domain, b->offs[l], b->unit_bytes, 1) < 0)
                        log_error("shared block at %llu: not its domain's in the pool",
                                  (unsigned long long)b->offs[l]);
        idmap_del(&d->prefixes, b->key);
        d->freed = true;
        uint64_t domain = b->domain;
        budget_charge_shared(d, b->ten, -(int64_t)b->bytes);
        free(b);
        domain_gc(d, domain);
}

void prefix_release(struct kvcd *d, struct session *s) {
        for (uint32_t i = 0; i < s->n_shared_blocks; i++)
                unref(d, s->shared[i]);
        s->n_shared_blocks = 0;
        domain_gc(d, s->prefix_domain);
}

void prefix_totals(const struct kvcd *d, uint32_t *ret_blocks, uint64_t *ret_bytes) {
        struct prefix_block *b;
        uint32_t n = 0;
        uint64_t bytes = 0;
        for (uint32_t it = 0; (b = idmap_next(&d->prefixes, &it));) {
                n++;
                bytes += b->bytes;
        }
        *ret_blocks = n;
        *ret_bytes = bytes;
}

int prefix_audit(const struct kvcd *d, uint64_t *ret_bytes) {
        struct prefix_block *b;
        uint64_t bytes = 0;
        int bad = 0;
        for (uint32_t it = 0; (b = idmap_next(&d->prefixes, &it));) {
                for (uint32_t l = 0; l < b->n_layers; l++)
                        if (pool_owns(d->pool, b->domain, b->offs[l], b->unit_bytes, 1) < 0)
                                bad++;
                bytes += b->bytes;
        }
        *ret_bytes = bytes;
        return bad ? -EUCLEAN : 0;
}
