/* test_shrink.c: cooperative shrink end to end (docs/gpu.md), on the host backend: the real kvcd
 * and two libkvc clients in this process, over real sockets.
 *
 * A client that closed its sessions still owns its chunks (empty). When another client's request
 * finds every chunk owned, kvcd asks the owner of the empty ones to give them back (an UNMAP
 * record); libkvc unmaps them at its next exchange with kvcd and acknowledges (UNMAPPED); only
 * then does kvcd scrub them and grant them again. Every wait is a round trip with kvcd.
 *
 * A chunk that still holds blocks is drained first: kvcd sends the owner a plan of block moves
 * (unasked) into the free room of its other chunk, libkvc copies the blocks and swaps its table
 * entries, and the emptied chunk then goes the same way. The moved blocks keep every byte.
 *
 * The request that found no chunk waits (up to 2 s) while kvcd takes one back. Where both clients
 * live in this thread the owner cannot answer while the requester waits, so the request fails
 * after the wait and is retried; a_request_waits_while_kvcd_takes_a_chunk_back puts the owner in
 * another process, where the request is simply answered.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <dirent.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>

#include "block.h"
#include "harness.h"
#include "kvc.h"

#define CHUNK (2u << 20)

static int setup_three_chunks(void **state) {
        const char *extra[] = { "--capacity", "6M", "--chunk-bytes", "2M", NULL };
        return harness_group_start(state, extra);
}

static int setup(void **state) {
        const char *extra[] = { "--capacity", "4M", "--chunk-bytes", "2M", NULL };
        return harness_group_start(state, extra);
}

static struct kvc_client *client(const struct daemon *d, const char *name) {
        struct kvc_options o = { .socket = d->dir, .name = name, .timeout_ms = HARNESS_DEADLINE_MS };
        struct kvc_client *c = NULL;
        assert_int_equal(kvc_connect(&o, &c), 0);
        assert_int_equal(kvc_pool_is_device(c), 0);
        assert_int_equal(kvc_pool_device(c), -1);
        return c;
}

/* One layer of one 1024-dim KV head in F32: blocks of about 128 KiB, 15 to a chunk. */
static struct kvc_session *session(struct kvc_client *c) {
        struct kvc_session_config cfg = {
                .geometry = { .n_layers = 1,
                              .n_heads = 1,
                              .n_kv_heads = 1,
                              .head_dim = 1024,
                              .dtype = KVC_DTYPE_F32,
                              .max_tokens = 1024 },
                .policy = "full",
        };
        struct kvc_session *s = NULL;
        assert_int_equal(kvc_session_open(c, &cfg, &s), 0);
        return s;
}

static long long status_int(const struct daemon *d, const char *key) {
        char *j = harness_kvcctl(d, "status");
        assert_non_null(j);
        long long v = harness_json_int(j, key);
        free(j);
        return v;
}

/* kvcctl audit finds the accounting clean (it exits 1 on a mismatch). */
static void audit_clean(const struct daemon *d) {
        char *audit = harness_kvcctl(d, "audit");
        assert_non_null(audit);
        free(audit);
}

