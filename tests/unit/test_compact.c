/* test_compact.c - unit tests of kernels/compact.c and kernels/block.c.
 *
 * Owns: compaction against an out-of-place oracle, the block layout, and the f16/bf16
 * conversions.
 *
 * The oracle snapshots the layer, then builds the expected layer in fresh blocks by copying, for
 * every KV head and new slot i, the bytes of source slot keep[i] (or the tail slot) of every
 * array: keys, values, pos, sum, ema, last, logw. Compaction in place must give the same bytes
 * in slots [0, new length). The blocks are filled with random bytes and are separate
 * allocations in shuffled order, so a mixed-up head, array, slot or block shows. Keep-sets are
 * random and also built to expose an in-place gather that reads a slot after overwriting it
 * (every slot moves by one, runs across block boundaries, every other slot, a window shift).
 *
 * The conversion tests are exhaustive over the 65536 half and bfloat16 patterns where that is
 * cheap, and check round-to-nearest-even at every midpoint.
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

#include "block.h"
#include "compact.h"

/* ---- a layer in separately allocated blocks ---- */

struct test_layer {
        struct block_layout layout;
        struct block_layer L;
        uint8_t **blocks; /* in slot order, allocated in shuffled order */
        uint8_t **saved;  /* a snapshot of each block */
        uint32_t n_blocks;
};

static void layer_make(struct test_layer *t, uint32_t block_tokens, uint32_t n_kv_heads, uint32_t head_dim,
                       enum block_dtype dtype, uint32_t n_tokens, uint32_t spare_blocks) {
        memset(t, 0, sizeof(*t));
        assert_int_equal(block_layout_init(&t->layout, block_tokens, n_kv_heads, head_dim, dtype), 0);
        t->n_blocks = (n_tokens + block_tokens - 1) / block_tokens + spare_blocks;
        if (t->n_blocks == 0)
                t->n_blocks = 1;
        t->blocks = calloc(t->n_blocks, sizeof(*t->blocks));
        t->saved = calloc(t->n_blocks, sizeof(*t->saved));
        assert_non_null(t->blocks);
        assert_non_null(t->saved);
        for (uint32_t b = 0; b < t->n_blocks; b++) {
                uint8_t *m = aligned_alloc(64, t->layout.block_bytes);
                assert_non_null(m);
                for (uint64_t i = 0; i < t->layout.block_bytes; i++)
                        m[i] = (uint8_t)rng_next();
                t->saved[b] = malloc(t->layout.block_bytes);
                assert_non_null(t->saved[b]);
                t->blocks[b] = m;
        }
        /* shuffle the block table so that slot order is not address order */
        for (uint32_t b = t->n_blocks; b > 1; b--) {
                uint32_t j = rng_below(b);
                uint8_t *x = t->blocks[b - 1];
                t->blocks[b - 1] = t->blocks[j];
                t->blocks[j] = x;
        }
        for (uint32_t b = 0; b < t->n_blocks; b++)
                memcpy(t->saved[b], t->blocks[b], t->layout.block_bytes);
        t->L = (struct block_layer){
                .layout = &t->layout, .blocks = t->blocks, .n_blocks = t->n_blocks, .n_tokens = n_tokens
        };
}

static void layer_done(struct test_layer *t) {
        for (uint32_t b = 0; b < t->n_blocks; b++) {
                free(t->blocks[b]);
                free(t->saved[b]);
        }
        free(t->blocks);
        free(t->saved);
}

static void assert_layer_unchanged(const struct test_layer *t) {
        for (uint32_t b = 0; b < t->n_blocks; b++)
                assert_memory_equal(t->blocks[b], t->saved[b], t->layout.block_bytes);
}

static const char *const array_names[] = { "key", "value", "pos", "sum", "ema", "last", "logw" };

/* The bytes of array a (0 key, 1 value, 2.. side arrays) for (head, slot) of a layer whose block
 * table is blocks. */
