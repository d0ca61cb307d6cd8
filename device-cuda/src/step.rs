//! The CUDA router's plans: `Prefill`, `Decode` and `DecodeFed` through the bookkeeping of
//! `router_book::plans` (the host router's), then [`DeviceModel::forward`] on the compute stream.
//!
//! # A step on the device
//!
//! `launch` validates and commits the rows' bookkeeping first (a refused plan changes
//! nothing: the same checks and typed errors as the host router), then enqueues, in order on
//! the compute stream:
//!
//! - a prefill's state work (zeroing a new row's live slot, restoring the Marconi checkpoint of
//!   a prefix hit into it, copying the live state into a checkpoint row at a split) and its
//!   runs, batched into as few [`DeviceModel::forward`] calls as the step allows: a call takes
//!   runs until one would repeat a slot (a row split at a checkpoint continues in the next call,
//!   after the checkpoint's copy) or the rows would pass `max_step_tokens` (a longer run is cut
//!   into pieces, which the forward step continues exactly as one run);
//! - a decode's one forward call, its tokens uploaded, or, for `DecodeFed`, gathered on the
//!   device from the feed cells (`kernels::feed_inputs`: the previous step's argmax, never
//!   through the host) and the host tokens;
//! - the argmax (masked when asked) of every row that reached a token position into the step's
//!   outputs and the feed cells, the outputs copied to the step's pinned buffer, and the step's
//!   event.
//!
//! Step `t` uses half `t % 2` of the logits and per-step buffers (two steps in flight), so at
//! depth 2 the host reads step `t` while `t + 1` computes. `await_result` waits for the step's
//! event, reads its argmax from the pinned buffer, and resolves the fed positions it produced.
//! A `HostLogits` step is a synchronisation point: its logits are in `into` when `launch`
//! returns.
//!
//! # Failures
//!
//! A device error after the commit (a lost device, or a router bug the forward step's own
//! validation catches) fails the step: its rows' tenures are marked failed (the rows are marked
//! the next time they are seen, and never cached), and the error is `DeviceLost` or `Failed` in
//! phase `Forward`.

use std::ops::Range;

use device_io::{
    DeviceError, Phase, PrefillReport, Readback, Result, RowOutput, StepPlan, StepResult, Ticket,
};
use router_book::plans::{self, DecodePlan, FeedSources, Input, Inputs, PrefillOp, StepBook};
use router_book::{LogitsHandle, RouterSeq};

use crate::error::CudaError;
use crate::forward::{DeviceState, StepOutput, StepRun};
use crate::io::{device_error, Inner, LogitsHeld};
use crate::kernels;
use crate::router::CudaRouter;
use crate::runtime::{DeviceSlice, Stream};

/// A launched step the host has not awaited.
#[derive(Debug)]
pub(crate) struct Flight {
    pub ticket: u64,
    /// Its half of the logits and per-step buffers.
    pub half: usize,
    /// Rows that reached a token position.
    pub logit_rows: usize,
    /// Per plan row: its token row.
    pub token_rows: Vec<Option<usize>>,
    pub tenures: Vec<u64>,
    pub reports: Option<Vec<PrefillReport>>,
    /// The host asked for the logits (rows then answer `logits_row`, not `token`).
    pub host: bool,
    /// The argmax of each token row, once read.
    pub argmax: Option<Vec<u32>>,
}

/// One run of a forward call: positions `start..start + len` on `slot`, with the block table
/// `blocks` of the step's tables.
#[derive(Debug, Clone)]
struct Run {
    start: usize,
    len: usize,
    slot: usize,
    blocks: Range<usize>,
}

/// The device work of a step, in order.
#[derive(Debug, Clone)]
enum Work {
    Zero(usize),
    Copy {
        from: usize,
        to: usize,
    },
    /// One forward call: its runs, their tokens, the rows whose logits it writes, and the
    /// first of them among the step's token rows.
    Forward {
        runs: Vec<Run>,
        tokens: Tokens,
        logit_rows: Vec<u32>,
        first_token_row: usize,
    },
}

/// Where a forward call's tokens come from.
#[derive(Debug, Clone)]
enum Tokens {
    Host(Vec<u32>),
    /// Per row: the host token (or 0) and the source (`-1`: the host token; else a feed cell).
    Fed(Vec<u32>, Vec<i32>),
}

/// A forward call being filled.
#[derive(Debug, Default)]
struct Batch {
    runs: Vec<Run>,
    tokens: Vec<u32>,
    logit_rows: Vec<u32>,
    first_token_row: Option<usize>,
}

