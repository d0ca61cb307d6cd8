//! The forward kernels on `SimRuntime` against plain f64 references of the host model's math
//! (ARCH.md): the Mamba2 conv and SSM (chunked scan across chunk boundaries and the single step,
//! continuing from a non-zero state, with and without the dt clamp), paged attention (scattered
//! blocks, GQA, odd head sizes, split and unsplit), and the MoE router, dispatch, expert GEMMs
//! and combine (ties, group limits, padding). Odd sizes and one-row cases throughout.

use device_cuda::kernels::{
    self, AttentionIo, AttentionShape, AttentionWork, KvPool, MambaShape, MoeDispatch, MoeGemm,
    MoeRoute, SsmScan, StateSlots, StepRows,
};
use device_cuda::{DType, DeviceBuffer, DeviceSlice, Runtime, SimRuntime, Stream};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const S: Stream = Stream::Compute;

fn upload<T: bytemuck::Pod>(rt: &dyn Runtime, values: &[T]) -> DeviceBuffer {
    let bytes: &[u8] = bytemuck::cast_slice(values);
    let buffer = rt.alloc(bytes.len().max(4)).unwrap();
    if !bytes.is_empty() {
        rt.upload(buffer.range(0, bytes.len()).unwrap(), bytes, S)
            .unwrap();
    }
    buffer
}

fn download<T: bytemuck::Pod>(rt: &dyn Runtime, slice: DeviceSlice) -> Vec<T> {
    let mut bytes = vec![0u8; slice.bytes()];
    rt.download(&mut bytes, slice, S).unwrap();
    let size = std::mem::size_of::<T>();
    bytes
        .chunks_exact(size)
        .map(|c| bytemuck::pod_read_unaligned(c))
        .collect()
}

fn random(rng: &mut ChaCha8Rng, n: usize, scale: f32) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-scale..scale)).collect()
}

fn close(what: &str, got: &[f32], want: &[f64], tol: f64) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        assert!(
            (f64::from(g) - w).abs() <= tol * (1.0 + w.abs()),
            "{what}[{i}]: {g} vs {w}"
        );
    }
}

/// The step descriptor of `runs` (start position, length, slot, block table).
struct Step {
    bufs: Vec<DeviceBuffer>,
    step: StepRows,
}

fn step(rt: &dyn Runtime, runs: &[(usize, usize, usize, Vec<u32>)]) -> Step {
    let mut row_pos = Vec::new();
    let mut row_run = Vec::new();
    let mut words = Vec::new();
    let mut tables = Vec::new();
    for (i, (start, len, slot, table)) in runs.iter().enumerate() {
        words.extend([
            row_pos.len() as u32,
            *len as u32,
            *start as u32,
            *slot as u32,
            tables.len() as u32,
            table.len() as u32,
        ]);
        tables.extend_from_slice(table);
        for j in 0..*len {
            row_pos.push((start + j) as u32);
            row_run.push(i as u32);
        }
    }
    let rows = row_pos.len();
    let bufs = vec![
        upload(rt, &row_pos),
        upload(rt, &row_run),
        upload(rt, &words),
        upload(rt, &tables),
    ];
    let step = StepRows {
        row_pos: bufs[0].range(0, rows * 4).unwrap(),
        row_run: bufs[1].range(0, rows * 4).unwrap(),
        runs: bufs[2].range(0, words.len() * 4).unwrap(),
        tables: bufs[3].range(0, tables.len() * 4).unwrap(),
        rows,
        num_runs: runs.len(),
        snapshots: None,
    };
    Step { bufs, step }
}

fn silu(a: f64) -> f64 {
    a / (1.0 + (-a).exp())
}

fn softplus(a: f64) -> f64 {
    if a > 20.0 {
        a
    } else {
        a.exp().ln_1p()
    }
}

