//! The engine against `device_io::testing::ScriptedRouter`: scheduling, chunked prefill, stop
//! conditions, cancellation, preemption (recompute and spill), compaction, faults, shutdown, and
//! the threaded client. Tokens are the scripted router's deterministic function of (id, position),
//! so every expected output is exact.

mod common;

use common::{config, expected, idle_facts, prompt, router};

use device_io::testing::{FaultAt, Hooked, Hooks, ScriptedRouter, ScriptedSeq};
use device_io::{DeviceError, DeviceIo, Phase, StepPlan, Ticket};
use device_trace::{TraceSink, TracingDeviceIo};
use scheduler::replay::{replay, ReplayOptions, TurnOutcome};
use scheduler::workload::{GenOptions, TokenIds, Workload};
use scheduler::{
    Completion, Engine, EngineConfig, EngineError, EngineThread, Event, FinishReason, Preemption,
    RandomSampling, Request, RequestError, RequestHandle, Sampling, ServeError, ShutdownMode,
    SpillTarget,
};

fn engine(num_blocks: usize, num_slots: usize, config: EngineConfig) -> Engine<ScriptedRouter> {
    Engine::new(router(num_blocks, num_slots), config).unwrap()
}

fn done(handle: RequestHandle) -> Completion {
    handle.wait().expect("request failed")
}

#[test]
fn greedy_requests_stream_the_routers_tokens_then_finish() {
    let mut engine = engine(64, 8, config());
    let a = engine.submit(Request::greedy(prompt(5, 1), 3)).unwrap();
    let b = engine.submit(Request::greedy(prompt(9, 2), 4)).unwrap();
    let (ida, idb) = (a.id(), b.id());
    engine.run_until_idle();
    let events: Vec<Event> = a.events().try_iter().collect();
    let want = expected(engine.router(), ida, 5, 3);
    assert_eq!(events.len(), 4);
    for (event, token) in events.iter().zip(&want) {
        assert_eq!(event, &Event::Token(*token));
    }
    match &events[3] {
        Event::Finished {
            reason,
            usage,
            logits_digest,
        } => {
            assert_eq!(*reason, FinishReason::Length);
            assert_eq!(usage.prompt_tokens, 5);
            assert_eq!(usage.generated_tokens, 3);
            assert_eq!(usage.cached_tokens, 0);
            assert_eq!(usage.preemptions, 0);
            assert!(usage.time_to_first_token.is_some());
            assert!(usage.time_per_output_token.is_some());
            assert_eq!(*logits_digest, None);
        }
        other => panic!("expected Finished, got {other:?}"),
    }
    let b = done(b);
    assert_eq!(b.tokens, expected(engine.router(), idb, 9, 4));
    assert_eq!(engine.router().facts(), idle_facts(engine.router()));
    let metrics = engine.metrics();
    assert_eq!(metrics.finished, 2);
    assert_eq!(metrics.generated_tokens, 7);
    assert_eq!(metrics.prefill_tokens_computed, 14);
}

#[test]
fn prefill_is_chunked_under_the_step_budget() {
    let config = EngineConfig {
        max_running: 4,
        max_step_tokens: 10,
        max_prefill_chunk: 6,
        ..EngineConfig::default()
    };
    let mut engine = engine(64, 8, config);
    let a = engine.submit(Request::greedy(prompt(15, 1), 2)).unwrap();
    let b = engine.submit(Request::greedy(prompt(7, 2), 2)).unwrap();
    let (ida, idb) = (a.id(), b.id());
    // Step 1: a takes 6 (its chunk), b the other 4 of the budget.
    let step = engine.step();
    assert_eq!(
        (step.admitted, step.prefill_rows, step.prefill_tokens),
        (2, 2, 10)
    );
    // Step 2: a 6 more, b its last 3; b's prompt completes and yields its first token.
    let step = engine.step();
    assert_eq!(
        (step.decode_rows, step.prefill_rows, step.prefill_tokens),
        (0, 2, 9)
    );
    // Step 3: b decodes (1 of the budget); a computes its last 3.
    let step = engine.step();
    assert_eq!(
        (step.decode_rows, step.prefill_rows, step.prefill_tokens),
        (1, 1, 3)
    );
    assert_eq!(step.ended, 1);
    engine.run_until_idle();
    assert_eq!(done(a).tokens, expected(engine.router(), ida, 15, 2));
    assert_eq!(done(b).tokens, expected(engine.router(), idb, 7, 2));
}

