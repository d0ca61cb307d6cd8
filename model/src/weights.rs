//! Model weights in memory (f32), built tensor by tensor from a [`TensorSource`]: a safetensors
//! checkpoint (f32/bf16/f16, one file or an index of shards) or a seeded random initialisation.
//!
//! One function ([`Weights::build`]) names every tensor and checks its shape against the config, so
//! loading, random initialisation, saving and fingerprinting can never disagree about names or order.
//! Invariants: every matrix is `[out, in]` row-major (the PyTorch `nn.Linear` layout) with the
//! lengths the config implies; an optional bias is present exactly when the config says so.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use safetensors::{Dtype, SafeTensors};

use crate::gemm::Packed;
use crate::{Config, LayerKind, ModelError};

/// A dense linear map with an optional bias, its matrix packed for the matrix product
/// ([`crate::gemm::Packed`]: 16-column panels, the layout every product reads, built once at load).
#[derive(Debug, Clone)]
pub(crate) struct Linear {
    /// The `[out, in]` matrix, packed.
    pub weight: Packed,
    /// `out` floats when present.
    pub bias: Option<Vec<f32>>,
    /// Output features.
    pub out_dim: usize,
    /// Input features.
    pub in_dim: usize,
}

/// Mamba2 mixer weights (ARCH.md §3).
#[derive(Debug, Clone)]
pub(crate) struct MambaWeights {
    pub in_proj: Linear,
    /// `[conv_dim, K]`: channel-major, the last tap multiplies the current token (the
    /// checkpoint's layout, which the tensor visitor hands out).
    pub conv_weight: Vec<f32>,
    /// The same taps `[K, conv_dim]`, tap-major, derived at build time: the conv reads one tap
    /// of every channel contiguously (vector loads instead of a stride of `K`).
    pub conv_taps: Vec<f32>,
    pub conv_bias: Option<Vec<f32>>,
    pub dt_bias: Vec<f32>,
    pub a_log: Vec<f32>,
    /// `-exp(a_log)`, derived at build time.
    pub a: Vec<f32>,
    pub d: Vec<f32>,
    pub norm: Vec<f32>,
    pub out_proj: Linear,
}

/// Attention weights; q, k and v are fused into one `[(n_h + 2 n_kv) hd, d]` projection.
#[derive(Debug, Clone)]
pub(crate) struct AttentionWeights {
    pub qkv: Linear,
    pub o_proj: Linear,
}

/// A non-gated ReLU² MLP (dense layer, routed expert or shared expert).
#[derive(Debug, Clone)]
pub(crate) struct MlpWeights {
    pub up: Linear,
    pub down: Linear,
}

/// Mixture-of-experts weights (ARCH.md §6).
#[derive(Debug, Clone)]
pub(crate) struct MoeWeights {
    /// Router `[E_n, d]`, no bias.
    pub gate: Linear,
    pub correction_bias: Vec<f32>,
    pub experts: Vec<MlpWeights>,
    pub shared: MlpWeights,
    /// `fc1_latent_proj` and `fc2_latent_proj` when `moe_latent_size` is set.
    pub latent: Option<(Linear, Linear)>,
}

/// The mixer of one block.
#[derive(Debug, Clone)]
pub(crate) enum Mixer {
    Mamba(MambaWeights),
    Attention(AttentionWeights),
    Mlp(MlpWeights),
    Moe(MoeWeights),
}

/// One pre-norm block.
#[derive(Debug, Clone)]
pub(crate) struct Layer {
    pub norm: Vec<f32>,
    pub mixer: Mixer,
}

/// The MTP head (vLLM's `NemotronHMultiTokenPredictor`): `eh_proj` over the normed embedding of
/// the next token and the normed previous hidden state, the layers of the MTP pattern, a final
/// norm; the embeddings and `lm_head` are the main model's.
#[derive(Debug, Clone)]
pub(crate) struct MtpWeights {
    /// `mtp.layers.0.enorm`, on the embedding.
    pub enorm: Vec<f32>,
    /// `mtp.layers.0.hnorm`, on the previous hidden state.
    pub hnorm: Vec<f32>,
    /// `mtp.layers.0.eh_proj`: `[d, 2d]`, input `[enorm(e), hnorm(h)]`.
    pub eh_proj: Linear,
    pub layers: Vec<Layer>,
    /// `mtp.layers.{last}.final_layernorm`.
    pub final_norm: Vec<f32>,
}

/// All weights: the main stack, and the MTP head when the config carries one ([`Config::mtp`]).
#[derive(Debug, Clone)]
pub(crate) struct Weights {
    /// `[V, d]`.
    pub embeddings: Vec<f32>,
    pub layers: Vec<Layer>,
    pub norm_f: Vec<f32>,
    /// `[V, d]`, never tied to the embeddings.
    pub lm_head: Linear,
    pub mtp: Option<MtpWeights>,
}

