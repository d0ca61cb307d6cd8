//! The effects' bookkeeping, shared by every router: which slot and which blocks a sequence
//! holds, what a release offers to the prefix cache, the reservation ledger of `ReserveKv` and
//! `Rollback`, the snapshot ring's owners, and the checks, header and encoding of a spill image.
//!
//! A router keeps its tables in the shape [`BookMut`] borrows and calls these functions for the
//! bookkeeping of each effect; the device work (copying state rows, exporting and importing KV
//! and state) stays the router's. Each function validates first and changes nothing when it
//! refuses; where device work sits between validation and commit (`CompactSlot`,
//! `MarconiCheckpoint`, the ring), the router's row copy is passed in as a closure, queued in
//! the router's stream order, and a failed copy leaves the tables as they were.
//!
//! State rows: live slot `i` is row `i`; checkpoint slot `c` is row `max_seqs + c`; ring slot `r`
//! is row `max_seqs + checkpoint_slots + r` ([`BookShape::checkpoint_row`],
//! [`BookShape::ring_row`]).

use std::collections::{BTreeMap, BTreeSet};
use std::io::Read;

use device_io::{DeviceError, EffectOutcome, Result};

use crate::image::{self, Image, ImageHeader, Layout};
use crate::seq::{new_tenure, Reservation};
use crate::spec::{mtp_section, MtpTrack};
use crate::{Caches, CheckpointSlot, LoraBinding, Namespace, RouterSeq};

/// The token a fed position holds until the step that produced it has finished.
pub const FED_PLACEHOLDER: u32 = u32::MAX;

/// Who owns a live-state slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotOwner {
    /// The owner's tenure.
    pub tenure: u64,
}

/// A sequence's tenure: from its first prefill (or restore) to its release.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tenure {
    /// The sequence's id (for teardown's report).
    pub seq_id: u64,
    /// The LoRA adapter the sequence is bound to (its id).
    pub adapter: Option<u32>,
}

/// What a snapshot ring slot holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RingEntry {
    /// The tenure whose state it is.
    pub tenure: u64,
    /// The sequence's computed length when it was saved.
    pub pos: usize,
    /// Written by a `Verify`: the main model's Mamba layers only.
    pub main_only: bool,
}

/// A fed position whose token the host has not resolved yet: the token is the argmax of `row`
/// of step `ticket`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PendingFeed {
    /// The sequence position.
    pub pos: usize,
    /// The step that computes its token.
    pub ticket: u64,
    /// That step's row.
    pub row: usize,
}

/// The fixed sizes the bookkeeping checks against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BookShape {
    /// Tokens per KV block.
    pub block_size: usize,
    /// Live-state slots.
    pub max_seqs: usize,
    /// Checkpoint slots of the Marconi region.
    pub checkpoint_slots: usize,
    /// Snapshot ring slots.
    pub snapshot_slots: usize,
    /// The longest sequence.
    pub max_context: usize,
    /// The router's pipeline depth (rollback needs 2).
    pub max_depth: usize,
    /// Whether the model has Mamba layers (a truncation then leaves the state ahead).
    pub hybrid: bool,
    /// Whether the router reruns the MTP head at a prefix hit (`router_book::spec`'s rule):
    /// it stores the main model's hidden state before each checkpoint it takes, and a hit on a
    /// checkpoint so marked ([`crate::HeadMark`]) copies the hit's blocks the head rewrites and
    /// names the rerun in its first prefill run. A head with Mamba layers needs `head_lags` too.
    pub head_rerun: bool,
    /// Whether the MTP head has Mamba layers: a checkpoint holds the head's state, so a prefill
    /// run ending at a checkpoint the head marks stops the head one position short (the
    /// checkpoint then holds its state before `L - 1`, which a rerun computes) and the row's
    /// next run leads with that position (`PrefillRun::lag`); at a checkpoint where the row's
    /// prefill plan ends its head state is past `L - 1`, so the mark names the row's token at
    /// `L` instead of a rerun (`crate::HeadMark::next`).
    pub head_lags: bool,
    /// What a spill image must match.
    pub layout: Layout,
}

impl BookShape {
    /// The state row of checkpoint slot `slot`.
    pub fn checkpoint_row(&self, slot: usize) -> usize {
        self.max_seqs + slot
    }

    /// The state row of ring slot `slot`.
    pub fn ring_row(&self, slot: usize) -> usize {
        self.max_seqs + self.checkpoint_slots + slot
    }
}

