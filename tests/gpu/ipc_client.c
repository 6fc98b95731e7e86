/* ipc_client.c: kvc-ipc-client, a client process of tests/gpu/ipc.sh: it maps kvcd's GPU pool
 * through libkvc, writes and reads back KV with cudaMemcpy, and applies kvcd's plans with the CUDA
 * compaction kernel (kvc_cuda_compact_mixed) as libkvc's compactor.
 *
 * Roles (--role):
 *   survivor  phase 1: fills one session of 2 layers x 2 KV heads x head_dim 64 (F32) token by
 *             token under the window policy (budget 32), so kvcd plans from the positions it reads
 *             off the GPU; checks every token's key and value after every plan (they moved with
 *             their positions, and the newest token is still last); prints "PHASE1 ok" and the
 *             timings, then waits for a line on stdin; phase 2 (after the victim died): the data
 *             is intact, 24 more tokens and plans, "DONE ok".
 *   victim    fills a session with a marker pattern, prints "READY chunks=I,J,..." (the chunks
 *             its blocks and plan buffer lie in) and waits on stdin to be killed.
 *   checker   --chunks I,J,...: opens a session and reserves room until it holds a chunk of that
 *             list (a dead client's, scrubbed and granted again), then reads that whole chunk
 *             back: every byte must be zero. Prints "REUSED chunk I: N bytes, all zero".
 *   mover     holds a session of the full policy whose blocks lie in two chunks, the first with
 *             room for all of them (another session there closed), each block filled with its own
 *             byte; prints "READY blocks=N"; then, for every line on stdin, makes one exchange
 *             with kvcd and answers "EXCHANGED in=K" (the chunks its blocks lie in), so that the
 *             script can lower kvcd's capacity and watch kvcd move the blocks together (plans of
 *             block moves, copied on the device by libkvc) and take the emptied chunk back; at EOF
 *             it checks every block's bytes and prints "MOVED M blocks, all intact".
 *
 * Timings printed (microseconds, one run): connect (driver load, primary context, the pool's
 * address range), session open (the first chunk imported and mapped), grant (Reserve -> Grant
 * with the chunk map when one comes), plan round trip (StepBatch -> kvcd reads the positions off
 * the GPU and writes the plan into it -> PlanBatch -> libkvc checks a copy -> GPU compaction ->
 * PlanApplied sent).
 *
 * Built twice by kernels/cuda.mk: with the CUDA kernels and the static CUDA runtime (`make cuda`),
 * and with the emulated kernels (tests/gpu/emu) for `ipc.sh --fake`, where the driver libkvc and
 * kvcd load is tests/gpu/fakecuda.c and device memory is host memory.
 */
#define _GNU_SOURCE
#include <cuda_runtime_api.h>
#include <errno.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "block.h"
#include "cuda.h"
#include "kvc.h"
#include "mixed.h"

#define N_LAYERS  2u
#define N_HEADS   4u
#define N_KV      2u
#define HEAD_DIM  64u
#define BUDGET    32u
#define MAX_TIMES 256

static const char *role = "client";

#define DIE(...)                                                                                             \
        do {                                                                                                 \
                fprintf(stderr, "[%s] FAIL: ", role);                                                        \
                fprintf(stderr, __VA_ARGS__);                                                                \
                fputc('\n', stderr);                                                                         \
                exit(1);                                                                                     \
        } while (0)

