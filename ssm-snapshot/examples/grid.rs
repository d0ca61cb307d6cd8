//! The policy grid: generates every trace family for every seed, replays each at every capacity
//! (block size 1; the paper's 7B cost model unless `--model`) under `lru`, `marconi`, the
//! paper's SGLang+ and the paper's Marconi, and prints one markdown row per cell and a summary
//! (cells where `marconi` falls below a reference by more than its tolerance, worst margins,
//! tuned and held-out cells apart).
//!
//! ```text
//! cargo run --release -p ssm-snapshot --example grid -- [--threads N]
//!     [--families chat,longchat,agentic,mix,shifting,sharegpt] [--seeds 1,2,3]
//!     [--capacities 5e8,1e9,...] [--references FILE.json] [--jitter N [--jitter-rate 0.02]]
//!     [--json FILE]
//! ```
//!
//! With `--jitter N` every cell is replayed again, under all four policies, on `N` jittered
//! copies of its trace (`ssm_snapshot::generate::jitter`: a few neighbouring requests of
//! different sessions served in the other order), and each row also shows the copies' mean
//! margins and whether the cell passes its check on them (`ssm_snapshot::grid::mean_of_copies`):
//! a cell's margin on one trace is partly the chaos of which sequence an eviction happened to
//! hit, and the copies' mean tells a policy's loss from that. The copies' references are cached
//! with the others.
//!
//! The default families are [`ssm_snapshot::grid::families`]; the same generators at other
//! session counts (`chat50`, `longchat50`, `longchat200`, `agentic20`, `agentic80`) can be named
//! too. Which cells were held out while tuning is [`ssm_snapshot::grid::held_out`]. Exits with
//! status 2 when a cell fails its check.
//!
//! `--json FILE` writes the cells as data too (`ssm_snapshot::grid::compare::Report`), which
//! the `compare` example reads: two runs of the grid (the default and a candidate) side by
//! side, with the paired change of `marconi − lru` on the cells and on their copies' mean.
#![forbid(unsafe_code)]

mod common;

use std::collections::HashMap;
use std::io;
use std::process::ExitCode;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Instant;

use clap::Parser;
use ssm_snapshot::generate::jitter;
use ssm_snapshot::grid::compare::{CellRecord, Figures, ReportKind, Tally};
use ssm_snapshot::grid::{
    canary_key, canary_trace, families, held_out, mean_of_copies, other_session_counts,
    parse_byte_count, read_checked_figures, run_cell_with, run_references, same_figure, trace_of,
    write_figures, CellFigures, Family, References, CANARY_CAPACITY, CAPACITIES, LRU_TOLERANCE,
    PAPER_MARCONI_TOLERANCE, PAPER_OVERSHOOT,
};
use ssm_snapshot::{CostModel, PinScope};

/// Runs the policy grid and prints the report.
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
    /// Worker threads (cells run in parallel).
    #[arg(long, default_value_t = 1)]
    threads: usize,
    /// Families to run (default: all).
    #[arg(long, value_delimiter = ',')]
    families: Vec<String>,
    /// Seeds.
    #[arg(long, value_delimiter = ',', default_values_t = [1u64, 2, 3])]
    seeds: Vec<u64>,
    /// Capacities in bytes (`5e8` accepted; default: 0.5 GB to 40 GB).
    #[arg(long, value_delimiter = ',', value_parser = byte_count)]
    capacities: Vec<u64>,
    /// A JSON file of reference figures (lru and the paper's policies, which do not depend on
    /// the `marconi` policy): cells found there are not rerun, new ones are added. A file
    /// written by other code (the store or the paper model changed: its canary cell's figures
    /// differ) is recomputed.
    #[arg(long)]
    references: Option<std::path::PathBuf>,
    /// Jittered copies of each cell's trace to replay too (seeds 1..=N), under every policy.
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

/// A byte count: an integer or exact scientific notation (`2e10`).
fn byte_count(text: &str) -> Result<u64, String> {
    parse_byte_count(text).ok_or_else(|| format!("`{text}` is not a byte count"))
}

