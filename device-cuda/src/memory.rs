//! The CUDA router's memory plan: how one byte budget is split between the weights, the KV pool,
//! the live SSM state slots, the Marconi checkpoint slots, the snapshot ring, the activation
//! workspace of the largest step and the logits buffers, as `CpuRouterConfig::from_byte_budget`
//! splits host memory.
//!
//! KV and SSM state are f32 on the device, in the host model's layouts (a block is one
//! contiguous run of floats, all attention layers, K then V; a slot likewise for all Mamba
//! layers), so a spill image moves between the host and the CUDA router of the same model.

use model::{Config, KvPool, LayerKind, MambaStates};

use crate::forward::{ForwardLimits, ForwardMode, Workspace};
use crate::runtime::DType;

/// Bytes every region is aligned to inside its buffer.
pub const ALIGN: u64 = 256;

/// The CUDA router's sizes and switches.
#[derive(Debug, Clone, PartialEq)]
pub struct CudaRouterConfig {
    /// Device memory the router may use, in bytes.
    pub budget_bytes: u64,
    /// Live-state slots: the most sequences that run at once (and the most rows of a step).
    pub max_seqs: usize,
    /// The longest sequence (prompt plus generated tokens).
    pub max_context: usize,
    /// The most tokens one step computes (prefill chunks plus decode rows): sizes the workspace.
    pub max_step_tokens: usize,
    /// The element type of the weights on the device.
    pub weights: DType,
    /// Tokens per KV block.
    pub block_size: usize,
    /// Slots of the snapshot ring.
    pub snapshot_slots: usize,
    /// Whether finished sequences are offered to a prefix cache.
    pub prefix_cache: bool,
    /// On a hybrid model, whether the tuned Marconi policy evicts checkpoints (else LRU).
    pub marconi: bool,
    /// Steps in flight: 1 (each step awaited before the next; `DecodeFed` and `Rollback` answer
    /// `Unsupported`, as on the host router) or 2 (the core launches step t + 1 before reading
    /// step t).
    pub max_depth: usize,
    /// The device forward's mode: [`ForwardMode::Exact`] (the default) gives the same logits
    /// bits however the work is cut, so the caches are bit-transparent; [`ForwardMode::Fast`]
    /// is faster on long prompts but equal only to rounding.
    pub forward_mode: ForwardMode,
    /// Exact sizes of the KV pool and the checkpoint slots. `None` (the default): what the
    /// budget leaves after the fixed regions is split, three quarters to KV blocks and one
    /// quarter to checkpoint slots on a hybrid model (all to KV otherwise). `Some`: exactly
    /// these sizes, which the budget must hold ([`PlanError::BudgetTooSmall`] otherwise); what it
    /// holds beyond them stays unused. A host build that asks for `n` blocks gets `n` blocks.
    pub pool: Option<PoolSizes>,
}

/// Exact sizes of the KV pool and the Marconi checkpoint slots ([`CudaRouterConfig::pool`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolSizes {
    /// KV blocks (at least one `max_context` sequence's).
    pub kv_blocks: usize,
    /// Checkpoint slots (0 when the prefix cache is off or the model has no Mamba layers).
    pub checkpoint_slots: usize,
}

impl CudaRouterConfig {
    /// A config with bf16 weights, 16-token blocks, 4 ring slots, both caches on, depth 2, and a
    /// step of up to `max(2048, max_seqs)` tokens.
    pub fn new(budget_bytes: u64, max_seqs: usize, max_context: usize) -> Self {
        CudaRouterConfig {
            budget_bytes,
            max_seqs,
            max_context,
            max_step_tokens: max_seqs.max(2048),
            weights: DType::Bf16,
            block_size: 16,
            snapshot_slots: 4,
            prefix_cache: true,
            marconi: true,
            max_depth: 2,
            forward_mode: ForwardMode::Exact,
            pool: None,
        }
    }
}

/// Why a plan could not be made.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    /// A size is zero or does not fit.
    #[error("invalid CUDA router config: {field} = {value} ({limit})")]
    BadConfig {
        /// The field.
        field: &'static str,
        /// Its value.
        value: u64,
        /// The limit it broke.
        limit: &'static str,
    },
    /// The budget cannot hold the fixed regions plus one sequence of `max_context` tokens.
    #[error("byte budget {budget} is too small: {what} need {needed} bytes")]
    BudgetTooSmall {
        /// The budget.
        budget: u64,
        /// What did not fit.
        what: &'static str,
        /// The bytes it needs.
        needed: u64,
    },
    /// The model refused the layout.
    #[error("model: {0}")]
    Model(String),
}

