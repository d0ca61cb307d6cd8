//! The Marconi store for hybrid models: a radix tree over tokens whose nodes hold KV block
//! references and SSM checkpoints; admission (where to checkpoint), FLOP-aware eviction under a
//! strict byte budget, the checkpoint slot pool, α tuning, and a trace-driven simulator.
//!
//! A Mamba2 layer's state is updated in place and cannot be rolled back, so on a hybrid model a
//! cached prefix of length `L` is reusable only if an SSM checkpoint taken at exactly `L` exists.
//! [`SnapshotStore`] decides which checkpoints are worth their memory (Marconi, Pan et al.,
//! MLSys 2025, arXiv 2411.19379) and finds the longest usable hit. It owns no device memory: it
//! hands out ids of checkpoint slots ([`SlotId`]) in the router's checkpoint region and holds
//! references to KV blocks ([`kv_cache::BlockId`]); the router copies state and applies the
//! reference changes each call reports in a [`StoreDelta`]. See [`store`] for the router flow.
//!
//! **Architecture Invariant:** this crate never names a device and never touches state memory.
#![forbid(unsafe_code)]

pub mod cost;
pub mod error;
pub mod sim;
pub mod slots;
pub mod store;
pub mod tuning;

pub use cost::{CostCoefficients, CostModel, HybridDims};
pub use error::SnapshotError;
pub use slots::{SlotId, SlotPool, SlotState};
pub use store::{
    Admission, BranchOutcome, BudgetScope, CachedCheckpoint, FinishReport, FlopBasis, Hit,
    Namespace, Pin, Recency, SnapshotStore, StoreConfig, StoreDelta, StoreStats,
};
pub use tuning::{AlphaTuner, Objective, TuningMode};
