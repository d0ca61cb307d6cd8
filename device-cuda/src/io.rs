//! `DeviceIo` for [`CudaRouter`]: the effects, real on the device, with the bookkeeping of
//! `router_book` that the host router shares, and the plans' seam with the forward kernels.
//!
//! # Device layout
//!
//! KV block `b` is bytes `b * kv_block_bytes ..` of the KV buffer, and state row `r` bytes
//! `r * state_slot_bytes ..` of the state buffer, each a run of f32 in the host model's order
//! (`model::KvPool::export_block`, `model::MambaStates::slot`), so a spill image is the same
//! bytes on either router. State rows: live slot `i` is row `i`, checkpoint slot `c` row
//! `max_seqs + c`, ring slot `r` row `max_seqs + checkpoint_slots + r` (`BookShape`).
//!
//! # Streams
//!
//! Steps run on the compute stream. Every effect's device work is ordered after the steps
//! launched before it by running on the compute stream too (state-row copies, the KV gather of a
//! spill, the KV scatter of a restore), and the host traffic goes through pinned buffers on the
//! copy stream, joined to the compute stream by an event: a spill gathers on compute, records,
//! and the copy stream waits for that record before it copies to pinned memory; a restore copies
//! from pinned memory on the copy stream, records, and the compute stream waits before it
//! scatters. `Quiesce { stream }` waits for stream `stream` (0 compute, 1 copy);
//! `SyncSecondary` makes the copy stream wait for the compute stream's work so far.
//!
//! # Plans
//!
//! `launch` and `await_result` are the `step` module's: the plans' bookkeeping of `router_book`
//! (the host router's), then `DeviceModel::forward` on the compute stream.
//!
//! # Effects this router has nothing for
//!
//! `EpShutdown` (no expert-parallel workers: one device) answers `Unit` and changes nothing.
//!
//! # Speculation
//!
//! A `Verify` writes the main model's Mamba layers after each draft into the ring rows it names
//! (`router_book::spec`, the `step` module); `SsmSnapshotRestore` of such a snapshot copies
//! those layers only (the first ones of a state row) into the live row, and `TruncateKv` is the
//! shared bookkeeping's (the KV past the kept positions is never read again: no prefix-cache
//! insert covers it, and the next step overwrites it).
//!
//! On a model with an MTP head the router keeps each sequence's catch-up ring
//! (`router_book::spec::MtpTrack`) as device cells of one hidden state each (the MTP regions of
//! `MtpLayout`): a prefill keeps the prompt's last position, and `SaveHiddenCatchup` copies a
//! row of the latest settled decode or verification (kept in the step's half of
//! `step_hidden`) into a free cell; `TruncateKv`, `Rollback` and `ReleaseSeq` free the cells
//! of the positions they drop, and `Draft` those it consumes. A spill image (version 2) carries
//! the head's position and its ring (the cells downloaded; a restore uploads them into free
//! cells). A `MarconiCheckpoint` the head can mark copies the ring's cells from the head's
//! position to the rows stored with the checkpoint (`router_book::spec::checkpoint_head`), for
//! the head's rerun at a hit on it (the `step` module). `SyncSecondary`
//! is the copy stream's join: the catch-up itself runs inside the next `Draft`, after every
//! step before it on the compute stream, as on the host router.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use device_io::{
    CacheEventSink, DeviceError, DeviceFacts, DeviceIo, Effect, EffectOutcome, LoraAck,
    LoraCommand, LoraError, Phase, Result, StepPlan, StepResult, Ticket,
};
use router_book::book::{self, BookMut};
use router_book::spec::MtpTrack;
use router_book::{Caches, LogitsHandle, PendingFeed, RingEntry, RouterSeq, SlotOwner, Tenure};

use crate::error::CudaError;
use crate::kernels::{self, BlockShape};
use crate::router::CudaRouter;
use crate::runtime::{DeviceBuffer, DeviceSlice, Runtime, Stream};

