/* test_runtime_dir.c: the runtime directory cannot be squatted (issue 19, item 2).
 *
 * kvcd refuses a runtime directory another uid owns or that others may write in, and a kvcd.lock
 * that is a symlink (its target is not created); libkvc refuses a kvcd whose side channel is
 * served by a uid it does not allow (SO_PEERCRED), a runtime directory others may write in, and a
 * kvcd.sock of another user, before it sends a byte; kvcctl makes the same check of
 * kvcd.admin.sock (issue 28). The uid it allows is pinned for the test with
 * KVC_DAEMON_UID (the test's kvcd runs as root, which libkvc allows by default). Needs root (chown
 * to 65534); skipped otherwise.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>

#include "harness.h"
#include "kvc.h"

#define NOBODY 65534

struct tmp {
        char root[96];
        char dir[128];
};

static void tmp_make(struct tmp *t) {
        const char *tmp = getenv("TMPDIR");
        snprintf(t->root, sizeof(t->root), "%s/kvcd-rtdir-XXXXXX", tmp && *tmp ? tmp : "/tmp");
        assert_non_null(mkdtemp(t->root));
        snprintf(t->dir, sizeof(t->dir), "%s/run", t->root);
        assert_int_equal(mkdir(t->dir, 0750), 0);
}

static void tmp_remove(struct tmp *t) {
        char cmd[300];
        snprintf(cmd, sizeof(cmd), "rm -rf '%s'", t->root);
        assert_int_equal(system(cmd), 0);
}

/* Runs kvcd on dir (no service manager): it must fail at once, with exit status 1 and a line on
 * stderr containing want. */
static void kvcd_refuses(const char *dir, const char *want) {
        const char *argv[] = { harness_bin("kvcd"), "--runtime-dir", dir, NULL };
        struct proc p;
        int err_fd, st;
        assert_int_equal(harness_spawn_stderr(&p, argv, &err_fd), 0);
        char *err = harness_read_all(err_fd);
        close(err_fd);
        char *out = NULL;
        assert_int_equal(harness_finish(&p, &out, &st), 0);
        free(out);
        assert_non_null(err);
        if (!strstr(err, want))
                fail_msg("kvcd said \"%s\", not \"%s\"", err, want);
        assert_true(WIFEXITED(st) && WEXITSTATUS(st) == 1);
        free(err);
}

static void kvcd_refuses_a_runtime_directory_another_uid_owns(void **state) {
        (void)state;
        struct tmp t;
        tmp_make(&t);
        assert_int_equal(chown(t.dir, NOBODY, NOBODY), 0);
        kvcd_refuses(t.dir, "belongs to uid 65534");
        char lock[200];
        snprintf(lock, sizeof(lock), "%s/kvcd.lock", t.dir);
        assert_int_equal(access(lock, F_OK), -1); /* nothing was created in it */
        tmp_remove(&t);
}

static void kvcd_refuses_a_runtime_directory_others_can_write(void **state) {
        (void)state;
        struct tmp t;
        tmp_make(&t);
        assert_int_equal(chmod(t.dir, 0777), 0);
        kvcd_refuses(t.dir, "mode 0777");
        assert_int_equal(chmod(t.dir, 01770), 0); /* sticky or not, group-writable is refused */
        kvcd_refuses(t.dir, "mode 1770");
        tmp_remove(&t);
}

static void kvcd_refuses_a_symlinked_lock_and_creates_nothing(void **state) {
        (void)state;
        struct tmp t;
        tmp_make(&t);
        char lock[200], victim[200];
        snprintf(lock, sizeof(lock), "%s/kvcd.lock", t.dir);
        snprintf(victim, sizeof(victim), "%s/victim", t.root);
        assert_int_equal(symlink(victim, lock), 0);
        kvcd_refuses(t.dir, "symlink");
        assert_int_equal(access(victim, F_OK), -1);
        assert_int_equal(errno, ENOENT);
        /* a runtime directory that is itself a symlink is refused too */
        char link[200];
        snprintf(link, sizeof(link), "%s/link", t.root);
        assert_int_equal(symlink(t.dir, link), 0);
        kvcd_refuses(link, "symlink");
        tmp_remove(&t);
}

