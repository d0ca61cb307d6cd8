//! The router's cache bookkeeping in one place: the KV block pool (`kv-cache`), and the prefix
//! index that decides what a new sequence may reuse: the hash-chain prefix cache of `kv-cache` for
//! attention-only models, the Marconi store of `ssm-snapshot` for hybrid ones.
//!
//! # Reference ownership
//!
//! Every block id a sequence lists holds exactly one pool reference owned by that sequence:
//! - a fresh block comes from [`Caches::allocate`] with its one reference;
//! - a hash-chain hit comes from `KvCache::match_prefix`, which takes the reference for the caller;
//! - a Marconi hit lists the tree's blocks, and [`Caches::lookup`] takes one more reference on
//!   each for the sequence (the tree keeps its own).
//!
//! The Marconi tree's own references move only through [`StoreDelta`]s, applied here
//! (`retain_blocks` before `release_blocks`); its freed checkpoint slots need no memory work (the
//! state rows are simply reused). A block is free in the pool only when neither a sequence nor the
//! tree nor the hash chain's index holds it, so no block is ever released twice.

use kv_cache::{BlockId, ExtraKey, KvCache, KvCacheConfig};
use model::{Config, LayerKind, Model};
use ssm_snapshot::tuning::RecordedRequest;
use ssm_snapshot::{
    AlphaTuner, CostCoefficients, CostModel, HybridDims, Pin, SlotId, SnapshotStore, StoreConfig,
    StoreDelta,
};
use xxhash_rust::xxh3::xxh3_64;

use crate::events::{Adoption, Events, Listed};
use crate::{BookError, Namespace};

/// The Marconi tree's hold on a running sequence's hit path.
pub type PinHandle = Pin;
/// A checkpoint slot of the prefix cache's region.
pub type CheckpointSlot = SlotId;

/// What a new sequence attaches on its first chunk.
#[derive(Debug)]
pub struct Attach {
    /// Tokens served from the cache (a multiple of the block size).
    pub len: usize,
    /// The blocks of `0..len`, each with one reference taken for the sequence.
    pub blocks: Vec<u32>,
    /// The checkpoint whose state is the state after `len` tokens (hybrid hits).
    pub checkpoint: Option<SlotId>,
    /// Where the Marconi tree asks for a checkpoint during this prefill.
    pub branch_point: Option<usize>,
    /// The pinned hit path (hybrid models with caching on).
    pub pin: Option<Pin>,
}

/// Prefix-cache counters for reports.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct CacheStats {
    /// Lookups made by first prefill chunks.
    pub lookups: u64,
    /// Tokens those lookups served from the cache.
    pub hit_tokens: u64,
    /// Checkpoints the Marconi tree holds now.
    pub checkpoints: u64,
    /// Checkpoints the Marconi tree admitted so far (branch points, ends of input and output).
    pub checkpoints_taken: u64,
    /// Lookups the Marconi tree answered with a checkpoint (hits that restored SSM state).
    pub checkpoint_hits: u64,
    /// Checkpoints the Marconi tree evicted so far (leaves, and single-child nodes merged).
    pub checkpoints_evicted: u64,
    /// The Marconi eviction weight α now in use (`None` without a Marconi store).
    pub alpha: Option<f64>,
    /// The Marconi store's recency basis now: `path`, `own`, `shared` or `adaptive` (`None`
    /// without a Marconi store).
    pub recency: Option<&'static str>,
    /// The Marconi store's FLOP basis now: `prefix` or `marginal` (`None` without a Marconi
    /// store).
    pub flop_basis: Option<&'static str>,
    /// Whether the Marconi store's guarded admission is on now (`None` without a Marconi store).
    pub guard: Option<bool>,
    /// How many times the tuner changed the eviction setting (`None` when no tuner runs:
    /// `marconi: false`, or no Marconi store).
    pub tuner_switches: Option<u64>,
    /// Checkpoint hits after which the MTP head is a cold run's: the checkpoint is marked
    /// ([`HeadMark`]) and every cached position before the rerun holds head K/V its writer
    /// computed exactly for this path ([`Caches::head_vouched`]). Counted on a router that reruns
    /// the head at a hit (`BookShape::head_rerun`), as are the next three.
    pub head_exact_hits: u64,
    /// Checkpoint hits on a marked checkpoint where a cached position before the rerun holds head
    /// K/V written for another path (its writer's next token differed) or never computed
    /// exactly, or whose mark needs no rerun but was made with another token at the checkpoint
    /// ([`HeadMark::next`]): the head reruns over the marked positions, if any, but it is not a
    /// cold run's (drafts may differ; the output never does), and the sequence marks none of
    /// its own checkpoints.
    pub head_unvouched_hits: u64,
    /// Checkpoint hits on an unmarked checkpoint (its taker's head was not exact there, its ring
    /// lacked the positions, or a head with Mamba layers did not lag there): no rerun; the head
    /// is not a cold run's.
    pub head_unmarked_hits: u64,
    /// Checkpoint hits on a marked checkpoint whose rerun would copy blocks the pool cannot hold
    /// beside a sequence of `max_context` tokens: served without the rerun, so that a hit never
    /// needs more blocks than no hit; the head is not a cold run's (drafts may differ from one;
    /// the output never does).
    pub head_skipped_hits: u64,
}

