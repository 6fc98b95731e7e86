/* ladder.h: a layer whose tokens live in several tiers of the precision ladder (tier.h), with
 * its compaction and demotion, its decode and prompt-row attention and its readers (CPU
 * references; the fast kernels are in ladder_fast.c).
 *
 * Tier 0 has the session's dtype (f32, f16 or bf16); tiers 1 .. n_tiers - 1 have strictly fewer
 * bits each (q8, q4, q3, q2, or any subset in that order), the same block_tokens (T), n_kv_heads
 * and head_dim, and each has its own block table. A token lives in exactly one tier, and a
 * token's tier only goes up the index (down in precision): nothing is ever made more precise.
 *
 * The layer is one logical sequence of slots, the lowest tier first:
 *   [ tier n_tiers-1 : n[n_tiers-1] slots ] ... [ tier 1 : n[1] ] [ tier 0 : n[0] ]
 * logical slot s of tier t is slot (s - first(t)) of that tier's table, in block (s - first(t)) / T,
 * where first(t) is the sum of n[u] over u > t. New tokens are appended to tier 0 (the end). With
 * tiers {f16, q8} this is exactly the mixed layer of mixed.h (INT8 prefix, full-precision rest).
 *
 * Rotated tiers (q4, q3, q2) store R_h k and R_h v for the layer's rotation of KV head h (lloyd.h);
 * the attention rotates the query to match and rotates their share of the output back.
 *
 * A shared prefix (slots [0, n_shared), other sessions' blocks) is full precision: it requires
 * every tier but tier 0 to be empty. As in mixed.h, a set bit j of shared_mask[h * mask_stride + j / 8]
 * masks slot j for KV head h, and the scores of shared slots are never written.
 *
 * No function allocates; the caller passes scratch of the size the *_scratch_floats functions
 * give. Failures return -EINVAL and change nothing.
 */
#pragma once

#include <stddef.h>
#include <stdint.h>

#include "block.h"

#define LADDER_TIERS 5u /* the session's dtype, q8, q4, q3, q2 */

struct ladder_layer {
        uint32_t n_tiers;
        const struct block_layout *layout[LADDER_TIERS];
        uint8_t *const *blocks[LADDER_TIERS];
        uint32_t n_blocks[LADDER_TIERS];
        uint32_t n[LADDER_TIERS]; /* live tokens per tier */
        const float *signs;       /* [n_kv_heads][head_dim] +-1: the rotation, needed by rotated tiers */
        uint32_t n_shared;
        const uint8_t *shared_mask;
        uint32_t mask_stride;
};

/* 0 when the tiers are as above (layouts consistent, bits strictly decreasing, rotated tiers
 * after the others, every table holding its tokens, signs where needed, a shared prefix only in
 * a layer of tier 0 alone); -EINVAL otherwise. Reads no block. */
int ladder_check(const struct ladder_layer *M);

uint32_t ladder_tokens(const struct ladder_layer *M);

/* The tier of logical slot s and its index in that tier's table. s < ladder_tokens(M). */
void ladder_locate(const struct ladder_layer *M, uint32_t s, uint32_t *ret_tier, uint32_t *ret_index);

/* ---- compaction and demotion ---- */

size_t ladder_compact_scratch_floats(const struct ladder_layer *M);

/* Keeps keep_count tokens, each at a tier, and the tail. keep holds slot indices (per_head: one
 * set per KV head, head after head), strictly ascending and below base_tokens <= ladder_tokens(M);
 * tier (NULL: every kept token stays in its tier) gives each kept token its new tier, laid out like
 * keep. The tokens appended since the plan was built (slots [base_tokens, n)) stay in tier 0.
 * Afterwards tier t holds its kept tokens in ascending order of their old slots (tier 0: then the
 * tail), so the new logical sequence is tier by tier as the layer's invariant says.
 *
 * -EINVAL (and nothing moved) unless: M passes ladder_check; keep is valid; every new tier is the
 * token's tier or a lower one (a higher index) below n_tiers; every head gives each tier the same
 * number of tokens; each table holds ceil(new count / T) blocks (the caller grants them before).
 * On success ret_n[t] is tier t's new count (ret_n has LADDER_TIERS entries; the caller sets M->n).
 *
 * Quantized destination blocks are written whole: every source of a block is gathered (keys and
 * values as floats in the destination's basis, a source of the same tier also as its bytes)
 * before the block is written, so a block may be its own source; keys of q8 blocks are
 * requantized to the block's new scales, and a row whose tier keeps per-row scales moves byte for
 * byte when it stays in its tier. A destination block holding exactly the tokens it held is left
 * untouched. Side arrays move with their token, exactly. */
int ladder_compact(const struct ladder_layer *M, const uint32_t *keep, const uint8_t *tier,
                   uint32_t keep_count, int per_head, uint32_t base_tokens, float *scratch, uint32_t *ret_n);

/* ---- attention ---- */

/* Floats of scratch ladder_attend needs for n_heads query heads; 0 for an invalid geometry. */
size_t ladder_attn_scratch_floats(const struct ladder_layer *M, uint32_t n_heads);

/* Decode attention of one query token, with the semantics of attn_decode_mixed (mixed.h) over
 * every tier: per query head s_j = q . k_j / sqrt(head_dim) + logw_j, softmax, out = sum a_j v_j,
 * the score arrays updated with the attention averaged over the query heads of each KV head, a
 * -inf log-weight or a set shared_mask bit masking a token, every token masked giving zeros.
 * A chunked online softmax, one block per chunk, the dequantization fused (tier.h's rows). Over
 * tiers {f32|f16|bf16, q8} it computes attn_decode_mixed's bits exactly. */
int ladder_attend(const struct ladder_layer *M, const float *q, float *out, uint32_t n_heads, float ema_gamma,
                  int update_scores, float *scratch);

/* The last n_rows tokens (tier 0's last n_rows: a prompt chunk just appended) attend causally:
 * row r over slots [0, n - n_rows + r + 1), as n_rows calls of ladder_attend would, scores
 * included. -EINVAL when tier 0 holds fewer than n_rows tokens. Scratch as ladder_attend's. */
int ladder_attend_rows(const struct ladder_layer *M, uint32_t n_rows, const float *q, float *out,
                       uint32_t n_heads, float ema_gamma, int update_scores, float *scratch);

/* ---- readers ---- */

/* The key and the value of logical slot s of KV head h as the model wrote them, up to the tier's
 * rounding: dequantized and rotated back. Either output may be NULL. */
void ladder_load(const struct ladder_layer *M, uint32_t h, uint32_t s, float *key, float *value);
