/* test_eval_long.c: the long-generation and mechanism tasks of the quality lab check themselves in
 * their quick modes, on SmolLM2 ($KVC_SMOLLM2) through a real kvcd: the full cache is its own
 * reference (KL 0, every greedy token agreed), every answer position is scored in exactly one
 * part of the SCOPE split, budgets under the length are charged less than the full cache, a
 * window that has evicted nothing is the full cache (KL exactly 0 at those steps), attention
 * masses are shares, correlations are finite and in [-1, 1] with their intervals, and the files
 * are written. About 25 s of CPU for the two runs. */
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
#include "harness.h"

static char *longgen_output, *mechanism_output;
static char out_dir[512];

static int setup(void **state) {
        static struct daemon d;
        const char *model = getenv("KVC_SMOLLM2");
        if (!model || !*model) {
                fprintf(stderr, "KVC_SMOLLM2 is not set: run through `make test` (after `make model`)\n");
                return -1;
        }
        harness_client_deadline_ms = 600000; /* about 25 s of CPU: longer on a loaded 2-core machine */
        if (harness_daemon_start(&d, NULL, NULL) < 0)
                return -1;
        *state = &d;
        snprintf(out_dir, sizeof(out_dir), "%s/long-out", d.root);
        const char *tasks[] = { "longgen", "mechanism" };
        char **outputs[] = { &longgen_output, &mechanism_output };
        for (size_t i = 0; i < 2; i++) {
                const char *argv[] = { harness_bin("kvc-eval"),
                                       "--socket",
                                       d.dir,
                                       "--task",
                                       tasks[i],
                                       "--quick",
                                       "--threads",
                                       "1",
                                       "--model",
                                       model,
                                       "--out",
                                       out_dir,
                                       NULL };
                int st;
                if (harness_run(argv, outputs[i], &st) < 0 || !WIFEXITED(st) || WEXITSTATUS(st) != 0)
                        return -1;
        }
        return 0;
}

static int teardown(void **state) {
        free(longgen_output);
        free(mechanism_output);
        int st = harness_daemon_stop(*state);
        return WIFEXITED(st) && WEXITSTATUS(st) == 0 ? 0 : -1;
}

static void files_are_written(const char *const *names, size_t n) {
        for (size_t i = 0; i < n; i++) {
                char path[700];
                size_t len;
                snprintf(path, sizeof(path), "%s/%s", out_dir, names[i]);
                char *text = harness_slurp(path, &len);
                assert_non_null(text);
                assert_true(len > 0);
                free(text);
                snprintf(path, sizeof(path), "%s/%s.partial", out_dir, names[i]);
                assert_int_equal(access(path, F_OK), -1);
        }
}

static void the_full_cache_is_its_own_reference(void **state) {
        (void)state;
        assert_true(eval_field(longgen_output, "full", "kl") == 0);
        assert_true(eval_field(longgen_output, "full", "top1_agree") == 1.0);
        assert_true(eval_field(longgen_output, "full", "prompts") == 2);
        assert_true(eval_field(longgen_output, "full", "gen_tokens") == 48);
        assert_true(eval_field(longgen_output, "full", "n_prompt_cut") == 0);
        assert_true(eval_field(longgen_output, "full", "prompt_held") == 1.0);
}

/* Quick: the full cache, a unified window and SCOPE at half of prompt + answer. */
static void every_answer_position_is_scored_in_one_part(void **state) {
        (void)state;
        const char *labels[] = { "full", "window-50%", "scope-50%" };
        for (size_t i = 0; i < 3; i++) {
                double whole = eval_field(longgen_output, labels[i], "n_prompt_whole"),
                       cut = eval_field(longgen_output, labels[i], "n_prompt_cut");
                assert_true(whole + cut == 2 * 48);
                double kl = eval_field(longgen_output, labels[i], "kl"),
                       ag = eval_field(longgen_output, labels[i], "top1_agree");
                assert_true(kl >= 0 && ag >= 0 && ag <= 1);
                assert_true(eval_field(longgen_output, labels[i], "kl_lo") <= kl);
                assert_true(kl <= eval_field(longgen_output, labels[i], "kl_hi"));
                double held = eval_field(longgen_output, labels[i], "prompt_held");
                assert_true(held > 0 && held <= 1);
        }
        /* SCOPE cuts the prompt once it is in: every answer position but the first of each prompt
         * attended over a cut prompt */
        assert_true(eval_field(longgen_output, "scope-50%", "n_prompt_cut") >= 2 * 47);
        assert_true(eval_field(longgen_output, "scope-50%", "prompt_held") < 1.0);
        assert_null(strstr(longgen_output, "\"label\":\"h2o")); /* quick: three configurations only */
}

