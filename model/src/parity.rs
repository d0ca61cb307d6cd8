//! Checks a model against a reference fixture folder laid out like `nemotron-h-tiny`
//! (`PATH/model/`, `PATH/expected.safetensors`, `PATH/cases.json`): every prompt position's logits
//! from one prefill, then teacher-forced decode steps fed the reference greedy ids.
//!
//! Used by the fixture test and by `cargo run --release -p model --example forward_parity -- PATH`.

use std::path::{Path, PathBuf};

use safetensors::SafeTensors;

use crate::{DecodeRow, KvPool, MambaStates, Model, ModelError, PrefillRow, Scratch};

/// What agreement the fixture's README calls comfortable for an f32 implementation.
pub const DEFAULT_TOLERANCE: f32 = 1e-4;

/// Outcome of one case.
#[derive(Debug, Clone, PartialEq)]
pub struct CaseReport {
    /// The case index in `cases.json`.
    pub index: usize,
    /// Prompt tokens.
    pub prompt_len: usize,
    /// Decode steps checked.
    pub decode_steps: usize,
    /// Largest |ours - reference| over all prompt positions.
    pub max_prompt_diff: f32,
    /// Largest |ours - reference| over all decode steps.
    pub max_decode_diff: f32,
    /// Reference greedy ids followed by `next_id_after_last_step`.
    pub expected_greedy: Vec<u32>,
    /// Our argmax after the prompt and after each decode step.
    pub actual_greedy: Vec<u32>,
}

impl CaseReport {
    /// Within `tolerance` everywhere and the same greedy ids.
    pub fn passed(&self, tolerance: f32) -> bool {
        self.max_prompt_diff <= tolerance
            && self.max_decode_diff <= tolerance
            && self.expected_greedy == self.actual_greedy
    }
}

/// Outcome of a whole fixture.
#[derive(Debug, Clone, PartialEq)]
pub struct ParityReport {
    /// One entry per case, in file order.
    pub cases: Vec<CaseReport>,
}

impl ParityReport {
    /// Every case passed.
    pub fn passed(&self, tolerance: f32) -> bool {
        !self.cases.is_empty() && self.cases.iter().all(|c| c.passed(tolerance))
    }

    /// The largest difference over all cases.
    pub fn max_diff(&self) -> f32 {
        self.cases
            .iter()
            .map(|c| c.max_prompt_diff.max(c.max_decode_diff))
            .fold(0.0, f32::max)
    }
}

fn fixture_err(path: &Path, reason: impl Into<String>) -> ModelError {
    ModelError::Fixture {
        path: path.to_owned(),
        reason: reason.into(),
    }
}

/// Index of the largest logit (lowest index on ties).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in logits.iter().enumerate() {
        if v > logits[best] {
            best = i;
        }
    }
    best as u32
}

fn ids(value: &serde_json::Value, key: &str, path: &Path) -> Result<Vec<u32>, ModelError> {
    value[key]
        .as_array()
        .ok_or_else(|| fixture_err(path, format!("`{key}` is not a list")))?
        .iter()
        .map(|v| {
            v.as_u64()
                .and_then(|x| u32::try_from(x).ok())
                .ok_or_else(|| fixture_err(path, format!("`{key}` holds a non-id {v}")))
        })
        .collect()
}

/// Reads `[rows, vocab]` f32 logits called `name`.
fn expected_logits(
    tensors: &SafeTensors<'_>,
    name: &str,
    vocab: usize,
    path: &Path,
) -> Result<(usize, Vec<f32>), ModelError> {
    let view = tensors
        .tensor(name)
        .map_err(|e| fixture_err(path, format!("tensor `{name}`: {e}")))?;
    if view.dtype() != safetensors::Dtype::F32
        || view.shape().len() != 2
        || view.shape()[1] != vocab
    {
        return Err(fixture_err(
            path,
            format!(
                "tensor `{name}` is {:?} {:?}, expected F32 [rows, {vocab}]",
                view.dtype(),
                view.shape()
            ),
        ));
    }
    let values = view
        .data()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    Ok((view.shape()[0], values))
}

