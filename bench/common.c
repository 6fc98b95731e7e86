/* common.c: the benchmarks' shared helpers (common.h). */
#define _GNU_SOURCE
#include "common.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

uint64_t bench_now_ns(void) {
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

int bench_cpus(int *ret, int max) {
        cpu_set_t set;
        int n = 0;
        if (sched_getaffinity(0, sizeof(set), &set) < 0)
                return 0;
        for (int c = 0; c < CPU_SETSIZE && n < max; c++)
                if (CPU_ISSET(c, &set))
                        ret[n++] = c;
        return n;
}

int bench_pin(pid_t pid, int cpu) {
        if (cpu < 0)
                return 0;
        cpu_set_t set;
        CPU_ZERO(&set);
        CPU_SET(cpu, &set);
        return sched_setaffinity(pid, sizeof(set), &set) < 0 ? -errno : 0;
}

void bench_pick_cpus(int *ret_client, int *ret_server) {
        int cpus[2];
        int n = bench_cpus(cpus, 2);
        *ret_client = n >= 2 ? cpus[0] : -1;
        *ret_server = n >= 2 ? cpus[1] : -1;
}

static int cmp_double(const void *a, const void *b) {
        double x = *(const double *)a, y = *(const double *)b;
        return x < y ? -1 : x > y;
}

double bench_quantile(double *v, size_t n, double q) {
        if (n == 0)
                return NAN;
        qsort(v, n, sizeof(*v), cmp_double);
        size_t i = (size_t)ceil(q * (double)n);
        return v[i ? i - 1 : 0];
}

double bench_mean(const double *v, size_t n) {
        double s = 0;
        for (size_t i = 0; i < n; i++)
                s += v[i];
        return n ? s / (double)n : NAN;
}

long bench_status_kib(pid_t pid, const char *field) {
        char path[64], line[256];
        long v = -1;
        size_t n = strlen(field);
        snprintf(path, sizeof(path), "/proc/%d/status", (int)pid);
        FILE *f = fopen(path, "r");
        if (!f)
                return -1;
        while (fgets(line, sizeof(line), f))
                if (strncmp(line, field, n) == 0 && line[n] == ':')
                        v = strtol(line + n + 1, NULL, 10);
        fclose(f);
        return v;
}

double bench_cpu_seconds(pid_t pid) {
        char path[64], buf[1024];
        snprintf(path, sizeof(path), "/proc/%d/stat", (int)pid);
        FILE *f = fopen(path, "r");
        if (!f)
                return NAN;
        size_t n = fread(buf, 1, sizeof(buf) - 1, f);
        fclose(f);
        buf[n] = '\0';
        const char *p = strrchr(buf, ')'); /* the command may hold spaces */
        unsigned long long ut = 0, st = 0;
        if (!p || sscanf(p + 2, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %llu %llu", &ut, &st) != 2)
                return NAN;
        return (double)(ut + st) / (double)sysconf(_SC_CLK_TCK);
}

int bench_tmpdir(char *buf, size_t len, const char *tag) {
        const char *tmp = getenv("TMPDIR");
        if ((size_t)snprintf(buf, len, "%s/kvc-bench-%s-XXXXXX", tmp && *tmp ? tmp : "/tmp", tag) >= len)
                return -ENAMETOOLONG;
        return mkdtemp(buf) ? 0 : -errno;
}

void bench_rmtree(const char *dir) {
        pid_t p = fork();
        if (p == 0) {
                execlp("rm", "rm", "-rf", "--", dir, (char *)NULL);
                _exit(127);
        }
        if (p > 0)
                waitpid(p, NULL, 0);
}

int bench_kvcd_start(const char *path, int cpu, struct bench_kvcd *k) {
        int e = bench_tmpdir(k->root, sizeof(k->root), "kvcd");
        if (e < 0)
                return e;
        snprintf(k->dir, sizeof(k->dir), "%s/run", k->root);
        struct sockaddr_un sa = { .sun_family = AF_UNIX };
        snprintf(sa.sun_path, sizeof(sa.sun_path), "%s/notify", k->root);
        int nfd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
        if (nfd < 0 || bind(nfd, (struct sockaddr *)&sa, sizeof(sa)) < 0)
                return -errno;
        k->pid = fork();
        if (k->pid < 0)
                return -errno;
        if (k->pid == 0) {
                int devnull = open("/dev/null", O_WRONLY);
                bench_die_with_parent(SIGTERM); /* a benchmark that fails leaves no kvcd behind */
                dup2(devnull, STDERR_FILENO);
                bench_pin(0, cpu);
                setenv("NOTIFY_SOCKET", sa.sun_path, 1);
                execl(path, path, "--runtime-dir", k->dir, "--log-level", "warning", (char *)NULL);
                _exit(127);
        }
        int pfd = (int)syscall(SYS_pidfd_open, k->pid, 0);
        for (;;) {
                struct pollfd p[2] = { { .fd = nfd, .events = POLLIN }, { .fd = pfd, .events = POLLIN } };
                if (poll(p, 2, 20000) <= 0 || (p[1].revents & POLLIN)) {
                        close(nfd);
                        close(pfd);
                        return -ECHILD;
                }
                char msg[512];
                ssize_t m = recv(nfd, msg, sizeof(msg) - 1, 0);
                if (m > 0) {
                        msg[m] = '\0';
                        if (strstr(msg, "READY=1"))
                                break;
                }
        }
        close(pfd);
        /* kvcd keeps sending STATUS=: nobody reads it from now on, so the socket goes (its
         * sd_notify then fails harmlessly instead of filling a queue) */
        close(nfd);
        unlink(sa.sun_path);
        return 0;
}

void bench_die_with_parent(int sig) {
        prctl(PR_SET_PDEATHSIG, sig);
}

void bench_kvcd_stop(struct bench_kvcd *k) {
        if (k->pid > 0) {
                /* a graceful stop; sessions still open would hold it for its stop timeout, so a
                 * second SIGTERM (stop at once) follows after 3 s */
                kill(k->pid, SIGTERM);
                for (int i = 0; i < 300 && waitpid(k->pid, NULL, WNOHANG) == 0; i++)
                        usleep(10000);
                if (waitpid(k->pid, NULL, WNOHANG) == 0) {
                        kill(k->pid, SIGTERM);
                        waitpid(k->pid, NULL, 0);
                }
                k->pid = 0;
        }
        if (k->root[0])
                bench_rmtree(k->root);
}
