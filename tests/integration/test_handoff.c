/* test_handoff.c: a session handed from one client process to another without copying.
 *
 * Two kvc-run processes split a greedy generation: the first exports its session after 120
 * positions and exits, the second imports it with the ticket and carries on; together they print
 * exactly what one uninterrupted run prints, and kvcd copied nothing (the imported session is the
 * same session, in the same chunks). Then the ticket's rules, through libkvc in this process: one
 * import per ticket, none with a wrong ticket, no export of a session that was not opened for it.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>

#include <cmocka.h>

#include "harness.h"
#include "kvc.h"

#define RUN "-n", "300", "--no-stop", "--policy", "window", "--budget", "64"

/* kvc-run RUN, then the arguments of `with` and of `extra` (either may be NULL). */
static char *kvc_run_with(const struct daemon *d, const char *const *with, const char *const *extra) {
        const char *argv[40] = { harness_bin("kvc-run"), "--socket", d->dir, RUN };
        int n = 10;
        for (int i = 0; with && with[i] && n < 39; i++)
                argv[n++] = with[i];
        for (int i = 0; extra && extra[i] && n < 39; i++)
                argv[n++] = extra[i];
        argv[n] = NULL;
        char *out = harness_output(argv);
        assert_non_null(out);
        return out;
}

/* A generation exported after 120 positions and imported by another process prints the story of
 * one uninterrupted run (every run with the arguments `with` too). */
static void split_generation(struct daemon *d, const char *const *with) {
        char file[200];
        snprintf(file, sizeof(file), "%s/handoff", d->root);
        char *reference = kvc_run_with(d, with, NULL);
        const char *exporter[] = { "--export-at", "120", "--handoff-file", file, NULL };
        char *first = kvc_run_with(d, with, exporter);
        char *ticket = harness_slurp(file, NULL);
        assert_non_null(ticket);
        long long id = -1;
        assert_int_equal(sscanf(ticket, "kvc-handoff 1 session %lld", &id), 1);
        /* the exporter has exited: its session waits, parked, still holding its blocks */
        char *status = harness_kvcctl(d, "status");
        assert_int_equal(harness_json_int(status, "sessions"), 1);
        assert_true(harness_json_int(status, "used_bytes") > 0);
        long long held = harness_json_int(status, "used_bytes");
        free(status);

        const char *importer[] = { "--import", "--handoff-file", file, NULL };
        char *rest = kvc_run_with(d, with, importer);
        size_t n = strlen(first);
        char *both = malloc(n + strlen(rest) + 1);
        memcpy(both, first, n);
        strcpy(both + n, rest);
        assert_string_equal(both, reference);

        char *log = harness_slurp(d->log, NULL);
        char want[96];
        snprintf(want, sizeof(want), "session %lld imported by client", id);
        assert_non_null(strstr(log, want));
        assert_non_null(strstr(log, "nothing copied"));
        free(log);
        /* the same ticket again: the session is gone */
        const char *again[] = { harness_bin("kvc-run"), "--socket", d->dir, RUN, "--import",
                                "--handoff-file",       file,       NULL };
        char *out = NULL;
        int st;
        assert_int_equal(harness_run(again, &out, &st), 0);
        assert_true(WIFEXITED(st) && WEXITSTATUS(st) != 0);
        status = harness_kvcctl(d, "status");
        assert_int_equal(harness_json_int(status, "sessions"), 0);
        assert_int_equal(harness_json_int(status, "used_bytes"), 0);
        assert_true(held > 0);
        free(status);
        free(out);
        free(both);
        free(rest);
        free(ticket);
        free(first);
        free(reference);
}

static void two_processes_split_a_generation_and_print_one_story(void **state) {
        split_generation(*state, NULL);
}

static void a_ladder_session_is_handed_over_with_its_tiers(void **state) {
        const char *tiers[] = { "--tier", "q4", "--tier-window", "16", NULL }; /* window 64, 48 at 4 bits */
        split_generation(*state, tiers);
}

static struct kvc_session *open_one(struct kvc_client *c, int handoff) {
        struct kvc_session_config cfg = {
                .geometry = { .n_layers = 2,
                              .n_heads = 2,
                              .n_kv_heads = 1,
                              .head_dim = 8,
                              .dtype = KVC_DTYPE_F32,
                              .max_tokens = 128 },
                .policy = "window",
                .budget_tokens = 32,
                .handoff = handoff,
        };
        struct kvc_session *s = NULL;
        assert_int_equal(kvc_session_open(c, &cfg, &s), 0);
        float k[8], v[8];
        for (int i = 0; i < 8; i++)
                k[i] = v[i] = (float)i;
        for (int pos = 0; pos < 20; pos++)
                for (uint32_t l = 0; l < 2; l++)
                        assert_int_equal(kvc_append(s, l, pos, k, v), 0);
        return s;
}

static void a_ticket_opens_its_session_once(void **state) {
        struct daemon *d = *state;
        struct kvc_options o = { .socket = d->dir };
        struct kvc_client *a, *b;
        assert_int_equal(kvc_connect(&o, &a), 0);
        assert_int_equal(kvc_connect(&o, &b), 0);

        struct kvc_handoff h;
        struct kvc_session *plain = open_one(a, 0), *s = open_one(a, 1), *got = NULL;
        assert_int_equal(kvc_session_export(plain, &h), -EINVAL);
        assert_int_equal(kvc_session_export(s, &h), 0);

        struct kvc_handoff wrong = h;
        wrong.ticket[5] ^= 1;
        assert_int_equal(kvc_session_import(b, &wrong, &got), -EPERM);
        wrong = h;
        wrong.session_id = kvc_session_id(plain);
        assert_int_equal(kvc_session_import(b, &wrong, &got), -EPERM);
        assert_int_equal(kvc_session_import(b, &h, &got), 0);
        assert_int_equal(kvc_session_id(got), h.session_id);
        assert_int_equal(kvc_layer_tokens(got, 0), 20);
        assert_int_equal(kvc_layer_tokens(got, 1), 20);
        assert_int_equal(kvc_session_import(a, &h, &got), -EPERM); /* once */

        /* the importer carries on: appends and steps into the blocks it was handed */
        float k[8] = { 0 }, q[16] = { 0 }, out[16];
        assert_int_equal(kvc_append(got, 0, 20, k, k), 0);
        assert_int_equal(kvc_attend(got, 0, q, out), 0);
        assert_int_equal(kvc_session_close(got, NULL), 0);
        assert_int_equal(kvc_session_close(plain, NULL), 0);
        kvc_disconnect(a);
        kvc_disconnect(b);
        char *audit = harness_kvcctl(d, "audit");
        assert_non_null(audit);
        assert_non_null(strstr(audit, "\"clean\":true"));
        free(audit);
}

static int setup(void **state) {
        return harness_group_start(state, NULL);
}

int main(void) {
        const struct CMUnitTest tests[] = {
                cmocka_unit_test(two_processes_split_a_generation_and_print_one_story),
                cmocka_unit_test(a_ladder_session_is_handed_over_with_its_tiers),
                cmocka_unit_test(a_ticket_opens_its_session_once),
        };
        return cmocka_run_group_tests(tests, setup, harness_group_stop);
}