static void kvcd_takes_back_empty_chunks_only_after_the_owner_unmaps_them(void **state) {
        struct daemon *d = *state;
        struct kvc_client *a = client(d, "owner"), *b = client(d, "newcomer");
        struct kvc_session *big = session(a), *idle = session(a);
        struct kvc_layer_view v;

        /* a fills both chunks (16 blocks: 15 in chunk 0, one in chunk 1), marks every byte, closes */
        assert_int_equal(kvc_session_reserve(big, 256), 0);
        assert_int_equal(kvc_layer_view(big, 0, &v), 0);
        assert_int_equal(v.n_blocks, 16);
        uint8_t *base = kvc_pool_base(a);
        assert_int_equal((v.blocks[15] - base) / CHUNK, 1);
        for (uint32_t i = 0; i < v.n_blocks; i++)
                memset(v.blocks[i], 0x5a, v.block_bytes);
        assert_int_equal(kvc_session_close(big, NULL), 0);
        assert_int_equal(status_int(d, "chunks_in_use"), 2); /* empty, still a's */
        assert_int_equal(status_int(d, "used_bytes"), 0);

        /* b finds every chunk owned: refused, and kvcd asks a for the empty ones */
        struct kvc_session *t = session(b);
        assert_int_equal(kvc_session_reserve(t, 16), -ENOSPC);
        assert_int_equal(status_int(d, "chunks_in_use"), 2); /* asked, not given back yet */

        /* a's next exchange with kvcd (one that allocates nothing, or a might take a chunk back
         * itself) handles the request: unmap, acknowledge */
        assert_int_equal(kvc_session_close(idle, NULL), 0);

        /* now b gets one, scrubbed */
        assert_int_equal(kvc_session_reserve(t, 16), 0);
        assert_int_equal(kvc_layer_view(t, 0, &v), 0);
        assert_int_equal(v.n_blocks, 1);
        for (uint64_t i = 0; i < v.block_bytes; i++)
                if (v.blocks[0][i])
                        fail_msg("byte %llu of a chunk given back is 0x%02x: not scrubbed",
                                 (unsigned long long)i, v.blocks[0][i]);
        assert_int_equal(status_int(d, "chunks_in_use"), 1);
        audit_clean(d);

        /* a carries on: a new grant brings it a chunk again, through the side channel */
        struct kvc_session *again = session(a);
        assert_int_equal(kvc_session_reserve(again, 16), 0);
        assert_int_equal(kvc_layer_view(again, 0, &v), 0);
        memset(v.blocks[0], 1, v.block_bytes);
        assert_int_equal(status_int(d, "chunks_in_use"), 2);

        kvc_disconnect(b);
        kvc_disconnect(a);
}

/* A counter's value in kvcctl's metrics (the exposition text, in a JSON string), or -1. */
static long long metric(const char *text, const char *name) {
        char pat[128];
        snprintf(pat, sizeof(pat), "\n%s ", name);
        const char *p = strstr(text, pat);
        if (!p) { /* inside JSON the newline is escaped */
                snprintf(pat, sizeof(pat), "\\n%s ", name);
                p = strstr(text, pat);
        }
        return p ? strtoll(p + strlen(pat), NULL, 10) : -1;
}

static uint32_t chunk_of(const struct kvc_client *c, const uint8_t *block) {
        return (uint32_t)((block - (const uint8_t *)kvc_pool_base(c)) / CHUNK);
}

/* a's session that stays, with 7 blocks in a's first chunk and 7 in its second (chunks 0 and 1 of
 * a pool nobody else uses), every byte marked; the first has room for 8 more blocks (a session
 * that held them closed). Neither chunk is empty. */
static struct kvc_session *fragmented(struct kvc_client *a) {
        struct kvc_session *first = session(a), *kept = session(a);
        struct kvc_layer_view v;
        assert_int_equal(kvc_session_reserve(first, 8 * 16), 0);
        assert_int_equal(kvc_session_reserve(kept, 14 * 16), 0);
        assert_int_equal(kvc_layer_view(kept, 0, &v), 0);
        assert_int_equal(v.n_blocks, 14);
        assert_int_equal(chunk_of(a, v.blocks[6]), chunk_of(a, v.blocks[0]));
        assert_int_equal(chunk_of(a, v.blocks[7]), chunk_of(a, v.blocks[0]) + 1);
        for (uint32_t i = 0; i < v.n_blocks; i++)
                for (uint64_t k = 0; k < v.block_bytes; k++)
                        v.blocks[i][k] = (uint8_t)(i * 31 + k * 7 + 1);
        assert_int_equal(kvc_session_close(first, NULL), 0);
        return kept;
}

/* t, b's session, asks for a block while every chunk is owned, some by a in this same thread:
 * kvcd sets out to take one of a's back, and the request waits for it and fails (a cannot answer
 * while this thread waits); then a's exchanges with kvcd carry the moves (applied, acknowledged)
 * and the UNMAP of the emptied chunk (unmapped, acknowledged), and t's request succeeds once kvcd
 * has the chunk back. */
static void granted_once_a_gives_back(struct kvc_client *b, struct kvc_session *t, struct kvc_session *kept) {
        assert_int_equal(kvc_session_reserve(t, 16), -ENOSPC);
        assert_non_null(strstr(kvc_last_error(b), "waited 2.0 s for memory being taken back"));
        int r = -ENOSPC;
        for (int i = 0; i < 100 && r == -ENOSPC; i++) {
                assert_int_equal(kvc_session_reserve(kept, 14 * 16), 0);
                r = kvc_session_reserve(t, 16);
        }
        assert_int_equal(r, 0);
}

