//! Workload replay: drives an [`Engine`] through a [`Workload`] with forced outputs and reports
//! what it took.
//!
//! Each turn becomes a [`Request::forced`] with the trace's input and recorded output, so later
//! turns share history exactly as the trace says while the model still computes every step. A
//! session's next turn is submitted only after its previous turn ended (its KV has been offered to
//! the prefix cache by then); at most `max_in_flight` turns run at once, taken in arrival order.
//! Arrival times order the turns; with [`ReplayOptions::pace`] they also hold each turn back
//! until its (scaled) arrival time, otherwise the replay is as fast as the engine goes.
//! Driving [`Engine::step`] on the caller's thread keeps a replay deterministic.
//!
//! With [`ReplayOptions::adapters`], sessions take those LoRA adapters (loaded in the engine)
//! round-robin in order of their first turn, and the report gives each adapter's prefix-cache
//! hit rate ([`AdapterHits`]).

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::time::{Duration, Instant};

use device_io::{DeviceIo, Sequence};
use serde::Serialize;

use crate::engine::Engine;
use crate::event::{Event, Usage};
use crate::handle::RequestHandle;
use crate::metrics::Metrics;
use crate::request::Request;
use crate::workload::{Turn, Workload};

/// How a replay runs.
#[derive(Debug, Clone, PartialEq)]
pub struct ReplayOptions {
    /// The most turns in flight at once (each from a different session); at least 1.
    pub max_in_flight: usize,
    /// Ask every request for its logits digest (host logits readback on every step).
    pub digests: bool,
    /// Pace arrivals: submit no turn before its `ts` (relative to the first turn's), divided by
    /// this speed-up (1.0 is real time). `None` replays as fast as the engine goes.
    pub pace: Option<f64>,
    /// LoRA adapters (ids loaded in the engine) the sessions take round-robin, in order of
    /// their first turn; empty: every turn runs on the base model.
    pub adapters: Vec<u32>,
}

impl Default for ReplayOptions {
    fn default() -> Self {
        ReplayOptions {
            max_in_flight: 16,
            digests: false,
            pace: None,
            adapters: Vec::new(),
        }
    }
}

/// One LoRA adapter's share of a replay.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct AdapterHits {
    /// The adapter's id.
    pub adapter: u32,
    /// Sessions that took it.
    pub sessions: usize,
    /// Their turns that completed.
    pub completed: usize,
    /// Prompt tokens of those turns.
    pub prompt_tokens: usize,
    /// Of those, tokens served from the prefix cache.
    pub cached_tokens: usize,
    /// `cached_tokens / prompt_tokens` (0 without prompt tokens).
    pub token_hit_rate: f64,
}

/// What happened to one turn.
#[derive(Debug, Clone, PartialEq)]
pub enum TurnOutcome {
    /// It completed.
    Done {
        /// What it used.
        usage: Usage,
        /// Its logits digest, when digests were on.
        digest: Option<u64>,
        /// The tokens it generated (the forced ones, unless it stopped early).
        tokens: Vec<u32>,
    },
    /// It was refused or failed; the message says why.
    Failed(String),
    /// It recorded no output, so there was nothing to replay.
    Skipped,
}

/// Counters the router keeps about its caches, when the backend can read them.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize)]
pub struct CacheStats {
    /// Prefix-cache lookups (one per first prefill chunk).
    pub lookups: u64,
    /// Tokens those lookups served from the cache.
    pub hit_tokens: u64,
    /// SSM checkpoints the Marconi store holds at the end of the run.
    pub checkpoints_held: u64,
    /// SSM checkpoints the Marconi store admitted during the run.
    pub checkpoints_taken: u64,
    /// Lookups the Marconi store answered with a checkpoint (SSM state restored).
    pub checkpoint_hits: u64,
    /// SSM checkpoints the Marconi store evicted during the run.
    pub checkpoints_evicted: u64,
    /// The Marconi store's eviction weight α at the end (`None` without a Marconi store).
    pub marconi_alpha: Option<f64>,
    /// Its recency basis at the end (`path`, `own`, `shared`, `adaptive`).
    pub marconi_recency: Option<&'static str>,
    /// Its FLOP basis at the end (`prefix`, `marginal`).
    pub marconi_flop_basis: Option<&'static str>,
    /// Whether its guarded admission was on at the end.
    pub marconi_guard: Option<bool>,
    /// How many times the Marconi tuner changed the setting during the run; `None` when no
    /// tuner ran (the Marconi policy off: eviction by recency, or no Marconi store).
    pub tuner_switches: Option<u64>,
    /// Checkpoint hits after which the router's MTP head is a cold run's (the head reran over
    /// positions the checkpoint marks, and every cached position before them is vouched for).
    /// This and the next three count only on a router that reruns the head at a hit.
    pub head_exact_hits: u64,
    /// Checkpoint hits on a marked checkpoint whose cached head K/V are not all right for the
    /// new sequence (the Marconi tree keeps blocks another sequence wrote): its drafts may
    /// differ from a cold run's (its output never does).
    pub head_unvouched_hits: u64,
    /// Checkpoint hits on a checkpoint the head did not mark: no rerun; the head is not a cold
    /// run's.
    pub head_unmarked_hits: u64,
    /// Checkpoint hits on a marked checkpoint whose rerun's block copies the pool could not hold
    /// beside a longest sequence: no rerun (a hit never needs more blocks than no hit); the
    /// head is not a cold run's.
    pub head_skipped_hits: u64,
}

