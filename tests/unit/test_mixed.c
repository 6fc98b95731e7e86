/* test_mixed.c - unit tests of kernels/mixed.c: compaction, quantization and decode attention over
 * a layer whose older tokens are INT8 and whose recent ones are full precision.
 *
 * Owns: compact_mixed and mixed_advance_q8 against an out-of-place oracle, and attn_decode_mixed
 * against a double-precision oracle, attn_decode_ref and an FP32 reference.
 *
 * The compaction oracle reads the whole layer as floats before the call (INT8 slots dequantized
 * with their own block's scales), applies the keep-set to that float sequence, and recomputes
 * every destination INT8 block's key scales from exactly the tokens the block will hold. After
 * the call: side arrays equal their source's exactly; full-precision slots equal their source's
 * bits; INT8 keys are within (1/2 + 254 * 2^-24) of the oracle's fresh scale of their block and
 * channel (so an outlier moved into a block of small values must make the scale grow: clipping
 * would break the bound), and the stored scales are the oracle's within four ulps; INT8 values
 * that were INT8 keep their codes and scale exactly, quantized ones are within half their fresh
 * per-token scale. Blocks past the new layout are untouched. Blocks are separate allocations,
 * filled with random bytes and shuffled, as in test_compact.c, and the keep-sets are the ones
 * that expose an in-place gather that reads a slot after overwriting it.
 *
 * Attention tolerances are those of test_kernels.c: |got - want| <= 1e-5 * sum_j a_j |v_j|, the
 * score arrays 1e-5 relative. INT8 against FP32: 1e-2 of sum_j a_j |v_j| of the FP32 reference.
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
#include "testblocks.h"

#include "attention.h"
#include "block.h"
#include "mixed.h"
#include "quant.h"

#define ROUND_TRIP_SLACK (0.5 + 254.0 / 16777216.0)
#define MAX_D            256

static float rng_uniform(float lo, float hi) {
        return lo + (hi - lo) * (float)((double)(rng_next() >> 11) / 9007199254740992.0);
}

/* ---- a mixed layer in separately allocated, shuffled blocks ---- */

enum make_flags {
        MAKE_LOGW_RANDOM = 1,  /* log-weights in [-3, 0], else 0 */
        MAKE_KEY_OUTLIERS = 2, /* every 7th key channel 30 times larger */
};

struct tmix {
        struct block_layout lf, lq;
        struct mixed_layer M;
        uint8_t **fp, **q8;
        uint8_t **fp_saved, **q8_saved;
        uint32_t n_fp, n_q8b;
        float *K0, *V0; /* [H][n][D]: the values before storage (rounding, quantization) */
};

static void blocks_free(uint8_t **b, uint32_t n) {
        for (uint32_t i = 0; i < n; i++)
                free(b[i]);
        free(b);
}

static uint8_t **blocks_copy(uint8_t **b, uint32_t n, uint64_t bytes) {
        uint8_t **c = calloc(n ? n : 1, sizeof(*c));
        assert_non_null(c);
        for (uint32_t i = 0; i < n; i++) {
                c[i] = malloc(bytes);
                assert_non_null(c[i]);
                memcpy(c[i], b[i], bytes);
        }
        return c;
}

static void side_offsets(const struct block_layout *l, uint64_t off[5]) {
        off[0] = l->pos_offset;
        off[1] = l->sum_offset;
        off[2] = l->ema_offset;
        off[3] = l->last_offset;
        off[4] = l->logw_offset;
}

/* Where (head, slot) of the logical sequence lives. */
static uint8_t *slot_block(const struct mixed_layer *M, uint32_t s, const struct block_layout **l,
                           uint32_t *in_block) {
        uint32_t T = M->q8->block_tokens;
        if (s < M->n_q8) {
                *l = M->q8;
                *in_block = s % T;
                return M->q8_blocks[s / T];
        }
        *l = M->fp;
        *in_block = (s - M->n_q8) % T;
        return M->fp_blocks[(s - M->n_q8) / T];
}

static float *side_of(const struct mixed_layer *M, int a, uint32_t h, uint32_t s) {
        const struct block_layout *l;
        uint32_t in;
        uint8_t *b = slot_block(M, s, &l, &in);
        uint64_t off[5];
        side_offsets(l, off);
        return block_side(l, b, off[a], h, in);
}

/* The key and value of (head, slot) as floats, and its five side words. */
static void read_slot(const struct mixed_layer *M, uint32_t h, uint32_t s, float *k, float *v,
                      uint32_t side[5]) {
        const struct block_layout *l;
        uint32_t in;
        uint8_t *b = slot_block(M, s, &l, &in);
        if (l->dtype == BLOCK_DTYPE_Q8) {
                quant_block_load_key(l, b, h, in, k);
                quant_block_load_value(l, b, h, in, v);
        } else {
                block_load_row(l->dtype, block_key(l, b, h, in), k, l->head_dim);
                block_load_row(l->dtype, block_value(l, b, h, in), v, l->head_dim);
        }
        for (int a = 0; a < 5; a++)
                memcpy(&side[a], side_of(M, a, h, s), 4);
}

/* A layer of n tokens, the first n_q8 INT8. The tables hold enough blocks for any new layout of
 * at most n tokens, plus garbage blocks; slots past the live ones hold random bytes. */
static void mix_make(struct tmix *t, uint32_t T, uint32_t H, uint32_t D, enum block_dtype dtype, uint32_t n,
                     uint32_t n_q8, int flags) {
        float k[64 * MAX_D], v[64 * MAX_D];
        assert_true(T <= 64 && D <= MAX_D && n_q8 <= n);
        memset(t, 0, sizeof(*t));
        assert_int_equal(block_layout_init(&t->lf, T, H, D, dtype), 0);
        assert_int_equal(block_layout_init(&t->lq, T, H, D, BLOCK_DTYPE_Q8), 0);
        t->n_q8b = (n + T - 1) / T + 1;
        t->n_fp = (n + T - 1) / T + 1;
        t->q8 = blocks_alloc(t->n_q8b, t->lq.block_bytes);
        t->fp = blocks_alloc(t->n_fp, t->lf.block_bytes);
        t->K0 = malloc((size_t)H * (n ? n : 1) * D * sizeof(float));
        t->V0 = malloc((size_t)H * (n ? n : 1) * D * sizeof(float));
        assert_true(t->K0 && t->V0);
        t->M = (struct mixed_layer){ .fp = &t->lf,
                                     .q8 = &t->lq,
                                     .fp_blocks = t->fp,
                                     .n_fp_blocks = t->n_fp,
                                     .q8_blocks = t->q8,
                                     .n_q8_blocks = t->n_q8b,
                                     .n_q8 = n_q8,
                                     .n_tokens = n };
        for (uint32_t h = 0; h < H; h++) {
                for (uint32_t s = 0; s < n; s++) {
                        float *k0 = t->K0 + ((size_t)h * n + s) * D, *v0 = t->V0 + ((size_t)h * n + s) * D;
                        for (uint32_t c = 0; c < D; c++) {
                                k0[c] = rng_uniform(-1, 1) *
                                        ((flags & MAKE_KEY_OUTLIERS) && c % 7 == 3 ? 30.0f : 1.0f);
                                v0[c] = rng_uniform(-1, 1);
                        }
                        if (s >= n_q8) {
                                const struct block_layout *l;
                                uint32_t in;
                                uint8_t *b = slot_block(&t->M, s, &l, &in);
                                block_store_row(dtype, k0, block_key(l, b, h, in), D);
                                block_store_row(dtype, v0, block_value(l, b, h, in), D);
                        }
                        int32_t pos = (int32_t)s;
                        float side[5] = { 0, rng_uniform(0, 2), rng_uniform(0, 1), rng_uniform(0, 1),
                                          (flags & MAKE_LOGW_RANDOM) ? rng_uniform(-3, 0) : 0.0f };
                        memcpy(&side[0], &pos, 4);
                        for (int a = 0; a < 5; a++)
                                memcpy(side_of(&t->M, a, h, s), &side[a], 4);
                }
                for (uint32_t b = 0; b * T < n_q8; b++) {
                        uint32_t cnt = n_q8 - b * T < T ? n_q8 - b * T : T;
                        for (uint32_t i = 0; i < cnt; i++) {
                                memcpy(k + (size_t)i * D, t->K0 + ((size_t)h * n + b * T + i) * D,
                                       D * sizeof(float));
                                memcpy(v + (size_t)i * D, t->V0 + ((size_t)h * n + b * T + i) * D,
                                       D * sizeof(float));
                        }
                        assert_int_equal(quant_block_fill_head(&t->lq, t->q8[b], h, k, v, cnt), 0);
                }
        }
        t->q8_saved = blocks_copy(t->q8, t->n_q8b, t->lq.block_bytes);
        t->fp_saved = blocks_copy(t->fp, t->n_fp, t->lf.block_bytes);
}

