/* bench-footprint: kvcd's memory footprint (issue 7, item 4).
 *
 * kvcd is started for the run; its resident memory is read from /proc/PID/status: VmRSS, split
 * into RssAnon (kvcd's own heap and stacks) and RssShmem (pool pages kvcd touched through its
 * mapping of the chunks: it reads the score arrays when it plans and writes plan buffers).
 *
 *   idle         right after READY=1
 *   per session  one client opens 64, then 512 sessions (stories260K's geometry, window policy,
 *                budget 64), each stepped 100 steps so that its blocks, grants and first plans
 *                exist; per session = the growth from 64 to 512 over 448 (one-time costs, such as
 *                the plan scratch, cancel out), set against the pool bytes a session holds
 *   steady state 64 sessions stepped in batches, RSS read after each of --checkpoints rounds
 *                of --batches batches (after one round of warm-up); then the 64 sessions closed
 *                and reopened --churn times. Growth from the first reading to the last is what
 *                the target is about: it must not grow with steps.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "kvc.h"

#define LAYERS       5u
#define MAX_TOKENS   512u
#define SESSIONS_MAX 512

struct rss {
        long rss, anon, shmem;
};

static struct rss rss_of(pid_t pid) {
        return (struct rss){ bench_status_kib(pid, "VmRSS"), bench_status_kib(pid, "RssAnon"),
                             bench_status_kib(pid, "RssShmem") };
}

static void fail(const char *what, int e, struct kvc_client *c) {
        fprintf(stderr, "bench-footprint: %s: %s%s%s\n", what, strerror(-e), c ? ": " : "",
                c ? kvc_last_error(c) : "");
        exit(1);
}

static struct kvc_session *open_one(struct kvc_client *c) {
        struct kvc_session_config cfg = {
                .geometry = { .n_layers = LAYERS,
                              .n_heads = 8,
                              .n_kv_heads = 4,
                              .head_dim = 8,
                              .dtype = KVC_DTYPE_F32,
                              .max_tokens = MAX_TOKENS },
                .policy = "window",
                .budget_tokens = 64,
        };
        struct kvc_session *s;
        int e = kvc_session_open(c, &cfg, &s);
        if (e < 0)
                fail("open", e, c);
        return s;
}

static const struct kvc_summary a_summary = { .entropy = 0.5f, .top1_prob = 0.4f, .margin = 1.5f };

/* One batch: a token in every layer of sessions [0, n) and their summaries in one flush. */
static void batch(struct kvc_client *c, struct kvc_session **s, uint64_t *step, int n) {
        int e = 0;
        for (int i = 0; i < n; i++) {
                for (uint32_t l = 0; l < LAYERS && e == 0; l++)
                        e = kvc_append_slots(s[i], l, 1);
                if (e < 0 || (e = kvc_step(s[i], step[i]++, KVC_PHASE_DECODE, &a_summary)) < 0)
                        fail("step", e, c);
        }
        if ((e = kvc_flush(c)) < 0)
                fail("flush", e, c);
}