#[test]
fn a_stop_token_ends_the_request_and_is_part_of_the_output() {
    let mut engine = engine(64, 8, config());
    let probe = engine.submit(Request::greedy(prompt(6, 3), 5)).unwrap();
    let id = probe.id();
    engine.run_until_idle();
    let full = done(probe).tokens;
    assert_eq!(full, expected(engine.router(), id, 6, 5));
    // The scripted tokens depend on the id, so script the next request's tokens directly.
    engine.router().script(&[11, 12, 13, 14, 15]);
    let handle = engine
        .submit(Request::greedy(prompt(6, 3), 5).with_stop_tokens(vec![13]))
        .unwrap();
    engine.run_until_idle();
    let completion = done(handle);
    assert_eq!(completion.tokens, vec![11, 12, 13]);
    assert_eq!(completion.reason, FinishReason::Stop(13));
    engine.router().script(&[]);
}

#[test]
fn forced_tokens_replace_the_routers_choice() {
    let mut engine = engine(64, 8, config());
    let handle = engine
        .submit(Request::forced(prompt(5, 0), vec![9, 8, 7]))
        .unwrap();
    engine.run_until_idle();
    let completion = done(handle);
    assert_eq!(completion.tokens, vec![9, 8, 7]);
    assert_eq!(completion.reason, FinishReason::Length);
}

#[test]
fn cancel_ends_waiting_and_running_requests() {
    let config = EngineConfig {
        max_running: 1,
        max_step_tokens: 8,
        ..config()
    };
    let mut engine = engine(64, 8, config);
    let running = engine.submit(Request::greedy(prompt(4, 0), 50)).unwrap();
    let queued = engine.submit(Request::greedy(prompt(4, 1), 50)).unwrap();
    engine.step();
    engine.step();
    assert_eq!((engine.running_len(), engine.waiting_len()), (1, 1));
    queued.cancel();
    running.cancel();
    engine.step();
    assert!(engine.is_idle());
    for handle in [running, queued] {
        let completion = done(handle);
        assert_eq!(completion.reason, FinishReason::Cancelled);
    }
    assert_eq!(engine.metrics().cancelled, 2);
    assert_eq!(engine.router().facts(), idle_facts(engine.router()));
    let effects = engine.router().effects();
    assert!(effects.contains(&"ReleaseSeq{cache=true, cancel}".to_string()));
}

#[test]
fn bad_requests_are_refused_at_submission() {
    let mut engine = engine(16, 4, config());
    let cases = [
        (Request::greedy(vec![], 1), RequestError::EmptyPrompt),
        (
            Request::greedy(vec![1, 1000], 1),
            RequestError::TokenOutOfVocab {
                field: "prompt",
                index: 1,
                token: 1000,
                vocab_size: 1000,
            },
        ),
        (Request::greedy(vec![1], 0), RequestError::ZeroMaxTokens),
        (
            Request::greedy(vec![1; 70], 1),
            RequestError::PromptTooLong {
                len: 70,
                max_context: 64,
            },
        ),
        (
            Request::greedy(vec![1], 1).with_adapter(4),
            RequestError::UnknownAdapter {
                adapter: 4,
                known: vec![],
            },
        ),
        (
            Request::greedy(vec![1], 1)
                .with_sampling(Sampling::Random(RandomSampling::new(f32::INFINITY, 1))),
            RequestError::Temperature(f32::INFINITY),
        ),
    ];
    for (request, error) in cases {
        assert_eq!(engine.submit(request).unwrap_err(), error);
    }
    assert!(engine.is_idle());
    assert_eq!(engine.metrics().admitted, 0);
}

