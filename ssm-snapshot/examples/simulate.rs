//! Trace-driven simulator of the checkpoint store: replays a Marconi-format JSONL trace under a
//! policy and prints one JSON object of figures as its last line, or generates a synthetic trace.
//!
//! ```text
//! cargo run --release -p ssm-snapshot --example simulate -- --help
//! simulate --trace FILE --capacity-bytes N --policy {vllm,lru,marconi} [store and tuning options]
//! simulate --trace FILE --capacity-bytes N --policy {paper-sglang,paper-marconi} [--alpha A]
//! simulate --generate KIND [--sessions N] [--seed S] --out FILE
//! ```
//!
//! `paper-sglang` and `paper-marconi` replay the trace through [`ssm_snapshot::paper`], our model
//! of the Marconi artifact's own simulator (SGLang+ = its V1; Marconi = its V2 with the bootstrap
//! replay tuning α, or V3 with `--alpha A` fixed; `--bootstrap-multiplier` [15] sets the window).
//! They are references to score our policies against: block size 1 only, and the artifact checks
//! capacity only before inserting, so `max_bytes` may exceed `capacity_bytes` (reported, not an
//! error).
//!
//! The tuning options (`--tuning`, `--grid`, `--window`, `--cooldown`, `--margin`,
//! `--objective`) and the initial setting (`--recency`, `--flop-basis`, `--guard`) apply to
//! `marconi`, and `--tuner-events` prints the tuner's every decision (trials begun, led and
//! ended, switches, each with why) before the report; `--help` gives each one's values and
//! default. A flag that does not apply to the
//! chosen policy is refused, naming it.
#![forbid(unsafe_code)]

// Its `progress` serves the grids' long runs; this example reports only when done.
#[allow(dead_code)]
mod common;

use std::fs::File;
use std::io::{self, BufWriter};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::{Parser, ValueEnum};

use ssm_snapshot::paper::{PaperCache, PaperConfig, PaperVersion};
use ssm_snapshot::sim::{
    generate, read_trace_file, write_trace, Policy, SimConfig, Simulation, TraceKind,
};
use ssm_snapshot::tuning::{
    default_grid, grid, grid_of, legacy_grid, DEFAULT_ALPHAS, DEFAULT_COOLDOWN, DEFAULT_HALF_LIFE,
    DEFAULT_MARGIN,
};
use ssm_snapshot::{CostModel, FlopBasis, Objective, PinScope, Recency, SnapshotError, TuningMode};

/// What the long help says before the options.
const LONG_ABOUT: &str = "\
Trace-driven simulator of the SSM checkpoint store: replays a Marconi-format JSONL trace under a
policy and prints one JSON object of figures as its last line, or writes a synthetic trace.

  simulate --trace FILE --capacity-bytes N --policy {vllm,lru,marconi} [store and tuning options]
  simulate --trace FILE --capacity-bytes N --policy {paper-sglang,paper-marconi} [--alpha A]
           [--bootstrap-multiplier M]
  simulate --generate KIND [--sessions N] [--seed S] --out FILE

paper-sglang and paper-marconi replay the trace through our model of the Marconi artifact's own
simulator (block size 1 only; max_bytes may exceed capacity_bytes, as in the artifact).";

/// `simulate [OPTIONS]`.
#[derive(Debug, Parser)]
#[command(name = "simulate", version, about, long_about = LONG_ABOUT)]
struct Args {
    /// A Marconi-format JSONL trace to replay
    #[arg(long, value_name = "FILE", required_unless_present = "generate")]
    trace: Option<PathBuf>,

    /// Bytes for SSM checkpoints plus KV: an integer or exact scientific notation (2e10), at
    /// least 1
    #[arg(long, value_name = "BYTES", value_parser = byte_count, required_unless_present = "generate")]
    capacity_bytes: Option<u64>,

