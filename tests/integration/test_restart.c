/* test_restart.c: kvcd killed mid-generation comes back under its service manager (played by
 * sdharness) with every cache: the client's answer is the one an uninterrupted run gives. */
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
#include "sdharness.h"

#define RUN_ARGS "-n", "400", "--no-stop", "--policy", "window", "--budget", "64"

static int setup(void **state) {
        struct sdsvc *s = calloc(1, sizeof(*s));
        if (!s || sdsvc_init(s) < 0 || sdsvc_start(s, NULL) < 0)
                return -1;
        *state = s;
        return 0;
}

static int teardown(void **state) {
        struct sdsvc *s = *state;
        sdsvc_free(s);
        free(s);
        return 0;
}

/* kvcctl --json VERB against the harness's kvcd: its output (malloc'd) or NULL. */
static char *kvcctl(struct sdsvc *s, const char *verb) {
        const char *argv[] = { harness_bin("kvcctl"), "--socket", s->dir, "--json", verb, NULL };
        return harness_output(argv);
}

static long long status_int(struct sdsvc *s, const char *key) {
        char *json = kvcctl(s, "status");
        long long v = json ? harness_json_int(json, key) : -1;
        free(json);
        return v;
}

static size_t count(const char *hay, const char *needle) {
        size_t n = 0;
        for (const char *p = hay; (p = strstr(p, needle)); p += strlen(needle))
                n++;
        return n;
}

static char *run_to_end(struct sdsvc *s) {
        const char *argv[] = { harness_bin("kvc-run"), "--socket", s->dir, RUN_ARGS, NULL };
        char *out = harness_output(argv);
        assert_non_null(out);
        return out;
}

static void a_killed_kvcd_gives_every_cache_back(void **state) {
        struct sdsvc *s = *state;
        char *reference = run_to_end(s);
        assert_true(strlen(reference) > 400);
        assert_int_equal(status_int(s, "sessions"), 0);

        /* kvcd is stopped (SIGSTOP) while the client waits on it, then killed: the client never
         * sees an answer from the old kvcd after the cut. The first 300 bytes of its output mark
         * "mid-generation"; if the kill still came after the end, try again (it has not yet). */
        bool resumed = false;
        for (int attempt = 0; attempt < 3 && !resumed; attempt++) {
                const char *argv[] = { harness_bin("kvc-run"), "--socket", s->dir, RUN_ARGS, NULL };
                struct proc p;
                assert_int_equal(harness_spawn(&p, argv, true), 0);
                char head[300];
                assert_int_equal(harness_read_some(&p, head, sizeof(head)), (ssize_t)sizeof(head));
                kill(s->pid, SIGSTOP);
                int st = sdsvc_kill(s, SIGKILL);
                assert_true(WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL);
                assert_true(sdsvc_store_count(s, "chunk-") > 0);
                assert_int_equal(sdsvc_store_count(s, "state"), 1);

                assert_int_equal(sdsvc_start(s, NULL), 0);
                char *rest = NULL;
                assert_int_equal(harness_finish(&p, &rest, &st), 0);
                assert_true(WIFEXITED(st) && WEXITSTATUS(st) == 0);
                char *all = malloc(sizeof(head) + strlen(rest) + 1);
                memcpy(all, head, sizeof(head));
                strcpy(all + sizeof(head), rest);
                assert_string_equal(all, reference);
                free(all);
                free(rest);

                char *log = harness_slurp(s->log, NULL);
                assert_non_null(log);
                resumed = count(log, "resumed by client") > (size_t)attempt;
                free(log);
        }
        assert_true(resumed);
        /* the resumed session closed normally: nothing held, nothing left of the old connection */
        assert_int_equal(status_int(s, "sessions"), 0);
        assert_int_equal(status_int(s, "used_bytes"), 0);
        free(reference);
}

static void a_session_nobody_resumes_is_scrubbed_after_the_grace(void **state) {
        struct sdsvc *s = *state;
        const char *argv[] = { harness_bin("kvc-run"), "--socket", s->dir, RUN_ARGS, NULL };
        struct proc p;
        assert_int_equal(harness_spawn(&p, argv, true), 0);
        char head[100];
        assert_int_equal(harness_read_some(&p, head, sizeof(head)), (ssize_t)sizeof(head));
        kill(s->pid, SIGSTOP);
        kill(p.pid, SIGKILL); /* the client dies with kvcd */
        char *out = NULL;
        int st;
        harness_finish(&p, &out, &st);
        free(out);
        sdsvc_kill(s, SIGKILL);

        const char *grace[] = { "--resume-grace", "0.2", NULL };
        assert_int_equal(sdsvc_start(s, grace), 0);
        /* the orphaned session is back (it holds its memory) until the grace ends */
        long long sessions = -1, used = -1;
        for (int i = 0; i < 2000; i++) {
                sessions = status_int(s, "sessions");
                used = status_int(s, "used_bytes");
                if (sessions == 0 && used == 0)
                        break;
        }
        assert_int_equal(sessions, 0);
        assert_int_equal(used, 0);
        char *log = harness_slurp(s->log, NULL);
        assert_non_null(strstr(log, "did not come back"));
        free(log);
        /* chunks of the scrubbed connection went back to the pool, and stay in the store for reuse */
        assert_int_equal(sdsvc_store_count(s, "state"), 1);
}

static void a_clean_stop_empties_the_store(void **state) {
        struct sdsvc *s = *state;
        free(run_to_end(s));
        assert_true(sdsvc_store_count(s, "") > 0);
        int st = sdsvc_kill(s, SIGTERM);
        assert_true(WIFEXITED(st) && WEXITSTATUS(st) == 0);
        assert_int_equal(sdsvc_store_count(s, ""), 0);
        /* and the next start is a fresh one */
        assert_int_equal(sdsvc_start(s, NULL), 0);
        assert_int_equal(status_int(s, "sessions"), 0);
}

int main(void) {
        const struct CMUnitTest tests[] = {
                cmocka_unit_test(a_killed_kvcd_gives_every_cache_back),
                cmocka_unit_test(a_session_nobody_resumes_is_scrubbed_after_the_grace),
                cmocka_unit_test(a_clean_stop_empties_the_store),
        };
        return cmocka_run_group_tests(tests, setup, teardown);
}
