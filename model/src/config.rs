//! `config.json` for the NemotronH family: serde parsing (both layout forms, the legacy key aliases,
//! `{"__float__": "Infinity"}`), validation that names the bad field, and built-in configs.
//!
//! Invariants of a [`Config`] that passed [`Config::validate`] (every constructor in this crate
//! validates): `num_hidden_layers == layer_kinds.len() > 0`; the sizes of every layer kind that
//! occurs in `layer_kinds` are non-zero; `n_groups` divides `mamba_num_heads`;
//! `num_key_value_heads` divides `num_attention_heads`; `n_group` divides `n_routed_experts` with
//! at least two experts per group; `1 <= topk_group <= n_group`; `1 <= num_experts_per_tok <=
//! topk_group * experts_per_group`; `vocab_size <= u32::MAX`. Sizes of kinds that do not occur are
//! whatever the file said (zero when absent) and are never read.

use serde::{Deserialize, Serialize};

use crate::ModelError;

/// One block of the stack.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub enum LayerKind {
    /// Mamba2 mixer (`M`, `linear_attention`, legacy `mamba`).
    Mamba,
    /// Causal GQA self-attention without positional encoding (`*`, `full_attention`, legacy `attention`).
    Attention,
    /// Dense ReLU² MLP (`-`, `mlp`).
    Mlp,
    /// Routed mixture of experts plus one shared expert (`E`, `moe`).
    Moe,
}

impl LayerKind {
    /// The kind of a `hybrid_override_pattern` letter.
    pub fn from_letter(letter: char) -> Option<Self> {
        match letter {
            'M' => Some(Self::Mamba),
            '*' => Some(Self::Attention),
            '-' => Some(Self::Mlp),
            'E' => Some(Self::Moe),
            _ => None,
        }
    }

    /// The kind of a `layers_block_type` entry (current and legacy names).
    pub fn from_block_type(name: &str) -> Option<Self> {
        match name {
            "linear_attention" | "mamba" => Some(Self::Mamba),
            "full_attention" | "attention" => Some(Self::Attention),
            "mlp" => Some(Self::Mlp),
            "moe" => Some(Self::Moe),
            _ => None,
        }
    }

    /// The pattern letter.
    pub fn letter(self) -> char {
        match self {
            Self::Mamba => 'M',
            Self::Attention => '*',
            Self::Mlp => '-',
            Self::Moe => 'E',
        }
    }

    /// The `layers_block_type` name transformers 5.23 writes.
    pub fn block_type(self) -> &'static str {
        match self {
            Self::Mamba => "linear_attention",
            Self::Attention => "full_attention",
            Self::Mlp => "mlp",
            Self::Moe => "moe",
        }
    }
}

/// Which tokens get transformers' lower clamp `dt = max(dt, time_step_min)` (ARCH.md §3.5).
///
/// transformers clamps in its multi-token path and not in its single-token decode step. This crate
/// applies one convention to every token of both entry points, so a row's logits never depend on
/// how its tokens were cut into calls (chunk invariance, cache transparency). With the clamp
/// inactive (true for the fixtures) both conventions equal transformers exactly.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
pub enum DtClamp {
    /// Clamp every token (transformers' prefill convention; the default).
    #[default]
    TimeStepMin,
    /// Never clamp (transformers' decode-step convention, and vLLM's with `time_step_limit = (0, inf)`).
    Off,
}

/// A validated NemotronH configuration. Field names follow `config.json`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Config {
    /// Vocabulary size `V`.
    pub vocab_size: usize,
    /// Model width `d`.
    pub hidden_size: usize,
    /// Always `layer_kinds.len()` (a value stored in the file is ignored, as transformers does).
    pub num_hidden_layers: usize,
    /// One kind per layer, in order.
    pub layer_kinds: Vec<LayerKind>,
    /// eps of every RMSNorm (block pre-norms, final norm, Mamba gated norm).
    pub layer_norm_epsilon: f64,

    /// Mamba heads `H`.
    pub mamba_num_heads: usize,
    /// Mamba head width `P`.
    pub mamba_head_dim: usize,
    /// SSM state size `N`.
    pub ssm_state_size: usize,
    /// B/C groups `G` (also the gated-norm groups).
    pub n_groups: usize,
    /// Depthwise conv width `K`.
    pub conv_kernel: usize,
    /// Lower clamp on dt (see [`DtClamp`]).
    pub time_step_min: f64,
    /// Ignored by the forward (initialisation only).
    pub time_step_max: f64,
    /// Ignored by the forward (initialisation only).
    pub time_step_floor: f64,
    /// Ignored by the forward (transformers hard-codes `(time_step_min, inf)`).
    pub time_step_limit: (f64, f64),
    /// Bias on `in_proj` / `out_proj`.
    pub use_bias: bool,
    /// Bias on the depthwise conv.
    pub use_conv_bias: bool,
    /// SSD block length in transformers; affects rounding only, unused here (the recurrence is per token).
    pub chunk_size: usize,
    /// Activation after the conv (only `silu`).
    pub mamba_hidden_act: String,
    /// Which tokens get the dt clamp. Not part of `config.json`.
    pub dt_clamp: DtClamp,

    /// Query heads.
    pub num_attention_heads: usize,
    /// Key/value heads.
    pub num_key_value_heads: usize,
    /// Attention head width (explicit; `hidden_size / num_attention_heads` when absent).
    pub head_dim: usize,

    /// Dense MLP width.
    pub intermediate_size: usize,
    /// Biases on MLPs and experts.
    pub mlp_bias: bool,
    /// MLP/expert activation (only `relu2`).
    pub mlp_hidden_act: String,

    /// Routed experts `E_n`.
    pub n_routed_experts: usize,
    /// Experts per token `k`.
    pub num_experts_per_tok: usize,
    /// Routed expert width.
    pub moe_intermediate_size: usize,
    /// Shared expert width.
    pub moe_shared_expert_intermediate_size: usize,
    /// Router groups `n_g`.
    pub n_group: usize,
    /// Groups kept per token `k_g`.
    pub topk_group: usize,
    /// Normalise the chosen weights to sum 1.
    pub norm_topk_prob: bool,
    /// Factor on the routed weights.
    pub routed_scaling_factor: f64,
    /// Latent width of the routed experts, if any (ARCH.md §6.4).
    pub moe_latent_size: Option<usize>,

    /// MTP predictor groups declared by the file (transformers builds no MTP module; this crate
    /// builds one group, as vLLM and SGLang do, when the checkpoint carries `mtp.*` tensors).
    pub num_nextn_predict_layers: usize,
    /// MTP layer layout (default `*E`).
    pub mtp_layer_kinds: Vec<LayerKind>,
    /// Whether the model carries its MTP head (the `mtp.*` layers of `mtp_layer_kinds`). Not part of
    /// `config.json`: [`crate::Model::load`] sets it when the checkpoint has `mtp.*` tensors, a
    /// caller sets it for [`crate::Model::random`]. Only then do the KV pool and the state slots
    /// hold the MTP layers' K/V and Mamba state (after the main model's layers).
    pub mtp: bool,

    /// Beginning-of-sequence token, if declared.
    pub bos_token_id: Option<u32>,
    /// End-of-sequence tokens (a single id or a list in the file).
    pub eos_token_ids: Vec<u32>,
    /// Padding token, if declared.
    pub pad_token_id: Option<u32>,
    /// The longest sequence the model was trained for (`max_position_embeddings`), if declared.
    /// A router's context defaults to it (see `device_cpu::CpuRouterConfig::max_context`), the
    /// way vLLM derives `max_model_len`.
    pub max_position_embeddings: Option<usize>,
}