struct Row {
    family: Family,
    seed: u64,
    capacity: u64,
    figures: CellFigures,
    /// The cell on its jittered copies (`--jitter`): the mean of their figures.
    copies: Option<CellFigures>,
    seconds: f64,
    requests: usize,
}

impl Row {
    fn record(&self) -> CellRecord {
        CellRecord {
            family: self.family.name.to_string(),
            sessions: self.family.sessions,
            seed: self.seed,
            capacity_bytes: self.capacity,
            block_size: 1,
            requests: self.requests,
            figures: Figures::from(&self.figures),
            copies: self.copies.as_ref().map(Figures::from),
            switches: None,
        }
    }
}

fn main() -> ExitCode {
    let args = Args::parse();
    let all: Vec<Family> = families()
        .into_iter()
        .chain(other_session_counts())
        .collect();
    let chosen: Vec<Family> = if args.families.is_empty() {
        families()
    } else {
        let mut chosen = Vec::new();
        for name in &args.families {
            match all.iter().find(|f| f.name == name) {
                Some(f) => chosen.push(*f),
                None => {
                    let names: Vec<&str> = all.iter().map(|f| f.name).collect();
                    eprintln!("error: unknown family `{name}` (expected one of {names:?})");
                    return ExitCode::FAILURE;
                }
            }
        }
        chosen
    };
    let capacities = if args.capacities.is_empty() {
        CAPACITIES.to_vec()
    } else {
        args.capacities.clone()
    };
    if args.threads == 0 || args.seeds.is_empty() {
        eprintln!("error: --threads and --seeds need at least one");
        return ExitCode::FAILURE;
    }
    let cost = args.model.clone();
    let traces: Vec<(Family, u64, Vec<_>)> = chosen
        .iter()
        .flat_map(|&f| args.seeds.iter().map(move |&s| (f, s)))
        .map(|(f, s)| (f, s, trace_of(f, s)))
        .collect();
    let cells: Vec<(usize, u64)> = (0..traces.len())
        .flat_map(|t| capacities.iter().map(move |&c| (t, c)))
        .collect();
    let known: HashMap<String, References> = match args.references.as_deref().map(|path| {
        let canary = run_references(&canary_trace(), CANARY_CAPACITY, &cost, args.pin_scope)?;
        read_checked_figures(path, canary_key(args.pin_scope), canary, same_references)
    }) {
        Some(Ok((map, stale))) => {
            if stale {
                eprintln!("note: the reference cache was written by other code, for another model or under another pin scope (its canary differs); recomputing");
            }
            map
        }
        Some(Err(e)) => {
            eprintln!("error: {e}");
            return ExitCode::FAILURE;
        }
        None => HashMap::new(),
    };
    let known = Mutex::new(known);
    let next = AtomicUsize::new(0);
    let rows = Mutex::new(Vec::new());
    let failed = Mutex::new(None);
    std::thread::scope(|scope| {
        for _ in 0..args.threads {
            scope.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(&(t, capacity)) = cells.get(i) else {
                    break;
                };
                let (family, seed, trace) = &traces[t];
                let key = format!("{}/{seed}/{capacity}", family.name);
                // The cell on `trace` (the original or a copy) whose references are cached
                // under `key`, and the seconds `marconi` took.
                let replay = |trace: &[_], key: String| {
                    let cached = known.lock().expect("no panics").get(&key).copied();
                    let references = match cached {
                        Some(r) => r,
                        None => run_references(trace, capacity, &cost, args.pin_scope)?,
                    };
                    known.lock().expect("no panics").insert(key, references);
                    let start = Instant::now();
                    run_cell_with(trace, capacity, &cost, args.pin_scope, references)
                        .map(|figures| (figures, start.elapsed().as_secs_f64()))
                };
                let replayed = replay(trace, key.clone()).and_then(|(figures, seconds)| {
                    let copies = (1..=args.jitter)
                        .map(|k| {
                            let copy = jitter(trace, args.jitter_rate, k);
                            let key = format!("{key}/jitter {k} at {}", args.jitter_rate);
                            replay(&copy, key).map(|(f, _)| f)
                        })
                        .collect::<Result<Vec<_>, _>>()?;
                    let mean = mean_of_copies(&figures, &copies);
                    Ok((figures, mean, seconds))
                });
                match replayed {
                    Ok((figures, copies, seconds)) => {
                        let row = Row {
                            family: *family,
                            seed: *seed,
                            capacity,
                            figures,
                            copies,
                            seconds,
                            requests: trace.len(),
                        };
                        common::progress(&line(&row));
                        rows.lock().expect("no panics").push(row);
                    }
                    Err(e) => {
                        *failed.lock().expect("no panics") =
                            Some(format!("{} seed {seed} {capacity}: {e}", family.name));
                    }
                }
            });
        }
    });
    if let Some(message) = failed.into_inner().expect("no panics") {
        eprintln!("error: {message}");
        return ExitCode::FAILURE;
    }
    if let Some(path) = &args.references {
        let map = known.into_inner().expect("no panics");
        if let Err(e) = write_figures(path, &map) {
            eprintln!("error: {e}");
            return ExitCode::FAILURE;
        }
    }
    let mut rows = rows.into_inner().expect("no panics");
    let order = |r: &Row| {
        (
            chosen.iter().position(|f| *f == r.family),
            r.seed,
            r.capacity,
        )
    };
    rows.sort_by_key(order);
    let (copies_head, copies_rule) = if args.jitter > 0 {
        (
            format!(
                " {} jittered copies' mean: − lru / − SGLang+ / − paper Marconi |",
                args.jitter
            ),
            "---|",
        )
    } else {
        (String::new(), "")
    };
    let mut lines = vec![
        format!("| trace | seed | capacity | held out | lru | paper SGLang+ | paper Marconi | **marconi** | − lru | − SGLang+ | − paper Marconi | SGLang+ peak / capacity | paper Marconi peak / capacity | marconi s |{copies_head}"),
        format!("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|{copies_rule}"),
    ];
    lines.extend(rows.iter().map(line));
    lines.push(String::new());
    for (title, held) in [("tuned", false), ("held out", true)] {
        let part: Vec<&Row> = rows
            .iter()
            .filter(|r| held_out(r.family, r.seed, r.capacity) == held)
            .collect();
        lines.extend(summary(title, &part));
    }
    lines.extend(summary("all", &rows.iter().collect::<Vec<_>>()));
    if let Err(e) = common::write_lines(io::stdout().lock(), &lines) {
        eprintln!("error: writing the report: {e}");
        return ExitCode::FAILURE;
    }
    if let Some(path) = &args.json {
        let run = common::RunOf {
            kind: ReportKind::Grid,
            model: &cost,
            pin_scope: args.pin_scope,
            jitter: args.jitter,
            jitter_rate: args.jitter_rate,
        };
        if let Err(e) = common::write_report(path, run, rows.iter().map(Row::record).collect()) {
            eprintln!("error: {e}");
            return ExitCode::FAILURE;
        }
    }
    if rows.iter().all(|r| r.figures.passes()) {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(2)
    }
}

