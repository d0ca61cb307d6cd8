//! The short-trace scan: the full grid's generators with few sessions (a few hundred requests
//! each, ending as their sessions drain) at the engine's block size, `lru` against the default
//! `marconi` on every cell, with the switches the tuner made. One markdown row per cell and a
//! summary per family; exits with status 2 when `marconi` falls below `lru` by more than
//! [`LRU_TOLERANCE`] on any cell.
//!
//! ```text
//! cargo run --release -p ssm-snapshot --example short_grid -- [--threads N]
//!     [--families sharegpt,longchat,chat,mix,agentic] [--sessions 20,30,40,60]
//!     [--seeds 1,2,3,4,5,6] [--capacities 5e8,1e9,2e9] [--block-size 16] [--lru FILE.json]
//!     [--jitter N [--jitter-rate 0.02]] [--json FILE]
//! ```
//!
//! With `--jitter N` every cell is replayed again on `N` jittered copies of its trace
//! (`ssm_snapshot::generate::jitter`: a few neighbouring requests of different sessions served
//! in the other order), `lru` and `marconi` both, and each row gets the copies' `marconi − lru`
//! (mean, least and most): how much of a cell's margin is the chaos of which sequence an
//! eviction happened to hit. The summary counts the cells below `lru` whose copies are below it
//! on average too (a loss that holds up) and those whose copies are not. The exit status is the
//! original cells'.
//!
//! `--json FILE` writes the cells as data too (`ssm_snapshot::grid::compare::Report`), which
//! the `compare` example reads: two runs of the scan (the default and a candidate) side by side,
//! with the paired change of `marconi − lru` on the cells and on their copies' mean.
//!
//! The default seeds are the ones the policy was tuned on ([`SHORT_TUNING_SEEDS`]); seeds 7
//! and 8 are held out.
#![forbid(unsafe_code)]

mod common;

use std::collections::HashMap;
use std::io;
use std::process::ExitCode;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use clap::Parser;
use ssm_snapshot::generate::jitter;
use ssm_snapshot::grid::compare::{CellRecord, Figures, ReportKind};
use ssm_snapshot::grid::{
    canary_key, canary_trace, parse_byte_count, read_checked_figures, run_short_cell, run_store,
    same_figure, write_figures, ShortCell, CANARY_CAPACITY, LRU_TOLERANCE, SHORT_BLOCK_SIZE,
    SHORT_CAPACITIES, SHORT_KINDS, SHORT_SESSIONS, SHORT_TUNING_SEEDS,
};
use ssm_snapshot::sim::{generate, Policy, SimConfig};
use ssm_snapshot::{CostModel, PinScope, SnapshotError};

