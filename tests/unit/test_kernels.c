/* test_kernels.c - unit tests of kernels/attention.c and kernels/summary.c against double
 * precision oracles written here.
 *
 * Owns: decode attention over a paged layer (GQA ratios, head dims, lengths across many blocks,
 * the log-weight mask, the score side outputs, read-only mode) and the logits summary (entropy,
 * top-1 probability, margin, top-k, ties, refusals, degenerate distributions).
 *
 * Tolerances. Attention output: |got - want| <= 1e-5 * sum_j a_j |v_j| per element, the error
 * relative to the magnitude the sum is made of (a relative error of the result itself is
 * unbounded where positive and negative terms cancel). Score side arrays: 1e-5 relative. Summary:
 * about 1e-6, since summary.c accumulates in double. Masking is checked for exact equality:
 * a masked token adds exact zeros.
 */
#include <errno.h>
#include <float.h>
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "testutil.h"

#include "attention.h"
#include "block.h"
#include "summary.h"

/* Uniform in [lo, hi). */
static float rng_uniform(float lo, float hi) {
        return lo + (hi - lo) * (float)((double)(rng_next() >> 11) / 9007199254740992.0);
}

/* ---- a layer of separately allocated blocks ---- */

struct test_layer {
        struct block_layout layout;
        struct block_layer L;
        uint8_t **blocks;
        uint32_t n_blocks;
};

enum logw_mode {
        LOGW_ZERO,
        LOGW_RANDOM, /* in [-3, 0] */
};

static float *side(struct test_layer *t, uint64_t off, uint32_t head, uint32_t slot) {
        const struct block_layout *l = &t->layout;
        return block_side(l, t->blocks[slot / l->block_tokens], off, head, slot % l->block_tokens);
}

static void layer_make(struct test_layer *t, uint32_t T, uint32_t H, uint32_t D, enum block_dtype dtype,
                       uint32_t n_tokens, enum logw_mode logw) {
        const struct block_layout *l = &t->layout;
        float row[1024];

        memset(t, 0, sizeof(*t));
        assert_int_equal(block_layout_init(&t->layout, T, H, D, dtype), 0);
        t->n_blocks = n_tokens ? (n_tokens + T - 1) / T : 1;
        t->blocks = calloc(t->n_blocks, sizeof(*t->blocks));
        assert_non_null(t->blocks);
        for (uint32_t b = 0; b < t->n_blocks; b++) {
                t->blocks[b] = aligned_alloc(64, l->block_bytes);
                assert_non_null(t->blocks[b]);
                memset(t->blocks[b], 0xcd, l->block_bytes); /* garbage in unused slots */
        }
        for (uint32_t h = 0; h < H; h++) {
                for (uint32_t s = 0; s < n_tokens; s++) {
                        uint8_t *b = t->blocks[s / T];
                        for (uint32_t i = 0; i < D; i++)
                                row[i] = rng_uniform(-1, 1);
                        block_store_row(dtype, row, block_key(l, b, h, s % T), D);
                        for (uint32_t i = 0; i < D; i++)
                                row[i] = rng_uniform(-1, 1);
                        block_store_row(dtype, row, block_value(l, b, h, s % T), D);
                        *(int32_t *)(void *)side(t, l->pos_offset, h, s) = (int32_t)s;
                        *side(t, l->sum_offset, h, s) = rng_uniform(0, 2);
                        *side(t, l->ema_offset, h, s) = rng_uniform(0, 1);
                        *side(t, l->last_offset, h, s) = rng_uniform(0, 1);
                        *side(t, l->logw_offset, h, s) = logw == LOGW_ZERO ? 0.0f : rng_uniform(-3, 0);
                }
        }
        t->L = (struct block_layer){
                .layout = &t->layout, .blocks = t->blocks, .n_blocks = t->n_blocks, .n_tokens = n_tokens
        };
}

static void layer_done(struct test_layer *t) {
        for (uint32_t b = 0; b < t->n_blocks; b++)
                free(t->blocks[b]);
        free(t->blocks);
}

static uint8_t **layer_snapshot(const struct test_layer *t) {
        uint8_t **s = calloc(t->n_blocks, sizeof(*s));
        assert_non_null(s);
        for (uint32_t b = 0; b < t->n_blocks; b++) {
                s[b] = malloc(t->layout.block_bytes);
                assert_non_null(s[b]);
                memcpy(s[b], t->blocks[b], t->layout.block_bytes);
        }
        return s;
}

static void snapshot_free(const struct test_layer *t, uint8_t **s) {
        for (uint32_t b = 0; b < t->n_blocks; b++)
                free(s[b]);
        free(s);
}

/* Bytes [from, to) of every block equal the snapshot's. */
static void assert_region_unchanged(const struct test_layer *t, uint8_t **snap, uint64_t from, uint64_t to,
                                    const char *what) {
        for (uint32_t b = 0; b < t->n_blocks; b++)
                if (memcmp(t->blocks[b] + from, snap[b] + from, to - from) != 0)
                        fail_msg("%s of block %u changed", what, b);
}

