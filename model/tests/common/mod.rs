//! What the model's integration tests share: where the fixtures live, the tiny fixture
//! checkpoint, and logits as bits for exact comparisons.

// Each test binary includes this module and uses a part of it.
#![allow(dead_code)]

use std::path::PathBuf;

use model::Model;

/// The fixtures folder, `tests/fixtures`.
pub fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

/// The tiny fixture's checkpoint folder (`config.json`, `model.safetensors`).
pub fn tiny_dir() -> PathBuf {
    fixtures().join("nemotron-h-tiny/model")
}

/// The tiny fixture's model.
///
/// # Panics
/// When the checkpoint does not load (a test helper: the fixture is checked in).
pub fn tiny() -> Model {
    Model::load(&tiny_dir()).unwrap()
}

/// The bits of `values`, for exact comparisons.
pub fn bits(values: &[f32]) -> Vec<u32> {
    values.iter().map(|v| v.to_bits()).collect()
}
