/* ladder.cu: decode attention over a layer of several tiers of the precision ladder on the GPU
 * (kernels/ladder.c's ladder_attend is the reference; the contract is ladder.h's): the session's
 * dtype (f32, f16, bf16), q8, and the packed rotated tiers q4, q3, q2.
 *
 * The structure is attention.cu's split-K, two launches:
 *
 * 1. ladder_split, grid (KV head, split, query-head subgroup), 4 warps. The layer is one sequence
 *    of chunks of 16 slots, tier by tier in the logical order (the lowest tier first, tier 0
 *    last; a tier's chunks never straddle a block since T is a multiple of 16). A split takes a
 *    contiguous range of chunks and its warps take every 4th; a warp keeps the online-softmax
 *    state (m, l, acc) of the G query heads of its subgroup. Per chunk, as in attention.cu: lane
 *    2t + h takes token t and half of its key row, the halves are added with a shuffle, the
 *    log-weight added (-inf, or a set shared-mask bit, masks), the logit stored for the score
 *    pass, the recurrence applied, then each lane adds the weighted values of its D/32 channels.
 *    The tier decides how a row is read, with the dequantization fused:
 *      - the dtype: the elements as floats;
 *      - q8: the int8 codes against the query pre-scaled by the block's key scales, the value
 *        scale folded into the weight;
 *      - q4 / q3 / q2: the codes as centroids of the Lloyd-Max codebook (in shared memory),
 *        against the rotated query; the row's key scale multiplies the dot, the value scale is
 *        folded into the weight, and the values are summed in the rotated basis.
 *    Rotation: the rotated tiers come first in the sequence (ladder.h) and a warp takes its
 *    chunks in ascending order, so a warp's accumulator holds only rotated rows until its first
 *    unrotated chunk, where the warp rotates it back once (R^T is linear, so the softmax's
 *    rescalings commute with it), as attn_decode_fast_ladder does; a warp that ends in the rotated
 *    basis rotates back before the merge. The warp rotates the query itself when it enters the
 *    rotated part (x -> H diag(signs) x / sqrt(d), the reference's butterflies in the same order)
 *    into its own scratch (the q8 pre-scaled query's, unused by rotated chunks), so the shared
 *    memory is attention.cu's and a layer without rotated tokens pays nothing.
 * 2. ladder_combine, grid (KV head, token range): merges the splits per query head; block 0
 *    writes out; every block turns its range of stored logits into the attention averaged over
 *    the group and updates sum, ema and last of each slot in its tier's block (shared slots are
 *    never written).
 *
 * Against the reference: the same operations in float, up to the order of the sums, the dots in
 * float instead of double, the query pre-scaled by 1/sqrt(d) before the dot (and, for the rotated
 * tiers, before the rotation), and the rotation back of each warp's partial sum instead of the
 * whole sum: rounding only (tests/gpu/gpucheck.c states the tolerance).
 *
 * Not yet: speed work (no value prefetch, the packed codes read byte by byte; the decode of a
 * packed row is a loop, not attn_decode_fast_ladder's in-register lookup).
 */
#include <errno.h>
#include <float.h>
#include <string.h>

#include "common.cuh"
#include "cuda.h"

extern "C" {
#include "lloyd.h"
#include "tier.h"
}

