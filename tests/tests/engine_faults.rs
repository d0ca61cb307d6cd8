//! Fault injection end to end: a wrapper router injects launch failures, await failures, effect
//! failures and KV exhaustion into the host router under the engine, at pipeline depth 1 and 2.
//! In every scenario exactly the requests the fault hit fail (or, for KV exhaustion, are
//! preempted and still complete), every other request produces the same tokens and logits
//! digest as a fault-free run at depth 1, and afterwards every KV block and live slot is free
//! again.

use std::collections::BTreeSet;
use std::sync::Mutex;

use device_cpu::{CpuRouter, CpuRouterConfig};
use device_io::{
    DeviceError, DeviceFacts, DeviceIo, Effect, EffectOutcome, LoraError, Phase, Sequence,
    StepPlan, StepResult, Ticket,
};
use model::{Config, Model};
use scheduler::{
    Completion, Engine, EngineConfig, Preemption, Request, ServeError, ShutdownMode, SpillTarget,
};

/// When to inject a fault. Launch and effect counts start at 1.
#[derive(Debug, Clone)]
enum Trigger {
    /// The `nth` launch fails with this error.
    Launch(usize, DeviceError),
    /// Every launch whose rows include this request fails with this error.
    LaunchWith(u64, DeviceError),
    /// The `nth` await fails with this error (the step is lost: its rows are hit).
    Await(usize, DeviceError),
    /// The `nth` effect of this name fails with this error.
    Effect(&'static str, usize, DeviceError),
}

#[derive(Debug, Default)]
struct Faults {
    triggers: Vec<Trigger>,
    launches: usize,
    awaits: usize,
    /// The request ids of each launched step's rows.
    rows: std::collections::BTreeMap<Ticket, Vec<u64>>,
    effects: Vec<(&'static str, usize)>,
    /// The request ids each injected fault hit.
    hit: BTreeSet<u64>,
    injected: usize,
}

/// A router that forwards to `inner` except where a trigger fires; then it answers the error and
/// changes nothing.
#[derive(Debug)]
struct Faulty<D> {
    inner: D,
    faults: Mutex<Faults>,
}

impl<D: DeviceIo> Faulty<D>
where
    D::Seq: Sequence,
{
    fn new(inner: D, triggers: Vec<Trigger>) -> Self {
        Faulty {
            inner,
            faults: Mutex::new(Faults {
                triggers,
                ..Faults::default()
            }),
        }
    }

    fn hit(&self) -> BTreeSet<u64> {
        self.faults.lock().unwrap().hit.clone()
    }

    fn injected(&self) -> usize {
        self.faults.lock().unwrap().injected
    }
}

fn effect_seq_id<S: Sequence, P>(effect: &Effect<'_, S, P>) -> Option<u64> {
    match effect {
        Effect::ReleaseSeq { seq, .. }
        | Effect::CompactSlot { seq, .. }
        | Effect::DetachSlot { seq }
        | Effect::RestoreSequenceState { seq, .. }
        | Effect::MarconiCheckpoint { seq }
        | Effect::ReserveKv { seq }
        | Effect::Rollback { seq }
        | Effect::TruncateKv { seq, .. }
        | Effect::SsmSnapshotRestore { seq, .. } => Some(seq.id()),
        Effect::SaveSequenceState { seq, .. } | Effect::SsmSnapshotSave { seq, .. } => {
            Some(seq.id())
        }
        _ => None,
    }
}

impl<D: DeviceIo> DeviceIo for Faulty<D>
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
        {
            let mut faults = self.faults.lock().unwrap();
            faults.launches += 1;
            let n = faults.launches;
            let fired = faults.triggers.iter().find_map(|trigger| match trigger {
                Trigger::Launch(nth, err) if *nth == n => Some(err.clone()),
                Trigger::LaunchWith(id, err) if rows.iter().any(|seq| seq.id() == *id) => {
                    Some(err.clone())
                }
                _ => None,
            });
            if let Some(err) = fired {
                let ids: Vec<u64> = rows.iter().map(|seq| seq.id()).collect();
                faults.hit.extend(ids);
                faults.injected += 1;
                return Err(err);
            }
        }
        let ids: Vec<u64> = rows.iter().map(|seq| seq.id()).collect();
        let ticket = self.inner.launch(plan, rows)?;
        self.faults.lock().unwrap().rows.insert(ticket, ids);
        Ok(ticket)
    }