/// The router's bookkeeping, behind one mutex.
///
/// Invariants: those of [`BookMut`]; `unsettled` lists the launched, unclaimed tickets in launch
/// order (at most two), and `flights` their device records in the same order; `logits` names
/// the steps whose logits the logits buffer holds, with their row count and half of the buffer;
/// `last_rows` / `last_token_rows` describe the rows of the latest launched step (what a
/// `Feed::Row` may name, and which feed cell holds its argmax); `last_argmax` is the argmax of
/// each row of the latest step whose outputs the host has read.
#[derive(Debug)]
pub(crate) struct Inner {
    pub cache: Caches,
    pub slots: Vec<Option<SlotOwner>>,
    pub tenures: BTreeMap<u64, Tenure>,
    pub ring: Vec<Option<RingEntry>>,
    pub pending: BTreeMap<u64, Vec<PendingFeed>>,
    pub resolved: BTreeMap<u64, Vec<(usize, u32)>>,
    pub failed: BTreeSet<u64>,
    pub unsettled: VecDeque<u64>,
    pub logits: Vec<LogitsHeld>,
    pub next_step: u64,
    pub flights: VecDeque<crate::step::Flight>,
    pub last_rows: Vec<(u64, bool)>,
    pub last_token_rows: Vec<Option<usize>>,
    pub last_argmax: Option<(u64, Vec<Option<u32>>)>,
    /// The MTP head of each tenure that has one running, its ring holding catch-up cells.
    pub mtp: BTreeMap<u64, MtpTrack<u32>>,
    /// Catch-up cells no ring holds.
    pub free_cells: Vec<u32>,
    /// The hidden states the latest steps kept (at most one per half of `step_hidden`).
    pub step_hidden: Vec<StepHidden>,
    /// The latest ticket `await_result` handed over.
    pub settled: Option<u64>,
    /// Fault injection at the device ([`CudaRouter::inject_step_faults`]).
    pub step_faults: Option<router_book::StepFaults>,
}

/// The hidden states a decode or verification kept in its half of the MTP regions'
/// `step_hidden`, for `SaveHiddenCatchup`.
#[derive(Debug, Clone)]
pub(crate) struct StepHidden {
    pub ticket: u64,
    pub half: usize,
    /// Per row: tenure, first position, positions, first hidden row.
    pub rows: Vec<(u64, usize, usize, usize)>,
}

/// The logits of one step in the logits buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct LogitsHeld {
    pub step: u64,
    pub rows: usize,
    /// Which of the buffer's two halves (depth 2 keeps two steps).
    pub half: usize,
}

impl Inner {
    pub fn new(cache: Caches, live_slots: usize, snapshot_slots: usize, cells: usize) -> Self {
        Inner {
            cache,
            slots: vec![None; live_slots],
            tenures: BTreeMap::new(),
            ring: vec![None; snapshot_slots],
            pending: BTreeMap::new(),
            resolved: BTreeMap::new(),
            failed: BTreeSet::new(),
            unsettled: VecDeque::new(),
            logits: Vec::new(),
            next_step: 1,
            flights: VecDeque::new(),
            last_rows: Vec::new(),
            last_token_rows: Vec::new(),
            last_argmax: None,
            mtp: BTreeMap::new(),
            free_cells: (0..cells as u32).rev().collect(),
            step_hidden: Vec::new(),
            settled: None,
            step_faults: None,
        }
    }

    /// Forgets the MTP catch-up positions of `tenure` at and past `len` (a rollback or
    /// truncation dropped them); their cells are free again.
    pub fn forget_catchup(&mut self, tenure: Option<u64>, len: usize) {
        if let Some(track) = tenure.and_then(|tenure| self.mtp.get_mut(&tenure)) {
            let dropped = track.forget_from(len);
            self.free_cells.extend(dropped);
        }
    }

    /// Drops the MTP head of `tenure` (a released sequence); its cells are free again.
    pub fn drop_track(&mut self, tenure: Option<u64>) {
        if let Some(track) = tenure.and_then(|tenure| self.mtp.remove(&tenure)) {
            self.free_cells.extend(track.ring.into_values());
        }
    }

    pub fn book(&mut self) -> BookMut<'_> {
        self.book_and_tracks().0
    }

    /// The shared bookkeeping's tables and the MTP catch-up rings, borrowed together.
    pub fn book_and_tracks(&mut self) -> (BookMut<'_>, &mut BTreeMap<u64, MtpTrack<u32>>) {
        (router_book::book_mut!(self), &mut self.mtp)
    }
}

/// A device call that failed inside an effect: a lost device when the runtime is gone (a
/// failed driver call, a sticky error), else a router bug reported as `Failed`.
pub(crate) fn device_error(phase: Phase, err: CudaError) -> DeviceError {
    match err {
        CudaError::Sticky(_)
        | CudaError::Call { .. }
        | CudaError::NoDriver { .. }
        | CudaError::NoDevice(_)
        | CudaError::DriverTooOld { .. }
        | CudaError::MissingPtx { .. } => DeviceError::DeviceLost(err.to_string()),
        CudaError::OutOfMemory { .. }
        | CudaError::BadRange(_)
        | CudaError::BadLaunch { .. }
        | CudaError::UnknownEvent(_) => DeviceError::Failed {
            phase,
            message: err.to_string(),
        },
    }
}

fn effect_err(err: CudaError) -> DeviceError {
    device_error(Phase::Effect, err)
}

