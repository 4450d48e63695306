// Fused AdamW over one group's flat float32 buffers (DESIGN.md decision 3): one launch reads
// param, grad, m, v and writes param, m, v (and optionally a 16-bit compute copy of param).
//
// Same arithmetic as torch.optim.AdamW (non-fused, non-amsgrad, default eps placement):
//   g     = grad * grad_scale [* *grad_scale_ptr]
//   p     = p * (1 - lr * wd)            only inside the decay ranges (norms are outside)
//   m     = beta1 * m + (1 - beta1) * g
//   v     = beta2 * v + (1 - beta2) * g * g
//   p     = p - step_size * m / (sqrt(v) * inv_sqrt_bc2 + eps)
// with step_size = lr / (1 - beta1^step) and inv_sqrt_bc2 = 1 / sqrt(1 - beta2^step), both
// computed on the host in double precision.
//
// grad_scale_ptr (optional, a device float32 scalar) lets clipping and fp16 unscaling stay on the
// device: the host never reads the norm. found_inf_ptr (optional, a device float32 scalar): when it
// is nonzero the kernel writes nothing, so an fp16 overflow skips the step without a host sync.
//
// Weight decay applies to the elements in [decay_ranges[2r], decay_ranges[2r+1]) for r < n_ranges
// (sorted, disjoint, merged on the host; a block has two: attention and MLP matrices).
#include "apr_common.cuh"

__device__ __forceinline__ float adamw_decay_factor(long long idx, const long long* __restrict__ ranges,
                                                    int n_ranges, float decay_factor) {
    for (int r = 0; r < n_ranges; ++r) {
        if (idx >= ranges[2 * r] && idx < ranges[2 * r + 1]) return decay_factor;
    }
    return 1.0f;
}

__device__ __forceinline__ float adamw_update(float p, float g, float& m, float& v, float decay, float beta1,
                                              float beta2, float step_size, float inv_sqrt_bc2, float eps) {
    p *= decay;
    m = fmaf(beta1, m, (1.0f - beta1) * g);
    v = fmaf(beta2, v, (1.0f - beta2) * g * g);
    const float denom = sqrtf(v) * inv_sqrt_bc2 + eps;
    return p - step_size * (m / denom);
}

// copy_kind: 0 no compute copy, 1 bfloat16, 2 float16 (param_copy then points at 16-bit storage).
template <int COPY_KIND>
__device__ __forceinline__ void adamw_store_copy(void* param_copy, long long i, float p) {
    if (COPY_KIND == 1) apr_store(reinterpret_cast<apr_bf16*>(param_copy), i, p);
    if (COPY_KIND == 2) apr_store(reinterpret_cast<apr_f16*>(param_copy), i, p);
}

template <int COPY_KIND>
__device__ __forceinline__ void adamw_store_copy4(void* param_copy, long long i4, float4 p) {
    if (COPY_KIND == 1) apr_store4(reinterpret_cast<apr_bf16*>(param_copy), i4, p);
    if (COPY_KIND == 2) apr_store4(reinterpret_cast<apr_f16*>(param_copy), i4, p);
}

