//! The block pool: ref-counted KV blocks, the free list, the LRU list of evictable cached blocks,
//! the registry of cached blocks' keys, the counters and the event bus.
//!
//! # Block states
//!
//! Every block is in exactly one of four states, decided by two facts: its reference count `rc`
//! (how many holders: block tables, a pending reservation, a prefix match not yet handed to a
//! table, an outside store such as the Marconi tree) and whether a key is registered for it in
//! the prefix cache (`key`).
//!
//! | state              | `rc` | `key` | where it lives               | counted in        |
//! |--------------------|------|-------|------------------------------|-------------------|
//! | `Free`             | 0    | none  | the free list (exactly once) | `free_blocks()`   |
//! | `Owned`            | ≥ 1  | none  | its holders                  | `used_blocks()`   |
//! | `CachedHeld`       | ≥ 1  | some  | its holders and the index    | `used_blocks()`   |
//! | `CachedEvictable`  | 0    | some  | the LRU list (exactly once) and the index | `cached_blocks()` |
//!
//! So `free_blocks() + cached_blocks() + used_blocks() == num_blocks()` always, and
//! `registered_blocks()` (every block with a key) is `cached_blocks()` plus the `CachedHeld` ones.
//!
//! # Transitions
//!
//! ```text
//!   Free ──allocate──▶ Owned ──register (KvCache::insert)──▶ CachedHeld
//!     ▲                 │  ▲                                  │  ▲
//!     └─release (rc→0)──┘  │                    release(rc→0) │  │ retain (a prefix hit)
//!                          │                                  ▼  │
//!                          └──allocate evicts (LRU first)── CachedEvictable
//! ```
//!
//! - `allocate`: `Free → Owned` (pops the free list); only when the free list is empty,
//!   `CachedEvictable → Owned` for the least recently released cached block (its key leaves the
//!   index, a `BlockRemoved` event is published). Neither possible: [`Exhausted`].
//! - `retain`: `rc += 1` on `Owned`/`CachedHeld`; `CachedEvictable → CachedHeld` (leaves the LRU
//!   list). On `Free` it is an error ([`KvError::RetainFree`]): a free block sits in the free list
//!   and would be handed to a second owner.
//! - `release`: `rc -= 1`; at zero, `Owned → Free` (pushed on the free list) or
//!   `CachedHeld → CachedEvictable` (appended at the most recent end of the LRU list). On `rc == 0`
//!   it is an error ([`KvError::NotHeld`]) and nothing changes.
//! - `clear_cache`: every key is dropped: `CachedHeld → Owned`, `CachedEvictable → Free`.
//!
//! What can never happen: a block in the free list twice, or in both lists; a block in a list
//! with `rc > 0`; a key in the index for a block in `Free` or `Owned`; two blocks under one key.
//! [`BlockPool::check_consistency`] verifies all of it.
//!
//! # Costs
//!
//! `allocate`, `retain` and `release` are O(1) and allocate nothing on the heap: the free list is
//! a stack preallocated to `num_blocks`, and the LRU list is intrusive (links live in the per-block
//! slots). Eviction also removes one entry from a hash map.

use std::collections::HashMap;

use crossbeam_channel::Receiver;

use crate::events::{CacheEvent, EventBus};
use crate::{BlockHash, BlockId, Exhausted, ExtraKey, Inconsistency, KvError};

/// The list terminator of the intrusive LRU list; never a block id (pools are smaller).
const NIL: u32 = u32::MAX;

/// A block's state; see the [module docs](self).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BlockState {
    /// No holder, no key: in the free list.
    Free,
    /// Held, not in the prefix cache.
    Owned,
    /// Held and in the prefix cache.
    CachedHeld,
    /// In the prefix cache with no holder: may be evicted by `allocate`.
    CachedEvictable,
}

