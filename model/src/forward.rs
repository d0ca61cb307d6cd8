//! The forward pass over a batch of token rows: embedding, the block stack (Mamba2, attention, MLP,
//! MoE) over caller-owned KV blocks and Mamba state slots, final norm and lm_head.
//!
//! One code path serves prefill chunks and decode batches: a row is one token with its position,
//! block table and state slot. Rows of one sequence (a prefill chunk) are processed in position
//! order, so the Mamba recurrence sees them one by one exactly as a decode step would, and every
//! attention query reads keys `0..=pos` in position order. Matrix products batch all rows; every
//! other reduction runs per row in a fixed order (see `math`). Hence a row's logits are the same
//! bits whatever other rows share its batch and however its sequence was cut into chunks.
//!
//! The MTP head ([`forward_mtp`]) runs its own layers through the same block code, with the
//! KV and state indices of its layers after the main stack's, from the input `eh_proj` makes of
//! the next token's embedding and the previous hidden state.
//!
//! Callers validate everything (ids, positions, layouts) before calling [`forward`]; it only
//! indexes memory the validation has vouched for.

use std::sync::Arc;

use crate::config::DtClamp;
use crate::experts::{ExpertBatch, ExpertPool};
use crate::gemm::{Epilogue, Kernels};
use crate::lora::{LoraAdapter, Target};
use crate::math::{
    exp_simd, matmul, matmul_then, relu2, rms_norm, sigmoid, silu, softplus, sum_squares, Matmul,
};
use crate::state::{KvPool, MambaStates};
use crate::weights::{
    AttentionWeights, Layer, Linear, MambaWeights, Mixer, MlpWeights, MoeWeights, MtpWeights,
    Weights,
};
use crate::{Config, DecodeRow, LayerKind, ModelError, PrefillRow, RunRow};

/// Rows processed together at most; longer prefills are split (which cannot change any bits).
pub(crate) const MAX_ROWS: usize = 128;

/// Reusable activation buffers and the thread pool a forward pass runs on.
///
/// Buffers only grow, so a steady-state step allocates little here (the Mamba scan builds one
/// small list of state slices per layer). A `Scratch` may be shared by models of different
/// configs; it simply grows to the largest. Its thread count ([`Scratch::with_threads`]) never
/// changes any output bit: work is split by output rows, heads or columns, never inside a sum.
#[derive(Debug, Default, Clone)]
pub struct Scratch {
    /// The pool the forward pass runs on; `None` runs it on the caller's thread.
    pool: Option<Arc<rayon::ThreadPool>>,
    /// Expert-parallel workers for the MoE layers; `None` runs the experts here.
    experts: Option<Arc<ExpertPool>>,
    mm: Matmul,
    hidden: Vec<f32>,
    normed: Vec<f32>,
    proj: Vec<f32>,
    mixed: Vec<f32>,
    out: Vec<f32>,
    // Attention: the tasks' outputs, tile after tile (see `attention`).
    attn: Vec<f32>,
    // Mamba: conv outputs of every row, the scan's outputs (run-major, see `mamba`).
    conv_out: Vec<f32>,
    scan: Vec<f32>,
    // MoE.
    router: Vec<f32>,
    choices: Vec<(usize, f32)>,
    kept_groups: Vec<bool>,
    expert_rows: Vec<(usize, f32)>,
    // Local experts: each expert's range of `expert_rows`, each token's (output row, weight)
    // (`k` places per token, `token_counts` used), one single-threaded product per expert.
    expert_spans: Vec<(usize, usize)>,
    token_slots: Vec<(usize, f32)>,
    token_counts: Vec<usize>,
    expert_mms: Vec<Matmul>,
    expert_in: Vec<f32>,
    expert_act: Vec<f32>,
    expert_out: Vec<f32>,
    routed: Vec<f32>,
    latent_in: Vec<f32>,
    shared_act: Vec<f32>,
    // LoRA: the rows of each adapter group (flat, group after group), the groups as
    // (a row of the group, start, end) into it, and the gathered input, `x·Aᵀ` and `(x·Aᵀ)·Bᵀ`.
    lora_order: Vec<usize>,
    lora_groups: Vec<(usize, usize, usize)>,
    lora_in: Vec<f32>,
    lora_mid: Vec<f32>,
    lora_out: Vec<f32>,
    // Validation.
    pub(crate) pairs: Vec<(usize, usize)>,
}

/// `buf[..len]`, growing `buf` if needed (never shrinking, so no reallocation in steady state).
fn take(buf: &mut Vec<f32>, len: usize) -> &mut [f32] {
    if buf.len() < len {
        buf.resize(len, 0.0);
    }
    &mut buf[..len]
}

impl Scratch {
    /// Buffers pre-sized for `config` at the largest row count one forward pass uses (128); the
    /// forward pass runs on the caller's thread.
    pub fn new(config: &Config) -> Self {
        let mut scratch = Self::default();
        let rows = MAX_ROWS;
        let d = config.hidden_size;
        let widest = [
            config.mamba_in_proj_dim(),
            (config.num_attention_heads + 2 * config.num_key_value_heads) * config.head_dim,
            config.intermediate_size,
            config.moe_intermediate_size,
            config.moe_shared_expert_intermediate_size,
            d,
        ]
        .into_iter()
        .max()
        .unwrap_or(d);
        take(&mut scratch.hidden, rows * d);
        take(&mut scratch.normed, rows * d);
        take(&mut scratch.out, rows * d);
        take(&mut scratch.proj, rows * widest);
        take(&mut scratch.mixed, rows * widest);
        take(
            &mut scratch.attn,
            rows * config.num_attention_heads * config.head_dim,
        );
        scratch
    }

    /// Like [`Scratch::new`], with forward passes spread over a pool of `threads` threads (1: the
    /// caller's thread, no pool). Outputs are the same bits for every thread count.
    pub fn with_threads(config: &Config, threads: usize) -> Result<Self, ModelError> {
        let mut scratch = Self::new(config);
        scratch.set_threads(threads)?;
        Ok(scratch)
    }

    /// Changes the thread count (see [`Scratch::with_threads`]).
    pub fn set_threads(&mut self, threads: usize) -> Result<(), ModelError> {
        if threads == 0 {
            return Err(ModelError::InvalidConfig {
                field: "threads",
                value: "0".into(),
                reason: "a forward pass needs at least one thread".into(),
            });
        }
        self.pool = if threads == 1 {
            None
        } else {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .thread_name(|i| format!("model-compute-{i}"))
                .build()
                .map_err(|e| ModelError::InvalidConfig {
                    field: "threads",
                    value: threads.to_string(),
                    reason: format!("the thread pool could not be started: {e}"),
                })?;
            Some(Arc::new(pool))
        };
        self.mm.kernels.threads = threads;
        Ok(())
    }

    /// Threads a forward pass uses.
    pub fn threads(&self) -> usize {
        self.mm.kernels.threads
    }

    /// Sets how finely each parallel region is cut: no job is more than `1 / (jobs * threads)`
    /// of the region (default 8 jobs per thread; ignored on one thread). Jobs also shrink
    /// towards the region's end (each at most `1 / (2 * threads)` of what is left), and the
    /// threads take them one at a time in order, so a thread that runs slower (a busier core, a
    /// later wake-up) does less of the region instead of holding up its join, at the cost of one
    /// hand-off per job; with `1`, only the shrinking bounds the jobs (a quarter of the region
    /// first on two threads). A tuning knob for benchmarks: it never changes any output bit.
    pub fn set_jobs_per_thread(&mut self, jobs: usize) -> Result<(), ModelError> {
        if jobs == 0 {
            return Err(ModelError::InvalidConfig {
                field: "jobs_per_thread",
                value: "0".into(),
                reason: "a parallel region needs at least one job per thread".into(),
            });
        }
        self.mm.kernels.jobs_per_thread = jobs;
        Ok(())
    }

    /// Jobs per thread of each parallel region (see [`Scratch::set_jobs_per_thread`]).
    pub fn jobs_per_thread(&self) -> usize {
        self.mm.kernels.jobs_per_thread
    }

    /// Runs the routed experts of MoE layers on `experts` (`None`: here, on the forward pass's
    /// threads). Outputs are the same bits either way.
    pub fn set_expert_pool(&mut self, experts: Option<Arc<ExpertPool>>) {
        self.experts = experts;
    }

    /// The expert-parallel workers, if any.
    pub fn expert_pool(&self) -> Option<&Arc<ExpertPool>> {
        self.experts.as_ref()
    }
}

/// The rows of one forward call.
pub(crate) enum Rows<'r, 'a> {
    /// Tokens `first..first + len` of one sequence's prefill chunk.
    Prefill {
        row: &'r PrefillRow<'a>,
        first: usize,
        len: usize,
    },
    /// Independent decode rows.
    Decode(&'r [DecodeRow<'a>]),
    /// Positions of several sequences' runs: row `i` is position `table[i].1` of run
    /// `table[i].0`; a run's rows are consecutive and in position order.
    Runs {
        runs: &'r [RunRow<'a>],
        table: &'r [(usize, usize)],
    },
}

impl Rows<'_, '_> {
    fn len(&self) -> usize {
        match self {
            Self::Prefill { len, .. } => *len,
            Self::Decode(rows) => rows.len(),
            Self::Runs { table, .. } => table.len(),
        }
    }

    fn token(&self, i: usize) -> u32 {
        match self {
            Self::Prefill { row, first, .. } => row.tokens[first + i],
            Self::Decode(rows) => rows[i].token,
            Self::Runs { runs, table } => runs[table[i].0].tokens[table[i].1],
        }
    }

    fn pos(&self, i: usize) -> usize {
        match self {
            Self::Prefill { row, first, .. } => row.start_pos + first + i,
            Self::Decode(rows) => rows[i].pos,
            Self::Runs { runs, table } => runs[table[i].0].start_pos + table[i].1,
        }
    }

    fn blocks(&self, i: usize) -> &[u32] {
        match self {
            Self::Prefill { row, .. } => row.blocks,
            Self::Decode(rows) => rows[i].blocks,
            Self::Runs { runs, table } => runs[table[i].0].blocks,
        }
    }

    fn slot(&self, i: usize) -> usize {
        match self {
            Self::Prefill { row, .. } => row.slot,
            Self::Decode(rows) => rows[i].slot,
            Self::Runs { runs, table } => runs[table[i].0].slot,
        }
    }

    /// The runs of rows sharing a state slot, in row order, as (first row, length): a prefill
    /// chunk is one run, each decode row its own, each sequence of a batch of runs one.
    fn runs(&self) -> Vec<(usize, usize)> {
        match self {
            Self::Prefill { len, .. } => vec![(0, *len)],
            Self::Decode(rows) => (0..rows.len()).map(|i| (i, 1)).collect(),
            Self::Runs { table, .. } => {
                let mut runs: Vec<(usize, usize)> = Vec::new();
                for (i, &(run, _)) in table.iter().enumerate() {
                    match runs.last_mut() {
                        Some((first, len)) if table[*first].0 == run => *len += 1,
                        _ => runs.push((i, 1)),
                    }
                }
                runs
            }
        }
    }