/* ---- the attention oracle ---- */

struct oracle {
        double *out;   /* [n_heads][D] */
        double *scale; /* [n_heads][D]: sum_j a_j |v_j| */
        double *acc;   /* [H][n]: attention averaged over the group */
        double *wsum;  /* [n_heads]: sum_j a_j */
};

static void oracle_run(struct test_layer *t, const float *q, uint32_t n_heads, struct oracle *o) {
        const struct block_layout *l = &t->layout;
        uint32_t H = l->n_kv_heads, D = l->head_dim, T = l->block_tokens, n = t->L.n_tokens;
        uint32_t group = n_heads / H;
        double *s = calloc(n, sizeof(*s));
        float k[1024], v[1024];

        assert_non_null(s);
        o->out = calloc((size_t)n_heads * D, sizeof(double));
        o->scale = calloc((size_t)n_heads * D, sizeof(double));
        o->acc = calloc((size_t)H * n, sizeof(double));
        o->wsum = calloc(n_heads, sizeof(double));
        assert_true(o->out && o->scale && o->acc && o->wsum);
        for (uint32_t h = 0; h < n_heads; h++) {
                uint32_t g = h / group;
                double max = -INFINITY, sum = 0;
                for (uint32_t j = 0; j < n; j++) {
                        block_load_row(l->dtype, block_key(l, t->blocks[j / T], g, j % T), k, D);
                        double dot = 0;
                        for (uint32_t i = 0; i < D; i++)
                                dot += (double)q[(size_t)h * D + i] * k[i];
                        s[j] = dot / sqrt((double)D) + *side(t, l->logw_offset, g, j);
                        if (s[j] > max)
                                max = s[j];
                }
                if (max == -INFINITY)
                        continue; /* every token masked: no attention, zero output */
                for (uint32_t j = 0; j < n; j++)
                        sum += exp(s[j] - max);
                for (uint32_t j = 0; j < n; j++) {
                        double a = exp(s[j] - max) / sum;
                        block_load_row(l->dtype, block_value(l, t->blocks[j / T], g, j % T), v, D);
                        for (uint32_t i = 0; i < D; i++) {
                                o->out[(size_t)h * D + i] += a * v[i];
                                o->scale[(size_t)h * D + i] += a * fabs(v[i]);
                        }
                        o->acc[(size_t)g * n + j] += a / group;
                        o->wsum[h] += a;
                }
        }
        free(s);
}

static void oracle_free(struct oracle *o) {
        free(o->out);
        free(o->scale);
        free(o->acc);
        free(o->wsum);
}

static float *random_q(uint32_t n_heads, uint32_t D, float amp) {
        float *q = malloc((size_t)n_heads * D * sizeof(*q));
        assert_non_null(q);
        for (size_t i = 0; i < (size_t)n_heads * D; i++)
                q[i] = rng_uniform(-amp, amp);
        return q;
}

static double max_rel_err;

/* Runs attn_decode_ref with score updates on t and checks output and side arrays against the
 * oracle (computed on the state before the call). */
static void check_attention(struct test_layer *t, uint32_t n_heads, float gamma, float q_amp,
                            const char *what) {
        const struct block_layout *l = &t->layout;
        uint32_t H = l->n_kv_heads, D = l->head_dim, n = t->L.n_tokens;
        float *q = random_q(n_heads, D, q_amp);
        float *out = malloc((size_t)n_heads * D * sizeof(*out));
        float *scratch = malloc(2 * (size_t)n * sizeof(*scratch));
        uint8_t **snap = layer_snapshot(t);
        struct oracle o;

        assert_non_null(out);
        assert_non_null(scratch);
        oracle_run(t, q, n_heads, &o);
        assert_int_equal(attn_decode_ref(&t->L, q, out, n_heads, gamma, 1, scratch), 0);

        for (size_t i = 0; i < (size_t)n_heads * D; i++) {
                double err = fabs((double)out[i] - o.out[i]);
                if (!(err <= 1e-5 * o.scale[i]))
                        fail_msg(
                                "%s: out[%zu] = %.9g, oracle %.9g (scale %.3g, T=%u H=%u heads=%u D=%u n=%u)",
                                what, i, (double)out[i], o.out[i], o.scale[i], l->block_tokens, H, n_heads, D,
                                n);
                if (o.scale[i] > 0 && err / o.scale[i] > max_rel_err)
                        max_rel_err = err / o.scale[i];
        }
        for (uint32_t g = 0; g < H; g++) {
                double total = 0;
                for (uint32_t j = 0; j < n; j++) {
                        size_t b = j / l->block_tokens;
                        uint32_t s = j % l->block_tokens;
                        double a = o.acc[(size_t)g * n + j];
                        double sum0 = *(float *)block_side(l, snap[b], l->sum_offset, g, s);
                        double ema0 = *(float *)block_side(l, snap[b], l->ema_offset, g, s);
                        double want[3] = { sum0 + a, gamma * ema0 + (1 - gamma) * a, a };
                        float got[3] = { *side(t, l->sum_offset, g, j), *side(t, l->ema_offset, g, j),
                                         *side(t, l->last_offset, g, j) };
                        for (int k = 0; k < 3; k++)
                                if (!(fabs(got[k] - want[k]) <= 1e-5 * fabs(want[k]) + 1e-12))
                                        fail_msg("%s: %s of head %u slot %u = %.9g, oracle %.9g", what,
                                                 k == 0   ? "sum"
                                                 : k == 1 ? "ema"
                                                          : "last",
                                                 g, j, (double)got[k], want[k]);
                        total += got[2];
                }
                /* the averaged weights of a KV head sum to one, like each query head's */
                if (!(fabs(total - 1) <= 1e-5))
                        fail_msg("%s: attention of KV head %u sums to %.9g", what, g, total);
        }
        /* keys, values, positions and log-weights are only read */
        assert_region_unchanged(t, snap, 0, l->sum_offset, "keys, values or positions");
        assert_region_unchanged(t, snap, l->logw_offset, l->block_bytes, "log-weights");
        snapshot_free(t, snap);
        oracle_free(&o);
        free(q);
        free(out);
        free(scratch);
}

