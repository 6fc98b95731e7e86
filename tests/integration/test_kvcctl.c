/* test_kvcctl.c: the operator CLI as scripts and operators rely on it, driven as a program
 * against the real kvcd over real sockets: its exit codes, one-line refusals of bad command
 * lines (trailing words, flags of other verbs), global flags after the verb, JSON errors, a
 * missing, stale or forbidden socket told at once, drain's exit when it times out, events
 * followed until interrupted (one JSON object per line), top's JSON frames with rates and its
 * 80-column layout, and status's tenants and RSS.
 *
 * The sessions kvcctl watches are opened by a libkvc client in this process (one layer, one
 * small F32 head), so each test knows exactly what kvcd holds. Nothing sleeps: every wait is
 * for kvcctl's output or exit, with the harness's deadline.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pty.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "harness.h"
#include "kvc.h"

#define DIM   64
#define QUOTA (16u << 20)

static int setup(void **state) {
        const char *extra[] = { "--capacity", "64M", "--tenant", "alice:quota=16M", NULL };
        return harness_group_start(state, extra);
}

struct result {
        int exit; /* -1 unless it exited */
        char *out, *err;
};

static void result_free(struct result *r) {
        free(r->out);
        free(r->err);
}

/* Runs kvcctl with args (NULL-terminated), with --socket dir first unless dir is NULL. */
static struct result ctlv(const char *dir, const char *const *args) {
        const char *argv[40];
        int n = 0;
        argv[n++] = harness_bin("kvcctl");
        if (dir) {
                argv[n++] = "--socket";
                argv[n++] = dir;
        }
        for (; *args && n < 38; args++)
                argv[n++] = *args;
        argv[n] = NULL;
        struct proc p;
        int err_fd, st;
        struct result r = { .exit = -1 };
        assert_int_equal(harness_spawn_stderr(&p, argv, &err_fd), 0);
        assert_int_equal(harness_finish(&p, &r.out, &st), 0);
        r.err = harness_read_all(err_fd);
        close(err_fd);
        assert_non_null(r.err);
        if (WIFEXITED(st))
                r.exit = WEXITSTATUS(st);
        return r;
}

#define CTL(dir, ...) ctlv((dir), (const char *const[]){ __VA_ARGS__, NULL })

static size_t count_lines(const char *s) {
        size_t n = 0;
        for (; *s; s++)
                n += *s == '\n';
        return n;
}

static struct kvc_client *client(const struct daemon *d) {
        struct kvc_options o = { .socket = d->dir, .name = "ctltest", .timeout_ms = HARNESS_DEADLINE_MS };
        struct kvc_client *c = NULL;
        assert_int_equal(kvc_connect(&o, &c), 0);
        return c;
}

/* A session of tenant (NULL: the default) holding n tokens after n steps; with prompt ids when
 * ids is non-NULL (n of them: kvcd publishes their 16-token blocks as KV events). */
static struct kvc_session *session(struct kvc_client *c, const char *tenant, int n, const uint32_t *ids) {
        struct kvc_session_config cfg = {
                .geometry = { .n_layers = 1,
                              .n_heads = 1,
                              .n_kv_heads = 1,
                              .head_dim = DIM,
                              .dtype = KVC_DTYPE_F32,
                              .max_tokens = 1024 },
                .policy = "full",
                .tenant = tenant,
                .prompt_tokens = ids ? (uint32_t)n : 0,
                .prompt_token_ids = ids,
                .n_prompt_token_ids = ids ? (size_t)n : 0,
        };
        struct kvc_session *s = NULL;
        assert_int_equal(kvc_session_open(c, &cfg, &s), 0);
        struct kvc_summary sum = { .entropy = 0.5f, .top1_prob = 0.5f, .margin = 1.0f };
        float k[DIM], v[DIM], out[DIM];
        for (int pos = 0; pos < n; pos++) {
                for (int i = 0; i < DIM; i++)
                        k[i] = v[i] = (float)((pos * 7 + i) % 13) / 13.0f;
                assert_int_equal(kvc_append(s, 0, pos, k, v), 0);
                assert_int_equal(kvc_attend(s, 0, k, out), 0);
                assert_int_equal(
                        kvc_step(s, (uint64_t)pos + 1, ids ? KVC_PHASE_PREFILL : KVC_PHASE_DECODE, &sum), 0);
                assert_int_equal(kvc_flush(c), 0);
        }
        return s;
}

