//! The depth-2 oracle on the host router: multi-turn greedy conversations whose turns stop on a
//! stop token mid-batch, reach `max_tokens`, or are cancelled while their next step computes,
//! with the prefix cache and Marconi checkpoints on (on a hybrid model, and the hash-chain cache
//! on an attention-only one), give at depth 2 exactly what they give at depth 1: every turn's
//! tokens, finish reason, logits digest and cached prompt tokens, and afterwards the same cache
//! counters and resources. Host-logits rows (seeded sampling) force drains and still match.
//!
//! The negative controls break the pipeline on purpose: skipping the `Rollback` of an over-run
//! leaves it in the prefix cache (the cache counters or later hits differ), and emitting the
//! over-run token changes the streams; [`the_negative_controls_are_caught`] shows that the same
//! comparison fails for both.

use device_cpu::{CheckpointBudget, CpuRouter, CpuRouterConfig};
use device_io::testing::assert_nothing_held;
use device_io::{DeviceFacts, DeviceIo};
use model::{Config, Model};
use scheduler::{
    Completion, Engine, EngineConfig, FinishReason, PipelineFault, Preemption, RandomSampling,
    Request, Sampling, ShutdownMode, SpillTarget,
};

const SESSIONS: usize = 3;
const TURNS: usize = 3;

fn hybrid() -> Model {
    Model::random(Config::tiny_demo(), 21).unwrap()
}

fn attention_only() -> Model {
    tests::models::attention_only(22)
}

fn message(session: usize, turn: usize, len: usize) -> Vec<u32> {
    (0..len as u32)
        .map(|i| (i * 37 + session as u32 * 101 + turn as u32 * 53 + 7) % 256)
        .collect()
}

/// One turn's outcome, minus timings.
#[derive(Debug, Clone, PartialEq)]
struct Turn {
    tokens: Vec<u32>,
    reason: Result<FinishReason, String>,
    digest: Option<u64>,
    cached: usize,
}

#[derive(Debug, PartialEq)]
struct Outcome {
    turns: Vec<Turn>,
    stats: device_cpu::CacheStats,
    facts: DeviceFacts,
}

struct Scenario {
    model: Model,
    depth: usize,
    num_blocks: usize,
    preemption: Preemption,
    fault: Option<PipelineFault>,
    /// Stop tokens of every request (chosen from what the model says often).
    stops: Vec<u32>,
}

/// Runs `TURNS` rounds of `SESSIONS` concurrent greedy requests; each turn's prompt is the
/// session's history (earlier prompts and outputs) plus a new message. In round 1, session 0's
/// request is cancelled once it has 3 tokens.
fn converse(scenario: &Scenario) -> (Outcome, scheduler::Metrics) {
    let config = CpuRouterConfig {
        block_size: 4,
        num_blocks: scenario.num_blocks,
        max_seqs: 4,
        checkpoints: CheckpointBudget::Slots(24),
        snapshot_slots: 1,
        prefix_cache: true,
        marconi: true,
        max_context: Some(112),
        max_depth: scenario.depth,
        threads: device_cpu::default_threads(),
        expert_workers: 0,
        lora_slots: 0,
    };
    let router = CpuRouter::new(scenario.model.clone(), config).unwrap();
    let engine_config = EngineConfig {
        max_running: 4,
        max_step_tokens: 40,
        max_prefill_chunk: 16,
        preemption: scenario.preemption.clone(),
        ..EngineConfig::default()
    };
    let mut engine = Engine::new(router, engine_config).unwrap();
    if let Some(fault) = scenario.fault {
        engine.inject_pipeline_fault(fault);
    }
    let mut histories: Vec<Vec<u32>> = (0..SESSIONS).map(|s| message(s, 99, 9 + 5 * s)).collect();
    let mut turns = Vec::new();
    for round in 0..TURNS {
        let mut handles = Vec::new();
        for (session, history) in histories.iter_mut().enumerate() {
            history.extend(message(session, round, 3 + round + session));
            let max_tokens = 10 + 3 * session + round;
            let request = Request::greedy(history.clone(), max_tokens)
                .with_stop_tokens(scenario.stops.clone())
                .with_logits_digest(true);
            handles.push(engine.submit(request).unwrap());
        }
        let mut received = vec![Vec::new(); SESSIONS];
        while !engine.is_idle() {
            engine.step();
            for (session, handle) in handles.iter().enumerate() {
                received[session].extend(handle.events().try_iter());
                let tokens = received[session]
                    .iter()
                    .filter(|e| matches!(e, scheduler::Event::Token(_)))
                    .count();
                if round == 1 && session == 0 && tokens == 3 {
                    handle.cancel();
                }
            }
        }
        for (session, (handle, mut events)) in handles.into_iter().zip(received).enumerate() {
            events.extend(handle.events().try_iter());
            let turn = match events.pop() {
                Some(scheduler::Event::Finished {
                    reason,
                    usage,
                    logits_digest,
                }) => {
                    let tokens: Vec<u32> = events
                        .iter()
                        .map(|e| match e {
                            scheduler::Event::Token(t) => *t,
                            other => panic!("{other:?}"),
                        })
                        .collect();
                    Turn {
                        tokens,
                        reason: Ok(reason),
                        digest: logits_digest,
                        cached: usage.cached_tokens,
                    }
                }
                other => Turn {
                    tokens: Vec::new(),
                    reason: Err(format!("{other:?}")),
                    digest: None,
                    cached: 0,
                },
            };
            histories[session].extend_from_slice(&turn.tokens);
            turns.push(turn);
        }
    }
    assert_nothing_held(engine.router());
    let facts = engine.router().facts();
    let outcome = Outcome {
        turns,
        stats: engine.router().cache_stats().unwrap(),
        facts,
    };
    let metrics = *engine.metrics();
    engine.shutdown(ShutdownMode::Drain).unwrap();
    (outcome, metrics)
}

