//! The engine: a queue of requests and a set of running sequences, advanced one step at a time
//! over any router.
//!
//! # One step
//!
//! 1. Commands (submissions, cancellations, shutdown) are drained.
//! 2. **Admission**: waiting requests (preempted ones first, then new ones in arrival order) move
//!    to running while live slots allow and their tokens fit the reclaimable blocks (free plus
//!    cached, at most the pool minus what running sequences hold) less what running sequences
//!    still need for their current work; with nothing running the head always goes. A spilled one
//!    is restored with `RestoreSequenceState`, any other gets a fresh sequence.
//! 3. **Decode**: every running sequence whose prompt is complete feeds its last token. The
//!    readback is the device `Argmax` unless a row needs host logits (random sampling or a logits
//!    digest), then `HostLogits`.
//! 4. **Prefill**: sequences whose prompt is not complete advance by chunks, within the step's
//!    token budget (`max_step_tokens` minus the decode rows) and `max_prefill_chunk` per row.
//! 5. `MarconiCheckpoint` for every sequence that [`Sequence::checkpoint_due`] (live, or ended
//!    by its own output this step: that position is real).
//! 6. Ended requests are released (`ReleaseSeq { cache: true }` when finished or cancelled,
//!    `cache: false` when failed) and their final event is sent. A release the router refuses is
//!    retried without caching; if that fails too, the sequence becomes an *orphan* that is
//!    released again at every later step and before teardown.
//! 7. **Compaction**: survivors holding slots at or above `n` (the number of slot holders,
//!    orphans included) move down with `CompactSlot` into slots below `n` that neither a survivor
//!    nor an orphan holds, so live sequences occupy slots `0..n`.
//!
//! With [`EngineConfig::speculation`], step 3 is a speculative step instead: drafts, one
//! `Verify` launch of every decode row, acceptance, and the exact rollback of rejected positions
//! (see the `speculate` module); on a router of depth 2 it may run ahead by cohorts
//! ([`SpecOverlap`]): one half of the rows launches its verification while the other half's
//! settles.
//!
//! With a router whose `max_depth()` is 2, a step with only greedy or forced decode rows keeps
//! one decode step in flight instead: it launches step t+1 (`DecodeFed`) before it reads step t,
//! and falls back to the step above (after awaiting what is in flight) by the drain rule; see
//! [`pipeline`] for the protocol, the over-run rollback and the rule.
//!
//! A launch that finds the KV pool (or the slots) dry changed nothing; the engine first releases
//! requests that ended earlier in the step, then retries its orphans (a victim's release may
//! have failed earlier in the step), else preempts a victim (fewest generated tokens, not
//! resumed in the last `protect_steps` steps unless all were; the latest arrival on ties; only
//! sequences that hold a slot or are rows of the plan) and relaunches without it. A row that cannot fit even when
//! it is the only live sequence fails with [`ServeError::CannotFit`]. Any other launch error fails
//! exactly that plan's rows.
//!
//! A lost device is different: when any router call answers `DeviceLost`, or panics (every call
//! goes through `Guarded`, which turns a panic into `DeviceLost`), the engine fails every live and
//! waiting request with [`ServeError::DeviceLost`] (a request whose output was already complete
//! finishes), refuses new submissions, calls the router no more, and its shutdown answers
//! [`EngineError::DeviceLost`] after the router's teardown.
//!
//! # Invariants
//!
//! - A request is in exactly one of `waiting` and `running`, or has ended and been sent its
//!   final event (and is in neither).
//! - Every sequence in `running` may hold router resources; a sequence in `waiting` holds none
//!   (it was released, or never launched); an orphan holds what the router would not take back
//!   and belongs to no request.
//! - `Tracked::end` is `None` for every request in `waiting`; in `running` it is set only between
//!   the moment a request ends and the release at the end of the same step.
//! - `Tracked::tokens` is the prompt followed by every generated token; a decode row feeds the
//!   last of them, and a recompute creates its sequence from all of them.

use std::collections::VecDeque;
use std::num::NonZeroUsize;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use crossbeam_channel::{Receiver, Sender};
use device_io::{
    CacheEvent, DeviceError, DeviceIo, Effect, LoraAck, LoraCommand, LoraError, Readback,
    RowOutput, SeqSpec, Sequence, StepPlan, StepResult,
};
use xxhash_rust::xxh3::Xxh3;

mod pipeline;
mod speculate;

pub use pipeline::PipelineFault;
pub use speculate::{Drafter, SpecFault, SpecOverlap, Speculation, MAX_DRAFTS};

use crate::cache_events::{self, ChannelSink};
use crate::event::{Event, FinishReason, ServeError, Usage};
use crate::guard::Guarded;
use crate::handle::{
    Command, ControlError, EngineClient, EngineStats, Intake, RequestHandle, ShutdownMode,
};
use crate::metrics::{Metrics, StepReport};
use crate::request::{Limits, Request, RequestError};
use crate::sampling::Sampler;
use crate::spill::{token_digest, ImageTag, SpillError, SpillStore, SpillTarget};

/// How often an idle engine on its own thread retries the release of its orphans.
const ORPHAN_RETRY: std::time::Duration = std::time::Duration::from_millis(10);

/// How a preempted sequence comes back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Preemption {
    /// Release it with `ReleaseSeq { cache: true }` and later prefill prompt plus generated
    /// tokens again (mostly served from the prefix cache when it is on).
    Recompute,
    /// Save its image with `SaveSequenceState`, release it, and later `RestoreSequenceState`.
    /// A failed save or restore falls back to recompute.
    Spill(SpillTarget),
}

/// The engine's policy knobs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineConfig {
    /// The most running sequences (also bounded by the router's live slots); at least 1.
    pub max_running: usize,
    /// Tokens one step may compute: one per decode row plus the prefill chunks. Must exceed
    /// `max_running`, so prefill always gets some budget.
    pub max_step_tokens: usize,
    /// The most prompt tokens one row computes in one step; at least 1.
    pub max_prefill_chunk: usize,
    /// How preempted sequences come back.
    pub preemption: Preemption,
    /// A sequence resumed (restored or readmitted) within this many steps is not chosen as a
    /// victim unless every candidate was.
    pub protect_steps: u64,
    /// The router streams to `Quiesce` at shutdown.
    pub streams: Vec<u64>,
    /// Speculative decoding (see [`Speculation`]); `None` decodes
    /// one token per row and step.
    pub speculation: Option<Speculation>,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            max_running: 32,
            max_step_tokens: 512,
            max_prefill_chunk: 256,
            preemption: Preemption::Recompute,
            protect_steps: 4,
            streams: vec![0],
            speculation: None,
        }
    }
}

/// An engine-level error (construction, shutdown); request-level failures are [`ServeError`]s.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// A configuration value breaks its rule.
    #[error("engine config: {field} = {value} breaks the rule `{rule}`")]
    Config {
        /// The field.
        field: &'static str,
        /// Its value.
        value: usize,
        /// The rule it breaks.
        rule: &'static str,
    },
    /// Speculation with `k` drafts per row needs a snapshot ring of at least `k` slots, and the
    /// router reports fewer ([`device_io::DeviceFacts::snapshot_slots_total`]).
    #[error(
        "speculation with k = {k} drafts per row needs at least {k} snapshot ring slots; the router has {slots}"
    )]
    SnapshotRing {
        /// Drafts per row.
        k: usize,
        /// The router's snapshot ring slots.
        slots: usize,
    },
    /// The spill directory given is unusable, or the engine's own could not be created in it.
    #[error(transparent)]
    SpillDirectory(SpillError),
    /// A shutdown effect failed (the remaining shutdown steps still ran).
    #[error("shutdown effect {effect} failed: {source}")]
    Shutdown {
        /// The effect that failed.
        effect: &'static str,
        /// The router's error.
        #[source]
        source: DeviceError,
    },
    /// The router's teardown failed (for example, sequences still held resources).
    #[error("router teardown failed: {0}")]
    Teardown(#[source] DeviceError),
    /// The device was lost (a router call answered `DeviceLost`, or panicked) before the
    /// shutdown; every request was failed then, and the shutdown touched the router no more than
    /// its teardown.
    #[error("the device was lost: {0}")]
    DeviceLost(#[source] DeviceError),
    /// The engine thread panicked.
    #[error("the engine thread panicked")]
    ThreadPanicked,
}

/// Why a request ended (set during a step, acted on when the step releases it).
#[derive(Debug)]
enum End {
    Finish(FinishReason),
    Fail(ServeError),
}

/// A request's running logits hash (the hasher's state is large, so it lives on the heap).
struct Digest(Box<Xxh3>);

impl std::fmt::Debug for Digest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Digest")
    }
}

