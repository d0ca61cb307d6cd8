//! The hash-chain prefix cache: `KvCache` (a [`BlockPool`] plus the seeded [`BlockHasher`]),
//! `match_prefix` and `insert`.
//!
//! # Model
//!
//! Only full blocks are cached. Block `i` of a token sequence is keyed by
//! `hash(parent key, extra, its tokens)` (see [`crate::hash`]), so a key stands for the whole
//! prefix up to the end of its block. The pool keeps, per cached block, its key, its parent's key,
//! its extra key and its tokens; the index maps key to block.
//!
//! `match_prefix` walks the query block by block, stops at the first key that is missing, and
//! **verifies** every hit: the block's stored parent key, extra key and tokens must equal the
//! query's. A hash collision therefore costs a miss (counted in
//! [`CacheCounters::hash_collisions`](crate::CacheCounters)), never another prefix's (or another
//! tenant's) K/V: vLLM's cross-tenant collision problem cannot happen here whatever the hash width.
//! The verification reads `block_size` tokens per hit, which the tokens just hashed made hot.
//!
//! `insert` registers a sequence's full blocks. A block whose key is already cached under another
//! block stays uncached (the cached twin keeps serving hits); after a collision nothing further
//! down that chain is registered (it could never be reached).
//!
//! # Eviction order: tails before heads
//!
//! Evictable blocks leave in the order they were released, oldest first. Tables release their
//! blocks last-to-first ([`BlockTable::release_all`](crate::BlockTable::release_all)), so when a
//! sequence ends, the tail of its chain is queued for eviction before its head: a chain is
//! shortened from its end, and a shared system prompt outlives the conversations under it.

use crate::pool::BlockKey;
use crate::{BlockHash, BlockHasher, BlockId, BlockPool, ExtraKey, HashKind, KvError};

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
    /// Bytes of the block being hashed; reused so lookups do not allocate.
    scratch: Vec<u8>,
    /// Keys computed by `insert` before it mutates anything.
    pending: Vec<BlockHash>,
    /// Block ids `insert` checks for duplicates.
    seen: Vec<BlockId>,
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
    pub fn with_pool(pool: BlockPool, hasher: BlockHasher) -> Self {
        Self {
            pool,
            hasher,
            scratch: Vec::new(),
            pending: Vec::new(),
            seen: Vec::new(),
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
        out.clear();
        let block_size = self.pool.block_size();
        let mut parent = None;
        for chunk in tokens.chunks_exact(block_size) {
            let hash = self
                .hasher
                .hash_block(parent, extra, chunk, &mut self.scratch);
            let Some(id) = self.pool.lookup(hash) else {
                break;
            };
            if !self.pool.key_matches(id, parent, extra, chunk) {
                self.pool.counters_mut().hash_collisions += 1;
                tracing::debug!(%hash, block = id.0, "prefix cache hash collision: treated as a miss");
                break;
            }
            // A cached block can always be retained short of u32::MAX holders; stop there.
            if self.pool.retain(id).is_err() {
                break;
            }
            out.push(id);
            parent = Some(hash);
        }
        let matched = out.len() * block_size;
        let counters = self.pool.counters_mut();
        counters.lookups += 1;
        counters.lookup_tokens += tokens.len() as u64;
        counters.hit_blocks += out.len() as u64;
        counters.hit_tokens += matched as u64;
        matched
    }

    /// How many tokens `match_prefix` would return now, without taking references, touching the
    /// LRU order or counting a lookup: an estimate for admission and for a hybrid model's hit
    /// length (KV coverage is one bound, the Marconi checkpoints the other). Any allocation
    /// between this call and the match may evict some of those blocks.
    pub fn cached_prefix_len(&mut self, tokens: &[u32], extra: ExtraKey) -> usize {
        let block_size = self.pool.block_size();
        let mut parent = None;
        let mut blocks = 0;
        for chunk in tokens.chunks_exact(block_size) {
            let hash = self
                .hasher
                .hash_block(parent, extra, chunk, &mut self.scratch);
            match self.pool.lookup(hash) {
                Some(id) if self.pool.key_matches(id, parent, extra, chunk) => {}
                _ => break,
            }
            blocks += 1;
            parent = Some(hash);
        }
        blocks * block_size
    }

    /// The keys of the full blocks of `tokens`, in order (what `insert` would register and what
    /// the events of a matching sequence carry), appended to `out`.
    pub fn block_hashes(&mut self, tokens: &[u32], extra: ExtraKey, out: &mut Vec<BlockHash>) {
        let mut parent = None;
        for chunk in tokens.chunks_exact(self.pool.block_size()) {
            let hash = self
                .hasher
                .hash_block(parent, extra, chunk, &mut self.scratch);
            out.push(hash);
            parent = Some(hash);
        }
    }

    /// Registers the full blocks of a sequence: `blocks[i]` holds `tokens[i*B..(i+1)*B]`.
    /// Trailing tokens of a partial block, and blocks past the full ones, are ignored. Returns
    /// how many blocks were newly registered.
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

        // Validate everything before the first change.
        self.pending.clear();
        let mut parent = None;
        for (position, (chunk, &id)) in tokens.chunks_exact(block_size).zip(blocks).enumerate() {
            self.pool.check_id(id)?;
            if self.pool.ref_count(id) == 0 {
                return Err(KvError::NotHeld { block: id });
            }
            let hash = self
                .hasher
                .hash_block(parent, extra, chunk, &mut self.scratch);
            if let Some(key) = self.pool.key_of(id) {
                if key.hash != hash || !self.pool.key_matches(id, parent, extra, chunk) {
                    return Err(KvError::CachedWithOtherContents {
                        block: id,
                        position,
                    });
                }
            }
            self.pending.push(hash);
            parent = Some(hash);
        }
        self.seen.clear();
        self.seen.extend_from_slice(blocks);
        self.seen.sort_unstable();
        if let Some(pair) = self.seen.windows(2).find(|w| w[0] == w[1]) {
            return Err(KvError::DuplicateBlock { block: pair[0] });
        }

        let mut stored = 0;
        let mut parent = None;
        for (i, (chunk, &id)) in tokens.chunks_exact(block_size).zip(blocks).enumerate() {
            let hash = self.pending[i];
            if self.pool.key_of(id).is_none() {
                match self.pool.lookup(hash) {
                    Some(twin) if self.pool.key_matches(twin, parent, extra, chunk) => {
                        self.pool.counters_mut().deduplicated_blocks += 1;
                    }
                    Some(other) => {
                        self.pool.counters_mut().hash_collisions += 1;
                        tracing::debug!(%hash, block = id.0, other = other.0,
                            "prefix cache hash collision on insert: the rest of the chain stays uncached");
                        break;
                    }
                    None => {
                        let key = BlockKey {
                            hash,
                            parent,
                            extra,
                        };
                        self.pool.register(id, key, chunk);
                        stored += 1;
                    }
                }
            }
            parent = Some(hash);
        }
        Ok(stored)
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
        let key = BlockKey {
            hash: hashes[0],
            parent: None,
            extra: ExtraKey::NONE,
        };
        kv.pool_mut().register(impostor, key, &tokens(4, 1));

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