/// Monotonic counters since the pool was made.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheCounters {
    /// Calls of `match_prefix`.
    pub lookups: u64,
    /// Tokens queried by those calls.
    pub lookup_tokens: u64,
    /// Blocks those calls returned.
    pub hit_blocks: u64,
    /// Tokens those blocks hold.
    pub hit_tokens: u64,
    /// Blocks registered by `insert`.
    pub stored_blocks: u64,
    /// Blocks `insert` left unregistered because an equal block was already cached.
    pub deduplicated_blocks: u64,
    /// Cached blocks evicted by `allocate`.
    pub evictions: u64,
    /// Lookups or inserts that found a different block under the same key (a hash collision).
    pub hash_collisions: u64,
}

/// A snapshot of the pool's gauges and counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvStats {
    /// `num_blocks()`.
    pub total_blocks: usize,
    /// Blocks in the free list.
    pub free_blocks: usize,
    /// Cached blocks nobody holds (evictable).
    pub cached_blocks: usize,
    /// Blocks with at least one holder.
    pub used_blocks: usize,
    /// Blocks with a key, held or not.
    pub registered_blocks: usize,
    /// The counters.
    pub counters: CacheCounters,
}

/// What the prefix cache knows about a cached block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CachedBlock<'a> {
    /// The block's key.
    pub hash: BlockHash,
    /// The key of the block before it, `None` for a first block.
    pub parent: Option<BlockHash>,
    /// The adapter and salt.
    pub extra: ExtraKey,
    /// The tokens it holds.
    pub tokens: &'a [u32],
}

/// The key fields of a cached block, kept per block id.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct BlockKey {
    pub(crate) hash: BlockHash,
    pub(crate) parent: Option<BlockHash>,
    pub(crate) extra: ExtraKey,
}

/// Per-block bookkeeping. `prev`/`next` link the LRU list and are `NIL` unless the block is
/// `CachedEvictable`.
#[derive(Debug, Clone, Copy)]
struct Slot {
    ref_count: u32,
    prev: u32,
    next: u32,
}

/// A pool of `num_blocks` KV blocks of `block_size` tokens each; see the [module docs](self).
///
/// Used alone it is a ref-counted allocator (no block ever gets a key, so `cached_blocks()` stays
/// 0); [`KvCache`](crate::KvCache) adds the prefix cache on top of the same pool.
#[derive(Debug)]
pub struct BlockPool {
    block_size: usize,
    slots: Vec<Slot>,
    /// Free block ids; the top is handed out next. Capacity `num_blocks`, so pushes never allocate.
    free: Vec<u32>,
    /// Least recently released evictable block (evicted first), or `NIL`.
    lru_head: u32,
    /// Most recently released evictable block, or `NIL`.
    lru_tail: u32,
    lru_len: usize,
    /// Blocks with `ref_count > 0`.
    used: usize,
    /// `keys[i]` is `Some` exactly when block `i` is cached.
    keys: Vec<Option<BlockKey>>,
    /// Cached blocks' tokens, `block_size` per block id; empty until the first registration.
    tokens: Vec<u32>,
    index: HashMap<BlockHash, BlockId>,
    counters: CacheCounters,
    events: EventBus,
}

impl BlockPool {
    /// The largest supported pool (`u32::MAX` is the list terminator).
    pub const MAX_BLOCKS: usize = (u32::MAX - 1) as usize;

