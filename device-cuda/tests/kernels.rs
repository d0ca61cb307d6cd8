//! Each kernel on `SimRuntime` against a host reference: odd sizes, one row, block boundaries,
//! ties, NaNs, masks, out-of-range ids. Float kernels are compared bit for bit with a host
//! reference that sums in the kernel's fixed order, and loosely with an f64 one.

use device_cuda::kernels::{self, BlockShape};
use device_cuda::{DType, DeviceBuffer, DeviceSlice, Gemm, Runtime, SimRuntime, Stream};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const S: Stream = Stream::Compute;

fn rt() -> SimRuntime {
    SimRuntime::new().unwrap()
}

fn upload_f32(rt: &dyn Runtime, values: &[f32]) -> DeviceBuffer {
    let buffer = rt.alloc(values.len() * 4).unwrap();
    rt.upload(buffer.all(), bytemuck::cast_slice(values), S)
        .unwrap();
    buffer
}

fn upload_u32(rt: &dyn Runtime, values: &[u32]) -> DeviceBuffer {
    let buffer = rt.alloc(values.len() * 4).unwrap();
    rt.upload(buffer.all(), bytemuck::cast_slice(values), S)
        .unwrap();
    buffer
}

fn upload_bytes(rt: &dyn Runtime, values: &[u8]) -> DeviceBuffer {
    let buffer = rt.alloc(values.len()).unwrap();
    rt.upload(buffer.all(), values, S).unwrap();
    buffer
}

fn download_f32(rt: &dyn Runtime, slice: DeviceSlice) -> Vec<f32> {
    let mut bytes = vec![0u8; slice.bytes()];
    rt.download(&mut bytes, slice, S).unwrap();
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

fn download_u32(rt: &dyn Runtime, slice: DeviceSlice) -> Vec<u32> {
    let mut bytes = vec![0u8; slice.bytes()];
    rt.download(&mut bytes, slice, S).unwrap();
    bytes
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

fn random(rng: &mut ChaCha8Rng, n: usize, scale: f32) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-scale..scale)).collect()
}

fn bf16_bits(values: &[f32]) -> Vec<u16> {
    values
        .iter()
        .map(|&v| half::bf16::from_f32(v).to_bits())
        .collect()
}

fn bf16_value(bits: u16) -> f32 {
    half::bf16::from_bits(bits).to_f32()
}

/// The kernel's sum of squares: thread t adds i = t, t+256, ...; each warp sums by xor butterfly
/// (offsets 16, 8, 4, 2, 1); the warp totals are added in order.
fn kernel_order_sum_squares(x: &[f32]) -> f32 {
    let threads = kernels::ROW_THREADS as usize;
    let mut lanes = vec![0.0f32; threads];
    for (t, lane) in lanes.iter_mut().enumerate() {
        let mut i = t;
        while i < x.len() {
            *lane += x[i] * x[i];
            i += threads;
        }
    }
    let mut total = 0.0f32;
    for warp in lanes.chunks(32) {
        let mut v = warp.to_vec();
        for offset in [16, 8, 4, 2, 1] {
            let before = v.clone();
            for (l, value) in v.iter_mut().enumerate() {
                *value = before[l] + before[l ^ offset];
            }
        }
        total += v[0];
    }
    total
}

fn check_rmsnorm(rows: usize, dim: usize, dtype: DType, seed: u64) {
    let rt = rt();
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let x = random(&mut rng, rows * dim, 3.0);
    let w = random(&mut rng, dim, 2.0);
    let eps = 1e-5f32;
    let (w_buf, w_host): (DeviceBuffer, Vec<f32>) = match dtype {
        DType::F32 => (upload_f32(&rt, &w), w.clone()),
        DType::Bf16 => {
            let bits = bf16_bits(&w);
            let buffer = upload_bytes(&rt, bytemuck::cast_slice(&bits));
            (buffer, bits.iter().map(|&b| bf16_value(b)).collect())
        }
    };
    let x_buf = upload_f32(&rt, &x);
    let out = rt.alloc(rows * dim * 4).unwrap();
    let norm_into = |out: DeviceSlice| {
        kernels::rmsnorm(&rt, S, out, x_buf.all(), w_buf.all(), dtype, rows, dim, eps).unwrap()
    };
    norm_into(out.all());
    let got = download_f32(&rt, out.all());
    for r in 0..rows {
        let row = &x[r * dim..(r + 1) * dim];
        let inv = 1.0 / (kernel_order_sum_squares(row) / dim as f32 + eps).sqrt();
        let exact: Vec<f32> = row
            .iter()
            .zip(&w_host)
            .map(|(&v, &w)| w * (v * inv))
            .collect();
        assert_eq!(
            got[r * dim..(r + 1) * dim],
            exact[..],
            "rmsnorm {dtype:?} rows {rows} dim {dim}: row {r} differs from the kernel-order reference"
        );
        let mean: f64 = row
            .iter()
            .map(|&v| f64::from(v) * f64::from(v))
            .sum::<f64>()
            / dim as f64;
        let inv64 = 1.0 / (mean + f64::from(eps)).sqrt();
        for (i, (&v, &w)) in row.iter().zip(&w_host).enumerate() {
            let want = f64::from(w) * f64::from(v) * inv64;
            let have = f64::from(got[r * dim + i]);
            assert!(
                (want - have).abs() <= 1e-5 * (1.0 + want.abs()),
                "row {r} col {i}: {have} vs {want}"
            );
        }
    }
    // In place gives the same bits.
    norm_into(x_buf.all());
    assert_eq!(download_f32(&rt, x_buf.all()), got);
}

