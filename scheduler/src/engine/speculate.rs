//! Speculative decoding: the decode step of an engine with [`Speculation`] configured.
//!
//! # One step
//!
//! 1. **Drafts.** Every live row whose prompt is complete may speculate (greedy, randomly
//!    sampled, or forced: a replayed turn, whose drafts are accepted while they equal its
//!    recorded tokens), `k_i = min(k, max_tokens - generated - 1)` drafts (fewer near the
//!    context's end), as long as the snapshot ring has a slot for each (the router's ring, whose
//!    size the engine reads from `DeviceFacts::snapshot_slots_total` at start and refuses, with
//!    `EngineError::SnapshotRing`, when it is under `k`). The drafter proposes them once per step: [`Drafter::Mtp`] launches
//!    [`StepPlan::Draft`] (the router's MTP head; a row whose head has no catch-up state drafts
//!    nothing, counted in `Metrics::draft_misses`, and a refused draft step only costs this
//!    step's drafts, while one that failed on the device (`Failed` in phase `Forward`, or a lost
//!    device) fails its rows, whose state the contract leaves unspecified; the head's drafts for
//!    a verification that could not launch, on a dry pool, are kept for the next launch at the
//!    same length, since the head consumed the row's
//!    catch-up ring to propose them and a second `Draft` there would find none); [`Drafter::Known`]
//!    proposes from continuations known from an earlier run (the tests' perfect and adversarial
//!    drafters, which do not depend on the MTP weights).
//! 2. **Verify.** One [`StepPlan::Verify`] over every decode row: a row feeds its last token and
//!    its drafts (a row without drafts is a plain decode row), naming `k_i` ring slots for the
//!    SSM state after each draft. A dry pool preempts a victim and relaunches (the drafts are kept;
//!    a victim's are dropped), as for a plain decode.
//! 3. **Accept.** A row emits the token it chooses at each position exactly as plain decoding
//!    would there (a greedy row the target's argmax, a sampled row a draw from the position's
//!    logits with the request's own seeded stream, a forced row its next forced token), walking
//!    while the draft fed there equals it: for a greedy row the longest prefix of drafts equal
//!    to the target's argmax, plus the target's next token. A stop token or `max_tokens` inside
//!    the run ends the request at exactly the token plain decoding ends it at; a logits digest
//!    hashes each emitted position's row.
//!
//!    For a sampled row this *is* standard speculative rejection sampling: every drafter here
//!    proposes its tokens with certainty (the MTP head greedily, known continuations), and
//!    against a drafter distribution `q = δ(d)` the rule (accept `d` with probability
//!    `min(1, p(d)/q(d)) = p(d)`, else draw from `max(0, p - q)` renormalised, which is `p`
//!    without `d`) has the same law as drawing `x ~ p` and accepting iff `x = d`. Drawing `x`
//!    with the request's stream, one draw per emitted token as plain decoding makes, gives more
//!    than the same distribution: the same tokens, bit for bit, under the same seed.
//! 4. **Rollback.** Each row keeps `c + e` positions (`c` its length before the step, `e` the
//!    tokens it emitted): [`Effect::TruncateKv`] releases the rest (blocks through the ledger,
//!    nothing of a rejected draft reaches the prefix cache or a checkpoint), and when it dropped a
//!    position, [`Effect::SsmSnapshotRestore`] of the snapshot after input `e - 1` rewinds the
//!    Mamba state. With the MTP drafter, [`Effect::SaveHiddenCatchup`] keeps every kept position's
//!    hidden state and one [`Effect::SyncSecondary`] follows. A row the router then says is due
//!    a checkpoint gets its `MarconiCheckpoint` at once: when the kept run carried it past a
//!    block boundary, the router takes it from the run's snapshot there, which a later
//!    verification may overwrite (a plain decode step would have checkpointed that boundary).
//!
//! Greedy output is therefore bit-identical to plain decoding; the tests in
//! `tests/tests/engine_speculative.rs` check tokens and logits digests on both MTP fixtures for
//! k = 1..4, with caches on and off, mixed batches, preemption by spill and recompute, and
//! cancellation, at depth 1 and 2, with every block and slot back at the end; and that planted
//! bugs (skipping the SSM restore; cohorts sharing ring slots at depth 2) are caught.
//!
//! # Depth 2: cohorts
//!
//! On a router with `max_depth() >= 2` the engine may pipeline *across sequences*, as
//! [`Speculation::overlap`] says: [`SpecOverlap::Auto`] (the default) runs ahead by cohorts
//! unless the router computes on the host's own cores ([`DeviceIo::computes_on_host`]), where
//! nothing can overlap and the half batches only cost; [`SpecOverlap::Off`] and
//! [`SpecOverlap::Cohorts`] choose either way. With cohorts, when every live
//! row has its prompt computed, at least two rows are live and nothing waiting would be
//! admitted, the first half of the rows (a *cohort*) drafts and launches its verification
//! without awaiting it. Each later step the other cohort (the live rows not in flight) drafts
//! and launches its verification, and the one in flight settles meanwhile (accept, truncate,
//! restore, catch-up as above): with a drafter in the core the new verification is launched
//! first and the old one settles while it computes; with the MTP drafter the cohort's `Draft`
//! is launched first, the old verification settles while it computes (tickets settle in launch
//! order, and the verification needs the drafts), then its verification is launched.
//!
//! Why cohorts and not an optimistic run-ahead of the same rows (launching step N+1 as if every
//! draft of step N were accepted, as overlap schedulers that keep the sequence lengths on the
//! device do): the next verification's inputs (the target's token after the accepted run, and
//! drafts that follow it) are only known on the host after step N is read, and the contract's
//! `Verify` takes host tokens; a wrong guess would have to be unwound on both the KV and the SSM
//! state of a step that computed on top of a rejected one. With cohorts a sequence never has two
//! steps in flight, so nothing is ever unwound beyond the ordinary `TruncateKv` and the output
//! is exact by construction: each sequence sees the same plans and effects in the same order as
//! at depth 1 (the router's bits do not depend on the batch). The cost is that each launch
//! carries half the rows; on the host router, where host and device are the same cores and the
//! host work per step is small, that costs more than the overlap gains (see the `speculation`
//! example's depth table).
//!
//! The two cohorts' verifications name disjoint ring slots when both can be unsettled at once
//! (half the ring each, with a drafter in the core; the MTP drafter's cohort restores before
//! the next verification launches, so each may use the whole ring). The drain rule is the
//! plain pipeline's (admission, prefill work, compaction, a dry pool), less host logits: a row
//! that samples or digests makes its cohort's launch read logits back to a buffer of the flight's
//! own (a synchronisation point on the host router, but exact). A row cancelled while its
//! verification computes emits nothing of it, and `TruncateKv` drops every position the
//! verification computed for it before it is released (`Metrics::spec_discards`). A dry pool at
//! a cohort's launch changes nothing: the flight settles and the step runs at depth 1, which
//! preempts by spill or recompute as usual.

