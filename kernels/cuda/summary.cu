/* summary.cu: the logits summary of a batch of rows on the GPU (kernels/summary.c is the
 * reference), and the runtime helpers of the CUDA library.
 *
 * One thread block per row, three sweeps over it (the row stays in L1/L2):
 *   1. each thread keeps its two best logits in the order (value descending, index ascending)
 *      and whether it saw a non-finite one; a block merge gives top-1, top-2 and the verdict;
 *   2. sum_i exp(z_i - max) and sum_i exp(z_i - max) (z_i - max) in double, as summary.c does:
 *      entropy = log(sum) - zsum / sum, over log(V);
 *   3. per top-k rank, the best logit strictly after the previous one in that order.
 * The order makes ties come out as summary.c's: the lowest index first.
 */
#include <errno.h>
#include <float.h>

#include "common.cuh"
#include "cuda.h"

namespace kvc {

namespace {

constexpr int SUMMARY_THREADS = 256;
constexpr uint32_t NONE = 0xffffffffu;

struct cand {
        float v;
        uint32_t i;
};

/* a before b in (value descending, index ascending); NONE is after everything. */
__device__ __forceinline__ bool before(cand a, cand b) {
        if (a.i == NONE)
                return false;
        if (b.i == NONE)
                return true;
        return a.v > b.v || (a.v == b.v && a.i < b.i);
}

struct top2 {
        cand a, b; /* a before b */
};

__device__ __forceinline__ top2 merge(top2 x, top2 y) {
        top2 r;
        if (before(x.a, y.a)) {
                r.a = x.a;
                r.b = before(x.b, y.a) ? x.b : y.a;
        } else {
                r.a = y.a;
                r.b = before(y.b, x.a) ? y.b : x.a;
        }
        return r;
}

__device__ __forceinline__ top2 shfl_top2(top2 t, int o) {
        top2 r;
        r.a.v = __shfl_xor_sync(KVC_FULL_MASK, t.a.v, o);
        r.a.i = __shfl_xor_sync(KVC_FULL_MASK, t.a.i, o);
        r.b.v = __shfl_xor_sync(KVC_FULL_MASK, t.b.v, o);
        r.b.i = __shfl_xor_sync(KVC_FULL_MASK, t.b.i, o);
        return r;
}

/* Block-wide reductions; every thread gets the result. scratch holds a slot per warp. */
__device__ top2 block_top2(top2 t, top2 *scratch) {
        int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nw = blockDim.x / 32;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1)
                t = merge(t, shfl_top2(t, o));
        __syncthreads(); /* scratch may still be read from the previous reduction */
        if (lane == 0)
                scratch[warp] = t;
        __syncthreads();
        t = scratch[0];
        for (int w = 1; w < nw; w++)
                t = merge(t, scratch[w]);
        return t;
}

__device__ double block_sum(double v, double *scratch) {
        int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nw = blockDim.x / 32;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1)
                v += __shfl_xor_sync(KVC_FULL_MASK, v, o);
        __syncthreads();
        if (lane == 0)
                scratch[warp] = v;
        __syncthreads();
        v = 0;
        for (int w = 0; w < nw; w++)
                v += scratch[w];
        return v;
}

__global__ void __launch_bounds__(SUMMARY_THREADS)
        summary_rows(const float *logits, uint32_t vocab, struct summary *ret, float *topk, uint32_t k,
                     int32_t *status) {
        __shared__ top2 t2_scratch[SUMMARY_THREADS / 32];
        __shared__ double d_scratch[SUMMARY_THREADS / 32];
        const float *z = logits + (uint64_t)blockIdx.x * vocab;

        /* 1: top two, finiteness */
        top2 t = { { 0.0f, NONE }, { 0.0f, NONE } };
        int bad = 0;
        for (uint32_t i = threadIdx.x; i < vocab; i += blockDim.x) {
                float v = z[i];
                bad |= !isfinite(v);
                cand c = { v, i };
                if (before(c, t.a)) {
                        t.b = t.a;
                        t.a = c;
                } else if (before(c, t.b)) {
                        t.b = c;
                }
        }
        if (__syncthreads_or(bad)) {
                if (threadIdx.x == 0)
                        status[blockIdx.x] = -EINVAL;
                return;
        }
        t = block_top2(t, t2_scratch);
        double max = t.a.v;

        /* 2: the sums of summary.c, in double */
        double sum = 0.0, zsum = 0.0;
        for (uint32_t i = threadIdx.x; i < vocab; i += blockDim.x) {
                double d = (double)z[i] - max, e = exp(d);
                sum += e;
                zsum += e * d;
        }
        sum = block_sum(sum, d_scratch);
        zsum = block_sum(zsum, d_scratch);
        double lse = max + log(sum);
        if (threadIdx.x == 0) {
                double h = log(sum) - zsum / sum, hn = h / log((double)vocab);
                float margin = t.a.v - t.b.v;
                struct summary s;
                s.entropy = (float)(hn < 0 ? 0 : hn > 1 ? 1 : hn);
                s.top1_prob = (float)exp((double)t.a.v - lse);
                s.margin = isinf(margin) ? FLT_MAX : margin;
                s.top1 = t.a.i;
                ret[blockIdx.x] = s;
                status[blockIdx.x] = 0;
        }

        /* 3: top-k by repeated selection, each rank strictly after the previous one */
        cand last = { INFINITY, NONE };
        for (uint32_t j = 0; j < k; j++) {
                top2 b = { { 0.0f, NONE }, { 0.0f, NONE } };
                for (uint32_t i = threadIdx.x; i < vocab; i += blockDim.x) {
                        cand c = { z[i], i };
                        if (last.i != NONE && !before(last, c))
                                continue;
                        if (before(c, b.a))
                                b.a = c;
                }
                b = block_top2(b, t2_scratch);
                if (threadIdx.x == 0)
                        topk[(uint64_t)blockIdx.x * k + j] = (float)((double)b.a.v - lse);
                last = b.a;
        }
}

} // namespace

int launch_status() {
        return cudaGetLastError() == cudaSuccess ? 0 : -EIO;
}

} // namespace kvc

extern "C" int kvc_cuda_device_count(void) {
        int n = 0;
        if (cudaGetDeviceCount(&n) != cudaSuccess) {
                cudaGetLastError(); /* no driver or no device: not sticky, but clear it */
                return 0;
        }
        return n;
}

extern "C" int kvc_cuda_summary(const float *logits, uint32_t n_rows, uint32_t vocab, struct summary *ret,
                                float *topk, uint32_t k, int32_t *status, void *stream) {
        if (vocab < 2 || k > vocab || n_rows == 0 || !logits || !ret || !status || (k && !topk))
                return -EINVAL;
        KVC_LAUNCH(kvc::summary_rows, n_rows, kvc::SUMMARY_THREADS, 0, (cudaStream_t)stream)
        (logits, vocab, ret, topk, k, status);
        return kvc::launch_status();
}
