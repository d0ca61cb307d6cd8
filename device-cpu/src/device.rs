//! The host router's device side: the memory steps compute on, the jobs that change it, and the
//! executor that runs those jobs, inline on the caller's thread (depth 1) or in order on a worker
//! thread fed by a `crossbeam-channel` (depth 2).
//!
//! The router splits every plan and effect into *bookkeeping*, done at once on the caller's
//! thread under the router's state lock (slots, blocks, the prefix cache, sequence lengths), and
//! *device work*, a [`Work`] item that only touches [`Device`]: computing a step, copying a state
//! slot. Device work runs in submission order, as on one device stream, so bookkeeping may run
//! ahead of it: a block freed by the bookkeeping while an earlier step still writes it is only
//! handed to work submitted later. Anything that needs device data back (`SaveSequenceState`,
//! `ReadLogits`, host logits) waits for the work before it ([`Executor::fence`]).
//!
//! # Invariants
//!
//! - `feed[i]` is the argmax (masked when the step was masked) of row `i` of step `feed_step`,
//!   the latest step that computed successfully; a fed step whose source is not `feed_step` fails
//!   (`router_book::plans::check_feed_source`, the CUDA router's rule too).
//! - `logits` holds one buffer per step that may still be read (the router's depth); a buffer
//!   names its step, and a failed step leaves none.
//! - `failed` names the tenures of the rows of failed steps; a later step with such a row fails
//!   too, so it never computes on an unspecified state.
//! - `fault`, once set (a copy that failed: a router bug), fails every later step.

use std::collections::BTreeSet;
use std::ops::Range;
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;

use crossbeam_channel::{Receiver, Sender};
use device_io::{DeviceError, PrefillReport, Result, RowOutput, StepResult, Ticket, TokenRun};
use model::{
    DecodeRow, KvPool, LoraAdapter, MambaStates, Model, PrefillRow, RunOutputs, RunRow, Scratch,
};

use crate::{LogitsHandle, StepHidden};

/// The memory a step computes on.
pub(crate) struct Device {
    pub kv: KvPool,
    pub states: MambaStates,
    pub scratch: Scratch,
    row_logits: Vec<f32>,
    logits: Vec<LogitsBuffer>,
    feed: Vec<u32>,
    feed_step: Option<u64>,
    failed: BTreeSet<u64>,
    fault: Option<String>,
    /// Per checkpoint slot: the main model's hidden states stored with the checkpoint it holds
    /// for the MTP head's rerun at a prefix hit (`router_book::spec`), rows back to back; what a
    /// mark ([`router_book::HeadMark`]) names, written by the device work before the hit's.
    pub checkpoint_hidden: Vec<Vec<f32>>,
}

/// The logits of one step (`rows` rows of `vocab` floats).
#[derive(Default)]
struct LogitsBuffer {
    step: Option<u64>,
    rows: usize,
    data: Vec<f32>,
}

impl Device {
    pub fn new(
        kv: KvPool,
        states: MambaStates,
        scratch: Scratch,
        depth: usize,
        checkpoint_slots: usize,
    ) -> Self {
        Device {
            checkpoint_hidden: vec![Vec::new(); checkpoint_slots],
            kv,
            states,
            scratch,
            row_logits: Vec::new(),
            logits: (0..depth.max(1)).map(|_| LogitsBuffer::default()).collect(),
            feed: Vec::new(),
            feed_step: None,
            failed: BTreeSet::new(),
            fault: None,
        }
    }

    /// The logits of `step` (`rows`, data), if a buffer still holds them.
    pub fn logits_of(&self, step: u64) -> Option<(usize, &[f32])> {
        self.logits
            .iter()
            .find(|buffer| buffer.step == Some(step))
            .map(|buffer| (buffer.rows, &buffer.data[..]))
    }

    /// The steps whose logits are held, oldest first.
    pub fn logits_steps(&self) -> Vec<u64> {
        let mut steps: Vec<u64> = self.logits.iter().filter_map(|b| b.step).collect();
        steps.sort_unstable();
        steps
    }
}

/// One device operation of a job; ranges index the job's `tokens` and `blocks`.
#[derive(Debug, Clone)]
pub(crate) enum Op {
    /// Zero live-state row `0`.
    ZeroSlot(usize),
    /// Copy state row `from` to state row `to`.
    CopySlot { from: usize, to: usize },
    /// Copy the Mamba layers `layers` of state row `from` to state row `to`.
    CopyLayers {
        from: usize,
        to: usize,
        layers: Range<usize>,
    },
    /// Copy KV block `from` over block `to`.
    CopyBlock { from: u32, to: u32 },
    /// Store hidden rows with checkpoint slot `checkpoint` (`Device::checkpoint_hidden`).
    StoreHidden { checkpoint: usize, rows: Vec<f32> },
    /// Compute a prompt chunk of one row; `emit` appends its last position's logits to the
    /// step's logits.
    Prefill {
        tokens: Range<usize>,
        start_pos: usize,
        blocks: Range<usize>,
        slot: usize,
        emit: bool,
        /// On a model with an MTP head: the head's part of the chunk.
        mtp: Option<MtpChunk>,
        /// The row's LoRA adapter.
        lora: Option<Arc<LoraAdapter>>,
    },
}

