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
/// [`BlockTable::from_prefix`](crate::BlockTable::from_prefix), or release the blocks).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
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
