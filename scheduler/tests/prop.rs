//! Property test of the engine over the scripted router, at depth 1 and at depth 2: random
//! submissions (some with a stop token), cancellations, steps and injected faults on a small
//! pool. Whatever the interleaving, every request's stream is tokens then exactly one final
//! event; a request that finished by length or by its stop token produced exactly the router's
//! tokens up to that point (preemption, spill, compaction and pipelining never change them); a
//! cancelled one produced a prefix of them; only injected faults fail requests (an injected dry
//! pool only when the request was alone); and the pool and slots end free.
//!
//! At depth 2 the router's input log shows that the device fed each request exactly the tokens
//! it emitted, in place, and never its last one (an over-run is rolled back, so its input is
//! gone from the log), and the router's rollbacks name only requests that ended by a stop token,
//! a cancel or a failure, never one that reached its length (which the engine sees coming).

use device_io::testing::{FaultAt, ScriptedConfig, ScriptedRouter};
use device_io::{DeviceError, DeviceFacts, DeviceIo, Phase};
use proptest::prelude::*;
use scheduler::{
    Engine, EngineConfig, Event, FinishReason, Preemption, Request, RequestHandle, SpillTarget,
};

#[derive(Debug, Clone)]
enum Op {
    /// With `stop_at`, the request's stop token is the router's answer at that output index.
    Submit {
        prompt: usize,
        max_tokens: usize,
        stop_at: Option<usize>,
    },
    Cancel(usize),
    Step,
    FailNextLaunch,
    FailNextEffect(&'static str),
    ExhaustNextLaunch,
    ExhaustNextRestore,
    /// The next `await_result` fails (its step, and a fed step after it, are lost).
    FailNextAwait,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (1usize..20, 1usize..16, proptest::option::of(0usize..12))
            .prop_map(|(prompt, max_tokens, stop_at)| Op::Submit { prompt, max_tokens, stop_at }),
        1 => (0usize..16).prop_map(Op::Cancel),
        6 => Just(Op::Step),
        1 => Just(Op::FailNextLaunch),
        1 => prop_oneof![
            Just("ReleaseSeq"),
            Just("CompactSlot"),
            Just("SaveSequenceState"),
            Just("RestoreSequenceState"),
            Just("ReserveKv"),
            Just("MarconiCheckpoint"),
        ]
        .prop_map(Op::FailNextEffect),
        1 => Just(Op::ExhaustNextLaunch),
        1 => Just(Op::ExhaustNextRestore),
        1 => Just(Op::FailNextAwait),
    ]
}

struct Tracked {
    handle: RequestHandle,
    prompt: Vec<u32>,
    max_tokens: usize,
    stop: Option<u32>,
}

fn injected() -> DeviceError {
    DeviceError::Failed {
        phase: Phase::Forward,
        message: "injected".into(),
    }
}

fn exhausted() -> DeviceError {
    DeviceError::KvExhausted { needed: 1, free: 0 }
}

