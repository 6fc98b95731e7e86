/* test_pool.c - unit tests of daemon/pool.c (with the real host backend) and daemon/idmap.c.
 *
 * Owns: the pool's accounting (used bytes, the capacity as a hard limit), its isolation (a chunk
 * holds one owner's units, and is scrubbed before another owner gets it), the carving of chunks
 * into units, the refusal of releases that are not allocations, and a seeded random sequence of
 * allocations and releases checked after every operation against a shadow model and
 * pool_audit(). For idmap: put/get/del, duplicates, keys built to collide (including around the
 * end of the table, where backward-shift deletion wraps), growth, and a random sequence against
 * a shadow array.
 *
 * The host backend makes real memfd chunks, so what a test writes through pool_ptr() is real
 * memory: the scrub test reads it back through a new owner's allocation.
 */
#include <errno.h>
#include <setjmp.h>
#include <stdbool.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "testutil.h"

#include "backend.h"
#include "idmap.h"
#include "pool.h"

#define MIB   (1ull << 20)
#define CHUNK (2 * MIB)

static const struct backend_ops *host(void) {
        const struct backend_ops *ops = NULL;
        assert_int_equal(backend_find("host", &ops), 0);
        assert_non_null(ops);
        return ops;
}

static struct pool *pool_make(uint64_t capacity_bytes) {
        struct pool *p = NULL;
        assert_int_equal(pool_new(host(), capacity_bytes, CHUNK, &p), 0);
        assert_non_null(p);
        return p;
}

static uint64_t used_bytes(const struct pool *p) {
        struct pool_stats st;
        pool_get_stats(p, &st);
        return st.used_bytes;
}

static uint32_t chunks_owned(const struct pool *p) {
        struct pool_stats st;
        pool_get_stats(p, &st);
        return st.chunks_owned;
}

static void assert_audit_clean(const struct pool *p) {
        char why[256] = "";
        int r = pool_audit(p, why, sizeof(why));
        if (r != 0)
                fail_msg("pool_audit: %d (%s)", r, why);
}

static uint64_t alloc_ok(struct pool *p, uint64_t owner, uint32_t unit_bytes, uint32_t n_units,
                         int64_t *ret_new_chunk) {
        uint64_t off = UINT64_MAX;
        int64_t nc = -2;
        int r = pool_alloc(p, owner, unit_bytes, n_units, &off, &nc);
        if (r != 0)
                fail_msg("pool_alloc(owner %llu, %u x %u) = %d", (unsigned long long)owner, n_units,
                         unit_bytes, r);
        assert_true(nc >= -1);
        assert_true(off % CHUNK % unit_bytes == 0);
        assert_true(off / CHUNK == (off + (uint64_t)unit_bytes * n_units - 1) / CHUNK);
        if (ret_new_chunk)
                *ret_new_chunk = nc;
        return off;
}

/* ---- pool ---- */

static void backend_find_knows_host_and_refuses_the_rest(void **state) {
        const struct backend_ops *ops = NULL;
        (void)state;
        assert_int_equal(backend_find("host", &ops), 0);
        assert_string_equal(ops->name, "host");
        assert_int_equal(backend_find("nope", &ops), -ENOENT);
        assert_int_equal(backend_find("cuda", &ops), 0); /* opens only where a GPU is: test_cuda_backend */
}

static void pool_new_rejects_sizes_that_hold_no_chunk(void **state) {
        struct pool *p = NULL;
        (void)state;
        assert_int_equal(pool_new(host(), 8 * MIB, 0, &p), -EINVAL);
        assert_int_equal(pool_new(host(), 8 * MIB, MIB, &p), -EINVAL);
        assert_int_equal(pool_new(host(), 8 * MIB, 3 * MIB, &p), -EINVAL);
        assert_int_equal(pool_new(host(), CHUNK - 1, CHUNK, &p), -EINVAL);
        assert_int_equal(pool_new(host(), 16ull << 30, 8ull << 30, &p), -EINVAL);
        assert_null(p);
        assert_null(pool_free(NULL));
}

