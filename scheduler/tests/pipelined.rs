//! The engine at depth 2 over the scripted router (`max_depth: 2`): the same streams as at depth
//! 1 for greedy and forced requests with stop tokens mid-batch, `max_tokens` reached by some rows,
//! cancels while a step is in flight, preemption and faults; the router's input log shows the
//! device fed exactly what the host emitted; and the negative controls (skipping the rollback,
//! emitting the over-run) are caught by the same checks.

mod common;

use common::{prompt, router_at_depth};
use device_io::testing::{FaultAt, ScriptedRouter};
use device_io::{DeviceError, DeviceFacts, DeviceIo, Phase};
use scheduler::{
    Engine, EngineConfig, Event, FinishReason, PipelineFault, Preemption, Request, RequestHandle,
    ShutdownMode, SpillTarget,
};

fn config(preemption: Preemption) -> EngineConfig {
    EngineConfig {
        max_running: 4,
        max_step_tokens: 32,
        max_prefill_chunk: 8,
        preemption,
        ..EngineConfig::default()
    }
}

/// A request's whole stream: its tokens, then how it ended.
type Stream = (Vec<u32>, Result<FinishReason, String>);

/// Runs requests built by `requests(id)` (ids are 1, 2, ... in order) to completion, stepping by
/// hand; `cancel_after` cancels a request once it has received that many tokens. Answers the
/// streams, the engine's metrics and whether the router's input log matched every stream.
struct Run {
    streams: Vec<Stream>,
    metrics: scheduler::Metrics,
    inputs_match: Result<(), String>,
    rollbacks: Vec<u64>,
}

fn run(
    depth: usize,
    num_blocks: usize,
    preemption: Preemption,
    fault: Option<PipelineFault>,
    requests: &dyn Fn(&ScriptedRouter, u64) -> Option<Request>,
    cancel_after: &[(u64, usize)],
) -> Run {
    let mut engine =
        Engine::new(router_at_depth(depth, num_blocks, 4), config(preemption)).unwrap();
    if let Some(fault) = fault {
        engine.inject_pipeline_fault(fault);
    }
    let initial = DeviceFacts {
        live_slots_used: 0,
        kv_blocks_free: num_blocks,
        ..engine.router().facts()
    };
    let mut handles: Vec<(RequestHandle, Vec<u32>, Vec<Event>)> = Vec::new();
    for id in 1.. {
        let Some(request) = requests(engine.router(), id) else {
            break;
        };
        let prompt = request.prompt.clone();
        let handle = engine.submit(request).unwrap();
        assert_eq!(handle.id(), id);
        handles.push((handle, prompt, Vec::new()));
    }
    while !engine.is_idle() {
        engine.step();
        for (handle, _, events) in &mut handles {
            events.extend(handle.events().try_iter());
            let received = events
                .iter()
                .filter(|e| matches!(e, Event::Token(_)))
                .count();
            if cancel_after.contains(&(handle.id(), received)) {
                handle.cancel();
            }
        }
    }
    let mut streams = Vec::new();
    let mut inputs_match = Ok(());
    for (handle, prompt, mut events) in handles {
        events.extend(handle.events().try_iter());
        let (last, tokens) = events.split_last().expect("a final event");
        let tokens: Vec<u32> = tokens
            .iter()
            .map(|e| match e {
                Event::Token(t) => *t,
                other => panic!("{other:?} before the end"),
            })
            .collect();
        let end = match last {
            Event::Finished { reason, .. } => Ok(*reason),
            Event::Error(err) => Err(err.to_string()),
            Event::Token(_) => panic!("a stream ending with a token"),
        };
        if end.is_ok() {
            let mut full = prompt;
            full.extend_from_slice(&tokens);
            for (pos, token) in engine.router().inputs(handle.id()) {
                if pos + 1 >= full.len() || full[pos] != token {
                    inputs_match = Err(format!(
                        "request {}: the device consumed {token} at {pos}; the host emitted {:?}",
                        handle.id(),
                        &full[prompt_len(&full, &tokens)..]
                    ));
                }
            }
        }
        streams.push((tokens, end));
    }
    assert_eq!(engine.router().facts(), initial, "resources not all free");
    let metrics = *engine.metrics();
    let rollbacks = engine.router().rollbacks();
    engine.shutdown(ShutdownMode::Drain).unwrap();
    Run {
        streams,
        metrics,
        inputs_match,
        rollbacks,
    }
}

fn prompt_len(full: &[u32], tokens: &[u32]) -> usize {
    full.len() - tokens.len()
}