/// The router's tables, borrowed together.
///
/// Invariants (the router keeps them; these functions preserve them):
/// - `slots[i]` is `Some(owner)` exactly when a sequence with tenure `owner.tenure` holds live
///   slot `i`, and that tenure is in `tenures`.
/// - `pending` holds, per tenure, the fed positions whose step has not finished; when it does,
///   they move to `resolved` (or, when it failed, the tenure goes to `failed`) until the
///   sequence is next seen ([`sync`]), which copies them into it.
#[derive(Debug)]
pub struct BookMut<'a> {
    /// The block pool and the prefix index.
    pub cache: &'a mut Caches,
    /// Live-state slot owners.
    pub slots: &'a mut Vec<Option<SlotOwner>>,
    /// Every tenure holding resources.
    pub tenures: &'a mut BTreeMap<u64, Tenure>,
    /// Snapshot ring owners.
    pub ring: &'a mut Vec<Option<RingEntry>>,
    /// Fed positions of unfinished steps, per tenure.
    pub pending: &'a mut BTreeMap<u64, Vec<PendingFeed>>,
    /// Fed tokens resolved since the sequence was last seen, per tenure.
    pub resolved: &'a mut BTreeMap<u64, Vec<(usize, u32)>>,
    /// Tenures a failed step was a row of, until the sequence is next seen.
    pub failed: &'a mut BTreeSet<u64>,
    /// The ticket of the step being planned (the router's next one).
    pub step: u64,
    /// The latest ticket `await_result` handed over (steps settle in launch order).
    pub settled: Option<u64>,
}

/// A [`BookMut`] over the tables of a router's state `$state` (a place whose fields are named as
/// `BookMut`'s, with `next_step` and `settled` copied as `step` and `settled`), borrowed field by field, so the caller may borrow the state's other fields (a
/// router's own: feed cells, catch-up rings, executors) at the same time.
#[macro_export]
macro_rules! book_mut {
    ($state:expr) => {
        $crate::BookMut {
            cache: &mut $state.cache,
            slots: &mut $state.slots,
            tenures: &mut $state.tenures,
            ring: &mut $state.ring,
            pending: &mut $state.pending,
            resolved: &mut $state.resolved,
            failed: &mut $state.failed,
            step: $state.next_step,
            settled: $state.settled,
        }
    };
}

/// What a spill image of a sequence holds, gathered before its device data is read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SavePlan {
    /// The live slot whose state goes in.
    pub slot: usize,
    /// The sequence-level fields.
    pub header: ImageHeader,
    /// The tokens, fed ones resolved.
    pub tokens: Vec<u32>,
    /// The blocks whose KV goes in, in position order.
    pub blocks: Vec<u32>,
}

fn invalid(what: &'static str, detail: String) -> DeviceError {
    DeviceError::Invalid { what, detail }
}

/// Brings a sequence up to date with what the device finished since it was last seen: resolved
/// fed tokens, and the failure of a step it was a row of.
pub fn sync(book: &mut BookMut<'_>, seq: &mut RouterSeq) {
    let Some(tenure) = seq.tenure else {
        return;
    };
    if let Some(resolved) = book.resolved.remove(&tenure) {
        for (pos, token) in resolved {
            if let Some(slot) = seq.tokens.get_mut(pos) {
                *slot = token;
            }
        }
    }
    if book.failed.contains(&tenure) {
        seq.failed = true;
    }
    // The branch checkpoint enters the tree once the step that wrote it settled, never after
    // it failed.
    if let Some((ticket, pos, slot)) = seq.branch_taken {
        if seq.failed {
            seq.branch_taken = None;
            book.cache.free_checkpoint_slot(slot);
        } else if book.settled.is_some_and(|settled| settled >= ticket) {
            seq.branch_taken = None;
            match &seq.pin {
                Some(pin) => book.cache.register_branch(pin, &seq.tokens[..pos], slot),
                None => book.cache.free_checkpoint_slot(slot),
            }
        }
    }
}

/// Forgets everything kept about a tenure that ended.
pub fn forget(book: &mut BookMut<'_>, tenure: u64) {
    book.pending.remove(&tenure);
    book.resolved.remove(&tenure);
    book.failed.remove(&tenure);
}

/// Refuses a sequence whose resources belong to another router.
pub fn check_tenure(
    tenures: &BTreeMap<u64, Tenure>,
    seq: &RouterSeq,
    what: &'static str,
) -> Result<()> {
    match seq.tenure {
        Some(tenure) if !tenures.contains_key(&tenure) => Err(invalid(
            what,
            format!("sequence {} holds resources of another router", seq.id),
        )),
        _ => Ok(()),
    }
}

/// The live slot the sequence owns, or `Invalid` naming `what`.
pub fn owned_slot(book: &BookMut<'_>, seq: &RouterSeq, what: &'static str) -> Result<usize> {
    match (seq.slot, seq.tenure) {
        (Some(slot), Some(tenure)) if book.slots.get(slot) == Some(&Some(SlotOwner { tenure })) => {
            Ok(slot)
        }
        _ => Err(invalid(
            what,
            format!("sequence {} holds no live slot", seq.id),
        )),
    }
}

