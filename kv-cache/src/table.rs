//! Per-sequence block tables and the run-ahead ledger that lives in them.
//!
//! # Fields and invariants
//!
//! - `blocks`: the blocks holding the sequence's positions; position `p` lives in
//!   `blocks[p / block_size]` at row `p % block_size`. The table holds exactly one reference on
//!   each entry, and no block appears twice in one table.
//! - `len`: the tokens written. `blocks.len() >= ceil(len / block_size)`; entries past that are
//!   capacity a reservation (or an append) made for positions not written yet.
//! - `reservation`: the ledger entry of the latest `reserve_next` not yet committed or rolled
//!   back: the length and block count before it, and, when it had to copy a shared block, the
//!   original block, on which the ledger keeps the table's former reference until the
//!   reservation is committed (so a rollback can put it back even if every other holder left).
//!
//! # Copy-on-write
//!
//! A table writes a block only when it is the block's single holder and the block is not cached
//! (`fork` shares every block, including a partial last one; a truncation can leave a cached
//! block as a partial tail). The first write into any other block allocates a fresh block,
//! reports a [`BlockCopy`] (the router copies the rows already written), and drops the table's
//! reference on the shared one. So a fork costs no copy until a branch diverges, and a cached
//! block's contents never change under its key.
//!
//! # The run-ahead ledger
//!
//! `reserve_next` makes the block for position `len` exist and be writable, and records what it
//! did; `rollback` undoes exactly that (and any tokens or blocks appended since): reserve then
//! rollback leaves every reference count, the free list and the table as they were. The one thing
//! it cannot give back is a cached block the reservation had to evict, since the over-run may
//! have written into it: that block comes back free instead of cached. The entry is committed
//! (forgotten) by the next `reserve_next`, by `truncate`, by `commit_reservation` and by
//! `release_all`.
//!
//! A table belongs to one pool; every method takes that pool. Dropping a table without
//! `release_all` leaks its references (the blocks stay used).

use crate::{BlockId, BlockPool, Exhausted, KvError, PrefixMatch};

/// Copy the first `rows` rows (token positions) of block `src` into block `dst` before writing
/// into `dst`: the router's half of a copy-on-write.
///
/// Perform it before the next pool operation: after an `append` the table no longer holds `src`
/// (its contents stay intact until `src` is allocated again, which takes another allocation);
/// after a `reserve_next` the ledger holds `src` until the reservation is committed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockCopy {
    /// The shared block.
    pub src: BlockId,
    /// The table's fresh block.
    pub dst: BlockId,
    /// Rows to copy: the positions of that block the sequence had already written.
    pub rows: usize,
}

/// What [`BlockTable::append`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Appended {
    /// Blocks allocated (fresh tail blocks plus copy-on-write replacements).
    pub added: usize,
    /// The copy the router must perform before writing, if the first block written was shared.
    pub copy: Option<BlockCopy>,
}

/// The ledger entry of a pending reservation; see the [module docs](self).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reservation {
    len: usize,
    blocks_before: usize,
    added: usize,
    /// The shared block the reservation copied away from, with the ledger's reference on it.
    replaced: Option<BlockId>,
    copy: Option<BlockCopy>,
}

impl Reservation {
    /// The table's length when the reservation was made.
    pub fn len_before(&self) -> usize {
        self.len
    }

    /// Blocks the reservation allocated (0 or 1).
    pub fn added(&self) -> usize {
        self.added
    }

    /// The copy the router must perform before writing position `len_before()`, if the block there was
    /// shared and the reservation replaced it.
    pub fn copy(&self) -> Option<BlockCopy> {
        self.copy
    }
}

/// One sequence's blocks; see the [module docs](self).
/// Not `Clone`: a copy would hold the same references without counting them; use
/// [`fork`](Self::fork).
#[derive(Debug, PartialEq, Eq, Default)]
pub struct BlockTable {
    blocks: Vec<BlockId>,
    len: usize,
    reservation: Option<Reservation>,
}

impl BlockTable {
    /// An empty table.
    pub fn new() -> Self {
        Self::default()
    }

