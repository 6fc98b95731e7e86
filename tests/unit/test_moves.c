/* test_moves.c: libkvc's side of block relocation (Plan.moves), against a daemon played here.
 *
 * Owns: a plan of moves copies every moved block byte for byte and swaps the table entries (the
 * blocks the session's table holds are the new ones); and a faulty or hostile kvcd's
 * moves are refused whole, with nothing copied and nothing changed: a `from` that is not the
 * table's entry, an entry past the table, a destination outside the pool or not aligned to the
 * block size, two moves to one place or of one entry. The session is kvc_fuzz_client_new()'s: a
 * private pool of 8 chunks of 64 KiB, the plan buffer in chunk 0.
 */
#include <errno.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "kvc_fuzz.h"
#include "wire.h"

#define CHUNK (64u * 1024u)

struct fixture {
        struct kvc_client *c;
        struct kvc_session *s;
        uint8_t *pool;
        uint64_t block_bytes;
        uint64_t next_plan;
};

static int feed(struct fixture *f, Kvc__PlanBatch *pb) {
        Kvc__Envelope env = KVC__ENVELOPE__INIT;
        env.version = WIRE_VERSION;
        env.body_case = KVC__ENVELOPE__BODY_PLAN_BATCH;
        env.plan_batch = pb;
        size_t n = wire_packed_size(&env);
        uint8_t *buf = malloc(n);
        assert_non_null(buf);
        wire_pack(&env, buf);
        int r = kvc_fuzz_feed(f->c, buf, n);
        free(buf);
        return r;
}

/* Grants layer 0's table of tier `tier` the blocks at the given offsets. */
static void grant_tier(struct fixture *f, uint32_t tier, const uint64_t *blocks, size_t n) {
        Kvc__LayerBlocks lb = KVC__LAYER_BLOCKS__INIT, *lbp = &lb;
        lb.tier = tier;
        Kvc__Grant g = KVC__GRANT__INIT, *gp = &g;
        Kvc__PlanBatch pb = KVC__PLAN_BATCH__INIT;
        lb.blocks = (uint64_t *)blocks;
        lb.n_blocks = n;
        g.session_id = 1;
        g.layers = &lbp;
        g.n_layers = 1;
        pb.grants = &gp;
        pb.n_grants = 1;
        assert_int_equal(feed(f, &pb), 0);
}

static void grant(struct fixture *f, const uint64_t *blocks, size_t n) {
        grant_tier(f, 0, blocks, n);
}

/* A plan of n moves of layer 0's table of tier `tier`: entry index[i] from from[i] to to[i]. */
static int moves_tier(struct fixture *f, uint32_t tier, size_t n, const uint32_t *index, const uint64_t *from,
                      const uint64_t *to) {
        Kvc__BlockMove mv[8], *mvp[8];
        Kvc__Plan p = KVC__PLAN__INIT, *pp = &p;
        Kvc__PlanBatch pb = KVC__PLAN_BATCH__INIT;
        assert_true(n <= 8);
        for (size_t i = 0; i < n; i++) {
                kvc__block_move__init(&mv[i]);
                mv[i].tier = tier;
                mv[i].index = index[i];
                mv[i].from = from[i];
                mv[i].to = to[i];
                mvp[i] = &mv[i];
        }
        p.session_id = 1;
        p.plan_id = ++f->next_plan;
        p.moves = mvp;
        p.n_moves = n;
        pb.plans = &pp;
        pb.n_plans = 1;
        return feed(f, &pb);
}

static int setup(void **state) {
        struct fixture *f = calloc(1, sizeof(*f));
        assert_non_null(f);
        struct kvc_geometry g = { .n_layers = 1,
                                  .n_heads = 1,
                                  .n_kv_heads = 1,
                                  .head_dim = 8,
                                  .dtype = KVC_DTYPE_F32,
                                  .max_tokens = 64 };
        assert_int_equal(kvc_fuzz_client_new(&g, 64, 1024, &f->c, &f->s), 0);
        uint64_t bytes;
        f->pool = kvc_fuzz_pool(f->c, &bytes);
        assert_int_equal(bytes, 8 * CHUNK);
        struct kvc_fuzz_tier v; /* the dtype's table (the fuzz session has q8 and q4 tiers too) */
        uint64_t blocks[3];
        assert_int_equal(kvc_fuzz_tier(f->s, 0, 0, &v), 0);
        f->block_bytes = v.block_bytes;
        for (int i = 0; i < 3; i++) /* three blocks in chunk 1, each byte marked */
                blocks[i] = CHUNK + (uint64_t)i * f->block_bytes;
        grant(f, blocks, 3);
        for (uint64_t k = 0; k < 3 * f->block_bytes; k++)
                f->pool[CHUNK + k] = (uint8_t)(k * 13 + 5);
        *state = f;
        return 0;
}

static int moves(struct fixture *f, size_t n, const uint32_t *index, const uint64_t *from,
                 const uint64_t *to) {
        return moves_tier(f, 0, n, index, from, to);
}

static int teardown(void **state) {
        struct fixture *f = *state;
        kvc_disconnect(f->c);
        free(f);
        return 0;
}

/* Layer 0's table as offsets. */
static void table(struct fixture *f, uint64_t *offs) {
        struct kvc_fuzz_tier v;
        assert_int_equal(kvc_fuzz_tier(f->s, 0, 0, &v), 0);
        assert_int_equal(v.n_blocks, 3);
        for (uint32_t i = 0; i < 3; i++)
                offs[i] = (uint64_t)(v.blocks[i] - f->pool);
}