/// The largest `|a[i] - b[i]|`: infinite where a difference is NaN or the lengths differ, so that
/// no tolerance passes a NaN or a missing value.
pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    if a.len() != b.len() {
        return f32::INFINITY;
    }
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(
            0.0,
            |m, d| if d.is_nan() { f32::INFINITY } else { m.max(d) },
        )
}

/// The prompt of every case of `dir/cases.json` (`prompt_ids`), in file order.
pub fn prompts(dir: &Path) -> Result<Vec<Vec<u32>>, ModelError> {
    let (cases_path, root) = read_cases(dir)?;
    cases(&root, &cases_path)?
        .iter()
        .map(|case| ids(case, "prompt_ids", &cases_path))
        .collect()
}

/// One case of an MTP fixture's `cases.json` (`nemotron-h-tiny/mtp`, `nemotron-h-alt/mtp`): the
/// reference's greedy ids after the prompt and its draft ids after the prompt (`draft0`) and
/// after the first decoded tokens (`draft1`).
#[derive(Debug, Clone, PartialEq)]
pub struct MtpCase {
    /// The case index in `cases.json`.
    pub index: usize,
    /// `prompt_ids`.
    pub prompt: Vec<u32>,
    /// `greedy_ids`.
    pub greedy: Vec<u32>,
    /// `draft0_ids`.
    pub draft0: Vec<u32>,
    /// `draft1_ids`.
    pub draft1: Vec<u32>,
}

/// Every case of the MTP fixture folder `dir`'s `cases.json`, in file order.
pub fn mtp_cases(dir: &Path) -> Result<Vec<MtpCase>, ModelError> {
    let (cases_path, root) = read_cases(dir)?;
    cases(&root, &cases_path)?
        .iter()
        .map(|case| {
            let index = case["index"]
                .as_u64()
                .and_then(|i| usize::try_from(i).ok())
                .ok_or_else(|| fixture_err(&cases_path, "a case's `index` is not a count"))?;
            Ok(MtpCase {
                index,
                prompt: ids(case, "prompt_ids", &cases_path)?,
                greedy: ids(case, "greedy_ids", &cases_path)?,
                draft0: ids(case, "draft0_ids", &cases_path)?,
                draft1: ids(case, "draft1_ids", &cases_path)?,
            })
        })
        .collect()
}

/// `dir/cases.json`'s path and its parsed contents.
fn read_cases(dir: &Path) -> Result<(PathBuf, serde_json::Value), ModelError> {
    let cases_path = dir.join("cases.json");
    let text = std::fs::read_to_string(&cases_path).map_err(|source| ModelError::Io {
        path: cases_path.clone(),
        source,
    })?;
    let root = serde_json::from_str(&text).map_err(|e| fixture_err(&cases_path, e.to_string()))?;
    Ok((cases_path, root))
}

/// The list of cases of a parsed `cases.json` read from `path`.
fn cases<'a>(
    root: &'a serde_json::Value,
    path: &Path,
) -> Result<&'a [serde_json::Value], ModelError> {
    root["cases"]
        .as_array()
        .map(Vec::as_slice)
        .ok_or_else(|| fixture_err(path, "`cases` is not a list"))
}

/// Loads `dir/model` and checks every case of `dir/cases.json` against `dir/expected.safetensors`.
pub fn check_fixture(dir: &Path) -> Result<ParityReport, ModelError> {
    let model = Model::load(&dir.join("model"))?;
    check_model(&model, dir)
}

