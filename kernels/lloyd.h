/* lloyd.h: the quantizer of the precision ladder's low tiers (Q4, Q3, Q2; CPU reference).
 *
 * A row x of head_dim d (a key or a value of one KV head) is stored as
 *   y = R x,  R = H_d diag(signs) / sqrt(d)        (a randomized Hadamard rotation)
 *   code_i = the nearest centroid of y_i / s,  s = sigma = sqrt(sum y_i^2 / d) at first
 *   s      = <y, c> / <c, c>                    (c_i = centroid[code_i]: least squares)
 * the codes and the scale refitted three times (LLOYD_FIT_ROUNDS), each round never worse than the
 * one before.
 * and read back as y'_i = scale * centroid[code_i] (in the rotated basis; R^T y' is the row).
 *
 * Why this quantizer (bench/quant-study.md has the measurements): keys have outlier channels, so
 * any per-token grid wastes its levels on them; the rotation spreads every channel over all
 * coordinates, which then look Gaussian with variance |x|^2 / d, and the Lloyd-Max codebook is
 * the mean-square-optimal scalar quantizer for a Gaussian. The scale is fitted by least squares
 * to the codes actually chosen (not set to the norm): never worse, and it absorbs the codebook's
 * shrinkage; refitting the codes to it and the scale to them three times lowered the mean-square
 * error by 9%, 8% and 3% at 4, 3 and 2 bits on SmolLM2's keys and values (bench/quant-study.md,
 * which measured 19 candidates on them). The attention never unrotates a key: R is orthogonal, so q.k = (R
 * q).(R k), and values are summed in the rotated basis and the sum is rotated back once per head.
 *
 * The rotation is fixed per (layer, KV head): its signs come from a 64-bit seed recorded with the
 * session (lloyd_signs), the same on every machine. The transform is the in-place fast
 * Walsh-Hadamard butterfly in a fixed order, so a row rotates to the same floats everywhere.
 *
 * Error (expected, for Gaussian coordinates; the codebooks' distortion, computed to 9 digits by
 * the Lloyd iteration on a fine grid): relative mean-square error 0.0095 at 4 bits, 0.0345 at 3,
 * 0.1175 at 2 (relative RMS error 9.7%, 18.6%, 34.3%). Worst case: |y - y'| <= |y| for every row
 * (scale 0 is a candidate of the least-squares fit), so nothing is ever amplified.
 *
 * Codes are packed little-endian, code i in bits [i b, i b + b) of the row, so a row of d codes
 * is d b / 8 bytes (d a power of two >= 8). Non-finite input is refused: the row is stored as
 * zero (scale 0) and the encoder returns -EINVAL.
 */
#pragma once

#include <stdint.h>

#include "block.h"

#define LLOYD_MAX_DIM    1024u
#define LLOYD_FIT_ROUNDS 3u

/* The 2^bits centroids of the Lloyd-Max quantizer for N(0, 1), ascending; NULL unless bits is
 * 2, 3 or 4. Lloyd iterations on grids of 1.2M and 2.4M points, extrapolated, then refined with
 * the closed-form cell means (bench/quant-study.md), 9 significant digits. Each table is padded to a multiple
 * of 8 floats and 32-byte aligned, so a fast kernel loads it into a register as it is. Inline, so a kernel
 * that knows bits gets a constant. */
static inline const float *lloyd_codebook(uint32_t bits) {
        static const float c2[8]
                __attribute__((aligned(32))) = { -1.51041761f, -0.452780035f, 0.452780035f, 1.51041761f };
        static const float c3[8]
                __attribute__((aligned(32))) = { -2.1519457f,  -1.34390928f, -0.756005281f, -0.245094179f,
                                                 0.245094179f, 0.756005281f, 1.34390928f,   2.1519457f };
        static const float c4[16]
                __attribute__((aligned(32))) = { -2.73258957f,  -2.06901723f,  -1.61804639f,  -1.2562312f,
                                                 -0.942340456f, -0.656759119f, -0.388048299f, -0.12839503f,
                                                 0.12839503f,   0.388048299f,  0.656759119f,  0.942340456f,
                                                 1.2562312f,    1.61804639f,   2.06901723f,   2.73258957f };
        switch (bits) {
        case 2: return c2;
        case 3: return c3;
        case 4: return c4;
        }
        return (const float *)0;
}

/* The signs (+1.0f or -1.0f) of the rotation of KV head `head` of layer `layer`, d of them. */
void lloyd_signs(uint64_t seed, uint32_t layer, uint32_t head, uint32_t d, float *signs);

/* In place: x <- R x, and x <- R^T x. d a power of two <= LLOYD_MAX_DIM. */
void lloyd_rotate(const float *signs, float *x, uint32_t d);
void lloyd_unrotate(const float *signs, float *x, uint32_t d);

/* Codes a rotated row y of d values into d * bits / 8 bytes at codes and its scale at *ret_scale.
 * -EINVAL (and the row coded as zero) when y holds a NaN or an infinity. */
int lloyd_encode_row(const float *y, uint32_t d, uint32_t bits, uint8_t *codes, float *ret_scale);

/* y'_i = scale * centroid[code_i], d values. */
void lloyd_decode_row(const uint8_t *codes, float scale, uint32_t d, uint32_t bits, float *y);

/* The code of element i of a packed row. */
static inline uint32_t lloyd_code(const uint8_t *codes, uint32_t i, uint32_t bits) {
        uint32_t bit = i * bits, byte = bit / 8, shift = bit % 8;
        uint32_t w = codes[byte] | (shift + bits > 8 ? (uint32_t)codes[byte + 1] << 8 : 0u);
        return (w >> shift) & ((1u << bits) - 1u);
}