static void pool_counts_used_bytes_across_alloc_and_release(void **state) {
        struct pool *p = pool_make(8 * MIB);
        struct pool_stats st;
        (void)state;

        pool_get_stats(p, &st);
        assert_int_equal(st.capacity_bytes, 8 * MIB);
        assert_int_equal(st.chunk_bytes, CHUNK);
        assert_int_equal(st.chunks_total, 4);
        assert_int_equal(st.used_bytes, 0);
        assert_int_equal(st.chunks_owned, 0);
        assert_int_equal(st.chunks_created, 0);
        assert_int_equal(pool_chunk_bytes(p), CHUNK);
        assert_int_equal(pool_va_bytes(p), 8 * MIB);

        uint64_t a = alloc_ok(p, 1, 4096, 3, NULL);
        assert_int_equal(used_bytes(p), 3 * 4096);
        uint64_t b = alloc_ok(p, 1, 4096, 1, NULL);
        assert_int_equal(used_bytes(p), 4 * 4096);
        uint64_t c = alloc_ok(p, 2, 192, 10, NULL);
        assert_int_equal(used_bytes(p), 4 * 4096 + 1920);
        assert_int_equal(chunks_owned(p), 2);
        assert_audit_clean(p);

        assert_int_equal(pool_release(p, 1, a, 4096, 3), 0);
        assert_int_equal(used_bytes(p), 4096 + 1920);
        assert_int_equal(pool_release(p, 2, c, 192, 10), 0);
        assert_int_equal(used_bytes(p), 4096);
        assert_int_equal(pool_release(p, 1, b, 4096, 1), 0);
        assert_int_equal(used_bytes(p), 0);
        /* empty chunks stay with their owners until they go */
        assert_int_equal(chunks_owned(p), 2);
        assert_audit_clean(p);
        pool_free(p);
}

static void pool_rejects_bad_alloc_arguments(void **state) {
        struct pool *p = pool_make(8 * MIB);
        uint64_t off = 12345;
        int64_t nc = 12345;
        (void)state;

        assert_int_equal(pool_alloc(p, 0, 4096, 1, &off, &nc), -EINVAL);
        assert_int_equal(pool_alloc(p, 1, 0, 1, &off, &nc), -EINVAL);
        assert_int_equal(pool_alloc(p, 1, 100, 1, &off, &nc), -EINVAL);
        assert_int_equal(pool_alloc(p, 1, 4096, 0, &off, &nc), -EINVAL);
        assert_int_equal(pool_alloc(p, 1, 4096, CHUNK / 4096 + 1, &off, &nc), -EINVAL);
        assert_int_equal(pool_alloc(p, 1, UINT32_MAX - 63, 2, &off, &nc), -EINVAL);
        assert_int_equal(off, 12345);
        assert_int_equal(nc, 12345);
        assert_int_equal(used_bytes(p), 0);
        assert_int_equal(chunks_owned(p), 0);
        /* a whole chunk in one allocation is fine */
        alloc_ok(p, 1, CHUNK / 2, 2, NULL);
        assert_int_equal(used_bytes(p), CHUNK);
        pool_free(p);
}

/* Used bytes reach the capacity exactly, and not one unit more. */
static void pool_refuses_allocation_past_capacity(void **state) {
        struct pool *p = pool_make(2 * CHUNK);
        uint64_t offs[4], off = 777;
        int64_t nc = 777;
        (void)state;

        for (int i = 0; i < 4; i++)
                offs[i] = alloc_ok(p, 1, MIB, 1, NULL);
        assert_int_equal(used_bytes(p), 2 * CHUNK);
        assert_int_equal(pool_alloc(p, 1, MIB, 1, &off, &nc), -ENOSPC);
        assert_int_equal(pool_alloc(p, 1, 64, 1, &off, &nc), -ENOSPC);
        assert_int_equal(pool_alloc(p, 2, 64, 1, &off, &nc), -ENOSPC);
        assert_int_equal(off, 777);
        assert_int_equal(nc, 777);
        assert_int_equal(used_bytes(p), 2 * CHUNK);

        /* one unit back, one unit in */
        assert_int_equal(pool_release(p, 1, offs[2], MIB, 1), 0);
        assert_int_equal(alloc_ok(p, 1, MIB, 1, NULL), offs[2]);
        assert_int_equal(pool_alloc(p, 1, MIB, 1, &off, &nc), -ENOSPC);
        assert_audit_clean(p);
        pool_free(p);
}

/* A capacity between two chunk multiples: the pool has the whole chunks that fit, never more. */
static void pool_never_passes_a_capacity_that_is_not_a_chunk_multiple(void **state) {
        struct pool *p = pool_make(2 * CHUNK + MIB);
        struct pool_stats st;
        uint64_t off;
        int64_t nc;
        uint32_t n = 0;
        (void)state;

        pool_get_stats(p, &st);
        assert_int_equal(st.chunks_total, 2);
        while (pool_alloc(p, 1 + n % 2, 65536, 1, &off, &nc) == 0)
                n++;
        assert_int_equal(n, 2 * CHUNK / 65536);
        assert_true(used_bytes(p) <= 2 * CHUNK + MIB);
        assert_int_equal(pool_alloc(p, 3, 64, 1, &off, &nc), -ENOSPC);
        assert_audit_clean(p);
        pool_free(p);
}