/// Eight requests: greedy ones whose stop token is the router's answer at some output index
/// (so they stop mid-batch, while their next step is already computing), greedy ones that run
/// to `max_tokens`, and forced ones.
fn mix(router: &ScriptedRouter, id: u64) -> Option<Request> {
    if id > 8 {
        return None;
    }
    let len = 5 + 3 * id as usize;
    let p = prompt(len, id as u32);
    let request = match id % 4 {
        0 => Request::forced(p, (0..9).map(|i| (id as u32 * 31 + i) % 1000).collect()),
        1 => Request::greedy(p, 12),
        _ => {
            let stop = router.fallback_token(id, len + 2 + id as usize % 5);
            Request::greedy(p, 20).with_stop_tokens(vec![stop])
        }
    };
    Some(request)
}

#[test]
fn depth_two_streams_are_the_depth_one_streams() {
    let reference = run(1, 64, Preemption::Recompute, None, &mix, &[]);
    assert!(reference.streams.iter().all(|(_, end)| end.is_ok()));
    let stops = reference
        .streams
        .iter()
        .filter(|(_, end)| matches!(end, Ok(FinishReason::Stop(_))))
        .count();
    assert_eq!(stops, 4);
    assert_eq!(reference.metrics.fed_launches, 0);
    let pipelined = run(2, 64, Preemption::Recompute, None, &mix, &[]);
    assert_eq!(pipelined.streams, reference.streams);
    assert_eq!(pipelined.inputs_match, Ok(()));
    assert!(
        pipelined.metrics.fed_launches > 10,
        "{:?}",
        pipelined.metrics
    );
    // Only greedy requests that stopped over-ran (those whose stop came while their next step
    // was computing), each once; the forced ones and those reaching max_tokens never did.
    let mut rolled_back = pipelined.rollbacks.clone();
    rolled_back.sort_unstable();
    rolled_back.dedup();
    assert_eq!(rolled_back.len(), pipelined.rollbacks.len());
    assert!(rolled_back.len() >= 2, "{rolled_back:?}");
    assert!(rolled_back.iter().all(|id| [2, 3, 6, 7].contains(id)));
    assert_eq!(pipelined.metrics.rollbacks, rolled_back.len() as u64);
    assert_eq!(
        pipelined.metrics.generated_tokens,
        reference.metrics.generated_tokens
    );
}

/// The negative controls: the same run with the rollback skipped feeds the device tokens the
/// host never emitted (the input log catches it), and with the over-run emitted the streams
/// differ.
#[test]
fn skipping_the_rollback_or_emitting_the_over_run_is_caught() {
    let reference = run(1, 64, Preemption::Recompute, None, &mix, &[]);
    let skipped = run(
        2,
        64,
        Preemption::Recompute,
        Some(PipelineFault::SkipRollback),
        &mix,
        &[],
    );
    assert_eq!(skipped.streams, reference.streams);
    assert!(skipped.inputs_match.is_err());
    assert_eq!(skipped.metrics.rollbacks, 0);
    let emitted = run(
        2,
        64,
        Preemption::Recompute,
        Some(PipelineFault::EmitOverRun),
        &mix,
        &[],
    );
    assert_ne!(emitted.streams, reference.streams);
}

#[test]
fn a_cancel_while_a_step_computes_gives_the_depth_one_stream() {
    // Request 1 is cancelled once it has 4 tokens, request 5 once it has 2.
    let cancels = [(1, 4), (5, 2)];
    let reference = run(1, 64, Preemption::Recompute, None, &mix, &cancels);
    let pipelined = run(2, 64, Preemption::Recompute, None, &mix, &cancels);
    assert_eq!(pipelined.streams, reference.streams);
    assert_eq!(pipelined.streams[0].0.len(), 4);
    assert_eq!(pipelined.streams[0].1, Ok(FinishReason::Cancelled));
    assert_eq!(pipelined.inputs_match, Ok(()));
    assert!(
        pipelined.rollbacks.contains(&1),
        "{:?}",
        pipelined.rollbacks
    );
}

#[test]
fn preemption_by_recompute_and_by_spill_gives_the_depth_one_streams() {
    // 14 blocks of 4 tokens cannot hold four of these requests as they grow.
    for preemption in [
        Preemption::Recompute,
        Preemption::Spill(SpillTarget::Memory),
    ] {
        let reference = run(1, 64, Preemption::Recompute, None, &mix, &[]);
        let pipelined = run(2, 14, preemption.clone(), None, &mix, &[]);
        assert!(pipelined.metrics.preemptions > 0, "{preemption:?}");
        assert!(pipelined.metrics.pipeline_drains > 0, "{preemption:?}");
        assert_eq!(pipelined.streams, reference.streams, "{preemption:?}");
        assert_eq!(pipelined.inputs_match, Ok(()), "{preemption:?}");
    }
}

