//! The crate's errors: `Exhausted` (a dry pool, an outcome callers branch on), `KvError` (bad
//! input or misuse, reported and harmless) and `Inconsistency` (what `check_consistency` finds).
//!
//! Every operation that returns one of these has changed nothing: errors are detected before the
//! first mutation.

use crate::BlockId;

/// The pool cannot supply the blocks an operation needs. Nothing was allocated or changed; the
/// caller may free or preempt something and retry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("KV pool exhausted: {needed} blocks needed, {free} available (free plus evictable cached)")]
pub struct Exhausted {
    /// How many blocks the operation needed in total.
    pub needed: usize,
    /// How many blocks the pool could hand out: free blocks plus evictable cached blocks.
    pub free: usize,
}

/// Bad input or a misuse of the pool. The operation that returned it changed nothing.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KvError {
    /// A pool must have at least one block.
    #[error("a KV pool needs at least one block (got num_blocks = 0)")]
    NoBlocks,
    /// A block holds at least one token.
    #[error("a KV block holds at least one token (got block_size = 0)")]
    ZeroBlockSize,
    /// Block ids are `u32` and `u32::MAX` is reserved as the list terminator.
    #[error("num_blocks = {num_blocks} exceeds the limit of {max} blocks")]
    TooManyBlocks {
        /// The requested number of blocks.
        num_blocks: usize,
        /// The largest supported number of blocks.
        max: usize,
    },
    /// `num_blocks * block_size` tokens do not fit in a `usize`.
    #[error("num_blocks = {num_blocks} times block_size = {block_size} overflows a usize")]
    CapacityOverflow {
        /// The requested number of blocks.
        num_blocks: usize,
        /// The requested block size.
        block_size: usize,
    },
    /// The block id is not an index of this pool.
    #[error("block {} is out of range: the pool has {num_blocks} blocks", block.0)]
    UnknownBlock {
        /// The offending id.
        block: BlockId,
        /// The pool's size.
        num_blocks: usize,
    },
    /// `release` (or an operation built on it) met a block nobody holds.
    #[error("block {} has reference count 0: it cannot be released", block.0)]
    NotHeld {
        /// The offending id.
        block: BlockId,
    },
    /// `retain` met a free block: a free block has no contents worth holding and sits in the free
    /// list, so a reference on it would let `allocate` hand it to a second owner.
    #[error("block {} is free: allocate it instead of retaining it", block.0)]
    RetainFree {
        /// The offending id.
        block: BlockId,
    },
    /// A block's reference count would exceed `u32::MAX`.
    #[error("block {} already has the maximum of {max} holders", block.0)]
    RefCountOverflow {
        /// The offending id.
        block: BlockId,
        /// The limit.
        max: u32,
    },
    /// `rollback` on a table with no pending reservation.
    #[error("rollback without a pending reservation")]
    NoReservation,
    /// `truncate` to a length longer than the table.
    #[error("cannot truncate a table of {len} tokens to {requested} tokens")]
    TruncateBeyondLength {
        /// The requested length.
        requested: usize,
        /// The table's length.
        len: usize,
    },
    /// A table's length would overflow a `usize`.
    #[error("appending {added} tokens to a table of {len} tokens overflows a usize")]
    LengthOverflow {
        /// The table's length.
        len: usize,
        /// The number of tokens to add.
        added: usize,
    },
    /// `insert` got fewer blocks than the tokens' full blocks.
    #[error("insert needs {needed} blocks for {tokens} tokens but got {blocks}")]
    TooFewBlocks {
        /// The number of tokens given.
        tokens: usize,
        /// The number of full blocks those tokens fill.
        needed: usize,
        /// The number of block ids given.
        blocks: usize,
    },
    /// `insert` got the same block at two positions.
    #[error("block {} appears twice in the blocks given to insert", block.0)]
    DuplicateBlock {
        /// The offending id.
        block: BlockId,
    },
    /// `insert` got a block that is already cached under a different key: the caller's tokens
    /// are not what the block holds.
    #[error("block {} at position {position} is already cached with other contents", block.0)]
    CachedWithOtherContents {
        /// The offending id.
        block: BlockId,
        /// Its index in the blocks given.
        position: usize,
    },
    /// The operation needed blocks the pool could not supply.
    #[error(transparent)]
    Exhausted(#[from] Exhausted),
}

/// A broken pool invariant found by [`BlockPool::check_consistency`](crate::BlockPool::check_consistency).
/// It can only arise from a bug in this crate; tests and fault-injection harnesses call the check.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("KV pool inconsistency: {0}")]
pub struct Inconsistency(pub String);
