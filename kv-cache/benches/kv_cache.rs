//! Criterion benchmarks of the KV bookkeeping: `match_prefix` on a 32k-token prompt half cached
//! (ns per prompt token), single-block alloc + free in steady state (ns per op, and a counting
//! global allocator showing no heap allocation per op), and a multi-turn chat replay (ns per
//! request).
//!
//! Run: `cargo bench -p kv-cache --bench kv_cache`.

use std::alloc::System;
use std::time::{Duration, Instant};

use criterion::{black_box, criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use kv_cache::{
    BlockId, BlockPool, BlockTable, ExtraKey, HashKind, KvCache, KvCacheConfig, KvError,
};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use stats_alloc::{Region, StatsAlloc, INSTRUMENTED_SYSTEM};

#[global_allocator]
static GLOBAL: &StatsAlloc<System> = &INSTRUMENTED_SYSTEM;

const BLOCK_SIZE: usize = 16;

fn random_tokens(rng: &mut ChaCha8Rng, n: usize) -> Vec<u32> {
    (0..n).map(|_| rng.random_range(0..128_000)).collect()
}

/// A cache holding the first half of a 32k-token prompt, all of it evictable.
fn half_cached(kind: HashKind, prompt: &[u32]) -> KvCache {
    let config = KvCacheConfig {
        hash_kind: kind,
        seed: Some(1),
        ..KvCacheConfig::new(4096, BLOCK_SIZE)
    };
    let mut kv = KvCache::new(config).expect("valid config");
    let half = &prompt[..prompt.len() / 2];
    let mut table = BlockTable::new();
    table.append(kv.pool_mut(), half.len()).expect("fits");
    let stored = kv
        .insert(half, table.blocks(), ExtraKey::NONE)
        .expect("insert");
    assert_eq!(stored, half.len() / BLOCK_SIZE);
    table.release_all(kv.pool_mut());
    kv
}

fn bench_match_prefix(c: &mut Criterion) {
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    let prompt = random_tokens(&mut rng, 32 * 1024);
    let mut group = c.benchmark_group("match_prefix_32k_half_cached");
    group.throughput(Throughput::Elements(prompt.len() as u64));
    for kind in [HashKind::Xxh3x64, HashKind::Xxh3x128] {
        let mut kv = half_cached(kind, &prompt);
        let mut out = Vec::with_capacity(prompt.len() / BLOCK_SIZE);

        // One warm call under the counting allocator: a lookup allocates nothing.
        kv.match_prefix_into(&prompt, ExtraKey::NONE, &mut out);
        release(&mut kv, &out);
        let region = Region::new(GLOBAL);
        let matched = kv.match_prefix_into(&prompt, ExtraKey::NONE, &mut out);
        let allocations = region.change().allocations;
        release(&mut kv, &out);
        assert_eq!(matched, prompt.len() / 2);
        println!("match_prefix {kind:?}: {matched} of {} tokens hit, {allocations} heap allocations per warm call", prompt.len());
        assert_eq!(allocations, 0);

        // Only the lookup is timed; releasing the references is not part of it.
        group.bench_function(BenchmarkId::from_parameter(format!("{kind:?}")), |b| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    let start = Instant::now();
                    black_box(kv.match_prefix_into(black_box(&prompt), ExtraKey::NONE, &mut out));
                    total += start.elapsed();
                    release(&mut kv, &out);
                }
                total
            })
        });
    }
    group.finish();
}

fn release(kv: &mut KvCache, blocks: &[BlockId]) {
    for &id in blocks {
        kv.pool_mut().release(id).expect("held");
    }
}

fn bench_alloc_free(c: &mut Criterion) {
    let mut pool = BlockPool::new(8192, BLOCK_SIZE).expect("valid pool");
    // Steady state: half the pool in use, as under load.
    let held: Vec<BlockId> = (0..4096).map(|_| pool.allocate().expect("free")).collect();

    let region = Region::new(GLOBAL);
    for _ in 0..1_000_000 {
        let id = pool.allocate().expect("free");
        pool.release(black_box(id)).expect("held");
    }
    let stats = region.change();
    println!(
        "alloc+free x 1,000,000: {} allocations, {} reallocations, {} deallocations on the heap",
        stats.allocations, stats.reallocations, stats.deallocations
    );
    assert_eq!(stats.allocations + stats.reallocations, 0);

    let mut group = c.benchmark_group("block_pool");
    // Two operations per iteration: one allocate, one release.
    group.throughput(Throughput::Elements(2));
    group.bench_function("alloc_free_single_block", |b| {
        b.iter(|| {
            let id = pool.allocate().expect("free");
            pool.release(black_box(id)).expect("held");
        })
    });
    group.finish();
    black_box(held);
}

/// One turn of a conversation: the full prompt (history plus the new message) and the reply.
struct Request {
    prompt: Vec<u32>,
    output: Vec<u32>,
    extra: ExtraKey,
}

