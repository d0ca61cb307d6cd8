// Attention over the paged KV pool (ARCH.md section 4: causal, grouped-query, no positional
// encoding): the K/V write of a step's rows, and the attention of each row's query over keys
// 0..=pos of its sequence's block table, split across thread blocks (flash-decoding) and merged.
//
// Pool layout (f32, the host model's): block b is `block_floats` floats; attention layer l owns
// `2 * block_size * kv_heads * head_dim` of them at `layer_offset`, K then V, each
// [block_size, kv_heads, head_dim]. Rows and runs are described as in mamba.cu: row_pos[row],
// row_run[row], six words per run (first row, length, start, slot, table offset, table length).
#include "common.cuh"

#define ATTN_MAX_HEAD_DIM 256
#define ATTN_MAX_WARPS 32

__device__ __forceinline__ float attn_neg_inf() { return -__int_as_float(0x7f800000); }

// The pool index of token `pos`'s K row of `kv_head`, or ~0 when the table does not cover it.
__device__ __forceinline__ unsigned long long attn_key_index(const unsigned int* tables, unsigned int tables_len,
                                                             unsigned int table_offset, unsigned int table_len,
                                                             unsigned int pos,
                                                             unsigned int block_size, unsigned long long block_floats,
                                                             unsigned long long layer_offset, unsigned int num_blocks,
                                                             unsigned int kv_heads, unsigned int head_dim,
                                                             unsigned int kv_head) {
    unsigned int slot = pos / block_size;
    if (slot >= table_len || (unsigned long long)table_offset + slot >= tables_len) return ~0ull;
    unsigned int block = tables[table_offset + slot];
    if (block >= num_blocks) return ~0ull;
    return (unsigned long long)block * block_floats + layer_offset +
           ((unsigned long long)(pos % block_size) * kv_heads + kv_head) * head_dim;
}

// Grid: (ceil(kv_heads * head_dim / blockDim.x), rows). Writes each row's K and V (columns
// k_offset.. and k_offset + kv_heads*head_dim.. of its qkv row) at its position.
extern "C" __global__ void kv_write(float* pool, const float* qkv, const unsigned int* row_pos,
                                    const unsigned int* row_run, const unsigned int* runs, const unsigned int* tables,
                                    unsigned int tables_len, unsigned int rows, unsigned int num_runs, unsigned int qkv_dim,
                                    unsigned int k_offset, unsigned int kv_heads, unsigned int head_dim,
                                    unsigned int block_size, unsigned long long block_floats,
                                    unsigned long long layer_offset, unsigned int num_blocks) {
    unsigned int row = blockIdx.y;
    unsigned int width = kv_heads * head_dim;
    unsigned int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (row >= rows || c >= width) return;
    unsigned int run = row_run[row];
    if (run >= num_runs) return;
    const unsigned int* r = runs + (size_t)run * 6;
    unsigned long long at = attn_key_index(tables, tables_len, r[4], r[5], row_pos[row], block_size, block_floats, layer_offset,
                                           num_blocks, kv_heads, head_dim, 0);
    if (at == ~0ull) return;
    const float* src = qkv + (size_t)row * qkv_dim + k_offset;
    pool[at + c] = src[c];
    pool[at + (unsigned long long)block_size * width + c] = src[width + c];
}

