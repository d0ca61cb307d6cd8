//! The soak: load, memory pressure and faults through the public API (`EngineThread`, its
//! clients and request handles), with the invariants a careful user of a serving engine relies
//! on checked at the end of every run.
//!
//! A run generates a seeded workload (prompts sharing prefixes, so the prefix cache and Marconi
//! checkpoints are used; later turns of earlier requests' conversations, whose prompts replay
//! the earlier prompt and output, so they hit blocks and states another request wrote; random
//! `max_tokens`; stop tokens; a share of requests cancelled mid-stream and a share of handles
//! dropped unread), serves it from several client threads at once, and counts:
//!
//! - **lost final events**: accepted requests whose stream ended without exactly one `Finished`
//!   or `Error` as its last event (or with anything after it);
//! - **mismatches**: completed greedy requests whose tokens differ from the same prompt served
//!   alone (on the host router: a fresh engine with both caches off; on the scripted router: its
//!   deterministic answer), and cancelled ones whose tokens are not a prefix of that;
//! - **leaked blocks and slots**: at idle, after the prefix cache is cleared, KV blocks not free,
//!   live slots in use, and orphans;
//! - **bystander failures**: requests that failed although no injected fault hit them;
//! - **fed steps served over a failure**: depth-2 fed steps that read a row of a step that then
//!   failed, which the router served anyway (the contract fails them too; [`Chaos`] counts both).
//!
//! A run's requests reach the engine from client threads while it steps, or all before it
//! steps ([`Submission`]); then, without cancels, nothing the engine sees depends on timing and
//! a run repeats exactly.
//!
//! Every feature a user may serve under load can be switched on ([`RouterOptions`],
//! [`WorkloadOptions`]): the host router or the CUDA router on its host runtime (`SimRuntime`),
//! pipeline depth 2, speculative decoding (the router's MTP head, or drafters in the core that
//! know the reference output: perfect or always wrong), seeded randomly sampled rows, and LoRA
//! adapters (loaded before the run, requests bound at random). The reference stays the request
//! served alone on a fresh engine over the same router with both caches off, at depth 1, without
//! speculation, with the same adapter and the same seed; the engine promises those outputs bit
//! for bit (a row's logits do not depend on its batch, its chunking, a prefix hit, a spill, the
//! depth or speculation, and a sampled row draws from its own seeded stream once per emitted
//! token, so a sampled row's tokens are the same as alone, not merely alike in distribution).
//!
//! `tests/tests/soak.rs` runs small versions in CI; `cargo xtask soak` runs the full one (2,000
//! requests from 8 clients) and prints one JSON object per run, then one with the totals.

use std::collections::{BTreeSet, HashMap};
use std::ops::RangeInclusive;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use device_io::{
    DeviceError, DeviceFacts, DeviceIo, Effect, EffectOutcome, Feed, LoraError, Phase, Sequence,
    StepPlan, StepResult, Ticket,
};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use scheduler::backend::{self, BackendOptions, Device, StepFaults};
use scheduler::{
    Drafter, EngineClient, EngineConfig, EngineThread, Event, FinishReason, LoraCommand,
    RandomSampling, Request, Sampling, ServeError, ShutdownMode, SpecOverlap, Speculation,
};
use serde::Serialize;

/// The shape of a generated workload.
#[derive(Debug, Clone)]
pub struct WorkloadOptions {
    /// Requests in all.
    pub requests: usize,
    /// Client threads submitting them (each serves its share one request at a time).
    pub clients: usize,
    /// Prompt lengths.
    pub prompt_len: RangeInclusive<usize>,
    /// `max_tokens`.
    pub max_tokens: RangeInclusive<usize>,
    /// Percent of requests cancelled after their first tokens.
    pub cancel_percent: u32,
    /// Percent of requests whose handle is dropped right after submission.
    pub drop_percent: u32,
    /// Shared prefixes the prompts start from.
    pub prefixes: usize,
    /// Token ids are below this.
    pub vocab_size: u32,
    /// Percent of requests sampled at random (temperature, top-k, top-p and min-p drawn per
    /// request, each with its own seed); the rest are greedy.
    pub sampled_percent: u32,
    /// LoRA adapters loaded for the run (ids `1..=adapters`); each request names one of them or
    /// none, at random. Zero: no adapter.
    pub adapters: u32,
    /// Percent of requests that ask for a logits digest (host logits for the steps they are
    /// in), compared bit for bit with the reference's.
    pub digest_percent: u32,
    /// While the clients run, one more thread asks the engine for something every this many
    /// milliseconds, in turn: to clear its prefix cache, and on the host router a LoRA command
    /// (each drains a step in flight): with adapters, loading one more (id `adapters + 1`) and
    /// unloading it; without, listing them. Zero: none.
    pub command_every_ms: u64,
    /// Abort the engine (`ShutdownMode::Abort`) this many milliseconds into the run, with
    /// requests waiting, running and in flight, instead of draining it at idle. Zero: drain.
    pub abort_after_ms: u64,
    /// Percent of requests that are a later turn of an earlier request's conversation: its
    /// prompt is that request's prompt and output (served alone) and a few new tokens, with
    /// its adapter, submitted by the same client after it ended; the prefix cache and Marconi
    /// checkpoints then hit on blocks and states another request wrote.
    pub followup_percent: u32,
    /// Percent of requests with a stop token: one their output served alone without it
    /// generates (at a random place), so they end there.
    pub stop_percent: u32,
    /// When the requests reach the engine.
    pub submission: Submission,
    /// Seed of everything random.
    pub seed: u64,
}

/// What a client does with a request's stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Action {
    Read,
    /// Cancel after this many tokens.
    Cancel(usize),
    Drop,
}

#[derive(Debug, Clone)]
struct Planned {
    prompt: Vec<u32>,
    max_tokens: usize,
    action: Action,
    /// Random sampling (else greedy).
    sampling: Option<RandomSampling>,
    /// The LoRA adapter it is served with.
    adapter: Option<u32>,
    /// Whether it asks for a logits digest.
    digest: bool,
    /// Its stop tokens ([`alone`] writes them).
    stop: Vec<u32>,
    /// Whether it gets a stop token, and where in its output (a random draw).
    stop_draw: Option<u64>,
    /// A later turn of request `parent`'s conversation: its prompt is `parent`'s prompt and
    /// output served alone, then `new` ([`complete_turn`] writes it).
    turn: Option<Turn>,
}

/// A later turn of a conversation.
#[derive(Debug, Clone)]
struct Turn {
    parent: usize,
    new: Vec<u32>,
}

impl Planned {
    /// The request a client submits (and the reference serves alone).
    fn request(&self) -> Request {
        let mut request = Request::greedy(self.prompt.clone(), self.max_tokens);
        if let Some(params) = self.sampling {
            request = request.with_sampling(Sampling::Random(params));
        }
        if let Some(adapter) = self.adapter {
            request = request.with_adapter(adapter);
        }
        if !self.stop.is_empty() {
            request = request.with_stop_tokens(self.stop.clone());
        }
        request.with_logits_digest(self.digest)
    }
}

/// A later turn's prompt: its parent's `prompt` and `output` (served alone), then `new` tokens,
/// as many as fit `max_context` with `max_tokens`; `None` when not one fits (the turn then
/// starts afresh from its new tokens alone, and is no later turn).
fn turn_prompt(
    (prompt, output): (&[u32], &[u32]),
    new: &[u32],
    max_tokens: usize,
    max_context: usize,
) -> Option<Vec<u32>> {
    let held = prompt.len() + output.len();
    let room = max_context.saturating_sub(held + max_tokens);
    (room > 0).then(|| {
        let mut turn = prompt.to_vec();
        turn.extend_from_slice(output);
        turn.extend(new.iter().take(room));
        turn
    })
}