#[test]
fn requests_that_each_need_the_whole_pool_take_turns() {
    // 8 blocks of 4 = 32 positions; 20 + 12 - 1 = 31 positions need all 8 blocks.
    let mut engine = engine(8, 4, config());
    let a = engine.submit(Request::greedy(prompt(20, 0), 12)).unwrap();
    let b = engine.submit(Request::greedy(prompt(20, 1), 12)).unwrap();
    let (ida, idb) = (a.id(), b.id());
    engine.run_until_idle();
    assert_eq!(done(a).tokens, expected(engine.router(), ida, 20, 12));
    assert_eq!(done(b).tokens, expected(engine.router(), idb, 20, 12));
    assert_eq!(engine.router().facts(), idle_facts(engine.router()));
}

/// Runs `n` requests of different lengths and answers each one's output (by submission order).
fn run_mix(engine: &mut Engine<ScriptedRouter>, n: usize) -> Vec<(u64, Completion)> {
    let handles: Vec<RequestHandle> = (0..n)
        .map(|i| {
            engine
                .submit(Request::greedy(prompt(6 + 3 * i, i as u32), 10 + i))
                .unwrap()
        })
        .collect();
    engine.run_until_idle();
    handles.into_iter().map(|h| (h.id(), done(h))).collect()
}

fn check_mix(engine: &Engine<ScriptedRouter>, results: &[(u64, Completion)]) {
    for (i, (id, completion)) in results.iter().enumerate() {
        assert_eq!(
            completion.tokens,
            expected(engine.router(), *id, 6 + 3 * i, 10 + i),
            "request {i}"
        );
    }
}

#[test]
fn kv_exhaustion_preempts_by_recompute_and_outputs_do_not_change() {
    // 16 blocks of 4: six requests of up to 35 positions cannot all stay resident.
    let mut engine = engine(16, 8, config());
    let results = run_mix(&mut engine, 6);
    check_mix(&engine, &results);
    let metrics = *engine.metrics();
    assert!(metrics.preemptions > 0, "{metrics:?}");
    assert_eq!(metrics.recomputes, metrics.preemptions);
    assert_eq!(metrics.spills, 0);
    let preempted: usize = results.iter().map(|(_, c)| c.usage.preemptions).sum();
    assert_eq!(preempted as u64, metrics.preemptions);
    assert_eq!(engine.router().facts(), idle_facts(engine.router()));
    let effects = engine.router().effects();
    assert!(effects.contains(&"ReleaseSeq{cache=true, preempt}".to_string()));
}

#[test]
fn kv_exhaustion_preempts_by_spill_to_memory_and_to_a_directory() {
    let parent = std::env::temp_dir();
    for target in [SpillTarget::Memory, SpillTarget::Directory(parent)] {
        let config = EngineConfig {
            preemption: Preemption::Spill(target.clone()),
            ..config()
        };
        let mut engine = engine(16, 8, config);
        let dir = engine.spill_directory().map(|d| d.to_path_buf());
        assert_eq!(dir.is_some(), matches!(target, SpillTarget::Directory(_)));
        let results = run_mix(&mut engine, 6);
        check_mix(&engine, &results);
        let metrics = *engine.metrics();
        assert!(metrics.spills > 0, "{metrics:?}");
        assert_eq!(metrics.spills, metrics.restores);
        assert_eq!(metrics.recomputes, 0);
        assert_eq!(engine.router().facts(), idle_facts(engine.router()));
        let effects = engine.router().effects();
        assert!(effects.contains(&"SaveSequenceState".to_string()));
        assert!(effects.contains(&"RestoreSequenceState".to_string()));
        assert!(effects.contains(&"ReleaseSeq{cache=false, preempt}".to_string()));
        engine.shutdown(ShutdownMode::Drain).unwrap();
        if let Some(dir) = dir {
            assert!(!dir.exists(), "{} left behind", dir.display());
        }
    }
}

