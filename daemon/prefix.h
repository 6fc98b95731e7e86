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
 * reference goes. A client can only find blocks of a prompt it has (the chain hashes its own
 * tokens) for the same model (the key includes model_id and the geometry), so sharing crosses
 * tenants without showing anyone anything they could not compute. */
#pragma once

#include <stdint.h>

struct kvcd;
struct session;
struct tenant;

#define PREFIX_DOMAIN (1ull << 62)

struct prefix_block {
        uint64_t model;  /* the model's key */
        uint64_t chain;  /* the hash chain of the prompt up to and with this block */
        uint32_t index;  /* the block's place in the prompt */
        uint32_t refs;   /* sessions whose tables hold it */
        uint64_t domain; /* whose chunks it lives in */
        struct tenant *ten;
        uint64_t bytes; /* one block per layer */
        uint32_t unit_bytes;
        uint32_t n_layers;
        uint64_t offs[]; /* per layer */
};

int prefix_init(struct kvcd *d);
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