static void pool_reports_each_new_chunk_once(void **state) {
        struct pool *p = pool_make(8 * MIB);
        struct pool_stats st;
        int64_t nc;
        (void)state;

        uint64_t a = alloc_ok(p, 1, 4096, 1, &nc);
        assert_true(nc >= 0);
        assert_int_equal(a / CHUNK, (uint64_t)nc);
        assert_true(pool_chunk_fd(p, (uint32_t)nc) >= 0);
        alloc_ok(p, 1, 4096, 1, &nc);
        assert_int_equal(nc, -1);
        /* another unit size of the same owner needs another chunk: it is new to nobody else */
        uint64_t b = alloc_ok(p, 1, 8192, 1, &nc);
        assert_true(nc >= 0);
        assert_int_equal(b / CHUNK, (uint64_t)nc);
        assert_true(b / CHUNK != a / CHUNK);
        /* fill the first chunk: the next unit of that size comes in a new chunk */
        for (uint32_t i = 2; i < CHUNK / 4096; i++) {
                alloc_ok(p, 1, 4096, 1, &nc);
                assert_int_equal(nc, -1);
        }
        uint64_t c = alloc_ok(p, 1, 4096, 1, &nc);
        assert_true(nc >= 0);
        assert_int_equal(c / CHUNK, (uint64_t)nc);
        pool_get_stats(p, &st);
        assert_int_equal(st.chunks_owned, 3);
        assert_int_equal(st.chunks_created, 3);
        assert_int_equal(pool_chunk_fd(p, st.chunks_total), -1);
        assert_audit_clean(p);
        pool_free(p);
}

static void pool_never_shares_a_chunk_between_owners(void **state) {
        struct pool *p = pool_make(8 * MIB);
        uint64_t chunk_owner[4] = { 0 };
        (void)state;

        for (int i = 0; i < 60; i++) {
                uint64_t owner = 1 + (uint64_t)(i % 3);
                int64_t nc;
                uint64_t off = alloc_ok(p, owner, 4096, 1 + (uint32_t)(i % 4), &nc);
                uint64_t idx = off / CHUNK;
                assert_true(idx < 4);
                if (chunk_owner[idx] == 0) {
                        assert_int_equal(nc, (int64_t)idx);
                        chunk_owner[idx] = owner;
                } else {
                        assert_int_equal(nc, -1);
                }
                assert_int_equal(chunk_owner[idx], owner);
        }
        /* three owners, three chunks, although the first has room for everybody */
        assert_int_equal(chunks_owned(p), 3);
        /* the fourth owner takes the last chunk, a fifth finds none */
        uint64_t off;
        int64_t nc;
        alloc_ok(p, 4, 64, 1, &nc);
        assert_true(nc >= 0 && chunk_owner[nc] == 0);
        assert_int_equal(pool_alloc(p, 5, 64, 1, &off, &nc), -ENOSPC);
        assert_audit_clean(p);
        pool_free(p);
}

/* Every way to name a range that is not one of owner's allocations of that unit size. */
static void pool_rejects_release_of_what_is_not_an_allocation(void **state) {
        struct pool *p = pool_make(8 * MIB);
        struct pool_stats before, after;
        (void)state;

        uint64_t a = alloc_ok(p, 1, 4096, 4, NULL);
        uint64_t b = alloc_ok(p, 2, 4096, 1, NULL);
        uint64_t last = alloc_ok(p, 1, 8192, 1, NULL);
        pool_get_stats(p, &before);

        const struct {
                uint64_t owner, offset;
                uint32_t unit_bytes, n_units;
        } bad[] = {
                { 2, a, 4096, 4 }, /* another owner's */
                { 0, a, 4096, 4 }, /* owner 0 */
                { 1, a, 8192, 2 }, /* same bytes, other unit size */
                { 1, a, 2048, 8 },
                { 1, a, 0, 4 },                                   /* no unit size */
                { 1, a + 64, 4096, 1 },                           /* not on a unit boundary */
                { 1, a, 4096, 5 },                                /* runs past the allocation */
                { 1, a + 4 * 4096, 4096, 1 },                     /* never allocated */
                { 1, b, 4096, 1 },                                /* owner 2's chunk */
                { 1, last + 8192 * (CHUNK / 8192 - 1), 8192, 2 }, /* past the chunk's end */
                { 1, 3 * CHUNK, 4096, 1 },                        /* a free chunk */
                { 1, 4 * CHUNK, 4096, 1 },                        /* past the pool */
                { 1, UINT64_MAX - 4095, 4096, 1 },
                { 1, a, 4096, UINT32_MAX },
        };
        for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
                int r = pool_release(p, bad[i].owner, bad[i].offset, bad[i].unit_bytes, bad[i].n_units);
                if (r != -EINVAL)
                        fail_msg("bad release %zu returned %d", i, r);
                pool_get_stats(p, &after);
                assert_int_equal(after.used_bytes, before.used_bytes);
                assert_int_equal(after.chunks_owned, before.chunks_owned);
                assert_int_equal(after.chunks_created, before.chunks_created);
                assert_audit_clean(p);
        }
        /* a double release */
        assert_int_equal(pool_release(p, 2, b, 4096, 1), 0);
        assert_int_equal(pool_release(p, 2, b, 4096, 1), -EINVAL);
        /* the real ones still go */
        assert_int_equal(pool_release(p, 1, a, 4096, 4), 0);
        assert_int_equal(pool_release(p, 1, last, 8192, 1), 0);
        assert_int_equal(used_bytes(p), 0);
        assert_audit_clean(p);
        pool_free(p);
}

