//! The cost model: how many FLOPs a cached prefix saves and how many bytes its KV and its SSM
//! checkpoint take, from the layer counts and widths of a hybrid model.
//!
//! FLOPs for a prefix of `l` tokens computed from scratch (the work a hit of length `l` saves):
//!
//! ```text
//! flops(l) = A · (attention_linear · l + attention_quadratic · l²)
//!          + M · mamba_per_token · l
//!          + P · mlp_per_token · l
//! ```
//!
//! with `A`, `M`, `P` the attention, Mamba2 and MLP (or MoE, counted by its active experts) layer
//! counts. Bytes: `kv_bytes_per_token` over all attention layers, `checkpoint_bytes` for one SSM
//! checkpoint (SSM state + conv state of every Mamba2 layer).
//!
//! Invariant: every coefficient is finite and non-negative, `kv_bytes_per_token` and
//! `checkpoint_bytes` are positive (checked by [`CostModel::new`]).

use crate::error::SnapshotError;

/// The names [`CostModel::by_name`] knows (an unknown name's error lists them).
pub const BUILT_IN_MODELS: &[&str] = &["nvidia-hybrid-7b", "nemotron-h-8b", "nemotron-h-56b"];

/// Per-model costs. Fields are private so that every value went through [`CostModel::new`].
#[derive(Debug, Clone, PartialEq)]
pub struct CostModel {
    name: String,
    attention_layers: u32,
    mamba_layers: u32,
    mlp_layers: u32,
    attention_linear_flops_per_token: f64,
    attention_quadratic_flops: f64,
    mamba_flops_per_token: f64,
    mlp_flops_per_token: f64,
    kv_bytes_per_token: u64,
    checkpoint_bytes: u64,
}

/// The raw coefficients of a [`CostModel`], per layer (see the module docs for the formula).
#[derive(Debug, Clone, PartialEq)]
pub struct CostCoefficients {
    /// A short name for reports (`nvidia-hybrid-7b`).
    pub name: String,
    /// Attention layers.
    pub attention_layers: u32,
    /// Mamba2 layers.
    pub mamba_layers: u32,
    /// MLP (or MoE) layers.
    pub mlp_layers: u32,
    /// Per attention layer, FLOPs per token of the Q/K/V/O projections.
    pub attention_linear_flops_per_token: f64,
    /// Per attention layer, the coefficient `c` of `c · l²` (scores plus weighted sum).
    pub attention_quadratic_flops: f64,
    /// Per Mamba2 layer, FLOPs per token (projections, convolution, scan).
    pub mamba_flops_per_token: f64,
    /// Per MLP layer, FLOPs per token.
    pub mlp_flops_per_token: f64,
    /// KV bytes per token over all attention layers.
    pub kv_bytes_per_token: u64,
    /// Bytes of one SSM checkpoint over all Mamba2 layers.
    pub checkpoint_bytes: u64,
}

/// The widths of a NemotronH-style hybrid model, as its `config.json` gives them; the router
/// fills this from its model config and calls [`CostModel::from_dims`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HybridDims {
    /// A short name for reports.
    pub name: String,
    /// Hidden size `d`.
    pub hidden_size: u64,
    /// Attention (`*`) layers.
    pub attention_layers: u32,
    /// Query heads per attention layer.
    pub num_attention_heads: u64,
    /// KV heads per attention layer (grouped-query attention shares them).
    pub num_key_value_heads: u64,
    /// Width of one attention head.
    pub head_dim: u64,
    /// Mamba2 (`M`) layers.
    pub mamba_layers: u32,
    /// Mamba2 heads.
    pub mamba_num_heads: u64,
    /// Width of one Mamba2 head (`mamba_num_heads · mamba_head_dim` is the inner width).
    pub mamba_head_dim: u64,
    /// SSM state size `n`.
    pub ssm_state_size: u64,
    /// Groups sharing B and C.
    pub n_groups: u64,
    /// Causal convolution kernel width.
    pub conv_kernel: u64,
    /// MLP (`-`) layers plus MoE (`E`) layers.
    pub mlp_layers: u32,
    /// MLP intermediate width (for MoE: the summed width of the experts active per token).
    pub mlp_intermediate: u64,
    /// Weight matrices per MLP (2 for NemotronH's squared-ReLU MLP, 3 for a gated one).
    pub mlp_matrices: u64,
    /// Bytes per cached value (2 for bf16).
    pub elem_bytes: u64,
}