/// What a checkpoint hit made of the MTP head (see [`CacheStats::head_exact_hits`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HeadHit {
    /// A rerun over a marked checkpoint whose cached K/V are vouched for: a cold run's head.
    Exact,
    /// A rerun over a marked checkpoint with cached K/V not vouched for.
    Unvouched,
    /// No rerun: the checkpoint is unmarked.
    Unmarked,
    /// No rerun: the checkpoint is marked, but the pool cannot hold the rerun's copies beside a
    /// sequence of `max_context` tokens.
    Skipped,
}

/// The MTP head's part of a finished sequence's offer to the prefix cache: its head consumed
/// positions `0..exact` with the sequence's own next tokens (`MtpTrack::exact`), and `next` is
/// the sequence's token after the offered ones, when known.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeadOffer {
    /// Positions the head consumed exactly, from the first.
    pub exact: usize,
    /// The token after the offered tokens.
    pub next: Option<u32>,
}

/// What the writer of a cached block vouches for about the MTP head's K/V in it: the first
/// `exact` positions of the block were consumed with the writer's own next tokens, and `next`
/// is the writer's token after the block (the one the block's last position was consumed with).
/// Every position but the last has its next token inside the block, which any path through
/// the block shares; the last one's is right for a path only when that path continues with
/// `next`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct BlockHead {
    exact: usize,
    next: Option<u32>,
}

/// [`Caches::head_vouched`] over the records `heads` (per block id) of blocks of `size` tokens.
fn vouched(
    heads: &[Option<BlockHead>],
    size: usize,
    blocks: &[u32],
    tokens: &[u32],
    upto: usize,
) -> usize {
    for (index, &block) in blocks.iter().enumerate() {
        let start = index * size;
        if start >= upto {
            break;
        }
        let Some(Some(head)) = heads.get(block as usize) else {
            return start;
        };
        if head.exact < size {
            return upto.min(start + head.exact);
        }
        let last = start + size - 1;
        if last < upto && tokens.get(last + 1) != head.next.as_ref() {
            return last;
        }
    }
    upto.min(blocks.len() * size)
}

enum Index {
    /// No prefix reuse.
    Off,
    /// The hash-chain prefix cache inside `kv` (attention-only models).
    HashChain,
    /// The Marconi store (hybrid models), with its α tuner when `marconi: true`.
    Marconi(Box<SnapshotStore>, Option<Box<AlphaTuner>>),
}

/// What the pool and the prefix index are built for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheConfig {
    /// KV blocks in the pool.
    pub num_blocks: usize,
    /// Tokens per block.
    pub block_size: usize,
    /// Whether the model has Mamba layers (the Marconi tree indexes prefixes then).
    pub hybrid: bool,
    /// Checkpoint slots of the Marconi region (0: no hybrid prefix reuse).
    pub checkpoint_slots: usize,
    /// Whether finished sequences are offered to a prefix cache.
    pub prefix_cache: bool,
    /// On a hybrid model, whether the tuned Marconi policy evicts (else LRU).
    pub marconi: bool,
}

/// The pool and the prefix index (see the module docs for who holds which reference).
pub struct Caches {
    kv: KvCache,
    index: Index,
    delta: StoreDelta,
    scratch_blocks: Vec<BlockId>,
    lookups: u64,
    hit_tokens: u64,
    events: Events,
    /// Per checkpoint slot index: the MTP head's mark on the checkpoint it holds
    /// ([`HeadMark`]); cleared whenever the slot is handed out again.
    head_marks: std::collections::BTreeMap<usize, HeadMark>,
    /// Per block id, on a model with an MTP head: what the writer of a block the Marconi tree
    /// adopted vouches for ([`BlockHead`]); written whenever the tree adopts the block (`None`
    /// when its writer had no head track), so every block the tree holds has its writer's.
    head_blocks: Vec<Option<BlockHead>>,
    /// Tokens per block.
    block_size: usize,
    /// Checkpoint hits by what they made of the MTP head: exact, unvouched, unmarked, skipped.
    head_hits: [u64; 4],
}

