/* common.cuh: what the CUDA kernels share: element loads and conversions of the block dtypes,
 * the INT8 quantization rule of quant.h (the same IEEE operations, so the same bytes), warp
 * reductions, and the host-side mapping of CUDA errors.
 *
 * Build note: no --use_fast_math. x / s must be the IEEE division and rintf round to nearest even
 * for the codes to match the CPU reference bit for bit; expf and the divisions of the softmax
 * stay accurate to an ulp or two.
 */
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

extern "C" {
#include "block.h"
}

#define KVC_FULL_MASK 0xffffffffu

/* Kernel launches and dynamic shared memory go through these macros, and nothing else depends
 * on nvcc: tests/gpu/emu defines them (and the few CUDA names the kernels use) to run this very
 * code on the CPU, a thread per CUDA thread, where no GPU is at hand. KVC_LAUNCH_CONCURRENT marks a
 * kernel that keeps nothing in static __shared__ variables, whose blocks the emulator can then run
 * at the same time (on a GPU the two are the same). */
#ifndef KVC_LAUNCH
#define KVC_LAUNCH(kernel, grid, block, smem, stream)            kernel<<<grid, block, smem, stream>>>
#define KVC_LAUNCH_CONCURRENT(kernel, grid, block, smem, stream) kernel<<<grid, block, smem, stream>>>

#define KVC_DYNAMIC_SMEM(name) extern __shared__ __align__(16) uint8_t name[]
#endif

namespace kvc {

/* The element kinds: the block dtypes (block.h). */
enum : int {
        E_F32 = BLOCK_DTYPE_F32,
        E_F16 = BLOCK_DTYPE_F16,
        E_BF16 = BLOCK_DTYPE_BF16,
        E_Q8 = BLOCK_DTYPE_Q8
};

template <int E> struct elem_bytes_of { static constexpr int value = E == E_F32 ? 4 : E == E_Q8 ? 1 : 2; };

/* A few raw bytes loaded with one (or two) vector loads; BYTES in {2, 4, 8, 16, 32}. The address
 * must be aligned to min(BYTES, 16). */
template <int BYTES> struct raw {
        static constexpr int WORDS = BYTES < 4 ? 1 : BYTES / 4;
        uint32_t w[WORDS];

        __device__ __forceinline__ void load(const uint8_t *p) {
                if constexpr (BYTES == 2) {
                        w[0] = *reinterpret_cast<const uint16_t *>(p);
                } else if constexpr (BYTES == 4) {
                        w[0] = *reinterpret_cast<const uint32_t *>(p);
                } else if constexpr (BYTES == 8) {
                        uint2 v = *reinterpret_cast<const uint2 *>(p);
                        w[0] = v.x;
                        w[1] = v.y;
                } else {
#pragma unroll
                        for (int i = 0; i < BYTES / 16; i++) {
                                uint4 v = *reinterpret_cast<const uint4 *>(p + 16 * i);
                                w[4 * i] = v.x;
                                w[4 * i + 1] = v.y;
                                w[4 * i + 2] = v.z;
                                w[4 * i + 3] = v.w;
                        }
                }
        }

        __device__ __forceinline__ void store(uint8_t *p) const {
                if constexpr (BYTES == 2) {
                        *reinterpret_cast<uint16_t *>(p) = (uint16_t)w[0];
                } else if constexpr (BYTES == 4) {
                        *reinterpret_cast<uint32_t *>(p) = w[0];
                } else if constexpr (BYTES == 8) {
                        *reinterpret_cast<uint2 *>(p) = make_uint2(w[0], w[1]);
                } else {
#pragma unroll
                        for (int i = 0; i < BYTES / 16; i++)
                                *reinterpret_cast<uint4 *>(p + 16 * i) =
                                        make_uint4(w[4 * i], w[4 * i + 1], w[4 * i + 2], w[4 * i + 3]);
                }
        }

        __device__ __forceinline__ void zero() {
#pragma unroll
                for (int i = 0; i < WORDS; i++)
                        w[i] = 0;
        }
};

__device__ __forceinline__ float half_bits_to_float(uint32_t h) {
        return __half2float(__ushort_as_half((unsigned short)h));
}

/* Element i of a raw group, as a float (an INT8 code as its integer value). */
template <int E, int BYTES> __device__ __forceinline__ float elem_at(const raw<BYTES> &r, int i) {
        if constexpr (E == E_Q8)
                return (float)(int8_t)(uint8_t)(r.w[i / 4] >> (8 * (i % 4)));
        else if constexpr (E == E_F32)
                return __uint_as_float(r.w[i]);
        else if constexpr (E == E_F16)
                return half_bits_to_float((r.w[i / 2] >> (16 * (i % 2))) & 0xffffu);
        else
                return __uint_as_float(((r.w[i / 2] >> (16 * (i % 2))) & 0xffffu) << 16);
}

/* The first N elements of a raw group as floats. INT8 codes without I2F (a quarter-rate
 * instruction, and the INT8 attention is close to compute bound): the code plus 128 as the low
 * mantissa byte of 2^23, minus 2^23 + 128. Exact. */
template <int E, int N, int BYTES>
__device__ __forceinline__ void to_floats(const raw<BYTES> &r, float *out) {
#pragma unroll
        for (int i = 0; i < N; i++) {
                if constexpr (E == E_Q8)
                        out[i] = __uint_as_float(__byte_perm(r.w[i / 4] ^ 0x80808080u, 0x4b000000u,
                                                             0x7540u + i % 4)) -
                                 8388736.0f;
                else
                        out[i] = elem_at<E>(r, i);
        }
}

/* quant.h's rule, operation for operation. */
__device__ __forceinline__ int quant_one(float x, float s) {
        if (!(s > 0.0f))
                return 0;
        float r = rintf(__fdiv_rn(x, s));
        if (r > 127.0f)
                return 127;
        if (r < -127.0f)
                return -127;
        return r == r ? (int)r : 0;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
        for (int o = 16; o > 0; o >>= 1)
                v = fmaxf(v, __shfl_xor_sync(KVC_FULL_MASK, v, o));
        return v;
}

/* The largest |x| of a warp, ignoring NaN like quant_scale's `a > m`. */
__device__ __forceinline__ float warp_absmax(float m) {
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
                float x = __shfl_xor_sync(KVC_FULL_MASK, m, o);
                m = x > m ? x : m;
        }
        return m;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
        for (int o = 16; o > 0; o >>= 1)
                v += __shfl_xor_sync(KVC_FULL_MASK, v, o);
        return v;
}