/// What [`Model::visit_tensors`](crate::Model::visit_tensors) (and the weights' and an
/// adapter's own `visit_tensors`) calls with each weight tensor: its checkpoint name, shape and
/// f32 values.
pub type TensorVisitor<'f> = dyn FnMut(&str, &[usize], &[f32]) + 'f;

/// A failed write of `path`.
pub(crate) fn write_error(path: &Path, reason: impl std::fmt::Display) -> ModelError {
    ModelError::Write {
        path: path.to_owned(),
        reason: reason.to_string(),
    }
}

/// Writes the tensors `visit` passes on (name, shape, f32 values) to the safetensors file
/// `dir/file`, as f32, under those names. `dir` must exist.
pub(crate) fn save_safetensors(
    dir: &Path,
    file: &str,
    visit: impl FnOnce(&mut TensorVisitor<'_>),
) -> Result<(), ModelError> {
    let mut tensors: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    visit(&mut |name, shape, data| {
        tensors.push((
            name.to_string(),
            shape.to_vec(),
            bytemuck::cast_slice::<f32, u8>(data).to_vec(),
        ));
    });
    let views = tensors
        .iter()
        .map(|(name, shape, data)| {
            safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape.clone(), data)
                .map(|view| (name.clone(), view))
        })
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| write_error(dir, e))?;
    let path = dir.join(file);
    let bytes = safetensors::serialize(views, None).map_err(|e| write_error(dir, e))?;
    std::fs::write(&path, bytes).map_err(|e| write_error(&path, e))
}

/// Where [`Weights::build`] gets each tensor from.
pub(crate) trait TensorSource {
    /// The tensor called `name`, which must have exactly `shape`.
    fn tensor(&mut self, name: &str, shape: &[usize]) -> Result<Vec<f32>, ModelError>;
}

fn linear(
    source: &mut dyn TensorSource,
    prefix: &str,
    out_dim: usize,
    in_dim: usize,
    bias: bool,
) -> Result<Linear, ModelError> {
    let weight = source.tensor(&format!("{prefix}.weight"), &[out_dim, in_dim])?;
    let bias = if bias {
        Some(source.tensor(&format!("{prefix}.bias"), &[out_dim])?)
    } else {
        None
    };
    Ok(Linear::from_rows(&weight, bias, out_dim, in_dim))
}

impl Linear {
    /// From a checkpoint-layout `[out, in]` matrix.
    pub(crate) fn from_rows(
        weight: &[f32],
        bias: Option<Vec<f32>>,
        out_dim: usize,
        in_dim: usize,
    ) -> Self {
        Self {
            weight: Packed::from_rows(weight, out_dim, in_dim),
            bias,
            out_dim,
            in_dim,
        }
    }

    /// The checkpoint-layout `[out, in]` matrix, into `out`.
    pub(crate) fn rows_into(&self, out: &mut Vec<f32>) {
        self.weight.rows_into(out);
    }
}

fn mlp(
    source: &mut dyn TensorSource,
    prefix: &str,
    width: usize,
    io_dim: usize,
    bias: bool,
) -> Result<MlpWeights, ModelError> {
    Ok(MlpWeights {
        up: linear(source, &format!("{prefix}.up_proj"), width, io_dim, bias)?,
        down: linear(source, &format!("{prefix}.down_proj"), io_dim, width, bias)?,
    })
}

impl Weights {
    /// Builds every tensor of `config` from `source`, in checkpoint order.
    pub(crate) fn build(
        config: &Config,
        source: &mut dyn TensorSource,
    ) -> Result<Self, ModelError> {
        let (v, d) = (config.vocab_size, config.hidden_size);
        let embeddings = source.tensor("backbone.embeddings.weight", &[v, d])?;
        let mut layers = Vec::with_capacity(config.layer_kinds.len());
        for (i, &kind) in config.layer_kinds.iter().enumerate() {
            layers.push(Self::layer(
                config,
                source,
                &format!("backbone.layers.{i}"),
                kind,
            )?);
        }
        let norm_f = source.tensor("backbone.norm_f.weight", &[d])?;
        let lm_head = linear(source, "lm_head", v, d, false)?;
        let mtp = if config.mtp {
            Some(Self::mtp(config, source)?)
        } else {
            None
        };
        Ok(Weights {
            embeddings,
            layers,
            norm_f,
            lm_head,
            mtp,
        })
    }