/* Releasing zero units releases nothing, so it names no allocation. */
static void pool_rejects_release_of_zero_units(void **state) {
        struct pool *p = pool_make(8 * MIB);
        (void)state;
        uint64_t a = alloc_ok(p, 1, 4096, 1, NULL);
        assert_int_equal(pool_release(p, 1, a, 4096, 0), -EINVAL);
        assert_int_equal(pool_release(p, 1, a + 4096, 4096, 0), -EINVAL);
        assert_int_equal(used_bytes(p), 4096);
        pool_free(p);
}

static void pool_scrubs_the_chunks_of_an_owner_that_goes(void **state) {
        struct pool *p = pool_make(2 * CHUNK);
        (void)state;

        uint64_t a = alloc_ok(p, 1, 65536, 32, NULL); /* the whole first chunk */
        uint64_t b = alloc_ok(p, 1, 4096, 3, NULL);   /* part of the second */
        memset(pool_ptr(p, a), 0xa5, CHUNK);
        memset(pool_ptr(p, b), 0x5a, 3 * 4096);
        assert_int_equal(chunks_owned(p), 2);

        assert_int_equal(pool_release_owner(p, 1), 2);
        assert_int_equal(used_bytes(p), 0);
        assert_int_equal(chunks_owned(p), 0);
        assert_int_equal(pool_release_owner(p, 1), 0);
        assert_int_equal(pool_release_owner(p, 0), 0);
        assert_int_equal(pool_release(p, 1, b, 4096, 3), -EINVAL);
        assert_audit_clean(p);

        /* owner 2 gets both chunks back, announced as new to it, and reads zeros everywhere */
        int64_t nc1, nc2;
        uint64_t c = alloc_ok(p, 2, 65536, 32, &nc1);
        uint64_t d = alloc_ok(p, 2, 1024, 2048, &nc2);
        assert_true(nc1 >= 0 && nc2 >= 0 && nc1 != nc2);
        const uint8_t *pc = pool_ptr(p, c), *pd = pool_ptr(p, d);
        for (uint64_t i = 0; i < CHUNK; i++)
                if (pc[i] != 0 || pd[i] != 0)
                        fail_msg("byte %llu of a re-granted chunk is not zero", (unsigned long long)i);
        pool_free(p);
}

static void pool_disowns_a_chunk_whose_fd_did_not_arrive(void **state) {
        struct pool *p = pool_make(8 * MIB);
        int64_t nc;
        (void)state;
        uint64_t a = alloc_ok(p, 1, 4096, 2, &nc);
        assert_true(nc >= 0);
        assert_int_equal(pool_release(p, 1, a, 4096, 2), 0);
        pool_disown_chunk(p, (uint32_t)nc);
        assert_int_equal(chunks_owned(p), 0);
        pool_disown_chunk(p, (uint32_t)nc); /* twice is harmless */
        pool_disown_chunk(p, 1000);
        assert_int_equal(chunks_owned(p), 0);
        assert_audit_clean(p);
        /* the same chunk goes to the next comer, announced again */
        int64_t nc2;
        alloc_ok(p, 2, 4096, 1, &nc2);
        assert_int_equal(nc2, nc);
        pool_free(p);
}

