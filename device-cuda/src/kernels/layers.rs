//! Launchers of the forward kernels (`mamba.cu`, `attention.cu`, `moe.cu`, `elementwise.cu`).
//!
//! As for part 1's launchers, each checks every slice's size and alignment against its shape
//! before the unsafe launch; indices that come from device data (runs, block tables, slots,
//! expert choices and positions) are bound-checked by the kernels themselves against the sizes
//! passed here, so no input makes a kernel touch memory outside its slices.

use super::{
    expect_aligned, expect_bytes, flat_blocks, flat_grid, to_u32, Kernel, FLAT_THREADS, ROW_THREADS,
};
use crate::error::{CudaError, Result};
use crate::runtime::{DType, DeviceSlice, KernelArg, LaunchDims, Runtime, Stream};

/// Rows per tile of the expert GEMM (the dispatch pads each expert's rows to a multiple of it).
pub const MOE_TILE_ROWS: usize = 32;
const MOE_TILE_COLS: usize = 64;
/// Threads of the SSM, attention and MoE blocks.
const LAYER_THREADS: u32 = 128;
/// Dynamic shared memory every CUDA device gives a block without opting in.
const SHARED_LIMIT: usize = 48 * 1024;
/// The longest causal conv the conv kernel keeps in registers (`MAMBA_MAX_HISTORY + 1`).
const MAX_CONV_KERNEL: usize = 9;
/// The widest attention head (`ATTN_MAX_HEAD_DIM`).
const MAX_HEAD_DIM: usize = 256;
/// Words of one run in [`StepRows::runs`].
pub(crate) const RUN_WORDS: usize = 6;

/// A step's rows on the device. Rows are grouped in runs (consecutive rows of one sequence in
/// position order); a run is six u32 words: first row, length, start position, state slot,
/// offset of its block table in `tables`, length of that table.
#[derive(Debug, Clone, Copy)]
pub struct StepRows {
    /// `rows` u32: each row's position.
    pub row_pos: DeviceSlice,
    /// `rows` u32: each row's run.
    pub row_run: DeviceSlice,
    /// `num_runs * 6` u32.
    pub runs: DeviceSlice,
    /// The block tables, concatenated (u32).
    pub tables: DeviceSlice,
    /// Rows of the step.
    pub rows: usize,
    /// Runs of the step.
    pub num_runs: usize,
    /// `None`, or `rows` u32: the state slot that receives each row's Mamba state (conv history
    /// and SSM state, layer by layer) as it is after the row's token, or `u32::MAX` for none (a
    /// verification's rewind points). Such a step's runs all go through the token-by-token scan.
    pub snapshots: Option<DeviceSlice>,
}

impl StepRows {
    fn check(&self, k: Kernel) -> Result<()> {
        expect_bytes(k, "row positions", self.row_pos, self.rows, 4)?;
        expect_bytes(k, "row runs", self.row_run, self.rows, 4)?;
        expect_bytes(
            k,
            "runs",
            self.runs,
            self.num_runs.saturating_mul(RUN_WORDS),
            4,
        )?;
        expect_bytes(k, "tables", self.tables, self.tables.bytes() / 4, 4)?;
        for (what, slice) in [
            ("row positions", self.row_pos),
            ("row runs", self.row_run),
            ("runs", self.runs),
            ("tables", self.tables),
        ] {
            expect_aligned(k, what, slice, 4)?;
        }
        if let Some(snapshots) = self.snapshots {
            expect_bytes(k, "row snapshots", snapshots, self.rows, 4)?;
            expect_aligned(k, "row snapshots", snapshots, 4)?;
        }
        if self.rows == 0 || self.num_runs == 0 {
            return Err(CudaError::BadLaunch {
                kernel: k.name(),
                detail: "a step has at least one row and one run".to_owned(),
            });
        }
        Ok(())
    }

    /// The runs, their count and the row count, as the Mamba kernels take them.
    fn args(&self, k: Kernel) -> Result<[KernelArg; 3]> {
        Ok([
            KernelArg::Ptr(self.runs),
            KernelArg::U32(to_u32(k, "runs", self.num_runs)?),
            KernelArg::U32(to_u32(k, "rows", self.rows)?),
        ])
    }

    /// The per-row snapshot slots, as the Mamba kernels take them (null for none).
    fn snapshot_arg(&self) -> KernelArg {
        self.snapshots.map_or(KernelArg::Null, KernelArg::Ptr)
    }
}

/// The state slots as one layer sees them: `num_slots` slots of `slot_floats` f32, the layer's
/// part starting `layer_offset` floats into each.
#[derive(Debug, Clone, Copy)]
pub struct StateSlots {
    /// `num_slots * slot_floats` f32.
    pub states: DeviceSlice,
    /// Slots.
    pub num_slots: usize,
    /// Floats per slot.
    pub slot_floats: usize,
    /// Where this layer's conv history starts inside a slot (its SSM state follows it).
    pub layer_offset: usize,
}

/// A Mamba2 mixer's sizes (ARCH.md §3).
#[derive(Debug, Clone, Copy)]
pub struct MambaShape {
    /// Heads `H`.
    pub heads: usize,
    /// Head dimension `P`.
    pub head_dim: usize,
    /// State size `N`.
    pub state: usize,
    /// B/C groups `G`.
    pub groups: usize,
    /// Conv width `K`.
    pub conv_kernel: usize,
}

impl MambaShape {
    /// `H * P`.
    pub fn inner(&self) -> usize {
        self.heads * self.head_dim
    }

    /// `H * P + 2 G N`.
    pub fn conv_dim(&self) -> usize {
        self.inner() + 2 * self.groups * self.state
    }

    /// `in_proj`'s width: `z`, `xBC`, `dt`.
    pub fn proj_dim(&self) -> usize {
        self.inner() + self.conv_dim() + self.heads
    }

    /// Floats of one layer's conv history.
    pub fn conv_floats(&self) -> usize {
        self.conv_kernel.saturating_sub(1) * self.conv_dim()
    }

    /// Floats of one layer's SSM state.
    pub fn ssm_floats(&self) -> usize {
        self.inner() * self.state
    }

    fn check(&self, k: Kernel) -> Result<()> {
        let bad = |detail: String| CudaError::BadLaunch {
            kernel: k.name(),
            detail,
        };
        if self.heads == 0 || self.head_dim == 0 || self.state == 0 || self.groups == 0 {
            return Err(bad(format!("empty Mamba shape {self:?}")));
        }
        if self.heads % self.groups != 0 {
            return Err(bad(format!(
                "{} heads in {} groups",
                self.heads, self.groups
            )));
        }
        if self.conv_kernel == 0 || self.conv_kernel > MAX_CONV_KERNEL {
            return Err(bad(format!(
                "conv width {} (1..={MAX_CONV_KERNEL})",
                self.conv_kernel
            )));
        }
        Ok(())
    }
}

