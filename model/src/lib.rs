//! The NemotronH model family on the host: `config.json` and safetensors loading, seeded random
//! weights, and the reference forward math (prefill chunk, batched decode, batched runs of several
//! sequences for speculative verification, the MTP head) over paged KV and per-sequence Mamba2
//! state that the caller owns; LoRA adapters in PEFT's format ([`LoraAdapter`]), applied per row
//! (`y = x·Wᵀ + scale·((x·Aᵀ)·Bᵀ)`, batched per adapter, never merged into the weights) by
//! [`Model::prefill_with_adapter`] and [`Model::decode_with_adapters`].
//!
//! # MTP
//! A checkpoint with `mtp.*` tensors carries NemotronH's multi-token-prediction head (vLLM's
//! `NemotronHMultiTokenPredictor`): position `q` of the head takes the embedding of the token after
//! `q` and the hidden state it follows (the main model's at `q` after `norm_f`, or the head's own
//! output when drafting further), normalises them separately (`enorm`, `hnorm`), projects their
//! concatenation (`eh_proj`), runs the blocks of the MTP pattern with their own K/V and state, a
//! final norm, and the shared `lm_head`. [`Model::forward_runs`] gives the main model's hidden
//! states (and the per-token Mamba snapshots a verification rewinds to); [`Model::mtp`] runs the
//! head. `tests/fixtures/mtp_reference.py` is its float64 NumPy reference.
//!
//! # Contract
//! - [`Model`] is immutable after construction; [`Model::prefill`] and [`Model::decode`] take the
//!   mutable state ([`Scratch`], [`KvPool`], [`MambaStates`]) from the caller (a router).
//! - Every id, token and position is validated **before** any state is touched: a call that returns
//!   an error has modified no KV block and no Mamba slot (it may have cleared `logits`).
//! - A Mamba state slot must be zeroed ([`MambaStates::zero_slot`]) by the caller before a
//!   sequence's first token. The model never zeroes state itself.
//! - Positions index the sequence's block table: position `p` lives in `blocks[p / block_size]` at
//!   offset `p % block_size`. Writing position `p` overwrites that K/V entry, so forked sequences
//!   need copy-on-write ([`KvPool::copy_block`]) before diverging inside a shared block.
//! - The one exception: with expert-parallel workers ([`ExpertPool`]), a worker lost mid-step
//!   fails the call after some layers ran ([`ModelError::ExpertWorkerLost`]); the state of the
//!   call's sequences is then unspecified (a router treats this as a lost device).
//! - **Invariance:** a row's logits are the same bits whatever other rows share its decode batch,
//!   however its prompt was cut into prefill chunks, and whether a token was prefilled or decoded:
//!   both entry points run the same per-token recurrence and the same fixed-order reductions, and
//!   the dt clamp follows one convention for every token ([`DtClamp`]).
//! - Numbers: weights and activations are f32 in memory whatever the checkpoint dtype.
//!
//! # Example
//! ```
//! use model::{Config, DecodeRow, KvPool, MambaStates, Model, PrefillRow, Scratch};
//!
//! let model = Model::random(Config::tiny_demo(), 0)?;
//! let config = model.config();
//! let mut kv = KvPool::new(config, 4, 16)?; // 4 blocks of 16 tokens
//! let mut states = MambaStates::new(config, 2)?; // 2 sequences
//! let mut scratch = Scratch::new(config);
//! let mut logits = Vec::new();
//!
//! // Sequence in slot 0 with blocks [0, 1]: prefill 5 tokens, last position's logits only.
//! states.zero_slot(0)?;
//! let row = PrefillRow { tokens: &[1, 7, 42, 9, 3], start_pos: 0, blocks: &[0, 1], slot: 0 };
//! model.prefill(&mut scratch, &mut kv, &mut states, row, false, &mut logits)?;
//! let next = model::parity::argmax(&logits);
//!
//! // One decode step for it, batched with a fresh sequence in slot 1 (blocks [2]).
//! states.zero_slot(1)?;
//! let rows = [
//!     DecodeRow { token: next, pos: 5, blocks: &[0, 1], slot: 0 },
//!     DecodeRow { token: 1, pos: 0, blocks: &[2], slot: 1 },
//! ];
//! model.decode(&mut scratch, &mut kv, &mut states, &rows, &mut logits)?;
//! assert_eq!(logits.len(), 2 * config.vocab_size);
//! # Ok::<(), model::ModelError>(())
//! ```
#![forbid(unsafe_code)]

mod config;
mod error;
mod experts;
mod forward;
mod gemm;
mod lora;
mod math;
pub mod parity;
#[cfg(feature = "region-timing")]
pub mod regions;
mod state;
mod weights;

