//! The kernels of `kernels/*.cu` by name, and typed, checked launchers for each.
//!
//! Every launcher checks the sizes of its slices against its shape before it calls the unsafe
//! [`Runtime::launch`], and the kernels bound-check every index that comes from device data
//! (token ids, feed sources, block ids), so these functions are safe to call with any input.
//!
//! Kernel interface (every kernel, the forward step's included): a kernel is an
//! `extern "C" __global__` function in `kernels/<module>.cu`; activations are f32, weights f32 or
//! bf16 (raw 16 bits); row kernels take one block of [`ROW_THREADS`] threads per row.

use crate::error::{CudaError, Result};
use crate::runtime::{DType, DeviceSlice, KernelArg, LaunchDims, Runtime, Stream};

mod layers;

pub use layers::{
    add_into, attention, attention_plan, attention_tile_rows, attention_tiled, bias_act, kv_write,
    mamba_conv, mamba_gated_norm, mamba_ssm, moe_combine, moe_dispatch, moe_gemm, moe_route,
    residual_rmsnorm, rmsnorm_select, AttentionIo, AttentionShape, AttentionWork, KvPool,
    MambaShape, MoeDispatch, MoeGemm, MoeRoute, SsmScan, StateSlots, StepRows, MOE_TILE_ROWS,
};

/// Threads per block of the row kernels (RMSNorm, argmax): a multiple of 32.
pub const ROW_THREADS: u32 = 256;
/// Threads per block of the element-wise and copy kernels.
pub const FLAT_THREADS: u32 = 256;
/// The most blocks a grid-stride kernel launches.
const MAX_FLAT_BLOCKS: u64 = 4096;

/// Every kernel, by its `extern "C"` name. The discriminant is the index into [`Kernel::ALL`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kernel {
    /// `embed.cu`: resolve each row's input token (host token or a previous step's feed cell).
    FeedInputs,
    /// `embed.cu`: embedding rows from an f32 table.
    EmbeddingGatherF32,
    /// `embed.cu`: embedding rows from a bf16 table.
    EmbeddingGatherBf16,
    /// `norm.cu`: RMSNorm with f32 weights.
    RmsNormF32,
    /// `norm.cu`: RMSNorm with bf16 weights.
    RmsNormBf16,
    /// `argmax.cu`: argmax per row, into outputs and feed cells.
    ArgmaxRows,
    /// `argmax.cu`: argmax per row over a mask of allowed ids.
    ArgmaxMaskedRows,
    /// `copy.cu`: gather pool blocks into a contiguous buffer.
    GatherBlocks,
    /// `copy.cu`: scatter a contiguous buffer into pool blocks.
    ScatterBlocks,
    /// `copy.cu`: f32 to bf16 (round to nearest even).
    F32ToBf16,
    /// `mamba.cu`: causal depthwise conv over runs, continuing from the slots' conv history.
    MambaConv,
    /// `mamba.cu`: the chunked SSM scan (SSD) of prefill runs.
    MambaSsmChunked,
    /// `mamba.cu`: the SSM recurrence token by token over runs (decode rows and, by default,
    /// prefill runs).
    MambaSsmRun,
    /// `mamba.cu`: the gated RMSNorm over groups.
    MambaGatedNorm,
    /// `attention.cu`: the K/V write of a step's rows into the paged pool.
    KvWrite,
    /// `attention.cu`: attention of each row over its block table, split across blocks.
    AttentionSplit,
    /// `attention.cu`: merges the splits of [`Kernel::AttentionSplit`] and
    /// [`Kernel::AttentionTile`].
    AttentionCombine,
    /// `attention.cu`: flash-style attention of a tile of a prefill chunk's rows, keys staged in
    /// shared memory.
    AttentionTile,
    /// `moe.cu`: the router of each token.
    MoeRoute,
    /// `moe.cu`: assignments per expert.
    MoeCount,
    /// `moe.cu`: assignments sorted by expert, padded to whole tiles.
    MoePlace,
    /// `moe.cu`: expert GEMM over tiles, f32 weights.
    MoeGemmF32,
    /// `moe.cu`: expert GEMM over tiles, bf16 weights.
    MoeGemmBf16,
    /// `moe.cu`: the weighted combine per token.
    MoeCombine,
    /// `elementwise.cu`: bias and ReLU² after a GEMM.
    BiasAct,
    /// `elementwise.cu`: `dst += src`.
    AddInto,
    /// `elementwise.cu`: residual add fused with the next RMSNorm.
    ResidualRmsNorm,
    /// `elementwise.cu`: RMSNorm of selected rows.
    RmsNormSelect,
}