/// The MTP head over a prefill chunk: it consumes `lead` positions before the chunk (from the
/// hidden rows stored with a checkpoint, after a prefix hit) and the chunk's first
/// `next.len() - lead.rows` positions, the next tokens of all of them `tokens[next]`; `keep` (the
/// row's tenure) keeps the chunk's last position's hidden state in the row's catch-up ring (the
/// prompt's last position, whose next token is not known yet); `stash` stores it with a
/// checkpoint instead.
#[derive(Debug, Clone)]
pub(crate) struct MtpChunk {
    pub next: Range<usize>,
    pub keep: Option<u64>,
    /// The rerun after a hit: the checkpoint slot whose hidden rows come first, and how many.
    pub lead: Option<(usize, usize)>,
    /// The checkpoint slot the chunk's last hidden state is stored with.
    pub stash: Option<usize>,
}

/// One row of a verification: `tokens` at `start..`, with a snapshot state row per token.
#[derive(Debug, Clone)]
pub(crate) struct RunJobRow {
    pub tokens: Range<usize>,
    pub start: usize,
    pub blocks: Range<usize>,
    pub slot: usize,
    pub snapshots: Vec<usize>,
    /// The row's LoRA adapter.
    pub lora: Option<Arc<LoraAdapter>>,
}

/// One row of a draft: the catch-up over the ring (none: the row drafts nothing), then the
/// drafts from position `next_pos` (the row's next token's) on state row `scratch`.
#[derive(Debug, Clone)]
pub(crate) struct DraftJobRow {
    pub catchup: Option<Catchup>,
    pub next_pos: usize,
    pub blocks: Range<usize>,
    pub slot: usize,
    pub scratch: usize,
}

/// The head's catch-up: positions `start..start + next.len()` with next tokens `tokens[next]`
/// and hidden inputs `hidden[rows]` (floats) of the draft job.
#[derive(Debug, Clone)]
pub(crate) struct Catchup {
    pub start: usize,
    pub next: Range<usize>,
    pub rows: Range<usize>,
}

/// A draft step: `k` drafts per row.
#[derive(Debug, Default)]
pub(crate) struct DraftJob {
    pub k: usize,
    pub rows: Vec<DraftJobRow>,
    pub hidden: Vec<f32>,
}

/// Where a decode row's input token comes from (the shared bookkeeping's).
pub(crate) use router_book::plans::Input;

/// One row of a batched decode.
#[derive(Debug, Clone)]
pub(crate) struct DecodeJobRow {
    pub input: Input,
    pub pos: usize,
    pub blocks: Range<usize>,
    pub slot: usize,
    /// The row's LoRA adapter.
    pub lora: Option<Arc<LoraAdapter>>,
}

/// A step's device work and what its result needs.
#[derive(Debug, Default)]
pub(crate) struct StepJob {
    pub ticket: u64,
    /// Prefill work (slot setup, chunks, checkpoint copies), in order.
    pub ops: Vec<Op>,
    /// One batched decode after `ops`, when not empty.
    pub decode: Vec<DecodeJobRow>,
    pub tokens: Vec<u32>,
    pub blocks: Vec<u32>,
    /// Empty, or one `vocab`-long mask per plan row, flattened.
    pub masks: Vec<bool>,
    /// Per plan row: its row in the step's logits, when it reaches a token position.
    pub token_rows: Vec<Option<usize>>,
    pub reports: Option<Vec<PrefillReport>>,
    /// `Some` (an emptied buffer to fill) when the host wants every logit.
    pub host_logits: Option<Vec<f32>>,
    /// The step a fed row takes its input from.
    pub fed_from: Option<u64>,
    /// The rows' tenures, in row order.
    pub tenures: Vec<u64>,
    pub vocab: usize,
    /// A verification's rows (then `decode` and `ops` are empty).
    pub runs: Vec<RunJobRow>,
    /// A draft (then everything else is empty).
    pub draft: Option<DraftJob>,
    /// Keep the hidden states of the decode or verification rows (a model with an MTP head).
    pub keep_hidden: bool,
    pub hidden_size: usize,
    /// Fail the step after it ran, with what it wrote overwritten (`router_book::StepFaults`).
    pub injected_fault: bool,
}

