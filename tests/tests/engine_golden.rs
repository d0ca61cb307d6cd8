//! A golden trace of the engine over the host router: a small scenario that admits, prefills in
//! chunks, decodes, finishes, compacts slots and preempts by spill, recorded through
//! `TracingDeviceIo` step by step and compared with `tests/golden/engine_scenario.trace`
//! (regenerate with `cargo xtask codegen`).

use device_cpu::{CheckpointBudget, CpuRouter, CpuRouterConfig};
use device_trace::{TraceSink, TracingDeviceIo};
use model::{Config, Model};
use scheduler::{Engine, EngineConfig, Preemption, Request, ShutdownMode, SpillTarget};

fn prompt(len: u32, salt: u32) -> Vec<u32> {
    (0..len).map(|t| (t * 11 + salt) % 256).collect()
}

#[test]
fn engine_scenario_matches_its_golden_trace() {
    let model = Model::random(Config::tiny_demo(), 5).unwrap();
    let router_config = CpuRouterConfig {
        block_size: 16,
        num_blocks: 7,
        max_seqs: 3,
        checkpoints: CheckpointBudget::Slots(4),
        snapshot_slots: 1,
        prefix_cache: true,
        marconi: true,
        max_context: 64,
        max_depth: 1,
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
    let c = engine.submit(Request::greedy(prompt(30, 3), 20)).unwrap();

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
    for (name, handle) in [("a", a), ("b", b), ("c", c)] {
        let done = handle.wait().unwrap();
        text.push_str(&format!(
            "# {name}: {:?} tokens={:?} cached={} preemptions={}\n",
            done.reason, done.tokens, done.usage.cached_tokens, done.usage.preemptions
        ));
    }
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
