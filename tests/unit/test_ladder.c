/* test_ladder.c - unit tests of kernels/ladder.c: a layer of several tiers, its compaction and
 * demotion, its attention and its reader.
 *
 * Owns: ladder_compact against a slow oracle that reads every token dequantized before the call
 * (random plans over every tier, per head and per layer, race-prone keep-sets, demotions without
 * eviction); the bits a ladder of {fp, q8} shares with the mixed layer it generalizes (compaction
 * and attention, byte for byte); ladder_attend against a double-precision oracle over the
 * dequantized tokens (the fused loops), and against the unquantized tokens within the tiers'
 * error (the quantizers); ladder_attend_rows against row-by-row calls; and every refusal, with
 * nothing changed.
 *
 * The compaction oracle. After the call, every new slot holds the token the plan says, identified
 * by its side words (equal, bit for bit, to its source's). A token that stays in a tier whose
 * rows carry their own scales (fp, q4, q3, q2) reads back bit for bit as before; one demoted into
 * q4-q2 reads back exactly what lloyd_encode_row gives for its rotated, dequantized old value (the
 * second rounding is the only one); q8 keys are within half a step of the destination block's
 * fresh scale per channel, q8 values that were q8 keep their bytes, and demoted values are within
 * half their fresh per-token step.
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
#include "ladder.h"
#include "lloyd.h"
#include "mixed.h"
#include "quant.h"
#include "tier.h"

#define MAX_D            128
#define ROUND_TRIP_SLACK (0.5 + 254.0 / 16777216.0)

static double rng_gauss(void) {
        double u = ((double)(rng_next() >> 11) + 0.5) / 9007199254740992.0;
        double v = (double)(rng_next() >> 11) / 9007199254740992.0;
        return sqrt(-2.0 * log(u)) * cos(6.283185307179586 * v);
}

static float rng_uniform(float lo, float hi) {
        return lo + (hi - lo) * (float)((double)(rng_next() >> 11) / 9007199254740992.0);
}

/* ---- a ladder in separately allocated, shuffled blocks ---- */

struct tlad {
        struct block_layout lay[LADDER_TIERS];
        struct ladder_layer M;
        uint8_t **blocks[LADDER_TIERS], **saved[LADDER_TIERS];
        float *signs;
        uint32_t H, D, T;
};

static uint32_t *side_word(const struct ladder_layer *M, int a, uint32_t h, uint32_t s) {
        uint32_t t, idx;
        ladder_locate(M, s, &t, &idx);
        const struct block_layout *l = M->layout[t];
        uint64_t off[5];
        block_side_offsets(l, off);
        return block_side(l, M->blocks[t][idx / l->block_tokens], off[a], h, idx % l->block_tokens);
}

/* A ladder of the given tiers holding n[t] tokens each, random keys (every 7th channel 30x when
 * outliers) and values, positions in logical order, random scores and log-weights in [-3, 0]
 * (logw 0 unless logw). Every table holds room for all tokens plus one block. */
static void lad_make(struct tlad *L, const enum block_dtype *dts, uint32_t n_tiers, uint32_t T, uint32_t H,
                     uint32_t D, const uint32_t *n, int outliers, int logw) {
        uint32_t total = 0;
        memset(L, 0, sizeof(*L));
        L->H = H;
        L->D = D;
        L->T = T;
        for (uint32_t t = 0; t < n_tiers; t++)
                total += n[t];
        L->signs = malloc((size_t)H * D * sizeof(float));
        for (uint32_t h = 0; h < H; h++)
                lloyd_signs(77, 5, h, D, L->signs + (size_t)h * D);
        L->M.n_tiers = n_tiers;
        L->M.signs = L->signs;
        for (uint32_t t = 0; t < n_tiers; t++) {
                assert_int_equal(block_layout_init(&L->lay[t], T, H, D, dts[t]), 0);
                L->M.layout[t] = &L->lay[t];
                L->M.n_blocks[t] = (total + T - 1) / T + 1;
                L->blocks[t] = blocks_alloc(L->M.n_blocks[t], L->lay[t].block_bytes);
                L->M.blocks[t] = L->blocks[t];
                L->M.n[t] = n[t];
        }
        assert_int_equal(ladder_check(&L->M), 0);
        float *k = malloc((size_t)T * D * sizeof(float)), *v = malloc((size_t)T * D * sizeof(float));
        for (uint32_t h = 0; h < H; h++)
                for (uint32_t t = 0; t < n_tiers; t++) {
                        const struct tier_row *row = tier_row(dts[t]);
                        for (uint32_t b = 0; b * T < n[t]; b++) {
                                uint32_t cnt = n[t] - b * T < T ? n[t] - b * T : T;
                                for (uint32_t i = 0; i < cnt * D; i++) {
                                        k[i] = (float)rng_gauss() *
                                               (outliers && i % D % 7 == 3 ? 30.0f : 1.0f);
                                        v[i] = (float)rng_gauss();
                                }
                                if (row->rotated)
                                        for (uint32_t i = 0; i < cnt; i++) {
                                                lloyd_rotate(L->signs + (size_t)h * D, k + (size_t)i * D, D);
                                                lloyd_rotate(L->signs + (size_t)h * D, v + (size_t)i * D, D);
                                        }
                                assert_int_equal(row->fill_head(&L->lay[t], L->blocks[t][b], h, k, v, cnt),
                                                 0);
                        }
                }
        free(k);
        free(v);
        for (uint32_t h = 0; h < H; h++)
                for (uint32_t s = 0; s < total; s++) {
                        int32_t pos = (int32_t)s;
                        float side[5] = { 0, rng_uniform(0, 2), rng_uniform(0, 1), rng_uniform(0, 1),
                                          logw ? rng_uniform(-3, 0) : 0.0f };
                        memcpy(&side[0], &pos, 4);
                        for (int a = 0; a < 5; a++)
                                memcpy(side_word(&L->M, a, h, s), &side[a], 4);
                }
}

