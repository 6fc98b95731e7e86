/* test_scores.c: kvc_layer_set_scores and kvc_layer_get_scores against a real kvcd (issue 27 item
 * 3: importance the client computes, in the score the policies rank by). A score set for a
 * token stays with it through kvcd's plans, as it is evicted around and sent down the precision
 * ladder (a conf session with INT8 and a 4-bit tier: three tiers at once), and reads back in slot
 * order from every tier; a range set writes that range only; bad layers, ranges, arrays and
 * scores that are not finite numbers are refused with nothing written; the slots of a shared
 * prefix are left to the session that published them. kvc-run's --importance modes run through
 * kvcd with an evicting policy and print a text.
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
#include <sys/wait.h>

#include <cmocka.h>

#include "harness.h"
#include "kvc.h"

#define LAYERS 2
#define H      2  /* KV heads */
#define D      32 /* head_dim: the rotated tiers need a power of 2 */
#define N      300

static struct kvc_client *client(const struct daemon *d) {
        struct kvc_options o = { .socket = d->dir, .name = "scores", .timeout_ms = HARNESS_DEADLINE_MS };
        struct kvc_client *c = NULL;
        assert_int_equal(kvc_connect(&o, &c), 0);
        return c;
}

static struct kvc_session *open_session(struct kvc_client *c, const struct kvc_session_config *extra) {
        struct kvc_session_config cfg = *extra;
        cfg.geometry = (struct kvc_geometry){ .n_layers = LAYERS,
                                              .n_heads = 4,
                                              .n_kv_heads = H,
                                              .head_dim = D,
                                              .dtype = KVC_DTYPE_F32,
                                              .max_tokens = 1024 };
        cfg.rotation_seed = 7;
        struct kvc_session *s = NULL;
        assert_int_equal(kvc_session_open(c, &cfg, &s), 0);
        return s;
}

static float keys[N][H * D];

static void make_tokens(void) {
        uint32_t seed = 27;
        for (uint32_t t = 0; t < N; t++)
                for (uint32_t i = 0; i < H * D; i++)
                        keys[t][i] = (float)(seed = seed * 1103515245u + 12345u) / 4294967296.0f - 0.5f;
}

static void append(struct kvc_session *s, uint32_t t) {
        for (uint32_t l = 0; l < LAYERS; l++)
                assert_int_equal(kvc_append(s, l, (int32_t)t, keys[t], keys[t]), 0);
}

/* A step of middling confidence: conf plans at its budget whatever the logits say. */
static void step(struct kvc_client *c, struct kvc_session *s, uint64_t t, enum kvc_phase phase) {
        const struct kvc_summary sum = { .entropy = 0.5f, .top1_prob = 0.5f, .margin = 1.0f };
        assert_int_equal(kvc_step(s, t, phase, &sum), 0);
        assert_int_equal(kvc_flush(c), 0);
}

/* Token t's score in KV head h: which token and head it is, recoverable from the float. */
static float score_of(uint32_t t, uint32_t h) {
        return (float)(t * 10 + h) + 0.5f;
}

/* Every slot of every layer holds the score set for the token its key is: within its tier's
 * rounding (exact at the dtype), the tokens ascending inside a tier. */