impl StateSlots {
    fn check(&self, k: Kernel, layer_floats: usize) -> Result<()> {
        expect_bytes(
            k,
            "states",
            self.states,
            self.num_slots.saturating_mul(self.slot_floats),
            4,
        )?;
        expect_aligned(k, "states", self.states, 4)?;
        if self.layer_offset.saturating_add(layer_floats) > self.slot_floats {
            return Err(CudaError::BadRange(format!(
                "{}: a layer of {layer_floats} floats at {} does not fit a slot of {}",
                k.name(),
                self.layer_offset,
                self.slot_floats
            )));
        }
        Ok(())
    }
}

fn f32_slice(k: Kernel, what: &str, slice: DeviceSlice, elems: usize) -> Result<KernelArg> {
    expect_bytes(k, what, slice, elems, 4)?;
    expect_aligned(k, what, slice, 4)?;
    Ok(KernelArg::Ptr(slice))
}

fn optional_f32(
    k: Kernel,
    what: &str,
    slice: Option<DeviceSlice>,
    elems: usize,
) -> Result<KernelArg> {
    match slice {
        Some(slice) => f32_slice(k, what, slice, elems),
        None => Ok(KernelArg::Null),
    }
}

/// Causal depthwise conv of every run (ARCH.md §3.2) continuing from the slots' conv history,
/// which it advances: `out [rows, conv_dim] = silu(conv(xBC) + bias)`, where xBC are columns
/// `inner..inner + conv_dim` of `proj [rows, proj_dim]`; `weight` is `[conv_dim, K]` f32.
#[allow(clippy::too_many_arguments)] // The step, the slots, the shape and four buffers.
pub fn mamba_conv(
    rt: &dyn Runtime,
    stream: Stream,
    step: &StepRows,
    slots: &StateSlots,
    shape: &MambaShape,
    out: DeviceSlice,
    proj: DeviceSlice,
    weight: DeviceSlice,
    bias: Option<DeviceSlice>,
) -> Result<()> {
    let k = Kernel::MambaConv;
    shape.check(k)?;
    step.check(k)?;
    slots.check(k, shape.conv_floats())?;
    let conv_dim = shape.conv_dim();
    let [runs, num_runs, rows] = step.args(k)?;
    let args = [
        f32_slice(k, "out", out, step.rows.saturating_mul(conv_dim))?,
        f32_slice(k, "proj", proj, step.rows.saturating_mul(shape.proj_dim()))?,
        KernelArg::Ptr(slots.states),
        f32_slice(
            k,
            "weight",
            weight,
            conv_dim.saturating_mul(shape.conv_kernel),
        )?,
        optional_f32(k, "bias", bias, conv_dim)?,
        runs,
        num_runs,
        rows,
        KernelArg::U32(to_u32(k, "conv dim", conv_dim)?),
        KernelArg::U32(to_u32(k, "proj dim", shape.proj_dim())?),
        KernelArg::U32(to_u32(k, "inner", shape.inner())?),
        KernelArg::U32(to_u32(k, "conv kernel", shape.conv_kernel)?),
        KernelArg::U64(slots.slot_floats as u64),
        KernelArg::U64(slots.layer_offset as u64),
        KernelArg::U32(to_u32(k, "slots", slots.num_slots)?),
        step.snapshot_arg(),
    ];
    let dims = flat_grid(k, ("channel blocks", conv_dim), ("runs", step.num_runs))?;
    // SAFETY: the arguments match `mamba_conv`'s parameters; out and proj hold `rows` rows, the
    // weights conv_dim * K floats, the states num_slots * slot_floats floats with the layer's
    // history inside each slot, the snapshot slots (if any) one word per row (all checked
    // above); the kernel skips runs whose rows or slot are out of range and snapshot slots past
    // num_slots.
    unsafe { rt.launch(k, dims, &args, stream) }
}

/// How [`mamba_ssm`] scans a prefill run (a decode row is a run of one token).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SsmScan {
    /// Every run, of any length, through the token-by-token recurrence (`mamba_ssm_run`): each
    /// token goes through exactly the operations of a decode row, so a position's output and
    /// state are the same bits however the sequence was cut into runs (prefix-cache hits,
    /// prefill chunks, decode rows). Parallel over heads × channels × state lanes, sequential
    /// over the run's tokens.
    #[default]
    Sequential,
    /// Runs of two tokens or more through the chunked scan (SSD, `mamba_ssm_chunked`, chunks of
    /// up to 64 tokens from each run's start), runs of one through the recurrence: more parallel
    /// work for long prompts, equal to `Sequential` only to rounding, so a prefix hit or another
    /// chunking changes the last bits (caches on/off are then not bit-transparent).
    Chunked,
}

