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
//!   the latest step that computed successfully; a fed step whose source is not `feed_step` fails.
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
use device_io::{DeviceError, PrefillReport, Result, RowOutput, StepResult, Ticket};
use model::{DecodeRow, KvPool, MambaStates, Model, PrefillRow, Scratch};

use crate::LogitsHandle;

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
}

/// The logits of one step (`rows` rows of `vocab` floats).
#[derive(Default)]
struct LogitsBuffer {
    step: Option<u64>,
    rows: usize,
    data: Vec<f32>,
}

impl Device {
    pub fn new(kv: KvPool, states: MambaStates, scratch: Scratch, depth: usize) -> Self {
        Device {
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
    /// Compute a prompt chunk of one row; `emit` appends its last position's logits to the
    /// step's logits.
    Prefill {
        tokens: Range<usize>,
        start_pos: usize,
        blocks: Range<usize>,
        slot: usize,
        emit: bool,
    },
}

/// Where a decode row's input token comes from.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Input {
    Token(u32),
    /// The feed cell of this row of the source step.
    Feed(usize),
}

/// One row of a batched decode.
#[derive(Debug, Clone)]
pub(crate) struct DecodeJobRow {
    pub input: Input,
    pub pos: usize,
    pub blocks: Range<usize>,
    pub slot: usize,
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

/// Runs copies (an effect's device work); a failure is a router bug that fails later steps.
fn run_copies(device: &mut Device, ops: &[Op]) -> std::result::Result<(), String> {
    for op in ops {
        let done = match *op {
            Op::ZeroSlot(slot) => device.states.zero_slot(slot),
            Op::CopySlot { from, to } => device.states.copy_slot(from, to),
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
    if let Some(source) = job.fed_from {
        if device.feed_step != Some(source) {
            let err = forward_failed(format!(
                "its inputs come from ticket {source}, which failed"
            ));
            fail(device, &mut completed, err);
            return completed;
        }
    }
    // The buffer of the oldest step held is the one this step overwrites.
    let index = (0..device.logits.len())
        .min_by_key(|&i| device.logits[i].step)
        .unwrap_or(0);
    let mut logits = std::mem::take(&mut device.logits[index].data);
    device.logits[index].step = None;
    logits.clear();
    match compute(model, device, &job, &mut logits) {
        Ok(()) => {}
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
    device.feed.clear();
    for (i, &token_row) in job.token_rows.iter().enumerate() {
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
    device.feed_step = Some(job.ticket);
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
        tokens: Vec::new(),
    });
    completed
}

fn compute(
    model: &Model,
    device: &mut Device,
    job: &StepJob,
    logits: &mut Vec<f32>,
) -> std::result::Result<(), model::ModelError> {
    let Device {
        kv,
        states,
        scratch,
        row_logits,
        feed,
        ..
    } = device;
    for op in &job.ops {
        match op {
            Op::ZeroSlot(slot) => states.zero_slot(*slot)?,
            Op::CopySlot { from, to } => states.copy_slot(*from, *to)?,
            Op::Prefill {
                tokens,
                start_pos,
                blocks,
                slot,
                emit,
            } => {
                let row = PrefillRow {
                    tokens: &job.tokens[tokens.clone()],
                    start_pos: *start_pos,
                    blocks: &job.blocks[blocks.clone()],
                    slot: *slot,
                };
                model.prefill(scratch, kv, states, row, false, row_logits)?;
                if *emit {
                    logits.extend_from_slice(row_logits);
                }
            }
        }
    }
    if !job.decode.is_empty() {
        let batch: Vec<DecodeRow<'_>> = job
            .decode
            .iter()
            .map(|row| DecodeRow {
                token: match row.input {
                    Input::Token(token) => token,
                    Input::Feed(source) => feed.get(source).copied().unwrap_or(u32::MAX),
                },
                pos: row.pos,
                blocks: &job.blocks[row.blocks.clone()],
                slot: row.slot,
            })
            .collect();
        model.decode(scratch, kv, states, &batch, logits)?;
    }
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