    /// The state slot that receives the row's Mamba state as it is after this row, if any.
    fn snapshot(&self, i: usize) -> Option<usize> {
        match self {
            Self::Runs { runs, table } => runs[table[i].0].snapshots.get(table[i].1).copied(),
            _ => None,
        }
    }
}

/// The LoRA adapter of each row of a forward call.
#[derive(Debug, Clone, Copy)]
pub(crate) enum LoraRows<'r, 'a> {
    /// No row has an adapter.
    None,
    /// Every row has this one (a prefill chunk).
    All(&'a LoraAdapter),
    /// Row `i` has `adapters[i]`.
    PerRow(&'r [Option<&'a LoraAdapter>]),
}

impl<'a> LoraRows<'_, 'a> {
    fn of(&self, row: usize) -> Option<&'a LoraAdapter> {
        match *self {
            LoraRows::None => None,
            LoraRows::All(adapter) => Some(adapter),
            LoraRows::PerRow(adapters) => adapters.get(row).copied().flatten(),
        }
    }

    /// Groups the `m` rows by adapter (the same adapter object), in order of first appearance,
    /// into `order` (rows, group after group, ascending within a group) and `groups`.
    fn group(&self, m: usize, order: &mut Vec<usize>, groups: &mut Vec<(usize, usize, usize)>) {
        order.clear();
        groups.clear();
        match *self {
            LoraRows::None => {}
            LoraRows::All(_) => {
                order.extend(0..m);
                groups.push((0, 0, m));
            }
            LoraRows::PerRow(_) => {
                for i in 0..m {
                    let Some(adapter) = self.of(i) else {
                        continue;
                    };
                    let seen = groups.iter().any(|&(rep, _, _)| {
                        self.of(rep)
                            .is_some_and(|other| std::ptr::eq(other, adapter))
                    });
                    if seen {
                        continue;
                    }
                    let start = order.len();
                    for j in i..m {
                        if self.of(j).is_some_and(|other| std::ptr::eq(other, adapter)) {
                            order.push(j);
                        }
                    }
                    groups.push((i, start, order.len()));
                }
            }
        }
    }
}

/// Where a LoRA term goes: the current layer's module `target`, whose base output for row `i`
/// is `out[i * stride + offset..][..out_dim]`.
#[derive(Debug, Clone, Copy)]
struct LoraSite {
    target: Target,
    stride: usize,
    offset: usize,
}

/// The LoRA buffers and row groups of one forward call (taken out of `Scratch` for the call).
pub(crate) struct LoraWork<'r, 'a> {
    rows: LoraRows<'r, 'a>,
    /// The layer being computed.
    layer: usize,
    order: Vec<usize>,
    groups: Vec<(usize, usize, usize)>,
    input: Vec<f32>,
    mid: Vec<f32>,
    out: Vec<f32>,
}

impl LoraWork<'_, '_> {
    /// Adds `scale · ((x·Aᵀ)·Bᵀ)` of each row's adapter to its base output at `site`, one batched
    /// pair of products per adapter over that adapter's rows (gathered), never merging weights.
    /// `x` holds the layer input, `in_dim` floats per row. The products are the packed GEMM's
    /// (`mm`, on the forward pass's threads), so the terms are the same bits for every thread
    /// count and whatever other rows share the batch.
    fn apply(
        &mut self,
        mm: &mut Matmul,
        x: &[f32],
        in_dim: usize,
        site: LoraSite,
        out: &mut [f32],
    ) {
        for g in 0..self.groups.len() {
            let (rep, start, end) = self.groups[g];
            let Some(adapter) = self.rows.of(rep) else {
                continue;
            };
            let Some(pair) = adapter.layers[self.layer].get(site.target) else {
                continue;
            };
            let rows = &self.order[start..end];
            let count = rows.len();
            let input = take(&mut self.input, count * in_dim);
            for (r, &i) in rows.iter().enumerate() {
                input[r * in_dim..(r + 1) * in_dim]
                    .copy_from_slice(&x[i * in_dim..(i + 1) * in_dim]);
            }
            let rank = pair.a.out_dim;
            let mid = take(&mut self.mid, count * rank);
            matmul(mm, &self.input[..count * in_dim], count, &pair.a, mid);
            let n = pair.b.out_dim;
            let delta = take(&mut self.out, count * n);
            matmul(mm, &self.mid[..count * rank], count, &pair.b, delta);
            let scale = adapter.scale();
            for (r, &i) in rows.iter().enumerate() {
                let base = i * site.stride + site.offset;
                for (o, &v) in out[base..base + n]
                    .iter_mut()
                    .zip(&delta[r * n..(r + 1) * n])
                {
                    *o += scale * v;
                }
            }
        }
    }

    fn active(&self) -> bool {
        !self.groups.is_empty()
    }
}

impl LoraWork<'_, '_> {
    /// No row has an adapter (the MTP head's layers are never adapted).
    fn none() -> Self {
        LoraWork {
            rows: LoraRows::None,
            layer: 0,
            order: Vec::new(),
            groups: Vec::new(),
            input: Vec::new(),
            mid: Vec::new(),
            out: Vec::new(),
        }
    }
}

