//! Trace-driven simulator of the checkpoint store: replays a Marconi-format JSONL trace under a
//! policy and prints one JSON object of figures as its last line, or generates a synthetic trace.
//!
//! ```text
//! simulate --trace FILE --capacity-bytes N --policy {vllm,lru,marconi}
//!          [--block-size B] [--model nvidia-hybrid-7b] [--alpha A]
//! simulate --trace FILE --capacity-bytes N --policy {paper-sglang,paper-marconi}
//!          [--model nvidia-hybrid-7b] [--alpha A] [--bootstrap-multiplier M]
//! simulate --generate {chat,sharegpt,agentic} --sessions N --seed S --out FILE
//! ```
//!
//! `paper-sglang` and `paper-marconi` replay the trace through [`ssm_snapshot::paper`], our model
//! of the Marconi artifact's own simulator (SGLang+ = its V1; Marconi = its V2 with the bootstrap
//! replay tuning α, or V3 with `--alpha A` fixed; `--bootstrap-multiplier` [15] sets the window).
//! They are references to score our policies against: block size 1 only, and the artifact checks
//! capacity only before inserting, so `max_bytes` may exceed `capacity_bytes` (reported, not an
//! error).
//!
//! Tuning options for `marconi` (defaults in brackets; `--alpha` fixes α and disables tuning):
//! `--tuning {shadow,periodic,bootstrap}` [shadow], `--grid {default,legacy,paper,wide}`
//! [default], `--window N` (shadow half-life [200] or periodic window [100]), `--cooldown N` [300],
//! `--margin F` [0.02], `--objective {flops,tokens}` [flops]; the initial setting:
//! `--recency {path,own,shared,adaptive}` [adaptive], `--flop-basis {marginal,prefix}`
//! [marginal], `--guard {off,on}` (guarded admission) [off].
#![forbid(unsafe_code)]

use std::collections::HashMap;
use std::fs::File;
use std::io::{BufReader, BufWriter};
use std::process::ExitCode;

use ssm_snapshot::paper::{PaperCache, PaperConfig, PaperVersion};
use ssm_snapshot::sim::{
    generate, read_trace, write_trace, Policy, SimConfig, Simulation, TraceKind,
};
use ssm_snapshot::tuning::{
    default_grid, grid, grid_of, legacy_grid, DEFAULT_ALPHAS, DEFAULT_COOLDOWN, DEFAULT_HALF_LIFE,
    DEFAULT_MARGIN,
};
use ssm_snapshot::{CostModel, FlopBasis, Objective, Recency, Setting, SnapshotError, TuningMode};

const USAGE: &str = "usage:
  simulate --trace FILE --capacity-bytes N --policy {vllm,lru,marconi} [--block-size B] \
[--model nvidia-hybrid-7b] [--alpha A] [--tuning {shadow,periodic,bootstrap}] \
[--grid {default,legacy,paper,wide}] [--window N] [--cooldown N] [--margin F] \
[--objective {flops,tokens}] [--recency {path,own,shared,adaptive}] \
[--flop-basis {marginal,prefix}] [--guard {off,on}]
  simulate --trace FILE --capacity-bytes N --policy {paper-sglang,paper-marconi} \
[--model nvidia-hybrid-7b] [--alpha A] [--bootstrap-multiplier M]
  simulate --generate {chat,sharegpt,agentic} --sessions N --seed S --out FILE";

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}\n{USAGE}");
            ExitCode::FAILURE
        }
    }
}

/// `--flag value` pairs; every flag takes exactly one value.
fn parse_flags() -> Result<HashMap<String, String>, SnapshotError> {
    let mut flags = HashMap::new();
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let Some(name) = flag.strip_prefix("--") else {
            return Err(SnapshotError::BadArgument(format!(
                "`{flag}` is not a --flag"
            )));
        };
        let value = args
            .next()
            .ok_or_else(|| SnapshotError::BadArgument(format!("{flag} needs a value")))?;
        if flags.insert(name.to_owned(), value).is_some() {
            return Err(SnapshotError::BadArgument(format!("{flag} given twice")));
        }
    }
    Ok(flags)
}

