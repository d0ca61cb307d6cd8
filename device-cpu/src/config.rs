//! `CpuRouterConfig`: how much host memory the router sets aside for each region, and the rule that
//! splits one byte budget between them.

use model::Config;

/// How large the prefix cache's checkpoint region is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CheckpointBudget {
    /// This many checkpoint slots.
    Slots(usize),
    /// As many slots as fit in this many bytes (one slot is one live state: every Mamba layer's conv
    /// and SSM state, f32). This is the Marconi store's byte budget.
    Bytes(u64),
}

/// The host router's sizes and switches.
///
/// Memory regions (all f32 on the host):
/// - a paged KV pool of `num_blocks` blocks of `block_size` tokens, for every attention layer;
/// - `max_seqs` live-state slots (one per running sequence);
/// - the checkpoint region ([`CheckpointBudget`]), owned by the Marconi store's policy;
/// - `snapshot_slots` ring slots for `SsmSnapshotSave` / `SsmSnapshotRestore`.
#[derive(Debug, Clone, PartialEq)]
pub struct CpuRouterConfig {
    /// Tokens per KV block (and the granularity of prefix-cache hits and checkpoints).
    pub block_size: usize,
    /// KV blocks in the pool.
    pub num_blocks: usize,
    /// Live-state slots: the most sequences that can run at once.
    pub max_seqs: usize,
    /// The checkpoint region of the Marconi store (unused on attention-only models).
    pub checkpoints: CheckpointBudget,
    /// Slots of the snapshot ring.
    pub snapshot_slots: usize,
    /// Whether finished sequences are offered to a prefix cache and new ones look it up.
    pub prefix_cache: bool,
    /// On a hybrid model, whether the full Marconi policy runs the checkpoint store: FLOP-aware
    /// eviction whose weight α, recency basis, FLOP basis and guarded admission `ssm-snapshot`'s
    /// tuner keeps choosing from the requests served, starting at plain LRU and falling back to
    /// it when the live store falls behind an LRU shadow. `false` keeps Marconi's admission
    /// (branch points, ends of input and output) but evicts by recency only (α = 0, path
    /// recency: SGLang's LRU). Attention-only models ignore it
    /// (they use the hash-chain prefix cache).
    pub marconi: bool,
    /// The longest sequence (prompt plus generated tokens) the router accepts, like vLLM's
    /// `max_model_len`. `None` (the default): the model's `max_position_embeddings`, or what the
    /// pool holds when that is less or the model does not say. `Some(n)`: `n`, which must not
    /// exceed the model's `max_position_embeddings` and must fit in the pool.
    pub max_context: Option<usize>,
    /// 1: every step completes inside `launch` (the synchronous router). 2: the pipelined router:
    /// device work runs in order on a worker thread, `launch` returns at once, and the core may
    /// launch a `DecodeFed` step before it awaits the previous one.
    pub max_depth: usize,
    /// Threads the model's forward pass runs on (matrix products, attention and the Mamba scan
    /// split by output columns, rows and heads; outputs are the same bits for every count).
    /// [`default_threads`] by default.
    pub threads: usize,
    /// Expert parallelism: the routed experts of MoE layers sharded across this many worker
    /// threads (`model::ExpertPool`; outputs are the same bits for every count). 0 (the default)
    /// runs them on the forward pass's threads.
    pub expert_workers: usize,
    /// LoRA adapter slots: the most adapters loaded at once (vLLM's `max_loras`). Adapters are
    /// loaded and unloaded with `DeviceIo::lora`; a decode or prefill step may mix rows of
    /// different adapters and rows of none. 0 refuses every load.
    pub lora_slots: usize,
}

/// The machine's available parallelism (1 when it cannot be told).
pub fn default_threads() -> usize {
    std::thread::available_parallelism().map_or(1, usize::from)
}

/// The default number of LoRA adapter slots.
pub const DEFAULT_LORA_SLOTS: usize = 4;

/// The default block size, as in vLLM.
pub const DEFAULT_BLOCK_SIZE: usize = 16;
/// The default number of snapshot ring slots.
pub const DEFAULT_SNAPSHOT_SLOTS: usize = 4;

