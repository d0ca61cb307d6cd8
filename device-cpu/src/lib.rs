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
//!   checkpoints. `Decode` feeds one token per row through one batched `Model::decode`. Readback is
//!   `Argmax` or `HostLogits`; `ArgmaxMasked` and `DecodeFed` answer
//!   [`DeviceError::Unsupported`]. `max_depth() == 1`: `launch` completes the step, `await_result`
//!   hands over its result once.
//! - **Effects.** Every effect of the contract does what it says (see [`CpuRouter`]'s `apply`):
//!   release (caching first), compaction, detaching, spill images ([`image`] documents the format),
//!   logits readback, Marconi checkpoints, the snapshot ring, KV reservation. `Rollback` answers
//!   `Unsupported` (there is no ledger on a synchronous router), and the MTP / stream / expert
//!   effects are no-ops because this router has no catch-up ring, one stream and no expert workers.
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
//! failed; they are then never cached.
#![forbid(unsafe_code)]

mod cache;
mod config;
mod effects;
pub mod image;
mod plans;
mod seq;

use std::collections::BTreeMap;
use std::sync::{Mutex, MutexGuard};

use device_io::{
    DeviceError, DeviceFacts, DeviceIo, Effect, EffectOutcome, LoraCommand, Result, StepPlan,
    StepResult, Ticket,
};
use model::{KvPool, MambaStates, Model, Scratch};

pub use cache::CacheStats;
pub use config::{CheckpointBudget, CpuRouterConfig, DEFAULT_BLOCK_SIZE, DEFAULT_SNAPSHOT_SLOTS};
pub use seq::{CpuSeq, LogitsHandle, Namespace};

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
    /// The model refused the memory layout.
    #[error("model: {0}")]
    Model(#[from] model::ModelError),
    /// A cache structure refused its sizes.
    #[error("cache: {0}")]
    Cache(String),
}

/// Who owns a live-state slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct SlotOwner {
    pub tenure: u64,
}

/// Tenure ids are unique in the process, not just per router, so a sequence handed to a router
/// that does not hold it is recognised (its tenure is not in that router's table) instead of
/// having its block ids released there.
static NEXT_TENURE: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

/// A fresh tenure id.
pub(crate) fn new_tenure() -> u64 {
    NEXT_TENURE.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

/// A sequence's tenure: from its first prefill (or restore) to its release.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Tenure {
    pub seq_id: u64,
}

/// What a snapshot ring slot holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RingEntry {
    pub tenure: u64,
    pub pos: usize,
}

/// The router's mutable state, behind one mutex.
///
/// Invariants:
/// - `slots[i]` is `Some(owner)` exactly when a sequence with tenure `owner.tenure` holds live slot
///   `i`, and that tenure is in `tenures`.
/// - Live slot `i` is state row `i` of `states`; checkpoint slot `c` is row `max_seqs + c`; ring slot
///   `r` is row `max_seqs + checkpoint_slots + r`.
/// - `pending` holds at most one settled, unclaimed step (depth 1); `logits` holds the latest step's
///   token-position rows, `logits_rows` of them, named by `logits_step`.
pub(crate) struct Inner {
    pub kv: KvPool,
    pub states: MambaStates,
    pub scratch: Scratch,
    pub cache: cache::Caches,
    pub slots: Vec<Option<SlotOwner>>,
    pub tenures: BTreeMap<u64, Tenure>,
    pub ring: Vec<Option<RingEntry>>,
    pub next_step: u64,
    pub pending: Option<StepResult<LogitsHandle>>,
    pub logits: Vec<f32>,
    pub logits_rows: usize,
    pub logits_step: Option<u64>,
    pub row_logits: Vec<f32>,
    /// Blocks a plan reserved and has not handed to its rows yet (empty between calls).
    pub fresh: Vec<u32>,
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
}

impl Shape {
    pub fn checkpoint_row(&self, slot: usize) -> usize {
        self.max_seqs + slot
    }

    pub fn ring_row(&self, slot: usize) -> usize {
        self.max_seqs + self.checkpoint_slots + slot
    }
}

