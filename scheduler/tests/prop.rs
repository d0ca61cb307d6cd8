//! Property test of the engine over the scripted router: random submissions, cancellations,
//! steps and injected faults on a small pool. Whatever the interleaving, every request's stream is
//! tokens then exactly one final event; a request that finished by length produced exactly the
//! router's tokens (preemption, spill and compaction never change them); a cancelled one produced
//! a prefix of them; only injected faults fail requests (an injected dry pool only when the
//! request was alone); and the pool and slots end free.

use device_io::testing::{FaultAt, ScriptedConfig, ScriptedRouter};
use device_io::{DeviceError, DeviceFacts, DeviceIo, Phase};
use proptest::prelude::*;
use scheduler::{
    Engine, EngineConfig, Event, FinishReason, Preemption, Request, RequestHandle, SpillTarget,
};

#[derive(Debug, Clone)]
enum Op {
    Submit { prompt: usize, max_tokens: usize },
    Cancel(usize),
    Step,
    FailNextLaunch,
    FailNextEffect(&'static str),
    ExhaustNextLaunch,
    ExhaustNextRestore,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (1usize..20, 1usize..16).prop_map(|(prompt, max_tokens)| Op::Submit { prompt, max_tokens }),
        1 => (0usize..16).prop_map(Op::Cancel),
        6 => Just(Op::Step),
        1 => Just(Op::FailNextLaunch),
        1 => prop_oneof![
            Just("ReleaseSeq"),
            Just("CompactSlot"),
            Just("SaveSequenceState"),
            Just("RestoreSequenceState"),
        ]
        .prop_map(Op::FailNextEffect),
        1 => Just(Op::ExhaustNextLaunch),
        1 => Just(Op::ExhaustNextRestore),
    ]
}

struct Tracked {
    handle: RequestHandle,
    prompt: usize,
    max_tokens: usize,
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

fn run(ops: &[Op], spill: bool, max_step_tokens: usize) -> Result<(), TestCaseError> {
    let router = ScriptedRouter::new(ScriptedConfig {
        block_size: 4,
        num_blocks: 12,
        num_slots: 3,
        vocab_size: 500,
        max_depth: 1,
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
            Op::Submit { prompt, max_tokens } => {
                let tokens: Vec<u32> = (0..*prompt as u32).map(|t| (t * 3 + 1) % 500).collect();
                let handle = engine.submit(Request::greedy(tokens, *max_tokens)).unwrap();
                requests.push(Tracked {
                    handle,
                    prompt: *prompt,
                    max_tokens: *max_tokens,
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
    for request in &requests {
        let id = request.handle.id();
        let expected: Vec<u32> = (0..request.max_tokens)
            .map(|i| engine.router().fallback_token(id, request.prompt + i))
            .collect();
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
        match last {
            Event::Finished {
                reason: FinishReason::Length,
                usage,
                ..
            } => {
                prop_assert_eq!(&tokens, &expected);
                prop_assert_eq!(usage.generated_tokens, request.max_tokens);
            }
            Event::Finished {
                reason: FinishReason::Cancelled,
                ..
            } => {}
            Event::Finished { reason, .. } => {
                return Err(TestCaseError::fail(format!("unexpected {reason:?}")))
            }
            Event::Error(_) => failures += 1,
            Event::Token(_) => return Err(TestCaseError::fail("the stream ends with a token")),
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
    ) {
        run(&ops, spill, max_step_tokens)?;
    }
}
