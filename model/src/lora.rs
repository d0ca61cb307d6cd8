//! LoRA adapters in the PEFT format: loading and validating `adapter_config.json` and
//! `adapter_model.safetensors` against a base [`Model`], seeded random adapters, and writing them
//! back in the same format.
//!
//! # What an adapter is
//!
//! For every targeted linear layer `y = x·Wᵀ` of the main stack an adapter holds `A` (`[r, in]`)
//! and `B` (`[out, r]`), and the layer computes `y = x·Wᵀ + scale·((x·Aᵀ)·Bᵀ)` with
//! `scale = lora_alpha / r` (or `lora_alpha / sqrt(r)` with `use_rslora`), as PEFT's `LoraLayer`
//! does. The base weights are never changed: a batch may mix rows of several adapters and rows of
//! none (see `forward`).
//!
//! # Targets
//!
//! Every linear layer of NemotronH's main stack that PEFT can name: Mamba `in_proj` and
//! `out_proj`; attention `q_proj`, `k_proj`, `v_proj`, `o_proj`; the dense MLP's `up_proj` and
//! `down_proj`; the MoE layer's shared expert (`shared_experts.up_proj`, `.down_proj`). Routed
//! experts (stacked parameters in transformers, reachable only through PEFT's
//! `target_parameters`), the router `gate`, the latent projections, `lm_head` and the embeddings
//! are refused with a typed error that says so.
//!
//! # The files
//!
//! Tensor names are `base_model.model.<module path>.lora_A.weight` / `.lora_B.weight`, where the
//! module path is transformers' in-memory one (`model.layers.{i}.mixer.q_proj`) or the checkpoint
//! one (`backbone.layers.{i}...`); f32, bf16 and f16 are read (and held as f32). In
//! `adapter_config.json`: `r`, `lora_alpha`, `use_rslora`, `target_modules` (a list, `"all-linear"`,
//! or a regular expression, which is not checked against the model), `layers_to_transform`,
//! `fan_in_fan_out` (PEFT resets it for `nn.Linear` targets, and every target here is one: the
//! stored `A` and `B` have the same layout either way, so it changes nothing), `bias` (must be
//! `none`) and `modules_to_save` (must be empty). DoRA, `rank_pattern` / `alpha_pattern`,
//! `lora_bias` and `target_parameters` are refused.
//!
//! # Errors
//!
//! Every problem is [`ModelError::Adapter`] naming the file and an [`AdapterProblem`]: a missing
//! file, JSON that does not parse, rank 0, a shape that does not match the base layer, a target
//! module the model does not have, a bias, `modules_to_save`, non-finite values, a weight without
//! its pair, a target without weights.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::Deserialize;

use crate::weights::{
    save_safetensors, write_error, Linear, SafetensorsSource, TensorSource, TensorVisitor,
};
use crate::{Config, LayerKind, Model, ModelError};

/// The file PEFT writes the adapter's settings to.
pub const ADAPTER_CONFIG_FILE: &str = "adapter_config.json";
/// The file PEFT writes the adapter's weights to.
pub const ADAPTER_WEIGHTS_FILE: &str = "adapter_model.safetensors";

/// The linear layers an adapter may target, as an index into a layer's modules.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) enum Target {
    /// Mamba `in_proj`.
    InProj,
    /// Mamba `out_proj`.
    OutProj,
    /// Attention `q_proj`.
    Q,
    /// Attention `k_proj`.
    K,
    /// Attention `v_proj`.
    V,
    /// Attention `o_proj`.
    O,
    /// MLP `up_proj`, or the MoE shared expert's.
    Up,
    /// MLP `down_proj`, or the MoE shared expert's.
    Down,
}

/// How many [`Target`]s there are.
pub(crate) const TARGETS: usize = 8;

impl Target {
    const ALL: [Target; TARGETS] = [
        Target::InProj,
        Target::OutProj,
        Target::Q,
        Target::K,
        Target::V,
        Target::O,
        Target::Up,
        Target::Down,
    ];

    fn index(self) -> usize {
        self as usize
    }

    /// The targets a layer of `kind` has, in module order.
    fn of(kind: LayerKind) -> &'static [Target] {
        match kind {
            LayerKind::Mamba => &[Target::InProj, Target::OutProj],
            LayerKind::Attention => &[Target::Q, Target::K, Target::V, Target::O],
            LayerKind::Mlp | LayerKind::Moe => &[Target::Up, Target::Down],
        }
    }

    /// The module's path below `layers.{i}.mixer.` in a layer of `kind`.
    fn module(self, kind: LayerKind) -> &'static str {
        match (self, kind) {
            (Target::InProj, _) => "in_proj",
            (Target::OutProj, _) => "out_proj",
            (Target::Q, _) => "q_proj",
            (Target::K, _) => "k_proj",
            (Target::V, _) => "v_proj",
            (Target::O, _) => "o_proj",
            (Target::Up, LayerKind::Moe) => "shared_experts.up_proj",
            (Target::Down, LayerKind::Moe) => "shared_experts.down_proj",
            (Target::Up, _) => "up_proj",
            (Target::Down, _) => "down_proj",
        }
    }

    /// `(out, in)` of the base layer this target adapts in a layer of `kind`.
    fn dims(self, config: &Config, kind: LayerKind) -> (usize, usize) {
        let d = config.hidden_size;
        let (nh, nkv, hd) = (
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
        );
        match (self, kind) {
            (Target::InProj, _) => (config.mamba_in_proj_dim(), d),
            (Target::OutProj, _) => (d, config.mamba_inner()),
            (Target::Q, _) => (nh * hd, d),
            (Target::K | Target::V, _) => (nkv * hd, d),
            (Target::O, _) => (d, nh * hd),
            (Target::Up, LayerKind::Moe) => (config.moe_shared_expert_intermediate_size, d),
            (Target::Down, LayerKind::Moe) => (d, config.moe_shared_expert_intermediate_size),
            (Target::Up, _) => (config.intermediate_size, d),
            (Target::Down, _) => (d, config.intermediate_size),
        }
    }
}