template <int COPY_KIND>
__device__ void adamw_body(float* __restrict__ param, const float* __restrict__ grad, float* __restrict__ exp_avg,
                           float* __restrict__ exp_avg_sq, void* __restrict__ param_copy,
                           const long long* __restrict__ decay_ranges, int n_ranges,
                           const float* __restrict__ grad_scale_ptr, const float* __restrict__ found_inf_ptr,
                           long long n, long long n_vec4, float lr,
                           float beta1, float beta2, float eps, float weight_decay, float step_size,
                           float inv_sqrt_bc2, float grad_scale) {
    if (found_inf_ptr != nullptr && *found_inf_ptr != 0.0f) return;  // skipped step: touch nothing
    float scale = grad_scale;
    if (grad_scale_ptr != nullptr) scale *= *grad_scale_ptr;
    const float decay = 1.0f - lr * weight_decay;
    const long long stride = (long long)gridDim.x * blockDim.x;
    const long long tid = (long long)blockIdx.x * blockDim.x + threadIdx.x;

    // Vector part: elements [0, 4 * n_vec4) as float4 (all pointers 16-byte aligned, checked on the host).
    for (long long i4 = tid; i4 < n_vec4; i4 += stride) {
        const long long base = 4 * i4;
        float4 p = reinterpret_cast<const float4*>(param)[i4];
        const float4 g = reinterpret_cast<const float4*>(grad)[i4];
        float4 m = reinterpret_cast<const float4*>(exp_avg)[i4];
        float4 v = reinterpret_cast<const float4*>(exp_avg_sq)[i4];
        float d0, d1, d2, d3;
        d0 = adamw_decay_factor(base, decay_ranges, n_ranges, decay);
        // One lookup covers all four when they share a range (almost always: ranges are whole matrices).
        if (adamw_decay_factor(base + 3, decay_ranges, n_ranges, decay) == d0 &&
            adamw_decay_factor(base + 1, decay_ranges, n_ranges, decay) == d0 &&
            adamw_decay_factor(base + 2, decay_ranges, n_ranges, decay) == d0) {
            d1 = d2 = d3 = d0;
        } else {
            d1 = adamw_decay_factor(base + 1, decay_ranges, n_ranges, decay);
            d2 = adamw_decay_factor(base + 2, decay_ranges, n_ranges, decay);
            d3 = adamw_decay_factor(base + 3, decay_ranges, n_ranges, decay);
        }
        p.x = adamw_update(p.x, g.x * scale, m.x, v.x, d0, beta1, beta2, step_size, inv_sqrt_bc2, eps);
        p.y = adamw_update(p.y, g.y * scale, m.y, v.y, d1, beta1, beta2, step_size, inv_sqrt_bc2, eps);
        p.z = adamw_update(p.z, g.z * scale, m.z, v.z, d2, beta1, beta2, step_size, inv_sqrt_bc2, eps);
        p.w = adamw_update(p.w, g.w * scale, m.w, v.w, d3, beta1, beta2, step_size, inv_sqrt_bc2, eps);
        reinterpret_cast<float4*>(param)[i4] = p;
        reinterpret_cast<float4*>(exp_avg)[i4] = m;
        reinterpret_cast<float4*>(exp_avg_sq)[i4] = v;
        adamw_store_copy4<COPY_KIND>(param_copy, i4, p);
    }
    // Scalar tail (and the whole buffer when it is not aligned).
    for (long long i = 4 * n_vec4 + tid; i < n; i += stride) {
        float m = exp_avg[i], v = exp_avg_sq[i];
        const float d = adamw_decay_factor(i, decay_ranges, n_ranges, decay);
        const float p = adamw_update(param[i], grad[i] * scale, m, v, d, beta1, beta2, step_size, inv_sqrt_bc2, eps);
        param[i] = p;
        exp_avg[i] = m;
        exp_avg_sq[i] = v;
        adamw_store_copy<COPY_KIND>(param_copy, i, p);
    }
}

#define APR_ADAMW_KERNEL(NAME, COPY_KIND)                                                                      \
    extern "C" __global__ void NAME(float* __restrict__ param, const float* __restrict__ grad,                \
                                    float* __restrict__ exp_avg, float* __restrict__ exp_avg_sq,               \
                                    void* __restrict__ param_copy, const long long* __restrict__ decay_ranges, \
                                    int n_ranges, const float* __restrict__ grad_scale_ptr,                    \
                                    const float* __restrict__ found_inf_ptr, long long n,                      \
                                    long long n_vec4, float lr, float beta1, float beta2, float eps,           \
                                    float weight_decay, float step_size, float inv_sqrt_bc2,                   \
                                    float grad_scale) {                                                        \
        adamw_body<COPY_KIND>(param, grad, exp_avg, exp_avg_sq, param_copy, decay_ranges, n_ranges,            \
                              grad_scale_ptr, found_inf_ptr, n, n_vec4, lr, beta1, beta2, eps, weight_decay, step_size,       \
                              inv_sqrt_bc2, grad_scale);                                                       \
    }

APR_ADAMW_KERNEL(apr_adamw_f32, 0)
APR_ADAMW_KERNEL(apr_adamw_f32_copy_bf16, 1)
APR_ADAMW_KERNEL(apr_adamw_f32_copy_f16, 2)
