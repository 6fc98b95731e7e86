/* bench-relocate: what it costs a client when kvcd takes a chunk back that still holds its blocks
 * (issue 3: cooperative shrink with relocation, docs/gpu.md).
 *
 * One client holds a session of the full policy whose blocks lie in two chunks, the first with room
 * for all of them (another session there closed), in a 7B-class layout (8 KV heads, head_dim 128,
 * f16: 68 KiB blocks, 30 to a 2 MiB chunk). Both sessions wrote their blocks, as sessions do, so
 * the pool's pages are in memory (a host pool faults pages in on first touch). kvcctl lowers the capacity to
 * one chunk; kvcd sends a plan of block moves unasked; the client's next exchange with kvcd (a Reserve that
 * asks for nothing new) applies it: copies the blocks, swaps its table entries, acknowledges. Timed:
 *
 *   relocation   that exchange, moves applied (until the session's blocks lie in one chunk)
 *   exchange     the same exchange with nothing to move (the round trip alone)
 *   memcpy       the same bytes copied block by block between two warm buffers
 *
 * and, after it, the chunk given back (UNMAP/UNMAPPED) is checked with kvcctl. Each figure is the
 * median of --reps repetitions, alternating; the ratios are relocation over exchange and the
 * relocation's extra time (relocation - exchange) over memcpy.
 *
 * Usage: bench-relocate --kvcd PATH [--reps N] (kvcctl is taken from kvcd's directory)
 */
#define _GNU_SOURCE
#include <errno.h>
#include <getopt.h>
#include <libgen.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common.h"
#include "kvc.h"

#define N_LAYERS 2u
#define MAX_REPS 64

extern char **environ;

static char kvcctl[512];
static struct bench_kvcd kvcd;

static void fail(const char *what, int e, struct kvc_client *c) {
        fprintf(stderr, "bench-relocate: %s: %s (%s)\n", what, strerror(e < 0 ? -e : e), kvc_last_error(c));
        bench_kvcd_stop(&kvcd);
        exit(1);
}

/* Runs kvcctl with args; its standard output in out (may be NULL). */
static void ctl(char *const *args, char *out, size_t cap) {
        char *argv[16] = { kvcctl, "--socket", kvcd.dir };
        int n = 3, pipefd[2];
        for (; *args && n < 15; args++)
                argv[n++] = *args;
        argv[n] = NULL;
        posix_spawn_file_actions_t fa;
        if (pipe(pipefd) < 0)
                fail("pipe", errno, NULL);
        posix_spawn_file_actions_init(&fa);
        posix_spawn_file_actions_adddup2(&fa, pipefd[1], STDOUT_FILENO);
        posix_spawn_file_actions_addclose(&fa, pipefd[0]);
        pid_t pid;
        int r = posix_spawn(&pid, kvcctl, &fa, NULL, argv, environ);
        posix_spawn_file_actions_destroy(&fa);
        close(pipefd[1]);
        if (r != 0)
                fail("kvcctl", r, NULL);
        size_t len = 0;
        char sink[256];
        for (ssize_t m;
             (m = read(pipefd[0], out ? out + len : sink, out ? cap - 1 - len : sizeof(sink))) > 0;)
                len += out ? (size_t)m : 0;
        if (out)
                out[len] = '\0';
        close(pipefd[0]);
        int st;
        if (waitpid(pid, &st, 0) < 0 || !WIFEXITED(st) || WEXITSTATUS(st) != 0)
                fail("kvcctl exited with an error", EIO, NULL);
}

static int chunks_owned(void) {
        char out[4096];
        char *args[] = { "--json", "status", NULL };
        ctl(args, out, sizeof(out));
        const char *p = strstr(out, "\"chunks_in_use\":");
        return p ? atoi(p + strlen("\"chunks_in_use\":")) : -1;
}

static void set_capacity(const char *bytes) {
        char *args[] = { "budget", "set", "--capacity", (char *)bytes, NULL };
        ctl(args, NULL, 0);
}

static int chunks_of(struct kvc_client *c, struct kvc_session *s) {
        uint64_t set = 0;
        for (uint32_t l = 0; l < N_LAYERS; l++) {
                struct kvc_layer_view v;
                kvc_layer_view(s, l, &v);
                for (uint32_t b = 0; b < v.n_blocks; b++)
                        set |= 1ull << ((uint64_t)(v.blocks[b] - (uint8_t *)kvc_pool_base(c)) / (2u << 20) %
                                        64);
        }
        return __builtin_popcountll(set);
}