    /// The MTP head under vLLM's and SGLang's checkpoint names (`mtp.layers.{i}`).
    fn mtp(config: &Config, source: &mut dyn TensorSource) -> Result<MtpWeights, ModelError> {
        let d = config.hidden_size;
        let enorm = source.tensor("mtp.layers.0.enorm.weight", &[d])?;
        let hnorm = source.tensor("mtp.layers.0.hnorm.weight", &[d])?;
        let eh_proj = linear(source, "mtp.layers.0.eh_proj", d, 2 * d, false)?;
        let mut layers = Vec::with_capacity(config.mtp_layer_kinds.len());
        for (i, &kind) in config.mtp_layer_kinds.iter().enumerate() {
            layers.push(Self::layer(
                config,
                source,
                &format!("mtp.layers.{i}"),
                kind,
            )?);
        }
        let last = config.mtp_layer_kinds.len() - 1;
        let final_norm =
            source.tensor(&format!("mtp.layers.{last}.final_layernorm.weight"), &[d])?;
        Ok(MtpWeights {
            enorm,
            hnorm,
            eh_proj,
            layers,
            final_norm,
        })
    }

    /// One pre-norm block (`{prefix}.norm`, `{prefix}.mixer.*`).
    fn layer(
        config: &Config,
        source: &mut dyn TensorSource,
        prefix: &str,
        kind: LayerKind,
    ) -> Result<Layer, ModelError> {
        let d = config.hidden_size;
        let norm = source.tensor(&format!("{prefix}.norm.weight"), &[d])?;
        let m = format!("{prefix}.mixer");
        let mixer = match kind {
            LayerKind::Mamba => Mixer::Mamba(Self::mamba(config, source, &m)?),
            LayerKind::Attention => {
                let (nh, nkv, hd) = (
                    config.num_attention_heads,
                    config.num_key_value_heads,
                    config.head_dim,
                );
                let q = source.tensor(&format!("{m}.q_proj.weight"), &[nh * hd, d])?;
                let k = source.tensor(&format!("{m}.k_proj.weight"), &[nkv * hd, d])?;
                let vv = source.tensor(&format!("{m}.v_proj.weight"), &[nkv * hd, d])?;
                let mut weight = q;
                weight.extend_from_slice(&k);
                weight.extend_from_slice(&vv);
                Mixer::Attention(AttentionWeights {
                    qkv: Linear::from_rows(&weight, None, (nh + 2 * nkv) * hd, d),
                    o_proj: linear(source, &format!("{m}.o_proj"), d, nh * hd, false)?,
                })
            }
            LayerKind::Mlp => Mixer::Mlp(mlp(
                source,
                &m,
                config.intermediate_size,
                d,
                config.mlp_bias,
            )?),
            LayerKind::Moe => Mixer::Moe(Self::moe(config, source, &m)?),
        };
        Ok(Layer { norm, mixer })
    }

    fn mamba(
        config: &Config,
        source: &mut dyn TensorSource,
        m: &str,
    ) -> Result<MambaWeights, ModelError> {
        let d = config.hidden_size;
        let (h, inner, conv_dim, k) = (
            config.mamba_num_heads,
            config.mamba_inner(),
            config.mamba_conv_dim(),
            config.conv_kernel,
        );
        let in_proj = linear(
            source,
            &format!("{m}.in_proj"),
            config.mamba_in_proj_dim(),
            d,
            config.use_bias,
        )?;
        let conv_weight = source.tensor(&format!("{m}.conv1d.weight"), &[conv_dim, 1, k])?;
        let conv_taps = (0..k)
            .flat_map(|j| (0..conv_dim).map(move |c| (c, j)))
            .map(|(c, j)| conv_weight[c * k + j])
            .collect();
        let conv_bias = if config.use_conv_bias {
            Some(source.tensor(&format!("{m}.conv1d.bias"), &[conv_dim])?)
        } else {
            None
        };
        let dt_bias = source.tensor(&format!("{m}.dt_bias"), &[h])?;
        let a_log = source.tensor(&format!("{m}.A_log"), &[h])?;
        let a = a_log.iter().map(|&x| -x.exp()).collect();
        let dd = source.tensor(&format!("{m}.D"), &[h])?;
        let norm = source.tensor(&format!("{m}.norm.weight"), &[inner])?;
        let out_proj = linear(source, &format!("{m}.out_proj"), d, inner, config.use_bias)?;
        Ok(MambaWeights {
            in_proj,
            conv_weight,
            conv_taps,
            conv_bias,
            dt_bias,
            a_log,
            a,
            d: dd,
            norm,
            out_proj,
        })
    }

