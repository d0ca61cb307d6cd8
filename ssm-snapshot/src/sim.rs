//! The trace-driven simulator: the Marconi artifact's JSONL trace format, synthetic trace
//! generators (chat, ShareGPT-like long replies, agentic), the per-request replay step shared
//! with α tuning, and the three policies the `simulate` example compares.
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
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};
use workload_trace::{ReadOptions, TraceReader};

use crate::cost::CostModel;
use crate::error::SnapshotError;
use crate::slots::SlotId;
use crate::store::{
    Admission, BudgetScope, FlopBasis, Namespace, Recency, SnapshotStore, StoreConfig, StoreDelta,
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
}

impl SimConfig {
    /// The defaults for `policy`; for `marconi`: shadow tuning over the default grid
    /// ([`default_tuning`]), starting at α = 0, adaptive recency, marginal FLOPs, plain admission
    /// (what measured best; see the crate report).
    pub fn new(policy: Policy, capacity_bytes: u64, block_size: u32, cost: CostModel) -> Self {
        Self {
            policy,
            capacity_bytes,
            block_size,
            cost,
            alpha: None,
            tuning: default_tuning(),
            flop_basis: FlopBasis::Marginal,
            recency: Recency::Adaptive,
            guard: false,
            objective: Objective::Flops,
        }
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

/// The synthetic workloads of `--generate`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TraceKind {
    /// Multi-turn chat: 10 to 20 turns, short replies, some popular shared openers.
    Chat,
    /// Long-reply chat (ShareGPT-like): 2 to 8 turns, replies of 300 to 1200 tokens.
    ShareGpt,
    /// Agentic sessions: a long system prompt shared by all, a repository context shared by the
    /// sessions on the same repository, 15 to 30 turns of tool calls and results, with history
    /// edits (compaction, dropped tool results) instead of pure extension.
    Agentic,
}

impl TraceKind {
    /// Parses `chat`, `sharegpt` or `agentic`.
    pub fn parse(text: &str) -> Result<Self, SnapshotError> {
        match text {
            "chat" => Ok(Self::Chat),
            "sharegpt" => Ok(Self::ShareGpt),
            "agentic" => Ok(Self::Agentic),
            other => Err(SnapshotError::BadArgument(format!(
                "trace kind `{other}` (expected chat, sharegpt or agentic)"
            ))),
        }
    }
}

const VOCAB: u32 = 50_000;

fn random_tokens(rng: &mut ChaCha8Rng, lo: usize, hi: usize) -> Vec<u32> {
    let len = rng.random_range(lo..=hi);
    (0..len).map(|_| rng.random_range(0..VOCAB)).collect()
}

/// Picks `0..n` with weight `1 / (i + 1)` (a Zipf-like popularity).
fn zipf(rng: &mut ChaCha8Rng, n: usize) -> usize {
    let total: f64 = (0..n).map(|i| 1.0 / (i + 1) as f64).sum();
    let mut x = rng.random::<f64>() * total;
    for i in 0..n {
        x -= 1.0 / (i + 1) as f64;
        if x <= 0.0 {
            return i;
        }
    }
    n - 1
}

/// Generates a synthetic trace of `sessions` sessions, sorted by arrival time.
pub fn generate(kind: TraceKind, sessions: usize, seed: u64) -> Vec<TraceRecord> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut records = Vec::new();
    // Sessions arrive over a span proportional to their number, so about the same number of
    // sessions is live at any time whatever `sessions` is.
    let span = sessions as f64 * 20.0;
    match kind {
        TraceKind::Chat | TraceKind::ShareGpt => {
            let chat = kind == TraceKind::Chat;
            let openers: Vec<Vec<u32>> =
                (0..8).map(|_| random_tokens(&mut rng, 200, 800)).collect();
            for session in 0..sessions {
                let mut history = if rng.random_bool(if chat { 0.6 } else { 0.2 }) {
                    openers[zipf(&mut rng, openers.len())].clone()
                } else {
                    random_tokens(&mut rng, 50, 300)
                };
                let turns = if chat {
                    rng.random_range(10..=20)
                } else {
                    rng.random_range(2..=8)
                };
                let mut ts = rng.random::<f64>() * span;
                for turn in 0..turns {
                    let user = if chat {
                        random_tokens(&mut rng, 20, 300)
                    } else {
                        random_tokens(&mut rng, 20, 200)
                    };
                    history.extend_from_slice(&user);
                    let reply = if chat {
                        random_tokens(&mut rng, 50, 400)
                    } else {
                        random_tokens(&mut rng, 300, 1200)
                    };
                    records.push(record(session, turn, ts, &history, &reply));
                    history.extend_from_slice(&reply);
                    ts += rng.random_range(10.0..60.0);
                }
            }
        }
        TraceKind::Agentic => {
            let system = random_tokens(&mut rng, 3000, 3000);
            let repos: Vec<Vec<u32>> = (0..(sessions / 4).max(1))
                .map(|_| random_tokens(&mut rng, 2000, 6000))
                .collect();
            for session in 0..sessions {
                let repo = &repos[zipf(&mut rng, repos.len())];
                // The history as messages; the first two are the shared system prompt and repo.
                let mut messages: Vec<Vec<u32>> = vec![
                    system.clone(),
                    repo.clone(),
                    random_tokens(&mut rng, 50, 300),
                ];
                let turns = rng.random_range(15..=30);
                let mut ts = rng.random::<f64>() * span;
                for turn in 0..turns {
                    if turn >= 2 && rng.random_bool(0.15) {
                        // Edit the history: keep a prefix of the messages (past the shared
                        // ones) and replace the rest by a summary.
                        let keep = rng.random_range(3..messages.len());
                        messages.truncate(keep);
                        messages.push(random_tokens(&mut rng, 100, 400));
                    }
                    let input: Vec<u32> = messages.concat();
                    let call = random_tokens(&mut rng, 30, 200);
                    records.push(record(session, turn, ts, &input, &call));
                    messages.push(call);
                    messages.push(random_tokens(&mut rng, 50, 800));
                    ts += rng.random_range(2.0..20.0);
                }
            }
        }
    }
    records.sort_by(|a, b| a.ts.total_cmp(&b.ts));
    records
}

fn record(session: usize, turn: usize, ts: f64, input: &[u32], output: &[u32]) -> TraceRecord {
    TraceRecord {
        session_id: SessionId::Number(session as u64),
        turn_id: turn as u64,
        ts,
        num_input_tokens: input.len(),
        num_output_tokens: output.len(),
        input_tokens: input.to_vec(),
        output_tokens: output.to_vec(),
    }
}
