//! The trace-driven simulator: the Marconi artifact's JSONL trace format, the per-request replay
//! step shared with α tuning, and the three policies the `simulate` example compares (the
//! synthetic trace generators live in [`crate::generate`] and are re-exported here).
//!
//! A replay has no model: for each request in file order it looks up the input tokens, counts the
//! reused tokens and the FLOPs they save, takes the branch checkpoint the lookup asks for, then
//! inserts input + output with the checkpoints the admission policy asks for. Block ids are
//! synthetic; [`Simulation`] counts the tree's references per block and fails if a release has
//! no matching retain, or if references remain once the tree is cleared.

use std::collections::HashMap;
use std::io::BufRead;
use std::path::Path;

use kv_cache::BlockId;
use serde::{Deserialize, Serialize};
use workload_trace::{ReadOptions, TraceReader};

use crate::cost::CostModel;
use crate::error::SnapshotError;
pub use crate::generate::{generate, TraceKind};
use crate::slots::SlotId;
use crate::store::{
    Admission, BudgetScope, FlopBasis, Namespace, PinScope, Recency, SnapshotStore, StoreConfig,
    StoreDelta,
};
use crate::tuning::{default_tuning, AlphaTuner, Objective, RecordedRequest, TuningMode};

/// The trace format's record, session id and writer, re-exported from `workload-trace`, the one
/// reader the replay shares.
pub use workload_trace::{write_trace, SessionId, TraceRecord};

/// Reads a JSONL trace with the replay's rules (see `workload_trace`; no vocabulary, so token
/// ids need only fit in 32 bits), calling `each` on every record in file order; `name` is the
/// file's name in errors. Returns the number of records.
pub fn read_trace_named(
    name: &str,
    reader: impl BufRead,
    mut each: impl FnMut(TraceRecord) -> Result<(), SnapshotError>,
) -> Result<usize, SnapshotError> {
    let mut count = 0;
    for entry in TraceReader::new(name, reader, ReadOptions::default()) {
        each(entry?.record)?;
        count += 1;
    }
    Ok(count)
}

/// [`read_trace_named`] for a reader without a file name (errors call it `trace`).
pub fn read_trace(
    reader: impl BufRead,
    each: impl FnMut(TraceRecord) -> Result<(), SnapshotError>,
) -> Result<usize, SnapshotError> {
    read_trace_named("trace", reader, each)
}

/// [`read_trace_named`] for the file at `path`.
pub fn read_trace_file(
    path: &Path,
    mut each: impl FnMut(TraceRecord) -> Result<(), SnapshotError>,
) -> Result<usize, SnapshotError> {
    let mut count = 0;
    for entry in TraceReader::open(path, ReadOptions::default())? {
        each(entry?.record)?;
        count += 1;
    }
    Ok(count)
}

/// Fresh synthetic block ids for a replay.
#[derive(Debug, Clone)]
pub struct SyntheticBlocks {
    next: u32,
}

impl SyntheticBlocks {
    /// Ids counting up from `first` (wrapping).
    pub fn new(first: u32) -> Self {
        Self { next: first }
    }

    fn take(&mut self) -> BlockId {
        let id = BlockId(self.next);
        self.next = self.next.wrapping_add(1);
        id
    }
}

/// What one replayed request reused.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct RequestOutcome {
    /// Tokens looked up.
    pub input_tokens: usize,
    /// Tokens reused.
    pub hit_tokens: usize,
    /// FLOPs the hit saved.
    pub flops_saved: f64,
}

/// Serves one request on `store` as a router would: lookup, branch checkpoint, finish with the
/// checkpoints the admission policy asks for (reserved from the last position backwards, so when
/// room runs out the most recent ones are the ones kept, as LRU would).
pub fn serve_request(
    store: &mut SnapshotStore,
    namespace: Namespace,
    input: &[u32],
    full: &[u32],
    blocks: &mut SyntheticBlocks,
    delta: &mut StoreDelta,
) -> Result<RequestOutcome, SnapshotError> {
    let mut table = Vec::new();
    let hit = store.lookup(namespace, input, &mut table);
    let outcome = RequestOutcome {
        input_tokens: input.len(),
        hit_tokens: hit.hit_tokens,
        flops_saved: store.config().cost.prefix_flops(hit.hit_tokens as u64),
    };
    if let Some(pos) = hit.branch_at {
        if let Some(slot) = store.reserve_checkpoint_for(&hit.pin, delta)? {
            store.commit_branch(&hit.pin, input, pos, slot, delta)?;
        }
    }
    let block = store.config().block_size as usize;
    let mut checkpoints: Vec<(usize, SlotId)> = Vec::new();
    for index in store.finish_positions(hit.hit_tokens, full.len()).rev() {
        match store.reserve_checkpoint_for(&hit.pin, delta)? {
            Some(slot) => checkpoints.push((index * block, slot)),
            None => break,
        }
    }
    checkpoints.reverse();
    let needed = full.len() / block;
    while table.len() < needed {
        table.push(blocks.take());
    }
    table.truncate(needed);
    store.finish(hit.pin, full, &table, &checkpoints, delta)?;
    Ok(outcome)
}