/// Runs the short-trace scan and prints the report.
#[derive(Debug, Parser)]
struct Args {
    /// The model whose costs the cells use: a built-in name (`ssm_snapshot::BUILT_IN_MODELS`; an
    /// unknown name lists them). The default, nvidia-hybrid-7b, is the paper's, which the policy
    /// was tuned on. A reference cache written for another model is recomputed (its canary cell
    /// differs).
    #[arg(long, value_name = "NAME", default_value = "nvidia-hybrid-7b", value_parser = common::cost_model)]
    model: CostModel,
    /// Which checkpoints a running request's pin holds: `path` (every one on its hit path, the
    /// default) or `hit` (only the hit one; `ssm_snapshot::PinScope`). A cache written under the
    /// other scope is recomputed.
    #[arg(long, value_name = "SCOPE", default_value = "path", value_parser = common::pin_scope)]
    pin_scope: PinScope,
    /// Families (default: all five).
    #[arg(long, value_delimiter = ',')]
    families: Vec<String>,
    /// Sessions per trace.
    #[arg(long, value_delimiter = ',', default_values_t = SHORT_SESSIONS.to_vec())]
    sessions: Vec<usize>,
    /// Cells replayed at once, one per thread.
    #[arg(long, default_value_t = 1)]
    threads: usize,
    /// Seeds (default: the tuning seeds, 1-6).
    #[arg(long, value_delimiter = ',', default_values_t = SHORT_TUNING_SEEDS.to_vec())]
    seeds: Vec<u64>,
    /// Capacities in bytes (`5e8` accepted).
    #[arg(long, value_delimiter = ',', value_parser = byte_count,
          default_values_t = SHORT_CAPACITIES.to_vec())]
    capacities: Vec<u64>,
    /// Tokens per block.
    #[arg(long, default_value_t = SHORT_BLOCK_SIZE)]
    block_size: u32,
    /// A JSON file of `lru` figures (which do not depend on the `marconi` policy): cells found
    /// there are not rerun, new ones are added. A file written by other code (the store changed:
    /// its canary cell's figure differs) is recomputed.
    #[arg(long)]
    lru: Option<std::path::PathBuf>,
    /// Jittered copies of each cell's trace to replay too (seeds 1..=N), each with its own `lru`
    /// run (not cached).
    #[arg(long, default_value_t = 0)]
    jitter: u64,
    /// The chance that a pair of neighbouring requests of different sessions is swapped in a
    /// jittered copy.
    #[arg(long, default_value_t = 0.02, value_parser = common::probability)]
    jitter_rate: f64,
    /// Also writes the cells to this file as JSON (`ssm_snapshot::grid::compare::Report`; the
    /// `compare` example compares two).
    #[arg(long, value_name = "FILE")]
    json: Option<std::path::PathBuf>,
}

fn byte_count(text: &str) -> Result<u64, String> {
    parse_byte_count(text).ok_or_else(|| format!("`{text}` is not a byte count"))
}

struct Cell {
    family: &'static str,
    sessions: usize,
    seed: u64,
    capacity: u64,
}

