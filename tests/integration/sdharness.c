/* sdharness.c: the tests' stand-in for systemd (see sdharness.h). */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "harness.h"
#include "sdharness.h"

static const struct {
        const char *name;
        int type;
} sockets[SDSVC_SOCKETS] = {
        { "kvcd.sock", SOCK_STREAM },
        { "kvcd.fd.sock", SOCK_SEQPACKET },
        { "kvcd.admin.sock", SOCK_STREAM },
        { "kvcd.events.sock", SOCK_STREAM },
};

static int listen_at(const char *dir, const char *name, int type) {
        struct sockaddr_un sa = { .sun_family = AF_UNIX };
        if ((size_t)snprintf(sa.sun_path, sizeof(sa.sun_path), "%s/%s", dir, name) >= sizeof(sa.sun_path))
                return -ENAMETOOLONG;
        int fd = socket(AF_UNIX, type | SOCK_CLOEXEC, 0);
        if (fd < 0)
                return -errno;
        if (bind(fd, (struct sockaddr *)&sa, sizeof(sa)) < 0 || listen(fd, 128) < 0) {
                int e = errno;
                close(fd);
                return -e;
        }
        return fd;
}

/* "KEY=value" lines of a notification: the value of key, copied into out, or false. */
static bool field(const char *msg, const char *key, char *out, size_t out_len) {
        size_t k = strlen(key);
        for (const char *p = msg; p && *p; p = strchr(p, '\n'), p = p ? p + 1 : NULL) {
                if (strncmp(p, key, k) != 0 || p[k] != '=')
                        continue;
                const char *v = p + k + 1, *end = strchrnul(v, '\n');
                snprintf(out, out_len, "%.*s", (int)(end - v), v);
                return true;
        }
        return false;
}

static void store_remove(struct sdsvc *s, const char *name) {
        size_t w = 0;
        for (size_t i = 0; i < s->n_store; i++) {
                if (strcmp(s->store[i].name, name) == 0)
                        close(s->store[i].fd);
                else
                        s->store[w++] = s->store[i];
        }
        s->n_store = w;
}

/* One notification, with the fds it carries, handled as systemd would. */
static void handle_notification(struct sdsvc *s, const char *msg, const int *fds, size_t n_fds) {
        char v[64], name[64] = "stored";
        field(msg, "FDNAME", name, sizeof(name));
        pthread_mutex_lock(&s->mu);
        if (field(msg, "FDSTORE", v, sizeof(v)) && strcmp(v, "1") == 0) {
                for (size_t i = 0; i < n_fds; i++) {
                        if (s->n_store == SDSVC_STORE_MAX) {
                                close(fds[i]);
                                continue;
                        }
                        snprintf(s->store[s->n_store].name, sizeof(s->store[0].name), "%s", name);
                        s->store[s->n_store++].fd = fds[i];
                }
                n_fds = 0;
        }
        if (field(msg, "FDSTOREREMOVE", v, sizeof(v)) && strcmp(v, "1") == 0)
                store_remove(s, name);
        if (field(msg, "READY", v, sizeof(v)) && strcmp(v, "1") == 0)
                s->ready++;
        pthread_cond_broadcast(&s->cond);
        pthread_mutex_unlock(&s->mu);
        for (size_t i = 0; i < n_fds; i++)
                close(fds[i]);
}

static void *notify_thread(void *arg) {
        struct sdsvc *s = arg;
        for (;;) {
                struct pollfd p[2] = { { .fd = s->notify_fd, .events = POLLIN },
                                       { .fd = s->wake[0], .events = POLLIN } };
                if (poll(p, 2, -1) < 0 && errno != EINTR)
                        return NULL;
                if (p[1].revents)
                        return NULL;
                if (!(p[0].revents & POLLIN))
                        continue;
                char msg[4096];
                union {
                        struct cmsghdr align;
                        char buf[CMSG_SPACE(sizeof(int) * 64)];
                } ctl;
                struct iovec iov = { .iov_base = msg, .iov_len = sizeof(msg) - 1 };
                struct msghdr mh = { .msg_iov = &iov,
                                     .msg_iovlen = 1,
                                     .msg_control = ctl.buf,
                                     .msg_controllen = sizeof(ctl.buf) };
                ssize_t n = recvmsg(s->notify_fd, &mh, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
                if (n < 0)
                        continue;
                msg[n] = '\0';
                int fds[64];
                size_t n_fds = 0;
                for (struct cmsghdr *c = CMSG_FIRSTHDR(&mh); c; c = CMSG_NXTHDR(&mh, c)) {
                        if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS)
                                continue;
                        size_t k = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
                        for (size_t i = 0; i < k && n_fds < 64; i++)
                                memcpy(&fds[n_fds++], CMSG_DATA(c) + i * sizeof(int), sizeof(int));
                }
                handle_notification(s, msg, fds, n_fds);
        }
}

