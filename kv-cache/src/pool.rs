//! The block pool: ref-counted KV blocks, the free list, the LRU list of evictable cached blocks,
//! the registry of cached blocks (keys, chain links, tokens), the counters and the event bus.
//!
//! # Block states
//!
//! Every block is in exactly one of four states, decided by three facts: its reference count `rc`
//! (how many holders: block tables, a pending reservation, a prefix match not yet handed to a
//! table, an outside store such as the Marconi tree), whether it is registered in the prefix
//! cache (`cached`), and whether it is *pinned*: held (`rc ≥ 1`), or cached with a pinned cached
//! child (a held block keeps its whole cached chain, back to the first block, out of reach of
//! eviction).
//!
//! | state              | pinned | cached | where it lives                            | counted in        |
//! |--------------------|--------|--------|-------------------------------------------|-------------------|
//! | `Free`             | no     | no     | the free list (exactly once)              | `free_blocks()`   |
//! | `Owned`            | yes    | no     | its holders (`rc ≥ 1`)                    | `used_blocks()`   |
//! | `CachedHeld`       | yes    | yes    | its holders or pinned children            | `used_blocks()`   |
//! | `CachedEvictable`  | no     | yes    | the LRU list (exactly once)               | `cached_blocks()` |
//!
//! So `free_blocks() + cached_blocks() + used_blocks() == num_blocks()` always, and
//! `registered_blocks()` (every block with a key) is `cached_blocks()` plus the `CachedHeld` ones.
//!
//! # The chain
//!
//! A cached block records its *parent*: the cached block of the position before it in the
//! sequence that registered it (none for a first block, which records its namespace instead),
//! and its *first child*: the child registered when it had no cached child, while that child
//! stays cached. The index (key → block) holds the other cached blocks: first blocks, and the
//! children of a block that already had a first child (branch points). So a lookup follows first
//! children without hashing or probing the index (verifying each like any hit), a conversation's
//! chain is walked like a linked list, and the index is touched at first blocks and branch points
//! only; a block registered under a childless parent costs no index entry.
//! Invariants: a cached block's parent is cached; `pins` of a block is the number of its cached
//! children that are pinned; and the LRU list holds every unpinned cached block, ordered by the
//! time it became unpinned. A child pins its parent, so a parent becomes unpinned no earlier than
//! its last child, and comes after all its cached children in the LRU list. Hence **the head of
//! the LRU list is always a leaf**: eviction shortens chains from their ends and never strands a
//! descendant (an ancestor is never evicted before its descendants, however blocks are shared,
//! deduplicated or released). This is SGLang's and TGI's leaf-first LRU, kept with O(1) list
//! operations instead of a heap.
//!
//! # Transitions
//!
//! ```text
//!   Free ──allocate──▶ Owned ──register (KvCache::insert)──▶ CachedHeld
//!     ▲                 │  ▲                                  │  ▲
//!     └─release (rc→0)──┘  │                 last unpin       │  │ retain, or a child pinned
//!                          │                                  ▼  │
//!                          └──allocate evicts (LRU first)── CachedEvictable
//! ```
//!
//! - `allocate`: `Free → Owned` (pops the free list); only when the free list is empty,
//!   `CachedEvictable → Owned` for the LRU head (its key is dropped, a `BlockRemoved` event is
//!   published). Neither possible: [`Exhausted`].
//! - `retain`: `rc += 1` on `Owned`/`CachedHeld`; `CachedEvictable → CachedHeld` (leaves the LRU
//!   list, and pins its unpinned ancestors). On `Free` it is an error ([`KvError::RetainFree`]):
//!   a free block sits in the free list and would be handed to a second owner.
//! - `release`: `rc -= 1`; when that unpins the block, `Owned → Free` (pushed on the free list) or
//!   `CachedHeld → CachedEvictable` (appended at the most recent end of the LRU list), followed by
//!   every ancestor it unpins, child before parent. On `rc == 0` it is an error
//!   ([`KvError::NotHeld`]) and nothing changes.
//! - `clear_cache`: every key is dropped: held blocks become `Owned`, the others `Free`.
//!
//! What can never happen: a block in the free list twice, or in both lists; a pinned block in a
//! list; an uncached block, or a first child, in the index; two indexed blocks under one key; a
//! cached block whose parent is not cached, or that is neither its parent's first child nor
//! indexed. [`BlockPool::check_consistency`] verifies all of it.
//!
//! # Memory and costs
//!
//! Bookkeeping per block is one 32-byte record (key, reference count, pins, parent or namespace,
//! first child, the LRU or free-list links), plus, once a [`KvCache`](crate::KvCache) uses the
//! pool, the index (a `hashbrown` table of 4-byte block ids with room for every block, about 10
//! bytes per block), the block's tokens (4 bytes per token slot, for verifying hits) and, for
//! 128-bit keys, the upper key halves (8 bytes). A pool used alone (the Marconi store's) keeps only the
//! records. Everything is allocated when the pool (or the cache) is made; `allocate`, `retain`,
//! `release`, lookups and registration allocate nothing on the heap (except a new namespace's
//! first registration). The free and LRU lists are intrusive; all operations are O(1) except
//! where one release unpins a chain of ancestors (each block is unpinned once per pin, so that is
//! O(1) amortized).

