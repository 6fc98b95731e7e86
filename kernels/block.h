/* block.h: the layout of one KV block in the pool, shared by kvcd, libkvc and the kernels.
 *
 * A block holds block_tokens token slots of one layer of one session: the keys and values of
 * every KV head, and beside them the per-token side arrays the policies read (original
 * position, accumulated / EMA / last attention, decode-time log-weight). Keeping the side arrays
 * in the block means they move with the KV in a compaction and are accounted with it.
 *
 *   key   [n_kv_heads][block_tokens][head_dim]  elements of elem_bytes
 *   value [n_kv_heads][block_tokens][head_dim]
 *   pos   [n_kv_heads][block_tokens]  int32
 *   sum   [n_kv_heads][block_tokens]  float    (sum of attention received)
 *   ema   [n_kv_heads][block_tokens]  float    (exponential moving average of it)
 *   last  [n_kv_heads][block_tokens]  float    (attention at the last step)
 *   logw  [n_kv_heads][block_tokens]  float    (log-weight added to the attention logit)
 *
 * The INT8 block class (BLOCK_DTYPE_Q8) holds tokens that left the recent full-precision
 * window: keys and values as int8, with their scales between the values and the side arrays:
 *
 *   key    [n_kv_heads][block_tokens][head_dim]  int8, symmetric: k = q * kscale[head][channel]
 *   value  [n_kv_heads][block_tokens][head_dim]  int8, symmetric: v = q * vscale[head][slot]
 *   kscale [n_kv_heads][head_dim]     float      (per channel over the block's tokens: keys
 *                                                 have outlier channels)
 *   vscale [n_kv_heads][block_tokens] float      (per token)
 *   pos, sum, ema, last, logw as above
 *
 * A key scale belongs to its block: a token moved into another INT8 block is requantized to
 * that block's scales, never copied with its bytes.
 *
 * The low tiers of the precision ladder (BLOCK_DTYPE_Q4, _Q3, _Q2: kernels/lloyd.h) hold rows
 * rotated by the layer's randomized Hadamard transform and coded per coordinate against a
 * Lloyd-Max codebook of b bits, with one scale per row (keys and values alike):
 *
 *   key    [n_kv_heads][block_tokens][head_dim * b / 8]  codes packed little-endian, b bits each
 *   value  [n_kv_heads][block_tokens][head_dim * b / 8]
 *   kscale [n_kv_heads][block_tokens] float              (per token: k' = kscale * c[code])
 *   vscale [n_kv_heads][block_tokens] float              (per token)
 *   pos, sum, ema, last, logw as above
 *
 * A row's scale depends on that row alone, so a token moves between such blocks byte for byte.
 * kernels/tier.h states each class's cost in bits per value, metadata and side arrays included.
 *
 * Each array starts on a 64-byte boundary and the block size is a multiple of 64, so blocks can
 * be carved back to back out of a chunk. Both sides compute the layout from the geometry with
 * block_layout_init(); SessionOpened carries block_bytes as a cross-check.
 *
 * Slot-major rows per head keep one head's keys of a block contiguous: that is the order the
 * attention reads them in and the order compaction moves them in.
 */
#pragma once

#include <stddef.h>
#include <stdint.h>

enum block_dtype {
        BLOCK_DTYPE_F32 = 1,
        BLOCK_DTYPE_F16 = 2,
        BLOCK_DTYPE_BF16 = 3,
        BLOCK_DTYPE_Q8 = 4, /* int8 with per-block key scales and per-token value scales */
        BLOCK_DTYPE_Q4 = 5, /* rotated, 4-bit Lloyd-Max codes, a scale per row (lloyd.h) */
        BLOCK_DTYPE_Q3 = 6, /* the same at 3 bits */
        BLOCK_DTYPE_Q2 = 7, /* the same at 2 bits */
};

struct block_layout {
        uint32_t block_tokens;
        uint32_t n_kv_heads;
        uint32_t head_dim;
        enum block_dtype dtype;
        uint32_t elem_bytes; /* 0 for the packed classes (Q4, Q3, Q2) */
        uint64_t row_bytes;  /* one row of one head: head_dim * elem_bytes, or head_dim * bits / 8 */
        uint64_t key_offset;
        uint64_t value_offset;
        uint64_t kscale_offset; /* quantized classes only (0 otherwise) */
        uint64_t vscale_offset; /* quantized classes only (0 otherwise) */
        uint64_t pos_offset;
        uint64_t sum_offset;
        uint64_t ema_offset;
        uint64_t last_offset;
        uint64_t logw_offset;
        uint64_t block_bytes;
};

