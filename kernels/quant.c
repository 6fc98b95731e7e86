/* quant.c: symmetric absmax INT8 quantization; the contract is in quant.h. */
#include "quant.h"

#include <errno.h>
#include <math.h>

float quant_scale(const float *x, uint32_t n) {
        float m = 0.0f;
        for (uint32_t i = 0; i < n; i++) {
                float a = fabsf(x[i]);
                if (a > m)
                        m = a;
        }
        return m / (float)QUANT_LEVELS;
}

int8_t quant_one(float x, float s) {
        if (!(s > 0.0f))
                return 0;
        float r = rintf(x / s);
        if (r > (float)QUANT_LEVELS)
                return QUANT_LEVELS;
        if (r < -(float)QUANT_LEVELS)
                return -QUANT_LEVELS;
        return r == r ? (int8_t)r : 0; /* NaN: 0, and no out-of-range conversion */
}

void quant_encode_row(const float *x, float scale, int8_t *q, uint32_t n) {
        for (uint32_t i = 0; i < n; i++)
                q[i] = quant_one(x[i], scale);
}

void quant_decode_row(const int8_t *q, float scale, float *x, uint32_t n) {
        for (uint32_t i = 0; i < n; i++)
                x[i] = (float)q[i] * scale;
}

void quant_encode_row_channels(const float *x, const float *scales, int8_t *q, uint32_t n) {
        for (uint32_t i = 0; i < n; i++)
                q[i] = quant_one(x[i], scales[i]);
}

void quant_decode_row_channels(const int8_t *q, const float *scales, float *x, uint32_t n) {
        for (uint32_t i = 0; i < n; i++)
                x[i] = (float)q[i] * scales[i];
}

void quant_channel_scales(const float *rows, uint32_t n_rows, uint32_t d, float *scales) {
        for (uint32_t c = 0; c < d; c++)
                scales[c] = 0.0f;
        for (uint32_t r = 0; r < n_rows; r++)
                for (uint32_t c = 0; c < d; c++) {
                        float a = fabsf(rows[(uint64_t)r * d + c]);
                        if (a > scales[c])
                                scales[c] = a;
                }
        for (uint32_t c = 0; c < d; c++)
                scales[c] /= (float)QUANT_LEVELS;
}

int quant_block_fill_head(const struct block_layout *l, uint8_t *block, uint32_t head, const float *keys,
                          const float *values, uint32_t n) {
        if (l->dtype != BLOCK_DTYPE_Q8 || head >= l->n_kv_heads || n > l->block_tokens)
                return -EINVAL;
        uint32_t D = l->head_dim;
        float *ks = block_kscale(l, block, head);
        quant_channel_scales(keys, n, D, ks);
        for (uint32_t t = 0; t < n; t++) {
                const float *v = values + (uint64_t)t * D;
                float vs = quant_scale(v, D);
                quant_encode_row_channels(keys + (uint64_t)t * D, ks, (int8_t *)block_key(l, block, head, t),
                                          D);
                quant_encode_row(v, vs, (int8_t *)block_value(l, block, head, t), D);
                *block_vscale(l, block, head, t) = vs;
        }
        return 0;
}

void quant_block_load_key(const struct block_layout *l, uint8_t *block, uint32_t head, uint32_t slot,
                          float *dst) {
        quant_decode_row_channels((const int8_t *)block_key(l, block, head, slot),
                                  block_kscale(l, block, head), dst, l->head_dim);
}

void quant_block_load_value(const struct block_layout *l, uint8_t *block, uint32_t head, uint32_t slot,
                            float *dst) {
        quant_decode_row((const int8_t *)block_value(l, block, head, slot),
                         *block_vscale(l, block, head, slot), dst, l->head_dim);
}