static void assert_scores_follow_tokens(struct kvc_session *s) {
        for (uint32_t l = 0; l < LAYERS; l++) {
                uint32_t n = kvc_layer_tokens(s, l);
                float *k = malloc((size_t)H * n * D * sizeof(float)),
                      *v = malloc((size_t)H * n * D * sizeof(float)),
                      *sc = malloc((size_t)H * n * sizeof(float));
                assert_true(k && v && sc);
                assert_int_equal(kvc_layer_gather(s, l, 0, n, 0, k, v), 0);
                assert_int_equal(kvc_layer_get_scores(s, l, 0, n, sc), 0);
                uint32_t slot = 0;
                for (uint32_t t = kvc_session_tiers(s); t-- > 0;) {
                        double bound = t == 0 ? 0.0 : 0.25; /* a row's relative error in q8 or q4 */
                        int prev = -1;
                        for (uint32_t end = slot + kvc_layer_tier_tokens(s, l, t); slot < end; slot++)
                                for (uint32_t h = 0; h < H; h++) {
                                        float got = sc[(size_t)h * n + slot];
                                        uint32_t tok = (uint32_t)(got / 10.0f);
                                        if (tok >= N || got != score_of(tok, h))
                                                fail_msg("layer %u slot %u head %u: score %g", l, slot, h,
                                                         got);
                                        double e = 0, norm = 0;
                                        for (uint32_t j = 0; j < D; j++) {
                                                double x = k[((size_t)h * n + slot) * D + j],
                                                       w = keys[tok][h * D + j];
                                                e += (x - w) * (x - w);
                                                norm += w * w;
                                        }
                                        if (sqrt(e / norm) > bound + 1e-6)
                                                fail_msg("layer %u tier %u slot %u head %u: score of token "
                                                         "%u, key "
                                                         "off by %g",
                                                         l, t, slot, h, tok, sqrt(e / norm));
                                        if (h == 0 && (int)tok <= prev)
                                                fail_msg("layer %u slot %u: token %u after %d", l, slot, tok,
                                                         prev);
                                        if (h == 0)
                                                prev = (int)tok;
                                }
                }
                assert_int_equal(slot, n);
                free(k);
                free(v);
                free(sc);
        }
}

static void scores_follow_their_tokens_through_plans_and_tiers(void **state) {
        struct kvc_client *c = client(*state);
        const struct kvc_param params[] = { { "int8", "1" }, { "tier_window", "96" } };
        struct kvc_session_config cfg = {
                .policy = "conf", .budget_tokens = 160, .params = params, .n_params = 2, .tiers = "q8,q4"
        };
        struct kvc_session *s = open_session(c, &cfg);
        make_tokens();
        for (uint32_t t = 0; t < N; t++) { /* the newest slot is token t until the step */
                append(s, t);
                for (uint32_t l = 0; l < LAYERS; l++) {
                        uint32_t last = kvc_layer_tokens(s, l) - 1;
                        float sc[H];
                        for (uint32_t h = 0; h < H; h++)
                                sc[h] = score_of(t, h);
                        assert_int_equal(kvc_layer_set_scores(s, l, last, 1, sc), 0);
                }
                step(c, s, t, KVC_PHASE_DECODE);
        }
        assert_true(kvc_layer_tokens(s, 0) < N); /* evicted */
        for (uint32_t t = 0; t < 3; t++)
                assert_true(kvc_layer_tier_tokens(s, 0, t) > 0);
        assert_scores_follow_tokens(s);

        /* a whole layer written and read back exactly, then a range of it alone */
        uint32_t n = kvc_layer_tokens(s, 1);
        float *in = malloc((size_t)H * n * sizeof(float)), *out = malloc((size_t)H * n * sizeof(float));
        assert_true(in && out);
        for (size_t i = 0; i < (size_t)H * n; i++)
                in[i] = (float)i * 0.25f - 7.0f;
        assert_int_equal(kvc_layer_set_scores(s, 1, 0, n, in), 0);
        assert_int_equal(kvc_layer_get_scores(s, 1, 0, n, out), 0);
        assert_memory_equal(in, out, (size_t)H * n * sizeof(float));
        float part[H * 20];
        for (uint32_t i = 0; i < H * 20; i++)
                part[i] = 1000.0f + (float)i;
        assert_int_equal(kvc_layer_set_scores(s, 1, 50, 20, part), 0);
        assert_int_equal(kvc_layer_get_scores(s, 1, 0, n, out), 0);
        for (uint32_t h = 0; h < H; h++)
                for (uint32_t i = 0; i < n; i++) {
                        float want = i >= 50 && i < 70 ? part[h * 20 + i - 50] : in[(size_t)h * n + i];
                        if (out[(size_t)h * n + i] != want)
                                fail_msg("head %u slot %u: %g, want %g", h, i, out[(size_t)h * n + i], want);
                }
        float sub[H * 20];
        assert_int_equal(kvc_layer_get_scores(s, 1, 50, 20, sub), 0);
        assert_memory_equal(sub, part, sizeof(part));
        free(in);
        free(out);
        assert_int_equal(kvc_session_close(s, NULL), 0);
        kvc_disconnect(c);
}

