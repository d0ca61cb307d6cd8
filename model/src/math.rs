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

/// `out[m, lin.out_dim] = x[m, lin.in_dim] · W[out, in]ᵀ (+ bias)`, with `W` stored transposed.
pub(crate) fn matmul(x: &[f32], rows: usize, lin: &Linear, out: &mut [f32]) {
    let (k, n) = (lin.in_dim, lin.out_dim);
    let out = &mut out[..rows * n];
    if rows == 0 {
        return;
    }
    // The shapes below are guaranteed by the caller's buffer sizing and `Weights::build`.
    let a = ArrayView2::from_shape((rows, k), &x[..rows * k]).expect("activation shape");
    let b = ArrayView2::from_shape((k, n), &lin.weight_t[..]).expect("weight shape");
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

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    fn random(n: usize, rng: &mut rand_chacha::ChaCha8Rng) -> Vec<f32> {
        (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect()
    }

    /// One row's product has the same bits alone and at any place in a batch of any size. The
    /// shapes cross matrixmultiply's tile sizes (8 or 16 rows, 8 or 16 columns) and its 256-deep
    /// k-blocking, and the bias path.
    #[test]
    fn matmul_row_bits_do_not_depend_on_batch() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
        for &(k, n) in &[(64, 196), (300, 70), (17, 9)] {
            let weight = random(n * k, &mut rng);
            let lin = Linear::from_rows(&weight, Some(random(n, &mut rng)), n, k);
            let batch = 70;
            let x = random(batch * k, &mut rng);
            let mut all = vec![0.0; batch * n];
            matmul(&x, batch, &lin, &mut all);
            for &rows in &[1usize, 2, 7, 8, 9, 16, 17, 33, 70] {
                let mut part = vec![0.0; rows * n];
                for start in [0, batch - rows] {
                    matmul(&x[start * k..], rows, &lin, &mut part);
                    for r in 0..rows {
                        let ours = &part[r * n..(r + 1) * n];
                        let full = &all[(start + r) * n..(start + r + 1) * n];
                        assert!(
                            ours.iter()
                                .zip(full)
                                .all(|(a, b)| a.to_bits() == b.to_bits()),
                            "k={k} n={n}: row {} differs in a batch of {rows}",
                            start + r
                        );
                    }
                }
            }
            // And it is the right product (sgemm vs a plain f64 dot, loosely).
            for r in [0, batch - 1] {
                for o in [0, n - 1] {
                    let exact: f64 = (0..k)
                        .map(|i| f64::from(x[r * k + i]) * f64::from(weight[o * k + i]))
                        .sum::<f64>()
                        + f64::from(lin.bias.as_ref().unwrap()[o]);
                    assert!((f64::from(all[r * n + o]) - exact).abs() < 1e-4);
                }
            }
        }
    }

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
}