/// The SSM of one Mamba layer for every run (ARCH.md §3.3-3.4), as `scan` says (see
/// [`SsmScan`]), continuing from and advancing the state in the slots (`slots.layer_offset` is the layer's conv history;
/// its SSM state follows). `y [rows, inner] = S·C + D x`; xBC after the conv in
/// `xbc [rows, conv_dim]`, dt before softplus in `proj` columns `inner + conv_dim..`; `dt_min`
/// is the lower clamp of dt (0 for none). `run_lens` are the runs' lengths as uploaded.
#[allow(clippy::too_many_arguments)] // The step, the slots, the shape, the clamp and six buffers.
pub fn mamba_ssm(
    rt: &dyn Runtime,
    stream: Stream,
    step: &StepRows,
    run_lens: &[usize],
    slots: &StateSlots,
    shape: &MambaShape,
    y: DeviceSlice,
    xbc: DeviceSlice,
    proj: DeviceSlice,
    params: [DeviceSlice; 3],
    dt_min: f32,
    scan: SsmScan,
) -> Result<()> {
    let chunked = Kernel::MambaSsmChunked;
    shape.check(chunked)?;
    step.check(chunked)?;
    slots.check(chunked, shape.conv_floats() + shape.ssm_floats())?;
    if run_lens.len() != step.num_runs {
        return Err(CudaError::BadRange(format!(
            "mamba_ssm: {} run lengths for {} runs",
            run_lens.len(),
            step.num_runs
        )));
    }
    let [dt_bias, a, d] = params;
    let (h, n, p) = (shape.heads, shape.state, shape.head_dim);
    let common = |k: Kernel| -> Result<Vec<KernelArg>> {
        let [runs, num_runs, rows] = step.args(k)?;
        Ok(vec![
            f32_slice(k, "y", y, step.rows.saturating_mul(shape.inner()))?,
            f32_slice(k, "xbc", xbc, step.rows.saturating_mul(shape.conv_dim()))?,
            f32_slice(k, "proj", proj, step.rows.saturating_mul(shape.proj_dim()))?,
            KernelArg::Ptr(slots.states),
            f32_slice(k, "dt_bias", dt_bias, h)?,
            f32_slice(k, "A", a, h)?,
            f32_slice(k, "D", d, h)?,
            runs,
            num_runs,
            rows,
            KernelArg::U32(to_u32(k, "heads", h)?),
            KernelArg::U32(to_u32(k, "head dim", p)?),
            KernelArg::U32(to_u32(k, "state", n)?),
            KernelArg::U32(to_u32(k, "groups", shape.groups)?),
            KernelArg::U32(to_u32(k, "conv dim", shape.conv_dim())?),
            KernelArg::U32(to_u32(k, "proj dim", shape.proj_dim())?),
            KernelArg::U32(to_u32(k, "dt offset", shape.inner() + shape.conv_dim())?),
            KernelArg::U64(slots.slot_floats as u64),
            KernelArg::U64((slots.layer_offset + shape.conv_floats()) as u64),
            KernelArg::U32(to_u32(k, "slots", slots.num_slots)?),
        ])
    };
    let grid = [
        to_u32(chunked, "heads", h)?,
        to_u32(chunked, "runs", step.num_runs)?,
        1,
    ];
    // The chunked scan keeps no per-token states: a step with snapshots scans token by token.
    let chunk_runs =
        scan == SsmScan::Chunked && step.snapshots.is_none() && run_lens.iter().any(|&len| len > 1);
    if chunk_runs {
        // The largest chunk (a power of two up to 64) whose tiles fit the shared memory.
        let floats = |q: usize| 3 * q + 2 * q * n + q * p + q * q;
        let chunk = [64usize, 32, 16, 8, 4, 2, 1]
            .into_iter()
            .find(|&q| floats(q) * 4 <= SHARED_LIMIT)
            .ok_or_else(|| CudaError::BadLaunch {
                kernel: chunked.name(),
                detail: format!("state {n} x head dim {p} does not fit shared memory"),
            })?;
        let mut args = common(chunked)?;
        args.extend([
            KernelArg::U32(chunk as u32),
            KernelArg::F32(dt_min),
            KernelArg::U32(2),
        ]);
        let dims = LaunchDims {
            grid,
            block: [LAYER_THREADS, 1, 1],
            shared_bytes: (floats(chunk) * 4) as u32,
        };
        // SAFETY: the arguments match `mamba_ssm_chunked`'s parameters; every buffer holds
        // `rows` rows of its width and the states hold num_slots slots with the layer inside
        // each (checked above); the shared memory holds the chunk's tiles; the kernel skips
        // runs whose rows or slot are out of range.
        unsafe { rt.launch(chunked, dims, &args, stream)? };
    }
    // The runs the chunked scan leaves: those of one token when it ran, else all of them.
    let max_len = if chunk_runs { 1 } else { u32::MAX };
    if run_lens
        .iter()
        .any(|&len| len == 1 || (len > 1 && !chunk_runs))
    {
        let k = Kernel::MambaSsmRun;
        let mut args = common(k)?;
        args.extend([
            KernelArg::F32(dt_min),
            KernelArg::U32(max_len),
            step.snapshot_arg(),
        ]);
        let dims = LaunchDims {
            grid,
            block: [LAYER_THREADS, 1, 1],
            shared_bytes: 0,
        };
        // SAFETY: as above, for `mamba_ssm_run`'s parameters (the same less chunk and min_len,
        // plus max_len and the snapshot slots, one word per row when present); the kernel walks
        // only runs whose rows are in range and skips snapshot slots past num_slots.
        unsafe { rt.launch(k, dims, &args, stream)? };
    }
    Ok(())
}

/// The gated RMSNorm (ARCH.md §3.6), in place on `y [rows, inner]`, with the gate `z` in
/// columns `0..inner` of `proj [rows, proj_dim]` and f32 `weight [inner]`.
#[allow(clippy::too_many_arguments)] // Three buffers, the shape, the rows and eps.
pub fn mamba_gated_norm(
    rt: &dyn Runtime,
    stream: Stream,
    shape: &MambaShape,
    y: DeviceSlice,
    proj: DeviceSlice,
    weight: DeviceSlice,
    rows: usize,
    eps: f32,
) -> Result<()> {
    let k = Kernel::MambaGatedNorm;
    shape.check(k)?;
    let inner = shape.inner();
    let args = [
        f32_slice(k, "y", y, rows.saturating_mul(inner))?,
        f32_slice(k, "proj", proj, rows.saturating_mul(shape.proj_dim()))?,
        f32_slice(k, "weight", weight, inner)?,
        KernelArg::U32(to_u32(k, "rows", rows)?),
        KernelArg::U32(to_u32(k, "inner", inner)?),
        KernelArg::U32(to_u32(k, "groups", shape.groups)?),
        KernelArg::U32(to_u32(k, "proj dim", shape.proj_dim())?),
        KernelArg::F32(eps),
    ];
    let dims = LaunchDims {
        grid: [
            to_u32(k, "groups", shape.groups)?,
            to_u32(k, "rows", rows.max(1))?,
            1,
        ],
        block: [ROW_THREADS, 1, 1],
        shared_bytes: 0,
    };
    // SAFETY: the arguments match `mamba_gated_norm`'s parameters; y, proj and the weight hold
    // the sizes checked above; block (g, row) touches one group of one row.
    unsafe { rt.launch(k, dims, &args, stream) }
}

/// The paged KV pool as one attention layer sees it: `num_blocks` blocks of `block_floats` f32,
/// the layer's K then V (`[block_size, kv_heads, head_dim]` each) at `layer_offset` in each.
#[derive(Debug, Clone, Copy)]
pub struct KvPool {
    /// `num_blocks * block_floats` f32.
    pub kv: DeviceSlice,
    /// Blocks.
    pub num_blocks: usize,
    /// Tokens per block.
    pub block_size: usize,
    /// Floats per block (all layers).
    pub block_floats: usize,
    /// The layer's K inside a block.
    pub layer_offset: usize,
}

/// An attention layer's sizes.
#[derive(Debug, Clone, Copy)]
pub struct AttentionShape {
    /// Query heads.
    pub heads: usize,
    /// K/V heads (dividing `heads`).
    pub kv_heads: usize,
    /// Head dimension.
    pub head_dim: usize,
}

impl AttentionShape {
    /// Width of the fused QKV row.
    pub fn qkv_dim(&self) -> usize {
        (self.heads + 2 * self.kv_heads) * self.head_dim
    }

    fn check(&self, k: Kernel, pool: &KvPool) -> Result<()> {
        let bad = |detail: String| CudaError::BadLaunch {
            kernel: k.name(),
            detail,
        };
        if self.heads == 0 || self.kv_heads == 0 || self.heads % self.kv_heads != 0 {
            return Err(bad(format!("{self:?}: KV heads must divide heads")));
        }
        if self.head_dim == 0 || self.head_dim > MAX_HEAD_DIM {
            return Err(bad(format!(
                "head dim {} (1..={MAX_HEAD_DIM})",
                self.head_dim
            )));
        }
        let layer = 2 * pool.block_size * self.kv_heads * self.head_dim;
        if pool.block_size == 0 || pool.layer_offset.saturating_add(layer) > pool.block_floats {
            return Err(CudaError::BadRange(format!(
                "{}: a layer of {layer} floats at {} does not fit a block of {}",
                k.name(),
                pool.layer_offset,
                pool.block_floats
            )));
        }
        expect_bytes(
            k,
            "pool",
            pool.kv,
            pool.num_blocks.saturating_mul(pool.block_floats),
            4,
        )?;
        expect_aligned(k, "pool", pool.kv, 4)
    }
}

