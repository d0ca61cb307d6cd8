//! `RouterSeq`: a router's per-sequence bookkeeping (the host router's `RouterSeq`, the CUDA
//! router's sequence), and `LogitsHandle`, a router's logits pointer.
//!
//! Its fields are public so that every router of the workspace keeps them the same way (the
//! shared effects of [`crate::book`] change them); the engine core sees a sequence only through
//! [`Sequence`], and only routers change it.
//!
//! # Invariants
//!
//! - `tokens[..computed_len]` are the tokens whose KV and state exist on the router; `tokens` starts as
//!   the prompt and grows by one per decoded input token, so after the prompt is complete
//!   `tokens.len() == computed_len`, and before it `tokens.len() == prompt_len`.
//! - `blocks` holds one pool reference per entry, owned by this sequence; `blocks.len() * block_size
//!   >= computed_len`, and it may hold one more block than that needs (after `ReserveKv`).
//! - `tenure` is `Some` exactly while the sequence holds router resources (blocks, a slot, a pinned
//!   cache path or a pending checkpoint); the router's tenure table names it, which is how `teardown`
//!   reports holders and how a slot is never freed by a sequence that no longer owns it.
//! - `slot` is `Some` only with a `tenure`, and the router's slot table records that tenure as the
//!   slot's owner.
//! - `input_checkpoint` and `output_checkpoint`, when `Some((pos, slot))`, are reserved checkpoint
//!   slots holding the live state as it was at position `pos` (a positive multiple of `block_size`,
//!   `<= computed_len`): the input one at the last block boundary before the prompt's last token
//!   (taken during prefill), the output one at the latest block boundary a decode step reached
//!   (taken by `MarconiCheckpoint`), so `input.pos < output.pos` when both exist. Marconi admits
//!   exactly these (the end of a request's input, the end of its output); they are offered to the
//!   tree on a cached release and freed otherwise.
//! - `failed` is set when a forward step over this row failed; such a sequence is never cached.
//! - After a prompt is complete, a position fed on the device (`DecodeFed` with `Feed::Row`) holds
//!   `u32::MAX` in `tokens` until the router has seen the step that produced its token finish
//!   (it resolves it the next time it is handed the sequence).
//! - `reservation` is the open run-ahead or verification (see [`Reservation`]); `state_ahead` is set
//!   by a rollback or a truncation that dropped a computed position (the live SSM state is past
//!   `computed_len`) and cleared by an `SsmSnapshotRestore` of a snapshot taken at exactly
//!   `computed_len`; while it is set the sequence is never computed, spilled or checkpointed.

use device_io::{SeqSpec, Sequence};

/// The device's handle to one step's logits: the number of the step that produced them.
///
/// The router keeps only the latest step's logits; `ReadLogits` with a handle of an older step is a
/// typed error ([`device_io::DeviceError::Invalid`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct LogitsHandle {
    /// The step (ticket number) whose logits this names.
    pub step: u64,
}

/// The cache namespace of a sequence: two sequences share cached prefixes only within one namespace.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Namespace {
    /// The LoRA adapter, if any.
    pub adapter: Option<u32>,
    /// The tenant's cache salt, if any.
    pub cache_salt: Option<u64>,
}

/// A router's bookkeeping for one sequence. Create it with [`Sequence::create`]; only the router
/// changes it (through plans and effects).
#[derive(Debug)]
pub struct RouterSeq {
    pub id: u64,
    pub prompt_len: usize,
    pub tokens: Vec<u32>,
    pub computed_len: usize,
    pub blocks: Vec<u32>,
    pub slot: Option<usize>,
    pub tenure: Option<u64>,
    pub namespace: Namespace,
    /// The Marconi path this sequence pinned at its first chunk (released with the sequence).
    pub pin: Option<crate::PinHandle>,
    /// Where the Marconi tree asked for a checkpoint during this sequence's prefill, if not taken yet.
    pub branch_point: Option<usize>,
    /// The checkpoint taken at the branch point: `(ticket, pos, slot)`, taken by step `ticket`
    /// and entered into the Marconi tree only once that step settled without failing this row
    /// (`crate::book::sync`), so no other sequence restores a state a failed step wrote.
    pub branch_taken: Option<(u64, usize, crate::CheckpointSlot)>,
    pub input_checkpoint: Option<(usize, crate::CheckpointSlot)>,
    pub output_checkpoint: Option<(usize, crate::CheckpointSlot)>,
    pub checkpoint_due: bool,
    pub failed: bool,
    /// The open run-ahead, between `ReserveKv` and the next reservation, rollback or release.
    pub reservation: Option<Reservation>,
    /// A rollback dropped a computed position: the live state is past `computed_len`.
    pub state_ahead: bool,
    /// The loaded adapter the sequence computes with (bound when it takes router resources,
    /// dropped at release), when its namespace names one.
    pub lora: Option<LoraBinding>,
}

