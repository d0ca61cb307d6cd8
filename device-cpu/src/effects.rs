//! The host router's effects: each validates first and changes nothing when it refuses.
//!
//! Bookkeeping happens at once; device work (state copies) is queued behind the steps launched
//! before it, and an effect that reads device data (`SaveSequenceState`, `ReadLogits`) or writes
//! it from the host (`RestoreSequenceState`) first waits for that work (see [`crate::device`]).
//!
//! The bookkeeping of every effect is `router_book::book`'s, which the CUDA router shares: slot
//! and block ownership, the cache offer on release, the reservation ledger of `ReserveKv`,
//! `Rollback` and `TruncateKv` (the position reserved, the blocks added, and the output
//! checkpoint a `MarconiCheckpoint` taken past that position replaced, so a rollback restores
//! exactly what the sequence had before), the snapshot ring's owners, and a spill image's checks.
//! This module adds the host's device work (state-row copies queued behind the launched steps,
//! the KV and state of a spill image) and what only this router keeps (the MTP catch-up ring).
//!
//! `TruncateKv` closes a `Verify`'s ledger entry keeping its accepted positions: the blocks it
//! added wholly past them return to the pool (once), a checkpoint past them is dropped, the MTP
//! catch-up ring forgets them; the sequence is then `state_ahead` (refused by every plan and by
//! spilling and checkpointing) until `SsmSnapshotRestore` of the snapshot at its length. The
//! ring forgets the run's snapshots past the kept positions; when the kept run carried the
//! sequence past a block boundary, the next `MarconiCheckpoint` takes that boundary's checkpoint
//! from the run's snapshot there (main layers; the MTP head's from the live state), as a decode
//! step would have at the boundary.
//!
//! `SaveHiddenCatchup` keeps a hidden state of the latest settled step in the sequence's MTP
//! catch-up ring (on a model with an MTP head; a no-op otherwise). `SyncSecondary` answers `Unit`:
//! the host runs the catch-up inside the next `Draft`, which is ordered after every step before
//! it, so the head's state is the same as if it had run at the effect. `Quiesce` is a no-op: one
//! host "stream", always drained. `EpShutdown` stops the expert-parallel workers (the router
//! handles it before this module, since the workers belong to the router, not to a sequence);
//! `ReleaseSeq` needs no message to them because they keep no per-sequence state.

use std::sync::Mutex;

use device_io::{DeviceError, Effect, EffectOutcome, Result};
use model::Model;
use router_book::book;