static void mix_done(struct tmix *t) {
        blocks_free(t->q8, t->n_q8b);
        blocks_free(t->fp, t->n_fp);
        blocks_free(t->q8_saved, t->n_q8b);
        blocks_free(t->fp_saved, t->n_fp);
        free(t->K0);
        free(t->V0);
}

static void mix_snapshot(struct tmix *t) {
        for (uint32_t b = 0; b < t->n_q8b; b++)
                memcpy(t->q8_saved[b], t->q8[b], t->lq.block_bytes);
        for (uint32_t b = 0; b < t->n_fp; b++)
                memcpy(t->fp_saved[b], t->fp[b], t->lf.block_bytes);
}

static void assert_mix_unchanged(const struct tmix *t, const char *what) {
        for (uint32_t b = 0; b < t->n_q8b; b++)
                if (memcmp(t->q8[b], t->q8_saved[b], t->lq.block_bytes))
                        fail_msg("%s: q8 block %u changed", what, b);
        for (uint32_t b = 0; b < t->n_fp; b++)
                if (memcmp(t->fp[b], t->fp_saved[b], t->lf.block_bytes))
                        fail_msg("%s: fp block %u changed", what, b);
}

/* ---- the compaction oracle ---- */

static uint32_t src_of(const uint32_t *keep, uint32_t kc, uint32_t base, uint32_t i) {
        return i < kc ? keep[i] : base + (i - kc);
}

static uint32_t kept_int8(const uint32_t *keep, uint32_t kc, uint32_t base, uint32_t n_q8) {
        uint32_t c = 0;
        for (uint32_t i = 0; i < kc; i++)
                c += keep[i] < n_q8;
        return c + (base < n_q8 ? n_q8 - base : 0);
}

static uint32_t max_kept_int8(const uint32_t *keep, uint32_t kc, int per_head, uint32_t H, uint32_t base,
                              uint32_t n_q8) {
        uint32_t m = 0;
        for (uint32_t h = 0; h < (per_head ? H : 1); h++) {
                uint32_t c = kept_int8(keep ? keep + (size_t)h * kc : NULL, kc, base, n_q8);
                m = c > m ? c : m;
        }
        return m;
}

static double ks_max_rel_err;

static void check_compaction(struct tmix *t, const uint32_t *keep, uint32_t kc, int per_head, uint32_t base,
                             uint32_t new_q8, const char *what) {
        struct mixed_layer *M = &t->M;
        uint32_t H = t->lq.n_kv_heads, D = t->lq.head_dim, T = t->lq.block_tokens, n = M->n_tokens;
        uint32_t old_q8 = M->n_q8, new_len = kc + (n - base);
        float *K = malloc((size_t)H * (n ? n : 1) * D * 4), *V = malloc((size_t)H * (n ? n : 1) * D * 4);
        uint32_t *S = malloc((size_t)H * (n ? n : 1) * 5 * 4);
        int8_t *VQ = malloc((size_t)H * (n ? n : 1) * D);
        float *VS = malloc((size_t)H * (n ? n : 1) * 4);
        float *scratch = malloc(compact_mixed_scratch_floats(M) * sizeof(float));
        float k[MAX_D], v[MAX_D], ks[MAX_D];
        uint32_t side[5];

        assert_true(K && V && S && VQ && VS && scratch);
        for (uint32_t h = 0; h < H; h++)
                for (uint32_t s = 0; s < n; s++) {
                        size_t at = (size_t)h * n + s;
                        read_slot(M, h, s, K + at * D, V + at * D, S + at * 5);
                        if (s < old_q8) {
                                uint8_t *b = M->q8_blocks[s / T];
                                memcpy(VQ + at * D, block_value(&t->lq, b, h, s % T), D);
                                VS[at] = *block_vscale(&t->lq, b, h, s % T);
                        }
                }
        mix_snapshot(t);

        uint32_t got_len = 0xdeadbeef;
        int r = compact_mixed(M, keep, kc, per_head, base, new_q8, scratch, &got_len);
        if (r != 0)
                fail_msg("%s: compact_mixed returned %d (n %u n_q8 %u base %u keep %u new_q8 %u)", what, r, n,
                         old_q8, base, kc, new_q8);
        assert_int_equal(got_len, new_len);
        M->n_q8 = new_q8;
        M->n_tokens = new_len;

        for (uint32_t h = 0; h < H; h++) {
                const uint32_t *kh = per_head ? keep + (size_t)h * kc : keep;
                for (uint32_t i = 0; i < new_len; i++) {
                        uint32_t s = src_of(kh, kc, base, i);
                        size_t at = (size_t)h * n + s;
                        read_slot(M, h, i, k, v, side);
                        if (memcmp(side, S + at * 5, sizeof(side)))
                                fail_msg("%s: side arrays of head %u new slot %u (old %u) differ", what, h, i,
                                         s);
                        if (i >= new_q8) {
                                assert_true(s >= old_q8);
                                if (memcmp(k, K + at * D, D * 4) || memcmp(v, V + at * D, D * 4))
                                        fail_msg("%s: fp slot %u of head %u differs from old slot %u", what,
                                                 i, h, s);
                                continue;
                        }
                        /* the oracle's fresh key scales of i's destination block */
                        uint32_t first = i / T * T, cnt = new_q8 - first < T ? new_q8 - first : T;
                        for (uint32_t c = 0; c < D; c++) {
                                float m = 0;
                                for (uint32_t u = first; u < first + cnt; u++)
                                        m = fmaxf(
                                                m,
                                                fabsf(K[((size_t)h * n + src_of(kh, kc, base, u)) * D + c]));
                                ks[c] = m / 127.0f;
                        }
                        uint8_t *db = M->q8_blocks[i / T];
                        const float *stored = block_kscale(&t->lq, db, h);
                        for (uint32_t c = 0; c < D; c++) {
                                double e = fabs((double)stored[c] - ks[c]);
                                if (!(e <= ks[c] * 0x1p-21))
                                        fail_msg("%s: key scale %u of head %u block %u is %.9g, oracle %.9g",
                                                 what, c, h, i / T, (double)stored[c], (double)ks[c]);
                                if (ks[c] > 0 && e / ks[c] > ks_max_rel_err)
                                        ks_max_rel_err = e / ks[c];
                                if (!(fabs((double)k[c] - K[at * D + c]) <= ks[c] * ROUND_TRIP_SLACK))
                                        fail_msg("%s: key %u of head %u new slot %u is %.9g, was %.9g (scale "
                                                 "%.9g)",
                                                 what, c, h, i, (double)k[c], (double)K[at * D + c],
                                                 (double)ks[c]);
                        }
                        float vs = *block_vscale(&t->lq, db, h, i % T);
                        if (s < old_q8) { /* INT8 values move exactly */
                                if (vs != VS[at] || memcmp(block_value(&t->lq, db, h, i % T), VQ + at * D, D))
                                        fail_msg("%s: INT8 value of old slot %u changed moving to %u", what,
                                                 s, i);
                        } else {
                                float want = quant_scale(V + at * D, D);
                                assert_true(vs == want);
                                for (uint32_t c = 0; c < D; c++)
                                        assert_true(fabs((double)v[c] - V[at * D + c]) <=
                                                    vs * ROUND_TRIP_SLACK);
                        }
                }
        }
        /* blocks past the new layout: untouched */
        for (uint32_t b = (new_q8 + T - 1) / T; b < t->n_q8b; b++)
                if (memcmp(t->q8[b], t->q8_saved[b], t->lq.block_bytes))
                        fail_msg("%s: q8 block %u past the new layout changed", what, b);
        for (uint32_t b = (new_len - new_q8 + T - 1) / T; b < t->n_fp; b++)
                if (memcmp(t->fp[b], t->fp_saved[b], t->lf.block_bytes))
                        fail_msg("%s: fp block %u past the new layout changed", what, b);
        free(K);
        free(V);
        free(S);
        free(VQ);
        free(VS);
        free(scratch);
}

