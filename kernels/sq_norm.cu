// Squared L2 norm of a flat buffer, reduced on the device (no host sync), for gradient clipping,
// the fp16 overflow check and logging. Two launches and no atomics, so the result is bitwise
// reproducible for a given size and grid (exact resume): pass 1 writes one double per block,
// pass 2 sums them in a fixed order in one block and writes (or adds to) a float32 scalar.
//
// Each element is squared in float32 (one rounding; an overflow to inf is what marks an fp16
// overflow) and accumulated in double. vec4 (n_vec4 > 0) needs 16-byte aligned float32 or 8-byte
// aligned 16-bit input (checked on the host); the scalar loop does the tail.
#include "apr_common.cuh"

#define APR_SQ_NORM_THREADS 256
#define APR_SQ_NORM_FINISH_THREADS 1024

template <typename T>
__device__ __forceinline__ void sq_norm_partial_body(const T* __restrict__ x, long long n, long long n_vec4,
                                                     double* __restrict__ partials) {
    __shared__ double scratch[32];
    const long long stride = (long long)gridDim.x * blockDim.x;
    const long long tid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    double acc = 0.0;
    for (long long i4 = tid; i4 < n_vec4; i4 += stride) {
        const float4 v = apr_load4(x, i4);
        acc += (double)__fmul_rn(v.x, v.x) + (double)__fmul_rn(v.y, v.y) + (double)__fmul_rn(v.z, v.z) +
               (double)__fmul_rn(v.w, v.w);
    }
    for (long long i = 4 * n_vec4 + tid; i < n; i += stride) {
        const float v = apr_load(x, i);
        acc += (double)__fmul_rn(v, v);
    }
    acc = apr_block_sum(acc, scratch);
    if (threadIdx.x == 0) partials[blockIdx.x] = acc;
}

#define APR_SQ_NORM_PARTIAL(NAME, T)                                                                            \
    extern "C" __global__ void __launch_bounds__(APR_SQ_NORM_THREADS)                                           \
        NAME(const T* __restrict__ x, long long n, long long n_vec4, double* __restrict__ partials) {           \
        sq_norm_partial_body<T>(x, n, n_vec4, partials);                                                        \
    }

APR_SQ_NORM_PARTIAL(apr_sq_norm_partial_f32, float)
APR_SQ_NORM_PARTIAL(apr_sq_norm_partial_bf16, apr_bf16)
APR_SQ_NORM_PARTIAL(apr_sq_norm_partial_f16, apr_f16)

// One block of APR_SQ_NORM_FINISH_THREADS threads (blockDim.x a multiple of 32). accumulate != 0
// adds to *out (a global norm summed over groups without a torch op).
extern "C" __global__ void __launch_bounds__(APR_SQ_NORM_FINISH_THREADS)
    apr_sq_norm_finish(const double* __restrict__ partials, int n_partials, float* __restrict__ out,
                       int accumulate) {
    __shared__ double scratch[32];
    double acc = 0.0;
    for (int i = threadIdx.x; i < n_partials; i += blockDim.x) acc += partials[i];
    acc = apr_block_sum(acc, scratch);
    if (threadIdx.x == 0) {
        const double prev = accumulate ? (double)(*out) : 0.0;
        *out = (float)(prev + acc);
    }
}
