//! The router's prefix-cache events (`device_io::events`): one key scheme, kv-cache's hash chain
//! ([`kv_cache::hash`]), whichever index holds the blocks.
//!
//! - **Hash chain** (attention-only models): `kv-cache` publishes its own events; while anyone
//!   subscribes, the router holds one subscription to them and forwards each, converted, after
//!   every cache operation.
//! - **Marconi tree** (hybrid models): the tree's block references move only through
//!   `StoreDelta`s. A block the tree adopts (`retain_blocks`, only ever from a finishing
//!   sequence) is stored under the chain key of its position in that sequence; a block it gives
//!   back (`release_blocks`) is removed under the key it was stored with.
//!
//! A new subscription first gets the cache's contents, parents first (see `contents`).
//!
//! Invariants: `tree_extra[b]` is the namespace of block `b` whenever the tree holds `b` (written
//! at every adoption, subscribed or not: the contents of a later subscription need it; 16 bytes
//! per block, no allocation). While the bus is active, `tree_keys[b]` is `Some(key)` exactly when
//! the tree holds `b` and `key` is what its `BlockStored` carried, and on the hash chain `kv` is
//! `Some`. With the bus inactive nothing is built, hashed or tracked but `tree_extra`.

use crossbeam_channel::Receiver;
use device_io::{BlockKey, CacheEvent, CacheEventBus, CacheEventSink};
use kv_cache::{BlockHash, BlockId, ExtraKey, KvCache};
use ssm_snapshot::{SnapshotStore, StoreDelta};

/// The sequence whose finish produced a Marconi delta: where the blocks the tree adopts come
/// from.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Adoption<'a> {
    pub tokens: &'a [u32],
    pub blocks: &'a [u32],
    pub extra: ExtraKey,
}

/// See the module docs.
#[derive(Debug)]
pub(crate) struct Events {
    bus: CacheEventBus,
    kv: Option<Receiver<kv_cache::CacheEvent>>,
    tree_extra: Vec<ExtraKey>,
    tree_keys: Vec<Option<BlockHash>>,
    /// Block id → its position in the adopting sequence (valid for that sequence's blocks only).
    position: Vec<u32>,
    hashes: Vec<BlockHash>,
}

fn key(hash: BlockHash) -> BlockKey {
    BlockKey(hash.0)
}

fn stored(
    hash: BlockHash,
    parent: Option<BlockHash>,
    tokens: &[u32],
    extra: ExtraKey,
) -> CacheEvent {
    CacheEvent::BlockStored {
        key: key(hash),
        parent: parent.map(key),
        tokens: tokens.to_vec(),
        lora_adapter: extra.lora_adapter,
        cache_salt: extra.cache_salt,
    }
}

fn convert(event: kv_cache::CacheEvent) -> CacheEvent {
    match event {
        kv_cache::CacheEvent::BlockStored {
            hash,
            parent,
            tokens,
            extra,
        } => CacheEvent::BlockStored {
            key: key(hash),
            parent: parent.map(key),
            tokens,
            lora_adapter: extra.lora_adapter,
            cache_salt: extra.cache_salt,
        },
        kv_cache::CacheEvent::BlockRemoved { hash } => CacheEvent::BlockRemoved { key: key(hash) },
        kv_cache::CacheEvent::AllCleared => CacheEvent::AllBlocksCleared,
    }
}

/// One block of the prefix cache's contents.
#[derive(Debug)]
pub struct Listed {
    /// The block.
    pub block: BlockId,
    /// Its chain key.
    pub hash: BlockHash,
    /// The `BlockStored` that describes it.
    pub event: CacheEvent,
}

