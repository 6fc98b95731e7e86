/* kvc.c: libkvc. Owns the client's two connections to kvcd (ZeroMQ DEALER for messages,
 * SEQPACKET for chunk fds), the reserved address range the pool is mapped into, and the client
 * side of every session: block tables, lengths, plan application.
 *
 * The daemon is trusted no more than a client is by the daemon: every grant and plan is checked
 * before it touches memory (offsets inside mapped chunks, keep-sets sorted and inside the cache,
 * plan entries inside the plan buffer, which is copied out before use), so a faulty kvcd cannot
 * make a client write out of bounds. A plan that fails the checks is refused and reported.
 *
 * Device pools (kvcd's cuda backend, docs/gpu.md): kvcd says so on the side channel, with the
 * GPU's UUID; the range is then reserved on that GPU and chunks are imported and mapped there
 * (devpool.c, through the driver loaded with dlopen). The CPU kernels cannot touch that memory:
 * kvc_append and kvc_attend answer -ENOTSUP, the caller writes tokens with its own kernels
 * (kvc_append_slots, kvc_layer_view) and plans are applied by the compactor it registered
 * (kvc_set_compactor), after the same checks on a copy of the plan buffer. The host path is
 * untouched by any of this. Chunks kvcd asks back (UNMAP) are unmapped and acknowledged when
 * nothing of the client's lies in them.
 */
#define _GNU_SOURCE
#include "kvc.h"

#include <errno.h>
#include <math.h>
#include <poll.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#include "attention.h"
#include "block.h"
#include "compact.h"
#include "cuda/driver.h"
#include "devpool.h"
#include "fdwire.h"
#include "mixed.h"
#include "summarize.h"
#include "summary.h"
#include "wire.h"

#define KVC_DEFAULT_TIMEOUT_MS 10000
#define KVC_MAX_PENDING        64u /* StepBatches in flight */
#define MAPPED_RW              1
#define MAPPED_RO              2

/* One class of a layer's blocks (full precision or INT8), in slot order. */
struct table {
        uint64_t *offs; /* pool offsets */
        uint8_t **ptrs; /* their addresses here */
        uint32_t n;
};

/* Slots [0, n_q8) are INT8 (in q8), slots [n_q8, n_tokens) full precision (in fp). */
struct layer {
        struct table fp;
        struct table q8;
        uint32_t n_tokens;
        uint32_t n_q8;
};

struct kvc_session {
        struct kvc_client *c;
        struct kvc_session *next;
        uint64_t id;
        uint8_t token[WIRE_TOKEN_BYTES];
        struct kvc_geometry g;
        struct block_layout layout;
        struct block_layout q8_layout; /* block_bytes 0: the session keeps no INT8 */
        uint32_t budget;
        uint32_t max_layer_tokens;
        uint32_t max_layer_blocks;
        float ema_gamma;
        uint64_t plan_offset;
        uint64_t plan_bytes;
        uint32_t *plan_copy; /* plan_bytes: the keep-sets copied out of the shared buffer */
        float *attn_scratch;
        float *compact_scratch;
        struct layer *layers;
        uint64_t last_step;
        bool stepped;
        uint64_t last_plan_id;
        int closed_by_kvcd; /* the errno kvcd closed the session with (an operator's evict), or 0 */
        uint32_t n_shared;  /* slots [0, n_shared) of every layer are a shared prefix */
        uint8_t *mask;      /* [layer][kv head][mask_stride]: the shared slots this session evicted */
        uint64_t mask_offset;
        uint32_t mask_stride;
        struct kvc_session_stats stats;
};

/* A step summary waiting for kvc_flush(); its layer lengths sit in the client's flat buffer. */
struct queued_step {
        uint64_t session_id;
        uint64_t prev_step; /* the session's last step before this one, for a Resume */
        bool prev_stepped;
        uint64_t step;
        enum kvc_phase phase;
        float entropy, top1_prob, margin;
        uint32_t n_layers;
        size_t lengths_at;
};

/* A StepBatch sent and not yet answered: kept whole, to be sent again after a resume. */
struct sent_batch {
        uint8_t *bytes;
        size_t len;
        struct queued_step *steps; /* session ids and the steps before, for the Resume */
        size_t n_steps;
};

struct kvc_client {
        char sock_path[256], fd_path[256];
        char name[WIRE_MAX_NAME + 1];
        bool resumable;  /* kvcd keeps our pool across its restarts (Welcome.resumable) */
        bool recovering; /* inside recover(): a second break is reported, not recovered */
        int resume_ms;
        void *zctx;
        void *zsock;
        int fd;
        uint64_t client_id;
        uint64_t chunk_bytes;
        uint64_t pool_bytes;
        uint32_t n_chunks;
        uint32_t block_tokens;
        uint8_t *base;          /* the pool's range: host memory, or a device pointer when dev */
        uint8_t *mapped;        /* per chunk: 0, MAPPED_RW or MAPPED_RO */
        uint32_t *mapped_gen;   /* per chunk: the generation mapped (fdwire.h) */
        struct cuda_driver drv; /* loaded for a device pool */
        struct devpool *dev;    /* a device pool; NULL: host memory */
        uint8_t device_uuid[16];
        kvc_compactor compactor;
        void *compactor_ctx;
        int timeout_ms;
        uint32_t plan_lag;
        struct wire_arena *arena;
        uint8_t *sendbuf;
        size_t sendbuf_cap;
        uint64_t next_request_id;
        struct kvc_session *sessions;

        struct queued_step *queue;
        size_t n_queue, cap_queue;
        uint32_t *lengths;
        size_t n_lengths, cap_lengths;
        uint64_t pending[KVC_MAX_PENDING];       /* request ids of StepBatches awaiting their PlanBatch */
        struct sent_batch sent[KVC_MAX_PENDING]; /* the same batches, whole */
        uint32_t pending_head, n_pending;
        int step_error; /* first per-step error kvcd reported since the last flush */

        char error[WIRE_MAX_MESSAGE + 64];
};

static int set_error(struct kvc_client *c, int code, const char *fmt, ...)
        __attribute__((format(printf, 3, 4)));

static int set_error(struct kvc_client *c, int code, const char *fmt, ...) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(c->error, sizeof(c->error), fmt, ap);
        va_end(ap);
        return code;
}

/* Why the last kvc_connect of this thread failed, when it knows more than the code. */
static __thread char connect_error[640];

const char *kvc_last_error(const struct kvc_client *c) {
        return c ? c->error : connect_error[0] ? connect_error : "no client";
}

struct uuid_text {
        char s[41];
};

static struct uuid_text uuid_text(const uint8_t bytes[16]) {
        struct cuda_uuid u;
        struct uuid_text t;
        memcpy(u.bytes, bytes, sizeof(u.bytes));
        cuda_uuid_format(&u, t.s);
        return t;
}

int kvc_default_runtime_dir(char *buf, size_t len) {
        const char *env = getenv("KVC_SOCKET"), *xdg = getenv("XDG_RUNTIME_DIR");
        int n;
        if (env && *env)
                n = snprintf(buf, len, "%s", env);
        else if (xdg && *xdg)
                n = snprintf(buf, len, "%s/kvcd", xdg);
        else
                n = snprintf(buf, len, "/tmp/kvcd-%u", (unsigned)getuid());
        return n < 0 || (size_t)n >= len ? -ENAMETOOLONG : 0;
}

/* kvcd.sock and kvcd.fd.sock from a runtime directory or a kvcd.sock path. */
static int socket_paths(const char *hint, char *sock, char *fdp, size_t len) {
        char dir[256];
        struct stat st;
        int r;
        if (hint && *hint) {
                size_t n = strlen(hint);
                bool sock_path = (stat(hint, &st) == 0 && S_ISSOCK(st.st_mode)) ||
                                 (n > 5 && strcmp(hint + n - 5, ".sock") == 0);
                if (!sock_path) {
                        r = snprintf(dir, sizeof(dir), "%s", hint);
                } else {
                        const char *slash = strrchr(hint, '/');
                        r = slash ? snprintf(dir, sizeof(dir), "%.*s", (int)(slash - hint), hint)
                                  : snprintf(dir, sizeof(dir), ".");
                        if (r >= 0 && (size_t)r < sizeof(dir) && snprintf(sock, len, "%s", hint) < (int)len)
                                return snprintf(fdp, len, "%s/kvcd.fd.sock", dir) < (int)len ? 0
                                                                                             : -ENAMETOOLONG;
                }
                if (r < 0 || (size_t)r >= sizeof(dir))
                        return -ENAMETOOLONG;
        } else if ((r = kvc_default_runtime_dir(dir, sizeof(dir))) < 0) {
                return r;
        }
        if (snprintf(sock, len, "%s/kvcd.sock", dir) >= (int)len ||
            snprintf(fdp, len, "%s/kvcd.fd.sock", dir) >= (int)len)
                return -ENAMETOOLONG;
        return 0;
}

static int send_packed(struct kvc_client *c, const uint8_t *bytes, size_t n) {
        if (!c->zsock) /* a client made by kvc_fuzz_client_new(): nobody to tell */
                return 0;
        if (zmq_send(c->zsock, bytes, n, 0) < 0)
                return set_error(c, -ECONNREFUSED, "cannot send to kvcd: %s", zmq_strerror(zmq_errno()));
        return 0;
}

static int send_env(struct kvc_client *c, Kvc__Envelope *env) {
        env->version = WIRE_VERSION;
        size_t n = wire_packed_size(env);
        if (!c->zsock) /* a client made by kvc_fuzz_client_new(): nobody to tell */
                return 0;
        if (n > c->sendbuf_cap) {
                uint8_t *b = realloc(c->sendbuf, n);
                if (!b)
                        return -ENOMEM;
                c->sendbuf = b;
                c->sendbuf_cap = n;
        }
        wire_pack(env, c->sendbuf);
        return send_packed(c, c->sendbuf, n);
}

static int side_record(struct kvc_client *c, const struct fdwire_msg *m, int fd);

/* Receives one message (valid until the next receive). -ETIMEDOUT, -ENOTCONN when kvcd's side
 * channel hung up (it died), -EPROTO for a message that fails validation. */
