//! The host router's effects: each validates first and changes nothing when it refuses.
//!
//! Bookkeeping happens at once; device work (state copies) is queued behind the steps launched
//! before it, and an effect that reads device data (`SaveSequenceState`, `ReadLogits`) or writes
//! it from the host (`RestoreSequenceState`) first waits for that work (see [`crate::device`]).
//!
//! `ReserveKv` and `Rollback` keep the sequence's reservation ledger ([`crate::seq::Reservation`]):
//! the position reserved, the block added, and the output checkpoint a `MarconiCheckpoint` taken
//! past that position replaced, so a rollback restores exactly what the sequence had before.
//!
//! `TruncateKv` closes a `Verify`'s ledger entry keeping its accepted positions: the blocks it
//! added wholly past them return to the pool (once), a checkpoint past them is dropped, the MTP
//! catch-up ring forgets them; the sequence is then `state_ahead` (refused by every plan and by
//! spilling and checkpointing) until `SsmSnapshotRestore` of the snapshot at its length.
//!
//! `SaveHiddenCatchup` keeps a hidden state of the latest settled step in the sequence's MTP
//! catch-up ring (on a model with an MTP head; a no-op otherwise). `SyncSecondary` answers `Unit`:
//! the host runs the catch-up inside the next `Draft`, which is ordered after every step before
//! it, so the head's state is the same as if it had run at the effect. `Quiesce` is a no-op: one
//! host "stream", always drained. `EpShutdown` stops the expert-parallel workers (the router
//! handles it before this module, since the workers belong to the router, not to a sequence);
//! `ReleaseSeq` needs no message to them because they keep no per-sequence state.

use std::io::Read;

use std::sync::Mutex;

use device_io::{DeviceError, Effect, EffectOutcome, Result};
use model::Model;

use crate::device::{self, Device, Op};
use crate::image::{self, ImageHeader};
use crate::plans::{take_checkpoint, FED_PLACEHOLDER};
use crate::seq::Reservation;
use crate::{CpuSeq, Inner, LogitsHandle, Namespace, RingEntry, Shape, SlotOwner, Tenure};

fn invalid(what: &'static str, detail: String) -> DeviceError {
    DeviceError::Invalid { what, detail }
}

/// A model-memory error inside an effect that validated its ids: a router bug, reported as such.
fn effect_failed(err: model::ModelError) -> DeviceError {
    DeviceError::Failed {
        phase: device_io::Phase::Effect,
        message: err.to_string(),
    }
}

pub(crate) fn apply(
    model: &Model,
    shape: &Shape,
    inner: &mut Inner,
    device: &Mutex<Device>,
    effect: Effect<'_, CpuSeq, LogitsHandle>,
) -> Result<EffectOutcome> {
    let dev = Dev { model, device };
    match effect {
        Effect::ReleaseSeq { seq, cache, what } => {
            inner.sync(seq);
            release(shape, inner, seq, cache, what)?;
            Ok(EffectOutcome::Unit)
        }
        Effect::CompactSlot { seq, target } => {
            inner.sync(seq);
            compact(shape, inner, &dev, seq, target)
        }
        Effect::DetachSlot { seq } => {
            inner.sync(seq);
            detach(inner, seq)
        }
        Effect::SaveSequenceState { seq, writer } => save(shape, inner, &dev, seq, writer),
        Effect::RestoreSequenceState { seq, reader } => restore(shape, inner, &dev, seq, reader),
        Effect::ReadLogits { logits, rows, into } => read_logits(inner, &dev, logits, rows, into),
        Effect::MarconiCheckpoint { seq } => {
            inner.sync(seq);
            marconi_checkpoint(shape, inner, &dev, seq)
        }
        Effect::SsmSnapshotSave { seq, slot } => snapshot_save(shape, inner, &dev, seq, slot),
        Effect::SsmSnapshotRestore { seq, slot } => {
            inner.sync(seq);
            snapshot_restore(shape, inner, &dev, seq, slot)
        }
        Effect::ReserveKv { seq } => {
            inner.sync(seq);
            reserve_kv(shape, inner, seq)
        }
        Effect::Rollback { seq } => {
            inner.sync(seq);
            rollback(shape, inner, seq)
        }
        Effect::TruncateKv { seq, len } => {
            inner.sync(seq);
            truncate_kv(shape, inner, seq, len)
        }
        Effect::SaveHiddenCatchup { row, pos } => save_hidden(shape, inner, row, pos),
        // The catch-up runs inside the next `Draft`, one stream; `EpShutdown` never gets here
        // (see the module docs).
        Effect::SyncSecondary | Effect::EpShutdown | Effect::Quiesce { .. } => {
            Ok(EffectOutcome::Unit)
        }
    }
}

