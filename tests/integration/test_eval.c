/* test_eval.c: the quality lab's harness checks itself, on the real model through a real kvcd:
 * the full cache reproduces the model's own perplexity (computed without kvcd), and a window at
 * least as long as the sequence is the full cache. */
#define _GNU_SOURCE
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>

#include <cmocka.h>

#include "harness.h"

static char *eval_output;

static int setup(void **state) {
        static struct daemon d;
        if (harness_daemon_start(&d, NULL, NULL) < 0)
                return -1;
        *state = &d;
        const char *argv[] = { harness_bin("kvc-eval"), "--socket", d.dir, "--quick", NULL };
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

/* The number after "key": in the JSON line of configuration label ("own" for the model alone). */
static double field(const char *label, const char *key) {
        char pat[96], kpat[64];
        snprintf(pat, sizeof(pat), strcmp(label, "own") == 0 ? "{\"own\":true" : "{\"label\":\"%s\"", label);
        const char *line = strstr(eval_output, pat);
        assert_non_null(line);
        snprintf(kpat, sizeof(kpat), "\"%s\":", key);
        const char *p = strstr(line, kpat), *end = strchr(line, '\n');
        assert_non_null(p);
        assert_true(!end || p < end);
        return strtod(p + strlen(kpat), NULL);
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

int main(void) {
        const struct CMUnitTest tests[] = {
                cmocka_unit_test(full_cache_reproduces_the_models_own_perplexity),
                cmocka_unit_test(window_as_long_as_the_sequence_equals_the_full_cache),
                cmocka_unit_test(a_short_window_costs_quality_and_saves_bytes),
        };
        return cmocka_run_group_tests(tests, setup, teardown);
}