// Grid: (splits, heads, rows or list_len); blockDim.x a multiple of 32, at most 1024. Block
// (split, head, z) takes row z, or row row_list[z] when row_list is not null (the decode rows of a
// step whose prefill rows go to attention_tile), and attends the row's query head over keys [split * split_keys, min(pos + 1, (split+1) * split_keys))
// with an online softmax per warp (warp w takes keys w, w + warps, ...; lanes take dimensions),
// merges its warps and writes (max, sum, unnormalised output[head_dim]) to
// partial[((row * heads + head) * splits + split) * (head_dim + 2)].
extern "C" __global__ void attention_split(float* partial, const float* qkv, const float* pool,
                                           const unsigned int* row_pos, const unsigned int* row_run,
                                           const unsigned int* runs, const unsigned int* tables, unsigned int tables_len,
                                           unsigned int rows, unsigned int num_runs, unsigned int heads, unsigned int kv_heads,
                                           unsigned int head_dim, unsigned int qkv_dim, unsigned int block_size,
                                           unsigned long long block_floats, unsigned long long layer_offset,
                                           unsigned int num_blocks, unsigned int splits, unsigned int split_keys,
                                           float scale, const unsigned int* row_list, unsigned int list_len) {
    __shared__ float s_max[ATTN_MAX_WARPS];
    __shared__ float s_sum[ATTN_MAX_WARPS];
    SIM_DYNAMIC_SHARED(float, s_acc);  // [warps, head_dim]
    unsigned int split = blockIdx.x;
    unsigned int head = blockIdx.y;
    unsigned int row = blockIdx.z;
    if (row_list != 0) {
        if (row >= list_len) return;
        row = row_list[row];
    }
    if (row >= rows || head >= heads || split >= splits || kv_heads == 0 || heads % kv_heads != 0 ||
        head_dim > ATTN_MAX_HEAD_DIM)
        return;
    unsigned int run = row_run[row];
    if (run >= num_runs) return;
    const unsigned int* r = runs + (size_t)run * 6;
    unsigned int pos = row_pos[row];
    unsigned int kv_head = head / (heads / kv_heads);
    unsigned int lane = threadIdx.x & 31u;
    unsigned int warp = threadIdx.x >> 5;
    unsigned int warps = blockDim.x >> 5;
    const float* q = qkv + (size_t)row * qkv_dim + (size_t)head * head_dim;
    float qv[ATTN_MAX_HEAD_DIM / 32];
    float acc[ATTN_MAX_HEAD_DIM / 32];
    for (unsigned int i = 0; i < ATTN_MAX_HEAD_DIM / 32; ++i) {
        unsigned int d = lane + 32 * i;
        qv[i] = d < head_dim ? q[d] : 0.0f;
        acc[i] = 0.0f;
    }
    float m = attn_neg_inf();
    float l = 0.0f;
    unsigned long long start = (unsigned long long)split * split_keys;
    unsigned long long end = start + split_keys;
    if (end > (unsigned long long)pos + 1) end = (unsigned long long)pos + 1;
    unsigned long long value_offset = (unsigned long long)block_size * kv_heads * head_dim;
    for (unsigned long long s = start + warp; s < end; s += warps) {
        unsigned long long at = attn_key_index(tables, tables_len, r[4], r[5], (unsigned int)s, block_size, block_floats,
                                               layer_offset, num_blocks, kv_heads, head_dim, kv_head);
        if (at == ~0ull) continue;
        const float* k = pool + at;
        float dot = 0.0f;
        for (unsigned int i = 0; i < ATTN_MAX_HEAD_DIM / 32; ++i) {
            unsigned int d = lane + 32 * i;
            if (d < head_dim) dot += qv[i] * k[d];
        }
        float score = warp_sum(dot) * scale;
        float next = score > m ? score : m;
        float correction = expf(m - next);
        float p = expf(score - next);
        l = l * correction + p;
        const float* v = k + value_offset;
        for (unsigned int i = 0; i < ATTN_MAX_HEAD_DIM / 32; ++i) {
            unsigned int d = lane + 32 * i;
            if (d < head_dim) acc[i] = acc[i] * correction + p * v[d];
        }
        m = next;
    }
    if (lane == 0) {
        s_max[warp] = m;
        s_sum[warp] = l;
    }
    for (unsigned int i = 0; i < ATTN_MAX_HEAD_DIM / 32; ++i) {
        unsigned int d = lane + 32 * i;
        if (d < head_dim) s_acc[warp * head_dim + d] = acc[i];
    }
    __syncthreads();
    float top = attn_neg_inf();
    for (unsigned int w = 0; w < warps; ++w) top = s_max[w] > top ? s_max[w] : top;
    float* out = partial + (((size_t)row * heads + head) * splits + split) * (head_dim + 2);
    if (threadIdx.x == 0) {
        float sum = 0.0f;
        for (unsigned int w = 0; w < warps; ++w) {
            if (s_sum[w] > 0.0f) sum += s_sum[w] * expf(s_max[w] - top);
        }
        out[0] = top;
        out[1] = sum;
    }
    for (unsigned int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float o = 0.0f;
        for (unsigned int w = 0; w < warps; ++w) {
            if (s_sum[w] > 0.0f) o += s_acc[w * head_dim + d] * expf(s_max[w] - top);
        }
        out[2 + d] = o;
    }
}