fn pool_args(k: Kernel, pool: &KvPool) -> Result<[KernelArg; 4]> {
    Ok([
        KernelArg::U32(to_u32(k, "block size", pool.block_size)?),
        KernelArg::U64(pool.block_floats as u64),
        KernelArg::U64(pool.layer_offset as u64),
        KernelArg::U32(to_u32(k, "blocks", pool.num_blocks)?),
    ])
}

/// Writes each row's K and V (from `qkv [rows, qkv_dim]`, after the queries) into the pool at
/// the row's position through its run's block table. Positions the table does not cover, and
/// block ids past the pool, are skipped.
pub fn kv_write(
    rt: &dyn Runtime,
    stream: Stream,
    step: &StepRows,
    pool: &KvPool,
    shape: &AttentionShape,
    qkv: DeviceSlice,
) -> Result<()> {
    let k = Kernel::KvWrite;
    step.check(k)?;
    shape.check(k, pool)?;
    let width = shape.kv_heads * shape.head_dim;
    let [p0, p1, p2, p3] = pool_args(k, pool)?;
    let args = [
        KernelArg::Ptr(pool.kv),
        f32_slice(k, "qkv", qkv, step.rows.saturating_mul(shape.qkv_dim()))?,
        KernelArg::Ptr(step.row_pos),
        KernelArg::Ptr(step.row_run),
        KernelArg::Ptr(step.runs),
        KernelArg::Ptr(step.tables),
        KernelArg::U32(to_u32(k, "tables", step.tables.bytes() / 4)?),
        KernelArg::U32(to_u32(k, "rows", step.rows)?),
        KernelArg::U32(to_u32(k, "runs", step.num_runs)?),
        KernelArg::U32(to_u32(k, "qkv dim", shape.qkv_dim())?),
        KernelArg::U32(to_u32(k, "k offset", shape.heads * shape.head_dim)?),
        KernelArg::U32(to_u32(k, "kv heads", shape.kv_heads)?),
        KernelArg::U32(to_u32(k, "head dim", shape.head_dim)?),
        p0,
        p1,
        p2,
        p3,
    ];
    let dims = flat_grid(k, ("column blocks", width), ("rows", step.rows))?;
    // SAFETY: the arguments match `kv_write`'s parameters; qkv holds rows rows, the pool
    // num_blocks blocks with the layer inside each, the step's arrays their checked lengths; the
    // kernel checks runs, table offsets and block ids against those lengths.
    unsafe { rt.launch(k, dims, &args, stream) }
}

/// The buffers and the key split of one attention call ([`attention`], [`attention_tiled`]).
#[derive(Debug, Clone, Copy)]
pub struct AttentionIo {
    /// Every row's `q | k | v` projections, `rows * qkv_dim` f32 (`AttentionShape::qkv_dim`).
    pub qkv: DeviceSlice,
    /// The splits' partial results, `rows * heads * splits * (head_dim + 2)` f32.
    pub partial: DeviceSlice,
    /// The merged output, `rows * heads * head_dim` f32.
    pub out: DeviceSlice,
    /// Thread blocks each row's keys are split across.
    pub splits: usize,
    /// Keys per split.
    pub split_keys: usize,
}

/// Causal GQA attention of every row's queries (in `io.qkv`) over keys `0..=pos` of its run's
/// block table, split across `io.splits` blocks of `io.split_keys` keys each and merged into
/// `io.out`.
pub fn attention(
    rt: &dyn Runtime,
    stream: Stream,
    step: &StepRows,
    pool: &KvPool,
    shape: &AttentionShape,
    io: &AttentionIo,
) -> Result<()> {
    let launch = AttentionLaunch::new(Kernel::AttentionSplit, step, pool, shape, io)?;
    launch.split(rt, stream, SplitRows::All)?;
    attention_combine(rt, stream, step, shape, io.partial, io.out, io.splits)
}

/// What one attention call gives both of its kernels, `attention_split` and `attention_tile`
/// (their shared parameters, in the same order).
struct AttentionLaunch<'a> {
    step: &'a StepRows,
    pool: &'a KvPool,
    shape: &'a AttentionShape,
    qkv: DeviceSlice,
    partial: DeviceSlice,
    splits: usize,
    split_keys: usize,
}

/// The rows one launch of `attention_split` computes.
enum SplitRows {
    /// Every row of the step.
    All,
    /// The `count` rows listed in `rows` (u32 row indices).
    Listed { rows: DeviceSlice, count: usize },
}

impl<'a> AttentionLaunch<'a> {
    /// Checks the step, the shape against the pool, and the split; `k` names the kernel in
    /// errors.
    fn new(
        k: Kernel,
        step: &'a StepRows,
        pool: &'a KvPool,
        shape: &'a AttentionShape,
        io: &AttentionIo,
    ) -> Result<Self> {
        let (splits, split_keys) = (io.splits, io.split_keys);
        step.check(k)?;
        shape.check(k, pool)?;
        if splits == 0 || split_keys == 0 {
            return Err(CudaError::BadLaunch {
                kernel: k.name(),
                detail: format!("{splits} splits of {split_keys} keys"),
            });
        }
        Ok(AttentionLaunch {
            step,
            pool,
            shape,
            qkv: io.qkv,
            partial: io.partial,
            splits,
            split_keys,
        })
    }

    /// The arguments both kernels take, in their order: the buffers and the step's arrays, then
    /// the shapes, the pool and the split (the tile kernel takes its tile list between the two,
    /// the split kernel its row list after them). Checks `partial` and `qkv` against the step;
    /// `k` names the kernel in errors.
    fn args(&self, k: Kernel) -> Result<([KernelArg; 8], [KernelArg; 13])> {
        let (step, shape) = (self.step, self.shape);
        let (h, hd) = (shape.heads, shape.head_dim);
        let partial_floats = step
            .rows
            .saturating_mul(h)
            .saturating_mul(self.splits)
            .saturating_mul(hd + 2);
        let buffers = [
            f32_slice(k, "partial", self.partial, partial_floats)?,
            f32_slice(
                k,
                "qkv",
                self.qkv,
                step.rows.saturating_mul(shape.qkv_dim()),
            )?,
            KernelArg::Ptr(self.pool.kv),
            KernelArg::Ptr(step.row_pos),
            KernelArg::Ptr(step.row_run),
            KernelArg::Ptr(step.runs),
            KernelArg::Ptr(step.tables),
            KernelArg::U32(to_u32(k, "tables", step.tables.bytes() / 4)?),
        ];
        let [p0, p1, p2, p3] = pool_args(k, self.pool)?;
        let shapes = [
            KernelArg::U32(to_u32(k, "rows", step.rows)?),
            KernelArg::U32(to_u32(k, "runs", step.num_runs)?),
            KernelArg::U32(to_u32(k, "heads", h)?),
            KernelArg::U32(to_u32(k, "kv heads", shape.kv_heads)?),
            KernelArg::U32(to_u32(k, "head dim", hd)?),
            KernelArg::U32(to_u32(k, "qkv dim", shape.qkv_dim())?),
            p0,
            p1,
            p2,
            p3,
            KernelArg::U32(to_u32(k, "splits", self.splits)?),
            KernelArg::U32(to_u32(k, "split keys", self.split_keys)?),
            KernelArg::F32((hd as f64).powf(-0.5) as f32),
        ];
        Ok((buffers, shapes))
    }