    fn moe(
        config: &Config,
        source: &mut dyn TensorSource,
        m: &str,
    ) -> Result<MoeWeights, ModelError> {
        let d = config.hidden_size;
        let e = config.n_routed_experts;
        let gate = linear(source, &format!("{m}.gate"), e, d, false)?;
        let correction_bias = source.tensor(&format!("{m}.gate.e_score_correction_bias"), &[e])?;
        let expert_dim = config.moe_expert_dim();
        let experts = (0..e)
            .map(|j| {
                mlp(
                    source,
                    &format!("{m}.experts.{j}"),
                    config.moe_intermediate_size,
                    expert_dim,
                    config.mlp_bias,
                )
            })
            .collect::<Result<Vec<_>, _>>()?;
        let shared = mlp(
            source,
            &format!("{m}.shared_experts"),
            config.moe_shared_expert_intermediate_size,
            d,
            config.mlp_bias,
        )?;
        let latent = match config.moe_latent_size {
            Some(l) => Some((
                linear(
                    source,
                    &format!("{m}.fc1_latent_proj"),
                    l,
                    d,
                    config.mlp_bias,
                )?,
                linear(
                    source,
                    &format!("{m}.fc2_latent_proj"),
                    d,
                    l,
                    config.mlp_bias,
                )?,
            )),
            None => None,
        };
        Ok(MoeWeights {
            gate,
            correction_bias,
            experts,
            shared,
            latent,
        })
    }

    /// Calls `f` with every tensor's checkpoint name, shape and values (checkpoint layout), in
    /// checkpoint (build) order. Matrices are transposed back one at a time into a reused buffer.
    pub(crate) fn visit_tensors(&self, config: &Config, f: &mut TensorVisitor<'_>) {
        let mut buf = Vec::new();
        let mut linear = |f: &mut TensorVisitor<'_>, prefix: &str, lin: &Linear| {
            lin.rows_into(&mut buf);
            f(
                &format!("{prefix}.weight"),
                &[lin.out_dim, lin.in_dim],
                &buf,
            );
            if let Some(bias) = &lin.bias {
                f(&format!("{prefix}.bias"), &[lin.out_dim], bias);
            }
        };
        let (v, d) = (config.vocab_size, config.hidden_size);
        f("backbone.embeddings.weight", &[v, d], &self.embeddings);
        for (i, layer) in self.layers.iter().enumerate() {
            Self::visit_layer(
                config,
                &format!("backbone.layers.{i}"),
                layer,
                f,
                &mut linear,
            );
        }
        f("backbone.norm_f.weight", &[d], &self.norm_f);
        linear(f, "lm_head", &self.lm_head);
        if let Some(mtp) = &self.mtp {
            f("mtp.layers.0.enorm.weight", &[d], &mtp.enorm);
            f("mtp.layers.0.hnorm.weight", &[d], &mtp.hnorm);
            linear(f, "mtp.layers.0.eh_proj", &mtp.eh_proj);
            for (i, layer) in mtp.layers.iter().enumerate() {
                Self::visit_layer(config, &format!("mtp.layers.{i}"), layer, f, &mut linear);
            }
            let last = mtp.layers.len() - 1;
            f(
                &format!("mtp.layers.{last}.final_layernorm.weight"),
                &[d],
                &mtp.final_norm,
            );
        }
    }

    fn visit_layer(
        config: &Config,
        prefix: &str,
        layer: &Layer,
        f: &mut TensorVisitor<'_>,
        linear: &mut dyn FnMut(&mut TensorVisitor<'_>, &str, &Linear),
    ) {
        let d = config.hidden_size;
        f(&format!("{prefix}.norm.weight"), &[d], &layer.norm);
        let m = format!("{prefix}.mixer");
        match &layer.mixer {
            Mixer::Mamba(w) => {
                let conv_dim = config.mamba_conv_dim();
                let h = config.mamba_num_heads;
                linear(f, &format!("{m}.in_proj"), &w.in_proj);
                f(
                    &format!("{m}.conv1d.weight"),
                    &[conv_dim, 1, config.conv_kernel],
                    &w.conv_weight,
                );
                if let Some(b) = &w.conv_bias {
                    f(&format!("{m}.conv1d.bias"), &[conv_dim], b);
                }
                f(&format!("{m}.dt_bias"), &[h], &w.dt_bias);
                f(&format!("{m}.A_log"), &[h], &w.a_log);
                f(&format!("{m}.D"), &[h], &w.d);
                f(
                    &format!("{m}.norm.weight"),
                    &[config.mamba_inner()],
                    &w.norm,
                );
                linear(f, &format!("{m}.out_proj"), &w.out_proj);
            }
            Mixer::Attention(w) => {
                let (nh, nkv, hd) = (
                    config.num_attention_heads,
                    config.num_key_value_heads,
                    config.head_dim,
                );
                let mut rows = Vec::new();
                w.qkv.rows_into(&mut rows);
                let (q, rest) = rows.split_at(nh * hd * d);
                let (k, vv) = rest.split_at(nkv * hd * d);
                f(&format!("{m}.q_proj.weight"), &[nh * hd, d], q);
                f(&format!("{m}.k_proj.weight"), &[nkv * hd, d], k);
                f(&format!("{m}.v_proj.weight"), &[nkv * hd, d], vv);
                linear(f, &format!("{m}.o_proj"), &w.o_proj);
            }
            Mixer::Mlp(w) => {
                linear(f, &format!("{m}.up_proj"), &w.up);
                linear(f, &format!("{m}.down_proj"), &w.down);
            }
            Mixer::Moe(w) => {
                linear(f, &format!("{m}.gate"), &w.gate);
                f(
                    &format!("{m}.gate.e_score_correction_bias"),
                    &[w.correction_bias.len()],
                    &w.correction_bias,
                );
                for (j, expert) in w.experts.iter().enumerate() {
                    linear(f, &format!("{m}.experts.{j}.up_proj"), &expert.up);
                    linear(f, &format!("{m}.experts.{j}.down_proj"), &expert.down);
                }
                linear(f, &format!("{m}.shared_experts.up_proj"), &w.shared.up);
                linear(f, &format!("{m}.shared_experts.down_proj"), &w.shared.down);
                if let Some((fc1, fc2)) = &w.latent {
                    linear(f, &format!("{m}.fc1_latent_proj"), fc1);
                    linear(f, &format!("{m}.fc2_latent_proj"), fc2);
                }
            }
        }
    }
}