/// The client that serves each request: a later turn goes to its parent's client (which
/// submits it after the parent ended), the others in turn.
fn lanes(planned: &[Planned], clients: usize) -> Vec<usize> {
    let mut lanes: Vec<usize> = Vec::with_capacity(planned.len());
    for (index, item) in planned.iter().enumerate() {
        let lane = match &item.turn {
            Some(turn) => lanes[turn.parent],
            None => index % clients,
        };
        lanes.push(lane);
    }
    lanes
}

/// Sampling parameters for one request: each filter on or off at random, so every path of the
/// sampler (top-k of 1 included, which leaves one candidate) meets speculation and batching.
fn random_sampling(rng: &mut ChaCha8Rng) -> RandomSampling {
    const TEMPERATURES: [f32; 3] = [0.6, 1.0, 1.5];
    const TOP_K: [Option<usize>; 3] = [None, Some(1), Some(40)];
    RandomSampling {
        temperature: TEMPERATURES[rng.random_range(0..TEMPERATURES.len())],
        top_k: TOP_K[rng.random_range(0..TOP_K.len())],
        top_p: if rng.random_bool(0.5) { 1.0 } else { 0.9 },
        min_p: if rng.random_bool(0.5) { 0.0 } else { 0.05 },
        seed: rng.random(),
    }
}

/// A seeded workload: prompts share prefixes, so caches have something to hit. Sampling and
/// adapters are drawn from a stream of their own, so switching them on leaves the prompts,
/// lengths and actions of a seed as they were.
fn plan(options: &WorkloadOptions) -> Vec<Planned> {
    let mut features = ChaCha8Rng::seed_from_u64(options.seed ^ 0x5A3D_1E0A_F00D);
    let mut planned = plan_prompts(options);
    for item in &mut planned {
        if features.random_range(0..100) < options.sampled_percent {
            item.sampling = Some(random_sampling(&mut features));
        }
        if options.adapters > 0 {
            let adapter = features.random_range(0..=options.adapters);
            item.adapter = (adapter > 0).then_some(adapter);
        }
        item.digest = features.random_range(0..100) < options.digest_percent;
        if features.random_range(0..100) < options.stop_percent {
            item.stop_draw = Some(features.random());
        }
    }
    // A conversation keeps its adapter.
    for index in 0..planned.len() {
        if let Some(turn) = &planned[index].turn {
            planned[index].adapter = planned[turn.parent].adapter;
        }
    }
    planned
}

/// The prompts, lengths and actions of [`plan`].
fn plan_prompts(options: &WorkloadOptions) -> Vec<Planned> {
    let mut rng = ChaCha8Rng::seed_from_u64(options.seed);
    let longest = *options.prompt_len.end();
    let prefixes: Vec<Vec<u32>> = (0..options.prefixes.max(1))
        .map(|_| {
            (0..longest)
                .map(|_| rng.random_range(0..options.vocab_size))
                .collect()
        })
        .collect();
    let mut planned: Vec<Planned> = (0..options.requests)
        .map(|_| {
            let len = rng.random_range(options.prompt_len.clone());
            let base = &prefixes[rng.random_range(0..prefixes.len())];
            let shared = rng.random_range(0..=len);
            let mut prompt = base[..shared].to_vec();
            prompt.extend((shared..len).map(|_| rng.random_range(0..options.vocab_size)));
            let max_tokens = rng.random_range(options.max_tokens.clone());
            let roll = rng.random_range(0..100);
            let action = if roll < options.drop_percent {
                Action::Drop
            } else if roll < options.drop_percent + options.cancel_percent {
                Action::Cancel(rng.random_range(1..=max_tokens.max(1)))
            } else {
                Action::Read
            };
            Planned {
                prompt,
                max_tokens,
                action,
                sampling: None,
                adapter: None,
                digest: false,
                stop: Vec::new(),
                stop_draw: None,
                turn: None,
            }
        })
        .collect();
    // Later turns, from a stream of their own (so switching them on leaves the other requests
    // of a seed as they were): the parent is one of the 16 requests before, its new tokens a
    // fresh user message of up to a quarter of the longest prompt.
    let mut turns = ChaCha8Rng::seed_from_u64(options.seed ^ 0x7E2A_C0DE);
    for (index, item) in planned.iter_mut().enumerate().skip(1) {
        if turns.random_range(0..100) >= options.followup_percent {
            continue;
        }
        let parent = turns.random_range(index.saturating_sub(16)..index);
        let len = turns.random_range(1..=(longest / 4).max(1));
        let new = (0..len)
            .map(|_| turns.random_range(0..options.vocab_size))
            .collect();
        item.turn = Some(Turn { parent, new });
    }
    planned
}

/// How one request ended, as its client saw it.
#[derive(Debug, Clone, PartialEq)]
enum Outcome {
    /// Its tokens and logits digest, and whether it ended on a stop token.
    Completed(Vec<u32>, Option<u64>, bool),
    Cancelled(Vec<u32>),
    Failed(String),
    Refused(String),
    /// Failed or refused because the engine was shut down (an abort run's expected end).
    Stopped,
    Dropped,
    /// The stream ended without a proper final event (none, or events after it).
    Lost,
}

#[derive(Debug, Clone)]
struct Served {
    id: Option<u64>,
    planned: Planned,
    outcome: Outcome,
}

/// Reads a stream to its end; answers the outcome (`Lost` unless exactly one final event came
/// last).
fn read_stream(handle: &scheduler::RequestHandle, cancel_after: Option<usize>) -> Outcome {
    let mut tokens = Vec::new();
    let mut outcome = None;
    let mut cancelled = false;
    // The stream ends when the engine drops the request after its final event.
    while let Ok(event) = handle.events().recv() {
        if outcome.is_some() {
            return Outcome::Lost;
        }
        match event {
            Event::Token(token) => {
                tokens.push(token);
                if !cancelled && cancel_after.is_some_and(|n| tokens.len() >= n) {
                    handle.cancel();
                    cancelled = true;
                }
            }
            Event::Finished {
                reason: FinishReason::Cancelled,
                ..
            } => outcome = Some(Outcome::Cancelled(std::mem::take(&mut tokens))),
            Event::Finished {
                logits_digest,
                reason,
                ..
            } => {
                outcome = Some(Outcome::Completed(
                    std::mem::take(&mut tokens),
                    logits_digest,
                    matches!(reason, FinishReason::Stop(_)),
                ))
            }
            Event::Error(ServeError::Shutdown | ServeError::EngineStopped) => {
                outcome = Some(Outcome::Stopped)
            }
            Event::Error(err) => outcome = Some(Outcome::Failed(err.to_string())),
        }
    }
    outcome.unwrap_or(Outcome::Lost)
}

/// What a control thread asks of the engine while the clients run.
#[derive(Debug, Clone)]
enum ControlOp {
    /// A LoRA command (run at quiescence: it drains a step in flight).
    Lora(LoraCommand),
    /// Clear the prefix cache (entries that running sequences hold stay theirs).
    ClearPrefixCache,
}

/// Operations a control thread sends in turn, one every `every`, while the clients run.
#[derive(Debug, Clone)]
struct Control {
    every: Duration,
    commands: Vec<ControlOp>,
}

/// What the control thread did: commands sent, and the errors of those that failed.
#[derive(Debug, Default)]
struct Controlled {
    sent: u64,
    failures: Vec<String>,
}

/// Sends `control`'s commands until every one of `clients` clients has `finished`.
fn send_commands(
    client: &EngineClient,
    control: &Control,
    finished: &AtomicUsize,
    clients: usize,
) -> Controlled {
    let mut controlled = Controlled::default();
    for command in control.commands.iter().cycle() {
        std::thread::sleep(control.every);
        if finished.load(Ordering::Acquire) == clients {
            break;
        }
        let answer = match command {
            ControlOp::Lora(lora) => client.lora(lora.clone()).map(drop),
            ControlOp::ClearPrefixCache => client.clear_prefix_cache(),
        };
        match answer {
            Ok(()) => {}
            // An abort run stops the engine under the control thread's feet.
            Err(scheduler::ControlError::EngineStopped) => break,
            Err(err) => controlled.failures.push(format!("{command:?}: {err}")),
        }
        controlled.sent += 1;
    }
    controlled
}

