//! The host router: `DeviceIo` over the host model with `kv-cache` and `ssm-snapshot`
//! bookkeeping; the default backend and the oracle every other router is compared with.
//!
//! [`CpuRouter`] owns host memory for one [`model::Model`] and executes the core's plans and effects
//! for real (see [`CpuRouterConfig`] for the regions and how a byte budget is split):
//!
//! - **Plans.** `Prefill` attaches, on a row's first chunk, the longest cached prefix (the
//!   hash-chain prefix cache of `kv-cache` on an attention-only model; the Marconi tree of
//!   `ssm-snapshot` on a hybrid one, whose SSM checkpoint is copied into the row's live slot), then
//!   computes up to the row's budget, splitting the computation where the tree asked for a
//!   checkpoint (the branch point) and at the prompt's last block boundary to take those
//!   checkpoints. `Decode` feeds one token per row through one batched `Model::decode`; `DecodeFed`
//!   does the same with each row's input taken from a feed cell of the previous step or a host
//!   token. Readback is `Argmax`, `ArgmaxMasked` (the argmax over the allowed ids, as masking the
//!   logits on the host would give) or `HostLogits`.
//! - **Effects.** Every effect of the contract does what it says (see [`CpuRouter`]'s `apply`):
//!   release (caching first), compaction, detaching, spill images ([`image`] documents the format),
//!   logits readback, Marconi checkpoints, the snapshot ring, KV reservation and rollback (the
//!   reservation ledger; `Rollback` answers `Unsupported` at depth 1), `TruncateKv`, and the MTP
//!   catch-up ring (`SaveHiddenCatchup`). The stream / expert effects are no-ops because this
//!   router has one stream and no expert workers.
//! - **Speculative decoding** (see the `spec` module): `Verify` computes each row's next token and
//!   drafts as one run of `Model::forward_runs`, writing the per-position Mamba snapshots into the
//!   ring slots the core names (main layers only) and opening the row's ledger entry for
//!   `TruncateKv`; `Draft` runs the MTP head (`Model::mtp`): the catch-up over the ring of hidden
//!   states `SaveHiddenCatchup` kept, then `k` greedy drafts on a scratch copy of the state. On a
//!   model with an MTP head every prefill chunk also runs the head over its positions whose next
//!   token is known, and decode steps keep their hidden states.
//!
//! # Depth
//!
//! [`CpuRouterConfig::max_depth`] picks the mode; both share every line of bookkeeping and
//! device work (see the `device` module) and one ticket sequence:
//!
//! - **1, synchronous**: `launch` runs the step before it returns; `await_result` hands over its
//!   result once. `DecodeFed` and `Rollback` answer [`DeviceError::Unsupported`].
//! - **2, pipelined**: device work runs in order on a worker thread fed by a `crossbeam-channel`;
//!   `launch` does the step's bookkeeping and returns its ticket at once, `await_result` blocks
//!   for it, so the core can launch step t+1 (a `DecodeFed`) and then read step t while t+1
//!   computes. A `HostLogits` step is a synchronisation point (its logits are in `into` when
//!   `launch` returns). The logits of the latest two steps stay readable with `ReadLogits`.
//!   `teardown` lets the worker finish what was submitted, joins it, and reports unclaimed steps
//!   with the sequences still holding resources.
//!
//! # Exactness
//!
//! A row's logits do not depend on its batch or on how its prompt was chunked (the model promises
//! it, bit for bit), so a prefix served from the cache, a spilled-and-restored sequence and a
//! compacted one produce the same bits as the plain run. The tests check this.
//!
//! # Failures
//!
//! Every plan validates all rows and reserves all blocks and slots before it changes anything; a
//! dry pool is [`DeviceError::KvExhausted`] with nothing changed. Only an error inside the model
//! after validation ([`DeviceError::Failed`] in phase `Forward`) leaves the step's rows marked
//! failed; they are then never cached. At depth 2 that error comes from `await_result` (or from
//! `launch` for a synchronous step); the router marks the rows failed the next time it is handed
//! them, fails every later step that has one of them as a row or feeds from the failed step, and
//! holds nothing for the step itself. A worker thread that panicked makes every later call answer
//! [`DeviceError::DeviceLost`].
//!
//! # Cache events
//!
//! `subscribe_cache_events` publishes the prefix cache's changes in one key scheme, `kv-cache`'s
//! hash chain, on both indexes: on an attention-only model the hash chain's own events; on a
//! hybrid one a `BlockStored` for each block the Marconi tree adopts from a finishing sequence
//! (keyed by the chain over that sequence's tokens) and a `BlockRemoved` for each block it gives
//! back. A new subscription starts with the contents ([`CpuRouter::cache_contents`]); with no
//! subscription nothing is built or hashed.
//!
//! # Example
//!
//! Load the tiny fixture checkpoint, prefill a prompt and decode two tokens through `DeviceIo`
//! (what the engine does for one request), then send the same prompt again: its full blocks come
//! from the prefix cache (on this hybrid model, with the Marconi checkpoint taken at the prompt's
//! last block boundary), and its first token is the same.
//!
//! ```
//! use device_cpu::{CpuRouter, CpuRouterConfig, CpuSeq};
//! use device_io::{DeviceIo, Effect, Readback, SeqSpec, Sequence, StepPlan};
//!
//! let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../model/tests/fixtures/nemotron-h-tiny/model");
//! let model = model::Model::load(std::path::Path::new(dir))?;
//! let router = CpuRouter::new(model, CpuRouterConfig::new(64, 2))?; // 64 blocks of 16, 2 slots
//!
//! let prompt: Vec<u32> = (1..=40).collect();
//! let spec = |id| SeqSpec { id, prompt: &prompt, adapter: None, cache_salt: None };
//! let prefill = || StepPlan::Prefill { budgets: &[64], readback: Readback::Argmax };
//!
//! let mut first = CpuSeq::create(spec(1));
//! let step = router.await_result(router.launch(prefill(), &mut [&mut first])?)?;
//! let mut token = step.rows[0].token.expect("the prompt completed");
//! let mut generated = vec![token];
//! for _ in 0..2 {
//!     let decode = StepPlan::Decode { tokens: &[token], readback: Readback::Argmax };
//!     token = router.await_result(router.launch(decode, &mut [&mut first])?)?.rows[0]
//!         .token
//!         .expect("decode rows reach a token");
//!     generated.push(token);
//! }
//! println!("generated {generated:?}");
//! router.apply(Effect::ReleaseSeq { seq: &mut first, cache: true, what: "finish" })?;
//!
//! let mut again = CpuSeq::create(spec(2));
//! let step = router.await_result(router.launch(prefill(), &mut [&mut again])?)?;
//! let report = step.rows[0].prefill.expect("a prefill row reports how it advanced");
//! assert_eq!((report.cached, report.computed), (32, 8));
//! assert_eq!(step.rows[0].token, Some(generated[0]));
//! router.apply(Effect::ReleaseSeq { seq: &mut again, cache: true, what: "finish" })?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
#![forbid(unsafe_code)]

