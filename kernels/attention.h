/* attention.h: decode attention of one query token over one layer's cache (CPU reference).
 *
 * For every query head h (KV head g = h / (n_heads / n_kv_heads), grouped-query attention):
 *   s_j = q_h . k_j / sqrt(head_dim) + logw_j      over the live slots j
 *   a_j = softmax(s)_j,  out_h = sum_j a_j v_j
 * computed in the order llama2.c's run.c uses (two passes, max-subtracted), so that a model run
 * through kvcd reproduces the reference model's greedy text exactly. As a side output it updates
 * the block's score arrays with the attention each token received, averaged over the query heads
 * of its KV head: sum += a, ema = gamma * ema + (1 - gamma) * a, last = a. The policies read them.
 *
 * A log-weight of -inf masks a token (it receives zero attention). Inside a shared prefix
 * (L->n_shared) a session masks with its own bitmap instead, since the blocks, log-weights
 * included, are other sessions' too; their scores are left alone.
 */
#pragma once

#include <stdint.h>

#include "block.h"

/* The largest head dimension the reference handles (the protocol allows up to 1024). */
#define ATTN_MAX_HEAD_DIM 1024u

/* q and out are [n_heads][head_dim] floats. scratch holds at least 2 * L->n_tokens floats.
 * update_scores = 0 leaves the side arrays untouched (a read-only shared cache).
 * -EINVAL for an empty layer or n_heads not a multiple of n_kv_heads. */
int attn_decode_ref(const struct block_layer *L, const float *q, float *out, uint32_t n_heads,
                    float ema_gamma, int update_scores, float *scratch);
