// Cross-entropy forward and backward over a chunk of logits rows in one kernel (DESIGN.md
// decision 5: full logits never exist, and neither does a softmax tensor).
//
// One block per row. Pass 1 reads the row once, keeping a running (max, sum of exp) per thread
// (online softmax), merged across the block. Pass 2 reads the row again (it is still in L2: a
// 32K-vocab float32 row is 128 KiB) and overwrites it in place with
//   d_logits = (exp(x - max) / sum - onehot(target)) * grad_scale [* *grad_scale_ptr]
// row_loss[row] = log(sum) + max - x[target]; ignored rows (target == ignore_index) get loss 0
// and a zero gradient. A target outside [0, vocab) that is not ignore_index gives NaN loss and NaN
// gradients for that row, so a bad batch is visible instead of silently wrong.
//
// write_grad == 0 runs pass 1 only (evaluation: loss without gradient, logits left unchanged).
//
// Rows are `row_stride` elements apart (last dimension contiguous). vec4 != 0 means vocab and
// row_stride are multiples of 4 and the base pointer is aligned for 4-element accesses.
#include "apr_common.cuh"

#define APR_LOG2E 1.4426950408889634f

// Merge a (max, sum) pair into another; -inf max with zero sum is the empty state.
__device__ __forceinline__ void ce_merge(float& m, float& s, float m2, float s2) {
    const float mn = fmaxf(m, m2);
    if (mn == -APR_INF) {  // both empty or -inf so far; fmaxf drops NaN, so keep it in the sum
        if (m2 != m2) s = m2;
        return;
    }
    s = s * exp2f((m - mn) * APR_LOG2E) + s2 * exp2f((m2 - mn) * APR_LOG2E);
    m = mn;
}

// Block-wide merge; every thread gets the row's (max, sum).
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
__device__ void ce_fwd_bwd_body(T* __restrict__ logits, const long long* __restrict__ targets, long long vocab,
                                long long row_stride, long long ignore_index, float grad_scale,
                                const float* __restrict__ grad_scale_ptr, float* __restrict__ row_loss,
                                int vec4, int write_grad) {
    __shared__ float sm_max[32];
    __shared__ float sm_sum[32];
    const long long row = blockIdx.x;
    T* x = logits + row * row_stride;
    const long long target = targets[row];
    const bool ignored = (target == ignore_index);
    const bool bad_target = !ignored && (target < 0 || target >= vocab);

    float scale = grad_scale;
    if (grad_scale_ptr != nullptr) scale *= *grad_scale_ptr;

    if (ignored) {
        if (write_grad)
            for (long long i = threadIdx.x; i < vocab; i += blockDim.x) apr_store(x, i, 0.0f);
        if (threadIdx.x == 0) row_loss[row] = 0.0f;
        return;
    }

    // Pass 1: online max / sum-exp. The target logit is read before pass 2 overwrites it.
    float x_target = 0.0f;
    if (threadIdx.x == 0 && !bad_target) x_target = apr_load(x, target);
    float m = -APR_INF, s = 0.0f;
    const long long n_vec4 = vec4 ? vocab / 4 : 0;
    for (long long i4 = threadIdx.x; i4 < n_vec4; i4 += blockDim.x) {
        const float4 v = apr_load4(x, i4);
        const float mx = fmaxf(fmaxf(v.x, v.y), fmaxf(v.z, v.w));
        const float mn = fmaxf(m, mx);
        if (mn == -APR_INF) {  // fmaxf drops NaN: keep a NaN logit visible in the sum
            if (v.x != v.x || v.y != v.y || v.z != v.z || v.w != v.w) s = __int_as_float(0x7fc00000);
        } else {
            const float mn2 = mn * APR_LOG2E;
            s = s * exp2f(m * APR_LOG2E - mn2) + exp2f(v.x * APR_LOG2E - mn2) + exp2f(v.y * APR_LOG2E - mn2) +
                exp2f(v.z * APR_LOG2E - mn2) + exp2f(v.w * APR_LOG2E - mn2);
            m = mn;
        }
    }
    for (long long i = 4 * n_vec4 + threadIdx.x; i < vocab; i += blockDim.x) {
        const float v = apr_load(x, i);
        ce_merge(m, s, v, 1.0f);
    }
    ce_block_merge(m, s, sm_max, sm_sum);

    const float inv_s = 1.0f / s;
    const float m2 = m * APR_LOG2E;
    if (threadIdx.x == 0) {
        row_loss[row] = bad_target ? __int_as_float(0x7fc00000) : (logf(s) + m - x_target);
    }
    if (!write_grad) return;
    const float nan_or_zero = bad_target ? __int_as_float(0x7fc00000) : 0.0f;
    // Pass 2: gradient in place.
    for (long long i4 = threadIdx.x; i4 < n_vec4; i4 += blockDim.x) {
        float4 v = apr_load4(x, i4);
        const long long base = 4 * i4;
        v.x = (exp2f(v.x * APR_LOG2E - m2) * inv_s - (base + 0 == target ? 1.0f : 0.0f)) * scale + nan_or_zero;
        v.y = (exp2f(v.y * APR_LOG2E - m2) * inv_s - (base + 1 == target ? 1.0f : 0.0f)) * scale + nan_or_zero;
        v.z = (exp2f(v.z * APR_LOG2E - m2) * inv_s - (base + 2 == target ? 1.0f : 0.0f)) * scale + nan_or_zero;
        v.w = (exp2f(v.w * APR_LOG2E - m2) * inv_s - (base + 3 == target ? 1.0f : 0.0f)) * scale + nan_or_zero;
        apr_store4(x, i4, v);
    }
    for (long long i = 4 * n_vec4 + threadIdx.x; i < vocab; i += blockDim.x) {
        const float v = apr_load(x, i);
        apr_store(x, i, (exp2f(v * APR_LOG2E - m2) * inv_s - (i == target ? 1.0f : 0.0f)) * scale + nan_or_zero);
    }
}

#define APR_CE_KERNEL(NAME, T)                                                                            \
    extern "C" __global__ void NAME(T* __restrict__ logits, const long long* __restrict__ targets,       \
                                    long long vocab, long long row_stride, long long ignore_index,        \
                                    float grad_scale, const float* __restrict__ grad_scale_ptr,           \
                                    float* __restrict__ row_loss, int vec4, int write_grad) {             \
        ce_fwd_bwd_body<T>(logits, targets, vocab, row_stride, ignore_index, grad_scale, grad_scale_ptr, \
                           row_loss, vec4, write_grad);                                                   \
    }

APR_CE_KERNEL(apr_ce_fwd_bwd_f32, float)
APR_CE_KERNEL(apr_ce_fwd_bwd_bf16, apr_bf16)
APR_CE_KERNEL(apr_ce_fwd_bwd_f16, apr_f16)