use std::path::Path;

pub use config::{Config, DtClamp, LayerKind};
pub use error::ModelError;
pub use experts::ExpertPool;
pub use forward::Scratch;
pub use lora::{AdapterProblem, LoraAdapter, LoraSpec, ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE};
pub use state::{KvPool, MambaLayout, MambaStates};

use forward::{LoraRows, Rows, MAX_ROWS};
pub use weights::TensorVisitor;
use weights::{save_safetensors, write_error, MapSource, RandomSource, SafetensorsSource, Weights};

/// A chunk of one sequence's prompt: `tokens` at positions `start_pos..start_pos + tokens.len()`.
#[derive(Debug, Clone, Copy)]
pub struct PrefillRow<'a> {
    /// Token ids, at least one.
    pub tokens: &'a [u32],
    /// Position of `tokens[0]`.
    pub start_pos: usize,
    /// The sequence's block table; must cover `start_pos + tokens.len()` positions when the model
    /// has attention layers.
    pub blocks: &'a [u32],
    /// The sequence's Mamba state slot.
    pub slot: usize,
}

/// One decode token of one sequence.
#[derive(Debug, Clone, Copy)]
pub struct DecodeRow<'a> {
    /// The token fed at `pos`.
    pub token: u32,
    /// Its position.
    pub pos: usize,
    /// The sequence's block table; must cover `pos + 1` positions when the model has attention.
    pub blocks: &'a [u32],
    /// The sequence's Mamba state slot (distinct across the rows of one call).
    pub slot: usize,
}

/// A run of consecutive positions of one sequence, in a call that batches several sequences'
/// runs ([`Model::forward_runs`], [`Model::mtp`]).
#[derive(Debug, Clone, Copy)]
pub struct RunRow<'a> {
    /// Token ids, at least one: the tokens fed at `start_pos..` (for [`Model::mtp`], each
    /// position's *next* token).
    pub tokens: &'a [u32],
    /// Position of `tokens[0]`.
    pub start_pos: usize,
    /// The sequence's block table; must cover `start_pos + tokens.len()` positions when the
    /// layers run have attention.
    pub blocks: &'a [u32],
    /// The sequence's state slot (distinct across the runs of one call).
    pub slot: usize,
    /// Empty, or one state slot per token: slot `snapshots[j]` receives the Mamba state of the
    /// layers run (all of them) as it is after `tokens[j]`, the rewind points of a speculative
    /// verification. Distinct from each other and from every run's `slot`.
    pub snapshots: &'a [usize],
}

/// Which positions of each run get logits (and, for [`Model::mtp`], hidden outputs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RunOutputs {
    /// Every position, run after run.
    All,
    /// Each run's last position, one row per run.
    Last,
}

/// Changes (checkpoint name, shape, values) in place for [`Model::map_tensors`].
pub type TensorMap<'f> = dyn FnMut(&str, &[usize], &mut [f32]) + 'f;

/// A NemotronH model: validated config plus f32 weights.
#[derive(Debug, Clone)]
pub struct Model {
    config: Config,
    weights: Weights,
    fingerprint: u64,
}

impl Model {
    fn from_weights(config: Config, weights: Weights) -> Self {
        let mut model = Self {
            config,
            weights,
            fingerprint: 0,
        };
        model.fingerprint = model.compute_fingerprint();
        model
    }

    /// Loads `dir/config.json` and `dir/model.safetensors` (or the shards named by
    /// `dir/model.safetensors.index.json`). Every tensor's shape is checked against the config;
    /// a missing, misshapen or unexplained tensor is an error naming it.
    ///
    /// A checkpoint with `mtp.*` tensors whose config declares one MTP predictor group
    /// (`num_nextn_predict_layers: 1`) loads its MTP head ([`Config::mtp`] is then set, and every
    /// tensor of the head must be there); otherwise `mtp.*` tensors are ignored, as transformers
    /// does, and the model loads as if they were absent.
    pub fn load(dir: &Path) -> Result<Model, ModelError> {
        let mut config = Config::from_file(&dir.join("config.json"))?;
        let files = weights::read_checkpoint_files(dir)?;
        let mut source = SafetensorsSource::new(&files)?;
        if source.has_prefix("mtp.") {
            if config.num_nextn_predict_layers == 1 {
                config.mtp = true;
                config.validate()?;
            } else {
                tracing::warn!(
                    declared = config.num_nextn_predict_layers,
                    "the checkpoint has mtp.* tensors but the config does not declare one MTP \
                     predictor group; they are ignored"
                );
            }
        }
        let weights = Weights::build(&config, &mut source)?;
        source.check_all_used(config.mtp)?;
        tracing::debug!(dir = %dir.display(), pattern = %config.pattern(), "loaded model");
        Ok(Self::from_weights(config, weights))
    }

