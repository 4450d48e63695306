// Helpers shared by apr's kernels. Compiled by NVRTC (through cupy.RawModule) and, in CI, by nvcc
// (and by g++ for the CPU emulation test, with APR_HOST_EMULATION defined).
// No system or CUDA headers on purpose: NVRTC without a CUDA toolkit (pip-installed CuPy) has none,
// so 16-bit floats are handled as raw bits and converted here.
#pragma once

#define APR_INF __int_as_float(0x7f800000)

// Storage tags for 16-bit floats: distinct types so that overloads pick the right conversion.
struct apr_bf16 { unsigned short bits; };
struct apr_f16 { unsigned short bits; };

__device__ __forceinline__ bool apr_isfinite(float x) {
    return (__float_as_uint(x) & 0x7f800000u) != 0x7f800000u;
}

// float32 -> bfloat16 with round-to-nearest-even; NaN stays a quiet NaN (what torch's .to(bfloat16) does).
__device__ __forceinline__ unsigned short apr_f32_to_bf16_bits(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (unsigned short)(u >> 16);
}

__device__ __forceinline__ float apr_bf16_bits_to_f32(unsigned short b) {
    return __uint_as_float(((unsigned int)b) << 16);
}

// Stochastic rounding to bfloat16 (training.state_dtype: bf16): 16 bits of noise added to the float32
// bits, the low 16 dropped, so the expected stored value is the float32 one. The noise of element i
// is a counter-based hash of (key, i), MurmurHash3's fmix32, so it depends on neither the launch
// shape nor the thread: apr/kernels/torch_backend.py stochastic_round_bf16 draws the same bits.
__device__ __forceinline__ unsigned int apr_fmix32(unsigned int h) {
    h ^= h >> 16;
    h *= 0x85ebca6bu;
    h ^= h >> 13;
    h *= 0xc2b2ae35u;
    h ^= h >> 16;
    return h;
}

__device__ __forceinline__ unsigned int apr_rounding_noise(long long i, unsigned int key) {
    unsigned int h = apr_fmix32((unsigned int)((unsigned long long)i & 0xffffffffull) ^ key);
    const unsigned int hi = (unsigned int)((unsigned long long)i >> 32);
    if (hi != 0u) h = apr_fmix32(h + hi);
    return h >> 16;
}

__device__ __forceinline__ unsigned short apr_f32_to_bf16_bits_sr(float f, unsigned int noise) {
    return (unsigned short)((__float_as_uint(f) + noise) >> 16);
}

#ifdef APR_HOST_EMULATION
// The CPU emulation in tests/kernels (g++, threads standing in for a block) has no PTX: its prelude
// defines these two with the host's _Float16, which also rounds to nearest even.
#else
__device__ __forceinline__ unsigned short apr_f32_to_f16_bits(float f) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

__device__ __forceinline__ float apr_f16_bits_to_f32(unsigned short h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}
#endif

// Scalar load/store as float32 for each storage type.
__device__ __forceinline__ float apr_load(const float* p, long long i) { return p[i]; }
__device__ __forceinline__ float apr_load(const apr_bf16* p, long long i) { return apr_bf16_bits_to_f32(p[i].bits); }
__device__ __forceinline__ float apr_load(const apr_f16* p, long long i) { return apr_f16_bits_to_f32(p[i].bits); }
__device__ __forceinline__ void apr_store(float* p, long long i, float v) { p[i] = v; }
__device__ __forceinline__ void apr_store(apr_bf16* p, long long i, float v) { p[i].bits = apr_f32_to_bf16_bits(v); }
__device__ __forceinline__ void apr_store(apr_f16* p, long long i, float v) { p[i].bits = apr_f32_to_f16_bits(v); }

// Four consecutive elements starting at 4*i4 in one 16-byte (float) or 8-byte (16-bit) access.
// The caller guarantees the alignment (checked on the host).
__device__ __forceinline__ float4 apr_load4(const float* p, long long i4) {
    return reinterpret_cast<const float4*>(p)[i4];
}
__device__ __forceinline__ float4 apr_load4(const apr_bf16* p, long long i4) {
    uint2 w = reinterpret_cast<const uint2*>(p)[i4];
    return make_float4(__uint_as_float(w.x << 16), __uint_as_float(w.x & 0xffff0000u),
                       __uint_as_float(w.y << 16), __uint_as_float(w.y & 0xffff0000u));
}
__device__ __forceinline__ float4 apr_load4(const apr_f16* p, long long i4) {
    uint2 w = reinterpret_cast<const uint2*>(p)[i4];
    return make_float4(apr_f16_bits_to_f32((unsigned short)(w.x & 0xffffu)),
                       apr_f16_bits_to_f32((unsigned short)(w.x >> 16)),
                       apr_f16_bits_to_f32((unsigned short)(w.y & 0xffffu)),
                       apr_f16_bits_to_f32((unsigned short)(w.y >> 16)));
}
__device__ __forceinline__ void apr_store4(float* p, long long i4, float4 v) {
    reinterpret_cast<float4*>(p)[i4] = v;
}
__device__ __forceinline__ void apr_store4(apr_bf16* p, long long i4, float4 v) {
    uint2 w;
    w.x = (unsigned int)apr_f32_to_bf16_bits(v.x) | ((unsigned int)apr_f32_to_bf16_bits(v.y) << 16);
    w.y = (unsigned int)apr_f32_to_bf16_bits(v.z) | ((unsigned int)apr_f32_to_bf16_bits(v.w) << 16);
    reinterpret_cast<uint2*>(p)[i4] = w;
}
__device__ __forceinline__ void apr_store4(apr_f16* p, long long i4, float4 v) {
    uint2 w;
    w.x = (unsigned int)apr_f32_to_f16_bits(v.x) | ((unsigned int)apr_f32_to_f16_bits(v.y) << 16);
    w.y = (unsigned int)apr_f32_to_f16_bits(v.z) | ((unsigned int)apr_f32_to_f16_bits(v.w) << 16);
    reinterpret_cast<uint2*>(p)[i4] = w;
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024). Every thread gets the total.
// `scratch` holds 32 values in shared memory; the function ends with the scratch free for reuse.
__device__ __forceinline__ double apr_block_sum(double v, double* scratch) {
    const unsigned int lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
    const unsigned int n_warps = blockDim.x >> 5;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = (lane < n_warps) ? scratch[lane] : 0.0;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
    __syncthreads();
    return v;
}
