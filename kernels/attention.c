/* attention.c: the plain-loop CPU reference of decode attention over a paged layer. */
#include "attention.h"

#include <errno.h>
#include <math.h>
#include <stdbool.h>
#include <string.h>

/* Two-pass softmax in place, exactly as llama2.c: max, exp(x - max) with a running sum, divide.
 * All -inf (every token masked) gives all zeros rather than NaN. */
static void softmax_inplace(float *x, uint32_t n) {
        float max = x[0];
        for (uint32_t i = 1; i < n; i++)
                if (x[i] > max)
                        max = x[i];
        if (isinf(max) && max < 0) {
                memset(x, 0, (size_t)n * sizeof(float));
                return;
        }
        float sum = 0.0f;
        for (uint32_t i = 0; i < n; i++) {
                x[i] = expf(x[i] - max);
                sum += x[i];
        }
        for (uint32_t i = 0; i < n; i++)
                x[i] /= sum;
}

int attn_decode_ref(const struct block_layer *L, const float *q, float *out, uint32_t n_heads,
                    float ema_gamma, int update_scores, float *scratch) {
        const struct block_layout *l = L->layout;
        uint32_t H = l->n_kv_heads, D = l->head_dim, T = l->block_tokens, n = L->n_tokens;
        float krow[ATTN_MAX_HEAD_DIM], vrow[ATTN_MAX_HEAD_DIM];

        if (n == 0 || n_heads == 0 || n_heads % H || D > ATTN_MAX_HEAD_DIM ||
            (uint64_t)n > (uint64_t)L->n_blocks * T)
                return -EINVAL;
        if (L->n_shared && (!L->shared_mask || (uint64_t)L->mask_stride * 8 < L->n_shared || L->n_shared > n))
                return -EINVAL;

        uint32_t group = n_heads / H;
        float *att = scratch, *acc = scratch + n;
        float scale = sqrtf((float)D);
        bool f32 = l->dtype == BLOCK_DTYPE_F32;

        for (uint32_t g = 0; g < H; g++) {
                if (update_scores)
                        memset(acc, 0, (size_t)n * sizeof(float));
                for (uint32_t r = 0; r < group; r++) {
                        uint32_t h = g * group + r;
                        const float *qh = q + (size_t)h * D;
                        float *oh = out + (size_t)h * D;

                        /* block by block, slot by slot: the same arithmetic, in the same order, as
                         * token by token; f32 rows are read where they lie */
                        for (uint32_t t0 = 0; t0 < n; t0 += T) {
                                uint8_t *b = L->blocks[t0 / T];
                                uint32_t cnt = n - t0 < T ? n - t0 : T;
                                for (uint32_t u = 0; u < cnt; u++) {
                                        const float *k = f32 ? (const float *)block_key(l, b, g, u) : krow;
                                        if (!f32)
                                                block_load_row(l->dtype, block_key(l, b, g, u), krow, D);
                                        float s = 0.0f;
                                        for (uint32_t i = 0; i < D; i++)
                                                s += qh[i] * k[i];
                                        s /= scale;
                                        s += *(const float *)block_side(l, b, l->logw_offset, g, u);
                                        att[t0 + u] = s;
                                }
                        }
                        for (uint32_t t = 0; t < L->n_shared;
                             t++) /* evicted by this session, kept for others */
                                if (L->shared_mask[(size_t)g * L->mask_stride + t / 8] >> (t % 8) & 1)
                                        att[t] = -INFINITY;
                        softmax_inplace(att, n);
                        memset(oh, 0, (size_t)D * sizeof(float));
                        for (uint32_t t0 = 0; t0 < n; t0 += T) {
                                uint8_t *b = L->blocks[t0 / T];
                                uint32_t cnt = n - t0 < T ? n - t0 : T;
                                for (uint32_t u = 0; u < cnt; u++) {
                                        float a = att[t0 + u];
                                        const float *v = f32 ? (const float *)block_value(l, b, g, u) : vrow;
                                        if (!f32)
                                                block_load_row(l->dtype, block_value(l, b, g, u), vrow, D);
                                        for (uint32_t i = 0; i < D; i++)
                                                oh[i] += a * v[i];
                                        if (update_scores)
                                                acc[t0 + u] += a;
                                }
                        }
                }
                if (!update_scores)
                        continue;
                for (uint32_t t = L->n_shared; t < n; t++) { /* shared slots are read-only */
                        uint8_t *b = L->blocks[t / T];
                        float a = acc[t] / (float)group;
                        float *sum = block_side(l, b, l->sum_offset, g, t % T);
                        float *ema = block_side(l, b, l->ema_offset, g, t % T);
                        float *last = block_side(l, b, l->last_offset, g, t % T);
                        *sum += a;
                        *ema = ema_gamma * *ema + (1.0f - ema_gamma) * a;
                        *last = a;
                }
        }
        return 0;
}