/// When a run's requests reach the engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Submission {
    /// Each client submits its next request once its last one ended, while the engine steps.
    Clients,
    /// Every request is submitted, in plan order, and every handle to drop is dropped, before
    /// the engine starts stepping; the clients then read (and cancel) the streams. Without
    /// cancels nothing the engine sees depends on timing, so a run repeats exactly. (No later
    /// turns: they wait for an output.)
    Queued,
}

/// A request submitted before the engine started: its id and its handle (`None` once
/// dropped), or why it was refused; the client serving it takes it.
type Queued =
    Mutex<Option<Result<(u64, Option<scheduler::RequestHandle>), scheduler::RequestError>>>;

/// Submits every request of `planned` to `engine` (see [`Submission::Queued`]).
fn queue<D>(engine: &mut scheduler::Engine<D>, planned: &[Planned]) -> Vec<Queued>
where
    D: DeviceIo,
    D::Seq: Sequence,
{
    (planned.iter())
        .map(|item| {
            assert!(item.turn.is_none(), "a later turn cannot be queued");
            let submitted = engine.submit(item.request()).map(|handle| {
                let id = handle.id();
                (id, (item.action != Action::Drop).then_some(handle))
            });
            Mutex::new(Some(submitted))
        })
        .collect()
}

/// Serves `planned` from `clients` threads (while `control`'s thread sends its commands), each
/// submitting its requests or taking them from `queued`; answers every request's outcome, in
/// plan order, and what the control thread did.
fn serve(
    client: &EngineClient,
    planned: &[Planned],
    clients: usize,
    control: Option<&Control>,
    queued: Option<&[Queued]>,
) -> (Vec<Served>, Controlled) {
    let clients = clients.max(1);
    let lanes = lanes(planned, clients);
    let results: Vec<Mutex<Option<Served>>> = planned.iter().map(|_| Mutex::new(None)).collect();
    let finished = AtomicUsize::new(0);
    let controlled = std::thread::scope(|scope| {
        let controller = control.filter(|c| !c.commands.is_empty()).map(|control| {
            let client = client.clone();
            let finished = &finished;
            scope.spawn(move || send_commands(&client, control, finished, clients))
        });
        for worker in 0..clients {
            let client = client.clone();
            let results = &results;
            let finished = &finished;
            let lanes = &lanes;
            scope.spawn(move || {
                let mine =
                    (planned.iter().enumerate()).filter(|&(index, _)| lanes[index] == worker);
                for (index, item) in mine {
                    let submitted = match queued {
                        Some(queued) => lock(&queued[index]).take().expect("queued once"),
                        None => (client.submit(item.request()))
                            .map(|handle| (handle.id(), Some(handle))),
                    };
                    let served = match submitted {
                        Err(scheduler::RequestError::EngineStopped) => Served {
                            id: None,
                            planned: item.clone(),
                            outcome: Outcome::Stopped,
                        },
                        Err(err) => Served {
                            id: None,
                            planned: item.clone(),
                            outcome: Outcome::Refused(err.to_string()),
                        },
                        Ok((id, handle)) => {
                            let id = Some(id);
                            let outcome = match (item.action, handle) {
                                (Action::Drop, handle) => {
                                    drop(handle);
                                    Outcome::Dropped
                                }
                                (Action::Read, Some(handle)) => read_stream(&handle, None),
                                (Action::Cancel(after), Some(handle)) => {
                                    read_stream(&handle, Some(after))
                                }
                                // Only a handle to drop is dropped before it is read.
                                (_, None) => Outcome::Lost,
                            };
                            Served {
                                id,
                                planned: item.clone(),
                                outcome,
                            }
                        }
                    };
                    *results[index].lock().unwrap_or_else(|e| e.into_inner()) = Some(served);
                }
                finished.fetch_add(1, Ordering::AcqRel);
            });
        }
        controller.map_or_else(Controlled::default, |thread| {
            thread.join().expect("the control thread")
        })
    });
    let served = results
        .into_iter()
        .map(|cell| {
            cell.into_inner()
                .unwrap_or_else(|e| e.into_inner())
                .expect("every request was served")
        })
        .collect();
    (served, controlled)
}

/// The counts of one run (or of several added up). Every `*_failures`, `mismatches`,
/// `leaked_*` and `lost_final_events` count is zero in a healthy engine.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct SoakReport {
    /// What ran.
    pub run: String,
    /// Requests submitted.
    pub requests: u64,
    /// Requests that finished (length or stop token).
    pub completed: u64,
    /// Of them, those that ended on a stop token.
    pub stopped_on_token: u64,
    /// Requests that ended cancelled.
    pub cancelled: u64,
    /// Requests that ended with an error.
    pub failed: u64,
    /// Handles dropped unread.
    pub dropped: u64,
    /// Requests failed or refused because an abort run stopped the engine.
    pub stopped: u64,
    /// Shutdowns that answered an error (an abort must leave nothing behind either), with the
    /// error.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub shutdown_error: Option<String>,
    /// Submissions refused.
    pub refused: u64,
    /// Completed (or cancelled) requests whose tokens differ from the request served alone.
    pub mismatches: u64,
    /// Completed requests whose logits digest differs from the request's served alone.
    pub digest_mismatches: u64,
    /// KV blocks not free at idle after the prefix cache was cleared.
    pub leaked_blocks: u64,
    /// Live slots in use (and orphans) at idle.
    pub leaked_slots: u64,
    /// Accepted, read requests whose stream did not end with exactly one final event.
    pub lost_final_events: u64,
    /// Failed requests that no injected fault hit.
    pub bystander_failures: u64,
    /// The first few bystander failures: `request ID: ERROR`.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub bystander_errors: Vec<String>,
    /// KV blocks of the router's pool.
    pub kv_blocks: u64,
    /// Preemptions the engine made.
    pub preemptions: u64,
    /// Of them, spills.
    pub spills: u64,
    /// Sequences whose release failed twice (kept as orphans and released later).
    pub orphaned: u64,
    /// Commands (LoRA, prefix cache clears) the control thread sent while the clients ran.
    pub commands: u64,
    /// Of them, those that failed.
    pub command_failures: u64,
    /// The first few of those failures.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub command_errors: Vec<String>,
    /// Faults injected.
    pub faults_injected: u64,
    /// Of them, steps failed at the device (inside the router).
    pub device_faults: u64,
    /// Fed steps launched over a step that then failed (they read its outputs on the device), each
    /// failed too, as the contract requires.
    pub fed_over_failures: u64,
    /// Fed steps launched over a step that then failed that the router served anyway (it breaks
    /// the contract: they computed on a failed step's outputs).
    pub fed_over_failures_served: u64,
    /// Requests sampled at random (the rest greedy).
    pub sampled: u64,
    /// Requests served with a LoRA adapter.
    pub with_adapter: u64,
    /// Requests that are a later turn of an earlier one's conversation.
    pub later_turns: u64,
    /// Prefills that started from a cached prefix.
    pub prefix_hits: u64,
    /// Decode steps launched fed from the step before (depth 2).
    pub fed_launches: u64,
    /// Verification launches (speculative decoding).
    pub verify_launches: u64,
    /// Drafts proposed.
    pub drafted: u64,
    /// Drafts accepted.
    pub accepted: u64,
    /// Verifications launched while another cohort's was in flight (depth 2).
    pub spec_flights: u64,
    /// Wall time of the run in seconds.
    pub wall_s: f64,
}

impl SoakReport {
    /// Whether every failure count is zero.
    pub fn clean(&self) -> bool {
        self.mismatches == 0
            && self.digest_mismatches == 0
            && self.command_failures == 0
            && self.leaked_blocks == 0
            && self.leaked_slots == 0
            && self.lost_final_events == 0
            && self.bystander_failures == 0
            && self.refused == 0
            && self.fed_over_failures_served == 0
            && self.shutdown_error.is_none()
    }

