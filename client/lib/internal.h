/* internal.h: libkvc's own objects, shared by the files of client/lib/ and by nobody else (kvc.h
 * is the one public header; these symbols are hidden from libkvc.so).
 *
 * Who owns what:
 *   struct kvc_client    the connection (client.c): both sockets, the reserved pool range and its
 *                        chunk map (mapping.c), the sessions, the step queue and the StepBatches
 *                        in flight (step.c), the last error
 *   struct kvc_session   one sequence (session.c): geometry, layouts, the block tables of every
 *                        layer, the plan buffer's place and its private copy (plan.c), the
 *                        shared prefix's masks, scratch for the kernels
 *
 * Invariants: a session's tables name only blocks inside chunks this client maps (every offset
 * kvcd sends goes through mapping_check_region first); a layer's slots are laid out tier by tier,
 * the lowest first (kernels/ladder.h): low[k] slots in tier k >= 1, the rest in tier 0 (the
 * session's dtype); a table has room for max_layer_blocks + 1 entries.
 *
 * Errors: every function returns 0 or -errno; client_error() records the reason for
 * kvc_last_error() and returns the code it is given, so `return client_error(c, -EPROTO, ...)`.
 */
#pragma once

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "block.h"
#include "cuda/driver.h"
#include "fdwire.h"
#include "kvc.h"
#include "ladder.h"
#include "mixed.h"
#include "wire.h"

#pragma GCC visibility push(hidden)

#define KVC_DEFAULT_TIMEOUT_MS 10000
#define KVC_SERVICE_USER       "kvcd" /* systemd/kvcd.service's User= */
#define KVC_MAX_PENDING        64u    /* StepBatches in flight */
#define MAPPED_RW              1
#define MAPPED_RO              2

/* One tier's blocks of a layer, in slot order. */
struct table {
        uint64_t *offs; /* pool offsets */
        uint8_t **ptrs; /* their addresses here */
        uint32_t n;
};

/* The lowest tier's slots first, tier 0's last (kernels/ladder.h). */
struct layer {
        struct table t[LADDER_TIERS]; /* t[0]: the dtype's blocks; t[k]: tier k's */
        uint32_t n_tokens;
        uint32_t low[LADDER_TIERS]; /* tokens in tier k >= 1; tier 0 holds the rest */
};

struct kvc_session {
        struct kvc_client *c;
        struct kvc_session *next;
        uint64_t id;
        uint8_t token[WIRE_TOKEN_BYTES];
        struct kvc_geometry g;
        struct block_layout layout;               /* tier 0's */
        uint32_t n_tiers;                         /* 1 + the tiers below the dtype kvcd put in force */
        struct block_layout tiers[LADDER_TIERS];  /* tiers[0] is layout */
        float *signs; /* [n_layers][n_kv_heads][head_dim]: the rotated tiers' rotation, or NULL */
        bool awaiting_link; /* kvcd sends the next link of a demotion (Plan.more) */
        uint32_t budget;
        uint32_t max_layer_tokens;
        uint32_t max_layer_blocks;
        float ema_gamma;
        uint64_t plan_offset;
        uint64_t plan_bytes;
        uint64_t budget_bytes; /* SessionOpened.budget_bytes */
        uint32_t *plan_copy; /* plan_bytes: the keep-sets copied out of the shared buffer */
        uint8_t *plan_tier;  /* a layer's kept tokens' tiers, for ladder_compact (identity_slots) */
        uint32_t *identity;  /* identity_slots: the keep-set of every slot, per head (plan.c) */
        float *attn_scratch;
        float *rows_scratch; /* kvc_attend_rows' for a chunk, made at its first use */
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
        bool recovering; /* inside resume_recover(): a second break is reported, not recovered */
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
        uint32_t n_links; /* sessions waiting for the next link of a demotion (Plan.more) */
        int step_error; /* first per-step error kvcd reported since the last flush */

        char error[WIRE_MAX_MESSAGE + 64];

