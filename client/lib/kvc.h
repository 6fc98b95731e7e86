/* kvc.h: libkvc, the client library of kvcd.
 *
 * An inference process connects once (kvc_connect), opens one session per sequence
 * (kvc_session_open), and for every token of every sequence:
 *
 *   1. per layer: kvc_append() the token's key and value, kvc_attend() its query (the CPU
 *      attention; it also updates the per-token scores the policy reads);
 *   2. kvc_summarize() the logits and kvc_step() the summary;
 *   3. kvc_flush() once per batch: the summaries of all sessions go to kvcd in one message, and the
 *      plans kvcd answers with are applied (compaction) before the call returns.
 *
 * With the default plan_lag of 0 the plan caused by step t is applied before step t + 1, so a run
 * is deterministic: the same tokens whatever the timing. A larger lag lets the client run ahead
 * of kvcd by that many steps.
 *
 * The pool is mapped into one reserved address range: a block is at the same offset from
 * kvc_pool_base() in this process as in kvcd. Keys and values are handed over as floats and
 * stored in the session's dtype.
 *
 * Conventions: int returns, 0 or positive on success, -errno on failure (the README lists the
 * codes); out-parameters are untouched on failure; kvc_last_error() has the reason, including the
 * daemon's message. The library never prints, exits or aborts, and is not thread-safe: one
 * client per thread.
 */
#pragma once

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define KVC_VERSION "0.3.0"

enum kvc_dtype {
        KVC_DTYPE_F32 = 1,
        KVC_DTYPE_F16 = 2,
        KVC_DTYPE_BF16 = 3,
};

enum kvc_phase {
        KVC_PHASE_DECODE = 0,
        KVC_PHASE_PREFILL = 1,
};

struct kvc_client;
struct kvc_session;

struct kvc_options {
        const char *socket;      /* kvcd's runtime directory or its kvcd.sock; NULL: $KVC_SOCKET, else
                                    $XDG_RUNTIME_DIR/kvcd, else /tmp/kvcd-$UID */
        const char *name;        /* shown to operators; at most 64 bytes */
        int timeout_ms;          /* for every wait on kvcd; 0: 10000 */
        uint32_t plan_lag;       /* steps the client may run ahead of kvcd's answers (default 0) */
        int resume_ms;           /* when kvcd restarts under its service manager (it said so), how long
                                    to keep trying to reconnect and resume every session: 0: 30000;
                                    negative: never (calls fail with ENOTCONN at once) */
        const char *daemon_user; /* the only user (a name or a uid) kvcd may run as; NULL:
                               $KVC_DAEMON_UID, else root, this process's uid or the user "kvcd"
                               (the unit's User=); and root as pid 1 (socket activation). Checked
                               on the side channel (SO_PEERCRED), the runtime directory and
                               kvcd.sock before a byte is sent: EPERM */
};

/* A kvcd that keeps its pool in systemd's fd store (kvcd --fd-store) comes back after a crash
 * with every chunk: libkvc then reconnects by itself, resumes every session with its block tables
 * (nothing is copied or recomputed) and sends again the step summaries kvcd had not answered, so
 * the caller sees one slower call and nothing else. A kvcd without it closes the connection for
 * good: calls fail with ENOTCONN.
 *
 * On a device pool (kvcd --backend cuda) this also loads the CUDA driver (dlopen), finds the GPU
 * kvcd named by UUID, makes its primary context current on the calling thread and reserves the
 * pool's range there; -ENODEV (no driver, a stub, no device) or -ENXIO (the GPU is not visible to
 * this process) then, with the reason in kvc_last_error(NULL). */
int kvc_connect(const struct kvc_options *opt, struct kvc_client **ret);
/* Closes every session (kvcd frees their blocks) and the connection. Accepts NULL. */
struct kvc_client *kvc_disconnect(struct kvc_client *c);
/* The reason for the last failure, or "". With NULL: why the last kvc_connect() of this thread
 * failed, when it knows more than its return code. */