use std::collections::HashMap;

use crossbeam_channel::Receiver;
use hashbrown::HashTable;

use crate::events::{CacheEvent, EventBus};
use crate::{BlockHash, BlockId, Exhausted, ExtraKey, Inconsistency, KvError};

/// The list terminator of the intrusive lists and the empty child hint; never a block id.
const NIL: u32 = u32::MAX;
/// `Slot::parent` of a block that is not cached.
const UNCACHED: u32 = u32::MAX;
/// `Slot::parent` of a cached first block is `ROOT + namespace`; block ids are below `ROOT`. As a
/// parent argument, `ROOT` means "a first block".
pub(crate) const ROOT: u32 = 1 << 31;

/// A block's state; see the [module docs](self).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BlockState {
    /// No holder, no key: in the free list.
    Free,
    /// Held, not in the prefix cache.
    Owned,
    /// In the prefix cache and pinned: held, or the ancestor of a held cached block.
    CachedHeld,
    /// In the prefix cache and not pinned: may be evicted by `allocate`.
    CachedEvictable,
}

/// Monotonic counters since the pool was made.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheCounters {
    /// Calls of `match_prefix` (or `match_keys`).
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
    /// Cached blocks nobody pins (evictable).
    pub cached_blocks: usize,
    /// Pinned blocks: held, or cached under a held block.
    pub used_blocks: usize,
    /// Blocks with a key, pinned or not.
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

/// A block's record as `insert` checks it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Record {
    pub(crate) ref_count: u32,
    link: u32,
    key: u64,
}

impl Record {
    pub(crate) fn cached(&self) -> bool {
        self.link != UNCACHED
    }

    /// The parent block of a cached block that is not a first block.
    pub(crate) fn parent(&self) -> Option<u32> {
        (self.link < ROOT).then_some(self.link)
    }
}

/// What a probe of the index found for a key, a parent and tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Probe {
    /// No block under the key.
    Miss,
    /// The block under the key holds exactly these tokens after this parent, in this namespace.
    Hit(u32),
    /// A block under the key holds something else (a hash collision).
    Collision(u32),
}

/// Per-block bookkeeping, half a cache line.
///
/// - `key`: the lower 64 bits of the block's key (meaningful only when cached).
/// - `parent`: `UNCACHED`; `ROOT + n` for a cached first block in namespace `n`; else the cached
///   parent's id.
/// - `pins`: cached children that are pinned (held, or pinning a child in turn).
/// - `child`: the first child (see the module docs), or `NIL`.
/// - `prev`/`next`: the LRU links of a `CachedEvictable` block; `next` is the free-list link of a
///   `Free` block; both `NIL` otherwise.
#[derive(Debug, Clone, Copy)]
#[repr(C, align(32))]
struct Slot {
    key: u64,
    ref_count: u32,
    pins: u32,
    parent: u32,
    child: u32,
    prev: u32,
    next: u32,
}

impl Slot {
    const EMPTY: Slot = Slot {
        key: 0,
        ref_count: 0,
        pins: 0,
        parent: UNCACHED,
        child: NIL,
        prev: NIL,
        next: NIL,
    };

    fn pinned(&self) -> bool {
        self.ref_count > 0 || self.pins > 0
    }

    fn cached(&self) -> bool {
        self.parent != UNCACHED
    }

    /// The parent block of a cached block that is not a first block.
    fn parent_block(&self) -> Option<u32> {
        (self.parent < ROOT).then_some(self.parent)
    }

    /// The namespace of a cached first block.
    fn root_namespace(&self) -> Option<u32> {
        (self.parent >= ROOT && self.parent != UNCACHED).then(|| self.parent - ROOT)
    }
}

/// The namespaces (adapter and salt) of cached first blocks, interned so a block records them in
/// its parent field.
#[derive(Debug, Default)]
struct Namespaces {
    /// `(extra, cached first blocks in it)`; an entry with no blocks is vacant.
    entries: Vec<(ExtraKey, u32)>,
    by_extra: HashMap<ExtraKey, u32>,
    vacant: Vec<u32>,
}

impl Namespaces {
    fn extra(&self, id: u32) -> ExtraKey {
        self.entries
            .get(id as usize)
            .map_or(ExtraKey::NONE, |e| e.0)
    }

    /// The id of `extra`, with one more block counted in it.
    fn acquire(&mut self, extra: ExtraKey) -> u32 {
        if let Some(&id) = self.by_extra.get(&extra) {
            self.entries[id as usize].1 += 1;
            return id;
        }
        let id = match self.vacant.pop() {
            Some(id) => {
                self.entries[id as usize] = (extra, 1);
                id
            }
            None => {
                self.entries.push((extra, 1));
                (self.entries.len() - 1) as u32
            }
        };
        self.by_extra.insert(extra, id);
        id
    }

    /// One block fewer in namespace `id`; the entry is freed at zero.
    fn release(&mut self, id: u32) {
        let entry = &mut self.entries[id as usize];
        entry.1 -= 1;
        if entry.1 == 0 {
            self.by_extra.remove(&entry.0);
            self.vacant.push(id);
        }
    }

    fn clear(&mut self) {
        self.entries.clear();
        self.by_extra.clear();
        self.vacant.clear();
    }

