//! The two plans the host router runs: `Prefill` (with prefix attach and checkpoint splits) and
//! `Decode` (one batched model call).
//!
//! Both work in three phases, so that a refused step changes nothing:
//! 1. **validate** every row (no state touched);
//! 2. **reserve** what the step needs (slots, the cache lookups that take references, blocks); on a
//!    dry pool every reservation is undone and the step answers `KvExhausted`;
//! 3. **commit and compute**. Only a model error here (which validation rules out for well-formed
//!    input) leaves the rows changed; they are marked failed.

use device_io::{DeviceError, PrefillReport, Readback, Result, RowOutput, StepResult, Ticket};
use model::{DecodeRow, Model, PrefillRow};

use crate::cache::Attach;
use crate::{CpuSeq, Inner, LogitsHandle, Shape, SlotOwner, Tenure};

fn invalid(what: &'static str, detail: String) -> DeviceError {
    DeviceError::Invalid { what, detail }
}

/// The index of the largest value (the first one on ties), as `torch.argmax` picks it.
pub(crate) fn argmax(row: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &value) in row.iter().enumerate() {
        if value > row[best] {
            best = i;
        }
    }
    best as u32
}

/// How the host gets a step's token positions back.
enum Sink<'a> {
    Argmax,
    Host(&'a mut Vec<f32>),
}

fn sink<'a>(readback: Readback<'a>) -> Result<Sink<'a>> {
    match readback {
        Readback::Argmax => Ok(Sink::Argmax),
        Readback::HostLogits { into } => Ok(Sink::Host(into)),
        Readback::ArgmaxMasked { .. } => Err(DeviceError::Unsupported {
            what: "ArgmaxMasked",
        }),
    }
}

fn forward_failed(rows: &mut [&mut CpuSeq], err: model::ModelError) -> DeviceError {
    for seq in rows.iter_mut() {
        seq.failed = true;
    }
    tracing::error!(%err, "forward step failed; its rows are marked failed");
    DeviceError::Failed {
        phase: device_io::Phase::Forward,
        message: err.to_string(),
    }
}

/// Fills the step's outputs from `inner.logits` and records the step as the logits holder.
fn finish_step(
    inner: &mut Inner,
    ticket: Ticket,
    token_rows: impl ExactSizeIterator<Item = Option<usize>>,
    reports: Option<Vec<PrefillReport>>,
    sink: Sink<'_>,
    vocab: usize,
) -> StepResult<LogitsHandle> {
    let logits_rows = inner.logits.len() / vocab.max(1);
    inner.logits_rows = logits_rows;
    inner.logits_step = Some(ticket.0);
    let mut outputs = Vec::with_capacity(token_rows.len());
    let host = matches!(sink, Sink::Host(_));
    for (i, row) in token_rows.enumerate() {
        let mut out = RowOutput {
            prefill: reports.as_ref().map(|r| r[i]),
            ..RowOutput::default()
        };
        if let Some(row) = row {
            if host {
                out.logits_row = Some(row);
            } else {
                out.token = Some(argmax(&inner.logits[row * vocab..(row + 1) * vocab]));
            }
        }
        outputs.push(out);
    }
    if let Sink::Host(into) = sink {
        into.clear();
        into.extend_from_slice(&inner.logits);
    }
    StepResult {
        ticket,
        rows: outputs,
        logits: (logits_rows > 0).then_some(LogitsHandle { step: ticket.0 }),
    }
}

