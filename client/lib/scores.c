/* scores.c: kvc_layer_set_scores and kvc_layer_get_scores, the caller's own importance in the score
 * the policies rank by.
 *
 * Why it is here: a policy ranks a layer's tokens by the side array `sum` (kernels/block.h), which
 * the attention kernels fill with the attention each token received so far: importance as seen
 * by the queries that came before. A client that knows better (the surprisal of each token, or
 * how much a pass that reconstructs the context attends to it: client/engine/importance.h, and
 * docs/policies.md, "Importance without the question") writes its own scores there, and kvcd's
 * policies rank by them with no change to kvcd or to the wire.
 *
 * Contract: slot first + i of KV head h gets score[h * n + i] (kvc_layer_gather's order, one
 * float a slot), in whatever tier the slot lives (the ladder's logical order: the lowest tier
 * first, kernels/ladder.h); get reads the same places back. Only `sum` is written: the EMA and
 * the last attention stay the attention kernels' (a policy that ranks by those sees no change),
 * and the kernels go on adding to `sum` on every kvc_attend after the write. Slots of a shared
 * prefix are other sessions' too (read-only here, like their scores in the attention kernels):
 * set leaves them as they are, get reads them. Every check comes before the first write:
 * -EINVAL for a bad layer, a range past the layer's length, a missing array or a score that is
 * NaN or infinite, -ENOTSUP on a device pool (the blocks are GPU memory). The rejected
 * alternative, a score message to kvcd, would copy what the client can write where it is.
 */
#include <errno.h>
#include <math.h>

#include "internal.h"
#include "ladder.h"

/* The checks both directions share; 0 or the error, recorded. */
static int check_range(const struct kvc_session *s, uint32_t layer, uint32_t first, uint32_t n,
                       const float *score) {
        if (layer >= s->g.n_layers)
                return client_error(s->c, -EINVAL, "layer %u of %u", layer, s->g.n_layers);
        if (s->c->dev)
                return client_error(s->c, -ENOTSUP, "scores: the pool is GPU memory");
        uint32_t len = s->layers[layer].n_tokens;
        if (first > len || n > len - first)
                return client_error(s->c, -EINVAL,
                                    "scores of %u slots from slot %u of layer %u, which holds %u", n, first,
                                    layer, len);
        if (n && !score)
                return client_error(s->c, -EINVAL, "no score array for layer %u", layer);
        return 0;
}

/* The `sum` of logical slot `slot` of KV head h. */
static float *sum_at(const struct ladder_layer *M, uint32_t h, uint32_t slot) {
        uint32_t t, idx;
        ladder_locate(M, slot, &t, &idx);
        const struct block_layout *l = M->layout[t];
        return block_side(l, M->blocks[t][idx / l->block_tokens], l->sum_offset, h, idx % l->block_tokens);
}

int kvc_layer_set_scores(struct kvc_session *s, uint32_t layer, uint32_t first, uint32_t n,
                         const float *score) {
        int e = check_range(s, layer, first, n, score);
        if (e < 0)
                return e;
        size_t all = (size_t)s->g.n_kv_heads * n;
        for (size_t i = 0; i < all; i++)
                if (!isfinite(score[i]))
                        return client_error(s->c, -EINVAL, "score %zu of layer %u is not a finite number", i,
                                            layer);
        struct ladder_layer M = session_ladder_layer(s, layer);
        uint32_t from = first > s->n_shared ? first : s->n_shared;
        for (uint32_t h = 0; h < s->g.n_kv_heads; h++)
                for (uint32_t slot = from; slot < first + n; slot++)
                        *sum_at(&M, h, slot) = score[(size_t)h * n + (slot - first)];
        return 0;
}

int kvc_layer_get_scores(const struct kvc_session *s, uint32_t layer, uint32_t first, uint32_t n,
                         float *score) {
        int e = check_range(s, layer, first, n, score);
        if (e < 0)
                return e;
        struct ladder_layer M = session_ladder_layer(s, layer);
        for (uint32_t h = 0; h < s->g.n_kv_heads; h++)
                for (uint32_t i = 0; i < n; i++)
                        score[(size_t)h * n + i] = *sum_at(&M, h, first + i);
        return 0;
}
