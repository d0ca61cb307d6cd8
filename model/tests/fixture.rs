//! The reference fixtures in `tests/fixtures/`: every prompt position and every teacher-forced
//! decode step within 1e-4 of the reference, and identical greedy ids.
//!
//! - `nemotron-h-tiny`: transformers 5.23's float64 forward (layout as a `layers_block_type` list).
//! - `nemotron-h-alt`: another shape and layer order (`*ME-MM*EM-`, string layout, Mamba biases,
//!   hidden 72, 8 Mamba heads in 4 groups, conv kernel 3, 6/2 attention heads of width 10,
//!   12 experts in 3 groups with top-2 groups and top-3 experts, eps 1e-6), from the independent
//!   float64 NumPy implementation of ARCH.md (`make_fixture.py`).

use std::path::{Path, PathBuf};

use model::parity::{check_fixture, mtp_cases, prompts, MtpCase, DEFAULT_TOLERANCE};
use model::{Config, ModelError};

fn fixture_dir(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

/// Checks every case of `tests/fixtures/{name}` and that the prompts have `lengths` tokens.
fn check(name: &str, lengths: &[usize]) {
    let dir = fixture_dir(name);
    let report = check_fixture(&dir).unwrap();
    let found: Vec<usize> = report.cases.iter().map(|c| c.prompt_len).collect();
    assert_eq!(found, lengths, "{name}: prompt lengths");
    let prompts: Vec<usize> = prompts(&dir).unwrap().iter().map(Vec::len).collect();
    assert_eq!(prompts, lengths, "{name}: parity::prompts");
    for case in &report.cases {
        assert_eq!(case.decode_steps, 12, "{name} case {}", case.index);
        assert_eq!(case.actual_greedy.len(), 13, "{name} case {}", case.index);
        assert_eq!(
            case.actual_greedy, case.expected_greedy,
            "{name} case {} greedy ids",
            case.index
        );
        assert!(
            case.max_prompt_diff <= DEFAULT_TOLERANCE && case.max_decode_diff <= DEFAULT_TOLERANCE,
            "{name} case {}: prompt diff {:e}, decode diff {:e}",
            case.index,
            case.max_prompt_diff,
            case.max_decode_diff
        );
    }
    assert!(report.passed(DEFAULT_TOLERANCE), "{name}");
}

#[test]
fn every_case_matches_transformers() {
    check("nemotron-h-tiny", &[1, 5, 16, 17, 40, 100]);
}

#[test]
fn every_case_of_the_alt_shape_matches_the_numpy_reference() {
    // The alt fixture exists to cover what the tiny one does not; a regenerated file must keep that.
    let config =
        Config::from_file(&fixture_dir("nemotron-h-alt").join("model/config.json")).unwrap();
    assert_eq!(config.pattern(), "*ME-MM*EM-");
    assert_eq!(
        (
            config.hidden_size,
            config.vocab_size,
            config.layer_norm_epsilon
        ),
        (72, 320, 1e-6)
    );
    assert_eq!(
        (
            config.mamba_num_heads,
            config.mamba_head_dim,
            config.n_groups
        ),
        (8, 10, 4)
    );
    assert_eq!((config.ssm_state_size, config.conv_kernel), (8, 3));
    assert!(config.use_bias && config.use_conv_bias);
    assert_eq!(
        (
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim
        ),
        (6, 2, 10)
    );
    assert_eq!(
        (
            config.n_routed_experts,
            config.n_group,
            config.topk_group,
            config.num_experts_per_tok
        ),
        (12, 3, 2, 3)
    );
    check("nemotron-h-alt", &[1, 7, 16, 33, 64]);
}

/// `result` is the typed error of a malformed fixture file `path` (written from `text`) with `reason`.
fn assert_fixture_error<T: std::fmt::Debug>(
    result: Result<T, ModelError>,
    path: &Path,
    reason: &str,
    text: &str,
) {
    match result {
        Err(ModelError::Fixture {
            path: at,
            reason: got,
        }) => assert_eq!((at.as_path(), got.as_str()), (path, reason), "{text}"),
        other => panic!("{text}: {other:?}"),
    }
}

/// A `cases.json` that is not what the fixtures hold is a typed error naming the file and what
/// is wrong, for the prompts as for the parity check.
#[test]
fn a_malformed_cases_file_is_a_typed_error() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("cases.json");
    for (text, reason) in [
        (r#"{"cases": 3}"#, "`cases` is not a list"),
        (
            r#"{"cases": [{"prompt_ids": [1, -2]}]}"#,
            "`prompt_ids` holds a non-id -2",
        ),
        (r#"{"cases": [{}]}"#, "`prompt_ids` is not a list"),
    ] {
        std::fs::write(&path, text).unwrap();
        assert_fixture_error(prompts(dir.path()), &path, reason, text);
    }
    std::fs::remove_file(&path).unwrap();
    assert!(matches!(prompts(dir.path()), Err(ModelError::Io { .. })));
}

/// An MTP fixture's `cases.json` is read whole (every case's index and four id lists), and one
/// that lacks a field or holds a bad index is a typed error naming the file and the field.
#[test]
fn mtp_cases_are_read_and_a_malformed_one_is_a_typed_error() {
    let cases = mtp_cases(&fixture_dir("nemotron-h-alt").join("mtp")).unwrap();
    assert_eq!(cases.len(), 5);
    assert_eq!(
        cases.iter().map(|c| c.index).collect::<Vec<_>>(),
        [0, 1, 2, 3, 4]
    );

    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("cases.json");
    let ok = r#""prompt_ids": [1], "greedy_ids": [2], "draft0_ids": [3]"#;
    for (text, reason) in [
        (
            format!(r#"{{"cases": [{{"index": -1, {ok}, "draft1_ids": [4]}}]}}"#),
            "a case's `index` is not a count",
        ),
        (
            format!(r#"{{"cases": [{{"index": 0, {ok}}}]}}"#),
            "`draft1_ids` is not a list",
        ),
    ] {
        std::fs::write(&path, &text).unwrap();
        assert_fixture_error(mtp_cases(dir.path()), &path, reason, &text);
    }
    std::fs::write(
        &path,
        format!(r#"{{"cases": [{{"index": 7, {ok}, "draft1_ids": [4]}}]}}"#),
    )
    .unwrap();
    assert_eq!(
        mtp_cases(dir.path()).unwrap(),
        [MtpCase {
            index: 7,
            prompt: vec![1],
            greedy: vec![2],
            draft0: vec![3],
            draft1: vec![4],
        }]
    );
}