static void pool_recarves_an_empty_chunk_for_another_unit_size(void **state) {
        struct pool *p = pool_make(CHUNK);
        uint64_t off;
        int64_t nc;
        (void)state;

        uint64_t a = alloc_ok(p, 1, 64, 5, &nc);
        assert_true(nc >= 0);
        /* the only chunk is carved in 64-byte units and in use: no room for another size */
        assert_int_equal(pool_alloc(p, 1, 128, 1, &off, &nc), -ENOSPC);
        assert_int_equal(pool_release(p, 1, a, 64, 5), 0);
        /* empty now: re-carved in 128 KiB units, not announced again */
        uint64_t b = alloc_ok(p, 1, 131072, 16, &nc);
        assert_int_equal(nc, -1);
        assert_int_equal(b, 0);
        assert_int_equal(used_bytes(p), CHUNK);
        assert_int_equal(pool_release(p, 1, a, 64, 5), -EINVAL); /* the old carving is gone */
        assert_int_equal(pool_release(p, 1, b, 131072, 16), 0);
        alloc_ok(p, 1, 64, 1, &nc);
        assert_int_equal(nc, -1);
        assert_audit_clean(p);
        pool_free(p);
}

/* Runs of several units are contiguous, do not overlap anything live, and skip holes that are too
 * small. */
static void pool_allocates_contiguous_runs(void **state) {
        struct pool *p = pool_make(CHUNK);
        uint64_t single[10];
        (void)state;

        for (int i = 0; i < 10; i++) {
                single[i] = alloc_ok(p, 1, 4096, 1, NULL);
                memset(pool_ptr(p, single[i]), 0x10 + i, 4096);
        }
        for (int i = 0; i < 10; i += 2)
                assert_int_equal(pool_release(p, 1, single[i], 4096, 1), 0);
        /* one-unit holes: a run of three must go past all of them */
        uint64_t run = alloc_ok(p, 1, 4096, 3, NULL);
        for (int i = 1; i < 10; i += 2)
                assert_true(run + 3 * 4096 <= single[i] || run >= single[i] + 4096);
        memset(pool_ptr(p, run), 0xee, 3 * 4096);
        for (int i = 1; i < 10; i += 2) {
                const uint8_t *s = pool_ptr(p, single[i]);
                for (int j = 0; j < 4096; j++)
                        assert_int_equal(s[j], 0x10 + i);
        }
        /* a single unit does fill a hole */
        uint64_t one = alloc_ok(p, 1, 4096, 1, NULL);
        assert_true(one < single[9]);
        /* release the run in one piece */
        assert_int_equal(pool_release(p, 1, run, 4096, 3), 0);
        assert_int_equal(used_bytes(p), 6 * 4096);
        assert_audit_clean(p);
        pool_free(p);
}

/* Runs of 7 units straddle the 64-unit words of the bitmap; they fill a chunk to the last run
 * that fits, and single units fill the rest. Owner 2 holds the other chunk, so a failure is the
 * chunk's, not the capacity's. */
static void pool_fills_a_chunk_with_runs_exactly(void **state) {
        struct pool *p = pool_make(2 * CHUNK);
        uint32_t units = CHUNK / 1024, taken = 0;
        uint64_t off;
        int64_t nc;
        (void)state;

        alloc_ok(p, 2, 64, 1, NULL);
        while (taken + 7 <= units) {
                alloc_ok(p, 1, 1024, 7, NULL);
                taken += 7;
        }
        assert_int_equal(pool_alloc(p, 1, 1024, 7, &off, &nc), -ENOSPC);
        while (taken < units) {
                alloc_ok(p, 1, 1024, 1, NULL);
                taken++;
        }
        assert_int_equal(used_bytes(p), CHUNK + 64);
        assert_int_equal(pool_alloc(p, 1, 1024, 1, &off, &nc), -ENOSPC);
        assert_audit_clean(p);
        pool_free(p);
}

struct live {
        uint64_t owner, offset;
        uint32_t unit_bytes, n_units;
};

/* A seeded sequence of allocations, releases, bad releases and owner departures, checked after
 * every operation against a shadow list of what is live. The memory of each allocation carries
 * its index; a clash between two allocations would overwrite it. */