    /// Seeded random weights for any valid config (same seed, same weights, same fingerprint). With
    /// [`Config::mtp`] set the MTP head is drawn after the main stack, so the main stack's weights
    /// are the same as without it.
    pub fn random(config: Config, seed: u64) -> Result<Model, ModelError> {
        config.validate()?;
        let weights = Weights::build(&config, &mut RandomSource::new(seed))?;
        Ok(Self::from_weights(config, weights))
    }

    /// Writes `dir/config.json` and `dir/model.safetensors` (f32, checkpoint names), so that
    /// [`Model::load`] gives back the same model.
    pub fn save(&self, dir: &Path) -> Result<(), ModelError> {
        std::fs::create_dir_all(dir).map_err(|e| write_error(dir, e))?;
        let config_path = dir.join("config.json");
        std::fs::write(&config_path, self.config.to_hf_json())
            .map_err(|e| write_error(&config_path, e))?;
        save_safetensors(dir, "model.safetensors", |visit| {
            self.weights.visit_tensors(&self.config, visit)
        })
    }

    /// The same model (same config) with every weight tensor passed through `map`, which gets its
    /// checkpoint name and shape and changes its values in place: e.g. the host reference of a
    /// device that stores some matrices at a lower precision is this model with them rounded.
    pub fn map_tensors(&self, map: &mut TensorMap<'_>) -> Result<Model, ModelError> {
        let mut tensors = std::collections::HashMap::new();
        self.visit_tensors(&mut |name, shape, data| {
            let mut values = data.to_vec();
            map(name, shape, &mut values);
            tensors.insert(name.to_string(), values);
        });
        let weights = Weights::build(&self.config, &mut MapSource(tensors))?;
        Ok(Self::from_weights(self.config.clone(), weights))
    }

    /// The same model with another dt clamp convention ([`DtClamp`]); the fingerprint changes
    /// with it, since logits may.
    pub fn with_dt_clamp(mut self, dt_clamp: DtClamp) -> Model {
        self.config.dt_clamp = dt_clamp;
        self.fingerprint = self.compute_fingerprint();
        self
    }

    /// The validated config.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// xxh3 of the config (as JSON) and every weight (checkpoint order, names, shapes, f32 bits):
    /// equal fingerprints mean interchangeable models, e.g. for spill images.
    pub fn fingerprint(&self) -> u64 {
        self.fingerprint
    }

    /// Calls `f` with every weight tensor in checkpoint order: its checkpoint name, shape and f32
    /// values (what a device router uploads, and what [`Model::save`] writes).
    pub fn visit_tensors(&self, f: &mut TensorVisitor<'_>) {
        self.weights.visit_tensors(&self.config, f);
    }

    fn compute_fingerprint(&self) -> u64 {
        let mut hasher = xxhash_rust::xxh3::Xxh3::new();
        hasher.update(&serde_json::to_vec(&self.config).unwrap_or_default());
        self.weights
            .visit_tensors(&self.config, &mut |name, shape, data| {
                hasher.update(name.as_bytes());
                for &dim in shape {
                    hasher.update(&(dim as u64).to_le_bytes());
                }
                hasher.update(bytemuck::cast_slice::<f32, u8>(data));
            });
        hasher.digest()
    }

    fn check_token(&self, token: u32, index: usize) -> Result<(), ModelError> {
        if (token as usize) < self.config.vocab_size {
            Ok(())
        } else {
            Err(ModelError::TokenOutOfRange {
                token,
                index,
                vocab_size: self.config.vocab_size,
            })
        }
    }

    /// Checks that `blocks` covers positions `0..end` with valid block ids.
    fn check_blocks(&self, kv: &KvPool, blocks: &[u32], end: usize) -> Result<(), ModelError> {
        if !self.config.has(LayerKind::Attention) {
            return Ok(());
        }
        let block_size = kv.block_size();
        let needed = end.div_ceil(block_size);
        if needed > blocks.len() {
            return Err(ModelError::PositionBeyondBlocks {
                position: blocks.len() * block_size,
                blocks: blocks.len(),
                block_size,
                capacity: blocks.len() * block_size,
            });
        }
        for &block in &blocks[..needed] {
            if block as usize >= kv.num_blocks() {
                return Err(ModelError::BadBlock {
                    block,
                    num_blocks: kv.num_blocks(),
                });
            }
        }
        Ok(())
    }