static const enum block_dtype dtypes[] = { BLOCK_DTYPE_F32, BLOCK_DTYPE_F16, BLOCK_DTYPE_BF16 };

/* Runs a keep-set on fresh layers, per layer and per head (head 0 the given set, the other
 * heads random sets of the same size), each with new_q8 at its smallest, at the new length, in
 * between and (where allowed) at the old n_q8. */
static void run_case(uint32_t T, uint32_t H, uint32_t D, enum block_dtype dt, uint32_t n, uint32_t n_q8,
                     uint32_t base, const uint32_t *keep, uint32_t kc, const char *what) {
        uint32_t *kh = calloc((size_t)H * kc + 1, sizeof(*kh));
        assert_non_null(kh);
        for (uint32_t h = 0; h < H; h++) {
                if (h == 0) {
                        memcpy(kh, keep, kc * sizeof(*kh));
                        continue;
                }
                uint32_t need = kc, m = 0;
                for (uint32_t i = 0; i < base && need > 0; i++)
                        if (rng_below(base - i) < need) {
                                kh[(size_t)h * kc + m++] = i;
                                need--;
                        }
        }
        for (int per_head = 0; per_head < 2; per_head++) {
                const uint32_t *k = per_head ? kh : keep;
                uint32_t new_len = kc + n - base;
                uint32_t lo = max_kept_int8(k, kc, per_head, H, base, n_q8);
                uint32_t choices[4] = { lo, new_len, lo + rng_below(new_len - lo + 1), n_q8 };
                for (int c = 0; c < 4; c++) {
                        if (c == 3 && (n_q8 < lo || n_q8 > new_len))
                                continue;
                        struct tmix t;
                        char msg[160];
                        mix_make(&t, T, H, D, dt, n, n_q8, rng_below(2) ? MAKE_KEY_OUTLIERS : 0);
                        snprintf(msg, sizeof(msg),
                                 "%s (T=%u H=%u D=%u dtype %d n %u n_q8 %u base %u keep %u%s)", what, T, H, D,
                                 (int)dt, n, n_q8, base, kc, per_head ? " per head" : "");
                        check_compaction(&t, k, kc, per_head, base, choices[c], msg);
                        mix_done(&t);
                }
        }
        free(kh);
}

static uint32_t keep_shift_by_one(uint32_t base, uint32_t *keep) {
        for (uint32_t i = 1; i < base; i++)
                keep[i - 1] = i;
        return base ? base - 1 : 0;
}

static uint32_t keep_every_other(uint32_t base, uint32_t first, uint32_t *keep) {
        uint32_t n = 0;
        for (uint32_t i = first; i < base; i += 2)
                keep[n++] = i;
        return n;
}

static uint32_t keep_last(uint32_t base, uint32_t B, uint32_t *keep) {
        uint32_t n = 0;
        for (uint32_t i = base > B ? base - B : 0; i < base; i++)
                keep[n++] = i;
        return n;
}

static uint32_t keep_straddling(uint32_t base, uint32_t T, uint32_t run_len, uint32_t *keep) {
        uint32_t n = 0;
        for (uint32_t edge = T; edge < base + run_len; edge += T) {
                uint32_t from = edge >= run_len / 2 ? edge - run_len / 2 : 0;
                for (uint32_t i = from; i < from + run_len && i < base; i++)
                        if (n == 0 || i > keep[n - 1])
                                keep[n++] = i;
        }
        return n;
}

static uint32_t keep_random(uint32_t base, uint32_t per_mille, uint32_t *keep) {
        uint32_t n = 0;
        for (uint32_t i = 0; i < base; i++)
                if (rng_below(1000) < per_mille)
                        keep[n++] = i;
        return n;
}

static uint32_t keep_all(uint32_t base, uint32_t *keep) {
        for (uint32_t i = 0; i < base; i++)
                keep[i] = i;
        return base;
}

static void compact_mixed_matches_oracle_on_race_prone_keep_sets(void **state) {
        static const uint32_t Ts[] = { 1, 3, 4, 16 };
        static const uint32_t tails[] = { 0, 1, 5 };
        (void)state;
        rng_state = 0xc0ffee8;
        ks_max_rel_err = 0;
        for (size_t ti = 0; ti < sizeof(Ts) / sizeof(Ts[0]); ti++) {
                uint32_t T = Ts[ti];
                for (size_t ta = 0; ta < sizeof(tails) / sizeof(tails[0]); ta++) {
                        uint32_t base = 5 * T + 2, n = base + tails[ta];
                        uint32_t H = 1 + rng_below(3), D = 1 + rng_below(24);
                        enum block_dtype dt = dtypes[rng_below(3)];
                        /* the INT8 boundary inside a block, on a block edge, at either end */
                        const uint32_t q8s[] = { 0, 2 * T + 1, 3 * T, n };
                        uint32_t *keep = calloc(base + 1, sizeof(*keep));
                        uint32_t kc;
                        assert_non_null(keep);
                        for (size_t qi = 0; qi < 4; qi++) {
                                uint32_t q8 = q8s[qi];
                                kc = keep_shift_by_one(base, keep);
                                run_case(T, H, D, dt, n, q8, base, keep, kc, "every slot moves by one");
                                kc = keep_every_other(base, 0, keep);
                                run_case(T, H, D, dt, n, q8, base, keep, kc, "every other slot from 0");
                                kc = keep_every_other(base, 1, keep);
                                run_case(T, H, D, dt, n, q8, base, keep, kc, "every other slot from 1");
                                for (uint32_t run = 2; run <= T + 3; run += 1 + T / 2) {
                                        kc = keep_straddling(base, T, run, keep);
                                        run_case(T, H, D, dt, n, q8, base, keep, kc,
                                                 "runs straddle block edges");
                                }
                                kc = keep_last(base, T, keep);
                                run_case(T, H, D, dt, n, q8, base, keep, kc, "window shift, the last block");
                                kc = keep_last(base, 2 * T + 1, keep);
                                run_case(T, H, D, dt, n, q8, base, keep, kc, "window shift, the last 2T+1");
                                run_case(T, H, D, dt, n, q8, base, keep, 0, "keep nothing");
                                kc = keep_all(base, keep);
                                run_case(T, H, D, dt, n, q8, base, keep, kc, "keep everything");
                                keep[0] = 0;
                                run_case(T, H, D, dt, n, q8, base, keep, 1, "only the first");
                        }
                        free(keep);
                }
        }
        print_message("largest key scale error relative to the oracle's: %.3g\n", ks_max_rel_err);
}