use crate::device::{self, Device, Op};
use crate::{CpuSeq, Inner, LogitsHandle, Shape};

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
    let host = shape;
    let book_shape = shape.book();
    let shape = &book_shape;
    match effect {
        Effect::ReleaseSeq { seq, cache, what } => {
            inner.sync(seq);
            let tenure = seq.tenure;
            let head_exact = tenure
                .and_then(|tenure| inner.mtp.get(&tenure))
                .map(|track| track.exact);
            book::release(shape, &mut inner.book(), seq, cache, what, head_exact)?;
            if let Some(tenure) = tenure {
                inner.mtp.remove(&tenure);
            }
            Ok(EffectOutcome::Unit)
        }
        Effect::CompactSlot { seq, target } => {
            inner.sync(seq);
            with_copies(inner, &dev, |book, copy| {
                book::compact(shape, book, seq, target, &mut |from, to| {
                    copy(Op::CopySlot { from, to })
                })
            })
        }
        Effect::DetachSlot { seq } => {
            inner.sync(seq);
            book::detach(&mut inner.book(), seq)
        }
        Effect::SaveSequenceState { seq, writer } => save(shape, inner, &dev, seq, writer),
        Effect::RestoreSequenceState { seq, reader } => restore(shape, inner, &dev, seq, reader),
        Effect::ReadLogits { logits, rows, into } => read_logits(inner, &dev, logits, rows, into),
        Effect::MarconiCheckpoint { seq } => {
            inner.sync(seq);
            let main_layers = host.main_mamba_layers;
            let before = seq.output_checkpoint;
            let outcome = with_copies(inner, &dev, |book, copy| {
                // A boundary a `Verify` passed comes from its snapshot: main layers only.
                book::marconi_checkpoint_layered(shape, book, seq, &mut |from, to, main_only| {
                    copy(state_copy(from, to, main_only, main_layers))
                })
            })?;
            match seq.output_checkpoint {
                Some((pos, slot)) if shape.head_rerun && seq.output_checkpoint != before => {
                    stash_head(inner, &dev, seq.tenure, slot, pos)?
                }
                _ => {}
            }
            Ok(outcome)
        }
        Effect::SsmSnapshotSave { seq, slot } => with_copies(inner, &dev, |book, copy| {
            book::snapshot_save(shape, book, seq, slot, &mut |from, to| {
                copy(Op::CopySlot { from, to })
            })
        }),
        Effect::SsmSnapshotRestore { seq, slot } => {
            inner.sync(seq);
            let main_layers = host.main_mamba_layers;
            with_copies(inner, &dev, |book, copy| {
                // A snapshot a `Verify` wrote holds the main model's Mamba layers only.
                let mut copy_ring = |from: usize, to: usize, main_only: bool| {
                    copy(state_copy(from, to, main_only, main_layers))
                };
                book::snapshot_restore(shape, book, seq, slot, &mut copy_ring)
            })
        }
        Effect::ReserveKv { seq } => {
            inner.sync(seq);
            book::reserve_kv(shape, &mut inner.book(), seq)
        }
        Effect::Rollback { seq } => {
            inner.sync(seq);
            let at = book::rollback(shape, &mut inner.book(), seq)?;
            forget_catchup(inner, seq, at);
            Ok(EffectOutcome::Unit)
        }
        Effect::TruncateKv { seq, len } => {
            inner.sync(seq);
            let len = book::truncate_kv(shape, &mut inner.book(), seq, len)?;
            forget_catchup(inner, seq, len);
            Ok(EffectOutcome::Unit)
        }
        Effect::SaveHiddenCatchup { row, pos } => save_hidden(host, inner, row, pos),
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
    /// Waits for every device work item submitted so far, then locks device memory.
    fn fenced<'d>(&'d self, inner: &mut Inner) -> Result<std::sync::MutexGuard<'d, Device>> {
        inner.fence(self.model, self.device)?;
        device::lock(self.device)
    }
}

/// Forgets the MTP catch-up positions at and past `len` (a rollback or truncation dropped them).
fn forget_catchup(inner: &mut Inner, seq: &CpuSeq, len: usize) {
    if let Some(track) = seq.tenure.and_then(|tenure| inner.mtp.get_mut(&tenure)) {
        track.forget_from(len);
    }
}

/// A checkpoint a sequence just took at `pos`: the hidden states its MTP head's rerun at a hit
/// needs, when its catch-up ring holds them (`router_book::spec::checkpoint_head`), stored with
/// the checkpoint behind the work queued before.
fn stash_head(
    inner: &mut Inner,
    dev: &Dev<'_>,
    tenure: Option<u64>,
    slot: router_book::CheckpointSlot,
    pos: usize,
) -> Result<()> {
    let head = router_book::spec::checkpoint_head(&inner.mtp, tenure, &mut inner.cache, slot, pos);
    let Some(rows) = head else {
        return Ok(());
    };
    let rows: Vec<f32> = rows.into_iter().flatten().copied().collect();
    let op = Op::StoreHidden {
        checkpoint: slot.index(),
        rows,
    };
    inner
        .executor
        .submit(dev.model, dev.device, device::Work::Copies(vec![op]))
}