static void pool_stays_consistent_under_random_operations(void **state) {
        enum { N_OPS = 4000, MAX_LIVE = 4096, N_OWNERS = 5 };
        static const uint32_t sizes[] = { 64, 192, 4096, 65536, 133632 };
        struct pool *p = pool_make(4 * CHUNK);
        struct live *live = calloc(MAX_LIVE, sizeof(*live));
        uint64_t model_used = 0;
        uint32_t n_live = 0, n_nospc = 0, n_departures = 0;
        (void)state;

        assert_non_null(live);
        rng_state = 0x5eed0001;
        for (int op = 0; op < N_OPS; op++) {
                uint32_t what = rng_below(100);
                if (what < 55 && n_live < MAX_LIVE) {
                        struct live l = { .owner = 1 + rng_below(N_OWNERS),
                                          .unit_bytes = sizes[rng_below(5)],
                                          .n_units = 1 + rng_below(8) };
                        int64_t nc;
                        int r = pool_alloc(p, l.owner, l.unit_bytes, l.n_units, &l.offset, &nc);
                        if (r == -ENOSPC) {
                                n_nospc++;
                        } else {
                                assert_int_equal(r, 0);
                                uint64_t end = l.offset + (uint64_t)l.unit_bytes * l.n_units;
                                assert_int_equal(l.offset / CHUNK, (end - 1) / CHUNK);
                                for (uint32_t i = 0; i < n_live; i++) {
                                        const struct live *o = &live[i];
                                        uint64_t oend = o->offset + (uint64_t)o->unit_bytes * o->n_units;
                                        assert_false(l.offset < oend && o->offset < end);
                                        if (o->offset / CHUNK == l.offset / CHUNK)
                                                assert_int_equal(o->owner, l.owner);
                                }
                                for (uint32_t u = 0; u < l.n_units; u++)
                                        memcpy(pool_ptr(p, l.offset + (uint64_t)u * l.unit_bytes), &n_live,
                                               4);
                                live[n_live++] = l;
                                model_used += (uint64_t)l.unit_bytes * l.n_units;
                        }
                } else if (what < 90 && n_live > 0) {
                        uint32_t i = rng_below(n_live);
                        struct live l = live[i];
                        for (uint32_t u = 0; u < l.n_units; u++) {
                                uint32_t tag;
                                memcpy(&tag, pool_ptr(p, l.offset + (uint64_t)u * l.unit_bytes), 4);
                                assert_int_equal(tag, i);
                        }
                        /* a wrong owner first: refused */
                        assert_int_equal(
                                pool_release(p, l.owner % N_OWNERS + 1, l.offset, l.unit_bytes, l.n_units),
                                -EINVAL);
                        assert_int_equal(pool_release(p, l.owner, l.offset, l.unit_bytes, l.n_units), 0);
                        model_used -= (uint64_t)l.unit_bytes * l.n_units;
                        live[i] = live[--n_live];
                        if (i < n_live) /* the moved one carries its new index */
                                for (uint32_t u = 0; u < live[i].n_units; u++)
                                        memcpy(pool_ptr(p, live[i].offset + (uint64_t)u * live[i].unit_bytes),
                                               &i, 4);
                } else if (what < 93) {
                        uint64_t owner = 1 + rng_below(N_OWNERS);
                        pool_release_owner(p, owner);
                        n_departures++;
                        for (uint32_t i = 0; i < n_live;) {
                                if (live[i].owner != owner) {
                                        i++;
                                        continue;
                                }
                                model_used -= (uint64_t)live[i].unit_bytes * live[i].n_units;
                                live[i] = live[--n_live];
                                /* the moved one carries its new index, unless it left too (its
                                 * chunk is retired: not mapped any more) */
                                if (i < n_live && live[i].owner != owner)
                                        for (uint32_t u = 0; u < live[i].n_units; u++)
                                                memcpy(pool_ptr(p, live[i].offset +
                                                                           (uint64_t)u * live[i].unit_bytes),
                                                       &i, 4);
                        }
                } else if (n_live > 0) {
                        /* a release that overlaps a live allocation but is not one */
                        const struct live *l = &live[rng_below(n_live)];
                        assert_int_equal(pool_release(p, l->owner, l->offset, l->unit_bytes,
                                                      l->n_units + 1 + (uint32_t)(CHUNK / l->unit_bytes)),
                                         -EINVAL);
                }
                assert_int_equal(used_bytes(p), model_used);
                assert_true(model_used <= 4 * CHUNK);
                assert_audit_clean(p);
        }
        /* the run went through the interesting states */
        assert_true(n_nospc > 0);
        assert_true(n_departures > 0);
        for (uint64_t o = 1; o <= N_OWNERS; o++)
                pool_release_owner(p, o);
        assert_int_equal(used_bytes(p), 0);
        assert_int_equal(chunks_owned(p), 0);
        assert_audit_clean(p);
        free(live);
        pool_free(p);
}

/* ---- idmap ---- */

/* The probe start of idmap.c, copied to build keys that collide on purpose. If idmap.c changes
 * its hash the tests stay correct, only less pointed. */
static uint32_t home_slot(uint64_t key, uint32_t cap) {
        key ^= key >> 33;
        key *= 0xff51afd7ed558ccdull;
        key ^= key >> 33;
        return (uint32_t)key & (cap - 1);
}

