//! Property test: random sequences of cache operations against a naive model (plain `Vec` and
//! `HashMap` reimplementation keyed by whole token prefixes instead of hashes), checked after
//! every step.
//!
//! Checked after every step: each block's reference count equals its number of holders (table
//! entries, ledger entries, outside holders); free + cached + used = total, and each block's state
//! is the model's; no block is held by a table twice and `allocate` never hands out a held block
//! (the model predicts every allocated id); eviction takes the model's least recently unpinned
//! block and never a block with a registered descendant; every match returns blocks whose
//! registered tokens equal the query's tokens, and exactly the model's blocks; reserve then
//! rollback is the identity; the event stream stores and removes each key alternately;
//! `check_consistency` holds.
//!
//! The model's eviction policy, stated naively: a registered block is *pinned* while it has a
//! holder or a registered descendant with a holder; unpinned registered blocks are evictable, in
//! the order they became unpinned (when one release unpins several, the deepest first).

use std::collections::{HashMap, HashSet};

use kv_cache::{
    Appended, BlockCopy, BlockId, BlockState, BlockTable, CacheEvent, Exhausted, ExtraKey,
    HashKind, KvCache, KvCacheConfig, KvError,
};
use proptest::prelude::*;

/// A registered block in the model: the whole token prefix through the block, and the extra key.
type Key = (Vec<u32>, ExtraKey);

#[derive(Debug, Clone, Copy)]
struct ModelReservation {
    len: usize,
    blocks_before: usize,
    replaced: Option<u32>,
}

/// One live sequence: the real table, and the model's view of it.
#[derive(Debug)]
struct Seq {
    table: BlockTable,
    tokens: Vec<u32>,
    extra: ExtraKey,
    blocks: Vec<u32>,
    reservation: Option<ModelReservation>,
}

/// The naive model of the pool and the prefix cache.
#[derive(Debug)]
struct Model {
    block_size: usize,
    num_blocks: usize,
    /// The free list: the last entry is handed out next.
    free: Vec<u32>,
    /// Evictable cached blocks, least recently unpinned first.
    lru: Vec<u32>,
    registry: HashMap<u32, Key>,
    by_key: HashMap<Key, u32>,
}

struct Harness {
    kv: KvCache,
    model: Model,
    seqs: Vec<Seq>,
    /// Blocks held by an outside holder (the Marconi store, say), one entry per reference.
    outside: Vec<u32>,
    /// Token sequences seen so far, to build prompts that share prefixes.
    history: Vec<Vec<u32>>,
    events: crossbeam_channel::Receiver<CacheEvent>,
    stored_keys: HashSet<kv_cache::BlockHash>,
}

#[derive(Debug, Clone)]
enum Op {
    Admit {
        base: usize,
        cut: usize,
        suffix: Vec<u32>,
        salted: bool,
    },
    Lookup {
        base: usize,
        cut: usize,
        suffix: Vec<u32>,
        salted: bool,
    },
    Decode {
        seq: usize,
        tokens: Vec<u32>,
    },
    Fork {
        seq: usize,
    },
    Truncate {
        seq: usize,
        to: usize,
    },
    Insert {
        seq: usize,
    },
    Finish {
        seq: usize,
        cache: bool,
    },
    Reserve {
        seq: usize,
    },
    Rollback {
        seq: usize,
    },
    ReserveRollback {
        seq: usize,
        overrun: usize,
    },
    OutsideAlloc,
    OutsideRetain {
        block: usize,
    },
    OutsideRelease {
        pick: usize,
    },
    BadRelease {
        block: usize,
    },
    Clear,
}

fn tokens(max: usize) -> impl Strategy<Value = Vec<u32>> + Clone {
    // A tiny alphabet, so that prompts share blocks often.
    prop::collection::vec(0u32..3, 0..=max)
}

