//! The checkpoint store: one radix tree over token ids per cache namespace, whose nodes hold
//! references to KV blocks and SSM checkpoints; admission, FLOP-aware eviction and the strict
//! byte budget.
//!
//! # The tree
//!
//! A node is an edge of tokens (a whole number of blocks of `block_size` tokens), the KV block ids
//! of those tokens (one per block), and at most one checkpoint: the SSM state after the edge's last
//! token, held in a checkpoint slot. A node's depth (`end`) is the number of tokens from the root
//! to the end of its edge. Children are keyed by the hash of their first block.
//!
//! Each node also keeps two times: `last_access` (the last time a request's path went through
//! it; the candidate order, so plain LRU pops the first candidate) and `last_hit` (the last time
//! it was a hit or got its checkpoint; used when the recency basis is [`Recency::Own`]).
//!
//! Invariants (checked by [`SnapshotStore::check_invariants`]):
//! - every non-root node has a checkpoint or at least two children (a bare node with one child is
//!   merged into the child at once, a bare leaf never exists), so every leaf holds a checkpoint;
//!   the one exception, under [`PinScope::HitCheckpoint`], is a pinned node with one child whose
//!   checkpoint was evicted: it merges into its child when its last pin goes;
//! - a node's `pins` is the number of running sequences ([`Pin`]s) whose hit path passes through
//!   it, so a pinned node's ancestors are pinned too and an unpinned node's subtree is unpinned;
//!   its `locks` (at most `pins`) count the pins that hold its checkpoint: a pin holds the KV of
//!   its whole path and, under [`PinScope::Path`] (the default), every checkpoint on it; under
//!   [`PinScope::HitCheckpoint`] only its hit node's, the state its sequence restores;
//! - eviction candidates are exactly the non-root nodes with no locks, at most one child and a
//!   checkpoint (a pinned one loses only its checkpoint); candidates are ordered by (last
//!   access, deeper first);
//! - the tree holds exactly one reference on each block id listed in its nodes: it asks for a
//!   reference in [`StoreDelta::retain_blocks`] when it adopts a block and gives it back in
//!   [`StoreDelta::release_blocks`];
//! - after every public call, [`SnapshotStore::bytes`] (checkpoints held or reserved, plus the KV
//!   of the tree's blocks when the budget covers KV) is at most the budget.
//!
//! # Hit rule
//!
//! A request's hit is the deepest node on its path whose edge it matches completely and that holds
//! a checkpoint; the hit length is that node's depth. There is no state inside an edge, so a
//! partially matched edge gives nothing. Every node holds the KV of its edge, so the KV of the
//! whole path `0..hit` is always present.
//!
//! # Admission
//!
//! [`Admission::Marconi`] checkpoints (a) the branch point a lookup reveals: the block-aligned
//! position where the request leaves the tree strictly inside an edge (the position becomes a
//! node with two children), or at an existing node that has no checkpoint (one whose branch
//! checkpoint was never taken); and (b) the end of each finished sequence's full blocks (the next
//! turn of a conversation extends input + output). Nothing else. [`Admission::EveryBlock`]
//! checkpoints every block boundary after the hit, as vLLM's align mode does; it floods memory
//! with states that are never hit and is there for comparison.
//!
//! Guarded admission ([`StoreConfig::guard`]) restricts what a sequence that missed may
//! displace: only dead entries (unused for longer than 1.5 times the 90th percentile of recent
//! hit ages). Its reservations ([`SnapshotStore::reserve_checkpoint_for`]) are refused rather
//! than evict a live entry, and the checkpoints it brings (the `newcomers` since the latest
//! lookup) are the first victims when room is needed. Against LRU thrashing: when the working
//! set is larger than memory, a stable part of it stays cached. A conversation that lost its
//! entry and comes back (a returning sequence, below) may also take the room of entries unused
//! for longer than twice its own dead age: otherwise, once the working set fits again, a
//! conversation kept out stays out while the cache holds the entries of conversations that
//! have ended (the short-trace scan's mix, 30 sessions, seed 9, 2 GB: the last conversation
//! missed 11 turns in a row that LRU hit, and the store ended 0.04 below LRU).
//!
//! # Eviction
//!
//! Candidates (see the invariants) get the score `recency + α · efficiency`, both min-max
//! normalised across the candidates, efficiency being FLOPs per byte ([`FlopBasis`]): the
//! whole prefix's FLOPs over the bytes the node's eviction frees, or the FLOPs since the nearest
//! checkpointed ancestor over the bytes the node holds (its checkpoint plus the KV of its edge).
//! The lowest score goes: a leaf frees its checkpoint and KV; a node with one child frees its
//! checkpoint only and merges into the child, which keeps the KV. With
//! α = 0 and [`Recency::Path`] this is SGLang's LRU, served from the ordered candidate set in
//! O(log n); otherwise one pass over the candidates. The recency term is the last time a path
//! went through the node ([`Recency::Path`]) or the last time the node itself was hit
//! ([`Recency::Own`]; [`Recency::Shared`] and [`Recency::Adaptive`] add some pass-throughs).
//! Under guarded admission dead entries go first, then (for a returning sequence, below) entries
//! colder than its conversation, then newcomers, then the score order.
//! Eviction runs when a checkpoint slot is
//! reserved and the budget (or the slot pool) is full, after a finish adds KV under a budget
//! that covers KV, and on [`SnapshotStore::evict_for_kv`] (leaves only: only they free KV).
//!
//! A returning sequence. Without the guard, an α > 0 score can evict the entry a request has
//! just inserted at that request's own finish (a fresh leaf whose efficiency is the lowest), and
//! when its conversation's next turn comes it misses and loses its new entry the same way, turn
//! after turn, while the cache keeps entries nobody has used for far longer. So the store
//! remembers such a sequence (a *ghost*: namespace, length, tokens' hash; only for as long as
//! the dead age, at most 128 of them), and a lookup whose tokens extend a ghost is
//! its conversation coming back after a gap `g` (clock ticks since the ghost's finish). For that
//! sequence's reservations and finish, entries unused for longer than 1.5 · `g` (its own dead
//! age, as the global one is 1.5 times the 90th percentile of hit ages) go first, least recently
//! used first, then the score order. Under LRU this is the order anyway. Under guarded admission
//! dead entries go first, then those unused for longer than twice its own dead age, then the
//! guard's own rules (with the unguarded 1.5 · `g`, returning conversations broke up the stable
//! part the guard keeps on chat traces: see `GUARDED_RETURN_FACTOR`).
//!
//! # Router flow
//!
//! 1. [`SnapshotStore::lookup`] with the tokens whose state the router may reuse (the prompt
//!    without its last token, which must be computed for logits): the hit length, the KV blocks of
//!    `0..hit`, the checkpoint slot to restore, and the branch point (Marconi admission: where the
//!    request leaves the tree strictly inside an edge, or at a node without a checkpoint). The hit
//!    path is pinned: it is not evicted until the [`Pin`] is finished or released (under
//!    [`PinScope::HitCheckpoint`] the checkpoints above the hit may go, keeping their KV).
//! 2. When prefill reaches the branch point, the router reserves a slot
//!    ([`SnapshotStore::reserve_checkpoint`]), copies the SSM state into it, and calls
//!    [`SnapshotStore::commit_branch`].
//! 3. On finish, [`SnapshotStore::finish`] with the sequence's tokens (input + output), its block
//!    table, and the checkpoints it took (the end of its full blocks, reserved the same way); the
//!    pin is released.
//! 4. [`SnapshotStore::evict_for_kv`] when the KV pool runs dry. Every mutating call appends to a
//!    [`StoreDelta`]: block references to take and to drop (apply `retain_blocks` first), and the
//!    checkpoint slots that are free again.

use std::collections::{BTreeSet, HashMap};

use kv_cache::BlockId;
use xxhash_rust::xxh3::xxh3_64;

use crate::cost::CostModel;
use crate::error::SnapshotError;
use crate::slots::{SlotId, SlotPool};

const NONE: u32 = u32::MAX;

/// How many recent hit ages the dead age is estimated from, and how many ghosts are kept.
const HIT_AGE_RING: usize = 128;

/// Under guarded admission, a returning sequence that missed may take the room of entries
/// unused for longer than this many times its own dead age (see the module docs). 1 (the
/// unguarded rule) and 4 were measured too, with α 0 and 1 guarded and fixed on the policy
/// grid's traces (chat, long replies, agentic, mix, sharegpt, shifting; seeds 1-3; 0.5-5 GB;
/// see the crate report): mean token hit rate against the guard without the rule +0.0245, +0.0272
/// (this), +0.0236; chat alone -0.0131, -0.0018, -0.0001.
const GUARDED_RETURN_FACTOR: u64 = 2;

/// The most checkpoint slots a store manages (16 Mi: far beyond any device's memory at tens of
/// MB per checkpoint; the bound keeps the slot table's host memory in check).
pub const MAX_SLOTS: u32 = 1 << 24;

/// A cache namespace: sequences only share prefixes within one LoRA adapter and cache salt.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct Namespace {
    /// LoRA adapter id (0 for the base model).
    pub adapter: u32,
    /// Cache salt (isolates tenants; 0 for none).
    pub salt: u64,
}

/// Where checkpoints are taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    /// Marconi's speculative insertion: at branch points a lookup reveals, and at the end of each
    /// finished sequence.
    Marconi,
    /// Every block boundary of a new sequence (vLLM's align mode extended to hybrids).
    EveryBlock,
}

/// Which FLOPs saved, over which bytes, a node's FLOP efficiency counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FlopBasis {
    /// The FLOPs of the node's whole prefix (Marconi's definition), over the bytes evicting the
    /// node frees: its checkpoint, plus the KV of its edge when it is a leaf (a node with one
    /// child merges into the child, which keeps the KV). Counting that KV made a shared prefix
    /// that every request hits, with one cached conversation below it, the least efficient
    /// entry at small capacities: evicted, re-admitted and evicted again on every request.
    Prefix,
    /// The FLOPs between the nearest checkpointed ancestor and the node, what evicting it loses
    /// when hits fall back to that ancestor, over the bytes the node holds (its checkpoint plus
    /// the KV of its edge): the edge's own FLOPs per byte. (Over the bytes its eviction frees,
    /// as for `Prefix`, more cells fell below LRU: ssm-snapshot/MEASUREMENTS.md, session 13.)
    Marginal,
}

impl FlopBasis {
    /// Its name in reports and on command lines: `prefix` or `marginal`.
    pub const fn name(self) -> &'static str {
        match self {
            FlopBasis::Prefix => "prefix",
            FlopBasis::Marginal => "marginal",
        }
    }
}

impl std::fmt::Display for FlopBasis {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Which time a candidate's recency term uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Recency {
    /// The last time any request's path went through the node (SGLang's and Marconi's LRU):
    /// a node is never older than its descendants.
    Path,
    /// The last time the node's own checkpoint was hit or admitted. A checkpoint in the middle
    /// of a conversation is only useful to a request that diverges exactly there, so the turns
    /// that go through it to a deeper hit do not refresh it.
    Own,
    /// [`Recency::Own`], and a request going through the node while it is a branch point (two
    /// or more children) refreshes it too: a prefix that several conversations share (a system
    /// prompt, a repository) stays as fresh as its use, a checkpoint in the middle of one
    /// conversation does not.
    Shared,
    /// [`Recency::Shared`] while few hits land in the middle of cached sequences, [`Recency::Path`]
    /// while many do (more than 5% of recent hits, an exponential average over about 64 hits):
    /// workloads that edit or regenerate their history reuse middle checkpoints, chat that only
    /// extends it does not.
    Adaptive,
}

impl Recency {
    /// Its name in reports and on command lines: `path`, `own`, `shared` or `adaptive`.
    pub const fn name(self) -> &'static str {
        match self {
            Recency::Path => "path",
            Recency::Own => "own",
            Recency::Shared => "shared",
            Recency::Adaptive => "adaptive",
        }
    }
}

impl std::fmt::Display for Recency {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Which checkpoints a running sequence's [`Pin`] holds (its hit path's KV is always held).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PinScope {
    /// Every checkpoint on the hit path: nothing on it is evicted while the sequence runs.
    #[default]
    Path,
    /// Only the hit checkpoint, the state the sequence restores: the checkpoints above it serve
    /// other requests, not this one, and may go (checkpoint only; the KV stays). What the
    /// paper's cache and SGLang do (neither pins). It matters when a checkpoint is large against
    /// the budget: at Nemotron-H-56B's costs (a checkpoint weighs 11,275 tokens of KV) a 2 GB
    /// store holds four, and a returning conversation whose path held three could never
    /// checkpoint its new end, so its next turns hit the old end again. Not the default: the
    /// tuner's constants were chosen under `Path`, and under this scope it falls below `lru` on
    /// more short traces (ssm-snapshot/MEASUREMENTS.md, session 19).
    HitCheckpoint,
}

/// What the byte budget covers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BudgetScope {
    /// Checkpoints only (the engine: KV is bounded by the block pool and freed with
    /// [`SnapshotStore::evict_for_kv`]).
    Checkpoints,
    /// Checkpoints plus the KV of the tree's blocks (Marconi's simulator: one memory pool).
    CheckpointsAndKv,
}

/// Store configuration. Public fields: [`SnapshotStore::new`] checks them.
#[derive(Debug, Clone)]
pub struct StoreConfig {
    /// Tokens per KV block; checkpoints sit only at multiples of it (1 = token granularity).
    pub block_size: u32,
    /// Checkpoint slots in the router's prefix-cache region.
    pub checkpoint_slots: u32,
    /// The byte budget (see [`BudgetScope`]); it holds after every call.
    pub budget_bytes: u64,
    /// What the budget covers.
    pub budget_scope: BudgetScope,
    /// Admission policy.
    pub admission: Admission,
    /// Weight of FLOP efficiency against recency in the eviction score (0 = LRU).
    pub alpha: f64,
    /// How FLOPs saved are counted.
    pub flop_basis: FlopBasis,
    /// Which time the recency term uses.
    pub recency: Recency,
    /// Guarded admission, against LRU thrashing when the working set is larger than memory: a
    /// sequence that missed (a new conversation, or one evicted since) may take the place of
    /// dead entries only, those not used for longer than reuses take (1.5 times the 90th
    /// percentile of recent hit ages), never of live ones, unless it is a conversation that lost
    /// its entry coming back (then also of entries colder than it: see the module docs). Its
    /// checkpoints are refused or are the first victims. Sequences that hit (conversations the
    /// cache serves) are admitted as usual. A stable part of the working set then stays cached
    /// instead of all of it cycling through.
    /// With fewer than 16 hits observed everything counts as dead (plain admission).
    /// A tuner chooses it per workload.
    pub guard: bool,
    /// Which checkpoints a running sequence's pin holds.
    pub pin_scope: PinScope,
    /// Costs of the model served.
    pub cost: CostModel,
}

