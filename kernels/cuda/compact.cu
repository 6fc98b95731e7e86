/* compact.cu: compaction and quantization of a mixed INT8 / full-precision layer on the GPU, in
 * place and in one pass (kernels/mixed.c's compact_mixed is the reference; same bytes).
 *
 * The work is cut into chunks: one destination block of one KV head. The INT8 destination
 * blocks come first, then the full-precision ones, in slot order (chunk number: block * H +
 * head, the fp ones after all INT8 ones). A chunk reads its sources (anywhere at or after its own
 * slots, see mixed.c), and writes its own block ("its storage").
 *
 * The race. A parallel gather in place is wrong when a chunk overwrites its storage while another
 * chunk still has to read a source there: with keep = 1, 2, 3, ... every block is read by the
 * chunk before it. Two cheap ways out cost bandwidth: out of place into scratch and back (twice the
 * traffic), or two kernels with everything staged in between. Instead, each chunk reads all its
 * sources into shared memory, publishes "read done", waits until every other chunk that reads its
 * storage has published the same, and only then writes. Why that cannot deadlock:
 *  - sources are strictly increasing with src(i) >= i, so every chunk that reads a storage comes
 *    at or before the chunk that writes it in chunk order (proof in mixed.c: an INT8 block d is
 *    read only by INT8 destinations < (d + 1)T, an fp block j only by INT8 destinations and fp
 *    destinations with index < (j + 1)T);
 *  - chunks are not taken by blockIdx (the hardware may schedule blocks in any order) but by a
 *    ticket from an atomic counter, in chunk order. A block that waits for a smaller ticket waits
 *    for a block that is already running and that publishes before it waits for anything.
 * Which chunks read a given storage is computed by compact_prep, one thread per (head, new slot),
 * as a range [min, max] per storage (the readers of a storage are consecutive chunks); the same
 * kernel checks the keep-set (ascending, below base, no INT8 token past new_q8) and, when it is
 * wrong, sets the status so that no chunk moves anything. One memset, two kernels per call;
 * every byte of KV is read once and written once, as in a copy.
 *
 * Chunk work. An fp chunk copies rows (16-byte vectors) and side words. An INT8 chunk gathers its
 * keys as floats (INT8 sources dequantized with their block's scales, fp sources converted), its
 * value codes and scales (INT8 sources as they are, fp ones quantized per token by a warp), and
 * its side words; computes the block's key scales over exactly those tokens; requantizes the keys.
 * A chunk whose tokens are those it already holds (same slots, same count) is skipped, as on the
 * CPU.
 */
#include <errno.h>

#include <cuda/atomic>

#include "common.cuh"
#include "cuda.h"