int sdsvc_init(struct sdsvc *s) {
        memset(s, 0, sizeof(*s));
        s->notify_fd = s->wake[0] = s->wake[1] = -1;
        for (int i = 0; i < SDSVC_SOCKETS; i++)
                s->listen_fd[i] = -1;
        pthread_mutex_init(&s->mu, NULL);
        pthread_cond_init(&s->cond, NULL);
        snprintf(s->root, sizeof(s->root), "/tmp/kvc-sd-XXXXXX");
        if (!mkdtemp(s->root))
                return -errno;
        snprintf(s->dir, sizeof(s->dir), "%s/run", s->root);
        snprintf(s->log, sizeof(s->log), "%s/kvcd.log", s->root);
        snprintf(s->notify, sizeof(s->notify), "%s/notify", s->root);
        if (mkdir(s->dir, 0750) < 0)
                return -errno;
        for (int i = 0; i < SDSVC_SOCKETS; i++)
                if ((s->listen_fd[i] = listen_at(s->dir, sockets[i].name, sockets[i].type)) < 0)
                        return s->listen_fd[i];
        struct sockaddr_un sa = { .sun_family = AF_UNIX };
        snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", s->notify);
        s->notify_fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
        if (s->notify_fd < 0 || bind(s->notify_fd, (struct sockaddr *)&sa, sizeof(sa)) < 0 ||
            pipe2(s->wake, O_CLOEXEC) < 0)
                return -errno;
        int r = pthread_create(&s->thread, NULL, notify_thread, s);
        if (r)
                return -r;
        s->thread_started = true;
        return 0;
}

/* Async-signal-safe decimal, for the child between fork and exec. */
static void put_uint(char *out, unsigned long v) {
        char tmp[24];
        int n = 0;
        do
                tmp[n++] = (char)('0' + v % 10);
        while ((v /= 10));
        while (n)
                *out++ = tmp[--n];
        *out = '\0';
}

int sdsvc_start(struct sdsvc *s, const char *const *extra) {
        /* everything the child needs is built before fork(): the notify thread runs */
        pthread_mutex_lock(&s->mu);
        size_t n_fds = SDSVC_SOCKETS + s->n_store;
        int *fds = malloc(n_fds * sizeof(int));
        size_t names_len = 1;
        for (size_t i = 0; i < s->n_store; i++)
                names_len += strlen(s->store[i].name) + 1;
        char *names = malloc(names_len + 200);
        if (!fds || !names) {
                pthread_mutex_unlock(&s->mu);
                free(fds);
                free(names);
                return -ENOMEM;
        }
        char *p = names + sprintf(names, "LISTEN_FDNAMES=");
        for (size_t i = 0; i < n_fds; i++) {
                fds[i] = i < SDSVC_SOCKETS ? s->listen_fd[i] : s->store[i - SDSVC_SOCKETS].fd;
                p += sprintf(p, "%s%s", i ? ":" : "",
                             i < SDSVC_SOCKETS ? sockets[i].name : s->store[i - SDSVC_SOCKETS].name);
        }
        unsigned ready = s->ready;
        pthread_mutex_unlock(&s->mu);

        char listen_fds[32], listen_pid[32] = "LISTEN_PID=", notify[160];
        snprintf(listen_fds, sizeof(listen_fds), "LISTEN_FDS=%zu", n_fds);
        snprintf(notify, sizeof(notify), "NOTIFY_SOCKET=%s", s->notify);
        const char *argv[40] = { harness_bin("kvcd"), "--runtime-dir", s->dir,
                                 "--fd-store",        "--log-level",   "debug" };
        int argc = 6;
        for (int i = 0; extra && extra[i] && argc < 39; i++)
                argv[argc++] = extra[i];
        argv[argc] = NULL;
        const char *envp[] = { listen_fds, listen_pid, names, notify, "PATH=/usr/bin:/bin", NULL };
        int log_fd = open(s->log, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600);

        pid_t pid = fork();
        if (pid == 0) {
                /* stderr first: log_fd's number may be one of 3, 4, ... that the passed fds fill
                 * next (kvcd then logged into a pool chunk) */
                if (log_fd >= 0)
                        dup2(log_fd, STDERR_FILENO);
                /* fds above the ones to fill, then down into 3, 4, ... (dup2 clears CLOEXEC) */
                for (size_t i = 0; i < n_fds; i++)
                        if ((fds[i] = fcntl(fds[i], F_DUPFD_CLOEXEC, (int)(3 + n_fds + 64))) < 0)
                                _exit(127);
                for (size_t i = 0; i < n_fds; i++)
                        if (dup2(fds[i], (int)(3 + i)) < 0)
                                _exit(127);
                put_uint(listen_pid + strlen("LISTEN_PID="), (unsigned long)getpid());
                execve(argv[0], (char *const *)argv, (char *const *)envp);
                _exit(127);
        }
        int e = errno;
        free(fds);
        free(names);
        if (log_fd >= 0)
                close(log_fd);
        if (pid < 0)
                return -e;
        s->pid = pid;

        struct timespec deadline;
        clock_gettime(CLOCK_REALTIME, &deadline);
        deadline.tv_sec += HARNESS_DEADLINE_MS / 1000;
        int r = 0;
        pthread_mutex_lock(&s->mu);
        while (s->ready == ready && r == 0) {
                /* short slices: a kvcd that exits sends no READY */
                struct timespec slice;
                clock_gettime(CLOCK_REALTIME, &slice);
                slice.tv_nsec += 50 * 1000000L;
                if (slice.tv_nsec >= 1000000000L) {
                        slice.tv_sec++;
                        slice.tv_nsec -= 1000000000L;
                }
                pthread_cond_timedwait(&s->cond, &s->mu, &slice);
                int st;
                if (s->ready == ready && waitpid(pid, &st, WNOHANG) == pid) {
                        s->pid = 0;
                        r = -ECHILD;
                } else if (s->ready == ready &&
                           (slice.tv_sec > deadline.tv_sec ||
                            (slice.tv_sec == deadline.tv_sec && slice.tv_nsec >= deadline.tv_nsec)))
                        r = -ETIMEDOUT;
        }
        pthread_mutex_unlock(&s->mu);
        return r;
}

