/* qtype.h - tensor types of GGUF files (ggml's type numbers) as one table of rows: block size,
 * bytes per block and, for the types the engine computes with, dequantize and dot-product
 * functions. A new quantization type is one row with its functions and a test against a
 * reference (house style); nothing else changes.
 *
 * Every type ggml defines has a row with its sizes, so gguf.c can bound any tensor of any type;
 * rows without functions are types the engine refuses by name when a model uses them.
 *
 * Rows are plain loops (the reference) unless a row says otherwise; the fast paths live beside
 * them and are tested against them.
 */
#ifndef KVC_ENGINE_QTYPE_H
#define KVC_ENGINE_QTYPE_H

#include <stddef.h>
#include <stdint.h>

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
        /* sum over i < n of w[i] * x[i], w of this type, accumulated in f32 in a fixed order */
        float (*dot)(const void *w, const float *x, size_t n);
};

/* The row of ggml type id, or NULL for a number ggml does not define. */
const struct qtype *qtype_of(uint32_t id);
/* Bytes of a row of n elements; 0 when n is not a multiple of the block size. */
uint64_t qtype_row_bytes(const struct qtype *t, uint64_t n);

#endif
