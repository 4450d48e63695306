// Fused AdamW over one group's flat float32 buffers (DESIGN.md decision 3): one launch reads
// param, grad, m, v and writes param, m, v (and optionally a 16-bit compute copy of param).
//
// The op sequence of torch.optim.AdamW's single-tensor path (non-amsgrad), element by element,
// with the same float32 roundings torch's CUDA kernels make (fma where they contract):
//   g     = grad * grad_scale [* *grad_scale_ptr]                  (grad.mul_(scale))
//   p     = p * decay_keep            only inside the decay ranges  (p.mul_(1 - lr * wd))
//   m     = lerp(m, g, 1 - beta1)                                   (exp_avg.lerp_(g, 1 - beta1))
//   v     = v * beta2 + (1 - beta2) * g * g                         (mul_(beta2).addcmul_(g, g, 1 - beta2))
//   p     = p - step_size * (m / (sqrt(v) * inv_sqrt_bc2 + eps))    (addcdiv_(m, denom, -step_size))
// decay_keep = 1 - lr * wd, 1 - beta1, 1 - beta2 and step_size = lr / (1 - beta1^step) are computed
// on the host in double precision and rounded to float32 once, exactly as torch rounds its
// Python-scalar arguments; inv_sqrt_bc2 = 1.0f / float(sqrt(1 - beta2^step)) in float32, which is
// what torch's CUDA division by a host scalar (sqrt(v) / sqrt_bc2) multiplies by. Each torch op
// rounds its result, so the kernel keeps those roundings (__fmul_rn: no contraction into an fma).
//
// grad_scale_ptr (optional, a device float32 scalar) keeps clipping and fp16 unscaling on the
// device: the host never reads the norm. found_inf_ptr (optional, a device scalar of float32
// (found_inf_kind 1) or bool/uint8 (found_inf_kind 2)): when nonzero the kernel writes nothing,
// so an overflowed or non-finite step is skipped without a host sync.
//
// Weight decay applies to the elements in [decay_ranges[2r], decay_ranges[2r+1]) for r < n_ranges
// (sorted, disjoint, merged on the host; a transformer block has two: attention and MLP matrices).
//
// bf16 state (apr_adamw_bf16_sr*, training.state_dtype: bf16): param, exp_avg and exp_avg_sq are
// bfloat16, the gradient float32 or bfloat16; the same float32 update on their float32 values, each
// result stored with stochastic rounding (apr_common.cuh), keyed per tensor by the host
// (apr.kernels.interface.rounding_keys: seed, step, group). Scalar loop only.
//
// Vector path: elements [0, 4 * n_vec4) as float4 (16-byte accesses; the host passes n_vec4 = 0
// unless every buffer is 16-byte aligned and the copy 8-byte aligned); the scalar loop does the
// tail, so any length works.
#include "apr_common.cuh"

#define APR_ADAMW_THREADS 256

__device__ __forceinline__ bool adamw_in_ranges(long long idx, const long long* __restrict__ ranges, int n_ranges) {
    for (int r = 0; r < n_ranges; ++r) {
        if (idx >= ranges[2 * r] && idx < ranges[2 * r + 1]) return true;
    }
    return false;
}

struct AdamwScalars {
    float decay_keep, beta1, one_minus_beta1, beta2, one_minus_beta2, eps, step_size, inv_sqrt_bc2, scale;
};

// torch's lerp (ATen/native/Lerp.h): self + w * (end - self) for |w| < 0.5, else
// end - (end - self) * (1 - w); nvcc contracts the first form into one fma.
__device__ __forceinline__ float adamw_lerp(float self, float end, float w) {
    return (fabsf(w) < 0.5f) ? fmaf(w, end - self, self) : end - (end - self) * (1.0f - w);
}

