//! Block keys of the prefix cache: the hash chain (`BlockHash`), the extra key (`ExtraKey`), the
//! seeded hasher (`BlockHasher`) and one sequence's keys (`BlockKeys`).
//!
//! # The chain
//!
//! A sequence's namespace key is `hash(seed; tag, adapter, salt)`: one tag byte (bit 0: a LoRA
//! adapter, bit 1: a cache salt), the adapter id (4 bytes, little-endian, zero when absent) and the
//! salt (8 bytes, zero when absent), hashed with the cache instance's seed. Its full block `i` is
//! keyed from `prefix`, the key of block `i - 1` (the namespace key for block 0), and its tokens,
//! each written as 4 little-endian bytes:
//!
//! - 64-bit keys ([`HashKind::Xxh3x64`]): `xxh3_64(tokens, seed = prefix)`, the previous key as
//!   the xxh3 seed (no bytes are copied to hash a block);
//! - 128-bit keys ([`HashKind::Xxh3x128`]): `xxh3_128(prefix as 16 little-endian bytes ++ tokens,
//!   seed = instance seed)`, so the whole 128-bit chain enters every key.
//!
//! Equal keys mean equal prefixes in the same namespace up to collisions, which the cache detects
//! (see [`crate::prefix`]). The hash is xxh3 ([`xxhash_rust`]); hashing a block of 16 tokens is one
//! xxh3 call of 64 (or 80) bytes, with no allocation.
//!
//! # Keys computed once per sequence
//!
//! A [`BlockKeys`] holds the keys of one sequence's full blocks. `KvCache::match_keys` computes
//! the keys it needs as it walks the prompt and leaves them there; `KvCache::insert_keys` extends
//! them to the finished sequence and reuses the ones already computed. So each block of a
//! sequence is hashed once, however many times it is looked up or registered (vLLM's "request
//! block hashes").

use std::fmt;
use std::hash::BuildHasher as _;

/// The key of one full block in the prefix cache. With [`HashKind::Xxh3x64`] the upper 64 bits are
/// zero.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct BlockHash(pub u128);

impl BlockHash {
    /// The lower 64 bits: the index key of the block.
    pub(crate) fn low(self) -> u64 {
        self.0 as u64
    }

    /// The upper 64 bits (zero for 64-bit keys).
    pub(crate) fn high(self) -> u64 {
        (self.0 >> 64) as u64
    }
}

impl fmt::Display for BlockHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:032x}", self.0)
    }
}

/// What besides the tokens decides whether two blocks may be shared: the LoRA adapter that
/// computed the K/V (different adapters give different K/V for the same tokens) and a per-tenant
/// cache salt (two requests share a block only if their salts are equal, so a tenant with a secret
/// salt cannot probe another tenant's prompts through cache timing).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct ExtraKey {
    /// The LoRA adapter id, `None` for the base model.
    pub lora_adapter: Option<u32>,
    /// The tenant's cache salt (e.g. 64 random bits per tenant), `None` for the shared namespace.
    pub cache_salt: Option<u64>,
}

impl ExtraKey {
    /// The base model, no salt: the namespace every unsalted base-model request shares.
    pub const NONE: ExtraKey = ExtraKey {
        lora_adapter: None,
        cache_salt: None,
    };

    /// This key with the given LoRA adapter.
    pub fn with_lora(self, adapter: u32) -> Self {
        Self {
            lora_adapter: Some(adapter),
            ..self
        }
    }

    /// This key with the given cache salt.
    pub fn with_salt(self, salt: u64) -> Self {
        Self {
            cache_salt: Some(salt),
            ..self
        }
    }
}

/// Which hash the prefix cache keys blocks with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum HashKind {
    /// 64-bit xxh3, seeded per cache instance: the default. Accidental collisions need about 2^32
    /// cached blocks to become likely, far above any pool; and a collision is detected on lookup
    /// (it costs a miss, never a wrong block).
    #[default]
    Xxh3x64,
    /// 128-bit xxh3, seeded per cache instance: for pools shared by tenants that do not trust each
    /// other, so that not even the "denial of cache" a deliberate collision would cause (a miss) is
    /// within reach. The index compares all 128 bits.
    Xxh3x128,
}

