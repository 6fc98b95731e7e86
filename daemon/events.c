/* events.c: the KV event publisher (see events.h). */
#include "events.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#include "backend.h"
#include "kvcd.h"
#include "log.h"

#define EVENTS_TOPIC "kv-events"
#define EVENTS_BLOCK 16u

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

static void publish(struct kvcd *d, Kvc__KvEvent *ev) {
        if (!d->zevents)
                return;
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        Kvc__KvEventBatch b = KVC__KV_EVENT_BATCH__INIT;
        Kvc__KvEvent *evs[1] = { ev };
        b.ts_usec = (uint64_t)ts.tv_sec * 1000000u + (uint64_t)ts.tv_nsec / 1000u;
        b.n_events = 1;
        b.events = evs;
        size_t n = wire_event_packed_size(&b);
        uint8_t *buf = malloc(n ? n : 1);
        if (!buf)
                return;
        wire_event_pack(&b, buf);
        uint8_t seq[8];
        d->event_seq++;
        for (int i = 0; i < 8; i++)
                seq[i] = (uint8_t)(d->event_seq >> (56 - 8 * i));
        zmq_send(d->zevents, EVENTS_TOPIC, sizeof(EVENTS_TOPIC) - 1, ZMQ_SNDMORE | ZMQ_DONTWAIT);
        zmq_send(d->zevents, seq, sizeof(seq), ZMQ_SNDMORE | ZMQ_DONTWAIT);
        zmq_send(d->zevents, buf, n, ZMQ_DONTWAIT);
        free(buf);
}

static void cleared(struct kvcd *d) {
        Kvc__KvAllBlocksCleared c = KVC__KV_ALL_BLOCKS_CLEARED__INIT;
        Kvc__KvEvent ev = KVC__KV_EVENT__INIT;
        ev.event_case = KVC__KV_EVENT__EVENT_CLEARED;
        ev.cleared = &c;
        publish(d, &ev);
}

int events_open(struct kvcd *d) {
        char ep[300];
        int zero = 0, hwm = 10000;
        d->zevents = zmq_socket(d->zctx, ZMQ_PUB);
        if (!d->zevents)
                return -zmq_errno();
        snprintf(ep, sizeof(ep), "ipc://%s", d->events_path);
        if (zmq_setsockopt(d->zevents, ZMQ_LINGER, &zero, sizeof(zero)) < 0 ||
            zmq_setsockopt(d->zevents, ZMQ_SNDHWM, &hwm, sizeof(hwm)) < 0 ||
            (d->events_fd >= 0 &&
             zmq_setsockopt(d->zevents, ZMQ_USE_FD, &d->events_fd, sizeof(d->events_fd)) < 0) ||
            (d->events_fd < 0 && unlink(d->events_path) < 0 && errno != ENOENT) ||
            zmq_bind(d->zevents, ep) < 0) {
                int r = -zmq_errno();
                zmq_close(d->zevents);
                d->zevents = NULL;
                return r;
        }
        if (d->events_fd < 0)
                chmod(d->events_path, 0660);
        cleared(d); /* a fresh kvcd holds nothing */
        return 0;
}

void events_close(struct kvcd *d) {
        if (!d->zevents)
                return;
        cleared(d);
        zmq_close(d->zevents);
        d->zevents = NULL;
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

void events_session_progress(struct kvcd *d, struct session *s) {
        uint64_t whole = s->appended / EVENTS_BLOCK;
        uint32_t upto = whole < s->prompt_alive ? (uint32_t)whole : s->prompt_alive;
        if (upto <= s->blocks_stored)
                return;
        Kvc__KvBlockStored st = KVC__KV_BLOCK_STORED__INIT;
        Kvc__KvEvent ev = KVC__KV_EVENT__INIT;
        st.n_block_hashes = upto - s->blocks_stored;
        st.block_hashes = s->block_hashes + s->blocks_stored;
        st.parent_block_hash = s->blocks_stored ? s->block_hashes[s->blocks_stored - 1] : 0;
        st.n_token_ids = (size_t)st.n_block_hashes * EVENTS_BLOCK;
        st.token_ids = s->prompt_ids + (size_t)s->blocks_stored * EVENTS_BLOCK;
        st.block_size = EVENTS_BLOCK;
        st.session_id = s->id;
        st.medium = (char *)d->backend->name;
        ev.event_case = KVC__KV_EVENT__EVENT_STORED;
        ev.stored = &st;
        publish(d, &ev);
        s->blocks_stored = upto;
}

static void removed(struct kvcd *d, struct session *s, uint32_t from) {
        if (from >= s->blocks_stored)
                return;
        Kvc__KvBlockRemoved rm = KVC__KV_BLOCK_REMOVED__INIT;
        Kvc__KvEvent ev = KVC__KV_EVENT__INIT;
        rm.n_block_hashes = s->blocks_stored - from;
        rm.block_hashes = s->block_hashes + from;
        rm.session_id = s->id;
        rm.medium = (char *)d->backend->name;
        ev.event_case = KVC__KV_EVENT__EVENT_REMOVED;
        ev.removed = &rm;
        publish(d, &ev);
        s->blocks_stored = from;
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
