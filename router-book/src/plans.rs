//! The plans' bookkeeping, shared by every router: `Prefill` (the prefix cache's attach on a
//! row's first chunk, a Marconi checkpoint restored through a prefix hit, chunking at the
//! checkpoint splits, block reservation, the checkpoints taken at the splits) and `Decode` /
//! `DecodeFed` (the block of each row's new position, the fed inputs and their pending
//! positions), and the row checks of every decode-like plan ([`check_row`]).
//!
//! Each plan works in three phases, so that a refused step changes nothing:
//! 1. **validate** every row (no state touched);
//! 2. **reserve** what the step needs (slots, the cache lookups that take references, blocks); on
//!    a dry pool every reservation is undone and the step answers `KvExhausted`;
//! 3. **commit**: the bookkeeping moves to the step's end (lengths, tokens, blocks, checkpoint
//!    slots taken) and the device work is listed in order ([`PrefillOp`], [`DecodeRow`]) for the
//!    router to run after everything it queued before. Only a device error there (which
//!    validation rules out for well-formed input) fails the step; the router then marks its
//!    rows failed.
//!
//! A fed row's input token is not known to the host at launch: the row's `tokens` hold
//! [`FED_PLACEHOLDER`] at that position, and the router records where the token will come from
//! ([`PendingFeed`]) until the step finishes.

use std::ops::Range;

use device_io::{DeviceError, Feed, PrefillReport, Readback, Result, Ticket};

use crate::book::{self, BookMut, BookShape, PendingFeed, Tenure, FED_PLACEHOLDER};
use crate::{Attach, Caches, CheckpointSlot, LoraBinding, Namespace, RouterSeq};

fn invalid(what: &'static str, detail: String) -> DeviceError {
    DeviceError::Invalid { what, detail }
}

/// How a router binds a sequence's adapter id (`None`: no adapter) to its loaded weights, or
/// says why it cannot.
pub type BindAdapter<'a> =
    &'a mut dyn FnMut(Option<u32>) -> std::result::Result<Option<LoraBinding>, String>;

/// The masks of an `ArgmaxMasked` readback, checked (one per row, each `vocab_size` long with an
/// allowed token) and flattened; empty for the other readbacks.
pub fn readback_masks(
    shape: &BookShape,
    what: &'static str,
    rows: usize,
    readback: &Readback<'_>,
) -> Result<Vec<bool>> {
    match readback {
        Readback::Argmax | Readback::HostLogits { .. } => Ok(Vec::new()),
        Readback::ArgmaxMasked { masks } => flatten_masks(shape, what, rows, masks),
    }
}

