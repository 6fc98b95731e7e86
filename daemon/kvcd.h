/* kvcd.h: the daemon's objects and who owns what.
 *
 *   struct kvcd     the daemon: owns the pool, the sockets, every client and (through them)
 *                   every session. One thread runs everything (server.c's loop).
 *   struct client   one inference process: its fd side-channel connection (credentials,
 *                   liveness), its ZeroMQ routing id once it said Hello, and its sessions.
 *                   Owns its sessions; dies (with them) when the side channel hangs up.
 *   struct session  one sequence: geometry, policy, the blocks of each layer, the plan buffer,
 *                   the outstanding plan. Owned by its client; indexed by id in kvcd.sessions.
 *
 * Every block a session holds is recorded in exactly one place, its layer's block table, and was
 * allocated from the pool under the session's client id: the audit recomputes one from the other.
 *
 * After the objects come the declarations of the files without a header of their own (client.c,
 * session.c, restart.c, handoff.c, relocate.c, server.c). The rest have their own, and none of
 * those includes this one: a file that needs only the time (clock.h), only to send (handlers.h),
 * or only a module's interface (pool.h, prefix.h, budget.h, plan.h, events.h, admin.h, ...)
 * includes just that.
 */
#pragma once

#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>

#include "block.h"
#include "ladder.h"
#include "budget.h"
#include "idmap.h"
#include "metrics.h"
#include "plan.h"
#include "wire.h"

struct backend_ops;
struct policy;
struct pool;
struct prefix_block;
struct restart;
struct events;

#define KVCD_VERSION                 "0.3.0"
#define KVCD_MAX_CLIENTS             256u
#define KVCD_MAX_SESSIONS            4096u
#define KVCD_MAX_SESSIONS_PER_CLIENT 1024u
#define KVCD_ROUTING_ID_MAX          255u
#define KVCD_WAIT_USEC               2000000u /* a request waits this long for memory the arbiter reclaims */
/* kvcd's own heap for one client's sessions (their structs, block tables, policy state, prompt
 * ids, masks, prefix entries): past it a request is refused with ENOSPC (docs/security.md) */
#define KVCD_CLIENT_HEAP_BYTES (32ull << 20)
/* A side-channel connection that has not said Hello within this is closed; a uid has at most
 * KVCD_MAX_PENDING_PER_UID such connections (a new one closes its oldest); when kvcd runs out of
 * file descriptors it stops accepting for KVCD_ACCEPT_BACKOFF_USEC at a time (client.c). */
#define KVCD_HELLO_USEC          2000000u
#define KVCD_MAX_PENDING_PER_UID 16u
#define KVCD_ACCEPT_BACKOFF_USEC 250000u
/* The main loop trims the heap when the allocator holds this much more free memory than after its
 * last trim (server.c): kvcd's RSS comes back within about this of idle after a peak. */
#define KVCD_TRIM_SLACK_BYTES (512u << 10)

struct kvcd_config {
        const char *runtime_dir;
        const char *backend;
        const char *device; /* cuda: the GPU's UUID; NULL: device 0 */
        uint64_t capacity_bytes;
        uint64_t chunk_bytes;
        uint64_t pool_max_bytes;    /* the most `kvcctl budget set --capacity` may raise it to */
        uint16_t metrics_port;      /* 0: no HTTP endpoint */
        uint64_t stop_timeout_usec; /* SIGTERM waits this long for open sessions to end */
        bool fd_store;              /* keep chunks and the state record in systemd's fd store */
        uint64_t resume_grace_usec; /* after a restart, clients have this long to resume */
        /* KV events (events.c) */
        const char *events_format;          /* "kvcd" (NULL: the same) or "vllm" */
        const char *events_endpoint;        /* a second endpoint for the PUB socket (tcp://), or NULL */
        const char *events_replay_endpoint; /* a second endpoint for the replay ROUTER, or NULL */
        uint32_t events_replay_buffer;      /* messages kept for replay; 0: no replay socket */
        bool events_token_ids;              /* publish the prompts' token ids */
        int share_scope;                    /* who attaches whose shared prefix (enum prefix_scope) */
        /* the numeric IPv4 or IPv6 address of the metrics endpoint; NULL: 127.0.0.1 */
        const char *metrics_address;
};