static void lad_snapshot(struct tlad *L) {
        for (uint32_t t = 0; t < L->M.n_tiers; t++) {
                if (!L->saved[t])
                        L->saved[t] = calloc(L->M.n_blocks[t], sizeof(uint8_t *));
                for (uint32_t b = 0; b < L->M.n_blocks[t]; b++) {
                        if (!L->saved[t][b])
                                L->saved[t][b] = malloc(L->lay[t].block_bytes);
                        memcpy(L->saved[t][b], L->blocks[t][b], L->lay[t].block_bytes);
                }
        }
}

static void assert_lad_unchanged(const struct tlad *L, const char *what) {
        for (uint32_t t = 0; t < L->M.n_tiers; t++)
                for (uint32_t b = 0; b < L->M.n_blocks[t]; b++)
                        if (memcmp(L->saved[t][b], L->blocks[t][b], L->lay[t].block_bytes))
                                fail_msg("%s: tier %u block %u changed", what, t, b);
}

static void lad_done(struct tlad *L) {
        for (uint32_t t = 0; t < L->M.n_tiers; t++) {
                for (uint32_t b = 0; b < L->M.n_blocks[t]; b++) {
                        free(L->blocks[t][b]);
                        if (L->saved[t])
                                free(L->saved[t][b]);
                }
                free(L->blocks[t]);
                free(L->saved[t]);
        }
        free(L->signs);
}

/* ---- the compaction oracle ---- */

struct token {
        uint32_t tier;
        float k[MAX_D], v[MAX_D];   /* dequantized, unrotated */
        float kr[MAX_D], vr[MAX_D]; /* in the stored basis */
        uint32_t side[5];
};

static void read_token(const struct ladder_layer *M, uint32_t h, uint32_t s, struct token *tk) {
        uint32_t idx;
        ladder_locate(M, s, &tk->tier, &idx);
        const struct block_layout *l = M->layout[tk->tier];
        const struct tier_row *row = tier_row(l->dtype);
        uint8_t *b = M->blocks[tk->tier][idx / l->block_tokens];
        row->load_key(l, b, h, idx % l->block_tokens, tk->kr);
        row->load_value(l, b, h, idx % l->block_tokens, tk->vr);
        ladder_load(M, h, s, tk->k, tk->v);
        for (int a = 0; a < 5; a++)
                tk->side[a] = *side_word(M, a, h, s);
}

