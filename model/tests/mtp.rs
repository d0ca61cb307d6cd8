//! The MTP head against its float64 NumPy reference (`tests/fixtures/mtp_reference.py`): the head
//! over every prompt position, draft chains of depth 1..4 after the prompt and after five decoded
//! tokens, and the catch-up over those five, within 1e-4 and with the reference's draft ids; on
//! both fixtures (`nemotron-h-tiny/mtp`, pattern `*E`; `nemotron-h-alt/mtp`, pattern `M*-`).
//! Also: loading (a checkpoint without `mtp.*` loads as before, a missing MTP tensor is named),
//! and the batched-runs entry point verification uses (bits and state snapshots equal to decode
//! steps).

use std::path::{Path, PathBuf};

use model::parity::{argmax, max_abs_diff, MtpCase};
use model::{
    Config, DecodeRow, KvPool, LayerKind, MambaStates, Model, ModelError, PrefillRow, RunOutputs,
    RunRow, Scratch,
};
use safetensors::SafeTensors;

const TOLERANCE: f32 = 1e-4;

fn fixture_dir(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

fn cases(dir: &Path) -> Vec<MtpCase> {
    model::parity::mtp_cases(dir).unwrap()
}

struct Harness<'m> {
    model: &'m Model,
    kv: KvPool,
    states: MambaStates,
    scratch: Scratch,
    blocks: Vec<u32>,
}

impl<'m> Harness<'m> {
    fn new(model: &'m Model) -> Self {
        let config = model.config();
        Harness {
            model,
            kv: KvPool::new(config, 16, 16).unwrap(),
            states: MambaStates::new(config, 2).unwrap(),
            scratch: Scratch::new(config),
            blocks: (0..16).collect(),
        }
    }

    /// The main stack over `tokens` at `start`: (logits, hidden) of every position.
    fn main(&mut self, tokens: &[u32], start: usize) -> (Vec<f32>, Vec<f32>) {
        let (mut logits, mut hidden) = (Vec::new(), Vec::new());
        let run = RunRow {
            tokens,
            start_pos: start,
            blocks: &self.blocks,
            slot: 0,
            snapshots: &[],
        };
        self.model
            .forward_runs(
                &mut self.scratch,
                &mut self.kv,
                &mut self.states,
                &[run],
                RunOutputs::All,
                &mut logits,
                Some(&mut hidden),
            )
            .unwrap();
        (logits, hidden)
    }

    /// The MTP head over positions `start..` in `slot`: (logits, outputs) of every position.
    fn mtp(
        &mut self,
        next: &[u32],
        hidden: &[f32],
        start: usize,
        slot: usize,
    ) -> (Vec<f32>, Vec<f32>) {
        let (mut logits, mut out) = (Vec::new(), Vec::new());
        let run = RunRow {
            tokens: next,
            start_pos: start,
            blocks: &self.blocks,
            slot,
            snapshots: &[],
        };
        self.model
            .mtp(
                &mut self.scratch,
                &mut self.kv,
                &mut self.states,
                &[run],
                hidden,
                RunOutputs::All,
                &mut logits,
                &mut out,
            )
            .unwrap();
        (logits, out)
    }

    /// A draft chain of depth 4 from position `pos`, whose first row (`first`, `g`) is given;
    /// runs on a copy of the state in slot 1 (its K/V writes at `pos + 1..` are overwritten later
    /// by real inputs, as a router's are). Returns the rows and the draft ids.
    fn draft_chain(&mut self, first: &[f32], g: &[f32], pos: usize) -> (Vec<f32>, Vec<u32>) {
        self.states.copy_slot(0, 1).unwrap();
        let mut rows = first.to_vec();
        let mut ids = vec![argmax(first)];
        let mut g = g.to_vec();
        for depth in 1..4 {
            let (logits, out) = self.mtp(&[*ids.last().unwrap()], &g, pos + depth, 1);
            ids.push(argmax(&logits));
            rows.extend_from_slice(&logits);
            g = out;
        }
        (rows, ids)
    }
}

