/* compact.c: sequential in-place gather of kept slots into a dense prefix, moving runs of
 * consecutive slots with one move per array, so that a window shift costs about a memcpy.
 *
 * A run is often one token (h2o, sparse keep-sets) and then each of its seven pieces per head
 * (key row, value row, five side words) is a few bytes: a call to memmove per piece cost more
 * than the bytes (bench/RESULTS.md, item 3). So pieces of 4 to 64 bytes are moved inline, by
 * loading all of a piece before storing any (an overlapping run is still moved right), and the
 * longer ones go to memmove. When the heads share a keep-set (per-layer plans) the runs are
 * found once and each is moved for every head, rather than found again head by head.
 */
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

/* memmove of n bytes. From 4 to 64 bytes: two possibly overlapping fixed-size copies from each
 * end, every load before any store, which the compiler turns into a few register moves. Shorter
 * (2-byte rows) and longer: memmove. */
static inline void move_bytes(uint8_t *d, const uint8_t *s, size_t n) {
        if (n > 64) {
                memmove(d, s, n);
        } else if (n >= 32) {
                uint8_t a[32], b[32];
                memcpy(a, s, 32);
                memcpy(b, s + n - 32, 32);
                memcpy(d, a, 32);
                memcpy(d + n - 32, b, 32);
        } else if (n >= 16) {
                uint8_t a[16], b[16];
                memcpy(a, s, 16);
                memcpy(b, s + n - 16, 16);
                memcpy(d, a, 16);
                memcpy(d + n - 16, b, 16);
        } else if (n >= 8) {
                uint64_t a, b;
                memcpy(&a, s, 8);
                memcpy(&b, s + n - 8, 8);
                memcpy(d, &a, 8);
                memcpy(d + n - 8, &b, 8);
        } else if (n >= 4) {
                uint32_t a, b;
                memcpy(&a, s, 4);
                memcpy(&b, s + n - 4, 4);
                memcpy(d, &a, 4);
                memcpy(d + n - 4, &b, 4);
        } else {
                memmove(d, s, n);
        }
}

/* Moves `len` consecutive slots of heads [h0, h1) from src to dst (dst < src), all inside one
 * block each. Overlap-safe, because a run may overlap itself within a block. The block and slot
 * arithmetic is done once for all the heads. */
static void move_run(const struct block_layer *L, uint32_t h0, uint32_t h1, uint32_t src, uint32_t dst,
                     uint32_t len) {
        const struct block_layout *l = L->layout;
        uint32_t T = l->block_tokens;
        uint8_t *sb = L->blocks[src / T], *db = L->blocks[dst / T];
        uint32_t ss = src % T, ds = dst % T;
        size_t rows = (size_t)len * l->row_bytes, side = (size_t)len * 4u;

        for (uint32_t h = h0; h < h1; h++) {
                move_bytes(block_key(l, db, h, ds), block_key(l, sb, h, ss), rows);
                move_bytes(block_value(l, db, h, ds), block_value(l, sb, h, ss), rows);
                move_bytes(block_side(l, db, l->pos_offset, h, ds), block_side(l, sb, l->pos_offset, h, ss),
                           side);
                move_bytes(block_side(l, db, l->sum_offset, h, ds), block_side(l, sb, l->sum_offset, h, ss),
                           side);
                move_bytes(block_side(l, db, l->ema_offset, h, ds), block_side(l, sb, l->ema_offset, h, ss),
                           side);
                move_bytes(block_side(l, db, l->last_offset, h, ds), block_side(l, sb, l->last_offset, h, ss),
                           side);
                move_bytes(block_side(l, db, l->logw_offset, h, ds), block_side(l, sb, l->logw_offset, h, ss),
                           side);
        }
}

static uint32_t source_of(const uint32_t *keep, uint32_t kc, uint32_t base, uint32_t i) {
        return i < kc ? keep[i] : base + (i - kc);
}

/* Compacts heads [h0, h1), which share the keep-set: run after run, each run for all of them
 * (the heads' slots never alias, and each head still sees its runs in ascending order). */
static void compact_heads(const struct block_layer *L, uint32_t h0, uint32_t h1, const uint32_t *keep,
                          uint32_t kc, uint32_t base, uint32_t new_len) {
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
                        move_run(L, h0, h1, src, i, len);
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
        if (!per_head)
                compact_heads(L, 0, H, keep, keep_count, base_tokens, new_len);
        for (uint32_t h = 0; per_head && h < H; h++)
                compact_heads(L, h, h + 1, keep + (uint64_t)h * keep_count, keep_count, base_tokens, new_len);
        *ret_n_tokens = new_len;
        return 0;
}