const char *kvc_last_error(const struct kvc_client *c);
/* The runtime directory a client would use without options (buf gets at most len bytes). */
int kvc_default_runtime_dir(char *buf, size_t len);
/* The check kvc_connect makes of kvcd.sock, for the programs that use kvcd's other sockets
 * (kvcctl on kvcd.admin.sock): connects to the Unix socket at path once (nothing is sent) and
 * checks its listener (SO_PEERCRED), the socket file and its directory against the users allowed
 * to be kvcd (daemon_user as in kvc_options, NULL: $KVC_DAEMON_UID, else root, this process's uid
 * or the user "kvcd"); the directory must be writable by nobody else. 0, -EPERM when it is not
 * kvcd's, or -errno (-ENOENT, -ECONNREFUSED, -EACCES...) from the connect; the reason in why. */
int kvc_check_daemon_socket(const char *path, const char *daemon_user, char *why, size_t why_len);

struct kvc_geometry {
        uint32_t n_layers;
        uint32_t n_heads;    /* query heads */
        uint32_t n_kv_heads; /* divides n_heads */
        uint32_t head_dim;
        enum kvc_dtype dtype;
        uint32_t max_tokens; /* the model's context length */
};

/* A policy parameter: the value is sent as a number when it parses as one, else as a word. */
struct kvc_param {
        const char *key;
        const char *value;
};

struct kvc_session_config {
        struct kvc_geometry geometry;
        const char *policy;     /* "full", "window", ... */
        uint32_t budget_tokens; /* per layer; 0: the policy's default */
        const struct kvc_param *params;
        size_t n_params;
        const char *tenant;               /* NULL: the default tenant */
        uint32_t prompt_tokens;           /* the prompt's length (BOS included) if known: the prefill policies
                                             (snapkv, scope) compress the prompt once it is in */
        const uint32_t *prompt_token_ids; /* optional: the prompt's tokens, whose 16-token blocks
                                             kvcd publishes as KV events (prefix routing) */
        size_t n_prompt_token_ids;
        /* memory limits (kvcd clamps them; docs/operations.md, "Budgets"): the bytes kvcd must
         * guarantee (0: the least the session runs with), the most it may hold (0: no limit of its
         * own), and the priority (higher keeps its memory longer when memory is short) */
        uint64_t min_bytes;
        uint64_t max_bytes;
        int32_t priority;
        /* the session may be handed to another process (kvc_session_export): its blocks then live
         * in chunks of its own, at least one chunk (2 MiB by default) */
        int handoff;
        /* shared prefixes: with the prompt's token ids, attach the longest prefix of whole 16-token
         * prompt blocks another session of the same model_id published (kvc_session_shared_tokens
         * says how many tokens are already in the cache: the caller computes nothing for them),
         * and publish this session's own once its prefill has passed them. Host pools only. */
        int share_prefix;
        const char *model_id; /* names the weights: sessions share only with the same id */
        /* the precision ladder (docs/protocol.md, "Tiers"): the tiers below the dtype this session
         * stores, highest first, comma-separated: "q4", "q8,q4", "q8,q4,q3" (any falling subset of
         * q8, q4, q3, q2). NULL or "": INT8 when the policy asks for it (conf's int8), as before.
         * Policies send the oldest tokens down (conf's int8, the tier_window parameter: every token
         * but the newest N at the lowest tier). Host pools only. */
        const char *tiers;
        uint64_t rotation_seed; /* of the rotated tiers (q4, q3, q2), recorded with the session */
        /* a byte budget (docs/policies.md, "Byte budgets"): the most bytes the session's cache
         * should hold as kvcd charges them, 0: none. The ladder policy fits it by lowering
         * precision first (with tiers); token policies get the tokens per layer it buys at the
         * dtype. kvc_full_cache_bytes gives the bytes of a whole cache to take a fraction of. */
        uint64_t budget_bytes;
};

/* The bytes kvcd charges for n_tokens tokens in every layer at the geometry's dtype (whole
 * 16-token blocks, no plan buffer): the full cache a byte budget is a fraction of. 0 for a
 * geometry kvcd would refuse. */
uint64_t kvc_full_cache_bytes(const struct kvc_geometry *g, uint32_t n_tokens);