__device__ __forceinline__ float attn_warp_max(float value) {
    for (int offset = 16; offset > 0; offset >>= 1) {
        float other = __shfl_xor_sync(0xffffffffu, value, offset);
        value = other > value ? other : value;
    }
    return value;
}

// Grid: (splits, heads, tiles); blockDim.x = 32 * ATTN_TILE_WARPS. The flash-style attention of
// a prefill chunk: block (split, head, t) takes tile t, `tiles[2t]` its first row and
// `tiles[2t + 1]` its row count (at most tile_cap <= ATTN_TILE_WARPS * ATTN_ROWS_PER_WARP
// consecutive rows of one run), and attends the tile's queries of `head` over keys [split * split_keys,
// min(last pos + 1, (split + 1) * split_keys)) of the run's block table, each row masked to keys
// <= its position. Keys come in tiles of ATTN_TILE_KEYS staged in shared memory (K, then V in
// the same buffer), so every key is read once per tile of queries rather than once per query.
// Warp w owns the tile's rows w, w + warps, ...; for a key tile, lane j scores key j against
// each of its rows, the warp keeps an online softmax per row in f32 (running max m, sum l and
// the unnormalised output, lanes over dimensions), and the partials (m, l, output[head_dim])
// go to the same place as attention_split's, for attention_combine.
// Dynamic shared memory: tile_cap * head_dim floats of queries, then ATTN_TILE_KEYS *
// (head_dim + 1) floats of keys or values (the +1 keeps lanes reading one key each on distinct
// banks).
#define ATTN_TILE_KEYS 32
#define ATTN_TILE_WARPS 4
#define ATTN_ROWS_PER_WARP 4
extern "C" __global__ void attention_tile(float* partial, const float* qkv, const float* pool,
                                          const unsigned int* row_pos, const unsigned int* row_run,
                                          const unsigned int* runs, const unsigned int* tables, unsigned int tables_len,
                                          const unsigned int* tiles, unsigned int num_tiles, unsigned int rows,
                                          unsigned int num_runs, unsigned int heads, unsigned int kv_heads,
                                          unsigned int head_dim, unsigned int qkv_dim, unsigned int block_size,
                                          unsigned long long block_floats, unsigned long long layer_offset,
                                          unsigned int num_blocks, unsigned int splits, unsigned int split_keys,
                                          float scale, unsigned int tile_cap) {
    __shared__ unsigned long long s_at[ATTN_TILE_KEYS];
    SIM_DYNAMIC_SHARED(float, s_mem);
    unsigned int split = blockIdx.x;
    unsigned int head = blockIdx.y;
    unsigned int tile = blockIdx.z;
    if (tile_cap > ATTN_TILE_WARPS * ATTN_ROWS_PER_WARP) return;
    if (tile >= num_tiles || head >= heads || split >= splits || kv_heads == 0 || heads % kv_heads != 0 ||
        head_dim == 0 || head_dim > ATTN_MAX_HEAD_DIM || blockDim.x != 32 * ATTN_TILE_WARPS)
        return;
    unsigned int first = tiles[2 * tile];
    unsigned int count = tiles[2 * tile + 1];
    if (count == 0 || count > tile_cap || first >= rows || count > rows - first) return;
    unsigned int run = row_run[first];
    if (run >= num_runs) return;
    const unsigned int* r = runs + (size_t)run * 6;
    unsigned int kv_head = head / (heads / kv_heads);
    unsigned int lane = threadIdx.x & 31u;
    unsigned int warp = threadIdx.x >> 5;
    unsigned int stride = head_dim + 1;
    float* s_q = s_mem;
    float* s_kv = s_mem + (size_t)count * head_dim;

    // The tile's queries, and the last position among its rows (rows of one run ascend).
    unsigned int last = 0;
    for (unsigned int i = 0; i < count; ++i) {
        unsigned int p = row_pos[first + i];
        last = p > last ? p : last;
    }
    for (unsigned int idx = threadIdx.x; idx < count * head_dim; idx += blockDim.x) {
        unsigned int i = idx / head_dim;
        unsigned int d = idx - i * head_dim;
        s_q[idx] = qkv[(size_t)(first + i) * qkv_dim + (size_t)head * head_dim + d];
    }
    unsigned int my_pos[ATTN_ROWS_PER_WARP];
    float m[ATTN_ROWS_PER_WARP];
    float l[ATTN_ROWS_PER_WARP];
    float acc[ATTN_ROWS_PER_WARP][ATTN_MAX_HEAD_DIM / 32];
    for (unsigned int k = 0; k < ATTN_ROWS_PER_WARP; ++k) {
        unsigned int q = warp + k * ATTN_TILE_WARPS;
        my_pos[k] = q < count ? row_pos[first + q] : 0;
        m[k] = attn_neg_inf();
        l[k] = 0.0f;
        for (unsigned int i = 0; i < ATTN_MAX_HEAD_DIM / 32; ++i) acc[k][i] = 0.0f;
    }
    unsigned long long start = (unsigned long long)split * split_keys;
    unsigned long long end = start + split_keys;
    if (end > (unsigned long long)last + 1) end = (unsigned long long)last + 1;
    unsigned long long value_offset = (unsigned long long)block_size * kv_heads * head_dim;
    for (unsigned long long t0 = start; t0 < end; t0 += ATTN_TILE_KEYS) {
        // Wait until every warp is done with the previous tile's values.
        __syncthreads();
        if (threadIdx.x < ATTN_TILE_KEYS) {
            unsigned long long key = t0 + threadIdx.x;
            s_at[threadIdx.x] = key < end ? attn_key_index(tables, tables_len, r[4], r[5], (unsigned int)key, block_size,
                                                           block_floats, layer_offset, num_blocks, kv_heads, head_dim,
                                                           kv_head)
                                          : ~0ull;
        }
        __syncthreads();
        for (unsigned int idx = threadIdx.x; idx < ATTN_TILE_KEYS * head_dim; idx += blockDim.x) {
            unsigned int j = idx / head_dim;
            unsigned int d = idx - j * head_dim;
            unsigned long long at = s_at[j];
            s_kv[j * stride + d] = at == ~0ull ? 0.0f : pool[at + d];
        }
        __syncthreads();
        // Lane j scores key t0 + j against each of the warp's rows.
        float score[ATTN_ROWS_PER_WARP];
        bool key_ok = s_at[lane] != ~0ull;
        for (unsigned int k = 0; k < ATTN_ROWS_PER_WARP; ++k) {
            unsigned int q = warp + k * ATTN_TILE_WARPS;
            score[k] = attn_neg_inf();
            if (q >= count) continue;
            const float* qv = s_q + (size_t)q * head_dim;
            const float* kv = s_kv + lane * stride;
            float dot = 0.0f;
            for (unsigned int d = 0; d < head_dim; ++d) dot += qv[d] * kv[d];
            if (key_ok && t0 + lane <= my_pos[k]) score[k] = dot * scale;
        }
        __syncthreads();
        for (unsigned int idx = threadIdx.x; idx < ATTN_TILE_KEYS * head_dim; idx += blockDim.x) {
            unsigned int j = idx / head_dim;
            unsigned int d = idx - j * head_dim;
            unsigned long long at = s_at[j];
            s_kv[j * stride + d] = at == ~0ull ? 0.0f : pool[at + value_offset + d];
        }
        __syncthreads();
        for (unsigned int k = 0; k < ATTN_ROWS_PER_WARP; ++k) {
            unsigned int q = warp + k * ATTN_TILE_WARPS;
            if (q >= count) continue;
            float top = attn_warp_max(score[k]);
            float next = top > m[k] ? top : m[k];
            // No key of this row so far (all masked): nothing to add.
            if (next == attn_neg_inf()) continue;
            float correction = expf(m[k] - next);
            float p = score[k] == attn_neg_inf() ? 0.0f : expf(score[k] - next);
            l[k] = l[k] * correction + warp_sum(p);
            for (unsigned int i = 0; i < ATTN_MAX_HEAD_DIM / 32; ++i) acc[k][i] *= correction;
            for (unsigned int j = 0; j < ATTN_TILE_KEYS; ++j) {
                float pj = __shfl_sync(0xffffffffu, p, (int)j);
                const float* v = s_kv + j * stride;
                for (unsigned int i = 0; i < ATTN_MAX_HEAD_DIM / 32; ++i) {
                    unsigned int d = lane + 32 * i;
                    if (d < head_dim) acc[k][i] += pj * v[d];
                }
            }
            m[k] = next;
        }
    }
    for (unsigned int k = 0; k < ATTN_ROWS_PER_WARP; ++k) {
        unsigned int q = warp + k * ATTN_TILE_WARPS;
        if (q >= count) continue;
        float* out = partial + (((size_t)(first + q) * heads + head) * splits + split) * (head_dim + 2);
        if (lane == 0) {
            out[0] = m[k];
            out[1] = l[k];
        }
        for (unsigned int i = 0; i < ATTN_MAX_HEAD_DIM / 32; ++i) {
            unsigned int d = lane + 32 * i;
            if (d < head_dim) out[2 + d] = acc[k][i];
        }
    }
}

