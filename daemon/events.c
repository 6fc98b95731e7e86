/* events.c: the KV event publisher (see events.h): the prompts' hash chains, the PUB socket and
 * its endpoints, the choice of wire format (one table row per format), and the replay ROUTER.
 *
 * Sequence numbers start at 0 when kvcd starts (vLLM's publisher does the same) and go up by one
 * a message, whatever the format; every message is one batch of one event. kvcd announces
 * AllBlocksCleared as its first message on every start, with or without the fd store: the hash
 * chains live only in memory (restart.c does not record them), so a kvcd that restarted cannot
 * send BlockRemoved for what the previous one published, and a router must forget the node's
 * blocks. A subscriber that joins late gets that message from the replay socket (seq 0).
 */
#include "events.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#include "backend.h"
#include "kvcd.h"
#include "log.h"

#define EVENTS_BLOCK 16u
/* Replay requests answered per call of events_replay_run: one request can be answered with the
 * whole ring, so the main loop does a bounded amount of it per round. */
#define EVENTS_REPLAYS_PER_ROUND 4

struct events {
        const struct events_format *format;
        const char *medium;
        void *zreplay; /* ROUTER, or NULL */
        struct events_ring *ring;
        /* the connections answered, while they last: ZeroMQ's descriptor and its socket's inode
         * (a descriptor number is reused, an inode is not while the socket is open) */
        struct replay_peer {
                int fd;
                ino_t ino;
        } peers[EVENTS_REPLAY_MAX_PEERS];
        uint32_t n_peers;
        uint64_t replay_refused; /* requests dropped: every peer slot taken */
        char replay_path[300];
        struct idmap held; /* per-node formats: block hash -> how many sessions hold it */
};

static int encode_kvcd(uint64_t ts_usec, const struct events_event *evs, size_t n, uint8_t **ret_buf,
                       size_t *ret_len);

/* One row per --events-format: its encoder and its name for a backend's memory. */
static const struct events_format {
        const char *name;
        events_encode_fn encode;
        const char *(*medium)(const char *backend_name); /* NULL: the backend's own name */
        /* true: events say what the node holds (a hash is stored when the first session holds it
         * and removed when the last lets go, as vLLM's block pool does); false: what each
         * session holds, with its id */
        bool per_node;
} formats[] = {
        { "kvcd", encode_kvcd, NULL, false },
        { "vllm", events_vllm_encode, events_vllm_medium, true },
};

static const struct events_format *format_named(const char *name) {
        for (size_t i = 0; i < sizeof(formats) / sizeof(formats[0]); i++)
                if (strcmp(formats[i].name, name ? name : "kvcd") == 0)
                        return &formats[i];
        return NULL;
}

bool events_format_known(const char *name) {
        return format_named(name) != NULL;
}

uint64_t events_block_hash(uint64_t parent, const uint32_t *ids, uint32_t n) {
        uint64_t h = 0xcbf29ce484222325ull;
        uint8_t bytes[8];
        for (int i = 0; i < 8; i++)
                bytes[i] = (uint8_t)(parent >> (8 * i));
        for (int i = 0; i < 8; i++)
                h = (h ^ bytes[i]) * 0x100000001b3ull;
        for (uint32_t t = 0; t < n; t++)
                for (int i = 0; i < 4; i++)
                        h = (h ^ (uint8_t)(ids[t] >> (8 * i))) * 0x100000001b3ull;
        return h ? h : 1; /* 0 means "no parent" */
}