use std::sync::Arc;
use std::time::Instant;

use device_io::{
    DeviceError, DeviceIo, Effect, Phase, Readback, RowOutput, Sequence, StepPlan, StepResult,
    Ticket,
};

use super::pipeline::in_order;
use super::{choose_token, recycle, End, Engine, PlanKind};
use crate::event::ServeError;
use crate::metrics::StepReport;

/// The most drafts per row and step.
pub const MAX_DRAFTS: usize = 8;

/// Speculative decoding, engine-wide (see the module docs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Speculation {
    /// Drafts per speculating row and step, `1..=MAX_DRAFTS`.
    pub k: usize,
    /// Who proposes the drafts.
    pub drafter: Drafter,
    /// Whether the rows speculate in two cohorts on a router of depth 2.
    pub overlap: SpecOverlap,
}

impl Speculation {
    /// `k` drafts per step from the router's MTP head, cohorts as [`SpecOverlap::Auto`] decides.
    pub fn mtp(k: usize) -> Self {
        Speculation {
            k,
            drafter: Drafter::Mtp,
            overlap: SpecOverlap::Auto,
        }
    }
}

/// Whether speculation runs ahead by cohorts on a router of depth 2 (see the module docs): one
/// half of the rows verifies while the other half's verification is read, at the cost of two
/// launches of half the batch per round. A router of depth 1 always speculates at depth 1.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SpecOverlap {
    /// Cohorts when the router's depth is 2 and it does not compute on the host's own cores
    /// ([`DeviceIo::computes_on_host`]); depth 1 otherwise. On the host router the host's work
    /// cannot hide behind the device's (they share the cores), so the cohorts only cost: the
    /// `speculation` example measured 0.71–0.84× the tokens per second of depth 1 there. An
    /// accelerator's router overlaps the host's settling with the other cohort's verification.
    #[default]
    Auto,
    /// Depth 1 on any router: every row verifies in one launch, read before the next.
    Off,
    /// Cohorts whenever the router's depth is 2.
    Cohorts,
}

impl SpecOverlap {
    /// Whether an engine speculating on a router of `depth` runs ahead by cohorts.
    pub fn cohorts(self, depth: usize, computes_on_host: bool) -> bool {
        depth >= 2
            && match self {
                SpecOverlap::Auto => !computes_on_host,
                SpecOverlap::Off => false,
                SpecOverlap::Cohorts => true,
            }
    }
}