static void attn_matches_double_oracle_for_f32(void **state) {
        static const uint32_t gqa[][2] = { { 1, 1 }, { 4, 4 }, { 8, 2 }, { 8, 1 }, { 12, 3 }, { 32, 4 } };
        static const uint32_t dims[] = { 8, 64, 128 };
        static const uint32_t lens[] = { 1, 2, 15, 16, 17, 33, 100, 255, 300 };
        (void)state;
        rng_state = 0xa77e;
        max_rel_err = 0;
        for (size_t gi = 0; gi < sizeof(gqa) / sizeof(gqa[0]); gi++) {
                for (size_t di = 0; di < sizeof(dims) / sizeof(dims[0]); di++) {
                        for (size_t li = 0; li < sizeof(lens) / sizeof(lens[0]); li++) {
                                struct test_layer t;
                                uint32_t T = li % 2 ? 16 : 7;
                                layer_make(&t, T, gqa[gi][1], dims[di], BLOCK_DTYPE_F32, lens[li],
                                           li % 3 ? LOGW_RANDOM : LOGW_ZERO);
                                check_attention(&t, gqa[gi][0], 0.9f, li % 4 ? 2.0f : 8.0f, "f32");
                                layer_done(&t);
                        }
                }
        }
        print_message("largest error relative to sum a|v|: %.3g\n", max_rel_err);
}

/* Half and bfloat16 storage: the oracle reads the same stored values, so only the arithmetic
 * differs. */
static void attn_matches_double_oracle_for_f16_and_bf16(void **state) {
        (void)state;
        rng_state = 0x16bf;
        for (int dt = BLOCK_DTYPE_F16; dt <= BLOCK_DTYPE_BF16; dt++) {
                for (uint32_t n = 1; n <= 300; n += 37) {
                        struct test_layer t;
                        layer_make(&t, 16, 2, 64, (enum block_dtype)dt, n, LOGW_RANDOM);
                        check_attention(&t, 8, 0.5f, 2.0f, dt == BLOCK_DTYPE_F16 ? "f16" : "bf16");
                        layer_done(&t);
                }
        }
}

static void attn_applies_ema_gamma_at_its_extremes(void **state) {
        (void)state;
        rng_state = 0x9a;
        for (int g = 0; g <= 1; g++) {
                struct test_layer t;
                layer_make(&t, 4, 2, 8, BLOCK_DTYPE_F32, 23, LOGW_RANDOM);
                /* gamma 0: ema becomes the attention; gamma 1: ema keeps its value */
                check_attention(&t, 4, (float)g, 2.0f, g ? "gamma 1" : "gamma 0");
                layer_done(&t);
        }
}

