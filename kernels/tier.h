/* tier.h: the precision ladder's table of tiers. A tier is a block class (block.h) and one row
 * here: its cost, how a head of a block is quantized, how a row is read back, and the two inner
 * loops of the attention (logits of a tile of keys, weighted sum of a tile of values) with the
 * dequantization fused into them. kernels/ladder.h builds layers of several tiers on it.
 *
 *   tier  class   keys                               values               bits/value (d = 64, T = 16)
 *   f32   F32     as is                              as is                32    (33.25 with sides)
 *   f16   F16     as is (round to nearest even)      as is                16    (17.25)
 *   bf16  BF16    as is                              as is                16    (17.25)
 *   q8    Q8      int8, absmax scale per channel     int8, absmax scale   9.25  (10.50)
 *                 over the block's tokens            per token
 *   q4    Q4      rotated, 4-bit Lloyd-Max codes,    the same             4.50  (5.75)
 *                 a least-squares scale per token
 *   q3    Q3      the same, 3-bit                    the same             3.50  (4.75)
 *   q2    Q2      the same, 2-bit                    the same             2.50  (3.75)
 *
 * "bits/value" counts codes and scales; "with sides" adds the 20 bytes of side arrays per token
 * and KV head (pos, sum, ema, last, logw), which every tier keeps so that a token's scores move
 * with it: tier_bits_per_value() computes it from a layout, block padding included, and that is
 * what kvcd charges. Error bounds: quant.h (Q8: |x - x'| <= scale / 2 per element) and lloyd.h
 * (Q4-Q2: |y - y'| <= |y| per row always, relative mean-square error 0.0095 / 0.0345 / 0.1175
 * for Gaussian-like rotated coordinates). Why these quantizers: docs/kernels.md.
 *
 * Adding a tier: its class and layout in block.h, its quantizer in one file, one row below.
 */
#pragma once

#include <stdint.h>

#include "block.h"

struct tier_row {
        enum block_dtype dtype;
        const char *name;
        int rotated;          /* rows are stored in the layer's rotated basis (lloyd.h) */
        int key_block_scales; /* key scales are shared by the block's tokens (written as a whole) */
        int quantized;        /* rows need their scales to be read */

        /* Quantizes (or stores) n rows of keys and of values ([n][head_dim] floats, in the tier's
         * basis) into slots [0, n) of KV head `head`; side arrays untouched. -EINVAL when an input
         * is not finite (the row is stored as zeros; the rest are stored). */
        int (*fill_head)(const struct block_layout *l, uint8_t *block, uint32_t head, const float *keys,
                         const float *values, uint32_t n);
        /* Reads row (head, slot) back as head_dim floats, in the tier's basis. */
        void (*load_key)(const struct block_layout *l, uint8_t *block, uint32_t head, uint32_t slot,
                         float *dst);
        void (*load_value)(const struct block_layout *l, uint8_t *block, uint32_t head, uint32_t slot,
                           float *dst);
        /* dots[r * cnt + t] = q_r . k_t (double accumulation, no 1 / sqrt(d)) for the group query
         * rows q ([group][head_dim], in the tier's basis) and slots [0, cnt) of KV head head.
         * scratch holds group * head_dim + head_dim floats. */
        void (*dots)(const struct block_layout *l, uint8_t *block, uint32_t head, uint32_t cnt,
                     const float *q, uint32_t group, float *scratch, double *dots);
        /* acc[r][c] += sum_t w[r * w_stride + t] v_t[c] over slots [0, cnt) of head, in the tier's
         * basis; a zero weight adds nothing. row holds head_dim floats. */
        void (*accumulate)(const struct block_layout *l, uint8_t *block, uint32_t head, uint32_t cnt,
                           const float *w, uint32_t w_stride, uint32_t group, float *row, float *acc);
};

/* The row of a block class; NULL for an unknown one. */
const struct tier_row *tier_row(enum block_dtype dtype);

/* The row named name ("f16", "q4", ...); NULL when there is none. */
const struct tier_row *tier_by_name(const char *name);

/* What a block of layout l costs per stored value (keys and values): block_bytes * 8 /
 * (2 * block_tokens * n_kv_heads * head_dim), scales, side arrays and padding included. */
double tier_bits_per_value(const struct block_layout *l);