static int encode_kvcd(uint64_t ts_usec, const struct events_event *evs, size_t n, uint8_t **ret_buf,
                       size_t *ret_len) {
        Kvc__KvEventBatch b = KVC__KV_EVENT_BATCH__INIT;
        Kvc__KvEvent ev[1] = { KVC__KV_EVENT__INIT }, *evp[1] = { &ev[0] };
        Kvc__KvBlockStored st = KVC__KV_BLOCK_STORED__INIT;
        Kvc__KvBlockRemoved rm = KVC__KV_BLOCK_REMOVED__INIT;
        Kvc__KvAllBlocksCleared cl = KVC__KV_ALL_BLOCKS_CLEARED__INIT;
        if (n != 1) /* kvcd publishes one event a batch */
                return -EINVAL;
        const struct events_event *e = &evs[0];
        switch (e->kind) {
        case EVENTS_KIND_STORED:
                st.n_block_hashes = e->n_block_hashes;
                st.block_hashes = (uint64_t *)e->block_hashes;
                st.parent_block_hash = e->parent_block_hash;
                st.n_token_ids = e->n_token_ids;
                st.token_ids = (uint32_t *)e->token_ids;
                st.block_size = e->block_size;
                st.session_id = e->session_id;
                st.medium = (char *)e->medium;
                ev[0].event_case = KVC__KV_EVENT__EVENT_STORED;
                ev[0].stored = &st;
                break;
        case EVENTS_KIND_REMOVED:
                rm.n_block_hashes = e->n_block_hashes;
                rm.block_hashes = (uint64_t *)e->block_hashes;
                rm.session_id = e->session_id;
                rm.medium = (char *)e->medium;
                ev[0].event_case = KVC__KV_EVENT__EVENT_REMOVED;
                ev[0].removed = &rm;
                break;
        case EVENTS_KIND_CLEARED:
                ev[0].event_case = KVC__KV_EVENT__EVENT_CLEARED;
                ev[0].cleared = &cl;
                break;
        }
        b.ts_usec = ts_usec;
        b.n_events = 1;
        b.events = evp;
        size_t len = wire_event_packed_size(&b);
        uint8_t *buf = malloc(len ? len : 1);
        if (!buf)
                return -ENOMEM;
        wire_event_pack(&b, buf);
        *ret_buf = buf;
        *ret_len = len;
        return 0;
}

/* Encodes one event, sends it (a subscriber that cannot keep up loses it: PUB) and keeps it for
 * replay. The sequence number is spent even when encoding fails, so subscribers see the loss. */
static void publish(struct kvcd *d, const struct events_event *ev) {
        struct events *es = d->events;
        if (!d->zevents || !es)
                return;
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        uint64_t seq = d->event_seq++;
        uint8_t *buf;
        size_t n;
        if (es->format->encode((uint64_t)ts.tv_sec * 1000000u + (uint64_t)ts.tv_nsec / 1000u, ev, 1, &buf,
                               &n) < 0) {
                log_warning("KV event %llu lost: no memory to encode it", (unsigned long long)seq);
                return;
        }
        uint8_t sq[8];
        for (int i = 0; i < 8; i++)
                sq[i] = (uint8_t)(seq >> (56 - 8 * i));
        zmq_send(d->zevents, EVENTS_TOPIC, sizeof(EVENTS_TOPIC) - 1, ZMQ_SNDMORE | ZMQ_DONTWAIT);
        zmq_send(d->zevents, sq, sizeof(sq), ZMQ_SNDMORE | ZMQ_DONTWAIT);
        zmq_send(d->zevents, buf, n, ZMQ_DONTWAIT);
        if (es->ring)
                events_ring_push(es->ring, seq, &buf, n);
        free(buf);
}

static void cleared(struct kvcd *d) {
        struct events_event ev = { .kind = EVENTS_KIND_CLEARED };
        publish(d, &ev);
}

/* The options both sockets share: no linger, a send high-water mark, heartbeats (a router on
 * another machine that vanishes is dropped within 12 s, its pipe with it), and a cap on what a
 * peer may send (subscriptions and replay requests are short). */
static int tune(void *z, int hwm, int64_t max_in_bytes) {
        int zero = 0, ivl = 2000, timeout = 10000;
        return zmq_setsockopt(z, ZMQ_LINGER, &zero, sizeof(zero)) < 0 ||
                               zmq_setsockopt(z, ZMQ_SNDHWM, &hwm, sizeof(hwm)) < 0 ||
                               zmq_setsockopt(z, ZMQ_HEARTBEAT_IVL, &ivl, sizeof(ivl)) < 0 ||
                               zmq_setsockopt(z, ZMQ_HEARTBEAT_TIMEOUT, &timeout, sizeof(timeout)) < 0 ||
                               zmq_setsockopt(z, ZMQ_HANDSHAKE_IVL, &ivl, sizeof(ivl)) < 0 || /* fdguard.h */
                               zmq_setsockopt(z, ZMQ_MAXMSGSIZE, &max_in_bytes, sizeof(max_in_bytes)) < 0
                       ? -zmq_errno()
                       : 0;
}