    /// The sum of `reports` (named `run`).
    pub fn total(run: &str, reports: &[SoakReport]) -> SoakReport {
        let mut total = SoakReport {
            run: run.to_string(),
            ..SoakReport::default()
        };
        for r in reports {
            total.requests += r.requests;
            total.completed += r.completed;
            total.stopped_on_token += r.stopped_on_token;
            total.cancelled += r.cancelled;
            total.failed += r.failed;
            total.dropped += r.dropped;
            total.stopped += r.stopped;
            if total.shutdown_error.is_none() {
                total.shutdown_error.clone_from(&r.shutdown_error);
            }
            total.refused += r.refused;
            total.mismatches += r.mismatches;
            total.digest_mismatches += r.digest_mismatches;
            total.commands += r.commands;
            total.command_failures += r.command_failures;
            total.command_errors.extend(
                (r.command_errors.iter())
                    .take(5 - total.command_errors.len().min(5))
                    .cloned(),
            );
            total.leaked_blocks += r.leaked_blocks;
            total.leaked_slots += r.leaked_slots;
            total.lost_final_events += r.lost_final_events;
            total.bystander_failures += r.bystander_failures;
            total.bystander_errors.extend(
                r.bystander_errors
                    .iter()
                    .take(5 - total.bystander_errors.len().min(5))
                    .cloned(),
            );
            total.kv_blocks = total.kv_blocks.max(r.kv_blocks);
            total.preemptions += r.preemptions;
            total.spills += r.spills;
            total.orphaned += r.orphaned;
            total.faults_injected += r.faults_injected;
            total.device_faults += r.device_faults;
            total.fed_over_failures += r.fed_over_failures;
            total.fed_over_failures_served += r.fed_over_failures_served;
            total.sampled += r.sampled;
            total.with_adapter += r.with_adapter;
            total.later_turns += r.later_turns;
            total.prefix_hits += r.prefix_hits;
            total.fed_launches += r.fed_launches;
            total.verify_launches += r.verify_launches;
            total.drafted += r.drafted;
            total.accepted += r.accepted;
            total.spec_flights += r.spec_flights;
            total.wall_s += r.wall_s;
        }
        total
    }
}

