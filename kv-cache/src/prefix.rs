//! The hash-chain prefix cache: `KvCache` (a [`BlockPool`] plus the seeded [`BlockHasher`]),
//! `match_prefix` / `match_keys` and `insert` / `insert_keys`.
//!
//! # Model
//!
//! Only full blocks are cached. Block `i` of a token sequence is keyed by a hash of the key of
//! block `i - 1` (or of the namespace, for a first block) and its tokens (see [`crate::hash`]), so
//! a key stands for the whole prefix up to the end of its block. The pool keeps, per cached
//! block, the key, the *parent* (the cached block of the position before it), the namespace of a
//! first block, the *first child* (see [`crate::pool`]) and the tokens; the index maps key to
//! block for first blocks and for children other than first children.
//!
//! # Exact hits
//!
//! `match_keys` walks the query block by block: along first-child links while they lead to a
//! block holding the query's tokens, else through the index under the query's key, and stops at
//! the first block it cannot find. It **verifies** every hit: the block must record as its parent
//! exactly the block matched one position earlier (a first block: no parent, and the query's
//! namespace), and hold exactly the query's tokens. By induction every matched block holds
//! exactly the query's prefix, whatever the hash: a collision costs a miss (counted in
//! [`CacheCounters::hash_collisions`](crate::CacheCounters)), never another prefix's (or another
//! tenant's) K/V, so vLLM's cross-tenant collision problem cannot happen here whatever the hash
//! width. The pool never evicts a block before its cached descendants (see [`crate::pool`]), so a
//! parent link always names the block the child was registered after.
//!
//! # Keys computed once
//!
//! A sequence's keys live in a [`BlockKeys`]. `match_keys` hashes only where it consults the
//! index (a first block, a branch point, the first miss) and copies the keys of the blocks it
//! found along first-child links from the cache; `insert_keys` takes the keys it lacks from the
//! cached blocks it checks and hashes only the blocks it registers. So no block of a sequence is
//! hashed twice, and most are never hashed. The token forms (`match_prefix`, `insert`) work the
//! same way on the cache's own scratch keys.
//!
//! `insert_keys` registers a sequence's full blocks. A block already registered is checked by its
//! link to the previous position and by key, or token by token where the key is not known yet. A
//! block whose contents are already cached under the same parent is a duplicate: it stays
//! uncached, the cached twin keeps serving hits, and the rest of the chain is registered under
//! the twin (which the new blocks pin, so it outlives them). After a collision nothing further
//! down that chain is registered (it could never be reached). A block registered under a block
//! this same call registered needs no probe: it cannot have a twin.
//!
//! # Eviction order: tails before heads
//!
//! Evictable blocks leave least recently used first, where a block is used while it or a
//! descendant is held, and a block is never evicted while it has cached descendants: a chain is
//! shortened from its end, and a shared system prompt outlives the conversations under it.
//!
//! # Performance
//!
//! `taskset -c 0 cargo bench -p kv-cache --bench op_trace` replays the operation trace of a
//! multi-turn chat workload (lookup, allocate, insert, free per request) and prints ns per block
//! operation and µs per request; the crate docs quote its figures.

use crate::hash::BlockKeys;
use crate::pool::{Probe, ROOT};
use crate::{BlockHash, BlockHasher, BlockId, BlockPool, ExtraKey, HashKind, KvError};

/// First children a lookup collects before comparing their tokens.
const RUN_BLOCKS: usize = 32;

/// How to build a [`KvCache`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvCacheConfig {
    /// Blocks in the pool.
    pub num_blocks: usize,
    /// Tokens per block.
    pub block_size: usize,
    /// The key hash.
    pub hash_kind: HashKind,
    /// The hash seed; `None` draws one from the operating system (the default: keys then differ
    /// per instance, so nobody outside can precompute collisions). Replicas behind one cluster
    /// router that reads their events share a seed.
    pub seed: Option<u64>,
}

impl KvCacheConfig {
    /// `num_blocks` blocks of `block_size` tokens, 64-bit xxh3 with a random seed.
    pub fn new(num_blocks: usize, block_size: usize) -> Self {
        Self {
            num_blocks,
            block_size,
            hash_kind: HashKind::default(),
            seed: None,
        }
    }
}

/// The result of [`KvCache::match_prefix`]: the longest run of cached blocks at the start of
/// the query, with one reference taken on each for the caller (hand it to
/// [`BlockTable::from_prefix`](crate::BlockTable::from_prefix), or release the blocks). Not
/// `Clone`, for the same reason as a table.
#[derive(Debug, PartialEq, Eq, Default)]
pub struct PrefixMatch {
    /// The matched blocks, in order.
    pub blocks: Vec<BlockId>,
    /// Tokens they cover: `blocks.len() * block_size`.
    pub tokens: usize,
}