    /// A pool with every block free.
    pub fn new(num_blocks: usize, block_size: usize) -> Result<Self, KvError> {
        if num_blocks == 0 {
            return Err(KvError::NoBlocks);
        }
        if block_size == 0 {
            return Err(KvError::ZeroBlockSize);
        }
        if num_blocks > Self::MAX_BLOCKS {
            return Err(KvError::TooManyBlocks {
                num_blocks,
                max: Self::MAX_BLOCKS,
            });
        }
        if num_blocks.checked_mul(block_size).is_none() {
            return Err(KvError::CapacityOverflow {
                num_blocks,
                block_size,
            });
        }
        let last = u32::try_from(num_blocks).map_err(|_| KvError::TooManyBlocks {
            num_blocks,
            max: Self::MAX_BLOCKS,
        })?;
        Ok(Self {
            block_size,
            slots: vec![
                Slot {
                    ref_count: 0,
                    prev: NIL,
                    next: NIL,
                };
                num_blocks
            ],
            // Reversed, so that block 0 is handed out first.
            free: (0..last).rev().collect(),
            lru_head: NIL,
            lru_tail: NIL,
            lru_len: 0,
            used: 0,
            keys: vec![None; num_blocks],
            tokens: Vec::new(),
            index: HashMap::new(),
            counters: CacheCounters::default(),
            events: EventBus::default(),
        })
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Blocks in the pool.
    pub fn num_blocks(&self) -> usize {
        self.slots.len()
    }

    /// Blocks in the free list (`Free`).
    pub fn free_blocks(&self) -> usize {
        self.free.len()
    }

    /// Cached blocks nobody holds (`CachedEvictable`).
    pub fn cached_blocks(&self) -> usize {
        self.lru_len
    }

    /// Blocks with at least one holder (`Owned` or `CachedHeld`).
    pub fn used_blocks(&self) -> usize {
        self.used
    }

    /// Blocks `allocate` can hand out: free plus evictable cached.
    pub fn available_blocks(&self) -> usize {
        self.free.len() + self.lru_len
    }

    /// Blocks with a key in the prefix cache, held or not.
    pub fn registered_blocks(&self) -> usize {
        self.index.len()
    }

    /// The block's holder count; 0 for a free, evictable or unknown block.
    pub fn ref_count(&self, id: BlockId) -> u32 {
        self.slots.get(id.index()).map_or(0, |s| s.ref_count)
    }

    /// The block's state, `None` for an id outside the pool.
    pub fn state(&self, id: BlockId) -> Option<BlockState> {
        let slot = self.slots.get(id.index())?;
        let cached = self.keys[id.index()].is_some();
        Some(match (slot.ref_count, cached) {
            (0, false) => BlockState::Free,
            (_, false) => BlockState::Owned,
            (0, true) => BlockState::CachedEvictable,
            (_, true) => BlockState::CachedHeld,
        })
    }

    /// What the prefix cache knows about the block, `None` unless it is cached.
    pub fn cached(&self, id: BlockId) -> Option<CachedBlock<'_>> {
        let key = self.keys.get(id.index())?.as_ref()?;
        Some(CachedBlock {
            hash: key.hash,
            parent: key.parent,
            extra: key.extra,
            tokens: self.block_tokens(id),
        })
    }

    /// The counters.
    pub fn counters(&self) -> CacheCounters {
        self.counters
    }

    /// Gauges and counters at once.
    pub fn stats(&self) -> KvStats {
        KvStats {
            total_blocks: self.num_blocks(),
            free_blocks: self.free_blocks(),
            cached_blocks: self.cached_blocks(),
            used_blocks: self.used_blocks(),
            registered_blocks: self.registered_blocks(),
            counters: self.counters,
        }
    }

    /// A new subscription to the cache events; see [`crate::events`].
    pub fn subscribe(&mut self) -> Receiver<CacheEvent> {
        self.events.subscribe()
    }

    /// Live event subscriptions (a dropped receiver counts until the next event).
    pub fn subscribers(&self) -> usize {
        self.events.subscriber_count()
    }

    /// Hands out one block with reference count 1: a free block if there is one, else the least
    /// recently released evictable cached block (whose key is dropped).
    pub fn allocate(&mut self) -> Result<BlockId, Exhausted> {
        let index = match self.free.pop() {
            Some(index) => index,
            None if self.lru_head != NIL => {
                let index = self.lru_head;
                self.lru_unlink(index);
                self.evict_key(index);
                index
            }
            None => return Err(Exhausted { needed: 1, free: 0 }),
        };
        self.slots[index as usize].ref_count = 1;
        self.used += 1;
        Ok(BlockId(index))
    }

