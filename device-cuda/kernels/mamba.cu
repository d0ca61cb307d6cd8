// The Mamba2 mixer between its two GEMMs (ARCH.md section 3): the causal depthwise conv over a
// run of tokens continuing from the slot's conv history, the SSM as the token-by-token recurrence over
// a run (or, opted into, a chunked scan (SSD) over a prefill run) continuing from the slot's state, and
// the gated RMSNorm over groups.
//
// A step's rows are grouped in runs: consecutive rows of one sequence in position order. A run
// is six words: first row, length, start position, state slot, offset of its block table in the
// tables array, length of its block table (see forward.rs). State is f32 in the host model's slot
// layout: per Mamba layer the last K-1 pre-conv xBC vectors, oldest first, then S [H, P, N].
// By default every run's SSM is the token-by-token recurrence (`mamba_ssm_run`), bit-identical
// however the work is cut; the chunked scan is the opt-in for long prompts, exact only to
// rounding (its chunks start at each run's start).
#include "common.cuh"

#define MAMBA_MAX_HISTORY 8

__device__ __forceinline__ float mamba_silu(float a) { return a / (1.0f + expf(-a)); }

// log(1 + e^a), the identity above 20 as in torch.
__device__ __forceinline__ float mamba_softplus(float a) { return a > 20.0f ? a : log1pf(expf(a)); }

// Grid: (ceil(conv_dim / blockDim.x), runs). One thread per (run, channel) walks the run's tokens
// in order: conv over the K-1 previous inputs and this one, bias, SiLU into `out` [rows, conv_dim];
// the last K-1 inputs go back to the slot's conv history. `snapshots` (null, or one word per row:
// a state slot, or any value >= num_slots for none) receives the history as it is after the
// row's token: a verification's rewind points.
extern "C" __global__ void mamba_conv(float* out, const float* proj, float* states, const float* weight,
                                      const float* bias, const unsigned int* runs, unsigned int num_runs,
                                      unsigned int num_rows, unsigned int conv_dim, unsigned int proj_dim,
                                      unsigned int xbc_offset, unsigned int kernel, unsigned long long slot_floats,
                                      unsigned long long layer_offset, unsigned int num_slots,
                                      const unsigned int* snapshots) {
    unsigned int run = blockIdx.y;
    unsigned int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (run >= num_runs || c >= conv_dim || kernel == 0 || kernel > MAMBA_MAX_HISTORY + 1) return;
    const unsigned int* r = runs + (size_t)run * 6;
    unsigned int first = r[0], len = r[1], slot = r[3];
    if (slot >= num_slots || first > num_rows || len > num_rows - first) return;
    float* history = states + (size_t)slot * slot_floats + layer_offset;
    unsigned int keep = kernel - 1;
    float hist[MAMBA_MAX_HISTORY];
    for (unsigned int j = 0; j < keep; ++j) hist[j] = history[(size_t)j * conv_dim + c];
    const float* w = weight + (size_t)c * kernel;
    for (unsigned int t = 0; t < len; ++t) {
        size_t row = first + t;
        float x = proj[row * proj_dim + xbc_offset + c];
        float acc = 0.0f;
        for (unsigned int j = 0; j < keep; ++j) acc += w[j] * hist[j];
        acc += w[keep] * x;
        if (bias) acc += bias[c];
        out[row * conv_dim + c] = mamba_silu(acc);
        if (keep > 0) {
            for (unsigned int j = 0; j + 1 < keep; ++j) hist[j] = hist[j + 1];
            hist[keep - 1] = x;
        }
        if (snapshots) {
            unsigned int snap = snapshots[row];
            if (snap < num_slots) {
                float* copy = states + (size_t)snap * slot_floats + layer_offset;
                for (unsigned int j = 0; j < keep; ++j) copy[(size_t)j * conv_dim + c] = hist[j];
            }
        }
    }
    for (unsigned int j = 0; j < keep; ++j) history[(size_t)j * conv_dim + c] = hist[j];
}


