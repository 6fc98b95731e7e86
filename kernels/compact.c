/* compact.c: sequential in-place gather of kept slots into a dense prefix, moving runs of
 * consecutive slots with one memmove per array, so that a window shift costs about a memcpy. */
#include "compact.h"

#include <errno.h>
#include <string.h>

int compact_check_keep(const uint32_t *keep, uint32_t n, uint32_t base_tokens) {
        for (uint32_t i = 0; i < n; i++) {
                if (keep[i] >= base_tokens)
                        return -EINVAL;
                if (i > 0 && keep[i] <= keep[i - 1])
                        return -EINVAL;
        }
        return 0;
}

/* Moves `len` consecutive slots of one head from src to dst (dst < src), all inside one block
 * each. memmove, because a run may overlap itself within a block. */
static void move_run(const struct block_layer *L, uint32_t head, uint32_t src, uint32_t dst, uint32_t len) {
        const struct block_layout *l = L->layout;
        uint32_t T = l->block_tokens;
        uint8_t *sb = L->blocks[src / T], *db = L->blocks[dst / T];
        uint32_t ss = src % T, ds = dst % T;
        static const size_t side_offsets[] = {
                offsetof(struct block_layout, pos_offset),  offsetof(struct block_layout, sum_offset),
                offsetof(struct block_layout, ema_offset),  offsetof(struct block_layout, last_offset),
                offsetof(struct block_layout, logw_offset),
        };

        memmove(block_key(l, db, head, ds), block_key(l, sb, head, ss), len * l->row_bytes);
        memmove(block_value(l, db, head, ds), block_value(l, sb, head, ss), len * l->row_bytes);
        for (size_t i = 0; i < sizeof(side_offsets) / sizeof(side_offsets[0]); i++) {
                uint64_t off = *(const uint64_t *)((const uint8_t *)l + side_offsets[i]);
                memmove(block_side(l, db, off, head, ds), block_side(l, sb, off, head, ss), (size_t)len * 4u);
        }
}

static uint32_t source_of(const uint32_t *keep, uint32_t kc, uint32_t base, uint32_t i) {
        return i < kc ? keep[i] : base + (i - kc);
}

static void compact_head(const struct block_layer *L, uint32_t head, const uint32_t *keep, uint32_t kc,
                         uint32_t base, uint32_t new_len) {
        uint32_t T = L->layout->block_tokens;
        uint32_t i = 0;
        while (i < new_len) {
                uint32_t src = source_of(keep, kc, base, i);
                /* the run ends where the sources stop being consecutive or a block ends */
                uint32_t room = T - (src % T) < T - (i % T) ? T - (src % T) : T - (i % T);
                uint32_t len = 1;
                while (len < room && i + len < new_len && source_of(keep, kc, base, i + len) == src + len)
                        len++;
                if (src != i)
                        move_run(L, head, src, i, len);
                i += len;
        }
}

int compact_layer(const struct block_layer *L, const uint32_t *keep, uint32_t keep_count, int per_head,
                  uint32_t base_tokens, uint32_t *ret_n_tokens) {
        const struct block_layout *l = L->layout;
        uint32_t H = l->n_kv_heads;

        if (base_tokens > L->n_tokens || (uint64_t)L->n_tokens > (uint64_t)L->n_blocks * l->block_tokens)
                return -EINVAL;
        for (uint32_t h = 0; h < (per_head ? H : 1u); h++)
                if (compact_check_keep(keep + (uint64_t)h * keep_count, keep_count, base_tokens) < 0)
                        return -EINVAL;

        uint32_t new_len = keep_count + (L->n_tokens - base_tokens);
        for (uint32_t h = 0; h < H; h++)
                compact_head(L, h, per_head ? keep + (uint64_t)h * keep_count : keep, keep_count, base_tokens,
                             new_len);
        *ret_n_tokens = new_len;
        return 0;
}