/// Which rows of a forward call get logits, and where they go (`count * vocab` floats).
#[derive(Debug)]
pub(crate) enum LogitRows<'o> {
    /// Every row.
    All(&'o mut [f32]),
    /// Only this row.
    One(usize, &'o mut [f32]),
    /// These rows (ascending), one output row each.
    Select(&'o [usize], &'o mut [f32]),
    /// None (the call only advances KV and Mamba state).
    Skip,
}

/// Runs `rows` (each with its LoRA adapter, if any) through the model and writes the logits
/// `logit_rows` asks for, and, when `hidden_out` is given, every row's hidden state after the
/// final norm (`m * hidden_size`); on the scratch's thread pool when it has one.
#[allow(clippy::too_many_arguments)] // the model's state, the rows and their adapters, the two outputs
pub(crate) fn forward(
    config: &Config,
    weights: &Weights,
    scratch: &mut Scratch,
    kv: &mut KvPool,
    states: &mut MambaStates,
    rows: &Rows<'_, '_>,
    lora_rows: LoraRows<'_, '_>,
    logit_rows: LogitRows<'_>,
    hidden_out: Option<&mut [f32]>,
) -> Result<(), ModelError> {
    let run = |scratch: &mut Scratch| {
        forward_here(
            config, weights, scratch, kv, states, rows, lora_rows, logit_rows, hidden_out,
        )
    };
    #[cfg(feature = "region-timing")]
    crate::regions::forward_start();
    let result = match scratch.pool.clone() {
        Some(pool) => pool.install(|| run(scratch)),
        None => run(scratch),
    };
    #[cfg(feature = "region-timing")]
    crate::regions::forward_end();
    result
}

#[allow(clippy::too_many_arguments)] // see `forward`
fn forward_here(
    config: &Config,
    weights: &Weights,
    scratch: &mut Scratch,
    kv: &mut KvPool,
    states: &mut MambaStates,
    rows: &Rows<'_, '_>,
    lora_rows: LoraRows<'_, '_>,
    logit_rows: LogitRows<'_>,
    hidden_out: Option<&mut [f32]>,
) -> Result<(), ModelError> {
    let m = rows.len();
    let d = config.hidden_size;
    let hidden = take(&mut scratch.hidden, m * d);
    for i in 0..m {
        let t = rows.token(i) as usize;
        hidden[i * d..(i + 1) * d].copy_from_slice(&weights.embeddings[t * d..(t + 1) * d]);
    }
    let mut lora = LoraWork {
        rows: lora_rows,
        layer: 0,
        order: std::mem::take(&mut scratch.lora_order),
        groups: std::mem::take(&mut scratch.lora_groups),
        input: std::mem::take(&mut scratch.lora_in),
        mid: std::mem::take(&mut scratch.lora_mid),
        out: std::mem::take(&mut scratch.lora_out),
    };
    lora_rows.group(m, &mut lora.order, &mut lora.groups);
    let stacked = stack(
        config,
        &weights.layers,
        scratch,
        kv,
        states,
        rows,
        (0, 0, 0),
        &mut lora,
    );
    scratch.lora_order = lora.order;
    scratch.lora_groups = lora.groups;
    scratch.lora_in = lora.input;
    scratch.lora_mid = lora.mid;
    scratch.lora_out = lora.out;
    stacked?;
    head(
        config,
        &weights.norm_f,
        &weights.lm_head,
        scratch,
        m,
        logit_rows,
        hidden_out,
    );
    Ok(())
}

/// The MTP head over `rows` (whose tokens are each position's *next* token): the input
/// `eh_proj [enorm(E[token]), hnorm(hidden_in[i])]`, the MTP layers (KV and state indices after
/// the main stack's), the final norm, the shared `lm_head`. `hidden_out` receives every row's
/// normed output (the next draft position's hidden input). Runs on the scratch's thread pool
/// when it has one, like [`forward`].
#[allow(clippy::too_many_arguments)] // the same state arguments as `forward`, plus the two hidden streams
pub(crate) fn forward_mtp(
    config: &Config,
    weights: &Weights,
    mtp: &MtpWeights,
    scratch: &mut Scratch,
    kv: &mut KvPool,
    states: &mut MambaStates,
    rows: &Rows<'_, '_>,
    hidden_in: &[f32],
    logit_rows: LogitRows<'_>,
    hidden_out: Option<&mut [f32]>,
) -> Result<(), ModelError> {
    let run = |scratch: &mut Scratch| {
        forward_mtp_here(
            config, weights, mtp, scratch, kv, states, rows, hidden_in, logit_rows, hidden_out,
        )
    };
    #[cfg(feature = "region-timing")]
    crate::regions::forward_start();
    let result = match scratch.pool.clone() {
        Some(pool) => pool.install(|| run(scratch)),
        None => run(scratch),
    };
    #[cfg(feature = "region-timing")]
    crate::regions::forward_end();
    result
}

#[allow(clippy::too_many_arguments)] // see `forward_mtp`
fn forward_mtp_here(
    config: &Config,
    weights: &Weights,
    mtp: &MtpWeights,
    scratch: &mut Scratch,
    kv: &mut KvPool,
    states: &mut MambaStates,
    rows: &Rows<'_, '_>,
    hidden_in: &[f32],
    logit_rows: LogitRows<'_>,
    hidden_out: Option<&mut [f32]>,
) -> Result<(), ModelError> {
    let m = rows.len();
    let d = config.hidden_size;
    let eps = config.layer_norm_epsilon as f32;
    // `normed` holds the 2d-wide fused input row by row: [enorm(e), hnorm(h)].
    let fused = take(&mut scratch.normed, m * 2 * d);
    for i in 0..m {
        let t = rows.token(i) as usize;
        let (e, h) = fused[i * 2 * d..(i + 1) * 2 * d].split_at_mut(d);
        rms_norm(&weights.embeddings[t * d..(t + 1) * d], &mtp.enorm, eps, e);
        rms_norm(&hidden_in[i * d..(i + 1) * d], &mtp.hnorm, eps, h);
    }
    let hidden = take(&mut scratch.hidden, m * d);
    matmul(
        &mut scratch.mm,
        &scratch.normed[..m * 2 * d],
        m,
        &mtp.eh_proj,
        hidden,
    );
    let base = (
        config.count(LayerKind::Attention),
        config.count(LayerKind::Mamba),
        weights.layers.len(),
    );
    let mut no_lora = LoraWork::none();
    stack(
        config,
        &mtp.layers,
        scratch,
        kv,
        states,
        rows,
        base,
        &mut no_lora,
    )?;
    head(
        config,
        &mtp.final_norm,
        &weights.lm_head,
        scratch,
        m,
        logit_rows,
        hidden_out,
    );
    Ok(())
}

/// The pre-norm blocks `layers` over `scratch.hidden`; `base` is the (attention, Mamba) index of
/// the first of them in the KV pool and the state slots, and its layer index among the main
/// stack's layers followed by the MTP head's (the expert-parallel workers' numbering). `lora`
/// adds each row's adapter terms (layer `i` of `layers` is the adapter's layer `i`).
#[allow(clippy::too_many_arguments)] // the model's state, the rows, where they start, their adapters
fn stack(
    config: &Config,
    layers: &[Layer],
    scratch: &mut Scratch,
    kv: &mut KvPool,
    states: &mut MambaStates,
    rows: &Rows<'_, '_>,
    base: (usize, usize, usize),
    lora: &mut LoraWork<'_, '_>,
) -> Result<(), ModelError> {
    let m = rows.len();
    let d = config.hidden_size;
    let eps = config.layer_norm_epsilon as f32;
    let (mut attention_index, mut mamba_index, first_layer) = base;
    let kernels = scratch.mm.kernels;
    // Row-wise work runs on the threads too (one row per chunk: the same bits): the first
    // layer's norm here, every later one with the residual add of the layer before it.
    if let Some(first) = layers.first() {
        let normed = take(&mut scratch.normed, m * d);
        let hidden = &scratch.hidden[..m * d];
        kernels.for_each_chunk(normed, d, |i, n| {
            rms_norm(&hidden[i * d..(i + 1) * d], &first.norm, eps, n);
        });
    }
    for (i, layer) in layers.iter().enumerate() {
        lora.layer = i;
        match &layer.mixer {
            Mixer::Mamba(w) => {
                mamba(config, w, scratch, states, rows, mamba_index, lora);
                mamba_index += 1;
            }
            Mixer::Attention(w) => {
                attention(config, w, scratch, kv, rows, attention_index, lora);
                attention_index += 1;
            }
            Mixer::Mlp(w) => {
                let normed = &scratch.normed[..m * d];
                mlp(
                    &mut scratch.mm,
                    w,
                    normed,
                    m,
                    (&mut scratch.mixed, &mut scratch.out),
                    Some(lora),
                    None,
                );
            }
            Mixer::Moe(w) => moe(config, w, scratch, m, first_layer + i, lora)?,
        }
        let out = &scratch.out[..m * d];
        let add = |i: usize, h: &mut [f32]| {
            for (h, o) in h.iter_mut().zip(&out[i * d..(i + 1) * d]) {
                *h += o;
            }
        };
        match layers.get(i + 1) {
            Some(next) => {
                let normed = take(&mut scratch.normed, m * d);
                let hidden = &mut scratch.hidden[..m * d];
                kernels.for_each_chunk_pair(hidden, d, normed, d, |i, h, n| {
                    add(i, h);
                    rms_norm(h, &next.norm, eps, n);
                });
            }
            None => kernels.for_each_chunk(&mut scratch.hidden[..m * d], d, add),
        }
    }
    Ok(())
}

/// The final norm `norm` and `lm_head` over `scratch.hidden`: the wanted rows' logits, and every
/// row's normed hidden state into `hidden_out` when given.
fn head(
    config: &Config,
    norm: &[f32],
    lm_head: &Linear,
    scratch: &mut Scratch,
    m: usize,
    logit_rows: LogitRows<'_>,
    hidden_out: Option<&mut [f32]>,
) {
    let d = config.hidden_size;
    let eps = config.layer_norm_epsilon as f32;
    let (first, count, select, logits) = match logit_rows {
        LogitRows::All(out) => (0, m, None, Some(out)),
        LogitRows::One(i, out) => (i, 1, None, Some(out)),
        LogitRows::Select(rows, out) => (0, m, Some(rows), Some(out)),
        LogitRows::Skip => (0, 0, None, None),
    };
    // Every row is normed when the hidden states are wanted; the norm is per row, so the wanted
    // rows' bits are the same either way.
    let (norm_first, norm_count) = if hidden_out.is_some() {
        (0, m)
    } else {
        (first, count)
    };
    let normed = take(&mut scratch.normed, norm_count * d);
    for (i, n) in normed.chunks_exact_mut(d).enumerate() {
        let row = norm_first + i;
        rms_norm(&scratch.hidden[row * d..(row + 1) * d], norm, eps, n);
    }
    if let Some(out) = hidden_out {
        out[..m * d].copy_from_slice(&scratch.normed[..m * d]);
    }
    let Some(logits) = logits else {
        return;
    };
    match select {
        None => {
            let start = (first - norm_first) * d;
            matmul(
                &mut scratch.mm,
                &scratch.normed[start..start + count * d],
                count,
                lm_head,
                logits,
            );
        }
        Some(rows) => {
            // Gather the selected rows (the product is per row, so no bits change).
            let gathered = take(&mut scratch.mixed, rows.len() * d);
            for (g, &row) in gathered.chunks_exact_mut(d).zip(rows) {
                g.copy_from_slice(&scratch.normed[row * d..(row + 1) * d]);
            }
            matmul(
                &mut scratch.mm,
                &scratch.mixed[..rows.len() * d],
                rows.len(),
                lm_head,
                logits,
            );
        }
    }
}

/// Dense MLP: `out = down(relu(up x)²)`, with each row's LoRA terms on `up` and `down` when
/// `lora` names the layer (the dense MLP and the MoE shared expert; never a routed expert).
/// Without LoRA terms the activation is applied in the `up` product's tasks, and `down_then`
/// (if any) in the `down` product's; with them, `down_then` must be `None` (the terms come after
/// the product).
pub(crate) fn mlp(
    mm: &mut Matmul,
    w: &MlpWeights,
    x: &[f32],
    m: usize,
    (act, out): (&mut Vec<f32>, &mut Vec<f32>),
    mut lora: Option<&mut LoraWork<'_, '_>>,
    down_then: Option<Epilogue<'_>>,
) {
    let act = take(act, m * w.up.out_dim);
    let out = take(out, m * w.down.out_dim);
    let Some(lora) = lora.as_mut().filter(|l| l.active()) else {
        matmul_then(mm, x, m, &w.up, act, Some(&|_, _, cols| relu2(cols)));
        matmul_then(mm, act, m, &w.down, out, down_then);
        return;
    };
    debug_assert!(
        down_then.is_none(),
        "LoRA terms come after the down product"
    );
    matmul(mm, x, m, &w.up, act);
    let site = LoraSite {
        target: Target::Up,
        stride: w.up.out_dim,
        offset: 0,
    };
    lora.apply(mm, x, w.up.in_dim, site, act);
    relu2(act);
    matmul(mm, act, m, &w.down, out);
    let site = LoraSite {
        target: Target::Down,
        stride: w.down.out_dim,
        offset: 0,
    };
    lora.apply(mm, act, w.down.in_dim, site, out);
}

/// A Mamba layer's sizes and constants, as [`mamba`] and [`mamba_rows`] both read them.
struct MambaShape {
    /// Heads, head dim P, state size N, groups, conv kernel K.
    h: usize,
    p: usize,
    n: usize,
    g: usize,
    k: usize,
    inner: usize,
    conv_dim: usize,
    proj_dim: usize,
    eps: f32,
    /// The lower clamp of `dt` after its softplus, where the config asks for one.
    clamp: Option<f32>,
}

impl MambaShape {
    fn new(config: &Config) -> Self {
        Self {
            h: config.mamba_num_heads,
            p: config.mamba_head_dim,
            n: config.ssm_state_size,
            g: config.n_groups,
            k: config.conv_kernel,
            inner: config.mamba_inner(),
            conv_dim: config.mamba_conv_dim(),
            proj_dim: config.mamba_in_proj_dim(),
            eps: config.layer_norm_epsilon as f32,
            clamp: match config.dt_clamp {
                DtClamp::TimeStepMin => Some(config.time_step_min as f32),
                DtClamp::Off => None,
            },
        }
    }
}

/// Mamba2 mixer (ARCH.md §3).
///
/// The projections batch all rows. The causal conv then runs row by row (it reads and shifts each
/// sequence's history). The selective scan is split into tasks of one head over one *run* of rows
/// sharing a state slot (a prefill chunk is one run; each decode row is its own; each sequence of
/// a batch of runs is one): a task steps its head's state through the run's tokens in order, so
/// the state (`P x N` floats) stays in L1 while tokens stream past, and every state element and
/// output sees exactly the per-token recurrence a decode step computes. Tasks write disjoint parts
/// of `scan` (run-major: the run starting at row `f` holds `[head][token][P]` from `f * inner`),
/// which the gate and group norm read back per row. A row with a snapshot slot has its conv
/// history copied there after the conv, and each head's state after that head's step of the row.
///
/// A decode batch (every row a run of its own, no snapshot) with at least two rows per thread
/// takes a shorter way: one task per row runs that row's conv, history shift, every head's scan
/// step and the gate and norm (one fork and join per layer between the projections instead of
/// three). It is the same arithmetic on the same values, so the bits do not depend on the way.
fn mamba(
    config: &Config,
    w: &MambaWeights,
    scratch: &mut Scratch,
    states: &mut MambaStates,
    rows: &Rows<'_, '_>,
    layer: usize,
    lora: &mut LoraWork<'_, '_>,
) {
    let m = rows.len();
    let MambaShape {
        h,
        p,
        n,
        g,
        k,
        inner,
        conv_dim,
        proj_dim,
        eps,
        clamp,
    } = MambaShape::new(config);
    let proj = take(&mut scratch.proj, m * proj_dim);
    matmul(
        &mut scratch.mm,
        &scratch.normed[..m * config.hidden_size],
        m,
        &w.in_proj,
        proj,
    );
    if lora.active() {
        let site = LoraSite {
            target: Target::InProj,
            stride: proj_dim,
            offset: 0,
        };
        lora.apply(
            &mut scratch.mm,
            &scratch.normed,
            config.hidden_size,
            site,
            proj,
        );
    }
    let proj = &scratch.proj[..m * proj_dim];
    // Runs of rows that share a state slot, as (first row, length): a prefill chunk is one run,
    // decode rows are one each, a batch of runs has one per sequence.
    let runs = rows.runs();
    let kernels = scratch.mm.kernels;
    let heads_per_group = h / g;
    let group_size = inner / g;
    let dims = (p, n, g, inner, conv_dim, proj_dim);
    // Rows that are each a run of their own (decode rows) with no snapshot, enough of them to
    // share between the threads: one task per row does its conv, its history shift, every
    // head's scan step and the gate and norm, one fork and join instead of three. The same
    // operations on the same values as the general path below, so the same bits.
    if runs.len() == m && m >= 2 * kernels.threads && (0..m).all(|i| rows.snapshot(i).is_none()) {
        let conv_out = take(&mut scratch.conv_out, m * conv_dim);
        let mixed = take(&mut scratch.mixed, m * inner);
        let mut tasks: Vec<RowTask<'_>> = states
            .layers_mut(layer, (0..m).map(|i| rows.slot(i)))
            .into_iter()
            .zip(conv_out.chunks_exact_mut(conv_dim))
            .zip(mixed.chunks_exact_mut(inner))
            .enumerate()
            .map(|(row, (((history, state), conv), y))| RowTask {
                row,
                history,
                state,
                conv,
                y,
            })
            .collect();
        kernels.for_each_task(&mut tasks, |task| {
            let i = task.row;
            conv_row(
                w,
                proj,
                task.history,
                (i, 0),
                (inner, conv_dim, proj_dim, k),
                task.conv,
            );
            let xbc = &proj[i * proj_dim + inner..i * proj_dim + inner + conv_dim];
            push_history(task.history, xbc, k);
            let ctx = ScanContext {
                w,
                proj,
                conv_out: task.conv,
                conv_first: i,
                clamp,
                dims,
                heads_per_group,
            };
            kernels.arch.dispatch(ScanHeads {
                ctx: &ctx,
                row: i,
                state: task.state,
                y: task.y,
            });
            gate_norm(
                w,
                &proj[i * proj_dim..i * proj_dim + inner],
                task.y,
                group_size,
                eps,
            );
        });
    } else {
        mamba_rows(config, w, scratch, states, rows, layer, &runs);
    }
    let out = take(&mut scratch.out, m * config.hidden_size);
    matmul(
        &mut scratch.mm,
        &scratch.mixed[..m * inner],
        m,
        &w.out_proj,
        out,
    );
    if lora.active() {
        let site = LoraSite {
            target: Target::OutProj,
            stride: config.hidden_size,
            offset: 0,
        };
        lora.apply(&mut scratch.mm, &scratch.mixed, inner, site, out);
    }
}

/// The conv, the scan and the gate and norm of [`mamba`] for any rows: `scratch.proj` holds
/// the rows' input projections, `scratch.mixed` receives the gated, normed scan outputs.
fn mamba_rows(
    config: &Config,
    w: &MambaWeights,
    scratch: &mut Scratch,
    states: &mut MambaStates,
    rows: &Rows<'_, '_>,
    layer: usize,
    runs: &[(usize, usize)],
) {
    let m = rows.len();
    let MambaShape {
        h,
        p,
        n,
        g,
        k,
        inner,
        conv_dim,
        proj_dim,
        eps,
        clamp,
    } = MambaShape::new(config);
    let proj = &scratch.proj[..m * proj_dim];
    let kernels = scratch.mm.kernels;
    // The causal depthwise conv of every row at once, on the threads: a row's window is its
    // K-1 predecessors in the run, taken from the history before the run where the run has
    // none, so no row waits for the history updates of the rows before it (done below).
    let conv_out = take(&mut scratch.conv_out, m * conv_dim);
    let history = &*states;
    kernels.for_each_chunk(conv_out, conv_dim, |i, out| {
        let (first, _) = runs[runs.partition_point(|&(first, _)| first <= i) - 1];
        let hist = history.conv(rows.slot(i), layer);
        conv_row(
            w,
            proj,
            hist,
            (i, i - first),
            (inner, conv_dim, proj_dim, k),
            out,
        );
    });
    // The histories after the rows: a run's last K-1 inputs (fewer rows: the newest part of
    // the history before, then the rows). A run with snapshot rows shifts row by row, so each
    // snapshot slot receives the history as it is after its row.
    for &(first, len) in runs {
        let slot = rows.slot(first);
        let snapshots = (first..first + len).any(|i| rows.snapshot(i).is_some());
        if snapshots {
            for i in first..first + len {
                let xbc = &proj[i * proj_dim + inner..i * proj_dim + inner + conv_dim];
                let (conv_hist, _) = states.layer_mut(slot, layer);
                push_history(conv_hist, xbc, k);
                if let Some(snapshot) = rows.snapshot(i) {
                    states.copy_conv(slot, snapshot, layer);
                }
            }
        } else if k > 1 {
            let (conv_hist, _) = states.layer_mut(slot, layer);
            let kept = (k - 1).saturating_sub(len);
            conv_hist.copy_within(len.min(k - 1) * conv_dim.., 0);
            for at in kept..k - 1 {
                let row = first + len + at - (k - 1);
                conv_hist[at * conv_dim..(at + 1) * conv_dim].copy_from_slice(
                    &proj[row * proj_dim + inner..row * proj_dim + inner + conv_dim],
                );
            }
        }
    }
    let conv_out = &scratch.conv_out[..m * conv_dim];

    let heads_per_group = h / g;
    let scan = take(&mut scratch.scan, m * inner);
    // The runs' head states, then the snapshot slots' (row order), slot-major.
    let snapshot_rows: Vec<(usize, usize)> = (0..m)
        .filter_map(|i| rows.snapshot(i).map(|slot| (i, slot)))
        .collect();
    let slots = runs
        .iter()
        .map(|&(first, _)| rows.slot(first))
        .chain(snapshot_rows.iter().map(|&(_, slot)| slot));
    let mut head_states = states.ssm_heads_mut(layer, slots, h).into_iter();
    // One task per (run, head): its state, its `len x P` part of `scan`, and the snapshot
    // slots' parts for that head with the token after which each receives the state.
    let mut tasks: Vec<ScanTask<'_>> = Vec::with_capacity(runs.len() * h);
    let mut rest: &mut [f32] = scan;
    for &(first, len) in runs {
        for head in 0..h {
            let (out, tail) = std::mem::take(&mut rest).split_at_mut(len * p);
            rest = tail;
            let state = head_states.next().expect("one state per run and head");
            tasks.push(ScanTask {
                first,
                head,
                state,
                out,
                snapshots: Vec::new(),
            });
        }
    }
    for &(i, _) in &snapshot_rows {
        let run = runs.partition_point(|&(first, _)| first <= i) - 1;
        let t = i - runs[run].0;
        for head in 0..h {
            let state = head_states.next().expect("one state per snapshot and head");
            tasks[run * h + head].snapshots.push((t, state));
        }
    }
    let ctx = ScanContext {
        w,
        proj,
        conv_out,
        conv_first: 0,
        clamp,
        dims: (p, n, g, inner, conv_dim, proj_dim),
        heads_per_group,
    };
    kernels.for_each_task(&mut tasks, |task| {
        kernels.arch.dispatch(ScanRun { ctx: &ctx, task });
    });
    drop(tasks);

    // Gate first, then RMSNorm per group (norm_before_gate = False), row by row.
    let scan = &scratch.scan[..m * inner];
    let mixed = take(&mut scratch.mixed, m * inner);
    let group_size = inner / g;
    kernels.for_each_chunk(mixed, inner, |i, y| {
        let (first, len) = runs[runs.partition_point(|&(first, _)| first <= i) - 1];
        let t = i - first;
        for (head, yh) in y.chunks_exact_mut(p).enumerate() {
            let start = first * inner + (head * len + t) * p;
            yh.copy_from_slice(&scan[start..start + p]);
        }
        gate_norm(
            w,
            &proj[i * proj_dim..i * proj_dim + inner],
            y,
            group_size,
            eps,
        );
    });
}

/// One row's gate and group norm (`norm_before_gate = False`): `y *= silu(z)`, then RMSNorm
/// over each group of `group_size` channels.
fn gate_norm(w: &MambaWeights, z: &[f32], y: &mut [f32], group_size: usize, eps: f32) {
    for (yv, &zv) in y.iter_mut().zip(z) {
        *yv *= silu(zv);
    }
    for (seg, weight) in y
        .chunks_exact_mut(group_size)
        .zip(w.norm.chunks_exact(group_size))
    {
        let inv = 1.0 / (sum_squares(seg) / group_size as f32 + eps).sqrt();
        for (v, &wv) in seg.iter_mut().zip(weight) {
            *v = wv * (*v * inv);
        }
    }
}

/// One decode row of [`mamba`]'s fused path: its conv history and SSM state (this layer's, in
/// its slot), its conv output and its gated scan output.
struct RowTask<'a> {
    row: usize,
    history: &'a mut [f32],
    state: &'a mut [f32],
    conv: &'a mut [f32],
    y: &'a mut [f32],
}