// Grid: (heads, rows). Merges a row's splits: out[row, head*head_dim + d] = sum_s o_s[d]
// e^(m_s - M) / sum_s l_s e^(m_s - M), with M the largest m_s.
extern "C" __global__ void attention_combine(float* out, const float* partial, unsigned int rows, unsigned int heads,
                                             unsigned int head_dim, unsigned int splits) {
    unsigned int head = blockIdx.x;
    unsigned int row = blockIdx.y;
    if (row >= rows || head >= heads) return;
    const float* p = partial + ((size_t)row * heads + head) * splits * (head_dim + 2);
    float top = attn_neg_inf();
    for (unsigned int s = 0; s < splits; ++s) {
        float m = p[(size_t)s * (head_dim + 2)];
        top = m > top ? m : top;
    }
    float sum = 0.0f;
    for (unsigned int s = 0; s < splits; ++s) {
        const float* ps = p + (size_t)s * (head_dim + 2);
        if (ps[1] > 0.0f) sum += ps[1] * expf(ps[0] - top);
    }
    float* dst = out + (size_t)row * heads * head_dim + (size_t)head * head_dim;
    for (unsigned int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float o = 0.0f;
        for (unsigned int s = 0; s < splits; ++s) {
            const float* ps = p + (size_t)s * (head_dim + 2);
            if (ps[1] > 0.0f) o += ps[2 + d] * expf(ps[0] - top);
        }
        dst[d] = o / sum;
    }
}