/// The engine's state of one accepted request.
#[derive(Debug)]
pub(crate) struct Tracked {
    id: u64,
    /// Prompt, then every generated token.
    tokens: Vec<u32>,
    prompt_len: usize,
    max_tokens: usize,
    stop_tokens: Vec<u32>,
    adapter: Option<u32>,
    cache_salt: Option<u64>,
    sampler: Sampler,
    digest: Option<Digest>,
    events: Sender<Event>,
    arrived: Instant,
    scheduled: Option<Instant>,
    first_token: Option<Instant>,
    last_token: Option<Instant>,
    cached_tokens: usize,
    preemptions: usize,
    /// The step it was last resumed at (restored, or readmitted after a preemption).
    resumed_at: Option<u64>,
    end: Option<End>,
}

impl Tracked {
    pub(crate) fn new(id: u64, request: Request, events: Sender<Event>) -> Self {
        let prompt_len = request.prompt.len();
        let mut tokens = request.prompt;
        // Room for the usual output; a very long one grows the vector as it goes.
        tokens.reserve(request.max_tokens.min(4096));
        Tracked {
            id,
            tokens,
            prompt_len,
            max_tokens: request.max_tokens,
            stop_tokens: request.stop_tokens,
            adapter: request.adapter,
            cache_salt: request.cache_salt,
            sampler: Sampler::new(request.sampling),
            digest: request.logits_digest.then(|| Digest(Box::new(Xxh3::new()))),
            events,
            arrived: Instant::now(),
            scheduled: None,
            first_token: None,
            last_token: None,
            cached_tokens: 0,
            preemptions: 0,
            resumed_at: None,
            end: None,
        }
    }

    fn generated(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }

    fn needs_logits(&self) -> bool {
        self.digest.is_some() || self.sampler.needs_logits()
    }

    fn spec(&self) -> SeqSpec<'_> {
        SeqSpec {
            id: self.id,
            prompt: &self.tokens,
            adapter: self.adapter,
            cache_salt: self.cache_salt,
        }
    }

    /// Appends a generated token, streams it, and sets `end` when a stop condition holds.
    fn push_token(&mut self, token: u32, now: Instant) {
        self.tokens.push(token);
        self.first_token.get_or_insert(now);
        self.last_token = Some(now);
        if self.events.send(Event::Token(token)).is_err() {
            // Nobody listens any more: stop spending compute on it.
            self.end = Some(End::Finish(FinishReason::Cancelled));
        } else if self.stop_tokens.contains(&token) {
            self.end = Some(End::Finish(FinishReason::Stop(token)));
        } else if self.generated() >= self.max_tokens {
            self.end = Some(End::Finish(FinishReason::Length));
        }
    }

    fn usage(&self) -> Usage {
        let generated = self.generated();
        let time_per_output_token = match (self.first_token, self.last_token) {
            (Some(first), Some(last)) if generated >= 2 => {
                Some((last - first) / (generated as u32 - 1))
            }
            _ => None,
        };
        Usage {
            prompt_tokens: self.prompt_len,
            cached_tokens: self.cached_tokens,
            generated_tokens: generated,
            queue_time: self
                .scheduled
                .map(|at| at - self.arrived)
                .unwrap_or_default(),
            time_to_first_token: self.first_token.map(|at| at - self.arrived),
            time_per_output_token,
            preemptions: self.preemptions,
        }
    }

    /// Sends the final event for `end` (the receiver may be gone; that is fine).
    fn send_final(&mut self, end: End) {
        let event = match end {
            End::Finish(reason) => Event::Finished {
                reason,
                usage: self.usage(),
                logits_digest: self.digest.as_ref().map(|digest| digest.0.digest()),
            },
            End::Fail(err) => Event::Error(err),
        };
        let _ = self.events.send(event);
    }
}

#[derive(Debug)]
struct Active<S> {
    seq: S,
    req: Tracked,
    /// Whether the sequence is a row of the plan being built or settled.
    in_plan: bool,
    /// Whether the sequence is a row of the decode step in flight (depth 2).
    in_flight: bool,
    /// Never offer the sequence to the prefix cache (a rollback of its over-run failed).
    no_cache: bool,
    /// The drafts proposed for this step (speculative decoding).
    drafts: Vec<u32>,
    /// The snapshot ring slot named for each draft (the SSM state after it).
    draft_slots: Vec<usize>,
    /// The length the sequence had when the router's MTP head proposed `drafts` (`None`: they
    /// came from a drafter in the core, or there are none); drafts of the current length that
    /// no verification took are proposed again by no `Draft` (see `engine::speculate`).
    drafts_at: Option<usize>,
}

#[derive(Debug)]
struct Waiting<S> {
    req: Tracked,
    /// The released sequence whose image is in the spill store, when it was spilled.
    spilled: Option<Spilled<S>>,
}

/// A spilled request's released sequence and what its image holds.
#[derive(Debug)]
struct Spilled<S> {
    seq: S,
    tag: ImageTag,
    /// The router's MTP drafts for the sequence's next step that no verification took, and the
    /// length they were proposed at: the head consumed its catch-up ring to propose them (the
    /// image carries that ring), so they come back with the sequence.
    drafts: Option<(usize, Vec<u32>)>,
}

/// Buffers reused by every step, so a steady state allocates nothing of its own.
#[derive(Debug, Default)]
struct Scratch {
    tokens: Vec<u32>,
    budgets: Vec<usize>,
    logits: Vec<f32>,
    sample: Vec<(f32, u32)>,
    slot_used: Vec<bool>,
    /// The allocation of the per-launch `Vec<&mut Seq>`, kept empty between launches.
    rows: Vec<usize>,
    /// The per-row sources of a fed step.
    sources: Vec<device_io::Feed>,
    /// Logits copied with `ReadLogits` for digests at depth 2.
    logit_bytes: Vec<u8>,
    /// A spare row-id list for the next step in flight.
    flight_ids: Vec<u64>,
}

/// Reuses the allocation of an (emptied) vector for elements of another type of the same size
/// and alignment, such as `&mut T` and `usize`; the standard library collects in place then.
fn recycle<T, U>(mut vec: Vec<T>) -> Vec<U> {
    vec.clear();
    vec.into_iter().map(|_| -> U { unreachable!() }).collect()
}

/// Which plan a launch loop builds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PlanKind {
    Decode,
    Prefill,
}

impl PlanKind {
    fn name(self) -> &'static str {
        match self {
            PlanKind::Decode => "Decode",
            PlanKind::Prefill => "Prefill",
        }
    }
}

/// The engine over router `D`; see the module docs for what a step does.
///
/// End it with [`Engine::shutdown`]: dropping it instead drops the router without `teardown`
/// and cuts every request's stream ([`ServeError::EngineStopped`] on the handles).
pub struct Engine<D: DeviceIo> {
    router: Guarded<D>,
    config: EngineConfig,
    limits: Arc<Limits>,
    waiting: VecDeque<Waiting<D::Seq>>,
    running: Vec<Active<D::Seq>>,
    commands: Receiver<Command>,
    command_tx: Sender<Command>,
    /// Closed when a shutdown begins; clients check it before queueing a submission.
    intake: Intake,
    next_id: Arc<AtomicU64>,
    spill: Option<SpillStore>,
    /// Sequences whose release failed twice; released again every step until the router takes
    /// them (they belong to no request any more).
    orphans: Vec<D::Seq>,
    step_no: u64,
    /// Requests retired during the current step (for its [`StepReport`]).
    step_ended: usize,
    metrics: Metrics,
    shutdown_requested: Option<ShutdownMode>,
    closed: bool,
    scratch: Scratch,
    /// The router's depth (2: the engine may keep a decode step in flight).
    depth: usize,
    /// The router's snapshot ring slots ([`device_io::DeviceFacts::snapshot_slots_total`]), which
    /// speculation's verifications name.
    ring_slots: usize,
    /// The decode step in flight, launched and not awaited yet (depth 2).
    flight: Option<pipeline::Flight>,
    /// The verification in flight, launched and not awaited yet (speculation at depth 2).
    spec_flight: Option<speculate::SpecFlight>,
    /// A deliberate fault of the depth-2 protocol (the oracle's negative control).
    pipeline_fault: Option<PipelineFault>,
    /// A deliberate fault of the speculative protocol (the oracle's negative control).
    spec_fault: Option<SpecFault>,
    /// Cache-event subscriptions that fell behind (the subscriptions' sinks count them).
    cache_event_lags: Arc<AtomicU64>,
    /// LoRA commands from clients, applied at the next quiescent point.
    lora_commands: VecDeque<LoraQueued>,
    /// How a LoRA command reaches the router (fixed by [`Engine::new`]).
    lora_path: LoraPath<D>,
}