    /// Launches `attention_split` (one block per split, head and row) over `rows`.
    fn split(&self, rt: &dyn Runtime, stream: Stream, rows: SplitRows) -> Result<()> {
        let k = Kernel::AttentionSplit;
        // The kernel takes a null list with a count of 0 for every row of the step.
        let (list, listed, count, what) = match rows {
            SplitRows::All => (KernelArg::Null, 0, self.step.rows, "rows"),
            SplitRows::Listed { rows, count } => {
                (KernelArg::Ptr(rows), count, count, "single rows")
            }
        };
        if count > 65535 {
            return Err(CudaError::BadLaunch {
                kernel: k.name(),
                detail: format!("{count} rows (at most 65535 a launch)"),
            });
        }
        let (buffers, shapes) = self.args(k)?;
        let args: Vec<KernelArg> = buffers
            .into_iter()
            .chain(shapes)
            .chain([list, KernelArg::U32(to_u32(k, what, listed)?)])
            .collect();
        let warps = (LAYER_THREADS / 32) as usize;
        let dims = LaunchDims {
            grid: [
                to_u32(k, "splits", self.splits)?,
                to_u32(k, "heads", self.shape.heads)?,
                to_u32(k, what, count)?,
            ],
            block: [LAYER_THREADS, 1, 1],
            shared_bytes: to_u32(k, "shared bytes", warps * self.shape.head_dim * 4)?,
        };
        // SAFETY: the arguments match `attention_split`'s parameters; partial and qkv hold the
        // sizes `args` checked, the pool num_blocks blocks with the layer inside each, a row list
        // its count of words (checked by the caller); the kernel checks runs, table offsets,
        // block ids and each listed row against their lengths; the shared memory holds warps x
        // head_dim floats.
        unsafe { rt.launch(k, dims, &args, stream) }
    }
}

/// Merges the splits' partials into `out [rows, heads * head_dim]`.
fn attention_combine(
    rt: &dyn Runtime,
    stream: Stream,
    step: &StepRows,
    shape: &AttentionShape,
    partial: DeviceSlice,
    out: DeviceSlice,
    splits: usize,
) -> Result<()> {
    let (h, hd) = (shape.heads, shape.head_dim);
    let k = Kernel::AttentionCombine;
    expect_bytes(
        k,
        "partial",
        partial,
        step.rows
            .saturating_mul(h)
            .saturating_mul(splits)
            .saturating_mul(hd + 2),
        4,
    )?;
    let args = [
        f32_slice(k, "out", out, step.rows.saturating_mul(h * hd))?,
        KernelArg::Ptr(partial),
        KernelArg::U32(to_u32(k, "rows", step.rows)?),
        KernelArg::U32(to_u32(k, "heads", h)?),
        KernelArg::U32(to_u32(k, "head dim", hd)?),
        KernelArg::U32(to_u32(k, "splits", splits)?),
    ];
    let dims = LaunchDims {
        grid: [to_u32(k, "heads", h)?, to_u32(k, "rows", step.rows)?, 1],
        block: [LAYER_THREADS, 1, 1],
        shared_bytes: 0,
    };
    // SAFETY: the arguments match `attention_combine`'s parameters; out holds rows x heads x
    // head_dim floats and partial the size checked for the split launch.
    unsafe { rt.launch(k, dims, &args, stream) }
}

/// Warps of an [`attention_tiled`] block (`ATTN_TILE_WARPS`).
const TILE_WARPS: usize = 4;
/// Query rows each warp of a tile block owns (`ATTN_ROWS_PER_WARP`).
const TILE_ROWS_PER_WARP: usize = 4;
/// Keys staged in shared memory at a time (`ATTN_TILE_KEYS`).
const TILE_KEYS: usize = 32;

/// Dynamic shared memory of an `attention_tile` block: the tile's queries and one key tile
/// (rows padded by one float).
fn tile_shared_bytes(tile_rows: usize, head_dim: usize) -> usize {
    (tile_rows * head_dim + TILE_KEYS * (head_dim + 1)) * 4
}

/// The most query rows of one tile of [`attention_tiled`] for heads of `head_dim`: 16 where the
/// queries and a key tile fit the 48 KiB every device gives a block (head_dim ≤ 254), else 8.
pub fn attention_tile_rows(head_dim: usize) -> usize {
    let most = TILE_WARPS * TILE_ROWS_PER_WARP;
    // Static shared memory: the key tile's KV offsets.
    let limit = SHARED_LIMIT - TILE_KEYS * 8;
    let mut rows = most;
    while rows > 1 && tile_shared_bytes(rows, head_dim) > limit {
        rows /= 2;
    }
    rows
}

/// How a step's rows go to the attention kernels: tiles of consecutive rows of one prefill run
/// (`num_tiles` pairs of u32: first row, row count ≤ [`attention_tile_rows`]) to the tiled
/// kernel, and single rows (`num_singles` u32 row indices, the decode rows) to the split kernel.
/// Together they must name every row of the step once; a row named by neither keeps stale
/// partials (memory-safe, but wrong).
#[derive(Debug, Clone, Copy)]
pub struct AttentionWork {
    /// `2 * num_tiles` u32.
    pub tiles: DeviceSlice,
    /// Tiles.
    pub num_tiles: usize,
    /// Row count bound of every tile (at most [`attention_tile_rows`] of the head size).
    pub tile_rows: usize,
    /// `num_singles` u32.
    pub singles: DeviceSlice,
    /// Single rows.
    pub num_singles: usize,
}

/// The tiles and singles of a step's runs (start position, length) for [`AttentionWork`], as
/// host words: runs are cut into tiles of at most `tile_rows` rows, but runs of one row are
/// singles (the split kernel's) when `singles` is set. Answers `(tiles, singles)`.
pub fn attention_plan(
    run_lens: &[usize],
    tile_rows: usize,
    singles_on: bool,
) -> (Vec<u32>, Vec<u32>) {
    let tile_rows = tile_rows.max(1);
    let (mut tiles, mut singles) = (Vec::new(), Vec::new());
    let mut row = 0usize;
    for &len in run_lens {
        if len == 1 && singles_on {
            singles.push(row as u32);
        } else {
            let mut done = 0;
            while done < len {
                let count = (len - done).min(tile_rows);
                tiles.extend([(row + done) as u32, count as u32]);
                done += count;
            }
        }
        row += len;
    }
    (tiles, singles)
}