#[test]
fn rmsnorm_matches_the_host_in_kernel_order() {
    for (rows, dim) in [
        (1, 1),
        (1, 31),
        (3, 32),
        (2, 255),
        (2, 256),
        (4, 257),
        (3, 1000),
        (1, 4096),
    ] {
        check_rmsnorm(rows, dim, DType::F32, rows as u64 * 7919 + dim as u64);
        check_rmsnorm(rows, dim, DType::Bf16, rows as u64 * 104729 + dim as u64);
    }
}

/// torch.argmax over allowed ids: the first maximum; NaN never wins; `u32::MAX` with no candidate.
fn host_argmax(row: &[f32], mask: Option<&[u8]>) -> u32 {
    let mut best: Option<usize> = None;
    for (i, &v) in row.iter().enumerate() {
        if mask.is_some_and(|m| m[i] == 0) || v.is_nan() {
            continue;
        }
        if best.is_none_or(|b| v > row[b]) {
            best = Some(i);
        }
    }
    best.map_or(u32::MAX, |b| b as u32)
}

fn check_argmax(logits: &[f32], rows: usize, vocab: usize, mask: Option<&[u8]>) {
    let rt = rt();
    let l = upload_f32(&rt, logits);
    let m = mask.map(|m| upload_bytes(&rt, m));
    let out = rt.alloc(rows * 4).unwrap();
    let feed = rt.alloc(rows * 4).unwrap();
    kernels::argmax(
        &rt,
        S,
        l.all(),
        m.as_ref().map(DeviceBuffer::all),
        rows,
        vocab,
        out.all(),
        Some(feed.all()),
    )
    .unwrap();
    let want: Vec<u32> = (0..rows)
        .map(|r| {
            host_argmax(
                &logits[r * vocab..(r + 1) * vocab],
                mask.map(|m| &m[r * vocab..(r + 1) * vocab]),
            )
        })
        .collect();
    assert_eq!(
        download_u32(&rt, out.all()),
        want,
        "rows {rows} vocab {vocab} masked {}",
        mask.is_some()
    );
    assert_eq!(download_u32(&rt, feed.all()), want, "feed cells");
}

#[test]
fn argmax_takes_the_first_maximum() {
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    for (rows, vocab) in [
        (1, 1),
        (1, 7),
        (3, 33),
        (2, 255),
        (2, 256),
        (2, 257),
        (5, 1000),
        (2, 4099),
    ] {
        let logits = random(&mut rng, rows * vocab, 10.0);
        check_argmax(&logits, rows, vocab, None);
    }
    // Ties: across a lane boundary, a warp boundary, the block's stride boundary, first and last.
    let vocab = 600;
    let mut logits = vec![0.5f32; 4 * vocab];
    for (row, ties) in [[3, 35], [31, 32], [255, 256], [0, 599]].iter().enumerate() {
        for &i in ties {
            logits[row * vocab + i] = 9.0;
        }
    }
    check_argmax(&logits, 4, vocab, None);
    // NaNs never win; a row of NaNs has no candidate.
    let mut nan = random(&mut rng, 2 * 300, 1.0);
    nan[0] = f32::NAN;
    nan[17] = 50.0;
    nan[18] = f32::NAN;
    for v in &mut nan[300..] {
        *v = f32::NAN;
    }
    check_argmax(&nan, 2, 300, None);
    // Negative values and -inf.
    let mut negative = vec![-1.0e30f32; 513];
    negative[0] = f32::NEG_INFINITY;
    negative[512] = -5.0;
    check_argmax(&negative, 1, 513, None);
}

