// Mixture of experts (ARCH.md section 6) without a host round trip: the router of each token
// (sigmoid, correction bias, group-limited top-k, normalisation, scaling), the dispatch of the
// (token, expert) assignments sorted by expert and padded to whole tiles, the expert GEMMs over
// those tiles (a tile's rows all belong to one expert), and the weighted combine per token in
// ascending expert order (the host model's order).
#include "common.cuh"

#define MOE_TILE_ROWS 32
#define MOE_TILE_COLS 64
#define MOE_TILE_K 32
#define MOE_INVALID 0xffffffffu

__device__ __forceinline__ float moe_sigmoid(float a) { return 1.0f / (1.0f + expf(-a)); }

__device__ __forceinline__ float moe_corrected(const float* logits, const float* bias, unsigned int j) {
    return moe_sigmoid(logits[j]) + bias[j];
}

// Index of the largest corrected score among experts base..base+count, skipping `skip` (the first
// index on ties; the first candidate is taken whatever its value, as the host model's argmax).
__device__ __forceinline__ unsigned int moe_group_best(const float* logits, const float* bias, unsigned int base,
                                                       unsigned int count, unsigned int skip) {
    unsigned int best = MOE_INVALID;
    float best_value = 0.0f;
    for (unsigned int j = 0; j < count; ++j) {
        float v = j == skip ? -__int_as_float(0x7f800000) : moe_corrected(logits, bias, base + j);
        if (best == MOE_INVALID || v > best_value) {
            best = j;
            best_value = v;
        }
    }
    return best;
}

// One thread per token. logits [tokens, experts] (the gate GEMM); writes `k` (expert, weight)
// pairs per token to choice/weight [tokens, k] in choice order. groups <= 64, k <= experts.
extern "C" __global__ void moe_route(unsigned int* choice, float* weight, const float* logits, const float* bias,
                                     unsigned int tokens, unsigned int experts, unsigned int groups,
                                     unsigned int topk_groups, unsigned int k, unsigned int normalize, float scale) {
    unsigned int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= tokens || groups == 0 || groups > 64 || experts % groups != 0 || k > experts) return;
    const float* lg = logits + (size_t)t * experts;
    unsigned int per = experts / groups;
    float neg_inf = -__int_as_float(0x7f800000);
    unsigned long long kept = 0;
    for (unsigned int it = 0; it < topk_groups && it < groups; ++it) {
        unsigned int best = MOE_INVALID;
        float best_value = 0.0f;
        for (unsigned int grp = 0; grp < groups; ++grp) {
            float v = neg_inf;
            if (!((kept >> grp) & 1ull)) {
                unsigned int base = grp * per;
                unsigned int top = moe_group_best(lg, bias, base, per, MOE_INVALID);
                unsigned int second = moe_group_best(lg, bias, base, per, top);
                v = moe_corrected(lg, bias, base + top) + moe_corrected(lg, bias, base + second);
            }
            if (best == MOE_INVALID || v > best_value) {
                best = grp;
                best_value = v;
            }
        }
        kept |= 1ull << best;
    }
    unsigned int* chosen = choice + (size_t)t * k;
    float* w = weight + (size_t)t * k;
    float total = 0.0f;
    for (unsigned int j = 0; j < k; ++j) {
        unsigned int best = MOE_INVALID;
        float best_value = 0.0f;
        for (unsigned int x = 0; x < experts; ++x) {
            bool taken = false;
            for (unsigned int i = 0; i < j; ++i) taken = taken || chosen[i] == x;
            float v = (taken || !((kept >> (x / per)) & 1ull)) ? neg_inf : moe_corrected(lg, bias, x);
            if (best == MOE_INVALID || v > best_value) {
                best = x;
                best_value = v;
            }
        }
        chosen[j] = best;
        float s = moe_sigmoid(lg[best]);
        w[j] = s;
        total += s;
    }
    for (unsigned int j = 0; j < k; ++j) {
        float v = w[j];
        if (normalize) v /= total + 1e-20f;
        w[j] = v * scale;
    }
}

// Grid: experts blocks; blockDim.x a multiple of 32. counts[e] = assignments routed to expert e.
extern "C" __global__ void moe_count(unsigned int* counts, const unsigned int* choice, unsigned int assignments,
                                     unsigned int experts) {
    unsigned int e = blockIdx.x;
    if (e >= experts) return;
    unsigned int mine = 0;
    for (unsigned int a = threadIdx.x; a < assignments; a += blockDim.x) mine += choice[a] == e ? 1u : 0u;
    __shared__ unsigned int partial[32];
    unsigned int lane = threadIdx.x & 31u;
    unsigned int warp = threadIdx.x >> 5;
    for (int offset = 16; offset > 0; offset >>= 1) mine += __shfl_xor_sync(0xffffffffu, mine, offset);
    if (lane == 0) partial[warp] = mine;
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned int total = 0;
        for (unsigned int w = 0; w < (blockDim.x >> 5); ++w) total += partial[w];
        counts[e] = total;
    }
}