/// The host router. See the crate docs.
///
/// `Send` and `Sync`: every method takes `&self` and locks one mutex around the router's state; the
/// model is read-only and lives outside it.
pub struct CpuRouter {
    model: Model,
    shape: Shape,
    inner: Mutex<Inner>,
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
        if config.max_context == 0 {
            return Err(bad_config("max_context", 0, "must be at least 1"));
        }
        let blocks_per_context = config.max_context.div_ceil(config.block_size);
        if config.num_blocks < blocks_per_context {
            return Err(bad_config(
                "num_blocks",
                config.num_blocks,
                format!(
                    "must hold one sequence of max_context {} tokens: at least {blocks_per_context}",
                    config.max_context
                ),
            ));
        }
        if u32::try_from(config.num_blocks).is_err() {
            return Err(bad_config(
                "num_blocks",
                config.num_blocks,
                "block ids are u32",
            ));
        }
        let kv = KvPool::new(mc, config.num_blocks, config.block_size)?;
        let state_floats = MambaStates::new(mc, 0)?.floats_per_slot();
        let hybrid = state_floats > 0;
        let checkpoint_slots = if hybrid {
            config.checkpoint_slots(4 * state_floats as u64)
        } else {
            0
        };
        let snapshot_slots = config.snapshot_slots;
        let states = MambaStates::new(mc, config.max_seqs + checkpoint_slots + snapshot_slots)?;
        let layout = image::Layout {
            fingerprint: model.fingerprint(),
            block_size: config.block_size,
            floats_per_block: kv.floats_per_block(),
            floats_per_slot: state_floats,
            max_context: config.max_context,
            vocab_size: mc.vocab_size,
        };
        let shape = Shape {
            block_size: config.block_size,
            num_blocks: config.num_blocks,
            max_seqs: config.max_seqs,
            checkpoint_slots,
            snapshot_slots,
            max_context: config.max_context,
            vocab_size: mc.vocab_size,
            hybrid,
            layout,
        };
        let cache = cache::Caches::new(&model, &config, &shape)?;
        let inner = Inner {
            kv,
            states,
            scratch: Scratch::new(mc),
            cache,
            slots: vec![None; config.max_seqs],
            tenures: BTreeMap::new(),
            ring: vec![None; snapshot_slots],
            next_step: 1,
            pending: None,
            logits: Vec::new(),
            logits_rows: 0,
            logits_step: None,
            row_logits: Vec::new(),
            fresh: Vec::new(),
        };
        tracing::debug!(?shape, "host router ready");
        Ok(CpuRouter {
            model,
            shape,
            inner: Mutex::new(inner),
        })
    }

    fn lock(&self) -> Result<MutexGuard<'_, Inner>> {
        self.inner
            .lock()
            .map_err(|_| DeviceError::DeviceLost("router state poisoned by a panic".to_string()))
    }

    /// Whether the model has Mamba layers (and so uses the Marconi store for prefix reuse).
    pub fn is_hybrid(&self) -> bool {
        self.shape.hybrid
    }

    /// Drops every cached prefix that no running sequence holds (vLLM's `reset_prefix_cache`): its
    /// KV blocks return to the free list and its checkpoint slots to the region.
    pub fn clear_prefix_cache(&self) -> Result<()> {
        let mut inner = self.lock()?;
        inner.cache.clear();
        Ok(())
    }

    /// Prefix-cache counters, for reports.
    pub fn cache_stats(&self) -> Result<CacheStats> {
        Ok(self.lock()?.cache.stats())
    }
}

impl DeviceIo for CpuRouter {
    type Seq = CpuSeq;
    type Ptr = LogitsHandle;
    type Model = Model;
    type LoraCmd = LoraCommand;
    type LoraAck = ();

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
        }
    }

    fn max_depth(&self) -> usize {
        1
    }

    fn launch(&self, plan: StepPlan<'_>, rows: &mut [&mut CpuSeq]) -> Result<Ticket> {
        let mut inner = self.lock()?;
        if let Some(pending) = &inner.pending {
            return Err(DeviceError::Invalid {
                what: "launch",
                detail: format!("{} is not awaited yet and max_depth is 1", pending.ticket),
            });
        }
        let ticket = Ticket(inner.next_step);
        let result = match plan {
            StepPlan::Prefill { budgets, readback } => plans::prefill(
                &self.model,
                &self.shape,
                &mut inner,
                ticket,
                budgets,
                readback,
                rows,
            )?,
            StepPlan::Decode { tokens, readback } => plans::decode(
                &self.model,
                &self.shape,
                &mut inner,
                ticket,
                tokens,
                readback,
                rows,
            )?,
            StepPlan::DecodeFed { .. } => {
                return Err(DeviceError::Unsupported { what: "DecodeFed" })
            }
        };
        inner.next_step += 1;
        inner.pending = Some(result);
        Ok(ticket)
    }

    fn await_result(&self, ticket: Ticket) -> Result<StepResult<LogitsHandle>> {
        let mut inner = self.lock()?;
        match inner.pending.take() {
            Some(result) if result.ticket == ticket => Ok(result),
            other => {
                inner.pending = other;
                Err(DeviceError::UnknownTicket(ticket))
            }
        }
    }

    fn apply(&self, effect: Effect<'_, CpuSeq, LogitsHandle>) -> Result<EffectOutcome> {
        let mut inner = self.lock()?;
        effects::apply(&self.model, &self.shape, &mut inner, effect)
    }

    fn lora(&mut self, cmd: LoraCommand) -> std::result::Result<(), String> {
        Err(format!(
            "LoRA is not supported yet by the host router (command {cmd:?})"
        ))
    }

    fn teardown(self: Box<Self>) -> Result<()> {
        let CpuRouter { inner, .. } = *self;
        let mut inner = inner
            .into_inner()
            .map_err(|_| DeviceError::DeviceLost("router state poisoned by a panic".to_string()))?;
        let holders: Vec<String> = inner
            .tenures
            .values()
            .map(|t| t.seq_id.to_string())
            .collect();
        // The cache's own references go first; every buffer is dropped with `inner`.
        inner.cache.clear();
        if holders.is_empty() {
            Ok(())
        } else {
            Err(DeviceError::Failed {
                phase: device_io::Phase::Teardown,
                message: format!(
                    "{} sequence(s) still held resources at teardown: {}",
                    holders.len(),
                    holders.join(", ")
                ),
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
