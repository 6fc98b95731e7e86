/* test_attn_fast.c: the fast decode attention kernel (attention.c: attn_decode_fast,
 * attn_decode_fast_mixed, attn_decode_rows) against the plain-loop references attn_decode_ref and
 * attn_decode_mixed, for both of its paths (ATTN_ISA_PLAIN, and ATTN_ISA_AVX2 where the CPU has
 * it), and the contiguous-rows entry against the blocks entry.
 *
 * Tolerances (the references and the kernel differ by summation order and the online softmax's
 * rescaling only): keys and values are uniform in [-1, 1], so sum_j a_j |v_j| <= 1 and an output
 * element may differ by ATTN_TOL = 2e-5 absolute; the score arrays (each a_j <= 1, sum averaged
 * over the group) by SCORE_TOL = 1e-5. Masks are exact: a masked token gets exactly zero. The
 * rows entry over a contiguous f32 cache equals the blocks entry over f32 blocks of 16 bit for
 * bit (what makes kvc-run through kvcd with --policy full print --local's text), and a prompt
 * chunk's rows at once (attn_prefill_*) equal one decode call per row bit for bit, scores included.
 */
#include <errno.h>
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "testutil.h"

#include "attention.h"
#include "block.h"
#include "mixed.h"

#define ATTN_TOL  2e-5f
#define SCORE_TOL 1e-5f

static float uni(float lo, float hi) {
        return lo + (hi - lo) * (float)((double)(rng_next() >> 11) / 9007199254740992.0);
}

/* fp blocks for n tokens (random keys, values, side arrays; every 7th log-weight -inf when
 * masked), and q8 blocks for up to n tokens, empty. */
struct layer {
        struct block_layout fp, q8;
        uint8_t **fb, **qb;
        uint32_t nb, n;
};

static void layer_make(struct layer *t, uint32_t T, uint32_t H, uint32_t D, enum block_dtype dt, uint32_t n,
                       int masked) {
        memset(t, 0, sizeof(*t));
        assert_int_equal(block_layout_init(&t->fp, T, H, D, dt), 0);
        assert_int_equal(block_layout_init(&t->q8, T, H, D, BLOCK_DTYPE_Q8), 0);
        t->n = n;
        t->nb = (n + T - 1) / T;
        t->fb = calloc(t->nb, sizeof(*t->fb));
        t->qb = calloc(t->nb, sizeof(*t->qb));
        assert_non_null(t->fb);
        assert_non_null(t->qb);
        float row[ATTN_MAX_HEAD_DIM];
        for (uint32_t b = 0; b < t->nb; b++) {
                t->fb[b] = aligned_alloc(64, t->fp.block_bytes);
                t->qb[b] = aligned_alloc(64, t->q8.block_bytes);
                memset(t->fb[b], 0xcd, t->fp.block_bytes);
                memset(t->qb[b], 0, t->q8.block_bytes);
        }
        for (uint32_t h = 0; h < H; h++)
                for (uint32_t s = 0; s < n; s++) {
                        uint8_t *b = t->fb[s / T];
                        for (uint32_t i = 0; i < D; i++)
                                row[i] = uni(-1, 1) * (i == 3 ? 8.0f : 1.0f); /* an outlier channel */
                        block_store_row(dt, row, block_key(&t->fp, b, h, s % T), D);
                        for (uint32_t i = 0; i < D; i++)
                                row[i] = uni(-1, 1);
                        block_store_row(dt, row, block_value(&t->fp, b, h, s % T), D);
                        *(int32_t *)block_side(&t->fp, b, t->fp.pos_offset, h, s % T) = (int32_t)s;
                        *(float *)block_side(&t->fp, b, t->fp.sum_offset, h, s % T) = uni(0, 2);
                        *(float *)block_side(&t->fp, b, t->fp.ema_offset, h, s % T) = uni(0, 1);
                        *(float *)block_side(&t->fp, b, t->fp.last_offset, h, s % T) = uni(0, 1);
                        *(float *)block_side(&t->fp, b, t->fp.logw_offset, h, s % T) =
                                masked && s % 7 == 3 ? -INFINITY : uni(-3, 0);
                }
}

