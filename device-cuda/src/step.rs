//! The CUDA router's plans: `Prefill`, `Decode`, `DecodeFed` and `Verify` through the
//! bookkeeping of `router_book::plans` and `router_book::spec` (the host router's), then
//! [`DeviceModel::forward`] on the compute stream.
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
//! A `Verify` (the bookkeeping of `router_book::spec`, the host router's) is one forward call
//! (more only past `max_step_tokens`, whole rows each) in which each row is one run of its next
//! token and drafts: every position a logits row, and the Mamba state after each draft written
//! by the scan kernels into the ring rows the plan names (`StepRun::snapshots`). Its argmax covers
//! every position and leaves the feed cells alone (no `DecodeFed` may name a verified row). In
//! `ForwardMode::Exact` every position is the bits a decode step of that token gives.
//!
//! On a model with an MTP head, a prefill call keeps every row's hidden state and runs the head
//! over the positions whose next token the prompt holds (`prefill_head`), keeping the prompt's
//! last position in the row's catch-up ring. After a prefix hit on a checkpoint the head marked
//! (`router_book::spec`; a head with Mamba layers lags one position at a prefill checkpoint,
//! leading the row's next run with it), the head first reruns the positions the
//! mark names from the main model's hidden rows stored with the checkpoint (the `marks`
//! buffer, `MemoryPlan::mark_bytes` per checkpoint slot), on copies of the shared blocks it
//! rewrites; a run that ends at a checkpoint stores its last hidden row there (a
//! `MarconiCheckpoint` copies the ring's cells instead), so its head after a hit is a cold
//! run's, as on the host router. A decode or verification keeps its logit rows'
//! hidden states for `SaveHiddenCatchup`. A `Draft` (`router_book::spec`'s bookkeeping) runs
//! the head's catch-up over each drafting row's ring (its cells gathered into one buffer), the
//! first drafts by device argmax, then `k - 1` one-position steps per row on scratch copies of
//! the live state, each fed the draft before without leaving the device; the drafts come back
//! through the half's pinned buffer.
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
//! phase `Forward`. A `DecodeFed` whose source step failed fails too when it settles (the
//! contract; `router_book::plans::check_feed_source`, the host router's rule): it computed on a
//! failed step's outputs and state.

use std::ops::Range;

use device_io::{
    DeviceError, Phase, PrefillReport, Readback, Result, RowOutput, StepPlan, StepResult, Ticket,
    TokenRun,
};
use router_book::plans::{self, DecodePlan, FeedSources, Input, Inputs, PrefillOp, StepBook};
use router_book::spec::{DraftPlan, MtpTrack, VerifyPlan};
use router_book::{Caches, LogitsHandle, RouterSeq};

use crate::error::CudaError;
use crate::forward::{DeviceState, HiddenRows, StepArgs, StepOutput, StepRun};
use crate::io::{device_error, Inner, LogitsHeld, StepHidden};
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
    /// The argmax of each token row (a `Verify`: of every position), once read.
    pub argmax: Option<Vec<u32>>,
    /// A `Verify`: each row's positions among the step's logits rows.
    pub runs: Option<Vec<TokenRun>>,
    /// A `Draft`: which rows drafted, and the drafts per row (the argmax is then the drafts,
    /// row after row).
    pub draft: Option<(Vec<bool>, usize)>,
    /// The step its fed rows read their inputs from (the one launched before it), if any.
    pub fed_from: Option<u64>,
    /// Why it failed, once known without reading it: by fault injection
    /// (`router_book::StepFaults`: what it wrote was overwritten after it ran), or, found when it
    /// settles, because its source step failed (`plans::check_feed_source`). Its await answers
    /// this error.
    pub failed: Option<DeviceError>,
}

/// What a step wrote on the device, for fault injection to overwrite.
#[derive(Debug, Default)]
struct Wrote {
    /// State rows (whole rows).
    rows: Vec<usize>,
    /// Whole KV blocks.
    blocks: Vec<u32>,
    /// Token positions: (block, offset inside it).
    positions: Vec<(u32, usize)>,
    /// Checkpoint slots whose stored hidden rows (marks) it wrote.
    marks: Vec<usize>,
}

impl Wrote {
    fn positions(&mut self, table: &[u32], block_size: usize, range: Range<usize>) {
        for pos in range {
            if let Some(&block) = table.get(pos / block_size) {
                self.positions.push((block, pos % block_size));
            }
        }
    }

    /// What `work` writes.
    fn step(work: &[Work], blocks: &[u32], block_size: usize) -> Wrote {
        let mut wrote = Wrote::default();
        for item in work {
            match item {
                Work::Zero(slot) | Work::Copy { to: slot, .. } => wrote.rows.push(*slot),
                Work::CopyBlock { to, .. } => wrote.blocks.push(*to),
                Work::Forward { runs, hidden, .. } => {
                    for run in runs {
                        let table = &blocks[run.blocks.clone()];
                        wrote.positions(table, block_size, run.start..run.start + run.len);
                        wrote.rows.push(run.slot);
                        wrote.rows.extend(&run.snapshots);
                    }
                    if let Hidden::Prefill(pieces) = hidden {
                        for piece in pieces {
                            if let (Some(lead), Some(run)) = (&piece.lead, runs.get(piece.run)) {
                                let table = &blocks[run.blocks.clone()];
                                let end = lead.from + lead.next.len();
                                wrote.positions(table, block_size, lead.from..end);
                            }
                            wrote
                                .marks
                                .extend(piece.stash.map(|(_, checkpoint)| checkpoint));
                        }
                    }
                }
            }
        }
        wrote
    }
}