/// A block pool with a prefix cache: the one object a router keeps for its attention KV.
///
/// The pool is reachable through [`KvCache::pool_mut`] for tables, the ledger and outside holders
/// (the Marconi store), so all of them share one set of reference counts.
#[derive(Debug)]
pub struct KvCache {
    pool: BlockPool,
    hasher: BlockHasher,
    /// Bytes of the block being hashed; reused so hashing does not allocate.
    scratch: Vec<u8>,
    /// The keys of the token forms (`match_prefix`, `insert`, ...), reused.
    keys: BlockKeys,
    /// One bit per block: the blocks `insert` has seen in the current call (duplicate check).
    marks: Vec<u64>,
}

impl KvCache {
    /// A cache over a fresh pool.
    pub fn new(config: KvCacheConfig) -> Result<Self, KvError> {
        let pool = BlockPool::new(config.num_blocks, config.block_size)?;
        let hasher = match config.seed {
            Some(seed) => BlockHasher::new(config.hash_kind, seed),
            None => BlockHasher::random(config.hash_kind),
        };
        Ok(Self::with_pool(pool, hasher))
    }

    /// A cache over an existing pool (which may hold blocks already) with the given hasher.
    /// Allocates the prefix cache's storage for the whole pool now (the tokens of every block,
    /// the index), so that no lookup or registration allocates. Keys already cached in the pool
    /// are dropped if they have the other width.
    pub fn with_pool(mut pool: BlockPool, hasher: BlockHasher) -> Self {
        pool.enable_prefix_cache(hasher.kind() == HashKind::Xxh3x128);
        let marks = vec![0; pool.num_blocks().div_ceil(64)];
        let keys = BlockKeys {
            extra: ExtraKey::NONE,
            namespace: hasher.namespace_key(ExtraKey::NONE),
            hashes: Vec::new(),
        };
        let scratch = vec![0; crate::hash::PREFIX_BYTES + 4 * pool.block_size()];
        Self {
            pool,
            hasher,
            scratch,
            keys,
            marks,
        }
    }

    /// The pool.
    pub fn pool(&self) -> &BlockPool {
        &self.pool
    }

    /// The pool, for tables, the ledger and outside holders.
    pub fn pool_mut(&mut self) -> &mut BlockPool {
        &mut self.pool
    }

    /// The pool, giving up the cache.
    pub fn into_pool(self) -> BlockPool {
        self.pool
    }

    /// The hasher.
    pub fn hasher(&self) -> &BlockHasher {
        &self.hasher
    }

    // ----- keys computed once per sequence -----

    /// Empty keys for a sequence in the namespace of `extra`.
    pub fn keys(&self, extra: ExtraKey) -> BlockKeys {
        let mut keys = BlockKeys::default();
        self.reset_keys(&mut keys, extra);
        keys
    }

    /// Empties `keys` for a new sequence in the namespace of `extra`, keeping their capacity.
    pub fn reset_keys(&self, keys: &mut BlockKeys, extra: ExtraKey) {
        keys.hashes.clear();
        keys.extra = extra;
        keys.namespace = self.hasher.namespace_key(extra);
    }

    /// Computes the keys of the full blocks of `tokens` that `keys` lacks. `tokens` must start
    /// with the tokens the keys were computed from (the same sequence, grown).
    pub fn extend_keys(&mut self, keys: &mut BlockKeys, tokens: &[u32]) {
        let block_size = self.pool.block_size();
        let full = tokens.len() / block_size;
        keys.hashes.reserve(full.saturating_sub(keys.hashes.len()));
        for i in keys.hashes.len()..full {
            let chunk = &tokens[i * block_size..(i + 1) * block_size];
            let key = self
                .hasher
                .chain(keys.prefix_of(i), chunk, &mut self.scratch);
            keys.hashes.push(key);
        }
    }