/// Checks one mask per row, each `vocab_size` long with an allowed token, and flattens them.
pub fn flatten_masks(
    shape: &BookShape,
    what: &'static str,
    rows: usize,
    masks: &[&[bool]],
) -> Result<Vec<bool>> {
    let vocab_size = shape.layout.vocab_size;
    if masks.len() != rows {
        return Err(invalid(
            what,
            format!("{} masks for {rows} rows", masks.len()),
        ));
    }
    let mut flat = Vec::with_capacity(rows * vocab_size);
    for (i, mask) in masks.iter().enumerate() {
        if mask.len() != vocab_size {
            return Err(invalid(
                what,
                format!(
                    "mask {i} has {} entries, the vocabulary {vocab_size}",
                    mask.len(),
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

/// Takes `count` blocks, evicting cached ones if the free list runs dry; on failure gives back
/// what it took and answers the typed error.
pub fn reserve_blocks(cache: &mut Caches, count: usize) -> Result<Vec<u32>> {
    let available = cache.free_blocks() + cache.evictable_blocks();
    let mut fresh = Vec::with_capacity(count);
    for _ in 0..count {
        match cache.allocate() {
            Some(block) => fresh.push(block),
            None => {
                for block in fresh.drain(..) {
                    cache.release(block);
                }
                return Err(DeviceError::KvExhausted {
                    needed: count,
                    free: available,
                });
            }
        }
    }
    Ok(fresh)
}

/// What every plan hands its router besides its device work.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StepBook {
    /// `ArgmaxMasked`: one mask of `vocab_size` per row, flattened; else empty.
    pub masks: Vec<bool>,
    /// The rows' block tables, concatenated (the ops' `blocks` ranges index it).
    pub blocks: Vec<u32>,
    /// Per row: its index among the rows that reach a token position, if it reaches one.
    pub token_rows: Vec<Option<usize>>,
    /// Per row: its tenure.
    pub tenures: Vec<u64>,
}

/// One piece of a prefill's device work, in the order the router runs them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PrefillOp {
    /// Zero live state row `slot` (a new row starts from nothing).
    ZeroSlot(usize),
    /// Copy state row `from` to state row `to` (a checkpoint restored through a prefix hit, or
    /// taken at a split).
    CopyRow {
        /// The source row.
        from: usize,
        /// The target row.
        to: usize,
    },
    /// Copy KV block `from` (a cached block of a prefix hit) to the sequence's fresh block `to`,
    /// which replaces it in the sequence's table: the MTP head's rerun writes positions there
    /// ([`HeadLead`]), and a block another sequence shares is never written.
    CopyBlock {
        /// The cached block.
        from: u32,
        /// The sequence's copy.
        to: u32,
    },
    /// Compute a run of positions of one row.
    Run(PrefillRun),
}

/// Positions `start..stop` of plan row `row` (its tokens `tokens[start..stop]`), and what the
/// MTP head does with them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrefillRun {
    /// The plan row.
    pub row: usize,
    /// The first position.
    pub start: usize,
    /// One past the last position.
    pub stop: usize,
    /// The row's live state slot.
    pub slot: usize,
    /// The row's block table in [`StepBook::blocks`].
    pub blocks: Range<usize>,
    /// The run ends the prompt: its last position's logits are the row's.
    pub emit: bool,
    /// The MTP head's rerun before the run's own positions, after a hit on a marked
    /// checkpoint (only when [`BookShape::head_rerun`]).
    pub lead: Option<HeadLead>,
    /// The checkpoint taken at `stop`, for the router to store the main model's hidden
    /// state at `stop - 1` with (`crate::spec::prefill_checkpoint_head` decides, and marks
    /// it; only when [`BookShape::head_rerun`]). For a head with Mamba layers that does not
    /// `lag` here (the row's plan ends at `stop`), the mark needs no hidden state.
    pub stash: Option<CheckpointSlot>,
    /// The MTP head consumes no further than `stop - 2` ([`BookShape::head_lags`]: the
    /// checkpoint at `stop` then holds the head's state before `stop - 1`); the row's next
    /// run, in the same plan, leads with `stop - 1` from the hidden state stored with
    /// `stash`, which the router stores whether or not the head marks the checkpoint.
    pub lag: bool,
}

/// A prefix hit's MTP-head rerun (see `crate::spec`'s [`HeadRun`](crate::spec::HeadRun)): the
/// head consumes positions `from..` (the hit's length) again, from the main model's hidden
/// states stored with checkpoint `checkpoint`, before the first run's own positions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeadLead {
    /// The checkpoint the hit restored (or the row's own, for a lag).
    pub checkpoint: CheckpointSlot,
    /// The rerun's first position.
    pub from: usize,
    /// The row's own lagged position (`PrefillRun::lag`), not a hit: the head's K/V and
    /// state are the row's own through `from`.
    pub own: bool,
    /// After a hit: the positions `0..vouched` hold head K/V that are right for this sequence
    /// ([`Caches::head_vouched`]); when that falls short of `from` the rerun still runs, but
    /// the head is not a cold run's.
    pub vouched: usize,
}

/// A committed prefill.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PrefillPlan {
    /// Masks, tables, token rows, tenures.
    pub step: StepBook,
    /// The device work, in order.
    pub ops: Vec<PrefillOp>,
    /// Per row: how its prompt advanced.
    pub reports: Vec<PrefillReport>,
}

/// The first chunk of a new row: where it starts (after the cached prefix), what it attached,
/// and the adapter it binds.
struct NewRow {
    slot: usize,
    attach: Attach,
    lora: Option<LoraBinding>,
    /// The MTP head's rerun, and the hit's blocks (by index) it rewrites; or how a hit without
    /// one counts.
    lead: Result<(HeadLead, Range<usize>), crate::HeadHit>,
}

/// The MTP head's rerun after a hit (`attach`, for a sequence of `tokens`) on a checkpoint the
/// router marked, with the indexes of the hit's blocks holding the rerun's positions; or, with
/// no rerun, how the hit counts: `Unmarked`, or `Skipped` where the pool cannot hold the copies.
fn head_lead(
    shape: &BookShape,
    cache: &Caches,
    attach: &Attach,
    tokens: &[u32],
) -> Result<(HeadLead, Range<usize>), crate::HeadHit> {
    let unmarked = crate::HeadHit::Unmarked;
    let checkpoint = attach
        .checkpoint
        .filter(|_| shape.head_rerun)
        .ok_or(unmarked)?;
    let mark = cache.head_mark(checkpoint).ok_or(unmarked)?;
    if mark.pos != attach.len || mark.from > mark.pos || mark.pos == 0 {
        return Err(unmarked);
    }
    // A mark with `from == pos` reruns nothing (an empty range of blocks to copy); its head
    // consumed `pos - 1` with its own token at `pos`, which must be this sequence's.
    let mut vouched = cache.head_vouched(&attach.blocks, tokens, mark.from);
    if mark.next.is_some() && tokens.get(mark.pos) != mark.next.as_ref() {
        vouched = vouched.min(mark.pos - 1);
    }
    let blocks = mark.from / shape.block_size..(mark.pos - 1) / shape.block_size + 1;
    let blocks = blocks.start.min(blocks.end)..blocks.end;
    // The originals of the copied blocks stay held while the hit path is pinned (the
    // sequence's lifetime), so the copies cost the sequence blocks that a run from scratch
    // never needs. A hit must never need more of the pool than no hit: where a sequence of
    // `max_context` tokens and the copies do not fit the pool together, the head skips the
    // rerun and takes the hit as it is served (its drafts may differ from a cold run's; the
    // output never does).
    if blocks.end > attach.blocks.len() {
        return Err(unmarked);
    }
    if shape.max_context.div_ceil(shape.block_size) + blocks.len() > cache.num_blocks() {
        return Err(crate::HeadHit::Skipped);
    }
    let lead = HeadLead {
        checkpoint,
        from: mark.from,
        own: false,
        vouched,
    };
    Ok((lead, blocks))
}

/// `Prefill`: validates every row, reserves slots, cached prefixes and blocks, then commits the
/// rows' bookkeeping and lists the device work. `bind` binds a new row's adapter.
pub fn prefill(
    shape: &BookShape,
    book: &mut BookMut<'_>,
    budgets: &[usize],
    readback: &Readback<'_>,
    rows: &mut [&mut RouterSeq],
    bind: BindAdapter<'_>,
) -> Result<PrefillPlan> {
    let vocab_size = shape.layout.vocab_size;
    // Phase 1: validate.
    if budgets.len() != rows.len() {
        return Err(invalid(
            "Prefill",
            format!("{} budgets for {} rows", budgets.len(), rows.len()),
        ));
    }
    let masks = readback_masks(shape, "Prefill", rows.len(), readback)?;
    for (i, (seq, &budget)) in rows.iter().zip(budgets).enumerate() {
        let id = seq.id;
        book::check_tenure(book.tenures, seq, "Prefill")?;
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
            if let Err(reason) = bind(seq.namespace.adapter) {
                return Err(invalid(
                    "Prefill",
                    format!(
                        "row {i} (sequence {id}) names an adapter that cannot be used: {reason}"
                    ),
                ));
            }
            if let Some(&bad) = seq.tokens.iter().find(|&&t| t as usize >= vocab_size) {
                return Err(invalid(
                    "Prefill",
                    format!(
                        "row {i} (sequence {id}) has token id {bad}, outside the vocabulary of \
                         {vocab_size}"
                    ),
                ));
            }
        }
    }

    // Phase 2: reserve slots, cached prefixes and blocks.
    let new_count = rows.iter().filter(|s| s.tenure.is_none()).count();
    let free_slots: Vec<usize> = (0..shape.max_seqs)
        .filter(|&i| book.slots[i].is_none())
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
            // The last prompt token must be computed (its logits are needed, and Mamba state
            // cannot step back), so only the prompt without it is looked up.
            let lookup = &seq.tokens[..seq.prompt_len - 1];
            let lora = match bind(seq.namespace.adapter) {
                Ok(lora) => lora,
                Err(reason) => {
                    for new_row in new_rows.into_iter().flatten() {
                        book.cache.undo_attach(new_row.attach);
                    }
                    return Err(invalid("Prefill", reason));
                }
            };
            let namespace = Namespace {
                adapter: lora.as_ref().map(|binding| binding.serial),
                cache_salt: seq.namespace.cache_salt,
            };
            let attach = book.cache.lookup(namespace, lookup);
            let slot = next_free.next().expect("counted above");
            let lead = head_lead(shape, book.cache, &attach, &seq.tokens);
            // The blocks the head's rerun rewrites are copied: one more block each.
            let copies = lead.as_ref().map_or(0, |(_, blocks)| blocks.len());
            (
                attach.len,
                attach.blocks.len() - copies,
                Some(NewRow {
                    slot,
                    attach,
                    lora,
                    lead,
                }),
            )
        } else {
            (seq.computed_len, seq.blocks.len(), None)
        };
        let end = (start + budget).min(seq.prompt_len);
        needs.push(end.div_ceil(shape.block_size).saturating_sub(held));
        new_rows.push(new_row);
    }
    let total_needed: usize = needs.iter().sum();
    let mut fresh = match reserve_blocks(book.cache, total_needed) {
        Ok(fresh) => fresh,
        Err(err) => {
            for new_row in new_rows.into_iter().flatten() {
                book.cache.undo_attach(new_row.attach);
            }
            return Err(err);
        }
    };

    // Phase 3: commit.
    let mut plan = PrefillPlan {
        step: StepBook {
            masks,
            ..StepBook::default()
        },
        ..PrefillPlan::default()
    };
    let mut token_rows = 0;
    for (i, new_row) in new_rows.into_iter().enumerate() {
        let seq = &mut *rows[i];
        let mut report = PrefillReport::default();
        let mut lead = None;
        if let Some(NewRow {
            slot,
            attach,
            lora,
            lead: head,
        }) = new_row
        {
            let adapter = seq.namespace.adapter;
            book::seat(book, seq, slot, adapter, lora);
            seq.computed_len = attach.len;
            seq.blocks = attach.blocks;
            seq.pin = attach.pin;
            seq.branch_point = attach.branch_point;
            report.cached = attach.len;
            plan.ops.push(PrefillOp::ZeroSlot(slot));
            if let Some(checkpoint) = attach.checkpoint {
                plan.ops.push(PrefillOp::CopyRow {
                    from: shape.checkpoint_row(checkpoint.index()),
                    to: slot,
                });
                if shape.head_rerun {
                    book.cache.count_head_hit(match &head {
                        Ok((lead, _)) if lead.vouched >= lead.from => crate::HeadHit::Exact,
                        Ok(_) => crate::HeadHit::Unvouched,
                        Err(hit) => *hit,
                    });
                }
            }
            if let Ok((head, copied)) = head {
                for index in copied {
                    let to = fresh.pop().expect("reserved above");
                    let from = std::mem::replace(&mut seq.blocks[index], to);
                    plan.ops.push(PrefillOp::CopyBlock { from, to });
                    // Device work runs in order: the copy reads it before anything later
                    // could reuse it.
                    book.cache.release(from);
                    needs[i] -= 1;
                }
                lead = Some(head);
            }
        }
        let from = fresh.len() - needs[i];
        seq.blocks.extend(fresh.drain(from..));
        let slot = seq.slot.expect("validated or assigned above");
        let start = seq.computed_len;
        let end = (start + budgets[i]).min(seq.prompt_len);
        let blocks = plan.step.blocks.len()..plan.step.blocks.len() + seq.blocks.len();
        plan.step.blocks.extend_from_slice(&seq.blocks);
        // Where the computation stops to take a checkpoint: the tree's branch point, and the
        // end-of-input checkpoint: the last block boundary before the prompt's last token, which
        // is the longest hit both a repeat of this prompt and a longer request can use (a hit
        // must leave the last prompt token to compute).
        let input_boundary = (book.cache.wants_end_checkpoints() && seq.input_checkpoint.is_none())
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
            let run = plan.ops.len();
            plan.ops.push(PrefillOp::Run(PrefillRun {
                row: i,
                start: pos,
                stop,
                slot,
                blocks: blocks.clone(),
                emit: stop == seq.prompt_len,
                lead: lead.take(),
                stash: None,
                lag: false,
            }));
            pos = stop;
            seq.computed_len = pos;
            let mut taken = None;
            if seq.branch_point == Some(pos) {
                seq.branch_point = None;
                taken = take_branch_checkpoint(shape, book, seq, &mut plan.ops);
            } else if input_boundary == Some(pos) {
                if let Some(checkpoint) = take_checkpoint(shape, book, seq, &mut plan.ops) {
                    seq.input_checkpoint = Some((pos, checkpoint));
                    taken = Some(checkpoint);
                }
            }
            let taken = taken.filter(|_| shape.head_rerun);
            // A head with Mamba layers lags one position at a checkpoint it may mark, when the
            // row continues in this plan; where the plan ends there, its mark names the token
            // after the checkpoint instead of a rerun (see `BookShape::head_lags`).
            let lags = shape.head_lags && taken.is_some() && pos < end;
            if let PrefillOp::Run(PrefillRun {
                stash, lag, stop, ..
            }) = &mut plan.ops[run]
            {
                *stash = taken;
                *lag = lags;
                if let (true, Some(checkpoint)) = (lags, taken) {
                    lead = Some(HeadLead {
                        checkpoint,
                        from: *stop - 1,
                        own: true,
                        vouched: *stop - 1,
                    });
                }
            }
        }
        report.computed = end - start;
        report.done = end == seq.prompt_len;
        if report.done {
            plan.step.token_rows.push(Some(token_rows));
            token_rows += 1;
        } else {
            plan.step.token_rows.push(None);
        }
        plan.reports.push(report);
    }
    plan.step.tenures = rows
        .iter()
        .map(|seq| seq.tenure.unwrap_or_default())
        .collect();
    Ok(plan)
}

