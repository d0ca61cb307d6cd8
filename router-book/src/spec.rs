//! The speculative plans' bookkeeping, shared by every router: `Verify` (a row's next token and
//! its drafts as one run of the main model), in the three phases of [`crate::plans`] (validate,
//! reserve, commit), so a refused plan changes nothing and both routers refuse alike.
//!
//! # Verify
//!
//! Row `i` feeds `inputs[i]` at positions `c..c + n` (`c` its `computed_len`): the blocks those
//! positions need are taken and recorded in the row's reservation ledger entry (committing the
//! one before, as `ReserveKv` does), the tokens and the length move to the run's end, and
//! `snapshots[i][j]` becomes a ring entry of this sequence at position `c + j + 1` holding the
//! main model's Mamba layers only (`RingEntry::main_only`): the router writes the state after
//! input `j` there as the run passes. `TruncateKv` and `SsmSnapshotRestore` then keep the
//! accepted positions. The plan reaches no token position in the sense of a decode (no feed
//! cell, `token_rows` all `None`): every position's argmax comes back as the row's run.
//!
//! # Draft
//!
//! A row drafts when its MTP catch-up ring ([`MtpTrack`]) holds position `c - 1` (the main
//! model's hidden state there, kept by a prefill or by `SaveHiddenCatchup`); the head first
//! consumes the ring's contiguous positions up to `c - 1` (the last one with the row's next
//! token), for good; then the router drafts `k` tokens on a scratch copy of the head's state.
//! Blocks the sequence does not hold for the draft positions are lent for the step only. A row
//! whose ring lacks `c - 1` drafts nothing.

use std::ops::Range;

use device_io::{DeviceError, Readback, Result};

use crate::book::{BookMut, BookShape, RingEntry, Tenure};
use crate::plans::{check_row, readback_masks, reserve_blocks, StepBook};
use crate::{Reservation, RouterSeq};

fn invalid(what: &'static str, detail: String) -> DeviceError {
    DeviceError::Invalid { what, detail }
}

/// Refuses a token outside the vocabulary.
pub fn check_token(shape: &BookShape, what: &'static str, i: usize, token: u32) -> Result<()> {
    let vocab_size = shape.layout.vocab_size;
    if token as usize >= vocab_size {
        return Err(invalid(
            what,
            format!("row {i} feeds token id {token}, outside the vocabulary of {vocab_size}"),
        ));
    }
    Ok(())
}

/// One row of a committed `Verify`: its tokens at positions `start..start + tokens.len()`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VerifyRow {
    /// The row's tokens in [`VerifyPlan::tokens`].
    pub tokens: Range<usize>,
    /// The position of its first token.
    pub start: usize,
    /// Its live state slot.
    pub slot: usize,
    /// Its block table in [`StepBook::blocks`] (covering the run's end).
    pub blocks: Range<usize>,
    /// On a hybrid model, when the plan names snapshot slots: the state rows (ring rows) that
    /// receive the main model's Mamba state after each of the row's first `tokens.len() - 1`
    /// inputs; else `None`.
    pub snapshots: Option<Vec<usize>>,
}

/// A committed `Verify`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct VerifyPlan {
    /// Tables and tenures (no masks; no row reaches a decode's token position).
    pub step: StepBook,
    /// Every row's inputs, row after row.
    pub tokens: Vec<u32>,
    /// The rows, in plan order.
    pub rows: Vec<VerifyRow>,
}