    fn check_slot(states: &MambaStates, slot: usize) -> Result<(), ModelError> {
        if slot < states.num_slots() {
            Ok(())
        } else {
            Err(ModelError::BadSlot {
                slot,
                num_slots: states.num_slots(),
            })
        }
    }

    /// Checks that `adapter` was loaded for this model.
    fn check_adapter(&self, adapter: &LoraAdapter) -> Result<(), ModelError> {
        if adapter.base_fingerprint() == self.fingerprint {
            Ok(())
        } else {
            Err(ModelError::AdapterMismatch {
                adapter: adapter.path().map_or_else(
                    || "<random adapter>".to_string(),
                    |p| p.display().to_string(),
                ),
                adapter_base: adapter.base_fingerprint(),
                model: self.fingerprint,
            })
        }
    }

    /// Checks a call's per-row (or per-run) adapters: none, or one for each of its `rows`, each
    /// loaded for this model.
    fn check_adapters(
        &self,
        adapters: &[Option<&LoraAdapter>],
        rows: usize,
    ) -> Result<(), ModelError> {
        if !adapters.is_empty() && adapters.len() != rows {
            return Err(ModelError::AdapterRows {
                adapters: adapters.len(),
                rows,
            });
        }
        for adapter in adapters.iter().flatten() {
            self.check_adapter(adapter)?;
        }
        Ok(())
    }

    /// Prefills `row.tokens` of one sequence at positions `row.start_pos..`, reading and writing
    /// its K/V through `row.blocks` and its Mamba state in `row.slot`. `logits` is cleared and
    /// receives every position's logits (`n * vocab`) when `all_logits`, else the last
    /// position's (`vocab`).
    pub fn prefill(
        &self,
        scratch: &mut Scratch,
        kv: &mut KvPool,
        states: &mut MambaStates,
        row: PrefillRow<'_>,
        all_logits: bool,
        logits: &mut Vec<f32>,
    ) -> Result<(), ModelError> {
        self.prefill_with_adapter(scratch, kv, states, row, None, all_logits, logits)
    }

    /// [`Model::prefill`] with LoRA adapter `adapter` (loaded for this model) applied to every
    /// token of the chunk: each adapted layer computes `y = x·Wᵀ + scale·((x·Aᵀ)·Bᵀ)`.
    #[allow(clippy::too_many_arguments)] // The caller-owned state of `prefill`, plus the adapter.
    pub fn prefill_with_adapter(
        &self,
        scratch: &mut Scratch,
        kv: &mut KvPool,
        states: &mut MambaStates,
        row: PrefillRow<'_>,
        adapter: Option<&LoraAdapter>,
        all_logits: bool,
        logits: &mut Vec<f32>,
    ) -> Result<(), ModelError> {
        logits.clear();
        if let Some(adapter) = adapter {
            self.check_adapter(adapter)?;
        }
        if row.tokens.is_empty() {
            return Err(ModelError::EmptyInput("prefill with no tokens"));
        }
        for (index, &token) in row.tokens.iter().enumerate() {
            self.check_token(token, index)?;
        }
        kv.check_layout(&self.config)?;
        states.check_layout(&self.config)?;
        Self::check_slot(states, row.slot)?;
        let end = row
            .start_pos
            .checked_add(row.tokens.len())
            .ok_or(ModelError::SizeOverflow("prefill end position"))?;
        self.check_blocks(kv, row.blocks, end)?;

        let vocab = self.config.vocab_size;
        let n = row.tokens.len();
        logits.resize(if all_logits { n * vocab } else { vocab }, 0.0);
        let mut first = 0;
        while first < n {
            let len = (n - first).min(MAX_ROWS);
            let rows = Rows::Prefill {
                row: &row,
                first,
                len,
            };
            let wanted = if all_logits {
                forward::LogitRows::All(&mut logits[first * vocab..(first + len) * vocab])
            } else if first + len == n {
                forward::LogitRows::One(len - 1, &mut logits[..])
            } else {
                // Earlier sub-chunks only advance the state; their logits are not wanted.
                forward::LogitRows::Skip
            };
            let lora = match adapter {
                Some(adapter) => LoraRows::All(adapter),
                None => LoraRows::None,
            };
            forward::forward(
                &self.config,
                &self.weights,
                scratch,
                kv,
                states,
                &rows,
                lora,
                wanted,
                None,
            )?;
            first += len;
        }
        Ok(())
    }

