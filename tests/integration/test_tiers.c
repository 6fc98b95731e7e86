/* test_tiers.c: the precision ladder through a real kvcd (issue 26). A session that stores tiers
 * below its dtype (kvc_session_config.tiers) with the tier_window parameter keeps its newest
 * tokens at the dtype and sends the rest down, without evicting: a prompt's demotion goes in links
 * of one block per tier and layer, so the session's peak charged bytes stay within one block per
 * tier and layer of what it held before the demotion; every token reads back (kvc_layer_gather)
 * within its tier's rounding, in slot order, with its position; a conf session with INT8 and a
 * 4-bit tier under its window evicts and demotes into three tiers at once; a session's bytes by
 * tier and bits per value reach kvcctl; unknown or rising tiers are refused at open.
 */
#define _GNU_SOURCE
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
#include "harness.h"
#include "kvc.h"

#define LAYERS 2
#define H      2  /* KV heads */
#define D      32 /* head_dim: the rotated tiers need a power of 2 */
#define VOCAB  100

static struct kvc_client *client(const struct daemon *d) {
        struct kvc_options o = { .socket = d->dir, .name = "tiers", .timeout_ms = HARNESS_DEADLINE_MS };
        struct kvc_client *c = NULL;
        assert_int_equal(kvc_connect(&o, &c), 0);
        return c;
}

static int open_session(struct kvc_client *c, const char *policy, uint32_t budget, const char *tiers,
                        const struct kvc_param *params, size_t n_params, struct kvc_session **ret) {
        struct kvc_session_config cfg = {
                .geometry = { .n_layers = LAYERS,
                              .n_heads = 4,
                              .n_kv_heads = H,
                              .head_dim = D,
                              .dtype = KVC_DTYPE_F32,
                              .max_tokens = 1024 },
                .policy = policy,
                .budget_tokens = budget,
                .params = params,
                .n_params = n_params,
                .tiers = tiers,
                .rotation_seed = 7,
        };
        return kvc_session_open(c, &cfg, ret);
}

static float keys[1024][H * D];

/* Token t's key (its value is the key negated): pseudo-random, the same in every run. */
static void make_tokens(uint32_t n) {
        uint32_t seed = 2026;
        for (uint32_t t = 0; t < n; t++)
                for (uint32_t i = 0; i < H * D; i++)
                        keys[t][i] = (float)(seed = seed * 1103515245u + 12345u) / 4294967296.0f - 0.5f;
}

static void append(struct kvc_session *s, uint32_t t) {
        float v[H * D];
        for (uint32_t i = 0; i < H * D; i++)
                v[i] = -keys[t][i];
        for (uint32_t l = 0; l < LAYERS; l++)
                assert_int_equal(kvc_append(s, l, (int32_t)t, keys[t], v), 0);
}

static void step(struct kvc_client *c, struct kvc_session *s, uint64_t t, enum kvc_phase phase) {
        float logits[VOCAB];
        uint32_t seed = (uint32_t)t * 7919u + 1;
        for (uint32_t i = 0; i < VOCAB; i++)
                logits[i] = (float)(seed = seed * 1103515245u + 12345u) / 4294967296.0f * 8.0f;
        struct kvc_summary sum;
        assert_int_equal(kvc_summarize(logits, VOCAB, &sum), 0);
        assert_int_equal(kvc_step(s, t, phase, &sum), 0);
        assert_int_equal(kvc_flush(c), 0);
}

/* Every slot of every layer reads back as the token at its position: exactly at the dtype, and in
 * a lower tier within a relative error of its rounding (a row's error norm over its norm: the
 * 4-bit Lloyd-Max codes of a rotated row err by about 0.1, the 2-bit ones by about 0.35 (0.55 seen in a 32-dim row), INT8 by
 * under 0.01). The positions are
 * read from the block's side arrays of the slot (kvc_layer_view), so order and identity are
 * checked too. */
