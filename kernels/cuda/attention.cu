/* attention.cu: decode attention over a mixed INT8 / full-precision layer on the GPU
 * (kernels/mixed.c's attn_decode_mixed is the reference; the semantics are attention.h's).
 *
 * Split-K (flash-decoding), two launches:
 *
 * 1. attn_split, grid (KV head, split, query-head subgroup), 4 warps. The layer is a sequence of
 *    chunks of 16 slots (INT8 chunks, then full-precision ones; a block of T = 16k slots is k
 *    chunks); split s takes a contiguous range of chunks, its warps take every 4th. A warp keeps
 *    the online-softmax state (m, l, acc) of the G query heads of its subgroup, so each key and
 *    value is read and dequantized once for all of them (grouped-query attention). Per chunk:
 *      - it first issues the loads of all 16 value rows (one lane owns D/32 channels), so that
 *        they are in flight while the keys are processed;
 *      - keys: lane 2t + h takes token t and every other 16-byte vector of its row; for an INT8
 *        chunk the query was pre-scaled by the block's key scales (per channel, in shared
 *        memory), so the integer codes are dotted with it directly: fused dequantization;
 *      - the two halves are added with one shuffle, the log-weight added (-inf masks), the logit
 *        stored for the score pass, and the usual recurrence applied: m' = max(m, max_t s_t),
 *        alpha = exp(m - m'), l' = alpha l + sum_t p_t, acc' = alpha acc + sum_t p_t v_t, with
 *        the per-token value scale folded into p_t for an INT8 chunk.
 *    The 4 warps' states are merged through shared memory and the block writes one partial
 *    (m, l, acc[D]) per query head and split.
 * 2. attn_combine, grid (KV head, token range): merges the splits per query head (out = sum_s
 *    exp(m_s - M) acc_s / sum_s exp(m_s - M) l_s; zero when everything was masked), block 0 writes
 *    out; every block then turns its range of stored logits into the attention averaged over the
 *    group and updates sum, ema and last in the blocks.
 *
 * Bytes: an INT8 chunk is half the key and value bytes of an F16 one (plus 4 bytes of scale per
 * token and the key scales once per block), and the decode is bandwidth bound, which is what
 * makes INT8 faster. The split count aims at two blocks per SM with at least 8 chunks per block,
 * so short caches do not drown in partials.
 */
#include <errno.h>
#include <float.h>

#include "common.cuh"
#include "cuda.h"

