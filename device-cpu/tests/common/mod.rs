//! Helpers shared by the router's integration tests: models, routers, and the core's moves
//! (prefill to completion, decode, release) written once, through `DeviceIo` only.
#![allow(dead_code, unused_imports)] // Each test file uses a different subset of the helpers.

use std::path::PathBuf;

use device_cpu::{CpuRouter, CpuRouterConfig, CpuSeq};
use device_io::{DeviceIo, Effect, PrefillReport, Readback, Sequence, StepPlan};
use model::{Config, Model};

pub fn fixture_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../model/tests/fixtures/nemotron-h-tiny")
}

/// The shared fixture's hybrid model (Mamba2, attention, MLP, MoE).
pub fn hybrid_model() -> Model {
    Model::load(&fixture_dir().join("model")).unwrap()
}

/// A random attention + MLP model (no Mamba layer), the fixture's widths.
pub fn attention_model() -> Model {
    Model::random(Config::tiny_attention_only(), 7).unwrap()
}

/// A router with block size `block_size`, 64 blocks, 4 live slots, 16 checkpoint slots.
pub fn router(model: Model, block_size: usize, prefix_cache: bool) -> CpuRouter {
    let mut config = CpuRouterConfig::new(64, 4);
    config.block_size = block_size;
    config.max_context = Some(256);
    config.checkpoints = device_cpu::CheckpointBudget::Slots(16);
    config.prefix_cache = prefix_cache;
    CpuRouter::new(model, config).unwrap()
}

/// Deterministic token ids in `0..256` (a fixed pattern, not a random draw).
pub fn tokens(seed: u32, n: usize) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (i.wrapping_mul(97).wrapping_add(seed.wrapping_mul(31)) ^ (i >> 2)) % 256)
        .collect()
}

pub use device_io::testing::{assert_back_to_initial, assert_nothing_held, release, seq};

/// Prefills to completion in chunks of `chunk`; returns the last prompt position's logits and the
/// summed report (cached, computed).
pub fn prefill<D: DeviceIo<Seq = CpuSeq> + ?Sized>(
    router: &D,
    seq: &mut CpuSeq,
    chunk: usize,
) -> (Vec<f32>, PrefillReport) {
    let mut host = Vec::new();
    let mut total = PrefillReport::default();
    let mut last = Vec::new();
    while !seq.prefill_done() {
        let ticket = router
            .launch(
                StepPlan::Prefill {
                    budgets: &[chunk],
                    readback: Readback::HostLogits { into: &mut host },
                },
                &mut [seq],
            )
            .unwrap();
        let result = router.await_result(ticket).unwrap();
        let report = result.rows[0].prefill.unwrap();
        total.cached += report.cached;
        total.computed += report.computed;
        total.done = report.done;
        if report.done {
            last = host.clone();
        }
    }
    (last, total)
}

/// One decode step over `seqs`; returns the host logits (rows in order). Takes the Marconi
/// checkpoints the router asks for, as the core does.
pub fn decode<D: DeviceIo<Seq = CpuSeq> + ?Sized>(
    router: &D,
    seqs: &mut [&mut CpuSeq],
    tokens: &[u32],
) -> Vec<f32> {
    let mut host = Vec::new();
    let ticket = router
        .launch(
            StepPlan::Decode {
                tokens,
                readback: Readback::HostLogits { into: &mut host },
            },
            seqs,
        )
        .unwrap();
    router.await_result(ticket).unwrap();
    for seq in seqs.iter_mut() {
        if seq.checkpoint_due() {
            router.apply(Effect::MarconiCheckpoint { seq }).unwrap();
        }
    }
    host
}

pub use model::parity::argmax;

/// Greedy generation of `steps` tokens after a completed prefill whose last logits are `logits`;
/// returns every step's logits (the prefill's first).
pub fn generate(
    router: &CpuRouter,
    seq: &mut CpuSeq,
    logits: Vec<f32>,
    steps: usize,
) -> Vec<Vec<f32>> {
    let mut rows = vec![logits];
    for _ in 0..steps {
        let token = argmax(rows.last().unwrap());
        rows.push(decode(router, &mut [seq], &[token]));
    }
    rows
}

/// Bits of a list of logit rows, for exact comparisons.
pub fn bits(rows: &[Vec<f32>]) -> Vec<u32> {
    rows.iter().flatten().map(|x| x.to_bits()).collect()
}