fn invalid(what: &'static str, detail: String) -> DeviceError {
    DeviceError::Invalid { what, detail }
}

fn f32_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

fn bytes_f32(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// Device memory an effect borrows for its duration, freed (after both streams drained) however
/// the effect ends.
struct Scratch<'a> {
    rt: &'a dyn Runtime,
    buffers: Vec<DeviceBuffer>,
    pinned: Vec<crate::runtime::PinnedBuffer>,
}

impl<'a> Scratch<'a> {
    fn new(rt: &'a dyn Runtime) -> Self {
        Scratch {
            rt,
            buffers: Vec::new(),
            pinned: Vec::new(),
        }
    }

    fn alloc(&mut self, bytes: usize) -> std::result::Result<DeviceSlice, CudaError> {
        let buffer = self.rt.alloc(bytes)?;
        let slice = buffer.all();
        self.buffers.push(buffer);
        Ok(slice)
    }

    fn pinned(&mut self, bytes: usize) -> std::result::Result<usize, CudaError> {
        self.pinned.push(self.rt.alloc_pinned(bytes)?);
        Ok(self.pinned.len() - 1)
    }

    /// Frees everything; the first error wins.
    fn finish(mut self) -> std::result::Result<(), CudaError> {
        let mut first = Ok(());
        for pinned in std::mem::take(&mut self.pinned) {
            let freed = self.rt.free_pinned(pinned);
            first = first.and(freed);
        }
        for buffer in std::mem::take(&mut self.buffers) {
            let freed = self.rt.free(buffer);
            first = first.and(freed);
        }
        first
    }
}

impl Drop for Scratch<'_> {
    fn drop(&mut self) {
        for pinned in std::mem::take(&mut self.pinned) {
            if let Err(err) = self.rt.free_pinned(pinned) {
                tracing::error!(%err, "freeing an effect's pinned buffer");
            }
        }
        for buffer in std::mem::take(&mut self.buffers) {
            if let Err(err) = self.rt.free(buffer) {
                tracing::error!(%err, "freeing an effect's device buffer");
            }
        }
    }
}

impl CudaRouter {
    /// State row `row` (live, checkpoint or ring; see the module docs).
    fn state_row(&self, row: usize) -> std::result::Result<DeviceSlice, CudaError> {
        let bytes = self.plan().state_slot_bytes as usize;
        self.buffers()?.states.range(row * bytes, bytes)
    }

    /// Queues the copy of state row `from` to row `to` on the compute stream, after the steps
    /// launched before.
    fn copy_row(&self, from: usize, to: usize) -> Result<()> {
        if self.plan().state_slot_bytes == 0 {
            return Ok(());
        }
        let run = || -> std::result::Result<(), CudaError> {
            let src = self.state_row(from)?;
            let dst = self.state_row(to)?;
            self.runtime().copy(dst, src, Stream::Compute)
        };
        run().map_err(effect_err)
    }

    /// [`Self::copy_main_layers`] when `main_only` (what a `Verify` snapshot holds), otherwise
    /// [`Self::copy_row`]: the copy `book::snapshot_restore` and
    /// `book::marconi_checkpoint_layered` ask for.
    fn copy_layers(&self, from: usize, to: usize, main_only: bool) -> Result<()> {
        if main_only {
            self.copy_main_layers(from, to)
        } else {
            self.copy_row(from, to)
        }
    }

    /// Queues the copy of the main model's Mamba layers (the first ones of a row; an MTP head's
    /// follow) of state row `from` to row `to`, on the compute stream after the steps launched
    /// before: what a `Verify` snapshot holds.
    fn copy_main_layers(&self, from: usize, to: usize) -> Result<()> {
        let layout = model::MambaStates::new(self.model_config(), 0)
            .map_err(|err| DeviceError::Failed {
                phase: Phase::Effect,
                message: err.to_string(),
            })?
            .layout();
        let main_layers = self.model_config().count(model::LayerKind::Mamba);
        let bytes = 4 * main_layers * layout.layer_floats();
        if bytes == 0 {
            return Ok(());
        }
        let run = || -> std::result::Result<(), CudaError> {
            let src = self.state_row(from)?.range(0, bytes)?;
            let dst = self.state_row(to)?.range(0, bytes)?;
            self.runtime().copy(dst, src, Stream::Compute)
        };
        run().map_err(effect_err)
    }

    /// The hidden state in catch-up cell `cell`, read after the work queued before.
    fn read_cell(&self, cell: u32) -> std::result::Result<Vec<f32>, CudaError> {
        let src = self.cell(cell)?;
        let mut out = vec![0u8; src.bytes()];
        self.runtime().download(&mut out, src, Stream::Compute)?;
        Ok(bytes_f32(&out))
    }