static void layer_done(struct layer *t) {
        for (uint32_t b = 0; b < t->nb; b++) {
                free(t->fb[b]);
                free(t->qb[b]);
        }
        free(t->fb);
        free(t->qb);
}

/* A deep copy of the layer's blocks (the score arrays are updated in place). */
static void layer_copy(struct layer *dst, const struct layer *src) {
        *dst = *src;
        dst->fb = calloc(src->nb, sizeof(*dst->fb));
        dst->qb = calloc(src->nb, sizeof(*dst->qb));
        for (uint32_t b = 0; b < src->nb; b++) {
                dst->fb[b] = aligned_alloc(64, src->fp.block_bytes);
                dst->qb[b] = aligned_alloc(64, src->q8.block_bytes);
                memcpy(dst->fb[b], src->fb[b], src->fp.block_bytes);
                memcpy(dst->qb[b], src->qb[b], src->q8.block_bytes);
        }
}

static struct mixed_layer mixed_of(struct layer *t, uint32_t n_q8) {
        uint32_t T = t->fp.block_tokens;
        return (struct mixed_layer){ .fp = &t->fp,
                                     .q8 = &t->q8,
                                     .fp_blocks = t->fb,
                                     .n_fp_blocks = (t->n - n_q8 + T - 1) / T,
                                     .q8_blocks = t->qb,
                                     .n_q8_blocks = (n_q8 + T - 1) / T,
                                     .n_q8 = n_q8,
                                     .n_tokens = t->n };
}

static struct block_layer plain_of(struct layer *t) {
        return (struct block_layer){ .layout = &t->fp, .blocks = t->fb, .n_blocks = t->nb, .n_tokens = t->n };
}

static void assert_close(const float *a, const float *b, size_t n, float tol, const char *what) {
        for (size_t i = 0; i < n; i++) {
                if (a[i] == b[i])
                        continue;
                if (!(fabsf(a[i] - b[i]) <= tol))
                        fail_msg("%s[%zu]: %.9g against the reference's %.9g", what, i, (double)a[i],
                                 (double)b[i]);
        }
}

/* Every score array of the fp part (slots [n_q8, n)) and of the q8 part equals the other layer's
 * within SCORE_TOL, masked tokens' attention (last) exactly zero in both. */
static void assert_scores_close(const struct layer *a, const struct layer *b, uint32_t n_q8) {
        const struct block_layout *l[2] = { &a->q8, &a->fp };
        uint32_t T = a->fp.block_tokens;
        for (uint32_t part = 0; part < 2; part++) {
                uint32_t len = part ? a->n - n_q8 : n_q8;
                uint64_t offs[3] = { l[part]->sum_offset, l[part]->ema_offset, l[part]->last_offset };
                for (uint32_t h = 0; h < a->fp.n_kv_heads; h++)
                        for (uint32_t s = 0; s < len; s++)
                                for (int k = 0; k < 3; k++) {
                                        uint8_t *ba = part ? a->fb[s / T] : a->qb[s / T];
                                        uint8_t *bb = part ? b->fb[s / T] : b->qb[s / T];
                                        float x = *(float *)block_side(l[part], ba, offs[k], h, s % T);
                                        float y = *(float *)block_side(l[part], bb, offs[k], h, s % T);
                                        assert_close(&x, &y, 1, SCORE_TOL, "score");
                                }
        }
}

static const enum attn_isa isas[] = { ATTN_ISA_PLAIN, ATTN_ISA_AVX2 };

/* One case: plain layer (n_q8 0) or mixed, the fast kernel on both paths against the reference,
 * outputs and the score arrays. */
