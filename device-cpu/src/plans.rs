//! The two plans the host router runs: `Prefill` (with prefix attach and checkpoint splits) and
//! `Decode` / `DecodeFed` (one batched model call), each turned into a [`StepJob`] of device work.
//!
//! Both work in three phases, so that a refused step changes nothing:
//! 1. **validate** every row (no state touched);
//! 2. **reserve** what the step needs (slots, the cache lookups that take references, blocks); on a
//!    dry pool every reservation is undone and the step answers `KvExhausted`;
//! 3. **commit**: the bookkeeping moves to the step's end (lengths, tokens, blocks, checkpoint
//!    slots taken) and the device work is written into the job, which the executor runs in order
//!    after everything submitted before it. Only a model error there (which validation rules out
//!    for well-formed input) fails the step; its rows are then marked failed.
//!
//! A fed row's input token is not known to the host at launch: the row's `tokens` hold
//! [`FED_PLACEHOLDER`] at that position, and the router records where the token will come from
//! ([`crate::PendingFeed`]) until the step finishes.

use std::sync::Arc;

use device_io::{DeviceError, Feed, PrefillReport, Readback, Result};

use crate::device::{DecodeJobRow, Input, MtpChunk, Op, StepJob};
use crate::{CpuSeq, Inner, Shape};
use router_book::{book, Attach, PendingFeed, SlotOwner, Tenure};

/// What a fed position holds in `CpuSeq::tokens` until its step has finished.
pub(crate) use router_book::FED_PLACEHOLDER;

pub(crate) fn invalid(what: &'static str, detail: String) -> DeviceError {
    DeviceError::Invalid { what, detail }
}

/// How the host gets a step's token positions back: the masks (flattened, empty for none) and
/// where host logits go.
pub(crate) type Sink<'a> = (Vec<bool>, Option<&'a mut Vec<f32>>);

pub(crate) fn sink<'a>(
    shape: &Shape,
    what: &'static str,
    rows: usize,
    readback: Readback<'a>,
) -> Result<Sink<'a>> {
    match readback {
        Readback::Argmax => Ok((Vec::new(), None)),
        Readback::HostLogits { into } => Ok((Vec::new(), Some(into))),
        Readback::ArgmaxMasked { masks } => Ok((flatten_masks(shape, what, rows, masks)?, None)),
    }
}

/// Checks one mask per row, each `vocab_size` long with an allowed token, and flattens them.
fn flatten_masks(
    shape: &Shape,
    what: &'static str,
    rows: usize,
    masks: &[&[bool]],
) -> Result<Vec<bool>> {
    if masks.len() != rows {
        return Err(invalid(
            what,
            format!("{} masks for {rows} rows", masks.len()),
        ));
    }
    let mut flat = Vec::with_capacity(rows * shape.vocab_size);
    for (i, mask) in masks.iter().enumerate() {
        if mask.len() != shape.vocab_size {
            return Err(invalid(
                what,
                format!(
                    "mask {i} has {} entries, the vocabulary {}",
                    mask.len(),
                    shape.vocab_size
                ),
            ));
        }
        if !mask.iter().any(|allowed| *allowed) {
            return Err(invalid(what, format!("mask {i} allows no token")));
        }
        flat.extend_from_slice(mask);
    }
    Ok(flat)
}

/// Takes `count` blocks into `inner.fresh` (cleared first), evicting cached ones if the free
/// list runs dry; on failure gives back what it took and answers the typed error.
pub(crate) fn reserve_blocks(inner: &mut Inner, count: usize) -> Result<()> {
    let available = inner.cache.free_blocks() + inner.cache.evictable_blocks();
    inner.fresh.clear();
    for _ in 0..count {
        match inner.cache.allocate() {
            Some(block) => inner.fresh.push(block),
            None => {
                for block in inner.fresh.drain(..) {
                    inner.cache.release(block);
                }
                return Err(DeviceError::KvExhausted {
                    needed: count,
                    free: available,
                });
            }
        }
    }
    Ok(())
}

/// The first chunk of a new row: where it starts (after the cached prefix), what it attached,
/// and the adapter it binds.
struct NewRow {
    slot: usize,
    attach: Attach,
    lora: Option<crate::lora::Binding>,
}

/// A validated plan's job, and where its host logits go (when asked for).
pub(crate) type Planned<'a> = (StepJob, Option<&'a mut Vec<f32>>);