/// Causal GQA attention like [`attention`], with the prefill rows in flash-style query tiles
/// (see `attention_tile` in `attention.cu`): each tile block stages its keys and values in shared
/// memory, tile by tile, so a prefill chunk reads each key once per tile of queries instead of
/// once per query. Decode rows (`work.singles`) go to the split kernel as in [`attention`]; both
/// write the same partials, merged by one combine.
pub fn attention_tiled(
    rt: &dyn Runtime,
    stream: Stream,
    step: &StepRows,
    work: &AttentionWork,
    pool: &KvPool,
    shape: &AttentionShape,
    io: &AttentionIo,
) -> Result<()> {
    let k = Kernel::AttentionTile;
    let launch = AttentionLaunch::new(k, step, pool, shape, io)?;
    let bad = |detail: String| CudaError::BadLaunch {
        kernel: k.name(),
        detail,
    };
    let (h, hd) = (shape.heads, shape.head_dim);
    let tile_cap = attention_tile_rows(hd);
    if work.tile_rows == 0 || work.tile_rows > tile_cap {
        return Err(bad(format!(
            "tiles of {} rows (1..={tile_cap} for heads of {hd})",
            work.tile_rows
        )));
    }
    expect_bytes(k, "tiles", work.tiles, work.num_tiles.saturating_mul(2), 4)?;
    expect_bytes(k, "single rows", work.singles, work.num_singles, 4)?;
    expect_aligned(k, "tiles", work.tiles, 4)?;
    expect_aligned(k, "single rows", work.singles, 4)?;
    // Checks partial and qkv (naming the tile kernel) whichever of the two kernels run.
    let (buffers, shapes) = launch.args(k)?;
    if work.num_tiles > 0 {
        if work.num_tiles > 65535 {
            return Err(bad(format!(
                "{} tiles (at most 65535 a launch)",
                work.num_tiles
            )));
        }
        let tiles = [
            KernelArg::Ptr(work.tiles),
            KernelArg::U32(to_u32(k, "tiles", work.num_tiles)?),
        ];
        let tile_rows = KernelArg::U32(to_u32(k, "tile rows", work.tile_rows)?);
        let args: Vec<KernelArg> = buffers
            .into_iter()
            .chain(tiles)
            .chain(shapes)
            .chain([tile_rows])
            .collect();
        let dims = LaunchDims {
            grid: [
                to_u32(k, "splits", io.splits)?,
                to_u32(k, "heads", h)?,
                to_u32(k, "tiles", work.num_tiles)?,
            ],
            block: [(TILE_WARPS * 32) as u32, 1, 1],
            shared_bytes: to_u32(k, "shared bytes", tile_shared_bytes(work.tile_rows, hd))?,
        };
        // SAFETY: the arguments match `attention_tile`'s parameters; partial and qkv hold the
        // sizes checked above, the pool num_blocks blocks with the layer inside each, tiles
        // 2 * num_tiles words; the kernel checks each tile's rows against `rows` and `tile_rows`,
        // and runs, table offsets and block ids against their lengths; the shared memory holds
        // tile_rows queries and one key tile.
        unsafe { rt.launch(k, dims, &args, stream)? };
    }
    if work.num_singles > 0 {
        launch.split(
            rt,
            stream,
            SplitRows::Listed {
                rows: work.singles,
                count: work.num_singles,
            },
        )?;
    }
    attention_combine(rt, stream, step, shape, io.partial, io.out, io.splits)
}

/// The MoE router's settings (ARCH.md §6.1).
#[derive(Debug, Clone, Copy)]
pub struct MoeRoute {
    /// Routed experts.
    pub experts: usize,
    /// Expert groups (at most 64, dividing `experts`).
    pub groups: usize,
    /// Groups kept.
    pub topk_groups: usize,
    /// Experts per token.
    pub k: usize,
    /// Whether the chosen weights are normalised.
    pub normalize: bool,
    /// The routed scaling factor.
    pub scale: f32,
}

/// Routes each of `tokens` tokens from its gate logits (`logits [tokens, experts]`) with the
/// correction bias (`bias [experts]`): `choice [tokens, k]` expert ids and `weight [tokens, k]`.
#[allow(clippy::too_many_arguments)] // Four buffers, the token count and the settings.
pub fn moe_route(
    rt: &dyn Runtime,
    stream: Stream,
    route: &MoeRoute,
    choice: DeviceSlice,
    weight: DeviceSlice,
    logits: DeviceSlice,
    bias: DeviceSlice,
    tokens: usize,
) -> Result<()> {
    let k = Kernel::MoeRoute;
    if route.groups == 0
        || route.groups > 64
        || route.experts % route.groups != 0
        || route.experts / route.groups < 2
        || route.k == 0
        || route.k > route.experts
        || route.topk_groups == 0
        || route.topk_groups > route.groups
    {
        return Err(CudaError::BadLaunch {
            kernel: k.name(),
            detail: format!("router {route:?}"),
        });
    }
    let picks = tokens.saturating_mul(route.k);
    expect_bytes(k, "choice", choice, picks, 4)?;
    expect_aligned(k, "choice", choice, 4)?;
    let args = [
        KernelArg::Ptr(choice),
        f32_slice(k, "weight", weight, picks)?,
        f32_slice(k, "logits", logits, tokens.saturating_mul(route.experts))?,
        f32_slice(k, "bias", bias, route.experts)?,
        KernelArg::U32(to_u32(k, "tokens", tokens)?),
        KernelArg::U32(to_u32(k, "experts", route.experts)?),
        KernelArg::U32(to_u32(k, "groups", route.groups)?),
        KernelArg::U32(to_u32(k, "top groups", route.topk_groups)?),
        KernelArg::U32(to_u32(k, "k", route.k)?),
        KernelArg::U32(u32::from(route.normalize)),
        KernelArg::F32(route.scale),
    ];
    let dims = LaunchDims::linear(
        to_u32(k, "blocks", tokens.div_ceil(LAYER_THREADS as usize).max(1))?,
        LAYER_THREADS,
    );
    // SAFETY: the arguments match `moe_route`'s parameters; thread t reads one row of logits and
    // the bias and writes k choices and weights of row t, all sized above.
    unsafe { rt.launch(k, dims, &args, stream) }
}

/// The dispatch buffers of one MoE layer: `pad_cap = tokens * k + experts * (TILE - 1)` rounded
/// up to whole tiles, `tiles = pad_cap / TILE`.
#[derive(Debug, Clone, Copy)]
pub struct MoeDispatch {
    /// `experts` u32.
    pub counts: DeviceSlice,
    /// `pad_cap` u32: each position's assignment (`token * k + j`) or `u32::MAX` (padding).
    pub sorted: DeviceSlice,
    /// `tiles` i32: each tile's expert, -1 past the last.
    pub tile_expert: DeviceSlice,
    /// `tokens * k` u32: each assignment's position.
    pub assign_pos: DeviceSlice,
    /// Positions.
    pub pad_cap: usize,
}

impl MoeDispatch {
    /// The positions `tokens` tokens with `k` experts each over `experts` experts may need.
    pub fn pad_cap(tokens: usize, k: usize, experts: usize) -> usize {
        (tokens * k + experts * (MOE_TILE_ROWS - 1)).div_ceil(MOE_TILE_ROWS) * MOE_TILE_ROWS
    }

    fn tiles(&self) -> usize {
        self.pad_cap / MOE_TILE_ROWS
    }

