//! The NemotronH forward step on a [`Runtime`]: the model's weights in a device layout made for
//! the kernels ([`WeightImage`], [`DeviceModel`]), the activation workspace of the largest step
//! ([`ForwardLimits`], [`Workspace`]), and [`DeviceModel::forward`], which runs one step's rows
//! through every layer over the device's paged KV pool and state slots and leaves the logits of
//! the rows asked for.
//!
//! # The step
//! A step is a list of runs ([`StepRun`]): consecutive positions of one sequence (a prefill
//! chunk, or one decode token), each with its block table and state slot. Rows are the runs'
//! tokens, run after run, in position order. Every layer handles all rows at once: GEMMs batch
//! them; the Mamba2 conv and SSM walk each run in order (token by token with a decode step's
//! operations; the chunked scan for prefill runs in [`ForwardMode::Fast`]), continuing from the
//! slot's state; attention
//! writes every row's K/V first, then each row attends keys `0..=pos` of its table, so rows of a
//! prefill chunk see the chunk's earlier rows and any cached or earlier-computed blocks. Prefill
//! runs attend in flash-style query tiles (`kernels::attention_tiled`: keys and values staged in
//! shared memory, read once per tile of up to 16 queries), decode rows as one-row tiles (by the
//! split kernel in [`ForwardMode::Fast`]); both split long contexts across thread blocks and
//! merge.
//!
//! # The MTP head
//! A model whose checkpoint carries `mtp.*` tensors keeps its MTP head in the image too
//! ([`DeviceModel::has_mtp`]). [`DeviceModel::mtp`] runs it over a step's runs as
//! `model::Model::mtp` does (the input `eh_proj [enorm(E[token]), hnorm(hidden)]`, the MTP
//! layers with KV and state after the main stack's, the final norm, the shared `lm_head`), fed
//! by the main stack's final-normed hidden states ([`DeviceModel::forward_hidden`]) or by its
//! own outputs when drafting: what the router's `Draft` plan needs.
//!
//! # Weights
//! GEMM matrices (embeddings, projections, experts stacked `[E, out, in]`, `lm_head`) are in the
//! configured element type; the fused QKV projection is one matrix. Everything else (norm
//! weights, conv weights and bias, `dt_bias`, `A = -exp(A_log)`, `D`, biases, the MoE gate and its
//! correction bias) stays f32 whatever the type: those are a few KB per layer, and the router's
//! choices and the SSM's decays are where bf16 rounding would move results most. The host model's
//! math is matched exactly (ARCH.md); the dt clamp follows the model's [`DtClamp`].
//!
//! # Numbers
//! Against the host model (`model::Model`, f32) the device forward differs only by rounding: its
//! reductions run in other orders (block sums, the SSD chunk algebra, online softmax), GEMMs are
//! cuBLAS (or the host sgemm on `SimRuntime`). `tests/forward.rs` measures it: within 1e-4 of
//! the host logits with f32 weights; the bf16 bound is derived there. Among its own steps, in
//! [`ForwardMode::Exact`] (the default), a position's logits are the same bits however the work
//! is cut (`tests/invariance.rs`), which makes the router's caches bit-transparent.

use std::collections::HashMap;
use std::sync::Mutex;

use model::{Config, DtClamp, LayerKind, Model};

use crate::error::{CudaError, Result};
use crate::kernels::{
    self, AttentionShape, AttentionWork, KvPool, MambaShape, MoeDispatch, MoeGemm, MoeRoute,
    SsmScan, StateSlots, StepRows,
};
use crate::runtime::{
    DType, DeviceBuffer, DeviceSlice, Event, Gemm, PinnedBuffer, Runtime, Stream,
};

/// Alignment of every tensor in the weight image and every workspace region.
const ALIGN: usize = 256;
/// Keys per attention split before the step needs more splits.
pub const DEFAULT_SPLIT_KEYS: usize = 256;
/// Attention partials per row and head the workspace holds on average.
const SPLITS_PER_ROW: usize = 4;

fn align(bytes: usize) -> usize {
    bytes.div_ceil(ALIGN) * ALIGN
}

/// A matrix `[rows, cols]` (checkpoint layout `[out, in]`) in the weight image.
#[derive(Debug, Clone, Copy)]
struct Mat {
    offset: usize,
    rows: usize,
    cols: usize,
    dtype: DType,
    bias: Option<Floats>,
}

/// f32 values in the weight image.
#[derive(Debug, Clone, Copy)]
struct Floats {
    offset: usize,
    len: usize,
}

#[derive(Debug, Clone, Copy)]
struct MambaWeights {
    in_proj: Mat,
    conv_weight: Floats,
    conv_bias: Option<Floats>,
    dt_bias: Floats,
    a: Floats,
    d: Floats,
    norm: Floats,
    out_proj: Mat,
    /// Its index among the Mamba layers (its place in a state slot).
    index: usize,
}

#[derive(Debug, Clone, Copy)]
struct MoeWeights {
    gate: Mat,
    correction: Floats,
    /// `[E * I_moe, d']`, experts stacked.
    up: Mat,
    /// `[E * d', I_moe]`, experts stacked.
    down: Mat,
    shared_up: Mat,
    shared_down: Mat,
    latent: Option<(Mat, Mat)>,
}

#[derive(Debug, Clone, Copy)]
enum Mixer {
    Mamba(MambaWeights),
    Attention {
        qkv: Mat,
        o_proj: Mat,
        /// Its index among the attention layers (its place in a KV block).
        index: usize,
    },
    Mlp {
        up: Mat,
        down: Mat,
    },
    Moe(MoeWeights),
}

#[derive(Debug, Clone, Copy)]
struct Layer {
    norm: Floats,
    mixer: Mixer,
}

/// The MTP head in the weight image: `eh_proj [d, 2d]` is stored as its two column halves, so
/// `eh_proj · [enorm(e), hnorm(h)]` is two GEMMs and an add with no concatenated input.
#[derive(Debug, Clone)]
struct MtpLayout {
    enorm: Floats,
    hnorm: Floats,
    /// `eh_proj[:, :d]`, on the normed embedding.
    eh_embed: Mat,
    /// `eh_proj[:, d:]`, on the normed hidden state.
    eh_hidden: Mat,
    /// Their KV and state indices follow the main stack's.
    layers: Vec<Layer>,
    final_norm: Floats,
}

/// Where everything is in the weight image.
#[derive(Debug, Clone)]
struct Layout {
    embeddings: Mat,
    layers: Vec<Layer>,
    norm_f: Floats,
    lm_head: Mat,
    mtp: Option<MtpLayout>,
}

/// The model's weights as device bytes (see the module docs), ready to upload.
#[derive(Debug, Clone)]
pub struct WeightImage {
    bytes: Vec<u8>,
    layout: Layout,
    dtype: DType,
}

/// How a tensor of a seeded random model is filled (see [`DeviceModel::random`]).
#[derive(Debug, Clone, Copy, PartialEq)]
enum Init {
    /// A GEMM matrix: uniform with standard deviation 0.02 (transformers' `initializer_range`).
    Matrix,
    /// Every value the same.
    Const(f32),
    /// Uniform in `[lo, hi)`.
    Uniform(f32, f32),
}

/// One tensor's place and filling in a layout-only image.
#[derive(Debug, Clone, Copy)]
struct Fill {
    offset: usize,
    len: usize,
    dtype: DType,
    init: Init,
}

/// Lays out the image: with the model's tensors it writes their bytes, without (a random model)
/// it only records where each tensor goes and how to fill it.
struct Builder<'m> {
    bytes: Vec<u8>,
    len: usize,
    tensors: Option<HashMap<String, Vec<f32>>>,
    fills: Vec<Fill>,
    dtype: DType,
    model: &'m Config,
}