/* Two calls accumulate: sum gains the attention twice, ema decays twice. */
static void attn_accumulates_scores_over_calls(void **state) {
        struct test_layer t;
        const float gamma = 0.75f;
        float out[4 * 16], scratch[2 * 40];
        (void)state;
        rng_state = 0x2c;
        layer_make(&t, 16, 2, 16, BLOCK_DTYPE_F32, 40, LOGW_ZERO);
        const struct block_layout *l = &t.layout;
        float *q = random_q(4, 16, 2.0f);
        float sum0[2][40], ema0[2][40];
        for (uint32_t g = 0; g < 2; g++)
                for (uint32_t j = 0; j < 40; j++) {
                        sum0[g][j] = *side(&t, l->sum_offset, g, j);
                        ema0[g][j] = *side(&t, l->ema_offset, g, j);
                }
        assert_int_equal(attn_decode_ref(&t.L, q, out, 4, gamma, 1, scratch), 0);
        assert_int_equal(attn_decode_ref(&t.L, q, out, 4, gamma, 1, scratch), 0);
        for (uint32_t g = 0; g < 2; g++)
                for (uint32_t j = 0; j < 40; j++) {
                        double a = *side(&t, l->last_offset, g, j);
                        double want_sum = sum0[g][j] + 2 * a;
                        double want_ema = gamma * (gamma * ema0[g][j] + (1 - gamma) * a) + (1 - gamma) * a;
                        assert_true(fabs(*side(&t, l->sum_offset, g, j) - want_sum) <= 1e-6 * (1 + want_sum));
                        assert_true(fabs(*side(&t, l->ema_offset, g, j) - want_ema) <= 1e-6);
                }
        free(q);
        layer_done(&t);
}

static void attn_leaves_side_arrays_alone_without_update_scores(void **state) {
        (void)state;
        rng_state = 0x50;
        for (uint32_t n = 1; n <= 70; n += 23) {
                struct test_layer t;
                layer_make(&t, 16, 2, 32, BLOCK_DTYPE_F32, n, LOGW_RANDOM);
                float *q = random_q(6, 32, 2.0f);
                float out_ro[6 * 32], out_rw[6 * 32], scratch[2 * 70];
                uint8_t **snap = layer_snapshot(&t);
                assert_int_equal(attn_decode_ref(&t.L, q, out_ro, 6, 0.9f, 0, scratch), 0);
                assert_region_unchanged(&t, snap, 0, t.layout.block_bytes, "a read-only layer");
                /* and the output is the same as with updates */
                assert_int_equal(attn_decode_ref(&t.L, q, out_rw, 6, 0.9f, 1, scratch), 0);
                assert_memory_equal(out_ro, out_rw, sizeof(out_ro));
                snapshot_free(&t, snap);
                free(q);
                layer_done(&t);
        }
}

/* A layer equal to src without token `drop`. */
static void layer_without(struct test_layer *dst, struct test_layer *src, uint32_t drop) {
        const struct block_layout *l = &src->layout;
        uint32_t n = src->L.n_tokens;
        layer_make(dst, l->block_tokens, l->n_kv_heads, l->head_dim, l->dtype, n - 1, LOGW_ZERO);
        const uint64_t offs[] = { l->pos_offset, l->sum_offset, l->ema_offset, l->last_offset,
                                  l->logw_offset };
        for (uint32_t h = 0; h < l->n_kv_heads; h++) {
                for (uint32_t j = 0, k = 0; j < n; j++) {
                        if (j == drop)
                                continue;
                        uint8_t *sb = src->blocks[j / l->block_tokens],
                                *db = dst->blocks[k / l->block_tokens];
                        uint32_t ss = j % l->block_tokens, ds = k % l->block_tokens;
                        memcpy(block_key(l, db, h, ds), block_key(l, sb, h, ss), l->row_bytes);
                        memcpy(block_value(l, db, h, ds), block_value(l, sb, h, ss), l->row_bytes);
                        for (int a = 0; a < 5; a++)
                                memcpy(block_side(l, db, offs[a], h, ds), block_side(l, sb, offs[a], h, ss),
                                       4);
                        k++;
                }
        }
}

/* A -inf log-weight removes a token exactly: the output equals attention without it, the
 * token's score gets zero attention, and every other token's score is as without it. */