/// Where the budget goes. Every `*_bytes` figure is a region's size; `total_bytes` their sum.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryPlan {
    /// Tokens per KV block.
    pub block_size: usize,
    /// The weights, in the configured element type, each tensor aligned to [`ALIGN`].
    pub weight_bytes: u64,
    /// One KV block: all attention layers, K and V, f32.
    pub kv_block_bytes: u64,
    /// KV blocks in the pool.
    pub num_blocks: usize,
    /// One SSM state slot: every Mamba layer's conv and SSM state, f32.
    pub state_slot_bytes: u64,
    /// Live-state slots.
    pub live_slots: usize,
    /// Marconi checkpoint slots.
    pub checkpoint_slots: usize,
    /// Snapshot ring slots.
    pub snapshot_slots: usize,
    /// Scratch state rows, one per live slot, where a `Draft` runs the MTP head's drafts on a
    /// copy of the live state (a model with an MTP head; 0 otherwise).
    pub scratch_slots: usize,
    /// The MTP head's regions ([`MtpLayout`]; 0 without a head).
    pub mtp_bytes: u64,
    /// Per checkpoint slot: the main model's hidden states stored with the checkpoint for the
    /// MTP head's rerun at a prefix hit (`router_book::spec`; `head_reruns`): `CATCHUP_RING`
    /// rows of `hidden_size` f32, at most what a mark names. 0 when the head does not rerun.
    pub mark_bytes: u64,
    /// Activations of the largest step: the forward step's [`Workspace`](crate::Workspace) for
    /// [`forward_limits`].
    pub workspace_bytes: u64,
    /// Logits of two steps in flight (depth 2), [`MemoryPlan::logit_rows`] rows each, f32.
    pub logits_bytes: u64,
    /// Per-step inputs and outputs of two steps (tokens, host tokens and feed sources of a fed
    /// step, argmax outputs, masks) and the feed cells: [`IoLayout`].
    pub io_bytes: u64,
}

fn align(bytes: u64) -> u64 {
    bytes.div_ceil(ALIGN) * ALIGN
}

/// The largest step of a router: `max_step_tokens` rows, one run per live slot, every run's
/// block table as long as `max_context` needs.
pub fn forward_limits(router: &CudaRouterConfig) -> ForwardLimits {
    ForwardLimits {
        max_rows: router.max_step_tokens,
        max_runs: router.max_seqs,
        max_table: router
            .max_seqs
            .saturating_mul(router.max_context.div_ceil(router.block_size.max(1))),
    }
}

/// Byte offsets in the per-step buffer (`MemoryPlan::io_bytes`): two halves, one per step in
/// flight (step `t` uses half `t % 2`), then the feed cells.
///
/// In a half: the step's tokens (`max_step_tokens` u32, what the forward step reads), the host
/// tokens and the feed sources of a `DecodeFed` (`max_seqs` u32 / i32 each), the argmax outputs
/// (one u32 per logits row: `logit_rows`, a verification's positions included) and the masks
/// (`max_seqs × vocab` bytes). The feed cells (`max_seqs` u32)
/// hold the argmax of each token row of the latest step that took one; a `DecodeFed` reads
/// them on the compute stream before its own argmax overwrites them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IoLayout {
    /// The step's tokens, from the start of a half.
    pub tokens: u64,
    /// A fed step's host tokens.
    pub host_tokens: u64,
    /// A fed step's sources (`-1`: the host token; else a feed cell).
    pub sources: u64,
    /// The argmax of each token row.
    pub out: u64,
    /// The masks of the token rows.
    pub mask: u64,
    /// Bytes of a half (the second half starts there).
    pub half: u64,
    /// The feed cells, after both halves.
    pub feed: u64,
    /// Bytes of the whole buffer.
    pub total: u64,
}

impl IoLayout {
    /// The layout for steps of up to `max_step_tokens` tokens over `max_seqs` rows of `vocab`,
    /// with up to `logit_rows` rows of logits.
    pub fn new(
        max_step_tokens: usize,
        max_seqs: usize,
        logit_rows: usize,
        vocab: usize,
    ) -> IoLayout {
        let tokens = align(4 * max_step_tokens as u64);
        let rows = align(4 * max_seqs as u64);
        let outs = align(4 * logit_rows.max(max_seqs) as u64);
        let masks = align(max_seqs as u64 * vocab as u64);
        let half = tokens + 2 * rows + outs + masks;
        IoLayout {
            tokens: 0,
            host_tokens: tokens,
            sources: tokens + rows,
            out: tokens + 2 * rows,
            mask: tokens + 2 * rows + outs,
            half,
            feed: 2 * half,
            total: 2 * half + rows,
        }
    }
}