static void check_case(uint32_t T, uint32_t H, uint32_t group, uint32_t D, enum block_dtype dt, uint32_t n,
                       uint32_t n_q8, int masked) {
        uint32_t nh = H * group;
        struct layer ref;
        layer_make(&ref, T, H, D, dt, n, masked);
        struct mixed_layer probe = mixed_of(&ref, 0);
        size_t sf = attn_fast_scratch_floats(n, nh, H, D, T) + attn_mixed_scratch_floats(&probe, nh) +
                    compact_mixed_scratch_floats(&probe) + 2 * (size_t)n;
        float *scratch = malloc(sf * sizeof(float)), *q = malloc((size_t)nh * D * sizeof(float));
        float *want = malloc((size_t)nh * D * sizeof(float)), *got = malloc((size_t)nh * D * sizeof(float));
        assert_non_null(scratch);
        for (size_t i = 0; i < (size_t)nh * D; i++)
                q[i] = uni(-2, 2);
        if (n_q8) {
                struct mixed_layer M = mixed_of(&ref, 0);
                M.n_q8_blocks = (n_q8 + T - 1) / T;
                assert_int_equal(mixed_advance_q8(&M, n_q8, scratch), 0);
        }
        struct layer base;
        layer_copy(&base, &ref);
        struct mixed_layer Mr = mixed_of(&ref, n_q8);
        struct block_layer Lr = plain_of(&ref);
        if (n_q8)
                assert_int_equal(attn_decode_mixed(&Mr, q, want, nh, 0.75f, 1, scratch), 0);
        else
                assert_int_equal(attn_decode_ref(&Lr, q, want, nh, 0.75f, 1, scratch), 0);
        for (size_t k = 0; k < sizeof(isas) / sizeof(isas[0]); k++) {
                struct layer t;
                layer_copy(&t, &base);
                struct mixed_layer M = mixed_of(&t, n_q8);
                struct block_layer L = plain_of(&t);
                int r = n_q8 ? attn_decode_fast_mixed(&M, q, got, nh, 0.75f, 1, scratch, isas[k])
                             : attn_decode_fast(&L, q, got, nh, 0.75f, 1, scratch, isas[k]);
                if (r == -ENOTSUP && isas[k] == ATTN_ISA_AVX2) {
                        layer_done(&t);
                        continue; /* no AVX2 here, or head_dim % 8 */
                }
                assert_int_equal(r, 0);
                assert_close(got, want, (size_t)nh * D, ATTN_TOL, "out");
                assert_scores_close(&t, &ref, n_q8);
                for (uint32_t h = 0; masked && !n_q8 && h < H; h++) /* a masked token: exactly zero */
                        for (uint32_t j = 3; j < n; j += 7)
                                assert_true(*(float *)block_side(&t.fp, t.fb[j / T], t.fp.last_offset, h,
                                                                 j % T) == 0.0f);
                layer_done(&t);
        }
        layer_done(&base);
        layer_done(&ref);
        free(scratch);
        free(q);
        free(want);
        free(got);
}

static void fast_matches_the_reference_for_smollm2s_shape(void **state) {
        (void)state;
        rng_state = 17;
        static const enum block_dtype dts[] = { BLOCK_DTYPE_F32, BLOCK_DTYPE_F16, BLOCK_DTYPE_BF16 };
        static const uint32_t lens[] = { 1, 15, 16, 17, 100, 1030 };
        for (size_t d = 0; d < 3; d++)
                for (size_t i = 0; i < sizeof(lens) / sizeof(lens[0]); i++)
                        check_case(16, 3, 3, 64, dts[d], lens[i], 0, 1);
}

static void fast_matches_the_reference_for_other_groups_and_dims(void **state) {
        (void)state;
        rng_state = 18;
        check_case(16, 2, 1, 64, BLOCK_DTYPE_F16, 70, 0, 1);  /* no grouping */
        check_case(16, 1, 4, 128, BLOCK_DTYPE_F32, 90, 0, 0); /* 4 query heads: 3 + 1 */
        check_case(8, 2, 2, 24, BLOCK_DTYPE_BF16, 41, 0, 1);  /* blocks of 8 */
        check_case(16, 2, 3, 12, BLOCK_DTYPE_F32, 33, 0, 1);  /* head_dim % 8: plain path only */
}

static void fast_matches_attn_decode_mixed_with_int8_blocks(void **state) {
        (void)state;
        rng_state = 19;
        check_case(16, 3, 3, 64, BLOCK_DTYPE_F16, 1030, 1000, 1); /* a partial last INT8 block */
        check_case(16, 3, 3, 64, BLOCK_DTYPE_F32, 200, 32, 0);
        check_case(16, 3, 3, 64, BLOCK_DTYPE_BF16, 20, 20, 1); /* INT8 only */
        check_case(16, 1, 2, 24, BLOCK_DTYPE_F16, 50, 17, 1);
}

