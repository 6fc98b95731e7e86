/* test_events.c - unit tests of daemon/events_vllm.c (vLLM's KVEventBatch in msgpack, read back
 * with msgpack-c's unpacker field by field, against vLLM 0.10.2's struct layout) and
 * daemon/events_ring.c (the replay buffer: its two limits, and a replay that never skips a
 * message in its middle). The pytest test (tests/python) checks the same bytes against msgspec. */
#include <errno.h>
#include <msgpack.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "events.h"

static msgpack_object_array as_array(msgpack_object o, uint32_t n) {
        assert_int_equal(o.type, MSGPACK_OBJECT_ARRAY);
        assert_int_equal(o.via.array.size, n);
        return o.via.array;
}

static void assert_str(msgpack_object o, const char *s) {
        assert_int_equal(o.type, MSGPACK_OBJECT_STR);
        assert_int_equal(o.via.str.size, strlen(s));
        assert_memory_equal(o.via.str.ptr, s, strlen(s));
}

static void assert_uint(msgpack_object o, uint64_t v) {
        assert_int_equal(o.type, MSGPACK_OBJECT_POSITIVE_INTEGER);
        assert_true(o.via.u64 == v);
}

static void vllm_batch_is_ts_events_rank_with_tagged_events(void **state) {
        (void)state;
        uint64_t hashes[2] = { 0xfedcba9876543210ull, 7 };
        uint32_t ids[32];
        for (int i = 0; i < 32; i++)
                ids[i] = (uint32_t)(i * 1000);
        struct events_event evs[] = {
                { .kind = EVENTS_KIND_CLEARED },
                { .kind = EVENTS_KIND_STORED,
                  .block_hashes = hashes,
                  .n_block_hashes = 2,
                  .parent_block_hash = 0,
                  .token_ids = ids,
                  .n_token_ids = 32,
                  .block_size = 16,
                  .medium = "CPU" },
                { .kind = EVENTS_KIND_STORED,
                  .block_hashes = hashes + 1,
                  .n_block_hashes = 1,
                  .parent_block_hash = hashes[0],
                  .block_size = 16,
                  .medium = "GPU" },
                { .kind = EVENTS_KIND_REMOVED, .block_hashes = hashes, .n_block_hashes = 2, .medium = "CPU" },
        };
        uint8_t *buf;
        size_t len;
        assert_int_equal(events_vllm_encode(1700000000123456ull, evs, 4, &buf, &len), 0);

        msgpack_unpacked u;
        msgpack_unpacked_init(&u);
        size_t off = 0;
        assert_int_equal(msgpack_unpack_next(&u, (const char *)buf, len, &off), MSGPACK_UNPACK_SUCCESS);
        assert_int_equal(off, len); /* one object, nothing after it */
        msgpack_object_array batch = as_array(u.data, 3);
        assert_int_equal(batch.ptr[0].type, MSGPACK_OBJECT_FLOAT64);
        assert_true(batch.ptr[0].via.f64 == 1700000000.123456);
        assert_uint(batch.ptr[2], 0); /* data_parallel_rank */
        msgpack_object_array e = as_array(batch.ptr[1], 4);

        assert_str(as_array(e.ptr[0], 1).ptr[0], "AllBlocksCleared");

        msgpack_object_array st = as_array(e.ptr[1], 7);
        assert_str(st.ptr[0], "BlockStored");
        msgpack_object_array h = as_array(st.ptr[1], 2);
        assert_uint(h.ptr[0], hashes[0]);
        assert_uint(h.ptr[1], 7);
        assert_int_equal(st.ptr[2].type, MSGPACK_OBJECT_NIL); /* no parent */
        msgpack_object_array t = as_array(st.ptr[3], 32);
        for (int i = 0; i < 32; i++)
                assert_uint(t.ptr[i], ids[i]);
        assert_uint(st.ptr[4], 16);
        assert_int_equal(st.ptr[5].type, MSGPACK_OBJECT_NIL); /* lora_id */
        assert_str(st.ptr[6], "CPU");

        msgpack_object_array st2 = as_array(e.ptr[2], 7);
        assert_uint(st2.ptr[2], hashes[0]); /* the parent */
        as_array(st2.ptr[3], 0);            /* token ids withheld: an empty list */
        assert_str(st2.ptr[6], "GPU");

        msgpack_object_array rm = as_array(e.ptr[3], 3);
        assert_str(rm.ptr[0], "BlockRemoved");
        as_array(rm.ptr[1], 2);
        assert_str(rm.ptr[2], "CPU");
        msgpack_unpacked_destroy(&u);
        free(buf);
}