/// `ReleaseSeq`: offers the sequence to the prefix cache (when asked, and when it did not fail),
/// then frees its blocks, its slot, its pinned path, its ring entries and its pending
/// checkpoints. Releasing a sequence that holds nothing does nothing. `head_exact`: on a model
/// with an MTP head, how many positions from the first the sequence's head consumed exactly
/// (`crate::spec::MtpTrack::exact`), which the cache records with the blocks it adopts.
pub fn release(
    shape: &BookShape,
    book: &mut BookMut<'_>,
    seq: &mut RouterSeq,
    cache: bool,
    what: &'static str,
    head_exact: Option<usize>,
) -> Result<()> {
    let Some(tenure) = seq.tenure else {
        return Ok(());
    };
    check_tenure(book.tenures, seq, "ReleaseSeq")?;
    seq.tenure = None;
    tracing::debug!(seq = seq.id, cache, what, "release");
    // A fed position whose step has not finished holds no known token: never cache it.
    let known = book
        .pending
        .get(&tenure)
        .and_then(|pending| pending.iter().map(|p| p.pos).min())
        .unwrap_or(seq.computed_len)
        .min(seq.computed_len);
    let full_blocks = known / shape.block_size;
    if let Some(superseded) = seq.reservation.take().and_then(|r| r.superseded) {
        book.cache.free_checkpoint_slot(superseded.1);
    }
    // A branch checkpoint whose step has not settled (or failed) is never registered.
    if let Some((_, _, slot)) = seq.branch_taken.take() {
        book.cache.free_checkpoint_slot(slot);
    }
    seq.state_ahead = false;
    let checkpoints: Vec<_> = [seq.input_checkpoint.take(), seq.output_checkpoint.take()]
        .into_iter()
        .flatten()
        .filter(|&(pos, slot)| {
            // A checkpoint past the known tokens cannot be keyed; it is freed.
            pos <= known || {
                book.cache.free_checkpoint_slot(slot);
                false
            }
        })
        .collect();
    if cache && !seq.failed {
        // Register while the block ids are still valid (this sequence holds them). The
        // checkpoints sit at block boundaries at or below `computed_len`, inside the full blocks.
        let full = full_blocks * shape.block_size;
        let looked_up = &seq.tokens[..seq.prompt_len.saturating_sub(1)];
        let head = head_exact.map(|exact| crate::HeadOffer {
            exact,
            next: seq
                .tokens
                .get(full)
                .copied()
                .filter(|&token| token != FED_PLACEHOLDER),
        });
        book.cache.insert_finished(
            seq.cache_namespace(),
            seq.pin.take(),
            looked_up,
            &seq.tokens[..full],
            &seq.blocks[..full_blocks],
            &checkpoints,
            head,
        );
    } else {
        for (_, slot) in checkpoints {
            book.cache.free_checkpoint_slot(slot);
        }
        if let Some(pin) = seq.pin.take() {
            book.cache.unpin(pin);
        }
    }
    for block in seq.blocks.drain(..) {
        book.cache.release(block);
    }
    if let Some(slot) = seq.slot.take() {
        if book.slots[slot] == Some(SlotOwner { tenure }) {
            book.slots[slot] = None;
        }
    }
    for entry in book.ring.iter_mut() {
        if entry.is_some_and(|e| e.tenure == tenure) {
            *entry = None;
        }
    }
    book.tenures.remove(&tenure);
    forget(book, tenure);
    seq.lora = None;
    seq.computed_len = 0;
    seq.tokens.truncate(seq.prompt_len);
    seq.branch_point = None;
    seq.checkpoint_due = false;
    // The state that may have been corrupt is gone; the sequence starts afresh if prefilled again.
    seq.failed = false;
    Ok(())
}

/// `CompactSlot`: moves the sequence to free live slot `target`; `copy(from, to)` queues the
/// device copy of the state row.
pub fn compact(
    shape: &BookShape,
    book: &mut BookMut<'_>,
    seq: &mut RouterSeq,
    target: usize,
    copy: &mut dyn FnMut(usize, usize) -> Result<()>,
) -> Result<EffectOutcome> {
    let from = owned_slot(book, seq, "CompactSlot")?;
    if target >= shape.max_seqs {
        return Err(invalid(
            "CompactSlot",
            format!(
                "target slot {target} is outside the {} live slots",
                shape.max_seqs
            ),
        ));
    }
    if target == from {
        return Ok(EffectOutcome::Unit);
    }
    if book.slots[target].is_some() {
        return Err(invalid(
            "CompactSlot",
            format!("target slot {target} is not free"),
        ));
    }
    copy(from, target)?;
    book.slots[target] = book.slots[from].take();
    seq.slot = Some(target);
    Ok(EffectOutcome::Unit)
}

/// `DetachSlot`: the slot stops belonging to this sequence and becomes free for the router to
/// hand out (a `CompactSlot` of another sequence may target it); its contents stay until then.
pub fn detach(book: &mut BookMut<'_>, seq: &mut RouterSeq) -> Result<EffectOutcome> {
    let slot = owned_slot(book, seq, "DetachSlot")?;
    book.slots[slot] = None;
    seq.slot = None;
    Ok(EffectOutcome::Unit)
}