/// The replay's report (the `--json` output of the `replay` example).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ReplayReport {
    /// The workload's name.
    pub workload: String,
    /// Turns in the workload (after `--max-requests`).
    pub requests: usize,
    /// Turns that completed.
    pub completed: usize,
    /// Turns refused or failed.
    pub failed: usize,
    /// Turns without recorded output (not submitted).
    pub skipped: usize,
    /// Input tokens of the submitted turns.
    pub input_tokens: usize,
    /// Output tokens generated.
    pub output_tokens: usize,
    /// Prompt tokens the router computed.
    pub prefill_tokens_computed: u64,
    /// Prompt tokens served from the prefix cache.
    pub prefill_tokens_cached: u64,
    /// `cached / (cached + computed)`.
    pub token_hit_rate: f64,
    /// Requests (first prefill chunks) served partly from the cache; on a hybrid model each
    /// restored a Marconi checkpoint.
    pub prefix_hits: u64,
    /// `MarconiCheckpoint` effects the engine applied after decode steps.
    pub marconi_checkpoint_effects: u64,
    /// The router's own cache counters, when known.
    pub cache: Option<CacheStats>,
    /// Time to first token, median, in milliseconds.
    pub ttft_p50_ms: f64,
    /// Time to first token, 95th percentile, in milliseconds.
    pub ttft_p95_ms: f64,
    /// Time per output token, median, in milliseconds.
    pub tpot_p50_ms: f64,
    /// Time per output token, 95th percentile, in milliseconds.
    pub tpot_p95_ms: f64,
    /// Wall time of the replay in seconds.
    pub wall_s: f64,
    /// Generated tokens per second of wall time.
    pub output_tokens_per_s: f64,
    /// Prompt tokens (computed or cached) plus generated tokens per second of wall time.
    pub total_tokens_per_s: f64,
    /// Preemptions.
    pub preemptions: u64,
    /// Preemptions by spill.
    pub spills: u64,
    /// Restores from the spill store.
    pub restores: u64,
    /// Preemptions by recompute.
    pub recomputes: u64,
    /// Engine steps.
    pub steps: u64,
    /// Mean rows per decode step.
    pub mean_decode_batch: f64,
    /// Decode steps launched ahead of the host (`DecodeFed`, depth 2).
    pub fed_steps: u64,
    /// Steps that found a step in flight and could not run ahead (depth 2; see the engine's
    /// drain rule).
    pub pipeline_drains: u64,
    /// Over-runs rolled back (rows that stopped or were cancelled while their next step ran).
    pub rollbacks: u64,
    /// Each LoRA adapter's sessions and prefix-cache hit rate (empty without adapters).
    pub adapters: Vec<AdapterHits>,
    /// Speculative decoding: verification steps (target steps of the batch).
    pub verify_steps: u64,
    /// Speculative decoding: drafts verified.
    pub drafted: u64,
    /// Speculative decoding: drafts accepted.
    pub accepted: u64,
    /// `accepted / drafted` (0 without drafts).
    pub acceptance_rate: f64,
    /// Accepted drafts per row that carried drafts (mean accepted length).
    pub mean_accepted_length: f64,
    /// Tokens emitted per target step of a row that carried drafts (1 without speculation).
    pub tokens_per_target_step: f64,
    /// Speculative decoding: `Draft` steps of the router's MTP head that settled.
    pub draft_steps: u64,
    /// Speculative decoding: `Draft` steps the router refused (those steps verified without
    /// drafts).
    pub draft_failures: u64,
    /// Speculative decoding: rows a settled `Draft` proposed nothing for though they had a
    /// budget (the head had no catch-up state for them); each costs a row's drafts for a step.
    pub draft_misses: u64,
}