static void bad_layers_ranges_and_scores_are_refused_and_nothing_is_written(void **state) {
        struct kvc_client *c = client(*state);
        struct kvc_session_config cfg = { .policy = "full" };
        struct kvc_session *s = open_session(c, &cfg);
        make_tokens();
        for (uint32_t t = 0; t < 20; t++)
                append(s, t);
        float before[H * 20], sc[H * 20], after[H * 20];
        for (uint32_t i = 0; i < H * 20; i++)
                before[i] = sc[i] = (float)i;
        assert_int_equal(kvc_layer_set_scores(s, 0, 0, 20, before), 0);
        sc[H * 20 - 1] = NAN; /* the last one: nothing before it is written either */
        assert_int_equal(kvc_layer_set_scores(s, 0, 0, 20, sc), -EINVAL);
        assert_non_null(strstr(kvc_last_error(c), "finite"));
        sc[H * 20 - 1] = INFINITY;
        assert_int_equal(kvc_layer_set_scores(s, 0, 0, 20, sc), -EINVAL);
        sc[H * 20 - 1] = -INFINITY;
        assert_int_equal(kvc_layer_set_scores(s, 0, 0, 20, sc), -EINVAL);
        for (uint32_t i = 0; i < H * 20; i++)
                sc[i] = -1.0f;
        assert_int_equal(kvc_layer_set_scores(s, LAYERS, 0, 1, sc), -EINVAL);
        assert_int_equal(kvc_layer_set_scores(s, 0, 0, 21, sc), -EINVAL);
        assert_int_equal(kvc_layer_set_scores(s, 0, 21, 0, sc), -EINVAL);
        assert_int_equal(kvc_layer_set_scores(s, 0, 19, 2, sc), -EINVAL);
        assert_int_equal(kvc_layer_set_scores(s, 0, 0, 1, NULL), -EINVAL);
        assert_int_equal(kvc_layer_set_scores(s, 0, 20, 0, NULL), 0); /* nothing, at the end */
        for (uint32_t i = 0; i < H * 20; i++)
                after[i] = -2.0f;
        assert_int_equal(kvc_layer_get_scores(s, LAYERS, 0, 1, after), -EINVAL);
        assert_int_equal(kvc_layer_get_scores(s, 0, 5, 16, after), -EINVAL);
        assert_int_equal(kvc_layer_get_scores(s, 0, 0, 1, NULL), -EINVAL);
        assert_true(after[0] == -2.0f); /* untouched on failure */
        assert_int_equal(kvc_layer_get_scores(s, 0, 0, 20, after), 0);
        assert_memory_equal(after, before, sizeof(before));
        assert_int_equal(kvc_session_close(s, NULL), 0);
        kvc_disconnect(c);
}

/* A second session of the same prompt attaches the first one's published blocks: writing over
 * them leaves the publisher's scores, the rest of the layer is written. */
static void a_shared_prefix_keeps_its_publishers_scores(void **state) {
        struct kvc_client *c = client(*state);
        enum { P = 32 };
        uint32_t ids[P + 1];
        for (uint32_t i = 0; i <= P; i++)
                ids[i] = i + 1;
        struct kvc_session_config cfg = { .policy = "full",
                                          .prompt_tokens = P + 1,
                                          .prompt_token_ids = ids,
                                          .n_prompt_token_ids = P + 1,
                                          .share_prefix = 1,
                                          .model_id = "scores" };
        struct kvc_session *a = open_session(c, &cfg);
        make_tokens();
        for (uint32_t t = 0; t <= P; t++)
                append(a, t);
        float mine[H * (P + 1)], got[H * (P + 1)];
        for (uint32_t i = 0; i < H * (P + 1); i++)
                mine[i] = 3.0f;
        for (uint32_t l = 0; l < LAYERS; l++)
                assert_int_equal(kvc_layer_set_scores(a, l, 0, P + 1, mine), 0);
        step(c, a, P, KVC_PHASE_PREFILL); /* the prompt is in: its whole blocks are published */

        struct kvc_session *b = open_session(c, &cfg);
        uint32_t shared = kvc_session_shared_tokens(b);
        assert_int_equal(shared, P);
        append(b, P);
        for (uint32_t i = 0; i < H * (P + 1); i++)
                mine[i] = 5.0f;
        assert_int_equal(kvc_layer_set_scores(b, 0, 0, P + 1, mine), 0);
        assert_int_equal(kvc_layer_get_scores(b, 0, 0, P + 1, got), 0);
        for (uint32_t h = 0; h < H; h++)
                for (uint32_t i = 0; i <= P; i++)
                        assert_true(got[h * (P + 1) + i] == (i < shared ? 3.0f : 5.0f));
        assert_int_equal(kvc_layer_get_scores(a, 0, 0, P, got), 0);
        for (uint32_t i = 0; i < P; i++)
                assert_true(got[i] == 3.0f);
        assert_int_equal(kvc_session_close(b, NULL), 0);
        assert_int_equal(kvc_session_close(a, NULL), 0);
        kvc_disconnect(c);
}