struct kvc_session_stats {
        uint64_t steps;
        uint64_t plans;             /* plans kvcd sent */
        uint64_t plans_applied;     /* plans this client applied */
        uint64_t blocks_moved;      /* blocks this client moved for kvcd (relocation) */
        uint32_t peak_tokens;       /* the most tokens a layer held, by kvcd's accounting */
        uint32_t peak_layer_blocks; /* the most blocks a layer held, by kvcd's accounting */
        uint64_t peak_bytes;        /* the most pool bytes the session held */
        uint64_t bytes;             /* pool bytes held when the stats were taken */
};

int kvc_session_open(struct kvc_client *c, const struct kvc_session_config *cfg, struct kvc_session **ret);
/* Closes the session and frees it (also on failure); ret_stats (may be NULL) gets kvcd's final
 * accounting. */
int kvc_session_close(struct kvc_session *s, struct kvc_session_stats *ret_stats);
uint64_t kvc_session_id(const struct kvc_session *s);
/* The budget kvcd put in force (tokens per layer). */
uint32_t kvc_session_budget(const struct kvc_session *s);
/* The most tokens one layer of the session may hold (the policy's limit, or the session's cap):
 * a client that appends several tokens before its next step (a prompt in chunks) keeps a layer's
 * length plus the chunk within it, and lets kvcd's plans make room between chunks. */
uint32_t kvc_session_max_tokens(const struct kvc_session *s);

/* Hand-off without copying (a prefill worker giving a sequence to a decode worker). The owner
 * waits for every answer and plan, then trades the session for a one-time ticket: the session is
 * freed here and must not be used again. Another process imports it with the ticket within 30 s
 * and carries on where the exporter stopped: same blocks (its chunks are mapped into the
 * importer), same lengths, same steps; kvcd then asks the exporter to unmap the chunks. Only
 * sessions opened with kvc_session_config.handoff can be exported (EINVAL otherwise). The ticket
 * is a secret: whoever has it gets the sequence's cache. */
struct kvc_handoff {
        uint64_t session_id;
        uint8_t ticket[16];
};
int kvc_session_export(struct kvc_session *s, struct kvc_handoff *ret);
int kvc_session_import(struct kvc_client *c, const struct kvc_handoff *h, struct kvc_session **ret);
/* The last step the session took (for an importer: where the exporter stopped), and whether it
 * took any. */
uint64_t kvc_session_last_step(const struct kvc_session *s, int *ret_stepped);

/* Makes room for n_tokens tokens in every layer (a prompt). -ENOSPC beyond the policy's limit or
 * the pool's capacity. kvc_append() reserves one more token by itself when it must. */
int kvc_session_reserve(struct kvc_session *s, uint32_t n_tokens);

/* Stores the key and value ([n_kv_heads * head_dim] floats each) of the token at position pos at
 * the end of the layer. */
int kvc_append(struct kvc_session *s, uint32_t layer, int32_t pos, const float *k, const float *v);

/* Decode attention of q ([n_heads * head_dim]) over the layer's cache into out (same shape), and
 * the update of the per-token scores (sum, EMA, last) the policies rank by. */
int kvc_attend(struct kvc_session *s, uint32_t layer, const float *q, float *out);

/* Attention of a prompt chunk: the layer's last n_rows tokens (appended with kvc_append, no plan
 * applied since) attend causally, row r of q ([n_rows][n_heads * head_dim]) over the layer's
 * slots up to and including its own, into out (same shape). It computes what n_rows kvc_attend()
 * calls, each right after its token's kvc_append(), would (bit for bit, scores included), reading
 * the cache once for every 8 rows instead of once a row. -EINVAL for n_rows 0, more than the
 * layer's tokens, or rows a plan moved to INT8. kvc_attend() is kvc_attend_rows() of one row. */
int kvc_attend_rows(struct kvc_session *s, uint32_t layer, uint32_t n_rows, const float *q, float *out);

uint32_t kvc_layer_tokens(const struct kvc_session *s, uint32_t layer);
/* The shared prefix at the front of every layer: tokens already there when the session opened
 * (attached), or published since; they are never written again. */
uint32_t kvc_session_shared_tokens(const struct kvc_session *s);
/* How many of a layer's tokens (the oldest, in slot order) are held below the session's dtype, in
 * any lower tier (INT8 for a session whose only lower tier is q8). */
uint32_t kvc_layer_q8_tokens(const struct kvc_session *s, uint32_t layer);
/* The session's tiers: 1 + the tiers below its dtype; the name of tier t ("f16", "q8", "q4", ...,
 * NULL past the last), and how many of a layer's tokens tier t holds. */