static const uint8_t *slot_bytes(const struct block_layout *l, uint8_t *const *blocks, int a, uint32_t head,
                                 uint32_t slot, size_t *ret_len) {
        uint8_t *b = blocks[slot / l->block_tokens];
        uint32_t s = slot % l->block_tokens;
        const uint64_t side[] = { l->pos_offset, l->sum_offset, l->ema_offset, l->last_offset,
                                  l->logw_offset };

        if (a < 2) {
                *ret_len = l->row_bytes;
                return a == 0 ? block_key(l, b, head, s) : block_value(l, b, head, s);
        }
        *ret_len = 4;
        return block_side(l, b, side[a - 2], head, s);
}

/* Compacts t with keep (per layer, or per head) and compares with the out-of-place oracle. */
static void check_compaction(struct test_layer *t, const uint32_t *keep, uint32_t keep_count, int per_head,
                             uint32_t base_tokens, const char *what) {
        const struct block_layout *l = &t->layout;
        uint32_t H = l->n_kv_heads, n_tokens = t->L.n_tokens;
        uint32_t new_len = keep_count + (n_tokens - base_tokens);
        uint8_t **expect = calloc(t->n_blocks, sizeof(*expect));

        /* the oracle: fresh blocks, filled by copying from the snapshot */
        assert_non_null(expect);
        for (uint32_t b = 0; b < t->n_blocks; b++) {
                expect[b] = calloc(1, l->block_bytes);
                assert_non_null(expect[b]);
        }
        for (uint32_t h = 0; h < H; h++) {
                const uint32_t *kh = per_head ? keep + (size_t)h * keep_count : keep;
                for (uint32_t i = 0; i < new_len; i++) {
                        uint32_t src = i < keep_count ? kh[i] : base_tokens + (i - keep_count);
                        for (int a = 0; a < 7; a++) {
                                size_t len;
                                const uint8_t *from = slot_bytes(l, t->saved, a, h, src, &len);
                                uint8_t *to = (uint8_t *)slot_bytes(l, expect, a, h, i, &len);
                                memcpy(to, from, len);
                        }
                }
        }
        /* t->saved mirrors t->blocks, block for block */
        uint32_t got_len = 0xdeadbeef;
        int r = compact_layer(&t->L, keep, keep_count, per_head, base_tokens, &got_len);
        if (r != 0)
                fail_msg("%s: compact_layer returned %d", what, r);
        if (got_len != new_len)
                fail_msg("%s: new length %u, want %u", what, got_len, new_len);
        for (uint32_t h = 0; h < H; h++) {
                for (uint32_t i = 0; i < new_len; i++) {
                        for (int a = 0; a < 7; a++) {
                                size_t len;
                                const uint8_t *got = slot_bytes(l, t->blocks, a, h, i, &len);
                                const uint8_t *want = slot_bytes(l, expect, a, h, i, &len);
                                if (memcmp(got, want, len) != 0)
                                        fail_msg("%s (T=%u H=%u D=%u dtype %d, n %u base %u keep %u%s): "
                                                 "%s of head %u slot %u differs",
                                                 what, l->block_tokens, H, l->head_dim, (int)l->dtype,
                                                 n_tokens, base_tokens, keep_count,
                                                 per_head ? " per head" : "", array_names[a], h, i);
                        }
                }
        }
        for (uint32_t b = 0; b < t->n_blocks; b++)
                free(expect[b]);
        free(expect);
}

/* Runs one keep-set on a fresh layer of the given geometry: per layer, then (the same set
 * shifted per head where it fits) per head. */
static void run_case(uint32_t T, uint32_t H, uint32_t D, enum block_dtype dtype, uint32_t n_tokens,
                     uint32_t base, const uint32_t *keep, uint32_t kc, const char *what) {
        struct test_layer t;

        layer_make(&t, T, H, D, dtype, n_tokens, 0);
        check_compaction(&t, keep, kc, 0, base, what);
        layer_done(&t);

        /* per head: head h keeps a random subset of the same size */
        uint32_t *kh = calloc((size_t)H * kc + 1, sizeof(*kh));
        assert_non_null(kh);
        for (uint32_t h = 0; h < H; h++) {
                if (h == 0) {
                        memcpy(kh, keep, kc * sizeof(*kh));
                        continue;
                }
                /* choose kc of base, in order (selection sampling) */
                uint32_t need = kc, m = 0;
                for (uint32_t i = 0; i < base && need > 0; i++) {
                        if (rng_below(base - i) < need) {
                                kh[(size_t)h * kc + m++] = i;
                                need--;
                        }
                }
        }
        layer_make(&t, T, H, D, dtype, n_tokens, 0);
        check_compaction(&t, kh, kc, 1, base, what);
        layer_done(&t);
        free(kh);
}