static void assert_reads_back_as(struct kvc_session *s, uint32_t n_tokens_seen, bool per_token, uint8_t *ret_tier) {
        for (uint32_t l = 0; l < LAYERS; l++) {
                uint32_t n = kvc_layer_tokens(s, l);
                float *k = malloc((size_t)H * n * D * sizeof(float)), *v = malloc((size_t)H * n * D * sizeof(float));
                assert_non_null(k);
                assert_non_null(v);
                assert_int_equal(kvc_layer_gather(s, l, 0, n, 0, k, v), 0);
                uint32_t first = 0, last_pos = 0;
                for (uint32_t t = kvc_session_tiers(s) - 1;; t--) {
                        uint32_t cnt = kvc_layer_tier_tokens(s, l, t);
                        const char *name = kvc_session_tier_name(s, t);
                        double bound = strcmp(name, "q8") == 0   ? 0.01
                                       : strcmp(name, "q4") == 0 ? 0.2
                                       : strcmp(name, "q3") == 0 ? 0.3
                                       : strcmp(name, "q2") == 0 ? 0.7
                                                                 : 0.0;
                        for (uint32_t slot = first; slot < first + cnt; slot++) {
                                /* the nearest token: the one the row came from, when the error is small */
                                for (uint32_t h = 0; h < H; h++) {
                                        const float *got = k + ((size_t)h * n + slot) * D;
                                        double best = 1e30;
                                        uint32_t best_t = 0;
                                        for (uint32_t c = 0; c < n_tokens_seen; c++) {
                                                double e = 0;
                                                for (uint32_t j = 0; j < D; j++)
                                                        e += (got[j] - keys[c][h * D + j]) * (got[j] - keys[c][h * D + j]);
                                                if (e < best) {
                                                        best = e;
                                                        best_t = c;
                                                }
                                        }
                                        double norm = 0;
                                        for (uint32_t j = 0; j < D; j++)
                                                norm += keys[best_t][h * D + j] * keys[best_t][h * D + j];
                                        if (sqrt(best / norm) > bound + 1e-6)
                                                fail_msg("layer %u tier %s slot %u head %u: error %g over %g", l, name,
                                                         slot, h, sqrt(best / norm), bound);
                                        if (h == 0 && slot > (per_token ? first : 0) && best_t <= last_pos)
                                                fail_msg("layer %u slot %u: token %u after token %u", l, slot, best_t,
                                                         last_pos);
                                        if (h == 0)
                                                last_pos = best_t;
                                        if (h == 0 && l == 0 && ret_tier)
                                                ret_tier[best_t] = (uint8_t)t;
                                        const float *gv = v + ((size_t)h * n + slot) * D;
                                        double ev = 0;
                                        for (uint32_t j = 0; j < D; j++)
                                                ev += (gv[j] + keys[best_t][h * D + j]) * (gv[j] + keys[best_t][h * D + j]);
                                        if (sqrt(ev / norm) > bound + 1e-6)
                                                fail_msg("layer %u tier %s slot %u head %u: value error %g", l, name, slot,
                                                         h, sqrt(ev / norm));
                                }
                        }
                        first += cnt;
                        if (t == 0)
                                break;
                }
                assert_int_equal(first, n);
                free(k);
                free(v);
        }
}

/* In slot order, position order throughout (the oldest go lowest) */
static void assert_reads_back(struct kvc_session *s, uint32_t n_tokens_seen) {
        assert_reads_back_as(s, n_tokens_seen, false, NULL);
}