int sdsvc_kill(struct sdsvc *s, int sig) {
        if (s->pid <= 0)
                return -ESRCH;
        kill(s->pid, sig);
        int st = 0, r = harness_wait(s->pid, &st, HARNESS_DEADLINE_MS);
        if (r == -ETIMEDOUT) {
                kill(s->pid, SIGKILL);
                harness_wait(s->pid, &st, HARNESS_DEADLINE_MS);
        }
        s->pid = 0;
        if (r < 0)
                return r;
        /* systemd reads every notification a service sent before it reaps it; so do we: the
         * thread takes each one under the lock and signals, so wait while the socket has any */
        for (int slices = 0; slices < HARNESS_DEADLINE_MS / 10; slices++) {
                struct pollfd p = { .fd = s->notify_fd, .events = POLLIN };
                if (poll(&p, 1, 0) <= 0)
                        break;
                struct timespec t;
                clock_gettime(CLOCK_REALTIME, &t);
                t.tv_nsec += 10 * 1000000L;
                if (t.tv_nsec >= 1000000000L) {
                        t.tv_sec++;
                        t.tv_nsec -= 1000000000L;
                }
                pthread_mutex_lock(&s->mu);
                pthread_cond_timedwait(&s->cond, &s->mu, &t);
                pthread_mutex_unlock(&s->mu);
        }
        return st;
}

size_t sdsvc_store_count(struct sdsvc *s, const char *prefix) {
        size_t n = 0;
        pthread_mutex_lock(&s->mu);
        for (size_t i = 0; i < s->n_store; i++)
                n += strncmp(s->store[i].name, prefix, strlen(prefix)) == 0;
        pthread_mutex_unlock(&s->mu);
        return n;
}

void sdsvc_free(struct sdsvc *s) {
        if (s->pid > 0)
                sdsvc_kill(s, SIGKILL);
        if (s->thread_started) {
                if (write(s->wake[1], "x", 1) != 1)
                        pthread_cancel(s->thread);
                pthread_join(s->thread, NULL);
        }
        for (int i = 0; i < SDSVC_SOCKETS; i++)
                if (s->listen_fd[i] >= 0)
                        close(s->listen_fd[i]);
        for (size_t i = 0; i < s->n_store; i++)
                close(s->store[i].fd);
        s->n_store = 0;
        int fds[] = { s->notify_fd, s->wake[0], s->wake[1] };
        for (size_t i = 0; i < 3; i++)
                if (fds[i] >= 0)
                        close(fds[i]);
        if (getenv("KVC_KEEP_LOGS")) {
                char *log = harness_slurp(s->log, NULL);
                fprintf(stderr, "--- kvcd log ---\n%s", log ? log : "");
                free(log);
        }
        if (s->root[0]) {
                char cmd[160];
                snprintf(cmd, sizeof(cmd), "rm -rf '%s'", s->root);
                if (system(cmd) != 0)
                        fprintf(stderr, "sdharness: could not remove %s\n", s->root);
        }
        pthread_mutex_destroy(&s->mu);
        pthread_cond_destroy(&s->cond);
}