/// Moves a conv history (the K-1 inputs before a row, oldest first) on past that row: the
/// oldest input goes, the row's conv input `xbc` comes last. With K = 1 there is no history.
fn push_history(history: &mut [f32], xbc: &[f32], k: usize) {
    if k > 1 {
        let conv_dim = xbc.len();
        history.copy_within(conv_dim.., 0);
        history[(k - 2) * conv_dim..].copy_from_slice(xbc);
    }
}

/// Row `i` (token `t` of its run) of the causal depthwise conv, activated: channel `c` is
/// `silu(Σ_j tap_j · x_j + tap_{K-1} · xbc + bias)` over its K-1 predecessors `x_j`, oldest first,
/// in that order (`hist` holds the K-1 inputs before the run, oldest first). The channels run in
/// the inner loop; each channel's sum is the same chain as one channel at a time.
fn conv_row(
    w: &MambaWeights,
    proj: &[f32],
    hist: &[f32],
    (i, t): (usize, usize),
    (inner, conv_dim, proj_dim, k): (usize, usize, usize, usize),
    out: &mut [f32],
) {
    let input = |row: usize| &proj[row * proj_dim + inner..row * proj_dim + inner + conv_dim];
    let tap = |j: usize| &w.conv_taps[j * conv_dim..(j + 1) * conv_dim];
    out.fill(0.0);
    for j in 0..k - 1 {
        // Input `j` of the window is `K-1-j` tokens before this one.
        let x = if t + j + 1 >= k {
            input(i + j + 1 - k)
        } else {
            &hist[(t + j) * conv_dim..(t + j + 1) * conv_dim]
        };
        for ((o, &x), &tap) in out.iter_mut().zip(x).zip(tap(j)) {
            *o += tap * x;
        }
    }
    for ((o, &x), &tap) in out.iter_mut().zip(input(i)).zip(tap(k - 1)) {
        *o += tap * x;
    }
    if let Some(bias) = &w.conv_bias {
        for (o, &b) in out.iter_mut().zip(bias) {
            *o += b;
        }
    }
    for o in out.iter_mut() {
        *o = silu(*o);
    }
}