static void attn_masks_a_token_with_minus_inf_logweight(void **state) {
        (void)state;
        rng_state = 0x3a5c;
        for (int iter = 0; iter < 40; iter++) {
                struct test_layer a, b;
                uint32_t T = 1 + rng_below(16), H = 1 + rng_below(3), group = 1 + rng_below(4);
                uint32_t D = 1 + rng_below(40), n = 2 + rng_below(80), drop = rng_below(n);
                uint32_t n_heads = H * group;
                const float gamma = 0.8f;
                layer_make(&a, T, H, D, BLOCK_DTYPE_F32, n, iter % 2 ? LOGW_RANDOM : LOGW_ZERO);
                for (uint32_t h = 0; h < H; h++)
                        *side(&a, a.layout.logw_offset, h, drop) = -INFINITY;
                layer_without(&b, &a, drop);
                float ema_drop[3], sum_drop[3];
                for (uint32_t h = 0; h < H; h++) {
                        ema_drop[h] = *side(&a, a.layout.ema_offset, h, drop);
                        sum_drop[h] = *side(&a, a.layout.sum_offset, h, drop);
                }

                float *q = random_q(n_heads, D, 4.0f);
                float *out_a = malloc((size_t)n_heads * D * sizeof(float));
                float *out_b = malloc((size_t)n_heads * D * sizeof(float));
                float *scratch = malloc(2 * (size_t)n * sizeof(float));
                assert_true(out_a && out_b && scratch);
                assert_int_equal(attn_decode_ref(&a.L, q, out_a, n_heads, gamma, 1, scratch), 0);
                assert_int_equal(attn_decode_ref(&b.L, q, out_b, n_heads, gamma, 1, scratch), 0);
                for (size_t i = 0; i < (size_t)n_heads * D; i++)
                        if (!(out_a[i] == out_b[i]))
                                fail_msg("case %d: out[%zu] %a with the token masked, %a without it", iter, i,
                                         (double)out_a[i], (double)out_b[i]);
                const struct block_layout *l = &a.layout;
                const uint64_t offs[] = { l->sum_offset, l->ema_offset, l->last_offset };
                for (uint32_t h = 0; h < H; h++) {
                        assert_true(*side(&a, l->last_offset, h, drop) == 0.0f);
                        assert_true(*side(&a, l->sum_offset, h, drop) == sum_drop[h]);
                        assert_true(*side(&a, l->ema_offset, h, drop) == gamma * ema_drop[h]);
                        for (uint32_t j = 0, k = 0; j < n; j++) {
                                if (j == drop)
                                        continue;
                                for (int s = 0; s < 3; s++)
                                        assert_true(*side(&a, offs[s], h, j) == *side(&b, offs[s], h, k));
                                k++;
                        }
                }
                free(q);
                free(out_a);
                free(out_b);
                free(scratch);
                layer_done(&a);
                layer_done(&b);
        }
}

/* A shared prefix: a token masked in this session's bitmap is removed exactly as a -inf
 * log-weight removes it, and no score of a shared slot is written (other sessions read them). */
static void attn_masks_shared_slots_with_the_bitmap_and_writes_none(void **state) {
        (void)state;
        rng_state = 0x5e7a;
        for (int iter = 0; iter < 40; iter++) {
                struct test_layer a, b;
                uint32_t T = 16, H = 1 + rng_below(3), group = 1 + rng_below(4), D = 1 + rng_below(40);
                uint32_t S = 16 * (1 + rng_below(3)), n = S + 1 + rng_below(40), drop = rng_below(S);
                uint32_t n_heads = H * group, stride = 8;
                layer_make(&a, T, H, D, BLOCK_DTYPE_F32, n, iter % 2 ? LOGW_RANDOM : LOGW_ZERO);
                layer_make(&b, T, H, D, BLOCK_DTYPE_F32, n, LOGW_ZERO);
                for (uint32_t bl = 0; bl < a.n_blocks; bl++) /* b: the same layer... */
                        memcpy(b.blocks[bl], a.blocks[bl], a.layout.block_bytes);
                for (uint32_t h = 0; h < H; h++) /* ...with the token masked the usual way */
                        *side(&b, b.layout.logw_offset, h, drop) = -INFINITY;
                uint8_t mask[3 * 8] = { 0 };
                for (uint32_t h = 0; h < H; h++)
                        mask[h * stride + drop / 8] |= (uint8_t)(1u << (drop % 8));
                a.L.n_shared = S;
                a.L.shared_mask = mask;
                a.L.mask_stride = stride;
                uint8_t **snap = layer_snapshot(&a);
                float *q = random_q(n_heads, D, 4.0f);
                float *out_a = malloc((size_t)n_heads * D * sizeof(float));
                float *out_b = malloc((size_t)n_heads * D * sizeof(float));
                float *scratch = malloc(2 * (size_t)n * sizeof(float));
                assert_true(out_a && out_b && scratch);
                assert_int_equal(attn_decode_ref(&a.L, q, out_a, n_heads, 0.8f, 1, scratch), 0);
                assert_int_equal(attn_decode_ref(&b.L, q, out_b, n_heads, 0.8f, 1, scratch), 0);
                for (size_t i = 0; i < (size_t)n_heads * D; i++)
                        if (!(out_a[i] == out_b[i]))
                                fail_msg("case %d: out[%zu] %a with the bitmap, %a with -inf", iter, i,
                                         (double)out_a[i], (double)out_b[i]);
                /* the shared blocks are byte for byte as they were; the private slots got scores */
                for (uint32_t bl = 0; bl < S / T; bl++)
                        assert_memory_equal(a.blocks[bl], snap[bl], a.layout.block_bytes);
                for (uint32_t h = 0; h < H; h++)
                        for (uint32_t j = S; j < n; j++)
                                assert_true(*side(&a, a.layout.last_offset, h, j) ==
                                            *side(&b, b.layout.last_offset, h, j));
                /* a mask too short for the prefix is refused */
                a.L.mask_stride = S / 8 - 1;
                assert_int_equal(attn_decode_ref(&a.L, q, out_a, n_heads, 0.8f, 1, scratch), -EINVAL);
                snapshot_free(&a, snap);
                free(q);
                free(out_a);
                free(out_b);
                free(scratch);
                layer_done(&a);
                layer_done(&b);
        }
}