/// `SaveSequenceState`, before the device data is read: the checks (a failed or rolled-back
/// sequence, or one with a fed token no finished step produced, has no image) and what the
/// image holds. Call it after waiting for the steps launched before, so that every fed token
/// that can be resolved is.
pub fn save_plan(shape: &BookShape, book: &BookMut<'_>, seq: &RouterSeq) -> Result<SavePlan> {
    let slot = owned_slot(book, seq, "SaveSequenceState")?;
    let tenure = seq.tenure.expect("owned_slot checked it");
    let failed = seq.failed || book.failed.contains(&tenure);
    if failed {
        return Err(invalid(
            "SaveSequenceState",
            format!("sequence {} failed; its state is unspecified", seq.id),
        ));
    }
    if seq.state_ahead {
        return Err(invalid(
            "SaveSequenceState",
            format!(
                "sequence {} was rolled back; its state is past its length",
                seq.id
            ),
        ));
    }
    // The sequence is borrowed shared here, so the fed tokens are read from what the router
    // resolved.
    let mut tokens = seq.tokens.clone();
    for &(pos, token) in book.resolved.get(&tenure).into_iter().flatten() {
        if let Some(slot) = tokens.get_mut(pos) {
            *slot = token;
        }
    }
    if tokens.contains(&FED_PLACEHOLDER) {
        return Err(invalid(
            "SaveSequenceState",
            format!(
                "sequence {} has a fed token no finished step produced",
                seq.id
            ),
        ));
    }
    let num_blocks = seq.computed_len.div_ceil(shape.block_size);
    let token_count = if seq.computed_len >= seq.prompt_len {
        seq.computed_len
    } else {
        seq.prompt_len
    };
    tokens.truncate(token_count);
    Ok(SavePlan {
        slot,
        header: ImageHeader {
            seq_id: seq.id,
            prompt_len: seq.prompt_len,
            computed_len: seq.computed_len,
            adapter: seq.namespace.adapter,
            cache_salt: seq.namespace.cache_salt,
        },
        tokens,
        blocks: seq.blocks[..num_blocks].to_vec(),
    })
}

/// `SaveSequenceState`, once the device data of `plan` is read (`kv`: its blocks' K/V in
/// position order; `state`: its slot's live state): the encoded image, to go to
/// [`write_image`]. On a model with an MTP head the head goes in too (its K/V and state are in
/// the blocks and the slot; `read` reads one hidden state of its catch-up ring, the router's way).
pub fn encode_image<H>(
    shape: &BookShape,
    plan: &SavePlan,
    seq: &RouterSeq,
    mtp: &BTreeMap<u64, MtpTrack<H>>,
    kv: &[f32],
    state: &[f32],
    read: impl FnMut(&H) -> Result<Vec<f32>>,
) -> Result<Vec<u8>> {
    let section = seq
        .tenure
        .and_then(|tenure| mtp.get(&tenure))
        .filter(|_| shape.layout.hidden_size > 0)
        .map(|track| mtp_section(track, seq.computed_len, read))
        .transpose()?;
    Ok(image::encode(
        &shape.layout,
        &plan.header,
        &plan.tokens,
        plan.blocks.len(),
        kv,
        state,
        section.as_ref(),
    ))
}

/// Writes an encoded image to `writer`; a failed write is `Failed` in phase `Effect`.
pub fn write_image(seq_id: u64, bytes: &[u8], writer: &mut dyn std::io::Write) -> Result<()> {
    writer
        .write_all(bytes)
        .and_then(|()| writer.flush())
        .map_err(|err| DeviceError::Failed {
            phase: device_io::Phase::Effect,
            message: format!("writing the image of sequence {seq_id}: {err}"),
        })
}

/// `ReadLogits` of a step whose logits the router does not hold (`held`: the steps whose
/// logits it holds, in the order to name them): `Invalid`, naming them.
pub fn logits_not_held(step: u64, held: &[u64]) -> DeviceError {
    let detail = if held.is_empty() {
        format!("the handle names step {step}, the router holds no logits")
    } else {
        let held: Vec<String> = held.iter().map(u64::to_string).collect();
        format!(
            "the handle names step {step}, the router holds the logits of step {}",
            held.join(" and ")
        )
    };
    invalid("ReadLogits", detail)
}

/// `ReadLogits` of `rows` rows of step `step`, of which the router holds `held_rows`: more
/// than it holds is `Invalid`.
pub fn check_logit_rows(step: u64, rows: usize, held_rows: usize) -> Result<()> {
    if rows > held_rows {
        return Err(invalid(
            "ReadLogits",
            format!("{rows} rows asked, step {step} has {held_rows}"),
        ));
    }
    Ok(())
}