struct kvcd_counters {
        uint64_t steps;
        uint64_t plans;
        uint64_t plans_applied;
        uint64_t grants;
        uint64_t sessions_opened;
        uint64_t client_deaths;
        uint64_t errors;
        uint64_t dropped_replies;
        uint64_t admission_refusals;
        uint64_t evictions;
        uint64_t chunks_drained;   /* drains started: chunks whose blocks are to move out (relocate.c) */
        uint64_t blocks_relocated; /* blocks moved */
        uint64_t step_batches;     /* StepBatch messages handled (steps counts their summaries) */
        /* sessions that looked for a shared prefix at open, those that attached one, its tokens */
        uint64_t prefix_lookups, prefix_hits, prefix_hit_tokens;
        /* opens and reservations refused for memory or admission, by reason (metrics.h) */
        uint64_t refusals[REFUSAL_N];
};

struct client {
        uint64_t id;
        int fd; /* SEQPACKET connection */
        pid_t pid;
        uid_t uid;
        gid_t gid;
        uint8_t token[WIRE_TOKEN_BYTES];
        bool bound;
        uint8_t rid[KVCD_ROUTING_ID_MAX];
        uint8_t rid_len;
        char name[WIRE_MAX_NAME + 1];
        uint32_t n_sessions;
        struct session *sessions; /* list through session.next */
        struct client *orphan_next;
        uint64_t adopted_from; /* after a restart: the id of the connection this one took over */
        uint64_t connected_usec;
        bool refuses_moves;  /* it refused a plan of block moves: its chunks are not drained again */
        bool said_bye;       /* its last side-channel record was BYE: a clean disconnect */
        uint64_t heap_bytes; /* kvcd's heap its sessions hold, at most KVCD_CLIENT_HEAP_BYTES */
};

/* The chunks of a client that died, held until its process has exited (client.c). */
#define EXITING_DOMAIN (1ull << 61)
struct exit_hold {
        uint64_t owner; /* EXITING_DOMAIN | the client's id: the chunks' owner meanwhile */
        pid_t pid;
        int pidfd; /* readable once the process has exited */
};

/* One block table: the blocks of one tier of one layer, in slot order. */
struct block_table {
        uint64_t *blocks; /* pool offsets; room for cap, grown with use up to max_layer_blocks */
        uint32_t n;
        uint32_t cap;
};

/* A layer: one block table per tier of the session (kernels/ladder.h's layout: the lowest tier's
 * slots first, tier 0's last). low[t] (t >= 1) is tier t's count; tier 0 holds the rest. */
struct session_layer {
        struct block_table t[LADDER_TIERS];
        uint32_t n_tokens;               /* as the client last reported */
        uint32_t low[LADDER_TIERS];      /* tokens in tiers 1.., as of the last plan applied */
        uint32_t planned[LADDER_TIERS];  /* the same after the outstanding plan */
        uint32_t wanted[LADDER_TIERS];   /* a demotion cut into links: kept tokens at tier >= t it
                                            aims for (cumulative, like plan.c's), 0: none pending */
        bool relink;                     /* per-token tiers: a plan's demotion was capped, the next
                                            link asks the policy again */
};

/* A block that changes place (relocate.c): entry index of a layer's table goes from `from` to
 * `to` when the client applies the plan; `to` is allocated from the pool meanwhile. */
struct block_move {
        uint32_t layer;
        uint32_t tier;
        uint32_t index;
        uint64_t from, to;
};

struct session_stats {
        uint64_t steps;
        uint64_t plans;
        uint32_t peak_tokens;
        uint32_t peak_layer_blocks;
        uint64_t peak_bytes;
};

struct session {
        uint64_t id;
        uint8_t token[WIRE_TOKEN_BYTES];
        struct client *owner;
        struct session *next, *prev; /* in owner->sessions */