static int open_replay(struct kvcd *d, struct events *es) {
        char ep[320];
        int r = events_ring_new(d->cfg.events_replay_buffer, EVENTS_REPLAY_MAX_BYTES, &es->ring);
        if (r < 0)
                return r;
        snprintf(es->replay_path, sizeof(es->replay_path), "%s/%s", d->cfg.runtime_dir, EVENTS_REPLAY_PATH);
        snprintf(ep, sizeof(ep), "ipc://%s", es->replay_path);
        es->zreplay = zmq_socket(d->zctx, ZMQ_ROUTER);
        if (!es->zreplay)
                return -zmq_errno();
        /* one window and its end marker fit in a subscriber's pipe whatever it has read (ZeroMQ
         * learns what the reader took only every half high-water mark); a request is [empty, 8 bytes] */
        if ((r = tune(es->zreplay, (int)EVENTS_REPLAY_HWM, 64)) < 0)
                return r;
        if ((unlink(es->replay_path) < 0 && errno != ENOENT) || zmq_bind(es->zreplay, ep) < 0)
                return -zmq_errno();
        chmod(es->replay_path, 0660);
        if (d->cfg.events_replay_endpoint && zmq_bind(es->zreplay, d->cfg.events_replay_endpoint) < 0) {
                r = -zmq_errno();
                log_error("cannot bind the KV event replay socket to %s: %s", d->cfg.events_replay_endpoint,
                          zmq_strerror(-r));
                return r;
        }
        return 0;
}

int events_open(struct kvcd *d) {
        char ep[300];
        int r;
        struct events *es = calloc(1, sizeof(*es));
        if (!es)
                return -ENOMEM;
        d->events = es;
        if ((r = idmap_init(&es->held, 64)) < 0)
                return r;
        es->format = format_named(d->cfg.events_format);
        if (!es->format)
                return -EINVAL; /* main.c checked the name */
        es->medium = es->format->medium ? es->format->medium(d->backend->name) : d->backend->name;
        d->zevents = zmq_socket(d->zctx, ZMQ_PUB);
        if (!d->zevents)
                return -zmq_errno();
        snprintf(ep, sizeof(ep), "ipc://%s", d->events_path);
        if (tune(d->zevents, 10000, 256) < 0 ||
            (d->events_fd >= 0 &&
             zmq_setsockopt(d->zevents, ZMQ_USE_FD, &d->events_fd, sizeof(d->events_fd)) < 0) ||
            (d->events_fd < 0 && unlink(d->events_path) < 0 && errno != ENOENT) ||
            zmq_bind(d->zevents, ep) < 0) {
                r = -zmq_errno();
                zmq_close(d->zevents);
                d->zevents = NULL;
                return r;
        }
        if (d->events_fd < 0)
                chmod(d->events_path, 0660);
        if (d->cfg.events_endpoint && zmq_bind(d->zevents, d->cfg.events_endpoint) < 0) {
                r = -zmq_errno();
                log_error("cannot bind the KV event socket to %s: %s", d->cfg.events_endpoint,
                          zmq_strerror(-r));
                return r;
        }
        if (d->cfg.events_replay_buffer && (r = open_replay(d, es)) < 0)
                return r;
        log_info("KV events: format %s, token ids %s%s%s, replay buffer %u", es->format->name,
                 d->cfg.events_token_ids ? "published" : "withheld",
                 d->cfg.events_endpoint ? ", also on " : "",
                 d->cfg.events_endpoint ? d->cfg.events_endpoint : "", d->cfg.events_replay_buffer);
        cleared(d); /* a fresh kvcd holds nothing, and knows nothing of what a previous one published */
        return 0;
}

void events_close(struct kvcd *d) {
        struct events *es = d->events;
        if (d->zevents) {
                cleared(d);
                zmq_close(d->zevents);
                d->zevents = NULL;
        }
        if (!es)
                return;
        if (es->zreplay) {
                zmq_close(es->zreplay);
                unlink(es->replay_path);
        }
        events_ring_free(es->ring);
        if (es->held.keys)
                idmap_done(&es->held);
        free(es);
        d->events = NULL;
}

void *events_replay_socket(const struct kvcd *d) {
        return d->events ? d->events->zreplay : NULL;
}

/* Reads one request: 0, the start seq and the descriptor of the connection it came on (ZeroMQ's,
 * from its first frame after the routing id: the routing id frame is ZeroMQ's own and carries
 * none), -EAGAIN when none waits, -EPROTO for a malformed one (read to its end and dropped, as
 * vLLM's publisher drops it). */
static int replay_request(void *z, zmq_msg_t *rid, uint64_t *ret_from, int *ret_fd) {
        zmq_msg_t part;
        int n = 0, r = 0;
        *ret_fd = -1;
        uint64_t from = 0;
        if (zmq_msg_recv(rid, z, ZMQ_DONTWAIT) < 0)
                return -EAGAIN;
        for (bool more = zmq_msg_more(rid); more; n++) {
                zmq_msg_init(&part);
                if (zmq_msg_recv(&part, z, ZMQ_DONTWAIT) < 0) {
                        zmq_msg_close(&part);
                        return -EPROTO;
                }
                more = zmq_msg_more(&part);
                if (n == 0)
                        *ret_fd = zmq_msg_get(&part, ZMQ_SRCFD);
                if ((n == 0 && zmq_msg_size(&part) != 0) || (n == 1 && zmq_msg_size(&part) != 8) || n > 1)
                        r = -EPROTO;
                else if (n == 1)
                        for (int i = 0; i < 8; i++)
                                from = from << 8 | ((const uint8_t *)zmq_msg_data(&part))[i];
                zmq_msg_close(&part);
        }
        if (r == 0 && n != 2)
                r = -EPROTO;
        *ret_from = from;
        return r;
}

