/* matmul.h - matrix times vectors for the engine's weights: y[b][r] = dot(row r of W, x[b]) for B
 * vectors at once, over a range of rows (the caller splits the rows across threads).
 *
 * Owns: the two paths of the product and the 8-bit form of the activations the fast path reads.
 *
 * - The exact path (xq NULL) is qtype.h's dot: dequantized weights times f32 activations, summed in
 *   the order of qtype_dot_lanes. y[b][r] is bit for bit t->dot(row r, x[b], cols). Each block of a
 *   row is dequantized once for up to MATMUL_CHUNK vectors.
 * - The fast path (xq from matmul_quantize) is llama.cpp's: the activations are quantized once per
 *   product to blocks of 32 int8 with an f32 scale (struct matmul_q8), and a q8_0, q4_0 or q4_1
 *   weight block meets an activation block in an integer dot product, exact in int32, as eight
 *   lane sums (lane l: elements 4l .. 4l + 3). The f32 steps: lane l of block k, times
 *   d_w d_x, goes into f32 accumulator lane l; q4_1's m d_x sum(q) of block k goes into lane
 *   k % 8, ahead of its group of eight blocks; a fixed tree adds the lanes at the end of the
 *   row. The f32, f16 and bf16 rows have no integer form and take the exact path either way.
 *   Each weight block is read once for all B vectors, which is what makes a batch pay.
 *
 * Both paths are deterministic and give the same y[b][r] whatever the batch (B, which b) and the
 * row range: a row's result depends on the row and its vector alone. The fast path has three
 * implementations, plain C, AVX2 with F16C, and that with AVX-512 VNNI (the best the CPU has,
 * from kernels/cpu.h's detection made once at start, or the one isa names); they agree bit for
 * bit, because the integer sums are exact and the f32 steps are the same in all.
 *
 * The fast path's error. Activation block k of x has scale d_k = max|x_j| / 127 over its 32
 * elements and codes q_j = round(x_j / d_k), so |x_j - q_j d_k| <= d_k / 2 (plus an f32 rounding of
 * x_j / d_k). The fast result is then the exact dot of W with the rounded activations, hence
 * |fast - exact| <= sum_k (d_k / 2) sum_{j in k} |w_j|, plus f32 rounding of the lane sums, each
 * term rounded at most n / 32 + n / 256 + 10 times (tests/unit/test_qtype.c checks this bound with
 * its rounding terms).
 */
#ifndef KVC_ENGINE_MATMUL_H
#define KVC_ENGINE_MATMUL_H

#include <stddef.h>
#include <stdint.h>

#include "qtype.h"

#define MATMUL_BLOCK 32 /* elements of an activation block */
#define MATMUL_CHUNK 8  /* vectors the exact path takes through a row together */

/* One block of 32 activations: x_j ~ d * q[j]; sum is the sum of q[j], for the weights with a
 * minimum or an offset (q4_1: m * d * sum; q4_0: -8 * sum). */
struct matmul_q8 {
        float d;
        int32_t sum;
        int8_t q[MATMUL_BLOCK];
};

enum matmul_isa {
        MATMUL_ISA_BEST = 0, /* the last of these the CPU has */
        MATMUL_ISA_PLAIN,
        MATMUL_ISA_AVX2,        /* AVX2 and F16C */
        MATMUL_ISA_AVX512_VNNI, /* and AVX-512 VL + VNNI: vpdpbusd on 256-bit registers */
};

/* One product. The caller fills it once and hands it to every thread with a row range. */
struct matmul {
        const struct qtype *t;      /* the weights' type: a row with dequantize and dot */
        const void *w;              /* rows of cols elements of type t, row_bytes apart */
        size_t row_bytes;           /* >= qtype_row_bytes(t, cols) */
        uint32_t cols;              /* a multiple of t->block */
        const float *x;             /* n_x vectors of cols floats, x[b * x_stride + i] */
        size_t x_stride;            /* >= cols */
        const struct matmul_q8 *xq; /* NULL: the exact path; else matmul_quantize(x) */
        uint32_t n_x;               /* B, at least 1 */
        float *y;                   /* y[b * y_stride + r] for r in the row range */
        size_t y_stride;            /* >= the rows the caller writes */
        enum matmul_isa isa;        /* the fast path's implementation; 0 picks the best */
};

/* Blocks matmul_quantize writes for n_x vectors of cols elements (cols a multiple of 32). */
size_t matmul_q8_count(uint32_t cols, uint32_t n_x);
/* Quantizes n_x vectors x[b * x_stride + i], i < cols, into ret: vector b's blocks are
 * ret[b * cols / 32 ...], in order. Non-finite activations quantize to clamped codes (their
 * products are then meaningless, but defined). -EINVAL when cols is not a multiple of 32 or
 * x_stride < cols; ret is untouched then. */
int matmul_quantize(const float *x, size_t x_stride, uint32_t n_x, uint32_t cols, struct matmul_q8 *ret);
/* matmul_quantize with the given implementation (plain C, or AVX2 for any x86 isa): the same bytes
 * from each; -ENOTSUP when this CPU lacks isa. */
int matmul_quantize_isa(enum matmul_isa isa, const float *x, size_t x_stride, uint32_t n_x, uint32_t cols,
                        struct matmul_q8 *ret);

/* Computes y[b][r] for b < n_x, row_begin <= r < row_end. -EINVAL for a product that is not as the
 * fields above say (no dot for t, cols not a multiple of its block, short strides, n_x 0, an
 * xq for cols not a multiple of 32) or a range with row_begin > row_end; -ENOTSUP when isa names
 * an implementation this CPU or build lacks. Nothing is written on failure. */
int matmul_rows(const struct matmul *m, uint32_t row_begin, uint32_t row_end);

/* Whether this CPU and build run the given fast-path implementation. */
int matmul_isa_supported(enum matmul_isa isa);

#endif