    /// The policy: vllm (checkpoint every block, LRU), lru (Marconi admission, SGLang+ eviction),
    /// marconi (Marconi admission, FLOP-aware eviction, tuned), paper-sglang or paper-marconi
    /// (the artifact's simulator as modelled by `ssm_snapshot::paper`)
    #[arg(long, value_name = "POLICY", value_parser = sim_policy, required_unless_present = "generate")]
    policy: Option<SimPolicy>,

    /// Tokens per block (1: token granularity, as in the paper) [default: 1]
    #[arg(long, value_name = "B", value_parser = clap::value_parser!(u32).range(1..))]
    block_size: Option<u32>,

    /// The model whose costs the simulation uses: a built-in name (an unknown name lists them)
    #[arg(long, value_name = "NAME", default_value = "nvidia-hybrid-7b", value_parser = common::cost_model)]
    model: CostModel,

    /// A fixed eviction weight α (marconi, paper-marconi), instead of tuning
    #[arg(long, value_name = "A", value_parser = non_negative, allow_negative_numbers = true)]
    alpha: Option<f64>,

    /// paper-marconi without --alpha: the bootstrap window as a multiple of the requests before
    /// the first eviction [default: 15]
    #[arg(long, value_name = "M", value_parser = clap::value_parser!(u64).range(1..))]
    bootstrap_multiplier: Option<u64>,

    /// marconi: how α (and the rest of the setting) is tuned [default: shadow]
    #[arg(long, value_enum, value_name = "MODE")]
    tuning: Option<Tuning>,

    /// marconi: the settings the tuner tries [default: default]
    #[arg(long, value_enum, value_name = "GRID")]
    grid: Option<GridName>,

    /// marconi: shadow half-life in requests [default: 200], or the periodic window [default: 100]
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    window: Option<u64>,

    /// marconi with shadow tuning: requests between two switches, and before the first
    /// [default: 300]
    #[arg(long, value_name = "N")]
    cooldown: Option<usize>,

    /// marconi with shadow tuning: the lead a shadow needs over the live setting to take over
    /// [default: 0.02]
    #[arg(long, value_name = "F", value_parser = non_negative, allow_negative_numbers = true)]
    margin: Option<f64>,

    /// marconi with tuning: what the replays maximise [default: flops]
    #[arg(long, value_enum, value_name = "WHAT")]
    objective: Option<ObjectiveName>,

    /// marconi: the recency term's time basis (initial setting) [default: path]
    #[arg(long, value_enum, value_name = "BASIS")]
    recency: Option<RecencyName>,

    /// marconi: what FLOPs saved means (initial setting) [default: marginal]
    #[arg(long, value_enum, value_name = "BASIS")]
    flop_basis: Option<FlopBasisName>,

    /// marconi: guarded admission against thrashing (initial setting) [default: off]
    #[arg(long, value_enum, value_name = "ON_OFF")]
    guard: Option<OnOff>,

    /// The store's policies: which checkpoints a running request's pin holds (every one on its
    /// hit path, or only the hit one; `ssm_snapshot::PinScope`) [default: path]
    #[arg(long, value_name = "SCOPE", value_parser = common::pin_scope)]
    pin_scope: Option<PinScope>,

    /// marconi: print every decision of the tuner (trials begun, led and ended, switches and
    /// why), one line each, before the report
    #[arg(long)]
    tuner_events: bool,

    /// Write a synthetic trace of this kind (chat, sharegpt, agentic) instead of simulating
    #[arg(long, value_name = "KIND", value_parser = trace_kind, requires = "out", conflicts_with_all = STORE_FLAGS)]
    generate: Option<TraceKind>,

    /// --generate: sessions to generate
    #[arg(long, value_name = "N", default_value_t = 100, requires = "generate", value_parser = clap::value_parser!(u64).range(1..))]
    sessions: u64,

    /// --generate: the generator's seed
    #[arg(long, value_name = "S", default_value_t = 0, requires = "generate")]
    seed: u64,