/* A shared prefix: masked slots get zero weight, no shared slot's scores change. */
static void fast_masks_shared_slots_and_leaves_their_scores(void **state) {
        (void)state;
        rng_state = 20;
        uint32_t H = 3, D = 64, n = 80, shared = 40, nh = 9;
        struct layer a, b;
        layer_make(&a, 16, H, D, BLOCK_DTYPE_F16, n, 0);
        layer_copy(&b, &a);
        uint8_t mask[3 * 8] = { 0 };
        for (uint32_t h = 0; h < H; h++)
                for (uint32_t j = h; j < shared; j += 5)
                        mask[h * 8 + j / 8] |= (uint8_t)(1u << (j % 8));
        float q[9 * 64], want[9 * 64], got[9 * 64];
        for (size_t i = 0; i < sizeof(q) / sizeof(q[0]); i++)
                q[i] = uni(-2, 2);
        size_t sf = attn_fast_scratch_floats(n, nh, H, D, 16) + 2 * n;
        float *scratch = malloc(sf * sizeof(float));
        struct block_layer La = plain_of(&a), Lb = plain_of(&b);
        La.n_shared = Lb.n_shared = shared;
        La.shared_mask = Lb.shared_mask = mask;
        La.mask_stride = Lb.mask_stride = 8;
        assert_int_equal(attn_decode_ref(&La, q, want, nh, 0.5f, 1, scratch), 0);
        for (size_t k = 0; k < 2; k++) {
                struct layer c;
                layer_copy(&c, &b);
                struct block_layer Lc = plain_of(&c);
                Lc.n_shared = shared;
                Lc.shared_mask = mask;
                Lc.mask_stride = 8;
                int r = attn_decode_fast(&Lc, q, got, nh, 0.5f, 1, scratch, isas[k]);
                if (r == -ENOTSUP) {
                        layer_done(&c);
                        continue;
                }
                assert_int_equal(r, 0);
                assert_close(got, want, sizeof(got) / sizeof(got[0]), ATTN_TOL, "out");
                for (uint32_t bl = 0; bl < shared / 16; bl++) /* shared blocks: side arrays as before */
                        assert_memory_equal(c.fb[bl] + c.fp.sum_offset, b.fb[bl] + c.fp.sum_offset,
                                            c.fp.block_bytes - c.fp.sum_offset);
                assert_scores_close(&c, &a, 0);
                layer_done(&c);
        }
        layer_done(&a);
        layer_done(&b);
        free(scratch);
}

static void fast_gives_zeros_when_every_token_is_masked(void **state) {
        (void)state;
        rng_state = 21;
        struct layer a;
        layer_make(&a, 16, 1, 64, BLOCK_DTYPE_F32, 20, 0);
        for (uint32_t s = 0; s < 20; s++)
                *(float *)block_side(&a.fp, a.fb[s / 16], a.fp.logw_offset, 0, s % 16) = -INFINITY;
        float q[2 * 64], out[2 * 64], zero[2 * 64] = { 0 };
        for (size_t i = 0; i < 128; i++)
                q[i] = uni(-1, 1);
        float *scratch = malloc(attn_fast_scratch_floats(20, 2, 1, 64, 16) * sizeof(float));
        struct block_layer L = plain_of(&a);
        for (size_t k = 0; k < 2; k++) {
                int r = attn_decode_fast(&L, q, out, 2, 0.9f, 1, scratch, isas[k]);
                if (r == -ENOTSUP)
                        continue;
                assert_int_equal(r, 0);
                assert_memory_equal(out, zero, sizeof(out));
                for (uint32_t s = 0; s < 20; s++)
                        assert_true(*(float *)block_side(&a.fp, a.fb[s / 16], a.fp.last_offset, 0, s % 16) ==
                                    0.0f);
        }
        free(scratch);
        layer_done(&a);
}

