/* mixed.h: a layer whose older tokens are INT8 and whose recent tokens are full precision, with
 * its compaction, quantization and decode attention (CPU references; kernels/cuda.h has the GPU
 * versions behind the same model).
 *
 * The layer is one logical sequence of slots [0, n_tokens) in position order:
 *   slots [0, n_q8)         live in Q8 blocks:   slot s in q8_blocks[s / T] at slot s % T
 *   slots [n_q8, n_tokens)  live in fp blocks:   slot s in fp_blocks[(s - n_q8) / T] at (s - n_q8) % T
 * (T = block_tokens). The fp blocks have the session's dtype (F32, F16 or BF16); both layouts have
 * the same T, n_kv_heads and head_dim. INT8 tokens never become full precision again.
 *
 * Invariants kept by every function here: a Q8 block's key scales (per head and channel) are
 * computed over exactly the live tokens it holds; a token moved into another Q8 block has its key
 * requantized with that block's fresh scales (never copied with its bytes: the old block's
 * scales would be wrong for it, too small for an outlier or too coarse for a small value). Value
 * codes and their per-token scale move exactly, byte for byte, between Q8 blocks. Side arrays
 * (pos, sum, ema, last, logw) move with their token, exactly.
 *
 * No function allocates; the caller passes scratch of the size the *_scratch_floats functions
 * give. Failures return -EINVAL and change nothing.
 */
#pragma once

#include <stddef.h>
#include <stdint.h>

#include "block.h"

struct mixed_layer {
        const struct block_layout *fp; /* the session's dtype */
        const struct block_layout *q8; /* BLOCK_DTYPE_Q8, same T, heads, head_dim */
        uint8_t *const *fp_blocks;
        uint32_t n_fp_blocks;
        uint8_t *const *q8_blocks;
        uint32_t n_q8_blocks;
        uint32_t n_q8;     /* slots [0, n_q8) are INT8 */
        uint32_t n_tokens; /* slots [n_q8, n_tokens) are full precision */
        /* a shared prefix (blocks other sessions read too): slots [0, n_shared) are never written
         * (attention leaves their scores alone) and a set bit of shared_mask masks one of them for
         * this session alone: bit j of byte shared_mask[h * mask_stride + j / 8], per KV head h.
         * n_shared 0: no shared prefix (the mask is not read). */
        uint32_t n_shared;
        const uint8_t *shared_mask;
        uint32_t mask_stride;
};

/* 0 when the layouts match (Q8 and a full-precision dtype, same geometry), n_q8 <= n_tokens and
 * both block tables hold their part; -EINVAL otherwise. Reads no block. */
int mixed_layer_check(const struct mixed_layer *M);

/* ---- compaction and quantization ---- */

/* Floats of scratch compact_mixed and mixed_advance_q8 need: one destination block of one head
 * (keys as floats, value codes and scales, side arrays) and one row. */
size_t compact_mixed_scratch_floats(const struct mixed_layer *M);

/* Compacts M like compact_layer (compact.h): keep holds keep_count slot indices (per_head: one set
 * per KV head, head after head), strictly ascending and below base_tokens <= n_tokens; new slot i
 * takes old slot keep[i] for i < keep_count, and old slot base_tokens + (i - keep_count) after
 * that (the tokens appended since the plan was built). New length: keep_count + n_tokens -
 * base_tokens. Afterwards slots [0, new_q8) are INT8 and the rest full precision: a kept INT8 token
 * stays INT8, a full-precision token that lands below new_q8 is quantized.
 *
 * -EINVAL (and nothing moved) unless: M passes mixed_layer_check; keep is valid; new_q8 <= new
 * length; new_q8 >= the number of kept INT8 tokens (of every head); the q8 table holds
 * ceil(new_q8 / T) blocks and the fp table ceil((new length - new_q8) / T) (the caller grants
 * them before). On success *ret_n_tokens is the new length; the caller sets M's n_q8 = new_q8 and
 * n_tokens. Slots past the new length, and slots past new_q8 in its last Q8 block, are garbage.
 *
 * A destination Q8 block whose tokens are exactly those it already held (same slots, same live
 * count) is left untouched, so repeated calls do not requantize what did not move. */
int compact_mixed(const struct mixed_layer *M, const uint32_t *keep, uint32_t keep_count, int per_head,
                  uint32_t base_tokens, uint32_t new_q8, float *scratch, uint32_t *ret_n_tokens);

/* Quantization of the tokens that leave the full-precision window: slots [n_q8, new_q8) become
 * INT8, nothing is dropped (compact_mixed with an identity keep-set). n_q8 <= new_q8 <= n_tokens. */
int mixed_advance_q8(const struct mixed_layer *M, uint32_t new_q8, float *scratch);

/* ---- decode attention ---- */

/* Floats of scratch attn_decode_mixed needs: per KV head, the logits of its query heads over all
 * tokens (for the score pass) and per-query-head vectors. */
size_t attn_mixed_scratch_floats(const struct mixed_layer *M, uint32_t n_heads);

/* Decode attention of one query token over M, with the semantics of attn_decode_ref
 * (attention.h): per query head s_j = q . k_j / sqrt(head_dim) + logw_j, softmax, out = sum a_j v_j;
 * the score arrays get the attention averaged over the query heads of each KV head; a -inf
 * log-weight masks a token, and so does a set bit of shared_mask; every token masked gives zeros,
 * never NaN. The scores of shared slots are not updated. q and out are
 * [n_heads][head_dim]. -EINVAL for an empty or inconsistent layer, n_heads not a multiple of
 * n_kv_heads, or head_dim > ATTN_MAX_HEAD_DIM.
 *
 * Computed as a chunked online softmax, one block per chunk, with the INT8 dequantization fused:
 * for an INT8 block q is pre-scaled by the block's key scales per channel and the integer codes
 * are dotted with it; each value's per-token scale multiplies its weight. */
int attn_decode_mixed(const struct mixed_layer *M, const float *q, float *out, uint32_t n_heads,
                      float ema_gamma, int update_scores, float *scratch);