/// One run of a forward call: positions `start..start + len` on `slot`, with the block table
/// `blocks` of the step's tables.
#[derive(Debug, Clone)]
struct Run {
    start: usize,
    len: usize,
    slot: usize,
    blocks: Range<usize>,
    /// State rows receiving the Mamba state after each of the run's first tokens.
    snapshots: Vec<usize>,
}

/// The device work of a step, in order.
#[derive(Debug, Clone)]
enum Work {
    Zero(usize),
    Copy {
        from: usize,
        to: usize,
    },
    /// Copy KV block `from` over block `to`.
    CopyBlock {
        from: u32,
        to: u32,
    },
    /// One forward call: its runs, their tokens, the rows whose logits it writes, and the
    /// first of them among the step's token rows.
    Forward {
        runs: Vec<Run>,
        tokens: Tokens,
        logit_rows: Vec<u32>,
        first_token_row: usize,
        hidden: Hidden,
    },
}

/// What a forward call keeps of the main model's hidden states (a model with an MTP head).
#[derive(Debug, Clone)]
enum Hidden {
    /// Nothing (no MTP head).
    None,
    /// The logit rows' hidden states, in the step's half of `step_hidden` (decode,
    /// verification): what `SaveHiddenCatchup` keeps.
    Keep,
    /// A prefill call: every row's hidden state in `staging`, then the MTP head over each
    /// piece's positions whose next token the prompt holds, and the prompt's last position kept
    /// in a catch-up cell.
    Prefill(Vec<MtpPiece>),
}

/// The MTP head's part of one run of a prefill call.
#[derive(Debug, Clone)]
struct MtpPiece {
    /// The run, in the call.
    run: usize,
    /// The token after each of the run's first `next.len()` positions.
    next: Vec<u32>,
    /// The run's row at the prompt's last position, and the cell its hidden state goes to.
    keep: Option<(usize, u32)>,
    /// The head's rerun after a hit on a marked checkpoint, before the run's own positions.
    lead: Option<Lead>,
    /// The run's last row, and the checkpoint slot its hidden state is stored with.
    stash: Option<(usize, usize)>,
}

/// The MTP head's rerun after a prefix hit (`router_book::plans::HeadLead`): positions
/// `from..from + next.len()`, from the hidden rows stored with checkpoint slot `checkpoint`.
#[derive(Debug, Clone)]
struct Lead {
    checkpoint: usize,
    from: usize,
    /// The token after each position.
    next: Vec<u32>,
}

/// The catch-up rings a prefill on a model with an MTP head updates, and the checkpoints it
/// marks for the head's rerun.
struct MtpBook<'a> {
    tracks: &'a mut std::collections::BTreeMap<u64, MtpTrack<u32>>,
    free_cells: &'a mut Vec<u32>,
    cache: &'a mut Caches,
    /// The head has Mamba layers (`router_book::BookShape::head_lags`).
    head_lags: bool,
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
    /// The MTP head's pieces (a prefill on a model with a head).
    pieces: Option<Vec<MtpPiece>>,
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
        let mtp = self.pieces.is_some();
        let batch = std::mem::take(self);
        if mtp {
            self.pieces = Some(Vec::new());
        }
        work.push(Work::Forward {
            runs: batch.runs,
            tokens: Tokens::Host(batch.tokens),
            logit_rows: batch.logit_rows,
            first_token_row: batch.first_token_row.unwrap_or(next_token_row),
            hidden: match batch.pieces {
                Some(pieces) => Hidden::Prefill(pieces),
                None => Hidden::None,
            },
        });
    }
}