/// Takes a checkpoint slot for the live state at the tree's branch point, to be registered once
/// this step settled without failing the row (`RouterSeq::branch_taken`, [`book::sync`]);
/// answers it when taken.
fn take_branch_checkpoint(
    shape: &BookShape,
    book: &mut BookMut<'_>,
    seq: &mut RouterSeq,
    ops: &mut Vec<PrefillOp>,
) -> Option<CheckpointSlot> {
    let pos = seq.computed_len;
    let checkpoint = take_checkpoint(shape, book, seq, ops)?;
    match &seq.pin {
        Some(_) => {
            seq.branch_taken = Some((book.step, pos, checkpoint));
            Some(checkpoint)
        }
        None => {
            book.cache.free_checkpoint_slot(checkpoint);
            None
        }
    }
}

/// Takes a fresh checkpoint slot (evicting cached checkpoints if needed) and lists the copy of
/// the live state into it; `None` when the region is held entirely by running sequences (the
/// checkpoint is skipped: it is an optimisation, never needed for correctness).
fn take_checkpoint(
    shape: &BookShape,
    book: &mut BookMut<'_>,
    seq: &RouterSeq,
    ops: &mut Vec<PrefillOp>,
) -> Option<CheckpointSlot> {
    let (checkpoint, from, to) = book::take_checkpoint(shape, book, seq)?;
    ops.push(PrefillOp::CopyRow { from, to });
    Some(checkpoint)
}