    /// The bytes of state row `row`, read after the work queued before (for tests and checks).
    pub fn read_state_row(&self, row: usize) -> std::result::Result<Vec<u8>, CudaError> {
        let src = self.state_row(row)?;
        let mut out = vec![0u8; src.bytes()];
        self.runtime().download(&mut out, src, Stream::Compute)?;
        Ok(out)
    }

    /// Overwrites state row `row` with `bytes` (its whole length), in stream order: for tests
    /// that must tell a restored state from the one it replaced.
    #[doc(hidden)]
    pub fn write_state_row(&self, row: usize, bytes: &[u8]) -> std::result::Result<(), CudaError> {
        let dst = self.state_row(row)?;
        self.runtime().upload(dst, bytes, Stream::Compute)
    }

    /// `blocks`' ids uploaded into `scratch` on the compute stream, and the shape of a gather
    /// or scatter of those blocks of the KV pool.
    fn block_ids(
        &self,
        scratch: &mut Scratch<'_>,
        blocks: &[u32],
    ) -> std::result::Result<(DeviceSlice, BlockShape), CudaError> {
        let ids = scratch.alloc(4 * blocks.len())?;
        let id_bytes: Vec<u8> = blocks.iter().flat_map(|b| b.to_le_bytes()).collect();
        self.runtime().upload(ids, &id_bytes, Stream::Compute)?;
        let shape = BlockShape {
            count: blocks.len(),
            words: self.plan().kv_block_bytes as usize / 4,
            pool_blocks: self.plan().num_blocks,
        };
        Ok((ids, shape))
    }

    /// The KV of `blocks` and the state of live slot `slot`, gathered on the compute stream and
    /// copied to a pinned buffer on the copy stream.
    fn export(
        &self,
        blocks: &[u32],
        slot: usize,
    ) -> std::result::Result<(Vec<f32>, Vec<f32>), CudaError> {
        let rt = self.runtime();
        let kv_block = self.plan().kv_block_bytes as usize;
        let state_bytes = self.plan().state_slot_bytes as usize;
        let kv_bytes = kv_block * blocks.len();
        let mut scratch = Scratch::new(rt);
        let total = kv_bytes + state_bytes;
        let mut bytes = vec![0u8; total];
        if total > 0 {
            let staging = scratch.alloc(total)?;
            if kv_bytes > 0 {
                let (ids, shape) = self.block_ids(&mut scratch, blocks)?;
                let (staged, pool) = (staging.range(0, kv_bytes)?, self.buffers()?.kv.all());
                kernels::gather_blocks(rt, Stream::Compute, staged, pool, ids, shape)?;
            }
            if state_bytes > 0 {
                rt.copy(
                    staging.range(kv_bytes, state_bytes)?,
                    self.state_row(slot)?,
                    Stream::Compute,
                )?;
            }
            let joined = self.join_event()?;
            rt.record(joined, Stream::Compute)?;
            rt.wait_event(Stream::Copy, joined)?;
            let pinned = scratch.pinned(total)?;
            rt.copy_to_pinned(&scratch.pinned[pinned], 0, staging, Stream::Copy)?;
            rt.read_pinned(&scratch.pinned[pinned], 0, &mut bytes)?;
        }
        scratch.finish()?;
        Ok((bytes_f32(&bytes[..kv_bytes]), bytes_f32(&bytes[kv_bytes..])))
    }

    /// Writes an image's KV into `blocks` and its state into live slot `slot`: host bytes into a
    /// pinned buffer, to the device on the copy stream, scattered on the compute stream after
    /// the steps launched before.
    fn import(
        &self,
        blocks: &[u32],
        kv: &[f32],
        slot: usize,
        state: &[f32],
    ) -> std::result::Result<(), CudaError> {
        let rt = self.runtime();
        let kv_block = self.plan().kv_block_bytes as usize;
        let state_bytes = self.plan().state_slot_bytes as usize;
        let kv_bytes = kv_block * blocks.len();
        let total = kv_bytes + state_bytes;
        if total == 0 {
            return Ok(());
        }
        let mut scratch = Scratch::new(rt);
        let pinned = scratch.pinned(total)?;
        rt.write_pinned(&scratch.pinned[pinned], 0, &f32_bytes(kv))?;
        rt.write_pinned(&scratch.pinned[pinned], kv_bytes, &f32_bytes(state))?;
        let staging = scratch.alloc(total)?;
        rt.copy_from_pinned(staging, &scratch.pinned[pinned], 0, Stream::Copy)?;
        let joined = self.join_event()?;
        rt.record(joined, Stream::Copy)?;
        rt.wait_event(Stream::Compute, joined)?;
        if kv_bytes > 0 {
            let (ids, shape) = self.block_ids(&mut scratch, blocks)?;
            let (pool, staged) = (self.buffers()?.kv.all(), staging.range(0, kv_bytes)?);
            kernels::scatter_blocks(rt, Stream::Compute, pool, staged, ids, shape)?;
        }
        if state_bytes > 0 {
            rt.copy(
                self.state_row(slot)?,
                staging.range(kv_bytes, state_bytes)?,
                Stream::Compute,
            )?;
        }
        // Freeing waits for both streams, so the data has landed when this returns.
        scratch.finish()
    }