/// A LoRA command's way to the router, with the router's command and ack types converted.
type LoraPath<D> = fn(&mut Guarded<D>, LoraCommand) -> Result<LoraAck, LoraError>;

/// A client's LoRA command and where its answer goes.
type LoraQueued = (LoraCommand, Sender<Result<LoraAck, ControlError>>);

impl<D: DeviceIo> std::fmt::Debug for Engine<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("config", &self.config)
            .field("limits", &self.limits)
            .field("waiting", &self.waiting.len())
            .field("running", &self.running.len())
            .field("step", &self.step_no)
            .field("metrics", &self.metrics)
            .finish_non_exhaustive()
    }
}

impl<D> Engine<D>
where
    D: DeviceIo,
    D::Seq: Sequence,
    D::LoraCmd: From<LoraCommand>,
    D::LoraAck: Into<LoraAck>,
{
    /// An engine over `router` (idle, nothing queued). Requests may name the LoRA adapters
    /// loaded through the engine ([`Engine::lora`], [`EngineClient::lora`]); a router handed in
    /// with adapters already loaded makes them nameable after one `LoraCommand::List`.
    ///
    /// The router's LoRA command and ack types must convert from and to the workspace's
    /// ([`LoraCommand`], [`LoraAck`]); that conversion is fixed here, once, so nothing else about
    /// the engine depends on it.
    pub fn new(router: D, config: EngineConfig) -> Result<Self, EngineError> {
        let check = |ok: bool, field: &'static str, value: usize, rule: &'static str| {
            if ok {
                Ok(())
            } else {
                Err(EngineError::Config { field, value, rule })
            }
        };
        check(
            config.max_running >= 1,
            "max_running",
            config.max_running,
            "max_running >= 1",
        )?;
        check(
            config.max_prefill_chunk >= 1,
            "max_prefill_chunk",
            config.max_prefill_chunk,
            "max_prefill_chunk >= 1",
        )?;
        check(
            config.max_step_tokens > config.max_running,
            "max_step_tokens",
            config.max_step_tokens,
            "max_step_tokens > max_running",
        )?;
        if let Some(spec) = &config.speculation {
            check(
                (1..=MAX_DRAFTS).contains(&spec.k),
                "speculation.k",
                spec.k,
                "1 <= k <= MAX_DRAFTS (8)",
            )?;
        }
        let spill = match &config.preemption {
            Preemption::Recompute => None,
            Preemption::Spill(target) => {
                Some(SpillStore::open(target).map_err(EngineError::SpillDirectory)?)
            }
        };
        let router = Guarded::new(router);
        let lora_path: LoraPath<D> = Guarded::lora;
        let limits = Arc::new(Limits::new(&router.facts(), Vec::new()));
        let (command_tx, commands) = crossbeam_channel::unbounded();
        let scratch = Scratch {
            rows: Vec::with_capacity(config.max_running),
            tokens: Vec::with_capacity(config.max_running),
            budgets: Vec::with_capacity(config.max_running),
            sources: Vec::with_capacity(config.max_running),
            flight_ids: Vec::with_capacity(config.max_running),
            ..Scratch::default()
        };
        let depth = router.inner().max_depth();
        // Speculation names ring slots of the router's own ring, whose size it reports.
        let ring_slots = router.facts().snapshot_slots_total;
        if let Some(spec) = &config.speculation {
            if ring_slots < spec.k {
                return Err(EngineError::SnapshotRing {
                    k: spec.k,
                    slots: ring_slots,
                });
            }
        }
        Ok(Engine {
            router,
            config,
            limits,
            waiting: VecDeque::new(),
            running: Vec::new(),
            commands,
            command_tx,
            intake: Intake::default(),
            next_id: Arc::new(AtomicU64::new(1)),
            spill,
            orphans: Vec::new(),
            step_no: 0,
            step_ended: 0,
            metrics: Metrics::default(),
            shutdown_requested: None,
            closed: false,
            scratch,
            depth,
            ring_slots,
            flight: None,
            spec_flight: None,
            pipeline_fault: None,
            spec_fault: None,
            cache_event_lags: Arc::new(AtomicU64::new(0)),
            lora_commands: VecDeque::new(),
            lora_path,
        })
    }
}