/// A finished replay: the report and every turn's outcome (in workload order).
#[derive(Debug, Clone, PartialEq)]
pub struct Replay {
    /// The summary.
    pub report: ReplayReport,
    /// One outcome per turn of the workload, in its order.
    pub outcomes: Vec<TurnOutcome>,
}

impl Replay {
    /// Every turn's digest (`None` for turns without one), in workload order.
    pub fn digests(&self) -> Vec<Option<u64>> {
        self.outcomes
            .iter()
            .map(|outcome| match outcome {
                TurnOutcome::Done { digest, .. } => *digest,
                _ => None,
            })
            .collect()
    }
}

struct InFlight {
    turn: usize,
    handle: RequestHandle,
    tokens: Vec<u32>,
}

/// Replays `workload` on `engine`; `on_turn` is called once per turn as it ends.
pub fn replay<D>(
    engine: &mut Engine<D>,
    workload: &Workload,
    options: &ReplayOptions,
    on_turn: &mut dyn FnMut(usize, &TurnOutcome),
) -> Replay
where
    D: DeviceIo,
    D::Seq: Sequence,
{
    let started = Instant::now();
    let before = *engine.metrics();
    let turns = &workload.turns;
    // Each session's turns in arrival order; `ready` holds each idle session's next turn, so the
    // earliest ready turn (by index, i.e. arrival) is always `ready.first()`.
    let mut queues: HashMap<u64, VecDeque<usize>> = HashMap::new();
    for (index, turn) in turns.iter().enumerate() {
        queues.entry(turn.session).or_default().push_back(index);
    }
    let mut ready: BTreeSet<usize> = queues
        .values_mut()
        .filter_map(VecDeque::pop_front)
        .collect();
    let session_adapters = assign_adapters(workload, &options.adapters);
    let mut outcomes: Vec<Option<TurnOutcome>> = vec![None; turns.len()];
    let mut in_flight: Vec<InFlight> = Vec::new();
    let max_in_flight = options.max_in_flight.max(1);
    let first_ts = turns.iter().map(|t| t.ts).fold(f64::INFINITY, f64::min);
    loop {
        while in_flight.len() < max_in_flight {
            let Some(&turn_index) = ready.first() else {
                break;
            };
            if let Some(wait) = not_yet_due(&turns[turn_index], first_ts, options.pace, started) {
                if !in_flight.is_empty() {
                    break;
                }
                std::thread::sleep(wait);
            }
            ready.remove(&turn_index);
            let turn = &turns[turn_index];
            let outcome = if turn.output.is_empty() {
                TurnOutcome::Skipped
            } else {
                let mut request = Request::forced(turn.input.clone(), turn.output.clone())
                    .with_logits_digest(options.digests);
                request.adapter = session_adapters.get(&turn.session).copied();
                match engine.submit(request) {
                    Ok(handle) => {
                        in_flight.push(InFlight {
                            turn: turn_index,
                            handle,
                            tokens: Vec::with_capacity(turn.output.len()),
                        });
                        continue;
                    }
                    Err(err) => TurnOutcome::Failed(err.to_string()),
                }
            };
            // Not submitted: the session's next turn is ready at once.
            on_turn(turn_index, &outcome);
            outcomes[turn_index] = Some(outcome);
            ready.extend(queues.get_mut(&turn.session).and_then(VecDeque::pop_front));
        }
        if in_flight.is_empty() {
            break;
        }
        engine.step();
        let mut index = 0;
        while index < in_flight.len() {
            let flight = &mut in_flight[index];
            let mut outcome = None;
            while let Ok(event) = flight.handle.events().try_recv() {
                match event {
                    Event::Token(token) => flight.tokens.push(token),
                    Event::Finished {
                        usage,
                        logits_digest,
                        ..
                    } => {
                        outcome = Some(TurnOutcome::Done {
                            usage,
                            digest: logits_digest,
                            tokens: std::mem::take(&mut flight.tokens),
                        });
                    }
                    Event::Error(err) => outcome = Some(TurnOutcome::Failed(err.to_string())),
                }
            }
            match outcome {
                Some(outcome) => {
                    let flight = in_flight.remove(index);
                    let session = turns[flight.turn].session;
                    ready.extend(queues.get_mut(&session).and_then(VecDeque::pop_front));
                    on_turn(flight.turn, &outcome);
                    outcomes[flight.turn] = Some(outcome);
                }
                None => index += 1,
            }
        }
    }
    let wall = started.elapsed();
    let outcomes: Vec<TurnOutcome> = outcomes
        .into_iter()
        .map(|outcome| outcome.unwrap_or(TurnOutcome::Skipped))
        .collect();
    let mut report = summarize(workload, &outcomes, &engine.metrics().since(&before), wall);
    report.adapters = adapter_hits(workload, &outcomes, &options.adapters, &session_adapters);
    Replay { report, outcomes }
}