/* The n smallest keys >= from whose home slot in a table of cap is `slot`. */
static void keys_with_home(uint32_t slot, uint32_t cap, uint64_t from, uint64_t *out, uint32_t n) {
        for (uint64_t k = from; n > 0; k++) {
                if (home_slot(k, cap) == slot) {
                        *out++ = k;
                        n--;
                }
        }
}

static void *val(uint64_t key) {
        return (void *)(uintptr_t)(key * 16 + 8);
}

static void idmap_puts_gets_and_deletes(void **state) {
        struct idmap m;
        (void)state;
        assert_int_equal(idmap_init(&m, 4), 0);
        assert_null(idmap_get(&m, 1));
        assert_int_equal(idmap_put(&m, 1, val(1)), 0);
        assert_int_equal(idmap_put(&m, 0xffffffffffffffffull, val(2)), 0);
        assert_ptr_equal(idmap_get(&m, 1), val(1));
        assert_ptr_equal(idmap_get(&m, 0xffffffffffffffffull), val(2));
        assert_int_equal(m.n, 2);
        assert_ptr_equal(idmap_del(&m, 1), val(1));
        assert_null(idmap_get(&m, 1));
        assert_null(idmap_del(&m, 1));
        assert_null(idmap_del(&m, 12345));
        assert_int_equal(m.n, 1);
        /* key 0 is "empty": never stored */
        assert_int_equal(idmap_put(&m, 0, val(3)), -EINVAL);
        assert_null(idmap_get(&m, 0));
        assert_null(idmap_del(&m, 0));
        assert_int_equal(m.n, 1);
        idmap_done(&m);
        assert_null(m.keys);
        assert_int_equal(m.cap, 0);
}

static void idmap_rejects_duplicate_keys(void **state) {
        struct idmap m;
        (void)state;
        assert_int_equal(idmap_init(&m, 0), 0);
        assert_int_equal(idmap_put(&m, 42, val(42)), 0);
        assert_int_equal(idmap_put(&m, 42, val(43)), -EEXIST);
        assert_ptr_equal(idmap_get(&m, 42), val(42));
        assert_int_equal(m.n, 1);
        /* also when the duplicate arrives just as the table must grow */
        for (uint64_t k = 100; m.n + 1 <= m.cap / 2; k++)
                assert_int_equal(idmap_put(&m, k, val(k)), 0);
        uint32_t cap = m.cap, n = m.n;
        assert_int_equal(idmap_put(&m, 42, val(44)), -EEXIST);
        assert_int_equal(m.n, n);
        assert_true(m.cap >= cap);
        assert_ptr_equal(idmap_get(&m, 42), val(42));
        idmap_done(&m);
}

/* Keys that share a home slot, including the last slot of the table (their probe wraps to slot
 * 0), deleted in every order: each remaining key stays reachable. */
static void idmap_keeps_colliding_keys_reachable(void **state) {
        enum { CAP = 16, N = 7 };
        (void)state;
        for (uint32_t home = CAP - 3; home < CAP; home++) {
                uint64_t keys[N], near[2];
                keys_with_home(home, CAP, 1, keys, N - 2);
                /* two keys whose home is a slot the cluster runs over */
                keys_with_home((home + 2) % CAP, CAP, 1, near, 2);
                keys[N - 2] = near[0];
                keys[N - 1] = near[1];
                for (uint32_t first = 0; first < N; first++) {
                        for (uint32_t stride = 1; stride < N; stride++) {
                                struct idmap m;
                                assert_int_equal(idmap_init(&m, N), 0);
                                assert_int_equal(m.cap, CAP);
                                for (uint32_t i = 0; i < N; i++)
                                        assert_int_equal(idmap_put(&m, keys[i], val(keys[i])), 0);
                                assert_int_equal(m.cap, CAP); /* no growth: the collisions stay */
                                bool gone[N] = { false };
                                for (uint32_t d = 0; d < N; d++) {
                                        uint32_t i = (first + d * stride) % N;
                                        if (gone[i])
                                                continue;
                                        assert_ptr_equal(idmap_del(&m, keys[i]), val(keys[i]));
                                        gone[i] = true;
                                        for (uint32_t j = 0; j < N; j++) {
                                                if (gone[j])
                                                        assert_null(idmap_get(&m, keys[j]));
                                                else
                                                        assert_ptr_equal(idmap_get(&m, keys[j]),
                                                                         val(keys[j]));
                                        }
                                }
                                idmap_done(&m);
                        }
                }
        }
}