    fn await_result(&self, ticket: Ticket) -> Result<StepResult<D::Ptr>, DeviceError> {
        let result = self.inner.await_result(ticket);
        let mut faults = self.faults.lock().unwrap();
        faults.awaits += 1;
        let n = faults.awaits;
        let ids = faults.rows.remove(&ticket).unwrap_or_default();
        let fired = faults.triggers.iter().find_map(|trigger| match trigger {
            Trigger::Await(nth, err) if *nth == n => Some(err.clone()),
            _ => None,
        });
        if let Some(err) = fired {
            // The step ran on the device, but its result is lost.
            faults.hit.extend(ids);
            faults.injected += 1;
            return Err(err);
        }
        result
    }

    fn apply(&self, effect: Effect<'_, D::Seq, D::Ptr>) -> Result<EffectOutcome, DeviceError> {
        {
            let mut faults = self.faults.lock().unwrap();
            let name = effect.name();
            let count = match faults.effects.iter_mut().find(|(n, _)| *n == name) {
                Some((_, count)) => {
                    *count += 1;
                    *count
                }
                None => {
                    faults.effects.push((name, 1));
                    1
                }
            };
            let fired = faults.triggers.iter().find_map(|trigger| match trigger {
                Trigger::Effect(n, nth, err) if *n == name && *nth == count => Some(err.clone()),
                _ => None,
            });
            if let Some(err) = fired {
                faults.hit.extend(effect_seq_id(&effect));
                faults.injected += 1;
                return Err(err);
            }
        }
        self.inner.apply(effect)
    }

    fn lora(&mut self, cmd: D::LoraCmd) -> Result<D::LoraAck, LoraError> {
        self.inner.lora(cmd)
    }

    fn teardown(self: Box<Self>) -> Result<(), DeviceError> {
        Box::new(self.inner).teardown()
    }
}

fn failed(phase: Phase) -> DeviceError {
    DeviceError::Failed {
        phase,
        message: "injected".into(),
    }
}

/// Six greedy requests with digests: prompts of 16..=56 tokens, 24..=44 new tokens each (so
/// decoding, not only admission, needs blocks).
fn requests() -> Vec<Request> {
    (0..6u32)
        .map(|i| {
            let prompt: Vec<u32> = (0..16 + 8 * i).map(|t| (t * 7 + i * 31) % 256).collect();
            Request::greedy(prompt, 24 + 4 * i as usize).with_logits_digest(true)
        })
        .collect()
}

struct Run {
    /// By submission order: the request id and its outcome.
    outcomes: Vec<(u64, Result<Completion, ServeError>)>,
    hit: BTreeSet<u64>,
    injected: usize,
    initial: DeviceFacts,
    after: DeviceFacts,
    preemptions: u64,
    spills: u64,
    restores: u64,
    spill_fallbacks: u64,
}

fn run(
    model: &Model,
    num_blocks: usize,
    preemption: Preemption,
    triggers: Vec<Trigger>,
    depth: usize,
) -> Run {
    let mut config = CpuRouterConfig::new(num_blocks, 4);
    config.max_depth = depth;
    config.max_context = Some(112);
    config.prefix_cache = false;
    config.marconi = false;
    let router = Faulty::new(CpuRouter::new(model.clone(), config).unwrap(), triggers);
    let initial = router.facts();
    let engine_config = EngineConfig {
        max_running: 4,
        max_step_tokens: 48,
        max_prefill_chunk: 32,
        preemption,
        ..EngineConfig::default()
    };
    let mut engine = Engine::new(router, engine_config).unwrap();
    let handles: Vec<_> = requests()
        .into_iter()
        .map(|request| engine.submit(request).unwrap())
        .collect();
    engine.run_until_idle();
    let outcomes = handles.into_iter().map(|h| (h.id(), h.wait())).collect();
    let run = Run {
        outcomes,
        hit: engine.router().hit(),
        injected: engine.router().injected(),
        initial,
        after: engine.router().facts(),
        preemptions: engine.metrics().preemptions,
        spills: engine.metrics().spills,
        restores: engine.metrics().restores,
        spill_fallbacks: engine.metrics().spill_fallbacks,
    };
    engine.shutdown(ShutdownMode::Drain).unwrap();
    run
}