/// Each session's adapter: `adapters` round-robin over the sessions in order of their first
/// turn (none when `adapters` is empty).
fn assign_adapters(workload: &Workload, adapters: &[u32]) -> HashMap<u64, u32> {
    let mut assigned = HashMap::new();
    if adapters.is_empty() {
        return assigned;
    }
    for turn in &workload.turns {
        let next = adapters[assigned.len() % adapters.len()];
        assigned.entry(turn.session).or_insert(next);
    }
    assigned
}

/// Each adapter's sessions, completed turns and prefix-cache hits, in the order of `adapters`.
fn adapter_hits(
    workload: &Workload,
    outcomes: &[TurnOutcome],
    adapters: &[u32],
    session_adapters: &HashMap<u64, u32>,
) -> Vec<AdapterHits> {
    adapters
        .iter()
        .map(|&adapter| {
            let mut hits = AdapterHits {
                adapter,
                sessions: session_adapters.values().filter(|&&a| a == adapter).count(),
                completed: 0,
                prompt_tokens: 0,
                cached_tokens: 0,
                token_hit_rate: 0.0,
            };
            for (turn, outcome) in workload.turns.iter().zip(outcomes) {
                if session_adapters.get(&turn.session) != Some(&adapter) {
                    continue;
                }
                if let TurnOutcome::Done { usage, .. } = outcome {
                    hits.completed += 1;
                    hits.prompt_tokens += usage.prompt_tokens;
                    hits.cached_tokens += usage.cached_tokens;
                }
            }
            if hits.prompt_tokens > 0 {
                hits.token_hit_rate = hits.cached_tokens as f64 / hits.prompt_tokens as f64;
            }
            hits
        })
        .collect()
}

/// How long until `turn` is due under `pace` (`None` when it is due now or pacing is off).
fn not_yet_due(
    turn: &Turn,
    first_ts: f64,
    pace: Option<f64>,
    started: Instant,
) -> Option<Duration> {
    let speed = pace.filter(|speed| *speed > 0.0)?;
    let due = Duration::try_from_secs_f64((turn.ts - first_ts) / speed).ok()?;
    due.checked_sub(started.elapsed())
        .filter(|wait| !wait.is_zero())
}

fn summarize(
    workload: &Workload,
    outcomes: &[TurnOutcome],
    metrics: &Metrics,
    wall: Duration,
) -> ReplayReport {
    let mut ttft = Vec::new();
    let mut tpot = Vec::new();
    let (mut completed, mut failed, mut skipped) = (0, 0, 0);
    let mut input_tokens = 0;
    let mut output_tokens = 0;
    for (turn, outcome) in workload.turns.iter().zip(outcomes) {
        match outcome {
            TurnOutcome::Done { usage, .. } => {
                completed += 1;
                input_tokens += turn.input.len();
                output_tokens += usage.generated_tokens;
                ttft.extend(usage.time_to_first_token);
                tpot.extend(usage.time_per_output_token);
            }
            TurnOutcome::Failed(_) => {
                failed += 1;
                input_tokens += turn.input.len();
            }
            TurnOutcome::Skipped => skipped += 1,
        }
    }
    let prefill = metrics.prefill_tokens_cached + metrics.prefill_tokens_computed;
    let seconds = wall.as_secs_f64().max(f64::MIN_POSITIVE);
    ReplayReport {
        workload: workload.name.clone(),
        requests: workload.turns.len(),
        completed,
        failed,
        skipped,
        input_tokens,
        output_tokens,
        prefill_tokens_computed: metrics.prefill_tokens_computed,
        prefill_tokens_cached: metrics.prefill_tokens_cached,
        token_hit_rate: if prefill == 0 {
            0.0
        } else {
            metrics.prefill_tokens_cached as f64 / prefill as f64
        },
        prefix_hits: metrics.prefix_hits,
        marconi_checkpoint_effects: metrics.marconi_checkpoints,
        cache: None,
        ttft_p50_ms: percentile_ms(&mut ttft, 50),
        ttft_p95_ms: percentile_ms(&mut ttft, 95),
        tpot_p50_ms: percentile_ms(&mut tpot, 50),
        tpot_p95_ms: percentile_ms(&mut tpot, 95),
        wall_s: wall.as_secs_f64(),
        output_tokens_per_s: output_tokens as f64 / seconds,
        total_tokens_per_s: (prefill as f64 + output_tokens as f64) / seconds,
        preemptions: metrics.preemptions,
        spills: metrics.spills,
        restores: metrics.restores,
        recomputes: metrics.recomputes,
        steps: metrics.steps,
        mean_decode_batch: if metrics.decode_launches == 0 {
            0.0
        } else {
            metrics.decode_rows as f64 / metrics.decode_launches as f64
        },
        fed_steps: metrics.fed_launches,
        pipeline_drains: metrics.pipeline_drains,
        rollbacks: metrics.rollbacks,
        adapters: Vec::new(),
        verify_steps: metrics.verify_launches,
        drafted: metrics.drafted,
        accepted: metrics.accepted,
        acceptance_rate: ratio(metrics.accepted, metrics.drafted),
        mean_accepted_length: ratio(metrics.accepted, metrics.spec_rows),
        tokens_per_target_step: ratio(metrics.spec_tokens, metrics.spec_rows),
        draft_steps: metrics.draft_launches,
        draft_failures: metrics.draft_failures,
        draft_misses: metrics.draft_misses,
    }
}

