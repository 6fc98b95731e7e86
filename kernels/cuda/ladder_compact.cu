/* ladder_compact.cu: compaction and demotion of a layer of several tiers on the GPU, in place
 * (kernels/ladder.c's ladder_compact is the reference; same bytes).
 *
 * Two launches on the stream:
 *  1. lcompact_check, one block per keep-set (per KV head, or one): the keep-set ascending and
 *     below base_tokens, every new tier the token's tier or a lower one below n_tiers, and the
 *     counts per tier equal to the new_n the caller passed (which the host checked against the
 *     tables). A wrong one sets the status at the start of the workspace to -EINVAL.
 *  2. lcompact_head, one block per KV head (a head's rows, scales and side words are its own in
 *     every block, so heads are independent): if the status is 0, the reference's walk, in its
 *     order: destination tiers n_tiers - 1 down to 1, block by block (thread 0 walks the keep-set
 *     as ladder.c's cursor does, and a block holding exactly the tokens it held is skipped), each
 *     block gathered whole into the head's workspace (a thread per source row: read as floats in
 *     the destination's basis, rotated when it comes from an unrotated tier, a same-tier row's
 *     bytes and scales kept) and only then written (q8: key scales per channel over the gathered
 *     keys, keys requantized, values quantized per token or copied; q4-q2: rows coded or copied);
 *     then tier 0, whose rows only move down, in batches of T rows, every source of a batch read
 *     before any of its rows is written. ladder.c states why this order is safe in place; the
 *     barriers between the phases keep it.
 *
 * Bit for bit: the quantizers are quant.c's and lloyd.c's operations in the same order, products
 * and sums of the Lloyd fit with __dmul_rn / __dadd_rn so that nvcc contracts nothing into an
 * FMA, IEEE division and square root (no --use_fast_math), the rotation lloyd.c's butterflies.
 *
 * Not fast: one block per head walks the destination blocks one after another (the CPU's order),
 * and a row is coded by one thread. Enough to keep compaction on the device; the mixed layer's
 * one-pass kernel (compact.cu) shows what a fast one would look like.
 */
#include <errno.h>
#include <string.h>

#include "common.cuh"
#include "cuda.h"

extern "C" {
#include "lloyd.h"
#include "quant.h"
#include "tier.h"
}