fn number<T: std::str::FromStr>(
    flags: &HashMap<String, String>,
    name: &str,
) -> Result<Option<T>, SnapshotError> {
    flags
        .get(name)
        .map(|text| {
            text.parse::<T>().map_err(|_| {
                SnapshotError::BadArgument(format!("--{name} `{text}` is not a valid number"))
            })
        })
        .transpose()
}

fn required<'a>(flags: &'a HashMap<String, String>, name: &str) -> Result<&'a str, SnapshotError> {
    flags
        .get(name)
        .map(String::as_str)
        .ok_or_else(|| SnapshotError::BadArgument(format!("--{name} is required")))
}

/// Refuses a flag outside `known`, naming it: `--NAME <why>`.
fn only(flags: &HashMap<String, String>, known: &[&str], why: &str) -> Result<(), SnapshotError> {
    match flags.keys().find(|k| !known.contains(&k.as_str())) {
        Some(extra) => Err(SnapshotError::BadArgument(format!("--{extra} {why}"))),
        None => Ok(()),
    }
}

/// The value of enumerated flag `--name` (`default` when absent); an unknown value is named
/// with the accepted ones.
fn choice<T: Copy>(
    flags: &HashMap<String, String>,
    name: &str,
    default: T,
    options: &[(&str, T)],
) -> Result<T, SnapshotError> {
    let Some(given) = flags.get(name) else {
        return Ok(default);
    };
    options
        .iter()
        .find(|(text, _)| text == given)
        .map(|&(_, value)| value)
        .ok_or_else(|| {
            let accepted: Vec<&str> = options.iter().map(|(text, _)| *text).collect();
            SnapshotError::BadArgument(format!(
                "--{name} `{given}` (expected {})",
                accepted.join(", ")
            ))
        })
}

/// A tuning setting as `alpha/recency/basis[/guard]`.
fn label(s: &Setting) -> String {
    let guard = if s.guard { "/guard" } else { "" };
    format!("{}/{:?}/{:?}{guard}", s.alpha, s.recency, s.flop_basis)
}

fn io_error(path: &str) -> impl Fn(std::io::Error) -> SnapshotError + '_ {
    move |e| SnapshotError::Io {
        path: path.to_owned(),
        message: e.to_string(),
    }
}

/// A `--capacity-bytes` value: a plain integer or exact scientific notation (`2e10`).
fn byte_count(capacity: &str) -> Result<u64, SnapshotError> {
    capacity
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
            SnapshotError::BadArgument(format!("--capacity-bytes `{capacity}` is not a byte count"))
        })
}

