/* test_eval.c: the quality lab's harness checks itself, on the real model through a real kvcd:
 * the full cache reproduces the model's own perplexity (computed without kvcd), a window at least
 * as long as the sequence is the full cache, bytes are what kvcd charges (its peak, reported at
 * close), tokens held show the plan's slack, every figure carries its interval, results go to
 * the directory asked for only when the run completes. The second group runs the needle task's
 * quick mode on SmolLM2 ($KVC_SMOLLM2): the full cache finds every needle, every configuration
 * reports its bytes and intervals. */
#define _GNU_SOURCE
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>

#include "evalout.h"
#include "evalout.h"
#include "harness.h"

static char *eval_output;
static char out_dir[512];

static int setup(void **state) {
        static struct daemon d;
        if (harness_daemon_start(&d, NULL, NULL) < 0)
                return -1;
        *state = &d;
        snprintf(out_dir, sizeof(out_dir), "%s/eval-out", d.root);
        const char *argv[] = {
                harness_bin("kvc-eval"), "--socket", d.dir, "--quick", "--out", out_dir, NULL
        };
        int st;
        if (harness_run(argv, &eval_output, &st) < 0 || !WIFEXITED(st) || WEXITSTATUS(st) != 0)
                return -1;
        return 0;
}

static int teardown(void **state) {
        free(eval_output);
        int st = harness_daemon_stop(*state);
        return WIFEXITED(st) && WEXITSTATUS(st) == 0 ? 0 : -1;
}

static double field(const char *label, const char *key) {
        return eval_field(eval_output, label, key);
}

static void full_cache_reproduces_the_models_own_perplexity(void **state) {
        (void)state;
        double own = field("own", "ppl"), full = field("full", "ppl");
        assert_true(own > 1.5 && own < 10);
        assert_true(fabs(full - own) / own < 1e-4);
        assert_true(field("own", "tokens") >= 300);
        assert_true(field("full", "kl") < 1e-9);
        assert_true(field("full", "top1_agree") == 1.0);
}

static void window_as_long_as_the_sequence_equals_the_full_cache(void **state) {
        (void)state;
        assert_true(field("window-big", "ppl") == field("full", "ppl"));
        assert_true(field("window-big", "kl") < 1e-9);
        assert_true(field("window-big", "plans") == 0);
}

static void a_short_window_costs_quality_and_saves_bytes(void **state) {
        (void)state;
        assert_true(field("window-32", "ppl") > field("full", "ppl"));
        assert_true(field("window-32", "kl") > 0.001);
        assert_true(field("window-32", "avg_kv_bytes") < field("full", "avg_kv_bytes") / 2);
        assert_true(field("window-32", "plans") > 0);
        /* each story has recurring names to measure recall on */
        assert_true(field("full", "name_n") > 0);
}

/* Bytes are kvcd's: blocks granted at their full size with the side arrays, so more than the live
 * tokens as FP16; the peak is kvcd's own. Budget 32 with a block of slack holds 32..47 tokens. */
static void bytes_are_what_kvcd_charges_and_tokens_show_the_slack(void **state) {
        (void)state;
        assert_true(field("window-32", "avg_charged_bytes") > field("window-32", "avg_kv_bytes"));
        assert_true(field("window-32", "peak_charged_bytes") >= field("window-32", "avg_charged_bytes"));
        assert_true(field("full", "peak_charged_bytes") > field("window-32", "peak_charged_bytes"));
        assert_true(field("window-32", "avg_tokens_held") >= 32);
        assert_true(field("window-32", "avg_tokens_held") < 48);
        assert_true(field("window-32", "peak_tokens_held") <= 47);
        assert_true(field("window-32", "peak_tokens_held") >= 33);
        /* the full cache has no reserve beyond its layers' blocks */
        assert_true(field("full", "close_extra_bytes") == 0);
}

/* Every perplexity and KL carries its story-clustered interval, around the estimate. */
static void every_figure_has_its_interval(void **state) {
        (void)state;
        const char *labels[] = { "full", "window-32", "conf-32" };
        for (size_t i = 0; i < 3; i++) {
                assert_true(field(labels[i], "ppl_lo") <= field(labels[i], "ppl"));
                assert_true(field(labels[i], "ppl_hi") >= field(labels[i], "ppl"));
                assert_true(field(labels[i], "ppl_hi") > field(labels[i], "ppl_lo"));
                assert_true(field(labels[i], "sequences") == 3);
        }
        assert_true(field("window-32", "kl_hi") > field("window-32", "kl"));
        assert_true(field("window-32", "kl_lo") < field("window-32", "kl"));
}