__device__ __forceinline__ float adamw_update(float p, float grad, float& m, float& v, bool decays,
                                              const AdamwScalars& s) {
    const float g = __fmul_rn(grad, s.scale);
    if (decays) p = __fmul_rn(p, s.decay_keep);
    m = adamw_lerp(m, g, s.one_minus_beta1);
    v = fmaf(s.one_minus_beta2, __fmul_rn(g, g), __fmul_rn(v, s.beta2));
    const float denom = __fadd_rn(__fmul_rn(sqrtf(v), s.inv_sqrt_bc2), s.eps);
    return fmaf(-s.step_size, m / denom, p);
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
__device__ __forceinline__ void adamw_body(float* __restrict__ param, const float* __restrict__ grad,
                                           float* __restrict__ exp_avg, float* __restrict__ exp_avg_sq,
                                           void* __restrict__ param_copy, const long long* __restrict__ decay_ranges,
                                           int n_ranges, const float* __restrict__ grad_scale_ptr,
                                           const void* __restrict__ found_inf_ptr, int found_inf_kind, long long n,
                                           long long n_vec4, AdamwScalars s) {
    if (found_inf_kind == 1 && *reinterpret_cast<const float*>(found_inf_ptr) != 0.0f) return;
    if (found_inf_kind == 2 && *reinterpret_cast<const unsigned char*>(found_inf_ptr) != 0) return;
    if (grad_scale_ptr != nullptr) s.scale *= *grad_scale_ptr;
    const long long stride = (long long)gridDim.x * blockDim.x;
    const long long tid = (long long)blockIdx.x * blockDim.x + threadIdx.x;

    for (long long i4 = tid; i4 < n_vec4; i4 += stride) {
        const long long base = 4 * i4;
        float4 p = reinterpret_cast<const float4*>(param)[i4];
        const float4 g = reinterpret_cast<const float4*>(grad)[i4];
        float4 m = reinterpret_cast<const float4*>(exp_avg)[i4];
        float4 v = reinterpret_cast<const float4*>(exp_avg_sq)[i4];
        bool d0 = false, d1 = false, d2 = false, d3 = false;
        if (n_ranges > 0) {
            d0 = adamw_in_ranges(base, decay_ranges, n_ranges);
            d3 = adamw_in_ranges(base + 3, decay_ranges, n_ranges);
            if (d0 == d3) {  // ranges are whole matrices: the four almost always share one
                d1 = d2 = d0;
                if (d0 != adamw_in_ranges(base + 1, decay_ranges, n_ranges) ||
                    d0 != adamw_in_ranges(base + 2, decay_ranges, n_ranges)) {
                    d1 = adamw_in_ranges(base + 1, decay_ranges, n_ranges);
                    d2 = adamw_in_ranges(base + 2, decay_ranges, n_ranges);
                }
            } else {
                d1 = adamw_in_ranges(base + 1, decay_ranges, n_ranges);
                d2 = adamw_in_ranges(base + 2, decay_ranges, n_ranges);
            }
        }
        p.x = adamw_update(p.x, g.x, m.x, v.x, d0, s);
        p.y = adamw_update(p.y, g.y, m.y, v.y, d1, s);
        p.z = adamw_update(p.z, g.z, m.z, v.z, d2, s);
        p.w = adamw_update(p.w, g.w, m.w, v.w, d3, s);
        reinterpret_cast<float4*>(param)[i4] = p;
        reinterpret_cast<float4*>(exp_avg)[i4] = m;
        reinterpret_cast<float4*>(exp_avg_sq)[i4] = v;
        adamw_store_copy4<COPY_KIND>(param_copy, i4, p);
    }
    for (long long i = 4 * n_vec4 + tid; i < n; i += stride) {
        float m = exp_avg[i], v = exp_avg_sq[i];
        const bool d = n_ranges > 0 && adamw_in_ranges(i, decay_ranges, n_ranges);
        const float p = adamw_update(param[i], grad[i], m, v, d, s);
        param[i] = p;
        exp_avg[i] = m;
        exp_avg_sq[i] = v;
        adamw_store_copy<COPY_KIND>(param_copy, i, p);
    }
}

#define APR_ADAMW_KERNEL(NAME, COPY_KIND)                                                                        \
    extern "C" __global__ void __launch_bounds__(APR_ADAMW_THREADS)                                              \
        NAME(float* __restrict__ param, const float* __restrict__ grad, float* __restrict__ exp_avg,             \
             float* __restrict__ exp_avg_sq, void* __restrict__ param_copy,                                      \
             const long long* __restrict__ decay_ranges, int n_ranges, const float* __restrict__ grad_scale_ptr, \
             const void* __restrict__ found_inf_ptr, int found_inf_kind, long long n, long long n_vec4,          \
             float decay_keep, float beta1, float one_minus_beta1, float beta2, float one_minus_beta2,           \
             float eps, float step_size, float inv_sqrt_bc2, float grad_scale) {                                     \
        AdamwScalars s;                                                                                          \
        s.decay_keep = decay_keep;                                                                               \
        s.beta1 = beta1;                                                                                         \
        s.one_minus_beta1 = one_minus_beta1;                                                                     \
        s.beta2 = beta2;                                                                                         \
        s.one_minus_beta2 = one_minus_beta2;                                                                     \
        s.eps = eps;                                                                                             \
        s.step_size = step_size;                                                                                 \
        s.inv_sqrt_bc2 = inv_sqrt_bc2;                                                                           \
        s.scale = grad_scale;                                                                                    \
        adamw_body<COPY_KIND>(param, grad, exp_avg, exp_avg_sq, param_copy, decay_ranges, n_ranges,              \
                              grad_scale_ptr, found_inf_ptr, found_inf_kind, n, n_vec4, s);                      \
    }

APR_ADAMW_KERNEL(apr_adamw_f32, 0)
APR_ADAMW_KERNEL(apr_adamw_f32_copy_bf16, 1)
APR_ADAMW_KERNEL(apr_adamw_f32_copy_f16, 2)

template <int GRAD_BF16>
__device__ __forceinline__ void adamw_bf16_sr_body(apr_bf16* __restrict__ param, const void* __restrict__ grad,
                                                   apr_bf16* __restrict__ exp_avg, apr_bf16* __restrict__ exp_avg_sq,
                                                   const long long* __restrict__ decay_ranges, int n_ranges,
                                                   const float* __restrict__ grad_scale_ptr,
                                                   const void* __restrict__ found_inf_ptr, int found_inf_kind,
                                                   long long n, unsigned int key_param, unsigned int key_m,
                                                   unsigned int key_v, AdamwScalars s) {
    if (found_inf_kind == 1 && *reinterpret_cast<const float*>(found_inf_ptr) != 0.0f) return;
    if (found_inf_kind == 2 && *reinterpret_cast<const unsigned char*>(found_inf_ptr) != 0) return;
    if (grad_scale_ptr != nullptr) s.scale *= *grad_scale_ptr;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const float g = GRAD_BF16 ? apr_load(reinterpret_cast<const apr_bf16*>(grad), i)
                                  : reinterpret_cast<const float*>(grad)[i];
        float m = apr_load(exp_avg, i), v = apr_load(exp_avg_sq, i);
        const bool d = n_ranges > 0 && adamw_in_ranges(i, decay_ranges, n_ranges);
        const float p = adamw_update(apr_load(param, i), g, m, v, d, s);
        param[i].bits = apr_f32_to_bf16_bits_sr(p, apr_rounding_noise(i, key_param));
        exp_avg[i].bits = apr_f32_to_bf16_bits_sr(m, apr_rounding_noise(i, key_m));
        exp_avg_sq[i].bits = apr_f32_to_bf16_bits_sr(v, apr_rounding_noise(i, key_v));
    }
}