/// `Verify`: validates every row (inputs, readback, snapshot slots: distinct, inside the ring,
/// one per draft), reserves the blocks the rows' positions need, then commits (see the module
/// docs). `ArgmaxMasked` is `Unsupported`.
pub fn verify(
    shape: &BookShape,
    book: &mut BookMut<'_>,
    inputs: &[&[u32]],
    snapshots: &[&[usize]],
    readback: &Readback<'_>,
    rows: &mut [&mut RouterSeq],
) -> Result<VerifyPlan> {
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
    readback_masks(shape, WHAT, rows.len(), readback)?;
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
        check_row(shape, book.tenures, WHAT, i, seq, input.len())?;
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
    let needs = |seq: &RouterSeq, n: usize| {
        (seq.computed_len + n)
            .div_ceil(shape.block_size)
            .saturating_sub(seq.blocks.len())
    };
    let total: usize = rows
        .iter()
        .zip(inputs)
        .map(|(seq, input)| needs(seq, input.len()))
        .sum();
    let mut fresh = reserve_blocks(book.cache, total)?;

    // Phase 3: commit.
    let mut plan = VerifyPlan::default();
    for (i, (seq, input)) in rows.iter_mut().zip(inputs).enumerate() {
        let n = input.len();
        let added: Vec<u32> = (0..needs(seq, n))
            .map(|_| fresh.pop().expect("reserved above"))
            .collect();
        seq.blocks.extend_from_slice(&added);
        if let Some(superseded) = seq.reservation.take().and_then(|r| r.superseded) {
            book.cache.free_checkpoint_slot(superseded.1);
        }
        let c = seq.computed_len;
        seq.reservation = Some(Reservation {
            at: c,
            blocks: added,
            superseded: None,
        });
        let tenure = seq.tenure.expect("validated");
        let slot = seq.slot.expect("validated");
        let mut rows_snapshots = None;
        if let Some(slots) = snapshots.get(i) {
            for (j, &ring) in slots.iter().enumerate() {
                book.ring[ring] = Some(RingEntry {
                    tenure,
                    pos: c + j + 1,
                    main_only: true,
                });
            }
            if shape.hybrid {
                rows_snapshots = Some(slots.iter().map(|&ring| shape.ring_row(ring)).collect());
            }
        }
        let blocks = plan.step.blocks.len()..plan.step.blocks.len() + seq.blocks.len();
        plan.step.blocks.extend_from_slice(&seq.blocks);
        let tokens = plan.tokens.len()..plan.tokens.len() + n;
        plan.tokens.extend_from_slice(input);
        plan.rows.push(VerifyRow {
            tokens,
            start: c,
            slot,
            blocks,
            snapshots: rows_snapshots,
        });
        seq.tokens.extend_from_slice(input);
        seq.computed_len += n;
        // A boundary inside the run passed with the state moving on; one at its end is offered
        // once the core has kept it (`TruncateKv`).
        seq.checkpoint_due = false;
        plan.step.token_rows.push(None);
        plan.step.tenures.push(tenure);
    }
    Ok(plan)
}

/// Positions an MTP catch-up ring holds at most (a `Verify` of 4 drafts keeps 5), and so the
/// most drafts a `Draft` step makes per row.
pub const CATCHUP_RING: usize = 16;

/// A sequence's MTP head: the positions it has consumed and the main model's hidden states it
/// has not consumed yet (the catch-up ring), by position; `H` is how the router holds one
/// hidden state (host floats, a device cell).
#[derive(Debug)]
pub struct MtpTrack<H> {
    /// The head's K/V and state cover positions `..consumed`.
    pub consumed: usize,
    /// The head's K/V at every position before `exact` were computed with the sequence's own
    /// next tokens (`exact <= consumed`): no position there was skipped (a gap in the ring) or
    /// served by a prefix hit the head did not rerun.
    pub exact: usize,
    /// Hidden states by position.
    pub ring: std::collections::BTreeMap<usize, H>,
}

impl<H> Default for MtpTrack<H> {
    fn default() -> Self {
        MtpTrack {
            consumed: 0,
            exact: 0,
            ring: std::collections::BTreeMap::new(),
        }
    }
}

impl<H> MtpTrack<H> {
    /// Forgets the ring's positions at and past `len` (dropped by a truncation or rollback);
    /// answers what it dropped.
    pub fn forget_from(&mut self, len: usize) -> Vec<H> {
        let dropped = self.ring.split_off(&len).into_values().collect();
        self.consumed = self.consumed.min(len);
        self.exact = self.exact.min(len);
        dropped
    }