namespace kvc {

namespace {

constexpr int THREADS = 128;
constexpr int WARPS = THREADS / 32;
constexpr uint32_t MAX_T = 64;
constexpr uint32_t MAX_TD = 4096; /* block_tokens * head_dim: keeps a chunk within 48 KiB of shared memory */
constexpr uint32_t NONE = 0xffffffffu;
constexpr size_t HEADER_BYTES = 16; /* int32 status, uint32 ticket, padding */

struct compact_params {
        uint8_t *const *q8_blocks;
        uint8_t *const *fp_blocks;
        uint64_t q_key, q_val, q_ks, q_vs;
        uint64_t f_key, f_val;
        side_offsets q_side, f_side;
        uint32_t f_row_bytes;
        uint32_t T, H, D;
        uint32_t n_q8, n, new_q8, new_len;
        const uint32_t *keep;
        uint32_t kc, base;
        int per_head;
        uint32_t q8_dest_blocks, fp_dest_blocks, nq_chunks, n_chunks;
        int32_t *status;
        uint32_t *ticket, *flags, *rmin_not, *rmax1;
};

__device__ __forceinline__ uint32_t src_of(const compact_params &p, uint32_t h, uint32_t i) {
        return i < p.kc ? p.keep[(p.per_head ? (uint64_t)h * p.kc : 0) + i] : p.base + (i - p.kc);
}

/* The chunk that writes new slot i of head h. */
__device__ __forceinline__ uint32_t reader_chunk(const compact_params &p, uint32_t h, uint32_t i) {
        return i < p.new_q8 ? (i / p.T) * p.H + h : p.nq_chunks + ((i - p.new_q8) / p.T) * p.H + h;
}

/* The chunk whose storage holds old slot s of head h, or NONE if no chunk writes that block. */
__device__ __forceinline__ uint32_t storage_chunk(const compact_params &p, uint32_t h, uint32_t s) {
        if (s < p.n_q8) {
                uint32_t b = s / p.T;
                return b < p.q8_dest_blocks ? b * p.H + h : NONE;
        }
        uint32_t b = (s - p.n_q8) / p.T;
        return b < p.fp_dest_blocks ? p.nq_chunks + b * p.H + h : NONE;
}

__global__ void compact_prep(compact_params p) {
        uint64_t total = (uint64_t)p.H * p.new_len;
        for (uint64_t x = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; x < total;
             x += (uint64_t)gridDim.x * blockDim.x) {
                uint32_t h = (uint32_t)(x / p.new_len), i = (uint32_t)(x % p.new_len);
                uint32_t s = src_of(p, h, i);
                bool bad = i >= p.new_q8 && s < p.n_q8; /* an INT8 token would become fp */
                if (i < p.kc)
                        bad |= s >= p.base || (i > 0 && src_of(p, h, i - 1) >= s);
                if (bad) {
                        atomicExch(p.status, -EINVAL);
                        continue;
                }
                uint32_t rd = reader_chunk(p, h, i), st = storage_chunk(p, h, s);
                if (st == NONE || st == rd)
                        continue;
                /* one atomic at each end of a run of slots with the same (reader, storage) */
                bool first = i == 0 || reader_chunk(p, h, i - 1) != rd ||
                             storage_chunk(p, h, src_of(p, h, i - 1)) != st;
                bool last = i + 1 == p.new_len || reader_chunk(p, h, i + 1) != rd ||
                            storage_chunk(p, h, src_of(p, h, i + 1)) != st;
                if (first)
                        atomicMax(&p.rmin_not[st], ~rd);
                if (last)
                        atomicMax(&p.rmax1[st], rd + 1);
        }
}

/* Called by thread 0 after a __syncthreads that follows the block's last read of its sources. */
__device__ __forceinline__ void publish_read_done(uint32_t *flag) {
        __threadfence();
        cuda::atomic_ref<uint32_t, cuda::thread_scope_device> f(*flag);
        f.store(1u, cuda::memory_order_release);
}

/* Thread 0 waits until every other chunk that reads this chunk's storage has read it; then the
 * whole block may write. */
__device__ void wait_for_readers(const compact_params &p, uint32_t ticket) {
        if (threadIdx.x == 0) {
                uint32_t hi = p.rmax1[ticket];
                if (hi) {
                        for (uint32_t c = ~p.rmin_not[ticket]; c < hi; c++) {
                                if (c == ticket)
                                        continue;
                                cuda::atomic_ref<uint32_t, cuda::thread_scope_device> f(p.flags[c]);
                                while (f.load(cuda::memory_order_acquire) == 0)
                                        __nanosleep(100);
                        }
                }
                __threadfence();
        }
        __syncthreads();
}

/* Code k of a zeroed group. */
template <int CPL> __device__ __forceinline__ void set_code(raw<CPL> &r, int k, int q) {
        r.w[k / 4] |= (uint32_t)(q & 0xff) << (8 * (k % 4));
}

/* An INT8 destination block: gather, publish, compute its key scales, wait, requantize, write. */
template <int E, int CPL>
__device__ void q8_chunk(const compact_params &p, uint32_t ticket, uint32_t h, uint32_t blk, uint32_t cnt,
                         const uint32_t *src, uint8_t *smem) {
        constexpr int D = 32 * CPL, EB = elem_bytes_of<E>::value;
        const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
        const uint32_t T = p.T;
        float *kf = (float *)smem;             /* [T][D] */
        int8_t *vq = (int8_t *)(kf + T * D);   /* [T][D] */
        float *vs = (float *)(vq + T * D);     /* [T] */
        uint32_t *side = (uint32_t *)(vs + T); /* [T][5] */
        float *ks = (float *)(side + 5 * T);   /* [D] */

        for (uint32_t t = warp; t < cnt; t += WARPS) {
                uint32_t s = src[t];
                float *k = kf + t * D + lane * CPL;
                if (s < p.n_q8) {
                        const uint8_t *b = p.q8_blocks[s / T];
                        uint64_t hs = (uint64_t)h * T + s % T;
                        raw<CPL> codes, vcodes;
                        raw<CPL * 4> scales;
                        codes.load(b + p.q_key + hs * D + lane * CPL);
                        scales.load(b + p.q_ks + ((uint64_t)h * D + lane * CPL) * 4);
                        vcodes.load(b + p.q_val + hs * D + lane * CPL);
#pragma unroll
                        for (int i = 0; i < CPL; i++)
                                k[i] = __fmul_rn(elem_at<E_Q8>(codes, i), __uint_as_float(scales.w[i]));
                        vcodes.store((uint8_t *)vq + t * D + lane * CPL);
                        if (lane == 0)
                                vs[t] = *(const float *)(b + p.q_vs + hs * 4);
                        if (lane < 5)
                                side[t * 5 + lane] = *(const uint32_t *)(b + p.q_side.off[lane] + hs * 4);
                } else {
                        uint32_t f = s - p.n_q8;
                        const uint8_t *b = p.fp_blocks[f / T];
                        uint64_t hs = (uint64_t)h * T + f % T;
                        raw<CPL * EB> kr, vr;
                        kr.load(b + p.f_key + hs * D * EB + lane * CPL * EB);
                        vr.load(b + p.f_val + hs * D * EB + lane * CPL * EB);
                        to_floats<E, CPL>(kr, k);
                        float v[CPL], m = 0.0f;
                        to_floats<E, CPL>(vr, v);
#pragma unroll
                        for (int i = 0; i < CPL; i++) {
                                float a = fabsf(v[i]);
                                m = a > m ? a : m;
                        }
                        float scale = __fdiv_rn(warp_absmax(m), 127.0f);
                        raw<CPL> vcodes;
                        vcodes.zero();
#pragma unroll
                        for (int i = 0; i < CPL; i++)
                                set_code<CPL>(vcodes, i, quant_one(v[i], scale));
                        vcodes.store((uint8_t *)vq + t * D + lane * CPL);
                        if (lane == 0)
                                vs[t] = scale;
                        if (lane < 5)
                                side[t * 5 + lane] = *(const uint32_t *)(b + p.f_side.off[lane] + hs * 4);
                }
        }
        __syncthreads();
        if (threadIdx.x == 0)
                publish_read_done(&p.flags[ticket]);

        for (uint32_t c = threadIdx.x; c < (uint32_t)D; c += THREADS) {
                float m = 0.0f;
                for (uint32_t t = 0; t < cnt; t++) {
                        float a = fabsf(kf[t * D + c]);
                        m = a > m ? a : m;
                }
                ks[c] = __fdiv_rn(m, 127.0f);
        }
        wait_for_readers(p, ticket); /* also makes ks visible to the block */

        uint8_t *db = p.q8_blocks[blk];
        for (uint32_t t = warp; t < cnt; t += WARPS) {
                uint64_t hs = (uint64_t)h * T + t;
                raw<CPL> codes, vcodes;
                codes.zero();
#pragma unroll
                for (int i = 0; i < CPL; i++) {
                        int c = lane * CPL + i;
                        set_code<CPL>(codes, i, quant_one(kf[t * D + c], ks[c]));
                }
                codes.store(db + p.q_key + hs * D + lane * CPL);
                vcodes.load((const uint8_t *)vq + t * D + lane * CPL);
                vcodes.store(db + p.q_val + hs * D + lane * CPL);
                if (lane == 0)
                        *(float *)(db + p.q_vs + hs * 4) = vs[t];
                if (lane < 5)
                        *(uint32_t *)(db + p.q_side.off[lane] + hs * 4) = side[t * 5 + lane];
        }
        for (uint32_t c = threadIdx.x; c < (uint32_t)D; c += THREADS)
                ((float *)(db + p.q_ks))[(uint64_t)h * D + c] = ks[c];
}

/* A full-precision destination block: its rows and side words, gathered then written. */
__device__ void fp_chunk(const compact_params &p, uint32_t ticket, uint32_t h, uint32_t blk, uint32_t cnt,
                         const uint32_t *src, uint8_t *smem) {
        const uint32_t T = p.T, RB = p.f_row_bytes, RV = RB / 16;
        uint8_t *kraw = smem, *vraw = smem + T * RB;
        uint32_t *side = (uint32_t *)(smem + 2 * T * RB);

        for (uint32_t x = threadIdx.x; x < cnt * RV; x += THREADS) {
                uint32_t t = x / RV, v = x % RV, f = src[t] - p.n_q8;
                const uint8_t *b = p.fp_blocks[f / T];
                uint64_t at = ((uint64_t)h * T + f % T) * RB + v * 16;
                *(uint4 *)(kraw + t * RB + v * 16) = *(const uint4 *)(b + p.f_key + at);
                *(uint4 *)(vraw + t * RB + v * 16) = *(const uint4 *)(b + p.f_val + at);
        }
        for (uint32_t x = threadIdx.x; x < cnt * 5; x += THREADS) {
                uint32_t t = x / 5, a = x % 5, f = src[t] - p.n_q8;
                const uint8_t *b = p.fp_blocks[f / T];
                side[x] = *(const uint32_t *)(b + p.f_side.off[a] + ((uint64_t)h * T + f % T) * 4);
        }
        __syncthreads();
        if (threadIdx.x == 0)
                publish_read_done(&p.flags[ticket]);
        wait_for_readers(p, ticket);

        uint8_t *db = p.fp_blocks[blk];
        for (uint32_t x = threadIdx.x; x < cnt * RV; x += THREADS) {
                uint32_t t = x / RV, v = x % RV;
                uint64_t at = ((uint64_t)h * T + t) * RB + v * 16;
                *(uint4 *)(db + p.f_key + at) = *(const uint4 *)(kraw + t * RB + v * 16);
                *(uint4 *)(db + p.f_val + at) = *(const uint4 *)(vraw + t * RB + v * 16);
        }
        for (uint32_t x = threadIdx.x; x < cnt * 5; x += THREADS) {
                uint32_t t = x / 5, a = x % 5;
                *(uint32_t *)(db + p.f_side.off[a] + ((uint64_t)h * T + t) * 4) = side[x];
        }
}

/* Dynamic shared memory: the ticket, the chunk's sources, then the chunk's data. */
constexpr size_t SMEM_HEAD = 16 + 4 * MAX_T;

template <int E, int CPL> __global__ void __launch_bounds__(THREADS) compact_chunks(compact_params p) {
        KVC_DYNAMIC_SMEM(smem_all);
        uint32_t &s_ticket = *(uint32_t *)smem_all, *s_src = (uint32_t *)(smem_all + 16);
        uint8_t *smem = smem_all + SMEM_HEAD;

        if (threadIdx.x == 0) {
                cuda::atomic_ref<int32_t, cuda::thread_scope_device> status(*p.status);
                s_ticket = status.load(cuda::memory_order_relaxed) ? NONE : atomicAdd(p.ticket, 1u);
        }
        __syncthreads();
        const uint32_t ticket = s_ticket;
        if (ticket == NONE)
                return; /* the keep-set was refused: move nothing */
        const bool q8 = ticket < p.nq_chunks;
        const uint32_t h = ticket % p.H, blk = (q8 ? ticket : ticket - p.nq_chunks) / p.H;
        const uint32_t first = (q8 ? 0 : p.new_q8) + blk * p.T, end = q8 ? p.new_q8 : p.new_len;
        const uint32_t cnt = min(p.T, end - first);
        for (uint32_t t = threadIdx.x; t < cnt; t += THREADS)
                s_src[t] = src_of(p, h, first + t);
        __syncthreads();

        bool skip;
        if (q8) {
                uint32_t old_live = p.n_q8 > first ? min(p.T, p.n_q8 - first) : 0;
                skip = old_live == cnt && s_src[0] == first && s_src[cnt - 1] == first + cnt - 1;
        } else {
                uint32_t at = blk * p.T; /* fp index of the first destination */
                skip = s_src[0] - p.n_q8 == at && s_src[cnt - 1] - p.n_q8 == at + cnt - 1;
        }
        if (skip) {
                if (threadIdx.x == 0)
                        publish_read_done(&p.flags[ticket]);
                return;
        }
        if (q8)
                q8_chunk<E, CPL>(p, ticket, h, blk, cnt, s_src, smem);
        else
                fp_chunk(p, ticket, h, blk, cnt, s_src, smem);
}

struct ws_layout {
        size_t flags, rmin_not, rmax1, bytes;
};

ws_layout ws_of(uint64_t n_chunks) {
        ws_layout w;
        w.flags = HEADER_BYTES;
        w.rmin_not = w.flags + n_chunks * 4;
        w.rmax1 = w.rmin_not + n_chunks * 4;
        w.bytes = w.rmax1 + n_chunks * 4;
        return w;
}

size_t smem_bytes(const struct mixed_layer *M) {
        size_t T = M->q8->block_tokens, D = M->q8->head_dim, RB = M->fp->row_bytes;
        size_t q8 = T * D * 4 + T * D + T * 4 + T * 20 + D * 4, fp = 2 * T * RB + T * 20;
        return SMEM_HEAD + (q8 > fp ? q8 : fp);
}

template <int E, int CPL>
int launch(uint32_t n_chunks, size_t smem, const compact_params &p, cudaStream_t st) {
        auto *kernel = compact_chunks<E, CPL>;
        KVC_LAUNCH_CONCURRENT(kernel, n_chunks, THREADS, smem, st)(p);
        return 0;
}

template <int E>
int launch_cpl(uint32_t D, uint32_t n_chunks, size_t smem, const compact_params &p, cudaStream_t st) {
        switch (D) {
        case 64: return launch<E, 2>(n_chunks, smem, p, st);
        case 128: return launch<E, 4>(n_chunks, smem, p, st);
        case 256: return launch<E, 8>(n_chunks, smem, p, st);
        }
        return -EINVAL;
}

} // namespace

} // namespace kvc

