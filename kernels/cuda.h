/* cuda.h: the C interface of the CUDA kernels (the .cu files in kernels/cuda/), built wherever nvcc is found
 * (`make cuda`) into libkvc_cuda.a. Each function is the GPU twin of a CPU reference that is
 * always built and is its test oracle: kvc_cuda_summary of summary_logits_ref,
 * kvc_cuda_attn_decode_mixed of attn_decode_mixed, kvc_cuda_compact_mixed of compact_mixed,
 * kvc_cuda_mixed_advance_q8 of mixed_advance_q8 (mixed.h), kvc_cuda_attn_decode_ladder of
 * ladder_attend, kvc_cuda_attn_rows_ladder of ladder_attend_rows and kvc_cuda_ladder_compact of
 * ladder_compact (ladder.h). tests/gpu/run.sh
 * compares them.
 *
 * Plain C: every pointer argument documented as device memory is a device pointer, and a stream
 * is a cudaStream_t passed as void * (NULL: the default stream), so a C caller needs no CUDA
 * header. A struct mixed_layer passed here is read on the host (layouts, counts) and its
 * fp_blocks / q8_blocks point to device arrays of device block pointers: the same layout as the
 * CPU side, one level of indirection on the device. A struct ladder_layer likewise: its layouts
 * and counts are read on the host, blocks[t] are device arrays of device block pointers, signs
 * (the rotation, [n_kv_heads][head_dim]) and shared_mask are device memory. The functions only enqueue work:
 * they return once it is launched, and results are there when the stream has reached them. Nothing is
 * allocated; the caller passes device workspace of the size the *_workspace_bytes functions give.
 *
 * The CUDA runtime is linked statically (libcudart_static); it reaches the driver with dlopen,
 * so a binary that links this library runs, and reports no device, on a machine without one.
 *
 * Errors: -EINVAL for arguments refused on the host (the CPU reference's checks that need no
 * device memory, and geometries the kernels do not handle: head_dim 64, 128 or 256;
 * block_tokens a multiple of 16 for attention, block_tokens * head_dim <= 4096 for compaction);
 * -EIO when CUDA refuses a launch. Checks that need the keep-set's contents run on the device
 * (see kvc_cuda_compact_mixed).
 */
#pragma once

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#include "ladder.h"
#include "mixed.h"
#include "summary.h"

/* The number of CUDA devices; 0 when there is none, or no driver to ask. */
int kvc_cuda_device_count(void);

/* The logits summary of n_rows rows (device, [n_rows][vocab] floats): ret[n_rows] and, when
 * k > 0, topk[n_rows][k] (device). status[n_rows] (device) gets 0, or -EINVAL for a row with a
 * non-finite logit, whose outputs are then unspecified. -EINVAL for vocab < 2, k > vocab or
 * n_rows == 0. Same values as summary_logits_ref up to the order of double-precision sums. */
int kvc_cuda_summary(const float *logits, uint32_t n_rows, uint32_t vocab, struct summary *ret, float *topk,
                     uint32_t k, int32_t *status, void *stream);

/* Device workspace for kvc_cuda_attn_decode_mixed: split-K partial results and the logits of
 * every query head (for the score pass). */
size_t kvc_cuda_attn_workspace_bytes(const struct mixed_layer *M, uint32_t n_heads);

/* attn_decode_mixed on the GPU: q and out are device [n_heads][head_dim] floats; the score
 * arrays in the blocks are updated when update_scores. The fp part may be F32, F16 or BF16. */
int kvc_cuda_attn_decode_mixed(const struct mixed_layer *M, const float *q, float *out, uint32_t n_heads,
                               float ema_gamma, int update_scores, void *workspace, size_t workspace_bytes,
                               void *stream);

/* Device workspace for kvc_cuda_compact_mixed and kvc_cuda_mixed_advance_q8 on layers with M's
 * block tables. It starts with the int32 status of the last call on it. */
size_t kvc_cuda_compact_workspace_bytes(const struct mixed_layer *M);