    /// `SaveHiddenCatchup`'s rule: a position the head consumed or the ring holds is not saved
    /// again (`hidden` comes back); else it is kept, and a ring over [`CATCHUP_RING`] forgets its
    /// oldest positions (they come back: the head skips them at its next catch-up).
    pub fn keep(&mut self, pos: usize, hidden: H) -> Vec<H> {
        if pos < self.consumed || self.ring.contains_key(&pos) {
            return vec![hidden];
        }
        self.ring.insert(pos, hidden);
        let mut forgotten = Vec::new();
        while self.ring.len() > CATCHUP_RING {
            if let Some((_, oldest)) = self.ring.pop_first() {
                forgotten.push(oldest);
            }
        }
        forgotten
    }

    /// The head consumed positions `from..to` with the sequence's own next tokens.
    fn consumed_exactly(&mut self, from: usize, to: usize) {
        if self.exact >= from {
            self.exact = self.exact.max(to);
        }
        self.consumed = to.max(from);
    }
}

/// `SaveHiddenCatchup { row, pos }`'s checks, the same on every router. `settled` is the latest
/// step settled; `kept` lists the steps whose hidden states the router kept (a prefill keeps
/// its own): each step's ticket, its rows (per row: tenure, first position, positions, first
/// hidden row) and whatever else the router needs of it. Answers the settled step's extra, the
/// row's tenure (still held) and the hidden row that holds `pos`; refusals are `Invalid`.
pub fn catchup_source<'k, S>(
    tenures: &std::collections::BTreeMap<u64, Tenure>,
    settled: Option<u64>,
    kept: impl IntoIterator<Item = (u64, &'k [(u64, usize, usize, usize)], S)>,
    row: usize,
    pos: usize,
) -> Result<(S, u64, usize)> {
    let invalid = |detail: String| DeviceError::Invalid {
        what: "SaveHiddenCatchup",
        detail,
    };
    let Some(ticket) = settled else {
        return Err(invalid("no step has settled yet".to_string()));
    };
    let found = kept.into_iter().find(|&(step, _, _)| step == ticket);
    let Some((_, rows, step)) = found else {
        return Err(invalid(format!(
            "step {ticket} kept no hidden states (a prefill keeps its own)"
        )));
    };
    let Some(&(tenure, start, len, first_hidden)) = rows.get(row) else {
        return Err(invalid(format!(
            "row {row} is outside step {ticket}'s {} rows",
            rows.len()
        )));
    };
    if pos < start || pos >= start + len {
        return Err(invalid(format!(
            "row {row} of step {ticket} computed positions {start}..{}, not {pos}",
            start + len
        )));
    }
    if !tenures.contains_key(&tenure) {
        return Err(invalid(format!("row {row}'s sequence was released")));
    }
    Ok((step, tenure, first_hidden + pos - start))
}

/// The MTP section of a spill image for `track`, of a sequence of `computed` positions: the
/// head's positions and its ring's rows in `consumed..computed` (`read` reads one hidden state).
pub fn mtp_section<H, E>(
    track: &MtpTrack<H>,
    computed: usize,
    mut read: impl FnMut(&H) -> std::result::Result<Vec<f32>, E>,
) -> std::result::Result<crate::image::MtpSection, E> {
    let consumed = track.consumed.min(computed);
    let mut ring = Vec::new();
    for (&pos, hidden) in track.ring.range(consumed..computed).take(CATCHUP_RING) {
        ring.push((pos, read(hidden)?));
    }
    Ok(crate::image::MtpSection {
        consumed,
        exact: track.exact.min(consumed),
        ring,
    })
}

/// The MTP head of a sequence restored from an image's MTP section: `hold` keeps one hidden
/// state the router's way (`None`: no room; the ring then keeps the newest rows it could, and
/// the head skips the rest at its next catch-up).
pub fn restored_track<H, E>(
    section: crate::image::MtpSection,
    mut hold: impl FnMut(Vec<f32>) -> std::result::Result<Option<H>, E>,
) -> std::result::Result<MtpTrack<H>, E> {
    let mut track = MtpTrack {
        consumed: section.consumed,
        exact: section.exact,
        ring: std::collections::BTreeMap::new(),
    };
    for (pos, row) in section.ring.into_iter().rev() {
        match hold(row)? {
            Some(hidden) => {
                track.ring.insert(pos, hidden);
            }
            None => break,
        }
    }
    Ok(track)
}

