//! Bit-for-bit invariance of a row's logits and state: alone or inside a decode batch of 7,
//! whatever the prefill chunking (one chunk, chunks of 1, 16 or 33, token-by-token decode), and
//! whatever the number of threads the forward pass runs on (1, 2 or 3).

mod common;

use common::{bits, tiny};
use model::{Config, DecodeRow, KvPool, MambaStates, Model, PrefillRow, Scratch};

const BLOCK_SIZE: usize = 16;

/// Deterministic pseudo-random prompt (a simple LCG is enough for token ids).
fn prompt(len: usize, seed: u32, vocab: usize) -> Vec<u32> {
    let mut x = seed.wrapping_mul(2_654_435_761).wrapping_add(12345);
    (0..len)
        .map(|_| {
            x = x.wrapping_mul(1_103_515_245).wrapping_add(12345);
            (x >> 8) % vocab as u32
        })
        .collect()
}

/// Thread counts the checks cycle through (1 is the reference every other count must match).
const THREADS: [usize; 3] = [1, 2, 3];

fn scratch_on(model: &Model, threads: usize) -> Scratch {
    Scratch::with_threads(model.config(), threads).unwrap()
}

/// Prefills `tokens` in chunks of `chunk` tokens (one call per chunk) on `threads` threads,
/// returning every position's logits.
#[allow(clippy::too_many_arguments)] // a test helper; a struct would only rename the arguments
fn prefill_chunked(
    model: &Model,
    kv: &mut KvPool,
    states: &mut MambaStates,
    tokens: &[u32],
    chunk: usize,
    table: &[u32],
    slot: usize,
    threads: usize,
) -> Vec<f32> {
    let mut scratch = scratch_on(model, threads);
    let mut all = Vec::new();
    let mut logits = Vec::new();
    for (i, piece) in tokens.chunks(chunk).enumerate() {
        let row = PrefillRow {
            tokens: piece,
            start_pos: i * chunk,
            blocks: table,
            slot,
        };
        model
            .prefill(&mut scratch, kv, states, row, true, &mut logits)
            .unwrap();
        all.extend_from_slice(&logits);
    }
    all
}

fn check_chunk_invariance(model: &Model, len: usize, chunks: &[usize]) {
    let config = model.config();
    let tokens = prompt(len, 5, config.vocab_size);
    let num_blocks = len.div_ceil(BLOCK_SIZE);
    let table: Vec<u32> = (0..num_blocks as u32).collect();
    let run = |chunk: usize, threads: usize| {
        let mut kv = KvPool::new(config, num_blocks, BLOCK_SIZE).unwrap();
        let mut states = MambaStates::new(config, 1).unwrap();
        let logits = prefill_chunked(
            model,
            &mut kv,
            &mut states,
            &tokens,
            chunk,
            &table,
            0,
            threads,
        );
        let mut kv_floats = Vec::new();
        for &b in &table {
            kv.export_block(b, &mut kv_floats).unwrap();
        }
        (
            bits(&logits),
            bits(states.slot(0).unwrap()),
            bits(&kv_floats),
        )
    };
    let whole = run(len, 1);
    assert_eq!(whole.0.len(), len * config.vocab_size);
    // Each chunking on the next thread count in turn, and the whole prompt on the other counts.
    let cases = chunks
        .iter()
        .enumerate()
        .map(|(i, &chunk)| (chunk, THREADS[(i + 1) % THREADS.len()]))
        .chain(THREADS[1..].iter().map(|&threads| (len, threads)));
    for (chunk, threads) in cases {
        let chunked = run(chunk, threads);
        assert!(
            whole.0 == chunked.0,
            "logits differ with chunks of {chunk} on {threads} threads"
        );
        assert!(
            whole.1 == chunked.1,
            "Mamba state differs with chunks of {chunk} on {threads} threads"
        );
        assert!(
            whole.2 == chunked.2,
            "KV differs with chunks of {chunk} on {threads} threads"
        );
    }

    // Token-by-token decode (on 3 threads) computes the very same bits as prefill.
    let mut kv = KvPool::new(config, num_blocks, BLOCK_SIZE).unwrap();
    let mut states = MambaStates::new(config, 1).unwrap();
    let mut scratch = scratch_on(model, 3);
    let mut decoded = Vec::new();
    let mut logits = Vec::new();
    for (pos, &token) in tokens.iter().enumerate() {
        let row = DecodeRow {
            token,
            pos,
            blocks: &table,
            slot: 0,
        };
        model
            .decode(&mut scratch, &mut kv, &mut states, &[row], &mut logits)
            .unwrap();
        decoded.extend_from_slice(&logits);
    }
    assert!(whole.0 == bits(&decoded), "decode differs from prefill");
    assert!(whole.1 == bits(states.slot(0).unwrap()));
}

