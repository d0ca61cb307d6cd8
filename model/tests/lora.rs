//! LoRA adapters: the oracles of the adapter math and of the PEFT format.
//!
//! - adapters made by real PEFT on the tiny fixture (`fixtures/nemotron-h-tiny-lora`, made by its
//!   `make_lora.py`) give the logits transformers + PEFT computed, within 1e-4, with the same
//!   greedy tokens; the bf16 and f16 copies of one adapter give the same bits;
//! - an adapter whose `B` is zero gives the base model's logits bit for bit;
//! - an adapter equals the base model with merged weights `W + scale·B·A` (built here, in f64,
//!   written as a checkpoint and loaded) within 1e-5;
//! - a decode batch of rows with three adapters and one without gives each row the bits it gets
//!   alone;
//! - every kind of bad adapter is a typed error naming the file and the problem.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use common::{bits, fixtures, tiny};
use model::parity::{argmax, max_abs_diff};
use model::{
    AdapterProblem, DecodeRow, KvPool, LoraAdapter, LoraSpec, MambaStates, Model, ModelError,
    PrefillRow, RunOutputs, RunRow, Scratch,
};
use safetensors::{Dtype, SafeTensors};
use serde_json::json;

const BLOCK_SIZE: usize = 16;

fn lora_dir(name: &str) -> PathBuf {
    fixtures().join("nemotron-h-tiny-lora").join(name)
}

/// One sequence's caller-owned state on the host: its KV blocks `0..blocks` and Mamba slot 0.
struct Run {
    kv: KvPool,
    states: MambaStates,
    scratch: Scratch,
    table: Vec<u32>,
    len: usize,
}

impl Run {
    fn new(model: &Model, blocks: usize) -> Self {
        let config = model.config();
        let mut states = MambaStates::new(config, 1).unwrap();
        states.zero_slot(0).unwrap();
        Run {
            kv: KvPool::new(config, blocks, BLOCK_SIZE).unwrap(),
            states,
            scratch: Scratch::new(config),
            table: (0..blocks as u32).collect(),
            len: 0,
        }
    }

    /// Every position's logits of `tokens`, prefilled in one call.
    fn prefill(
        &mut self,
        model: &Model,
        adapter: Option<&LoraAdapter>,
        tokens: &[u32],
    ) -> Vec<f32> {
        let mut logits = Vec::new();
        let row = PrefillRow {
            tokens,
            start_pos: self.len,
            blocks: &self.table,
            slot: 0,
        };
        model
            .prefill_with_adapter(
                &mut self.scratch,
                &mut self.kv,
                &mut self.states,
                row,
                adapter,
                true,
                &mut logits,
            )
            .unwrap();
        self.len += tokens.len();
        logits
    }

    /// One decode step of `token`.
    fn decode(&mut self, model: &Model, adapter: Option<&LoraAdapter>, token: u32) -> Vec<f32> {
        let mut logits = Vec::new();
        let row = DecodeRow {
            token,
            pos: self.len,
            blocks: &self.table,
            slot: 0,
        };
        model
            .decode_with_adapters(
                &mut self.scratch,
                &mut self.kv,
                &mut self.states,
                &[row],
                &[adapter],
                &mut logits,
            )
            .unwrap();
        self.len += 1;
        logits
    }
}

/// Prompt logits, then `steps` greedy decode steps' logits, all concatenated.
fn generate(
    model: &Model,
    adapter: Option<&LoraAdapter>,
    prompt: &[u32],
    steps: usize,
) -> Vec<f32> {
    let vocab = model.config().vocab_size;
    let mut run = Run::new(model, 8);
    let mut all = run.prefill(model, adapter, prompt);
    let mut token = argmax(&all[all.len() - vocab..]);
    for _ in 0..steps {
        let logits = run.decode(model, adapter, token);
        token = argmax(&logits);
        all.extend_from_slice(&logits);
    }
    all
}

fn prompt(len: usize, seed: u32) -> Vec<u32> {
    let mut x = seed.wrapping_mul(2_654_435_761).wrapping_add(12345);
    (0..len)
        .map(|_| {
            x = x.wrapping_mul(1_103_515_245).wrapping_add(12345);
            (x >> 8) % 256
        })
        .collect()
}