fn op() -> impl Strategy<Value = Op> {
    let prompt = (any::<usize>(), any::<usize>(), tokens(10), any::<bool>());
    prop_oneof![
        4 => prompt.clone().prop_map(|(base, cut, suffix, salted)| Op::Admit { base, cut, suffix, salted }),
        2 => prompt.prop_map(|(base, cut, suffix, salted)| Op::Lookup { base, cut, suffix, salted }),
        4 => (any::<usize>(), prop::collection::vec(0u32..3, 1..=5))
            .prop_map(|(seq, tokens)| Op::Decode { seq, tokens }),
        2 => any::<usize>().prop_map(|seq| Op::Fork { seq }),
        2 => (any::<usize>(), any::<usize>()).prop_map(|(seq, to)| Op::Truncate { seq, to }),
        2 => any::<usize>().prop_map(|seq| Op::Insert { seq }),
        3 => (any::<usize>(), any::<bool>()).prop_map(|(seq, cache)| Op::Finish { seq, cache }),
        2 => any::<usize>().prop_map(|seq| Op::Reserve { seq }),
        2 => any::<usize>().prop_map(|seq| Op::Rollback { seq }),
        2 => (any::<usize>(), 0usize..=6).prop_map(|(seq, overrun)| Op::ReserveRollback { seq, overrun }),
        1 => Just(Op::OutsideAlloc),
        1 => any::<usize>().prop_map(|block| Op::OutsideRetain { block }),
        1 => any::<usize>().prop_map(|pick| Op::OutsideRelease { pick }),
        1 => any::<usize>().prop_map(|block| Op::BadRelease { block }),
        1 => Just(Op::Clear),
    ]
}

impl Model {
    fn new(num_blocks: usize, block_size: usize) -> Self {
        Self {
            block_size,
            num_blocks,
            free: (0..num_blocks as u32).rev().collect(),
            lru: Vec::new(),
            registry: HashMap::new(),
            by_key: HashMap::new(),
        }
    }

    fn available(&self) -> usize {
        self.free.len() + self.lru.len()
    }
}

impl Harness {
    fn new(num_blocks: usize, block_size: usize, hash_kind: HashKind) -> Self {
        let config = KvCacheConfig {
            seed: Some(5),
            hash_kind,
            ..KvCacheConfig::new(num_blocks, block_size)
        };
        let mut kv = KvCache::new(config).unwrap();
        let events = kv.pool_mut().subscribe();
        Self {
            kv,
            model: Model::new(num_blocks, block_size),
            seqs: Vec::new(),
            outside: Vec::new(),
            history: Vec::new(),
            events,
            stored_keys: HashSet::new(),
        }
    }

    // ----- the model's holders and transitions -----

    /// The holders of `block` according to the model: table entries, ledger entries, outside.
    fn holders(&self, block: u32) -> usize {
        let in_tables: usize = self
            .seqs
            .iter()
            .map(|s| {
                s.blocks.iter().filter(|&&b| b == block).count()
                    + usize::from(s.reservation.and_then(|r| r.replaced) == Some(block))
            })
            .sum();
        in_tables + self.outside.iter().filter(|&&b| b == block).count()
    }

    /// The registered block whose key is the key of `block` without its last block (its parent
    /// in the chain), if `block` is registered and not a first block.
    fn parent(&self, block: u32) -> Option<u32> {
        let (prefix, extra) = self.model.registry.get(&block)?;
        let shorter = prefix.len().checked_sub(self.model.block_size)?;
        if shorter == 0 {
            return None;
        }
        let key = (prefix[..shorter].to_vec(), *extra);
        Some(
            *self
                .model
                .by_key
                .get(&key)
                .expect("a registered block's parent is registered"),
        )
    }

    /// Blocks with a holder (plus one more holder on `extra_holder`), and every registered
    /// ancestor of a registered block among them.
    fn pinned(&self, extra_holder: Option<u32>) -> HashSet<u32> {
        let mut pinned = HashSet::new();
        for block in 0..self.model.num_blocks as u32 {
            if self.holders(block) > 0 || extra_holder == Some(block) {
                let mut cursor = Some(block);
                while let Some(b) = cursor {
                    if !pinned.insert(b) && b != block {
                        break;
                    }
                    cursor = self.parent(b);
                }
            }
        }
        pinned
    }

