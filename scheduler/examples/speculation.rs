//! Speculative decoding on the host router: what it buys and what it costs.
//!
//! `cargo run --release -p scheduler --example speculation` prints two tables:
//!
//! 1. **Perfect drafter, k = 3** (drafts known from a plain run, so every draft is accepted and
//!    a row emits 4 tokens per target step): decode tokens per second with and without
//!    speculation at batch 1 and batch 16, on the embedded `small_512` model (seeded random
//!    weights, 43 M parameters), and what one verification of 4 positions costs against one
//!    decode step.
//! 2. **The MTP head** of the fixtures `nemotron-h-tiny/mtp` and `nemotron-h-alt/mtp` (seeded
//!    random MTP weights, so the drafts are rarely right: acceptance is low, as it would not be
//!    for a trained head): acceptance rate, tokens per target step and the time per step with
//!    and without speculation (the drafting overhead), k = 1..4.
//!
//! 3. **Depth 1 vs 2** with the perfect drafter (`-- depth` prints only this table): tokens per
//!    second of plain decoding and of speculation on a synchronous and on a pipelined router
//!    (with cohorts, and with the host router's default, `SpecOverlap::Auto`: none).
//!
//! Every speculative run's output is checked against the plain run's (tokens and logits
//! digests) before its figures are printed. `SPECULATION_ROUNDS=N` repeats each measurement N
//! times and keeps the fastest (default 3).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use scheduler::backend::device_cpu::{CheckpointBudget, CpuRouter, CpuRouterConfig};
use scheduler::backend::{Model, ModelConfig};
use scheduler::{
    Drafter, Engine, EngineConfig, Metrics, Request, ShutdownMode, SpecOverlap, Speculation,
};

const PROMPT: usize = 16;
const OUTPUT: usize = 64;

struct Run {
    outputs: Vec<(Vec<u32>, Option<u64>)>,
    metrics: Metrics,
    wall: Duration,
}

fn prompts(batch: usize, vocab: usize) -> Vec<Vec<u32>> {
    (0..batch)
        .map(|b| {
            (0..PROMPT)
                .map(|i| ((b * 7919 + i * 104_729 + 13) % vocab) as u32)
                .collect()
        })
        .collect()
}

/// How a run is served: the router's depth, and whether requests ask for logits digests (which
/// make every step read its logits back to the host).
#[derive(Clone, Copy)]
struct Mode {
    depth: usize,
    digests: bool,
}

const CHECKED: Mode = Mode {
    depth: 1,
    digests: true,
};

fn serve(model: &Model, prompts: &[Vec<u32>], speculation: Option<Speculation>, mode: Mode) -> Run {
    let batch = prompts.len();
    // A ring slot per draft of every row: each row speculates at every step.
    let ring = speculation.as_ref().map_or(4, |s| batch * s.k);
    let blocks_per_seq = (PROMPT + OUTPUT + 16).div_ceil(16) + 1;
    let config = CpuRouterConfig {
        block_size: 16,
        num_blocks: batch * blocks_per_seq + 8,
        max_seqs: batch,
        checkpoints: CheckpointBudget::Slots(0),
        snapshot_slots: ring,
        prefix_cache: false,
        marconi: false,
        max_context: Some(blocks_per_seq * 16),
        max_depth: mode.depth,
        ..CpuRouterConfig::new(batch * blocks_per_seq + 8, batch)
    };
    let router = CpuRouter::new(model.clone(), config).expect("router");
    let mut engine = Engine::new(
        router,
        EngineConfig {
            max_running: batch,
            max_step_tokens: batch * PROMPT + batch + 1,
            max_prefill_chunk: PROMPT,
            speculation,
            ..EngineConfig::default()
        },
    )
    .expect("engine");
    let handles: Vec<_> = prompts
        .iter()
        .map(|p| {
            engine
                .submit(Request::greedy(p.clone(), OUTPUT).with_logits_digest(mode.digests))
                .expect("submit")
        })
        .collect();
    // The prefill step first, outside the measurement: the figures are about decoding.
    engine.step();
    let start = Instant::now();
    engine.run_until_idle();
    let wall = start.elapsed();
    let outputs = handles
        .into_iter()
        .map(|h| {
            let c = h.wait().expect("completion");
            (c.tokens, c.logits_digest)
        })
        .collect();
    let metrics = *engine.metrics();
    engine.shutdown(ShutdownMode::Drain).expect("shutdown");
    Run {
        outputs,
        metrics,
        wall,
    }
}