fn run(ops: &[Op], spill: bool, max_step_tokens: usize, depth: usize) -> Result<(), TestCaseError> {
    let router = ScriptedRouter::new(ScriptedConfig {
        block_size: 4,
        num_blocks: 12,
        num_slots: 3,
        vocab_size: 500,
        max_depth: depth,
    });
    let initial = DeviceFacts {
        live_slots_used: 0,
        ..router.facts()
    };
    let config = EngineConfig {
        max_running: 3,
        max_step_tokens,
        max_prefill_chunk: 6,
        preemption: if spill {
            Preemption::Spill(SpillTarget::Memory)
        } else {
            Preemption::Recompute
        },
        protect_steps: 2,
        ..EngineConfig::default()
    };
    let mut engine = Engine::new(router, config).unwrap();
    let mut requests: Vec<Tracked> = Vec::new();
    let mut faults = 0;
    for op in ops {
        match op {
            Op::Submit {
                prompt,
                max_tokens,
                stop_at,
            } => {
                let tokens: Vec<u32> = (0..*prompt as u32).map(|t| (t * 3 + 1) % 500).collect();
                // Ids are handed out in submission order from 1.
                let id = requests.len() as u64 + 1;
                let stop = stop_at.map(|at| engine.router().fallback_token(id, prompt + at));
                let mut request = Request::greedy(tokens.clone(), *max_tokens);
                if let Some(stop) = stop {
                    request = request.with_stop_tokens(vec![stop]);
                }
                let handle = engine.submit(request).unwrap();
                prop_assert_eq!(handle.id(), id);
                requests.push(Tracked {
                    handle,
                    prompt: tokens,
                    max_tokens: *max_tokens,
                    stop,
                });
            }
            Op::Cancel(index) => {
                if let Some(request) = requests.get(*index) {
                    request.handle.cancel();
                }
            }
            Op::Step => {
                engine.step();
            }
            Op::FailNextLaunch => {
                faults += 1;
                engine.router().inject(FaultAt::Launch, injected());
            }
            Op::FailNextEffect(name) => {
                faults += 1;
                engine.router().inject(FaultAt::Effect(name), injected());
            }
            Op::ExhaustNextLaunch => {
                faults += 1;
                engine.router().inject(FaultAt::Launch, exhausted());
            }
            Op::ExhaustNextRestore => {
                faults += 1;
                engine
                    .router()
                    .inject(FaultAt::Effect("RestoreSequenceState"), exhausted());
            }
            Op::FailNextAwait => {
                faults += 1;
                engine.router().inject(FaultAt::Await, injected());
            }
        }
    }
    engine.run_until_idle();
    // Orphans (sequences whose release the router refused twice) are released again at each
    // step; every injected fault strikes once, so at most `faults` more steps free them all.
    for _ in 0..=faults {
        if engine.orphans_len() == 0 {
            break;
        }
        engine.step();
    }
    prop_assert_eq!(engine.orphans_len(), 0);
    let mut failures = 0;
    let rollbacks = engine.router().rollbacks();
    for request in &requests {
        let id = request.handle.id();
        let prompt = request.prompt.len();
        // The router's tokens, up to and including the first stop token.
        let mut expected: Vec<u32> = Vec::new();
        for i in 0..request.max_tokens {
            let token = engine.router().fallback_token(id, prompt + i);
            expected.push(token);
            if Some(token) == request.stop {
                break;
            }
        }
        let events: Vec<Event> = request.handle.events().try_iter().collect();
        let (last, tokens) = events.split_last().expect("a stream without a final event");
        let tokens: Vec<u32> = tokens
            .iter()
            .map(|event| match event {
                Event::Token(token) => Ok(*token),
                other => Err(TestCaseError::fail(format!("{other:?} before the end"))),
            })
            .collect::<Result<_, _>>()?;
        prop_assert!(expected.starts_with(&tokens), "{tokens:?} vs {expected:?}");
        let rolled_back = rollbacks.iter().filter(|&&r| r == id).count();
        match last {
            Event::Finished {
                reason: reason @ (FinishReason::Length | FinishReason::Stop(_)),
                usage,
                ..
            } => {
                prop_assert_eq!(&tokens, &expected);
                prop_assert_eq!(usage.generated_tokens, expected.len());
                if *reason == FinishReason::Length {
                    prop_assert_eq!(rolled_back, 0, "request {} reached its length", id);
                } else {
                    prop_assert_eq!(Some(*expected.last().unwrap()), request.stop);
                }
            }
            Event::Finished {
                reason: FinishReason::Cancelled,
                ..
            } => {}
            Event::Error(_) => failures += 1,
            Event::Token(_) => return Err(TestCaseError::fail("the stream ends with a token")),
        }
        prop_assert!(
            rolled_back <= 1,
            "request {} rolled back {} times",
            id,
            rolled_back
        );
        if matches!(last, Event::Finished { .. }) {
            // Every input the device consumed at a decode position is the emitted token there,
            // and the last emitted token was never fed (an over-run's input was rolled back).
            let mut full = request.prompt.clone();
            full.extend_from_slice(&tokens);
            let inputs = engine.router().inputs(id);
            for &(pos, token) in &inputs {
                prop_assert!(
                    pos + 1 < full.len() && full[pos] == token,
                    "request {}: input {} at {} of {:?}",
                    id,
                    token,
                    pos,
                    full
                );
            }
        }
    }
    // A fault fails at most the rows of one plan (at most 3 live sequences) or one request.
    prop_assert!(
        failures <= 3 * faults,
        "{failures} failures from {faults} faults"
    );
    prop_assert_eq!(engine.router().facts(), initial);
    let metrics = *engine.metrics();
    prop_assert_eq!(
        metrics.finished + metrics.cancelled + metrics.failed,
        requests.len() as u64
    );

    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn any_interleaving_keeps_streams_and_accounting_exact(
        ops in proptest::collection::vec(op(), 1..60),
        spill in any::<bool>(),
        max_step_tokens in 4usize..24,
        depth in 1usize..=2,
    ) {
        run(&ops, spill, max_step_tokens, depth)?;
    }
}