fn main() -> ExitCode {
    let args = Args::parse();
    let mut kinds = Vec::new();
    for name in &args.families {
        match SHORT_KINDS.iter().find(|(n, _)| n == name) {
            Some(&kind) => kinds.push(kind),
            None => {
                let names: Vec<&str> = SHORT_KINDS.iter().map(|(n, _)| *n).collect();
                eprintln!("error: unknown family `{name}` (expected one of {names:?})");
                return ExitCode::FAILURE;
            }
        }
    }
    if kinds.is_empty() {
        kinds = SHORT_KINDS.to_vec();
    }
    if args.threads == 0 || args.block_size == 0 {
        eprintln!("error: --threads and --block-size must be at least 1");
        return ExitCode::FAILURE;
    }
    let mut cells = Vec::new();
    for &(family, _) in &kinds {
        for &sessions in &args.sessions {
            for &seed in &args.seeds {
                for &capacity in &args.capacities {
                    cells.push(Cell {
                        family,
                        sessions,
                        seed,
                        capacity,
                    });
                }
            }
        }
    }
    let cost = args.model.clone();
    let known: HashMap<String, f64> = match args.lru.as_deref().map(|path| {
        let config = SimConfig::new(Policy::Lru, CANARY_CAPACITY, SHORT_BLOCK_SIZE, cost.clone())
            .with_pin_scope(args.pin_scope);
        let canary = run_store(config, &canary_trace())?.token_hit_rate;
        let key = canary_key(args.pin_scope);
        read_checked_figures(path, key, canary, |&a, &b| same_figure(a, b))
    }) {
        Some(Ok((map, stale))) => {
            if stale {
                eprintln!("note: the lru cache was written by other code, for another model or under another pin scope (its canary differs); recomputing");
            }
            map
        }
        Some(Err(e)) => {
            eprintln!("error: {e}");
            return ExitCode::FAILURE;
        }
        None => HashMap::new(),
    };
    let key = |c: &Cell| {
        format!(
            "{}/{}/{}/{}/{}",
            c.family, c.sessions, c.seed, c.capacity, args.block_size
        )
    };
    let known = Mutex::new(known);
    let next = AtomicUsize::new(0);
    let results = Mutex::new(Vec::new());
    let failed = Mutex::new(None);
    std::thread::scope(|scope| {
        for _ in 0..args.threads {
            scope.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(cell) = cells.get(i) else {
                    break;
                };
                let kind = kinds.iter().find(|(n, _)| *n == cell.family).map(|k| k.1);
                let trace = generate(kind.expect("chosen above"), cell.sessions, cell.seed);
                let lru = known.lock().expect("no panics").get(&key(cell)).copied();
                let scope = args.pin_scope;
                let run = |trace: &[_], lru| {
                    run_short_cell(trace, cell.capacity, args.block_size, lru, &cost, scope)
                };
                let replayed = run(&trace, lru).and_then(|figures| {
                    let copies = (1..=args.jitter)
                        .map(|seed| run(&jitter(&trace, args.jitter_rate, seed), None))
                        .collect::<Result<Vec<ShortCell>, SnapshotError>>()?;
                    Ok((figures, copies))
                });
                match replayed {
                    Ok((figures, copies)) => {
                        let margins = Margins::of(&copies);
                        known
                            .lock()
                            .expect("no panics")
                            .insert(key(cell), figures.lru);
                        common::progress(&row(cell, &figures, &margins));
                        results
                            .lock()
                            .expect("no panics")
                            .push((i, figures, margins));
                    }
                    Err(e) => {
                        *failed.lock().expect("no panics") = Some(format!("{}: {e}", key(cell)))
                    }
                }
            });
        }
    });
    // The lru figures are saved even when a cell failed: they are right either way.
    let saved = args.lru.as_deref().map_or(Ok(()), |path| {
        write_figures(path, &known.into_inner().expect("no panics"))
    });
    let failed = failed.into_inner().expect("no panics");
    if let Some(message) = failed.or(saved.err().map(|e| e.to_string())) {
        eprintln!("error: {message}");
        return ExitCode::FAILURE;
    }
    let mut results = results.into_inner().expect("no panics");
    results.sort_by_key(|(i, _, _)| *i);
    let jittered = if args.jitter > 0 {
        format!(
            " {} jittered copies: − lru mean [least, most] |",
            args.jitter
        )
    } else {
        String::new()
    };
    let mut lines = vec![
        format!("| family | sessions | seed | capacity | requests | lru | **marconi** | − lru | switches (request: α, recency, FLOP basis, guard) |{jittered}"),
        format!("|---|---|---|---|---|---|---|---|---|{}", if args.jitter > 0 { "---|" } else { "" }),
    ];
    lines.extend(
        results
            .iter()
            .map(|(i, figures, margins)| row(&cells[*i], figures, margins)),
    );
    lines.push(String::new());
    let mut failing = false;
    for &(family, _) in kinds.iter().chain([&("all", kinds[0].1)]) {
        let part: Vec<(&ShortCell, &Margins)> = results
            .iter()
            .filter(|(i, _, _)| family == "all" || cells[*i].family == family)
            .map(|(_, f, margins)| (f, margins))
            .collect();
        let diff = |f: &ShortCell| f.marconi - f.lru;
        let below = part
            .iter()
            .filter(|(f, _)| diff(f) < -LRU_TOLERANCE)
            .count();
        let above = part.iter().filter(|(f, _)| diff(f) > LRU_TOLERANCE).count();
        let mean = part.iter().map(|(f, _)| diff(f)).sum::<f64>() / part.len().max(1) as f64;
        let worst = part
            .iter()
            .map(|(f, _)| diff(f))
            .fold(f64::INFINITY, f64::min);
        lines.push(format!(
            "{family}: {} cells, {below} below lru by > {LRU_TOLERANCE}, {above} above by > {LRU_TOLERANCE}; mean {mean:+.4}, worst {worst:+.4}",
            part.len()
        ));
        failing |= below > 0;
        if args.jitter > 0 {
            let (mut holds, mut straddles, mut jittered_below) = (0, 0, 0);
            for &(f, margins) in &part {
                let below_on_average = margins.mean_vs_lru() < -LRU_TOLERANCE;
                jittered_below += usize::from(below_on_average);
                if diff(f) < -LRU_TOLERANCE {
                    if below_on_average {
                        holds += 1;
                    } else {
                        straddles += 1;
                    }
                }
            }
            lines.push(format!(
                "  jittered: {jittered_below} cells below lru by > {LRU_TOLERANCE} on their copies' mean; of the {below} below, {holds} below on their copies' mean too, {straddles} not"
            ));
        }
    }
    if let Err(e) = common::write_lines(io::stdout().lock(), &lines) {
        eprintln!("error: writing the report: {e}");
        return ExitCode::FAILURE;
    }
    if let Some(path) = &args.json {
        let run = common::RunOf {
            kind: ReportKind::Scan,
            model: &cost,
            pin_scope: args.pin_scope,
            jitter: args.jitter,
            jitter_rate: args.jitter_rate,
        };
        let records = results
            .iter()
            .map(|(i, f, margins)| record(&cells[*i], f, margins, args.block_size))
            .collect();
        if let Err(e) = common::write_report(path, run, records) {
            eprintln!("error: {e}");
            return ExitCode::FAILURE;
        }
    }
    if failing {
        ExitCode::from(2)
    } else {
        ExitCode::SUCCESS
    }
}