    /// Allocates `count` blocks into `out` (appended), or none at all.
    pub fn allocate_many(&mut self, count: usize, out: &mut Vec<BlockId>) -> Result<(), Exhausted> {
        self.ensure_available(count)?;
        out.reserve(count);
        for _ in 0..count {
            // Cannot fail: availability was checked and nothing else runs in between.
            out.push(self.allocate()?);
        }
        Ok(())
    }

    /// Adds a holder. Revives an evictable cached block; an error on a free block.
    pub fn retain(&mut self, id: BlockId) -> Result<(), KvError> {
        let index = self.check_id(id)?;
        let ref_count = self.slots[index].ref_count;
        if ref_count == u32::MAX {
            return Err(KvError::RefCountOverflow {
                block: id,
                max: u32::MAX,
            });
        }
        if ref_count == 0 {
            if self.keys[index].is_none() {
                return Err(KvError::RetainFree { block: id });
            }
            self.lru_unlink(id.0);
            self.used += 1;
        }
        self.slots[index].ref_count = ref_count + 1;
        Ok(())
    }

    /// Drops a holder. At zero a cached block becomes evictable (the most recent end of the LRU
    /// list), any other block free. An error, changing nothing, when nobody holds the block.
    pub fn release(&mut self, id: BlockId) -> Result<(), KvError> {
        let index = self.check_id(id)?;
        let ref_count = self.slots[index].ref_count;
        if ref_count == 0 {
            return Err(KvError::NotHeld { block: id });
        }
        self.slots[index].ref_count = ref_count - 1;
        if ref_count == 1 {
            self.used -= 1;
            if self.keys[index].is_some() {
                self.lru_push_back(id.0);
            } else {
                self.free.push(id.0);
            }
        }
        Ok(())
    }

    /// Drops every key: held cached blocks become plain owned blocks, evictable ones free.
    /// Publishes `AllCleared`.
    pub fn clear_cache(&mut self) {
        while self.lru_head != NIL {
            let index = self.lru_head;
            self.lru_unlink(index);
            self.free.push(index);
        }
        for key in &mut self.keys {
            *key = None;
        }
        self.index.clear();
        if self.events.is_active() {
            self.events.publish(CacheEvent::AllCleared);
        }
    }

    /// Verifies every invariant of the [module docs](self); O(num_blocks).
    pub fn check_consistency(&self) -> Result<(), Inconsistency> {
        let n = self.num_blocks();
        let fail = |what: String| Err(Inconsistency(what));
        let mut in_free = vec![false; n];
        for &index in &self.free {
            let i = index as usize;
            if i >= n {
                return fail(format!("free list holds out-of-range id {i}"));
            }
            if in_free[i] {
                return fail(format!("block {i} is in the free list twice"));
            }
            in_free[i] = true;
            if self.slots[i].ref_count != 0 || self.keys[i].is_some() {
                return fail(format!("free-listed block {i} is held or cached"));
            }
        }
        let mut in_lru = vec![false; n];
        let mut count = 0;
        let mut prev = NIL;
        let mut cursor = self.lru_head;
        while cursor != NIL {
            let i = cursor as usize;
            if i >= n || in_lru[i] || count > n {
                return fail(format!("the LRU list is malformed at {cursor}"));
            }
            in_lru[i] = true;
            count += 1;
            if in_free[i] {
                return fail(format!("block {i} is in both lists"));
            }
            if self.slots[i].ref_count != 0 || self.keys[i].is_none() {
                return fail(format!("LRU-listed block {i} is held or has no key"));
            }
            if self.slots[i].prev != prev {
                return fail(format!("block {i} has a wrong LRU back link"));
            }
            prev = cursor;
            cursor = self.slots[i].next;
        }
        if prev != self.lru_tail || count != self.lru_len {
            return fail(format!(
                "LRU tail or length is stale ({count} linked, {} recorded)",
                self.lru_len
            ));
        }
        let mut used = 0;
        for (i, slot) in self.slots.iter().enumerate() {
            if slot.ref_count > 0 {
                used += 1;
            } else if !in_free[i] && !in_lru[i] {
                return fail(format!("block {i} is unheld but in neither list"));
            }
            if !in_lru[i] && (slot.prev != NIL || slot.next != NIL) {
                return fail(format!("block {i} keeps LRU links outside the list"));
            }
        }
        if used != self.used {
            return fail(format!("{used} blocks are held but {} recorded", self.used));
        }
        let keyed = self.keys.iter().filter(|k| k.is_some()).count();
        if keyed != self.index.len() {
            return fail(format!(
                "{keyed} keyed blocks but {} index entries",
                self.index.len()
            ));
        }
        for (hash, id) in &self.index {
            match self.keys.get(id.index()) {
                Some(Some(key)) if key.hash == *hash => {}
                _ => {
                    return fail(format!(
                        "index entry {hash} points at block {} without that key",
                        id.0
                    ))
                }
            }
        }
        Ok(())
    }