/// Tensors read from one or more safetensors files (all bytes held in memory while building).
pub(crate) struct SafetensorsSource<'a> {
    files: &'a [(PathBuf, Vec<u8>)],
    /// name -> (file index, parsed header of that file).
    index: HashMap<String, usize>,
    parsed: Vec<SafeTensors<'a>>,
    used: HashSet<String>,
}

impl<'a> SafetensorsSource<'a> {
    /// Parses every file's header; a truncated or corrupt file is an error naming it.
    pub(crate) fn new(files: &'a [(PathBuf, Vec<u8>)]) -> Result<Self, ModelError> {
        let mut parsed = Vec::with_capacity(files.len());
        let mut index = HashMap::new();
        for (i, (path, bytes)) in files.iter().enumerate() {
            let tensors = SafeTensors::deserialize(bytes).map_err(|e| ModelError::Safetensors {
                path: path.clone(),
                reason: diagnose_safetensors(bytes, &e),
            })?;
            for name in tensors.names() {
                index.insert(name.to_string(), i);
            }
            parsed.push(tensors);
        }
        Ok(Self {
            files,
            index,
            parsed,
            used: HashSet::new(),
        })
    }

    /// Whether any tensor's name starts with `prefix`.
    pub(crate) fn has_prefix(&self, prefix: &str) -> bool {
        self.index.keys().any(|name| name.starts_with(prefix))
    }

    /// Every tensor name in the files, sorted.
    pub(crate) fn names(&self) -> Vec<String> {
        let mut names: Vec<String> = self.index.keys().cloned().collect();
        names.sort();
        names
    }

    /// Fails on the first tensor (in name order) that the build did not consume, except `mtp.*`
    /// when the MTP head was not built (transformers drops MTP weights too, ARCH.md §8).
    pub(crate) fn check_all_used(&self, mtp_built: bool) -> Result<(), ModelError> {
        let mut unused: Vec<&String> = self
            .index
            .keys()
            .filter(|n| !self.used.contains(*n) && (mtp_built || !n.starts_with("mtp.")))
            .collect();
        unused.sort();
        match unused.first() {
            Some(name) => Err(ModelError::UnexpectedTensor {
                path: self.files[self.index[*name]].0.clone(),
                name: (*name).clone(),
            }),
            None => Ok(()),
        }
    }
}

impl TensorSource for SafetensorsSource<'_> {
    fn tensor(&mut self, name: &str, shape: &[usize]) -> Result<Vec<f32>, ModelError> {
        let file = *self
            .index
            .get(name)
            .ok_or_else(|| ModelError::MissingTensor {
                name: name.to_string(),
            })?;
        let view = self.parsed[file]
            .tensor(name)
            .map_err(|e| ModelError::Safetensors {
                path: self.files[file].0.clone(),
                reason: format!("tensor `{name}`: {e}"),
            })?;
        if view.shape() != shape {
            return Err(ModelError::TensorShape {
                path: self.files[file].0.clone(),
                name: name.to_string(),
                expected: shape.to_vec(),
                actual: view.shape().to_vec(),
            });
        }
        let data = view.data();
        // Element-wise little-endian decoding: safetensors data need not be aligned for a cast.
        let values: Vec<f32> = match view.dtype() {
            Dtype::F32 => data
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
            Dtype::BF16 => data
                .chunks_exact(2)
                .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            Dtype::F16 => data
                .chunks_exact(2)
                .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            other => {
                return Err(ModelError::TensorDtype {
                    path: self.files[file].0.clone(),
                    name: name.to_string(),
                    dtype: format!("{other:?}"),
                })
            }
        };
        if let Some((index, &value)) = values.iter().enumerate().find(|(_, v)| !v.is_finite()) {
            return Err(ModelError::NonFiniteWeight {
                path: self.files[file].0.clone(),
                name: name.to_string(),
                index,
                value,
            });
        }
        self.used.insert(name.to_string());
        Ok(values)
    }
}