/// Checks a faulty run against the fault-free one: the hit requests failed as `expect_failure`
/// says, every other one is identical, and the router's resources are all free again.
fn check(name: &str, baseline: &Run, faulty: &Run, expect_failure: &dyn Fn(&ServeError) -> bool) {
    assert!(faulty.injected > 0, "{name}: the fault never fired");
    assert!(!faulty.hit.is_empty(), "{name}: the fault hit no request");
    for ((id, base), (faulty_id, outcome)) in baseline.outcomes.iter().zip(&faulty.outcomes) {
        assert_eq!(id, faulty_id);
        let base = base.as_ref().unwrap();
        if faulty.hit.contains(id) {
            match outcome {
                Err(err) => assert!(expect_failure(err), "{name}: request {id}: {err}"),
                Ok(_) => panic!("{name}: request {id} was hit but completed"),
            }
        } else {
            assert_eq!(outcome.as_ref().unwrap(), base, "{name}: request {id}");
        }
    }
    assert_eq!(
        faulty.after, faulty.initial,
        "{name}: resources not all free"
    );
}

/// What a hit request's error must look like.
type Expectation = Box<dyn Fn(&ServeError) -> bool>;

fn strip_times(mut run: Run) -> Run {
    // Times differ between runs; everything else must not.
    for (_, outcome) in &mut run.outcomes {
        if let Ok(done) = outcome {
            done.usage.queue_time = Default::default();
            done.usage.time_to_first_token = None;
            done.usage.time_per_output_token = None;
            done.usage.preemptions = 0;
        }
    }
    run
}

#[test]
fn each_fault_fails_only_the_requests_it_hit() {
    let model = Model::random(Config::tiny_demo(), 3).unwrap();
    let roomy = 64;
    let baseline = strip_times(run(&model, roomy, Preemption::Recompute, vec![], 1));
    assert_eq!(baseline.after, baseline.initial);
    let pipelined = strip_times(run(&model, roomy, Preemption::Recompute, vec![], 2));
    assert_eq!(pipelined.outcomes, baseline.outcomes);

    let device = |during: &'static str| move |err: &ServeError| matches!(err, ServeError::Device { during: d, .. } if *d == during);
    let scenarios: Vec<(&str, Vec<Trigger>, Expectation)> = vec![
        (
            "the 2nd launch fails in the forward pass",
            vec![Trigger::Launch(2, failed(Phase::Forward))],
            Box::new(|err: &ServeError| matches!(err, ServeError::Device { .. })),
        ),
        (
            "the first release of a finished request fails",
            vec![Trigger::Effect("ReleaseSeq", 1, failed(Phase::Effect))],
            Box::new(device("ReleaseSeq")),
        ),
        (
            "the first compaction fails",
            vec![Trigger::Effect("CompactSlot", 1, failed(Phase::Effect))],
            Box::new(device("CompactSlot")),
        ),
        (
            "the 9th await fails in the forward pass",
            vec![Trigger::Await(9, failed(Phase::Forward))],
            Box::new(|err: &ServeError| matches!(err, ServeError::Device { .. })),
        ),
    ];
    for (name, triggers, expect) in scenarios {
        for depth in [1, 2] {
            let faulty = strip_times(run(
                &model,
                roomy,
                Preemption::Recompute,
                triggers.clone(),
                depth,
            ));
            check(
                &format!("{name}, depth {depth}"),
                &baseline,
                &faulty,
                &expect,
            );
        }
    }
}