    /// The longest cached prefix of `tokens` (whose keys, as far as computed, are `keys`), with
    /// a reference taken on each block, into `out` (cleared first); returns the tokens matched.
    /// Computes the keys it needs that `keys` lacks and leaves them there. Allocates nothing once
    /// `out` and `keys` have the capacity.
    ///
    /// Only whole blocks match. A caller that needs logits for the last prompt token passes all
    /// but that token, so that at least one token is computed.
    pub fn match_keys(
        &mut self,
        keys: &mut BlockKeys,
        tokens: &[u32],
        out: &mut Vec<BlockId>,
    ) -> usize {
        out.clear();
        let block_size = self.pool.block_size();
        let blocks = tokens.len() / block_size;
        let mut parent = ROOT;
        loop {
            let i = out.len();
            if i == blocks {
                break;
            }
            if parent != ROOT {
                // A run of first children: their ids by following the links (records only),
                // then their tokens compared in one pass whose loads do not wait on each other.
                // An exact hit needs no key: its key is the cached block's, the one the hasher
                // would compute.
                let limit = (blocks - i).min(RUN_BLOCKS);
                let found = self.pool.first_children(parent, limit, out);
                let verified = out[i..]
                    .iter()
                    .zip(tokens[i * block_size..].chunks_exact(block_size))
                    .take_while(|(id, chunk)| self.pool.holds(id.0, chunk))
                    .count();
                out.truncate(i + verified);
                if keys.hashes.len() == i {
                    let pool = &self.pool;
                    keys.hashes
                        .extend(out[i..].iter().map(|id| pool.key_of(id.0)));
                } else {
                    for (k, id) in out[i..].iter().enumerate() {
                        if keys.hashes.len() == i + k {
                            keys.hashes.push(self.pool.key_of(id.0));
                        }
                    }
                }
                if let Some(last) = out.last() {
                    parent = last.0;
                }
                if verified == limit && found == limit {
                    // The run may go on.
                    continue;
                }
            }
            // The index: a first block, or a block that is not its parent's first child.
            let i = out.len();
            if i == blocks {
                break;
            }
            let chunk = &tokens[i * block_size..(i + 1) * block_size];
            let key = match keys.hashes.get(i) {
                Some(&key) => key,
                None => {
                    let key = self
                        .hasher
                        .chain(keys.prefix_of(i), chunk, &mut self.scratch);
                    keys.hashes.push(key);
                    key
                }
            };
            match self.pool.probe_index(key, parent, keys.extra, chunk) {
                Probe::Hit(id) => {
                    out.push(BlockId(id));
                    parent = id;
                }
                Probe::Collision(id) => {
                    self.pool.counters_mut().hash_collisions += 1;
                    tracing::debug!(%key, block = id, "prefix cache hash collision: treated as a miss");
                    break;
                }
                Probe::Miss => break,
            }
        }
        // References are taken after the walk, so the walk's loop stays short and its loads
        // (records and tokens of the next blocks) overlap.
        for (taken, &id) in out.iter().enumerate() {
            // A cached block can always be retained short of u32::MAX holders; stop there.
            if !self.pool.retain_hit(id.0) {
                out.truncate(taken);
                break;
            }
        }
        let matched = out.len() * block_size;
        let counters = self.pool.counters_mut();
        counters.lookups += 1;
        counters.lookup_tokens += tokens.len() as u64;
        counters.hit_blocks += out.len() as u64;
        counters.hit_tokens += matched as u64;
        matched
    }

    /// Registers the full blocks of a sequence: `blocks[i]` holds `tokens[i*B..(i+1)*B]`, whose
    /// keys (as far as computed) are `keys`; the missing keys are computed and left in `keys`.
    /// Trailing tokens of a partial block, and blocks past the full ones, are ignored. Returns how
    /// many blocks were newly registered.
    ///
    /// The caller must hold every block it passes (a table's blocks, typically). Errors, which
    /// change nothing in the cache: an unknown or unheld block, a block given twice, a block
    /// already cached with other contents, fewer blocks than full blocks.
    pub fn insert_keys(
        &mut self,
        keys: &mut BlockKeys,
        tokens: &[u32],
        blocks: &[BlockId],
    ) -> Result<usize, KvError> {
        let block_size = self.pool.block_size();
        let full = tokens.len() / block_size;
        if blocks.len() < full {
            return Err(KvError::TooFewBlocks {
                tokens: tokens.len(),
                needed: full,
                blocks: blocks.len(),
            });
        }
        let blocks = &blocks[..full];
        let tokens = &tokens[..full * block_size];
        let first_new = self.validate_insert(keys, tokens, blocks)?;

        let mut stored = 0;
        let mut parent = match first_new.checked_sub(1) {
            Some(previous) => blocks[previous].0,
            None => ROOT,
        };
        // Whether `parent` was registered by this call: then it has no child, so nothing can be
        // a duplicate under it and the block becomes its first child without a probe.
        let mut fresh_parent = false;
        let new_tokens = tokens[first_new * block_size..].chunks_exact(block_size);
        for (i, (chunk, &id)) in (first_new..).zip(new_tokens.zip(&blocks[first_new..])) {
            if self.pool.is_cached(id) {
                parent = id.0;
                fresh_parent = false;
                continue;
            }
            let key = keys.hashes[i];
            let probe = if fresh_parent {
                Probe::Miss
            } else {
                self.pool.probe(key, parent, keys.extra, chunk)
            };
            match probe {
                Probe::Hit(twin) => {
                    self.pool.counters_mut().deduplicated_blocks += 1;
                    parent = twin;
                    fresh_parent = false;
                }
                Probe::Collision(other) => {
                    self.pool.counters_mut().hash_collisions += 1;
                    tracing::debug!(%key, block = id.0, other,
                        "prefix cache hash collision on insert: the rest of the chain stays uncached");
                    break;
                }
                Probe::Miss => {
                    self.pool.register(id.0, key, parent, keys.extra, chunk);
                    stored += 1;
                    parent = id.0;
                    fresh_parent = true;
                }
            }
        }
        Ok(stored)
    }