pub(crate) fn prefill<'a>(
    shape: &Shape,
    inner: &mut Inner,
    ticket: u64,
    budgets: &[usize],
    readback: Readback<'a>,
    rows: &mut [&mut CpuSeq],
) -> Result<Planned<'a>> {
    // Phase 1: validate.
    if budgets.len() != rows.len() {
        return Err(invalid(
            "Prefill",
            format!("{} budgets for {} rows", budgets.len(), rows.len()),
        ));
    }
    let (masks, host) = sink(shape, "Prefill", rows.len(), readback)?;
    for (i, (seq, &budget)) in rows.iter().zip(budgets).enumerate() {
        let id = seq.id;
        book::check_tenure(&inner.tenures, seq, "Prefill")?;
        if seq.failed {
            return Err(invalid(
                "Prefill",
                format!("row {i} (sequence {id}) failed in an earlier step; release it"),
            ));
        }
        if budget == 0 {
            return Err(invalid("Prefill", format!("row {i} has a budget of 0")));
        }
        if seq.prompt_len == 0 {
            return Err(invalid(
                "Prefill",
                format!("row {i} (sequence {id}) has an empty prompt"),
            ));
        }
        if seq.computed_len >= seq.prompt_len {
            return Err(invalid(
                "Prefill",
                format!(
                    "row {i} (sequence {id}) has its prompt of {} tokens complete",
                    seq.prompt_len
                ),
            ));
        }
        if seq.prompt_len > shape.max_context {
            return Err(invalid(
                "Prefill",
                format!(
                    "row {i} (sequence {id}) has a prompt of {} tokens, over max_context {}",
                    seq.prompt_len, shape.max_context
                ),
            ));
        }
        if seq.tenure.is_some() && seq.slot.is_none() {
            return Err(invalid(
                "Prefill",
                format!("row {i} (sequence {id}) has no live slot (it was detached)"),
            ));
        }
        if seq.tenure.is_none() {
            if let Err(reason) = inner.lora.bind(seq.namespace.adapter) {
                return Err(invalid(
                    "Prefill",
                    format!(
                        "row {i} (sequence {id}) names an adapter that cannot be used: {reason}"
                    ),
                ));
            }
            if let Some(&bad) = seq.tokens.iter().find(|&&t| t as usize >= shape.vocab_size) {
                return Err(invalid(
                    "Prefill",
                    format!(
                        "row {i} (sequence {id}) has token id {bad}, outside the vocabulary of {}",
                        shape.vocab_size
                    ),
                ));
            }
        }
    }

    // Phase 2: reserve slots, cached prefixes and blocks.
    let new_count = rows.iter().filter(|s| s.tenure.is_none()).count();
    let free_slots: Vec<usize> = (0..shape.max_seqs)
        .filter(|&i| inner.slots[i].is_none())
        .take(new_count)
        .collect();
    if free_slots.len() < new_count {
        return Err(DeviceError::SlotsExhausted {
            total: shape.max_seqs,
        });
    }
    let mut new_rows: Vec<Option<NewRow>> = Vec::with_capacity(rows.len());
    let mut next_free = free_slots.into_iter();
    let mut needs = Vec::with_capacity(rows.len());
    for (seq, &budget) in rows.iter().zip(budgets) {
        let (start, held, new_row) = if seq.tenure.is_none() {
            // The last prompt token must be computed (its logits are needed, and Mamba state cannot
            // step back), so only the prompt without it is looked up.
            let lookup = &seq.tokens[..seq.prompt_len - 1];
            let lora = inner
                .lora
                .bind(seq.namespace.adapter)
                .map_err(|reason| invalid("Prefill", reason))?;
            let namespace = crate::Namespace {
                adapter: lora.as_ref().map(|binding| binding.serial),
                cache_salt: seq.namespace.cache_salt,
            };
            let attach = inner.cache.lookup(namespace, lookup);
            let slot = next_free.next().expect("counted above");
            (
                attach.len,
                attach.blocks.len(),
                Some(NewRow { slot, attach, lora }),
            )
        } else {
            (seq.computed_len, seq.blocks.len(), None)
        };
        let end = (start + budget).min(seq.prompt_len);
        needs.push(end.div_ceil(shape.block_size).saturating_sub(held));
        new_rows.push(new_row);
    }
    let total_needed: usize = needs.iter().sum();
    match reserve_blocks(inner, total_needed) {
        Ok(()) => {}
        Err(err) => {
            for new_row in new_rows.into_iter().flatten() {
                inner.cache.undo_attach(new_row.attach);
            }
            return Err(err);
        }
    };

    // Phase 3: commit.
    let mut job = StepJob {
        ticket,
        masks,
        vocab: shape.vocab_size,
        hidden_size: shape.hidden_size,
        ..StepJob::default()
    };
    let reports = commit_prefill(shape, inner, budgets, rows, new_rows, &needs, &mut job);
    job.reports = Some(reports);
    job.tenures = rows
        .iter()
        .map(|seq| seq.tenure.unwrap_or_default())
        .collect();
    Ok((job, host))
}