/// Conv then SSM of one Mamba layer over runs of 1, 2, 63, 64, 65 and 130 tokens (the scan's
/// chunk is 64 here) in one launch, from random conv history and state, against the per-token
/// recurrence in f64; then the gated norm. With the dt clamp biting and without, each with the
/// sequential (bit-exact) scan and the chunked one.
#[test]
fn mamba_conv_scan_step_and_gated_norm() {
    let cases = [
        (
            MambaShape {
                heads: 4,
                head_dim: 5,
                state: 7,
                groups: 2,
                conv_kernel: 4,
            },
            0.0f32,
        ),
        (
            MambaShape {
                heads: 3,
                head_dim: 9,
                state: 16,
                groups: 1,
                conv_kernel: 2,
            },
            0.3,
        ),
    ];
    let scans = [SsmScan::Sequential, SsmScan::Chunked];
    for ((shape, dt_min), scan) in cases
        .into_iter()
        .flat_map(|case| scans.map(|scan| (case, scan)))
    {
        let rt = SimRuntime::new().unwrap();
        let mut rng = ChaCha8Rng::seed_from_u64(11);
        let lens = [1usize, 2, 63, 64, 65, 130];
        let (h, p, n, g, k) = (
            shape.heads,
            shape.head_dim,
            shape.state,
            shape.groups,
            shape.conv_kernel,
        );
        let (inner, conv_dim, proj_dim) = (shape.inner(), shape.conv_dim(), shape.proj_dim());
        let layer_floats = shape.conv_floats() + shape.ssm_floats();
        // Two layers per slot; the tested one is the second. Slots in reverse run order.
        let slot_floats = 2 * layer_floats + 3;
        let slots = lens.len() + 1;
        let runs: Vec<(usize, usize, usize, Vec<u32>)> = lens
            .iter()
            .enumerate()
            .map(|(i, &len)| (10 + i, len, slots - 1 - i, Vec::new()))
            .collect();
        let st = step(&rt, &runs);
        let rows = st.step.rows;
        let proj = random(&mut rng, rows * proj_dim, 1.0);
        let mut states = random(&mut rng, slots * slot_floats, 0.5);
        let weight = random(&mut rng, conv_dim * k, 0.6);
        let bias = random(&mut rng, conv_dim, 0.2);
        let mut dt_bias = random(&mut rng, h, 1.0);
        // Head 0's dt often falls below the clamp of the second shape.
        dt_bias[0] = -1.5;
        let a: Vec<f32> = (0..h).map(|_| -rng.random_range(0.2f32..2.0)).collect();
        let d = random(&mut rng, h, 1.0);
        let norm_w = random(&mut rng, inner, 1.0);
        let b_proj = upload(&rt, &proj);
        let b_states = upload(&rt, &states);
        let b_weight = upload(&rt, &weight);
        let b_bias = upload(&rt, &bias);
        let b_params: Vec<DeviceBuffer> =
            [&dt_bias, &a, &d].iter().map(|v| upload(&rt, v)).collect();
        let b_norm = upload(&rt, &norm_w);
        let b_xbc = rt.alloc(rows * conv_dim * 4).unwrap();
        let b_y = rt.alloc(rows * inner * 4).unwrap();
        let slot_view = StateSlots {
            states: b_states.all(),
            num_slots: slots,
            slot_floats,
            layer_offset: layer_floats,
        };
        kernels::mamba_conv(
            &rt,
            S,
            &st.step,
            &slot_view,
            &shape,
            b_xbc.all(),
            b_proj.all(),
            b_weight.all(),
            Some(b_bias.all()),
        )
        .unwrap();
        kernels::mamba_ssm(
            &rt,
            S,
            &st.step,
            &lens,
            &slot_view,
            &shape,
            b_y.all(),
            b_xbc.all(),
            b_proj.all(),
            [b_params[0].all(), b_params[1].all(), b_params[2].all()],
            dt_min,
            scan,
        )
        .unwrap();
        let y_raw: Vec<f32> = download(&rt, b_y.all());
        kernels::mamba_gated_norm(
            &rt,
            S,
            &shape,
            b_y.all(),
            b_proj.all(),
            b_norm.all(),
            rows,
            1e-5,
        )
        .unwrap();
        let got_xbc: Vec<f32> = download(&rt, b_xbc.all());
        let got_y: Vec<f32> = download(&rt, b_y.all());
        let got_states: Vec<f32> = download(&rt, b_states.all());

        // Reference, run by run, token by token.
        let mut want_xbc = vec![0.0f64; rows * conv_dim];
        let mut want_raw = vec![0.0f64; rows * inner];
        let mut want_y = vec![0.0f64; rows * inner];
        let mut row = 0;
        for (_, len, slot, _) in &runs {
            let base = slot * slot_floats + layer_floats;
            let mut hist: Vec<Vec<f64>> = (0..k - 1)
                .map(|j| {
                    (0..conv_dim)
                        .map(|c| f64::from(states[base + j * conv_dim + c]))
                        .collect()
                })
                .collect();
            let ssm = base + shape.conv_floats();
            let mut s: Vec<f64> = states[ssm..ssm + inner * n]
                .iter()
                .map(|&v| f64::from(v))
                .collect();
            for _ in 0..*len {
                let u = &proj[row * proj_dim..(row + 1) * proj_dim];
                let x_in: Vec<f64> = (0..conv_dim).map(|c| f64::from(u[inner + c])).collect();
                let v: Vec<f64> = (0..conv_dim)
                    .map(|c| {
                        let mut acc = f64::from(bias[c]);
                        for j in 0..k - 1 {
                            acc += f64::from(weight[c * k + j]) * hist[j][c];
                        }
                        silu(acc + f64::from(weight[c * k + k - 1]) * x_in[c])
                    })
                    .collect();
                if k > 1 {
                    hist.remove(0);
                    hist.push(x_in);
                }
                want_xbc[row * conv_dim..(row + 1) * conv_dim].copy_from_slice(&v);
                for head in 0..h {
                    let grp = head / (h / g);
                    let dt = softplus(f64::from(u[inner + conv_dim + head] + dt_bias[head]))
                        .max(f64::from(dt_min));
                    let decay = (dt * f64::from(a[head])).exp();
                    for pp in 0..p {
                        let x = v[head * p + pp];
                        let mut y = 0.0;
                        for nn in 0..n {
                            let cell = &mut s[(head * p + pp) * n + nn];
                            *cell = *cell * decay + dt * v[inner + grp * n + nn] * x;
                            y += *cell * v[inner + g * n + grp * n + nn];
                        }
                        want_raw[row * inner + head * p + pp] = y + f64::from(d[head]) * x;
                    }
                }
                // Gated norm.
                let size = inner / g;
                for grp in 0..g {
                    let q: Vec<f64> = (0..size)
                        .map(|i| {
                            let c = grp * size + i;
                            want_raw[row * inner + c] * silu(f64::from(u[c]))
                        })
                        .collect();
                    let inv =
                        1.0 / (q.iter().map(|x| x * x).sum::<f64>() / size as f64 + 1e-5).sqrt();
                    for i in 0..size {
                        want_y[row * inner + grp * size + i] =
                            f64::from(norm_w[grp * size + i]) * q[i] * inv;
                    }
                }
                row += 1;
            }
            for j in 0..k - 1 {
                for c in 0..conv_dim {
                    states[base + j * conv_dim + c] = hist[j][c] as f32;
                }
            }
            for (i, &v) in s.iter().enumerate() {
                states[ssm + i] = v as f32;
            }
        }
        close("conv out", &got_xbc, &want_xbc, 1e-5);
        close("ssm y", &y_raw, &want_raw, 2e-4);
        close("gated norm", &got_y, &want_y, 2e-4);
        let want_states: Vec<f64> = states.iter().map(|&v| f64::from(v)).collect();
        close("states", &got_states, &want_states, 2e-4);
        drop(st.bufs);
    }
}