        uint32_t n_layers, n_heads, n_kv_heads, head_dim, max_tokens;
        Kvc__Dtype dtype;
        struct block_layout layout;                /* tier 0: the dtype's blocks */
        uint32_t n_tiers;                          /* 1 + the tiers below the dtype */
        struct block_layout tiers[LADDER_TIERS];   /* tiers[0] is layout */
        uint64_t rotation_seed;                    /* of the rotated tiers (OpenSession) */
        uint32_t tier_window;                      /* the tier_window parameter: 0, none */
        bool token_tiers;                          /* the policy gives each kept token its tier */
        uint64_t tier_offset;                      /* their bytes, from the plan buffer's start */
        uint64_t tier_block_bytes[LADDER_TIERS];   /* tiers[t].block_bytes, as policies take them */
        uint8_t tier_bits[LADDER_TIERS];           /* and their bits per value */
        uint64_t budget_bytes;                     /* OpenSession.budget_bytes (0: none) */
        struct policy_step link_step;              /* the step a link of a per-token demotion asks
                                                      the policy with (layer_tokens not kept) */
        char tenant[WIRE_MAX_NAME + 1];
        char policy_name[WIRE_MAX_NAME + 1];
        struct policy *policy;
        uint32_t budget_tokens;
        uint32_t max_layer_tokens; /* the policy's limit */
        uint32_t max_layer_blocks; /* ceil(max_layer_tokens / block_tokens) */
        uint32_t max_keep;         /* entries per layer (and head) in the plan buffer */
        bool per_head;
        bool summarize; /* plans keep a summary slot of the evicted tokens (kernels/summarize.h) */
        struct session_layer *layers;

        uint64_t plan_offset; /* 0 and plan_units 0 when the policy never plans */
        uint32_t plan_units;  /* of the full-precision block size */

        uint32_t prompt_tokens;
        uint64_t appended; /* tokens appended to layer 0 since the session opened */
        uint32_t last_growth; /* ... by its last step */
        uint64_t last_step;
        uint64_t last_step_usec; /* when it came (kvcctl top marks sessions idle for long) */
        bool stepped;
        uint64_t next_plan_id;
        uint64_t pending_plan_id; /* 0: none outstanding */
        uint64_t pending_since_usec;
        float confidence;
        uint64_t bytes; /* pool bytes held: blocks of both classes and the plan buffer */
        /* limits (budget.c) */
        struct tenant *ten;   /* charged with bytes */
        uint64_t floor_bytes; /* the least it runs with: its plan buffer and a block per layer */
        uint64_t min_bytes;   /* guaranteed */
        uint64_t max_bytes;
        uint64_t cap_bytes;    /* the arbiter's limit: max_bytes unless memory is short */
        uint64_t demand_bytes; /* what its policy wanted at its last step, clamped to min..max */
        uint64_t lowest_bytes; /* per-token tiers: what it holds with every token at its lowest tier */
        int32_t priority;
        /* a request answered later, when memory frees up (the arbiter is shrinking others) */
        struct session_wait {
                enum { WAIT_NONE, WAIT_OPEN, WAIT_RESERVE } kind;
                uint64_t request_id;
                uint32_t n_tokens;
                uint64_t deadline_usec;
        } wait;
        /* the prompt's 16-token blocks, for KV events (events.c) */
        uint32_t *prompt_ids;
        uint64_t *block_hashes;
        uint32_t prompt_blocks; /* full blocks in the prompt */
        uint32_t prompt_alive;  /* of those, the leading ones no plan has evicted from */
        uint32_t blocks_stored; /* published as stored */
        uint32_t plan_intact;   /* the outstanding plan leaves this many prompt blocks whole */
        struct session_stats stats;
        uint64_t opened_usec;
        int32_t state_slot; /* in the restart record, or -1 */
        uint64_t domain;    /* SESSION_DOMAIN | id when opened for hand-off (chunks of its own), else 0 */
        /* shared prefix (prefix.c); model_key 0: the session shares nothing */
        uint64_t model_key;
        uint32_t share_blocks;        /* prompt blocks it may share: all whole ones but the last token's */
        uint32_t n_shared_blocks;     /* the first blocks of every layer are shared (attached, published) */
        struct prefix_block **shared; /* [share_blocks]: the references it holds */
        uint64_t prefix_domain;       /* PREFIX_DOMAIN | id: where its own prompt blocks are allocated */
        bool publish_tried;
        bool just_published;  /* since the last reply: the client is told the new shared length */
        uint32_t keep_cap;    /* keep-set entries per layer and head in the plan buffer */
        uint64_t mask_offset; /* its masks of shared slots, bytes into the plan buffer */
        uint32_t mask_stride; /* bytes per layer (and per KV head in the plan buffer) */
        uint8_t *mask;        /* [n_layers][mask_stride]: shared slots it evicted, as applied */
        uint8_t *mask_next;   /* the same after the outstanding plan */
        struct handoff_state {
                uint8_t ticket[WIRE_TOKEN_BYTES];
                uint64_t from_client; /* the exporter, asked to unmap the chunks at the import */
                uint64_t deadline_usec;
        } handoff;                /* while exported and not yet imported */
        struct block_move *moves; /* [WIRE_MAX_MOVES], the outstanding plan's moves (relocate.c) */
        uint32_t n_moves;
        uint64_t heap_bytes; /* kvcd's heap this session holds, charged to its owner's heap_bytes */
        /* OpenSession.model_id ("": none), a metrics label */
        char model_id[WIRE_MAX_NAME + 1];
};