static void compact_mixed_matches_oracle_on_random_geometries(void **state) {
        (void)state;
        rng_state = 0xabcdef02;
        for (int iter = 0; iter < 300; iter++) {
                uint32_t T = rng_below(3) == 0 ? 16 : 1 + rng_below(8);
                uint32_t H = 1 + rng_below(4), D = 1 + rng_below(40);
                enum block_dtype dt = dtypes[rng_below(3)];
                uint32_t n = rng_below(6 * T + 1);
                uint32_t base = n - rng_below(n < 2 * T ? n + 1 : 2 * T + 1);
                uint32_t n_q8 = rng_below(n + 1);
                uint32_t *keep = calloc(base + 1, sizeof(*keep));
                assert_non_null(keep);
                uint32_t kc = keep_random(base, rng_below(1001), keep);
                char what[64];
                snprintf(what, sizeof(what), "random case %d", iter);
                run_case(T, H, D, dt, n, n_q8, base, keep, kc, what);
                free(keep);
        }
}

/* Block 0 holds small keys; a token of block 1 has a key of 100 in channel 2. Keeping the first
 * three slots and that token packs it into block 0, whose scale of channel 2 must grow to hold it
 * (a copy of its bytes, or block 0's old scale, would clip it to about 0.01). The reverse, a small
 * token moving out of a block with an outlier, gets a finer scale. */
static void compact_mixed_requantizes_an_outlier_into_a_block_of_small_values(void **state) {
        enum { T = 4, D = 8 };
        struct tmix t;
        float k[T * D], v[T * D];
        (void)state;
        rng_state = 0x0d1;
        mix_make(&t, T, 1, D, BLOCK_DTYPE_F16, 12, 8, 0);
        for (uint32_t b = 0; b < 2; b++) {
                for (uint32_t i = 0; i < T * D; i++) {
                        k[i] = rng_uniform(-0.01f, 0.01f);
                        v[i] = rng_uniform(-1, 1);
                }
                if (b == 1)
                        k[1 * D + 2] = 100.0f; /* slot 5 */
                assert_int_equal(quant_block_fill_head(&t.lq, t.q8[b], 0, k, v, T), 0);
        }
        float before = block_kscale(&t.lq, t.q8[0], 0)[2];
        assert_true(before <= 0.01f / 127.0f);
        uint32_t keep[] = { 0, 1, 2, 5 };
        check_compaction(&t, keep, 4, 0, 8, 4, "outlier into small block");
        float after = block_kscale(&t.lq, t.q8[0], 0)[2];
        assert_true(after == 100.0f / 127.0f);
        float got[D];
        quant_block_load_key(&t.lq, t.q8[0], 0, 3, got);
        assert_true(fabsf(got[2] - 100.0f) <= after * 0.5f);
        mix_done(&t);

        /* the reverse: block 1 loses its outlier, and its small keys get their own fine scale */
        mix_make(&t, T, 1, D, BLOCK_DTYPE_F16, 12, 8, 0);
        for (uint32_t b = 0; b < 2; b++) {
                for (uint32_t i = 0; i < T * D; i++) {
                        k[i] = rng_uniform(-0.01f, 0.01f);
                        v[i] = rng_uniform(-1, 1);
                }
                if (b == 0)
                        k[0 * D + 2] = 100.0f; /* slot 0 */
                assert_int_equal(quant_block_fill_head(&t.lq, t.q8[b], 0, k, v, T), 0);
        }
        uint32_t keep2[] = { 1, 2, 3, 4 };
        check_compaction(&t, keep2, 4, 0, 8, 4, "outlier dropped");
        assert_true(block_kscale(&t.lq, t.q8[0], 0)[2] < 0.02f / 127.0f);
        mix_done(&t);
}

/* Tokens leaving the full-precision window: 40 f16 tokens, the boundary moved to 16, 32, then 37.
 * Blocks whose tokens did not change keep their bytes. */
static void mixed_advance_q8_quantizes_the_tokens_leaving_the_window(void **state) {
        enum { T = 16, H = 2, D = 32 };
        struct tmix t;
        (void)state;
        rng_state = 0xadu;
        mix_make(&t, T, H, D, BLOCK_DTYPE_F16, 40, 0, MAKE_KEY_OUTLIERS);
        const uint32_t steps[] = { 16, 32, 37, 37, 40 };
        for (size_t i = 0; i < sizeof(steps) / sizeof(steps[0]); i++) {
                uint8_t *q8b0 = malloc(t.lq.block_bytes);
                assert_non_null(q8b0);
                memcpy(q8b0, t.q8[0], t.lq.block_bytes);
                uint32_t old = t.M.n_q8, new_q8 = steps[i];
                /* the oracle of an advance: keep everything, nothing appended */
                uint32_t keep[40];
                for (uint32_t s = 0; s < 40; s++)
                        keep[s] = s;
                check_compaction(&t, keep, 40, 0, 40, new_q8, "advance");
                if (old >= T)
                        assert_memory_equal(q8b0, t.q8[0], t.lq.block_bytes);
                free(q8b0);
        }
        mix_done(&t);

        /* mixed_advance_q8 itself gives the same bytes as that identity compaction */
        for (uint32_t to = 0; to <= 40; to += 13) {
                struct tmix a, b;
                rng_state = 0x77 + to;
                mix_make(&a, T, H, D, BLOCK_DTYPE_BF16, 40, 5, 0);
                rng_state = 0x77 + to;
                mix_make(&b, T, H, D, BLOCK_DTYPE_BF16, 40, 5, 0);
                float *scratch = malloc(compact_mixed_scratch_floats(&a.M) * sizeof(float));
                uint32_t keep[40], n;
                assert_non_null(scratch);
                for (uint32_t s = 0; s < 40; s++)
                        keep[s] = s;
                int want = to < 5 ? -EINVAL : 0;
                assert_int_equal(mixed_advance_q8(&a.M, to, scratch), want);
                assert_int_equal(compact_mixed(&b.M, keep, 40, 0, 40, to, scratch, &n), want);
                for (uint32_t i = 0; i < a.n_q8b; i++)
                        assert_memory_equal(a.q8[i], b.q8[i], a.lq.block_bytes);
                for (uint32_t i = 0; i < a.n_fp; i++)
                        assert_memory_equal(a.fp[i], b.fp[i], a.lf.block_bytes);
                free(scratch);
                mix_done(&a);
                mix_done(&b);
        }
        struct tmix c;
        mix_make(&c, T, H, D, BLOCK_DTYPE_F32, 40, 5, 0);
        float *scratch = malloc(compact_mixed_scratch_floats(&c.M) * sizeof(float));
        assert_non_null(scratch);
        assert_int_equal(mixed_advance_q8(&c.M, 41, scratch), -EINVAL);
        assert_mix_unchanged(&c, "advance past the length");
        free(scratch);
        mix_done(&c);
}