namespace kvc {

namespace {

constexpr int WARPS = 4;
constexpr int CHUNK = 16;
constexpr uint32_t MAX_SPLITS = 256;

struct attn_params {
        uint8_t *const *q8_blocks;
        uint8_t *const *fp_blocks;
        uint64_t q_key, q_val, q_ks, q_vs, q_logw;
        uint64_t f_key, f_val, f_logw;
        side_offsets q_side, f_side;
        uint32_t T, n_q8, n, group, n_splits, cq, cf;
        const float *q;
        float *out;
        float *part_m, *part_l, *part_acc, *logits;
        float inv_sqrt_d, gamma;
        int update;
};

/* Which chunk of the sequence: its block, first slot in the block, first slot in the sequence,
 * live count; INT8 when q8. */
struct chunk_ref {
        const uint8_t *block;
        uint32_t in_block, slot0, cnt;
};

__device__ __forceinline__ chunk_ref chunk_at(const attn_params &p, uint32_t c, bool q8) {
        chunk_ref r;
        uint32_t per_block = p.T / CHUNK;
        if (q8) {
                r.block = p.q8_blocks[c / per_block];
                r.in_block = (c % per_block) * CHUNK;
                r.slot0 = c * CHUNK;
                r.cnt = min((uint32_t)CHUNK, p.n_q8 - r.slot0);
        } else {
                uint32_t f = c - p.cq;
                r.block = p.fp_blocks[f / per_block];
                r.in_block = (f % per_block) * CHUNK;
                r.slot0 = p.n_q8 + f * CHUNK;
                r.cnt = min((uint32_t)CHUNK, p.n - r.slot0);
        }
        return r;
}

template <int KE, int D, int G> struct chunk_step {
        static constexpr int EB = elem_bytes_of<KE>::value;
        static constexpr int CPL = D / 32;                  /* value channels per lane */
        static constexpr int VB = CPL * EB;                 /* value bytes per lane and token */
        static constexpr int EPV = 16 / EB;                 /* key elements per 16-byte vector */
        static constexpr int NV = D * EB / 16;              /* 16-byte vectors per key row */
        static constexpr bool PREFETCH = VB * CHUNK <= 256; /* at most 64 registers of values */

        __device__ __forceinline__ static void run(const attn_params &p, const chunk_ref &ch, int g, int h0,
                                                   const float (*qs)[D], float (*qk)[D], float (*pw)[CHUNK],
                                                   float m[G], float l[G], float acc[G][CPL]) {
                constexpr bool Q8 = KE == E_Q8;
                const int lane = threadIdx.x % 32, t = lane >> 1, half = lane & 1;
                const uint64_t row_bytes = (uint64_t)D * EB;
                const uint64_t head_slot = (uint64_t)g * p.T + ch.in_block;
                const uint8_t *keys = ch.block + (Q8 ? p.q_key : p.f_key) + head_slot * row_bytes;
                const uint8_t *vals = ch.block + (Q8 ? p.q_val : p.f_val) + head_slot * row_bytes;
                const float *logw = (const float *)(ch.block + (Q8 ? p.q_logw : p.f_logw)) + head_slot;
                const uint32_t cnt = ch.cnt;
                const bool valid = (uint32_t)t < cnt;

                raw<VB> vr[PREFETCH ? CHUNK : 1];
                if constexpr (PREFETCH) {
#pragma unroll
                        for (int u = 0; u < CHUNK; u++) {
                                if ((uint32_t)u < cnt)
                                        vr[u].load(vals + u * row_bytes + lane * VB);
                                else
                                        vr[u].zero();
                        }
                }

                const float(*qsrc)[D] = qs;
                if constexpr (Q8) { /* fused dequantization: q * kscale, per channel */
                        const float *ks = (const float *)(ch.block + p.q_ks) + (uint64_t)g * D;
#pragma unroll
                        for (int c = lane; c < D; c += 32) {
                                float s = ks[c];
#pragma unroll
                                for (int r = 0; r < G; r++)
                                        qk[r][c] = qs[r][c] * s;
                        }
                        __syncwarp();
                        qsrc = qk;
                }

                float s[G];
#pragma unroll
                for (int r = 0; r < G; r++)
                        s[r] = 0.0f;
                const uint8_t *krow = keys + (uint64_t)(valid ? t : 0) * row_bytes;
#pragma unroll
                for (int v = half; v < NV; v += 2) {
                        raw<16> kr;
                        if (valid)
                                kr.load(krow + v * 16);
                        else
                                kr.zero();
                        float f[EPV];
                        to_floats<KE, EPV>(kr, f);
#pragma unroll
                        for (int r = 0; r < G; r++) {
                                const float4 *q4 = reinterpret_cast<const float4 *>(&qsrc[r][v * EPV]);
#pragma unroll
                                for (int e = 0; e < EPV / 4; e++) {
                                        float4 qv = q4[e];
                                        s[r] += qv.x * f[4 * e] + qv.y * f[4 * e + 1] + qv.z * f[4 * e + 2] +
                                                qv.w * f[4 * e + 3];
                                }
                        }
                }

                float lw = valid ? logw[t] : -INFINITY;
                float vs = 0.0f;
                if constexpr (Q8)
                        vs = valid ? ((const float *)(ch.block + p.q_vs))[head_slot + t] : 0.0f;
#pragma unroll
                for (int r = 0; r < G; r++) {
                        s[r] += __shfl_xor_sync(KVC_FULL_MASK, s[r], 1);
                        /* a -inf log-weight masks; +inf and NaN become the largest finite logit */
                        s[r] = lw == -INFINITY ? -INFINITY : fminf(s[r] + lw, FLT_MAX);
                        if (p.update && half == 0 && valid)
                                p.logits[(uint64_t)(h0 + r) * p.n + ch.slot0 + t] = s[r];
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
                        if constexpr (Q8)
                                pr *= vs;
                        if (half == 0)
                                pw[r][t] = pr;
                }
                __syncwarp();

#pragma unroll
                for (int u = 0; u < CHUNK; u++) {
                        if ((uint32_t)u >= cnt)
                                break;
                        float f[CPL];
                        if constexpr (PREFETCH) {
                                to_floats<KE, CPL>(vr[u], f);
                        } else {
                                raw<VB> r1;
                                r1.load(vals + u * row_bytes + lane * VB);
                                to_floats<KE, CPL>(r1, f);
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

template <int E, int D, int G> __global__ void __launch_bounds__(WARPS * 32) attn_split(attn_params p) {
        constexpr int CPL = D / 32;
        __shared__ __align__(16) float qs[G][D];
        /* per warp: the pre-scaled query of INT8 chunks, then the accumulators for the merge */
        __shared__ __align__(16) float qk[WARPS][G][D];
        __shared__ float pw[WARPS][G][CHUNK];
        __shared__ float wm[WARPS][G], wl[WARPS][G];

        const int g = blockIdx.x, split = blockIdx.y, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
        const int h0 = g * p.group + blockIdx.z * G;
        for (int i = threadIdx.x; i < G * D; i += blockDim.x)
                qs[i / D][i % D] = p.q[(uint64_t)h0 * D + i] * p.inv_sqrt_d;
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
        uint32_t C = p.cq + p.cf;
        uint32_t c_begin = (uint32_t)((uint64_t)C * split / p.n_splits);
        uint32_t c_end = (uint32_t)((uint64_t)C * (split + 1) / p.n_splits);
        for (uint32_t c = c_begin + warp; c < c_end; c += WARPS) {
                if (c < p.cq)
                        chunk_step<E_Q8, D, G>::run(p, chunk_at(p, c, true), g, h0, qs, qk[warp], pw[warp], m,
                                                    l, acc);
                else
                        chunk_step<E, D, G>::run(p, chunk_at(p, c, false), g, h0, qs, qk[warp], pw[warp], m,
                                                 l, acc);
        }

        split_write_partial<D, G, WARPS>(p, h0, split, warp, lane, wm, wl, qk, m, l, acc);
}

constexpr int COMBINE_THREADS = 256;
constexpr uint32_t TOKENS_PER_COMBINE = 2048;

template <int D> __global__ void __launch_bounds__(COMBINE_THREADS) attn_combine(attn_params p) {
        KVC_DYNAMIC_SMEM(smem);
        float *ml = (float *)smem; /* M[group], L[group] */
        const int g = blockIdx.x;
        const uint32_t group = p.group;
        split_combine<D, COMBINE_THREADS>(p, ml);

        if (!p.update)
                return;
        uint32_t end = min(p.n, (blockIdx.y + 1) * TOKENS_PER_COMBINE);
        for (uint32_t j = blockIdx.y * TOKENS_PER_COMBINE + threadIdx.x; j < end; j += COMBINE_THREADS) {
                float a = 0.0f;
                for (uint32_t r = 0; r < group; r++) {
                        float L = ml[group + r];
                        if (L > 0.0f)
                                a += expf(p.logits[((uint64_t)g * group + r) * p.n + j] - ml[r]) / L;
                }
                a /= (float)group;
                bool q8 = j < p.n_q8;
                uint32_t s = q8 ? j : j - p.n_q8;
                uint8_t *b = (q8 ? p.q8_blocks : p.fp_blocks)[s / p.T];
                const side_offsets &so = q8 ? p.q_side : p.f_side;
                uint64_t at = ((uint64_t)g * p.T + s % p.T) * 4u;
                float *sum = (float *)(b + so.off[1] + at), *ema = (float *)(b + so.off[2] + at);
                float *last = (float *)(b + so.off[3] + at);
                *sum += a;
                *ema = p.gamma * *ema + (1.0f - p.gamma) * a;
                *last = a;
        }
}

struct split_plan {
        uint32_t G, n_sub, n_splits;
};

uint32_t chunk_count(const struct mixed_layer *M) {
        return div_up(M->n_q8, CHUNK) + div_up(M->n_tokens - M->n_q8, CHUNK);
}

uint32_t max_splits(uint32_t C) {
        uint32_t s = C / 8;
        return s < 1 ? 1 : s > MAX_SPLITS ? MAX_SPLITS : s;
}

split_plan plan_splits(const struct mixed_layer *M, uint32_t n_heads, int n_sm) {
        uint32_t H = M->q8->n_kv_heads, group = n_heads / H;
        split_plan sp;
        sp.G = group % 8 == 0 ? 8 : group % 4 == 0 ? 4 : group % 2 == 0 ? 2 : 1;
        sp.n_sub = group / sp.G;
        uint32_t want = div_up(4u * (uint32_t)n_sm, (uint64_t)H * sp.n_sub);
        uint32_t most = max_splits(chunk_count(M));
        sp.n_splits = want < 1 ? 1 : want > most ? most : want;
        return sp;
}

struct workspace_layout {
        size_t part_m, part_l, part_acc, logits, bytes;
};

workspace_layout workspace_of(const struct mixed_layer *M, uint32_t n_heads) {
        uint64_t S = max_splits(chunk_count(M)), D = M->q8->head_dim;
        workspace_layout w;
        w.part_m = 0;
        w.part_l = align_up(w.part_m + n_heads * S * 4, 256);
        w.part_acc = align_up(w.part_l + n_heads * S * 4, 256);
        w.logits = align_up(w.part_acc + n_heads * S * D * 4, 256);
        w.bytes = align_up(w.logits + (uint64_t)n_heads * M->n_tokens * 4, 256);
        return w;
}

template <int E, int D, int G> void launch_split(dim3 grid, const attn_params &p, cudaStream_t st) {
        auto *kernel = attn_split<E, D, G>;
        KVC_LAUNCH(kernel, grid, WARPS * 32, 0, st)(p);
}

template <int E, int D> int launch_g(uint32_t G, dim3 grid, const attn_params &p, cudaStream_t st) {
        switch (G) {
        case 1: launch_split<E, D, 1>(grid, p, st); break;
        case 2: launch_split<E, D, 2>(grid, p, st); break;
        case 4: launch_split<E, D, 4>(grid, p, st); break;
        case 8: launch_split<E, D, 8>(grid, p, st); break;
        default: return -EINVAL;
        }
        return 0;
}

template <int E> int launch_d(uint32_t D, uint32_t G, dim3 grid, const attn_params &p, cudaStream_t st) {
        switch (D) {
        case 64: return launch_g<E, 64>(G, grid, p, st);
        case 128: return launch_g<E, 128>(G, grid, p, st);
        case 256: return launch_g<E, 256>(G, grid, p, st);
        }
        return -EINVAL;
}

} // namespace

} // namespace kvc

extern "C" size_t kvc_cuda_attn_workspace_bytes(const struct mixed_layer *M, uint32_t n_heads) {
        return kvc::workspace_of(M, n_heads).bytes;
}

extern "C" int kvc_cuda_attn_decode_mixed(const struct mixed_layer *M, const float *q, float *out,
                                          uint32_t n_heads, float ema_gamma, int update_scores,
                                          void *workspace, size_t workspace_bytes, void *stream) {
        using namespace kvc;
        if (mixed_layer_check(M) < 0 || M->n_tokens == 0 || !q || !out || !workspace)
                return -EINVAL;
        uint32_t H = M->q8->n_kv_heads, D = M->q8->head_dim, T = M->q8->block_tokens;
        if (n_heads == 0 || n_heads % H || T % CHUNK || (D != 64 && D != 128 && D != 256))
                return -EINVAL;
        workspace_layout w = workspace_of(M, n_heads);
        if (workspace_bytes < w.bytes)
                return -EINVAL;

        int dev = 0, n_sm = 0;
        if (cudaGetDevice(&dev) != cudaSuccess ||
            cudaDeviceGetAttribute(&n_sm, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess)
                return -EIO;
        split_plan sp = plan_splits(M, n_heads, n_sm);

        uint8_t *ws = (uint8_t *)workspace;
        attn_params p;
        p.q8_blocks = M->q8_blocks;
        p.fp_blocks = M->fp_blocks;
        p.q_key = M->q8->key_offset;
        p.q_val = M->q8->value_offset;
        p.q_ks = M->q8->kscale_offset;
        p.q_vs = M->q8->vscale_offset;
        p.q_logw = M->q8->logw_offset;
        p.f_key = M->fp->key_offset;
        p.f_val = M->fp->value_offset;
        p.f_logw = M->fp->logw_offset;
        p.q_side = side_offsets_of(M->q8);
        p.f_side = side_offsets_of(M->fp);
        p.T = T;
        p.n_q8 = M->n_q8;
        p.n = M->n_tokens;
        p.group = n_heads / H;
        p.n_splits = sp.n_splits;
        p.cq = div_up(M->n_q8, CHUNK);
        p.cf = div_up(M->n_tokens - M->n_q8, CHUNK);
        p.q = q;
        p.out = out;
        p.part_m = (float *)(ws + w.part_m);
        p.part_l = (float *)(ws + w.part_l);
        p.part_acc = (float *)(ws + w.part_acc);
        p.logits = (float *)(ws + w.logits);
        p.inv_sqrt_d = 1.0f / sqrtf((float)D);
        p.gamma = ema_gamma;
        p.update = update_scores != 0;

        cudaStream_t st = (cudaStream_t)stream;
        dim3 grid(H, sp.n_splits, sp.n_sub);
        int r;
        switch (M->fp->dtype) {
        case BLOCK_DTYPE_F32: r = launch_d<E_F32>(D, sp.G, grid, p, st); break;
        case BLOCK_DTYPE_F16: r = launch_d<E_F16>(D, sp.G, grid, p, st); break;
        case BLOCK_DTYPE_BF16: r = launch_d<E_BF16>(D, sp.G, grid, p, st); break;
        default: return -EINVAL;
        }
        if (r < 0)
                return r;
        if ((r = launch_status()) < 0)
                return r;
        dim3 cgrid(H, update_scores ? div_up(M->n_tokens, TOKENS_PER_COMBINE) : 1);
        size_t smem = 2 * (size_t)p.group * sizeof(float);
        auto *combine = D == 64 ? attn_combine<64> : D == 128 ? attn_combine<128> : attn_combine<256>;
        KVC_LAUNCH(combine, cgrid, COMBINE_THREADS, smem, st)(p);
        return launch_status();
}
