//! Effects: the bookkeeping a router does on device memory between steps, and what each answers.

use std::fmt;

/// One piece of bookkeeping on device memory between steps, applied with
/// [`DeviceIo::apply`](crate::DeviceIo::apply).
///
/// `S` is the router's per-sequence bookkeeping ([`DeviceIo::Seq`](crate::DeviceIo::Seq)) and `P`
/// its logits handle ([`DeviceIo::Ptr`](crate::DeviceIo::Ptr)).
pub enum Effect<'a, S, P> {
    /// Release a sequence's device resources: optionally offer its KV (and, on a hybrid model, its
    /// end-of-sequence SSM checkpoint) to the prefix cache, free it, then tell the EP worker.
    ///
    /// With `cache: true` the router registers the sequence's full blocks with the prefix cache
    /// *before* freeing them, while their ids are valid. A sequence that failed is released with
    /// `cache: false` and is never cached. `what` says why (`"finish"`, `"cancel"`, `"preempt"`,
    /// `"fault"`) and appears in traces.
    ReleaseSeq {
        /// The sequence to release; afterwards it holds no blocks and no slot.
        seq: &'a mut S,
        /// Whether to offer its KV to the prefix cache first.
        cache: bool,
        /// Why it is released.
        what: &'static str,
    },
    /// Move a live sequence's state (Mamba conv and SSM state, MTP hidden) to slot `target`,
    /// which must be free; the core keeps live sequences in slots `0..n` this way.
    CompactSlot {
        /// The sequence to move.
        seq: &'a mut S,
        /// The free slot it moves to.
        target: usize,
    },
    /// Disown the sequence's slot: it has been handed to another sequence, so no later release of
    /// this one may free it twice.
    ///
    /// Afterwards the sequence owns no slot, and the slot is no longer counted as this
    /// sequence's: a router returns it to its free slots with its contents untouched (so the
    /// sequence it was handed to can adopt it, e.g. through admission or `CompactSlot`), and
    /// `ReleaseSeq` of the detached sequence releases its blocks only.
    DetachSlot {
        /// The sequence that stops owning its slot.
        seq: &'a mut S,
    },
    /// Spill: write a versioned, self-describing image of the sequence (its KV blocks and live
    /// state, and on a model with an MTP head the head's position and catch-up ring, so a
    /// restored sequence drafts at its next step) to `writer`. The sequence itself is
    /// unchanged; the core usually releases it next.
    SaveSequenceState {
        /// The sequence to spill.
        seq: &'a S,
        /// Where the image goes.
        writer: &'a mut dyn std::io::Write,
    },
    /// The inverse of [`Effect::SaveSequenceState`]: read an image into fresh blocks and a free
    /// slot of `seq` (which must hold none). A truncated, corrupt or foreign image is refused with
    /// [`DeviceError::BadImage`](crate::DeviceError::BadImage) and changes nothing. A router reads
    /// the image versions its format names (an older image without the MTP head's section
    /// restores a sequence that drafts again once it kept a new hidden state).
    RestoreSequenceState {
        /// The sequence that receives the image; it must hold no blocks and no slot.
        seq: &'a mut S,
        /// Where the image comes from.
        reader: &'a mut dyn std::io::Read,
    },
    /// Copy the first `rows` rows of a step's logits from the device to the host (valid until
    /// `max_depth()` newer steps have been launched; see [`StepResult::logits`](crate::StepResult::logits)); answers
    /// [`EffectOutcome::HostLogits`] with the element width written to `into`.
    ReadLogits {
        /// The step's logits handle ([`StepResult::logits`](crate::StepResult::logits)).
        logits: P,
        /// How many rows to copy.
        rows: usize,
        /// The bytes, replaced (not appended to).
        into: &'a mut Vec<u8>,
    },
    /// Checkpoint the sequence's live SSM state at its last block boundary into the prefix cache's
    /// checkpoint region, when the store's policy admits it (the sequence says so with
    /// [`Sequence::checkpoint_due`](crate::Sequence::checkpoint_due)). After a `Verify` whose kept
    /// positions carried the sequence past a boundary (not up to one), the state at that
    /// boundary is the snapshot the `Verify` wrote there, and a router that keeps it checkpoints
    /// from it, as a decode step at the boundary would have.
    MarconiCheckpoint {
        /// The sequence whose state is checkpointed.
        seq: &'a mut S,
    },
    /// Save the sequence's live SSM state into snapshot ring slot `slot` (e.g. before speculative
    /// tokens, to roll back after a rejection).
    SsmSnapshotSave {
        /// The sequence whose state is saved.
        seq: &'a S,
        /// The ring slot.
        slot: usize,
    },
    /// Restore the sequence's live SSM state from snapshot ring slot `slot`, which must hold a
    /// snapshot of this sequence (saved by `SsmSnapshotSave` or written by a `Verify`). It
    /// restores the SSM state only, never positions or K/V ([`Effect::TruncateKv`] drops those);
    /// a state past the sequence's length (after a truncation) is in step again once the snapshot
    /// restored was taken at exactly its length.
    SsmSnapshotRestore {
        /// The sequence whose state is restored.
        seq: &'a mut S,
        /// The ring slot.
        slot: usize,
    },
    /// Keep the hidden state of batch row `row` of the latest settled step at position `pos` in
    /// that row's sequence's MTP catch-up ring, so the MTP head can catch up with (and draft after)
    /// the positions the main model computed since it last ran: the core applies it for each
    /// position a sequence keeps after a `Decode`, `DecodeFed` or `Verify` (a `Prefill` keeps its
    /// own). A position the ring already holds, or the head has consumed, is not saved again; a
    /// ring that is full forgets its oldest position (the head then skips it: a sequence that has
    /// not drafted for a while drafts from a partial catch-up, never a wrong token).
    SaveHiddenCatchup {
        /// The batch row of the last step.
        row: usize,
        /// The sequence position of that row.
        pos: usize,
    },
    /// The secondary (MTP) state catches up with the primary (main model's): for every live
    /// sequence the MTP head runs over the positions of its catch-up ring whose next token the
    /// router knows (all but the sequence's latest position), ordered after every step launched
    /// before it, as a drafter's stream waits for the target's. Afterwards each ring holds at most
    /// the latest position, which the next `Draft` consumes with the token after it. A router
    /// without an MTP head has nothing to catch up.
    SyncSecondary,
    /// Stop the expert-parallel workers (part of teardown).
    EpShutdown,
    /// Wait until stream `stream` has no work left.
    Quiesce {
        /// The stream to drain.
        stream: u64,
    },
    /// Opens a run-ahead of the sequence: makes sure the KV block for its next position (its
    /// `computed_len`) exists, and records that position and the blocks it added in the
    /// sequence's *reservation ledger*. The next launched step that computes that position is the
    /// run-ahead [`Effect::Rollback`] undoes.
    ///
    /// Answers [`EffectOutcome::Reserved`] with the blocks it added (0 when the block was already
    /// there), or [`EffectOutcome::Exhausted`] when the pool is dry (nothing changed, the ledger
    /// keeps what it had). A new reservation replaces the sequence's earlier ledger entry, which
    /// becomes permanent: at depth 2 the core reserves for step t+1 only for a row whose step-t
    /// position it will keep, so at most the latest run-ahead can ever be undone.
    /// [`Effect::ReleaseSeq`] closes the ledger entry (what the run-ahead computed counts as the
    /// sequence's own then). Any router may support it; a router that reserves nothing answers
    /// `Reserved { blocks: 0 }` only when the block exists.
    ReserveKv {
        /// The sequence to reserve for.
        seq: &'a mut S,
    },
    /// Undoes the sequence's latest reservation exactly, because the core discards what the
    /// run-ahead computed (the row had stopped, or was cancelled, before the host read it):
    ///
    /// - the reserved position, if a launched step computed it, is dropped: the sequence's
    ///   `computed_len` goes back to it, its KV there is forgotten, and no later prefix-cache
    ///   insert of the sequence covers it;
    /// - a Marconi checkpoint taken at or after that position is discarded, and the one it
    ///   replaced (if any) is the sequence's again, so no checkpoint remembers the over-run token;
    /// - the blocks the reservation added return to the pool;
    /// - the ledger entry is removed.
    ///
    /// Mamba state cannot step back: after a rollback that dropped a position, the live state is
    /// past the sequence's length, so the router refuses to decode, spill or checkpoint the
    /// sequence again ([`DeviceError::Invalid`](crate::DeviceError::Invalid)); the core releases
    /// it. The rollback is ordered after the step that computed the position (it need not have
    /// been awaited).
    ///
    /// A sequence with no ledger entry (never reserved, already rolled back, or released since)
    /// is [`DeviceError::Invalid`](crate::DeviceError::Invalid) and nothing changes. A router
    /// with `max_depth() == 1` answers [`DeviceError::Unsupported`](crate::DeviceError::Unsupported).
    Rollback {
        /// The sequence whose latest reservation is undone.
        seq: &'a mut S,
    },
    /// Speculative decoding: keeps the sequence's first `len` positions of its latest
    /// reservation (a `Verify`'s accepted positions) and drops the rest: `computed_len` becomes
    /// `len`, the K/V past it is forgotten (no prefix-cache insert ever covers it), the blocks the
    /// reservation added that lie wholly past `len` return to the pool, a Marconi checkpoint past
    /// `len` is discarded (the one it replaced is the sequence's again), the MTP catch-up ring
    /// forgets positions past `len`, so does the snapshot ring (the snapshots of rejected
    /// positions), and the ledger entry closes. `len` must lie in
    /// `reserved position..=computed_len` ([`DeviceError::Invalid`](crate::DeviceError::Invalid)
    /// otherwise, nothing changed); `len == computed_len` only closes the entry.
    ///
    /// The SSM state is not touched: after dropping positions it is past `len` until an
    /// [`Effect::SsmSnapshotRestore`] of the snapshot taken at `len`; in between the router
    /// refuses to compute, spill or checkpoint the sequence.
    TruncateKv {
        /// The sequence to truncate.
        seq: &'a mut S,
        /// The positions it keeps.
        len: usize,
    },
}