#[test]
fn a_failed_restore_falls_back_to_recompute() {
    let config = EngineConfig {
        preemption: Preemption::Spill(SpillTarget::Memory),
        ..config()
    };
    let mut engine = engine(16, 8, config);
    engine.router().inject(
        FaultAt::Effect("RestoreSequenceState"),
        DeviceError::BadImage("checksum mismatch".into()),
    );
    let results = run_mix(&mut engine, 6);
    check_mix(&engine, &results);
    let metrics = *engine.metrics();
    assert_eq!(metrics.spill_fallbacks, 1, "{metrics:?}");
    assert_eq!(metrics.restores + 1, metrics.spills);
    assert_eq!(engine.router().facts(), idle_facts(engine.router()));
}

#[test]
fn survivors_are_compacted_into_the_low_slots() {
    let mut engine = engine(64, 8, config());
    let a = engine.submit(Request::greedy(prompt(4, 0), 6)).unwrap();
    let b = engine.submit(Request::greedy(prompt(4, 1), 2)).unwrap();
    let c = engine.submit(Request::greedy(prompt(4, 2), 6)).unwrap();
    engine.run_until_idle();
    for handle in [a, b, c] {
        done(handle);
    }
    let effects = engine.router().effects();
    // b (slot 1) finishes first; c moves from slot 2 to slot 1.
    let release = effects
        .iter()
        .position(|e| e == "ReleaseSeq{cache=true, finish}")
        .unwrap();
    assert_eq!(effects[release + 1], "CompactSlot{target=1}");
    assert_eq!(engine.metrics().compactions, 1);
}

#[test]
fn a_launch_fault_fails_exactly_that_steps_rows() {
    let mut engine = engine(64, 8, config());
    let a = engine.submit(Request::greedy(prompt(4, 0), 5)).unwrap();
    engine.step(); // a is prefilled and has its first token.
    let b = engine.submit(Request::greedy(prompt(8, 1), 3)).unwrap();
    let idb = b.id();
    // The next launch is step 2's decode plan, whose only row is a; b's prefill goes on.
    engine.router().inject(
        FaultAt::Launch,
        DeviceError::Failed {
            phase: Phase::Forward,
            message: "injected".into(),
        },
    );
    engine.run_until_idle();
    match a.wait() {
        Err(ServeError::Device { during, source }) => {
            assert_eq!(during, "Decode");
            assert!(matches!(source, DeviceError::Failed { .. }));
        }
        other => panic!("expected a device error, got {other:?}"),
    }
    assert_eq!(done(b).tokens, expected(engine.router(), idb, 8, 3));
    assert!(engine
        .router()
        .effects()
        .contains(&"ReleaseSeq{cache=false, fault}".to_string()));
    assert_eq!(engine.router().facts(), idle_facts(engine.router()));
    assert_eq!(engine.metrics().failed, 1);
}

#[test]
fn effect_faults_fail_only_the_request_they_hit() {
    // A failed CompactSlot fails the moved request; a failed release of a finished one fails
    // it (and the retry without caching frees it).
    let mut engine = engine(64, 8, config());
    let a = engine.submit(Request::greedy(prompt(4, 0), 6)).unwrap();
    let b = engine.submit(Request::greedy(prompt(4, 1), 2)).unwrap();
    let c = engine.submit(Request::greedy(prompt(4, 2), 6)).unwrap();
    engine.router().inject(
        FaultAt::Effect("CompactSlot"),
        DeviceError::Invalid {
            what: "CompactSlot",
            detail: "injected".into(),
        },
    );
    engine.run_until_idle();
    assert_eq!(done(a).tokens.len(), 6);
    assert_eq!(done(b).tokens.len(), 2);
    assert!(matches!(
        c.wait(),
        Err(ServeError::Device {
            during: "CompactSlot",
            ..
        })
    ));
    assert_eq!(engine.router().facts(), idle_facts(engine.router()));

    let d = engine.submit(Request::greedy(prompt(4, 3), 2)).unwrap();
    let e = engine.submit(Request::greedy(prompt(4, 4), 3)).unwrap();
    engine.router().inject(
        FaultAt::Effect("ReleaseSeq"),
        DeviceError::Failed {
            phase: Phase::Effect,
            message: "injected".into(),
        },
    );
    engine.run_until_idle();
    assert!(matches!(
        d.wait(),
        Err(ServeError::Device {
            during: "ReleaseSeq",
            ..
        })
    ));
    assert_eq!(done(e).tokens.len(), 3);
    assert_eq!(engine.router().facts(), idle_facts(engine.router()));
}