    /// Hands out a block the model's way: the free list's top, else the LRU head (evicted).
    fn model_allocate(&mut self) -> u32 {
        let block = match self.model.free.pop() {
            Some(b) => b,
            None => {
                let b = self.model.lru.remove(0);
                let has_child = self
                    .model
                    .registry
                    .keys()
                    .any(|&other| self.parent(other) == Some(b));
                assert!(!has_child, "block {b} evicted before its descendants");
                let key = self
                    .model
                    .registry
                    .remove(&b)
                    .expect("LRU blocks are registered");
                self.model.by_key.remove(&key);
                b
            }
        };
        assert_eq!(
            self.holders(block),
            0,
            "block {block} handed to a second owner"
        );
        block
    }

    /// Called after a holder entry of `block` was removed.
    fn model_released(&mut self, block: u32) {
        let before = self.pinned(Some(block));
        let after = self.pinned(None);
        if after.contains(&block) {
            return;
        }
        if !self.model.registry.contains_key(&block) {
            self.model.free.push(block);
            return;
        }
        // The blocks this release unpinned: `block` and some of its ancestors, deepest first.
        let mut unpinned: Vec<u32> = before.difference(&after).copied().collect();
        unpinned.sort_by_key(|b| std::cmp::Reverse(self.model.registry[b].0.len()));
        self.model.lru.extend(unpinned);
    }

    /// Called before a holder entry of `block` is added.
    fn model_retaining(&mut self, block: u32) {
        let after = self.pinned(Some(block));
        self.model.lru.retain(|b| !after.contains(b));
    }

    /// Called after blocks were registered: a held block registered under an unpinned block pins
    /// it (and its ancestors).
    fn model_registered(&mut self) {
        let pinned = self.pinned(None);
        self.model.lru.retain(|b| !pinned.contains(b));
    }

    fn exclusive(&self, block: u32) -> bool {
        self.holders(block) == 1 && !self.model.registry.contains_key(&block)
    }

    fn model_match(&mut self, query: &[u32], extra: ExtraKey) -> Vec<u32> {
        let mut out = Vec::new();
        for end in (1..=query.len() / self.model.block_size).map(|i| i * self.model.block_size) {
            match self.model.by_key.get(&(query[..end].to_vec(), extra)) {
                Some(&b) => out.push(b),
                None => break,
            }
        }
        out
    }

    fn model_append(&mut self, s: usize, added_tokens: &[u32]) -> Result<Appended, KvError> {
        let bs = self.model.block_size;
        let len = self.seqs[s].tokens.len();
        let new_len = len + added_tokens.len();
        if added_tokens.is_empty() {
            return Ok(Appended::default());
        }
        let first = len / bs;
        let end = new_len.div_ceil(bs);
        let have = self.seqs[s].blocks.len();
        let existing_end = end.min(have);
        let mut needed = end.saturating_sub(have);
        for i in first.min(existing_end)..existing_end {
            if !self.exclusive(self.seqs[s].blocks[i]) {
                needed += 1;
            }
        }
        if needed > self.model.available() {
            return Err(KvError::Exhausted(Exhausted {
                needed,
                free: self.model.available(),
            }));
        }
        for _ in have..end {
            let b = self.model_allocate();
            self.seqs[s].blocks.push(b);
        }
        let mut copy = None;
        for i in (first..existing_end).rev() {
            let old = self.seqs[s].blocks[i];
            if self.exclusive(old) {
                continue;
            }
            let fresh = self.model_allocate();
            self.seqs[s].blocks[i] = fresh;
            self.model_released(old);
            if i == first && len % bs > 0 {
                copy = Some(BlockCopy {
                    src: BlockId(old),
                    dst: BlockId(fresh),
                    rows: len % bs,
                });
            }
        }
        self.seqs[s].tokens.extend_from_slice(added_tokens);
        Ok(Appended {
            added: needed,
            copy,
        })
    }

    fn model_commit(&mut self, s: usize) {
        if let Some(ModelReservation {
            replaced: Some(old),
            ..
        }) = self.seqs[s].reservation.take()
        {
            self.model_released(old);
        }
    }

