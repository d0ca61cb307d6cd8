//! The soak: load, memory pressure and faults through the public API (`EngineThread`, its
//! clients and request handles), with the invariants a careful user of a serving engine relies
//! on checked at the end of every run.
//!
//! A run generates a seeded workload (prompts sharing prefixes, so the prefix cache and Marconi
//! checkpoints are used; random `max_tokens`; a share of requests cancelled mid-stream and a
//! share of handles dropped unread), serves it from several client threads at once, and counts:
//!
//! - **lost final events**: accepted requests whose stream ended without exactly one `Finished`
//!   or `Error` as its last event (or with anything after it);
//! - **mismatches**: completed greedy requests whose tokens differ from the same prompt served
//!   alone (on the host router: a fresh engine with both caches off; on the scripted router: its
//!   deterministic answer), and cancelled ones whose tokens are not a prefix of that;
//! - **leaked blocks and slots**: at idle, after the prefix cache is cleared, KV blocks not free,
//!   live slots in use, and orphans;
//! - **bystander failures**: requests that failed although no injected fault hit them.
//!
//! `tests/tests/soak.rs` runs small versions in CI; `cargo xtask soak` runs the full one (2,000
//! requests from 8 clients) and prints one JSON object per run, then one with the totals.

use std::collections::{BTreeSet, HashMap};
use std::ops::RangeInclusive;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use device_io::{
    DeviceError, DeviceFacts, DeviceIo, Effect, EffectOutcome, LoraError, Phase, Sequence,
    StepPlan, StepResult, Ticket,
};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use scheduler::{
    EngineClient, EngineConfig, EngineThread, Event, FinishReason, Request, ShutdownMode,
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
}

/// A seeded workload: prompts share prefixes, so caches have something to hit.
fn plan(options: &WorkloadOptions) -> Vec<Planned> {
    let mut rng = ChaCha8Rng::seed_from_u64(options.seed);
    let longest = *options.prompt_len.end();
    let prefixes: Vec<Vec<u32>> = (0..options.prefixes.max(1))
        .map(|_| {
            (0..longest)
                .map(|_| rng.random_range(0..options.vocab_size))
                .collect()
        })
        .collect();
    (0..options.requests)
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
            }
        })
        .collect()
}

/// How one request ended, as its client saw it.
#[derive(Debug, Clone, PartialEq)]
enum Outcome {
    Completed(Vec<u32>),
    Cancelled(Vec<u32>),
    Failed(String),
    Refused(String),
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
            Event::Finished { .. } => {
                outcome = Some(Outcome::Completed(std::mem::take(&mut tokens)))
            }
            Event::Error(err) => outcome = Some(Outcome::Failed(err.to_string())),
        }
    }
    outcome.unwrap_or(Outcome::Lost)
}

