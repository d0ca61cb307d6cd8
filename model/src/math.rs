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
pub(crate) fn matmul(mm: &mut Matmul, x: &[f32], rows: usize, lin: &Linear, out: &mut [f32]) {
    gemm::matmul(
        &mm.kernels,
        x,
        rows,
        &lin.weight,
        lin.bias.as_deref(),
        &mut mm.tmp,
        out,
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

/// [`dot`] with explicit 8-lane vectors where the instruction set has them (AVX2: one register
/// holds the 8 lanes): the very same operations in the same order, so the same bits, without
/// relying on the compiler to keep the lanes apart (it interleaves them with shuffles otherwise).
#[inline(always)]
pub(crate) fn dot_simd<S: pulp::Simd>(simd: S, a: &[f32], b: &[f32]) -> f32 {
    if S::F32_LANES != LANES {
        return dot(a, b);
    }
    let (va, ta) = S::as_simd_f32s(a);
    let (vb, tb) = S::as_simd_f32s(b);
    let mut acc = simd.splat_f32s(0.0);
    for (&x, &y) in va.iter().zip(vb) {
        acc = simd.add_f32s(acc, simd.mul_f32s(x, y));
    }
    let mut lanes = [0.0f32; LANES];
    lanes.copy_from_slice(bytemuck::cast_slice::<S::f32s, f32>(std::slice::from_ref(
        &acc,
    )));
    let mut tail = 0.0f32;
    for (x, y) in ta.iter().zip(tb) {
        tail += x * y;
    }
    fold(lanes, tail)
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

    #[test]
    fn scalar_kernels() {
        assert_eq!(dot(&[1.0; 19], &[2.0; 19]), 38.0);
        // The explicit-vector form is the same function, bit for bit, on any lengths.
        let a: Vec<f32> = (0..37).map(|i| (i as f32 * 0.37).sin()).collect();
        let b: Vec<f32> = (0..37).map(|i| (i as f32 * 0.91).cos()).collect();
        struct Both<'a>(&'a [f32], &'a [f32]);
        impl pulp::WithSimd for Both<'_> {
            type Output = Vec<(u32, u32)>;
            fn with_simd<S: pulp::Simd>(self, simd: S) -> Self::Output {
                (0..=self.0.len())
                    .map(|n| {
                        let (x, y) = (&self.0[..n], &self.1[..n]);
                        (dot(x, y).to_bits(), dot_simd(simd, x, y).to_bits())
                    })
                    .collect()
            }
        }
        for (plain, simd) in pulp::Arch::new().dispatch(Both(&a, &b)) {
            assert_eq!(plain, simd);
        }
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
}
