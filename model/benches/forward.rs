//! Criterion benchmarks of the host forward: decode tokens/s at batch 1, 8 and 64 (each row with
//! a 128-token context) and prefill tokens/s (one 128-token chunk), for the fixture's config
//! (`Config::tiny_demo`, hidden 64, 10 layers) and the built-in `Config::small_512` (hidden 512,
//! 16 layers), both with seeded random weights.
//!
//! `cargo bench -p model --bench forward`

mod common;

use common::{
    block_tables, context, decode_rows, prefill_contexts, BLOCKS_PER_ROW, BLOCK_SIZE, CONTEXT,
};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use model::{Config, KvPool, MambaStates, Model, PrefillRow, Scratch};

fn bench_config(c: &mut Criterion, name: &str, config: Config) {
    let model = Model::random(config, 1).expect("built-in config is valid");
    let config = model.config().clone();
    let vocab = config.vocab_size as u32;
    let mut group = c.benchmark_group(name);
    group.sample_size(10);
    group.warm_up_time(std::time::Duration::from_secs(1));
    group.measurement_time(std::time::Duration::from_secs(3));

    for batch in [1usize, 8, 64] {
        let mut kv = KvPool::new(&config, batch * BLOCKS_PER_ROW, BLOCK_SIZE).expect("pool");
        let mut states = MambaStates::new(&config, batch).expect("states");
        let mut scratch = Scratch::new(&config);
        let mut logits = Vec::new();
        let tables = block_tables(batch);
        prefill_contexts(&model, &mut scratch, &mut kv, &mut states, &tables, &[]);
        let rows = decode_rows(&tables, vocab);
        group.throughput(Throughput::Elements(batch as u64));
        group.bench_function(BenchmarkId::new("decode", batch), |b| {
            b.iter(|| {
                model
                    .decode(&mut scratch, &mut kv, &mut states, &rows, &mut logits)
                    .expect("decode")
            })
        });
    }

    let mut kv = KvPool::new(&config, BLOCKS_PER_ROW, BLOCK_SIZE).expect("pool");
    let mut states = MambaStates::new(&config, 1).expect("states");
    let mut scratch = Scratch::new(&config);
    let mut logits = Vec::new();
    let table = &block_tables(1)[0];
    let tokens = context(0, vocab);
    group.throughput(Throughput::Elements(CONTEXT as u64));
    group.bench_function(BenchmarkId::new("prefill", CONTEXT), |b| {
        b.iter(|| {
            states.zero_slot(0).expect("slot");
            let row = PrefillRow {
                tokens: &tokens,
                start_pos: 0,
                blocks: table,
                slot: 0,
            };
            model
                .prefill(&mut scratch, &mut kv, &mut states, row, false, &mut logits)
                .expect("prefill")
        })
    });
    group.finish();
}

fn benches(c: &mut Criterion) {
    bench_config(c, "tiny_demo", Config::tiny_demo());
    bench_config(c, "small_512", Config::small_512());
}

criterion_group!(forward, benches);
criterion_main!(forward);