/// Serves `planned` from `clients` threads; answers every request's outcome, in plan order.
fn serve(client: &EngineClient, planned: &[Planned], clients: usize) -> Vec<Served> {
    let clients = clients.max(1);
    let results: Vec<Mutex<Option<Served>>> = planned.iter().map(|_| Mutex::new(None)).collect();
    std::thread::scope(|scope| {
        for worker in 0..clients {
            let client = client.clone();
            let results = &results;
            scope.spawn(move || {
                for (index, item) in planned.iter().enumerate().skip(worker).step_by(clients) {
                    let request = Request::greedy(item.prompt.clone(), item.max_tokens);
                    let served = match client.submit(request) {
                        Err(err) => Served {
                            id: None,
                            planned: item.clone(),
                            outcome: Outcome::Refused(err.to_string()),
                        },
                        Ok(handle) => {
                            let id = Some(handle.id());
                            let outcome = match item.action {
                                Action::Drop => {
                                    drop(handle);
                                    Outcome::Dropped
                                }
                                Action::Read => read_stream(&handle, None),
                                Action::Cancel(after) => read_stream(&handle, Some(after)),
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
            });
        }
    });
    results
        .into_iter()
        .map(|cell| {
            cell.into_inner()
                .unwrap_or_else(|e| e.into_inner())
                .expect("every request was served")
        })
        .collect()
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
    /// Requests that ended cancelled.
    pub cancelled: u64,
    /// Requests that ended with an error.
    pub failed: u64,
    /// Handles dropped unread.
    pub dropped: u64,
    /// Submissions refused.
    pub refused: u64,
    /// Completed (or cancelled) requests whose tokens differ from the request served alone.
    pub mismatches: u64,
    /// KV blocks not free at idle after the prefix cache was cleared.
    pub leaked_blocks: u64,
    /// Live slots in use (and orphans) at idle.
    pub leaked_slots: u64,
    /// Accepted, read requests whose stream did not end with exactly one final event.
    pub lost_final_events: u64,
    /// Failed requests that no injected fault hit.
    pub bystander_failures: u64,
    /// Preemptions the engine made.
    pub preemptions: u64,
    /// Of them, spills.
    pub spills: u64,
    /// Faults injected.
    pub faults_injected: u64,
    /// Wall time of the run in seconds.
    pub wall_s: f64,
}

impl SoakReport {
    /// Whether every failure count is zero.
    pub fn clean(&self) -> bool {
        self.mismatches == 0
            && self.leaked_blocks == 0
            && self.leaked_slots == 0
            && self.lost_final_events == 0
            && self.bystander_failures == 0
            && self.refused == 0
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
            total.cancelled += r.cancelled;
            total.failed += r.failed;
            total.dropped += r.dropped;
            total.refused += r.refused;
            total.mismatches += r.mismatches;
            total.leaked_blocks += r.leaked_blocks;
            total.leaked_slots += r.leaked_slots;
            total.lost_final_events += r.lost_final_events;
            total.bystander_failures += r.bystander_failures;
            total.preemptions += r.preemptions;
            total.spills += r.spills;
            total.faults_injected += r.faults_injected;
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

/// The counts of `served`, given each request's reference output (by plan index) and the ids a
/// fault hit.
fn count(
    run: &str,
    served: &[Served],
    reference: &dyn Fn(usize, &Served) -> Vec<u32>,
    hit: &BTreeSet<u64>,
) -> SoakReport {
    let mut report = SoakReport {
        run: run.to_string(),
        requests: served.len() as u64,
        ..SoakReport::default()
    };
    for (index, s) in served.iter().enumerate() {
        match &s.outcome {
            Outcome::Completed(tokens) => {
                report.completed += 1;
                if *tokens != reference(index, s) {
                    report.mismatches += 1;
                }
            }
            Outcome::Cancelled(tokens) => {
                report.cancelled += 1;
                if !reference(index, s).starts_with(tokens) {
                    report.mismatches += 1;
                }
            }
            Outcome::Failed(_) => {
                report.failed += 1;
                if !s.id.is_some_and(|id| hit.contains(&id)) {
                    report.bystander_failures += 1;
                }
            }
            Outcome::Refused(_) => report.refused += 1,
            Outcome::Dropped => report.dropped += 1,
            Outcome::Lost => report.lost_final_events += 1,
        }
    }
    report
}

/// Runs `planned` on `engine` (on its own thread) and checks it; `reference` gives the output
/// each request must have, `faults` the record of injected faults (if any).
fn soak_engine<D>(
    run: &str,
    engine: scheduler::Engine<D>,
    planned: &[Planned],
    clients: usize,
    reference: &dyn Fn(usize, &Served) -> Vec<u32>,
    faults: Option<&Arc<Mutex<FaultRecord>>>,
) -> SoakReport
where
    D: DeviceIo + 'static,
    D::Seq: Sequence + 'static,
{
    let start = Instant::now();
    let thread = EngineThread::spawn(engine).expect("engine thread");
    let client = thread.client();
    let served = serve(&client, planned, clients);
    let (facts, orphans) = idle_facts(&client, Duration::from_secs(120));
    let metrics = thread
        .shutdown(ShutdownMode::Drain)
        .expect("a clean shutdown");
    let (hit, injected) = match faults {
        Some(record) => {
            let record = record.lock().unwrap_or_else(|e| e.into_inner());
            (record.hit.clone(), record.injected)
        }
        None => (BTreeSet::new(), 0),
    };
    let mut report = count(run, &served, reference, &hit);
    report.leaked_blocks = (facts.kv_blocks_total - facts.kv_blocks_free) as u64;
    report.leaked_slots = (facts.live_slots_used + orphans) as u64;
    report.preemptions = metrics.preemptions;
    report.spills = metrics.spills;
    report.faults_injected = injected;
    report.wall_s = start.elapsed().as_secs_f64();
    report
}

/// What [`Chaos`] injected, and which requests its faults hit.
#[derive(Debug, Default)]
pub struct FaultRecord {
    /// Faults injected.
    pub injected: u64,
    /// Ids of the requests a fault hit (the rows of a failed launch or await, the sequence of a
    /// failed effect).
    pub hit: BTreeSet<u64>,
}

/// A router that forwards to `inner` but fails launches, awaits and per-sequence effects at
/// random (each with probability `percent`%), recording which requests each fault hit. A failed
/// await settles the step first, so the router's state is as after a device error in that step.
#[derive(Debug)]
pub struct Chaos<D> {
    inner: D,
    percent: u32,
    rng: Mutex<ChaCha8Rng>,
    record: Arc<Mutex<FaultRecord>>,
    /// The ids of each unsettled ticket's rows.
    rows: Mutex<HashMap<u64, Vec<u64>>>,
}

impl<D> Chaos<D> {
    /// Wraps `inner`; faults strike with probability `percent`%, drawn from `seed`.
    pub fn new(inner: D, percent: u32, seed: u64) -> Self {
        Chaos {
            inner,
            percent,
            rng: Mutex::new(ChaCha8Rng::seed_from_u64(seed)),
            record: Arc::default(),
            rows: Mutex::default(),
        }
    }

    /// The shared record of what was injected.
    pub fn record(&self) -> Arc<Mutex<FaultRecord>> {
        Arc::clone(&self.record)
    }

    fn strike(&self, hit: impl IntoIterator<Item = u64>) -> bool {
        let roll = self
            .rng
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .random_range(0..100);
        if roll >= self.percent {
            return false;
        }
        let mut record = self.record.lock().unwrap_or_else(|e| e.into_inner());
        record.injected += 1;
        record.hit.extend(hit);
        true
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
    fn launch(&self, plan: StepPlan<'_>, rows: &mut [&mut D::Seq]) -> Result<Ticket, DeviceError> {
        let ids: Vec<u64> = rows.iter().map(|seq| seq.id()).collect();
        if self.strike(ids.iter().copied()) {
            return Err(injected(Phase::Forward));
        }
        let ticket = self.inner.launch(plan, rows)?;
        self.rows
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(ticket.0, ids);
        Ok(ticket)
    }
    fn await_result(&self, ticket: Ticket) -> Result<StepResult<D::Ptr>, DeviceError> {
        let ids = self
            .rows
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&ticket.0)
            .unwrap_or_default();
        let result = self.inner.await_result(ticket)?;
        if self.strike(ids) {
            return Err(injected(Phase::Readback));
        }
        Ok(result)
    }
    fn apply(&self, effect: Effect<'_, D::Seq, D::Ptr>) -> Result<EffectOutcome, DeviceError> {
        let id = match &effect {
            Effect::ReleaseSeq { seq, .. }
            | Effect::CompactSlot { seq, .. }
            | Effect::RestoreSequenceState { seq, .. }
            | Effect::MarconiCheckpoint { seq } => Some(seq.id()),
            Effect::SaveSequenceState { seq, .. } => Some(seq.id()),
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

/// The host router's side of a soak.
#[derive(Debug, Clone)]
pub struct HostOptions {
    /// The model served.
    pub model: model::Model,
    /// KV blocks of 16 tokens.
    pub kv_blocks: usize,
    /// Live slots (and `max_running`).
    pub slots: usize,
    /// Longest sequence.
    pub max_context: usize,
}

fn host_router(options: &HostOptions, caches: bool) -> device_cpu::CpuRouter {
    let mut config = device_cpu::CpuRouterConfig::new(options.kv_blocks, options.slots);
    config.max_context = Some(options.max_context);
    config.prefix_cache = caches;
    config.marconi = caches;
    device_cpu::CpuRouter::new(options.model.clone(), config).expect("host router")
}

/// Each request of `planned` served alone on a fresh engine with both caches off (one at a time
/// on one engine: with the caches off nothing carries over from one request to the next).
fn alone_on_host(options: &HostOptions, planned: &[Planned]) -> Vec<Vec<u32>> {
    let roomy = HostOptions {
        kv_blocks: options.max_context.div_ceil(16) + 1,
        slots: 1,
        ..options.clone()
    };
    let config = EngineConfig {
        max_running: 1,
        ..EngineConfig::default()
    };
    let mut engine =
        scheduler::Engine::new(host_router(&roomy, false), config).expect("reference engine");
    let outputs = planned
        .iter()
        .map(|item| {
            let handle = engine
                .submit(Request::greedy(item.prompt.clone(), item.max_tokens))
                .expect("reference request");
            engine.run_until_idle();
            handle.wait().expect("reference output").tokens
        })
        .collect();
    engine
        .shutdown(ShutdownMode::Drain)
        .expect("reference shutdown");
    outputs
}

fn engine_config(slots: usize, preemption: scheduler::Preemption) -> EngineConfig {
    EngineConfig {
        max_running: slots,
        max_step_tokens: 256,
        max_prefill_chunk: 64,
        preemption,
        ..EngineConfig::default()
    }
}

/// Load on the host router with both caches on (prefix cache and Marconi checkpoints).
pub fn soak_host(workload: &WorkloadOptions, host: &HostOptions) -> SoakReport {
    let planned = plan(workload);
    let alone = alone_on_host(host, &planned);
    let reference = |index: usize, _: &Served| alone[index].clone();
    let engine = scheduler::Engine::new(
        host_router(host, true),
        engine_config(host.slots, scheduler::Preemption::Recompute),
    )
    .expect("engine");
    soak_engine(
        "host: load, caches on",
        engine,
        &planned,
        workload.clients,
        &reference,
        None,
    )
}

/// Memory pressure: `workload` on `host` (whose pool should be small enough to preempt often),
/// once per `mode`, both caches on. Answers one report per mode.
pub fn soak_pressure(
    workload: &WorkloadOptions,
    host: &HostOptions,
    modes: &[PressureMode],
) -> Vec<SoakReport> {
    let planned = plan(workload);
    let alone = alone_on_host(host, &planned);
    let reference = |index: usize, _: &Served| alone[index].clone();
    modes
        .iter()
        .map(|&mode| {
            let (name, preemption) = match mode {
                PressureMode::Recompute => (
                    "host: pressure, recompute",
                    scheduler::Preemption::Recompute,
                ),
                PressureMode::SpillMemory => (
                    "host: pressure, spill to memory",
                    scheduler::Preemption::Spill(scheduler::SpillTarget::Memory),
                ),
                PressureMode::SpillDirectory => (
                    "host: pressure, spill to a directory",
                    scheduler::Preemption::Spill(scheduler::SpillTarget::Directory(
                        std::env::temp_dir(),
                    )),
                ),
            };
            let engine = scheduler::Engine::new(
                host_router(host, true),
                engine_config(host.slots, preemption),
            )
            .expect("engine");
            soak_engine(name, engine, &planned, workload.clients, &reference, None)
        })
        .collect()
}

/// The scripted router with random faults at launch, await and per-sequence effects
/// (`fault_percent`% each), on `blocks` KV blocks of 4 tokens and `slots` slots.
pub fn soak_faults(
    workload: &WorkloadOptions,
    blocks: usize,
    slots: usize,
    fault_percent: u32,
    preemption: scheduler::Preemption,
) -> SoakReport {
    use device_io::testing::{ScriptedConfig, ScriptedRouter};
    let planned = plan(workload);
    let shape = ScriptedConfig {
        block_size: 4,
        num_blocks: blocks,
        num_slots: slots,
        vocab_size: workload.vocab_size as usize,
        max_depth: 1,
    };
    let chaos = Chaos::new(
        ScriptedRouter::new(shape),
        fault_percent,
        workload.seed ^ 0xFA17,
    );
    let record = chaos.record();
    let oracle = ScriptedRouter::new(shape);
    let reference = |_: usize, served: &Served| -> Vec<u32> {
        let (Some(id), prompt) = (served.id, served.planned.prompt.len()) else {
            return Vec::new();
        };
        (0..served.planned.max_tokens)
            .map(|i| oracle.fallback_token(id, prompt + i))
            .collect()
    };
    let engine = scheduler::Engine::new(chaos, engine_config(slots, preemption)).expect("engine");
    soak_engine(
        "scripted: random faults",
        engine,
        &planned,
        workload.clients,
        &reference,
        Some(&record),
    )
}
