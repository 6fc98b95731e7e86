/* events.h: KV events for prefix-aware routing, on a ZeroMQ PUB socket (kvcd.events.sock, and a
 * TCP endpoint with --events-endpoint), with vLLM's replay socket beside it.
 *
 * A session that gave its prompt's token ids has the prompt's full 16-token blocks hashed in a
 * chain (FNV-1a 64, see kvc.proto and docs/protocol.md). kvcd publishes BlockStored when a block
 * of the prompt is in the session's cache, BlockRemoved when a plan evicts from it or the session
 * ends, and AllBlocksCleared when kvcd starts and stops. Three frames per message, like vLLM's
 * publisher: topic, 8-byte big-endian sequence number, payload. The payload is in one of two
 * formats (--events-format): "kvcd", a protobuf KvEventBatch (kvcctl events reads it), or "vllm",
 * vLLM's msgpack EventBatch (events_vllm.c), which routers built for vLLM read. Both encoders take
 * the same format-neutral struct events_event, from one table in events.c.
 *
 * PUB drops what a slow subscriber cannot take; the sequence numbers let it notice, and with
 * --events-replay-buffer N the last N messages are kept (events_ring, at most
 * EVENTS_REPLAY_MAX_BYTES of payload) and served on a ROUTER (kvcd.events.replay.sock, and
 * --events-replay-endpoint): a request [empty, 8-byte big-endian start seq] is answered with
 * [empty, seq, payload] for the kept messages from start on, at most EVENTS_REPLAY_WINDOW of
 * them, then [empty, -1 as 8 bytes, empty]; a subscriber that needs more asks again from the next
 * seq.
 *
 * What the replay socket can make kvcd hold (issue 28, item 3). A message is at most
 * EVENTS_MESSAGE_MAX_BYTES: an event names at most EVENTS_MESSAGE_BLOCKS blocks (a longer prompt's
 * blocks go out in several, each with its parent hash). A peer's pipe holds at most
 * EVENTS_REPLAY_HWM messages (two windows and their end markers: ZeroMQ learns what a reader
 * took only every half high-water mark), however often it asks without reading; answers go to at
 * most EVENTS_REPLAY_MAX_PEERS connections at a time (the ones answered before, while they stay
 * connected; a request from another is dropped). So what the replay queues in kvcd is at most
 * EVENTS_REPLAY_MAX_PEERS x EVENTS_REPLAY_HWM x EVENTS_MESSAGE_MAX_BYTES (16 x 130 x 6 KiB:
 * 12.2 MiB), beside the buffer itself.
 *
 * Token ids are published only with --events-token-ids (docs/security.md): without it every
 * BlockStored carries an empty token_ids list, and the hashes alone identify the blocks.
 */
#pragma once

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct kvcd;
struct session;

#define EVENTS_TOPIC            "kv-events"
#define EVENTS_REPLAY_MAX       1000000u    /* --events-replay-buffer's largest N */
#define EVENTS_REPLAY_MAX_BYTES (64u << 20) /* payload bytes the replay buffer keeps at most */
#define EVENTS_REPLAY_PATH      "kvcd.events.replay.sock"
#define EVENTS_REPLAY_WINDOW    64u /* messages of one replay answer at most */
#define EVENTS_REPLAY_HWM       (2 * (EVENTS_REPLAY_WINDOW + 1)) /* a peer's pipe, in messages */
#define EVENTS_REPLAY_MAX_PEERS 16u  /* connections answered at a time */
/* blocks one event names at most, and so the largest message: 64 hashes and 1024 token ids as
 * varints (10 and 5 bytes at most) and the rest, in either format */
#define EVENTS_MESSAGE_BLOCKS    64u
#define EVENTS_MESSAGE_MAX_BYTES (6u << 10)

/* Whether --events-format NAME is one kvcd speaks ("kvcd", "vllm"). */
bool events_format_known(const char *name);
int events_open(struct kvcd *d);
void events_close(struct kvcd *d);
/* The replay ROUTER (NULL without --events-replay-buffer), for the main loop's poll set. */
void *events_replay_socket(const struct kvcd *d);
/* Answers the replay requests that are waiting (at most a few a call). */
void events_replay_run(struct kvcd *d);

/* Hashes the prompt's blocks into the session (nothing when it gave no token ids). */
int events_session_opened(struct kvcd *d, struct session *s, const uint32_t *ids, size_t n);
/* After a step: publishes the prompt blocks that are now complete in the cache. */
void events_session_progress(struct kvcd *d, struct session *s);
/* After a plan: only the first `intact` prompt blocks are still whole; the rest are removed. */
void events_session_evicted(struct kvcd *d, struct session *s, uint32_t intact);
/* The session ends: whatever it published is removed. */
void events_session_closed(struct kvcd *d, struct session *s);

/* FNV-1a 64 chain of one block of token ids after `parent` (0: the first block). */
uint64_t events_block_hash(uint64_t parent, const uint32_t *ids, uint32_t n);

/* One event, whatever the format. Pointers are borrowed for the call that encodes it. */
enum events_kind { EVENTS_KIND_STORED, EVENTS_KIND_REMOVED, EVENTS_KIND_CLEARED };
struct events_event {
        enum events_kind kind;
        const uint64_t *block_hashes; /* stored, removed */
        uint32_t n_block_hashes;
        uint64_t parent_block_hash; /* stored; 0: the first block of a prompt */
        const uint32_t *token_ids;  /* stored; n_token_ids 0 without --events-token-ids */
        size_t n_token_ids;
        uint32_t block_size; /* stored */
        uint64_t session_id; /* stored, removed (the kvcd format only) */
        const char *medium;  /* stored, removed: the format's name for the backend's memory */
};

/* An encoder: one batch of n events at ts_usec (CLOCK_REALTIME) into a malloc'd payload.
 * 0 and the payload and its length set; -ENOMEM (nothing set). */
typedef int (*events_encode_fn)(uint64_t ts_usec, const struct events_event *evs, size_t n, uint8_t **ret_buf,
                                size_t *ret_len);

/* vLLM's KVEventBatch in msgpack (events_vllm.c; the format is in docs/protocol.md). */
int events_vllm_encode(uint64_t ts_usec, const struct events_event *evs, size_t n, uint8_t **ret_buf,
                       size_t *ret_len);
/* The medium vLLM's format names for a kvcd backend: "GPU" for cuda, "CPU" otherwise. */
const char *events_vllm_medium(const char *backend_name);

/* events_ring: the last messages published, for replay. Bounded by a count and by payload bytes:
 * pushing past either drops the oldest. Owns the payloads pushed into it. */
struct events_ring;
/* -EINVAL when max_entries is 0, -ENOMEM. */
int events_ring_new(uint32_t max_entries, size_t max_bytes, struct events_ring **ret);
struct events_ring *events_ring_free(struct events_ring *r);
/* Takes *buf (set to NULL) as message seq; seqs must increase. A payload larger than max_bytes
 * is not kept (the ring then holds nothing older either: a replay never skips a message in its
 * middle). */
void events_ring_push(struct events_ring *r, uint64_t seq, uint8_t **buf, size_t len);
/* The i-th kept message at or after seq (i from 0): 0 and its seq, payload and length, or -ENOENT
 * past the last. */
int events_ring_get(const struct events_ring *r, uint64_t from_seq, uint32_t i, uint64_t *ret_seq,
                    const uint8_t **ret_buf, size_t *ret_len);
/* Messages and payload bytes kept. */
uint32_t events_ring_count(const struct events_ring *r);
size_t events_ring_bytes(const struct events_ring *r);
