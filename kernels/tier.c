/* tier.c: the table of tiers (tier.h): one row per block class, each with its store, load and
 * fused attention loops. The full-precision rows and the INT8 row compute exactly what the mixed
 * layer's reference (mixed.c) computes, operation for operation, so a ladder of f16 and q8 gives
 * the same bits as the two-tier code it generalizes. */
#include "tier.h"

#include <errno.h>
#include <math.h>
#include <string.h>

#include "lloyd.h"
#include "quant.h"

/* ---- full precision: f32, f16, bf16 ---- */

static int fp_fill_head(const struct block_layout *l, uint8_t *block, uint32_t head, const float *keys,
                        const float *values, uint32_t n) {
        uint32_t D = l->head_dim;
        for (uint32_t t = 0; t < n; t++) {
                block_store_row(l->dtype, keys + (uint64_t)t * D, block_key(l, block, head, t), D);
                block_store_row(l->dtype, values + (uint64_t)t * D, block_value(l, block, head, t), D);
        }
        return 0;
}

static void fp_load_key(const struct block_layout *l, uint8_t *block, uint32_t head, uint32_t slot,
                        float *dst) {
        block_load_row(l->dtype, block_key(l, block, head, slot), dst, l->head_dim);
}

static void fp_load_value(const struct block_layout *l, uint8_t *block, uint32_t head, uint32_t slot,
                          float *dst) {
        block_load_row(l->dtype, block_value(l, block, head, slot), dst, l->head_dim);
}

/* dots[r * cnt + t] = scale * q_r . row for the group's query rows (double accumulation). */
static void row_dots(const float *q, const float *row, uint32_t group, uint32_t D, double scale, uint32_t t,
                     uint32_t cnt, double *dots) {
        for (uint32_t r = 0; r < group; r++) {
                const float *qh = q + (uint64_t)r * D;
                double dot = 0.0;
                for (uint32_t c = 0; c < D; c++)
                        dot += (double)qh[c] * row[c];
                dots[(uint64_t)r * cnt + t] = dot * scale;
        }
}

static void fp_dots(const struct block_layout *l, uint8_t *block, uint32_t head, uint32_t cnt, const float *q,
                    uint32_t group, float *scratch, double *dots) {
        for (uint32_t t = 0; t < cnt; t++) {
                block_load_row(l->dtype, block_key(l, block, head, t), scratch, l->head_dim);
                row_dots(q, scratch, group, l->head_dim, 1.0, t, cnt, dots);
        }
}

/* The accumulation shared by every row: the value row as floats times w (times its scale). */
static void accumulate_row(const float *row, const float *w, uint32_t w_stride, uint32_t t, uint32_t group,
                           float vscale, int scaled, uint32_t D, float *acc) {
        for (uint32_t r = 0; r < group; r++) {
                float wt = w[(uint64_t)r * w_stride + t], *a = acc + (uint64_t)r * D;
                if (wt == 0.0f)
                        continue; /* masked or underflowed: adds exact zeros */
                if (scaled)
                        wt *= vscale;
                for (uint32_t c = 0; c < D; c++)
                        a[c] += wt * row[c];
        }
}

static void fp_accumulate(const struct block_layout *l, uint8_t *block, uint32_t head, uint32_t cnt,
                          const float *w, uint32_t w_stride, uint32_t group, float *row, float *acc) {
        for (uint32_t t = 0; t < cnt; t++) {
                block_load_row(l->dtype, block_value(l, block, head, t), row, l->head_dim);
                accumulate_row(row, w, w_stride, t, group, 1.0f, 0, l->head_dim, acc);
        }
}

/* ---- INT8 (quant.h): keys per channel over the block, values per token ---- */

static int q8_fill_head(const struct block_layout *l, uint8_t *block, uint32_t head, const float *keys,
                        const float *values, uint32_t n) {
        return quant_block_fill_head(l, block, head, keys, values, n);
}

static void q8_dots(const struct block_layout *l, uint8_t *block, uint32_t head, uint32_t cnt, const float *q,
                    uint32_t group, float *scratch, double *dots) {
        uint32_t D = l->head_dim;
        const float *ks = block_kscale(l, block, head);
        float *qk = scratch; /* the key scales folded into the query, as mixed.c does */
        for (uint32_t r = 0; r < group; r++)
                for (uint32_t c = 0; c < D; c++)
                        qk[(uint64_t)r * D + c] = q[(uint64_t)r * D + c] * ks[c];
        for (uint32_t t = 0; t < cnt; t++) {
                const int8_t *kq = (const int8_t *)block_key(l, block, head, t);
                for (uint32_t r = 0; r < group; r++) {
                        const float *qr = qk + (uint64_t)r * D;
                        double dot = 0.0;
                        for (uint32_t c = 0; c < D; c++)
                                dot += (double)qr[c] * kq[c];
                        dots[(uint64_t)r * cnt + t] = dot;
                }
        }
}

static void q8_accumulate(const struct block_layout *l, uint8_t *block, uint32_t head, uint32_t cnt,
                          const float *w, uint32_t w_stride, uint32_t group, float *row, float *acc) {
        uint32_t D = l->head_dim;
        for (uint32_t t = 0; t < cnt; t++) {
                const int8_t *vq = (const int8_t *)block_value(l, block, head, t);
                for (uint32_t c = 0; c < D; c++)
                        row[c] = (float)vq[c];
                accumulate_row(row, w, w_stride, t, group, *block_vscale(l, block, head, t), 1, D, acc);
        }
}

