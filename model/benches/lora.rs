//! Criterion benchmark of LoRA serving on the host forward (issue 16's target): one decode step
//! of 32 rows (each with a 128-token context) on the built-in `Config::small_512` model, with no
//! adapter, and with four rank-16 adapters on every linear layer of the main stack mixed in the
//! batch (rows take them round-robin, eight rows each). The ratio of the two is the cost of the
//! per-row adapter terms (two products per adapter and adapted layer, batched per adapter). Both
//! run on one thread and on two.
//!
//! `cargo bench -p model --bench lora`

mod common;

use common::{block_tables, decode_rows, prefill_contexts, BLOCKS_PER_ROW, BLOCK_SIZE};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use model::{Config, KvPool, LoraAdapter, LoraSpec, MambaStates, Model, Scratch};

const BATCH: usize = 32;
const ADAPTERS: usize = 4;
const RANK: usize = 16;

fn bench_lora(c: &mut Criterion) {
    let model = Model::random(Config::small_512(), 1).expect("built-in config is valid");
    let config = model.config().clone();
    let vocab = config.vocab_size as u32;
    let adapters: Vec<LoraAdapter> = (0..ADAPTERS as u64)
        .map(|seed| {
            LoraAdapter::random(&model, &LoraSpec::all_linear(RANK), 100 + seed).expect("adapter")
        })
        .collect();
    let mut group = c.benchmark_group("lora_small_512");
    group.sample_size(10);
    group.warm_up_time(std::time::Duration::from_secs(1));
    group.measurement_time(std::time::Duration::from_secs(3));
    group.throughput(Throughput::Elements(BATCH as u64));

    let tables = block_tables(BATCH);
    for threads in [1usize, 2] {
        for mixed in [false, true] {
            let row_adapters: Vec<Option<&LoraAdapter>> = if mixed {
                (0..BATCH).map(|i| Some(&adapters[i % ADAPTERS])).collect()
            } else {
                Vec::new()
            };
            let mut kv = KvPool::new(&config, BATCH * BLOCKS_PER_ROW, BLOCK_SIZE).expect("pool");
            let mut states = MambaStates::new(&config, BATCH).expect("states");
            let mut scratch = Scratch::with_threads(&config, threads).expect("threads");
            let mut logits = Vec::new();
            prefill_contexts(
                &model,
                &mut scratch,
                &mut kv,
                &mut states,
                &tables,
                &row_adapters,
            );
            let rows = decode_rows(&tables, vocab);
            let name = if mixed {
                "decode_4_adapters"
            } else {
                "decode_base"
            };
            group.bench_function(BenchmarkId::new(name, format!("{threads}t")), |b| {
                b.iter(|| {
                    model
                        .decode_with_adapters(
                            &mut scratch,
                            &mut kv,
                            &mut states,
                            &rows,
                            &row_adapters,
                            &mut logits,
                        )
                        .expect("decode")
                })
            });
        }
    }
    group.finish();
}

criterion_group!(benches, bench_lora);
criterion_main!(benches);