/// A JSON float that may be written as `{"__float__": "Infinity"}` (transformers' encoding of
/// non-finite floats).
#[derive(Deserialize)]
#[serde(untagged)]
enum JsonFloat {
    Number(f64),
    Special {
        #[serde(rename = "__float__")]
        value: String,
    },
}

impl JsonFloat {
    fn value(&self, field: &'static str) -> Result<f64, ModelError> {
        match self {
            Self::Number(x) => Ok(*x),
            Self::Special { value } => match value.as_str() {
                "Infinity" | "inf" => Ok(f64::INFINITY),
                "-Infinity" | "-inf" => Ok(f64::NEG_INFINITY),
                "NaN" | "nan" => Ok(f64::NAN),
                other => Err(ModelError::InvalidConfig {
                    field,
                    value: format!("{{\"__float__\": {other:?}}}"),
                    reason: "expected Infinity, -Infinity or NaN".into(),
                }),
            },
        }
    }
}

/// A token id or a list of them (`eos_token_id` may be either).
#[derive(Deserialize)]
#[serde(untagged)]
enum OneOrMany {
    One(u32),
    Many(Vec<u32>),
}

/// `config.json` as written, every field optional; [`Config::from_json_str`] decides which are required.
#[derive(Deserialize)]
struct RawConfig {
    vocab_size: Option<usize>,
    hidden_size: Option<usize>,
    num_hidden_layers: Option<usize>,
    #[serde(alias = "layer_types")]
    layers_block_type: Option<Vec<String>>,
    hybrid_override_pattern: Option<String>,
    layer_norm_epsilon: Option<JsonFloat>,

    mamba_num_heads: Option<usize>,
    mamba_head_dim: Option<usize>,
    ssm_state_size: Option<usize>,
    #[serde(alias = "mamba_n_groups")]
    n_groups: Option<usize>,
    #[serde(alias = "mamba_d_conv")]
    conv_kernel: Option<usize>,
    #[serde(alias = "mamba_dt_min")]
    time_step_min: Option<JsonFloat>,
    #[serde(alias = "mamba_dt_max")]
    time_step_max: Option<JsonFloat>,
    #[serde(alias = "mamba_dt_init_floor")]
    time_step_floor: Option<JsonFloat>,
    #[serde(alias = "mamba_dt_limit")]
    time_step_limit: Option<Vec<JsonFloat>>,
    use_bias: Option<bool>,
    #[serde(alias = "mamba_conv_bias")]
    use_conv_bias: Option<bool>,
    #[serde(alias = "mamba_chunk_size")]
    chunk_size: Option<usize>,
    mamba_hidden_act: Option<String>,

    num_attention_heads: Option<usize>,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,

    intermediate_size: Option<usize>,
    mlp_bias: Option<bool>,
    mlp_hidden_act: Option<String>,

    n_routed_experts: Option<usize>,
    num_experts_per_tok: Option<usize>,
    moe_intermediate_size: Option<usize>,
    moe_shared_expert_intermediate_size: Option<usize>,
    n_group: Option<usize>,
    topk_group: Option<usize>,
    norm_topk_prob: Option<bool>,
    routed_scaling_factor: Option<JsonFloat>,
    moe_latent_size: Option<usize>,

    num_nextn_predict_layers: Option<usize>,
    mtp_layers_block_type: Option<Vec<String>>,
    mtp_hybrid_override_pattern: Option<String>,

