/* events_ring.c: the replay buffer of the KV events (see events.h): the last messages published,
 * oldest first, in a circular array of max_entries slots, and at most max_bytes of payload.
 *
 * Invariant: the kept messages are consecutive in publication (none missing between the oldest
 * and the newest), so a subscriber that replays from seq gets either everything from seq on or,
 * when seq is older than the oldest kept, a first message after seq and knows what it lost.
 * A lookup is a binary search on the seqs, which increase around the ring.
 */
#include <errno.h>
#include <stdlib.h>

#include "events.h"

struct events_ring_entry {
        uint64_t seq;
        uint8_t *buf;
        size_t len;
};

struct events_ring {
        uint32_t max_entries;
        size_t max_bytes;
        uint32_t head; /* the oldest */
        uint32_t count;
        size_t bytes;
        struct events_ring_entry e[];
};

int events_ring_new(uint32_t max_entries, size_t max_bytes, struct events_ring **ret) {
        if (max_entries == 0 || max_entries > EVENTS_REPLAY_MAX)
                return -EINVAL;
        struct events_ring *r = calloc(1, sizeof(*r) + (size_t)max_entries * sizeof(r->e[0]));
        if (!r)
                return -ENOMEM;
        r->max_entries = max_entries;
        r->max_bytes = max_bytes;
        *ret = r;
        return 0;
}

static void drop_oldest(struct events_ring *r) {
        struct events_ring_entry *o = &r->e[r->head];
        r->bytes -= o->len;
        free(o->buf);
        o->buf = NULL;
        r->head = (r->head + 1) % r->max_entries;
        r->count--;
}

struct events_ring *events_ring_free(struct events_ring *r) {
        if (!r)
                return NULL;
        while (r->count)
                drop_oldest(r);
        free(r);
        return NULL;
}

void events_ring_push(struct events_ring *r, uint64_t seq, uint8_t **buf, size_t len) {
        if (len > r->max_bytes) { /* it cannot be kept: neither can anything before it */
                while (r->count)
                        drop_oldest(r);
                free(*buf);
                *buf = NULL;
                return;
        }
        while (r->count && (r->count == r->max_entries || r->bytes + len > r->max_bytes))
                drop_oldest(r);
        struct events_ring_entry *e = &r->e[(r->head + r->count) % r->max_entries];
        e->seq = seq;
        e->buf = *buf;
        e->len = len;
        *buf = NULL;
        r->count++;
        r->bytes += len;
}

int events_ring_get(const struct events_ring *r, uint64_t from_seq, uint32_t i, uint64_t *ret_seq,
                    const uint8_t **ret_buf, size_t *ret_len) {
        uint32_t lo = 0, hi = r->count; /* the first kept index whose seq >= from_seq */
        while (lo < hi) {
                uint32_t mid = lo + (hi - lo) / 2;
                if (r->e[(r->head + mid) % r->max_entries].seq < from_seq)
                        lo = mid + 1;
                else
                        hi = mid;
        }
        if (i >= r->count - lo)
                return -ENOENT;
        const struct events_ring_entry *e = &r->e[(r->head + lo + i) % r->max_entries];
        *ret_seq = e->seq;
        *ret_buf = e->buf;
        *ret_len = e->len;
        return 0;
}

uint32_t events_ring_count(const struct events_ring *r) {
        return r->count;
}

size_t events_ring_bytes(const struct events_ring *r) {
        return r->bytes;
}