/// The stop tokens: every twelfth id, so that about one token in twelve ends a turn, mid-way
/// through most of them.
fn stop_tokens() -> Vec<u32> {
    (0..256).filter(|t| t % 12 == 5).collect()
}

/// Runs the scenario at depth 1 and at depth 2 and compares every turn's tokens, reason and
/// digest, and with `cache_exact` also its cached tokens and the cache counters and facts at the
/// end.
fn compare(
    model: &Model,
    num_blocks: usize,
    preemption: Preemption,
    fault: Option<PipelineFault>,
    stops: Vec<u32>,
    cache_exact: bool,
) -> Result<(scheduler::Metrics, scheduler::Metrics), String> {
    let scenario = |depth, fault| Scenario {
        model: model.clone(),
        depth,
        num_blocks,
        preemption: preemption.clone(),
        fault,
        stops: stops.clone(),
    };
    let (mut sync, sync_metrics) = converse(&scenario(1, None));
    let (mut piped, piped_metrics) = converse(&scenario(2, fault));
    if !cache_exact {
        // Under a dry pool depth 2 holds each row's next block one step earlier, so preemption
        // and eviction may choose differently: only what the requests see must match.
        for turn in sync.turns.iter_mut().chain(piped.turns.iter_mut()) {
            turn.cached = 0;
        }
        piped.stats = sync.stats;
        piped.facts = sync.facts;
    }
    if sync != piped {
        let first = sync
            .turns
            .iter()
            .zip(&piped.turns)
            .position(|(a, b)| a != b)
            .map(|i| format!("turn {i}: {:?} vs {:?}", sync.turns[i], piped.turns[i]))
            .unwrap_or_else(|| {
                format!(
                    "{:?} / {:?} vs {:?} / {:?}",
                    sync.stats, sync.facts, piped.stats, piped.facts
                )
            });
        return Err(first);
    }
    Ok((sync_metrics, piped_metrics))
}

fn check_kinds(turns: &[Turn]) {
    let stopped = turns
        .iter()
        .filter(|t| matches!(t.reason, Ok(FinishReason::Stop(_))))
        .count();
    let length = turns
        .iter()
        .filter(|t| t.reason == Ok(FinishReason::Length))
        .count();
    let cancelled = turns
        .iter()
        .filter(|t| t.reason == Ok(FinishReason::Cancelled))
        .count();
    assert!(stopped >= 2 && length >= 1 && cancelled == 1, "{turns:?}");
    assert!(
        turns.iter().skip(SESSIONS).any(|t| t.cached > 0),
        "{turns:?}"
    );
}

