//! Criterion benchmark: lookup + branch checkpoint + finish (insert) + eviction for one
//! 2k-token request against a warm store at steady state (every request evicts).
#![forbid(unsafe_code)]

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use kv_cache::BlockId;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use ssm_snapshot::{
    Admission, BudgetScope, CostModel, FlopBasis, Namespace, PinScope, Recency, SnapshotStore,
    StoreConfig, StoreDelta,
};

/// 512 requests of 2048 input tokens (a 1024-token opener from 8 shared ones plus a unique part)
/// and 64 output tokens.
fn requests() -> Vec<(Vec<u32>, Vec<u32>)> {
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    let mut tokens =
        |n: usize| -> Vec<u32> { (0..n).map(|_| rng.random_range(0..50_000)).collect() };
    let openers: Vec<Vec<u32>> = (0..8).map(|_| tokens(1024)).collect();
    (0..512)
        .map(|i| {
            let mut input = openers[i % 8].clone();
            input.extend(tokens(1024));
            let mut full = input.clone();
            full.extend(tokens(64));
            (input, full)
        })
        .collect()
}

/// One request as a router drives the store; returns the hit length so the work is used.
fn serve(
    store: &mut SnapshotStore,
    input: &[u32],
    full: &[u32],
    table: &mut Vec<BlockId>,
    next_block: &mut u32,
    delta: &mut StoreDelta,
) -> usize {
    delta.clear();
    let hit = store.lookup(Namespace::default(), &input[..input.len() - 1], table);
    if let Some(pos) = hit.branch_at {
        if let Some(slot) = store
            .reserve_checkpoint_for(&hit.pin, delta)
            .expect("held pin")
        {
            store
                .commit_branch(&hit.pin, input, pos, slot, delta)
                .expect("valid branch");
        }
    }
    let block = store.config().block_size as usize;
    let n = full.len() / block;
    while table.len() < n {
        table.push(BlockId(*next_block));
        *next_block = next_block.wrapping_add(1);
    }
    let hit_tokens = hit.hit_tokens;
    match store
        .reserve_checkpoint_for(&hit.pin, delta)
        .expect("held pin")
    {
        Some(slot) => store
            .finish(hit.pin, full, table, &[(n * block, slot)], delta)
            .expect("valid finish"),
        None => store
            .finish(hit.pin, full, table, &[], delta)
            .expect("valid finish"),
    };
    store.evict_for_kv(4, delta);
    hit_tokens
}

fn bench_request(c: &mut Criterion) {
    let requests = requests();
    let mut group = c.benchmark_group("request_2k");
    for (block_size, alpha, guard) in [
        (16u32, 0.0f64, false),
        (16, 1.0, false),
        (16, 1.0, true),
        (1, 0.0, false),
        (1, 1.0, false),
        (1, 1.0, true),
    ] {
        let cost = CostModel::nvidia_hybrid_7b();
        // Room for about 40 requests' unique parts: every request evicts.
        let budget = 40 * (1024 * cost.kv_bytes_per_token() + 2 * cost.checkpoint_bytes());
        let config = StoreConfig {
            block_size,
            checkpoint_slots: 1024,
            budget_bytes: budget,
            budget_scope: BudgetScope::CheckpointsAndKv,
            admission: Admission::Marconi,
            alpha,
            flop_basis: FlopBasis::Marginal,
            recency: Recency::Adaptive,
            guard,
            pin_scope: PinScope::Path,
            cost,
        };
        let mut store = SnapshotStore::new(config).expect("valid config");
        let mut delta = StoreDelta::default();
        let mut table = Vec::new();
        let mut next_block = 0u32;
        for (input, full) in &requests {
            serve(
                &mut store,
                input,
                full,
                &mut table,
                &mut next_block,
                &mut delta,
            );
        }
        let mut i = 0;
        let guarded = if guard { "/guard" } else { "" };
        let id = BenchmarkId::new(format!("B={block_size}"), format!("alpha={alpha}{guarded}"));
        group.bench_function(id, |b| {
            b.iter(|| {
                let (input, full) = &requests[i % requests.len()];
                i += 1;
                serve(
                    &mut store,
                    input,
                    full,
                    &mut table,
                    &mut next_block,
                    &mut delta,
                )
            })
        });
    }
    group.finish();
}

criterion_group!(benches, bench_request);
criterion_main!(benches);