impl Builder<'_> {
    fn new(
        model: &Config,
        dtype: DType,
        tensors: Option<HashMap<String, Vec<f32>>>,
    ) -> Builder<'_> {
        Builder {
            bytes: Vec::new(),
            len: 0,
            tensors,
            fills: Vec::new(),
            dtype,
            model,
        }
    }

    /// The named tensors concatenated (`None` for a layout-only image).
    fn take(&mut self, names: &[String]) -> Result<Option<Vec<f32>>> {
        let Some(tensors) = &mut self.tensors else {
            return Ok(None);
        };
        let mut values = Vec::new();
        for name in names {
            values.extend(
                tensors.remove(name).ok_or_else(|| {
                    CudaError::BadRange(format!("the model has no tensor {name}"))
                })?,
            );
        }
        Ok(Some(values))
    }

    /// Reserves `len` values of `dtype` at the next aligned offset, writing `values` (converted)
    /// when given, else recording `init`.
    fn put(
        &mut self,
        values: Option<&[f32]>,
        len: usize,
        dtype: DType,
        init: Init,
    ) -> Result<usize> {
        let offset = align(self.len);
        if let Some(values) = values {
            if values.len() != len {
                return Err(CudaError::BadRange(format!(
                    "a tensor of {} values where the layout needs {len}",
                    values.len()
                )));
            }
            self.bytes.resize(offset, 0);
            match dtype {
                DType::F32 => self
                    .bytes
                    .extend(values.iter().flat_map(|v| v.to_le_bytes())),
                DType::Bf16 => self.bytes.extend(
                    values
                        .iter()
                        .flat_map(|&v| half::bf16::from_f32(v).to_bits().to_le_bytes()),
                ),
            }
        } else {
            self.fills.push(Fill {
                offset,
                len,
                dtype,
                init,
            });
        }
        self.len = offset + len * dtype.bytes();
        Ok(offset)
    }

    /// f32 values: the named tensors concatenated, mapped by `map`.
    fn vector(
        &mut self,
        names: &[String],
        len: usize,
        init: Init,
        map: fn(f32) -> f32,
    ) -> Result<Floats> {
        let values = self
            .take(names)?
            .map(|v| v.into_iter().map(map).collect::<Vec<f32>>());
        let offset = self.put(values.as_deref(), len, DType::F32, init)?;
        Ok(Floats { offset, len })
    }

    fn named(&mut self, name: &str, len: usize, init: Init) -> Result<Floats> {
        self.vector(&[name.to_owned()], len, init, |x| x)
    }

    /// A matrix `[rows, cols]`: the named tensors stacked along rows.
    fn matrix(&mut self, names: &[String], rows: usize, cols: usize, dtype: DType) -> Result<Mat> {
        let values = self.take(names)?;
        let offset = self.put(values.as_deref(), rows * cols, dtype, Init::Matrix)?;
        Ok(Mat {
            offset,
            rows,
            cols,
            dtype,
            bias: None,
        })
    }

    /// `{prefix}.weight` `[rows, cols]` and `{prefix}.bias` when `bias`.
    fn linear(
        &mut self,
        prefix: &str,
        rows: usize,
        cols: usize,
        bias: bool,
        dtype: DType,
    ) -> Result<Mat> {
        let mut mat = self.matrix(&[format!("{prefix}.weight")], rows, cols, dtype)?;
        if bias {
            mat.bias = Some(self.named(&format!("{prefix}.bias"), rows, Init::Const(0.0))?);
        }
        Ok(mat)
    }

    /// The experts' `{which}` matrices stacked `[E * rows, cols]`, their biases `[E * rows]`.
    fn stacked(&mut self, m: &str, which: &str, rows: usize, cols: usize) -> Result<Mat> {
        let experts = self.model.n_routed_experts;
        let names: Vec<String> = (0..experts)
            .map(|j| format!("{m}.experts.{j}.{which}.weight"))
            .collect();
        let mut mat = self.matrix(&names, experts * rows, cols, self.dtype)?;
        if self.model.mlp_bias {
            let names: Vec<String> = (0..experts)
                .map(|j| format!("{m}.experts.{j}.{which}.bias"))
                .collect();
            mat.bias = Some(self.vector(&names, experts * rows, Init::Const(0.0), |x| x)?);
        }
        Ok(mat)
    }

    /// The pre-norm block named `p` (`backbone.layers.{i}` or `mtp.layers.{i}`); `indices` are
    /// the next (attention, Mamba) indices.
    fn layer(&mut self, p: &str, kind: LayerKind, indices: &mut (usize, usize)) -> Result<Layer> {
        let c = self.model;
        let (d, dtype) = (c.hidden_size, self.dtype);
        let norm = self.named(&format!("{p}.norm.weight"), d, Init::Const(1.0))?;
        let m = format!("{p}.mixer");
        let mixer = match kind {
            LayerKind::Mamba => {
                let (inner, h) = (c.mamba_inner(), c.mamba_num_heads);
                let conv_dim = c.mamba_conv_dim();
                let in_proj = self.linear(
                    &format!("{m}.in_proj"),
                    c.mamba_in_proj_dim(),
                    d,
                    c.use_bias,
                    dtype,
                )?;
                let conv_weight = self.named(
                    &format!("{m}.conv1d.weight"),
                    conv_dim * c.conv_kernel,
                    Init::Uniform(-0.5, 0.5),
                )?;
                let conv_bias = if c.use_conv_bias {
                    Some(self.named(&format!("{m}.conv1d.bias"), conv_dim, Init::Const(0.0))?)
                } else {
                    None
                };
                // A random model draws dt in [0.001, 0.1] through softplus⁻¹, as transformers'
                // initialisation does.
                let dt_bias = self.named(&format!("{m}.dt_bias"), h, Init::Uniform(-6.9, -2.25))?;
                // A = -exp(A_log), as the host model derives it (a random model: A_log in
                // [0, ln 16), so A in (-16, -1]).
                let a = self.vector(
                    &[format!("{m}.A_log")],
                    h,
                    Init::Uniform(-16.0, -1.0),
                    |x| -x.exp(),
                )?;
                let d_skip = self.named(&format!("{m}.D"), h, Init::Const(1.0))?;
                let gnorm = self.named(&format!("{m}.norm.weight"), inner, Init::Const(1.0))?;
                let out_proj =
                    self.linear(&format!("{m}.out_proj"), d, inner, c.use_bias, dtype)?;
                indices.1 += 1;
                Mixer::Mamba(MambaWeights {
                    in_proj,
                    conv_weight,
                    conv_bias,
                    dt_bias,
                    a,
                    d: d_skip,
                    norm: gnorm,
                    out_proj,
                    index: indices.1 - 1,
                })
            }
            LayerKind::Attention => {
                let (nh, nkv, hd) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
                let names = ["q_proj", "k_proj", "v_proj"].map(|w| format!("{m}.{w}.weight"));
                let qkv = self.matrix(&names, (nh + 2 * nkv) * hd, d, dtype)?;
                let o_proj = self.linear(&format!("{m}.o_proj"), d, nh * hd, false, dtype)?;
                indices.0 += 1;
                Mixer::Attention {
                    qkv,
                    o_proj,
                    index: indices.0 - 1,
                }
            }
            LayerKind::Mlp => Mixer::Mlp {
                up: self.linear(
                    &format!("{m}.up_proj"),
                    c.intermediate_size,
                    d,
                    c.mlp_bias,
                    dtype,
                )?,
                down: self.linear(
                    &format!("{m}.down_proj"),
                    d,
                    c.intermediate_size,
                    c.mlp_bias,
                    dtype,
                )?,
            },
            LayerKind::Moe => {
                let e = c.n_routed_experts;
                let (moe_i, shared_i, ed) = (
                    c.moe_intermediate_size,
                    c.moe_shared_expert_intermediate_size,
                    c.moe_expert_dim(),
                );
                // The gate stays f32: the router's choices are the most rounding-sensitive step.
                let gate = self.linear(&format!("{m}.gate"), e, d, false, DType::F32)?;
                let correction = self.named(
                    &format!("{m}.gate.e_score_correction_bias"),
                    e,
                    Init::Const(0.0),
                )?;
                let up = self.stacked(&m, "up_proj", moe_i, ed)?;
                let down = self.stacked(&m, "down_proj", ed, moe_i)?;
                let shared_up = self.linear(
                    &format!("{m}.shared_experts.up_proj"),
                    shared_i,
                    d,
                    c.mlp_bias,
                    dtype,
                )?;
                let shared_down = self.linear(
                    &format!("{m}.shared_experts.down_proj"),
                    d,
                    shared_i,
                    c.mlp_bias,
                    dtype,
                )?;
                let latent = match c.moe_latent_size {
                    Some(l) => Some((
                        self.linear(&format!("{m}.fc1_latent_proj"), l, d, c.mlp_bias, dtype)?,
                        self.linear(&format!("{m}.fc2_latent_proj"), d, l, c.mlp_bias, dtype)?,
                    )),
                    None => None,
                };
                Mixer::Moe(MoeWeights {
                    gate,
                    correction,
                    up,
                    down,
                    shared_up,
                    shared_down,
                    latent,
                })
            }
        };
        Ok(Layer { norm, mixer })
    }

    /// The whole main stack.
    fn build(&mut self) -> Result<Layout> {
        let config = self.model;
        let (v, d, dtype) = (config.vocab_size, config.hidden_size, self.dtype);
        let embeddings = self.linear("backbone.embeddings", v, d, false, dtype)?;
        let mut indices = (0, 0);
        let layers = config
            .layer_kinds
            .iter()
            .enumerate()
            .map(|(i, &kind)| self.layer(&format!("backbone.layers.{i}"), kind, &mut indices))
            .collect::<Result<Vec<_>>>()?;
        let norm_f = self.named("backbone.norm_f.weight", d, Init::Const(1.0))?;
        let lm_head = self.linear("lm_head", v, d, false, dtype)?;
        let mtp = if config.mtp {
            Some(self.mtp(&mut indices)?)
        } else {
            None
        };
        Ok(Layout {
            embeddings,
            layers,
            norm_f,
            lm_head,
            mtp,
        })
    }

    /// The MTP head (`mtp.layers.*`), its layers' indices after the main stack's.
    fn mtp(&mut self, indices: &mut (usize, usize)) -> Result<MtpLayout> {
        let config = self.model;
        let (d, dtype) = (config.hidden_size, self.dtype);
        let enorm = self.named("mtp.layers.0.enorm.weight", d, Init::Const(1.0))?;
        let hnorm = self.named("mtp.layers.0.hnorm.weight", d, Init::Const(1.0))?;
        // eh_proj [d, 2d] row by row: the first d columns act on the embedding, the last d on the
        // hidden state.
        let (embed_half, hidden_half) =
            match self.take(&["mtp.layers.0.eh_proj.weight".to_owned()])? {
                Some(values) => {
                    if values.len() != 2 * d * d {
                        return Err(CudaError::BadRange(format!(
                            "mtp.layers.0.eh_proj.weight has {} values, [{d}, {}] needs {}",
                            values.len(),
                            2 * d,
                            2 * d * d
                        )));
                    }
                    let (mut e, mut h) = (Vec::with_capacity(d * d), Vec::with_capacity(d * d));
                    for row in values.chunks_exact(2 * d) {
                        e.extend_from_slice(&row[..d]);
                        h.extend_from_slice(&row[d..]);
                    }
                    (Some(e), Some(h))
                }
                None => (None, None),
            };
        let mut half = |values: Option<Vec<f32>>| -> Result<Mat> {
            let offset = self.put(values.as_deref(), d * d, dtype, Init::Matrix)?;
            Ok(Mat {
                offset,
                rows: d,
                cols: d,
                dtype,
                bias: None,
            })
        };
        let eh_embed = half(embed_half)?;
        let eh_hidden = half(hidden_half)?;
        let layers = config
            .mtp_layer_kinds
            .iter()
            .enumerate()
            .map(|(i, &kind)| self.layer(&format!("mtp.layers.{i}"), kind, indices))
            .collect::<Result<Vec<_>>>()?;
        let last = config.mtp_layer_kinds.len().saturating_sub(1);
        let final_norm = self.named(
            &format!("mtp.layers.{last}.final_layernorm.weight"),
            d,
            Init::Const(1.0),
        )?;
        Ok(MtpLayout {
            enorm,
            hnorm,
            eh_embed,
            eh_hidden,
            layers,
            final_norm,
        })
    }
}

