/* prefix.h: shared prompt prefixes (OpenSession.share_prefix). Owns the index of published
 * blocks and their references.
 *
 * A session that may share its prompt allocates the prompt's whole 16-token blocks (all but the
 * block of the prompt's last token, whose logits the session computes itself) in chunks of a
 * domain of its own, PREFIX_DOMAIN | its id. Once its prefill has passed them, it publishes them:
 * each block (one per layer) enters the index under the hash chain of the prompt's tokens up to it
 * (events.c's FNV-1a chain) and the model's key, with one reference, the publisher's, and is
 * charged to the publisher's tenant instead of the session. A later session of the same model and
 * the same prompt prefix attaches the blocks at open: it takes a reference to each, its tables
 * start with them, and its client maps their chunks read-only and computes nothing for them. A
 * shared block is never written again: plans keep shared slots in place and mask the ones a session
 * evicts (its own bitmap in its plan buffer), attention leaves their scores alone, kvcd writes no
 * log-weight into them. The last reference to go frees the block; a domain whose blocks are all
 * gone gives its chunks back, scrubbed and retired.
 *
 * Shared blocks count once against the capacity, charged to the publisher's tenant until the last
 * reference goes.
 *
 * Who attaches what (issue 28, item 1). The public chain hash (events.c's FNV-1a, on the KV events
 * and the replay socket) is linear enough that anyone who reads it can forge a prompt with the same
 * chain, so attaching never rests on it:
 *   - the index is keyed by a chain of SipHash-2-4 under a per-boot secret over the scope, the
 *     model's key and the block's token ids (prefix_key), so a forged key needs the secret;
 *   - a hit is then checked exactly: every published block keeps its 16 token ids and the block it
 *     was published after (its parent), and a session attaches block i only when its ids are the
 *     session's and its parent is the block the session attached at i - 1, so the whole prefix is
 *     compared id for id, whatever any hash says;
 *   - blocks are shared only inside a scope (--share-scope): by default the publisher's uid (the
 *     side channel's SO_PEERCRED), or the session's tenant. Another scope's blocks are not found,
 *     and its publications never stop this scope's own.
 * Rejected: hashing the ids with a stronger public hash only (still a hash alone, and the events
 * must keep the hash routers compute); sharing across uids by default (one user's prompt is
 * another's secret: a match would tell an attacker that some session used the prompt). */
#pragma once

#include <stdint.h>

struct kvcd;
struct session;
struct tenant;

#define PREFIX_DOMAIN (1ull << 62)

#define PREFIX_BLOCK_TOKENS 16 /* sharing needs 16-token blocks: those the prompt's ids are kept in */

enum prefix_scope {
        PREFIX_SCOPE_UID,    /* sessions of clients with the publisher's uid (the default) */
        PREFIX_SCOPE_TENANT, /* sessions of the publisher's tenant */
};

struct prefix_block {
        uint64_t model; /* the model's key */
        uint64_t key;   /* its key in the index: the keyed chain of its scope, model and ids */
        uint64_t scope; /* who may attach it (prefix_scope_of) */
        struct prefix_block *parent; /* the block before it (NULL for the first); outlives it */
        uint32_t ids[PREFIX_BLOCK_TOKENS];
        uint32_t index; /* the block's place in the prompt */
        uint32_t refs;   /* sessions whose tables hold it */
        uint64_t domain; /* whose chunks it lives in */
        struct tenant *ten;
        uint64_t bytes; /* one block per layer */
        uint32_t unit_bytes;
        uint32_t n_layers;
        uint64_t offs[]; /* per layer */
};

/* Draws the per-boot secret of the index keys. */
int prefix_init(struct kvcd *d);
/* "uid" or "tenant": the scope, or -EINVAL. */
int prefix_scope_parse(const char *name);
void prefix_done(struct kvcd *d);

/* The key of a model: its id and everything that shapes its blocks. 0 when model_id is empty. */
uint64_t prefix_model_key(const char *model_id, uint32_t n_layers, uint32_t n_kv_heads, uint32_t head_dim,
                          int dtype, uint32_t block_tokens);

/* At open, the session registered and its prompt hashed: attaches the longest published prefix
 * (its first table entries, references taken, chunks sent read-only to its client). Returns the
 * number of blocks attached. */
uint32_t prefix_attach(struct kvcd *d, struct session *s);
/* After a step: publishes the prompt blocks the prefill has passed, when it has passed them all.
 * Returns how many it published. */
uint32_t prefix_publish(struct kvcd *d, struct session *s);
/* At close: drops the session's references; blocks nobody holds are freed. */
void prefix_release(struct kvcd *d, struct session *s);

/* What the index holds (status, audit). */
void prefix_totals(const struct kvcd *d, uint32_t *ret_blocks, uint64_t *ret_bytes);
/* For the audit: 0 when every block of the index is its domain's in the pool. */
int prefix_audit(const struct kvcd *d, uint64_t *ret_bytes);
