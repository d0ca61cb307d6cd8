//! Paged KV bookkeeping: block pool with ref counts, per-sequence block tables, the hash-chain
//! prefix cache, the run-ahead reservation ledger, counters and cache events.
//!
//! **Architecture Invariant:** this crate never names a device; a router keeps the K/V arrays,
//! this crate says which block holds what, who shares it and what may be evicted.
#![forbid(unsafe_code)]

/// The index of one KV block in a pool: the same index addresses the block's K/V rows in every
/// attention layer of a router.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct BlockId(pub u32);

impl BlockId {
    /// The block's index as a `usize`, for addressing a router's arrays.
    pub fn index(self) -> usize {
        self.0 as usize
    }
}