/* t's request for a block once another client's process has ended: kvcd takes in the end on its
 * own time, so it is asked again (each try a round trip) until granted. */
static void granted_after_the_exit(struct kvc_session *t) {
        int r = -ENOSPC;
        for (int i = 0; i < 10000 && r == -ENOSPC; i++)
                r = kvc_session_reserve(t, 16);
        assert_int_equal(r, 0);
}

/* Waits (kvcctl round trips) until kvcd holds n chunks for dead clients' processes. */
static void expect_held(const struct daemon *d, long long n) {
        long long held = -1;
        for (int i = 0; i < 1000 && held != n; i++)
                held = status_int(d, "chunks_held");
        assert_int_equal(held, n);
}

static void kvcd_moves_blocks_out_of_a_chunk_it_wants_back(void **state) {
        struct daemon *d = *state;
        struct kvc_client *a = client(d, "owner"), *b = client(d, "newcomer");
        struct kvc_session *kept = fragmented(a);
        struct kvc_layer_view v;

        /* b finds every chunk owned, and kvcd drains chunk 1, a's second */
        struct kvc_session *t = session(b);
        granted_once_a_gives_back(b, t, kept);

        /* every block of kept is in chunk 0 now, byte for byte what a wrote */
        struct kvc_session_stats st;
        kvc_session_get_stats(kept, &st);
        assert_int_equal(st.blocks_moved, 7);
        assert_int_equal(kvc_layer_view(kept, 0, &v), 0);
        assert_int_equal(v.n_blocks, 14);
        for (uint32_t i = 0; i < v.n_blocks; i++) {
                assert_int_equal(chunk_of(a, v.blocks[i]), 0);
                for (uint64_t k = 0; k < v.block_bytes; k++)
                        if (v.blocks[i][k] != (uint8_t)(i * 31 + k * 7 + 1))
                                fail_msg("block %u byte %llu changed in the move", i, (unsigned long long)k);
        }
        /* b's block is in the chunk a gave back, scrubbed */
        struct kvc_layer_view w;
        assert_int_equal(kvc_layer_view(t, 0, &w), 0);
        assert_int_equal(chunk_of(b, w.blocks[0]), 1);
        for (uint64_t k = 0; k < w.block_bytes; k++)
                if (w.blocks[0][k])
                        fail_msg("byte %llu of the drained chunk is 0x%02x: not scrubbed",
                                 (unsigned long long)k, w.blocks[0][k]);
        assert_int_equal(status_int(d, "chunks_in_use"), 2);
        audit_clean(d);
        char *metrics = harness_kvcctl(d, "metrics");
        assert_non_null(metrics);
        assert_int_equal(metric(metrics, "kvcd_blocks_relocated_total"), 7);
        assert_int_equal(metric(metrics, "kvcd_chunk_drains_total"), 1);
        free(metrics);

        /* a carries on in its one chunk: the moved blocks take new tokens */
        assert_int_equal(kvc_session_reserve(kept, 15 * 16), 0);
        assert_int_equal(kvc_session_close(kept, NULL), 0);
        kvc_disconnect(b);
        kvc_disconnect(a);
}

#define DIM 1024u

/* Token pos's key (value: salt 1), a function of its position only. */
static void row(int32_t pos, int salt, float *out) {
        for (uint32_t j = 0; j < DIM; j++)
                out[j] = salt ? cosf((float)pos * 0.23f + (float)j * 0.07f)
                              : sinf((float)pos * 0.37f + (float)j * 0.11f);
}

/* The window's cache after token `last`: its n slots hold tokens last-n+1..last in order, each
 * key and value exactly as appended. */