impl HybridDims {
    /// NVIDIA's Nemotron-H-8B as its published config gives it (`nvidia/Nemotron-H-8B-Base-8K`:
    /// hidden 4096; 4 attention layers of 32 query and 8 KV heads of 128; 24 Mamba2 layers of
    /// 128 heads of 64, state 128 in 8 groups, kernel 4; 24 squared-ReLU MLPs of 21,504), bf16.
    /// Priced by [`CostModel::from_dims`]: 16,384 KV bytes per token and 52,297,728 bytes per
    /// checkpoint, so one checkpoint weighs as much as 3,192 tokens of KV (the paper's 7B model,
    /// without grouped-query sharing: 409).
    pub fn nemotron_h_8b() -> Self {
        Self {
            name: "nemotron-h-8b".into(),
            hidden_size: 4096,
            attention_layers: 4,
            num_attention_heads: 32,
            num_key_value_heads: 8,
            head_dim: 128,
            mamba_layers: 24,
            mamba_num_heads: 128,
            mamba_head_dim: 64,
            ssm_state_size: 128,
            n_groups: 8,
            conv_kernel: 4,
            mlp_layers: 24,
            mlp_intermediate: 21504,
            mlp_matrices: 2,
            elem_bytes: 2,
        }
    }

    /// NVIDIA's Nemotron-H-56B as its published config gives it (`nvidia/Nemotron-H-56B-Base-8K`:
    /// hidden 8192; 10 attention layers of 64 query and 8 KV heads of 128; 54 Mamba2 layers of
    /// 256 heads of 64, state 256 in 8 groups, kernel 4; 54 squared-ReLU MLPs of 32,768), bf16.
    /// Priced by [`CostModel::from_dims`]: 40,960 KV bytes per token and 461,832,192 bytes per
    /// checkpoint, so one checkpoint weighs as much as 11,275 tokens of KV (28 times the paper's
    /// 7B model; a larger budget than the smaller models' holds only a few checkpoints).
    pub fn nemotron_h_56b() -> Self {
        Self {
            name: "nemotron-h-56b".into(),
            hidden_size: 8192,
            attention_layers: 10,
            num_attention_heads: 64,
            num_key_value_heads: 8,
            head_dim: 128,
            mamba_layers: 54,
            mamba_num_heads: 256,
            mamba_head_dim: 64,
            ssm_state_size: 256,
            n_groups: 8,
            conv_kernel: 4,
            mlp_layers: 54,
            mlp_intermediate: 32768,
            mlp_matrices: 2,
            elem_bytes: 2,
        }
    }
}

impl CostModel {
    /// Checks and wraps raw coefficients.
    pub fn new(c: CostCoefficients) -> Result<Self, SnapshotError> {
        let floats = [
            (
                "attention_linear_flops_per_token",
                c.attention_linear_flops_per_token,
            ),
            ("attention_quadratic_flops", c.attention_quadratic_flops),
            ("mamba_flops_per_token", c.mamba_flops_per_token),
            ("mlp_flops_per_token", c.mlp_flops_per_token),
        ];
        for (field, value) in floats {
            if !value.is_finite() || value < 0.0 {
                return Err(SnapshotError::BadCost {
                    field,
                    value: value.to_string(),
                });
            }
        }
        if c.kv_bytes_per_token == 0 {
            return Err(SnapshotError::BadCost {
                field: "kv_bytes_per_token",
                value: "0".into(),
            });
        }
        if c.checkpoint_bytes == 0 {
            return Err(SnapshotError::BadCost {
                field: "checkpoint_bytes",
                value: "0".into(),
            });
        }
        Ok(Self {
            name: c.name,
            attention_layers: c.attention_layers,
            mamba_layers: c.mamba_layers,
            mlp_layers: c.mlp_layers,
            attention_linear_flops_per_token: c.attention_linear_flops_per_token,
            attention_quadratic_flops: c.attention_quadratic_flops,
            mamba_flops_per_token: c.mamba_flops_per_token,
            mlp_flops_per_token: c.mlp_flops_per_token,
            kv_bytes_per_token: c.kv_bytes_per_token,
            checkpoint_bytes: c.checkpoint_bytes,
        })
    }

