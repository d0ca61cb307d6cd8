// Copies the effects need: gathering scattered KV blocks into one staging buffer (spill) and
// scattering them back (restore), bit for bit (32-bit words, whatever they hold).
#include "common.cuh"

// dst[i * words + j] = pool[ids[i] * words + j]. Grid-stride over count * words. An id at or past
// pool_blocks (the router never sends one) is skipped instead of reading past the pool.
extern "C" __global__ void gather_blocks(unsigned int* dst, const unsigned int* pool, const unsigned int* ids,
                                         unsigned int count, unsigned long long words, unsigned int pool_blocks) {
    unsigned long long total = (unsigned long long)count * words;
    unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += stride) {
        unsigned long long block = i / words;
        unsigned long long word = i - block * words;
        unsigned int id = ids[block];
        if (id < pool_blocks) dst[i] = pool[(unsigned long long)id * words + word];
    }
}

// pool[ids[i] * words + j] = src[i * words + j]; ids at or past pool_blocks are skipped.
extern "C" __global__ void scatter_blocks(unsigned int* pool, const unsigned int* src, const unsigned int* ids,
                                          unsigned int count, unsigned long long words, unsigned int pool_blocks) {
    unsigned long long total = (unsigned long long)count * words;
    unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += stride) {
        unsigned long long block = i / words;
        unsigned long long word = i - block * words;
        unsigned int id = ids[block];
        if (id < pool_blocks) pool[(unsigned long long)id * words + word] = src[i];
    }
}

// out[i] = bf16(in[i]) (round to nearest even): the activations a bf16 GEMM takes.
extern "C" __global__ void f32_to_bf16_n(unsigned short* out, const float* in, unsigned long long n) {
    unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        out[i] = f32_to_bf16(in[i]);
    }
}
