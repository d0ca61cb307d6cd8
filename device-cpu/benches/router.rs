//! Criterion benchmarks of the host router: one decode step through `DeviceIo` against the bare
//! `Model::decode` it wraps (the router's per-step overhead), and a prefill served from the prefix
//! cache against the same prefill computed. `cargo bench -p device-cpu --bench router`.

use std::path::PathBuf;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use device_cpu::{CpuRouter, CpuRouterConfig, CpuSeq};
use device_io::testing::{release, seq};
use device_io::{DeviceIo, Readback, Sequence, StepPlan};
use model::{DecodeRow, KvPool, MambaStates, Model, Scratch};

fn fixture_model() -> Model {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../model/tests/fixtures/nemotron-h-tiny/model");
    Model::load(&dir).expect("the fixture model")
}

fn prompt(seed: u32, n: usize, vocab: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (i.wrapping_mul(2654435761).wrapping_add(seed) >> 7) % vocab)
        .collect()
}

fn run(router: &CpuRouter, plan: StepPlan<'_>, rows: &mut [&mut CpuSeq]) {
    let ticket = router.launch(plan, rows).unwrap();
    router.await_result(ticket).unwrap();
}

/// One prefill chunk of `budget` tokens of `seq`.
fn prefill_chunk(router: &CpuRouter, seq: &mut CpuSeq, budget: usize) {
    let plan = StepPlan::Prefill {
        budgets: &[budget],
        readback: Readback::Argmax,
    };
    run(router, plan, &mut [seq]);
}

/// Decode positions cycle through this many steps after a 32-token prompt.
const CYCLE: usize = 256;

/// Decode steps at batch `batch` after a 32-token prompt each, through the router and bare.
fn decode(c: &mut Criterion, name: &str, model: Model) {
    let vocab = model.config().vocab_size as u32;
    let mut group = c.benchmark_group(format!("decode/{name}"));
    for batch in [1usize, 8, 32] {
        group.throughput(Throughput::Elements(batch as u64));
        let mut config = CpuRouterConfig::new(batch * 64, batch);
        config.max_context = Some(1024);
        config.prefix_cache = false;
        let router = CpuRouter::new(model.clone(), config).unwrap();
        let prompts: Vec<Vec<u32>> = (0..batch).map(|i| prompt(i as u32, 32, vocab)).collect();
        let mut seqs: Vec<CpuSeq> = prompts
            .iter()
            .enumerate()
            .map(|(i, p)| seq(i as u64, p))
            .collect();
        for s in seqs.iter_mut() {
            prefill_chunk(&router, s, 32);
        }
        let tokens: Vec<u32> = (0..batch as u32).collect();
        group.bench_function(BenchmarkId::new("router", batch), |b| {
            b.iter(|| {
                let mut rows: Vec<&mut CpuSeq> = seqs.iter_mut().collect();
                if rows[0].computed_len() >= 32 + CYCLE {
                    // Start over so positions stay in 32..32+CYCLE like the bare run's (a release
                    // and a 32-token prefill every CYCLE steps).
                    for s in rows.iter_mut() {
                        release(&router, s, false);
                        prefill_chunk(&router, s, 32);
                    }
                }
                run(
                    &router,
                    StepPlan::Decode {
                        tokens: &tokens,
                        readback: Readback::Argmax,
                    },
                    &mut rows,
                );
            })
        });
        for s in seqs.iter_mut() {
            release(&router, s, false);
        }

        // The same step on the bare model: one block table per row, positions cycling in
        // 32..32+CYCLE.
        let block = 16;
        let mut kv = KvPool::new(model.config(), batch * 32, block).unwrap();
        let mut states = MambaStates::new(model.config(), batch).unwrap();
        let mut scratch = Scratch::new(model.config());
        let tables: Vec<Vec<u32>> = (0..batch)
            .map(|r| (0..32).map(|b| (r * 32 + b) as u32).collect())
            .collect();
        let mut logits = Vec::new();
        let mut pos = 32usize;
        group.bench_function(BenchmarkId::new("bare-model", batch), |b| {
            b.iter(|| {
                let rows: Vec<DecodeRow<'_>> = (0..batch)
                    .map(|r| DecodeRow {
                        token: r as u32,
                        pos,
                        blocks: &tables[r],
                        slot: r,
                    })
                    .collect();
                model
                    .decode(&mut scratch, &mut kv, &mut states, &rows, &mut logits)
                    .unwrap();
                pos = if pos + 1 >= 32 + CYCLE { 32 } else { pos + 1 };
            })
        });
    }
    group.finish();
}

/// A 256-token prompt computed, against the same prompt's next turn served from the cache.
fn prefill(c: &mut Criterion, name: &str, model: Model) {
    let vocab = model.config().vocab_size as u32;
    let mut group = c.benchmark_group(format!("prefill/{name}"));
    group.throughput(Throughput::Elements(256));
    let mut config = CpuRouterConfig::new(128, 2);
    config.checkpoints = device_cpu::CheckpointBudget::Slots(8);
    let router = CpuRouter::new(model, config).unwrap();
    let p = prompt(99, 256, vocab);
    let mut id = 0;
    let mut once = |router: &CpuRouter, cache: bool| {
        id += 1;
        let mut s: CpuSeq = seq(id, &p);
        let ticket = router
            .launch(
                StepPlan::Prefill {
                    budgets: &[256],
                    readback: Readback::Argmax,
                },
                &mut [&mut s],
            )
            .unwrap();
        let cached = router.await_result(ticket).unwrap().rows[0]
            .prefill
            .unwrap()
            .cached;
        release(router, &mut s, cache);
        cached
    };
    group.bench_function("computed", |b| {
        b.iter(|| {
            router.clear_prefix_cache().unwrap();
            once(&router, false)
        })
    });
    once(&router, true);
    assert_eq!(
        once(&router, true),
        240,
        "the repeated prompt is served from the cache"
    );
    group.bench_function("from-cache-240", |b| b.iter(|| once(&router, true)));
    group.finish();
}

fn benches(c: &mut Criterion) {
    decode(c, "fixture", fixture_model());
    prefill(c, "fixture", fixture_model());
    let small = Model::random(model::Config::small_512(), 1).unwrap();
    decode(c, "small-512", small.clone());
    prefill(c, "small-512", small);
}

criterion_group! {
    name = router;
    config = Criterion::default().sample_size(20).warm_up_time(std::time::Duration::from_millis(500)).measurement_time(std::time::Duration::from_secs(2));
    targets = benches
}
criterion_main!(router);