static void check_window(struct kvc_session *s, int32_t last) {
        struct kvc_layer_view v;
        struct block_layout lay;
        float want[DIM];
        assert_int_equal(kvc_layer_view(s, 0, &v), 0);
        assert_int_equal(block_layout_init(&lay, v.block_tokens, 1, DIM, BLOCK_DTYPE_F32), 0);
        for (uint32_t i = 0; i < v.n_tokens; i++) {
                uint8_t *b = v.blocks[i / v.block_tokens];
                uint32_t slot = i % v.block_tokens;
                int32_t pos = *(const int32_t *)block_side(&lay, b, lay.pos_offset, 0, slot);
                if (pos != last - (int32_t)v.n_tokens + 1 + (int32_t)i)
                        fail_msg("after token %d, slot %u holds token %d", last, i, pos);
                for (int salt = 0; salt < 2; salt++) {
                        row(pos, salt, want);
                        if (memcmp(salt ? block_value(&lay, b, 0, slot) : block_key(&lay, b, 0, slot), want,
                                   sizeof(want)))
                                fail_msg("after token %d, token %d's %s changed", last, pos,
                                         salt ? "value" : "key");
                }
        }
}

/* A session that generates while its blocks move: plans of moves interleave with its window's
 * compaction plans, and its cache stays exactly what it appended, step after step. */
static void a_generating_session_keeps_its_cache_while_its_blocks_move(void **state) {
        struct daemon *d = *state;
        struct kvc_client *a = client(d, "generator"), *b = client(d, "newcomer");
        struct kvc_session_config cfg = {
                .geometry = { .n_layers = 1,
                              .n_heads = 1,
                              .n_kv_heads = 1,
                              .head_dim = DIM,
                              .dtype = KVC_DTYPE_F32,
                              .max_tokens = 1024 },
                .policy = "window",
                .budget_tokens = 40,
        };
        struct kvc_session *gen = NULL;
        assert_int_equal(kvc_session_open(a, &cfg, &gen), 0); /* its plan buffer: chunk 0 */
        struct kvc_session *filler = session(a);
        assert_int_equal(kvc_session_reserve(filler, 14 * 16), 0); /* the rest of chunk 0 */
        struct kvc_summary sum = { .entropy = 0.5f, .top1_prob = 0.5f, .margin = 1.0f };
        float k[DIM], val[DIM], out[DIM];
        int32_t pos = 0;
        struct kvc_session *t = session(b);
        int granted = -ENOSPC;
        for (int phase = 0; phase < 2; phase++) {
                for (int i = 0; i < 60; i++, pos++) {
                        row(pos, 0, k);
                        row(pos, 1, val);
                        assert_int_equal(kvc_append(gen, 0, pos, k, val), 0);
                        assert_int_equal(kvc_attend(gen, 0, k, out), 0);
                        assert_int_equal(kvc_step(gen, (uint64_t)pos + 1, KVC_PHASE_DECODE, &sum), 0);
                        assert_int_equal(kvc_flush(a), 0);
                        check_window(gen, pos);
                        if (phase == 1 && granted == -ENOSPC) /* b asks again, until kvcd has a chunk */
                                granted = kvc_session_reserve(t, 16);
                }
                if (phase == 0) { /* gen's blocks are all in chunk 1; chunk 0 gets room */
                        struct kvc_layer_view v;
                        assert_int_equal(kvc_layer_view(gen, 0, &v), 0);
                        for (uint32_t i = 0; i < v.n_blocks; i++)
                                assert_int_equal(chunk_of(a, v.blocks[i]), 1);
                        assert_int_equal(kvc_session_close(filler, NULL), 0);
                        assert_int_equal(kvc_session_reserve(t, 16), -ENOSPC); /* the drain starts */
                }
        }
        assert_int_equal(granted, 0);
        struct kvc_session_stats st;
        kvc_session_get_stats(gen, &st);
        assert_true(st.blocks_moved > 0);
        assert_true(st.plans_applied >= 2); /* its window's, and the moves' */
        struct kvc_layer_view v;
        assert_int_equal(kvc_layer_view(gen, 0, &v), 0);
        for (uint32_t i = 0; i < v.n_blocks; i++)
                assert_int_equal(chunk_of(a, v.blocks[i]), 0);
        audit_clean(d);
        kvc_disconnect(b);
        kvc_disconnect(a);
}

/* An operator lowers the capacity below the chunks owned: kvcd moves blocks together and takes
 * the emptied chunk back, and the owner's data stays. */
