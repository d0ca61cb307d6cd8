//! The shared fixture through `DeviceIo` only: prefill + 12 decode steps of every case match the
//! transformers reference (1e-4, same greedy ids), twice per case with the prefix cache on, the
//! second run served from the cache with the same bits.

#[path = "../examples/router_parity/check.rs"]
mod check;

use std::path::PathBuf;

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../model/tests/fixtures/nemotron-h-tiny")
}

#[test]
fn every_fixture_case_matches_the_reference_twice() {
    let reports = check::check_fixture(&fixture()).unwrap();
    assert_eq!(reports.len(), 12, "six cases, two runs each");
    for (i, r) in reports.iter().enumerate() {
        assert_eq!((r.case, r.run), (i / 2, i % 2 + 1));
        assert!(r.ok(1e-4), "{r:?}");
    }
    // Second runs are served from the cache: the prompt's last block boundary below its last
    // token (the end-of-input checkpoint), for the prompts of 1, 5, 16, 17, 40 and 100 tokens.
    let cached: Vec<(usize, usize)> = reports.iter().map(|r| (r.prompt_len, r.cached)).collect();
    assert_eq!(
        cached,
        vec![
            (1, 0),
            (1, 0),
            (5, 0),
            (5, 0),
            (16, 0),
            (16, 0),
            (17, 0),
            (17, 16),
            (40, 0),
            (40, 32),
            (100, 0),
            (100, 96)
        ]
    );
}