extern "C" size_t kvc_cuda_compact_workspace_bytes(const struct mixed_layer *M) {
        /* the block tables bound the chunks of any layout they can hold */
        uint64_t chunks = ((uint64_t)M->n_q8_blocks + M->n_fp_blocks) * M->q8->n_kv_heads;
        return kvc::align_up(kvc::ws_of(chunks).bytes, 256);
}

extern "C" int kvc_cuda_compact_mixed(const struct mixed_layer *M, const uint32_t *keep, uint32_t keep_count,
                                      int per_head, uint32_t base_tokens, uint32_t new_q8, void *workspace,
                                      size_t workspace_bytes, void *stream, uint32_t *ret_n_tokens) {
        using namespace kvc;
        if (mixed_layer_check(M) < 0 || base_tokens > M->n_tokens || keep_count > base_tokens ||
            (keep_count && !keep) || !workspace)
                return -EINVAL;
        const uint32_t T = M->q8->block_tokens, H = M->q8->n_kv_heads, D = M->q8->head_dim;
        if ((D != 64 && D != 128 && D != 256) || T > MAX_T || T * D > MAX_TD || M->fp->row_bytes % 16)
                return -EINVAL;
        const uint32_t new_len = keep_count + (M->n_tokens - base_tokens);
        const uint32_t q8_dest = div_up(new_q8, T), fp_dest = div_up(new_len - new_q8, T);
        if (new_q8 > new_len || q8_dest > M->n_q8_blocks || fp_dest > M->n_fp_blocks ||
            workspace_bytes < kvc_cuda_compact_workspace_bytes(M))
                return -EINVAL;

        compact_params p;
        p.q8_blocks = M->q8_blocks;
        p.fp_blocks = M->fp_blocks;
        p.q_key = M->q8->key_offset;
        p.q_val = M->q8->value_offset;
        p.q_ks = M->q8->kscale_offset;
        p.q_vs = M->q8->vscale_offset;
        p.f_key = M->fp->key_offset;
        p.f_val = M->fp->value_offset;
        p.q_side = side_offsets_of(M->q8);
        p.f_side = side_offsets_of(M->fp);
        p.f_row_bytes = (uint32_t)M->fp->row_bytes;
        p.T = T;
        p.H = H;
        p.D = D;
        p.n_q8 = M->n_q8;
        p.n = M->n_tokens;
        p.new_q8 = new_q8;
        p.new_len = new_len;
        p.keep = keep;
        p.kc = keep_count;
        p.base = base_tokens;
        p.per_head = per_head != 0;
        p.q8_dest_blocks = q8_dest;
        p.fp_dest_blocks = fp_dest;
        p.nq_chunks = q8_dest * H;
        p.n_chunks = (q8_dest + fp_dest) * H;
        ws_layout w = ws_of(p.n_chunks);
        uint8_t *ws = (uint8_t *)workspace;
        p.status = (int32_t *)ws;
        p.ticket = (uint32_t *)(ws + 4);
        p.flags = (uint32_t *)(ws + w.flags);
        p.rmin_not = (uint32_t *)(ws + w.rmin_not);
        p.rmax1 = (uint32_t *)(ws + w.rmax1);

        cudaStream_t st = (cudaStream_t)stream;
        if (cudaMemsetAsync(ws, 0, w.bytes, st) != cudaSuccess)
                return -EIO;
        if (new_len) {
                uint64_t total = (uint64_t)H * new_len, blocks = (total + 255) / 256;
                KVC_LAUNCH_CONCURRENT(compact_prep, (unsigned)(blocks < 4096 ? blocks : 4096), 256, 0, st)(p);
                int r = launch_status();
                if (r < 0)
                        return r;
        }
        if (p.n_chunks) {
                size_t smem = smem_bytes(M);
                int r;
                switch (M->fp->dtype) {
                case BLOCK_DTYPE_F32: r = launch_cpl<E_F32>(D, p.n_chunks, smem, p, st); break;
                case BLOCK_DTYPE_F16: r = launch_cpl<E_F16>(D, p.n_chunks, smem, p, st); break;
                case BLOCK_DTYPE_BF16: r = launch_cpl<E_BF16>(D, p.n_chunks, smem, p, st); break;
                default: return -EINVAL;
                }
                if (r < 0)
                        return r;
                if ((r = launch_status()) < 0)
                        return r;
        }
        *ret_n_tokens = new_len;
        return 0;
}

extern "C" int kvc_cuda_mixed_advance_q8(const struct mixed_layer *M, uint32_t new_q8, void *workspace,
                                         size_t workspace_bytes, void *stream) {
        uint32_t n;
        if (mixed_layer_check(M) < 0 || new_q8 < M->n_q8 || new_q8 > M->n_tokens)
                return -EINVAL;
        return kvc_cuda_compact_mixed(M, NULL, 0, 0, 0, new_q8, workspace, workspace_bytes, stream, &n);
}