impl Kernel {
    /// Every kernel, in discriminant order.
    pub const ALL: [Kernel; 28] = [
        Kernel::FeedInputs,
        Kernel::EmbeddingGatherF32,
        Kernel::EmbeddingGatherBf16,
        Kernel::RmsNormF32,
        Kernel::RmsNormBf16,
        Kernel::ArgmaxRows,
        Kernel::ArgmaxMaskedRows,
        Kernel::GatherBlocks,
        Kernel::ScatterBlocks,
        Kernel::F32ToBf16,
        Kernel::MambaConv,
        Kernel::MambaSsmChunked,
        Kernel::MambaSsmRun,
        Kernel::MambaGatedNorm,
        Kernel::KvWrite,
        Kernel::AttentionSplit,
        Kernel::AttentionCombine,
        Kernel::AttentionTile,
        Kernel::MoeRoute,
        Kernel::MoeCount,
        Kernel::MoePlace,
        Kernel::MoeGemmF32,
        Kernel::MoeGemmBf16,
        Kernel::MoeCombine,
        Kernel::BiasAct,
        Kernel::AddInto,
        Kernel::ResidualRmsNorm,
        Kernel::RmsNormSelect,
    ];

    /// The `extern "C"` name.
    pub fn name(self) -> &'static str {
        match self {
            Kernel::FeedInputs => "feed_inputs",
            Kernel::EmbeddingGatherF32 => "embedding_gather_f32",
            Kernel::EmbeddingGatherBf16 => "embedding_gather_bf16",
            Kernel::RmsNormF32 => "rmsnorm_f32",
            Kernel::RmsNormBf16 => "rmsnorm_bf16",
            Kernel::ArgmaxRows => "argmax_rows",
            Kernel::ArgmaxMaskedRows => "argmax_masked_rows",
            Kernel::GatherBlocks => "gather_blocks",
            Kernel::ScatterBlocks => "scatter_blocks",
            Kernel::F32ToBf16 => "f32_to_bf16_n",
            Kernel::MambaConv => "mamba_conv",
            Kernel::MambaSsmChunked => "mamba_ssm_chunked",
            Kernel::MambaSsmRun => "mamba_ssm_run",
            Kernel::MambaGatedNorm => "mamba_gated_norm",
            Kernel::KvWrite => "kv_write",
            Kernel::AttentionSplit => "attention_split",
            Kernel::AttentionCombine => "attention_combine",
            Kernel::AttentionTile => "attention_tile",
            Kernel::MoeRoute => "moe_route",
            Kernel::MoeCount => "moe_count",
            Kernel::MoePlace => "moe_place",
            Kernel::MoeGemmF32 => "moe_gemm_f32",
            Kernel::MoeGemmBf16 => "moe_gemm_bf16",
            Kernel::MoeCombine => "moe_combine",
            Kernel::BiasAct => "bias_act",
            Kernel::AddInto => "add_into",
            Kernel::ResidualRmsNorm => "residual_rmsnorm",
            Kernel::RmsNormSelect => "rmsnorm_select",
        }
    }

    /// The file it lives in, `kernels/<module>.cu` (and its PTX, `kernels/ptx/<module>.ptx`).
    pub fn module(self) -> &'static str {
        match self {
            Kernel::FeedInputs | Kernel::EmbeddingGatherF32 | Kernel::EmbeddingGatherBf16 => {
                "embed"
            }
            Kernel::RmsNormF32 | Kernel::RmsNormBf16 => "norm",
            Kernel::ArgmaxRows | Kernel::ArgmaxMaskedRows => "argmax",
            Kernel::GatherBlocks | Kernel::ScatterBlocks | Kernel::F32ToBf16 => "copy",
            Kernel::MambaConv
            | Kernel::MambaSsmChunked
            | Kernel::MambaSsmRun
            | Kernel::MambaGatedNorm => "mamba",
            Kernel::KvWrite
            | Kernel::AttentionSplit
            | Kernel::AttentionCombine
            | Kernel::AttentionTile => "attention",
            Kernel::MoeRoute
            | Kernel::MoeCount
            | Kernel::MoePlace
            | Kernel::MoeGemmF32
            | Kernel::MoeGemmBf16
            | Kernel::MoeCombine => "moe",
            Kernel::BiasAct | Kernel::AddInto | Kernel::ResidualRmsNorm | Kernel::RmsNormSelect => {
                "elementwise"
            }
        }
    }
}

