/* test_replay.c: what the KV event replay socket can make kvcd hold (daemon/events.c; issue 28,
 * item 3).
 *
 * kvcd's event publisher in process, its replay buffer filled with 961 messages (30 prompts of
 * 16,384 tokens with their token ids: BlockStored and BlockRemoved, 16 messages each), and
 * subscribers over the real ipc socket. Peers that ask many times and never read: kvcd's heap
 * (mallinfo2, every thread's arena: ZeroMQ's copies of the answers are in it) grows by at most the
 * stated bound, and only EVENTS_REPLAY_MAX_PEERS of them are answered; before, each got a copy
 * of the whole ring. A subscriber that reads gets everything, one window at a time, in order.
 * Waits are polls with deadlines.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <malloc.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#include <cmocka.h>

#include "backend.h"
#include "events.h"
#include "kvcd.h"

#define PROMPT    16384u
#define SESSIONS  30u
#define PEERS     20u
#define ASKS      2u
#define DEADLINE  20000

static int64_t now_ms(void) {
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static size_t heap_in_use(void) {
        struct mallinfo2 mi = mallinfo2();
        return mi.uordblks + mi.hblkhd;
}

struct fixture {
        struct kvcd d;
        char dir[64];
        char ep[128];
        void *pctx; /* the peers' */
};

static void fixture_open(struct fixture *f) {
        memset(f, 0, sizeof(*f));
        snprintf(f->dir, sizeof(f->dir), "/tmp/kvcd-replay-XXXXXX");
        assert_non_null(mkdtemp(f->dir));
        struct kvcd *d = &f->d;
        d->cfg.runtime_dir = f->dir;
        d->cfg.events_replay_buffer = 10000;
        d->cfg.events_token_ids = true;
        d->events_fd = -1;
        snprintf(d->events_path, sizeof(d->events_path), "%s/kvcd.events.sock", f->dir);
        assert_int_equal(backend_find("host", &d->backend), 0);
        d->zctx = zmq_ctx_new();
        assert_non_null(d->zctx);
        assert_int_equal(events_open(d), 0);
        static uint32_t ids[PROMPT];
        for (uint32_t k = 0; k < SESSIONS; k++) {
                struct session s = { .id = k + 1 };
                for (uint32_t i = 0; i < PROMPT; i++)
                        ids[i] = k * 7919u + i;
                assert_int_equal(events_session_opened(d, &s, ids, PROMPT), 0);
                s.appended = PROMPT;
                events_session_progress(d, &s); /* BlockStored */
                events_session_closed(d, &s);   /* BlockRemoved; frees the session's arrays */
        }
        snprintf(f->ep, sizeof(f->ep), "ipc://%s/%s", f->dir, EVENTS_REPLAY_PATH);
        f->pctx = zmq_ctx_new();
        assert_non_null(f->pctx);
}

static void fixture_close(struct fixture *f) {
        zmq_ctx_term(f->pctx);
        events_close(&f->d);
        zmq_ctx_term(f->d.zctx);
        char path[128];
        snprintf(path, sizeof(path), "%s/%s", f->dir, EVENTS_REPLAY_PATH);
        unlink(path);
        unlink(f->d.events_path);
        rmdir(f->dir);
}

/* A DEALER; one that never reads takes as little as it can off kvcd (rcvhwm 1, a 4 KiB buffer). */
static void *peer_new(struct fixture *f, bool reads) {
        void *z = zmq_socket(f->pctx, ZMQ_DEALER);
        int zero = 0, one = 1, small = 4096;
        assert_non_null(z);
        assert_int_equal(zmq_setsockopt(z, ZMQ_LINGER, &zero, sizeof(zero)), 0);
        if (!reads) {
                assert_int_equal(zmq_setsockopt(z, ZMQ_RCVHWM, &one, sizeof(one)), 0);
                assert_int_equal(zmq_setsockopt(z, ZMQ_RCVBUF, &small, sizeof(small)), 0);
        }
        assert_int_equal(zmq_connect(z, f->ep), 0);
        return z;
}

static void ask(void *z, uint64_t from) {
        uint8_t sq[8];
        for (int i = 0; i < 8; i++)
                sq[i] = (uint8_t)(from >> (56 - 8 * i));
        assert_int_equal(zmq_send(z, "", 0, ZMQ_SNDMORE), 0);
        assert_int_equal(zmq_send(z, sq, 8, 0), 8);
}

/* kvcd's loop, as long as requests come within quiet_ms of each other (bounded). */
static void serve(struct fixture *f, int quiet_ms) {
        int64_t deadline = now_ms() + DEADLINE;
        while (now_ms() < deadline) {
                zmq_pollitem_t it = { .socket = events_replay_socket(&f->d), .events = ZMQ_POLLIN };
                if (zmq_poll(&it, 1, quiet_ms) <= 0)
                        return;
                events_replay_run(&f->d);
        }
}