static const enum block_dtype dtypes[] = { BLOCK_DTYPE_F32, BLOCK_DTYPE_F16, BLOCK_DTYPE_BF16 };

/* keep-set builders: each writes into keep and returns the count */

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

/* Runs of length run_len that start run_len/2 before each block boundary, so each one
 * straddles two blocks, and a gap between runs. */
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

/* The shapes of keep-set that break a careless in-place gather, on small and 16-token blocks,
 * with and without tail tokens. */
static void compact_matches_oracle_on_race_prone_keep_sets(void **state) {
        static const uint32_t Ts[] = { 1, 3, 4, 16 };
        static const uint32_t tails[] = { 0, 1, 5 };
        (void)state;
        rng_state = 0xc0ffee;
        for (size_t ti = 0; ti < sizeof(Ts) / sizeof(Ts[0]); ti++) {
                uint32_t T = Ts[ti];
                for (size_t ta = 0; ta < sizeof(tails) / sizeof(tails[0]); ta++) {
                        uint32_t base = 5 * T + 2, n = base + tails[ta];
                        uint32_t H = 1 + rng_below(3), D = 1 + rng_below(16);
                        enum block_dtype dt = dtypes[rng_below(3)];
                        uint32_t *keep = calloc(base + 1, sizeof(*keep));
                        uint32_t kc;
                        assert_non_null(keep);

                        kc = keep_shift_by_one(base, keep);
                        run_case(T, H, D, dt, n, base, keep, kc, "every slot moves by one");
                        kc = keep_every_other(base, 0, keep);
                        run_case(T, H, D, dt, n, base, keep, kc, "every other slot from 0");
                        kc = keep_every_other(base, 1, keep);
                        run_case(T, H, D, dt, n, base, keep, kc, "every other slot from 1");
                        for (uint32_t run = 2; run <= T + 3; run += 1 + T / 2) {
                                kc = keep_straddling(base, T, run, keep);
                                run_case(T, H, D, dt, n, base, keep, kc, "runs straddle block edges");
                        }
                        kc = keep_last(base, T, keep);
                        run_case(T, H, D, dt, n, base, keep, kc, "window shift, the last block");
                        kc = keep_last(base, 2 * T + 1, keep);
                        run_case(T, H, D, dt, n, base, keep, kc, "window shift, the last 2T+1");
                        kc = keep_last(base, 1, keep);
                        run_case(T, H, D, dt, n, base, keep, kc, "only the last");
                        run_case(T, H, D, dt, n, base, keep, 0, "keep nothing");
                        kc = keep_all(base, keep);
                        run_case(T, H, D, dt, n, base, keep, kc, "keep everything");
                        keep[0] = 0;
                        run_case(T, H, D, dt, n, base, keep, 1, "only the first");
                        free(keep);
                }
        }
}

static void compact_matches_oracle_on_random_geometries(void **state) {
        (void)state;
        rng_state = 0xabcdef01;
        for (int iter = 0; iter < 300; iter++) {
                uint32_t T = rng_below(3) == 0 ? 16 : 1 + rng_below(8);
                uint32_t H = 1 + rng_below(4), D = 1 + rng_below(16);
                enum block_dtype dt = dtypes[rng_below(3)];
                uint32_t n = rng_below(6 * T + 1);
                uint32_t base = n - rng_below(n < 2 * T ? n + 1 : 2 * T + 1);
                uint32_t *keep = calloc(base + 1, sizeof(*keep));
                assert_non_null(keep);
                uint32_t kc = keep_random(base, rng_below(1001), keep);
                char what[64];
                snprintf(what, sizeof(what), "random case %d", iter);
                run_case(T, H, D, dt, n, base, keep, kc, what);
                free(keep);
        }
}