namespace kvc {

namespace {

constexpr int WARPS = 4;
constexpr int CHUNK = 16;
constexpr uint32_t MAX_SPLITS = 256;

/* The tier kinds of a chunk: the block dtypes of common.cuh, and the packed tiers by their bits. */
enum : int { K_LM2 = 16 + 2, K_LM3 = 16 + 3, K_LM4 = 16 + 4 };

struct tier_params {
        uint8_t *const *blocks;
        uint64_t key, val, ks, vs, logw;
        side_offsets side;
        uint32_t n, first, c0; /* live tokens, first logical slot, first chunk */
        int kind, rotated;
};

struct ladder_params {
        tier_params tier[LADDER_TIERS];
        uint32_t n_tiers, T, n, group, n_splits, C;
        uint32_t n_shared, mask_stride;
        const uint8_t *shared_mask;
        const float *signs;
        float codebook[28]; /* 2 bits at 0, 3 bits at 4, 4 bits at 12 */
        const float *q;
        float *out;
        float *part_m, *part_l, *part_acc, *logits;
        float inv_sqrt_d, gamma;
        int update;
};

__host__ __device__ constexpr int codebook_at(int bits) {
        return bits == 2 ? 0 : bits == 3 ? 4 : 12;
}

struct chunk_ref {
        const tier_params *tp;
        const uint8_t *block;
        uint32_t in_block, slot0, cnt;
};

/* The tier of chunk c: the tiers' chunks are in logical order, tier n_tiers - 1 first. */
__device__ __forceinline__ uint32_t tier_of_chunk(const ladder_params &p, uint32_t c) {
        uint32_t t = 0;
        while (t + 1 < p.n_tiers && c < p.tier[t].c0)
                t++;
        return t;
}

__device__ __forceinline__ chunk_ref chunk_at(const ladder_params &p, uint32_t c) {
        const tier_params &tp = p.tier[tier_of_chunk(p, c)];
        uint32_t i = (c - tp.c0) * CHUNK, per_block = p.T;
        chunk_ref r;
        r.tp = &tp;
        r.block = tp.blocks[i / per_block];
        r.in_block = i % per_block;
        r.slot0 = tp.first + i;
        r.cnt = tp.n - i < (uint32_t)CHUNK ? tp.n - i : CHUNK;
        return r;
}

/* Code i of a packed row: lloyd_code. */
__device__ __forceinline__ uint32_t code_at(const uint8_t *codes, uint32_t i, uint32_t bits) {
        uint32_t bit = i * bits, byte = bit / 8, shift = bit % 8;
        uint32_t w = codes[byte] | (shift + bits > 8 ? (uint32_t)codes[byte + 1] << 8 : 0u);
        return (w >> shift) & ((1u << bits) - 1u);
}

/* The fast Walsh-Hadamard transform of the G rows of buf, by one warp: lloyd.c's butterflies,
 * span by span (each pair of a span is one lane's, so the order of the spans is all that counts). */
template <int D, int G> __device__ __forceinline__ void warp_fwht(float (*buf)[D]) {
        const int lane = threadIdx.x % 32;
        __syncwarp();
#pragma unroll 1
        for (int h = 1; h < D; h *= 2) {
                for (int i = lane; i < G * D / 2; i += 32) {
                        int r = i / (D / 2), k = i % (D / 2), j = (k / h) * 2 * h + k % h;
                        float a = buf[r][j], b = buf[r][j + h];
                        buf[r][j] = a + b;
                        buf[r][j + h] = a - b;
                }
                __syncwarp();
        }
}

/* buf <- R qs (lloyd_rotate of each row). */
template <int D, int G>
__device__ __forceinline__ void warp_rotate_query(const float (*qs)[D], float (*buf)[D], const float *signs) {
        const int lane = threadIdx.x % 32;
        const float norm = 1.0f / sqrtf((float)D);
        __syncwarp(); /* buf may still be read by the chunk before */
        for (int i = lane; i < G * D; i += 32)
                buf[i / D][i % D] = qs[i / D][i % D] * signs[i % D];
        warp_fwht<D, G>(buf);
        for (int i = lane; i < G * D; i += 32)
                buf[i / D][i % D] *= norm;
        __syncwarp();
}

/* acc <- R^T acc (lloyd_unrotate), the accumulators spread over the lanes, through buf. */
template <int D, int G>
__device__ __forceinline__ void warp_unrotate_acc(float acc[G][D / 32], float (*buf)[D], const float *signs) {
        constexpr int CPL = D / 32;
        const int lane = threadIdx.x % 32;
        const float norm = 1.0f / sqrtf((float)D);
        __syncwarp();
#pragma unroll
        for (int r = 0; r < G; r++)
#pragma unroll
                for (int k = 0; k < CPL; k++)
                        buf[r][lane * CPL + k] = acc[r][k];
        warp_fwht<D, G>(buf);
#pragma unroll
        for (int r = 0; r < G; r++)
#pragma unroll
                for (int k = 0; k < CPL; k++)
                        acc[r][k] = buf[r][lane * CPL + k] * (norm * signs[lane * CPL + k]);
        __syncwarp();
}

/* One chunk of tier kind K: the block dtypes (E_F32, E_F16, E_BF16, E_Q8) or K_LM2..4. qsrc is
 * the query (pre-scaled by 1 / sqrt(d); rotated for the packed tiers), qk a warp scratch of
 * [G][D] floats that INT8 chunks fill with the query times the key scales. */
template <int K, int D, int G> struct chunk_step {
        static constexpr bool LM = K >= K_LM2;
        static constexpr int BITS = LM ? K - 16 : 0;
        static constexpr int CPL = D / 32; /* value channels per lane */
        /* element bytes (BITS / 8 for LM) and bytes of a row */
        static constexpr uint64_t ROW_BYTES =
                LM ? (uint64_t)D * BITS / 8 : (uint64_t)D * elem_bytes_of<K>::value;

        __device__ __forceinline__ static void run(const ladder_params &p, const chunk_ref &ch, int g, int h0,
                                                   const float (*qsrc)[D], float (*qk)[D], float (*pw)[CHUNK],
                                                   const float *cb, float m[G], float l[G],
                                                   float acc[G][CPL]) {
                constexpr bool Q8 = K == E_Q8;
                const tier_params &tp = *ch.tp;
                const int lane = threadIdx.x % 32, t = lane >> 1, half = lane & 1;
                const uint64_t row_bytes = ROW_BYTES;
                const uint64_t head_slot = (uint64_t)g * p.T + ch.in_block;
                const uint8_t *keys = ch.block + tp.key + head_slot * row_bytes;
                const uint8_t *vals = ch.block + tp.val + head_slot * row_bytes;
                const float *logw = (const float *)(ch.block + tp.logw) + head_slot;
                const uint32_t cnt = ch.cnt;
                const bool valid = (uint32_t)t < cnt;

                if constexpr (Q8) { /* fused dequantization: q * kscale, per channel */
                        const float *ks = (const float *)(ch.block + tp.ks) + (uint64_t)g * D;
                        __syncwarp();
                        for (int c = lane; c < D; c += 32) {
                                float s = ks[c];
#pragma unroll
                                for (int r = 0; r < G; r++)
                                        qk[r][c] = qsrc[r][c] * s;
                        }
                        __syncwarp();
                        qsrc = qk;
                }

                float s[G];
#pragma unroll
                for (int r = 0; r < G; r++)
                        s[r] = 0.0f;
                const uint8_t *krow = keys + (uint64_t)(valid ? t : 0) * row_bytes;
                if constexpr (LM) {
                        /* groups of 8 codes, BITS bytes each; the halves take every other group */
                        for (int v = half; v < D / 8 && valid; v += 2) {
                                uint32_t w = 0;
#pragma unroll
                                for (int b = 0; b < BITS; b++)
                                        w |= (uint32_t)krow[v * BITS + b] << (8 * b);
                                float f[8];
#pragma unroll
                                for (int e = 0; e < 8; e++)
                                        f[e] = cb[(w >> (e * BITS)) & ((1u << BITS) - 1u)];
#pragma unroll
                                for (int r = 0; r < G; r++)
#pragma unroll
                                        for (int e = 0; e < 8; e++)
                                                s[r] += qsrc[r][v * 8 + e] * f[e];
                        }
                } else {
                        constexpr int EPV = 16 / elem_bytes_of<K>::value; /* elements per 16-byte vector */
                        constexpr int NV = (int)(ROW_BYTES / 16);         /* 16-byte vectors per key row */
#pragma unroll
                        for (int v = half; v < NV; v += 2) {
                                raw<16> kr;
                                if (valid)
                                        kr.load(krow + v * 16);
                                else
                                        kr.zero();
                                float f[EPV];
                                to_floats<K, EPV>(kr, f);
#pragma unroll
                                for (int r = 0; r < G; r++)
#pragma unroll
                                        for (int e = 0; e < EPV; e++)
                                                s[r] += qsrc[r][v * EPV + e] * f[e];
                        }
                }

                float lw = valid ? logw[t] : -INFINITY;
                uint32_t j = ch.slot0 + t;
                if (valid && j < p.n_shared &&
                    (p.shared_mask[(uint64_t)g * p.mask_stride + j / 8] >> (j % 8) & 1))
                        lw = -INFINITY; /* evicted by this session, kept for the others */
                float ks = 1.0f, vs = 0.0f;
                if constexpr (LM)
                        ks = valid ? ((const float *)(ch.block + tp.ks))[head_slot + t] : 0.0f;
                if constexpr (Q8 || LM)
                        vs = valid ? ((const float *)(ch.block + tp.vs))[head_slot + t] : 0.0f;
#pragma unroll
                for (int r = 0; r < G; r++) {
                        s[r] += __shfl_xor_sync(KVC_FULL_MASK, s[r], 1);
                        if constexpr (LM)
                                s[r] *= ks;
                        /* a -inf log-weight masks; +inf and NaN become the largest finite logit */
                        s[r] = lw == -INFINITY ? -INFINITY : fminf(s[r] + lw, FLT_MAX);
                        if (p.update && half == 0 && valid)
                                p.logits[(uint64_t)(h0 + r) * p.n + j] = s[r];
                        float m_new = fmaxf(m[r], warp_max(s[r]));
                        float pr = 0.0f, alpha = 1.0f;
                        if (m_new != -INFINITY) {
                                alpha = expf(m[r] - m_new);
                                pr = expf(s[r] - m_new);
                        }
                        /* lanes 2t and 2t+1 hold the same token: sum over one of each pair */
                        float psum = pr;
#pragma unroll
                        for (int o = 2; o < 32; o <<= 1)
                                psum += __shfl_xor_sync(KVC_FULL_MASK, psum, o);
                        l[r] = l[r] * alpha + psum;
                        m[r] = m_new;
#pragma unroll
                        for (int k = 0; k < CPL; k++)
                                acc[r][k] *= alpha;
                        if constexpr (Q8 || LM)
                                pr *= vs;
                        if (half == 0)
                                pw[r][t] = pr;
                }
                __syncwarp();

                for (uint32_t u = 0; u < cnt; u++) {
                        float f[CPL];
                        if constexpr (LM) {
                                const uint8_t *vrow = vals + u * row_bytes;
#pragma unroll
                                for (int k = 0; k < CPL; k++)
                                        f[k] = cb[code_at(vrow, lane * CPL + k, BITS)];
                        } else {
                                constexpr int VB = CPL * elem_bytes_of<K>::value; /* value bytes per lane */
                                raw<VB> r1;
                                r1.load(vals + u * row_bytes + lane * VB);
                                to_floats<K, CPL>(r1, f);
                        }
#pragma unroll
                        for (int r = 0; r < G; r++) {
                                float w = pw[r][u];
#pragma unroll
                                for (int k = 0; k < CPL; k++)
                                        acc[r][k] += w * f[k];
                        }
                }
                __syncwarp(); /* pw and qk are rewritten by the next chunk */
        }
};

template <int E, int D, int G> __global__ void __launch_bounds__(WARPS * 32) ladder_split(ladder_params p) {
        constexpr int CPL = D / 32;
        __shared__ __align__(16) float qs[G][D];
        /* per warp: the pre-scaled query of INT8 chunks or the rotated query, then the accumulators
         * for the merge */
        __shared__ __align__(16) float qk[WARPS][G][D];
        __shared__ float pw[WARPS][G][CHUNK];
        __shared__ float wm[WARPS][G], wl[WARPS][G];
        __shared__ float cb[28];

        const int g = blockIdx.x, split = blockIdx.y, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
        const int h0 = g * p.group + blockIdx.z * G;
        const float *signs = p.signs ? p.signs + (uint64_t)g * D : nullptr;
        for (int i = threadIdx.x; i < G * D; i += blockDim.x)
                qs[i / D][i % D] = p.q[(uint64_t)h0 * D + i] * p.inv_sqrt_d;
        for (int i = threadIdx.x; i < 28; i += blockDim.x)
                cb[i] = p.codebook[i];
        __syncthreads();

        float m[G], l[G], acc[G][CPL];
#pragma unroll
        for (int r = 0; r < G; r++) {
                m[r] = -INFINITY;
                l[r] = 0.0f;
#pragma unroll
                for (int k = 0; k < CPL; k++)
                        acc[r][k] = 0.0f;
        }
        bool rotated = false; /* acc (and qk[warp], the rotated query) in the rotated basis */
        uint32_t c_begin = (uint32_t)((uint64_t)p.C * split / p.n_splits);
        uint32_t c_end = (uint32_t)((uint64_t)p.C * (split + 1) / p.n_splits);
        for (uint32_t c = c_begin + warp; c < c_end; c += WARPS) {
                chunk_ref ch = chunk_at(p, c);
                if (ch.tp->rotated && !rotated) { /* the warp's first chunk: acc is zero */
                        warp_rotate_query<D, G>(qs, qk[warp], signs);
                        rotated = true;
                } else if (!ch.tp->rotated && rotated) {
                        warp_unrotate_acc<D, G>(acc, qk[warp], signs);
                        rotated = false;
                }
                float(*qw)[D] = qk[warp];
                switch (ch.tp->kind) {
                case E_Q8: chunk_step<E_Q8, D, G>::run(p, ch, g, h0, qs, qw, pw[warp], cb, m, l, acc); break;
                case K_LM2:
                        chunk_step<K_LM2, D, G>::run(p, ch, g, h0, qw, qw, pw[warp], cb + codebook_at(2), m,
                                                     l, acc);
                        break;
                case K_LM3:
                        chunk_step<K_LM3, D, G>::run(p, ch, g, h0, qw, qw, pw[warp], cb + codebook_at(3), m,
                                                     l, acc);
                        break;
                case K_LM4:
                        chunk_step<K_LM4, D, G>::run(p, ch, g, h0, qw, qw, pw[warp], cb + codebook_at(4), m,
                                                     l, acc);
                        break;
                default: chunk_step<E, D, G>::run(p, ch, g, h0, qs, qw, pw[warp], cb, m, l, acc); break;
                }
        }
        if (rotated)
                warp_unrotate_acc<D, G>(acc, qk[warp], signs);

        split_write_partial<D, G, WARPS>(p, h0, split, warp, lane, wm, wl, qk, m, l, acc);
}

constexpr int COMBINE_THREADS = 256;
constexpr uint32_t TOKENS_PER_COMBINE = 2048;

template <int D> __global__ void __launch_bounds__(COMBINE_THREADS) ladder_combine(ladder_params p) {
        KVC_DYNAMIC_SMEM(smem);
        float *ml = (float *)smem; /* M[group], L[group] */
        const int g = blockIdx.x;
        const uint32_t group = p.group;
        split_combine<D, COMBINE_THREADS>(p, ml);

        if (!p.update)
                return;
        uint32_t end = min(p.n, (blockIdx.y + 1) * TOKENS_PER_COMBINE);
        uint32_t begin = blockIdx.y * TOKENS_PER_COMBINE;
        if (begin < p.n_shared)
                begin = p.n_shared; /* shared slots: never written */
        for (uint32_t j = begin + threadIdx.x; j < end; j += COMBINE_THREADS) {
                float a = 0.0f;
                for (uint32_t r = 0; r < group; r++) {
                        float L = ml[group + r];
                        if (L > 0.0f)
                                a += expf(p.logits[((uint64_t)g * group + r) * p.n + j] - ml[r]) / L;
                }
                a /= (float)group;
                uint32_t t = 0;
                while (t + 1 < p.n_tiers && j < p.tier[t].first)
                        t++;
                const tier_params &tp = p.tier[t];
                uint32_t s = j - tp.first;
                uint8_t *b = tp.blocks[s / p.T];
                uint64_t at = ((uint64_t)g * p.T + s % p.T) * 4u;
                float *sum = (float *)(b + tp.side.off[1] + at), *ema = (float *)(b + tp.side.off[2] + at);
                float *last = (float *)(b + tp.side.off[3] + at);
                *sum += a;
                *ema = p.gamma * *ema + (1.0f - p.gamma) * a;
                *last = a;
        }
}

uint32_t chunk_count(const struct ladder_layer *M) {
        uint32_t c = 0;
        for (uint32_t t = 0; t < M->n_tiers; t++)
                c += div_up(M->n[t], CHUNK);
        return c;
}

uint32_t max_splits(uint32_t C) {
        uint32_t s = C / 8;
        return s < 1 ? 1 : s > MAX_SPLITS ? MAX_SPLITS : s;
}

struct workspace_layout {
        size_t part_m, part_l, part_acc, logits, bytes;
};

workspace_layout workspace_of(const struct ladder_layer *M, uint32_t n_heads) {
        uint64_t S = max_splits(chunk_count(M)), D = M->layout[0]->head_dim;
        workspace_layout w;
        w.part_m = 0;
        w.part_l = align_up(w.part_m + n_heads * S * 4, 256);
        w.part_acc = align_up(w.part_l + n_heads * S * 4, 256);
        w.logits = align_up(w.part_acc + n_heads * S * D * 4, 256);
        w.bytes = align_up(w.logits + (uint64_t)n_heads * ladder_tokens(M) * 4, 256);
        return w;
}

template <int E, int D, int G> void launch_split(dim3 grid, const ladder_params &p, cudaStream_t st) {
        auto *kernel = ladder_split<E, D, G>;
        KVC_LAUNCH(kernel, grid, WARPS * 32, 0, st)(p);
}

template <int E, int D> int launch_g(uint32_t G, dim3 grid, const ladder_params &p, cudaStream_t st) {
        switch (G) {
        case 1: launch_split<E, D, 1>(grid, p, st); break;
        case 2: launch_split<E, D, 2>(grid, p, st); break;
        case 4: launch_split<E, D, 4>(grid, p, st); break;
        case 8: launch_split<E, D, 8>(grid, p, st); break;
        default: return -EINVAL;
        }
        return 0;
}

template <int E> int launch_d(uint32_t D, uint32_t G, dim3 grid, const ladder_params &p, cudaStream_t st) {
        switch (D) {
        case 64: return launch_g<E, 64>(G, grid, p, st);
        case 128: return launch_g<E, 128>(G, grid, p, st);
        case 256: return launch_g<E, 256>(G, grid, p, st);
        }
        return -EINVAL;
}

int kind_of(enum block_dtype dt) {
        switch (dt) {
        case BLOCK_DTYPE_Q4: return K_LM4;
        case BLOCK_DTYPE_Q3: return K_LM3;
        case BLOCK_DTYPE_Q2: return K_LM2;
        default: return (int)dt;
        }
}

/* The device geometry of M's tiers; -EINVAL for what the kernels do not handle. */
int params_of(const struct ladder_layer *M, uint32_t n_heads, ladder_params *p) {
        if (ladder_check(M) < 0 || ladder_tokens(M) == 0)
                return -EINVAL;
        uint32_t H = M->layout[0]->n_kv_heads, D = M->layout[0]->head_dim, T = M->layout[0]->block_tokens;
        if (n_heads == 0 || n_heads % H || T % CHUNK || (D != 64 && D != 128 && D != 256))
                return -EINVAL;
        memset(p, 0, sizeof(*p));
        uint32_t first = 0, c0 = 0;
        for (uint32_t t = M->n_tiers; t-- > 0;) {
                const struct block_layout *l = M->layout[t];
                tier_params &tp = p->tier[t];
                tp.blocks = M->blocks[t];
                tp.key = l->key_offset;
                tp.val = l->value_offset;
                tp.ks = l->kscale_offset;
                tp.vs = l->vscale_offset;
                tp.logw = l->logw_offset;
                tp.side = side_offsets_of(l);
                tp.n = M->n[t];
                tp.first = first;
                tp.c0 = c0;
                tp.kind = kind_of(l->dtype);
                tp.rotated = tier_row(l->dtype)->rotated;
                first += M->n[t];
                c0 += div_up(M->n[t], CHUNK);
        }
        for (int bits = 2; bits <= 4; bits++)
                memcpy(p->codebook + codebook_at(bits), lloyd_codebook(bits), sizeof(float) << bits);
        p->n_tiers = M->n_tiers;
        p->T = T;
        p->n = first;
        p->C = c0;
        p->group = n_heads / H;
        p->n_shared = M->n_shared;
        p->mask_stride = M->mask_stride;
        p->shared_mask = M->shared_mask;
        p->signs = M->signs;
        p->inv_sqrt_d = 1.0f / sqrtf((float)D);
        return 0;
}

} // namespace

} // namespace kvc