    /// Checks `insert_keys`'s blocks before anything changes in the cache, completing `keys` as
    /// it goes; returns the position of the first uncached block (`blocks.len()` if none).
    ///
    /// Each block must be known and held. An uncached block must not be given twice. A cached
    /// block must be cached exactly there: a first block in this namespace at position 0, else
    /// a child of the block at the previous position (or of a block keyed like it, a twin), and
    /// hold these tokens: checked by its key where `keys` has it, else token by token (and its
    /// key copied into `keys`, so the chain of keys needs no hashing up to the first new block).
    fn validate_insert(
        &mut self,
        keys: &mut BlockKeys,
        tokens: &[u32],
        blocks: &[BlockId],
    ) -> Result<usize, KvError> {
        let block_size = self.pool.block_size();
        let mut result = Ok(blocks.len());
        let mut first_new = None;
        let mut checked = 0;
        for (position, (&id, chunk)) in blocks
            .iter()
            .zip(tokens.chunks_exact(block_size))
            .enumerate()
        {
            let Some(record) = self.pool.record(id) else {
                result = Err(KvError::UnknownBlock {
                    block: id,
                    num_blocks: self.pool.num_blocks(),
                });
                break;
            };
            if record.ref_count == 0 {
                result = Err(KvError::NotHeld { block: id });
                break;
            }
            checked = position + 1;
            if record.cached() {
                let parent = record.parent();
                let linked = match position.checked_sub(1) {
                    Some(previous) => {
                        parent == Some(blocks[previous].0)
                            || parent.is_some_and(|p| self.pool.key_of(p) == keys.hashes[previous])
                    }
                    None => self.pool.is_first_block_in(id.0, keys.extra),
                };
                let holds = match keys.hashes.get(position) {
                    Some(&key) => self.pool.has_key(id.0, &record, key),
                    None => self.pool.holds(id.0, chunk),
                };
                if !(linked && holds) {
                    result = Err(KvError::CachedWithOtherContents {
                        block: id,
                        position,
                    });
                    break;
                }
                if keys.hashes.len() == position {
                    keys.hashes.push(self.pool.key_of(id.0));
                }
                continue;
            }
            first_new.get_or_insert(position);
            let (word, bit) = (id.index() / 64, 1u64 << (id.index() % 64));
            if self.marks[word] & bit != 0 {
                result = Err(KvError::DuplicateBlock { block: id });
                break;
            }
            self.marks[word] |= bit;
            if keys.hashes.len() == position {
                let key = self
                    .hasher
                    .chain(keys.prefix_of(position), chunk, &mut self.scratch);
                keys.hashes.push(key);
            }
        }
        // Outside this function every mark is clear, so clearing whole words is enough (and
        // stores do not wait on each other as read-modify-writes of one word would).
        // Only uncached blocks were marked, and none comes before `first_new`.
        for &id in &blocks[first_new.unwrap_or(checked).min(checked)..checked] {
            if let Some(word) = self.marks.get_mut(id.index() / 64) {
                *word = 0;
            }
        }
        result.map(|all| first_new.unwrap_or(all))
    }

    // ----- the token forms -----

    /// The longest cached prefix of `tokens` under `extra`, with a reference taken on each block.
    ///
    /// Only whole blocks match. A caller that needs logits for the last prompt token passes all
    /// but that token, so that at least one token is computed.
    pub fn match_prefix(&mut self, tokens: &[u32], extra: ExtraKey) -> PrefixMatch {
        let mut blocks = Vec::new();
        let tokens = self.match_prefix_into(tokens, extra, &mut blocks);
        PrefixMatch { blocks, tokens }
    }

    /// [`match_prefix`](Self::match_prefix) into a caller's vector (cleared first), so a warm
    /// call allocates nothing; returns the tokens matched.
    pub fn match_prefix_into(
        &mut self,
        tokens: &[u32],
        extra: ExtraKey,
        out: &mut Vec<BlockId>,
    ) -> usize {
        let mut keys = std::mem::take(&mut self.keys);
        self.reset_keys(&mut keys, extra);
        let matched = self.match_keys(&mut keys, tokens, out);
        self.keys = keys;
        matched
    }

    /// How many tokens `match_prefix` would return now, without taking references, touching the
    /// LRU order or counting a lookup: an estimate for admission and for a hybrid model's hit
    /// length (KV coverage is one bound, the Marconi checkpoints the other). Any allocation
    /// between this call and the match may evict some of those blocks.
    pub fn cached_prefix_len(&mut self, tokens: &[u32], extra: ExtraKey) -> usize {
        let block_size = self.pool.block_size();
        let namespace = self.hasher.namespace_key(extra);
        let mut prefix = namespace;
        let mut parent = ROOT;
        let mut blocks = 0;
        for chunk in tokens.chunks_exact(block_size) {
            let key = self.hasher.chain(prefix, chunk, &mut self.scratch);
            match self.pool.probe(key, parent, extra, chunk) {
                Probe::Hit(id) => parent = id,
                _ => break,
            }
            blocks += 1;
            prefix = key;
        }
        blocks * block_size
    }

