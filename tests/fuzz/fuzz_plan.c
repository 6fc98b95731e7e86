/* fuzz_plan.c: libFuzzer target for libkvc's side of a hostile daemon: grants, plans (per layer,
 * per head, INT8 boundaries, summary slots), errors and garbage, fed to a session that really has
 * blocks, with appends and attention between them. The promise under test is libkvc's (client/lib/plan.c): a faulty
 * or hostile kvcd cannot make a client touch memory outside its pool and its own objects
 * (AddressSanitizer watches every heap object; the pool is one private mapping, so a stray access
 * past it faults), and libkvc's own accounting stays consistent whatever it is told.
 *
 * The session is made by kvc_fuzz_client_new() (client/kvc_fuzz.h): a private pool of 8 chunks of
 * 64 KiB, the plan buffer at the start of chunk 0, blocks granted anywhere in the pool.
 *
 * Input:
 *   byte 0    the geometry: bit 0 layers 1|2, bit 1 KV heads 1|2, bit 2 query heads per KV head
 *             1|2, bit 3 head_dim 4|8, bits 4-5 dtype f32|f16|bf16|f32, bit 6 plan buffer
 *             1|4 KiB, bit 7 the policy's limit 64|128 tokens per layer
 *   then records [op][len, u16 little-endian][len bytes] (len clipped to what is left):
 *     op % 4 == 0  write into the plan buffer: u16 byte offset (mod its size), then the bytes
 *     op % 4 == 1  a frame from "kvcd", handled by kvc_fuzz_feed()
 *     op % 4 == 2  steps: 1 + byte 0 % 32 of them, each appending to and attending over every
 *                  layer, with keys, values and queries cycled from the remaining bytes
 *     op % 4 == 3  write anywhere in the pool: u32 byte offset (mod its size), then the bytes
 * A step is taken only while every layer has room (as kvcd's grants would have made), since the
 * fuzz client has no daemon to ask for more.
 *
 * tests/fuzz/seeds.c writes the seed inputs of this format. With FUZZ_VERBOSE set in the
 * environment, every record's outcome goes to stderr (to see what a seed or a crash does).
 */
#include <errno.h>
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvc_fuzz.h"

#define MAX_HEADS    4u
#define MAX_HEAD_DIM 8u
#define MAX_STEPS    32u