/// Every case of `fixture/mtp` within [`TOLERANCE`], with the reference's draft ids.
fn check(fixture: &str, pattern: &str) {
    let dir = fixture_dir(fixture).join("mtp");
    let model = Model::load(&dir.join("model")).unwrap();
    assert!(model.has_mtp(), "{fixture}: the MTP head was not loaded");
    let config = model.config();
    assert!(config.mtp);
    let mtp_pattern: String = config.mtp_layer_kinds.iter().map(|k| k.letter()).collect();
    assert_eq!(mtp_pattern, pattern);
    let vocab = config.vocab_size;
    let d = config.hidden_size;
    let bytes = std::fs::read(dir.join("expected.safetensors")).unwrap();
    let expected = SafeTensors::deserialize(&bytes).unwrap();
    let tensor = |name: String| -> Vec<f32> {
        let view = expected.tensor(&name).unwrap();
        bytemuck_free_f32(view.data())
    };
    let cases = cases(&dir);
    assert_eq!(cases.len(), if fixture.contains("alt") { 5 } else { 6 });
    for case in cases {
        let i = case.index;
        let mut h = Harness::new(&model);
        let n = case.prompt.len();
        let (_, hidden) = h.main(&case.prompt, 0);
        let mut next: Vec<u32> = case.prompt[1..].to_vec();
        next.push(case.greedy[0]);
        let (prompt_rows, outs) = h.mtp(&next, &hidden, 0, 0);
        let diff = max_abs_diff(&prompt_rows, &tensor(format!("case{i}.mtp_prompt_logits")));
        assert!(
            diff <= TOLERANCE,
            "{fixture} case {i}: MTP prompt rows differ by {diff:e}"
        );

        let last = &prompt_rows[(n - 1) * vocab..];
        let (rows, ids) = h.draft_chain(last, &outs[(n - 1) * d..], n - 1);
        let diff = max_abs_diff(&rows, &tensor(format!("case{i}.draft0_logits")));
        assert!(
            diff <= TOLERANCE,
            "{fixture} case {i}: draft chain 0 differs by {diff:e}"
        );
        assert_eq!(ids, case.draft0, "{fixture} case {i}: draft ids 0");

        let (main_logits, hidden) = h.main(&case.greedy[..5], n);
        for j in 0..5 {
            assert_eq!(
                argmax(&main_logits[j * vocab..(j + 1) * vocab]),
                case.greedy[j + 1],
                "{fixture} case {i}: main greedy id {j}"
            );
        }
        let (catchup, outs) = h.mtp(&case.greedy[1..6], &hidden, n, 0);
        let diff = max_abs_diff(&catchup, &tensor(format!("case{i}.catchup_logits")));
        assert!(
            diff <= TOLERANCE,
            "{fixture} case {i}: catch-up rows differ by {diff:e}"
        );
        let (rows, ids) = h.draft_chain(&catchup[4 * vocab..], &outs[4 * d..], n + 4);
        let diff = max_abs_diff(&rows, &tensor(format!("case{i}.draft1_logits")));
        assert!(
            diff <= TOLERANCE,
            "{fixture} case {i}: draft chain 1 differs by {diff:e}"
        );
        assert_eq!(ids, case.draft1, "{fixture} case {i}: draft ids 1");
    }
}