/* Runs the plan and checks the result against the oracle. tier may be NULL. */
static void check_compaction(struct tlad *L, const uint32_t *keep, const uint8_t *tier, uint32_t kc,
                             int per_head, uint32_t base) {
        struct ladder_layer *M = &L->M;
        uint32_t n = ladder_tokens(M), H = L->H, D = L->D, T = L->T;
        struct token *old = malloc((size_t)H * (n ? n : 1) * sizeof(*old));
        for (uint32_t h = 0; h < H; h++)
                for (uint32_t s = 0; s < n; s++)
                        read_token(M, h, s, &old[(size_t)h * n + s]);
        float *scratch = malloc(ladder_compact_scratch_floats(M) * sizeof(float));
        uint32_t got[LADDER_TIERS];
        assert_int_equal(ladder_compact(M, keep, tier, kc, per_head, base, scratch, got), 0);
        free(scratch);
        struct ladder_layer old_M = *M;
        for (uint32_t t = 0; t < M->n_tiers; t++)
                M->n[t] = got[t];
        uint32_t new_n = ladder_tokens(M);
        assert_int_equal(new_n, kc + n - base);

        struct token now;
        uint32_t *order = malloc((size_t)(new_n ? new_n : 1) * sizeof(*order));
        uint8_t *order_tier = malloc(new_n ? new_n : 1);
        for (uint32_t h = 0; h < H; h++) {
                const uint32_t *kh = keep ? keep + (per_head ? (size_t)h * kc : 0) : NULL;
                const uint8_t *th = tier ? tier + (per_head ? (size_t)h * kc : 0) : NULL;
                /* the expected sequence: tier by tier, lowest first, ascending old slots, the tail last */
                uint32_t j = 0;
                for (uint32_t t = M->n_tiers; t-- > 0;) {
                        for (uint32_t i = 0; i < kc; i++) {
                                uint32_t nt = th ? th[i] : old[(size_t)h * n + kh[i]].tier;
                                if (nt == t) {
                                        order_tier[j] = (uint8_t)t;
                                        order[j++] = kh[i];
                                }
                        }
                        if (t == 0)
                                for (uint32_t s = base; s < n; s++) {
                                        order_tier[j] = 0;
                                        order[j++] = s;
                                }
                }
                assert_int_equal(j, new_n);
                for (uint32_t s = 0; s < new_n; s++) {
                        const struct token *was = &old[(size_t)h * n + order[s]];
                        read_token(M, h, s, &now);
                        assert_int_equal(now.tier, order_tier[s]);
                        if (memcmp(now.side, was->side, sizeof(now.side)))
                                fail_msg("head %u slot %u: side words are not those of old slot %u", h, s,
                                         order[s]);
                        const struct tier_row *row = tier_row(M->layout[now.tier]->dtype);
                        if (!row->quantized || (row->rotated && now.tier == was->tier)) {
                                assert_memory_equal(now.kr, was->kr, D * sizeof(float));
                                assert_memory_equal(now.vr, was->vr, D * sizeof(float));
                        } else if (row->rotated) { /* demoted into a low tier: one more rounding, exactly */
                                float y[MAX_D], want[MAX_D], sc;
                                uint8_t codes[MAX_D];
                                uint32_t bits = block_dtype_bits(M->layout[now.tier]->dtype);
                                for (int kv = 0; kv < 2; kv++) {
                                        const float *src = kv ? was->v : was->k;
                                        if (tier_row(old_M.layout[was->tier]->dtype)->rotated)
                                                src = kv ? was->vr : was->kr;
                                        memcpy(y, src, D * sizeof(float));
                                        if (!tier_row(old_M.layout[was->tier]->dtype)->rotated)
                                                lloyd_rotate(L->signs + (size_t)h * D, y, D);
                                        lloyd_encode_row(y, D, bits, codes, &sc);
                                        lloyd_decode_row(codes, sc, D, bits, want);
                                        assert_memory_equal(kv ? now.vr : now.kr, want, D * sizeof(float));
                                }
                        } else { /* q8 */
                                float vs = 0;
                                for (uint32_t c = 0; c < D; c++)
                                        vs = fmaxf(vs, fabsf(was->v[c]));
                                vs /= 127.0f;
                                if (was->tier == now.tier)
                                        assert_memory_equal(now.v, was->v, D * sizeof(float));
                                else
                                        for (uint32_t c = 0; c < D; c++)
                                                assert_true(fabs((double)now.v[c] - was->v[c]) <=
                                                            vs * ROUND_TRIP_SLACK + 1e-30);
                        }
                }
                /* q8 keys: within half a step of their block's fresh per-channel scale */
                for (uint32_t t = 1; t < M->n_tiers; t++) {
                        if (M->layout[t]->dtype != BLOCK_DTYPE_Q8)
                                continue;
                        uint32_t first = 0;
                        for (uint32_t u = t + 1; u < M->n_tiers; u++)
                                first += M->n[u];
                        for (uint32_t b = 0; b * T < M->n[t]; b++) {
                                uint32_t cnt = M->n[t] - b * T < T ? M->n[t] - b * T : T;
                                for (uint32_t c = 0; c < D; c++) {
                                        float ks = 0;
                                        for (uint32_t e = 0; e < cnt; e++)
                                                ks = fmaxf(ks,
                                                           fabsf(old[(size_t)h * n + order[first + b * T + e]]
                                                                         .k[c]));
                                        ks /= 127.0f;
                                        for (uint32_t e = 0; e < cnt; e++) {
                                                read_token(M, h, first + b * T + e, &now);
                                                double w = old[(size_t)h * n + order[first + b * T + e]].k[c];
                                                if (!(fabs(now.k[c] - w) <= ks * ROUND_TRIP_SLACK + 1e-30))
                                                        fail_msg("q8 key off: head %u block %u channel %u: "
                                                                 "%g vs %g (scale %g)",
                                                                 h, b, c, (double)now.k[c], w, (double)ks);
                                        }
                                }
                        }
                }
        }
        free(order);
        free(order_tier);
        free(old);
}

static const enum block_dtype five[] = { BLOCK_DTYPE_F16, BLOCK_DTYPE_Q8, BLOCK_DTYPE_Q4, BLOCK_DTYPE_Q3,
                                         BLOCK_DTYPE_Q2 };

/* A random plan: keep_count of the base slots per head (the same count), each at its tier or a
 * lower one; the same number per tier on every head (a random permutation of one head's tiers
 * among its tokens would break the ascending tier order, so each head draws its keep-set and then
 * the tiers are dealt so that each tier gets the counts of head 0). */
static void random_plan(const struct tlad *L, uint32_t base, uint32_t kc, int per_head, uint32_t *keep,
                        uint8_t *tier) {
        uint32_t H = per_head ? L->H : 1;
        uint32_t want[LADDER_TIERS] = { 0 };
        for (uint32_t h = 0; h < H; h++) {
                uint32_t *kh = keep + (size_t)h * kc;
                uint8_t *th = tier + (size_t)h * kc;
                /* choose kc of [0, base) */
                uint32_t chosen = 0;
                for (uint32_t s = 0; s < base && chosen < kc; s++)
                        if (rng_below(base - s) < kc - chosen)
                                kh[chosen++] = s;
                assert_int_equal(chosen, kc);
                for (uint32_t i = 0; i < kc; i++) {
                        uint32_t ot, idx;
                        ladder_locate(&L->M, kh[i], &ot, &idx);
                        th[i] = (uint8_t)(ot + rng_below(L->M.n_tiers - ot));
                }
                if (h == 0) {
                        for (uint32_t i = 0; i < kc; i++)
                                want[th[i]]++;
                        continue;
                }
                /* make head h's counts equal head 0's: deal the tiers again, lowest tiers to the
                 * tokens that allow them (any token may go lower; old tiers bound from below) */
                uint32_t left[LADDER_TIERS];
                memcpy(left, want, sizeof(left));
                int ok = 1;
                for (uint32_t i = 0; i < kc && ok; i++) {
                        uint32_t ot, idx;
                        ladder_locate(&L->M, kh[i], &ot, &idx);
                        uint32_t t = L->M.n_tiers;
                        while (t-- > ot)
                                if (left[t]) {
                                        left[t]--;
                                        th[i] = (uint8_t)t;
                                        break;
                                }
                        if (th[i] != t || t < ot)
                                ok = 0;
                }
                if (!ok) /* head h's tokens cannot take head 0's tiers: use head 0's plan */
                        for (uint32_t i = 0; i < kc; i++) {
                                kh[i] = keep[i];
                                th[i] = tier[i];
                        }
        }
}