/// What is wrong with an adapter (the file is in [`ModelError::Adapter`]).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AdapterProblem {
    /// The file is missing or unreadable.
    #[error("cannot read it: {0}")]
    Unreadable(#[source] std::io::Error),
    /// `adapter_config.json` is not JSON of the PEFT shape.
    #[error("does not parse as a PEFT adapter config: {0}")]
    Json(String),
    /// `peft_type` names another method than LoRA.
    #[error("peft_type is {0:?}; only LORA adapters are supported")]
    NotLora(String),
    /// `r` is 0.
    #[error("rank r is 0; a LoRA adapter needs r >= 1")]
    ZeroRank,
    /// `lora_alpha` is not a finite number.
    #[error("lora_alpha = {0} is not a finite number")]
    BadAlpha(f64),
    /// `bias` is not `none`: PEFT would train the base layers' biases, which changes the base.
    #[error("bias is {0:?}; only \"none\" is supported (a trained bias changes the base layer)")]
    Bias(String),
    /// `modules_to_save` lists modules: PEFT saves whole trained copies of them, which replace
    /// the base model's and cannot be served next to other adapters.
    #[error("modules_to_save {0:?} is not supported (whole trained copies of base modules)")]
    ModulesToSave(Vec<String>),
    /// An option of the config this loader does not implement.
    #[error("{field} = {value} is not supported")]
    Unsupported {
        /// The config field.
        field: &'static str,
        /// Its value, as written.
        value: String,
    },
    /// A target module (in `target_modules` or in a tensor name) that the model does not have.
    #[error("target module `{module}` is not a linear layer of this model{detail}")]
    UnknownModule {
        /// The module as the adapter names it.
        module: String,
        /// Why (which layer kind lacks it), or the modules the model has.
        detail: String,
    },
    /// A module LoRA cannot target here (routed experts, the router, `lm_head`, embeddings).
    #[error("`{module}` cannot be adapted: {reason}")]
    UnsupportedModule {
        /// The module as the adapter names it.
        module: String,
        /// Why.
        reason: &'static str,
    },
    /// A tensor's shape does not match the base layer and the rank.
    #[error("tensor `{tensor}` has shape {actual:?}; with r = {rank} and the base layer (out {out}, in {input}) it must be {expected:?}")]
    Shape {
        /// The tensor.
        tensor: String,
        /// Its shape in the file.
        actual: Vec<usize>,
        /// The shape it must have.
        expected: Vec<usize>,
        /// The adapter's rank.
        rank: usize,
        /// The base layer's output features.
        out: usize,
        /// The base layer's input features.
        input: usize,
    },
    /// A tensor is stored in a dtype other than f32, bf16 or f16.
    #[error("tensor `{tensor}` has dtype {dtype}; only F32, BF16 and F16 are supported")]
    Dtype {
        /// The tensor.
        tensor: String,
        /// Its dtype.
        dtype: String,
    },
    /// A tensor holds NaN or an infinity.
    #[error("tensor `{tensor}` holds a non-finite value ({value}) at element {index}")]
    NonFinite {
        /// The tensor.
        tensor: String,
        /// The first bad element (row-major).
        index: usize,
        /// Its value.
        value: f32,
    },
    /// A tensor whose pair (`lora_A` for `lora_B` or the reverse), or a targeted module's
    /// weights, are not in the file.
    #[error("tensor `{tensor}` is missing ({why})")]
    MissingTensor {
        /// The tensor expected.
        tensor: String,
        /// Why it is expected.
        why: String,
    },
    /// A tensor whose name is not a LoRA weight of a module path.
    #[error("tensor `{0}` is not a LoRA weight (expected base_model.model.<module>.lora_A.weight or .lora_B.weight)")]
    UnexpectedTensor(String),
    /// The safetensors file is truncated or corrupt.
    #[error("invalid safetensors: {0}")]
    Safetensors(String),
    /// The file holds no LoRA weights at all.
    #[error("holds no LoRA weights")]
    Empty,
}