    bos_token_id: Option<u32>,
    eos_token_id: Option<OneOrMany>,
    pad_token_id: Option<u32>,
    max_position_embeddings: Option<usize>,
}

fn required<T>(
    value: Option<T>,
    field: &'static str,
    needed_by: &'static str,
) -> Result<T, ModelError> {
    value.ok_or(ModelError::MissingConfigField { field, needed_by })
}

/// A field that only matters when `used` (a layer kind is present): required then, else 0.
fn required_if(
    used: bool,
    value: Option<usize>,
    field: &'static str,
    needed_by: &'static str,
) -> Result<usize, ModelError> {
    if used {
        required(value, field, needed_by)
    } else {
        Ok(value.unwrap_or(0))
    }
}

fn float_or(
    value: Option<JsonFloat>,
    field: &'static str,
    default: f64,
) -> Result<f64, ModelError> {
    value.map_or(Ok(default), |v| v.value(field))
}

fn parse_pattern(pattern: &str, field: &'static str) -> Result<Vec<LayerKind>, ModelError> {
    pattern
        .chars()
        .enumerate()
        .map(|(position, letter)| {
            LayerKind::from_letter(letter).ok_or(ModelError::UnknownBlockLetter {
                field,
                letter,
                position,
            })
        })
        .collect()
}

fn parse_block_types(names: &[String], field: &'static str) -> Result<Vec<LayerKind>, ModelError> {
    names
        .iter()
        .enumerate()
        .map(|(position, name)| {
            LayerKind::from_block_type(name).ok_or_else(|| ModelError::UnknownBlockType {
                field,
                name: name.clone(),
                position,
            })
        })
        .collect()
}

fn invalid(field: &'static str, value: impl ToString, reason: impl Into<String>) -> ModelError {
    ModelError::InvalidConfig {
        field,
        value: value.to_string(),
        reason: reason.into(),
    }
}

fn nonzero(field: &'static str, value: usize) -> Result<(), ModelError> {
    if value == 0 {
        Err(invalid(field, value, "must be at least 1"))
    } else {
        Ok(())
    }
}

impl Config {
    /// Parses and validates the text of a `config.json`.
    pub fn from_json_str(text: &str) -> Result<Config, ModelError> {
        let raw: RawConfig =
            serde_json::from_str(text).map_err(|e| ModelError::ConfigJson(e.to_string()))?;
        let layer_kinds = match (&raw.layers_block_type, &raw.hybrid_override_pattern) {
            // transformers: if both are present, the list wins.
            (Some(list), _) => parse_block_types(list, "layers_block_type")?,
            (None, Some(pattern)) => parse_pattern(pattern, "hybrid_override_pattern")?,
            (None, None) => {
                return Err(ModelError::MissingConfigField {
                    field: "layers_block_type",
                    needed_by: "the layer layout (or `hybrid_override_pattern`)",
                })
            }
        };
        if let Some(stored) = raw.num_hidden_layers {
            if stored != layer_kinds.len() {
                tracing::warn!(
                    stored,
                    layout = layer_kinds.len(),
                    "num_hidden_layers disagrees with the layer layout; using the layout"
                );
            }
        }
        let mtp_layer_kinds = match (&raw.mtp_layers_block_type, &raw.mtp_hybrid_override_pattern) {
            (Some(list), _) => parse_block_types(list, "mtp_layers_block_type")?,
            (None, Some(pattern)) => parse_pattern(pattern, "mtp_hybrid_override_pattern")?,
            (None, None) => vec![LayerKind::Attention, LayerKind::Moe],
        };
        let has = |kind: LayerKind| layer_kinds.contains(&kind);
        let (mamba, attention, mlp, moe) = (
            has(LayerKind::Mamba),
            has(LayerKind::Attention),
            has(LayerKind::Mlp),
            has(LayerKind::Moe),
        );
        let time_step_limit = match raw.time_step_limit {
            None => (0.0, f64::INFINITY),
            Some(pair) if pair.len() == 2 => (
                pair[0].value("time_step_limit")?,
                pair[1].value("time_step_limit")?,
            ),
            Some(other) => {
                return Err(invalid(
                    "time_step_limit",
                    format!("a list of {} values", other.len()),
                    "must be [min, max]",
                ))
            }
        };
        let hidden_size = required(raw.hidden_size, "hidden_size", "the embedding")?;
        let num_attention_heads = required_if(
            attention,
            raw.num_attention_heads,
            "num_attention_heads",
            "attention layers",
        )?;
        let head_dim = match raw.head_dim {
            Some(d) => d,
            None if attention && num_attention_heads > 0 => hidden_size / num_attention_heads,
            None => 0,
        };
        let config = Config {
            vocab_size: required(raw.vocab_size, "vocab_size", "the embedding")?,
            hidden_size,
            num_hidden_layers: layer_kinds.len(),
            layer_norm_epsilon: float_or(raw.layer_norm_epsilon, "layer_norm_epsilon", 1e-5)?,
            mamba_num_heads: required_if(
                mamba,
                raw.mamba_num_heads,
                "mamba_num_heads",
                "Mamba layers",
            )?,
            mamba_head_dim: required_if(
                mamba,
                raw.mamba_head_dim,
                "mamba_head_dim",
                "Mamba layers",
            )?,
            ssm_state_size: required_if(
                mamba,
                raw.ssm_state_size,
                "ssm_state_size",
                "Mamba layers",
            )?,
            n_groups: required_if(mamba, raw.n_groups, "n_groups", "Mamba layers")?,
            conv_kernel: required_if(mamba, raw.conv_kernel, "conv_kernel", "Mamba layers")?,
            time_step_min: float_or(raw.time_step_min, "time_step_min", 1e-3)?,
            time_step_max: float_or(raw.time_step_max, "time_step_max", 0.1)?,
            time_step_floor: float_or(raw.time_step_floor, "time_step_floor", 1e-4)?,
            time_step_limit,
            use_bias: raw.use_bias.unwrap_or(false),
            use_conv_bias: raw.use_conv_bias.unwrap_or(true),
            chunk_size: raw.chunk_size.unwrap_or(128),
            mamba_hidden_act: raw.mamba_hidden_act.unwrap_or_else(|| "silu".into()),
            dt_clamp: DtClamp::default(),
            num_attention_heads,
            num_key_value_heads: required_if(
                attention,
                raw.num_key_value_heads,
                "num_key_value_heads",
                "attention layers",
            )?,
            head_dim,
            intermediate_size: required_if(
                mlp,
                raw.intermediate_size,
                "intermediate_size",
                "MLP layers",
            )?,
            mlp_bias: raw.mlp_bias.unwrap_or(false),
            mlp_hidden_act: raw.mlp_hidden_act.unwrap_or_else(|| "relu2".into()),
            n_routed_experts: required_if(
                moe,
                raw.n_routed_experts,
                "n_routed_experts",
                "MoE layers",
            )?,
            num_experts_per_tok: required_if(
                moe,
                raw.num_experts_per_tok,
                "num_experts_per_tok",
                "MoE layers",
            )?,
            moe_intermediate_size: required_if(
                moe,
                raw.moe_intermediate_size,
                "moe_intermediate_size",
                "MoE layers",
            )?,
            moe_shared_expert_intermediate_size: required_if(
                moe,
                raw.moe_shared_expert_intermediate_size,
                "moe_shared_expert_intermediate_size",
                "MoE layers",
            )?,
            n_group: raw.n_group.unwrap_or(1),
            topk_group: raw.topk_group.unwrap_or(1),
            norm_topk_prob: if moe {
                required(raw.norm_topk_prob, "norm_topk_prob", "MoE layers")?
            } else {
                raw.norm_topk_prob.unwrap_or(true)
            },
            routed_scaling_factor: if moe {
                required(
                    raw.routed_scaling_factor,
                    "routed_scaling_factor",
                    "MoE layers",
                )?
                .value("routed_scaling_factor")?
            } else {
                float_or(raw.routed_scaling_factor, "routed_scaling_factor", 1.0)?
            },
            moe_latent_size: raw.moe_latent_size,
            num_nextn_predict_layers: raw.num_nextn_predict_layers.unwrap_or(0),
            mtp_layer_kinds,
            mtp: false,
            bos_token_id: raw.bos_token_id,
            eos_token_ids: match raw.eos_token_id {
                None => Vec::new(),
                Some(OneOrMany::One(id)) => vec![id],
                Some(OneOrMany::Many(ids)) => ids,
            },
            pad_token_id: raw.pad_token_id,
            max_position_embeddings: raw.max_position_embeddings,
            layer_kinds,
        };
        config.validate()?;
        Ok(config)
    }