/* kvc_connect with KVC_DAEMON_UID set to pin (NULL: unset). */
static int connect_as(const struct daemon *d, const char *pin, struct kvc_client **ret) {
        if (pin)
                setenv("KVC_DAEMON_UID", pin, 1);
        else
                unsetenv("KVC_DAEMON_UID");
        struct kvc_options o = { .socket = d->dir, .timeout_ms = 5000, .resume_ms = -1 };
        int r = kvc_connect(&o, ret);
        unsetenv("KVC_DAEMON_UID");
        return r;
}

static void libkvc_refuses_a_kvcd_of_a_uid_it_does_not_allow(void **state) {
        struct daemon *d = *state;
        struct kvc_client *c = NULL;
        assert_int_equal(connect_as(d, "65534", &c), -EPERM);
        assert_null(c);
        const char *why = kvc_last_error(NULL);
        if (!strstr(why, "served by uid 0") || !strstr(why, "only uid 65534"))
                fail_msg("kvc_last_error: %s", why);
        /* it said nothing to kvcd: no client ever said Hello */
        char *json = harness_kvcctl(d, "status");
        assert_non_null(json);
        assert_int_equal(harness_json_int(json, "clients"), 0);
        free(json);

        /* the uid kvcd does run as, by number or by name, and the default set, are allowed */
        assert_int_equal(connect_as(d, "0", &c), 0);
        c = kvc_disconnect(c);
        assert_int_equal(connect_as(d, "root", &c), 0);
        c = kvc_disconnect(c);
        assert_int_equal(connect_as(d, NULL, &c), 0);
        c = kvc_disconnect(c);
        /* a user nobody is called */
        assert_int_equal(connect_as(d, "no-such-user-kvcd-test", &c), -EINVAL);
}

static void libkvc_refuses_a_runtime_directory_others_can_write(void **state) {
        struct daemon *d = *state;
        struct kvc_client *c = NULL;
        assert_int_equal(chmod(d->dir, 0777), 0);
        int r = connect_as(d, NULL, &c);
        assert_int_equal(chmod(d->dir, 0750), 0);
        assert_int_equal(r, -EPERM);
        if (!strstr(kvc_last_error(NULL), "mode 0777"))
                fail_msg("kvc_last_error: %s", kvc_last_error(NULL));
        assert_int_equal(connect_as(d, NULL, &c), 0);
        kvc_disconnect(c);
}

static void libkvc_refuses_a_kvcd_sock_of_another_user(void **state) {
        struct daemon *d = *state;
        struct kvc_client *c = NULL;
        char sock[200];
        snprintf(sock, sizeof(sock), "%s/kvcd.sock", d->dir);
        assert_int_equal(lchown(sock, NOBODY, NOBODY), 0);
        int r = connect_as(d, NULL, &c);
        assert_int_equal(lchown(sock, 0, 0), 0);
        assert_int_equal(r, -EPERM);
        if (!strstr(kvc_last_error(NULL), "kvcd.sock is not a socket of kvcd's user"))
                fail_msg("kvc_last_error: %s", kvc_last_error(NULL));
}

static void libkvc_follows_no_symlink_of_another_user_to_kvcd(void **state) {
        struct daemon *d = *state;
        struct kvc_client *c = NULL;
        char link[200];
        snprintf(link, sizeof(link), "%s/squatted", d->root);
        assert_int_equal(symlink(d->dir, link), 0);
        struct kvc_options o = { .socket = link, .timeout_ms = 5000, .resume_ms = -1 };
        assert_int_equal(kvc_connect(&o, &c), 0); /* our own link */
        c = kvc_disconnect(c);
        assert_int_equal(lchown(link, NOBODY, NOBODY), 0);
        assert_int_equal(kvc_connect(&o, &c), -EPERM);
        if (!strstr(kvc_last_error(NULL), "is a symlink of uid 65534"))
                fail_msg("kvc_last_error: %s", kvc_last_error(NULL));
        assert_int_equal(unlink(link), 0);
}

