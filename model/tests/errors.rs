//! Bad input is a typed error naming the problem, never a panic, and a failed call changes no
//! KV block and no Mamba state: bad ids, empty input, positions beyond the block table, broken
//! checkpoints and configs. Also checkpoint round trips (save/load, bf16 and f16 on disk).

mod common;

use std::path::{Path, PathBuf};

use common::tiny_dir;
use model::{Config, DecodeRow, KvPool, MambaStates, Model, ModelError, PrefillRow, Scratch};
use safetensors::{Dtype, SafeTensors};

/// A fresh, empty directory for one test.
fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("model-errors-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The fixture's tensors as (name, dtype, shape, bytes).
fn fixture_tensors() -> Vec<(String, Dtype, Vec<usize>, Vec<u8>)> {
    let bytes = std::fs::read(tiny_dir().join("model.safetensors")).unwrap();
    let tensors = SafeTensors::deserialize(&bytes).unwrap();
    let mut out: Vec<_> = tensors
        .tensors()
        .into_iter()
        .map(|(name, view)| {
            (
                name,
                view.dtype(),
                view.shape().to_vec(),
                view.data().to_vec(),
            )
        })
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

/// Writes a checkpoint folder with the fixture config (or `config`) and these tensors.
fn write_checkpoint(
    dir: &Path,
    config: Option<&str>,
    tensors: &[(String, Dtype, Vec<usize>, Vec<u8>)],
) {
    let config = match config {
        Some(text) => text.to_string(),
        None => std::fs::read_to_string(tiny_dir().join("config.json")).unwrap(),
    };
    std::fs::write(dir.join("config.json"), config).unwrap();
    let views: Vec<_> = tensors
        .iter()
        .map(|(name, dtype, shape, data)| {
            (
                name.clone(),
                safetensors::tensor::TensorView::new(*dtype, shape.clone(), data).unwrap(),
            )
        })
        .collect();
    let bytes = safetensors::serialize(views, None).unwrap();
    std::fs::write(dir.join("model.safetensors"), bytes).unwrap();
}

fn load_err(dir: &Path) -> ModelError {
    Model::load(dir).unwrap_err()
}

#[test]
fn truncated_and_corrupt_safetensors() {
    let original = std::fs::read(tiny_dir().join("model.safetensors")).unwrap();
    let config = std::fs::read(tiny_dir().join("config.json")).unwrap();
    let dir = temp_dir("truncated");
    std::fs::write(dir.join("config.json"), &config).unwrap();
    std::fs::write(
        dir.join("model.safetensors"),
        &original[..original.len() - 100],
    )
    .unwrap();
    assert!(matches!(load_err(&dir), ModelError::Safetensors { .. }));
    std::fs::write(dir.join("model.safetensors"), &original[..5]).unwrap();
    assert!(matches!(load_err(&dir), ModelError::Safetensors { .. }));
    let mut corrupt = original.clone();
    corrupt[8..16].copy_from_slice(b"garbage!");
    std::fs::write(dir.join("model.safetensors"), &corrupt).unwrap();
    assert!(matches!(load_err(&dir), ModelError::Safetensors { .. }));
    std::fs::remove_file(dir.join("model.safetensors")).unwrap();
    assert!(matches!(load_err(&dir), ModelError::Io { .. }));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn missing_wrong_shape_wrong_dtype_and_unexpected_tensors() {
    let tensors = fixture_tensors();
    let dir = temp_dir("tensors");

    let name = "backbone.layers.3.mixer.k_proj.weight";
    let without: Vec<_> = tensors.iter().filter(|t| t.0 != name).cloned().collect();
    write_checkpoint(&dir, None, &without);
    assert_eq!(
        load_err(&dir).to_string(),
        format!("tensor `{name}` is missing from the checkpoint")
    );

    let mut reshaped = tensors.clone();
    let t = reshaped.iter_mut().find(|t| t.0 == name).unwrap();
    t.2 = vec![64, 32];
    write_checkpoint(&dir, None, &reshaped);
    assert_eq!(
        load_err(&dir).to_string(),
        format!(
            "tensor `{name}` in {} has shape [64, 32], the config requires [32, 64]",
            dir.join("model.safetensors").display()
        )
    );

    let mut retyped = tensors.clone();
    let t = retyped.iter_mut().find(|t| t.0 == name).unwrap();
    t.1 = Dtype::I32;
    write_checkpoint(&dir, None, &retyped);
    assert!(matches!(load_err(&dir), ModelError::TensorDtype { .. }));

    let mut extra = tensors.clone();
    extra.push((
        "backbone.layers.0.mixer.in_proj.bias".into(),
        Dtype::F32,
        vec![196],
        vec![0; 196 * 4],
    ));
    write_checkpoint(&dir, None, &extra);
    assert_eq!(
        load_err(&dir).to_string(),
        format!(
            "tensor `backbone.layers.0.mixer.in_proj.bias` in {} is not expected by the config",
            dir.join("model.safetensors").display()
        )
    );
    extra.retain(|t| !t.0.ends_with("in_proj.bias"));
    // A stray MTP tensor: with one MTP group declared the head is built and must be complete.
    extra.push((
        "mtp.layers.0.norm.weight".into(),
        Dtype::F32,
        vec![64],
        vec![0; 64 * 4],
    ));
    write_checkpoint(&dir, None, &extra);
    assert_eq!(
        load_err(&dir).to_string(),
        "tensor `mtp.layers.0.enorm.weight` is missing from the checkpoint"
    );
    // Without a declared MTP group, MTP tensors are dropped silently, as transformers does.
    let base = std::fs::read_to_string(tiny_dir().join("config.json")).unwrap();
    let no_mtp = base.replacen(
        "\"num_nextn_predict_layers\": 1",
        "\"num_nextn_predict_layers\": 0",
        1,
    );
    assert_ne!(no_mtp, base);
    write_checkpoint(&dir, Some(&no_mtp), &extra);
    let model = Model::load(&dir).unwrap();
    assert!(!model.has_mtp());
    write_checkpoint(&dir, None, &tensors);
    assert_eq!(
        Model::load(&dir).unwrap().fingerprint(),
        Model::load(&tiny_dir()).unwrap().fingerprint()
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bad_configs_fail_to_load() {
    let tensors = fixture_tensors();
    let dir = temp_dir("configs");
    let base = std::fs::read_to_string(tiny_dir().join("config.json")).unwrap();
    let check = |from: &str, to: &str, expected: &str| {
        assert!(base.contains(from), "{from}");
        write_checkpoint(&dir, Some(&base.replacen(from, to, 1)), &tensors);
        assert_eq!(load_err(&dir).to_string(), expected);
    };
    check(
        "\"num_attention_heads\": 4",
        "\"num_attention_heads\": 0",
        "config field `num_attention_heads` = 0 is invalid: must be at least 1",
    );
    check(
        "\"n_groups\": 2",
        "\"n_groups\": 3",
        "config field `n_groups` = 3 is invalid: must divide mamba_num_heads = 4",
    );
    check(
        "\"linear_attention\",\n    \"moe\"",
        "\"linear_attention\",\n    \"conv\"",
        "unknown block type \"conv\" at index 1 of `layers_block_type` (expected linear_attention/mamba, full_attention/attention, mlp or moe)",
    );
    let pattern = base
        .replacen("\"layers_block_type\"", "\"ignored_layers\"", 1)
        .replacen(
            "\"layer_norm_epsilon\"",
            "\"hybrid_override_pattern\": \"MEM*-ME*Mx\",\n  \"layer_norm_epsilon\"",
            1,
        );
    write_checkpoint(&dir, Some(&pattern), &tensors);
    assert_eq!(
        load_err(&dir).to_string(),
        "unknown block letter 'x' at position 9 of `hybrid_override_pattern` (expected one of M, *, -, E)"
    );
    // A valid but different layout: the checkpoint then lacks the tensors it needs.
    write_checkpoint(
        &dir,
        Some(&pattern.replace("MEM*-ME*Mx", "MEM*-ME*M*")),
        &tensors,
    );
    assert_eq!(
        load_err(&dir).to_string(),
        "tensor `backbone.layers.9.mixer.q_proj.weight` is missing from the checkpoint"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn save_load_round_trip_and_half_precision_checkpoints_and_mapped_tensors() {
    let model = Model::random(Config::tiny_demo(), 11).unwrap();
    assert_eq!(
        model.fingerprint(),
        Model::random(Config::tiny_demo(), 11)
            .unwrap()
            .fingerprint()
    );
    assert_ne!(
        model.fingerprint(),
        Model::random(Config::tiny_demo(), 12)
            .unwrap()
            .fingerprint()
    );
    let dir = temp_dir("roundtrip");
    model.save(&dir).unwrap();
    let loaded = Model::load(&dir).unwrap();
    assert_eq!(loaded.config(), model.config());
    assert_eq!(loaded.fingerprint(), model.fingerprint());

    // bf16 / f16 on disk load to exactly the f32 values they represent, and
    // `Model::map_tensors` rounding the fixture's tensors in memory gives the same model.
    let fixture = Model::load(&tiny_dir()).unwrap();
    for (dtype, to_half, from_half) in [
        (
            Dtype::BF16,
            (|x: f32| half::bf16::from_f32(x).to_le_bytes()) as fn(f32) -> [u8; 2],
            (|b: [u8; 2]| half::bf16::from_le_bytes(b).to_f32()) as fn([u8; 2]) -> f32,
        ),
        (
            Dtype::F16,
            |x: f32| half::f16::from_f32(x).to_le_bytes(),
            |b: [u8; 2]| half::f16::from_le_bytes(b).to_f32(),
        ),
    ] {
        let mut halves = Vec::new();
        let mut rounded = Vec::new();
        for (name, _, shape, data) in fixture_tensors() {
            let values = data
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]));
            let half_bytes: Vec<u8> = values.clone().flat_map(to_half).collect();
            let back: Vec<u8> = half_bytes
                .chunks_exact(2)
                .flat_map(|b| from_half([b[0], b[1]]).to_le_bytes())
                .collect();
            halves.push((name.clone(), dtype, shape.clone(), half_bytes));
            rounded.push((name, Dtype::F32, shape, back));
        }
        write_checkpoint(&dir, None, &halves);
        let half_model = Model::load(&dir).unwrap();
        write_checkpoint(&dir, None, &rounded);
        assert_eq!(
            half_model.fingerprint(),
            Model::load(&dir).unwrap().fingerprint()
        );
        let mapped = fixture
            .map_tensors(&mut |_, _, values| {
                for v in values {
                    *v = from_half(to_half(*v));
                }
            })
            .unwrap();
        assert_eq!(mapped.config(), fixture.config());
        assert_eq!(mapped.fingerprint(), half_model.fingerprint());
    }
    // A map that changes nothing gives the same model.
    let same = fixture.map_tensors(&mut |_, _, _| {}).unwrap();
    assert_eq!(same.fingerprint(), fixture.fingerprint());
    let _ = std::fs::remove_dir_all(&dir);
}

/// A loaded model with one prefilled sequence in slot 0 (blocks 0..2) and a spare slot 1.
struct Setup {
    model: Model,
    scratch: Scratch,
    kv: KvPool,
    states: MambaStates,
    table: Vec<u32>,
}

fn setup() -> Setup {
    let model = Model::load(&tiny_dir()).unwrap();
    let config = model.config().clone();
    let mut kv = KvPool::new(&config, 4, 16).unwrap();
    let mut states = MambaStates::new(&config, 2).unwrap();
    let mut scratch = Scratch::new(&config);
    let table = vec![0, 1];
    let mut logits = Vec::new();
    let row = PrefillRow {
        tokens: &[5, 6, 7],
        start_pos: 0,
        blocks: &table,
        slot: 0,
    };
    model
        .prefill(&mut scratch, &mut kv, &mut states, row, false, &mut logits)
        .unwrap();
    Setup {
        model,
        scratch,
        kv,
        states,
        table,
    }
}

fn snapshot(s: &Setup) -> (Vec<u32>, Vec<u32>) {
    let mut kv = Vec::new();
    for b in 0..s.kv.num_blocks() as u32 {
        s.kv.export_block(b, &mut kv).unwrap();
    }
    let mut states = Vec::new();
    for slot in 0..s.states.num_slots() {
        s.states.export_slot(slot, &mut states).unwrap();
    }
    (
        kv.iter().map(|v| v.to_bits()).collect(),
        states.iter().map(|v| v.to_bits()).collect(),
    )
}

#[test]
fn bad_prefill_inputs_are_errors_that_change_nothing() {
    let mut s = setup();
    let before = snapshot(&s);
    let table = s.table.clone();
    let mut logits = vec![1.0];
    let cases: Vec<(PrefillRow<'_>, &str)> = vec![
        (
            PrefillRow {
                tokens: &[1, 256],
                start_pos: 3,
                blocks: &table,
                slot: 0,
            },
            "token id 256 at input index 1 is out of range (vocab_size = 256)",
        ),
        (
            PrefillRow {
                tokens: &[],
                start_pos: 3,
                blocks: &table,
                slot: 0,
            },
            "empty input: prefill with no tokens",
        ),
        (
            PrefillRow {
                tokens: &[1; 30],
                start_pos: 3,
                blocks: &table,
                slot: 0,
            },
            "position 32 is beyond the block table (2 blocks x 16 tokens = 32 positions)",
        ),
        (
            PrefillRow {
                tokens: &[1],
                start_pos: 3,
                blocks: &[9, 0],
                slot: 0,
            },
            "KV block id 9 is out of range (pool has 4 blocks)",
        ),
        (
            PrefillRow {
                tokens: &[1],
                start_pos: 3,
                blocks: &table,
                slot: 2,
            },
            "Mamba state slot 2 is out of range (2 slots)",
        ),
        (
            PrefillRow {
                tokens: &[1],
                start_pos: usize::MAX,
                blocks: &table,
                slot: 0,
            },
            "size overflow computing prefill end position",
        ),
    ];
    for (row, expected) in cases {
        let err = s
            .model
            .prefill(
                &mut s.scratch,
                &mut s.kv,
                &mut s.states,
                row,
                true,
                &mut logits,
            )
            .unwrap_err();
        assert_eq!(err.to_string(), expected);
        assert!(logits.is_empty());
        assert!(
            snapshot(&s) == before,
            "state changed by a failed prefill: {expected}"
        );
    }
}

#[test]
fn bad_decode_inputs_are_errors_that_change_nothing() {
    let mut s = setup();
    let before = snapshot(&s);
    let t = s.table.clone();
    let ok = DecodeRow {
        token: 1,
        pos: 3,
        blocks: &t,
        slot: 0,
    };
    let other = DecodeRow {
        token: 1,
        pos: 0,
        blocks: &[2],
        slot: 1,
    };
    let cases: Vec<(Vec<DecodeRow<'_>>, &str)> = vec![
        (vec![], "empty input: decode with no rows"),
        (
            vec![other, DecodeRow { token: 300, ..ok }],
            "token id 300 at input index 1 is out of range (vocab_size = 256)",
        ),
        (
            vec![other, DecodeRow { pos: 32, ..ok }],
            "position 32 is beyond the block table (2 blocks x 16 tokens = 32 positions)",
        ),
        (
            vec![DecodeRow { slot: 5, ..ok }],
            "Mamba state slot 5 is out of range (2 slots)",
        ),
        (
            vec![
                ok,
                DecodeRow {
                    blocks: &[3],
                    ..other
                },
                DecodeRow {
                    blocks: &[2],
                    slot: 0,
                    ..other
                },
            ],
            "decode rows 0 and 2 both use Mamba state slot 0",
        ),
        (
            vec![
                ok,
                DecodeRow {
                    blocks: &[0],
                    pos: 3,
                    ..other
                },
            ],
            "decode rows 0 and 1 both write KV block 0 offset 3",
        ),
        (
            vec![
                other,
                DecodeRow {
                    blocks: &[7],
                    pos: 0,
                    ..ok
                },
            ],
            "KV block id 7 is out of range (pool has 4 blocks)",
        ),
    ];
    let mut logits = vec![1.0];
    for (rows, expected) in cases {
        let err = s
            .model
            .decode(&mut s.scratch, &mut s.kv, &mut s.states, &rows, &mut logits)
            .unwrap_err();
        assert_eq!(err.to_string(), expected);
        assert!(logits.is_empty());
        assert!(
            snapshot(&s) == before,
            "state changed by a failed decode: {expected}"
        );
    }
    // The same rows, fixed, succeed.
    s.model
        .decode(
            &mut s.scratch,
            &mut s.kv,
            &mut s.states,
            &[ok, other],
            &mut logits,
        )
        .unwrap();
    assert_eq!(logits.len(), 2 * 256);
}

#[test]
fn pools_built_for_another_config_are_rejected() {
    let mut s = setup();
    let other = Config::small_512();
    let mut kv = KvPool::new(&other, 4, 16).unwrap();
    let mut states = MambaStates::new(&other, 2).unwrap();
    let mut logits = Vec::new();
    let row = PrefillRow {
        tokens: &[1],
        start_pos: 0,
        blocks: &[0],
        slot: 0,
    };
    let err = s
        .model
        .prefill(
            &mut s.scratch,
            &mut kv,
            &mut s.states,
            row,
            false,
            &mut logits,
        )
        .unwrap_err();
    assert!(
        matches!(err, ModelError::LayoutMismatch { what: "KvPool", .. }),
        "{err}"
    );
    let err = s
        .model
        .prefill(
            &mut s.scratch,
            &mut s.kv,
            &mut states,
            row,
            false,
            &mut logits,
        )
        .unwrap_err();
    assert!(
        matches!(
            err,
            ModelError::LayoutMismatch {
                what: "MambaStates",
                ..
            }
        ),
        "{err}"
    );
}

/// No threads and no jobs per thread are named errors; a refused setting leaves the scratch as it
/// was.
#[test]
fn zero_threads_or_zero_jobs_per_thread_is_a_named_error() {
    let config = Config::tiny_demo();
    match Scratch::with_threads(&config, 0) {
        Err(ModelError::InvalidConfig { field, .. }) => assert_eq!(field, "threads"),
        other => panic!("expected an InvalidConfig error, got {other:?}"),
    }
    let mut scratch = Scratch::with_threads(&config, 2).unwrap();
    scratch.set_jobs_per_thread(3).unwrap();
    match scratch.set_jobs_per_thread(0) {
        Err(ModelError::InvalidConfig { field, .. }) => assert_eq!(field, "jobs_per_thread"),
        other => panic!("expected an InvalidConfig error, got {other:?}"),
    }
    assert_eq!((scratch.threads(), scratch.jobs_per_thread()), (2, 3));
}