/// What a router stored with a checkpoint for the MTP head (`router_book::spec`'s prefix-hit
/// rule): the main model's hidden states at positions `from..pos` (`pos` the checkpoint's
/// position), and the promise that the head's K/V before `from` in the sequence's blocks were
/// computed with the sequence's own next tokens (and that its state in the checkpoint is its
/// state before `from`). A hit at `pos` then reruns the head over `from..pos` with the new
/// sequence's tokens instead of trusting the K/V there. The promise is about the marking
/// sequence's blocks: the tree may keep other blocks for `0..from` (another sequence's, which
/// it adopted first, or the originals of blocks the marking sequence copied for its own rerun),
/// so a hit also checks the blocks it is served ([`Caches::head_vouched`]).
///
/// A mark with `from == pos` stores nothing: a head with Mamba layers whose prefill plan ended at
/// the checkpoint consumed `pos - 1` already (its state in the checkpoint is past it, so a rerun
/// there would consume it twice), with the marking sequence's token `next` at `pos`; a hit whose
/// token at `pos` is `next` needs no rerun, and any other finds the head not a cold run's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeadMark {
    /// The checkpoint's position.
    pub pos: usize,
    /// The first position whose hidden state is stored.
    pub from: usize,
    /// For a mark with `from == pos`: the marking sequence's token at `pos`, with which its head
    /// consumed `pos - 1`; `None` for a mark the hit reruns.
    pub next: Option<u32>,
}

impl std::fmt::Debug for Caches {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Caches")
            .field("free_blocks", &self.free_blocks())
            .field("cached_blocks", &self.cached_blocks())
            .field("checkpoint_slots_used", &self.checkpoint_slots_used())
            .finish_non_exhaustive()
    }
}

fn extra_key(ns: Namespace) -> ExtraKey {
    ExtraKey {
        lora_adapter: ns.adapter,
        cache_salt: ns.cache_salt,
    }
}

/// The Marconi store keys namespaces by a plain `(adapter, salt)` pair; presence matters too
/// (no salt is not salt 0), so the salt field carries a hash of both options.
fn store_namespace(ns: Namespace) -> ssm_snapshot::Namespace {
    let mut bytes = [0u8; 14];
    bytes[0] = u8::from(ns.adapter.is_some());
    bytes[1] = u8::from(ns.cache_salt.is_some());
    bytes[2..6].copy_from_slice(&ns.adapter.unwrap_or(0).to_le_bytes());
    bytes[6..14].copy_from_slice(&ns.cache_salt.unwrap_or(0).to_le_bytes());
    ssm_snapshot::Namespace {
        adapter: ns.adapter.unwrap_or(0),
        salt: xxh3_64(&bytes),
    }
}

/// The cost model of `config` as the host computes it (f32 values).
pub fn cost_model(config: &Config) -> Result<CostModel, BookError> {
    let mlp = config.count(LayerKind::Mlp);
    let moe = config.count(LayerKind::Moe);
    let moe_width = config.num_experts_per_tok * config.moe_intermediate_size
        + config.moe_shared_expert_intermediate_size;
    // One width stands for both kinds of feed-forward layer: their layer-weighted mean.
    let mlp_intermediate = (mlp * config.intermediate_size + moe * moe_width)
        .checked_div(mlp + moe)
        .unwrap_or(0);
    let dims = HybridDims {
        name: "host-model".to_string(),
        hidden_size: config.hidden_size as u64,
        attention_layers: config.count(LayerKind::Attention) as u32,
        num_attention_heads: config.num_attention_heads as u64,
        num_key_value_heads: config.num_key_value_heads as u64,
        head_dim: config.head_dim as u64,
        mamba_layers: config.count(LayerKind::Mamba) as u32,
        mamba_num_heads: config.mamba_num_heads as u64,
        mamba_head_dim: config.mamba_head_dim as u64,
        ssm_state_size: config.ssm_state_size as u64,
        n_groups: config.n_groups as u64,
        conv_kernel: config.conv_kernel as u64,
        mlp_layers: (mlp + moe) as u32,
        mlp_intermediate: mlp_intermediate as u64,
        mlp_matrices: 2,
        elem_bytes: 4,
    };
    if dims.attention_layers > 0 {
        return CostModel::from_dims(&dims).map_err(|err| BookError::Cache(err.to_string()));
    }
    // `CostModel` insists on positive KV bytes per token, which a model without attention does
    // not have. Its checkpoint budget does not count KV here, and KV bytes only enter the
    // eviction score as part of a node's size next to its checkpoint, so one nominal byte per
    // token keeps every ratio as it is. The FLOP terms follow `CostModel::from_dims`'s documented
    // formulas for the Mamba2 and MLP layers.
    let d = dims.hidden_size as f64;
    let e = (dims.mamba_num_heads * dims.mamba_head_dim) as f64;
    let n = dims.ssm_state_size as f64;
    let g = dims.n_groups as f64;
    let h = dims.mamba_num_heads as f64;
    let inner = dims.mamba_num_heads * dims.mamba_head_dim;
    let state = inner * dims.ssm_state_size
        + dims.conv_kernel * (inner + 2 * dims.n_groups * dims.ssm_state_size);
    CostModel::new(CostCoefficients {
        name: dims.name,
        attention_layers: 0,
        mamba_layers: dims.mamba_layers,
        mlp_layers: dims.mlp_layers,
        attention_linear_flops_per_token: 0.0,
        attention_quadratic_flops: 0.0,
        mamba_flops_per_token: 2.0 * d * (2.0 * e + 2.0 * g * n + h)
            + 2.0 * e * d
            + 8.0 * e * n
            + 5.0 * e,
        mlp_flops_per_token: 2.0 * dims.mlp_matrices as f64 * d * dims.mlp_intermediate as f64,
        kv_bytes_per_token: 1,
        checkpoint_bytes: u64::from(dims.mamba_layers) * state * dims.elem_bytes,
    })
    .map_err(|err| BookError::Cache(err.to_string()))
}