fn expect_bytes(
    kernel: Kernel,
    what: &str,
    slice: DeviceSlice,
    elems: usize,
    elem: usize,
) -> Result<()> {
    match elems.checked_mul(elem) {
        Some(bytes) if bytes == slice.bytes() => Ok(()),
        need => Err(CudaError::BadRange(format!(
            "{}: {what} has {} bytes, the shape needs {}",
            kernel.name(),
            slice.bytes(),
            need.map_or("more than memory".to_owned(), |n| n.to_string())
        ))),
    }
}

fn expect_aligned(kernel: Kernel, what: &str, slice: DeviceSlice, align: u64) -> Result<()> {
    if slice.address() % align == 0 {
        Ok(())
    } else {
        Err(CudaError::BadRange(format!(
            "{}: {what} at {:#x} is not {align}-byte aligned",
            kernel.name(),
            slice.address()
        )))
    }
}

fn to_u32(kernel: Kernel, what: &str, value: usize) -> Result<u32> {
    u32::try_from(value).map_err(|_| CudaError::BadLaunch {
        kernel: kernel.name(),
        detail: format!("{what} {value} does not fit in 32 bits"),
    })
}

/// A grid of [`FLAT_THREADS`]-thread blocks over `columns.1` elements (x, in blocks of
/// `FLAT_THREADS`) of each of `rows.1` rows (y); the `.0`s name the block and row counts in errors.
fn flat_grid(k: Kernel, columns: (&str, usize), rows: (&str, usize)) -> Result<LaunchDims> {
    Ok(LaunchDims {
        grid: [
            to_u32(k, columns.0, columns.1.div_ceil(FLAT_THREADS as usize))?,
            to_u32(k, rows.0, rows.1)?,
            1,
        ],
        block: [FLAT_THREADS, 1, 1],
        shared_bytes: 0,
    })
}

fn flat_blocks(elems: u64) -> u32 {
    elems
        .div_ceil(u64::from(FLAT_THREADS))
        .clamp(1, MAX_FLAT_BLOCKS) as u32
}

/// `tokens[i] = sources[i] >= 0 ? feed[sources[i]] : host_tokens[i]` for `rows` rows (`feed` has
/// `feed.bytes() / 4` cells; a source past them yields `u32::MAX`).
pub fn feed_inputs(
    rt: &dyn Runtime,
    stream: Stream,
    tokens: DeviceSlice,
    host_tokens: DeviceSlice,
    sources: DeviceSlice,
    feed: DeviceSlice,
    rows: usize,
) -> Result<()> {
    let k = Kernel::FeedInputs;
    for (what, slice) in [
        ("tokens", tokens),
        ("host tokens", host_tokens),
        ("sources", sources),
    ] {
        expect_bytes(k, what, slice, rows, 4)?;
        expect_aligned(k, what, slice, 4)?;
    }
    expect_aligned(k, "feed", feed, 4)?;
    let rows32 = to_u32(k, "rows", rows)?;
    let feed_len = to_u32(k, "feed cells", feed.bytes() / 4)?;
    let args = [
        KernelArg::Ptr(tokens),
        KernelArg::Ptr(host_tokens),
        KernelArg::Ptr(sources),
        KernelArg::Ptr(feed),
        KernelArg::U32(feed_len),
        KernelArg::U32(rows32),
    ];
    // SAFETY: the arguments match `feed_inputs(uint*, const uint*, const int*, const uint*, uint,
    // uint)`; the kernel touches rows elements of the first three (checked above) and reads feed
    // only below feed_len, its checked length.
    unsafe {
        rt.launch(
            k,
            LaunchDims::linear(flat_blocks(rows as u64), FLAT_THREADS),
            &args,
            stream,
        )
    }
}