extern "C" size_t kvc_cuda_ladder_attn_workspace_bytes(const struct ladder_layer *M, uint32_t n_heads) {
        return kvc::workspace_of(M, n_heads).bytes;
}

extern "C" int kvc_cuda_attn_decode_ladder(const struct ladder_layer *M, const float *q, float *out,
                                           uint32_t n_heads, float ema_gamma, int update_scores,
                                           void *workspace, size_t workspace_bytes, void *stream) {
        using namespace kvc;
        ladder_params p;
        if (!q || !out || !workspace || params_of(M, n_heads, &p) < 0)
                return -EINVAL;
        workspace_layout w = workspace_of(M, n_heads);
        if (workspace_bytes < w.bytes)
                return -EINVAL;
        uint32_t H = M->layout[0]->n_kv_heads, D = M->layout[0]->head_dim;

        int dev = 0, n_sm = 0;
        if (cudaGetDevice(&dev) != cudaSuccess ||
            cudaDeviceGetAttribute(&n_sm, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess)
                return -EIO;
        uint32_t group = p.group, G = group % 8 == 0 ? 8 : group % 4 == 0 ? 4 : group % 2 == 0 ? 2 : 1;
        uint32_t n_sub = group / G, want = div_up(4u * (uint32_t)n_sm, (uint64_t)H * n_sub);
        uint32_t most = max_splits(p.C);
        p.n_splits = want < 1 ? 1 : want > most ? most : want;

        uint8_t *ws = (uint8_t *)workspace;
        p.q = q;
        p.out = out;
        p.part_m = (float *)(ws + w.part_m);
        p.part_l = (float *)(ws + w.part_l);
        p.part_acc = (float *)(ws + w.part_acc);
        p.logits = (float *)(ws + w.logits);
        p.gamma = ema_gamma;
        p.update = update_scores != 0;

        cudaStream_t st = (cudaStream_t)stream;
        dim3 grid(H, p.n_splits, n_sub);
        int r;
        switch (M->layout[0]->dtype) {
        case BLOCK_DTYPE_F32: r = launch_d<E_F32>(D, G, grid, p, st); break;
        case BLOCK_DTYPE_F16: r = launch_d<E_F16>(D, G, grid, p, st); break;
        case BLOCK_DTYPE_BF16: r = launch_d<E_BF16>(D, G, grid, p, st); break;
        default: return -EINVAL;
        }
        if (r < 0)
                return r;
        if ((r = launch_status()) < 0)
                return r;
        dim3 cgrid(H, update_scores ? div_up(p.n, TOKENS_PER_COMBINE) : 1);
        size_t smem = 2 * (size_t)group * sizeof(float);
        auto *combine = D == 64 ? ladder_combine<64> : D == 128 ? ladder_combine<128> : ladder_combine<256>;
        KVC_LAUNCH(combine, cgrid, COMBINE_THREADS, smem, st)(p);
        return launch_status();
}

extern "C" int kvc_cuda_attn_rows_ladder(const struct ladder_layer *M, uint32_t n_rows, const float *q,
                                         float *out, uint32_t n_heads, float ema_gamma, int update_scores,
                                         void *workspace, size_t workspace_bytes, void *stream) {
        if (ladder_check(M) < 0 || n_rows == 0 || n_rows > M->n[0] || M->n_shared > M->n[0] - n_rows)
                return -EINVAL;
        uint64_t row = (uint64_t)n_heads * M->layout[0]->head_dim;
        struct ladder_layer P = *M;
        for (uint32_t r = 0; r < n_rows; r++) {
                P.n[0] = M->n[0] - (n_rows - 1 - r);
                int e = kvc_cuda_attn_decode_ladder(&P, q + r * row, out + r * row, n_heads, ema_gamma,
                                                    update_scores, workspace, workspace_bytes, stream);
                if (e < 0)
                        return e;
        }
        return 0;
}