impl Caches {
    /// The pool and the index `config` asks for, for `model`.
    pub fn new(model: &Model, config: &CacheConfig) -> Result<Self, BookError> {
        let kv = KvCache::new(KvCacheConfig::new(config.num_blocks, config.block_size))
            .map_err(|err| BookError::Cache(err.to_string()))?;
        let index = if !config.prefix_cache {
            Index::Off
        } else if !config.hybrid {
            Index::HashChain
        } else if config.checkpoint_slots == 0 {
            // A hybrid hit needs a checkpoint; with no region there is nothing to reuse.
            Index::Off
        } else {
            let cost = cost_model(model.config())?;
            let slots =
                u32::try_from(config.checkpoint_slots).map_err(|_| BookError::BadConfig {
                    field: "checkpoints",
                    value: config.checkpoint_slots as u64,
                    limit: "at most u32::MAX - 1 slots".to_string(),
                })?;
            let mut store_config = StoreConfig::engine(
                cost.clone(),
                config.block_size as u32,
                u64::from(slots) * cost.checkpoint_bytes(),
            );
            store_config.checkpoint_slots = slots;
            // Plain LRU (α = 0, path recency: SGLang's policy); `marconi: false` keeps it, and
            // `marconi: true` starts there, the setting its tuner falls back to.
            store_config.alpha = 0.0;
            store_config.recency = ssm_snapshot::Recency::Path;
            let cache_err = |err: ssm_snapshot::SnapshotError| BookError::Cache(err.to_string());
            let store = SnapshotStore::new(store_config).map_err(cache_err)?;
            // `marconi: true` tunes the eviction the way `ssm-snapshot` measured best: shadow
            // stores over a grid of α, FLOP basis and guarded admission, following the leader.
            let tuner = if config.marconi {
                let mode = ssm_snapshot::tuning::default_tuning();
                Some(Box::new(AlphaTuner::new(mode, &store).map_err(cache_err)?))
            } else {
                None
            };
            Index::Marconi(Box::new(store), tuner)
        };
        let events = Events::new(match index {
            Index::Marconi(..) => config.num_blocks,
            _ => 0,
        });
        Ok(Caches {
            kv,
            index,
            delta: StoreDelta::default(),
            scratch_blocks: Vec::new(),
            lookups: 0,
            hit_tokens: 0,
            events,
            head_marks: std::collections::BTreeMap::new(),
            head_blocks: if model.has_mtp() {
                vec![None; config.num_blocks]
            } else {
                Vec::new()
            },
            block_size: config.block_size,
            head_hits: [0; 4],
        })
    }

    /// Whether sequences keep a checkpoint at their latest block boundary for the Marconi tree.
    pub fn wants_end_checkpoints(&self) -> bool {
        matches!(self.index, Index::Marconi(..))
    }

    pub fn free_blocks(&self) -> usize {
        self.kv.pool().free_blocks()
    }

    /// The pool's size in blocks.
    pub fn num_blocks(&self) -> usize {
        self.kv.pool().num_blocks()
    }

    /// Cached blocks that `allocate` can take back without evicting from the Marconi tree.
    pub fn evictable_blocks(&self) -> usize {
        self.kv.pool().cached_blocks()
    }

    /// Blocks the prefix cache keeps (held by a sequence or not), each counted once.
    pub fn cached_blocks(&self) -> usize {
        match &self.index {
            Index::Off => 0,
            Index::HashChain => self.kv.pool().registered_blocks(),
            Index::Marconi(store, _) => store.held_block_count() as usize,
        }
    }