impl Batch {
    fn rows(&self) -> usize {
        self.tokens.len()
    }

    fn has_slot(&self, slot: usize) -> bool {
        self.runs.iter().any(|run| run.slot == slot)
    }

    fn flush(&mut self, work: &mut Vec<Work>, next_token_row: usize) {
        if self.runs.is_empty() {
            return;
        }
        let batch = std::mem::take(self);
        work.push(Work::Forward {
            runs: batch.runs,
            tokens: Tokens::Host(batch.tokens),
            logit_rows: batch.logit_rows,
            first_token_row: batch.first_token_row.unwrap_or(next_token_row),
        });
    }
}

/// A prefill's ops as forward calls and state copies (see the module docs).
fn prefill_work(ops: Vec<PrefillOp>, rows: &[&mut RouterSeq], max_rows: usize) -> Vec<Work> {
    let mut work = Vec::new();
    let mut batch = Batch::default();
    let mut token_row = 0;
    for op in ops {
        match op {
            PrefillOp::ZeroSlot(slot) => {
                if batch.has_slot(slot) {
                    batch.flush(&mut work, token_row);
                }
                work.push(Work::Zero(slot));
            }
            PrefillOp::CopyRow { from, to } => {
                if batch.has_slot(from) || batch.has_slot(to) {
                    batch.flush(&mut work, token_row);
                }
                work.push(Work::Copy { from, to });
            }
            PrefillOp::Run {
                row,
                start,
                stop,
                slot,
                blocks,
                emit,
            } => {
                let tokens = &rows[row].tokens;
                let mut pos = start;
                while pos < stop {
                    if batch.has_slot(slot) || batch.rows() == max_rows {
                        batch.flush(&mut work, token_row);
                    }
                    let end = stop.min(pos + (max_rows - batch.rows()));
                    batch.runs.push(Run {
                        start: pos,
                        len: end - pos,
                        slot,
                        blocks: blocks.clone(),
                    });
                    batch.tokens.extend_from_slice(&tokens[pos..end]);
                    if end == stop && emit {
                        batch.logit_rows.push((batch.rows() - 1) as u32);
                        batch.first_token_row.get_or_insert(token_row);
                        token_row += 1;
                    }
                    pos = end;
                }
            }
        }
    }
    batch.flush(&mut work, token_row);
    work
}

/// A decode as one forward call.
fn decode_work(plan: &DecodePlan, last_token_rows: &[Option<usize>]) -> Vec<Work> {
    let runs = plan
        .rows
        .iter()
        .map(|row| Run {
            start: row.pos,
            len: 1,
            slot: row.slot,
            blocks: row.blocks.clone(),
        })
        .collect();
    let mut host = Vec::with_capacity(plan.rows.len());
    let mut sources = Vec::with_capacity(plan.rows.len());
    for row in &plan.rows {
        match row.input {
            Input::Token(token) => {
                host.push(token);
                sources.push(-1);
            }
            Input::Feed(r) => {
                // Validated: row `r` of the previous step reached a token position, whose argmax
                // is in feed cell `last_token_rows[r]` (a cell past the feed cells gives the
                // kernel's `u32::MAX`, never another row's token).
                let cell = last_token_rows
                    .get(r)
                    .copied()
                    .flatten()
                    .map_or(i32::MAX, |cell| cell as i32);
                host.push(0);
                sources.push(cell);
            }
        }
    }
    let tokens = if sources.iter().all(|&source| source < 0) {
        Tokens::Host(host)
    } else {
        Tokens::Fed(host, sources)
    };
    vec![Work::Forward {
        runs,
        tokens,
        logit_rows: (0..plan.rows.len() as u32).collect(),
        first_token_row: 0,
    }]
}