/// Takes `count` blocks into `inner.fresh` (cleared first), evicting cached ones if the free
/// list runs dry; on failure gives back what it took and answers the typed error.
fn reserve_blocks(inner: &mut Inner, count: usize) -> Result<()> {
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

/// The first chunk of a new row: where it starts (after the cached prefix) and what it attached.
struct NewRow {
    slot: usize,
    attach: Attach,
}

pub(crate) fn prefill(
    model: &Model,
    shape: &Shape,
    inner: &mut Inner,
    ticket: Ticket,
    budgets: &[usize],
    readback: Readback<'_>,
    rows: &mut [&mut CpuSeq],
) -> Result<StepResult<LogitsHandle>> {
    // Phase 1: validate.
    if budgets.len() != rows.len() {
        return Err(invalid(
            "Prefill",
            format!("{} budgets for {} rows", budgets.len(), rows.len()),
        ));
    }
    let sink = sink(readback)?;
    for (i, (seq, &budget)) in rows.iter().zip(budgets).enumerate() {
        let id = seq.id;
        crate::effects::check_tenure(inner, seq, "Prefill")?;
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
            let attach = inner.cache.lookup(seq.namespace, lookup);
            let slot = next_free.next().expect("counted above");
            (
                attach.len,
                attach.blocks.len(),
                Some(NewRow { slot, attach }),
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

    // Phase 3: commit and compute.
    let reserved = Reserved { new_rows, needs };
    match commit_prefill(model, shape, inner, budgets, rows, reserved) {
        Ok((token_rows, reports)) => Ok(finish_step(
            inner,
            ticket,
            token_rows.into_iter(),
            Some(reports),
            sink,
            shape.vocab_size,
        )),
        Err(err) => Err(forward_failed(rows, err)),
    }
}

/// What phase 2 of a prefill reserved (besides the blocks in `inner.fresh`).
struct Reserved {
    new_rows: Vec<Option<NewRow>>,
    needs: Vec<usize>,
}

type PrefillOutputs = (Vec<Option<usize>>, Vec<PrefillReport>);

fn commit_prefill(
    model: &Model,
    shape: &Shape,
    inner: &mut Inner,
    budgets: &[usize],
    rows: &mut [&mut CpuSeq],
    reserved: Reserved,
) -> std::result::Result<PrefillOutputs, model::ModelError> {
    let vocab = shape.vocab_size;
    let Reserved { new_rows, needs } = reserved;
    inner.logits.clear();
    let mut token_rows = Vec::with_capacity(rows.len());
    let mut reports = Vec::with_capacity(rows.len());
    for (i, new_row) in new_rows.into_iter().enumerate() {
        let seq = &mut *rows[i];
        let mut report = PrefillReport::default();
        if let Some(NewRow { slot, attach }) = new_row {
            let tenure = crate::new_tenure();
            inner.tenures.insert(tenure, Tenure { seq_id: seq.id });
            inner.slots[slot] = Some(SlotOwner { tenure });
            seq.tenure = Some(tenure);
            seq.slot = Some(slot);
            seq.computed_len = attach.len;
            seq.blocks = attach.blocks;
            seq.pin = attach.pin;
            seq.branch_point = attach.branch_point;
            report.cached = attach.len;
            inner.states.zero_slot(slot)?;
            if let Some(checkpoint) = attach.checkpoint {
                inner
                    .states
                    .copy_slot(shape.checkpoint_row(checkpoint.index()), slot)?;
            }
        }
        let from = inner.fresh.len() - needs[i];
        seq.blocks.extend(inner.fresh.drain(from..));
        let slot = seq.slot.expect("validated or assigned above");
        let start = seq.computed_len;
        let end = (start + budgets[i]).min(seq.prompt_len);
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
            let row = PrefillRow {
                tokens: &seq.tokens[pos..stop],
                start_pos: pos,
                blocks: &seq.blocks,
                slot,
            };
            model.prefill(
                &mut inner.scratch,
                &mut inner.kv,
                &mut inner.states,
                row,
                false,
                &mut inner.row_logits,
            )?;
            pos = stop;
            seq.computed_len = pos;
            if seq.branch_point == Some(pos) {
                seq.branch_point = None;
                take_branch_checkpoint(shape, inner, seq)?;
            } else if input_boundary == Some(pos) {
                if let Some(checkpoint) = take_checkpoint(shape, inner, seq)? {
                    seq.input_checkpoint = Some((pos, checkpoint));
                }
            }
        }
        report.computed = end - start;
        report.done = end == seq.prompt_len;
        if report.done {
            token_rows.push(Some(inner.logits.len() / vocab));
            let Inner {
                logits, row_logits, ..
            } = &mut *inner;
            logits.extend_from_slice(row_logits);
        } else {
            token_rows.push(None);
        }
        reports.push(report);
    }
    Ok((token_rows, reports))
}

/// Copies the live state at the tree's branch point into a checkpoint slot and registers it.
fn take_branch_checkpoint(
    shape: &Shape,
    inner: &mut Inner,
    seq: &mut CpuSeq,
) -> std::result::Result<(), model::ModelError> {
    let pos = seq.computed_len;
    let Some(checkpoint) = take_checkpoint(shape, inner, seq)? else {
        return Ok(());
    };
    match &seq.pin {
        Some(pin) => inner
            .cache
            .register_branch(pin, &seq.tokens[..pos], checkpoint),
        None => inner.cache.free_checkpoint_slot(checkpoint),
    }
    Ok(())
}

/// Copies the live state into a fresh checkpoint slot (evicting cached checkpoints if needed);
/// `None` when the region is held entirely by running sequences (the checkpoint is skipped: it
/// is an optimisation, never needed for correctness).
pub(crate) fn take_checkpoint(
    shape: &Shape,
    inner: &mut Inner,
    seq: &CpuSeq,
) -> std::result::Result<Option<crate::cache::CheckpointSlot>, model::ModelError> {
    let Some(checkpoint) = inner.cache.take_checkpoint_slot(seq.pin.as_ref()) else {
        tracing::debug!(
            pos = seq.computed_len,
            "no checkpoint slot free; checkpoint skipped"
        );
        return Ok(None);
    };
    let slot = seq.slot.expect("a computing row has a slot");
    if let Err(err) = inner
        .states
        .copy_slot(slot, shape.checkpoint_row(checkpoint.index()))
    {
        inner.cache.free_checkpoint_slot(checkpoint);
        return Err(err);
    }
    Ok(Some(checkpoint))
}

pub(crate) fn decode(
    model: &Model,
    shape: &Shape,
    inner: &mut Inner,
    ticket: Ticket,
    tokens: &[u32],
    readback: Readback<'_>,
    rows: &mut [&mut CpuSeq],
) -> Result<StepResult<LogitsHandle>> {
    // Phase 1: validate.
    if tokens.len() != rows.len() {
        return Err(invalid(
            "Decode",
            format!("{} tokens for {} rows", tokens.len(), rows.len()),
        ));
    }
    let sink = sink(readback)?;
    for (i, (seq, &token)) in rows.iter().zip(tokens).enumerate() {
        let id = seq.id;
        if seq.failed {
            return Err(invalid(
                "Decode",
                format!("row {i} (sequence {id}) failed in an earlier step; release it"),
            ));
        }
        crate::effects::check_tenure(inner, seq, "Decode")?;
        if seq.slot.is_none() {
            return Err(invalid(
                "Decode",
                format!("row {i} (sequence {id}) holds no live slot"),
            ));
        }
        if seq.computed_len < seq.prompt_len {
            return Err(invalid(
                "Decode",
                format!(
                    "row {i} (sequence {id}) has computed {} of its {} prompt tokens",
                    seq.computed_len, seq.prompt_len
                ),
            ));
        }
        if seq.computed_len + 1 > shape.max_context {
            return Err(invalid(
                "Decode",
                format!(
                    "row {i} (sequence {id}) would reach {} tokens, over max_context {}",
                    seq.computed_len + 1,
                    shape.max_context
                ),
            ));
        }
        if token as usize >= shape.vocab_size {
            return Err(invalid(
                "Decode",
                format!(
                    "row {i} (sequence {id}) feeds token id {token}, outside the vocabulary of {}",
                    shape.vocab_size
                ),
            ));
        }
    }

    // Phase 2: reserve the block each row's new position needs.
    let needs_block = |seq: &CpuSeq| seq.blocks.len() * shape.block_size <= seq.computed_len;
    let total_needed = rows.iter().filter(|seq| needs_block(seq)).count();
    reserve_blocks(inner, total_needed)?;

    // Phase 3: commit and compute.
    for seq in rows.iter_mut() {
        if needs_block(seq) {
            seq.blocks.push(inner.fresh.pop().expect("reserved above"));
        }
    }
    let batch: Vec<DecodeRow<'_>> = rows
        .iter()
        .zip(tokens)
        .map(|(seq, &token)| DecodeRow {
            token,
            pos: seq.computed_len,
            blocks: &seq.blocks,
            slot: seq.slot.expect("validated"),
        })
        .collect();
    let Inner {
        kv,
        states,
        scratch,
        logits,
        ..
    } = &mut *inner;
    let result = model.decode(scratch, kv, states, &batch, logits);
    drop(batch);
    if let Err(err) = result {
        return Err(forward_failed(rows, err));
    }
    let wants_checkpoints = inner.cache.wants_end_checkpoints();
    for (seq, &token) in rows.iter_mut().zip(tokens) {
        seq.tokens.push(token);
        seq.computed_len += 1;
        // A boundary passed without its checkpoint cannot be taken any more.
        seq.checkpoint_due = wants_checkpoints && seq.computed_len % shape.block_size == 0;
    }
    Ok(finish_step(
        inner,
        ticket,
        (0..rows.len()).map(Some),
        None,
        sink,
        shape.vocab_size,
    ))
}
