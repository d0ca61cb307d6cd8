//! Token choice per request: greedy, seeded random sampling with filters, or forced tokens.
//!
//! Random sampling costs O(vocab) per row in the common cases: weights are computed in id order,
//! top-k selects (no full sort), top-p ranks only as many candidates as the nucleus needs, and
//! min-p filters in place.
//!
//! A [`Sampler`] belongs to one request and lives as long as it does, across preemptions (so a
//! request's random stream continues where it left off after a spill or a recompute). Greedy
//! and forced samplers never need host logits; a random sampler always does.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::request::{RandomSampling, Sampling};

/// The token chooser of one request (the engine keeps one per request). Parameters are meant to
/// have passed [`crate::Limits::validate`]; out-of-range ones never panic.
#[derive(Debug)]
pub struct Sampler {
    kind: Kind,
}

#[derive(Debug)]
enum Kind {
    Greedy,
    Random {
        params: RandomSampling,
        // Boxed: the generator's state is much larger than the other variants.
        rng: Box<ChaCha8Rng>,
    },
    Forced {
        tokens: Vec<u32>,
        next: usize,
    },
}

impl Sampler {
    /// A chooser for `sampling` (a random one seeds its own ChaCha8 stream).
    pub fn new(sampling: Sampling) -> Self {
        let kind = match sampling {
            Sampling::Greedy => Kind::Greedy,
            Sampling::Random(params) => Kind::Random {
                rng: Box::new(ChaCha8Rng::seed_from_u64(params.seed)),
                params,
            },
            Sampling::Forced(tokens) => Kind::Forced { tokens, next: 0 },
        };
        Sampler { kind }
    }

    /// Whether choosing a token needs the host logits (a device argmax will not do).
    pub fn needs_logits(&self) -> bool {
        matches!(self.kind, Kind::Random { .. })
    }

    /// Where the input after the next chosen token comes from before the host has read it: the
    /// device argmax itself (greedy, or forced once the list is spent), the forced token, or
    /// nowhere (a random sampler needs the logits first).
    pub fn run_ahead(&self) -> RunAhead {
        match &self.kind {
            Kind::Greedy => RunAhead::DeviceArgmax,
            Kind::Random { .. } => RunAhead::NeedsLogits,
            Kind::Forced { tokens, next } => match tokens.get(*next) {
                Some(&token) => RunAhead::Known(token),
                None => RunAhead::DeviceArgmax,
            },
        }
    }

    /// The next token when only the device argmax is known (never called for a random sampler,
    /// which [`Self::needs_logits`]).
    pub fn choose_with_argmax(&mut self, argmax: u32) -> u32 {
        match &mut self.kind {
            Kind::Greedy | Kind::Random { .. } => argmax,
            Kind::Forced { tokens, next } => take_forced(tokens, next, argmax),
        }
    }

    /// The next token from one row of host logits; `scratch` is reused between calls.
    pub fn choose_from_logits(&mut self, logits: &[f32], scratch: &mut Vec<(f32, u32)>) -> u32 {
        match &mut self.kind {
            Kind::Greedy => argmax(logits),
            Kind::Forced { tokens, next } => take_forced(tokens, next, argmax(logits)),
            Kind::Random { params, rng } => sample(logits, params, rng, scratch),
        }
    }
}

/// How the token a sampler will choose next is known ahead of the host reading the step that
/// produces it (what lets the engine run a step ahead).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RunAhead {
    /// It is the device argmax: a fed step takes it from the device's feed cell.
    DeviceArgmax,
    /// It is this token, whatever the device computes.
    Known(u32),
    /// Only the host logits decide it.
    NeedsLogits,
}

fn take_forced(tokens: &[u32], next: &mut usize, fallback: u32) -> u32 {
    // Validation guarantees `max_tokens <= tokens.len()`, so the list never runs out before the
    // request stops; the fallback only keeps this total.
    let token = tokens.get(*next).copied().unwrap_or(fallback);
    *next += 1;
    token
}