#[test]
fn a_sequence_that_cannot_fit_even_alone_fails_instead_of_looping() {
    let mut engine = engine(16, 8, config());
    let a = engine.submit(Request::greedy(prompt(8, 0), 4)).unwrap();
    engine.router().inject(
        FaultAt::Launch,
        DeviceError::KvExhausted { needed: 2, free: 0 },
    );
    engine.run_until_idle();
    assert_eq!(a.wait(), Err(ServeError::CannotFit { needed: 2, free: 0 }));
    let b = engine.submit(Request::greedy(prompt(8, 0), 4)).unwrap();
    engine.run_until_idle();
    assert_eq!(done(b).tokens.len(), 4);
    assert_eq!(engine.router().facts(), idle_facts(engine.router()));
}

#[test]
fn host_logits_that_the_router_refuses_fail_only_those_rows() {
    let mut engine = engine(64, 8, config());
    let random = engine
        .submit(
            Request::greedy(prompt(4, 0), 3)
                .with_sampling(Sampling::Random(RandomSampling::new(0.7, 5))),
        )
        .unwrap();
    engine.run_until_idle();
    assert_eq!(
        random.wait(),
        Err(ServeError::Device {
            during: "Prefill",
            source: DeviceError::Unsupported { what: "HostLogits" }
        })
    );
    let greedy = engine.submit(Request::greedy(prompt(4, 0), 3)).unwrap();
    engine.run_until_idle();
    assert_eq!(done(greedy).tokens.len(), 3);
}

#[test]
fn abort_shutdown_fails_what_is_left() {
    let config = EngineConfig {
        max_running: 1,
        max_step_tokens: 8,
        streams: vec![0, 1],
        ..config()
    };
    let mut engine = engine(64, 8, config);
    let running = engine.submit(Request::greedy(prompt(4, 0), 50)).unwrap();
    let queued = engine.submit(Request::greedy(prompt(4, 1), 50)).unwrap();
    engine.step();
    let client = engine.client();
    let metrics = engine.shutdown(ShutdownMode::Abort).unwrap();
    assert_eq!(metrics.failed, 2);
    assert_eq!(running.wait(), Err(ServeError::Shutdown));
    assert_eq!(queued.wait(), Err(ServeError::Shutdown));
    assert_eq!(
        client.submit(Request::greedy(vec![1], 1)).unwrap_err(),
        RequestError::EngineStopped
    );
}

#[test]
fn shutdown_effects_come_last_in_order() {
    let config = EngineConfig {
        streams: vec![0, 1],
        ..config()
    };
    let (sink, trace) = TraceSink::memory();
    let router = TracingDeviceIo::new(router(64, 8), sink);
    let mut engine = Engine::new(router, config).unwrap();
    let handle = engine.submit(Request::greedy(prompt(4, 0), 2)).unwrap();
    // Drain serves the request to completion before stopping the router.
    let metrics = engine.shutdown(ShutdownMode::Drain).unwrap();
    assert_eq!(metrics.finished, 1);
    assert_eq!(done(handle).tokens.len(), 2);
    let lines = trace.lines();
    let tail: Vec<&str> = lines[lines.len() - 10..]
        .iter()
        .map(String::as_str)
        .collect();
    assert_eq!(
        tail,
        [
            "fx apply ReleaseSeq{cache=true, finish}",
            "-> Unit",
            "fx apply EpShutdown",
            "-> Unit",
            "fx apply Quiesce{stream=0}",
            "-> Unit",
            "fx apply Quiesce{stream=1}",
            "-> Unit",
            "fx teardown",
            "-> ok",
        ]
    );
}

/// Around a [`ScriptedRouter`]: waits for a permit before each launch, so a test can hold the
/// engine thread between steps.
#[derive(Debug)]
struct LaunchGate {
    permits: crossbeam_channel::Receiver<()>,
}