/* Spare blocks past the live ones are allowed, and compaction leaves them alone. */
static void compact_leaves_blocks_past_the_length_alone(void **state) {
        struct test_layer t;
        uint32_t keep[] = { 2, 3, 9 };
        uint32_t n;
        (void)state;
        rng_state = 7;
        layer_make(&t, 4, 2, 3, BLOCK_DTYPE_F32, 10, 2);
        assert_int_equal(compact_layer(&t.L, keep, 3, 0, 10, &n), 0);
        assert_int_equal(n, 3);
        assert_memory_equal(t.blocks[3], t.saved[3], t.layout.block_bytes);
        assert_memory_equal(t.blocks[4], t.saved[4], t.layout.block_bytes);
        layer_done(&t);
}

/* Refusals move nothing and leave *ret_n_tokens alone. */
static void compact_rejects_bad_keep_sets(void **state) {
        static const struct {
                uint32_t keep[4];
                uint32_t count;
                uint32_t base;
                const char *what;
        } bad[] = {
                { { 1, 3, 2 }, 3, 10, "unsorted" },
                { { 1, 3, 3 }, 3, 10, "duplicate" },
                { { 4, 4 }, 2, 10, "duplicate at the start" },
                { { 1, 2, 10 }, 3, 10, "index equal to base_tokens" },
                { { 0, 1, 2, 3 }, 4, 3, "index beyond base_tokens" },
                { { 0xffffffffu }, 1, 10, "huge index" },
                { { 0 }, 1, 0, "anything with base_tokens 0" },
                { { 1 }, 1, 11, "base_tokens beyond n_tokens" },
                { { 0 }, 0, 11, "base_tokens beyond n_tokens, empty keep" },
        };
        (void)state;
        rng_state = 99;
        for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
                for (int per_head = 0; per_head < 2; per_head++) {
                        struct test_layer t;
                        uint32_t keep[8], n = 12345;
                        layer_make(&t, 4, 2, 5, BLOCK_DTYPE_F16, 10, 0);
                        /* per head: head 0 has a valid set, head 1 the bad one */
                        for (uint32_t k = 0; k < bad[i].count; k++) {
                                keep[k] = per_head ? k : bad[i].keep[k];
                                keep[bad[i].count + k] = bad[i].keep[k];
                        }
                        int r = compact_layer(&t.L, keep, bad[i].count, per_head, bad[i].base, &n);
                        if (r != -EINVAL)
                                fail_msg("%s%s: compact_layer returned %d", bad[i].what,
                                         per_head ? " (per head)" : "", r);
                        assert_int_equal(n, 12345);
                        assert_layer_unchanged(&t);
                        layer_done(&t);
                }
        }
        /* a layer longer than its blocks */
        struct test_layer t;
        uint32_t keep[] = { 0 }, n = 12345;
        layer_make(&t, 4, 1, 2, BLOCK_DTYPE_F32, 8, 0);
        t.L.n_tokens = 9;
        assert_int_equal(compact_layer(&t.L, keep, 1, 0, 9, &n), -EINVAL);
        assert_int_equal(n, 12345);
        assert_layer_unchanged(&t);
        layer_done(&t);
}

static void compact_check_keep_accepts_only_strictly_ascending_sets(void **state) {
        uint32_t ok[] = { 0, 1, 5, 9 }, dup[] = { 0, 5, 5 }, down[] = { 3, 2 };
        (void)state;
        assert_int_equal(compact_check_keep(ok, 4, 10), 0);
        assert_int_equal(compact_check_keep(ok, 4, 9), -EINVAL);
        assert_int_equal(compact_check_keep(ok, 0, 0), 0);
        assert_int_equal(compact_check_keep(dup, 3, 10), -EINVAL);
        assert_int_equal(compact_check_keep(down, 2, 10), -EINVAL);
        assert_int_equal(compact_check_keep(down, 1, 4), 0);
        assert_int_equal(compact_check_keep(down, 1, 3), -EINVAL);
}

/* ---- block layout ---- */