static void budgets_under_the_length_are_charged_less(void **state) {
        (void)state;
        const char *labels[] = { "window-50%", "scope-50%" };
        for (size_t i = 0; i < 2; i++) {
                assert_true(eval_field(longgen_output, labels[i], "peak_charged_bytes") <
                            eval_field(longgen_output, "full", "peak_charged_bytes"));
                assert_true(eval_field(longgen_output, labels[i], "avg_charged_bytes") <
                            eval_field(longgen_output, "full", "avg_charged_bytes"));
                assert_true(eval_field(longgen_output, labels[i], "end_charged_bytes") <
                            eval_field(longgen_output, "full", "end_charged_bytes"));
                assert_true(eval_field(longgen_output, labels[i], "end_of_full") < 1);
                assert_true(eval_field(longgen_output, labels[i], "kl") > 0);
        }
        const char *names[] = { "longgen.md", "longgen.jsonl", "longgen_prompts.csv", "longgen_curve.csv",
                                "longgen_answers.txt" };
        files_are_written(names, 5);
}

static void correlations_are_finite_and_in_range(void **state) {
        (void)state;
        const char *signals[] = { "confidence", "attn_mass_beyond", "attn_entropy",
                                  "attn_mass_beyond_nosink" };
        const char *targets[] = { "kl", "kl_next16" };
        for (size_t s = 0; s < 4; s++)
                for (size_t t = 0; t < 2; t++) {
                        char label[96];
                        snprintf(label, sizeof(label), "%s/%s/window-32", signals[s], targets[t]);
                        assert_true(eval_field(mechanism_output, label, "steps") > 100);
                        assert_true(eval_field(mechanism_output, label, "documents") == 2);
                        const char *keys[] = { "pearson", "spearman" };
                        for (size_t k = 0; k < 2; k++) {
                                char lo[32], hi[32];
                                snprintf(lo, sizeof(lo), "%s_lo", keys[k]);
                                snprintf(hi, sizeof(hi), "%s_hi", keys[k]);
                                double r = eval_field(mechanism_output, label, keys[k]);
                                double l = eval_field(mechanism_output, label, lo),
                                       h = eval_field(mechanism_output, label, hi);
                                assert_true(isfinite(r) && r >= -1 && r <= 1);
                                assert_true(isfinite(l) && isfinite(h) && l <= h && l >= -1 && h <= 1);
                        }
                }
}

/* The per-step file: before the window's first eviction it holds what the full cache holds, so
 * its KL is exactly 0; afterwards it costs something; attention masses are shares of 1. */
static void a_window_that_evicted_nothing_is_the_full_cache(void **state) {
        (void)state;
        char path[700];
        size_t len;
        snprintf(path, sizeof(path), "%s/mechanism_steps.csv", out_dir);
        char *text = harness_slurp(path, &len);
        assert_non_null(text);
        assert_non_null(strstr(text, "evicted_w32,kl_w32,kl_next16_w32,attn_mass_beyond_w32"));
        unsigned before = 0, after = 0;
        double after_kl = 0;
        char *save = NULL;
        strtok_r(text, "\n", &save); /* the header */
        for (char *line; (line = strtok_r(NULL, "\n", &save));) {
                unsigned doc, pos;
                int evicted;
                double conf, ent, top1, margin, attn_ent, kl, mass;
                char next[32] = "";
                int got = sscanf(line, "%u,%u,%lf,%lf,%lf,%lf,%lf,%d,%lf,%31[^,],%lf", &doc, &pos, &conf,
                                 &ent, &top1, &margin, &attn_ent, &evicted, &kl, next, &mass);
                if (got < 9)
                        continue;
                if (got < 11) /* no 16-step mean at the document's end: the field is empty */
                        assert_int_equal(sscanf(line, "%*u,%*u,%*f,%*f,%*f,%*f,%*f,%*d,%*f,,%lf", &mass), 1);
                assert_true(conf >= 0.15 && conf <= 1);
                assert_true(attn_ent >= 0 && attn_ent <= 1.0001);
                assert_true(mass >= 0 && mass <= 1.0001);
                if (!evicted) {
                        assert_true(kl == 0);
                        before++;
                } else {
                        after++;
                        after_kl += kl;
                }
        }
        free(text);
        assert_true(before >= 2 * 32);
        assert_true(after > 100);
        assert_true(after_kl / after > 0.01);
        const char *names[] = { "mechanism.md", "mechanism.jsonl", "mechanism_steps.csv" };
        files_are_written(names, 3);
}

int main(void) {
        const struct CMUnitTest tests[] = {
                cmocka_unit_test(the_full_cache_is_its_own_reference),
                cmocka_unit_test(every_answer_position_is_scored_in_one_part),
                cmocka_unit_test(budgets_under_the_length_are_charged_less),
                cmocka_unit_test(correlations_are_finite_and_in_range),
                cmocka_unit_test(a_window_that_evicted_nothing_is_the_full_cache),
        };
        return cmocka_run_group_tests(tests, setup, teardown);
}