/* Every refusal returns -EINVAL and changes nothing, the length included. */
static void compact_mixed_rejects_bad_input_and_changes_nothing(void **state) {
        enum { T = 4, H = 2, D = 8 };
        (void)state;
        rng_state = 0xbad;
        for (int c = 0; c < 16; c++) {
                struct tmix t;
                mix_make(&t, T, H, D, BLOCK_DTYPE_F16, 20, 10, 0);
                struct mixed_layer M = t.M;
                struct block_layout other;
                float *scratch = malloc(compact_mixed_scratch_floats(&M) * sizeof(float));
                uint32_t keep[2 * 20], kc = 6, base = 20, new_q8 = 10, per_head = 0, n = 12345;
                const uint32_t *kp = keep;
                const char *what = "";
                assert_non_null(scratch);
                /* a valid start: keep 0, 2, 4 (INT8) and 12, 14, 16 (fp), per head the same */
                for (uint32_t i = 0; i < 6; i++)
                        keep[i] = keep[6 + i] = i < 3 ? 2 * i : 12 + 2 * (i - 3);
                switch (c) {
                case 0:
                        what = "new_q8 below the kept INT8 count";
                        new_q8 = 2;
                        break;
                case 1:
                        what = "new_q8 below the kept INT8 count of head 1";
                        per_head = 1;
                        keep[6 + 3] = 7; /* head 1 keeps 4 INT8 tokens */
                        keep[6 + 4] = 13;
                        keep[6 + 5] = 15;
                        new_q8 = 3;
                        break;
                case 2:
                        what = "INT8 tail tokens not counted";
                        base = 8;
                        kc = 3;
                        new_q8 = 4;
                        break;
                case 3:
                        what = "new_q8 past the new length";
                        new_q8 = 7;
                        break;
                case 4:
                        what = "too few q8 blocks for new_q8";
                        M.n_q8_blocks = 3; /* holds the 10 INT8 tokens, not 13 */
                        for (uint32_t i = 0; i < 20; i++)
                                keep[i] = i;
                        kc = 20;
                        new_q8 = 13;
                        break;
                case 5:
                        what = "unsorted keep";
                        keep[1] = 5;
                        keep[2] = 4;
                        break;
                case 6:
                        what = "keep past base";
                        base = 16;
                        break;
                case 7:
                        what = "base past the length";
                        base = 21;
                        break;
                case 8:
                        what = "n_q8 past the length";
                        M.n_q8 = 21;
                        break;
                case 9:
                        what = "n_q8 past its blocks";
                        M.n_q8_blocks = 2;
                        break;
                case 10:
                        what = "fp part past its blocks";
                        M.n_fp_blocks = 2;
                        break;
                case 11:
                        what = "fp layout of dtype Q8";
                        M.fp = &t.lq;
                        break;
                case 12:
                        what = "layouts of different heads";
                        assert_int_equal(block_layout_init(&other, T, H + 1, D, BLOCK_DTYPE_F16), 0);
                        M.fp = &other;
                        break;
                case 13:
                        what = "q8 layout not Q8";
                        M.q8 = &t.lf;
                        break;
                case 14:
                        what = "no keep array";
                        kp = NULL;
                        break;
                case 15:
                        what = "duplicate in head 1";
                        per_head = 1;
                        keep[6 + 1] = 0;
                        break;
                }
                int r = compact_mixed(&M, kp, kc, (int)per_head, base, new_q8, scratch, &n);
                if (r != -EINVAL)
                        fail_msg("%s: compact_mixed returned %d", what, r);
                assert_int_equal(n, 12345);
                assert_mix_unchanged(&t, what);
                if (c == 0) { /* no scratch at all, with otherwise valid arguments */
                        assert_int_equal(compact_mixed(&M, kp, kc, 0, base, 10, NULL, &n), -EINVAL);
                        assert_mix_unchanged(&t, "no scratch");
                        /* and the same call with new_q8 at the kept INT8 count succeeds */
                        assert_int_equal(compact_mixed(&M, kp, kc, 0, base, 3, scratch, &n), 0);
                        assert_int_equal(n, 6);
                }
                free(scratch);
                mix_done(&t);
        }
}

/* ---- the attention oracle, over the layer as floats ---- */

struct oracle {
        double *out, *scale, *acc; /* [n_heads][D], [n_heads][D], [H][n] */
};

/* K, V: [H][n][D], logw [H][n]. */
static void oracle_run(const float *K, const float *V, const float *logw, uint32_t H, uint32_t n, uint32_t D,
                       const float *q, uint32_t n_heads, struct oracle *o) {
        uint32_t group = n_heads / H;
        double *s = calloc(n ? n : 1, sizeof(*s));
        assert_non_null(s);
        o->out = calloc((size_t)n_heads * D, sizeof(double));
        o->scale = calloc((size_t)n_heads * D, sizeof(double));
        o->acc = calloc((size_t)H * (n ? n : 1), sizeof(double));
        assert_true(o->out && o->scale && o->acc);
        for (uint32_t h = 0; h < n_heads; h++) {
                uint32_t g = h / group;
                double max = -INFINITY, sum = 0;
                for (uint32_t j = 0; j < n; j++) {
                        const float *k = K + ((size_t)g * n + j) * D;
                        double dot = 0;
                        for (uint32_t i = 0; i < D; i++)
                                dot += (double)q[(size_t)h * D + i] * k[i];
                        s[j] = dot / sqrt((double)D) + logw[(size_t)g * n + j];
                        max = s[j] > max ? s[j] : max;
                }
                if (max == -INFINITY)
                        continue;
                for (uint32_t j = 0; j < n; j++)
                        sum += exp(s[j] - max);
                for (uint32_t j = 0; j < n; j++) {
                        double a = exp(s[j] - max) / sum;
                        const float *v = V + ((size_t)g * n + j) * D;
                        for (uint32_t i = 0; i < D; i++) {
                                o->out[(size_t)h * D + i] += a * v[i];
                                o->scale[(size_t)h * D + i] += a * fabs(v[i]);
                        }
                        o->acc[(size_t)g * n + j] += a / group;
                }
        }
        free(s);
}

static void oracle_free(struct oracle *o) {
        free(o->out);
        free(o->scale);
        free(o->acc);
}

/* The layer as floats (INT8 dequantized) and its side arrays. */
static void mix_read_all(const struct mixed_layer *M, float *K, float *V, float *logw, float *sum,
                         float *ema) {
        uint32_t H = M->q8->n_kv_heads, D = M->q8->head_dim, n = M->n_tokens;
        uint32_t side[5];
        for (uint32_t h = 0; h < H; h++)
                for (uint32_t s = 0; s < n; s++) {
                        size_t at = (size_t)h * n + s;
                        read_slot(M, h, s, K + at * D, V + at * D, side);
                        memcpy(&sum[at], &side[1], 4);
                        memcpy(&ema[at], &side[2], 4);
                        memcpy(&logw[at], &side[4], 4);
                }
}

static float *random_q(uint32_t n_heads, uint32_t D, float amp) {
        float *q = malloc((size_t)n_heads * D * sizeof(*q));
        assert_non_null(q);
        for (size_t i = 0; i < (size_t)n_heads * D; i++)
                q[i] = rng_uniform(-amp, amp);
        return q;
}

static double attn_max_rel_err;

/* Runs attn_decode_mixed with score updates on t and checks it against the double oracle over the
 * dequantized layer as it was before the call. */
