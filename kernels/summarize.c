/* summarize.c: merging evicted tokens into the summary slot (see summarize.h). */
#include "summarize.h"

#include <errno.h>
#include <math.h>
#include <stdbool.h>
#include <string.h>

#include "attention.h"

#define ATTN_ROW_MAX ATTN_MAX_HEAD_DIM

int summarize_evicted(const struct block_layer *L, const uint32_t *keep, uint32_t keep_count,
                      uint32_t base_tokens, uint32_t summary, float *scratch) {
        const struct block_layout *l = L->layout;
        uint32_t T = l->block_tokens, D = l->head_dim;
        if (l->dtype == BLOCK_DTYPE_Q8 || base_tokens > L->n_tokens || summary >= base_tokens ||
            (uint64_t)L->n_tokens > (uint64_t)L->n_blocks * T)
                return -EINVAL;
        bool found = false;
        for (uint32_t i = 0; i < keep_count && !found; i++)
                found = keep[i] == summary;
        if (!found)
                return -EINVAL;

        float *ksum = scratch, *vsum = scratch + D, row[ATTN_ROW_MAX];
        if (D > ATTN_ROW_MAX)
                return -EINVAL;
        uint8_t *sb = L->blocks[summary / T];
        uint32_t ss = summary % T;
        for (uint32_t h = 0; h < l->n_kv_heads; h++) {
                int32_t *spos = block_side(l, sb, l->pos_offset, h, ss);
                float *slogw = block_side(l, sb, l->logw_offset, h, ss);
                /* the summary so far (count = exp(logw)), or the fresh carrier as one evicted token */
                double count = *spos == SUMMARY_POS && isfinite(*slogw) ? exp((double)*slogw) : 1.0;
                block_load_row(l->dtype, block_key(l, sb, h, ss), row, D);
                for (uint32_t i = 0; i < D; i++)
                        ksum[i] = (float)(row[i] * count);
                block_load_row(l->dtype, block_value(l, sb, h, ss), row, D);
                for (uint32_t i = 0; i < D; i++)
                        vsum[i] = (float)(row[i] * count);
                uint32_t k = 0;
                for (uint32_t j = 0; j < base_tokens; j++) {
                        while (k < keep_count && keep[k] < j)
                                k++;
                        if (k < keep_count && keep[k] == j)
                                continue; /* kept */
                        uint8_t *b = L->blocks[j / T];
                        block_load_row(l->dtype, block_key(l, b, h, j % T), row, D);
                        for (uint32_t i = 0; i < D; i++)
                                ksum[i] += row[i];
                        block_load_row(l->dtype, block_value(l, b, h, j % T), row, D);
                        for (uint32_t i = 0; i < D; i++)
                                vsum[i] += row[i];
                        count += 1.0;
                }
                for (uint32_t i = 0; i < D; i++) {
                        ksum[i] = (float)(ksum[i] / count);
                        vsum[i] = (float)(vsum[i] / count);
                }
                block_store_row(l->dtype, ksum, block_key(l, sb, h, ss), D);
                block_store_row(l->dtype, vsum, block_value(l, sb, h, ss), D);
                *spos = SUMMARY_POS;
                *slogw = (float)log(count);
                *(float *)block_side(l, sb, l->sum_offset, h, ss) = 0.0f;
                *(float *)block_side(l, sb, l->ema_offset, h, ss) = 0.0f;
                *(float *)block_side(l, sb, l->last_offset, h, ss) = 0.0f;
        }
        return 0;
}