mod config;
mod device;
mod effects;
mod lora;
mod plans;
mod spec;

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};

use device_io::{
    CacheEvent, CacheEventSink, DeviceError, DeviceFacts, DeviceIo, Effect, EffectOutcome, LoraAck,
    LoraCommand, LoraError, Readback, Result, StepPlan, StepResult, Ticket,
};
use model::{ExpertPool, KvPool, MambaStates, Model, Scratch};

use crate::device::{Device, Done, Executor, Work};

pub use config::{
    default_threads, CheckpointBudget, CpuRouterConfig, DEFAULT_BLOCK_SIZE, DEFAULT_LORA_SLOTS,
    DEFAULT_SNAPSHOT_SLOTS,
};
/// The spill image format (shared with every router: see `router_book::image`).
pub use router_book::image;
pub use router_book::CacheStats;
/// The host router's per-sequence bookkeeping: the record every router of the workspace keeps
/// (`router_book::RouterSeq`).
pub use router_book::RouterSeq as CpuSeq;
pub use router_book::{LogitsHandle, Namespace, StepFaults};

/// Why a router could not be built.
#[derive(Debug, thiserror::Error)]
pub enum RouterError {
    /// A config field is out of range.
    #[error("invalid router config: {field} = {value} ({limit})")]
    BadConfig {
        /// The field.
        field: &'static str,
        /// Its value.
        value: u64,
        /// The limit it broke.
        limit: String,
    },
    /// A byte budget is too small for the fixed regions.
    #[error("byte budget {budget} is too small for {what}: needs at least {needed}")]
    BudgetTooSmall {
        /// The budget given.
        budget: u64,
        /// The bytes needed.
        needed: u64,
        /// What did not fit.
        what: &'static str,
    },
    /// The worker thread of a pipelined router could not be started.
    #[error("could not start the router's worker thread: {0}")]
    Worker(String),
    /// The model refused the memory layout.
    #[error("model: {0}")]
    Model(#[from] model::ModelError),
    /// A cache structure refused its sizes.
    #[error("cache: {0}")]
    Cache(String),
}

use router_book::book::{self, BookMut, BookShape};
use router_book::{Caches, PendingFeed, RingEntry, SlotOwner, Tenure};

/// A sequence's MTP head: the positions it has consumed and the main model's hidden states it
/// has not consumed yet (the catch-up ring), by position (`router_book::spec`'s, holding host
/// floats).
pub(crate) type MtpTrack = router_book::spec::MtpTrack<Vec<f32>>;

/// The hidden states a step kept (decode and verify rows on a model with an MTP head), for
/// `SaveHiddenCatchup`.
#[derive(Debug)]
pub(crate) struct StepHidden {
    pub ticket: u64,
    /// Per row: tenure, first position, positions, first hidden row.
    pub rows: Vec<(u64, usize, usize, usize)>,
    pub width: usize,
    pub data: Vec<f32>,
}

/// The router's bookkeeping, behind one mutex (device memory is behind its own, see
/// [`device`]).
///
/// Invariants:
/// - `slots[i]` is `Some(owner)` exactly when a sequence with tenure `owner.tenure` holds live slot
///   `i`, and that tenure is in `tenures`.
/// - Live slot `i` is state row `i` of the device's states; checkpoint slot `c` is row
///   `max_seqs + c`; ring slot `r` is row `max_seqs + checkpoint_slots + r`.
/// - `unsettled` lists the launched, unclaimed tickets in launch order (at most the router's
///   depth); `stash` holds the results of those the device finished.
/// - `last_rows` is the tenure of each row of the latest launched step and whether it reached a
///   token position (what a `Feed::Row` may name).
/// - `pending` holds, per tenure, the fed positions whose step has not finished; when it does,
///   they move to `resolved` (or, when it failed, the tenure goes to `failed`) until the sequence
///   is next seen, which copies them into it.
pub(crate) struct Inner {
    pub cache: Caches,
    pub slots: Vec<Option<SlotOwner>>,
    pub tenures: BTreeMap<u64, Tenure>,
    pub ring: Vec<Option<RingEntry>>,
    pub next_step: u64,
    pub executor: Executor,
    pub unsettled: VecDeque<u64>,
    pub stash: BTreeMap<u64, Result<StepResult<LogitsHandle>>>,
    pub last_rows: Vec<(u64, bool)>,
    pub pending: BTreeMap<u64, Vec<PendingFeed>>,
    pub resolved: BTreeMap<u64, Vec<(usize, u32)>>,
    pub failed: BTreeSet<u64>,
    /// The host logits of the latest synchronous step, until `launch` hands them over.
    pub host_logits: Option<(u64, Vec<f32>)>,
    /// The argmax of each row of the latest step the device finished (for a fed step launched
    /// after its source finished).
    pub last_argmax: Option<(u64, Vec<Option<u32>>)>,
    /// The MTP head of each tenure that has one running.
    pub mtp: BTreeMap<u64, MtpTrack>,
    /// The hidden states of the latest steps that kept them (at most three).
    pub step_hidden: VecDeque<StepHidden>,
    /// The latest ticket `await_result` handed over.
    pub settled: Option<u64>,
    /// The LoRA adapter slots.
    pub lora: lora::LoraTable,
    /// Fault injection at the device ([`CpuRouter::inject_step_faults`]).
    pub step_faults: Option<StepFaults>,
}

impl Inner {
    /// Takes in one answer of the device: resolves the fed tokens a finished step produced, or
    /// marks the rows of a failed one.
    fn take_in(&mut self, mut done: device::Completed) {
        if let Some(buffer) = done.host_logits.take() {
            self.host_logits = Some((done.ticket, buffer));
        }
        // A prefill keeps its last prompt position's hidden state in the sequence's ring.
        for (tenure, pos, row) in done.kept.drain(..) {
            if self.tenures.contains_key(&tenure) {
                let track = self.mtp.entry(tenure).or_default();
                if pos >= track.consumed {
                    track.ring.insert(pos, row);
                }
            }
        }
        if let Some(hidden) = done.hidden.take() {
            if self.step_hidden.len() >= 3 {
                self.step_hidden.pop_front();
            }
            self.step_hidden.push_back(hidden);
        }
        match &done.result {
            Ok(_) => {
                let mut argmax = self
                    .last_argmax
                    .take()
                    .map(|(_, buffer)| buffer)
                    .unwrap_or_default();
                argmax.clear();
                argmax.extend_from_slice(&done.argmax);
                self.last_argmax = Some((done.ticket, argmax));
                let ticket = done.ticket;
                router_book::plans::resolve_feeds(
                    &mut self.book(),
                    ticket,
                    &done.tenures,
                    &done.argmax,
                );
            }
            Err(_) => {
                for &tenure in &done.tenures {
                    if self.tenures.contains_key(&tenure) {
                        self.failed.insert(tenure);
                    }
                }
            }
        }
        self.stash.insert(done.ticket, done.result);
    }