static void run_random_case(const enum block_dtype *dts, uint32_t n_tiers, uint32_t T, uint32_t H, uint32_t D,
                            int per_head) {
        uint32_t n[LADDER_TIERS] = { 0 }, total = 0;
        for (uint32_t t = 0; t < n_tiers; t++) {
                n[t] = rng_below(3 * T);
                total += n[t];
        }
        if (total == 0)
                n[0] = total = 1;
        struct tlad L;
        lad_make(&L, dts, n_tiers, T, H, D, n, 1, 1);
        uint32_t first0 = total - n[0];
        uint32_t base = first0 + rng_below(n[0] + 1);
        uint32_t kc = rng_below(base + 1);
        uint32_t *keep = malloc((size_t)H * (kc ? kc : 1) * sizeof(*keep));
        uint8_t *tier = malloc((size_t)H * (kc ? kc : 1));
        random_plan(&L, base, kc, per_head, keep, tier);
        check_compaction(&L, keep, tier, kc, per_head, base);
        free(keep);
        free(tier);
        lad_done(&L);
}

static void ladder_compact_matches_the_oracle_on_random_plans_over_every_tier(void **state) {
        (void)state;
        rng_state = 0x1add;
        for (int rep = 0; rep < 150; rep++) {
                uint32_t n_tiers = 1 + rng_below(5);
                enum block_dtype dts[LADDER_TIERS];
                /* a random subset of the lower tiers, in order */
                dts[0] = rep % 3 == 0 ? BLOCK_DTYPE_F32 : rep % 3 == 1 ? BLOCK_DTYPE_F16 : BLOCK_DTYPE_BF16;
                uint32_t m = 1;
                for (uint32_t i = 1; i < 5 && m < n_tiers; i++)
                        if (rng_below(5 - i) < n_tiers - m)
                                dts[m++] = five[i];
                n_tiers = m;
                uint32_t T = rep % 4 == 0 ? 4 : 16, H = 1 + rng_below(3), D = rep % 5 == 0 ? 128 : 64;
                run_random_case(dts, n_tiers, T, H, D, (int)rng_below(2));
        }
}

/* Demotion without eviction: every token kept, the oldest lowered tier by tier. */
static void ladder_demotes_without_evicting(void **state) {
        (void)state;
        rng_state = 31;
        uint32_t n[5] = { 70, 0, 0, 0, 0 };
        struct tlad L;
        lad_make(&L, five, 5, 16, 3, 64, n, 1, 0);
        uint32_t keep[70];
        uint8_t tier[70];
        for (uint32_t i = 0; i < 70; i++) {
                keep[i] = i;
                tier[i] = (uint8_t)(i < 10 ? 4 : i < 25 ? 3 : i < 40 ? 2 : i < 50 ? 1 : 0);
        }
        check_compaction(&L, keep, tier, 70, 0, 70);
        assert_int_equal(L.M.n[4], 10);
        assert_int_equal(L.M.n[3], 15);
        assert_int_equal(L.M.n[2], 15);
        assert_int_equal(L.M.n[1], 10);
        assert_int_equal(L.M.n[0], 20);
        /* and again, one step further: the q8 tokens to q4, keeping their order */
        for (uint32_t i = 0; i < 70; i++) {
                uint32_t t, idx;
                ladder_locate(&L.M, i, &t, &idx);
                tier[i] = (uint8_t)(t == 1 ? 2 : t);
        }
        check_compaction(&L, keep, tier, 70, 0, 70);
        assert_int_equal(L.M.n[2], 25);
        assert_int_equal(L.M.n[1], 0);
        lad_done(&L);
}

/* Keep-sets that expose an in-place gather reading a slot after overwriting it. */
static void ladder_compact_survives_race_prone_keep_sets(void **state) {
        (void)state;
        rng_state = 77;
        uint32_t n[5] = { 40, 20, 20, 20, 20 };
        for (int variant = 0; variant < 4; variant++) {
                struct tlad L;
                lad_make(&L, five, 5, 16, 2, 64, n, 1, 1);
                uint32_t total = ladder_tokens(&L.M), keep[160], kc = 0;
                uint8_t tier[160];
                for (uint32_t s = 0; s < total; s++) {
                        int take = variant == 0   ? s % 2 == 1
                                   : variant == 1 ? s % 16 != 0
                                   : variant == 2 ? s >= 17
                                                  : s % 3 != 2;
                        if (!take)
                                continue;
                        uint32_t t, idx;
                        ladder_locate(&L.M, s, &t, &idx);
                        keep[kc] = s;
                        tier[kc++] = (uint8_t)(t + (variant == 3 && t < 4 ? 1 : 0));
                }
                check_compaction(&L, keep, variant == 1 ? NULL : tier, kc, 0, total);
                lad_done(&L);
        }
}

