/* test_share.c: kvc-run processes sharing a prompt prefix through kvcd.
 *
 * A publisher runs with --share and is stopped (SIGSTOP) once kvcd says it published its prompt
 * blocks; while it holds them, other runs of the same prompt attach them: they print exactly what
 * unshared runs print (with the full policy, and with a window that evicts inside the shared
 * prefix by masking), they compute nothing for the attached tokens (kvcd counts fewer steps), and
 * the prefix is held once (their peak bytes drop by the shared bytes, the node counts the blocks
 * once). Continued, the publisher prints its own unshared text; at the end nothing is left and the
 * audit is clean.
 */
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

#define PROMPT                                                                                               \
        "Once upon a time, there was a little girl named Lily. She loved to play outside in the park "       \
        "with her friends. One day, she saw a big red ball"

/* kvc-run --json with the prompt and the extra arguments: its JSON (malloc'd). */
static char *run_json(const struct daemon *d, const char *const *extra) {
        const char *argv[40] = { harness_bin("kvc-run"), "--socket", d->dir, "-i", PROMPT, "--json" };
        int n = 6;
        for (int i = 0; extra[i] && n < 39; i++)
                argv[n++] = extra[i];
        argv[n] = NULL;
        char *out = harness_output(argv);
        assert_non_null(out);
        return out;
}

/* The "text" of kvc-run's JSON (malloc'd; escapes kept as they are: compared, not read). */
static char *text_of(const char *json) {
        const char *p = strstr(json, "\"text\":\"");
        assert_non_null(p);
        p += 8;
        const char *e = p;
        while (*e && !(*e == '"' && e[-1] != '\\'))
                e++;
        return strndup(p, (size_t)(e - p));
}

static long long status_int(const struct daemon *d, const char *key) {
        char *json = harness_kvcctl(d, "status");
        long long v = json ? harness_json_int(json, key) : -1;
        free(json);
        return v;
}

static void runs_of_one_prompt_share_its_prefix(void **state) {
        struct daemon *d = *state;
        const char *full[] = { "-n", "200", NULL },
                   *window[] = { "-n", "200", "--policy", "window", "--budget", "24", NULL };
        const char *full_shared[] = { "-n", "200", "--share", NULL };
        const char *window_shared[] = {
                "-n", "200", "--policy", "window", "--budget", "24", "--share", NULL
        };
        const char *long_run[] = { "-n", "400", "--no-stop", NULL };
        char *ref_full = run_json(d, full), *ref_window = run_json(d, window),
             *ref_long = run_json(d, long_run);
        long long ref_peak = harness_json_int(strstr(ref_full, "\"kvcd\""), "peak_bytes");
        assert_int_equal(status_int(d, "shared_blocks"), 0); /* unshared runs publish nothing */

        /* the publisher stops itself at position 48, past its prompt of 33: published by then */
        const char *pub_argv[] = { harness_bin("kvc-run"),
                                   "--socket",
                                   d->dir,
                                   "-i",
                                   PROMPT,
                                   "--json",
                                   "-n",
                                   "400",
                                   "--no-stop",
                                   "--share",
                                   "--stop-at",
                                   "48",
                                   NULL };
        struct proc pub;
        int st;
        assert_int_equal(harness_spawn(&pub, pub_argv, true), 0);
        assert_int_equal(waitpid(pub.pid, &st, WUNTRACED), pub.pid); /* the event: it stopped */
        assert_true(WIFSTOPPED(st));
        long long blocks = status_int(d, "shared_blocks");
        assert_true(blocks > 0);
        long long shared_bytes = status_int(d, "shared_bytes");
        assert_true(shared_bytes > 0);

        /* attached runs: the same text, fewer steps, the prefix held once */
        char *a = run_json(d, full_shared), *b = run_json(d, window_shared);
        char *ta = text_of(a), *tb = text_of(b), *tf = text_of(ref_full), *tw = text_of(ref_window);
        assert_string_equal(ta, tf);
        assert_string_equal(tb, tw);
        long long steps = harness_json_int(strstr(a, "\"kvcd\""), "steps");
        assert_int_equal(steps, 200 - blocks * 16); /* nothing computed for the attached tokens */
        assert_int_equal(harness_json_int(strstr(a, "\"kvcd\""), "peak_bytes"), ref_peak - shared_bytes);
        assert_int_equal(status_int(d, "shared_blocks"), blocks); /* once, however many attach */
        char *log = harness_slurp(d->log, NULL);
        assert_non_null(strstr(log, "attached a shared prefix"));
        free(log);

        /* the publisher goes on, unharmed */
        kill(pub.pid, SIGCONT);
        char *pub_out = NULL;
        assert_int_equal(harness_finish(&pub, &pub_out, &st), 0);
        assert_true(WIFEXITED(st) && WEXITSTATUS(st) == 0);
        char *tp = text_of(pub_out), *tl = text_of(ref_long);
        assert_string_equal(tp, tl);

        assert_int_equal(status_int(d, "shared_blocks"), 0);
        assert_int_equal(status_int(d, "used_bytes"), 0);
        char *audit = harness_kvcctl(d, "audit");
        assert_non_null(audit);
        assert_non_null(strstr(audit, "\"clean\":true"));
        free(audit);
        free(tp);
        free(tl);
        free(pub_out);
        free(ta);
        free(tb);
        free(tf);
        free(tw);
        free(a);
        free(b);
        free(ref_full);
        free(ref_window);
        free(ref_long);
}

static int setup(void **state) {
        return harness_group_start(state, NULL);
}

int main(void) {
        const struct CMUnitTest tests[] = {
                cmocka_unit_test(runs_of_one_prompt_share_its_prefix),
        };
        return cmocka_run_group_tests(tests, setup, harness_group_stop);
}
