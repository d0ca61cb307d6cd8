//! End-to-end cache transparency of the engine on the host router: a multi-turn chat workload
//! (forced outputs, logits digests) replayed with the prefix cache and Marconi checkpoints on and
//! off, and with preemption by recompute, by spill (memory and directory) and none, each at
//! pipeline depth 1 and 2, gives every turn the same digest: the xxh3 of the bits of every logits
//! row it produced. At depth 2 the forced rows run ahead with their known tokens and their
//! digests come from `ReadLogits` of each step while the next one computes.

use device_cpu::{CheckpointBudget, CpuRouter, CpuRouterConfig};
use device_io::testing::assert_nothing_held;
use model::{Config, Model};
use scheduler::replay::{replay, Replay, ReplayOptions, TurnOutcome};
use scheduler::workload::{GenOptions, Workload};
use scheduler::{
    Engine, EngineConfig, Preemption, RandomSampling, Request, Sampling, ShutdownMode, SpillTarget,
};

const BLOCK: usize = 16;

fn model() -> Model {
    Model::random(Config::tiny_demo(), 7).unwrap()
}

/// 4 sessions of 3 turns over 2 shared 40-token openers: later turns extend earlier histories.
fn workload(vocab: usize) -> Workload {
    let options = GenOptions {
        seed: 11,
        sessions: 4,
        turns: 3,
        shared_prefixes: 2,
        prefix_len: 40,
        message_len: (6, 20),
        output_len: (10, 24),
        session_gap_s: 0.1,
        think_time_s: 1.0,
    };
    Workload::chat(&options, vocab).unwrap()
}

struct Setup {
    caches: bool,
    num_blocks: usize,
    preemption: Preemption,
    depth: usize,
}

fn run(model: &Model, workload: &Workload, setup: Setup) -> Replay {
    let max_context = workload.longest_turn().div_ceil(BLOCK) * BLOCK;
    let router_config = CpuRouterConfig {
        block_size: BLOCK,
        num_blocks: setup.num_blocks,
        max_seqs: 4,
        checkpoints: CheckpointBudget::Slots(16),
        snapshot_slots: 2,
        prefix_cache: setup.caches,
        marconi: setup.caches,
        max_context: Some(max_context),
        max_depth: setup.depth,
        threads: device_cpu::default_threads(),
        expert_workers: 0,
        lora_slots: 0,
    };
    let router = CpuRouter::new(model.clone(), router_config).unwrap();
    let config = EngineConfig {
        max_running: 4,
        max_step_tokens: 64,
        max_prefill_chunk: 24,
        preemption: setup.preemption,
        ..EngineConfig::default()
    };
    let mut engine = Engine::new(router, config).unwrap();
    let options = ReplayOptions {
        max_in_flight: 4,
        digests: true,
        pace: None,
        ..ReplayOptions::default()
    };
    let result = replay(&mut engine, workload, &options, &mut |_, _| {});
    for (turn, outcome) in workload.turns.iter().zip(&result.outcomes) {
        match outcome {
            TurnOutcome::Done { tokens, digest, .. } => {
                assert_eq!(tokens, &turn.output);
                assert!(digest.is_some());
            }
            other => panic!("session {} turn {}: {other:?}", turn.session, turn.turn),
        }
    }
    assert_nothing_held(engine.router());
    engine.shutdown(ShutdownMode::Drain).unwrap();
    result
}

#[test]
fn caches_and_preemption_do_not_change_a_single_logit() {
    let model = model();
    let workload = workload(model.config().vocab_size);
    let roomy = 64;
    // Four sequences of up to 11 blocks each (outputs of 10 to 24 tokens keep growing after
    // admission), plus what the cache keeps, do not fit in 14: decoding runs the pool dry.
    let tight = 14;

    let reference = run(
        &model,
        &workload,
        Setup {
            caches: false,
            num_blocks: roomy,
            preemption: Preemption::Recompute,
            depth: 1,
        },
    );
    assert_eq!(reference.report.prefill_tokens_cached, 0);
    assert_eq!(reference.report.preemptions, 0);
    let digests = reference.digests();

    for depth in [1, 2] {
        let cached = run(
            &model,
            &workload,
            Setup {
                caches: true,
                num_blocks: roomy,
                preemption: Preemption::Recompute,
                depth,
            },
        );
        assert!(
            cached.report.prefill_tokens_cached > 0,
            "{:?}",
            cached.report
        );
        assert_eq!(cached.digests(), digests, "caches on vs off, depth {depth}");
        if depth == 2 {
            assert_eq!(cached.report.preemptions, 0);
        }
    }

    let spill_dir = std::env::temp_dir();
    let cases = [
        ("recompute, caches on", true, Preemption::Recompute),
        ("recompute, caches off", false, Preemption::Recompute),
        (
            "spill to memory, caches on",
            true,
            Preemption::Spill(SpillTarget::Memory),
        ),
        (
            "spill to a directory, caches off",
            false,
            Preemption::Spill(SpillTarget::Directory(spill_dir)),
        ),
    ];
    for (name, caches, preemption) in cases {
        for depth in [1, 2] {
            let spilling = matches!(preemption, Preemption::Spill(_));
            let result = run(
                &model,
                &workload,
                Setup {
                    caches,
                    num_blocks: tight,
                    preemption: preemption.clone(),
                    depth,
                },
            );
            let report = &result.report;
            assert!(report.preemptions > 0, "{name}, depth {depth}: {report:?}");
            if spilling {
                assert!(report.spills > 0, "{name}, depth {depth}: {report:?}");
                assert_eq!(report.spills, report.restores, "{name}, depth {depth}");
            } else {
                assert_eq!(
                    report.recomputes, report.preemptions,
                    "{name}, depth {depth}"
                );
            }
            assert_eq!(result.digests(), digests, "{name}, depth {depth}");
        }
    }
}

