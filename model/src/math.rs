//! Numeric kernels with a fixed evaluation order: the matrix product (the packed kernel of
//! [`crate::gemm`]), dot products and sums of squares in 8 fixed lanes, RMSNorm, and the scalar
//! activations.
//!
//! Invariant: every function here computes each output row from that row's inputs alone, in an
//! order that depends only on the vector lengths, never on how many rows are processed together
//! or on how many threads share the work; `tests/invariance.rs` checks it bit for bit.

use crate::gemm::{self, Kernels};
use crate::weights::Linear;

/// The matrix product's context: the kernels (threads, instruction set) and its panel scratch.
#[derive(Debug, Clone)]
pub(crate) struct Matmul {
    pub kernels: Kernels,
    tmp: Vec<f32>,
}

impl Default for Matmul {
    fn default() -> Self {
        Self::new(Kernels::single())
    }
}

impl Matmul {
    pub(crate) fn new(kernels: Kernels) -> Self {
        Self {
            kernels,
            tmp: Vec::new(),
        }
    }
}

/// `out[m, lin.out_dim] = x[m, lin.in_dim] · Wᵀ (+ bias)`; see [`gemm`] for the evaluation order.
#[track_caller]
pub(crate) fn matmul(mm: &mut Matmul, x: &[f32], rows: usize, lin: &Linear, out: &mut [f32]) {
    matmul_then(mm, x, rows, lin, out, None);
}

/// [`matmul`], then `then` over each output row's columns in the task that computed them (see
/// [`gemm::Epilogue`]).
#[track_caller]
pub(crate) fn matmul_then(
    mm: &mut Matmul,
    x: &[f32],
    rows: usize,
    lin: &Linear,
    out: &mut [f32],
    then: Option<gemm::Epilogue<'_>>,
) {
    gemm::matmul(
        &mm.kernels,
        x,
        rows,
        &lin.weight,
        lin.bias.as_deref(),
        &mut mm.tmp,
        out,
        then,
    );
}

const LANES: usize = 8;

/// Folds 8 lane accumulators and a tail in one fixed tree order.
#[inline]
fn fold(acc: [f32; LANES], tail: f32) -> f32 {
    ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7])) + tail
}

/// `Σ a_i b_i` in 8 lanes (lane `i % 8` for the full chunks), then the tail in order.
#[inline]
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    let mut acc = [0.0f32; LANES];
    let (ca, cb) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        // Fixed-size views let the compiler keep `acc` in one vector register.
        let (x, y): (&[f32; LANES], &[f32; LANES]) = match (x.try_into(), y.try_into()) {
            (Ok(x), Ok(y)) => (x, y),
            _ => unreachable!("chunks_exact yields {LANES} floats"),
        };
        for l in 0..LANES {
            acc[l] += x[l] * y[l];
        }
    }
    let mut tail = 0.0f32;
    for (x, y) in ra.iter().zip(rb) {
        tail += x * y;
    }
    fold(acc, tail)
}

/// `e^x` in every lane, for a softmax's `x - max` (so `x <= 0`; above 88 the result saturates at
/// about `e^88` instead of overflowing). `-inf` gives exactly 0, as does anything whose `e^x` is
/// below the smallest normal float (`x < ln 2^-126`); `exp(0)` is exactly 1; NaN stays NaN.
///
/// `x = n ln 2 + r` with `n` the nearest integer to `x log2 e` (`|r| <= ln 2 / 2`), `e^r` by its
/// Taylor polynomial of degree 7 in Horner form (truncation below 1e-8 relatively, a tenth of an
/// ulp) and `2^n` built in the exponent bits. Every lane runs the same fused multiply-adds, so a
/// value's result does not depend on the lane it sits in or on the vector width.
#[inline(always)]
pub(crate) fn exp_simd<S: pulp::Simd>(simd: S, x: S::f32s) -> S::f32s {
    // ln 2^-126: below it e^x is subnormal (flushed to 0 here, like -inf).
    const MIN: f32 = -87.336_54;
    // 88 log2 e < 127, so 2^n stays a normal float.
    const MAX: f32 = 88.0;
    // 1.5 * 2^23: adding it rounds a float below 2^22 to the nearest integer (ties to even).
    const ROUND: f32 = 12_582_912.0;
    // ln 2 in two parts: the float nearest ln 2 and the rest.
    const LN2_HI: f32 = std::f32::consts::LN_2;
    const LN2_LO: f32 = -1.904_654_3e-9;
    let clamped = simd.min_f32s(simd.max_f32s(x, simd.splat_f32s(MIN)), simd.splat_f32s(MAX));
    let shifted = simd.mul_add_f32s(
        clamped,
        simd.splat_f32s(std::f32::consts::LOG2_E),
        simd.splat_f32s(ROUND),
    );
    let n = simd.sub_f32s(shifted, simd.splat_f32s(ROUND));
    let r = simd.mul_add_f32s(n, simd.splat_f32s(-LN2_HI), clamped);
    let r = simd.mul_add_f32s(n, simd.splat_f32s(-LN2_LO), r);
    // 1 + r + r²/2! + ... + r⁷/7!
    let mut p = simd.splat_f32s(1.0 / 5040.0);
    for c in [
        1.0 / 720.0,
        1.0 / 120.0,
        1.0 / 24.0,
        1.0 / 6.0,
        0.5,
        1.0,
        1.0,
    ] {
        p = simd.mul_add_f32s(p, r, simd.splat_f32s(c));
    }
    // The low bits of `shifted` hold n (ROUND's low 23 bits are 0x400000, whose low 9 bits are
    // 0): shifting n + 127 into the exponent field gives the bits of 2^n, n in -126..=127.
    let biased = simd.add_u32s(simd.transmute_u32s_f32s(shifted), simd.splat_u32s(127));
    let scale = simd.wrapping_dyn_shl_u32s(biased, simd.splat_u32s(23));
    let e = simd.mul_f32s(p, simd.transmute_f32s_u32s(scale));
    let e = simd.select_f32s_m32s(
        simd.less_than_f32s(x, simd.splat_f32s(MIN)),
        simd.splat_f32s(0.0),
        e,
    );
    // NaN is the one value not equal to itself.
    simd.select_f32s_m32s(simd.equal_f32s(x, x), e, x)
}