static void block_layout_aligns_and_separates_every_array(void **state) {
        (void)state;
        for (uint32_t T = 1; T <= 33; T += 4) {
                for (uint32_t H = 1; H <= 9; H += 2) {
                        for (uint32_t D = 1; D <= 130; D += 43) {
                                for (size_t di = 0; di < 3; di++) {
                                        struct block_layout l;
                                        assert_int_equal(block_layout_init(&l, T, H, D, dtypes[di]), 0);
                                        uint64_t eb = block_dtype_bytes(dtypes[di]);
                                        assert_int_equal(l.elem_bytes, eb);
                                        assert_int_equal(l.row_bytes, D * eb);
                                        assert_int_equal(l.block_tokens, T);
                                        assert_int_equal(l.n_kv_heads, H);
                                        assert_int_equal(l.head_dim, D);
                                        const uint64_t off[] = { l.key_offset,  l.value_offset, l.pos_offset,
                                                                 l.sum_offset,  l.ema_offset,   l.last_offset,
                                                                 l.logw_offset, l.block_bytes };
                                        const uint64_t size[] = {
                                                (uint64_t)H * T * D * eb, (uint64_t)H * T * D * eb,
                                                (uint64_t)H * T * 4,      (uint64_t)H * T * 4,
                                                (uint64_t)H * T * 4,      (uint64_t)H * T * 4,
                                                (uint64_t)H * T * 4
                                        };
                                        assert_int_equal(l.key_offset, 0);
                                        for (int a = 0; a < 8; a++)
                                                assert_int_equal(off[a] % 64, 0);
                                        /* in order, each array fits before the next begins */
                                        for (int a = 0; a < 7; a++)
                                                assert_true(off[a] + size[a] <= off[a + 1]);
                                        /* no more padding than alignment needs */
                                        for (int a = 0; a < 7; a++)
                                                assert_true(off[a + 1] - off[a] - size[a] < 64);
                                        /* the accessors land where the offsets say */
                                        uint8_t *b = (uint8_t *)(uintptr_t)0x100000;
                                        assert_ptr_equal(block_key(&l, b, H - 1, T - 1),
                                                         b + size[0] - l.row_bytes);
                                        assert_ptr_equal(block_value(&l, b, 0, 0), b + l.value_offset);
                                        assert_ptr_equal(block_side(&l, b, l.logw_offset, H - 1, T - 1),
                                                         b + l.logw_offset + size[6] - 4);
                                }
                        }
                }
        }
}

static void block_layout_rejects_zero_and_unknown_fields(void **state) {
        struct block_layout l, before;
        (void)state;
        memset(&l, 0x7e, sizeof(l));
        before = l;
        assert_int_equal(block_layout_init(&l, 0, 8, 128, BLOCK_DTYPE_F16), -EINVAL);
        assert_int_equal(block_layout_init(&l, 16, 0, 128, BLOCK_DTYPE_F16), -EINVAL);
        assert_int_equal(block_layout_init(&l, 16, 8, 0, BLOCK_DTYPE_F16), -EINVAL);
        assert_int_equal(block_layout_init(&l, 16, 8, 128, (enum block_dtype)0), -EINVAL);
        assert_int_equal(block_layout_init(&l, 16, 8, 128, (enum block_dtype)8), -EINVAL); /* 5-7: the packed tiers */
        assert_memory_equal(&l, &before, sizeof(l));
        assert_int_equal(block_dtype_bytes((enum block_dtype)0), 0);
        assert_int_equal(block_dtype_bytes(BLOCK_DTYPE_F32), 4);
        assert_int_equal(block_dtype_bytes(BLOCK_DTYPE_F16), 2);
        assert_int_equal(block_dtype_bytes(BLOCK_DTYPE_BF16), 2);
}

