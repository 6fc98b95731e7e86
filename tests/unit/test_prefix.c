/* test_prefix.c: who attaches a shared prompt prefix (daemon/prefix.c; issue 28, item 1).
 *
 * Owns the attach rule: a session attaches a published block only when kvcd compares the block's
 * token ids (and the blocks before it) equal to its own prompt's, and only inside the publisher's
 * scope (its uid by default, its tenant with --share-scope tenant). kvcd in process
 * (tests/unit/sim.h) with clients of given uids.
 *
 * The forged prompt: FORGED's first block differs from VICTIM's in its last four ids and has the
 * same FNV-1a chain hash (events.c's, the one the KV events and the replay socket publish), so
 * both blocks of the two prompts hash alike. It was found by lattice reduction, as the review did
 * (an attacker who reads the hashes does the same in well under a second): with t_k the low byte
 * of the state after byte k is XORed in, the final hash is a sum of (t_k - low byte of the state
 * before) * P^(n-k), so a short vector of the lattice of small differences e with
 * sum e_k P^(n-k) = 0 mod 2^64 (and the low-byte recurrence's congruences) is a collision. The
 * test checks the collision itself (kvcd's own chain hashes of both sessions) before it relies on it.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "prefix.h"
#include "sim.h"

#define N_PROMPT 33 /* two whole blocks to share, and the last token's */

static const uint32_t victim_block0[16] = { 0x3e8,      0x3e9,      0x3ea,      0x3eb,     0x3ec,     0x3ed,
                                            0x3ee,      0x3ef,      0x3f0,      0x3f1,     0x3f2,     0x3f3,
                                            0xd30de3fb, 0xef31f9cb, 0x7afa2be5, 0x4b05f63e };
static const uint32_t forged_block0[16] = { 0x3e8,      0x3e9,      0x3ea,      0x3eb,     0x3ec,     0x3ed,
                                            0x3ee,      0x3ef,      0x3f0,      0x3f1,     0x3f2,     0x3f3,
                                            0x2ff1e519, 0xf9cbef31, 0x4b05bd17, 0x7afaffc1 };

/* block 0, then the same second block and last token for both */
static void prompt_of(const uint32_t block0[16], uint32_t out[N_PROMPT]) {
        memcpy(out, block0, 16 * sizeof(uint32_t));
        for (uint32_t i = 16; i < N_PROMPT; i++)
                out[i] = 7000 + i;
}

static struct session *open_shared(struct sim *m, struct client *c, const uint32_t *prompt, const char *tenant) {
        struct open_args a = { .policy = "full",
                               .prompt = prompt,
                               .n_prompt = N_PROMPT,
                               .model_id = "stories",
                               .share = true,
                               .tenant = tenant };
        struct session *s;
        char why[256];
        int r = sim_open_session(m, c, &a, &s, why, sizeof(why));
        if (r < 0)
                fail_msg("open: %s", why);
        return s;
}

/* The publisher prefills its prompt: 33 steps of one token; kvcd publishes the two blocks. */
static void prefill(struct sim *m, struct session *s) {
        for (int i = 0; i < N_PROMPT; i++)
                sim_step(m, s, 0.5f, true, NULL);
        assert_int_equal(s->n_shared_blocks, 2);
}

static void forged_prompt_with_the_same_chain_hashes_attaches_nothing(void **state) {
        (void)state;
        struct sim *m = sim_new(64 * MIB);
        struct client *owner = sim_client_new(m, 1000, 1000), *attacker = sim_client_new(m, 1000, 1000);
        uint32_t victim[N_PROMPT], forged[N_PROMPT];
        prompt_of(victim_block0, victim);
        prompt_of(forged_block0, forged);
        struct session *pub = open_shared(m, owner, victim, NULL);
        prefill(m, pub);

        struct session *f = open_shared(m, attacker, forged, NULL);
        /* the collision is real: kvcd hashes both prompts to the same chain */
        assert_int_equal(f->prompt_blocks, 2);
        assert_memory_equal(f->block_hashes, pub->block_hashes, 2 * sizeof(uint64_t));
        assert_memory_not_equal(f->prompt_ids, pub->prompt_ids, 16 * sizeof(uint32_t));
        assert_int_equal(f->n_shared_blocks, 0); /* before the fix: 2, the victim's keys and values */

        /* the genuine prompt, from the same uid, still attaches both */
        struct session *g = open_shared(m, attacker, victim, NULL);
        assert_int_equal(g->n_shared_blocks, 2);
        sim_free(m);
}

static void another_uid_attaches_nothing_by_default(void **state) {
        (void)state;
        struct sim *m = sim_new(64 * MIB);
        struct client *owner = sim_client_new(m, 1000, 1000), *other = sim_client_new(m, 1001, 1000);
        uint32_t victim[N_PROMPT], forged[N_PROMPT];
        prompt_of(victim_block0, victim);
        prompt_of(forged_block0, forged);
        prefill(m, open_shared(m, owner, victim, NULL));
        /* neither the forged prompt nor the very same prompt, from another uid */
        assert_int_equal(open_shared(m, other, forged, NULL)->n_shared_blocks, 0);
        assert_int_equal(open_shared(m, other, victim, NULL)->n_shared_blocks, 0);
        /* and its own publication of the same prompt is not blocked by the first uid's */
        struct session *own = open_shared(m, other, victim, NULL);
        prefill(m, own);
        assert_int_equal(open_shared(m, other, victim, NULL)->n_shared_blocks, 2);
        sim_free(m);
}

static void tenant_scope_shares_across_uids_of_one_tenant_only(void **state) {
        (void)state;
        struct sim *m = sim_new(64 * MIB);
        m->d.cfg.share_scope = PREFIX_SCOPE_TENANT;
        struct client *a = sim_client_new(m, 1000, 1000), *b = sim_client_new(m, 1001, 1000);
        uint32_t victim[N_PROMPT], forged[N_PROMPT];
        prompt_of(victim_block0, victim);
        prompt_of(forged_block0, forged);
        prefill(m, open_shared(m, a, victim, NULL)); /* tenant "default" */
        assert_int_equal(open_shared(m, b, victim, NULL)->n_shared_blocks, 2);
        assert_int_equal(open_shared(m, b, forged, NULL)->n_shared_blocks, 0);
        assert_int_equal(open_shared(m, b, victim, "other")->n_shared_blocks, 0);
        sim_free(m);
}

int main(void) {
        const struct CMUnitTest tests[] = {
                cmocka_unit_test(forged_prompt_with_the_same_chain_hashes_attaches_nothing),
                cmocka_unit_test(another_uid_attaches_nothing_by_default),
                cmocka_unit_test(tenant_scope_shares_across_uids_of_one_tenant_only),
        };
        return cmocka_run_group_tests(tests, NULL, NULL);
}