int main(int argc, char **argv) {
        const char *kvcd_path = NULL;
        int reps = 15;
        static const struct option opts[] = { { "kvcd", required_argument, NULL, 'k' },
                                              { "reps", required_argument, NULL, 'r' },
                                              {} };
        for (int o; (o = getopt_long(argc, argv, "", opts, NULL)) != -1;) {
                if (o == 'k')
                        kvcd_path = optarg;
                else if (o == 'r')
                        reps = atoi(optarg);
                else
                        return 2;
        }
        if (!kvcd_path || reps < 1 || reps > MAX_REPS) {
                fprintf(stderr, "usage: bench-relocate --kvcd PATH [--reps N (1..%d)]\n", MAX_REPS);
                return 2;
        }
        char tmp[512];
        snprintf(tmp, sizeof(tmp), "%s", kvcd_path);
        snprintf(kvcctl, sizeof(kvcctl), "%s/kvcctl", dirname(tmp));
        int cpu_client, cpu_server;
        bench_pick_cpus(&cpu_client, &cpu_server);
        bench_pin(0, cpu_client);
        int r = bench_kvcd_start(kvcd_path, cpu_server, &kvcd);
        if (r < 0)
                fail("starting kvcd", r, NULL);

        double t_reloc[MAX_REPS], t_noop[MAX_REPS], t_copy[MAX_REPS];
        uint64_t moved_blocks = 0, block_bytes = 0;
        struct kvc_session_config cfg = {
                .geometry = { .n_layers = N_LAYERS,
                              .n_heads = 32,
                              .n_kv_heads = 8,
                              .head_dim = 128,
                              .dtype = KVC_DTYPE_F16,
                              .max_tokens = 4096 },
                .policy = "full",
        };
        for (int rep = 0; rep < reps; rep++) {
                struct kvc_options o = { .socket = kvcd.dir, .name = "bench-relocate" };
                struct kvc_client *c = NULL;
                struct kvc_session *first = NULL, *kept = NULL;
                if ((r = kvc_connect(&o, &c)) < 0)
                        fail("kvc_connect", r, NULL);
                if ((r = kvc_session_open(c, &cfg, &first)) < 0 || (r = kvc_session_open(c, &cfg, &kept)) < 0)
                        fail("kvc_session_open", r, c);
                struct kvc_layer_view v;
                kvc_layer_view(first, 0, &v);
                block_bytes = v.block_bytes;
                uint32_t third = (uint32_t)((2u << 20) / v.block_bytes / 3 / N_LAYERS),
                         tokens = 2 * third * 16;
                if ((r = kvc_session_reserve(first, tokens)) < 0 ||
                    (r = kvc_session_reserve(kept, tokens)) < 0)
                        fail("kvc_session_reserve", r, c);
                for (int i = 0; i < 2; i++) { /* both hold KV, as sessions do: their pages are in */
                        struct kvc_session *s = i ? kept : first;
                        for (uint32_t l = 0; l < N_LAYERS; l++) {
                                kvc_layer_view(s, l, &v);
                                for (uint32_t b = 0; b < v.n_blocks; b++)
                                        memset(v.blocks[b], (int)(b + 1), v.block_bytes);
                        }
                }
                if ((r = kvc_session_close(first, NULL)) < 0)
                        fail("kvc_session_close", r, c);
                if (chunks_of(c, kept) != 2)
                        fail("the session's blocks are not in two chunks", EINVAL, c);

                uint64_t t0 = bench_now_ns(); /* the round trip alone */
                if ((r = kvc_session_reserve(kept, tokens)) < 0)
                        fail("exchange", r, c);
                t_noop[rep] = (double)(bench_now_ns() - t0);

                struct kvc_session_stats before, after;
                kvc_session_get_stats(kept, &before);
                set_capacity("2M"); /* kvcd has sent the moves when this returns */
                t0 = bench_now_ns();
                for (int i = 0; i < 100 && chunks_of(c, kept) != 1; i++)
                        if ((r = kvc_session_reserve(kept, tokens)) < 0)
                                fail("exchange with moves", r, c);
                t_reloc[rep] = (double)(bench_now_ns() - t0);
                kvc_session_get_stats(kept, &after);
                uint64_t moved = after.blocks_moved - before.blocks_moved;
                if (chunks_of(c, kept) != 1 || moved == 0)
                        fail("kvcd did not move the blocks", EIO, c);
                moved_blocks = moved;
                for (int i = 0; i < 100 && chunks_owned() != 1; i++) /* UNMAP, UNMAPPED */
                        if ((r = kvc_session_reserve(kept, tokens)) < 0)
                                fail("exchange", r, c);
                if (chunks_owned() != 1)
                        fail("kvcd did not take the emptied chunk back", EIO, c);

                /* the baseline: the same bytes, block by block, between two warm buffers */
                size_t bytes = moved * v.block_bytes;
                uint8_t *src = malloc(bytes), *dst = malloc(bytes);
                if (!src || !dst)
                        fail("malloc", ENOMEM, c);
                memset(src, 1, bytes);
                memset(dst, 2, bytes);
                t0 = bench_now_ns();
                for (uint64_t b = 0; b < moved; b++)
                        memcpy(dst + b * v.block_bytes, src + b * v.block_bytes, v.block_bytes);
                t_copy[rep] = (double)(bench_now_ns() - t0);
                if (dst[bytes - 1] != 1)
                        fail("memcpy", EIO, c);
                free(src);
                free(dst);

                kvc_session_close(kept, NULL);
                kvc_disconnect(c); /* BYE: its chunk is scrubbed at once */
                set_capacity("256M");
        }
        bench_kvcd_stop(&kvcd);

        double reloc = bench_quantile(t_reloc, (size_t)reps, 0.5) / 1e3,
               noop = bench_quantile(t_noop, (size_t)reps, 0.5) / 1e3,
               copy = bench_quantile(t_copy, (size_t)reps, 0.5) / 1e3;
        double mib = (double)(moved_blocks * block_bytes) / (1 << 20);
        printf("relocation, 7B-class blocks (8 x 128, f16: %llu bytes), 2 MiB chunks; median of %d\n",
               (unsigned long long)block_bytes, reps);
        printf("| blocks moved | MiB | relocation us | exchange us | memcpy us | relocation / exchange | "
               "(relocation - exchange) / memcpy |\n");
        printf("|---:|---:|---:|---:|---:|---:|---:|\n");
        printf("| %llu | %.2f | %.0f | %.0f | %.0f | %.2f | %.2f |\n", (unsigned long long)moved_blocks, mib,
               reloc, noop, copy, reloc / noop, (reloc - noop) / copy);
        return 0;
}