#[derive(serde::Deserialize)]
struct Cases {
    adapters: Vec<AdapterCases>,
}

#[derive(serde::Deserialize)]
struct AdapterCases {
    name: String,
    cases: Vec<Case>,
}

#[derive(serde::Deserialize)]
struct Case {
    prompt_ids: Vec<u32>,
    greedy_ids: Vec<u32>,
}

fn expected_tensor(tensors: &SafeTensors<'_>, name: &str) -> Vec<f32> {
    let view = tensors.tensor(name).unwrap();
    assert_eq!(view.dtype(), Dtype::F32);
    view.data()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

/// Runs every case of adapter `name` through `adapter`: prompt logits and each decode step (fed
/// PEFT's greedy ids) within 1e-4 of transformers + PEFT, same greedy ids. Answers every logit.
fn check_against_peft(model: &Model, adapter: &LoraAdapter, name: &str) -> Vec<f32> {
    let root = fixtures().join("nemotron-h-tiny-lora");
    let cases: Cases =
        serde_json::from_str(&std::fs::read_to_string(root.join("cases.json")).unwrap()).unwrap();
    let bytes = std::fs::read(root.join("expected.safetensors")).unwrap();
    let expected = SafeTensors::deserialize(&bytes).unwrap();
    let vocab = model.config().vocab_size;
    let adapter_cases = cases.adapters.iter().find(|a| a.name == name).unwrap();
    let mut all = Vec::new();
    let mut worst: f32 = 0.0;
    for (i, case) in adapter_cases.cases.iter().enumerate() {
        let mut run = Run::new(model, 8);
        let prompt_logits = run.prefill(model, Some(adapter), &case.prompt_ids);
        let want = expected_tensor(&expected, &format!("{name}.case{i}.prompt_logits"));
        worst = worst.max(max_abs_diff(&prompt_logits, &want));
        let mut token = argmax(&prompt_logits[prompt_logits.len() - vocab..]);
        all.extend_from_slice(&prompt_logits);
        let want = expected_tensor(&expected, &format!("{name}.case{i}.decode_logits"));
        for (step, &fed) in case.greedy_ids.iter().enumerate() {
            assert_eq!(
                token, fed,
                "adapter {name} case {i}: greedy id before step {step}"
            );
            let logits = run.decode(model, Some(adapter), fed);
            worst = worst.max(max_abs_diff(
                &logits,
                &want[step * vocab..(step + 1) * vocab],
            ));
            token = argmax(&logits);
            all.extend_from_slice(&logits);
        }
    }
    assert!(worst < 1e-4, "adapter {name}: max |logit - PEFT| = {worst}");
    all
}

#[test]
fn peft_adapters_match_transformers_and_peft() {
    let model = tiny();
    let a = LoraAdapter::load(&lora_dir("adapter-a"), &model).unwrap();
    assert_eq!((a.rank(), a.scale(), a.rslora()), (8, 2.0, false));
    // q/k/v/o on 2 attention layers, in_proj on 4 Mamba layers, up/down on 2 MLP and 2 shared
    // experts.
    assert_eq!(a.module_count(), 8 + 4 + 8);
    check_against_peft(&model, &a, "a");

    // rsLoRA, layers_to_transform, bf16 and f16 files of the same values.
    let b = LoraAdapter::load(&lora_dir("adapter-b"), &model).unwrap();
    assert_eq!((b.rank(), b.scale(), b.rslora()), (4, 3.0, true));
    assert_eq!(
        b.modules(model.config()),
        [
            "model.layers.0.mixer.in_proj",
            "model.layers.3.mixer.o_proj",
            "model.layers.4.mixer.down_proj",
            "model.layers.6.mixer.shared_experts.down_proj",
            "model.layers.8.mixer.in_proj",
        ]
    );
    let b16 = LoraAdapter::load(&lora_dir("adapter-b-f16"), &model).unwrap();
    assert_eq!(b.fingerprint(), b16.fingerprint());
    let from_bf16 = check_against_peft(&model, &b, "b");
    let from_f16 = check_against_peft(&model, &b16, "b");
    assert_eq!(bits(&from_bf16), bits(&from_f16));
}

/// Every linear layer of the main stack PEFT can name, plus Mamba's `out_proj` (which PEFT
/// refuses for Mamba models but the math covers).
fn every_target(rank: usize, b_range: f32) -> LoraSpec {
    let mut spec = LoraSpec::all_linear(rank);
    spec.b_range = b_range;
    spec
}

#[test]
fn zero_b_is_bit_identical_to_the_base_model() {
    let model = tiny();
    let zero = LoraAdapter::random(&model, &every_target(4, 0.0), 1).unwrap();
    assert_eq!(zero.module_count(), 2 * 4 + 4 * 2 + 2 * 2 + 2 * 2);
    let nonzero = LoraAdapter::random(&model, &every_target(4, 0.5), 1).unwrap();
    for (len, seed) in [(1, 1), (17, 2), (40, 3)] {
        let tokens = prompt(len, seed);
        let base = generate(&model, None, &tokens, 6);
        assert_eq!(
            bits(&generate(&model, Some(&zero), &tokens, 6)),
            bits(&base)
        );
        // The control: the same A with a non-zero B changes the logits.
        assert!(max_abs_diff(&generate(&model, Some(&nonzero), &tokens, 6), &base) > 1e-2);
    }
}

/// `dir/model.safetensors` read back as (name -> (shape, f32 values)).
fn read_f32_tensors(path: &Path) -> BTreeMap<String, (Vec<usize>, Vec<f32>)> {
    let bytes = std::fs::read(path).unwrap();
    let file = SafeTensors::deserialize(&bytes).unwrap();
    file.names()
        .into_iter()
        .map(|name| {
            let view = file.tensor(name).unwrap();
            assert_eq!(view.dtype(), Dtype::F32);
            let values = view
                .data()
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect();
            (name.to_string(), (view.shape().to_vec(), values))
        })
        .collect()
}

/// The base checkpoint with `W + scale·B·A` for every module the adapter in `adapter_dir`
/// changes, computed in f64 and written as a checkpoint in `out`.
fn merged_checkpoint(model: &Model, adapter_dir: &Path, scale: f64, out: &Path) -> Model {
    model.save(out).unwrap();
    let mut base = read_f32_tensors(&out.join("model.safetensors"));
    let lora = read_f32_tensors(&adapter_dir.join("adapter_model.safetensors"));
    let (nh, hd) = (model.config().num_attention_heads, model.config().head_dim);
    assert_eq!(nh * hd, 64);
    let mut merged_modules = 0;
    for (name, (a_shape, a)) in &lora {
        let Some(stem) = name.strip_suffix(".lora_A.weight") else {
            continue;
        };
        let (b_shape, b) = &lora[&format!("{stem}.lora_B.weight")];
        let module = stem.strip_prefix("base_model.model.model.").unwrap();
        let (weight_shape, weight) = base.get_mut(&format!("backbone.{module}.weight")).unwrap();
        let (rank, input) = (a_shape[0], a_shape[1]);
        let out_dim = b_shape[0];
        assert_eq!(weight_shape, &vec![out_dim, input]);
        for o in 0..out_dim {
            for i in 0..input {
                let delta: f64 = (0..rank)
                    .map(|k| f64::from(b[o * rank + k]) * f64::from(a[k * input + i]))
                    .sum();
                let w = &mut weight[o * input + i];
                *w = (f64::from(*w) + scale * delta) as f32;
            }
        }
        merged_modules += 1;
    }
    assert_eq!(merged_modules, 24);
    let data: Vec<(String, Vec<usize>, Vec<u8>)> = base
        .into_iter()
        .map(|(name, (shape, values))| (name, shape, bytemuck::cast_slice(&values).to_vec()))
        .collect();
    let views: Vec<_> = data
        .iter()
        .map(|(name, shape, bytes)| {
            (
                name.clone(),
                safetensors::tensor::TensorView::new(Dtype::F32, shape.clone(), bytes).unwrap(),
            )
        })
        .collect();
    std::fs::write(
        out.join("model.safetensors"),
        safetensors::serialize(views, None).unwrap(),
    )
    .unwrap();
    Model::load(out).unwrap()
}

/// The largest difference between `model` with a random adapter over every target and the merged
/// checkpoint, over prompts of 1 to 70 tokens and 8 decode steps each; and the largest logit.
fn adapter_vs_merged(model: &Model, b_range: f32) -> (f32, f32) {
    let dir = tempfile::tempdir().unwrap();
    let adapter_dir = dir.path().join("adapter");
    let merged_dir = dir.path().join("merged");
    let mut spec = every_target(4, b_range);
    spec.alpha = 6.0; // scale 1.5
    let random = LoraAdapter::random(model, &spec, 7).unwrap();
    random.save(&adapter_dir, model.config()).unwrap();
    let adapter = LoraAdapter::load(&adapter_dir, model).unwrap();
    assert_eq!(adapter.fingerprint(), random.fingerprint());
    assert_eq!(adapter.scale(), 1.5);
    let merged = merged_checkpoint(model, &adapter_dir, 1.5, &merged_dir);
    let (mut worst, mut largest): (f32, f32) = (0.0, 0.0);
    for (len, seed) in [(1, 11), (16, 12), (33, 13), (70, 14)] {
        let tokens = prompt(len, seed);
        let ours = generate(model, Some(&adapter), &tokens, 8);
        let reference = generate(&merged, None, &tokens, 8);
        // The control: the adapter changes the base model's output by far more than that.
        assert!(max_abs_diff(&generate(model, None, &tokens, 8), &reference) > 1e-2);
        worst = worst.max(max_abs_diff(&ours, &reference));
        largest = ours.iter().fold(largest, |m, v| m.max(v.abs()));
    }
    (worst, largest)
}

#[test]
fn an_adapter_equals_the_merged_weights() {
    // A seeded random model of the fixture's shape (logits of order 1).
    let model = Model::random(model::Config::tiny_demo(), 5).unwrap();
    let (worst, _) = adapter_vs_merged(&model, 0.3);
    assert!(worst < 1e-5, "max |adapter - merged| = {worst}");
    // The fixture, whose logits reach |9| and whose own float32 error against its float64
    // reference is 1.07e-5 (its README): the same bound relative to the largest logit.
    let model = tiny();
    let (worst, largest) = adapter_vs_merged(&model, 0.1);
    assert!(
        worst < 1e-5 * largest,
        "max |adapter - merged| = {worst}, largest logit {largest}"
    );
}

#[test]
fn a_mixed_batch_gives_each_row_its_bits_alone() {
    let model = tiny();
    let config = model.config();
    let vocab = config.vocab_size;
    let adapters: Vec<LoraAdapter> = (0..3)
        .map(|i| {
            let mut spec = every_target(2 + 2 * i, 0.4);
            if i == 1 {
                spec.targets = ["in_proj", "out_proj", "q_proj", "v_proj", "up_proj"]
                    .map(String::from)
                    .to_vec();
                spec.rslora = true;
            }
            LoraAdapter::random(&model, &spec, 20 + i as u64).unwrap()
        })
        .collect();
    // Rows: adapter 0, none, adapter 2, adapter 1, adapter 0 again (two rows of one adapter are
    // batched together).
    let row_adapters: Vec<Option<&LoraAdapter>> = vec![
        Some(&adapters[0]),
        None,
        Some(&adapters[2]),
        Some(&adapters[1]),
        Some(&adapters[0]),
    ];
    let n = row_adapters.len();
    let prompts: Vec<Vec<u32>> = (0..n).map(|i| prompt(5 + 7 * i, 40 + i as u32)).collect();

    // Each row alone: its own pool and slot.
    let mut alone: Vec<Vec<f32>> = Vec::new();
    let mut alone_last: Vec<Vec<f32>> = Vec::new();
    let mut firsts = Vec::new();
    for (p, adapter) in prompts.iter().zip(&row_adapters) {
        let mut run = Run::new(&model, 4);
        let logits = run.prefill(&model, *adapter, p);
        alone_last.push(logits[logits.len() - vocab..].to_vec());
        let mut token = argmax(&logits[logits.len() - vocab..]);
        firsts.push(token);
        let mut steps = Vec::new();
        for _ in 0..5 {
            let logits = run.decode(&model, *adapter, token);
            token = argmax(&logits);
            steps.push(logits);
        }
        alone.push(steps.concat());
    }

    // Together: one pool, slot i, blocks 4i..4i+4; prefills alone, decode steps batched; on 1, 2
    // and 3 threads of the forward pass (the LoRA terms use the same thread-invariant products).
    for threads in [1, 2, 3] {
        let mut kv = KvPool::new(config, 4 * n, BLOCK_SIZE).unwrap();
        let mut states = MambaStates::new(config, n).unwrap();
        let mut scratch = Scratch::with_threads(config, threads).unwrap();
        let tables: Vec<Vec<u32>> = (0..n)
            .map(|i| (4 * i as u32..4 * i as u32 + 4).collect())
            .collect();
        let mut logits = Vec::new();
        for (i, p) in prompts.iter().enumerate() {
            states.zero_slot(i).unwrap();
            let row = PrefillRow {
                tokens: p,
                start_pos: 0,
                blocks: &tables[i],
                slot: i,
            };
            model
                .prefill_with_adapter(
                    &mut scratch,
                    &mut kv,
                    &mut states,
                    row,
                    row_adapters[i],
                    false,
                    &mut logits,
                )
                .unwrap();
            assert_eq!(
                bits(&logits),
                bits(&alone_last[i]),
                "row {i}'s prefill on {threads} threads"
            );
        }
        let mut tokens = firsts.clone();
        let mut together: Vec<Vec<f32>> = vec![Vec::new(); n];
        for step in 0..5 {
            let rows: Vec<DecodeRow<'_>> = (0..n)
                .map(|i| DecodeRow {
                    token: tokens[i],
                    pos: prompts[i].len() + step,
                    blocks: &tables[i],
                    slot: i,
                })
                .collect();
            model
                .decode_with_adapters(
                    &mut scratch,
                    &mut kv,
                    &mut states,
                    &rows,
                    &row_adapters,
                    &mut logits,
                )
                .unwrap();
            for i in 0..n {
                let row = &logits[i * vocab..(i + 1) * vocab];
                tokens[i] = argmax(row);
                together[i].extend_from_slice(row);
            }
        }
        for i in 0..n {
            assert_eq!(
                bits(&together[i]),
                bits(&alone[i]),
                "row {i} on {threads} threads"
            );
        }
    }
    // The control: the adapters do change the rows.
    let base = {
        let mut run = Run::new(&model, 4);
        let l = run.prefill(&model, None, &prompts[0]);
        run.decode(&model, None, argmax(&l[l.len() - vocab..]))
    };
    assert!(max_abs_diff(&base, &alone[0][..vocab]) > 1e-2);
}

#[test]
fn adapter_rows_and_foreign_adapters_are_refused() {
    let model = tiny();
    let other = Model::random(model.config().clone(), 3).unwrap();
    let foreign = LoraAdapter::random(&other, &LoraSpec::all_linear(2), 1).unwrap();
    let mut run = Run::new(&model, 2);
    let mut logits = Vec::new();
    let row = PrefillRow {
        tokens: &[1, 2, 3],
        start_pos: 0,
        blocks: &run.table,
        slot: 0,
    };
    let err = model
        .prefill_with_adapter(
            &mut run.scratch,
            &mut run.kv,
            &mut run.states,
            row,
            Some(&foreign),
            false,
            &mut logits,
        )
        .unwrap_err();
    assert!(matches!(err, ModelError::AdapterMismatch { .. }), "{err}");
    // A decode batch and a batch of runs check their per-row adapters alike: none, or one per
    // row, each loaded for this model.
    let rows = [DecodeRow {
        token: 1,
        pos: 0,
        blocks: &run.table,
        slot: 0,
    }];
    let runs = [RunRow {
        tokens: &[1, 2],
        start_pos: 0,
        blocks: &run.table,
        slot: 0,
        snapshots: &[],
    }];
    for decode in [true, false] {
        let mut refusal = |adapters: &[Option<&LoraAdapter>]| {
            let (scratch, kv, states) = (&mut run.scratch, &mut run.kv, &mut run.states);
            let answer = if decode {
                model.decode_with_adapters(scratch, kv, states, &rows, adapters, &mut logits)
            } else {
                model.forward_runs_with_adapters(
                    scratch,
                    kv,
                    states,
                    &runs,
                    adapters,
                    RunOutputs::All,
                    &mut logits,
                    None,
                )
            };
            answer.unwrap_err()
        };
        let err = refusal(&[None, None]);
        assert_eq!(err.to_string(), "2 adapters given for 1 rows", "{decode}");
        let err = refusal(&[Some(&foreign)]);
        assert!(
            matches!(err, ModelError::AdapterMismatch { .. }),
            "{decode}: {err}"
        );
    }
}

// ----------------------------------------------------------------------------------------------
// Bad adapters: each is a typed error naming the file and the problem.
// ----------------------------------------------------------------------------------------------

/// A copy of `adapter-b` (bf16, 5 modules) in a temporary folder, with its config changed by
/// `config` and its tensors by `tensors`.
fn broken(
    config: impl FnOnce(&mut serde_json::Value),
    tensors: impl FnOnce(&mut Vec<(String, Dtype, Vec<usize>, Vec<u8>)>),
) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().to_path_buf();
    let source = lora_dir("adapter-b");
    let mut settings: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(source.join("adapter_config.json")).unwrap())
            .unwrap();
    config(&mut settings);
    std::fs::write(
        path.join("adapter_config.json"),
        serde_json::to_string(&settings).unwrap(),
    )
    .unwrap();
    let bytes = std::fs::read(source.join("adapter_model.safetensors")).unwrap();
    let file = SafeTensors::deserialize(&bytes).unwrap();
    let mut list: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = file
        .names()
        .into_iter()
        .map(|name| {
            let view = file.tensor(name).unwrap();
            (
                name.to_string(),
                view.dtype(),
                view.shape().to_vec(),
                view.data().to_vec(),
            )
        })
        .collect();
    tensors(&mut list);
    let views: Vec<_> = list
        .iter()
        .map(|(name, dtype, shape, data)| {
            (
                name.clone(),
                safetensors::tensor::TensorView::new(*dtype, shape.clone(), data).unwrap(),
            )
        })
        .collect();
    std::fs::write(
        path.join("adapter_model.safetensors"),
        safetensors::serialize(views, None).unwrap(),
    )
    .unwrap();
    (dir, path)
}

