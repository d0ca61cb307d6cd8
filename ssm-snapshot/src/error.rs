//! The crate's error type: every rejected input names the bad value and the limit it broke.
//! A call that returns an error has changed nothing.

use crate::slots::SlotId;

/// Why the store, the cost model or the simulator refused an input.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SnapshotError {
    /// A cost-model coefficient is negative, not finite, or a byte size is zero.
    #[error("bad cost model: `{field}` is {value} (FLOPs must be finite and non-negative, byte sizes positive)")]
    BadCost {
        /// The offending field.
        field: &'static str,
        /// Its value, as text.
        value: String,
    },
    /// No built-in cost model has this name.
    #[error("unknown cost model `{0}` (built in: {list})", list = crate::cost::BUILT_IN_MODELS.join(", "))]
    UnknownModel(String),
    /// A store configuration value is out of range.
    #[error("bad store config: `{field}` is {value} ({limit})")]
    BadConfig {
        /// The offending field.
        field: &'static str,
        /// Its value, as text.
        value: String,
        /// What it must be.
        limit: &'static str,
    },
    /// The pin is not (or no longer) held: it was finished or released already.
    #[error("pin {index}/{generation} is not held (already finished or released)")]
    StalePin {
        /// Pin slot index.
        index: u32,
        /// Pin generation.
        generation: u32,
    },
    /// A checkpoint slot id is outside the pool.
    #[error("checkpoint slot {slot:?} is outside the pool of {slots} slots")]
    SlotOutOfRange {
        /// The slot.
        slot: SlotId,
        /// Pool size.
        slots: u32,
    },
    /// A checkpoint slot was handed in that is not reserved (free, or already holding a cached
    /// checkpoint, or listed twice).
    #[error("checkpoint slot {slot:?} is not reserved by the caller (state: {state})")]
    SlotNotReserved {
        /// The slot.
        slot: SlotId,
        /// Its current state.
        state: &'static str,
    },
    /// A checkpoint position is not a positive multiple of the block size within the sequence.
    #[error("checkpoint position {pos} is invalid: must be a positive multiple of block size {block_size}, at most {limit}, and increasing")]
    BadCheckpointPosition {
        /// The position.
        pos: usize,
        /// The store's block size.
        block_size: u32,
        /// The largest allowed position (full-block length of the tokens).
        limit: usize,
    },
    /// Fewer KV block ids than the sequence's full blocks.
    #[error(
        "{got} KV block ids given for {tokens} tokens; block size {block_size} needs {needed}"
    )]
    TooFewBlocks {
        /// Block ids given.
        got: usize,
        /// Tokens given.
        tokens: usize,
        /// Block size.
        block_size: u32,
        /// Block ids needed.
        needed: usize,
    },
    /// A trace could not be read (the file, the line and the field at fault).
    #[error(transparent)]
    Trace(#[from] workload_trace::TraceError),
    /// A bad command-line argument for the simulator.
    #[error("bad argument: {0}")]
    BadArgument(String),
    /// An I/O failure (file name and OS message).
    #[error("{path}: {message}")]
    Io {
        /// The file.
        path: String,
        /// The OS message.
        message: String,
    },
    /// A bookkeeping check of the simulator failed (a bug in the store, never bad input).
    #[error("internal check failed: {0}")]
    Internal(String),
}