/// The policies the simulator compares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Policy {
    /// Checkpoint every block, evict LRU (vLLM's approach extended to hybrids).
    Vllm,
    /// Marconi admission, α = 0 (SGLang+).
    Lru,
    /// Marconi admission and FLOP-aware eviction.
    Marconi,
}

impl Policy {
    /// Parses `vllm`, `lru` or `marconi`.
    pub fn parse(text: &str) -> Result<Self, SnapshotError> {
        match text {
            "vllm" => Ok(Self::Vllm),
            "lru" => Ok(Self::Lru),
            "marconi" => Ok(Self::Marconi),
            other => Err(SnapshotError::BadArgument(format!(
                "policy `{other}` (expected vllm, lru or marconi)"
            ))),
        }
    }

    /// The name used on the command line and in reports.
    pub fn name(self) -> &'static str {
        match self {
            Self::Vllm => "vllm",
            Self::Lru => "lru",
            Self::Marconi => "marconi",
        }
    }
}

/// A simulation's settings.
#[derive(Debug, Clone)]
pub struct SimConfig {
    /// The policy.
    pub policy: Policy,
    /// Bytes for checkpoints plus KV.
    pub capacity_bytes: u64,
    /// Tokens per block (1 = token granularity, as in the paper).
    pub block_size: u32,
    /// The model's costs.
    pub cost: CostModel,
    /// For `marconi`: a fixed α instead of tuning.
    pub alpha: Option<f64>,
    /// For `marconi` without a fixed α: how to tune.
    pub tuning: TuningMode,
    /// For `marconi`: what FLOPs saved means.
    pub flop_basis: FlopBasis,
    /// For `marconi`: which time the recency term uses.
    pub recency: Recency,
    /// For `marconi`: guarded admission (initial setting; see [`crate::StoreConfig::guard`]).
    pub guard: bool,
    /// For `marconi` with tuning: what the replays maximise.
    pub objective: Objective,
    /// Which checkpoints a running request's pin holds (every policy of this simulator).
    pub pin_scope: PinScope,
}

impl SimConfig {
    /// The defaults for `policy`; for `marconi`: shadow tuning over the default grid
    /// ([`default_tuning`]), starting at plain LRU (α = 0, path recency, plain admission; the
    /// FLOP basis, marginal, counts only once α > 0), the setting the tuner falls back to (see
    /// [`TuningMode::Shadow`]).
    pub fn new(policy: Policy, capacity_bytes: u64, block_size: u32, cost: CostModel) -> Self {
        Self {
            policy,
            capacity_bytes,
            block_size,
            cost,
            alpha: None,
            tuning: default_tuning(),
            flop_basis: FlopBasis::Marginal,
            recency: Recency::Path,
            guard: false,
            objective: Objective::Flops,
            pin_scope: PinScope::Path,
        }
    }

    /// The same configuration with `pin_scope`.
    pub fn with_pin_scope(self, pin_scope: PinScope) -> Self {
        Self { pin_scope, ..self }
    }
}

/// The simulator's result, printed as the last line of the `simulate` example.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SimReport {
    /// Policy name.
    pub policy: String,
    /// The byte budget.
    pub capacity_bytes: u64,
    /// Tokens per block.
    pub block_size: u32,
    /// Requests replayed.
    pub requests: u64,
    /// Input tokens looked up.
    pub input_tokens: u64,
    /// Input tokens reused.
    pub hit_tokens: u64,
    /// `hit_tokens / input_tokens`.
    pub token_hit_rate: f64,
    /// Fraction of requests with a non-zero hit.
    pub request_hit_rate: f64,
    /// FLOPs the hits saved.
    pub flops_saved: f64,
    /// α at the end (0 for `vllm` and `lru`).
    pub alpha: f64,
    /// The most bytes (checkpoints + KV) held after any operation.
    pub max_bytes: u64,
}

/// A running replay.
#[derive(Debug)]
pub struct Simulation {
    config: SimConfig,
    store: SnapshotStore,
    tuner: AlphaTuner,
    blocks: SyntheticBlocks,
    references: HashMap<BlockId, u32>,
    delta: StoreDelta,
    requests: u64,
    input_tokens: u64,
    hit_tokens: u64,
    hit_requests: u64,
    flops_saved: f64,
    max_bytes: u64,
}