/// `adapter_config.json` as PEFT writes it; fields this loader does not need are ignored.
#[derive(Debug, Deserialize)]
struct PeftConfig {
    #[serde(default)]
    peft_type: Option<String>,
    /// PEFT's default rank.
    #[serde(default = "default_rank")]
    r: usize,
    #[serde(default = "default_alpha")]
    lora_alpha: f64,
    #[serde(default)]
    use_rslora: bool,
    #[serde(default)]
    target_modules: Option<serde_json::Value>,
    #[serde(default)]
    fan_in_fan_out: bool,
    #[serde(default)]
    bias: Option<String>,
    #[serde(default)]
    modules_to_save: Option<Vec<String>>,
    #[serde(default)]
    use_dora: bool,
    #[serde(default)]
    lora_bias: bool,
    #[serde(default)]
    rank_pattern: Option<BTreeMap<String, serde_json::Value>>,
    #[serde(default)]
    alpha_pattern: Option<BTreeMap<String, serde_json::Value>>,
    #[serde(default)]
    target_parameters: Option<Vec<String>>,
    #[serde(default)]
    layers_to_transform: Option<serde_json::Value>,
    #[serde(default)]
    layers_pattern: Option<serde_json::Value>,
    #[serde(default)]
    exclude_modules: Option<serde_json::Value>,
    #[serde(default)]
    layer_replication: Option<serde_json::Value>,
    #[serde(default)]
    alora_invocation_tokens: Option<serde_json::Value>,
    #[serde(default)]
    trainable_token_indices: Option<serde_json::Value>,
    #[serde(default)]
    arrow_config: Option<serde_json::Value>,
}

fn default_rank() -> usize {
    8
}

fn default_alpha() -> f64 {
    8.0
}

/// One adapted linear layer: `A` as a `[r, in]` map and `B` as an `[out, r]` map.
#[derive(Debug, Clone)]
pub(crate) struct LoraLinear {
    /// `x·Aᵀ`: `in -> r`.
    pub a: Linear,
    /// `t·Bᵀ`: `r -> out`.
    pub b: Linear,
}

/// The adapted modules of one layer, indexed by [`Target`].
#[derive(Debug, Clone, Default)]
pub(crate) struct LayerLora {
    pub modules: [Option<LoraLinear>; TARGETS],
}

impl LayerLora {
    pub(crate) fn get(&self, target: Target) -> Option<&LoraLinear> {
        self.modules[target.index()].as_ref()
    }
}

/// How a random adapter is made ([`LoraAdapter::random`]).
#[derive(Debug, Clone, PartialEq)]
pub struct LoraSpec {
    /// The rank `r` (at least 1).
    pub rank: usize,
    /// `lora_alpha`.
    pub alpha: f64,
    /// Scale by `alpha / sqrt(r)` instead of `alpha / r`.
    pub rslora: bool,
    /// Module names as PEFT's `target_modules` lists them (`q_proj`, `in_proj`, `up_proj`, ...);
    /// each targets every layer that has a module of that name. The single entry `all-linear`
    /// (PEFT's shorthand) targets every linear layer of the main stack the model has.
    pub targets: Vec<String>,
    /// `B`'s values are uniform in `±b_range / sqrt(r)` (0 gives an adapter that changes
    /// nothing, as PEFT's initialisation does).
    pub b_range: f32,
}

impl LoraSpec {
    /// Rank `rank`, `lora_alpha = 2 r`, every linear layer of the main stack (`all-linear`),
    /// `b_range` 0.5.
    pub fn all_linear(rank: usize) -> Self {
        LoraSpec {
            rank,
            alpha: 2.0 * rank as f64,
            rslora: false,
            targets: vec![ALL_LINEAR.to_string()],
            b_range: 0.5,
        }
    }
}

/// A LoRA adapter for one base model, validated against it.
#[derive(Debug, Clone)]
pub struct LoraAdapter {
    path: Option<PathBuf>,
    base_fingerprint: u64,
    rank: usize,
    alpha: f64,
    rslora: bool,
    scale: f32,
    /// One entry per layer of the base model.
    pub(crate) layers: Vec<LayerLora>,
    /// The `target_modules` names, sorted.
    targets: Vec<String>,
    fingerprint: u64,
}

fn adapter_error(path: &Path, problem: AdapterProblem) -> ModelError {
    ModelError::Adapter {
        path: path.to_owned(),
        problem,
    }
}

/// A module named by a tensor: the layer, the target, and whether it is `lora_A`.
struct Named {
    layer: usize,
    target: Target,
    is_a: bool,
}