/* kvcctl --json --socket DIR status with KVC_DAEMON_UID=pin (NULL: unset): its exit status, and
 * its output (malloc'd) in *ret_out. */
static int kvcctl_status(const struct daemon *d, const char *pin, char **ret_out) {
        const char *argv[] = { harness_bin("kvcctl"), "--json", "--socket", d->dir, "status", NULL };
        int st = -1;
        if (pin)
                setenv("KVC_DAEMON_UID", pin, 1);
        int r = harness_run(argv, ret_out, &st);
        unsetenv("KVC_DAEMON_UID");
        assert_int_equal(r, 0);
        assert_true(WIFEXITED(st));
        return WEXITSTATUS(st);
}

static void kvcctl_expect_denied(const struct daemon *d, const char *pin, const char *want) {
        char *out = NULL;
        int code = kvcctl_status(d, pin, &out);
        if (code != 4 || !out || !strstr(out, want) || !strstr(out, "EPERM"))
                fail_msg("kvcctl exited %d: %s (expected 4 and \"%s\")", code, out ? out : "", want);
        free(out);
}

/* Issue 28, item 11: kvcctl (and kvcd.admin, which runs it) sent an operator's commands to
 * whatever listened on kvcd.admin.sock, a squatted /tmp/kvcd-UID included. It now makes
 * libkvc's check (kvc_check_daemon_socket) of the admin socket first. */
static void kvcctl_refuses_an_admin_socket_that_is_not_kvcds(void **state) {
        struct daemon *d = *state;
        char *out = NULL, sock[200];
        assert_int_equal(kvcctl_status(d, NULL, &out), 0);
        free(out);
        kvcctl_expect_denied(d, "65534", "served by uid 0");
        assert_int_equal(chmod(d->dir, 0777), 0);
        kvcctl_expect_denied(d, NULL, "mode 0777");
        assert_int_equal(chmod(d->dir, 0750), 0);
        snprintf(sock, sizeof(sock), "%s/kvcd.admin.sock", d->dir);
        assert_int_equal(lchown(sock, NOBODY, NOBODY), 0);
        kvcctl_expect_denied(d, NULL, "is not a socket of kvcd's user");
        assert_int_equal(lchown(sock, 0, 0), 0);
        assert_int_equal(kvcctl_status(d, "0", &out), 0);
        free(out);
        /* the public check itself, as kvcctl calls it */
        char why[256];
        assert_int_equal(kvc_check_daemon_socket(sock, NULL, why, sizeof(why)), 0);
        assert_int_equal(kvc_check_daemon_socket(sock, "65534", why, sizeof(why)), -EPERM);
        snprintf(sock, sizeof(sock), "%s/no-such.sock", d->dir);
        assert_int_equal(kvc_check_daemon_socket(sock, NULL, why, sizeof(why)), -ENOENT);
}

static int group_start(void **state) {
        return harness_group_start(state, NULL);
}

int main(void) {
        if (geteuid() != 0) {
                printf("test_runtime_dir: skipped (needs root to chown to %d)\n", NOBODY);
                return 0;
        }
        const struct CMUnitTest alone[] = {
                cmocka_unit_test(kvcd_refuses_a_runtime_directory_another_uid_owns),
                cmocka_unit_test(kvcd_refuses_a_runtime_directory_others_can_write),
                cmocka_unit_test(kvcd_refuses_a_symlinked_lock_and_creates_nothing),
        };
        const struct CMUnitTest with_kvcd[] = {
                cmocka_unit_test(libkvc_refuses_a_kvcd_of_a_uid_it_does_not_allow),
                cmocka_unit_test(libkvc_refuses_a_runtime_directory_others_can_write),
                cmocka_unit_test(libkvc_refuses_a_kvcd_sock_of_another_user),
                cmocka_unit_test(libkvc_follows_no_symlink_of_another_user_to_kvcd),
                cmocka_unit_test(kvcctl_refuses_an_admin_socket_that_is_not_kvcds),
        };
        int failed = cmocka_run_group_tests(alone, NULL, NULL);
        return failed + cmocka_run_group_tests(with_kvcd, group_start, harness_group_stop);
}
