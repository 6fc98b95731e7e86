/* qtype.c - the table of tensor types (qtype.h): sizes for every type ggml defines, and the
 * dequantize and dot functions of the ones the engine computes with: f32, f16, bf16, q8_0, q4_0,
 * q4_1, q4_K and q6_K.
 *
 * Sizes are ggml's (ggml-common.h's block structs): a block's bytes include its scales. Blocks are
 * read byte by byte (memcpy for the f16 scales): tensor data in a mapped file has no alignment
 * that a row of 18 or 20-byte blocks could keep.
 *
 * dequantize is ggml's dequantize_row_* (ggml-quants.c) element for element, and dot is
 * dequantize-then-multiply through qtype_dot_lanes: one generic loop over 32-element spans (a
 * K-quant's span is its block of 256, whose sub-block scales are packed across the block), so a
 * new row needs only its dequantize function.
 */
#include "qtype.h"

#include <stddef.h>
#include <string.h>

#define SPAN 32 /* elements per dot step: a multiple of every block size below 256 */

static uint16_t load_u16(const uint8_t *p) {
        uint16_t v;

        memcpy(&v, p, sizeof(v));
        return v;
}

void qtype_dot_lanes(float lanes[QTYPE_LANES], const float *w, const float *x, size_t n) {
        size_t i = 0;

        for (; i + QTYPE_LANES <= n; i += QTYPE_LANES)
                for (size_t l = 0; l < QTYPE_LANES; l++)
                        lanes[l] += w[i + l] * x[i + l];
        for (size_t l = 0; i < n; i++, l++)
                lanes[l] += w[i] * x[i];
}

float qtype_lanes_sum(const float lanes[QTYPE_LANES]) {
        return ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) +
               ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
}

static void dequantize_f32(const void *src, float *dst, size_t n) {
        memcpy(dst, src, n * sizeof(float));
}

static void dequantize_f16(const void *src, float *dst, size_t n) {
        const uint8_t *p = src;

        for (size_t i = 0; i < n; i++)
                dst[i] = qtype_f16_to_f32(load_u16(p + 2 * i));
}

static void dequantize_bf16(const void *src, float *dst, size_t n) {
        const uint8_t *p = src;

        for (size_t i = 0; i < n; i++)
                dst[i] = qtype_bf16_to_f32(load_u16(p + 2 * i));
}

/* q8_0: f16 d, 32 int8 q; x = q * d */
static void dequantize_q8_0(const void *src, float *dst, size_t n) {
        const uint8_t *b = src;

        for (size_t i = 0; i < n / 32; i++, b += 34) {
                float d = qtype_f16_to_f32(load_u16(b));
                for (int j = 0; j < 32; j++)
                        dst[i * 32 + j] = (float)(int8_t)b[2 + j] * d;
        }
}

/* q4_0: f16 d, 16 bytes of nibbles; element j < 16 is the low nibble of byte j, element j + 16 its
 * high nibble; x = (q - 8) * d */
static void dequantize_q4_0(const void *src, float *dst, size_t n) {
        const uint8_t *b = src;

        for (size_t i = 0; i < n / 32; i++, b += 18) {
                float d = qtype_f16_to_f32(load_u16(b));
                for (int j = 0; j < 16; j++) {
                        dst[i * 32 + j] = (float)((b[2 + j] & 0x0f) - 8) * d;
                        dst[i * 32 + j + 16] = (float)((b[2 + j] >> 4) - 8) * d;
                }
        }
}

/* q4_1: f16 d, f16 m, 16 bytes of nibbles as q4_0; x = q * d + m */
static void dequantize_q4_1(const void *src, float *dst, size_t n) {
        const uint8_t *b = src;

        for (size_t i = 0; i < n / 32; i++, b += 20) {
                float d = qtype_f16_to_f32(load_u16(b)), m = qtype_f16_to_f32(load_u16(b + 2));
                for (int j = 0; j < 16; j++) {
                        dst[i * 32 + j] = (float)(b[4 + j] & 0x0f) * d + m;
                        dst[i * 32 + j + 16] = (float)(b[4 + j] >> 4) * d + m;
                }
        }
}