/// Waits (up to `limit`) until the engine has nothing waiting or running, then clears the prefix
/// cache and reads the facts; answers the facts and the orphans.
fn idle_facts(client: &EngineClient, limit: Duration) -> (DeviceFacts, usize) {
    let start = Instant::now();
    loop {
        let stats = client.stats().expect("the engine answers stats");
        let idle = stats.waiting == 0 && stats.running == 0 && stats.orphans == 0;
        if idle || start.elapsed() > limit {
            break;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    client
        .clear_prefix_cache()
        .expect("the engine clears its prefix cache");
    let stats = client.stats().expect("the engine answers stats");
    (stats.facts, stats.orphans)
}

/// What a completed request must answer: the request's output served alone.
#[derive(Debug, Clone, PartialEq)]
struct Expected {
    tokens: Vec<u32>,
    /// Its logits digest (`None` unless the request asked for one).
    digest: Option<u64>,
}

/// The counts of `served`, given each request's reference output (by plan index) and the ids a
/// fault hit.
fn count(
    run: &str,
    served: &[Served],
    reference: &dyn Fn(usize, &Served) -> Expected,
    hit: &BTreeSet<u64>,
) -> SoakReport {
    let mut report = SoakReport {
        run: run.to_string(),
        requests: served.len() as u64,
        ..SoakReport::default()
    };
    for (index, s) in served.iter().enumerate() {
        match &s.outcome {
            Outcome::Completed(tokens, digest, stopped) => {
                report.completed += 1;
                report.stopped_on_token += u64::from(*stopped);
                let expected = reference(index, s);
                if *tokens != expected.tokens {
                    report.mismatches += 1;
                } else if *digest != expected.digest {
                    report.digest_mismatches += 1;
                }
            }
            Outcome::Cancelled(tokens) => {
                report.cancelled += 1;
                if !reference(index, s).tokens.starts_with(tokens) {
                    report.mismatches += 1;
                }
            }
            Outcome::Failed(error) => {
                report.failed += 1;
                if !s.id.is_some_and(|id| hit.contains(&id)) {
                    report.bystander_failures += 1;
                    if report.bystander_errors.len() < 5 {
                        let id = s.id.map_or("?".to_string(), |id| id.to_string());
                        report
                            .bystander_errors
                            .push(format!("request {id}: {error}"));
                    }
                }
            }
            Outcome::Refused(_) => report.refused += 1,
            Outcome::Stopped => report.stopped += 1,
            Outcome::Dropped => report.dropped += 1,
            Outcome::Lost => report.lost_final_events += 1,
        }
    }
    report
}

/// How a run serves its requests.
#[derive(Debug, Clone, Copy)]
struct Serving<'a> {
    /// Client threads.
    clients: usize,
    /// The control thread's operations, if any.
    control: Option<&'a Control>,
    /// Abort the engine this long into the run (else drain it at idle).
    abort_after: Option<Duration>,
    /// When the requests reach the engine.
    submission: Submission,
}

/// Runs `planned` on `engine` (on its own thread), served as `serving` says, and checks it;
/// `reference` gives the output each request must have, `faults` the record of injected faults
/// (if any).
fn soak_engine<D>(
    run: &str,
    mut engine: scheduler::Engine<D>,
    planned: &[Planned],
    serving: Serving<'_>,
    reference: &dyn Fn(usize, &Served) -> Expected,
    faults: Option<&Arc<Mutex<FaultRecord>>>,
) -> SoakReport
where
    D: DeviceIo + 'static,
    D::Seq: Sequence + 'static,
{
    let start = Instant::now();
    let Serving {
        clients,
        control,
        abort_after,
        submission,
    } = serving;
    let queued = (submission == Submission::Queued).then(|| queue(&mut engine, planned));
    let queued = queued.as_deref();
    let thread = EngineThread::spawn(engine).expect("engine thread");
    let client = thread.client();
    let (served, controlled, idle, shutdown) = match abort_after {
        None => {
            let (served, controlled) = serve(&client, planned, clients, control, queued);
            let idle = idle_facts(&client, Duration::from_secs(120));
            let shutdown = thread.shutdown(ShutdownMode::Drain);
            (served, controlled, Some(idle), shutdown)
        }
        // The clients keep submitting and reading while the engine is aborted under them; what
        // it held is checked by the router's teardown (the shutdown answers what it reports).
        Some(after) => std::thread::scope(|scope| {
            let serving = scope.spawn(|| serve(&client, planned, clients, control, queued));
            std::thread::sleep(after);
            let shutdown = thread.shutdown(ShutdownMode::Abort);
            let (served, controlled) = serving.join().expect("the clients");
            (served, controlled, None, shutdown)
        }),
    };
    let (metrics, shutdown_error) = match shutdown {
        Ok(metrics) => (metrics, None),
        Err(err) => (scheduler::Metrics::default(), Some(err.to_string())),
    };
    let record = faults
        .map(|record| lock(record).clone())
        .unwrap_or_default();
    let mut report = count(run, &served, reference, &record.hit);
    if let Some((facts, orphans)) = idle {
        report.kv_blocks = facts.kv_blocks_total as u64;
        report.leaked_blocks = (facts.kv_blocks_total - facts.kv_blocks_free) as u64;
        report.leaked_slots = (facts.live_slots_used + orphans) as u64;
    }
    report.shutdown_error = shutdown_error;
    report.preemptions = metrics.preemptions;
    report.spills = metrics.spills;
    report.orphaned = metrics.orphaned_sequences;
    report.faults_injected = record.injected;
    report.device_faults = record.device;
    report.fed_over_failures = record.fed_over_failures;
    report.fed_over_failures_served = record.fed_over_failures_served;
    report.prefix_hits = metrics.prefix_hits;
    report.fed_launches = metrics.fed_launches;
    report.verify_launches = metrics.verify_launches;
    report.drafted = metrics.drafted;
    report.accepted = metrics.accepted;
    report.spec_flights = metrics.spec_flights;
    report.commands = controlled.sent;
    report.command_failures = controlled.failures.len() as u64;
    report.command_errors = controlled.failures.into_iter().take(5).collect();
    report.wall_s = start.elapsed().as_secs_f64();
    report
}

/// What [`Chaos`] injected, and which requests its faults hit.
#[derive(Debug, Default, Clone)]
pub struct FaultRecord {
    /// Faults injected.
    pub injected: u64,
    /// Of them, steps failed at the device (by the router's `StepFaults`).
    pub device: u64,
    /// Ids of the requests a fault hit (the rows of a failed launch or await, the sequence of a
    /// failed effect, and the rows of a fed step whose source step failed).
    pub hit: BTreeSet<u64>,
    /// Fed steps launched over a step that then failed, failed too.
    pub fed_over_failures: u64,
    /// Fed steps launched over a step that then failed at the device, served by the router
    /// anyway (a broken contract).
    pub fed_over_failures_served: u64,
}

/// The random faults of a run: each strikes with probability `percent`%, drawn from one seeded
/// stream, and is recorded with the requests it hit. Shared by [`Chaos`] and the router's
/// [`StepFaults`] (which asks it, inside `launch`, whether the step being launched fails at the
/// device).
#[derive(Debug)]
pub struct Faults {
    per_mille: u32,
    rng: Mutex<ChaCha8Rng>,
    record: Arc<Mutex<FaultRecord>>,
    /// The ids of the rows of the step being launched.
    launching: Mutex<Vec<u64>>,
    /// Tickets failed at the device.
    doomed: Mutex<BTreeSet<u64>>,
}

impl Faults {
    /// Faults with probability `per_mille`‰, drawn from `seed`.
    pub fn new(per_mille: u32, seed: u64) -> Arc<Faults> {
        Arc::new(Faults {
            per_mille,
            rng: Mutex::new(ChaCha8Rng::seed_from_u64(seed)),
            record: Arc::default(),
            launching: Mutex::default(),
            doomed: Mutex::default(),
        })
    }

    /// The hook a router takes (`scheduler::backend::BackendOptions::step_faults`): fails the
    /// step being launched through [`Chaos`] with probability `percent`%.
    pub fn step_faults(self: &Arc<Self>) -> StepFaults {
        let faults = Arc::clone(self);
        StepFaults::new(move |ticket| {
            let rows = lock(&faults.launching).clone();
            if !faults.strike(rows) {
                return false;
            }
            lock(&faults.record).device += 1;
            lock(&faults.doomed).insert(ticket);
            true
        })
    }

    fn strike(&self, hit: impl IntoIterator<Item = u64>) -> bool {
        let roll = lock(&self.rng).random_range(0..1000);
        if roll >= self.per_mille {
            return false;
        }
        let mut record = lock(&self.record);
        record.injected += 1;
        record.hit.extend(hit);
        true
    }

    fn doomed(&self, ticket: u64) -> bool {
        lock(&self.doomed).contains(&ticket)
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|e| e.into_inner())
}

/// A router that forwards to `inner` but fails launches and per-sequence effects at random (each
/// with probability `percent`%), recording which requests each fault hit; and steps at the
/// device, either through the router's own fault injection ([`Chaos::over`]: the step runs, what
/// it wrote is overwritten, its rows are marked failed inside the router, and its await or
/// synchronous launch fails), or, for a router without it ([`Chaos::new`]), by failing awaits
/// here after the step settled. A failed launch or effect is not forwarded (a router's failed
/// call changes nothing).
#[derive(Debug)]
pub struct Chaos<D> {
    inner: D,
    faults: Arc<Faults>,
    /// Whether awaits fail here (the router has no fault injection of its own).
    await_faults: bool,
    /// Each unsettled ticket's rows and sources.
    rows: Mutex<HashMap<u64, Launched>>,
    /// Tickets whose await failed here (`await_faults`).
    failed_here: Mutex<BTreeSet<u64>>,
}

/// A step [`Chaos`] launched.
#[derive(Debug, Default)]
struct Launched {
    /// The ids of its rows.
    ids: Vec<u64>,
    /// For a fed step that reads a row of the step before on the device: the tickets unsettled
    /// when it was launched (its source).
    sources: Vec<u64>,
}

impl<D> Chaos<D> {
    /// Wraps `inner` (a router without fault injection); faults strike with probability
    /// `percent`%, drawn from `seed`, awaits failing here.
    pub fn new(inner: D, percent: u32, seed: u64) -> Self {
        Chaos {
            inner,
            faults: Faults::new(10 * percent, seed),
            await_faults: true,
            rows: Mutex::default(),
            failed_here: Mutex::default(),
        }
    }

    /// Wraps `inner`, a router built with `faults.step_faults()`: steps fail at the device.
    pub fn over(inner: D, faults: Arc<Faults>) -> Self {
        Chaos {
            inner,
            faults,
            await_faults: false,
            rows: Mutex::default(),
            failed_here: Mutex::default(),
        }
    }

    /// The shared record of what was injected.
    pub fn record(&self) -> Arc<Mutex<FaultRecord>> {
        Arc::clone(&self.faults.record)
    }

    fn strike(&self, hit: impl IntoIterator<Item = u64>) -> bool {
        self.faults.strike(hit)
    }
}

fn injected(phase: Phase) -> DeviceError {
    DeviceError::Failed {
        phase,
        message: "injected by the soak".to_string(),
    }
}

impl<D: DeviceIo> DeviceIo for Chaos<D>
where
    D::Seq: Sequence,
{
    type Seq = D::Seq;
    type Ptr = D::Ptr;
    type Model = D::Model;
    type LoraCmd = D::LoraCmd;
    type LoraAck = D::LoraAck;

    fn model(&self) -> &D::Model {
        self.inner.model()
    }
    fn facts(&self) -> DeviceFacts {
        self.inner.facts()
    }
    fn max_depth(&self) -> usize {
        self.inner.max_depth()
    }
    fn computes_on_host(&self) -> bool {
        self.inner.computes_on_host()
    }
    fn launch(&self, plan: StepPlan<'_>, rows: &mut [&mut D::Seq]) -> Result<Ticket, DeviceError> {
        let ids: Vec<u64> = rows.iter().map(|seq| seq.id()).collect();
        if self.strike(ids.iter().copied()) {
            return Err(injected(Phase::Forward));
        }
        let fed = match &plan {
            StepPlan::DecodeFed { sources, .. } => {
                sources.iter().any(|source| matches!(source, Feed::Row(_)))
            }
            _ => false,
        };
        *lock(&self.faults.launching) = ids.clone();
        let ticket = self.inner.launch(plan, rows)?;
        let mut unsettled = lock(&self.rows);
        let sources = if fed {
            unsettled.keys().copied().collect()
        } else {
            Vec::new()
        };
        unsettled.insert(ticket.0, Launched { ids, sources });
        Ok(ticket)
    }
    fn await_result(&self, ticket: Ticket) -> Result<StepResult<D::Ptr>, DeviceError> {
        let Launched { ids, sources } = lock(&self.rows).remove(&ticket.0).unwrap_or_default();
        // Its source step was awaited first: whether that failed is known now.
        let failed_here = {
            let mut failed = lock(&self.failed_here);
            let source = sources.iter().find(|&source| failed.contains(source));
            // Awaits come in launch order: no later step reads an older ticket.
            failed.retain(|&older| older >= ticket.0);
            source
        };
        let over_failure =
            failed_here.is_some() || sources.iter().any(|&source| self.faults.doomed(source));
        let result = match self.inner.await_result(ticket) {
            Err(err) => {
                if over_failure {
                    // A fed step whose source failed fails too (the contract).
                    let mut record = lock(&self.faults.record);
                    record.hit.extend(ids);
                    record.fed_over_failures += 1;
                }
                return Err(err);
            }
            Ok(result) => result,
        };
        if let Some(source) = failed_here {
            // Its source failed here, not in the router, which served it: it fails here too,
            // as a device would fail a step fed by a step it failed.
            let mut record = lock(&self.faults.record);
            record.hit.extend(ids);
            record.fed_over_failures += 1;
            lock(&self.failed_here).insert(ticket.0);
            return Err(DeviceError::Failed {
                phase: Phase::Forward,
                message: format!("its inputs came from ticket {source}, which failed"),
            });
        }
        if over_failure {
            lock(&self.faults.record).fed_over_failures_served += 1;
        }
        if self.await_faults && self.strike(ids) {
            lock(&self.failed_here).insert(ticket.0);
            return Err(injected(Phase::Readback));
        }
        Ok(result)
    }
    fn apply(&self, effect: Effect<'_, D::Seq, D::Ptr>) -> Result<EffectOutcome, DeviceError> {
        let id = match &effect {
            Effect::ReleaseSeq { seq, .. }
            | Effect::CompactSlot { seq, .. }
            | Effect::RestoreSequenceState { seq, .. }
            | Effect::MarconiCheckpoint { seq }
            | Effect::SsmSnapshotRestore { seq, .. }
            | Effect::ReserveKv { seq }
            | Effect::Rollback { seq }
            | Effect::TruncateKv { seq, .. } => Some(seq.id()),
            Effect::SaveSequenceState { seq, .. } | Effect::SsmSnapshotSave { seq, .. } => {
                Some(seq.id())
            }
            _ => None,
        };
        if let Some(id) = id {
            if self.strike([id]) {
                return Err(injected(Phase::Effect));
            }
        }
        self.inner.apply(effect)
    }
    fn clear_prefix_cache(&self) -> Result<(), DeviceError> {
        self.inner.clear_prefix_cache()
    }
    fn subscribe_cache_events(
        &self,
        sink: Box<dyn device_io::CacheEventSink>,
    ) -> Result<(), DeviceError> {
        self.inner.subscribe_cache_events(sink)
    }
    fn lora(&mut self, cmd: D::LoraCmd) -> Result<D::LoraAck, LoraError> {
        self.inner.lora(cmd)
    }
    fn teardown(self: Box<Self>) -> Result<(), DeviceError> {
        Box::new(self.inner).teardown()
    }
}

/// How preempted sequences come back in a pressure run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PressureMode {
    /// Release and prefill again.
    Recompute,
    /// Spill to host memory.
    SpillMemory,
    /// Spill to a private directory.
    SpillDirectory,
}

