//! The speculative-decoding plans of the host router: `Verify` (a row's next token and its drafts
//! as one run of the main model) and `Draft` (the MTP head's catch-up and `k` greedy drafts),
//! each turned into a [`StepJob`] in the three phases of [`crate::plans`] (validate, reserve,
//! commit), so a refused plan changes nothing.
//!
//! # Verify
//!
//! Row `i` feeds `inputs[i]` at positions `c..c + n` (`c` its `computed_len`): the blocks those
//! positions need are taken and recorded in the row's reservation ledger entry (committing the
//! one before, as `ReserveKv` does), the tokens and the length move to the run's end, and
//! `snapshots[i][j]` becomes a ring entry of this sequence at position `c + j + 1` holding the
//! main model's Mamba layers (the model writes them as the run passes; the run's last position
//! writes a scratch row). `TruncateKv` and `SsmSnapshotRestore` then keep the accepted positions.
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
//! it finished). A row whose ring lacks `c - 1` (after a spill and restore, or when the core kept
//! no hidden state) drafts nothing: its run is empty.
//!
//! The MTP head's state is approximate after a prefix-cache hit (its K/V at the position before
//! the hit's end and its checkpointed state were computed by the sequence that cached them); only
//! drafts depend on it, never a verified token.

use device_io::{DeviceError, Readback, Result};

use crate::device::{Catchup, DraftJob, DraftJobRow, RunJobRow, StepJob};
use crate::plans::{check_row, invalid, reserve_blocks, sink, Planned};
use crate::{CpuSeq, Inner, RingEntry, Shape};
use router_book::Reservation;

fn check_token(shape: &Shape, what: &'static str, i: usize, token: u32) -> Result<()> {
    if token as usize >= shape.vocab_size {
        return Err(invalid(
            what,
            format!(
                "row {i} feeds token id {token}, outside the vocabulary of {}",
                shape.vocab_size
            ),
        ));
    }
    Ok(())
}

