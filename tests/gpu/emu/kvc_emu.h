/* kvc_emu.h: just enough of CUDA to compile the kernels of kernels/cuda with a host C++ compiler
 * and run them on the CPU, where no GPU is at hand (`make cuda-emu`, tests/gpu/emulate.sh).
 *
 * Every CUDA thread of a block is a host thread. The blocks of a grid run one after another, or,
 * for a kernel launched with KVC_LAUNCH_CONCURRENT (no static __shared__ state), up to
 * KVC_EMU_RESIDENT blocks at a time (default 16), a new one starting when the oldest finishes, as
 * blocks become resident on a GPU.
 * __syncthreads and __syncwarp are barriers, a shuffle is a store, a warp barrier, a load and a
 * barrier; atomics are the compiler's atomics. __shared__ arrays become function statics (shared
 * by the threads of the one block that runs), dynamic shared memory a buffer per block, filled
 * with garbage. Device memory is host memory; streams run synchronously.
 *
 * What this checks: the kernels' index arithmetic, lane and warp mappings, shared-memory use, the
 * barriers (a warp or block that does not reach a barrier together hangs, and the run times out)
 * and the results against the CPU references, and for concurrent kernels whether blocks that
 * run at the same time wait for each other where they must (the compaction's read-done flags).
 * What it cannot check: timing, and the GPU memory model beyond what the host's gives.
 */
#pragma once

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <thread>
#include <tuple>

#include "cuda_runtime_api.h"

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__   static
#define __align__(n) __attribute__((aligned(n)))

struct uint3 {
        unsigned x, y, z;
};

struct dim3 {
        unsigned x, y, z;
        dim3(unsigned a = 1, unsigned b = 1, unsigned c = 1) : x(a), y(b), z(c) {
        }
};

struct alignas(8) uint2 {
        unsigned x, y;
};

struct alignas(16) uint4 {
        unsigned x, y, z, w;
};

struct alignas(16) float4 {
        float x, y, z, w;
};

inline uint2 make_uint2(unsigned x, unsigned y) {
        return uint2{ x, y };
}

inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) {
        return uint4{ x, y, z, w };
}

using std::isfinite;
using std::isinf;

inline unsigned min(unsigned a, unsigned b) {
        return a < b ? a : b;
}

namespace kvc_emu {

struct block_ctx;
struct warp_ctx;

extern thread_local uint3 tl_thread, tl_block;
extern thread_local unsigned tl_lane;
extern thread_local block_ctx *tl_blk;
extern thread_local warp_ctx *tl_warp;
extern dim3 g_grid, g_block;

void run(const std::function<void()> &body, dim3 grid, dim3 block, size_t dynamic_smem, bool concurrent);
uint8_t *dynamic_smem();
void sync_block();
int sync_block_or(int p);
void sync_warp();
uint64_t exchange(uint64_t v, int lane);

template <class... P> struct launcher {
        void (*kernel)(P...);
        dim3 grid, block;
        size_t smem;
        bool concurrent;

        template <class... A> void operator()(A &&...a) const {
                std::tuple<P...> args(std::forward<A>(a)...);
                auto k = kernel;
                run([&] { std::apply(k, args); }, grid, block, smem, concurrent);
        }
};

template <class... P>
launcher<P...> launch(void (*kernel)(P...), dim3 grid, dim3 block, size_t smem, bool concurrent) {
        return launcher<P...>{ kernel, grid, block, smem, concurrent };
}

} // namespace kvc_emu

#define threadIdx (kvc_emu::tl_thread)
#define blockIdx  (kvc_emu::tl_block)
#define blockDim  (kvc_emu::g_block)
#define gridDim   (kvc_emu::g_grid)

#define KVC_LAUNCH(kernel, grid, block, smem, stream)                                                        \
        ((void)(stream), kvc_emu::launch(kernel, grid, block, smem, false))
#define KVC_LAUNCH_CONCURRENT(kernel, grid, block, smem, stream)                                             \
        ((void)(stream), kvc_emu::launch(kernel, grid, block, smem, true))
#define KVC_DYNAMIC_SMEM(name) uint8_t *name = kvc_emu::dynamic_smem()

inline void __syncthreads() {
        kvc_emu::sync_block();
}

inline int __syncthreads_or(int p) {
        return kvc_emu::sync_block_or(p);
}

inline void __syncwarp(unsigned mask = 0xffffffffu) {
        (void)mask;
        kvc_emu::sync_warp();
}

template <class T> inline T __shfl_xor_sync(unsigned mask, T v, int o) {
        static_assert(sizeof(T) <= 8, "shuffle of at most 8 bytes");
        (void)mask;
        uint64_t x = 0;
        std::memcpy(&x, &v, sizeof(T));
        x = kvc_emu::exchange(x, (int)kvc_emu::tl_lane ^ o);
        T r;
        std::memcpy(&r, &x, sizeof(T));
        return r;
}

inline void __threadfence() {
        std::atomic_thread_fence(std::memory_order_seq_cst);
}

inline void __nanosleep(unsigned) {
        std::this_thread::yield();
}

inline unsigned atomicAdd(unsigned *p, unsigned v) {
        return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST);
}

inline int atomicExch(int *p, int v) {
        return __atomic_exchange_n(p, v, __ATOMIC_SEQ_CST);
}

inline unsigned atomicMax(unsigned *p, unsigned v) {
        unsigned old = __atomic_load_n(p, __ATOMIC_RELAXED);
        while (old < v && !__atomic_compare_exchange_n(p, &old, v, false, __ATOMIC_SEQ_CST, __ATOMIC_RELAXED))
                ;
        return old;
}

inline float __uint_as_float(unsigned u) {
        float f;
        std::memcpy(&f, &u, 4);
        return f;
}

/* prmt's default mode: byte n of the result is byte (s >> 4n) & 7 of y:x, or its sign if bit 3 is set. */
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
        uint64_t v = (uint64_t)y << 32 | x;
        unsigned r = 0;
        for (int n = 0; n < 4; n++) {
                unsigned sel = (s >> (4 * n)) & 0xf, b = (unsigned)(v >> (8 * (sel & 7))) & 0xff;
                if (sel & 8)
                        b = b & 0x80 ? 0xff : 0;
                r |= b << (8 * n);
        }
        return r;
}

inline float __fdiv_rn(float a, float b) {
        return a / b;
}

inline float __fmul_rn(float a, float b) {
        return a * b;
}

inline double __dmul_rn(double a, double b) {
        return a * b;
}

inline double __dadd_rn(double a, double b) {
        return a + b;
}

inline double __ddiv_rn(double a, double b) {
        return a / b;
}

struct __half {
        unsigned short bits;
};

inline __half __ushort_as_half(unsigned short h) {
        return __half{ h };
}

float kvc_emu_half_to_float(unsigned short h);

inline float __half2float(__half h) {
        return kvc_emu_half_to_float(h.bits);
}

namespace cuda {

enum memory_order {
        memory_order_relaxed = __ATOMIC_RELAXED,
        memory_order_acquire = __ATOMIC_ACQUIRE,
        memory_order_release = __ATOMIC_RELEASE,
        memory_order_seq_cst = __ATOMIC_SEQ_CST,
};

enum thread_scope { thread_scope_system, thread_scope_device, thread_scope_block, thread_scope_thread };

template <class T, thread_scope S> struct atomic_ref {
        T *p;

        explicit atomic_ref(T &r) : p(&r) {
        }

        void store(T v, memory_order o) const {
                __atomic_store_n(p, v, (int)o);
        }

        T load(memory_order o) const {
                return __atomic_load_n(p, (int)o);
        }
};

} // namespace cuda
