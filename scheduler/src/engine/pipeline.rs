//! Depth 2: the engine keeps one decode step in flight, so the router computes step t+1 while
//! the engine reads step t and does the host work for it (stop checks, streaming, metrics,
//! admission planning).
//!
//! # When the engine runs ahead
//!
//! With a router whose `max_depth() >= 2`, a step that has no prefill work (every live request
//! has its prompt computed, and none waiting would be admitted) and whose decode rows can all be
//! fed without the host (greedy rows: the device argmax; forced rows: the forced token) *starts*
//! a flight: it applies `ReserveKv` to every row and launches a `DecodeFed` whose sources are the
//! rows' last tokens ([`Feed::Host`]), and does not await it. Each later step *runs ahead*:
//!
//! 1. it plans step t+1 from the rows of step t (in flight) that are still live and whose step-t
//!    output is not known to be their last (a row reaching `max_tokens`, or whose forced token is
//!    a stop token, leaves the pipeline instead of over-running): a greedy row feeds from its
//!    row of step t on the device ([`Feed::Row`]), a forced row from its known token;
//! 2. applies `ReserveKv` to each, launches step t+1, and only then awaits step t;
//! 3. takes step t's outputs: tokens are chosen, streamed and checked for stop conditions; the
//!    logits digest of a row that asked for one is computed from `ReadLogits` of step t (the
//!    router keeps step t's logits while t+1 computes, so a digest does not drain);
//! 4. applies `MarconiCheckpoint` for rows of step t+1 still live (the checkpoint is ordered
//!    after t+1 on the device, and taken only once the host knows the position is real);
//! 5. releases the requests that ended and are not rows of step t+1 (no compaction).
//!
//! A row that was already ended when step t is read (it stopped at step t-1, or was cancelled
//! since step t was launched) over-ran in step t: its output is discarded, never emitted, and
//! `Rollback` undoes its position before the row is released, so neither the prefix cache nor a
//! Marconi checkpoint remembers it. Tokens, logits digests and cache contents are therefore those
//! of depth 1 (the oracle in `tests/tests/engine_pipelined.rs` checks it).
//!
//! # The drain rule
//!
//! A step *drains* (awaits the step in flight, takes its outputs as above, then runs as at depth
//! 1: admission, decode, prefill, checkpoints, releases, compaction) instead of running ahead
//! when any of these holds:
//!
//! - **admission**: a waiting request fits now (a new or recomputing one needs a prefill; a
//!   restored one joins at depth 1);
//! - **prefill work** or a live request that is not a row of the step in flight;
//! - **host logits**: a live row samples from the logits (random sampling);
//! - **compaction**: a slot holder sits at or above the number of holders, so a row in flight
//!   would move (compaction runs only with nothing in flight);
//! - **a dry pool**: a `ReserveKv` answered `Exhausted` (the reservations of this step are
//!   rolled back; the depth-1 step then preempts as usual, by spill or recompute);
//! - **mask changes**: requests carry no token masks yet, so every fed step is unmasked; a
//!   feature that adds them must drain when a row's mask changes.
//!
//! Cancellation needs no drain (the row's in-flight output is discarded as above). Shutdown
//! drains before it releases anything. A failed launch of step t+1 rolls back its reservations
//! and fails exactly its rows (a dry pool drains instead); a step that fails when awaited fails
//! its live rows, and the fed step launched after it fails the same way when it settles.

use std::time::Instant;

use device_io::{DeviceError, DeviceIo, Effect, EffectOutcome, Feed, Sequence, StepPlan, Ticket};

use super::{recycle, Active, End, Engine, Tracked};
use crate::event::ServeError;
use crate::guard::Guarded;
use crate::sampling::RunAhead;

/// A deliberate break of the depth-2 protocol, for the oracle's negative control only: with
/// it, the depth-2 tests must fail (`tests/tests/engine_pipelined.rs` shows they do).
#[doc(hidden)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PipelineFault {
    /// Discard an over-run's output but never apply `Rollback`.
    SkipRollback,
    /// Emit an over-run's output as if it were a real token (and skip the rollback).
    EmitOverRun,
}

/// How launching a fed step went.
enum Launched {
    Yes,
    /// The pool (or the slots) ran dry; nothing changed.
    Dry,
    /// Any other error; nothing changed, and the rows must fail.
    Failed(DeviceError),
}

/// The decode step in flight.
#[derive(Debug)]
pub(super) struct Flight {
    ticket: Ticket,
    /// The request ids of its rows, in row order (which is their order in `running`).
    ids: Vec<u64>,
    /// Whether a row wants its logits digest (then the step's logits are read back).
    digests: bool,
}

/// Whether a row's next input can be named before the host reads the step that produces it.
fn pipelineable(req: &Tracked) -> bool {
    req.sampler.run_ahead() != RunAhead::NeedsLogits
}