/// What a PEFT module path (`model.layers.3.mixer.q_proj`) is in `config`.
fn parse_module(config: &Config, module: &str) -> Result<(usize, Target), AdapterProblem> {
    let unknown = |detail: String| AdapterProblem::UnknownModule {
        module: module.to_string(),
        detail,
    };
    let unsupported = |reason| AdapterProblem::UnsupportedModule {
        module: module.to_string(),
        reason,
    };
    if module == "lm_head" {
        return Err(unsupported(
            "lm_head is not part of the main stack; only its linear layers are adapted",
        ));
    }
    let rest = module
        .strip_prefix("model.")
        .or_else(|| module.strip_prefix("backbone."))
        .ok_or_else(|| unknown(String::new()))?;
    if rest.starts_with("embeddings") {
        return Err(unsupported("embedding LoRA is not supported"));
    }
    let rest = rest
        .strip_prefix("layers.")
        .ok_or_else(|| unknown(String::new()))?;
    let (index, rest) = rest.split_once('.').ok_or_else(|| unknown(String::new()))?;
    let layer: usize = index.parse().map_err(|_| unknown(String::new()))?;
    let kind = *config.layer_kinds.get(layer).ok_or_else(|| {
        unknown(format!(
            " (the model has {} layers)",
            config.layer_kinds.len()
        ))
    })?;
    let path = rest
        .strip_prefix("mixer.")
        .ok_or_else(|| unknown(String::new()))?;
    if path.starts_with("experts.") || path == "experts" {
        return Err(unsupported(
            "routed experts cannot be adapted (only the shared expert and the dense layers)",
        ));
    }
    if path == "gate" {
        return Err(unsupported(
            "the MoE router is not a linear layer PEFT adapts",
        ));
    }
    if path.ends_with("latent_proj") {
        return Err(unsupported("the MoE latent projections are not supported"));
    }
    Target::of(kind)
        .iter()
        .copied()
        .find(|t| t.module(kind) == path)
        .map(|t| (layer, t))
        .ok_or_else(|| {
            let has: Vec<&str> = Target::of(kind).iter().map(|t| t.module(kind)).collect();
            unknown(format!(
                " (layer {layer} is {} and has {})",
                kind.block_type(),
                has.join(", ")
            ))
        })
}

/// Splits a tensor name into its module and the half it holds.
fn parse_tensor(config: &Config, name: &str) -> Result<Named, AdapterProblem> {
    let body = name
        .strip_prefix("base_model.model.")
        .ok_or_else(|| AdapterProblem::UnexpectedTensor(name.to_string()))?;
    let (module, is_a) = if let Some(module) = body.strip_suffix(".lora_A.weight") {
        (module, true)
    } else if let Some(module) = body.strip_suffix(".lora_B.weight") {
        (module, false)
    } else {
        if body.contains("lora_embedding") {
            return Err(AdapterProblem::UnsupportedModule {
                module: body.to_string(),
                reason: "embedding LoRA is not supported",
            });
        }
        if body.contains("lora_magnitude_vector") {
            return Err(AdapterProblem::Unsupported {
                field: "use_dora",
                value: "true (the file holds DoRA magnitudes)".to_string(),
            });
        }
        return Err(AdapterProblem::UnexpectedTensor(name.to_string()));
    };
    let (layer, target) = parse_module(config, module)?;
    Ok(Named {
        layer,
        target,
        is_a,
    })
}

/// The module keys of `config` that PEFT would match against `target_modules` entries (both
/// module-tree prefixes), with the layer and target each stands for.
fn module_keys(config: &Config) -> Vec<(String, usize, Target)> {
    let mut keys = Vec::new();
    for (layer, &kind) in config.layer_kinds.iter().enumerate() {
        for &target in Target::of(kind) {
            for prefix in ["model", "backbone"] {
                keys.push((
                    format!("{prefix}.layers.{layer}.mixer.{}", target.module(kind)),
                    layer,
                    target,
                ));
            }
        }
    }
    keys
}

/// PEFT's rule for a list entry: the key equals it or ends with `.` followed by it.
fn peft_matches(key: &str, entry: &str) -> bool {
    key == entry
        || key
            .strip_suffix(entry)
            .is_some_and(|head| head.ends_with('.'))
}

/// Checks one `target_modules` entry and adds the modules it targets to `wanted`.
fn check_target_entry(
    config: &Config,
    keys: &[(String, usize, Target)],
    entry: &str,
    wanted: &mut BTreeSet<(usize, Target)>,
) -> Result<(), AdapterProblem> {
    let mut matched = false;
    for (key, layer, target) in keys {
        if peft_matches(key, entry) {
            matched = true;
            wanted.insert((*layer, *target));
        }
    }
    if matched {
        return Ok(());
    }
    let unsupported = |reason| AdapterProblem::UnsupportedModule {
        module: entry.to_string(),
        reason,
    };
    let last = entry.rsplit('.').next().unwrap_or(entry);
    match last {
        "lm_head" => Err(unsupported(
            "lm_head is not part of the main stack; only its linear layers are adapted",
        )),
        "embeddings" => Err(unsupported("embedding LoRA is not supported")),
        "experts" => Err(unsupported(
            "routed experts cannot be adapted (only the shared expert and the dense layers)",
        )),
        "gate" => Err(unsupported(
            "the MoE router is not a linear layer PEFT adapts",
        )),
        "fc1_latent_proj" | "fc2_latent_proj" => {
            Err(unsupported("the MoE latent projections are not supported"))
        }
        _ => {
            let mut names: Vec<&str> = config
                .layer_kinds
                .iter()
                .flat_map(|&kind| Target::of(kind).iter().map(move |t| t.module(kind)))
                .collect();
            names.sort_unstable();
            names.dedup();
            Err(AdapterProblem::UnknownModule {
                module: entry.to_string(),
                detail: format!(" (it has {})", names.join(", ")),
            })
        }
    }
}