    /// Waits for the device's answer for `ticket` (already submitted).
    pub fn wait_for(&mut self, ticket: u64) -> Result<()> {
        while !self.stash.contains_key(&ticket) {
            match self.executor.receive()? {
                Done::Step(done) => self.take_in(*done),
                Done::Fence => {}
            }
        }
        Ok(())
    }

    /// Waits until the device has run every work item submitted so far.
    pub fn fence(&mut self, model: &Model, device: &Mutex<Device>) -> Result<()> {
        self.executor.submit(model, device, Work::Fence)?;
        loop {
            match self.executor.receive()? {
                Done::Step(done) => self.take_in(*done),
                Done::Fence => return Ok(()),
            }
        }
    }

    /// The tables the shared bookkeeping works on.
    pub fn book(&mut self) -> BookMut<'_> {
        self.book_and_tracks().0
    }

    /// The shared bookkeeping's tables and the MTP catch-up rings, borrowed together.
    pub fn book_and_tracks(&mut self) -> (BookMut<'_>, &mut BTreeMap<u64, MtpTrack>) {
        (router_book::book_mut!(self), &mut self.mtp)
    }

    /// Brings a sequence up to date with what the device finished since it was last seen:
    /// resolved fed tokens, and the failure of a step it was a row of.
    pub fn sync(&mut self, seq: &mut CpuSeq) {
        book::sync(&mut self.book(), seq);
    }
}