/// The MTP head after a prefix hit, and the checkpoints it marks (the rule both routers keep
/// when their [`BookShape::head_rerun`] is set).
///
/// A hit at `L` serves the cached blocks of `0..L`, whose MTP-head K/V at a position `p` were
/// computed from the main model's hidden state at `p` and the caching sequence's token at
/// `p + 1`: right for `p < L - 1`, but at `L - 1` (the caching sequence's token at `L` need not
/// be ours) and at any position the caching head never consumed, they are not what a cold run
/// of this sequence computes. So a router stores, with each checkpoint it takes, the main
/// model's hidden states from the first position its head has not consumed exactly through
/// `L - 1` (a [`crate::HeadMark`]): at the end of a prefill run that is `L - 1` alone
/// ([`prefill_checkpoint_head`]); at a `MarconiCheckpoint`, the catch-up ring's positions from the head's
/// ([`checkpoint_head`]). A hit on a marked checkpoint ([`crate::plans::HeadLead`]) copies the
/// hit's blocks that hold those positions (never writing a block another sequence shares) and
/// reruns the head there with this sequence's tokens before its first prefill run, so its
/// K/V at `0..L` and its drafts are a cold run's. A hit on an unmarked checkpoint leaves the
/// head as the cache served it (drafts may differ from a cold run's; the output never does).
/// A mark vouches for the marking sequence's own blocks, but the tree serves `0..from` with the
/// blocks it adopted first: another sequence's, or the originals of blocks the marking sequence
/// copied for its own rerun, whose head K/V at a block's last position were computed with their
/// writer's next token, and at positions a writer's head never consumed, not at all. So the
/// cache records with every block it adopts what its writer's head vouches for (its exact
/// positions and the token after the block, [`crate::HeadOffer`]), and a hit checks the blocks
/// it is served ([`crate::Caches::head_vouched`], [`crate::plans::HeadLead::vouched`]): the
/// rerun runs either way, but only when every cached position before `from` is vouched for is
/// the head a cold run's (counted in `CacheStats::head_exact_hits`; otherwise in
/// `head_unvouched_hits`, and the sequence's head counts as inexact from the first position not
/// vouched for, so it marks none of its own checkpoints).
/// A head with Mamba layers ([`BookShape::head_lags`]) keeps its state in the checkpoint too,
/// so at a prefill checkpoint it lags: the run ending at `L` consumes through `L - 2`, the
/// checkpoint holds the head's state before `L - 1`, and the row's next run leads with `L - 1`
/// (`lag`, an `own` [`crate::plans::HeadLead`]); a rerun at a hit then consumes `L - 1` once.
/// At a `MarconiCheckpoint` the head's state is already before the ring's first position.
///
/// What a prefill run of positions `start..stop` of `seq` asks of the MTP head: it consumes
/// `from..known`, `from` being the rerun's first position after a hit on a marked checkpoint
/// (`lead`) and else `start`, and `known` one past the last position whose next token the
/// prompt holds (the run's last position, when it ends the prompt, is the one the ring keeps:
/// its next token is not known yet), or `stop - 1` when the run `lag`s.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeadRun {
    /// The first position the head consumes.
    pub from: usize,
    /// One past the last.
    pub known: usize,
}

/// The MTP head's part of a prefill run of positions `start..stop` of `seq` (see [`HeadRun`]).
pub fn prefill_head<H>(
    track: &mut MtpTrack<H>,
    seq: &RouterSeq,
    (start, stop): (usize, usize),
    lead: Option<crate::plans::HeadLead>,
    lag: bool,
) -> HeadRun {
    let from = match lead {
        // The row's own lagged position: the head consumed through `lead.from - 1`.
        Some(lead) if lead.own => lead.from,
        Some(lead) => {
            // The cached K/V before `lead.from` are exact for this sequence as far as their
            // writers vouch for them (`HeadLead::vouched`); past that the head is not a cold
            // run's, so this sequence marks none of its checkpoints.
            track.consumed = lead.from;
            track.exact = lead.vouched.min(lead.from);
            lead.from
        }
        None => start,
    };
    let known = if lag {
        stop - 1
    } else {
        stop.min(seq.prompt_len.saturating_sub(1))
    };
    track.consumed_exactly(from, known);
    HeadRun { from, known }
}