    /// Reads, parses and validates a `config.json` file.
    pub fn from_file(path: &std::path::Path) -> Result<Config, ModelError> {
        let text = std::fs::read_to_string(path).map_err(|source| ModelError::Io {
            path: path.to_owned(),
            source,
        })?;
        Self::from_json_str(&text)
    }

    /// Checks every rule listed in the module docs; the error names the first bad field.
    pub fn validate(&self) -> Result<(), ModelError> {
        nonzero("vocab_size", self.vocab_size)?;
        if u32::try_from(self.vocab_size).is_err() {
            return Err(invalid(
                "vocab_size",
                self.vocab_size,
                "token ids are u32, so at most 4294967295",
            ));
        }
        nonzero("hidden_size", self.hidden_size)?;
        if self.max_position_embeddings == Some(0) {
            return Err(invalid(
                "max_position_embeddings",
                0,
                "must be at least 1 (or absent)",
            ));
        }
        if self.layer_kinds.is_empty() {
            return Err(invalid(
                "layers_block_type",
                "[]",
                "needs at least one layer",
            ));
        }
        if self.num_hidden_layers != self.layer_kinds.len() {
            return Err(invalid(
                "num_hidden_layers",
                self.num_hidden_layers,
                format!(
                    "must equal the {} layers of the layout",
                    self.layer_kinds.len()
                ),
            ));
        }
        if !(self.layer_norm_epsilon.is_finite() && self.layer_norm_epsilon > 0.0) {
            return Err(invalid(
                "layer_norm_epsilon",
                self.layer_norm_epsilon,
                "must be finite and > 0",
            ));
        }
        if self.mtp {
            if self.num_nextn_predict_layers != 1 {
                return Err(invalid(
                    "num_nextn_predict_layers",
                    self.num_nextn_predict_layers,
                    "an MTP head is built for exactly one predictor group (as vLLM and SGLang do)",
                ));
            }
            if self.mtp_layer_kinds.is_empty() {
                return Err(invalid(
                    "mtp_layers_block_type",
                    "[]",
                    "an MTP head needs at least one layer",
                ));
            }
        }
        if self.uses(LayerKind::Mamba) {
            self.validate_mamba()?;
        }
        if self.uses(LayerKind::Attention) {
            nonzero("num_attention_heads", self.num_attention_heads)?;
            nonzero("num_key_value_heads", self.num_key_value_heads)?;
            nonzero("head_dim", self.head_dim)?;
            if self.num_attention_heads % self.num_key_value_heads != 0 {
                return Err(invalid(
                    "num_key_value_heads",
                    self.num_key_value_heads,
                    format!(
                        "must divide num_attention_heads = {}",
                        self.num_attention_heads
                    ),
                ));
            }
        }
        if (self.uses(LayerKind::Mlp) || self.uses(LayerKind::Moe))
            && self.mlp_hidden_act != "relu2"
        {
            return Err(invalid(
                "mlp_hidden_act",
                &self.mlp_hidden_act,
                "only relu2 is supported",
            ));
        }
        if self.uses(LayerKind::Mlp) {
            nonzero("intermediate_size", self.intermediate_size)?;
        }
        if self.uses(LayerKind::Moe) {
            self.validate_moe()?;
        }
        self.check_sizes()
    }