#[test]
fn prefill_chunking_does_not_change_bits() {
    check_chunk_invariance(&tiny(), 100, &[1, 16, 33]);
}

#[test]
fn long_prefill_split_internally_does_not_change_bits() {
    // 150 tokens cross the 128-row internal split of one prefill call.
    check_chunk_invariance(&tiny(), 150, &[16, 128, 149]);
}

/// Seven sequences with different histories; row `probe` decoded alone on one thread and inside
/// the batch on 2 or 3 threads.
fn check_batch_invariance(model: &Model) {
    let config = model.config();
    let lengths = [3usize, 17, 1, 40, 9, 25, 16];
    let steps = 3usize;
    let blocks_per_seq = (40 + steps).div_ceil(BLOCK_SIZE);
    let mut kv = KvPool::new(config, lengths.len() * blocks_per_seq, BLOCK_SIZE).unwrap();
    let mut states = MambaStates::new(config, lengths.len()).unwrap();
    let tables: Vec<Vec<u32>> = (0..lengths.len())
        .map(|s| ((s * blocks_per_seq) as u32..((s + 1) * blocks_per_seq) as u32).collect())
        .collect();
    let mut scratch = Scratch::new(config);
    let mut logits = Vec::new();
    let mut next = Vec::new();
    for (s, &len) in lengths.iter().enumerate() {
        let tokens = prompt(len, s as u32 + 1, config.vocab_size);
        let row = PrefillRow {
            tokens: &tokens,
            start_pos: 0,
            blocks: &tables[s],
            slot: s,
        };
        model
            .prefill(&mut scratch, &mut kv, &mut states, row, false, &mut logits)
            .unwrap();
        next.push(model::parity::argmax(&logits));
    }
    let vocab = config.vocab_size;
    let mut alone_scratch = scratch_on(model, 1);
    for (probe, threads) in [(0usize, 2), (3, 3), (6, 2)] {
        let mut scratch = scratch_on(model, threads);
        let (mut kv_alone, mut states_alone) = (kv.clone(), states.clone());
        let (mut kv_batch, mut states_batch) = (kv.clone(), states.clone());
        let mut tokens = next.clone();
        let mut token_alone = next[probe];
        for step in 0..steps {
            let row = |s: usize, token: u32| DecodeRow {
                token,
                pos: lengths[s] + step,
                blocks: &tables[s],
                slot: s,
            };
            let mut alone = Vec::new();
            model
                .decode(
                    &mut alone_scratch,
                    &mut kv_alone,
                    &mut states_alone,
                    &[row(probe, token_alone)],
                    &mut alone,
                )
                .unwrap();
            // The batch lists the rows in a rotated order so the probe is not always first.
            let order: Vec<usize> = (0..lengths.len())
                .map(|i| (i + 4) % lengths.len())
                .collect();
            let rows: Vec<DecodeRow<'_>> = order.iter().map(|&s| row(s, tokens[s])).collect();
            let mut batch = Vec::new();
            model
                .decode(
                    &mut scratch,
                    &mut kv_batch,
                    &mut states_batch,
                    &rows,
                    &mut batch,
                )
                .unwrap();
            let at = order.iter().position(|&s| s == probe).unwrap();
            assert!(
                bits(&alone) == bits(&batch[at * vocab..(at + 1) * vocab]),
                "row {probe} step {step}: logits differ alone vs in a batch of 7 on {threads} threads"
            );
            assert!(
                bits(states_alone.slot(probe).unwrap()) == bits(states_batch.slot(probe).unwrap())
            );
            for (i, &s) in order.iter().enumerate() {
                tokens[s] = model::parity::argmax(&batch[i * vocab..(i + 1) * vocab]);
            }
            token_alone = model::parity::argmax(&alone);
            assert_eq!(token_alone, tokens[probe]);
        }
        for &b in &tables[probe] {
            assert!(bits(kv_alone.block(b).unwrap()) == bits(kv_batch.block(b).unwrap()));
        }
    }
}

