/* qtype.h - tensor types of GGUF files (ggml's type numbers) as one table of rows: block size,
 * bytes per block and, for the types the engine computes with, dequantize and dot-product
 * functions. A new quantization type is one row with its functions and a test against a
 * reference (house style); nothing else changes.
 *
 * Every type ggml defines has a row with its sizes, so gguf.c can bound any tensor of any type;
 * rows without functions are types the engine refuses by name when a model uses them.
 *
 * Rows are plain loops (the reference): dequantize is ggml's dequantize_row_* element for element
 * (the same float operations in the same order, so the values are bit for bit those of ggml and of
 * the gguf Python package), and dot is the exact path: sum of dequantized w[i] times x[i] in f32,
 * in the order qtype_dot_lanes defines. The fast paths (matmul.h) live beside them and are tested
 * against them.
 */
#ifndef KVC_ENGINE_QTYPE_H
#define KVC_ENGINE_QTYPE_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

enum qtype_id {
        QTYPE_F32 = 0,
        QTYPE_F16 = 1,
        QTYPE_Q4_0 = 2,
        QTYPE_Q4_1 = 3,
        QTYPE_Q5_0 = 6,
        QTYPE_Q5_1 = 7,
        QTYPE_Q8_0 = 8,
        QTYPE_Q8_1 = 9,
        QTYPE_Q2_K = 10,
        QTYPE_Q3_K = 11,
        QTYPE_Q4_K = 12,
        QTYPE_Q5_K = 13,
        QTYPE_Q6_K = 14,
        QTYPE_Q8_K = 15,
        QTYPE_BF16 = 30,
};

struct qtype {
        uint32_t id;
        const char *name; /* ggml's name: "q4_1" */
        uint32_t block;   /* elements per block */
        uint32_t bytes;   /* bytes per block */
        /* n elements (a multiple of block) of src into dst; NULL: the engine cannot use the type */
        void (*dequantize)(const void *src, float *dst, size_t n);
        /* sum over i < n (a multiple of block) of w[i] * x[i], w of this type: the f32 products of
         * the dequantized w[i] and x[i], summed in the order of qtype_dot_lanes */
        float (*dot)(const void *w, const float *x, size_t n);
};

/* The row of ggml type id, or NULL for a number ggml does not define. */
const struct qtype *qtype_of(uint32_t id);
/* Bytes of a row of n elements; 0 when n is not a multiple of the block size. */
uint64_t qtype_row_bytes(const struct qtype *t, uint64_t n);

/* The exact dot's order of summation, shared by every row's dot and by the exact matrix product
 * (matmul.c), so that the two agree bit for bit. A dot of n elements keeps QTYPE_LANES f32
 * partial sums: element i's product w[i] * x[i] (rounded to f32) is added to lane i % QTYPE_LANES,
 * in increasing i, and the lanes are summed at the end as a balanced tree, ((l0 + l1) + (l2 + l3)) +
 * ((l4 + l5) + (l6 + l7)). Independent lanes let the compiler vectorize the loop without changing
 * a single rounding (the build has no -ffast-math and -ffp-contract=off). The error of the sum is
 * at most (n / QTYPE_LANES + 3) * 2^-24 * sum |w[i] x[i]| (to first order), plus the products' own
 * roundings, 2^-24 each.
 *
 * qtype_dot_lanes adds elements [0, n) of a span that starts at an element index that is a
 * multiple of QTYPE_LANES (every call but the last of a dot passes n a multiple of QTYPE_LANES). */
#define QTYPE_LANES 8
/* The largest block of a type with functions (the K-quants' 256): dequantize buffers hold one. */
#define QTYPE_MAX_BLOCK 256
void qtype_dot_lanes(float lanes[QTYPE_LANES], const float *w, const float *x, size_t n);
float qtype_lanes_sum(const float lanes[QTYPE_LANES]);

/* IEEE half and bfloat16 to f32, exact (every half and bfloat16 value is an f32 value; NaN keeps
 * its payload). Inline: the fast kernels convert two scales per block. */
static inline float qtype_f16_to_f32(uint16_t h) {
        uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, bits;
        float f;

        if (exp == 0x1f)
                bits = sign | 0x7f800000u | man << 13;
        else if (exp)
                bits = sign | (exp + 112) << 23 | man << 13;
        else {
                f = (float)man * 0x1p-24f; /* subnormal or zero: exact, man < 2^10 */
                memcpy(&bits, &f, sizeof(bits));
                bits |= sign;
        }
        memcpy(&f, &bits, sizeof(f));
        return f;
}

static inline float qtype_bf16_to_f32(uint16_t h) {
        uint32_t bits = (uint32_t)h << 16;
        float f;

        memcpy(&f, &bits, sizeof(f));
        return f;
}

#endif
