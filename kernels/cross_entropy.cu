// Cross-entropy forward and backward over a chunk of logits rows in one kernel (DESIGN.md
// decision 5: full logits never exist, and neither does a softmax tensor).
//
// One block per row. Pass 1 reads the row once, keeping a running (max, sum of exp) per thread
// (online softmax), merged across the block. Pass 2 reads the row again and overwrites it in place:
//   d_logits = (exp(x - max) / sum - onehot(target)) * grad_scale [* *grad_scale_ptr]
// With 1024-thread blocks at most two rows per SM are in flight (a 32K-vocab float32 row is
// 128 KiB), so on an H100 the second read is served from L2: HBM sees one read and one write.
//
// row_loss[row] = log(sum) + max - x[target]; ignored rows (target == ignore_index) get loss 0
// and a zero gradient. A target outside [0, vocab) that is not ignore_index gives a NaN loss and
// NaN gradients for that row, so a bad batch is visible instead of silently wrong. A NaN logit
// makes its row's loss NaN; +inf gives a non-finite loss.
//
// write_grad == 0 runs pass 1 only (evaluation: loss without gradient, logits left unchanged).
//
// Rows are `row_stride` elements apart (last dimension contiguous). vec4 != 0 means vocab and
// row_stride are multiples of 4 and the base pointer is aligned for 4-element accesses (16 bytes
// for float32, 8 for 16-bit; checked on the host).
#include "apr_common.cuh"

#define APR_CE_MAX_THREADS 1024
#define APR_LOG2E 1.4426950408889634f
#define APR_NAN __int_as_float(0x7fc00000)

// exp(d) for d <= 0 (d = x - max): exp2 of an exactly formed difference, no cancellation.
__device__ __forceinline__ float ce_exp(float d) { return exp2f(d * APR_LOG2E); }

// Merge a (max, sum) pair into another; (-inf, 0) is the empty state. fmaxf drops a NaN, so a NaN
// is carried in the sum instead.
__device__ __forceinline__ void ce_merge(float& m, float& s, float m2, float s2) {
    const float mn = fmaxf(m, m2);
    if (mn == -APR_INF) {
        if (m2 != m2 || s2 != s2) s = APR_NAN;
        return;
    }
    s = s * ce_exp(m - mn) + s2 * ce_exp(m2 - mn);
    m = mn;
}

// Four values of one thread into its running (max, sum).
__device__ __forceinline__ void ce_accum4(float& m, float& s, float4 v) {
    const float mx = fmaxf(fmaxf(v.x, v.y), fmaxf(v.z, v.w));
    const float mn = fmaxf(m, mx);
    if (mn == -APR_INF) {
        if (v.x != v.x || v.y != v.y || v.z != v.z || v.w != v.w) s = APR_NAN;
        return;
    }
    s = s * ce_exp(m - mn) + ((ce_exp(v.x - mn) + ce_exp(v.y - mn)) + (ce_exp(v.z - mn) + ce_exp(v.w - mn)));
    m = mn;
}

// Block-wide merge; every thread gets the row's (max, sum). Ends after a __syncthreads, so every
// thread has finished reading the row before any thread starts overwriting it.
__device__ __forceinline__ void ce_block_merge(float& m, float& s, float* sm_max, float* sm_sum) {
    const unsigned int lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
    const unsigned int n_warps = blockDim.x >> 5;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        const float m2 = __shfl_xor_sync(0xffffffffu, m, off);
        const float s2 = __shfl_xor_sync(0xffffffffu, s, off);
        ce_merge(m, s, m2, s2);
    }
    if (lane == 0) {
        sm_max[warp] = m;
        sm_sum[warp] = s;
    }
    __syncthreads();
    m = (lane < n_warps) ? sm_max[lane] : -APR_INF;
    s = (lane < n_warps) ? sm_sum[lane] : 0.0f;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        const float m2 = __shfl_xor_sync(0xffffffffu, m, off);
        const float s2 = __shfl_xor_sync(0xffffffffu, s, off);
        ce_merge(m, s, m2, s2);
    }
}