    fn save(
        &self,
        inner: &mut Inner,
        seq: &RouterSeq,
        writer: &mut dyn std::io::Write,
    ) -> Result<EffectOutcome> {
        let shape = *self.book_shape();
        // The fed tokens of the steps in flight go in: wait for them and resolve their feeds.
        self.settle_flights(inner)?;
        let plan = book::save_plan(&shape, &inner.book(), seq)?;
        let (kv, state) = self.export(&plan.blocks, plan.slot).map_err(effect_err)?;
        // The MTP head's catch-up ring cells are read here.
        let bytes = book::encode_image(&shape, &plan, seq, &inner.mtp, &kv, &state, |&cell| {
            self.read_cell(cell).map_err(effect_err)
        })?;
        book::write_image(seq.id, &bytes, writer)?;
        Ok(EffectOutcome::Unit)
    }

    fn restore(
        &self,
        inner: &mut Inner,
        seq: &mut RouterSeq,
        reader: &mut dyn std::io::Read,
    ) -> Result<EffectOutcome> {
        let shape = *self.book_shape();
        let mut image = book::read_image(&shape, &inner.book(), seq, reader)?;
        if let Some(adapter) = image.header.adapter {
            return Err(invalid(
                "RestoreSequenceState",
                format!(
                    "sequence {}: the image was computed with LoRA adapter {adapter}, and the \
                     CUDA router has no adapter slots",
                    seq.id
                ),
            ));
        }
        let (slot, blocks) = book::restore_reserve(&shape, &mut inner.book(), &image)?;
        if let Err(err) = self.import(&blocks, &image.kv, slot, &image.state) {
            book::restore_abort(&mut inner.book(), blocks);
            return Err(effect_err(err));
        }
        // The MTP head's ring into free catch-up cells (as many as there are, newest first).
        let mut track = None;
        if let Some(section) = image.mtp.take() {
            let free = &mut inner.free_cells;
            let mut taken = Vec::new();
            let held = router_book::spec::restored_track(section, |row| {
                let Some(cell) = free.pop() else {
                    return Ok(None);
                };
                taken.push(cell);
                self.runtime()
                    .upload(self.cell(cell)?, &f32_bytes(&row), Stream::Compute)?;
                Ok::<_, CudaError>(Some(cell))
            });
            match held {
                Ok(held) => track = Some(held),
                Err(err) => {
                    inner.free_cells.extend(taken);
                    book::restore_abort(&mut inner.book(), blocks);
                    return Err(effect_err(err));
                }
            }
        }
        book::restore_commit(&mut inner.book(), seq, image, slot, blocks, None);
        if let (Some(track), Some(tenure)) = (track, seq.tenure) {
            inner.mtp.insert(tenure, track);
        }
        Ok(EffectOutcome::Unit)
    }

    fn read_logits(
        &self,
        inner: &Inner,
        handle: LogitsHandle,
        rows: usize,
        into: &mut Vec<u8>,
    ) -> Result<EffectOutcome> {
        let Some(held) = inner.logits.iter().find(|l| l.step == handle.step).copied() else {
            let steps: Vec<u64> = inner.logits.iter().map(|l| l.step).collect();
            return Err(book::logits_not_held(handle.step, &steps));
        };
        book::check_logit_rows(handle.step, rows, held.rows)?;
        let row_bytes = 4 * self.model_config().vocab_size;
        let half = (self.plan().logits_bytes / 2) as usize;
        let bytes = rows * row_bytes;
        let run = || -> std::result::Result<Vec<u8>, CudaError> {
            let rt = self.runtime();
            let mut out = vec![0u8; bytes];
            if bytes == 0 {
                return Ok(out);
            }
            let src = self.buffers()?.logits.range(held.half * half, bytes)?;
            // The step's logits are complete once the compute stream has passed it.
            let joined = self.join_event()?;
            rt.record(joined, Stream::Compute)?;
            rt.wait_event(Stream::Copy, joined)?;
            let mut scratch = Scratch::new(rt);
            let pinned = scratch.pinned(bytes)?;
            rt.copy_to_pinned(&scratch.pinned[pinned], 0, src, Stream::Copy)?;
            rt.read_pinned(&scratch.pinned[pinned], 0, &mut out)?;
            scratch.finish()?;
            Ok(out)
        };
        *into = run().map_err(|err| device_error(Phase::Readback, err))?;
        Ok(EffectOutcome::HostLogits { elem_bytes: 4 })
    }