static void check_attention(struct tmix *t, uint32_t n_heads, float gamma, const float *q, const char *what) {
        const struct mixed_layer *M = &t->M;
        uint32_t H = t->lq.n_kv_heads, D = t->lq.head_dim, n = M->n_tokens;
        size_t hn = (size_t)H * n;
        float *K = malloc(hn * D * 4), *V = malloc(hn * D * 4), *lw = malloc(hn * 4), *sum0 = malloc(hn * 4),
              *ema0 = malloc(hn * 4);
        float *out = malloc((size_t)n_heads * D * sizeof(float));
        float *scratch = malloc(attn_mixed_scratch_floats(M, n_heads) * sizeof(float));
        struct oracle o;

        assert_true(K && V && lw && sum0 && ema0 && out && scratch);
        mix_read_all(M, K, V, lw, sum0, ema0);
        oracle_run(K, V, lw, H, n, D, q, n_heads, &o);
        mix_snapshot(t);
        memset(out, 0xff, (size_t)n_heads * D * sizeof(float));
        assert_int_equal(attn_decode_mixed(M, q, out, n_heads, gamma, 1, scratch), 0);

        for (size_t i = 0; i < (size_t)n_heads * D; i++) {
                double err = fabs((double)out[i] - o.out[i]);
                if (!(err <= 1e-5 * o.scale[i]))
                        fail_msg("%s: out[%zu] = %.9g, oracle %.9g (scale %.3g, T=%u H=%u heads=%u D=%u n=%u "
                                 "n_q8=%u)",
                                 what, i, (double)out[i], o.out[i], o.scale[i], t->lq.block_tokens, H,
                                 n_heads, D, n, M->n_q8);
                if (o.scale[i] > 0 && err / o.scale[i] > attn_max_rel_err)
                        attn_max_rel_err = err / o.scale[i];
        }
        for (uint32_t g = 0; g < H; g++) {
                double total = 0;
                int any = 0;
                for (uint32_t j = 0; j < n; j++) {
                        size_t at = (size_t)g * n + j;
                        double a = o.acc[at];
                        double want[3] = { sum0[at] + a, gamma * ema0[at] + (1 - gamma) * a, a };
                        float got[3] = { *side_of(M, 1, g, j), *side_of(M, 2, g, j), *side_of(M, 3, g, j) };
                        for (int k = 0; k < 3; k++)
                                if (!(fabs(got[k] - want[k]) <= 1e-5 * fabs(want[k]) + 1e-12))
                                        fail_msg("%s: score %d of head %u slot %u = %.9g, oracle %.9g (D=%u "
                                                 "n=%u n_q8=%u)",
                                                 what, k, g, j, (double)got[k], want[k], D, n, M->n_q8);
                        total += got[2];
                        any |= lw[at] != -INFINITY;
                }
                if (any && !(fabs(total - 1) <= 1e-5))
                        fail_msg("%s: attention of KV head %u sums to %.9g", what, g, total);
        }
        /* keys, values, scales, positions and log-weights are only read */
        for (uint32_t b = 0; b < t->n_q8b; b++) {
                assert_memory_equal(t->q8[b], t->q8_saved[b], t->lq.sum_offset);
                assert_memory_equal(t->q8[b] + t->lq.logw_offset, t->q8_saved[b] + t->lq.logw_offset,
                                    t->lq.block_bytes - t->lq.logw_offset);
        }
        for (uint32_t b = 0; b < t->n_fp; b++) {
                assert_memory_equal(t->fp[b], t->fp_saved[b], t->lf.sum_offset);
                assert_memory_equal(t->fp[b] + t->lf.logw_offset, t->fp_saved[b] + t->lf.logw_offset,
                                    t->lf.block_bytes - t->lf.logw_offset);
        }
        oracle_free(&o);
        free(K);
        free(V);
        free(lw);
        free(sum0);
        free(ema0);
        free(out);
        free(scratch);
}

static void attn_mixed_matches_double_oracle(void **state) {
        static const uint32_t gqa[][2] = { { 1, 1 }, { 4, 4 }, { 8, 2 }, { 8, 1 }, { 12, 3 }, { 32, 4 } };
        static const uint32_t dims[] = { 8, 64, 128 };
        static const uint32_t lens[] = { 1, 2, 15, 16, 17, 33, 100, 255, 300 };
        (void)state;
        rng_state = 0xa77e8;
        attn_max_rel_err = 0;
        for (size_t gi = 0; gi < sizeof(gqa) / sizeof(gqa[0]); gi++) {
                for (size_t di = 0; di < sizeof(dims) / sizeof(dims[0]); di++) {
                        for (size_t li = 0; li < sizeof(lens) / sizeof(lens[0]); li++) {
                                struct tmix t;
                                uint32_t T = li % 2 ? 16 : 7, n = lens[li];
                                /* the boundary anywhere: none, all, inside a block */
                                uint32_t n_q8 = li % 3 == 0 ? n : li % 3 == 1 ? rng_below(n + 1) : 0;
                                if (gi % 2)
                                        n_q8 = n - rng_below(n + 1);
                                mix_make(&t, T, gqa[gi][1], dims[di], dtypes[(gi + li) % 3], n, n_q8,
                                         (li % 3 ? MAKE_LOGW_RANDOM : 0) | (di % 2 ? MAKE_KEY_OUTLIERS : 0));
                                float *q = random_q(gqa[gi][0], dims[di], li % 4 ? 2.0f : 8.0f);
                                check_attention(&t, gqa[gi][0], 0.9f, q, "mixed");
                                free(q);
                                mix_done(&t);
                        }
                }
        }
        print_message("largest error relative to sum a|v|: %.3g\n", attn_max_rel_err);
}

/* Without INT8 tokens the mixed layer is a plain layer: attn_decode_ref on the same blocks gives
 * the same output and scores within 1e-5. */
static void attn_mixed_agrees_with_attn_decode_ref_without_int8(void **state) {
        (void)state;
        rng_state = 0x5eed;
        double worst = 0;
        for (int iter = 0; iter < 40; iter++) {
                uint32_t H = 1 + rng_below(4), group = 1 + rng_below(4),
                         D = iter % 2 ? 64 : 1 + rng_below(100);
                uint32_t n = 1 + rng_below(400), T = iter % 3 ? 16 : 1 + rng_below(9), nh = H * group;
                enum block_dtype dt = dtypes[iter % 3];
                struct tmix a, b;
                uint64_t seed = rng_next();
                rng_state = seed;
                mix_make(&a, T, H, D, dt, n, 0, MAKE_LOGW_RANDOM);
                rng_state = seed;
                mix_make(&b, T, H, D, dt, n, 0, MAKE_LOGW_RANDOM);
                float *q = random_q(nh, D, 4.0f);
                float *out_m = malloc((size_t)nh * D * 4), *out_r = malloc((size_t)nh * D * 4);
                float *sm = malloc(attn_mixed_scratch_floats(&a.M, nh) * 4), *sr = malloc(2 * (size_t)n * 4);
                size_t hn = (size_t)H * n;
                float *K = malloc(hn * D * 4), *V = malloc(hn * D * 4), *lw = malloc(hn * 4),
                      *s0 = malloc(hn * 4), *e0 = malloc(hn * 4);
                struct oracle o;
                assert_true(q && out_m && out_r && sm && sr && K && V && lw && s0 && e0);
                mix_read_all(&a.M, K, V, lw, s0, e0);
                oracle_run(K, V, lw, H, n, D, q, nh, &o);
                struct block_layer L = { .layout = &b.lf, .blocks = b.fp, .n_blocks = b.n_fp, .n_tokens = n };
                assert_int_equal(attn_decode_mixed(&a.M, q, out_m, nh, 0.8f, 1, sm), 0);
                assert_int_equal(attn_decode_ref(&L, q, out_r, nh, 0.8f, 1, sr), 0);
                for (size_t i = 0; i < (size_t)nh * D; i++) {
                        double e = fabs((double)out_m[i] - out_r[i]);
                        if (!(e <= 1e-5 * o.scale[i]))
                                fail_msg("iter %d: out[%zu] mixed %.9g, ref %.9g", iter, i, (double)out_m[i],
                                         (double)out_r[i]);
                        if (o.scale[i] > 0 && e / o.scale[i] > worst)
                                worst = e / o.scale[i];
                }
                for (uint32_t h = 0; h < H; h++)
                        for (uint32_t j = 0; j < n; j++)
                                for (int k = 1; k <= 3; k++) {
                                        float x = *side_of(&a.M, k, h, j), y = *side_of(&b.M, k, h, j);
                                        if (!(fabsf(x - y) <= 1e-5f * fabsf(y) + 1e-12f))
                                                fail_msg("iter %d: score %d of %u/%u mixed %.9g ref %.9g",
                                                         iter, k, h, j, (double)x, (double)y);
                                }
                oracle_free(&o);
                free(q);
                free(out_m);
                free(out_r);
                free(sm);
                free(sr);
                free(K);
                free(V);
                free(lw);
                free(s0);
                free(e0);
                mix_done(&a);
                mix_done(&b);
        }
        print_message("largest difference from attn_decode_ref relative to sum a|v|: %.3g\n", worst);
}

