//! Issue 18: the device forward on `SimRuntime` gives every position the same bits however the
//! work is cut: a sequence's logits at each position, computed as one whole-prompt prefill, as
//! a prefill continuing after a prefix of p tokens (block boundaries and not), as decode rows
//! alone, and as decode rows or prefill chunks in steps shared with other sequences (batches of
//! several sizes, prefill chunks next to decode rows), are bit-identical; with the attention
//! split into several blocks of keys and not. This is what makes the caches bit-transparent
//! (a prefix hit starts a prefill mid-prompt).

mod common;

use common::{DeviceForward, Shape};
use device_cuda::{DType, ForwardLimits, SimRuntime, StepRun};
use model::{Config, Model};

const BLOCK: usize = 4;
const BLOCKS_EACH: usize = 16;
const SLOTS: usize = 3;

/// One step's runs: (sequence, first position, length).
type Cut = Vec<Vec<(usize, usize, usize)>>;

fn tokens(seq: usize, from: usize, len: usize, vocab: usize) -> Vec<u32> {
    (from..from + len)
        .map(|i| ((i * 37 + seq * 101 + 11) % vocab) as u32)
        .collect()
}

/// The logits (as bits) of sequence 0's positions, in order, over the steps of `cut`.
fn run(model: &Model, split_keys: usize, cut: &Cut) -> Vec<u32> {
    let vocab = model.config().vocab_size;
    let blocks = SLOTS * BLOCKS_EACH;
    let dev = DeviceForward::new(
        SimRuntime::new().unwrap(),
        model,
        DType::F32,
        split_keys,
        Shape {
            blocks,
            block_size: BLOCK,
            slots: SLOTS,
            limits: ForwardLimits {
                max_rows: 64,
                max_runs: SLOTS,
                max_table: blocks,
            },
        },
    );
    // Interleaved tables: sequence s owns blocks s, s + SLOTS, ...
    let tables: Vec<Vec<u32>> = (0..SLOTS)
        .map(|s| (0..BLOCKS_EACH).map(|j| (j * SLOTS + s) as u32).collect())
        .collect();
    let mut out = Vec::new();
    for step in cut {
        let runs: Vec<StepRun<'_>> = step
            .iter()
            .map(|&(seq, start_pos, len)| StepRun {
                start_pos,
                len,
                slot: seq,
                blocks: &tables[seq],
                snapshots: &[],
            })
            .collect();
        let all: Vec<u32> = step
            .iter()
            .flat_map(|&(seq, from, len)| tokens(seq, from, len, vocab))
            .collect();
        let bytes = dev.step(&runs, &all);
        let bits: &[u32] = bytemuck::cast_slice(&bytes);
        let mut row = 0;
        for &(seq, _, len) in step {
            if seq == 0 {
                out.extend_from_slice(&bits[row * vocab..(row + len) * vocab]);
            }
            row += len;
        }
    }
    dev.free();
    out
}

#[test]
fn every_position_has_the_same_bits_however_the_work_is_cut() {
    let model = Model::random(Config::tiny_demo(), 7).unwrap();
    const LEN: usize = 44;
    let mut cuts: Vec<(String, Cut)> = Vec::new();
    for p in [1, 7, 16, 17, 33] {
        cuts.push((
            format!("prefix {p}"),
            vec![vec![(0, 0, p)], vec![(0, p, LEN - p)]],
        ));
    }
    let mut decode: Cut = vec![vec![(0, 0, 40)]];
    decode.extend((40..LEN).map(|i| vec![(0, i, 1)]));
    cuts.push(("decode rows alone".to_owned(), decode));
    cuts.push((
        "shared steps".to_owned(),
        vec![
            vec![(1, 0, 10), (0, 0, 20), (2, 0, 5)],
            vec![(0, 20, 20), (1, 10, 1)],
            vec![(2, 5, 1), (0, 40, 1), (1, 11, 1)],
            vec![(0, 41, 1)],
            vec![(1, 12, 1), (2, 6, 1), (0, 42, 1)],
            vec![(0, 43, 1), (2, 7, 13)],
        ],
    ));
    let mut failures = Vec::new();
    // 8: the width the tables allow is 16 keys (64 keys a run, 4 splits); 256: one split.
    for split_keys in [8, 256] {
        let whole = run(&model, split_keys, &vec![vec![(0, 0, LEN)]]);
        assert_eq!(whole.len(), LEN * model.config().vocab_size);
        for (name, cut) in &cuts {
            let got = run(&model, split_keys, cut);
            assert_eq!(got.len(), whole.len());
            let vocab = model.config().vocab_size;
            let differing: Vec<usize> = (0..LEN)
                .filter(|&i| got[i * vocab..(i + 1) * vocab] != whole[i * vocab..(i + 1) * vocab])
                .collect();
            if !differing.is_empty() {
                failures.push(format!(
                    "{name}, split {split_keys} keys: positions {differing:?}"
                ));
            }
        }
    }
    assert!(
        failures.is_empty(),
        "positions that differ from one whole prefill:\n{}",
        failures.join("\n")
    );
}