/// A computed (or failed) step.
#[derive(Debug)]
pub(crate) struct Completed {
    pub ticket: u64,
    pub result: Result<StepResult<LogitsHandle>>,
    /// Per plan row: the token its feed cell now holds.
    pub argmax: Vec<Option<u32>>,
    pub tenures: Vec<u64>,
    /// The filled host-logits buffer, when asked for.
    pub host_logits: Option<Vec<f32>>,
    /// Prefill: the hidden states kept in a ring (tenure, position, row).
    pub kept: Vec<(u64, usize, Vec<f32>)>,
    /// Decode or verification rows' hidden states, when kept.
    pub hidden: Option<StepHidden>,
}

/// An item of device work.
pub(crate) enum Work {
    Step(Box<StepJob>),
    Copies(Vec<Op>),
    /// Answered with [`Done::Fence`] once everything before it ran.
    Fence,
}

pub(crate) enum Done {
    Step(Box<Completed>),
    Fence,
}

/// The index of the largest value (the first one on ties), as `torch.argmax` picks it; with a
/// mask, over the allowed values only.
pub(crate) fn argmax(row: &[f32], mask: Option<&[bool]>) -> u32 {
    let mut best: Option<usize> = None;
    for (i, &value) in row.iter().enumerate() {
        if mask.is_some_and(|mask| !mask[i]) {
            continue;
        }
        if best.is_none_or(|b| value > row[b]) {
            best = Some(i);
        }
    }
    best.unwrap_or(0) as u32
}

fn forward_failed(message: String) -> DeviceError {
    DeviceError::Failed {
        phase: device_io::Phase::Forward,
        message,
    }
}

/// Stores `rows` with checkpoint slot `checkpoint`.
fn store_hidden(
    store: &mut [Vec<f32>],
    checkpoint: usize,
    rows: &[f32],
) -> std::result::Result<(), model::ModelError> {
    let num_slots = store.len();
    let slot = store
        .get_mut(checkpoint)
        .ok_or(model::ModelError::BadSlot {
            slot: checkpoint,
            num_slots,
        })?;
    slot.clear();
    slot.extend_from_slice(rows);
    Ok(())
}

/// Runs copies (an effect's device work); a failure is a router bug that fails later steps.
fn run_copies(device: &mut Device, ops: &[Op]) -> std::result::Result<(), String> {
    for op in ops {
        let done = match *op {
            Op::ZeroSlot(slot) => device.states.zero_slot(slot),
            Op::CopySlot { from, to } => device.states.copy_slot(from, to),
            Op::CopyLayers {
                from,
                to,
                ref layers,
            } => device.states.copy_layers(from, to, layers.clone()),
            Op::CopyBlock { from, to } => device.kv.copy_block(from, to),
            Op::StoreHidden {
                checkpoint,
                ref rows,
            } => store_hidden(&mut device.checkpoint_hidden, checkpoint, rows),
            Op::Prefill { .. } => Ok(()),
        };
        if let Err(err) = done {
            let message = format!("a device copy failed: {err}");
            tracing::error!(%message, "device fault; every later step fails");
            device.fault = Some(message.clone());
            return Err(message);
        }
    }
    Ok(())
}