/// One (run, head) task of the Mamba scan (see [`mamba`]).
struct ScanTask<'s> {
    /// The run's first row.
    first: usize,
    head: usize,
    /// The head's `P x N` state in the run's slot.
    state: &'s mut [f32],
    /// The head's outputs for the run's tokens (`len x P`).
    out: &'s mut [f32],
    /// (token of the run, the head's state in a snapshot slot), ascending by token.
    snapshots: Vec<(usize, &'s mut [f32])>,
}

/// What every task of one layer's Mamba scan reads (see [`mamba`]).
struct ScanContext<'a> {
    w: &'a MambaWeights,
    proj: &'a [f32],
    /// Conv outputs of rows `conv_first..` (row `i`'s at `(i - conv_first) * conv_dim`).
    conv_out: &'a [f32],
    conv_first: usize,
    clamp: Option<f32>,
    /// (head_dim P, state size N, groups, inner, conv_dim, in_proj dim).
    dims: (usize, usize, usize, usize, usize, usize),
    heads_per_group: usize,
}

/// One (run, head) task of the scan as a [`pulp::WithSimd`] operation, so the state update is
/// compiled for the CPU's vector instructions (the same operations in the same order whatever
/// the instruction set: see [`ssm_step`]).
struct ScanRun<'c, 't, 's> {
    ctx: &'c ScanContext<'c>,
    task: &'t mut ScanTask<'s>,
}

impl pulp::WithSimd for ScanRun<'_, '_, '_> {
    type Output = ();

    #[inline(always)]
    fn with_simd<S: pulp::Simd>(self, simd: S) {
        let ScanTask {
            first,
            head,
            state,
            out,
            snapshots,
        } = self.task;
        let mut dtb = vec![0.0f32; self.ctx.dims.1];
        scan_head(
            simd,
            self.ctx,
            (*first, *head),
            state,
            out,
            snapshots,
            &mut dtb,
        );
    }
}

/// Every head's scan step of one decode row (row `row`, a run of its own with no snapshot):
/// `state` is the row's `H x P x N` state, `y` its `H x P` outputs. See [`ScanRun`].
struct ScanHeads<'c, 's> {
    ctx: &'c ScanContext<'c>,
    row: usize,
    state: &'s mut [f32],
    y: &'s mut [f32],
}

impl pulp::WithSimd for ScanHeads<'_, '_> {
    type Output = ();

    #[inline(always)]
    fn with_simd<S: pulp::Simd>(self, simd: S) {
        let (p, n) = (self.ctx.dims.0, self.ctx.dims.1);
        let mut dtb = vec![0.0f32; n];
        for (head, (state, out)) in self
            .state
            .chunks_exact_mut(p * n)
            .zip(self.y.chunks_exact_mut(p))
            .enumerate()
        {
            scan_head(
                simd,
                self.ctx,
                (self.row, head),
                state,
                out,
                &mut [],
                &mut dtb,
            );
        }
    }
}

/// Steps head `head`'s `P x N` state through the tokens of a run starting at row `first`, one
/// token per `P` floats of `out`, copying the state into each snapshot slot after its token.
/// `dtb` is scratch of `N` floats.
#[inline(always)]
fn scan_head<S: pulp::Simd>(
    simd: S,
    ctx: &ScanContext<'_>,
    (first, head): (usize, usize),
    state: &mut [f32],
    out: &mut [f32],
    snapshots: &mut [(usize, &mut [f32])],
    dtb: &mut [f32],
) {
    let ScanContext {
        w,
        proj,
        conv_out,
        conv_first,
        clamp,
        dims: (p, n, g, inner, conv_dim, proj_dim),
        heads_per_group,
    } = *ctx;
    let group = head / heads_per_group;
    let mut snapshots = snapshots.iter_mut().peekable();
    // `dt * B` of the current token, shared by the head's P channels.
    let dtb = &mut dtb[..n];
    for (t, y) in out.chunks_exact_mut(p).enumerate() {
        let i = first + t;
        let raw = proj[i * proj_dim + inner + conv_dim + head];
        let mut dt = softplus(raw + w.dt_bias[head]);
        if let Some(min) = clamp {
            dt = dt.max(min);
        }
        let decay = (dt * w.a[head]).exp();
        let row = &conv_out[(i - conv_first) * conv_dim..(i - conv_first + 1) * conv_dim];
        let x = &row[head * p..(head + 1) * p];
        let b = &row[inner + group * n..inner + (group + 1) * n];
        let c = &row[inner + (g + group) * n..inner + (g + group + 1) * n];
        for (d, &bv) in dtb.iter_mut().zip(b) {
            *d = dt * bv;
        }
        for ((yv, &xv), s) in y.iter_mut().zip(x).zip(state.chunks_exact_mut(n)) {
            *yv = ssm_step(simd, s, decay, dtb, xv, c) + w.d[head] * xv;
        }
        if let Some((_, snapshot)) = snapshots.next_if(|(at, _)| *at == t) {
            snapshot.copy_from_slice(state);
        }
    }
}

/// One channel's SSM step, fused so the state is read and written once:
/// `s = s * decay + dtb * x` (`dtb = dt * B`), returning `s · C` (the same lanes and fold order
/// as `dot`). With 8-lane vectors (AVX2) each lane is one register lane; the operations and
/// their order are the same either way, so are the bits.
#[inline(always)]
fn ssm_step<S: pulp::Simd>(
    simd: S,
    s: &mut [f32],
    decay: f32,
    dtb: &[f32],
    x: f32,
    c: &[f32],
) -> f32 {
    const LANES: usize = 8;
    let mut acc = [0.0f32; LANES];
    let split = s.len() / LANES * LANES;
    let (s_body, rest) = s.split_at_mut(split);
    if S::F32_LANES == LANES {
        let (sv, _) = S::as_mut_simd_f32s(s_body);
        let (bv, _) = S::as_simd_f32s(&dtb[..split]);
        let (cv, _) = S::as_simd_f32s(&c[..split]);
        let (vdecay, vx) = (simd.splat_f32s(decay), simd.splat_f32s(x));
        let mut vacc = simd.splat_f32s(0.0);
        for ((sv, &bv), &cv) in sv.iter_mut().zip(bv).zip(cv) {
            *sv = simd.add_f32s(simd.mul_f32s(*sv, vdecay), simd.mul_f32s(bv, vx));
            vacc = simd.add_f32s(vacc, simd.mul_f32s(*sv, cv));
        }
        acc.copy_from_slice(bytemuck::cast_slice::<S::f32s, f32>(std::slice::from_ref(
            &vacc,
        )));
    } else {
        for ((sv, bv), cv) in s_body
            .chunks_exact_mut(LANES)
            .zip(dtb.chunks_exact(LANES))
            .zip(c.chunks_exact(LANES))
        {
            for l in 0..LANES {
                sv[l] = sv[l] * decay + bv[l] * x;
                acc[l] += sv[l] * cv[l];
            }
        }
    }
    let mut tail = 0.0f32;
    for ((sv, &bv), &cv) in rest.iter_mut().zip(&dtb[split..]).zip(&c[split..]) {
        *sv = *sv * decay + bv * x;
        tail += *sv * cv;
    }
    ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7])) + tail
}