// Grid: experts blocks; blockDim.x a multiple of 32. Expert e's assignments take positions
// offset_e .. offset_e + counts[e] of `sorted` in assignment order (stable), where offset_e sums
// the earlier experts' counts rounded up to whole tiles; the rest of its tiles is padding
// (MOE_INVALID). tile_expert[tile] names each tile's expert (-1 past the last one);
// assign_pos[a] is assignment a's position.
extern "C" __global__ void moe_place(unsigned int* sorted, int* tile_expert, unsigned int* assign_pos,
                                     const unsigned int* counts, const unsigned int* choice, unsigned int assignments,
                                     unsigned int experts, unsigned int tile, unsigned int pad_cap,
                                     unsigned int tiles_cap) {
    __shared__ unsigned int warp_counts[32];
    unsigned int e = blockIdx.x;
    if (e >= experts || tile == 0) return;
    unsigned long long offset = 0;
    for (unsigned int x = 0; x < e; ++x) offset += (counts[x] + tile - 1) / tile * tile;
    unsigned int count = counts[e];
    unsigned long long padded = (unsigned long long)(count + tile - 1) / tile * tile;
    unsigned int lane = threadIdx.x & 31u;
    unsigned int warp = threadIdx.x >> 5;
    unsigned int warps = blockDim.x >> 5;
    unsigned long long base = 0;
    for (unsigned int chunk = 0; chunk < assignments; chunk += blockDim.x) {
        unsigned int a = chunk + threadIdx.x;
        bool mine = a < assignments && choice[a] == e;
        unsigned int ballot = __ballot_sync(0xffffffffu, mine);
        if (lane == 0) warp_counts[warp] = __popc(ballot);
        __syncthreads();
        unsigned int before = 0, total = 0;
        for (unsigned int w = 0; w < warps; ++w) {
            if (w < warp) before += warp_counts[w];
            total += warp_counts[w];
        }
        if (mine) {
            unsigned long long p = offset + base + before + __popc(ballot & ((1u << lane) - 1u));
            if (p < pad_cap) {
                sorted[p] = a;
                assign_pos[a] = (unsigned int)p;
            }
        }
        base += total;
        __syncthreads();
    }
    for (unsigned long long i = count + threadIdx.x; i < padded; i += blockDim.x) {
        if (offset + i < pad_cap) sorted[offset + i] = MOE_INVALID;
    }
    for (unsigned long long t = offset / tile + threadIdx.x; t < (offset + padded) / tile; t += blockDim.x) {
        if (t < tiles_cap) tile_expert[t] = (int)e;
    }
    if (e + 1 == experts) {
        for (unsigned long long t = (offset + padded) / tile + threadIdx.x; t < tiles_cap; t += blockDim.x) {
            tile_expert[t] = -1;
        }
    }
}

template <typename Weight>
__device__ __forceinline__ float moe_load(const Weight* w, unsigned long long i);

template <>
__device__ __forceinline__ float moe_load<float>(const float* w, unsigned long long i) {
    return w[i];
}

template <>
__device__ __forceinline__ float moe_load<unsigned short>(const unsigned short* w, unsigned long long i) {
    return bf16_to_f32(w[i]);
}