fn commit_prefill(
    shape: &Shape,
    inner: &mut Inner,
    budgets: &[usize],
    rows: &mut [&mut CpuSeq],
    new_rows: Vec<Option<NewRow>>,
    needs: &[usize],
    job: &mut StepJob,
) -> Vec<PrefillReport> {
    let mut reports = Vec::with_capacity(rows.len());
    let mut token_rows = 0;
    for (i, new_row) in new_rows.into_iter().enumerate() {
        let seq = &mut *rows[i];
        let mut report = PrefillReport::default();
        if let Some(NewRow { slot, attach, lora }) = new_row {
            let tenure = router_book::new_tenure();
            inner.tenures.insert(
                tenure,
                Tenure {
                    seq_id: seq.id,
                    adapter: seq.namespace.adapter,
                },
            );
            seq.lora = lora;
            inner.slots[slot] = Some(SlotOwner { tenure });
            seq.tenure = Some(tenure);
            seq.slot = Some(slot);
            seq.computed_len = attach.len;
            seq.blocks = attach.blocks;
            seq.pin = attach.pin;
            seq.branch_point = attach.branch_point;
            report.cached = attach.len;
            job.ops.push(Op::ZeroSlot(slot));
            if let Some(checkpoint) = attach.checkpoint {
                job.ops.push(Op::CopySlot {
                    from: shape.checkpoint_row(checkpoint.index()),
                    to: slot,
                });
            }
        }
        let from = inner.fresh.len() - needs[i];
        seq.blocks.extend(inner.fresh.drain(from..));
        let slot = seq.slot.expect("validated or assigned above");
        let start = seq.computed_len;
        let end = (start + budgets[i]).min(seq.prompt_len);
        let blocks = job.blocks.len()..job.blocks.len() + seq.blocks.len();
        job.blocks.extend_from_slice(&seq.blocks);
        // Where the computation stops to take a checkpoint: the tree's branch point, and the
        // end-of-input checkpoint: the last block boundary before the prompt's last token, which
        // is the longest hit both a repeat of this prompt and a longer request can use (a hit
        // must leave the last prompt token to compute).
        let input_boundary = (inner.cache.wants_end_checkpoints()
            && seq.input_checkpoint.is_none())
        .then_some((seq.prompt_len - 1) / shape.block_size * shape.block_size)
        .filter(|&b| b > 0);
        let mut pos = start;
        while pos < end {
            let mut stop = end;
            for point in [seq.branch_point, input_boundary].into_iter().flatten() {
                if point > pos && point < stop {
                    stop = point;
                }
            }
            let tokens = job.tokens.len()..job.tokens.len() + (stop - pos);
            job.tokens.extend_from_slice(&seq.tokens[pos..stop]);
            let mtp = shape.mtp.then(|| {
                // The head consumes the positions whose next token is in the prompt.
                let tenure = seq.tenure.expect("assigned above");
                let known = stop.min(seq.prompt_len - 1);
                let next = job.tokens.len()..job.tokens.len() + known.saturating_sub(pos);
                if known > pos {
                    job.tokens.extend_from_slice(&seq.tokens[pos + 1..=known]);
                }
                inner.mtp.entry(tenure).or_default().consumed = known.max(pos);
                MtpChunk {
                    next,
                    keep: (stop == seq.prompt_len).then_some(tenure),
                }
            });
            job.ops.push(Op::Prefill {
                tokens,
                start_pos: pos,
                blocks: blocks.clone(),
                slot,
                emit: stop == seq.prompt_len,
                mtp,
                lora: seq
                    .lora
                    .as_ref()
                    .map(|binding| Arc::clone(&binding.weights)),
            });
            pos = stop;
            seq.computed_len = pos;
            if seq.branch_point == Some(pos) {
                seq.branch_point = None;
                take_branch_checkpoint(shape, inner, seq, &mut job.ops);
            } else if input_boundary == Some(pos) {
                if let Some(checkpoint) = take_checkpoint(shape, inner, seq, &mut job.ops) {
                    seq.input_checkpoint = Some((pos, checkpoint));
                }
            }
        }
        report.computed = end - start;
        report.done = end == seq.prompt_len;
        if report.done {
            job.token_rows.push(Some(token_rows));
            token_rows += 1;
        } else {
            job.token_rows.push(None);
        }
        reports.push(report);
    }
    reports
}