uint32_t kvc_session_tiers(const struct kvc_session *s);
const char *kvc_session_tier_name(const struct kvc_session *s, uint32_t tier);
uint32_t kvc_layer_tier_tokens(const struct kvc_session *s, uint32_t layer, uint32_t tier);
/* The bytes kvcd charges the session now, as this client holds them: every tier's blocks of every
 * layer and the plan buffer (what a byte budget bounds: kvc_session_config.budget_bytes). */
uint64_t kvc_session_bytes(const struct kvc_session *s);
/* The byte budget in force (SessionOpened.budget_bytes; 0: none). */
uint64_t kvc_session_budget_bytes(const struct kvc_session *s);

/* How a layer lies in the pool, for a kernel of the caller's own (see kernels/block.h and
 * kernels/mixed.h): slots [0, n_q8) are INT8 in q8_blocks, slots [n_q8, n_tokens) full precision
 * in blocks. */
struct kvc_layer_view {
        uint32_t n_tokens;
        uint32_t n_blocks;
        uint32_t block_tokens;
        uint64_t block_bytes;
        uint8_t *const *blocks; /* n_blocks full-precision block addresses, in slot order */
        uint32_t n_q8;
        uint32_t n_q8_blocks;
        uint64_t q8_block_bytes;
        uint8_t *const *q8_blocks;
};
/* -ENOTSUP for a session with tiers other than INT8 (OpenSession.tiers): its packed blocks have no
 * view here; kvc_layer_gather reads every tier. */
int kvc_layer_view(const struct kvc_session *s, uint32_t layer, struct kvc_layer_view *ret);

/* ---- device pools (kvcd --backend cuda; docs/gpu.md) ----
 *
 * The pool is then GPU memory: kvc_pool_base() and the block addresses of kvc_layer_view() are
 * device pointers on the GPU kvc_pool_device() names (this process's CUDA ordinal), and the CPU
 * kernels behind kvc_append() and kvc_attend() answer -ENOTSUP. The caller runs its own kernels
 * (kernels/cuda.h has the compaction, attention and summary kernels) on the blocks:
 *
 *   - a token goes in with kvc_append_slots() (room is granted, the length counted), then the
 *     caller writes its key, value and side arrays (position; zero scores and log-weight) at the
 *     slot kvc_layer_view() shows; its stream must be synchronized before kvc_flush(), which
 *     reports the lengths (kvcd reads the score arrays from the GPU when it plans);
 *   - plans are checked by libkvc on a copy of the plan buffer, then handed, one layer at a time,
 *     to the compactor the caller registered; without one a plan is refused (-ENOTSUP, and kvcd
 *     is told).
 */

/* 1 when the pool is GPU memory. */
int kvc_pool_is_device(const struct kvc_client *c);
/* The base of the pool's range (a device pointer on a device pool): chunk i at i * chunk bytes. */
void *kvc_pool_base(const struct kvc_client *c);
/* The CUDA device ordinal (in this process) of a device pool; -1 for host memory. */
int kvc_pool_device(const struct kvc_client *c);

/* Counts n more tokens at the end of the layer, which the caller writes itself (any pool): their
 * slots are the layer's old length and on, in the blocks kvc_layer_view() shows after the call.
 * Reserves blocks from kvcd as kvc_append() does. -ENOSPC past the session's limit. */
int kvc_append_slots(struct kvc_session *s, uint32_t layer, uint32_t n);

/* One layer of a plan, for a compactor: gather slots keep[...] (per KV head when per_head, head
 * after head) of the first base_tokens into a dense prefix, move slots [base_tokens, old length)
 * right after them, leave the oldest q8_tokens slots INT8 (kernels/mixed.h): the contract of
 * compact_mixed and kvc_cuda_compact_mixed. summary_slot, when not 0, asks for a summary of the
 * evicted tokens in slot summary_slot - 1 (kernels/summarize.h); a compactor that cannot make
 * one refuses the layer. */