/// Little-endian f32s (safetensors data need not be aligned for a cast).
fn bytemuck_free_f32(data: &[u8]) -> Vec<f32> {
    data.chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

#[test]
fn the_tiny_fixtures_mtp_head_matches_the_numpy_reference() {
    check("nemotron-h-tiny", "*E");
}

#[test]
fn the_alt_fixtures_mtp_head_with_a_mamba_layer_matches_the_numpy_reference() {
    check("nemotron-h-alt", "M*-");
}

/// The MTP checkpoint's main stack is the base checkpoint's: the same logits bit for bit; the
/// base (no `mtp.*`) loads without a head, as before.
#[test]
fn a_checkpoint_without_mtp_loads_as_before() {
    let base = Model::load(&fixture_dir("nemotron-h-tiny").join("model")).unwrap();
    assert!(!base.has_mtp());
    assert!(!base.config().mtp);
    let with = Model::load(&fixture_dir("nemotron-h-tiny").join("mtp/model")).unwrap();
    assert_ne!(base.fingerprint(), with.fingerprint());
    let tokens = [3u32, 1, 4, 1, 5, 9, 2, 6, 5, 3];
    let logits = |model: &Model| {
        let mut h = Harness::new(model);
        h.main(&tokens, 0).0
    };
    assert_eq!(logits(&base), logits(&with));
    // Without a head the MTP entry point is a typed error.
    let mut h = Harness::new(&base);
    let mut out = (Vec::new(), Vec::new());
    let run = RunRow {
        tokens: &[1],
        start_pos: 0,
        blocks: &h.blocks,
        slot: 0,
        snapshots: &[],
    };
    let err = base
        .mtp(
            &mut h.scratch,
            &mut h.kv,
            &mut h.states,
            &[run],
            &vec![0.0; base.config().hidden_size],
            RunOutputs::All,
            &mut out.0,
            &mut out.1,
        )
        .unwrap_err();
    assert!(matches!(err, ModelError::NoMtpHead), "{err}");
}

/// A checkpoint that declares an MTP head but lacks one of its tensors names it.
#[test]
fn a_missing_mtp_tensor_is_named() {
    let source = fixture_dir("nemotron-h-tiny");
    let dir = std::env::temp_dir().join(format!("mtp-missing-{}", std::process::id()));
    let model_dir = dir.join("model");
    std::fs::create_dir_all(&model_dir).unwrap();
    std::fs::copy(
        source.join("mtp/model/config.json"),
        model_dir.join("config.json"),
    )
    .unwrap();
    std::fs::copy(
        source.join("model/model.safetensors"),
        model_dir.join("main.safetensors"),
    )
    .unwrap();
    let bytes = std::fs::read(source.join("mtp/model/mtp.safetensors")).unwrap();
    let tensors = SafeTensors::deserialize(&bytes).unwrap();
    let kept: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
        .tensors()
        .into_iter()
        .filter(|(name, _)| name != "mtp.layers.1.final_layernorm.weight")
        .collect();
    let out =
        safetensors::serialize(kept.iter().map(|(n, v)| (n.as_str(), v.clone())), None).unwrap();
    std::fs::write(model_dir.join("mtp.safetensors"), out).unwrap();
    let main_bytes = std::fs::read(model_dir.join("main.safetensors")).unwrap();
    let main = SafeTensors::deserialize(&main_bytes).unwrap();
    let mut map = serde_json::Map::new();
    for name in main.names() {
        map.insert(name.to_string(), "main.safetensors".into());
    }
    for (name, _) in &kept {
        map.insert(name.clone(), "mtp.safetensors".into());
    }
    let index = serde_json::json!({ "weight_map": map });
    std::fs::write(
        model_dir.join("model.safetensors.index.json"),
        index.to_string(),
    )
    .unwrap();
    let err = Model::load(&model_dir).unwrap_err();
    std::fs::remove_dir_all(&dir).unwrap();
    assert!(
        matches!(&err, ModelError::MissingTensor { name } if name == "mtp.layers.1.final_layernorm.weight"),
        "{err}"
    );
}

/// Random MTP heads: drawn after the main stack (same main weights), saved and reloaded under
/// the checkpoint names, and a config that asks for two predictor groups is refused.
#[test]
fn random_heads_round_trip_through_save_and_load() {
    let config = Config {
        mtp: true,
        mtp_layer_kinds: vec![LayerKind::Mamba, LayerKind::Attention, LayerKind::Moe],
        ..Config::tiny_demo()
    };
    let with = Model::random(config.clone(), 7).unwrap();
    let without = Model::random(Config::tiny_demo(), 7).unwrap();
    assert!(with.has_mtp() && !without.has_mtp());
    let tokens = [9u32, 8, 7];
    assert_eq!(
        Harness::new(&with).main(&tokens, 0).0,
        Harness::new(&without).main(&tokens, 0).0
    );
    let dir = std::env::temp_dir().join(format!("mtp-random-{}", std::process::id()));
    with.save(&dir).unwrap();
    let loaded = Model::load(&dir).unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    assert!(loaded.has_mtp());
    assert_eq!(loaded.fingerprint(), with.fingerprint());
    let err = Model::random(
        Config {
            num_nextn_predict_layers: 2,
            ..config
        },
        7,
    )
    .unwrap_err();
    assert_eq!(
        err.to_string(),
        "config field `num_nextn_predict_layers` = 2 is invalid: an MTP head is built for exactly one predictor group (as vLLM and SGLang do)"
    );
}

/// Verification's entry point: several sequences' runs in one batch give every position the bits
/// a decode step of that token gives, and the snapshots hold the state after each token, bit for
/// bit (on both fixtures' MTP models, whose state slots include the MTP head's Mamba layers).
#[test]
fn runs_match_decode_steps_bit_for_bit_with_snapshots() {
    for fixture in ["nemotron-h-tiny", "nemotron-h-alt"] {
        let model = Model::load(&fixture_dir(fixture).join("mtp/model")).unwrap();
        let config = model.config();
        let vocab = config.vocab_size;
        let prompts: [&[u32]; 3] = [&[5, 6, 7, 8, 9, 10, 11], &[1, 2, 3], &[42; 18]];
        let feeds: [&[u32]; 3] = [&[3, 1, 4, 1], &[2, 7], &[9]];
        let tables: [Vec<u32>; 3] = [vec![0, 1], vec![2, 3], vec![4, 5]];
        let prefill = |kv: &mut KvPool, states: &mut MambaStates, scratch: &mut Scratch| {
            for (seq, prompt) in prompts.iter().enumerate() {
                states.zero_slot(seq).unwrap();
                let row = PrefillRow {
                    tokens: prompt,
                    start_pos: 0,
                    blocks: &tables[seq],
                    slot: seq,
                };
                model
                    .prefill(scratch, kv, states, row, false, &mut Vec::new())
                    .unwrap();
            }
        };
        // Reference: decode steps, one token per sequence per step, states copied after each.
        let mut kv = KvPool::new(config, 6, 16).unwrap();
        let mut states = MambaStates::new(config, 12).unwrap();
        let mut scratch = Scratch::new(config);
        prefill(&mut kv, &mut states, &mut scratch);
        let mut expected: Vec<Vec<f32>> = vec![Vec::new(); 3];
        let mut expected_states: Vec<Vec<Vec<f32>>> = vec![Vec::new(); 3];
        for step in 0..4 {
            let rows: Vec<DecodeRow<'_>> = (0..3)
                .filter(|&seq| step < feeds[seq].len())
                .map(|seq| DecodeRow {
                    token: feeds[seq][step],
                    pos: prompts[seq].len() + step,
                    blocks: &tables[seq],
                    slot: seq,
                })
                .collect();
            let mut logits = Vec::new();
            model
                .decode(&mut scratch, &mut kv, &mut states, &rows, &mut logits)
                .unwrap();
            for (r, row) in rows.iter().enumerate() {
                expected[row.slot].extend_from_slice(&logits[r * vocab..(r + 1) * vocab]);
                let state = states.slot(row.slot).unwrap().to_vec();
                expected_states[row.slot].push(state);
            }
        }
        // One call over three runs, with snapshots into slots 3.. (main stack's Mamba layers), on
        // 1, 2 and 3 threads; then the MTP head over the same runs, whose bits (logits, outputs,
        // every state slot) must not depend on the thread count either.
        let mut mtp_bits: Option<Vec<Vec<u32>>> = None;
        for threads in [1, 2, 3] {
            let mut scratch = Scratch::with_threads(config, threads).unwrap();
            let mut kv = KvPool::new(config, 6, 16).unwrap();
            let mut states = MambaStates::new(config, 12).unwrap();
            prefill(&mut kv, &mut states, &mut scratch);
            let snapshots: [Vec<usize>; 3] = [vec![3, 4, 5, 6], vec![7, 8], vec![9]];
            let runs: Vec<RunRow<'_>> = (0..3)
                .map(|seq| RunRow {
                    tokens: feeds[seq],
                    start_pos: prompts[seq].len(),
                    blocks: &tables[seq],
                    slot: seq,
                    snapshots: &snapshots[seq],
                })
                .collect();
            let mut logits = Vec::new();
            let mut hidden = Vec::new();
            model
                .forward_runs(
                    &mut scratch,
                    &mut kv,
                    &mut states,
                    &runs,
                    RunOutputs::All,
                    &mut logits,
                    Some(&mut hidden),
                )
                .unwrap();
            assert_eq!(hidden.len(), 7 * config.hidden_size);
            let main_mamba = config.count(LayerKind::Mamba);
            let per_layer = states.layout().layer_floats();
            let mut row = 0;
            for seq in 0..3 {
                let n = feeds[seq].len();
                assert_eq!(
                    logits[row * vocab..(row + n) * vocab],
                    expected[seq][..],
                    "{fixture}: sequence {seq}'s logits"
                );
                for (j, &snapshot) in snapshots[seq].iter().enumerate() {
                    let main_floats = main_mamba * per_layer;
                    assert_eq!(
                        states.slot(snapshot).unwrap()[..main_floats],
                        expected_states[seq][j][..main_floats],
                        "{fixture}: sequence {seq}'s snapshot after token {j}"
                    );
                }
                row += n;
            }
            // Last-position outputs are the last rows of the runs.
            let mut kv = KvPool::new(config, 6, 16).unwrap();
            let mut states = MambaStates::new(config, 12).unwrap();
            prefill(&mut kv, &mut states, &mut scratch);
            let mut last = Vec::new();
            model
                .forward_runs(
                    &mut scratch,
                    &mut kv,
                    &mut states,
                    &runs,
                    RunOutputs::Last,
                    &mut last,
                    None,
                )
                .unwrap();
            for seq in 0..3 {
                let n = feeds[seq].len();
                assert_eq!(
                    last[seq * vocab..(seq + 1) * vocab],
                    expected[seq][(n - 1) * vocab..n * vocab]
                );
            }
            // The MTP head over the runs (each position's next token: the run's tokens shifted,
            // then a fixed id), from the main stack's hidden rows of the first call above.
            let next: [Vec<u32>; 3] = [vec![1, 4, 1, 5], vec![7, 1], vec![8]];
            let mtp_runs: Vec<RunRow<'_>> = (0..3)
                .map(|seq| RunRow {
                    tokens: &next[seq],
                    start_pos: prompts[seq].len(),
                    blocks: &tables[seq],
                    slot: seq,
                    snapshots: &snapshots[seq],
                })
                .collect();
            let (mut mtp_logits, mut mtp_out) = (Vec::new(), Vec::new());
            model
                .mtp(
                    &mut scratch,
                    &mut kv,
                    &mut states,
                    &mtp_runs,
                    &hidden,
                    RunOutputs::All,
                    &mut mtp_logits,
                    &mut mtp_out,
                )
                .unwrap();
            // What the MTP call produced, as bits: logits, outputs, then every state slot.
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
            let mut seen = vec![bits(&mtp_logits), bits(&mtp_out)];
            seen.extend((0..12).map(|slot| bits(states.slot(slot).unwrap())));
            match &mtp_bits {
                None => mtp_bits = Some(seen),
                Some(first) => {
                    for (k, (a, b)) in seen.iter().zip(first).enumerate() {
                        let what = match k {
                            0 => "logits".to_string(),
                            1 => "outputs".to_string(),
                            _ => format!("state slot {}", k - 2),
                        };
                        assert!(a == b, "{fixture}: MTP {what} on {threads} threads");
                    }
                }
            }
        }
    }
}

/// Bad runs are typed errors that change nothing.
#[test]
fn bad_runs_are_refused() {
    let model = Model::load(&fixture_dir("nemotron-h-tiny").join("mtp/model")).unwrap();
    let config = model.config();
    let mut kv = KvPool::new(config, 4, 16).unwrap();
    let mut states = MambaStates::new(config, 4).unwrap();
    let mut scratch = Scratch::new(config);
    let mut logits = Vec::new();
    let mut check = |runs: &[RunRow<'_>], expected: &str| {
        let before = (kv.clone(), states.clone());
        let err = model
            .forward_runs(
                &mut scratch,
                &mut kv,
                &mut states,
                runs,
                RunOutputs::All,
                &mut logits,
                None,
            )
            .unwrap_err();
        assert_eq!(err.to_string(), expected);
        assert_eq!(kv.block(0).unwrap(), before.0.block(0).unwrap());
        assert_eq!(states.slot(0).unwrap(), before.1.slot(0).unwrap());
    };
    let run = |tokens: &'static [u32], slot, snapshots: &'static [usize]| RunRow {
        tokens,
        start_pos: 0,
        blocks: &[0, 1],
        slot,
        snapshots,
    };
    check(&[], "empty input: a call with no runs");
    check(
        &[run(&[1, 2], 0, &[1])],
        "run 0 names 1 snapshot slots for its 2 tokens (one per token, or none)",
    );
    check(
        &[run(&[1, 2], 0, &[1, 0])],
        "decode rows 0 and 0 both use Mamba state slot 0",
    );
    check(
        &[run(&[1], 0, &[]), run(&[1], 1, &[])],
        "decode rows 0 and 1 both write KV block 0 offset 0",
    );
    check(
        &[run(&[1, 999], 0, &[])],
        "token id 999 at input index 1 is out of range (vocab_size = 256)",
    );
}