/// One tensor's entry in a safetensors header, as the format defines it.
#[derive(serde::Deserialize)]
struct HeaderEntry {
    dtype: Dtype,
    shape: Vec<u64>,
    data_offsets: (u64, u64),
}

/// Why `safetensors` refused `bytes`, said precisely: which tensor is at fault and how, or how
/// the file is truncated. The `safetensors` crate decides whether a file is valid; this only
/// re-reads the header (JSON, with `serde_json`) to name what its error does not, and falls back
/// to its message. Nothing here allocates more than the header's own size.
pub(crate) fn diagnose_safetensors(bytes: &[u8], err: &safetensors::SafeTensorError) -> String {
    let fallback = err.to_string();
    let Some(prefix) = bytes.get(..8) else {
        return format!(
            "truncated: the file has {} bytes, fewer than the 8-byte header length",
            bytes.len()
        );
    };
    let mut length = [0u8; 8];
    length.copy_from_slice(prefix);
    let declared = u64::from_le_bytes(length);
    let after = (bytes.len() - 8) as u64;
    if declared > after {
        return format!(
            "truncated: the header declares {declared} bytes of JSON, the file has {after} bytes \
             after the 8-byte length ({fallback})"
        );
    }
    // `declared <= after`, so it fits in usize.
    let header = &bytes[8..8 + declared as usize];
    let Ok(map) =
        serde_json::from_slice::<std::collections::BTreeMap<String, serde_json::Value>>(header)
    else {
        return fallback;
    };
    let mut entries = Vec::with_capacity(map.len());
    for (name, value) in map {
        if name == "__metadata__" {
            continue;
        }
        match serde_json::from_value::<HeaderEntry>(value) {
            Ok(entry) => entries.push((name, entry)),
            Err(e) => return format!("tensor `{name}`: its header entry is invalid ({e})"),
        }
    }
    entries.sort_by_key(|(_, e)| e.data_offsets);
    let data_len = after - declared;
    let mut expected_start = 0u64;
    let mut previous: Option<&str> = None;
    for (name, entry) in &entries {
        let (start, end) = entry.data_offsets;
        let elements = entry
            .shape
            .iter()
            .try_fold(1u128, |acc, &dim| acc.checked_mul(u128::from(dim)));
        let needed = elements
            .and_then(|n| n.checked_mul(entry.dtype.bitsize() as u128))
            .map(|bits| bits.div_ceil(8));
        let Some(needed) = needed else {
            return format!(
                "tensor `{name}`: shape {:?} of {:?} is too large to address",
                entry.shape, entry.dtype
            );
        };
        if end < start || u128::from(end - start) != needed {
            return format!(
                "tensor `{name}`: shape {:?} of {:?} needs {needed} bytes, its data offsets \
                 [{start}, {end}] hold {}",
                entry.shape,
                entry.dtype,
                end.saturating_sub(start)
            );
        }
        if start != expected_start {
            let after_what =
                previous.map_or("the start of the data".to_string(), |p| format!("`{p}`"));
            return format!(
                "tensor `{name}`: its data starts at byte {start}, but {after_what} ends at \
                 {expected_start} (offsets overlap or leave a gap)"
            );
        }
        expected_start = end;
        previous = Some(name);
    }
    match previous {
        Some(last) if expected_start > data_len => format!(
            "truncated: tensor `{last}` ends at data byte {expected_start}, the file holds only \
             {data_len} data bytes"
        ),
        Some(last) if expected_start < data_len => format!(
            "{} trailing bytes after the last tensor `{last}` (its data ends at byte \
             {expected_start} of {data_len})",
            data_len - expected_start
        ),
        _ => fallback,
    }
}

/// Reads the checkpoint files of a model folder: `model.safetensors`, or the shards listed by
/// `model.safetensors.index.json`.
pub(crate) fn read_checkpoint_files(dir: &Path) -> Result<Vec<(PathBuf, Vec<u8>)>, ModelError> {
    let read = |path: PathBuf| -> Result<(PathBuf, Vec<u8>), ModelError> {
        let bytes = std::fs::read(&path).map_err(|source| ModelError::Io {
            path: path.clone(),
            source,
        })?;
        Ok((path, bytes))
    };
    let index_path = dir.join("model.safetensors.index.json");
    if !index_path.exists() {
        return Ok(vec![read(dir.join("model.safetensors"))?]);
    }
    let text = std::fs::read_to_string(&index_path).map_err(|source| ModelError::Io {
        path: index_path.clone(),
        source,
    })?;
    #[derive(serde::Deserialize)]
    struct Index {
        weight_map: HashMap<String, String>,
    }
    let index: Index = serde_json::from_str(&text).map_err(|e| ModelError::Safetensors {
        path: index_path.clone(),
        reason: e.to_string(),
    })?;
    let mut shards: Vec<&String> = index.weight_map.values().collect();
    shards.sort();
    shards.dedup();
    shards.into_iter().map(|s| read(dir.join(s))).collect()
}