template <typename T>
__device__ __forceinline__ void ce_fwd_bwd_body(T* __restrict__ logits, const long long* __restrict__ targets,
                                                long long vocab, long long row_stride, long long ignore_index,
                                                float grad_scale, const float* __restrict__ grad_scale_ptr,
                                                float* __restrict__ row_loss, int vec4, int write_grad) {
    __shared__ float sm_max[32];
    __shared__ float sm_sum[32];
    const long long row = blockIdx.x;
    T* x = logits + row * row_stride;
    const long long target = targets[row];
    const bool ignored = (target == ignore_index);
    const bool bad_target = !ignored && (target < 0 || target >= vocab);
    const long long n_vec4 = vec4 ? vocab / 4 : 0;

    if (ignored) {  // uniform across the block: every thread returns here, no barrier is skipped
        if (write_grad) {
            for (long long i4 = threadIdx.x; i4 < n_vec4; i4 += blockDim.x)
                apr_store4(x, i4, make_float4(0.0f, 0.0f, 0.0f, 0.0f));
            for (long long i = 4 * n_vec4 + threadIdx.x; i < vocab; i += blockDim.x) apr_store(x, i, 0.0f);
        }
        if (threadIdx.x == 0) row_loss[row] = 0.0f;
        return;
    }

    // The target logit, read before pass 2 overwrites the row (pass 2 starts after a barrier).
    float x_target = 0.0f;
    if (threadIdx.x == 0 && !bad_target) x_target = apr_load(x, target);

    // Pass 1: online max / sum of exp.
    float m = -APR_INF, s = 0.0f;
    for (long long i4 = threadIdx.x; i4 < n_vec4; i4 += blockDim.x) ce_accum4(m, s, apr_load4(x, i4));
    for (long long i = 4 * n_vec4 + threadIdx.x; i < vocab; i += blockDim.x) ce_merge(m, s, apr_load(x, i), 1.0f);
    ce_block_merge(m, s, sm_max, sm_sum);

    if (threadIdx.x == 0) row_loss[row] = bad_target ? APR_NAN : (logf(s) + m) - x_target;
    if (!write_grad) return;

    float scale = grad_scale;
    if (grad_scale_ptr != nullptr) scale *= *grad_scale_ptr;
    const float inv_s = 1.0f / s;
    const float poison = bad_target ? APR_NAN : 0.0f;  // NaN gradients for a bad target
    // Pass 2: gradient in place.
    for (long long i4 = threadIdx.x; i4 < n_vec4; i4 += blockDim.x) {
        float4 v = apr_load4(x, i4);
        const long long base = 4 * i4;
        v.x = (ce_exp(v.x - m) * inv_s - (base + 0 == target ? 1.0f : 0.0f)) * scale + poison;
        v.y = (ce_exp(v.y - m) * inv_s - (base + 1 == target ? 1.0f : 0.0f)) * scale + poison;
        v.z = (ce_exp(v.z - m) * inv_s - (base + 2 == target ? 1.0f : 0.0f)) * scale + poison;
        v.w = (ce_exp(v.w - m) * inv_s - (base + 3 == target ? 1.0f : 0.0f)) * scale + poison;
        apr_store4(x, i4, v);
    }
    for (long long i = 4 * n_vec4 + threadIdx.x; i < vocab; i += blockDim.x) {
        const float v = apr_load(x, i);
        apr_store(x, i, (ce_exp(v - m) * inv_s - (i == target ? 1.0f : 0.0f)) * scale + poison);
    }
}

#define APR_CE_KERNEL(NAME, T)                                                                                \
    extern "C" __global__ void __launch_bounds__(APR_CE_MAX_THREADS)                                          \
        NAME(T* __restrict__ logits, const long long* __restrict__ targets, long long vocab,                  \
             long long row_stride, long long ignore_index, float grad_scale,                                  \
             const float* __restrict__ grad_scale_ptr, float* __restrict__ row_loss, int vec4, int write_grad) { \
        ce_fwd_bwd_body<T>(logits, targets, vocab, row_stride, ignore_index, grad_scale, grad_scale_ptr,     \
                           row_loss, vec4, write_grad);                                                       \
    }

APR_CE_KERNEL(apr_ce_fwd_bwd_f32, float)