/// A prefill run of `seq` ending at `stop` took checkpoint `slot` there: when the head is exact
/// through `stop - 1`, marks it and answers whether the router stores the main model's hidden
/// state at `stop - 1` with it (for the rerun at a hit). `consumed_past`: the head has Mamba
/// layers and did not lag here (the row's prefill plan ends at `stop`), so it consumed `stop - 1`
/// already with the sequence's token at `stop`: the mark names that token instead of a rerun
/// ([`crate::HeadMark::next`]) and needs no hidden state.
pub fn prefill_checkpoint_head<H>(
    track: &MtpTrack<H>,
    cache: &mut crate::Caches,
    slot: crate::CheckpointSlot,
    seq: &RouterSeq,
    stop: usize,
    consumed_past: bool,
) -> bool {
    if consumed_past {
        let next = seq
            .tokens
            .get(stop)
            .copied()
            .filter(|&token| token != crate::book::FED_PLACEHOLDER);
        if let (true, Some(next)) = (stop > 0 && track.exact >= stop, next) {
            cache.mark_head(
                slot,
                crate::HeadMark {
                    pos: stop,
                    from: stop,
                    next: Some(next),
                },
            );
        }
        return false;
    }
    if stop == 0 || track.exact < stop - 1 {
        return false;
    }
    cache.mark_head(
        slot,
        crate::HeadMark {
            pos: stop,
            from: stop - 1,
            next: None,
        },
    );
    true
}

/// What a router does for the MTP head in a prefill run of positions `start..stop` of `seq`
/// ([`PrefillRun`](crate::plans::PrefillRun)'s `lead`, `stash` and `lag`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeadPrefill {
    /// The positions the head consumes ([`prefill_head`]).
    pub run: HeadRun,
    /// The checkpoint the run took at `stop` with which the router stores the main model's hidden
    /// state at `stop - 1`: one the head marked ([`prefill_checkpoint_head`]), or any when the
    /// run lags (the row's next run leads from it even where the head does not mark it).
    pub stash: Option<crate::CheckpointSlot>,
    /// The rerun the run leads with: a hit's mark before `start` (a mark with `from == start`
    /// needs no rerun and leads with nothing).
    pub rerun: Option<crate::plans::HeadLead>,
}

/// The MTP head's part of `run` (positions `start..stop` of `seq`, see [`HeadRun`]), its
/// checkpoint `stash` marked when the head is exact (see [`prefill_checkpoint_head`];
/// `head_lags`: [`crate::BookShape::head_lags`]), and the rerun it leads with: one rule for
/// every router.
pub fn prefill_head_plan<H>(
    track: &mut MtpTrack<H>,
    cache: &mut crate::Caches,
    seq: &RouterSeq,
    run: &crate::plans::PrefillRun,
    head_lags: bool,
) -> HeadPrefill {
    let crate::plans::PrefillRun {
        start,
        stop,
        lead,
        stash,
        lag,
        ..
    } = *run;
    let run = prefill_head(track, seq, (start, stop), lead, lag);
    let consumed_past = head_lags && !lag;
    let stash = stash.filter(|&slot| {
        prefill_checkpoint_head(track, cache, slot, seq, stop, consumed_past) || lag
    });
    HeadPrefill {
        run,
        stash,
        rerun: lead.filter(|lead| lead.from < start),
    }
}