#[test]
fn decode_batch_does_not_change_a_rows_bits() {
    check_batch_invariance(&tiny());
}

#[test]
fn batch_invariance_holds_for_other_shapes() {
    // Wider, with more experts per token and a different layout, still small enough for debug tests.
    let config = Config {
        hidden_size: 48,
        layer_kinds: vec![
            model::LayerKind::Moe,
            model::LayerKind::Attention,
            model::LayerKind::Mamba,
            model::LayerKind::Moe,
        ],
        num_hidden_layers: 4,
        n_routed_experts: 12,
        num_experts_per_tok: 3,
        n_group: 3,
        topk_group: 2,
        conv_kernel: 3,
        ..Config::tiny_demo()
    };
    check_batch_invariance(&Model::random(config.clone(), 3).unwrap());
    check_chunk_invariance(&Model::random(config, 4).unwrap(), 40, &[1, 7]);
}

#[test]
fn variants_without_a_fixture_run_and_stay_invariant() {
    // Latent MoE, every optional bias, no conv bias, a 2-tap conv, one router group, MHA, and a
    // pattern string; then a model with no attention at all and one with no Mamba layer.
    let text = Config::tiny_demo()
        .to_hf_json()
        .replace("\"moe_latent_size\": null", "\"moe_latent_size\": 24")
        .replace("\"use_bias\": false", "\"use_bias\": true")
        .replace("\"mlp_bias\": false", "\"mlp_bias\": true")
        .replace("\"use_conv_bias\": true", "\"use_conv_bias\": false")
        .replace("\"conv_kernel\": 4", "\"conv_kernel\": 2")
        .replace("\"n_group\": 2", "\"n_group\": 1")
        .replace("\"num_key_value_heads\": 2", "\"num_key_value_heads\": 4")
        .replace("\"norm_topk_prob\": true", "\"norm_topk_prob\": false");
    let variant = Config::from_json_str(&text).unwrap();
    assert_eq!(variant.moe_latent_size, Some(24));
    assert!(variant.use_bias && variant.mlp_bias && !variant.use_conv_bias);
    let model = Model::random(variant, 9).unwrap();
    check_batch_invariance(&model);
    check_chunk_invariance(&model, 40, &[1, 13]);

    let dir = std::env::temp_dir().join(format!("model-variant-{}", std::process::id()));
    model.save(&dir).unwrap();
    assert_eq!(
        Model::load(&dir).unwrap().fingerprint(),
        model.fingerprint()
    );
    let _ = std::fs::remove_dir_all(&dir);

    let kinds = |pattern: &str| {
        pattern
            .chars()
            .map(|c| model::LayerKind::from_letter(c).unwrap())
            .collect::<Vec<_>>()
    };
    for pattern in ["ME-M", "*E-*"] {
        let config = Config {
            layer_kinds: kinds(pattern),
            num_hidden_layers: pattern.len(),
            ..Config::tiny_demo()
        };
        let model = Model::random(config, 2).unwrap();
        check_batch_invariance(&model);
        check_chunk_invariance(&model, 40, &[1, 13]);
    }
}

/// The comparisons above are only as exact as `bits`: distinct floats (even 0.0 and -0.0, which
/// compare equal as floats) give distinct bits.
#[test]
fn bits_are_the_floats_exact_bits() {
    assert_eq!(
        bits(&[1.0, 0.0, -0.0, f32::NAN]),
        [0x3f80_0000, 0, 0x8000_0000, 0x7fc0_0000]
    );
}