/// Runs a shared effect whose state-row copies are queued behind the launched steps.
fn with_copies<T>(
    inner: &mut Inner,
    dev: &Dev<'_>,
    effect: impl FnOnce(&mut router_book::BookMut<'_>, &mut dyn FnMut(Op) -> Result<()>) -> Result<T>,
) -> Result<T> {
    let mut book = router_book::book_mut!(inner);
    let executor = &mut inner.executor;
    let mut copy = |op: Op| executor.submit(dev.model, dev.device, device::Work::Copies(vec![op]));
    effect(&mut book, &mut copy)
}

fn save(
    shape: &router_book::BookShape,
    inner: &mut Inner,
    dev: &Dev<'_>,
    seq: &CpuSeq,
    writer: &mut dyn std::io::Write,
) -> Result<EffectOutcome> {
    book::owned_slot(&inner.book(), seq, "SaveSequenceState")?;
    let device = dev.fenced(inner)?;
    let plan = book::save_plan(shape, &inner.book(), seq)?;
    let mut kv = Vec::with_capacity(plan.blocks.len() * shape.layout.floats_per_block);
    for &block in &plan.blocks {
        device
            .kv
            .export_block(block, &mut kv)
            .map_err(effect_failed)?;
    }
    let state = device.states.slot(plan.slot).map_err(effect_failed)?;
    let bytes = book::encode_image(shape, &plan, seq, &inner.mtp, &kv, state, |row| {
        Ok(row.clone())
    })?;
    drop(device);
    book::write_image(seq.id, &bytes, writer)?;
    Ok(EffectOutcome::Unit)
}

fn restore(
    shape: &router_book::BookShape,
    inner: &mut Inner,
    dev: &Dev<'_>,
    seq: &mut CpuSeq,
    reader: &mut dyn std::io::Read,
) -> Result<EffectOutcome> {
    let mut image = book::read_image(shape, &inner.book(), seq, reader)?;
    let lora = inner.lora.bind(image.header.adapter).map_err(|reason| {
        invalid(
            "RestoreSequenceState",
            format!("sequence {}: {reason}", seq.id),
        )
    })?;
    let (slot, blocks) = book::restore_reserve(shape, &mut inner.book(), &image)?;
    let mut device = match dev.fenced(inner) {
        Ok(device) => device,
        Err(err) => {
            book::restore_abort(&mut inner.book(), blocks);
            return Err(err);
        }
    };
    let per_block = shape.layout.floats_per_block;
    let mut written = Ok(());
    for (i, &block) in blocks.iter().enumerate() {
        let data = &image.kv[i * per_block..(i + 1) * per_block];
        written = device.kv.import_block(block, data);
        if written.is_err() {
            break;
        }
    }
    if written.is_ok() {
        written = device.states.import_slot(slot, &image.state);
    }
    drop(device);
    if let Err(err) = written {
        // The sizes were validated against this pool, so this is a router bug; undo.
        book::restore_abort(&mut inner.book(), blocks);
        return Err(effect_failed(err));
    }
    let mtp = image.mtp.take();
    book::restore_commit(&mut inner.book(), seq, image, slot, blocks, lora);
    if let (Some(mtp), Some(tenure)) = (mtp, seq.tenure) {
        let track = router_book::spec::restored_track(mtp, |row| {
            Ok::<_, std::convert::Infallible>(Some(row))
        })
        .unwrap_or_else(|never| match never {});
        inner.mtp.insert(tenure, track);
    }
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
        return Err(book::logits_not_held(handle.step, &device.logits_steps()));
    };
    book::check_logit_rows(handle.step, rows, held_rows)?;
    let vocab = logits.len() / held_rows.max(1);
    into.clear();
    into.reserve(rows * vocab * 4);
    for value in &logits[..rows * vocab] {
        into.extend_from_slice(&value.to_le_bytes());
    }
    Ok(EffectOutcome::HostLogits { elem_bytes: 4 })
}

/// Keeps the hidden state of row `row` of the latest settled step at position `pos` in that
/// row's sequence's catch-up ring (a no-op on a model without an MTP head).
fn save_hidden(shape: &Shape, inner: &mut Inner, row: usize, pos: usize) -> Result<EffectOutcome> {
    if !shape.mtp {
        return Ok(EffectOutcome::Unit);
    }
    let kept = inner.step_hidden.iter().map(|h| (h.ticket, &h.rows[..], h));
    let (step, tenure, hidden_row) =
        router_book::spec::catchup_source(&inner.tenures, inner.settled, kept, row, pos)?;
    let d = step.width;
    let data = step.data[hidden_row * d..(hidden_row + 1) * d].to_vec();
    // A full ring forgets its oldest position: the head skips it at its next catch-up.
    inner.mtp.entry(tenure).or_default().keep(pos, data);
    Ok(EffectOutcome::Unit)
}

/// The copy of state row `from` to `to`: the main model's first `main_layers` Mamba layers only
/// where `main_only` (a row a `Verify` wrote holds no more), else the whole row.
fn state_copy(from: usize, to: usize, main_only: bool, main_layers: usize) -> Op {
    if main_only {
        Op::CopyLayers {
            from,
            to,
            layers: 0..main_layers,
        }
    } else {
        Op::CopySlot { from, to }
    }
}