/// Takes a checkpoint slot for the live state at the tree's branch point and registers it.
fn take_branch_checkpoint(shape: &Shape, inner: &mut Inner, seq: &mut CpuSeq, ops: &mut Vec<Op>) {
    let pos = seq.computed_len;
    let Some(checkpoint) = take_checkpoint(shape, inner, seq, ops) else {
        return;
    };
    match &seq.pin {
        Some(pin) => inner
            .cache
            .register_branch(pin, &seq.tokens[..pos], checkpoint),
        None => inner.cache.free_checkpoint_slot(checkpoint),
    }
}

/// Takes a fresh checkpoint slot (evicting cached checkpoints if needed) and queues the copy of
/// the live state into it; `None` when the region is held entirely by running sequences (the
/// checkpoint is skipped: it is an optimisation, never needed for correctness).
pub(crate) fn take_checkpoint(
    shape: &Shape,
    inner: &mut Inner,
    seq: &CpuSeq,
    ops: &mut Vec<Op>,
) -> Option<router_book::CheckpointSlot> {
    let (checkpoint, from, to) = book::take_checkpoint(&shape.book(), &mut inner.book(), seq)?;
    ops.push(Op::CopySlot { from, to });
    Some(checkpoint)
}

/// A decode's inputs: host tokens (`Decode`) or per-row sources (`DecodeFed`).
pub(crate) enum Inputs<'a> {
    Tokens(&'a [u32]),
    Fed(&'a [Feed]),
}

impl Inputs<'_> {
    fn len(&self) -> usize {
        match self {
            Inputs::Tokens(tokens) => tokens.len(),
            Inputs::Fed(sources) => sources.len(),
        }
    }
}