    /// The paper's 7B Attention-Mamba2 hybrid (Marconi §5): 24 Mamba2, 4 attention and 28 MLP
    /// layers, `d = 4096`, `n = 128`, 2-byte values, no grouped-query sharing. KV is
    /// `2·d·2` bytes per token per attention layer (65,536 bytes per token); a checkpoint is
    /// `2·d·n + 2·4·(2d + 2n)` bytes per Mamba2 layer (26,787,840 bytes in all); FLOPs per layer
    /// for `l` tokens: attention `8ld² + 4l²d`, MLP `16ld²`, Mamba2 `12ld² + 16ldn + 10ld`.
    pub fn nvidia_hybrid_7b() -> Self {
        let d = 4096.0_f64;
        let n = 128.0_f64;
        let (d_bytes, n_bytes) = (4096_u64, 128_u64);
        Self {
            name: "nvidia-hybrid-7b".into(),
            attention_layers: 4,
            mamba_layers: 24,
            mlp_layers: 28,
            attention_linear_flops_per_token: 8.0 * d * d,
            attention_quadratic_flops: 4.0 * d,
            mamba_flops_per_token: 12.0 * d * d + 16.0 * d * n + 10.0 * d,
            mlp_flops_per_token: 16.0 * d * d,
            kv_bytes_per_token: 4 * 2 * d_bytes * 2,
            checkpoint_bytes: 24 * (2 * d_bytes * n_bytes + 2 * 4 * (2 * d_bytes + 2 * n_bytes)),
        }
    }

    /// A built-in model by name (one of [`BUILT_IN_MODELS`]): `nvidia-hybrid-7b`
    /// ([`CostModel::nvidia_hybrid_7b`], the paper's), `nemotron-h-8b`
    /// ([`HybridDims::nemotron_h_8b`]) or `nemotron-h-56b` ([`HybridDims::nemotron_h_56b`]).
    pub fn by_name(name: &str) -> Result<Self, SnapshotError> {
        match name {
            "nvidia-hybrid-7b" => Ok(Self::nvidia_hybrid_7b()),
            "nemotron-h-8b" => Self::from_dims(&HybridDims::nemotron_h_8b()),
            "nemotron-h-56b" => Self::from_dims(&HybridDims::nemotron_h_56b()),
            other => Err(SnapshotError::UnknownModel(other.to_owned())),
        }
    }

    /// Costs from a NemotronH-style configuration. With `e` the inner Mamba2 width
    /// (`mamba_num_heads · mamba_head_dim`), `q = heads · head_dim`, `kv = kv_heads · head_dim`:
    /// attention `2d(2q + 2kv)` per token plus `4q · l²`; Mamba2 `2d(2e + 2gn + h) + 2ed`
    /// (projections) `+ 8en` (scan) `+ 5e` (convolution, gating) per token; MLP
    /// `2 · matrices · d · intermediate` per token. KV is `2 · kv · elem` bytes per token per
    /// attention layer; a checkpoint holds `e · n` SSM values and `kernel · (e + 2gn)` conv values
    /// per Mamba2 layer. Zero widths where a layer kind is present are rejected.
    pub fn from_dims(dims: &HybridDims) -> Result<Self, SnapshotError> {
        let nonzero = [
            ("hidden_size", dims.hidden_size),
            ("elem_bytes", dims.elem_bytes),
            ("num_attention_heads", dims.num_attention_heads),
            ("num_key_value_heads", dims.num_key_value_heads),
            ("head_dim", dims.head_dim),
            ("mamba_num_heads", dims.mamba_num_heads),
            ("mamba_head_dim", dims.mamba_head_dim),
            ("ssm_state_size", dims.ssm_state_size),
            ("n_groups", dims.n_groups),
            ("conv_kernel", dims.conv_kernel),
        ];
        for (field, value) in nonzero {
            let needed = match field {
                "num_attention_heads" | "num_key_value_heads" | "head_dim" => {
                    dims.attention_layers > 0
                }
                "mamba_num_heads" | "mamba_head_dim" | "ssm_state_size" | "n_groups"
                | "conv_kernel" => dims.mamba_layers > 0,
                _ => true,
            };
            if needed && value == 0 {
                return Err(SnapshotError::BadCost {
                    field,
                    value: "0".into(),
                });
            }
        }
        let d = dims.hidden_size as f64;
        let q = (dims.num_attention_heads * dims.head_dim) as f64;
        let kv = (dims.num_key_value_heads * dims.head_dim) as f64;
        let e = (dims.mamba_num_heads * dims.mamba_head_dim) as f64;
        let n = dims.ssm_state_size as f64;
        let g = dims.n_groups as f64;
        let h = dims.mamba_num_heads as f64;
        let kv_bytes_per_token = u64::from(dims.attention_layers)
            .saturating_mul(2 * dims.num_key_value_heads * dims.head_dim * dims.elem_bytes);
        let inner = dims.mamba_num_heads * dims.mamba_head_dim;
        let per_layer_state = inner * dims.ssm_state_size
            + dims.conv_kernel * (inner + 2 * dims.n_groups * dims.ssm_state_size);
        let checkpoint_bytes = u64::from(dims.mamba_layers)
            .saturating_mul(per_layer_state.saturating_mul(dims.elem_bytes));
        Self::new(CostCoefficients {
            name: dims.name.clone(),
            attention_layers: dims.attention_layers,
            mamba_layers: dims.mamba_layers,
            mlp_layers: dims.mlp_layers,
            attention_linear_flops_per_token: 2.0 * d * (2.0 * q + 2.0 * kv),
            attention_quadratic_flops: 4.0 * q,
            mamba_flops_per_token: 2.0 * d * (2.0 * e + 2.0 * g * n + h)
                + 2.0 * e * d
                + 8.0 * e * n
                + 5.0 * e,
            mlp_flops_per_token: 2.0 * dims.mlp_matrices as f64 * d * dims.mlp_intermediate as f64,
            kv_bytes_per_token,
            checkpoint_bytes,
        })
    }