/// The device side an effect may queue work on or read from.
struct Dev<'a> {
    model: &'a Model,
    device: &'a Mutex<Device>,
}

impl Dev<'_> {
    fn copy(&self, inner: &mut Inner, from: usize, to: usize) -> Result<()> {
        inner.copies(self.model, self.device, vec![Op::CopySlot { from, to }])
    }

    /// Waits for every device work item submitted so far, then locks device memory.
    fn fenced<'d>(&'d self, inner: &mut Inner) -> Result<std::sync::MutexGuard<'d, Device>> {
        inner.fence(self.model, self.device)?;
        device::lock(self.device)
    }
}

/// Offers the sequence to the prefix cache (when asked, and when it did not fail), then frees its
/// blocks, its slot, its pinned path and its pending checkpoint. Releasing a sequence that holds
/// nothing does nothing.
fn release(
    shape: &Shape,
    inner: &mut Inner,
    seq: &mut CpuSeq,
    cache: bool,
    what: &'static str,
) -> Result<()> {
    let Some(tenure) = seq.tenure else {
        return Ok(());
    };
    check_tenure(inner, seq, "ReleaseSeq")?;
    seq.tenure = None;
    tracing::debug!(seq = seq.id, cache, what, "release");
    // A fed position whose step has not finished holds no known token: never cache it.
    let known = inner
        .pending
        .get(&tenure)
        .and_then(|pending| pending.iter().map(|p| p.pos).min())
        .unwrap_or(seq.computed_len)
        .min(seq.computed_len);
    let full_blocks = known / shape.block_size;
    if let Some(superseded) = seq.reservation.take().and_then(|r| r.superseded) {
        inner.cache.free_checkpoint_slot(superseded.1);
    }
    seq.state_ahead = false;
    let checkpoints: Vec<_> = [seq.input_checkpoint.take(), seq.output_checkpoint.take()]
        .into_iter()
        .flatten()
        .filter(|&(pos, slot)| {
            // A checkpoint past the known tokens cannot be keyed; it is freed.
            pos <= known || {
                inner.cache.free_checkpoint_slot(slot);
                false
            }
        })
        .collect();
    if cache && !seq.failed {
        // Register while the block ids are still valid (this sequence holds them). The
        // checkpoints sit at block boundaries at or below `computed_len`, inside the full blocks.
        let full = full_blocks * shape.block_size;
        let looked_up = &seq.tokens[..seq.prompt_len.saturating_sub(1)];
        inner.cache.insert_finished(
            seq.cache_namespace(),
            seq.pin.take(),
            looked_up,
            &seq.tokens[..full],
            &seq.blocks[..full_blocks],
            &checkpoints,
        );
    } else {
        for (_, slot) in checkpoints {
            inner.cache.free_checkpoint_slot(slot);
        }
        if let Some(pin) = seq.pin.take() {
            inner.cache.unpin(pin);
        }
    }
    for block in seq.blocks.drain(..) {
        inner.cache.release(block);
    }
    if let Some(slot) = seq.slot.take() {
        if inner.slots[slot] == Some(SlotOwner { tenure }) {
            inner.slots[slot] = None;
        }
    }
    for entry in inner.ring.iter_mut() {
        if entry.is_some_and(|e| e.tenure == tenure) {
            *entry = None;
        }
    }
    inner.tenures.remove(&tenure);
    inner.forget(tenure);
    seq.lora = None;
    seq.computed_len = 0;
    seq.tokens.truncate(seq.prompt_len);
    seq.branch_point = None;
    seq.checkpoint_due = false;
    // The state that may have been corrupt is gone; the sequence starts afresh if prefilled again.
    seq.failed = false;
    Ok(())
}

/// Refuses a sequence whose resources belong to another router.
pub(crate) fn check_tenure(inner: &Inner, seq: &CpuSeq, what: &'static str) -> Result<()> {
    match seq.tenure {
        Some(tenure) if !inner.tenures.contains_key(&tenure) => Err(invalid(
            what,
            format!("sequence {} holds resources of another router", seq.id),
        )),
        _ => Ok(()),
    }
}