/// The layers `layers_to_transform` keeps (`None`: all).
fn layers_kept(
    value: &Option<serde_json::Value>,
) -> Result<Option<BTreeSet<usize>>, AdapterProblem> {
    let bad = |value: &serde_json::Value| AdapterProblem::Unsupported {
        field: "layers_to_transform",
        value: value.to_string(),
    };
    match value {
        None | Some(serde_json::Value::Null) => Ok(None),
        Some(v @ serde_json::Value::Number(n)) => {
            let layer = n.as_u64().ok_or_else(|| bad(v))?;
            Ok(Some(BTreeSet::from([layer as usize])))
        }
        Some(v @ serde_json::Value::Array(items)) => items
            .iter()
            .map(|item| item.as_u64().map(|n| n as usize).ok_or_else(|| bad(v)))
            .collect::<Result<BTreeSet<_>, _>>()
            .map(Some),
        Some(other) => Err(bad(other)),
    }
}

/// The `(layer, target)` pairs an adapter config asks for; `None` when it cannot be told.
type Wanted = Option<BTreeSet<(usize, Target)>>;

/// Which `(layer, target)` pairs the config asks for: `None` when it cannot be told without a
/// regular expression engine (a string other than `all-linear`).
fn wanted_modules(
    config: &Config,
    peft: &PeftConfig,
) -> Result<(Wanted, Vec<String>), AdapterProblem> {
    let keys = module_keys(config);
    let mut wanted = BTreeSet::new();
    let names: Vec<String> = match &peft.target_modules {
        None | Some(serde_json::Value::Null) => {
            return Err(AdapterProblem::Json(
                "target_modules is missing (PEFT cannot infer it for NemotronH)".to_string(),
            ))
        }
        Some(serde_json::Value::String(s)) if s == ALL_LINEAR => {
            for (_, layer, target) in &keys {
                wanted.insert((*layer, *target));
            }
            vec![s.clone()]
        }
        Some(serde_json::Value::String(s)) => return Ok((None, vec![s.clone()])),
        Some(serde_json::Value::Array(items)) => {
            let mut names = Vec::with_capacity(items.len());
            for item in items {
                let entry = item.as_str().ok_or_else(|| {
                    AdapterProblem::Json(format!("target_modules entry {item} is not a string"))
                })?;
                check_target_entry(config, &keys, entry, &mut wanted)?;
                names.push(entry.to_string());
            }
            if names.is_empty() {
                return Err(AdapterProblem::Json("target_modules is empty".to_string()));
            }
            names.sort();
            names.dedup();
            names
        }
        Some(other) => {
            return Err(AdapterProblem::Json(format!(
                "target_modules is {other}, expected a list of module names or a string"
            )))
        }
    };
    if let Some(kept) = layers_kept(&peft.layers_to_transform)? {
        match &peft.layers_pattern {
            None | Some(serde_json::Value::Null) => {}
            Some(serde_json::Value::String(s)) if s == "layers" => {}
            Some(serde_json::Value::Array(items))
                if items.len() == 1 && items[0].as_str() == Some("layers") => {}
            Some(other) => {
                return Err(AdapterProblem::Unsupported {
                    field: "layers_pattern",
                    value: other.to_string(),
                })
            }
        }
        wanted.retain(|(layer, _)| kept.contains(layer));
    }
    match &peft.exclude_modules {
        None | Some(serde_json::Value::Null) => {}
        Some(serde_json::Value::Array(items)) => {
            for entry in items.iter().filter_map(serde_json::Value::as_str) {
                for (key, layer, target) in &keys {
                    if peft_matches(key, entry) {
                        wanted.remove(&(*layer, *target));
                    }
                }
            }
        }
        // A regular expression: which modules it excludes is not checked.
        Some(_) => return Ok((None, names)),
    }
    Ok((Some(wanted), names))
}

/// Checks the config fields that must hold for any adapter this crate serves.
fn check_peft_config(peft: &PeftConfig) -> Result<(), AdapterProblem> {
    if let Some(kind) = &peft.peft_type {
        if kind != "LORA" {
            return Err(AdapterProblem::NotLora(kind.clone()));
        }
    }
    if peft.r == 0 {
        return Err(AdapterProblem::ZeroRank);
    }
    if !peft.lora_alpha.is_finite() {
        return Err(AdapterProblem::BadAlpha(peft.lora_alpha));
    }
    if let Some(bias) = &peft.bias {
        if bias != "none" {
            return Err(AdapterProblem::Bias(bias.clone()));
        }
    }
    if let Some(modules) = &peft.modules_to_save {
        if !modules.is_empty() {
            return Err(AdapterProblem::ModulesToSave(modules.clone()));
        }
    }
    if peft.use_dora {
        return Err(AdapterProblem::Unsupported {
            field: "use_dora",
            value: "true".to_string(),
        });
    }
    if peft.lora_bias {
        return Err(AdapterProblem::Unsupported {
            field: "lora_bias",
            value: "true".to_string(),
        });
    }
    for (field, pattern) in [
        ("rank_pattern", &peft.rank_pattern),
        ("alpha_pattern", &peft.alpha_pattern),
    ] {
        if let Some(pattern) = pattern {
            if !pattern.is_empty() {
                return Err(AdapterProblem::Unsupported {
                    field,
                    value: serde_json::to_string(pattern).unwrap_or_default(),
                });
            }
        }
    }
    // Options that change more than the adapted layers' outputs (layer copies, activation
    // tokens, trained embedding rows, routing between adapters).
    for (field, value) in [
        ("layer_replication", &peft.layer_replication),
        ("alora_invocation_tokens", &peft.alora_invocation_tokens),
        ("trainable_token_indices", &peft.trainable_token_indices),
        ("arrow_config", &peft.arrow_config),
    ] {
        if let Some(value) = value.as_ref().filter(|v| !v.is_null()) {
            return Err(AdapterProblem::Unsupported {
                field,
                value: value.to_string(),
            });
        }
    }
    if let Some(params) = &peft.target_parameters {
        if !params.is_empty() {
            return Err(AdapterProblem::UnsupportedModule {
                module: params.join(", "),
                reason: "target_parameters adapts parameters such as the routed experts, which \
                         cannot be adapted (only the shared expert and the dense layers)",
            });
        }
    }
    Ok(())
}