/// `MarconiCheckpoint` on a router that reruns the head: when the sequence of `tenure` (its
/// head in `tracks`, if it has one) just took a checkpoint at `pos` (`slot`) and its head is
/// exact through the positions it consumed, whose next ones through `pos - 1` its ring holds (at
/// most [`CATCHUP_RING`]), marks the checkpoint and answers those positions' hidden states for
/// the router to store with it.
pub fn checkpoint_head<'t, H>(
    tracks: &'t std::collections::BTreeMap<u64, MtpTrack<H>>,
    tenure: Option<u64>,
    cache: &mut crate::Caches,
    slot: crate::CheckpointSlot,
    pos: usize,
) -> Option<Vec<&'t H>> {
    let track = tracks.get(&tenure?)?;
    let from = track.consumed;
    if from >= pos || track.exact < from {
        return None;
    }
    let rows: Vec<&H> = (from..pos).map_while(|p| track.ring.get(&p)).collect();
    if rows.len() != pos - from {
        return None;
    }
    cache.mark_head(
        slot,
        crate::HeadMark {
            pos,
            from,
            next: None,
        },
    );
    Some(rows)
}

/// A drafting row's catch-up: the head consumes positions `start..start + hidden.len()`, the
/// last of them the sequence's latest, fed the token after each (`tokens`, the last the row's
/// next token).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Catchup<H> {
    /// The first position consumed.
    pub start: usize,
    /// The token after each position.
    pub tokens: Vec<u32>,
    /// The main model's hidden state at each position, taken out of the ring.
    pub hidden: Vec<H>,
}

/// One row of a committed `Draft`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DraftRow<H> {
    /// The catch-up, when the row drafts (its ring held its latest position); `None`: it drafts
    /// nothing.
    pub catchup: Option<Catchup<H>>,
    /// The position of the row's next token (its `computed_len`).
    pub next_pos: usize,
    /// Its block table in [`StepBook::blocks`], with blocks lent for the draft positions.
    pub blocks: Range<usize>,
    /// Its live state slot.
    pub slot: usize,
}

/// A committed `Draft`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DraftPlan<H> {
    /// Tables and tenures (no row reaches a token position).
    pub step: StepBook,
    /// The rows, in plan order.
    pub rows: Vec<DraftRow<H>>,
    /// Blocks lent to the draft positions the sequences do not cover: the router gives them
    /// back (`Caches::release`) once the step's device work is queued, since device work runs
    /// in order and nothing later sees them before the step finished.
    pub lent: Vec<u32>,
    /// Hidden states the rings forgot (positions behind a gap, which the head now skips).
    pub dropped: Vec<H>,
}

