//! Pipelining depth 1 vs depth 2 with a simulated device: the real engine over the scripted
//! router, which computes nothing but takes `DEVICE` per step on a simulated device timeline
//! (`ScriptedRouter::with_step_time`: a step runs from its launch, after the step before it, and
//! `await_result` sleeps until it is done), while the host spends a set time per step on work
//! outside the engine, standing in for detokenizing and streaming the step's tokens. One
//! iteration is one engine step plus that host work, over 16 greedy requests decoding in steady
//! state (they never finish during the run).
//!
//! At depth 1 a step costs the device time plus the host time; at depth 2 the device computes
//! step t+1 while the host works on step t, so a step costs about the larger of the two. With
//! host time equal to device time the ideal ratio is 2x; the target is at least 1.6x. The host
//! work comes in two forms: `spin` keeps the host thread busy (the realistic form, but on a
//! loaded machine the spinning thread also waits for a core, which inflates both depths), and
//! `wait` sleeps (the same latency without competing for a core, so the figure shows the
//! overlap itself). A pair with the host at a quarter of the device time shows the gain when the
//! host is the smaller part.
//!
//! `cargo bench -p scheduler --bench pipeline` (steps per second = 1 / time per iteration).

use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use device_io::testing::{ScriptedConfig, ScriptedRouter};
use scheduler::{Engine, EngineConfig, Event, Request, RequestHandle};

const DEVICE: Duration = Duration::from_micros(1000);
const ROWS: usize = 16;

/// An engine over a simulated device at `depth`, with `ROWS` requests decoding.
fn engine(depth: usize) -> (Engine<ScriptedRouter>, Vec<RequestHandle>) {
    let router = ScriptedRouter::new(ScriptedConfig {
        block_size: 16,
        num_blocks: 1 << 22,
        num_slots: ROWS,
        vocab_size: 32_000,
        max_depth: depth,
    })
    .with_step_time(DEVICE);
    let config = EngineConfig {
        max_running: ROWS,
        max_step_tokens: 4096,
        max_prefill_chunk: 256,
        ..EngineConfig::default()
    };
    let mut engine = Engine::new(router, config).unwrap();
    let handles: Vec<RequestHandle> = (0..ROWS as u32)
        .map(|i| {
            let prompt: Vec<u32> = (0..64).map(|t| (t * 7 + i) % 32_000).collect();
            engine.submit(Request::greedy(prompt, 1 << 24)).unwrap()
        })
        .collect();
    // Prefill, then a few decode steps: from here on every step is a plain decode step.
    for _ in 0..8 {
        engine.step();
    }
    assert_eq!(engine.running_len(), ROWS);
    (engine, handles)
}

/// How the host spends its per-step time.
#[derive(Debug, Clone, Copy)]
enum Host {
    /// Busy on a core.
    Spin(Duration),
    /// Waiting (off the cores).
    Wait(Duration),
}

/// The host's own per-step work: drains every stream (the tokens of the step just read), then
/// spins or waits until the set time has passed since the step returned.
fn host_work(handles: &[RequestHandle], host: Host) {
    let started = Instant::now();
    let mut tokens = 0usize;
    for handle in handles {
        tokens += handle
            .events()
            .try_iter()
            .filter(|event| matches!(event, Event::Token(_)))
            .count();
    }
    std::hint::black_box(tokens);
    match host {
        Host::Spin(time) => {
            while started.elapsed() < time {
                std::hint::spin_loop();
            }
        }
        Host::Wait(time) => std::thread::sleep(time.saturating_sub(started.elapsed())),
    }
}

fn bench(c: &mut Criterion) {
    let mut group = c.benchmark_group("pipeline_step");
    group.sample_size(30);
    group.measurement_time(Duration::from_secs(4));
    let cases = [
        ("spin, host=device", Host::Spin(DEVICE)),
        ("wait, host=device", Host::Wait(DEVICE)),
        ("spin, host=device/4", Host::Spin(DEVICE / 4)),
    ];
    for (label, host) in cases {
        for depth in [1, 2] {
            let (mut engine, handles) = engine(depth);
            group.bench_with_input(
                BenchmarkId::new(format!("depth{depth}"), label),
                &host,
                |b, &host| {
                    b.iter(|| {
                        engine.step();
                        host_work(&handles, host);
                    })
                },
            );
            if depth == 2 {
                assert!(engine.metrics().fed_launches > 0, "{:?}", engine.metrics());
            }
        }
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