/// Causal GQA attention without positional encoding (ARCH.md §4) over the paged pool.
///
/// One task per (query tile, KV head): a query tile is up to [`QUERY_ROWS`] consecutive rows of
/// one sequence, and the task computes all of that KV head's query heads for those rows at once,
/// so each key and value is read once per tile of queries rather than once per query head and
/// row. Keys are streamed in tiles of [`KEY_TILE`] positions fixed by absolute position (tile `t`
/// holds positions `64t..64t + 64`, whatever the block size) with an online softmax (running max
/// `m`, running sum `l`, output rescaled by `exp(m_old - m_new)`).
///
/// **Evaluation order.** For one query at position `p`, everything is a function of `p` and the
/// keys and values `0..=p` alone:
/// - its score against key `j` is one fused multiply-add chain over the head dimension in order,
///   times the scale (vector lanes run across queries, never along the chain);
/// - a key after `p` in a tile (another query of the tile sees it) scores `-inf`, which leaves
///   the tile's max unchanged, weighs exactly 0 ([`exp_simd`]) and adds exactly 0 to `l`; a tile
///   entirely after `p` leaves `m` unchanged and rescales by `exp(0) = 1`, so tiles the query does
///   not see change no bit of it;
/// - `l` adds the weights in key order; the output is one fused multiply-add chain per element
///   over the keys `<= p` in order, rescaled at each tile, divided by `l` at the end.
///
/// So a query's output does not depend on the other rows of its tile or batch, on how its
/// sequence was chunked, on the block size, on the thread count or on the vector width.
fn attention(
    config: &Config,
    w: &AttentionWeights,
    scratch: &mut Scratch,
    kv: &mut KvPool,
    rows: &Rows<'_, '_>,
    layer: usize,
    lora: &mut LoraWork<'_, '_>,
) {
    let m = rows.len();
    let (nh, nkv, hd) = (
        config.num_attention_heads,
        config.num_key_value_heads,
        config.head_dim,
    );
    let qkv_dim = (nh + 2 * nkv) * hd;
    let proj = take(&mut scratch.proj, m * qkv_dim);
    matmul(
        &mut scratch.mm,
        &scratch.normed[..m * config.hidden_size],
        m,
        &w.qkv,
        proj,
    );
    if lora.active() {
        for (target, offset) in [
            (Target::Q, 0),
            (Target::K, nh * hd),
            (Target::V, (nh + nkv) * hd),
        ] {
            let site = LoraSite {
                target,
                stride: qkv_dim,
                offset,
            };
            lora.apply(
                &mut scratch.mm,
                &scratch.normed,
                config.hidden_size,
                site,
                proj,
            );
        }
    }
    let block_size = kv.block_size();
    let value_offset = kv.value_offset();
    // Write every row's K/V first: rows of one prefill chunk attend to earlier rows of the chunk.
    for i in 0..m {
        let pos = rows.pos(i);
        let block = rows.blocks(i)[pos / block_size];
        let row = &scratch.proj[i * qkv_dim..(i + 1) * qkv_dim];
        let (k_new, v_new) = row[nh * hd..].split_at(nkv * hd);
        let start = kv.key_index(layer, block, pos % block_size, 0);
        let data = kv.data_mut();
        data[start..start + nkv * hd].copy_from_slice(k_new);
        data[start + value_offset..start + value_offset + nkv * hd].copy_from_slice(v_new);
    }
    let group = nh / nkv;
    // Query tiles as (first row, rows): runs cut into pieces of at most QUERY_ROWS rows.
    let mut tiles: Vec<(usize, usize)> = Vec::new();
    for (first, len) in rows.runs() {
        let mut row = first;
        while row < first + len {
            let count = QUERY_ROWS.min(first + len - row);
            tiles.push((row, count));
            row += count;
        }
    }
    // Each task writes its rows' heads of its group, `rows x group x hd`, into its own part of
    // `attn` (tile after tile, KV head after KV head); they are scattered into `mixed` below.
    let attn = take(&mut scratch.attn, m * nh * hd);
    let mut tasks: Vec<TileTask<'_>> = Vec::with_capacity(tiles.len() * nkv);
    let mut rest = attn;
    for &(first_row, count) in &tiles {
        for kv_head in 0..nkv {
            let (out, tail) = rest.split_at_mut(count * group * hd);
            rest = tail;
            tasks.push(TileTask {
                first_row,
                rows: count,
                kv_head,
                out,
            });
        }
    }
    let ctx = TileContext {
        kv,
        layer,
        rows,
        proj: &scratch.proj[..m * qkv_dim],
        qkv_dim,
        group,
        head_dim: hd,
        scale: (hd as f64).powf(-0.5) as f32,
    };
    // The tasks with the most (query, key) pairs first (see `for_each_uneven_task`): a causal
    // chunk's last tiles see the most keys.
    tasks.sort_by_key(|task| {
        let last = rows.pos(task.first_row + task.rows - 1);
        std::cmp::Reverse(task.rows * (last + 1))
    });
    let kernels = scratch.mm.kernels;
    kernels.for_each_uneven_task(&mut tasks, |task| {
        kernels.arch.dispatch(AttendTile { ctx: &ctx, task });
    });
    drop(tasks);
    let mixed = take(&mut scratch.mixed, m * nh * hd);
    let mut from = 0;
    for &(first_row, count) in &tiles {
        for kv_head in 0..nkv {
            for row in first_row..first_row + count {
                let to = row * nh * hd + kv_head * group * hd;
                mixed[to..to + group * hd].copy_from_slice(&scratch.attn[from..from + group * hd]);
                from += group * hd;
            }
        }
    }
    let out = take(&mut scratch.out, m * config.hidden_size);
    matmul(
        &mut scratch.mm,
        &scratch.mixed[..m * nh * hd],
        m,
        &w.o_proj,
        out,
    );
    if lora.active() {
        let site = LoraSite {
            target: Target::O,
            stride: config.hidden_size,
            offset: 0,
        };
        lora.apply(&mut scratch.mm, &scratch.mixed, nh * hd, site, out);
    }
}

/// Keys per tile of the online softmax; tiles start at multiples of it.
const KEY_TILE: usize = 64;
/// Rows (positions of one sequence) per attention task.
const QUERY_ROWS: usize = 8;
/// Keys one pass of the score kernel reads at once (independent chains per query vector).
const KEY_STEP: usize = 4;
/// Value vectors one pass of the output kernel accumulates at once (a 64-wide head on AVX2).
const VALUE_STEP: usize = 8;

/// What every attention task of one layer call reads.
struct TileContext<'a> {
    kv: &'a KvPool,
    layer: usize,
    rows: &'a Rows<'a, 'a>,
    /// The rows' `q | k | v` projections, `qkv_dim` floats each.
    proj: &'a [f32],
    qkv_dim: usize,
    group: usize,
    head_dim: usize,
    scale: f32,
}

/// One task: rows `first_row..first_row + rows` (one sequence's, in position order) and the
/// query heads of KV head `kv_head`; `out` is `rows x group x head_dim`.
struct TileTask<'a> {
    first_row: usize,
    rows: usize,
    kv_head: usize,
    out: &'a mut [f32],
}

/// [`attend_tile`] as a [`pulp::WithSimd`] operation, so its loops are compiled for the CPU's
/// vector and FMA instructions (no result depends on them: see [`attention`]).
struct AttendTile<'a, 'b> {
    ctx: &'a TileContext<'a>,
    task: &'a mut TileTask<'b>,
}

impl pulp::WithSimd for AttendTile<'_, '_> {
    type Output = ();

    #[inline(always)]
    fn with_simd<S: pulp::Simd>(self, simd: S) {
        attend_tile(simd, self.ctx, self.task);
    }
}

/// One task of [`attention`]. Queries are numbered `row * group + head` within the task and
/// padded with zero queries to whole vectors (`width` lanes); a padded lane's results are never
/// read.
#[inline(always)]
fn attend_tile<S: pulp::Simd>(simd: S, ctx: &TileContext<'_>, task: &mut TileTask<'_>) {
    let (hd, group) = (ctx.head_dim, ctx.group);
    let lanes = S::F32_LANES;
    let queries = task.rows * group;
    let vectors = queries.div_ceil(lanes);
    let width = vectors * lanes;
    let kv = ctx.kv;
    let (block_size, value_offset, data) = (kv.block_size(), kv.value_offset(), kv.data());
    let blocks = ctx.rows.blocks(task.first_row);
    let positions: Vec<usize> = (0..queries)
        .map(|q| ctx.rows.pos(task.first_row + q / group))
        .collect();
    let last = positions.iter().copied().max().unwrap_or(0);
    // The queries transposed, vector-major: lane `q % lanes` of vector `(q / lanes) * hd + d`
    // holds element `d` of query `q`, so a vector of queries multiplies one key element.
    let mut transposed = vec![0.0f32; vectors * hd * lanes];
    for (q, _) in positions.iter().enumerate() {
        let row = task.first_row + q / group;
        let head = task.kv_head * group + q % group;
        let start = row * ctx.qkv_dim + head * hd;
        let (v, lane) = (q / lanes, q % lanes);
        for (d, &x) in ctx.proj[start..start + hd].iter().enumerate() {
            transposed[(v * hd + d) * lanes + lane] = x;
        }
    }
    let (queries_t, _) = S::as_simd_f32s(&transposed);
    // Scores, then weights, of the current key tile: `KEY_TILE x width`, key-major.
    let mut scores = vec![0.0f32; KEY_TILE * width];
    let mut max = vec![f32::NEG_INFINITY; width];
    let mut sum = vec![0.0f32; width];
    let mut rescale = vec![1.0f32; width];
    let mut keys = [0usize; KEY_TILE];
    task.out.fill(0.0);
    let mut start = 0;
    while start <= last {
        let len = KEY_TILE.min(last + 1 - start);
        for (j, key) in keys[..len].iter_mut().enumerate() {
            let p = start + j;
            *key = kv.key_index(
                ctx.layer,
                blocks[p / block_size],
                p % block_size,
                task.kv_head,
            );
        }
        let keys = &keys[..len];
        tile_scores(simd, ctx, queries_t, vectors, data, keys, &mut scores);
        // Keys after a query's position score -inf for it.
        for (q, &p) in positions.iter().enumerate() {
            let seen = (p + 1).saturating_sub(start).min(len);
            for j in seen..len {
                scores[j * width + q] = f32::NEG_INFINITY;
            }
        }
        {
            let (scores_v, _) = S::as_mut_simd_f32s(&mut scores[..len * width]);
            let (max_v, _) = S::as_mut_simd_f32s(&mut max);
            let (sum_v, _) = S::as_mut_simd_f32s(&mut sum);
            let (rescale_v, _) = S::as_mut_simd_f32s(&mut rescale);
            for v in 0..vectors {
                let mut tile_max = simd.splat_f32s(f32::NEG_INFINITY);
                for j in 0..len {
                    tile_max = simd.max_f32s(tile_max, scores_v[j * vectors + v]);
                }
                let new_max = simd.max_f32s(max_v[v], tile_max);
                // exp(-inf) = 0 on the first tile, when nothing has been summed yet.
                let factor = exp_simd(simd, simd.sub_f32s(max_v[v], new_max));
                let mut total = simd.mul_f32s(sum_v[v], factor);
                for j in 0..len {
                    let score = &mut scores_v[j * vectors + v];
                    *score = exp_simd(simd, simd.sub_f32s(*score, new_max));
                    total = simd.add_f32s(total, *score);
                }
                max_v[v] = new_max;
                sum_v[v] = total;
                rescale_v[v] = factor;
            }
        }
        for (q, (&p, out)) in positions
            .iter()
            .zip(task.out.chunks_exact_mut(hd))
            .enumerate()
        {
            let seen = (p + 1).saturating_sub(start).min(len);
            if seen == 0 {
                continue;
            }
            let factor = rescale[q];
            for o in out.iter_mut() {
                *o *= factor;
            }
            accumulate_values(
                simd,
                out,
                &scores,
                width,
                q,
                data,
                &keys[..seen],
                value_offset,
            );
        }
        start += len;
    }
    for (out, &total) in task.out.chunks_exact_mut(hd).zip(&sum) {
        let inv = 1.0 / total;
        for o in out.iter_mut() {
            *o *= inv;
        }
    }
}

/// `scores[j * width + q] = (q · key j) * scale` for the tile's keys (`keys`: their indices into
/// `data`) and every query lane; see [`attention`] for the order. Two query vectors and
/// [`KEY_STEP`] keys at a time: each key element is broadcast once for 16 queries.
#[inline(always)]
fn tile_scores<S: pulp::Simd>(
    simd: S,
    ctx: &TileContext<'_>,
    queries_t: &[S::f32s],
    vectors: usize,
    data: &[f32],
    keys: &[usize],
    scores: &mut [f32],
) {
    let hd = ctx.head_dim;
    let scale = simd.splat_f32s(ctx.scale);
    let (scores_v, _) = S::as_mut_simd_f32s(&mut scores[..keys.len() * vectors * S::F32_LANES]);
    let query = |v: usize| &queries_t[v * hd..(v + 1) * hd];
    let mut v = 0;
    while v < vectors {
        if v + 2 <= vectors {
            score_block(simd, [query(v), query(v + 1)], data, hd, keys, |j, i, s| {
                scores_v[j * vectors + v + i] = simd.mul_f32s(s, scale);
            });
            v += 2;
        } else {
            score_block(simd, [query(v)], data, hd, keys, |j, _, s| {
                scores_v[j * vectors + v] = simd.mul_f32s(s, scale);
            });
            v += 1;
        }
    }
}