/// The widest per-token activation of `config` (floats): a Mamba in_proj, the fused QKV, the
/// dense MLP, or the routed plus shared experts.
pub fn widest_activation(config: &Config) -> usize {
    let mut widest = config.hidden_size;
    if config.has(LayerKind::Mamba) {
        widest = widest.max(config.mamba_in_proj_dim());
    }
    if config.has(LayerKind::Attention) {
        widest = widest
            .max((config.num_attention_heads + 2 * config.num_key_value_heads) * config.head_dim);
    }
    if config.has(LayerKind::Mlp) {
        widest = widest.max(config.intermediate_size);
    }
    if config.has(LayerKind::Moe) {
        widest = widest.max(
            config.num_experts_per_tok * config.moe_intermediate_size
                + config.moe_shared_expert_intermediate_size,
        );
    }
    widest
}

impl MemoryPlan {
    /// Splits `router.budget_bytes` for `config`, whose weights take `weight_bytes` on the device:
    ///
    /// 1. Fixed regions first: the weights, `max_seqs` live slots and the snapshot ring, the
    ///    workspace (the forward step's [`Workspace`](crate::Workspace) for `max_step_tokens`
    ///    rows of `max_seqs` sequences of up to `max_context` tokens), the logits of two steps
    ///    and the per-step inputs and outputs ([`IoLayout`]).
    /// 2. Of the rest, a hybrid model gives a quarter to checkpoints and three quarters to KV; an
    ///    attention-only model everything to KV (as the host router does). A checkpoint slot
    ///    costs a state row plus, when the MTP head reruns at a hit (`head_reruns`), its
    ///    stored hidden rows (`mark_bytes`). With [`CudaRouterConfig::pool`] set, the rest holds
    ///    exactly those sizes instead (or the plan fails with [`PlanError::BudgetTooSmall`]).
    /// 3. A model without attention has no KV bytes; its pool is bookkeeping only, with blocks
    ///    for `max_seqs` sequences of `max_context` tokens.
    ///
    /// Fails when the fixed regions plus the KV of one `max_context` sequence do not fit.
    pub fn from_budget(
        config: &Config,
        weight_bytes: u64,
        router: &CudaRouterConfig,
    ) -> Result<MemoryPlan, PlanError> {
        for (field, value, limit) in [
            ("max_seqs", router.max_seqs, "must be at least 1"),
            ("max_context", router.max_context, "must be at least 1"),
            (
                "max_step_tokens",
                router.max_step_tokens,
                "must be at least 1",
            ),
            ("block_size", router.block_size, "must be at least 1"),
        ] {
            if value == 0 {
                return Err(PlanError::BadConfig {
                    field,
                    value: 0,
                    limit,
                });
            }
        }
        if !(1..=2).contains(&router.max_depth) {
            return Err(PlanError::BadConfig {
                field: "max_depth",
                value: router.max_depth as u64,
                limit: "must be 1 (synchronous) or 2 (pipelined)",
            });
        }
        if router.max_step_tokens < router.max_seqs {
            return Err(PlanError::BadConfig {
                field: "max_step_tokens",
                value: router.max_step_tokens as u64,
                limit: "must be at least max_seqs (a decode step has one token per sequence)",
            });
        }
        let model_err = |err: model::ModelError| PlanError::Model(err.to_string());
        let kv_block_bytes = 4 * KvPool::new(config, 1, router.block_size)
            .map_err(model_err)?
            .floats_per_block() as u64;
        let state_slot_bytes = 4 * MambaStates::new(config, 0)
            .map_err(model_err)?
            .floats_per_slot() as u64;
        // One workspace, the forward step's, for the largest step: `max_step_tokens` rows of
        // `max_seqs` sequences of up to `max_context` tokens.
        let forward = Workspace::new(config, forward_limits(router))
            .map_err(|err| PlanError::Model(err.to_string()))?;
        let workspace_bytes = align(forward.bytes() as u64);
        let scratch_slots = if config.mtp_kinds().is_empty() {
            0
        } else {
            router.max_seqs
        };
        let mtp_bytes = MtpLayout::new(config, router).total;
        let rows = (router.max_seqs + router.snapshot_slots) as u64;
        let vocab = config.vocab_size as u64;
        let logits_bytes = 2 * align(4 * rows * vocab);
        let io_bytes = IoLayout::new(
            router.max_step_tokens,
            router.max_seqs,
            router.max_seqs + router.snapshot_slots,
            config.vocab_size,
        )
        .total;
        let fixed = align(weight_bytes)
            + align(
                state_slot_bytes * (router.max_seqs + router.snapshot_slots + scratch_slots) as u64,
            )
            + mtp_bytes
            + workspace_bytes
            + logits_bytes
            + io_bytes;
        let min_blocks = router.max_context.div_ceil(router.block_size);
        let rest = router
            .budget_bytes
            .checked_sub(fixed)
            .ok_or(PlanError::BudgetTooSmall {
                budget: router.budget_bytes,
                what: "the weights, live slots, snapshot ring, workspace and logits",
                needed: fixed + min_blocks as u64 * kv_block_bytes,
            })?;
        let hybrid = state_slot_bytes > 0;
        let mark_bytes = if head_reruns(config) {
            4 * (config.hidden_size * router_book::spec::CATCHUP_RING) as u64
        } else {
            0
        };
        let (num_blocks, checkpoint_slots) = match router.pool {
            Some(pool) => {
                if pool.kv_blocks < min_blocks || u32::try_from(pool.kv_blocks).is_err() {
                    return Err(PlanError::BadConfig {
                        field: "pool.kv_blocks",
                        value: pool.kv_blocks as u64,
                        limit: "must hold one max_context sequence and fit block ids of u32",
                    });
                }
                let checkpoint_slots = if hybrid && router.prefix_cache {
                    pool.checkpoint_slots
                } else {
                    0
                };
                let needed = (pool.kv_blocks as u64)
                    .checked_mul(kv_block_bytes)
                    .and_then(|kv| {
                        (checkpoint_slots as u64)
                            .checked_mul(state_slot_bytes + mark_bytes)
                            .and_then(|checkpoints| kv.checked_add(checkpoints))
                    })
                    .unwrap_or(u64::MAX);
                if needed > rest {
                    return Err(PlanError::BudgetTooSmall {
                        budget: router.budget_bytes,
                        what: "the fixed regions, the KV pool and the checkpoint slots asked for",
                        needed: fixed.saturating_add(needed),
                    });
                }
                (pool.kv_blocks, checkpoint_slots)
            }
            None => {
                let (checkpoint_bytes, kv_bytes) = if hybrid {
                    (rest / 4, rest - rest / 4)
                } else {
                    (0, rest)
                };
                let num_blocks = match kv_bytes.checked_div(kv_block_bytes) {
                    Some(blocks) => usize::try_from(blocks).unwrap_or(usize::MAX),
                    None => router.max_seqs.saturating_mul(min_blocks),
                };
                let checkpoint_slots =
                    match checkpoint_bytes.checked_div(state_slot_bytes + mark_bytes) {
                        Some(slots) if router.prefix_cache => {
                            usize::try_from(slots).unwrap_or(usize::MAX)
                        }
                        _ => 0,
                    };
                (num_blocks, checkpoint_slots)
            }
        };
        if num_blocks < min_blocks {
            return Err(PlanError::BudgetTooSmall {
                budget: router.budget_bytes,
                what: "the fixed regions and the KV of one max_context sequence",
                needed: fixed + min_blocks as u64 * kv_block_bytes * if hybrid { 4 } else { 3 } / 3,
            });
        }
        if u32::try_from(num_blocks).is_err() {
            return Err(PlanError::BadConfig {
                field: "budget_bytes",
                value: router.budget_bytes,
                limit: "block ids are u32: the budget gives more than 2^32 blocks",
            });
        }
        Ok(MemoryPlan {
            block_size: router.block_size,
            weight_bytes,
            kv_block_bytes,
            num_blocks,
            state_slot_bytes,
            live_slots: router.max_seqs,
            checkpoint_slots,
            snapshot_slots: router.snapshot_slots,
            scratch_slots,
            mtp_bytes,
            mark_bytes,
            workspace_bytes,
            logits_bytes,
            io_bytes,
        })
    }