/* A ladder of {fp, q8} is the mixed layer: the same plans give the same bytes. */
static void ladder_of_fp_and_q8_computes_the_mixed_layers_bits(void **state) {
        (void)state;
        rng_state = 4242;
        for (int rep = 0; rep < 60; rep++) {
                enum block_dtype fp = rep % 2 ? BLOCK_DTYPE_F16 : BLOCK_DTYPE_F32;
                enum block_dtype dts[2] = { fp, BLOCK_DTYPE_Q8 };
                uint32_t T = 16, H = 1 + rng_below(3), D = 64;
                uint32_t n[2] = { 1 + rng_below(60), rng_below(50) };
                struct tlad L;
                lad_make(&L, dts, 2, T, H, D, n, 1, 1);
                uint32_t total = n[0] + n[1];
                /* a copy as a mixed layer */
                uint8_t **fpb = malloc(L.M.n_blocks[0] * sizeof(*fpb)),
                        **q8b = malloc(L.M.n_blocks[1] * sizeof(*q8b));
                for (uint32_t b = 0; b < L.M.n_blocks[0]; b++) {
                        fpb[b] = malloc(L.lay[0].block_bytes);
                        memcpy(fpb[b], L.blocks[0][b], L.lay[0].block_bytes);
                }
                for (uint32_t b = 0; b < L.M.n_blocks[1]; b++) {
                        q8b[b] = malloc(L.lay[1].block_bytes);
                        memcpy(q8b[b], L.blocks[1][b], L.lay[1].block_bytes);
                }
                struct mixed_layer X = { .fp = &L.lay[0],
                                         .q8 = &L.lay[1],
                                         .fp_blocks = fpb,
                                         .n_fp_blocks = L.M.n_blocks[0],
                                         .q8_blocks = q8b,
                                         .n_q8_blocks = L.M.n_blocks[1],
                                         .n_q8 = n[1],
                                         .n_tokens = total };
                if (rep % 3 == 0) { /* attention */
                        uint32_t nh = H * (1 + rng_below(3));
                        float q[9 * 64], o1[9 * 64], o2[9 * 64];
                        for (uint32_t i = 0; i < nh * D; i++)
                                q[i] = (float)rng_gauss();
                        float *s1 = malloc(attn_mixed_scratch_floats(&X, nh) * sizeof(float));
                        float *s2 = malloc(ladder_attn_scratch_floats(&L.M, nh) * sizeof(float));
                        assert_int_equal(attn_decode_mixed(&X, q, o1, nh, 0.9f, 1, s1), 0);
                        assert_int_equal(ladder_attend(&L.M, q, o2, nh, 0.9f, 1, s2), 0);
                        assert_memory_equal(o1, o2, nh * D * sizeof(float));
                        free(s1);
                        free(s2);
                } else { /* a plan: keep some, the first new_q8 of them INT8 */
                        uint32_t base = n[1] + rng_below(n[0] + 1), kc = rng_below(base + 1), keep[128],
                                 c = 0;
                        for (uint32_t s = 0; s < base && c < kc; s++)
                                if (rng_below(base - s) < kc - c)
                                        keep[c++] = s;
                        uint32_t kept_q8 = 0;
                        while (kept_q8 < kc && keep[kept_q8] < n[1])
                                kept_q8++;
                        uint32_t new_q8 = kept_q8 + rng_below(kc - kept_q8 + 1);
                        uint8_t tier[128];
                        for (uint32_t i = 0; i < kc; i++)
                                tier[i] = i < new_q8;
                        float *s1 = malloc(compact_mixed_scratch_floats(&X) * sizeof(float));
                        float *s2 = malloc(ladder_compact_scratch_floats(&L.M) * sizeof(float));
                        uint32_t len, got[LADDER_TIERS];
                        assert_int_equal(compact_mixed(&X, keep, kc, 0, base, new_q8, s1, &len), 0);
                        assert_int_equal(ladder_compact(&L.M, keep, tier, kc, 0, base, s2, got), 0);
                        assert_int_equal(got[1], new_q8);
                        assert_int_equal(got[0] + got[1], len);
                        free(s1);
                        free(s2);
                }
                for (uint32_t b = 0; b < L.M.n_blocks[0]; b++) {
                        assert_memory_equal(fpb[b], L.blocks[0][b], L.lay[0].block_bytes);
                        free(fpb[b]);
                }
                for (uint32_t b = 0; b < L.M.n_blocks[1]; b++) {
                        assert_memory_equal(q8b[b], L.blocks[1][b], L.lay[1].block_bytes);
                        free(q8b[b]);
                }
                free(fpb);
                free(q8b);
                lad_done(&L);
        }
}

/* ---- attention ---- */

/* Double-precision attention over the given keys and values ([H][n][D]) and log-weights. */
static void oracle_attend(const float *K, const float *V, const float *logw, uint32_t H, uint32_t n,
                          uint32_t D, const float *q, uint32_t nh, double *out, double *attn /* [H][n] */) {
        uint32_t group = nh / H;
        double *s = malloc(n * sizeof(double));
        memset(attn, 0, (size_t)H * n * sizeof(double));
        for (uint32_t hq = 0; hq < nh; hq++) {
                uint32_t g = hq / group;
                double m = -INFINITY, l = 0;
                for (uint32_t j = 0; j < n; j++) {
                        double dot = 0;
                        for (uint32_t c = 0; c < D; c++)
                                dot += (double)q[hq * D + c] * K[((size_t)g * n + j) * D + c];
                        s[j] = dot / sqrt((double)D) + logw[(size_t)g * n + j];
                        m = fmax(m, s[j]);
                }
                for (uint32_t j = 0; j < n; j++)
                        l += exp(s[j] - m);
                for (uint32_t c = 0; c < D; c++)
                        out[hq * D + c] = 0;
                for (uint32_t j = 0; j < n; j++) {
                        double a = exp(s[j] - m) / l;
                        attn[(size_t)g * n + j] += a / group;
                        for (uint32_t c = 0; c < D; c++)
                                out[hq * D + c] += a * V[((size_t)g * n + j) * D + c];
                }
        }
        free(s);
}

/* Reads every token of M dequantized (as ladder_load gives it) with its log-weight. */
static void read_all(const struct ladder_layer *M, uint32_t H, uint32_t D, float *K, float *V, float *logw) {
        uint32_t n = ladder_tokens(M);
        for (uint32_t g = 0; g < H; g++)
                for (uint32_t j = 0; j < n; j++) {
                        ladder_load(M, g, j, K + ((size_t)g * n + j) * D, V + ((size_t)g * n + j) * D);
                        memcpy(&logw[(size_t)g * n + j], side_word(M, 4, g, j), 4);
                }
}