/// One Mamba layer's conv and SSM output (y before the gated norm, then the final state) for a
/// 70-token sequence cut into runs of `cut` tokens, each run its own step, from the same
/// random conv history and state.
fn mamba_cut(cut: &[usize], scan: SsmScan) -> (Vec<u32>, Vec<u32>) {
    let shape = MambaShape {
        heads: 3,
        head_dim: 9,
        state: 40,
        groups: 1,
        conv_kernel: 4,
    };
    let rt = SimRuntime::new().unwrap();
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    let total: usize = cut.iter().sum();
    let (h, inner, conv_dim, proj_dim) = (
        shape.heads,
        shape.inner(),
        shape.conv_dim(),
        shape.proj_dim(),
    );
    let slot_floats = shape.conv_floats() + shape.ssm_floats();
    let proj = random(&mut rng, total * proj_dim, 1.0);
    let states = random(&mut rng, slot_floats, 0.5);
    let weight = random(&mut rng, conv_dim * shape.conv_kernel, 0.6);
    let params: Vec<DeviceBuffer> = [
        random(&mut rng, h, 1.0),
        (0..h).map(|_| -rng.random_range(0.2f32..2.0)).collect(),
        random(&mut rng, h, 1.0),
    ]
    .iter()
    .map(|v| upload(&rt, v))
    .collect();
    let b_states = upload(&rt, &states);
    let b_weight = upload(&rt, &weight);
    let slots = StateSlots {
        states: b_states.all(),
        num_slots: 1,
        slot_floats,
        layer_offset: 0,
    };
    let mut y = Vec::new();
    let mut start = 0;
    for &len in cut {
        let st = step(&rt, &[(start, len, 0, Vec::new())]);
        let b_proj = upload(&rt, &proj[start * proj_dim..(start + len) * proj_dim]);
        let b_xbc = rt.alloc(len * conv_dim * 4).unwrap();
        let b_y = rt.alloc(len * inner * 4).unwrap();
        kernels::mamba_conv(
            &rt,
            S,
            &st.step,
            &slots,
            &shape,
            b_xbc.all(),
            b_proj.all(),
            b_weight.all(),
            None,
        )
        .unwrap();
        kernels::mamba_ssm(
            &rt,
            S,
            &st.step,
            &[len],
            &slots,
            &shape,
            b_y.all(),
            b_xbc.all(),
            b_proj.all(),
            [params[0].all(), params[1].all(), params[2].all()],
            0.0,
            scan,
        )
        .unwrap();
        let piece: Vec<f32> = download(&rt, b_y.all());
        y.extend(piece.iter().map(|v| v.to_bits()));
        start += len;
    }
    let state: Vec<f32> = download(&rt, b_states.all());
    (y, state.iter().map(|v| v.to_bits()).collect())
}