impl Hooks for LaunchGate {
    fn launch(
        &self,
        router: &ScriptedRouter,
        plan: StepPlan<'_>,
        rows: &mut [&mut ScriptedSeq],
    ) -> Result<Ticket, DeviceError> {
        // A closed gate (sender dropped) lets every launch through.
        let _ = self.permits.recv();
        router.launch(plan, rows)
    }
}

#[test]
fn the_engine_thread_serves_clients_on_other_threads() {
    let engine = engine(64, 8, config());
    let thread = EngineThread::spawn(engine).unwrap();
    let workers: Vec<_> = (0..4)
        .map(|i| {
            let client = thread.client();
            std::thread::spawn(move || {
                let handle = client
                    .submit(Request::greedy(prompt(5 + i, i as u32), 4))
                    .unwrap();
                done(handle).tokens.len()
            })
        })
        .collect();
    for worker in workers {
        assert_eq!(worker.join().unwrap(), 4);
    }
    let client = thread.client();
    let metrics = thread.shutdown(ShutdownMode::Drain).unwrap();
    assert_eq!(metrics.finished, 4);
    assert_eq!(
        client.submit(Request::greedy(vec![1], 1)).unwrap_err(),
        RequestError::EngineStopped
    );
}

#[test]
fn a_cancel_reaches_the_engine_thread_within_a_step() {
    let (permits, gate) = crossbeam_channel::unbounded();
    let router = Hooked {
        router: router(64, 8),
        hooks: LaunchGate { permits: gate },
    };
    let thread = EngineThread::spawn(Engine::new(router, config()).unwrap()).unwrap();
    let handle = thread
        .client()
        .submit(Request::greedy(prompt(4, 9), 60))
        .unwrap();
    permits.send(()).unwrap(); // the prefill step: the first token
    assert!(matches!(handle.events().recv(), Ok(Event::Token(_))));
    handle.cancel();
    // At most the step already waiting at the gate runs before the engine takes the cancel.
    drop(permits);
    let end = handle.wait().unwrap();
    assert_eq!(end.reason, FinishReason::Cancelled);
    assert!(end.tokens.len() <= 1, "{:?}", end.tokens);
    let metrics = thread.shutdown(ShutdownMode::Drain).unwrap();
    assert_eq!(metrics.cancelled, 1);
}

#[test]
fn public_handles_are_send_and_clients_are_sync() {
    fn send<T: Send>() {}
    fn sync<T: Sync>() {}
    send::<scheduler::EngineClient>();
    sync::<scheduler::EngineClient>();
    send::<RequestHandle>();
    send::<EngineThread>();
    send::<Engine<ScriptedRouter>>();
    send::<Event>();
    sync::<Event>();
}

#[test]
fn replay_forces_the_recorded_outputs_and_counts_everything() {
    let options = GenOptions {
        sessions: 3,
        turns: 3,
        shared_prefixes: 1,
        prefix_len: 20,
        message_len: (4, 8),
        output_len: (2, 5),
        ..GenOptions::chat(5)
    };
    let workload = Workload::chat(&options, 1000).unwrap();
    let mut engine = engine(256, 8, config());
    let mut seen = Vec::new();
    let replay_options = ReplayOptions {
        max_in_flight: 2,
        digests: false,
        pace: None,
        ..ReplayOptions::default()
    };
    let result = replay(&mut engine, &workload, &replay_options, &mut |turn, _| {
        seen.push(turn)
    });
    seen.sort_unstable();
    assert_eq!(seen, (0..9).collect::<Vec<_>>());
    for (turn, outcome) in workload.turns.iter().zip(&result.outcomes) {
        match outcome {
            TurnOutcome::Done { tokens, .. } => assert_eq!(tokens, &turn.output),
            other => panic!("{other:?}"),
        }
    }
    let report = &result.report;
    assert_eq!(
        (report.requests, report.completed, report.failed),
        (9, 9, 0)
    );
    assert_eq!(report.input_tokens, workload.input_tokens());
    assert_eq!(report.output_tokens, workload.output_tokens());
    assert_eq!(
        report.prefill_tokens_computed,
        workload.input_tokens() as u64
    );
    assert_eq!(report.token_hit_rate, 0.0);
    assert_eq!(engine.router().facts(), idle_facts(engine.router()));
}