/* compact_mixed on the GPU, in place, in one pass: keep is device memory (keep_count indices, or
 * n_kv_heads * keep_count when per_head). The host checks what it can and returns -EINVAL with
 * nothing launched, or sets *ret_n_tokens and launches. The keep-set's contents (strictly
 * ascending, below base_tokens, new_q8 at least the kept INT8 count) are checked on the device
 * before anything moves: the int32 at the start of the workspace is then 0, or -EINVAL with
 * nothing moved. Same bytes as compact_mixed. */
int kvc_cuda_compact_mixed(const struct mixed_layer *M, const uint32_t *keep, uint32_t keep_count,
                           int per_head, uint32_t base_tokens, uint32_t new_q8, void *workspace,
                           size_t workspace_bytes, void *stream, uint32_t *ret_n_tokens);

/* mixed_advance_q8 on the GPU: slots [n_q8, new_q8) become INT8. */
int kvc_cuda_mixed_advance_q8(const struct mixed_layer *M, uint32_t new_q8, void *workspace,
                              size_t workspace_bytes, void *stream);

/* Device workspace for kvc_cuda_attn_decode_ladder and kvc_cuda_attn_rows_ladder: split-K
 * partial results and the logits of every query head. */
size_t kvc_cuda_ladder_attn_workspace_bytes(const struct ladder_layer *M, uint32_t n_heads);

/* ladder_attend on the GPU, over every tier (the dtype, q8, q4, q3, q2): q and out are device
 * [n_heads][head_dim] floats; the score arrays of the non-shared slots are updated when
 * update_scores; a -inf log-weight or a set shared_mask bit masks a token. -EINVAL where
 * ladder_attend refuses (ladder_check, no token, n_heads not a multiple of n_kv_heads) and for
 * the geometries above. The reference's values up to float rounding (the dots in float, not
 * double; docs/kernels.md). */
int kvc_cuda_attn_decode_ladder(const struct ladder_layer *M, const float *q, float *out, uint32_t n_heads,
                                float ema_gamma, int update_scores, void *workspace, size_t workspace_bytes,
                                void *stream);

/* ladder_attend_rows on the GPU: the last n_rows tokens of tier 0 attend causally, row r as a
 * decode over slots [0, n - n_rows + r + 1) (one decode launch pair per row, in order). q and out
 * are device [n_rows][n_heads][head_dim]; the workspace is kvc_cuda_ladder_attn_workspace_bytes(M). */
int kvc_cuda_attn_rows_ladder(const struct ladder_layer *M, uint32_t n_rows, const float *q, float *out,
                              uint32_t n_heads, float ema_gamma, int update_scores, void *workspace,
                              size_t workspace_bytes, void *stream);

/* Device workspace for kvc_cuda_ladder_compact on layers with M's geometry: the int32 status of
 * the last call at its start, then a destination block's gather per KV head. */
size_t kvc_cuda_ladder_compact_workspace_bytes(const struct ladder_layer *M);

/* ladder_compact on the GPU, in place: keep and tier (NULL: every kept token stays in its tier)
 * are device memory laid out as ladder_compact's; new_n (host, LADDER_TIERS entries) is what the
 * caller expects each tier to hold afterwards. The host checks what it can (ladder_check, no
 * shared prefix, base_tokens, the tail from tier 0, head_dim <= 256, new_n against the tables and
 * against keep_count + the tail) and returns -EINVAL with nothing launched. The device checks the
 * keep-set (strictly ascending, below base_tokens), the tiers (never up, below n_tiers) and that
 * every head's counts per tier equal new_n before anything moves: the int32 at the start of the
 * workspace is then 0, or -EINVAL with nothing moved. On success the bytes are ladder_compact's
 * and the caller sets M->n to new_n. Not tuned: one block per KV head walks the destination
 * blocks in the reference's order. */
int kvc_cuda_ladder_compact(const struct ladder_layer *M, const uint32_t *keep, const uint8_t *tier,
                            uint32_t keep_count, int per_head, uint32_t base_tokens, const uint32_t *new_n,
                            void *workspace, size_t workspace_bytes, void *stream);

#ifdef __cplusplus
}
#endif
