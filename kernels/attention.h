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

/* ---- the fast kernel (attention.c, "The fast kernel") ----
 *
 * attn_decode_fast has attn_decode_ref's semantics (attn_decode_fast_mixed attn_decode_mixed's,
 * for a layer with INT8 tokens: struct mixed_layer, mixed.h), computed for
 * speed: the query heads of one KV head together (each key and value row is read and converted
 * once for all of them), one pass over the keys and values with an online softmax, one block per
 * tile, f16 / bf16 / int8 rows converted in registers (AVX2 with F16C where the CPU has them,
 * otherwise plain loops of the same structure). Results differ from the references by rounding
 * only: tests/unit/test_attn_fast.c bounds the difference. */

struct mixed_layer;

enum attn_isa {
        ATTN_ISA_BEST = 0,  /* AVX2 + F16C when the CPU has both and head_dim % 8 == 0, else plain */
        ATTN_ISA_PLAIN = 1, /* the plain loops */
        ATTN_ISA_AVX2 = 2,  /* -ENOTSUP where the CPU lacks it or head_dim % 8 != 0 */
};

/* Floats of scratch attn_decode_fast and attn_decode_rows need for a layer of up to n_tokens
 * tokens in tiles of up to tile_tokens (a block's tokens). 0 for an invalid geometry. */
size_t attn_fast_scratch_floats(uint32_t n_tokens, uint32_t n_heads, uint32_t n_kv_heads, uint32_t head_dim,
                                uint32_t tile_tokens);

/* Decode attention over a plain layer, semantics as attn_decode_ref, scores included. scratch
 * holds attn_fast_scratch_floats(L->n_tokens, n_heads, kv heads, head_dim, block_tokens) floats.
 * -EINVAL as attn_decode_ref (and for a Q8 layout), -ENOTSUP for ATTN_ISA_AVX2 where it cannot
 * run. */
int attn_decode_fast(const struct block_layer *L, const float *q, float *out, uint32_t n_heads,
                     float ema_gamma, int update_scores, float *scratch, enum attn_isa isa);

/* The same over a layer with INT8 tokens, semantics as attn_decode_mixed (mixed.h); -EINVAL
 * where mixed_layer_check fails. Scratch as above, for M->n_tokens. */
int attn_decode_fast_mixed(const struct mixed_layer *M, const float *q, float *out, uint32_t n_heads,
                           float ema_gamma, int update_scores, float *scratch, enum attn_isa isa);

/* ---- many query rows at once: a prompt chunk ----
 *
 * The last n_rows tokens of a layer (a chunk of a prompt just appended) attend causally: row r
 * (queries q + r * n_heads * head_dim, output likewise) over slots [0, n_tokens - n_rows + r + 1),
 * computed exactly as attn_decode_fast over a layer of that many tokens computes it (the same
 * tiles, the same order: bit for bit), scores updated row after row as n_rows calls would. Up to
 * ATTN_ROWS_GROUP rows share each read of a tile of keys and values, so a chunk reads the cache
 * once per group instead of once per row. The rows' tokens must be full precision (n_q8 <=
 * n_tokens - n_rows + 1); -EINVAL otherwise and as attn_decode_fast. scratch holds
 * attn_rows_scratch_floats(n_tokens, n_rows, ...) floats. n_rows = 1 is attn_decode_fast. */
#define ATTN_ROWS_GROUP 8u
size_t attn_rows_scratch_floats(uint32_t n_tokens, uint32_t n_rows, uint32_t n_heads, uint32_t n_kv_heads,
                                uint32_t head_dim, uint32_t tile_tokens);
int attn_prefill_fast(const struct block_layer *L, uint32_t n_rows, const float *q, float *out,
                      uint32_t n_heads, float ema_gamma, int update_scores, float *scratch,
                      enum attn_isa isa);
int attn_prefill_fast_mixed(const struct mixed_layer *M, uint32_t n_rows, const float *q, float *out,
                            uint32_t n_heads, float ema_gamma, int update_scores, float *scratch,
                            enum attn_isa isa);

/* The same over a layer of several tiers (ladder.h): the rotated tiers' tiles dot their packed
 * codes, read as centroids (a codebook in a register, lanes chosen by the codes), with the
 * rotated query and scale the dot by the row's key scale; their values are summed in the
 * rotated basis and the sum rotated back once, before the first unrotated tile (the rotated tiers
 * come first in a layer). Over tiers {fp, q8} it computes attn_prefill_fast_mixed's bits. The
 * rows must be tier 0's last n_rows; -EINVAL where ladder_check fails. Scratch as above, for the
 * layer's ladder_tokens(). */
struct ladder_layer;
int attn_decode_fast_ladder(const struct ladder_layer *L, const float *q, float *out, uint32_t n_heads,
                            float ema_gamma, int update_scores, float *scratch, enum attn_isa isa);
int attn_prefill_fast_ladder(const struct ladder_layer *L, uint32_t n_rows, const float *q, float *out,
                             uint32_t n_heads, float ema_gamma, int update_scores, float *scratch,
                             enum attn_isa isa);

/* The same kernel over a contiguous f32 cache (kvc-run --local's): token t's KV head g key is
 * keys[t * row_stride + g * head_dim .. + head_dim), its value likewise in values; no
 * log-weights, no scores. Tiles of ATTN_ROWS_TILE tokens, the block size kvc-run gives kvcd, so a
 * full f32 cache through kvcd computes bit for bit what this does. scratch holds
 * attn_fast_scratch_floats(n_tokens, n_heads, n_kv_heads, head_dim, ATTN_ROWS_TILE) floats. */
#define ATTN_ROWS_TILE 16u
int attn_decode_rows(const float *keys, const float *values, size_t row_stride, uint32_t n_tokens,
                     const float *q, float *out, uint32_t n_heads, uint32_t n_kv_heads, uint32_t head_dim,
                     float *scratch, enum attn_isa isa);
/* attn_decode_rows for the last n_rows of n_tokens rows, causally (as attn_prefill_fast); scratch
 * holds attn_rows_scratch_floats(n_tokens, n_rows, n_heads, n_kv_heads, head_dim, ATTN_ROWS_TILE). */
int attn_prefill_rows(const float *keys, const float *values, size_t row_stride, uint32_t n_tokens,
                      uint32_t n_rows, const float *q, float *out, uint32_t n_heads, uint32_t n_kv_heads,
                      uint32_t head_dim, float *scratch, enum attn_isa isa);
