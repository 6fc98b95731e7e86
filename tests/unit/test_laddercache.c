/* test_laddercache.c - unit tests of client/engine/laddercache.c on stories260K (8 heads of 8
 * dims, 5 layers): the in-process cache of the precision ladder.
 *
 * Owns: the ladder cache without a lower tier computing the plain cache's bits (f32); a prompt in
 * chunks and token by token giving the same bits with demotions under way; the bytes it reports
 * (every block of every tier in use) and the peak bound (what is held beyond the steady bytes is
 * at most one block per tier per layer, the demotion's new low block beside the full-precision
 * block it empties); the error growing as the tier's bits shrink; and the refusals.
 *
 * The model directory is $KVC_STORIES_DIR, or ../shared/models/stories260K.
 */
#include <errno.h>
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "block.h"
#include "laddercache.h"
#include "model.h"

static struct model *model;

static int group_setup(void **state) {
        const char *dir = getenv("KVC_STORIES_DIR");
        char path[4200];
        (void)state;
        snprintf(path, sizeof(path), "%s/stories260K.bin",
                 dir && *dir ? dir : "../shared/models/stories260K");
        if (model_load(path, &model) < 0) {
                fprintf(stderr, "test_laddercache: cannot load %s\n", path);
                return -1;
        }
        return 0;
}

static int group_teardown(void **state) {
        (void)state;
        model = model_free(model);
        return 0;
}

enum { N_TOKENS = 150 };

static int token_at(int i) {
        return 1 + (i * 37 + 11) % 400;
}

/* Token by token through ops/ctx; logits of every position into out [N][V]. */
static void run_tokens(const struct model_cache_ops *ops, void *ctx, int n, float *out) {
        int V = model_get_config(model)->vocab_size;
        for (int i = 0; i < n; i++) {
                float *lg;
                assert_int_equal(model_forward(model, token_at(i), i, ops, ctx, &lg), 0);
                memcpy(out + (size_t)i * V, lg, V * sizeof(float));
        }
}

static struct ladder_cache *make(const char *tier, enum block_dtype dt, uint32_t window) {
        struct ladder_cache *c = NULL;
        struct ladder_cache_config lc = { .dtype = dt, .tier = tier, .window = window, .seed = 9 };
        assert_int_equal(ladder_cache_new(model_get_config(model), 512, &lc, &c), 0);
        return c;
}

static void ladder_cache_without_a_tier_computes_the_plain_caches_bits(void **state) {
        (void)state;
        int V = model_get_config(model)->vocab_size;
        float *a = malloc((size_t)N_TOKENS * V * 4), *b = malloc((size_t)N_TOKENS * V * 4);
        struct plain_cache *p;
        assert_int_equal(plain_cache_new(model_get_config(model), 512, &p), 0);
        struct ladder_cache *c = make(NULL, BLOCK_DTYPE_F32, 16);
        run_tokens(&plain_cache_ops, p, N_TOKENS, a);
        run_tokens(&ladder_cache_ops, c, N_TOKENS, b);
        assert_memory_equal(a, b, (size_t)N_TOKENS * V * 4);
        plain_cache_free(p);
        ladder_cache_free(c);
        free(a);
        free(b);
}

/* SmolLM2 (a GGUF: prompt rows go through the model together, 64-dim heads): a prompt in chunks
 * of 37 rows and the same prompt token by token give the same logits, demotions under way. */