#[test]
fn seeded_sampling_gives_the_same_tokens_with_caches_on_and_off() {
    let model = model();
    let prompt: Vec<u32> = (0..50).map(|i| (i * 13 + 5) % 256).collect();
    let sampling = RandomSampling {
        temperature: 0.8,
        top_k: Some(40),
        top_p: 0.9,
        min_p: 0.02,
        seed: 1234,
    };
    let mut outputs = Vec::new();
    for (caches, depth) in [(true, 1), (false, 1), (true, 2)] {
        let mut config = CpuRouterConfig::new(32, 2);
        config.prefix_cache = caches;
        config.marconi = caches;
        config.max_depth = depth;
        let router = CpuRouter::new(model.clone(), config).unwrap();
        let mut engine = Engine::new(router, EngineConfig::default()).unwrap();
        // The same request twice: the second is served from the cache when caches are on.
        let mut tokens = Vec::new();
        for _ in 0..2 {
            let request = Request::greedy(prompt.clone(), 12)
                .with_sampling(Sampling::Random(sampling))
                .with_logits_digest(true);
            let handle = engine.submit(request).unwrap();
            engine.run_until_idle();
            let done = handle.wait().unwrap();
            tokens.push((done.tokens, done.logits_digest));
        }
        assert_eq!(tokens[0], tokens[1]);
        if caches {
            assert!(engine.metrics().prefill_tokens_cached > 0);
        }
        engine.shutdown(ShutdownMode::Drain).unwrap();
        outputs.push(tokens.remove(0));
    }
    assert_eq!(outputs[0], outputs[1]);
    assert_eq!(outputs[0], outputs[2]);
    // Sampling really sampled: not every token is the same.
    let mut distinct = outputs[0].0.clone();
    distinct.sort_unstable();
    distinct.dedup();
    assert!(distinct.len() > 1);
}

#[test]
fn cache_salts_reach_the_routers_cache_keys() {
    for depth in [1, 2] {
        cache_salts_at(depth);
    }
}

fn cache_salts_at(depth: usize) {
    let model = model();
    let mut config = CpuRouterConfig::new(32, 2);
    config.max_depth = depth;
    let router = CpuRouter::new(model, config).unwrap();
    let mut engine = Engine::new(router, EngineConfig::default()).unwrap();
    let prompt: Vec<u32> = (0..70).map(|i| (i * 5 + 3) % 256).collect();
    let mut cached = Vec::new();
    for salt in [1, 2, 1] {
        let request = Request::greedy(prompt.clone(), 3).with_cache_salt(salt);
        let handle = engine.submit(request).unwrap();
        engine.run_until_idle();
        cached.push(handle.wait().unwrap().usage.cached_tokens);
    }
    // Another tenant's salt misses; the same salt hits (whole blocks, short of the last token).
    assert_eq!(cached[0], 0);
    assert_eq!(cached[1], 0);
    assert!(cached[2] >= 48, "{cached:?}");
    engine.shutdown(ShutdownMode::Drain).unwrap();
}

#[test]
fn the_engine_thread_gives_the_same_outputs_as_stepping() {
    let model = model();
    let requests: Vec<Request> = (0..6u32)
        .map(|i| {
            let prompt: Vec<u32> = (0..30 + 7 * i).map(|t| (t * 13 + i) % 256).collect();
            Request::greedy(prompt, 5 + i as usize).with_logits_digest(true)
        })
        .collect();
    let router = |depth: usize| {
        let mut config = CpuRouterConfig::new(32, 3);
        config.max_depth = depth;
        CpuRouter::new(model.clone(), config).unwrap()
    };

    let mut engine = Engine::new(router(1), EngineConfig::default()).unwrap();
    let handles: Vec<_> = requests
        .iter()
        .map(|r| engine.submit(r.clone()).unwrap())
        .collect();
    engine.run_until_idle();
    let stepped: Vec<_> = handles
        .into_iter()
        .map(|h| {
            let done = h.wait().unwrap();
            (done.tokens, done.logits_digest)
        })
        .collect();
    engine.shutdown(ShutdownMode::Drain).unwrap();

    // On the thread, clients on their own threads submit concurrently: batches differ, outputs
    // must not (at either depth).
    for depth in [1, 2] {
        let thread = scheduler::EngineThread::spawn(
            Engine::new(router(depth), EngineConfig::default()).unwrap(),
        )
        .unwrap();
        let threaded = submit_from_threads(&thread, &requests);
        thread.shutdown(ShutdownMode::Drain).unwrap();
        assert_eq!(threaded, stepped, "depth {depth}");
    }
}

fn submit_from_threads(
    thread: &scheduler::EngineThread,
    requests: &[Request],
) -> Vec<(Vec<u32>, Option<u64>)> {
    let workers: Vec<_> = requests
        .iter()
        .cloned()
        .map(|request| {
            let client = thread.client();
            std::thread::spawn(move || {
                let done = client.submit(request).unwrap().wait().unwrap();
                (done.tokens, done.logits_digest)
            })
        })
        .collect();
    workers.into_iter().map(|w| w.join().unwrap()).collect()
}