fn owned_slot(inner: &Inner, seq: &CpuSeq, what: &'static str) -> Result<usize> {
    match (seq.slot, seq.tenure) {
        (Some(slot), Some(tenure))
            if inner.slots.get(slot) == Some(&Some(SlotOwner { tenure })) =>
        {
            Ok(slot)
        }
        _ => Err(invalid(
            what,
            format!("sequence {} holds no live slot", seq.id),
        )),
    }
}

fn compact(
    shape: &Shape,
    inner: &mut Inner,
    dev: &Dev<'_>,
    seq: &mut CpuSeq,
    target: usize,
) -> Result<EffectOutcome> {
    let from = owned_slot(inner, seq, "CompactSlot")?;
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
    if inner.slots[target].is_some() {
        return Err(invalid(
            "CompactSlot",
            format!("target slot {target} is not free"),
        ));
    }
    dev.copy(inner, from, target)?;
    inner.slots[target] = inner.slots[from].take();
    seq.slot = Some(target);
    Ok(EffectOutcome::Unit)
}

/// The slot stops belonging to this sequence and becomes free for the router to hand out (a
/// `CompactSlot` of another sequence may target it); its contents stay until then.
fn detach(inner: &mut Inner, seq: &mut CpuSeq) -> Result<EffectOutcome> {
    let slot = owned_slot(inner, seq, "DetachSlot")?;
    inner.slots[slot] = None;
    seq.slot = None;
    Ok(EffectOutcome::Unit)
}