impl StoreConfig {
    /// An engine configuration: Marconi admission, a checkpoint-only budget of `budget_bytes`, as
    /// many slots as the budget holds, α = 0 with [`Recency::Adaptive`], plain admission, until
    /// an [`AlphaTuner`](crate::AlphaTuner) changes the setting.
    pub fn engine(cost: CostModel, block_size: u32, budget_bytes: u64) -> Self {
        let slots = (budget_bytes / cost.checkpoint_bytes()).min(u64::from(MAX_SLOTS)) as u32;
        Self {
            block_size,
            checkpoint_slots: slots,
            budget_bytes,
            budget_scope: BudgetScope::Checkpoints,
            admission: Admission::Marconi,
            alpha: 0.0,
            flop_basis: FlopBasis::Marginal,
            recency: Recency::Adaptive,
            guard: false,
            pin_scope: PinScope::Path,
            cost,
        }
    }
}

/// Changes the caller applies to its block pool and checkpoint region. Reuse one across calls
/// (`clear` it) so the hot path does not allocate.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StoreDelta {
    /// Blocks the tree now references: take one reference on each (before releasing).
    pub retain_blocks: Vec<BlockId>,
    /// Blocks the tree no longer references: drop one reference on each.
    pub release_blocks: Vec<BlockId>,
    /// Checkpoint slots whose contents are no longer needed (evicted or dropped duplicates).
    pub freed_slots: Vec<SlotId>,
}

impl StoreDelta {
    /// Empties all three lists, keeping their capacity.
    pub fn clear(&mut self) {
        self.retain_blocks.clear();
        self.release_blocks.clear();
        self.freed_slots.clear();
    }

    /// Applies the block references to `pool`: every retain, then every release. Apply a
    /// finish's delta before the finished sequence drops its own references, so that the blocks
    /// the tree adopts are still held when it retains them. On an error nothing is changed: a
    /// failed retain undoes the retains before it, and releases are checked (each block held)
    /// before the first one.
    pub fn apply_to_pool(&self, pool: &mut kv_cache::BlockPool) -> Result<(), kv_cache::KvError> {
        for (i, &block) in self.retain_blocks.iter().enumerate() {
            if let Err(e) = pool.retain(block) {
                for &done in &self.retain_blocks[..i] {
                    // Undoing a retain that just succeeded cannot fail.
                    let _ = pool.release(done);
                }
                return Err(e);
            }
        }
        if let Some(&block) = self
            .release_blocks
            .iter()
            .find(|&&b| pool.ref_count(b) == 0)
        {
            for &done in &self.retain_blocks {
                let _ = pool.release(done);
            }
            return Err(kv_cache::KvError::NotHeld { block });
        }
        for &block in &self.release_blocks {
            pool.release(block)?;
        }
        Ok(())
    }

    /// Whether nothing changed.
    pub fn is_empty(&self) -> bool {
        self.retain_blocks.is_empty()
            && self.release_blocks.is_empty()
            && self.freed_slots.is_empty()
    }
}

/// A running sequence's hold on its hit path. Consumed by [`SnapshotStore::finish`] or
/// [`SnapshotStore::release`]; not `Clone`, so it is given back exactly once.
#[derive(Debug, PartialEq, Eq)]
pub struct Pin {
    index: u32,
    generation: u32,
}

/// The answer to a lookup.
#[derive(Debug, PartialEq, Eq)]
pub struct Hit {
    /// Holds the hit path until finish or release.
    pub pin: Pin,
    /// Reusable prefix length, a multiple of the block size.
    pub hit_tokens: usize,
    /// The slot holding the SSM state at `hit_tokens` (`None` when `hit_tokens` is 0).
    pub checkpoint: Option<SlotId>,
    /// Where to checkpoint during prefill (Marconi admission): the block-aligned position where
    /// the request leaves the tree, when that is strictly inside an edge or at a node without a
    /// checkpoint. Always greater than `hit_tokens`.
    pub branch_at: Option<usize>,
    /// How many leading tokens (block-aligned) match the tree, hit or not.
    pub matched_tokens: usize,
}

/// What became of a branch checkpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BranchOutcome {
    /// Now cached at the branch point.
    Admitted,
    /// A checkpoint at that position already existed; the slot was freed.
    Duplicate,
    /// The path to the branch point was evicted meanwhile; the slot was freed.
    PathGone,
}

/// What a finish inserted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct FinishReport {
    /// Tokens added to the tree (new edges).
    pub inserted_tokens: usize,
    /// Checkpoints attached to nodes.
    pub admitted_checkpoints: usize,
    /// Checkpoints dropped because one existed at the position (or a hash collision).
    pub dropped_checkpoints: usize,
}

/// Counters since creation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct StoreStats {
    /// Lookups served.
    pub lookups: u64,
    /// Lookups with a non-zero hit.
    pub hits: u64,
    /// Sum of hit lengths.
    pub hit_tokens: u64,
    /// Hits on a node with exactly one child: a checkpoint in the middle of a cached sequence,
    /// reached by a request that diverges there (an edited history, a regenerated turn).
    pub mid_hits: u64,
    /// Leaves evicted (checkpoint and KV freed).
    pub evicted_leaves: u64,
    /// Single-child nodes evicted (checkpoint freed, node merged into its child).
    pub evicted_checkpoints_only: u64,
    /// Checkpoints attached to nodes.
    pub admitted_checkpoints: u64,
    /// Checkpoints dropped (duplicates, path gone, collisions).
    pub dropped_checkpoints: u64,
}

/// One block reference of the tree as [`SnapshotStore::visit_blocks`] shows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TreeBlock<'a> {
    /// The namespace of the tree that holds it.
    pub namespace: Namespace,
    /// The block before it in its sequence (`None` for a first block).
    pub parent: Option<BlockId>,
    /// The block.
    pub block: BlockId,
    /// Its tokens (`block_size` of them).
    pub tokens: &'a [u32],
}

/// A cached checkpoint as [`SnapshotStore::cached_checkpoints`] lists it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct CachedCheckpoint {
    /// Its namespace.
    pub namespace: Namespace,
    /// The tokens whose state it holds.
    pub tokens: Vec<u32>,
    /// Its slot.
    pub slot: SlotId,
}

#[derive(Debug, Clone)]
struct Node {
    namespace: Namespace,
    /// `NONE` for a root.
    parent: u32,
    /// Tokens before this edge.
    start: usize,
    tokens: Vec<u32>,
    blocks: Vec<BlockId>,
    /// Hash of the first block; the node's key in `children` under its parent.
    key: u64,
    children: Vec<u32>,
    checkpoint: Option<SlotId>,
    pins: u32,
    /// Pins that hold its checkpoint (see [`PinScope`]): those whose hit node it is (the state
    /// their sequences restore) and, under [`PinScope::Path`], every pin through it. At most
    /// `pins`.
    locks: u32,
    /// Last time a request's path went through the node (the candidate order).
    last_access: u64,
    /// Last time the node was a lookup's hit or got its checkpoint.
    last_hit: u64,
    /// The node's key in `candidates`, present iff it is a candidate.
    candidate: Option<(u64, usize, u32)>,
    /// When the checkpoint was attached (the store's clock).
    admitted: u64,
    live: bool,
}

impl Node {
    fn end(&self) -> usize {
        self.start + self.tokens.len()
    }
}

#[derive(Debug, Clone)]
struct PinRecord {
    generation: u32,
    /// The hit node (or the root); `NONE` when the record is free.
    node: u32,
    root: u32,
    /// The sequence extends a ghost: entries unused for longer than this make room for it first.
    returning: Option<u64>,
}

/// A sequence that lost its own new entry at its own finish (or could not reserve one): see
/// "A returning sequence" in the module docs.
#[derive(Debug, Clone)]
struct Ghost {
    namespace: Namespace,
    /// Its length (a whole number of blocks).
    end: usize,
    /// Its last block (a cheap first test) and the hash of all its tokens.
    last_block: Vec<u32>,
    hash: u64,
    /// Its finish (the store's clock).
    at: u64,
}

/// How a walk down the tree ended.
#[derive(Debug, Clone, Copy)]
enum Stop {
    /// All tokens were consumed exactly at the end of the walk's node.
    End,
    /// No child continues with the next block.
    Leave,
    /// `matched` tokens (a whole number of blocks, less than the edge) of `child`'s edge match;
    /// the tokens then differ (`diverged`) or end.
    InEdge {
        child: u32,
        matched: usize,
        diverged: bool,
    },
}

#[derive(Debug, Clone, Copy)]
struct Walk {
    /// The deepest node whose edge was matched completely.
    node: u32,
    /// Its depth.
    depth: usize,
    stop: Stop,
}

/// The Marconi checkpoint store. See the module docs for the invariants and the router flow.
#[derive(Debug, Clone)]
pub struct SnapshotStore {
    config: StoreConfig,
    block: usize,
    nodes: Vec<Node>,
    free_nodes: Vec<u32>,
    roots: HashMap<Namespace, u32>,
    children: HashMap<(u32, u64), u32>,
    candidates: BTreeSet<(u64, usize, u32)>,
    slots: SlotPool,
    pins: Vec<PinRecord>,
    free_pins: Vec<u32>,
    clock: u64,
    held_blocks: u64,
    pinned_checkpoints: u64,
    pinned_blocks: u64,
    stats: StoreStats,
    scratch_path: Vec<u32>,
    scratch_scores: Vec<(u32, u64, f64)>,
    scratch_slots: Vec<SlotId>,
    /// Guarded admission: nodes that got a checkpoint from a sequence that missed, since the
    /// latest lookup (may hold stale ids; `admitted > lookup_clock` tells which are current).
    newcomers: Vec<u32>,
    /// The clock at the latest lookup.
    lookup_clock: u64,
    /// While inserting for a sequence that missed under guarded admission.
    guarding: bool,
    /// The ages (clock ticks since last use) of the latest hits, a ring.
    hit_ages: Vec<u64>,
    /// Next slot of `hit_ages` to write.
    hit_age_at: usize,
    /// Reused buffer for the percentile of `hit_ages`.
    scratch_ages: Vec<u64>,
    /// Entries unused for longer than this are dead (1.5 times the 90th percentile of
    /// `hit_ages`).
    dead_after: u64,
    /// Exponential average of the fraction of hits on a node with one child.
    mid_rate: f64,
    /// Sequences that lost their own new entry, oldest first (none older than the dead age).
    ghosts: Vec<Ghost>,
    /// While reserving or finishing for a returning sequence: its own dead age.
    returning: Option<u64>,
}

/// Hash of one block of tokens: the key of a child under its parent.
fn block_key(tokens: &[u32]) -> u64 {
    xxh3_64(bytemuck::cast_slice(tokens))
}

/// Length of the common prefix of `a` and `b`.
fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

impl SnapshotStore {
    /// A store with an empty tree and all slots free.
    pub fn new(config: StoreConfig) -> Result<Self, SnapshotError> {
        if config.block_size == 0 {
            return Err(SnapshotError::BadConfig {
                field: "block_size",
                value: "0".into(),
                limit: "at least 1",
            });
        }
        check_alpha(config.alpha)?;
        if config.checkpoint_slots > MAX_SLOTS {
            return Err(SnapshotError::BadConfig {
                field: "checkpoint_slots",
                value: config.checkpoint_slots.to_string(),
                limit: "at most 16777216",
            });
        }
        let slots = SlotPool::new(config.checkpoint_slots);
        Ok(Self {
            block: config.block_size as usize,
            config,
            nodes: Vec::new(),
            free_nodes: Vec::new(),
            roots: HashMap::new(),
            children: HashMap::new(),
            candidates: BTreeSet::new(),
            slots,
            pins: Vec::new(),
            free_pins: Vec::new(),
            clock: 0,
            held_blocks: 0,
            pinned_checkpoints: 0,
            pinned_blocks: 0,
            stats: StoreStats::default(),
            scratch_path: Vec::new(),
            scratch_scores: Vec::new(),
            scratch_slots: Vec::new(),
            newcomers: Vec::new(),
            lookup_clock: 0,
            guarding: false,
            hit_ages: Vec::new(),
            hit_age_at: 0,
            scratch_ages: Vec::new(),
            dead_after: 0,
            mid_rate: 0.0,
            ghosts: Vec::new(),
            returning: None,
        })
    }

    /// The configuration (α as currently set).
    pub fn config(&self) -> &StoreConfig {
        &self.config
    }

    /// Sets α (the weight of FLOP efficiency in eviction scores).
    pub fn set_alpha(&mut self, alpha: f64) -> Result<(), SnapshotError> {
        check_alpha(alpha)?;
        self.config.alpha = alpha;
        Ok(())
    }

    /// Turns guarded admission on or off (see [`StoreConfig::guard`]).
    pub fn set_guard(&mut self, guard: bool) {
        self.config.guard = guard;
        self.newcomers.clear();
    }

    /// Sets which time the recency term of eviction scores uses.
    pub fn set_recency(&mut self, recency: Recency) {
        self.config.recency = recency;
    }

    /// Which nodes a request going through refreshes in `last_hit`: (branch points, all).
    fn refresh_rule(&self) -> (bool, bool) {
        match self.config.recency {
            Recency::Shared => (true, false),
            Recency::Adaptive if self.mid_rate > 0.05 => (true, true),
            Recency::Adaptive => (true, false),
            Recency::Path | Recency::Own => (false, false),
        }
    }