/// Fixed facts about the router, outside the mutex.
#[derive(Debug, Clone)]
pub(crate) struct Shape {
    pub block_size: usize,
    pub num_blocks: usize,
    pub max_seqs: usize,
    pub checkpoint_slots: usize,
    pub snapshot_slots: usize,
    pub max_context: usize,
    pub vocab_size: usize,
    pub hybrid: bool,
    pub layout: image::Layout,
    pub max_depth: usize,
    /// The model has an MTP head.
    pub mtp: bool,
    /// Mamba layers of the main stack (the first ones of a slot).
    pub main_mamba_layers: usize,
    pub hidden_size: usize,
    /// The MTP head is rerun at a prefix hit (`router_book::spec`'s rule): a model with a head
    /// and checkpoint slots.
    pub head_rerun: bool,
    /// The head has Mamba layers: it lags one position at a prefill checkpoint
    /// (`router_book::BookShape::head_lags`).
    pub head_lags: bool,
}

impl Shape {
    /// The sizes the shared bookkeeping checks against.
    pub fn book(&self) -> BookShape {
        BookShape {
            block_size: self.block_size,
            max_seqs: self.max_seqs,
            checkpoint_slots: self.checkpoint_slots,
            snapshot_slots: self.snapshot_slots,
            max_context: self.max_context,
            max_depth: self.max_depth,
            hybrid: self.hybrid,
            layout: self.layout,
            head_rerun: self.head_rerun,
            head_lags: self.head_lags,
        }
    }

    /// A scratch state row per live slot (drafting, a verification's last snapshot).
    pub fn scratch_row(&self, slot: usize) -> usize {
        self.max_seqs + self.checkpoint_slots + self.snapshot_slots + slot
    }
}

/// The host router. See the crate docs.
///
/// `Send` and `Sync`: every method takes `&self` and locks the router's bookkeeping; device
/// memory sits behind its own lock, taken by whoever runs device work (the caller at depth 1,
/// the worker thread at depth 2); the model is read-only and shared with the worker.
pub struct CpuRouter {
    model: Arc<Model>,
    shape: Shape,
    inner: Mutex<Inner>,
    device: Arc<Mutex<Device>>,
    /// The expert-parallel workers (also in the device's scratch), stopped by `EpShutdown`.
    experts: Option<Arc<ExpertPool>>,
}