    /// Decodes one token for each row. `logits` is cleared and receives `rows.len() * vocab`
    /// floats, row-major. Rows must use distinct Mamba slots and distinct K/V write positions.
    pub fn decode(
        &self,
        scratch: &mut Scratch,
        kv: &mut KvPool,
        states: &mut MambaStates,
        rows: &[DecodeRow<'_>],
        logits: &mut Vec<f32>,
    ) -> Result<(), ModelError> {
        self.decode_with_adapters(scratch, kv, states, rows, &[], logits)
    }

    /// [`Model::decode`] where row `i` runs with LoRA adapter `adapters[i]` (`None`: the base
    /// model). `adapters` is empty (no adapters) or one entry per row. Rows of one adapter are
    /// batched together per adapted layer; a row's logits are the same bits whatever adapters
    /// the other rows of the batch have.
    pub fn decode_with_adapters(
        &self,
        scratch: &mut Scratch,
        kv: &mut KvPool,
        states: &mut MambaStates,
        rows: &[DecodeRow<'_>],
        adapters: &[Option<&LoraAdapter>],
        logits: &mut Vec<f32>,
    ) -> Result<(), ModelError> {
        logits.clear();
        if rows.is_empty() {
            return Err(ModelError::EmptyInput("decode with no rows"));
        }
        self.check_adapters(adapters, rows.len())?;
        kv.check_layout(&self.config)?;
        states.check_layout(&self.config)?;
        for (index, row) in rows.iter().enumerate() {
            self.check_token(row.token, index)?;
            Self::check_slot(states, row.slot)?;
            let end = row
                .pos
                .checked_add(1)
                .ok_or(ModelError::SizeOverflow("decode position"))?;
            self.check_blocks(kv, row.blocks, end)?;
        }
        let pairs = &mut scratch.pairs;
        pairs.clear();
        pairs.extend(rows.iter().enumerate().map(|(i, r)| (r.slot, i)));
        check_distinct_slots(pairs, states)?;
        if self.config.has(LayerKind::Attention) {
            let block_size = kv.block_size();
            pairs.clear();
            pairs.extend(
                rows.iter()
                    .enumerate()
                    .map(|(i, r)| (kv_position(r.blocks, r.pos, block_size), i)),
            );
            check_distinct_kv_writes(pairs, block_size)?;
        }

        let vocab = self.config.vocab_size;
        logits.resize(rows.len() * vocab, 0.0);
        for (chunk_index, chunk) in rows.chunks(MAX_ROWS).enumerate() {
            let start = chunk_index * MAX_ROWS * vocab;
            let out = &mut logits[start..start + chunk.len() * vocab];
            let lora = if adapters.iter().any(Option::is_some) {
                let first = chunk_index * MAX_ROWS;
                LoraRows::PerRow(&adapters[first..first + chunk.len()])
            } else {
                LoraRows::None
            };
            forward::forward(
                &self.config,
                &self.weights,
                scratch,
                kv,
                states,
                &Rows::Decode(chunk),
                lora,
                forward::LogitRows::All(out),
                None,
            )?;
        }
        Ok(())
    }
}

/// Refuses a state slot that two rows (or runs) of one call name: they would step one
/// recurrence in batch order. `pairs` holds (slot, row) for each slot a row names; sorted here.
/// A model without Mamba state (no floats per slot) has nothing to collide.
fn check_distinct_slots(
    pairs: &mut [(usize, usize)],
    states: &MambaStates,
) -> Result<(), ModelError> {
    match first_repeat(pairs) {
        Some((slot, first, second)) if states.floats_per_slot() > 0 => {
            Err(ModelError::DuplicateSlot {
                slot,
                first,
                second,
            })
        }
        _ => Ok(()),
    }
}

/// Refuses a K/V position that two rows (or runs) of one call would write: `pairs` holds
/// ([`kv_position`], row) for each position a row writes; sorted here.
fn check_distinct_kv_writes(
    pairs: &mut [(usize, usize)],
    block_size: usize,
) -> Result<(), ModelError> {
    match first_repeat(pairs) {
        Some((position, first, second)) => Err(ModelError::DuplicateKvWrite {
            block: (position / block_size) as u32,
            offset: position % block_size,
            first,
            second,
        }),
        None => Ok(()),
    }
}

/// Where position `pos` of a sequence with block table `blocks` lives in the K/V pool, counted
/// in positions from the pool's start: its block times `block_size`, plus its offset.
fn kv_position(blocks: &[u32], pos: usize, block_size: usize) -> usize {
    blocks[pos / block_size] as usize * block_size + pos % block_size
}

/// Sorts `pairs` (key, row) and answers the smallest key held twice, with its first two rows.
fn first_repeat(pairs: &mut [(usize, usize)]) -> Option<(usize, usize, usize)> {
    pairs.sort_unstable();
    pairs
        .windows(2)
        .find(|w| w[0].0 == w[1].0)
        .map(|w| (w[0].0, w[0].1, w[1].1))
}

impl Model {
    /// Whether the model carries an MTP head ([`Config::mtp`]).
    pub fn has_mtp(&self) -> bool {
        self.weights.mtp.is_some()
    }

    /// Checks the runs of one call: ids, positions, slots (distinct), snapshot slots (distinct,
    /// not a run's slot), distinct K/V write positions; and the hidden inputs' length.
    fn check_runs(
        &self,
        scratch: &mut Scratch,
        kv: &KvPool,
        states: &MambaStates,
        runs: &[RunRow<'_>],
        attention: bool,
    ) -> Result<usize, ModelError> {
        if runs.is_empty() {
            return Err(ModelError::EmptyInput("a call with no runs"));
        }
        kv.check_layout(&self.config)?;
        states.check_layout(&self.config)?;
        let mut total = 0usize;
        for (index, run) in runs.iter().enumerate() {
            if run.tokens.is_empty() {
                return Err(ModelError::EmptyInput("a run with no tokens"));
            }
            for (j, &token) in run.tokens.iter().enumerate() {
                self.check_token(token, total + j)?;
            }
            Self::check_slot(states, run.slot)?;
            if !run.snapshots.is_empty() && run.snapshots.len() != run.tokens.len() {
                return Err(ModelError::SnapshotCount {
                    run: index,
                    expected: run.tokens.len(),
                    actual: run.snapshots.len(),
                });
            }
            for &snapshot in run.snapshots {
                Self::check_slot(states, snapshot)?;
            }
            let end = run
                .start_pos
                .checked_add(run.tokens.len())
                .ok_or(ModelError::SizeOverflow("run end position"))?;
            if attention {
                self.check_blocks(kv, run.blocks, end)?;
            }
            total += run.tokens.len();
        }
        // Live slots and snapshot slots: no state slot is named twice.
        let pairs = &mut scratch.pairs;
        pairs.clear();
        for (i, run) in runs.iter().enumerate() {
            pairs.push((run.slot, i));
            pairs.extend(run.snapshots.iter().map(|&s| (s, i)));
        }
        check_distinct_slots(pairs, states)?;
        if attention {
            let block_size = kv.block_size();
            pairs.clear();
            for (i, run) in runs.iter().enumerate() {
                let positions = run.start_pos..run.start_pos + run.tokens.len();
                pairs.extend(positions.map(|pos| (kv_position(run.blocks, pos, block_size), i)));
            }
            check_distinct_kv_writes(pairs, block_size)?;
        }
        Ok(total)
    }

    /// Runs several sequences' runs of consecutive tokens through the main stack in one batch
    /// (speculative verification feeds a sequence's last token and its drafts as one run).
    /// `logits` is cleared and receives the logits `outputs` names, row-major; `hidden`, when
    /// given, is cleared and receives every position's hidden state after the final norm
    /// (`hidden_size` floats per position, run after run), the MTP head's input.
    ///
    /// A run's positions see each other exactly as a prefill chunk's do, so every position's
    /// logits are the same bits a decode step of that token would give.
    #[allow(clippy::too_many_arguments)] // the outputs are separate buffers the caller reuses
    pub fn forward_runs(
        &self,
        scratch: &mut Scratch,
        kv: &mut KvPool,
        states: &mut MambaStates,
        runs: &[RunRow<'_>],
        outputs: RunOutputs,
        logits: &mut Vec<f32>,
        hidden: Option<&mut Vec<f32>>,
    ) -> Result<(), ModelError> {
        self.forward_runs_with_adapters(scratch, kv, states, runs, &[], outputs, logits, hidden)
    }

    /// [`Model::forward_runs`] where every position of run `i` runs with LoRA adapter
    /// `adapters[i]` (`None`: the base model). `adapters` is empty (no adapters) or one entry per
    /// run. A position's logits are the same bits a decode step of that token with that adapter
    /// would give ([`Model::decode_with_adapters`]). The MTP head ([`Model::mtp`]) is never
    /// adapted: its drafts are proposals the adapted main stack verifies.
    #[allow(clippy::too_many_arguments)] // the outputs are separate buffers the caller reuses
    pub fn forward_runs_with_adapters(
        &self,
        scratch: &mut Scratch,
        kv: &mut KvPool,
        states: &mut MambaStates,
        runs: &[RunRow<'_>],
        adapters: &[Option<&LoraAdapter>],
        outputs: RunOutputs,
        logits: &mut Vec<f32>,
        hidden: Option<&mut Vec<f32>>,
    ) -> Result<(), ModelError> {
        logits.clear();
        self.check_adapters(adapters, runs.len())?;
        let attention = self.config.has(LayerKind::Attention);
        let total = self.check_runs(scratch, kv, states, runs, attention)?;
        let adapted = adapters.iter().any(Option::is_some);
        let mut row_adapters: Vec<Option<&LoraAdapter>> = Vec::new();
        self.each_batch(
            runs,
            total,
            outputs,
            logits,
            hidden,
            |first_run, batch, table, wanted, hidden_out| {
                let lora = if adapted {
                    row_adapters.clear();
                    row_adapters.extend(table.iter().map(|&(run, _)| adapters[first_run + run]));
                    LoraRows::PerRow(&row_adapters)
                } else {
                    LoraRows::None
                };
                forward::forward(
                    &self.config,
                    &self.weights,
                    scratch,
                    kv,
                    states,
                    &Rows::Runs { runs: batch, table },
                    lora,
                    wanted,
                    hidden_out,
                )
            },
        )
    }

    /// Runs the MTP head over several sequences' runs in one batch. Position `q` of a run takes
    /// `tokens[j]`, the sequence's token *after* `q` (`q = start_pos + j`), and `hidden[j]`, the
    /// hidden state it follows: the main model's at `q` after its final norm (as
    /// [`Model::forward_runs`] gives it), or, drafting, the MTP head's own output at `q - 1`.
    /// `hidden_in` holds one row per position, run after run. `logits` is cleared and receives
    /// the logits `outputs` names; `hidden_out` the MTP head's normed outputs of the same rows.
    ///
    /// The MTP layers' K/V live at the run's positions in the sequence's blocks and their Mamba
    /// state in its slot, after the main model's (see [`KvPool`], [`MambaStates`]); snapshots
    /// receive the MTP layers' state. Errors with [`ModelError::NoMtpHead`] on a model without one.
    #[allow(clippy::too_many_arguments)] // the outputs are separate buffers the caller reuses
    pub fn mtp(
        &self,
        scratch: &mut Scratch,
        kv: &mut KvPool,
        states: &mut MambaStates,
        runs: &[RunRow<'_>],
        hidden_in: &[f32],
        outputs: RunOutputs,
        logits: &mut Vec<f32>,
        hidden_out: &mut Vec<f32>,
    ) -> Result<(), ModelError> {
        logits.clear();
        hidden_out.clear();
        let Some(mtp) = &self.weights.mtp else {
            return Err(ModelError::NoMtpHead);
        };
        let attention = self.config.uses(LayerKind::Attention);
        let total = self.check_runs(scratch, kv, states, runs, attention)?;
        let d = self.config.hidden_size;
        if hidden_in.len() != total * d {
            return Err(ModelError::LengthMismatch {
                what: "MTP hidden inputs",
                expected: total * d,
                actual: hidden_in.len(),
            });
        }
        let mut first_row = 0;
        self.each_batch(
            runs,
            total,
            outputs,
            logits,
            Some(hidden_out),
            |_, batch, table, wanted, out| {
                let m = table.len();
                forward::forward_mtp(
                    &self.config,
                    &self.weights,
                    mtp,
                    scratch,
                    kv,
                    states,
                    &Rows::Runs { runs: batch, table },
                    &hidden_in[first_row * d..(first_row + m) * d],
                    wanted,
                    out,
                )?;
                first_row += m;
                Ok(())
            },
        )
    }

    /// Cuts `runs` into forward batches of at most `MAX_ROWS` positions (a run may be split;
    /// that changes no bits) and calls `step` with each batch's runs, its row table, the logit
    /// rows it writes and, when `hidden` is given, where its rows' hidden states go. Sizes
    /// `logits` and `hidden` first. Stops at the first batch that fails (a lost expert worker).
    fn each_batch<'r, 'a>(
        &self,
        runs: &'r [RunRow<'a>],
        total: usize,
        outputs: RunOutputs,
        logits: &mut Vec<f32>,
        hidden: Option<&mut Vec<f32>>,
        mut step: impl FnMut(
            usize,
            &'r [RunRow<'a>],
            &[(usize, usize)],
            forward::LogitRows<'_>,
            Option<&mut [f32]>,
        ) -> Result<(), ModelError>,
    ) -> Result<(), ModelError> {
        let vocab = self.config.vocab_size;
        let d = self.config.hidden_size;
        let (logit_count, hidden_count) = match outputs {
            RunOutputs::All => (total, total),
            RunOutputs::Last => (runs.len(), runs.len()),
        };
        logits.resize(logit_count * vocab, 0.0);
        let mut hidden = hidden;
        if let Some(h) = hidden.as_deref_mut() {
            h.clear();
            h.resize(hidden_count * d, 0.0);
        }
        // Split points: (run, offset) of each batch's first row.
        let mut table: Vec<(usize, usize)> = Vec::with_capacity(MAX_ROWS.min(total));
        let mut batch_hidden = Vec::new();
        let mut ends: Vec<usize> = Vec::new();
        let mut run = 0;
        let mut offset = 0;
        let mut out_row = 0; // next logit/hidden output row
        while run < runs.len() {
            table.clear();
            let first_run = run;
            while table.len() < MAX_ROWS && run < runs.len() {
                table.push((run - first_run, offset));
                offset += 1;
                if offset == runs[run].tokens.len() {
                    run += 1;
                    offset = 0;
                }
            }
            let last_run = if offset == 0 { run } else { run + 1 };
            let batch = &runs[first_run..last_run];
            let m = table.len();
            match outputs {
                RunOutputs::All => {
                    let wanted = forward::LogitRows::All(
                        &mut logits[out_row * vocab..(out_row + m) * vocab],
                    );
                    let out = hidden
                        .as_deref_mut()
                        .map(|h| &mut h[out_row * d..(out_row + m) * d]);
                    step(first_run, batch, &table, wanted, out)?;
                    out_row += m;
                }
                RunOutputs::Last => {
                    // Rows of this batch that end their run.
                    ends.clear();
                    ends.extend((0..m).filter(|&i| {
                        let (r, o) = table[i];
                        o + 1 == batch[r].tokens.len()
                    }));
                    let n = ends.len();
                    let wanted = if n == 0 {
                        forward::LogitRows::Skip
                    } else {
                        forward::LogitRows::Select(
                            &ends,
                            &mut logits[out_row * vocab..(out_row + n) * vocab],
                        )
                    };
                    match hidden.as_deref_mut() {
                        Some(h) => {
                            batch_hidden.clear();
                            batch_hidden.resize(m * d, 0.0);
                            step(
                                first_run,
                                batch,
                                &table,
                                wanted,
                                Some(&mut batch_hidden[..]),
                            )?;
                            for (k, &i) in ends.iter().enumerate() {
                                h[(out_row + k) * d..(out_row + k + 1) * d]
                                    .copy_from_slice(&batch_hidden[i * d..(i + 1) * d]);
                            }
                        }
                        None => step(first_run, batch, &table, wanted, None)?,
                    }
                    out_row += n;
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Public handles can move to and be shared with router worker threads.
    #[test]
    fn handles_are_send_and_sync() {
        fn check<T: Send + Sync>() {}
        check::<Model>();
        check::<Config>();
        check::<KvPool>();
        check::<MambaStates>();
        check::<Scratch>();
        check::<ModelError>();
    }

    fn last_logits(model: &Model, tokens: &[u32]) -> Vec<f32> {
        let config = model.config();
        let mut kv = KvPool::new(config, 2, 16).unwrap();
        let mut states = MambaStates::new(config, 1).unwrap();
        let mut logits = Vec::new();
        let row = PrefillRow {
            tokens,
            start_pos: 0,
            blocks: &[0, 1],
            slot: 0,
        };
        model
            .prefill(
                &mut Scratch::default(),
                &mut kv,
                &mut states,
                row,
                false,
                &mut logits,
            )
            .unwrap();
        logits
    }

    /// The dt clamp is applied exactly when the convention asks for it and dt is below the floor.
    #[test]
    fn dt_clamp_convention_is_wired() {
        let tokens = [3, 1, 4, 1, 5, 9, 2, 6];
        let model = Model::random(Config::tiny_demo(), 5).unwrap();
        // Random weights keep softplus(dt) >= 0.01: the clamp is inactive, conventions agree.
        let off = model.clone().with_dt_clamp(DtClamp::Off);
        assert_ne!(off.fingerprint(), model.fingerprint());
        assert_eq!(last_logits(&model, &tokens), last_logits(&off, &tokens));
        // dt_bias = -9 makes softplus(dt) ~ 1e-4 < time_step_min = 1e-3: now they differ.
        let mut low = model.clone();
        for layer in &mut low.weights.layers {
            if let weights::Mixer::Mamba(w) = &mut layer.mixer {
                w.dt_bias.fill(-9.0);
            }
        }
        let low_off = low.clone().with_dt_clamp(DtClamp::Off);
        assert_ne!(last_logits(&low, &tokens), last_logits(&low_off, &tokens));
    }
}
