//! Compares two runs of the policy grid or the short-trace scan, written with `--json FILE`
//! (`ssm_snapshot::grid::compare`): for each, the cells failing their check (below `lru` /
//! SGLang+ / the paper's Marconi) and the mean of `marconi − lru`, on the traces and on the
//! jittered copies' mean; the paired change of `marconi − lru` (second − first) with its
//! standard error; and every cell whose `marconi` moved or whose check on its copies changed.
//! What a change to the default policy is judged on (ssm-snapshot/MEASUREMENTS.md), with nothing
//! but the two files.
//!
//! ```text
//! cargo build --release -p ssm-snapshot --examples
//! target/release/examples/short_grid --threads 2 --jitter 8 --lru /tmp/lru.json --json /tmp/main.json
//! # (the candidate built)
//! target/release/examples/short_grid --threads 2 --jitter 8 --lru /tmp/lru.json --json /tmp/new.json
//! target/release/examples/compare /tmp/main.json /tmp/new.json
//! ```
//!
//! More than one pair (`compare A1 B1 A2 B2 ...`: a keep rule judged over several held-out sets)
//! prints each comparison and then their counts summed (`ssm_snapshot::grid::compare::summed`).
//! Refuses two reports of different kinds, models, pin scopes or jittered copies, and an odd
//! number of reports (exit status 1, the reason on stderr).
#![forbid(unsafe_code)]

// Only `write_lines` is used here.
#[allow(dead_code)]
mod common;

use std::io;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::Parser;
use ssm_snapshot::grid::compare::{compare, summed_lines, Comparison, Report};
use ssm_snapshot::SnapshotError;

/// Compares grid or scan reports, two by two.
#[derive(Debug, Parser)]
struct Args {
    /// Pairs of reports: the first of each (the baseline), then the second (the candidate).
    #[arg(required = true, num_args = 2..)]
    reports: Vec<PathBuf>,
}

/// The lines of one pair's comparison, headed by its files and what the reports are.
fn pair(first: &Path, second: &Path) -> Result<(Comparison, Vec<String>), SnapshotError> {
    let (a, b) = (Report::read(first)?, Report::read(second)?);
    let comparison = compare(&a, &b)?;
    let mut lines = vec![
        format!("first: {}", first.display()),
        format!("second: {}", second.display()),
        format!(
            "{:?} reports, {} (pin scope {}), {} jittered copies a cell",
            a.kind, a.model, a.pin_scope, a.jitter
        ),
    ];
    lines.extend(comparison.lines());
    Ok((comparison, lines))
}

fn main() -> ExitCode {
    let args = Args::parse();
    if args.reports.len() % 2 != 0 {
        eprintln!(
            "error: {} reports given; they are compared in pairs (first, second)",
            args.reports.len()
        );
        return ExitCode::FAILURE;
    }
    let compared: Result<Vec<_>, SnapshotError> =
        args.reports.chunks(2).map(|p| pair(&p[0], &p[1])).collect();
    let compared = match compared {
        Ok(compared) => compared,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::FAILURE;
        }
    };
    let mut lines = Vec::new();
    for (_, pair_lines) in &compared {
        lines.extend(pair_lines.iter().cloned());
        lines.push(String::new());
    }
    if compared.len() > 1 {
        let comparisons: Vec<Comparison> = compared.into_iter().map(|(c, _)| c).collect();
        lines.extend(summed_lines(&comparisons));
    }
    match common::write_lines(io::stdout().lock(), &lines) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: writing the report: {e}");
            ExitCode::FAILURE
        }
    }
}