/* Blocks over 4 GiB are refused, including sizes whose product does not fit 64 bits. */
static void block_layout_rejects_blocks_over_4_gib(void **state) {
        struct block_layout l;
        (void)state;
        assert_int_equal(block_layout_init(&l, 2048, 256, 1024, BLOCK_DTYPE_F32), -EINVAL);
        assert_int_equal(block_layout_init(&l, 1u << 16, 1u << 16, 1, BLOCK_DTYPE_F32), -EINVAL);
        /* 2^31 * 2^31 slots of 4 bytes is 2^64: zero if the arithmetic wraps */
        assert_int_equal(block_layout_init(&l, 1u << 31, 1u << 31, 1, BLOCK_DTYPE_F32), -EINVAL);
        assert_int_equal(block_layout_init(&l, 1u << 31, 1u << 31, 1u << 31, BLOCK_DTYPE_F16), -EINVAL);
        assert_int_equal(block_layout_init(&l, UINT32_MAX, UINT32_MAX, UINT32_MAX, BLOCK_DTYPE_F32), -EINVAL);
        assert_int_equal(block_layout_init(&l, 1, 1, UINT32_MAX, BLOCK_DTYPE_F32), -EINVAL);
        /* the protocol's largest geometry fits */
        assert_int_equal(block_layout_init(&l, 1024, 256, 1024, BLOCK_DTYPE_F32), 0);
        assert_int_equal(l.block_bytes, (2ull << 30) + 5 * (1ull << 20));
}

/* ---- f16 and bf16 ---- */

static uint32_t bits_of(float f) {
        uint32_t b;
        memcpy(&b, &f, 4);
        return b;
}

static float float_of(uint32_t b) {
        float f;
        memcpy(&f, &b, 4);
        return f;
}

static float load16(enum block_dtype dt, uint16_t h) {
        float f;
        block_load_row(dt, &h, &f, 1);
        return f;
}

static uint16_t store16(enum block_dtype dt, float f) {
        uint16_t h;
        block_store_row(dt, &f, &h, 1);
        return h;
}

static int is_nan16(enum block_dtype dt, uint16_t h) {
        return dt == BLOCK_DTYPE_F16 ? (h & 0x7c00) == 0x7c00 && (h & 0x3ff)
                                     : (h & 0x7f80) == 0x7f80 && (h & 0x7f);
}

/* The value of a half, computed independently of block.c. */
static double half_value(uint16_t h) {
        int e = (h >> 10) & 0x1f, m = h & 0x3ff;
        double v = e == 0 ? ldexp(m, -24) : e == 31 ? (m ? NAN : INFINITY) : ldexp(1024 + m, e - 25);
        return (h & 0x8000) ? -v : v;
}

/* Every non-NaN pattern loads to its value and stores back to itself; NaNs stay NaN. */
static void f16_and_bf16_round_trip_every_pattern(void **state) {
        (void)state;
        for (uint32_t i = 0; i < 65536; i++) {
                uint16_t h = (uint16_t)i;
                float f = load16(BLOCK_DTYPE_F16, h);
                if (is_nan16(BLOCK_DTYPE_F16, h)) {
                        assert_true(isnan(f));
                        assert_true(is_nan16(BLOCK_DTYPE_F16, store16(BLOCK_DTYPE_F16, f)));
                } else {
                        if ((double)f != half_value(h) || !!signbit(f) != !!(h & 0x8000))
                                fail_msg("half 0x%04x loads as %a, want %a", h, (double)f, half_value(h));
                        assert_int_equal(store16(BLOCK_DTYPE_F16, f), h);
                }

                float g = load16(BLOCK_DTYPE_BF16, h);
                assert_int_equal(bits_of(g), (uint32_t)h << 16);
                if (is_nan16(BLOCK_DTYPE_BF16, h))
                        assert_true(is_nan16(BLOCK_DTYPE_BF16, store16(BLOCK_DTYPE_BF16, g)));
                else
                        assert_int_equal(store16(BLOCK_DTYPE_BF16, g), h);
        }
}

/* Exactly half-way between two neighbours rounds to the even one; a hair either side rounds to
 * the nearer one. Over every pair of adjacent finite values of both types. */