#[test]
fn kv_exhaustion_preempts_instead_of_failing_unless_a_request_cannot_fit_alone() {
    let model = Model::random(Config::tiny_demo(), 3).unwrap();
    let baseline = strip_times(run(&model, 64, Preemption::Recompute, vec![], 1));
    let exhausted = DeviceError::KvExhausted { needed: 1, free: 0 };

    for depth in [1, 2] {
        // A dry pool on the 3rd launch: the engine preempts a victim and relaunches (at depth
        // 2, when it was a fed step, it decodes synchronously instead); nobody fails.
        let faulty = strip_times(run(
            &model,
            64,
            Preemption::Recompute,
            vec![Trigger::Launch(3, exhausted.clone())],
            depth,
        ));
        assert_eq!(faulty.injected, 1);
        if depth == 1 {
            assert!(faulty.preemptions >= 1);
        }
        for ((_, base), (_, outcome)) in baseline.outcomes.iter().zip(&faulty.outcomes) {
            assert_eq!(outcome, base, "depth {depth}");
        }
        assert_eq!(faulty.after, faulty.initial);

        // Request 3 never fits: it is preempted-around until it is alone, then fails; the
        // others are untouched.
        let faulty = strip_times(run(
            &model,
            64,
            Preemption::Recompute,
            vec![Trigger::LaunchWith(3, exhausted.clone())],
            depth,
        ));
        for ((id, base), (_, outcome)) in baseline.outcomes.iter().zip(&faulty.outcomes) {
            if *id == 3 {
                assert_eq!(
                    outcome,
                    &Err(ServeError::CannotFit { needed: 1, free: 0 }),
                    "depth {depth}"
                );
            } else {
                assert_eq!(outcome, base, "request {id}, depth {depth}");
            }
        }
        assert_eq!(faulty.after, faulty.initial);
    }
}

#[test]
fn a_real_dry_pool_and_a_failed_spill_still_give_identical_outputs() {
    let model = Model::random(Config::tiny_demo(), 3).unwrap();
    let baseline = strip_times(run(&model, 64, Preemption::Recompute, vec![], 1));
    for depth in [1, 2] {
        // 10 blocks of 16 cannot hold four of these requests at once: real preemption, by
        // spill, and the first spill's SaveSequenceState fails (the engine recomputes that one
        // instead).
        let faulty = strip_times(run(
            &model,
            10,
            Preemption::Spill(SpillTarget::Memory),
            vec![Trigger::Effect(
                "SaveSequenceState",
                1,
                failed(Phase::Effect),
            )],
            depth,
        ));
        assert_eq!(faulty.injected, 1);
        assert!(faulty.preemptions >= 2, "{}", faulty.preemptions);
        assert_eq!(faulty.spill_fallbacks, 1);
        assert!(faulty.spills >= 1);
        assert_eq!(faulty.spills, faulty.restores);
        for ((_, base), (_, outcome)) in baseline.outcomes.iter().zip(&faulty.outcomes) {
            assert_eq!(outcome, base, "depth {depth}");
        }
        assert_eq!(faulty.after, faulty.initial);
    }
}

#[test]
fn a_dry_pool_first_reclaims_requests_that_ended_earlier_in_the_step() {
    // Step 3 decodes a's last token (a ends, still holding its blocks), then launches b's next
    // prefill chunk (launch 4), which finds the pool dry. b is the only live request, but it is
    // not alone: a's blocks come back once a is released, so b must not fail.
    for depth in [1, 2] {
        dry_pool_reclaim_at(depth);
    }
}

fn dry_pool_reclaim_at(depth: usize) {
    let model = Model::random(Config::tiny_demo(), 3).unwrap();
    let mut config = CpuRouterConfig::new(16, 2);
    config.prefix_cache = false;
    config.marconi = false;
    config.max_depth = depth;
    let exhausted = DeviceError::KvExhausted { needed: 1, free: 0 };
    let router = Faulty::new(
        CpuRouter::new(model, config).unwrap(),
        vec![Trigger::Launch(4, exhausted)],
    );
    let engine_config = EngineConfig {
        max_running: 2,
        max_step_tokens: 48,
        max_prefill_chunk: 16,
        ..EngineConfig::default()
    };
    let mut engine = Engine::new(router, engine_config).unwrap();
    let a = engine
        .submit(Request::greedy((0..20).collect(), 2))
        .unwrap();
    let b = engine
        .submit(Request::greedy((0..60).map(|t| t % 256).collect(), 3))
        .unwrap();
    let steps: Vec<_> = (0..3).map(|_| engine.step()).collect();
    assert_eq!(steps[2].decode_rows, 1);
    assert_eq!(steps[2].ended, 1);
    assert_eq!(steps[2].prefill_rows, 1);
    assert_eq!(engine.router().injected(), 1);
    engine.run_until_idle();
    assert_eq!(a.wait().unwrap().tokens.len(), 2);
    assert_eq!(b.wait().unwrap().tokens.len(), 3);
    assert_eq!(engine.metrics().preemptions, 0);
    assert_eq!(engine.router().facts().live_slots_used, 0);
    engine.shutdown(ShutdownMode::Drain).unwrap();
}