fn save(
    shape: &Shape,
    inner: &mut Inner,
    dev: &Dev<'_>,
    seq: &CpuSeq,
    writer: &mut dyn std::io::Write,
) -> Result<EffectOutcome> {
    let slot = owned_slot(inner, seq, "SaveSequenceState")?;
    let device = dev.fenced(inner)?;
    // The image needs the fed tokens; the fence has resolved every one that can be. The sequence
    // is borrowed shared here, so they are read from what the router resolved.
    let tenure = seq.tenure.expect("owned_slot checked it");
    let failed = seq.failed || inner.failed.contains(&tenure);
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
    let mut tokens = seq.tokens.clone();
    for &(pos, token) in inner.resolved.get(&tenure).into_iter().flatten() {
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
    let mut kv = Vec::with_capacity(num_blocks * shape.layout.floats_per_block);
    for &block in &seq.blocks[..num_blocks] {
        device
            .kv
            .export_block(block, &mut kv)
            .map_err(effect_failed)?;
    }
    let header = ImageHeader {
        seq_id: seq.id,
        prompt_len: seq.prompt_len,
        computed_len: seq.computed_len,
        adapter: seq.namespace.adapter,
        cache_salt: seq.namespace.cache_salt,
    };
    let token_count = if seq.computed_len >= seq.prompt_len {
        seq.computed_len
    } else {
        seq.prompt_len
    };
    let bytes = image::encode(
        &shape.layout,
        &header,
        &tokens[..token_count],
        num_blocks,
        &kv,
        device.states.slot(slot).map_err(effect_failed)?,
    );
    drop(device);
    writer
        .write_all(&bytes)
        .and_then(|()| writer.flush())
        .map_err(|err| DeviceError::Failed {
            phase: device_io::Phase::Effect,
            message: format!("writing the image of sequence {}: {err}", seq.id),
        })?;
    Ok(EffectOutcome::Unit)
}

fn restore(
    shape: &Shape,
    inner: &mut Inner,
    dev: &Dev<'_>,
    seq: &mut CpuSeq,
    reader: &mut dyn std::io::Read,
) -> Result<EffectOutcome> {
    check_tenure(inner, seq, "RestoreSequenceState")?;
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
    let header = &image.header;
    if header.seq_id != seq.id {
        return Err(DeviceError::BadImage(format!(
            "the image is of sequence {}, not {}",
            header.seq_id, seq.id
        )));
    }
    let lora = inner.lora.bind(header.adapter).map_err(|reason| {
        invalid(
            "RestoreSequenceState",
            format!("sequence {}: {reason}", seq.id),
        )
    })?;
    let Some(slot) = inner.slots.iter().position(Option::is_none) else {
        return Err(DeviceError::SlotsExhausted {
            total: shape.max_seqs,
        });
    };
    let available = inner.cache.free_blocks() + inner.cache.evictable_blocks();
    let mut blocks = Vec::with_capacity(image.num_blocks);
    for _ in 0..image.num_blocks {
        match inner.cache.allocate() {
            Some(block) => blocks.push(block),
            None => {
                for block in blocks {
                    inner.cache.release(block);
                }
                return Err(DeviceError::KvExhausted {
                    needed: image.num_blocks,
                    free: available,
                });
            }
        }
    }
    let mut device = match dev.fenced(inner) {
        Ok(device) => device,
        Err(err) => {
            for block in blocks {
                inner.cache.release(block);
            }
            return Err(err);
        }
    };
    let per_block = shape.layout.floats_per_block;
    for (i, &block) in blocks.iter().enumerate() {
        let data = &image.kv[i * per_block..(i + 1) * per_block];
        if let Err(err) = device.kv.import_block(block, data) {
            // The sizes were validated against this pool, so this is a router bug; undo.
            for block in blocks {
                inner.cache.release(block);
            }
            return Err(effect_failed(err));
        }
    }
    if let Err(err) = device.states.import_slot(slot, &image.state) {
        for block in blocks {
            inner.cache.release(block);
        }
        return Err(effect_failed(err));
    }
    let tenure = crate::new_tenure();
    inner.tenures.insert(
        tenure,
        Tenure {
            seq_id: seq.id,
            adapter: header.adapter,
        },
    );
    seq.lora = lora;
    inner.slots[slot] = Some(SlotOwner { tenure });
    seq.tenure = Some(tenure);
    seq.slot = Some(slot);
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
    seq.input_checkpoint = None;
    seq.output_checkpoint = None;
    seq.checkpoint_due = false;
    seq.failed = false;
    seq.reservation = None;
    seq.state_ahead = false;
    Ok(EffectOutcome::Unit)
}

fn read_logits(
    inner: &mut Inner,
    dev: &Dev<'_>,
    handle: LogitsHandle,
    rows: usize,
    into: &mut Vec<u8>,
) -> Result<EffectOutcome> {
    // The logits of a step still computing are read once it finishes.
    if inner.unsettled.contains(&handle.step) {
        inner.wait_for(handle.step)?;
    }
    let device = device::lock(dev.device)?;
    let Some((held_rows, logits)) = device.logits_of(handle.step) else {
        let held = device.logits_steps();
        return Err(invalid(
            "ReadLogits",
            if held.is_empty() {
                format!(
                    "the handle names step {}, the router holds no logits",
                    handle.step
                )
            } else {
                let held: Vec<String> = held.iter().map(u64::to_string).collect();
                format!(
                    "the handle names step {}, the router holds the logits of step {}",
                    handle.step,
                    held.join(" and ")
                )
            },
        ));
    };
    if rows > held_rows {
        return Err(invalid(
            "ReadLogits",
            format!("{rows} rows asked, step {} has {held_rows}", handle.step),
        ));
    }
    let vocab = logits.len() / held_rows.max(1);
    into.clear();
    into.reserve(rows * vocab * 4);
    for value in &logits[..rows * vocab] {
        into.extend_from_slice(&value.to_le_bytes());
    }
    Ok(EffectOutcome::HostLogits { elem_bytes: 4 })
}

fn refuse_rolled_back(seq: &CpuSeq, what: &'static str) -> Result<()> {
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

fn marconi_checkpoint(
    shape: &Shape,
    inner: &mut Inner,
    dev: &Dev<'_>,
    seq: &mut CpuSeq,
) -> Result<EffectOutcome> {
    owned_slot(inner, seq, "MarconiCheckpoint")?;
    refuse_rolled_back(seq, "MarconiCheckpoint")?;
    if !seq.checkpoint_due {
        // The policy did not ask for one (or the boundary has passed): nothing to take.
        return Ok(EffectOutcome::Unit);
    }
    seq.checkpoint_due = false;
    if seq.computed_len % shape.block_size == 0 && inner.cache.wants_end_checkpoints() {
        let mut ops = Vec::new();
        let Some(taken) = take_checkpoint(shape, inner, seq, &mut ops) else {
            return Ok(EffectOutcome::Unit);
        };
        if let Err(err) = inner.copies(dev.model, dev.device, ops) {
            inner.cache.free_checkpoint_slot(taken);
            return Err(err);
        }
        let old = seq.output_checkpoint.replace((seq.computed_len, taken));
        // Inside a run-ahead whose position is computed, the checkpoint it replaces is kept
        // until the run-ahead is kept (a rollback gives it back).
        match (&mut seq.reservation, old) {
            (Some(reservation), Some(old)) if seq.computed_len > reservation.at => {
                if let Some((_, older)) = reservation.superseded.replace(old) {
                    inner.cache.free_checkpoint_slot(older);
                }
            }
            (_, Some((_, old))) => inner.cache.free_checkpoint_slot(old),
            (_, None) => {}
        }
    }
    Ok(EffectOutcome::Unit)
}

fn ring_slot(shape: &Shape, slot: usize, what: &'static str) -> Result<()> {
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

fn snapshot_save(
    shape: &Shape,
    inner: &mut Inner,
    dev: &Dev<'_>,
    seq: &CpuSeq,
    slot: usize,
) -> Result<EffectOutcome> {
    ring_slot(shape, slot, "SsmSnapshotSave")?;
    let live = owned_slot(inner, seq, "SsmSnapshotSave")?;
    refuse_rolled_back(seq, "SsmSnapshotSave")?;
    dev.copy(inner, live, shape.ring_row(slot))?;
    inner.ring[slot] = Some(RingEntry {
        tenure: seq.tenure.expect("owned_slot checked it"),
        pos: seq.computed_len,
        main_only: false,
    });
    Ok(EffectOutcome::Unit)
}

/// Restores the SSM state only: positions and KV are the caller's (the speculative path truncates
/// them); the ring slot must hold a snapshot of this very sequence.
///
/// A snapshot a `Verify` wrote holds the main model's Mamba layers only (the MTP head's state is
/// not part of a verification), so only those are copied. Restoring the snapshot taken at exactly
/// the sequence's length after a truncation puts its state back in step.
fn snapshot_restore(
    shape: &Shape,
    inner: &mut Inner,
    dev: &Dev<'_>,
    seq: &mut CpuSeq,
    slot: usize,
) -> Result<EffectOutcome> {
    ring_slot(shape, slot, "SsmSnapshotRestore")?;
    let live = owned_slot(inner, seq, "SsmSnapshotRestore")?;
    match inner.ring[slot] {
        Some(entry) if Some(entry.tenure) == seq.tenure => {
            let from = shape.ring_row(slot);
            let op = if entry.main_only {
                Op::CopyLayers {
                    from,
                    to: live,
                    layers: 0..shape.main_mamba_layers,
                }
            } else {
                Op::CopySlot { from, to: live }
            };
            inner.copies(dev.model, dev.device, vec![op])?;
            if seq.state_ahead && entry.pos == seq.computed_len {
                seq.state_ahead = false;
                seq.checkpoint_due = inner.cache.wants_end_checkpoints()
                    && seq.computed_len % shape.block_size == 0
                    && seq
                        .reservation
                        .as_ref()
                        .is_none_or(|r| r.at < seq.computed_len);
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

/// Opens a ledger entry for the sequence's next position (committing the one before).
fn reserve_kv(shape: &Shape, inner: &mut Inner, seq: &mut CpuSeq) -> Result<EffectOutcome> {
    owned_slot(inner, seq, "ReserveKv")?;
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
        match inner.cache.allocate() {
            Some(block) => Some(block),
            None => return Ok(EffectOutcome::Exhausted),
        }
    };
    if let Some(superseded) = seq.reservation.take().and_then(|r| r.superseded) {
        inner.cache.free_checkpoint_slot(superseded.1);
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

/// Undoes the sequence's latest reservation exactly (see `Effect::Rollback`).
fn rollback(shape: &Shape, inner: &mut Inner, seq: &mut CpuSeq) -> Result<EffectOutcome> {
    if shape.max_depth < 2 {
        return Err(DeviceError::Unsupported { what: "Rollback" });
    }
    check_tenure(inner, seq, "Rollback")?;
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
        if let Some(pending) = inner.pending.get_mut(&tenure) {
            pending.retain(|p| p.pos < at);
        }
        if let Some(resolved) = inner.resolved.get_mut(&tenure) {
            resolved.retain(|&(pos, _)| pos < at);
        }
        seq.state_ahead = true;
        seq.checkpoint_due = false;
    }
    if seq.output_checkpoint.is_some_and(|(pos, _)| pos > at) {
        if let Some((_, slot)) = seq.output_checkpoint.take() {
            inner.cache.free_checkpoint_slot(slot);
        }
        seq.output_checkpoint = reservation.superseded;
    } else if let Some((_, slot)) = reservation.superseded {
        inner.cache.free_checkpoint_slot(slot);
    }
    for &block in reservation.blocks.iter().rev() {
        if let Some(index) = seq.blocks.iter().rposition(|&b| b == block) {
            seq.blocks.remove(index);
            inner.cache.release(block);
        }
    }
    if let Some(track) = inner.mtp.get_mut(&tenure) {
        track.forget_from(at);
    }
    Ok(EffectOutcome::Unit)
}

/// Keeps the first `len` positions of the sequence's latest reservation (a `Verify`'s accepted
/// positions) and releases the rest through the ledger (see `Effect::TruncateKv`).
fn truncate_kv(
    shape: &Shape,
    inner: &mut Inner,
    seq: &mut CpuSeq,
    len: usize,
) -> Result<EffectOutcome> {
    check_tenure(inner, seq, "TruncateKv")?;
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
        if let Some(pending) = inner.pending.get_mut(&tenure) {
            pending.retain(|p| p.pos < len);
        }
        if let Some(resolved) = inner.resolved.get_mut(&tenure) {
            resolved.retain(|&(pos, _)| pos < len);
        }
        // Mamba state moved past `len`; an `SsmSnapshotRestore` at `len` puts it back in step.
        seq.state_ahead = shape.hybrid;
        seq.checkpoint_due = false;
    }
    // A Marconi checkpoint past `len` is a rejected draft's: the one it replaced comes back.
    if seq.output_checkpoint.is_some_and(|(pos, _)| pos > len) {
        if let Some((_, slot)) = seq.output_checkpoint.take() {
            inner.cache.free_checkpoint_slot(slot);
        }
        seq.output_checkpoint = reservation.superseded;
    } else if let Some((_, slot)) = reservation.superseded {
        inner.cache.free_checkpoint_slot(slot);
    }
    // The blocks the reservation added that lie wholly past `len` go back to the pool, once.
    let keep = len.div_ceil(shape.block_size);
    for &block in reservation.blocks.iter().rev() {
        match seq.blocks.iter().rposition(|&b| b == block) {
            Some(index) if index >= keep => {
                seq.blocks.remove(index);
                inner.cache.release(block);
            }
            _ => {}
        }
    }
    if let Some(track) = inner.mtp.get_mut(&tenure) {
        track.forget_from(len);
    }
    if !seq.state_ahead {
        seq.checkpoint_due =
            inner.cache.wants_end_checkpoints() && len > at && len % shape.block_size == 0;
    }
    Ok(EffectOutcome::Unit)
}

/// Keeps the hidden state of row `row` of the latest settled step at position `pos` in that
/// row's sequence's catch-up ring (a no-op on a model without an MTP head).
fn save_hidden(shape: &Shape, inner: &mut Inner, row: usize, pos: usize) -> Result<EffectOutcome> {
    if !shape.mtp {
        return Ok(EffectOutcome::Unit);
    }
    let Some(ticket) = inner.settled else {
        return Err(invalid(
            "SaveHiddenCatchup",
            "no step has settled yet".to_string(),
        ));
    };
    let Some(step) = inner.step_hidden.iter().find(|h| h.ticket == ticket) else {
        return Err(invalid(
            "SaveHiddenCatchup",
            format!("step {ticket} kept no hidden states (a prefill keeps its own)"),
        ));
    };
    let Some(&(tenure, start, len, offset)) = step.rows.get(row) else {
        return Err(invalid(
            "SaveHiddenCatchup",
            format!(
                "row {row} is outside step {ticket}'s {} rows",
                step.rows.len()
            ),
        ));
    };
    if pos < start || pos >= start + len {
        return Err(invalid(
            "SaveHiddenCatchup",
            format!(
                "row {row} of step {ticket} computed positions {start}..{}, not {pos}",
                start + len
            ),
        ));
    }
    let d = step.width;
    let at = (offset + pos - start) * d;
    let data = step.data[at..at + d].to_vec();
    if !inner.tenures.contains_key(&tenure) {
        return Err(invalid(
            "SaveHiddenCatchup",
            format!("row {row}'s sequence was released"),
        ));
    }
    let track = inner.mtp.entry(tenure).or_default();
    if pos < track.consumed || track.ring.contains_key(&pos) {
        return Ok(EffectOutcome::Unit);
    }
    track.ring.insert(pos, data);
    while track.ring.len() > crate::CATCHUP_RING {
        // The oldest goes: the head skips it at its next catch-up.
        track.ring.pop_first();
    }
    Ok(EffectOutcome::Unit)
}