/// `--policy paper-sglang` or `paper-marconi`: the artifact's simulator as modelled by
/// `ssm_snapshot::paper`, with the same last-line report.
fn run_paper(flags: &HashMap<String, String>, policy: &str) -> Result<(), SnapshotError> {
    let known = [
        "trace",
        "capacity-bytes",
        "policy",
        "block-size",
        "model",
        "alpha",
        "bootstrap-multiplier",
    ];
    only(
        flags,
        &known,
        &format!("does not apply to --policy {policy}"),
    )?;
    let trace = required(flags, "trace")?;
    let capacity_bytes = byte_count(required(flags, "capacity-bytes")?)?;
    let cost = CostModel::by_name(
        flags
            .get("model")
            .map_or("nvidia-hybrid-7b", String::as_str),
    )?;
    let alpha: Option<f64> = number(flags, "alpha")?;
    let multiplier: Option<u64> = number(flags, "bootstrap-multiplier")?;
    let version = match (policy, alpha, multiplier) {
        ("paper-sglang", Some(alpha), _) => {
            return Err(SnapshotError::BadArgument(format!(
                "--alpha {alpha} applies only to --policy paper-marconi or marconi"
            )))
        }
        ("paper-sglang", None, Some(_)) | ("paper-marconi", Some(_), Some(_)) => {
            return Err(SnapshotError::BadArgument(
                "--bootstrap-multiplier applies only to --policy paper-marconi without --alpha"
                    .into(),
            ))
        }
        ("paper-sglang", None, None) => PaperVersion::SglangPlus,
        (_, Some(alpha), _) => PaperVersion::FixedAlpha(alpha),
        (_, None, _) => PaperVersion::Marconi,
    };
    let mut config = PaperConfig::new(version, capacity_bytes, cost);
    config.block_size = number(flags, "block-size")?.unwrap_or(1);
    if let Some(multiplier) = multiplier {
        config.bootstrap_multiplier = multiplier;
    }
    let mut cache = PaperCache::new(config)?;
    let file = File::open(trace).map_err(io_error(trace))?;
    read_trace(BufReader::new(file), |record| {
        cache.serve(&record.input_tokens, &record.output_tokens);
        Ok(())
    })?;
    match (cache.first_eviction_requests(), cache.bootstrap_window()) {
        (Some(first), Some(window)) => {
            println!("first eviction at request {first}, bootstrap window {window}")
        }
        _ => println!("no eviction"),
    }
    if let Some(tuning) = cache.tuning() {
        let saved: Vec<String> = tuning
            .flops_saved
            .iter()
            .enumerate()
            .map(|(i, flops)| format!("{}:{flops:.4e}", f64::from(i as u32) / 10.0))
            .collect();
        println!(
            "bootstrap at request {} ({} calls replayed) chose alpha {}; replay FLOPs saved (alpha:flops): {}",
            tuning.at_request,
            tuning.calls_replayed,
            tuning.alpha,
            saved.join(" ")
        );
    }
    let stats = cache.stats();
    println!(
        "evictions {}, evicted leaves {}, merged nodes {}, splits {}, quirk appends {} ({} hit tokens), max_bytes/capacity {:.4}",
        stats.evictions,
        stats.evicted_leaves,
        stats.merged_nodes,
        stats.splits,
        stats.quirk_appends,
        stats.quirk_hit_tokens,
        cache.max_bytes() as f64 / capacity_bytes.max(1) as f64
    );
    let line = serde_json::to_string(&cache.report(policy))
        .map_err(|e| SnapshotError::Internal(e.to_string()))?;
    println!("{line}");
    Ok(())
}

