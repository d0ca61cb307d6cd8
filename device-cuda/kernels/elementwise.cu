// The glue of the forward step: bias and ReLU^2 after a GEMM, the residual add fused with the next
// block's RMSNorm, a plain add, and the final RMSNorm of the rows that want logits.
#include "common.cuh"

// Grid-stride over rows * cols: x = act(x + bias[col]) with act ReLU^2 when `relu2`, else none.
// `bias` may be null.
extern "C" __global__ void bias_act(float* x, const float* bias, unsigned int rows, unsigned int cols,
                                    unsigned int relu2) {
    unsigned long long total = (unsigned long long)rows * cols;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        float v = x[i];
        if (bias) v += bias[i % cols];
        if (relu2) {
            v = v > 0.0f ? v : 0.0f;
            v = v * v;
        }
        x[i] = v;
    }
}

// Grid-stride: dst[i] += src[i].
extern "C" __global__ void add_into(float* dst, const float* src, unsigned long long count) {
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < count;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        dst[i] += src[i];
    }
}

// Grid: rows blocks; blockDim.x a multiple of 32. hidden += add (when not null), then
// normed = w * (hidden * rsqrt(mean(hidden^2) + eps)): a block's residual and the next block's norm.
extern "C" __global__ void residual_rmsnorm(float* hidden, const float* add, float* normed, const float* w,
                                            unsigned int rows, unsigned int dim, float eps) {
    unsigned int row = blockIdx.x;
    if (row >= rows) return;
    float* h = hidden + (size_t)row * dim;
    float* n = normed + (size_t)row * dim;
    const float* a = add ? add + (size_t)row * dim : nullptr;
    float squares = 0.0f;
    for (unsigned int i = threadIdx.x; i < dim; i += blockDim.x) {
        float v = h[i];
        if (a) {
            v += a[i];
            h[i] = v;
        }
        squares += v * v;
    }
    float total = block_sum(squares);
    float inv = 1.0f / sqrtf(total / (float)dim + eps);
    for (unsigned int i = threadIdx.x; i < dim; i += blockDim.x) n[i] = w[i] * (h[i] * inv);
}

// Grid: count blocks; blockDim.x a multiple of 32. out[i] = RMSNorm(x[rows_idx[i]]) with f32
// weights; an index at or past x_rows gives a row of zeros.
extern "C" __global__ void rmsnorm_select(float* out, const float* x, const unsigned int* rows_idx, const float* w,
                                          unsigned int count, unsigned int x_rows, unsigned int dim, float eps) {
    unsigned int i = blockIdx.x;
    if (i >= count) return;
    unsigned int row = rows_idx[i];
    float* dst = out + (size_t)i * dim;
    if (row >= x_rows) {
        for (unsigned int j = threadIdx.x; j < dim; j += blockDim.x) dst[j] = 0.0f;
        return;
    }
    const float* in = x + (size_t)row * dim;
    float squares = 0.0f;
    for (unsigned int j = threadIdx.x; j < dim; j += blockDim.x) squares += in[j] * in[j];
    float total = block_sum(squares);
    float inv = 1.0f / sqrtf(total / (float)dim + eps);
    for (unsigned int j = threadIdx.x; j < dim; j += blockDim.x) dst[j] = w[j] * (in[j] * inv);
}