/// Issue 18: the default (sequential) scan gives every position the same bits however the
/// sequence is cut into runs: one prefill run, a prefix hit then the rest (inside a chunk of
/// the chunked scan and across its 64-token boundary), decode rows between prefill runs, all
/// decode rows. (The chunked scan fails this: its chunks start at each run's start.)
#[test]
fn mamba_scan_is_bit_identical_however_the_sequence_is_cut() {
    let whole = mamba_cut(&[70], SsmScan::Sequential);
    let cuts: [&[usize]; 4] = [&[16, 54], &[1, 1, 65, 3], &[33, 1, 36], &[1; 70]];
    for cut in cuts {
        let got = mamba_cut(cut, SsmScan::Sequential);
        assert!(got.0 == whole.0, "y differs for runs {cut:?}");
        assert!(got.1 == whole.1, "final state differs for runs {cut:?}");
    }
}

/// Which attention launcher a case runs.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Path {
    /// `kernels::attention`: every row by the split kernel.
    Split,
    /// `kernels::attention_tiled`: prefill runs in query tiles, decode rows by the split kernel.
    Tiled,
}

/// One attention case: writes the runs' K/V into a random pool (block size `block_size`, 6 query
/// heads on 2 KV heads of `head_dim`, the layer second of two in each block), attends with
/// `path`, and checks the pool after the write exactly and the output against softmax in f64.
fn check_attention(
    head_dim: usize,
    block_size: usize,
    runs: &[(usize, usize, usize, Vec<u32>)],
    split_keys: usize,
    path: Path,
) {
    let rt = SimRuntime::new().unwrap();
    let mut rng = ChaCha8Rng::seed_from_u64(5 + head_dim as u64 + block_size as u64);
    let shape = AttentionShape {
        heads: 6,
        kv_heads: 2,
        head_dim,
    };
    let layers = 2usize;
    let num_blocks = runs
        .iter()
        .flat_map(|r| r.3.iter())
        .max()
        .map_or(1, |&b| b as usize + 1);
    let layer_floats = 2 * block_size * 2 * head_dim;
    let block_floats = layers * layer_floats;
    let mut pool = random(&mut rng, num_blocks * block_floats, 1.0);
    let st = step(&rt, runs);
    let rows = st.step.rows;
    let qkv_dim = shape.qkv_dim();
    let qkv = random(&mut rng, rows * qkv_dim, 1.0);
    let b_pool = upload(&rt, &pool);
    let b_qkv = upload(&rt, &qkv);
    let view = KvPool {
        kv: b_pool.all(),
        num_blocks,
        block_size,
        block_floats,
        layer_offset: layer_floats,
    };
    let longest = runs.iter().map(|r| r.0 + r.1).max().unwrap();
    let splits = longest.div_ceil(split_keys);
    let b_partial = rt
        .alloc(rows * shape.heads * splits * (head_dim + 2) * 4)
        .unwrap();
    let b_out = rt.alloc(rows * shape.heads * head_dim * 4).unwrap();
    kernels::kv_write(&rt, S, &st.step, &view, &shape, b_qkv.all()).unwrap();
    let mut plan_bufs = Vec::new();
    let io = AttentionIo {
        qkv: b_qkv.all(),
        partial: b_partial.all(),
        out: b_out.all(),
        splits,
        split_keys: split_keys.min(longest),
    };
    match path {
        Path::Split => kernels::attention(&rt, S, &st.step, &view, &shape, &io).unwrap(),
        Path::Tiled => {
            let tile_rows = kernels::attention_tile_rows(head_dim);
            let lens: Vec<usize> = runs.iter().map(|r| r.1).collect();
            let (tiles, singles) = kernels::attention_plan(&lens, tile_rows, true);
            assert_eq!(
                tiles.chunks(2).map(|t| t[1] as usize).sum::<usize>() + singles.len(),
                rows,
                "the plan names every row once"
            );
            let b_tiles = upload(&rt, &tiles);
            let b_singles = upload(&rt, &singles);
            let work = AttentionWork {
                tiles: b_tiles.range(0, tiles.len() * 4).unwrap(),
                num_tiles: tiles.len() / 2,
                tile_rows,
                singles: b_singles.range(0, singles.len() * 4).unwrap(),
                num_singles: singles.len(),
            };
            kernels::attention_tiled(&rt, S, &st.step, &work, &view, &shape, &io).unwrap();
            plan_bufs.extend([b_tiles, b_singles]);
        }
    }
    let got_pool: Vec<f32> = download(&rt, b_pool.all());
    let got: Vec<f32> = download(&rt, b_out.all());
    // Reference: write K/V, then attend.
    let key_at = |table: &[u32], pos: usize, kvh: usize| {
        table[pos / block_size] as usize * block_floats
            + layer_floats
            + ((pos % block_size) * 2 + kvh) * head_dim
    };
    let kv_off = shape.heads * head_dim;
    let mut row = 0;
    for (start, len, _, table) in runs {
        for j in 0..*len {
            for kvh in 0..2 {
                let at = key_at(table, start + j, kvh);
                for c in 0..head_dim {
                    pool[at + c] = qkv[row * qkv_dim + kv_off + kvh * head_dim + c];
                    pool[at + block_size * 2 * head_dim + c] =
                        qkv[row * qkv_dim + kv_off + 2 * head_dim + kvh * head_dim + c];
                }
            }
            row += 1;
        }
    }
    assert_eq!(got_pool, pool, "the pool after the K/V write");
    let mut want = vec![0.0f64; rows * shape.heads * head_dim];
    let scale = 1.0 / (head_dim as f64).sqrt();
    row = 0;
    for (start, len, _, table) in runs {
        for j in 0..*len {
            let pos = start + j;
            for head in 0..shape.heads {
                let kvh = head / 3;
                let q = &qkv[row * qkv_dim + head * head_dim..][..head_dim];
                let scores: Vec<f64> = (0..=pos)
                    .map(|s| {
                        let at = key_at(table, s, kvh);
                        (0..head_dim)
                            .map(|c| f64::from(q[c]) * f64::from(pool[at + c]))
                            .sum::<f64>()
                            * scale
                    })
                    .collect();
                let top = scores.iter().copied().fold(f64::MIN, f64::max);
                let sum: f64 = scores.iter().map(|s| (s - top).exp()).sum();
                for c in 0..head_dim {
                    want[(row * shape.heads + head) * head_dim + c] = (0..=pos)
                        .map(|s| {
                            let at = key_at(table, s, kvh) + block_size * 2 * head_dim;
                            (scores[s] - top).exp() / sum * f64::from(pool[at + c])
                        })
                        .sum();
                }
            }
            row += 1;
        }
    }
    let what = format!("attention {path:?} head_dim {head_dim} split {split_keys}");
    let worst = got
        .iter()
        .zip(&want)
        .map(|(&g, &w)| (f64::from(g) - w).abs() / (1.0 + w.abs()))
        .fold(0.0, f64::max);
    eprintln!("{what}: max |got - f64| / (1 + |f64|) = {worst:.3e}");
    // The tolerance: a score is an f32 dot of head_dim ≤ 256 products, rounded at each add
    // (about √head_dim · 2⁻²⁴ ≈ 1e-6 of the score's size ≤ √head_dim when the errors add like a
    // random walk), and exp turns an absolute score error into the same relative error of its
    // weight; the output, a convex combination of values < 1, carries that and one more rounding
    // per key. 1e-5 covers it with room; measured worst (printed above): 1.6e-7 at head_dim 256.
    close(&what, &got, &want, 1e-5);
    drop(st.bufs);
}