    fn model_release_all(&mut self, s: usize) {
        self.model_commit(s);
        while let Some(b) = self.seqs[s].blocks.pop() {
            self.model_released(b);
        }
    }

    fn model_reserve(&mut self, s: usize) -> Result<usize, Exhausted> {
        let bs = self.model.block_size;
        let len = self.seqs[s].tokens.len();
        let index = len / bs;
        let current = self.seqs[s].blocks.get(index).copied();
        let needs = current.is_none_or(|b| !self.exclusive(b));
        if needs && self.model.available() < 1 {
            return Err(Exhausted {
                needed: 1,
                free: self.model.available(),
            });
        }
        self.model_commit(s);
        let mut reservation = ModelReservation {
            len,
            blocks_before: self.seqs[s].blocks.len(),
            replaced: None,
        };
        if needs {
            let fresh = self.model_allocate();
            match current {
                Some(old) => {
                    self.seqs[s].blocks[index] = fresh;
                    reservation.replaced = Some(old);
                }
                None => self.seqs[s].blocks.push(fresh),
            }
        }
        self.seqs[s].reservation = Some(reservation);
        Ok(usize::from(needs))
    }

    fn model_rollback(&mut self, s: usize) -> Result<usize, KvError> {
        let r = self.seqs[s]
            .reservation
            .take()
            .ok_or(KvError::NoReservation)?;
        let mut released = 0;
        if let Some(old) = r.replaced {
            let index = r.len / self.model.block_size;
            let fresh = std::mem::replace(&mut self.seqs[s].blocks[index], old);
            self.model_released(fresh);
            released += 1;
        }
        while self.seqs[s].blocks.len() > r.blocks_before {
            let b = self.seqs[s].blocks.pop().unwrap();
            self.model_released(b);
            released += 1;
        }
        self.seqs[s].tokens.truncate(r.len);
        Ok(released)
    }

    fn model_insert(&mut self, s: usize) -> usize {
        let bs = self.model.block_size;
        let (tokens, extra) = (self.seqs[s].tokens.clone(), self.seqs[s].extra);
        let mut stored = 0;
        for i in 0..tokens.len() / bs {
            let b = self.seqs[s].blocks[i];
            let key = (tokens[..(i + 1) * bs].to_vec(), extra);
            if let Some(registered) = self.model.registry.get(&b) {
                assert_eq!(
                    registered, &key,
                    "a table's block holds other tokens than its cache key"
                );
                continue;
            }
            if self.model.by_key.contains_key(&key) {
                continue;
            }
            self.model.registry.insert(b, key.clone());
            self.model.by_key.insert(key, b);
            stored += 1;
        }
        self.model_registered();
        stored
    }

    // ----- operations on both sides -----

    fn prompt(&self, base: usize, cut: usize, suffix: &[u32]) -> Vec<u32> {
        let mut prompt = match self.history.len() {
            0 => Vec::new(),
            n => {
                let base = &self.history[base % n];
                base[..cut % (base.len() + 1)].to_vec()
            }
        };
        prompt.extend_from_slice(suffix);
        prompt
    }

    fn extra(salted: bool) -> ExtraKey {
        if salted {
            ExtraKey::NONE.with_salt(1)
        } else {
            ExtraKey::NONE
        }
    }

    /// Matches on both sides and checks the blocks; returns the real match.
    fn lookup(&mut self, query: &[u32], extra: ExtraKey) -> kv_cache::PrefixMatch {
        let m = self.kv.match_prefix(query, extra);
        let expected = self.model_match(query, extra);
        let got: Vec<u32> = m.blocks.iter().map(|b| b.0).collect();
        assert_eq!(got, expected, "match of {query:?}");
        assert_eq!(m.tokens, m.blocks.len() * self.model.block_size);
        let bs = self.model.block_size;
        for (i, &b) in m.blocks.iter().enumerate() {
            let cached = self.kv.pool().cached(b).expect("matched blocks are cached");
            assert_eq!(cached.tokens, &query[i * bs..(i + 1) * bs]);
            assert_eq!(cached.extra, extra);
            assert_eq!(
                self.model.registry[&b.0],
                (query[..(i + 1) * bs].to_vec(), extra)
            );
        }
        m
    }