/// Loads `dir`, expecting an adapter error for `file` whose message is `message`.
fn check(model: &Model, dir: &Path, file: &str, message: &str) -> AdapterProblem {
    match LoraAdapter::load(dir, model) {
        Err(err @ ModelError::Adapter { .. }) => {
            let text = err.to_string();
            let ModelError::Adapter { path, problem } = err else {
                unreachable!()
            };
            assert_eq!(path, dir.join(file));
            assert_eq!(
                text,
                format!("LoRA adapter file {}: {message}", dir.join(file).display())
            );
            problem
        }
        Err(other) => panic!("expected an adapter error, got {other}"),
        Ok(_) => panic!("the broken adapter in {} loaded", dir.display()),
    }
}

const CONFIG: &str = "adapter_config.json";
const WEIGHTS: &str = "adapter_model.safetensors";
const IN_PROJ_A: &str = "base_model.model.model.layers.0.mixer.in_proj.lora_A.weight";

fn set(field: &'static str, value: serde_json::Value) -> impl FnOnce(&mut serde_json::Value) {
    move |config| {
        config[field] = value;
    }
}

fn keep(_: &mut Vec<(String, Dtype, Vec<usize>, Vec<u8>)>) {}

fn keep_config(_: &mut serde_json::Value) {}

#[test]
fn bad_adapter_configs_are_typed_errors_naming_the_file() {
    let model = tiny();

    type Change = Box<dyn FnOnce(&mut serde_json::Value)>;
    let cases: Vec<(Change, &str)> =
        vec![
        (Box::new(set("r", json!(0))), "rank r is 0; a LoRA adapter needs r >= 1"),
        (
            Box::new(set("bias", json!("all"))),
            "bias is \"all\"; only \"none\" is supported (a trained bias changes the base layer)",
        ),
        (
            Box::new(set("modules_to_save", json!(["lm_head"]))),
            "modules_to_save [\"lm_head\"] is not supported (whole trained copies of base modules)",
        ),
        (
            Box::new(set("target_modules", json!(["q_proj", "gate_proj"]))),
            "target module `gate_proj` is not a linear layer of this model (it has down_proj, \
             in_proj, k_proj, o_proj, out_proj, q_proj, shared_experts.down_proj, \
             shared_experts.up_proj, up_proj, v_proj)",
        ),
        (
            Box::new(set("target_modules", json!(["experts"]))),
            "`experts` cannot be adapted: routed experts cannot be adapted (only the shared \
             expert and the dense layers)",
        ),
        (
            Box::new(set("target_parameters", json!(["experts.up_proj"]))),
            "`experts.up_proj` cannot be adapted: target_parameters adapts parameters such as \
             the routed experts, which cannot be adapted (only the shared expert and the dense \
             layers)",
        ),
        (
            Box::new(set("target_modules", json!(["lm_head"]))),
            "`lm_head` cannot be adapted: lm_head is not part of the main stack; only its linear \
             layers are adapted",
        ),
        (
            Box::new(set("use_dora", json!(true))),
            "use_dora = true is not supported",
        ),
        (
            Box::new(set("rank_pattern", json!({"q_proj": 8}))),
            "rank_pattern = {\"q_proj\":8} is not supported",
        ),
        (
            Box::new(set("peft_type", json!("IA3"))),
            "peft_type is \"IA3\"; only LORA adapters are supported",
        ),
        (
            Box::new(set("lora_alpha", json!("sixteen"))),
            "does not parse as a PEFT adapter config: invalid type: string \"sixteen\", \
             expected f64 at line 1 column 571",
        ),
    ];
    for (change, message) in cases {
        let (_guard, dir) = broken(change, keep);
        check(&model, &dir, CONFIG, message);
    }
    // A target the file has no weights for.
    let (_guard, dir) = broken(set("target_modules", json!(["in_proj", "q_proj"])), keep);
    check(
        &model,
        &dir,
        WEIGHTS,
        "tensor `base_model.model.model.layers.3.mixer.q_proj.lora_A.weight` is missing \
         (target_modules targets this module)",
    );
    // A missing file.
    let (_guard, dir) = broken(keep_config, keep);
    std::fs::remove_file(dir.join(CONFIG)).unwrap();
    let problem = check(
        &model,
        &dir,
        CONFIG,
        "cannot read it: No such file or directory (os error 2)",
    );
    assert!(matches!(problem, AdapterProblem::Unreadable(_)));
    let (_guard, dir) = broken(keep_config, keep);
    std::fs::remove_file(dir.join(WEIGHTS)).unwrap();
    check(
        &model,
        &dir,
        WEIGHTS,
        "cannot read it: No such file or directory (os error 2)",
    );
}

