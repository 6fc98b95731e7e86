/* kvc-load: a load generator for kvcd, through libkvc.
 *
 * P client processes (fork) each open S sessions of one synthetic geometry (stories260K's by
 * default: 5 layers, 8 query heads, 4 KV heads, head dim 8, f32) and step them until the time is
 * up. One step of a process: for every session and every layer, kvc_append() a random key and
 * value and kvc_attend() a random query (which updates the scores the policy ranks by); then
 * kvc_summarize() random logits and kvc_step() every session; then one kvc_flush() for all of
 * them: one StepBatch, one PlanBatch back, the plans in it applied (compaction) and acknowledged.
 * The flush is timed: that is the plan round trip a decode step of an inference server waits for.
 * A session that reaches the context (a policy that keeps everything) is closed and reopened.
 *
 * Reported, in one line (or one JSON object with --json): session steps per second over all
 * processes, flushes per second, the flush round trip's p50 / p99 / max, plans applied, kvcd's
 * peak RSS (VmHWM of /proc/PID/status, reset at the start when /proc/PID/clear_refs allows it)
 * and the errors, which must be 0 (the exit status is 1 otherwise).
 *
 * kvcd is either one that runs (--socket DIR, its pid from --kvcd-pid or else from the side
 * channel's SO_PEERCRED) or one kvc-load starts for the run (--kvcd PATH: a private runtime
 * directory, READY=1 on a private NOTIFY_SOCKET, SIGTERM at the end).
 *
 * Latencies go into a log histogram (100 buckets per decade, 1 us .. 100 s: 2.3% resolution) per
 * process; the parent merges them.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <math.h>
#include <poll.h>
#include <signal.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "common.h"
#include "kvc.h"

#define MAX_PROCESSES   256
#define MAX_PARAMS      16
#define VOCAB           512
#define HIST_PER_DECADE 100
#define HIST_DECADES    8 /* 1 us .. 100 s */
#define HIST_BUCKETS    (HIST_PER_DECADE * HIST_DECADES + 1)

struct opts {
        const char *socket, *kvcd, *policy, *dtype_name;
        int processes, sessions;
        double seconds;
        uint32_t budget, layers, heads, kv_heads, head_dim, max_tokens;
        enum kvc_dtype dtype;
        struct kvc_param params[MAX_PARAMS];
        size_t n_params;
        pid_t kvcd_pid;
        uint64_t seed;
        bool json;
};

/* What a worker sends its parent through a pipe when it is done. */
struct result {
        uint64_t steps; /* session steps */
        uint64_t flushes;
        uint64_t plans_applied;
        uint64_t reopened; /* sessions that reached the context and were replaced */
        uint64_t errors;
        uint64_t lat_sum_ns, lat_max_ns;
        uint64_t hist[HIST_BUCKETS];
        char first_error[256];
};