    /// The most rows of logits one step leaves: a decode's `max_seqs`, or a `Verify`'s
    /// positions, one per row plus one per draft (the drafts of a step are at most the snapshot
    /// ring's slots, one ring slot each).
    pub fn logit_rows(&self) -> usize {
        self.live_slots + self.snapshot_slots
    }

    /// Bytes of the KV pool.
    pub fn kv_bytes(&self) -> u64 {
        self.kv_block_bytes * self.num_blocks as u64
    }

    /// State rows: live, checkpoint, ring and scratch rows, in that order.
    pub fn state_rows(&self) -> usize {
        self.live_slots + self.checkpoint_slots + self.snapshot_slots + self.scratch_slots
    }

    /// The scratch state row of live slot `slot` (a model with an MTP head).
    pub fn scratch_row(&self, slot: usize) -> usize {
        self.live_slots + self.checkpoint_slots + self.snapshot_slots + slot
    }

    /// Bytes of the hidden rows stored with every checkpoint slot (see `mark_bytes`).
    pub fn marks_bytes(&self) -> u64 {
        self.mark_bytes * self.checkpoint_slots as u64
    }

    /// Bytes of every state row.
    pub fn state_bytes(&self) -> u64 {
        self.state_slot_bytes * self.state_rows() as u64
    }