    /// Sets how the FLOP-efficiency term counts FLOPs saved.
    pub fn set_flop_basis(&mut self, flop_basis: FlopBasis) {
        self.config.flop_basis = flop_basis;
    }

    /// Counters since creation.
    pub fn stats(&self) -> StoreStats {
        self.stats
    }

    /// The checkpoint slot pool.
    pub fn slots(&self) -> &SlotPool {
        &self.slots
    }

    /// Bytes counted against the budget: checkpoints cached or reserved, plus the KV of the
    /// tree's blocks when the budget covers KV.
    pub fn bytes(&self) -> u64 {
        let checkpoints = u64::from(self.slots.cached_count() + self.slots.reserved_count());
        let mut bytes = checkpoints * self.config.cost.checkpoint_bytes();
        if self.config.budget_scope == BudgetScope::CheckpointsAndKv {
            bytes += self.held_blocks * self.kv_bytes_per_block();
        }
        bytes
    }

    /// KV bytes of the blocks the tree references (whether or not the budget covers them).
    pub fn kv_bytes(&self) -> u64 {
        self.held_blocks * self.kv_bytes_per_block()
    }

    /// Number of block references the tree holds.
    pub fn held_block_count(&self) -> u64 {
        self.held_blocks
    }

    /// Live nodes, roots included.
    pub fn node_count(&self) -> usize {
        self.nodes.len() - self.free_nodes.len()
    }

    fn kv_bytes_per_block(&self) -> u64 {
        self.config.cost.kv_bytes_per_token() * self.block as u64
    }

    fn full_len(&self, tokens: usize) -> usize {
        tokens / self.block * self.block
    }

    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    /// Looks `tokens` up in `namespace`: the hit, the KV blocks of `0..hit` (written to
    /// `blocks_out`, which is cleared first), the checkpoint at the hit and the branch point.
    /// Pins the hit path and marks it used. Only whole blocks of `tokens` are matched; a router
    /// passes the prompt without its last token so at least one token is computed.
    pub fn lookup(
        &mut self,
        namespace: Namespace,
        tokens: &[u32],
        blocks_out: &mut Vec<BlockId>,
    ) -> Hit {
        blocks_out.clear();
        let now = self.tick();
        self.lookup_clock = now;
        self.newcomers.clear();
        let root = self.root_for(namespace, now);
        let n = self.full_len(tokens.len());
        let walk = self.walk(root, &tokens[..n]);
        let mut hit = walk.node;
        while hit != root && self.nodes[hit as usize].checkpoint.is_none() {
            hit = self.nodes[hit as usize].parent;
        }
        let hit_tokens = if hit == root {
            0
        } else {
            self.nodes[hit as usize].end()
        };
        let marconi = self.config.admission == Admission::Marconi;
        let (branch_at, matched_tokens) = match walk.stop {
            Stop::InEdge {
                matched, diverged, ..
            } => (
                if marconi && diverged {
                    Some(walk.depth + matched)
                } else {
                    None
                },
                walk.depth + matched,
            ),
            Stop::Leave => {
                let bare = walk.node != root && self.nodes[walk.node as usize].checkpoint.is_none();
                (
                    if marconi && bare {
                        Some(walk.depth)
                    } else {
                        None
                    },
                    walk.depth,
                )
            }
            Stop::End => (None, walk.depth),
        };
        // Collect the hit path root-first; pin it and mark it used.
        let mut path = std::mem::take(&mut self.scratch_path);
        path.clear();
        let mut at = hit;
        while at != NONE {
            path.push(at);
            at = self.nodes[at as usize].parent;
        }
        if hit != root {
            let age = now - self.nodes[hit as usize].last_access;
            self.note_hit_age(age);
            let mid = self.nodes[hit as usize].children.len() == 1;
            self.stats.mid_hits += u64::from(mid);
            self.mid_rate += (f64::from(u8::from(mid)) - self.mid_rate) / 64.0;
        }
        let (shared, whole) = self.refresh_rule();
        let whole_path = self.config.pin_scope == PinScope::Path;
        for &id in path.iter().rev() {
            let node = &mut self.nodes[id as usize];
            blocks_out.extend_from_slice(&node.blocks);
            node.last_access = now;
            if whole || (shared && node.children.len() >= 2) {
                node.last_hit = now;
            }
            self.pin_node(id, whole_path || id == hit);
        }
        self.scratch_path = path;
        self.nodes[hit as usize].last_hit = now;
        let returning = if self.ghosts.is_empty() {
            None
        } else {
            self.returning_gap(namespace, &tokens[..n], now)
        };
        let pin = self.new_pin(hit, root, returning);
        self.stats.lookups += 1;
        if hit_tokens > 0 {
            self.stats.hits += 1;
            self.stats.hit_tokens += hit_tokens as u64;
        }
        let checkpoint = if hit == root {
            None
        } else {
            self.nodes[hit as usize].checkpoint
        };
        Hit {
            pin,
            hit_tokens,
            checkpoint,
            branch_at,
            matched_tokens,
        }
    }

    /// Reserves a checkpoint slot for the router to copy a sequence's SSM state into, evicting as
    /// needed so that the budget holds with it counted. `None` (with nothing evicted) when even
    /// evicting every unpinned node would not make room: pinned paths and other reservations
    /// hold the memory. Give the slot back with [`commit_branch`](Self::commit_branch),
    /// [`finish`](Self::finish) or [`cancel_checkpoint`](Self::cancel_checkpoint).
    pub fn reserve_checkpoint(&mut self, delta: &mut StoreDelta) -> Option<SlotId> {
        self.reserve(true, delta)
    }

    /// [`SnapshotStore::reserve_checkpoint`] for the sequence holding `pin`: under guarded
    /// admission ([`StoreConfig::guard`]) a sequence that missed may only take the room of dead
    /// entries, so this returns `None` rather than evict a live one.
    pub fn reserve_checkpoint_for(
        &mut self,
        pin: &Pin,
        delta: &mut StoreDelta,
    ) -> Result<Option<SlotId>, SnapshotError> {
        let record = self.pin_record(pin)?;
        let members = !self.config.guard || record.node != record.root;
        self.returning = record.returning;
        let slot = self.reserve(members, delta);
        self.returning = None;
        Ok(slot)
    }

    fn reserve(&mut self, members: bool, delta: &mut StoreDelta) -> Option<SlotId> {
        let checkpoint_bytes = self.config.cost.checkpoint_bytes();
        let least_checkpoints =
            self.pinned_checkpoints + u64::from(self.slots.reserved_count()) + 1;
        if least_checkpoints > u64::from(self.slots.len()) {
            return None;
        }
        let mut least_bytes = least_checkpoints * checkpoint_bytes;
        if self.config.budget_scope == BudgetScope::CheckpointsAndKv {
            least_bytes += self.pinned_blocks * self.kv_bytes_per_block();
        }
        if least_bytes > self.config.budget_bytes {
            return None;
        }
        while self.slots.free_count() == 0
            || self.bytes() + checkpoint_bytes > self.config.budget_bytes
        {
            let victim = self.pick_victim(false, members)?;
            self.evict(victim, delta);
        }
        self.slots.reserve()
    }

    /// Gives back a reserved slot that will not be committed.
    pub fn cancel_checkpoint(&mut self, slot: SlotId) -> Result<(), SnapshotError> {
        self.slots.check_reserved(slot)?;
        self.slots.free(slot);
        Ok(())
    }

    /// Admits the checkpoint the router took at `pos` (the hit's `branch_at`) into `slot`
    /// (reserved). `tokens` are the sequence's tokens (at least `pos` of them).
    pub fn commit_branch(
        &mut self,
        pin: &Pin,
        tokens: &[u32],
        pos: usize,
        slot: SlotId,
        delta: &mut StoreDelta,
    ) -> Result<BranchOutcome, SnapshotError> {
        let record = self.pin_record(pin)?.clone();
        self.slots.check_reserved(slot)?;
        let limit = self.full_len(tokens.len());
        if pos == 0 || pos % self.block != 0 || pos > limit {
            return Err(SnapshotError::BadCheckpointPosition {
                pos,
                block_size: self.config.block_size,
                limit,
            });
        }
        let now = self.tick();
        let walk = self.walk(record.root, &tokens[..pos]);
        let target = match walk.stop {
            Stop::End => Some(walk.node),
            Stop::InEdge {
                child,
                matched,
                diverged: false,
            } => Some(self.split(child, matched)),
            Stop::InEdge { .. } | Stop::Leave => None,
        };
        let outcome = match target {
            Some(node) if self.nodes[node as usize].checkpoint.is_none() => {
                self.guarding = self.config.guard && record.node == record.root;
                self.attach(node, slot, now);
                self.guarding = false;
                self.stats.admitted_checkpoints += 1;
                BranchOutcome::Admitted
            }
            Some(_) => {
                self.drop_slot(slot, delta);
                BranchOutcome::Duplicate
            }
            None => {
                self.drop_slot(slot, delta);
                BranchOutcome::PathGone
            }
        };
        Ok(outcome)
    }

    /// Where a finishing sequence should have checkpoints under the admission policy, given its
    /// hit length and its full token count (input + output): the end of its full blocks
    /// (Marconi), or every block boundary after the hit (every-block admission).
    pub fn finish_positions(
        &self,
        hit_tokens: usize,
        total_tokens: usize,
    ) -> std::ops::RangeInclusive<usize> {
        let n = self.full_len(total_tokens) / self.block;
        match self.config.admission {
            Admission::Marconi => n.max(1)..=n,
            Admission::EveryBlock => (hit_tokens / self.block + 1)..=n,
        }
    }

    /// Inserts a finished sequence: `tokens` (input + output; a partial last block is ignored),
    /// its block table `blocks` (block `i` holds tokens `i·B..(i+1)·B`; extra ids are ignored),
    /// and the checkpoints it took as `(position, reserved slot)` with increasing positions that
    /// are multiples of the block size. Tokens past the last checkpoint are not inserted (KV with
    /// no state after it cannot be hit). Releases the pin, then evicts to the budget.
    pub fn finish(
        &mut self,
        pin: Pin,
        tokens: &[u32],
        blocks: &[BlockId],
        checkpoints: &[(usize, SlotId)],
        delta: &mut StoreDelta,
    ) -> Result<FinishReport, SnapshotError> {
        let record = self.pin_record(&pin)?.clone();
        let n = self.full_len(tokens.len());
        let needed = n / self.block;
        if blocks.len() < needed {
            return Err(SnapshotError::TooFewBlocks {
                got: blocks.len(),
                tokens: tokens.len(),
                block_size: self.config.block_size,
                needed,
            });
        }
        let mut previous = 0;
        for &(pos, slot) in checkpoints {
            if pos <= previous || pos % self.block != 0 || pos > n {
                return Err(SnapshotError::BadCheckpointPosition {
                    pos,
                    block_size: self.config.block_size,
                    limit: n,
                });
            }
            self.slots.check_reserved(slot)?;
            previous = pos;
        }
        let mut sorted = std::mem::take(&mut self.scratch_slots);
        sorted.clear();
        sorted.extend(checkpoints.iter().map(|&(_, slot)| slot));
        sorted.sort_unstable();
        let duplicate = sorted.windows(2).find(|w| w[0] == w[1]).map(|w| w[0]);
        self.scratch_slots = sorted;
        if let Some(slot) = duplicate {
            return Err(SnapshotError::SlotNotReserved {
                slot,
                state: "listed twice",
            });
        }

        self.unpin(record.node);
        self.free_pin(&pin);
        let now = self.tick();
        let mut report = FinishReport::default();
        let mut end_node = None;
        if let Some(&(last, _)) = checkpoints.last() {
            self.guarding = self.config.guard && record.node == record.root;
            let end = self.insert(
                record.root,
                tokens,
                blocks,
                checkpoints,
                last,
                now,
                &mut report,
                delta,
            );
            self.guarding = false;
            end_node = Some((end, last));
            let (_, whole) = self.refresh_rule();
            let mut at = end;
            while at != NONE {
                self.nodes[at as usize].last_access = now;
                if whole {
                    self.nodes[at as usize].last_hit = now;
                }
                self.refresh(at);
                at = self.nodes[at as usize].parent;
            }
        }
        self.stats.admitted_checkpoints += report.admitted_checkpoints as u64;
        self.stats.dropped_checkpoints += report.dropped_checkpoints as u64;
        self.returning = record.returning;
        self.enforce_budget(delta);
        self.returning = None;
        // The sequence's own new end is gone already (or was never reserved): remember it.
        let kept = end_node.is_some_and(|(end, last)| {
            let node = &self.nodes[end as usize];
            node.live && node.end() == last
        });
        if n > 0 && !kept {
            self.note_ghost(record.root, &tokens[..n], now);
        }
        self.drop_root_if_empty(record.root);
        Ok(report)
    }

    /// Releases a pin without inserting anything (the sequence was aborted or preempted).
    pub fn release(&mut self, pin: Pin) -> Result<(), SnapshotError> {
        let record = self.pin_record(&pin)?.clone();
        self.unpin(record.node);
        self.free_pin(&pin);
        self.drop_root_if_empty(record.root);
        Ok(())
    }

    /// A copy of the store with no sequence in flight: the cached tree, clock, counters and
    /// setting as they stand, every pin released and every reserved checkpoint slot free. What
    /// the copy serves next starts from the cached contents alone, as if the running sequences
    /// had been aborted (the tuner trials a setting on such a copy; the copy's block ids are
    /// the original's, and its deltas must not be applied to a pool).
    pub fn detached_copy(&self) -> Self {
        let mut copy = self.clone();
        for index in 0..copy.pins.len() {
            let record = &copy.pins[index];
            if record.node != NONE {
                let pin = Pin {
                    index: index as u32,
                    generation: record.generation,
                };
                // The record is active, so the pin is valid and `release` cannot fail.
                let _ = copy.release(pin);
            }
        }
        if copy.slots.reserved_count() > 0 {
            for index in 0..copy.slots.len() {
                let slot = SlotId(index);
                if matches!(
                    copy.slots.state(slot),
                    Ok(crate::slots::SlotState::Reserved)
                ) {
                    copy.slots.free(slot);
                }
            }
        }
        copy.guarding = false;
        copy
    }

