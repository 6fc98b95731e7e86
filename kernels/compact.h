/* compact.h: compaction of one layer's cache into a dense prefix (CPU reference).
 *
 * A plan names, per layer (or per layer and KV head), the slots to keep, sorted ascending.
 * Compaction gathers them to slots 0..k-1 and moves the tokens appended since the plan was built
 * (slots base_tokens..n_tokens-1) right after them, carrying the keys, values and every side
 * array. Slots at and past the new length are garbage afterwards.
 *
 * In place is safe here because it is sequential: with keep strictly ascending, keep[i] >= i, so
 * the slot written at step i is never a source at a later step. A parallel gather (GPU threads)
 * would race on exactly those keep-sets; the GPU kernel gathers out of place instead, and the
 * tests use keep-sets built to expose the race against an out-of-place oracle.
 */
#pragma once

#include <stdint.h>

#include "block.h"

/* 0 when keep[0..n) is strictly ascending and below base_tokens, -EINVAL otherwise. */
int compact_check_keep(const uint32_t *keep, uint32_t n, uint32_t base_tokens);

/* Compacts layer L. keep holds keep_count indices, or n_kv_heads * keep_count (head after head)
 * when per_head. base_tokens <= L->n_tokens. On success *ret_n_tokens is the new length,
 * keep_count + (L->n_tokens - base_tokens); on failure (-EINVAL) nothing was moved. */
int compact_layer(const struct block_layer *L, const uint32_t *keep, uint32_t keep_count, int per_head,
                  uint32_t base_tokens, uint32_t *ret_n_tokens);