/* The run wrote its files in --out, complete (no .partial left), and says which split it scored. */
static void results_land_in_the_directory_asked_for(void **state) {
        (void)state;
        const char *names[] = { "results.md", "results.csv", "results.jsonl", "confidence_kl.csv" };
        char path[600];
        for (size_t i = 0; i < 4; i++) {
                snprintf(path, sizeof(path), "%s/%s", out_dir, names[i]);
                size_t len;
                char *text = harness_slurp(path, &len);
                assert_non_null(text);
                assert_true(len > 0);
                free(text);
                snprintf(path, sizeof(path), "%s/%s.partial", out_dir, names[i]);
                assert_int_equal(access(path, F_OK), -1);
        }
        snprintf(path, sizeof(path), "%s/results.md", out_dir);
        size_t md_len;
        char *md = harness_slurp(path, &md_len);
        assert_non_null(md);
        assert_non_null(strstr(md, "**test split**"));
        assert_non_null(strstr(md, "[")); /* intervals */
        free(md);
}

/* A run that fails (here: no kvcd to talk to) leaves the results already in --out as they were. */
static void a_failed_run_leaves_the_old_results_intact(void **state) {
        (void)state;
        char path[600], md[600];
        snprintf(md, sizeof(md), "%s/results.md", out_dir);
        size_t before_len;
        char *before = harness_slurp(md, &before_len);
        assert_non_null(before);
        snprintf(path, sizeof(path), "%s/no-such-kvcd", out_dir);
        const char *argv[] = { harness_bin("kvc-eval"), "--socket", path, "--quick", "--out", out_dir, NULL };
        char *out = NULL;
        int st;
        assert_int_equal(harness_run(argv, &out, &st), 0);
        assert_true(WIFEXITED(st) && WEXITSTATUS(st) != 0);
        free(out);
        size_t after_len;
        char *after = harness_slurp(md, &after_len);
        assert_non_null(after);
        assert_int_equal(after_len, before_len);
        assert_memory_equal(after, before, before_len);
        snprintf(path, sizeof(path), "%s/confidence_kl.csv.partial", out_dir);
        assert_int_equal(access(path, F_OK), -1);
        free(before);
        free(after);
}

/* ---- needle in a haystack, quick mode, on SmolLM2 ---- */

static char *niah_output, *longdoc_output;
static char niah_dir[512];

static int niah_setup(void **state) {
        static struct daemon d;
        const char *model = getenv("KVC_SMOLLM2");
        if (!model || !*model) {
                fprintf(stderr, "KVC_SMOLLM2 is not set: run through `make test` (after `make model`)\n");
                return -1;
        }
        harness_client_deadline_ms = 600000; /* about 50 s of CPU: longer on a loaded 2-core machine */
        if (harness_daemon_start(&d, NULL, NULL) < 0)
                return -1;
        *state = &d;
        snprintf(niah_dir, sizeof(niah_dir), "%s/niah-out", d.root);
        const char *argv[] = { harness_bin("kvc-eval"),
                               "--socket",
                               d.dir,
                               "--task",
                               "niah",
                               "--quick",
                               "--model",
                               model,
                               "--out",
                               niah_dir,
                               NULL };
        int st;
        if (harness_run(argv, &niah_output, &st) < 0 || !WIFEXITED(st) || WEXITSTATUS(st) != 0)
                return -1;
        const char *doc[] = { harness_bin("kvc-eval"),
                              "--socket",
                              d.dir,
                              "--task",
                              "longdoc",
                              "--quick",
                              "--model",
                              model,
                              "--out",
                              niah_dir,
                              NULL };
        if (harness_run(doc, &longdoc_output, &st) < 0 || !WIFEXITED(st) || WEXITSTATUS(st) != 0)
                return -1;
        return 0;
}

static int niah_teardown(void **state) {
        free(niah_output);
        free(longdoc_output);
        int st = harness_daemon_stop(*state);
        return WIFEXITED(st) && WEXITSTATUS(st) == 0 ? 0 : -1;
}

static double niah_field(const char *label, const char *key) {
        return eval_field(niah_output, label, key);
}

/* Long documents (quick: two of 256 tokens, the full cache, window and conf-fixed at a quarter and
 * a half, conf-attention at a quarter): the full cache is its own reference, the window differs
 * from it, every figure has its interval, and the attention gate is read against conf-fixed at its
 * own bytes (the gate holds between B and n_low, so conf-fixed's two budgets bracket it). */