    /// --generate: the JSONL file to write
    #[arg(long, value_name = "FILE", requires = "generate")]
    out: Option<PathBuf>,
}

/// The flags of a simulation, which `--generate` does not take.
const STORE_FLAGS: [&str; 17] = [
    "trace",
    "capacity_bytes",
    "policy",
    "block_size",
    "alpha",
    "bootstrap_multiplier",
    "tuning",
    "grid",
    "window",
    "cooldown",
    "margin",
    "objective",
    "recency",
    "flop_basis",
    "guard",
    "pin_scope",
    "tuner_events",
];

/// `--policy`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SimPolicy {
    /// One of the store's policies.
    Store(Policy),
    /// The artifact's SGLang+ (V1).
    PaperSglang,
    /// The artifact's Marconi (V2, or V3 with a fixed α).
    PaperMarconi,
}

impl SimPolicy {
    fn name(self) -> &'static str {
        match self {
            SimPolicy::Store(policy) => policy.name(),
            SimPolicy::PaperSglang => "paper-sglang",
            SimPolicy::PaperMarconi => "paper-marconi",
        }
    }
}

fn sim_policy(text: &str) -> Result<SimPolicy, String> {
    match text {
        "paper-sglang" => Ok(SimPolicy::PaperSglang),
        "paper-marconi" => Ok(SimPolicy::PaperMarconi),
        other => Policy::parse(other)
            .map(SimPolicy::Store)
            .map_err(|_| "expected vllm, lru, marconi, paper-sglang or paper-marconi".to_owned()),
    }
}

fn trace_kind(text: &str) -> Result<TraceKind, String> {
    TraceKind::parse(text).map_err(|err| err.to_string())
}

fn non_negative(text: &str) -> Result<f64, String> {
    let value: f64 = text.parse().map_err(|err| format!("{err}"))?;
    if value.is_finite() && value >= 0.0 {
        Ok(value)
    } else {
        Err("must be a finite number at least 0".to_owned())
    }
}

/// A `--capacity-bytes` value: a plain integer or exact scientific notation (`2e10`), at least 1.
fn byte_count(capacity: &str) -> Result<u64, String> {
    let bytes = capacity
        .parse::<u64>()
        .ok()
        .or_else(|| {
            capacity
                .parse::<f64>()
                .ok()
                .filter(|v| v.fract() == 0.0 && *v >= 0.0 && *v < 1.8e19)
                .map(|v| v as u64)
        })
        .ok_or_else(|| {
            "not a byte count (an integer, or exact scientific notation like 2e10)".to_owned()
        })?;
    if bytes == 0 {
        return Err("a cache of 0 bytes holds nothing; give at least 1".to_owned());
    }
    Ok(bytes)
}

/// `--tuning`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Tuning {
    /// Shadow stores over the grid follow the leader (the default)
    Shadow,
    /// Retune every window on the last window's requests
    Periodic,
    /// Tune once, after the first eviction (the paper's bootstrap)
    Bootstrap,
}

/// `--grid`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum GridName {
    /// The measured default grid
    Default,
    /// The grid before guarded admission
    Legacy,
    /// α only, path recency and prefix FLOPs (the paper's grid)
    Paper,
    /// Every α, recency, FLOP basis and guard combination
    Wide,
    /// The default grid without guarded admission (to measure what the guard does)
    NoGuard,
    /// The default grid with path recency instead of adaptive (to measure what adaptive
    /// recency does)
    PathRecency,
}

/// `--objective`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum ObjectiveName {
    /// FLOPs saved by hits (Marconi)
    Flops,
    /// Tokens reused (the token hit rate)
    Tokens,
}

/// `--recency`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum RecencyName {
    Path,
    Own,
    Shared,
    Adaptive,
}

/// `--flop-basis`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum FlopBasisName {
    Marginal,
    Prefix,
}

