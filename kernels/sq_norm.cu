// Squared L2 norm of a flat float32 buffer, reduced on the device (no host sync), for gradient
// clipping and logging. Two passes and no atomics, so the result is bitwise reproducible for a
// given size and grid (exact resume): pass 1 writes one double per block, pass 2 sums them in a
// fixed order in one block and writes (or adds to) a float32 scalar.
#include "apr_common.cuh"

extern "C" __global__ void apr_sq_norm_partial_f32(const float* __restrict__ x, long long n, long long n_vec4,
                                                   double* __restrict__ partials) {
    __shared__ double scratch[32];
    const long long stride = (long long)gridDim.x * blockDim.x;
    const long long tid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    double acc = 0.0;
    for (long long i4 = tid; i4 < n_vec4; i4 += stride) {
        const float4 v = reinterpret_cast<const float4*>(x)[i4];
        // Square in float32 (exact enough: one rounding), accumulate in double.
        acc += (double)(v.x * v.x) + (double)(v.y * v.y) + (double)(v.z * v.z) + (double)(v.w * v.w);
    }
    for (long long i = 4 * n_vec4 + tid; i < n; i += stride) {
        const float v = x[i];
        acc += (double)(v * v);
    }
    acc = apr_block_sum(acc, scratch);
    if (threadIdx.x == 0) partials[blockIdx.x] = acc;
}

// One block. accumulate != 0 adds to *out (a global norm summed over groups without a torch op).
extern "C" __global__ void apr_sq_norm_finish(const double* __restrict__ partials, int n_partials,
                                              float* __restrict__ out, int accumulate) {
    __shared__ double scratch[32];
    double acc = 0.0;
    for (int i = threadIdx.x; i < n_partials; i += blockDim.x) acc += partials[i];
    acc = apr_block_sum(acc, scratch);
    if (threadIdx.x == 0) {
        const double prev = accumulate ? (double)(*out) : 0.0;
        *out = (float)(prev + acc);
    }
}