pub(crate) fn decode<'a>(
    shape: &Shape,
    inner: &mut Inner,
    ticket: u64,
    inputs: Inputs<'_>,
    readback: Readback<'a>,
    rows: &mut [&mut CpuSeq],
) -> Result<Planned<'a>> {
    let what = match inputs {
        Inputs::Tokens(_) => "Decode",
        Inputs::Fed(_) => "DecodeFed",
    };
    // Phase 1: validate.
    if inputs.len() != rows.len() {
        let kind = match inputs {
            Inputs::Tokens(_) => "tokens",
            Inputs::Fed(_) => "sources",
        };
        return Err(invalid(
            what,
            format!("{} {kind} for {} rows", inputs.len(), rows.len()),
        ));
    }
    let (masks, host) = sink(shape, what, rows.len(), readback)?;
    let mut job_inputs = Vec::with_capacity(rows.len());
    for (i, seq) in rows.iter().enumerate() {
        let id = seq.id;
        check_row(shape, inner, what, i, seq, 1)?;
        let input = match &inputs {
            Inputs::Tokens(tokens) => Input::Token(tokens[i]),
            Inputs::Fed(sources) => match sources[i] {
                Feed::Host(token) => Input::Token(token),
                Feed::Row(r) => match inner.last_rows.get(r) {
                    Some(&(tenure, true)) if Some(tenure) == seq.tenure => Input::Feed(r),
                    Some(&(tenure, _)) if Some(tenure) != seq.tenure => {
                        return Err(invalid(
                            what,
                            format!(
                                "row {i} (sequence {id}) feeds from row {r} of the previous \
                                 step, which was another sequence"
                            ),
                        ))
                    }
                    Some(_) => {
                        return Err(invalid(
                            what,
                            format!(
                                "row {i} feeds from row {r} of the previous step, which reached \
                                 no token position"
                            ),
                        ))
                    }
                    None => {
                        return Err(invalid(
                            what,
                            format!(
                                "row {i} feeds from row {r}; the previous step had {} rows",
                                inner.last_rows.len()
                            ),
                        ))
                    }
                },
            },
        };
        if let Input::Token(token) = input {
            if token as usize >= shape.vocab_size {
                return Err(invalid(
                    what,
                    format!(
                        "row {i} (sequence {id}) feeds token id {token}, outside the vocabulary of {}",
                        shape.vocab_size
                    ),
                ));
            }
        }
        job_inputs.push(input);
    }
    let fed_from = job_inputs
        .iter()
        .any(|input| matches!(input, Input::Feed(_)))
        .then(|| ticket - 1);

    // Phase 2: reserve the block each row's new position needs.
    let needs_block = |seq: &CpuSeq| seq.blocks.len() * shape.block_size <= seq.computed_len;
    let total_needed = rows.iter().filter(|seq| needs_block(seq)).count();
    reserve_blocks(inner, total_needed)?;

    // Phase 3: commit.
    let mut job = StepJob {
        ticket,
        masks,
        vocab: shape.vocab_size,
        fed_from,
        keep_hidden: shape.mtp,
        hidden_size: shape.hidden_size,
        ..StepJob::default()
    };
    let wants_checkpoints = inner.cache.wants_end_checkpoints();
    for (i, (seq, input)) in rows.iter_mut().zip(job_inputs).enumerate() {
        if needs_block(seq) {
            seq.blocks.push(inner.fresh.pop().expect("reserved above"));
        }
        let blocks = job.blocks.len()..job.blocks.len() + seq.blocks.len();
        job.blocks.extend_from_slice(&seq.blocks);
        let pos = seq.computed_len;
        job.decode.push(DecodeJobRow {
            input,
            pos,
            blocks,
            slot: seq.slot.expect("validated"),
            lora: seq
                .lora
                .as_ref()
                .map(|binding| Arc::clone(&binding.weights)),
        });
        let tenure = seq.tenure.expect("validated");
        match input {
            Input::Token(token) => seq.tokens.push(token),
            Input::Feed(row) => {
                let source = ticket - 1;
                // The source step may have finished already; then its argmax is known here.
                match &inner.last_argmax {
                    Some((step, argmax)) if *step == source => {
                        seq.tokens.push(argmax[row].unwrap_or(FED_PLACEHOLDER));
                    }
                    _ => {
                        seq.tokens.push(FED_PLACEHOLDER);
                        inner.pending.entry(tenure).or_default().push(PendingFeed {
                            pos,
                            ticket: source,
                            row,
                        });
                    }
                }
            }
        }
        seq.computed_len += 1;
        // A boundary passed without its checkpoint cannot be taken any more.
        seq.checkpoint_due = wants_checkpoints && seq.computed_len % shape.block_size == 0;
        job.token_rows.push(Some(i));
        job.tenures.push(tenure);
    }
    Ok((job, host))
}

/// Refuses a row that cannot take a decode-like step: failed, foreign, without a slot, rolled
/// back, with its prompt incomplete, or past the context after `extra` more positions.
pub(crate) fn check_row(
    shape: &Shape,
    inner: &Inner,
    what: &'static str,
    i: usize,
    seq: &CpuSeq,
    extra: usize,
) -> Result<()> {
    let id = seq.id;
    if seq.failed {
        return Err(invalid(
            what,
            format!("row {i} (sequence {id}) failed in an earlier step; release it"),
        ));
    }
    book::check_tenure(&inner.tenures, seq, what)?;
    if seq.slot.is_none() {
        return Err(invalid(
            what,
            format!("row {i} (sequence {id}) holds no live slot"),
        ));
    }
    if seq.state_ahead {
        return Err(invalid(
            what,
            format!("row {i} (sequence {id}) was rolled back; its state is past its length"),
        ));
    }
    if seq.computed_len < seq.prompt_len {
        return Err(invalid(
            what,
            format!(
                "row {i} (sequence {id}) has computed {} of its {} prompt tokens",
                seq.computed_len, seq.prompt_len
            ),
        ));
    }
    if seq.computed_len + extra > shape.max_context {
        return Err(invalid(
            what,
            format!(
                "row {i} (sequence {id}) would reach {} tokens, over max_context {}",
                seq.computed_len + extra,
                shape.max_context
            ),
        ));
    }
    Ok(())
}
