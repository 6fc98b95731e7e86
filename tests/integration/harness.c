/* harness.c: processes, deadlines and the fake systemd notify socket for integration tests. */
#define _GNU_SOURCE
#include "harness.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

const char *harness_bin(const char *name) {
        static char paths[8][300];
        static int next;
        const char *b = getenv("KVC_BUILD");
        char *p = paths[next++ % 8];
        snprintf(p, 300, "%s/bin/%s", b && *b ? b : "build", name);
        return p;
}

static int64_t now_ms(void) {
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static int pidfd_of(pid_t pid) {
        return (int)syscall(SYS_pidfd_open, pid, 0);
}

int harness_wait(pid_t pid, int *ret_status, int timeout_ms) {
        int fd = pidfd_of(pid);
        if (fd >= 0) {
                struct pollfd p = { .fd = fd, .events = POLLIN };
                int r = poll(&p, 1, timeout_ms);
                close(fd);
                if (r == 0)
                        return -ETIMEDOUT;
        }
        int st;
        if (waitpid(pid, &st, 0) < 0)
                return -errno;
        if (ret_status)
                *ret_status = st;
        return 0;
}

static pid_t spawn(const char *const *argv, int out_fd, int err_fd, const char *notify) {
        pid_t pid = fork();
        if (pid != 0)
                return pid;
        if (out_fd >= 0)
                dup2(out_fd, STDOUT_FILENO);
        if (err_fd >= 0)
                dup2(err_fd, STDERR_FILENO);
        if (notify)
                setenv("NOTIFY_SOCKET", notify, 1);
        else
                unsetenv("NOTIFY_SOCKET");
        execv(argv[0], (char *const *)argv);
        _exit(127);
}

/* Starts kvcd on d's directory and notify socket (the log truncated or appended to) and waits
 * for READY=1. */
static int daemon_exec(struct daemon *d, const char *const *extra, int *exit_status, int log_flags) {
        struct sockaddr_un sa = { .sun_family = AF_UNIX };
        snprintf(sa.sun_path, sizeof(sa.sun_path), "%s/notify", d->root);
        const char *argv[32] = { harness_bin("kvcd"), "--runtime-dir", d->dir, "--log-level", "debug" };
        int n = 5;
        for (int i = 0; extra && extra[i] && n < 31; i++)
                argv[n++] = extra[i];
        argv[n] = NULL;
        int log_fd = open(d->log, O_WRONLY | O_CREAT | O_CLOEXEC | log_flags, 0600);
        d->pid = spawn(argv, -1, log_fd, sa.sun_path);
        close(log_fd);
        if (d->pid < 0)
                return -errno;

        int pfd = pidfd_of(d->pid);
        int64_t deadline = now_ms() + HARNESS_DEADLINE_MS;
        for (;;) {
                struct pollfd p[2] = { { .fd = d->notify_fd, .events = POLLIN },
                                       { .fd = pfd, .events = POLLIN } };
                int64_t left = deadline - now_ms();
                if (left <= 0 || poll(p, 2, (int)left) == 0) {
                        close(pfd);
                        return -ETIMEDOUT;
                }
                if (p[0].revents & POLLIN) {
                        char msg[512];
                        ssize_t m = recv(d->notify_fd, msg, sizeof(msg) - 1, 0);
                        if (m > 0) {
                                msg[m] = '\0';
                                if (strstr(msg, "READY=1")) {
                                        close(pfd);
                                        return 0;
                                }
                        }
                }
                if (p[1].revents & POLLIN) {
                        int st;
                        waitpid(d->pid, &st, 0);
                        if (exit_status)
                                *exit_status = st;
                        d->pid = 0;
                        close(pfd);
                        return -ECHILD;
                }
        }
}

int harness_daemon_start(struct daemon *d, const char *const *extra, int *exit_status) {
        const char *tmp = getenv("TMPDIR");
        memset(d, 0, sizeof(*d));
        d->notify_fd = -1;
        snprintf(d->root, sizeof(d->root), "%s/kvcd-test-XXXXXX", tmp && *tmp ? tmp : "/tmp");
        if (!mkdtemp(d->root))
                return -errno;
        snprintf(d->dir, sizeof(d->dir), "%s/run", d->root);
        snprintf(d->log, sizeof(d->log), "%s/kvcd.log", d->root);

        struct sockaddr_un sa = { .sun_family = AF_UNIX };
        snprintf(sa.sun_path, sizeof(sa.sun_path), "%s/notify", d->root);
        d->notify_fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
        if (d->notify_fd < 0 || bind(d->notify_fd, (struct sockaddr *)&sa, sizeof(sa)) < 0)
                return -errno;
        return daemon_exec(d, extra, exit_status, O_TRUNC);
}

int harness_daemon_kill(struct daemon *d, int *ret_status) {
        if (d->pid <= 0)
                return -ESRCH;
        if (kill(d->pid, SIGKILL) < 0)
                return -errno;
        int r = harness_wait(d->pid, ret_status, HARNESS_DEADLINE_MS);
        d->pid = 0;
        return r;
}

int harness_daemon_restart(struct daemon *d, const char *const *extra, int *exit_status) {
        if (d->pid > 0 || d->notify_fd < 0)
                return -EBUSY;
        harness_daemon_drain_notify(d);
        return daemon_exec(d, extra, exit_status, O_APPEND);
}

int harness_daemon_drain_notify(struct daemon *d) {
        int n = 0;
        for (;;) {
                char msg[512];
                union {
                        char buf[CMSG_SPACE(sizeof(int) * 16)];
                        struct cmsghdr align;
                } ctl;
                struct iovec iov = { .iov_base = msg, .iov_len = sizeof(msg) };
                struct msghdr mh = { .msg_iov = &iov,
                                     .msg_iovlen = 1,
                                     .msg_control = ctl.buf,
                                     .msg_controllen = sizeof(ctl.buf) };
                if (recvmsg(d->notify_fd, &mh, MSG_DONTWAIT | MSG_CMSG_CLOEXEC) < 0)
                        return n;
                for (struct cmsghdr *c = CMSG_FIRSTHDR(&mh); c; c = CMSG_NXTHDR(&mh, c)) {
                        if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS)
                                continue;
                        for (size_t i = 0; i < (c->cmsg_len - CMSG_LEN(0)) / sizeof(int); i++) {
                                int fd;
                                memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
                                close(fd);
                        }
                }
                n++;
        }
}