fn rounds() -> usize {
    std::env::var("SPECULATION_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3)
        .max(1)
}

/// The fastest of `rounds()` runs (the outputs are the same every time).
fn best(model: &Model, prompts: &[Vec<u32>], speculation: Option<Speculation>, mode: Mode) -> Run {
    (0..rounds())
        .map(|_| serve(model, prompts, speculation.clone(), mode))
        .min_by_key(|run| run.wall)
        .expect("at least one round")
}

/// Decode tokens per second after the prefill step (each request's first token came with it).
fn decode_rate(run: &Run) -> f64 {
    let tokens: usize = run.outputs.iter().map(|(t, _)| t.len() - 1).sum();
    tokens as f64 / run.wall.as_secs_f64()
}

fn per_step_ms(run: &Run) -> f64 {
    1e3 * run.wall.as_secs_f64() / run.metrics.decode_launches.max(1) as f64
}

fn perfect_drafter() {
    let model = Model::random(ModelConfig::small_512(), 0).expect("model");
    let vocab = model.config().vocab_size;
    let k = 3;
    println!(
        "== perfect drafter, k = {k}: embedded small_512 (seeded random weights), prompt {PROMPT}, {OUTPUT} greedy tokens per request"
    );
    println!(
        "{:>5}  {:>14}  {:>14}  {:>7}  {:>12}  {:>12}  {:>16}",
        "batch",
        "plain tok/s",
        "spec tok/s",
        "speedup",
        "plain steps",
        "verify steps",
        "verify/decode"
    );
    for batch in [1, 16] {
        let prompts = prompts(batch, vocab);
        let plain = best(&model, &prompts, None, CHECKED);
        let known: Vec<Vec<u32>> = prompts
            .iter()
            .zip(&plain.outputs)
            .map(|(p, (out, _))| p.iter().chain(out).copied().collect())
            .collect();
        let spec = Speculation {
            k,
            drafter: Drafter::Known {
                sequences: Arc::new(known),
                wrong: false,
            },
            overlap: SpecOverlap::Auto,
        };
        let fast = best(&model, &prompts, Some(spec), CHECKED);
        assert_eq!(
            fast.outputs, plain.outputs,
            "speculation changed the output"
        );
        assert_eq!(fast.metrics.accepted, fast.metrics.drafted);
        println!(
            "{:>5}  {:>14.1}  {:>14.1}  {:>6.2}x  {:>12}  {:>12}  {:>15.2}x",
            batch,
            decode_rate(&plain),
            decode_rate(&fast),
            decode_rate(&fast) / decode_rate(&plain),
            plain.metrics.decode_launches,
            fast.metrics.verify_launches,
            per_step_ms(&fast) / per_step_ms(&plain),
        );
    }
}

fn mtp_head() {
    println!();
    println!(
        "== the MTP head (seeded random weights: acceptance is low by construction), batch 4, prompt {PROMPT}, {OUTPUT} greedy tokens per request"
    );
    println!(
        "{:<16} {:>2}  {:>10}  {:>9}  {:>16}  {:>13}  {:>13}  {:>9}",
        "fixture",
        "k",
        "acceptance",
        "accepted",
        "tokens per step",
        "plain ms/step",
        "spec ms/step",
        "tok/s x"
    );
    for fixture in ["nemotron-h-tiny", "nemotron-h-alt"] {
        let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../model/tests/fixtures")
            .join(fixture)
            .join("mtp/model");
        let model = Model::load(&dir).expect("fixture");
        let prompts = prompts(4, model.config().vocab_size);
        let plain = best(&model, &prompts, None, CHECKED);
        for k in 1..=4 {
            let fast = best(&model, &prompts, Some(Speculation::mtp(k)), CHECKED);
            assert_eq!(
                fast.outputs, plain.outputs,
                "speculation changed the output"
            );
            let m = &fast.metrics;
            println!(
                "{:<16} {:>2}  {:>9.1}%  {:>9}  {:>16.2}  {:>13.2}  {:>13.2}  {:>8.2}x",
                fixture,
                k,
                100.0 * m.accepted as f64 / m.drafted.max(1) as f64,
                format!("{}/{}", m.accepted, m.drafted),
                m.spec_tokens as f64 / m.spec_rows.max(1) as f64,
                per_step_ms(&plain),
                per_step_ms(&fast),
                decode_rate(&fast) / decode_rate(&plain),
            );
        }
    }
}

/// Depth 1 against depth 2 with the perfect drafter (k = 3): at depth 2 with cohorts the engine
/// splits the rows into two cohorts and launches one's verification before the other's settles;
/// "spec d2 auto" is the default on the host router (`SpecOverlap::Auto`: no cohorts, as it
/// computes on the host's cores) on the same pipelined router. No logits digests here (host
/// logits would make every step a synchronisation point); the tokens of every run are checked
/// against plain decoding at depth 1.
fn depth_two() {
    let model = Model::random(ModelConfig::small_512(), 0).expect("model");
    let vocab = model.config().vocab_size;
    let k = 3;
    println!();
    println!(
        "== depth 1 vs 2, perfect drafter k = {k}: embedded small_512, prompt {PROMPT}, {OUTPUT} greedy tokens per request, no digests"
    );
    println!(
        "{:>5}  {:>16}  {:>16}  {:>15}  {:>15}  {:>9}  {:>18}  {:>14}",
        "batch",
        "plain d1 tok/s",
        "plain d2 tok/s",
        "spec d1 tok/s",
        "spec d2 tok/s",
        "d2/d1",
        "spec d2 auto tok/s",
        "spec d2 flights"
    );
    let tokens_only = |depth| Mode {
        depth,
        digests: false,
    };
    for batch in [2, 16] {
        let prompts = prompts(batch, vocab);
        let plain = best(&model, &prompts, None, tokens_only(1));
        let plain2 = best(&model, &prompts, None, tokens_only(2));
        let known: Vec<Vec<u32>> = prompts
            .iter()
            .zip(&plain.outputs)
            .map(|(p, (out, _))| p.iter().chain(out).copied().collect())
            .collect();
        let auto = Speculation {
            k,
            drafter: Drafter::Known {
                sequences: Arc::new(known),
                wrong: false,
            },
            overlap: SpecOverlap::Auto,
        };
        let cohorts = Speculation {
            overlap: SpecOverlap::Cohorts,
            ..auto.clone()
        };
        let spec1 = best(&model, &prompts, Some(auto.clone()), tokens_only(1));
        let spec2 = best(&model, &prompts, Some(cohorts), tokens_only(2));
        let spec2_auto = best(&model, &prompts, Some(auto), tokens_only(2));
        for run in [&plain2, &spec1, &spec2, &spec2_auto] {
            assert_eq!(run.outputs, plain.outputs, "a run changed the output");
        }
        assert!(spec2.metrics.spec_flights > 0);
        assert_eq!(spec2_auto.metrics.spec_flights, 0);
        println!(
            "{:>5}  {:>16.1}  {:>16.1}  {:>15.1}  {:>15.1}  {:>8.2}x  {:>18.1}  {:>14}",
            batch,
            decode_rate(&plain),
            decode_rate(&plain2),
            decode_rate(&spec1),
            decode_rate(&spec2),
            decode_rate(&spec2) / decode_rate(&spec1),
            decode_rate(&spec2_auto),
            spec2.metrics.spec_flights,
        );
    }
}

fn main() {
    let only = std::env::args().nth(1);
    if only.as_deref() != Some("depth") {
        perfect_drafter();
        mtp_head();
    }
    depth_two();
}