    /// Checks the buffers; with `Some((assignments, experts))` also the counts, the assignment
    /// positions and that `pad_cap` holds every assignment with each expert's padding.
    fn check(&self, k: Kernel, sizes: Option<(usize, usize)>) -> Result<()> {
        let (assignments, experts) = sizes.unwrap_or((0, 0));
        if self.pad_cap % MOE_TILE_ROWS != 0
            || self.pad_cap < assignments + experts * (MOE_TILE_ROWS - 1)
        {
            return Err(CudaError::BadRange(format!(
                "{}: {} positions for {assignments} assignments over {experts} experts",
                k.name(),
                self.pad_cap
            )));
        }
        let mut buffers = vec![
            ("sorted", self.sorted, self.pad_cap),
            ("tile experts", self.tile_expert, self.tiles()),
        ];
        if sizes.is_some() {
            buffers.push(("counts", self.counts, experts));
            buffers.push(("assignment positions", self.assign_pos, assignments));
        }
        for (what, slice, elems) in buffers {
            expect_bytes(k, what, slice, elems, 4)?;
            expect_aligned(k, what, slice, 4)?;
        }
        Ok(())
    }
}

/// Sorts the `tokens * k` assignments of `choice` by expert into `dispatch`, stable, each
/// expert's rows padded to whole tiles.
pub fn moe_dispatch(
    rt: &dyn Runtime,
    stream: Stream,
    dispatch: &MoeDispatch,
    choice: DeviceSlice,
    tokens: usize,
    k_top: usize,
    experts: usize,
) -> Result<()> {
    let assignments = tokens.saturating_mul(k_top);
    let k = Kernel::MoeCount;
    dispatch.check(k, Some((assignments, experts)))?;
    expect_bytes(k, "choice", choice, assignments, 4)?;
    expect_aligned(k, "choice", choice, 4)?;
    let dims = LaunchDims::linear(to_u32(k, "experts", experts)?, ROW_THREADS);
    let args = [
        KernelArg::Ptr(dispatch.counts),
        KernelArg::Ptr(choice),
        KernelArg::U32(to_u32(k, "assignments", assignments)?),
        KernelArg::U32(to_u32(k, "experts", experts)?),
    ];
    // SAFETY: the arguments match `moe_count`'s parameters; block e reads the assignments and
    // writes counts[e], all sized above.
    unsafe { rt.launch(k, dims, &args, stream)? };
    let k = Kernel::MoePlace;
    let args = [
        KernelArg::Ptr(dispatch.sorted),
        KernelArg::Ptr(dispatch.tile_expert),
        KernelArg::Ptr(dispatch.assign_pos),
        KernelArg::Ptr(dispatch.counts),
        KernelArg::Ptr(choice),
        KernelArg::U32(to_u32(k, "assignments", assignments)?),
        KernelArg::U32(to_u32(k, "experts", experts)?),
        KernelArg::U32(MOE_TILE_ROWS as u32),
        KernelArg::U32(to_u32(k, "positions", dispatch.pad_cap)?),
        KernelArg::U32(to_u32(k, "tiles", dispatch.tiles())?),
    ];
    // SAFETY: the arguments match `moe_place`'s parameters; the kernel writes positions below
    // pad_cap, tiles below tiles_cap and assignment positions below `assignments`, all sized above.
    unsafe { rt.launch(k, dims, &args, stream) }
}

/// The shape of one expert GEMM launch.
#[derive(Debug, Clone, Copy)]
pub struct MoeGemm {
    /// Experts stacked in the weights.
    pub experts: usize,
    /// Experts per token.
    pub k: usize,
    /// Rows of `x`.
    pub x_rows: usize,
    /// Input width.
    pub in_dim: usize,
    /// Output width.
    pub out_dim: usize,
    /// Whether `x` rows are tokens (first GEMM) or positions (second GEMM).
    pub gather: bool,
    /// Whether ReLU² follows.
    pub relu2: bool,
}

/// `out [pad_cap, out_dim]`: each dispatched position's row times its expert's weights
/// (`w [experts, out_dim, in_dim]` in `dtype`), plus the expert's bias, then ReLU² when asked.
#[allow(clippy::too_many_arguments)] // Four buffers, the dispatch, the weights' type and the shape.
pub fn moe_gemm(
    rt: &dyn Runtime,
    stream: Stream,
    dispatch: &MoeDispatch,
    shape: &MoeGemm,
    out: DeviceSlice,
    x: DeviceSlice,
    w: DeviceSlice,
    dtype: DType,
    bias: Option<DeviceSlice>,
) -> Result<()> {
    let k = match dtype {
        DType::F32 => Kernel::MoeGemmF32,
        DType::Bf16 => Kernel::MoeGemmBf16,
    };
    dispatch.check(k, None)?;
    if shape.k == 0 || shape.in_dim == 0 || shape.out_dim == 0 {
        return Err(CudaError::BadLaunch {
            kernel: k.name(),
            detail: format!("{shape:?}"),
        });
    }
    let stacked = shape
        .experts
        .saturating_mul(shape.out_dim)
        .saturating_mul(shape.in_dim);
    expect_bytes(k, "weights", w, stacked, dtype.bytes())?;
    expect_aligned(k, "weights", w, dtype.bytes() as u64)?;
    let args = [
        f32_slice(
            k,
            "out",
            out,
            dispatch.pad_cap.saturating_mul(shape.out_dim),
        )?,
        f32_slice(k, "x", x, shape.x_rows.saturating_mul(shape.in_dim))?,
        KernelArg::Ptr(w),
        optional_f32(k, "bias", bias, shape.experts.saturating_mul(shape.out_dim))?,
        KernelArg::Ptr(dispatch.sorted),
        KernelArg::Ptr(dispatch.tile_expert),
        KernelArg::U32(to_u32(k, "tiles", dispatch.tiles())?),
        KernelArg::U32(to_u32(k, "experts", shape.experts)?),
        KernelArg::U32(to_u32(k, "k", shape.k)?),
        KernelArg::U32(to_u32(k, "x rows", shape.x_rows)?),
        KernelArg::U32(to_u32(k, "in dim", shape.in_dim)?),
        KernelArg::U32(to_u32(k, "out dim", shape.out_dim)?),
        KernelArg::U32(u32::from(shape.gather)),
        KernelArg::U32(u32::from(shape.relu2)),
    ];
    let dims = LaunchDims {
        grid: [
            to_u32(k, "column tiles", shape.out_dim.div_ceil(MOE_TILE_COLS))?,
            to_u32(k, "tiles", dispatch.tiles())?,
            1,
        ],
        block: [256, 1, 1],
        shared_bytes: 0,
    };
    if dims.grid[1] > 65535 {
        return Err(CudaError::BadLaunch {
            kernel: k.name(),
            detail: format!("{} tiles (at most 65535 a launch)", dispatch.tiles()),
        });
    }
    // SAFETY: the arguments match `moe_gemm_*`'s parameters; out holds pad_cap rows, x x_rows
    // rows, the weights `experts` stacked matrices (checked above); the kernel checks tile
    // experts against `experts` and source rows against x_rows.
    unsafe { rt.launch(k, dims, &args, stream) }
}