/// A decode's inputs: host tokens (`Decode`) or per-row sources (`DecodeFed`).
#[derive(Debug, Clone, Copy)]
pub enum Inputs<'a> {
    /// One host token per row.
    Tokens(&'a [u32]),
    /// One source per row.
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

/// Where a decode row's input token comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Input {
    /// A token the host knows.
    Token(u32),
    /// The argmax of this row of the previous step (its feed cell).
    Feed(usize),
}

/// One row of a committed decode.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecodeRow {
    /// Its input.
    pub input: Input,
    /// The position it computes.
    pub pos: usize,
    /// Its block table in [`StepBook::blocks`].
    pub blocks: Range<usize>,
    /// Its live state slot.
    pub slot: usize,
}

/// A committed decode.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecodePlan {
    /// Masks, tables, token rows, tenures.
    pub step: StepBook,
    /// One per plan row.
    pub rows: Vec<DecodeRow>,
    /// The step a fed row reads its feed cell from (the one launched before), if any row is fed.
    pub fed_from: Option<u64>,
}

/// What the router knows of the steps before this one, for the fed inputs.
#[derive(Debug, Clone, Copy)]
pub struct FeedSources<'a> {
    /// Per row of the latest launched step: its tenure, and whether it reached a token position.
    pub last_rows: &'a [(u64, bool)],
    /// The argmax of each row of the latest step the device finished, with its ticket.
    pub last_argmax: Option<(u64, &'a [Option<u32>])>,
}

