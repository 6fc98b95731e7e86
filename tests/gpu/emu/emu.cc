/* emu.cc: the CPU side of the CUDA emulation (kvc_emu.h): grids run block after block, each
 * block's threads as host threads with barriers for __syncthreads, __syncwarp and shuffles; the
 * runtime API calls kvc-gpucheck makes, on host memory. */
#include <barrier>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <vector>

#include "kvc_emu.h"

extern "C" {
#include "block.h"
}

namespace kvc_emu {

struct block_ctx {
        std::barrier<> bar;
        std::atomic<int> or_acc{ 0 };
        std::vector<uint8_t> smem;

        explicit block_ctx(unsigned n) : bar((std::ptrdiff_t)n) {
        }
};

struct warp_ctx {
        std::barrier<> bar;
        uint64_t buf[32];

        explicit warp_ctx(unsigned n) : bar((std::ptrdiff_t)n) {
        }
};

thread_local uint3 tl_thread, tl_block;
thread_local unsigned tl_lane;
thread_local block_ctx *tl_blk;
thread_local warp_ctx *tl_warp;
dim3 g_grid, g_block;

/* One running block: its barriers, shared memory and threads. */
struct running_block {
        block_ctx blk;
        std::vector<std::unique_ptr<warp_ctx>> warps;
        std::vector<std::thread> threads;

        running_block(const std::function<void()> &body, unsigned n, uint3 id, size_t dynamic_smem) : blk(n) {
                blk.smem.assign(dynamic_smem ? dynamic_smem : 1, 0xa5); /* garbage, as on a GPU */
                for (unsigned w = 0; w < n / 32; w++)
                        warps.push_back(std::make_unique<warp_ctx>(32));
                for (unsigned t = 0; t < n; t++)
                        threads.emplace_back([this, &body, t, id] {
                                tl_thread = uint3{ t, 0, 0 };
                                tl_block = id;
                                tl_lane = t % 32;
                                tl_blk = &blk;
                                tl_warp = warps[t / 32].get();
                                body();
                        });
        }

        void join() {
                for (auto &th : threads)
                        th.join();
        }
};

void run(const std::function<void()> &body, dim3 grid, dim3 block, size_t dynamic_smem, bool concurrent) {
        unsigned n = block.x * block.y * block.z;
        if (block.y != 1 || block.z != 1 || n % 32 || n == 0 || n > 1024) {
                std::fprintf(stderr, "kvc-emu: unsupported block shape %ux%ux%u\n", block.x, block.y,
                             block.z);
                std::abort();
        }
        const char *env = std::getenv("KVC_EMU_RESIDENT");
        size_t resident = concurrent ? (env && std::atoi(env) > 0 ? (size_t)std::atoi(env) : 16) : 1;
        g_grid = grid;
        g_block = block;
        std::vector<std::unique_ptr<running_block>> live; /* oldest first */
        for (unsigned bz = 0; bz < grid.z; bz++)
                for (unsigned by = 0; by < grid.y; by++)
                        for (unsigned bx = 0; bx < grid.x; bx++) {
                                if (live.size() == resident) {
                                        live.front()->join();
                                        live.erase(live.begin());
                                }
                                live.push_back(std::make_unique<running_block>(body, n, uint3{ bx, by, bz },
                                                                               dynamic_smem));
                        }
        for (auto &b : live)
                b->join();
}

uint8_t *dynamic_smem() {
        return tl_blk->smem.data();
}

void sync_block() {
        tl_blk->bar.arrive_and_wait();
}

int sync_block_or(int p) {
        if (p)
                tl_blk->or_acc.fetch_or(1);
        tl_blk->bar.arrive_and_wait();
        int r = tl_blk->or_acc.load();
        tl_blk->bar.arrive_and_wait();
        if (tl_thread.x == 0)
                tl_blk->or_acc.store(0);
        tl_blk->bar.arrive_and_wait();
        return r;
}

void sync_warp() {
        tl_warp->bar.arrive_and_wait();
}

uint64_t exchange(uint64_t v, int lane) {
        tl_warp->buf[tl_lane] = v;
        tl_warp->bar.arrive_and_wait();
        uint64_t r = tl_warp->buf[lane & 31];
        tl_warp->bar.arrive_and_wait();
        return r;
}

} // namespace kvc_emu