    pub fn checkpoint_slots_used(&self) -> usize {
        match &self.index {
            Index::Marconi(store, _) => {
                (store.slots().cached_count() + store.slots().reserved_count()) as usize
            }
            _ => 0,
        }
    }

    pub fn stats(&self) -> CacheStats {
        CacheStats {
            lookups: self.lookups,
            hit_tokens: self.hit_tokens,
            checkpoints: match &self.index {
                Index::Marconi(store, _) => u64::from(store.slots().cached_count()),
                _ => 0,
            },
            head_exact_hits: self.head_hits[0],
            head_unvouched_hits: self.head_hits[1],
            head_unmarked_hits: self.head_hits[2],
            head_skipped_hits: self.head_hits[3],
            ..self.marconi_counts()
        }
    }

    /// The Marconi store's lifetime counters and its setting (zero and `None` without a store).
    fn marconi_counts(&self) -> CacheStats {
        match &self.index {
            Index::Marconi(store, tuner) => {
                let stats = store.stats();
                let setting = store.config();
                CacheStats {
                    alpha: Some(setting.alpha),
                    recency: Some(setting.recency.name()),
                    flop_basis: Some(setting.flop_basis.name()),
                    guard: Some(setting.guard),
                    tuner_switches: tuner.as_ref().map(|tuner| tuner.history().len() as u64),
                    checkpoints_taken: stats.admitted_checkpoints,
                    checkpoint_hits: stats.hits,
                    checkpoints_evicted: stats.evicted_leaves + stats.evicted_checkpoints_only,
                    ..CacheStats::default()
                }
            }
            _ => CacheStats::default(),
        }
    }

    /// Applies a Marconi delta to the pool: new references first, then dropped ones. The cache
    /// events see it first: `adoption` is the finishing sequence the tree adopted blocks from,
    /// `cleared` says the tree is empty after it.
    fn apply_delta(
        kv: &mut KvCache,
        delta: &mut StoreDelta,
        events: &mut Events,
        adoption: Option<Adoption<'_>>,
        cleared: bool,
    ) {
        events.tree_delta(kv, delta, adoption, cleared);
        for &block in &delta.retain_blocks {
            if let Err(err) = kv.pool_mut().retain(block) {
                tracing::error!(%err, "the Marconi tree adopted a block nobody held");
            }
        }
        for &block in &delta.release_blocks {
            if let Err(err) = kv.pool_mut().release(block) {
                tracing::error!(%err, "the Marconi tree released a block it did not hold");
            }
        }
        delta.clear();
    }

    /// One block with one reference; evicts from the Marconi tree when the pool is dry (the
    /// pool itself evicts hash-chain blocks). `None` when nothing can be freed.
    pub fn allocate(&mut self) -> Option<u32> {
        let block = loop {
            if let Ok(block) = self.kv.pool_mut().allocate() {
                break Some(block.0);
            }
            let Index::Marconi(store, _) = &mut self.index else {
                break None;
            };
            let released = store.evict_for_kv(1, &mut self.delta);
            Self::apply_delta(&mut self.kv, &mut self.delta, &mut self.events, None, false);
            if released == 0 {
                break None;
            }
        };
        // The pool evicts hash-chain blocks itself.
        self.events.flush_kv();
        block
    }

    /// Drops one reference the router holds on `block`.
    pub fn release(&mut self, block: u32) {
        if let Err(err) = self.kv.pool_mut().release(BlockId(block)) {
            tracing::error!(%err, "released a block the router did not hold");
            debug_assert!(false, "double release of block {block}: {err}");
        }
    }

    /// The longest reusable prefix of `tokens` (already without the prompt's last token), with
    /// references taken for the sequence and, on a hybrid model, the hit path pinned.
    pub fn lookup(&mut self, ns: Namespace, tokens: &[u32]) -> Attach {
        let mut attach = Attach {
            len: 0,
            blocks: Vec::new(),
            checkpoint: None,
            branch_point: None,
            pin: None,
        };
        match &mut self.index {
            Index::Off => {}
            Index::HashChain => {
                let found = self.kv.match_prefix(tokens, extra_key(ns));
                attach.len = found.tokens;
                attach.blocks = found.blocks.iter().map(|b| b.0).collect();
            }
            Index::Marconi(store, _) => {
                let hit = store.lookup(store_namespace(ns), tokens, &mut self.scratch_blocks);
                for &block in &self.scratch_blocks {
                    // The tree holds each listed block, so a retain cannot find it free.
                    if let Err(err) = self.kv.pool_mut().retain(block) {
                        tracing::error!(%err, "a Marconi hit listed a block the tree did not hold");
                    }
                    attach.blocks.push(block.0);
                }
                attach.len = hit.hit_tokens;
                attach.checkpoint = hit.checkpoint;
                attach.branch_point = hit.branch_at;
                attach.pin = Some(hit.pin);
            }
        }
        self.lookups += 1;
        self.hit_tokens += attach.len as u64;
        attach
    }