/// A prefill's ops as forward calls and state copies (see the module docs); with `mtp`, each
/// run's MTP head part too, as the host router runs it: the head consumes the positions whose
/// next token is in the prompt (after a hit on a marked checkpoint, from the rerun's first), the
/// prompt's last position is kept in the row's ring, and a run that ends at a checkpoint the
/// head marks stores its last hidden state with it.
fn prefill_work(
    ops: Vec<PrefillOp>,
    rows: &[&mut RouterSeq],
    max_rows: usize,
    mut mtp: Option<MtpBook<'_>>,
) -> Vec<Work> {
    let mut work = Vec::new();
    let mut batch = Batch {
        pieces: mtp.is_some().then(Vec::new),
        ..Batch::default()
    };
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
            PrefillOp::CopyBlock { from, to } => work.push(Work::CopyBlock { from, to }),
            PrefillOp::Run(run) => {
                let (start, stop, slot, emit) = (run.start, run.stop, run.slot, run.emit);
                let seq = &*rows[run.row];
                let tokens = &seq.tokens;
                // The head consumes positions `start..known` (after its rerun's); the prompt's
                // last is kept.
                let mut known = stop;
                let mut keep_cell = None;
                let mut rerun = None;
                let mut stash_slot = None;
                if let Some(book) = mtp.as_mut() {
                    let tenure = seq.tenure.expect("assigned by the bookkeeping");
                    let track = book.tracks.entry(tenure).or_default();
                    let head = router_book::spec::prefill_head_plan(
                        track,
                        book.cache,
                        seq,
                        &run,
                        book.head_lags,
                    );
                    known = head.run.known;
                    rerun = head.rerun.map(|lead| Lead {
                        checkpoint: lead.checkpoint.index(),
                        from: lead.from,
                        next: tokens[lead.from + 1..start + 1].to_vec(),
                    });
                    stash_slot = head.stash.map(|checkpoint| checkpoint.index());
                    if stop == seq.prompt_len {
                        if let Some(cell) = book.free_cells.pop() {
                            let forgotten = track.keep(stop - 1, cell);
                            book.free_cells.extend(forgotten);
                            keep_cell = track.ring.get(&(stop - 1)).copied();
                        }
                    }
                }
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
                        blocks: run.blocks.clone(),
                        snapshots: Vec::new(),
                    });
                    batch.tokens.extend_from_slice(&tokens[pos..end]);
                    if let Some(pieces) = batch.pieces.as_mut() {
                        let consumed = known.min(end).saturating_sub(pos);
                        pieces.push(MtpPiece {
                            run: batch.runs.len() - 1,
                            next: tokens[pos + 1..pos + 1 + consumed].to_vec(),
                            keep: keep_cell
                                .filter(|_| end == stop)
                                .map(|cell| (end - 1 - pos, cell)),
                            lead: rerun.take(),
                            stash: stash_slot
                                .filter(|_| end == stop)
                                .map(|checkpoint| (end - 1 - pos, checkpoint)),
                        });
                    }
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
            snapshots: Vec::new(),
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
        hidden: Hidden::None,
    }]
}

/// Each decode row's hidden state: tenure, position, one position, its logits row.
fn decode_kept(plan: &DecodePlan) -> Vec<(u64, usize, usize, usize)> {
    plan.rows
        .iter()
        .zip(&plan.step.tenures)
        .enumerate()
        .map(|(i, (row, &tenure))| (tenure, row.pos, 1, i))
        .collect()
}

/// Makes every forward call of `work` keep its logit rows' hidden states (a decode or
/// verification on a model with an MTP head).
fn keep_hidden(work: &mut [Work]) {
    for item in work {
        if let Work::Forward { hidden, .. } = item {
            *hidden = Hidden::Keep;
        }
    }
}

/// A verification as forward calls: whole rows (each a run of its positions, with its snapshot
/// rows), as many per call as `max_rows` allows, every position a logits row.
fn verify_work(plan: &VerifyPlan, max_rows: usize) -> Vec<Work> {
    let mut work = Vec::new();
    let mut batch = Batch::default();
    let mut token_row = 0;
    for row in &plan.rows {
        let len = row.tokens.len();
        if batch.rows() + len > max_rows {
            batch.flush(&mut work, token_row);
        }
        batch.runs.push(Run {
            start: row.start,
            len,
            slot: row.slot,
            blocks: row.blocks.clone(),
            snapshots: row.snapshots.clone().unwrap_or_default(),
        });
        for j in 0..len {
            batch.logit_rows.push((batch.rows() + j) as u32);
        }
        batch.first_token_row.get_or_insert(token_row);
        token_row += len;
        batch
            .tokens
            .extend_from_slice(&plan.tokens[row.tokens.clone()]);
    }
    batch.flush(&mut work, token_row);
    work
}