static int recv_env(struct kvc_client *c, int timeout_ms, Kvc__Envelope **ret) {
        zmq_pollitem_t items[2] = {
                { .socket = c->zsock, .events = ZMQ_POLLIN },
                { .fd = c->fd, .events = ZMQ_POLLIN },
        };
        for (;;) {
                int n = zmq_poll(items, 2, timeout_ms);
                if (n < 0 && zmq_errno() == EINTR)
                        continue;
                if (n < 0)
                        return set_error(c, -EIO, "poll: %s", zmq_strerror(zmq_errno()));
                if (n == 0)
                        return set_error(c, -ETIMEDOUT, "no answer from kvcd within %d ms", timeout_ms);
                /* the side channel first, as kvcd sent it first: a chunk ahead of the message that
                 * names it, one kvcd asks back, or kvcd hung up */
                if (items[1].revents) {
                        struct fdwire_msg m;
                        int fd, r = fdwire_recv(c->fd, &m, &fd, 0);
                        if (r == -ENOTCONN)
                                return set_error(c, -ENOTCONN, "kvcd closed the connection");
                        if (r == 0 && (r = side_record(c, &m, fd)) < 0)
                                return r;
                        if (r < 0 && r != -ETIMEDOUT && r != -EPROTO)
                                return set_error(c, r, "side channel: %s", strerror(-r));
                        if (r == 0)
                                continue; /* there may be more */
                }
                if (items[0].revents)
                        break;
        }
        zmq_msg_t msg;
        zmq_msg_init(&msg);
        if (zmq_msg_recv(&msg, c->zsock, ZMQ_DONTWAIT) < 0) {
                zmq_msg_close(&msg);
                return set_error(c, -EIO, "receive: %s", zmq_strerror(zmq_errno()));
        }
        char why[WIRE_MAX_MESSAGE];
        Kvc__Envelope *env;
        int r = wire_decode(c->arena, zmq_msg_data(&msg), zmq_msg_size(&msg), WIRE_REPLY_MAX_BYTES, &env, why,
                            sizeof(why));
        zmq_msg_close(&msg);
        if (r < 0)
                return set_error(c, -EPROTO, "bad message from kvcd: %s", why);
        *ret = env;
        return 0;
}

/* Maps chunk record m's fd (closed here either way). */
static int map_chunk(struct kvc_client *c, const struct fdwire_msg *m, int fd) {
        struct stat st;
        bool device = (m->flags & FDWIRE_DEVICE_MEM) != 0;
        if (fd < 0 || m->chunk_idx >= c->n_chunks || m->chunk_bytes != c->chunk_bytes ||
            device != (c->dev != NULL) ||
            (!device && (fstat(fd, &st) < 0 || (uint64_t)st.st_size < c->chunk_bytes))) {
                if (fd >= 0)
                        close(fd);
                return set_error(c, -EPROTO, "kvcd sent an invalid chunk record");
        }
        bool read_only = (m->flags & FDWIRE_READ_ONLY) != 0;
        if (c->dev && c->mapped[m->chunk_idx]) { /* sent again (kvcd called a reclaim off): same memory */
                close(fd);
                return 0;
        }
        /* the same memory again: a read-only record never takes write access away (a shared
         * prefix's chunk, when we also publish into it) */
        if (!c->dev && c->mapped[m->chunk_idx] && c->mapped_gen[m->chunk_idx] == m->generation &&
            (read_only || c->mapped[m->chunk_idx] == MAPPED_RW)) {
                close(fd);
                return 0;
        }
        if (c->dev) {
                char why[256];
                int r = devpool_map(c->dev, m->chunk_idx, fd, read_only, why, sizeof(why));
                close(fd);
                if (r < 0)
                        return set_error(c, r, "mapping chunk %llu on the GPU: %s",
                                         (unsigned long long)m->chunk_idx, why);
        } else {
                int prot = PROT_READ | (read_only ? 0 : PROT_WRITE);
                void *p = mmap(c->base + m->chunk_idx * c->chunk_bytes, c->chunk_bytes, prot,
                               MAP_SHARED | MAP_FIXED, fd, 0);
                close(fd);
                if (p == MAP_FAILED)
                        return set_error(c, -errno, "mapping chunk %llu: %s",
                                         (unsigned long long)m->chunk_idx, strerror(errno));
                /* a child forked without exec must not keep the pool: it would outlive our death */
                madvise(p, c->chunk_bytes, MADV_DONTFORK);
        }
        c->mapped[m->chunk_idx] = read_only ? MAPPED_RO : MAPPED_RW;
        c->mapped_gen[m->chunk_idx] = m->generation;
        return 0;
}

static bool in_chunk(const struct kvc_client *c, uint64_t off, uint64_t idx) {
        return off / c->chunk_bytes == idx;
}

/* Whether anything of the client's (a block, a plan buffer) lies in chunk idx. */
static bool chunk_in_use(const struct kvc_client *c, uint64_t idx) {
        for (const struct kvc_session *s = c->sessions; s; s = s->next) {
                if (s->plan_bytes && in_chunk(c, s->plan_offset, idx))
                        return true;
                for (uint32_t l = 0; s->layers && l < s->g.n_layers; l++) {
                        const struct layer *L = &s->layers[l];
                        for (uint32_t b = 0; b < L->fp.n; b++)
                                if (in_chunk(c, L->fp.offs[b], idx))
                                        return true;
                        for (uint32_t b = 0; b < L->q8.n; b++)
                                if (in_chunk(c, L->q8.offs[b], idx))
                                        return true;
                }
        }
        return false;
}

/* kvcd asks chunk idx back: unmap it and say so. A chunk that is not mapped, or still holds
 * something of ours, is kept and not acknowledged (kvcd then keeps it marked until we go). */
static int unmap_chunk(struct kvc_client *c, uint64_t idx) {
        if (idx >= c->n_chunks || !c->mapped[idx] || chunk_in_use(c, idx))
                return 0;
        if (c->dev) {
                char why[256];
                int r = devpool_unmap(c->dev, idx, why, sizeof(why));
                if (r < 0)
                        return set_error(c, r, "giving chunk %llu back: %s", (unsigned long long)idx, why);
        } else if (mmap(c->base + idx * c->chunk_bytes, c->chunk_bytes, PROT_NONE,
                        MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0) == MAP_FAILED) {
                return set_error(c, -errno, "giving chunk %llu back: %s", (unsigned long long)idx,
                                 strerror(errno));
        }
        c->mapped[idx] = 0;
        struct fdwire_msg m = { .magic = FDWIRE_MAGIC,
                                .version = FDWIRE_VERSION,
                                .kind = FDWIRE_UNMAPPED,
                                .chunk_idx = idx,
                                .chunk_bytes = c->chunk_bytes };
        int r = fdwire_send(c->fd, &m, -1);
        return r < 0 ? set_error(c, r, "telling kvcd chunk %llu is unmapped: %s", (unsigned long long)idx,
                                 strerror(-r))
                     : 0;
}

/* Handles one side-channel record (its fd, if any, is consumed). */
static int side_record(struct kvc_client *c, const struct fdwire_msg *m, int fd) {
        if (m->kind == FDWIRE_CHUNK)
                return map_chunk(c, m, fd);
        if (fd >= 0)
                close(fd);
        if (m->kind == FDWIRE_UNMAP)
                return unmap_chunk(c, m->chunk_idx);
        return set_error(c, -EPROTO, "kvcd sent an unexpected side-channel record (kind %u)", m->kind);
}

static int ensure_chunk(struct kvc_client *c, uint64_t idx) {
        while (!c->mapped[idx]) {
                struct fdwire_msg m;
                int fd, r = fdwire_recv(c->fd, &m, &fd, c->timeout_ms);
                if (r < 0)
                        return set_error(c, r, "waiting for chunk %llu: %s", (unsigned long long)idx,
                                         strerror(-r));
                if ((r = side_record(c, &m, fd)) < 0)
                        return r;
        }
        return 0;
}

/* Copies n bytes at a pool offset out of the pool (host memory, or the GPU's). */
static int pool_copy_out(const struct kvc_client *c, uint64_t off, void *dst, size_t n) {
        if (c->dev)
                return devpool_read(c->dev, off, dst, n);
        memcpy(dst, c->base + off, n);
        return 0;
}

static struct kvc_session *find_session(struct kvc_client *c, uint64_t id) {
        for (struct kvc_session *s = c->sessions; s; s = s->next)
                if (s->id == id)
                        return s;
        return NULL;
}

/* Checks that `bytes` at pool offset off lie inside one chunk, then maps that chunk. */
static int check_region(struct kvc_client *c, uint64_t off, uint64_t bytes) {
        uint64_t idx = off / c->chunk_bytes;
        if (off % 64 || idx >= c->n_chunks || off % c->chunk_bytes + bytes > c->chunk_bytes)
                return set_error(c, -EPROTO, "kvcd named a region outside the pool (offset %llu)",
                                 (unsigned long long)off);
        return ensure_chunk(c, idx);
}

static int apply_grant(struct kvc_client *c, const Kvc__Grant *g) {
        struct kvc_session *s = find_session(c, g->session_id);
        if (!s)
                return set_error(c, -EPROTO, "grant for unknown session %llu",
                                 (unsigned long long)g->session_id);
        /* check all, then apply */
        for (size_t i = 0; i < g->n_layers; i++) {
                const Kvc__LayerBlocks *lb = g->layers[i];
                const struct block_layout *lay = lb->q8 ? &s->q8_layout : &s->layout;
                if (lb->layer >= s->g.n_layers || lay->block_bytes == 0)
                        return set_error(c, -EPROTO, "grant for a layer or block class the session lacks");
                const struct layer *L = &s->layers[lb->layer];
                if ((lb->q8 ? L->q8.n : L->fp.n) + lb->n_blocks > s->max_layer_blocks)
                        return set_error(c, -EPROTO, "grant beyond the session's limit");
                for (size_t b = 0; b < lb->n_blocks; b++) {
                        int r = check_region(c, lb->blocks[b], lay->block_bytes);
                        if (r < 0)
                                return r;
                        if (lb->blocks[b] % c->chunk_bytes % lay->block_bytes)
                                return set_error(c, -EPROTO, "granted block not aligned to the block size");
                }
        }
        for (size_t i = 0; i < g->n_layers; i++) {
                const Kvc__LayerBlocks *lb = g->layers[i];
                struct table *t = lb->q8 ? &s->layers[lb->layer].q8 : &s->layers[lb->layer].fp;
                for (size_t b = 0; b < lb->n_blocks; b++) {
                        t->offs[t->n] = lb->blocks[b];
                        t->ptrs[t->n] = c->base + lb->blocks[b];
                        t->n++;
                }
        }
        return 0;
}

/* The full-precision part of a layer, for the kernels that know one dtype. */
static const uint8_t *mask_of(const struct kvc_session *s, uint32_t l) {
        return s->mask ? s->mask + (size_t)l * s->g.n_kv_heads * s->mask_stride : NULL;
}

static struct block_layer layer_of(const struct kvc_session *s, uint32_t l) {
        const struct layer *L = &s->layers[l];
        return (struct block_layer){ .layout = &s->layout,
                                     .blocks = L->fp.ptrs,
                                     .n_blocks = L->fp.n,
                                     .n_tokens = L->n_tokens - L->n_q8,
                                     .n_shared = s->n_shared,
                                     .shared_mask = mask_of(s, l),
                                     .mask_stride = s->mask_stride };
}

static struct mixed_layer mixed_of(const struct kvc_session *s, uint32_t l) {
        const struct layer *L = &s->layers[l];
        return (struct mixed_layer){ .fp = &s->layout,
                                     .q8 = &s->q8_layout,
                                     .fp_blocks = L->fp.ptrs,
                                     .n_fp_blocks = L->fp.n,
                                     .q8_blocks = L->q8.ptrs,
                                     .n_q8_blocks = L->q8.n,
                                     .n_q8 = L->n_q8,
                                     .n_tokens = L->n_tokens,
                                     .n_shared = s->n_shared,
                                     .shared_mask = mask_of(s, l),
                                     .mask_stride = s->mask_stride };
}

/* released[0][l] full-precision and released[1][l] INT8 blocks of layer l were given back: they
 * sit just past the tables' new ends. */