static void a_prompt_goes_down_in_links_and_the_peak_stays_within_a_block_per_tier(void **state) {
        const struct daemon *d = *state;
        struct kvc_client *c = client(d);
        const struct kvc_param window = { "tier_window", "32" };
        struct kvc_session *s = NULL;
        assert_int_equal(open_session(c, "full", 0, "q4", &window, 1, &s), 0);
        assert_int_equal(kvc_session_tiers(s), 2);
        assert_string_equal(kvc_session_tier_name(s, 1), "q4");
        enum { N = 512 };
        make_tokens(N);
        assert_int_equal(kvc_session_reserve(s, N), 0);
        for (uint32_t t = 0; t < N; t++)
                append(s, t);
        step(c, s, 0, KVC_PHASE_PREFILL); /* the whole prompt at once: 480 tokens to demote */
        for (uint32_t l = 0; l < LAYERS; l++) {
                assert_int_equal(kvc_layer_tokens(s, l), N);
                assert_int_equal(kvc_layer_tier_tokens(s, l, 1), N - 32); /* nothing evicted */
                assert_int_equal(kvc_layer_tier_tokens(s, l, 0), 32);
        }
        struct kvc_session_stats mid;
        kvc_session_get_stats(s, &mid);
        assert_true(mid.plans_applied >= (N - 32) / 16); /* a block per link */
        assert_reads_back(s, N);

        /* the charge: before the demotion, 33 float32 blocks a layer (the prompt, and room for the
         * next token; full has no plan buffer: a demotion's keep-set, every slot, is implied); at
         * no time more than that and one 4-bit block a layer (plan.c: the destination of a link is
         * granted before its source is freed) */
        struct kvc_layer_view lv;
        assert_int_equal(kvc_layer_view(s, 0, &lv), -ENOTSUP); /* packed blocks have no view */
        struct block_layout fl, ql;
        assert_int_equal(block_layout_init(&fl, 16, H, D, BLOCK_DTYPE_F32), 0);
        assert_int_equal(block_layout_init(&ql, 16, H, D, BLOCK_DTYPE_Q4), 0);
        uint64_t fp = fl.block_bytes, q4 = ql.block_bytes;
        uint64_t before = LAYERS * 33 * fp;
        struct kvc_session_stats end;
        assert_int_equal(kvc_session_close(s, &end), 0);
        assert_true(end.peak_bytes >= before);
        if (end.peak_bytes > before + LAYERS * q4)
                fail_msg("peak %llu bytes, more than %llu + one 4-bit block a layer (%llu)",
                         (unsigned long long)end.peak_bytes, (unsigned long long)before, (unsigned long long)q4);
        kvc_disconnect(c);
}

static void decode_demotes_a_block_at_a_time_and_reads_back(void **state) {
        struct kvc_client *c = client(*state);
        const struct kvc_param window = { "tier_window", "24" };
        struct kvc_session *s = NULL;
        assert_int_equal(open_session(c, "full", 0, "q8,q4", &window, 1, &s), 0);
        enum { N = 150 };
        make_tokens(N);
        for (uint32_t t = 0; t < N; t++) {
                append(s, t);
                step(c, s, t, KVC_PHASE_DECODE);
                uint32_t fp = kvc_layer_tier_tokens(s, 0, 0);
                assert_true(fp <= 24 + 16); /* the window and at most a block's hysteresis */
                assert_int_equal(kvc_layer_tier_tokens(s, 0, 1), 0); /* tier_window sends to the lowest */
        }
        assert_true(kvc_layer_tier_tokens(s, 1, 2) >= N - 24 - 16);
        assert_reads_back(s, N);
        assert_int_equal(kvc_session_close(s, NULL), 0);
        kvc_disconnect(c);
}