static void remove_tree(const char *root) {
        char cmd[600];
        snprintf(cmd, sizeof(cmd), "rm -rf '%s'", root);
        if (system(cmd) != 0)
                fprintf(stderr, "harness: could not remove %s\n", root);
}

int harness_daemon_stop(struct daemon *d) {
        int st = 0, r = 0;
        if (d->pid > 0) {
                kill(d->pid, SIGTERM);
                r = harness_wait(d->pid, &st, HARNESS_DEADLINE_MS);
                if (r == -ETIMEDOUT) {
                        kill(d->pid, SIGKILL);
                        harness_wait(d->pid, &st, HARNESS_DEADLINE_MS);
                }
                d->pid = 0;
        }
        if (d->notify_fd >= 0)
                close(d->notify_fd);
        d->notify_fd = -1;
        if (getenv("KVC_KEEP_LOGS")) {
                char *log = harness_slurp(d->log, NULL);
                fprintf(stderr, "--- kvcd log ---\n%s", log ? log : "");
                free(log);
        }
        if (d->root[0])
                remove_tree(d->root);
        return r < 0 ? r : st;
}

int harness_spawn(struct proc *p, const char *const *argv, bool capture) {
        int fds[2] = { -1, -1 };
        if (capture && pipe2(fds, O_CLOEXEC) < 0)
                return -errno;
        int devnull = capture ? -1 : open("/dev/null", O_WRONLY | O_CLOEXEC);
        p->pid = spawn(argv, capture ? fds[1] : devnull, -1, NULL);
        if (devnull >= 0)
                close(devnull);
        if (capture)
                close(fds[1]);
        p->out_fd = capture ? fds[0] : -1;
        return p->pid < 0 ? -errno : 0;
}

int harness_spawn_stderr(struct proc *p, const char *const *argv, int *ret_err_fd) {
        int out[2], err[2];
        if (pipe2(out, O_CLOEXEC) < 0)
                return -errno;
        if (pipe2(err, O_CLOEXEC) < 0) {
                int r = -errno;
                close(out[0]);
                close(out[1]);
                return r;
        }
        p->pid = spawn(argv, out[1], err[1], NULL);
        int r = p->pid < 0 ? -errno : 0;
        close(out[1]);
        close(err[1]);
        p->out_fd = out[0];
        *ret_err_fd = err[0];
        return r;
}

char *harness_read_all(int fd) {
        size_t len = 0, cap = 1024;
        char *out = malloc(cap);
        int64_t deadline = now_ms() + harness_client_deadline_ms;
        while (out) {
                struct pollfd pf = { .fd = fd, .events = POLLIN };
                int64_t left = deadline - now_ms();
                if (left <= 0 || poll(&pf, 1, (int)left) <= 0)
                        break;
                if (len + 256 > cap) {
                        char *o = realloc(out, cap * 2);
                        if (!o) {
                                free(out);
                                return NULL;
                        }
                        out = o;
                        cap *= 2;
                }
                ssize_t r = read(fd, out + len, cap - len - 1);
                if (r <= 0)
                        break;
                len += (size_t)r;
        }
        if (out)
                out[len] = '\0';
        return out;
}