#[test]
fn stops_lengths_and_cancels_with_caches_on_are_identical_at_depth_two() {
    for model in [hybrid(), attention_only()] {
        let stops = stop_tokens();
        let (outcome, _) = converse(&Scenario {
            model: model.clone(),
            depth: 1,
            num_blocks: 256,
            preemption: Preemption::Recompute,
            fault: None,
            stops,
        });
        check_kinds(&outcome.turns);
        let (_, piped) = compare(
            &model,
            256,
            Preemption::Recompute,
            None,
            stop_tokens(),
            true,
        )
        .unwrap();
        assert!(piped.fed_launches > 10, "{piped:?}");
        assert!(piped.rollbacks >= 2, "{piped:?}");
    }
}

#[test]
fn preemption_by_recompute_and_by_spill_is_identical_at_depth_two() {
    let model = hybrid();
    // 28 blocks of 4 tokens cannot hold three growing conversations.
    for preemption in [
        Preemption::Recompute,
        Preemption::Spill(SpillTarget::Memory),
    ] {
        let (sync, piped) =
            compare(&model, 28, preemption.clone(), None, Vec::new(), false).unwrap();
        assert!(sync.preemptions > 0, "{preemption:?}: {sync:?}");
        assert!(piped.preemptions > 0, "{preemption:?}: {piped:?}");
    }
}

/// The negative controls: the comparison above fails when the pipeline is broken on purpose.
/// With `PipelineFault::SkipRollback` (over-runs discarded but never rolled back) a later turn is
/// served more from the cache than at depth 1: on the attention-only model turn 5 gets 28 cached
/// prompt tokens instead of 24 (the over-run's block was cached), on the hybrid one turn 8 gets
/// 44 instead of 40 (a Marconi checkpoint of the over-run state was kept). With
/// `PipelineFault::EmitOverRun` the streams differ.
#[test]
fn the_negative_controls_are_caught() {
    for model in [attention_only(), hybrid()] {
        let skipped = compare(
            &model,
            256,
            Preemption::Recompute,
            Some(PipelineFault::SkipRollback),
            stop_tokens(),
            true,
        );
        let err = skipped.expect_err("skipping the rollback went unnoticed");
        assert!(err.contains("cached"), "{err}");
    }
    let emitted = compare(
        &attention_only(),
        256,
        Preemption::Recompute,
        Some(PipelineFault::EmitOverRun),
        stop_tokens(),
        true,
    );
    assert!(emitted.is_err(), "emitting the over-run went unnoticed");
}

#[test]
fn host_logits_rows_drain_the_pipeline_and_give_the_same_samples() {
    let model = hybrid();
    let run = |depth: usize| {
        let mut config = CpuRouterConfig::new(64, 4);
        config.max_depth = depth;
        let router = CpuRouter::new(model.clone(), config).unwrap();
        let mut engine = Engine::new(router, EngineConfig::default()).unwrap();
        let prompt: Vec<u32> = (0..30).map(|i| (i * 13 + 5) % 256).collect();
        // A greedy request runs ahead alone until the sampled one arrives.
        let greedy = engine
            .submit(Request::greedy(prompt.clone(), 24).with_logits_digest(true))
            .unwrap();
        for _ in 0..6 {
            engine.step();
        }
        let sampled = engine
            .submit(
                Request::greedy(prompt, 12)
                    .with_sampling(Sampling::Random(RandomSampling::new(0.9, 99)))
                    .with_logits_digest(true),
            )
            .unwrap();
        engine.run_until_idle();
        let out = |done: Completion| (done.tokens, done.reason, done.logits_digest);
        let result = (out(greedy.wait().unwrap()), out(sampled.wait().unwrap()));
        let metrics = *engine.metrics();
        engine.shutdown(ShutdownMode::Drain).unwrap();
        (result, metrics)
    };
    let (sync, _) = run(1);
    let (piped, metrics) = run(2);
    assert_eq!(piped, sync);
    assert!(metrics.fed_launches > 0, "{metrics:?}");
    assert!(metrics.pipeline_drains > 0, "{metrics:?}");
}
