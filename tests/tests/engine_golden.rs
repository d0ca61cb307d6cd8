//! Golden traces of the engine over the host router: a small scenario that admits, prefills in
//! chunks, decodes, finishes, compacts slots and preempts by spill, recorded through
//! `TracingDeviceIo` step by step and compared with `tests/golden/engine_scenario.trace`; and the
//! same scenario on the pipelined router (depth 2), where one request stops on a stop token while
//! its next step is in flight, in `tests/golden/engine_pipelined.trace`: reservations, fed steps
//! launched before the previous step is awaited, the rollback of the over-run, and the drains.
//! Regenerate both with `cargo xtask codegen`.

use device_cpu::{CheckpointBudget, CpuRouter, CpuRouterConfig};
use device_trace::{TraceSink, TracingDeviceIo};
use model::{Config, Model};
use scheduler::{Engine, EngineConfig, Preemption, Request, ShutdownMode, SpillTarget};

fn prompt(len: u32, salt: u32) -> Vec<u32> {
    (0..len).map(|t| (t * 11 + salt) % 256).collect()
}

/// What a scenario run produced: the trace text and each request's tokens.
struct Scenario {
    text: String,
    tokens: Vec<Vec<u32>>,
    metrics: scheduler::Metrics,
}

/// Runs the scenario at `depth`; `c_stop` is a stop token for request c.
fn scenario(depth: usize, c_stop: Option<u32>) -> Scenario {
    let model = Model::random(Config::tiny_demo(), 5).unwrap();
    let router_config = CpuRouterConfig {
        block_size: 16,
        num_blocks: 7,
        max_seqs: 3,
        checkpoints: CheckpointBudget::Slots(4),
        snapshot_slots: 1,
        prefix_cache: true,
        marconi: true,
        max_context: Some(64),
        max_depth: depth,
        threads: device_cpu::default_threads(),
        expert_workers: 0,
        lora_slots: 0,
    };
    let (sink, trace) = TraceSink::memory();
    let router = TracingDeviceIo::new(CpuRouter::new(model, router_config).unwrap(), sink);
    let config = EngineConfig {
        max_running: 3,
        max_step_tokens: 40,
        max_prefill_chunk: 16,
        preemption: Preemption::Spill(SpillTarget::Memory),
        ..EngineConfig::default()
    };
    let mut engine = Engine::new(router, config).unwrap();
    // a and c grow to four blocks each; b is short, so it finishes first and c moves down.
    let a = engine.submit(Request::greedy(prompt(40, 1), 20)).unwrap();
    let b = engine.submit(Request::greedy(prompt(20, 2), 3)).unwrap();
    let c_request =
        Request::greedy(prompt(30, 3), 20).with_stop_tokens(c_stop.into_iter().collect());
    let c = engine.submit(c_request).unwrap();

    let mut text = String::new();
    let mut step = 0;
    while !engine.is_idle() {
        step += 1;
        let report = engine.step();
        text.push_str(&format!(
            "# step {step}: admitted={} prefill_rows={} prefill_tokens={} decode_rows={} preempted={} ended={}\n",
            report.admitted,
            report.prefill_rows,
            report.prefill_tokens,
            report.decode_rows,
            report.preempted,
            report.ended
        ));
        for line in trace.take() {
            text.push_str(&line);
            text.push('\n');
        }
    }
    let metrics = *engine.metrics();
    engine.shutdown(ShutdownMode::Drain).unwrap();
    text.push_str("# shutdown\n");
    for line in trace.take() {
        text.push_str(&line);
        text.push('\n');
    }
    let mut tokens = Vec::new();
    for (name, handle) in [("a", a), ("b", b), ("c", c)] {
        let done = handle.wait().unwrap();
        text.push_str(&format!(
            "# {name}: {:?} tokens={:?} cached={} preemptions={}\n",
            done.reason, done.tokens, done.usage.cached_tokens, done.usage.preemptions
        ));
        tokens.push(done.tokens);
    }
    Scenario {
        text,
        tokens,
        metrics,
    }
}

#[test]
fn engine_scenario_matches_its_golden_trace() {
    let Scenario { text, metrics, .. } = scenario(1, None);
    // The scenario is only worth its file if it shows every part it claims to.
    assert!(
        metrics.spills >= 1 && metrics.restores == metrics.spills,
        "{metrics:?}"
    );
    assert!(metrics.compactions >= 1, "{metrics:?}");
    assert_eq!(metrics.finished, 3);
    for needle in [
        "Prefill{n=",
        "Decode{n=",
        "ReleaseSeq{cache=true, finish}",
        "CompactSlot{target=",
        "SaveSequenceState",
        "RestoreSequenceState",
        "EpShutdown",
        "fx teardown",
    ] {
        assert!(text.contains(needle), "the scenario never shows {needle}");
    }
    tests::golden::check("engine_scenario", &text);
}

#[test]
fn pipelined_scenario_matches_its_golden_trace() {
    // c stops on the token it produces 12th at depth 1: mid-batch, with its next step computing.
    let synchronous = scenario(1, None);
    let stop = synchronous.tokens[2][11];
    let Scenario {
        text,
        tokens,
        metrics,
    } = scenario(2, Some(stop));
    assert_eq!(tokens[..2], synchronous.tokens[..2]);
    let stopped_at = synchronous.tokens[2]
        .iter()
        .position(|&t| t == stop)
        .unwrap();
    assert_eq!(tokens[2], synchronous.tokens[2][..=stopped_at]);
    assert!(
        metrics.fed_launches > 0 && metrics.rollbacks == 1,
        "{metrics:?}"
    );
    for needle in [
        "ReserveKv",
        "DecodeFed{n=",
        "fed=",
        "Rollback",
        "fx teardown",
    ] {
        assert!(text.contains(needle), "the scenario never shows {needle}");
    }
    tests::golden::check("engine_pipelined", &text);
}