/// Where drafts come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Drafter {
    /// The router's MTP head ([`StepPlan::Draft`]).
    Mtp,
    /// Continuations known from an earlier run: a row whose tokens (prompt and output so far) are
    /// a proper prefix of one of `sequences` proposes the tokens that follow there; with
    /// `wrong`, each shifted by one in the vocabulary, so every draft is rejected. Rows that match
    /// none propose nothing. A drafter for tests and benchmarks: perfect (acceptance 100%) or
    /// adversarial (0%), independent of any MTP weights.
    Known {
        /// The known sequences.
        sequences: Arc<Vec<Vec<u32>>>,
        /// Propose wrong tokens.
        wrong: bool,
    },
}

/// A deliberate break of the speculative protocol, for the oracle's negative control only.
#[doc(hidden)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SpecFault {
    /// Never apply `SsmSnapshotRestore` after a rejected draft.
    SkipSsmRestore,
    /// Accept a randomly sampled row's drafts without drawing (a wrong acceptance rule).
    TrustSampledDrafts,
    /// At depth 2, let a cohort's verification name the ring slots of the one in flight.
    ReuseFlightRing,
}

/// A verification in flight (depth 2): launched, not awaited yet.
#[derive(Debug)]
pub(super) struct SpecFlight {
    ticket: Ticket,
    /// The request ids of its rows, in row order (their order in `running`).
    ids: Vec<u64>,
    /// Where its host logits went (empty unless a row needed them); the next verification
    /// launched while this one is in flight writes another buffer.
    logits: Vec<f32>,
    /// The snapshot ring slots its rows name (the next verification takes others).
    slots: Vec<usize>,
}

/// The rows of a `Draft`: each row's request id and draft budget, in row order.
type DraftRows = Vec<(u64, usize)>;

/// A `Draft` launched for a cohort and not awaited yet, with its rows (`None`: no row drafts).
type DraftLaunch = Option<(Result<Ticket, DeviceError>, DraftRows)>;

/// A settled `Draft`, with its rows (`None`: no row drafted).
type DraftSettled<P> = Option<(Result<StepResult<P>, DeviceError>, DraftRows)>;