static void conf_with_int8_and_a_4_bit_window_fills_three_tiers(void **state) {
        const struct daemon *d = *state;
        struct kvc_client *c = client(d);
        const struct kvc_param params[] = { { "int8", "1" }, { "tier_window", "96" } };
        struct kvc_session *s = NULL;
        assert_int_equal(open_session(c, "conf", 160, "q8,q4", params, 2, &s), 0);
        enum { N = 400 };
        make_tokens(N);
        for (uint32_t t = 0; t < N; t++) {
                float q[4 * D], out[4 * D];
                append(s, t);
                for (uint32_t i = 0; i < 4 * D; i++)
                        q[i] = keys[t][i % (H * D)];
                for (uint32_t l = 0; l < LAYERS; l++)
                        assert_int_equal(kvc_attend(s, l, q, out), 0);
                step(c, s, t, KVC_PHASE_DECODE);
        }
        uint32_t n = kvc_layer_tokens(s, 0);
        assert_true(n < N); /* evicted */
        assert_true(kvc_layer_tier_tokens(s, 0, 0) > 0);
        assert_true(kvc_layer_tier_tokens(s, 0, 1) > 0); /* conf's INT8 between the window and 4 bits */
        assert_true(kvc_layer_tier_tokens(s, 0, 2) > 0);
        assert_reads_back(s, N);

        /* kvcctl sees its bits per value and its bytes by tier, the metrics its bytes by precision */
        char *out = harness_kvcctl(d, "sessions");
        assert_non_null(out);
        if (!strstr(out, "\"q4\":") || !strstr(out, "bits_per_value"))
                fail_msg("kvcctl sessions shows no tiers:\n%s", out);
        free(out);
        const char *argv[] = { harness_bin("kvcctl"), "--socket", d->dir, "metrics", NULL };
        out = harness_output(argv);
        assert_non_null(out);
        for (const char *p = "q4", *q = "int8"; p; p = q, q = NULL) {
                char series[96];
                snprintf(series, sizeof(series), "kvcd_pool_bytes{state=\"used\",precision=\"%s\"} ", p);
                const char *at = strstr(out, series);
                if (!at || strtoull(at + strlen(series), NULL, 10) == 0)
                        fail_msg("no %s bytes in the metrics:\n%s", p, out);
        }
        free(out);
        assert_int_equal(kvc_session_close(s, NULL), 0);
        kvc_disconnect(c);
}

/* The ladder policy under a byte budget: a prompt in chunks of 64, then decoding. After every step
 * (links included), and with the room for the next chunk granted, the session holds no more than
 * its budget; while the lowest tier can hold every
 * token nothing is evicted, and the sinks and the newest window stay at the dtype; every token reads
 * back within its tier's rounding (each tier in position order). Under a smaller budget it evicts,
 * still within it. */
static void run_ladder(struct kvc_client *c, uint64_t budget, uint32_t n, bool evicts) {
        const struct kvc_param params[] = { { "sinks", "4" }, { "window", "32" } };
        struct kvc_session_config cfg = {
                .geometry = { .n_layers = LAYERS, .n_heads = 4, .n_kv_heads = H, .head_dim = D,
                              .dtype = KVC_DTYPE_F32, .max_tokens = 1024 },
                .policy = "ladder",
                .params = params,
                .n_params = 2,
                .tiers = "q8,q4,q2",
                .rotation_seed = 7,
                .budget_bytes = budget,
        };
        struct kvc_session *s = NULL;
        assert_int_equal(kvc_session_open(c, &cfg, &s), 0);
        assert_int_equal(kvc_session_budget_bytes(s), budget);
        make_tokens(n);
        uint64_t step_no = 0;
        for (uint32_t t = 0; t < n;) {
                uint32_t k = t < n - 40 ? 64 : 1; /* the prompt in chunks, the last 40 decoded */
                if (k > n - 40 - t && t < n - 40)
                        k = n - 40 - t;
                assert_int_equal(kvc_session_reserve(s, kvc_layer_tokens(s, 0) + k), 0);
                if (kvc_session_bytes(s) > budget) /* the room for a chunk is left aside */
                        fail_msg("at %u tokens with room for %u more: %llu bytes over the budget of %llu", t, k,
                                 (unsigned long long)kvc_session_bytes(s), (unsigned long long)budget);
                for (uint32_t j = 0; j < k; j++)
                        append(s, t + j);
                t += k;
                step(c, s, step_no++, k > 1 ? KVC_PHASE_PREFILL : KVC_PHASE_DECODE);
                if (kvc_session_bytes(s) > budget)
                        fail_msg("after %u tokens: %llu bytes over the budget of %llu", t,
                                 (unsigned long long)kvc_session_bytes(s), (unsigned long long)budget);
        }
        uint8_t tier_of[1024];
        memset(tier_of, 0xff, sizeof(tier_of));
        assert_reads_back_as(s, n, true, tier_of);
        uint32_t lower = 0;
        for (uint32_t t = 1; t < kvc_session_tiers(s); t++)
                lower += kvc_layer_tier_tokens(s, 0, t);
        assert_true(lower > 0);
        if (!evicts) {
                assert_int_equal(kvc_layer_tokens(s, 0), n);
                for (uint32_t i = 0; i < 4; i++)
                        assert_int_equal(tier_of[i], 0);
                for (uint32_t i = n - 32; i < n; i++)
                        assert_int_equal(tier_of[i], 0);
        } else {
                assert_true(kvc_layer_tokens(s, 0) < n);
        }
        struct kvc_session_stats end;
        assert_int_equal(kvc_session_close(s, &end), 0);
}