/* Steps s n more times, from step *pos + 1. */
static void steps(struct kvc_client *c, struct kvc_session *s, int n) {
        struct kvc_summary sum = { .entropy = 0.2f, .top1_prob = 0.9f, .margin = 3.0f };
        uint64_t last = kvc_session_last_step(s, NULL);
        for (int i = 1; i <= n; i++) {
                assert_int_equal(kvc_step(s, last + (uint64_t)i, KVC_PHASE_DECODE, &sum), 0);
                assert_int_equal(kvc_flush(c), 0);
        }
}

static void usage_errors_are_one_line_and_exit_2(void **state) {
        const struct daemon *d = *state;
        static const char *const bad[][6] = {
                { "status", "extra" },
                { "sessions", "--frob" },
                { "status", "--interval", "1" }, /* another verb's flag */
                { "evict" },
                { "evict", "1", "2" },
                { "evict", "x" },
                { "budget" },
                { "budget", "set" },
                { "budget", "frob" },
                { "budget", "get", "more" },
                { "budget", "set", "--min", "1M" }, /* --min without --session */
                { "budget", "set", "--tenant", "alice" },
                { "frob" },
                { "top", "-n", "0" },
                { "top", "--sort", "color" },
                { "drain", "--timeout", "x" },
                { "drain", "--resume", "--timeout", "1" },
                { "events", "--count", "0" },
                { "--timeout", "0", "status" },
                { "status", "--json=1" },
                { "status", "--socket" }, /* a value missing */
                { "metrics", "--count", "3" },
                { "top", "--interval", "3601" }, /* the limits: an hour between frames */
                { "top", "--interval", "0" },
                { "drain", "--timeout", "86401" },       /* a day of drain */
                { "--timeout", "1073741824", "status" }, /* INT_MAX / 2 ms */
                { "status", "-jx" },                     /* flags without values are not bundled */
        };
        for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
                struct result r = ctlv(d->dir, bad[i]);
                if (r.exit != 2 || count_lines(r.err) != 1 || strncmp(r.err, "kvcctl: ", 8) != 0 || r.out[0])
                        fail_msg("kvcctl %s %s %s: exit %d, stderr '%s', stdout '%s'", bad[i][0],
                                 bad[i][1] ? bad[i][1] : "", bad[i][1] && bad[i][2] ? bad[i][2] : "", r.exit,
                                 r.err, r.out);
                assert_null(strstr(r.err, "Usage"));
                result_free(&r);
        }
        /* and the help itself is not an error */
        struct result r = CTL(NULL, "status", "--help");
        assert_int_equal(r.exit, 0);
        assert_non_null(strstr(r.out, "Usage"));
        result_free(&r);
}

/* Issue 28, item 15: `budget set --quota 1G --tenant --capacity` set the quota of a tenant named
 * "--capacity", `--tenant=` one named "", and `--socket D --timeout` said "no verb given". */
static void a_missing_value_or_a_bad_tenant_name_is_said_as_such(void **state) {
        const struct daemon *d = *state;
        static const struct {
                const char *args[7];
                const char *want;
        } cases[] = {
                { { "--timeout" }, "--timeout needs a value (MS)" },
                { { "status", "--timeout" }, "--timeout needs a value (MS)" },
                { { "budget", "set", "--quota", "1G", "--tenant", "--capacity" }, "--tenant needs a value (NAME)" },
                { { "budget", "set", "--tenant", "--capacity", "1G" }, "--tenant needs a value (NAME)" },
                { { "budget", "set", "--quota", "1G", "--tenant=" }, "takes a tenant's name, not ''" },
                { { "budget", "set", "--quota", "1G", "--tenant", "-x" }, "takes a tenant's name, not '-x'" },
        };
        for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
                struct result r = ctlv(d->dir, cases[i].args);
                if (r.exit != 2 || !strstr(r.err, cases[i].want))
                        fail_msg("case %zu: exit %d, stderr '%s' (expected 2 and '%s')", i, r.exit, r.err,
                                 cases[i].want);
                result_free(&r);
        }
        struct result r = CTL(d->dir, "--json", "budget", "get");
        assert_int_equal(r.exit, 0);
        assert_non_null(strstr(r.out, "\"name\":\"alice\""));
        assert_null(strstr(r.out, "\"name\":\"--capacity\""));
        assert_null(strstr(r.out, "\"name\":\"\""));
        result_free(&r);
}