    /// Every product the model forms fits `usize` (absurd sizes are an error, not an overflow).
    fn check_sizes(&self) -> Result<(), ModelError> {
        let product = |what: &'static str, factors: &[usize]| {
            factors
                .iter()
                .try_fold(1usize, |acc, &f| acc.checked_mul(f))
                .ok_or(ModelError::SizeOverflow(what))
        };
        let d = self.hidden_size;
        product("embedding size", &[self.vocab_size, d])?;
        let groups = product("Mamba B/C width", &[2, self.n_groups, self.ssm_state_size])?;
        let inner = product(
            "Mamba inner width",
            &[self.mamba_num_heads, self.mamba_head_dim],
        )?;
        let in_proj = inner
            .checked_mul(2)
            .and_then(|x| x.checked_add(groups))
            .and_then(|x| x.checked_add(self.mamba_num_heads))
            .ok_or(ModelError::SizeOverflow("Mamba in_proj width"))?;
        product("Mamba in_proj size", &[in_proj, d])?;
        product("Mamba conv size", &[inner + groups, self.conv_kernel])?;
        product("Mamba SSM state", &[inner, self.ssm_state_size])?;
        let heads = self
            .num_key_value_heads
            .checked_mul(2)
            .and_then(|x| x.checked_add(self.num_attention_heads))
            .ok_or(ModelError::SizeOverflow("attention heads"))?;
        product("attention projection size", &[heads, self.head_dim, d])?;
        product("MLP size", &[self.intermediate_size, d])?;
        let expert_dim = self.moe_latent_size.unwrap_or(d);
        product(
            "expert sizes",
            &[
                self.n_routed_experts,
                self.moe_intermediate_size,
                expert_dim,
            ],
        )?;
        product(
            "shared expert size",
            &[self.moe_shared_expert_intermediate_size, d],
        )?;
        Ok(())
    }

    fn validate_mamba(&self) -> Result<(), ModelError> {
        nonzero("mamba_num_heads", self.mamba_num_heads)?;
        nonzero("mamba_head_dim", self.mamba_head_dim)?;
        nonzero("ssm_state_size", self.ssm_state_size)?;
        nonzero("n_groups", self.n_groups)?;
        nonzero("conv_kernel", self.conv_kernel)?;
        if self.mamba_num_heads % self.n_groups != 0 {
            return Err(invalid(
                "n_groups",
                self.n_groups,
                format!("must divide mamba_num_heads = {}", self.mamba_num_heads),
            ));
        }
        if !(self.time_step_min.is_finite() && self.time_step_min >= 0.0) {
            return Err(invalid(
                "time_step_min",
                self.time_step_min,
                "must be finite and >= 0",
            ));
        }
        if self.mamba_hidden_act != "silu" {
            return Err(invalid(
                "mamba_hidden_act",
                &self.mamba_hidden_act,
                "only silu is supported",
            ));
        }
        Ok(())
    }

    fn validate_moe(&self) -> Result<(), ModelError> {
        nonzero("n_routed_experts", self.n_routed_experts)?;
        nonzero("num_experts_per_tok", self.num_experts_per_tok)?;
        nonzero("moe_intermediate_size", self.moe_intermediate_size)?;
        nonzero(
            "moe_shared_expert_intermediate_size",
            self.moe_shared_expert_intermediate_size,
        )?;
        nonzero("n_group", self.n_group)?;
        if self.n_routed_experts % self.n_group != 0 {
            return Err(invalid(
                "n_group",
                self.n_group,
                format!("must divide n_routed_experts = {}", self.n_routed_experts),
            ));
        }
        let per_group = self.n_routed_experts / self.n_group;
        if per_group < 2 {
            return Err(invalid(
                "n_group",
                self.n_group,
                format!(
                    "group scores sum the two best experts, so each group needs >= 2 of the {} experts",
                    self.n_routed_experts
                ),
            ));
        }
        if self.topk_group == 0 || self.topk_group > self.n_group {
            return Err(invalid(
                "topk_group",
                self.topk_group,
                format!("must be in 1..={}", self.n_group),
            ));
        }
        if self.num_experts_per_tok > self.topk_group * per_group {
            return Err(invalid(
                "num_experts_per_tok",
                self.num_experts_per_tok,
                format!(
                    "must be at most topk_group * experts per group = {}",
                    self.topk_group * per_group
                ),
            ));
        }
        if !self.routed_scaling_factor.is_finite() {
            return Err(invalid(
                "routed_scaling_factor",
                self.routed_scaling_factor,
                "must be finite",
            ));
        }
        if self.moe_latent_size == Some(0) {
            return Err(invalid("moe_latent_size", 0, "must be at least 1 or null"));
        }
        Ok(())
    }

    /// Whether any layer has this kind.
    pub fn has(&self, kind: LayerKind) -> bool {
        self.layer_kinds.contains(&kind)
    }

    /// Number of layers of this kind (main stack).
    pub fn count(&self, kind: LayerKind) -> usize {
        self.layer_kinds.iter().filter(|&&k| k == kind).count()
    }

    /// The MTP head's layers, when the model carries it (empty otherwise).
    pub fn mtp_kinds(&self) -> &[LayerKind] {
        if self.mtp {
            &self.mtp_layer_kinds
        } else {
            &[]
        }
    }

    /// Whether the main stack or the MTP head (when carried) has a layer of this kind.
    pub fn uses(&self, kind: LayerKind) -> bool {
        self.has(kind) || self.mtp_kinds().contains(&kind)
    }

    /// Layers of this kind in the main stack and the MTP head together: what the KV pool and the
    /// state slots hold (the MTP head's after the main stack's).
    pub fn stored_count(&self, kind: LayerKind) -> usize {
        self.count(kind) + self.mtp_kinds().iter().filter(|&&k| k == kind).count()
    }

    /// The layout as a `hybrid_override_pattern` string.
    pub fn pattern(&self) -> String {
        self.layer_kinds.iter().map(|k| k.letter()).collect()
    }

    /// Mamba inner width `D_in = H * P` (not `expand * hidden_size`).
    pub fn mamba_inner(&self) -> usize {
        self.mamba_num_heads * self.mamba_head_dim
    }

    /// Width of the Mamba conv: `D_in + 2 G N`.
    pub fn mamba_conv_dim(&self) -> usize {
        self.mamba_inner() + 2 * self.n_groups * self.ssm_state_size
    }

    /// Width of `in_proj`'s output: `2 D_in + 2 G N + H`.
    pub fn mamba_in_proj_dim(&self) -> usize {
        self.mamba_inner() + self.mamba_conv_dim() + self.mamba_num_heads
    }

    /// Width the routed experts work in (`moe_latent_size` or `hidden_size`).
    pub fn moe_expert_dim(&self) -> usize {
        self.moe_latent_size.unwrap_or(self.hidden_size)
    }

    /// Serialises to a `config.json` in transformers 5.23's form (layout as `layers_block_type`).
    pub fn to_hf_json(&self) -> String {
        let float = |x: f64| {
            if x.is_finite() {
                serde_json::json!(x)
            } else if x > 0.0 {
                serde_json::json!({"__float__": "Infinity"})
            } else if x < 0.0 {
                serde_json::json!({"__float__": "-Infinity"})
            } else {
                serde_json::json!({"__float__": "NaN"})
            }
        };
        let kinds = |kinds: &[LayerKind]| kinds.iter().map(|k| k.block_type()).collect::<Vec<_>>();
        let mut value = serde_json::json!({
            "architectures": ["NemotronHForCausalLM"],
            "model_type": "nemotron_h",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "layers_block_type": kinds(&self.layer_kinds),
            "layer_norm_epsilon": float(self.layer_norm_epsilon),
            "mamba_num_heads": self.mamba_num_heads,
            "mamba_head_dim": self.mamba_head_dim,
            "ssm_state_size": self.ssm_state_size,
            "n_groups": self.n_groups,
            "conv_kernel": self.conv_kernel,
            "time_step_min": float(self.time_step_min),
            "time_step_max": float(self.time_step_max),
            "time_step_floor": float(self.time_step_floor),
            "time_step_limit": [float(self.time_step_limit.0), float(self.time_step_limit.1)],
            "use_bias": self.use_bias,
            "use_conv_bias": self.use_conv_bias,
            "chunk_size": self.chunk_size,
            "mamba_hidden_act": self.mamba_hidden_act,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "mlp_bias": self.mlp_bias,
            "mlp_hidden_act": self.mlp_hidden_act,
            "n_routed_experts": self.n_routed_experts,
            "num_experts_per_tok": self.num_experts_per_tok,
            "moe_intermediate_size": self.moe_intermediate_size,
            "moe_shared_expert_intermediate_size": self.moe_shared_expert_intermediate_size,
            "n_group": self.n_group,
            "topk_group": self.topk_group,
            "norm_topk_prob": self.norm_topk_prob,
            "routed_scaling_factor": float(self.routed_scaling_factor),
            "moe_latent_size": self.moe_latent_size,
            "num_nextn_predict_layers": self.num_nextn_predict_layers,
            "mtp_layers_block_type": kinds(&self.mtp_layer_kinds),
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_ids,
            "pad_token_id": self.pad_token_id,
        });
        // An undeclared context length is left out rather than written as `null`: transformers
        // (5.x) rejects `"max_position_embeddings": null`, and an absent key reads back as `None`.
        if let (Some(limit), Some(map)) = (self.max_position_embeddings, value.as_object_mut()) {
            map.insert("max_position_embeddings".into(), limit.into());
        }
        serde_json::to_string_pretty(&value).unwrap_or_default()
    }

    /// The shared fixture's shape (`nemotron-h-tiny`): vocab 256, hidden 64, pattern `MEM*-ME*M-`
    /// (without its declared context length: `max_position_embeddings` is `None`).
    pub fn tiny_demo() -> Config {
        let config = Config {
            vocab_size: 256,
            hidden_size: 64,
            num_hidden_layers: 10,
            layer_kinds: pattern_kinds("MEM*-ME*M-"),
            layer_norm_epsilon: 1e-5,
            mamba_num_heads: 4,
            mamba_head_dim: 16,
            ssm_state_size: 16,
            n_groups: 2,
            conv_kernel: 4,
            time_step_min: 1e-3,
            time_step_max: 0.1,
            time_step_floor: 1e-4,
            time_step_limit: (0.0, f64::INFINITY),
            use_bias: false,
            use_conv_bias: true,
            chunk_size: 16,
            mamba_hidden_act: "silu".into(),
            dt_clamp: DtClamp::default(),
            num_attention_heads: 4,
            num_key_value_heads: 2,
            head_dim: 16,
            intermediate_size: 128,
            mlp_bias: false,
            mlp_hidden_act: "relu2".into(),
            n_routed_experts: 8,
            num_experts_per_tok: 2,
            moe_intermediate_size: 32,
            moe_shared_expert_intermediate_size: 48,
            n_group: 2,
            topk_group: 1,
            norm_topk_prob: true,
            routed_scaling_factor: 2.5,
            moe_latent_size: None,
            num_nextn_predict_layers: 1,
            mtp_layer_kinds: vec![LayerKind::Attention, LayerKind::Moe],
            mtp: false,
            bos_token_id: Some(1),
            eos_token_ids: vec![2],
            pad_token_id: Some(0),
            max_position_embeddings: None,
        };
        debug_assert!(config.validate().is_ok());
        config
    }

    /// [`Config::tiny_demo`]'s widths with attention and MLP layers only (pattern `*-*-`): no
    /// Mamba layer, so a router keeps its prefix cache in the hash chain alone (no Marconi tree).
    pub fn tiny_attention_only() -> Config {
        let config = Config {
            num_hidden_layers: 4,
            layer_kinds: pattern_kinds("*-*-"),
            ..Config::tiny_demo()
        };
        debug_assert!(config.validate().is_ok());
        config
    }

    /// A realistic small config for benchmarks and demos: hidden 512, 16 layers
    /// (`MEM*MEM-MEM*MEM-`), vocab 4096, Mamba 16x64 heads with state 64 in 4 groups, attention
    /// 8/2 heads of 64, MLP 2048, MoE 16 experts (top 4 of 2 of 4 groups, 256 wide, shared 512).
    pub fn small_512() -> Config {
        let config = Config {
            vocab_size: 4096,
            hidden_size: 512,
            num_hidden_layers: 16,
            layer_kinds: pattern_kinds("MEM*MEM-MEM*MEM-"),
            mamba_num_heads: 16,
            mamba_head_dim: 64,
            ssm_state_size: 64,
            n_groups: 4,
            chunk_size: 128,
            num_attention_heads: 8,
            num_key_value_heads: 2,
            head_dim: 64,
            intermediate_size: 2048,
            n_routed_experts: 16,
            num_experts_per_tok: 4,
            moe_intermediate_size: 256,
            moe_shared_expert_intermediate_size: 512,
            n_group: 4,
            topk_group: 2,
            ..Config::tiny_demo()
        };
        debug_assert!(config.validate().is_ok());
        config
    }
}