// Grid: (H, runs); dynamic shared memory (3Q + 2QN + QP + Q^2) floats. Each block scans one head
// of one run of at least `min_len` tokens in chunks of Q = `chunk` tokens (the SSD algorithm):
// inside a chunk the output is (C B^T . L) dt x with L the decays from cumulative sums of dt A,
// plus the decayed contribution of the state at the chunk's start; the state then advances by
// the whole chunk. The state lives in the slot (global memory), read at each chunk's start and
// written at its end. Equal to the per-token recurrence in exact arithmetic.
extern "C" __global__ void mamba_ssm_chunked(float* y, const float* xbc, const float* proj, float* states,
                                             const float* dt_bias, const float* a, const float* d_skip,
                                             const unsigned int* runs, unsigned int num_runs, unsigned int num_rows,
                                             unsigned int heads, unsigned int head_dim, unsigned int state,
                                             unsigned int groups, unsigned int conv_dim, unsigned int proj_dim,
                                             unsigned int dt_offset, unsigned long long slot_floats,
                                             unsigned long long ssm_offset, unsigned int num_slots,
                                             unsigned int chunk, float dt_min, unsigned int min_len) {
    unsigned int head = blockIdx.x;
    unsigned int run = blockIdx.y;
    if (run >= num_runs || head >= heads || groups == 0 || heads % groups != 0 || chunk == 0) return;
    const unsigned int* r = runs + (size_t)run * 6;
    unsigned int first = r[0], len = r[1], slot = r[3];
    if (len < min_len || slot >= num_slots || first > num_rows || len > num_rows - first) return;
    unsigned int inner = heads * head_dim;
    unsigned int g = head / (heads / groups);
    SIM_DYNAMIC_SHARED(float, smem);
    float* s_dt = smem;
    float* s_cum = s_dt + chunk;
    float* s_w = s_cum + chunk;
    float* s_b = s_w + chunk;
    float* s_c = s_b + (size_t)chunk * state;
    float* s_x = s_c + (size_t)chunk * state;
    float* s_m = s_x + (size_t)chunk * head_dim;
    float* s = states + (size_t)slot * slot_floats + ssm_offset + (size_t)head * head_dim * state;
    float a_h = a[head];
    float d_h = d_skip[head];
    float bias = dt_bias[head];
    unsigned int tid = threadIdx.x;
    unsigned int threads = blockDim.x;
    for (unsigned int t0 = 0; t0 < len; t0 += chunk) {
        unsigned int q = len - t0 < chunk ? len - t0 : chunk;
        size_t row0 = first + t0;
        for (unsigned int i = tid; i < q; i += threads) {
            float dt = mamba_softplus(proj[(row0 + i) * proj_dim + dt_offset + head] + bias);
            s_dt[i] = dt > dt_min ? dt : dt_min;
        }
        for (unsigned int idx = tid; idx < q * state; idx += threads) {
            unsigned int i = idx / state, n = idx % state;
            const float* v = xbc + (row0 + i) * conv_dim + inner;
            s_b[idx] = v[g * state + n];
            s_c[idx] = v[(groups + g) * state + n];
        }
        for (unsigned int idx = tid; idx < q * head_dim; idx += threads) {
            unsigned int i = idx / head_dim, p = idx % head_dim;
            s_x[idx] = xbc[(row0 + i) * conv_dim + head * head_dim + p];
        }
        __syncthreads();
        if (tid == 0) {
            float cum = 0.0f;
            for (unsigned int i = 0; i < q; ++i) {
                cum += s_dt[i] * a_h;
                s_cum[i] = cum;
            }
            for (unsigned int i = 0; i < q; ++i) s_w[i] = expf(cum - s_cum[i]) * s_dt[i];
        }
        __syncthreads();
        // M[i][j] = (C_i . B_j) exp(cum_i - cum_j) dt_j for j <= i.
        for (unsigned int idx = tid; idx < q * q; idx += threads) {
            unsigned int i = idx / q, j = idx % q;
            float m = 0.0f;
            if (j <= i) {
                float dot = 0.0f;
                for (unsigned int n = 0; n < state; ++n) dot += s_c[i * state + n] * s_b[j * state + n];
                m = dot * expf(s_cum[i] - s_cum[j]) * s_dt[j];
            }
            s_m[idx] = m;
        }
        __syncthreads();
        for (unsigned int idx = tid; idx < q * head_dim; idx += threads) {
            unsigned int i = idx / head_dim, p = idx % head_dim;
            float intra = 0.0f;
            for (unsigned int j = 0; j <= i; ++j) intra += s_m[i * q + j] * s_x[j * head_dim + p];
            float inter = 0.0f;
            const float* sp = s + (size_t)p * state;
            for (unsigned int n = 0; n < state; ++n) inter += s_c[i * state + n] * sp[n];
            float out = intra + expf(s_cum[i]) * inter + d_h * s_x[idx];
            y[(row0 + i) * inner + head * head_dim + p] = out;
        }
        __syncthreads();
        float decay = expf(s_cum[q - 1]);
        for (unsigned int idx = tid; idx < head_dim * state; idx += threads) {
            unsigned int p = idx / state, n = idx % state;
            float acc = decay * s[idx];
            for (unsigned int j = 0; j < q; ++j) acc += s_w[j] * s_x[j * head_dim + p] * s_b[j * state + n];
            s[idx] = acc;
        }
        __syncthreads();
    }
}