        /* who may be kvcd (client.c, daemon_allowed): with pinned, daemon_uid alone; otherwise
         * root, our own uid, and service_uid (the user kvcd's unit runs as) when it exists */
        bool pinned, has_service_uid;
        uid_t daemon_uid, service_uid;
};

/* ---- client.c: the connection and its envelopes ---- */

/* Records why (for kvc_last_error) and returns code. */
int client_error(struct kvc_client *c, int code, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
/* Sends bytes already packed (a StepBatch kept for a resume), or an envelope (its version set). */
int client_send_packed(struct kvc_client *c, const uint8_t *bytes, size_t n);
int client_send(struct kvc_client *c, Kvc__Envelope *env);
/* Receives one message (valid until the next receive), handling side-channel records first.
 * -ETIMEDOUT, -ENOTCONN when kvcd's side channel hung up (it died), -EPROTO for a message that
 * fails validation. */
int client_recv(struct kvc_client *c, int timeout_ms, Kvc__Envelope **ret);
/* Sends env and waits for its reply of kind want (other messages are dispatched meanwhile). The
 * reply is valid until the next receive. An Error reply becomes its -code. */
int client_call(struct kvc_client *c, Kvc__Envelope *env, Kvc__Envelope__BodyCase want, Kvc__Envelope **ret);
/* The fd channel (kvcd's Welcome record, and the GPU's UUID for a device pool), the ZeroMQ
 * socket, and Hello. On failure the caller closes what opened. */
int client_open_channels(struct kvc_client *c, bool *ret_device, uint8_t uuid[16],
                         Kvc__Envelope **ret_welcome);
void client_close_channels(struct kvc_client *c);

/* ---- mapping.c: the pool's chunks in this process, and the side channel's records ---- */

/* Handles one side-channel record (its fd, if any, is consumed). */
int mapping_side_record(struct kvc_client *c, const struct fdwire_msg *m, int fd);
/* Copies n bytes at a pool offset out of the pool (host memory, or the GPU's). */
int mapping_copy_out(const struct kvc_client *c, uint64_t off, void *dst, size_t n);
/* Checks that `bytes` at pool offset off lie inside one chunk, then maps that chunk. */
int mapping_check_region(struct kvc_client *c, uint64_t off, uint64_t bytes);

/* ---- session.c: sessions and their layers ---- */

struct kvc_session *session_find(struct kvc_client *c, uint64_t id);
/* Frees a session that is no longer in its client's list; NULL. */
struct kvc_session *session_free(struct kvc_session *s);
/* Layer l as the kernels see it: its tier-0 part alone, or every tier. */
struct block_layer session_fp_layer(const struct kvc_session *s, uint32_t l);
struct ladder_layer session_ladder_layer(const struct kvc_session *s, uint32_t l);
/* Tokens of layer L in tiers 1.. */
uint32_t session_low_tokens(const struct kvc_session *s, const struct layer *L);

/* ---- plan.c: grants and plans (block moves, compaction, release) ---- */

/* Checks every block of a grant, then adds them to the session's tables; all or nothing. */
int plan_grant(struct kvc_client *c, const Kvc__Grant *g);
/* Validates a plan completely, moves the blocks it moves, then compacts every layer it names and
 * gives back the blocks the layers no longer need (keeping room for one more token); always
 * answers kvcd with a PlanApplied (status 0 or the reason it was refused). */
int plan_apply(struct kvc_client *c, const Kvc__Plan *p);

/* ---- step.c: step summaries, their batches and kvcd's answers ---- */

/* Handles a message that is not the reply a caller waits for (a PlanBatch, an Error). */
int step_dispatch(struct kvc_client *c, const Kvc__Envelope *env);

/* ---- resume.c: kvcd restarted ---- */

/* kvcd went away (its side channel hung up). When it said it keeps our pool across a restart:
 * connect again until resume_ms passes, resume every session, and send again the step batches
 * it had not answered. Otherwise, or when that fails, -ENOTCONN. */
int resume_recover(struct kvc_client *c);

#pragma GCC visibility pop