static void a_lower_capacity_takes_chunks_back(void **state) {
        struct daemon *d = *state;
        struct kvc_client *a = client(d, "owner");
        struct kvc_session *kept = fragmented(a);
        assert_int_equal(status_int(d, "chunks_in_use"), 2);
        const char *argv[] = { harness_bin("kvcctl"), "--socket", d->dir, "budget", "set",
                               "--capacity",          "2M",       NULL };
        char *out = NULL;
        int st;
        assert_int_equal(harness_run(argv, &out, &st), 0);
        free(out);
        assert_true(WIFEXITED(st) && WEXITSTATUS(st) == 0);
        long long in_use = 2; /* a's exchanges carry the moves, then the UNMAP */
        for (int i = 0; i < 100 && in_use == 2; i++) {
                assert_int_equal(kvc_session_reserve(kept, 14 * 16), 0);
                in_use = status_int(d, "chunks_in_use");
        }
        assert_int_equal(in_use, 1);
        struct kvc_layer_view v;
        assert_int_equal(kvc_layer_view(kept, 0, &v), 0);
        for (uint32_t i = 0; i < v.n_blocks; i++) {
                assert_int_equal(chunk_of(a, v.blocks[i]), 0);
                for (uint64_t k = 0; k < v.block_bytes; k++)
                        if (v.blocks[i][k] != (uint8_t)(i * 31 + k * 7 + 1))
                                fail_msg("block %u byte %llu changed in the move", i, (unsigned long long)k);
        }
        /* the capacity holds one chunk now: another client is refused one */
        struct kvc_client *b = client(d, "newcomer");
        struct kvc_session *t = session(b);
        assert_int_equal(kvc_session_reserve(t, 16), -ENOSPC);
        audit_clean(d);
        kvc_disconnect(b);
        kvc_disconnect(a);
}

/* Every byte of kept's blocks is what fragmented() wrote, and they all lie in one chunk. */
static bool intact(struct kvc_client *a, struct kvc_session *kept) {
        struct kvc_layer_view v;
        if (kvc_layer_view(kept, 0, &v) < 0 || v.n_blocks != 14)
                return false;
        for (uint32_t i = 0; i < v.n_blocks; i++) {
                if (chunk_of(a, v.blocks[i]) != chunk_of(a, v.blocks[0]))
                        return false;
                for (uint64_t k = 0; k < v.block_bytes; k++)
                        if (v.blocks[i][k] != (uint8_t)(i * 31 + k * 7 + 1))
                                return false;
        }
        return true;
}

/* Hangs up this process's side channel to kvcd d (the SEQPACKET socket connected to its fd
 * socket) without a BYE, the process staying alive with the pool mapped: what kvcd sees of a
 * client that is dying. */
static int hang_up_side_channel(const struct daemon *d) {
        char want[sizeof(((struct sockaddr_un *)0)->sun_path)];
        snprintf(want, sizeof(want), "%s/kvcd.fd.sock", d->dir);
        DIR *dir = opendir("/proc/self/fd");
        struct dirent *e;
        int found = -1;
        while (dir && (e = readdir(dir))) {
                int fd = atoi(e->d_name), type = 0;
                socklen_t len = sizeof(type);
                struct sockaddr_un peer = { 0 };
                socklen_t plen = sizeof(peer);
                if (fd > 2 && fd != dirfd(dir) && getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &len) == 0 &&
                    type == SOCK_SEQPACKET && getpeername(fd, (struct sockaddr *)&peer, &plen) == 0 &&
                    strcmp(peer.sun_path, want) == 0)
                        found = fd;
        }
        if (dir)
                closedir(dir);
        return found < 0 ? -1 : shutdown(found, SHUT_RDWR);
}

/* A client process of its own: body(d, ready, release) runs in a child, reports one byte on ready
 * ('r': set up) and returns its exit status; release turns readable (closes) when the test lets it
 * go on. */
struct owner {
        pid_t pid;
        int release;
};

static struct owner owner_start(const struct daemon *d, int (*body)(const struct daemon *, int, int)) {
        int ready[2], release[2];
        assert_int_equal(pipe(ready), 0);
        assert_int_equal(pipe(release), 0);
        pid_t pid = fork();
        assert_true(pid >= 0);
        if (pid == 0) {
                close(ready[0]);
                close(release[1]);
                _exit(body(d, ready[1], release[0]));
        }
        close(ready[1]);
        close(release[0]);
        char c = 0;
        assert_int_equal(read(ready[0], &c, 1), 1);
        close(ready[0]);
        assert_int_equal(c, 'r');
        return (struct owner){ .pid = pid, .release = release[1] };
}