fn run() -> Result<(), SnapshotError> {
    let flags = parse_flags()?;
    if let Some(kind) = flags.get("generate") {
        let known = ["generate", "sessions", "seed", "out"];
        only(&flags, &known, "does not apply to --generate")?;
        let kind = TraceKind::parse(kind)?;
        let sessions: usize = number(&flags, "sessions")?.unwrap_or(100);
        let seed: u64 = number(&flags, "seed")?.unwrap_or(0);
        let out = required(&flags, "out")?;
        let records = generate(kind, sessions, seed);
        let file = File::create(out).map_err(io_error(out))?;
        write_trace(BufWriter::new(file), &records).map_err(io_error(out))?;
        let tokens: usize = records.iter().map(|r| r.num_input_tokens).sum();
        println!(
            "wrote {} requests ({tokens} input tokens) to {out}",
            records.len()
        );
        return Ok(());
    }
    if let Some(policy @ ("paper-sglang" | "paper-marconi")) =
        flags.get("policy").map(String::as_str)
    {
        return run_paper(&flags, policy);
    }

    let known = [
        "recency",
        "objective",
        "grid",
        "margin",
        "cooldown",
        "trace",
        "capacity-bytes",
        "policy",
        "block-size",
        "model",
        "alpha",
        "tuning",
        "window",
        "flop-basis",
        "guard",
    ];
    only(&flags, &known, "is not a flag of this command")?;
    let trace = required(&flags, "trace")?;
    let capacity_bytes = byte_count(required(&flags, "capacity-bytes")?)?;
    let policy = Policy::parse(required(&flags, "policy")?)?;
    let block_size: u32 = number(&flags, "block-size")?.unwrap_or(1);
    if block_size == 0 {
        return Err(SnapshotError::BadArgument(
            "--block-size 0 (must be at least 1)".into(),
        ));
    }
    let cost = CostModel::by_name(
        flags
            .get("model")
            .map_or("nvidia-hybrid-7b", String::as_str),
    )?;
    let mut config = SimConfig::new(policy, capacity_bytes, block_size, cost);
    config.alpha = number(&flags, "alpha")?;
    if let Some(alpha) = config.alpha {
        if policy != Policy::Marconi {
            return Err(SnapshotError::BadArgument(format!(
                "--alpha {alpha} applies only to --policy marconi"
            )));
        }
    }
    let grid = match flags.get("grid").map(String::as_str) {
        None | Some("default") => default_grid(),
        Some("legacy") => legacy_grid(),
        Some("paper") => grid(&[Recency::Path], &[FlopBasis::Prefix]),
        Some("wide") => grid_of(
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
        Some(other) => {
            return Err(SnapshotError::BadArgument(format!(
                "--grid `{other}` (expected default, legacy, paper or wide)"
            )))
        }
    };
    let window: Option<usize> = number(&flags, "window")?;
    config.tuning = match flags.get("tuning").map(String::as_str) {
        None | Some("shadow") => TuningMode::Shadow {
            grid,
            half_life: window.unwrap_or(DEFAULT_HALF_LIFE),
            margin: number(&flags, "margin")?.unwrap_or(DEFAULT_MARGIN),
            cooldown: number(&flags, "cooldown")?.unwrap_or(DEFAULT_COOLDOWN),
        },
        Some("periodic") => TuningMode::Periodic {
            grid,
            window: window.unwrap_or(100),
        },
        Some("bootstrap") => TuningMode::Bootstrap {
            grid,
            window_factor: 3,
        },
        Some(other) => {
            return Err(SnapshotError::BadArgument(format!(
                "--tuning `{other}` (expected shadow, periodic or bootstrap)"
            )))
        }
    };
    config.flop_basis = choice(
        &flags,
        "flop-basis",
        FlopBasis::Marginal,
        &[
            ("marginal", FlopBasis::Marginal),
            ("prefix", FlopBasis::Prefix),
        ],
    )?;
    config.recency = choice(
        &flags,
        "recency",
        Recency::Adaptive,
        &[
            ("path", Recency::Path),
            ("own", Recency::Own),
            ("shared", Recency::Shared),
            ("adaptive", Recency::Adaptive),
        ],
    )?;
    config.guard = choice(&flags, "guard", false, &[("off", false), ("on", true)])?;
    config.objective = choice(
        &flags,
        "objective",
        Objective::Flops,
        &[
            ("flops", Objective::Flops),
            ("tokens", Objective::HitTokens),
        ],
    )?;

    let mut sim = Simulation::new(config)?;
    let file = File::open(trace).map_err(io_error(trace))?;
    read_trace(BufReader::new(file), |record| sim.step(&record))?;
    let history = sim.tuner().history().to_vec();
    if !history.is_empty() {
        let text: Vec<String> = history
            .iter()
            .map(|(at, s)| format!("{at}:{}", label(s)))
            .collect();
        println!("tuning (request:setting): {}", text.join(" "));
    }
    let shadows = sim.tuner().shadow_hit_tokens();
    if !shadows.is_empty() {
        let text: Vec<String> = shadows
            .iter()
            .map(|(s, hits)| format!("{}:{hits}", label(s)))
            .collect();
        println!("shadow hit tokens (setting:tokens): {}", text.join(" "));
    }
    let stats = sim.store().stats();
    println!(
        "hits {} (mid-sequence {}), evicted leaves {}, checkpoint-only evictions {}, checkpoints admitted {}, dropped {}",
        stats.hits,
        stats.mid_hits,
        stats.evicted_leaves,
        stats.evicted_checkpoints_only,
        stats.admitted_checkpoints,
        stats.dropped_checkpoints
    );
    let report = sim.finish()?;
    let line =
        serde_json::to_string(&report).map_err(|e| SnapshotError::Internal(e.to_string()))?;
    println!("{line}");
    Ok(())
}