    fn apply(&mut self, op: &Op) {
        let live = self.seqs.len();
        match op {
            Op::Admit {
                base,
                cut,
                suffix,
                salted,
            } => {
                if live >= 6 {
                    return;
                }
                let prompt = self.prompt(*base, *cut, suffix);
                let extra = Self::extra(*salted);
                let m = self.lookup(&prompt, extra);
                let matched: Vec<u32> = m.blocks.iter().map(|b| b.0).collect();
                for &b in &matched {
                    self.model_retaining(b);
                    // The holder entry is added when the model sequence is pushed below; count
                    // it now through a temporary outside entry.
                    self.outside.push(b);
                }
                let hit = m.tokens;
                let table = BlockTable::from_prefix(m);
                for _ in &matched {
                    self.outside.pop();
                }
                self.seqs.push(Seq {
                    table,
                    tokens: prompt[..hit].to_vec(),
                    extra,
                    blocks: matched,
                    reservation: None,
                });
                let s = self.seqs.len() - 1;
                let real = self.seqs[s]
                    .table
                    .append(self.kv.pool_mut(), prompt.len() - hit);
                let model = self.model_append(s, &prompt[hit..]);
                assert_eq!(real, model);
                self.history.push(prompt);
                if real.is_err() {
                    self.finish(s, false);
                }
            }
            Op::Lookup {
                base,
                cut,
                suffix,
                salted,
            } => {
                let query = self.prompt(*base, *cut, suffix);
                let m = self.lookup(&query, Self::extra(*salted));
                for b in &m.blocks {
                    self.model_retaining(b.0);
                    self.outside.push(b.0);
                }
                for b in m.blocks {
                    self.kv.pool_mut().release(b).unwrap();
                    let at = self.outside.iter().rposition(|&o| o == b.0).unwrap();
                    self.outside.remove(at);
                    self.model_released(b.0);
                }
            }
            Op::Decode { seq, tokens } if live > 0 => {
                let s = seq % live;
                let real = self.seqs[s].table.append(self.kv.pool_mut(), tokens.len());
                assert_eq!(real, self.model_append(s, tokens));
            }
            Op::Fork { seq } if live > 0 && live < 6 => {
                let s = seq % live;
                let child = self.seqs[s].table.fork(self.kv.pool_mut()).unwrap();
                let shared = self.seqs[s].tokens.len().div_ceil(self.model.block_size);
                let blocks = self.seqs[s].blocks[..shared].to_vec();
                for &b in &blocks {
                    self.model_retaining(b);
                }
                let tokens = self.seqs[s].tokens.clone();
                let extra = self.seqs[s].extra;
                self.seqs.push(Seq {
                    table: child,
                    tokens,
                    extra,
                    blocks,
                    reservation: None,
                });
            }
            Op::Truncate { seq, to } if live > 0 => {
                let s = seq % live;
                let new_len = to % (self.seqs[s].tokens.len() + 1);
                let real = self.seqs[s].table.truncate(self.kv.pool_mut(), new_len);
                self.model_commit(s);
                let keep = new_len.div_ceil(self.model.block_size);
                let mut released = 0;
                while self.seqs[s].blocks.len() > keep {
                    let b = self.seqs[s].blocks.pop().unwrap();
                    self.model_released(b);
                    released += 1;
                }
                self.seqs[s].tokens.truncate(new_len);
                assert_eq!(real, Ok(released));
            }
            Op::Insert { seq } if live > 0 => {
                let s = seq % live;
                let real = self.kv.insert(
                    &self.seqs[s].tokens,
                    self.seqs[s].table.blocks(),
                    self.seqs[s].extra,
                );
                assert_eq!(real, Ok(self.model_insert(s)));
            }
            Op::Finish { seq, cache } if live > 0 => self.finish(seq % live, *cache),
            Op::Reserve { seq } if live > 0 => {
                let s = seq % live;
                let real = self.seqs[s].table.reserve_next(self.kv.pool_mut());
                assert_eq!(real, self.model_reserve(s));
            }
            Op::Rollback { seq } if live > 0 => {
                let s = seq % live;
                let real = self.seqs[s].table.rollback(self.kv.pool_mut());
                assert_eq!(real, self.model_rollback(s));
            }
            Op::ReserveRollback { seq, overrun } if live > 0 => {
                let s = seq % live;
                // Start from no pending reservation, so that only this one is undone.
                self.seqs[s].table.commit_reservation(self.kv.pool_mut());
                self.model_commit(s);
                let snapshot = |kv: &KvCache| {
                    let pool = kv.pool();
                    let ids = (0..pool.num_blocks() as u32).map(BlockId);
                    let counts: Vec<u32> = ids.clone().map(|b| pool.ref_count(b)).collect();
                    let states: Vec<_> = ids.map(|b| pool.state(b)).collect();
                    (
                        counts,
                        states,
                        pool.free_blocks(),
                        pool.counters().evictions,
                    )
                };
                let before = snapshot(&self.kv);
                let table = (
                    self.seqs[s].table.len(),
                    self.seqs[s].table.blocks().to_vec(),
                );
                let real = self.seqs[s].table.reserve_next(self.kv.pool_mut());
                assert_eq!(real, self.model_reserve(s));
                if real.is_err() {
                    return;
                }
                let over = vec![0; *overrun];
                let real = self.seqs[s].table.append(self.kv.pool_mut(), over.len());
                assert_eq!(real, self.model_append(s, &over));
                let real = self.seqs[s].table.rollback(self.kv.pool_mut());
                assert_eq!(real, self.model_rollback(s));
                let after = snapshot(&self.kv);
                let now = (
                    self.seqs[s].table.len(),
                    self.seqs[s].table.blocks().to_vec(),
                );
                assert_eq!(now, table, "reserve + rollback changed the table");
                assert_eq!(self.seqs[s].table.reservation(), None);
                assert_eq!(
                    after.0, before.0,
                    "reserve + rollback changed reference counts"
                );
                if after.3 == before.3 {
                    assert_eq!(after.1, before.1, "reserve + rollback changed block states");
                    assert_eq!(
                        after.2, before.2,
                        "reserve + rollback changed the free list"
                    );
                }
            }
            Op::OutsideAlloc => {
                let real = self.kv.pool_mut().allocate();
                if self.model.available() == 0 {
                    assert_eq!(real, Err(Exhausted { needed: 1, free: 0 }));
                } else {
                    let expected = self.model_allocate();
                    assert_eq!(real, Ok(BlockId(expected)));
                    self.outside.push(expected);
                }
            }
            Op::OutsideRetain { block } => {
                let b = (*block % self.model.num_blocks) as u32;
                let real = self.kv.pool_mut().retain(BlockId(b));
                if self.holders(b) == 0 && !self.model.registry.contains_key(&b) {
                    assert_eq!(real, Err(KvError::RetainFree { block: BlockId(b) }));
                } else {
                    assert_eq!(real, Ok(()));
                    self.model_retaining(b);
                    self.outside.push(b);
                }
            }
            Op::OutsideRelease { pick } if !self.outside.is_empty() => {
                let b = self.outside.swap_remove(pick % self.outside.len());
                self.kv.pool_mut().release(BlockId(b)).unwrap();
                self.model_released(b);
            }
            Op::BadRelease { block } => {
                let unheld: Vec<u32> = (0..self.model.num_blocks as u32)
                    .filter(|&b| self.holders(b) == 0)
                    .collect();
                if !unheld.is_empty() {
                    let b = unheld[block % unheld.len()];
                    assert_eq!(
                        self.kv.pool_mut().release(BlockId(b)),
                        Err(KvError::NotHeld { block: BlockId(b) })
                    );
                }
            }
            Op::Clear => {
                self.kv.clear();
                let pinned = self.pinned(None);
                let lru = std::mem::take(&mut self.model.lru);
                self.model.free.extend(lru);
                // Registered blocks without holders that only a held descendant pinned are
                // freed too, by id.
                let mut pinned_only: Vec<u32> = self
                    .model
                    .registry
                    .keys()
                    .copied()
                    .filter(|&b| self.holders(b) == 0 && pinned.contains(&b))
                    .collect();
                pinned_only.sort_unstable();
                self.model.free.extend(pinned_only);
                self.model.registry.clear();
                self.model.by_key.clear();
            }
            // An operation on a sequence when none is live.
            _ => {}
        }
    }