impl WeightImage {
    /// The weights of `model` (its main stack, and its MTP head when it has one) with GEMM
    /// matrices in `dtype`.
    pub fn new(model: &Model, dtype: DType) -> Result<WeightImage> {
        let config = model.config();
        let mut tensors = HashMap::new();
        model.visit_tensors(&mut |name, _shape, data| {
            tensors.insert(name.to_owned(), data.to_vec());
        });
        let mut b = Builder::new(config, dtype, Some(tensors));
        let layout = b.build()?;
        Ok(WeightImage {
            bytes: b.bytes,
            layout,
            dtype,
        })
    }

    /// Its size in bytes.
    pub fn bytes(&self) -> usize {
        self.bytes.len()
    }
}

/// `model` with the matrices a [`DType::Bf16`] [`WeightImage`] keeps in bf16 rounded to bf16
/// (every 2-D weight but the MoE router's gate), on the host: the reference that bounds a bf16
/// device run, whose difference from `model` is the weights' own rounding.
pub fn bf16_shadow(model: &Model) -> std::result::Result<Model, model::ModelError> {
    model.map_tensors(&mut |name, shape, values| {
        if shape.len() == 2 && !name.ends_with(".gate.weight") {
            for v in values {
                *v = half::bf16::from_f32(*v).to_f32();
            }
        }
    })
}

/// The largest step a [`Workspace`] serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ForwardLimits {
    /// Rows (tokens) of one step.
    pub max_rows: usize,
    /// Runs (sequences) of one step.
    pub max_runs: usize,
    /// Block-table entries of one step, all runs together.
    pub max_table: usize,
}

#[derive(Debug, Clone, Copy)]
struct Region {
    offset: usize,
    bytes: usize,
}

impl Region {
    /// The region's first `bytes` bytes in `workspace`.
    fn slice(&self, workspace: DeviceSlice, bytes: usize) -> Result<DeviceSlice> {
        if bytes > self.bytes {
            return Err(CudaError::BadRange(format!(
                "forward workspace: {bytes} bytes wanted of a region of {}",
                self.bytes
            )));
        }
        workspace.range(self.offset, bytes)
    }
}

/// The activation workspace's regions for a config and its limits.
#[derive(Debug, Clone)]
pub struct Workspace {
    limits: ForwardLimits,
    partial_entries: usize,
    pad_cap: usize,
    /// Bytes of the largest step's descriptor (the upload staging's size, see [`DeviceModel`]).
    desc_bytes: usize,
    hidden: Region,
    normed: Region,
    out: Region,
    proj: Region,
    xbc: Region,
    y: Region,
    half: Region,
    partial: Region,
    router: Region,
    choice: Region,
    weight: Region,
    counts: Region,
    sorted: Region,
    tile_expert: Region,
    assign_pos: Region,
    expert_act: Region,
    expert_out: Region,
    latent_in: Region,
    routed: Region,
    total: usize,
}

impl Workspace {
    /// The layout for `config` and `limits` (all sizes at least 1).
    pub fn new(config: &Config, limits: ForwardLimits) -> Result<Workspace> {
        if limits.max_rows == 0 || limits.max_runs == 0 {
            return Err(CudaError::BadRange(format!(
                "forward limits {limits:?}: at least one row and one run"
            )));
        }
        let m = limits.max_rows;
        let d = config.hidden_size;
        // The MTP head's layers run in the same workspace.
        let has = |k| config.uses(k);
        let (nh, hd) = (config.num_attention_heads, config.head_dim);
        let mut proj_w = d;
        let mut y_w = d;
        let mut conv_w = 0;
        let mut half_w = d;
        if has(LayerKind::Mamba) {
            proj_w = proj_w.max(config.mamba_in_proj_dim());
            y_w = y_w.max(config.mamba_inner());
            conv_w = config.mamba_conv_dim();
            half_w = half_w.max(config.mamba_inner());
        }
        if has(LayerKind::Attention) {
            proj_w = proj_w.max((nh + 2 * config.num_key_value_heads) * hd);
            y_w = y_w.max(nh * hd);
            half_w = half_w.max(nh * hd);
        }
        if has(LayerKind::Mlp) {
            proj_w = proj_w.max(config.intermediate_size);
            half_w = half_w.max(config.intermediate_size);
        }
        let (mut e, mut k, mut moe_i, mut ed, mut latent) = (0, 0, 0, 0, 0);
        if has(LayerKind::Moe) {
            e = config.n_routed_experts;
            k = config.num_experts_per_tok;
            moe_i = config.moe_intermediate_size;
            ed = config.moe_expert_dim();
            latent = config.moe_latent_size.map_or(0, |_| ed);
            proj_w = proj_w.max(config.moe_shared_expert_intermediate_size);
            half_w = half_w
                .max(config.moe_shared_expert_intermediate_size)
                .max(ed);
        }
        let partial_entries = if has(LayerKind::Attention) {
            m * nh * SPLITS_PER_ROW
        } else {
            0
        };
        let pad_cap = if e > 0 {
            MoeDispatch::pad_cap(m, k, e)
        } else {
            0
        };
        let mut cursor = 0usize;
        let mut region = |bytes: usize| {
            let r = Region {
                offset: cursor,
                bytes,
            };
            cursor = align(cursor + bytes.max(1));
            r
        };
        // Row positions and runs, runs, tables, logit rows, the attention plan (tiles of two
        // words and single rows: at most two words a row), and the rows' snapshot slots.
        let desc_words = 2 * m + 6 * limits.max_runs + limits.max_table + m + 2 * m + m;
        let ws = Workspace {
            limits,
            partial_entries,
            pad_cap,
            desc_bytes: 4 * desc_words,
            hidden: region(4 * m * d),
            normed: region(4 * m * d),
            out: region(4 * m * d),
            proj: region(4 * m * proj_w),
            xbc: region(4 * m * conv_w),
            y: region(4 * m * y_w),
            half: region(2 * m * half_w),
            partial: region(4 * partial_entries * (hd + 2)),
            router: region(4 * m * e),
            choice: region(4 * m * k),
            weight: region(4 * m * k),
            counts: region(4 * e),
            sorted: region(4 * pad_cap),
            tile_expert: region(4 * (pad_cap / kernels::MOE_TILE_ROWS)),
            assign_pos: region(4 * m * k),
            expert_act: region(4 * pad_cap * moe_i),
            expert_out: region(4 * pad_cap * ed),
            latent_in: region(4 * m * latent),
            routed: region(4 * m * latent),
            total: 0,
        };
        Ok(Workspace {
            total: cursor,
            ..ws
        })
    }

    /// Bytes the workspace buffer needs.
    pub fn bytes(&self) -> usize {
        self.total
    }

    /// The limits it was made for.
    pub fn limits(&self) -> ForwardLimits {
        self.limits
    }
}

/// One run of a step: `len` consecutive positions of one sequence from `start_pos`.
#[derive(Debug, Clone, Copy)]
pub struct StepRun<'a> {
    /// Position of the run's first token.
    pub start_pos: usize,
    /// Tokens, at least one.
    pub len: usize,
    /// The sequence's state slot (distinct across the runs of a step).
    pub slot: usize,
    /// The sequence's block table; covers `start_pos + len` positions when the model has
    /// attention.
    pub blocks: &'a [u32],
    /// Empty, or the state slots that receive the Mamba state (every Mamba layer of the stack
    /// the step runs) as it is after each of the run's first `snapshots.len()` tokens (at most
    /// `len`): a verification's rewind points. Distinct across the step, and none a run's slot.
    /// A step with snapshots scans token by token whatever the [`ForwardMode`].
    pub snapshots: &'a [usize],
}

