//! Block keys of the prefix cache: the hash chain (`BlockHash`), the extra key (`ExtraKey`) and
//! the seeded hasher (`BlockHasher`).
//!
//! The key of full block `i` of a sequence is
//! `hash(seed; parent = key of block i-1 (or none), extra, tokens[i*B..(i+1)*B])`, so equal keys
//! mean equal prefixes (up to collisions, which the cache detects, see [`crate::prefix`]).
//!
//! The bytes hashed are, in order: one tag byte (bit 0: a parent is present, bit 1: a LoRA adapter,
//! bit 2: a cache salt), the parent key (16 bytes, little-endian, zero when absent), the adapter id
//! (4 bytes), the salt (8 bytes), then each token as 4 little-endian bytes. The layout has a fixed
//! header, so no two different inputs encode to the same bytes.

use std::fmt;

/// The key of one full block in the prefix cache. With [`HashKind::Xxh3x64`] the upper 64 bits are
/// zero.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct BlockHash(pub u128);

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
    /// within reach.
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

const TAG_PARENT: u8 = 1;
const TAG_LORA: u8 = 2;
const TAG_SALT: u8 = 4;
/// Tag byte, parent key, adapter id, salt.
const HEADER_BYTES: usize = 1 + 16 + 4 + 8;

impl BlockHasher {
    /// A hasher with the given seed. Replicas that publish cache events to one cluster router
    /// share a seed so that their keys agree; otherwise prefer [`BlockHasher::random`].
    pub fn new(kind: HashKind, seed: u64) -> Self {
        Self { kind, seed }
    }

    /// A hasher with a seed drawn from the operating system's entropy (through `rand`).
    pub fn random(kind: HashKind) -> Self {
        Self::new(kind, rand::random())
    }

    /// The hash kind.
    pub fn kind(&self) -> HashKind {
        self.kind
    }

    /// The key of a block holding `tokens` after the block keyed `parent`. `scratch` is reused
    /// for the bytes hashed, so a warm call allocates nothing.
    pub fn hash_block(
        &self,
        parent: Option<BlockHash>,
        extra: ExtraKey,
        tokens: &[u32],
        scratch: &mut Vec<u8>,
    ) -> BlockHash {
        scratch.clear();
        let mut tag = 0u8;
        if parent.is_some() {
            tag |= TAG_PARENT;
        }
        if extra.lora_adapter.is_some() {
            tag |= TAG_LORA;
        }
        if extra.cache_salt.is_some() {
            tag |= TAG_SALT;
        }
        scratch.reserve(HEADER_BYTES + 4 * tokens.len());
        scratch.push(tag);
        scratch.extend_from_slice(&parent.map_or(0, |p| p.0).to_le_bytes());
        scratch.extend_from_slice(&extra.lora_adapter.unwrap_or(0).to_le_bytes());
        scratch.extend_from_slice(&extra.cache_salt.unwrap_or(0).to_le_bytes());
        for token in tokens {
            scratch.extend_from_slice(&token.to_le_bytes());
        }
        match self.kind {
            HashKind::Xxh3x64 => BlockHash(u128::from(xxhash_rust::xxh3::xxh3_64_with_seed(
                scratch, self.seed,
            ))),
            HashKind::Xxh3x128 => {
                BlockHash(xxhash_rust::xxh3::xxh3_128_with_seed(scratch, self.seed))
            }
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
