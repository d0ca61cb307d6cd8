//! The NemotronH model family on the host: `config.json` and safetensors loading, seeded random
//! weights, and the reference forward math (prefill chunk, batched decode) over paged KV and
//! per-sequence Mamba2 state that the caller owns.
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
mod forward;
mod math;
pub mod parity;
mod state;
mod weights;

use std::path::Path;

pub use config::{Config, DtClamp, LayerKind};
pub use error::ModelError;
pub use forward::Scratch;
pub use state::{KvPool, MambaLayout, MambaStates};

use forward::{Rows, MAX_ROWS};
use weights::{RandomSource, SafetensorsSource, Weights};

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
    /// a missing, misshapen or unexplained tensor is an error naming it (`mtp.*` tensors are
    /// ignored, as transformers does).
    pub fn load(dir: &Path) -> Result<Model, ModelError> {
        let config = Config::from_file(&dir.join("config.json"))?;
        let files = weights::read_checkpoint_files(dir)?;
        let mut source = SafetensorsSource::new(&files)?;
        let weights = Weights::build(&config, &mut source)?;
        source.check_all_used()?;
        tracing::debug!(dir = %dir.display(), pattern = %config.pattern(), "loaded model");
        Ok(Self::from_weights(config, weights))
    }

    /// Seeded random weights for any valid config (same seed, same weights, same fingerprint).
    pub fn random(config: Config, seed: u64) -> Result<Model, ModelError> {
        config.validate()?;
        let weights = Weights::build(&config, &mut RandomSource::new(seed))?;
        Ok(Self::from_weights(config, weights))
    }

    /// Writes `dir/config.json` and `dir/model.safetensors` (f32, checkpoint names), so that
    /// [`Model::load`] gives back the same model.
    pub fn save(&self, dir: &Path) -> Result<(), ModelError> {
        let write_err = |path: &Path, reason: String| ModelError::Write {
            path: path.to_owned(),
            reason,
        };
        std::fs::create_dir_all(dir).map_err(|e| write_err(dir, e.to_string()))?;
        let config_path = dir.join("config.json");
        std::fs::write(&config_path, self.config.to_hf_json())
            .map_err(|e| write_err(&config_path, e.to_string()))?;
        let mut bytes: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
        self.weights
            .visit_tensors(&self.config, &mut |name, shape, data| {
                bytes.push((
                    name.to_string(),
                    shape.to_vec(),
                    bytemuck::cast_slice::<f32, u8>(data).to_vec(),
                ));
            });
        let views = bytes
            .iter()
            .map(|(name, shape, data)| {
                safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape.clone(), data)
                    .map(|view| (name.clone(), view))
            })
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| write_err(dir, e.to_string()))?;
        let path = dir.join("model.safetensors");
        let file =
            safetensors::serialize(views, None).map_err(|e| write_err(dir, e.to_string()))?;
        std::fs::write(&path, file).map_err(|e| write_err(&path, e.to_string()))
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
        logits.clear();
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
            forward::forward(
                &self.config,
                &self.weights,
                scratch,
                kv,
                states,
                &rows,
                wanted,
            );
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
        logits.clear();
        if rows.is_empty() {
            return Err(ModelError::EmptyInput("decode with no rows"));
        }
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
        // Distinct slots: two rows stepping one recurrence would depend on their batch order.
        let pairs = &mut scratch.pairs;
        pairs.clear();
        pairs.extend(rows.iter().enumerate().map(|(i, r)| (r.slot, i)));
        pairs.sort_unstable();
        for w in pairs.windows(2) {
            if w[0].0 == w[1].0 && states.floats_per_slot() > 0 {
                return Err(ModelError::DuplicateSlot {
                    slot: w[0].0,
                    first: w[0].1,
                    second: w[1].1,
                });
            }
        }
        if self.config.has(LayerKind::Attention) {
            let block_size = kv.block_size();
            pairs.clear();
            pairs.extend(rows.iter().enumerate().map(|(i, r)| {
                let target =
                    r.blocks[r.pos / block_size] as usize * block_size + r.pos % block_size;
                (target, i)
            }));
            pairs.sort_unstable();
            for w in pairs.windows(2) {
                if w[0].0 == w[1].0 {
                    return Err(ModelError::DuplicateKvWrite {
                        block: (w[0].0 / block_size) as u32,
                        offset: w[0].0 % block_size,
                        first: w[0].1,
                        second: w[1].1,
                    });
                }
            }
        }

        let vocab = self.config.vocab_size;
        logits.resize(rows.len() * vocab, 0.0);
        for (chunk_index, chunk) in rows.chunks(MAX_ROWS).enumerate() {
            let start = chunk_index * MAX_ROWS * vocab;
            let out = &mut logits[start..start + chunk.len() * vocab];
            forward::forward(
                &self.config,
                &self.weights,
                scratch,
                kv,
                states,
                &Rows::Decode(chunk),
                forward::LogitRows::All(out),
            );
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
