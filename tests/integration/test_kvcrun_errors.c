/* test_kvcrun_errors.c: kvc-run says why whenever it exits with a failure (issue 28, items 9 and
 * 16): a model it refuses names the field, a model whose logits are not finite is named as the
 * cause (it was "summary: Invalid argument"), and a kvcd refused as not kvcd's is explained with
 * kvc_last_error(), which names the uid (it was "Operation not permitted"). Each case runs the real
 * kvc-run and reads its stderr to EOF; the refusals of kvcd come from a real kvcd. */
#define _GNU_SOURCE
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>

#include "harness.h"

#define STORIES "../shared/models/stories260K/stories260K.bin"

/* Runs argv to its end: its exit status, and its stderr (malloc'd) in *ret_err. */
static int run_err(const char *const *argv, char **ret_err) {
        struct proc p;
        int err_fd, st = -1;
        assert_int_equal(harness_spawn_stderr(&p, argv, &err_fd), 0);
        *ret_err = harness_read_all(err_fd);
        close(err_fd);
        char *out = NULL;
        assert_int_equal(harness_finish(&p, &out, &st), 0);
        free(out);
        assert_non_null(*ret_err);
        assert_true(WIFEXITED(st));
        return WEXITSTATUS(st);
}

static void expect_failure_saying(const char *const *argv, const char *want) {
        char *err = NULL;
        int code = run_err(argv, &err);
        if (code == 0 || !strstr(err, want))
                fail_msg("kvc-run exited %d saying \"%s\", expected a failure saying \"%s\"", code, err, want);
        free(err);
}

static void kvc_run_names_the_context_length_it_refuses(void **state) {
        (void)state;
        const char *argv[] = { harness_bin("kvc-run"), "--model", "tests/fuzz/corpus/gguf/seed-context-2p31",
                               "--local", "-n", "4", NULL };
        expect_failure_saying(argv, "llama.context_length 2147483648 is out of range");
}

static void kvc_run_names_the_model_when_its_logits_are_not_finite(void **state) {
        (void)state;
        FILE *in = fopen(STORIES, "rb");
        assert_non_null(in);
        const char *tmp = getenv("TMPDIR");
        char path[256];
        snprintf(path, sizeof(path), "%s/kvc-run-nan-XXXXXX", tmp && *tmp ? tmp : "/tmp");
        int fd = mkstemp(path);
        assert_true(fd >= 0);
        FILE *out = fdopen(fd, "wb");
        assert_non_null(out);
        uint8_t head[28]; /* the llama2.c header: 7 int32 */
        assert_int_equal(fread(head, 1, sizeof(head), in), sizeof(head));
        assert_int_equal(fwrite(head, 1, sizeof(head), out), sizeof(head));
        const uint32_t nan_bits = 0x7fc00000u;
        uint32_t w;
        while (fread(&w, 4, 1, in) == 1) /* every weight NaN */
                assert_int_equal(fwrite(&nan_bits, 4, 1, out), 1);
        fclose(in);
        assert_int_equal(fclose(out), 0);
        const char *argv[] = { harness_bin("kvc-run"), "--model", path, "--local", "-n", "4", NULL };
        char want[384];
        snprintf(want, sizeof(want), "the model %s computed logits that are not finite", path);
        expect_failure_saying(argv, want);
        unlink(path);
}

static void kvc_run_prints_why_kvcd_was_refused(void **state) {
        struct daemon *d = *state;
        const char *argv[] = { harness_bin("kvc-run"), "--socket", d->dir, "-n", "4", NULL };
        setenv("KVC_DAEMON_UID", "65534", 1); /* the test's kvcd is ours, not that uid's */
        char *err = NULL;
        int code = run_err(argv, &err);
        unsetenv("KVC_DAEMON_UID");
        if (code != 1 || !strstr(err, "Operation not permitted") || !strstr(err, "is served by uid") ||
            !strstr(err, "only uid 65534"))
                fail_msg("kvc-run exited %d saying \"%s\"", code, err);
        free(err);
}

static int setup(void **state) {
        return harness_group_start(state, NULL);
}

int main(void) {
        const struct CMUnitTest tests[] = {
                cmocka_unit_test(kvc_run_names_the_context_length_it_refuses),
                cmocka_unit_test(kvc_run_names_the_model_when_its_logits_are_not_finite),
                cmocka_unit_test(kvc_run_prints_why_kvcd_was_refused),
        };
        return cmocka_run_group_tests(tests, setup, harness_group_stop);
}