/// Tensors held in memory by checkpoint name, each taken once ([`crate::Model::map_tensors`]).
pub(crate) struct MapSource(pub(crate) HashMap<String, Vec<f32>>);

impl TensorSource for MapSource {
    fn tensor(&mut self, name: &str, _shape: &[usize]) -> Result<Vec<f32>, ModelError> {
        self.0
            .remove(name)
            .ok_or_else(|| ModelError::MissingTensor {
                name: name.to_string(),
            })
    }
}

/// Seeded random weights whose scales keep activations O(1): matrices uniform in `±1/sqrt(in)`,
/// norms near 1 (`enorm`, `hnorm` and `final_layernorm` of an MTP head too), `A = -[1, 16)`, `softplus(dt_bias)` in `[0.01, 0.1)` (so the dt clamp never fires).
pub(crate) struct RandomSource {
    rng: ChaCha8Rng,
}

impl RandomSource {
    pub(crate) fn new(seed: u64) -> Self {
        Self {
            rng: ChaCha8Rng::seed_from_u64(seed),
        }
    }

    fn uniform(&mut self, n: usize, low: f32, high: f32) -> Vec<f32> {
        (0..n).map(|_| self.rng.random_range(low..high)).collect()
    }
}

impl TensorSource for RandomSource {
    fn tensor(&mut self, name: &str, shape: &[usize]) -> Result<Vec<f32>, ModelError> {
        let n: usize = shape.iter().product();
        let values = if name.ends_with("norm.weight") || name.ends_with("norm_f.weight") {
            self.uniform(n, 0.9, 1.1)
        } else if name.ends_with(".A_log") {
            self.uniform(n, 1.0, 16.0)
                .into_iter()
                .map(f32::ln)
                .collect()
        } else if name.ends_with(".dt_bias") {
            // Inverse softplus of dt: dt + ln(1 - exp(-dt)).
            self.uniform(n, 0.01, 0.1)
                .into_iter()
                .map(|dt| dt + (-(-dt).exp_m1()).ln())
                .collect()
        } else if name.ends_with(".D") {
            self.uniform(n, 0.5, 1.5)
        } else if name.ends_with("e_score_correction_bias") {
            self.uniform(n, -0.05, 0.05)
        } else if name.ends_with("embeddings.weight") {
            self.uniform(n, -1.0, 1.0)
        } else if name.ends_with("conv1d.weight") {
            let scale = 1.0 / (shape[2] as f32).sqrt();
            self.uniform(n, -scale, scale)
        } else if name.ends_with(".bias") {
            self.uniform(n, -0.05, 0.05)
        } else {
            let fan_in = shape.last().copied().unwrap_or(1).max(1);
            let scale = 1.0 / (fan_in as f32).sqrt();
            self.uniform(n, -scale, scale)
        };
        Ok(values)
    }
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use proptest::prelude::*;
    use safetensors::tensor::TensorView;

    use super::{SafetensorsSource, TensorSource};

    /// A small valid file: tensors of three dtypes, so offsets and alignments vary.
    fn good_file() -> Vec<u8> {
        let f32s: Vec<u8> = (0..6u8).flat_map(|i| f32::from(i).to_le_bytes()).collect();
        let bf16s: Vec<u8> = (0..4u8)
            .flat_map(|i| half::bf16::from_f32(f32::from(i)).to_le_bytes())
            .collect();
        let f16s: Vec<u8> = (0..4u8)
            .flat_map(|i| half::f16::from_f32(f32::from(i)).to_le_bytes())
            .collect();
        let views = vec![
            (
                "a",
                TensorView::new(safetensors::Dtype::F32, vec![2, 3], &f32s).unwrap(),
            ),
            (
                "b",
                TensorView::new(safetensors::Dtype::BF16, vec![4], &bf16s).unwrap(),
            ),
            (
                "c",
                TensorView::new(safetensors::Dtype::F16, vec![2, 2], &f16s).unwrap(),
            ),
        ];
        safetensors::serialize(views, None).unwrap()
    }

    const SHAPES: [(&str, &[usize]); 3] = [("a", &[2, 3]), ("b", &[4]), ("c", &[2, 2])];