/// `Σ a_i²`, same order as [`dot`].
#[inline]
pub(crate) fn sum_squares(a: &[f32]) -> f32 {
    dot(a, a)
}

/// `out = w ⊙ x / sqrt(mean(x²) + eps)`.
#[inline]
pub(crate) fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let inv = 1.0 / (sum_squares(x) / x.len() as f32 + eps).sqrt();
    for ((o, &v), &w) in out.iter_mut().zip(x).zip(weight) {
        *o = w * (v * inv);
    }
}

/// `a · sigmoid(a)`.
#[inline]
pub(crate) fn silu(a: f32) -> f32 {
    a / (1.0 + (-a).exp())
}

/// `1 / (1 + e^-a)`.
#[inline]
pub(crate) fn sigmoid(a: f32) -> f32 {
    1.0 / (1.0 + (-a).exp())
}

/// `log(1 + e^a)`, the identity above 20 as in torch.
#[inline]
pub(crate) fn softplus(a: f32) -> f32 {
    if a > 20.0 {
        a
    } else {
        a.exp().ln_1p()
    }
}

/// `max(a, 0)²` in place.
#[inline]
pub(crate) fn relu2(values: &mut [f32]) {
    for v in values {
        let r = v.max(0.0);
        *v = r * r;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pulp::WithSimd;

    #[test]
    fn scalar_kernels() {
        assert_eq!(dot(&[1.0; 19], &[2.0; 19]), 38.0);
        assert_eq!(sum_squares(&[3.0, 4.0]), 25.0);
        assert_eq!(softplus(30.0), 30.0);
        assert!((softplus(0.0) - std::f32::consts::LN_2).abs() < 1e-7);
        assert_eq!(silu(0.0), 0.0);
        assert_eq!(sigmoid(0.0), 0.5);
        let mut v = [-2.0, 3.0];
        relu2(&mut v);
        assert_eq!(v, [0.0, 9.0]);
        let mut out = [0.0; 2];
        rms_norm(&[3.0, 4.0], &[1.0, 2.0], 0.0, &mut out);
        let inv = 1.0 / 12.5f32.sqrt();
        assert_eq!(out, [3.0 * inv, 2.0 * (4.0 * inv)]);
    }

    /// [`exp_simd`] of every value (padded to whole vectors with zeros).
    struct ExpAll<'a>(&'a [f32]);

    impl pulp::WithSimd for ExpAll<'_> {
        type Output = Vec<f32>;

        fn with_simd<S: pulp::Simd>(self, simd: S) -> Vec<f32> {
            let mut values = self.0.to_vec();
            values.resize(self.0.len().next_multiple_of(S::F32_LANES), 0.0);
            let (vectors, _) = S::as_mut_simd_f32s(&mut values);
            for v in vectors {
                *v = exp_simd(simd, *v);
            }
            values.truncate(self.0.len());
            values
        }
    }

    /// Distance in units in the last place between two positive floats.
    fn ulps(a: f32, b: f32) -> u32 {
        a.to_bits().abs_diff(b.to_bits())
    }

    #[test]
    fn vector_exp_is_within_one_ulp_and_exact_where_the_softmax_needs_it() {
        // Every 9,973rd float from -87.3 to 0 (112,000 values), then steps of 0.01 up to 88.
        let mut x: Vec<f32> = Vec::new();
        let mut bits = (-87.3f32).to_bits();
        while bits > 0x8000_0000 {
            x.push(f32::from_bits(bits));
            bits -= 9_973;
        }
        x.extend((0..=8800).map(|i| i as f32 / 100.0));
        let fast = pulp::Arch::new().dispatch(ExpAll(&x));
        // The same bits without vector instructions (the lanes never mix).
        assert_eq!(
            fast.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            ExpAll(&x)
                .with_simd(pulp::Scalar::new())
                .iter()
                .map(|v| v.to_bits())
                .collect::<Vec<_>>()
        );
        let worst = x
            .iter()
            .zip(&fast)
            .map(|(&x, &e)| ulps(e, (x as f64).exp() as f32))
            .max();
        assert_eq!(
            worst,
            Some(1),
            "largest error in ulps over {} values",
            x.len()
        );
        let special = [0.0, -0.0, f32::NEG_INFINITY, -87.34, -100.0, 1.0, f32::NAN];
        let got = pulp::Arch::new().dispatch(ExpAll(&special));
        assert_eq!(&got[..5], &[1.0, 1.0, 0.0, 0.0, 0.0]);
        assert_eq!(got[5], std::f32::consts::E);
        assert!(got[6].is_nan());
    }
}
