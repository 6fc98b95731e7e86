/* harness.h: what the integration tests need to run the real programs: a kvcd in a private
 * runtime directory that is waited for through a fake NOTIFY_SOCKET (READY=1, never a sleep),
 * child processes with captured output, waits with deadlines (pidfd + poll), and tiny readers for
 * the JSON the programs print. Binaries come from $KVC_BUILD/bin (default build/bin). */
#pragma once

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#define HARNESS_DEADLINE_MS 20000

/* How long harness_finish (and so harness_run, harness_output), harness_read_some and
 * harness_read_all wait for a client's output: HARNESS_DEADLINE_MS unless a test sets more (a
 * real-size model; clients under the sanitizers on a loaded machine). */
extern int harness_client_deadline_ms;

struct daemon {
        pid_t pid;
        int notify_fd;
        char dir[128]; /* the runtime directory */
        char root[96]; /* the temporary directory that holds it and the notify socket */
        char log[128]; /* kvcd's stderr */
};

struct proc {
        pid_t pid;
        int out_fd; /* the child's stdout, or -1 */
};

/* The path of a binary of the build: "$KVC_BUILD/bin/name". */
const char *harness_bin(const char *name);

/* Starts kvcd with the extra arguments (NULL-terminated, may be NULL) and waits for READY=1.
 * -ETIMEDOUT, or -ECHILD when kvcd exited first (*exit_status then holds its status if non-NULL). */
int harness_daemon_start(struct daemon *d, const char *const *extra, int *exit_status);
/* SIGTERM, wait for the exit, remove the directory. Returns kvcd's exit status (or -errno). */
int harness_daemon_stop(struct daemon *d);
/* cmocka group fixtures: a kvcd started with extra (NULL-terminated, may be NULL), as *state; and
 * its stop, which fails the group unless kvcd exits 0 (a clean stop on SIGTERM). */
int harness_group_start(void **state, const char *const *extra);
int harness_group_stop(void **state);
/* SIGKILL and reap kvcd (its status in *ret_status); the directory and the notify socket stay,
 * for harness_daemon_restart(). */
int harness_daemon_kill(struct daemon *d, int *ret_status);
/* Starts kvcd again on the same runtime directory and notify socket (appending to the log) and
 * waits for READY=1, as harness_daemon_start(). -EBUSY while one still runs. */
int harness_daemon_restart(struct daemon *d, const char *const *extra, int *exit_status);
/* Reads and drops the notifications kvcd sent since READY=1 (STATUS, WATCHDOG, and FDSTORE with
 * fds, which are closed), so a long test never fills the socket; returns how many. */
int harness_daemon_drain_notify(struct daemon *d);

/* Starts argv[0] with argv; its stdout is captured unless capture is false (then /dev/null). */
int harness_spawn(struct proc *p, const char *const *argv, bool capture);
/* Reads the child's stdout to the end and waits for it; *ret_out is malloc'd and NUL-terminated. */
int harness_finish(struct proc *p, char **ret_out, int *ret_status);
/* harness_spawn() with stdout captured, and stderr too: *ret_err_fd reads it. */
int harness_spawn_stderr(struct proc *p, const char *const *argv, int *ret_err_fd);
/* Everything fd gives until EOF (deadline), malloc'd and NUL-terminated; NULL on no memory. */
char *harness_read_all(int fd);
/* The open fds of process pid: returns how many do not link to a path starting with prefix (all
 * when prefix is NULL), and *ret_matching how many do; -errno when /proc cannot tell. */
int harness_fd_count(pid_t pid, const char *prefix, int *ret_matching);
/* Reads at least n bytes of the child's stdout (or until EOF): returns how many were read. */
ssize_t harness_read_some(struct proc *p, char *buf, size_t n);
/* Waits for pid to exit (deadline). */
int harness_wait(pid_t pid, int *ret_status, int timeout_ms);

/* Runs argv to completion and returns its stdout (malloc'd). */
int harness_run(const char *const *argv, char **ret_out, int *ret_status);
/* The stdout of argv run to completion (malloc'd), or NULL unless it exited 0. */
char *harness_output(const char *const *argv);

/* kvcctl --socket DIR --json VERB: the JSON it printed (malloc'd) or NULL. */
char *harness_kvcctl(const struct daemon *d, const char *verb);

/* The number after "key": in a JSON text, or -1 when absent. */
long long harness_json_int(const char *json, const char *key);

/* The whole of a file (malloc'd, NUL-terminated) or NULL. */
char *harness_slurp(const char *path, size_t *ret_len);