/// Computes one step on `device`.
pub(crate) fn run_step(model: &Model, device: &mut Device, mut job: StepJob) -> Completed {
    let rows = job.token_rows.len();
    let mut completed = Completed {
        ticket: job.ticket,
        result: Err(forward_failed(String::new())),
        argmax: vec![None; rows],
        tenures: std::mem::take(&mut job.tenures),
        host_logits: None,
        kept: Vec::new(),
        hidden: None,
    };
    let fail = |device: &mut Device, completed: &mut Completed, err: DeviceError| {
        device.failed.extend(completed.tenures.iter().copied());
        completed.result = Err(err);
    };
    if let Some(fault) = &device.fault {
        let err = DeviceError::DeviceLost(fault.clone());
        fail(device, &mut completed, err);
        return completed;
    }
    // Before the rows' own check, which a fed step over a failed source also fails (its fed
    // rows were that step's), so the error names the cause, as on the CUDA router.
    if let Err(err) = router_book::plans::check_feed_source(job.fed_from, device.feed_step) {
        fail(device, &mut completed, err);
        return completed;
    }
    if let Some(tenure) = completed
        .tenures
        .iter()
        .find(|tenure| device.failed.contains(tenure))
    {
        let err = forward_failed(format!(
            "a row (tenure {tenure}) failed in an earlier step; its state is unspecified"
        ));
        fail(device, &mut completed, err);
        return completed;
    }
    // The buffer of the oldest step held is the one this step overwrites.
    let index = (0..device.logits.len())
        .min_by_key(|&i| device.logits[i].step)
        .unwrap_or(0);
    let mut logits = std::mem::take(&mut device.logits[index].data);
    device.logits[index].step = None;
    logits.clear();
    let mut extra = Extra::default();
    let computed = compute(model, device, &job, &mut logits, &mut extra);
    let computed = match computed {
        Ok(()) if job.injected_fault => {
            // An injected device fault: the step ran, then everything it wrote turns to garbage.
            let scribbled = scribble(device, &job);
            device.logits[index].data = logits;
            let mut message = format!(
                "an injected device fault (StepFaults) in step {}",
                job.ticket
            );
            if let Err(err) = scribbled {
                message += &format!("; overwriting what it wrote failed: {err}");
            }
            fail(device, &mut completed, forward_failed(message));
            return completed;
        }
        computed => computed,
    };
    match computed {
        Ok(()) => {}
        Err(err @ model::ModelError::ExpertWorkerLost { .. }) => {
            // A lost expert worker leaves the step's layers half run: the router is lost.
            device.logits[index].data = logits;
            let message = err.to_string();
            tracing::error!(%message, "expert worker lost; every later step fails");
            device.fault = Some(message.clone());
            fail(device, &mut completed, DeviceError::DeviceLost(message));
            return completed;
        }
        Err(err) => {
            device.logits[index].data = logits;
            fail(device, &mut completed, forward_failed(err.to_string()));
            return completed;
        }
    }
    let vocab = job.vocab.max(1);
    let logits_rows = logits.len() / vocab;
    let host = job.host_logits.is_some();
    let mut outputs = Vec::with_capacity(rows);
    completed.kept = std::mem::take(&mut extra.kept);
    if job.keep_hidden {
        let mut table = Vec::with_capacity(rows);
        let mut offset = 0;
        for (i, &tenure) in completed.tenures.iter().enumerate() {
            let (start, len) = match job.runs.get(i) {
                Some(run) => (run.start, run.tokens.len()),
                None => (job.decode[i].pos, 1),
            };
            table.push((tenure, start, len, offset));
            offset += len;
        }
        completed.hidden = Some(StepHidden {
            ticket: job.ticket,
            rows: table,
            width: job.hidden_size,
            data: std::mem::take(&mut extra.hidden),
        });
    }
    let mut tokens = Vec::new();
    if let Some(draft) = &job.draft {
        // Drafts: no logits, no feed cells.
        device.feed_step = None;
        device.logits[index].data = logits;
        let mut start = 0;
        for row in &draft.rows {
            let len = if row.catchup.is_some() { draft.k } else { 0 };
            outputs.push(RowOutput {
                run: Some(TokenRun { start, len }),
                ..RowOutput::default()
            });
            start += len;
        }
        completed.result = Ok(StepResult {
            ticket: Ticket(job.ticket),
            rows: outputs,
            logits: None,
            tokens: extra.tokens,
        });
        return completed;
    }
    if !job.runs.is_empty() {
        // A verification: every position's argmax; no feed cells (the core truncates).
        device.feed.clear();
        device.feed_step = None;
        let mut start = 0;
        for run in &job.runs {
            let len = run.tokens.len();
            for row in start..start + len {
                tokens.push(argmax(&logits[row * vocab..(row + 1) * vocab], None));
            }
            outputs.push(RowOutput {
                logits_row: host.then_some(start),
                run: Some(TokenRun { start, len }),
                ..RowOutput::default()
            });
            start += len;
        }
    }
    if job.runs.is_empty() {
        device.feed.clear();
    }
    let token_rows: &[Option<usize>] = if job.runs.is_empty() {
        &job.token_rows
    } else {
        &[]
    };
    for (i, &token_row) in token_rows.iter().enumerate() {
        let mut out = RowOutput {
            prefill: job.reports.as_ref().map(|reports| reports[i]),
            ..RowOutput::default()
        };
        let mut cell = 0;
        if let Some(row) = token_row {
            let mask = (!job.masks.is_empty()).then(|| &job.masks[i * vocab..(i + 1) * vocab]);
            let token = argmax(&logits[row * vocab..(row + 1) * vocab], mask);
            completed.argmax[i] = Some(token);
            cell = token;
            if host {
                out.logits_row = Some(row);
            } else {
                out.token = Some(token);
            }
        }
        device.feed.push(cell);
        outputs.push(out);
    }
    if job.runs.is_empty() {
        device.feed_step = Some(job.ticket);
    }
    if let Some(mut into) = job.host_logits.take() {
        into.clear();
        into.extend_from_slice(&logits);
        completed.host_logits = Some(into);
    }
    let buffer = &mut device.logits[index];
    buffer.data = logits;
    buffer.rows = logits_rows;
    buffer.step = Some(job.ticket);
    completed.result = Ok(StepResult {
        ticket: Ticket(job.ticket),
        rows: outputs,
        logits: (logits_rows > 0).then_some(LogitsHandle { step: job.ticket }),
        tokens,
    });
    completed
}