struct kvc_compaction {
        uint32_t layer;
        const uint32_t *keep;        /* host memory: libkvc's checked copy */
        const uint32_t *keep_device; /* the same entries in the plan buffer (device memory); kvcd
                                        could rewrite them after the check, so kernels that read
                                        them must check them again (kvc_cuda_compact_mixed does) */
        uint32_t keep_count;
        int per_head;
        uint32_t base_tokens;
        uint32_t q8_tokens;
        uint32_t summary_slot;
        uint32_t new_tokens;        /* the layer's length after compaction */
        struct kvc_layer_view view; /* the layer before it */
};
/* Compacts one layer and returns 0 once the work is complete (the stream synchronized: kvcd may
 * grant the blocks the layer gives back to another session), or -errno, which fails the plan. */
typedef int (*kvc_compactor)(void *ctx, struct kvc_session *s, const struct kvc_compaction *job);
/* Registers the compactor for plans on a device pool (NULL: none). Host pools use libkvc's CPU
 * kernels whatever is registered. */
void kvc_set_compactor(struct kvc_client *c, kvc_compactor fn, void *ctx);

/* The logits summary: normalized entropy, top-1 probability and top-1 minus top-2 margin. */
struct kvc_summary {
        float entropy;
        float top1_prob;
        float margin;
        uint32_t top1;
};
int kvc_summarize(const float *logits, uint32_t vocab, struct kvc_summary *ret);

/* CONF-KV's confidence of a summary with the default weights, as kvcd computes it:
 * 0.4 (1 - entropy) + 0.3 sigmoid(margin) + 0.3 top1_prob, in [0.15, 1]. */
float kvc_confidence(const struct kvc_summary *s);

/* Queues the summary of step `step` (strictly increasing) for the next kvc_flush(). A session
 * kvcd closed on its own (an operator evicted it) answers -ESHUTDOWN here and in kvc_append(). */
int kvc_step(struct kvc_session *s, uint64_t step, enum kvc_phase phase, const struct kvc_summary *sum);

/* Sends the queued summaries in one message, then waits until at most plan_lag answers are
 * outstanding, applying the plans and grants they carry. Errors kvcd reported about single
 * steps are returned (the first one) after everything else was handled. */
int kvc_flush(struct kvc_client *c);

/* Handles what kvcd sent, waiting up to timeout_ms for the first message. Returns the number of
 * messages handled. */
int kvc_poll(struct kvc_client *c, int timeout_ms);

/* The session's stats as this client knows them (kvcd's peak figures arrive at close). */
void kvc_session_get_stats(const struct kvc_session *s, struct kvc_session_stats *ret);

/* ---- importance scores (scores.c) ---- */

/* The score the policies rank a layer's tokens by (the accumulated attention, `sum` in
 * kernels/block.h), for a caller that computes its own importance (docs/policies.md, "Importance
 * without the question"). set writes score[h * n + i] as the score of slot first + i of KV head
 * h, in every tier (slot order as kvc_layer_gather's); get reads them back the same way. Only the
 * score is written, and the attention kernels keep adding to it on every kvc_attend. Slots of a
 * shared prefix are other sessions' too: set leaves them, get reads them. Host pools only
 * (-ENOTSUP on a device pool); -EINVAL for a bad layer, a range past the layer's length, a NULL
 * array with n > 0, or (set) a score that is NaN or infinite, and nothing is written then. */
int kvc_layer_set_scores(struct kvc_session *s, uint32_t layer, uint32_t first, uint32_t n, const float *score);
int kvc_layer_get_scores(const struct kvc_session *s, uint32_t layer, uint32_t first, uint32_t n, float *score);

/* ---- gathering a layer (gather.c) ---- */

/* Copies slots [first, first + n) of a layer, keys and values, into the caller's float32 arrays,
 * slot order, INT8 slots dequantized: row i of KV head h at out + (h * stride_tokens + i) *
 * head_dim (stride_tokens 0: n), the [n_kv_heads][tokens][head_dim] layout a framework's
 * attention takes. Host pools only (-ENOTSUP on a device pool); -EINVAL for a bad layer, a range
 * past the layer's length or a stride below n. The copy is the caller's: later plans leave it. */
int kvc_layer_gather(const struct kvc_session *s, uint32_t layer, uint32_t first, uint32_t n,
                     uint32_t stride_tokens, float *keys, float *values);

#ifdef __cplusplus
}
#endif