static void ladder_lowers_precision_before_it_evicts_within_its_byte_budget(void **state) {
        struct kvc_client *c = client(*state);
        enum { N = 800 }; /* long enough for the sinks, the window and the slack to be a small part */
        struct block_layout fl;
        assert_int_equal(block_layout_init(&fl, 16, H, D, BLOCK_DTYPE_F32), 0);
        uint64_t full = (uint64_t)LAYERS * (N / 16 + 1) * fl.block_bytes;
        run_ladder(c, full * 40 / 100, N, false); /* every token fits at 2 bits: none evicted */
        run_ladder(c, full * 28 / 100, N, true);  /* not even there: the least important go */
        kvc_disconnect(c);
}

/* The arbiter's cuts of one round in kvcctl --json metrics' text (its quotes escaped there). */
static double arbiter_cuts(const char *text, const char *round) {
        char pat[128];
        snprintf(pat, sizeof(pat), "kvcd_arbiter_cuts_total{round=\\\"%s\\\"} ", round);
        const char *at = strstr(text, pat);
        if (!at)
                fail_msg("no %s in the metrics", pat);
        return strtod(at + strlen(pat), NULL);
}

/* A node oversubscribed 1.2x (16 full caches of 0.9 MiB in 12 MiB): two eviction-only sessions
 * (window, budgets above what they hold) and 14 ladder sessions, each wanting its full cache,
 * driven a chunk at a time in turn.
 * The arbiter lowers the ladders' precision and makes nobody evict: every session keeps every
 * token, the ladders hold tokens below their dtype, the window sessions hold all of theirs, the
 * pool never refuses, and the metrics count the cuts as lowering, none as eviction. */