struct kvcd {
        struct kvcd_config cfg;
        const struct backend_ops *backend;
        struct pool *pool;
        void *zctx;
        void *zclient; /* ROUTER for libkvc */
        void *zadmin;  /* ROUTER for kvcctl */
        void *zevents; /* PUB for KV events */
        int events_fd; /* a socket-activated listening fd for it, or -1 */
        uint64_t event_seq;
        /* the rest of the KV event publisher's state (events.c) */
        struct events *events;
        int fd_listen;
        int act_client_fd; /* listening sockets passed by systemd, or -1 */
        int act_admin_fd;
        int sig_fd;
        int lock_fd;
        char sock_path[256], fd_path[256], admin_path[256], events_path[256], lock_path[256];

        struct client *clients[KVCD_MAX_CLIENTS];
        uint32_t n_clients;
        uint64_t next_client_id;
        struct idmap sessions;
        uint64_t next_session_id;
        struct budget budget;
        struct idmap prefixes;   /* published prompt blocks (prefix.c) */
        uint64_t prefix_secret[2]; /* the per-boot SipHash key of their index (prefix.c) */
        uint32_t n_waiting;      /* sessions with a request waiting for memory */
        bool freed;              /* memory went back to the pool since the waits were last tried */
        char refusal[256];       /* why the last allocation was refused by a limit */
        bool refusal_own;        /* ... and it was the session's own cap */
        struct restart *restart; /* the fd store and the state record (restart.c) */
        struct client *orphans;  /* clients from before a restart, until they resume (list via orphan_next) */
        struct client *handoffs; /* parking clients of exported sessions, until imported (handoff.c) */
        struct exit_hold holds[KVCD_MAX_CLIENTS]; /* dead clients' chunks, until their processes exit */
        uint32_t n_holds;
        struct relocation { /* the chunk being drained (relocate.c) */
                bool active;
                uint32_t chunk;
                uint64_t deadline_usec;   /* called off then */
                uint64_t not_before_usec; /* after a drain was called off, no other until then */
        } relocate;

        struct plan_scratch scratch;
        struct wire_arena *in;    /* the request being handled */
        struct wire_arena *out;   /* the reply being built */
        struct wire_arena *notes; /* a message kvcd sends unasked (relocate.c, plan_follow); NULL: d->out is used */
        struct kvcd_counters n;
        struct histogram plan_latency;
        struct histogram confidence;
        bool draining;
        struct drain_wait { /* an admin peer waiting for the sessions to end */
                bool active;
                uint8_t rid[KVCD_ROUTING_ID_MAX];
                uint8_t rid_len;
                uint64_t request_id;
                uint64_t deadline_usec;
        } drain;
        void *http; /* struct MHD_Daemon, when --metrics-port is given */
        uint64_t started_usec;
        uint64_t watchdog_usec;
        char last_status[128]; /* the STATUS= last sent to systemd */
        bool stopping;
        uint64_t stop_deadline_usec;       /* a graceful stop is under way until then */
        uint64_t accept_paused_until_usec; /* out of fds: the listener is not polled until then */
        bool fds_exhausted;                /* ... and that was logged (once, until an accept succeeds) */
        /* wall-clock time of the start (kvcd_start_time_seconds) */
        uint64_t started_unix_usec;
        /* the limit behind the last -ENOSPC (budget.c), for kvcd_refusals_total */
        enum refusal_reason refusal_reason;
};