/// A cell's jittered copies: the mean of their figures, and their least and most
/// `marconi − lru`. Empty without copies.
struct Margins {
    mean: Option<Figures>,
    least: f64,
    most: f64,
}

impl Margins {
    fn of(copies: &[ShortCell]) -> Margins {
        let n = copies.len() as f64;
        let margins = copies.iter().map(|c| c.marconi - c.lru);
        Margins {
            mean: (!copies.is_empty()).then(|| Figures {
                lru: copies.iter().map(|c| c.lru).sum::<f64>() / n,
                marconi: copies.iter().map(|c| c.marconi).sum::<f64>() / n,
                paper: None,
            }),
            least: margins.clone().fold(f64::INFINITY, f64::min),
            most: margins.fold(f64::NEG_INFINITY, f64::max),
        }
    }

    /// The copies' mean `marconi − lru` (0 without copies).
    fn mean_vs_lru(&self) -> f64 {
        self.mean.map_or(0.0, |m| m.vs_lru())
    }
}

fn record(cell: &Cell, f: &ShortCell, margins: &Margins, block_size: u32) -> CellRecord {
    CellRecord {
        family: cell.family.to_string(),
        sessions: cell.sessions,
        seed: cell.seed,
        capacity_bytes: cell.capacity,
        block_size,
        requests: f.requests,
        figures: Figures {
            lru: f.lru,
            marconi: f.marconi,
            paper: None,
        },
        copies: margins.mean,
        switches: Some(
            f.switches
                .iter()
                .map(|(at, s)| (*at, s.to_string()))
                .collect(),
        ),
    }
}

fn row(cell: &Cell, f: &ShortCell, margins: &Margins) -> String {
    let switches: Vec<String> = f
        .switches
        .iter()
        .map(|(at, s)| {
            let guard = if s.guard { ", guard" } else { "" };
            format!(
                "{at}: {} {:?} {:?}{guard}",
                s.alpha, s.recency, s.flop_basis
            )
        })
        .collect();
    let jittered = match margins.mean {
        None => String::new(),
        Some(mean) => format!(
            " {:+.4} [{:+.4}, {:+.4}] |",
            mean.vs_lru(),
            margins.least,
            margins.most
        ),
    };
    format!(
        "| {} | {} | {} | {} GB | {} | {:.4} | {:.4} | {:+.4} | {} |{jittered}",
        cell.family,
        cell.sessions,
        cell.seed,
        cell.capacity as f64 / 1e9,
        f.requests,
        f.lru,
        f.marconi,
        f.marconi - f.lru,
        switches.join("; "),
    )
}