static int send_plan_applied(struct kvc_client *c, struct kvc_session *s, uint64_t plan_id, int status,
                             uint32_t (*released)[WIRE_MAX_LAYERS]) {
        Kvc__PlanApplied pa = KVC__PLAN_APPLIED__INIT;
        Kvc__LayerBlocks lbs[2 * WIRE_MAX_LAYERS], *lbp[2 * WIRE_MAX_LAYERS];
        uint32_t lengths[WIRE_MAX_LAYERS], q8s[WIRE_MAX_LAYERS];
        pa.session_id = s->id;
        pa.plan_id = plan_id;
        pa.status = status;
        if (status == 0) {
                pa.n_layer_tokens = s->g.n_layers;
                pa.layer_tokens = lengths;
                pa.n_layer_q8_tokens = s->g.n_layers;
                pa.layer_q8_tokens = q8s;
                pa.released = lbp;
                for (uint32_t l = 0; l < s->g.n_layers; l++) {
                        lengths[l] = s->layers[l].n_tokens;
                        q8s[l] = s->layers[l].n_q8;
                        for (int q = 0; q < 2; q++) {
                                const struct table *t = q ? &s->layers[l].q8 : &s->layers[l].fp;
                                if (!released[q][l])
                                        continue;
                                kvc__layer_blocks__init(&lbs[pa.n_released]);
                                lbs[pa.n_released].layer = l;
                                lbs[pa.n_released].q8 = q;
                                lbs[pa.n_released].n_blocks = released[q][l];
                                lbs[pa.n_released].blocks = t->offs + t->n;
                                lbp[pa.n_released] = &lbs[pa.n_released];
                                pa.n_released++;
                        }
                }
        }
        Kvc__Envelope env = KVC__ENVELOPE__INIT;
        env.request_id = ++c->next_request_id;
        env.body_case = KVC__ENVELOPE__BODY_PLAN_APPLIED;
        env.plan_applied = &pa;
        return send_env(c, &env);
}

/* A plan's block moves (relocation): each names a block of ours by its table entry, and a
 * destination in a chunk we map writable, aligned, used by no other move; the shared prefix's
 * blocks never move. 0, or an errno with the reason set. */
static int check_moves(struct kvc_client *c, const struct kvc_session *s, const Kvc__Plan *p) {
        uint32_t first_fp = s->n_shared / s->layout.block_tokens;
        for (size_t i = 0; i < p->n_moves; i++) {
                const Kvc__BlockMove *m = p->moves[i];
                const struct block_layout *lay = m->q8 ? &s->q8_layout : &s->layout;
                const struct table *t = m->layer < s->g.n_layers
                                                ? (m->q8 ? &s->layers[m->layer].q8 : &s->layers[m->layer].fp)
                                                : NULL;
                bool ok = t && lay->block_bytes && m->index < t->n && t->offs[m->index] == m->from &&
                          (m->q8 || m->index >= first_fp) && m->to % c->chunk_bytes % lay->block_bytes == 0 &&
                          check_region(c, m->to, lay->block_bytes) == 0 &&
                          c->mapped[m->to / c->chunk_bytes] == MAPPED_RW;
                for (size_t j = 0; ok && j < i; j++)
                        ok = p->moves[j]->to != m->to &&
                             !(p->moves[j]->layer == m->layer && p->moves[j]->q8 == m->q8 &&
                               p->moves[j]->index == m->index);
                if (!ok) {
                        set_error(c, -EPROTO, "plan %llu: block move %zu (layer %u, entry %u) is invalid",
                                  (unsigned long long)p->plan_id, i, m->layer, m->index);
                        return EPROTO;
                }
        }
        return 0;
}

/* Copies each moved block to its new place and puts it in the table; all or nothing. */
static int apply_moves(struct kvc_client *c, struct kvc_session *s, const Kvc__Plan *p) {
        for (size_t i = 0; i < p->n_moves; i++) {
                const Kvc__BlockMove *m = p->moves[i];
                size_t bytes = (m->q8 ? s->q8_layout : s->layout).block_bytes;
                struct table *t = m->q8 ? &s->layers[m->layer].q8 : &s->layers[m->layer].fp;
                int r = 0;
                if (c->dev)
                        r = devpool_copy(c->dev, m->to, m->from, bytes);
                else
                        memcpy(c->base + m->to, c->base + m->from, bytes);
                if (r < 0) { /* the blocks moved so far go back: their old copies are untouched */
                        while (i-- > 0) {
                                m = p->moves[i];
                                t = m->q8 ? &s->layers[m->layer].q8 : &s->layers[m->layer].fp;
                                t->offs[m->index] = m->from;
                                t->ptrs[m->index] = c->base + m->from;
                        }
                        set_error(c, r, "plan %llu: cannot copy a block on the GPU",
                                  (unsigned long long)p->plan_id);
                        return EIO;
                }
                t->offs[m->index] = m->to;
                t->ptrs[m->index] = c->base + m->to;
        }
        s->stats.blocks_moved += p->n_moves;
        return 0;
}

/* Validates a plan completely, moves the blocks it moves, then compacts every layer it names and
 * gives back the blocks the layers no longer need (keeping room for one more token). */
static int apply_plan(struct kvc_client *c, const Kvc__Plan *p) {
        struct kvc_session *s = find_session(c, p->session_id);
        if (!s)
                return set_error(c, -EPROTO, "plan for unknown session %llu",
                                 (unsigned long long)p->session_id);
        int status = 0;
        uint64_t entries_cap = s->plan_bytes / 4, used = 0;
        bool seen[WIRE_MAX_LAYERS] = { false };

        if (p->plan_id <= s->last_plan_id) {
                status = ESTALE;
                set_error(c, -ESTALE, "plan %llu is older than plan %llu, already applied",
                          (unsigned long long)p->plan_id, (unsigned long long)s->last_plan_id);
        } else if (p->n_layers && (!s->stepped || p->base_step > s->last_step)) {
                status = EPROTO;
                set_error(c, -EPROTO, "plan %llu is based on step %llu, which this session has not taken",
                          (unsigned long long)p->plan_id, (unsigned long long)p->base_step);
        }
        for (size_t i = 0; status == 0 && i < p->n_layers; i++) {
                const Kvc__LayerPlan *lp = p->layers[i];
                uint64_t n = (uint64_t)lp->keep_count * (lp->per_head ? s->g.n_kv_heads : 1);
                if (lp->layer >= s->g.n_layers || seen[lp->layer] ||
                    lp->base_tokens > s->layers[lp->layer].n_tokens ||
                    (uint64_t)lp->keep_offset + n > entries_cap || used + n > entries_cap ||
                    (lp->summary_slot && (lp->per_head || lp->q8_tokens || s->layers[lp->layer].n_q8))) {
                        status = EPROTO;
                        set_error(c, -EPROTO, "plan %llu: layer entry %zu out of range",
                                  (unsigned long long)p->plan_id, i);
                        break;
                }
                seen[lp->layer] = true;
                const struct layer *L = &s->layers[lp->layer];
                uint32_t new_len = lp->keep_count + (L->n_tokens - lp->base_tokens),
                         T = s->layout.block_tokens;
                if (lp->q8_tokens && (s->q8_layout.block_bytes == 0 || lp->q8_tokens > new_len ||
                                      (lp->q8_tokens + T - 1) / T > L->q8.n)) {
                        status = EPROTO;
                        set_error(c, -EPROTO, "plan %llu: layer %u asks for %u INT8 slots it cannot hold",
                                  (unsigned long long)p->plan_id, lp->layer, lp->q8_tokens);
                        break;
                }
                /* copy out of the shared buffer, then check the copy */
                uint32_t *keep = s->plan_copy + used;
                if (pool_copy_out(c, s->plan_offset + (uint64_t)lp->keep_offset * 4, keep, n * 4) < 0) {
                        status = EIO;
                        set_error(c, -EIO, "plan %llu: cannot copy the plan buffer off the GPU",
                                  (unsigned long long)p->plan_id);
                        break;
                }
                for (uint32_t h = 0; h < (lp->per_head ? s->g.n_kv_heads : 1u); h++) {
                        if (compact_check_keep(keep + (uint64_t)h * lp->keep_count, lp->keep_count,
                                               lp->base_tokens) < 0) {
                                status = EPROTO;
                                set_error(c, -EPROTO,
                                          "plan %llu: layer %u keep-set not ascending or past the cache",
                                          (unsigned long long)p->plan_id, lp->layer);
                                break;
                        }
                        /* a shared prefix stays where it is: the keep-set starts with it, whole */
                        for (uint32_t j = 0; j < lp->shared_tokens && status == 0; j++)
                                if (keep[(uint64_t)h * lp->keep_count + j] != j) {
                                        status = EPROTO;
                                        set_error(c, -EPROTO, "plan %llu: layer %u moves its shared prefix",
                                                  (unsigned long long)p->plan_id, lp->layer);
                                }
                }
                if (status == 0 && lp->shared_tokens &&
                    (lp->shared_tokens != s->n_shared || lp->keep_count < lp->shared_tokens ||
                     lp->q8_tokens || lp->summary_slot || L->n_q8 || !s->mask ||
                     lp->shared_tokens / T > L->fp.n)) {
                        status = EPROTO;
                        set_error(c, -EPROTO,
                                  "plan %llu: layer %u's shared prefix of %u does not match ours (%u)",
                                  (unsigned long long)p->plan_id, lp->layer, lp->shared_tokens, s->n_shared);
                }
                used += n;
        }
        if (status == 0)
                status = check_moves(c, s, p);
        if (status == 0 && p->n_layers && c->dev && !c->compactor) {
                status = ENOTSUP;
                set_error(c, -ENOTSUP,
                          "plan %llu: the pool is GPU memory and no compactor is registered "
                          "(kvc_set_compactor)",
                          (unsigned long long)p->plan_id);
        }
        if (status == 0)
                status = apply_moves(c, s, p);
        if (status != 0) {
                int r = send_plan_applied(c, s, p->plan_id, status, NULL);
                return r < 0 ? r : -status;
        }

        uint32_t released[2][WIRE_MAX_LAYERS] = { { 0 } };
        uint32_t T = s->layout.block_tokens;
        used = 0;
        for (size_t i = 0; i < p->n_layers; i++) {
                const Kvc__LayerPlan *lp = p->layers[i];
                struct layer *L = &s->layers[lp->layer];
                uint32_t new_len;
                int r;
                if (c->dev) {
                        struct kvc_compaction job = {
                                .layer = lp->layer,
                                .keep = s->plan_copy + used,
                                .keep_device = (const uint32_t *)(c->base + s->plan_offset +
                                                                  (uint64_t)lp->keep_offset * 4),
                                .keep_count = lp->keep_count,
                                .per_head = lp->per_head,
                                .base_tokens = lp->base_tokens,
                                .q8_tokens = lp->q8_tokens,
                                .summary_slot = lp->summary_slot,
                                .new_tokens = lp->keep_count + (L->n_tokens - lp->base_tokens),
                        };
                        kvc_layer_view(s, lp->layer, &job.view);
                        r = c->compactor(c->compactor_ctx, s, &job);
                        new_len = job.new_tokens;
                } else if (lp->shared_tokens) {
                        /* the private part compacts on its own; the shared prefix only gets masks */
                        uint32_t S = lp->shared_tokens, kp = lp->keep_count - S, H = s->g.n_kv_heads;
                        uint32_t *keep = s->plan_copy + used, private_len = 0;
                        for (uint32_t h = 0; h < (lp->per_head ? H : 1u); h++)
                                for (uint32_t j = 0; j < kp; j++)
                                        keep[(uint64_t)h * kp + j] =
                                                keep[(uint64_t)h * lp->keep_count + S + j] - S;
                        struct block_layer bl = { .layout = &s->layout,
                                                  .blocks = L->fp.ptrs + S / T,
                                                  .n_blocks = L->fp.n - S / T,
                                                  .n_tokens = L->n_tokens - S };
                        r = compact_layer(&bl, keep, kp, lp->per_head, lp->base_tokens - S, &private_len);
                        new_len = S + private_len;
                        uint64_t at = (uint64_t)lp->layer * H * s->mask_stride;
                        if (r == 0)
                                r = pool_copy_out(c, s->plan_offset + s->mask_offset + at, s->mask + at,
                                                  (size_t)H * s->mask_stride);
                } else if (L->n_q8 == 0 && lp->q8_tokens == 0) {
                        struct block_layer bl = layer_of(s, lp->layer);
                        r = lp->summary_slot ? summarize_evicted(&bl, s->plan_copy + used, lp->keep_count,
                                                                 lp->base_tokens, lp->summary_slot - 1,
                                                                 s->compact_scratch)
                                             : 0;
                        if (r == 0)
                                r = compact_layer(&bl, s->plan_copy + used, lp->keep_count, lp->per_head,
                                                  lp->base_tokens, &new_len);
                } else {
                        struct mixed_layer ml = mixed_of(s, lp->layer);
                        r = compact_mixed(&ml, s->plan_copy + used, lp->keep_count, lp->per_head,
                                          lp->base_tokens, lp->q8_tokens, s->compact_scratch, &new_len);
                }
                if (r < 0) /* the kernel checks what only it can (kept INT8 beyond q8_tokens) */
                        return set_error(c, r, "compaction refused plan %llu on layer %u",
                                         (unsigned long long)p->plan_id, lp->layer);
                used += (uint64_t)lp->keep_count * (lp->per_head ? s->g.n_kv_heads : 1);
                L->n_tokens = new_len;
                L->n_q8 = lp->q8_tokens;
                /* keep room for one more token; give back the rest of each table */
                uint32_t fp_keep = (new_len - L->n_q8 + 1 + T - 1) / T, q8_keep = (L->n_q8 + T - 1) / T;
                if (fp_keep < L->fp.n) {
                        released[0][lp->layer] = L->fp.n - fp_keep;
                        L->fp.n = fp_keep;
                }
                if (q8_keep < L->q8.n) {
                        released[1][lp->layer] = L->q8.n - q8_keep;
                        L->q8.n = q8_keep;
                }
        }
        s->last_plan_id = p->plan_id;
        s->stats.plans_applied++;
        return send_plan_applied(c, s, p->plan_id, 0, released);
}