/// Turns an error of the safetensors reader into the adapter's problem.
fn tensor_problem(err: ModelError) -> AdapterProblem {
    match err {
        ModelError::TensorDtype { name, dtype, .. } => AdapterProblem::Dtype {
            tensor: name,
            dtype,
        },
        ModelError::NonFiniteWeight {
            name, index, value, ..
        } => AdapterProblem::NonFinite {
            tensor: name,
            index,
            value,
        },
        ModelError::Safetensors { reason, .. } => AdapterProblem::Safetensors(reason),
        ModelError::MissingTensor { name } => AdapterProblem::MissingTensor {
            tensor: name,
            why: "named by the adapter".to_string(),
        },
        other => AdapterProblem::Safetensors(other.to_string()),
    }
}

/// PEFT's shorthand for every linear layer but the output layer.
const ALL_LINEAR: &str = "all-linear";

/// `target_modules` as PEFT writes it: the string `all-linear`, or a list of names.
fn target_modules_json(targets: &[String]) -> serde_json::Value {
    match targets {
        [only] if only == ALL_LINEAR => serde_json::Value::from(ALL_LINEAR),
        names => serde_json::Value::from(names.to_vec()),
    }
}

fn scale_of(alpha: f64, rank: usize, rslora: bool) -> f32 {
    let r = rank as f64;
    let scale = if rslora { alpha / r.sqrt() } else { alpha / r };
    scale as f32
}

impl LoraAdapter {
    /// Loads the PEFT adapter in `dir` (`adapter_config.json`, `adapter_model.safetensors`) for
    /// `model`, checking every tensor against the base layer it adapts.
    pub fn load(dir: &Path, model: &Model) -> Result<LoraAdapter, ModelError> {
        let config = model.config();
        let config_path = dir.join(ADAPTER_CONFIG_FILE);
        let text = std::fs::read_to_string(&config_path)
            .map_err(|e| adapter_error(&config_path, AdapterProblem::Unreadable(e)))?;
        let peft: PeftConfig = serde_json::from_str(&text)
            .map_err(|e| adapter_error(&config_path, AdapterProblem::Json(e.to_string())))?;
        check_peft_config(&peft).map_err(|p| adapter_error(&config_path, p))?;
        let (wanted, targets) =
            wanted_modules(config, &peft).map_err(|p| adapter_error(&config_path, p))?;
        if peft.fan_in_fan_out {
            tracing::debug!(
                dir = %dir.display(),
                "fan_in_fan_out is set; every target is a linear layer, for which PEFT ignores it"
            );
        }

        let weights_path = dir.join(ADAPTER_WEIGHTS_FILE);
        let bytes = std::fs::read(&weights_path)
            .map_err(|e| adapter_error(&weights_path, AdapterProblem::Unreadable(e)))?;
        let files = [(weights_path.clone(), bytes)];
        let mut source = SafetensorsSource::new(&files)
            .map_err(|err| adapter_error(&weights_path, tensor_problem(err)))?;
        let fail = |problem| adapter_error(&weights_path, problem);
        let rank = peft.r;
        let mut found: BTreeMap<(usize, Target), [Option<String>; 2]> = BTreeMap::new();
        for name in source.names() {
            let named = parse_tensor(config, &name).map_err(fail)?;
            let halves = found.entry((named.layer, named.target)).or_default();
            halves[usize::from(!named.is_a)] = Some(name);
        }
        if found.is_empty() {
            return Err(fail(AdapterProblem::Empty));
        }
        if let Some(wanted) = &wanted {
            if let Some(&(layer, target)) = wanted.iter().find(|key| !found.contains_key(key)) {
                let kind = config.layer_kinds[layer];
                return Err(fail(AdapterProblem::MissingTensor {
                    tensor: format!(
                        "base_model.model.model.layers.{layer}.mixer.{}.lora_A.weight",
                        target.module(kind)
                    ),
                    why: "target_modules targets this module".to_string(),
                }));
            }
        }
        let mut layers = vec![LayerLora::default(); config.layer_kinds.len()];
        for ((layer, target), halves) in found {
            let kind = config.layer_kinds[layer];
            let (out, input) = target.dims(config, kind);
            let [a_name, b_name] = halves;
            let pair = |present: &Option<String>, suffix: &str| {
                let other = a_name
                    .as_ref()
                    .or(b_name.as_ref())
                    .cloned()
                    .unwrap_or_default();
                present
                    .clone()
                    .ok_or_else(|| AdapterProblem::MissingTensor {
                        tensor: other.replace(
                            if suffix == "A" {
                                ".lora_B."
                            } else {
                                ".lora_A."
                            },
                            &format!(".lora_{suffix}."),
                        ),
                        why: format!("its pair `{other}` is in the file"),
                    })
            };
            let a_name = pair(&a_name, "A").map_err(fail)?;
            let b_name = pair(&b_name, "B").map_err(fail)?;
            let mut read = |name: &str, shape: [usize; 2]| {
                source.tensor(name, &shape).map_err(|err| match err {
                    ModelError::TensorShape { actual, .. } => AdapterProblem::Shape {
                        tensor: name.to_string(),
                        actual,
                        expected: shape.to_vec(),
                        rank,
                        out,
                        input,
                    },
                    other => tensor_problem(other),
                })
            };
            let a = read(&a_name, [rank, input]).map_err(fail)?;
            let b = read(&b_name, [out, rank]).map_err(fail)?;
            layers[layer].modules[target.index()] = Some(LoraLinear {
                a: Linear::from_rows(&a, None, rank, input),
                b: Linear::from_rows(&b, None, out, rank),
            });
        }
        let mut adapter = LoraAdapter {
            path: Some(dir.to_owned()),
            base_fingerprint: model.fingerprint(),
            rank,
            alpha: peft.lora_alpha,
            rslora: peft.use_rslora,
            scale: scale_of(peft.lora_alpha, rank, peft.use_rslora),
            layers,
            targets,
            fingerprint: 0,
        };
        adapter.fingerprint = adapter.compute_fingerprint(config);
        tracing::debug!(
            dir = %dir.display(),
            rank,
            scale = adapter.scale,
            modules = adapter.module_count(),
            "loaded LoRA adapter"
        );
        Ok(adapter)
    }

