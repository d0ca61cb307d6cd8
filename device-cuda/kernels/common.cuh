// Shared by every kernel of this folder: the SIMT emulation on the host, bf16 conversions and the
// block reductions. Compiled by NVRTC (where __CUDACC__ is defined) and as C++ by SimRuntime.
#pragma once

#if !defined(__CUDACC__)
#include "sim/simt.h"
#define SIM_DYNAMIC_SHARED(type, name) type* name = static_cast<type*>(::simt::dynamic_shared())
#else
#define SIM_DYNAMIC_SHARED(type, name) extern __shared__ type name[]
#endif

// bf16 travels as its raw 16 bits (the upper half of an f32), so no cuda_bf16.h is needed and the
// host and the device agree bit for bit on every conversion.
__device__ __forceinline__ float bf16_to_f32(unsigned short bits) {
    return __uint_as_float(((unsigned int)bits) << 16);
}

// Round to nearest even, NaN kept quiet.
__device__ __forceinline__ unsigned short f32_to_bf16(float value) {
    unsigned int bits = __float_as_uint(value);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((bits >> 16) | 0x0040u);
    unsigned int rounding = 0x7fffu + ((bits >> 16) & 1u);
    return (unsigned short)((bits + rounding) >> 16);
}

__device__ __forceinline__ float warp_sum(float value) {
    for (int offset = 16; offset > 0; offset >>= 1) value += __shfl_xor_sync(0xffffffffu, value, offset);
    return value;
}

// The sum of `value` over the block, in a fixed order (lanes by xor butterfly, then warps in
// order), returned to every thread. blockDim.x must be a multiple of 32, at most 1024.
__device__ __forceinline__ float block_sum(float value) {
    __shared__ float partial[32];
    unsigned int lane = threadIdx.x & 31u;
    unsigned int warp = threadIdx.x >> 5;
    unsigned int warps = blockDim.x >> 5;
    value = warp_sum(value);
    if (lane == 0) partial[warp] = value;
    __syncthreads();
    float total = 0.0f;
    for (unsigned int w = 0; w < warps; ++w) total += partial[w];
    __syncthreads();
    return total;
}

// The better of two (value, index) candidates for an argmax: the larger value, the smaller index
// on ties (torch.argmax's first maximum). NaN loses to every number.
__device__ __forceinline__ bool argmax_better(float value, unsigned int index, float best, unsigned int best_index) {
    if (value != value) return false;
    if (best != best) return true;
    return value > best || (value == best && index < best_index);
}