static void ladder_attend_matches_a_double_oracle_over_every_tier(void **state) {
        (void)state;
        rng_state = 555;
        for (int rep = 0; rep < 40; rep++) {
                uint32_t H = 1 + rng_below(3), D = 64, nh = H * (1 + rng_below(3));
                uint32_t n[5];
                for (int t = 0; t < 5; t++)
                        n[t] = rng_below(40);
                n[0] += 1;
                struct tlad L;
                lad_make(&L, five, 5, 16, H, D, n, rep % 2, 1);
                uint32_t total = ladder_tokens(&L.M);
                float *K = malloc((size_t)H * total * D * 4), *V = malloc((size_t)H * total * D * 4);
                float *logw = malloc((size_t)H * total * 4), q[9 * 64], out[9 * 64];
                double want[9 * 64], *attn = malloc((size_t)H * total * sizeof(double));
                float *ema0 = malloc((size_t)H * total * 4);
                read_all(&L.M, H, D, K, V, logw);
                for (uint32_t g = 0; g < H; g++)
                        for (uint32_t j = 0; j < total; j++)
                                memcpy(&ema0[g * total + j], side_word(&L.M, 2, g, j), 4);
                for (uint32_t i = 0; i < nh * D; i++)
                        q[i] = (float)rng_gauss();
                oracle_attend(K, V, logw, H, total, D, q, nh, want, attn);
                float *scratch = malloc(ladder_attn_scratch_floats(&L.M, nh) * sizeof(float));
                assert_int_equal(ladder_attend(&L.M, q, out, nh, 0.5f, 1, scratch), 0);
                for (uint32_t hq = 0; hq < nh; hq++) {
                        double mag = 0;
                        for (uint32_t j = 0; j < total; j++) {
                                double vm = 0;
                                for (uint32_t c = 0; c < D; c++)
                                        vm = fmax(vm, fabs(V[((size_t)(hq / (nh / H)) * total + j) * D + c]));
                                mag = fmax(mag, vm);
                        }
                        for (uint32_t c = 0; c < D; c++)
                                if (!(fabs(out[hq * D + c] - want[hq * D + c]) <= 2e-5 * mag))
                                        fail_msg("rep %d head %u channel %u: %g vs %g", rep, hq, c,
                                                 (double)out[hq * D + c], want[hq * D + c]);
                }
                for (uint32_t g = 0; g < H; g++)
                        for (uint32_t j = 0; j < total; j++) {
                                float last, ema;
                                memcpy(&last, side_word(&L.M, 3, g, j), 4);
                                memcpy(&ema, side_word(&L.M, 2, g, j), 4);
                                assert_true(fabs(last - attn[g * total + j]) <=
                                            1e-5 * (1 + attn[g * total + j]));
                                double we = 0.5 * ema0[g * total + j] + 0.5 * attn[g * total + j];
                                assert_true(fabs(ema - we) <= 1e-5 * (1 + we));
                        }
                free(scratch);
                free(K);
                free(V);
                free(logw);
                free(attn);
                free(ema0);
                lad_done(&L);
        }
}

/* Every token at one tier (past 16 full-precision ones) against the same tokens unquantized: the
 * output error follows the tier's error. The bounds are about 1.2 to 1.35 times what this seed
 * measures (q8 0.013, q4 0.303, q3 0.431, q2 0.677), relative to the output's norm, on a hard case:
 * Gaussian values, whose weighted average has a small norm, and keys three times larger than the
 * query, so the softmax is peaked and every logit error moves weight. A broken rotation or
 * codebook moves these by far more; the quality of each tier on the real model is measured
 * elsewhere (docs/quality.md, bench/quant-study.md). */
static void ladder_attend_over_one_tier_stays_near_the_unquantized_attention(void **state) {
        static const double bound[5] = { 0, 0.02, 0.36, 0.53, 0.92 };
        (void)state;
        enum { H = 2, D = 64, NQ = 4, N = 200, W = 16 };
        for (uint32_t t = 1; t < 5; t++) {
                rng_state = 900 + t;
                enum block_dtype dts[2] = { BLOCK_DTYPE_F32, five[t] };
                uint32_t n[2] = { N, 0 };
                struct tlad L;
                lad_make(&L, dts, 2, 16, H, D, n, 0, 0);
                float *K = malloc(H * N * D * 4), *V = malloc(H * N * D * 4), *logw = malloc(H * N * 4);
                read_all(&L.M, H, D, K, V, logw);
                for (uint32_t i = 0; i < H * N * D; i++)
                        K[i] *= 3.0f; /* peakier attention: the logit errors matter */
                /* store the scaled keys again, then demote all but the last W */
                for (uint32_t g = 0; g < H; g++)
                        for (uint32_t j = 0; j < N; j++)
                                memcpy(block_key(&L.lay[0], L.blocks[0][j / 16], g, j % 16),
                                       K + ((size_t)g * N + j) * D, D * 4);
                uint32_t keep[N];
                uint8_t tier[N];
                for (uint32_t i = 0; i < N; i++) {
                        keep[i] = i;
                        tier[i] = i < N - W;
                }
                float *cs = malloc(ladder_compact_scratch_floats(&L.M) * 4);
                uint32_t got[LADDER_TIERS];
                assert_int_equal(ladder_compact(&L.M, keep, tier, N, 0, N, cs, got), 0);
                L.M.n[0] = got[0];
                L.M.n[1] = got[1];
                float q[NQ * D], out[NQ * D];
                double want[NQ * D], *attn = malloc(H * N * sizeof(double));
                /* the tier's tokens come first now: reorder the oracle's copy likewise (it is the identity)
                 */
                for (uint32_t i = 0; i < NQ * D; i++)
                        q[i] = (float)rng_gauss();
                oracle_attend(K, V, logw, H, N, D, q, NQ, want, attn);
                float *scratch = malloc(ladder_attn_scratch_floats(&L.M, NQ) * 4);
                assert_int_equal(ladder_attend(&L.M, q, out, NQ, 0.9f, 0, scratch), 0);
                double e = 0, nrm = 0;
                for (uint32_t i = 0; i < NQ * D; i++) {
                        e += (out[i] - want[i]) * (out[i] - want[i]);
                        nrm += want[i] * want[i];
                }
                double rel = sqrt(e / nrm);
                if (!(rel <= bound[t]))
                        fail_msg("tier %s: relative output error %.4f above %.2f", tier_row(five[t])->name,
                                 rel, bound[t]);
                print_message("tier %s: relative attention output error %.4f\n", tier_row(five[t])->name,
                              rel);
                free(scratch);
                free(cs);
                free(K);
                free(V);
                free(logw);
                free(attn);
                lad_done(&L);
        }
}