#define CK(x)                                                                                                \
        do {                                                                                                 \
                cudaError_t e_ = (x);                                                                        \
                if (e_ != cudaSuccess)                                                                       \
                        DIE("%s:%d: %s: %s", __FILE__, __LINE__, #x, cudaGetErrorString(e_));                \
        } while (0)

#define KV(c, x)                                                                                             \
        do {                                                                                                 \
                int r_ = (x);                                                                                \
                if (r_ < 0)                                                                                  \
                        DIE("%s:%d: %s: %s (%s)", __FILE__, __LINE__, #x, strerror(-r_), kvc_last_error(c)); \
        } while (0)

static uint64_t now_usec(void) {
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        return (uint64_t)ts.tv_sec * 1000000u + (uint64_t)ts.tv_nsec / 1000u;
}

struct times {
        uint64_t v[MAX_TIMES];
        int n;
};

static void note(struct times *t, uint64_t usec) {
        if (t->n < MAX_TIMES)
                t->v[t->n++] = usec;
}

static int cmp_u64(const void *a, const void *b) {
        uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
        return x < y ? -1 : x > y;
}

static uint64_t median(struct times *t) {
        if (!t->n)
                return 0;
        qsort(t->v, (size_t)t->n, sizeof(t->v[0]), cmp_u64);
        return t->v[t->n / 2];
}

/* The key of (layer, head, element d) of the token at position pos; values are its negation, so a
 * row that lands in the wrong place, or a key swapped with a value, is seen. */
static float key_of(float marker, uint32_t layer, int32_t pos, uint32_t h, uint32_t d) {
        return marker + (float)pos * 1000.0f + (float)layer * 500.0f + (float)h * 100.0f + (float)d;
}

struct ctx {
        struct kvc_client *c;
        struct kvc_session *s;
        struct block_layout fp, q8;
        uint8_t **d_fp, **d_q8; /* device copies of the block tables */
        uint32_t *d_keep;
        void *ws;
        size_t ws_bytes;
        uint32_t max_blocks;
        float marker;
        int32_t next_pos;
        struct times grant, plan;
        uint64_t plans_seen;       /* plans applied, as libkvc counts them */
        uint64_t layers_compacted; /* compactor calls */
};

/* libkvc's compactor: one layer of a checked plan, compacted on the GPU. */
static int compact(void *arg, struct kvc_session *s, const struct kvc_compaction *job) {
        struct ctx *x = arg;
        (void)s;
        if (job->summary_slot || job->view.n_blocks > x->max_blocks || job->view.n_q8_blocks > x->max_blocks)
                return -ENOTSUP;
        CK(cudaMemcpy(x->d_fp, job->view.blocks, job->view.n_blocks * sizeof(uint8_t *),
                      cudaMemcpyHostToDevice));
        if (job->view.n_q8_blocks)
                CK(cudaMemcpy(x->d_q8, job->view.q8_blocks, job->view.n_q8_blocks * sizeof(uint8_t *),
                              cudaMemcpyHostToDevice));
        uint32_t n_keep = job->keep_count * (job->per_head ? N_KV : 1u);
        CK(cudaMemcpy(x->d_keep, job->keep, (size_t)n_keep * sizeof(uint32_t), cudaMemcpyHostToDevice));
        struct mixed_layer M = { .fp = &x->fp,
                                 .q8 = &x->q8,
                                 .fp_blocks = x->d_fp,
                                 .n_fp_blocks = job->view.n_blocks,
                                 .q8_blocks = x->d_q8,
                                 .n_q8_blocks = job->view.n_q8_blocks,
                                 .n_q8 = job->view.n_q8,
                                 .n_tokens = job->view.n_tokens };
        uint32_t n_tokens = 0;
        int r = kvc_cuda_compact_mixed(&M, x->d_keep, job->keep_count, job->per_head, job->base_tokens,
                                       job->q8_tokens, x->ws, x->ws_bytes, NULL, &n_tokens);
        if (r < 0)
                return r;
        CK(cudaStreamSynchronize(NULL)); /* done before PlanApplied lets kvcd reuse freed blocks */
        int32_t status = 0;
        CK(cudaMemcpy(&status, x->ws, sizeof(status), cudaMemcpyDeviceToHost));
        if (status != 0 || n_tokens != job->new_tokens)
                return status ? status : -EPROTO;
        x->layers_compacted++;
        return 0;
}

static void ctx_init(struct ctx *x, float marker) {
        x->marker = marker;
        if (block_layout_init(&x->fp, 16, N_KV, HEAD_DIM, BLOCK_DTYPE_F32) < 0 ||
            block_layout_init(&x->q8, 16, N_KV, HEAD_DIM, BLOCK_DTYPE_Q8) < 0)
                DIE("block layouts");
        x->max_blocks = 1024 / 16 + 1;
        CK(cudaMalloc((void **)&x->d_fp, x->max_blocks * sizeof(uint8_t *)));
        CK(cudaMalloc((void **)&x->d_q8, x->max_blocks * sizeof(uint8_t *)));
        CK(cudaMalloc((void **)&x->d_keep, (size_t)x->max_blocks * 16 * N_KV * sizeof(uint32_t)));
        struct mixed_layer probe = { .fp = &x->fp,
                                     .q8 = &x->q8,
                                     .n_fp_blocks = x->max_blocks,
                                     .n_q8_blocks = x->max_blocks,
                                     .n_tokens = x->max_blocks * 16 };
        x->ws_bytes = kvc_cuda_compact_workspace_bytes(&probe);
        CK(cudaMalloc(&x->ws, x->ws_bytes));
}

static void ctx_done(struct ctx *x) {
        cudaFree(x->d_fp);
        cudaFree(x->d_q8);
        cudaFree(x->d_keep);
        cudaFree(x->ws);
}

static void connect_and_open(struct ctx *x, const char *sock, uint64_t *ret_connect, uint64_t *ret_open) {
        struct kvc_options o = { .socket = sock, .name = role, .timeout_ms = 30000 };
        uint64_t t0 = now_usec();
        int r = kvc_connect(&o, &x->c);
        if (r < 0)
                DIE("kvc_connect: %s (%s)", strerror(-r), kvc_last_error(NULL));
        *ret_connect = now_usec() - t0;
        if (!kvc_pool_is_device(x->c))
                DIE("kvcd does not serve GPU memory (start it with --backend cuda)");
        CK(cudaSetDevice(kvc_pool_device(x->c)));
        kvc_set_compactor(x->c, compact, x);
        struct kvc_session_config cfg = {
                .geometry = { .n_layers = N_LAYERS,
                              .n_heads = N_HEADS,
                              .n_kv_heads = N_KV,
                              .head_dim = HEAD_DIM,
                              .dtype = KVC_DTYPE_F32,
                              .max_tokens = 1024 },
                .policy = "window",
                .budget_tokens = BUDGET,
        };
        t0 = now_usec();
        KV(x->c, kvc_session_open(x->c, &cfg, &x->s));
        *ret_open = now_usec() - t0;
        float k[N_KV * HEAD_DIM] = { 0 };
        if (kvc_append(x->s, 0, 0, k, k) != -ENOTSUP)
                DIE("kvc_append on a GPU pool did not answer -ENOTSUP");
}

/* Appends one token (position next_pos) to every layer, written with cudaMemcpy, and steps. */
static void add_token(struct ctx *x) {
        int32_t pos = x->next_pos++;
        float row[HEAD_DIM], neg[HEAD_DIM], zero = 0.0f;
        for (uint32_t l = 0; l < N_LAYERS; l++) {
                struct kvc_layer_view v;
                KV(x->c, kvc_layer_view(x->s, l, &v));
                uint32_t blocks = v.n_blocks;
                uint64_t t0 = now_usec();
                KV(x->c, kvc_append_slots(x->s, l, 1));
                KV(x->c, kvc_layer_view(x->s, l, &v));
                if (v.n_blocks > blocks) /* blocks were reserved: a Reserve -> Grant round trip */
                        note(&x->grant, now_usec() - t0);
                uint32_t slot = v.n_tokens - 1 - v.n_q8;
                uint8_t *b = v.blocks[slot / 16];
                for (uint32_t h = 0; h < N_KV; h++) {
                        for (uint32_t d = 0; d < HEAD_DIM; d++) {
                                row[d] = key_of(x->marker, l, pos, h, d);
                                neg[d] = -row[d];
                        }
                        CK(cudaMemcpy(block_key(&x->fp, b, h, slot % 16), row, sizeof(row),
                                      cudaMemcpyHostToDevice));
                        CK(cudaMemcpy(block_value(&x->fp, b, h, slot % 16), neg, sizeof(neg),
                                      cudaMemcpyHostToDevice));
                        CK(cudaMemcpy(block_side(&x->fp, b, x->fp.pos_offset, h, slot % 16), &pos, 4,
                                      cudaMemcpyHostToDevice));
                        const uint64_t scores[] = { x->fp.sum_offset, x->fp.ema_offset, x->fp.last_offset,
                                                    x->fp.logw_offset };
                        for (int i = 0; i < 4; i++)
                                CK(cudaMemcpy(block_side(&x->fp, b, scores[i], h, slot % 16), &zero, 4,
                                              cudaMemcpyHostToDevice));
                }
        }
        CK(cudaStreamSynchronize(NULL)); /* kvcd reads the positions when it plans */
        struct kvc_summary sum = { .entropy = 0.5f, .top1_prob = 0.5f, .margin = 1.0f };
        KV(x->c, kvc_step(x->s, (uint64_t)pos + 1, KVC_PHASE_DECODE, &sum));
        struct kvc_session_stats st;
        kvc_session_get_stats(x->s, &st);
        uint64_t plans = st.plans_applied, t0 = now_usec();
        KV(x->c, kvc_flush(x->c));
        kvc_session_get_stats(x->s, &st);
        if (st.plans_applied > plans)
                note(&x->plan, now_usec() - t0);
        x->plans_seen = st.plans_applied;
}

/* Reads every token of every layer back: keys and values match their positions, positions
 * ascend, and the newest token is last. */
static void verify(struct ctx *x) {
        float row[HEAD_DIM], val[HEAD_DIM];
        for (uint32_t l = 0; l < N_LAYERS; l++) {
                struct kvc_layer_view v;
                KV(x->c, kvc_layer_view(x->s, l, &v));
                if (v.n_q8)
                        DIE("layer %u holds INT8 tokens; the window policy keeps none", l);
                for (uint32_t h = 0; h < N_KV; h++) {
                        int32_t prev = -1, pos = -1;
                        for (uint32_t slot = 0; slot < v.n_tokens; slot++) {
                                uint8_t *b = v.blocks[slot / 16];
                                CK(cudaMemcpy(&pos, block_side(&x->fp, b, x->fp.pos_offset, h, slot % 16), 4,
                                              cudaMemcpyDeviceToHost));
                                CK(cudaMemcpy(row, block_key(&x->fp, b, h, slot % 16), sizeof(row),
                                              cudaMemcpyDeviceToHost));
                                CK(cudaMemcpy(val, block_value(&x->fp, b, h, slot % 16), sizeof(val),
                                              cudaMemcpyDeviceToHost));
                                if (pos <= prev)
                                        DIE("layer %u head %u slot %u: position %d after %d", l, h, slot, pos,
                                            prev);
                                for (uint32_t d = 0; d < HEAD_DIM; d++)
                                        if (row[d] != key_of(x->marker, l, pos, h, d) || val[d] != -row[d])
                                                DIE("layer %u head %u slot %u (position %d): element %u is "
                                                    "%g/%g",
                                                    l, h, slot, pos, d, row[d], val[d]);
                                prev = pos;
                        }
                        if (v.n_tokens && prev != x->next_pos - 1)
                                DIE("layer %u head %u: the newest position is %d, not %d", l, h, prev,
                                    x->next_pos - 1);
                }
        }
}

static void wait_for_line(void) {
        char line[64];
        if (!fgets(line, sizeof(line), stdin))
                DIE("stdin closed");
}

static int run_survivor(const char *sock) {
        struct ctx x = { 0 };
        uint64_t t_connect, t_open;
        ctx_init(&x, 0.25f);
        connect_and_open(&x, sock, &t_connect, &t_open);
        for (uint32_t n = 16; n <= 48; n += 16) { /* room for the first tokens: one block per layer each */
                uint64_t t0 = now_usec();
                KV(x.c, kvc_session_reserve(x.s, n));
                note(&x.grant, now_usec() - t0);
        }
        for (int i = 0; i < 80; i++) {
                uint64_t plans = x.plans_seen;
                add_token(&x);
                if (x.plans_seen > plans || i % 16 == 0)
                        verify(&x);
        }
        verify(&x);
        if (x.plans_seen < 2)
                DIE("only %llu plans in 80 tokens with a window of %u", (unsigned long long)x.plans_seen,
                    BUDGET);
        printf("[survivor] %llu plans applied (%llu layers compacted on the GPU), %u tokens per layer held, "
               "every token's KV intact\n",
               (unsigned long long)x.plans_seen, (unsigned long long)x.layers_compacted,
               kvc_layer_tokens(x.s, 0));
        printf("[survivor] timings: connect %llu us (driver, context, address range), session open %llu us "
               "(first chunk imported and mapped), grant median %llu us (%d), plan round trip median %llu us "
               "(%d)\n",
               (unsigned long long)t_connect, (unsigned long long)t_open,
               (unsigned long long)median(&x.grant), x.grant.n, (unsigned long long)median(&x.plan),
               x.plan.n);
        printf("PHASE1 ok\n");
        fflush(stdout);
        wait_for_line();
        verify(&x); /* nothing of ours moved while the victim died and its chunks were scrubbed */
        for (int i = 0; i < 24; i++)
                add_token(&x);
        verify(&x);
        struct kvc_session_stats st;
        KV(x.c, kvc_session_close(x.s, &st));
        kvc_disconnect(x.c);
        ctx_done(&x);
        printf("[survivor] after the victim's death: data intact, %llu plans in all, peak %llu bytes\n",
               (unsigned long long)x.plans_seen, (unsigned long long)st.peak_bytes);
        printf("DONE ok\n");
        return 0;
}

static uint64_t chunk_of(const struct ctx *x, const void *p, uint64_t chunk_bytes) {
        return (uint64_t)((const uint8_t *)p - (const uint8_t *)kvc_pool_base(x->c)) / chunk_bytes;
}

static int run_victim(const char *sock, uint64_t chunk_bytes) {
        struct ctx x = { 0 };
        uint64_t t_connect, t_open;
        ctx_init(&x, 7777.0f);
        connect_and_open(&x, sock, &t_connect, &t_open);
        for (int i = 0; i < 40; i++) /* under the window's trigger: no plan, every block full of data */
                add_token(&x);
        verify(&x);
        /* every byte of its blocks' unused slots too, so a chunk that is not scrubbed shows */
        for (uint32_t l = 0; l < N_LAYERS; l++) {
                struct kvc_layer_view v;
                KV(x.c, kvc_layer_view(x.s, l, &v));
                for (uint32_t t = v.n_tokens; t < v.n_blocks * 16; t++)
                        for (uint32_t h = 0; h < N_KV; h++)
                                CK(cudaMemset(block_key(&x.fp, v.blocks[t / 16], h, t % 16), 0xab,
                                              HEAD_DIM * 4));
        }
        CK(cudaStreamSynchronize(NULL));
        printf("READY chunks=");
        uint64_t seen[64];
        int n = 0;
        for (uint32_t l = 0; l < N_LAYERS; l++) {
                struct kvc_layer_view v;
                KV(x.c, kvc_layer_view(x.s, l, &v));
                for (uint32_t b = 0; b < v.n_blocks; b++) {
                        uint64_t ch = chunk_of(&x, v.blocks[b], chunk_bytes);
                        bool dup = false;
                        for (int i = 0; i < n; i++)
                                dup |= seen[i] == ch;
                        if (!dup && n < 64) {
                                printf("%s%llu", n ? "," : "", (unsigned long long)ch);
                                seen[n++] = ch;
                        }
                }
        }
        printf("\n");
        fflush(stdout);
        wait_for_line(); /* killed here */
        kvc_disconnect(x.c);
        return 0;
}

static int run_checker(const char *sock, const char *chunks, uint64_t chunk_bytes) {
        struct ctx x = { 0 };
        uint64_t t_connect, t_open, want[64];
        int n_want = 0;
        for (const char *p = chunks; *p && n_want < 64;) {
                char *end;
                want[n_want++] = strtoull(p, &end, 10);
                p = *end == ',' ? end + 1 : end;
                if (end == p && *p)
                        DIE("bad --chunks %s", chunks);
        }
        if (!n_want)
                DIE("--chunks names no chunk");
        ctx_init(&x, 0.0f);
        connect_and_open(&x, sock, &t_connect, &t_open);
        /* room for more and more tokens until a block lies in one of the dead client's chunks */
        int64_t hit = -1;
        for (uint32_t tokens = 16; hit < 0 && tokens <= 1024; tokens += 16) {
                KV(x.c, kvc_session_reserve(x.s, tokens));
                for (uint32_t l = 0; l < N_LAYERS && hit < 0; l++) {
                        struct kvc_layer_view v;
                        KV(x.c, kvc_layer_view(x.s, l, &v));
                        for (uint32_t b = 0; b < v.n_blocks && hit < 0; b++)
                                for (int i = 0; i < n_want; i++)
                                        if (chunk_of(&x, v.blocks[b], chunk_bytes) == want[i])
                                                hit = (int64_t)want[i];
                }
        }
        if (hit < 0)
                DIE("no block in chunks %s was granted", chunks);
        uint8_t *host = malloc(chunk_bytes);
        if (!host)
                DIE("out of memory");
        CK(cudaMemcpy(host, (uint8_t *)kvc_pool_base(x.c) + (uint64_t)hit * chunk_bytes, chunk_bytes,
                      cudaMemcpyDeviceToHost));
        for (uint64_t i = 0; i < chunk_bytes; i++)
                if (host[i])
                        DIE("chunk %lld, granted again, has byte 0x%02x at %llu: not scrubbed",
                            (long long)hit, host[i], (unsigned long long)i);
        printf("REUSED chunk %lld: %llu bytes, all zero (connect %llu us, open %llu us)\n", (long long)hit,
               (unsigned long long)chunk_bytes, (unsigned long long)t_connect, (unsigned long long)t_open);
        free(host);
        KV(x.c, kvc_session_close(x.s, NULL));
        kvc_disconnect(x.c);
        ctx_done(&x);
        return 0;
}

/* The chunks the session's blocks lie in (a bitmap of the first 64). */
static uint64_t chunks_in_use(const struct ctx *x, struct kvc_session *s, uint64_t chunk_bytes) {
        uint64_t set = 0;
        for (uint32_t l = 0; l < N_LAYERS; l++) {
                struct kvc_layer_view v;
                KV(x->c, kvc_layer_view(s, l, &v));
                for (uint32_t b = 0; b < v.n_blocks; b++)
                        set |= 1ull << (chunk_of(x, v.blocks[b], chunk_bytes) % 64);
        }
        return set;
}

static int run_mover(const char *sock, uint64_t chunk_bytes) {
        struct ctx x = { 0 };
        uint64_t t_connect, t_open;
        ctx_init(&x, 0.0f);
        connect_and_open(&x, sock, &t_connect, &t_open); /* its window session: closed at once */
        KV(x.c, kvc_session_close(x.s, NULL));
        struct kvc_session_config cfg = {
                .geometry = { .n_layers = N_LAYERS,
                              .n_heads = N_HEADS,
                              .n_kv_heads = N_KV,
                              .head_dim = HEAD_DIM,
                              .dtype = KVC_DTYPE_F32,
                              .max_tokens = 4096 },
                .policy = "full",
        };
        struct kvc_session *first, *kept;
        KV(x.c, kvc_session_open(x.c, &cfg, &first));
        KV(x.c, kvc_session_open(x.c, &cfg, &kept));
        struct kvc_layer_view v;
        KV(x.c, kvc_layer_view(first, 0, &v));
        uint32_t per_chunk = (uint32_t)(chunk_bytes / v.block_bytes), third = per_chunk / 3 / N_LAYERS;
        /* first: two thirds of a chunk; kept: the last third, and as much again in the next chunk */
        KV(x.c, kvc_session_reserve(first, 2 * third * 16));
        KV(x.c, kvc_session_reserve(kept, 2 * third * 16));
        if (__builtin_popcountll(chunks_in_use(&x, kept, chunk_bytes)) != 2)
                DIE("the kept session's blocks are not in two chunks");
        uint32_t n_blocks = 0;
        for (uint32_t l = 0; l < N_LAYERS; l++) {
                KV(x.c, kvc_layer_view(kept, l, &v));
                for (uint32_t b = 0; b < v.n_blocks; b++, n_blocks++)
                        CK(cudaMemset(v.blocks[b], (int)(n_blocks % 251 + 1), v.block_bytes));
        }
        CK(cudaStreamSynchronize(NULL));
        KV(x.c, kvc_session_close(first, NULL));
        printf("READY blocks=%u\n", n_blocks);
        char line[64];
        while (fgets(line, sizeof(line), stdin)) {
                KV(x.c, kvc_session_reserve(kept, 2 * third * 16)); /* nothing new: an exchange */
                printf("EXCHANGED in=%d\n", __builtin_popcountll(chunks_in_use(&x, kept, chunk_bytes)));
        }
        uint8_t *host = malloc(v.block_bytes);
        if (!host)
                DIE("out of memory");
        n_blocks = 0;
        for (uint32_t l = 0; l < N_LAYERS; l++) {
                KV(x.c, kvc_layer_view(kept, l, &v));
                for (uint32_t b = 0; b < v.n_blocks; b++, n_blocks++) {
                        CK(cudaMemcpy(host, v.blocks[b], v.block_bytes, cudaMemcpyDeviceToHost));
                        for (uint64_t i = 0; i < v.block_bytes; i++)
                                if (host[i] != (uint8_t)(n_blocks % 251 + 1))
                                        DIE("layer %u block %u byte %llu is 0x%02x after the move", l, b,
                                            (unsigned long long)i, host[i]);
                }
        }
        free(host);
        struct kvc_session_stats st;
        kvc_session_get_stats(kept, &st);
        if (st.blocks_moved == 0)
                DIE("no block was moved");
        printf("MOVED %llu blocks, all intact\n", (unsigned long long)st.blocks_moved);
        KV(x.c, kvc_session_close(kept, NULL));
        kvc_disconnect(x.c);
        ctx_done(&x);
        return 0;
}

int main(int argc, char **argv) {
        const char *sock = NULL, *chunks = "";
        uint64_t chunk_bytes = 2u << 20;
        for (int i = 1; i + 1 < argc; i += 2) {
                if (strcmp(argv[i], "--socket") == 0)
                        sock = argv[i + 1];
                else if (strcmp(argv[i], "--role") == 0)
                        role = argv[i + 1];
                else if (strcmp(argv[i], "--chunks") == 0)
                        chunks = argv[i + 1];
                else if (strcmp(argv[i], "--chunk-bytes") == 0)
                        chunk_bytes = strtoull(argv[i + 1], NULL, 0);
                else
                        DIE("unknown argument %s", argv[i]);
        }
        if (!sock || (argc - 1) % 2) {
                fprintf(stderr, "usage: kvc-ipc-client --socket DIR --role survivor|victim|checker|mover "
                                "[--chunks I,J] "
                                "[--chunk-bytes N]\n");
                return 2;
        }
        setvbuf(stdout, NULL, _IOLBF, 0);
        if (strcmp(role, "survivor") == 0)
                return run_survivor(sock);
        if (strcmp(role, "victim") == 0)
                return run_victim(sock, chunk_bytes);
        if (strcmp(role, "checker") == 0)
                return run_checker(sock, chunks, chunk_bytes);
        if (strcmp(role, "mover") == 0)
                return run_mover(sock, chunk_bytes);
        DIE("unknown role");
}
