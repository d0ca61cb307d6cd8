//! Checks a reference fixture folder (`PATH/model/`, `PATH/expected.safetensors`,
//! `PATH/cases.json`) against this crate's forward: prints the largest absolute difference per
//! case and `OK` or `FAIL`, and exits non-zero on failure.
//!
//! `cargo run --release -p model --example forward_parity -- PATH [TOLERANCE]`

use std::path::PathBuf;
use std::process::ExitCode;

use model::parity::{check_fixture, DEFAULT_TOLERANCE};

fn main() -> ExitCode {
    let mut args = std::env::args().skip(1);
    let Some(dir) = args.next().map(PathBuf::from) else {
        eprintln!("usage: forward_parity PATH [TOLERANCE]");
        return ExitCode::from(2);
    };
    let tolerance = match args.next().map(|t| t.parse::<f32>()) {
        None => DEFAULT_TOLERANCE,
        Some(Ok(t)) => t,
        Some(Err(e)) => {
            eprintln!("bad tolerance: {e}");
            return ExitCode::from(2);
        }
    };
    let report = match check_fixture(&dir) {
        Ok(report) => report,
        Err(e) => {
            eprintln!("error: {e}");
            eprintln!("FAIL");
            return ExitCode::FAILURE;
        }
    };
    for case in &report.cases {
        println!(
            "case{} L={:3} decode={:2}: max|prompt diff| {:.2e}  max|decode diff| {:.2e}  greedy ids {}  {}",
            case.index,
            case.prompt_len,
            case.decode_steps,
            case.max_prompt_diff,
            case.max_decode_diff,
            if case.expected_greedy == case.actual_greedy { "match" } else { "DIFFER" },
            if case.passed(tolerance) { "ok" } else { "FAIL" },
        );
    }
    println!(
        "max abs diff {:.2e} (tolerance {tolerance:.0e})",
        report.max_diff()
    );
    if report.passed(tolerance) {
        println!("OK");
        ExitCode::SUCCESS
    } else {
        println!("FAIL");
        ExitCode::FAILURE
    }
}