    /// A seeded random adapter for `model` (same seed, same adapter): `A` uniform in
    /// `±1/sqrt(in)`, `B` uniform in `±spec.b_range/sqrt(r)`.
    pub fn random(model: &Model, spec: &LoraSpec, seed: u64) -> Result<LoraAdapter, ModelError> {
        let config = model.config();
        let here = Path::new("<random adapter>");
        if spec.rank == 0 {
            return Err(adapter_error(here, AdapterProblem::ZeroRank));
        }
        if !spec.alpha.is_finite() {
            return Err(adapter_error(here, AdapterProblem::BadAlpha(spec.alpha)));
        }
        let peft = PeftConfig {
            peft_type: None,
            r: spec.rank,
            lora_alpha: spec.alpha,
            use_rslora: spec.rslora,
            target_modules: Some(target_modules_json(&spec.targets)),
            fan_in_fan_out: false,
            bias: None,
            modules_to_save: None,
            use_dora: false,
            lora_bias: false,
            rank_pattern: None,
            alpha_pattern: None,
            target_parameters: None,
            layers_to_transform: None,
            layers_pattern: None,
            exclude_modules: None,
            layer_replication: None,
            alora_invocation_tokens: None,
            trainable_token_indices: None,
            arrow_config: None,
        };
        let (wanted, targets) =
            wanted_modules(config, &peft).map_err(|p| adapter_error(here, p))?;
        let wanted = wanted.unwrap_or_default();
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let mut uniform = |n: usize, range: f32| -> Vec<f32> {
            (0..n)
                .map(|_| {
                    if range > 0.0 {
                        rng.random_range(-range..range)
                    } else {
                        0.0
                    }
                })
                .collect()
        };
        let mut layers = vec![LayerLora::default(); config.layer_kinds.len()];
        let r = spec.rank;
        for (layer, target) in wanted {
            let (out, input) = target.dims(config, config.layer_kinds[layer]);
            let a = uniform(r * input, 1.0 / (input as f32).sqrt());
            let b = uniform(out * r, spec.b_range / (r as f32).sqrt());
            layers[layer].modules[target.index()] = Some(LoraLinear {
                a: Linear::from_rows(&a, None, r, input),
                b: Linear::from_rows(&b, None, out, r),
            });
        }
        let mut adapter = LoraAdapter {
            path: None,
            base_fingerprint: model.fingerprint(),
            rank: r,
            alpha: spec.alpha,
            rslora: spec.rslora,
            scale: scale_of(spec.alpha, r, spec.rslora),
            layers,
            targets,
            fingerprint: 0,
        };
        adapter.fingerprint = adapter.compute_fingerprint(config);
        Ok(adapter)
    }

    /// Writes the adapter in PEFT's format (`adapter_config.json` and an f32
    /// `adapter_model.safetensors` with transformers' module names), so that
    /// [`LoraAdapter::load`] gives it back and PEFT can load it onto the same base model.
    pub fn save(&self, dir: &Path, config: &Config) -> Result<(), ModelError> {
        std::fs::create_dir_all(dir).map_err(|e| write_error(dir, e))?;
        let settings = serde_json::json!({
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "r": self.rank,
            "lora_alpha": self.alpha,
            "use_rslora": self.rslora,
            "target_modules": target_modules_json(&self.targets),
            "fan_in_fan_out": false,
            "bias": "none",
            "modules_to_save": null,
            "lora_dropout": 0.0,
            "use_dora": false,
        });
        let config_path = dir.join(ADAPTER_CONFIG_FILE);
        let text =
            serde_json::to_string_pretty(&settings).map_err(|e| write_error(&config_path, e))?;
        std::fs::write(&config_path, text).map_err(|e| write_error(&config_path, e))?;
        save_safetensors(dir, ADAPTER_WEIGHTS_FILE, |visit| {
            self.visit_tensors(config, visit)
        })
    }