fn u32_bytes(values: &[u32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

fn host_sink(readback: Readback<'_>) -> Option<&mut Vec<f32>> {
    match readback {
        Readback::HostLogits { into } => Some(into),
        Readback::Argmax | Readback::ArgmaxMasked { .. } => None,
    }
}

impl CudaRouter {
    /// `launch`: see the module docs.
    pub(crate) fn launch_step(
        &self,
        inner: &mut Inner,
        plan: StepPlan<'_>,
        rows: &mut [&mut RouterSeq],
    ) -> Result<Ticket> {
        let depth = self.router_config().max_depth;
        if inner.unsettled.len() >= depth {
            return Err(DeviceError::Invalid {
                what: "launch",
                detail: format!(
                    "ticket {} is not awaited yet and max_depth is {depth}",
                    inner.unsettled.front().copied().unwrap_or_default(),
                ),
            });
        }
        for seq in rows.iter_mut() {
            router_book::book::sync(&mut inner.book(), seq);
        }
        let shape = *self.book_shape();
        let ticket = inner.next_step;
        let max_rows = self.router_config().max_step_tokens;
        let (step, work, reports, host) = match plan {
            StepPlan::Prefill { budgets, readback } => {
                let mut bind = |adapter: Option<u32>| match adapter {
                    None => Ok(None),
                    Some(adapter) => Err(format!(
                        "adapter {adapter}: the CUDA router has no LoRA adapter slots"
                    )),
                };
                let plan = plans::prefill(
                    &shape,
                    &mut inner.book(),
                    budgets,
                    &readback,
                    rows,
                    &mut bind,
                )?;
                let work = prefill_work(plan.ops, rows, max_rows);
                (plan.step, work, Some(plan.reports), host_sink(readback))
            }
            StepPlan::Decode { tokens, readback } => {
                let plan =
                    self.decode_plan(inner, ticket, Inputs::Tokens(tokens), &readback, rows)?;
                let work = decode_work(&plan, &inner.last_token_rows);
                (plan.step, work, None, host_sink(readback))
            }
            StepPlan::DecodeFed { sources, masks } => {
                if depth < 2 {
                    return Err(DeviceError::Unsupported { what: "DecodeFed" });
                }
                let readback = if masks.is_empty() {
                    Readback::Argmax
                } else {
                    Readback::ArgmaxMasked { masks }
                };
                let plan =
                    self.decode_plan(inner, ticket, Inputs::Fed(sources), &readback, rows)?;
                let work = decode_work(&plan, &inner.last_token_rows);
                (plan.step, work, None, None)
            }
            // Speculative decoding (verification, the MTP head's drafts) is not built here.
            StepPlan::Verify { .. } => return Err(DeviceError::Unsupported { what: "Verify" }),
            StepPlan::Draft { .. } => return Err(DeviceError::Unsupported { what: "Draft" }),
        };
        inner.next_step += 1;
        let half = (ticket % 2) as usize;
        let logit_rows = step.token_rows.iter().flatten().count();
        let enqueued = self.enqueue(half, &step, &work, logit_rows);
        inner.last_rows = step
            .tenures
            .iter()
            .zip(&step.token_rows)
            .map(|(&tenure, row)| (tenure, row.is_some()))
            .collect();
        inner.last_token_rows = step.token_rows.clone();
        if let Err(err) = enqueued {
            return Err(self.fail_step(inner, &step.tenures, err));
        }
        inner.logits.retain(|held| held.half != half);
        inner.logits.push(LogitsHeld {
            step: ticket,
            rows: logit_rows,
            half,
        });
        inner.unsettled.push_back(ticket);
        inner.flights.push_back(Flight {
            ticket,
            half,
            logit_rows,
            token_rows: step.token_rows,
            tenures: step.tenures,
            reports,
            host: host.is_some(),
            argmax: None,
        });
        if let Some(into) = host {
            let read = || -> std::result::Result<Vec<f32>, CudaError> {
                self.runtime().sync_event(self.step_event(half))?;
                let vocab = self.model_config().vocab_size;
                let mut bytes = vec![0u8; logit_rows * vocab * 4];
                if !bytes.is_empty() {
                    let src = self.logits_half(half)?.range(0, bytes.len())?;
                    self.runtime().download(&mut bytes, src, Stream::Compute)?;
                }
                Ok(bytes
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect())
            };
            match read() {
                Ok(logits) => *into = logits,
                Err(err) => {
                    let tenures = inner.flights.back().map(|f| f.tenures.clone());
                    return Err(self.fail_step(inner, &tenures.unwrap_or_default(), err));
                }
            }
        }
        Ok(Ticket(ticket))
    }

    fn decode_plan(
        &self,
        inner: &mut Inner,
        ticket: u64,
        inputs: Inputs<'_>,
        readback: &Readback<'_>,
        rows: &mut [&mut RouterSeq],
    ) -> Result<DecodePlan> {
        let shape = *self.book_shape();
        let Inner {
            cache,
            slots,
            tenures,
            ring,
            pending,
            resolved,
            failed,
            last_rows,
            last_argmax,
            ..
        } = inner;
        let mut book = router_book::BookMut {
            cache,
            slots,
            tenures,
            ring,
            pending,
            resolved,
            failed,
        };
        let sources = FeedSources {
            last_rows,
            last_argmax: last_argmax
                .as_ref()
                .map(|(step, argmax)| (*step, &argmax[..])),
        };
        plans::decode(&shape, &mut book, ticket, inputs, readback, sources, rows)
    }

    /// Marks the rows of a failed step and answers its error.
    fn fail_step(&self, inner: &mut Inner, tenures: &[u64], err: CudaError) -> DeviceError {
        for &tenure in tenures {
            if inner.tenures.contains_key(&tenure) {
                inner.failed.insert(tenure);
            }
        }
        tracing::error!(%err, "CUDA forward step failed; its rows are marked failed");
        device_error(Phase::Forward, err)
    }

    fn logits_half(&self, half: usize) -> std::result::Result<DeviceSlice, CudaError> {
        let bytes = (self.plan().logits_bytes / 2) as usize;
        self.buffers()?.logits.range(half * bytes, bytes)
    }

    fn io_half(
        &self,
        half: usize,
        offset: u64,
        bytes: usize,
    ) -> std::result::Result<DeviceSlice, CudaError> {
        let io = self.io_layout();
        self.buffers()?
            .io
            .range(half * io.half as usize + offset as usize, bytes)
    }

    /// Enqueues a committed step's device work on the compute stream (see the module docs).
    fn enqueue(
        &self,
        half: usize,
        step: &StepBook,
        work: &[Work],
        logit_rows: usize,
    ) -> std::result::Result<(), CudaError> {
        let rt = self.runtime();
        let s = Stream::Compute;
        let buffers = self.buffers()?;
        let plan = self.plan();
        let io = *self.io_layout();
        let vocab = self.model_config().vocab_size;
        let model = self.device_model()?;
        let state = DeviceState {
            kv: buffers.kv.all(),
            num_blocks: plan.num_blocks,
            block_size: plan.block_size,
            block_floats: (plan.kv_block_bytes / 4) as usize,
            states: buffers.states.all(),
            num_slots: plan.live_slots + plan.checkpoint_slots + plan.snapshot_slots,
            slot_floats: (plan.state_slot_bytes / 4) as usize,
        };
        let row_bytes = plan.state_slot_bytes as usize;
        let state_row = |row: usize| buffers.states.range(row * row_bytes, row_bytes);
        let logits = self.logits_half(half)?;
        let feed_cells = buffers.io.range(io.feed as usize, 4 * plan.live_slots)?;
        for item in work {
            match item {
                Work::Zero(slot) => {
                    if row_bytes > 0 {
                        rt.memset(state_row(*slot)?, 0, s)?;
                    }
                }
                Work::Copy { from, to } => {
                    if row_bytes > 0 {
                        rt.copy(state_row(*to)?, state_row(*from)?, s)?;
                    }
                }
                Work::Forward {
                    runs,
                    tokens,
                    logit_rows: call_rows,
                    first_token_row,
                } => {
                    let m: usize = runs.iter().map(|run| run.len).sum();
                    let token_slice = self.io_half(half, io.tokens, 4 * m)?;
                    match tokens {
                        Tokens::Host(tokens) => rt.upload(token_slice, &u32_bytes(tokens), s)?,
                        Tokens::Fed(host, sources) => {
                            let host_slice = self.io_half(half, io.host_tokens, 4 * m)?;
                            let source_slice = self.io_half(half, io.sources, 4 * m)?;
                            rt.upload(host_slice, &u32_bytes(host), s)?;
                            let source_bytes: Vec<u8> =
                                sources.iter().flat_map(|v| v.to_le_bytes()).collect();
                            rt.upload(source_slice, &source_bytes, s)?;
                            kernels::feed_inputs(
                                rt,
                                s,
                                token_slice,
                                host_slice,
                                source_slice,
                                feed_cells,
                                m,
                            )?;
                        }
                    }
                    let step_runs: Vec<StepRun<'_>> = runs
                        .iter()
                        .map(|run| StepRun {
                            start_pos: run.start,
                            len: run.len,
                            slot: run.slot,
                            blocks: &step.blocks[run.blocks.clone()],
                        })
                        .collect();
                    let out_logits =
                        logits.range(first_token_row * vocab * 4, call_rows.len() * vocab * 4)?;
                    model.forward(
                        rt,
                        buffers.workspace.all(),
                        self.workspace(),
                        &state,
                        &step_runs,
                        token_slice,
                        &StepOutput {
                            logit_rows: call_rows,
                            logits: out_logits,
                        },
                    )?;
                }
            }
        }
        if logit_rows > 0 {
            let mask = if step.masks.is_empty() {
                None
            } else {
                let mut bytes = Vec::with_capacity(logit_rows * vocab);
                for (i, token_row) in step.token_rows.iter().enumerate() {
                    if token_row.is_some() {
                        bytes.extend(
                            step.masks[i * vocab..(i + 1) * vocab]
                                .iter()
                                .map(|&allowed| u8::from(allowed)),
                        );
                    }
                }
                let slice = self.io_half(half, io.mask, bytes.len())?;
                rt.upload(slice, &bytes, s)?;
                Some(slice)
            };
            let out = self.io_half(half, io.out, 4 * logit_rows)?;
            kernels::argmax(
                rt,
                s,
                logits.range(0, logit_rows * vocab * 4)?,
                mask,
                logit_rows,
                vocab,
                out,
                Some(feed_cells.range(0, 4 * logit_rows)?),
            )?;
            rt.copy_to_pinned(&buffers.out_pinned[half], 0, out, s)?;
        }
        rt.record(self.step_event(half), s)
    }

    /// Waits for in-flight step `index` and reads its argmax, resolving the fed positions it
    /// produced (once).
    fn settle(&self, inner: &mut Inner, index: usize) -> Result<()> {
        let flight = &inner.flights[index];
        if flight.argmax.is_some() {
            return Ok(());
        }
        let (half, rows, ticket) = (flight.half, flight.logit_rows, flight.ticket);
        let read = || -> std::result::Result<Vec<u32>, CudaError> {
            self.runtime().sync_event(self.step_event(half))?;
            let mut bytes = vec![0u8; 4 * rows];
            if rows > 0 {
                self.runtime()
                    .read_pinned(&self.buffers()?.out_pinned[half], 0, &mut bytes)?;
            }
            Ok(bytes
                .chunks_exact(4)
                .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect())
        };
        let argmax = match read() {
            Ok(argmax) => argmax,
            Err(err) => {
                let tenures = inner.flights[index].tenures.clone();
                return Err(self.fail_step(inner, &tenures, err));
            }
        };
        let flight = &inner.flights[index];
        let per_row: Vec<Option<u32>> = flight
            .token_rows
            .iter()
            .map(|row| row.map(|k| argmax[k]))
            .collect();
        let tenures = flight.tenures.clone();
        plans::resolve_feeds(&mut inner.book(), ticket, &tenures, &per_row);
        inner.last_argmax = Some((ticket, per_row));
        inner.flights[index].argmax = Some(argmax);
        Ok(())
    }

    /// Waits for every step in flight and resolves their fed positions (a spill needs its
    /// tokens); their results stay for `await_result`.
    pub(crate) fn settle_flights(&self, inner: &mut Inner) -> Result<()> {
        for index in 0..inner.flights.len() {
            self.settle(inner, index)?;
        }
        Ok(())
    }

    /// `await_result`: see the module docs.
    pub(crate) fn await_step(
        &self,
        inner: &mut Inner,
        ticket: Ticket,
    ) -> Result<StepResult<LogitsHandle>> {
        match inner.unsettled.front() {
            Some(&oldest) if oldest == ticket.0 => {}
            Some(&oldest) if inner.unsettled.contains(&ticket.0) => {
                return Err(DeviceError::Invalid {
                    what: "await_result",
                    detail: format!("{ticket} awaited before ticket {oldest}"),
                })
            }
            _ => return Err(DeviceError::UnknownTicket(ticket)),
        }
        let settled = self.settle(inner, 0);
        inner.unsettled.pop_front();
        let flight = inner
            .flights
            .pop_front()
            .ok_or(DeviceError::UnknownTicket(ticket))?;
        settled?;
        let argmax = flight.argmax.unwrap_or_default();
        let rows = flight
            .token_rows
            .iter()
            .enumerate()
            .map(|(i, token_row)| {
                let mut out = RowOutput {
                    prefill: flight.reports.as_ref().map(|reports| reports[i]),
                    ..RowOutput::default()
                };
                if let Some(k) = *token_row {
                    if flight.host {
                        out.logits_row = Some(k);
                    } else {
                        out.token = argmax.get(k).copied();
                    }
                }
                out
            })
            .collect();
        Ok(StepResult {
            ticket,
            rows,
            logits: (flight.logit_rows > 0).then_some(LogitsHandle {
                step: flight.ticket,
            }),
            tokens: Vec::new(),
        })
    }
}