static void ladder_attend_rows_equals_row_by_row_calls(void **state) {
        (void)state;
        rng_state = 8080;
        enum { H = 3, D = 64, NH = 9, R = 5 };
        uint32_t n[5] = { 30, 17, 0, 21, 5 };
        struct tlad A, B;
        lad_make(&A, five, 5, 16, H, D, n, 1, 1);
        rng_state = 8080;
        lad_make(&B, five, 5, 16, H, D, n, 1, 1);
        float q[R * NH * D], o1[R * NH * D], o2[R * NH * D];
        for (uint32_t i = 0; i < R * NH * D; i++)
                q[i] = (float)rng_gauss();
        float *scratch = malloc(ladder_attn_scratch_floats(&A.M, NH) * 4);
        assert_int_equal(ladder_attend_rows(&A.M, R, q, o1, NH, 0.8f, 1, scratch), 0);
        for (uint32_t r = 0; r < R; r++) {
                struct ladder_layer P = B.M;
                P.n[0] = B.M.n[0] - (R - 1 - r);
                assert_int_equal(ladder_attend(&P, q + r * NH * D, o2 + r * NH * D, NH, 0.8f, 1, scratch), 0);
        }
        assert_memory_equal(o1, o2, sizeof(o1));
        for (uint32_t t = 0; t < 5; t++)
                for (uint32_t b = 0; b < A.M.n_blocks[t]; b++)
                        assert_memory_equal(A.blocks[t][b], B.blocks[t][b], A.lay[t].block_bytes);
        assert_int_equal(ladder_attend_rows(&A.M, 31, q, o1, NH, 0.8f, 1, scratch), -EINVAL);
        free(scratch);
        lad_done(&A);
        lad_done(&B);
}

/* The fast kernel (plain and AVX2) over every tier against the reference: rounding apart, the
 * same outputs and scores; prompt rows through it equal row-by-row decodes, bit for bit. */
static void ladder_fast_kernel_agrees_with_the_reference_over_every_tier(void **state) {
        (void)state;
        for (int isa = ATTN_ISA_PLAIN; isa <= ATTN_ISA_AVX2; isa++) {
                rng_state = 6000 + (uint64_t)isa;
                for (int rep = 0; rep < 30; rep++) {
                        uint32_t H = 1 + rng_below(3), D = rep % 4 == 0 ? 128 : 64,
                                 nh = H * (1 + rng_below(3));
                        uint32_t n[5];
                        for (int t = 0; t < 5; t++)
                                n[t] = rng_below(50);
                        n[0] += 4;
                        struct tlad A, B;
                        uint64_t seed = rng_state;
                        lad_make(&A, five, 5, 16, H, D, n, rep % 2, 1);
                        rng_state = seed;
                        lad_make(&B, five, 5, 16, H, D, n, rep % 2, 1);
                        uint32_t total = ladder_tokens(&A.M), R = 1 + rng_below(4);
                        float *q = malloc((size_t)R * nh * D * 4), *o1 = malloc((size_t)R * nh * D * 4),
                              *o2 = malloc((size_t)R * nh * D * 4);
                        for (uint32_t i = 0; i < R * nh * D; i++)
                                q[i] = (float)rng_gauss();
                        float *rs = malloc(ladder_attn_scratch_floats(&A.M, nh) * 4);
                        float *fs = malloc(attn_rows_scratch_floats(total, R, nh, H, D, 16) * 4);
                        assert_int_equal(ladder_attend_rows(&A.M, R, q, o1, nh, 0.7f, 1, rs), 0);
                        int e = attn_prefill_fast_ladder(&B.M, R, q, o2, nh, 0.7f, 1, fs, (enum attn_isa)isa);
                        if (e == -ENOTSUP) { /* no AVX2 here */
                                lad_done(&A);
                                lad_done(&B);
                                free(q), free(o1), free(o2), free(rs), free(fs);
                                return;
                        }
                        assert_int_equal(e, 0);
                        for (uint32_t i = 0; i < R * nh * D; i++)
                                if (!(fabs(o1[i] - o2[i]) <= 2e-5 * (1 + fabs(o1[i]))))
                                        fail_msg("isa %d rep %d: out[%u] %g vs %g", isa, rep, i,
                                                 (double)o2[i], (double)o1[i]);
                        for (uint32_t g = 0; g < H; g++)
                                for (uint32_t j = 0; j < total; j++)
                                        for (int a = 1; a < 4; a++) {
                                                float x, y;
                                                memcpy(&x, side_word(&A.M, a, g, j), 4);
                                                memcpy(&y, side_word(&B.M, a, g, j), 4);
                                                assert_true(fabs(x - y) <= 2e-5 * (1 + fabs(x)));
                                        }
                        /* the rows, bit for bit, as decodes of growing layers */
                        float *o3 = malloc((size_t)R * nh * D * 4);
                        rng_state = seed;
                        struct tlad C;
                        lad_make(&C, five, 5, 16, H, D, n, rep % 2, 1);
                        for (uint32_t r = 0; r < R; r++) {
                                struct ladder_layer P = C.M;
                                P.n[0] = C.M.n[0] - (R - 1 - r);
                                assert_int_equal(attn_decode_fast_ladder(&P, q + (size_t)r * nh * D,
                                                                         o3 + (size_t)r * nh * D, nh, 0.7f, 1,
                                                                         fs, (enum attn_isa)isa),
                                                 0);
                        }
                        assert_memory_equal(o2, o3, (size_t)R * nh * D * 4);
                        free(o3);
                        lad_done(&C);
                        free(q), free(o1), free(o2), free(rs), free(fs);
                        lad_done(&A);
                        lad_done(&B);
                }
        }
}