/// Overwrites everything `job` wrote with [`router_book::FAULT_GARBAGE`], as a device error
/// inside the step may leave it: the K/V of every position it computed (the MTP head's rerun
/// and drafts included), the Mamba layers of every state row it computed on, and every state
/// row, block and stored hidden row it copied or zeroed.
fn scribble(device: &mut Device, job: &StepJob) -> std::result::Result<(), model::ModelError> {
    let garbage = router_book::FAULT_GARBAGE;
    let block_size = device.kv.block_size();
    let state_floats = device.states.layout().state_floats();
    let Device {
        kv,
        states,
        checkpoint_hidden,
        ..
    } = device;
    let mut positions = |table: &[u32], range: Range<usize>| {
        for pos in range {
            let block = table.get(pos / block_size).copied().ok_or(
                model::ModelError::PositionBeyondBlocks {
                    position: pos,
                    blocks: table.len(),
                    block_size,
                    capacity: table.len() * block_size,
                },
            )?;
            kv.fill_offset(block, pos % block_size, garbage)?;
        }
        Ok::<(), model::ModelError>(())
    };
    let mut rows = Vec::new();
    let mut whole_rows = Vec::new();
    let mut hidden = Vec::new();
    for op in &job.ops {
        match op {
            Op::ZeroSlot(slot) | Op::CopySlot { to: slot, .. } => whole_rows.push(*slot),
            Op::CopyLayers { to, .. } => rows.push(*to),
            Op::CopyBlock { to, .. } => positions(&[*to], 0..block_size)?,
            Op::StoreHidden { checkpoint, .. } => hidden.push(*checkpoint),
            Op::Prefill {
                tokens,
                start_pos,
                blocks,
                slot,
                mtp,
                ..
            } => {
                let lead = mtp
                    .as_ref()
                    .and_then(|chunk| chunk.lead)
                    .map_or(0, |(_, rows)| rows);
                let table = &job.blocks[blocks.clone()];
                positions(table, start_pos - lead..start_pos + tokens.len())?;
                rows.push(*slot);
                hidden.extend(mtp.as_ref().and_then(|chunk| chunk.stash));
            }
        }
    }
    for row in &job.decode {
        positions(&job.blocks[row.blocks.clone()], row.pos..row.pos + 1)?;
        rows.push(row.slot);
    }
    for run in &job.runs {
        let table = &job.blocks[run.blocks.clone()];
        positions(table, run.start..run.start + run.tokens.len())?;
        rows.push(run.slot);
        rows.extend(&run.snapshots);
    }
    if let Some(draft) = &job.draft {
        for row in &draft.rows {
            let Some(catchup) = &row.catchup else {
                continue;
            };
            let table = &job.blocks[row.blocks.clone()];
            positions(table, catchup.start..catchup.start + catchup.next.len())?;
            positions(
                table,
                row.next_pos..row.next_pos + draft.k.saturating_sub(1),
            )?;
            rows.extend([row.slot, row.scratch]);
        }
    }
    for row in rows {
        states.slot_mut(row)?[..state_floats].fill(garbage);
    }
    for row in whole_rows {
        states.slot_mut(row)?.fill(garbage);
    }
    for checkpoint in hidden {
        if let Some(stored) = checkpoint_hidden.get_mut(checkpoint) {
            stored.fill(garbage);
        }
    }
    Ok(())
}

/// What a step computes besides its logits.
#[derive(Default)]
struct Extra {
    /// Prefill: hidden rows kept in rings.
    kept: Vec<(u64, usize, Vec<f32>)>,
    /// Decode / verification rows' hidden states, when kept.
    hidden: Vec<f32>,
    /// A draft's tokens.
    tokens: Vec<u32>,
}