static void f16_and_bf16_round_to_nearest_even(void **state) {
        (void)state;
        for (int di = 1; di < 3; di++) {
                enum block_dtype dt = dtypes[di];
                for (uint32_t sign = 0; sign < 2; sign++) {
                        for (uint32_t m = 0;; m++) {
                                uint16_t lo = (uint16_t)(m | sign << 15), hi = (uint16_t)(lo + 1);
                                float a = load16(dt, lo), b = load16(dt, hi);
                                if (isinf(b) || isnan(b))
                                        break;
                                /* both have at most 11 significant bits: the midpoint is exact */
                                float mid = (float)(((double)a + (double)b) / 2);
                                assert_true((double)mid == ((double)a + (double)b) / 2);
                                uint16_t even = (lo & 1) ? hi : lo;
                                if (store16(dt, mid) != even)
                                        fail_msg(
                                                "dtype %d: midpoint %a of 0x%04x and 0x%04x stored as 0x%04x",
                                                (int)dt, (double)mid, lo, hi, store16(dt, mid));
                                float above = nextafterf(mid, sign ? -INFINITY : INFINITY);
                                float below = nextafterf(mid, sign ? INFINITY : -INFINITY);
                                assert_int_equal(store16(dt, above), hi);
                                assert_int_equal(store16(dt, below), lo);
                        }
                }
        }
}

/* Random floats over the whole range go to a nearest half. */
static void f16_store_picks_a_nearest_value(void **state) {
        (void)state;
        rng_state = 0x16;
        for (int i = 0; i < 200000; i++) {
                float x = float_of((uint32_t)rng_next());
                if (isnan(x))
                        continue;
                uint16_t h = store16(BLOCK_DTYPE_F16, x);
                double v = half_value(h), err = fabs((double)x - v);
                assert_false(isnan(v));
                if (isinf(v)) {
                        /* only past the midpoint between the largest half and 2^16 */
                        assert_true(fabs((double)x) >= 65520.0);
                        continue;
                }
                for (int d = -1; d <= 1; d += 2) {
                        uint16_t n = (uint16_t)(h + d);
                        double w = half_value(n);
                        if ((n & 0x7fff) > 0x7c00 || (n ^ h) & 0x8000)
                                continue; /* NaN, or across zero */
                        if (fabs((double)x - w) < err)
                                fail_msg("%a stored as 0x%04x (%a), but 0x%04x (%a) is nearer", (double)x, h,
                                         v, n, w);
                }
        }
}