/// `out[r, :] = table[tokens[r], :]` for `rows` rows of `hidden` values; `table` holds `vocab`
/// rows of `dtype`. A token at or past `vocab` gives a row of zeros.
#[allow(clippy::too_many_arguments)] // The shape of a gather: three buffers and three sizes.
pub fn embedding_gather(
    rt: &dyn Runtime,
    stream: Stream,
    out: DeviceSlice,
    table: DeviceSlice,
    dtype: DType,
    tokens: DeviceSlice,
    rows: usize,
    hidden: usize,
    vocab: usize,
) -> Result<()> {
    let k = match dtype {
        DType::F32 => Kernel::EmbeddingGatherF32,
        DType::Bf16 => Kernel::EmbeddingGatherBf16,
    };
    let cells = rows.saturating_mul(hidden);
    expect_bytes(k, "out", out, cells, 4)?;
    expect_bytes(
        k,
        "table",
        table,
        vocab.saturating_mul(hidden),
        dtype.bytes(),
    )?;
    expect_bytes(k, "tokens", tokens, rows, 4)?;
    expect_aligned(k, "out", out, 4)?;
    expect_aligned(k, "table", table, dtype.bytes() as u64)?;
    expect_aligned(k, "tokens", tokens, 4)?;
    let dims = flat_grid(k, ("hidden blocks", hidden.max(1)), ("rows", rows))?;
    let args = [
        KernelArg::Ptr(out),
        KernelArg::Ptr(table),
        KernelArg::Ptr(tokens),
        KernelArg::U32(to_u32(k, "rows", rows)?),
        KernelArg::U32(to_u32(k, "hidden", hidden)?),
        KernelArg::U32(to_u32(k, "vocab", vocab)?),
    ];
    // SAFETY: the arguments match `embedding_gather_*(float*, const T*, const uint*, uint, uint,
    // uint)`; out holds rows*hidden floats, tokens rows ids, the table vocab*hidden values, and
    // the kernel reads the table only for ids below vocab.
    unsafe { rt.launch(k, dims, &args, stream) }
}

/// `out[r, :] = w * (x[r, :] * rsqrt(mean(x[r, :]^2) + eps))` for `rows` rows of `dim` values;
/// `out` may be `x`.
#[allow(clippy::too_many_arguments)] // The shape of a norm: three buffers, two sizes and eps.
pub fn rmsnorm(
    rt: &dyn Runtime,
    stream: Stream,
    out: DeviceSlice,
    x: DeviceSlice,
    weight: DeviceSlice,
    dtype: DType,
    rows: usize,
    dim: usize,
    eps: f32,
) -> Result<()> {
    let k = match dtype {
        DType::F32 => Kernel::RmsNormF32,
        DType::Bf16 => Kernel::RmsNormBf16,
    };
    let cells = rows.saturating_mul(dim);
    expect_bytes(k, "out", out, cells, 4)?;
    expect_bytes(k, "x", x, cells, 4)?;
    expect_bytes(k, "weight", weight, dim, dtype.bytes())?;
    if out != x && out.overlaps(&x) {
        return Err(CudaError::BadRange(
            "rmsnorm: out overlaps x without being x".to_owned(),
        ));
    }
    expect_aligned(k, "out", out, 4)?;
    expect_aligned(k, "x", x, 4)?;
    expect_aligned(k, "weight", weight, dtype.bytes() as u64)?;
    let args = [
        KernelArg::Ptr(out),
        KernelArg::Ptr(x),
        KernelArg::Ptr(weight),
        KernelArg::U32(to_u32(k, "rows", rows)?),
        KernelArg::U32(to_u32(k, "dim", dim)?),
        KernelArg::F32(eps),
    ];
    let dims = LaunchDims::linear(to_u32(k, "rows", rows.max(1))?, ROW_THREADS);
    // SAFETY: the arguments match `rmsnorm_*(float*, const float*, const T*, uint, uint, float)`;
    // each block touches one row of dim values of out and x and dim weights, all checked above;
    // in place is safe because each thread writes only the elements it read.
    unsafe { rt.launch(k, dims, &args, stream) }
}