// Grid: (H, runs); blockDim.x a multiple of 32. The recurrence, token by token, over each run of
// 1 to `max_len` tokens (a decode row is a run of one): S = exp(dt A) S + (dt B) x,
// y = S . C + D x. Warp w takes channels p = w, w + warps, ...; its lanes take the state's
// columns and keep them across the run's tokens. Every token goes through exactly the same
// operations in the same order whatever run it is part of and wherever the run starts, so a
// position's output and state do not depend on how the sequence was cut into runs (prefix hits,
// prefill chunks, decode rows): the bit-exact scan (forward.rs `SsmScan::Sequential`).
// `snapshots` (null, or one word per row: a state slot, or any value >= num_slots for none)
// receives the head's state as it is after the row's token: a verification's rewind points.
extern "C" __global__ void mamba_ssm_run(float* y, const float* xbc, const float* proj, float* states,
                                         const float* dt_bias, const float* a, const float* d_skip,
                                         const unsigned int* runs, unsigned int num_runs, unsigned int num_rows,
                                         unsigned int heads, unsigned int head_dim, unsigned int state,
                                         unsigned int groups, unsigned int conv_dim, unsigned int proj_dim,
                                         unsigned int dt_offset, unsigned long long slot_floats,
                                         unsigned long long ssm_offset, unsigned int num_slots, float dt_min,
                                         unsigned int max_len, const unsigned int* snapshots) {
    unsigned int head = blockIdx.x;
    unsigned int run = blockIdx.y;
    if (run >= num_runs || head >= heads || groups == 0 || heads % groups != 0) return;
    const unsigned int* r = runs + (size_t)run * 6;
    unsigned int first = r[0], len = r[1], slot = r[3];
    if (len == 0 || len > max_len || slot >= num_slots || first > num_rows || len > num_rows - first) return;
    unsigned int inner = heads * head_dim;
    unsigned int g = head / (heads / groups);
    float* s = states + (size_t)slot * slot_floats + ssm_offset + (size_t)head * head_dim * state;
    unsigned int lane = threadIdx.x & 31u;
    unsigned int warp = threadIdx.x >> 5;
    unsigned int warps = blockDim.x >> 5;
    for (unsigned int p = warp; p < head_dim; p += warps) {
        float* sp = s + (size_t)p * state;
        for (unsigned int t = 0; t < len; ++t) {
            size_t row = first + t;
            float dt = mamba_softplus(proj[row * proj_dim + dt_offset + head] + dt_bias[head]);
            dt = dt > dt_min ? dt : dt_min;
            float decay = expf(dt * a[head]);
            const float* v = xbc + row * conv_dim;
            const float* b = v + inner + g * state;
            const float* c = v + inner + (groups + g) * state;
            float x = v[head * head_dim + p];
            float* copy = nullptr;
            if (snapshots && snapshots[row] < num_slots) {
                copy = states + (size_t)snapshots[row] * slot_floats + ssm_offset +
                       ((size_t)head * head_dim + p) * state;
            }
            float acc = 0.0f;
            for (unsigned int n = lane; n < state; n += 32) {
                float next = sp[n] * decay + (dt * b[n]) * x;
                sp[n] = next;
                if (copy) copy[n] = next;
                acc += next * c[n];
            }
            acc = warp_sum(acc);
            if (lane == 0) y[row * inner + head * head_dim + p] = acc + d_skip[head] * x;
        }
    }
}

// Grid: (groups, rows); blockDim.x a multiple of 32. The gate first, then RMSNorm per group
// (norm_before_gate = False): q = y * silu(z); y = w * (q * rsqrt(mean_group(q^2) + eps)), in place.
extern "C" __global__ void mamba_gated_norm(float* y, const float* proj, const float* weight, unsigned int rows,
                                            unsigned int inner, unsigned int groups, unsigned int proj_dim,
                                            float eps) {
    unsigned int g = blockIdx.x;
    unsigned int row = blockIdx.y;
    if (row >= rows || g >= groups || inner % groups != 0) return;
    unsigned int size = inner / groups;
    float* v = y + (size_t)row * inner + (size_t)g * size;
    const float* z = proj + (size_t)row * proj_dim + (size_t)g * size;
    const float* w = weight + (size_t)g * size;
    float squares = 0.0f;
    for (unsigned int i = threadIdx.x; i < size; i += blockDim.x) {
        float q = v[i] * mamba_silu(z[i]);
        v[i] = q;
        squares += q * q;
    }
    float total = block_sum(squares);
    float inv = 1.0f / sqrtf(total / (float)size + eps);
    for (unsigned int i = threadIdx.x; i < size; i += blockDim.x) v[i] = w[i] * (v[i] * inv);
}