static void idmap_grows_and_keeps_every_entry(void **state) {
        enum { N = 20000 };
        struct idmap m;
        (void)state;
        assert_int_equal(idmap_init(&m, 1), 0);
        for (uint64_t k = 1; k <= N; k++) {
                assert_int_equal(idmap_put(&m, k * 0x10001ull, val(k)), 0);
                assert_true(m.n * 2 <= m.cap);
        }
        assert_int_equal(m.n, N);
        for (uint64_t k = 1; k <= N; k++)
                assert_ptr_equal(idmap_get(&m, k * 0x10001ull), val(k));
        for (uint64_t k = 1; k <= N; k += 2)
                assert_ptr_equal(idmap_del(&m, k * 0x10001ull), val(k));
        for (uint64_t k = 1; k <= N; k++) {
                if (k % 2)
                        assert_null(idmap_get(&m, k * 0x10001ull));
                else
                        assert_ptr_equal(idmap_get(&m, k * 0x10001ull), val(k));
        }
        assert_int_equal(m.n, N / 2);
        idmap_done(&m);
}

/* Keys from a small range, so that puts of present keys, deletes of absent ones and long probe
 * chains are all frequent. */
static void idmap_matches_a_shadow_array_under_random_operations(void **state) {
        enum { KEYS = 600, N_OPS = 60000 };
        struct idmap m;
        void **shadow = calloc(KEYS + 1, sizeof(*shadow));
        uint32_t n = 0;
        (void)state;

        assert_non_null(shadow);
        assert_int_equal(idmap_init(&m, 8), 0);
        rng_state = 0x1d3a9;
        for (int op = 0; op < N_OPS; op++) {
                /* a drift towards puts in the first half, deletes in the second */
                uint32_t bias = op < N_OPS / 2 ? 60 : 40;
                uint64_t k = 1 + rng_below(KEYS);
                void *v = val(k ^ (uint64_t)op);
                uint32_t what = rng_below(100);
                if (what < bias) {
                        int r = idmap_put(&m, k, v);
                        if (shadow[k]) {
                                assert_int_equal(r, -EEXIST);
                        } else {
                                assert_int_equal(r, 0);
                                shadow[k] = v;
                                n++;
                        }
                } else if (what < 95) {
                        assert_ptr_equal(idmap_del(&m, k), shadow[k]);
                        if (shadow[k])
                                n--;
                        shadow[k] = NULL;
                } else {
                        assert_ptr_equal(idmap_get(&m, k), shadow[k]);
                }
                assert_int_equal(m.n, n);
                if (op % 97 == 0)
                        for (uint64_t j = 0; j <= KEYS; j++)
                                assert_ptr_equal(idmap_get(&m, j), shadow[j]);
        }
        /* every stored key sits at or after its home slot, with no empty slot in between */
        for (uint32_t s = 0; s < m.cap; s++) {
                if (!m.keys[s])
                        continue;
                for (uint32_t i = home_slot(m.keys[s], m.cap); i != s; i = (i + 1) & (m.cap - 1))
                        assert_true(m.keys[i] != 0);
        }
        idmap_done(&m);
        free(shadow);
}

int main(void) {
        const struct CMUnitTest tests[] = {
                cmocka_unit_test(backend_find_knows_host_and_refuses_the_rest),
                cmocka_unit_test(pool_new_rejects_sizes_that_hold_no_chunk),
                cmocka_unit_test(pool_counts_used_bytes_across_alloc_and_release),
                cmocka_unit_test(pool_rejects_bad_alloc_arguments),
                cmocka_unit_test(pool_refuses_allocation_past_capacity),
                cmocka_unit_test(pool_never_passes_a_capacity_that_is_not_a_chunk_multiple),
                cmocka_unit_test(pool_reports_each_new_chunk_once),
                cmocka_unit_test(pool_never_shares_a_chunk_between_owners),
                cmocka_unit_test(pool_rejects_release_of_what_is_not_an_allocation),
                cmocka_unit_test(pool_rejects_release_of_zero_units),
                cmocka_unit_test(pool_scrubs_the_chunks_of_an_owner_that_goes),
                cmocka_unit_test(pool_disowns_a_chunk_whose_fd_did_not_arrive),
                cmocka_unit_test(pool_recarves_an_empty_chunk_for_another_unit_size),
                cmocka_unit_test(pool_allocates_contiguous_runs),
                cmocka_unit_test(pool_fills_a_chunk_with_runs_exactly),
                cmocka_unit_test(pool_stays_consistent_under_random_operations),
                cmocka_unit_test(idmap_puts_gets_and_deletes),
                cmocka_unit_test(idmap_rejects_duplicate_keys),
                cmocka_unit_test(idmap_keeps_colliding_keys_reachable),
                cmocka_unit_test(idmap_grows_and_keeps_every_entry),
                cmocka_unit_test(idmap_matches_a_shadow_array_under_random_operations),
        };
        return cmocka_run_group_tests(tests, NULL, NULL);
}