/* client.c */
/* Accepts one pending connection: 1 when one was taken (or refused), 0 when none waited or kvcd
 * is out of file descriptors (it then stops accepting for a while: client_accepting()). */
int client_accept(struct kvcd *d);
/* Whether the listening socket is to be polled now (not while backing off from EMFILE). */
bool client_accepting(const struct kvcd *d, uint64_t now);
/* Closes the connections that did not say Hello in time; call every loop round. */
void client_tick(struct kvcd *d, uint64_t now);
/* When client_tick() or client_accepting() next has something to do (UINT64_MAX: never). */
uint64_t client_next_deadline(const struct kvcd *d);
struct client *client_by_rid(struct kvcd *d, const uint8_t *rid, size_t len);
struct client *client_by_token(struct kvcd *d, const uint8_t *token);
/* Sends the fd of chunk idx to c (read_only: to map without write access; a client that already
 * maps that memory writable keeps it so). */
int client_send_chunk(struct kvcd *d, struct client *c, uint32_t idx);
int client_send_chunk_as(struct kvcd *d, struct client *c, uint32_t idx, bool read_only);
/* Reads what the client wrote on its side channel (UNMAPPED acknowledgements; the rest is
 * dropped); -ENOTCONN when it hung up. */
int client_drain(struct kvcd *d, struct client *c);
struct client *client_by_id(struct kvcd *d, uint64_t id);
/* Asks client c to unmap chunk idx (an UNMAP record). */
int client_send_unmap(struct kvcd *d, struct client *c, uint32_t idx);
/* When the pool ran short of chunks, asks the owners of chunks that hold none of their units to
 * give them back (cooperative shrink); when no owner could be asked, drains one (relocate.c). */
void client_reclaim(struct kvcd *d);
/* Ends a client: closes its sessions, gives its chunks back scrubbed, frees it. A client that
 * died (no BYE) has its chunks held until its process has exited, when it can be watched. */
void client_destroy(struct kvcd *d, struct client *c, bool died);
/* The process of holds[i] has exited (its pidfd is readable): its chunks are scrubbed, freed. */
void client_exited(struct kvcd *d, uint32_t i);
/* Chunks held for processes that have not exited yet. */
uint32_t client_held_chunks(const struct kvcd *d);

/* session.c */
/* Whose chunks hold the session's blocks: its client's, or its own (a session opened for
 * hand-off: SESSION_DOMAIN | id). */
#define SESSION_DOMAIN (1ull << 63)
uint64_t session_pool_owner(const struct session *s);
/* The pool unit of one block of tier t. */
uint32_t session_unit_bytes(const struct session *s, uint32_t t);
/* Tokens of layer L in tiers 1.. (after the last plan applied, or the outstanding one's with planned). */
uint32_t session_low_tokens(const struct session *s, const struct session_layer *L, bool planned);
/* The name of tier t ("f16", "q8", ...). */
const char *session_tier_name(const struct session *s, uint32_t t);
/* Bytes by block class: blocks of every table the session holds (shared prefix blocks aside), added
 * into by_dtype[enum block_dtype]. */
#define SESSION_DTYPES 8u
void session_add_tier_bytes(const struct session *s, uint64_t by_dtype[SESSION_DTYPES]);
/* The nonzero entries of by_dtype as TierBytes (arena memory). -ENOMEM when the arena is full. */
int session_tier_list(struct wire_arena *a, const uint64_t by_dtype[SESSION_DTYPES], Kvc__TierBytes ***ret,
                      size_t *ret_n);
/* Bits of its blocks (by_dtype: session_add_tier_bytes' of s alone) per key or value element it
 * holds (0 when it holds none). */
float session_bits_per_value(const struct session *s, const uint64_t by_dtype[SESSION_DTYPES]);
/* Layer l's tokens and tables as a ResumeLayer (HandoffImported): the tier fields, and the INT8
 * ones too when the session's only lower tier is q8. Arena memory; -ENOMEM when it is full. */