    // ----- crate-internal: the prefix cache's access to the registry -----

    pub(crate) fn lookup(&self, hash: BlockHash) -> Option<BlockId> {
        self.index.get(&hash).copied()
    }

    pub(crate) fn key_of(&self, id: BlockId) -> Option<&BlockKey> {
        self.keys.get(id.index())?.as_ref()
    }

    /// The registered tokens of a cached block (meaningless for others).
    pub(crate) fn block_tokens(&self, id: BlockId) -> &[u32] {
        let start = id.index() * self.block_size;
        self.tokens
            .get(start..start + self.block_size)
            .unwrap_or(&[])
    }

    /// Whether the block's key fields and tokens are exactly these.
    pub(crate) fn key_matches(
        &self,
        id: BlockId,
        parent: Option<BlockHash>,
        extra: ExtraKey,
        tokens: &[u32],
    ) -> bool {
        match self.key_of(id) {
            Some(key) => {
                key.parent == parent && key.extra == extra && self.block_tokens(id) == tokens
            }
            None => false,
        }
    }

    /// Whether a write into the block would be seen only by its single holder: held once and not
    /// cached. Anything else must be copied before it is written.
    pub(crate) fn is_exclusive(&self, id: BlockId) -> bool {
        self.slots.get(id.index()).is_some_and(|s| s.ref_count == 1)
            && self.keys[id.index()].is_none()
    }

    /// Registers a held, uncached block under a key not yet in the index.
    pub(crate) fn register(&mut self, id: BlockId, key: BlockKey, tokens: &[u32]) {
        debug_assert!(self.ref_count(id) > 0 && self.keys[id.index()].is_none());
        debug_assert_eq!(tokens.len(), self.block_size);
        if self.tokens.is_empty() {
            // One allocation for the life of the pool; checked against overflow in `new`.
            self.tokens = vec![0; self.num_blocks() * self.block_size];
        }
        let start = id.index() * self.block_size;
        self.tokens[start..start + self.block_size].copy_from_slice(tokens);
        self.keys[id.index()] = Some(key);
        self.index.insert(key.hash, id);
        self.counters.stored_blocks += 1;
        if self.events.is_active() {
            self.events.publish(CacheEvent::BlockStored {
                hash: key.hash,
                parent: key.parent,
                tokens: tokens.to_vec(),
                extra: key.extra,
            });
        }
    }

    pub(crate) fn counters_mut(&mut self) -> &mut CacheCounters {
        &mut self.counters
    }

    pub(crate) fn ensure_available(&self, needed: usize) -> Result<(), Exhausted> {
        let free = self.available_blocks();
        if needed > free {
            return Err(Exhausted { needed, free });
        }
        Ok(())
    }

    pub(crate) fn check_id(&self, id: BlockId) -> Result<usize, KvError> {
        let index = id.index();
        if index >= self.slots.len() {
            return Err(KvError::UnknownBlock {
                block: id,
                num_blocks: self.slots.len(),
            });
        }
        Ok(index)
    }