#[test]
fn a_step_lost_in_flight_fails_only_its_rows() {
    let mut engine = Engine::new(router_at_depth(2, 64, 4), config(Preemption::Recompute)).unwrap();
    let a = engine.submit(Request::greedy(prompt(5, 1), 30)).unwrap();
    let b = engine.submit(Request::greedy(prompt(6, 2), 30)).unwrap();
    step_until_in_flight(&mut engine);
    engine.step();
    assert!(engine.step_in_flight());
    // The next await fails: the step being read and the fed step after it are lost.
    let failure = injected_failure();
    engine.router().inject(FaultAt::Await, failure);
    let c = engine.submit(Request::greedy(prompt(7, 3), 4)).unwrap();
    engine.run_until_idle();
    assert!(a.wait().is_err());
    assert!(b.wait().is_err());
    assert_eq!(c.wait().unwrap().tokens.len(), 4);
    assert_eq!(engine.router().facts().live_slots_used, 0);
    assert_eq!(engine.router().facts().kv_blocks_free, 64);
    engine.shutdown(ShutdownMode::Drain).unwrap();
}

#[test]
fn a_device_lost_while_a_step_is_in_flight_ends_everything_and_stops_the_engine() {
    let (mut engine, handles) = depth_two_with_mix(3);
    step_until_in_flight(&mut engine);
    let lost = DeviceError::DeviceLost("injected".into());
    engine.router().inject(FaultAt::Await, lost.clone());
    engine.run_until_idle();
    assert!(!engine.step_in_flight());
    assert_eq!(engine.device_lost(), Some(&lost));
    for handle in handles {
        assert_eq!(
            handle.wait(),
            Err(scheduler::ServeError::DeviceLost("injected".into()))
        );
    }
    assert!(matches!(
        engine.shutdown(ShutdownMode::Drain),
        Err(scheduler::EngineError::DeviceLost(err)) if err == lost
    ));
}

#[test]
fn a_failed_fed_launch_fails_its_rows_after_their_last_real_token() {
    let reference = run(1, 64, Preemption::Recompute, None, &mix, &[]);
    let (mut engine, handles) = depth_two_with_mix(8);
    while engine.metrics().fed_launches < 3 {
        engine.step();
    }
    let failure = injected_failure();
    engine.router().inject(FaultAt::Launch, failure);
    engine.run_until_idle();
    let mut failed = 0;
    for (handle, (tokens, _)) in handles.into_iter().zip(&reference.streams) {
        let events: Vec<Event> = handle.events().try_iter().collect();
        let got: Vec<u32> = events
            .iter()
            .filter_map(|e| match e {
                Event::Token(t) => Some(*t),
                _ => None,
            })
            .collect();
        // Every stream is a prefix of the reference, and a failed one stopped early.
        assert!(tokens.starts_with(&got), "{got:?} vs {tokens:?}");
        if matches!(events.last(), Some(Event::Error(_))) {
            failed += 1;
        } else {
            assert_eq!(&got, tokens);
        }
    }
    assert!(failed > 0);
    assert_eq!(engine.router().facts().kv_blocks_free, 64);
    engine.shutdown(ShutdownMode::Drain).unwrap();
}

#[test]
fn an_abort_with_a_step_in_flight_settles_it_first() {
    let (mut engine, handles) = depth_two_with_mix(3);
    step_until_in_flight(&mut engine);
    engine.shutdown(ShutdownMode::Abort).unwrap();
    for handle in handles {
        assert!(handle.wait().is_err());
    }
}

/// The engine at depth 2 (64 blocks, recompute on preemption) with the `mix` requests of ids
/// `1..=n` submitted.
fn depth_two_with_mix(n: u64) -> (Engine<ScriptedRouter>, Vec<RequestHandle>) {
    let mut engine = Engine::new(router_at_depth(2, 64, 4), config(Preemption::Recompute)).unwrap();
    let handles = (1..=n)
        .map(|id| engine.submit(mix(engine.router(), id).unwrap()).unwrap())
        .collect();
    (engine, handles)
}

/// Steps until a launched step is not yet read.
fn step_until_in_flight(engine: &mut Engine<ScriptedRouter>) {
    while !engine.step_in_flight() {
        engine.step();
    }
}

/// A forward failure the test injects.
fn injected_failure() -> DeviceError {
    DeviceError::Failed {
        phase: Phase::Forward,
        message: "injected".into(),
    }
}