/* Handles a message that is not the reply a caller waits for. */
static int dispatch(struct kvc_client *c, const Kvc__Envelope *env) {
        int r = 0;
        switch (env->body_case) {
        case KVC__ENVELOPE__BODY_PLAN_BATCH: {
                const Kvc__PlanBatch *pb = env->plan_batch;
                if (c->n_pending && c->pending[c->pending_head] == env->request_id) {
                        struct sent_batch *b = &c->sent[c->pending_head];
                        free(b->bytes);
                        free(b->steps);
                        *b = (struct sent_batch){ 0 };
                        c->pending_head = (c->pending_head + 1) % KVC_MAX_PENDING;
                        c->n_pending--;
                }
                for (size_t i = 0; i < pb->n_grants && r == 0; i++)
                        r = apply_grant(c, pb->grants[i]);
                for (size_t i = 0; i < pb->n_shared; i++) { /* published: never written again */
                        struct kvc_session *s = find_session(c, pb->shared[i]->session_id);
                        uint32_t S = pb->shared[i]->shared_tokens;
                        if (s && S >= s->n_shared && (uint64_t)s->mask_stride * 8 >= S &&
                            S / s->layout.block_tokens <= s->layers[0].fp.n)
                                s->n_shared = S;
                }
                for (size_t i = 0; i < pb->n_plans; i++) {
                        int q = apply_plan(c, pb->plans[i]);
                        if (q < 0 && r == 0)
                                r = q;
                }
                for (size_t i = 0; i < pb->n_errors; i++) {
                        if (c->step_error == 0) {
                                c->step_error = -pb->errors[i]->code;
                                set_error(c, -pb->errors[i]->code, "session %llu: %s",
                                          (unsigned long long)pb->errors[i]->session_id,
                                          pb->errors[i]->message);
                        }
                }
                return r;
        }
        case KVC__ENVELOPE__BODY_ERROR: {
                /* kvcd refused a whole StepBatch (it failed validation): its answer all the same */
                if (env->request_id && c->n_pending && c->pending[c->pending_head] == env->request_id) {
                        struct sent_batch *b = &c->sent[c->pending_head];
                        free(b->bytes);
                        free(b->steps);
                        *b = (struct sent_batch){ 0 };
                        c->pending_head = (c->pending_head + 1) % KVC_MAX_PENDING;
                        c->n_pending--;
                        if (c->step_error == 0)
                                c->step_error = -env->error->code;
                }
                /* about a session, unasked: kvcd closed it (an operator evicted it) */
                struct kvc_session *s = env->request_id == 0 ? find_session(c, env->error->session_id) : NULL;
                if (s)
                        s->closed_by_kvcd = env->error->code;
                /* else an answer to a PlanApplied: kvcd refused our account of a plan */
                return set_error(c, -env->error->code, "kvcd: %s", env->error->message);
        }
        default: return set_error(c, -EPROTO, "unexpected %s from kvcd", wire_body_name(env->body_case));
        }
}

static int recover(struct kvc_client *c);

/* Sends env and waits for its reply of kind want (other messages are dispatched meanwhile). The
 * reply is valid until the next receive. An Error reply becomes its -code. */
static int call(struct kvc_client *c, Kvc__Envelope *env, Kvc__Envelope__BodyCase want, Kvc__Envelope **ret) {
        env->request_id = ++c->next_request_id;
        int r = send_env(c, env);
        if (r < 0)
                return r;
        for (;;) {
                Kvc__Envelope *in;
                r = recv_env(c, c->timeout_ms, &in);
                if (r == -ENOTCONN && !c->recovering) { /* kvcd restarted: resume, then ask again */
                        if ((r = recover(c)) < 0 || (r = send_env(c, env)) < 0)
                                return r;
                        continue;
                }
                if (r < 0)
                        return r;
                if (in->request_id != env->request_id) {
                        dispatch(c, in);
                        continue;
                }
                if (in->body_case == KVC__ENVELOPE__BODY_ERROR)
                        return set_error(c, -in->error->code, "kvcd: %s", in->error->message);
                if (in->body_case != want)
                        return set_error(c, -EPROTO, "kvcd answered %s to %s", wire_body_name(in->body_case),
                                         wire_body_name(env->body_case));
                *ret = in;
                return 0;
        }
}

/* The fd channel (kvcd's Welcome record, and the GPU's UUID for a device pool), the ZeroMQ
 * socket, and Hello: this client's connection to kvcd. On failure the caller closes what opened. */
static int open_channels(struct kvc_client *c, bool *ret_device, uint8_t uuid[16],
                         Kvc__Envelope **ret_welcome) {
        struct sockaddr_un sa = { .sun_family = AF_UNIX };
        struct fdwire_msg m;
        int fd = -1, r;
        if (strlen(c->fd_path) >= sizeof(sa.sun_path))
                return -ENAMETOOLONG;
        memcpy(sa.sun_path, c->fd_path, strlen(c->fd_path) + 1);
        c->fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
        if (c->fd < 0 || connect(c->fd, (struct sockaddr *)&sa, sizeof(sa)) < 0)
                return -errno;
        r = fdwire_recv(c->fd, &m, &fd, c->timeout_ms);
        if (r == 0 && (m.kind != FDWIRE_WELCOME || fd >= 0)) {
                if (fd >= 0)
                        close(fd);
                r = -EPROTO;
        }
        bool device = r == 0 && (m.flags & FDWIRE_DEVICE_MEM);
        if (device) { /* the GPU's UUID follows */
                struct fdwire_msg dm;
                r = fdwire_recv(c->fd, &dm, &fd, c->timeout_ms);
                if (r == 0 && (dm.kind != FDWIRE_DEVICE || fd >= 0)) {
                        if (fd >= 0)
                                close(fd);
                        r = -EPROTO;
                }
                if (r == 0)
                        memcpy(uuid, dm.token, 16);
        }
        if (r < 0)
                return r;
        *ret_device = device;

        int zero = 0;
        char ep[300];
        snprintf(ep, sizeof(ep), "ipc://%s", c->sock_path);
        if (!c->zctx && !(c->zctx = zmq_ctx_new()))
                return -ENOMEM;
        c->zsock = zmq_socket(c->zctx, ZMQ_DEALER);
        /* our routing id: the secret token (a first byte of 0 is ZeroMQ's), so that a connection
         * kvcd dropped (a heartbeat timeout while we were stopped) comes back as the same peer */
        uint8_t rid[1 + sizeof(m.token)] = { 'K' };
        memcpy(rid + 1, m.token, sizeof(m.token));
        if (!c->zsock || zmq_setsockopt(c->zsock, ZMQ_ROUTING_ID, rid, sizeof(rid)) < 0 ||
            zmq_setsockopt(c->zsock, ZMQ_LINGER, &zero, sizeof(zero)) < 0 ||
            zmq_setsockopt(c->zsock, ZMQ_SNDTIMEO, &c->timeout_ms, sizeof(c->timeout_ms)) < 0 ||
            zmq_connect(c->zsock, ep) < 0)
                return -ECONNREFUSED;

        Kvc__Hello hello = KVC__HELLO__INIT;
        hello.token.data = m.token;
        hello.token.len = sizeof(m.token);
        hello.client_name = c->name;
        Kvc__Envelope env = KVC__ENVELOPE__INIT;
        env.body_case = KVC__ENVELOPE__BODY_HELLO;
        env.hello = &hello;
        return call(c, &env, KVC__ENVELOPE__BODY_WELCOME, ret_welcome);
}

static void close_channels(struct kvc_client *c) {
        if (c->zsock)
                zmq_close(c->zsock);
        c->zsock = NULL;
        if (c->fd >= 0)
                close(c->fd); /* kvcd frees everything of ours when this closes */
        c->fd = -1;
}