/* Every token masked: zero output and zero attention, never NaN. */
static void attn_gives_zeros_when_every_token_is_masked(void **state) {
        struct test_layer t;
        float out[8 * 16], scratch[2 * 37];
        (void)state;
        rng_state = 0xdead;
        layer_make(&t, 16, 2, 16, BLOCK_DTYPE_F32, 37, LOGW_ZERO);
        const struct block_layout *l = &t.layout;
        float sum0[2][37], ema0[2][37];
        for (uint32_t h = 0; h < 2; h++)
                for (uint32_t j = 0; j < 37; j++) {
                        *side(&t, l->logw_offset, h, j) = -INFINITY;
                        sum0[h][j] = *side(&t, l->sum_offset, h, j);
                        ema0[h][j] = *side(&t, l->ema_offset, h, j);
                }
        float *q = random_q(8, 16, 2.0f);
        memset(out, 0xff, sizeof(out)); /* NaN patterns: must be overwritten */
        assert_int_equal(attn_decode_ref(&t.L, q, out, 8, 0.5f, 1, scratch), 0);
        for (size_t i = 0; i < 8 * 16; i++)
                assert_true(out[i] == 0.0f);
        for (uint32_t h = 0; h < 2; h++)
                for (uint32_t j = 0; j < 37; j++) {
                        assert_true(*side(&t, l->last_offset, h, j) == 0.0f);
                        assert_true(*side(&t, l->sum_offset, h, j) == sum0[h][j]);
                        assert_true(*side(&t, l->ema_offset, h, j) == 0.5f * ema0[h][j]);
                }
        free(q);
        layer_done(&t);
}

static void attn_rejects_bad_arguments(void **state) {
        struct test_layer t;
        float q[4 * 8] = { 0 }, out[4 * 8], scratch[2 * 20];
        (void)state;
        rng_state = 1;
        layer_make(&t, 4, 2, 8, BLOCK_DTYPE_F32, 20, LOGW_ZERO);
        uint8_t **snap = layer_snapshot(&t);
        assert_int_equal(attn_decode_ref(&t.L, q, out, 0, 0.9f, 1, scratch), -EINVAL);
        assert_int_equal(attn_decode_ref(&t.L, q, out, 3, 0.9f, 1, scratch), -EINVAL);
        t.L.n_tokens = 0;
        assert_int_equal(attn_decode_ref(&t.L, q, out, 4, 0.9f, 1, scratch), -EINVAL);
        t.L.n_tokens = 21; /* more than 5 blocks of 4 hold */
        assert_int_equal(attn_decode_ref(&t.L, q, out, 4, 0.9f, 1, scratch), -EINVAL);
        assert_region_unchanged(&t, snap, 0, t.layout.block_bytes, "a refused layer");
        snapshot_free(&t, snap);
        layer_done(&t);

        /* a head dimension past the reference's limit */
        struct block_layout wide;
        uint8_t *blk[1] = { NULL };
        assert_int_equal(block_layout_init(&wide, 1, 1, ATTN_MAX_HEAD_DIM + 1, BLOCK_DTYPE_F32), 0);
        struct block_layer L = { .layout = &wide, .blocks = blk, .n_blocks = 1, .n_tokens = 1 };
        assert_int_equal(attn_decode_ref(&L, q, out, 1, 0.9f, 1, scratch), -EINVAL);
}

/* ---- summary ---- */

struct summary_oracle {
        double entropy, top1_prob, margin;
        uint32_t top1;
        double *logp_sorted; /* descending */
};

static int cmp_desc(const void *a, const void *b) {
        double x = *(const double *)a, y = *(const double *)b;
        return x < y ? 1 : x > y ? -1 : 0;
}

static void summary_oracle_run(const float *z, uint32_t V, struct summary_oracle *o) {
        double max = -INFINITY, sum = 0, h = 0, second = -INFINITY;
        uint32_t top1 = 0;
        for (uint32_t i = 0; i < V; i++)
                if (z[i] > max) {
                        max = z[i];
                        top1 = i;
                }
        for (uint32_t i = 0; i < V; i++) {
                sum += exp(z[i] - max);
                if (i != top1 && z[i] > second)
                        second = z[i];
        }
        double lse = max + log(sum);
        o->logp_sorted = malloc(V * sizeof(double));
        assert_non_null(o->logp_sorted);
        for (uint32_t i = 0; i < V; i++) {
                double lp = z[i] - lse, p = exp(lp);
                if (p > 0)
                        h -= p * lp;
                o->logp_sorted[i] = lp;
        }
        qsort(o->logp_sorted, V, sizeof(double), cmp_desc);
        o->entropy = h / log((double)V);
        o->top1_prob = exp(max - lse);
        o->margin = max - second;
        o->top1 = top1;
}