/// The fused multiply-add chains `Σ_d q[d] * key_j[d]` of `QV` query vectors against every key
/// of `keys`, handed to `store(j, query vector, chain)`.
#[inline(always)]
fn score_block<S: pulp::Simd, const QV: usize>(
    simd: S,
    queries: [&[S::f32s]; QV],
    data: &[f32],
    hd: usize,
    keys: &[usize],
    mut store: impl FnMut(usize, usize, S::f32s),
) {
    let queries = queries.map(|q| &q[..hd]);
    let mut steps = keys.chunks_exact(KEY_STEP);
    let mut j = 0;
    for step in &mut steps {
        let rows: [&[f32]; KEY_STEP] = std::array::from_fn(|i| &data[step[i]..step[i] + hd]);
        let mut acc = [[simd.splat_f32s(0.0); KEY_STEP]; QV];
        for d in 0..hd {
            let k: [S::f32s; KEY_STEP] = std::array::from_fn(|i| simd.splat_f32s(rows[i][d]));
            for (acc, q) in acc.iter_mut().zip(&queries) {
                for (a, &k) in acc.iter_mut().zip(&k) {
                    *a = simd.mul_add_f32s(q[d], k, *a);
                }
            }
        }
        for (i, acc) in acc.into_iter().enumerate() {
            for (s, a) in acc.into_iter().enumerate() {
                store(j + s, i, a);
            }
        }
        j += KEY_STEP;
    }
    for &key in steps.remainder() {
        let row = &data[key..key + hd];
        let mut acc = [simd.splat_f32s(0.0); QV];
        for (d, &x) in row.iter().enumerate() {
            let k = simd.splat_f32s(x);
            for (a, q) in acc.iter_mut().zip(&queries) {
                *a = simd.mul_add_f32s(q[d], k, *a);
            }
        }
        for (i, a) in acc.into_iter().enumerate() {
            store(j, i, a);
        }
        j += 1;
    }
}

/// `out[d] = fma(weight_j, value_j[d], out[d])` for the keys `keys` in order, `weight_j` being
/// `weights[j * width + q]`: lanes run across `d`, [`VALUE_STEP`] vectors of `out` at a time.
#[allow(clippy::too_many_arguments)] // one kernel's operands; a struct would only rename them
#[inline(always)]
fn accumulate_values<S: pulp::Simd>(
    simd: S,
    out: &mut [f32],
    weights: &[f32],
    width: usize,
    q: usize,
    data: &[f32],
    keys: &[usize],
    value_offset: usize,
) {
    let lanes = S::F32_LANES;
    let weights = &weights[..keys.len() * width];
    let (out_v, out_tail) = S::as_mut_simd_f32s(out);
    let whole = out_v.len() * lanes;
    let mut steps = out_v.chunks_exact_mut(VALUE_STEP);
    let mut first = 0;
    for step in &mut steps {
        let mut acc: [S::f32s; VALUE_STEP] = std::array::from_fn(|i| step[i]);
        for (&key, &weight) in keys.iter().zip(weights[q..].iter().step_by(width)) {
            let weight = simd.splat_f32s(weight);
            let at = key + value_offset + first;
            let (values, _) = S::as_simd_f32s(&data[at..at + VALUE_STEP * lanes]);
            for (a, &v) in acc.iter_mut().zip(values) {
                *a = simd.mul_add_f32s(weight, v, *a);
            }
        }
        step.copy_from_slice(&acc);
        first += VALUE_STEP * lanes;
    }
    for o in steps.into_remainder() {
        let mut acc = *o;
        for (&key, &weight) in keys.iter().zip(weights[q..].iter().step_by(width)) {
            let at = key + value_offset + first;
            let (values, _) = S::as_simd_f32s(&data[at..at + lanes]);
            acc = simd.mul_add_f32s(simd.splat_f32s(weight), values[0], acc);
        }
        *o = acc;
        first += lanes;
    }
    for (d, o) in out_tail.iter_mut().enumerate() {
        for (&key, &weight) in keys.iter().zip(weights[q..].iter().step_by(width)) {
            *o = weight.mul_add(data[key + value_offset + whole + d], *o);
        }
    }
}

/// Index of the largest value (lowest index on ties).
fn argmax_first(values: impl Iterator<Item = f32>) -> usize {
    let mut best: Option<(usize, f32)> = None;
    for (i, v) in values.enumerate() {
        if best.is_none_or(|(_, b)| v > b) {
            best = Some((i, v));
        }
    }
    best.map_or(0, |(i, _)| i)
}

/// The router of ARCH.md §6.1 for one token: turns `logits` into sigmoid scores and fills
/// `choices` with `k` (expert, weight) pairs. `kept` is scratch for the group mask.
fn route(
    config: &Config,
    w: &MoeWeights,
    logits: &mut [f32],
    kept: &mut Vec<bool>,
    choices: &mut [(usize, f32)],
) {
    let e = config.n_routed_experts;
    let per_group = e / config.n_group;
    for l in logits.iter_mut() {
        *l = sigmoid(*l);
    }
    let s = &*logits;
    // The correction bias only decides which experts are chosen, never their weights.
    let corrected = |j: usize| s[j] + w.correction_bias[j];
    // Group score: the sum of the two largest corrected scores in the group (whatever k is).
    let group_score = |grp: usize| {
        let base = grp * per_group;
        let top = argmax_first((0..per_group).map(|j| corrected(base + j)));
        let second = argmax_first((0..per_group).map(|j| {
            if j == top {
                f32::NEG_INFINITY
            } else {
                corrected(base + j)
            }
        }));
        corrected(base + top) + corrected(base + second)
    };
    kept.clear();
    kept.resize(config.n_group, false);
    for _ in 0..config.topk_group {
        let best = argmax_first((0..config.n_group).map(|grp| {
            if kept[grp] {
                f32::NEG_INFINITY
            } else {
                group_score(grp)
            }
        }));
        kept[best] = true;
    }
    let mut total = 0.0f32;
    for j in 0..choices.len() {
        let best = argmax_first((0..e).map(|x| {
            let taken = choices[..j].iter().any(|&(c, _)| c == x);
            if taken || !kept[x / per_group] {
                f32::NEG_INFINITY
            } else {
                corrected(x)
            }
        }));
        choices[j] = (best, s[best]);
        total += s[best];
    }
    let scale = config.routed_scaling_factor as f32;
    for choice in choices.iter_mut() {
        if config.norm_topk_prob {
            choice.1 /= total + 1e-20;
        }
        choice.1 *= scale;
    }
}