int kvc_connect(const struct kvc_options *opt, struct kvc_client **ret) {
        struct kvc_options o = opt ? *opt : (struct kvc_options){ 0 };
        struct kvc_client *c = calloc(1, sizeof(*c));
        if (!c)
                return -ENOMEM;
        connect_error[0] = 0;
        c->fd = -1;
        c->base = MAP_FAILED;
        c->timeout_ms = o.timeout_ms > 0 ? o.timeout_ms : KVC_DEFAULT_TIMEOUT_MS;
        c->plan_lag = o.plan_lag < KVC_MAX_PENDING ? o.plan_lag : KVC_MAX_PENDING - 1;
        c->resume_ms = o.resume_ms == 0 ? 30000 : o.resume_ms;
        snprintf(c->name, sizeof(c->name), "%s", o.name ? o.name : "libkvc");
        int r = socket_paths(o.socket, c->sock_path, c->fd_path, sizeof(c->sock_path));
        if (r == 0)
                r = wire_arena_new(WIRE_REPLY_MAX_BYTES * 2, &c->arena);
        bool device = false;
        Kvc__Envelope *in = NULL;
        if (r == 0)
                r = open_channels(c, &device, c->device_uuid, &in);
        if (r < 0) {
                kvc_disconnect(c);
                return r;
        }
        const Kvc__Welcome *w = in->welcome;
        c->client_id = w->client_id;
        c->resumable = w->resumable;
        c->chunk_bytes = w->chunk_bytes;
        c->pool_bytes = w->pool_bytes;
        c->n_chunks = (uint32_t)(w->pool_bytes / w->chunk_bytes);
        c->block_tokens = w->block_tokens;
        c->mapped = calloc(c->n_chunks, 1);
        c->mapped_gen = calloc(c->n_chunks, sizeof(*c->mapped_gen));
        if (!c->mapped || !c->mapped_gen) {
                kvc_disconnect(c);
                return -ENOMEM;
        }
        if (device) {
                char why[512];
                r = cuda_driver_load(NULL, &c->drv, why, sizeof(why));
                if (r == 0)
                        r = devpool_open(&c->drv, c->device_uuid, c->pool_bytes, c->chunk_bytes, &c->dev, why,
                                         sizeof(why));
                if (r < 0) {
                        snprintf(connect_error, sizeof(connect_error), "the pool is on GPU %s: %s",
                                 uuid_text(c->device_uuid).s, why);
                        kvc_disconnect(c);
                        return r;
                }
                c->base = (uint8_t *)(uintptr_t)devpool_base(c->dev);
        } else {
                c->base = mmap(NULL, c->pool_bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                               -1, 0);
                if (c->base == MAP_FAILED) {
                        kvc_disconnect(c);
                        return -ENOMEM;
                }
        }
        *ret = c;
        return 0;
}