/* q4_K: 8 sub-blocks of 32 with 6-bit scales and minimums (ggml's get_scale_min_k4) */
static void scale_min_k4(int j, const uint8_t *q, uint8_t *d, uint8_t *m) {
        if (j < 4) {
                *d = q[j] & 63;
                *m = q[j + 4] & 63;
        } else {
                *d = (uint8_t)((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4));
                *m = (uint8_t)((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
        }
}

/* q4_K (144 bytes a block of 256): f16 d, f16 dmin, 12 bytes of packed 6-bit scales and minimums,
 * 128 bytes of nibbles; sub-block pair p (64 elements) takes the low nibbles of bytes [32p, 32p+32)
 * for its first 32 and the high nibbles for the next; x = d sc q - dmin m */
static void dequantize_q4_K(const void *src, float *dst, size_t n) {
        const uint8_t *b = src;

        for (size_t i = 0; i < n / 256; i++, b += 144) {
                float d = qtype_f16_to_f32(load_u16(b)), min = qtype_f16_to_f32(load_u16(b + 2));
                const uint8_t *scales = b + 4, *q = b + 16;
                float *y = dst + i * 256;
                for (int j = 0, is = 0; j < 256; j += 64, is += 2, q += 32, y += 64) {
                        uint8_t sc, m;
                        scale_min_k4(is, scales, &sc, &m);
                        float d1 = d * sc, m1 = min * m;
                        scale_min_k4(is + 1, scales, &sc, &m);
                        float d2 = d * sc, m2 = min * m;
                        for (int l = 0; l < 32; l++)
                                y[l] = d1 * (q[l] & 0xF) - m1;
                        for (int l = 0; l < 32; l++)
                                y[l + 32] = d2 * (q[l] >> 4) - m2;
                }
        }
}

/* q6_K (210 bytes a block of 256): 128 bytes of low nibbles, 64 bytes of high 2-bit pairs, 16 int8
 * scales (one a 16 elements), f16 d; x = d sc (q - 32), q 6 bits */
static void dequantize_q6_K(const void *src, float *dst, size_t n) {
        const uint8_t *b = src;

        for (size_t i = 0; i < n / 256; i++, b += 210) {
                float d = qtype_f16_to_f32(load_u16(b + 208));
                const uint8_t *ql = b, *qh = b + 128;
                const int8_t *sc = (const int8_t *)(b + 192);
                float *y = dst + i * 256;
                for (int k = 0; k < 256; k += 128, y += 128, ql += 64, qh += 32, sc += 8)
                        for (int l = 0; l < 32; l++) {
                                int is = l / 16;
                                int q1 = (int8_t)((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
                                int q2 = (int8_t)((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
                                int q3 = (int8_t)((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
                                int q4 = (int8_t)((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
                                y[l] = d * sc[is + 0] * q1;
                                y[l + 32] = d * sc[is + 2] * q2;
                                y[l + 64] = d * sc[is + 4] * q3;
                                y[l + 96] = d * sc[is + 6] * q4;
                        }
        }
}

/* The exact dot of every row: dequantize a span of SPAN elements (span_bytes bytes), multiply. */
static float dot_spans(void (*dequantize)(const void *, float *, size_t), size_t span, size_t span_bytes,
                       const void *w, const float *x, size_t n) {
        float lanes[QTYPE_LANES] = { 0 }, tmp[QTYPE_MAX_BLOCK];
        const uint8_t *p = w;

        for (size_t i = 0; i < n; i += span, p += span_bytes) {
                size_t len = n - i < span ? n - i : span;
                dequantize(p, tmp, len);
                qtype_dot_lanes(lanes, tmp, x + i, len);
        }
        return qtype_lanes_sum(lanes);
}

#define DOT(name, span_bytes)                                                                                \
        static float dot_##name(const void *w, const float *x, size_t n) {                                   \
                return dot_spans(dequantize_##name, SPAN, span_bytes, w, x, n);                              \
        }
/* K-quants: a span is one block of 256 */
#define DOT_K(name, block_bytes)                                                                             \
        static float dot_##name(const void *w, const float *x, size_t n) {                                   \
                return dot_spans(dequantize_##name, 256, block_bytes, w, x, n);                              \
        }
DOT(f32, SPAN * 4)
DOT(f16, SPAN * 2)
DOT(bf16, SPAN * 2)
DOT(q8_0, 34)
DOT(q4_0, 18)
DOT(q4_1, 20)
DOT_K(q4_K, 144)
DOT_K(q6_K, 210)

static const struct qtype qtypes[] = {
        { QTYPE_F32, "f32", 1, 4, dequantize_f32, dot_f32 },
        { QTYPE_F16, "f16", 1, 2, dequantize_f16, dot_f16 },
        { QTYPE_Q4_0, "q4_0", 32, 18, dequantize_q4_0, dot_q4_0 },
        { QTYPE_Q4_1, "q4_1", 32, 20, dequantize_q4_1, dot_q4_1 },
        { QTYPE_Q5_0, "q5_0", 32, 22, NULL, NULL },
        { QTYPE_Q5_1, "q5_1", 32, 24, NULL, NULL },
        { QTYPE_Q8_0, "q8_0", 32, 34, dequantize_q8_0, dot_q8_0 },
        { QTYPE_Q8_1, "q8_1", 32, 36, NULL, NULL },
        { QTYPE_Q2_K, "q2_K", 256, 84, NULL, NULL },
        { QTYPE_Q3_K, "q3_K", 256, 110, NULL, NULL },
        { QTYPE_Q4_K, "q4_K", 256, 144, dequantize_q4_K, dot_q4_K },
        { QTYPE_Q5_K, "q5_K", 256, 176, NULL, NULL },
        { QTYPE_Q6_K, "q6_K", 256, 210, dequantize_q6_K, dot_q6_K },
        { QTYPE_Q8_K, "q8_K", 256, 292, NULL, NULL },
        { 16, "iq2_xxs", 256, 66, NULL, NULL },
        { 17, "iq2_xs", 256, 74, NULL, NULL },
        { 18, "iq3_xxs", 256, 98, NULL, NULL },
        { 19, "iq1_s", 256, 50, NULL, NULL },
        { 20, "iq4_nl", 32, 18, NULL, NULL },
        { 21, "iq3_s", 256, 110, NULL, NULL },
        { 22, "iq2_s", 256, 82, NULL, NULL },
        { 23, "iq4_xs", 256, 136, NULL, NULL },
        { 24, "i8", 1, 1, NULL, NULL },
        { 25, "i16", 1, 2, NULL, NULL },
        { 26, "i32", 1, 4, NULL, NULL },
        { 27, "i64", 1, 8, NULL, NULL },
        { 28, "f64", 1, 8, NULL, NULL },
        { 29, "iq1_m", 256, 56, NULL, NULL },
        { QTYPE_BF16, "bf16", 1, 2, dequantize_bf16, dot_bf16 },
        { 34, "tq1_0", 256, 54, NULL, NULL },
        { 35, "tq2_0", 256, 66, NULL, NULL },
        { 39, "mxfp4", 32, 17, NULL, NULL },
};

const struct qtype *qtype_of(uint32_t id) {
        for (size_t i = 0; i < sizeof(qtypes) / sizeof(qtypes[0]); i++)
                if (qtypes[i].id == id)
                        return &qtypes[i];
        return NULL;
}

uint64_t qtype_row_bytes(const struct qtype *t, uint64_t n) {
        return n % t->block ? 0 : n / t->block * t->bytes;
}