    /// A table starting with a prefix match; the match's references become the table's.
    pub fn from_prefix(prefix: PrefixMatch) -> Self {
        Self {
            blocks: prefix.blocks,
            len: prefix.tokens,
            reservation: None,
        }
    }

    /// The blocks, in position order (including reserved capacity past `len`).
    pub fn blocks(&self) -> &[BlockId] {
        &self.blocks
    }

    /// Tokens written.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no token is written.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The pending reservation, if any.
    pub fn reservation(&self) -> Option<&Reservation> {
        self.reservation.as_ref()
    }

    /// The block and row of position `pos`, if the table has a block there.
    pub fn slot_of(&self, pos: usize, block_size: usize) -> Option<(BlockId, usize)> {
        let block = *self.blocks.get(pos / block_size.max(1))?;
        Some((block, pos % block_size.max(1)))
    }

    /// Adds `count` tokens at the end: allocates a block whenever a position crosses into a block
    /// the table does not have, and copies a shared block before its first write. All or nothing:
    /// on [`Exhausted`] nothing changed.
    pub fn append(&mut self, pool: &mut BlockPool, count: usize) -> Result<Appended, KvError> {
        if count == 0 {
            return Ok(Appended::default());
        }
        let block_size = pool.block_size();
        let new_len = self.len.checked_add(count).ok_or(KvError::LengthOverflow {
            len: self.len,
            added: count,
        })?;
        let first = self.len / block_size;
        let end = new_len.div_ceil(block_size);
        let existing_end = end.min(self.blocks.len());
        let mut needed = end.saturating_sub(self.blocks.len());
        for &id in &self.blocks[first.min(existing_end)..existing_end] {
            if !pool.is_exclusive(id) {
                needed += 1;
            }
        }
        pool.ensure_available(needed)?;

        for _ in self.blocks.len()..end {
            let fresh = pool.allocate()?;
            self.blocks.push(fresh);
        }
        // Replace shared blocks last to first, each allocation before its release: the block
        // whose rows must be copied (`first`) is released after every allocation of this call,
        // so none of them can reuse it before the router has copied it.
        let mut copy = None;
        for index in (first..existing_end).rev() {
            let old = self.blocks[index];
            if pool.is_exclusive(old) {
                continue;
            }
            let fresh = pool.allocate()?;
            self.blocks[index] = fresh;
            release_held(pool, old);
            let rows = if index == first {
                self.len % block_size
            } else {
                0
            };
            if rows > 0 {
                copy = Some(BlockCopy {
                    src: old,
                    dst: fresh,
                    rows,
                });
            }
        }
        self.len = new_len;
        Ok(Appended {
            added: needed,
            copy,
        })
    }

    /// Shortens the table to `new_len` tokens (rejected speculative tokens, a rewind) and
    /// releases the blocks no longer needed, last first. Commits a pending reservation.
    pub fn truncate(&mut self, pool: &mut BlockPool, new_len: usize) -> Result<usize, KvError> {
        if new_len > self.len {
            return Err(KvError::TruncateBeyondLength {
                requested: new_len,
                len: self.len,
            });
        }
        self.commit_reservation(pool);
        let keep = new_len.div_ceil(pool.block_size());
        let released = self.blocks.len().saturating_sub(keep);
        while self.blocks.len() > keep {
            if let Some(id) = self.blocks.pop() {
                release_held(pool, id);
            }
        }
        self.len = new_len;
        Ok(released)
    }

    /// A second table for the same sequence (n > 1 sampling, beam search): it shares every block
    /// covering `len` tokens, including a partial last block, which whichever table writes it
    /// first copies. Reserved capacity past `len` is not shared; neither is the reservation.
    pub fn fork(&self, pool: &mut BlockPool) -> Result<BlockTable, KvError> {
        let shared = &self.blocks[..self.len.div_ceil(pool.block_size()).min(self.blocks.len())];
        for (done, &id) in shared.iter().enumerate() {
            if let Err(error) = pool.retain(id) {
                for &taken in &shared[..done] {
                    release_held(pool, taken);
                }
                return Err(error);
            }
        }
        Ok(BlockTable {
            blocks: shared.to_vec(),
            len: self.len,
            reservation: None,
        })
    }