/// Hashes blocks into chain keys; one per cache instance, with the instance's seed.
#[derive(Clone)]
pub struct BlockHasher {
    kind: HashKind,
    seed: u64,
}

impl fmt::Debug for BlockHasher {
    // The seed is a secret: printing it would let a log reader precompute collisions.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BlockHasher")
            .field("kind", &self.kind)
            .finish_non_exhaustive()
    }
}

const TAG_LORA: u8 = 1;
const TAG_SALT: u8 = 2;
/// Tag byte, adapter id, salt.
const NAMESPACE_BYTES: usize = 1 + 4 + 8;
/// The prefix key in front of a block's tokens.
pub(crate) const PREFIX_BYTES: usize = 16;

impl BlockHasher {
    /// A hasher with the given seed. Replicas that publish cache events to one cluster router
    /// share a seed so that their keys agree; otherwise prefer [`BlockHasher::random`].
    pub fn new(kind: HashKind, seed: u64) -> Self {
        Self { kind, seed }
    }

    /// A hasher with a secret seed: std's [`RandomState`](std::hash::RandomState), whose SipHash
    /// keys come from the operating system's entropy source, hashes nothing, and the result is
    /// the seed (each `RandomState` gets distinct keys, so each hasher its own seed).
    pub fn random(kind: HashKind) -> Self {
        Self::new(kind, std::hash::RandomState::new().hash_one(()))
    }

    /// The hash kind.
    pub fn kind(&self) -> HashKind {
        self.kind
    }

    fn hash_bytes(&self, bytes: &[u8]) -> BlockHash {
        match self.kind {
            HashKind::Xxh3x64 => BlockHash(u128::from(xxhash_rust::xxh3::xxh3_64_with_seed(
                bytes, self.seed,
            ))),
            HashKind::Xxh3x128 => {
                BlockHash(xxhash_rust::xxh3::xxh3_128_with_seed(bytes, self.seed))
            }
        }
    }

    /// The key that stands in front of a sequence's first block: the namespace of `extra`.
    pub fn namespace_key(&self, extra: ExtraKey) -> BlockHash {
        let mut bytes = [0u8; NAMESPACE_BYTES];
        let mut tag = 0u8;
        if extra.lora_adapter.is_some() {
            tag |= TAG_LORA;
        }
        if extra.cache_salt.is_some() {
            tag |= TAG_SALT;
        }
        bytes[0] = tag;
        bytes[1..5].copy_from_slice(&extra.lora_adapter.unwrap_or(0).to_le_bytes());
        bytes[5..13].copy_from_slice(&extra.cache_salt.unwrap_or(0).to_le_bytes());
        self.hash_bytes(&bytes)
    }

    /// The key of a block holding `tokens` after the block keyed `parent` (`None`: a first block
    /// in the namespace of `extra`). `scratch` is reused for the bytes hashed, so a warm call
    /// allocates nothing.
    pub fn hash_block(
        &self,
        parent: Option<BlockHash>,
        extra: ExtraKey,
        tokens: &[u32],
        scratch: &mut Vec<u8>,
    ) -> BlockHash {
        let prefix = parent.unwrap_or_else(|| self.namespace_key(extra));
        self.chain(prefix, tokens, scratch)
    }