int session_resume_layer(struct wire_arena *a, const struct session *s, uint32_t l, Kvc__ResumeLayer *out);
/* Gives back the last n_blocks blocks of tier t's table of layer l (a grant undone). */
void session_shrink_table(struct kvcd *d, struct session *s, uint32_t l, uint32_t tier, uint32_t n_blocks);
/* Admits and opens a session. 1: opened, but it waits for its plan buffer (session.wait) while
 * the arbiter reclaims memory: the reply comes when session_retry_open() succeeds. */
int session_open(struct kvcd *d, struct client *c, const Kvc__OpenSession *m, struct session **ret, char *why,
                 size_t why_len);
/* A waiting request, tried again: 0 done, -EINPROGRESS still waiting, else refused. */
int session_retry_open(struct kvcd *d, struct session *s, char *why, size_t why_len);
int session_retry_reserve(struct kvcd *d, struct session *s, Kvc__Grant **ret_g, char *why, size_t why_len);
void session_wait_for_memory(struct kvcd *d, struct session *s, int kind, uint32_t n_tokens,
                             uint64_t request_id);
void session_wait_done(struct kvcd *d, struct session *s);
void session_close(struct kvcd *d, struct session *s);
/* After a restart: a session from its record, under the orphan that stands for its old client,
 * its plan buffer claimed back; its blocks come with the client's Resume. */
int session_restore(struct kvcd *d, struct client *orphan, const Kvc__OpenSession *m, uint64_t id,
                    const uint8_t *token, uint64_t plan_offset, uint32_t plan_units, struct session **ret,
                    char *why, size_t why_len);
/* The session changes hands (a restart's Resume, a hand-off): from its owner's list to to's. */
void session_move(struct session *s, struct client *to);
/* The session id names, if it is c's: -ENOENT unknown, -EPERM another client's. */
int session_lookup(struct kvcd *d, struct client *c, uint64_t id, struct session **ret);
/* Grows every layer to room for n_tokens, all or nothing; the new blocks go into g. */
int session_reserve(struct kvcd *d, struct session *s, uint32_t n_tokens, Kvc__Grant **ret_g, char *why,
                    size_t why_len);
/* Takes one step summary; may build a plan (*ret_plan) and grant blocks (*ret_grant). */
int session_step(struct kvcd *d, struct session *s, const Kvc__Step *st, Kvc__Plan **ret_plan,
                 Kvc__Grant **ret_grant, char *why, size_t why_len);
int session_plan_applied(struct kvcd *d, struct session *s, const Kvc__PlanApplied *m, char *why,
                         size_t why_len);
uint64_t session_bytes(const struct session *s);
uint32_t session_tokens(const struct session *s);
uint32_t session_blocks(const struct session *s);
int session_fill_stats(struct wire_arena *a, const struct session *s, Kvc__SessionStats *ret);
/* Slots of every layer that hold its shared prefix (the first n_shared_blocks blocks). */
uint32_t session_shared_tokens(const struct session *s);
/* A grant's entry for tier t's table of layer l, room for max_blocks blocks, added to g (memory of
 * arena a: d->out for a reply, d->notes for a message sent unasked); NULL when it is full. */
/* What a per-token-tier session's blocks may hold after its next plan: its byte budget or the
 * arbiter's cap, the lower, less its plan buffer and the room of its next step (UINT64_MAX: no
 * bound). The ladder's policy_step.budget_bytes. */
uint64_t session_blocks_budget(const struct session *s);
Kvc__LayerBlocks *session_grant_layer(struct wire_arena *a, Kvc__Grant *g, uint32_t l, uint32_t t,
                                      uint32_t max_blocks);
/* Makes room in table t of s for n entries (its heap grows, within the client's allowance):
 * -ENOSPC past max_layer_blocks or the allowance (the reason in d->refusal). */
int session_table_reserve(struct kvcd *d, struct session *s, struct block_table *t, uint32_t n);
/* Grows one table of layer l to n_blocks blocks from the pool (under the budget), recording the
 * new ones in out (arena memory). All or nothing: a failure gives back the blocks it took, and
 * leaves the table and out as they were. */
int session_grow_table(struct kvcd *d, struct session *s, uint32_t l, uint32_t t, uint32_t n_blocks,
                       Kvc__LayerBlocks *out);