    /// The model's name for reports.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// KV bytes per token over all attention layers.
    pub fn kv_bytes_per_token(&self) -> u64 {
        self.kv_bytes_per_token
    }

    /// Bytes of one SSM checkpoint over all Mamba2 layers.
    pub fn checkpoint_bytes(&self) -> u64 {
        self.checkpoint_bytes
    }

    /// FLOPs to compute a prefix of `tokens` tokens from scratch: what a hit of that length saves.
    pub fn prefix_flops(&self, tokens: u64) -> f64 {
        let l = tokens as f64;
        f64::from(self.attention_layers)
            * (self.attention_linear_flops_per_token * l + self.attention_quadratic_flops * l * l)
            + f64::from(self.mamba_layers) * self.mamba_flops_per_token * l
            + f64::from(self.mlp_layers) * self.mlp_flops_per_token * l
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builtin_7b_matches_the_issue_numbers() {
        let m = CostModel::nvidia_hybrid_7b();
        assert_eq!(m.kv_bytes_per_token(), 65_536);
        assert_eq!(m.checkpoint_bytes(), 26_787_840);
        let d = 4096.0_f64;
        let n = 128.0_f64;
        let l = 1000.0_f64;
        let expected = 4.0 * (8.0 * l * d * d + 4.0 * l * l * d)
            + 28.0 * 16.0 * l * d * d
            + 24.0 * (12.0 * l * d * d + 16.0 * l * d * n + 10.0 * l * d);
        assert_eq!(m.prefix_flops(1000), expected);
        assert_eq!(m.prefix_flops(0), 0.0);
        assert_eq!(CostModel::by_name("nvidia-hybrid-7b").unwrap(), m);
    }

    #[test]
    fn unknown_model_is_named() {
        let err = CostModel::by_name("gpt-9").unwrap_err();
        assert_eq!(
            err.to_string(),
            "unknown cost model `gpt-9` (built in: nvidia-hybrid-7b, nemotron-h-8b, nemotron-h-56b)"
        );
        for name in BUILT_IN_MODELS {
            assert_eq!(CostModel::by_name(name).unwrap().name(), *name);
        }
    }

    #[test]
    fn nemotron_h_8b_is_priced_from_its_published_widths() {
        let m = CostModel::by_name("nemotron-h-8b").unwrap();
        assert_eq!(m.name(), "nemotron-h-8b");
        // 4 layers · K and V · 8 heads · 128 · 2 bytes.
        assert_eq!(m.kv_bytes_per_token(), 4 * 2 * 8 * 128 * 2);
        // 24 layers · (8192 · 128 SSM + 4 · (8192 + 2 · 8 · 128) conv values) · 2 bytes.
        assert_eq!(
            m.checkpoint_bytes(),
            24 * (8192 * 128 + 4 * (8192 + 2048)) * 2
        );
        assert_eq!(m.checkpoint_bytes(), 52_297_728);
        assert_eq!(
            m,
            CostModel::from_dims(&HybridDims::nemotron_h_8b()).unwrap()
        );
    }

    #[test]
    fn nemotron_h_56b_is_priced_from_its_published_widths() {
        let m = CostModel::by_name("nemotron-h-56b").unwrap();
        // 10 layers · K and V · 8 heads · 128 · 2 bytes.
        assert_eq!(m.kv_bytes_per_token(), 10 * 2 * 8 * 128 * 2);
        assert_eq!(m.kv_bytes_per_token(), 40_960);
        // 54 layers · (16384 · 256 SSM + 4 · (16384 + 2 · 8 · 256) conv values) · 2 bytes.
        assert_eq!(
            m.checkpoint_bytes(),
            54 * (16384 * 256 + 4 * (16384 + 4096)) * 2
        );
        assert_eq!(m.checkpoint_bytes(), 461_832_192);
        assert_eq!(m.checkpoint_bytes() / m.kv_bytes_per_token(), 11_275);
    }

    fn tiny_dims() -> HybridDims {
        HybridDims {
            name: "tiny".into(),
            hidden_size: 64,
            attention_layers: 1,
            num_attention_heads: 4,
            num_key_value_heads: 2,
            head_dim: 16,
            mamba_layers: 2,
            mamba_num_heads: 8,
            mamba_head_dim: 16,
            ssm_state_size: 32,
            n_groups: 1,
            conv_kernel: 4,
            mlp_layers: 3,
            mlp_intermediate: 256,
            mlp_matrices: 2,
            elem_bytes: 2,
        }
    }

    #[test]
    fn from_dims_computes_bytes_and_flops() {
        let m = CostModel::from_dims(&tiny_dims()).unwrap();
        // KV: 1 layer · 2 (K and V) · 2 heads · 16 · 2 bytes.
        assert_eq!(m.kv_bytes_per_token(), 128);
        // Per layer: 128·32 SSM + 4·(128 + 64) conv values, 2 bytes, 2 layers.
        assert_eq!(m.checkpoint_bytes(), 2 * 2 * (128 * 32 + 4 * 192));
        let attention = 2.0 * 64.0 * (2.0 * 64.0 + 2.0 * 32.0) * 10.0 + 4.0 * 64.0 * 100.0;
        let mamba = (2.0 * 64.0 * (256.0 + 64.0 + 8.0)
            + 2.0 * 128.0 * 64.0
            + 8.0 * 128.0 * 32.0
            + 5.0 * 128.0)
            * 10.0;
        let mlp = 2.0 * 2.0 * 64.0 * 256.0 * 10.0;
        assert_eq!(m.prefix_flops(10), attention + 2.0 * mamba + 3.0 * mlp);
    }

    #[test]
    fn from_dims_rejects_zero_widths() {
        let mut dims = tiny_dims();
        dims.ssm_state_size = 0;
        let err = CostModel::from_dims(&dims).unwrap_err();
        assert_eq!(err.to_string(), "bad cost model: `ssm_state_size` is 0 (FLOPs must be finite and non-negative, byte sizes positive)");
        // Without Mamba2 layers there is no checkpoint, which a checkpoint store cannot price.
        let mut dims = tiny_dims();
        dims.mamba_layers = 0;
        dims.ssm_state_size = 0;
        let err = CostModel::from_dims(&dims).unwrap_err();
        assert_eq!(err.to_string(), "bad cost model: `checkpoint_bytes` is 0 (FLOPs must be finite and non-negative, byte sizes positive)");
    }

    #[test]
    fn new_rejects_negative_and_nan() {
        let mut c = CostCoefficients {
            name: "x".into(),
            attention_layers: 1,
            mamba_layers: 1,
            mlp_layers: 1,
            attention_linear_flops_per_token: 1.0,
            attention_quadratic_flops: 1.0,
            mamba_flops_per_token: 1.0,
            mlp_flops_per_token: -1.0,
            kv_bytes_per_token: 1,
            checkpoint_bytes: 1,
        };
        let err = CostModel::new(c.clone()).unwrap_err();
        assert_eq!(err.to_string(), "bad cost model: `mlp_flops_per_token` is -1 (FLOPs must be finite and non-negative, byte sizes positive)");
        c.mlp_flops_per_token = f64::NAN;
        assert!(matches!(
            CostModel::new(c),
            Err(SnapshotError::BadCost {
                field: "mlp_flops_per_token",
                ..
            })
        ));
    }
}
