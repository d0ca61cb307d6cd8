//! Host sampling cost per row: greedy argmax and seeded random sampling (plain temperature,
//! top-k, top-p, min-p) over one row of logits at vocabulary sizes 32k and 128k.
//!
//! `cargo bench -p scheduler --bench sampling`

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use scheduler::sampling::Sampler;
use scheduler::{RandomSampling, Sampling};

fn logits(vocab: usize) -> Vec<f32> {
    // Roughly the shape of real logits: most tokens far below a few likely ones.
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    (0..vocab)
        .map(|_| {
            let x: f32 = rng.random();
            -8.0 + 16.0 * x.powi(6)
        })
        .collect()
}

fn sampling(c: &mut Criterion) {
    let mut group = c.benchmark_group("sample_row");
    for vocab in [32_000usize, 128_000] {
        let row = logits(vocab);
        let random = |f: fn(&mut RandomSampling)| {
            let mut params = RandomSampling::new(0.8, 7);
            f(&mut params);
            Sampling::Random(params)
        };
        let cases: [(&str, Sampling); 5] = [
            ("greedy", Sampling::Greedy),
            ("temperature", random(|_| {})),
            ("top_k_50", random(|p| p.top_k = Some(50))),
            ("top_p_0.9", random(|p| p.top_p = 0.9)),
            ("min_p_0.05", random(|p| p.min_p = 0.05)),
        ];
        for (name, sampling) in cases {
            let mut sampler = Sampler::new(sampling);
            let mut scratch = Vec::with_capacity(vocab);
            group.bench_with_input(BenchmarkId::new(name, vocab), &row, |b, row| {
                b.iter(|| sampler.choose_from_logits(row, &mut scratch))
            });
        }
    }
    group.finish();
}

criterion_group!(benches, sampling);
criterion_main!(benches);