static void the_arbiter_lowers_precision_before_anyone_evicts(void **state) {
        const struct daemon *d = *state;
        struct kvc_client *c = client(d);
        enum { N = 800, S = 16, LADDERS = 14 };
        struct block_layout fl;
        assert_int_equal(block_layout_init(&fl, 16, H, D, BLOCK_DTYPE_F32), 0);
        uint64_t full = (uint64_t)LAYERS * (N / 16 + 1) * fl.block_bytes;
        const struct kvc_param params[] = { { "sinks", "4" }, { "window", "32" } };
        struct kvc_session *s[S];
        for (uint32_t i = 0; i < S; i++) {
                bool ladder = i < LADDERS;
                struct kvc_session_config cfg = {
                        .geometry = { .n_layers = LAYERS, .n_heads = 4, .n_kv_heads = H, .head_dim = D,
                                      .dtype = KVC_DTYPE_F32, .max_tokens = 1024 },
                        .policy = ladder ? "ladder" : "window",
                        .budget_tokens = ladder ? 0 : 1000,
                        .params = ladder ? params : NULL,
                        .n_params = ladder ? 2 : 0,
                        .tiers = ladder ? "q8,q4,q2" : NULL,
                        .rotation_seed = 7,
                        .budget_bytes = ladder ? 2 * full : 0,
                };
                assert_int_equal(kvc_session_open(c, &cfg, &s[i]), 0);
        }
        make_tokens(N);
        for (uint32_t t = 0; t < N; t += 64)
                for (uint32_t i = 0; i < S; i++) {
                        uint32_t k = N - t < 64 ? N - t : 64;
                        if (kvc_session_reserve(s[i], t + k) < 0) {
                                char *st = harness_kvcctl(d, "sessions"), *ss = harness_kvcctl(d, "status");
                                fail_msg("session %u at %u tokens: %s\n%s\n%s", i, t, kvc_last_error(c), st, ss);
                        }
                        for (uint32_t j = 0; j < k; j++)
                                append(s[i], t + j);
                        step(c, s[i], t / 64, KVC_PHASE_PREFILL);
                }
        for (uint32_t i = 0; i < S; i++) {
                uint32_t lower = 0;
                for (uint32_t t = 1; t < kvc_session_tiers(s[i]); t++)
                        lower += kvc_layer_tier_tokens(s[i], 0, t);
                assert_int_equal(kvc_layer_tokens(s[i], 0), N); /* nobody evicted */
                if (i < LADDERS)
                        assert_true(lower > N / 2);
        }
        char *text = harness_kvcctl(d, "metrics");
        assert_non_null(text);
        assert_true(arbiter_cuts(text, "lower") >= LADDERS);
        assert_true(arbiter_cuts(text, "evict") == 0);
        free(text);
        for (uint32_t i = 0; i < S; i++)
                assert_int_equal(kvc_session_close(s[i], NULL), 0);
        kvc_disconnect(c);
}

static int setup_node(void **state) {
        const char *extra[] = { "--capacity", "12M", "--chunk-bytes", "2M", NULL };
        return harness_group_start(state, extra);
}

static void unknown_and_rising_tiers_are_refused(void **state) {
        struct kvc_client *c = client(*state);
        struct kvc_session *s = NULL;
        assert_int_equal(open_session(c, "full", 0, "q5", NULL, 0, &s), -EINVAL);
        assert_non_null(strstr(kvc_last_error(c), "q5"));
        assert_int_equal(open_session(c, "full", 0, "q4,q8", NULL, 0, &s), -EINVAL);
        const struct kvc_param window = { "tier_window", "0" };
        assert_int_equal(open_session(c, "full", 0, "q4", &window, 1, &s), -EINVAL);
        const struct kvc_param alone = { "tier_window", "8" };
        assert_int_equal(open_session(c, "full", 0, NULL, &alone, 1, &s), -EINVAL); /* no tier to send to */
        kvc_disconnect(c);
}

static int setup(void **state) {
        return harness_group_start(state, NULL);
}

static int teardown(void **state) {
        return harness_group_stop(state);
}

int main(void) {
        const struct CMUnitTest tests[] = {
                cmocka_unit_test(a_prompt_goes_down_in_links_and_the_peak_stays_within_a_block_per_tier),
                cmocka_unit_test(decode_demotes_a_block_at_a_time_and_reads_back),
                cmocka_unit_test(conf_with_int8_and_a_4_bit_window_fills_three_tiers),
                cmocka_unit_test(ladder_lowers_precision_before_it_evicts_within_its_byte_budget),
                cmocka_unit_test(unknown_and_rising_tiers_are_refused),
                cmocka_unit_test_setup_teardown(the_arbiter_lowers_precision_before_anyone_evicts, setup_node,
                                                teardown),
        };
        return cmocka_run_group_tests(tests, setup, teardown);
}