static void ladder_rejects_bad_plans_and_changes_nothing(void **state) {
        (void)state;
        rng_state = 13;
        uint32_t n[5] = { 20, 10, 10, 0, 0 };
        struct tlad L;
        lad_make(&L, five, 5, 16, 2, 64, n, 0, 0);
        lad_snapshot(&L);
        float *scratch = malloc(ladder_compact_scratch_floats(&L.M) * 4);
        uint32_t got[LADDER_TIERS], keep[80];
        uint8_t tier[80];
        for (uint32_t i = 0; i < 40; i++) {
                keep[i] = i;
                tier[i] = i < 10 ? 2 : i < 20 ? 2 : 0; /* q8 (slots 10-19) may go to q4 */
                keep[40 + i] = i;
                tier[40 + i] = tier[i];
        }
        /* up the ladder: a q4 token (slot 0) back to q8 */
        tier[0] = 1;
        assert_int_equal(ladder_compact(&L.M, keep, tier, 40, 0, 40, scratch, got), -EINVAL);
        tier[0] = 2;
        /* a tier past the layer's */
        tier[5] = 5;
        assert_int_equal(ladder_compact(&L.M, keep, tier, 40, 0, 40, scratch, got), -EINVAL);
        tier[5] = 2;
        /* per head: head 1 gives q4 one token fewer */
        tier[40 + 25] = 2;
        assert_int_equal(ladder_compact(&L.M, keep, tier, 40, 1, 40, scratch, got), -EINVAL);
        tier[40 + 25] = 0;
        /* not ascending */
        keep[3] = 9;
        assert_int_equal(ladder_compact(&L.M, keep, tier, 40, 0, 40, scratch, got), -EINVAL);
        keep[3] = 3;
        /* base inside a lower tier while tokens follow it */
        assert_int_equal(ladder_compact(&L.M, keep, tier, 5, 0, 5, scratch, got), -EINVAL);
        /* no room: q4 needs 2 blocks, give it 1 */
        uint32_t nb = L.M.n_blocks[2];
        L.M.n_blocks[2] = 1;
        assert_int_equal(ladder_compact(&L.M, keep, tier, 40, 0, 40, scratch, got), -EINVAL);
        L.M.n_blocks[2] = nb;
        assert_lad_unchanged(&L, "refused plans");
        /* a bad layer */
        struct ladder_layer bad = L.M;
        bad.signs = NULL;
        assert_int_equal(ladder_check(&bad), -EINVAL);
        bad = L.M;
        bad.layout[1] = &L.lay[2];
        bad.layout[2] = &L.lay[1]; /* q4 before q8 */
        assert_int_equal(ladder_check(&bad), -EINVAL);
        bad = L.M;
        bad.n_shared = 3;
        uint8_t mask[8] = { 0 };
        bad.shared_mask = mask;
        bad.mask_stride = 8;
        assert_int_equal(ladder_check(&bad), -EINVAL); /* lower tiers beside a shared prefix */
        bad = L.M;
        bad.layout[0] = &L.lay[1];
        assert_int_equal(ladder_check(&bad), -EINVAL);
        /* and a valid plan goes through */
        assert_int_equal(ladder_compact(&L.M, keep, tier, 40, 1, 40, scratch, got), 0);
        assert_int_equal(got[2], 20);
        assert_int_equal(got[1], 0);
        assert_int_equal(got[0], 20);
        free(scratch);
        lad_done(&L);
}

int main(void) {
        const struct CMUnitTest tests[] = {
                cmocka_unit_test(ladder_compact_matches_the_oracle_on_random_plans_over_every_tier),
                cmocka_unit_test(ladder_demotes_without_evicting),
                cmocka_unit_test(ladder_compact_survives_race_prone_keep_sets),
                cmocka_unit_test(ladder_of_fp_and_q8_computes_the_mixed_layers_bits),
                cmocka_unit_test(ladder_attend_matches_a_double_oracle_over_every_tier),
                cmocka_unit_test(ladder_attend_over_one_tier_stays_near_the_unquantized_attention),
                cmocka_unit_test(ladder_attend_rows_equals_row_by_row_calls),
                cmocka_unit_test(ladder_fast_kernel_agrees_with_the_reference_over_every_tier),
                cmocka_unit_test(ladder_rejects_bad_plans_and_changes_nothing),
        };
        return cmocka_run_group_tests(tests, NULL, NULL);
}