/// `RestoreSequenceState`, before anything is reserved: the sequence must hold nothing here, and
/// the image (read up to the longest a sequence of `max_context` tokens needs) must decode
/// against this router's layout and be of this sequence.
pub fn read_image(
    shape: &BookShape,
    book: &BookMut<'_>,
    seq: &RouterSeq,
    reader: &mut dyn Read,
) -> Result<Image> {
    check_tenure(book.tenures, seq, "RestoreSequenceState")?;
    if seq.tenure.is_some() {
        return Err(invalid(
            "RestoreSequenceState",
            format!(
                "sequence {} still holds resources; release it first",
                seq.id
            ),
        ));
    }
    let limit = image::max_len(&shape.layout);
    let mut bytes = Vec::new();
    reader
        .take(limit + 1)
        .read_to_end(&mut bytes)
        .map_err(|err| DeviceError::BadImage(format!("reading failed: {err}")))?;
    if bytes.len() as u64 > limit {
        return Err(DeviceError::BadImage(format!(
            "the image is longer than {limit} bytes, the most a sequence of max_context {} \
             tokens needs",
            shape.max_context
        )));
    }
    let image = image::decode(&shape.layout, &bytes).map_err(DeviceError::BadImage)?;
    if image.header.seq_id != seq.id {
        return Err(DeviceError::BadImage(format!(
            "the image is of sequence {}, not {}",
            image.header.seq_id, seq.id
        )));
    }
    Ok(image)
}

/// Starts a tenure of `seq` in the free live slot `slot`: the tenure is registered (with
/// `adapter`, the sequence's adapter id), the slot is its, and the sequence computes with
/// `lora`, the router's binding of that adapter. A prefill's first chunk and a restore seat a
/// sequence; only a release ends its tenure.
pub(crate) fn seat(
    book: &mut BookMut<'_>,
    seq: &mut RouterSeq,
    slot: usize,
    adapter: Option<u32>,
    lora: Option<LoraBinding>,
) {
    let tenure = new_tenure();
    book.tenures.insert(
        tenure,
        Tenure {
            seq_id: seq.id,
            adapter,
        },
    );
    book.slots[slot] = Some(SlotOwner { tenure });
    seq.tenure = Some(tenure);
    seq.slot = Some(slot);
    seq.lora = lora;
}

/// `RestoreSequenceState`: a free live slot and fresh blocks for `image` (`SlotsExhausted` or
/// `KvExhausted`, with nothing taken, when there are none). The router writes the image's data
/// there, then calls [`restore_commit`], or [`restore_abort`] if that failed.
pub fn restore_reserve(
    shape: &BookShape,
    book: &mut BookMut<'_>,
    image: &Image,
) -> Result<(usize, Vec<u32>)> {
    let Some(slot) = book.slots.iter().position(Option::is_none) else {
        return Err(DeviceError::SlotsExhausted {
            total: shape.max_seqs,
        });
    };
    let available = book.cache.free_blocks() + book.cache.evictable_blocks();
    let mut blocks = Vec::with_capacity(image.num_blocks);
    for _ in 0..image.num_blocks {
        match book.cache.allocate() {
            Some(block) => blocks.push(block),
            None => {
                restore_abort(book, blocks);
                return Err(DeviceError::KvExhausted {
                    needed: image.num_blocks,
                    free: available,
                });
            }
        }
    }
    Ok((slot, blocks))
}

/// Gives back the blocks [`restore_reserve`] took.
pub fn restore_abort(book: &mut BookMut<'_>, blocks: Vec<u32>) {
    for block in blocks {
        book.cache.release(block);
    }
}

/// The sequence now holds `slot` and `blocks`, whose contents are the image's, and computes
/// with `lora`, the router's binding of the image's adapter.
pub fn restore_commit(
    book: &mut BookMut<'_>,
    seq: &mut RouterSeq,
    image: Image,
    slot: usize,
    blocks: Vec<u32>,
    lora: Option<LoraBinding>,
) {
    let header = image.header;
    seat(book, seq, slot, header.adapter, lora);
    seq.prompt_len = header.prompt_len;
    seq.computed_len = header.computed_len;
    seq.tokens = image.tokens;
    seq.blocks = blocks;
    seq.namespace = Namespace {
        adapter: header.adapter,
        cache_salt: header.cache_salt,
    };
    seq.pin = None;
    seq.branch_point = None;
    seq.branch_taken = None;
    seq.input_checkpoint = None;
    seq.output_checkpoint = None;
    seq.checkpoint_due = false;
    seq.failed = false;
    seq.reservation = None;
    seq.state_ahead = false;
}

fn refuse_rolled_back(seq: &RouterSeq, what: &'static str) -> Result<()> {
    if seq.state_ahead {
        return Err(invalid(
            what,
            format!(
                "sequence {} was rolled back; its state is past its length, release it",
                seq.id
            ),
        ));
    }
    Ok(())
}

/// A checkpoint slot for the sequence's live state now (evicting as the store decides), with the
/// state rows to copy (`from`, `to`); `None` when the store has no slot to give.
pub fn take_checkpoint(
    shape: &BookShape,
    book: &mut BookMut<'_>,
    seq: &RouterSeq,
) -> Option<(CheckpointSlot, usize, usize)> {
    let Some(checkpoint) = book.cache.take_checkpoint_slot(seq.pin.as_ref()) else {
        tracing::debug!(
            pos = seq.computed_len,
            "no checkpoint slot free; checkpoint skipped"
        );
        return None;
    };
    let slot = seq.slot.expect("a computing row has a slot");
    Some((checkpoint, slot, shape.checkpoint_row(checkpoint.index())))
}