    fn finish(&mut self, s: usize, cache: bool) {
        if cache {
            let real = self.kv.insert(
                &self.seqs[s].tokens,
                self.seqs[s].table.blocks(),
                self.seqs[s].extra,
            );
            assert_eq!(real, Ok(self.model_insert(s)));
        }
        let real = self.seqs[s].table.release_all(self.kv.pool_mut());
        let expected = self.seqs[s].blocks.len();
        self.model_release_all(s);
        assert_eq!(real, expected);
        let done = self.seqs.swap_remove(s);
        self.history.push(done.tokens);
    }

    fn check(&mut self) {
        let pool = self.kv.pool();
        pool.check_consistency().unwrap();
        let total = pool.num_blocks();
        assert_eq!(
            pool.free_blocks() + pool.cached_blocks() + pool.used_blocks(),
            total
        );
        assert_eq!(
            (pool.free_blocks(), pool.cached_blocks()),
            (self.model.free.len(), self.model.lru.len())
        );
        let pinned = self.pinned(None);
        for b in 0..total as u32 {
            let holders = self.holders(b);
            assert_eq!(
                pool.ref_count(BlockId(b)) as usize,
                holders,
                "ref count of block {b}"
            );
            let registered = self.model.registry.get(&b);
            let expected = match (pinned.contains(&b), registered.is_some()) {
                (false, false) => BlockState::Free,
                (false, true) => BlockState::CachedEvictable,
                (true, false) => BlockState::Owned,
                (true, true) => BlockState::CachedHeld,
            };
            assert_eq!(pool.state(BlockId(b)), Some(expected), "state of block {b}");
            if let Some((prefix, extra)) = registered {
                let cached = pool.cached(BlockId(b)).unwrap();
                assert_eq!(
                    cached.tokens,
                    &prefix[prefix.len() - self.model.block_size..]
                );
                assert_eq!(cached.extra, *extra);
            }
        }
        for seq in &self.seqs {
            assert_eq!(seq.table.len(), seq.tokens.len());
            let blocks: Vec<u32> = seq.table.blocks().iter().map(|b| b.0).collect();
            assert_eq!(blocks, seq.blocks);
            let distinct: HashSet<u32> = blocks.iter().copied().collect();
            assert_eq!(distinct.len(), blocks.len(), "a table holds a block twice");
        }
        for event in self.events.try_iter() {
            match event {
                CacheEvent::BlockStored { hash, .. } => {
                    assert!(self.stored_keys.insert(hash), "key {hash} stored twice");
                }
                CacheEvent::BlockRemoved { hash } => {
                    assert!(
                        self.stored_keys.remove(&hash),
                        "key {hash} removed but not stored"
                    );
                }
                CacheEvent::AllCleared => self.stored_keys.clear(),
            }
        }
        assert_eq!(self.stored_keys.len(), pool.registered_blocks());
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 192, ..ProptestConfig::default() })]

    #[test]
    fn cache_matches_the_naive_model(
        num_blocks in 4usize..14,
        block_size in 1usize..4,
        wide in any::<bool>(),
        ops in prop::collection::vec(op(), 1..80),
    ) {
        let kind = if wide { HashKind::Xxh3x128 } else { HashKind::Xxh3x64 };
        let mut harness = Harness::new(num_blocks, block_size, kind);
        for op in &ops {
            harness.apply(op);
            harness.check();
        }
        // Releasing everything returns every block.
        while !harness.seqs.is_empty() {
            harness.finish(0, true);
            harness.check();
        }
        for b in std::mem::take(&mut harness.outside) {
            harness.kv.pool_mut().release(BlockId(b)).unwrap();
        }
        let pool = harness.kv.pool();
        prop_assert_eq!(pool.used_blocks(), 0);
        prop_assert_eq!(pool.free_blocks() + pool.cached_blocks(), num_blocks);
    }
}
