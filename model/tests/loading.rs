//! Bad checkpoints at load time: non-finite weights are refused naming the tensor and the file,
//! and every way a safetensors file can be truncated or corrupt gives an error that names the
//! file and, where one is at fault, the tensor.

mod common;

use std::path::{Path, PathBuf};

use common::tiny_dir;
use model::{Model, ModelError};
use safetensors::SafeTensors;

/// A fresh directory holding the fixture's config and `weights` as `model.safetensors`.
fn checkpoint(name: &str, weights: &[u8]) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("model-loading-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy(tiny_dir().join("config.json"), dir.join("config.json")).unwrap();
    std::fs::write(dir.join("model.safetensors"), weights).unwrap();
    dir
}

fn fixture_bytes() -> Vec<u8> {
    std::fs::read(tiny_dir().join("model.safetensors")).unwrap()
}

/// The message of loading `dir`, which must fail; the directory is removed.
fn load_message(dir: &Path) -> String {
    let Err(err) = Model::load(dir) else {
        panic!("{} loaded", dir.display());
    };
    let message = err.to_string();
    std::fs::remove_dir_all(dir).unwrap();
    message
}

/// Where tensor `name`'s data starts in the file.
fn data_start(bytes: &[u8], name: &str) -> usize {
    let (header, metadata) = SafeTensors::read_metadata(bytes).unwrap();
    8 + header + metadata.info(name).unwrap().data_offsets.0
}

#[test]
fn non_finite_weights_are_refused_naming_the_tensor_and_the_file() {
    let name = "backbone.layers.3.mixer.k_proj.weight";
    for (label, value) in [
        ("nan", f32::NAN),
        ("inf", f32::INFINITY),
        ("-inf", f32::NEG_INFINITY),
    ] {
        let mut bytes = fixture_bytes();
        // The fixture is f32: element 5 of the tensor.
        let at = data_start(&bytes, name) + 4 * 5;
        bytes[at..at + 4].copy_from_slice(&value.to_le_bytes());
        let dir = checkpoint(&format!("nonfinite-{label}"), &bytes);
        let file = dir.join("model.safetensors");
        let Err(err) = Model::load(&dir) else {
            panic!("{label}: a checkpoint with a non-finite weight loaded");
        };
        assert!(
            matches!(&err, ModelError::NonFiniteWeight { name: n, index: 5, .. } if n == name),
            "{label}: {err}"
        );
        let message = err.to_string();
        assert!(message.contains(name), "{message}");
        assert!(message.contains(&file.display().to_string()), "{message}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

/// The fixture's file with `edit` applied to its header's JSON (the data unchanged).
fn with_header(edit: impl FnOnce(&mut serde_json::Map<String, serde_json::Value>)) -> Vec<u8> {
    let bytes = fixture_bytes();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let mut header: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    edit(&mut header);
    let text = serde_json::to_vec(&header).unwrap();
    let mut out = (text.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&text);
    out.extend_from_slice(&bytes[8 + n..]);
    out
}

#[test]
fn corrupt_and_truncated_files_name_the_file_and_the_tensor() {
    let original = fixture_bytes();
    let (header, metadata) = SafeTensors::read_metadata(&original).unwrap();
    let last = metadata
        .tensors()
        .into_iter()
        .max_by_key(|(_, info)| info.data_offsets.1)
        .map(|(name, _)| name)
        .unwrap();
    let cases: Vec<(&str, Vec<u8>, Vec<String>)> = vec![
        (
            "data cut short",
            original[..original.len() - 100].to_vec(),
            vec!["truncated".into(), format!("`{last}`")],
        ),
        (
            "file shorter than the length prefix",
            original[..5].to_vec(),
            vec!["truncated".into(), "5 bytes".into()],
        ),
        (
            "header cut short",
            original[..8 + header / 2].to_vec(),
            vec!["truncated".into(), format!("{header}")],
        ),
        (
            "a shape that disagrees with the data offsets",
            with_header(|h| {
                h["backbone.norm_f.weight"]["shape"] = serde_json::json!([65]);
            }),
            vec!["`backbone.norm_f.weight`".into(), "[65]".into()],
        ),
        (
            "a shape of 10^12 elements",
            with_header(|h| {
                h["backbone.norm_f.weight"]["shape"] = serde_json::json!([1_000_000, 1_000_000]);
            }),
            vec!["`backbone.norm_f.weight`".into()],
        ),
        (
            "trailing bytes after the last tensor",
            [original.as_slice(), &[0u8; 12]].concat(),
            vec![format!("`{last}`"), "12".into()],
        ),
    ];
    for (label, bytes, wanted) in cases {
        let dir = checkpoint(&label.replace(' ', "-"), &bytes);
        let file = dir.join("model.safetensors").display().to_string();
        let message = load_message(&dir);
        assert!(message.contains(&file), "{label}: {message}");
        for part in wanted {
            assert!(
                message.contains(&part),
                "{label}: {message:?} lacks {part:?}"
            );
        }
    }
}