/// The argmax of each of `rows` rows of `vocab` logits (first index on ties; NaN never wins), over
/// the ids whose byte in `mask` (rows x vocab) is non-zero when given, written to `out[row]` and,
/// when given, to the feed cell `feed[row]`. A row without a candidate answers `u32::MAX`.
#[allow(clippy::too_many_arguments)] // Logits, mask, two outputs and the shape.
pub fn argmax(
    rt: &dyn Runtime,
    stream: Stream,
    logits: DeviceSlice,
    mask: Option<DeviceSlice>,
    rows: usize,
    vocab: usize,
    out: DeviceSlice,
    feed: Option<DeviceSlice>,
) -> Result<()> {
    let k = if mask.is_some() {
        Kernel::ArgmaxMaskedRows
    } else {
        Kernel::ArgmaxRows
    };
    let cells = rows.saturating_mul(vocab);
    expect_bytes(k, "logits", logits, cells, 4)?;
    expect_aligned(k, "logits", logits, 4)?;
    expect_bytes(k, "out", out, rows, 4)?;
    expect_aligned(k, "out", out, 4)?;
    if let Some(mask) = mask {
        expect_bytes(k, "mask", mask, cells, 1)?;
    }
    if let Some(feed) = feed {
        expect_bytes(k, "feed", feed, rows, 4)?;
        expect_aligned(k, "feed", feed, 4)?;
        if feed.overlaps(&out) {
            return Err(CudaError::BadRange("argmax: feed overlaps out".to_owned()));
        }
    }
    let feed_arg = feed.map_or(KernelArg::Null, KernelArg::Ptr);
    let rows32 = to_u32(k, "rows", rows)?;
    let vocab32 = to_u32(k, "vocab", vocab)?;
    let args: Vec<KernelArg> = match mask {
        Some(mask) => vec![
            KernelArg::Ptr(logits),
            KernelArg::Ptr(mask),
            KernelArg::U32(rows32),
            KernelArg::U32(vocab32),
            KernelArg::Ptr(out),
            feed_arg,
        ],
        None => vec![
            KernelArg::Ptr(logits),
            KernelArg::U32(rows32),
            KernelArg::U32(vocab32),
            KernelArg::Ptr(out),
            feed_arg,
        ],
    };
    let dims = LaunchDims::linear(rows32.max(1), ROW_THREADS);
    // SAFETY: the arguments match `argmax_rows(const float*, uint, uint, uint*, uint*)` or
    // `argmax_masked_rows(const float*, const uchar*, uint, uint, uint*, uint*)`; block `row`
    // reads one row of logits (and mask) and writes out[row] and feed[row], all checked above.
    unsafe { rt.launch(k, dims, &args, stream) }
}

/// The shape of a block copy: `count` blocks of `words` 32-bit words each, out of a pool of
/// `pool_blocks` blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockShape {
    /// Blocks named by the ids.
    pub count: usize,
    /// 32-bit words per block.
    pub words: usize,
    /// Blocks in the pool.
    pub pool_blocks: usize,
}