/// The device's KV pool and state slots, in the host model's layouts.
#[derive(Debug, Clone, Copy)]
pub struct DeviceState {
    /// `num_blocks * block_floats` f32.
    pub kv: DeviceSlice,
    /// Blocks in the pool.
    pub num_blocks: usize,
    /// Tokens per block.
    pub block_size: usize,
    /// Floats per block (`model::KvPool::floats_per_block`).
    pub block_floats: usize,
    /// `num_slots * slot_floats` f32.
    pub states: DeviceSlice,
    /// State slots.
    pub num_slots: usize,
    /// Floats per slot (at least `model::MambaLayout::state_floats`).
    pub slot_floats: usize,
}

/// The double-buffered upload of step descriptors: two pinned host buffers and two device
/// buffers ("halves"), used alternately step by step, so the host prepares step `i + 1` while the
/// device still runs step `i`, and no upload serialises the host with the device.
///
/// Step `i` uses half `k = i % 2`:
/// 1. the host writes the descriptor into `pinned[k]` (the runtime first waits for the copy that
///    step `i - 2` issued from it, so the host runs at most two steps ahead of the copies);
/// 2. the copy stream waits for `consumed[k]` (recorded on the compute stream after step `i - 2`,
///    the last reader of `device[k]`), copies `pinned[k]` to `device[k]` and records
///    `uploaded[k]`;
/// 3. the compute stream waits for `uploaded[k]`, runs the step reading `device[k]`, and records
///    `consumed[k]`.
///
/// Invariant: between the copy into `device[k]` and the next `consumed[k]` record, only the
/// compute stream's step `i` reads `device[k]`. Without the wait of step 2, step `i + 2`'s copy
/// could overwrite `device[k]` while step `i`'s kernels read it (the copy stream runs ahead of
/// the compute stream wherever no event orders them); `tests/forward.rs` shows that race on
/// `SimRuntime` under `Schedule::CopyFirst`.
#[derive(Debug)]
struct Staging {
    pinned: [PinnedBuffer; 2],
    device: [DeviceBuffer; 2],
    uploaded: [Event; 2],
    consumed: [Event; 2],
    /// Bytes of each buffer.
    bytes: usize,
    /// The half the next step uses.
    next: usize,
}

impl Staging {
    fn new(rt: &dyn Runtime, bytes: usize) -> Result<Staging> {
        let bytes = bytes.max(4);
        Ok(Staging {
            pinned: [rt.alloc_pinned(bytes)?, rt.alloc_pinned(bytes)?],
            device: [rt.alloc(bytes)?, rt.alloc(bytes)?],
            uploaded: [rt.new_event()?, rt.new_event()?],
            consumed: [rt.new_event()?, rt.new_event()?],
            bytes,
            next: 0,
        })
    }

    /// Frees everything once the streams are done with it.
    fn free(self, rt: &dyn Runtime) -> Result<()> {
        let Staging {
            pinned,
            device,
            uploaded,
            consumed,
            ..
        } = self;
        for event in &consumed {
            rt.sync_event(event)?;
        }
        for buffer in pinned {
            rt.free_pinned(buffer)?;
        }
        for buffer in device {
            rt.free(buffer)?;
        }
        for event in uploaded.into_iter().chain(consumed) {
            rt.destroy_event(event)?;
        }
        Ok(())
    }

    /// Uploads `words` through the next half (made or grown to `capacity` bytes first) and makes
    /// the compute stream wait for it; answers the device copy and the half.
    fn upload(
        slot: &mut Option<Staging>,
        rt: &dyn Runtime,
        capacity: usize,
        words: &[u32],
    ) -> Result<(DeviceSlice, usize)> {
        let bytes: &[u8] = bytemuck::cast_slice(words);
        let capacity = capacity.max(bytes.len());
        if slot.as_ref().is_some_and(|s| s.bytes < capacity) {
            if let Some(old) = slot.take() {
                old.free(rt)?;
            }
        }
        if slot.is_none() {
            *slot = Some(Staging::new(rt, capacity)?);
        }
        let staging = slot
            .as_mut()
            .ok_or_else(|| CudaError::Sticky("the descriptor staging is missing".to_owned()))?;
        let k = staging.next;
        staging.next ^= 1;
        let desc = staging.device[k].range(0, bytes.len())?;
        rt.write_pinned(&staging.pinned[k], 0, bytes)?;
        rt.wait_event(Stream::Copy, &staging.consumed[k])?;
        rt.copy_from_pinned(desc, &staging.pinned[k], 0, Stream::Copy)?;
        rt.record(&staging.uploaded[k], Stream::Copy)?;
        rt.wait_event(Stream::Compute, &staging.uploaded[k])?;
        Ok((desc, k))
    }
}

/// Whose final-normed hidden states [`DeviceModel::forward_hidden`] writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HiddenRows {
    /// Each of `step.out.logit_rows`' (`logit_rows.len() * hidden_size` f32), as
    /// `model::Model::forward_runs` gives them.
    Logit,
    /// Every row's of the step (`rows * hidden_size` f32): the MTP head's input over a prefill
    /// chunk. (The norm is the residual-norm kernel's over all rows: equal to the logit rows'
    /// selected norm only to rounding.)
    All,
}

/// Which stack a step runs, and its hidden streams.
#[derive(Debug, Clone, Copy)]
enum Entry {
    /// The main model; `hidden_out` takes the final-normed rows of the logit rows, or of every
    /// row with `all_rows`.
    Main {
        hidden_out: Option<DeviceSlice>,
        all_rows: bool,
    },
    /// The MTP head over `hidden_in` (one row per step row).
    Mtp {
        hidden_in: DeviceSlice,
        hidden_out: DeviceSlice,
    },
}

/// A checked step's descriptor (see [`DeviceModel::describe`]).
struct Described {
    /// Row positions, row runs, runs (six words each), block tables, logit rows, attention
    /// tiles (two words each), attention single rows, and (when a run has any) each row's
    /// snapshot slot (`u32::MAX`: none).
    words: Vec<u32>,
    /// Whether the descriptor ends with the rows' snapshot slots.
    snapshots: bool,
    /// Each run's length.
    lens: Vec<usize>,
    rows: usize,
    table_len: usize,
    num_tiles: usize,
    num_singles: usize,
}

/// What the device forward guarantees beyond the host model's tolerance.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ForwardMode {
    /// Every position's arithmetic is independent of how the work is cut (the run it is part
    /// of, where the run starts, the other rows of the step, prefill or decode), so a sequence's
    /// logits are the same bits with the caches on or off (prefix hits, Marconi restores,
    /// chunking, pipeline depth): the Mamba scan walks each run token by token with a decode
    /// step's operations (`SsmScan::Sequential`); every attention row, decode rows included,
    /// goes through the tiled kernel; attention splits are at absolute key positions, of one
    /// width for every step (the configured one, doubled until a sequence of a run's share of
    /// the workspace's tables, the router's longest context, needs at most `SPLITS_PER_ROW`
    /// splits). On `SimRuntime` the GEMMs (matrixmultiply) and the other kernels are per-row
    /// invariant. On a GPU the kernels are too, but a cuBLAS GEMM may pick another algorithm
    /// (split-K, tile shape) for another row count, so there only the kernels' part holds.
    #[default]
    Exact,
    /// Faster on long prompts and decode, equal to `Exact` only to rounding: the chunked scan
    /// (SSD) for prefill runs (chunks from each run's start), decode rows through the split
    /// kernel, attention splits balanced over the step's longest sequence.
    Fast,
}

/// The attention split width of [`ForwardMode::Exact`]: the configured width, doubled until a
/// sequence of `most_keys` keys needs at most [`SPLITS_PER_ROW`] splits (what the workspace
/// holds for every row of the largest step). It depends on the workspace only, so a key's split,
/// and so every row's arithmetic, is the same in every step (of sequences up to `most_keys`).
fn exact_split_width(most_keys: usize, split_keys: usize) -> usize {
    let mut width = split_keys.max(1);
    while most_keys.div_ceil(width) > SPLITS_PER_ROW {
        width = width.saturating_mul(2);
    }
    width
}

/// The model on the device: its weights (see [`WeightImage`]) and config.
#[derive(Debug)]
pub struct DeviceModel {
    config: Config,
    dtype: DType,
    layout: Layout,
    weights: Option<DeviceBuffer>,
    split_keys: usize,
    /// Bit-exact however the work is cut, or faster (see [`ForwardMode`]).
    mode: ForwardMode,
    /// The descriptor upload's buffers and events, made by the first step.
    staging: Mutex<Option<Staging>>,
}

