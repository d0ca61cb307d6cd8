//! Speculative decoding: the decode step of an engine with [`Speculation`] configured.
//!
//! # One step
//!
//! 1. **Drafts.** Every live row whose prompt is complete may speculate (greedy, randomly
//!    sampled, or forced: a replayed turn, whose drafts are accepted while they equal its
//!    recorded tokens), `k_i = min(k, max_tokens - generated - 1)` drafts (fewer near the
//!    context's end), as long as the snapshot ring has `k` slots for it (`ring_slots / k` rows per
//!    step). The drafter proposes them once per step: [`Drafter::Mtp`] launches
//!    [`StepPlan::Draft`] (the router's MTP head; a row whose head has no catch-up state drafts
//!    nothing, and a refused draft step only costs this step's drafts); [`Drafter::Known`]
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
//!    hidden state and one [`Effect::SyncSecondary`] follows.
//!
//! Greedy output is therefore bit-identical to plain decoding; the tests in
//! `tests/tests/engine_speculative.rs` check tokens and logits digests on both MTP fixtures for
//! k = 1..4, with caches on and off, mixed batches, preemption by spill and recompute, and
//! cancellation, with every block and slot back at the end; and that a planted bug (skipping the
//! SSM restore) is caught.
//!
//! Speculation runs at depth 1: an engine with it never starts a flight (a pipelined router is
//! used synchronously).

use std::sync::Arc;
use std::time::Instant;

use device_io::{
    DeviceError, DeviceIo, Effect, Readback, RowOutput, Sequence, StepPlan, StepResult,
};

use super::{choose_token, recycle, End, Engine, PlanKind};
use crate::event::ServeError;

/// The most drafts per row and step.
pub const MAX_DRAFTS: usize = 8;

/// Speculative decoding, engine-wide (see the module docs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Speculation {
    /// Drafts per speculating row and step, `1..=MAX_DRAFTS`.
    pub k: usize,
    /// Who proposes the drafts.
    pub drafter: Drafter,
    /// Snapshot ring slots of the router (at least `k`); a step speculates on at most
    /// `ring_slots / k` rows.
    pub ring_slots: usize,
}