/// Attention over a paged pool: GQA (6 query heads on 2 KV heads), head sizes 10 and 40,
/// scattered blocks of 3 tokens, runs starting after earlier positions, a single row, and
/// splits of 4 keys or none; against softmax in f64; both launchers.
#[test]
fn paged_attention_split_and_unsplit() {
    // (start, len, slot, table): a prefill after 4 cached positions, a one-token decode at
    // position 13, a first chunk of 5.
    let runs = vec![
        (4usize, 6usize, 0usize, vec![7u32, 2, 11, 5]),
        (13, 1, 1, vec![19, 0, 3, 8, 14]),
        (0, 5, 2, vec![1, 9]),
    ];
    for path in [Path::Split, Path::Tiled] {
        for (head_dim, split_keys) in [(10usize, 4usize), (40, 1000), (40, 4)] {
            check_attention(head_dim, 3, &runs, split_keys, path);
        }
    }
}

/// The tiled (flash-style) prefill attention across its tile boundaries: a chunk of 40 rows
/// after 37 cached positions (query tiles of 16, 16 and 8; key tiles of 32 straddling the cache
/// boundary and the blocks of 5), a first chunk of 17 (one row past a tile), a two-row run, a
/// decode row at position 90 (the split kernel's row list); splits of 24 keys (not a multiple
/// of the key tile), of 7 and none; head sizes 40, 128 and 256 (tiles of 8 rows).
#[test]
fn tiled_prefill_attention_across_tiles_and_splits() {
    let table = |first: u32, n: u32| (0..n).map(|i| (first + 7 * i) % 61).collect::<Vec<u32>>();
    let runs = vec![
        (37usize, 40usize, 0usize, table(3, 16)),
        (0, 17, 1, table(4, 4)),
        (90, 1, 2, table(5, 19)),
        (11, 2, 3, table(6, 3)),
    ];
    assert_eq!(kernels::attention_tile_rows(128), 16);
    assert_eq!(kernels::attention_tile_rows(256), 8);
    for (head_dim, split_keys) in [(40usize, 24usize), (40, 7), (128, 1000), (256, 24)] {
        check_attention(head_dim, 5, &runs, split_keys, Path::Tiled);
    }
}

