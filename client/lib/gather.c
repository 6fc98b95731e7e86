/* gather.c: kvc_layer_gather, a copy of a layer's keys and values out of the pool's blocks into
 * one dense array per side, the layout a framework's attention takes ([n_kv_heads][tokens][head_dim]).
 *
 * Why it is here: a caller that cannot read kvcd's blocks in place (transformers' attention wants
 * one dense tensor per layer, and a layer is a table of 16-token blocks of [n_kv_heads][16][head_dim]
 * each) has to gather them every step. In C that is one memcpy per head and run of slots inside a
 * block (4 KiB for SmolLM2's head_dim 64 at float32); from Python it was an index_select over a
 * row index, 1.3x the cost of transformers' own cache per decode token (docs/python.md).
 *
 * Contract: slots [first, first + n) of the layer, in slot order; slots of a lower tier (the
 * layer's oldest) are dequantized with their scales and rotated back (ladder_load), tier 0's
 * converted from the session's dtype (a plain copy at float32). Row i of head h goes to
 * out + ((size_t)h * stride_tokens + i) * head_dim, so a caller may keep a larger array and fill
 * it piecewise (stride_tokens 0 means n). Reads only this process's mapping: no message to kvcd.
 * -EINVAL for a bad layer, a range past the layer's length or a stride below n; -ENOTSUP on a
 * device pool (the blocks are GPU memory there). Nothing is written on failure.
 */
#include <errno.h>
#include <string.h>

#include "internal.h"
#include "ladder.h"

int kvc_layer_gather(const struct kvc_session *s, uint32_t layer, uint32_t first, uint32_t n,
                     uint32_t stride_tokens, float *keys, float *values) {
        if (layer >= s->g.n_layers)
                return client_error(s->c, -EINVAL, "layer %u of %u", layer, s->g.n_layers);
        if (s->c->dev)
                return client_error(s->c, -ENOTSUP, "kvc_layer_gather: the pool is GPU memory");
        const struct layer *L = &s->layers[layer];
        if (first > L->n_tokens || n > L->n_tokens - first)
                return client_error(s->c, -EINVAL, "%u slots from slot %u of layer %u, which holds %u", n,
                                    first, layer, L->n_tokens);
        if (!stride_tokens)
                stride_tokens = n;
        if (stride_tokens < n)
                return client_error(s->c, -EINVAL, "a stride of %u tokens for %u slots", stride_tokens, n);
        if (n && (!keys || !values))
                return client_error(s->c, -EINVAL, "no array to gather layer %u into", layer);
        const struct block_layout *l = &s->layout;
        uint32_t T = l->block_tokens, D = s->g.head_dim, end = first + n, low = session_low_tokens(s, L);
        struct ladder_layer M = session_ladder_layer(s, layer);
        for (uint32_t h = 0; h < s->g.n_kv_heads; h++) {
                float *ko = keys + (size_t)h * stride_tokens * D,
                      *vo = values + (size_t)h * stride_tokens * D;
                uint32_t slot = first;
                for (; slot < end && slot < low; slot++) /* lower tiers: row by row, with the scales */
                        ladder_load(&M, h, slot, ko + (size_t)(slot - first) * D, vo + (size_t)(slot - first) * D);
                while (slot < end) { /* tier 0: a head's slots of one block are contiguous */
                        uint32_t fp = slot - low, in_block = fp % T, run = T - in_block;
                        if (run > end - slot)
                                run = end - slot;
                        uint8_t *b = L->t[0].ptrs[fp / T];
                        float *kd = ko + (size_t)(slot - first) * D, *vd = vo + (size_t)(slot - first) * D;
                        if (l->dtype == BLOCK_DTYPE_F32) {
                                memcpy(kd, block_key(l, b, h, in_block), (size_t)run * D * sizeof(float));
                                memcpy(vd, block_value(l, b, h, in_block), (size_t)run * D * sizeof(float));
                        } else {
                                block_load_row(l->dtype, block_key(l, b, h, in_block), kd, run * D);
                                block_load_row(l->dtype, block_value(l, b, h, in_block), vd, run * D);
                        }
                        slot += run;
                }
        }
        return 0;
}