/// The index of the largest logit, the first one on ties; NaNs never win (0 when all are NaN).
pub fn argmax(logits: &[f32]) -> u32 {
    // First the maximum, over eight independent lanes (one dependency chain per lane, so the
    // loop runs at the speed of the loads); `>` is false for NaN, so NaNs never count. Then the
    // first position that holds it.
    let mut lanes = [f32::NEG_INFINITY; 8];
    let mut chunks = logits.chunks_exact(8);
    for chunk in &mut chunks {
        for (lane, &value) in lanes.iter_mut().zip(chunk) {
            if value > *lane {
                *lane = value;
            }
        }
    }
    let mut max = f32::NEG_INFINITY;
    for &value in lanes.iter().chain(chunks.remainder()) {
        if value > max {
            max = value;
        }
    }
    logits.iter().position(|&value| value == max).unwrap_or(0) as u32
}

fn sample(
    logits: &[f32],
    params: &RandomSampling,
    rng: &mut ChaCha8Rng,
    scratch: &mut Vec<(f32, u32)>,
) -> u32 {
    // Temperature 0 is greedy (a hand-built sampler may ask for it; validation refuses it).
    if !(params.temperature.is_finite() && params.temperature > 0.0) {
        return argmax(logits);
    }
    scratch.clear();
    let mut max = f32::NEG_INFINITY;
    for (index, &value) in logits.iter().enumerate() {
        if value.is_nan() {
            continue;
        }
        let scaled = value / params.temperature;
        max = max.max(scaled);
        scratch.push((scaled, index as u32));
    }
    if scratch.is_empty() {
        tracing::warn!("every logit is NaN; answering token 0");
        return 0;
    }
    // Unnormalised softmax weights, in id order. With an infinite maximum (all -inf, or some
    // +inf) the maxima share the mass equally.
    for entry in scratch.iter_mut() {
        entry.0 = if max.is_infinite() {
            if entry.0 == max {
                1.0
            } else {
                0.0
            }
        } else {
            (entry.0 - max).exp()
        };
    }
    // Most likely first; equal weights in id order, so every order below is deterministic.
    let by_rank = |a: &(f32, u32), b: &(f32, u32)| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1));
    if let Some(k) = params.top_k {
        // `Limits::validate` refuses 0; a hand-built sampler gets the most likely token.
        let k = k.max(1);
        if k < scratch.len() {
            scratch.select_nth_unstable_by(k - 1, by_rank);
            scratch.truncate(k);
        }
    }
    if params.top_p < 1.0 {
        let mass: f64 = scratch.iter().map(|entry| f64::from(entry.0)).sum();
        let target = f64::from(params.top_p) * mass;
        // The nucleus is usually small: rank only as many candidates as it needs (O(vocab) per
        // round instead of sorting the whole vocabulary).
        let mut ranked = scratch.len().min(64);
        loop {
            if ranked < scratch.len() {
                scratch.select_nth_unstable_by(ranked - 1, by_rank);
            }
            scratch[..ranked].sort_unstable_by(by_rank);
            let mut cumulative = 0.0f64;
            let keep = scratch[..ranked].iter().position(|entry| {
                cumulative += f64::from(entry.0);
                cumulative >= target
            });
            match keep {
                Some(last) => {
                    scratch.truncate(last + 1);
                    break;
                }
                // Rounding left the whole set just short of the target: keep it all.
                None if ranked == scratch.len() => break,
                None => ranked = (ranked * 4).min(scratch.len()),
            }
        }
    }
    if params.min_p > 0.0 {
        let most_likely = scratch.iter().fold(0.0f32, |m, entry| m.max(entry.0));
        let floor = params.min_p * most_likely;
        scratch.retain(|entry| entry.0 >= floor);
    }
    let kept: f64 = scratch.iter().map(|entry| f64::from(entry.0)).sum();
    let mut target = rng.random::<f64>() * kept;
    for entry in scratch.iter() {
        target -= f64::from(entry.0);
        if target < 0.0 {
            return entry.1;
        }
    }
    // Rounding (or out-of-range parameters on a hand-built sampler, such as min_p above 1) left
    // nothing drawn: the last kept token, else the most likely one.
    scratch
        .last()
        .map_or_else(|| argmax(logits), |entry| entry.1)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn random(f: impl FnOnce(&mut RandomSampling)) -> Sampler {
        let mut params = RandomSampling::new(1.0, 42);
        f(&mut params);
        Sampler::new(Sampling::Random(params))
    }

    fn draws(sampler: &mut Sampler, logits: &[f32], n: usize) -> Vec<u32> {
        let mut scratch = Vec::new();
        (0..n)
            .map(|_| sampler.choose_from_logits(logits, &mut scratch))
            .collect()
    }

    #[test]
    fn argmax_takes_the_first_maximum_and_skips_nan() {
        assert_eq!(argmax(&[1.0, 3.0, 3.0, 2.0]), 1);
        assert_eq!(argmax(&[f32::NAN, -5.0, f32::NAN]), 1);
        assert_eq!(argmax(&[f32::NAN, f32::NAN]), 0);
        assert_eq!(argmax(&[f32::NEG_INFINITY, f32::NEG_INFINITY]), 0);
        assert_eq!(argmax(&[]), 0);
        // Longer than the eight lanes: ties across lanes, NaNs, the maximum in the remainder.
        let mut row: Vec<f32> = (0..37).map(|i| (i % 5) as f32).collect();
        assert_eq!(argmax(&row), 4);
        row[13] = 9.0;
        row[21] = 9.0;
        row[2] = f32::NAN;
        assert_eq!(argmax(&row), 13);
        row[35] = 9.5;
        assert_eq!(argmax(&row), 35);
        let naive = |row: &[f32]| {
            let mut best = 0;
            for (i, &v) in row.iter().enumerate() {
                if v > row[best] || row[best].is_nan() && !v.is_nan() {
                    best = i;
                }
            }
            best as u32
        };
        let mut rng = ChaCha8Rng::seed_from_u64(3);
        for _ in 0..200 {
            let len = rng.random_range(0..61);
            let row: Vec<f32> = (0..len)
                .map(|_| match rng.random_range(0..20) {
                    0 => f32::NAN,
                    n => n as f32,
                })
                .collect();
            assert_eq!(argmax(&row), naive(&row), "{row:?}");
        }
    }

    #[test]
    fn greedy_and_forced_ignore_randomness() {
        let mut scratch = Vec::new();
        let mut greedy = Sampler::new(Sampling::Greedy);
        assert!(!greedy.needs_logits());
        assert_eq!(greedy.choose_from_logits(&[0.0, 2.0, 1.0], &mut scratch), 1);
        assert_eq!(greedy.choose_with_argmax(9), 9);
        let mut forced = Sampler::new(Sampling::Forced(vec![4, 5]));
        assert!(!forced.needs_logits());
        assert_eq!(forced.choose_with_argmax(9), 4);
        assert_eq!(forced.choose_from_logits(&[0.0, 2.0], &mut scratch), 5);
    }

    #[test]
    fn what_a_step_ahead_can_know() {
        assert_eq!(
            Sampler::new(Sampling::Greedy).run_ahead(),
            RunAhead::DeviceArgmax
        );
        let mut forced = Sampler::new(Sampling::Forced(vec![4, 5]));
        assert_eq!(forced.run_ahead(), RunAhead::Known(4));
        forced.choose_with_argmax(0);
        assert_eq!(forced.run_ahead(), RunAhead::Known(5));
        forced.choose_with_argmax(0);
        assert_eq!(forced.run_ahead(), RunAhead::DeviceArgmax);
        let random = Sampler::new(Sampling::Random(RandomSampling {
            temperature: 1.0,
            top_k: None,
            top_p: 1.0,
            min_p: 0.0,
            seed: 1,
        }));
        assert_eq!(random.run_ahead(), RunAhead::NeedsLogits);
    }

    #[test]
    fn the_same_seed_gives_the_same_tokens() {
        let logits: Vec<f32> = (0..50).map(|i| (i as f32 * 0.37).sin()).collect();
        let a = draws(&mut random(|_| {}), &logits, 64);
        let b = draws(&mut random(|_| {}), &logits, 64);
        assert_eq!(a, b);
        let c = draws(&mut random(|p| p.seed = 43), &logits, 64);
        assert_ne!(a, c);
        // Random sampling really spreads over several tokens.
        let mut distinct = a.clone();
        distinct.sort_unstable();
        distinct.dedup();
        assert!(distinct.len() > 5, "{distinct:?}");
    }

    #[test]
    fn filters_restrict_the_support() {
        let logits = [0.0, 1.0, 5.0, 4.9, -3.0, 4.8];
        let mut top2 = draws(&mut random(|p| p.top_k = Some(2)), &logits, 200);
        top2.sort_unstable();
        top2.dedup();
        assert_eq!(top2, vec![2, 3]);

        // Probabilities of 2, 3, 5 are about 0.36, 0.33, 0.30: top_p 0.5 keeps two.
        let mut nucleus = draws(&mut random(|p| p.top_p = 0.5), &logits, 200);
        nucleus.sort_unstable();
        nucleus.dedup();
        assert_eq!(nucleus, vec![2, 3]);

        // min_p 0.5: tokens at least half as likely as token 2 (2, 3 and 5).
        let mut min_p = draws(&mut random(|p| p.min_p = 0.5), &logits, 400);
        min_p.sort_unstable();
        min_p.dedup();
        assert_eq!(min_p, vec![2, 3, 5]);

        // A tiny temperature is greedy in effect.
        let cold = draws(&mut random(|p| p.temperature = 1e-3), &logits, 50);
        assert!(cold.iter().all(|&t| t == 2));
    }

    #[test]
    fn a_wide_nucleus_is_ranked_in_rounds() {
        // 1000 equal logits: the nucleus of 0.5 is the first 500 ids (ties rank by id), more
        // than the first round's 64 candidates.
        let logits = vec![0.0f32; 1000];
        let picks = draws(&mut random(|p| p.top_p = 0.5), &logits, 400);
        assert!(picks.iter().all(|&t| t < 500), "{picks:?}");
        assert!(picks.iter().any(|&t| t >= 256));
    }

    #[test]
    fn draws_follow_the_softmax() {
        // Weights 1 and 3: token 1 should come up about three times in four.
        let logits = [0.0f32, 3.0f32.ln()];
        let picks = draws(&mut random(|_| {}), &logits, 4000);
        let ones = picks.iter().filter(|&&t| t == 1).count();
        assert!((2850..=3150).contains(&ones), "{ones}");
    }

    #[test]
    fn out_of_range_parameters_never_panic() {
        let logits = [0.5, 2.0, 1.0];
        assert_eq!(
            draws(&mut random(|p| p.min_p = 2.0), &logits, 3),
            vec![1, 1, 1]
        );
        assert_eq!(
            draws(&mut random(|p| p.top_k = Some(0)), &logits, 3),
            vec![1, 1, 1]
        );
        assert_eq!(
            draws(&mut random(|p| p.top_p = 0.0), &logits, 3),
            vec![1, 1, 1]
        );
        assert_eq!(
            draws(&mut random(|p| p.temperature = 0.0), &logits, 3),
            vec![1, 1, 1]
        );
    }

    #[test]
    fn infinite_logits_are_handled() {
        let logits = [0.0, f32::INFINITY, 1.0, f32::NEG_INFINITY];
        let picks = draws(&mut random(|_| {}), &logits, 20);
        assert!(picks.iter().all(|&t| t == 1));
        let picks = draws(&mut random(|_| {}), &[f32::NAN, f32::NAN], 3);
        assert_eq!(picks, vec![0, 0, 0]);
    }
}
