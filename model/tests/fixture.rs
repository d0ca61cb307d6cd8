//! The shared transformers fixture (`tests/fixtures/nemotron-h-tiny`): every prompt position and
//! every teacher-forced decode step within 1e-4 of the reference, and identical greedy ids.

use std::path::PathBuf;

use model::parity::{check_fixture, DEFAULT_TOLERANCE};

fn fixture_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/nemotron-h-tiny")
}

#[test]
fn every_case_matches_transformers() {
    let report = check_fixture(&fixture_dir()).unwrap();
    let lengths: Vec<usize> = report.cases.iter().map(|c| c.prompt_len).collect();
    assert_eq!(lengths, [1, 5, 16, 17, 40, 100]);
    for case in &report.cases {
        assert_eq!(case.decode_steps, 12, "case {}", case.index);
        assert_eq!(case.actual_greedy.len(), 13, "case {}", case.index);
        assert_eq!(
            case.actual_greedy, case.expected_greedy,
            "case {} greedy ids",
            case.index
        );
        assert!(
            case.max_prompt_diff <= DEFAULT_TOLERANCE && case.max_decode_diff <= DEFAULT_TOLERANCE,
            "case {}: prompt diff {:e}, decode diff {:e}",
            case.index,
            case.max_prompt_diff,
            case.max_decode_diff
        );
    }
    assert!(report.passed(DEFAULT_TOLERANCE));
}