int main(int argc, char **argv) {
        const char *kvcd = NULL;
        int checkpoints = 5, batches = 2000, churn = 20;
        bool json = false;
        static const struct option lo[] = {
                { "kvcd", required_argument, NULL, 'k' },
                { "checkpoints", required_argument, NULL, 'c' },
                { "batches", required_argument, NULL, 'b' },
                { "churn", required_argument, NULL, 'r' },
                { "json", no_argument, NULL, 'j' },
                { "help", no_argument, NULL, 'h' },
                {},
        };
        int ch;
        while ((ch = getopt_long(argc, argv, "h", lo, NULL)) != -1) {
                switch (ch) {
                case 'k': kvcd = optarg; break;
                case 'c': checkpoints = atoi(optarg); break;
                case 'b': batches = atoi(optarg); break;
                case 'r': churn = atoi(optarg); break;
                case 'j': json = true; break;
                case 'h':
                        printf("Usage: bench-footprint --kvcd PATH [--checkpoints N] [--batches N] [--churn "
                               "N] "
                               "[--json]\n");
                        return 0;
                default: return 2;
                }
        }
        if (!kvcd || checkpoints < 2 || batches < 1 || churn < 0) {
                fprintf(stderr, "bench-footprint: bad arguments (--help)\n");
                return 2;
        }
        int cpu_client, cpu_server;
        bench_pick_cpus(&cpu_client, &cpu_server);
        bench_pin(0, cpu_client);
        struct bench_kvcd kd = { 0 };
        int e = bench_kvcd_start(kvcd, cpu_server, &kd);
        if (e < 0)
                fail("starting kvcd", e, NULL);
        struct rss idle = rss_of(kd.pid);

        struct kvc_options ko = { .socket = kd.dir, .name = "bench-footprint" };
        struct kvc_client *c = NULL;
        if ((e = kvc_connect(&ko, &c)) < 0)
                fail("connect", e, NULL);
        static struct kvc_session *s[SESSIONS_MAX];
        static uint64_t step[SESSIONS_MAX];
        struct rss at[2];
        uint64_t pool_bytes[2] = { 0, 0 };
        const int counts[2] = { 64, SESSIONS_MAX };
        int open = 0;
        for (int m = 0; m < 2; m++) {
                for (; open < counts[m]; open++)
                        s[open] = open_one(c);
                for (int w = 0; w < 100; w++)
                        batch(c, s, step, open);
                at[m] = rss_of(kd.pid);
                for (int i = 0; i < open; i++)
                        for (uint32_t l = 0; l < LAYERS; l++) {
                                struct kvc_layer_view v;
                                if (kvc_layer_view(s[i], l, &v) == 0)
                                        pool_bytes[m] +=
                                                v.n_blocks * v.block_bytes + v.n_q8_blocks * v.q8_block_bytes;
                        }
        }
        for (int i = 64; i < SESSIONS_MAX; i++)
                kvc_session_close(s[i], NULL);
        double per_rss = (double)(at[1].rss - at[0].rss) * 1024.0 / (SESSIONS_MAX - 64);
        double per_anon = (double)(at[1].anon - at[0].anon) * 1024.0 / (SESSIONS_MAX - 64);
        double per_shmem = (double)(at[1].shmem - at[0].shmem) * 1024.0 / (SESSIONS_MAX - 64);
        double per_pool = (double)(pool_bytes[1] - pool_bytes[0]) / (SESSIONS_MAX - 64);

        /* steady state */
        struct rss *cp = calloc((size_t)checkpoints + 1, sizeof(*cp));
        uint64_t steps_done = 0;
        for (int r = 0; r <= checkpoints; r++) { /* round 0 warms up */
                for (int b = 0; b < batches; b++)
                        batch(c, s, step, 64);
                steps_done += (uint64_t)batches * 64;
                cp[r] = rss_of(kd.pid);
        }
        for (int r = 0; r < churn; r++) {
                for (int i = 0; i < 64; i++) {
                        kvc_session_close(s[i], NULL);
                        s[i] = open_one(c);
                        step[i] = 0;
                }
                for (int w = 0; w < 40; w++)
                        batch(c, s, step, 64);
        }
        struct rss after_churn = rss_of(kd.pid);
        long hwm = bench_status_kib(kd.pid, "VmHWM");
        for (int i = 0; i < 64; i++)
                kvc_session_close(s[i], NULL);
        kvc_disconnect(c);
        bench_kvcd_stop(&kd);

        long growth = cp[checkpoints].rss - cp[1].rss, growth_anon = cp[checkpoints].anon - cp[1].anon;
        if (json) {
                printf("{\"idle_kib\":{\"rss\":%ld,\"anon\":%ld,\"shmem\":%ld},\"per_session_bytes\":{"
                       "\"rss\":%.0f,"
                       "\"anon\":%.0f,\"shmem\":%.0f,\"pool\":%.0f},\"steady_kib\":[",
                       idle.rss, idle.anon, idle.shmem, per_rss, per_anon, per_shmem, per_pool);
                for (int r = 1; r <= checkpoints; r++)
                        printf("%s%ld", r > 1 ? "," : "", cp[r].rss);
                printf("],\"steady_growth_kib\":%ld,\"after_churn_kib\":%ld,\"vmhwm_kib\":%ld}\n", growth,
                       after_churn.rss, hwm);
                return 0;
        }
        printf("4. kvcd's footprint (KiB; anon = kvcd's heap, shmem = pool pages kvcd has touched)\n");
        printf("| state | VmRSS | RssAnon | RssShmem |\n|---|---:|---:|---:|\n");
        printf("| idle, after READY=1 | %ld | %ld | %ld |\n", idle.rss, idle.anon, idle.shmem);
        printf("| 64 sessions, 100 steps each | %ld | %ld | %ld |\n", at[0].rss, at[0].anon, at[0].shmem);
        printf("| 512 sessions, 100 steps each | %ld | %ld | %ld |\n", at[1].rss, at[1].anon, at[1].shmem);
        for (int r = 1; r <= checkpoints; r++)
                printf("| 64 sessions, after %llu summaries | %ld | %ld | %ld |\n",
                       (unsigned long long)((uint64_t)(r + 1) * batches * 64), cp[r].rss, cp[r].anon,
                       cp[r].shmem);
        printf("| after %d rounds of closing and reopening the 64 | %ld | %ld | %ld |\n", churn,
               after_churn.rss, after_churn.anon, after_churn.shmem);
        printf("per session (64 -> 512): %.0f bytes of RSS (%.0f heap, %.0f pool pages touched) for %.0f "
               "pool bytes "
               "of KV blocks held: %.3f of them\n",
               per_rss, per_anon, per_shmem, per_pool, per_rss / per_pool);
        printf("steady state: %llu summaries after warm-up, RSS %ld -> %ld KiB (%+ld KiB, heap %+ld KiB; "
               "ratio "
               "%.3f)\n",
               (unsigned long long)(steps_done - (uint64_t)batches * 64), cp[1].rss, cp[checkpoints].rss,
               growth, growth_anon, (double)cp[checkpoints].rss / (double)cp[1].rss);
        printf("target: steady state does not grow with steps: %s\n",
               growth_anon <= 0 && growth <= 4 ? "HOLDS" : "DOES NOT HOLD");
        return 0;
}