static void check_summary(const float *z, uint32_t V, uint32_t k, const char *what) {
        struct summary_oracle o;
        struct summary s;
        float *topk = malloc((k ? k : 1) * sizeof(float));

        assert_non_null(topk);
        summary_oracle_run(z, V, &o);
        assert_int_equal(summary_logits_ref(z, V, &s, k ? topk : NULL, k), 0);
        if (!(fabs(s.entropy - o.entropy) <= 1e-6) || s.entropy < 0 || s.entropy > 1)
                fail_msg("%s: entropy %.9g, oracle %.9g", what, (double)s.entropy, o.entropy);
        if (!(fabs(s.top1_prob - o.top1_prob) <= 1e-6 * o.top1_prob))
                fail_msg("%s: top1_prob %.9g, oracle %.9g", what, (double)s.top1_prob, o.top1_prob);
        if (!(s.margin == (float)o.margin) || s.margin < 0)
                fail_msg("%s: margin %.9g, oracle %.9g", what, (double)s.margin, o.margin);
        if (s.top1 != o.top1)
                fail_msg("%s: top1 %u, oracle %u", what, s.top1, o.top1);
        for (uint32_t j = 0; j < k; j++) {
                if (!(fabs(topk[j] - o.logp_sorted[j]) <= 1e-6 * fmax(1, fabs(o.logp_sorted[j]))))
                        fail_msg("%s: topk[%u] %.9g, oracle %.9g", what, j, (double)topk[j],
                                 o.logp_sorted[j]);
                assert_true(topk[j] <= 0);
                if (j > 0)
                        assert_true(topk[j] <= topk[j - 1]);
        }
        free(o.logp_sorted);
        free(topk);
}

static void summary_matches_double_oracle(void **state) {
        static const uint32_t vocabs[] = { 2, 3, 7, 64, 100, 1000, 32000 };
        static const float scales[] = { 0.01f, 1.0f, 10.0f, 100.0f };
        (void)state;
        rng_state = 0x5u;
        for (size_t vi = 0; vi < sizeof(vocabs) / sizeof(vocabs[0]); vi++) {
                uint32_t V = vocabs[vi];
                float *z = malloc(V * sizeof(float));
                assert_non_null(z);
                for (size_t si = 0; si < sizeof(scales) / sizeof(scales[0]); si++) {
                        for (int rep = 0; rep < 3; rep++) {
                                for (uint32_t i = 0; i < V; i++)
                                        z[i] = scales[si] * rng_uniform(-1, 1) + (rep == 2 ? 50.0f : 0.0f);
                                uint32_t k = V < 64 ? V : 64;
                                char what[64];
                                snprintf(what, sizeof(what), "V=%u scale %g rep %d", V, (double)scales[si],
                                         rep);
                                check_summary(z, V, rep == 1 ? 0 : k, what);
                        }
                }
                free(z);
        }
}

/* Integer logits from a small range: many ties, at the top too. */
static void summary_handles_ties(void **state) {
        (void)state;
        rng_state = 0x7135;
        for (int iter = 0; iter < 200; iter++) {
                uint32_t V = 2 + rng_below(100), k = 1 + rng_below(V < 64 ? V : 64);
                float z[101];
                for (uint32_t i = 0; i < V; i++)
                        z[i] = (float)rng_below(4) - 2.0f;
                check_summary(z, V, k, "ties");
        }
        /* the lowest index wins the top, the margin between tied maxima is zero */
        const float z[] = { 1, 3, 3, 2, 3 };
        struct summary s;
        float topk[5];
        assert_int_equal(summary_logits_ref(z, 5, &s, topk, 5), 0);
        assert_int_equal(s.top1, 1);
        assert_true(s.margin == 0.0f);
        assert_true(topk[0] == topk[1] && topk[1] == topk[2]);
        assert_true(topk[2] > topk[3] && topk[3] > topk[4]);
        /* the maximum last, and first */
        const float last[] = { 0, 1, 2, 5 }, first[] = { 5, 2, 1, 0 };
        assert_int_equal(summary_logits_ref(last, 4, &s, NULL, 0), 0);
        assert_int_equal(s.top1, 3);
        assert_true(s.margin == 3.0f);
        assert_int_equal(summary_logits_ref(first, 4, &s, NULL, 0), 0);
        assert_int_equal(s.top1, 0);
        assert_true(s.margin == 3.0f);
}

