//! LoRA end to end on the host router: requests with three adapters and none decode in mixed
//! batches at depth 2 while LoRA commands arrive with steps in flight. Every command runs at
//! quiescence (the `TracingDeviceIo` trace shows no `lora` call between a launch and its await),
//! each command drains the step in flight, and every request's tokens and logits digest equal
//! those of a depth-1 run with no commands at all, and of the request served alone.

use std::path::PathBuf;

use device_cpu::{CheckpointBudget, CpuRouter, CpuRouterConfig};
use device_trace::{TraceSink, TracingDeviceIo};
use model::{Config, LoraAdapter, LoraSpec, Model};
use scheduler::{
    Completion, Engine, EngineConfig, FinishReason, LoraAck, LoraCommand, Request, ShutdownMode,
};

/// What must not change: tokens, finish reason, logits digest, cached prompt tokens.
type Outcome = (Vec<u32>, FinishReason, Option<u64>, usize);

fn outcome(completion: &Completion) -> Outcome {
    (
        completion.tokens.clone(),
        completion.reason,
        completion.logits_digest,
        completion.usage.cached_tokens,
    )
}

fn model() -> Model {
    Model::random(Config::tiny_demo(), 31).unwrap()
}

/// Three random adapters for `model`, saved in PEFT's format under `dir`.
fn adapters(model: &Model, dir: &std::path::Path) -> Vec<PathBuf> {
    (0..3)
        .map(|i| {
            let mut spec = LoraSpec::all_linear(2 + 2 * i);
            spec.b_range = 0.3;
            let adapter = LoraAdapter::random(model, &spec, 100 + i as u64).unwrap();
            let path = dir.join(format!("adapter-{i}"));
            adapter.save(&path, model.config()).unwrap();
            path
        })
        .collect()
}

fn router(model: &Model, depth: usize, sink: TraceSink) -> TracingDeviceIo<CpuRouter> {
    let config = CpuRouterConfig {
        block_size: 4,
        num_blocks: 160,
        max_seqs: 8,
        checkpoints: CheckpointBudget::Slots(16),
        snapshot_slots: 1,
        prefix_cache: true,
        marconi: true,
        max_context: Some(128),
        max_depth: depth,
        threads: device_cpu::default_threads(),
        expert_workers: 0,
        lora_slots: 4,
    };
    TracingDeviceIo::new(CpuRouter::new(model.clone(), config).unwrap(), sink)
}

fn prompt(i: usize) -> Vec<u32> {
    (0..(7 + 3 * i) as u32)
        .map(|t| (t * 41 + i as u32 * 17 + 3) % 256)
        .collect()
}

/// Request `i` of the run: adapters 1, 2, 3 and none in turn, over two prompts (each served
/// with all four).
fn request(i: usize) -> Request {
    let request = Request::greedy(prompt(i / 4), 24).with_logits_digest(true);
    match i % 4 {
        3 => request,
        k => request.with_adapter(k as u32 + 1),
    }
}

fn load(adapter: u32, path: &std::path::Path) -> LoraCommand {
    LoraCommand::Load {
        adapter,
        path: path.to_owned(),
    }
}

/// A trace's `lora` calls, checking that none came while a launched ticket was not awaited.
fn quiescent_lora_calls(lines: &[String]) -> usize {
    let mut unsettled: Vec<&str> = Vec::new();
    let mut after_launch = false;
    let mut calls = 0;
    for line in lines {
        if line.starts_with("fx launch") {
            after_launch = true;
            continue;
        }
        if after_launch {
            after_launch = false;
            if let Some(ticket) = line.strip_prefix("-> ticket ") {
                unsettled.push(ticket);
            }
        } else if let Some(ticket) = line.strip_prefix("fx await ticket ") {
            unsettled.retain(|t| *t != ticket);
        } else if line.starts_with("fx lora") {
            assert!(
                unsettled.is_empty(),
                "`{line}` with {unsettled:?} in flight"
            );
            calls += 1;
        }
    }
    calls
}

/// Serves `requests` (indices) together; answers each one's completion, the trace, and the
/// number of commands the engine drained a step in flight for. With `interrupt`, LoRA commands
/// arrive whenever a step is in flight: list, load a fourth adapter, unload it.
fn serve(
    depth: usize,
    paths: &[PathBuf],
    requests: &[usize],
    interrupt: bool,
) -> (Vec<Outcome>, Vec<String>, u64) {
    let model = model();
    let (sink, buffer) = TraceSink::memory();
    let config = EngineConfig {
        max_running: 8,
        max_step_tokens: 64,
        max_prefill_chunk: 16,
        ..EngineConfig::default()
    };
    let mut engine = Engine::new(router(&model, depth, sink), config).unwrap();
    for (i, path) in paths.iter().enumerate() {
        assert!(matches!(
            engine.lora(load(i as u32 + 1, path)),
            Ok(LoraAck::Loaded(_))
        ));
    }
    let handles: Vec<_> = requests
        .iter()
        .map(|&i| engine.submit(request(i)).unwrap())
        .collect();
    let mut commands = vec![
        LoraCommand::Unload { adapter: 9 },
        load(9, &paths[0]),
        LoraCommand::List,
    ];
    while !engine.is_idle() {
        engine.step();
        if interrupt && engine.step_in_flight() {
            if let Some(cmd) = commands.pop() {
                engine.lora(cmd).unwrap();
            }
        }
    }
    if interrupt {
        assert!(commands.is_empty(), "every command found a step in flight");
    }
    let drains = engine.metrics().lora_drains;
    let completions = handles
        .into_iter()
        .map(|h| outcome(&h.wait().unwrap()))
        .collect();
    engine.shutdown(ShutdownMode::Drain).unwrap();
    (completions, buffer.lines(), drains)
}

#[test]
fn commands_run_at_quiescence_and_change_no_output() {
    let dir = std::env::temp_dir().join(format!("engine-lora-{}", std::process::id()));
    let paths = adapters(&model(), &dir);
    let all: Vec<usize> = (0..8).collect();

    // Depth 2, mixed batches of all four kinds of row, commands while steps are in flight.
    let (interrupted, trace, drains) = serve(2, &paths, &all, true);
    assert_eq!(drains, 3);
    // Three loads at the start, then the three commands.
    assert_eq!(quiescent_lora_calls(&trace), 6);
    assert!(trace.iter().any(|l| l.starts_with("fx launch DecodeFed")));

    // Depth 1 without commands gives the same tokens and logits.
    let (plain, trace, drains) = serve(1, &paths, &all, false);
    assert_eq!(drains, 0);
    assert_eq!(quiescent_lora_calls(&trace), 3);
    assert_eq!(interrupted, plain);

    // Each request alone gives the same tokens and logits (one of each kind).
    for i in [0, 1, 2, 3] {
        let (alone, _, _) = serve(1, &paths, &[i], false);
        assert_eq!(alone[0].0, plain[i].0, "request {i}");
        assert_eq!(alone[0].2, plain[i].2, "request {i}");
    }
    // The control: one prompt under the three adapters and none gives four different outputs.
    let digests: std::collections::BTreeSet<_> = plain[..4].iter().map(|o| o.2).collect();
    assert_eq!(digests.len(), 4);
    let _ = std::fs::remove_dir_all(&dir);
}