    /// The key of a block holding `tokens` after the key `prefix`.
    #[inline]
    pub(crate) fn chain(
        &self,
        prefix: BlockHash,
        tokens: &[u32],
        scratch: &mut Vec<u8>,
    ) -> BlockHash {
        if self.kind == HashKind::Xxh3x64 && cfg!(target_endian = "little") {
            // The tokens' memory is already their little-endian bytes.
            let bytes: &[u8] = bytemuck::cast_slice(tokens);
            return BlockHash(u128::from(xxhash_rust::xxh3::xxh3_64_with_seed(
                bytes,
                prefix.low(),
            )));
        }
        let len = PREFIX_BYTES + 4 * tokens.len();
        if scratch.len() != len {
            scratch.clear();
            scratch.resize(len, 0);
        }
        let (head, body) = scratch.split_at_mut(PREFIX_BYTES);
        head.copy_from_slice(&prefix.0.to_le_bytes());
        if cfg!(target_endian = "little") {
            // The tokens' memory is already their little-endian bytes: one copy.
            body.copy_from_slice(bytemuck::cast_slice(tokens));
        } else {
            for (bytes, token) in body.chunks_exact_mut(4).zip(tokens) {
                bytes.copy_from_slice(&token.to_le_bytes());
            }
        }
        match self.kind {
            HashKind::Xxh3x64 => BlockHash(u128::from(xxhash_rust::xxh3::xxh3_64_with_seed(
                body,
                prefix.low(),
            ))),
            HashKind::Xxh3x128 => {
                BlockHash(xxhash_rust::xxh3::xxh3_128_with_seed(scratch, self.seed))
            }
        }
    }
}

/// The keys of one sequence's full blocks in one namespace, computed once and extended as the
/// sequence grows; see the [module docs](self). Get one from `KvCache::keys`, or reset one
/// (keeping its capacity) with `KvCache::reset_keys`.
///
/// Invariant: `hashes[i]` is the key of block `i` of the token sequence the keys were computed
/// from, so the tokens handed to the cache with these keys must start with those tokens. Keys that
/// do not belong to the tokens cannot produce a wrong hit (every hit is verified against the
/// stored tokens and the chain's blocks), only misses.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BlockKeys {
    pub(crate) extra: ExtraKey,
    /// The key in front of block 0.
    pub(crate) namespace: BlockHash,
    pub(crate) hashes: Vec<BlockHash>,
}

impl BlockKeys {
    /// The namespace (adapter and salt) the keys were computed in.
    pub fn extra(&self) -> ExtraKey {
        self.extra
    }

    /// Blocks keyed so far.
    pub fn len(&self) -> usize {
        self.hashes.len()
    }

    /// Whether no block is keyed yet.
    pub fn is_empty(&self) -> bool {
        self.hashes.is_empty()
    }

    /// The keys, block by block.
    pub fn hashes(&self) -> &[BlockHash] {
        &self.hashes
    }

    /// Drops the keys of blocks `blocks..` (the sequence was truncated to fewer full blocks).
    pub fn truncate(&mut self, blocks: usize) {
        self.hashes.truncate(blocks);
    }

    /// Makes room for the keys of `additional` more blocks, so that computing them does not
    /// allocate.
    pub fn reserve(&mut self, additional: usize) {
        self.hashes.reserve(additional);
    }

