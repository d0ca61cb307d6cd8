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
//!   block, else evicts the least recently used cached block that nobody holds and no held
//!   block descends from (always a leaf of its chain: a block is never evicted before its
//!   descendants); a dry pool is the typed outcome [`Exhausted`]. Used alone, the pool is a
//!   ref-counted allocator (the Marconi store in `ssm-snapshot` holds its references through
//!   `retain`/`release`).
//! - A [`BlockTable`] maps one sequence's positions to blocks: append, truncate, fork with
//!   copy-on-write ([`table`]). Its pending run-ahead reservation (the ledger entry for
//!   `reserve_next`/`rollback`) is a field of the table, so there is no second map to keep in
//!   step with it.
//! - A [`KvCache`] is a pool plus the prefix cache ([`prefix`]): full blocks keyed by a hash
//!   chain, `match_prefix` (longest cached prefix, references taken) and `insert`. A router keeps
//!   one `KvCache`, its tables, and hands `kv.pool_mut()` to the tables, the ledger and the
//!   Marconi store: one set of reference counts, no double bookkeeping. A router that keeps a
//!   sequence's [`BlockKeys`] hands them to `match_keys` and `insert_keys`, so no block of the
//!   sequence is hashed twice.
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
//! // Finish: offer the full blocks to the prefix cache, then release (in any order: a held
//! // block keeps the blocks before it from being evicted).
//! assert_eq!(kv.insert(&prompt, table.blocks(), extra)?, 2);
//! table.release_all(kv.pool_mut());
//! assert_eq!(kv.pool().cached_blocks(), 2);
//! assert_eq!(kv.cached_prefix_len(&prompt, extra), 32);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! # Exact hits, and the hash
//!
//! Every hit is exact, whatever the hash: a cached block records the cached block before it in
//! its chain (a first block records its namespace), and a lookup accepts a block only if it is
//! linked to the block matched one position earlier (a first block: to the query's namespace)
//! and holds exactly the query's tokens (4 bytes per token slot of the pool are kept for that).
//! So a collision, accidental or crafted, degrades to a counted miss and can never hand one
//! prefix's K/V, or one tenant's, to another. vLLM moved to SHA-256 because its lookups trusted
//! the hash; verifying is cheaper and exact.
//!
//! Block keys are xxh3 ([`hash`]), seeded per cache instance, so keys cannot be precomputed from
//! outside; keys are 64-bit by default, 128-bit ([`HashKind::Xxh3x128`], the index then compares
//! all 128 bits) for pools shared by tenants that do not trust each other, where not even a
//! crafted miss is within reach. The key includes the LoRA adapter and a per-tenant cache salt
//! ([`ExtraKey`]): two tenants share a block only if they share a salt.
//!
//! Keys are what the index and the cache events need; a lookup mostly does without them. A
//! cached block also records its *first child*, and a lookup follows first children through a
//! conversation's chain, comparing tokens, without hashing or probing the index; the index (a
//! table of block ids probed with the key itself, nothing hashed twice) holds only the other
//! blocks: first blocks and the children of branch points. Each block of a sequence is hashed at
//! most once: by the lookup that reaches the index there, or by the insert that registers it.
//!
//! # Memory per block
//!
//! Bookkeeping per block: a 32-byte record (key, reference count, pins, parent, first child, list
//! links), the index's share (a `hashbrown` table of 4-byte ids plus a control byte, with room
//! for every block: 5.7 to 11.4 bytes per block as the table rounds up to a power of two, 10 at
//! 16,384 or 262,144 blocks), one bit for the insert's duplicate check, and 8 bytes more with
//! 128-bit keys: about 42 bytes per block, plus the cached tokens (4 bytes per token slot, 64 at a
//! block size of 16). A pool used alone keeps only the records. All of it is allocated, and
//! written, when the cache is made: no operation allocates on the heap or faults in a page
//! (the first block registered in each of more than 64 namespaces is the exception).
//!
//! # Performance
//!
//! `taskset -c 0 cargo bench -p kv-cache --bench op_trace` replays the operation trace of a
//! multi-turn chat workload (lookup, allocate, insert, free per request; see the bench's docs)
//! and prints, per configuration, ns per block operation (each request's median over 7 rounds,
//! summed, over Σ⌈|T|/16⌉), median and p99 µs per request, and the heap allocations made in the
//! timed operations. On a shared 2-core AMD EPYC (Zen 4) virtual machine, pinned to one core, a
//! 1,379-request trace of 3.2M input tokens (93.5% of them cache hits) printed:
//!
//! | prompts, pool | ns/block op | median µs/request | p99 µs/request | hit tokens | evictions |
//! |---|---|---|---|---|---|
//! | 1×, N = 16,384 (evicts) | 25.8 | 3.90 | 7.68 | 3,005,280 | 10,797 |
//! | 1×, N = 262,144 (never evicts) | 25.4 | 3.82 | 7.21 | 3,005,280 | 0 |
//! | 8×, N = 131,072 (evicts) | 19.2 | 22.87 | 47.58 | 24,114,720 | 86,593 |
//! | 8×, N = 2,097,152 (never evicts) | 18.3 | 21.93 | 43.59 | 24,114,720 | 0 |
//!
//! with no heap allocation in the timed operations, hit digests `130d11bc18c09885` (1×) and
//! `e3e8b668ecbf3f6a` (8×), and, per phase at 1× (N = 16,384), lookup 14.8, allocate 0.9, insert
//! 6.5 and free 2.9 ns per block operation. Figures on a shared machine move by several percent
//! from run to run.
//!
//! At the never-evicting size the per-request hits equal those of the bench's naive model. A
//! block operation costs less at 8× longer prompts than at 1× (per-request costs spread over more
//! blocks).
#![forbid(unsafe_code)]

pub mod error;
pub mod events;
pub mod hash;
pub mod pool;
pub mod prefix;
pub mod table;

pub use error::{Exhausted, Inconsistency, KvError};
pub use events::CacheEvent;
pub use hash::{BlockHash, BlockHasher, BlockKeys, ExtraKey, HashKind};
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