static int64_t now_ms(void) {
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* One session back from a restarted kvcd: our tables are the truth; the step before the first
 * unanswered one is where kvcd takes up (those steps are sent again). */
static int resume_session(struct kvc_client *c, struct kvc_session *s) {
        Kvc__Resume m = KVC__RESUME__INIT;
        m.session_id = s->id;
        m.token.data = s->token;
        m.token.len = sizeof(s->token);
        m.last_step = s->last_step;
        m.stepped = s->stepped;
        bool found = false;
        for (uint32_t i = 0; i < c->n_pending && !found; i++) {
                const struct sent_batch *b = &c->sent[(c->pending_head + i) % KVC_MAX_PENDING];
                for (size_t k = 0; k < b->n_steps && !found; k++) {
                        if (b->steps[k].session_id != s->id)
                                continue;
                        m.last_step = b->steps[k].prev_step;
                        m.stepped = b->steps[k].prev_stepped;
                        found = true;
                }
        }
        m.last_plan_id = s->last_plan_id;
        Kvc__ResumeLayer *layers = calloc(s->g.n_layers, sizeof(*layers));
        Kvc__ResumeLayer **lp = calloc(s->g.n_layers, sizeof(*lp));
        if (!layers || !lp) {
                free(layers);
                free(lp);
                return -ENOMEM;
        }
        for (uint32_t l = 0; l < s->g.n_layers; l++) {
                struct layer *L = &s->layers[l];
                kvc__resume_layer__init(&layers[l]);
                layers[l].n_tokens = L->n_tokens;
                layers[l].n_q8 = L->n_q8;
                layers[l].n_fp_blocks = L->fp.n;
                layers[l].fp_blocks = L->fp.offs;
                layers[l].n_q8_blocks = L->q8.n;
                layers[l].q8_blocks = L->q8.offs;
                lp[l] = &layers[l];
        }
        m.n_layers = s->g.n_layers;
        m.layers = lp;
        Kvc__Envelope env = KVC__ENVELOPE__INIT, *in;
        env.body_case = KVC__ENVELOPE__BODY_RESUME;
        env.resume = &m;
        int r = call(c, &env, KVC__ENVELOPE__BODY_RESUMED, &in);
        free(layers);
        free(lp);
        return r;
}

/* kvcd went away (its side channel hung up). When it said it keeps our pool across a restart:
 * connect again until resume_ms passes, resume every session, and send again the step batches
 * it had not answered. Otherwise, or when that fails, -ENOTCONN. */
static int recover(struct kvc_client *c) {
        if (!c->resumable || c->recovering || c->resume_ms < 0)
                return set_error(c, -ENOTCONN, "kvcd closed the connection");
        c->recovering = true;
        int64_t deadline = now_ms() + c->resume_ms;
        bool device = false;
        uint8_t uuid[16];
        Kvc__Envelope *in = NULL;
        int r;
        for (;;) {
                close_channels(c);
                r = open_channels(c, &device, uuid, &in);
                /* kvcd not back yet: no listener, a refused connection, or no Welcome in time */
                bool again = r == -ENOENT || r == -ECONNREFUSED || r == -ETIMEDOUT || r == -ENOTCONN ||
                             r == -ECONNRESET || r == -EPIPE;
                if (r == 0 || !again || now_ms() >= deadline)
                        break;
                poll(NULL, 0, 50);
        }
        if (r == 0 &&
            (in->welcome->chunk_bytes != c->chunk_bytes || in->welcome->pool_bytes != c->pool_bytes ||
             device != (c->dev != NULL) || (device && memcmp(uuid, c->device_uuid, 16) != 0)))
                r = set_error(c, -ESTALE, "kvcd came back with another pool");
        if (r == 0) {
                c->client_id = in->welcome->client_id;
                c->resumable = in->welcome->resumable;
                for (struct kvc_session *s = c->sessions; s; s = s->next) {
                        if (s->closed_by_kvcd)
                                continue;
                        int q = resume_session(c, s);
                        if (q < 0) /* kvcd did not keep it: the session is lost, the others go on */
                                s->closed_by_kvcd = -q;
                }
                for (uint32_t i = 0; i < c->n_pending && r == 0; i++) {
                        const struct sent_batch *b = &c->sent[(c->pending_head + i) % KVC_MAX_PENDING];
                        r = send_packed(c, b->bytes, b->len);
                }
        }
        c->recovering = false;
        if (r < 0)
                return set_error(c, -ENOTCONN, "kvcd closed the connection and did not come back: %s",
                                 c->error[0] ? c->error : strerror(-r));
        return 0;
}

static struct kvc_session *session_free(struct kvc_session *s) {
        if (!s)
                return NULL;
        if (s->layers)
                for (uint32_t l = 0; l < s->g.n_layers; l++) {
                        free(s->layers[l].fp.offs);
                        free(s->layers[l].fp.ptrs);
                        free(s->layers[l].q8.offs);
                        free(s->layers[l].q8.ptrs);
                }
        free(s->layers);
        free(s->plan_copy);
        free(s->mask);
        free(s->attn_scratch);
        free(s->compact_scratch);
        free(s);
        return NULL;
}

static void unlink_session(struct kvc_session *s) {
        for (struct kvc_session **p = &s->c->sessions; *p; p = &(*p)->next) {
                if (*p == s) {
                        *p = s->next;
                        return;
                }
        }
}

struct kvc_client *kvc_disconnect(struct kvc_client *c) {
        if (!c)
                return NULL;
        while (c->sessions) {
                struct kvc_session *s = c->sessions;
                c->sessions = s->next;
                session_free(s);
        }
        if (c->zsock)
                zmq_close(c->zsock);
        c->zsock = NULL;
        if (c->zctx)
                zmq_ctx_term(c->zctx);
        for (uint32_t i = 0; i < KVC_MAX_PENDING; i++) {
                free(c->sent[i].bytes);
                free(c->sent[i].steps);
        }
        if (c->dev) {
                c->dev = devpool_free(c->dev);
                c->base = MAP_FAILED;
        }
        cuda_driver_unload(&c->drv);
        if (c->base != MAP_FAILED)
                munmap(c->base, c->pool_bytes);
        if (c->fd >= 0) { /* nothing of the pool is mapped here any more: kvcd may scrub it at once */
                struct fdwire_msg bye = { .magic = FDWIRE_MAGIC,
                                          .version = FDWIRE_VERSION,
                                          .kind = FDWIRE_BYE };
                fdwire_send(c->fd, &bye, -1);
        }
        close_channels(c);
        free(c->mapped);
        free(c->mapped_gen);
        wire_arena_free(c->arena);
        free(c->sendbuf);
        free(c->queue);
        free(c->lengths);
        free(c);
        return NULL;
}

static Kvc__Dtype wire_dtype(enum kvc_dtype d) {
        switch (d) {
        case KVC_DTYPE_F16: return KVC__DTYPE__DTYPE_F16;
        case KVC_DTYPE_BF16: return KVC__DTYPE__DTYPE_BF16;
        case KVC_DTYPE_F32: return KVC__DTYPE__DTYPE_F32;
        }
        return KVC__DTYPE__DTYPE_UNSPECIFIED;
}

static int session_new(struct kvc_client *c, const struct kvc_geometry *geo, const Kvc__SessionOpened *o,
                       struct kvc_session **ret);

int kvc_session_open(struct kvc_client *c, const struct kvc_session_config *cfg, struct kvc_session **ret) {
        Kvc__Geometry g = KVC__GEOMETRY__INIT;
        Kvc__OpenSession os = KVC__OPEN_SESSION__INIT;
        Kvc__Param params[WIRE_MAX_PARAMS], *pp[WIRE_MAX_PARAMS];
        if (cfg->n_params > WIRE_MAX_PARAMS)
                return set_error(c, -EINVAL, "more than %u parameters", WIRE_MAX_PARAMS);
        g.n_layers = cfg->geometry.n_layers;
        g.n_heads = cfg->geometry.n_heads;
        g.n_kv_heads = cfg->geometry.n_kv_heads;
        g.head_dim = cfg->geometry.head_dim;
        g.dtype = wire_dtype(cfg->geometry.dtype);
        g.max_tokens = cfg->geometry.max_tokens;
        os.geometry = &g;
        os.policy = (char *)(cfg->policy ? cfg->policy : "full");
        os.budget_tokens = cfg->budget_tokens;
        os.tenant = (char *)(cfg->tenant ? cfg->tenant : "");
        os.min_bytes = cfg->min_bytes;
        os.max_bytes = cfg->max_bytes;
        os.priority = cfg->priority;
        os.prompt_tokens = cfg->prompt_tokens;
        os.prompt_token_ids = (uint32_t *)cfg->prompt_token_ids;
        os.n_prompt_token_ids = cfg->n_prompt_token_ids;
        os.int8 = true; /* libkvc stores INT8 blocks (kernels/mixed.h) */
        os.params = pp;
        for (size_t i = 0; i < cfg->n_params; i++) {
                char *end;
                double v = strtod(cfg->params[i].value, &end);
                kvc__param__init(&params[i]);
                params[i].key = (char *)cfg->params[i].key;
                if (*cfg->params[i].value && !*end) {
                        params[i].value_case = KVC__PARAM__VALUE_NUMBER;
                        params[i].number = v;
                } else {
                        params[i].value_case = KVC__PARAM__VALUE_TEXT;
                        params[i].text = (char *)cfg->params[i].value;
                }
                pp[i] = &params[i];
        }
        os.n_params = cfg->n_params;

        struct block_layout layout;
        if (block_layout_init(&layout, c->block_tokens, g.n_kv_heads, g.head_dim,
                              (enum block_dtype)cfg->geometry.dtype) < 0)
                return set_error(c, -EINVAL, "geometry has a zero or unknown field");
        os.handoff = cfg->handoff;
        if (cfg->share_prefix && c->dev)
                return set_error(c, -EINVAL, "shared prefixes need a host pool");
        os.share_prefix = cfg->share_prefix;
        os.model_id = (char *)(cfg->model_id ? cfg->model_id : "");

        Kvc__Envelope env = KVC__ENVELOPE__INIT, *in;
        env.body_case = KVC__ENVELOPE__BODY_OPEN_SESSION;
        env.open_session = &os;
        int r = call(c, &env, KVC__ENVELOPE__BODY_SESSION_OPENED, &in);
        if (r < 0)
                return r;
        return session_new(c, &cfg->geometry, in->session_opened, ret);
}

/* The client's side of a session kvcd opened (or handed over): layouts checked against kvcd's,
 * tables and scratch allocated, empty. */
static int session_new(struct kvc_client *c, const struct kvc_geometry *geo, const Kvc__SessionOpened *o,
                       struct kvc_session **ret) {
        struct block_layout layout;
        int r;
        if (block_layout_init(&layout, c->block_tokens, geo->n_kv_heads, geo->head_dim,
                              (enum block_dtype)geo->dtype) < 0)
                return set_error(c, -EINVAL, "geometry has a zero or unknown field");
        if (o->block_bytes != layout.block_bytes || o->block_tokens != c->block_tokens)
                return set_error(c, -EPROTO, "kvcd's block layout (%llu bytes) differs from ours (%llu)",
                                 (unsigned long long)o->block_bytes, (unsigned long long)layout.block_bytes);
        if (o->plan_bytes && (r = check_region(c, o->plan_offset, o->plan_bytes)) < 0)
                return r;
        struct block_layout q8_layout = { 0 };
        if (o->q8_block_bytes && (block_layout_init(&q8_layout, c->block_tokens, geo->n_kv_heads,
                                                    geo->head_dim, BLOCK_DTYPE_Q8) < 0 ||
                                  q8_layout.block_bytes != o->q8_block_bytes))
                return set_error(c, -EPROTO, "kvcd's INT8 block layout differs from ours");

        struct kvc_session *s = calloc(1, sizeof(*s));
        if (!s)
                return -ENOMEM;
        s->c = c;
        s->id = o->session_id;
        memcpy(s->token, o->token.data, sizeof(s->token));
        s->g = *geo;
        s->layout = layout;
        s->q8_layout = q8_layout;
        s->budget = o->budget_tokens;
        s->max_layer_tokens = o->max_layer_tokens;
        s->max_layer_blocks = (o->max_layer_tokens + layout.block_tokens - 1) / layout.block_tokens;
        s->ema_gamma = o->ema_gamma;
        s->plan_offset = o->plan_offset;
        s->plan_bytes = o->plan_bytes;
        s->layers = calloc(geo->n_layers, sizeof(*s->layers));
        s->plan_copy = malloc(o->plan_bytes ? o->plan_bytes : 4);
        size_t slots = (size_t)s->max_layer_blocks * layout.block_tokens + 1;
        struct mixed_layer probe = { .fp = &s->layout, .q8 = &s->q8_layout, .n_tokens = (uint32_t)slots };
        size_t attn = 2 * slots;
        if (q8_layout.block_bytes && attn_mixed_scratch_floats(&probe, geo->n_heads) > attn)
                attn = attn_mixed_scratch_floats(&probe, geo->n_heads);
        s->attn_scratch = malloc(attn * sizeof(float));
        size_t cs = 2 * (size_t)geo->head_dim; /* summarize_evicted */
        if (q8_layout.block_bytes && compact_mixed_scratch_floats(&probe) > cs)
                cs = compact_mixed_scratch_floats(&probe);
        s->compact_scratch = malloc(cs * sizeof(float));
        bool ok = s->layers && s->plan_copy && s->attn_scratch && s->compact_scratch;
        for (uint32_t l = 0; ok && l < geo->n_layers; l++) {
                struct layer *L = &s->layers[l];
                L->fp.offs = calloc(s->max_layer_blocks + 1, sizeof(uint64_t));
                L->fp.ptrs = calloc(s->max_layer_blocks + 1, sizeof(uint8_t *));
                L->q8.offs = calloc(s->max_layer_blocks + 1, sizeof(uint64_t));
                L->q8.ptrs = calloc(s->max_layer_blocks + 1, sizeof(uint8_t *));
                ok = L->fp.offs && L->fp.ptrs && L->q8.offs && L->q8.ptrs;
        }
        uint64_t mask_bytes = (uint64_t)geo->n_layers * geo->n_kv_heads * o->mask_stride;
        if (ok && o->mask_stride) {
                s->mask = calloc(mask_bytes, 1);
                s->mask_offset = o->mask_offset;
                s->mask_stride = o->mask_stride;
                ok = s->mask != NULL;
        }
        s->next = c->sessions;
        c->sessions = s;
        if (!ok) {
                kvc_session_close(s, NULL);
                return -ENOMEM;
        }
        r = 0;
        if (o->mask_stride && o->plan_bytes &&
            (o->mask_offset > o->plan_bytes || mask_bytes > o->plan_bytes - o->mask_offset))
                r = set_error(c, -EPROTO, "kvcd's masks lie outside the session's plan buffer");
        if (r == 0 && o->shared_tokens) { /* a prefix attached: the first blocks of every layer */
                uint32_t nb = o->shared_tokens / layout.block_tokens;
                if (o->n_attached != geo->n_layers || nb > s->max_layer_blocks ||
                    (uint64_t)o->mask_stride * 8 < o->shared_tokens || !s->mask)
                        r = set_error(c, -EPROTO, "kvcd's shared prefix does not fit the session");
                for (uint32_t l = 0; r == 0 && l < geo->n_layers; l++) {
                        const Kvc__LayerBlocks *lb = o->attached[l];
                        struct layer *L = &s->layers[l];
                        if (lb->layer != l || lb->n_blocks != nb || lb->q8) {
                                r = set_error(c, -EPROTO, "kvcd's shared prefix names layer %u wrongly", l);
                                break;
                        }
                        for (uint32_t b = 0; r == 0 && b < nb; b++) {
                                r = check_region(c, lb->blocks[b], layout.block_bytes);
                                L->fp.offs[b] = lb->blocks[b];
                                L->fp.ptrs[b] = c->base + lb->blocks[b];
                        }
                        L->fp.n = nb;
                        L->n_tokens = o->shared_tokens;
                }
                s->n_shared = o->shared_tokens;
        }
        if (r < 0) {
                kvc_session_close(s, NULL);
                return r;
        }
        *ret = s;
        return 0;
}

int kvc_session_export(struct kvc_session *s, struct kvc_handoff *ret) {
        struct kvc_client *c = s->c;
        int r;
        if (s->closed_by_kvcd)
                return set_error(c, -s->closed_by_kvcd, "kvcd closed session %llu",
                                 (unsigned long long)s->id);
        if (c->n_queue && (r = kvc_flush(c)) < 0)
                return r;
        while (c->n_pending) /* every answer in, every plan applied */
                if ((r = kvc_poll(c, c->timeout_ms)) < 0)
                        return r;
        Kvc__HandoffExport m = KVC__HANDOFF_EXPORT__INIT;
        uint32_t lengths[WIRE_MAX_LAYERS];
        for (uint32_t l = 0; l < s->g.n_layers; l++)
                lengths[l] = s->layers[l].n_tokens;
        m.session_id = s->id;
        m.n_layer_tokens = s->g.n_layers;
        m.layer_tokens = lengths;
        Kvc__Envelope env = KVC__ENVELOPE__INIT, *in;
        env.body_case = KVC__ENVELOPE__BODY_HANDOFF_EXPORT;
        env.handoff_export = &m;
        if ((r = call(c, &env, KVC__ENVELOPE__BODY_HANDOFF_TICKET, &in)) < 0)
                return r;
        ret->session_id = in->handoff_ticket->session_id;
        memcpy(ret->ticket, in->handoff_ticket->ticket.data, sizeof(ret->ticket));
        /* ours no more: kvcd asks for the chunks back (UNMAP) once the importer has them */
        unlink_session(s);
        session_free(s);
        return 0;
}

static enum kvc_dtype dtype_of_wire(Kvc__Dtype d) {
        switch (d) {
        case KVC__DTYPE__DTYPE_F16: return KVC_DTYPE_F16;
        case KVC__DTYPE__DTYPE_BF16: return KVC_DTYPE_BF16;
        default: return KVC_DTYPE_F32;
        }
}

/* Fills one table of a session handed over, checking every block kvcd names. */
static int import_table(struct kvc_client *c, struct table *t, const uint64_t *blocks, size_t n,
                        uint64_t block_bytes, uint32_t max_blocks) {
        if (n > max_blocks)
                return set_error(c, -EPROTO, "kvcd handed over %zu blocks for a layer of at most %u", n,
                                 max_blocks);
        for (size_t b = 0; b < n; b++) {
                int r = check_region(c, blocks[b], block_bytes);
                if (r < 0)
                        return r;
                t->offs[b] = blocks[b];
                t->ptrs[b] = c->base + blocks[b];
        }
        t->n = (uint32_t)n;
        return 0;
}

int kvc_session_import(struct kvc_client *c, const struct kvc_handoff *h, struct kvc_session **ret) {
        Kvc__HandoffImport m = KVC__HANDOFF_IMPORT__INIT;
        m.session_id = h->session_id;
        m.ticket.data = (uint8_t *)h->ticket;
        m.ticket.len = sizeof(h->ticket);
        Kvc__Envelope env = KVC__ENVELOPE__INIT, *in;
        env.body_case = KVC__ENVELOPE__BODY_HANDOFF_IMPORT;
        env.handoff_import = &m;
        int r = call(c, &env, KVC__ENVELOPE__BODY_HANDOFF_IMPORTED, &in);
        if (r < 0)
                return r;
        const Kvc__HandoffImported *hi = in->handoff_imported;
        const Kvc__Geometry *g = hi->geometry;
        struct kvc_geometry geo = { .n_layers = g->n_layers,
                                    .n_heads = g->n_heads,
                                    .n_kv_heads = g->n_kv_heads,
                                    .head_dim = g->head_dim,
                                    .dtype = dtype_of_wire(g->dtype),
                                    .max_tokens = g->max_tokens };
        struct kvc_session *s;
        if ((r = session_new(c, &geo, hi->opened, &s)) < 0)
                return r;
        uint32_t T = s->layout.block_tokens;
        for (uint32_t l = 0; l < geo.n_layers && r == 0; l++) {
                const Kvc__ResumeLayer *L = hi->layers[l];
                struct layer *SL = &s->layers[l];
                r = import_table(c, &SL->fp, L->fp_blocks, L->n_fp_blocks, s->layout.block_bytes,
                                 s->max_layer_blocks);
                if (r == 0 && L->n_q8_blocks && !s->q8_layout.block_bytes)
                        r = set_error(c, -EPROTO, "INT8 blocks handed over for a session without INT8");
                if (r == 0)
                        r = import_table(c, &SL->q8, L->q8_blocks, L->n_q8_blocks, s->q8_layout.block_bytes,
                                         s->max_layer_blocks);
                if (r == 0 && (L->n_tokens > s->max_layer_tokens || L->n_tokens - L->n_q8 > SL->fp.n * T ||
                               L->n_q8 > SL->q8.n * T))
                        r = set_error(c, -EPROTO, "layer %u: %u tokens do not fit the blocks handed over", l,
                                      L->n_tokens);
                SL->n_tokens = L->n_tokens;
                SL->n_q8 = L->n_q8;
        }
        if (r < 0) { /* the session is ours in kvcd: close it there too */
                kvc_session_close(s, NULL);
                return r;
        }
        s->last_step = hi->last_step;
        s->stepped = hi->stepped;
        s->last_plan_id = hi->last_plan_id;
        *ret = s;
        return 0;
}

int kvc_session_close(struct kvc_session *s, struct kvc_session_stats *ret_stats) {
        struct kvc_client *c = s->c;
        Kvc__CloseSession cs = KVC__CLOSE_SESSION__INIT;
        Kvc__Envelope env = KVC__ENVELOPE__INIT, *in;
        cs.session_id = s->id;
        env.body_case = KVC__ENVELOPE__BODY_CLOSE_SESSION;
        env.close_session = &cs;
        int r = call(c, &env, KVC__ENVELOPE__BODY_SESSION_CLOSED, &in);
        if (r == 0 && ret_stats) {
                struct kvc_session_stats st = s->stats;
                const Kvc__SessionStats *k = in->session_closed->stats;
                if (k) {
                        st.steps = k->steps;
                        st.plans = k->plans;
                        st.peak_tokens = k->peak_tokens;
                        st.peak_layer_blocks = k->peak_layer_blocks;
                        st.peak_bytes = k->peak_bytes;
                        st.bytes = k->bytes;
                }
                *ret_stats = st;
        }
        unlink_session(s);
        session_free(s);
        return r;
}

uint64_t kvc_session_last_step(const struct kvc_session *s, int *ret_stepped) {
        if (ret_stepped)
                *ret_stepped = s->stepped;
        return s->last_step;
}

uint32_t kvc_session_shared_tokens(const struct kvc_session *s) {
        return s->n_shared;
}

uint64_t kvc_session_id(const struct kvc_session *s) {
        return s->id;
}

uint32_t kvc_session_budget(const struct kvc_session *s) {
        return s->budget;
}

int kvc_session_reserve(struct kvc_session *s, uint32_t n_tokens) {
        struct kvc_client *c = s->c;
        Kvc__Reserve rs = KVC__RESERVE__INIT;
        Kvc__Envelope env = KVC__ENVELOPE__INIT, *in;
        rs.session_id = s->id;
        rs.n_tokens = n_tokens;
        env.body_case = KVC__ENVELOPE__BODY_RESERVE;
        env.reserve = &rs;
        int r = call(c, &env, KVC__ENVELOPE__BODY_GRANT, &in);
        return r < 0 ? r : apply_grant(c, in->grant);
}

#define DEVICE_POOL_HINT                                                                                     \
        "the pool is GPU memory: write and read it with CUDA kernels (kernels/cuda.h) at the blocks "        \
        "kvc_layer_view shows, and count tokens with kvc_append_slots"

int kvc_append(struct kvc_session *s, uint32_t layer, int32_t pos, const float *k, const float *v) {
        if (layer >= s->g.n_layers)
                return set_error(s->c, -EINVAL, "layer %u of %u", layer, s->g.n_layers);
        if (s->c->dev)
                return set_error(s->c, -ENOTSUP, "kvc_append: " DEVICE_POOL_HINT);
        if (s->closed_by_kvcd)
                return set_error(s->c, -s->closed_by_kvcd, "kvcd closed session %llu",
                                 (unsigned long long)s->id);
        struct layer *L = &s->layers[layer];
        const struct block_layout *l = &s->layout;
        uint32_t T = l->block_tokens, fp = L->n_tokens - L->n_q8;
        /* with a plan lag, the answers still on their way may bring room (grants, or plans that
         * compact the layer): take them before asking kvcd for more than the policy allows */
        while ((fp >= L->fp.n * T || L->n_tokens >= s->max_layer_tokens) && s->c->n_pending) {
                int r = kvc_poll(s->c, s->c->timeout_ms);
                if (r < 0)
                        return r;
                if (s->closed_by_kvcd)
                        return set_error(s->c, -s->closed_by_kvcd, "kvcd closed session %llu",
                                         (unsigned long long)s->id);
                fp = L->n_tokens - L->n_q8;
        }
        if (L->n_tokens >= s->max_layer_tokens) /* the scratch is sized for it, whatever kvcd granted */
                return set_error(s->c, -ENOSPC, "layer %u holds the %u tokens the session allows", layer,
                                 s->max_layer_tokens);
        if (fp >= L->fp.n * T) {
                int r = kvc_session_reserve(s, L->n_tokens + 1);
                if (r < 0)
                        return r;
                fp = L->n_tokens - L->n_q8; /* a plan may have been applied meanwhile */
                if (fp >= L->fp.n * T)
                        return set_error(s->c, -EPROTO, "kvcd granted no room for the next token");
        }
        uint32_t slot = fp % T, D = s->g.head_dim;
        uint8_t *b = L->fp.ptrs[fp / T];
        for (uint32_t h = 0; h < s->g.n_kv_heads; h++) {
                block_store_row(l->dtype, k + (size_t)h * D, block_key(l, b, h, slot), D);
                block_store_row(l->dtype, v + (size_t)h * D, block_value(l, b, h, slot), D);
                *(int32_t *)block_side(l, b, l->pos_offset, h, slot) = pos;
                *(float *)block_side(l, b, l->sum_offset, h, slot) = 0.0f;
                *(float *)block_side(l, b, l->ema_offset, h, slot) = 0.0f;
                *(float *)block_side(l, b, l->last_offset, h, slot) = 0.0f;
                *(float *)block_side(l, b, l->logw_offset, h, slot) = 0.0f;
        }
        L->n_tokens++;
        return 0;
}

int kvc_attend(struct kvc_session *s, uint32_t layer, const float *q, float *out) {
        if (layer >= s->g.n_layers)
                return set_error(s->c, -EINVAL, "layer %u of %u", layer, s->g.n_layers);
        if (s->c->dev)
                return set_error(s->c, -ENOTSUP, "kvc_attend: " DEVICE_POOL_HINT);
        int r;
        if (s->layers[layer].n_q8 == 0) { /* the reference: exactly the model's own attention */
                struct block_layer bl = layer_of(s, layer);
                r = attn_decode_ref(&bl, q, out, s->g.n_heads, s->ema_gamma, 1, s->attn_scratch);
        } else {
                struct mixed_layer ml = mixed_of(s, layer);
                r = attn_decode_mixed(&ml, q, out, s->g.n_heads, s->ema_gamma, 1, s->attn_scratch);
        }
        return r < 0 ? set_error(s->c, r, "attention over an empty layer %u", layer) : 0;
}

int kvc_append_slots(struct kvc_session *s, uint32_t layer, uint32_t n) {
        if (layer >= s->g.n_layers)
                return set_error(s->c, -EINVAL, "layer %u of %u", layer, s->g.n_layers);
        if (s->closed_by_kvcd)
                return set_error(s->c, -s->closed_by_kvcd, "kvcd closed session %llu",
                                 (unsigned long long)s->id);
        struct layer *L = &s->layers[layer];
        uint32_t T = s->layout.block_tokens;
        if (n > s->max_layer_tokens || L->n_tokens > s->max_layer_tokens - n)
                return set_error(s->c, -ENOSPC, "layer %u: %u more tokens pass the session's limit of %u",
                                 layer, n, s->max_layer_tokens);
        if (L->n_tokens - L->n_q8 + n > L->fp.n * T) {
                int r = kvc_session_reserve(s, L->n_tokens + n);
                if (r < 0)
                        return r;
                if (L->n_tokens - L->n_q8 + n > L->fp.n * T)
                        return set_error(s->c, -EPROTO, "kvcd granted no room for %u more tokens", n);
        }
        L->n_tokens += n;
        return 0;
}

int kvc_pool_is_device(const struct kvc_client *c) {
        return c->dev != NULL;
}

void *kvc_pool_base(const struct kvc_client *c) {
        return c->base == MAP_FAILED ? NULL : c->base;
}

int kvc_pool_device(const struct kvc_client *c) {
        return c->dev ? devpool_device(c->dev) : -1;
}

void kvc_set_compactor(struct kvc_client *c, kvc_compactor fn, void *ctx) {
        c->compactor = fn;
        c->compactor_ctx = ctx;
}

uint32_t kvc_layer_tokens(const struct kvc_session *s, uint32_t layer) {
        return layer < s->g.n_layers ? s->layers[layer].n_tokens : 0;
}

uint32_t kvc_layer_q8_tokens(const struct kvc_session *s, uint32_t layer) {
        return layer < s->g.n_layers ? s->layers[layer].n_q8 : 0;
}

int kvc_layer_view(const struct kvc_session *s, uint32_t layer, struct kvc_layer_view *ret) {
        if (layer >= s->g.n_layers)
                return -EINVAL;
        const struct layer *L = &s->layers[layer];
        *ret = (struct kvc_layer_view){ .n_tokens = L->n_tokens,
                                        .n_blocks = L->fp.n,
                                        .block_tokens = s->layout.block_tokens,
                                        .block_bytes = s->layout.block_bytes,
                                        .blocks = L->fp.ptrs,
                                        .n_q8 = L->n_q8,
                                        .n_q8_blocks = L->q8.n,
                                        .q8_block_bytes = s->q8_layout.block_bytes,
                                        .q8_blocks = L->q8.ptrs };
        return 0;
}

int kvc_summarize(const float *logits, uint32_t vocab, struct kvc_summary *ret) {
        struct summary sm;
        int r = summary_logits_ref(logits, vocab, &sm, NULL, 0);
        if (r < 0)
                return r;
        *ret = (struct kvc_summary){
                .entropy = sm.entropy, .top1_prob = sm.top1_prob, .margin = sm.margin, .top1 = sm.top1
        };
        return 0;
}

float kvc_confidence(const struct kvc_summary *s) {
        return 0.4f * (1.0f - s->entropy) + 0.3f / (1.0f + expf(-s->margin)) + 0.3f * s->top1_prob;
}

static int grow(void **p, size_t *cap, size_t need, size_t elem) {
        if (need <= *cap)
                return 0;
        size_t n = *cap ? *cap * 2 : 16;
        while (n < need)
                n *= 2;
        void *q = realloc(*p, n * elem);
        if (!q)
                return -ENOMEM;
        *p = q;
        *cap = n;
        return 0;
}

int kvc_step(struct kvc_session *s, uint64_t step, enum kvc_phase phase, const struct kvc_summary *sum) {
        struct kvc_client *c = s->c;
        if (s->closed_by_kvcd)
                return set_error(c, -s->closed_by_kvcd, "kvcd closed session %llu",
                                 (unsigned long long)s->id);
        if (s->stepped && step <= s->last_step)
                return set_error(c, -EINVAL, "step %llu is not after %llu", (unsigned long long)step,
                                 (unsigned long long)s->last_step);
        if (c->n_queue >= WIRE_MAX_STEPS)
                return set_error(c, -ENOSPC, "%u steps queued: flush first", WIRE_MAX_STEPS);
        if (grow((void **)&c->queue, &c->cap_queue, c->n_queue + 1, sizeof(*c->queue)) < 0 ||
            grow((void **)&c->lengths, &c->cap_lengths, c->n_lengths + s->g.n_layers, sizeof(uint32_t)) < 0)
                return -ENOMEM;
        c->queue[c->n_queue++] = (struct queued_step){
                .session_id = s->id,
                .prev_step = s->last_step,
                .prev_stepped = s->stepped,
                .step = step,
                .phase = phase,
                .entropy = sum->entropy,
                .top1_prob = sum->top1_prob,
                .margin = sum->margin,
                .n_layers = s->g.n_layers,
                .lengths_at = c->n_lengths,
        };
        for (uint32_t l = 0; l < s->g.n_layers; l++)
                c->lengths[c->n_lengths++] = s->layers[l].n_tokens;
        s->last_step = step;
        s->stepped = true;
        s->stats.steps++;
        return 0;
}

static int send_steps(struct kvc_client *c) {
        Kvc__Step *steps = calloc(c->n_queue, sizeof(*steps));
        Kvc__Step **sp = calloc(c->n_queue, sizeof(*sp));
        if (!steps || !sp) {
                free(steps);
                free(sp);
                return -ENOMEM;
        }
        for (size_t i = 0; i < c->n_queue; i++) {
                const struct queued_step *q = &c->queue[i];
                kvc__step__init(&steps[i]);
                steps[i].session_id = q->session_id;
                steps[i].step = q->step;
                steps[i].phase =
                        q->phase == KVC_PHASE_PREFILL ? KVC__PHASE__PHASE_PREFILL : KVC__PHASE__PHASE_DECODE;
                steps[i].n_layer_tokens = q->n_layers;
                steps[i].layer_tokens = c->lengths + q->lengths_at;
                steps[i].entropy = q->entropy;
                steps[i].top1_prob = q->top1_prob;
                steps[i].margin = q->margin;
                sp[i] = &steps[i];
        }
        Kvc__StepBatch sb = KVC__STEP_BATCH__INIT;
        sb.n_steps = c->n_queue;
        sb.steps = sp;
        Kvc__Envelope env = KVC__ENVELOPE__INIT;
        env.request_id = ++c->next_request_id;
        env.body_case = KVC__ENVELOPE__BODY_STEP_BATCH;
        env.step_batch = &sb;
        env.version = WIRE_VERSION;
        uint32_t slot = (c->pending_head + c->n_pending) % KVC_MAX_PENDING;
        struct sent_batch b = { .len = wire_packed_size(&env), .n_steps = c->n_queue };
        b.bytes = malloc(b.len);
        b.steps = malloc(c->n_queue * sizeof(*b.steps));
        int r = b.bytes && b.steps ? 0 : -ENOMEM;
        if (r == 0) {
                wire_pack(&env, b.bytes);
                memcpy(b.steps, c->queue, c->n_queue * sizeof(*b.steps));
                r = send_packed(c, b.bytes, b.len);
        }
        free(steps);
        free(sp);
        if (r < 0) {
                free(b.bytes);
                free(b.steps);
                return r;
        }
        c->sent[slot] = b;
        c->pending[slot] = env.request_id;
        c->n_pending++;
        c->n_queue = 0;
        c->n_lengths = 0;
        return 0;
}

int kvc_flush(struct kvc_client *c) {
        int r = 0;
        c->step_error = 0;
        if (c->n_queue) {
                if (c->n_pending >= KVC_MAX_PENDING - 1) /* make room: wait for the oldest answer */
                        while (c->n_pending >= KVC_MAX_PENDING - 1 && (r = kvc_poll(c, c->timeout_ms)) >= 0)
                                ;
                if (r < 0 || (r = send_steps(c)) < 0)
                        return r;
        }
        while (c->n_pending > c->plan_lag) {
                Kvc__Envelope *in;
                r = recv_env(c, c->timeout_ms, &in);
                if (r == -ENOTCONN && (r = recover(c)) == 0)
                        continue; /* the unanswered batches went again */
                if (r < 0)
                        return r;
                int q = dispatch(c, in);
                if (q < 0 && r == 0)
                        r = q;
        }
        return r < 0 ? r : c->step_error;
}

int kvc_poll(struct kvc_client *c, int timeout_ms) {
        int handled = 0;
        for (;;) {
                Kvc__Envelope *in;
                int r = recv_env(c, handled ? 0 : timeout_ms, &in);
                if (r == -ENOTCONN && (r = recover(c)) == 0)
                        continue;
                if (r == -ETIMEDOUT)
                        return handled;
                if (r < 0)
                        return r;
                dispatch(c, in);
                handled++;
        }
}

void kvc_session_get_stats(const struct kvc_session *s, struct kvc_session_stats *ret) {
        *ret = s->stats;
}

/* ---- kvc_fuzz.h: the daemon's side of the conversation, played by a fuzzer ---- */

#include "kvc_fuzz.h"

#define FUZZ_CHUNK_BYTES (64u * 1024u)
#define FUZZ_CHUNKS      8u

int kvc_fuzz_client_new(const struct kvc_geometry *g, uint32_t max_layer_tokens, uint64_t plan_bytes,
                        struct kvc_client **ret_c, struct kvc_session **ret_s) {
        struct kvc_client *c = calloc(1, sizeof(*c));
        struct kvc_session *s = calloc(1, sizeof(*s));
        int r = -ENOMEM;
        if (!c || !s)
                goto fail;
        c->fd = -1;
        c->base = MAP_FAILED;
        c->timeout_ms = 1;
        c->chunk_bytes = FUZZ_CHUNK_BYTES;
        c->pool_bytes = (uint64_t)FUZZ_CHUNKS * FUZZ_CHUNK_BYTES;
        c->n_chunks = FUZZ_CHUNKS;
        c->block_tokens = 16;
        c->mapped = malloc(FUZZ_CHUNKS);
        c->mapped_gen = calloc(FUZZ_CHUNKS, sizeof(*c->mapped_gen));
        c->base = mmap(NULL, c->pool_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (!c->mapped || !c->mapped_gen || c->base == MAP_FAILED ||
            wire_arena_new(WIRE_REPLY_MAX_BYTES * 2, &c->arena) < 0)
                goto fail;
        memset(c->mapped, 1, FUZZ_CHUNKS); /* every chunk "arrived" */

        r = -EINVAL;
        s->c = c;
        s->id = 1;
        s->g = *g;
        if (block_layout_init(&s->layout, 16, g->n_kv_heads, g->head_dim, (enum block_dtype)g->dtype) < 0 ||
            block_layout_init(&s->q8_layout, 16, g->n_kv_heads, g->head_dim, BLOCK_DTYPE_Q8) < 0 ||
            plan_bytes > FUZZ_CHUNK_BYTES || s->layout.block_bytes > FUZZ_CHUNK_BYTES)
                goto fail;
        s->max_layer_tokens = max_layer_tokens;
        s->max_layer_blocks = (max_layer_tokens + 15) / 16;
        s->ema_gamma = 0.9f;
        s->plan_offset = 0; /* chunk 0 is the plan buffer; blocks come in the others */
        s->plan_bytes = plan_bytes;
        s->layers = calloc(g->n_layers, sizeof(*s->layers));
        s->plan_copy = malloc(plan_bytes ? plan_bytes : 4);
        size_t slots = (size_t)s->max_layer_blocks * 16 + 1;
        struct mixed_layer probe = { .fp = &s->layout, .q8 = &s->q8_layout, .n_tokens = (uint32_t)slots };
        size_t attn = attn_mixed_scratch_floats(&probe, g->n_heads),
               cs = compact_mixed_scratch_floats(&probe);
        s->attn_scratch = malloc((attn > 2 * slots ? attn : 2 * slots) * sizeof(float));
        s->compact_scratch =
                malloc((cs > 2 * (size_t)g->head_dim ? cs : 2 * (size_t)g->head_dim) * sizeof(float));
        r = -ENOMEM;
        if (!s->layers || !s->plan_copy || !s->attn_scratch || !s->compact_scratch)
                goto fail;
        for (uint32_t l = 0; l < g->n_layers; l++) {
                struct layer *L = &s->layers[l];
                L->fp.offs = calloc(s->max_layer_blocks + 1, sizeof(uint64_t));
                L->fp.ptrs = calloc(s->max_layer_blocks + 1, sizeof(uint8_t *));
                L->q8.offs = calloc(s->max_layer_blocks + 1, sizeof(uint64_t));
                L->q8.ptrs = calloc(s->max_layer_blocks + 1, sizeof(uint8_t *));
                if (!L->fp.offs || !L->fp.ptrs || !L->q8.offs || !L->q8.ptrs)
                        goto fail;
        }
        c->sessions = s;
        *ret_c = c;
        *ret_s = s;
        return 0;
fail:
        if (s && s->layers)
                for (uint32_t l = 0; l < g->n_layers; l++) {
                        free(s->layers[l].fp.offs);
                        free(s->layers[l].fp.ptrs);
                        free(s->layers[l].q8.offs);
                        free(s->layers[l].q8.ptrs);
                }
        if (s) {
                free(s->layers);
                free(s->plan_copy);
                free(s->attn_scratch);
                free(s->compact_scratch);
        }
        free(s);
        if (c) {
                c->sessions = NULL;
                kvc_disconnect(c);
        }
        return r;
}

uint8_t *kvc_fuzz_pool(struct kvc_client *c, uint64_t *ret_bytes) {
        *ret_bytes = c->pool_bytes;
        return c->base;
}

int kvc_fuzz_feed(struct kvc_client *c, const void *data, size_t len) {
        Kvc__Envelope *env;
        char why[WIRE_MAX_MESSAGE];
        int r = wire_decode(c->arena, data, len, WIRE_REPLY_MAX_BYTES, &env, why, sizeof(why));
        return r < 0 ? r : dispatch(c, env);
}

int kvc_fuzz_step(struct kvc_session *s, uint64_t step, const float *kv, const float *q, float *out) {
        for (uint32_t l = 0; l < s->g.n_layers; l++) {
                int r = kvc_append(s, l, (int32_t)step, kv, kv);
                if (r < 0)
                        return r;
                if ((r = kvc_attend(s, l, q, out)) < 0)
                        return r;
        }
        s->last_step = step;
        s->stepped = true;
        return 0;
}
