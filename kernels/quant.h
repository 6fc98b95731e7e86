/* quant.h: symmetric INT8 quantization of rows and of Q8 blocks (CPU reference).
 *
 * One rule everywhere (block.h has the Q8 block layout):
 *   s = max |x| / 127 over the values that share the scale (0 when they are all zero),
 *   q = round-to-nearest-even(x / s) clamped to [-127, 127] (0 when s is 0),   x' = q * s.
 * The largest |x| maps to +-127, so nothing clips, and |x - x'| <= s / 2 up to one rounding of the
 * quotient and one of the product. Keys share a scale per (block, head, channel), over the
 * block's live tokens (keys have outlier channels); values one per (head, slot).
 *
 * The arithmetic is one float division for the scale, one per element for the quotient (not a
 * multiplication by 1/s), rintf and one float product to dequantize. The CUDA kernels do exactly
 * these IEEE operations (nvcc without --use_fast_math), so they produce the same bytes and a GPU
 * compaction can be compared with this one bit for bit.
 *
 * Inputs are meant to be finite. A non-finite input gives codes and scales that are unspecified
 * but never undefined behaviour: a NaN quotient becomes code 0, an infinite one +-127.
 */
#pragma once

#include <stdint.h>

#include "block.h"

#define QUANT_LEVELS 127

/* max |x[i]| / 127 over n values; 0 for n == 0 or all zeros. NaNs are ignored. */
float quant_scale(const float *x, uint32_t n);

/* One code: round(x / s) clamped, 0 when s is 0. */
int8_t quant_one(float x, float s);

/* A row with one scale (values), and a row with a scale per element (keys: per channel). */
void quant_encode_row(const float *x, float scale, int8_t *q, uint32_t n);
void quant_decode_row(const int8_t *q, float scale, float *x, uint32_t n);
void quant_encode_row_channels(const float *x, const float *scales, int8_t *q, uint32_t n);
void quant_decode_row_channels(const int8_t *q, const float *scales, float *x, uint32_t n);

/* Per-channel scales of n_rows rows of width d (row-major): scales[c] = max_r |rows[r][c]| / 127. */
void quant_channel_scales(const float *rows, uint32_t n_rows, uint32_t d, float *scales);

/* Fills slots [0, n) of head `head` of a Q8 block from n float rows of keys and of values
 * ([n][head_dim] each): the head's key scales over exactly those n rows, one value scale per row.
 * Slots [n, block_tokens) and the side arrays are left alone. -EINVAL when l is not a Q8 layout,
 * head is out of range or n > block_tokens. */
int quant_block_fill_head(const struct block_layout *l, uint8_t *block, uint32_t head, const float *keys,
                          const float *values, uint32_t n);

/* Dequantizes the key or the value of (head, slot) of a Q8 block into head_dim floats. */
void quant_block_load_key(const struct block_layout *l, uint8_t *block, uint32_t head, uint32_t slot,
                          float *dst);
void quant_block_load_value(const struct block_layout *l, uint8_t *block, uint32_t head, uint32_t slot,
                            float *dst);
