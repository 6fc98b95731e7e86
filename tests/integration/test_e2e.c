/* test_e2e.c: the real kvcd with real kvc-run clients over real sockets, on the real model.
 * Every wait is for an event (READY=1, a pipe's EOF, a process exit), with a deadline. */
#define _GNU_SOURCE
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>

#include <cmocka.h>

#include "harness.h"

#define GOLDEN "../shared/models/stories260K/golden-greedy-256.txt"

/* Runs kvc-run against d with the extra arguments; returns its stdout, asserting exit 0. */
static char *kvc_run(const struct daemon *d, const char *first, ...) {
        const char *argv[40] = { harness_bin("kvc-run"), "--socket", d->dir };
        int n = 3;
        va_list ap;
        va_start(ap, first);
        for (const char *a = first; a && n < 39; a = va_arg(ap, const char *))
                argv[n++] = a;
        va_end(ap);
        argv[n] = NULL;
        char *out = harness_output(argv);
        assert_non_null(out);
        return out;
}

static void full_policy_reproduces_the_known_greedy_story(void **state) {
        struct daemon *d = *state;
        size_t glen;
        char *golden = harness_slurp(GOLDEN, &glen);
        assert_non_null(golden);
        while (glen && golden[glen - 1] == '\n')
                golden[--glen] = '\0';
        char *out = kvc_run(d, "-n", "256", NULL);
        /* kvc-run prints the story and one newline, as llama2.c does */
        assert_int_equal(strlen(out), glen + 1);
        assert_memory_equal(out, golden, glen);
        assert_int_equal(out[glen], '\n');
        free(out);
        free(golden);
}

static void window_of_64_holds_at_most_one_block_more_than_its_budget(void **state) {
        struct daemon *d = *state;
        char *out =
                kvc_run(d, "--policy", "window", "--budget", "64", "-n", "512", "--no-stop", "--json", NULL);
        assert_int_equal(harness_json_int(out, "steps"), 512);
        /* kvcd's own accounting, reported when the session closed */
        long long peak_tokens = harness_json_int(out, "peak_tokens");
        long long peak_blocks = harness_json_int(out, "peak_layer_blocks");
        assert_true(peak_tokens > 64 && peak_tokens <= 64 + 16);
        assert_true(peak_blocks >= 4 && peak_blocks <= 5);
        long long plans = harness_json_int(out, "plans");
        assert_true(plans >= (512 - 80) / 16);
        assert_int_equal(harness_json_int(out, "plans_applied"), plans);
        free(out);

        /* and once closed, the pool is empty again */
        char *st = harness_kvcctl(d, "status");
        assert_non_null(st);
        assert_int_equal(harness_json_int(st, "used_bytes"), 0);
        assert_int_equal(harness_json_int(st, "sessions"), 0);
        free(st);
}

static void window_run_differs_from_full_once_the_window_bites(void **state) {
        struct daemon *d = *state;
        char *full = kvc_run(d, "-n", "300", NULL);
        char *win = kvc_run(d, "--policy", "window", "--budget", "32", "-n", "300", NULL);
        /* identical while the cache fits the window, different after: eviction is real */
        assert_memory_equal(full, win, 40);
        assert_string_not_equal(full, win);
        free(full);
        free(win);
}

static void concurrent_clients_produce_their_solo_output(void **state) {
        struct daemon *d = *state;
        const char *a_args[] = { harness_bin("kvc-run"),
                                 "--socket",
                                 d->dir,
                                 "-i",
                                 "Once upon a time, a cat",
                                 "-t",
                                 "0.9",
                                 "-s",
                                 "7",
                                 "-n",
                                 "400",
                                 NULL };
        const char *b_args[] = {
                harness_bin("kvc-run"), "--socket", d->dir, "--policy",  "window", "--budget", "48", "-i",
                "Tim had a red ball",   "-n",       "400",  "--no-stop", NULL
        };
        char *solo_a, *solo_b, *duo_a, *duo_b;
        int st;
        assert_int_equal(harness_run(a_args, &solo_a, &st), 0);
        assert_int_equal(harness_run(b_args, &solo_b, &st), 0);

        struct proc pa, pb;
        assert_int_equal(harness_spawn(&pa, a_args, true), 0);
        assert_int_equal(harness_spawn(&pb, b_args, true), 0);
        assert_int_equal(harness_finish(&pa, &duo_a, &st), 0);
        assert_true(WIFEXITED(st) && WEXITSTATUS(st) == 0);
        assert_int_equal(harness_finish(&pb, &duo_b, &st), 0);
        assert_true(WIFEXITED(st) && WEXITSTATUS(st) == 0);

        assert_true(strlen(solo_a) > 200 && strlen(solo_b) > 200);
        assert_string_equal(solo_a, duo_a);
        assert_string_equal(solo_b, duo_b);
        free(solo_a);
        free(solo_b);
        free(duo_a);
        free(duo_b);
}