static uint64_t now_ns(void) {
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static void hist_add(uint64_t *hist, uint64_t ns) {
        double us = (double)ns / 1000.0;
        int b = us <= 1.0 ? 0 : (int)(log10(us) * HIST_PER_DECADE) + 1;
        hist[b < HIST_BUCKETS ? b : HIST_BUCKETS - 1]++;
}

/* The latency (us) below which a fraction q of the samples lie: the upper edge of its bucket. */
static double hist_quantile(const uint64_t *hist, uint64_t n, double q) {
        uint64_t want = (uint64_t)ceil(q * (double)n), seen = 0;
        for (int b = 0; b < HIST_BUCKETS; b++) {
                seen += hist[b];
                if (seen >= want && want > 0)
                        return pow(10.0, (double)b / HIST_PER_DECADE);
        }
        return NAN;
}

/* ---- a worker process ---- */

static uint64_t rng_state;

static inline uint64_t rng_next(void) {
        uint64_t z = (rng_state += 0x9e3779b97f4a7c15ull);
        z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
        z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
        return z ^ (z >> 31);
}

static inline float rng_float(void) { /* in [-1, 1) */
        return (float)(int32_t)(rng_next() >> 32) / 2147483648.0f;
}

static void fill(float *x, size_t n, float scale) {
        for (size_t i = 0; i < n; i++)
                x[i] = rng_float() * scale;
}

static void note_error(struct result *r, struct kvc_client *c, const char *what, int e) {
        r->errors++;
        if (!r->first_error[0])
                snprintf(r->first_error, sizeof(r->first_error), "%s: %s: %s", what, strerror(-e),
                         c ? kvc_last_error(c) : "");
}

static int open_one(struct kvc_client *c, const struct opts *o, struct kvc_session **ret) {
        struct kvc_session_config cfg = {
                .geometry = { .n_layers = o->layers,
                              .n_heads = o->heads,
                              .n_kv_heads = o->kv_heads,
                              .head_dim = o->head_dim,
                              .dtype = o->dtype,
                              .max_tokens = o->max_tokens },
                .policy = o->policy,
                .budget_tokens = o->budget,
                .params = o->params,
                .n_params = o->n_params,
        };
        return kvc_session_open(c, &cfg, ret);
}

static void close_one(struct kvc_session *s, struct result *r) {
        struct kvc_session_stats st;
        kvc_session_get_stats(s, &st);
        r->plans_applied += st.plans_applied;
        kvc_session_close(s, NULL);
}

static void worker(const struct opts *o, int index, uint64_t deadline_ns, struct result *r) {
        struct kvc_options ko = { .socket = o->socket, .name = "kvc-load" };
        struct kvc_client *c = NULL;
        struct kvc_session **s = calloc((size_t)o->sessions, sizeof(*s));
        uint64_t *step = calloc((size_t)o->sessions, sizeof(*step));
        size_t kvn = (size_t)o->kv_heads * o->head_dim, qn = (size_t)o->heads * o->head_dim;
        float *k = malloc(kvn * sizeof(float)), *v = malloc(kvn * sizeof(float));
        float *q = malloc(qn * sizeof(float)), *out = malloc(qn * sizeof(float));
        float *logits = malloc(VOCAB * sizeof(float));
        int e;
        rng_state = o->seed * 1000003u + (uint64_t)index;
        if (!s || !step || !k || !v || !q || !out || !logits) {
                note_error(r, NULL, "memory", -ENOMEM);
                goto out;
        }
        if ((e = kvc_connect(&ko, &c)) < 0) {
                note_error(r, NULL, "connect", e);
                goto out;
        }
        for (int i = 0; i < o->sessions; i++)
                if ((e = open_one(c, o, &s[i])) < 0) {
                        note_error(r, c, "open", e);
                        goto out;
                }
        while (now_ns() < deadline_ns && r->errors == 0) {
                for (int i = 0; i < o->sessions && r->errors == 0; i++) {
                        if (kvc_layer_tokens(s[i], 0) + 1 >= o->max_tokens) { /* the context is full */
                                close_one(s[i], r);
                                s[i] = NULL;
                                step[i] = 0;
                                if ((e = open_one(c, o, &s[i])) < 0) {
                                        note_error(r, c, "reopen", e);
                                        break;
                                }
                                r->reopened++;
                        }
                        for (uint32_t l = 0; l < o->layers; l++) {
                                fill(k, kvn, 1.0f);
                                fill(v, kvn, 1.0f);
                                fill(q, qn, 1.0f);
                                if ((e = kvc_append(s[i], l, (int32_t)step[i], k, v)) < 0) {
                                        note_error(r, c, "append", e);
                                        break;
                                }
                                if ((e = kvc_attend(s[i], l, q, out)) < 0) {
                                        note_error(r, c, "attend", e);
                                        break;
                                }
                        }
                        struct kvc_summary sum;
                        fill(logits, VOCAB, 4.0f);
                        if (r->errors == 0 && ((e = kvc_summarize(logits, VOCAB, &sum)) < 0 ||
                                               (e = kvc_step(s[i], step[i], KVC_PHASE_DECODE, &sum)) < 0))
                                note_error(r, c, "step", e);
                        step[i]++;
                }
                if (r->errors)
                        break;
                uint64_t t0 = now_ns();
                e = kvc_flush(c);
                uint64_t dt = now_ns() - t0;
                if (e < 0) {
                        note_error(r, c, "flush", e);
                        break;
                }
                r->flushes++;
                r->steps += (uint64_t)o->sessions;
                r->lat_sum_ns += dt;
                if (dt > r->lat_max_ns)
                        r->lat_max_ns = dt;
                hist_add(r->hist, dt);
        }
out:
        for (int i = 0; s && c && i < o->sessions; i++)
                if (s[i])
                        close_one(s[i], r);
        kvc_disconnect(c);
        free(s);
        free(step);
        free(k);
        free(v);
        free(q);
        free(out);
        free(logits);
}

/* ---- kvcd: found, or started for the run ---- */

static long status_kib(pid_t pid, const char *field) {
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

/* Resets the peak RSS to the current RSS (proc(5), clear_refs "5"); false when not allowed. */
static bool reset_peak(pid_t pid) {
        char path[64];
        snprintf(path, sizeof(path), "/proc/%d/clear_refs", (int)pid);
        int fd = open(path, O_WRONLY | O_CLOEXEC);
        if (fd < 0)
                return false;
        bool ok = write(fd, "5", 1) == 1;
        close(fd);
        return ok;
}

/* The pid of the process listening on DIR/kvcd.fd.sock (SO_PEERCRED), if it is a kvcd. */
static pid_t find_kvcd(const char *socket_hint) {
        char dir[256], path[300], comm[64] = "";
        struct sockaddr_un sa = { .sun_family = AF_UNIX };
        if (socket_hint) {
                snprintf(dir, sizeof(dir), "%s", socket_hint);
                size_t n = strlen(dir);
                if (n > 5 && strcmp(dir + n - 5, ".sock") == 0) {
                        char *slash = strrchr(dir, '/');
                        if (slash)
                                *slash = '\0';
                }
        } else if (kvc_default_runtime_dir(dir, sizeof(dir)) < 0) {
                return -1;
        }
        snprintf(path, sizeof(path), "%s/kvcd.fd.sock", dir);
        if (strlen(path) >= sizeof(sa.sun_path))
                return -1;
        memcpy(sa.sun_path, path, strlen(path) + 1);
        int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
        struct ucred cred = { 0 };
        socklen_t len = sizeof(cred);
        if (fd < 0 || connect(fd, (struct sockaddr *)&sa, sizeof(sa)) < 0 ||
            getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) < 0) {
                if (fd >= 0)
                        close(fd);
                return -1;
        }
        close(fd);
        snprintf(path, sizeof(path), "/proc/%d/comm", (int)cred.pid);
        FILE *f = fopen(path, "r");
        if (f) {
                if (!fgets(comm, sizeof(comm), f))
                        comm[0] = '\0';
                fclose(f);
        }
        return strncmp(comm, "kvcd", 4) == 0 ? cred.pid : -1; /* socket activation: the listener is pid 1 */
}

/* ---- the command line and the parent ---- */

static void usage(FILE *f) {
        fprintf(f,
                "Usage: kvc-load [OPTIONS]\n"
                "Steps many libkvc sessions against kvcd and reports steps per second, the plan round trip\n"
                "(kvc_flush) p50 and p99, and kvcd's peak RSS.\n\n"
                "  --socket PATH        kvcd's runtime directory or kvcd.sock (default: as libkvc)\n"
                "  --kvcd PATH          start this kvcd binary in a private directory for the run instead\n"
                "  --kvcd-pid PID       kvcd's pid, for its RSS (default: from the side channel's peer)\n"
                "  -p, --processes N    client processes (default 16)\n"
                "  -S, --sessions N     sessions per process (default 16)\n"
                "  -t, --seconds T      how long to step (default 20)\n"
                "  --policy NAME        (default window)\n"
                "  --budget TOKENS      (default 64)\n"
                "  --param KEY=VALUE    a policy parameter (repeatable)\n"
                "  --layers N --heads N --kv-heads N --head-dim N --max-tokens N\n"
                "                       the geometry (default 5, 8, 4, 8, 512: stories260K)\n"
                "  --dtype f32|f16|bf16 (default f32)\n"
                "  --seed N             (default 1)\n"
                "  --json               one JSON object instead of the summary line\n"
                "  -h, --help\n");
}

static int parse(int argc, char **argv, struct opts *o) {
        static const struct option lo[] = {
                { "socket", required_argument, NULL, 's' },
                { "kvcd", required_argument, NULL, 'K' },
                { "kvcd-pid", required_argument, NULL, 'P' },
                { "processes", required_argument, NULL, 'p' },
                { "sessions", required_argument, NULL, 'S' },
                { "seconds", required_argument, NULL, 't' },
                { "policy", required_argument, NULL, 'y' },
                { "budget", required_argument, NULL, 'b' },
                { "param", required_argument, NULL, 'a' },
                { "layers", required_argument, NULL, 'L' },
                { "heads", required_argument, NULL, 'H' },
                { "kv-heads", required_argument, NULL, 'V' },
                { "head-dim", required_argument, NULL, 'D' },
                { "max-tokens", required_argument, NULL, 'M' },
                { "dtype", required_argument, NULL, 'd' },
                { "seed", required_argument, NULL, 'r' },
                { "json", no_argument, NULL, 'j' },
                { "help", no_argument, NULL, 'h' },
                {},
        };
        int ch;
        while ((ch = getopt_long(argc, argv, "p:S:t:h", lo, NULL)) != -1) {
                char *end = NULL;
                unsigned long u = optarg ? strtoul(optarg, &end, 10) : 0;
                bool num = optarg && *optarg && end && !*end;
                switch (ch) {
                case 's': o->socket = optarg; break;
                case 'K': o->kvcd = optarg; break;
                case 'y': o->policy = optarg; break;
                case 'j': o->json = true; break;
                case 'h': usage(stdout); exit(0);
                case 't':
                        o->seconds = strtod(optarg, &end);
                        if (*end || !(o->seconds > 0))
                                return -EINVAL;
                        break;
                case 'a': {
                        char *eq = strchr(optarg, '=');
                        if (!eq || eq == optarg || o->n_params >= MAX_PARAMS)
                                return -EINVAL;
                        *eq = '\0';
                        o->params[o->n_params++] = (struct kvc_param){ .key = optarg, .value = eq + 1 };
                        break;
                }
                case 'd':
                        o->dtype_name = optarg;
                        if (strcmp(optarg, "f32") == 0)
                                o->dtype = KVC_DTYPE_F32;
                        else if (strcmp(optarg, "f16") == 0)
                                o->dtype = KVC_DTYPE_F16;
                        else if (strcmp(optarg, "bf16") == 0)
                                o->dtype = KVC_DTYPE_BF16;
                        else
                                return -EINVAL;
                        break;
                default:
                        if (!num)
                                return -EINVAL;
                        switch (ch) {
                        case 'P': o->kvcd_pid = (pid_t)u; break;
                        case 'p': o->processes = (int)u; break;
                        case 'S': o->sessions = (int)u; break;
                        case 'b': o->budget = (uint32_t)u; break;
                        case 'L': o->layers = (uint32_t)u; break;
                        case 'H': o->heads = (uint32_t)u; break;
                        case 'V': o->kv_heads = (uint32_t)u; break;
                        case 'D': o->head_dim = (uint32_t)u; break;
                        case 'M': o->max_tokens = (uint32_t)u; break;
                        case 'r': o->seed = u; break;
                        default: return -EINVAL;
                        }
                }
        }
        if (optind < argc || o->processes < 1 || o->processes > MAX_PROCESSES || o->sessions < 1 ||
            o->sessions > 1024 || !o->layers || !o->heads || !o->kv_heads || o->heads % o->kv_heads ||
            !o->head_dim || o->max_tokens < 2)
                return -EINVAL;
        return 0;
}

static bool read_full(int fd, void *buf, size_t n) {
        uint8_t *p = buf;
        while (n > 0) {
                ssize_t r = read(fd, p, n);
                if (r < 0 && errno == EINTR)
                        continue;
                if (r <= 0)
                        return false;
                p += r;
                n -= (size_t)r;
        }
        return true;
}

int main(int argc, char **argv) {
        struct opts o = { .policy = "window",
                          .dtype_name = "f32",
                          .processes = 16,
                          .sessions = 16,
                          .seconds = 20,
                          .budget = 64,
                          .layers = 5,
                          .heads = 8,
                          .kv_heads = 4,
                          .head_dim = 8,
                          .max_tokens = 512,
                          .dtype = KVC_DTYPE_F32,
                          .seed = 1 };
        if (parse(argc, argv, &o) < 0) {
                usage(stderr);
                return 2;
        }
        struct bench_kvcd sp = { 0 };
        if (o.kvcd) {
                int e = bench_kvcd_start(o.kvcd, -1, &sp);
                if (e < 0) {
                        fprintf(stderr, "kvc-load: cannot start %s: %s\n", o.kvcd, strerror(-e));
                        return 1;
                }
                o.socket = sp.dir;
                o.kvcd_pid = sp.pid;
        } else if (!o.kvcd_pid) {
                o.kvcd_pid = find_kvcd(o.socket);
        }
        bool peak_reset = o.kvcd_pid > 0 && reset_peak(o.kvcd_pid);
        long rss_before = o.kvcd_pid > 0 ? status_kib(o.kvcd_pid, "VmRSS") : -1, rss_max = rss_before;
        long anon_at_max = -1, shmem_at_max = -1; /* kvcd's heap, and the pool pages it touched */

        fflush(NULL);
        pid_t pids[MAX_PROCESSES];
        int fds[MAX_PROCESSES];
        uint64_t start = now_ns(), deadline = start + (uint64_t)(o.seconds * 1e9);
        for (int i = 0; i < o.processes; i++) {
                int pfd[2];
                if (pipe2(pfd, O_CLOEXEC) < 0 || (pids[i] = fork()) < 0) {
                        perror("kvc-load: fork");
                        return 1;
                }
                if (pids[i] == 0) {
                        struct result *r = calloc(1, sizeof(*r));
                        close(pfd[0]);
                        if (r)
                                worker(&o, i, deadline, r);
                        bool ok = r && write(pfd[1], r, sizeof(*r)) == (ssize_t)sizeof(*r);
                        _exit(ok ? 0 : 1);
                }
                close(pfd[1]);
                fds[i] = pfd[0];
        }
        /* sample kvcd's RSS while the workers run (a benchmark may pace itself) */
        while (now_ns() < deadline && o.kvcd_pid > 0) {
                struct pollfd p = { .fd = fds[0], .events = POLLIN };
                if (poll(&p, 1, 100) > 0)
                        break; /* the first worker is done (or failed) */
                long rss = status_kib(o.kvcd_pid, "VmRSS");
                if (rss > rss_max) {
                        rss_max = rss;
                        anon_at_max = status_kib(o.kvcd_pid, "RssAnon");
                        shmem_at_max = status_kib(o.kvcd_pid, "RssShmem");
                }
        }
        struct result total = { 0 }, r;
        int lost = 0;
        for (int i = 0; i < o.processes; i++) {
                int st;
                if (!read_full(fds[i], &r, sizeof(r))) {
                        lost++;
                        memset(&r, 0, sizeof(r));
                        r.errors = 1;
                        snprintf(r.first_error, sizeof(r.first_error), "worker %d died", i);
                }
                close(fds[i]);
                waitpid(pids[i], &st, 0);
                total.steps += r.steps;
                total.flushes += r.flushes;
                total.plans_applied += r.plans_applied;
                total.reopened += r.reopened;
                total.errors += r.errors;
                total.lat_sum_ns += r.lat_sum_ns;
                if (r.lat_max_ns > total.lat_max_ns)
                        total.lat_max_ns = r.lat_max_ns;
                for (int b = 0; b < HIST_BUCKETS; b++)
                        total.hist[b] += r.hist[b];
                if (!total.first_error[0] && r.first_error[0])
                        snprintf(total.first_error, sizeof(total.first_error), "%s", r.first_error);
        }
        double elapsed = (double)(now_ns() - start) / 1e9;
        long hwm = o.kvcd_pid > 0 ? status_kib(o.kvcd_pid, "VmHWM") : -1;
        long rss_after = o.kvcd_pid > 0 ? status_kib(o.kvcd_pid, "VmRSS") : -1;
        if (o.kvcd)
                bench_kvcd_stop(&sp);

        double p50 = hist_quantile(total.hist, total.flushes, 0.50) / 1000.0;
        double p99 = hist_quantile(total.hist, total.flushes, 0.99) / 1000.0;
        double mean = total.flushes ? (double)total.lat_sum_ns / (double)total.flushes / 1e6 : NAN;
        double max = (double)total.lat_max_ns / 1e6;
        if (o.json) {
                printf("{\"processes\":%d,\"sessions_per_process\":%d,\"sessions\":%d,\"policy\":\"%s\","
                       "\"budget\":%u,"
                       "\"layers\":%u,\"heads\":%u,\"kv_heads\":%u,\"head_dim\":%u,\"dtype\":\"%s\","
                       "\"seconds\":%.3f,"
                       "\"session_steps\":%llu,\"steps_per_second\":%.1f,\"flushes\":%llu,\"flushes_per_"
                       "second\":%.1f,"
                       "\"flush_ms\":{\"p50\":%.4f,\"p99\":%.4f,\"mean\":%.4f,\"max\":%.4f},\"plans_"
                       "applied\":%llu,"
                       "\"sessions_reopened\":%llu,\"kvcd_pid\":%d,\"kvcd_rss_kib\":{\"before\":%ld,"
                       "\"after\":%ld,"
                       "\"max_sampled\":%ld,\"anon_at_max\":%ld,\"shmem_at_max\":%ld,\"peak_vmhwm\":%ld,"
                       "\"peak_reset_at_start\":%s},\"errors\":%llu",
                       o.processes, o.sessions, o.processes * o.sessions, o.policy, o.budget, o.layers,
                       o.heads, o.kv_heads, o.head_dim, o.dtype_name, elapsed,
                       (unsigned long long)total.steps, (double)total.steps / elapsed,
                       (unsigned long long)total.flushes, (double)total.flushes / elapsed, p50, p99, mean,
                       max, (unsigned long long)total.plans_applied, (unsigned long long)total.reopened,
                       (int)o.kvcd_pid, rss_before, rss_after, rss_max, anon_at_max, shmem_at_max, hwm,
                       peak_reset ? "true" : "false", (unsigned long long)total.errors);
                if (total.first_error[0]) {
                        printf(",\"first_error\":\"");
                        for (const char *c = total.first_error; *c; c++) {
                                if (*c == '"' || *c == '\\')
                                        putchar('\\');
                                putchar((unsigned char)*c < 0x20 ? '?' : *c);
                        }
                        printf("\"");
                }
                printf("}\n");
        } else {
                printf("kvc-load: %d processes x %d sessions (%s budget %u), %.1f s: %.0f session steps/s "
                       "(%llu steps, %.0f flushes/s), flush round trip p50 %.3f ms p99 %.3f ms max %.3f ms, "
                       "%llu plans applied, kvcd peak RSS %.1f MiB%s, %llu errors\n",
                       o.processes, o.sessions, o.policy, o.budget, elapsed, (double)total.steps / elapsed,
                       (unsigned long long)total.steps, (double)total.flushes / elapsed, p50, p99, max,
                       (unsigned long long)total.plans_applied, hwm > 0 ? (double)hwm / 1024.0 : NAN,
                       hwm < 0      ? " (unknown: --kvcd-pid)"
                       : peak_reset ? ""
                                    : " (since kvcd started)",
                       (unsigned long long)total.errors);
        }
        if (total.errors)
                fprintf(stderr, "kvc-load: %llu errors%s; the first: %s\n", (unsigned long long)total.errors,
                        lost ? " (workers lost)" : "", total.first_error);
        return total.errors ? 1 : 0;
}