#[test]
fn masked_argmax_takes_the_first_allowed_maximum() {
    let mut rng = ChaCha8Rng::seed_from_u64(2);
    for (rows, vocab) in [(1, 1), (3, 33), (2, 257), (4, 1000)] {
        let logits = random(&mut rng, rows * vocab, 10.0);
        let mut mask: Vec<u8> = (0..rows * vocab)
            .map(|_| u8::from(rng.random_bool(0.3)))
            .collect();
        // Row 0 allows nothing: no candidate.
        for m in &mut mask[..vocab] {
            *m = 0;
        }
        check_argmax(&logits, rows, vocab, Some(&mask));
        // Everything allowed equals the unmasked argmax.
        check_argmax(&logits, rows, vocab, Some(&vec![1u8; rows * vocab]));
    }
}

#[test]
fn feed_inputs_takes_feed_cells_or_host_tokens() {
    let rt = rt();
    let host = upload_u32(&rt, &[10, 11, 12, 13, 14]);
    let sources_i32: Vec<i32> = vec![-1, 2, 0, 7, -1];
    let sources = upload_bytes(&rt, bytemuck::cast_slice(&sources_i32));
    let feed = upload_u32(&rt, &[100, 101, 102]);
    let tokens = rt.alloc(5 * 4).unwrap();
    kernels::feed_inputs(
        &rt,
        S,
        tokens.all(),
        host.all(),
        sources.all(),
        feed.all(),
        5,
    )
    .unwrap();
    // Source 7 is past the 3 feed cells: u32::MAX, which no embedding row has.
    assert_eq!(
        download_u32(&rt, tokens.all()),
        vec![10, 102, 100, u32::MAX, 14]
    );
}

#[test]
fn embedding_gather_copies_rows_exactly() {
    let mut rng = ChaCha8Rng::seed_from_u64(3);
    for (vocab, hidden) in [(1, 1), (5, 255), (9, 256), (17, 257), (3, 1000)] {
        let rt = rt();
        let table = random(&mut rng, vocab * hidden, 1.0);
        let tokens: Vec<u32> = (0..7)
            .map(|i| {
                if i == 3 {
                    vocab as u32
                } else {
                    rng.random_range(0..vocab as u32)
                }
            })
            .collect();
        let t = upload_u32(&rt, &tokens);
        for dtype in [DType::F32, DType::Bf16] {
            let (table_buf, host): (DeviceBuffer, Vec<f32>) = match dtype {
                DType::F32 => (upload_f32(&rt, &table), table.clone()),
                DType::Bf16 => {
                    let bits = bf16_bits(&table);
                    (
                        upload_bytes(&rt, bytemuck::cast_slice(&bits)),
                        bits.iter().map(|&b| bf16_value(b)).collect(),
                    )
                }
            };
            let out = rt.alloc(tokens.len() * hidden * 4).unwrap();
            kernels::embedding_gather(
                &rt,
                S,
                out.all(),
                table_buf.all(),
                dtype,
                t.all(),
                tokens.len(),
                hidden,
                vocab,
            )
            .unwrap();
            let want: Vec<f32> = tokens
                .iter()
                .flat_map(|&tok| {
                    if (tok as usize) < vocab {
                        host[tok as usize * hidden..(tok as usize + 1) * hidden].to_vec()
                    } else {
                        vec![0.0; hidden]
                    }
                })
                .collect();
            let got = download_f32(&rt, out.all());
            assert_eq!(
                got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                want.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                "{dtype:?} vocab {vocab} hidden {hidden}"
            );
        }
    }
}

#[test]
fn gather_and_scatter_move_blocks_bit_for_bit() {
    let mut rng = ChaCha8Rng::seed_from_u64(4);
    for (pool_blocks, words) in [(1, 1), (5, 3), (8, 257), (4, 1024)] {
        let rt = rt();
        let pool: Vec<u32> = (0..pool_blocks * words).map(|_| rng.random()).collect();
        let pool_buf = upload_u32(&rt, &pool);
        let mut ids: Vec<u32> = (0..pool_blocks as u32).rev().collect();
        ids.push(pool_blocks as u32 + 3); // out of range: skipped
        let ids_buf = upload_u32(&rt, &ids);
        let shape = BlockShape {
            count: ids.len(),
            words,
            pool_blocks,
        };
        let staging = rt.alloc(ids.len() * words * 4).unwrap();
        rt.memset(staging.all(), 0xAB, S).unwrap();
        kernels::gather_blocks(&rt, S, staging.all(), pool_buf.all(), ids_buf.all(), shape)
            .unwrap();
        let got = download_u32(&rt, staging.all());
        for (i, &id) in ids.iter().enumerate() {
            let chunk = &got[i * words..(i + 1) * words];
            if (id as usize) < pool_blocks {
                assert_eq!(chunk, &pool[id as usize * words..(id as usize + 1) * words]);
            } else {
                assert!(
                    chunk.iter().all(|&w| w == 0xABAB_ABAB),
                    "an out-of-range id is skipped"
                );
            }
        }
        // Scatter the staged blocks into a fresh pool: the same pool comes back.
        let fresh = rt.alloc(pool_blocks * words * 4).unwrap();
        kernels::scatter_blocks(&rt, S, fresh.all(), staging.all(), ids_buf.all(), shape).unwrap();
        assert_eq!(download_u32(&rt, fresh.all()), pool);
    }
}