/// The block boundary a `Verify` run carried the sequence past without a checkpoint: the latest
/// boundary before its length (not at it: that one is the live state's), when the snapshot ring
/// holds this sequence's state there, its output checkpoint is older, and no run-ahead is open
/// (its ledger would keep the checkpoint replaced). Every snapshot of a
/// sequence left in the ring is of a position it kept (`TruncateKv` forgets the others), so
/// that snapshot is the sequence's state at the boundary. Answers the boundary and the ring slot.
fn passed_boundary(
    shape: &BookShape,
    book: &BookMut<'_>,
    seq: &RouterSeq,
) -> Option<(usize, usize)> {
    let tenure = seq.tenure?;
    let boundary = seq.computed_len / shape.block_size * shape.block_size;
    if boundary == 0
        || boundary == seq.computed_len
        || !book.cache.wants_end_checkpoints()
        || seq.reservation.is_some()
        || seq
            .output_checkpoint
            .is_some_and(|(pos, _)| pos >= boundary)
    {
        return None;
    }
    let slot = book.ring.iter().position(|entry| {
        entry.is_some_and(|entry| entry.tenure == tenure && entry.pos == boundary)
    })?;
    Some((boundary, slot))
}

/// `MarconiCheckpoint`: when the sequence is due and sits at a block boundary, copies its live
/// state into a checkpoint slot (`copy(from, to)`) as its output checkpoint; inside a run-ahead
/// the checkpoint it replaces is kept in the ledger until the run-ahead is kept or rolled back.
/// A boundary a `Verify` run passed is taken only from a full snapshot (see
/// [`marconi_checkpoint_layered`] for a router that copies layers).
pub fn marconi_checkpoint(
    shape: &BookShape,
    book: &mut BookMut<'_>,
    seq: &mut RouterSeq,
    copy: &mut dyn FnMut(usize, usize) -> Result<()>,
) -> Result<EffectOutcome> {
    checkpoint(shape, book, seq, false, &mut |from, to, _| copy(from, to))
}

/// [`marconi_checkpoint`] for a router that can copy the main model's Mamba layers alone
/// (`copy(from, to, main_only)`): a block boundary that a `Verify` run carried the sequence past
/// (see `TruncateKv`) is checkpointed from the snapshot the run wrote for it (main layers only),
/// with the rest of the row (the MTP head's layers) from the live state.
pub fn marconi_checkpoint_layered(
    shape: &BookShape,
    book: &mut BookMut<'_>,
    seq: &mut RouterSeq,
    copy: &mut dyn FnMut(usize, usize, bool) -> Result<()>,
) -> Result<EffectOutcome> {
    checkpoint(shape, book, seq, true, copy)
}

fn checkpoint(
    shape: &BookShape,
    book: &mut BookMut<'_>,
    seq: &mut RouterSeq,
    layered: bool,
    copy: &mut dyn FnMut(usize, usize, bool) -> Result<()>,
) -> Result<EffectOutcome> {
    owned_slot(book, seq, "MarconiCheckpoint")?;
    refuse_rolled_back(seq, "MarconiCheckpoint")?;
    if !seq.checkpoint_due {
        // The policy did not ask for one (or the boundary has passed): nothing to take.
        return Ok(EffectOutcome::Unit);
    }
    seq.checkpoint_due = false;
    if let Some((boundary, ring)) = passed_boundary(shape, book, seq) {
        let main_only = book.ring[ring].is_some_and(|entry| entry.main_only);
        if main_only && !layered {
            return Ok(EffectOutcome::Unit);
        }
        let Some((taken, live, to)) = take_checkpoint(shape, book, seq) else {
            return Ok(EffectOutcome::Unit);
        };
        let from = shape.ring_row(ring);
        let copied = if main_only {
            copy(live, to, false).and_then(|()| copy(from, to, true))
        } else {
            copy(from, to, false)
        };
        if let Err(err) = copied {
            book.cache.free_checkpoint_slot(taken);
            return Err(err);
        }
        // No run-ahead is open here (`TruncateKv` closed it): the older checkpoint goes.
        if let Some((_, old)) = seq.output_checkpoint.replace((boundary, taken)) {
            book.cache.free_checkpoint_slot(old);
        }
        return Ok(EffectOutcome::Unit);
    }
    if seq.computed_len % shape.block_size == 0 && book.cache.wants_end_checkpoints() {
        let Some((taken, from, to)) = take_checkpoint(shape, book, seq) else {
            return Ok(EffectOutcome::Unit);
        };
        if let Err(err) = copy(from, to, false) {
            book.cache.free_checkpoint_slot(taken);
            return Err(err);
        }
        let old = seq.output_checkpoint.replace((seq.computed_len, taken));
        // Inside a run-ahead whose position is computed, the checkpoint it replaces is kept
        // until the run-ahead is kept (a rollback gives it back).
        match (&mut seq.reservation, old) {
            (Some(reservation), Some(old)) if seq.computed_len > reservation.at => {
                if let Some((_, older)) = reservation.superseded.replace(old) {
                    book.cache.free_checkpoint_slot(older);
                }
            }
            (_, Some((_, old))) => book.cache.free_checkpoint_slot(old),
            (_, None) => {}
        }
    }
    Ok(EffectOutcome::Unit)
}