/* The side arrays in block order: pos, sum, ema, last, logw. */
struct side_offsets {
        uint64_t off[5];
};

inline side_offsets side_offsets_of(const struct block_layout *l) {
        return side_offsets{ { l->pos_offset, l->sum_offset, l->ema_offset, l->last_offset,
                               l->logw_offset } };
}

inline uint32_t div_up(uint64_t a, uint64_t b) {
        return (uint32_t)((a + b - 1) / b);
}

inline size_t align_up(size_t x, size_t a) {
        return (x + a - 1) / a * a;
}

/* ---- split-K decode attention: what attention.cu's and ladder.cu's kernels share ----
 * A block covers the query heads h0 .. h0 + G - 1 of one KV head and one split of the tokens; each
 * of its WARPS warps keeps a running max m, sum l and accumulator acc (D / 32 channels a lane).
 * P is the kernel's parameters: part_m, part_l, part_acc ([head][split], D floats each for acc),
 * n_splits, group, out. */

/* The block's warps merge (m, l, acc) and write the split's partial for its heads. wm, wl and qk are
 * the block's shared scratch; qk's rows are free (every warp is done with them). */
template <int D, int G, int WARPS, class P>
__device__ __forceinline__ void split_write_partial(const P &p, uint32_t h0, uint32_t split, int warp, int lane,
                                                    float (&wm)[WARPS][G], float (&wl)[WARPS][G],
                                                    float (&qk)[WARPS][G][D], const float (&m)[G],
                                                    const float (&l)[G], const float (&acc)[G][D / 32]) {
        constexpr int CPL = D / 32;
        if (lane == 0)
#pragma unroll
                for (int r = 0; r < G; r++) {
                        wm[warp][r] = m[r];
                        wl[warp][r] = l[r];
                }
        __syncthreads(); /* every warp is done with its qk */
#pragma unroll
        for (int r = 0; r < G; r++)
#pragma unroll
                for (int k = 0; k < CPL; k++)
                        qk[warp][r][lane * CPL + k] = acc[r][k];
        __syncthreads();
        for (int i = threadIdx.x; i < G * D; i += blockDim.x) {
                int r = i / D, c = i % D;
                float M = -INFINITY, a = 0.0f, L = 0.0f;
                for (int w = 0; w < WARPS; w++)
                        M = fmaxf(M, wm[w][r]);
                if (M != -INFINITY)
                        for (int w = 0; w < WARPS; w++) {
                                float f = wm[w][r] == -INFINITY ? 0.0f : expf(wm[w][r] - M);
                                a += f * qk[w][r][c];
                                L += f * wl[w][r];
                        }
                uint64_t at = (uint64_t)(h0 + r) * p.n_splits + split;
                p.part_acc[at * D + c] = a;
                if (c == 0) {
                        p.part_m[at] = M;
                        p.part_l[at] = L;
                }
        }
}

/* The combine launch (grid: KV heads x token ranges, THREADS threads): each query head's max and
 * sum over the splits into ml (shared: M[group], then L[group]) and, in the blocks of blockIdx.y 0,
 * the heads' outputs. The kernel then updates the scores its own way, from ml. */
template <int D, int THREADS, class P> __device__ __forceinline__ void split_combine(const P &p, float *ml) {
        const int g = blockIdx.x, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
        const uint32_t S = p.n_splits, group = p.group;
        for (uint32_t r = warp; r < group; r += THREADS / 32) {
                uint64_t h = (uint64_t)g * group + r;
                float M = -INFINITY, L = 0.0f;
                for (uint32_t s = lane; s < S; s += 32)
                        M = fmaxf(M, p.part_m[h * S + s]);
                M = warp_max(M);
                if (M != -INFINITY)
                        for (uint32_t s = lane; s < S; s += 32) {
                                float ms = p.part_m[h * S + s];
                                L += ms == -INFINITY ? 0.0f : expf(ms - M) * p.part_l[h * S + s];
                        }
                L = warp_sum(L);
                if (lane == 0) {
                        ml[r] = M;
                        ml[group + r] = L;
                }
        }
        __syncthreads();

        if (blockIdx.y == 0)
                for (uint32_t i = threadIdx.x; i < group * D; i += THREADS) {
                        uint32_t r = i / D, c = i % D;
                        uint64_t h = (uint64_t)g * group + r;
                        float M = ml[r], L = ml[group + r], o = 0.0f;
                        if (L > 0.0f) {
                                for (uint32_t s = 0; s < S; s++) {
                                        float ms = p.part_m[h * S + s];
                                        if (ms != -INFINITY)
                                                o += expf(ms - M) * p.part_acc[(h * S + s) * D + c];
                                }
                                o /= L;
                        }
                        p.out[h * D + c] = o;
                }
}

/* -EIO when the last launch failed (the error is consumed). */
int launch_status();

} // namespace kvc