static void long_documents_score_against_the_full_cache(void **state) {
        (void)state;
        assert_true(eval_field(longdoc_output, "full", "kl") == 0);
        assert_true(eval_field(longdoc_output, "full", "top1_agree") == 1.0);
        assert_true(eval_field(longdoc_output, "full", "documents") == 2);
        assert_true(eval_field(longdoc_output, "window-64", "kl") > 0.01);
        assert_true(eval_field(longdoc_output, "window-64", "top1_agree") < 1.0);
        double ppl = eval_field(longdoc_output, "window-64", "ppl");
        assert_true(eval_field(longdoc_output, "window-64", "ppl_lo") < ppl);
        assert_true(eval_field(longdoc_output, "window-64", "ppl_hi") > ppl);
        assert_true(eval_field(longdoc_output, "window-64", "avg_charged_bytes") <
                    eval_field(longdoc_output, "full", "avg_charged_bytes"));
        double gated = eval_field(longdoc_output, "conf-attention-64", "avg_charged_bytes");
        assert_true(gated >= eval_field(longdoc_output, "conf-fixed-64", "avg_charged_bytes"));
        assert_true(gated <= eval_field(longdoc_output, "conf-fixed-128", "avg_charged_bytes"));
        char path[600];
        size_t len = 0;
        snprintf(path, sizeof(path), "%s/longdoc.md", niah_dir);
        char *md = harness_slurp(path, &len);
        assert_non_null(md);
        assert_non_null(strstr(md, "#### Targets at 256 tokens"));
        const char *gate = strstr(md, "  - conf-attention-64 (");
        if (!gate || !strstr(gate, "ΔNLL") || !strstr(gate, "between conf-fixed-64 and conf-fixed-128"))
                fail_msg("longdoc.md does not read the attention gate against conf-fixed:\n%s", md);
        free(md);
        snprintf(path, sizeof(path), "%s/longdoc.jsonl", niah_dir);
        char *jl = harness_slurp(path, &len);
        assert_non_null(jl);
        assert_non_null(strstr(jl, "\"target\":\"gate_vs_fixed_nll\",\"label\":\"conf-attention-64\""));
        free(jl);
}

static void the_full_cache_finds_every_needle(void **state) {
        (void)state;
        assert_true(niah_field("full", "needles") == 3);
        assert_true(niah_field("full", "acc") == 1.0);
        assert_true(niah_field("full", "logp") > -3.0); /* the value's tokens, likely */
        assert_true(niah_field("full", "length") == 192);
}

/* Three configurations (the full cache, window and conf at half the haystack), each with its
 * bytes, its intervals around the estimates and its paired difference to the full cache. */
static void every_configuration_reports_bytes_and_intervals(void **state) {
        (void)state;
        const char *labels[] = { "full", "window-50%", "conf-fixed-50%" };
        for (size_t i = 0; i < 3; i++) {
                double acc = niah_field(labels[i], "acc"), lp = niah_field(labels[i], "logp");
                assert_true(acc >= 0 && acc <= 1);
                assert_true(niah_field(labels[i], "acc_lo") <= acc && acc <= niah_field(labels[i], "acc_hi"));
                assert_true(niah_field(labels[i], "logp_lo") <= lp && lp <= niah_field(labels[i], "logp_hi"));
                assert_true(niah_field(labels[i], "avg_charged_bytes") > 0);
                assert_true(niah_field(labels[i], "peak_charged_bytes") >=
                            niah_field(labels[i], "avg_charged_bytes"));
                assert_true(niah_field(labels[i], "d_logp_lo") <= niah_field(labels[i], "d_logp_hi"));
        }
        assert_true(niah_field("window-50%", "logp_hi") > niah_field("window-50%", "logp_lo"));
        assert_true(niah_field("window-50%", "peak_charged_bytes") <
                    niah_field("full", "peak_charged_bytes"));
        assert_true(niah_field("window-50%", "avg_charged_bytes") < niah_field("full", "avg_charged_bytes"));
        assert_null(strstr(niah_output, "\"label\":\"h2o")); /* quick: three configurations only */

        const char *names[] = { "niah.md", "niah.csv", "niah.jsonl", "niah_needles.csv" };
        for (size_t i = 0; i < 4; i++) {
                char path[600];
                size_t len;
                snprintf(path, sizeof(path), "%s/%s", niah_dir, names[i]);
                char *text = harness_slurp(path, &len);
                assert_non_null(text);
                assert_true(len > 0);
                free(text);
        }
}

int main(void) {
        const struct CMUnitTest tests[] = {
                cmocka_unit_test(full_cache_reproduces_the_models_own_perplexity),
                cmocka_unit_test(window_as_long_as_the_sequence_equals_the_full_cache),
                cmocka_unit_test(a_short_window_costs_quality_and_saves_bytes),
                cmocka_unit_test(bytes_are_what_kvcd_charges_and_tokens_show_the_slack),
                cmocka_unit_test(every_figure_has_its_interval),
                cmocka_unit_test(results_land_in_the_directory_asked_for),
                cmocka_unit_test(a_failed_run_leaves_the_old_results_intact),
        };
        const struct CMUnitTest niah[] = {
                cmocka_unit_test(the_full_cache_finds_every_needle),
                cmocka_unit_test(every_configuration_reports_bytes_and_intervals),
                cmocka_unit_test(long_documents_score_against_the_full_cache),
        };
        int failed = cmocka_run_group_tests(tests, setup, teardown);
        return failed + cmocka_run_group_tests(niah, niah_setup, niah_teardown);
}