static void global_flags_work_after_the_verb(void **state) {
        const struct daemon *d = *state;
        struct result r = CTL(NULL, "status", "--json", "--socket", d->dir, "--timeout", "5000");
        assert_int_equal(r.exit, 0);
        assert_true(r.out[0] == '{' && strstr(r.out, "\"version\":"));
        assert_int_equal(count_lines(r.out), 1);
        result_free(&r);
        r = CTL(NULL, "sessions", "--socket=", "--json");
        assert_int_equal(r.exit, 2); /* an empty --socket= is not a path */
        result_free(&r);
        r = CTL(d->dir, "sessions", "--json");
        assert_int_equal(r.exit, 0);
        assert_int_equal(r.out[0], '[');
        result_free(&r);
        r = CTL(d->dir, "budget", "--json", "get");
        assert_int_equal(r.exit, 0);
        assert_non_null(strstr(r.out, "\"capacity_bytes\":67108864"));
        result_free(&r);
}

static void json_errors_are_objects_on_stdout_with_the_same_exit_codes(void **state) {
        const struct daemon *d = *state;
        struct result r = CTL(d->dir, "--json", "status", "extra");
        assert_int_equal(r.exit, 2);
        assert_non_null(strstr(r.out, "{\"error\":{\"code\":22,\"name\":\"EINVAL\",\"message\":\""));
        assert_int_equal(count_lines(r.out), 1);
        assert_string_equal(r.err, "");
        result_free(&r);
        r = CTL(d->dir, "evict", "999999", "--json"); /* kvcd refuses: no such session */
        assert_int_equal(r.exit, 1);
        assert_non_null(strstr(r.out, "\"name\":\"ENOENT\""));
        assert_non_null(strstr(r.out, "no session 999999"));
        result_free(&r);
        r = CTL("/nonexistent-kvcd-dir", "--json", "status");
        assert_int_equal(r.exit, 3);
        static const char want[] =
                "{\"error\":{\"code\":2,\"name\":\"ENOENT\",\"message\":\"nothing is listening";
        assert_memory_equal(r.out, want, sizeof(want) - 1);
        result_free(&r);
        r = CTL(d->dir, "evict", "999999"); /* the same without --json: a line on stderr */
        assert_int_equal(r.exit, 1);
        assert_string_equal(r.out, "");
        assert_non_null(strstr(r.err, "ENOENT"));
        result_free(&r);
}

