/* laddercache.h - the in-process cache of the precision ladder (kvc-run --local --tier, the tier
 * bench): every token kept, the most recent `window` of each layer in the session's dtype and all
 * older ones at one lower tier (q8, q4, q3 or q2: kernels/tier.h), as llama.cpp's cache types and
 * transformers' QuantizedCache keep a whole cache at one precision beyond a recent window. It is
 * the reference a kvcd session with the same tiers is compared with, and the way each tier's
 * quality is measured alone.
 *
 * Demotion is decided by the count of stored tokens only: when a layer's full-precision part
 * reaches window + one block (16 tokens), its oldest block's worth goes down, at store() time. So
 * a prompt fed in chunks and the same prompt fed token by token give the same bits, and a token
 * attends to the older ones as they are held when it is stored. The cache offers no attend_rows:
 * rows are attended one after another (the model falls back to that), each over its own layer.
 *
 * Bytes: ladder_cache_bytes() is what kvcd would charge for the blocks in use (every tier's
 * blocks times its block size, kernels/block.h's layouts), so the cache's memory can be set beside
 * the full cache's at equal bytes.
 */
#ifndef KVC_ENGINE_LADDERCACHE_H
#define KVC_ENGINE_LADDERCACHE_H

#include <stdint.h>

#include "block.h"
#include "model.h"

struct ladder_cache;

struct ladder_cache_config {
        enum block_dtype dtype; /* the recent window's: f32, f16 or bf16 */
        const char *tier;       /* "q8", "q4", "q3", "q2", or NULL / "" for none (the window's dtype alone) */
        uint32_t window;        /* tokens kept at dtype, at least 1 */
        uint64_t seed;          /* the rotation's (lloyd.h) */
};

/* -EINVAL for a bad configuration (an unknown tier, a head_dim a packed tier cannot rotate),
 * -ENOMEM. max_tokens as plain_cache_new's. */
int ladder_cache_new(const struct model_config *cfg, int max_tokens, const struct ladder_cache_config *lc,
                     struct ladder_cache **ret);
struct ladder_cache *ladder_cache_free(struct ladder_cache *c);
/* Forgets every token (a new sequence), keeping the memory. */
void ladder_cache_reset(struct ladder_cache *c);
/* Bytes of the blocks that hold tokens now, summed over layers and tiers; and the most ever held. */
uint64_t ladder_cache_bytes(const struct ladder_cache *c);
uint64_t ladder_cache_peak_bytes(const struct ladder_cache *c);
/* The bytes a full cache of the same tokens at dtype would hold (the same blocks, all at dtype). */
uint64_t ladder_cache_full_bytes(const struct ladder_cache *c);

/* store(pos) needs pos == the tokens the layer holds (append) or 0 (the layer starts again);
 * -EINVAL otherwise, -ERANGE past max_tokens. */
extern const struct model_cache_ops ladder_cache_ops; /* ctx is a struct ladder_cache * */

#endif