/// `a / b`, 0 when `b` is 0.
fn ratio(a: u64, b: u64) -> f64 {
    if b == 0 {
        0.0
    } else {
        a as f64 / b as f64
    }
}

/// The nearest-rank percentile `p` of `values`, in milliseconds (0 when empty).
fn percentile_ms(values: &mut [Duration], p: usize) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    values.sort_unstable();
    let rank = (p * values.len()).div_ceil(100).clamp(1, values.len());
    values[rank - 1].as_secs_f64() * 1e3
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pacing_holds_a_turn_until_its_scaled_arrival() {
        let turn = |ts: f64| Turn {
            session: 0,
            turn: 0,
            ts,
            input: vec![1],
            output: vec![1],
            source_line: None,
        };
        let now = Instant::now();
        assert_eq!(not_yet_due(&turn(5.0), 5.0, Some(1.0), now), None);
        assert_eq!(not_yet_due(&turn(100.0), 0.0, None, now), None);
        let wait = not_yet_due(&turn(100.0), 0.0, Some(10.0), now).unwrap();
        assert!(wait > Duration::from_secs(9) && wait <= Duration::from_secs(10));
        let long_ago = now - Duration::from_secs(20);
        assert_eq!(not_yet_due(&turn(100.0), 0.0, Some(10.0), long_ago), None);
    }

    #[test]
    fn sessions_take_adapters_round_robin_in_order_of_first_turn() {
        let turn = |session: u64| Turn {
            session,
            turn: 0,
            ts: 0.0,
            input: vec![1],
            output: vec![1],
            source_line: None,
        };
        let workload = Workload {
            name: "w".to_string(),
            turns: [0, 1, 0, 2, 1, 3, 4].map(turn).to_vec(),
        };
        let assigned = assign_adapters(&workload, &[7, 8]);
        let expected: HashMap<u64, u32> = [(0, 7), (1, 8), (2, 7), (3, 8), (4, 7)].into();
        assert_eq!(assigned, expected);
        assert!(assign_adapters(&workload, &[]).is_empty());
        let usage = |prompt_tokens, cached_tokens| TurnOutcome::Done {
            usage: Usage {
                prompt_tokens,
                cached_tokens,
                ..Usage::default()
            },
            digest: None,
            tokens: vec![1],
        };
        let outcomes = [
            usage(10, 0),
            usage(10, 5),
            usage(20, 16),
            usage(8, 0),
            usage(30, 30),
            TurnOutcome::Failed("no".to_string()),
            usage(4, 0),
        ];
        let hits = adapter_hits(&workload, &outcomes, &[7, 8], &assigned);
        assert_eq!(
            hits.iter()
                .map(|h| (
                    h.adapter,
                    h.sessions,
                    h.completed,
                    h.prompt_tokens,
                    h.cached_tokens
                ))
                .collect::<Vec<_>>(),
            [(7, 3, 4, 42, 16), (8, 2, 2, 40, 35)]
        );
        assert_eq!(hits[1].token_hit_rate, 35.0 / 40.0);
    }

    #[test]
    fn percentiles_are_nearest_rank() {
        let mut values: Vec<Duration> = (1..=20).map(Duration::from_millis).collect();
        assert_eq!(percentile_ms(&mut values, 50), 10.0);
        assert_eq!(percentile_ms(&mut values, 95), 19.0);
        assert_eq!(percentile_ms(&mut [], 50), 0.0);
        assert_eq!(percentile_ms(&mut [Duration::from_millis(3)], 95), 3.0);
    }
}