#define FUZZ_CHECK(cond)                                                                                     \
        do {                                                                                                 \
                if (!(cond)) {                                                                               \
                        fprintf(stderr, "fuzz_plan: %s:%d: %s\n", __FILE__, __LINE__, #cond);                \
                        abort();                                                                             \
                }                                                                                            \
        } while (0)

struct run {
        struct kvc_client *c;
        struct kvc_session *s;
        struct kvc_geometry g;
        uint8_t *pool;
        uint64_t pool_bytes, plan_bytes;
        uint32_t max_layer_tokens;
        uint64_t step;
};

static void geometry_of(uint8_t b, struct kvc_geometry *g, uint64_t *plan_bytes, uint32_t *max_layer_tokens) {
        static const enum kvc_dtype dtypes[4] = { KVC_DTYPE_F32, KVC_DTYPE_F16, KVC_DTYPE_BF16,
                                                  KVC_DTYPE_F32 };
        g->n_layers = 1 + (b & 1u);
        g->n_kv_heads = 1 + ((b >> 1) & 1u);
        g->n_heads = g->n_kv_heads * (1 + ((b >> 2) & 1u));
        g->head_dim = (b & 8u) ? 8 : 4;
        g->dtype = dtypes[(b >> 4) & 3u];
        g->max_tokens = 256;
        *plan_bytes = (b & 64u) ? 4096 : 1024;
        *max_layer_tokens = (b & 128u) ? 128 : 64;
}

/* libkvc's tables of every layer and tier must stay inside what they were granted and inside the
 * pool, and the tiers' tokens add up to the layer's. */
static void check_layers(const struct run *r) {
        for (uint32_t l = 0; l < r->g.n_layers; l++) {
                uint64_t sum = 0;
                for (uint32_t t = 0; t < kvc_session_tiers(r->s); t++) {
                        struct kvc_fuzz_tier v;
                        FUZZ_CHECK(kvc_fuzz_tier(r->s, l, t, &v) == 0);
                        FUZZ_CHECK(v.n_tokens <= (uint64_t)v.n_blocks * v.block_tokens);
                        for (uint32_t b = 0; b < v.n_blocks; b++)
                                FUZZ_CHECK(v.blocks[b] >= r->pool &&
                                           v.blocks[b] + v.block_bytes <= r->pool + r->pool_bytes);
                        sum += v.n_tokens;
                }
                /* libkvc sizes its attention and compaction scratch for the policy's limit (64 or 128
                 * here, whole blocks): a layer never holds more, whatever kvcd grants */
                FUZZ_CHECK(kvc_layer_tokens(r->s, l) <= r->max_layer_tokens);
                FUZZ_CHECK(sum == kvc_layer_tokens(r->s, l));
        }
}

/* Whether every layer has a free slot at its dtype for the next token. */
static bool room_for_a_token(const struct run *r) {
        for (uint32_t l = 0; l < r->g.n_layers; l++) {
                struct kvc_fuzz_tier v;
                if (kvc_fuzz_tier(r->s, l, 0, &v) < 0 || v.n_tokens >= (uint64_t)v.n_blocks * v.block_tokens)
                        return false;
        }
        return true;
}

static int verbose = -1;

static void trace(const struct run *r, uint8_t op, size_t len, int result) {
        fprintf(stderr, "op %u, %zu bytes: %d %s |", op % 4u, len, result,
                result < 0 ? kvc_last_error(r->c) : "");
        for (uint32_t l = 0; l < r->g.n_layers; l++) {
                fprintf(stderr, " layer %u: %u tokens,", l, kvc_layer_tokens(r->s, l));
                for (uint32_t t = 0; t < kvc_session_tiers(r->s); t++) {
                        struct kvc_fuzz_tier v;
                        kvc_fuzz_tier(r->s, l, t, &v);
                        fprintf(stderr, " %s %u in %u blocks", kvc_session_tier_name(r->s, t), v.n_tokens,
                                v.n_blocks);
                }
        }
        fputc('\n', stderr);
}

static int steps(struct run *r, const uint8_t *p, size_t len) {
        float kv[MAX_HEADS * MAX_HEAD_DIM], q[MAX_HEADS * 2 * MAX_HEAD_DIM],
                out[MAX_HEADS * 2 * MAX_HEAD_DIM];
        uint32_t n = len ? 1u + p[0] % MAX_STEPS : 1u;
        const uint8_t *vals = len > 1 ? p + 1 : NULL;
        size_t n_vals = len > 1 ? len - 1 : 0, at = 0;

        int e = 0;
        for (uint32_t i = 0; i < n && e == 0 && room_for_a_token(r); i++) {
                for (uint32_t j = 0; j < r->g.n_kv_heads * r->g.head_dim; j++, at++)
                        kv[j] = vals ? (float)(int8_t)vals[at % n_vals] / 16.0f
                                     : (float)((r->step * 7 + j) % 11) / 8.0f - 0.5f;
                for (uint32_t j = 0; j < r->g.n_heads * r->g.head_dim; j++, at++)
                        q[j] = vals ? (float)(int8_t)vals[at % n_vals] / 16.0f
                                    : (float)((r->step * 5 + j) % 13) / 8.0f - 0.75f;
                e = kvc_fuzz_step(r->s, r->step, kv, q, out);
                r->step++;
        }
        return e;
}

static void write_at(uint8_t *dst, uint64_t cap, uint64_t off, const uint8_t *p, size_t len) {
        if (off >= cap)
                return;
        if (len > cap - off)
                len = (size_t)(cap - off);
        memcpy(dst + off, p, len);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
        struct run r = { 0 };
        if (size < 1)
                return 0;
        if (verbose < 0)
                verbose = getenv("FUZZ_VERBOSE") != NULL;
        geometry_of(data[0], &r.g, &r.plan_bytes, &r.max_layer_tokens);
        FUZZ_CHECK(kvc_fuzz_client_new(&r.g, r.max_layer_tokens, r.plan_bytes, &r.c, &r.s) == 0);
        r.pool = kvc_fuzz_pool(r.c, &r.pool_bytes);

        size_t at = 1;
        while (at + 3 <= size) {
                uint8_t op = data[at];
                size_t len = (size_t)data[at + 1] | (size_t)data[at + 2] << 8;
                at += 3;
                if (len > size - at)
                        len = size - at;
                const uint8_t *p = data + at;
                int result = 0;
                at += len;
                switch (op % 4) {
                case 0:
                        if (len >= 2)
                                write_at(r.pool, r.plan_bytes,
                                         ((uint64_t)p[0] | (uint64_t)p[1] << 8) % r.plan_bytes, p + 2,
                                         len - 2);
                        break;
                case 1: result = kvc_fuzz_feed(r.c, p, len); break;
                case 2: result = steps(&r, p, len); break;
                case 3:
                        if (len >= 4) {
                                uint64_t off = (uint64_t)p[0] | (uint64_t)p[1] << 8 | (uint64_t)p[2] << 16 |
                                               (uint64_t)p[3] << 24;
                                write_at(r.pool, r.pool_bytes, off % r.pool_bytes, p + 4, len - 4);
                        }
                        break;
                }
                if (verbose)
                        trace(&r, op, len, result);
                check_layers(&r);
        }
        kvc_disconnect(r.c);
        return 0;
}