fn ring_slot(shape: &BookShape, slot: usize, what: &'static str) -> Result<()> {
    if slot >= shape.snapshot_slots {
        return Err(invalid(
            what,
            format!(
                "ring slot {slot} is outside the {} snapshot slots",
                shape.snapshot_slots
            ),
        ));
    }
    Ok(())
}

/// `SsmSnapshotSave`: copies the live state into ring slot `slot` (`copy(from, to)`), which then
/// belongs to this sequence.
pub fn snapshot_save(
    shape: &BookShape,
    book: &mut BookMut<'_>,
    seq: &RouterSeq,
    slot: usize,
    copy: &mut dyn FnMut(usize, usize) -> Result<()>,
) -> Result<EffectOutcome> {
    ring_slot(shape, slot, "SsmSnapshotSave")?;
    let live = owned_slot(book, seq, "SsmSnapshotSave")?;
    refuse_rolled_back(seq, "SsmSnapshotSave")?;
    copy(live, shape.ring_row(slot))?;
    book.ring[slot] = Some(RingEntry {
        tenure: seq.tenure.expect("owned_slot checked it"),
        pos: seq.computed_len,
        main_only: false,
    });
    Ok(EffectOutcome::Unit)
}

/// `SsmSnapshotRestore`: restores the SSM state only (positions and KV are the caller's: the
/// speculative path truncates them); the ring slot must hold a snapshot of this very sequence.
/// `copy(from, to, main_only)` copies the row, or only the main model's Mamba layers for a
/// snapshot a `Verify` wrote (the MTP head's state is not part of a verification). Restoring the
/// snapshot taken at exactly the sequence's length after a truncation puts its state back in step.
pub fn snapshot_restore(
    shape: &BookShape,
    book: &mut BookMut<'_>,
    seq: &mut RouterSeq,
    slot: usize,
    copy: &mut dyn FnMut(usize, usize, bool) -> Result<()>,
) -> Result<EffectOutcome> {
    ring_slot(shape, slot, "SsmSnapshotRestore")?;
    let live = owned_slot(book, seq, "SsmSnapshotRestore")?;
    match book.ring[slot] {
        Some(entry) if Some(entry.tenure) == seq.tenure => {
            copy(shape.ring_row(slot), live, entry.main_only)?;
            if seq.state_ahead && entry.pos == seq.computed_len {
                seq.state_ahead = false;
                seq.checkpoint_due = (book.cache.wants_end_checkpoints()
                    && seq.computed_len % shape.block_size == 0
                    && seq
                        .reservation
                        .as_ref()
                        .is_none_or(|r| r.at < seq.computed_len))
                    || passed_boundary(shape, book, seq).is_some();
            }
            Ok(EffectOutcome::Unit)
        }
        Some(_) => Err(invalid(
            "SsmSnapshotRestore",
            format!("ring slot {slot} holds another sequence's snapshot"),
        )),
        None => Err(invalid(
            "SsmSnapshotRestore",
            format!("ring slot {slot} holds no snapshot"),
        )),
    }
}

/// `ReserveKv`: opens a ledger entry for the sequence's next position (committing the one
/// before), adding its block when it is not there.
pub fn reserve_kv(
    shape: &BookShape,
    book: &mut BookMut<'_>,
    seq: &mut RouterSeq,
) -> Result<EffectOutcome> {
    owned_slot(book, seq, "ReserveKv")?;
    refuse_rolled_back(seq, "ReserveKv")?;
    if seq.computed_len + 1 > shape.max_context {
        return Err(invalid(
            "ReserveKv",
            format!(
                "sequence {} would reach {} tokens, over max_context {}",
                seq.id,
                seq.computed_len + 1,
                shape.max_context
            ),
        ));
    }
    let block = if seq.blocks.len() * shape.block_size > seq.computed_len {
        None
    } else {
        match book.cache.allocate() {
            Some(block) => Some(block),
            None => return Ok(EffectOutcome::Exhausted),
        }
    };
    if let Some(superseded) = seq.reservation.take().and_then(|r| r.superseded) {
        book.cache.free_checkpoint_slot(superseded.1);
    }
    seq.blocks.extend(block);
    seq.reservation = Some(Reservation {
        at: seq.computed_len,
        blocks: block.into_iter().collect(),
        superseded: None,
    });
    Ok(EffectOutcome::Reserved {
        blocks: usize::from(block.is_some()),
    })
}