fn block_copy(
    rt: &dyn Runtime,
    stream: Stream,
    k: Kernel,
    first: DeviceSlice,
    second: DeviceSlice,
    ids: DeviceSlice,
    shape: BlockShape,
) -> Result<()> {
    let (pool, staging) = match k {
        Kernel::GatherBlocks => (second, first),
        _ => (first, second),
    };
    let staged = shape.count.saturating_mul(shape.words);
    expect_bytes(k, "staging", staging, staged, 4)?;
    expect_bytes(
        k,
        "pool",
        pool,
        shape.pool_blocks.saturating_mul(shape.words),
        4,
    )?;
    expect_bytes(k, "ids", ids, shape.count, 4)?;
    for (what, slice) in [("staging", staging), ("pool", pool), ("ids", ids)] {
        expect_aligned(k, what, slice, 4)?;
    }
    if staging.overlaps(&pool) || ids.overlaps(&pool) || ids.overlaps(&staging) {
        return Err(CudaError::BadRange(format!(
            "{}: buffers overlap",
            k.name()
        )));
    }
    if staged == 0 {
        return Ok(());
    }
    let args = [
        KernelArg::Ptr(first),
        KernelArg::Ptr(second),
        KernelArg::Ptr(ids),
        KernelArg::U32(to_u32(k, "count", shape.count)?),
        KernelArg::U64(shape.words as u64),
        KernelArg::U32(to_u32(k, "pool blocks", shape.pool_blocks)?),
    ];
    let dims = LaunchDims::linear(flat_blocks(staged as u64), FLAT_THREADS);
    // SAFETY: the arguments match `gather_blocks(uint* dst, const uint* pool, ...)` and
    // `scatter_blocks(uint* pool, const uint* src, ...)`: count*words staging words and
    // pool_blocks*words pool words, checked above; ids past pool_blocks are skipped by the kernel.
    unsafe { rt.launch(k, dims, &args, stream) }
}

/// `staging[i] = pool block ids[i]` for `shape.count` blocks (spill).
pub fn gather_blocks(
    rt: &dyn Runtime,
    stream: Stream,
    staging: DeviceSlice,
    pool: DeviceSlice,
    ids: DeviceSlice,
    shape: BlockShape,
) -> Result<()> {
    block_copy(rt, stream, Kernel::GatherBlocks, staging, pool, ids, shape)
}

/// `pool block ids[i] = staging[i]` for `shape.count` blocks (restore).
pub fn scatter_blocks(
    rt: &dyn Runtime,
    stream: Stream,
    pool: DeviceSlice,
    staging: DeviceSlice,
    ids: DeviceSlice,
    shape: BlockShape,
) -> Result<()> {
    block_copy(rt, stream, Kernel::ScatterBlocks, pool, staging, ids, shape)
}

/// `out[i] = bf16(input[i])` for `count` values (round to nearest even).
pub fn f32_to_bf16(
    rt: &dyn Runtime,
    stream: Stream,
    out: DeviceSlice,
    input: DeviceSlice,
    count: usize,
) -> Result<()> {
    let k = Kernel::F32ToBf16;
    expect_bytes(k, "out", out, count, 2)?;
    expect_bytes(k, "input", input, count, 4)?;
    expect_aligned(k, "out", out, 2)?;
    expect_aligned(k, "input", input, 4)?;
    if out.overlaps(&input) {
        return Err(CudaError::BadRange(
            "f32_to_bf16: out overlaps input".to_owned(),
        ));
    }
    if count == 0 {
        return Ok(());
    }
    let args = [
        KernelArg::Ptr(out),
        KernelArg::Ptr(input),
        KernelArg::U64(count as u64),
    ];
    let dims = LaunchDims::linear(flat_blocks(count as u64), FLAT_THREADS);
    // SAFETY: the arguments match `f32_to_bf16_n(ushort*, const float*, ulonglong)`; count values
    // of each, checked above.
    unsafe { rt.launch(k, dims, &args, stream) }
}