    fn reserve(&mut self, count: usize) {
        self.entries.reserve(count);
        self.by_extra.reserve(count);
        self.vacant.reserve(count);
    }
}

/// Namespaces a cache makes room for up front (more are fine: the first block registered in
/// each further one allocates).
const NAMESPACES_RESERVED: usize = 64;

/// Whether two blocks hold the same tokens. Branch-free over the block (equal blocks are the
/// common case on the lookup path), so it compiles to a few vector instructions instead of a
/// `memcmp` call.
#[inline]
fn same_tokens(a: &[u32], b: &[u32]) -> bool {
    // A block of 16, the common size, as arrays: the compiler unrolls it completely.
    if let (Ok(a), Ok(b)) = (<&[u32; 16]>::try_from(a), <&[u32; 16]>::try_from(b)) {
        return a.iter().zip(b).fold(0, |diff, (x, y)| diff | (x ^ y)) == 0;
    }
    a.len() == b.len() && a.iter().zip(b).fold(0, |diff, (x, y)| diff | (x ^ y)) == 0
}

/// Copies a block's tokens; a block of 16 is copied inline, without a `memcpy` call.
#[inline]
fn copy_tokens(to: &mut [u32], from: &[u32]) {
    match (
        <&mut [u32; 16]>::try_from(&mut *to),
        <&[u32; 16]>::try_from(from),
    ) {
        (Ok(to), Ok(from)) => *to = *from,
        _ => to.copy_from_slice(from),
    }
}

/// `len` zeros, written now: the pages are faulted in when the cache is made, not by the first
/// operations that touch them.
fn touched<T: Copy + Default>(len: usize) -> Vec<T> {
    let mut values = Vec::with_capacity(len);
    values.resize(len, T::default());
    values
}

/// A pool of `num_blocks` KV blocks of `block_size` tokens each; see the [module docs](self).
///
/// Used alone it is a ref-counted allocator (no block ever gets a key, so `cached_blocks()` stays
/// 0); [`KvCache`](crate::KvCache) adds the prefix cache on top of the same pool.
#[derive(Debug)]
pub struct BlockPool {
    block_size: usize,
    slots: Vec<Slot>,
    /// Top of the intrusive free stack (linked through `Slot::next`), or `NIL`.
    free_head: u32,
    free_len: usize,
    /// Least recently unpinned evictable block (evicted first), or `NIL`.
    lru_head: u32,
    /// Most recently unpinned evictable block, or `NIL`.
    lru_tail: u32,
    lru_len: usize,
    /// Pinned blocks.
    used: usize,
    /// Cached blocks.
    registered: usize,
    /// Cached blocks that are not first children, hashed by the lower 64 bits of their keys
    /// (already a hash: nothing is hashed twice).
    index: HashTable<u32>,
    /// Whether keys are 128-bit; then `wide[i]` is the upper half of block `i`'s key.
    wide_keys: bool,
    wide: Vec<u64>,
    /// Cached blocks' tokens, `block_size` per block id; empty until a cache uses the pool.
    tokens: Vec<u32>,
    namespaces: Namespaces,
    counters: CacheCounters,
    events: EventBus,
}