fn line(row: &Row) -> String {
    let f = &row.figures;
    let r = &f.references;
    format!(
        "| {} | {} | {} | {} | {:.4} | {:.4} | {:.4} | {:.4} | {:+.4} | {:+.4} | {:+.4} | {:.2} | {:.2} | {:.1} |",
        row.family.name,
        row.seed,
        gb(row.capacity),
        if held_out(row.family, row.seed, row.capacity) {
            "yes"
        } else {
            ""
        },
        r.lru,
        r.paper_sglang,
        r.paper_marconi,
        f.marconi,
        f.vs_lru(),
        f.vs_paper_sglang(),
        f.vs_paper_marconi(),
        r.paper_sglang_max_bytes as f64 / row.capacity as f64,
        r.paper_marconi_max_bytes as f64 / row.capacity as f64,
        row.seconds,
    ) + &row.copies.as_ref().map_or(String::new(), |c| {
        format!(
            " {:+.4} / {:+.4} / {:+.4}{} |",
            c.vs_lru(),
            c.vs_paper_sglang(),
            c.vs_paper_marconi(),
            if c.passes() { "" } else { " (fails)" },
        )
    })
}

/// Whether two reference figures are the same, bit for bit (`same_figure`).
fn same_references(a: &References, b: &References) -> bool {
    same_figure(a.lru, b.lru)
        && same_figure(a.paper_sglang, b.paper_sglang)
        && same_figure(a.paper_marconi, b.paper_marconi)
        && a.paper_sglang_max_bytes == b.paper_sglang_max_bytes
        && a.paper_marconi_max_bytes == b.paper_marconi_max_bytes
}