/// Whether the output of the step in flight is known to be the row's last: it reaches
/// `max_tokens`, or it is a forced stop token.
fn last_output_known(req: &Tracked) -> bool {
    if req.generated() + 1 >= req.max_tokens {
        return true;
    }
    matches!(req.sampler.run_ahead(), RunAhead::Known(token) if req.stop_tokens.contains(&token))
}

impl<D> Engine<D>
where
    D: DeviceIo,
    D::Seq: Sequence,
{
    /// Test-only: breaks the depth-2 protocol on purpose (the negative control).
    #[doc(hidden)]
    pub fn inject_pipeline_fault(&mut self, fault: PipelineFault) {
        self.pipeline_fault = Some(fault);
    }

    /// Whether a decode step (or, with speculation, a verification) is in flight (depth 2).
    pub fn step_in_flight(&self) -> bool {
        self.flight.is_some() || self.spec_flight.is_some()
    }

    /// Whether this step (with nothing in flight) can start a flight: see the module docs.
    pub(super) fn can_start_flight(&self) -> bool {
        // Speculative decoding runs ahead by cohorts instead (see the `speculate` module).
        if self.depth < 2 || self.flight.is_some() || self.config.speculation.is_some() {
            return false;
        }
        let mut rows = 0;
        for active in self.running.iter().filter(|a| a.req.end.is_none()) {
            if !active.seq.prefill_done() || !pipelineable(&active.req) {
                return false;
            }
            rows += 1;
        }
        rows > 0 && !self.would_admit()
    }

    /// Whether compaction would move a slot holder (which it must not while a step computes).
    pub(super) fn compaction_pending(&self) -> bool {
        let holders = self
            .running
            .iter()
            .filter(|a| a.seq.slot().is_some())
            .count()
            + self.orphans.iter().filter(|s| s.slot().is_some()).count();
        self.running
            .iter()
            .any(|a| a.seq.slot().is_some_and(|slot| slot >= holders))
    }

    /// Whether the step in flight can be followed by a fed step (see the drain rule).
    fn may_run_ahead(&self) -> bool {
        let live_outside = self
            .running
            .iter()
            .any(|a| a.req.end.is_none() && (!a.in_flight || !pipelineable(&a.req)));
        !live_outside && !self.compaction_pending() && !self.would_admit()
    }

    /// Starts a flight over every live row (all pipelineable, prompts complete): reserves, then
    /// launches a `DecodeFed` fed with each row's last token. Answers `false` when the engine
    /// should decode synchronously instead (a dry pool); a failed launch fails the rows.
    pub(super) fn start_flight(&mut self) -> bool {
        let Engine {
            running, scratch, ..
        } = self;
        scratch.sources.clear();
        for active in running.iter_mut() {
            active.in_plan = active.req.end.is_none();
            if active.in_plan {
                let last = active.req.tokens.last().copied().unwrap_or_default();
                scratch.sources.push(Feed::Host(last));
            }
        }
        if scratch.sources.is_empty() {
            return false;
        }
        if !self.reserve_rows() {
            return false;
        }
        match self.launch_fed() {
            Launched::Yes => true,
            Launched::Dry => false,
            Launched::Failed(err) => {
                self.fail_planned(&err);
                // The failed rows are released by the depth-1 part of the step.
                false
            }
        }
    }

    /// Fails the rows marked `in_plan` after their fed step failed at launch.
    fn fail_planned(&mut self, err: &DeviceError) {
        tracing::warn!(%err, "fed step failed at launch; failing its rows");
        for active in self.running.iter_mut().filter(|a| a.in_plan) {
            active.in_plan = false;
            active.req.end.get_or_insert(End::Fail(ServeError::Device {
                during: "DecodeFed",
                source: err.clone(),
            }));
        }
    }

    /// One step at depth 2 with a step in flight: runs ahead, or drains and answers `false` (the
    /// caller then runs the step at depth 1).
    pub(super) fn run_ahead(&mut self, report: &mut crate::metrics::StepReport) -> bool {
        let Some(flight) = self.flight.take() else {
            return false;
        };
        if !self.may_run_ahead() {
            self.drain(flight, report);
            return false;
        }
        // Plan step t+1: the rows of t that stay, each fed from its own row of t.
        let Engine {
            running, scratch, ..
        } = self;
        scratch.sources.clear();
        let mut row_in_flight = 0;
        for active in running.iter_mut() {
            active.in_plan = false;
            if !active.in_flight {
                continue;
            }
            let row = row_in_flight;
            row_in_flight += 1;
            if active.req.end.is_some() || last_output_known(&active.req) {
                continue;
            }
            let source = match active.req.sampler.run_ahead() {
                RunAhead::Known(token) => Feed::Host(token),
                RunAhead::DeviceArgmax | RunAhead::NeedsLogits => Feed::Row(row),
            };
            scratch.sources.push(source);
            active.in_plan = true;
        }
        if scratch.sources.is_empty() || !self.reserve_rows() {
            self.drain(flight, report);
            return false;
        }
        // Launch t+1 before reading t: the router computes it while the host works below.
        match self.launch_fed() {
            Launched::Yes => {}
            Launched::Dry => {
                self.drain(flight, report);
                return false;
            }
            Launched::Failed(err) => {
                // Step t's outputs are real: take them first, then fail the rows of t+1.
                self.drain(flight, report);
                self.fail_planned(&err);
                return false;
            }
        }
        self.settle(flight, report);
        true
    }

    /// Applies `ReserveKv` to every row marked `in_plan`; on a dry pool (or an error) rolls back
    /// the reservations it made and answers `false`.
    fn reserve_rows(&mut self) -> bool {
        let Engine {
            router,
            running,
            metrics,
            ..
        } = self;
        let mut failed = None;
        for (index, active) in running.iter_mut().enumerate() {
            if !active.in_plan {
                continue;
            }
            match router.apply(Effect::ReserveKv {
                seq: &mut active.seq,
            }) {
                Ok(EffectOutcome::Reserved { .. }) => {}
                Ok(_) => {
                    failed = Some(index);
                    break;
                }
                Err(err) => {
                    tracing::warn!(id = active.req.id, %err, "ReserveKv failed");
                    failed = Some(index);
                    break;
                }
            }
        }
        let Some(failed) = failed else {
            return true;
        };
        for active in running[..failed].iter_mut().filter(|a| a.in_plan) {
            if let Err(err) = router.apply(Effect::Rollback {
                seq: &mut active.seq,
            }) {
                tracing::warn!(id = active.req.id, %err, "Rollback of an unused reservation failed");
                metrics.rollback_failures += 1;
                active.no_cache = true;
            }
        }
        for active in running.iter_mut() {
            active.in_plan = false;
        }
        false
    }

    /// Launches the `DecodeFed` over the rows marked `in_plan` (reserved) with `scratch.sources`;
    /// on success it is the flight and its rows are marked `in_flight`. On failure the
    /// reservations are rolled back and the rows stay marked `in_plan`.
    fn launch_fed(&mut self) -> Launched {
        let Engine {
            router,
            running,
            scratch,
            metrics,
            ..
        } = self;
        let mut rows: Vec<&mut D::Seq> = recycle(std::mem::take(&mut scratch.rows));
        rows.extend(running.iter_mut().filter(|a| a.in_plan).map(|a| &mut a.seq));
        let plan = StepPlan::DecodeFed {
            sources: &scratch.sources,
            masks: &[],
        };
        let launched = router.launch(plan, &mut rows);
        scratch.rows = recycle(rows);
        match launched {
            Ok(ticket) => {
                metrics.fed_launches += 1;
                let mut ids = std::mem::take(&mut scratch.flight_ids);
                ids.clear();
                let mut digests = false;
                for active in running.iter_mut() {
                    active.in_flight = active.in_plan;
                    if active.in_plan {
                        ids.push(active.req.id);
                        digests |= active.req.digest.is_some();
                    }
                }
                self.flight = Some(Flight {
                    ticket,
                    ids,
                    digests,
                });
                Launched::Yes
            }
            Err(err) => {
                for active in running.iter_mut().filter(|a| a.in_plan) {
                    if let Err(again) = router.apply(Effect::Rollback {
                        seq: &mut active.seq,
                    }) {
                        tracing::warn!(id = active.req.id, err = %again, "Rollback failed");
                        metrics.rollback_failures += 1;
                        active.no_cache = true;
                    }
                }
                match err {
                    DeviceError::KvExhausted { .. } | DeviceError::SlotsExhausted { .. } => {
                        Launched::Dry
                    }
                    err => Launched::Failed(err),
                }
            }
        }
    }

    /// Awaits the step in flight, takes its outputs, and leaves nothing in flight.
    fn drain(&mut self, flight: Flight, report: &mut crate::metrics::StepReport) {
        self.metrics.pipeline_drains += 1;
        self.settle(flight, report);
        for active in self.running.iter_mut() {
            active.in_flight = false;
        }
    }

    /// Settles whatever is in flight (before shutdown releases anything).
    pub(super) fn drain_flight(&mut self) {
        if let Some(flight) = self.flight.take() {
            let mut report = crate::metrics::StepReport::default();
            self.drain(flight, &mut report);
        }
        self.drain_spec_flight();
    }

    /// Awaits `flight` and takes its rows' outputs: over-runs are discarded and rolled back, the
    /// others chosen, digested, streamed and checked for stop conditions.
    fn settle(&mut self, flight: Flight, report: &mut crate::metrics::StepReport) {
        let Flight {
            ticket,
            mut ids,
            digests,
        } = flight;
        let result = self.router.await_result(ticket);
        let now = Instant::now();
        let fault = self.pipeline_fault;
        let Engine {
            router,
            running,
            scratch,
            metrics,
            limits,
            ..
        } = self;
        let vocab = limits.vocab_size;
        let step = match result {
            Ok(step) => step,
            Err(err) => {
                tracing::warn!(%err, "a step in flight failed; failing its rows");
                for active in in_order(running, &ids) {
                    if active.req.end.is_some() {
                        rollback(router, active, metrics, fault);
                    } else {
                        active.req.end = Some(End::Fail(ServeError::Device {
                            during: "DecodeFed",
                            source: err.clone(),
                        }));
                    }
                }
                ids.clear();
                scratch.flight_ids = ids;
                return;
            }
        };
        metrics.decode_launches += 1;
        metrics.decode_rows += step.rows.len() as u64;
        report.decode_rows += step.rows.len();
        // The digests' logits, copied once for the whole step while the next one computes.
        let mut read_failed = None;
        if digests {
            match step.logits {
                Some(logits) => {
                    if let Err(err) = router.apply(Effect::ReadLogits {
                        logits,
                        rows: step.rows.len(),
                        into: &mut scratch.logit_bytes,
                    }) {
                        read_failed = Some(err);
                    }
                }
                None => {
                    read_failed = Some(DeviceError::Invalid {
                        what: "DecodeFed",
                        detail: "the step kept no logits to digest".to_string(),
                    })
                }
            }
        }
        let row_bytes = vocab * 4;
        let mut outputs = step.rows.iter().enumerate();
        for active in in_order(running, &ids) {
            let Some((row, output)) = outputs.next() else {
                active.req.end.get_or_insert(End::Fail(super::protocol(
                    super::PlanKind::Decode,
                    "the step answered fewer rows than it had",
                )));
                continue;
            };
            let req = &mut active.req;
            if req.end.is_some() {
                // An over-run: the row had ended before this output was read.
                if fault == Some(PipelineFault::EmitOverRun) {
                    if let Some(token) = output.token {
                        req.push_token(token, now);
                    }
                    continue;
                }
                rollback(router, active, metrics, fault);
                continue;
            }
            let Some(argmax) = output.token else {
                req.end = Some(End::Fail(super::protocol(
                    super::PlanKind::Decode,
                    "a row that reached a token position has no token",
                )));
                continue;
            };
            if let Some(digest) = &mut req.digest {
                let bytes = scratch
                    .logit_bytes
                    .get(row * row_bytes..(row + 1) * row_bytes);
                match (&read_failed, bytes) {
                    (None, Some(bytes)) => digest.0.update(bytes),
                    (Some(err), _) => {
                        req.end = Some(End::Fail(ServeError::Device {
                            during: "ReadLogits",
                            source: err.clone(),
                        }));
                        continue;
                    }
                    (None, None) => {
                        req.end = Some(End::Fail(super::protocol(
                            super::PlanKind::Decode,
                            "the step's logits have fewer rows than it had",
                        )));
                        continue;
                    }
                }
            }
            let token = req.sampler.choose_with_argmax(argmax);
            metrics.generated_tokens += 1;
            req.push_token(token, now);
        }
        ids.clear();
        scratch.flight_ids = ids;
    }
}

/// The rows of a step, in row order: the requests named by `ids` (which keep their order in
/// `running`).
pub(super) fn in_order<'a, S>(
    running: &'a mut [Active<S>],
    ids: &'a [u64],
) -> impl Iterator<Item = &'a mut Active<S>> + 'a {
    let mut next = 0;
    running.iter_mut().filter(move |active| {
        if ids.get(next) == Some(&active.req.id) {
            next += 1;
            true
        } else {
            false
        }
    })
}

/// Undoes an over-run of `active` (whose output was discarded).
fn rollback<D: DeviceIo>(
    router: &Guarded<D>,
    active: &mut Active<D::Seq>,
    metrics: &mut crate::metrics::Metrics,
    fault: Option<PipelineFault>,
) {
    if fault.is_some() {
        return;
    }
    match router.apply(Effect::Rollback {
        seq: &mut active.seq,
    }) {
        Ok(_) => metrics.rollbacks += 1,
        Err(err) => {
            // The over-run stays in the sequence: it must never reach the prefix cache.
            tracing::warn!(id = active.req.id, %err, "Rollback failed; the row is not cached");
            metrics.rollback_failures += 1;
            active.no_cache = true;
        }
    }
}