/// Which router serves a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RouterKind {
    /// The host router (`device_cpu::CpuRouter`).
    Host,
    /// The CUDA router on `SimRuntime`: its kernels run on the host, one fiber per CUDA thread,
    /// so a run is slow; keep it small. It has no LoRA adapter slots.
    CudaSim,
}

/// Who proposes the drafts of a speculating run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DraftSource {
    /// The router's MTP head (the model needs MTP layers).
    Head,
    /// A drafter in the core that knows every request's reference output: every draft is
    /// accepted (unless a sibling prompt's continuation is proposed).
    Perfect,
    /// The same, shifted in the vocabulary: every draft is rejected.
    Adversarial,
}

/// The router side of a run: which router, its sizes, and how the engine drives it.
#[derive(Debug, Clone)]
pub struct RouterOptions {
    /// The model served.
    pub model: model::Model,
    /// The router.
    pub router: RouterKind,
    /// KV blocks of 16 tokens.
    pub kv_blocks: usize,
    /// Live slots (and `max_running`).
    pub slots: usize,
    /// Longest sequence.
    pub max_context: usize,
    /// Pipeline depth, 1 or 2.
    pub depth: usize,
    /// Drafts per row and step of speculative decoding; 0: none.
    pub mtp: usize,
    /// Who drafts when `mtp` > 0.
    pub drafter: DraftSource,
    /// Whether speculation at depth 2 runs by cohorts.
    pub overlap: SpecOverlap,
    /// Per mille of launches, steps (inside the router) and per-sequence effects that fail
    /// ([`Chaos`]).
    pub fault_per_mille: u32,
}

impl RouterOptions {
    /// The host router at depth 1, no speculation, no faults.
    pub fn host(model: model::Model, kv_blocks: usize, slots: usize, max_context: usize) -> Self {
        RouterOptions {
            model,
            router: RouterKind::Host,
            kv_blocks,
            slots,
            max_context,
            depth: 1,
            mtp: 0,
            drafter: DraftSource::Head,
            overlap: SpecOverlap::Auto,
            fault_per_mille: 0,
        }
    }

    /// Why `self` cannot serve `workload` (a combination no router here supports), if it cannot.
    pub fn refusal(&self, workload: &WorkloadOptions) -> Option<String> {
        if !(1..=2).contains(&self.depth) {
            return Some(format!("depth {} (must be 1 or 2)", self.depth));
        }
        if self.mtp > scheduler::MAX_DRAFTS {
            return Some(format!(
                "{} drafts per step (at most {})",
                self.mtp,
                scheduler::MAX_DRAFTS
            ));
        }
        if self.mtp > 0 && self.drafter == DraftSource::Head && !self.model.has_mtp() {
            return Some("MTP drafts from a model without MTP layers".to_string());
        }
        if workload.submission == Submission::Queued && workload.followup_percent > 0 {
            return Some(
                "later turns with every request queued first (a turn waits for an output)"
                    .to_string(),
            );
        }
        if workload.adapters > 0 && self.router == RouterKind::CudaSim {
            return Some("LoRA adapters on the CUDA router (it has no adapter slots)".to_string());
        }
        if self.kv_blocks * BLOCK < self.max_context {
            return Some(format!(
                "{} KV blocks of {BLOCK} hold less than one longest sequence ({})",
                self.kv_blocks, self.max_context
            ));
        }
        None
    }

    /// What ran, for the report's `run`.
    fn label(&self, workload: &WorkloadOptions, what: &str) -> String {
        let mut label = match self.router {
            RouterKind::Host => "host".to_string(),
            RouterKind::CudaSim => "cuda-sim".to_string(),
        };
        label += &format!(" depth {}", self.depth);
        if self.mtp > 0 {
            let drafter = match self.drafter {
                DraftSource::Head => "mtp",
                DraftSource::Perfect => "perfect",
                DraftSource::Adversarial => "adversarial",
            };
            label += &format!(" {drafter} k {}", self.mtp);
            if self.depth == 2 {
                label += &format!(" {:?}", self.overlap).to_lowercase();
            }
        }
        if workload.sampled_percent > 0 {
            label += &format!(" sampled {}%", workload.sampled_percent);
        }
        if workload.adapters > 0 {
            label += &format!(" lora {}", workload.adapters);
        }
        if workload.digest_percent > 0 {
            label += &format!(" digests {}%", workload.digest_percent);
        }
        if workload.command_every_ms > 0 {
            label += &format!(" commands every {} ms", workload.command_every_ms);
        }
        if workload.abort_after_ms > 0 {
            label += &format!(" aborted after {} ms", workload.abort_after_ms);
        }
        if workload.submission == Submission::Queued {
            label += " queued";
        }
        if self.fault_per_mille > 0 {
            label += &format!(" faults {}‰", self.fault_per_mille);
        }
        format!("{label}: {what}")
    }
}

/// Tokens per KV block of the routers the soak builds.
const BLOCK: usize = device_cpu::DEFAULT_BLOCK_SIZE;