impl std::fmt::Debug for CpuRouter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CpuRouter")
            .field("shape", &self.shape)
            .finish_non_exhaustive()
    }
}

fn bad_config(field: &'static str, value: usize, limit: impl Into<String>) -> RouterError {
    RouterError::BadConfig {
        field,
        value: value as u64,
        limit: limit.into(),
    }
}

impl CpuRouter {
    /// Builds a router for `model` with the regions `config` sizes.
    pub fn new(model: Model, config: CpuRouterConfig) -> std::result::Result<Self, RouterError> {
        let mc = model.config();
        if config.block_size == 0 {
            return Err(bad_config("block_size", 0, "must be at least 1"));
        }
        if config.max_seqs == 0 {
            return Err(bad_config("max_seqs", 0, "must be at least 1"));
        }
        let pool_tokens = config.num_blocks.saturating_mul(config.block_size);
        let model_context = mc.max_position_embeddings;
        let max_context = match config.max_context {
            Some(0) => return Err(bad_config("max_context", 0, "must be at least 1")),
            Some(asked) => match model_context {
                Some(limit) if asked > limit => {
                    return Err(bad_config(
                        "max_context",
                        asked,
                        format!("must not exceed the model's max_position_embeddings {limit}"),
                    ))
                }
                _ => asked,
            },
            // The model's context, or what the pool holds when that is less.
            None => model_context.map_or(pool_tokens, |limit| limit.min(pool_tokens)),
        };
        if max_context == 0 {
            return Err(bad_config("num_blocks", 0, "must be at least 1"));
        }
        let blocks_per_context = max_context.div_ceil(config.block_size);
        if config.num_blocks < blocks_per_context {
            return Err(bad_config(
                "num_blocks",
                config.num_blocks,
                format!(
                    "must hold one sequence of max_context {max_context} tokens: at least \
                     {blocks_per_context}"
                ),
            ));
        }
        if !(1..=2).contains(&config.max_depth) {
            return Err(bad_config(
                "max_depth",
                config.max_depth,
                "must be 1 (synchronous) or 2 (pipelined)",
            ));
        }
        if u32::try_from(config.num_blocks).is_err() {
            return Err(bad_config(
                "num_blocks",
                config.num_blocks,
                "block ids are u32",
            ));
        }
        if config.threads == 0 {
            return Err(bad_config("threads", 0, "must be at least 1"));
        }
        let mut scratch = Scratch::with_threads(mc, config.threads)?;
        let experts = if config.expert_workers > 0 && mc.has(model::LayerKind::Moe) {
            Some(Arc::new(ExpertPool::start(&model, config.expert_workers)?))
        } else {
            None
        };
        scratch.set_expert_pool(experts.clone());
        let kv = KvPool::new(mc, config.num_blocks, config.block_size)?;
        let state_floats = MambaStates::new(mc, 0)?.floats_per_slot();
        let hybrid = state_floats > 0;
        let checkpoint_slots = if hybrid {
            config.checkpoint_slots(4 * state_floats as u64)
        } else {
            0
        };
        let snapshot_slots = config.snapshot_slots;
        let scratch_rows = if hybrid { config.max_seqs } else { 0 };
        let states = MambaStates::new(
            mc,
            config.max_seqs + checkpoint_slots + snapshot_slots + scratch_rows,
        )?;
        let layout = image::Layout {
            fingerprint: model.fingerprint(),
            block_size: config.block_size,
            floats_per_block: kv.floats_per_block(),
            floats_per_slot: state_floats,
            max_context,
            vocab_size: mc.vocab_size,
            hidden_size: if model.has_mtp() { mc.hidden_size } else { 0 },
        };
        let shape = Shape {
            block_size: config.block_size,
            num_blocks: config.num_blocks,
            max_seqs: config.max_seqs,
            checkpoint_slots,
            snapshot_slots,
            max_context,
            vocab_size: mc.vocab_size,
            hybrid,
            layout,
            max_depth: config.max_depth,
            mtp: model.has_mtp(),
            main_mamba_layers: mc.count(model::LayerKind::Mamba),
            hidden_size: mc.hidden_size,
            head_rerun: model.has_mtp() && checkpoint_slots > 0,
            head_lags: mc.stored_count(model::LayerKind::Mamba)
                != mc.count(model::LayerKind::Mamba),
        };
        let cache = Caches::new(
            &model,
            &router_book::CacheConfig {
                num_blocks: shape.num_blocks,
                block_size: shape.block_size,
                hybrid,
                checkpoint_slots,
                prefix_cache: config.prefix_cache,
                marconi: config.marconi,
            },
        )
        .map_err(|err| match err {
            router_book::BookError::BadConfig {
                field,
                value,
                limit,
            } => RouterError::BadConfig {
                field,
                value,
                limit,
            },
            router_book::BookError::Cache(message) => RouterError::Cache(message),
        })?;
        let device = Arc::new(Mutex::new(Device::new(
            kv,
            states,
            scratch,
            config.max_depth,
            checkpoint_slots,
        )));
        let model = Arc::new(model);
        let executor = if config.max_depth >= 2 {
            Executor::worker(Arc::clone(&model), Arc::clone(&device))
                .map_err(|err| RouterError::Worker(err.to_string()))?
        } else {
            Executor::inline()
        };
        let inner = Inner {
            cache,
            slots: vec![None; config.max_seqs],
            tenures: BTreeMap::new(),
            ring: vec![None; snapshot_slots],
            next_step: 1,
            executor,
            unsettled: VecDeque::new(),
            stash: BTreeMap::new(),
            last_rows: Vec::new(),
            pending: BTreeMap::new(),
            resolved: BTreeMap::new(),
            failed: BTreeSet::new(),
            host_logits: None,
            last_argmax: None,
            mtp: BTreeMap::new(),
            step_hidden: VecDeque::new(),
            settled: None,
            lora: lora::LoraTable::new(config.lora_slots),
            step_faults: None,
        };
        tracing::debug!(?shape, "host router ready");
        Ok(CpuRouter {
            model,
            shape,
            inner: Mutex::new(inner),
            device,
            experts,
        })
    }