    /// Gives back what a lookup took, for a step that was refused after its lookups.
    pub fn undo_attach(&mut self, attach: Attach) {
        self.lookups -= 1;
        self.hit_tokens -= attach.len as u64;
        for block in attach.blocks {
            self.release(block);
        }
        if let Some(pin) = attach.pin {
            self.unpin(pin);
        }
    }

    pub fn unpin(&mut self, pin: Pin) {
        if let Index::Marconi(store, _) = &mut self.index {
            if let Err(err) = store.release(pin) {
                tracing::error!(%err, "released a Marconi pin twice");
            }
        }
    }

    /// A checkpoint slot to copy a state into for the sequence holding `pin` (evicting cached
    /// checkpoints if the region is full); `None` when the region is held entirely by running
    /// sequences, or when guarded admission refuses a sequence that missed the cache.
    pub fn take_checkpoint_slot(&mut self, pin: Option<&Pin>) -> Option<SlotId> {
        let Index::Marconi(store, _) = &mut self.index else {
            return None;
        };
        let slot = match pin {
            Some(pin) => store
                .reserve_checkpoint_for(pin, &mut self.delta)
                .unwrap_or_else(|err| {
                    tracing::error!(%err, "checkpoint reserved under a stale pin");
                    None
                }),
            None => store.reserve_checkpoint(&mut self.delta),
        };
        Self::apply_delta(&mut self.kv, &mut self.delta, &mut self.events, None, false);
        if let Some(slot) = slot {
            // Whatever the slot held before is gone, and so is its mark.
            self.head_marks.remove(&slot.index());
        }
        slot
    }

    /// Marks checkpoint `slot` (taken, holding the state at `mark.pos`) as carrying the MTP
    /// head's hidden states `mark.from..mark.pos` (see [`HeadMark`]).
    pub fn mark_head(&mut self, slot: SlotId, mark: HeadMark) {
        self.head_marks.insert(slot.index(), mark);
    }

    /// The MTP head's mark on checkpoint `slot`, if the router stored one since it was taken.
    pub fn head_mark(&self, slot: SlotId) -> Option<HeadMark> {
        self.head_marks.get(&slot.index()).copied()
    }

    /// How far the MTP head's K/V in cached blocks are right for a path: the first position
    /// below `upto` in `blocks` (a hit's blocks, tree blocks in position order) whose head K/V
    /// the block's writer did not compute exactly with the token `tokens` (the path's, at least
    /// `upto` of them) hold after it, or `upto` when there is none. A position is vouched for
    /// when the writer consumed it exactly ([`HeadOffer::exact`]) and, for a block's last
    /// position, continued with the path's token after the block; the writer's tokens before
    /// that are the path's, since the tree keys blocks by every token before their end.
    pub fn head_vouched(&self, blocks: &[u32], tokens: &[u32], upto: usize) -> usize {
        vouched(&self.head_blocks, self.block_size, blocks, tokens, upto)
    }

    /// Counts a checkpoint hit by what it made of the MTP head ([`CacheStats::head_exact_hits`]).
    pub fn count_head_hit(&mut self, hit: HeadHit) {
        let at = match hit {
            HeadHit::Exact => 0,
            HeadHit::Unvouched => 1,
            HeadHit::Unmarked => 2,
            HeadHit::Skipped => 3,
        };
        self.head_hits[at] += 1;
    }

    /// Gives back a checkpoint slot that will not be offered to the tree.
    pub fn free_checkpoint_slot(&mut self, slot: SlotId) {
        if let Index::Marconi(store, _) = &mut self.index {
            if let Err(err) = store.cancel_checkpoint(slot) {
                tracing::error!(%err, "cancelled a checkpoint slot that was not reserved");
            }
        }
    }

    /// Registers the checkpoint a sequence took at its branch point (`tokens.len()`).
    pub fn register_branch(&mut self, pin: &Pin, tokens: &[u32], slot: SlotId) {
        let Index::Marconi(store, _) = &mut self.index else {
            return;
        };
        match store.commit_branch(pin, tokens, tokens.len(), slot, &mut self.delta) {
            Ok(outcome) => tracing::debug!(?outcome, pos = tokens.len(), "branch checkpoint"),
            Err(err) => {
                tracing::error!(%err, "the Marconi tree refused a branch checkpoint");
                let _ = store.cancel_checkpoint(slot);
            }
        }
        Self::apply_delta(&mut self.kv, &mut self.delta, &mut self.events, None, false);
    }