static uint64_t mono_ms(void) {
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

/* A Unix stream socket at path: listening when listen_too, else bound and left (a stale one). */
static int unix_socket_at(const char *path, bool listen_too) {
        struct sockaddr_un sa = { .sun_family = AF_UNIX };
        snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", path);
        int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
        assert_true(fd >= 0);
        assert_int_equal(bind(fd, (struct sockaddr *)&sa, sizeof(sa)), 0);
        if (listen_too)
                assert_int_equal(listen(fd, 4), 0);
        return fd;
}

static void a_missing_or_stale_socket_is_told_at_once_with_exit_3(void **state) {
        (void)state;
        char dir[] = "/tmp/kvcctl-test-XXXXXX", path[128];
        assert_non_null(mkdtemp(dir));
        /* nothing there: at once, not after the 20 s --timeout */
        uint64_t t0 = mono_ms();
        struct result r = CTL(dir, "--timeout", "20000", "status");
        assert_int_equal(r.exit, 3);
        assert_true(mono_ms() - t0 < 10000);
        assert_non_null(strstr(r.err, "nothing is listening at"));
        assert_non_null(strstr(r.err, "no such socket"));
        result_free(&r);
        /* a socket file no process listens on (a kvcd that crashed) */
        snprintf(path, sizeof(path), "%s/kvcd.admin.sock", dir);
        close(unix_socket_at(path, false));
        t0 = mono_ms();
        r = CTL(dir, "--timeout", "20000", "status");
        assert_int_equal(r.exit, 3);
        assert_true(mono_ms() - t0 < 10000);
        assert_non_null(strstr(r.err, "left from a kvcd that is gone"));
        result_free(&r);
        /* the same for events' socket */
        r = CTL(dir, "--timeout", "20000", "events");
        assert_int_equal(r.exit, 3);
        assert_non_null(strstr(r.err, "kvcd.events.sock"));
        result_free(&r);
        /* a listener that never answers still gets the whole --timeout: "no answer" */
        unlink(path);
        int fd = unix_socket_at(path, true);
        r = CTL(dir, "--timeout", "300", "--json", "status");
        assert_int_equal(r.exit, 3);
        assert_non_null(strstr(r.out, "\"name\":\"ETIMEDOUT\""));
        assert_non_null(strstr(r.out, "within 300 ms"));
        result_free(&r);
        close(fd);
        unlink(path);
        rmdir(dir);
}

/* Runs kvcctl with args as another user when this test is root (nobody), with
 * XDG_RUNTIME_DIR=xdg and no KVC_SOCKET when xdg is non-NULL; its exit status, *ret_err its
 * stderr (malloc'd). */
static int run_as_other(const char *const *args, const char *xdg, char **ret_err) {
        const char *argv[16] = { "kvcctl" };
        int n = 1;
        for (; *args && n < 15; args++)
                argv[n++] = *args;
        argv[n] = NULL;
        int out[2], err[2];
        assert_int_equal(pipe2(out, O_CLOEXEC), 0);
        assert_int_equal(pipe2(err, O_CLOEXEC), 0);
        pid_t pid = fork();
        assert_true(pid >= 0);
        if (pid == 0) {
                dup2(out[1], 1);
                dup2(err[1], 2);
                if (geteuid() == 0 && (setgid(65534) < 0 || setuid(65534) < 0))
                        _exit(99);
                if (xdg) {
                        unsetenv("KVC_SOCKET");
                        setenv("XDG_RUNTIME_DIR", xdg, 1);
                }
                execv(harness_bin("kvcctl"), (char *const *)argv);
                _exit(98);
        }
        close(out[1]);
        close(err[1]);
        free(harness_read_all(out[0]));
        *ret_err = harness_read_all(err[0]);
        int st;
        assert_int_equal(harness_wait(pid, &st, HARNESS_DEADLINE_MS), 0);
        close(out[0]);
        close(err[0]);
        assert_true(WIFEXITED(st));
        return WEXITSTATUS(st);
}

/* A socket this user may not connect to (0600, another owner; or mode 0 when the test is not
 * root), or a runtime directory it may not enter: exit 4 and EACCES at once, not "no answer". */
static void a_forbidden_socket_is_eacces_with_exit_4(void **state) {
        (void)state;
        char dir[] = "/tmp/kvcctl-test-XXXXXX", path[128], inner[128], inner_path[160];
        assert_non_null(mkdtemp(dir));
        assert_int_equal(chmod(dir, 0755), 0);
        snprintf(path, sizeof(path), "%s/kvcd.admin.sock", dir);
        int fd = unix_socket_at(path, true);
        assert_int_equal(chmod(path, geteuid() == 0 ? 0600 : 0), 0);
        char *e;
        uint64_t t0 = mono_ms();
        int code = run_as_other(
                (const char *const[]){ "--socket", dir, "--timeout", "20000", "status", NULL }, NULL, &e);
        if (code != 4 || !strstr(e, "permission denied on") || !strstr(e, path))
                fail_msg("exit %d, stderr '%s'", code, e);
        assert_true(mono_ms() - t0 < 10000);
        free(e);
        /* found without --socket, in a per-user directory it may not enter */
        snprintf(inner, sizeof(inner), "%s/kvcd", dir);
        snprintf(inner_path, sizeof(inner_path), "%s/kvcd.admin.sock", inner);
        assert_int_equal(mkdir(inner, geteuid() == 0 ? 0700 : 0), 0);
        if (geteuid() != 0) /* its own directory: make the socket, then lock the door */
                assert_int_equal(chmod(inner, 0700), 0);
        int fd2 = unix_socket_at(inner_path, true);
        if (geteuid() != 0)
                assert_int_equal(chmod(inner, 0), 0);
        code = run_as_other((const char *const[]){ "--json", "status", NULL }, dir, &e);
        free(e);
        assert_int_equal(code, 4);
        close(fd2);
        chmod(inner, 0700);
        unlink(inner_path);
        rmdir(inner);
        close(fd);
        unlink(path);
        rmdir(dir);
}

/* Without --socket: $XDG_RUNTIME_DIR/kvcd is looked in first. */
static void without_socket_the_per_user_directory_is_found(void **state) {
        const struct daemon *d = *state;
        char xdg[] = "/tmp/kvcctl-xdg-XXXXXX", link[128], cwd_dir[256];
        assert_non_null(mkdtemp(xdg));
        snprintf(link, sizeof(link), "%s/kvcd", xdg);
        if (d->dir[0] != '/') {
                assert_non_null(getcwd(cwd_dir, sizeof(cwd_dir) - strlen(d->dir) - 2));
                strcat(cwd_dir, "/");
                strcat(cwd_dir, d->dir);
        } else {
                snprintf(cwd_dir, sizeof(cwd_dir), "%s", d->dir);
        }
        assert_int_equal(symlink(cwd_dir, link), 0);
        char *old = getenv("KVC_SOCKET") ? strdup(getenv("KVC_SOCKET")) : NULL;
        char *old_xdg = getenv("XDG_RUNTIME_DIR") ? strdup(getenv("XDG_RUNTIME_DIR")) : NULL;
        unsetenv("KVC_SOCKET");
        setenv("XDG_RUNTIME_DIR", xdg, 1);
        struct result r = CTL(NULL, "status", "--json");
        assert_int_equal(r.exit, 0);
        assert_non_null(strstr(r.out, "\"version\":"));
        result_free(&r);
        unlink(link);
        r = CTL(NULL, "status"); /* gone: both places named */
        assert_int_equal(r.exit, 3);
        assert_non_null(strstr(r.err, link));
        assert_non_null(strstr(r.err, "/run/kvcd"));
        result_free(&r);
        if (old)
                setenv("KVC_SOCKET", old, 1);
        if (old_xdg)
                setenv("XDG_RUNTIME_DIR", old_xdg, 1);
        else
                unsetenv("XDG_RUNTIME_DIR");
        free(old);
        free(old_xdg);
        rmdir(xdg);
}

static void drain_that_times_out_exits_5(void **state) {
        const struct daemon *d = *state;
        struct kvc_client *c = client(d);
        struct kvc_session *s = session(c, NULL, 4, NULL);
        struct result r = CTL(d->dir, "drain", "--timeout", "0.2", "--json");
        assert_int_equal(r.exit, 5);
        assert_non_null(strstr(r.out, "\"sessions_left\":1,\"timed_out\":true"));
        result_free(&r);
        r = CTL(d->dir, "drain"); /* no wait: still not drained */
        assert_int_equal(r.exit, 5);
        assert_non_null(strstr(r.out, "1 sessions left"));
        result_free(&r);
        r = CTL(d->dir, "drain", "--resume");
        assert_int_equal(r.exit, 0);
        result_free(&r);
        assert_int_equal(kvc_session_close(s, NULL), 0);
        r = CTL(d->dir, "drain", "--timeout", "5"); /* nothing open: drained at once */
        assert_int_equal(r.exit, 0);
        assert_non_null(strstr(r.out, "0 sessions left"));
        result_free(&r);
        r = CTL(d->dir, "drain", "--resume");
        assert_int_equal(r.exit, 0);
        result_free(&r);
        kvc_disconnect(c);
}

static void status_shows_tenants_against_their_quota_and_rss(void **state) {
        const struct daemon *d = *state;
        struct kvc_client *c = client(d);
        struct kvc_session *s = session(c, "alice", 20, NULL);
        struct result r = CTL(d->dir, "status", "--json");
        assert_int_equal(r.exit, 0);
        const char *t = strstr(r.out, "{\"name\":\"alice\",");
        assert_non_null(t);
        assert_true(harness_json_int(t, "used_bytes") > 0);
        assert_int_equal(harness_json_int(t, "quota_bytes"), QUOTA);
        assert_int_equal(harness_json_int(t, "sessions"), 1);
        assert_true(harness_json_int(r.out, "rss_bytes") > 0);
        assert_true(harness_json_int(r.out, "rss_anon_bytes") > 0);
        assert_true(harness_json_int(r.out, "rss_anon_bytes") <= harness_json_int(r.out, "rss_bytes"));
        assert_true(harness_json_int(r.out, "step_batches_total") >= 20);
        result_free(&r);
        r = CTL(d->dir, "status");
        assert_int_equal(r.exit, 0);
        assert_non_null(strstr(r.out, "kvcd resident"));
        const char *row = strstr(r.out, "\nalice ");
        assert_non_null(row);
        assert_non_null(strstr(row, "16.0 MiB"));
        result_free(&r);
        assert_int_equal(kvc_session_close(s, NULL), 0);
        kvc_disconnect(c);
}

/* The n-th line of s (from 0), malloc'd, or NULL. */
static char *line_at(const char *s, int n) {
        for (; n > 0 && s; n--)
                if ((s = strchr(s, '\n')))
                        s++;
        if (!s || !*s)
                return NULL;
        const char *e = strchr(s, '\n');
        return strndup(s, e ? (size_t)(e - s) : strlen(s));
}

static double json_num(const char *json, const char *key) {
        char pat[64];
        snprintf(pat, sizeof(pat), "\"%s\":", key);
        const char *p = strstr(json, pat);
        return p ? strtod(p + strlen(pat), NULL) : -1;
}

static void top_json_gives_one_document_per_frame_with_rates(void **state) {
        const struct daemon *d = *state;
        struct kvc_client *c = client(d);
        struct kvc_session *old = session(c, NULL, 4, NULL), *big = session(c, "alice", 40, NULL);
        char ids[2][32];
        snprintf(ids[0], sizeof(ids[0]), "{\"id\":%llu,", (unsigned long long)kvc_session_id(old));
        snprintf(ids[1], sizeof(ids[1]), "{\"id\":%llu,", (unsigned long long)kvc_session_id(big));

        /* two frames 1 s apart, steps in between: frame 2's rates are over the interval */
        const char *argv[] = { harness_bin("kvcctl"), "--socket", d->dir, "top", "--json", "-n", "2",
                               "--interval",          "1",        NULL };
        struct proc p;
        assert_int_equal(harness_spawn(&p, argv, true), 0);
        char first[65536];
        size_t got = 0;
        while (!memchr(first, '\n', got)) {
                ssize_t n = harness_read_some(&p, first + got, 1);
                assert_true(n > 0);
                got += (size_t)n;
                assert_true(got < sizeof(first));
        }
        steps(c, big, 10);
        char *rest;
        int st;
        assert_int_equal(harness_finish(&p, &rest, &st), 0);
        assert_true(WIFEXITED(st) && WEXITSTATUS(st) == 0);
        char *out = malloc(got + strlen(rest) + 1);
        memcpy(out, first, got);
        strcpy(out + got, rest);
        free(rest);
        assert_int_equal(count_lines(out), 2);
        char *f1 = line_at(out, 0), *f2 = line_at(out, 1);
        assert_int_equal(f1[0], '{');
        assert_int_equal(f1[strlen(f1) - 1], '}');
        assert_int_equal(harness_json_int(f1, "frame"), 1);
        assert_int_equal(harness_json_int(f2, "frame"), 2);
        /* frame 1: rates since kvcd started (it has stepped); frame 2: over the interval */
        assert_true(json_num(f1, "summaries_per_s") > 0);
        assert_true(json_num(f1, "steps_per_s") > 0);
        double dt = json_num(f2, "interval_s");
        assert_true(dt >= 1.0);
        long long s1 = harness_json_int(strstr(f1, "\"status\":"), "steps_total");
        long long s2 = harness_json_int(strstr(f2, "\"status\":"), "steps_total");
        assert_true(s2 > s1);
        double rate = json_num(f2, "summaries_per_s");
        assert_true(rate > 0);
        assert_true(rate * dt > (double)(s2 - s1) - 0.5 && rate * dt < (double)(s2 - s1) + 0.5);
        /* per session: the one that stepped has a rate, the other none */
        const char *b = strstr(f2, ids[1]), *o = strstr(f2, ids[0]);
        assert_non_null(b);
        assert_non_null(o);
        assert_true(json_num(b, "steps_per_s") > 0);
        assert_true(json_num(o, "steps_per_s") == 0);
        assert_non_null(strstr(f2, "\"clients\":[{\"pid\":"));
        assert_non_null(strstr(f2, "\"name\":\"ctltest\""));
        assert_non_null(strstr(f2, "\"tenants\":[{\"name\":\"alice\""));
        /* sorted by bytes (the default): big first */
        assert_true(b < o);
        free(f1), free(f2), free(out);

        /* --sort age: the older first; --idle: every session idle */
        struct result r = CTL(d->dir, "top", "--json", "-n1", "--sort=age", "--idle", "0.000001");
        assert_int_equal(r.exit, 0);
        assert_int_equal(count_lines(r.out), 1);
        assert_true(strstr(r.out, ids[0]) < strstr(r.out, ids[1]));
        assert_non_null(strstr(r.out, "\"sort\":\"age\""));
        assert_null(strstr(r.out, "\"idle\":false"));
        result_free(&r);

        /* the table: every line within 80 columns, the client's name, both sessions, marks */
        r = CTL(d->dir, "top", "--iterations", "1", "--idle", "0.000001");
        assert_int_equal(r.exit, 0);
        for (int i = 0;; i++) {
                char *l = line_at(r.out, i);
                if (!l)
                        break;
                if (strlen(l) > 80)
                        fail_msg("line %d is %zu columns: '%s'", i, strlen(l), l);
                free(l);
        }
        assert_non_null(strstr(r.out, "ctltest"));
        assert_non_null(strstr(r.out, "STEP/S"));
        assert_non_null(strstr(r.out, "summaries"));
        assert_non_null(strstr(r.out, "\nalice "));
        assert_non_null(strstr(r.out, " I\n"));
        result_free(&r);
        assert_int_equal(kvc_session_close(old, NULL), 0);
        assert_int_equal(kvc_session_close(big, NULL), 0);
        kvc_disconnect(c);
}

/* Reads the terminal until want has appeared since *len (appending at *len); false at the
 * deadline or when the terminal closed first. */
static bool pty_wait_for(int fd, char *buf, size_t cap, size_t *len, const char *want) {
        size_t from = *len;
        uint64_t deadline = mono_ms() + HARNESS_DEADLINE_MS;
        while (!strstr(buf + from, want)) {
                struct pollfd pf = { .fd = fd, .events = POLLIN };
                uint64_t now = mono_ms();
                if (now >= deadline || poll(&pf, 1, (int)(deadline - now)) <= 0)
                        return false;
                ssize_t n = read(fd, buf + *len, cap - 1 - *len);
                if (n <= 0)
                        return false;
                *len += (size_t)n;
                buf[*len] = '\0';
        }
        return true;
}

/* On a terminal: a key changes the sort at once (no wait for the interval), q quits with 0. */
static void top_on_a_terminal_sorts_by_key_and_quits_on_q(void **state) {
        const struct daemon *d = *state;
        struct winsize ws = { .ws_row = 40, .ws_col = 80 };
        int master;
        pid_t pid = forkpty(&master, NULL, NULL, &ws);
        assert_true(pid >= 0);
        if (pid == 0) {
                execl(harness_bin("kvcctl"), "kvcctl", "--socket", d->dir, "top", "--interval", "600",
                      (char *)NULL);
                _exit(98);
        }
        static char buf[1 << 18];
        size_t len = 0;
        buf[0] = '\0';
        assert_true(pty_wait_for(master, buf, sizeof(buf), &len, "rates since kvcd started"));
        assert_non_null(strstr(buf, "\033[H\033[2J")); /* redrawn in place */
        assert_non_null(strstr(buf, "sort bytes"));
        assert_int_equal(write(master, "a", 1), 1);
        assert_true(pty_wait_for(master, buf, sizeof(buf), &len, "sort age"));
        assert_int_equal(write(master, "s", 1), 1); /* cycles: after age comes bytes */
        assert_true(pty_wait_for(master, buf, sizeof(buf), &len, "sort bytes"));
        assert_int_equal(write(master, "q", 1), 1);
        int st;
        assert_int_equal(harness_wait(pid, &st, HARNESS_DEADLINE_MS), 0);
        assert_true(WIFEXITED(st));
        assert_int_equal(WEXITSTATUS(st), 0);
        close(master);
}

/* Reads what kvcctl printed within ms into buf (appending at *len); false at EOF. */
static bool read_for(struct proc *p, char *buf, size_t cap, size_t *len, int ms) {
        struct pollfd pf = { .fd = p->out_fd, .events = POLLIN };
        if (poll(&pf, 1, ms) <= 0)
                return true;
        ssize_t n = read(p->out_fd, buf + *len, cap - 1 - *len);
        if (n <= 0)
                return false;
        *len += (size_t)n;
        buf[*len] = '\0';
        return true;
}

static void events_follow_until_interrupted_one_json_object_per_line(void **state) {
        const struct daemon *d = *state;
        struct kvc_client *c = client(d);
        const char *argv[] = { harness_bin("kvcctl"), "--socket", d->dir, "--json", "events", NULL };
        struct proc p;
        assert_int_equal(harness_spawn(&p, argv, true), 0);
        uint32_t ids[32];
        char buf[65536];
        size_t len = 0;
        buf[0] = '\0';
        /* a subscription takes a moment to reach the publisher: sessions come and go (each a
         * stored and a removed event) until kvcctl has printed some */
        uint64_t deadline = mono_ms() + HARNESS_DEADLINE_MS;
        for (uint32_t round = 0; count_lines(buf) < 4; round++) {
                assert_true(mono_ms() < deadline);
                for (int i = 0; i < 32; i++)
                        ids[i] = round * 100 + (uint32_t)i + 1;
                struct kvc_session *s = session(c, NULL, 32, ids);
                assert_int_equal(kvc_session_close(s, NULL), 0);
                assert_true(read_for(&p, buf, sizeof(buf), &len, 100));
        }
        /* still following: no exit after the events, only on SIGINT */
        int st;
        assert_int_equal(waitpid(p.pid, &st, WNOHANG), 0);
        assert_int_equal(kill(p.pid, SIGINT), 0);
        char *rest;
        assert_int_equal(harness_finish(&p, &rest, &st), 0);
        assert_true(WIFEXITED(st));
        assert_int_equal(WEXITSTATUS(st), 0);
        assert_true(len + strlen(rest) < sizeof(buf));
        strcat(buf, rest);
        free(rest);
        bool stored = false, removed = false;
        for (int i = 0;; i++) {
                char *l = line_at(buf, i);
                if (!l)
                        break;
                if (strncmp(l, "{\"seq\":", 7) != 0 || l[strlen(l) - 1] != '}')
                        fail_msg("not one JSON object: '%s'", l);
                stored |= strstr(l, "\"event\":\"stored\"") != NULL;
                removed |= strstr(l, "\"event\":\"removed\"") != NULL;
                free(l);
        }
        assert_true(stored && removed);

        /* --timeout bounds a follow when asked: exit 0; --count not reached in it: exit 5 */
        struct result r = CTL(d->dir, "events", "--timeout", "200", "--json");
        assert_int_equal(r.exit, 0);
        result_free(&r);
        r = CTL(d->dir, "events", "--count", "1000", "--timeout", "200");
        assert_int_equal(r.exit, 5);
        result_free(&r);
        kvc_disconnect(c);
}

int main(void) {
        const struct CMUnitTest tests[] = {
                cmocka_unit_test(usage_errors_are_one_line_and_exit_2),
                cmocka_unit_test(a_missing_value_or_a_bad_tenant_name_is_said_as_such),
                cmocka_unit_test(global_flags_work_after_the_verb),
                cmocka_unit_test(json_errors_are_objects_on_stdout_with_the_same_exit_codes),
                cmocka_unit_test(a_missing_or_stale_socket_is_told_at_once_with_exit_3),
                cmocka_unit_test(a_forbidden_socket_is_eacces_with_exit_4),
                cmocka_unit_test(without_socket_the_per_user_directory_is_found),
                cmocka_unit_test(drain_that_times_out_exits_5),
                cmocka_unit_test(status_shows_tenants_against_their_quota_and_rss),
                cmocka_unit_test(top_json_gives_one_document_per_frame_with_rates),
                cmocka_unit_test(top_on_a_terminal_sorts_by_key_and_quits_on_q),
                cmocka_unit_test(events_follow_until_interrupted_one_json_object_per_line),
        };
        return cmocka_run_group_tests(tests, setup, harness_group_stop);
}