/* kvc-run (stories260K) with the extra arguments: its stdout, or NULL unless it exited with
 * `status`. */
static char *kvc_run(const struct daemon *d, int status, const char *const *extra) {
        const char *argv[32] = { harness_bin("kvc-run"),
                                 "--socket",
                                 d->dir,
                                 "-i",
                                 "Once upon a time, Lily saw a big red ball",
                                 "-n",
                                 "96",
                                 "--json" };
        size_t n = 8;
        for (; *extra && n < 31; extra++)
                argv[n++] = *extra;
        argv[n] = NULL;
        char *out = NULL;
        int st = -1;
        assert_int_equal(harness_run(argv, &out, &st), 0);
        if (!WIFEXITED(st) || WEXITSTATUS(st) != status) {
                free(out);
                return NULL;
        }
        return out;
}

/* The text of kvc-run's JSON (malloc'd). */
static char *text_of(const char *json) {
        const char *at = strstr(json, "\"text\":\"");
        assert_non_null(at);
        at += 8;
        const char *end = strstr(at, "\",\"kvcd\"");
        assert_non_null(end);
        return strndup(at, (size_t)(end - at));
}

static void kvc_run_scores_the_prompt_without_changing_what_it_computes(void **state) {
        const struct daemon *d = *state;
        /* with full (nothing evicted) every kind prints attention's text: the recon pass appends
         * nothing to the session, and the scores decide only what a plan keeps */
        char *want = NULL;
        for (const char *const *k = (const char *const[]){ "attention", "surprisal", "recon", NULL }; *k;
             k++) {
                const char *extra[] = { "--importance", *k, NULL };
                char *out = kvc_run(d, 0, extra);
                assert_non_null(out);
                char *text = text_of(out);
                if (!want)
                        want = strdup(text);
                else if (strcmp(text, want) != 0)
                        fail_msg("--importance %s printed\n%s\nnot\n%s", *k, text, want);
                if (strcmp(*k, "attention") != 0 && !strstr(out, "\"importance_seconds\":"))
                        fail_msg("no importance_seconds in %s", out);
                free(text);
                free(out);
        }
        free(want);
        /* with a policy that evicts by the scores, each kind runs its course */
        for (const char *const *k = (const char *const[]){ "surprisal", "recon", NULL }; *k; k++) {
                const char *extra[] = { "--importance", *k, "--policy", "h2o", "--budget", "32", NULL };
                char *out = kvc_run(d, 0, extra);
                assert_non_null(out);
                assert_true(harness_json_int(out, "plans_applied") > 0);
                free(out);
        }
        /* refused: a kind it does not know, the in-process cache, a plan lag, batches */
        const char *const bad[][5] = { { "--importance", "question", NULL },
                                       { "--importance", "recon", "--local", NULL },
                                       { "--importance", "surprisal", "--plan-lag", "1", NULL } };
        for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
                char *out = kvc_run(d, 2, bad[i]);
                assert_non_null(out);
                free(out);
        }
}

static int setup(void **state) {
        return harness_group_start(state, NULL);
}

static int teardown(void **state) {
        return harness_group_stop(state);
}

int main(void) {
        const struct CMUnitTest tests[] = {
                cmocka_unit_test(scores_follow_their_tokens_through_plans_and_tiers),
                cmocka_unit_test(bad_layers_ranges_and_scores_are_refused_and_nothing_is_written),
                cmocka_unit_test(a_shared_prefix_keeps_its_publishers_scores),
                cmocka_unit_test(kvc_run_scores_the_prompt_without_changing_what_it_computes),
        };
        return cmocka_run_group_tests(tests, setup, teardown);
}