/* Lets the owner go on (after a SIGKILL when kill_it) and returns its wait status. */
static int owner_end(struct owner *o, bool kill_it) {
        int status;
        if (kill_it)
                assert_int_equal(kill(o->pid, SIGKILL), 0);
        close(o->release);
        assert_int_equal(waitpid(o->pid, &status, 0), o->pid);
        return status;
}

/* In an owner: reports c, then waits until the test lets it go on. */
static int report_and_wait(int ready, int release, char c) {
        char x;
        if (write(ready, &c, 1) != 1)
                return 1;
        while (read(release, &x, 1) > 0)
                ;
        return 0;
}

/* An owner busy with its own work: exchanges with kvcd until let go, then checks its blocks. */
static int busy_owner(const struct daemon *d, int ready, int release) {
        struct kvc_client *a = client(d, "busy owner");
        struct kvc_session *kept = fragmented(a);
        char c = 'r';
        if (write(ready, &c, 1) != 1)
                return 1;
        struct pollfd p = { .fd = release, .events = POLLIN };
        for (int i = 0; i < 1000000 && poll(&p, 1, 0) == 0; i++)
                if (kvc_session_reserve(kept, 14 * 16) < 0)
                        return 2;
        return intact(a, kept) ? 0 : 3;
}

/* An owner that sets up, then never talks to kvcd again. */
static int stalled_owner(const struct daemon *d, int ready, int release) {
        fragmented(client(d, "stalled owner"));
        return report_and_wait(ready, release, 'r');
}

/* A client holding tokens' worth of blocks (16 tokens a block, 15 blocks a chunk) that hangs up its
 * side channel without a BYE and lives on. */
static int dying_client_of(const struct daemon *d, int ready, int release, uint32_t tokens) {
        struct kvc_session *s = session(client(d, "dying"));
        assert_int_equal(kvc_session_reserve(s, tokens), 0);
        return report_and_wait(ready, release, hang_up_side_channel(d) == 0 ? 'r' : 'x');
}

static int dying_client(const struct daemon *d, int ready, int release) {
        return dying_client_of(d, ready, release, 16 * 16); /* both chunks of a 4M pool */
}

static int dying_client_of_one_chunk(const struct daemon *d, int ready, int release) {
        return dying_client_of(d, ready, release, 16);
}

/* With the owner in another process, busy with its own work, a request that finds no chunk free
 * waits while kvcd takes one back (the owner's blocks moved, its chunk unmapped) and succeeds: the
 * requester never sees ENOSPC. */
static void a_request_waits_while_kvcd_takes_a_chunk_back(void **state) {
        struct daemon *d = *state;
        struct owner o = owner_start(d, busy_owner);
        struct kvc_client *b = client(d, "newcomer");
        struct kvc_session *t = session(b);
        /* waited, then granted; on a machine so loaded that the owner cannot answer within kvcd's
         * 2 s, the request says it waited, and is asked again */
        int r = kvc_session_reserve(t, 16);
        for (int i = 0; i < 10 && r == -ENOSPC; i++) {
                assert_non_null(strstr(kvc_last_error(b), "waited 2.0 s for memory being taken back"));
                r = kvc_session_reserve(t, 16);
        }
        assert_int_equal(r, 0);
        struct kvc_layer_view w;
        assert_int_equal(kvc_layer_view(t, 0, &w), 0);
        assert_int_equal(chunk_of(b, w.blocks[0]), 1);
        int status = owner_end(&o, false);
        assert_true(WIFEXITED(status));
        assert_int_equal(WEXITSTATUS(status), 0); /* its blocks moved into chunk 0, every byte kept */
        audit_clean(d);
        kvc_disconnect(b);
}

/* The owner dies with the moves unapplied: their destinations go back with everything else. */
static void an_owner_that_dies_with_moves_in_flight_loses_nothing_of_anyone_else(void **state) {
        struct daemon *d = *state;
        struct owner o = owner_start(d, stalled_owner);
        struct kvc_client *b = client(d, "newcomer");
        struct kvc_session *t = session(b);
        assert_int_equal(kvc_session_reserve(t, 16), -ENOSPC); /* the drain starts: moves sent */
        char *metrics = harness_kvcctl(d, "metrics");
        assert_non_null(metrics);
        assert_int_equal(metric(metrics, "kvcd_chunk_drains_total"), 1);
        free(metrics);
        audit_clean(d); /* the destinations in flight are accounted for */

        owner_end(&o, true);
        granted_after_the_exit(t);
        assert_int_equal(status_int(d, "chunks_in_use"), 1);
        struct kvc_layer_view w;
        assert_int_equal(kvc_layer_view(t, 0, &w), 0);
        assert_int_equal(status_int(d, "used_bytes"), (long long)w.block_bytes); /* b's one block */
        audit_clean(d);
        kvc_disconnect(b);
}

