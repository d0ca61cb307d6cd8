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
//! Refuses two reports of different kinds, models, pin scopes or jittered copies (exit status
//! 1, the reason on stderr).
#![forbid(unsafe_code)]

// Only `write_lines` is used here.
#[allow(dead_code)]
mod common;

use std::io;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use ssm_snapshot::grid::compare::{compare, Report};

/// Compares two grid or scan reports.
#[derive(Debug, Parser)]
struct Args {
    /// The first report (the baseline).
    first: PathBuf,
    /// The second report (the candidate).
    second: PathBuf,
}

fn main() -> ExitCode {
    let args = Args::parse();
    let compared = Report::read(&args.first)
        .and_then(|first| Ok((first, Report::read(&args.second)?)))
        .and_then(|(first, second)| {
            let c = compare(&first, &second)?;
            let head = format!(
                "{:?} reports, {} (pin scope {}), {} jittered copies a cell",
                first.kind, first.model, first.pin_scope, first.jitter
            );
            Ok((head, c))
        });
    match compared {
        Ok((head, comparison)) => {
            let mut lines = vec![
                format!("first: {}", args.first.display()),
                format!("second: {}", args.second.display()),
                head,
            ];
            lines.extend(comparison.lines());
            match common::write_lines(io::stdout().lock(), &lines) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("error: writing the report: {e}");
                    ExitCode::FAILURE
                }
            }
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