impl<S, P> Effect<'_, S, P> {
    /// The variant's name, as in traces and error messages.
    pub fn name(&self) -> &'static str {
        match self {
            Effect::ReleaseSeq { .. } => "ReleaseSeq",
            Effect::CompactSlot { .. } => "CompactSlot",
            Effect::DetachSlot { .. } => "DetachSlot",
            Effect::SaveSequenceState { .. } => "SaveSequenceState",
            Effect::RestoreSequenceState { .. } => "RestoreSequenceState",
            Effect::ReadLogits { .. } => "ReadLogits",
            Effect::MarconiCheckpoint { .. } => "MarconiCheckpoint",
            Effect::SsmSnapshotSave { .. } => "SsmSnapshotSave",
            Effect::SsmSnapshotRestore { .. } => "SsmSnapshotRestore",
            Effect::SaveHiddenCatchup { .. } => "SaveHiddenCatchup",
            Effect::SyncSecondary => "SyncSecondary",
            Effect::EpShutdown => "EpShutdown",
            Effect::Quiesce { .. } => "Quiesce",
            Effect::ReserveKv { .. } => "ReserveKv",
            Effect::Rollback { .. } => "Rollback",
            Effect::TruncateKv { .. } => "TruncateKv",
        }
    }
}

impl<S, P> fmt::Debug for Effect<'_, S, P> {
    // The payloads (sequences, writers) need not be `Debug`; the label says everything a log needs.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&crate::Label::label(self))
    }
}

/// What an applied effect answers.
#[derive(Debug, PartialEq, Eq)]
pub enum EffectOutcome {
    /// Done; nothing to report.
    Unit,
    /// `ReadLogits` wrote host logits of `elem_bytes` bytes per element.
    HostLogits {
        /// Bytes per element (4 for f32).
        elem_bytes: usize,
    },
    /// `ReserveKv` made sure the next block exists and opened a ledger entry, adding `blocks`
    /// blocks (0 when it was there).
    Reserved {
        /// How many blocks the reservation added.
        blocks: usize,
    },
    /// `ReserveKv` found the pool dry; nothing changed.
    Exhausted,
}
