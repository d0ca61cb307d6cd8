// Step inputs: resolving fed tokens (DecodeFed) and the embedding gather.
#include "common.cuh"

// tokens[i] = feed[sources[i]] when sources[i] >= 0 (the device argmax of row sources[i] of the
// previous step), else host_tokens[i]. One thread per row. A source outside the feed_len cells
// (the router never sends one) reads nothing and gives 0xffffffff, which no embedding row has.
extern "C" __global__ void feed_inputs(unsigned int* tokens, const unsigned int* host_tokens, const int* sources,
                                       const unsigned int* feed, unsigned int feed_len, unsigned int rows) {
    unsigned int row = blockIdx.x * blockDim.x + threadIdx.x;
    if (row >= rows) return;
    int source = sources[row];
    if (source < 0) {
        tokens[row] = host_tokens[row];
    } else {
        tokens[row] = (unsigned int)source < feed_len ? feed[source] : 0xffffffffu;
    }
}

// out[r, :] = table[tokens[r], :] (hidden floats per row). Grid: (ceil(hidden / blockDim.x), rows).
// A token outside the vocabulary (the router never sends one) gives a zero row instead of a wild read.
extern "C" __global__ void embedding_gather_f32(float* out, const float* table, const unsigned int* tokens,
                                                unsigned int rows, unsigned int hidden, unsigned int vocab) {
    unsigned int row = blockIdx.y;
    unsigned int col = blockIdx.x * blockDim.x + threadIdx.x;
    if (row >= rows || col >= hidden) return;
    unsigned int token = tokens[row];
    float value = token < vocab ? table[(size_t)token * hidden + col] : 0.0f;
    out[(size_t)row * hidden + col] = value;
}

// As embedding_gather_f32 with a bf16 table.
extern "C" __global__ void embedding_gather_bf16(float* out, const unsigned short* table, const unsigned int* tokens,
                                                 unsigned int rows, unsigned int hidden, unsigned int vocab) {
    unsigned int row = blockIdx.y;
    unsigned int col = blockIdx.x * blockDim.x + threadIdx.x;
    if (row >= rows || col >= hidden) return;
    unsigned int token = tokens[row];
    float value = token < vocab ? bf16_to_f32(table[(size_t)token * hidden + col]) : 0.0f;
    out[(size_t)row * hidden + col] = value;
}