fn compute(
    model: &Model,
    device: &mut Device,
    job: &StepJob,
    logits: &mut Vec<f32>,
    extra: &mut Extra,
) -> std::result::Result<(), model::ModelError> {
    if let Some(draft) = &job.draft {
        return compute_draft(model, device, job, draft, extra);
    }
    let Device {
        kv,
        states,
        scratch,
        row_logits,
        feed,
        checkpoint_hidden,
        ..
    } = device;
    for op in &job.ops {
        match op {
            Op::ZeroSlot(slot) => states.zero_slot(*slot)?,
            Op::CopySlot { from, to } => states.copy_slot(*from, *to)?,
            Op::CopyLayers { from, to, layers } => {
                states.copy_layers(*from, *to, layers.clone())?
            }
            Op::CopyBlock { from, to } => kv.copy_block(*from, *to)?,
            Op::StoreHidden { checkpoint, rows } => {
                store_hidden(checkpoint_hidden, *checkpoint, rows)?
            }
            Op::Prefill {
                tokens,
                start_pos,
                blocks,
                slot,
                emit,
                mtp: None,
                lora,
            } => {
                let row = PrefillRow {
                    tokens: &job.tokens[tokens.clone()],
                    start_pos: *start_pos,
                    blocks: &job.blocks[blocks.clone()],
                    slot: *slot,
                };
                let adapter = lora.as_deref();
                model.prefill_with_adapter(scratch, kv, states, row, adapter, false, row_logits)?;
                if *emit {
                    logits.extend_from_slice(row_logits);
                }
            }
            Op::Prefill {
                tokens,
                start_pos,
                blocks,
                slot,
                emit,
                mtp: Some(chunk),
                lora,
            } => {
                // The main stack with every position's hidden state, then the MTP head over the
                // positions whose next token is known.
                let blocks = &job.blocks[blocks.clone()];
                let run = RunRow {
                    tokens: &job.tokens[tokens.clone()],
                    start_pos: *start_pos,
                    blocks,
                    slot: *slot,
                    snapshots: &[],
                };
                let mut hidden = Vec::new();
                model.forward_runs_with_adapters(
                    scratch,
                    kv,
                    states,
                    &[run],
                    &[lora.as_deref()],
                    RunOutputs::All,
                    row_logits,
                    Some(&mut hidden),
                )?;
                let n = tokens.len();
                let (vocab, d) = (job.vocab, job.hidden_size);
                if *emit {
                    logits.extend_from_slice(&row_logits[(n - 1) * vocab..n * vocab]);
                }
                let (lead_rows, mut head_in) = match chunk.lead {
                    Some((checkpoint, rows)) => {
                        let stored = checkpoint_hidden
                            .get(checkpoint)
                            .map_or(&[][..], |rows| &rows[..]);
                        if stored.len() != rows * d {
                            return Err(model::ModelError::LengthMismatch {
                                what: "hidden rows stored with a checkpoint",
                                expected: rows * d,
                                actual: stored.len(),
                            });
                        }
                        (rows, stored.to_vec())
                    }
                    None => (0, Vec::new()),
                };
                let consumed = chunk.next.len();
                if consumed > 0 {
                    head_in.extend_from_slice(&hidden[..(consumed - lead_rows) * d]);
                    let head = RunRow {
                        tokens: &job.tokens[chunk.next.clone()],
                        start_pos: *start_pos - lead_rows,
                        blocks,
                        slot: *slot,
                        snapshots: &[],
                    };
                    let (mut head_logits, mut head_out) = (Vec::new(), Vec::new());
                    model.mtp(
                        scratch,
                        kv,
                        states,
                        &[head],
                        &head_in,
                        RunOutputs::Last,
                        &mut head_logits,
                        &mut head_out,
                    )?;
                }
                let last = &hidden[(n - 1) * d..n * d];
                if let Some(tenure) = chunk.keep {
                    extra.kept.push((tenure, *start_pos + n - 1, last.to_vec()));
                }
                if let Some(checkpoint) = chunk.stash {
                    store_hidden(checkpoint_hidden, checkpoint, last)?;
                }
            }
        }
    }
    if !job.runs.is_empty() {
        let runs: Vec<RunRow<'_>> = job
            .runs
            .iter()
            .map(|run| RunRow {
                tokens: &job.tokens[run.tokens.clone()],
                start_pos: run.start,
                blocks: &job.blocks[run.blocks.clone()],
                slot: run.slot,
                snapshots: &run.snapshots,
            })
            .collect();
        let hidden = job.keep_hidden.then_some(&mut extra.hidden);
        let adapters: Vec<Option<&LoraAdapter>> =
            job.runs.iter().map(|run| run.lora.as_deref()).collect();
        model.forward_runs_with_adapters(
            scratch,
            kv,
            states,
            &runs,
            &adapters,
            RunOutputs::All,
            logits,
            hidden,
        )?;
        return Ok(());
    }
    if !job.decode.is_empty() && job.keep_hidden {
        // The same bits as `Model::decode`, with the hidden states the MTP head needs.
        let inputs: Vec<u32> = job
            .decode
            .iter()
            .map(|row| input_token(row.input, feed))
            .collect();
        let runs: Vec<RunRow<'_>> = job
            .decode
            .iter()
            .zip(&inputs)
            .map(|(row, token)| RunRow {
                tokens: std::slice::from_ref(token),
                start_pos: row.pos,
                blocks: &job.blocks[row.blocks.clone()],
                slot: row.slot,
                snapshots: &[],
            })
            .collect();
        let adapters: Vec<Option<&LoraAdapter>> =
            job.decode.iter().map(|row| row.lora.as_deref()).collect();
        model.forward_runs_with_adapters(
            scratch,
            kv,
            states,
            &runs,
            &adapters,
            RunOutputs::All,
            logits,
            Some(&mut extra.hidden),
        )?;
        return Ok(());
    }
    if !job.decode.is_empty() {
        let batch: Vec<DecodeRow<'_>> = job
            .decode
            .iter()
            .map(|row| DecodeRow {
                token: input_token(row.input, feed),
                pos: row.pos,
                blocks: &job.blocks[row.blocks.clone()],
                slot: row.slot,
            })
            .collect();
        let adapters: Vec<Option<&LoraAdapter>> = if job.decode.iter().any(|r| r.lora.is_some()) {
            job.decode.iter().map(|row| row.lora.as_deref()).collect()
        } else {
            Vec::new()
        };
        model.decode_with_adapters(scratch, kv, states, &batch, &adapters, logits)?;
    }
    Ok(())
}

