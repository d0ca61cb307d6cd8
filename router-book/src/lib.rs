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
//!   hash-chain key scheme, whichever index holds the blocks.
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