    /// Makes sure the block for position `len()` exists and is writable; returns how many blocks
    /// that allocated (0 when it was already there). The ledger remembers what it did, for
    /// [`rollback`](Self::rollback); a copy the router must make is in
    /// [`reservation()`](Self::reservation)`.copy()`. Commits the previous reservation. On
    /// [`Exhausted`] nothing changed.
    pub fn reserve_next(&mut self, pool: &mut BlockPool) -> Result<usize, Exhausted> {
        let block_size = pool.block_size();
        let index = self.len / block_size;
        let current = self.blocks.get(index).copied();
        let needs_block = match current {
            Some(id) => !pool.is_exclusive(id),
            None => true,
        };
        if needs_block {
            pool.ensure_available(1)?;
        }
        self.commit_reservation(pool);
        let mut reservation = Reservation {
            len: self.len,
            blocks_before: self.blocks.len(),
            added: 0,
            replaced: None,
            copy: None,
        };
        if needs_block {
            let fresh = pool.allocate()?;
            reservation.added = 1;
            match current {
                Some(old) => {
                    // The table's reference on `old` moves to the ledger.
                    self.blocks[index] = fresh;
                    reservation.replaced = Some(old);
                    let rows = self.len % block_size;
                    if rows > 0 {
                        reservation.copy = Some(BlockCopy {
                            src: old,
                            dst: fresh,
                            rows,
                        });
                    }
                }
                None => self.blocks.push(fresh),
            }
        }
        self.reservation = Some(reservation);
        Ok(reservation.added)
    }

    /// Undoes the pending reservation: restores the length and the block list it found (so any
    /// tokens appended since are dropped), puts back a block it copied away from, and releases
    /// what it and later appends allocated. Returns how many blocks were released.
    pub fn rollback(&mut self, pool: &mut BlockPool) -> Result<usize, KvError> {
        let reservation = self.reservation.take().ok_or(KvError::NoReservation)?;
        let mut released = 0;
        if let Some(old) = reservation.replaced {
            let index = reservation.len / pool.block_size();
            if let Some(slot) = self.blocks.get_mut(index) {
                let fresh = std::mem::replace(slot, old);
                release_held(pool, fresh);
                released += 1;
            }
        }
        while self.blocks.len() > reservation.blocks_before {
            if let Some(id) = self.blocks.pop() {
                release_held(pool, id);
                released += 1;
            }
        }
        self.len = reservation.len;
        Ok(released)
    }

    /// Forgets the pending reservation, keeping what it allocated; drops the ledger's reference
    /// on a block it copied away from.
    pub fn commit_reservation(&mut self, pool: &mut BlockPool) {
        if let Some(Reservation {
            replaced: Some(old),
            ..
        }) = self.reservation.take()
        {
            release_held(pool, old);
        }
    }

    /// Releases every block (last first, so the sequence's chain tail is evicted before its
    /// head) and the ledger's references; the table is empty afterwards. Returns the blocks
    /// released.
    pub fn release_all(&mut self, pool: &mut BlockPool) -> usize {
        self.commit_reservation(pool);
        let released = self.blocks.len();
        while let Some(id) = self.blocks.pop() {
            release_held(pool, id);
        }
        self.len = 0;
        released
    }
}