    fn json_value() -> impl Strategy<Value = serde_json::Value> {
        use serde_json::{json, Value};
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<u64>().prop_map(Value::from),
            (0u64..40).prop_map(Value::from),
            any::<i64>().prop_map(Value::from),
            Just(json!(1_000_000_000_000u64)),
            Just(json!(u64::MAX)),
            Just(json!(1.5)),
            prop_oneof![
                Just("F32"),
                Just("BF16"),
                Just("F16"),
                Just("I64"),
                Just("F4"),
                Just("??")
            ]
            .prop_map(Value::from),
        ];
        leaf.prop_recursive(2, 8, 4, |inner| {
            proptest::collection::vec(inner, 0..4).prop_map(Value::from)
        })
    }

    /// One way to damage the good file.
    #[derive(Debug, Clone)]
    enum Mutation {
        Byte(usize, u8),
        Cut(usize),
        Append(Vec<u8>),
        /// Replace field `field` of tensor `tensor`'s header entry, and rewrite the length.
        Header(usize, usize, serde_json::Value),
        /// Set the 8-byte header length.
        Length(u64),
    }

    fn mutation() -> impl Strategy<Value = Mutation> {
        prop_oneof![
            2 => (any::<usize>(), any::<u8>()).prop_map(|(at, b)| Mutation::Byte(at, b)),
            1 => any::<usize>().prop_map(Mutation::Cut),
            1 => proptest::collection::vec(any::<u8>(), 1..8).prop_map(Mutation::Append),
            4 => (0usize..3, 0usize..3, json_value()).prop_map(|(t, f, v)| Mutation::Header(t, f, v)),
            1 => prop_oneof![any::<u64>(), 0u64..300].prop_map(Mutation::Length),
        ]
    }

    fn apply(bytes: &mut Vec<u8>, mutation: &Mutation) {
        match mutation {
            Mutation::Byte(at, b) => {
                let len = bytes.len().max(1);
                if let Some(byte) = bytes.get_mut(at % len) {
                    *byte = *b;
                }
            }
            Mutation::Cut(at) => bytes.truncate(at % (bytes.len() + 1)),
            Mutation::Append(tail) => bytes.extend_from_slice(tail),
            Mutation::Length(n) => {
                if bytes.len() >= 8 {
                    bytes[..8].copy_from_slice(&n.to_le_bytes());
                }
            }
            Mutation::Header(tensor, field, value) => {
                let Some(prefix) = bytes.get(..8) else { return };
                let n = u64::from_le_bytes(prefix.try_into().unwrap_or_default()) as usize;
                let Some(header) = bytes.get(8..8usize.saturating_add(n)) else {
                    return;
                };
                let Ok(mut map) =
                    serde_json::from_slice::<serde_json::Map<String, serde_json::Value>>(header)
                else {
                    return;
                };
                let name = SHAPES[*tensor].0;
                let field = ["dtype", "shape", "data_offsets"][*field];
                if let Some(entry) = map.get_mut(name).and_then(|e| e.as_object_mut()) {
                    entry.insert(field.to_string(), value.clone());
                }
                let text = serde_json::to_vec(&map).unwrap_or_default();
                let mut out = (text.len() as u64).to_le_bytes().to_vec();
                out.extend_from_slice(&text);
                out.extend_from_slice(&bytes[8 + n..]);
                *bytes = out;
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig {
            cases: 10_000,
            failure_persistence: None,
            ..ProptestConfig::default()
        })]

        /// Mutated files (bytes flipped or cut, trailing bytes, header fields replaced by
        /// arbitrary JSON such as shapes of 10^12 elements or absurd offsets, a wrong header
        /// length) give tensors or a typed error, never a panic; what is read back has exactly
        /// the elements its shape says, and no more memory than the file's own bytes.
        #[test]
        fn mutated_safetensors_files_give_tensors_or_typed_errors(
            mutations in proptest::collection::vec(mutation(), 1..4),
        ) {
            let mut bytes = good_file();
            for m in &mutations {
                apply(&mut bytes, m);
            }
            let files = vec![(PathBuf::from("fuzz.safetensors"), bytes)];
            let Ok(mut source) = SafetensorsSource::new(&files) else {
                return Ok(());
            };
            for (name, shape) in SHAPES {
                if let Ok(values) = source.tensor(name, shape) {
                    prop_assert_eq!(values.len(), shape.iter().product::<usize>());
                    prop_assert!(values.len() * 2 <= files[0].1.len());
                }
            }
            let _ = source.check_all_used(false);
        }
    }

    #[test]
    fn a_good_file_reads_back() {
        let files = vec![(PathBuf::from("good.safetensors"), good_file())];
        let mut source = SafetensorsSource::new(&files).unwrap();
        assert_eq!(
            source.tensor("a", &[2, 3]).unwrap(),
            [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
        );
        assert_eq!(source.tensor("b", &[4]).unwrap(), [0.0, 1.0, 2.0, 3.0]);
        assert_eq!(source.tensor("c", &[2, 2]).unwrap(), [0.0, 1.0, 2.0, 3.0]);
        source.check_all_used(false).unwrap();
    }
}
