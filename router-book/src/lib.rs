//! The bookkeeping every router of the workspace keeps the same way, so that the host router
//! (`device-cpu`) and the CUDA router (`device-cuda`) make the same decisions and an image moves
//! between them:
//!
//! - [`seq`]: [`RouterSeq`], a router's per-sequence record (tokens, blocks, slot, tenure,
//!   checkpoints, reservation ledger), and [`LogitsHandle`];
//! - [`cache`]: [`Caches`], the KV block pool of `kv-cache` with the prefix index (the hash-chain
//!   prefix cache on an attention-only model, the Marconi tree of `ssm-snapshot` on a hybrid one);
//! - [`book`]: the effects' bookkeeping over a router's tables ([`BookMut`]): release with the
//!   cache offer, compaction, detaching, the reservation ledger, the snapshot ring, Marconi
//!   checkpoints, and the checks of a spill image; the device work stays the router's;
//! - [`plans`]: the plans' bookkeeping (`Prefill` with the prefix cache's attach, Marconi
//!   checkpoints restored and taken, chunking and blocks; `Decode` / `DecodeFed` with the fed
//!   inputs; the row checks), turned into an ordered list of device work the router runs;
//! - [`spec`]: the speculative plans' bookkeeping, in the same three phases (`Verify`: its
//!   checks, the blocks and reservation ledger entry of each row, the snapshot ring's entries;
//!   `Draft`: the MTP catch-up rings, the rows that draft, the blocks lent to draft positions);
//! - [`image`]: the spill image format, its writer and its validating reader;
//! - [`events`]: the prefix cache's events (`device_io`'s cache event bus) in kv-cache's
//!   hash-chain key scheme, whichever index holds the blocks;
//! - [`StepFaults`]: fault injection at the device, for soaks and recovery tests.
//!
//! It names no device: routers depend on it, it depends on the contract and the caches only.
#![forbid(unsafe_code)]

pub mod book;
pub mod cache;
pub mod events;
pub mod image;
pub mod plans;
pub mod seq;
pub mod spec;

pub use book::{BookMut, BookShape, PendingFeed, RingEntry, SlotOwner, Tenure, FED_PLACEHOLDER};
pub use cache::{
    Attach, CacheConfig, CacheStats, Caches, CheckpointSlot, HeadHit, HeadMark, HeadOffer,
    PinHandle,
};
pub use seq::{new_tenure, LogitsHandle, LoraBinding, Namespace, Reservation, RouterSeq};

/// Fault injection at the device, for soaks and recovery tests: a router given one asks it once
/// per launched step (with the step's ticket, at launch, after the bookkeeping committed) whether
/// the step's device work fails. A failing step runs, then everything it wrote (the K/V of the
/// positions it computed, every state row and stored hidden row it wrote) is overwritten with
/// garbage, and it fails as a device error after the commit does: `DeviceError::Failed` in phase
/// `Forward` (from `await_result`, or from `launch` for a synchronous step), its rows marked
/// failed. So what a router does after a real device error (nothing of the step cached, its
/// rows' blocks and slots freed) is what a soak checks.
#[derive(Clone)]
pub struct StepFaults(std::sync::Arc<dyn Fn(u64) -> bool + Send + Sync>);

impl StepFaults {
    /// Fails the steps whose ticket `fails` answers `true` for.
    pub fn new(fails: impl Fn(u64) -> bool + Send + Sync + 'static) -> Self {
        StepFaults(std::sync::Arc::new(fails))
    }

    /// Whether the step with ticket `ticket` fails.
    pub fn fails(&self, ticket: u64) -> bool {
        (self.0)(ticket)
    }
}

impl std::fmt::Debug for StepFaults {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("StepFaults")
    }
}

/// The value a step failed by [`StepFaults`] leaves in every float it wrote.
pub const FAULT_GARBAGE: f32 = 0.5;

/// Why the bookkeeping could not be built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BookError {
    /// A size is out of range.
    #[error("invalid router config: {field} = {value} ({limit})")]
    BadConfig {
        /// The field.
        field: &'static str,
        /// Its value.
        value: u64,
        /// The limit it broke.
        limit: String,
    },
    /// A cache structure refused its sizes.
    #[error("cache: {0}")]
    Cache(String),
}