namespace kvc {

namespace {

constexpr int THREADS = 128;
constexpr size_t HEADER_BYTES = 256; /* int32 status */
constexpr uint32_t MAX_D = 256;

struct ltier {
        uint8_t *const *blocks;
        uint64_t key, val, ks, vs, rb;
        side_offsets side;
        uint32_t n, first; /* old count and first logical slot */
        int dtype, rotated, bits;
};

struct lcompact_params {
        ltier tier[LADDER_TIERS];
        uint32_t n_tiers, T, D, kc, base, n_old, per_head;
        uint32_t new_n[LADDER_TIERS];
        const uint32_t *keep;
        const uint8_t *new_tier;
        const float *signs;
        float codebook[28];
        uint8_t *ws;
        uint64_t head_ws_bytes;
};

__host__ __device__ constexpr int codebook_at(int bits) {
        return bits == 2 ? 0 : bits == 3 ? 4 : 12;
}

/* The scratch of one head: ladder.c's struct gather. */
struct lgather {
        float *keys, *values; /* [T][D] */
        uint8_t *kraw, *vraw; /* [T][D] */
        float *kscale, *vscale;
        uint32_t *same, *src, *side; /* [T], [T], [T][5] */
};

__device__ lgather gather_of(const lcompact_params &p, uint32_t h) {
        uint8_t *b = p.ws + HEADER_BYTES + h * p.head_ws_bytes;
        uint64_t TD = (uint64_t)p.T * p.D;
        lgather g;
        g.keys = (float *)b;
        g.values = g.keys + TD;
        g.kscale = g.values + TD;
        g.vscale = g.kscale + p.T;
        g.same = (uint32_t *)(g.vscale + p.T);
        g.src = g.same + p.T;
        g.side = g.src + p.T;
        g.kraw = (uint8_t *)(g.side + 5 * (uint64_t)p.T);
        g.vraw = g.kraw + TD;
        return g;
}

uint64_t head_ws_bytes_of(uint32_t T, uint32_t D) {
        uint64_t TD = (uint64_t)T * D;
        return align_up(2 * TD * 4 + 2 * (uint64_t)T * 4 + 7 * (uint64_t)T * 4 + 2 * TD, 256);
}

__device__ __forceinline__ uint32_t old_tier(const lcompact_params &p, uint32_t s) {
        uint32_t t = p.n_tiers - 1;
        while (t > 0 && s >= p.tier[t].first + p.tier[t].n)
                t--;
        return t;
}

__device__ __forceinline__ uint32_t tier_of_keep(const lcompact_params &p, const uint32_t *keep,
                                                 const uint8_t *nt, uint32_t i) {
        return nt ? nt[i] : old_tier(p, keep[i]);
}

/* ladder.c's cursor: the next source of destination tier t (keep entries, then the tail). */
struct lcursor {
        uint32_t i, tail;
};

__device__ uint32_t cursor_next(const lcompact_params &p, const uint32_t *keep, const uint8_t *nt, uint32_t t,
                                lcursor *k) {
        while (k->i < p.kc) {
                uint32_t i = k->i++;
                if (tier_of_keep(p, keep, nt, i) == t)
                        return keep[i];
        }
        return k->tail++;
}

/* ---- the rows, as ladder.c's tier rows read and write them (one thread) ---- */

__device__ void load_row(const lcompact_params &p, const ltier &tr, const uint8_t *b, uint32_t h,
                         uint32_t slot, bool key, float *dst) {
        const uint32_t D = p.D, T = p.T;
        const uint8_t *row = b + (key ? tr.key : tr.val) + ((uint64_t)h * T + slot) * tr.rb;
        switch (tr.dtype) {
        case BLOCK_DTYPE_F32:
                for (uint32_t c = 0; c < D; c++)
                        dst[c] = ((const float *)row)[c];
                break;
        case BLOCK_DTYPE_F16:
                for (uint32_t c = 0; c < D; c++)
                        dst[c] = half_bits_to_float(((const uint16_t *)row)[c]);
                break;
        case BLOCK_DTYPE_BF16:
                for (uint32_t c = 0; c < D; c++)
                        dst[c] = __uint_as_float((uint32_t)((const uint16_t *)row)[c] << 16);
                break;
        case BLOCK_DTYPE_Q8: {
                const int8_t *q = (const int8_t *)row;
                if (key) {
                        const float *ks = (const float *)(b + tr.ks) + (uint64_t)h * D;
                        for (uint32_t c = 0; c < D; c++)
                                dst[c] = __fmul_rn((float)q[c], ks[c]);
                } else {
                        float vs = ((const float *)(b + tr.vs))[(uint64_t)h * T + slot];
                        for (uint32_t c = 0; c < D; c++)
                                dst[c] = __fmul_rn((float)q[c], vs);
                }
                break;
        }
        default: { /* packed: scale * centroid */
                float s = ((const float *)(b + (key ? tr.ks : tr.vs)))[(uint64_t)h * T + slot];
                const float *cb = p.codebook + codebook_at(tr.bits);
                for (uint32_t c = 0; c < D; c++) {
                        uint32_t bit = c * tr.bits, byte = bit / 8, shift = bit % 8;
                        uint32_t w = row[byte] | (shift + tr.bits > 8 ? (uint32_t)row[byte + 1] << 8 : 0u);
                        dst[c] = __fmul_rn(s, cb[(w >> shift) & ((1u << tr.bits) - 1u)]);
                }
        }
        }
}

/* lloyd_rotate, one thread. */
__device__ void rotate_row(const float *signs, float *x, uint32_t D) {
        float norm = 1.0f / sqrtf((float)D);
        for (uint32_t i = 0; i < D; i++)
                x[i] = __fmul_rn(x[i], signs[i]);
        for (uint32_t h = 1; h < D; h *= 2)
                for (uint32_t i = 0; i < D; i += 2 * h)
                        for (uint32_t j = i; j < i + h; j++) {
                                float a = x[j], b = x[j + h];
                                x[j] = a + b;
                                x[j + h] = a - b;
                        }
        for (uint32_t i = 0; i < D; i++)
                x[i] = __fmul_rn(x[i], norm);
}

__device__ uint32_t nearest(const float *c, uint32_t levels, float u) {
        uint32_t k = 0;
        while (k + 1 < levels && u > __fmul_rn(0.5f, c[k] + c[k + 1]))
                k++;
        return k;
}

__device__ double fit_round(const float *y, uint32_t d, const float *c, uint32_t levels, float s, uint8_t *k,
                            float *ret_scale) {
        float inv = __fdiv_rn(1.0f, s);
        double xc = 0.0, cc = 0.0, yy = 0.0;
        for (uint32_t i = 0; i < d; i++) {
                k[i] = (uint8_t)nearest(c, levels, __fmul_rn(y[i], inv));
                xc = __dadd_rn(xc, __dmul_rn((double)y[i], (double)c[k[i]]));
                cc = __dadd_rn(cc, __dmul_rn((double)c[k[i]], (double)c[k[i]]));
                yy = __dadd_rn(yy, __dmul_rn((double)y[i], (double)y[i]));
        }
        *ret_scale = (float)__ddiv_rn(xc, cc);
        return __dadd_rn(yy, -__ddiv_rn(__dmul_rn(xc, xc), cc));
}

/* lloyd_encode_row, one thread: codes (zeroed first) and the scale. */
__device__ void encode_row(const float *y, uint32_t d, uint32_t bits, const float *c, uint8_t *codes,
                           float *ret_scale) {
        uint32_t levels = 1u << bits;
        uint8_t k[MAX_D], best[MAX_D];
        double ss = 0.0;
        for (uint32_t i = 0; i < d * bits / 8; i++)
                codes[i] = 0;
        *ret_scale = 0.0f;
        for (uint32_t i = 0; i < d; i++) {
                if (!isfinite(y[i]))
                        return;
                ss = __dadd_rn(ss, __dmul_rn((double)y[i], (double)y[i]));
        }
        if (ss == 0.0)
                return;
        float s = (float)sqrt(__ddiv_rn(ss, (double)d)), best_s = 0.0f;
        double best_err = INFINITY;
        for (uint32_t round = 0; round < LLOYD_FIT_ROUNDS; round++) {
                float next;
                double err = fit_round(y, d, c, levels, s, k, &next);
                if (!(err < best_err) || !(next > 0.0f))
                        break;
                best_err = err;
                best_s = next;
                for (uint32_t i = 0; i < d; i++)
                        best[i] = k[i];
                s = next;
        }
        for (uint32_t i = 0; i < d; i++) {
                uint32_t bit = i * bits, byte = bit / 8, shift = bit % 8;
                codes[byte] |= (uint8_t)(best[i] << shift);
                if (shift + bits > 8)
                        codes[byte + 1] |= (uint8_t)(best[i] >> (8 - shift));
        }
        *ret_scale = best_s;
}

/* quant_scale */
__device__ float absmax_scale(const float *x, uint32_t n) {
        float m = 0.0f;
        for (uint32_t i = 0; i < n; i++) {
                float a = fabsf(x[i]);
                if (a > m)
                        m = a;
        }
        return __fdiv_rn(m, (float)QUANT_LEVELS);
}

/* ladder.c's gather_one: source slot s of head h into entry e, in tier t's basis. */
__device__ void gather_one(const lcompact_params &p, const lgather &g, uint32_t h, uint32_t t, uint32_t s,
                           uint32_t e) {
        uint32_t u = old_tier(p, s), idx = s - p.tier[u].first, T = p.T, D = p.D;
        const ltier &tu = p.tier[u], &tt = p.tier[t];
        const uint8_t *b = tu.blocks[idx / T];
        uint32_t slot = idx % T;
        float *k = g.keys + (uint64_t)e * D, *v = g.values + (uint64_t)e * D;
        load_row(p, tu, b, h, slot, true, k);
        load_row(p, tu, b, h, slot, false, v);
        if (tt.rotated && !tu.rotated) {
                rotate_row(p.signs + (uint64_t)h * D, k, D);
                rotate_row(p.signs + (uint64_t)h * D, v, D);
        }
        g.same[e] = 0;
        uint64_t rs = (uint64_t)h * T + slot;
        if (u == t) { /* t is quantized */
                const uint8_t *vr = b + tu.val + rs * tu.rb;
                for (uint64_t i = 0; i < tu.rb; i++)
                        g.vraw[e * tu.rb + i] = vr[i];
                g.vscale[e] = ((const float *)(b + tu.vs))[rs];
                g.same[e] = 1;
                if (tt.dtype != BLOCK_DTYPE_Q8) { /* per-row key scales */
                        const uint8_t *kr = b + tu.key + rs * tu.rb;
                        for (uint64_t i = 0; i < tu.rb; i++)
                                g.kraw[e * tu.rb + i] = kr[i];
                        g.kscale[e] = ((const float *)(b + tu.ks))[rs];
                        g.same[e] |= 2;
                }
        }
        for (int a = 0; a < 5; a++)
                g.side[e * 5 + a] = *(const uint32_t *)(b + tu.side.off[a] + rs * 4);
}

/* ladder.c's write_block: the cnt gathered tokens into block d of quantized tier t, head h. */
__device__ void write_block(const lcompact_params &p, const lgather &g, uint32_t h, uint32_t t, uint32_t d,
                            uint32_t cnt) {
        const ltier &tt = p.tier[t];
        const uint32_t D = p.D, T = p.T, rb = (uint32_t)tt.rb;
        uint8_t *b = tt.blocks[d];
        uint64_t hs = (uint64_t)h * T;
        if (tt.dtype == BLOCK_DTYPE_Q8) {
                float *ks = (float *)(b + tt.ks) + (uint64_t)h * D;
                for (uint32_t c = threadIdx.x; c < D; c += blockDim.x) { /* quant_channel_scales */
                        float m = 0.0f;
                        for (uint32_t e = 0; e < cnt; e++) {
                                float a = fabsf(g.keys[(uint64_t)e * D + c]);
                                if (a > m)
                                        m = a;
                        }
                        ks[c] = __fdiv_rn(m, (float)QUANT_LEVELS);
                }
                __syncthreads();
                for (uint32_t i = threadIdx.x; i < cnt * D; i += blockDim.x) {
                        uint32_t e = i / D, c = i % D;
                        ((int8_t *)(b + tt.key + (hs + e) * rb))[c] = (int8_t)quant_one(g.keys[i], ks[c]);
                }
                for (uint32_t e = threadIdx.x; e < cnt; e += blockDim.x) {
                        int8_t *vq = (int8_t *)(b + tt.val + (hs + e) * rb);
                        float *vs = (float *)(b + tt.vs) + hs + e;
                        if (g.same[e] & 1) {
                                for (uint32_t i = 0; i < rb; i++)
                                        vq[i] = (int8_t)g.vraw[(uint64_t)e * rb + i];
                                *vs = g.vscale[e];
                        } else {
                                const float *v = g.values + (uint64_t)e * D;
                                float s = absmax_scale(v, D);
                                for (uint32_t c = 0; c < D; c++)
                                        vq[c] = (int8_t)quant_one(v[c], s);
                                *vs = s;
                        }
                }
        } else {
                const float *cb = p.codebook + codebook_at(tt.bits);
                for (uint32_t e = threadIdx.x; e < cnt; e += blockDim.x) {
                        uint8_t *kr = b + tt.key + (hs + e) * rb, *vr = b + tt.val + (hs + e) * rb;
                        float *ks = (float *)(b + tt.ks) + hs + e, *vs = (float *)(b + tt.vs) + hs + e;
                        if (g.same[e] & 2) {
                                for (uint32_t i = 0; i < rb; i++)
                                        kr[i] = g.kraw[(uint64_t)e * rb + i];
                                *ks = g.kscale[e];
                        } else {
                                encode_row(g.keys + (uint64_t)e * D, D, tt.bits, cb, kr, ks);
                        }
                        if (g.same[e] & 1) {
                                for (uint32_t i = 0; i < rb; i++)
                                        vr[i] = g.vraw[(uint64_t)e * rb + i];
                                *vs = g.vscale[e];
                        } else {
                                encode_row(g.values + (uint64_t)e * D, D, tt.bits, cb, vr, vs);
                        }
                }
        }
        for (uint32_t e = threadIdx.x; e < cnt; e += blockDim.x)
                for (int a = 0; a < 5; a++)
                        *(uint32_t *)(b + tt.side.off[a] + (hs + e) * 4) = g.side[e * 5 + a];
}

__global__ void __launch_bounds__(THREADS) lcompact_check(lcompact_params p) {
        __shared__ unsigned cnt[LADDER_TIERS];
        const uint32_t h = blockIdx.x;
        const uint32_t *keep = p.keep + (uint64_t)h * p.kc;
        const uint8_t *nt = p.new_tier ? p.new_tier + (uint64_t)h * p.kc : nullptr;
        int *status = (int *)p.ws;
        if (threadIdx.x < LADDER_TIERS)
                cnt[threadIdx.x] = 0;
        __syncthreads();
        int bad = 0;
        for (uint32_t i = threadIdx.x; i < p.kc; i += blockDim.x) {
                uint32_t s = keep[i];
                if (s >= p.base || (i > 0 && s <= keep[i - 1])) {
                        bad = 1;
                        continue;
                }
                uint32_t ot = old_tier(p, s), t = nt ? nt[i] : ot;
                if (t < ot || t >= p.n_tiers) {
                        bad = 1;
                        continue;
                }
                atomicAdd(&cnt[t], 1u);
        }
        if (__syncthreads_or(bad)) {
                if (threadIdx.x == 0)
                        atomicExch(status, -EINVAL);
                return;
        }
        if (threadIdx.x == 0) {
                cnt[0] += p.n_old - p.base;
                for (uint32_t t = 0; t < LADDER_TIERS; t++)
                        if (cnt[t] != p.new_n[t])
                                atomicExch(status, -EINVAL);
        }
}

__global__ void __launch_bounds__(THREADS) lcompact_head(lcompact_params p) {
        __shared__ lcursor cur;
        __shared__ uint32_t skip;
        const uint32_t h = blockIdx.x, T = p.T;
        if (*(volatile int *)p.ws != 0)
                return; /* the keep-set was refused: nothing moves */
        const uint32_t *keep = p.per_head ? p.keep + (uint64_t)h * p.kc : p.keep;
        const uint8_t *nt = p.new_tier && p.per_head ? p.new_tier + (uint64_t)h * p.kc : p.new_tier;
        const lgather g = gather_of(p, h);

        for (uint32_t t = p.n_tiers; t-- > 1;) {
                uint32_t count = p.new_n[t];
                if (threadIdx.x == 0)
                        cur = lcursor{ 0, p.base };
                for (uint32_t d = 0; d * T < count; d++) {
                        uint32_t cnt = count - d * T < T ? count - d * T : T;
                        __syncthreads();
                        if (threadIdx.x == 0) {
                                uint32_t old_live = p.tier[t].n > d * T ? min(p.tier[t].n - d * T, T) : 0;
                                uint32_t unchanged = 1;
                                for (uint32_t e = 0; e < cnt; e++) {
                                        g.src[e] = cursor_next(p, keep, nt, t, &cur);
                                        if (g.src[e] != p.tier[t].first + d * T + e)
                                                unchanged = 0;
                                }
                                skip = unchanged && old_live == cnt;
                        }
                        __syncthreads();
                        if (skip)
                                continue;
                        for (uint32_t e = threadIdx.x; e < cnt; e += blockDim.x)
                                gather_one(p, g, h, t, g.src[e], e);
                        __syncthreads(); /* every source read before the block is written */
                        write_block(p, g, h, t, d, cnt);
                }
                __syncthreads();
        }

        /* tier 0: rows move down (destination index <= source index), T at a time */
        const ltier &t0 = p.tier[0];
        const uint32_t rb = (uint32_t)t0.rb, count = p.new_n[0];
        uint8_t *kraw = (uint8_t *)g.keys, *vraw = (uint8_t *)g.values; /* T rows of at most 4 D bytes */
        if (threadIdx.x == 0)
                cur = lcursor{ 0, p.base };
        for (uint32_t j0 = 0; j0 < count; j0 += T) {
                uint32_t cnt = count - j0 < T ? count - j0 : T;
                __syncthreads();
                if (threadIdx.x == 0)
                        for (uint32_t e = 0; e < cnt; e++)
                                g.src[e] = cursor_next(p, keep, nt, 0, &cur) - t0.first;
                __syncthreads();
                for (uint32_t i = threadIdx.x; i < cnt * rb; i += blockDim.x) {
                        uint32_t e = i / rb, f = g.src[e];
                        const uint8_t *b = t0.blocks[f / T];
                        uint64_t at = ((uint64_t)h * T + f % T) * rb + i % rb;
                        kraw[i] = b[t0.key + at];
                        vraw[i] = b[t0.val + at];
                }
                for (uint32_t i = threadIdx.x; i < cnt * 5; i += blockDim.x) {
                        uint32_t e = i / 5, f = g.src[e];
                        const uint8_t *b = t0.blocks[f / T];
                        g.side[i] =
                                *(const uint32_t *)(b + t0.side.off[i % 5] + ((uint64_t)h * T + f % T) * 4);
                }
                __syncthreads(); /* the batch's sources read before its rows are written */
                for (uint32_t i = threadIdx.x; i < cnt * rb; i += blockDim.x) {
                        uint32_t j = j0 + i / rb;
                        uint8_t *b = t0.blocks[j / T];
                        uint64_t at = ((uint64_t)h * T + j % T) * rb + i % rb;
                        b[t0.key + at] = kraw[i];
                        b[t0.val + at] = vraw[i];
                }
                for (uint32_t i = threadIdx.x; i < cnt * 5; i += blockDim.x) {
                        uint32_t j = j0 + i / 5;
                        uint8_t *b = t0.blocks[j / T];
                        *(uint32_t *)(b + t0.side.off[i % 5] + ((uint64_t)h * T + j % T) * 4) = g.side[i];
                }
        }
}

} // namespace

} // namespace kvc