/// `--guard`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum OnOff {
    Off,
    On,
}

fn main() -> ExitCode {
    let args = Args::parse();
    match run(&args) {
        Ok(lines) => match common::write_lines(io::stdout().lock(), &lines) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("simulate: writing the report: {e}");
                ExitCode::FAILURE
            }
        },
        Err(e) => {
            eprintln!("simulate: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Refuses each flag of `flags` that was given, naming it: `--NAME <why>`.
fn refuse(flags: &[(&str, bool)], why: &str) -> Result<(), SnapshotError> {
    match flags.iter().find(|(_, given)| *given) {
        Some((name, _)) => Err(SnapshotError::BadArgument(format!("--{name} {why}"))),
        None => Ok(()),
    }
}

fn io_error(path: &Path) -> impl Fn(std::io::Error) -> SnapshotError + '_ {
    move |e| SnapshotError::Io {
        path: path.display().to_string(),
        message: e.to_string(),
    }
}

/// `--policy paper-sglang` or `paper-marconi`: the artifact's simulator as modelled by
/// `ssm_snapshot::paper`, with the same last-line report.
fn run_paper(
    args: &Args,
    policy: SimPolicy,
    trace: &Path,
    capacity_bytes: u64,
) -> Result<Vec<String>, SnapshotError> {
    let why = format!("does not apply to --policy {}", policy.name());
    refuse(
        &[
            ("tuning", args.tuning.is_some()),
            ("grid", args.grid.is_some()),
            ("window", args.window.is_some()),
            ("cooldown", args.cooldown.is_some()),
            ("margin", args.margin.is_some()),
            ("objective", args.objective.is_some()),
            ("recency", args.recency.is_some()),
            ("flop-basis", args.flop_basis.is_some()),
            ("guard", args.guard.is_some()),
            ("pin-scope", args.pin_scope.is_some()),
            ("tuner-events", args.tuner_events),
        ],
        &why,
    )?;
    let version = match (policy, args.alpha, args.bootstrap_multiplier) {
        (SimPolicy::PaperSglang, Some(alpha), _) => {
            return Err(SnapshotError::BadArgument(format!(
                "--alpha {alpha} applies only to --policy paper-marconi or marconi"
            )))
        }
        (SimPolicy::PaperSglang, None, Some(_)) | (SimPolicy::PaperMarconi, Some(_), Some(_)) => {
            return Err(SnapshotError::BadArgument(
                "--bootstrap-multiplier applies only to --policy paper-marconi without --alpha"
                    .into(),
            ))
        }
        (SimPolicy::PaperSglang, None, None) => PaperVersion::SglangPlus,
        (_, Some(alpha), _) => PaperVersion::FixedAlpha(alpha),
        (_, None, _) => PaperVersion::Marconi,
    };
    let mut config = PaperConfig::new(version, capacity_bytes, args.model.clone());
    config.block_size = args.block_size.unwrap_or(1);
    if let Some(multiplier) = args.bootstrap_multiplier {
        config.bootstrap_multiplier = multiplier;
    }
    let mut cache = PaperCache::new(config)?;
    read_trace_file(trace, |record| {
        cache.serve(&record.input_tokens, &record.output_tokens);
        Ok(())
    })?;
    let mut lines = vec![
        match (cache.first_eviction_requests(), cache.bootstrap_window()) {
            (Some(first), Some(window)) => {
                format!("first eviction at request {first}, bootstrap window {window}")
            }
            _ => "no eviction".to_string(),
        },
    ];
    if let Some(tuning) = cache.tuning() {
        let saved: Vec<String> = tuning
            .flops_saved
            .iter()
            .enumerate()
            .map(|(i, flops)| format!("{}:{flops:.4e}", f64::from(i as u32) / 10.0))
            .collect();
        lines.push(format!(
            "bootstrap at request {} ({} calls replayed) chose alpha {}; replay FLOPs saved (alpha:flops): {}",
            tuning.at_request,
            tuning.calls_replayed,
            tuning.alpha,
            saved.join(" ")
        ));
    }
    let stats = cache.stats();
    lines.push(format!(
        "evictions {}, evicted leaves {}, merged nodes {}, splits {}, quirk appends {} ({} hit tokens), max_bytes/capacity {:.4}",
        stats.evictions,
        stats.evicted_leaves,
        stats.merged_nodes,
        stats.splits,
        stats.quirk_appends,
        stats.quirk_hit_tokens,
        cache.max_bytes() as f64 / capacity_bytes.max(1) as f64
    ));
    let line = serde_json::to_string(&cache.report(policy.name()))
        .map_err(|e| SnapshotError::Internal(e.to_string()))?;
    lines.push(line);
    Ok(lines)
}

/// `--generate KIND --out FILE`.
fn run_generate(kind: TraceKind, args: &Args, out: &Path) -> Result<Vec<String>, SnapshotError> {
    let sessions = usize::try_from(args.sessions).map_err(|_| {
        SnapshotError::BadArgument(format!("--sessions {} is too many", args.sessions))
    })?;
    let records = generate(kind, sessions, args.seed);
    let file = File::create(out).map_err(io_error(out))?;
    write_trace(BufWriter::new(file), &records).map_err(io_error(out))?;
    let tokens: usize = records.iter().map(|r| r.num_input_tokens).sum();
    Ok(vec![format!(
        "wrote {} requests ({tokens} input tokens) to {}",
        records.len(),
        out.display()
    )])
}

/// Runs what `args` ask for and returns the report's lines.
fn run(args: &Args) -> Result<Vec<String>, SnapshotError> {
    if let Some(kind) = args.generate {
        // clap makes `--out` required with `--generate`.
        let out = args
            .out
            .as_deref()
            .ok_or_else(|| SnapshotError::BadArgument("--generate needs --out FILE".into()))?;
        return run_generate(kind, args, out);
    }
    // clap makes these required without `--generate`.
    let (Some(trace), Some(capacity_bytes), Some(policy)) =
        (args.trace.as_deref(), args.capacity_bytes, args.policy)
    else {
        return Err(SnapshotError::BadArgument(
            "--trace, --capacity-bytes and --policy are required".into(),
        ));
    };
    let policy = match policy {
        SimPolicy::Store(policy) => policy,
        paper => return run_paper(args, paper, trace, capacity_bytes),
    };
    refuse(
        &[("bootstrap-multiplier", args.bootstrap_multiplier.is_some())],
        "applies only to --policy paper-marconi",
    )?;
    if policy != Policy::Marconi {
        refuse(
            &[("tuner-events", args.tuner_events)],
            "applies only to --policy marconi",
        )?;
    }
    let block_size = args.block_size.unwrap_or(1);
    let mut config = SimConfig::new(policy, capacity_bytes, block_size, args.model.clone());
    config.pin_scope = args.pin_scope.unwrap_or_default();
    config.alpha = args.alpha;
    if let Some(alpha) = config.alpha {
        if policy != Policy::Marconi {
            return Err(SnapshotError::BadArgument(format!(
                "--alpha {alpha} applies only to --policy marconi"
            )));
        }
    }
    let grid = match args.grid.unwrap_or(GridName::Default) {
        GridName::Default => default_grid(),
        GridName::Legacy => legacy_grid(),
        GridName::Paper => grid(&[Recency::Path], &[FlopBasis::Prefix]),
        GridName::Wide => grid_of(
            DEFAULT_ALPHAS,
            &[
                Recency::Path,
                Recency::Own,
                Recency::Shared,
                Recency::Adaptive,
            ],
            &[FlopBasis::Prefix, FlopBasis::Marginal],
            &[false, true],
        ),
        GridName::NoGuard => grid_of(
            DEFAULT_ALPHAS,
            &[Recency::Adaptive],
            &[FlopBasis::Prefix, FlopBasis::Marginal],
            &[false],
        ),
        GridName::PathRecency => grid_of(
            DEFAULT_ALPHAS,
            &[Recency::Path],
            &[FlopBasis::Prefix, FlopBasis::Marginal],
            &[false, true],
        ),
    };
    let window = args
        .window
        .map(|window| {
            usize::try_from(window)
                .map_err(|_| SnapshotError::BadArgument(format!("--window {window} is too long")))
        })
        .transpose()?;
    config.tuning = match args.tuning.unwrap_or(Tuning::Shadow) {
        Tuning::Shadow => TuningMode::Shadow {
            grid,
            half_life: window.unwrap_or(DEFAULT_HALF_LIFE),
            margin: args.margin.unwrap_or(DEFAULT_MARGIN),
            cooldown: args.cooldown.unwrap_or(DEFAULT_COOLDOWN),
        },
        Tuning::Periodic => TuningMode::Periodic {
            grid,
            window: window.unwrap_or(100),
        },
        Tuning::Bootstrap => TuningMode::Bootstrap {
            grid,
            window_factor: 3,
        },
    };
    config.flop_basis = match args.flop_basis.unwrap_or(FlopBasisName::Marginal) {
        FlopBasisName::Marginal => FlopBasis::Marginal,
        FlopBasisName::Prefix => FlopBasis::Prefix,
    };
    config.recency = match args.recency.unwrap_or(RecencyName::Path) {
        RecencyName::Path => Recency::Path,
        RecencyName::Own => Recency::Own,
        RecencyName::Shared => Recency::Shared,
        RecencyName::Adaptive => Recency::Adaptive,
    };
    config.guard = args.guard == Some(OnOff::On);
    config.objective = match args.objective.unwrap_or(ObjectiveName::Flops) {
        ObjectiveName::Flops => Objective::Flops,
        ObjectiveName::Tokens => Objective::HitTokens,
    };

    let mut sim = Simulation::new(config)?;
    let mut lines = Vec::new();
    // The tuner keeps only its latest events: take each request's as they come.
    let mut logged = 0;
    read_trace_file(trace, |record| {
        sim.step(&record)?;
        if args.tuner_events {
            let tuner = sim.tuner();
            let new = usize::try_from(tuner.events_logged() - logged).unwrap_or(usize::MAX);
            let skip = tuner.events().len().saturating_sub(new);
            lines.extend(tuner.events().skip(skip).map(ToString::to_string));
            logged = tuner.events_logged();
        }
        Ok(())
    })?;
    let history = sim.tuner().history().to_vec();
    if !history.is_empty() {
        let text: Vec<String> = history.iter().map(|(at, s)| format!("{at}:{s}")).collect();
        lines.push(format!("tuning (request:setting): {}", text.join(" ")));
    }
    let shadows = sim.tuner().shadow_hit_tokens();
    if !shadows.is_empty() {
        let text: Vec<String> = shadows
            .iter()
            .map(|(s, hits)| format!("{s}:{hits}"))
            .collect();
        lines.push(format!(
            "shadow hit tokens (setting:tokens): {}",
            text.join(" ")
        ));
    }
    let stats = sim.store().stats();
    lines.push(format!(
        "hits {} (mid-sequence {}), evicted leaves {}, checkpoint-only evictions {}, checkpoints admitted {}, dropped {}",
        stats.hits,
        stats.mid_hits,
        stats.evicted_leaves,
        stats.evicted_checkpoints_only,
        stats.admitted_checkpoints,
        stats.dropped_checkpoints
    ));
    let report = sim.finish()?;
    let line =
        serde_json::to_string(&report).map_err(|e| SnapshotError::Internal(e.to_string()))?;
    lines.push(line);
    Ok(lines)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The first line of the error clap gives for `args`.
    fn error(args: &[&str]) -> String {
        let err = Args::try_parse_from(std::iter::once("simulate").chain(args.iter().copied()))
            .expect_err("expected a usage error");
        err.to_string()
            .lines()
            .next()
            .unwrap_or_default()
            .to_owned()
    }

    #[test]
    fn bad_values_are_refused_naming_the_flag() {
        let base = ["--trace", "t.jsonl", "--policy", "marconi"];
        let with = |extra: &[&'static str]| -> Vec<&'static str> {
            base.iter().copied().chain(extra.iter().copied()).collect()
        };
        assert_eq!(
            error(&with(&["--capacity-bytes", "0"])),
            "error: invalid value '0' for '--capacity-bytes <BYTES>': a cache of 0 bytes holds nothing; give at least 1"
        );
        assert_eq!(
            error(&with(&["--capacity-bytes", "lots"])),
            "error: invalid value 'lots' for '--capacity-bytes <BYTES>': not a byte count (an integer, or exact scientific notation like 2e10)"
        );
        assert_eq!(
            error(&["--trace", "t", "--capacity-bytes", "1e9", "--policy", "fifo"]),
            "error: invalid value 'fifo' for '--policy <POLICY>': expected vllm, lru, marconi, paper-sglang or paper-marconi"
        );
        assert_eq!(
            error(&with(&["--capacity-bytes", "1e9", "--block-size", "0"])),
            "error: invalid value '0' for '--block-size <B>': 0 is not in 1..=4294967295"
        );
        assert_eq!(
            error(&with(&["--capacity-bytes", "1e9", "--alpha", "-1"])),
            "error: invalid value '-1' for '--alpha <A>': must be a finite number at least 0"
        );
        assert_eq!(
            error(&["--generate", "chat", "--out", "x", "--policy", "lru"]),
            "error: the argument '--generate <KIND>' cannot be used with '--policy <POLICY>'"
        );
        assert_eq!(
            error(&["--generate", "chat"]),
            "error: the following required arguments were not provided:"
        );
        assert_eq!(
            error(&with(&["--capacity-bytes", "1e9", "--sessions", "3"])),
            "error: the following required arguments were not provided:"
        );
    }

    #[test]
    fn flags_outside_the_policy_are_named() {
        let parse = |args: &[&str]| {
            Args::try_parse_from(std::iter::once("simulate").chain(args.iter().copied())).unwrap()
        };
        let paper = parse(&[
            "--trace",
            "/no/such/trace",
            "--capacity-bytes",
            "2e10",
            "--policy",
            "paper-sglang",
            "--grid",
            "wide",
        ]);
        assert_eq!(
            run(&paper).unwrap_err().to_string(),
            "bad argument: --grid does not apply to --policy paper-sglang"
        );
        let lru = parse(&[
            "--trace",
            "/no/such/trace",
            "--capacity-bytes",
            "2e10",
            "--policy",
            "lru",
            "--alpha",
            "1",
        ]);
        assert_eq!(
            run(&lru).unwrap_err().to_string(),
            "bad argument: --alpha 1 applies only to --policy marconi"
        );
        let store = |policy: &str| {
            let args = parse(&[
                "--trace",
                "/no/such/trace",
                "--capacity-bytes",
                "2e10",
                "--policy",
                policy,
                "--tuner-events",
            ]);
            run(&args).unwrap_err().to_string()
        };
        assert_eq!(
            store("lru"),
            "bad argument: --tuner-events applies only to --policy marconi"
        );
        assert_eq!(
            store("paper-marconi"),
            "bad argument: --tuner-events does not apply to --policy paper-marconi"
        );
        // With marconi it is taken, and the trace is the next thing wrong.
        assert!(
            store("marconi").starts_with("/no/such/trace: "),
            "{}",
            store("marconi")
        );
    }

    #[test]
    fn clap_definition_is_consistent() {
        use clap::CommandFactory;
        Args::command().debug_assert();
    }
}