    /// Evicts unpinned leaves (lowest score first) until the tree has released at least
    /// `blocks` block references or has no unpinned leaf left. Returns the references released
    /// (also listed in `delta.release_blocks`); a block is free in the pool only when no
    /// sequence holds it either.
    pub fn evict_for_kv(&mut self, blocks: usize, delta: &mut StoreDelta) -> usize {
        let mut released = 0;
        while released < blocks {
            let Some(victim) = self.pick_victim(true, true) else {
                break;
            };
            released += self.nodes[victim as usize].blocks.len();
            self.evict(victim, delta);
        }
        released
    }

    /// Evicts everything no pin holds (for shutdown, or to check that references balance).
    pub fn clear_unpinned(&mut self, delta: &mut StoreDelta) {
        while let Some(victim) = self.pick_victim(false, true) {
            self.evict(victim, delta);
        }
    }

    /// Every cached checkpoint with the tokens whose state it holds (for tests and debugging;
    /// allocates).
    pub fn cached_checkpoints(&self) -> Vec<CachedCheckpoint> {
        let mut out = Vec::new();
        for (id, node) in self.nodes.iter().enumerate() {
            if let (true, Some(slot)) = (node.live, node.checkpoint) {
                out.push(CachedCheckpoint {
                    namespace: node.namespace,
                    tokens: self.prefix_of(id as u32),
                    slot,
                });
            }
        }
        out.sort();
        out
    }

    /// Every block reference the tree holds, as `(namespace, tokens up to the block's end, block)`
    /// (for tests and debugging; allocates).
    pub fn cached_blocks(&self) -> Vec<(Namespace, Vec<u32>, BlockId)> {
        let mut out = Vec::new();
        for (id, node) in self.nodes.iter().enumerate() {
            if !node.live || node.blocks.is_empty() {
                continue;
            }
            let prefix = self.prefix_of(id as u32);
            for (i, &block) in node.blocks.iter().enumerate() {
                let end = node.start + (i + 1) * self.block;
                out.push((node.namespace, prefix[..end].to_vec(), block));
            }
        }
        out.sort();
        out
    }