/// `Rollback`: undoes the sequence's latest reservation exactly (see `Effect::Rollback`).
/// Answers the reserved position: whatever the router keeps per position past it (an MTP
/// catch-up ring) is the router's to forget.
pub fn rollback(shape: &BookShape, book: &mut BookMut<'_>, seq: &mut RouterSeq) -> Result<usize> {
    if shape.max_depth < 2 {
        return Err(DeviceError::Unsupported { what: "Rollback" });
    }
    check_tenure(book.tenures, seq, "Rollback")?;
    let (Some(tenure), Some(reservation)) = (seq.tenure, seq.reservation.clone()) else {
        return Err(invalid(
            "Rollback",
            format!("sequence {} has no reservation to undo", seq.id),
        ));
    };
    seq.reservation = None;
    let at = reservation.at;
    if seq.computed_len > at {
        seq.computed_len = at;
        seq.tokens.truncate(at.max(seq.prompt_len));
        if let Some(pending) = book.pending.get_mut(&tenure) {
            pending.retain(|p| p.pos < at);
        }
        if let Some(resolved) = book.resolved.get_mut(&tenure) {
            resolved.retain(|&(pos, _)| pos < at);
        }
        seq.state_ahead = true;
        seq.checkpoint_due = false;
    }
    if seq.output_checkpoint.is_some_and(|(pos, _)| pos > at) {
        if let Some((_, slot)) = seq.output_checkpoint.take() {
            book.cache.free_checkpoint_slot(slot);
        }
        seq.output_checkpoint = reservation.superseded;
    } else if let Some((_, slot)) = reservation.superseded {
        book.cache.free_checkpoint_slot(slot);
    }
    for &block in reservation.blocks.iter().rev() {
        if let Some(index) = seq.blocks.iter().rposition(|&b| b == block) {
            seq.blocks.remove(index);
            book.cache.release(block);
        }
    }
    Ok(at)
}

/// `TruncateKv`: keeps the first `len` positions of the sequence's latest reservation (a
/// `Verify`'s accepted positions) and releases the rest through the ledger: the blocks it added
/// wholly past them return to the pool (once), a checkpoint past them is dropped (the one it
/// replaced comes back), and on a hybrid model the sequence is `state_ahead` until an
/// `SsmSnapshotRestore` at its length. Answers `len`: what the router keeps per position past
/// it is the router's to forget.
pub fn truncate_kv(
    shape: &BookShape,
    book: &mut BookMut<'_>,
    seq: &mut RouterSeq,
    len: usize,
) -> Result<usize> {
    check_tenure(book.tenures, seq, "TruncateKv")?;
    let (Some(tenure), Some(reservation)) = (seq.tenure, seq.reservation.as_ref()) else {
        return Err(invalid(
            "TruncateKv",
            format!("sequence {} has no reservation to truncate", seq.id),
        ));
    };
    let at = reservation.at;
    if len < at || len > seq.computed_len {
        return Err(invalid(
            "TruncateKv",
            format!(
                "sequence {} keeps {len} positions; its reservation covers {at}..={}",
                seq.id, seq.computed_len
            ),
        ));
    }
    let reservation = seq.reservation.take().expect("checked above");
    if len < seq.computed_len {
        seq.computed_len = len;
        seq.tokens.truncate(len.max(seq.prompt_len));
        if let Some(pending) = book.pending.get_mut(&tenure) {
            pending.retain(|p| p.pos < len);
        }
        if let Some(resolved) = book.resolved.get_mut(&tenure) {
            resolved.retain(|&(pos, _)| pos < len);
        }
        // Mamba state moved past `len`; an `SsmSnapshotRestore` at `len` puts it back in step.
        seq.state_ahead = shape.hybrid;
        seq.checkpoint_due = false;
    }
    // The snapshots past `len` are of rejected drafts: the ring forgets them, so a snapshot of
    // the sequence left there is always of a position it kept.
    for entry in book.ring.iter_mut() {
        if entry.is_some_and(|e| e.tenure == tenure && e.pos > len) {
            *entry = None;
        }
    }
    // A Marconi checkpoint past `len` is a rejected draft's: the one it replaced comes back.
    if seq.output_checkpoint.is_some_and(|(pos, _)| pos > len) {
        if let Some((_, slot)) = seq.output_checkpoint.take() {
            book.cache.free_checkpoint_slot(slot);
        }
        seq.output_checkpoint = reservation.superseded;
    } else if let Some((_, slot)) = reservation.superseded {
        book.cache.free_checkpoint_slot(slot);
    }
    // The blocks the reservation added that lie wholly past `len` go back to the pool, once.
    let keep = len.div_ceil(shape.block_size);
    for &block in reservation.blocks.iter().rev() {
        match seq.blocks.iter().rposition(|&b| b == block) {
            Some(index) if index >= keep => {
                seq.blocks.remove(index);
                book.cache.release(block);
            }
            _ => {}
        }
    }
    if !seq.state_ahead {
        // The boundary at `len`, from the live state, or the latest one the run passed, from
        // its snapshot (`MarconiCheckpoint` takes either).
        seq.checkpoint_due =
            (book.cache.wants_end_checkpoints() && len > at && len % shape.block_size == 0)
                || passed_boundary(shape, book, seq).is_some();
    }
    Ok(len)
}

/// The ids of the sequences still holding resources, for a teardown report.
pub fn holders(tenures: &BTreeMap<u64, Tenure>) -> Vec<String> {
    tenures.values().map(|t| t.seq_id.to_string()).collect()
}