/// What every entry point of [`DeviceModel`] reads and writes but its hidden streams: one step's
/// buffers, state, runs and outputs.
#[derive(Debug, Clone, Copy)]
pub struct StepArgs<'a> {
    /// The forward's scratch memory, at least `workspace_layout.bytes()` bytes; no hidden stream
    /// of the step may overlap it.
    pub workspace: DeviceSlice,
    /// Where each buffer of the step lies in `workspace` ([`Workspace::new`]).
    pub workspace_layout: &'a Workspace,
    /// The KV pool and the state slots the step reads and advances.
    pub state: &'a DeviceState,
    /// The step's runs, in row order.
    pub runs: &'a [StepRun<'a>],
    /// One u32 token a row of the step.
    pub tokens: DeviceSlice,
    /// The rows that want logits and where they go.
    pub out: StepOutput<'a>,
}

/// What [`DeviceModel::forward`] writes.
#[derive(Debug, Clone, Copy)]
pub struct StepOutput<'a> {
    /// The rows (indices into the step's rows) that want logits.
    pub logit_rows: &'a [u32],
    /// `logit_rows.len() * vocab` f32.
    pub logits: DeviceSlice,
}

impl DeviceModel {
    /// Sets the forward's mode (see [`ForwardMode`]; [`ForwardMode::Exact`] by default).
    pub fn set_mode(&mut self, mode: ForwardMode) {
        self.mode = mode;
    }

    /// The forward's mode.
    pub fn mode(&self) -> ForwardMode {
        self.mode
    }

    /// Uploads `image` (of `model`) to a new buffer of `rt`.
    pub fn upload(rt: &dyn Runtime, model: &Model, image: &WeightImage) -> Result<DeviceModel> {
        let weights = rt.alloc(image.bytes.len())?;
        rt.upload(weights.all(), &image.bytes, Stream::Copy)?;
        rt.sync_stream(Stream::Copy)?;
        Ok(DeviceModel {
            config: model.config().clone(),
            dtype: image.dtype,
            layout: image.layout.clone(),
            weights: Some(weights),
            split_keys: DEFAULT_SPLIT_KEYS,
            mode: ForwardMode::default(),
            staging: Mutex::new(None),
        })
    }

    /// A model of `config` with seeded random weights built on the device, with no host copy of
    /// them (for benchmarks at real sizes): matrices are filled by device copies from a seeded
    /// pool of 2^22 values uniform with standard deviation 0.02, each copy from a seeded offset;
    /// the other tensors as transformers initialises them (norms and `D` 1, `A` in (-16, -1],
    /// dt through softplus in [0.001, 0.1], conv weights uniform in ±0.5, biases 0).
    pub fn random(
        rt: &dyn Runtime,
        config: &Config,
        dtype: DType,
        seed: u64,
    ) -> Result<DeviceModel> {
        use rand::{Rng, SeedableRng};
        config
            .validate()
            .map_err(|e| CudaError::BadRange(format!("config: {e}")))?;
        let mut b = Builder::new(config, dtype, None);
        let layout = b.build()?;
        let weights = rt.alloc(b.len.max(4))?;
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        const POOL: usize = 1 << 22;
        let bound = 0.02 * 3f32.sqrt();
        let pool: Vec<f32> = (0..POOL).map(|_| rng.random_range(-bound..bound)).collect();
        let pools = [DType::F32, DType::Bf16].map(|t| {
            let bytes: Vec<u8> = match t {
                DType::F32 => pool.iter().flat_map(|v| v.to_le_bytes()).collect(),
                DType::Bf16 => pool
                    .iter()
                    .flat_map(|&v| half::bf16::from_f32(v).to_bits().to_le_bytes())
                    .collect(),
            };
            (t, bytes)
        });
        let s = Stream::Compute;
        let mut buffers = Vec::new();
        for (t, bytes) in &pools {
            let buffer = rt.alloc(bytes.len())?;
            rt.upload(buffer.all(), bytes, s)?;
            buffers.push((*t, buffer));
        }
        let result = (|| -> Result<()> {
            for fill in &b.fills {
                let elem = fill.dtype.bytes();
                match fill.init {
                    Init::Matrix => {
                        let source = &buffers
                            .iter()
                            .find(|(t, _)| *t == fill.dtype)
                            .ok_or_else(|| CudaError::BadRange("no pool".to_owned()))?
                            .1;
                        let mut done = 0;
                        while done < fill.len {
                            let start = rng.random_range(0..POOL / 2);
                            let count = (fill.len - done).min(POOL - start);
                            rt.copy(
                                weights.range(fill.offset + done * elem, count * elem)?,
                                source.range(start * elem, count * elem)?,
                                s,
                            )?;
                            done += count;
                        }
                    }
                    Init::Const(v) => {
                        let values = vec![v; fill.len];
                        rt.upload(
                            weights.range(fill.offset, fill.len * 4)?,
                            bytemuck::cast_slice(&values),
                            s,
                        )?;
                    }
                    Init::Uniform(lo, hi) => {
                        let values: Vec<f32> =
                            (0..fill.len).map(|_| rng.random_range(lo..hi)).collect();
                        rt.upload(
                            weights.range(fill.offset, fill.len * 4)?,
                            bytemuck::cast_slice(&values),
                            s,
                        )?;
                    }
                }
            }
            rt.sync_stream(s)
        })();
        for (_, buffer) in buffers {
            rt.free(buffer)?;
        }
        if let Err(err) = result {
            rt.free(weights)?;
            return Err(err);
        }
        Ok(DeviceModel {
            config: config.clone(),
            dtype,
            layout,
            weights: Some(weights),
            split_keys: DEFAULT_SPLIT_KEYS,
            mode: ForwardMode::default(),
            staging: Mutex::new(None),
        })
    }

    /// Bytes of the weights on the device.
    pub fn weight_bytes(&self) -> usize {
        self.weights.as_ref().map_or(0, DeviceBuffer::bytes)
    }

    /// Bytes a decode step reads per token from the weights: every matrix but the embedding
    /// table (one row of it), every f32 vector.
    pub fn weight_bytes_per_token(&self) -> usize {
        let l = &self.layout;
        let mat = |m: &Mat| m.rows * m.cols * m.dtype.bytes() + m.bias.map_or(0, |b| b.len * 4);
        let mut total =
            l.embeddings.cols * l.embeddings.dtype.bytes() + mat(&l.lm_head) + l.norm_f.len * 4;
        for layer in &l.layers {
            total += layer.norm.len * 4;
            total += match &layer.mixer {
                Mixer::Mamba(w) => {
                    mat(&w.in_proj)
                        + mat(&w.out_proj)
                        + [w.conv_weight, w.dt_bias, w.a, w.d, w.norm]
                            .iter()
                            .map(|f| f.len * 4)
                            .sum::<usize>()
                }
                Mixer::Attention { qkv, o_proj, .. } => mat(qkv) + mat(o_proj),
                Mixer::Mlp { up, down } => mat(up) + mat(down),
                Mixer::Moe(w) => {
                    // The gate, the shared expert and k of the routed experts.
                    let k = self.config.num_experts_per_tok;
                    let e = self.config.n_routed_experts.max(1);
                    mat(&w.gate)
                        + mat(&w.shared_up)
                        + mat(&w.shared_down)
                        + (mat(&w.up) + mat(&w.down)) / e * k
                }
            };
        }
        total
    }

    /// The same model splitting attention every `split_keys` keys (tests use small values to
    /// exercise the merge).
    pub fn with_split_keys(mut self, split_keys: usize) -> DeviceModel {
        self.split_keys = split_keys.max(1);
        self
    }

    /// The config.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// The element type of the GEMM weights.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Frees the weights and the descriptor staging (after the steps that use them).
    pub fn free(mut self, rt: &dyn Runtime) -> Result<()> {
        let staging = self
            .staging
            .get_mut()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .take();
        if let Some(staging) = staging {
            staging.free(rt)?;
        }
        match self.weights.take() {
            Some(buffer) => rt.free(buffer),
            None => Ok(()),
        }
    }

    fn buffer(&self) -> Result<&DeviceBuffer> {
        self.weights
            .as_ref()
            .ok_or_else(|| CudaError::Sticky("the model's weights were freed".to_owned()))
    }

    fn mat(&self, mat: &Mat) -> Result<DeviceSlice> {
        self.buffer()?
            .range(mat.offset, mat.rows * mat.cols * mat.dtype.bytes())
    }

    fn floats(&self, f: &Floats) -> Result<DeviceSlice> {
        self.buffer()?.range(f.offset, f.len * 4)
    }

    fn bias(&self, mat: &Mat) -> Result<Option<DeviceSlice>> {
        mat.bias.as_ref().map(|b| self.floats(b)).transpose()
    }