extern "C" size_t kvc_cuda_ladder_compact_workspace_bytes(const struct ladder_layer *M) {
        const struct block_layout *l = M->layout[0];
        return kvc::HEADER_BYTES +
               (size_t)l->n_kv_heads * kvc::head_ws_bytes_of(l->block_tokens, l->head_dim);
}

extern "C" int kvc_cuda_ladder_compact(const struct ladder_layer *M, const uint32_t *keep,
                                       const uint8_t *tier, uint32_t keep_count, int per_head,
                                       uint32_t base_tokens, const uint32_t *new_n, void *workspace,
                                       size_t workspace_bytes, void *stream) {
        using namespace kvc;
        if (ladder_check(M) < 0 || !new_n || !workspace || (keep_count && !keep))
                return -EINVAL;
        const struct block_layout *l0 = M->layout[0];
        uint32_t n = ladder_tokens(M), H = l0->n_kv_heads, T = l0->block_tokens, D = l0->head_dim;
        if (base_tokens > n || M->n_shared || D > MAX_D ||
            workspace_bytes < kvc_cuda_ladder_compact_workspace_bytes(M))
                return -EINVAL;
        lcompact_params p;
        memset(&p, 0, sizeof(p));
        uint32_t first = 0;
        for (uint32_t t = M->n_tiers; t-- > 0;) {
                const struct block_layout *l = M->layout[t];
                ltier &tt = p.tier[t];
                tt.blocks = M->blocks[t];
                tt.key = l->key_offset;
                tt.val = l->value_offset;
                tt.ks = l->kscale_offset;
                tt.vs = l->vscale_offset;
                tt.rb = l->row_bytes;
                tt.side = side_offsets_of(l);
                tt.n = M->n[t];
                tt.first = first;
                tt.dtype = (int)l->dtype;
                tt.rotated = tier_row(l->dtype)->rotated;
                tt.bits = (int)block_dtype_bits(l->dtype);
                first += M->n[t];
        }
        if (base_tokens < n && base_tokens < p.tier[0].first)
                return -EINVAL; /* the tail goes to tier 0: it must come from there */
        uint64_t total = 0;
        for (uint32_t t = 0; t < LADDER_TIERS; t++) {
                if (t >= M->n_tiers ? new_n[t] != 0 : div_up(new_n[t], T) > M->n_blocks[t])
                        return -EINVAL;
                p.new_n[t] = new_n[t];
                total += new_n[t];
        }
        if (total != (uint64_t)keep_count + (n - base_tokens) || (!keep_count && new_n[0] != total))
                return -EINVAL; /* without a keep-set only the tail is left, all in tier 0 */
        for (int bits = 2; bits <= 4; bits++)
                memcpy(p.codebook + codebook_at(bits), lloyd_codebook(bits), sizeof(float) << bits);
        p.n_tiers = M->n_tiers;
        p.T = T;
        p.D = D;
        p.kc = keep_count;
        p.base = base_tokens;
        p.n_old = n;
        p.per_head = per_head != 0;
        p.keep = keep;
        p.new_tier = tier;
        p.signs = M->signs;
        p.ws = (uint8_t *)workspace;
        p.head_ws_bytes = head_ws_bytes_of(T, D);

        cudaStream_t st = (cudaStream_t)stream;
        if (cudaMemsetAsync(workspace, 0, 4, st) != cudaSuccess)
                return -EIO;
        if (keep_count)
                KVC_LAUNCH(lcompact_check, per_head ? H : 1, THREADS, 0, st)(p);
        int r = launch_status();
        if (r < 0)
                return r;
        KVC_LAUNCH(lcompact_head, H, THREADS, 0, st)(p);
        return launch_status();
}