/* The largest error of INT8 attention against an FP32 layer of the same original keys and values,
 * over a few random layers of head dim D (all tokens INT8, or all but a recent window): relative to
 * sum_j a_j |v_jc| of the FP32 reference per element, or (normwise) to its largest over the head. */
static double int8_vs_fp32_error(uint32_t D, int flags, uint32_t reps, int normwise) {
        double worst = 0;
        for (uint32_t rep = 0; rep < reps; rep++) {
                uint32_t H = 2, nh = 8, n = 200 + rng_below(1800), T = 16;
                uint32_t n_q8 = rep % 2 ? n : n - rng_below(64);
                struct tmix t;
                mix_make(&t, T, H, D, BLOCK_DTYPE_F32, n, n_q8, flags);
                struct block_layout lf;
                assert_int_equal(block_layout_init(&lf, T, H, D, BLOCK_DTYPE_F32), 0);
                uint32_t nb = (n + T - 1) / T;
                uint8_t **fb = blocks_alloc(nb, lf.block_bytes);
                float *lw = malloc((size_t)H * n * 4);
                assert_non_null(lw);
                for (uint32_t h = 0; h < H; h++)
                        for (uint32_t s = 0; s < n; s++) {
                                uint8_t *b = fb[s / T];
                                memcpy(block_key(&lf, b, h, s % T), t.K0 + ((size_t)h * n + s) * D, D * 4);
                                memcpy(block_value(&lf, b, h, s % T), t.V0 + ((size_t)h * n + s) * D, D * 4);
                                lw[(size_t)h * n + s] = *side_of(&t.M, 4, h, s);
                                memcpy(block_side(&lf, b, lf.logw_offset, h, s % T), &lw[(size_t)h * n + s],
                                       4);
                        }
                struct block_layer L = { .layout = &lf, .blocks = fb, .n_blocks = nb, .n_tokens = n };
                float *q = random_q(nh, D, 2.0f);
                float *out8 = malloc((size_t)nh * D * 4), *out32 = malloc((size_t)nh * D * 4);
                float *sm = malloc(attn_mixed_scratch_floats(&t.M, nh) * 4), *sr = malloc(2 * (size_t)n * 4);
                struct oracle o;
                assert_true(q && out8 && out32 && sm && sr);
                oracle_run(t.K0, t.V0, lw, H, n, D, q, nh, &o);
                assert_int_equal(attn_decode_mixed(&t.M, q, out8, nh, 0.9f, 0, sm), 0);
                assert_int_equal(attn_decode_ref(&L, q, out32, nh, 0.9f, 0, sr), 0);
                for (uint32_t h = 0; h < nh; h++) {
                        double norm = 0;
                        for (uint32_t c = 0; c < D; c++)
                                norm = fmax(norm, o.scale[(size_t)h * D + c]);
                        for (uint32_t c = 0; c < D; c++) {
                                size_t i = (size_t)h * D + c;
                                double e = fabs((double)out8[i] - out32[i]) / (normwise ? norm : o.scale[i]);
                                assert_false(isnan(out8[i]));
                                worst = e > worst ? e : worst;
                        }
                }
                oracle_free(&o);
                blocks_free(fb, nb);
                free(q);
                free(out8);
                free(out32);
                free(sm);
                free(sr);
                free(lw);
                mix_done(&t);
        }
        return worst;
}

/* The bound: on random data (keys and values uniform in [-1, 1], queries in [-2, 2]) INT8
 * attention is within 1e-2 of FP32, head dims 64 and 128. */
static void attn_int8_stays_within_1e_2_of_the_fp32_reference(void **state) {
        (void)state;
        rng_state = 0x1e2;
        for (uint32_t D = 64; D <= 128; D *= 2) {
                double e = int8_vs_fp32_error(D, 0, 4, 0);
                double w = int8_vs_fp32_error(D, MAKE_LOGW_RANDOM, 4, 0);
                e = w > e ? w : e;
                print_message("D=%u: largest INT8 error relative to sum a|v|: %.3g\n", D, e);
                assert_true(e <= 1e-2);
        }
}

/* With outlier key channels (every 7th channel 30 times larger) per-channel scales keep the small
 * channels precise, but the logits are larger and the softmax sharper: a few tokens dominate, so
 * the quantization error no longer averages out, and an output element can be far smaller than
 * its value row's INT8 step (per-token scale). Measured per head, relative to the largest
 * sum_j a_j |v_jc| of the head (2.5e-2 and 3.4e-2), with a bound that documents it rather than the
 * issue's, which is about random data. */
static void attn_int8_with_outlier_keys_stays_within_5e_2(void **state) {
        (void)state;
        rng_state = 0x1e3;
        for (uint32_t D = 64; D <= 128; D *= 2) {
                double e = int8_vs_fp32_error(D, MAKE_KEY_OUTLIERS, 6, 1);
                print_message("D=%u, outlier keys: largest INT8 error relative to max_c sum a|v_c|: %.3g\n",
                              D, e);
                assert_true(e <= 5e-2);
        }
}

/* Masked tokens, INT8 and fp, get exactly zero attention and add nothing; every token masked
 * gives zero output, zero attention, and no NaN. */
static void attn_mixed_masks_tokens_and_gives_zeros_when_all_are_masked(void **state) {
        enum { T = 16, H = 2, D = 16, N = 70, NH = 8 };
        (void)state;
        rng_state = 0xdead8;
        for (int all = 0; all < 2; all++) {
                struct tmix t;
                mix_make(&t, T, H, D, BLOCK_DTYPE_F16, N, 37, MAKE_LOGW_RANDOM);
                for (uint32_t h = 0; h < H; h++)
                        for (uint32_t s = 0; s < N; s++)
                                if (all || s % 5 == 0 || (s >= 16 && s < 32))
                                        *side_of(&t.M, 4, h, s) = -INFINITY;
                float *q = random_q(NH, D, 2.0f);
                float sum0[H][N], ema0[H][N];
                for (uint32_t h = 0; h < H; h++)
                        for (uint32_t s = 0; s < N; s++) {
                                sum0[h][s] = *side_of(&t.M, 1, h, s);
                                ema0[h][s] = *side_of(&t.M, 2, h, s);
                        }
                check_attention(&t, NH, 0.5f, q, all ? "all masked" : "some masked");
                float out[NH * D], *scratch = malloc(attn_mixed_scratch_floats(&t.M, NH) * 4);
                assert_non_null(scratch);
                for (uint32_t h = 0; h < H; h++)
                        for (uint32_t s = 0; s < N; s++)
                                if (*side_of(&t.M, 4, h, s) == -INFINITY) {
                                        assert_true(*side_of(&t.M, 3, h, s) == 0.0f);
                                        assert_true(*side_of(&t.M, 1, h, s) == sum0[h][s]);
                                        assert_true(*side_of(&t.M, 2, h, s) == 0.5f * ema0[h][s]);
                                }
                memset(out, 0xff, sizeof(out));
                assert_int_equal(attn_decode_mixed(&t.M, q, out, NH, 0.5f, 0, scratch), 0);
                for (int i = 0; i < NH * D; i++)
                        assert_true(all ? out[i] == 0.0f : isfinite(out[i]));
                free(scratch);
                free(q);
                mix_done(&t);
        }
}