/// A deterministic multi-turn chat trace: conversations share one of a few system prompts, each
/// turn's prompt is the conversation so far plus a new user message.
fn chat_trace() -> Vec<Request> {
    let mut rng = ChaCha8Rng::seed_from_u64(11);
    let systems: Vec<Vec<u32>> = (0..4).map(|_| random_tokens(&mut rng, 600)).collect();
    let conversations = 48;
    let turns = 6;
    let mut history: Vec<Vec<u32>> = (0..conversations)
        .map(|i| systems[i % systems.len()].clone())
        .collect();
    let mut trace = Vec::new();
    for _ in 0..turns {
        for (i, conversation) in history.iter_mut().enumerate() {
            let user_len = rng.random_range(20..200);
            conversation.extend(random_tokens(&mut rng, user_len));
            let reply_len = rng.random_range(20..250);
            let output = random_tokens(&mut rng, reply_len);
            trace.push(Request {
                prompt: conversation.clone(),
                output: output.clone(),
                // Every eighth conversation belongs to a salted tenant.
                extra: if i % 8 == 0 {
                    ExtraKey::NONE.with_salt(99)
                } else {
                    ExtraKey::NONE
                },
            });
            conversation.extend(output);
        }
    }
    trace
}

struct Running<'a> {
    request: &'a Request,
    table: BlockTable,
    generated: usize,
}

/// Replays the trace with up to 16 sequences decoding together, run-ahead style: every decode
/// step reserves the next position, and a finished sequence rolls its over-run back, registers
/// its blocks and releases them. A sequence that finds the pool dry is preempted (released).
/// Returns (hit tokens, preemptions).
fn replay(trace: &[Request], kv: &mut KvCache) -> (usize, usize) {
    let mut pending = trace.iter();
    let mut running: Vec<Running<'_>> = Vec::with_capacity(16);
    let mut hit = 0;
    let mut preempted = 0;
    let mut tokens = Vec::new();
    loop {
        while running.len() < 16 {
            let Some(request) = pending.next() else { break };
            let prompt = &request.prompt;
            let m = kv.match_prefix(&prompt[..prompt.len() - 1], request.extra);
            hit += m.tokens;
            let mut table = BlockTable::from_prefix(m);
            match table.append(kv.pool_mut(), prompt.len() - table.len()) {
                Ok(_) => running.push(Running {
                    request,
                    table,
                    generated: 0,
                }),
                Err(KvError::Exhausted(_)) => {
                    table.release_all(kv.pool_mut());
                    preempted += 1;
                }
                Err(e) => panic!("{e}"),
            }
        }
        if running.is_empty() {
            break;
        }
        let mut i = 0;
        while i < running.len() {
            let seq = &mut running[i];
            let done = seq.generated == seq.request.output.len();
            let step = seq
                .table
                .reserve_next(kv.pool_mut())
                .map_err(KvError::from)
                .and_then(|_| seq.table.append(kv.pool_mut(), 1));
            if step.is_err() {
                seq.table.release_all(kv.pool_mut());
                running.swap_remove(i);
                preempted += 1;
                continue;
            }
            if done {
                // The step after the last token was an over-run: roll it back, then cache.
                seq.table.rollback(kv.pool_mut()).expect("reserved");
                tokens.clear();
                tokens.extend_from_slice(&seq.request.prompt);
                tokens.extend_from_slice(&seq.request.output);
                kv.insert(&tokens, seq.table.blocks(), seq.request.extra)
                    .expect("insert");
                seq.table.release_all(kv.pool_mut());
                running.swap_remove(i);
                continue;
            }
            seq.generated += 1;
            i += 1;
        }
    }
    (hit, preempted)
}

fn bench_chat_trace(c: &mut Criterion) {
    let trace = chat_trace();
    let config = KvCacheConfig {
        seed: Some(3),
        ..KvCacheConfig::new(2048, BLOCK_SIZE)
    };
    let prompt_tokens: usize = trace.iter().map(|r| r.prompt.len()).sum();
    let output_tokens: usize = trace.iter().map(|r| r.output.len()).sum();
    let mut kv = KvCache::new(config).expect("valid config");
    let (hit, preempted) = replay(&trace, &mut kv);
    let counters = kv.pool().counters();
    println!(
        "chat trace: {} requests, {prompt_tokens} prompt tokens ({hit} from cache), {output_tokens} output tokens, \
         {preempted} preemptions, {} evictions, pool of {} blocks x {BLOCK_SIZE}",
        trace.len(),
        counters.evictions,
        kv.pool().num_blocks()
    );

    let mut group = c.benchmark_group("chat_trace");
    group.throughput(Throughput::Elements(trace.len() as u64));
    group.sample_size(20);
    group.bench_function("replay_per_request", |b| {
        b.iter(|| {
            let mut kv = KvCache::new(config).expect("valid config");
            black_box(replay(&trace, &mut kv))
        })
    });
    group.finish();
}

criterion_group!(
    benches,
    bench_match_prefix,
    bench_alloc_free,
    bench_chat_trace
);
criterion_main!(benches);