/// Mixture of experts (ARCH.md §6): routed experts (ascending expert order per token) plus the
/// shared expert. With expert-parallel workers the routed experts run there (`layer` names this
/// layer to them); the combination below is the same either way. Each row's LoRA terms apply to
/// the shared expert (routed experts are never adapted).
fn moe(
    config: &Config,
    w: &MoeWeights,
    scratch: &mut Scratch,
    m: usize,
    layer: usize,
    lora: &mut LoraWork<'_, '_>,
) -> Result<(), ModelError> {
    let d = config.hidden_size;
    let e = config.n_routed_experts;
    let k = config.num_experts_per_tok;
    let expert_dim = config.moe_expert_dim();
    let normed = &scratch.normed[..m * d];
    let router = take(&mut scratch.router, m * e);
    matmul(&mut scratch.mm, normed, m, &w.gate, router);
    scratch.choices.clear();
    scratch.choices.resize(m * k, (0, 0.0));
    for (logits, choices) in router
        .chunks_exact_mut(e)
        .zip(scratch.choices.chunks_exact_mut(k))
    {
        route(config, w, logits, &mut scratch.kept_groups, choices);
    }
    let expert_input: &[f32] = match &w.latent {
        Some((fc1, _)) => {
            let latent = take(&mut scratch.latent_in, m * expert_dim);
            matmul(&mut scratch.mm, normed, m, fc1, latent);
            &scratch.latent_in[..m * expert_dim]
        }
        None => normed,
    };
    let routed = take(&mut scratch.routed, m * expert_dim);
    let kernels = scratch.mm.kernels;
    // Rows routed to `expert`: (token, weight) in token order.
    let rows_of = |expert: usize, choices: &[(usize, f32)], out: &mut Vec<(usize, f32)>| {
        out.clear();
        for (t, choices) in choices.chunks_exact(k).enumerate() {
            if let Some(&(_, weight)) = choices.iter().find(|c| c.0 == expert) {
                out.push((t, weight));
            }
        }
    };
    if let Some(pool) = scratch.experts.clone() {
        routed.fill(0.0);
        let mut batches = Vec::new();
        for expert in 0..e {
            rows_of(expert, &scratch.choices, &mut scratch.expert_rows);
            if scratch.expert_rows.is_empty() {
                continue;
            }
            let mut data = Vec::with_capacity(scratch.expert_rows.len() * expert_dim);
            for &(t, _) in &scratch.expert_rows {
                data.extend_from_slice(&expert_input[t * expert_dim..(t + 1) * expert_dim]);
            }
            batches.push(ExpertBatch {
                expert,
                rows: scratch.expert_rows.len(),
                data,
            });
        }
        for batch in pool.run(layer, batches)? {
            rows_of(batch.expert, &scratch.choices, &mut scratch.expert_rows);
            combine(&scratch.expert_rows, &batch.data, expert_dim, routed);
        }
    } else {
        // One task per expert with rows: the expert's whole MLP on one thread, over its own
        // parts of the buffers (one fork and join per layer, not two per expert). A product's
        // bits do not depend on the threads (see `gemm`), so neither do the experts' outputs.
        group_by_expert(
            &scratch.choices,
            k,
            e,
            &mut scratch.expert_rows,
            &mut scratch.expert_spans,
        );
        let total = scratch.expert_rows.len();
        let widest = w.experts.iter().map(|x| x.up.out_dim).max().unwrap_or(0);
        if scratch.expert_mms.len() < e {
            let single = Kernels {
                threads: 1,
                ..kernels
            };
            scratch.expert_mms.resize_with(e, || Matmul::new(single));
        }
        let mut inputs = take(&mut scratch.expert_in, total * expert_dim);
        let mut acts = take(&mut scratch.expert_act, total * widest);
        let mut outs = take(&mut scratch.expert_out, total * expert_dim);
        let mut tasks: Vec<ExpertTask<'_>> = Vec::with_capacity(e);
        for ((weights, mm), &(start, end)) in w
            .experts
            .iter()
            .zip(scratch.expert_mms.iter_mut())
            .zip(&scratch.expert_spans)
        {
            let count = end - start;
            if count == 0 {
                continue;
            }
            let (input, rest) = std::mem::take(&mut inputs).split_at_mut(count * expert_dim);
            inputs = rest;
            let (act, rest) = std::mem::take(&mut acts).split_at_mut(count * weights.up.out_dim);
            acts = rest;
            let (out, rest) = std::mem::take(&mut outs).split_at_mut(count * expert_dim);
            outs = rest;
            tasks.push(ExpertTask {
                weights,
                rows: &scratch.expert_rows[start..end],
                input,
                act,
                out,
                mm,
            });
        }
        // The experts with the most rows first (see `for_each_uneven_task`).
        tasks.sort_by_key(|task| std::cmp::Reverse(task.rows.len()));
        kernels.for_each_uneven_task(&mut tasks, |task| {
            let count = task.rows.len();
            for (input, &(t, _)) in task.input.chunks_exact_mut(expert_dim).zip(task.rows) {
                input.copy_from_slice(&expert_input[t * expert_dim..(t + 1) * expert_dim]);
            }
            matmul(task.mm, task.input, count, &task.weights.up, task.act);
            relu2(task.act);
            matmul(task.mm, task.act, count, &task.weights.down, task.out);
        });
        drop(tasks);
        // Each token's (output row, weight) of its experts, in ascending expert order.
        let (slots, counts) = (&mut scratch.token_slots, &mut scratch.token_counts);
        slots.clear();
        slots.resize(m * k, (0, 0.0));
        counts.clear();
        counts.resize(m, 0);
        for &(start, end) in &scratch.expert_spans {
            for (row, &(t, weight)) in (start..end).zip(&scratch.expert_rows[start..end]) {
                slots[t * k + counts[t]] = (row, weight);
                counts[t] += 1;
            }
        }
        // With a latent projection the routed sum is needed before `fc2`; without, it is
        // added up below together with the shared expert's output (one fork and join less).
        if w.latent.is_some() {
            let (slots, counts) = (&scratch.token_slots, &scratch.token_counts);
            let outputs = &scratch.expert_out[..total * expert_dim];
            kernels.for_each_chunk(routed, expert_dim, |t, acc| {
                routed_sum(t, (slots, counts, k), outputs, acc);
            });
        }
    }
    // Without a latent projection or expert workers, and without LoRA terms on the shared
    // expert, its `down` product writes `out` and adds each token's routed sum to its columns
    // in the same tasks: `routed + shared` per element, the bits of the separate pass below,
    // one fork and join less.
    if w.latent.is_none() && scratch.experts.is_none() && !lora.active() {
        let (slots, counts) = (&scratch.token_slots, &scratch.token_counts);
        let outputs = &scratch.expert_out[..scratch.expert_rows.len() * d];
        let add_routed = |t: usize, first: usize, columns: &mut [f32]| {
            add_routed_sum(t, (slots, counts, k), (outputs, d, first), columns);
        };
        mlp(
            &mut scratch.mm,
            &w.shared,
            &scratch.normed[..m * d],
            m,
            (&mut scratch.shared_act, &mut scratch.out),
            None,
            Some(&add_routed),
        );
        return Ok(());
    }
    // The shared expert's output goes to `mixed` (its activation to `shared_act`); `out`
    // receives the routed sum (projected back from the latent space if any) plus it.
    mlp(
        &mut scratch.mm,
        &w.shared,
        &scratch.normed[..m * d],
        m,
        (&mut scratch.shared_act, &mut scratch.mixed),
        Some(lora),
        None,
    );
    let out = take(&mut scratch.out, m * d);
    let shared = &scratch.mixed[..m * d];
    if let Some((_, fc2)) = &w.latent {
        matmul(
            &mut scratch.mm,
            &scratch.routed[..m * expert_dim],
            m,
            fc2,
            out,
        );
        kernels.for_each_chunk(out, d, |i, out| {
            for (o, &s) in out.iter_mut().zip(&shared[i * d..(i + 1) * d]) {
                *o += s;
            }
        });
    } else if scratch.experts.is_none() {
        // `routed_sum` into `out`, then `+ shared`: the bits of `routed + shared` below.
        let (slots, counts) = (&scratch.token_slots, &scratch.token_counts);
        let outputs = &scratch.expert_out[..scratch.expert_rows.len() * d];
        kernels.for_each_chunk(out, d, |i, out| {
            routed_sum(i, (slots, counts, k), outputs, out);
            for (o, &s) in out.iter_mut().zip(&shared[i * d..(i + 1) * d]) {
                *o += s;
            }
        });
    } else {
        let routed = &scratch.routed[..m * d];
        kernels.for_each_chunk(out, d, |i, out| {
            let (routed, shared) = (&routed[i * d..(i + 1) * d], &shared[i * d..(i + 1) * d]);
            for ((o, &r), &s) in out.iter_mut().zip(routed).zip(shared) {
                *o = r + s;
            }
        });
    }
    Ok(())
}

/// Token `t`'s routed sum into `acc`: `Σ weight · output` over its experts' output rows in
/// ascending expert order (`slots[t * k..]`, `counts[t]` of them), the chain [`combine`] adds up.
fn routed_sum(
    t: usize,
    (slots, counts, k): (&[(usize, f32)], &[usize], usize),
    outputs: &[f32],
    acc: &mut [f32],
) {
    let dim = acc.len();
    acc.fill(0.0);
    for &(row, weight) in &slots[t * k..t * k + counts[t]] {
        let output = &outputs[row * dim..(row + 1) * dim];
        for (a, &v) in acc.iter_mut().zip(output) {
            *a += v * weight;
        }
    }
}

/// `columns[j] += routed[j]` for columns `first..` of token `t`'s output, where
/// `routed[j]` is [`routed_sum`]'s chain over its experts' `dim`-wide output rows (element by
/// element the same operations in the same order, so the same bits as `routed_sum` then `+`).
fn add_routed_sum(
    t: usize,
    (slots, counts, k): (&[(usize, f32)], &[usize], usize),
    (outputs, dim, first): (&[f32], usize, usize),
    columns: &mut [f32],
) {
    const WIDTH: usize = 16;
    let experts = &slots[t * k..t * k + counts[t]];
    for (block, columns) in columns.chunks_mut(WIDTH).enumerate() {
        let start = first + block * WIDTH;
        let mut acc = [0.0f32; WIDTH];
        for &(row, weight) in experts {
            let output = &outputs[row * dim + start..row * dim + start + columns.len()];
            for (a, &v) in acc.iter_mut().zip(output) {
                *a += v * weight;
            }
        }
        // `shared + routed`: one rounded addition, the same bits as `routed + shared`.
        for (c, a) in columns.iter_mut().zip(acc) {
            *c += a;
        }
    }
}

/// One routed expert's rows of a MoE layer (see [`moe`]): its weights, its (token, weight) rows,
/// and its parts of the gathered inputs, the activations and the outputs.
struct ExpertTask<'a> {
    weights: &'a MlpWeights,
    rows: &'a [(usize, f32)],
    input: &'a mut [f32],
    act: &'a mut [f32],
    out: &'a mut [f32],
    mm: &'a mut Matmul,
}

/// Sorts the routed rows by expert: `rows` gets each expert's (token, weight) rows in token
/// order, expert after expert, and `spans[e]` the range of expert `e`. A token naming an expert
/// twice (only NaN scores can make `route` do so) counts once, with its first weight, as in
/// `moe`'s per-expert search.
fn group_by_expert(
    choices: &[(usize, f32)],
    k: usize,
    experts: usize,
    rows: &mut Vec<(usize, f32)>,
    spans: &mut Vec<(usize, usize)>,
) {
    let first_naming =
        |choices: &[(usize, f32)], j: usize| !choices[..j].iter().any(|c| c.0 == choices[j].0);
    spans.clear();
    spans.resize(experts, (0, 0));
    for token in choices.chunks_exact(k) {
        for (j, &(expert, _)) in token.iter().enumerate() {
            if first_naming(token, j) {
                spans[expert].1 += 1;
            }
        }
    }
    let mut start = 0;
    for span in spans.iter_mut() {
        let count = span.1;
        *span = (start, start);
        start += count;
    }
    rows.clear();
    rows.resize(start, (0, 0.0));
    for (t, token) in choices.chunks_exact(k).enumerate() {
        for (j, &(expert, weight)) in token.iter().enumerate() {
            if first_naming(token, j) {
                rows[spans[expert].1] = (t, weight);
                spans[expert].1 += 1;
            }
        }
    }
}

/// `routed[t] += weight * output` for each (token, weight) row of one expert's outputs.
fn combine(rows: &[(usize, f32)], outputs: &[f32], dim: usize, routed: &mut [f32]) {
    for (r, &(t, weight)) in rows.iter().enumerate() {
        let src = &outputs[r * dim..(r + 1) * dim];
        for (acc, &v) in routed[t * dim..(t + 1) * dim].iter_mut().zip(src) {
            *acc += v * weight;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::weights::Linear;

    fn moe_with_bias(bias: Vec<f32>) -> MoeWeights {
        let empty = |o, i| Linear::from_rows(&vec![0.0; o * i], None, o, i);
        MoeWeights {
            gate: empty(8, 1),
            correction_bias: bias,
            experts: Vec::new(),
            shared: MlpWeights {
                up: empty(1, 1),
                down: empty(1, 1),
            },
            latent: None,
        }
    }

    fn check_route(logits: [f32; 8], bias: [f32; 8], expected: &[(usize, f32)]) {
        let config = Config::tiny_demo(); // 8 experts, 2 groups of 4, keep 1 group, top 2, x2.5
        let w = moe_with_bias(bias.to_vec());
        let mut scores = logits.to_vec();
        let mut kept = Vec::new();
        let mut choices = [(0, 0.0); 2];
        route(&config, &w, &mut scores, &mut kept, &mut choices);
        let s = |x: f32| 1.0 / (1.0 + (-x).exp());
        for (&(expert, weight), &(want_expert, logit)) in choices.iter().zip(expected) {
            let total: f32 = expected.iter().map(|&(_, l)| s(l)).sum();
            assert_eq!(expert, want_expert);
            assert!((weight - s(logit) / total * 2.5).abs() < 1e-6, "{weight}");
        }
    }

    #[test]
    fn router_groups_topk_and_weights() {
        // Group 0 (experts 0-3) scores 2+1.9 > group 1's 3+(-5): the single best expert (4) is
        // in the losing group and is not chosen.
        check_route(
            [2.0, 1.9, 0.0, 0.0, 3.0, -5.0, -5.0, -5.0],
            [0.0; 8],
            &[(0, 2.0), (1, 1.9)],
        );
        // The correction bias picks the experts (3 over 1) but the weights use plain sigmoids.
        check_route(
            [2.0, 1.9, 0.0, 0.0, -5.0, -5.0, -5.0, -5.0],
            [0.0, 0.0, 0.0, 0.5, 0.0, 0.0, 0.0, 0.0],
            &[(3, 0.0), (0, 2.0)],
        );
    }
}
