//! The checkpoint slot pool: ids of the SSM checkpoint slots that the router's prefix-cache memory
//! region holds. The store hands a slot out (`Reserved`) for the router to copy a sequence's SSM
//! state into, attaches it to a tree node (`Cached`) when the checkpoint is admitted, and takes it
//! back (`Free`) on eviction or when the checkpoint is dropped.
//!
//! Invariants: every slot is in exactly one state; `free` lists exactly the `Free` slots, each
//! once; `reserved` and `cached` count the slots in those states.

use crate::error::SnapshotError;

/// The index of one checkpoint slot in the router's checkpoint region.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct SlotId(pub u32);

impl SlotId {
    /// The slot's index as a `usize`, for addressing a router's arrays.
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

/// What a slot currently holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SlotState {
    /// Unused.
    Free,
    /// Handed to the router to write a checkpoint into; not yet in the tree.
    Reserved,
    /// Holds a checkpoint the tree references.
    Cached,
}

impl SlotState {
    fn name(self) -> &'static str {
        match self {
            SlotState::Free => "free",
            SlotState::Reserved => "reserved",
            SlotState::Cached => "cached",
        }
    }
}

/// A fixed pool of checkpoint slot ids.
#[derive(Debug, Clone)]
pub struct SlotPool {
    states: Vec<SlotState>,
    free: Vec<SlotId>,
    reserved: u32,
    cached: u32,
}

impl SlotPool {
    /// A pool of `slots` free slots, ids `0..slots`. Low ids are handed out first.
    pub fn new(slots: u32) -> Self {
        Self {
            states: vec![SlotState::Free; slots as usize],
            free: (0..slots).rev().map(SlotId).collect(),
            reserved: 0,
            cached: 0,
        }
    }

    /// Number of slots in the pool.
    pub fn len(&self) -> u32 {
        self.states.len() as u32
    }

    /// Whether the pool has no slots at all.
    pub fn is_empty(&self) -> bool {
        self.states.is_empty()
    }

    /// Free slots.
    pub fn free_count(&self) -> u32 {
        self.free.len() as u32
    }

    /// Reserved slots.
    pub fn reserved_count(&self) -> u32 {
        self.reserved
    }

    /// Slots holding cached checkpoints.
    pub fn cached_count(&self) -> u32 {
        self.cached
    }

    /// The state of `slot`, or an error when it is outside the pool.
    pub fn state(&self, slot: SlotId) -> Result<SlotState, SnapshotError> {
        self.states
            .get(slot.index())
            .copied()
            .ok_or(SnapshotError::SlotOutOfRange {
                slot,
                slots: self.len(),
            })
    }

    /// Takes a free slot and marks it reserved.
    pub(crate) fn reserve(&mut self) -> Option<SlotId> {
        let slot = self.free.pop()?;
        self.states[slot.index()] = SlotState::Reserved;
        self.reserved += 1;
        Some(slot)
    }

    /// Checks that `slot` is reserved.
    pub(crate) fn check_reserved(&self, slot: SlotId) -> Result<(), SnapshotError> {
        match self.state(slot)? {
            SlotState::Reserved => Ok(()),
            other => Err(SnapshotError::SlotNotReserved {
                slot,
                state: other.name(),
            }),
        }
    }

    /// Reserved -> cached. The caller checked the state.
    pub(crate) fn cache(&mut self, slot: SlotId) {
        debug_assert_eq!(self.states[slot.index()], SlotState::Reserved);
        self.states[slot.index()] = SlotState::Cached;
        self.reserved -= 1;
        self.cached += 1;
    }

    /// Reserved or cached -> free. The caller checked the state.
    pub(crate) fn free(&mut self, slot: SlotId) {
        match self.states[slot.index()] {
            SlotState::Reserved => self.reserved -= 1,
            SlotState::Cached => self.cached -= 1,
            SlotState::Free => {
                debug_assert!(false, "slot {slot:?} freed twice");
                return;
            }
        }
        self.states[slot.index()] = SlotState::Free;
        self.free.push(slot);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_move_through_their_states() {
        let mut pool = SlotPool::new(2);
        let a = pool.reserve().unwrap();
        let b = pool.reserve().unwrap();
        assert_eq!((a, b), (SlotId(0), SlotId(1)));
        assert_eq!(pool.reserve(), None);
        pool.cache(a);
        assert_eq!(
            (
                pool.free_count(),
                pool.reserved_count(),
                pool.cached_count()
            ),
            (0, 1, 1)
        );
        assert_eq!(
            pool.check_reserved(a).unwrap_err(),
            SnapshotError::SlotNotReserved {
                slot: a,
                state: "cached"
            }
        );
        assert_eq!(
            pool.check_reserved(SlotId(7)).unwrap_err(),
            SnapshotError::SlotOutOfRange {
                slot: SlotId(7),
                slots: 2
            }
        );
        pool.free(a);
        pool.free(b);
        assert_eq!(
            (
                pool.free_count(),
                pool.reserved_count(),
                pool.cached_count()
            ),
            (2, 0, 0)
        );
        assert_eq!(pool.state(b).unwrap(), SlotState::Free);
    }
}