/// `out [tokens, dim]`: each token's expert outputs (rows of `expert_out [pad_cap, dim]`)
/// weighted and summed in ascending expert order.
#[allow(clippy::too_many_arguments)] // Four buffers, the dispatch and the sizes.
pub fn moe_combine(
    rt: &dyn Runtime,
    stream: Stream,
    dispatch: &MoeDispatch,
    out: DeviceSlice,
    expert_out: DeviceSlice,
    choice: DeviceSlice,
    weight: DeviceSlice,
    tokens: usize,
    k_top: usize,
    dim: usize,
) -> Result<()> {
    let k = Kernel::MoeCombine;
    let picks = tokens.saturating_mul(k_top);
    expect_bytes(k, "choice", choice, picks, 4)?;
    expect_aligned(k, "choice", choice, 4)?;
    dispatch.check(k, None)?;
    expect_bytes(k, "assignment positions", dispatch.assign_pos, picks, 4)?;
    expect_aligned(k, "assignment positions", dispatch.assign_pos, 4)?;
    let args = [
        f32_slice(k, "out", out, tokens.saturating_mul(dim))?,
        f32_slice(
            k,
            "expert out",
            expert_out,
            dispatch.pad_cap.saturating_mul(dim),
        )?,
        KernelArg::Ptr(choice),
        f32_slice(k, "weight", weight, picks)?,
        KernelArg::Ptr(dispatch.assign_pos),
        KernelArg::U32(to_u32(k, "tokens", tokens)?),
        KernelArg::U32(to_u32(k, "k", k_top)?),
        KernelArg::U32(to_u32(k, "dim", dim)?),
        KernelArg::U32(to_u32(k, "positions", dispatch.pad_cap)?),
    ];
    let dims = flat_grid(k, ("column blocks", dim.max(1)), ("tokens", tokens))?;
    // SAFETY: the arguments match `moe_combine`'s parameters; every buffer holds the size checked
    // above and the kernel reads expert_out only at positions below pad_cap.
    unsafe { rt.launch(k, dims, &args, stream) }
}

/// `x = act(x + bias)` over `rows x cols`, act ReLU² when `relu2`; `bias [cols]` may be absent.
pub fn bias_act(
    rt: &dyn Runtime,
    stream: Stream,
    x: DeviceSlice,
    bias: Option<DeviceSlice>,
    rows: usize,
    cols: usize,
    relu2: bool,
) -> Result<()> {
    let k = Kernel::BiasAct;
    let cells = rows.saturating_mul(cols);
    let args = [
        f32_slice(k, "x", x, cells)?,
        optional_f32(k, "bias", bias, cols)?,
        KernelArg::U32(to_u32(k, "rows", rows)?),
        KernelArg::U32(to_u32(k, "cols", cols)?),
        KernelArg::U32(u32::from(relu2)),
    ];
    let dims = LaunchDims::linear(flat_blocks(cells as u64), FLAT_THREADS);
    // SAFETY: the arguments match `bias_act`'s parameters; x holds rows*cols floats and the bias
    // cols floats (checked above).
    unsafe { rt.launch(k, dims, &args, stream) }
}

/// `dst += src` over `count` floats (no overlap).
pub fn add_into(
    rt: &dyn Runtime,
    stream: Stream,
    dst: DeviceSlice,
    src: DeviceSlice,
    count: usize,
) -> Result<()> {
    let k = Kernel::AddInto;
    if dst.overlaps(&src) {
        return Err(CudaError::BadRange("add_into: dst overlaps src".to_owned()));
    }
    let args = [
        f32_slice(k, "dst", dst, count)?,
        f32_slice(k, "src", src, count)?,
        KernelArg::U64(count as u64),
    ];
    let dims = LaunchDims::linear(flat_blocks(count as u64), FLAT_THREADS);
    // SAFETY: the arguments match `add_into`'s parameters; both hold count floats.
    unsafe { rt.launch(k, dims, &args, stream) }
}

/// `hidden += add` (when given), then `normed = RMSNorm(hidden) * w` (f32 weights), per row.
#[allow(clippy::too_many_arguments)] // Four buffers, two sizes and eps.
pub fn residual_rmsnorm(
    rt: &dyn Runtime,
    stream: Stream,
    hidden: DeviceSlice,
    add: Option<DeviceSlice>,
    normed: DeviceSlice,
    weight: DeviceSlice,
    rows: usize,
    dim: usize,
    eps: f32,
) -> Result<()> {
    let k = Kernel::ResidualRmsNorm;
    let cells = rows.saturating_mul(dim);
    if hidden.overlaps(&normed) || add.is_some_and(|a| a.overlaps(&hidden) || a.overlaps(&normed)) {
        return Err(CudaError::BadRange(
            "residual_rmsnorm: buffers overlap".to_owned(),
        ));
    }
    let args = [
        f32_slice(k, "hidden", hidden, cells)?,
        optional_f32(k, "add", add, cells)?,
        f32_slice(k, "normed", normed, cells)?,
        f32_slice(k, "weight", weight, dim)?,
        KernelArg::U32(to_u32(k, "rows", rows)?),
        KernelArg::U32(to_u32(k, "dim", dim)?),
        KernelArg::F32(eps),
    ];
    let dims = LaunchDims::linear(to_u32(k, "rows", rows.max(1))?, ROW_THREADS);
    // SAFETY: the arguments match `residual_rmsnorm`'s parameters; every buffer holds rows x dim
    // floats (the weight dim), checked above; block `row` touches one row.
    unsafe { rt.launch(k, dims, &args, stream) }
}

/// `out[i] = RMSNorm(x[rows[i]]) * w` for the `count` rows named by `rows` (u32, device) out of
/// the `x_rows` rows of `x`.
#[allow(clippy::too_many_arguments)] // Four buffers, three sizes and eps.
pub fn rmsnorm_select(
    rt: &dyn Runtime,
    stream: Stream,
    out: DeviceSlice,
    x: DeviceSlice,
    rows: DeviceSlice,
    weight: DeviceSlice,
    count: usize,
    x_rows: usize,
    dim: usize,
    eps: f32,
) -> Result<()> {
    let k = Kernel::RmsNormSelect;
    expect_bytes(k, "rows", rows, count, 4)?;
    expect_aligned(k, "rows", rows, 4)?;
    let args = [
        f32_slice(k, "out", out, count.saturating_mul(dim))?,
        f32_slice(k, "x", x, x_rows.saturating_mul(dim))?,
        KernelArg::Ptr(rows),
        f32_slice(k, "weight", weight, dim)?,
        KernelArg::U32(to_u32(k, "count", count)?),
        KernelArg::U32(to_u32(k, "x rows", x_rows)?),
        KernelArg::U32(to_u32(k, "dim", dim)?),
        KernelArg::F32(eps),
    ];
    let dims = LaunchDims::linear(to_u32(k, "count", count.max(1))?, ROW_THREADS);
    // SAFETY: the arguments match `rmsnorm_select`'s parameters; out holds count rows, x x_rows
    // rows and the kernel zeroes rows whose index is past x_rows instead of reading them.
    unsafe { rt.launch(k, dims, &args, stream) }
}