    /// Offers a finished sequence's full blocks (and, on a hybrid model, its checkpoints, at
    /// increasing block boundaries `<= tokens.len()`) to the prefix cache; consumes the pin. The caller still
    /// holds every block and releases its own references afterwards. `head` is what the
    /// sequence's MTP head vouches for, recorded with each block the Marconi tree adopts.
    #[allow(clippy::too_many_arguments)] // One offer, described field by field.
    pub fn insert_finished(
        &mut self,
        ns: Namespace,
        pin: Option<Pin>,
        looked_up: &[u32],
        tokens: &[u32],
        blocks: &[u32],
        checkpoints: &[(usize, SlotId)],
        head: Option<HeadOffer>,
    ) {
        match &mut self.index {
            Index::Off => {}
            Index::HashChain => {
                self.scratch_blocks.clear();
                self.scratch_blocks
                    .extend(blocks.iter().map(|&b| BlockId(b)));
                if let Err(err) = self.kv.insert(tokens, &self.scratch_blocks, extra_key(ns)) {
                    tracing::error!(%err, "the prefix cache refused a finished sequence");
                }
                self.events.flush_kv();
            }
            Index::Marconi(store, tuner) => {
                // A restored sequence never looked the tree up; an empty lookup pins the root.
                let pin = match pin {
                    Some(pin) => pin,
                    None => {
                        store
                            .lookup(store_namespace(ns), &[], &mut self.scratch_blocks)
                            .pin
                    }
                };
                self.scratch_blocks.clear();
                self.scratch_blocks
                    .extend(blocks.iter().map(|&b| BlockId(b)));
                if let Err(err) = store.finish(
                    pin,
                    tokens,
                    &self.scratch_blocks,
                    checkpoints,
                    &mut self.delta,
                ) {
                    tracing::error!(%err, "the Marconi tree refused a finished sequence");
                    for &(_, slot) in checkpoints {
                        let _ = store.cancel_checkpoint(slot);
                    }
                }
                Self::record_heads(
                    &mut self.head_blocks,
                    self.block_size,
                    &self.delta.retain_blocks,
                    tokens,
                    blocks,
                    head,
                );
                let adoption = Adoption {
                    tokens,
                    blocks,
                    extra: extra_key(ns),
                };
                Self::apply_delta(
                    &mut self.kv,
                    &mut self.delta,
                    &mut self.events,
                    Some(adoption),
                    false,
                );
                if let Some(tuner) = tuner {
                    let request = RecordedRequest {
                        namespace: store_namespace(ns),
                        input: looked_up.to_vec(),
                        full: tokens.to_vec(),
                    };
                    match tuner.observe(store, request) {
                        Ok(Some(setting)) => {
                            tracing::debug!(?setting, "Marconi eviction score retuned")
                        }
                        Ok(None) => {}
                        Err(err) => tracing::error!(%err, "alpha tuning failed; alpha unchanged"),
                    }
                }
            }
        }
    }

    /// Records, for each of `blocks` the tree just adopted (`adopted`), what its writer's head
    /// vouches for (`head`; nothing when `None`). Block `i` holds `tokens[i * size..]`; the
    /// token after the last block is `head.next`.
    fn record_heads(
        head_blocks: &mut [Option<BlockHead>],
        size: usize,
        adopted: &[BlockId],
        tokens: &[u32],
        blocks: &[u32],
        head: Option<HeadOffer>,
    ) {
        if head_blocks.is_empty() || adopted.is_empty() {
            return;
        }
        let adopted: std::collections::HashSet<u32> = adopted.iter().map(|b| b.0).collect();
        for (index, &block) in blocks.iter().enumerate() {
            if !adopted.contains(&block) {
                continue;
            }
            let end = (index + 1) * size;
            let record = head.map(|head| BlockHead {
                exact: head.exact.saturating_sub(index * size).min(size),
                next: if end < tokens.len() {
                    Some(tokens[end])
                } else {
                    head.next
                },
            });
            if let Some(slot) = head_blocks.get_mut(block as usize) {
                *slot = record;
            }
        }
    }

    /// Drops every cached prefix no running sequence holds.
    pub fn clear(&mut self) {
        match &mut self.index {
            Index::Off => {}
            Index::HashChain => {
                self.kv.clear();
                self.events.flush_kv();
            }
            Index::Marconi(store, _) => {
                store.clear_unpinned(&mut self.delta);
                // Blocks on the paths of running sequences stay; when none does, the tree is
                // empty and one event says so.
                let cleared = store.held_block_count() == 0;
                Self::apply_delta(
                    &mut self.kv,
                    &mut self.delta,
                    &mut self.events,
                    None,
                    cleared,
                );
            }
        }
    }

