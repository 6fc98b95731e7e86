/* qtype.c - the table of tensor types (qtype.h): sizes for every type ggml defines, and the
 * dequantize and dot functions of the ones the engine computes with.
 *
 * Sizes are ggml's (ggml-common.h's block structs): a block's bytes include its scales.
 */
#include "qtype.h"

#include <stddef.h>

static const struct qtype qtypes[] = {
        { QTYPE_F32, "f32", 1, 4, NULL, NULL },
        { QTYPE_F16, "f16", 1, 2, NULL, NULL },
        { QTYPE_Q4_0, "q4_0", 32, 18, NULL, NULL },
        { QTYPE_Q4_1, "q4_1", 32, 20, NULL, NULL },
        { QTYPE_Q5_0, "q5_0", 32, 22, NULL, NULL },
        { QTYPE_Q5_1, "q5_1", 32, 24, NULL, NULL },
        { QTYPE_Q8_0, "q8_0", 32, 34, NULL, NULL },
        { QTYPE_Q8_1, "q8_1", 32, 36, NULL, NULL },
        { QTYPE_Q2_K, "q2_K", 256, 84, NULL, NULL },
        { QTYPE_Q3_K, "q3_K", 256, 110, NULL, NULL },
        { QTYPE_Q4_K, "q4_K", 256, 144, NULL, NULL },
        { QTYPE_Q5_K, "q5_K", 256, 176, NULL, NULL },
        { QTYPE_Q6_K, "q6_K", 256, 210, NULL, NULL },
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
        { QTYPE_BF16, "bf16", 1, 2, NULL, NULL },
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