#define APR_ADAMW_BF16_KERNEL(NAME, GRAD_BF16)                                                                   \
    extern "C" __global__ void __launch_bounds__(APR_ADAMW_THREADS)                                              \
        NAME(apr_bf16* __restrict__ param, const void* __restrict__ grad, apr_bf16* __restrict__ exp_avg,        \
             apr_bf16* __restrict__ exp_avg_sq, const long long* __restrict__ decay_ranges, int n_ranges,        \
             const float* __restrict__ grad_scale_ptr, const void* __restrict__ found_inf_ptr,                   \
             int found_inf_kind, long long n, int key_param, int key_m, int key_v, float decay_keep,             \
             float beta1, float one_minus_beta1, float beta2, float one_minus_beta2, float eps, float step_size,  \
             float inv_sqrt_bc2, float grad_scale) {                                                             \
        AdamwScalars s;                                                                                          \
        s.decay_keep = decay_keep;                                                                               \
        s.beta1 = beta1;                                                                                         \
        s.one_minus_beta1 = one_minus_beta1;                                                                     \
        s.beta2 = beta2;                                                                                         \
        s.one_minus_beta2 = one_minus_beta2;                                                                     \
        s.eps = eps;                                                                                             \
        s.step_size = step_size;                                                                                 \
        s.inv_sqrt_bc2 = inv_sqrt_bc2;                                                                           \
        s.scale = grad_scale;                                                                                    \
        adamw_bf16_sr_body<GRAD_BF16>(param, grad, exp_avg, exp_avg_sq, decay_ranges, n_ranges, grad_scale_ptr,  \
                                      found_inf_ptr, found_inf_kind, n, (unsigned int)key_param,                 \
                                      (unsigned int)key_m, (unsigned int)key_v, s);                              \
    }

APR_ADAMW_BF16_KERNEL(apr_adamw_bf16_sr, 0)
APR_ADAMW_BF16_KERNEL(apr_adamw_bf16_sr_grad_bf16, 1)
