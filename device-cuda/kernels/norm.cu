// RMSNorm over rows: out = w * (x * rsqrt(mean(x^2) + eps)), one block per row.
#include "common.cuh"

template <typename Weight>
__device__ __forceinline__ float load_weight(const Weight* w, unsigned int i);

template <>
__device__ __forceinline__ float load_weight<float>(const float* w, unsigned int i) {
    return w[i];
}

template <>
__device__ __forceinline__ float load_weight<unsigned short>(const unsigned short* w, unsigned int i) {
    return bf16_to_f32(w[i]);
}

template <typename Weight>
__device__ __forceinline__ void rmsnorm_row(float* out, const float* x, const Weight* w, unsigned int rows,
                                            unsigned int dim, float eps) {
    unsigned int row = blockIdx.x;
    if (row >= rows) return;
    const float* in = x + (size_t)row * dim;
    float* dst = out + (size_t)row * dim;
    float squares = 0.0f;
    for (unsigned int i = threadIdx.x; i < dim; i += blockDim.x) squares += in[i] * in[i];
    float total = block_sum(squares);
    float inv = 1.0f / sqrtf(total / (float)dim + eps);
    for (unsigned int i = threadIdx.x; i < dim; i += blockDim.x) dst[i] = load_weight(w, i) * (in[i] * inv);
}

// f32 weights. Grid: rows blocks; blockDim.x a multiple of 32. `out` may equal `x`.
extern "C" __global__ void rmsnorm_f32(float* out, const float* x, const float* w, unsigned int rows,
                                       unsigned int dim, float eps) {
    rmsnorm_row(out, x, w, rows, dim, eps);
}

// bf16 weights, f32 activations.
extern "C" __global__ void rmsnorm_bf16(float* out, const float* x, const unsigned short* w, unsigned int rows,
                                        unsigned int dim, float eps) {
    rmsnorm_row(out, x, w, rows, dim, eps);
}
