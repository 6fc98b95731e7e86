/* wire.h: framing, size caps and validation of kvc.proto messages.
 *
 * wire.c is the only code that calls protobuf-c. Everything that arrives from a socket goes
 * through wire_decode(), which refuses an oversized frame before looking at it, unpacks into a
 * bounded arena (protobuf-c trusts lengths and can amplify a frame 45x on the heap), and checks
 * every field of the message against the limits below, so a handler may rely on them. Handlers
 * read the unpacked message and copy what they keep: the arena is reset for the next message,
 * so no pointer into a message survives it.
 *
 * Limits are part of the protocol and documented in docs/protocol.md.
 */
#pragma once

#include <stddef.h>
#include <stdint.h>

#include "kvc.pb-c.h"

#define WIRE_VERSION     1u
#define WIRE_TOKEN_BYTES 16u

/* Frames a peer may send kvcd: larger ones are refused with EMSGSIZE. */
#define WIRE_REQUEST_MAX_BYTES (64u * 1024u)
/* Frames kvcd may send a client (plan batches, session lists). */
#define WIRE_REPLY_MAX_BYTES (8u * 1024u * 1024u)

#define WIRE_MAX_LAYERS       256u
#define WIRE_MAX_HEADS        1024u
#define WIRE_MAX_KV_HEADS     256u
#define WIRE_MAX_HEAD_DIM     1024u
#define WIRE_MAX_TOKENS       (1u << 20)
#define WIRE_MAX_BLOCK_TOKENS 1024u
#define WIRE_BLOCK_TOKENS     16u /* the tokens of kvcd's blocks (SessionOpened.block_tokens) */
#define WIRE_MAX_PARAMS       32u
#define WIRE_MAX_NAME         64u   /* names, tenants, keys, short texts */
#define WIRE_MAX_MESSAGE      256u  /* error messages */
#define WIRE_MAX_STEPS        1024u /* steps in one StepBatch */
#define WIRE_MAX_TOPK         64u
#define WIRE_MAX_BLOCK_REFS   65536u /* block offsets in one message */
#define WIRE_MAX_MOVES        256u   /* block moves in one plan (relocation) */
#define WIRE_MAX_TIERS        4u     /* tiers below a session's dtype (kernels/ladder.h) */
#define WIRE_MAX_ERRNO        4095

/* A bump allocator with a hard cap. Unpacking allocates from it; wire_arena_reset() frees all. */
struct wire_arena;

int wire_arena_new(size_t cap_bytes, struct wire_arena **ret);
struct wire_arena *wire_arena_free(struct wire_arena *a);
void wire_arena_reset(struct wire_arena *a);
/* Memory for building a reply: NULL when the arena is exhausted. Zeroed. */
void *wire_arena_alloc(struct wire_arena *a, size_t bytes);
/* A copy of s in the arena (NULL when exhausted). */
char *wire_arena_strdup(struct wire_arena *a, const char *s);

/* Decodes and validates one frame of at most max_bytes. On success *ret points into the arena
 * (valid until the next reset). On failure returns -EMSGSIZE (frame too large or arena
 * exhausted), -EPROTO (not a protobuf envelope, wrong version, no body) or -EINVAL (a field out
 * of range), and writes a one-line reason into why (if why_len > 0). */
int wire_decode(struct wire_arena *a, const void *data, size_t len, size_t max_bytes, Kvc__Envelope **ret,
                char *why, size_t why_len);

/* wire_decode for kvcd's requests: a kind kvcd only sends (a reply, a plan, an error) is refused
 * with -EPROTO before its fields are validated. When the frame unpacked but did not validate,
 * *ret_request_id is also set to its request id, so that the refusal answers the request it
 * refuses (its sender's wait ends at once); otherwise *ret_request_id is left untouched. */
int wire_decode_request(struct wire_arena *a, const void *data, size_t len, size_t max_bytes,
                        Kvc__Envelope **ret, uint64_t *ret_request_id, char *why, size_t why_len);

/* Checks the fields of an envelope (wire_decode calls it; exposed for tests). */
int wire_validate(const Kvc__Envelope *env, char *why, size_t why_len);

/* Encoding: the size of the packed envelope, and packing into a buffer of at least that size. */
size_t wire_packed_size(const Kvc__Envelope *env);
size_t wire_pack(const Kvc__Envelope *env, uint8_t *out);
/* A ResumeLayer's account of tier t >= 1 (Resume, HandoffImported): its tokens and blocks, from the
 * tier fields, or from the INT8 ones (n_q8, q8_blocks) of a peer before the ladder; 0 and none when
 * it names no such tier. */
void wire_resume_tier(const Kvc__ResumeLayer *L, uint32_t t, uint32_t *ret_tokens, const uint64_t **ret_blocks,
                      size_t *ret_n);

/* An OpenSession on its own (kvcd's restart record): pack into cap bytes (-EMSGSIZE), and decode
 * with the same validation as in an envelope. */
int wire_open_session_pack(const Kvc__OpenSession *m, uint8_t *out, size_t cap, size_t *ret_len);
int wire_open_session_decode(struct wire_arena *a, const void *data, size_t len, Kvc__OpenSession **ret,
                             char *why, size_t why_len);

/* KV event batches (the third frame on kvcd.events.sock): pack, and decode with validation. */
size_t wire_event_packed_size(const Kvc__KvEventBatch *b);
size_t wire_event_pack(const Kvc__KvEventBatch *b, uint8_t *out);
int wire_event_decode(struct wire_arena *a, const void *data, size_t len, Kvc__KvEventBatch **ret);

/* The name of a body case ("step_batch"), for logs. */
/* A size on a command line: "4096", "256M", "2G", "1GiB", "512KB" (powers of 1024). -EINVAL. */
int wire_parse_bytes(const char *s, uint64_t *ret);

const char *wire_body_name(Kvc__Envelope__BodyCase c);

/* "EINVAL" for 22 and so on, for the codes the protocol uses; "E?" otherwise. */
const char *wire_errno_name(int code);
