//! The speculative-decoding plans of the host router: `Verify` (a row's next token and its drafts
//! as one run of the main model) and `Draft` (the MTP head's catch-up and `k` greedy drafts).
//! Their bookkeeping (checks, blocks, the reservation ledger, the snapshot ring, the catch-up
//! rings) is `router_book::spec`'s, which the CUDA router shares, in the three phases of
//! `router_book::plans` (validate, reserve, commit), so a refused plan changes nothing; this
//! module turns it into a [`StepJob`].
//!
//! # Verify
//!
//! Row `i` feeds `inputs[i]` at positions `c..c + n` (`c` its `computed_len`) as one run of the
//! model, which writes the main model's Mamba layers after input `j` into the ring row of
//! `snapshots[i][j]` as the run passes (the run's last position writes a scratch row).
//! `TruncateKv` and `SsmSnapshotRestore` then keep the accepted positions.
//!
//! # Draft
//!
//! A row drafts when its MTP catch-up ring holds position `c - 1` (the main model's hidden state
//! there, kept by a prefill or by `SaveHiddenCatchup`); the head first consumes the ring's
//! contiguous positions up to `c - 1` (the last one with the row's next token), on the live state,
//! for good; then `k - 1` more positions on a scratch copy of the state, each fed the draft before.
//! Their K/V land at positions `c..c + k - 1` of the row's blocks, the speculative part of which
//! the next catch-up overwrites; blocks the sequence does not hold yet are taken for the step and
//! given back when it is submitted (device work runs in order, so nothing later sees them before
//! it finished). A row whose ring lacks `c - 1` (when the core kept no hidden state, or after a
//! restore from a version-1 spill image, which carries no ring) drafts nothing: its run is empty.
//!
//! After a prefix-cache hit the head is a cold run's when the hit's checkpoint carries the main
//! model's hidden states before it (`router_book::spec`'s rerun: the router stores them with
//! every checkpoint it takes at the end of a prefill run, and with a `MarconiCheckpoint` whose
//! positions the catch-up ring still holds; the prefill reruns the head over them on copies of
//! the shared blocks; a head with Mamba layers lags one position at such a prefill checkpoint,
//! so the checkpoint holds its state before the rerun's position), and when the blocks the tree
//! serves before the rerun hold head K/V their writers computed for this path
//! (`router_book::Caches::head_vouched`; the tree may keep another sequence's blocks under a
//! marked checkpoint; a head with Mamba layers whose prefill plan ended at the checkpoint is
//! not rerun, and is a cold run's when the hit's token after the checkpoint is the one its mark
//! names). Elsewhere it is the head the cache served: on an unmarked checkpoint, on a mark that
//! does not vouch for the hit (the rerun still runs), and on the hash-chain cache of an
//! attention-only model (no checkpoints). `CacheStats` counts the checkpoint hits of each kind. Only drafts depend on
//! it, never a verified token.

use device_io::{Readback, Result};

use crate::device::{Catchup, DraftJob, DraftJobRow, RunJobRow, StepJob};
use crate::plans::{sink, Planned};
use crate::{CpuSeq, Inner, Shape};

pub(crate) fn verify<'a>(
    shape: &Shape,
    inner: &mut Inner,
    ticket: u64,
    inputs: &[&[u32]],
    snapshots: &[&[usize]],
    readback: Readback<'a>,
    rows: &mut [&mut CpuSeq],
) -> Result<Planned<'a>> {
    let plan = router_book::spec::verify(
        &shape.book(),
        &mut inner.book(),
        inputs,
        snapshots,
        &readback,
        rows,
    )?;
    let (_, host) = sink(shape, "Verify", rows.len(), readback)?;
    let mut job = StepJob {
        ticket,
        vocab: shape.vocab_size,
        keep_hidden: shape.mtp,
        hidden_size: shape.hidden_size,
        tokens: plan.tokens,
        blocks: plan.step.blocks,
        token_rows: plan.step.token_rows,
        tenures: plan.step.tenures,
        ..StepJob::default()
    };
    for (seq, row) in rows.iter().zip(plan.rows) {
        // The model takes a snapshot row per token: the run's last one goes to a scratch row.
        let snapshots = match row.snapshots {
            Some(mut snapshots) => {
                snapshots.push(shape.scratch_row(row.slot));
                snapshots
            }
            None => Vec::new(),
        };
        job.runs.push(RunJobRow {
            tokens: row.tokens,
            start: row.start,
            blocks: row.blocks,
            slot: row.slot,
            snapshots,
            lora: seq
                .lora
                .as_ref()
                .map(|binding| std::sync::Arc::clone(&binding.weights)),
        });
    }
    Ok((job, host))
}

pub(crate) fn draft(
    shape: &Shape,
    inner: &mut Inner,
    ticket: u64,
    tokens: &[u32],
    k: usize,
    rows: &mut [&mut CpuSeq],
) -> Result<Planned<'static>> {
    let (mut book, tracks) = inner.book_and_tracks();
    let plan = router_book::spec::draft(&shape.book(), &mut book, tracks, tokens, k, rows)?;
    let mut job = StepJob {
        ticket,
        vocab: shape.vocab_size,
        hidden_size: shape.hidden_size,
        blocks: plan.step.blocks,
        token_rows: plan.step.token_rows,
        tenures: plan.step.tenures,
        ..StepJob::default()
    };
    let mut draft = DraftJob {
        k,
        ..DraftJob::default()
    };
    for row in plan.rows {
        let catchup = row.catchup.map(|catchup| {
            let next = job.tokens.len()..job.tokens.len() + catchup.tokens.len();
            job.tokens.extend_from_slice(&catchup.tokens);
            let rows_start = draft.hidden.len();
            for hidden in &catchup.hidden {
                draft.hidden.extend_from_slice(hidden);
            }
            Catchup {
                start: catchup.start,
                next,
                rows: rows_start..draft.hidden.len(),
            }
        });
        draft.rows.push(DraftJobRow {
            catchup,
            next_pos: row.next_pos,
            blocks: row.blocks,
            slot: row.slot,
            scratch: if shape.hybrid {
                shape.scratch_row(row.slot)
            } else {
                row.slot
            },
        });
    }
    // Device work runs in submission order: the blocks are free again for work submitted after.
    for block in plan.lent {
        inner.cache.release(block);
    }
    job.draft = Some(draft);
    Ok((job, None))
}
