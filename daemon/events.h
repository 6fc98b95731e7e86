/* events.h: KV events for prefix-aware routing, on a ZeroMQ PUB socket (kvcd.events.sock).
 *
 * A session that gave its prompt's token ids has the prompt's full 16-token blocks hashed in a
 * chain (FNV-1a 64, see kvc.proto). kvcd publishes BlockStored when a block of the prompt is in
 * the session's cache, BlockRemoved when a plan evicts from it or the session ends, and
 * AllBlocksCleared when kvcd starts and stops. Three frames per batch, like vLLM's publisher:
 * topic, 8-byte big-endian sequence number, KvEventBatch. PUB drops what a slow subscriber cannot
 * take; sequence numbers let it notice.
 */
#pragma once

#include <stddef.h>
#include <stdint.h>

struct kvcd;
struct session;

int events_open(struct kvcd *d);
void events_close(struct kvcd *d);

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