impl<D> Engine<D>
where
    D: DeviceIo,
    D::Seq: Sequence,
{
    /// Plants a speculation fault (the oracle's negative control; never in production).
    #[doc(hidden)]
    pub fn inject_spec_fault(&mut self, fault: SpecFault) {
        self.spec_fault = Some(fault);
    }

    /// The decode step of an engine with speculation at depth 1: drafts, then a verification
    /// relaunched without a victim on a dry pool, then acceptance and rollback. Answers the rows
    /// settled.
    pub(super) fn speculative_decode(&mut self, spec: &Speculation) -> usize {
        let cohort = vec![true; self.running.len()];
        let ring: Vec<usize> = (0..self.ring_slots).collect();
        let mut budgets = self.draft_budgets(spec.k, &cohort, ring.len());
        self.clear_drafts(&cohort, &mut budgets);
        match &spec.drafter {
            Drafter::Known { sequences, wrong } => self.propose_known(sequences, *wrong, &budgets),
            Drafter::Mtp => {
                let launched = self.launch_draft(spec.k, &budgets);
                let launched = launched
                    .map(|(ticket, rows)| (ticket.and_then(|t| self.router.await_result(t)), rows));
                self.take_drafts(launched);
            }
        }
        self.assign_ring_slots(&cohort, &ring);
        loop {
            if self.router.lost().is_some() {
                return 0;
            }
            let (rows, wants_logits) = self.mark_rows(PlanKind::Decode, 0);
            if rows == 0 {
                return 0;
            }
            let mut logits = std::mem::take(&mut self.scratch.logits);
            let result = self
                .launch_verify(wants_logits, &mut logits)
                .and_then(|ticket| self.router.await_result(ticket));
            match result {
                Ok(step) => {
                    let ids: Vec<u64> = (self.running.iter())
                        .filter(|a| a.in_plan)
                        .map(|a| a.req.id)
                        .collect();
                    self.accept_verify(spec, step, &ids, &logits);
                    self.scratch.logits = logits;
                    return rows;
                }
                Err(
                    err @ (DeviceError::KvExhausted { .. } | DeviceError::SlotsExhausted { .. }),
                ) => {
                    self.scratch.logits = logits;
                    if !self.make_room(PlanKind::Decode, err) {
                        return 0;
                    }
                }
                Err(err) => {
                    self.scratch.logits = logits;
                    self.fail_verify_rows(&err);
                    return 0;
                }
            }
        }
    }

    /// Fails the rows marked `in_plan` after their verification failed.
    fn fail_verify_rows(&mut self, err: &DeviceError) {
        match err {
            DeviceError::DeviceLost(message) => {
                self.fail_plan_rows(|| ServeError::DeviceLost(message.clone()));
            }
            err => {
                tracing::warn!(%err, "verification failed; failing its rows");
                self.fail_plan_rows(|| ServeError::Device {
                    during: "Verify",
                    source: err.clone(),
                });
            }
        }
    }

    /// Whether an engine with speculation may start a flight (depth 2, nothing in flight): every
    /// live row has its prompt computed, at least two of them (one cohort computes while the
    /// other settles), and nothing waiting would be admitted.
    pub(super) fn can_start_spec_flight(&self) -> bool {
        let Some(spec) = &self.config.speculation else {
            return false;
        };
        let cohorts = (spec.overlap).cohorts(self.depth, self.router.inner().computes_on_host());
        if !cohorts || self.flight.is_some() || self.spec_flight.is_some() {
            return false;
        }
        let mut rows = 0;
        for active in self.running.iter().filter(|a| a.req.end.is_none()) {
            if !active.seq.prefill_done() {
                return false;
            }
            rows += 1;
        }
        rows >= 2 && !self.would_admit()
    }

    /// Starts a flight: the first half of the live rows (rounded up) draft and launch their
    /// verification, which is not awaited. Answers `false` when nothing was launched (the
    /// engine then decodes at depth 1).
    pub(super) fn start_spec_flight(
        &mut self,
        spec: &Speculation,
        report: &mut StepReport,
    ) -> bool {
        let live = self.running.iter().filter(|a| a.req.end.is_none()).count();
        let mut left = live.div_ceil(2);
        let cohort: Vec<bool> = (self.running.iter())
            .map(|a| {
                let take = a.req.end.is_none() && left > 0;
                left -= usize::from(take);
                take
            })
            .collect();
        let ring: Vec<usize> = (0..self.cohort_ring_slots(spec)).collect();
        self.launch_cohort(spec, &cohort, &ring, None, report)
    }

    /// The ring slots one cohort's verification may name: all of them with the MTP drafter
    /// (the verification in flight settles, restores included, before the next one launches),
    /// half with a drafter in the core (the next verification launches before the one in
    /// flight settles, so their rings must not meet).
    fn cohort_ring_slots(&self, spec: &Speculation) -> usize {
        match spec.drafter {
            Drafter::Mtp => self.ring_slots,
            Drafter::Known { .. } => self.ring_slots / 2,
        }
    }

    /// Whether the verification in flight can be followed by the other cohort's (the drain rule
    /// of the module docs).
    fn may_spec_run_ahead(&self) -> bool {
        let prefill_work =
            (self.running.iter()).any(|a| a.req.end.is_none() && !a.seq.prefill_done());
        let cohort = (self.running.iter()).any(|a| a.req.end.is_none() && !a.in_flight);
        !prefill_work && cohort && !self.compaction_pending() && !self.would_admit()
    }

    /// One step at depth 2 with a verification in flight: the other cohort drafts and launches
    /// its verification, and the one in flight settles meanwhile; or the step drains (the flight
    /// settles) and answers `false`, and the caller runs the step at depth 1.
    pub(super) fn spec_run_ahead(&mut self, spec: &Speculation, report: &mut StepReport) -> bool {
        let Some(flight) = self.spec_flight.take() else {
            return false;
        };
        if !self.may_spec_run_ahead() {
            self.metrics.pipeline_drains += 1;
            self.settle_verify(spec, flight, report);
            return false;
        }
        let cohort: Vec<bool> = (self.running.iter())
            .map(|a| a.req.end.is_none() && !a.in_flight)
            .collect();
        // The ring slots the flight's rows may still restore from are not reused while it is
        // in flight (with the MTP drafter it settles before the next verification launches).
        let shared = self.spec_fault == Some(SpecFault::ReuseFlightRing)
            || matches!(spec.drafter, Drafter::Mtp);
        let free: Vec<usize> = (0..self.ring_slots)
            .filter(|slot| shared || !flight.slots.contains(slot))
            .take(self.cohort_ring_slots(spec))
            .collect();
        self.launch_cohort(spec, &cohort, &free, Some(flight), report)
    }

    /// Drafts for the rows of `cohort` and launches their verification without awaiting it
    /// (naming ring slots of `ring` only); `settling`, the verification in flight, settles in
    /// between: after the cohort's `Draft` is launched (the MTP drafter: tickets settle in launch
    /// order, and the drafts are needed before the verification) or after its verification is
    /// (a drafter in the core). Answers whether a verification is in flight afterwards.
    fn launch_cohort(
        &mut self,
        spec: &Speculation,
        cohort: &[bool],
        ring: &[usize],
        mut settling: Option<SpecFlight>,
        report: &mut StepReport,
    ) -> bool {
        let mut budgets = self.draft_budgets(spec.k, cohort, ring.len());
        self.clear_drafts(cohort, &mut budgets);
        match &spec.drafter {
            Drafter::Known { sequences, wrong } => self.propose_known(sequences, *wrong, &budgets),
            Drafter::Mtp => {
                let launched = self.launch_draft(spec.k, &budgets);
                if let Some(flight) = settling.take() {
                    self.settle_verify(spec, flight, report);
                }
                let launched = launched
                    .map(|(ticket, rows)| (ticket.and_then(|t| self.router.await_result(t)), rows));
                self.take_drafts(launched);
            }
        }
        self.assign_ring_slots(cohort, ring);
        // Mark the cohort's rows that are still live.
        let Engine {
            running, scratch, ..
        } = self;
        scratch.tokens.clear();
        let mut wants_logits = false;
        for (active, &member) in running.iter_mut().zip(cohort) {
            active.in_plan = false;
            if !member || active.req.end.is_some() {
                continue;
            }
            let Some(&last) = active.req.tokens.last() else {
                continue;
            };
            scratch.tokens.push(last);
            active.in_plan = true;
            wants_logits |= active.req.needs_logits();
        }
        if scratch.tokens.is_empty() {
            if let Some(flight) = settling.take() {
                self.settle_verify(spec, flight, report);
            }
            return false;
        }
        let mut logits = std::mem::take(&mut self.scratch.logits);
        let launched = self.launch_verify(wants_logits, &mut logits);
        match launched {
            Ok(ticket) => {
                self.metrics.spec_flights += 1;
                let mut ids = Vec::with_capacity(self.scratch.tokens.len());
                let mut slots = Vec::new();
                for active in self.running.iter_mut().filter(|a| a.in_plan) {
                    active.in_flight = true;
                    ids.push(active.req.id);
                    slots.extend_from_slice(&active.draft_slots);
                }
                // Launch t+1 before reading t: the router computes it while the host settles.
                if let Some(flight) = settling.take() {
                    self.settle_verify(spec, flight, report);
                }
                self.spec_flight = Some(SpecFlight {
                    ticket,
                    ids,
                    logits,
                    slots,
                });
                true
            }
            Err(err) => {
                // A refused launch changed nothing; what is in flight settles first.
                self.scratch.logits = logits;
                if let Some(flight) = settling.take() {
                    self.settle_verify(spec, flight, report);
                }
                if !matches!(
                    err,
                    DeviceError::KvExhausted { .. } | DeviceError::SlotsExhausted { .. }
                ) {
                    self.fail_verify_rows(&err);
                }
                // A dry pool: the depth-1 step preempts as usual.
                false
            }
        }
    }

    /// Awaits a verification in flight and takes its rows' outputs (a row that ended while it
    /// computed is discarded and every position the verification computed for it dropped).
    fn settle_verify(&mut self, spec: &Speculation, flight: SpecFlight, report: &mut StepReport) {
        let SpecFlight {
            ticket,
            ids,
            logits,
            ..
        } = flight;
        match self.router.await_result(ticket) {
            Ok(step) => {
                report.decode_rows += step.rows.len();
                self.accept_verify(spec, step, &ids, &logits);
            }
            Err(err) => {
                tracing::warn!(%err, "a verification in flight failed; failing its rows");
                for active in in_order(&mut self.running, &ids) {
                    if active.req.end.is_none() {
                        active.req.end = Some(End::Fail(match &err {
                            DeviceError::DeviceLost(message) => {
                                ServeError::DeviceLost(message.clone())
                            }
                            err => ServeError::Device {
                                during: "Verify",
                                source: err.clone(),
                            },
                        }));
                    }
                }
            }
        }
        for active in in_order(&mut self.running, &ids) {
            active.in_flight = false;
        }
        self.scratch.logits = logits;
    }

    /// Settles the verification in flight, if any (a drain: before shutdown or a LoRA command).
    pub(super) fn drain_spec_flight(&mut self) {
        if let Some(flight) = self.spec_flight.take() {
            let Some(spec) = self.config.speculation.clone() else {
                return;
            };
            self.metrics.pipeline_drains += 1;
            let mut report = StepReport::default();
            self.settle_verify(&spec, flight, &mut report);
        }
    }

    /// How many drafts a live row may take this step (0: it does not speculate).
    fn draft_budget(&self, index: usize, k: usize) -> usize {
        let active = &self.running[index];
        let req = &active.req;
        if req.end.is_some() || !active.seq.prefill_done() {
            return 0;
        }
        let left = req.max_tokens.saturating_sub(req.generated() + 1);
        let room = self
            .limits
            .max_context
            .saturating_sub(active.seq.computed_len() + 1);
        k.min(left).min(room)
    }

    /// The drafts each row of `cohort` may take this step, within `slots` ring slots (a row's
    /// drafts each name one).
    fn draft_budgets(&self, k: usize, cohort: &[bool], slots: usize) -> Vec<usize> {
        let mut slots_left = slots;
        (0..self.running.len())
            .map(|index| {
                if !cohort.get(index).copied().unwrap_or(false) {
                    return 0;
                }
                let budget = self.draft_budget(index, k).min(slots_left);
                slots_left -= budget;
                budget
            })
            .collect()
    }

    /// Clears the drafts of the rows of `cohort` before they are proposed, but for the MTP
    /// drafts still unverified at the row's current length (their verification could not
    /// launch): those are kept, within the row's budget, whose budget then drops to 0. The head
    /// consumed the row's catch-up ring when it drafted them, so a second `Draft` at the same
    /// length would find nothing to draft from; the drafts are as good as they were.
    fn clear_drafts(&mut self, cohort: &[bool], budgets: &mut [usize]) {
        let rows = (self.running.iter_mut())
            .zip(cohort)
            .zip(budgets.iter_mut());
        for ((active, _), budget) in rows.filter(|((_, &member), _)| member) {
            active.draft_slots.clear();
            let unverified = active.drafts_at == Some(active.seq.computed_len());
            if unverified && !active.drafts.is_empty() && *budget > 0 {
                active.drafts.truncate(*budget);
                *budget = 0;
            } else {
                active.drafts.clear();
                active.drafts_at = None;
            }
        }
    }

    /// Gives each row of `cohort` one slot of `ring` per draft, in row order.
    fn assign_ring_slots(&mut self, cohort: &[bool], ring: &[usize]) {
        let mut free = ring.iter().copied();
        for (active, _) in self.running.iter_mut().zip(cohort).filter(|(_, &c)| c) {
            active.draft_slots.clear();
            for _ in 0..active.drafts.len() {
                match free.next() {
                    Some(slot) => active.draft_slots.push(slot),
                    None => break,
                }
            }
            // The budgets keep within the ring; should they not, the row drafts fewer.
            active.drafts.truncate(active.draft_slots.len());
        }
    }

    /// [`Drafter::Known`]: the drafts of the rows with a budget, from the known continuations.
    fn propose_known(&mut self, sequences: &[Vec<u32>], wrong: bool, budgets: &[usize]) {
        let vocab = self.limits.vocab_size.max(1) as u32;
        for (active, &budget) in self.running.iter_mut().zip(budgets) {
            if budget == 0 {
                continue;
            }
            let tokens = &active.req.tokens;
            let Some(known) = sequences
                .iter()
                .find(|s| s.len() > tokens.len() && s.starts_with(tokens))
            else {
                continue;
            };
            let next = &known[tokens.len()..(tokens.len() + budget).min(known.len())];
            active.drafts.extend(
                next.iter()
                    .map(|&t| if wrong { (t + 1) % vocab } else { t }),
            );
        }
    }

    /// Launches one `Draft` of `k` tokens over the rows with a budget (and the context room for
    /// `k`), not awaited; `None` when no row drafts.
    fn launch_draft(&mut self, k: usize, budgets: &[usize]) -> DraftLaunch {
        let max_context = self.limits.max_context;
        let Engine {
            router,
            running,
            scratch,
            ..
        } = self;
        scratch.tokens.clear();
        let mut rows: Vec<&mut D::Seq> = recycle(std::mem::take(&mut scratch.rows));
        let mut drafting = Vec::new();
        for (active, &budget) in running.iter_mut().zip(budgets) {
            if budget == 0 || active.seq.computed_len() + k > max_context {
                continue;
            }
            let Some(&last) = active.req.tokens.last() else {
                continue;
            };
            scratch.tokens.push(last);
            drafting.push((active.req.id, budget));
            rows.push(&mut active.seq);
        }
        let launched = if rows.is_empty() {
            None
        } else {
            let plan = StepPlan::Draft {
                tokens: &scratch.tokens,
                k,
            };
            Some((router.launch(plan, &mut rows), drafting))
        };
        scratch.rows = recycle(rows);
        launched
    }

    /// Takes a settled `Draft`'s tokens into its rows' drafts (at most each row's budget).
    fn take_drafts(&mut self, settled: DraftSettled<D::Ptr>) {
        match settled {
            None => {}
            Some((Ok(step), drafting)) => {
                self.metrics.draft_launches += 1;
                let ids: Vec<u64> = drafting.iter().map(|&(id, _)| id).collect();
                let rows = in_order(&mut self.running, &ids);
                for ((active, (_, budget)), output) in rows.zip(&drafting).zip(&step.rows) {
                    let drafts = (output.run)
                        .and_then(|run| step.tokens.get(run.start..run.start + run.len))
                        .unwrap_or_default();
                    if drafts.is_empty() {
                        // The head had no catch-up state for the row (see the module docs).
                        self.metrics.draft_misses += 1;
                        continue;
                    }
                    let take = drafts.len().min(*budget);
                    active.drafts.extend_from_slice(&drafts[..take]);
                    active.drafts_at = Some(active.seq.computed_len());
                }
            }
            Some((
                Err(
                    err @ (DeviceError::Failed {
                        phase: Phase::Forward,
                        ..
                    }
                    | DeviceError::DeviceLost(_)),
                ),
                drafting,
            )) => {
                // The head ran on the rows and failed: their state is unspecified (the
                // contract), so they fail; the router refuses any later step over them.
                tracing::warn!(%err, "a draft step failed; failing its rows");
                self.metrics.draft_failures += 1;
                let ids: Vec<u64> = drafting.iter().map(|&(id, _)| id).collect();
                for active in in_order(&mut self.running, &ids) {
                    active.req.end.get_or_insert(End::Fail(match &err {
                        DeviceError::DeviceLost(message) => ServeError::DeviceLost(message.clone()),
                        err => ServeError::Device {
                            during: "Draft",
                            source: err.clone(),
                        },
                    }));
                }
            }
            Some((Err(err), _)) => {
                // Refused, nothing changed: only this step's drafts are lost; the verification
                // decodes plainly.
                tracing::debug!(%err, "draft step refused; decoding without drafts");
                self.metrics.draft_failures += 1;
            }
        }
    }

    /// Launches the verification of the marked rows (not awaited): each feeds its last token and
    /// its drafts, naming its ring slots.
    fn launch_verify(
        &mut self,
        wants_logits: bool,
        logits: &mut Vec<f32>,
    ) -> Result<Ticket, DeviceError> {
        let Engine {
            router,
            running,
            scratch,
            ..
        } = self;
        // Per row: its last token and drafts, and the ring slots after each draft.
        let mut flat: Vec<u32> = Vec::new();
        let mut slots: Vec<usize> = Vec::new();
        let mut spans = Vec::new();
        let mut any_drafts = false;
        for (active, &last) in running
            .iter()
            .filter(|a| a.in_plan)
            .zip(scratch.tokens.iter())
        {
            let start = flat.len();
            let slot_start = slots.len();
            flat.push(last);
            flat.extend_from_slice(&active.drafts);
            slots.extend_from_slice(&active.draft_slots);
            any_drafts |= !active.drafts.is_empty();
            spans.push((start..flat.len(), slot_start..slots.len()));
        }
        let inputs: Vec<&[u32]> = spans.iter().map(|(t, _)| &flat[t.clone()]).collect();
        let snapshot_lists: Vec<&[usize]> = spans.iter().map(|(_, s)| &slots[s.clone()]).collect();
        let snapshots: &[&[usize]] = if any_drafts { &snapshot_lists } else { &[] };
        let mut rows: Vec<&mut D::Seq> = recycle(std::mem::take(&mut scratch.rows));
        rows.extend(running.iter_mut().filter(|a| a.in_plan).map(|a| &mut a.seq));
        let readback = if wants_logits {
            Readback::HostLogits { into: logits }
        } else {
            Readback::Argmax
        };
        let plan = StepPlan::Verify {
            inputs: &inputs,
            snapshots,
            readback,
        };
        let result = router.launch(plan, &mut rows);
        scratch.rows = recycle(rows);
        result
    }

    /// Takes a settled verification into its rows (`ids`, in row order): tokens, stop
    /// conditions, truncation, SSM restore and the MTP head's catch-up. A row that ended while
    /// the verification computed (depth 2: it was cancelled) emits nothing and keeps none of the
    /// positions it computed.
    fn accept_verify(
        &mut self,
        spec: &Speculation,
        step: StepResult<D::Ptr>,
        ids: &[u64],
        logits: &[f32],
    ) {
        let now = Instant::now();
        let fault = self.spec_fault;
        let Engine {
            router,
            running,
            scratch,
            metrics,
            limits,
            ..
        } = self;
        let vocab = limits.vocab_size;
        metrics.decode_launches += 1;
        metrics.decode_rows += step.rows.len() as u64;
        metrics.verify_launches += 1;
        let mut outputs = step.rows.iter().enumerate();
        let mdrafter = matches!(spec.drafter, Drafter::Mtp);
        for active in in_order(running, ids) {
            let req = &mut active.req;
            let drafts = std::mem::take(&mut active.drafts);
            let slots = std::mem::take(&mut active.draft_slots);
            active.drafts_at = None;
            let d = drafts.len();
            let Some((row, output)) = outputs.next() else {
                req.end.get_or_insert(End::Fail(super::protocol(
                    PlanKind::Decode,
                    "the step answered fewer rows than it had",
                )));
                continue;
            };
            let c = active.seq.computed_len().saturating_sub(d + 1);
            if req.end.is_some() {
                // Ended while this verification computed: nothing of it is kept.
                metrics.spec_discards += 1;
                if let Err(err) = router.apply(Effect::TruncateKv {
                    seq: &mut active.seq,
                    len: c,
                }) {
                    tracing::warn!(id = req.id, %err, "TruncateKv of a discarded row failed");
                    active.no_cache = true;
                }
                continue;
            }
            let targets = output
                .run
                .filter(|run| run.len == d + 1)
                .and_then(|run| step.tokens.get(run.start..run.start + run.len));
            let Some(targets) = targets else {
                req.end = Some(End::Fail(super::protocol(
                    PlanKind::Decode,
                    "a verification row has no run of its positions",
                )));
                continue;
            };
            // Walk the run while the draft fed at each position is the token chosen there.
            let mut emitted = 0;
            let mut accepted = 0;
            for (j, &target) in targets.iter().enumerate() {
                let position = RowOutput {
                    token: Some(target),
                    logits_row: output.logits_row.map(|first| first + j),
                    ..RowOutput::default()
                };
                let chosen = if fault == Some(SpecFault::TrustSampledDrafts)
                    && j < d
                    && req.sampler.needs_logits()
                {
                    Ok(drafts[j])
                } else {
                    choose_token(req, &position, logits, vocab, &mut scratch.sample)
                };
                let token = match chosen {
                    Ok(token) => token,
                    Err(detail) => {
                        req.end = Some(End::Fail(super::protocol(PlanKind::Decode, detail)));
                        break;
                    }
                };
                metrics.generated_tokens += 1;
                req.push_token(token, now);
                emitted += 1;
                let matches = j < d && drafts[j] == token;
                accepted += usize::from(matches);
                if req.end.is_some() || !matches {
                    break;
                }
            }
            if d > 0 {
                metrics.spec_rows += 1;
                metrics.drafted += d as u64;
                metrics.accepted += accepted as u64;
                metrics.spec_tokens += emitted as u64;
            }
            // Keep the emitted positions (at least the fed token's, even for a failed row, so
            // the ledger entry closes on real positions only).
            let keep = c + emitted.max(1);
            let seq = &mut active.seq;
            let truncated = router.apply(Effect::TruncateKv { seq, len: keep });
            let restored = match truncated {
                Ok(_) if keep < c + d + 1 && fault != Some(SpecFault::SkipSsmRestore) => router
                    .apply(Effect::SsmSnapshotRestore {
                        seq: &mut active.seq,
                        slot: slots[keep - c - 1],
                    })
                    .map(|_| ())
                    .map_err(|err| ("SsmSnapshotRestore", err)),
                Ok(_) => Ok(()),
                Err(err) => Err(("TruncateKv", err)),
            };
            if keep < c + d + 1 {
                metrics.spec_rollbacks += 1;
            }
            if let Err((during, source)) = restored {
                tracing::warn!(id = req.id, %source, "speculative rollback failed");
                req.end = Some(End::Fail(ServeError::Device { during, source }));
                continue;
            }
            // The head follows every row (a row that drafted nothing this step catches up too,
            // so it can draft at the next).
            if mdrafter {
                for pos in c..keep {
                    if let Err(err) = router.apply(Effect::SaveHiddenCatchup { row, pos }) {
                        // Only the head's next drafts lose: it catches up from what it has.
                        tracing::debug!(id = req.id, %err, "SaveHiddenCatchup refused");
                    }
                }
            }
            // A block boundary the kept run passed is checkpointed from the run's snapshot, now:
            // at depth 2 the next verification may name the ring slot it is in.
            if active.seq.checkpoint_due() && !matches!(req.end, Some(End::Fail(_))) {
                match router.apply(Effect::MarconiCheckpoint {
                    seq: &mut active.seq,
                }) {
                    Ok(_) => metrics.marconi_checkpoints += 1,
                    Err(err) => {
                        // The router changed nothing; only caching loses, the request goes on.
                        tracing::warn!(id = req.id, %err, "MarconiCheckpoint failed");
                        metrics.marconi_checkpoint_failures += 1;
                    }
                }
            }
        }
        if mdrafter {
            if let Err(err) = router.apply(Effect::SyncSecondary) {
                tracing::debug!(%err, "SyncSecondary refused");
            }
        }
    }
}
