/* block.c: block layout arithmetic (every class of block.h) and element conversion (f32, f16,
 * bf16). */
#include "block.h"

#include <errno.h>
#include <string.h>

size_t block_dtype_bytes(enum block_dtype dtype) {
        switch (dtype) {
        case BLOCK_DTYPE_F32: return 4;
        case BLOCK_DTYPE_Q8: return 1;
        case BLOCK_DTYPE_F16:
        case BLOCK_DTYPE_BF16: return 2;
        case BLOCK_DTYPE_Q4:
        case BLOCK_DTYPE_Q3:
        case BLOCK_DTYPE_Q2: return 0;
        }
        return 0;
}

uint32_t block_dtype_bits(enum block_dtype dtype) {
        switch (dtype) {
        case BLOCK_DTYPE_F32: return 32;
        case BLOCK_DTYPE_F16:
        case BLOCK_DTYPE_BF16: return 16;
        case BLOCK_DTYPE_Q8: return 8;
        case BLOCK_DTYPE_Q4: return 4;
        case BLOCK_DTYPE_Q3: return 3;
        case BLOCK_DTYPE_Q2: return 2;
        }
        return 0;
}

int block_dtype_quantized(enum block_dtype dtype) {
        return dtype == BLOCK_DTYPE_Q8 || dtype == BLOCK_DTYPE_Q4 || dtype == BLOCK_DTYPE_Q3 ||
               dtype == BLOCK_DTYPE_Q2;
}

static uint64_t align64(uint64_t x) {
        return (x + 63u) & ~(uint64_t)63u;
}

int block_layout_init(struct block_layout *l, uint32_t block_tokens, uint32_t n_kv_heads, uint32_t head_dim,
                      enum block_dtype dtype) {
        size_t eb = block_dtype_bytes(dtype);
        uint32_t bits = block_dtype_bits(dtype);
        if (!block_tokens || !n_kv_heads || !head_dim || !bits)
                return -EINVAL;
        int packed = eb == 0;
        /* a packed row is a whole number of bytes, and the rotation needs a power of two */
        if (packed && (head_dim < 8 || (head_dim & (head_dim - 1))))
                return -EINVAL;
        /* each bound alone implies a block over 4 GiB; together they keep the sums below from
         * wrapping (slots * row_bytes < 2^62) */
        uint64_t slots = (uint64_t)n_kv_heads * block_tokens;
        if (slots > (1ull << 30) || (uint64_t)head_dim * bits > (1ull << 35))
                return -EINVAL;
        struct block_layout t = {
                .block_tokens = block_tokens,
                .n_kv_heads = n_kv_heads,
                .head_dim = head_dim,
                .dtype = dtype,
                .elem_bytes = (uint32_t)eb,
                .row_bytes = (uint64_t)head_dim * bits / 8u,
        };
        uint64_t kv = align64(slots * t.row_bytes);
        uint64_t side = align64(slots * 4u);
        t.key_offset = 0;
        t.value_offset = kv;
        t.pos_offset = 2 * kv;
        if (dtype == BLOCK_DTYPE_Q8) {
                t.kscale_offset = 2 * kv;
                t.vscale_offset = t.kscale_offset + align64((uint64_t)n_kv_heads * head_dim * 4u);
                t.pos_offset = t.vscale_offset + side;
        } else if (packed) {
                t.kscale_offset = 2 * kv;
                t.vscale_offset = t.kscale_offset + side;
                t.pos_offset = t.vscale_offset + side;
        }
        t.sum_offset = t.pos_offset + side;
        t.ema_offset = t.sum_offset + side;
        t.last_offset = t.ema_offset + side;
        t.logw_offset = t.last_offset + side;
        t.block_bytes = t.logw_offset + side;
        if (t.block_bytes > (1ull << 32))
                return -EINVAL;
        *l = t;
        return 0;
}

