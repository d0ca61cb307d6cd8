//! The two plans the host router runs: `Prefill` (with prefix attach and checkpoint splits) and
//! `Decode` / `DecodeFed` (one batched model call), each turned into a [`StepJob`] of device work.
//!
//! The bookkeeping is `router_book::plans` (shared with the CUDA router): it validates every
//! row, reserves what the step needs and commits the rows, so a refused step changes nothing,
//! and lists the device work in order; this module turns that list into the job the executor
//! runs after everything submitted before it (with the MTP head's part of each prefill chunk
//! and each row's LoRA adapter, which are this router's). Only a model error there (which
//! validation rules out for well-formed input) fails the step; its rows are then marked failed.
//!
//! A fed row's input token is not known to the host at launch: the row's `tokens` hold
//! [`router_book::FED_PLACEHOLDER`] at that position, and the router records where the token will come from
//! ([`crate::PendingFeed`]) until the step finishes.

use std::sync::Arc;

use device_io::{Readback, Result};

use crate::device::{DecodeJobRow, MtpChunk, Op, StepJob};
use crate::{CpuSeq, Inner, Shape};
use router_book::plans::{self as shared, FeedSources, PrefillOp};

pub(crate) use router_book::plans::Inputs;

/// How the host gets a step's token positions back: the masks (flattened, empty for none) and
/// where host logits go.
pub(crate) type Sink<'a> = (Vec<bool>, Option<&'a mut Vec<f32>>);

pub(crate) fn sink<'a>(
    shape: &Shape,
    what: &'static str,
    rows: usize,
    readback: Readback<'a>,
) -> Result<Sink<'a>> {
    let masks = shared::readback_masks(&shape.book(), what, rows, &readback)?;
    match readback {
        Readback::HostLogits { into } => Ok((masks, Some(into))),
        Readback::Argmax | Readback::ArgmaxMasked { .. } => Ok((masks, None)),
    }
}

/// Where a step's host logits go, when asked for.
fn host_sink(readback: Readback<'_>) -> Option<&mut Vec<f32>> {
    match readback {
        Readback::HostLogits { into } => Some(into),
        Readback::Argmax | Readback::ArgmaxMasked { .. } => None,
    }
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
    let mut book = router_book::book_mut!(inner);
    let (lora, mtp) = (&mut inner.lora, &mut inner.mtp);
    let plan = shared::prefill(
        &shape.book(),
        &mut book,
        budgets,
        &readback,
        rows,
        &mut |adapter| lora.bind(adapter),
    )?;
    let mut job = StepJob {
        ticket,
        masks: plan.step.masks,
        vocab: shape.vocab_size,
        hidden_size: shape.hidden_size,
        blocks: plan.step.blocks,
        token_rows: plan.step.token_rows,
        reports: Some(plan.reports),
        tenures: plan.step.tenures,
        ..StepJob::default()
    };
    for op in plan.ops {
        match op {
            PrefillOp::ZeroSlot(slot) => job.ops.push(Op::ZeroSlot(slot)),
            PrefillOp::CopyRow { from, to } => job.ops.push(Op::CopySlot { from, to }),
            PrefillOp::CopyBlock { from, to } => job.ops.push(Op::CopyBlock { from, to }),
            PrefillOp::Run(run) => {
                let (start, stop) = (run.start, run.stop);
                let seq = &*rows[run.row];
                let tokens = job.tokens.len()..job.tokens.len() + (stop - start);
                job.tokens.extend_from_slice(&seq.tokens[start..stop]);
                let mtp = shape.mtp.then(|| {
                    // The head consumes the positions whose next token is in the prompt (after
                    // a hit on a marked checkpoint, from the rerun's first).
                    let tenure = seq.tenure.expect("assigned by the bookkeeping");
                    let track = mtp.entry(tenure).or_default();
                    let head = router_book::spec::prefill_head_plan(
                        track,
                        book.cache,
                        seq,
                        &run,
                        shape.head_lags,
                    );
                    let (from, known) = (head.run.from, head.run.known);
                    let next = job.tokens.len()..job.tokens.len() + (known - from);
                    job.tokens
                        .extend_from_slice(&seq.tokens[from + 1..known + 1]);
                    MtpChunk {
                        next,
                        keep: (stop == seq.prompt_len).then_some(tenure),
                        lead: head
                            .rerun
                            .map(|lead| (lead.checkpoint.index(), start - lead.from)),
                        stash: head.stash.map(|slot| slot.index()),
                    }
                });
                job.ops.push(Op::Prefill {
                    tokens,
                    start_pos: start,
                    blocks: run.blocks,
                    slot: run.slot,
                    emit: run.emit,
                    mtp,
                    lora: seq
                        .lora
                        .as_ref()
                        .map(|binding| Arc::clone(&binding.weights)),
                });
            }
        }
    }
    Ok((job, host_sink(readback)))
}

pub(crate) fn decode<'a>(
    shape: &Shape,
    inner: &mut Inner,
    ticket: u64,
    inputs: Inputs<'_>,
    readback: Readback<'a>,
    rows: &mut [&mut CpuSeq],
) -> Result<Planned<'a>> {
    let mut book = router_book::book_mut!(inner);
    let sources = FeedSources::new(&inner.last_rows, &inner.last_argmax);
    let plan = shared::decode(
        &shape.book(),
        &mut book,
        ticket,
        inputs,
        &readback,
        sources,
        rows,
    )?;
    let mut job = StepJob {
        ticket,
        masks: plan.step.masks,
        vocab: shape.vocab_size,
        fed_from: plan.fed_from,
        keep_hidden: shape.mtp,
        hidden_size: shape.hidden_size,
        blocks: plan.step.blocks,
        token_rows: plan.step.token_rows,
        tenures: plan.step.tenures,
        ..StepJob::default()
    };
    for (seq, row) in rows.iter().zip(plan.rows) {
        job.decode.push(DecodeJobRow {
            input: row.input,
            pos: row.pos,
            blocks: row.blocks,
            slot: row.slot,
            lora: seq
                .lora
                .as_ref()
                .map(|binding| Arc::clone(&binding.weights)),
        });
    }
    Ok((job, host_sink(readback)))
}