fn gb(bytes: u64) -> String {
    format!("{} GB", bytes as f64 / 1e9)
}

/// The summary lines of `rows` under `title` (none for no rows).
fn summary(title: &str, rows: &[&Row]) -> Vec<String> {
    if rows.is_empty() {
        return Vec::new();
    }
    let count =
        |pred: &dyn Fn(&CellFigures) -> bool| rows.iter().filter(|r| pred(&r.figures)).count();
    let worst = |key: &dyn Fn(&CellFigures) -> f64| {
        rows.iter()
            .map(|r| (key(&r.figures), r))
            .min_by(|a, b| a.0.total_cmp(&b.0))
            .map(|(v, r)| {
                format!(
                    "{v:+.4} ({} seed {} {})",
                    r.family.name,
                    r.seed,
                    gb(r.capacity)
                )
            })
            .unwrap_or_default()
    };
    let mean = |key: &dyn Fn(&CellFigures) -> f64| {
        rows.iter().map(|r| key(&r.figures)).sum::<f64>() / rows.len() as f64
    };
    // `marconi` against one paper policy: cells above and below it, the worst and mean margin.
    let versus = |name: &str, key: &dyn Fn(&CellFigures) -> f64| {
        format!(
            "  vs {name}: {} above, {} below; worst {}; mean {:+.4}",
            count(&|f| key(f) > 0.0),
            count(&|f| key(f) < 0.0),
            worst(key),
            mean(key),
        )
    };
    let tally = Tally::of(rows.iter().map(|r| (Figures::from(&r.figures), r.capacity)));
    let (failing, [below_lru, below_sglang, below_paper]) = (tally.failing, tally.below);
    let mut lines = vec![
        format!(
            "{title}: {} cells; fail {failing} (below lru by > {LRU_TOLERANCE}: {below_lru}, below SGLang+ by > {LRU_TOLERANCE}: {below_sglang}, below paper Marconi by > {PAPER_MARCONI_TOLERANCE}: {below_paper}; paper policies above {PAPER_OVERSHOOT} x capacity not counted)",
            rows.len(),
        ),
        format!(
            "  vs lru: {} above, {} equal, {} below; worst {}; mean {:+.4}",
            count(&|f| f.vs_lru() > 0.0),
            count(&|f| f.vs_lru() == 0.0),
            count(&|f| f.vs_lru() < 0.0),
            worst(&|f| f.vs_lru()),
            mean(&|f| f.vs_lru()),
        ),
        versus("paper SGLang+", &|f| f.vs_paper_sglang()),
        versus("paper Marconi", &|f| f.vs_paper_marconi()),
    ];
    // On the jittered copies' mean: the cells that fail there, and how many of the cells that
    // fail on their own trace fail there too (the rest are within the chaos of one trace).
    let judged: Vec<(&CellFigures, &CellFigures)> = rows
        .iter()
        .filter_map(|r| r.copies.as_ref().map(|c| (&r.figures, c)))
        .collect();
    if !judged.is_empty() {
        let tally = Tally::of(
            judged
                .iter()
                .map(|(_, c)| (Figures::from(*c), c.capacity_bytes)),
        );
        let (failing, [below_lru, below_sglang, below_paper]) = (tally.failing, tally.below);
        lines.push(format!(
            "  on the jittered copies' mean ({} cells): fail {failing} (below lru: {below_lru}, below SGLang+: {below_sglang}, below paper Marconi: {below_paper}); of the {} failing here, {} fail on their copies' mean too; mean − lru {:+.4}",
            judged.len(),
            judged.iter().filter(|(f, _)| !f.passes()).count(),
            judged.iter().filter(|(f, c)| !f.passes() && !c.passes()).count(),
            judged.iter().map(|(_, c)| c.vs_lru()).sum::<f64>() / judged.len() as f64,
        ));
    }
    lines
}