/// Checks `model` against the cases of the fixture folder `dir`.
pub fn check_model(model: &Model, dir: &Path) -> Result<ParityReport, ModelError> {
    let (cases_path, root) = read_cases(dir)?;
    let expected_path = dir.join("expected.safetensors");
    let bytes = std::fs::read(&expected_path).map_err(|source| ModelError::Io {
        path: expected_path.clone(),
        source,
    })?;
    let tensors = SafeTensors::deserialize(&bytes).map_err(|e| ModelError::Safetensors {
        path: expected_path.clone(),
        reason: crate::weights::diagnose_safetensors(&bytes, &e),
    })?;
    let cases = cases(&root, &cases_path)?;

    let config = model.config();
    let vocab = config.vocab_size;
    let block_size = 16;
    let mut scratch = Scratch::new(config);
    let mut states = MambaStates::new(config, 1)?;
    let mut logits = Vec::new();
    let mut reports = Vec::with_capacity(cases.len());
    for (position, case) in cases.iter().enumerate() {
        let index = case["index"].as_u64().map_or(position, |i| i as usize);
        let prompt = ids(case, "prompt_ids", &cases_path)?;
        let greedy = ids(case, "greedy_ids", &cases_path)?;
        let mut expected_greedy = greedy.clone();
        if let Some(next) = case["next_id_after_last_step"].as_u64() {
            expected_greedy.push(next as u32);
        }
        let (prompt_rows, prompt_logits) = expected_logits(
            &tensors,
            &format!("case{index}.prompt_logits"),
            vocab,
            &expected_path,
        )?;
        let (decode_rows, decode_logits) = expected_logits(
            &tensors,
            &format!("case{index}.decode_logits"),
            vocab,
            &expected_path,
        )?;
        if prompt_rows != prompt.len() || decode_rows != greedy.len() {
            return Err(fixture_err(
                &expected_path,
                format!(
                    "case {index}: {prompt_rows} prompt rows for {} prompt ids, {decode_rows} decode rows for {} greedy ids",
                    prompt.len(),
                    greedy.len()
                ),
            ));
        }
        let total = prompt.len() + greedy.len();
        let num_blocks = total.div_ceil(block_size);
        let mut kv = KvPool::new(config, num_blocks, block_size)?;
        let table: Vec<u32> = (0..num_blocks as u32).collect();
        states.zero_slot(0)?;
        model.prefill(
            &mut scratch,
            &mut kv,
            &mut states,
            PrefillRow {
                tokens: &prompt,
                start_pos: 0,
                blocks: &table,
                slot: 0,
            },
            true,
            &mut logits,
        )?;
        let max_prompt_diff = max_abs_diff(&logits, &prompt_logits);
        let mut actual_greedy = vec![argmax(&logits[(prompt.len() - 1) * vocab..])];
        let mut max_decode_diff = 0.0f32;
        for (step, &token) in greedy.iter().enumerate() {
            let row = DecodeRow {
                token,
                pos: prompt.len() + step,
                blocks: &table,
                slot: 0,
            };
            model.decode(&mut scratch, &mut kv, &mut states, &[row], &mut logits)?;
            let reference = &decode_logits[step * vocab..(step + 1) * vocab];
            max_decode_diff = max_decode_diff.max(max_abs_diff(&logits, reference));
            actual_greedy.push(argmax(&logits));
        }
        actual_greedy.truncate(expected_greedy.len());
        reports.push(CaseReport {
            index,
            prompt_len: prompt.len(),
            decode_steps: greedy.len(),
            max_prompt_diff,
            max_decode_diff,
            expected_greedy,
            actual_greedy,
        });
    }
    Ok(ParityReport { cases: reports })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn max_abs_diff_is_the_largest_difference_and_infinite_for_nan_or_a_missing_value() {
        assert_eq!(max_abs_diff(&[1.0, -2.0, 3.0], &[1.5, -2.0, 0.75]), 2.25);
        assert_eq!(max_abs_diff(&[], &[]), 0.0);
        assert_eq!(max_abs_diff(&[1.0, f32::NAN], &[1.0, 0.0]), f32::INFINITY);
        assert_eq!(max_abs_diff(&[1.0, 2.0], &[1.0]), f32::INFINITY);
    }

    #[test]
    fn argmax_takes_the_lowest_index_of_the_largest_logit() {
        assert_eq!(argmax(&[0.5, 2.0, -1.0, 2.0]), 1);
        assert_eq!(argmax(&[-3.0]), 0);
    }
}