/// A decode row's input token: the one the host gave, or the one its feed cell holds (`u32::MAX`,
/// which no vocabulary holds, where there is no such cell: the model refuses the row).
fn input_token(input: Input, feed: &[u32]) -> u32 {
    match input {
        Input::Token(token) => token,
        Input::Feed(source) => feed.get(source).copied().unwrap_or(u32::MAX),
    }
}

/// A draft step: the catch-up of every drafting row in one batch of the MTP head, then `k - 1`
/// batches of one position per row on the rows' scratch state rows.
fn compute_draft(
    model: &Model,
    device: &mut Device,
    job: &StepJob,
    draft: &DraftJob,
    extra: &mut Extra,
) -> std::result::Result<(), model::ModelError> {
    let Device {
        kv,
        states,
        scratch,
        ..
    } = device;
    let drafting: Vec<(&DraftJobRow, &Catchup)> = draft
        .rows
        .iter()
        .filter_map(|row| row.catchup.as_ref().map(|c| (row, c)))
        .collect();
    if drafting.is_empty() {
        return Ok(());
    }
    let (vocab, k) = (job.vocab, draft.k);
    let runs: Vec<RunRow<'_>> = drafting
        .iter()
        .map(|(row, catchup)| RunRow {
            tokens: &job.tokens[catchup.next.clone()],
            start_pos: catchup.start,
            blocks: &job.blocks[row.blocks.clone()],
            slot: row.slot,
            snapshots: &[],
        })
        .collect();
    let mut hidden_in = Vec::new();
    for (_, catchup) in &drafting {
        hidden_in.extend_from_slice(&draft.hidden[catchup.rows.clone()]);
    }
    let (mut logits, mut out) = (Vec::new(), Vec::new());
    model.mtp(
        scratch,
        kv,
        states,
        &runs,
        &hidden_in,
        RunOutputs::Last,
        &mut logits,
        &mut out,
    )?;
    let n = drafting.len();
    let mut drafts = vec![0u32; n * k];
    let mut current: Vec<u32> = (0..n)
        .map(|i| argmax(&logits[i * vocab..(i + 1) * vocab], None))
        .collect();
    for (i, &token) in current.iter().enumerate() {
        drafts[i * k] = token;
    }
    if k > 1 {
        // The drafts change the head's state: they run on a copy.
        for (row, _) in &drafting {
            if row.scratch != row.slot {
                states.copy_slot(row.slot, row.scratch)?;
            }
        }
        let mut g = out;
        for depth in 1..k {
            let runs: Vec<RunRow<'_>> = drafting
                .iter()
                .zip(&current)
                .map(|((row, _), token)| RunRow {
                    tokens: std::slice::from_ref(token),
                    start_pos: row.next_pos + depth - 1,
                    blocks: &job.blocks[row.blocks.clone()],
                    slot: row.scratch,
                    snapshots: &[],
                })
                .collect();
            let mut next_out = Vec::new();
            model.mtp(
                scratch,
                kv,
                states,
                &runs,
                &g,
                RunOutputs::Last,
                &mut logits,
                &mut next_out,
            )?;
            let next: Vec<u32> = (0..n)
                .map(|i| argmax(&logits[i * vocab..(i + 1) * vocab], None))
                .collect();
            drop(runs);
            current = next;
            for (i, &token) in current.iter().enumerate() {
                drafts[i * k + depth] = token;
            }
            g = next_out;
        }
    }
    extra.tokens = drafts;
    Ok(())
}