/// What the prefix cache holds now, block by block, each after its parent: the hash chain's
/// registered blocks, or every block reference of the Marconi tree (`store`), keyed by the chain
/// over its sequence's tokens in its namespace (`tree_extra`). Allocates; for subscriptions and
/// inspection, not the hot path.
pub(crate) fn contents(
    kv: &KvCache,
    store: Option<&SnapshotStore>,
    tree_extra: &[ExtraKey],
) -> Vec<Listed> {
    let mut out = Vec::new();
    match store {
        Some(store) => {
            let mut keys: Vec<Option<BlockHash>> = vec![None; kv.pool().num_blocks()];
            let mut scratch = Vec::new();
            store.visit_blocks(|b| {
                let extra = tree_extra[b.block.index()];
                let parent = b.parent.and_then(|p| keys[p.index()]);
                let hash = kv
                    .hasher()
                    .hash_block(parent, extra, b.tokens, &mut scratch);
                keys[b.block.index()] = Some(hash);
                out.push(Listed {
                    block: b.block,
                    hash,
                    event: stored(hash, parent, b.tokens, extra),
                });
            });
        }
        None => {
            let pool = kv.pool();
            let blocks: Vec<(BlockId, kv_cache::CachedBlock<'_>)> = (0..pool.num_blocks())
                .filter_map(|i| {
                    let id = BlockId(i as u32);
                    pool.cached(id).map(|b| (id, b))
                })
                .collect();
            let by_key: std::collections::HashMap<BlockHash, usize> = blocks
                .iter()
                .enumerate()
                .map(|(i, (_, b))| (b.hash, i))
                .collect();
            // Each block after its parent: walk up to the first ancestor already listed, then
            // list the chain back down.
            let mut listed = vec![false; blocks.len()];
            let mut chain = Vec::new();
            for start in 0..blocks.len() {
                let mut at = Some(start);
                while let Some(i) = at.filter(|&i| !listed[i]) {
                    listed[i] = true;
                    chain.push(i);
                    at = blocks[i].1.parent.and_then(|p| by_key.get(&p).copied());
                }
                for &i in chain.iter().rev() {
                    let (block, b) = &blocks[i];
                    out.push(Listed {
                        block: *block,
                        hash: b.hash,
                        event: stored(b.hash, b.parent, b.tokens, b.extra),
                    });
                }
                chain.clear();
            }
        }
    }
    out
}

impl Events {
    /// No subscription; `tree_blocks` is the pool's block count when the Marconi tree is the
    /// index (0 otherwise).
    pub fn new(tree_blocks: usize) -> Self {
        Events {
            bus: CacheEventBus::default(),
            kv: None,
            tree_extra: vec![ExtraKey::NONE; tree_blocks],
            tree_keys: Vec::new(),
            position: Vec::new(),
            hashes: Vec::new(),
        }
    }

    /// Adds a subscription: delivers the cache's contents to `sink`, then keeps it for every
    /// change. Starts tracking when it is the first.
    pub fn subscribe(
        &mut self,
        kv: &mut KvCache,
        store: Option<&SnapshotStore>,
        mut sink: Box<dyn CacheEventSink>,
    ) {
        // Whatever the others have not been sent yet comes before the new one's contents.
        self.flush_kv();
        let now = contents(kv, store, &self.tree_extra);
        if !self.bus.is_active() {
            match store {
                Some(_) => {
                    self.tree_keys.clear();
                    self.tree_keys.resize(kv.pool().num_blocks(), None);
                    self.position.resize(kv.pool().num_blocks(), 0);
                    for listed in &now {
                        self.tree_keys[listed.block.index()] = Some(listed.hash);
                    }
                }
                None => self.kv = Some(kv.pool_mut().subscribe()),
            }
        }
        for listed in now {
            if !CacheEventBus::deliver_to(sink.as_mut(), listed.event) {
                self.settle();
                return;
            }
        }
        self.bus.add(sink);
    }

    /// Forwards what `kv-cache` published since the last call (hash-chain index).
    pub fn flush_kv(&mut self) {
        let Some(receiver) = &self.kv else {
            return;
        };
        for event in receiver.try_iter() {
            self.bus.publish(convert(event));
        }
        self.settle();
    }

    /// Stops tracking once the last subscriber is gone.
    fn settle(&mut self) {
        if !self.bus.is_active() {
            self.kv = None;
            self.tree_keys.clear();
        }
    }

    /// Records (and, while anyone subscribes, publishes) a Marconi delta before the pool applies
    /// it: a `BlockStored` per adopted block, then a `BlockRemoved` per given-back one, as the
    /// tree did them (a store call adopts before it evicts). With `cleared`, the tree is empty
    /// after this delta: one `AllBlocksCleared` stands for the removals.
    pub fn tree_delta(
        &mut self,
        kv: &mut KvCache,
        delta: &StoreDelta,
        adoption: Option<Adoption<'_>>,
        cleared: bool,
    ) {
        if let Some(adoption) = adoption {
            for &block in &delta.retain_blocks {
                self.tree_extra[block.index()] = adoption.extra;
            }
        }
        if !self.bus.is_active() {
            return;
        }
        if !delta.retain_blocks.is_empty() {
            match adoption {
                Some(adoption) => self.adopted(kv, &delta.retain_blocks, adoption),
                None => tracing::error!(
                    blocks = delta.retain_blocks.len(),
                    "the Marconi tree adopted blocks outside a finish; no events for them"
                ),
            }
        }
        for &block in &delta.release_blocks {
            let Some(hash) = self.tree_keys[block.index()].take() else {
                tracing::error!(
                    block = block.0,
                    "the Marconi tree released a block never stored"
                );
                continue;
            };
            if !cleared {
                self.bus
                    .publish(CacheEvent::BlockRemoved { key: key(hash) });
            }
        }
        if cleared {
            self.bus.publish(CacheEvent::AllBlocksCleared);
        }
        self.settle();
    }

    fn adopted(&mut self, kv: &mut KvCache, retained: &[BlockId], adoption: Adoption<'_>) {
        let block_size = kv.pool().block_size();
        self.hashes.clear();
        kv.block_hashes(adoption.tokens, adoption.extra, &mut self.hashes);
        for (i, &block) in adoption.blocks.iter().take(self.hashes.len()).enumerate() {
            self.position[block as usize] = i as u32;
        }
        for &block in retained {
            let i = self.position[block.index()] as usize;
            if adoption.blocks.get(i) != Some(&block.0) {
                tracing::error!(
                    block = block.0,
                    "the Marconi tree adopted a block the sequence did not list"
                );
                continue;
            }
            let hash = self.hashes[i];
            let parent = i.checked_sub(1).map(|p| self.hashes[p]);
            let tokens = &adoption.tokens[i * block_size..(i + 1) * block_size];
            self.tree_keys[block.index()] = Some(hash);
            self.bus
                .publish(stored(hash, parent, tokens, adoption.extra));
        }
    }

    /// The namespace of each block the Marconi tree holds (indexed by block id).
    pub fn tree_extra(&self) -> &[ExtraKey] {
        &self.tree_extra
    }
}