    /// The key in front of block `index`.
    pub(crate) fn prefix_of(&self, index: usize) -> BlockHash {
        match index.checked_sub(1) {
            Some(previous) => self.hashes[previous],
            None => self.namespace,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(
        hasher: &BlockHasher,
        parent: Option<BlockHash>,
        extra: ExtraKey,
        t: &[u32],
    ) -> BlockHash {
        hasher.hash_block(parent, extra, t, &mut Vec::new())
    }

    #[test]
    fn same_input_same_key_and_every_field_matters() {
        let h = BlockHasher::new(HashKind::Xxh3x64, 7);
        let base = key(&h, None, ExtraKey::NONE, &[1, 2, 3, 4]);
        assert_eq!(base, key(&h, None, ExtraKey::NONE, &[1, 2, 3, 4]));
        let variants = [
            key(&h, None, ExtraKey::NONE, &[1, 2, 3, 5]),
            key(&h, Some(BlockHash(0)), ExtraKey::NONE, &[1, 2, 3, 4]),
            key(&h, Some(base), ExtraKey::NONE, &[1, 2, 3, 4]),
            key(&h, None, ExtraKey::NONE.with_lora(0), &[1, 2, 3, 4]),
            key(&h, None, ExtraKey::NONE.with_salt(0), &[1, 2, 3, 4]),
            key(&h, None, ExtraKey::NONE.with_salt(1), &[1, 2, 3, 4]),
            key(
                &BlockHasher::new(HashKind::Xxh3x64, 8),
                None,
                ExtraKey::NONE,
                &[1, 2, 3, 4],
            ),
        ];
        for (i, v) in variants.iter().enumerate() {
            assert_ne!(*v, base, "variant {i} collides with the base key");
        }
    }

    #[test]
    fn random_hashers_draw_distinct_seeds_on_every_thread() {
        let draw = || -> Vec<u64> {
            (0..8)
                .map(|_| BlockHasher::random(HashKind::Xxh3x64).seed)
                .collect()
        };
        let mut seeds = draw();
        seeds.extend(std::thread::spawn(draw).join().unwrap());
        let distinct: std::collections::BTreeSet<u64> = seeds.iter().copied().collect();
        assert_eq!(distinct.len(), 16, "{seeds:x?}");
    }

    #[test]
    fn a_first_block_hashes_after_its_namespace_key() {
        let h = BlockHasher::new(HashKind::Xxh3x128, 3);
        let extra = ExtraKey::NONE.with_salt(11).with_lora(2);
        let namespace = h.namespace_key(extra);
        assert_eq!(
            key(&h, None, extra, &[5, 6]),
            key(&h, Some(namespace), ExtraKey::NONE, &[5, 6])
        );
        // The layout written out: the namespace bytes, then prefix key and tokens.
        let mut ns_bytes = vec![TAG_LORA | TAG_SALT];
        ns_bytes.extend_from_slice(&2u32.to_le_bytes());
        ns_bytes.extend_from_slice(&11u64.to_le_bytes());
        assert_eq!(
            namespace.0,
            xxhash_rust::xxh3::xxh3_128_with_seed(&ns_bytes, 3)
        );
        let mut block_bytes = namespace.0.to_le_bytes().to_vec();
        block_bytes.extend_from_slice(&5u32.to_le_bytes());
        block_bytes.extend_from_slice(&6u32.to_le_bytes());
        assert_eq!(
            key(&h, None, extra, &[5, 6]).0,
            xxhash_rust::xxh3::xxh3_128_with_seed(&block_bytes, 3)
        );
    }

    #[test]
    fn a_narrow_key_seeds_xxh3_with_the_previous_key() {
        let h = BlockHasher::new(HashKind::Xxh3x64, 3);
        let namespace = h.namespace_key(ExtraKey::NONE);
        let mut ns_bytes = vec![0u8];
        ns_bytes.extend_from_slice(&[0; 12]);
        assert_eq!(
            namespace.0,
            u128::from(xxhash_rust::xxh3::xxh3_64_with_seed(&ns_bytes, 3))
        );
        let mut block_bytes = 5u32.to_le_bytes().to_vec();
        block_bytes.extend_from_slice(&6u32.to_le_bytes());
        let first = key(&h, None, ExtraKey::NONE, &[5, 6]);
        assert_eq!(
            first.0,
            u128::from(xxhash_rust::xxh3::xxh3_64_with_seed(
                &block_bytes,
                namespace.0 as u64
            ))
        );
        assert_eq!(
            key(&h, Some(first), ExtraKey::NONE, &[5, 6]).0,
            u128::from(xxhash_rust::xxh3::xxh3_64_with_seed(
                &block_bytes,
                first.0 as u64
            ))
        );
    }

    #[test]
    fn widths() {
        let narrow = BlockHasher::new(HashKind::Xxh3x64, 1);
        let wide = BlockHasher::new(HashKind::Xxh3x128, 1);
        assert_eq!(key(&narrow, None, ExtraKey::NONE, &[9, 9]).0 >> 64, 0);
        assert_ne!(key(&wide, None, ExtraKey::NONE, &[9, 9]).0 >> 64, 0);
    }

    #[test]
    fn debug_hides_the_seed() {
        let h = BlockHasher::new(HashKind::Xxh3x128, 123_456_789);
        let text = format!("{h:?}");
        assert_eq!(text, "BlockHasher { kind: Xxh3x128, .. }");
    }
}
