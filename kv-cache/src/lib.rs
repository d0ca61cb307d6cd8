//! Paged KV bookkeeping: block pool with ref counts, per-sequence block tables, the hash-chain
//! prefix cache, the run-ahead reservation ledger, counters and cache events.
//!
//! **Architecture Invariant:** this crate never names a device; a router keeps the K/V arrays,
//! this crate says which block holds what, who shares it and what may be evicted. It depends on
//! no other workspace crate.
//!
//! # The model
//!
//! - A [`BlockPool`] owns `num_blocks` blocks of `block_size` token positions. Each block has a
//!   reference count (its holders) and is in one of four states, `Free`, `Owned`, `CachedHeld`,
//!   `CachedEvictable`, documented with their transitions in [`pool`]. Allocation takes a free
//!   block, else evicts the least recently released cached block; a dry pool is the typed outcome
//!   [`Exhausted`]. Used alone, the pool is a ref-counted allocator (the Marconi store in
//!   `ssm-snapshot` holds its references through `retain`/`release`).
//! - A [`BlockTable`] maps one sequence's positions to blocks: append, truncate, fork with
//!   copy-on-write ([`table`]). Its pending run-ahead reservation (the ledger entry for
//!   `reserve_next`/`rollback`) is a field of the table, so there is no second map to keep in
//!   step with it.
//! - A [`KvCache`] is a pool plus the prefix cache ([`prefix`]): full blocks keyed by a hash
//!   chain, `match_prefix` (longest cached prefix, references taken) and `insert`. A router keeps
//!   one `KvCache`, its tables, and hands `kv.pool_mut()` to the tables, the ledger and the
//!   Marconi store: one set of reference counts, no double bookkeeping.
//! - Counters ([`CacheCounters`], [`KvStats`]) and cache events ([`CacheEvent`], subscribed to with
//!   [`BlockPool::subscribe`], see [`events`]).
//!
//! # A router's flow
//!
//! ```
//! use kv_cache::{BlockTable, ExtraKey, KvCache, KvCacheConfig};
//!
//! let mut kv = KvCache::new(KvCacheConfig::new(64, 16))?;
//! let prompt: Vec<u32> = (0..40).collect();
//! let extra = ExtraKey::NONE.with_salt(7);
//!
//! // Admission: attach the longest cached prefix (all but the last token, which must be
//! // computed for its logits), then make room for the rest of the prompt.
//! let hit = kv.match_prefix(&prompt[..prompt.len() - 1], extra);
//! let mut table = BlockTable::from_prefix(hit);
//! table.append(kv.pool_mut(), prompt.len() - table.len())?;
//!
//! // Decoding at pipeline depth 2: reserve the next position before launching, and roll the
//! // over-run back when the sequence turns out to have finished.
//! let added = table.reserve_next(kv.pool_mut())?;
//! assert_eq!(added, 0); // position 40 is inside the third block
//! table.append(kv.pool_mut(), 1)?;
//! table.rollback(kv.pool_mut())?;
//!
//! // Finish: offer the full blocks to the prefix cache, then release (tail first).
//! assert_eq!(kv.insert(&prompt, table.blocks(), extra)?, 2);
//! table.release_all(kv.pool_mut());
//! assert_eq!(kv.pool().cached_blocks(), 2);
//! assert_eq!(kv.cached_prefix_len(&prompt, extra), 32);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! # The hash, and why
//!
//! Block keys are xxh3 ([`hash`]), one of the fastest well-tested non-cryptographic hashes: the
//! whole lookup of a 32k-token prompt, hashing, index probe and verification included, measures
//! under 2 ns per token (see the benches), where a cryptographic hash alone would cost several
//! times that. Each cache instance draws its own seed, so keys cannot be precomputed from
//! outside; keys are 64-bit by default, 128-bit ([`HashKind::Xxh3x128`]) for pools shared by
//! tenants that do not trust each other. The key includes the LoRA adapter and a per-tenant cache
//! salt ([`ExtraKey`]): two tenants share a block only if they share a salt.
//!
//! xxh3 is not a cryptographic hash, which is why the cache does not trust it: every hit is
//! verified against the block's stored tokens, parent key and extra key (4 bytes per token slot
//! of the pool, kept once the first block is cached), so a collision, accidental or crafted,
//! degrades to a miss and can never hand one prefix's K/V, or one tenant's, to another. vLLM moved
//! to SHA-256 because its lookups trusted the hash; verifying is cheaper and exact.
#![forbid(unsafe_code)]

pub mod error;
pub mod events;
pub mod hash;
pub mod pool;
pub mod prefix;
pub mod table;

pub use error::{Exhausted, Inconsistency, KvError};
pub use events::CacheEvent;
pub use hash::{BlockHash, BlockHasher, ExtraKey, HashKind};
pub use pool::{BlockPool, BlockState, CacheCounters, CachedBlock, KvStats};
pub use prefix::{KvCache, KvCacheConfig, PrefixMatch};
pub use table::{Appended, BlockCopy, BlockTable, Reservation};

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

#[cfg(test)]
mod send_sync {
    use super::*;

    fn assert_send_sync<T: Send + Sync>() {}

    /// Routers keep these behind a mutex or on a worker thread: they must cross threads.
    #[test]
    fn public_handles_are_send_and_sync() {
        assert_send_sync::<BlockPool>();
        assert_send_sync::<KvCache>();
        assert_send_sync::<BlockTable>();
        assert_send_sync::<CacheEvent>();
        assert_send_sync::<crossbeam_channel::Receiver<CacheEvent>>();
        assert_send_sync::<KvError>();
    }
}