float kvc_emu_half_to_float(unsigned short h) {
        float f;
        block_load_row(BLOCK_DTYPE_F16, &h, &f, 1);
        return f;
}

/* ---- the runtime API ---- */

struct kvc_emu_stream {
        int unused;
};

struct kvc_emu_event {
        std::chrono::steady_clock::time_point t;
};

extern "C" {

cudaError_t cudaGetDeviceCount(int *n) {
        *n = 1;
        return cudaSuccess;
}

cudaError_t cudaGetDevice(int *dev) {
        *dev = 0;
        return cudaSuccess;
}

cudaError_t cudaSetDevice(int) {
        return cudaSuccess;
}

cudaError_t cudaGetDeviceProperties(struct cudaDeviceProp *prop, int) {
        std::memset(prop, 0, sizeof(*prop));
        std::snprintf(prop->name, sizeof(prop->name), "kvc-emu (the CPU, emulating)");
        prop->totalGlobalMem = 1ull << 30;
        prop->multiProcessorCount = 2;
        return cudaSuccess;
}

cudaError_t cudaDeviceGetAttribute(int *value, enum cudaDeviceAttr attr, int) {
        if (attr != cudaDevAttrMultiProcessorCount)
                return cudaErrorInvalidValue;
        *value = 2;
        return cudaSuccess;
}

cudaError_t cudaGetLastError(void) {
        return cudaSuccess;
}

const char *cudaGetErrorString(cudaError_t e) {
        return e == cudaSuccess                 ? "no error"
               : e == cudaErrorMemoryAllocation ? "out of memory"
                                                : "invalid value";
}

cudaError_t cudaMalloc(void **p, size_t bytes) {
        *p = std::aligned_alloc(256, (bytes + 255) / 256 * 256);
        if (!*p)
                return cudaErrorMemoryAllocation;
        std::memset(*p, 0x5a, (bytes + 255) / 256 * 256); /* cudaMalloc gives garbage too */
        return cudaSuccess;
}

cudaError_t cudaFree(void *p) {
        std::free(p);
        return cudaSuccess;
}

cudaError_t cudaMemcpy(void *dst, const void *src, size_t bytes, enum cudaMemcpyKind) {
        std::memmove(dst, src, bytes);
        return cudaSuccess;
}

cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t bytes, enum cudaMemcpyKind kind,
                            cudaStream_t) {
        return cudaMemcpy(dst, src, bytes, kind);
}

cudaError_t cudaMemset(void *p, int value, size_t bytes) {
        std::memset(p, value, bytes);
        return cudaSuccess;
}

cudaError_t cudaMemsetAsync(void *p, int value, size_t bytes, cudaStream_t) {
        return cudaMemset(p, value, bytes);
}

cudaError_t cudaStreamCreate(cudaStream_t *s) {
        *s = new kvc_emu_stream{ 0 };
        return cudaSuccess;
}

cudaError_t cudaStreamDestroy(cudaStream_t s) {
        delete s;
        return cudaSuccess;
}

cudaError_t cudaStreamSynchronize(cudaStream_t) {
        return cudaSuccess;
}

cudaError_t cudaEventCreate(cudaEvent_t *e) {
        *e = new kvc_emu_event{};
        return cudaSuccess;
}

cudaError_t cudaEventDestroy(cudaEvent_t e) {
        delete e;
        return cudaSuccess;
}

cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t) {
        e->t = std::chrono::steady_clock::now();
        return cudaSuccess;
}

cudaError_t cudaEventSynchronize(cudaEvent_t) {
        return cudaSuccess;
}

cudaError_t cudaEventElapsedTime(float *ms, cudaEvent_t start, cudaEvent_t end) {
        *ms = std::chrono::duration<float, std::milli>(end->t - start->t).count();
        return cudaSuccess;
}

} /* extern "C" */