/// Locks the device memory; a poisoned lock means a step panicked: the device is lost.
pub(crate) fn lock(device: &Mutex<Device>) -> Result<MutexGuard<'_, Device>> {
    device
        .lock()
        .map_err(|_| DeviceError::DeviceLost("device memory poisoned by a panic".to_string()))
}

/// Runs device work: inline (depth 1) or on a worker thread (depth 2).
pub(crate) enum Executor {
    Inline {
        done: std::collections::VecDeque<Done>,
    },
    Worker {
        jobs: Option<Sender<Work>>,
        done: Receiver<Done>,
        thread: Option<JoinHandle<()>>,
    },
}

impl std::fmt::Debug for Executor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Executor::Inline { .. } => "Inline",
            Executor::Worker { .. } => "Worker",
        })
    }
}

fn worker_lost() -> DeviceError {
    DeviceError::DeviceLost("the router's worker thread stopped (a step panicked)".to_string())
}

impl Executor {
    pub fn inline() -> Self {
        Executor::Inline {
            done: std::collections::VecDeque::new(),
        }
    }

    /// Starts the worker thread over `model` and `device`.
    pub fn worker(model: Arc<Model>, device: Arc<Mutex<Device>>) -> std::io::Result<Self> {
        let (jobs_tx, jobs) = crossbeam_channel::unbounded::<Work>();
        let (done_tx, done) = crossbeam_channel::unbounded::<Done>();
        let thread = std::thread::Builder::new()
            .name("cpu-router-worker".to_string())
            .spawn(move || {
                for work in jobs {
                    let Ok(mut guard) = device.lock() else {
                        // A step panicked earlier: answering would claim work that never ran.
                        return;
                    };
                    let answer = match work {
                        Work::Step(job) => {
                            Some(Done::Step(Box::new(run_step(&model, &mut guard, *job))))
                        }
                        Work::Copies(ops) => {
                            let _ = run_copies(&mut guard, &ops);
                            None
                        }
                        Work::Fence => Some(Done::Fence),
                    };
                    drop(guard);
                    if let Some(answer) = answer {
                        if done_tx.send(answer).is_err() {
                            return;
                        }
                    }
                }
            })?;
        Ok(Executor::Worker {
            jobs: Some(jobs_tx),
            done,
            thread: Some(thread),
        })
    }

    /// Whether work runs on a worker thread.
    pub fn is_worker(&self) -> bool {
        matches!(self, Executor::Worker { .. })
    }

    /// Submits work; inline, it runs before this returns. Copies run inline answer their error.
    pub fn submit(&mut self, model: &Model, device: &Mutex<Device>, work: Work) -> Result<()> {
        match self {
            Executor::Inline { done } => {
                let mut guard = lock(device)?;
                match work {
                    Work::Step(job) => {
                        done.push_back(Done::Step(Box::new(run_step(model, &mut guard, *job))))
                    }
                    Work::Copies(ops) => {
                        run_copies(&mut guard, &ops).map_err(|message| DeviceError::Failed {
                            phase: device_io::Phase::Effect,
                            message,
                        })?;
                    }
                    Work::Fence => done.push_back(Done::Fence),
                }
                Ok(())
            }
            Executor::Worker { jobs, .. } => {
                let sender = jobs.as_ref().ok_or_else(worker_lost)?;
                sender.send(work).map_err(|_| worker_lost())
            }
        }
    }

    /// The next answer, waiting for it on a worker.
    pub fn receive(&mut self) -> Result<Done> {
        match self {
            Executor::Inline { done } => done.pop_front().ok_or_else(|| DeviceError::Invalid {
                what: "await_result",
                detail: "no device work is outstanding".to_string(),
            }),
            Executor::Worker { done, .. } => done.recv().map_err(|_| worker_lost()),
        }
    }

    /// Stops the worker after the work already submitted, and waits for it.
    pub fn shutdown(&mut self) -> std::result::Result<(), String> {
        if let Executor::Worker { jobs, thread, .. } = self {
            jobs.take();
            if let Some(thread) = thread.take() {
                return thread
                    .join()
                    .map_err(|_| "the worker thread panicked".to_string());
            }
        }
        Ok(())
    }
}

impl Drop for Executor {
    fn drop(&mut self) {
        let _ = self.shutdown();
    }
}