impl CpuRouterConfig {
    /// A config with `num_blocks` blocks of [`DEFAULT_BLOCK_SIZE`] tokens and `max_seqs` live slots;
    /// four checkpoint slots per live slot, [`DEFAULT_SNAPSHOT_SLOTS`] ring slots, prefix cache and
    /// Marconi on, `max_context` the model's (or the pool's, when smaller), depth 1, and
    /// [`default_threads`] threads, no expert workers, and [`DEFAULT_LORA_SLOTS`] adapter slots.
    pub fn new(num_blocks: usize, max_seqs: usize) -> Self {
        CpuRouterConfig {
            block_size: DEFAULT_BLOCK_SIZE,
            num_blocks,
            max_seqs,
            checkpoints: CheckpointBudget::Slots(4 * max_seqs),
            snapshot_slots: DEFAULT_SNAPSHOT_SLOTS,
            prefix_cache: true,
            marconi: true,
            max_context: None,
            max_depth: 1,
            threads: default_threads(),
            expert_workers: 0,
            lora_slots: DEFAULT_LORA_SLOTS,
        }
    }

    /// Splits `total_bytes` of host memory for `model`, with `max_seqs` live slots and sequences of
    /// up to `max_context` tokens. The rule:
    ///
    /// 1. The live slots (`max_seqs` states) and the snapshot ring ([`DEFAULT_SNAPSHOT_SLOTS`]
    ///    states) come first; they are needed whatever the workload.
    /// 2. Of the rest, a hybrid model gives one quarter to the checkpoint region and three quarters
    ///    to KV blocks; an attention-only model gives everything to KV blocks. (A quarter is
    ///    Marconi's order of magnitude: checkpoints are large, but only branch points and sequence
    ///    ends are kept, so a few per conversation suffice, while KV grows with every token.)
    /// 3. A model without attention layers has no KV bytes; its pool is bookkeeping only and gets
    ///    enough blocks for `max_seqs` sequences of `max_context` tokens.
    ///
    /// Fails when the budget cannot hold the live slots plus one sequence of `max_context` tokens.
    pub fn from_byte_budget(
        model: &Config,
        total_bytes: u64,
        max_seqs: usize,
        max_context: usize,
    ) -> Result<Self, crate::RouterError> {
        let block_size = DEFAULT_BLOCK_SIZE;
        // Empty and one-block instances are the cheapest way to ask the model for its sizes.
        let state_bytes = 4 * model::MambaStates::new(model, 0)?.floats_per_slot() as u64;
        let block_bytes = 4 * model::KvPool::new(model, 1, block_size)
            .map_err(crate::RouterError::Model)?
            .floats_per_block() as u64;
        let fixed = state_bytes * (max_seqs + DEFAULT_SNAPSHOT_SLOTS) as u64;
        let rest = total_bytes
            .checked_sub(fixed)
            .ok_or(crate::RouterError::BudgetTooSmall {
                budget: total_bytes,
                needed: fixed,
                what: "the live slots and the snapshot ring",
            })?;
        let hybrid = state_bytes > 0;
        let (checkpoint_bytes, kv_bytes) = if hybrid {
            (rest / 4, rest - rest / 4)
        } else {
            (0, rest)
        };
        let min_blocks = max_context.div_ceil(block_size);
        let num_blocks = match kv_bytes.checked_div(block_bytes) {
            Some(blocks) => usize::try_from(blocks).unwrap_or(usize::MAX),
            None => max_seqs * min_blocks,
        };
        if num_blocks < min_blocks {
            return Err(crate::RouterError::BudgetTooSmall {
                budget: total_bytes,
                needed: fixed + min_blocks as u64 * block_bytes * if hybrid { 4 } else { 1 } / 3,
                what: "one sequence of max_context tokens",
            });
        }
        Ok(CpuRouterConfig {
            block_size,
            num_blocks,
            max_seqs,
            checkpoints: CheckpointBudget::Bytes(checkpoint_bytes),
            snapshot_slots: DEFAULT_SNAPSHOT_SLOTS,
            prefix_cache: true,
            marconi: true,
            max_context: Some(max_context),
            max_depth: 1,
            threads: default_threads(),
            expert_workers: 0,
            lora_slots: DEFAULT_LORA_SLOTS,
        })
    }

    /// The number of checkpoint slots for states of `state_bytes` bytes each.
    pub fn checkpoint_slots(&self, state_bytes: u64) -> usize {
        match self.checkpoints {
            CheckpointBudget::Slots(n) => n,
            CheckpointBudget::Bytes(_) if state_bytes == 0 => 0,
            CheckpointBudget::Bytes(bytes) => usize::try_from(bytes / state_bytes).unwrap_or(0),
        }
    }
}