#[test]
fn replay_skips_turns_without_output_and_reports_refused_ones() {
    let text = r#"{"session_id": "x", "turn_id": 0, "ts": 0.0, "num_input_tokens": 3, "num_output_tokens": 2, "input_tokens": [1, 2, 3], "output_tokens": [4, 5]}
{"session_id": "x", "turn_id": 1, "ts": 1.0, "num_input_tokens": 2, "num_output_tokens": 0, "input_tokens": [1, 2], "output_tokens": []}
{"session_id": "y", "turn_id": 0, "ts": 2.0, "num_input_tokens": 70, "num_output_tokens": 1, "input_tokens": [9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9], "output_tokens": [1]}
"#;
    let workload = Workload::from_jsonl("trace", text, 1000, TokenIds::Refuse).unwrap();
    let mut engine = engine(16, 4, config());
    let result = replay(
        &mut engine,
        &workload,
        &ReplayOptions::default(),
        &mut |_, _| {},
    );
    assert!(matches!(result.outcomes[0], TurnOutcome::Done { .. }));
    assert_eq!(result.outcomes[1], TurnOutcome::Skipped);
    assert_eq!(
        result.outcomes[2],
        TurnOutcome::Failed(
            RequestError::PromptTooLong {
                len: 70,
                max_context: 64
            }
            .to_string()
        )
    );
    let report = &result.report;
    assert_eq!((report.completed, report.skipped, report.failed), (1, 1, 1));
}

#[test]
fn the_victim_is_the_request_with_the_fewest_generated_tokens() {
    // 10 blocks of 4; each request grows to 4 + 20 - 1 = 23 positions (6 blocks): both cannot
    // stay resident to the end.
    let mut engine = engine(10, 4, config());
    let a = engine.submit(Request::greedy(prompt(4, 0), 20)).unwrap();
    for _ in 0..3 {
        engine.step();
    }
    let b = engine.submit(Request::greedy(prompt(4, 1), 20)).unwrap();
    let (ida, idb) = (a.id(), b.id());
    engine.run_until_idle();
    let (a, b) = (done(a), done(b));
    assert_eq!(a.tokens, expected(engine.router(), ida, 4, 20));
    assert_eq!(b.tokens, expected(engine.router(), idb, 4, 20));
    assert_eq!(a.usage.preemptions, 0);
    assert!(b.usage.preemptions >= 1);
    assert_eq!(engine.router().facts(), idle_facts(engine.router()));
}

#[test]
fn engine_config_rules_are_checked() {
    let bad = EngineConfig {
        max_running: 8,
        max_step_tokens: 8,
        ..config()
    };
    match Engine::new(router(16, 4), bad) {
        Err(EngineError::Config { field, value, rule }) => {
            assert_eq!(
                (field, value, rule),
                ("max_step_tokens", 8, "max_step_tokens > max_running")
            );
        }
        other => panic!("expected a config error, got {other:?}"),
    }
    let zero = EngineConfig {
        max_prefill_chunk: 0,
        ..config()
    };
    assert!(matches!(
        Engine::new(router(16, 4), zero),
        Err(EngineError::Config {
            field: "max_prefill_chunk",
            value: 0,
            ..
        })
    ));
}

#[test]
fn a_dropped_handle_cancels_its_request_at_the_next_token() {
    let mut engine = engine(64, 8, config());
    let handle = engine.submit(Request::greedy(prompt(4, 0), 50)).unwrap();
    drop(handle);
    engine.run_until_idle();
    let metrics = *engine.metrics();
    assert_eq!((metrics.cancelled, metrics.finished), (1, 0));
    // The first token found nobody listening; no compute was spent after it.
    assert_eq!(metrics.generated_tokens, 1);
    assert_eq!(metrics.decode_launches, 0);
    assert_eq!(engine.router().facts(), idle_facts(engine.router()));
}