/* Whether the connection a request came on may be answered: one of the answered ones, or a new
 * one while a slot is free (slots of closed connections are freed first). */
static bool replay_admit(struct events *es, int fd) {
        struct stat st;
        if (fd < 0 || fstat(fd, &st) < 0)
                return false;
        for (uint32_t i = 0; i < es->n_peers; i++)
                if (es->peers[i].fd == fd && es->peers[i].ino == st.st_ino)
                        return true;
        for (uint32_t i = 0; i < es->n_peers;) {
                struct stat p;
                if (fstat(es->peers[i].fd, &p) < 0 || p.st_ino != es->peers[i].ino)
                        es->peers[i] = es->peers[--es->n_peers];
                else
                        i++;
        }
        if (es->n_peers >= EVENTS_REPLAY_MAX_PEERS)
                return false;
        es->peers[es->n_peers++] = (struct replay_peer){ .fd = fd, .ino = st.st_ino };
        return true;
}

static int replay_send(void *z, zmq_msg_t *rid, const uint8_t sq[8], const void *buf, size_t len) {
        zmq_msg_t id;
        zmq_msg_init(&id);
        zmq_msg_copy(&id, rid);
        int r = zmq_msg_send(&id, z, ZMQ_SNDMORE | ZMQ_DONTWAIT) < 0 ||
                                zmq_send(z, "", 0, ZMQ_SNDMORE | ZMQ_DONTWAIT) < 0 ||
                                zmq_send(z, sq, 8, ZMQ_SNDMORE | ZMQ_DONTWAIT) < 0 ||
                                zmq_send(z, buf, len, ZMQ_DONTWAIT) < 0
                        ? -zmq_errno()
                        : 0;
        zmq_msg_close(&id);
        return r;
}

void events_replay_run(struct kvcd *d) {
        struct events *es = d->events;
        if (!es || !es->zreplay)
                return;
        for (int k = 0; k < EVENTS_REPLAYS_PER_ROUND; k++) {
                zmq_msg_t rid;
                uint64_t from;
                int fd;
                zmq_msg_init(&rid);
                int r = replay_request(es->zreplay, &rid, &from, &fd);
                if (r == -EAGAIN) {
                        zmq_msg_close(&rid);
                        return;
                }
                if (r < 0) {
                        log_debug("KV event replay: a malformed request, dropped");
                        zmq_msg_close(&rid);
                        continue;
                }
                if (!replay_admit(es, fd)) {
                        if (es->replay_refused++ == 0)
                                log_warning("KV event replay: %u connections are being answered (the "
                                            "limit); requests from others are dropped",
                                            EVENTS_REPLAY_MAX_PEERS);
                        zmq_msg_close(&rid);
                        continue;
                }
                uint64_t seq;
                const uint8_t *buf;
                size_t len;
                uint32_t sent = 0;
                for (uint32_t i = 0; i < EVENTS_REPLAY_WINDOW && /* then it asks again from the next */
                                     events_ring_get(es->ring, from, i, &seq, &buf, &len) == 0;
                     i++) {
                        uint8_t sq[8];
                        for (int b = 0; b < 8; b++)
                                sq[b] = (uint8_t)(seq >> (56 - 8 * b));
                        if (replay_send(es->zreplay, &rid, sq, buf, len) < 0)
                                break; /* the subscriber's pipe is full or it left: it asks again */
                        sent++;
                }
                static const uint8_t end[8] = { 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff };
                replay_send(es->zreplay, &rid, end, "", 0);
                log_debug("KV event replay from %llu: %u messages", (unsigned long long)from, sent);
                zmq_msg_close(&rid);
        }
}