// Grid: (ceil(out_dim / 64), tiles); 256 threads. Tile t's 32 rows (positions t*32.. of `sorted`)
// all belong to expert tile_expert[t]: out[pos, :] = x[src, :] . W_e^T (+ bias_e), ReLU^2 when
// `relu2`, where src is the assignment's token (`gather`, x [tokens, in_dim]) or the position
// itself (x [pad_cap, in_dim]). W is stacked [experts, out_dim, in_dim]. Padding rows are skipped.
template <typename Weight>
__device__ __forceinline__ void moe_gemm(float* out, const float* x, const Weight* w, const float* bias,
                                         const unsigned int* sorted, const int* tile_expert, unsigned int tiles,
                                         unsigned int experts, unsigned int k, unsigned int x_rows,
                                         unsigned int in_dim, unsigned int out_dim, unsigned int gather,
                                         unsigned int relu2) {
    __shared__ float xs[MOE_TILE_ROWS][MOE_TILE_K + 1];
    __shared__ float ws[MOE_TILE_COLS][MOE_TILE_K + 1];
    __shared__ unsigned int src[MOE_TILE_ROWS];
    unsigned int tile = blockIdx.y;
    if (tile >= tiles || blockDim.x != 256 || k == 0) return;
    int expert = tile_expert[tile];
    if (expert < 0 || (unsigned int)expert >= experts) return;
    unsigned int tid = threadIdx.x;
    size_t row0 = (size_t)tile * MOE_TILE_ROWS;
    unsigned int col0 = blockIdx.x * MOE_TILE_COLS;
    if (tid < MOE_TILE_ROWS) {
        unsigned int a = sorted[row0 + tid];
        unsigned int s = MOE_INVALID;
        if (a != MOE_INVALID) s = gather ? a / k : (unsigned int)(row0 + tid);
        src[tid] = s < x_rows ? s : MOE_INVALID;
    }
    __syncthreads();
    unsigned int c = tid % MOE_TILE_COLS;
    unsigned int rgroup = tid / MOE_TILE_COLS;  // 4 groups of 8 rows
    float acc[8];
    for (unsigned int i = 0; i < 8; ++i) acc[i] = 0.0f;
    const Weight* we = w + (unsigned long long)expert * out_dim * in_dim;
    for (unsigned int k0 = 0; k0 < in_dim; k0 += MOE_TILE_K) {
        for (unsigned int idx = tid; idx < MOE_TILE_ROWS * MOE_TILE_K; idx += 256) {
            unsigned int r = idx / MOE_TILE_K, kk = idx % MOE_TILE_K;
            unsigned int s = src[r];
            xs[r][kk] = (s != MOE_INVALID && k0 + kk < in_dim) ? x[(size_t)s * in_dim + k0 + kk] : 0.0f;
        }
        for (unsigned int idx = tid; idx < MOE_TILE_COLS * MOE_TILE_K; idx += 256) {
            unsigned int cc = idx / MOE_TILE_K, kk = idx % MOE_TILE_K;
            unsigned int col = col0 + cc;
            ws[cc][kk] = (col < out_dim && k0 + kk < in_dim)
                             ? moe_load(we, (unsigned long long)col * in_dim + k0 + kk)
                             : 0.0f;
        }
        __syncthreads();
        for (unsigned int kk = 0; kk < MOE_TILE_K; ++kk) {
            float wv = ws[c][kk];
            for (unsigned int i = 0; i < 8; ++i) acc[i] += xs[rgroup * 8 + i][kk] * wv;
        }
        __syncthreads();
    }
    unsigned int col = col0 + c;
    if (col >= out_dim) return;
    for (unsigned int i = 0; i < 8; ++i) {
        unsigned int r = rgroup * 8 + i;
        if (src[r] == MOE_INVALID) continue;
        float v = acc[i];
        if (bias) v += bias[(size_t)expert * out_dim + col];
        if (relu2) {
            v = v > 0.0f ? v : 0.0f;
            v = v * v;
        }
        out[(row0 + r) * out_dim + col] = v;
    }
}

extern "C" __global__ void moe_gemm_f32(float* out, const float* x, const float* w, const float* bias,
                                        const unsigned int* sorted, const int* tile_expert, unsigned int tiles,
                                        unsigned int experts, unsigned int k, unsigned int x_rows,
                                        unsigned int in_dim, unsigned int out_dim, unsigned int gather,
                                        unsigned int relu2) {
    moe_gemm(out, x, w, bias, sorted, tile_expert, tiles, experts, k, x_rows, in_dim, out_dim, gather, relu2);
}

extern "C" __global__ void moe_gemm_bf16(float* out, const float* x, const unsigned short* w, const float* bias,
                                         const unsigned int* sorted, const int* tile_expert, unsigned int tiles,
                                         unsigned int experts, unsigned int k, unsigned int x_rows,
                                         unsigned int in_dim, unsigned int out_dim, unsigned int gather,
                                         unsigned int relu2) {
    moe_gemm(out, x, w, bias, sorted, tile_expert, tiles, experts, k, x_rows, in_dim, out_dim, gather, relu2);
}

// Grid: (ceil(dim / blockDim.x), tokens). out[t, :] = sum over t's k experts in ascending expert
// order of weight * expert_out[position, :], accumulated from zero as the host model does.
extern "C" __global__ void moe_combine(float* out, const float* expert_out, const unsigned int* choice,
                                       const float* weight, const unsigned int* assign_pos, unsigned int tokens,
                                       unsigned int k, unsigned int dim, unsigned int pad_cap) {
    unsigned int t = blockIdx.y;
    unsigned int col = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= tokens || col >= dim) return;
    const unsigned int* chosen = choice + (size_t)t * k;
    float acc = 0.0f;
    unsigned int last = 0;
    bool started = false;
    for (unsigned int step = 0; step < k; ++step) {
        // The smallest expert id above the last one taken (ids are distinct per token).
        unsigned int pick = MOE_INVALID;
        unsigned int pick_j = 0;
        for (unsigned int j = 0; j < k; ++j) {
            unsigned int e = chosen[j];
            if ((!started || e > last) && (pick == MOE_INVALID || e < pick)) {
                pick = e;
                pick_j = j;
            }
        }
        if (pick == MOE_INVALID) break;
        started = true;
        last = pick;
        unsigned int p = assign_pos[(size_t)t * k + pick_j];
        if (p < pad_cap) acc += expert_out[(size_t)p * dim + col] * weight[(size_t)t * k + pick_j];
    }
    out[(size_t)t * dim + col] = acc;
}