    /// The keys of the full blocks of `tokens`, in order (what `insert` would register and what
    /// the events of a matching sequence carry), appended to `out`.
    pub fn block_hashes(&mut self, tokens: &[u32], extra: ExtraKey, out: &mut Vec<BlockHash>) {
        let mut keys = std::mem::take(&mut self.keys);
        self.reset_keys(&mut keys, extra);
        self.extend_keys(&mut keys, tokens);
        out.extend_from_slice(&keys.hashes);
        self.keys = keys;
    }

    /// Registers the full blocks of a sequence: `blocks[i]` holds `tokens[i*B..(i+1)*B]`.
    /// Trailing tokens of a partial block, and blocks past the full ones, are ignored. Returns
    /// how many blocks were newly registered. See [`insert_keys`](Self::insert_keys), which
    /// reuses keys a lookup computed.
    ///
    /// The caller must hold every block it passes (a table's blocks, typically). Errors, which
    /// change nothing: an unknown or unheld block, a block given twice, a block already cached
    /// with other contents, fewer blocks than full blocks.
    pub fn insert(
        &mut self,
        tokens: &[u32],
        blocks: &[BlockId],
        extra: ExtraKey,
    ) -> Result<usize, KvError> {
        let mut keys = std::mem::take(&mut self.keys);
        self.reset_keys(&mut keys, extra);
        let result = self.insert_keys(&mut keys, tokens, blocks);
        self.keys = keys;
        result
    }