    /// Every region's bytes added up (at most the budget).
    pub fn total_bytes(&self) -> u64 {
        align(self.weight_bytes)
            + self.kv_bytes()
            + self.state_bytes()
            + self.workspace_bytes
            + self.logits_bytes
            + self.io_bytes
            + self.mtp_bytes
            + self.marks_bytes()
    }
}

/// Whether the router reruns the MTP head at a prefix hit (`router_book::BookShape::head_rerun`):
/// the model has a head (one with Mamba layers lags at prefill checkpoints,
/// `router_book::BookShape::head_lags`).
pub fn head_reruns(config: &Config) -> bool {
    !config.mtp_kinds().is_empty()
}

/// Byte offsets of the MTP head's regions, one buffer (a model with an MTP head; all zero
/// otherwise), each row `hidden_size` f32:
/// - `step_hidden`: per half (step `t` uses half `t % 2`), the final-normed hidden state of each
///   logits row of a decode or verification on the main model: what `SaveHiddenCatchup` keeps;
/// - `cells`: the catch-up rings' hidden states, `max_seqs × CATCHUP_RING` cells;
/// - `staging`: a prefill call's hidden states (every row), or a draft's catch-up inputs
///   (`max(max_step_tokens, CATCHUP_RING)` rows);
/// - `ping`, `pong`: a draft's hidden inputs and outputs, `max_seqs` rows each;
/// - `drafts`: a draft's tokens, `max_seqs × CATCHUP_RING` u32, depth-major.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct MtpLayout {
    /// Bytes of one hidden row.
    pub row: u64,
    /// The step halves' hidden rows.
    pub step_hidden: u64,
    /// Bytes of a half of `step_hidden`.
    pub half: u64,
    /// The catch-up cells.
    pub cells: u64,
    /// How many cells.
    pub num_cells: usize,
    /// Staging rows.
    pub staging: u64,
    /// Rows of `staging`.
    pub staging_rows: usize,
    /// Draft hidden inputs.
    pub ping: u64,
    /// Draft hidden outputs.
    pub pong: u64,
    /// Draft tokens.
    pub drafts: u64,
    /// Bytes of the whole buffer (0 without a head).
    pub total: u64,
}

impl MtpLayout {
    /// The layout for `config` under `router` (empty when the model has no MTP head).
    pub fn new(config: &Config, router: &CudaRouterConfig) -> MtpLayout {
        if config.mtp_kinds().is_empty() {
            return MtpLayout::default();
        }
        let row = 4 * config.hidden_size as u64;
        let logit_rows = (router.max_seqs + router.snapshot_slots) as u64;
        let num_cells = router.max_seqs * router_book::spec::CATCHUP_RING;
        let staging_rows = router.max_step_tokens.max(router_book::spec::CATCHUP_RING);
        let half = align(row * logit_rows);
        let step_hidden = 0;
        let cells = step_hidden + 2 * half;
        let staging = cells + align(row * num_cells as u64);
        let ping = staging + align(row * staging_rows as u64);
        let pong = ping + align(row * router.max_seqs as u64);
        let drafts = pong + align(row * router.max_seqs as u64);
        let total = drafts + align(4 * num_cells as u64);
        MtpLayout {
            row,
            step_hidden,
            half,
            cells,
            num_cells,
            staging,
            staging_rows,
            ping,
            pong,
            drafts,
            total,
        }
    }
}