    /// `SaveHiddenCatchup`: keeps the hidden state of row `row` of the latest settled step at
    /// position `pos` in a free catch-up cell of the row's sequence's ring (a copy on the compute
    /// stream from the step's half of `step_hidden`, which the step after next overwrites, in
    /// stream order after this copy). A no-op without an MTP head; the host router's checks and
    /// messages. With every cell taken (more live tenures than slots hold rings) the position is
    /// not kept: the head skips it, as a full ring's oldest.
    fn save_hidden(&self, inner: &mut Inner, row: usize, pos: usize) -> Result<EffectOutcome> {
        let layout = *self.mtp_layout();
        if layout.total == 0 {
            return Ok(EffectOutcome::Unit);
        }
        let kept = inner
            .step_hidden
            .iter()
            .map(|h| (h.ticket, &h.rows[..], h.half));
        let (half, tenure, hidden_row) =
            router_book::spec::catchup_source(&inner.tenures, inner.settled, kept, row, pos)?;
        let track = inner.mtp.entry(tenure).or_default();
        if pos < track.consumed || track.ring.contains_key(&pos) {
            return Ok(EffectOutcome::Unit);
        }
        let Some(cell) = inner.free_cells.pop() else {
            tracing::debug!(
                tenure,
                pos,
                "no free MTP catch-up cell; the head skips the position"
            );
            return Ok(EffectOutcome::Unit);
        };
        let row_bytes = layout.row as usize;
        let copied = (|| -> std::result::Result<(), CudaError> {
            let src = self.mtp_region(
                layout.step_hidden as usize + half * layout.half as usize + hidden_row * row_bytes,
                row_bytes,
            )?;
            let dst = self.cell(cell)?;
            self.runtime().copy(dst, src, Stream::Compute)
        })();
        if let Err(err) = copied {
            inner.free_cells.push(cell);
            return Err(effect_err(err));
        }
        let track = inner.mtp.entry(tenure).or_default();
        let forgotten = track.keep(pos, cell);
        inner.free_cells.extend(forgotten);
        Ok(EffectOutcome::Unit)
    }

    /// A checkpoint a sequence just took at `pos`: the hidden states its MTP head's rerun at a
    /// hit needs, when its catch-up ring holds them (`router_book::spec::checkpoint_head`),
    /// copied from the ring's cells to the rows stored with the checkpoint, behind the work
    /// queued before.
    fn stash_head(
        &self,
        inner: &mut Inner,
        tenure: Option<u64>,
        slot: router_book::CheckpointSlot,
        pos: usize,
    ) -> Result<()> {
        let head =
            router_book::spec::checkpoint_head(&inner.mtp, tenure, &mut inner.cache, slot, pos);
        let Some(cells) = head else {
            return Ok(());
        };
        for (i, &cell) in cells.into_iter().enumerate() {
            let copied = self.mark_rows(slot.index(), i, 1).and_then(|stored| {
                self.runtime()
                    .copy(stored, self.cell(cell)?, Stream::Compute)
            });
            copied.map_err(effect_err)?;
        }
        Ok(())
    }

    /// `bytes` bytes at `offset` of the MTP regions.
    pub(crate) fn mtp_region(
        &self,
        offset: usize,
        bytes: usize,
    ) -> std::result::Result<DeviceSlice, CudaError> {
        self.buffers()?
            .mtp
            .as_ref()
            .ok_or_else(|| CudaError::BadRange("the model has no MTP head".to_owned()))?
            .range(offset, bytes)
    }

    /// Row `row` of the hidden rows stored with checkpoint slot `checkpoint` (the MTP head's
    /// rerun at a prefix hit; `rows` rows from there).
    pub(crate) fn mark_rows(
        &self,
        checkpoint: usize,
        row: usize,
        rows: usize,
    ) -> std::result::Result<DeviceSlice, CudaError> {
        let bytes = self.mtp_layout().row as usize;
        let per_slot = self.plan().mark_bytes as usize;
        if (row + rows) * bytes > per_slot {
            return Err(CudaError::BadRange(format!(
                "rows {row}..{} of a checkpoint's {} stored hidden rows",
                row + rows,
                per_slot / bytes.max(1)
            )));
        }
        self.buffers()?
            .marks
            .as_ref()
            .ok_or_else(|| CudaError::BadRange("the MTP head does not rerun at a hit".to_owned()))?
            .range(checkpoint * per_slot + row * bytes, rows * bytes)
    }