/// What the await of a step failed by fault injection (`router_book::StepFaults`) answers.
fn injected_fault(ticket: u64) -> DeviceError {
    DeviceError::Failed {
        phase: Phase::Forward,
        message: format!("an injected device fault (StepFaults) in step {ticket}"),
    }
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
        let mtp = self.mtp_layout().total > 0;
        // Per row of a decode or verification on a model with an MTP head: tenure, first
        // position, positions, first hidden row (what `SaveHiddenCatchup` may keep).
        let mut kept: Option<Vec<(u64, usize, usize, usize)>> = None;
        let mut fed_from = None;
        let (step, mut work, reports, host, runs) = match plan {
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
                let book = mtp.then_some(MtpBook {
                    tracks: &mut inner.mtp,
                    free_cells: &mut inner.free_cells,
                    cache: &mut inner.cache,
                    head_lags: shape.head_lags,
                });
                let work = prefill_work(plan.ops, rows, max_rows, book);
                (
                    plan.step,
                    work,
                    Some(plan.reports),
                    host_sink(readback),
                    None,
                )
            }
            StepPlan::Decode { tokens, readback } => {
                let plan =
                    self.decode_plan(inner, ticket, Inputs::Tokens(tokens), &readback, rows)?;
                let work = decode_work(&plan, &inner.last_token_rows);
                kept = mtp.then(|| decode_kept(&plan));
                (plan.step, work, None, host_sink(readback), None)
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
                kept = mtp.then(|| decode_kept(&plan));
                fed_from = plan.fed_from;
                (plan.step, work, None, None, None)
            }
            StepPlan::Verify {
                inputs,
                snapshots,
                readback,
            } => {
                self.check_verify(inputs)?;
                let plan = router_book::spec::verify(
                    &shape,
                    &mut inner.book(),
                    inputs,
                    snapshots,
                    &readback,
                    rows,
                )?;
                let work = verify_work(&plan, max_rows);
                let mut start = 0;
                let runs: Vec<TokenRun> = plan
                    .rows
                    .iter()
                    .map(|row| {
                        let run = TokenRun {
                            start,
                            len: row.tokens.len(),
                        };
                        start += run.len;
                        run
                    })
                    .collect();
                kept = mtp.then(|| {
                    plan.rows
                        .iter()
                        .zip(&plan.step.tenures)
                        .zip(&runs)
                        .map(|((row, &tenure), run)| (tenure, row.start, run.len, run.start))
                        .collect()
                });
                (plan.step, work, None, host_sink(readback), Some(runs))
            }
            StepPlan::Draft { tokens, k } => {
                if !mtp {
                    return Err(DeviceError::Unsupported { what: "Draft" });
                }
                let (mut book, tracks) = inner.book_and_tracks();
                let plan = router_book::spec::draft(&shape, &mut book, tracks, tokens, k, rows)?;
                return self.launch_draft(inner, ticket, plan, k);
            }
        };
        if kept.is_some() {
            keep_hidden(&mut work);
        }
        inner.next_step += 1;
        let half = (ticket % 2) as usize;
        // A verification's rows leave every position's logits and no feed cell.
        let logit_rows = match &runs {
            Some(runs) => runs.iter().map(|run| run.len).sum(),
            None => step.token_rows.iter().flatten().count(),
        };
        let enqueued = self.enqueue(half, &step, &work, logit_rows, runs.is_none());
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
        let injected = inner
            .step_faults
            .as_ref()
            .is_some_and(|faults| faults.fails(ticket));
        if injected {
            let wrote = Wrote::step(&work, &step.blocks, shape.block_size);
            if let Err(err) = self.scribble(&wrote) {
                return Err(self.fail_step(inner, &step.tenures, err));
            }
        }
        inner.step_hidden.retain(|held| held.half != half);
        if let Some(rows) = kept {
            inner.step_hidden.push(StepHidden { ticket, half, rows });
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
            runs,
            draft: None,
            fed_from,
            failed: injected.then(|| injected_fault(ticket)),
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

    /// Refuses, before any bookkeeping, a `Verify` this router's buffers cannot hold: more
    /// positions than a step's logits rows, or a row longer than a forward call.
    fn check_verify(&self, inputs: &[&[u32]]) -> Result<()> {
        let positions: usize = inputs.iter().map(|input| input.len()).sum();
        let most = self.plan().logit_rows();
        if positions > most {
            return Err(DeviceError::Invalid {
                what: "Verify",
                detail: format!(
                    "{positions} positions; a step of this router holds the logits of at most \
                     {most} (max_seqs plus one per snapshot ring slot)"
                ),
            });
        }
        let max_rows = self.router_config().max_step_tokens;
        if let Some((i, input)) = inputs
            .iter()
            .enumerate()
            .find(|(_, input)| input.len() > max_rows)
        {
            return Err(DeviceError::Invalid {
                what: "Verify",
                detail: format!(
                    "row {i} feeds {} tokens, over max_step_tokens {max_rows}",
                    input.len()
                ),
            });
        }
        Ok(())
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
        let mut book = router_book::book_mut!(inner);
        let sources = FeedSources::new(&inner.last_rows, &inner.last_argmax);
        plans::decode(&shape, &mut book, ticket, inputs, readback, sources, rows)
    }

    /// Marks the rows of a failed step and answers its error.
    fn fail_step(&self, inner: &mut Inner, tenures: &[u64], err: CudaError) -> DeviceError {
        self.mark_failed(inner, tenures);
        tracing::error!(%err, "CUDA forward step failed; its rows are marked failed");
        device_error(Phase::Forward, err)
    }

    /// Marks the rows (tenures) of a failed step.
    fn mark_failed(&self, inner: &mut Inner, tenures: &[u64]) {
        for &tenure in tenures {
            if inner.tenures.contains_key(&tenure) {
                inner.failed.insert(tenure);
            }
        }
    }

    /// Overwrites what a step failed by fault injection wrote with
    /// [`router_book::FAULT_GARBAGE`], on the compute stream after the step (see [`Wrote`]).
    fn scribble(&self, wrote: &Wrote) -> std::result::Result<(), CudaError> {
        let rt = self.runtime();
        let s = Stream::Compute;
        let buffers = self.buffers()?;
        let plan = self.plan();
        let garbage = |bytes: usize| -> Vec<u8> {
            (0..bytes / 4)
                .flat_map(|_| router_book::FAULT_GARBAGE.to_le_bytes())
                .collect()
        };
        let row_bytes = plan.state_slot_bytes as usize;
        if row_bytes > 0 {
            for &row in &wrote.rows {
                rt.upload(
                    buffers.states.range(row * row_bytes, row_bytes)?,
                    &garbage(row_bytes),
                    s,
                )?;
            }
        }
        let block_bytes = plan.kv_block_bytes as usize;
        let kv = buffers.kv.all();
        for &block in &wrote.blocks {
            rt.upload(
                kv.range(block as usize * block_bytes, block_bytes)?,
                &garbage(block_bytes),
                s,
            )?;
        }
        if !wrote.positions.is_empty() {
            // The host model's layout (one position's K and V in every attention layer).
            let layout = model::KvPool::new(self.model_config(), 1, plan.block_size)
                .map_err(|err| CudaError::BadRange(err.to_string()))?;
            for &(block, offset) in &wrote.positions {
                for range in layout.offset_ranges(offset) {
                    let at = block as usize * block_bytes + 4 * range.start;
                    rt.upload(kv.range(at, 4 * range.len())?, &garbage(4 * range.len()), s)?;
                }
            }
        }
        let mark_bytes = plan.mark_bytes as usize;
        if let (Some(marks), true) = (&buffers.marks, mark_bytes > 0) {
            for &checkpoint in &wrote.marks {
                rt.upload(
                    marks.range(checkpoint * mark_bytes, mark_bytes)?,
                    &garbage(mark_bytes),
                    s,
                )?;
            }
        }
        Ok(())
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
        feed: bool,
    ) -> std::result::Result<(), CudaError> {
        let rt = self.runtime();
        let s = Stream::Compute;
        let buffers = self.buffers()?;
        let plan = self.plan();
        let io = *self.io_layout();
        let vocab = self.model_config().vocab_size;
        let model = self.device_model()?;
        let state = self.device_state()?;
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
                Work::CopyBlock { from, to } => {
                    let block = plan.kv_block_bytes as usize;
                    let kv = buffers.kv.all();
                    rt.copy(
                        kv.range(*to as usize * block, block)?,
                        kv.range(*from as usize * block, block)?,
                        s,
                    )?;
                }
                Work::Forward {
                    runs,
                    tokens,
                    logit_rows: call_rows,
                    first_token_row,
                    hidden,
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
                            snapshots: &run.snapshots,
                        })
                        .collect();
                    let out_logits =
                        logits.range(first_token_row * vocab * 4, call_rows.len() * vocab * 4)?;
                    let out = StepOutput {
                        logit_rows: call_rows,
                        logits: out_logits,
                    };
                    let args = StepArgs {
                        workspace: buffers.workspace.all(),
                        workspace_layout: self.workspace(),
                        state: &state,
                        runs: &step_runs,
                        tokens: token_slice,
                        out,
                    };
                    let mtp = self.mtp_layout();
                    let row = mtp.row as usize;
                    match hidden {
                        Hidden::None => model.forward(rt, &args)?,
                        Hidden::Keep => {
                            let at = mtp.step_hidden as usize
                                + half * mtp.half as usize
                                + first_token_row * row;
                            let kept = self.mtp_region(at, call_rows.len() * row)?;
                            model.forward_hidden(rt, &args, HiddenRows::Logit, kept)?;
                        }
                        Hidden::Prefill(pieces) => {
                            let staging = self.mtp_region(mtp.staging as usize, m * row)?;
                            model.forward_hidden(rt, &args, HiddenRows::All, staging)?;
                            self.prefill_head(half, &state, &step_runs, pieces, staging)?;
                        }
                    }
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
                if feed {
                    Some(feed_cells.range(0, 4 * logit_rows)?)
                } else {
                    None
                },
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
        // The steps before it settled first: `last_argmax` names the latest that computed.
        let last_computed = inner.last_argmax.as_ref().map(|(step, _)| *step);
        let source = plans::check_feed_source(flight.fed_from, last_computed);
        if flight.failed.is_some() || source.is_err() {
            // A failed step: its rows are marked, its outputs never read; `await_result`
            // answers the failure.
            let tenures = flight.tenures.clone();
            self.mark_failed(inner, &tenures);
            if let Err(err) = source {
                inner.flights[index].failed.get_or_insert(err);
            }
            return Ok(());
        }
        let (half, rows, ticket) = (flight.half, flight.logit_rows, flight.ticket);
        let draft = flight
            .draft
            .as_ref()
            .map(|(drafting, k)| (drafting.iter().filter(|&&d| d).count(), *k));
        let read = || -> std::result::Result<Vec<u32>, CudaError> {
            self.runtime().sync_event(self.step_event(half))?;
            let buffers = self.buffers()?;
            let (pinned, words) = match draft {
                Some((n, k)) => (&buffers.draft_pinned, n * k),
                None => (&buffers.out_pinned, rows),
            };
            let mut bytes = vec![0u8; 4 * words];
            if words > 0 {
                self.runtime().read_pinned(&pinned[half], 0, &mut bytes)?;
            }
            let words: Vec<u32> = bytes
                .chunks_exact(4)
                .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect();
            // A draft's tokens come depth after depth; the result gives them row after row.
            Ok(match draft {
                Some((n, k)) => (0..n * k).map(|i| words[(i % k) * n + i / k]).collect(),
                None => words,
            })
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
        plans::check_await(&inner.unsettled, ticket)?;
        let settled = self.settle(inner, 0);
        inner.unsettled.pop_front();
        let flight = inner
            .flights
            .pop_front()
            .ok_or(DeviceError::UnknownTicket(ticket))?;
        settled?;
        inner.settled = Some(ticket.0);
        if let Some(err) = flight.failed {
            tracing::error!(%ticket, %err, "the step failed; its rows are marked failed");
            return Err(err);
        }
        let argmax = flight.argmax.unwrap_or_default();
        if let Some((drafting, k)) = flight.draft {
            // A draft: `k` tokens per drafting row, none for the others; no logits.
            let mut start = 0;
            let rows = drafting
                .iter()
                .map(|&d| {
                    let len = if d { k } else { 0 };
                    let run = TokenRun { start, len };
                    start += len;
                    RowOutput {
                        run: Some(run),
                        ..RowOutput::default()
                    }
                })
                .collect();
            return Ok(StepResult {
                ticket,
                rows,
                logits: None,
                tokens: argmax,
            });
        }
        if let Some(runs) = flight.runs {
            // A verification: every position's argmax, each row's span of them.
            let rows = runs
                .iter()
                .map(|run| RowOutput {
                    logits_row: flight.host.then_some(run.start),
                    run: Some(*run),
                    ..RowOutput::default()
                })
                .collect();
            return Ok(StepResult {
                ticket,
                rows,
                logits: (flight.logit_rows > 0).then_some(LogitsHandle {
                    step: flight.ticket,
                }),
                tokens: argmax,
            });
        }
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

/// One drafting row of a `Draft` on the device.
struct Drafting<'a> {
    /// The catch-up's first position, next tokens and cells.
    catchup: &'a router_book::spec::Catchup<u32>,
    next_pos: usize,
    slot: usize,
    blocks: &'a [u32],
}

impl CudaRouter {
    /// The MTP head's part of a prefill call (after its main forward left every row's hidden
    /// state in `staging`): for each piece, the head's rerun after a prefix hit (from the hidden
    /// rows stored with the hit's checkpoint), the head over the positions whose next token the
    /// prompt holds, then the prompt's last position's hidden state into its catch-up cell, and
    /// the run's last hidden state with the checkpoint it ends at.
    fn prefill_head(
        &self,
        half: usize,
        state: &DeviceState,
        runs: &[StepRun<'_>],
        pieces: &[MtpPiece],
        staging: DeviceSlice,
    ) -> std::result::Result<(), CudaError> {
        let rt = self.runtime();
        let s = Stream::Compute;
        let row = self.mtp_layout().row as usize;
        let mut first_rows = Vec::with_capacity(runs.len());
        let mut first = 0;
        for run in runs {
            first_rows.push(first);
            first += run.len;
        }
        for piece in pieces {
            let run = &runs[piece.run];
            let first = first_rows[piece.run];
            if let Some(lead) = &piece.lead {
                let n = lead.next.len();
                let hidden = self.mark_rows(lead.checkpoint, 0, n)?;
                let rerun = StepRun {
                    start_pos: lead.from,
                    len: n,
                    ..*run
                };
                self.head_over(half, state, rerun, &lead.next, hidden)?;
            }
            let n = piece.next.len();
            if n > 0 {
                let rows = staging.range(first * row, n * row)?;
                self.head_over(half, state, StepRun { len: n, ..*run }, &piece.next, rows)?;
            }
            if let Some((at, cell)) = piece.keep {
                rt.copy(self.cell(cell)?, staging.range((first + at) * row, row)?, s)?;
            }
            if let Some((at, checkpoint)) = piece.stash {
                let stored = self.mark_rows(checkpoint, 0, 1)?;
                rt.copy(stored, staging.range((first + at) * row, row)?, s)?;
            }
        }
        Ok(())
    }

    /// The MTP head over `run`'s positions, fed `next` (the token after each) and `hidden` (the
    /// main model's hidden state at each); its logits and hidden outputs are not kept.
    fn head_over(
        &self,
        half: usize,
        state: &DeviceState,
        run: StepRun<'_>,
        next: &[u32],
        hidden: DeviceSlice,
    ) -> std::result::Result<(), CudaError> {
        let rt = self.runtime();
        let model = self.device_model()?;
        let buffers = self.buffers()?;
        let mtp = self.mtp_layout();
        let io = *self.io_layout();
        // Zero-length outputs (the head's logits and hidden outputs are not wanted here), outside
        // the workspace.
        let nothing = self.mtp_region(mtp.pong as usize, 0)?;
        let tokens = self.io_half(half, io.tokens, 4 * next.len())?;
        rt.upload(tokens, &u32_bytes(next), Stream::Compute)?;
        model.mtp(
            rt,
            &StepArgs {
                workspace: buffers.workspace.all(),
                workspace_layout: self.workspace(),
                state,
                runs: &[run],
                tokens,
                out: StepOutput {
                    logit_rows: &[],
                    logits: nothing,
                },
            },
            hidden,
            nothing,
        )
    }

    /// `Draft`: the committed plan's catch-up and drafts on the device (see the module docs),
    /// then the step's flight.
    fn launch_draft(
        &self,
        inner: &mut Inner,
        ticket: u64,
        plan: DraftPlan<u32>,
        k: usize,
    ) -> Result<Ticket> {
        inner.next_step += 1;
        let half = (ticket % 2) as usize;
        let drafting: Vec<bool> = plan.rows.iter().map(|r| r.catchup.is_some()).collect();
        let rows: Vec<Drafting<'_>> = plan
            .rows
            .iter()
            .filter_map(|r| {
                r.catchup.as_ref().map(|catchup| Drafting {
                    catchup,
                    next_pos: r.next_pos,
                    slot: r.slot,
                    blocks: &plan.step.blocks[r.blocks.clone()],
                })
            })
            .collect();
        let mut enqueued = self.enqueue_draft(half, &rows, k);
        let injected = inner
            .step_faults
            .as_ref()
            .is_some_and(|faults| faults.fails(ticket));
        if injected && enqueued.is_ok() {
            let block_size = self.book_shape().block_size;
            let row_bytes = self.plan().state_slot_bytes;
            let mut wrote = Wrote::default();
            for r in &rows {
                let catchup = r.catchup.start..r.catchup.start + r.catchup.hidden.len();
                wrote.positions(r.blocks, block_size, catchup);
                wrote.positions(r.blocks, block_size, r.next_pos..r.next_pos + k - 1);
                wrote.rows.push(r.slot);
                if k > 1 && row_bytes > 0 {
                    wrote.rows.push(self.plan().scratch_row(r.slot));
                }
            }
            enqueued = self.scribble(&wrote);
        }
        // The catch-up cells and the lent blocks are free again for work queued after.
        for r in &plan.rows {
            if let Some(catchup) = &r.catchup {
                inner.free_cells.extend_from_slice(&catchup.hidden);
            }
        }
        inner.free_cells.extend_from_slice(&plan.dropped);
        for &block in &plan.lent {
            inner.cache.release(block);
        }
        inner.last_rows = plan.step.tenures.iter().map(|&t| (t, false)).collect();
        inner.last_token_rows = plan.step.token_rows.clone();
        if let Err(err) = enqueued {
            return Err(self.fail_step(inner, &plan.step.tenures, err));
        }
        // The draft wrote its logits into this half: none are held there now.
        inner.logits.retain(|held| held.half != half);
        inner.step_hidden.retain(|held| held.half != half);
        inner.unsettled.push_back(ticket);
        inner.flights.push_back(Flight {
            ticket,
            half,
            logit_rows: 0,
            token_rows: plan.step.token_rows,
            tenures: plan.step.tenures,
            reports: None,
            host: false,
            argmax: None,
            runs: None,
            draft: Some((drafting, k)),
            fed_from: None,
            failed: injected.then(|| injected_fault(ticket)),
        });
        Ok(Ticket(ticket))
    }

    /// Enqueues a draft: the catch-up of every drafting row (its ring's hidden states gathered
    /// into `staging`, the head over them on the live state, in calls of whole pieces), the
    /// first drafts (device argmax of each row's last catch-up position), then `k - 1` steps of
    /// one position per row on the rows' scratch state rows, each fed the draft before (on the
    /// device) and the head's hidden output before; the drafts, depth after depth, go to the
    /// half's pinned buffer.
    fn enqueue_draft(
        &self,
        half: usize,
        rows: &[Drafting<'_>],
        k: usize,
    ) -> std::result::Result<(), CudaError> {
        let rt = self.runtime();
        let s = Stream::Compute;
        let buffers = self.buffers()?;
        let plan = self.plan();
        let model = self.device_model()?;
        let mtp = *self.mtp_layout();
        let io = *self.io_layout();
        let row = mtp.row as usize;
        let vocab = self.model_config().vocab_size;
        let n = rows.len();
        if n == 0 {
            return rt.record(self.step_event(half), s);
        }
        let state = self.device_state()?;
        let logits = self.logits_half(half)?;
        let (workspace, workspace_layout) = (buffers.workspace.all(), self.workspace());
        let (mut ping, mut pong) = (mtp.ping as usize, mtp.pong as usize);
        let nothing = self.mtp_region(mtp.drafts as usize, 0)?;
        // 1. The catch-up, in calls of at most `limit` rows: a row's positions may be cut into
        //    pieces (the head continues from its state and K/V exactly); only a row's last piece
        //    gives logits (its first draft) and a hidden output.
        let limit = mtp.staging_rows.min(self.router_config().max_step_tokens);
        let mut call: Vec<(usize, usize, usize)> = Vec::new(); // (drafting row, from, len)
        let flush = |call: &mut Vec<(usize, usize, usize)>| -> std::result::Result<(), CudaError> {
            if call.is_empty() {
                return Ok(());
            }
            let m: usize = call.iter().map(|c| c.2).sum();
            let mut tokens = Vec::with_capacity(m);
            let mut runs = Vec::with_capacity(call.len());
            let mut logit_rows = Vec::new();
            let mut emitting = Vec::new();
            let mut at = 0;
            for &(i, from, len) in call.iter() {
                let r = &rows[i];
                let catchup = r.catchup;
                for (j, &cell) in catchup.hidden[from..from + len].iter().enumerate() {
                    let dst = self.mtp_region(mtp.staging as usize + (at + j) * row, row)?;
                    rt.copy(dst, self.cell(cell)?, s)?;
                }
                tokens.extend_from_slice(&catchup.tokens[from..from + len]);
                runs.push(StepRun {
                    start_pos: catchup.start + from,
                    len,
                    slot: r.slot,
                    blocks: r.blocks,
                    snapshots: &[],
                });
                if from + len == catchup.hidden.len() {
                    logit_rows.push((at + len - 1) as u32);
                    emitting.push(i);
                }
                at += len;
            }
            let token_slice = self.io_half(half, io.tokens, 4 * m)?;
            rt.upload(token_slice, &u32_bytes(&tokens), s)?;
            // Emitting rows are consecutive drafting rows: their logits and hidden outputs are
            // consecutive rows of the half's logits and of `ping`.
            let (out_logits, hidden_out) = match emitting.first() {
                Some(&first) => (
                    logits.range(first * vocab * 4, emitting.len() * vocab * 4)?,
                    self.mtp_region(ping + first * row, emitting.len() * row)?,
                ),
                None => (nothing, nothing),
            };
            model.mtp(
                rt,
                &StepArgs {
                    workspace,
                    workspace_layout,
                    state: &state,
                    runs: &runs,
                    tokens: token_slice,
                    out: StepOutput {
                        logit_rows: &logit_rows,
                        logits: out_logits,
                    },
                },
                self.mtp_region(mtp.staging as usize, m * row)?,
                hidden_out,
            )?;
            call.clear();
            Ok(())
        };
        let mut in_call = 0;
        for (i, r) in rows.iter().enumerate() {
            let total = r.catchup.hidden.len();
            let mut from = 0;
            while from < total {
                if in_call == limit {
                    flush(&mut call)?;
                    in_call = 0;
                }
                let len = (total - from).min(limit - in_call);
                call.push((i, from, len));
                in_call += len;
                from += len;
            }
        }
        flush(&mut call)?;
        // 2. The first drafts.
        let cur = self.io_half(half, io.out, 4 * n)?;
        let drafts = |depth: usize| self.mtp_region(mtp.drafts as usize + depth * n * 4, n * 4);
        // Each depth's drafts: the argmax of the head's logits, kept in the drafts region.
        let take_drafts = |depth: usize| -> std::result::Result<(), CudaError> {
            kernels::argmax(
                rt,
                s,
                logits.range(0, n * vocab * 4)?,
                None,
                n,
                vocab,
                cur,
                None,
            )?;
            rt.copy(drafts(depth)?, cur, s)
        };
        take_drafts(0)?;
        // 3. The other drafts, on scratch copies of the live state (the head's own K/V at the
        //    draft positions is overwritten by the next catch-up).
        let row_bytes = plan.state_slot_bytes as usize;
        let scratch = |slot: usize| {
            if row_bytes > 0 {
                plan.scratch_row(slot)
            } else {
                slot
            }
        };
        if k > 1 && row_bytes > 0 {
            for r in rows {
                let src = buffers.states.range(r.slot * row_bytes, row_bytes)?;
                let dst = buffers
                    .states
                    .range(scratch(r.slot) * row_bytes, row_bytes)?;
                rt.copy(dst, src, s)?;
            }
        }
        let all_rows: Vec<u32> = (0..n as u32).collect();
        for depth in 1..k {
            let runs: Vec<StepRun<'_>> = rows
                .iter()
                .map(|r| StepRun {
                    start_pos: r.next_pos + depth - 1,
                    len: 1,
                    slot: scratch(r.slot),
                    blocks: r.blocks,
                    snapshots: &[],
                })
                .collect();
            model.mtp(
                rt,
                &StepArgs {
                    workspace,
                    workspace_layout,
                    state: &state,
                    runs: &runs,
                    tokens: cur,
                    out: StepOutput {
                        logit_rows: &all_rows,
                        logits: logits.range(0, n * vocab * 4)?,
                    },
                },
                self.mtp_region(ping, n * row)?,
                self.mtp_region(pong, n * row)?,
            )?;
            take_drafts(depth)?;
            std::mem::swap(&mut ping, &mut pong);
        }
        rt.copy_to_pinned(
            &buffers.draft_pinned[half],
            0,
            self.mtp_region(mtp.drafts as usize, n * k * 4)?,
            s,
        )?;
        rt.record(self.step_event(half), s)
    }

    /// The KV pool and every state row, as the forward step takes them.
    fn device_state(&self) -> std::result::Result<DeviceState, CudaError> {
        let buffers = self.buffers()?;
        let plan = self.plan();
        Ok(DeviceState {
            kv: buffers.kv.all(),
            num_blocks: plan.num_blocks,
            block_size: plan.block_size,
            block_floats: (plan.kv_block_bytes / 4) as usize,
            states: buffers.states.all(),
            num_slots: plan.state_rows(),
            slot_floats: (plan.state_slot_bytes / 4) as usize,
        })
    }
}