    // ----- private: the LRU list and eviction -----

    fn lru_push_back(&mut self, index: u32) {
        let i = index as usize;
        self.slots[i].prev = self.lru_tail;
        self.slots[i].next = NIL;
        if self.lru_tail == NIL {
            self.lru_head = index;
        } else {
            self.slots[self.lru_tail as usize].next = index;
        }
        self.lru_tail = index;
        self.lru_len += 1;
    }

    fn lru_unlink(&mut self, index: u32) {
        let i = index as usize;
        let Slot { prev, next, .. } = self.slots[i];
        if prev == NIL {
            self.lru_head = next;
        } else {
            self.slots[prev as usize].next = next;
        }
        if next == NIL {
            self.lru_tail = prev;
        } else {
            self.slots[next as usize].prev = prev;
        }
        self.slots[i].prev = NIL;
        self.slots[i].next = NIL;
        self.lru_len -= 1;
    }

    /// Drops the key of a block leaving `CachedEvictable` for reuse.
    fn evict_key(&mut self, index: u32) {
        if let Some(key) = self.keys[index as usize].take() {
            self.index.remove(&key.hash);
            self.counters.evictions += 1;
            tracing::trace!(block = index, hash = %key.hash, "evicted cached KV block");
            if self.events.is_active() {
                self.events
                    .publish(CacheEvent::BlockRemoved { hash: key.hash });
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(num_blocks: usize, block_size: usize) -> BlockPool {
        BlockPool::new(num_blocks, block_size).expect("valid pool")
    }

    /// Registers `id` under a made-up key, as `KvCache::insert` would.
    fn cache(pool: &mut BlockPool, id: BlockId, hash: u128) {
        let key = BlockKey {
            hash: BlockHash(hash),
            parent: None,
            extra: ExtraKey::NONE,
        };
        let tokens = vec![hash as u32; pool.block_size()];
        pool.register(id, key, &tokens);
    }

    fn gauges(pool: &BlockPool) -> (usize, usize, usize) {
        (pool.free_blocks(), pool.cached_blocks(), pool.used_blocks())
    }

    #[test]
    fn new_rejects_bad_sizes() {
        let check = |num_blocks, block_size, expected: KvError| {
            assert_eq!(
                BlockPool::new(num_blocks, block_size).unwrap_err(),
                expected
            );
        };
        check(0, 16, KvError::NoBlocks);
        check(4, 0, KvError::ZeroBlockSize);
        check(
            BlockPool::MAX_BLOCKS + 1,
            16,
            KvError::TooManyBlocks {
                num_blocks: BlockPool::MAX_BLOCKS + 1,
                max: BlockPool::MAX_BLOCKS,
            },
        );
        check(
            2,
            usize::MAX,
            KvError::CapacityOverflow {
                num_blocks: 2,
                block_size: usize::MAX,
            },
        );
    }

    #[test]
    fn fresh_pool() {
        let p = pool(3, 16);
        assert_eq!((p.num_blocks(), p.block_size()), (3, 16));
        assert_eq!(gauges(&p), (3, 0, 0));
        assert_eq!(p.state(BlockId(2)), Some(BlockState::Free));
        assert_eq!(p.state(BlockId(3)), None);
        assert_eq!(p.ref_count(BlockId(3)), 0);
        p.check_consistency().unwrap();
    }

    #[test]
    fn allocate_in_order_until_exhausted() {
        let mut p = pool(2, 4);
        assert_eq!(p.allocate(), Ok(BlockId(0)));
        assert_eq!(p.allocate(), Ok(BlockId(1)));
        assert_eq!(p.allocate(), Err(Exhausted { needed: 1, free: 0 }));
        assert_eq!(gauges(&p), (0, 0, 2));
        assert_eq!(p.ref_count(BlockId(0)), 1);
        assert_eq!(p.state(BlockId(0)), Some(BlockState::Owned));
        p.check_consistency().unwrap();
    }

    #[test]
    fn release_returns_to_free_list_lifo() {
        let mut p = pool(3, 4);
        let a = p.allocate().unwrap();
        let b = p.allocate().unwrap();
        p.release(a).unwrap();
        p.release(b).unwrap();
        assert_eq!(gauges(&p), (3, 0, 0));
        assert_eq!(p.allocate(), Ok(b));
        assert_eq!(p.allocate(), Ok(a));
        p.check_consistency().unwrap();
    }

    #[test]
    fn release_errors_change_nothing() {
        let mut p = pool(2, 4);
        let a = p.allocate().unwrap();
        p.release(a).unwrap();
        assert_eq!(p.release(a), Err(KvError::NotHeld { block: a }));
        assert_eq!(
            p.release(BlockId(9)),
            Err(KvError::UnknownBlock {
                block: BlockId(9),
                num_blocks: 2
            })
        );
        assert_eq!(gauges(&p), (2, 0, 0));
        // The double release did not put `a` in the free list twice.
        assert_eq!(p.allocate(), Ok(a));
        assert_eq!(p.allocate(), Ok(BlockId(1)));
        assert!(p.allocate().is_err());
        p.check_consistency().unwrap();
    }

    #[test]
    fn retain_counts_holders() {
        let mut p = pool(2, 4);
        let a = p.allocate().unwrap();
        p.retain(a).unwrap();
        p.retain(a).unwrap();
        assert_eq!(p.ref_count(a), 3);
        p.release(a).unwrap();
        p.release(a).unwrap();
        assert_eq!((p.ref_count(a), p.free_blocks()), (1, 1));
        p.release(a).unwrap();
        assert_eq!(p.state(a), Some(BlockState::Free));
        p.check_consistency().unwrap();
    }

    #[test]
    fn retain_errors_change_nothing() {
        let mut p = pool(2, 4);
        assert_eq!(
            p.retain(BlockId(0)),
            Err(KvError::RetainFree { block: BlockId(0) })
        );
        assert_eq!(
            p.retain(BlockId(2)),
            Err(KvError::UnknownBlock {
                block: BlockId(2),
                num_blocks: 2
            })
        );
        let a = p.allocate().unwrap();
        p.slots[a.index()].ref_count = u32::MAX;
        assert_eq!(
            p.retain(a),
            Err(KvError::RefCountOverflow {
                block: a,
                max: u32::MAX
            })
        );
        assert_eq!(p.ref_count(a), u32::MAX);
        assert_eq!(gauges(&p), (1, 0, 1));
    }

    #[test]
    fn allocate_many_is_all_or_nothing() {
        let mut p = pool(3, 4);
        let mut out = vec![BlockId(7)];
        assert_eq!(
            p.allocate_many(4, &mut out),
            Err(Exhausted { needed: 4, free: 3 })
        );
        assert_eq!((out.len(), p.free_blocks()), (1, 3));
        p.allocate_many(2, &mut out).unwrap();
        assert_eq!(out, vec![BlockId(7), BlockId(0), BlockId(1)]);
        assert_eq!(gauges(&p), (1, 0, 2));
    }

    #[test]
    fn cached_blocks_walk_the_four_states() {
        let mut p = pool(2, 2);
        let a = p.allocate().unwrap();
        cache(&mut p, a, 11);
        assert_eq!(p.state(a), Some(BlockState::CachedHeld));
        assert_eq!(
            (p.registered_blocks(), p.lookup(BlockHash(11))),
            (1, Some(a))
        );
        p.release(a).unwrap();
        assert_eq!(p.state(a), Some(BlockState::CachedEvictable));
        assert_eq!(gauges(&p), (1, 1, 0));
        p.retain(a).unwrap();
        assert_eq!(p.state(a), Some(BlockState::CachedHeld));
        assert_eq!(gauges(&p), (1, 0, 1));
        p.release(a).unwrap();
        let cached = p.cached(a).unwrap();
        assert_eq!((cached.hash, cached.tokens), (BlockHash(11), &[11, 11][..]));
        p.check_consistency().unwrap();
    }

    #[test]
    fn allocation_prefers_free_blocks_then_evicts_least_recent() {
        let mut p = pool(4, 2);
        let ids: Vec<BlockId> = (0..3).map(|_| p.allocate().unwrap()).collect();
        for (i, &id) in ids.iter().enumerate() {
            cache(&mut p, id, 100 + i as u128);
        }
        // Released in the order 2, 0, 1: block 2 is the least recently released.
        for i in [2, 0, 1] {
            p.release(ids[i]).unwrap();
        }
        let events = p.subscribe();
        assert_eq!(p.allocate(), Ok(BlockId(3)), "the free block goes first");
        assert_eq!(p.allocate(), Ok(ids[2]));
        assert_eq!(p.allocate(), Ok(ids[0]));
        assert_eq!(p.state(ids[0]), Some(BlockState::Owned));
        assert_eq!(p.lookup(BlockHash(100)), None);
        assert_eq!(p.lookup(BlockHash(101)), Some(ids[1]));
        assert_eq!(p.counters().evictions, 2);
        let got: Vec<CacheEvent> = events.try_iter().collect();
        assert_eq!(
            got,
            vec![
                CacheEvent::BlockRemoved {
                    hash: BlockHash(102)
                },
                CacheEvent::BlockRemoved {
                    hash: BlockHash(100)
                },
            ]
        );
        assert_eq!(gauges(&p), (0, 1, 3));
        p.check_consistency().unwrap();
    }

    #[test]
    fn clear_cache_drops_every_key() {
        let mut p = pool(3, 2);
        let held = p.allocate().unwrap();
        let idle = p.allocate().unwrap();
        cache(&mut p, held, 1);
        cache(&mut p, idle, 2);
        p.release(idle).unwrap();
        let events = p.subscribe();
        p.clear_cache();
        assert_eq!(p.state(held), Some(BlockState::Owned));
        assert_eq!(p.state(idle), Some(BlockState::Free));
        assert_eq!((p.registered_blocks(), gauges(&p)), (0, (2, 0, 1)));
        assert_eq!(events.try_recv(), Ok(CacheEvent::AllCleared));
        p.check_consistency().unwrap();
    }

    #[test]
    fn dropped_subscribers_are_forgotten() {
        let mut p = pool(2, 2);
        let kept = p.subscribe();
        drop(p.subscribe());
        p.clear_cache();
        assert_eq!(p.subscribers(), 1);
        assert_eq!(kept.try_recv(), Ok(CacheEvent::AllCleared));
    }

    #[test]
    fn stats_snapshot() {
        let mut p = pool(3, 2);
        let a = p.allocate().unwrap();
        cache(&mut p, a, 5);
        p.release(a).unwrap();
        let _b = p.allocate().unwrap();
        assert_eq!(
            p.stats(),
            KvStats {
                total_blocks: 3,
                free_blocks: 1,
                cached_blocks: 1,
                used_blocks: 1,
                registered_blocks: 1,
                counters: CacheCounters {
                    stored_blocks: 1,
                    ..CacheCounters::default()
                },
            }
        );
    }

    #[test]
    fn consistency_check_finds_corruption() {
        let mut p = pool(3, 2);
        let a = p.allocate().unwrap();
        p.free.push(a.0);
        assert_eq!(
            p.check_consistency(),
            Err(Inconsistency(
                "free-listed block 0 is held or cached".into()
            ))
        );
        p.free.pop();
        p.free.push(1);
        assert_eq!(
            p.check_consistency(),
            Err(Inconsistency("block 1 is in the free list twice".into()))
        );
        p.free.pop();
        p.used = 2;
        assert_eq!(
            p.check_consistency(),
            Err(Inconsistency("1 blocks are held but 2 recorded".into()))
        );
    }
}