int harness_fd_count(pid_t pid, const char *prefix, int *ret_matching) {
        char path[64], link[512];
        snprintf(path, sizeof(path), "/proc/%d/fd", (int)pid);
        DIR *dir = opendir(path);
        if (!dir)
                return -errno;
        int n = 0, matching = 0;
        struct dirent *e;
        while ((e = readdir(dir))) {
                if (e->d_name[0] == '.')
                        continue;
                char fdpath[128];
                snprintf(fdpath, sizeof(fdpath), "%s/%s", path, e->d_name);
                ssize_t k = readlink(fdpath, link, sizeof(link) - 1);
                if (k < 0)
                        continue; /* closed meanwhile */
                link[k] = '\0';
                if (prefix && strncmp(link, prefix, strlen(prefix)) == 0)
                        matching++;
                else
                        n++;
        }
        closedir(dir);
        if (ret_matching)
                *ret_matching = matching;
        return n;
}

ssize_t harness_read_some(struct proc *p, char *buf, size_t n) {
        size_t got = 0;
        int64_t deadline = now_ms() + harness_client_deadline_ms;
        while (got < n) {
                struct pollfd pf = { .fd = p->out_fd, .events = POLLIN };
                int64_t left = deadline - now_ms();
                if (left <= 0 || poll(&pf, 1, (int)left) <= 0)
                        return -ETIMEDOUT;
                ssize_t r = read(p->out_fd, buf + got, n - got);
                if (r <= 0)
                        break;
                got += (size_t)r;
        }
        return (ssize_t)got;
}

int harness_client_deadline_ms = HARNESS_DEADLINE_MS;

int harness_finish(struct proc *p, char **ret_out, int *ret_status) {
        size_t len = 0, cap = 4096;
        char *out = malloc(cap);
        int64_t deadline = now_ms() + harness_client_deadline_ms;
        if (!out)
                return -ENOMEM;
        while (p->out_fd >= 0) {
                struct pollfd pf = { .fd = p->out_fd, .events = POLLIN };
                int64_t left = deadline - now_ms();
                if (left <= 0 || poll(&pf, 1, (int)left) <= 0) {
                        free(out);
                        kill(p->pid, SIGKILL);
                        harness_wait(p->pid, NULL, HARNESS_DEADLINE_MS);
                        return -ETIMEDOUT;
                }
                if (len + 1024 > cap) {
                        char *o = realloc(out, cap * 2);
                        if (!o) {
                                free(out);
                                return -ENOMEM;
                        }
                        out = o;
                        cap *= 2;
                }
                ssize_t r = read(p->out_fd, out + len, cap - len - 1);
                if (r <= 0)
                        break;
                len += (size_t)r;
        }
        out[len] = '\0';
        if (p->out_fd >= 0)
                close(p->out_fd);
        p->out_fd = -1;
        int r = harness_wait(p->pid, ret_status, HARNESS_DEADLINE_MS);
        if (r < 0) {
                free(out);
                return r;
        }
        if (ret_out)
                *ret_out = out;
        else
                free(out);
        return 0;
}

int harness_run(const char *const *argv, char **ret_out, int *ret_status) {
        struct proc p;
        int r = harness_spawn(&p, argv, true);
        return r < 0 ? r : harness_finish(&p, ret_out, ret_status);
}

char *harness_kvcctl(const struct daemon *d, const char *verb) {
        const char *argv[] = { harness_bin("kvcctl"), "--socket", d->dir, "--json", verb, NULL };
        char *out = NULL;
        int st;
        if (harness_run(argv, &out, &st) < 0)
                return NULL;
        if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) {
                free(out);
                return NULL;
        }
        return out;
}

long long harness_json_int(const char *json, const char *key) {
        char pat[128];
        snprintf(pat, sizeof(pat), "\"%s\":", key);
        const char *p = json ? strstr(json, pat) : NULL;
        return p ? strtoll(p + strlen(pat), NULL, 10) : -1;
}

char *harness_slurp(const char *path, size_t *ret_len) {
        FILE *f = fopen(path, "rb");
        if (!f)
                return NULL;
        size_t cap = 4096, len = 0;
        char *buf = malloc(cap);
        size_t r;
        while (buf && (r = fread(buf + len, 1, cap - len - 1, f)) > 0) {
                len += r;
                if (len + 1 >= cap) {
                        char *b = realloc(buf, cap * 2);
                        if (!b) {
                                free(buf);
                                buf = NULL;
                                break;
                        }
                        buf = b;
                        cap *= 2;
                }
        }
        fclose(f);
        if (buf) {
                buf[len] = '\0';
                if (ret_len)
                        *ret_len = len;
        }
        return buf;
}

int harness_group_start(void **state, const char *const *extra) {
        struct daemon *d = calloc(1, sizeof(*d));
        if (!d || harness_daemon_start(d, extra, NULL) < 0) {
                free(d);
                return -1;
        }
        *state = d;
        return 0;
}

int harness_group_stop(void **state) {
        struct daemon *d = *state;
        int st = harness_daemon_stop(d);
        free(d);
        return WIFEXITED(st) && WEXITSTATUS(st) == 0 ? 0 : -1;
}

char *harness_output(const char *const *argv) {
        char *out = NULL;
        int st = -1;
        if (harness_run(argv, &out, &st) < 0 || !WIFEXITED(st) || WEXITSTATUS(st) != 0) {
                free(out);
                return NULL;
        }
        return out;
}