    /// Drops every cached key (publishes `AllCleared`); held blocks stay with their holders.
    pub fn clear(&mut self) {
        self.pool.clear_cache();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{BlockState, BlockTable, CacheEvent};

    const B: usize = 4;

    fn kv(num_blocks: usize) -> KvCache {
        KvCache::new(KvCacheConfig {
            seed: Some(42),
            ..KvCacheConfig::new(num_blocks, B)
        })
        .expect("valid config")
    }

    fn tokens(n: usize, salt: u32) -> Vec<u32> {
        (0..n as u32).map(|t| t * 7 + salt).collect()
    }

    /// A table that ran `toks` and registered them, then released: the blocks stay cached.
    fn finish(kv: &mut KvCache, toks: &[u32], extra: ExtraKey) -> Vec<BlockId> {
        let mut table = BlockTable::new();
        table.append(kv.pool_mut(), toks.len()).unwrap();
        kv.insert(toks, table.blocks(), extra).unwrap();
        let blocks = table.blocks().to_vec();
        table.release_all(kv.pool_mut());
        blocks
    }

    fn release(kv: &mut KvCache, m: &PrefixMatch) {
        for &id in &m.blocks {
            kv.pool_mut().release(id).unwrap();
        }
    }

    #[test]
    fn empty_cache_misses() {
        let mut kv = kv(4);
        assert_eq!(
            kv.match_prefix(&tokens(10, 0), ExtraKey::NONE),
            PrefixMatch::default()
        );
        let c = kv.pool().counters();
        assert_eq!((c.lookups, c.lookup_tokens, c.hit_blocks), (1, 10, 0));
    }

    #[test]
    fn match_returns_longest_cached_prefix_with_references() {
        let mut kv = kv(8);
        let prompt = tokens(10, 0); // two full blocks and a partial one
        let blocks = finish(&mut kv, &prompt, ExtraKey::NONE);
        assert_eq!(
            kv.pool().registered_blocks(),
            2,
            "the partial block is not cached"
        );

        let mut query = prompt[..9].to_vec();
        query.extend([999, 998, 997]);
        let m = kv.match_prefix(&query, ExtraKey::NONE);
        assert_eq!(
            m,
            PrefixMatch {
                blocks: blocks[..2].to_vec(),
                tokens: 8
            }
        );
        assert_eq!(kv.pool().state(blocks[0]), Some(BlockState::CachedHeld));
        assert_eq!(kv.pool().ref_count(blocks[1]), 1);

        // A query that diverges inside the second block keeps only the first.
        let mut diverging = prompt[..6].to_vec();
        diverging.extend([5000, 5001]);
        let m2 = kv.match_prefix(&diverging, ExtraKey::NONE);
        assert_eq!(
            m2,
            PrefixMatch {
                blocks: vec![blocks[0]],
                tokens: 4
            }
        );
        assert_eq!(kv.pool().ref_count(blocks[0]), 2);

        release(&mut kv, &m);
        release(&mut kv, &m2);
        let c = kv.pool().counters();
        assert_eq!((c.lookups, c.hit_blocks, c.hit_tokens), (2, 3, 12));
        kv.pool().check_consistency().unwrap();
    }

    #[test]
    fn cached_prefix_len_peeks_without_side_effects() {
        let mut kv = kv(4);
        let prompt = tokens(9, 0);
        finish(&mut kv, &prompt, ExtraKey::NONE);
        let before = kv.pool().stats();
        assert_eq!(kv.cached_prefix_len(&prompt, ExtraKey::NONE), 8);
        assert_eq!(kv.cached_prefix_len(&prompt[..7], ExtraKey::NONE), 4);
        assert_eq!(
            kv.cached_prefix_len(&prompt, ExtraKey::NONE.with_salt(1)),
            0
        );
        assert_eq!(kv.pool().stats(), before);
    }

    #[test]
    fn extra_key_separates_adapters_and_tenants() {
        let mut kv = kv(16);
        let prompt = tokens(8, 3);
        let tenant = ExtraKey::NONE.with_salt(77);
        finish(&mut kv, &prompt, tenant);
        let check = |kv: &mut KvCache, extra: ExtraKey, expected_tokens: usize| {
            let m = kv.match_prefix(&prompt, extra);
            assert_eq!(m.tokens, expected_tokens, "extra = {extra:?}");
            release(kv, &m);
        };
        check(&mut kv, tenant, 8);
        check(&mut kv, ExtraKey::NONE, 0);
        check(&mut kv, ExtraKey::NONE.with_salt(78), 0);
        check(&mut kv, tenant.with_lora(1), 0);
        finish(&mut kv, &prompt, ExtraKey::NONE.with_lora(1));
        check(&mut kv, ExtraKey::NONE.with_lora(1), 8);
        check(&mut kv, ExtraKey::NONE.with_lora(2), 0);
    }

    #[test]
    fn insert_deduplicates_equal_blocks() {
        let mut kv = kv(8);
        let prompt = tokens(8, 1);
        let first = finish(&mut kv, &prompt, ExtraKey::NONE);
        let second = {
            let mut table = BlockTable::new();
            table.append(kv.pool_mut(), 8).unwrap();
            assert_eq!(kv.insert(&prompt, table.blocks(), ExtraKey::NONE), Ok(0));
            let blocks = table.blocks().to_vec();
            table.release_all(kv.pool_mut());
            blocks
        };
        assert_ne!(first, second);
        assert_eq!(kv.pool().counters().deduplicated_blocks, 2);
        assert_eq!(kv.pool().state(second[0]), Some(BlockState::Free));
        let m = kv.match_prefix(&prompt, ExtraKey::NONE);
        assert_eq!(m.blocks, first);
        release(&mut kv, &m);
    }

    #[test]
    fn insert_of_matched_blocks_registers_only_new_ones() {
        let mut kv = kv(8);
        let prompt = tokens(4, 2);
        finish(&mut kv, &prompt, ExtraKey::NONE);
        let longer = tokens(12, 2);
        let mut table = BlockTable::from_prefix(kv.match_prefix(&longer, ExtraKey::NONE));
        assert_eq!(table.len(), 4);
        table.append(kv.pool_mut(), 8).unwrap();
        assert_eq!(kv.insert(&longer, table.blocks(), ExtraKey::NONE), Ok(2));
        assert_eq!(kv.pool().registered_blocks(), 3);
        table.release_all(kv.pool_mut());
        kv.pool().check_consistency().unwrap();
    }

    #[test]
    fn insert_errors_change_nothing() {
        let mut kv = kv(8);
        let prompt = tokens(8, 0);
        let mut table = BlockTable::new();
        table.append(kv.pool_mut(), 8).unwrap();
        let b = table.blocks().to_vec();
        let free = BlockId(7);
        let before = kv.pool().stats();
        let check = |kv: &mut KvCache, blocks: &[BlockId], expected: KvError| {
            assert_eq!(kv.insert(&prompt, blocks, ExtraKey::NONE), Err(expected));
            assert_eq!(kv.pool().stats(), before);
        };
        check(
            &mut kv,
            &b[..1],
            KvError::TooFewBlocks {
                tokens: 8,
                needed: 2,
                blocks: 1,
            },
        );
        check(
            &mut kv,
            &[b[0], BlockId(99)],
            KvError::UnknownBlock {
                block: BlockId(99),
                num_blocks: 8,
            },
        );
        check(&mut kv, &[b[0], free], KvError::NotHeld { block: free });
        check(
            &mut kv,
            &[b[0], b[0]],
            KvError::DuplicateBlock { block: b[0] },
        );

        // A block cached under other contents cannot be registered again.
        let other = tokens(4, 50);
        kv.insert(&other, &b[1..], ExtraKey::NONE).unwrap();
        let before = kv.pool().stats();
        assert_eq!(
            kv.insert(&prompt, &b, ExtraKey::NONE),
            Err(KvError::CachedWithOtherContents {
                block: b[1],
                position: 1
            })
        );
        assert_eq!(kv.pool().stats(), before);
        table.release_all(kv.pool_mut());
    }

    #[test]
    fn collisions_are_misses_not_wrong_blocks() {
        let mut kv = kv(4);
        let prompt = tokens(4, 0);
        // Fake a collision: another block registered under the prompt's key with other tokens.
        let mut hashes = Vec::new();
        kv.block_hashes(&prompt, ExtraKey::NONE, &mut hashes);
        let impostor = kv.pool_mut().allocate().unwrap();
        kv.pool_mut()
            .register(impostor.0, hashes[0], ROOT, ExtraKey::NONE, &tokens(4, 1));

        assert_eq!(
            kv.match_prefix(&prompt, ExtraKey::NONE),
            PrefixMatch::default()
        );
        assert_eq!(kv.pool().ref_count(impostor), 1);
        let mut table = BlockTable::new();
        table.append(kv.pool_mut(), 4).unwrap();
        assert_eq!(kv.insert(&prompt, table.blocks(), ExtraKey::NONE), Ok(0));
        assert_eq!(kv.pool().counters().hash_collisions, 2);
        assert_eq!(kv.pool().cached(table.blocks()[0]), None);
        table.release_all(kv.pool_mut());
        kv.pool().check_consistency().unwrap();
    }

    /// A collision under a branch point: the block found in the index under the query's key holds
    /// other tokens. The lookup stops there (a counted miss) and the insert registers nothing under
    /// it.
    #[test]
    fn a_collision_past_the_first_block_is_a_miss() {
        let mut kv = kv(8);
        let cached = tokens(8, 0);
        let blocks = finish(&mut kv, &cached, ExtraKey::NONE);
        let mut query = cached[..4].to_vec();
        query.extend([900, 901, 902, 903]);
        let mut hashes = Vec::new();
        kv.block_hashes(&query, ExtraKey::NONE, &mut hashes);
        // An impostor under the query's second key, a second child of the first block (so it is
        // indexed), holding other tokens.
        let impostor = kv.pool_mut().allocate().unwrap();
        kv.pool_mut().register(
            impostor.0,
            hashes[1],
            blocks[0].0,
            ExtraKey::NONE,
            &tokens(4, 77),
        );
        let m = kv.match_prefix(&query, ExtraKey::NONE);
        assert_eq!(m.blocks, vec![blocks[0]]);
        release(&mut kv, &m);
        let mut table = BlockTable::new();
        table.append(kv.pool_mut(), query.len()).unwrap();
        assert_eq!(kv.insert(&query, table.blocks(), ExtraKey::NONE), Ok(0));
        let c = kv.pool().counters();
        assert_eq!((c.hash_collisions, c.deduplicated_blocks), (2, 1));
        table.release_all(kv.pool_mut());
        kv.pool_mut().release(impostor).unwrap();
        kv.pool().check_consistency().unwrap();
    }

    #[test]
    fn events_describe_the_chain() {
        let mut kv = kv(3);
        let events = kv.pool_mut().subscribe();
        let prompt = tokens(8, 4);
        finish(&mut kv, &prompt, ExtraKey::NONE.with_salt(9));
        let mut hashes = Vec::new();
        kv.block_hashes(&prompt, ExtraKey::NONE.with_salt(9), &mut hashes);
        let stored: Vec<CacheEvent> = events.try_iter().collect();
        assert_eq!(
            stored,
            vec![
                CacheEvent::BlockStored {
                    hash: hashes[0],
                    parent: None,
                    tokens: prompt[..4].to_vec(),
                    extra: ExtraKey::NONE.with_salt(9),
                },
                CacheEvent::BlockStored {
                    hash: hashes[1],
                    parent: Some(hashes[0]),
                    tokens: prompt[4..].to_vec(),
                    extra: ExtraKey::NONE.with_salt(9),
                },
            ]
        );
        // Two allocations under pressure: the free block, then the chain's tail.
        let mut out = Vec::new();
        kv.pool_mut().allocate_many(2, &mut out).unwrap();
        assert_eq!(
            events.try_recv(),
            Ok(CacheEvent::BlockRemoved { hash: hashes[1] })
        );
        kv.clear();
        assert_eq!(events.try_recv(), Ok(CacheEvent::AllCleared));
        assert!(events.try_recv().is_err());
    }

    /// The defect this design removes: a block cached under another id (a duplicate on insert)
    /// used to stay where it was in the LRU list while the new blocks were chained under its
    /// twin, so the twin could be evicted before them and strand them. Now the new blocks pin the
    /// twin: the chain is evicted tail first and its head keeps serving hits.
    #[test]
    fn a_deduplicated_twin_outlives_the_blocks_chained_under_it() {
        let mut kv = kv(6);
        let head = tokens(8, 3);
        let mut whole = head.clone();
        whole.extend(tokens(8, 40));
        // Two sequences computed the same head concurrently; the short one is cached first.
        let mut short = BlockTable::new();
        short.append(kv.pool_mut(), head.len()).unwrap();
        let mut long = BlockTable::new();
        long.append(kv.pool_mut(), whole.len()).unwrap();
        assert_eq!(kv.insert(&head, short.blocks(), ExtraKey::NONE), Ok(2));
        let twins = short.blocks().to_vec();
        short.release_all(kv.pool_mut());
        // The long one's head is a duplicate; its tail is registered under the twins.
        assert_eq!(kv.insert(&whole, long.blocks(), ExtraKey::NONE), Ok(2));
        assert_eq!(kv.pool().counters().deduplicated_blocks, 2);
        let tail = long.blocks()[2..].to_vec();
        assert_eq!(kv.pool().state(twins[1]), Some(BlockState::CachedHeld));
        long.release_all(kv.pool_mut());
        kv.pool().check_consistency().unwrap();

        // Two free blocks (the duplicates), then evictions: the tail's last block goes first.
        let mut out = Vec::new();
        kv.pool_mut().allocate_many(3, &mut out).unwrap();
        assert_eq!(out[2], tail[1]);
        let m = kv.match_prefix(&whole, ExtraKey::NONE);
        assert_eq!(m.blocks, vec![twins[0], twins[1], tail[0]]);
        release(&mut kv, &m);
        for id in out {
            kv.pool_mut().release(id).unwrap();
        }
        kv.pool().check_consistency().unwrap();
    }

    /// Keys computed by a lookup are reused by the insert, and match what the token forms
    /// compute.
    #[test]
    fn keys_are_computed_once_and_shared() {
        let mut kv = kv(16);
        let extra = ExtraKey::NONE.with_salt(5);
        let prompt = tokens(10, 1);
        finish(&mut kv, &prompt[..4], extra);
        let mut keys = kv.keys(extra);
        let mut blocks = Vec::new();
        // One hit, then one miss: two keys computed, the partial block none.
        assert_eq!(kv.match_keys(&mut keys, &prompt, &mut blocks), 4);
        assert_eq!(keys.len(), 2);
        let mut table = BlockTable::from_prefix(PrefixMatch {
            blocks: blocks.clone(),
            tokens: 4,
        });
        let mut full = prompt.clone();
        full.extend(tokens(6, 9));
        table.append(kv.pool_mut(), full.len() - 4).unwrap();
        assert_eq!(kv.insert_keys(&mut keys, &full, table.blocks()), Ok(3));
        assert_eq!(keys.len(), 4);
        let mut expected = Vec::new();
        kv.block_hashes(&full, extra, &mut expected);
        assert_eq!(keys.hashes(), &expected[..]);
        table.release_all(kv.pool_mut());
        assert_eq!(kv.cached_prefix_len(&full, extra), 16);
        kv.reset_keys(&mut keys, ExtraKey::NONE);
        assert!(keys.is_empty());
        assert_eq!(kv.match_keys(&mut keys, &full, &mut blocks), 0);
        kv.pool().check_consistency().unwrap();
    }

    #[test]
    fn tails_are_evicted_before_heads() {
        let mut kv = kv(3);
        let prompt = tokens(12, 5);
        let blocks = finish(&mut kv, &prompt, ExtraKey::NONE);
        assert_eq!(kv.pool().cached_blocks(), 3);
        assert_eq!(kv.pool_mut().allocate(), Ok(blocks[2]));
        assert_eq!(kv.pool_mut().allocate(), Ok(blocks[1]));
        let m = kv.match_prefix(&prompt, ExtraKey::NONE);
        assert_eq!(
            m,
            PrefixMatch {
                blocks: vec![blocks[0]],
                tokens: 4
            }
        );
    }

    #[test]
    fn wide_hash_and_explicit_hasher() {
        let config = KvCacheConfig {
            hash_kind: HashKind::Xxh3x128,
            seed: Some(1),
            ..KvCacheConfig::new(4, B)
        };
        let mut kv = KvCache::new(config).unwrap();
        assert_eq!(kv.hasher().kind(), HashKind::Xxh3x128);
        let prompt = tokens(8, 0);
        let blocks = finish(&mut kv, &prompt, ExtraKey::NONE);
        let m = kv.match_prefix(&prompt, ExtraKey::NONE);
        assert_eq!(m.blocks, blocks);

        // The same seed in another instance gives the same keys (what replicas rely on).
        let mut a = Vec::new();
        let mut b = Vec::new();
        kv.block_hashes(&prompt, ExtraKey::NONE, &mut a);
        KvCache::new(config)
            .unwrap()
            .block_hashes(&prompt, ExtraKey::NONE, &mut b);
        assert_eq!(a, b);
        assert_eq!(
            KvCache::new(KvCacheConfig::new(0, 4)).unwrap_err(),
            KvError::NoBlocks
        );
    }
}