#[test]
fn a_refused_marconi_checkpoint_costs_only_caching() {
    let model = Model::random(Config::tiny_demo(), 3).unwrap();
    let run = |triggers: Vec<Trigger>, depth: usize| {
        let mut config = CpuRouterConfig::new(64, 4);
        config.max_depth = depth;
        let router = Faulty::new(CpuRouter::new(model.clone(), config).unwrap(), triggers);
        let mut engine = Engine::new(router, EngineConfig::default()).unwrap();
        let handles: Vec<_> = requests()
            .into_iter()
            .map(|request| engine.submit(request).unwrap())
            .collect();
        engine.run_until_idle();
        let outputs: Vec<_> = handles
            .into_iter()
            .map(|h| {
                let done = h.wait().unwrap();
                (done.tokens, done.logits_digest)
            })
            .collect();
        let injected = engine.router().injected();
        let metrics = *engine.metrics();
        engine.shutdown(ShutdownMode::Drain).unwrap();
        (outputs, injected, metrics)
    };
    let (reference, _, clean) = run(vec![], 1);
    assert!(clean.marconi_checkpoints > 0, "{clean:?}");
    for depth in [1, 2] {
        let refused = Trigger::Effect("MarconiCheckpoint", 1, failed(Phase::Effect));
        let (outputs, injected, metrics) = run(vec![refused], depth);
        assert_eq!(injected, 1);
        assert_eq!(metrics.marconi_checkpoint_failures, 1);
        assert_eq!(metrics.failed, 0);
        assert_eq!(outputs, reference, "depth {depth}");
    }
}

#[test]
fn a_lost_device_ends_every_unfinished_request_and_the_engine_stops_cleanly() {
    for depth in [1, 2] {
        lost_device_at(depth);
    }
}

fn lost_device_at(depth: usize) {
    let model = Model::random(Config::tiny_demo(), 3).unwrap();
    let mut config = CpuRouterConfig::new(64, 4);
    config.max_depth = depth;
    config.max_context = Some(112);
    config.prefix_cache = false;
    config.marconi = false;
    let lost = DeviceError::DeviceLost("injected".into());
    let router = Faulty::new(
        CpuRouter::new(model, config).unwrap(),
        vec![Trigger::Launch(7, lost.clone())],
    );
    let engine_config = EngineConfig {
        max_running: 4,
        max_step_tokens: 48,
        max_prefill_chunk: 32,
        ..EngineConfig::default()
    };
    let mut engine = Engine::new(router, engine_config).unwrap();
    let handles: Vec<_> = requests()
        .into_iter()
        .map(|request| engine.submit(request).unwrap())
        .collect();
    engine.run_until_idle();
    assert_eq!(engine.device_lost(), Some(&lost));
    // Six requests, four slots: two were still waiting, four running when the 7th launch (a
    // decode of the four) lost the device; none had finished.
    for handle in handles {
        assert_eq!(
            handle.wait(),
            Err(ServeError::DeviceLost("injected".into()))
        );
    }
    assert_eq!(engine.metrics().failed, 6);
    assert_eq!(
        engine.submit(requests().remove(0)).unwrap_err(),
        scheduler::RequestError::EngineStopped
    );
    assert!(matches!(
        engine.shutdown(ShutdownMode::Drain),
        Err(scheduler::EngineError::DeviceLost(err)) if err == lost
    ));
}