static void a_chunked_prompt_and_token_by_token_agree_while_tokens_are_demoted(void **state) {
        (void)state;
        const char *path = getenv("KVC_SMOLLM2");
        if (!path || !*path)
                fail_msg("KVC_SMOLLM2 is not set: run through `make test` (after `make model`)");
        struct model_options mo = { .threads = 1 };
        struct model *m = NULL;
        char why[256] = "";
        assert_int_equal(model_open(path, &mo, &m, why, sizeof(why)), 0);
        const struct model_config *mc = model_get_config(m);
        int V = mc->vocab_size, N = 90;
        static const char *const tiers[] = { "q8", "q4", "q3", "q2" };
        float *a = malloc((size_t)N * V * 4);
        for (size_t t = 0; t < 4; t++) {
                struct ladder_cache *c1 = NULL, *c2 = NULL;
                struct ladder_cache_config lc = {
                        .dtype = BLOCK_DTYPE_F16, .tier = tiers[t], .window = 20, .seed = 3
                };
                assert_int_equal(ladder_cache_new(mc, 256, &lc, &c1), 0);
                assert_int_equal(ladder_cache_new(mc, 256, &lc, &c2), 0);
                for (int i = 0; i < N; i++) {
                        float *lg;
                        assert_int_equal(model_forward(m, token_at(i), i, &ladder_cache_ops, c1, &lg), 0);
                        memcpy(a + (size_t)i * V, lg, V * sizeof(float));
                }
                struct model_row rows[37];
                for (int pos = 0; pos < N;) {
                        int k = N - pos < 37 ? N - pos : 37;
                        float *lg = NULL;
                        for (int j = 0; j < k; j++)
                                rows[j] = (struct model_row){
                                        .token = token_at(pos + j), .pos = pos + j, .ctx = c2, .logits = true
                                };
                        assert_int_equal(model_forward_rows(m, rows, (uint32_t)k, &ladder_cache_ops, &lg), 0);
                        for (int j = 0; j < k; j++)
                                assert_memory_equal(lg + (size_t)j * V, a + (size_t)(pos + j) * V,
                                                    V * sizeof(float));
                        pos += k;
                }
                assert_int_equal(ladder_cache_bytes(c1), ladder_cache_bytes(c2));
                /* 64-dim heads: the low tiers pay */
                assert_true(ladder_cache_bytes(c1) < ladder_cache_full_bytes(c1) * (t ? 0.6 : 0.8));
                ladder_cache_free(c1);
                ladder_cache_free(c2);
        }
        free(a);
        model_free(m);
}

static void ladder_cache_bytes_are_its_blocks_and_its_peak_stays_within_a_block_per_tier(void **state) {
        (void)state;
        const struct model_config *mc = model_get_config(model);
        uint32_t H = (uint32_t)mc->n_kv_heads, D = (uint32_t)(mc->dim / mc->n_heads),
                 L = (uint32_t)mc->n_layers;
        struct block_layout f16, q4;
        assert_int_equal(block_layout_init(&f16, 16, H, D, BLOCK_DTYPE_F16), 0);
        assert_int_equal(block_layout_init(&q4, 16, H, D, BLOCK_DTYPE_Q4), 0);
        struct ladder_cache *c = make("q4", BLOCK_DTYPE_F16, 32);
        uint64_t most = 0;
        for (int i = 0; i < N_TOKENS; i++) {
                float *lg;
                assert_int_equal(model_forward(model, token_at(i), i, &ladder_cache_ops, c, &lg), 0);
                /* n tokens: the window holds 32..47 (demoted a block at 48), the rest is q4 */
                uint32_t n = (uint32_t)i + 1, fp = n < 48 ? n : 32 + (n - 32) % 16, low = n - fp;
                uint64_t want = L * ((uint64_t)(fp + 15) / 16 * f16.block_bytes +
                                     (uint64_t)(low + 15) / 16 * q4.block_bytes);
                assert_int_equal(ladder_cache_bytes(c), want);
                most = want > most ? want : most;
                assert_true(ladder_cache_peak_bytes(c) >= most);
                assert_true(ladder_cache_peak_bytes(c) <= most + L * (f16.block_bytes + q4.block_bytes));
                assert_int_equal(ladder_cache_full_bytes(c), L * (uint64_t)((n + 15) / 16) * f16.block_bytes);
        }
        /* 8-dim heads: a row's scale (4 bytes) and its side words (20) outweigh its codes (4), so q4
         * saves little here; SmolLM2's 64-dim heads are where the tiers pay (tier.h's table) */
        assert_true(ladder_cache_bytes(c) < ladder_cache_full_bytes(c));
        ladder_cache_free(c);
}