    /// Catch-up cell `cell`.
    pub(crate) fn cell(&self, cell: u32) -> std::result::Result<DeviceSlice, CudaError> {
        let layout = self.mtp_layout();
        let row = layout.row as usize;
        self.mtp_region(layout.cells as usize + cell as usize * row, row)
    }

    fn quiesce(&self, stream: u64) -> Result<EffectOutcome> {
        let Some(which) = Stream::from_index(stream) else {
            return Err(invalid(
                "Quiesce",
                format!("stream {stream}: this router has streams 0 (compute) and 1 (copy)"),
            ));
        };
        self.runtime().sync_stream(which).map_err(effect_err)?;
        Ok(EffectOutcome::Unit)
    }

    fn sync_secondary(&self) -> Result<EffectOutcome> {
        let run = || -> std::result::Result<(), CudaError> {
            let joined = self.join_event()?;
            self.runtime().record(joined, Stream::Compute)?;
            self.runtime().wait_event(Stream::Copy, joined)
        };
        run().map_err(effect_err)?;
        Ok(EffectOutcome::Unit)
    }

    fn lock(&self) -> Result<std::sync::MutexGuard<'_, Inner>> {
        self.inner()
            .lock()
            .map_err(|_| DeviceError::DeviceLost("router state poisoned by a panic".to_owned()))
    }
}

impl DeviceIo for CudaRouter {
    type Seq = RouterSeq;
    type Ptr = LogitsHandle;
    /// The CUDA router keeps the weights on the device only; the host keeps the config.
    type Model = model::Config;
    type LoraCmd = LoraCommand;
    type LoraAck = LoraAck;

    fn model(&self) -> &model::Config {
        self.model_config()
    }

    fn facts(&self) -> DeviceFacts {
        let Ok(inner) = self.lock() else {
            return DeviceFacts::default();
        };
        let plan = self.plan();
        DeviceFacts {
            block_size: plan.block_size,
            vocab_size: self.model_config().vocab_size,
            max_context: self.router_config().max_context,
            kv_blocks_total: plan.num_blocks,
            kv_blocks_free: inner.cache.free_blocks(),
            kv_blocks_cached: inner.cache.cached_blocks(),
            live_slots_total: plan.live_slots,
            live_slots_used: inner.slots.iter().filter(|s| s.is_some()).count(),
            checkpoint_slots_total: plan.checkpoint_slots,
            checkpoint_slots_used: inner.cache.checkpoint_slots_used(),
            snapshot_slots_total: plan.snapshot_slots,
        }
    }

    fn max_depth(&self) -> usize {
        self.router_config().max_depth
    }

    /// Runs the plans' shared bookkeeping, then enqueues the step on the compute stream and
    /// returns at once (see the `step` module); `Draft` answers `Unsupported` on a model
    /// without an MTP head.
    fn launch(&self, plan: StepPlan<'_>, rows: &mut [&mut RouterSeq]) -> Result<Ticket> {
        let mut inner = self.lock()?;
        self.launch_step(&mut inner, plan, rows)
    }

    /// Waits for the step's event and reads its argmax back (see the `step` module).
    fn await_result(&self, ticket: Ticket) -> Result<StepResult<LogitsHandle>> {
        let mut inner = self.lock()?;
        self.await_step(&mut inner, ticket)
    }