    /// Calls `f` with every tensor's PEFT name, shape and values, in layer and module order.
    fn visit_tensors(&self, config: &Config, f: &mut TensorVisitor<'_>) {
        let mut buf = Vec::new();
        for (layer, lora) in self.layers.iter().enumerate() {
            let kind = config.layer_kinds[layer];
            for &target in &Target::ALL {
                let Some(pair) = lora.get(target) else {
                    continue;
                };
                let stem = format!(
                    "base_model.model.model.layers.{layer}.mixer.{}",
                    target.module(kind)
                );
                pair.a.rows_into(&mut buf);
                f(
                    &format!("{stem}.lora_A.weight"),
                    &[pair.a.out_dim, pair.a.in_dim],
                    &buf,
                );
                pair.b.rows_into(&mut buf);
                f(
                    &format!("{stem}.lora_B.weight"),
                    &[pair.b.out_dim, pair.b.in_dim],
                    &buf,
                );
            }
        }
    }

    fn compute_fingerprint(&self, config: &Config) -> u64 {
        let mut hasher = xxhash_rust::xxh3::Xxh3::new();
        hasher.update(&self.base_fingerprint.to_le_bytes());
        hasher.update(&self.scale.to_le_bytes());
        self.visit_tensors(config, &mut |name, shape, data| {
            hasher.update(name.as_bytes());
            for &dim in shape {
                hasher.update(&(dim as u64).to_le_bytes());
            }
            hasher.update(bytemuck::cast_slice::<f32, u8>(data));
        });
        hasher.digest()
    }

    /// The folder it was loaded from (`None` for a random adapter).
    pub fn path(&self) -> Option<&Path> {
        self.path.as_deref()
    }

    /// The rank `r`.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// `lora_alpha`.
    pub fn alpha(&self) -> f64 {
        self.alpha
    }

    /// Whether the scale is rsLoRA's `alpha / sqrt(r)`.
    pub fn rslora(&self) -> bool {
        self.rslora
    }

    /// The factor of the adapter's term: `alpha / r`, or `alpha / sqrt(r)` with rsLoRA.
    pub fn scale(&self) -> f32 {
        self.scale
    }

    /// The `target_modules` entries, sorted.
    pub fn targets(&self) -> &[String] {
        &self.targets
    }

    /// How many linear layers the adapter changes.
    pub fn module_count(&self) -> usize {
        self.layers
            .iter()
            .map(|l| l.modules.iter().filter(|m| m.is_some()).count())
            .sum()
    }

    /// The adapted modules as PEFT names them below the model (`model.layers.3.mixer.q_proj`),
    /// in layer and module order.
    pub fn modules(&self, config: &Config) -> Vec<String> {
        let mut names = Vec::new();
        for (layer, lora) in self.layers.iter().enumerate() {
            let Some(&kind) = config.layer_kinds.get(layer) else {
                continue;
            };
            for &target in &Target::ALL {
                if lora.get(target).is_some() {
                    names.push(format!(
                        "model.layers.{layer}.mixer.{}",
                        target.module(kind)
                    ));
                }
            }
        }
        names
    }

    /// The fingerprint of the base model the adapter was checked against.
    pub fn base_fingerprint(&self) -> u64 {
        self.base_fingerprint
    }

    /// xxh3 of the base model's fingerprint, the scale and every weight: equal fingerprints mean
    /// interchangeable adapters.
    pub fn fingerprint(&self) -> u64 {
        self.fingerprint
    }

    /// Bytes of its weights in memory (f32).
    pub fn bytes(&self) -> usize {
        self.layers
            .iter()
            .flat_map(|l| l.modules.iter().flatten())
            .map(|m| 4 * (m.a.out_dim * m.a.in_dim + m.b.out_dim * m.b.in_dim))
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peft_list_matching_is_by_dotted_suffix() {
        assert!(peft_matches("model.layers.3.mixer.q_proj", "q_proj"));
        assert!(peft_matches("model.layers.3.mixer.q_proj", "mixer.q_proj"));
        assert!(peft_matches(
            "model.layers.3.mixer.q_proj",
            "model.layers.3.mixer.q_proj"
        ));
        assert!(!peft_matches("model.layers.3.mixer.q_proj", "_proj"));
        assert!(!peft_matches("model.layers.3.mixer.q_proj", "3.mixer.q"));
        assert!(peft_matches(
            "model.layers.1.mixer.shared_experts.up_proj",
            "up_proj"
        ));
    }

    #[test]
    fn scale_follows_lora_and_rslora() {
        assert_eq!(scale_of(16.0, 8, false), 2.0);
        assert_eq!(scale_of(16.0, 4, true), 8.0);
    }
}