static void killed_client_gives_back_every_block(void **state) {
        struct daemon *d = *state;
        const char *args[] = { harness_bin("kvc-run"), "--socket", d->dir, "-n", "512", "--no-stop", NULL };
        bool caught = false;
        /* kill it while kvcd shows its session holding blocks; a run may finish before we freeze it,
         * then try again */
        for (int attempt = 0; attempt < 20 && !caught; attempt++) {
                struct proc p;
                char buf[64];
                int st;
                assert_int_equal(harness_spawn(&p, args, true), 0);
                assert_true(harness_read_some(&p, buf, sizeof(buf)) > 0);
                kill(p.pid, SIGSTOP);
                char *sessions = harness_kvcctl(d, "sessions");
                assert_non_null(sessions);
                caught = harness_json_int(sessions, "bytes") > 0;
                free(sessions);
                kill(p.pid, SIGKILL);
                assert_int_equal(harness_finish(&p, NULL, &st), 0);
        }
        assert_true(caught);

        char *status = harness_kvcctl(d, "status");
        assert_non_null(status);
        assert_int_equal(harness_json_int(status, "used_bytes"), 0);
        assert_int_equal(harness_json_int(status, "sessions"), 0);
        assert_int_equal(harness_json_int(status, "clients"), 0);
        assert_int_equal(harness_json_int(status, "chunks_in_use"), 0);
        assert_true(harness_json_int(status, "client_deaths") >= 1);
        free(status);

        /* and the scrubbed chunks serve the next client */
        char *out = kvc_run(d, "-n", "64", NULL);
        assert_true(strlen(out) > 100);
        free(out);
}

static void second_kvcd_on_the_same_directory_refuses_to_start(void **state) {
        struct daemon *d = *state;
        const char *argv[] = { harness_bin("kvcd"), "--runtime-dir", d->dir, NULL };
        char *out;
        int st;
        assert_int_equal(harness_run(argv, &out, &st), 0);
        free(out);
        assert_true(WIFEXITED(st));
        assert_int_equal(WEXITSTATUS(st), 1);
        /* the first one still serves */
        char *s = harness_kvcctl(d, "status");
        assert_non_null(s);
        free(s);
}

static void every_binary_answers_help_and_version(void **state) {
        (void)state;
        const char *names[] = { "kvcd", "kvcctl", "kvc-run" };
        for (size_t i = 0; i < 3; i++) {
                for (int v = 0; v < 2; v++) {
                        const char *argv[] = { harness_bin(names[i]), v ? "--version" : "--help", NULL };
                        char *out;
                        int st;
                        assert_int_equal(harness_run(argv, &out, &st), 0);
                        assert_true(WIFEXITED(st) && WEXITSTATUS(st) == 0);
                        assert_non_null(strstr(out, v ? "0." : "Usage"));
                        free(out);
                }
        }
}

static void kvcctl_exits_3_when_no_kvcd_answers(void **state) {
        (void)state;
        const char *argv[] = {
                harness_bin("kvcctl"), "--socket", "/nonexistent-kvcd-dir", "--timeout", "300", "status", NULL
        };
        char *out;
        int st;
        assert_int_equal(harness_run(argv, &out, &st), 0);
        free(out);
        assert_true(WIFEXITED(st));
        assert_int_equal(WEXITSTATUS(st), 3);
}

static int setup(void **state) {
        return harness_group_start(state, NULL);
}

int main(void) {
        const struct CMUnitTest tests[] = {
                cmocka_unit_test(full_policy_reproduces_the_known_greedy_story),
                cmocka_unit_test(window_of_64_holds_at_most_one_block_more_than_its_budget),
                cmocka_unit_test(window_run_differs_from_full_once_the_window_bites),
                cmocka_unit_test(concurrent_clients_produce_their_solo_output),
                cmocka_unit_test(killed_client_gives_back_every_block),
                cmocka_unit_test(second_kvcd_on_the_same_directory_refuses_to_start),
                cmocka_unit_test(every_binary_answers_help_and_version),
                cmocka_unit_test(kvcctl_exits_3_when_no_kvcd_answers),
        };
        return cmocka_run_group_tests(tests, setup, harness_group_stop);
}