pub(crate) fn verify<'a>(
    shape: &Shape,
    inner: &mut Inner,
    ticket: u64,
    inputs: &[&[u32]],
    snapshots: &[&[usize]],
    readback: Readback<'a>,
    rows: &mut [&mut CpuSeq],
) -> Result<Planned<'a>> {
    const WHAT: &str = "Verify";
    // Phase 1: validate.
    if inputs.len() != rows.len() {
        return Err(invalid(
            WHAT,
            format!("{} inputs for {} rows", inputs.len(), rows.len()),
        ));
    }
    if matches!(readback, Readback::ArgmaxMasked { .. }) {
        return Err(DeviceError::Unsupported {
            what: "Verify with ArgmaxMasked",
        });
    }
    let (_, host) = sink(shape, WHAT, rows.len(), readback)?;
    if !snapshots.is_empty() && snapshots.len() != rows.len() {
        return Err(invalid(
            WHAT,
            format!("{} snapshot lists for {} rows", snapshots.len(), rows.len()),
        ));
    }
    let mut ring_used = vec![false; shape.snapshot_slots];
    for (i, (seq, input)) in rows.iter().zip(inputs).enumerate() {
        if input.is_empty() {
            return Err(invalid(WHAT, format!("row {i} feeds no token")));
        }
        check_row(shape, inner, WHAT, i, seq, input.len())?;
        for &token in input.iter() {
            check_token(shape, WHAT, i, token)?;
        }
        if let Some(slots) = snapshots.get(i) {
            if slots.len() != input.len() - 1 {
                return Err(invalid(
                    WHAT,
                    format!(
                        "row {i} names {} snapshot slots for {} drafts",
                        slots.len(),
                        input.len() - 1
                    ),
                ));
            }
            for &slot in slots.iter() {
                if slot >= shape.snapshot_slots {
                    return Err(invalid(
                        WHAT,
                        format!(
                            "ring slot {slot} is outside the {} snapshot slots",
                            shape.snapshot_slots
                        ),
                    ));
                }
                if std::mem::replace(&mut ring_used[slot], true) {
                    return Err(invalid(WHAT, format!("ring slot {slot} is named twice")));
                }
            }
        }
    }

    // Phase 2: reserve the blocks every row's positions need.
    let needs = |seq: &CpuSeq, n: usize| {
        (seq.computed_len + n)
            .div_ceil(shape.block_size)
            .saturating_sub(seq.blocks.len())
    };
    let total: usize = rows
        .iter()
        .zip(inputs)
        .map(|(seq, input)| needs(seq, input.len()))
        .sum();
    reserve_blocks(inner, total)?;

    // Phase 3: commit.
    let mut job = StepJob {
        ticket,
        vocab: shape.vocab_size,
        keep_hidden: shape.mtp,
        hidden_size: shape.hidden_size,
        ..StepJob::default()
    };
    for (i, (seq, input)) in rows.iter_mut().zip(inputs).enumerate() {
        let n = input.len();
        let added: Vec<u32> = (0..needs(seq, n))
            .map(|_| inner.fresh.pop().expect("reserved above"))
            .collect();
        seq.blocks.extend_from_slice(&added);
        if let Some(superseded) = seq.reservation.take().and_then(|r| r.superseded) {
            inner.cache.free_checkpoint_slot(superseded.1);
        }
        let c = seq.computed_len;
        seq.reservation = Some(Reservation {
            at: c,
            blocks: added,
            superseded: None,
        });
        let tenure = seq.tenure.expect("validated");
        let slot = seq.slot.expect("validated");
        let mut rows_snapshots = Vec::new();
        if let Some(slots) = snapshots.get(i) {
            for (j, &ring) in slots.iter().enumerate() {
                inner.ring[ring] = Some(RingEntry {
                    tenure,
                    pos: c + j + 1,
                    main_only: true,
                });
                rows_snapshots.push(shape.ring_row(ring));
            }
            if shape.hybrid {
                rows_snapshots.push(shape.scratch_row(slot));
            } else {
                rows_snapshots.clear();
            }
        }
        let blocks = job.blocks.len()..job.blocks.len() + seq.blocks.len();
        job.blocks.extend_from_slice(&seq.blocks);
        let tokens = job.tokens.len()..job.tokens.len() + n;
        job.tokens.extend_from_slice(input);
        job.runs.push(RunJobRow {
            tokens,
            start: c,
            blocks,
            slot,
            snapshots: rows_snapshots,
            lora: seq
                .lora
                .as_ref()
                .map(|binding| std::sync::Arc::clone(&binding.weights)),
        });
        seq.tokens.extend_from_slice(input);
        seq.computed_len += n;
        // A boundary inside the run passed with the state moving on; one at its end is offered
        // once the core has kept it (`TruncateKv`).
        seq.checkpoint_due = false;
        job.token_rows.push(None);
        job.tenures.push(tenure);
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
    const WHAT: &str = "Draft";
    // Phase 1: validate.
    if tokens.len() != rows.len() {
        return Err(invalid(
            WHAT,
            format!("{} tokens for {} rows", tokens.len(), rows.len()),
        ));
    }
    if k == 0 {
        return Err(invalid(
            WHAT,
            "k is 0; draft at least one token".to_string(),
        ));
    }
    if k > crate::CATCHUP_RING {
        return Err(invalid(
            WHAT,
            format!("k is {k}, at most {} drafts per step", crate::CATCHUP_RING),
        ));
    }
    for (i, (seq, &token)) in rows.iter().zip(tokens).enumerate() {
        check_row(shape, inner, WHAT, i, seq, k)?;
        check_token(shape, WHAT, i, token)?;
    }

    // Which rows draft: those whose ring holds their latest position.
    let drafting: Vec<bool> = rows
        .iter()
        .map(|seq| {
            let c = seq.computed_len;
            c > 0
                && seq.tenure.is_some_and(|tenure| {
                    inner
                        .mtp
                        .get(&tenure)
                        .is_some_and(|track| track.ring.contains_key(&(c - 1)))
                })
        })
        .collect();

    // Phase 2: blocks for the draft positions the sequences do not cover, for this step only.
    let needs = |seq: &CpuSeq| {
        (seq.computed_len + k - 1)
            .div_ceil(shape.block_size)
            .saturating_sub(seq.blocks.len())
    };
    let total: usize = rows
        .iter()
        .zip(&drafting)
        .filter(|(_, &d)| d)
        .map(|(seq, _)| needs(seq))
        .sum();
    reserve_blocks(inner, total)?;
    let temporary: Vec<u32> = inner.fresh.drain(..).collect();
    let mut spare = temporary.iter().copied();

    // Phase 3: commit (the catch-up is for good; the drafts are not).
    let mut job = StepJob {
        ticket,
        vocab: shape.vocab_size,
        hidden_size: shape.hidden_size,
        ..StepJob::default()
    };
    let d = shape.hidden_size;
    let mut draft = DraftJob {
        k,
        ..DraftJob::default()
    };
    for ((seq, &token), &drafts) in rows.iter().zip(tokens).zip(&drafting) {
        let tenure = seq.tenure.expect("validated");
        let slot = seq.slot.expect("validated");
        let c = seq.computed_len;
        let blocks = job.blocks.len()..job.blocks.len() + seq.blocks.len() + needs(seq);
        job.blocks.extend_from_slice(&seq.blocks);
        let mut catchup = None;
        if drafts {
            job.blocks.extend(spare.by_ref().take(needs(seq)));
            let track = inner.mtp.get_mut(&tenure).expect("checked above");
            // The ring's contiguous positions ending at `c - 1`, from the first not consumed.
            let mut start = c - 1;
            while start > track.consumed && track.ring.contains_key(&(start - 1)) {
                start -= 1;
            }
            let rows_start = draft.hidden.len();
            let next = job.tokens.len()..job.tokens.len() + (c - start);
            for pos in start..c {
                let row = track.ring.remove(&pos).expect("contiguous above");
                debug_assert_eq!(row.len(), d);
                draft.hidden.extend_from_slice(&row);
                job.tokens.push(if pos + 1 < c {
                    seq.tokens[pos + 1]
                } else {
                    token
                });
            }
            track.ring.retain(|&pos, _| pos >= c);
            track.consumed = c;
            catchup = Some(Catchup {
                start,
                next,
                rows: rows_start..draft.hidden.len(),
            });
        } else {
            job.blocks.truncate(blocks.start + seq.blocks.len());
        }
        let blocks = if drafts {
            blocks
        } else {
            blocks.start..blocks.start + seq.blocks.len()
        };
        draft.rows.push(DraftJobRow {
            catchup,
            next_pos: c,
            blocks,
            slot,
            scratch: if shape.hybrid {
                shape.scratch_row(slot)
            } else {
                slot
            },
        });
        job.token_rows.push(None);
        job.tenures.push(tenure);
    }
    // Device work runs in submission order: the blocks are free again for work submitted after.
    for block in temporary {
        inner.cache.release(block);
    }
    job.draft = Some(draft);
    Ok((job, None))
}