impl<D> Engine<D>
where
    D: DeviceIo,
    D::Seq: Sequence,
{
    /// The router (for facts and inspection; the engine owns every sequence).
    pub fn router(&self) -> &D {
        self.router.inner()
    }

    /// The error that lost the device, if one did: every request was failed then, new ones are
    /// refused, and the router is called no more (but for its teardown at shutdown).
    pub fn device_lost(&self) -> Option<&DeviceError> {
        self.router.lost()
    }

    /// What requests are checked against.
    pub fn limits(&self) -> &Limits {
        &self.limits
    }

    /// The configuration.
    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    /// Cumulative counters.
    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    /// The directory the spill store owns (removed at shutdown), when spilling to files.
    pub fn spill_directory(&self) -> Option<&std::path::Path> {
        self.spill.as_ref().and_then(SpillStore::directory)
    }

    /// A snapshot of the engine and its router.
    pub fn stats(&self) -> EngineStats {
        let mut metrics = self.metrics;
        metrics.cache_event_lags = self.cache_event_lags.load(Ordering::Relaxed);
        EngineStats {
            facts: self.router.facts(),
            metrics,
            waiting: self.waiting.len(),
            running: self.running.len(),
            orphans: self.orphans.len(),
            device_lost: self.router.lost().cloned(),
        }
    }

    /// Drops every cached prefix that no running request holds (vLLM's `reset_prefix_cache`).
    pub fn clear_prefix_cache(&self) -> Result<(), DeviceError> {
        self.router.clear_prefix_cache()
    }

    /// Subscribes to the prefix cache's events with the default backlog; see
    /// [`crate::cache_events`]. The stream starts with the blocks cached now. A router without
    /// cache events answers `DeviceError::Unsupported`.
    pub fn subscribe_cache_events(&self) -> Result<Receiver<CacheEvent>, DeviceError> {
        self.subscribe_cache_events_with_backlog(cache_events::default_backlog(
            &self.router.facts(),
        ))
    }

    /// [`Engine::subscribe_cache_events`] with room for `backlog` unreceived events.
    pub fn subscribe_cache_events_with_backlog(
        &self,
        backlog: NonZeroUsize,
    ) -> Result<Receiver<CacheEvent>, DeviceError> {
        let (sink, receiver) = ChannelSink::new(backlog, Arc::clone(&self.cache_event_lags));
        self.router.subscribe_cache_events(Box::new(sink))?;
        Ok(receiver)
    }

    /// Brings `metrics.cache_event_lags` up to date with what the subscriptions counted (at the
    /// end of every step, in [`Engine::stats`] and at shutdown).
    fn count_cache_event_lags(&mut self) {
        self.metrics.cache_event_lags = self.cache_event_lags.load(Ordering::Relaxed);
    }

    /// Requests waiting (new or preempted).
    pub fn waiting_len(&self) -> usize {
        self.waiting.len()
    }

    /// Requests running (holding or about to hold router resources).
    pub fn running_len(&self) -> usize {
        self.running.len()
    }

    /// Sequences whose release the router refused twice; each later step (and shutdown)
    /// releases them again, so they hold router resources only until a release succeeds.
    pub fn orphans_len(&self) -> usize {
        self.orphans.len()
    }

    /// Whether nothing is waiting or running (commands not yet drained are not counted, and
    /// neither are [orphans](Self::orphans_len), which hold resources but serve no request).
    pub fn is_idle(&self) -> bool {
        self.waiting.is_empty() && self.running.is_empty()
    }

    /// A cloneable, `Send` client that submits to this engine (through its command channel;
    /// the submissions are taken at the start of the next step).
    pub fn client(&self) -> EngineClient {
        EngineClient::new(
            self.command_tx.clone(),
            Arc::clone(&self.limits),
            Arc::clone(&self.next_id),
            self.intake.clone(),
        )
    }

    /// Validates and queues `request`; its events arrive on the handle as steps run.
    pub fn submit(&mut self, request: Request) -> Result<RequestHandle, RequestError> {
        if self.closed || self.router.lost().is_some() {
            return Err(RequestError::EngineStopped);
        }
        self.limits.validate(&request)?;
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (events_tx, events) = crossbeam_channel::unbounded();
        self.waiting.push_back(Waiting {
            req: Tracked::new(id, request, events_tx),
            spilled: None,
        });
        Ok(RequestHandle::new(id, events, self.command_tx.clone()))
    }

    /// Runs steps until nothing is waiting or running.
    pub fn run_until_idle(&mut self) {
        self.drain_commands();
        self.apply_lora_commands();
        while !self.is_idle() {
            self.step();
        }
        if !self.orphans.is_empty() && self.router.lost().is_none() {
            self.release_orphans();
        }
    }

    /// Runs the engine loop on the current thread until a shutdown command arrives, then shuts
    /// down (used by [`crate::EngineThread`]).
    pub fn run(mut self) -> Result<Metrics, EngineError> {
        loop {
            if let Some(mode) = self.shutdown_requested {
                return self.shutdown(mode);
            }
            if self.is_idle() {
                // Orphans hold router resources until a release succeeds: an idle engine keeps
                // retrying them (every `ORPHAN_RETRY`) instead of leaving them until the next
                // request arrives.
                if !self.orphans.is_empty() && self.router.lost().is_none() {
                    self.release_orphans();
                }
                let command = if self.orphans.is_empty() {
                    // The engine holds a sender itself, so this only returns with a command.
                    self.commands.recv().ok()
                } else {
                    self.commands.recv_timeout(ORPHAN_RETRY).ok()
                };
                if let Some(command) = command {
                    self.handle_command(command);
                }
                self.apply_lora_commands();
                continue;
            }
            self.step();
        }
    }

    /// One step (see the module docs).
    pub fn step(&mut self) -> StepReport {
        self.drain_commands();
        self.apply_lora_commands();
        self.step_ended = 0;
        self.step_no += 1;
        self.metrics.steps += 1;
        let mut report = StepReport::default();
        if self.abandon_if_lost() {
            return self.end_step(report);
        }
        // Depth 2: run ahead (launch the next fed step, then read the one in flight), or drain.
        if self.flight.is_some() && self.run_ahead(&mut report) {
            self.checkpoints(false);
            // Rows of the step in flight stay; compaction waits for a step with nothing in flight.
            self.release_ended(false);
            return self.end_step(report);
        }
        let speculation = self.config.speculation.clone();
        // Speculation at depth 2: the other cohort launches its verification while the one in
        // flight settles, or the flight drains.
        if let Some(spec) = &speculation {
            if self.spec_flight.is_some() && self.spec_run_ahead(spec, &mut report) {
                // The settled rows' kept positions are real, their checkpoints too.
                self.checkpoints(true);
                self.release_ended(false);
                return self.end_step(report);
            }
        }
        if self.abandon_if_lost() {
            return self.end_step(report);
        }
        report.admitted = self.admit();
        if self.can_start_flight() {
            self.release_ended(true);
            if self.router.lost().is_none() && self.start_flight() {
                self.checkpoints(false);
                self.abandon_if_lost();
                return self.end_step(report);
            }
        }
        if let Some(spec) = &speculation {
            if self.can_start_spec_flight() {
                self.release_ended(true);
                if self.router.lost().is_none() && self.start_spec_flight(spec, &mut report) {
                    self.checkpoints(false);
                    self.abandon_if_lost();
                    return self.end_step(report);
                }
            }
        }
        let preemptions_before = self.metrics.preemptions;
        let decode_rows = match &speculation {
            Some(spec) => self.speculative_decode(spec),
            None => self.launch_loop(PlanKind::Decode, 0).0,
        };
        report.decode_rows += decode_rows;
        let (rows, tokens) = self.launch_loop(PlanKind::Prefill, decode_rows);
        report.prefill_rows = rows;
        report.prefill_tokens = tokens;
        report.preempted = (self.metrics.preemptions - preemptions_before) as usize;
        // A row that ended by its own output this step still computed a real position, so its
        // checkpoint is taken as at depth 2 (where it is taken before the output is read).
        self.checkpoints(true);
        self.release_ended(true);
        self.end_step(report)
    }

    /// Releases the ended requests that are not rows of a step in flight, compacts the
    /// survivors' slots (when `compact`), and retries the orphans; unless the device is lost,
    /// which ends every request at once with nothing released on it.
    fn release_ended(&mut self, compact: bool) {
        // A device lost during the step fails everything before anything is released on it.
        if self.abandon_if_lost() {
            return;
        }
        self.retire_ended();
        if compact {
            for _ in 0..3 {
                // A failed `CompactSlot` ends its request; release it and compact again.
                if self.compact() {
                    break;
                }
                self.retire_ended();
            }
        }
        if !self.orphans.is_empty() {
            self.release_orphans();
        }
        self.abandon_if_lost();
    }

    fn end_step(&mut self, mut report: StepReport) -> StepReport {
        report.ended = std::mem::take(&mut self.step_ended);
        self.count_cache_event_lags();
        report
    }

    /// When the device is lost, ends every request at once without touching the router: a
    /// request whose output was complete finishes, every other one fails with
    /// [`ServeError::DeviceLost`] (unless it had already failed for another reason); spilled
    /// images are dropped, orphans forgotten, and new submissions refused. Answers whether the
    /// device is lost.
    fn abandon_if_lost(&mut self) -> bool {
        let Some(lost) = self.router.lost() else {
            return false;
        };
        // A step in flight on a lost device is never awaited.
        self.flight = None;
        self.spec_flight = None;
        let message = match lost {
            DeviceError::DeviceLost(message) => message.clone(),
            other => other.to_string(),
        };
        self.intake.close();
        self.orphans.clear();
        for mut waiting in std::mem::take(&mut self.waiting) {
            if let Some(store) = &mut self.spill {
                store.remove(waiting.req.id);
            }
            self.metrics.failed += 1;
            self.step_ended += 1;
            waiting
                .req
                .send_final(End::Fail(ServeError::DeviceLost(message.clone())));
        }
        for Active { mut req, .. } in std::mem::take(&mut self.running) {
            self.step_ended += 1;
            let end = match req.end.take() {
                Some(End::Finish(reason)) => {
                    if reason == FinishReason::Cancelled {
                        self.metrics.cancelled += 1;
                    } else {
                        self.metrics.finished += 1;
                    }
                    End::Finish(reason)
                }
                Some(End::Fail(err)) if !is_loss(&err) => {
                    self.metrics.failed += 1;
                    End::Fail(err)
                }
                _ => {
                    self.metrics.failed += 1;
                    End::Fail(ServeError::DeviceLost(message.clone()))
                }
            };
            req.send_final(end);
        }
        true
    }

    /// Shuts down: finishes (`Drain`) or fails (`Abort`) every request, then applies
    /// `EpShutdown`, `Quiesce` for each configured stream, and tears the router down. Every
    /// stage runs even if an earlier one failed; the first failure is the error.
    pub fn shutdown(mut self, mode: ShutdownMode) -> Result<Metrics, EngineError> {
        self.closed = true;
        // After this every submission is either in the channel (and failed by the drain below)
        // or refused at `submit`.
        self.intake.close();
        self.drain_commands();
        if mode == ShutdownMode::Drain {
            while !self.is_idle() {
                self.step();
            }
        }
        // Nothing may be released while a step computes on it.
        self.drain_flight();
        self.apply_lora_commands();
        if self.abandon_if_lost() {
            // Nothing but the teardown reaches a lost router; what it reports is moot.
            let Engine { router, .. } = self;
            let lost = router.lost().cloned();
            if let Err(err) = router.teardown() {
                tracing::warn!(%err, "teardown of the lost router");
            }
            return Err(EngineError::DeviceLost(
                lost.unwrap_or_else(|| DeviceError::DeviceLost("unknown".to_string())),
            ));
        }
        for mut waiting in std::mem::take(&mut self.waiting) {
            if let Some(store) = &mut self.spill {
                store.remove(waiting.req.id);
            }
            self.metrics.failed += 1;
            waiting.req.send_final(End::Fail(ServeError::Shutdown));
        }
        for active in &mut self.running {
            active.req.end = Some(End::Fail(ServeError::Shutdown));
        }
        self.retire_ended();
        self.release_orphans();
        let mut first_error = None;
        if let Err(source) = self.router.apply(Effect::EpShutdown) {
            first_error.get_or_insert(EngineError::Shutdown {
                effect: "EpShutdown",
                source,
            });
        }
        for &stream in &self.config.streams {
            if let Err(source) = self.router.apply(Effect::Quiesce { stream }) {
                first_error.get_or_insert(EngineError::Shutdown {
                    effect: "Quiesce",
                    source,
                });
            }
        }
        self.count_cache_event_lags();
        let Engine {
            router, metrics, ..
        } = self;
        if let Err(err) = router.teardown() {
            first_error.get_or_insert(EngineError::Teardown(err));
        }
        match first_error {
            None => Ok(metrics),
            Some(err) => Err(err),
        }
    }

    fn drain_commands(&mut self) {
        while let Ok(command) = self.commands.try_recv() {
            self.handle_command(command);
        }
    }

    fn handle_command(&mut self, command: Command) {
        match command {
            Command::Submit(req) => {
                let mut req = *req;
                if self.closed || self.shutdown_requested.is_some() || self.router.lost().is_some()
                {
                    // It arrived after the engine stopped taking requests.
                    self.metrics.failed += 1;
                    req.send_final(End::Fail(ServeError::EngineStopped));
                } else if let Some(adapter) =
                    req.adapter.filter(|&a| !self.limits.adapters.contains(a))
                {
                    // The client checked it against the adapters loaded then; an unload was
                    // applied before the engine took it in.
                    self.metrics.failed += 1;
                    req.send_final(End::Fail(ServeError::AdapterNotLoaded { adapter }));
                } else {
                    self.waiting.push_back(Waiting { req, spilled: None });
                }
            }
            Command::Cancel(id) => self.cancel(id),
            Command::Shutdown(mode) => {
                self.intake.close();
                self.shutdown_requested.get_or_insert(mode);
            }
            // The asker may have given up waiting; that is fine.
            Command::Stats(answer) => {
                let _ = answer.send(self.stats());
            }
            Command::ClearPrefixCache(answer) => {
                let _ = answer.send(self.clear_prefix_cache());
            }
            Command::SubscribeCacheEvents { backlog, answer } => {
                let subscribed = match backlog {
                    Some(backlog) => self.subscribe_cache_events_with_backlog(backlog),
                    None => self.subscribe_cache_events(),
                };
                let _ = answer.send(subscribed);
            }
            Command::Lora(cmd, answer) => self.lora_commands.push_back((cmd, answer)),
        }
    }

    /// Applies a LoRA command now: at depth 2 the step in flight is drained first (awaited and
    /// its outputs taken), so the router is quiescent. An unload is refused with
    /// [`LoraError::InUse`] while an unfinished request (waiting, preempted or running) names
    /// the adapter; otherwise the router's ack or error is the answer. Requests may name an
    /// adapter once its load is acknowledged, and no longer once its unload is.
    pub fn lora(&mut self, cmd: LoraCommand) -> Result<LoraAck, ControlError> {
        if let Some(lost) = self.router.lost() {
            return Err(ControlError::Lora(LoraError::DeviceLost(lost.to_string())));
        }
        if self.flight.is_some() || self.spec_flight.is_some() {
            self.metrics.lora_drains += 1;
            self.drain_flight();
        }
        if let LoraCommand::Unload { adapter } = cmd {
            let mut users: Vec<u64> = self
                .waiting
                .iter()
                .map(|w| &w.req)
                .chain(self.running.iter().map(|a| &a.req))
                .filter(|req| req.adapter == Some(adapter))
                .map(|req| req.id)
                .collect();
            if !users.is_empty() {
                users.sort_unstable();
                return Err(ControlError::Lora(LoraError::InUse {
                    adapter,
                    sequences: users,
                }));
            }
        }
        let result = (self.lora_path)(&mut self.router, cmd);
        self.abandon_if_lost();
        let ack = result?;
        let adapters = &self.limits.adapters;
        match &ack {
            LoraAck::Loaded(info) => adapters.insert(info.adapter),
            LoraAck::Unloaded { adapter, .. } => adapters.remove(*adapter),
            LoraAck::Listed {
                adapters: listed, ..
            } => {
                adapters.replace(listed.iter().map(|a| a.adapter));
            }
        }
        self.metrics.lora_commands += 1;
        Ok(ack)
    }

    /// Applies the LoRA commands clients queued, in order, and answers each.
    fn apply_lora_commands(&mut self) {
        while let Some((cmd, answer)) = self.lora_commands.pop_front() {
            let result = self.lora(cmd);
            // The asker may have given up waiting; that is fine.
            let _ = answer.send(result);
        }
    }

    fn cancel(&mut self, id: u64) {
        if let Some(active) = self.running.iter_mut().find(|a| a.req.id == id) {
            active
                .req
                .end
                .get_or_insert(End::Finish(FinishReason::Cancelled));
        } else if let Some(index) = self.waiting.iter().position(|w| w.req.id == id) {
            if let Some(mut waiting) = self.waiting.remove(index) {
                if let Some(store) = &mut self.spill {
                    store.remove(id);
                }
                self.metrics.cancelled += 1;
                waiting.req.send_final(End::Finish(FinishReason::Cancelled));
            }
        }
    }

    /// KV blocks the running sequences will still take for their current work (the rest of the
    /// prompt, or the next decode position).
    fn committed_blocks(&self) -> usize {
        let limits = &self.limits;
        self.running
            .iter()
            .filter(|a| a.req.end.is_none())
            .map(|a| {
                let computed = a.seq.computed_len();
                let target = a.seq.prompt_len().max(computed + 1);
                limits.blocks_for(target) - limits.blocks_for(computed)
            })
            .sum()
    }

    /// How many requests may run at once now, and the KV blocks admission may still hand out.
    fn admission_room(&self) -> (usize, usize) {
        let facts = self.router.facts();
        // Orphans still hold their slots until the router takes them back.
        let slots = facts.live_slots_total.saturating_sub(self.orphans.len());
        let cap = self.config.max_running.min(slots);
        // Free blocks plus cached ones count as available, except cached blocks that running
        // sequences hold (the router cannot evict those). The facts do not say how many those
        // are, so also bound the estimate by the pool minus what running sequences hold (which
        // counts a shared block once per holder, erring low).
        let held: usize = self
            .running
            .iter()
            .map(|a| self.limits.blocks_for(a.seq.computed_len()))
            .sum();
        let reclaimable = (facts.kv_blocks_free + facts.kv_blocks_cached)
            .min(facts.kv_blocks_total.saturating_sub(held));
        (cap, reclaimable.saturating_sub(self.committed_blocks()))
    }

    /// Whether the waiting request at the head of the queue fits now (what `admit` checks).
    fn head_fits(&self, available: usize) -> bool {
        self.waiting.front().is_some_and(|front| {
            let needed = self.limits.blocks_for(front.req.tokens.len() + 1);
            // With nothing running the head always goes: the pool can hold it alone, since
            // requests that can never fit were refused at submission.
            needed <= available || self.running.is_empty()
        })
    }

    /// Whether `admit` would admit a request now.
    fn would_admit(&self) -> bool {
        let (cap, available) = self.admission_room();
        self.running.len() < cap && self.head_fits(available)
    }

    fn admit(&mut self) -> usize {
        let (cap, mut available) = self.admission_room();
        let mut admitted = 0;
        while self.running.len() < cap {
            let Some(front) = self.waiting.front() else {
                break;
            };
            let needed = self.limits.blocks_for(front.req.tokens.len() + 1);
            if !self.head_fits(available) {
                break;
            }
            let Some(Waiting { mut req, spilled }) = self.waiting.pop_front() else {
                break;
            };
            if req.scheduled.is_none() {
                req.scheduled = Some(Instant::now());
                self.metrics.admitted += 1;
            }
            if req.preemptions > 0 {
                req.resumed_at = Some(self.step_no);
            }
            let mut kept = None;
            let seq = match spilled {
                Some(spilled) => match self.restore(spilled, &mut req) {
                    Restored::Yes(seq, drafts) => {
                        kept = drafts;
                        seq
                    }
                    // With nothing running, waiting cannot help: prefill it again instead (and
                    // if even that cannot fit, the request fails rather than waits forever).
                    Restored::Later(_) if self.running.is_empty() => {
                        if let Some(store) = &mut self.spill {
                            store.remove(req.id);
                        }
                        self.metrics.spill_fallbacks += 1;
                        self.metrics.recomputes += 1;
                        D::Seq::create(req.spec())
                    }
                    Restored::Later(spilled) => {
                        self.waiting.push_front(Waiting {
                            req,
                            spilled: Some(spilled),
                        });
                        break;
                    }
                    Restored::Recompute => D::Seq::create(req.spec()),
                },
                None => D::Seq::create(req.spec()),
            };
            available = available.saturating_sub(needed);
            admitted += 1;
            self.running.push(Active {
                seq,
                req,
                in_plan: false,
                in_flight: false,
                no_cache: false,
                drafts_at: kept.as_ref().map(|&(at, _)| at),
                drafts: kept.map(|(_, drafts)| drafts).unwrap_or_default(),
                draft_slots: Vec::new(),
            });
        }
        admitted
    }

    fn restore(&mut self, spilled: Spilled<D::Seq>, req: &mut Tracked) -> Restored<D::Seq> {
        let Spilled {
            mut seq,
            tag,
            drafts,
        } = spilled;
        let Some(store) = &mut self.spill else {
            return Restored::Recompute;
        };
        let router = &self.router;
        let loaded = store.load(&tag, |reader| {
            router.apply(Effect::RestoreSequenceState {
                seq: &mut seq,
                reader,
            })
        });
        match loaded {
            Ok(Ok(_)) => {
                store.remove(req.id);
                match check_restored(&seq, &tag) {
                    Ok(()) => {
                        self.metrics.restores += 1;
                        let drafts = drafts.filter(|&(at, _)| at == seq.computed_len());
                        return Restored::Yes(seq, drafts);
                    }
                    Err(problem) => {
                        // The router restored something other than what was spilled: give its
                        // resources back and prefill again.
                        tracing::warn!(
                            id = req.id,
                            problem,
                            "restored sequence refused; recomputing instead"
                        );
                        self.metrics.spill_images_rejected += 1;
                        let _ = self.release(seq, false, "fault");
                    }
                }
            }
            Ok(Err(DeviceError::KvExhausted { .. } | DeviceError::SlotsExhausted { .. })) => {
                return Restored::Later(Spilled { seq, tag, drafts });
            }
            Ok(Err(err)) => {
                tracing::warn!(id = req.id, %err, "restore failed; recomputing instead");
                store.remove(req.id);
            }
            Err(err) => {
                tracing::warn!(id = req.id, %err, "spill image refused; recomputing instead");
                store.remove(req.id);
                if matches!(err, SpillError::Refused { .. }) {
                    self.metrics.spill_images_rejected += 1;
                }
            }
        }
        self.metrics.spill_fallbacks += 1;
        self.metrics.recomputes += 1;
        Restored::Recompute
    }

    /// Builds, launches and settles one plan of `kind`, preempting on exhaustion and relaunching
    /// without the victim. Answers the rows and computed prompt tokens of the settled plan.
    fn launch_loop(&mut self, kind: PlanKind, decode_rows: usize) -> (usize, usize) {
        loop {
            if self.router.lost().is_some() {
                return (0, 0);
            }
            let (rows, wants_logits) = self.mark_rows(kind, decode_rows);
            if rows == 0 {
                return (0, 0);
            }
            match self.launch(kind, wants_logits) {
                Ok(step) => {
                    let computed = self.accept(kind, step);
                    return (rows, computed);
                }
                Err(
                    err @ (DeviceError::KvExhausted { .. } | DeviceError::SlotsExhausted { .. }),
                ) => {
                    if !self.make_room(kind, err) {
                        return (0, 0);
                    }
                }
                Err(DeviceError::DeviceLost(message)) => {
                    self.fail_plan_rows(|| ServeError::DeviceLost(message.clone()));
                    return (0, 0);
                }
                Err(err) => {
                    tracing::warn!(plan = kind.name(), %err, "step failed; failing its rows");
                    self.fail_plan_rows(|| ServeError::Device {
                        during: kind.name(),
                        source: err.clone(),
                    });
                    return (0, 0);
                }
            }
        }
    }

    /// Marks the rows of the next plan of `kind` (and fills the per-row inputs); answers how
    /// many there are and whether any needs host logits.
    fn mark_rows(&mut self, kind: PlanKind, decode_rows: usize) -> (usize, bool) {
        let Engine {
            running,
            scratch,
            config,
            ..
        } = self;
        scratch.tokens.clear();
        scratch.budgets.clear();
        let mut budget_left = config.max_step_tokens.saturating_sub(decode_rows);
        let mut rows = 0;
        let mut wants_logits = false;
        for active in running.iter_mut() {
            active.in_plan = false;
            if active.req.end.is_some() {
                continue;
            }
            let prefill_done = active.seq.prefill_done();
            match kind {
                PlanKind::Decode if prefill_done => {
                    let Some(&last) = active.req.tokens.last() else {
                        continue;
                    };
                    scratch.tokens.push(last);
                }
                PlanKind::Prefill if !prefill_done && budget_left > 0 => {
                    // At least 1: a router's `prefill_done` decides, not this arithmetic.
                    let remaining = (active.seq.prompt_len())
                        .saturating_sub(active.seq.computed_len())
                        .max(1);
                    let budget = remaining.min(config.max_prefill_chunk).min(budget_left);
                    budget_left -= budget;
                    scratch.budgets.push(budget);
                }
                _ => continue,
            }
            active.in_plan = true;
            wants_logits |= active.req.needs_logits();
            rows += 1;
        }
        (rows, wants_logits)
    }

    fn launch(
        &mut self,
        kind: PlanKind,
        wants_logits: bool,
    ) -> Result<StepResult<D::Ptr>, DeviceError> {
        let Engine {
            router,
            running,
            scratch,
            ..
        } = self;
        let mut rows: Vec<&mut D::Seq> = recycle(std::mem::take(&mut scratch.rows));
        rows.extend(running.iter_mut().filter(|a| a.in_plan).map(|a| &mut a.seq));
        let readback = if wants_logits {
            Readback::HostLogits {
                into: &mut scratch.logits,
            }
        } else {
            Readback::Argmax
        };
        let plan = match kind {
            PlanKind::Decode => StepPlan::Decode {
                tokens: &scratch.tokens,
                readback,
            },
            PlanKind::Prefill => StepPlan::Prefill {
                budgets: &scratch.budgets,
                readback,
            },
        };
        let result = router
            .launch(plan, &mut rows)
            .and_then(|ticket| router.await_result(ticket));
        scratch.rows = recycle(rows);
        result
    }

    /// Takes a settled plan's outputs into the marked rows; answers the prompt tokens computed.
    fn accept(&mut self, kind: PlanKind, step: StepResult<D::Ptr>) -> usize {
        let now = Instant::now();
        let Engine {
            running,
            scratch,
            metrics,
            limits,
            ..
        } = self;
        let vocab = limits.vocab_size;
        let mut outputs = step.rows.iter();
        let mut computed_total = 0;
        match kind {
            PlanKind::Decode => {
                metrics.decode_launches += 1;
                metrics.decode_rows += step.rows.len() as u64;
            }
            PlanKind::Prefill => metrics.prefill_launches += 1,
        }
        for active in running.iter_mut().filter(|a| a.in_plan) {
            let req = &mut active.req;
            let Some(output) = outputs.next() else {
                req.end = Some(End::Fail(protocol(
                    kind,
                    "the step answered fewer rows than it had",
                )));
                continue;
            };
            if kind == PlanKind::Prefill {
                let Some(report) = output.prefill else {
                    req.end = Some(End::Fail(protocol(kind, "a prefill row has no report")));
                    continue;
                };
                req.cached_tokens += report.cached;
                metrics.prefill_tokens_cached += report.cached as u64;
                metrics.prefix_hits += u64::from(report.cached > 0);
                metrics.prefill_tokens_computed += report.computed as u64;
                computed_total += report.computed;
                if !report.done {
                    continue;
                }
            }
            match choose_token(req, output, &scratch.logits, vocab, &mut scratch.sample) {
                Ok(token) => {
                    metrics.generated_tokens += 1;
                    req.push_token(token, now);
                }
                Err(detail) => req.end = Some(End::Fail(protocol(kind, detail))),
            }
        }
        computed_total
    }

    /// After a launch found the pool or the slots dry: preempts a victim and answers `true` to
    /// relaunch, or, when the plan's rows are all that is left to preempt, fails them.
    fn make_room(&mut self, kind: PlanKind, err: DeviceError) -> bool {
        // Requests that ended earlier in this step still hold their blocks: release them first.
        if self.running.iter().any(|a| a.req.end.is_some()) {
            self.retire_ended();
            return true;
        }
        // Orphans hold what the router refused to take back, perhaps a victim released earlier
        // in this step: retry them before preempting anyone or failing a row that would fit.
        if !self.orphans.is_empty() {
            let before = self.orphans.len();
            self.release_orphans();
            if self.orphans.len() < before {
                return true;
            }
        }
        let live = self.running.iter().filter(|a| a.req.end.is_none()).count();
        let victim = if live > 1 { self.choose_victim() } else { None };
        let Some(victim) = victim else {
            tracing::warn!(plan = kind.name(), %err, "a sequence cannot fit even alone");
            self.fail_plan_rows(|| match &err {
                DeviceError::KvExhausted { needed, free } => ServeError::CannotFit {
                    needed: *needed,
                    free: *free,
                },
                other => ServeError::Device {
                    during: kind.name(),
                    source: other.clone(),
                },
            });
            return false;
        };
        self.preempt(victim);
        true
    }

    fn fail_plan_rows(&mut self, error: impl Fn() -> ServeError) {
        for active in self.running.iter_mut().filter(|a| a.in_plan) {
            active.req.end = Some(End::Fail(error()));
        }
    }

    /// The live sequence to preempt: the fewest generated tokens among those not resumed in the
    /// last `protect_steps` steps (all candidates when every one was), the latest arrival on ties.
    /// Candidates hold a slot or are rows of the plan being launched.
    fn choose_victim(&self) -> Option<usize> {
        let protect = self.config.protect_steps;
        let step = self.step_no;
        let is_protected = |a: &Active<D::Seq>| {
            a.req
                .resumed_at
                .is_some_and(|at| step < at.saturating_add(protect))
        };
        // A sequence that holds nothing yet frees nothing, unless it is part of the plan that
        // found the pool dry (then dropping it lowers what the plan needs).
        let live = || {
            self.running
                .iter()
                .enumerate()
                .filter(|(_, a)| a.req.end.is_none() && (a.in_plan || a.seq.slot().is_some()))
        };
        let all_protected = live().all(|(_, a)| is_protected(a));
        live()
            .filter(|(_, a)| all_protected || !is_protected(a))
            .min_by_key(|(_, a)| (a.req.generated(), std::cmp::Reverse(a.req.id)))
            .map(|(index, _)| index)
    }

    fn preempt(&mut self, index: usize) {
        let Active {
            seq,
            mut req,
            drafts,
            drafts_at,
            ..
        } = self.running.remove(index);
        let drafts = drafts_at
            .filter(|&at| at == seq.computed_len() && !drafts.is_empty())
            .map(|at| (at, drafts));
        req.preemptions += 1;
        self.metrics.preemptions += 1;
        tracing::debug!(
            id = req.id,
            generated = req.generated(),
            "preempting on KV exhaustion"
        );
        let seq = match &mut self.spill {
            // A sequence that never got a slot holds nothing worth an image.
            Some(_) if seq.slot().is_none() => {
                self.recompute(seq, req);
                return;
            }
            // The engine's tokens must cover what the sequence computed; if they do not, its
            // image could not be checked at restore.
            Some(_) if seq.computed_len() > req.tokens.len() => {
                self.recompute(seq, req);
                return;
            }
            Some(store) => {
                let router = &self.router;
                let covered = &req.tokens[..seq.computed_len()];
                let saved = store.save(req.id, covered, |writer| {
                    router
                        .apply(Effect::SaveSequenceState { seq: &seq, writer })
                        .map(|_| ())
                });
                self.metrics.spill_directory_recreations = store.directory_recreations();
                match saved {
                    Ok(Ok(tag)) => Some((seq, tag)),
                    Ok(Err(err)) => {
                        tracing::warn!(id = req.id, %err, "spill failed; recomputing instead");
                        self.metrics.spill_fallbacks += 1;
                        self.recompute(seq, req);
                        return;
                    }
                    Err(err) => {
                        tracing::warn!(id = req.id, %err, "spill store failed; recomputing instead");
                        self.metrics.spill_fallbacks += 1;
                        self.recompute(seq, req);
                        return;
                    }
                }
            }
            None => {
                self.recompute(seq, req);
                return;
            }
        };
        let Some((seq, tag)) = seq else { return };
        // The image holds everything the sequence needs; offering its blocks to the cache too
        // would only compete with other entries.
        match self.release(seq, false, "preempt") {
            Ok(seq) => {
                self.metrics.spills += 1;
                self.waiting.push_front(Waiting {
                    req,
                    spilled: Some(Spilled { seq, tag, drafts }),
                });
            }
            Err(source) => {
                if let Some(store) = &mut self.spill {
                    store.remove(req.id);
                }
                self.metrics.failed += 1;
                req.send_final(End::Fail(ServeError::Device {
                    during: "ReleaseSeq",
                    source,
                }));
            }
        }
    }

    fn recompute(&mut self, seq: D::Seq, mut req: Tracked) {
        match self.release(seq, true, "preempt") {
            Ok(_) => {
                self.metrics.recomputes += 1;
                self.waiting.push_front(Waiting { req, spilled: None });
            }
            Err(source) => {
                self.metrics.failed += 1;
                req.send_final(End::Fail(ServeError::Device {
                    during: "ReleaseSeq",
                    source,
                }));
            }
        }
    }

    /// Releases `seq` and hands it back (holding nothing). When that fails (the router changed
    /// nothing), tries once more without caching; if that fails too the sequence becomes an
    /// orphan, released again at every later step and before teardown. Answers the first error.
    fn release(
        &mut self,
        mut seq: D::Seq,
        cache: bool,
        what: &'static str,
    ) -> Result<D::Seq, DeviceError> {
        let err = match self.router.apply(Effect::ReleaseSeq {
            seq: &mut seq,
            cache,
            what,
        }) {
            Ok(_) => return Ok(seq),
            // Nothing on a lost device needs releasing any more, and nothing could be.
            Err(err @ DeviceError::DeviceLost(_)) => return Err(err),
            Err(err) => err,
        };
        tracing::warn!(id = seq.id(), %err, "release failed; retrying without caching");
        if let Err(again) = self.router.apply(Effect::ReleaseSeq {
            seq: &mut seq,
            cache: false,
            what: "fault",
        }) {
            if matches!(again, DeviceError::DeviceLost(_)) {
                return Err(err);
            }
            tracing::error!(id = seq.id(), err = %again, "release failed twice; retrying every step");
            self.metrics.orphaned_sequences += 1;
            self.orphans.push(seq);
        }
        Err(err)
    }

    /// Retries the release of every orphan (sequences whose release failed twice).
    fn release_orphans(&mut self) {
        let Engine {
            router, orphans, ..
        } = self;
        orphans.retain_mut(|seq| {
            router
                .apply(Effect::ReleaseSeq {
                    seq,
                    cache: false,
                    what: "fault",
                })
                .is_err()
        });
    }

    /// Applies `MarconiCheckpoint` to every live sequence the router asked it for; with
    /// `ended_by_output`, also to those whose output ended them in this step (not failed ones).
    fn checkpoints(&mut self, ended_by_output: bool) {
        if self.router.lost().is_some() {
            return;
        }
        let Engine {
            router,
            running,
            metrics,
            ..
        } = self;
        let wanted = |a: &Active<D::Seq>| match &a.req.end {
            None => true,
            Some(End::Finish(_)) => ended_by_output,
            Some(End::Fail(_)) => false,
        };
        for active in running
            .iter_mut()
            .filter(|a| a.seq.checkpoint_due() && wanted(a))
        {
            match router.apply(Effect::MarconiCheckpoint {
                seq: &mut active.seq,
            }) {
                Ok(_) => metrics.marconi_checkpoints += 1,
                Err(err) => {
                    // The router changed nothing; only caching loses, the request goes on.
                    tracing::warn!(id = active.req.id, %err, "MarconiCheckpoint failed");
                    metrics.marconi_checkpoint_failures += 1;
                }
            }
        }
    }

    /// Releases every ended request and sends its final event; counts them in `step_ended`.
    fn retire_ended(&mut self) {
        let mut index = 0;
        while index < self.running.len() {
            let active = &self.running[index];
            // A row in flight is released once its step settles (and its over-run is undone).
            if active.req.end.is_none() || active.in_flight {
                index += 1;
                continue;
            }
            let Active {
                seq,
                mut req,
                no_cache,
                ..
            } = self.running.remove(index);
            self.step_ended += 1;
            let Some(end) = req.end.take() else {
                continue;
            };
            match end {
                End::Finish(reason) => {
                    let what = if reason == FinishReason::Cancelled {
                        "cancel"
                    } else {
                        "finish"
                    };
                    match self.release(seq, !no_cache, what) {
                        Ok(_) => {
                            if reason == FinishReason::Cancelled {
                                self.metrics.cancelled += 1;
                            } else {
                                self.metrics.finished += 1;
                            }
                            req.send_final(End::Finish(reason));
                        }
                        Err(source) => {
                            self.metrics.failed += 1;
                            req.send_final(End::Fail(ServeError::Device {
                                during: "ReleaseSeq",
                                source,
                            }));
                        }
                    }
                }
                End::Fail(err) => {
                    let what = if err == ServeError::Shutdown {
                        "shutdown"
                    } else {
                        "fault"
                    };
                    // A failed row may be in an unspecified state: never cache it. The request
                    // fails with its own error whatever the release answers.
                    let _ = self.release(seq, false, what);
                    self.metrics.failed += 1;
                    req.send_final(End::Fail(err));
                }
            }
        }
    }

    /// Moves slot holders at or above `n` into the free slots below it; answers `false` when a
    /// move failed (its request is marked failed and must be retired).
    ///
    /// Orphans still hold their slots (the router would not take them back): they count as
    /// holders and their slots as taken, so no survivor is moved into one. Orphans themselves are
    /// never moved; once released, the next compaction fills their slots.
    fn compact(&mut self) -> bool {
        let Engine {
            router,
            running,
            orphans,
            scratch,
            metrics,
            ..
        } = self;
        let orphan_slots = || orphans.iter().filter_map(|seq| seq.slot());
        let holders =
            running.iter().filter(|a| a.seq.slot().is_some()).count() + orphan_slots().count();
        scratch.slot_used.clear();
        scratch.slot_used.resize(holders, false);
        let held = running.iter().filter_map(|a| a.seq.slot());
        for slot in held.chain(orphan_slots()) {
            if slot < holders {
                scratch.slot_used[slot] = true;
            }
        }
        let mut all_moved = true;
        let mut next_free = 0;
        for active in running.iter_mut() {
            let Some(slot) = active.seq.slot() else {
                continue;
            };
            if slot < holders {
                continue;
            }
            while scratch.slot_used.get(next_free) == Some(&true) {
                next_free += 1;
            }
            if next_free >= holders {
                // Only a router that reports two sequences in one slot gets here.
                tracing::error!(
                    slot,
                    holders,
                    "no free slot below the holder count to compact into"
                );
                break;
            }
            match router.apply(Effect::CompactSlot {
                seq: &mut active.seq,
                target: next_free,
            }) {
                Ok(_) => {
                    scratch.slot_used[next_free] = true;
                    metrics.compactions += 1;
                }
                Err(source) => {
                    all_moved = false;
                    // Skip this target: the next holder tries the next free slot.
                    next_free += 1;
                    active.req.end = Some(End::Fail(ServeError::Device {
                        during: "CompactSlot",
                        source,
                    }));
                }
            }
        }
        all_moved
    }
}