/* One layer of one session as the kernels see it: its blocks in slot order and its length. */
struct block_layer {
        const struct block_layout *layout;
        uint8_t *const *blocks;
        uint32_t n_blocks;
        uint32_t n_tokens; /* slots [0, n_tokens) are live; n_tokens <= n_blocks * block_tokens */
        /* a shared prefix, as in struct mixed_layer (mixed.h): slots [0, n_shared) are read, never
         * written, and bit j of shared_mask[h * mask_stride + j / 8] masks slot j for KV head h */
        uint32_t n_shared;
        const uint8_t *shared_mask;
        uint32_t mask_stride;
};

/* Fills l for the geometry. -EINVAL for a zero or unknown field, a block over 4 GiB, or a packed
 * class (Q4, Q3, Q2) whose head_dim is not a power of two (the Hadamard rotation's length). */
int block_layout_init(struct block_layout *l, uint32_t block_tokens, uint32_t n_kv_heads, uint32_t head_dim,
                      enum block_dtype dtype);

/* Bytes of one element: 4, 2, or 1 (Q8); 0 for the packed classes and unknown values. */
size_t block_dtype_bytes(enum block_dtype dtype);
/* Bits of one coded element: 32, 16, 8, 4, 3 or 2; 0 for an unknown value. */
uint32_t block_dtype_bits(enum block_dtype dtype);
/* 1 for the classes whose rows need scales to be read (Q8 and the packed classes). */
int block_dtype_quantized(enum block_dtype dtype);

static inline uint8_t *block_key(const struct block_layout *l, uint8_t *block, uint32_t head, uint32_t slot) {
        return block + l->key_offset + ((uint64_t)head * l->block_tokens + slot) * l->row_bytes;
}

static inline uint8_t *block_value(const struct block_layout *l, uint8_t *block, uint32_t head,
                                   uint32_t slot) {
        return block + l->value_offset + ((uint64_t)head * l->block_tokens + slot) * l->row_bytes;
}

/* Q8 blocks: the key scales of a head ([head_dim] floats) and the value scale of a slot. The
 * packed classes keep a key scale per slot: block_vscale's arithmetic on kscale_offset. */
static inline float *block_kscale(const struct block_layout *l, uint8_t *block, uint32_t head) {
        return (float *)(block + l->kscale_offset) + (uint64_t)head * l->head_dim;
}

static inline float *block_vscale(const struct block_layout *l, uint8_t *block, uint32_t head,
                                  uint32_t slot) {
        return (float *)(block + l->vscale_offset) + (uint64_t)head * l->block_tokens + slot;
}

/* The five side arrays' offsets, in the order pos, sum, ema, last, logw. */
#define BLOCK_SIDE_ARRAYS 5
static inline void block_side_offsets(const struct block_layout *l, uint64_t off[BLOCK_SIDE_ARRAYS]) {
        off[0] = l->pos_offset;
        off[1] = l->sum_offset;
        off[2] = l->ema_offset;
        off[3] = l->last_offset;
        off[4] = l->logw_offset;
}

/* The side array at offset `off` (pos, sum, ema, last, logw), element (head, slot). */
static inline void *block_side(const struct block_layout *l, uint8_t *block, uint64_t off, uint32_t head,
                               uint32_t slot) {
        return block + off + ((uint64_t)head * l->block_tokens + slot) * 4u;
}

/* The key scale of a slot of a packed block (Q4, Q3, Q2). */
static inline float *block_kscale_row(const struct block_layout *l, uint8_t *block, uint32_t head,
                                      uint32_t slot) {
        return (float *)(block + l->kscale_offset) + (uint64_t)head * l->block_tokens + slot;
}

/* Loads n elements of dtype into floats, and stores floats into dtype (round to nearest even).
 * Not for the quantized classes, whose rows need their scales (kernels/tier.h). */
void block_load_row(enum block_dtype dtype, const void *src, float *dst, uint32_t n);
void block_store_row(enum block_dtype dtype, const float *src, void *dst, uint32_t n);
