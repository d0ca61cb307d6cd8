// Device readback: the argmax of each row's logits (optionally over a mask of allowed ids), written
// to the step's output tokens and to the row's feed cell, which a DecodeFed step reads on the device.
#include "common.cuh"

__device__ __forceinline__ void argmax_row(const float* logits, const unsigned char* mask, unsigned int rows,
                                           unsigned int vocab, unsigned int* out, unsigned int* feed) {
    __shared__ float best_values[32];
    __shared__ unsigned int best_indices[32];
    unsigned int row = blockIdx.x;
    if (row >= rows) return;
    const float* values = logits + (size_t)row * vocab;
    const unsigned char* allowed = mask ? mask + (size_t)row * vocab : nullptr;
    float best = 0.0f;
    unsigned int best_index = 0xffffffffu;
    for (unsigned int i = threadIdx.x; i < vocab; i += blockDim.x) {
        if (allowed && !allowed[i]) continue;
        float v = values[i];
        if (best_index == 0xffffffffu ? v == v : argmax_better(v, i, best, best_index)) {
            best = v;
            best_index = i;
        }
    }
    // A lane with no candidate carries index 0xffffffff, which loses every comparison below.
    for (int offset = 16; offset > 0; offset >>= 1) {
        float other = __shfl_xor_sync(0xffffffffu, best, offset);
        unsigned int other_index = __shfl_xor_sync(0xffffffffu, best_index, offset);
        bool take = other_index != 0xffffffffu &&
                    (best_index == 0xffffffffu || argmax_better(other, other_index, best, best_index));
        if (take) {
            best = other;
            best_index = other_index;
        }
    }
    unsigned int lane = threadIdx.x & 31u;
    unsigned int warp = threadIdx.x >> 5;
    if (lane == 0) {
        best_values[warp] = best;
        best_indices[warp] = best_index;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned int warps = blockDim.x >> 5;
        float b = best_values[0];
        unsigned int bi = best_indices[0];
        for (unsigned int w = 1; w < warps; ++w) {
            unsigned int wi = best_indices[w];
            if (wi != 0xffffffffu && (bi == 0xffffffffu || argmax_better(best_values[w], wi, b, bi))) {
                b = best_values[w];
                bi = wi;
            }
        }
        // A row with no candidate (every value NaN, or nothing allowed by its mask) answers
        // 0xffffffff; the router reports it as a failed step instead of feeding it.
        out[row] = bi;
        if (feed) feed[row] = bi;
    }
}

// Grid: rows blocks; blockDim.x a multiple of 32. `feed` may be null.
extern "C" __global__ void argmax_rows(const float* logits, unsigned int rows, unsigned int vocab, unsigned int* out,
                                       unsigned int* feed) {
    argmax_row(logits, nullptr, rows, vocab, out, feed);
}

// As argmax_rows over the ids whose mask byte is non-zero (`mask` is rows x vocab bytes).
extern "C" __global__ void argmax_masked_rows(const float* logits, const unsigned char* mask, unsigned int rows,
                                              unsigned int vocab, unsigned int* out, unsigned int* feed) {
    argmax_row(logits, mask, rows, vocab, out, feed);
}