/// What restoring a spilled sequence came to.
enum Restored<S> {
    /// Restored; the sequence runs again (with the MTP drafts it had, at its length).
    Yes(S, Option<(usize, Vec<u32>)>),
    /// The pool or the slots are dry; try again later.
    Later(Spilled<S>),
    /// The image could not be restored; prefill prompt plus generated tokens again.
    Recompute,
}

/// Whether a request's failure is the loss of the device (in either form).
fn is_loss(err: &ServeError) -> bool {
    matches!(
        err,
        ServeError::DeviceLost(_)
            | ServeError::Device {
                source: DeviceError::DeviceLost(_),
                ..
            }
    )
}

/// Whether a restored sequence is the one that was spilled: same request, same computed length,
/// same tokens over it.
fn check_restored<S: Sequence>(seq: &S, tag: &ImageTag) -> Result<(), String> {
    if seq.id() != tag.id {
        return Err(format!(
            "restored sequence {} for request {}",
            seq.id(),
            tag.id
        ));
    }
    let computed = seq.computed_len();
    if computed as u64 != tag.computed_len {
        return Err(format!(
            "restored {computed} computed positions, {} were spilled",
            tag.computed_len
        ));
    }
    match seq.tokens().get(..computed) {
        Some(tokens) if token_digest(tokens) == tag.token_digest => Ok(()),
        Some(_) => Err("the restored tokens differ from the spilled ones".to_string()),
        None => Err(format!(
            "the restored sequence has {} tokens for {computed} computed positions",
            seq.tokens().len()
        )),
    }
}