static float half_to_float(uint16_t h) {
        uint32_t sign = (uint32_t)(h >> 15) << 31, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
        if (exp == 0) {
                if (man == 0) {
                        bits = sign;
                } else { /* subnormal: normalize */
                        int e = -1;
                        do {
                                e++;
                                man <<= 1;
                        } while (!(man & 0x400));
                        bits = sign | ((uint32_t)(127 - 15 - e) << 23) | ((man & 0x3ff) << 13);
                }
        } else if (exp == 0x1f) {
                bits = sign | 0x7f800000u | (man << 13);
        } else {
                bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
        }
        float f;
        memcpy(&f, &bits, 4);
        return f;
}

static uint16_t float_to_half(float f) {
        uint32_t x;
        memcpy(&x, &f, 4);
        uint32_t sign = (x >> 16) & 0x8000, exp = (x >> 23) & 0xff, man = x & 0x7fffff;
        if (exp == 0xff) /* inf or nan */
                return (uint16_t)(sign | 0x7c00 | (man ? 0x200 : 0));
        int e = (int)exp - 127 + 15;
        if (e >= 0x1f)
                return (uint16_t)(sign | 0x7c00);
        if (e <= 0) { /* subnormal or zero */
                if (e < -10)
                        return (uint16_t)sign;
                man |= 0x800000;
                uint32_t shift = (uint32_t)(14 - e);
                uint32_t h = man >> shift, rem = man & ((1u << shift) - 1), half = 1u << (shift - 1);
                if (rem > half || (rem == half && (h & 1)))
                        h++;
                return (uint16_t)(sign | h);
        }
        uint32_t h = sign | ((uint32_t)e << 10) | (man >> 13), rem = man & 0x1fff;
        if (rem > 0x1000 || (rem == 0x1000 && (h & 1)))
                h++; /* may carry into the exponent: that is the correct rounding */
        return (uint16_t)h;
}

static float bf16_to_float(uint16_t b) {
        uint32_t bits = (uint32_t)b << 16;
        float f;
        memcpy(&f, &bits, 4);
        return f;
}

static uint16_t float_to_bf16(float f) {
        uint32_t x;
        memcpy(&x, &f, 4);
        if ((x & 0x7fffffff) > 0x7f800000)
                return (uint16_t)((x >> 16) | 0x40);
        x += 0x7fff + ((x >> 16) & 1);
        return (uint16_t)(x >> 16);
}

void block_load_row(enum block_dtype dtype, const void *src, float *dst, uint32_t n) {
        const uint16_t *s16 = src;
        switch (dtype) {
        case BLOCK_DTYPE_Q8:
        case BLOCK_DTYPE_Q4:
        case BLOCK_DTYPE_Q3:
        case BLOCK_DTYPE_Q2: memset(dst, 0, (size_t)n * 4); return; /* needs scales: tier.h */
        case BLOCK_DTYPE_F32: memcpy(dst, src, (size_t)n * 4); return;
        case BLOCK_DTYPE_F16:
                for (uint32_t i = 0; i < n; i++)
                        dst[i] = half_to_float(s16[i]);
                return;
        case BLOCK_DTYPE_BF16:
                for (uint32_t i = 0; i < n; i++)
                        dst[i] = bf16_to_float(s16[i]);
                return;
        }
}

void block_store_row(enum block_dtype dtype, const float *src, void *dst, uint32_t n) {
        uint16_t *d16 = dst;
        switch (dtype) {
        case BLOCK_DTYPE_Q8:
        case BLOCK_DTYPE_Q4:
        case BLOCK_DTYPE_Q3:
        case BLOCK_DTYPE_Q2: return; /* needs scales: tier.h */
        case BLOCK_DTYPE_F32: memcpy(dst, src, (size_t)n * 4); return;
        case BLOCK_DTYPE_F16:
                for (uint32_t i = 0; i < n; i++)
                        d16[i] = float_to_half(src[i]);
                return;
        case BLOCK_DTYPE_BF16:
                for (uint32_t i = 0; i < n; i++)
                        d16[i] = float_to_bf16(src[i]);
                return;
        }
}