/* ---- the rotated Lloyd-Max tiers (lloyd.h): a scale per row ---- */

static int lm_fill_head(const struct block_layout *l, uint8_t *block, uint32_t head, const float *keys,
                        const float *values, uint32_t n) {
        uint32_t D = l->head_dim, bits = block_dtype_bits(l->dtype);
        int e = 0;
        if (head >= l->n_kv_heads || n > l->block_tokens)
                return -EINVAL;
        for (uint32_t t = 0; t < n; t++) {
                if (lloyd_encode_row(keys + (uint64_t)t * D, D, bits, block_key(l, block, head, t),
                                     block_kscale_row(l, block, head, t)) < 0)
                        e = -EINVAL;
                if (lloyd_encode_row(values + (uint64_t)t * D, D, bits, block_value(l, block, head, t),
                                     block_vscale(l, block, head, t)) < 0)
                        e = -EINVAL;
        }
        return e;
}

static void lm_load_key(const struct block_layout *l, uint8_t *block, uint32_t head, uint32_t slot,
                        float *dst) {
        lloyd_decode_row(block_key(l, block, head, slot), *block_kscale_row(l, block, head, slot),
                         l->head_dim, block_dtype_bits(l->dtype), dst);
}

static void lm_load_value(const struct block_layout *l, uint8_t *block, uint32_t head, uint32_t slot,
                          float *dst) {
        lloyd_decode_row(block_value(l, block, head, slot), *block_vscale(l, block, head, slot), l->head_dim,
                         block_dtype_bits(l->dtype), dst);
}

/* q . k = scale * sum_c q_c centroid[code_c]: the codes are read as centroids, the scale once. */
static void lm_dots(const struct block_layout *l, uint8_t *block, uint32_t head, uint32_t cnt, const float *q,
                    uint32_t group, float *scratch, double *dots) {
        uint32_t D = l->head_dim, bits = block_dtype_bits(l->dtype);
        for (uint32_t t = 0; t < cnt; t++) {
                lloyd_decode_row(block_key(l, block, head, t), 1.0f, D, bits, scratch);
                row_dots(q, scratch, group, D, *block_kscale_row(l, block, head, t), t, cnt, dots);
        }
}

static void lm_accumulate(const struct block_layout *l, uint8_t *block, uint32_t head, uint32_t cnt,
                          const float *w, uint32_t w_stride, uint32_t group, float *row, float *acc) {
        uint32_t D = l->head_dim, bits = block_dtype_bits(l->dtype);
        for (uint32_t t = 0; t < cnt; t++) {
                lloyd_decode_row(block_value(l, block, head, t), 1.0f, D, bits, row);
                accumulate_row(row, w, w_stride, t, group, *block_vscale(l, block, head, t), 1, D, acc);
        }
}

/* ---- the table ---- */

#define FP_ROW(dt, nm)                                                                                       \
        {                                                                                                    \
                .dtype = dt, .name = nm, .fill_head = fp_fill_head, .load_key = fp_load_key,                 \
                .load_value = fp_load_value, .dots = fp_dots, .accumulate = fp_accumulate                    \
        }
#define LM_ROW(dt, nm)                                                                                       \
        {                                                                                                    \
                .dtype = dt, .name = nm, .rotated = 1, .quantized = 1, .fill_head = lm_fill_head,            \
                .load_key = lm_load_key, .load_value = lm_load_value, .dots = lm_dots,                       \
                .accumulate = lm_accumulate                                                                  \
        }

static const struct tier_row tiers[] = {
        FP_ROW(BLOCK_DTYPE_F32, "f32"),
        FP_ROW(BLOCK_DTYPE_F16, "f16"),
        FP_ROW(BLOCK_DTYPE_BF16, "bf16"),
        { .dtype = BLOCK_DTYPE_Q8,
          .name = "q8",
          .key_block_scales = 1,
          .quantized = 1,
          .fill_head = q8_fill_head,
          .load_key = quant_block_load_key,
          .load_value = quant_block_load_value,
          .dots = q8_dots,
          .accumulate = q8_accumulate },
        LM_ROW(BLOCK_DTYPE_Q4, "q4"),
        LM_ROW(BLOCK_DTYPE_Q3, "q3"),
        LM_ROW(BLOCK_DTYPE_Q2, "q2"),
};

const struct tier_row *tier_row(enum block_dtype dtype) {
        for (size_t i = 0; i < sizeof(tiers) / sizeof(tiers[0]); i++)
                if (tiers[i].dtype == dtype)
                        return &tiers[i];
        return NULL;
}

const struct tier_row *tier_by_name(const char *name) {
        for (size_t i = 0; name && i < sizeof(tiers) / sizeof(tiers[0]); i++)
                if (strcmp(tiers[i].name, name) == 0)
                        return &tiers[i];
        return NULL;
}

double tier_bits_per_value(const struct block_layout *l) {
        return (double)l->block_bytes * 8.0 / (2.0 * l->block_tokens * l->n_kv_heads * l->head_dim);
}