fn protocol(kind: PlanKind, detail: &str) -> ServeError {
    ServeError::Device {
        during: kind.name(),
        source: DeviceError::Invalid {
            what: kind.name(),
            detail: detail.to_string(),
        },
    }
}

/// The token for a row that reached a token position; hashes its logits row into the digest.
fn choose_token(
    req: &mut Tracked,
    output: &RowOutput,
    logits: &[f32],
    vocab: usize,
    scratch: &mut Vec<(f32, u32)>,
) -> Result<u32, &'static str> {
    if let Some(row) = output.logits_row {
        let range = row
            .checked_mul(vocab)
            .and_then(|start| Some(start..start.checked_add(vocab)?));
        let Some(row_logits) = range.and_then(|range| logits.get(range)) else {
            return Err("a logits row index is outside the host logits");
        };
        if let Some(digest) = &mut req.digest {
            digest.0.update(bytemuck::cast_slice(row_logits));
        }
        return Ok(req.sampler.choose_from_logits(row_logits, scratch));
    }
    if req.needs_logits() {
        return Err("a row that needs host logits got none");
    }
    match output.token {
        Some(argmax) => Ok(req.sampler.choose_with_argmax(argmax)),
        None => Err("a row that reached a token position has no token"),
    }
}

#[cfg(test)]
mod tests {
    use super::recycle;

    #[test]
    fn recycling_a_row_buffer_keeps_its_allocation() {
        let mut values = [1u64, 2, 3];
        let mut rows: Vec<&mut u64> = Vec::with_capacity(64);
        rows.extend(values.iter_mut());
        let pointer = rows.as_ptr() as usize;
        let stored: Vec<usize> = recycle(rows);
        assert_eq!((stored.len(), stored.capacity()), (0, 64));
        assert_eq!(stored.as_ptr() as usize, pointer);
        let again: Vec<&mut u64> = recycle(stored);
        assert_eq!((again.len(), again.capacity()), (0, 64));
        assert_eq!(again.as_ptr() as usize, pointer);
    }
}