/* One answer: its messages' seqs into seqs (at most max), their payload bytes in *ret_bytes;
 * the number of messages, or -1 when none came within timeout_ms. */
static int read_answer(void *z, int timeout_ms, uint64_t *seqs, int max, size_t *ret_bytes) {
        int n = 0;
        *ret_bytes = 0;
        for (;;) {
                zmq_pollitem_t it = { .socket = z, .events = ZMQ_POLLIN };
                if (zmq_poll(&it, 1, timeout_ms) <= 0) {
                        if (n)
                                fail_msg("an answer without its end marker (%d messages)", n);
                        return -1;
                }
                uint8_t sq[8];
                zmq_msg_t m;
                assert_int_equal(zmq_recv(z, sq, 0, 0), 0); /* empty delimiter */
                assert_int_equal(zmq_recv(z, sq, 8, 0), 8);
                zmq_msg_init(&m);
                assert_true(zmq_msg_recv(&m, z, 0) >= 0);
                uint64_t seq = 0;
                for (int i = 0; i < 8; i++)
                        seq = seq << 8 | sq[i];
                size_t len = zmq_msg_size(&m);
                zmq_msg_close(&m);
                if (seq == UINT64_MAX)
                        return n;
                assert_true(n < max);
                seqs[n++] = seq;
                *ret_bytes += len;
        }
}

static void peers_that_never_read_hold_a_bounded_part_of_kvcds_heap(void **state) {
        (void)state;
        struct fixture f;
        fixture_open(&f);
        void *peers[PEERS];
        size_t before = heap_in_use();
        for (uint32_t p = 0; p < PEERS; p++) {
                peers[p] = peer_new(&f, false);
                for (uint32_t k = 0; k < ASKS; k++)
                        ask(peers[p], 0);
        }
        serve(&f, 500);
        size_t grown = heap_in_use() - before;
        /* the stated bound (events.h), plus ZeroMQ's own per message and per connection (a few
         * MiB), against a copy of the whole ring (about 8 MiB) per peer before */
        size_t bound = (size_t)EVENTS_REPLAY_MAX_PEERS * EVENTS_REPLAY_HWM * EVENTS_MESSAGE_MAX_BYTES +
                       (4u << 20);
        print_message("replay: %u peers asked %u times each and never read: kvcd's heap +%zu KiB "
                      "(bound %zu KiB)\n",
                      PEERS, ASKS, grown / 1024, bound / 1024);
        assert_true(grown < bound);

        /* the answered ones hold the slots: a reader among the others gets nothing yet */
        uint64_t seqs[2 * EVENTS_REPLAY_WINDOW];
        size_t bytes;
        int answered = 0;
        for (uint32_t p = 0; p < PEERS; p++) {
                zmq_pollitem_t it = { .socket = peers[p], .events = ZMQ_POLLIN };
                answered += zmq_poll(&it, 1, 0) > 0;
        }
        assert_int_equal(answered, EVENTS_REPLAY_MAX_PEERS);
        for (uint32_t p = 0; p < PEERS; p++)
                zmq_close(peers[p]);

        /* once they are gone a reader gets the whole ring, a window at a time, in order */
        void *r = peer_new(&f, true);
        uint64_t next = 0;
        int windows = 0, got = -1;
        int64_t deadline = now_ms() + DEADLINE;
        while (got != 0 && now_ms() < deadline) {
                ask(r, next);
                serve(&f, 100);
                got = read_answer(r, 2000, seqs, (int)(sizeof(seqs) / sizeof(seqs[0])), &bytes);
                if (got < 0)
                        continue; /* the old connections' slots are not free yet: ask again */
                for (int i = 0; i < got; i++)
                        assert_int_equal(seqs[i], next + (uint64_t)i);
                assert_true(got <= (int)EVENTS_REPLAY_WINDOW);
                assert_true(bytes <= (size_t)got * EVENTS_MESSAGE_MAX_BYTES);
                next += (uint64_t)got;
                windows += got > 0;
        }
        assert_int_equal(got, 0);
        /* AllBlocksCleared, then each prompt's 1,024 blocks stored and removed, 64 a message */
        assert_int_equal(next, 1 + 2 * SESSIONS * (PROMPT / 16 / EVENTS_MESSAGE_BLOCKS));
        assert_true(windows > 1);
        print_message("replay: %llu messages in %d windows\n", (unsigned long long)next, windows);
        zmq_close(r);
        fixture_close(&f);
}

int main(void) {
        const struct CMUnitTest tests[] = {
                cmocka_unit_test(peers_that_never_read_hold_a_bounded_part_of_kvcds_heap),
        };
        return cmocka_run_group_tests(tests, NULL, NULL);
}