impl BlockPool {
    /// The largest supported pool (block ids stay below 2^31; the values above mark first blocks
    /// and list ends).
    pub const MAX_BLOCKS: usize = (ROOT - 1) as usize;

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
        let mut slots = vec![Slot::EMPTY; num_blocks];
        // The free stack hands out block 0 first, then 1, 2, ...
        for (i, slot) in slots.iter_mut().enumerate() {
            slot.next = if i + 1 < num_blocks {
                (i + 1) as u32
            } else {
                NIL
            };
        }
        Ok(Self {
            block_size,
            slots,
            free_head: 0,
            free_len: num_blocks,
            lru_head: NIL,
            lru_tail: NIL,
            lru_len: 0,
            used: 0,
            registered: 0,
            index: HashTable::new(),
            wide_keys: false,
            wide: Vec::new(),
            tokens: Vec::new(),
            namespaces: Namespaces::default(),
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
        self.free_len
    }

    /// Cached blocks nobody pins (`CachedEvictable`).
    pub fn cached_blocks(&self) -> usize {
        self.lru_len
    }

    /// Pinned blocks (`Owned` or `CachedHeld`): held, or cached under a held block.
    pub fn used_blocks(&self) -> usize {
        self.used
    }

    /// Blocks `allocate` can hand out: free plus evictable cached.
    pub fn available_blocks(&self) -> usize {
        self.free_len + self.lru_len
    }

    /// Blocks with a key in the prefix cache, pinned or not.
    pub fn registered_blocks(&self) -> usize {
        self.registered
    }

    /// The block's holder count; 0 for a free, evictable or unknown block.
    pub fn ref_count(&self, id: BlockId) -> u32 {
        self.slots.get(id.index()).map_or(0, |s| s.ref_count)
    }

    /// The block's state, `None` for an id outside the pool.
    pub fn state(&self, id: BlockId) -> Option<BlockState> {
        let slot = self.slots.get(id.index())?;
        Some(match (slot.cached(), slot.pinned()) {
            (false, false) => BlockState::Free,
            (false, true) => BlockState::Owned,
            (true, true) => BlockState::CachedHeld,
            (true, false) => BlockState::CachedEvictable,
        })
    }

    /// What the prefix cache knows about the block, `None` unless it is cached.
    pub fn cached(&self, id: BlockId) -> Option<CachedBlock<'_>> {
        let slot = self.slots.get(id.index())?;
        if !slot.cached() {
            return None;
        }
        Some(CachedBlock {
            hash: self.key_of(id.0),
            parent: slot.parent_block().map(|p| self.key_of(p)),
            extra: self.namespaces.extra(self.namespace_of(id.0)),
            tokens: self.block_tokens(id.0),
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
    /// recently unpinned evictable cached block, always a leaf of its chain (its key is dropped).
    #[inline]
    pub fn allocate(&mut self) -> Result<BlockId, Exhausted> {
        let index = if self.free_head != NIL {
            let index = self.free_head;
            let slot = &mut self.slots[index as usize];
            self.free_head = slot.next;
            slot.next = NIL;
            self.free_len -= 1;
            index
        } else if self.lru_head != NIL {
            let index = self.lru_head;
            self.lru_unlink(index);
            self.evict_key(index);
            index
        } else {
            return Err(Exhausted { needed: 1, free: 0 });
        };
        self.slots[index as usize].ref_count = 1;
        self.used += 1;
        Ok(BlockId(index))
    }

    /// Allocates `count` blocks into `out` (appended), or none at all.
    ///
    /// Evicted blocks come out of the LRU list chain tail first, that is in the reverse order of
    /// the chain they held; they are handed out in the chain's order instead, so that blocks
    /// allocated together for one sequence keep the memory order of the chain they replace
    /// (contiguous chains stay contiguous, which makes later lookups along them
    /// prefetch-friendly).
    pub fn allocate_many(&mut self, count: usize, out: &mut Vec<BlockId>) -> Result<(), Exhausted> {
        self.ensure_available(count)?;
        out.reserve(count);
        let from_free = count.min(self.free_len);
        for _ in 0..count {
            // Cannot fail: availability was checked and nothing else runs in between.
            out.push(self.allocate()?);
        }
        let evicted = out.len() - (count - from_free);
        out[evicted..].reverse();
        Ok(())
    }

    /// Adds a holder. Revives an evictable cached block; an error on a free block.
    #[inline]
    pub fn retain(&mut self, id: BlockId) -> Result<(), KvError> {
        let index = self.check_id(id)?;
        let slot = self.slots[index];
        if slot.ref_count == u32::MAX {
            return Err(KvError::RefCountOverflow {
                block: id,
                max: u32::MAX,
            });
        }
        if !slot.pinned() && !slot.cached() {
            return Err(KvError::RetainFree { block: id });
        }
        self.slots[index].ref_count = slot.ref_count + 1;
        if !slot.pinned() {
            self.became_pinned(id.0);
        }
        Ok(())
    }

    /// Adds a holder to a cached block a lookup just found; `false` (changing nothing) at the
    /// holder limit.
    #[inline]
    pub(crate) fn retain_hit(&mut self, id: u32) -> bool {
        let slot = &mut self.slots[id as usize];
        let Some(ref_count) = slot.ref_count.checked_add(1) else {
            return false;
        };
        let was_pinned = slot.pinned();
        slot.ref_count = ref_count;
        if !was_pinned {
            self.became_pinned(id);
        }
        true
    }

    /// Drops a holder. When that unpins the block, a cached block becomes evictable (the most
    /// recent end of the LRU list, followed by the ancestors it unpins), any other block free. An
    /// error, changing nothing, when nobody holds the block.
    #[inline]
    pub fn release(&mut self, id: BlockId) -> Result<(), KvError> {
        let index = self.check_id(id)?;
        let slot = &mut self.slots[index];
        if slot.ref_count == 0 {
            return Err(KvError::NotHeld { block: id });
        }
        slot.ref_count -= 1;
        if !slot.pinned() {
            self.became_unpinned(id.0);
        }
        Ok(())
    }

    /// Drops every key: held blocks become plain owned blocks, the others free (pushed on the
    /// free list in LRU order, then the cached blocks that only pinned children kept, by id).
    /// Publishes `AllCleared`.
    pub fn clear_cache(&mut self) {
        while self.lru_head != NIL {
            let index = self.lru_head;
            self.lru_unlink(index);
            let slot = &mut self.slots[index as usize];
            slot.parent = UNCACHED;
            slot.child = NIL;
            self.free_push(index);
        }
        for index in 0..self.slots.len() {
            let slot = &mut self.slots[index];
            if !slot.cached() {
                continue;
            }
            slot.parent = UNCACHED;
            slot.pins = 0;
            slot.child = NIL;
            if slot.ref_count == 0 {
                self.used -= 1;
                self.free_push(index as u32);
            }
        }
        self.index.clear();
        self.namespaces.clear();
        self.registered = 0;
        if self.events.is_active() {
            self.events.publish(CacheEvent::AllCleared);
        }
    }

    /// Verifies every invariant of the [module docs](self); O(num_blocks).
    pub fn check_consistency(&self) -> Result<(), Inconsistency> {
        let n = self.num_blocks();
        let fail = |what: String| Err(Inconsistency(what));
        let mut in_free = vec![false; n];
        let mut count = 0;
        let mut cursor = self.free_head;
        while cursor != NIL {
            let i = cursor as usize;
            if i >= n || count > n {
                return fail(format!("the free list is malformed at {cursor}"));
            }
            if in_free[i] {
                return fail(format!("block {i} is in the free list twice"));
            }
            in_free[i] = true;
            count += 1;
            let slot = &self.slots[i];
            if slot.pinned() || slot.cached() {
                return fail(format!("free-listed block {i} is held or cached"));
            }
            cursor = slot.next;
        }
        if count != self.free_len {
            return fail(format!(
                "{count} blocks in the free list but {} recorded",
                self.free_len
            ));
        }
        // LRU position of each listed block, to check children before parents.
        let mut lru_position = vec![usize::MAX; n];
        let mut count = 0;
        let mut prev = NIL;
        let mut cursor = self.lru_head;
        while cursor != NIL {
            let i = cursor as usize;
            if i >= n || lru_position[i] != usize::MAX || count > n {
                return fail(format!("the LRU list is malformed at {cursor}"));
            }
            lru_position[i] = count;
            count += 1;
            if in_free[i] {
                return fail(format!("block {i} is in both lists"));
            }
            if self.slots[i].pinned() || !self.slots[i].cached() {
                return fail(format!("LRU-listed block {i} is pinned or has no key"));
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
        let mut pinned_children = vec![0u32; n];
        let mut namespace_blocks: HashMap<u32, u32> = HashMap::new();
        let (mut used, mut registered) = (0, 0);
        for (i, slot) in self.slots.iter().enumerate() {
            if slot.pinned() {
                used += 1;
            } else if !in_free[i] && lru_position[i] == usize::MAX {
                return fail(format!("block {i} is unpinned but in neither list"));
            }
            if lru_position[i] == usize::MAX && slot.prev != NIL
                || !in_free[i] && lru_position[i] == usize::MAX && slot.next != NIL
            {
                return fail(format!("block {i} keeps list links outside the lists"));
            }
            if !slot.cached() {
                if slot.pins != 0 {
                    return fail(format!("uncached block {i} has {} pins", slot.pins));
                }
                continue;
            }
            registered += 1;
            if slot.child != NIL {
                let hinted = self.slots.get(slot.child as usize);
                if hinted.and_then(Slot::parent_block) != Some(i as u32) {
                    return fail(format!("block {i} hints at {}, not its child", slot.child));
                }
            }
            let Some(p) = slot.parent_block() else {
                if let Some(namespace) = slot.root_namespace() {
                    *namespace_blocks.entry(namespace).or_insert(0) += 1;
                }
                continue;
            };
            let p = p as usize;
            if !self.slots.get(p).is_some_and(Slot::cached) {
                return fail(format!(
                    "cached block {i} has parent {p}, which is not cached"
                ));
            }
            if slot.pinned() {
                pinned_children[p] += 1;
            } else if lru_position[p] != usize::MAX && lru_position[p] < lru_position[i] {
                return fail(format!(
                    "block {p} would be evicted before its child {i} (LRU order)"
                ));
            }
        }
        for (i, slot) in self.slots.iter().enumerate() {
            if slot.pins != pinned_children[i] {
                return fail(format!(
                    "block {i} records {} pins but has {} pinned children",
                    slot.pins, pinned_children[i]
                ));
            }
        }
        if used != self.used {
            return fail(format!(
                "{used} blocks are pinned but {} recorded",
                self.used
            ));
        }
        let first_children = self
            .slots
            .iter()
            .filter(|s| s.cached() && s.child != NIL)
            .count();
        if registered != self.registered || registered != self.index.len() + first_children {
            return fail(format!(
                "{registered} cached blocks, {} recorded, {} indexed, {first_children} first children",
                self.registered,
                self.index.len()
            ));
        }
        for &id in self.index.iter() {
            if !self.is_indexed(id) || self.lookup(self.key_of(id)) != Some(id) {
                return fail(format!("index entry {id} is not an indexed block's"));
            }
        }
        for (id, (extra, blocks)) in self.namespaces.entries.iter().enumerate() {
            let counted = namespace_blocks.get(&(id as u32)).copied().unwrap_or(0);
            let live = self.namespaces.by_extra.get(extra) == Some(&(id as u32));
            if counted != *blocks || (*blocks > 0) != live {
                return fail(format!(
                    "namespace {id} records {blocks} blocks but holds {counted}"
                ));
            }
        }
        Ok(())
    }

    // ----- crate-internal: the prefix cache's access to the registry -----

    /// Makes room for the prefix cache: the token store, the index and (for 128-bit keys) the
    /// upper key halves, all at the pool's capacity, so registering never allocates. A pool
    /// switched to the other key width drops its cached keys first.
    pub(crate) fn enable_prefix_cache(&mut self, wide_keys: bool) {
        if self.wide_keys != wide_keys && self.registered > 0 {
            self.clear_cache();
        }
        self.wide_keys = wide_keys;
        let n = self.num_blocks();
        if wide_keys && self.wide.len() != n {
            self.wide = touched(n);
        }
        if self.tokens.is_empty() {
            // Checked against overflow in `new`.
            self.tokens = touched(n * self.block_size);
        }
        let slots = &self.slots;
        self.index
            .reserve(n.saturating_sub(self.index.len()), |&id| {
                slots[id as usize].key
            });
        self.namespaces.reserve(NAMESPACES_RESERVED);
    }

    /// The first child of `parent`, if it holds exactly `tokens`: an exact hit found without a
    /// key.
    #[inline]
    pub(crate) fn first_child(&self, parent: u32, tokens: &[u32]) -> Option<u32> {
        let child = self.slots[parent as usize].child;
        let slot = self.slots.get(child as usize)?;
        (slot.parent == parent && same_tokens(self.block_tokens(child), tokens)).then_some(child)
    }

    /// Follows first-child links from `parent`, appending up to `limit` blocks to `out`; returns
    /// how many. Each is a cached child of the one before (their tokens are not checked).
    #[inline]
    pub(crate) fn first_children(
        &self,
        parent: u32,
        limit: usize,
        out: &mut Vec<BlockId>,
    ) -> usize {
        let mut current = parent;
        let mut found = 0;
        while found < limit {
            // Blocks allocated together are often consecutive ids. While the first child is the
            // next id, the next address does not wait for this load (only a predicted branch
            // does), so the loads of a run overlap instead of following each other.
            let next = current.wrapping_add(1);
            if self.slots[current as usize].child == next {
                out.push(BlockId(next));
                current = next;
                found += 1;
                continue;
            }
            let child = self.slots[current as usize].child;
            if child == NIL {
                break;
            }
            out.push(BlockId(child));
            current = child;
            found += 1;
        }
        found
    }

    /// Whether cached block `id` holds exactly `tokens`.
    #[inline]
    pub(crate) fn holds(&self, id: u32, tokens: &[u32]) -> bool {
        same_tokens(self.block_tokens(id), tokens)
    }

    /// Whether a cached block is in the index: a first block, or not its parent's first child.
    fn is_indexed(&self, id: u32) -> bool {
        let slot = &self.slots[id as usize];
        match slot.parent_block() {
            Some(parent) => self.slots[parent as usize].child != id,
            None => slot.cached(),
        }
    }

    /// The indexed block under `key`, if any.
    pub(crate) fn lookup(&self, key: BlockHash) -> Option<u32> {
        let low = key.low();
        let high = key.high();
        self.index
            .find(low, |&id| {
                self.slots[id as usize].key == low
                    && (!self.wide_keys || self.wide[id as usize] == high)
            })
            .copied()
    }

    /// The cached block holding exactly `tokens` after `parent` (`ROOT`: a first block in the
    /// namespace of `extra`), keyed `key`: the parent's first child, else the indexed block under
    /// `key`, verified: its parent, its namespace (first blocks) and its tokens must be exactly
    /// these.
    #[inline]
    pub(crate) fn probe(
        &self,
        key: BlockHash,
        parent: u32,
        extra: ExtraKey,
        tokens: &[u32],
    ) -> Probe {
        if parent != ROOT {
            if let Some(child) = self.first_child(parent, tokens) {
                return Probe::Hit(child);
            }
        }
        self.probe_index(key, parent, extra, tokens)
    }

    /// [`probe`](Self::probe) in the index only.
    #[inline]
    pub(crate) fn probe_index(
        &self,
        key: BlockHash,
        parent: u32,
        extra: ExtraKey,
        tokens: &[u32],
    ) -> Probe {
        let Some(id) = self.lookup(key) else {
            return Probe::Miss;
        };
        let slot = &self.slots[id as usize];
        let linked = match slot.root_namespace() {
            Some(namespace) => parent == ROOT && self.namespaces.extra(namespace) == extra,
            None => slot.parent == parent,
        };
        let exact = linked && same_tokens(self.block_tokens(id), tokens);
        if exact {
            Probe::Hit(id)
        } else {
            Probe::Collision(id)
        }
    }

    /// The full key of a cached block.
    pub(crate) fn key_of(&self, id: u32) -> BlockHash {
        let low = self.slots[id as usize].key;
        let high = if self.wide_keys {
            self.wide[id as usize]
        } else {
            0
        };
        BlockHash(u128::from(low) | u128::from(high) << 64)
    }

    /// What `insert` checks of a block, read at once: `None` for an id outside the pool.
    #[inline]
    pub(crate) fn record(&self, id: BlockId) -> Option<Record> {
        self.slots.get(id.index()).map(|slot| Record {
            ref_count: slot.ref_count,
            link: slot.parent,
            key: slot.key,
        })
    }

    /// Whether the cached block `id`, read as `record`, has the key `key`.
    #[inline]
    pub(crate) fn has_key(&self, id: u32, record: &Record, key: BlockHash) -> bool {
        record.key == key.low() && (!self.wide_keys || self.wide[id as usize] == key.high())
    }

    /// Whether `id` is a cached first block in the namespace of `extra`.
    pub(crate) fn is_first_block_in(&self, id: u32, extra: ExtraKey) -> bool {
        self.slots[id as usize]
            .root_namespace()
            .is_some_and(|namespace| self.namespaces.extra(namespace) == extra)
    }

    /// The namespace of a cached block: its first block's.
    fn namespace_of(&self, mut id: u32) -> u32 {
        loop {
            let slot = &self.slots[id as usize];
            match slot.parent_block() {
                Some(parent) => id = parent,
                None => return slot.root_namespace().unwrap_or(0),
            }
        }
    }

    pub(crate) fn is_cached(&self, id: BlockId) -> bool {
        self.slots.get(id.index()).is_some_and(Slot::cached)
    }

    /// The registered tokens of a cached block (meaningless for others).
    fn block_tokens(&self, id: u32) -> &[u32] {
        let start = id as usize * self.block_size;
        self.tokens
            .get(start..start + self.block_size)
            .unwrap_or(&[])
    }

    /// Whether a write into the block would be seen only by its single holder: held once and not
    /// cached. Anything else must be copied before it is written.
    pub(crate) fn is_exclusive(&self, id: BlockId) -> bool {
        self.slots
            .get(id.index())
            .is_some_and(|s| s.ref_count == 1 && !s.cached())
    }

    /// Registers a held, uncached block after `parent` (`ROOT` for a first block in the namespace
    /// of `extra`, else a cached block), which has no cached child holding these tokens, under a
    /// key not yet in the index (when it goes there: a first block, or a parent's second child).
    /// The pool must have been prepared with `enable_prefix_cache`.
    pub(crate) fn register(
        &mut self,
        id: u32,
        key: BlockHash,
        parent: u32,
        extra: ExtraKey,
        tokens: &[u32],
    ) {
        let i = id as usize;
        debug_assert!(self.slots[i].ref_count > 0 && !self.slots[i].cached());
        debug_assert_eq!(tokens.len(), self.block_size);
        let link = if parent == ROOT {
            ROOT + self.namespaces.acquire(extra)
        } else {
            parent
        };
        let start = i * self.block_size;
        copy_tokens(&mut self.tokens[start..start + self.block_size], tokens);
        if self.wide_keys {
            self.wide[i] = key.high();
        }
        let slot = &mut self.slots[i];
        slot.key = key.low();
        slot.parent = link;
        let first_child = parent != ROOT && self.slots[parent as usize].child == NIL;
        if first_child {
            self.slots[parent as usize].child = id;
        } else {
            let slots = &self.slots;
            self.index
                .insert_unique(key.low(), id, |&b| slots[b as usize].key);
        }
        self.registered += 1;
        self.counters.stored_blocks += 1;
        if parent != ROOT {
            // The new block is held, so it pins its parent.
            let p = &mut self.slots[parent as usize];
            let was_pinned = p.pinned();
            p.pins += 1;
            if !was_pinned {
                self.became_pinned(parent);
            }
        }
        if self.events.is_active() {
            self.events.publish(CacheEvent::BlockStored {
                hash: key,
                parent: (parent != ROOT).then(|| self.key_of(parent)),
                tokens: tokens.to_vec(),
                extra,
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

    // ----- private: pins, the lists and eviction -----

    /// Block `index` just became pinned (held, or given a pinned child): it leaves the LRU list,
    /// and pins its parent, which may become pinned in turn.
    #[inline]
    fn became_pinned(&mut self, mut index: u32) {
        loop {
            self.used += 1;
            let slot = self.slots[index as usize];
            if !slot.cached() {
                return;
            }
            self.lru_unlink(index);
            let Some(parent) = slot.parent_block() else {
                return;
            };
            let p = &mut self.slots[parent as usize];
            let was_pinned = p.pinned();
            p.pins += 1;
            if was_pinned {
                return;
            }
            index = parent;
        }
    }

    /// Block `index` just became unpinned: an uncached block is freed; a cached one joins the LRU
    /// list and unpins its parent, which may become unpinned (and listed after it) in turn.
    #[inline]
    fn became_unpinned(&mut self, mut index: u32) {
        loop {
            self.used -= 1;
            let slot = self.slots[index as usize];
            if !slot.cached() {
                self.free_push(index);
                return;
            }
            self.lru_push_back(index);
            let Some(parent) = slot.parent_block() else {
                return;
            };
            let slot = &mut self.slots[parent as usize];
            slot.pins -= 1;
            if slot.pinned() {
                return;
            }
            index = parent;
        }
    }

    fn free_push(&mut self, index: u32) {
        self.slots[index as usize].next = self.free_head;
        self.free_head = index;
        self.free_len += 1;
    }

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

    /// Drops the key of a block leaving `CachedEvictable` for reuse: an unpinned leaf.
    fn evict_key(&mut self, index: u32) {
        let key = self.key_of(index);
        let slot = &mut self.slots[index as usize];
        debug_assert!(slot.cached() && slot.pins == 0);
        let indexed = self.is_indexed(index);
        let slot = &mut self.slots[index as usize];
        let link = std::mem::replace(&mut slot.parent, UNCACHED);
        slot.child = NIL;
        if indexed {
            if let Ok(entry) = self.index.find_entry(key.low(), |&id| id == index) {
                entry.remove();
            }
        } else {
            // A first child: its parent has no first child now (its other children stay indexed).
            self.slots[link as usize].child = NIL;
        }
        if link >= ROOT {
            self.namespaces.release(link - ROOT);
        }
        self.registered -= 1;
        self.counters.evictions += 1;
        tracing::trace!(block = index, hash = %key, "evicted cached KV block");
        if self.events.is_active() {
            self.events.publish(CacheEvent::BlockRemoved { hash: key });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(num_blocks: usize, block_size: usize) -> BlockPool {
        let mut pool = BlockPool::new(num_blocks, block_size).expect("valid pool");
        pool.enable_prefix_cache(false);
        pool
    }

    /// Registers `id` as a first block under a made-up key, as `KvCache::insert` would.
    fn cache(pool: &mut BlockPool, id: BlockId, hash: u128) {
        cache_under(pool, id, hash, ROOT);
    }

    fn cache_under(pool: &mut BlockPool, id: BlockId, hash: u128, parent: u32) {
        let tokens = vec![hash as u32; pool.block_size()];
        pool.register(id.0, BlockHash(hash), parent, ExtraKey::NONE, &tokens);
    }

    /// Three new blocks cached as one chain (hashes 10, 11, 12, each the parent of the next), still
    /// held.
    fn cached_chain(pool: &mut BlockPool) -> Vec<BlockId> {
        let ids: Vec<BlockId> = (0..3).map(|_| pool.allocate().unwrap()).collect();
        cache(pool, ids[0], 10);
        cache_under(pool, ids[1], 11, ids[0].0);
        cache_under(pool, ids[2], 12, ids[1].0);
        ids
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
    fn records_are_32_bytes() {
        assert_eq!(std::mem::size_of::<Slot>(), 32);
        assert_eq!(std::mem::align_of::<Slot>(), 32);
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
            (1, Some(a.0))
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
        assert_eq!(cached.parent, None);
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
        assert_eq!(p.lookup(BlockHash(101)), Some(ids[1].0));
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

    /// A chain released head first (as a router that drains its block list front to back does)
    /// is still evicted tail first: a held child pins its parent.
    #[test]
    fn a_chain_released_head_first_is_evicted_tail_first() {
        let mut p = pool(3, 2);
        let ids = cached_chain(&mut p);
        for &id in &ids {
            p.release(id).unwrap();
            p.check_consistency().unwrap();
        }
        assert_eq!(p.state(ids[0]), Some(BlockState::CachedEvictable));
        assert_eq!(p.allocate(), Ok(ids[2]));
        assert_eq!(p.allocate(), Ok(ids[1]));
        assert_eq!(p.allocate(), Ok(ids[0]));
        p.check_consistency().unwrap();
    }

    /// Holding a deep block pins its whole chain: nothing above it can be evicted, and the
    /// blocks above count as used, not as evictable.
    #[test]
    fn holding_a_descendant_pins_its_ancestors() {
        let mut p = pool(4, 2);
        let ids = cached_chain(&mut p);
        for &id in ids.iter().rev() {
            p.release(id).unwrap();
        }
        assert_eq!(gauges(&p), (1, 3, 0));
        p.retain(ids[2]).unwrap();
        assert_eq!(gauges(&p), (1, 0, 3));
        assert_eq!(p.state(ids[0]), Some(BlockState::CachedHeld));
        assert_eq!(p.ref_count(ids[0]), 0);
        assert_eq!(p.allocate(), Ok(BlockId(3)));
        assert_eq!(p.allocate(), Err(Exhausted { needed: 1, free: 0 }));
        p.check_consistency().unwrap();
        // Released, the chain becomes evictable again, leaf first.
        p.release(ids[2]).unwrap();
        assert_eq!(gauges(&p), (0, 3, 1));
        assert_eq!(p.allocate(), Ok(ids[2]));
        p.check_consistency().unwrap();
    }

    #[test]
    fn clear_cache_drops_every_key() {
        let mut p = pool(4, 2);
        let held = p.allocate().unwrap();
        let idle = p.allocate().unwrap();
        let root = p.allocate().unwrap();
        cache(&mut p, held, 1);
        cache(&mut p, idle, 2);
        cache(&mut p, root, 3);
        let child = p.allocate().unwrap();
        cache_under(&mut p, child, 4, root.0);
        p.release(idle).unwrap();
        p.release(root).unwrap();
        assert_eq!(p.state(root), Some(BlockState::CachedHeld));
        let events = p.subscribe();
        p.clear_cache();
        assert_eq!(p.state(held), Some(BlockState::Owned));
        assert_eq!(p.state(child), Some(BlockState::Owned));
        assert_eq!(p.state(idle), Some(BlockState::Free));
        assert_eq!(p.state(root), Some(BlockState::Free));
        assert_eq!((p.registered_blocks(), gauges(&p)), (0, (2, 0, 2)));
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
        let (head, len) = (p.free_head, p.free_len);
        p.slots[a.index()].next = p.free_head;
        p.free_head = a.0;
        p.free_len += 1;
        assert_eq!(
            p.check_consistency(),
            Err(Inconsistency(
                "free-listed block 0 is held or cached".into()
            ))
        );
        p.slots[a.index()].next = NIL;
        (p.free_head, p.free_len) = (head, len);
        p.check_consistency().unwrap();
        p.used = 2;
        assert_eq!(
            p.check_consistency(),
            Err(Inconsistency("1 blocks are pinned but 2 recorded".into()))
        );
        p.used = 1;
        cache(&mut p, a, 9);
        let b = p.allocate().unwrap();
        cache_under(&mut p, b, 10, a.0);
        p.slots[a.index()].pins = 0;
        assert_eq!(
            p.check_consistency(),
            Err(Inconsistency(
                "block 0 records 0 pins but has 1 pinned children".into()
            ))
        );
    }
}