    /// Checks a step against the model, the state and the workspace; answers the words of its
    /// descriptor (row positions, row runs, runs, tables, logit rows, attention tiles and single
    /// rows) and the run lengths.
    fn describe(
        &self,
        ws: &Workspace,
        state: &DeviceState,
        runs: &[StepRun<'_>],
        out: &StepOutput<'_>,
    ) -> Result<Described> {
        let bad = |detail: String| Err(CudaError::BadRange(format!("forward step: {detail}")));
        let limits = ws.limits;
        let rows: usize = runs.iter().map(|r| r.len).sum();
        if runs.is_empty() || rows == 0 {
            return bad("no rows".to_owned());
        }
        if rows > limits.max_rows || runs.len() > limits.max_runs {
            return bad(format!(
                "{rows} rows in {} runs (the workspace holds {} rows, {} runs)",
                runs.len(),
                limits.max_rows,
                limits.max_runs
            ));
        }
        let attention = self.config.uses(LayerKind::Attention);
        let mamba = self.config.uses(LayerKind::Mamba);
        let mut row_pos = Vec::with_capacity(rows);
        let mut row_run = Vec::with_capacity(rows);
        let mut run_words = Vec::with_capacity(6 * runs.len());
        let mut tables = Vec::new();
        let mut slots = Vec::with_capacity(runs.len());
        let mut writes = Vec::new();
        // Each row's snapshot slot, when any run names one.
        let any_snapshots = mamba && runs.iter().any(|run| !run.snapshots.is_empty());
        let mut row_snap: Vec<u32> = Vec::new();
        let mut snap_slots = Vec::new();
        let u32_of = |value: usize, what: &str| {
            u32::try_from(value)
                .map_err(|_| CudaError::BadRange(format!("forward step: {what} {value} > u32")))
        };
        for (i, run) in runs.iter().enumerate() {
            if run.len == 0 {
                return bad(format!("run {i} has no tokens"));
            }
            if run.slot >= state.num_slots {
                return bad(format!(
                    "run {i}: slot {} of {} slots",
                    run.slot, state.num_slots
                ));
            }
            slots.push(run.slot);
            let end = run
                .start_pos
                .checked_add(run.len)
                .ok_or_else(|| CudaError::BadRange("forward step: position overflow".into()))?;
            u32_of(end, "position")?;
            let mut table: &[u32] = &[];
            if attention {
                let needed = end.div_ceil(state.block_size);
                if run.blocks.len() < needed {
                    return bad(format!(
                        "run {i}: {} blocks cover {} positions, it reaches {end}",
                        run.blocks.len(),
                        run.blocks.len() * state.block_size
                    ));
                }
                table = &run.blocks[..needed];
                if let Some(&b) = table.iter().find(|&&b| b as usize >= state.num_blocks) {
                    return bad(format!(
                        "run {i}: block {b} of a pool of {}",
                        state.num_blocks
                    ));
                }
                for pos in run.start_pos..end {
                    writes.push((table[pos / state.block_size], pos % state.block_size));
                }
            }
            run_words.extend([
                u32_of(row_pos.len(), "row")?,
                u32_of(run.len, "run length")?,
                u32_of(run.start_pos, "position")?,
                u32_of(run.slot, "slot")?,
                u32_of(tables.len(), "table offset")?,
                u32_of(table.len(), "table length")?,
            ]);
            tables.extend_from_slice(table);
            if run.snapshots.len() > run.len {
                return bad(format!(
                    "run {i}: {} snapshot slots for {} tokens",
                    run.snapshots.len(),
                    run.len
                ));
            }
            if let Some(&slot) = run.snapshots.iter().find(|&&s| s >= state.num_slots) {
                return bad(format!(
                    "run {i}: snapshot slot {slot} of {} slots",
                    state.num_slots
                ));
            }
            snap_slots.extend_from_slice(run.snapshots);
            for j in 0..run.len {
                row_pos.push(u32_of(run.start_pos + j, "position")?);
                row_run.push(i as u32);
                if any_snapshots {
                    row_snap.push(match run.snapshots.get(j) {
                        Some(&slot) => u32_of(slot, "snapshot slot")?,
                        None => u32::MAX,
                    });
                }
            }
        }
        if tables.len() > limits.max_table {
            return bad(format!(
                "{} block-table entries (the workspace holds {})",
                tables.len(),
                limits.max_table
            ));
        }
        slots.sort_unstable();
        if mamba && slots.windows(2).any(|w| w[0] == w[1]) {
            return bad("two runs share a state slot".to_owned());
        }
        snap_slots.sort_unstable();
        if snap_slots.windows(2).any(|w| w[0] == w[1]) {
            return bad("a snapshot slot is named twice".to_owned());
        }
        if let Some(slot) = snap_slots.iter().find(|s| slots.binary_search(s).is_ok()) {
            return bad(format!("snapshot slot {slot} is a run's live slot"));
        }
        writes.sort_unstable();
        if let Some(w) = writes.windows(2).find(|w| w[0] == w[1]) {
            return bad(format!("two rows write block {} offset {}", w[0].0, w[0].1));
        }
        if out.logit_rows.len() > rows {
            return bad(format!(
                "{} logit rows for {rows} rows",
                out.logit_rows.len()
            ));
        }
        if let Some(&r) = out.logit_rows.iter().find(|&&r| r as usize >= rows) {
            return bad(format!("logit row {r} of {rows} rows"));
        }
        let table_len = tables.len();
        let lens: Vec<usize> = runs.iter().map(|r| r.len).collect();
        let (tiles, singles) = if attention {
            kernels::attention_plan(
                &lens,
                kernels::attention_tile_rows(self.config.head_dim),
                self.mode == ForwardMode::Fast,
            )
        } else {
            (Vec::new(), Vec::new())
        };
        let mut words = row_pos;
        words.extend(row_run);
        words.extend(run_words);
        words.extend(tables);
        words.extend_from_slice(out.logit_rows);
        let (num_tiles, num_singles) = (tiles.len() / 2, singles.len());
        words.extend(tiles);
        words.extend(singles);
        words.extend(row_snap);
        Ok(Described {
            snapshots: any_snapshots,
            words,
            lens,
            rows,
            table_len,
            num_tiles,
            num_singles,
        })
    }

    /// `out [m, mat.rows] = x [m, mat.cols] · matᵀ`, then the bias and ReLU² when asked.
    #[allow(clippy::too_many_arguments)] // The runtime, the workspace, the operands and the epilogue.
    fn linear(
        &self,
        rt: &dyn Runtime,
        ws_buf: DeviceSlice,
        ws: &Workspace,
        x: DeviceSlice,
        m: usize,
        mat: &Mat,
        out: DeviceSlice,
        relu2: bool,
    ) -> Result<()> {
        let s = Stream::Compute;
        let a = match mat.dtype {
            DType::F32 => x,
            DType::Bf16 => {
                let half = ws.half.slice(ws_buf, m * mat.cols * 2)?;
                kernels::f32_to_bf16(rt, s, half, x, m * mat.cols)?;
                half
            }
        };
        rt.gemm(
            &Gemm {
                m,
                n: mat.rows,
                k: mat.cols,
                dtype: mat.dtype,
                a,
                b: self.mat(mat)?,
                c: out,
            },
            s,
        )?;
        let bias = self.bias(mat)?;
        if bias.is_some() || relu2 {
            kernels::bias_act(rt, s, out, bias, m, mat.rows, relu2)?;
        }
        Ok(())
    }

    /// Runs one step (see the module docs) on the compute stream: reads the rows' tokens from
    /// `step.tokens` (`rows` u32 on the device), reads and advances the KV pool and the state
    /// slots of `step.state`, and writes the logits of `step.out.logit_rows`. Everything is
    /// validated before the first launch: a refused step has touched nothing. It returns once the
    /// step is queued: its descriptor goes up through pinned, double-buffered staging on the copy
    /// stream (two halves alternating step by step, an event guarding each half's reuse), so the
    /// host can prepare the next step while this one runs (it waits only when two uploads ahead).
    pub fn forward(&self, rt: &dyn Runtime, step: &StepArgs<'_>) -> Result<()> {
        self.run(
            rt,
            step,
            Entry::Main {
                hidden_out: None,
                all_rows: false,
            },
        )
    }

    /// [`DeviceModel::forward`], also writing the final-normed hidden states of `rows` to
    /// `hidden_out`: the MTP head's input ([`DeviceModel::mtp`]).
    pub fn forward_hidden(
        &self,
        rt: &dyn Runtime,
        step: &StepArgs<'_>,
        rows: HiddenRows,
        hidden_out: DeviceSlice,
    ) -> Result<()> {
        self.run(
            rt,
            step,
            Entry::Main {
                hidden_out: Some(hidden_out),
                all_rows: matches!(rows, HiddenRows::All),
            },
        )
    }

    /// Whether the model carries an MTP head (its image was made from a model with one).
    pub fn has_mtp(&self) -> bool {
        self.layout.mtp.is_some()
    }

    /// The MTP head over one step's runs, as `model::Model::mtp` computes it: row `j` of a run at
    /// position `q` takes `step.tokens[j]`, the token *after* `q`, and row `j` of `hidden_in`
    /// (`rows * hidden_size` f32), the hidden state it follows (the main model's at `q` after its
    /// final norm, from [`DeviceModel::forward_hidden`], or, drafting, the head's own output at
    /// `q - 1`). Runs `eh_proj [enorm(E[token]), hnorm(hidden)]`, the MTP layers (their K/V at
    /// the rows' positions in the runs' blocks, their Mamba state in the runs' slots, after the
    /// main stack's), the final norm and the shared `lm_head`; writes the logits of
    /// `step.out.logit_rows` and those rows' normed outputs to `hidden_out` (`logit_rows.len() *
    /// hidden_size` f32: the next draft position's hidden input). Validated before the first
    /// launch like [`DeviceModel::forward`]; a model without a head is refused.
    pub fn mtp(
        &self,
        rt: &dyn Runtime,
        step: &StepArgs<'_>,
        hidden_in: DeviceSlice,
        hidden_out: DeviceSlice,
    ) -> Result<()> {
        self.run(
            rt,
            step,
            Entry::Mtp {
                hidden_in,
                hidden_out,
            },
        )
    }

    /// The entry points' common path: checks, the descriptor's upload, the step.
    fn run(&self, rt: &dyn Runtime, args: &StepArgs<'_>, entry: Entry) -> Result<()> {
        let StepArgs {
            workspace,
            workspace_layout: ws,
            state,
            runs,
            tokens,
            out,
        } = *args;
        let vocab = self.config.vocab_size;
        let d = self.config.hidden_size;
        if workspace.bytes() < ws.total {
            return Err(CudaError::BadRange(format!(
                "forward workspace of {} bytes, the layout needs {}",
                workspace.bytes(),
                ws.total
            )));
        }
        let described = self.describe(ws, state, runs, &out)?;
        let (words, m) = (&described.words, described.rows);
        let logit_count = out.logit_rows.len();
        if out.logits.bytes() != logit_count * vocab * 4 {
            return Err(CudaError::BadRange(format!(
                "forward step: logits of {} bytes for {logit_count} rows of {vocab}",
                out.logits.bytes()
            )));
        }
        if tokens.bytes() != m * 4 {
            return Err(CudaError::BadRange(format!(
                "forward step: {} bytes of tokens for {m} rows",
                tokens.bytes()
            )));
        }
        let hidden_bytes = |what: &str, slice: DeviceSlice, rows: usize| {
            if slice.bytes() == rows * d * 4 {
                Ok(())
            } else {
                Err(CudaError::BadRange(format!(
                    "forward step: {what} of {} bytes for {rows} rows of {d}",
                    slice.bytes()
                )))
            }
        };
        match entry {
            Entry::Main {
                hidden_out,
                all_rows,
            } => {
                if let Some(h) = hidden_out {
                    hidden_bytes("hidden outputs", h, if all_rows { m } else { logit_count })?;
                    if h.overlaps(&workspace) {
                        return Err(CudaError::BadRange(
                            "forward step: the hidden outputs overlap the workspace".to_owned(),
                        ));
                    }
                }
            }
            Entry::Mtp {
                hidden_in,
                hidden_out,
            } => {
                if self.layout.mtp.is_none() {
                    return Err(CudaError::BadRange(
                        "MTP step: the model has no MTP head (its checkpoint carries no mtp.* \
                         tensors)"
                            .to_owned(),
                    ));
                }
                hidden_bytes("MTP hidden inputs", hidden_in, m)?;
                hidden_bytes("MTP hidden outputs", hidden_out, logit_count)?;
                if hidden_in.overlaps(&workspace) || hidden_out.overlaps(&workspace) {
                    return Err(CudaError::BadRange(
                        "MTP step: a hidden stream overlaps the workspace".to_owned(),
                    ));
                }
            }
        }
        let mut staging = self
            .staging
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let (desc, half) = Staging::upload(&mut staging, rt, ws.desc_bytes, words)?;
        let result = self.step(rt, args, &described, desc, entry);
        // The step's reads of the descriptor end here, in compute-stream order; the upload two
        // steps on waits for this record before it overwrites the same half.
        if let Some(staging) = staging.as_ref() {
            rt.record(&staging.consumed[half], Stream::Compute)?;
        }
        result
    }

    /// [`DeviceModel::forward`] after its checks and the descriptor's upload to `desc`.
    fn step(
        &self,
        rt: &dyn Runtime,
        args: &StepArgs<'_>,
        described: &Described,
        desc: DeviceSlice,
        entry: Entry,
    ) -> Result<()> {
        let StepArgs {
            workspace,
            workspace_layout: ws,
            state,
            runs,
            tokens,
            out,
        } = *args;
        let c = &self.config;
        let (d, vocab) = (c.hidden_size, c.vocab_size);
        let (lens, m, table_len) = (&described.lens, described.rows, described.table_len);
        let logit_count = out.logit_rows.len();
        let s = Stream::Compute;
        let region = |r: &Region, bytes: usize| r.slice(workspace, bytes);
        let num_runs = runs.len();
        let step = StepRows {
            row_pos: desc.range(0, m * 4)?,
            row_run: desc.range(m * 4, m * 4)?,
            runs: desc.range(8 * m, num_runs * 24)?,
            tables: desc.range(8 * m + num_runs * 24, table_len * 4)?,
            rows: m,
            num_runs,
            snapshots: None,
        };
        let logit_at = 8 * m + num_runs * 24 + table_len * 4;
        let logit_idx = desc.range(logit_at, logit_count * 4)?;
        let tiles_at = logit_at + logit_count * 4;
        let (num_tiles, num_singles) = (described.num_tiles, described.num_singles);
        let step = StepRows {
            snapshots: if described.snapshots {
                Some(desc.range(tiles_at + num_tiles * 8 + num_singles * 4, m * 4)?)
            } else {
                None
            },
            ..step
        };
        let tile_rows = kernels::attention_tile_rows(c.head_dim);
        let attention_work = AttentionWork {
            tiles: desc.range(tiles_at, num_tiles * 8)?,
            num_tiles,
            tile_rows,
            singles: desc.range(tiles_at + num_tiles * 8, num_singles * 4)?,
            num_singles,
        };
        let eps = c.layer_norm_epsilon as f32;
        let hidden = region(&ws.hidden, m * d * 4)?;
        let normed = region(&ws.normed, m * d * 4)?;
        let block_out = region(&ws.out, m * d * 4)?;
        let layout = &self.layout;
        kernels::embedding_gather(
            rt,
            s,
            hidden,
            self.mat(&layout.embeddings)?,
            layout.embeddings.dtype,
            tokens,
            m,
            d,
            vocab,
        )?;
        let (layers, final_norm) = match (entry, &layout.mtp) {
            (Entry::Mtp { hidden_in, .. }, Some(mtp)) => {
                // hidden = eh_embed · enorm(E[token]) + eh_hidden · hnorm(hidden_in).
                kernels::residual_rmsnorm(
                    rt,
                    s,
                    hidden,
                    None,
                    normed,
                    self.floats(&mtp.enorm)?,
                    m,
                    d,
                    eps,
                )?;
                self.linear(
                    rt,
                    workspace,
                    ws,
                    normed,
                    m,
                    &mtp.eh_embed,
                    block_out,
                    false,
                )?;
                kernels::residual_rmsnorm(
                    rt,
                    s,
                    hidden_in,
                    None,
                    normed,
                    self.floats(&mtp.hnorm)?,
                    m,
                    d,
                    eps,
                )?;
                self.linear(rt, workspace, ws, normed, m, &mtp.eh_hidden, hidden, false)?;
                kernels::add_into(rt, s, hidden, block_out, m * d)?;
                (&mtp.layers, &mtp.final_norm)
            }
            (Entry::Mtp { .. }, None) => {
                return Err(CudaError::BadRange(
                    "MTP step: the model has no MTP head".to_owned(),
                ))
            }
            (Entry::Main { .. }, _) => (&layout.layers, &layout.norm_f),
        };
        if let Some(first) = layers.first() {
            kernels::residual_rmsnorm(
                rt,
                s,
                hidden,
                None,
                normed,
                self.floats(&first.norm)?,
                m,
                d,
                eps,
            )?;
        }
        let kv_layer = 2 * state.block_size * c.num_key_value_heads * c.head_dim;
        let mamba_shape = MambaShape {
            heads: c.mamba_num_heads,
            head_dim: c.mamba_head_dim,
            state: c.ssm_state_size,
            groups: c.n_groups,
            conv_kernel: c.conv_kernel,
        };
        let mamba_layer = mamba_shape.conv_floats() + mamba_shape.ssm_floats();
        let dt_min = match c.dt_clamp {
            DtClamp::TimeStepMin => c.time_step_min as f32,
            DtClamp::Off => 0.0,
        };
        let longest = runs.iter().map(|r| r.start_pos + r.len).max().unwrap_or(1);
        for (i, layer) in layers.iter().enumerate() {
            match &layer.mixer {
                Mixer::Mamba(w) => {
                    let (inner, conv_dim, proj_dim) = (
                        mamba_shape.inner(),
                        mamba_shape.conv_dim(),
                        mamba_shape.proj_dim(),
                    );
                    let proj = region(&ws.proj, m * proj_dim * 4)?;
                    self.linear(rt, workspace, ws, normed, m, &w.in_proj, proj, false)?;
                    let slots = StateSlots {
                        states: state.states,
                        num_slots: state.num_slots,
                        slot_floats: state.slot_floats,
                        layer_offset: w.index * mamba_layer,
                    };
                    let xbc = region(&ws.xbc, m * conv_dim * 4)?;
                    let conv_bias = w.conv_bias.as_ref().map(|b| self.floats(b)).transpose()?;
                    kernels::mamba_conv(
                        rt,
                        s,
                        &step,
                        &slots,
                        &mamba_shape,
                        xbc,
                        proj,
                        self.floats(&w.conv_weight)?,
                        conv_bias,
                    )?;
                    let y = region(&ws.y, m * inner * 4)?;
                    kernels::mamba_ssm(
                        rt,
                        s,
                        &step,
                        lens,
                        &slots,
                        &mamba_shape,
                        y,
                        xbc,
                        proj,
                        [
                            self.floats(&w.dt_bias)?,
                            self.floats(&w.a)?,
                            self.floats(&w.d)?,
                        ],
                        dt_min,
                        match self.mode {
                            ForwardMode::Exact => SsmScan::Sequential,
                            ForwardMode::Fast => SsmScan::Chunked,
                        },
                    )?;
                    kernels::mamba_gated_norm(
                        rt,
                        s,
                        &mamba_shape,
                        y,
                        proj,
                        self.floats(&w.norm)?,
                        m,
                        eps,
                    )?;
                    self.linear(rt, workspace, ws, y, m, &w.out_proj, block_out, false)?;
                }
                Mixer::Attention { qkv, o_proj, index } => {
                    let shape = AttentionShape {
                        heads: c.num_attention_heads,
                        kv_heads: c.num_key_value_heads,
                        head_dim: c.head_dim,
                    };
                    let pool = KvPool {
                        kv: state.kv,
                        num_blocks: state.num_blocks,
                        block_size: state.block_size,
                        block_floats: state.block_floats,
                        layer_offset: index * kv_layer,
                    };
                    let proj = region(&ws.proj, m * shape.qkv_dim() * 4)?;
                    self.linear(rt, workspace, ws, normed, m, qkv, proj, false)?;
                    kernels::kv_write(rt, s, &step, &pool, &shape, proj)?;
                    let fits = (ws.partial_entries / (m * shape.heads)).max(1);
                    let (splits, split_keys) = match self.mode {
                        ForwardMode::Exact => {
                            // One width for every step: the one for a sequence of a run's share
                            // of the tables (the router's longest context). Wider only for a
                            // longer sequence, which the router does not make.
                            let share = ws.limits.max_table / ws.limits.max_runs.max(1);
                            let most_keys = share.saturating_mul(state.block_size);
                            let mut width = exact_split_width(most_keys, self.split_keys);
                            while longest.div_ceil(width) > fits {
                                width = width.saturating_mul(2);
                            }
                            (longest.div_ceil(width).max(1), width)
                        }
                        ForwardMode::Fast => {
                            let splits = longest.div_ceil(self.split_keys).clamp(1, fits);
                            (splits, longest.div_ceil(splits))
                        }
                    };
                    let partial = region(
                        &ws.partial,
                        m * shape.heads * splits * (shape.head_dim + 2) * 4,
                    )?;
                    let y = region(&ws.y, m * shape.heads * shape.head_dim * 4)?;
                    let io = kernels::AttentionIo {
                        qkv: proj,
                        partial,
                        out: y,
                        splits,
                        split_keys,
                    };
                    kernels::attention_tiled(rt, s, &step, &attention_work, &pool, &shape, &io)?;
                    self.linear(rt, workspace, ws, y, m, o_proj, block_out, false)?;
                }
                Mixer::Mlp { up, down } => {
                    let proj = region(&ws.proj, m * up.rows * 4)?;
                    self.linear(rt, workspace, ws, normed, m, up, proj, true)?;
                    self.linear(rt, workspace, ws, proj, m, down, block_out, false)?;
                }
                Mixer::Moe(w) => self.moe(rt, workspace, ws, w, normed, block_out, m)?,
            }
            match layers.get(i + 1) {
                Some(next) => kernels::residual_rmsnorm(
                    rt,
                    s,
                    hidden,
                    Some(block_out),
                    normed,
                    self.floats(&next.norm)?,
                    m,
                    d,
                    eps,
                )?,
                None => kernels::add_into(rt, s, hidden, block_out, m * d)?,
            }
        }
        if let Entry::Main {
            hidden_out: Some(h),
            all_rows: true,
        } = entry
        {
            kernels::residual_rmsnorm(rt, s, hidden, None, h, self.floats(final_norm)?, m, d, eps)?;
        }
        if logit_count == 0 {
            return Ok(());
        }
        let last = region(&ws.normed, logit_count * d * 4)?;
        kernels::rmsnorm_select(
            rt,
            s,
            last,
            hidden,
            logit_idx,
            self.floats(final_norm)?,
            logit_count,
            m,
            d,
            eps,
        )?;
        self.linear(
            rt,
            workspace,
            ws,
            last,
            logit_count,
            &layout.lm_head,
            out.logits,
            false,
        )?;
        let hidden_out = match entry {
            Entry::Main { all_rows: true, .. } => None,
            Entry::Main { hidden_out, .. } => hidden_out,
            Entry::Mtp { hidden_out, .. } => Some(hidden_out),
        };
        match hidden_out {
            Some(h) => rt.copy(h, last, s),
            None => Ok(()),
        }
    }

    /// One MoE layer: gate, routing, dispatch, expert GEMMs, combine, shared expert.
    #[allow(clippy::too_many_arguments)] // The runtime, the workspace, the weights and the rows.
    fn moe(
        &self,
        rt: &dyn Runtime,
        workspace: DeviceSlice,
        ws: &Workspace,
        w: &MoeWeights,
        normed: DeviceSlice,
        block_out: DeviceSlice,
        m: usize,
    ) -> Result<()> {
        let c = &self.config;
        let s = Stream::Compute;
        let d = c.hidden_size;
        let (e, k) = (c.n_routed_experts, c.num_experts_per_tok);
        let (moe_i, ed) = (c.moe_intermediate_size, c.moe_expert_dim());
        let region = |r: &Region, bytes: usize| r.slice(workspace, bytes);
        let logits = region(&ws.router, m * e * 4)?;
        self.linear(rt, workspace, ws, normed, m, &w.gate, logits, false)?;
        let choice = region(&ws.choice, m * k * 4)?;
        let weight = region(&ws.weight, m * k * 4)?;
        let route = MoeRoute {
            experts: e,
            groups: c.n_group,
            topk_groups: c.topk_group,
            k,
            normalize: c.norm_topk_prob,
            scale: c.routed_scaling_factor as f32,
        };
        kernels::moe_route(
            rt,
            s,
            &route,
            choice,
            weight,
            logits,
            self.floats(&w.correction)?,
            m,
        )?;
        let pad_cap = MoeDispatch::pad_cap(m, k, e);
        if pad_cap > ws.pad_cap {
            return Err(CudaError::BadRange(format!(
                "forward workspace: {pad_cap} MoE positions wanted of {}",
                ws.pad_cap
            )));
        }
        let dispatch = MoeDispatch {
            counts: region(&ws.counts, e * 4)?,
            sorted: region(&ws.sorted, pad_cap * 4)?,
            tile_expert: region(&ws.tile_expert, pad_cap / kernels::MOE_TILE_ROWS * 4)?,
            assign_pos: region(&ws.assign_pos, m * k * 4)?,
            pad_cap,
        };
        kernels::moe_dispatch(rt, s, &dispatch, choice, m, k, e)?;
        let x = match &w.latent {
            Some((fc1, _)) => {
                let lat = region(&ws.latent_in, m * ed * 4)?;
                self.linear(rt, workspace, ws, normed, m, fc1, lat, false)?;
                lat
            }
            None => normed,
        };
        let act = region(&ws.expert_act, pad_cap * moe_i * 4)?;
        let up_bias = self.bias(&w.up)?;
        kernels::moe_gemm(
            rt,
            s,
            &dispatch,
            &MoeGemm {
                experts: e,
                k,
                x_rows: m,
                in_dim: ed,
                out_dim: moe_i,
                gather: true,
                relu2: true,
            },
            act,
            x,
            self.mat(&w.up)?,
            w.up.dtype,
            up_bias,
        )?;
        let expert_out = region(&ws.expert_out, pad_cap * ed * 4)?;
        kernels::moe_gemm(
            rt,
            s,
            &dispatch,
            &MoeGemm {
                experts: e,
                k,
                x_rows: pad_cap,
                in_dim: moe_i,
                out_dim: ed,
                gather: false,
                relu2: false,
            },
            expert_out,
            act,
            self.mat(&w.down)?,
            w.down.dtype,
            self.bias(&w.down)?,
        )?;
        match &w.latent {
            Some((_, fc2)) => {
                let routed = region(&ws.routed, m * ed * 4)?;
                kernels::moe_combine(
                    rt, s, &dispatch, routed, expert_out, choice, weight, m, k, ed,
                )?;
                self.linear(rt, workspace, ws, routed, m, fc2, block_out, false)?;
            }
            None => kernels::moe_combine(
                rt, s, &dispatch, block_out, expert_out, choice, weight, m, k, d,
            )?,
        }
        let shared_act = region(&ws.proj, m * w.shared_up.rows * 4)?;
        self.linear(rt, workspace, ws, normed, m, &w.shared_up, shared_act, true)?;
        let shared = region(&ws.y, m * d * 4)?;
        self.linear(
            rt,
            workspace,
            ws,
            shared_act,
            m,
            &w.shared_down,
            shared,
            false,
        )?;
        kernels::add_into(rt, s, block_out, shared, m * d)
    }
}