    fn lock(&self) -> Result<MutexGuard<'_, Inner>> {
        self.inner
            .lock()
            .map_err(|_| DeviceError::DeviceLost("router state poisoned by a panic".to_string()))
    }

    /// Fails, from now on, the steps `faults` picks, as a device error after the commit would
    /// ([`StepFaults`]: the step runs, what it wrote is overwritten, its rows are marked failed);
    /// for soaks and recovery tests.
    pub fn inject_step_faults(&self, faults: StepFaults) -> Result<()> {
        self.lock()?.step_faults = Some(faults);
        Ok(())
    }

    /// Whether the model has Mamba layers (and so uses the Marconi store for prefix reuse).
    pub fn is_hybrid(&self) -> bool {
        self.shape.hybrid
    }

    /// The expert-parallel workers (`CpuRouterConfig::expert_workers` > 0 on a MoE model).
    pub fn expert_pool(&self) -> Option<&Arc<ExpertPool>> {
        self.experts.as_ref()
    }

    /// Prefix-cache counters, for reports.
    pub fn cache_stats(&self) -> Result<CacheStats> {
        Ok(self.lock()?.cache.stats())
    }

    /// The keys the cache events give the full blocks of `tokens` in the namespace of `lora_adapter`
    /// and `cache_salt` (kv-cache's hash chain, on either index), in order: block `i`'s key
    /// covers `tokens[..(i + 1) * block_size]`.
    pub fn block_keys(
        &self,
        lora_adapter: Option<u32>,
        cache_salt: Option<u64>,
        tokens: &[u32],
    ) -> Result<Vec<device_io::BlockKey>> {
        let ns = Namespace {
            adapter: lora_adapter,
            cache_salt,
        };
        let mut inner = self.lock()?;
        Ok(inner
            .cache
            .block_keys(ns, tokens)
            .into_iter()
            .map(|hash| device_io::BlockKey(hash.0))
            .collect())
    }

    /// What the prefix cache holds now, as the `BlockStored` events that describe it, each after
    /// its parent: what a new subscription to the cache events starts with (for inspection and
    /// tests; allocates).
    pub fn cache_contents(&self) -> Result<Vec<CacheEvent>> {
        let inner = self.lock()?;
        Ok(inner
            .cache
            .contents()
            .into_iter()
            .map(|listed| listed.event)
            .collect())
    }
}

impl DeviceIo for CpuRouter {
    type Seq = CpuSeq;
    type Ptr = LogitsHandle;
    type Model = Model;
    type LoraCmd = LoraCommand;
    type LoraAck = LoraAck;

    fn model(&self) -> &Model {
        &self.model
    }