    /// Subscribes `sink` to the cache events (see [`crate::events`]).
    pub fn subscribe(&mut self, sink: Box<dyn device_io::CacheEventSink>) {
        let store = match &self.index {
            Index::Marconi(store, _) => Some(&**store),
            _ => None,
        };
        self.events.subscribe(&mut self.kv, store, sink);
    }

    /// The keys the cache events give the full blocks of `tokens` in the namespace of `ns`.
    pub fn block_keys(&mut self, ns: Namespace, tokens: &[u32]) -> Vec<kv_cache::BlockHash> {
        let mut keys = Vec::new();
        self.kv.block_hashes(tokens, extra_key(ns), &mut keys);
        keys
    }

    /// What the prefix cache holds, block by block, parents first.
    pub fn contents(&self) -> Vec<Listed> {
        match &self.index {
            Index::Off => Vec::new(),
            Index::HashChain => crate::events::contents(&self.kv, None, &[]),
            Index::Marconi(store, _) => {
                crate::events::contents(&self.kv, Some(store), self.events.tree_extra())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A finished sequence's offer: its tokens, its blocks, those the tree adopts, its head's.
    type Offer<'a> = (&'a [u32], &'a [u32], &'a [u32], Option<HeadOffer>);

    /// Records each offer in turn, then answers how far `path` (served by `served`) is vouched
    /// for below `upto`.
    fn check(offers: &[Offer<'_>], served: &[u32], path: &[u32], upto: usize) -> usize {
        let mut heads = vec![None; 16];
        for &(tokens, blocks, adopted, head) in offers {
            let adopted: Vec<BlockId> = adopted.iter().map(|&b| BlockId(b)).collect();
            Caches::record_heads(&mut heads, 4, &adopted, tokens, blocks, head);
        }
        vouched(&heads, 4, served, path, upto)
    }

    fn offer(exact: usize, next: Option<u32>) -> Option<HeadOffer> {
        Some(HeadOffer { exact, next })
    }

    #[test]
    fn a_hit_is_vouched_for_as_far_as_its_blocks_writers_say() {
        let w: Vec<u32> = (0..12).collect();
        let mut other = w.clone();
        other[8] = 99;
        // The writer's own path: every position before the rerun.
        assert_eq!(
            check(
                &[(&w[..8], &[3, 5], &[3, 5], offer(12, Some(8)))],
                &[3, 5],
                &w,
                7
            ),
            7
        );
        assert_eq!(
            check(
                &[(&w[..8], &[3, 5], &[3, 5], offer(12, Some(8)))],
                &[3, 5],
                &w,
                8
            ),
            8
        );
        // Another path after the blocks: the last position's next token differs.
        assert_eq!(
            check(
                &[(&w[..8], &[3, 5], &[3, 5], offer(12, Some(8)))],
                &[3, 5],
                &other,
                8
            ),
            7
        );
        // ... which a rerun from 7 covers.
        assert_eq!(
            check(
                &[(&w[..8], &[3, 5], &[3, 5], offer(12, Some(8)))],
                &[3, 5],
                &other,
                7
            ),
            7
        );
        // A head that consumed 6 positions vouches for 6.
        assert_eq!(
            check(
                &[(&w[..8], &[3, 5], &[3, 5], offer(6, Some(8)))],
                &[3, 5],
                &w,
                7
            ),
            6
        );
        // A block the tree did not adopt from this offer, or adopted with no head, vouches
        // for nothing.
        assert_eq!(
            check(
                &[(&w[..8], &[3, 5], &[3], offer(12, Some(8)))],
                &[3, 5],
                &w,
                7
            ),
            4
        );
        assert_eq!(
            check(&[(&w[..8], &[3, 5], &[3, 5], None)], &[3, 5], &w, 7),
            0
        );
        // A later offer that adopts a block again replaces its record.
        assert_eq!(
            check(
                &[
                    (&w[..8], &[3, 5], &[3, 5], offer(12, Some(8))),
                    (&w[..4], &[5], &[5], offer(2, Some(4))),
                ],
                &[3, 5],
                &w,
                7
            ),
            6
        );
        // The token after a block inside the offer is the sequence's own.
        assert_eq!(
            check(
                &[(&w[..8], &[3, 5], &[3, 5], offer(12, None))],
                &[3, 5],
                &other[..],
                7
            ),
            7
        );
        let mut early = w.clone();
        early[4] = 77;
        assert_eq!(
            check(
                &[(&w[..8], &[3, 5], &[3, 5], offer(12, Some(8)))],
                &[3, 5],
                &early,
                7
            ),
            3
        );
    }
}