static void summary_rejects_bad_input(void **state) {
        float z[8] = { 0.5f, 1, 2, 3, 4, 5, 6, 7 }, topk[9];
        struct summary s = { .entropy = 42 };
        (void)state;
        assert_int_equal(summary_logits_ref(z, 0, &s, NULL, 0), -EINVAL);
        assert_int_equal(summary_logits_ref(z, 1, &s, NULL, 0), -EINVAL);
        assert_int_equal(summary_logits_ref(z, 8, &s, topk, 9), -EINVAL);
        const float bad[] = { NAN, -NAN, INFINITY, -INFINITY };
        for (size_t b = 0; b < sizeof(bad) / sizeof(bad[0]); b++) {
                for (uint32_t at = 0; at < 8; at += 7) {
                        float saved = z[at];
                        z[at] = bad[b];
                        assert_int_equal(summary_logits_ref(z, 8, &s, topk, 3), -EINVAL);
                        z[at] = saved;
                }
        }
        assert_true(s.entropy == 42); /* untouched by the refusals */
        assert_int_equal(summary_logits_ref(z, 8, &s, topk, 8), 0);
}

static void summary_of_one_huge_logit_has_no_entropy(void **state) {
        enum { V = 1000 };
        float z[V] = { 0 }, topk[3];
        struct summary s;
        (void)state;
        z[517] = 1000.0f;
        assert_int_equal(summary_logits_ref(z, V, &s, topk, 3), 0);
        assert_true(s.entropy >= 0 && s.entropy < 1e-6f);
        assert_true(s.top1_prob == 1.0f);
        assert_true(s.margin == 1000.0f);
        assert_int_equal(s.top1, 517);
        assert_true(topk[0] == 0.0f);
        assert_true(fabsf(topk[1] + 1000.0f) < 1e-3f);
        assert_true(topk[2] == topk[1]);
        /* just dominant: entropy small but positive */
        z[517] = 20.0f;
        check_summary(z, V, 3, "one dominant logit");
}

static void summary_of_equal_logits_has_entropy_one_and_no_margin(void **state) {
        static const uint32_t vocabs[] = { 2, 3, 1000, 32000 };
        float *z = malloc(32000 * sizeof(float)), topk[64];
        (void)state;
        assert_non_null(z);
        for (size_t vi = 0; vi < sizeof(vocabs) / sizeof(vocabs[0]); vi++) {
                uint32_t V = vocabs[vi], k = V < 64 ? V : 64;
                struct summary s;
                for (uint32_t i = 0; i < V; i++)
                        z[i] = -7.25f;
                assert_int_equal(summary_logits_ref(z, V, &s, topk, k), 0);
                assert_true(fabsf(s.entropy - 1.0f) <= 1e-6f);
                assert_true(fabs(s.top1_prob - 1.0 / V) <= 1e-6 / V);
                assert_true(s.margin == 0.0f);
                assert_int_equal(s.top1, 0);
                for (uint32_t j = 0; j < k; j++)
                        assert_true(fabs(topk[j] + log((double)V)) <= 1e-6 * log((double)V));
        }
        free(z);
}

/* Finite logits far apart still give a finite margin: the protocol refuses an infinite one. */
static void summary_margin_stays_finite_for_extreme_logits(void **state) {
        const float z[] = { FLT_MAX, -FLT_MAX, 0 };
        const float w[] = { -FLT_MAX, FLT_MAX };
        struct summary s;
        (void)state;
        assert_int_equal(summary_logits_ref(z, 3, &s, NULL, 0), 0);
        assert_true(isfinite(s.margin) && s.margin >= 0);
        assert_true(s.margin == FLT_MAX); /* z1 - z2 = FLT_MAX - 0 */
        assert_true(s.top1_prob == 1.0f);
        assert_true(s.entropy == 0.0f);
        assert_int_equal(summary_logits_ref(w, 2, &s, NULL, 0), 0);
        assert_int_equal(s.top1, 1);
        assert_true(isfinite(s.margin) && s.margin >= 0);
        assert_true(s.entropy >= 0 && s.entropy <= 1);
}

int main(void) {
        const struct CMUnitTest tests[] = {
                cmocka_unit_test(attn_matches_double_oracle_for_f32),
                cmocka_unit_test(attn_matches_double_oracle_for_f16_and_bf16),
                cmocka_unit_test(attn_applies_ema_gamma_at_its_extremes),
                cmocka_unit_test(attn_accumulates_scores_over_calls),
                cmocka_unit_test(attn_leaves_side_arrays_alone_without_update_scores),
                cmocka_unit_test(attn_masks_a_token_with_minus_inf_logweight),
                cmocka_unit_test(attn_masks_shared_slots_with_the_bitmap_and_writes_none),
                cmocka_unit_test(attn_gives_zeros_when_every_token_is_masked),
                cmocka_unit_test(attn_rejects_bad_arguments),
                cmocka_unit_test(summary_matches_double_oracle),
                cmocka_unit_test(summary_handles_ties),
                cmocka_unit_test(summary_rejects_bad_input),
                cmocka_unit_test(summary_of_one_huge_logit_has_no_entropy),
                cmocka_unit_test(summary_of_equal_logits_has_entropy_one_and_no_margin),
                cmocka_unit_test(summary_margin_stays_finite_for_extreme_logits),
        };
        return cmocka_run_group_tests(tests, NULL, NULL);
}