    fn facts(&self) -> DeviceFacts {
        let Ok(inner) = self.lock() else {
            return DeviceFacts::default();
        };
        DeviceFacts {
            block_size: self.shape.block_size,
            vocab_size: self.shape.vocab_size,
            max_context: self.shape.max_context,
            kv_blocks_total: self.shape.num_blocks,
            kv_blocks_free: inner.cache.free_blocks(),
            kv_blocks_cached: inner.cache.cached_blocks(),
            live_slots_total: self.shape.max_seqs,
            live_slots_used: inner.slots.iter().filter(|s| s.is_some()).count(),
            checkpoint_slots_total: self.shape.checkpoint_slots,
            checkpoint_slots_used: inner.cache.checkpoint_slots_used(),
            snapshot_slots_total: self.shape.snapshot_slots,
        }
    }

    fn max_depth(&self) -> usize {
        self.shape.max_depth
    }

    /// The model runs on the host's cores, the core's too.
    fn computes_on_host(&self) -> bool {
        true
    }

    fn launch(&self, plan: StepPlan<'_>, rows: &mut [&mut CpuSeq]) -> Result<Ticket> {
        let mut inner = self.lock()?;
        if inner.unsettled.len() >= self.shape.max_depth {
            let detail = format!(
                "ticket {} is not awaited yet and max_depth is {}",
                inner.unsettled.front().copied().unwrap_or_default(),
                self.shape.max_depth
            );
            return Err(DeviceError::Invalid {
                what: "launch",
                detail,
            });
        }
        for seq in rows.iter_mut() {
            inner.sync(seq);
        }
        let ticket = inner.next_step;
        let (mut job, host_into) = match plan {
            StepPlan::Prefill { budgets, readback } => {
                plans::prefill(&self.shape, &mut inner, ticket, budgets, readback, rows)?
            }
            StepPlan::Decode { tokens, readback } => plans::decode(
                &self.shape,
                &mut inner,
                ticket,
                plans::Inputs::Tokens(tokens),
                readback,
                rows,
            )?,
            StepPlan::Verify {
                inputs,
                snapshots,
                readback,
            } => spec::verify(
                &self.shape,
                &mut inner,
                ticket,
                inputs,
                snapshots,
                readback,
                rows,
            )?,
            StepPlan::Draft { tokens, k } => {
                if !self.shape.mtp {
                    return Err(DeviceError::Unsupported { what: "Draft" });
                }
                // The catch-up reads the rings the steps before it fill.
                inner.fence(&self.model, &self.device)?;
                spec::draft(&self.shape, &mut inner, ticket, tokens, k, rows)?
            }
            StepPlan::DecodeFed { sources, masks } => {
                if self.shape.max_depth < 2 {
                    return Err(DeviceError::Unsupported { what: "DecodeFed" });
                }
                let readback = if masks.is_empty() {
                    Readback::Argmax
                } else {
                    Readback::ArgmaxMasked { masks }
                };
                plans::decode(
                    &self.shape,
                    &mut inner,
                    ticket,
                    plans::Inputs::Fed(sources),
                    readback,
                    rows,
                )?
            }
        };
        inner.next_step += 1;
        job.injected_fault = inner
            .step_faults
            .as_ref()
            .is_some_and(|faults| faults.fails(ticket));
        let last_rows: Vec<(u64, bool)> = job
            .tenures
            .iter()
            .zip(&job.token_rows)
            .map(|(&tenure, row)| (tenure, row.is_some()))
            .collect();
        let sync = host_into.is_some() || !inner.executor.is_worker();
        let mut host_into = host_into;
        if let Some(into) = host_into.as_mut() {
            job.host_logits = Some(std::mem::take(*into));
        }
        inner.unsettled.push_back(ticket);
        inner.last_rows = last_rows;
        if let Err(err) =
            inner
                .executor
                .submit(&self.model, &self.device, Work::Step(Box::new(job)))
        {
            inner.unsettled.pop_back();
            return Err(err);
        }
        if !sync {
            return Ok(Ticket(ticket));
        }
        // A synchronous step: its answer (and the host logits) are in before `launch` returns.
        inner.wait_for(ticket)?;
        if let (Some(into), Some((step, buffer))) = (host_into, inner.host_logits.take()) {
            debug_assert_eq!(step, ticket);
            *into = buffer;
        }
        if let Some(Err(err)) = inner.stash.get(&ticket) {
            let err = err.clone();
            inner.stash.remove(&ticket);
            inner.unsettled.retain(|&t| t != ticket);
            inner.last_rows.clear();
            for seq in rows.iter_mut() {
                inner.sync(seq);
                seq.failed = true;
            }
            tracing::error!(%err, "forward step failed; its rows are marked failed");
            return Err(err);
        }
        Ok(Ticket(ticket))
    }