/* restart.c: the fd store (chunks and the state record) across a restart */
/* Keeps a passed fd named `name` (chunk-N, state) for restore; -ENOENT when it is not one. */
int restore_keep_fd(struct kvcd *d, const char *name, int fd);
/* After the pool exists: takes back the kept chunks and sessions (orphaned until their clients
 * resume them), or starts a fresh record. Under no service manager it does nothing. */
int restart_begin(struct kvcd *d);
/* The state record follows sessions and chunk owners. */
int restart_record_session(struct kvcd *d, struct session *s, const Kvc__OpenSession *m);
void restart_forget_session(struct kvcd *d, struct session *s);
/* The session's plan buffer came later than its record (it waited for memory). */
void restart_record_plan(struct kvcd *d, struct session *s);
void restart_record_chunk_owner(struct kvcd *d, uint32_t idx, uint64_t owner);
void restart_record_ids(struct kvcd *d);
/* A client takes back a session after the restart. */
int restart_resume(struct kvcd *d, struct client *c, const Kvc__Resume *m, char *why, size_t why_len);
/* Orphans nobody resumed within the grace period are closed; call every loop round. */
void restart_tick(struct kvcd *d, uint64_t now);
/* Whether the fd store keeps the pool across a restart (clients may then resume). */
bool restart_managed(const struct kvcd *d);
/* A clean stop: nothing is restored next time. */
void restart_end(struct kvcd *d);

/* handoff.c: sessions handed from one client process to another */
/* The owner gives the session up for an import with the ticket (written to ticket). */
int handoff_export(struct kvcd *d, struct client *c, const Kvc__HandoffExport *m,
                   uint8_t ticket[WIRE_TOKEN_BYTES], char *why, size_t why_len);
/* c takes the session: its chunk fds are sent to c; the caller answers with its tables. */
int handoff_import(struct kvcd *d, struct client *c, const Kvc__HandoffImport *m, struct session **ret,
                   char *why, size_t why_len);
/* Exports nobody imported in time are closed; call every loop round. */
void handoff_tick(struct kvcd *d, uint64_t now);
/* At stop: every export is closed. */
void handoff_end(struct kvcd *d);

/* relocate.c: moving a client's blocks out of a chunk so that the chunk can be given back */
/* d->notes, the arena of what kvcd sends unasked: one plan of WIRE_MAX_MOVES moves (about 20 KiB),
 * or a demotion's link with its grant, at most WIRE_MAX_LAYERS layers of a LayerPlan, its tier
 * counts and a LayerBlocks of one block for each of WIRE_MAX_TIERS tiers (under 512 bytes a
 * layer: 128 KiB), with room to spare */
#define NOTE_BYTES (256u * 1024u)
/* The pool is short of chunks and none is empty: picks one to drain, and sends its sessions their
 * moves. false when none qualifies, or one is draining already. */
bool relocate_pick(struct kvcd *d, uint64_t now);
/* Whether s has blocks in the chunk being drained. */
bool relocate_wanted(const struct kvcd *d, const struct session *s);
/* Sends s a plan of moves (unasked) when it has blocks to move and no plan outstanding. */
void relocate_kick(struct kvcd *d, struct session *s);
/* The outstanding plan's moves in s's tables: forward puts the destinations in, !forward undoes. */
void relocate_swap(struct session *s, bool forward);
/* The plan was applied (tables swapped): the blocks moved from are freed. */
void relocate_commit(struct kvcd *d, struct session *s);
/* The plan's destinations are freed (the session closes, or a plan was not sent). */
void relocate_undo(struct kvcd *d, struct session *s);
/* The client refused the plan: destinations freed, the drain called off, its chunks left alone. */
void relocate_refused(struct kvcd *d, struct session *s, int status);
/* Pool bytes the session's moves in flight hold (the audit counts them). */
uint64_t relocate_bytes(const struct session *s);
/* Calls off a drain past its deadline; call every loop round. */
void relocate_tick(struct kvcd *d, uint64_t now);

/* server.c */
int server_start(struct kvcd *d);
int server_run(struct kvcd *d);
void server_stop(struct kvcd *d);