/// What a sequence bound to a loaded LoRA adapter computes with.
#[derive(Debug, Clone)]
pub struct LoraBinding {
    /// The load's serial, the sequence's cache namespace (entries computed with one loaded
    /// adapter are never served to another load of it).
    pub serial: u32,
    /// The adapter's weights.
    pub weights: std::sync::Arc<model::LoraAdapter>,
}

/// A reservation ledger entry (one per sequence: a new reservation commits the one before), opened
/// by `ReserveKv` (one position) or by a `Verify` (its row's positions).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reservation {
    /// The position reserved (the sequence's `computed_len` when it was reserved).
    pub at: usize,
    /// The blocks the reservation added, in position order (at most one for `ReserveKv`).
    pub blocks: Vec<u32>,
    /// The output checkpoint a `MarconiCheckpoint` past `at` replaced, held until the run-ahead
    /// is kept (freed then) or rolled back (restored then).
    pub superseded: Option<(usize, crate::CheckpointSlot)>,
}

impl RouterSeq {
    /// The tokens whose KV and state exist (`tokens()[..computed_len()]`), plus, before the prompt is
    /// complete, the rest of the prompt.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// The KV block ids this sequence holds a reference on, in position order.
    pub fn blocks(&self) -> &[u32] {
        &self.blocks
    }

    /// The cache namespace (LoRA adapter and cache salt).
    pub fn namespace(&self) -> Namespace {
        self.namespace
    }

    /// Whether a forward step over this sequence failed (it will never be cached).
    pub fn failed(&self) -> bool {
        self.failed
    }

    /// The positions of the checkpoints this sequence holds for the prefix cache (end of input,
    /// latest block boundary of the output).
    pub fn checkpoints_held(&self) -> (Option<usize>, Option<usize>) {
        (
            self.input_checkpoint.map(|(pos, _)| pos),
            self.output_checkpoint.map(|(pos, _)| pos),
        )
    }

    /// Whether the sequence holds any router resource.
    pub fn holds_resources(&self) -> bool {
        self.tenure.is_some()
    }

    /// The namespace the prefix cache keys this sequence by: its salt, and instead of the
    /// adapter's id the serial of the adapter's load it is bound to, so entries computed with
    /// one loaded adapter are never served to another.
    pub fn cache_namespace(&self) -> Namespace {
        Namespace {
            adapter: self.lora.as_ref().map(|binding| binding.serial),
            cache_salt: self.namespace.cache_salt,
        }
    }
}

impl Sequence for RouterSeq {
    fn create(spec: SeqSpec<'_>) -> Self {
        RouterSeq {
            id: spec.id,
            prompt_len: spec.prompt.len(),
            tokens: spec.prompt.to_vec(),
            computed_len: 0,
            blocks: Vec::new(),
            slot: None,
            tenure: None,
            namespace: Namespace {
                adapter: spec.adapter,
                cache_salt: spec.cache_salt,
            },
            pin: None,
            branch_point: None,
            branch_taken: None,
            input_checkpoint: None,
            output_checkpoint: None,
            checkpoint_due: false,
            failed: false,
            reservation: None,
            state_ahead: false,
            lora: None,
        }
    }

    fn id(&self) -> u64 {
        self.id
    }

    fn prompt_len(&self) -> usize {
        self.prompt_len
    }

    fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    fn computed_len(&self) -> usize {
        self.computed_len
    }

    fn slot(&self) -> Option<usize> {
        self.slot
    }

    fn checkpoint_due(&self) -> bool {
        self.checkpoint_due
    }
}

/// Tenure ids are unique in the process, not just per router, so a sequence handed to a router
/// that does not hold it is recognised (its tenure is not in that router's table) instead of
/// having its block ids released there.
static NEXT_TENURE: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

/// A fresh tenure id, unique in the process.
pub fn new_tenure() -> u64 {
    NEXT_TENURE.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}
