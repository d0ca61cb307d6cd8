//! Numeric kernels with a fixed evaluation order: the matrix product (matrixmultiply's sgemm via
//! ndarray's safe wrapper), dot products and sums of squares in 8 fixed lanes, RMSNorm, and the
//! scalar activations.
//!
//! Invariant: every function here computes each output row from that row's inputs alone, in an
//! order that depends only on the vector lengths, never on how many rows are processed together.
//! For [`matmul`] this rests on matrixmultiply's structure: an output element is accumulated over
//! `k` in `kc`-sized blocks (a function of `k` only) by the same micro-kernel whatever the row count
//! or the row's place inside a tile; `tests/invariance.rs` checks it bit for bit.

use ndarray::linalg::general_mat_mul;
use ndarray::{ArrayView2, ArrayViewMut2};

use crate::weights::Linear;

/// `out[m, lin.out_dim] = x[m, lin.in_dim] · lin.weightᵀ (+ bias)`.
pub(crate) fn matmul(x: &[f32], rows: usize, lin: &Linear, out: &mut [f32]) {
    let (k, n) = (lin.in_dim, lin.out_dim);
    let out = &mut out[..rows * n];
    if rows == 0 {
        return;
    }
    // The shapes below are guaranteed by the caller's buffer sizing and `Weights::build`.
    let a = ArrayView2::from_shape((rows, k), &x[..rows * k]).expect("activation shape");
    let b = ArrayView2::from_shape((n, k), &lin.weight[..])
        .expect("weight shape")
        .reversed_axes();
    let mut c = ArrayViewMut2::from_shape((rows, n), &mut *out).expect("output shape");
    general_mat_mul(1.0, &a, &b, 0.0, &mut c);
    if let Some(bias) = &lin.bias {
        for row in out.chunks_exact_mut(n) {
            for (o, b) in row.iter_mut().zip(bias) {
                *o += b;
            }
        }
    }
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