/// ARCH.md §6.1 in f64: sigmoid, corrected scores, group scores (two best), kept groups, top k
/// by corrected score (first index on ties), weights from the plain sigmoid, normalised, scaled.
fn route_reference(
    logits: &[f32],
    bias: &[f32],
    groups: usize,
    topk_groups: usize,
    k: usize,
    scale: f64,
) -> Vec<(usize, f64)> {
    let e = logits.len();
    let per = e / groups;
    let s: Vec<f32> = logits.iter().map(|&l| 1.0 / (1.0 + (-l).exp())).collect();
    let corrected: Vec<f32> = s.iter().zip(bias).map(|(a, b)| a + b).collect();
    let first_max = |values: &mut dyn Iterator<Item = f32>| {
        let mut best: Option<(usize, f32)> = None;
        for (i, v) in values.enumerate() {
            if best.is_none_or(|(_, b)| v > b) {
                best = Some((i, v));
            }
        }
        best.unwrap().0
    };
    let group_score = |grp: usize| {
        let c = &corrected[grp * per..(grp + 1) * per];
        let top = first_max(&mut c.iter().copied());
        let second =
            first_max(
                &mut c
                    .iter()
                    .enumerate()
                    .map(|(i, &v)| if i == top { f32::NEG_INFINITY } else { v }),
            );
        c[top] + c[second]
    };
    let mut kept = vec![false; groups];
    for _ in 0..topk_groups {
        let best = first_max(&mut (0..groups).map(|grp| {
            if kept[grp] {
                f32::NEG_INFINITY
            } else {
                group_score(grp)
            }
        }));
        kept[best] = true;
    }
    let mut chosen: Vec<usize> = Vec::new();
    for _ in 0..k {
        let best = first_max(&mut (0..e).map(|x| {
            if chosen.contains(&x) || !kept[x / per] {
                f32::NEG_INFINITY
            } else {
                corrected[x]
            }
        }));
        chosen.push(best);
    }
    let total: f64 = chosen.iter().map(|&c| f64::from(s[c])).sum();
    chosen
        .iter()
        .map(|&c| (c, f64::from(s[c]) / (total + 1e-20) * scale))
        .collect()
}