/// Releases a reference this crate's bookkeeping says is held. Failure means an outside caller
/// released a table's reference behind its back; it is logged, since the table cannot repair it.
fn release_held(pool: &mut BlockPool, id: BlockId) {
    if let Err(error) = pool.release(id) {
        tracing::error!(block = id.0, %error, "a block table's reference was already gone");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{BlockState, ExtraKey, KvCache, KvCacheConfig};

    const B: usize = 4;

    fn pool(num_blocks: usize) -> BlockPool {
        BlockPool::new(num_blocks, B).unwrap()
    }

    fn ids(raw: &[u32]) -> Vec<BlockId> {
        raw.iter().map(|&i| BlockId(i)).collect()
    }

    /// What a table says about itself, for before/after comparisons.
    fn view(t: &BlockTable) -> (usize, Vec<BlockId>, Option<Reservation>) {
        (t.len(), t.blocks().to_vec(), t.reservation().copied())
    }

    /// Ref counts of every block, for identity checks.
    fn ref_counts(pool: &BlockPool) -> Vec<u32> {
        (0..pool.num_blocks() as u32)
            .map(|i| pool.ref_count(BlockId(i)))
            .collect()
    }

    #[test]
    fn append_allocates_at_block_boundaries() {
        let mut p = pool(4);
        let mut t = BlockTable::new();
        let check = |t: &mut BlockTable, p: &mut BlockPool, count, added, len, blocks: &[u32]| {
            assert_eq!(t.append(p, count), Ok(Appended { added, copy: None }));
            assert_eq!((t.len(), t.blocks()), (len, &ids(blocks)[..]));
        };
        check(&mut t, &mut p, 0, 0, 0, &[]);
        check(&mut t, &mut p, 3, 1, 3, &[0]);
        check(&mut t, &mut p, 1, 0, 4, &[0]);
        check(&mut t, &mut p, 1, 1, 5, &[0, 1]);
        check(&mut t, &mut p, 8, 2, 13, &[0, 1, 2, 3]);
        assert_eq!(t.slot_of(9, B), Some((BlockId(2), 1)));
        assert_eq!(t.slot_of(16, B), None);
        assert!(!t.is_empty());
        p.check_consistency().unwrap();
    }

    #[test]
    fn append_exhausted_changes_nothing() {
        let mut p = pool(2);
        let mut t = BlockTable::new();
        t.append(&mut p, 5).unwrap();
        let before = view(&t);
        assert_eq!(
            t.append(&mut p, 8),
            Err(KvError::Exhausted(Exhausted { needed: 2, free: 0 }))
        );
        assert_eq!(view(&t), before);
        assert_eq!(
            t.append(&mut p, usize::MAX),
            Err(KvError::LengthOverflow {
                len: 5,
                added: usize::MAX
            })
        );
        assert_eq!(p.used_blocks(), 2);
    }

    #[test]
    fn truncate_releases_unneeded_blocks_last_first() {
        let mut p = pool(4);
        let mut t = BlockTable::new();
        t.append(&mut p, 12).unwrap();
        assert_eq!(
            t.truncate(&mut p, 13),
            Err(KvError::TruncateBeyondLength {
                requested: 13,
                len: 12
            })
        );
        assert_eq!(t.truncate(&mut p, 5), Ok(1));
        assert_eq!((t.len(), t.blocks()), (5, &ids(&[0, 1])[..]));
        assert_eq!(t.truncate(&mut p, 0), Ok(2));
        assert_eq!(p.free_blocks(), 4);
        // Released last first, so the free list hands out block 0 again first.
        assert_eq!(p.allocate(), Ok(BlockId(0)));
    }

    #[test]
    fn fork_shares_and_copies_the_partial_block_on_write() {
        let mut p = pool(6);
        let mut parent = BlockTable::new();
        parent.append(&mut p, 6).unwrap(); // blocks 0 (full), 1 (2 rows)
        let mut child = parent.fork(&mut p).unwrap();
        assert_eq!(child.blocks(), parent.blocks());
        assert_eq!((p.ref_count(BlockId(0)), p.ref_count(BlockId(1))), (2, 2));

        let copy = BlockCopy {
            src: BlockId(1),
            dst: BlockId(2),
            rows: 2,
        };
        assert_eq!(
            child.append(&mut p, 1),
            Ok(Appended {
                added: 1,
                copy: Some(copy)
            })
        );
        assert_eq!(child.blocks(), &ids(&[0, 2])[..]);
        assert_eq!(p.ref_count(BlockId(1)), 1);
        // The parent is now the only holder of block 1 and writes it in place.
        assert_eq!(
            parent.append(&mut p, 1),
            Ok(Appended {
                added: 0,
                copy: None
            })
        );
        assert_eq!(parent.blocks(), &ids(&[0, 1])[..]);

        parent.release_all(&mut p);
        child.release_all(&mut p);
        assert_eq!(p.free_blocks(), 6);
        p.check_consistency().unwrap();
    }

    #[test]
    fn fork_at_a_block_boundary_needs_no_copy() {
        let mut p = pool(4);
        let mut parent = BlockTable::new();
        parent.append(&mut p, 4).unwrap();
        let mut child = parent.fork(&mut p).unwrap();
        assert_eq!(
            child.append(&mut p, 1),
            Ok(Appended {
                added: 1,
                copy: None
            })
        );
        assert_eq!(child.blocks(), &ids(&[0, 1])[..]);
        assert_eq!(p.ref_count(BlockId(0)), 2);
    }

    #[test]
    fn fork_does_not_share_reserved_capacity() {
        let mut p = pool(4);
        let mut parent = BlockTable::new();
        parent.append(&mut p, 4).unwrap();
        assert_eq!(parent.reserve_next(&mut p), Ok(1));
        let child = parent.fork(&mut p).unwrap();
        assert_eq!(
            (child.blocks(), child.reservation()),
            (&ids(&[0])[..], None)
        );
        assert_eq!(p.ref_count(BlockId(1)), 1);
    }

    #[test]
    fn fork_error_takes_back_its_references() {
        let mut p = pool(3);
        let mut t = BlockTable::new();
        t.append(&mut p, 8).unwrap();
        // Make the second block unretainable by releasing the table's reference behind its back.
        p.release(BlockId(1)).unwrap();
        assert_eq!(
            t.fork(&mut p),
            Err(KvError::RetainFree { block: BlockId(1) })
        );
        assert_eq!(p.ref_count(BlockId(0)), 1);
    }

    #[test]
    fn writing_into_a_truncated_cached_block_copies_it() {
        let mut kv = KvCache::new(KvCacheConfig {
            seed: Some(3),
            ..KvCacheConfig::new(4, B)
        })
        .unwrap();
        let toks: Vec<u32> = (0..8).collect();
        let mut t = BlockTable::new();
        t.append(kv.pool_mut(), 8).unwrap();
        kv.insert(&toks, t.blocks(), ExtraKey::NONE).unwrap();
        t.truncate(kv.pool_mut(), 6).unwrap();
        let copy = BlockCopy {
            src: BlockId(1),
            dst: BlockId(2),
            rows: 2,
        };
        assert_eq!(
            t.append(kv.pool_mut(), 1),
            Ok(Appended {
                added: 1,
                copy: Some(copy)
            })
        );
        assert_eq!(
            kv.pool().state(BlockId(1)),
            Some(BlockState::CachedEvictable)
        );
        t.release_all(kv.pool_mut());
        let m = kv.match_prefix(&toks, ExtraKey::NONE);
        assert_eq!(m.blocks, ids(&[0, 1]), "the cached block kept its contents");
    }

    #[test]
    fn reserve_next_adds_a_block_only_at_a_boundary() {
        let mut p = pool(4);
        let mut t = BlockTable::new();
        assert_eq!(t.reserve_next(&mut p), Ok(1));
        assert_eq!((t.len(), t.blocks()), (0, &ids(&[0])[..]));
        t.append(&mut p, 3).unwrap();
        assert_eq!(t.reserve_next(&mut p), Ok(0));
        assert_eq!(
            t.reservation()
                .map(|r| (r.len_before(), r.added(), r.copy())),
            Some((3, 0, None))
        );
        t.append(&mut p, 1).unwrap();
        assert_eq!(t.reserve_next(&mut p), Ok(1));
        assert_eq!(
            t.append(&mut p, 1),
            Ok(Appended {
                added: 0,
                copy: None
            })
        );
        assert_eq!(t.blocks(), &ids(&[0, 1])[..]);
    }

    #[test]
    fn reserve_then_rollback_is_the_identity() {
        let mut p = pool(5);
        let mut t = BlockTable::new();
        t.append(&mut p, 8).unwrap();
        let (before_table, before_counts, before_free) =
            (view(&t), ref_counts(&p), p.free_blocks());
        assert_eq!(t.reserve_next(&mut p), Ok(1));
        assert_eq!(t.rollback(&mut p), Ok(1));
        assert_eq!(
            (view(&t), ref_counts(&p), p.free_blocks()),
            (before_table.clone(), before_counts.clone(), before_free)
        );

        // With the over-run written, even across a further block boundary.
        t.reserve_next(&mut p).unwrap();
        t.append(&mut p, 5).unwrap();
        assert_eq!(t.rollback(&mut p), Ok(2));
        assert_eq!(
            (view(&t), ref_counts(&p), p.free_blocks()),
            (before_table, before_counts, before_free)
        );
        assert_eq!(
            p.allocate(),
            Ok(BlockId(2)),
            "the free list order is restored too"
        );
        assert_eq!(t.rollback(&mut p), Err(KvError::NoReservation));
    }

    #[test]
    fn reserve_copies_a_shared_block_and_rollback_restores_it() {
        let mut p = pool(4);
        let mut parent = BlockTable::new();
        parent.append(&mut p, 6).unwrap();
        let mut child = parent.fork(&mut p).unwrap();
        let counts = ref_counts(&p);

        assert_eq!(child.reserve_next(&mut p), Ok(1));
        let copy = BlockCopy {
            src: BlockId(1),
            dst: BlockId(2),
            rows: 2,
        };
        assert_eq!(child.reservation().and_then(Reservation::copy), Some(copy));
        assert_eq!(child.blocks(), &ids(&[0, 2])[..]);
        // The ledger keeps the child's old reference, so the parent leaving cannot free block 1.
        assert_eq!(p.ref_count(BlockId(1)), 2);
        child.append(&mut p, 1).unwrap();
        assert_eq!(child.rollback(&mut p), Ok(1));
        assert_eq!((child.blocks(), child.len()), (&ids(&[0, 1])[..], 6));
        assert_eq!(ref_counts(&p), counts);

        // Committed instead: the ledger's reference goes.
        child.reserve_next(&mut p).unwrap();
        child.commit_reservation(&mut p);
        assert_eq!((p.ref_count(BlockId(1)), p.ref_count(BlockId(2))), (1, 1));
        assert_eq!(child.reservation(), None);
    }

    #[test]
    fn reserve_exhausted_keeps_the_previous_reservation() {
        let mut p = pool(2);
        let mut t = BlockTable::new();
        t.append(&mut p, 4).unwrap();
        t.reserve_next(&mut p).unwrap();
        t.append(&mut p, 4).unwrap();
        let before = view(&t);
        assert_eq!(
            t.reserve_next(&mut p),
            Err(Exhausted { needed: 1, free: 0 })
        );
        assert_eq!(view(&t), before);
        assert_eq!(t.rollback(&mut p), Ok(1));
        assert_eq!((t.len(), p.free_blocks()), (4, 1));
    }

    #[test]
    fn truncate_and_release_all_commit_the_reservation() {
        let mut p = pool(4);
        let mut t = BlockTable::new();
        t.append(&mut p, 4).unwrap();
        t.reserve_next(&mut p).unwrap();
        t.append(&mut p, 1).unwrap();
        assert_eq!(t.truncate(&mut p, 4), Ok(1));
        assert_eq!(t.rollback(&mut p), Err(KvError::NoReservation));
        t.reserve_next(&mut p).unwrap();
        assert_eq!(t.release_all(&mut p), 2);
        assert_eq!((t.len(), t.blocks(), t.reservation()), (0, &[][..], None));
        assert_eq!(p.free_blocks(), 4);
    }

    #[test]
    fn from_prefix_takes_over_the_match() {
        let t = BlockTable::from_prefix(PrefixMatch {
            blocks: ids(&[3, 1]),
            tokens: 8,
        });
        assert_eq!((t.len(), t.blocks()), (8, &ids(&[3, 1])[..]));
    }
}
