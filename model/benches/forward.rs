//! Criterion benchmarks of the host forward: decode tokens/s at batch 1, 8 and 64 (each row with
//! a 128-token context) and prefill tokens/s (one 128-token chunk), for the fixture's config
//! (`Config::tiny_demo`, hidden 64, 10 layers) and the built-in `Config::small_512` (hidden 512,
//! 16 layers), both with seeded random weights.
//!
//! `cargo bench -p model --bench forward`

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use model::{Config, DecodeRow, KvPool, MambaStates, Model, PrefillRow, Scratch};

const BLOCK_SIZE: usize = 16;
const CONTEXT: usize = 128;

fn bench_config(c: &mut Criterion, name: &str, config: Config) {
    let model = Model::random(config, 1).expect("built-in config is valid");
    let config = model.config().clone();
    let vocab = config.vocab_size as u32;
    let mut group = c.benchmark_group(name);
    group.sample_size(10);
    group.warm_up_time(std::time::Duration::from_secs(1));
    group.measurement_time(std::time::Duration::from_secs(3));

    let blocks_per_seq = (CONTEXT + 1).div_ceil(BLOCK_SIZE);
    for batch in [1usize, 8, 64] {
        let mut kv = KvPool::new(&config, batch * blocks_per_seq, BLOCK_SIZE).expect("pool");
        let mut states = MambaStates::new(&config, batch).expect("states");
        let mut scratch = Scratch::new(&config);
        let mut logits = Vec::new();
        let tables: Vec<Vec<u32>> = (0..batch)
            .map(|s| ((s * blocks_per_seq) as u32..((s + 1) * blocks_per_seq) as u32).collect())
            .collect();
        for (slot, table) in tables.iter().enumerate() {
            let tokens: Vec<u32> = (0..CONTEXT as u32)
                .map(|t| (t * 31 + slot as u32 * 7) % vocab)
                .collect();
            let row = PrefillRow {
                tokens: &tokens,
                start_pos: 0,
                blocks: table,
                slot,
            };
            model
                .prefill(&mut scratch, &mut kv, &mut states, row, false, &mut logits)
                .expect("prefill");
        }
        // Every iteration decodes position CONTEXT again (overwriting its K/V), so the context
        // length stays fixed while the Mamba state keeps stepping.
        let rows: Vec<DecodeRow<'_>> = tables
            .iter()
            .enumerate()
            .map(|(slot, table)| DecodeRow {
                token: (slot as u32 * 13) % vocab,
                pos: CONTEXT,
                blocks: table,
                slot,
            })
            .collect();
        group.throughput(Throughput::Elements(batch as u64));
        group.bench_function(BenchmarkId::new("decode", batch), |b| {
            b.iter(|| {
                model
                    .decode(&mut scratch, &mut kv, &mut states, &rows, &mut logits)
                    .expect("decode")
            })
        });
    }

    let mut kv = KvPool::new(&config, blocks_per_seq, BLOCK_SIZE).expect("pool");
    let mut states = MambaStates::new(&config, 1).expect("states");
    let mut scratch = Scratch::new(&config);
    let mut logits = Vec::new();
    let table: Vec<u32> = (0..blocks_per_seq as u32).collect();
    let tokens: Vec<u32> = (0..CONTEXT as u32).map(|t| (t * 31) % vocab).collect();
    group.throughput(Throughput::Elements(CONTEXT as u64));
    group.bench_function(BenchmarkId::new("prefill", CONTEXT), |b| {
        b.iter(|| {
            states.zero_slot(0).expect("slot");
            let row = PrefillRow {
                tokens: &tokens,
                start_pos: 0,
                blocks: &table,
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