    /// Calls `visit` once for every block reference the tree holds, each block after the block
    /// before it in its sequence (depth first): what a router needs to describe the tree's
    /// contents block by block (its cache events' starting contents) without hashing a prefix
    /// twice. Allocates only a traversal stack.
    pub fn visit_blocks(&self, mut visit: impl FnMut(TreeBlock<'_>)) {
        let mut roots: Vec<(Namespace, u32)> =
            self.roots.iter().map(|(&ns, &id)| (ns, id)).collect();
        roots.sort_unstable();
        let mut stack: Vec<(u32, Option<BlockId>)> = Vec::new();
        for (namespace, root) in roots {
            stack.push((root, None));
            while let Some((id, mut parent)) = stack.pop() {
                let node = &self.nodes[id as usize];
                for (i, &block) in node.blocks.iter().enumerate() {
                    visit(TreeBlock {
                        namespace,
                        parent,
                        block,
                        tokens: &node.tokens[i * self.block..(i + 1) * self.block],
                    });
                    parent = Some(block);
                }
                stack.extend(node.children.iter().map(|&child| (child, parent)));
            }
        }
    }

    fn prefix_of(&self, id: u32) -> Vec<u32> {
        let mut path = Vec::new();
        let mut at = id;
        while at != NONE {
            path.push(at);
            at = self.nodes[at as usize].parent;
        }
        path.iter()
            .rev()
            .flat_map(|&p| self.nodes[p as usize].tokens.iter().copied())
            .collect()
    }

    /// Checks every invariant of the module docs; the error says which one broke.
    pub fn check_invariants(&self) -> Result<(), String> {
        let mut held = 0u64;
        let mut cached = 0u32;
        let mut pinned_checkpoints = 0u64;
        let mut pinned_blocks = 0u64;
        let mut candidates = 0usize;
        let mut seen_slots = std::collections::HashSet::new();
        for (id, node) in self.nodes.iter().enumerate() {
            let id = id as u32;
            if !node.live {
                if node.candidate.is_some() {
                    return Err(format!("free node {id} is a candidate"));
                }
                continue;
            }
            held += node.blocks.len() as u64;
            if node.tokens.len() != node.blocks.len() * self.block {
                return Err(format!(
                    "node {id}: {} tokens but {} blocks",
                    node.tokens.len(),
                    node.blocks.len()
                ));
            }
            if let Some(slot) = node.checkpoint {
                cached += 1;
                if !seen_slots.insert(slot) {
                    return Err(format!("slot {slot:?} in two nodes"));
                }
                if self.slots.state(slot) != Ok(crate::slots::SlotState::Cached) {
                    return Err(format!(
                        "node {id} holds slot {slot:?} that the pool does not mark cached"
                    ));
                }
            }
            if node.pins > 0 {
                pinned_blocks += node.blocks.len() as u64;
            }
            if node.locks > 0 {
                pinned_checkpoints += u64::from(node.checkpoint.is_some());
            }
            if node.locks > node.pins {
                return Err(format!(
                    "node {id} has {} locks, more than its {} pins",
                    node.locks, node.pins
                ));
            }
            let child_pins: u32 = node
                .children
                .iter()
                .map(|&c| self.nodes[c as usize].pins)
                .sum();
            if node.pins < child_pins {
                return Err(format!(
                    "node {id} has {} pins, fewer than its children's {child_pins}",
                    node.pins
                ));
            }
            for &c in &node.children {
                let child = &self.nodes[c as usize];
                if !child.live || child.parent != id || child.start != node.end() {
                    return Err(format!(
                        "node {id}: child {c} is not attached at depth {}",
                        node.end()
                    ));
                }
                if self.children.get(&(id, child.key)) != Some(&c)
                    || child.key != block_key(&child.tokens[..self.block])
                {
                    return Err(format!(
                        "node {id}: child {c} is not indexed by its first block"
                    ));
                }
            }
            if node.parent == NONE {
                if self.roots.get(&node.namespace) != Some(&id)
                    || node.checkpoint.is_some()
                    || !node.tokens.is_empty()
                {
                    return Err(format!("root {id} is not registered or holds data"));
                }
            } else {
                if node.tokens.is_empty() {
                    return Err(format!("node {id} has an empty edge"));
                }
                // A pinned path node whose checkpoint went waits for its pins to merge.
                let waiting = node.pins > 0 && node.children.len() == 1;
                if node.checkpoint.is_none() && node.children.len() < 2 && !waiting {
                    return Err(format!(
                        "bare node {id} has {} children",
                        node.children.len()
                    ));
                }
            }
            let eligible = node.parent != NONE
                && node.locks == 0
                && node.children.len() <= 1
                && node.checkpoint.is_some();
            if eligible != node.candidate.is_some() {
                return Err(format!(
                    "node {id}: candidate flag {} but eligible {eligible}",
                    node.candidate.is_some()
                ));
            }
            if let Some(key) = node.candidate {
                candidates += 1;
                if key != (node.last_access, usize::MAX - node.end(), id)
                    || !self.candidates.contains(&key)
                {
                    return Err(format!("node {id}: stale candidate key"));
                }
            }
        }
        if self.children.len() + self.roots.len() != self.node_count() {
            return Err(format!(
                "child index has {} entries and {} roots for {} nodes",
                self.children.len(),
                self.roots.len(),
                self.node_count()
            ));
        }
        if candidates != self.candidates.len() {
            return Err(format!(
                "{} candidates indexed, {candidates} flagged",
                self.candidates.len()
            ));
        }
        if held != self.held_blocks || cached != self.slots.cached_count() {
            return Err(format!(
                "counters: blocks {held} vs {}, checkpoints {cached} vs {}",
                self.held_blocks,
                self.slots.cached_count()
            ));
        }
        // Every checkpoint the tree holds was admitted once and is removed only by an eviction.
        let removed = self.stats.evicted_leaves + self.stats.evicted_checkpoints_only;
        if self.stats.admitted_checkpoints != removed + u64::from(cached) {
            return Err(format!(
                "checkpoint counters: {} admitted, {removed} evicted, {cached} held",
                self.stats.admitted_checkpoints
            ));
        }
        if pinned_checkpoints != self.pinned_checkpoints || pinned_blocks != self.pinned_blocks {
            return Err(format!(
                "pinned counters: checkpoints {pinned_checkpoints} vs {}, blocks {pinned_blocks} vs {}",
                self.pinned_checkpoints, self.pinned_blocks
            ));
        }
        // Every active pin locks its hit node, and under `PinScope::Path` every node above it.
        let mut locks = vec![0u32; self.nodes.len()];
        for record in self.pins.iter().filter(|p| p.node != NONE) {
            let mut at = record.node;
            while at != NONE {
                locks[at as usize] += 1;
                at = self.nodes[at as usize].parent;
                if self.config.pin_scope == PinScope::HitCheckpoint {
                    break;
                }
            }
        }
        for (id, node) in self.nodes.iter().enumerate() {
            if node.live && node.locks != locks[id] {
                return Err(format!(
                    "node {id} has {} locks, its pins hold {}",
                    node.locks, locks[id]
                ));
            }
        }
        let active_pins = self.pins.iter().filter(|p| p.node != NONE).count();
        if active_pins + self.free_pins.len() != self.pins.len() {
            return Err("pin records and free list disagree".into());
        }
        if self.bytes() > self.config.budget_bytes {
            return Err(format!(
                "{} bytes over the budget of {}",
                self.bytes(),
                self.config.budget_bytes
            ));
        }
        Ok(())
    }

    // ---- internals -------------------------------------------------------------------------

    fn root_for(&mut self, namespace: Namespace, now: u64) -> u32 {
        if let Some(&root) = self.roots.get(&namespace) {
            return root;
        }
        let root = self.alloc(Node {
            namespace,
            parent: NONE,
            start: 0,
            tokens: Vec::new(),
            blocks: Vec::new(),
            key: 0,
            children: Vec::new(),
            checkpoint: None,
            pins: 0,
            locks: 0,
            last_access: now,
            last_hit: now,
            candidate: None,
            admitted: 0,
            live: true,
        });
        self.roots.insert(namespace, root);
        root
    }

    fn drop_root_if_empty(&mut self, root: u32) {
        let node = &self.nodes[root as usize];
        if node.live && node.parent == NONE && node.children.is_empty() && node.pins == 0 {
            self.roots.remove(&node.namespace);
            self.free_node(root);
        }
    }

    fn alloc(&mut self, node: Node) -> u32 {
        if let Some(id) = self.free_nodes.pop() {
            self.nodes[id as usize] = node;
            id
        } else {
            self.nodes.push(node);
            (self.nodes.len() - 1) as u32
        }
    }

    fn free_node(&mut self, id: u32) {
        let node = &mut self.nodes[id as usize];
        debug_assert!(node.candidate.is_none());
        node.live = false;
        node.tokens = Vec::new();
        node.blocks = Vec::new();
        node.children = Vec::new();
        node.checkpoint = None;
        node.parent = NONE;
        self.free_nodes.push(id);
    }

    fn new_pin(&mut self, node: u32, root: u32, returning: Option<u64>) -> Pin {
        if let Some(index) = self.free_pins.pop() {
            let record = &mut self.pins[index as usize];
            record.node = node;
            record.root = root;
            record.returning = returning;
            Pin {
                index,
                generation: record.generation,
            }
        } else {
            self.pins.push(PinRecord {
                generation: 0,
                node,
                root,
                returning,
            });
            Pin {
                index: (self.pins.len() - 1) as u32,
                generation: 0,
            }
        }
    }

    fn pin_record(&self, pin: &Pin) -> Result<&PinRecord, SnapshotError> {
        match self.pins.get(pin.index as usize) {
            Some(record) if record.generation == pin.generation && record.node != NONE => {
                Ok(record)
            }
            _ => Err(SnapshotError::StalePin {
                index: pin.index,
                generation: pin.generation,
            }),
        }
    }

    fn free_pin(&mut self, pin: &Pin) {
        let record = &mut self.pins[pin.index as usize];
        record.node = NONE;
        record.generation = record.generation.wrapping_add(1);
        self.free_pins.push(pin.index);
    }

    /// Pins `id` for a running sequence, and with `lock` its checkpoint too (see [`PinScope`]).
    fn pin_node(&mut self, id: u32, lock: bool) {
        let node = &mut self.nodes[id as usize];
        if node.pins == 0 {
            self.pinned_blocks += node.blocks.len() as u64;
        }
        node.pins += 1;
        if lock {
            if node.locks == 0 {
                self.pinned_checkpoints += u64::from(node.checkpoint.is_some());
            }
            node.locks += 1;
        }
        self.refresh(id);
    }

    /// Takes one lock off `id`'s checkpoint.
    fn unlock(&mut self, id: u32) {
        let node = &mut self.nodes[id as usize];
        node.locks -= 1;
        if node.locks == 0 {
            self.pinned_checkpoints -= u64::from(node.checkpoint.is_some());
        }
    }

    /// Takes a pin off its hit path (`node`, which it locked, and every node above). A path node
    /// whose checkpoint went while it was pinned (bare, one child) merges into the child once
    /// unpinned.
    fn unpin(&mut self, node: u32) {
        let path = self.config.pin_scope == PinScope::Path;
        let mut at = node;
        while at != NONE {
            if at == node || path {
                self.unlock(at);
            }
            let n = &mut self.nodes[at as usize];
            n.pins -= 1;
            if n.pins == 0 {
                self.pinned_blocks -= n.blocks.len() as u64;
            }
            let parent = n.parent;
            let merge =
                n.pins == 0 && parent != NONE && n.checkpoint.is_none() && n.children.len() == 1;
            if merge {
                self.merge_into_child(at);
            } else {
                self.refresh(at);
            }
            at = parent;
        }
    }

    /// Re-files `id` in the candidate set after any change to it.
    fn refresh(&mut self, id: u32) {
        let node = &mut self.nodes[id as usize];
        let eligible = node.live
            && node.parent != NONE
            && node.locks == 0
            && node.children.len() <= 1
            && node.checkpoint.is_some();
        let key = eligible.then(|| (node.last_access, usize::MAX - node.end(), id));
        if node.candidate != key {
            if let Some(old) = node.candidate {
                self.candidates.remove(&old);
            }
            if let Some(new) = key {
                self.candidates.insert(new);
            }
            node.candidate = key;
        }
    }

    fn walk(&self, root: u32, tokens: &[u32]) -> Walk {
        let mut node = root;
        let mut depth = 0;
        loop {
            if depth == tokens.len() {
                return Walk {
                    node,
                    depth,
                    stop: Stop::End,
                };
            }
            let key = block_key(&tokens[depth..depth + self.block]);
            let Some(&child) = self.children.get(&(node, key)) else {
                return Walk {
                    node,
                    depth,
                    stop: Stop::Leave,
                };
            };
            let edge = &self.nodes[child as usize].tokens;
            let rest = &tokens[depth..];
            let matched = common_prefix(edge, rest) / self.block * self.block;
            if matched == 0 {
                // A hash collision: a different first block under the same key.
                return Walk {
                    node,
                    depth,
                    stop: Stop::Leave,
                };
            }
            if matched == edge.len() {
                node = child;
                depth += matched;
                continue;
            }
            return Walk {
                node,
                depth,
                stop: Stop::InEdge {
                    child,
                    matched,
                    diverged: matched < rest.len(),
                },
            };
        }
    }

    /// Splits `child`'s edge after `cut` tokens (a whole number of blocks, less than the edge);
    /// returns the new upper node, which inherits the position, pins and recency.
    fn split(&mut self, child: u32, cut: usize) -> u32 {
        let block = self.block;
        let c = &mut self.nodes[child as usize];
        debug_assert!(cut > 0 && cut < c.tokens.len() && cut % block == 0);
        let upper_tokens: Vec<u32> = c.tokens.drain(..cut).collect();
        let upper_blocks: Vec<BlockId> = c.blocks.drain(..cut / block).collect();
        let (namespace, parent, start, key, pins, last_access) =
            (c.namespace, c.parent, c.start, c.key, c.pins, c.last_access);
        c.start += cut;
        let lower_key = block_key(&c.tokens[..block]);
        c.key = lower_key;
        let upper = self.alloc(Node {
            namespace,
            parent,
            start,
            tokens: upper_tokens,
            blocks: upper_blocks,
            key,
            children: vec![child],
            checkpoint: None,
            pins,
            // Under `Path` every pin through `child` locks the new node above it too.
            locks: if self.config.pin_scope == PinScope::Path {
                pins
            } else {
                0
            },
            last_access,
            last_hit: last_access,
            candidate: None,
            admitted: 0,
            live: true,
        });
        self.nodes[child as usize].parent = upper;
        if let Some(slot) = self.nodes[parent as usize]
            .children
            .iter_mut()
            .find(|c| **c == child)
        {
            *slot = upper;
        }
        self.children.insert((parent, key), upper);
        self.children.insert((upper, lower_key), child);
        self.refresh(child);
        upper
    }

    fn attach(&mut self, id: u32, slot: SlotId, now: u64) {
        self.slots.cache(slot);
        let node = &mut self.nodes[id as usize];
        debug_assert!(node.checkpoint.is_none() && node.parent != NONE);
        node.checkpoint = Some(slot);
        node.last_access = now;
        node.last_hit = now;
        node.admitted = now;
        if self.guarding {
            self.newcomers.push(id);
        }
        if node.locks > 0 {
            self.pinned_checkpoints += 1;
        }
        self.refresh(id);
    }

    fn drop_slot(&mut self, slot: SlotId, delta: &mut StoreDelta) {
        self.slots.free(slot);
        delta.freed_slots.push(slot);
        self.stats.dropped_checkpoints += 1;
    }

    #[allow(clippy::too_many_arguments)] // One internal call site; bundling the arguments would only rename them.
    fn insert(
        &mut self,
        root: u32,
        tokens: &[u32],
        blocks: &[BlockId],
        checkpoints: &[(usize, SlotId)],
        last: usize,
        now: u64,
        report: &mut FinishReport,
        delta: &mut StoreDelta,
    ) -> u32 {
        let block = self.block;
        let mut node = root;
        let mut depth = 0;
        let mut next = 0;
        loop {
            if next < checkpoints.len() && checkpoints[next].0 == depth {
                let slot = checkpoints[next].1;
                next += 1;
                if self.nodes[node as usize].checkpoint.is_some() {
                    self.slots.free(slot);
                    delta.freed_slots.push(slot);
                    report.dropped_checkpoints += 1;
                } else {
                    self.attach(node, slot, now);
                    report.admitted_checkpoints += 1;
                }
            }
            if depth == last {
                return node;
            }
            let next_pos = checkpoints[next].0;
            let key = block_key(&tokens[depth..depth + block]);
            let Some(&child) = self.children.get(&(node, key)) else {
                // A new chain of nodes, one per remaining checkpoint.
                let mut key = key;
                for &(pos, slot) in &checkpoints[next..] {
                    let new_blocks = &blocks[depth / block..pos / block];
                    delta.retain_blocks.extend_from_slice(new_blocks);
                    self.held_blocks += new_blocks.len() as u64;
                    let id = self.alloc(Node {
                        namespace: self.nodes[node as usize].namespace,
                        parent: node,
                        start: depth,
                        tokens: tokens[depth..pos].to_vec(),
                        blocks: new_blocks.to_vec(),
                        key,
                        children: Vec::new(),
                        checkpoint: None,
                        pins: 0,
                        locks: 0,
                        last_access: now,
                        last_hit: now,
                        candidate: None,
                        admitted: 0,
                        live: true,
                    });
                    self.children.insert((node, key), id);
                    self.nodes[node as usize].children.push(id);
                    self.refresh(node);
                    self.attach(id, slot, now);
                    report.admitted_checkpoints += 1;
                    report.inserted_tokens += pos - depth;
                    node = id;
                    depth = pos;
                    if pos < last {
                        key = block_key(&tokens[pos..pos + block]);
                    }
                }
                return node;
            };
            let edge_len = self.nodes[child as usize].tokens.len();
            let limit = (last - depth).min(edge_len);
            let matched = common_prefix(
                &self.nodes[child as usize].tokens[..limit],
                &tokens[depth..depth + limit],
            ) / block
                * block;
            if matched == 0 {
                // Hash collision: leave the rest uncached.
                for &(_, slot) in &checkpoints[next..] {
                    self.slots.free(slot);
                    delta.freed_slots.push(slot);
                    report.dropped_checkpoints += 1;
                }
                return node;
            }
            let cut = matched.min(next_pos - depth);
            if cut == edge_len {
                node = child;
            } else {
                node = self.split(child, cut);
            }
            depth += cut;
        }
    }

    fn enforce_budget(&mut self, delta: &mut StoreDelta) {
        while self.bytes() > self.config.budget_bytes {
            let Some(victim) = self.pick_victim(false, true) else {
                tracing::warn!(
                    bytes = self.bytes(),
                    budget = self.config.budget_bytes,
                    "pinned data exceeds the budget"
                );
                break;
            };
            self.evict(victim, delta);
        }
    }

    /// FLOPs a hit on `id` saves per byte (see [`FlopBasis`] for which FLOPs and bytes).
    fn flop_efficiency(&self, id: u32) -> f64 {
        let node = &self.nodes[id as usize];
        let end = node.end() as u64;
        let mut saved = self.config.cost.prefix_flops(end);
        if self.config.flop_basis == FlopBasis::Marginal {
            let mut at = node.parent;
            while at != NONE && self.nodes[at as usize].checkpoint.is_none() {
                at = self.nodes[at as usize].parent;
            }
            if at != NONE && self.nodes[at as usize].parent != NONE {
                saved -= self
                    .config
                    .cost
                    .prefix_flops(self.nodes[at as usize].end() as u64);
            }
        }
        let kv = if node.children.is_empty() || self.config.flop_basis == FlopBasis::Marginal {
            node.blocks.len() as u64 * self.kv_bytes_per_block()
        } else {
            0
        };
        let bytes = kv + u64::from(node.checkpoint.is_some()) * self.config.cost.checkpoint_bytes();
        saved / bytes as f64
    }

    /// Records the age of a hit; every 16 hits, `dead_after` becomes 1.5 times the 90th
    /// percentile of the latest 128 (measured best of 1, 1.5 and 2 times; 0 until 16 hits were
    /// seen: everything unused counts as dead).
    fn note_hit_age(&mut self, age: u64) {
        const RING: usize = HIT_AGE_RING;
        if self.hit_ages.len() < RING {
            self.hit_ages.push(age);
        } else {
            self.hit_ages[self.hit_age_at] = age;
        }
        self.hit_age_at = (self.hit_age_at + 1) % RING;
        if self.hit_ages.len() >= 16 && self.hit_age_at % 16 == 0 {
            let mut ages = std::mem::take(&mut self.scratch_ages);
            ages.clear();
            ages.extend_from_slice(&self.hit_ages);
            let k = ages.len() * 9 / 10;
            let (_, &mut p90, _) = ages.select_nth_unstable(k);
            self.dead_after = p90 + p90 / 2;
            self.scratch_ages = ages;
        }
    }

    /// The candidate with the lowest score `recency + α · efficiency` (both min-max normalised
    /// over the candidates considered); ties go to the least recent, then the deepest. Under
    /// guarded admission dead entries go first; for a returning sequence, entries unused for
    /// longer than its own dead age (times [`GUARDED_RETURN_FACTOR`] under guarded admission);
    /// under guarded admission, then the checkpoints a missed sequence brought, and with
    /// `members` false nothing else goes.
    fn pick_victim(&mut self, leaf_only: bool, members: bool) -> Option<u32> {
        if self.config.guard {
            // Dead entries first, oldest first.
            let dead = self.least_recent_unused_for(self.dead_after, leaf_only);
            if dead.is_some() {
                return dead;
            }
        }
        if let Some(after) = self.returning {
            // A returning sequence: entries unused for longer than its own dead age.
            let after = if self.config.guard {
                after.saturating_mul(GUARDED_RETURN_FACTOR)
            } else {
                after
            };
            let stale = self.least_recent_unused_for(after, leaf_only);
            if stale.is_some() {
                return stale;
            }
        }
        if self.config.guard {
            // Then what a sequence that missed brought, newest first.
            for &id in self.newcomers.iter().rev() {
                let node = &self.nodes[id as usize];
                if node.live
                    && node.candidate.is_some()
                    && node.admitted > self.lookup_clock
                    && (!leaf_only || node.children.is_empty())
                {
                    return Some(id);
                }
            }
            if !members {
                return None;
            }
        }
        let own = matches!(
            self.config.recency,
            Recency::Own | Recency::Shared | Recency::Adaptive
        );
        if self.config.alpha == 0.0 && !own {
            return self
                .candidates
                .iter()
                .map(|&(_, _, id)| id)
                .find(|&id| !leaf_only || self.nodes[id as usize].children.is_empty());
        }
        let mut scores = std::mem::take(&mut self.scratch_scores);
        scores.clear();
        let (mut t_min, mut t_max) = (u64::MAX, 0u64);
        let (mut e_min, mut e_max) = (f64::INFINITY, f64::NEG_INFINITY);
        for &(t, _, id) in &self.candidates {
            let node = &self.nodes[id as usize];
            if leaf_only && !node.children.is_empty() {
                continue;
            }
            let t = if own { node.last_hit } else { t };
            let e = self.flop_efficiency(id);
            t_min = t_min.min(t);
            t_max = t_max.max(t);
            e_min = e_min.min(e);
            e_max = e_max.max(e);
            scores.push((id, t, e));
        }
        let t_span = (t_max.saturating_sub(t_min)) as f64;
        let e_span = e_max - e_min;
        let alpha = self.config.alpha;
        let mut best: Option<(f64, u32)> = None;
        for &(id, t, e) in &scores {
            let recency = if t_span > 0.0 {
                (t - t_min) as f64 / t_span
            } else {
                0.0
            };
            let efficiency = if e_span > 0.0 {
                (e - e_min) / e_span
            } else {
                0.0
            };
            let score = recency + alpha * efficiency;
            if best.is_none_or(|(s, _)| score < s) {
                best = Some((score, id));
            }
        }
        self.scratch_scores = scores;
        best.map(|(_, id)| id)
    }

    /// The least recently used candidate (a leaf if `leaf_only`) unused for more than `after`
    /// clock ticks.
    fn least_recent_unused_for(&self, after: u64, leaf_only: bool) -> Option<u32> {
        self.candidates
            .iter()
            .take_while(|&&(t, _, _)| self.clock - t > after)
            .map(|&(_, _, id)| id)
            .find(|&id| !leaf_only || self.nodes[id as usize].children.is_empty())
    }

    /// If `tokens` (a lookup's) extend a ghost, forgets it and returns the new sequence's own
    /// dead age: 1.5 times the gap since the ghost's finish. Ghosts older than the dead age are
    /// dropped first (a conversation back after that is treated as new).
    fn returning_gap(&mut self, namespace: Namespace, tokens: &[u32], now: u64) -> Option<u64> {
        let dead_after = self.dead_after;
        self.ghosts.retain(|g| now - g.at <= dead_after);
        let block = self.block;
        let found = self.ghosts.iter().position(|g| {
            g.namespace == namespace
                && g.end <= tokens.len()
                && tokens[g.end - block..g.end] == g.last_block[..]
                && xxh3_64(bytemuck::cast_slice(&tokens[..g.end])) == g.hash
        })?;
        let gap = now - self.ghosts.remove(found).at;
        Some(gap + gap / 2)
    }

    /// Remembers a sequence that lost its own new entry (`tokens`: a whole number of blocks).
    fn note_ghost(&mut self, root: u32, tokens: &[u32], now: u64) {
        if self.ghosts.len() >= HIT_AGE_RING {
            self.ghosts.remove(0);
        }
        let end = tokens.len();
        self.ghosts.push(Ghost {
            namespace: self.nodes[root as usize].namespace,
            end,
            last_block: tokens[end - self.block..].to_vec(),
            hash: xxh3_64(bytemuck::cast_slice(tokens)),
            at: now,
        });
    }

    fn evict(&mut self, id: u32, delta: &mut StoreDelta) {
        let node = &mut self.nodes[id as usize];
        debug_assert!(node.candidate.is_some());
        if let Some(old) = node.candidate.take() {
            self.candidates.remove(&old);
        }
        if let Some(slot) = node.checkpoint.take() {
            self.slots.free(slot);
            delta.freed_slots.push(slot);
        }
        if node.pins > 0 {
            // A checkpoint above every pin's hit node: the running sequences need only the KV of
            // the path, which stays; the node, bare, merges into its child once unpinned.
            self.stats.evicted_checkpoints_only += 1;
            self.refresh(id);
        } else if node.children.is_empty() {
            self.stats.evicted_leaves += 1;
            let (parent, key) = (node.parent, node.key);
            let blocks = std::mem::take(&mut node.blocks);
            self.held_blocks -= blocks.len() as u64;
            delta.release_blocks.extend_from_slice(&blocks);
            self.children.remove(&(parent, key));
            let siblings = &mut self.nodes[parent as usize].children;
            if let Some(i) = siblings.iter().position(|&c| c == id) {
                siblings.swap_remove(i);
            }
            self.free_node(id);
            let p = &self.nodes[parent as usize];
            if p.parent == NONE {
                self.drop_root_if_empty(parent);
            } else if p.checkpoint.is_none() && p.children.len() == 1 {
                self.merge_into_child(parent);
            } else {
                self.refresh(parent);
            }
        } else {
            self.stats.evicted_checkpoints_only += 1;
            self.merge_into_child(id);
        }
    }

    /// Merges bare `id` (exactly one child) into its child, which takes over its edge and place.
    fn merge_into_child(&mut self, id: u32) {
        let node = &mut self.nodes[id as usize];
        debug_assert!(node.checkpoint.is_none() && node.children.len() == 1);
        if let Some(old) = node.candidate.take() {
            self.candidates.remove(&old);
        }
        let child = node.children[0];
        let (parent, key, start) = (node.parent, node.key, node.start);
        let mut tokens = std::mem::take(&mut node.tokens);
        let mut blocks = std::mem::take(&mut node.blocks);
        let pins = node.pins;
        let c = &mut self.nodes[child as usize];
        debug_assert_eq!(c.pins, pins);
        let child_key = c.key;
        tokens.extend_from_slice(&c.tokens);
        blocks.extend_from_slice(&c.blocks);
        c.tokens = tokens;
        c.blocks = blocks;
        c.start = start;
        c.parent = parent;
        c.key = key;
        self.children.remove(&(id, child_key));
        self.children.insert((parent, key), child);
        if let Some(slot) = self.nodes[parent as usize]
            .children
            .iter_mut()
            .find(|c| **c == id)
        {
            *slot = child;
        }
        self.free_node(id);
        self.refresh(child);
    }
}

fn check_alpha(alpha: f64) -> Result<(), SnapshotError> {
    if alpha.is_finite() && alpha >= 0.0 {
        Ok(())
    } else {
        Err(SnapshotError::BadConfig {
            field: "alpha",
            value: alpha.to_string(),
            limit: "finite and non-negative",
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cost::CostCoefficients;

    /// 1 KV byte per token, 10 bytes per checkpoint, 1 FLOP per token of prefix.
    fn cost() -> CostModel {
        CostModel::new(CostCoefficients {
            name: "unit".into(),
            attention_layers: 0,
            mamba_layers: 0,
            mlp_layers: 1,
            attention_linear_flops_per_token: 0.0,
            attention_quadratic_flops: 0.0,
            mamba_flops_per_token: 0.0,
            mlp_flops_per_token: 1.0,
            kv_bytes_per_token: 1,
            checkpoint_bytes: 10,
        })
        .unwrap()
    }

    fn store(block_size: u32, budget: u64, scope: BudgetScope, alpha: f64) -> SnapshotStore {
        SnapshotStore::new(StoreConfig {
            block_size,
            checkpoint_slots: 16,
            budget_bytes: budget,
            budget_scope: scope,
            admission: Admission::Marconi,
            alpha,
            flop_basis: FlopBasis::Prefix,
            recency: Recency::Path,
            guard: false,
            pin_scope: PinScope::Path,
            cost: cost(),
        })
        .unwrap()
    }

    const NS: Namespace = Namespace {
        adapter: 0,
        salt: 0,
    };

    /// Block ids are `first token of the block · 100 + block index`, so tests can name them.
    fn table(tokens: &[u32], block: usize) -> Vec<BlockId> {
        tokens
            .chunks_exact(block)
            .enumerate()
            .map(|(i, c)| BlockId(c[0] * 100 + i as u32))
            .collect()
    }

    /// Looks `input` up, takes the branch checkpoint, finishes `full` with an end checkpoint.
    fn serve(
        s: &mut SnapshotStore,
        ns: Namespace,
        input: &[u32],
        full: &[u32],
        delta: &mut StoreDelta,
    ) -> Hit {
        let mut blocks = Vec::new();
        let hit = s.lookup(ns, input, &mut blocks);
        if let Some(pos) = hit.branch_at {
            let slot = s.reserve_checkpoint(delta).unwrap();
            s.commit_branch(&hit.pin, input, pos, slot, delta).unwrap();
        }
        let b = s.config().block_size as usize;
        let n = full.len() / b * b;
        let slot = s.reserve_checkpoint(delta).unwrap();
        let Hit {
            pin,
            hit_tokens,
            checkpoint,
            branch_at,
            matched_tokens,
        } = hit;
        s.finish(pin, full, &table(full, b), &[(n, slot)], delta)
            .unwrap();
        s.check_invariants().unwrap();
        let pin = Pin {
            index: u32::MAX,
            generation: 0,
        };
        Hit {
            pin,
            hit_tokens,
            checkpoint,
            branch_at,
            matched_tokens,
        }
    }

    fn peek(
        s: &mut SnapshotStore,
        ns: Namespace,
        tokens: &[u32],
    ) -> (usize, Option<usize>, Vec<BlockId>) {
        let mut blocks = Vec::new();
        let hit = s.lookup(ns, tokens, &mut blocks);
        let out = (hit.hit_tokens, hit.branch_at, blocks);
        s.release(hit.pin).unwrap();
        s.check_invariants().unwrap();
        out
    }

    fn prefixes(s: &SnapshotStore) -> Vec<Vec<u32>> {
        s.cached_checkpoints()
            .into_iter()
            .map(|c| c.tokens)
            .collect()
    }

    #[test]
    fn visiting_blocks_shows_each_after_its_parent_with_its_tokens() {
        let mut s = store(2, 1000, BudgetScope::CheckpointsAndKv, 0.0);
        let mut d = StoreDelta::default();
        let other = Namespace {
            adapter: 3,
            salt: 9,
        };
        serve(&mut s, NS, &[1, 2, 3], &[1, 2, 3, 4, 5, 6], &mut d);
        // Leaves the first sequence inside its edge at 4: a branch point splits the edge.
        serve(
            &mut s,
            NS,
            &[1, 2, 3, 4, 7, 8, 9],
            &[1, 2, 3, 4, 7, 8, 9, 10],
            &mut d,
        );
        serve(&mut s, other, &[1, 2, 3], &[1, 2, 3, 4], &mut d);
        let expected = s.cached_blocks();
        let prefix_of: HashMap<(Namespace, BlockId), Vec<u32>> = expected
            .iter()
            .map(|(ns, prefix, block)| ((*ns, *block), prefix.clone()))
            .collect();
        let mut visited = Vec::new();
        s.visit_blocks(|b| {
            let prefix = &prefix_of[&(b.namespace, b.block)];
            let (before, tokens) = prefix.split_at(prefix.len() - 2);
            assert_eq!(b.tokens, tokens, "block {:?}", b.block);
            match b.parent {
                None => assert!(before.is_empty(), "block {:?} has a parent", b.block),
                Some(parent) => {
                    assert_eq!(prefix_of[&(b.namespace, parent)], before);
                    assert!(visited.contains(&(b.namespace, parent)), "parent first");
                }
            }
            visited.push((b.namespace, b.block));
        });
        let mut all: Vec<(Namespace, BlockId)> = expected
            .iter()
            .map(|(ns, _, block)| (*ns, *block))
            .collect();
        all.sort();
        visited.sort();
        assert_eq!(visited, all);
        assert_eq!(visited.len(), 3 + 2 + 2);
    }

    #[test]
    fn a_finished_sequence_is_hit_at_its_end_only() {
        let mut s = store(1, 1000, BudgetScope::CheckpointsAndKv, 0.0);
        let mut d = StoreDelta::default();
        let first = serve(&mut s, NS, &[1, 2, 3], &[1, 2, 3, 4, 5], &mut d);
        assert_eq!(
            (first.hit_tokens, first.branch_at, first.matched_tokens),
            (0, None, 0)
        );
        assert_eq!(d.retain_blocks, table(&[1, 2, 3, 4, 5], 1));
        // The next turn extends input + output: a hit at 5 with its blocks.
        assert_eq!(
            peek(&mut s, NS, &[1, 2, 3, 4, 5, 6]),
            (5, None, table(&[1, 2, 3, 4, 5], 1))
        );
        // A prefix ending inside the edge gives nothing: there is no state there.
        assert_eq!(peek(&mut s, NS, &[1, 2, 3, 4]), (0, None, vec![]));
        // Another namespace shares nothing.
        assert_eq!(
            peek(
                &mut s,
                Namespace {
                    adapter: 1,
                    salt: 0
                },
                &[1, 2, 3, 4, 5, 6]
            ),
            (0, None, vec![])
        );
        assert_eq!(s.bytes(), 5 + 10);
    }

    #[test]
    fn divergence_inside_an_edge_is_a_branch_point() {
        let mut s = store(1, 1000, BudgetScope::CheckpointsAndKv, 0.0);
        let mut d = StoreDelta::default();
        serve(&mut s, NS, &[1, 2, 3, 4], &[1, 2, 3, 4, 5, 6], &mut d);
        let second = serve(&mut s, NS, &[1, 2, 3, 9, 9], &[1, 2, 3, 9, 9, 7], &mut d);
        assert_eq!(
            (second.hit_tokens, second.branch_at, second.matched_tokens),
            (0, Some(3), 3)
        );
        assert_eq!(
            prefixes(&s),
            vec![
                vec![1, 2, 3],
                vec![1, 2, 3, 4, 5, 6],
                vec![1, 2, 3, 9, 9, 7]
            ]
        );
        // A third request branching at the same point hits the branch checkpoint.
        assert_eq!(
            peek(&mut s, NS, &[1, 2, 3, 8]),
            (3, None, table(&[1, 2, 3], 1))
        );
        // Leaving the tree at a node without a checkpoint also asks for one there: split the
        // edge after a finish whose output diverges, then branch at that bare node.
        serve(&mut s, NS, &[5, 6], &[5, 6, 7, 8], &mut d);
        serve(&mut s, NS, &[5, 6, 7], &[5, 6, 7, 1], &mut d);
        assert_eq!(peek(&mut s, NS, &[5, 6, 7, 3, 3]), (0, Some(3), vec![]));
    }

    #[test]
    fn block_granularity_rounds_down_and_ignores_partial_blocks() {
        let mut s = store(4, 1000, BudgetScope::CheckpointsAndKv, 0.0);
        let mut d = StoreDelta::default();
        let tokens: Vec<u32> = (1..=10).collect();
        serve(&mut s, NS, &tokens[..6], &tokens, &mut d);
        // Only the two full blocks were inserted, with a checkpoint at 8.
        assert_eq!(prefixes(&s), vec![tokens[..8].to_vec()]);
        assert_eq!(s.held_block_count(), 2);
        // Diverging at token 6 (inside the second block) branches at 4, the block boundary.
        let other = [1, 2, 3, 4, 5, 6, 0, 0, 0];
        assert_eq!(peek(&mut s, NS, &other), (0, Some(4), vec![]));
        assert_eq!(
            peek(&mut s, NS, &[1, 2, 3, 4, 5, 6, 7, 8, 9]),
            (8, None, table(&tokens[..8], 4))
        );
    }

    #[test]
    fn leaf_eviction_frees_kv_and_merge_frees_only_the_checkpoint() {
        // Budget 2 checkpoints + 10 KV bytes. With α > 0 the single-child node (lower FLOP
        // efficiency) goes first; under pure LRU a parent is never older than its child, so LRU
        // only ever evicts leaves.
        let mut s = store(1, 30, BudgetScope::CheckpointsAndKv, 1.0);
        let mut d = StoreDelta::default();
        serve(&mut s, NS, &[1, 2], &[1, 2, 3, 4], &mut d); // 14 bytes
        serve(&mut s, NS, &[1, 2, 3, 4, 5], &[1, 2, 3, 4, 5, 6], &mut d); // +12: 26 bytes
        assert_eq!(prefixes(&s), vec![vec![1, 2, 3, 4], vec![1, 2, 3, 4, 5, 6]]);
        assert!(d.release_blocks.is_empty());
        // A third sequence needs room: [1,2,3,4] (4 FLOPs over 14 bytes) has one child: it
        // merges, freeing its checkpoint but no KV.
        d.clear();
        serve(&mut s, NS, &[7], &[7, 8], &mut d);
        assert_eq!(prefixes(&s), vec![vec![1, 2, 3, 4, 5, 6], vec![7, 8]]);
        assert_eq!(d.freed_slots, vec![SlotId(0)]);
        assert!(d.release_blocks.is_empty());
        assert_eq!(s.bytes(), 6 + 2 + 20);
        // Another: the leaf [1..6] (oldest; its efficiency is the best, a tie on score) goes,
        // with all its KV.
        d.clear();
        serve(&mut s, NS, &[9], &[9, 9, 9], &mut d);
        assert_eq!(prefixes(&s), vec![vec![7, 8], vec![9, 9, 9]]);
        assert_eq!(d.release_blocks, table(&[1, 2, 3, 4, 5, 6], 1));
        assert_eq!(s.stats().evicted_leaves, 1);
        assert_eq!(s.stats().evicted_checkpoints_only, 1);
    }

    #[test]
    fn pinned_paths_survive_and_reservations_fail_cleanly() {
        let mut s = store(1, 25, BudgetScope::CheckpointsAndKv, 0.0);
        let mut d = StoreDelta::default();
        serve(&mut s, NS, &[1], &[1, 2, 3], &mut d); // 13 bytes
        let mut blocks = Vec::new();
        let hit = s.lookup(NS, &[1, 2, 3, 4], &mut blocks);
        assert_eq!(hit.hit_tokens, 3);
        // Pinned: 13 bytes stay; one more checkpoint (23) fits, a second would not.
        let slot = s.reserve_checkpoint(&mut d).unwrap();
        assert_eq!(s.reserve_checkpoint(&mut d), None);
        assert_eq!(prefixes(&s), vec![vec![1, 2, 3]]);
        // Finishing adds KV for [4,5]: 3 + 2 KV + 20 = 25 fits exactly.
        s.finish(
            hit.pin,
            &[1, 2, 3, 4, 5],
            &table(&[1, 2, 3, 4, 5], 1),
            &[(5, slot)],
            &mut d,
        )
        .unwrap();
        s.check_invariants().unwrap();
        assert_eq!(prefixes(&s), vec![vec![1, 2, 3], vec![1, 2, 3, 4, 5]]);
        assert_eq!(s.bytes(), 25);
    }

    /// A path of three checkpoints, [1,2] → [3,4] → [5,6], that fills a budget of 38 but two.
    fn three_deep(pin_scope: PinScope, d: &mut StoreDelta) -> SnapshotStore {
        let mut s = SnapshotStore::new(StoreConfig {
            pin_scope,
            ..store(1, 38, BudgetScope::CheckpointsAndKv, 0.0)
                .config()
                .clone()
        })
        .unwrap();
        serve(&mut s, NS, &[1], &[1, 2], d);
        serve(&mut s, NS, &[1, 2, 3], &[1, 2, 3, 4], d);
        serve(&mut s, NS, &[1, 2, 3, 4, 5], &[1, 2, 3, 4, 5, 6], d);
        assert_eq!(s.bytes(), 36);
        s
    }

    #[test]
    fn a_pin_on_the_path_scope_holds_every_checkpoint_of_its_path() {
        let mut d = StoreDelta::default();
        let mut s = three_deep(PinScope::Path, &mut d);
        let mut blocks = Vec::new();
        let hit = s.lookup(NS, &[1, 2, 3, 4, 5, 6, 7], &mut blocks);
        assert_eq!(hit.hit_tokens, 6);
        // 36 of 38 bytes are on the pinned path: no room for the new end's checkpoint.
        assert_eq!(s.reserve_checkpoint_for(&hit.pin, &mut d).unwrap(), None);
        assert!(d.freed_slots.is_empty());
        s.check_invariants().unwrap();
        s.release(hit.pin).unwrap();
        assert_eq!(s.bytes(), 36);
    }

    #[test]
    fn a_pin_on_the_hit_scope_holds_its_hit_checkpoint_and_the_kv_of_its_path() {
        // A returning conversation whose path holds every checkpoint the budget has room for
        // (Nemotron-H-56B at 2 GB: a checkpoint weighs 11,275 tokens of KV) can still
        // checkpoint its new end: the checkpoints above its hit go, their KV stays.
        const FULL: [u32; 8] = [1, 2, 3, 4, 5, 6, 7, 8];
        let mut d = StoreDelta::default();
        let mut s = three_deep(PinScope::HitCheckpoint, &mut d);
        let mut blocks = Vec::new();
        let hit = s.lookup(NS, &FULL[..7], &mut blocks);
        assert_eq!(hit.hit_tokens, 6);
        s.check_invariants().unwrap();
        d.clear();
        let slot = s.reserve_checkpoint_for(&hit.pin, &mut d).unwrap().unwrap();
        // The deepest checkpoint above the hit went; its KV stays (the path is pinned).
        assert_eq!(d.freed_slots.len(), 1);
        assert!(d.release_blocks.is_empty());
        assert_eq!(prefixes(&s), vec![vec![1, 2], vec![1, 2, 3, 4, 5, 6]]);
        assert_eq!(s.bytes(), 36);
        s.check_invariants().unwrap();
        d.clear();
        s.finish(hit.pin, &FULL, &table(&FULL, 1), &[(8, slot)], &mut d)
            .unwrap();
        s.check_invariants().unwrap();
        // The new end is cached; the bare [3,4] merged into [5,6] once unpinned.
        assert_eq!(
            prefixes(&s),
            vec![vec![1, 2], vec![1, 2, 3, 4, 5, 6], FULL.to_vec()]
        );
        assert_eq!(s.node_count(), 3 + 1);
        assert_eq!(s.bytes(), 38);
        assert_eq!(s.stats().evicted_checkpoints_only, 1);
    }

    #[test]
    fn a_checkpoint_that_another_sequence_hit_stays_while_it_runs() {
        let mut d = StoreDelta::default();
        let mut s = three_deep(PinScope::HitCheckpoint, &mut d);
        let mut blocks = Vec::new();
        let first = s.lookup(NS, &[1, 2, 3, 4, 5, 6, 7], &mut blocks);
        // A second sequence whose hit is [3,4], the checkpoint the first would give up first.
        let second = s.lookup(NS, &[1, 2, 3, 4, 9, 9], &mut blocks);
        assert_eq!(second.hit_tokens, 4);
        s.check_invariants().unwrap();
        let slot = s
            .reserve_checkpoint_for(&first.pin, &mut d)
            .unwrap()
            .unwrap();
        // [1,2] went instead: the first sequence holds [5,6], the second [3,4].
        assert_eq!(prefixes(&s), vec![vec![1, 2, 3, 4], vec![1, 2, 3, 4, 5, 6]]);
        s.check_invariants().unwrap();
        // Aborting both: the bare [1,2] merges into [3,4], nothing else changes.
        s.cancel_checkpoint(slot).unwrap();
        s.release(first.pin).unwrap();
        s.check_invariants().unwrap();
        s.release(second.pin).unwrap();
        s.check_invariants().unwrap();
        assert_eq!(s.node_count(), 2 + 1);
        assert_eq!(s.bytes(), 26);
    }

    #[test]
    fn the_budget_holds_when_a_sequence_does_not_fit() {
        let mut s = store(1, 15, BudgetScope::CheckpointsAndKv, 0.0);
        let mut d = StoreDelta::default();
        // 10 bytes of checkpoint + 8 of KV > 15: admitted, then evicted at once.
        serve(&mut s, NS, &[1], &(1..=8).collect::<Vec<_>>(), &mut d);
        assert_eq!(s.bytes(), 0);
        assert_eq!(d.retain_blocks, d.release_blocks);
        assert_eq!(s.node_count(), 0);
    }

    #[test]
    fn checkpoint_only_budget_ignores_kv_and_evict_for_kv_takes_leaves() {
        let mut s = store(2, 20, BudgetScope::Checkpoints, 0.0);
        let mut d = StoreDelta::default();
        serve(&mut s, NS, &[1, 1], &[1, 1, 2, 2], &mut d);
        serve(
            &mut s,
            NS,
            &[1, 1, 2, 2, 3, 3],
            &[1, 1, 2, 2, 3, 3, 4, 4],
            &mut d,
        );
        assert_eq!(s.bytes(), 20);
        assert_eq!(s.kv_bytes(), 8);
        d.clear();
        // Only the leaf frees KV; the single-child node [1,1,2,2] is not touched.
        assert_eq!(s.evict_for_kv(1, &mut d), 2);
        assert_eq!(d.release_blocks, vec![BlockId(302), BlockId(403)]);
        assert_eq!(prefixes(&s), vec![vec![1, 1, 2, 2]]);
        assert_eq!(s.evict_for_kv(5, &mut d), 2);
        assert_eq!(s.evict_for_kv(5, &mut d), 0);
        assert_eq!(s.node_count(), 0);
    }

    #[test]
    fn alpha_keeps_flop_efficient_nodes_over_recent_ones() {
        // Two leaves: a long old one (40 FLOPs over 50 bytes, 0.8 per byte) and a short recent
        // one (2 FLOPs over 12 bytes, 0.17). LRU drops the old one; with a large α the short
        // one goes.
        for (alpha, survivor) in [(0.0, vec![2u32, 2]), (5.0, (1..=40).collect::<Vec<u32>>())] {
            let mut s = store(1, 70, BudgetScope::CheckpointsAndKv, alpha);
            let mut d = StoreDelta::default();
            let long: Vec<u32> = (1..=40).collect();
            serve(&mut s, NS, &long[..1], &long, &mut d);
            serve(&mut s, NS, &[2], &[2, 2], &mut d);
            serve(&mut s, NS, &[3], &[3], &mut d); // 62 bytes held: a checkpoint more is over 70
            let kept = prefixes(&s);
            assert!(kept.contains(&survivor), "alpha {alpha}: {kept:?}");
            assert_eq!(kept.len(), 2, "alpha {alpha}: {kept:?}");
        }
    }

    #[test]
    fn a_node_with_one_child_is_valued_by_the_checkpoint_its_eviction_frees() {
        // A shared prefix (tokens 1..=20) cached, then one conversation below it (to 40): 60
        // bytes over a budget of 55. Evicting the prefix frees its checkpoint only (10 bytes,
        // the child keeps the KV): 20 FLOPs over 10 bytes, 2 per byte, against the leaf's 40
        // over 30, 1.33. With a large α the leaf goes and the prefix stays for the next
        // conversation (counting the prefix's KV, 20 over 30, made it the victim).
        let mut s = store(1, 55, BudgetScope::CheckpointsAndKv, 5.0);
        let mut d = StoreDelta::default();
        let prefix: Vec<u32> = (1..=20).collect();
        let long: Vec<u32> = (1..=40).collect();
        serve(&mut s, NS, &prefix, &prefix, &mut d);
        let hit = serve(&mut s, NS, &long[..30], &long, &mut d);
        assert_eq!(hit.hit_tokens, 20);
        assert_eq!(prefixes(&s), vec![prefix.clone()]);
        let other: Vec<u32> = (1..=20).chain([99, 98]).collect();
        assert_eq!(peek(&mut s, NS, &other).0, 20);
    }

    #[test]
    fn rejected_calls_change_nothing() {
        let mut s = store(2, 1000, BudgetScope::CheckpointsAndKv, 0.0);
        let mut d = StoreDelta::default();
        serve(&mut s, NS, &[1, 1], &[1, 1, 2, 2], &mut d);
        let mut blocks = Vec::new();
        let hit = s.lookup(NS, &[1, 1, 2, 2, 5, 5], &mut blocks);
        let slot = s.reserve_checkpoint(&mut d).unwrap();
        let before = (s.cached_checkpoints(), s.cached_blocks(), s.bytes());
        let t = [1, 1, 2, 2, 5, 5];
        let cases: Vec<(Result<FinishReport, SnapshotError>, SnapshotError)> = vec![
            (
                s.finish(
                    Pin {
                        index: hit.pin.index,
                        generation: 9,
                    },
                    &t,
                    &table(&t, 2),
                    &[(6, slot)],
                    &mut d,
                ),
                SnapshotError::StalePin {
                    index: hit.pin.index,
                    generation: 9,
                },
            ),
            (
                s.finish(
                    Pin { ..hit.pin },
                    &t,
                    &table(&t, 2)[..2],
                    &[(6, slot)],
                    &mut d,
                ),
                SnapshotError::TooFewBlocks {
                    got: 2,
                    tokens: 6,
                    block_size: 2,
                    needed: 3,
                },
            ),
            (
                s.finish(Pin { ..hit.pin }, &t, &table(&t, 2), &[(5, slot)], &mut d),
                SnapshotError::BadCheckpointPosition {
                    pos: 5,
                    block_size: 2,
                    limit: 6,
                },
            ),
            (
                s.finish(
                    Pin { ..hit.pin },
                    &t,
                    &table(&t, 2),
                    &[(4, slot), (2, slot)],
                    &mut d,
                ),
                SnapshotError::BadCheckpointPosition {
                    pos: 2,
                    block_size: 2,
                    limit: 6,
                },
            ),
            (
                s.finish(
                    Pin { ..hit.pin },
                    &t,
                    &table(&t, 2),
                    &[(2, slot), (4, slot)],
                    &mut d,
                ),
                SnapshotError::SlotNotReserved {
                    slot,
                    state: "listed twice",
                },
            ),
            (
                s.finish(
                    Pin { ..hit.pin },
                    &t,
                    &table(&t, 2),
                    &[(6, SlotId(0))],
                    &mut d,
                ),
                SnapshotError::SlotNotReserved {
                    slot: SlotId(0),
                    state: "cached",
                },
            ),
            (
                s.finish(
                    Pin { ..hit.pin },
                    &t,
                    &table(&t, 2),
                    &[(6, SlotId(99))],
                    &mut d,
                ),
                SnapshotError::SlotOutOfRange {
                    slot: SlotId(99),
                    slots: 16,
                },
            ),
        ];
        for (got, want) in cases {
            assert_eq!(got.unwrap_err(), want);
        }
        assert_eq!(
            s.commit_branch(&hit.pin, &t, 3, slot, &mut d).unwrap_err(),
            SnapshotError::BadCheckpointPosition {
                pos: 3,
                block_size: 2,
                limit: 6
            }
        );
        assert_eq!(
            (s.cached_checkpoints(), s.cached_blocks(), s.bytes()),
            before
        );
        s.check_invariants().unwrap();
        // The pin is still valid and the slot still reserved after all those refusals.
        s.finish(hit.pin, &t, &table(&t, 2), &[(6, slot)], &mut d)
            .unwrap();
        assert_eq!(prefixes(&s), vec![vec![1, 1, 2, 2], vec![1, 1, 2, 2, 5, 5]]);
        assert!(s.set_alpha(f64::NAN).is_err());
        assert_eq!(
            SnapshotStore::new(StoreConfig {
                checkpoint_slots: MAX_SLOTS + 1,
                ..s.config().clone()
            })
            .unwrap_err()
            .to_string(),
            "bad store config: `checkpoint_slots` is 16777217 (at most 16777216)"
        );
        assert_eq!(
            SnapshotStore::new(StoreConfig {
                block_size: 0,
                ..s.config().clone()
            })
            .unwrap_err(),
            SnapshotError::BadConfig {
                field: "block_size",
                value: "0".into(),
                limit: "at least 1"
            }
        );
    }

    #[test]
    fn a_used_pin_is_refused() {
        let mut s = store(1, 1000, BudgetScope::CheckpointsAndKv, 0.0);
        let mut blocks = Vec::new();
        let hit = s.lookup(NS, &[1], &mut blocks);
        let copy = Pin { ..hit.pin };
        s.release(hit.pin).unwrap();
        assert_eq!(
            s.release(copy).unwrap_err(),
            SnapshotError::StalePin {
                index: 0,
                generation: 0
            }
        );
        assert_eq!(s.node_count(), 0);
    }

    #[test]
    fn branch_commit_reports_duplicates_and_vanished_paths() {
        let mut s = store(1, 1000, BudgetScope::CheckpointsAndKv, 0.0);
        let mut d = StoreDelta::default();
        serve(&mut s, NS, &[1, 2], &[1, 2, 3, 4], &mut d);
        let mut blocks = Vec::new();
        let hit = s.lookup(NS, &[1, 2, 9], &mut blocks);
        assert_eq!(hit.branch_at, Some(2));
        let a = s.reserve_checkpoint(&mut d).unwrap();
        assert_eq!(
            s.commit_branch(&hit.pin, &[1, 2, 9], 2, a, &mut d).unwrap(),
            BranchOutcome::Admitted
        );
        let b = s.reserve_checkpoint(&mut d).unwrap();
        d.clear();
        assert_eq!(
            s.commit_branch(&hit.pin, &[1, 2, 9], 2, b, &mut d).unwrap(),
            BranchOutcome::Duplicate
        );
        assert_eq!(d.freed_slots, vec![b]);
        let c = s.reserve_checkpoint(&mut d).unwrap();
        assert_eq!(
            s.commit_branch(&hit.pin, &[1, 2, 9], 3, c, &mut d).unwrap(),
            BranchOutcome::PathGone
        );
        s.release(hit.pin).unwrap();
        s.check_invariants().unwrap();
        assert_eq!(s.slots().reserved_count(), 0);
    }

    #[test]
    fn every_block_admission_checkpoints_each_new_block() {
        let mut s = store(2, 1000, BudgetScope::CheckpointsAndKv, 0.0);
        s.config.admission = Admission::EveryBlock;
        assert_eq!(s.finish_positions(2, 7), 2..=3);
        assert_eq!(s.finish_positions(0, 1).count(), 0);
        s.config.admission = Admission::Marconi;
        assert_eq!(s.finish_positions(2, 7), 3..=3);
        assert_eq!(s.finish_positions(0, 1).count(), 0);
    }

    /// Serves `tokens` (input = output = `tokens`) reserving through the pin, as the simulator
    /// does; returns the hit length.
    fn serve_pinned(s: &mut SnapshotStore, tokens: &[u32], delta: &mut StoreDelta) -> usize {
        let mut blocks = Vec::new();
        let hit = s.lookup(NS, tokens, &mut blocks);
        let mut checkpoints = Vec::new();
        if let Some(slot) = s.reserve_checkpoint_for(&hit.pin, delta).unwrap() {
            checkpoints.push((tokens.len(), slot));
        }
        let hit_tokens = hit.hit_tokens;
        s.finish(hit.pin, tokens, &table(tokens, 1), &checkpoints, delta)
            .unwrap();
        s.check_invariants().unwrap();
        hit_tokens
    }

    /// Serves each of `members` once (each misses), then all of them `rounds` times in turn
    /// (each hits whole): every hit is then `2 · members.len() − 1` clock ticks old (a lookup
    /// and a finish tick per request).
    fn warm_round_robin(
        s: &mut SnapshotStore,
        members: &[Vec<u32>],
        rounds: usize,
        delta: &mut StoreDelta,
    ) {
        for seq in members {
            assert_eq!(serve_pinned(s, seq, delta), 0);
        }
        for _ in 0..rounds {
            for seq in members {
                assert_eq!(serve_pinned(s, seq, delta), seq.len());
            }
        }
    }

    #[test]
    fn guarded_admission_keeps_live_entries_from_missed_sequences() {
        // Room for three 5-token sequences (15 bytes each) and one checkpoint more.
        let (a, b, c, d, e) = (
            [1u32; 5].to_vec(),
            [2u32; 5].to_vec(),
            [3u32; 5].to_vec(),
            [4u32; 5].to_vec(),
            [5u32; 5].to_vec(),
        );
        for guard in [false, true] {
            let mut s = store(1, 55, BudgetScope::CheckpointsAndKv, 0.0);
            s.set_guard(guard);
            let mut dl = StoreDelta::default();
            // 18 round-robin hits: every hit is 5 clock ticks old, the 90th percentile of hit
            // ages; entries unused for more than 7 ticks are dead.
            warm_round_robin(&mut s, &[a.clone(), b.clone(), c.clone()], 6, &mut dl);
            // A new sequence misses. Plain admission evicts the least recently used (a);
            // guarded admission evicts its own checkpoint instead: a, b, c are all live.
            assert_eq!(serve_pinned(&mut s, &d, &mut dl), 0);
            let expected = if guard {
                vec![a.clone(), b.clone(), c.clone()]
            } else {
                vec![b.clone(), c.clone(), d.clone()]
            };
            assert_eq!(prefixes(&s), expected, "guard {guard}");
            if guard {
                // b and c stay in use, a goes stale: the next newcomer takes a's place.
                for _ in 0..2 {
                    for seq in [&b, &c] {
                        assert_eq!(serve_pinned(&mut s, seq, &mut dl), 5);
                    }
                }
                assert_eq!(serve_pinned(&mut s, &e, &mut dl), 0);
                assert_eq!(prefixes(&s), vec![b.clone(), c.clone(), e.clone()]);
            }
        }
    }

    #[test]
    fn a_guarded_store_lets_a_conversation_back_in_only_past_entries_colder_than_it() {
        // Room for six 5-token members (15 bytes each) and one checkpoint more. Round-robin
        // hits are 11 ticks old (a lookup and a finish tick per request): nothing is dead
        // before 16 ticks unused.
        let members: Vec<Vec<u32>> = (1..=6).map(|t| vec![t; 5]).collect();
        let turn1 = vec![9u32; 5];
        let turn2 = [turn1.clone(), vec![8; 3]].concat();
        let turn3 = [turn2.clone(), vec![7; 2]].concat();
        let warm = || {
            let mut s = store(1, 100, BudgetScope::CheckpointsAndKv, 0.0);
            s.set_guard(true);
            let mut dl = StoreDelta::default();
            warm_round_robin(&mut s, &members, 4, &mut dl);
            // A new conversation misses and may not displace a live member: kept out.
            assert_eq!(serve_pinned(&mut s, &turn1, &mut dl), 0);
            assert_eq!(prefixes(&s), members);
            (s, dl)
        };
        // Its next turn comes at once (a gap of 1 tick: its own dead age is 1, the guard asks
        // for 2): the least recently used member, unused for 13 ticks, makes room, and the
        // turn after hits.
        let (mut s, mut dl) = warm();
        assert_eq!(serve_pinned(&mut s, &turn2, &mut dl), 0);
        let mut expected = members[1..].to_vec();
        expected.push(turn2.clone());
        assert_eq!(prefixes(&s), expected);
        assert_eq!(serve_pinned(&mut s, &turn3, &mut dl), 8);
        // After two members' turns it comes back 5 ticks later (own dead age 7, the guard asks
        // for 14): the coldest member, unused for 13 ticks, is reused more often than that,
        // so the conversation stays out (the unguarded rule would have let it in).
        let (mut s, mut dl) = warm();
        for seq in &members[..2] {
            assert_eq!(serve_pinned(&mut s, seq, &mut dl), 5);
        }
        assert_eq!(serve_pinned(&mut s, &turn2, &mut dl), 0);
        assert_eq!(prefixes(&s), members);
    }

    #[test]
    fn a_guarded_reservation_for_a_missed_sequence_evicts_no_live_entry() {
        let mut s = store(1, 30, BudgetScope::CheckpointsAndKv, 0.0);
        s.set_guard(true);
        let mut dl = StoreDelta::default();
        let (a, b) = ([1u32; 5].to_vec(), [2u32; 5].to_vec());
        serve_pinned(&mut s, &a, &mut dl);
        for _ in 0..16 {
            assert_eq!(serve_pinned(&mut s, &a, &mut dl), 5);
        }
        // 15 bytes held; a second checkpoint fits, a third would need a's room.
        let mut blocks = Vec::new();
        let miss = s.lookup(NS, &b, &mut blocks);
        let first = s.reserve_checkpoint_for(&miss.pin, &mut dl).unwrap();
        assert!(first.is_some());
        assert_eq!(s.reserve_checkpoint_for(&miss.pin, &mut dl).unwrap(), None);
        assert_eq!(prefixes(&s), vec![a.clone()]);
        // A sequence that hit may take the room of live entries.
        let mut blocks = Vec::new();
        let hit = s.lookup(NS, &a, &mut blocks);
        assert_eq!(hit.hit_tokens, 5);
        s.release(hit.pin).unwrap();
        s.cancel_checkpoint(first.unwrap()).unwrap();
        s.release(miss.pin).unwrap();
        s.check_invariants().unwrap();
    }

    #[test]
    fn a_conversation_that_lost_its_own_entry_keeps_the_next_one() {
        // Two 20-token members (30 bytes each) and room for one checkpoint more; α = 5 on the
        // whole prefix's FLOPs: a 20-token entry saves 20 per 30 bytes, a fresh 5-token one 5
        // per 15, so the fresh one is the lowest score however recent it is.
        let members: Vec<Vec<u32>> = (1..=2).map(|t| vec![t; 20]).collect();
        let mut s = store(1, 70, BudgetScope::CheckpointsAndKv, 5.0);
        let mut dl = StoreDelta::default();
        // Round-robin hits 3 ticks old: the dead age is 4 ticks.
        warm_round_robin(&mut s, &members, 8, &mut dl);
        // A conversation starts; its first turn's entry is evicted at its own finish.
        let turn1 = vec![9u32; 5];
        let turn2 = [turn1.clone(), vec![6; 3]].concat();
        let turn3 = [turn2.clone(), vec![7; 2]].concat();
        assert_eq!(serve_pinned(&mut s, &turn1, &mut dl), 0);
        assert_eq!(prefixes(&s), members);
        // Its next turn comes one tick later and misses: back after a gap of 1, an entry unused
        // for longer than 1 tick (the least recently used member) makes room for it rather than
        // its own new entry (8 per 18 bytes, still the lowest score), and the turn after hits
        // it. Without the return, every turn would miss and lose its entry the same way.
        assert_eq!(serve_pinned(&mut s, &turn2, &mut dl), 0);
        assert_eq!(prefixes(&s), vec![members[1].clone(), turn2.clone()]);
        assert_eq!(serve_pinned(&mut s, &turn3, &mut dl), 8);
        // A new sequence that extends nothing lost is scored as before: its entry goes.
        let other = vec![8u32; 6];
        assert_eq!(serve_pinned(&mut s, &other, &mut dl), 0);
        assert!(!prefixes(&s).contains(&other));
    }

    #[test]
    fn recency_bases_differ_on_checkpoints_in_the_middle_of_a_sequence() {
        // x = [1,1] becomes the middle of the sequence [1,1,5,5]; z = [3,3] the middle of
        // [3,3,6,6], and `edits` lookups diverge right after z (hits in the middle); then a
        // request goes through x to [1,1,5,5]. One slot is then needed: who goes?
        let run = |recency: Recency, edits: usize| {
            let mut s = SnapshotStore::new(StoreConfig {
                checkpoint_slots: 5,
                budget_bytes: 1000,
                budget_scope: BudgetScope::Checkpoints,
                recency,
                ..store(1, 1000, BudgetScope::Checkpoints, 0.0)
                    .config()
                    .clone()
            })
            .unwrap();
            let mut dl = StoreDelta::default();
            serve(&mut s, NS, &[1], &[1, 1], &mut dl);
            serve(&mut s, NS, &[1, 1, 5], &[1, 1, 5, 5], &mut dl);
            serve(&mut s, NS, &[3], &[3, 3], &mut dl);
            serve(&mut s, NS, &[3, 3, 6], &[3, 3, 6, 6], &mut dl);
            serve(&mut s, NS, &[2], &[2, 2], &mut dl);
            for _ in 0..edits {
                assert_eq!(peek(&mut s, NS, &[3, 3, 8]).0, 2);
            }
            assert_eq!(peek(&mut s, NS, &[1, 1, 5, 5, 7]).0, 4);
            assert_eq!(s.stats().mid_hits, edits as u64);
            let slot = s.reserve_checkpoint(&mut dl).unwrap();
            s.cancel_checkpoint(slot).unwrap();
            s.check_invariants().unwrap();
            let all = [
                vec![1, 1],
                vec![1, 1, 5, 5],
                vec![2, 2],
                vec![3, 3],
                vec![3, 3, 6, 6],
            ];
            let kept = prefixes(&s);
            let gone: Vec<Vec<u32>> = all.into_iter().filter(|p| !kept.contains(p)).collect();
            gone
        };
        // Path: going through x refreshed it; [3,3,6,6] is the least recently used.
        assert_eq!(run(Recency::Path, 4), vec![vec![3, 3, 6, 6]]);
        // Own and Shared: x was last hit itself before anything else happened.
        assert_eq!(run(Recency::Own, 4), vec![vec![1, 1]]);
        assert_eq!(run(Recency::Shared, 4), vec![vec![1, 1]]);
        // Adaptive: three middle hits of the last ones (4.7%) keep it shared; four (6.1%)
        // make going through refresh, as Path does.
        assert_eq!(run(Recency::Adaptive, 3), vec![vec![1, 1]]);
        assert_eq!(run(Recency::Adaptive, 4), vec![vec![3, 3, 6, 6]]);
    }
}