#[test]
fn f32_to_bf16_rounds_to_nearest_even() {
    let rt = rt();
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    let mut values = random(&mut rng, 1001, 100.0);
    values.extend([
        0.0,
        -0.0,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        1.0 + 1.0 / 256.0,
        1.0 + 3.0 / 256.0,
        f32::MAX,
    ]);
    let input = upload_f32(&rt, &values);
    let out = rt.alloc(values.len() * 2).unwrap();
    kernels::f32_to_bf16(&rt, S, out.all(), input.all(), values.len()).unwrap();
    let mut bytes = vec![0u8; values.len() * 2];
    rt.download(&mut bytes, out.all(), S).unwrap();
    let got: Vec<u16> = bytes
        .chunks_exact(2)
        .map(|c| u16::from_le_bytes([c[0], c[1]]))
        .collect();
    assert_eq!(got, bf16_bits(&values));
}

#[test]
fn gemm_matches_a_plain_product() {
    let mut rng = ChaCha8Rng::seed_from_u64(6);
    for (m, n, k) in [(1, 1, 1), (1, 33, 17), (3, 257, 64), (7, 5, 300)] {
        let rt = rt();
        let a = random(&mut rng, m * k, 1.0);
        let b = random(&mut rng, n * k, 1.0);
        for dtype in [DType::F32, DType::Bf16] {
            let (a_buf, b_buf, a_host, b_host) = match dtype {
                DType::F32 => (
                    upload_f32(&rt, &a),
                    upload_f32(&rt, &b),
                    a.clone(),
                    b.clone(),
                ),
                DType::Bf16 => {
                    let (ab, bb) = (bf16_bits(&a), bf16_bits(&b));
                    (
                        upload_bytes(&rt, bytemuck::cast_slice(&ab)),
                        upload_bytes(&rt, bytemuck::cast_slice(&bb)),
                        ab.iter().map(|&x| bf16_value(x)).collect::<Vec<_>>(),
                        bb.iter().map(|&x| bf16_value(x)).collect::<Vec<_>>(),
                    )
                }
            };
            let c = rt.alloc(m * n * 4).unwrap();
            rt.gemm(
                &Gemm {
                    m,
                    n,
                    k,
                    dtype,
                    a: a_buf.all(),
                    b: b_buf.all(),
                    c: c.all(),
                },
                S,
            )
            .unwrap();
            let got = download_f32(&rt, c.all());
            for i in 0..m {
                for j in 0..n {
                    let want: f64 = (0..k)
                        .map(|p| f64::from(a_host[i * k + p]) * f64::from(b_host[j * k + p]))
                        .sum();
                    let have = f64::from(got[i * n + j]);
                    assert!(
                        (want - have).abs() <= 1e-4 * (1.0 + want.abs()),
                        "{dtype:?} {m}x{n}x{k} [{i},{j}]: {have} vs {want}"
                    );
                }
            }
        }
    }
}

#[test]
fn launchers_refuse_mismatched_shapes() {
    let rt = rt();
    let small = rt.alloc(16).unwrap();
    let err = kernels::rmsnorm(
        &rt,
        S,
        small.all(),
        small.all(),
        small.all(),
        DType::F32,
        2,
        4,
        1e-5,
    )
    .unwrap_err();
    assert_eq!(
        err.to_string(),
        "bad memory range: rmsnorm_f32: out has 16 bytes, the shape needs 32"
    );
    let err = kernels::argmax(&rt, S, small.all(), None, 1, 4, small.all(), None).unwrap_err();
    assert_eq!(
        err.to_string(),
        "bad memory range: argmax_rows: out has 16 bytes, the shape needs 4"
    );
}