    fn await_result(&self, ticket: Ticket) -> Result<StepResult<LogitsHandle>> {
        let mut inner = self.lock()?;
        router_book::plans::check_await(&inner.unsettled, ticket)?;
        let waited = inner.wait_for(ticket.0);
        inner.unsettled.pop_front();
        waited?;
        inner.settled = Some(ticket.0);
        inner
            .stash
            .remove(&ticket.0)
            .unwrap_or(Err(DeviceError::UnknownTicket(ticket)))
    }

    fn apply(&self, effect: Effect<'_, CpuSeq, LogitsHandle>) -> Result<EffectOutcome> {
        let mut inner = self.lock()?;
        if let Effect::EpShutdown = effect {
            // Steps already launched finish on the workers first.
            inner.fence(&self.model, &self.device)?;
            if let Some(experts) = &self.experts {
                experts.shutdown();
            }
            return Ok(EffectOutcome::Unit);
        }
        effects::apply(&self.model, &self.shape, &mut inner, &self.device, effect)
    }

    /// Drops every cached prefix that no running sequence holds: its KV blocks return to the free
    /// list and its checkpoint slots to the region.
    fn clear_prefix_cache(&self) -> Result<()> {
        let mut inner = self.lock()?;
        inner.cache.clear();
        Ok(())
    }

    /// Cache events in kv-cache's hash-chain key scheme on both indexes (the hash chain's own
    /// events on an attention-only model; on a hybrid one, the Marconi tree's adoptions and
    /// releases of blocks, keyed by the chain over each block's sequence). Clearing publishes
    /// `AllBlocksCleared` when nothing is left (on the Marconi tree a running sequence's path
    /// stays, and its blocks' removals are published one by one). With the prefix cache off the
    /// subscription is accepted and never receives anything.
    fn subscribe_cache_events(&self, sink: Box<dyn CacheEventSink>) -> Result<()> {
        self.lock()?.cache.subscribe(sink);
        Ok(())
    }

    /// Loads an adapter into a free slot, unloads one (refused while a live sequence uses it),
    /// or lists them; refused with [`LoraError::Busy`] while a launched step is not awaited.
    fn lora(&mut self, cmd: LoraCommand) -> std::result::Result<LoraAck, LoraError> {
        let CpuRouter { model, inner, .. } = self;
        let inner = inner
            .get_mut()
            .map_err(|_| LoraError::DeviceLost("router state poisoned by a panic".to_string()))?;
        lora::command(model, inner, cmd)
    }

    fn teardown(self: Box<Self>) -> Result<()> {
        let CpuRouter { inner, experts, .. } = *self;
        let mut inner = inner
            .into_inner()
            .map_err(|_| DeviceError::DeviceLost("router state poisoned by a panic".to_string()))?;
        // Every step submitted runs to its end before the worker stops; then the expert workers
        // stop, as `EpShutdown` does.
        let stopped = inner.executor.shutdown();
        if let Some(experts) = experts {
            experts.shutdown();
        }
        let holders = book::holders(&inner.tenures);
        let unclaimed: Vec<String> = inner.unsettled.iter().map(u64::to_string).collect();
        // The cache's own references go first; every buffer is dropped with `inner`.
        inner.cache.clear();
        let mut problems = Vec::new();
        if let Err(err) = stopped {
            problems.push(err);
        }
        if !holders.is_empty() {
            problems.push(format!(
                "{} sequence(s) still held resources at teardown: {}",
                holders.len(),
                holders.join(", ")
            ));
        }
        if !unclaimed.is_empty() {
            problems.push(format!(
                "{} launched step(s) were never awaited: ticket {}",
                unclaimed.len(),
                unclaimed.join(", ticket ")
            ));
        }
        if problems.is_empty() {
            Ok(())
        } else {
            Err(DeviceError::Failed {
                phase: device_io::Phase::Teardown,
                message: problems.join("; "),
            })
        }
    }
}

#[cfg(test)]
mod tests;

#[cfg(test)]
mod send_sync {
    fn assert_send<T: Send>() {}
    fn assert_sync<T: Sync>() {}

    #[test]
    fn public_handles_are_send() {
        assert_send::<super::CpuRouter>();
        assert_sync::<super::CpuRouter>();
        assert_send::<super::CpuSeq>();
        assert_send::<super::LogitsHandle>();
    }
}