/// The LoRA adapters of a run: seeded random ones for the run's model, written in PEFT's format
/// to a private temporary folder (removed when this is dropped).
struct Adapters {
    _dir: Option<tempfile::TempDir>,
    paths: Vec<PathBuf>,
}

impl Adapters {
    /// `count` adapters of ranks 2, 4 and 6 in turn (ids `1..=count`).
    fn new(model: &model::Model, count: u32, seed: u64) -> Adapters {
        if count == 0 {
            return Adapters {
                _dir: None,
                paths: Vec::new(),
            };
        }
        let dir = tempfile::tempdir().expect("a folder for the adapters");
        let paths = (0..count as usize)
            .map(|i| {
                let mut spec = model::LoraSpec::all_linear(2 + 2 * (i % 3));
                // Large enough that an adapter changes the greedy tokens.
                spec.b_range = 0.3;
                let adapter = model::LoraAdapter::random(model, &spec, seed + i as u64)
                    .expect("a random adapter");
                let path = dir.path().join(format!("adapter-{}", i + 1));
                adapter
                    .save(&path, model.config())
                    .expect("the adapter saved");
                path
            })
            .collect();
        Adapters {
            _dir: Some(dir),
            paths,
        }
    }

    /// Operations that change no request's output: clearing the prefix cache, and (on a
    /// router with adapter slots) loading the first adapter's weights once more under the next
    /// id and unloading it, or, without adapters, listing them.
    fn churn(&self, lora: bool) -> Vec<ControlOp> {
        let mut ops = vec![ControlOp::ClearPrefixCache];
        match self.paths.first() {
            _ if !lora => {}
            None => ops.push(ControlOp::Lora(LoraCommand::List)),
            Some(path) => {
                let extra = self.paths.len() as u32 + 1;
                ops.insert(
                    0,
                    ControlOp::Lora(LoraCommand::Load {
                        adapter: extra,
                        path: path.clone(),
                    }),
                );
                ops.push(ControlOp::Lora(LoraCommand::Unload { adapter: extra }));
            }
        }
        ops
    }
}

/// What differs between the engines of a run (its reference and the soaked one).
#[derive(Debug, Clone)]
struct Shape {
    kv_blocks: usize,
    slots: usize,
    depth: usize,
    caches: bool,
    fault_per_mille: u32,
    fault_seed: u64,
    /// Threads of the host router's forward pass.
    threads: usize,
}

/// The router `options` names, with `shape`'s sizes, through the one path a program takes
/// (`scheduler::backend`), with [`Faults`] injected at its device and wrapped in [`Chaos`].
fn router(options: &RouterOptions, shape: &Shape, adapters: usize) -> Chaos<backend::Router> {
    let faults = Faults::new(shape.fault_per_mille, shape.fault_seed);
    let snapshot_slots = if options.mtp > 0 {
        // Ring slots for half the rows' drafts: a step speculates on as many rows as the ring
        // holds drafts for, so the rows left out decode plainly next to the others.
        (shape.slots * options.mtp)
            .div_ceil(2)
            .max(options.mtp)
            .max(device_cpu::DEFAULT_SNAPSHOT_SLOTS)
    } else {
        device_cpu::DEFAULT_SNAPSHOT_SLOTS
    };
    let backend_options = BackendOptions {
        device: match options.router {
            RouterKind::Host => Device::Cpu,
            RouterKind::CudaSim => Device::CudaSim,
        },
        max_context: Some(options.max_context),
        snapshot_slots,
        prefix_cache: shape.caches,
        marconi: shape.caches,
        max_depth: shape.depth,
        // One more than the run's adapters, for the control thread's.
        lora_slots: (adapters + 1).max(device_cpu::DEFAULT_LORA_SLOTS),
        // Steps fail inside the router, as after a device error.
        step_faults: Some(faults.step_faults()),
        threads: shape.threads,
        ..BackendOptions::new(shape.kv_blocks, shape.slots)
    };
    let router = backend::build_router(options.model.clone(), backend_options).expect("the router");
    Chaos::over(router, faults)
}

/// An engine over [`router`] with `config`, the run's adapters loaded.
fn engine(
    options: &RouterOptions,
    shape: &Shape,
    config: EngineConfig,
    adapters: &Adapters,
) -> (
    scheduler::Engine<Chaos<backend::Router>>,
    Arc<Mutex<FaultRecord>>,
) {
    let router = router(options, shape, adapters.paths.len());
    let record = router.record();
    let mut engine = scheduler::Engine::new(router, config).expect("the engine");
    for (id, path) in (1..).zip(&adapters.paths) {
        engine
            .lora(LoraCommand::Load {
                adapter: id,
                path: path.clone(),
            })
            .expect("the adapter loads");
    }
    (engine, record)
}

/// Each request of `planned` served alone on a fresh engine over `options`' router with both
/// caches off, at depth 1, without speculation (one at a time on one engine: with the caches off
/// nothing carries over from one request to the next); writes the prompts of later turns from
/// their parents' outputs, and the stop tokens, on the way. A conversation (a request and its
/// later turns) is served in plan order by one engine, the conversations spread over one engine
/// per core: the CUDA router on `SimRuntime` runs each step on one thread, so the reference of
/// a cuda-sim run is as parallel as the machine (the host router's reference engines compute on
/// one thread each; its bits do not depend on the thread count).
fn alone(options: &RouterOptions, planned: &mut [Planned], adapters: &Adapters) -> Vec<Expected> {
    // Each request's conversation: the first request of its chain of turns.
    let mut root: Vec<usize> = Vec::with_capacity(planned.len());
    for (index, item) in planned.iter().enumerate() {
        let first = item.turn.as_ref().map_or(index, |turn| root[turn.parent]);
        root.push(first);
    }
    let conversations = root.iter().enumerate().filter(|&(i, &r)| i == r).count();
    let engines = std::thread::available_parallelism()
        .map_or(1, usize::from)
        .min(conversations)
        .max(1);
    let shape = Shape {
        kv_blocks: options.max_context.div_ceil(BLOCK) + 1,
        slots: 1,
        depth: 1,
        caches: false,
        fault_per_mille: 0,
        fault_seed: 0,
        threads: if engines > 1 {
            1
        } else {
            device_cpu::default_threads()
        },
    };
    // The conversations in turn: the k-th goes to engine k % engines.
    let mut engine_of = vec![0; planned.len()];
    let mut next = 0;
    for index in 0..planned.len() {
        if root[index] == index {
            engine_of[index] = next % engines;
            next += 1;
        } else {
            engine_of[index] = engine_of[root[index]];
        }
    }
    let shared: &[Planned] = planned;
    let served: Vec<Vec<(usize, Planned, Expected)>> = std::thread::scope(|scope| {
        let workers: Vec<_> = (0..engines)
            .map(|me| {
                let (shape, engine_of) = (&shape, &engine_of);
                scope.spawn(move || {
                    let config = EngineConfig {
                        max_running: 1,
                        ..EngineConfig::default()
                    };
                    let (mut engine, _) = engine(options, shape, config, adapters);
                    let mut mine: HashMap<usize, (Planned, Expected)> = HashMap::new();
                    for index in (0..shared.len()).filter(|&i| engine_of[i] == me) {
                        let mut item = shared[index].clone();
                        // A later turn's prompt holds its parent's output, served before it.
                        if let Some(turn) = item.turn.clone() {
                            let (parent, output) = &mine[&turn.parent];
                            let held = (&parent.prompt[..], &output.tokens[..]);
                            match turn_prompt(held, &turn.new, item.max_tokens, options.max_context)
                            {
                                Some(prompt) => item.prompt = prompt,
                                None => (item.prompt, item.turn) = (turn.new, None),
                            }
                        }
                        let mut serve = |request: Request| {
                            let handle = engine.submit(request).expect("reference request");
                            engine.run_until_idle();
                            handle.wait().expect("reference output")
                        };
                        let mut completion = serve(item.request());
                        // A stop token: one this output holds, at a random place; served alone
                        // again with it.
                        if let (Some(draw), false) = (item.stop_draw, completion.tokens.is_empty())
                        {
                            let at = (draw % completion.tokens.len() as u64) as usize;
                            item.stop = vec![completion.tokens[at]];
                            completion = serve(item.request());
                        }
                        let expected = Expected {
                            tokens: completion.tokens,
                            digest: completion.logits_digest,
                        };
                        mine.insert(index, (item, expected));
                    }
                    engine
                        .shutdown(ShutdownMode::Drain)
                        .expect("reference shutdown");
                    mine.into_iter()
                        .map(|(i, (item, out))| (i, item, out))
                        .collect()
                })
            })
            .collect();
        (workers.into_iter())
            .map(|worker| worker.join().expect("a reference engine"))
            .collect()
    });
    let mut outputs: Vec<Option<Expected>> = vec![None; planned.len()];
    for (index, item, expected) in served.into_iter().flatten() {
        planned[index] = item;
        outputs[index] = Some(expected);
    }
    (outputs.into_iter())
        .map(|output| output.expect("every request was served alone"))
        .collect()
}