#[test]
fn bad_adapter_tensors_are_typed_errors_naming_the_file() {
    let model = tiny();
    type Change = Box<dyn FnOnce(&mut Vec<(String, Dtype, Vec<usize>, Vec<u8>)>)>;
    let find = |list: &mut Vec<(String, Dtype, Vec<usize>, Vec<u8>)>, name: &str| {
        list.iter().position(|t| t.0 == name).unwrap()
    };
    let cases: Vec<(Change, &str)> = vec![
        (
            Box::new(move |list| {
                let i = find(list, IN_PROJ_A);
                list[i].2 = vec![8, 32];
            }),
            "tensor `base_model.model.model.layers.0.mixer.in_proj.lora_A.weight` has shape \
             [8, 32]; with r = 4 and the base layer (out 196, in 64) it must be [4, 64]",
        ),
        (
            Box::new(move |list| {
                let i = find(list, IN_PROJ_A);
                // bf16 NaN: exponent all ones, mantissa non-zero.
                list[i].3[6..8].copy_from_slice(&[0xc1, 0x7f]);
            }),
            "tensor `base_model.model.model.layers.0.mixer.in_proj.lora_A.weight` holds a \
             non-finite value (NaN) at element 3",
        ),
        (
            Box::new(move |list| {
                let i = find(list, IN_PROJ_A);
                list[i].1 = Dtype::I16;
            }),
            "tensor `base_model.model.model.layers.0.mixer.in_proj.lora_A.weight` has dtype I16; \
             only F32, BF16 and F16 are supported",
        ),
        (
            Box::new(move |list| {
                let i = find(list, IN_PROJ_A);
                list.remove(i);
            }),
            "tensor `base_model.model.model.layers.0.mixer.in_proj.lora_A.weight` is missing \
             (its pair `base_model.model.model.layers.0.mixer.in_proj.lora_B.weight` is in the \
             file)",
        ),
        (
            Box::new(move |list| {
                let i = find(list, IN_PROJ_A);
                list[i].0 = "base_model.model.model.layers.1.mixer.experts.3.up_proj.lora_A.weight"
                    .to_string();
            }),
            "`model.layers.1.mixer.experts.3.up_proj` cannot be adapted: routed experts cannot \
             be adapted (only the shared expert and the dense layers)",
        ),
        (
            Box::new(move |list| {
                let i = find(list, IN_PROJ_A);
                list[i].0 = "base_model.model.model.layers.0.mixer.q_proj.lora_A.weight".into();
            }),
            "target module `model.layers.0.mixer.q_proj` is not a linear layer of this model \
             (layer 0 is linear_attention and has in_proj, out_proj)",
        ),
        (
            Box::new(move |list| {
                let i = find(list, IN_PROJ_A);
                list[i].0 = "base_model.model.model.layers.0.mixer.in_proj.weight".into();
            }),
            "tensor `base_model.model.model.layers.0.mixer.in_proj.weight` is not a LoRA weight \
             (expected base_model.model.<module>.lora_A.weight or .lora_B.weight)",
        ),
        (Box::new(move |list| list.clear()), "holds no LoRA weights"),
    ];
    for (change, message) in cases {
        let (_guard, dir) = broken(keep_config, change);
        check(&model, &dir, WEIGHTS, message);
    }
    // A file that is not safetensors.
    let (_guard, dir) = broken(keep_config, keep);
    std::fs::write(dir.join(WEIGHTS), b"not a safetensors file").unwrap();
    let problem = LoraAdapter::load(&dir, &model).unwrap_err();
    assert!(
        matches!(
            &problem,
            ModelError::Adapter { path, problem: AdapterProblem::Safetensors(_) }
                if path == &dir.join(WEIGHTS)
        ),
        "{problem}"
    );
}

#[test]
fn fan_in_fan_out_and_all_linear_load_the_same_weights() {
    let model = tiny();
    let reference = LoraAdapter::load(&lora_dir("adapter-a"), &model).unwrap();
    // PEFT resets fan_in_fan_out for nn.Linear targets; the stored A and B are the same.
    let (_guard, dir) = broken(set("fan_in_fan_out", serde_json::json!(true)), keep);
    let b = LoraAdapter::load(&dir, &model).unwrap();
    assert_eq!(
        b.fingerprint(),
        LoraAdapter::load(&lora_dir("adapter-b"), &model)
            .unwrap()
            .fingerprint()
    );
    // "all-linear" asks for every module, which adapter-b does not have.
    let (_guard, dir) = broken(set("target_modules", serde_json::json!("all-linear")), keep);
    assert!(LoraAdapter::load(&dir, &model).is_err());
    assert_eq!(reference.targets().len(), 7);
}