/* A client whose side channel hangs up without a BYE is taken for dying: its chunks are held
 * (counted against the capacity, granted to nobody) until its process has exited. */
static void a_dead_clients_chunks_wait_for_its_process_to_exit(void **state) {
        struct daemon *d = *state;
        struct owner o = owner_start(d, dying_client);
        struct kvc_client *b = client(d, "newcomer");
        struct kvc_session *t = session(b);
        expect_held(d, 2); /* kvcd handles the hang-up on its own time (its sessions closed) */
        char *metrics = harness_kvcctl(d, "metrics"); /* the metric says so too */
        assert_non_null(metrics);
        assert_non_null(strstr(metrics, "kvcd_pool_chunks{state=\\\"held_for_exit\\\"} 2"));
        free(metrics);
        assert_int_equal(status_int(d, "sessions"), 1); /* b's */
        assert_int_equal(status_int(d, "used_bytes"), 0);
        assert_int_equal(kvc_session_reserve(t, 16), -ENOSPC); /* nothing is granted beside them */

        int status = owner_end(&o, false); /* the process exits */
        assert_true(WIFEXITED(status) && WEXITSTATUS(status) == 0);
        granted_after_the_exit(t);
        assert_int_equal(status_int(d, "chunks_in_use"), 1);
        assert_int_equal(status_int(d, "chunks_held"), 0);
        audit_clean(d);
        kvc_disconnect(b);
}

/* A dead client's empty chunk, held until its process exits, cannot be asked back; kvcd then
 * drains another client's chunk instead of giving up. */
static void a_held_chunk_does_not_stop_a_drain(void **state) {
        struct daemon *d = *state;
        struct owner o = owner_start(d, dying_client_of_one_chunk);
        expect_held(d, 1);
        struct kvc_client *a = client(d, "owner"), *b = client(d, "newcomer");
        struct kvc_session *kept = fragmented(a); /* the two other chunks */
        struct kvc_session *t = session(b);
        /* the held chunk is picked and passed over, and a's second chunk is drained: the request
         * waits for it rather than failing at once */
        granted_once_a_gives_back(b, t, kept);
        assert_true(intact(a, kept));
        assert_int_equal(status_int(d, "chunks_held"), 1);
        int status = owner_end(&o, false);
        assert_true(WIFEXITED(status) && WEXITSTATUS(status) == 0);
        audit_clean(d);
        kvc_disconnect(b);
        kvc_disconnect(a);
}

int main(void) {
        const struct CMUnitTest tests[] = {
                cmocka_unit_test_setup_teardown(kvcd_takes_back_empty_chunks_only_after_the_owner_unmaps_them,
                                                setup, harness_group_stop),
                cmocka_unit_test_setup_teardown(kvcd_moves_blocks_out_of_a_chunk_it_wants_back, setup,
                                                harness_group_stop),
                cmocka_unit_test_setup_teardown(
                        an_owner_that_dies_with_moves_in_flight_loses_nothing_of_anyone_else, setup,
                        harness_group_stop),
                cmocka_unit_test_setup_teardown(a_generating_session_keeps_its_cache_while_its_blocks_move,
                                                setup, harness_group_stop),
                cmocka_unit_test_setup_teardown(a_lower_capacity_takes_chunks_back, setup,
                                                harness_group_stop),
                cmocka_unit_test_setup_teardown(a_dead_clients_chunks_wait_for_its_process_to_exit, setup,
                                                harness_group_stop),
                cmocka_unit_test_setup_teardown(a_request_waits_while_kvcd_takes_a_chunk_back, setup,
                                                harness_group_stop),
                cmocka_unit_test_setup_teardown(a_held_chunk_does_not_stop_a_drain, setup_three_chunks,
                                                harness_group_stop),
        };
        return cmocka_run_group_tests(tests, NULL, NULL);
}