static void moved_blocks_keep_every_byte_and_take_their_table_entries(void **state) {
        struct fixture *f = *state;
        uint64_t bb = f->block_bytes, offs[3];
        uint32_t index[2] = { 2, 0 };
        uint64_t from[2] = { CHUNK + 2 * bb, CHUNK }, to[2] = { 3 * CHUNK, 3 * CHUNK + bb };
        assert_int_equal(moves(f, 2, index, from, to), 0);
        table(f, offs);
        assert_int_equal(offs[0], 3 * CHUNK + bb);
        assert_int_equal(offs[1], CHUNK + bb); /* not moved */
        assert_int_equal(offs[2], 3 * CHUNK);
        for (uint64_t k = 0; k < bb; k++) {
                assert_int_equal(f->pool[3 * CHUNK + bb + k], (uint8_t)(k * 13 + 5));
                assert_int_equal(f->pool[3 * CHUNK + k], (uint8_t)((2 * bb + k) * 13 + 5));
        }
        struct kvc_session_stats st;
        kvc_session_get_stats(f->s, &st);
        assert_int_equal(st.blocks_moved, 2);
        assert_int_equal(st.plans_applied, 1);
}

static void bad_moves_are_refused_whole(void **state) {
        struct fixture *f = *state;
        uint64_t bb = f->block_bytes, before[3], after[3];
        table(f, before);
        uint8_t *copy = malloc(8 * CHUNK);
        assert_non_null(copy);
        memcpy(copy, f->pool, 8 * CHUNK);
        struct {
                const char *what;
                uint32_t index[2];
                uint64_t from[2], to[2];
                size_t n;
        } cases[] = {
                { "from is not the entry", { 0, 1 }, { CHUNK, CHUNK }, { 3 * CHUNK, 3 * CHUNK + bb }, 2 },
                { "entry past the table",
                  { 0, 3 },
                  { CHUNK, CHUNK + 3 * bb },
                  { 3 * CHUNK, 3 * CHUNK + bb },
                  2 },
                { "outside the pool", { 0, 1 }, { CHUNK, CHUNK + bb }, { 3 * CHUNK, 8 * CHUNK }, 2 },
                { "across the pool's end",
                  { 0, 1 },
                  { CHUNK, CHUNK + bb },
                  { 3 * CHUNK, 8 * CHUNK - 64 },
                  2 },
                { "not block-aligned", { 0, 1 }, { CHUNK, CHUNK + bb }, { 3 * CHUNK, 3 * CHUNK + 64 }, 2 },
                { "two moves to one place", { 0, 1 }, { CHUNK, CHUNK + bb }, { 3 * CHUNK, 3 * CHUNK }, 2 },
                { "one entry moved twice",
                  { 1, 1 },
                  { CHUNK + bb, CHUNK + bb },
                  { 3 * CHUNK, 4 * CHUNK },
                  2 },
        };
        for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
                int r = moves(f, cases[i].n, cases[i].index, cases[i].from, cases[i].to);
                if (r != -EPROTO && r != -EINVAL)
                        fail_msg("%s: %d, not refused", cases[i].what, r);
                table(f, after);
                if (memcmp(before, after, sizeof(before)) || memcmp(copy, f->pool, 8 * CHUNK))
                        fail_msg("%s: refused, but something changed", cases[i].what);
        }
        struct kvc_session_stats st;
        kvc_session_get_stats(f->s, &st);
        assert_int_equal(st.blocks_moved, 0);
        free(copy);
}

/* The ladder's packed tier (q4: the fuzz session's tier 2) moves as the dtype's does: its block byte
 * for byte, into its own table; a move naming the wrong table is refused. */
static void a_packed_tier_block_moves_with_its_bytes(void **state) {
        struct fixture *f = *state;
        struct kvc_fuzz_tier v;
        assert_int_equal(kvc_fuzz_tier(f->s, 0, 2, &v), 0);
        uint64_t qb = v.block_bytes, blocks[2] = { 5 * CHUNK, 5 * CHUNK + qb };
        grant_tier(f, 2, blocks, 2);
        for (uint64_t k = 0; k < 2 * qb; k++)
                f->pool[5 * CHUNK + k] = (uint8_t)(k * 7 + 3);
        uint32_t index[1] = { 1 };
        uint64_t from[1] = { 5 * CHUNK + qb }, to[1] = { 6 * CHUNK };
        assert_int_equal(moves_tier(f, 0, 1, index, from, to), -EPROTO); /* not the dtype's entry 1 */
        assert_int_equal(moves_tier(f, 2, 1, index, from, to), 0);
        assert_int_equal(kvc_fuzz_tier(f->s, 0, 2, &v), 0);
        assert_int_equal(v.n_blocks, 2);
        assert_ptr_equal(v.blocks[0], f->pool + 5 * CHUNK);
        assert_ptr_equal(v.blocks[1], f->pool + 6 * CHUNK);
        for (uint64_t k = 0; k < qb; k++)
                assert_int_equal(f->pool[6 * CHUNK + k], (uint8_t)((qb + k) * 7 + 3));
}

int main(void) {
        const struct CMUnitTest tests[] = {
                cmocka_unit_test_setup_teardown(moved_blocks_keep_every_byte_and_take_their_table_entries,
                                                setup, teardown),
                cmocka_unit_test_setup_teardown(bad_moves_are_refused_whole, setup, teardown),
                cmocka_unit_test_setup_teardown(a_packed_tier_block_moves_with_its_bytes, setup, teardown),
        };
        return cmocka_run_group_tests(tests, NULL, NULL);
}