/* The contiguous cache (kvc-run --local) and f32 blocks of 16 (kvcd) give the same bits. */
static void rows_equal_f32_blocks_of_16_bit_for_bit(void **state) {
        (void)state;
        rng_state = 22;
        uint32_t H = 3, D = 64, nh = 9;
        static const uint32_t lens[] = { 1, 16, 33, 700 };
        for (size_t i = 0; i < sizeof(lens) / sizeof(lens[0]); i++) {
                uint32_t n = lens[i];
                struct layer a;
                layer_make(&a, ATTN_ROWS_TILE, H, D, BLOCK_DTYPE_F32, n, 0);
                for (uint32_t h = 0; h < H; h++) /* kvcd's fresh tokens carry log-weight 0 */
                        for (uint32_t s = 0; s < n; s++)
                                *(float *)block_side(&a.fp, a.fb[s / 16], a.fp.logw_offset, h, s % 16) = 0.0f;
                float *keys = malloc((size_t)n * H * D * sizeof(float)),
                      *vals = malloc((size_t)n * H * D * sizeof(float));
                for (uint32_t s = 0; s < n; s++)
                        for (uint32_t h = 0; h < H; h++) {
                                memcpy(keys + ((size_t)s * H + h) * D,
                                       block_key(&a.fp, a.fb[s / 16], h, s % 16), D * 4);
                                memcpy(vals + ((size_t)s * H + h) * D,
                                       block_value(&a.fp, a.fb[s / 16], h, s % 16), D * 4);
                        }
                float q[9 * 64], x[9 * 64], y[9 * 64];
                for (size_t j = 0; j < sizeof(q) / sizeof(q[0]); j++)
                        q[j] = uni(-3, 3);
                float *scratch = malloc(attn_fast_scratch_floats(n, nh, H, D, 16) * sizeof(float));
                struct block_layer L = plain_of(&a);
                for (size_t k = 0; k < 2; k++) {
                        int r = attn_decode_rows(keys, vals, (size_t)H * D, n, q, x, nh, H, D, scratch,
                                                 isas[k]);
                        if (r == -ENOTSUP)
                                continue;
                        assert_int_equal(r, 0);
                        assert_int_equal(attn_decode_fast(&L, q, y, nh, 0.9f, 1, scratch, isas[k]), 0);
                        assert_memory_equal(x, y, sizeof(x));
                }
                free(scratch);
                free(keys);
                free(vals);
                layer_done(&a);
        }
}

/* A layer's first n tokens (the others not there yet), as a plain or a mixed layer. */
static struct mixed_layer mixed_first(struct layer *t, uint32_t n_q8, uint32_t n) {
        struct mixed_layer M = mixed_of(t, n_q8);
        M.n_tokens = n;
        M.n_fp_blocks = (n - n_q8 + t->fp.block_tokens - 1) / t->fp.block_tokens;
        return M;
}

/* A prompt chunk's rows at once (attn_prefill_fast, _mixed, _rows) against one decode call per row
 * over the layer as it was when that row was appended: the same outputs and the same score arrays,
 * bit for bit, on both paths; chunks that cross row groups and block boundaries. */