static void vllm_medium_is_gpu_for_cuda_and_cpu_for_host(void **state) {
        (void)state;
        assert_string_equal(events_vllm_medium("cuda"), "GPU");
        assert_string_equal(events_vllm_medium("host"), "CPU");
}

static uint8_t *payload(size_t n, uint8_t fill) {
        uint8_t *p = malloc(n);
        assert_non_null(p);
        memset(p, fill, n);
        return p;
}

static void ring_keeps_the_last_max_entries_messages(void **state) {
        (void)state;
        struct events_ring *r;
        assert_int_equal(events_ring_new(0, 1000, &r), -EINVAL);
        assert_int_equal(events_ring_new(EVENTS_REPLAY_MAX + 1, 1000, &r), -EINVAL);
        assert_int_equal(events_ring_new(4, 1000, &r), 0);
        for (uint64_t s = 0; s < 10; s++) {
                uint8_t *p = payload(10, (uint8_t)s);
                events_ring_push(r, s, &p, 10);
                assert_null(p);
        }
        assert_int_equal(events_ring_count(r), 4);
        assert_int_equal(events_ring_bytes(r), 40);
        uint64_t seq;
        const uint8_t *buf;
        size_t len;
        /* from before the oldest: the oldest kept (6) first, so the subscriber sees what it lost */
        assert_int_equal(events_ring_get(r, 0, 0, &seq, &buf, &len), 0);
        assert_int_equal(seq, 6);
        assert_int_equal(buf[0], 6);
        for (uint32_t i = 0; i < 4; i++) {
                assert_int_equal(events_ring_get(r, 6, i, &seq, &buf, &len), 0);
                assert_int_equal(seq, 6 + i);
                assert_int_equal(len, 10);
        }
        assert_int_equal(events_ring_get(r, 6, 4, &seq, &buf, &len), -ENOENT);
        assert_int_equal(events_ring_get(r, 8, 0, &seq, &buf, &len), 0);
        assert_int_equal(seq, 8);
        assert_int_equal(events_ring_get(r, 10, 0, &seq, &buf, &len), -ENOENT); /* nothing yet */
        assert_null(events_ring_free(r));
}

static void ring_keeps_at_most_max_bytes_of_payload(void **state) {
        (void)state;
        struct events_ring *r;
        assert_int_equal(events_ring_new(100, 100, &r), 0);
        for (uint64_t s = 0; s < 5; s++) {
                uint8_t *p = payload(30, 0);
                events_ring_push(r, s, &p, 30);
        }
        assert_int_equal(events_ring_count(r), 3); /* 90 of 100 bytes: a fourth would be 120 */
        assert_int_equal(events_ring_bytes(r), 90);
        uint64_t seq;
        const uint8_t *buf;
        size_t len;
        assert_int_equal(events_ring_get(r, 0, 0, &seq, &buf, &len), 0);
        assert_int_equal(seq, 2);
        /* one message over the whole limit is not kept, and neither is anything before it: a
         * replay across it would skip it silently */
        uint8_t *big = payload(101, 0);
        events_ring_push(r, 5, &big, 101);
        assert_null(big);
        assert_int_equal(events_ring_count(r), 0);
        assert_int_equal(events_ring_bytes(r), 0);
        uint8_t *p = payload(30, 0);
        events_ring_push(r, 6, &p, 30);
        assert_int_equal(events_ring_get(r, 2, 0, &seq, &buf, &len), 0);
        assert_int_equal(seq, 6); /* the gap 2..5 shows */
        assert_null(events_ring_free(r));
        assert_null(events_ring_free(NULL));
}

int main(void) {
        const struct CMUnitTest tests[] = {
                cmocka_unit_test(vllm_batch_is_ts_events_rank_with_tagged_events),
                cmocka_unit_test(vllm_medium_is_gpu_for_cuda_and_cpu_for_host),
                cmocka_unit_test(ring_keeps_the_last_max_entries_messages),
                cmocka_unit_test(ring_keeps_at_most_max_bytes_of_payload),
        };
        return cmocka_run_group_tests(tests, NULL, NULL);
}