int events_session_opened(struct kvcd *d, struct session *s, const uint32_t *ids, size_t n) {
        (void)d;
        uint32_t blocks = (uint32_t)(n / EVENTS_BLOCK);
        if (blocks == 0)
                return 0;
        s->prompt_ids = malloc((size_t)blocks * EVENTS_BLOCK * sizeof(uint32_t));
        s->block_hashes = malloc(blocks * sizeof(uint64_t));
        if (!s->prompt_ids || !s->block_hashes)
                return -ENOMEM;
        memcpy(s->prompt_ids, ids, (size_t)blocks * EVENTS_BLOCK * sizeof(uint32_t));
        uint64_t h = 0;
        for (uint32_t b = 0; b < blocks; b++)
                s->block_hashes[b] = h = events_block_hash(h, ids + (size_t)b * EVENTS_BLOCK, EVENTS_BLOCK);
        s->prompt_blocks = s->prompt_alive = blocks;
        return 0;
}

/* Per-node formats count the sessions that hold each hash: returns the first of hashes[0..n) that
 * no session held before (n: none), counting them all as held once more now. A session holds a
 * prefix of its chain and a hash stands for its whole prefix, so the new ones are a suffix. */
static uint32_t hold(struct events *es, const uint64_t *h, uint32_t n) {
        uint32_t first = n;
        for (uint32_t i = 0; i < n; i++) {
                uintptr_t c = (uintptr_t)idmap_del(&es->held, h[i]);
                if (c == 0 && first == n)
                        first = i;
                if (idmap_put(&es->held, h[i], (void *)(c + 1)) < 0)
                        log_warning("KV events: no memory to count the holders of a block");
        }
        return first;
}

/* The reverse: returns the first of hashes[0..n) that no session holds any more (n: none). */
static uint32_t unhold(struct events *es, const uint64_t *h, uint32_t n) {
        uint32_t first = n;
        for (uint32_t i = 0; i < n; i++) {
                uintptr_t c = (uintptr_t)idmap_del(&es->held, h[i]);
                if (c > 1 && idmap_put(&es->held, h[i], (void *)(c - 1)) < 0)
                        log_warning("KV events: no memory to count the holders of a block");
                if (c <= 1 && first == n)
                        first = i;
        }
        return first;
}

void events_session_progress(struct kvcd *d, struct session *s) {
        uint64_t whole = s->appended / EVENTS_BLOCK;
        uint32_t upto = whole < s->prompt_alive ? (uint32_t)whole : s->prompt_alive;
        struct events *es = d->events;
        if (upto <= s->blocks_stored || !es)
                return;
        uint32_t from = s->blocks_stored, n = upto - from;
        if (es->format->per_node)
                from += hold(es, s->block_hashes + from, n);
        s->blocks_stored = upto;
        if (from == upto)
                return; /* other sessions hold all of them: the node announced them already */
        for (; from < upto; from += n) { /* a message per EVENTS_MESSAGE_BLOCKS blocks */
                n = upto - from < EVENTS_MESSAGE_BLOCKS ? upto - from : EVENTS_MESSAGE_BLOCKS;
                struct events_event ev = {
                        .kind = EVENTS_KIND_STORED,
                        .block_hashes = s->block_hashes + from,
                        .n_block_hashes = n,
                        .parent_block_hash = from ? s->block_hashes[from - 1] : 0,
                        .token_ids = s->prompt_ids + (size_t)from * EVENTS_BLOCK,
                        .n_token_ids = d->cfg.events_token_ids ? (size_t)n * EVENTS_BLOCK : 0,
                        .block_size = EVENTS_BLOCK,
                        .session_id = s->id,
                        .medium = es->medium,
                };
                publish(d, &ev);
        }
}

static void removed(struct kvcd *d, struct session *s, uint32_t from) {
        struct events *es = d->events;
        if (from >= s->blocks_stored || !es)
                return;
        uint32_t upto = s->blocks_stored;
        s->blocks_stored = from;
        if (es->format->per_node)
                from += unhold(es, s->block_hashes + from, upto - from);
        if (from == upto)
                return; /* other sessions still hold them */
        for (uint32_t n; from < upto; from += n) {
                n = upto - from < EVENTS_MESSAGE_BLOCKS ? upto - from : EVENTS_MESSAGE_BLOCKS;
                struct events_event ev = {
                        .kind = EVENTS_KIND_REMOVED,
                        .block_hashes = s->block_hashes + from,
                        .n_block_hashes = n,
                        .session_id = s->id,
                        .medium = es->medium,
                };
                publish(d, &ev);
        }
}

void events_session_evicted(struct kvcd *d, struct session *s, uint32_t intact) {
        if (intact >= s->prompt_alive)
                return;
        s->prompt_alive = intact; /* evicted prompt tokens never come back */
        removed(d, s, intact);
}

void events_session_closed(struct kvcd *d, struct session *s) {
        removed(d, s, 0);
        free(s->prompt_ids);
        free(s->block_hashes);
        s->prompt_ids = NULL;
        s->block_hashes = NULL;
}