/// The speculation `options` asks for; the core's drafters know each request's reference
/// output (`alone`).
fn speculation(
    options: &RouterOptions,
    planned: &[Planned],
    alone: &[Expected],
) -> Option<Speculation> {
    if options.mtp == 0 {
        return None;
    }
    let known = |wrong| Drafter::Known {
        sequences: Arc::new(
            planned
                .iter()
                .zip(alone)
                .map(|(item, output)| item.prompt.iter().chain(&output.tokens).copied().collect())
                .collect(),
        ),
        wrong,
    };
    Some(Speculation {
        k: options.mtp,
        drafter: match options.drafter {
            DraftSource::Head => Drafter::Mtp,
            DraftSource::Perfect => known(false),
            DraftSource::Adversarial => known(true),
        },
        overlap: options.overlap,
    })
}

fn engine_config(
    slots: usize,
    preemption: scheduler::Preemption,
    speculation: Option<Speculation>,
) -> EngineConfig {
    EngineConfig {
        max_running: slots,
        max_step_tokens: 256,
        max_prefill_chunk: 64,
        preemption,
        speculation,
        ..EngineConfig::default()
    }
}

/// Load on `options`' router with both caches on (prefix cache and Marconi checkpoints).
///
/// # Panics
/// When `options.refusal(workload)` names a reason, or an engine cannot be built.
pub fn soak_load(workload: &WorkloadOptions, options: &RouterOptions) -> SoakReport {
    let modes: [Option<PressureMode>; 1] = [None];
    soak_runs(workload, options, &modes).remove(0)
}

/// Memory pressure: `workload` on `options`' router (whose pool should be small enough to preempt
/// often), once per `mode`, both caches on. Answers one report per mode.
///
/// # Panics
/// As [`soak_load`].
pub fn soak_pressure(
    workload: &WorkloadOptions,
    options: &RouterOptions,
    modes: &[PressureMode],
) -> Vec<SoakReport> {
    let modes: Vec<Option<PressureMode>> = modes.iter().copied().map(Some).collect();
    soak_runs(workload, options, &modes)
}

/// One run of `workload` per mode (`None`: load, recompute when the pool runs dry), all checked
/// against one reference.
fn soak_runs(
    workload: &WorkloadOptions,
    options: &RouterOptions,
    modes: &[Option<PressureMode>],
) -> Vec<SoakReport> {
    if let Some(why) = options.refusal(workload) {
        panic!("the soak cannot run {why}");
    }
    let mut planned = plan(workload);
    let adapters = Adapters::new(&options.model, workload.adapters, workload.seed ^ 0xADA);
    let alone = alone(options, &mut planned, &adapters);
    let reference = |index: usize, _: &Served| alone[index].clone();
    let speculation = speculation(options, &planned, &alone);
    let control = (workload.command_every_ms > 0).then(|| Control {
        every: Duration::from_millis(workload.command_every_ms),
        commands: adapters.churn(options.router == RouterKind::Host),
    });
    modes
        .iter()
        .map(|&mode| {
            let (what, preemption) = match mode {
                None => ("load, caches on", scheduler::Preemption::Recompute),
                Some(PressureMode::Recompute) => {
                    ("pressure, recompute", scheduler::Preemption::Recompute)
                }
                Some(PressureMode::SpillMemory) => (
                    "pressure, spill to memory",
                    scheduler::Preemption::Spill(scheduler::SpillTarget::Memory),
                ),
                Some(PressureMode::SpillDirectory) => (
                    "pressure, spill to a directory",
                    scheduler::Preemption::Spill(scheduler::SpillTarget::Directory(
                        std::env::temp_dir(),
                    )),
                ),
            };
            let shape = Shape {
                kv_blocks: options.kv_blocks,
                slots: options.slots,
                depth: options.depth,
                caches: true,
                fault_per_mille: options.fault_per_mille,
                fault_seed: workload.seed ^ 0xFA17,
                threads: device_cpu::default_threads(),
            };
            let config = engine_config(options.slots, preemption, speculation.clone());
            let (engine, record) = engine(options, &shape, config, &adapters);
            let mut report = soak_engine(
                &options.label(workload, what),
                engine,
                &planned,
                Serving {
                    clients: workload.clients,
                    control: control.as_ref(),
                    abort_after: (workload.abort_after_ms > 0)
                        .then(|| Duration::from_millis(workload.abort_after_ms)),
                    submission: workload.submission,
                },
                &reference,
                Some(&record),
            );
            report.sampled = planned.iter().filter(|p| p.sampling.is_some()).count() as u64;
            report.with_adapter = planned.iter().filter(|p| p.adapter.is_some()).count() as u64;
            report.later_turns = planned.iter().filter(|p| p.turn.is_some()).count() as u64;
            report
        })
        .collect()
}

/// The scripted router at `depth` with random faults at launch, await and per-sequence effects
/// (`fault_percent`% each), on `blocks` KV blocks of 4 tokens and `slots` slots.
pub fn soak_faults(
    workload: &WorkloadOptions,
    depth: usize,
    (blocks, slots): (usize, usize),
    fault_percent: u32,
    preemption: scheduler::Preemption,
) -> SoakReport {
    use device_io::testing::{ScriptedConfig, ScriptedRouter};
    // The scripted router answers tokens of its own (greedy), has no adapters and no logits.
    // Nor does it know stop tokens; a later turn's prompt would need an output.
    let planned = plan(&WorkloadOptions {
        sampled_percent: 0,
        adapters: 0,
        digest_percent: 0,
        followup_percent: 0,
        stop_percent: 0,
        ..workload.clone()
    });
    let shape = ScriptedConfig {
        block_size: 4,
        num_blocks: blocks,
        num_slots: slots,
        vocab_size: workload.vocab_size as usize,
        max_depth: depth,
    };
    let chaos = Chaos::new(
        ScriptedRouter::new(shape),
        fault_percent,
        workload.seed ^ 0xFA17,
    );
    let record = chaos.record();
    let oracle = ScriptedRouter::new(shape);
    let reference = |_: usize, served: &Served| {
        let tokens = match (served.id, served.planned.prompt.len()) {
            (Some(id), prompt) => (0..served.planned.max_tokens)
                .map(|i| oracle.fallback_token(id, prompt + i))
                .collect(),
            (None, _) => Vec::new(),
        };
        Expected {
            tokens,
            digest: None,
        }
    };
    let engine =
        scheduler::Engine::new(chaos, engine_config(slots, preemption, None)).expect("engine");
    let queued = match workload.submission {
        Submission::Clients => "",
        Submission::Queued => ", queued",
    };
    soak_engine(
        &format!("scripted depth {depth}: random faults{queued}"),
        engine,
        &planned,
        Serving {
            clients: workload.clients,
            control: None,
            abort_after: None,
            submission: workload.submission,
        },
        &reference,
        Some(&record),
    )
}