impl<'a> FeedSources<'a> {
    /// The sources as a router keeps them: the latest launched step's rows, and the latest
    /// finished step's ticket and per-row argmax.
    pub fn new(
        last_rows: &'a [(u64, bool)],
        last_argmax: &'a Option<(u64, Vec<Option<u32>>)>,
    ) -> Self {
        FeedSources {
            last_rows,
            last_argmax: last_argmax
                .as_ref()
                .map(|(step, argmax)| (*step, &argmax[..])),
        }
    }
}

/// `Decode` and `DecodeFed` (step `ticket`): validates every row and input, reserves the block
/// each row's new position needs, then commits the rows (one more position each; a fed
/// position's token is the placeholder until its source step is seen finished, unless it
/// already is).
pub fn decode(
    shape: &BookShape,
    book: &mut BookMut<'_>,
    ticket: u64,
    inputs: Inputs<'_>,
    readback: &Readback<'_>,
    sources: FeedSources<'_>,
    rows: &mut [&mut RouterSeq],
) -> Result<DecodePlan> {
    let vocab_size = shape.layout.vocab_size;
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
    let masks = readback_masks(shape, what, rows.len(), readback)?;
    let mut row_inputs = Vec::with_capacity(rows.len());
    for (i, seq) in rows.iter().enumerate() {
        let id = seq.id;
        check_row(shape, book.tenures, what, i, seq, 1)?;
        let input = match &inputs {
            Inputs::Tokens(tokens) => Input::Token(tokens[i]),
            Inputs::Fed(fed) => match fed[i] {
                Feed::Host(token) => Input::Token(token),
                Feed::Row(r) => match sources.last_rows.get(r) {
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
                                sources.last_rows.len()
                            ),
                        ))
                    }
                },
            },
        };
        if let Input::Token(token) = input {
            if token as usize >= vocab_size {
                return Err(invalid(
                    what,
                    format!(
                        "row {i} (sequence {id}) feeds token id {token}, outside the vocabulary \
                         of {vocab_size}"
                    ),
                ));
            }
        }
        row_inputs.push(input);
    }
    let fed_from = row_inputs
        .iter()
        .any(|input| matches!(input, Input::Feed(_)))
        .then(|| ticket - 1);

    // Phase 2: reserve the block each row's new position needs.
    let needs_block = |seq: &RouterSeq| seq.blocks.len() * shape.block_size <= seq.computed_len;
    let total_needed = rows.iter().filter(|seq| needs_block(seq)).count();
    let mut fresh = reserve_blocks(book.cache, total_needed)?;

    // Phase 3: commit.
    let mut plan = DecodePlan {
        step: StepBook {
            masks,
            ..StepBook::default()
        },
        rows: Vec::with_capacity(rows.len()),
        fed_from,
    };
    let wants_checkpoints = book.cache.wants_end_checkpoints();
    for (i, (seq, input)) in rows.iter_mut().zip(row_inputs).enumerate() {
        if needs_block(seq) {
            seq.blocks.push(fresh.pop().expect("reserved above"));
        }
        let blocks = plan.step.blocks.len()..plan.step.blocks.len() + seq.blocks.len();
        plan.step.blocks.extend_from_slice(&seq.blocks);
        let pos = seq.computed_len;
        plan.rows.push(DecodeRow {
            input,
            pos,
            blocks,
            slot: seq.slot.expect("validated"),
        });
        let tenure = seq.tenure.expect("validated");
        match input {
            Input::Token(token) => seq.tokens.push(token),
            Input::Feed(row) => {
                let source = ticket - 1;
                // The source step may have finished already; then its argmax is known here.
                match sources.last_argmax {
                    Some((step, argmax)) if step == source => {
                        seq.tokens.push(argmax[row].unwrap_or(FED_PLACEHOLDER));
                    }
                    _ => {
                        seq.tokens.push(FED_PLACEHOLDER);
                        book.pending.entry(tenure).or_default().push(PendingFeed {
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
        plan.step.token_rows.push(Some(i));
        plan.step.tenures.push(tenure);
    }
    Ok(plan)
}

/// Refuses a row that cannot take a decode-like step: failed, foreign, without a slot, rolled
/// back, with its prompt incomplete, or past the context after `extra` more positions.
pub fn check_row(
    shape: &BookShape,
    tenures: &std::collections::BTreeMap<u64, Tenure>,
    what: &'static str,
    i: usize,
    seq: &RouterSeq,
    extra: usize,
) -> Result<()> {
    let id = seq.id;
    if seq.failed {
        return Err(invalid(
            what,
            format!("row {i} (sequence {id}) failed in an earlier step; release it"),
        ));
    }
    book::check_tenure(tenures, seq, what)?;
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

/// The fed positions a finished step resolves: moves each tenure's pending positions of
/// `ticket` (per row, `argmax[row]`, for the rows of `tenures`) to the resolved tokens, to be
/// copied into the sequence when it is next seen ([`book::sync`]).
pub fn resolve_feeds(book: &mut BookMut<'_>, ticket: u64, tenures: &[u64], argmax: &[Option<u32>]) {
    for (row, (&tenure, token)) in tenures.iter().zip(argmax).enumerate() {
        let Some(pending) = book.pending.get_mut(&tenure) else {
            continue;
        };
        let (hits, rest): (Vec<PendingFeed>, Vec<PendingFeed>) = pending
            .iter()
            .partition(|p| p.ticket == ticket && p.row == row);
        *pending = rest;
        if pending.is_empty() {
            book.pending.remove(&tenure);
        }
        if let Some(token) = token {
            let resolved = book.resolved.entry(tenure).or_default();
            resolved.extend(hits.iter().map(|p| (p.pos, *token)));
        }
    }
}

/// `await_result`'s order rule, the same on every router: `ticket` must be the oldest of
/// `unsettled` (the launched, unclaimed tickets, in launch order); a later one of them is
/// `Invalid` (awaited before the oldest), any other ticket `UnknownTicket`.
pub fn check_await(unsettled: &std::collections::VecDeque<u64>, ticket: Ticket) -> Result<()> {
    match unsettled.front() {
        Some(&oldest) if oldest == ticket.0 => Ok(()),
        Some(&oldest) if unsettled.contains(&ticket.0) => Err(DeviceError::Invalid {
            what: "await_result",
            detail: format!("{ticket} awaited before ticket {oldest}"),
        }),
        _ => Err(DeviceError::UnknownTicket(ticket)),
    }
}

/// A fed step's source rule, the same on every router (the contract: a fed step whose source
/// step failed fails too): a step that reads feed cells of `fed_from` (the step launched before
/// it, [`DecodePlan::fed_from`]) fails unless that step is `last_computed`, the latest step whose
/// device work completed without failing. Checked when the fed step's result is decided: before
/// it computes on a router that runs its device work in order (the host router), when it settles
/// on one that queues it behind its source (the CUDA router).
pub fn check_feed_source(fed_from: Option<u64>, last_computed: Option<u64>) -> Result<()> {
    match fed_from {
        Some(source) if last_computed != Some(source) => Err(DeviceError::Failed {
            phase: device_io::Phase::Forward,
            message: format!("its inputs come from ticket {source}, which failed"),
        }),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[track_caller]
    fn check(unsettled: &[u64], ticket: u64, expected: &str) {
        let unsettled = unsettled.iter().copied().collect();
        let got = match check_await(&unsettled, Ticket(ticket)) {
            Ok(()) => "ok".to_string(),
            Err(err) => format!("{err:?}"),
        };
        assert_eq!(got, expected);
    }

    #[test]
    fn a_fed_step_fails_unless_its_source_is_the_latest_step_computed() {
        let feed = |fed_from, last_computed| match check_feed_source(fed_from, last_computed) {
            Ok(()) => "ok".to_string(),
            Err(err) => err.to_string(),
        };
        assert_eq!(feed(None, None), "ok");
        assert_eq!(feed(None, Some(2)), "ok");
        assert_eq!(feed(Some(3), Some(3)), "ok");
        let failed = "forward failed: its inputs come from ticket 3, which failed";
        assert_eq!(feed(Some(3), Some(2)), failed);
        assert_eq!(feed(Some(3), None), failed);
        assert_eq!(feed(Some(3), Some(4)), failed);
    }

    #[test]
    fn only_the_oldest_unsettled_ticket_may_be_awaited() {
        check(&[3, 4], 3, "ok");
        check(&[4], 4, "ok");
        check(
            &[3, 4],
            4,
            r#"Invalid { what: "await_result", detail: "ticket 4 awaited before ticket 3" }"#,
        );
        check(&[3, 4], 5, "UnknownTicket(Ticket(5))");
        check(&[3, 4], 2, "UnknownTicket(Ticket(2))");
        check(&[], 3, "UnknownTicket(Ticket(3))");
    }
}