/* The logits move away from the f16 cache's as the bits shrink (KL, summed over positions). */
static void fewer_bits_move_the_logits_further(void **state) {
        (void)state;
        int V = model_get_config(model)->vocab_size;
        static const char *const tiers[] = { "q8", "q4", "q3", "q2" };
        float *ref = malloc((size_t)N_TOKENS * V * 4), *got = malloc((size_t)N_TOKENS * V * 4);
        struct ladder_cache *c = make(NULL, BLOCK_DTYPE_F16, 16);
        run_tokens(&ladder_cache_ops, c, N_TOKENS, ref);
        ladder_cache_free(c);
        double prev = 0;
        for (size_t t = 0; t < 4; t++) {
                c = make(tiers[t], BLOCK_DTYPE_F16, 16);
                run_tokens(&ladder_cache_ops, c, N_TOKENS, got);
                ladder_cache_free(c);
                double kl = 0;
                for (int i = 0; i < N_TOKENS; i++) {
                        const float *p = ref + (size_t)i * V, *q = got + (size_t)i * V;
                        double mp = p[0], mq = q[0], zp = 0, zq = 0;
                        for (int v = 1; v < V; v++)
                                mp = fmax(mp, p[v]), mq = fmax(mq, q[v]);
                        for (int v = 0; v < V; v++)
                                zp += exp(p[v] - mp), zq += exp(q[v] - mq);
                        for (int v = 0; v < V; v++) {
                                double lp = p[v] - mp - log(zp), lq = q[v] - mq - log(zq);
                                kl += exp(lp) * (lp - lq);
                        }
                }
                print_message("%s: KL to f16 summed over %d positions %.5f\n", tiers[t], N_TOKENS, kl);
                assert_true(kl > prev);
                prev = kl;
        }
        free(ref);
        free(got);
}

static void ladder_cache_refuses_what_it_cannot_hold(void **state) {
        (void)state;
        const struct model_config *mc = model_get_config(model);
        struct ladder_cache *c = NULL;
        struct ladder_cache_config lc = { .dtype = BLOCK_DTYPE_F16, .tier = "q5", .window = 16 };
        assert_int_equal(ladder_cache_new(mc, 64, &lc, &c), -EINVAL);
        lc.tier = "f32"; /* not a lower tier */
        assert_int_equal(ladder_cache_new(mc, 64, &lc, &c), -EINVAL);
        lc.tier = "q4";
        lc.window = 0;
        assert_int_equal(ladder_cache_new(mc, 64, &lc, &c), -EINVAL);
        lc.window = 16;
        lc.dtype = BLOCK_DTYPE_Q8;
        assert_int_equal(ladder_cache_new(mc, 64, &lc, &c), -EINVAL);
        lc.dtype = BLOCK_DTYPE_F16;
        assert_int_equal(ladder_cache_new(mc, 64, &lc, &c), 0);
        float k[64] = { 0 }, v[64] = { 0 };
        assert_int_equal(ladder_cache_ops.store(c, 0, 1, k, v), -EINVAL); /* a gap */
        assert_int_equal(ladder_cache_ops.store(c, 0, 0, k, v), 0);
        assert_int_equal(ladder_cache_ops.store(c, 0, 64, k, v), -ERANGE);
        assert_int_equal(ladder_cache_ops.store(c, mc->n_layers, 0, k, v), -EINVAL);
        ladder_cache_free(c);
        assert_null(ladder_cache_free(NULL));
}

int main(void) {
        const struct CMUnitTest tests[] = {
                cmocka_unit_test(ladder_cache_without_a_tier_computes_the_plain_caches_bits),
                cmocka_unit_test(a_chunked_prompt_and_token_by_token_agree_while_tokens_are_demoted),
                cmocka_unit_test(
                        ladder_cache_bytes_are_its_blocks_and_its_peak_stays_within_a_block_per_tier),
                cmocka_unit_test(fewer_bits_move_the_logits_further),
                cmocka_unit_test(ladder_cache_refuses_what_it_cannot_hold),
        };
        return cmocka_run_group_tests(tests, group_setup, group_teardown);
}
