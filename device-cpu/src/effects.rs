//! The host router's effects: each validates first and changes nothing when it refuses.
//!
//! `SaveHiddenCatchup`, `SyncSecondary`, `EpShutdown` and `Quiesce` are deliberate no-ops here:
//! this router keeps no MTP catch-up ring (the MTP issue adds one), runs on one host "stream" that
//! is always drained when `launch` returns, and has no expert-parallel workers. They answer `Unit`
//! and change no state (tested).

use std::io::Read;

use device_io::{DeviceError, Effect, EffectOutcome, Result};
use model::Model;

use crate::image::{self, ImageHeader};
use crate::plans::take_checkpoint;
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
    effect: Effect<'_, CpuSeq, LogitsHandle>,
) -> Result<EffectOutcome> {
    match effect {
        Effect::ReleaseSeq { seq, cache, what } => {
            release(shape, inner, seq, cache, what)?;
            Ok(EffectOutcome::Unit)
        }
        Effect::CompactSlot { seq, target } => compact(shape, inner, seq, target),
        Effect::DetachSlot { seq } => detach(inner, seq),
        Effect::SaveSequenceState { seq, writer } => save(shape, inner, seq, writer),
        Effect::RestoreSequenceState { seq, reader } => restore(shape, inner, seq, reader),
        Effect::ReadLogits { logits, rows, into } => read_logits(inner, logits, rows, into),
        Effect::MarconiCheckpoint { seq } => marconi_checkpoint(shape, inner, seq),
        Effect::SsmSnapshotSave { seq, slot } => snapshot_save(shape, inner, seq, slot),
        Effect::SsmSnapshotRestore { seq, slot } => snapshot_restore(shape, inner, seq, slot),
        Effect::ReserveKv { seq } => reserve_kv(shape, inner, seq),
        Effect::Rollback { .. } => Err(DeviceError::Unsupported { what: "Rollback" }),
        // No MTP ring, one stream, no expert workers: see the module docs.
        Effect::SaveHiddenCatchup { .. }
        | Effect::SyncSecondary
        | Effect::EpShutdown
        | Effect::Quiesce { .. } => {
            let _ = model;
            Ok(EffectOutcome::Unit)
        }
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
    let full_blocks = seq.computed_len / shape.block_size;
    let checkpoints: Vec<_> = [seq.input_checkpoint.take(), seq.output_checkpoint.take()]
        .into_iter()
        .flatten()
        .collect();
    if cache && !seq.failed {
        // Register while the block ids are still valid (this sequence holds them). The
        // checkpoints sit at block boundaries at or below `computed_len`, inside the full blocks.
        let full = full_blocks * shape.block_size;
        let looked_up = &seq.tokens[..seq.prompt_len.saturating_sub(1)];
        inner.cache.insert_finished(
            seq.namespace,
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
    inner
        .states
        .copy_slot(from, target)
        .map_err(effect_failed)?;
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
    seq: &CpuSeq,
    writer: &mut dyn std::io::Write,
) -> Result<EffectOutcome> {
    let slot = owned_slot(inner, seq, "SaveSequenceState")?;
    if seq.failed {
        return Err(invalid(
            "SaveSequenceState",
            format!("sequence {} failed; its state is unspecified", seq.id),
        ));
    }
    let num_blocks = seq.computed_len.div_ceil(shape.block_size);
    let mut kv = Vec::with_capacity(num_blocks * shape.layout.floats_per_block);
    for &block in &seq.blocks[..num_blocks] {
        inner
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
        &seq.tokens[..token_count],
        num_blocks,
        &kv,
        inner.states.slot(slot).map_err(effect_failed)?,
    );
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
    let per_block = shape.layout.floats_per_block;
    for (i, &block) in blocks.iter().enumerate() {
        let data = &image.kv[i * per_block..(i + 1) * per_block];
        if let Err(err) = inner.kv.import_block(block, data) {
            // The sizes were validated against this pool, so this is a router bug; undo.
            for block in blocks {
                inner.cache.release(block);
            }
            return Err(effect_failed(err));
        }
    }
    if let Err(err) = inner.states.import_slot(slot, &image.state) {
        for block in blocks {
            inner.cache.release(block);
        }
        return Err(effect_failed(err));
    }
    let tenure = crate::new_tenure();
    inner.tenures.insert(tenure, Tenure { seq_id: seq.id });
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
    Ok(EffectOutcome::Unit)
}

fn read_logits(
    inner: &mut Inner,
    handle: LogitsHandle,
    rows: usize,
    into: &mut Vec<u8>,
) -> Result<EffectOutcome> {
    if inner.logits_step != Some(handle.step) {
        return Err(invalid(
            "ReadLogits",
            match inner.logits_step {
                Some(step) => format!(
                    "the handle names step {}, the router holds the logits of step {step}",
                    handle.step
                ),
                None => format!(
                    "the handle names step {}, the router holds no logits",
                    handle.step
                ),
            },
        ));
    }
    if rows > inner.logits_rows {
        return Err(invalid(
            "ReadLogits",
            format!(
                "{rows} rows asked, step {} has {}",
                handle.step, inner.logits_rows
            ),
        ));
    }
    let vocab = inner.logits.len() / inner.logits_rows.max(1);
    into.clear();
    into.reserve(rows * vocab * 4);
    for value in &inner.logits[..rows * vocab] {
        into.extend_from_slice(&value.to_le_bytes());
    }
    Ok(EffectOutcome::HostLogits { elem_bytes: 4 })
}

fn marconi_checkpoint(shape: &Shape, inner: &mut Inner, seq: &mut CpuSeq) -> Result<EffectOutcome> {
    owned_slot(inner, seq, "MarconiCheckpoint")?;
    if !seq.checkpoint_due {
        // The policy did not ask for one (or the boundary has passed): nothing to take.
        return Ok(EffectOutcome::Unit);
    }
    seq.checkpoint_due = false;
    if seq.computed_len % shape.block_size == 0 && inner.cache.wants_end_checkpoints() {
        if let Some((_, old)) = seq.output_checkpoint.take() {
            inner.cache.free_checkpoint_slot(old);
        }
        let taken = take_checkpoint(shape, inner, seq).map_err(effect_failed)?;
        seq.output_checkpoint = taken.map(|slot| (seq.computed_len, slot));
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
    seq: &CpuSeq,
    slot: usize,
) -> Result<EffectOutcome> {
    ring_slot(shape, slot, "SsmSnapshotSave")?;
    let live = owned_slot(inner, seq, "SsmSnapshotSave")?;
    inner
        .states
        .copy_slot(live, shape.ring_row(slot))
        .map_err(effect_failed)?;
    inner.ring[slot] = Some(RingEntry {
        tenure: seq.tenure.expect("owned_slot checked it"),
        pos: seq.computed_len,
    });
    Ok(EffectOutcome::Unit)
}

/// Restores the SSM state only: positions and KV are the caller's (the speculative path truncates
/// them); the ring slot must hold a snapshot of this very sequence.
fn snapshot_restore(
    shape: &Shape,
    inner: &mut Inner,
    seq: &CpuSeq,
    slot: usize,
) -> Result<EffectOutcome> {
    ring_slot(shape, slot, "SsmSnapshotRestore")?;
    let live = owned_slot(inner, seq, "SsmSnapshotRestore")?;
    match inner.ring[slot] {
        Some(entry) if Some(entry.tenure) == seq.tenure => {
            inner
                .states
                .copy_slot(shape.ring_row(slot), live)
                .map_err(effect_failed)?;
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

fn reserve_kv(shape: &Shape, inner: &mut Inner, seq: &mut CpuSeq) -> Result<EffectOutcome> {
    owned_slot(inner, seq, "ReserveKv")?;
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
    if seq.blocks.len() * shape.block_size > seq.computed_len {
        return Ok(EffectOutcome::Reserved { blocks: 0 });
    }
    match inner.cache.allocate() {
        Some(block) => {
            seq.blocks.push(block);
            Ok(EffectOutcome::Reserved { blocks: 1 })
        }
        None => Ok(EffectOutcome::Exhausted),
    }
}
