//! The Marconi store for hybrid models: a radix tree over tokens whose nodes hold KV block
//! references and SSM checkpoints; admission (where to checkpoint), FLOP-aware eviction under a
//! strict byte budget, the checkpoint slot pool, tuning of the eviction score, and a trace-driven
//! simulator.
//!
//! A Mamba2 layer's state is updated in place and cannot be rolled back, so on a hybrid model a
//! cached prefix of length `L` is reusable only if an SSM checkpoint taken at exactly `L` exists.
//! [`SnapshotStore`] decides which checkpoints are worth their memory (Marconi, Pan et al.,
//! MLSys 2025, arXiv 2411.19379) and finds the longest usable hit. It owns no device memory: it
//! hands out ids of checkpoint slots ([`SlotId`]) in the router's checkpoint region and holds
//! references to KV blocks ([`kv_cache::BlockId`]); the router copies state and applies the
//! reference changes each call reports in a [`StoreDelta`] ([`StoreDelta::apply_to_pool`] does
//! it for a [`kv_cache::BlockPool`]).
//!
//! Beyond Marconi: guarded admission ([`StoreConfig::guard`]: when the working set is larger
//! than memory, a sequence that missed may only replace dead entries, or, for a conversation
//! coming back after it lost its entry, entries colder than it, so a stable part of the
//! working set stays cached instead of all of it cycling through), adaptive recency
//! ([`Recency::Adaptive`]: mid-sequence checkpoints count as used when requests go through them
//! only while the workload actually hits them), and a tuner that follows the best of 41 shadow
//! stores, plain LRU among them: the live store starts at LRU (or, when its first eviction comes
//! late, takes α = 0 with adaptive recency there), takes a leading shadow's setting only once a
//! trial of the switch on a copy of the live store (the transition included) led the live store
//! significantly, and goes back when it falls behind the LRU shadow ([`tuning`]).
//!
//! # Modules
//! - [`store`]: the tree, the hit rule, admission, eviction, the byte budget (invariants there);
//! - [`cost`]: FLOPs and bytes per prefix from layer counts and widths ([`CostModel`]; built
//!   in: the paper's 7B and Nemotron-H-8B);
//! - [`slots`]: the checkpoint slot pool;
//! - [`tuning`]: choosing α, the recency basis, the FLOP basis and guarded admission
//!   (Marconi's bootstrap replay, periodic replay, and shadow stores, the default);
//! - [`sim`]: the Marconi JSONL trace format and the replay behind the `simulate` example;
//! - [`generate`]: synthetic traces (chat, long replies, agentic, a mix, an adversarial one) and
//!   jittered copies of a trace (a few neighbouring requests reordered, to measure chaos);
//! - [`grid`]: the policy grid (trace families × seeds × capacities) and the check the default
//!   policy must pass on each cell;
//! - [`paper`]: a model of the Marconi artifact's own simulator (its SGLang+ and Marconi
//!   policies, with their exact tie orders and their capacity overshoot), the reference the
//!   `simulate` example scores our policies against.
//!
//! # How a router uses it
//!
//! Checkpoints sit at multiples of the router's block size `B`; partial last blocks are never
//! cached. One request, with its KV in a [`kv_cache::BlockPool`]:
//!
//! ```
//! use kv_cache::BlockPool;
//! use ssm_snapshot::{CostModel, Namespace, SnapshotStore, StoreConfig, StoreDelta};
//!
//! let cost = CostModel::nvidia_hybrid_7b();
//! // A checkpoint budget of 16 checkpoints, block size 4; as many slots as the budget holds.
//! let config = StoreConfig::engine(cost.clone(), 4, 16 * cost.checkpoint_bytes());
//! let mut store = SnapshotStore::new(config).unwrap();
//! let mut pool = BlockPool::new(32, 4).unwrap();
//! let mut delta = StoreDelta::default();
//!
//! let prompt: Vec<u32> = (0..10).collect();
//! // 1. Lookup with the prompt minus its last token (which is computed for logits). The hit
//! //    path is pinned until finish/release.
//! let mut hit_blocks = Vec::new();
//! let hit = store.lookup(Namespace::default(), &prompt[..prompt.len() - 1], &mut hit_blocks);
//! assert_eq!((hit.hit_tokens, hit.checkpoint, hit.branch_at), (0, None, None));
//! // (On a hit: take a reference on each of `hit_blocks` for the sequence, restore the SSM
//! // state from slot `hit.checkpoint`, prefill from `hit.hit_tokens`.)
//! // 2. If `hit.branch_at` is `Some(p)`: stop the prefill chunk at `p`, reserve a slot, copy
//! //    the state into it and `store.commit_branch(&hit.pin, &prompt, p, slot, &mut delta)`.
//! let mut table = Vec::new();
//! pool.allocate_many(3, &mut table).unwrap(); // 10 prompt tokens + 2 decoded = 3 blocks
//! let full: Vec<u32> = (0..12).collect();
//! // 3. On finish: the state at the last block boundary (12) goes into a reserved slot.
//! let slot = store.reserve_checkpoint(&mut delta).expect("room");
//! let end = *store.finish_positions(hit.hit_tokens, full.len()).end() * 4;
//! store.finish(hit.pin, &full, &table, &[(end, slot)], &mut delta).unwrap();
//! delta.apply_to_pool(&mut pool).unwrap(); // before the sequence drops its own references
//! for block in table {
//!     pool.release(block).unwrap();
//! }
//! assert_eq!(pool.used_blocks(), 3); // now held by the tree
//! // 4. Under KV pressure, ask the tree for blocks; it evicts unpinned leaves.
//! delta.clear();
//! assert_eq!(store.evict_for_kv(3, &mut delta), 3);
//! delta.apply_to_pool(&mut pool).unwrap();
//! assert_eq!(pool.free_blocks(), 32);
//! ```
//!
//! **Architecture Invariant:** this crate never names a device and never touches state memory.
#![forbid(unsafe_code)]

pub mod cost;
pub mod error;
pub mod generate;
pub mod grid;
pub mod paper;
pub mod sim;
pub mod slots;
pub mod store;
pub mod tuning;

pub use cost::{CostCoefficients, CostModel, HybridDims, BUILT_IN_MODELS};
pub use error::SnapshotError;
pub use slots::{SlotId, SlotPool, SlotState};
pub use store::{
    Admission, BranchOutcome, BudgetScope, CachedCheckpoint, FinishReport, FlopBasis, Hit,
    Namespace, Pin, PinScope, Recency, SnapshotStore, StoreConfig, StoreDelta, StoreStats,
    TreeBlock,
};
pub use tuning::{AlphaTuner, Objective, Setting, SwitchCause, TrialEnd, TunerEvent, TuningMode};

/// Compile-time check that the store and its handles can move between threads (a router is
/// `Send`).
const _: () = {
    const fn assert_send<T: Send>() {}
    assert_send::<SnapshotStore>();
    assert_send::<AlphaTuner>();
    assert_send::<Pin>();
    assert_send::<StoreDelta>();
};