static void prefill_equals_one_call_per_row(void **state) {
        (void)state;
        rng_state = 31;
        struct {
                enum block_dtype dt;
                uint32_t n, n_rows, n_q8;
                int masked;
        } cases[] = { { BLOCK_DTYPE_F16, 100, 19, 0, 0 },
                      { BLOCK_DTYPE_F32, 70, 70, 0, 1 },
                      { BLOCK_DTYPE_F16, 90, 17, 48, 0 },
                      { BLOCK_DTYPE_BF16, 9, 1, 0, 1 } };
        uint32_t T = 16, H = 3, D = 64, nh = 9, QD = nh * D;
        for (size_t c = 0; c < sizeof(cases) / sizeof(cases[0]); c++) {
                uint32_t n = cases[c].n, R = cases[c].n_rows, nq = cases[c].n_q8;
                struct layer base;
                layer_make(&base, T, H, D, cases[c].dt, n, cases[c].masked);
                size_t sf = attn_rows_scratch_floats(n, R, nh, H, D, T);
                struct mixed_layer probe = mixed_of(&base, 0);
                size_t qf = compact_mixed_scratch_floats(&probe) + 2 * (size_t)n;
                float *scratch = malloc((sf > qf ? sf : qf) * sizeof(float));
                float *q = malloc((size_t)R * QD * sizeof(float)),
                      *want = malloc((size_t)R * QD * sizeof(float)),
                      *got = malloc((size_t)R * QD * sizeof(float));
                assert_non_null(scratch);
                for (size_t i = 0; i < (size_t)R * QD; i++)
                        q[i] = uni(-2, 2);
                if (nq) {
                        struct mixed_layer M = mixed_of(&base, 0);
                        M.n_q8_blocks = (nq + T - 1) / T;
                        assert_int_equal(mixed_advance_q8(&M, nq, scratch), 0);
                }
                for (size_t k = 0; k < sizeof(isas) / sizeof(isas[0]); k++) {
                        struct layer a, b;
                        layer_copy(&a, &base);
                        layer_copy(&b, &base);
                        int r = 0;
                        for (uint32_t i = 0; i < R && r == 0; i++) {
                                struct mixed_layer M = mixed_first(&a, nq, n - R + i + 1);
                                r = attn_decode_fast_mixed(&M, q + (size_t)i * QD, want + (size_t)i * QD, nh,
                                                           0.75f, 1, scratch, isas[k]);
                        }
                        if (r == -ENOTSUP && isas[k] == ATTN_ISA_AVX2) {
                                layer_done(&a);
                                layer_done(&b);
                                continue;
                        }
                        assert_int_equal(r, 0);
                        struct mixed_layer M = mixed_of(&b, nq);
                        struct block_layer L = plain_of(&b);
                        r = nq ? attn_prefill_fast_mixed(&M, R, q, got, nh, 0.75f, 1, scratch, isas[k])
                               : attn_prefill_fast(&L, R, q, got, nh, 0.75f, 1, scratch, isas[k]);
                        assert_int_equal(r, 0);
                        assert_memory_equal(got, want, (size_t)R * QD * sizeof(float));
                        for (uint32_t blk = 0; blk < base.nb; blk++) { /* scores included */
                                assert_memory_equal(a.fb[blk], b.fb[blk], base.fp.block_bytes);
                                assert_memory_equal(a.qb[blk], b.qb[blk], base.q8.block_bytes);
                        }
                        layer_done(&a);
                        layer_done(&b);
                }
                free(scratch);
                free(q);
                free(want);
                free(got);
                layer_done(&base);
        }
}

/* The contiguous cache's chunk (kvc-run --local's prefill) against one attn_decode_rows per row. */
static void prefill_rows_equal_one_call_per_row(void **state) {
        (void)state;
        rng_state = 32;
        uint32_t H = 3, D = 64, nh = 9, QD = nh * D, n = 75, R = 41;
        float *keys = malloc((size_t)n * H * D * sizeof(float)),
              *vals = malloc((size_t)n * H * D * sizeof(float));
        float *q = malloc((size_t)R * QD * sizeof(float)), *want = malloc((size_t)R * QD * sizeof(float)),
              *got = malloc((size_t)R * QD * sizeof(float));
        for (size_t i = 0; i < (size_t)n * H * D; i++) {
                keys[i] = uni(-1, 1);
                vals[i] = uni(-1, 1);
        }
        for (size_t i = 0; i < (size_t)R * QD; i++)
                q[i] = uni(-2, 2);
        float *scratch = malloc(attn_rows_scratch_floats(n, R, nh, H, D, ATTN_ROWS_TILE) * sizeof(float));
        for (size_t k = 0; k < sizeof(isas) / sizeof(isas[0]); k++) {
                int r = 0;
                for (uint32_t i = 0; i < R && r == 0; i++)
                        r = attn_decode_rows(keys, vals, (size_t)H * D, n - R + i + 1, q + (size_t)i * QD,
                                             want + (size_t)i * QD, nh, H, D, scratch, isas[k]);
                if (r == -ENOTSUP)
                        continue;
                assert_int_equal(r, 0);
                assert_int_equal(attn_prefill_rows(keys, vals, (size_t)H * D, n, R, q, got, nh, H, D, scratch,
                                                   isas[k]),
                                 0);
                assert_memory_equal(got, want, (size_t)R * QD * sizeof(float));
        }
        /* a chunk longer than the layer, an empty one, INT8 slots among the rows */
        assert_int_equal(
                attn_prefill_rows(keys, vals, (size_t)H * D, 4, 5, q, got, nh, H, D, scratch, ATTN_ISA_BEST),
                -EINVAL);
        assert_int_equal(
                attn_prefill_rows(keys, vals, (size_t)H * D, 4, 0, q, got, nh, H, D, scratch, ATTN_ISA_BEST),
                -EINVAL);
        struct layer t;
        layer_make(&t, 16, H, D, BLOCK_DTYPE_F16, 40, 0);
        struct mixed_layer M = mixed_of(&t, 32);
        assert_int_equal(attn_prefill_fast_mixed(&M, 10, q, got, nh, 0.75f, 1, scratch, ATTN_ISA_BEST),
                         -EINVAL);
        layer_done(&t);
        free(scratch);
        free(keys);
        free(vals);
        free(q);
        free(want);
        free(got);
}