/// Layer kinds of a pattern known to be valid (built-in configs only).
fn pattern_kinds(pattern: &str) -> Vec<LayerKind> {
    pattern.chars().filter_map(LayerKind::from_letter).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const FIXTURE_CONFIG: &str =
        include_str!("../tests/fixtures/nemotron-h-tiny/model/config.json");

    #[test]
    fn fixture_config_parses_to_the_tiny_demo() {
        let config = Config::from_json_str(FIXTURE_CONFIG).unwrap();
        // The built-in config declares no context length; the fixture's file says 4096.
        let tiny = Config {
            max_position_embeddings: Some(4096),
            ..Config::tiny_demo()
        };
        assert_eq!(config, tiny);
        assert_eq!(config.pattern(), "MEM*-ME*M-");
        assert_eq!(config.time_step_limit, (0.0, f64::INFINITY));
        assert_eq!(config.mamba_in_proj_dim(), 196);
        assert_eq!(config.mamba_conv_dim(), 128);
    }

    #[test]
    fn hf_json_round_trips() {
        for config in [
            Config::tiny_demo(),
            Config::small_512(),
            Config::tiny_attention_only(),
        ] {
            assert_eq!(Config::from_json_str(&config.to_hf_json()).unwrap(), config);
        }
    }

    #[test]
    fn the_attention_only_config_is_the_tiny_demo_without_mamba_and_moe() {
        let config = Config::tiny_attention_only();
        config.validate().unwrap();
        assert_eq!(config.pattern(), "*-*-");
        assert_eq!(config.num_hidden_layers, 4);
        assert_eq!(
            Config {
                num_hidden_layers: 10,
                layer_kinds: Config::tiny_demo().layer_kinds,
                ..config
            },
            Config::tiny_demo()
        );
    }

    /// transformers rejects `"max_position_embeddings": null`: an undeclared length is left out,
    /// a declared one is written as the number.
    #[test]
    fn hf_json_leaves_out_an_undeclared_context_length() {
        let undeclared: serde_json::Value =
            serde_json::from_str(&Config::tiny_demo().to_hf_json()).unwrap();
        assert_eq!(undeclared.get("max_position_embeddings"), None);
        let mut config = Config::tiny_demo();
        config.max_position_embeddings = Some(4096);
        let declared: serde_json::Value = serde_json::from_str(&config.to_hf_json()).unwrap();
        assert_eq!(declared["max_position_embeddings"], serde_json::json!(4096));
    }

    /// Replaces (or with `None` removes) top-level keys of the fixture config and parses it.
    fn parse_with(edits: &[(&str, Option<serde_json::Value>)]) -> Result<Config, ModelError> {
        let mut value: serde_json::Value = serde_json::from_str(FIXTURE_CONFIG).unwrap();
        let object = value.as_object_mut().unwrap();
        for (key, new) in edits {
            match new {
                Some(v) => {
                    object.insert((*key).to_string(), v.clone());
                }
                None => {
                    object.remove(*key);
                }
            }
        }
        Config::from_json_str(&value.to_string())
    }

    #[test]
    fn pattern_string_and_legacy_names() {
        use serde_json::json;
        let config = parse_with(&[
            ("layers_block_type", None),
            ("hybrid_override_pattern", Some(json!("M*-E"))),
            ("n_groups", None),
            ("mamba_n_groups", Some(json!(4))),
            ("conv_kernel", None),
            ("mamba_d_conv", Some(json!(3))),
            ("time_step_limit", None),
            (
                "mamba_dt_limit",
                Some(json!([0.0, {"__float__": "Infinity"}])),
            ),
            ("mtp_layers_block_type", None),
            ("mtp_hybrid_override_pattern", Some(json!("*E-"))),
        ])
        .unwrap();
        assert_eq!(
            config.layer_kinds,
            vec![
                LayerKind::Mamba,
                LayerKind::Attention,
                LayerKind::Mlp,
                LayerKind::Moe
            ]
        );
        assert_eq!(config.num_hidden_layers, 4);
        assert_eq!(config.n_groups, 4);
        assert_eq!(config.conv_kernel, 3);
        assert_eq!(
            config.mtp_layer_kinds,
            vec![LayerKind::Attention, LayerKind::Moe, LayerKind::Mlp]
        );
        // The list wins over the string, and legacy list names are accepted.
        let config = parse_with(&[
            ("hybrid_override_pattern", Some(json!("MMMM"))),
            (
                "layers_block_type",
                Some(json!(["mamba", "attention", "moe"])),
            ),
        ])
        .unwrap();
        assert_eq!(config.pattern(), "M*E");
    }

    fn check_err(edits: &[(&str, Option<serde_json::Value>)], expected: &str) {
        let err = parse_with(edits).unwrap_err().to_string();
        assert_eq!(err, expected);
    }

    #[test]
    fn bad_configs_name_the_field() {
        use serde_json::json;
        check_err(
            &[
                ("layers_block_type", None),
                ("hybrid_override_pattern", Some(json!("MEX"))),
            ],
            "unknown block letter 'X' at position 2 of `hybrid_override_pattern` (expected one of M, *, -, E)",
        );
        check_err(
            &[("layers_block_type", Some(json!(["mlp", "conv"])))],
            "unknown block type \"conv\" at index 1 of `layers_block_type` (expected linear_attention/mamba, full_attention/attention, mlp or moe)",
        );
        check_err(
            &[("num_attention_heads", Some(json!(0)))],
            "config field `num_attention_heads` = 0 is invalid: must be at least 1",
        );
        check_err(
            &[("mamba_num_heads", Some(json!(0)))],
            "config field `mamba_num_heads` = 0 is invalid: must be at least 1",
        );
        check_err(
            &[("n_groups", Some(json!(3)))],
            "config field `n_groups` = 3 is invalid: must divide mamba_num_heads = 4",
        );
        check_err(
            &[("num_key_value_heads", Some(json!(3)))],
            "config field `num_key_value_heads` = 3 is invalid: must divide num_attention_heads = 4",
        );
        check_err(
            &[("n_group", Some(json!(8)))],
            "config field `n_group` = 8 is invalid: group scores sum the two best experts, so each group needs >= 2 of the 8 experts",
        );
        check_err(
            &[("topk_group", Some(json!(3)))],
            "config field `topk_group` = 3 is invalid: must be in 1..=2",
        );
        check_err(
            &[("num_experts_per_tok", Some(json!(5)))],
            "config field `num_experts_per_tok` = 5 is invalid: must be at most topk_group * experts per group = 4",
        );
        check_err(
            &[("ssm_state_size", None)],
            "config field `ssm_state_size` is missing (needed by Mamba layers)",
        );
        check_err(
            &[("mlp_hidden_act", Some(json!("gelu")))],
            "config field `mlp_hidden_act` = gelu is invalid: only relu2 is supported",
        );
        check_err(
            &[("time_step_limit", Some(json!([0.0, {"__float__": "Huge"}])))],
            "config field `time_step_limit` = {\"__float__\": \"Huge\"} is invalid: expected Infinity, -Infinity or NaN",
        );
        check_err(
            &[("layers_block_type", Some(json!([])))],
            "config field `layers_block_type` = [] is invalid: needs at least one layer",
        );
        assert!(matches!(
            parse_with(&[("vocab_size", Some(json!("many")))]),
            Err(ModelError::ConfigJson(_))
        ));
    }

    #[test]
    fn absurd_sizes_are_errors() {
        let config = Config {
            hidden_size: usize::MAX / 2,
            ..Config::tiny_demo()
        };
        assert!(matches!(
            config.validate(),
            Err(ModelError::SizeOverflow("embedding size"))
        ));
    }

    #[test]
    fn sizes_of_absent_kinds_are_not_required() {
        use serde_json::json;
        let config = parse_with(&[
            ("layers_block_type", Some(json!(["mlp", "mlp"]))),
            ("mamba_num_heads", None),
            ("num_attention_heads", None),
            ("n_routed_experts", None),
            ("norm_topk_prob", None),
        ])
        .unwrap();
        assert_eq!(config.pattern(), "--");
        assert_eq!(config.mamba_num_heads, 0);
        assert_eq!(config.head_dim, 16);
    }
}