impl Simulation {
    /// An empty cache under `config`.
    pub fn new(config: SimConfig) -> Result<Self, SnapshotError> {
        let slots = (config.capacity_bytes / config.cost.checkpoint_bytes())
            .min(u64::from(crate::store::MAX_SLOTS)) as u32;
        let (admission, alpha, basis, recency) = match config.policy {
            Policy::Vllm => (Admission::EveryBlock, 0.0, FlopBasis::Prefix, Recency::Path),
            Policy::Lru => (Admission::Marconi, 0.0, FlopBasis::Prefix, Recency::Path),
            Policy::Marconi => (
                Admission::Marconi,
                config.alpha.unwrap_or(0.0),
                config.flop_basis,
                config.recency,
            ),
        };
        let store = SnapshotStore::new(StoreConfig {
            block_size: config.block_size,
            checkpoint_slots: slots,
            budget_bytes: config.capacity_bytes,
            budget_scope: BudgetScope::CheckpointsAndKv,
            admission,
            alpha,
            flop_basis: basis,
            recency,
            guard: config.policy == Policy::Marconi && config.guard,
            pin_scope: config.pin_scope,
            cost: config.cost.clone(),
        })?;
        let mode = match (config.policy, config.alpha) {
            (Policy::Marconi, None) => config.tuning.clone(),
            _ => TuningMode::Fixed,
        };
        let tuner = AlphaTuner::new(mode, &store)?.with_objective(config.objective);
        Ok(Self {
            config,
            store,
            tuner,
            blocks: SyntheticBlocks::new(0),
            references: HashMap::new(),
            delta: StoreDelta::default(),
            requests: 0,
            input_tokens: 0,
            hit_tokens: 0,
            hit_requests: 0,
            flops_saved: 0.0,
            max_bytes: 0,
        })
    }

    /// The store (for inspection).
    pub fn store(&self) -> &SnapshotStore {
        &self.store
    }

    /// The tuner (for its history).
    pub fn tuner(&self) -> &AlphaTuner {
        &self.tuner
    }

    /// Replays one request.
    pub fn step(&mut self, record: &TraceRecord) -> Result<(), SnapshotError> {
        let mut full = Vec::with_capacity(record.input_tokens.len() + record.output_tokens.len());
        full.extend_from_slice(&record.input_tokens);
        full.extend_from_slice(&record.output_tokens);
        self.delta.clear();
        let outcome = serve_request(
            &mut self.store,
            Namespace::default(),
            &record.input_tokens,
            &full,
            &mut self.blocks,
            &mut self.delta,
        )?;
        self.apply_delta()?;
        self.max_bytes = self.max_bytes.max(self.store.bytes());
        if self.store.bytes() > self.config.capacity_bytes {
            return Err(SnapshotError::Internal(format!(
                "{} bytes held, over the capacity of {}",
                self.store.bytes(),
                self.config.capacity_bytes
            )));
        }
        self.requests += 1;
        self.input_tokens += outcome.input_tokens as u64;
        self.hit_tokens += outcome.hit_tokens as u64;
        self.hit_requests += u64::from(outcome.hit_tokens > 0);
        self.flops_saved += outcome.flops_saved;
        let request = RecordedRequest {
            namespace: Namespace::default(),
            input: record.input_tokens.clone(),
            full,
        };
        self.tuner.observe(&mut self.store, request)?;
        Ok(())
    }

    fn apply_delta(&mut self) -> Result<(), SnapshotError> {
        for &block in &self.delta.retain_blocks {
            *self.references.entry(block).or_insert(0) += 1;
        }
        for &block in &self.delta.release_blocks {
            match self.references.get_mut(&block) {
                Some(count) if *count > 1 => *count -= 1,
                Some(_) => {
                    self.references.remove(&block);
                }
                None => {
                    return Err(SnapshotError::Internal(format!(
                        "block {block:?} released but never retained"
                    )))
                }
            }
        }
        Ok(())
    }

    /// The figures so far; also clears the cache and checks that every block reference the tree
    /// took was given back.
    pub fn finish(mut self) -> Result<SimReport, SnapshotError> {
        self.delta.clear();
        self.store.clear_unpinned(&mut self.delta);
        self.apply_delta()?;
        if !self.references.is_empty() || self.store.slots().cached_count() != 0 {
            return Err(SnapshotError::Internal(format!(
                "{} blocks still referenced and {} checkpoints cached after clearing",
                self.references.len(),
                self.store.slots().cached_count()
            )));
        }
        let ratio = |a: u64, b: u64| if b == 0 { 0.0 } else { a as f64 / b as f64 };
        Ok(SimReport {
            policy: self.config.policy.name().to_owned(),
            capacity_bytes: self.config.capacity_bytes,
            block_size: self.config.block_size,
            requests: self.requests,
            input_tokens: self.input_tokens,
            hit_tokens: self.hit_tokens,
            token_hit_rate: ratio(self.hit_tokens, self.input_tokens),
            request_hit_rate: ratio(self.hit_requests, self.requests),
            flops_saved: self.flops_saved,
            alpha: self.store.config().alpha,
            max_bytes: self.max_bytes,
        })
    }
}