static void f16_and_bf16_keep_inf_nan_zero_and_handle_the_extremes(void **state) {
        (void)state;
        /* infinities and signed zeros */
        assert_int_equal(store16(BLOCK_DTYPE_F16, INFINITY), 0x7c00);
        assert_int_equal(store16(BLOCK_DTYPE_F16, -INFINITY), 0xfc00);
        assert_int_equal(store16(BLOCK_DTYPE_F16, 0.0f), 0x0000);
        assert_int_equal(store16(BLOCK_DTYPE_F16, -0.0f), 0x8000);
        assert_int_equal(store16(BLOCK_DTYPE_BF16, INFINITY), 0x7f80);
        assert_int_equal(store16(BLOCK_DTYPE_BF16, -INFINITY), 0xff80);
        assert_int_equal(store16(BLOCK_DTYPE_BF16, -0.0f), 0x8000);
        assert_true(isinf(load16(BLOCK_DTYPE_F16, 0xfc00)) && load16(BLOCK_DTYPE_F16, 0xfc00) < 0);
        /* NaNs of every kind stay NaN, including payloads only in the low float bits */
        const uint32_t nans[] = {
                0x7fc00000u, 0xffc00000u, 0x7f800001u, 0xff800001u, 0x7fffffffu, 0x7f802000u
        };
        for (size_t i = 0; i < sizeof(nans) / sizeof(nans[0]); i++) {
                assert_true(is_nan16(BLOCK_DTYPE_F16, store16(BLOCK_DTYPE_F16, float_of(nans[i]))));
                assert_true(is_nan16(BLOCK_DTYPE_BF16, store16(BLOCK_DTYPE_BF16, float_of(nans[i]))));
        }
        /* overflow: the largest half, the last value that rounds to it, and past it */
        assert_int_equal(store16(BLOCK_DTYPE_F16, 65504.0f), 0x7bff);
        assert_int_equal(store16(BLOCK_DTYPE_F16, 65519.996f), 0x7bff);
        assert_int_equal(store16(BLOCK_DTYPE_F16, 65520.0f), 0x7c00);
        assert_int_equal(store16(BLOCK_DTYPE_F16, 1e10f), 0x7c00);
        assert_int_equal(store16(BLOCK_DTYPE_F16, -FLT_MAX), 0xfc00);
        assert_int_equal(store16(BLOCK_DTYPE_BF16, FLT_MAX), 0x7f80);
        assert_int_equal(store16(BLOCK_DTYPE_BF16, 3.3895314e38f), 0x7f7f);
        /* half subnormals: the smallest, half of it (a tie: to zero), a hair above half of it */
        assert_int_equal(store16(BLOCK_DTYPE_F16, ldexpf(1, -24)), 0x0001);
        assert_int_equal(store16(BLOCK_DTYPE_F16, ldexpf(1, -25)), 0x0000);
        assert_int_equal(store16(BLOCK_DTYPE_F16, nextafterf(ldexpf(1, -25), 1)), 0x0001);
        assert_int_equal(store16(BLOCK_DTYPE_F16, ldexpf(3, -25)), 0x0002); /* 1.5 ulp: tie to even */
        assert_int_equal(store16(BLOCK_DTYPE_F16, -ldexpf(1, -26)), 0x8000);
        assert_int_equal(store16(BLOCK_DTYPE_F16, ldexpf(1023, -24)), 0x03ff); /* largest subnormal */
        assert_int_equal(store16(BLOCK_DTYPE_F16, ldexpf(2047, -25)), 0x0400); /* rounds up to normal */
        assert_true(load16(BLOCK_DTYPE_F16, 0x0001) == ldexpf(1, -24));
        assert_true(load16(BLOCK_DTYPE_F16, 0x83ff) == -ldexpf(1023, -24));
        /* float subnormals: zero in half, kept in bfloat16 */
        assert_int_equal(store16(BLOCK_DTYPE_F16, float_of(1)), 0x0000);
        assert_int_equal(store16(BLOCK_DTYPE_F16, float_of(0x80000001u)), 0x8000);
        assert_int_equal(store16(BLOCK_DTYPE_BF16, float_of(0x00010000u)), 0x0001);
        assert_int_equal(store16(BLOCK_DTYPE_BF16, float_of(0x00008000u)), 0x0000); /* tie to even */
        assert_int_equal(store16(BLOCK_DTYPE_BF16, float_of(0x00018000u)), 0x0002);
        /* f32 is a plain copy, NaN payloads included */
        float in[3] = { float_of(0x7f800123u), -0.0f, 1.5f }, out[3];
        block_store_row(BLOCK_DTYPE_F32, in, out, 3);
        assert_memory_equal(in, out, sizeof(in));
        block_load_row(BLOCK_DTYPE_F32, in, out, 3);
        assert_memory_equal(in, out, sizeof(in));
}

int main(void) {
        const struct CMUnitTest tests[] = {
                cmocka_unit_test(compact_matches_oracle_on_race_prone_keep_sets),
                cmocka_unit_test(compact_matches_oracle_on_random_geometries),
                cmocka_unit_test(compact_leaves_blocks_past_the_length_alone),
                cmocka_unit_test(compact_rejects_bad_keep_sets),
                cmocka_unit_test(compact_check_keep_accepts_only_strictly_ascending_sets),
                cmocka_unit_test(block_layout_aligns_and_separates_every_array),
                cmocka_unit_test(block_layout_rejects_zero_and_unknown_fields),
                cmocka_unit_test(block_layout_rejects_blocks_over_4_gib),
                cmocka_unit_test(f16_and_bf16_round_trip_every_pattern),
                cmocka_unit_test(f16_and_bf16_round_to_nearest_even),
                cmocka_unit_test(f16_store_picks_a_nearest_value),
                cmocka_unit_test(f16_and_bf16_keep_inf_nan_zero_and_handle_the_extremes),
        };
        return cmocka_run_group_tests(tests, NULL, NULL);
}