/// The router, the dispatch and the expert GEMMs with their combine, for 1 and 37 tokens over 12
/// experts in 3 groups (keep 2, top 3), with exact ties in the logits and a correction bias that
/// changes the choices; the routed output against a direct f64 evaluation, f32 and bf16 weights.
#[test]
fn moe_route_dispatch_experts_combine() {
    for (tokens, dtype) in [(1usize, DType::F32), (37, DType::F32), (37, DType::Bf16)] {
        let rt = SimRuntime::new().unwrap();
        let mut rng = ChaCha8Rng::seed_from_u64(tokens as u64);
        let (e, groups, topk_groups, k) = (12usize, 3usize, 2usize, 3usize);
        let (dim, inter) = (70usize, 33usize);
        let route = MoeRoute {
            experts: e,
            groups,
            topk_groups,
            k,
            normalize: true,
            scale: 2.5,
        };
        // Logits on a coarse grid so that exact ties happen.
        let logits: Vec<f32> = (0..tokens * e)
            .map(|_| f32::from(rng.random_range(-4i8..4)) * 0.5)
            .collect();
        let mut bias = vec![0.0f32; e];
        bias[5] = 0.3;
        bias[9] = -0.2;
        let x = random(&mut rng, tokens * dim, 1.0);
        let mut up = random(&mut rng, e * inter * dim, 0.3);
        let mut down = random(&mut rng, e * dim * inter, 0.3);
        let bf16 = |v: &mut Vec<f32>| {
            for x in v.iter_mut() {
                *x = half::bf16::from_f32(*x).to_f32();
            }
        };
        let as_bytes = |v: &[f32]| -> Vec<u8> {
            match dtype {
                DType::F32 => bytemuck::cast_slice(v).to_vec(),
                DType::Bf16 => v
                    .iter()
                    .flat_map(|&x| half::bf16::from_f32(x).to_bits().to_le_bytes())
                    .collect(),
            }
        };
        if dtype == DType::Bf16 {
            bf16(&mut up);
            bf16(&mut down);
        }
        let b_logits = upload(&rt, &logits);
        let b_bias = upload(&rt, &bias);
        let b_x = upload(&rt, &x);
        let b_up = upload(&rt, &as_bytes(&up));
        let b_down = upload(&rt, &as_bytes(&down));
        let b_choice = rt.alloc(tokens * k * 4).unwrap();
        let b_weight = rt.alloc(tokens * k * 4).unwrap();
        kernels::moe_route(
            &rt,
            S,
            &route,
            b_choice.all(),
            b_weight.all(),
            b_logits.all(),
            b_bias.all(),
            tokens,
        )
        .unwrap();
        let choice: Vec<u32> = download(&rt, b_choice.all());
        let weight: Vec<f32> = download(&rt, b_weight.all());
        let mut reference = Vec::new();
        for t in 0..tokens {
            let want = route_reference(
                &logits[t * e..(t + 1) * e],
                &bias,
                groups,
                topk_groups,
                k,
                2.5,
            );
            for (j, &(expert, w)) in want.iter().enumerate() {
                assert_eq!(choice[t * k + j] as usize, expert, "token {t} choice {j}");
                assert!((f64::from(weight[t * k + j]) - w).abs() < 1e-6);
            }
            reference.push(want);
        }
        let pad_cap = MoeDispatch::pad_cap(tokens, k, e);
        let bufs: Vec<DeviceBuffer> = [e, pad_cap, pad_cap / kernels::MOE_TILE_ROWS, tokens * k]
            .iter()
            .map(|&n| rt.alloc(n * 4).unwrap())
            .collect();
        let dispatch = MoeDispatch {
            counts: bufs[0].all(),
            sorted: bufs[1].all(),
            tile_expert: bufs[2].all(),
            assign_pos: bufs[3].all(),
            pad_cap,
        };
        kernels::moe_dispatch(&rt, S, &dispatch, b_choice.all(), tokens, k, e).unwrap();
        let b_act = rt.alloc(pad_cap * inter * 4).unwrap();
        let b_eout = rt.alloc(pad_cap * dim * 4).unwrap();
        let b_out = rt.alloc(tokens * dim * 4).unwrap();
        let gemm = |out: DeviceSlice, xs: DeviceSlice, w: DeviceSlice, shape: MoeGemm| {
            kernels::moe_gemm(&rt, S, &dispatch, &shape, out, xs, w, dtype, None).unwrap();
        };
        gemm(
            b_act.all(),
            b_x.all(),
            b_up.all(),
            MoeGemm {
                experts: e,
                k,
                x_rows: tokens,
                in_dim: dim,
                out_dim: inter,
                gather: true,
                relu2: true,
            },
        );
        gemm(
            b_eout.all(),
            b_act.all(),
            b_down.all(),
            MoeGemm {
                experts: e,
                k,
                x_rows: pad_cap,
                in_dim: inter,
                out_dim: dim,
                gather: false,
                relu2: false,
            },
        );
        kernels::moe_combine(
            &rt,
            S,
            &dispatch,
            b_out.all(),
            b_eout.all(),
            b_choice.all(),
            b_weight.all(),
            tokens,
            k,
            dim,
        )
        .unwrap();
        // Dispatch: every expert's assignments in token order, padded to whole tiles.
        let counts: Vec<u32> = download(&rt, bufs[0].all());
        let sorted: Vec<u32> = download(&rt, bufs[1].all());
        let mut at = 0;
        for (expert, &count) in counts.iter().enumerate() {
            let mine: Vec<u32> = (0..(tokens * k) as u32)
                .filter(|&a| choice[a as usize] as usize == expert)
                .collect();
            assert_eq!(count as usize, mine.len());
            assert_eq!(&sorted[at..at + mine.len()], &mine[..]);
            let padded = mine.len().div_ceil(kernels::MOE_TILE_ROWS) * kernels::MOE_TILE_ROWS;
            assert!(sorted[at + mine.len()..at + padded]
                .iter()
                .all(|&s| s == u32::MAX));
            at += padded;
        }
        let got: Vec<f32> = download(&rt, b_out.all());
        let mut want = vec![0.0f64; tokens * dim];
        for t in 0..tokens {
            for &(expert, w) in &reference[t] {
                let xin: Vec<f64> = x[t * dim..(t + 1) * dim]
                    .iter()
                    .map(|&v| f64::from(v))
                    .collect();
                let act: Vec<f64> = (0..inter)
                    .map(|i| {
                        let dot: f64 = (0..dim)
                            .map(|c| f64::from(up[(expert * inter + i) * dim + c]) * xin[c])
                            .sum();
                        dot.max(0.0).powi(2)
                    })
                    .collect();
                for c in 0..dim {
                    let dot: f64 = (0..inter)
                        .map(|i| f64::from(down[(expert * dim + c) * inter + i]) * act[i])
                        .sum();
                    want[t * dim + c] += w * dot;
                }
            }
        }
        close("routed output", &got, &want, 1e-4);
    }
}