static void fast_rejects_bad_arguments(void **state) {
        (void)state;
        rng_state = 23;
        struct layer a;
        layer_make(&a, 16, 3, 64, BLOCK_DTYPE_F32, 20, 0);
        float q[9 * 64] = { 0 }, out[9 * 64];
        float *scratch = malloc(attn_fast_scratch_floats(20, 9, 3, 64, 16) * sizeof(float));
        struct block_layer L = plain_of(&a);
        assert_int_equal(attn_decode_fast(&L, q, out, 8, 0.9f, 1, scratch, ATTN_ISA_BEST),
                         -EINVAL); /* 8 % 3 */
        assert_int_equal(attn_decode_fast(&L, q, out, 0, 0.9f, 1, scratch, ATTN_ISA_BEST), -EINVAL);
        assert_int_equal(attn_decode_fast(&L, q, out, 9, 0.9f, 1, NULL, ATTN_ISA_BEST), -EINVAL);
        L.n_tokens = 0;
        assert_int_equal(attn_decode_fast(&L, q, out, 9, 0.9f, 1, scratch, ATTN_ISA_BEST), -EINVAL);
        L.n_tokens = 33; /* past its two blocks */
        assert_int_equal(attn_decode_fast(&L, q, out, 9, 0.9f, 1, scratch, ATTN_ISA_BEST), -EINVAL);
        L = plain_of(&a);
        L.n_shared = 4; /* no mask */
        assert_int_equal(attn_decode_fast(&L, q, out, 9, 0.9f, 1, scratch, ATTN_ISA_BEST), -EINVAL);
        L = plain_of(&a);
        L.layout = &a.q8;
        assert_int_equal(attn_decode_fast(&L, q, out, 9, 0.9f, 1, scratch, ATTN_ISA_BEST), -EINVAL);
        struct mixed_layer M = mixed_of(&a, 0);
        M.n_q8 = 5; /* no q8 blocks */
        assert_int_equal(attn_decode_fast_mixed(&M, q, out, 9, 0.9f, 1, scratch, ATTN_ISA_BEST), -EINVAL);
        float rows[4 * 64] = { 0 };
        assert_int_equal(attn_decode_rows(rows, rows, 10, 4, q, out, 9, 3, 64, scratch, ATTN_ISA_BEST),
                         -EINVAL);
        assert_int_equal(attn_fast_scratch_floats(10, 8, 3, 64, 16), 0u);
        /* head_dim 12 cannot take the AVX2 path */
        struct layer b;
        layer_make(&b, 16, 1, 12, BLOCK_DTYPE_F32, 4, 0);
        struct block_layer Lb = plain_of(&b);
        assert_int_equal(attn_decode_fast(&Lb, q, out, 1, 0.9f, 1, scratch, ATTN_ISA_AVX2), -ENOTSUP);
        layer_done(&b);
        free(scratch);
        layer_done(&a);
}

int main(void) {
        const struct CMUnitTest tests[] = {
                cmocka_unit_test(fast_matches_the_reference_for_smollm2s_shape),
                cmocka_unit_test(fast_matches_the_reference_for_other_groups_and_dims),
                cmocka_unit_test(fast_matches_attn_decode_mixed_with_int8_blocks),
                cmocka_unit_test(fast_masks_shared_slots_and_leaves_their_scores),
                cmocka_unit_test(fast_gives_zeros_when_every_token_is_masked),
                cmocka_unit_test(rows_equal_f32_blocks_of_16_bit_for_bit),
                cmocka_unit_test(prefill_equals_one_call_per_row),
                cmocka_unit_test(prefill_rows_equal_one_call_per_row),
                cmocka_unit_test(fast_rejects_bad_arguments),
        };
        return cmocka_run_group_tests(tests, NULL, NULL);
}