/// `Draft`: validates every row (tokens, `k` in `1..=CATCHUP_RING`), picks the rows whose ring
/// holds their latest position, lends blocks for their draft positions, then takes each
/// drafting row's catch-up out of its ring for good (see `device-cpu`'s `spec` module docs).
pub fn draft<H>(
    shape: &BookShape,
    book: &mut BookMut<'_>,
    tracks: &mut std::collections::BTreeMap<u64, MtpTrack<H>>,
    tokens: &[u32],
    k: usize,
    rows: &mut [&mut RouterSeq],
) -> Result<DraftPlan<H>> {
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
    if k > CATCHUP_RING {
        return Err(invalid(
            WHAT,
            format!("k is {k}, at most {CATCHUP_RING} drafts per step"),
        ));
    }
    for (i, (seq, &token)) in rows.iter().zip(tokens).enumerate() {
        check_row(shape, book.tenures, WHAT, i, seq, k)?;
        check_token(shape, WHAT, i, token)?;
    }

    // Which rows draft: those whose ring holds their latest position.
    let drafting: Vec<bool> = rows
        .iter()
        .map(|seq| {
            let c = seq.computed_len;
            c > 0
                && seq.tenure.is_some_and(|tenure| {
                    tracks
                        .get(&tenure)
                        .is_some_and(|track| track.ring.contains_key(&(c - 1)))
                })
        })
        .collect();

    // Phase 2: blocks for the draft positions the sequences do not cover, for this step only.
    let needs = |seq: &RouterSeq| {
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
    let lent = reserve_blocks(book.cache, total)?;
    let mut spare = lent.iter().copied();

    // Phase 3: commit (the catch-up is for good; the drafts are not).
    let mut plan = DraftPlan {
        step: StepBook::default(),
        rows: Vec::with_capacity(rows.len()),
        lent: Vec::new(),
        dropped: Vec::new(),
    };
    for ((seq, &token), &drafts) in rows.iter().zip(tokens).zip(&drafting) {
        let tenure = seq.tenure.expect("validated");
        let slot = seq.slot.expect("validated");
        let c = seq.computed_len;
        let start_block = plan.step.blocks.len();
        plan.step.blocks.extend_from_slice(&seq.blocks);
        let mut catchup = None;
        if drafts {
            plan.step.blocks.extend(spare.by_ref().take(needs(seq)));
            let track = tracks.get_mut(&tenure).expect("checked above");
            // The ring's contiguous positions ending at `c - 1`, from the first not consumed.
            let mut start = c - 1;
            while start > track.consumed && track.ring.contains_key(&(start - 1)) {
                start -= 1;
            }
            let mut next = Vec::with_capacity(c - start);
            let mut hidden = Vec::with_capacity(c - start);
            for pos in start..c {
                hidden.push(track.ring.remove(&pos).expect("contiguous above"));
                next.push(if pos + 1 < c {
                    seq.tokens[pos + 1]
                } else {
                    token
                });
            }
            // Positions before `start` (a gap in the ring) are behind the head now: forgotten.
            let newer = track.ring.split_off(&c);
            plan.dropped
                .extend(std::mem::replace(&mut track.ring, newer).into_values());
            // After a gap the head's K/V there stay what they were: not exact from then on.
            track.consumed_exactly(start, c);
            catchup = Some(Catchup {
                start,
                tokens: next,
                hidden,
            });
        }
        plan.rows.push(DraftRow {
            catchup,
            next_pos: c,
            blocks: start_block..plan.step.blocks.len(),
            slot,
        });
        plan.step.token_rows.push(None);
        plan.step.tenures.push(tenure);
    }
    plan.lent = lent;
    Ok(plan)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `catchup_source`'s answer (the step, the tenure, the hidden row), or its refusal's detail.
    fn catchup(
        settled: Option<u64>,
        row: usize,
        pos: usize,
    ) -> std::result::Result<(u64, u64, usize), String> {
        let mut tenures = std::collections::BTreeMap::new();
        tenures.insert(
            11,
            Tenure {
                seq_id: 1,
                adapter: None,
            },
        );
        // Step 5 kept two rows: tenure 11 at positions 7..10 (hidden rows 0..3) and the
        // released tenure 12 at position 4 (hidden row 3); step 3 kept one, tenure 11 at
        // position 2 (hidden row 0); step 4 kept none.
        let rows_5 = [(11, 7, 3, 0), (12, 4, 1, 3)];
        let rows_3 = [(11, 2, 1, 0)];
        let kept = [(5, &rows_5[..], 5), (3, &rows_3[..], 3)];
        match catchup_source(&tenures, settled, kept, row, pos) {
            Ok((step, tenure, hidden)) => Ok((step, tenure, hidden)),
            Err(DeviceError::Invalid {
                what: "SaveHiddenCatchup",
                detail,
            }) => Err(detail),
            Err(other) => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_catchup_source_is_a_kept_position_of_a_held_sequence() {
        assert_eq!(catchup(Some(5), 0, 7), Ok((5, 11, 0)));
        assert_eq!(catchup(Some(5), 0, 9), Ok((5, 11, 2)));
        assert_eq!(catchup(Some(3), 0, 2), Ok((3, 11, 0)));
        let refused = |settled: Option<u64>, row: usize, pos: usize, detail: &str| {
            let answer = catchup(settled, row, pos);
            assert_eq!(answer, Err(detail.to_string()), "{settled:?} {row} {pos}");
        };
        refused(None, 0, 7, "no step has settled yet");
        refused(
            Some(4),
            0,
            7,
            "step 4 kept no hidden states (a prefill keeps its own)",
        );
        refused(Some(5), 2, 7, "row 2 is outside step 5's 2 rows");
        refused(
            Some(5),
            0,
            6,
            "row 0 of step 5 computed positions 7..10, not 6",
        );
        refused(
            Some(5),
            0,
            10,
            "row 0 of step 5 computed positions 7..10, not 10",
        );
        refused(Some(5), 1, 4, "row 1's sequence was released");
        refused(Some(3), 1, 2, "row 1 is outside step 3's 1 rows");
    }
}