    fn apply(&self, effect: Effect<'_, RouterSeq, LogitsHandle>) -> Result<EffectOutcome> {
        let mut inner = self.lock()?;
        let shape = *self.book_shape();
        let mut copy = |from: usize, to: usize| self.copy_row(from, to);
        match effect {
            Effect::ReleaseSeq { seq, cache, what } => {
                book::sync(&mut inner.book(), seq);
                let tenure = seq.tenure;
                let head_exact = tenure
                    .and_then(|tenure| inner.mtp.get(&tenure))
                    .map(|track| track.exact);
                book::release(&shape, &mut inner.book(), seq, cache, what, head_exact)?;
                inner.drop_track(tenure);
                Ok(EffectOutcome::Unit)
            }
            Effect::CompactSlot { seq, target } => {
                book::sync(&mut inner.book(), seq);
                book::compact(&shape, &mut inner.book(), seq, target, &mut copy)
            }
            Effect::DetachSlot { seq } => {
                book::sync(&mut inner.book(), seq);
                book::detach(&mut inner.book(), seq)
            }
            Effect::SaveSequenceState { seq, writer } => self.save(&mut inner, seq, writer),
            Effect::RestoreSequenceState { seq, reader } => self.restore(&mut inner, seq, reader),
            Effect::ReadLogits { logits, rows, into } => {
                self.read_logits(&inner, logits, rows, into)
            }
            Effect::MarconiCheckpoint { seq } => {
                book::sync(&mut inner.book(), seq);
                // A boundary a `Verify` run passed comes from the snapshot the run wrote for it:
                // the main model's Mamba layers, the MTP head's from the live row.
                let mut copy_layers = |from, to, main_only| self.copy_layers(from, to, main_only);
                let before = seq.output_checkpoint;
                let outcome = book::marconi_checkpoint_layered(
                    &shape,
                    &mut inner.book(),
                    seq,
                    &mut copy_layers,
                )?;
                match seq.output_checkpoint {
                    Some((pos, slot)) if shape.head_rerun && seq.output_checkpoint != before => {
                        self.stash_head(&mut inner, seq.tenure, slot, pos)?;
                    }
                    _ => {}
                }
                Ok(outcome)
            }
            Effect::SsmSnapshotSave { seq, slot } => {
                book::snapshot_save(&shape, &mut inner.book(), seq, slot, &mut copy)
            }
            Effect::SsmSnapshotRestore { seq, slot } => {
                book::sync(&mut inner.book(), seq);
                // A snapshot a `Verify` wrote holds the main model's Mamba layers only.
                let mut copy_ring = |from, to, main_only| self.copy_layers(from, to, main_only);
                book::snapshot_restore(&shape, &mut inner.book(), seq, slot, &mut copy_ring)
            }
            Effect::ReserveKv { seq } => {
                book::sync(&mut inner.book(), seq);
                book::reserve_kv(&shape, &mut inner.book(), seq)
            }
            Effect::Rollback { seq } => {
                book::sync(&mut inner.book(), seq);
                let at = book::rollback(&shape, &mut inner.book(), seq)?;
                inner.forget_catchup(seq.tenure, at);
                Ok(EffectOutcome::Unit)
            }
            Effect::TruncateKv { seq, len } => {
                book::sync(&mut inner.book(), seq);
                let len = book::truncate_kv(&shape, &mut inner.book(), seq, len)?;
                inner.forget_catchup(seq.tenure, len);
                Ok(EffectOutcome::Unit)
            }
            Effect::Quiesce { stream } => self.quiesce(stream),
            Effect::SyncSecondary => self.sync_secondary(),
            Effect::SaveHiddenCatchup { row, pos } => self.save_hidden(&mut inner, row, pos),
            // No expert workers: one device.
            Effect::EpShutdown => Ok(EffectOutcome::Unit),
        }
    }

    fn clear_prefix_cache(&self) -> Result<()> {
        self.lock()?.cache.clear();
        Ok(())
    }

    /// The prefix cache's events, as the host router publishes them (`router_book::events`: the
    /// same bookkeeping, so the same events).
    fn subscribe_cache_events(&self, sink: Box<dyn CacheEventSink>) -> Result<()> {
        self.lock()?.cache.subscribe(sink);
        Ok(())
    }

    fn lora(&mut self, cmd: LoraCommand) -> std::result::Result<LoraAck, LoraError> {
        drop(cmd);
        Err(LoraError::Unsupported {
            what: "LoRA (the CUDA router has no adapter slots yet)",
        })
    }

    /// Waits for both streams, frees every region, and reports the sequences that still held
    /// resources and the steps never awaited (as the host router does), and any device error.
    fn teardown(self: Box<Self>) -> Result<()> {
        let (inner, freed) = self.into_parts();
        let mut problems = Vec::new();
        if let Err(err) = freed {
            problems.push(format!("freeing device memory: {err}"));
        }
        match inner {
            Ok(mut inner) => {
                let holders = book::holders(&inner.tenures);
                inner.cache.clear();
                if !holders.is_empty() {
                    problems.push(format!(
                        "{} sequence(s) still held resources at teardown: {}",
                        holders.len(),
                        holders.join(", ")
                    ));
                }
                if !inner.unsettled.is_empty() {
                    let unclaimed: Vec<String> =
                        inner.unsettled.iter().map(u64::to_string).collect();
                    problems.push(format!(
                        "{} launched step(s) were never awaited: ticket {}",
                        unclaimed.len(),
                        unclaimed.join(", ticket ")
                    ));
                }
            }
            Err(message) => problems.push(message),
        }
        if problems.is_empty() {
            Ok(())
        } else {
            Err(DeviceError::Failed {
                phase: Phase::Teardown,
                message: problems.join("; "),
            })
        }
    }
}