impl Speculation {
    /// `k` drafts per step from the router's MTP head, with `ring_slots` snapshot slots.
    pub fn mtp(k: usize, ring_slots: usize) -> Self {
        Speculation {
            k,
            drafter: Drafter::Mtp,
            ring_slots,
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
}

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

    /// The decode step of an engine with speculation: drafts, then a verification relaunched
    /// without a victim on a dry pool, then acceptance and rollback. Answers the rows settled.
    pub(super) fn speculative_decode(&mut self, spec: &Speculation) -> usize {
        self.propose(spec);
        loop {
            if self.router.lost().is_some() {
                return 0;
            }
            let (rows, wants_logits) = self.mark_rows(PlanKind::Decode, 0);
            if rows == 0 {
                return 0;
            }
            match self.launch_verify(wants_logits) {
                Ok(step) => {
                    self.accept_verify(spec, step);
                    return rows;
                }
                Err(
                    err @ (DeviceError::KvExhausted { .. } | DeviceError::SlotsExhausted { .. }),
                ) => {
                    if !self.make_room(PlanKind::Decode, err) {
                        return 0;
                    }
                }
                Err(DeviceError::DeviceLost(message)) => {
                    self.fail_plan_rows(|| ServeError::DeviceLost(message.clone()));
                    return 0;
                }
                Err(err) => {
                    tracing::warn!(%err, "verification failed; failing its rows");
                    self.fail_plan_rows(|| ServeError::Device {
                        during: "Verify",
                        source: err.clone(),
                    });
                    return 0;
                }
            }
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

    /// Fills every live row's `drafts` for this step.
    fn propose(&mut self, spec: &Speculation) {
        let k = spec.k;
        let mut budgets = Vec::with_capacity(self.running.len());
        let mut rows_left = spec.ring_slots / k.max(1);
        for index in 0..self.running.len() {
            let budget = if rows_left > 0 {
                self.draft_budget(index, k)
            } else {
                0
            };
            rows_left -= usize::from(budget > 0);
            budgets.push(budget);
            self.running[index].drafts.clear();
        }
        match &spec.drafter {
            Drafter::Known { sequences, wrong } => {
                let vocab = self.limits.vocab_size.max(1) as u32;
                for (active, &budget) in self.running.iter_mut().zip(&budgets) {
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
                            .map(|&t| if *wrong { (t + 1) % vocab } else { t }),
                    );
                }
            }
            Drafter::Mtp => self.propose_mtp(k, &budgets),
        }
    }

    /// One `Draft` of `k` tokens over the rows with a budget (and the context room for `k`).
    fn propose_mtp(&mut self, k: usize, budgets: &[usize]) {
        let max_context = self.limits.max_context;
        let Engine {
            router,
            running,
            scratch,
            metrics,
            ..
        } = self;
        scratch.tokens.clear();
        let mut rows: Vec<&mut D::Seq> = recycle(std::mem::take(&mut scratch.rows));
        let mut drafting = Vec::new();
        for (index, (active, &budget)) in running.iter_mut().zip(budgets).enumerate() {
            if budget == 0 || active.seq.computed_len() + k > max_context {
                continue;
            }
            let Some(&last) = active.req.tokens.last() else {
                continue;
            };
            scratch.tokens.push(last);
            drafting.push((index, budget));
            rows.push(&mut active.seq);
        }
        let result = if rows.is_empty() {
            None
        } else {
            let plan = StepPlan::Draft {
                tokens: &scratch.tokens,
                k,
            };
            Some(
                router
                    .launch(plan, &mut rows)
                    .and_then(|ticket| router.await_result(ticket)),
            )
        };
        scratch.rows = recycle(rows);
        match result {
            None => {}
            Some(Ok(step)) => {
                metrics.draft_launches += 1;
                for ((index, budget), output) in drafting.into_iter().zip(&step.rows) {
                    let Some(run) = output.run else { continue };
                    let Some(drafts) = step.tokens.get(run.start..run.start + run.len) else {
                        continue;
                    };
                    let take = drafts.len().min(budget);
                    running[index].drafts.extend_from_slice(&drafts[..take]);
                }
            }
            Some(Err(err)) => {
                // Only this step's drafts are lost; the verification decodes plainly.
                tracing::debug!(%err, "draft step refused; decoding without drafts");
                metrics.draft_failures += 1;
            }
        }
    }

    /// Launches and settles the verification of the marked rows.
    fn launch_verify(&mut self, wants_logits: bool) -> Result<StepResult<D::Ptr>, DeviceError> {
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
            slots.extend(slot_start..slot_start + active.drafts.len());
            any_drafts |= !active.drafts.is_empty();
            spans.push((start..flat.len(), slot_start..slots.len()));
        }
        let inputs: Vec<&[u32]> = spans.iter().map(|(t, _)| &flat[t.clone()]).collect();
        let snapshot_lists: Vec<&[usize]> = spans.iter().map(|(_, s)| &slots[s.clone()]).collect();
        let snapshots: &[&[usize]] = if any_drafts { &snapshot_lists } else { &[] };
        let mut rows: Vec<&mut D::Seq> = recycle(std::mem::take(&mut scratch.rows));
        rows.extend(running.iter_mut().filter(|a| a.in_plan).map(|a| &mut a.seq));
        let readback = if wants_logits {
            Readback::HostLogits {
                into: &mut scratch.logits,
            }
        } else {
            Readback::Argmax
        };
        let plan = StepPlan::Verify {
            inputs: &inputs,
            snapshots,
            readback,
        };
        let result = router
            .launch(plan, &mut rows)
            .and_then(|ticket| router.await_result(ticket));
        scratch.rows = recycle(rows);
        result
    }

    /// Takes a settled verification into its rows: tokens, stop conditions, truncation, SSM
    /// restore and the MTP head's catch-up.
    fn accept_verify(&mut self, spec: &Speculation, step: StepResult<D::Ptr>) {
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
        let mut slot_base = 0;
        for active in running.iter_mut().filter(|a| a.in_plan) {
            let req = &mut active.req;
            let drafts = std::mem::take(&mut active.drafts);
            let d = drafts.len();
            let slots = slot_base..slot_base + d;
            slot_base += d;
            let Some((row, output)) = outputs.next() else {
                req.end = Some(End::Fail(super::protocol(
                    PlanKind::Decode,
                    "the step answered fewer rows than it had",
                )));
                continue;
            };
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
            let c = active.seq.computed_len() - (d + 1);
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
                    choose_token(req, &position, &scratch.logits, vocab, &mut scratch.sample)
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
                Ok(_) if keep < c + d + 1 && fault != Some(SpecFault::SkipSsmRestore) => {
                    let slot = slots.start + (keep - c - 1);
                    router
                        .apply(Effect::SsmSnapshotRestore {
                            seq: &mut active.seq,
                            slot,
                        })
                        .map(|_| ())
                        .map_err(|err| ("SsmSnapshotRestore", err))
                }
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
        }
        if mdrafter {
            if let Err(err) = router.apply(Effect::SyncSecondary) {
                tracing::debug!(%err, "SyncSecondary refused");
            }
        }
    }
}