/* Logits far beyond exp's range, and products that overflow to infinity: finite output, the
 * weights of each KV head still sum to one. */
static void attn_mixed_never_gives_nan_for_huge_logits(void **state) {
        static const float amps[] = { 1e3f, 1e10f, 1e30f, 3e38f };
        enum { T = 16, H = 2, D = 64, N = 50, NH = 4 };
        (void)state;
        rng_state = 0x4a4;
        for (size_t ai = 0; ai < sizeof(amps) / sizeof(amps[0]); ai++) {
                struct tmix t;
                mix_make(&t, T, H, D, BLOCK_DTYPE_F32, N, 30, MAKE_LOGW_RANDOM | MAKE_KEY_OUTLIERS);
                float *q = random_q(NH, D, amps[ai]);
                float out[NH * D], *scratch = malloc(attn_mixed_scratch_floats(&t.M, NH) * 4);
                assert_non_null(scratch);
                assert_int_equal(attn_decode_mixed(&t.M, q, out, NH, 0.5f, 1, scratch), 0);
                for (int i = 0; i < NH * D; i++)
                        if (!isfinite(out[i]) || fabsf(out[i]) > 1.0001f)
                                fail_msg("amplitude %g: out[%d] = %g", (double)amps[ai], i, (double)out[i]);
                for (uint32_t h = 0; h < H; h++) {
                        double total = 0;
                        for (uint32_t s = 0; s < N; s++) {
                                float a = *side_of(&t.M, 3, h, s);
                                assert_true(isfinite(a) && a >= 0 && a <= 1.0f + 1e-6f);
                                assert_true(isfinite(*side_of(&t.M, 1, h, s)) &&
                                            isfinite(*side_of(&t.M, 2, h, s)));
                                total += a;
                        }
                        assert_true(fabs(total - 1) <= 1e-5);
                }
                free(scratch);
                free(q);
                mix_done(&t);
        }
}

static void attn_mixed_leaves_side_arrays_alone_without_update_scores(void **state) {
        struct tmix t;
        (void)state;
        rng_state = 0x51de;
        mix_make(&t, 16, 2, 32, BLOCK_DTYPE_BF16, 90, 41, MAKE_LOGW_RANDOM);
        float *q = random_q(4, 32, 2.0f), out[4 * 32];
        float *scratch = malloc(attn_mixed_scratch_floats(&t.M, 4) * 4);
        assert_non_null(scratch);
        mix_snapshot(&t);
        assert_int_equal(attn_decode_mixed(&t.M, q, out, 4, 0.9f, 0, scratch), 0);
        assert_mix_unchanged(&t, "read-only attention");
        free(scratch);
        free(q);
        mix_done(&t);
}

static void attn_mixed_rejects_bad_arguments(void **state) {
        struct tmix t;
        float q[4 * 8] = { 0 }, out[4 * 8], scratch[4096];
        (void)state;
        rng_state = 2;
        mix_make(&t, 4, 2, 8, BLOCK_DTYPE_F32, 20, 9, 0);
        struct mixed_layer M = t.M;
        assert_int_equal(attn_decode_mixed(&M, q, out, 0, 0.9f, 1, scratch), -EINVAL);
        assert_int_equal(attn_decode_mixed(&M, q, out, 3, 0.9f, 1, scratch), -EINVAL);
        assert_int_equal(attn_decode_mixed(&M, q, out, 4, 0.9f, 1, NULL), -EINVAL);
        assert_int_equal(attn_mixed_scratch_floats(&M, 3), 0);
        M.n_tokens = 0;
        M.n_q8 = 0;
        assert_int_equal(attn_decode_mixed(&M, q, out, 4, 0.9f, 1, scratch), -EINVAL);
        M = t.M;
        M.n_q8 = 21;
        assert_int_equal(attn_decode_mixed(&M, q, out, 4, 0.9f, 1, scratch), -EINVAL);
        M = t.M;
        M.n_q8_blocks = 2; /* 9 INT8 tokens need 3 blocks of 4 */
        assert_int_equal(attn_decode_mixed(&M, q, out, 4, 0.9f, 1, scratch), -EINVAL);
        M = t.M;
        M.q8 = &t.lf;
        assert_int_equal(attn_decode_mixed(&M, q, out, 4, 0.9f, 1, scratch), -EINVAL);
        assert_mix_unchanged(&t, "refused attention");
        mix_done(&t);

        struct block_layout wide, wide8;
        uint8_t *blk[1] = { NULL };
        assert_int_equal(block_layout_init(&wide, 1, 1, ATTN_MAX_HEAD_DIM + 1, BLOCK_DTYPE_F32), 0);
        assert_int_equal(block_layout_init(&wide8, 1, 1, ATTN_MAX_HEAD_DIM + 1, BLOCK_DTYPE_Q8), 0);
        struct mixed_layer W = { .fp = &wide,
                                 .q8 = &wide8,
                                 .fp_blocks = blk,
                                 .n_fp_blocks = 1,
                                 .q8_blocks = blk,
                                 .n_q8_blocks = 1,
                                 .n_q8 = 0,
                                 .n_tokens = 1 };
        assert_int_equal(attn_decode_mixed(&W, q, out, 1, 0.9f, 1, scratch), -EINVAL);
}

int main(void) {
        const struct CMUnitTest tests[] = {
                cmocka_unit_test(compact_mixed_matches_oracle_on_race_prone_keep_sets),
                cmocka_unit_test(compact_mixed_matches_oracle_on_random_geometries),
                cmocka_unit_test(compact_mixed_requantizes_an_outlier_into_a_block_of_small_values),
                cmocka_unit_test(mixed_advance_q8_quantizes_the_tokens_leaving_the_window),
                cmocka_unit_test(compact_mixed_rejects_bad_input_and_changes_nothing),
                cmocka_unit_test(attn_mixed_matches_double_oracle),
                cmocka_unit_test(attn_mixed_agrees_with_attn_decode_ref_without_int8),
                cmocka_unit_test(attn_int8_stays_within_1e_2_of_the_fp32_reference),
                cmocka_unit_test(attn_int8_with_outlier_keys_stays_within_5e_2),
                cmocka_unit_test(attn_mixed_masks_tokens_and_gives_zeros_when_all_are_masked),
                cmocka_unit_test(attn_mixed_never_gives_nan_for_huge_logits),
                cmocka_unit_test(attn_mixed_leaves_side_arrays_alone_without_update_scores),
                cmocka_unit_test(attn_mixed_rejects_bad_arguments),
        };
        return cmocka_run_group_tests(tests, NULL, NULL);
}
