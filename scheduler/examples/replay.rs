//! The main job: replay a multi-turn workload on the host router and report what it took.
//!
//! ```text
//! cargo run --release -p scheduler --example replay -- [options]
//!   --model DIR           a NemotronH checkpoint (config.json + model.safetensors); default: an
//!                         embedded model (seeded random weights, see `embedded_model_config`)
//!   --embedded NAME       which embedded model: `small` (default, hidden 512, 16 layers) or `mini`
//!   --workload W          a JSONL trace file (Marconi artifact format), or `chat` / `agentic`
//!                         (built-in, seeded); default `chat`
//!   --max-requests N      replay only the first N turns
//!   --no-prefix-cache     build the router without its prefix cache
//!   --no-marconi          evict SSM checkpoints by recency instead of Marconi's FLOP-aware policy
//!   --json FILE           also write the report as JSON
//!   --verify              replay twice, caches on and off, with logits digests; exit 1 unless every
//!                         turn's digest matches
//!   --preempt MODE        `recompute` (default) or `spill` (to a temporary directory)
//!   --kv-blocks N         KV blocks of 16 tokens in the pool (default: 48 per running sequence)
//!   --max-in-flight N     turns in flight at once (default 16)
//!   --seed N              seed of the built-in workloads and the embedded model (default 0)
//!   --device D            `cpu` (default) or `cuda` (needs the `cuda` feature; this build has no
//!                         CUDA router and says so)
//!   --pace SPEEDUP        hold each turn until its trace arrival time divided by SPEEDUP (default:
//!                         as fast as possible; a session's next turn always waits for the last)
//!   --trace FILE          write every plan, effect and outcome to FILE (needs `--features trace`)
//! ```

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use indicatif::{ProgressBar, ProgressStyle};
use scheduler::backend::{self, BackendOptions, Device};
use scheduler::replay::{self, Replay, ReplayOptions, ReplayReport, TurnOutcome};
use scheduler::workload::Workload;
use scheduler::{EngineConfig, Preemption, ShutdownMode, SpillTarget};

/// The embedded models (seeded random weights, built in code), by `--embedded` name.
///
/// - `small` (default): `model::Config::small_512()`, NemotronH-shaped: vocab 4096, hidden 512,
///   16 layers `MEM*MEM-MEM*MEM-` (8 Mamba2, 4 MoE, 2 attention, 2 MLP); Mamba2 16 heads of 64
///   with state 64 in 4 groups; attention 8 query / 2 KV heads of 64; MLP 2048; MoE 16 routed
///   experts of 256 (top 4) plus a shared expert of 512. About 43 M parameters. The default
///   replay takes about 25 s on two cores.
/// - `mini`: the same family at hidden 256 and 8 layers `MEM*MEM-` (about 7.6 M parameters),
///   for quick runs (about 6 s).
fn embedded_model_config(name: &str) -> Result<model::Config, String> {
    match name {
        "small" => Ok(model::Config::small_512()),
        "mini" => {
            let layer_kinds: Vec<model::LayerKind> = "MEM*MEM-"
                .chars()
                .filter_map(model::LayerKind::from_letter)
                .collect();
            Ok(model::Config {
                hidden_size: 256,
                num_hidden_layers: layer_kinds.len(),
                layer_kinds,
                mamba_num_heads: 8,
                n_groups: 2,
                num_attention_heads: 4,
                intermediate_size: 1024,
                n_routed_experts: 8,
                num_experts_per_tok: 2,
                n_group: 2,
                topk_group: 1,
                ..model::Config::small_512()
            })
        }
        other => Err(format!("--embedded {other:?}: expected small or mini")),
    }
}

#[derive(Debug)]
struct Args {
    model: Option<PathBuf>,
    embedded: String,
    workload: String,
    max_requests: Option<usize>,
    prefix_cache: bool,
    marconi: bool,
    json: Option<PathBuf>,
    verify: bool,
    spill: bool,
    kv_blocks: Option<usize>,
    max_in_flight: usize,
    seed: u64,
    device: String,
    pace: Option<f64>,
    trace: Option<PathBuf>,
}

const USAGE: &str = "usage: replay [--model DIR | --embedded small|mini] \
    [--workload FILE|chat|agentic] [--max-requests N] [--no-prefix-cache] [--no-marconi] \
    [--json FILE] [--verify] [--preempt recompute|spill] [--kv-blocks N] [--max-in-flight N] \
    [--seed N] [--device cpu|cuda] [--pace SPEEDUP] [--trace FILE]";

/// The options, or `None` when help was asked for.
fn parse_args() -> Result<Option<Args>, String> {
    let mut args = Args {
        model: None,
        embedded: "small".to_string(),
        workload: "chat".to_string(),
        max_requests: None,
        prefix_cache: true,
        marconi: true,
        json: None,
        verify: false,
        spill: false,
        kv_blocks: None,
        max_in_flight: 16,
        seed: 0,
        device: "cpu".to_string(),
        pace: None,
        trace: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = |name: &str| it.next().ok_or(format!("{name} needs a value"));
        let number = |name: &str, text: String| {
            text.parse::<u64>()
                .map_err(|err| format!("{name} {text:?}: {err}"))
        };
        match flag.as_str() {
            "--model" => args.model = Some(PathBuf::from(value("--model")?)),
            "--embedded" => args.embedded = value("--embedded")?,
            "--workload" => args.workload = value("--workload")?,
            "--max-requests" => {
                let n = number("--max-requests", value("--max-requests")?)?;
                args.max_requests = Some(n as usize);
            }
            "--no-prefix-cache" => args.prefix_cache = false,
            "--no-marconi" => args.marconi = false,
            "--json" => args.json = Some(PathBuf::from(value("--json")?)),
            "--verify" => args.verify = true,
            "--preempt" => match value("--preempt")?.as_str() {
                "recompute" => args.spill = false,
                "spill" => args.spill = true,
                other => return Err(format!("--preempt {other:?}: expected recompute or spill")),
            },
            "--kv-blocks" => {
                args.kv_blocks = Some(number("--kv-blocks", value("--kv-blocks")?)? as usize)
            }
            "--max-in-flight" => {
                let n = number("--max-in-flight", value("--max-in-flight")?)? as usize;
                if n == 0 {
                    return Err("--max-in-flight must be at least 1".to_string());
                }
                args.max_in_flight = n;
            }
            "--seed" => args.seed = number("--seed", value("--seed")?)?,
            "--device" => args.device = value("--device")?,
            "--trace" => args.trace = Some(PathBuf::from(value("--trace")?)),
            "--pace" => {
                let text = value("--pace")?;
                let speed: f64 = text
                    .parse()
                    .map_err(|err| format!("--pace {text:?}: {err}"))?;
                if !(speed.is_finite() && speed > 0.0) {
                    return Err(format!("--pace {speed}: must be a positive speed-up"));
                }
                args.pace = Some(speed);
            }
            "-h" | "--help" => return Ok(None),
            other => return Err(format!("unknown option {other:?} (try --help)")),
        }
    }
    Ok(Some(args))
}

/// One replay pass with the caches as given.
fn run_pass(
    args: &Args,
    model: &model::Model,
    workload: &Workload,
    prefix_cache: bool,
    label: &str,
    digests: bool,
) -> Result<Replay, String> {
    let block_size = 16;
    let max_seqs = args.max_in_flight;
    let longest = workload.longest_turn().max(1);
    let max_context = longest.div_ceil(block_size) * block_size;
    let kv_blocks = args
        .kv_blocks
        .unwrap_or(48 * max_seqs)
        .max(max_context / block_size);
    let options = BackendOptions {
        #[cfg(feature = "trace")]
        trace: trace_sink(args, label)?,
        device: device(&args.device)?,
        max_context,
        prefix_cache,
        marconi: args.marconi,
        ..BackendOptions::new(kv_blocks, max_seqs)
    };
    let preemption = if args.spill {
        Preemption::Spill(SpillTarget::Directory(std::env::temp_dir()))
    } else {
        Preemption::Recompute
    };
    let config = EngineConfig {
        max_running: max_seqs,
        max_step_tokens: 512,
        max_prefill_chunk: 256,
        preemption,
        ..EngineConfig::default()
    };
    let mut engine =
        backend::build_engine(model.clone(), options, config).map_err(|err| err.to_string())?;
    let bar = ProgressBar::new(workload.turns.len() as u64);
    bar.set_style(
        ProgressStyle::with_template(
            "{prefix:>12} [{elapsed_precise}] {bar:40} {pos}/{len} turns {msg}",
        )
        .map_err(|err| err.to_string())?,
    );
    bar.set_prefix(label.to_string());
    let mut failed = 0;
    let replay_options = ReplayOptions {
        max_in_flight: args.max_in_flight,
        digests,
        pace: args.pace,
    };
    let mut replay = replay::replay(&mut engine, workload, &replay_options, &mut |_, outcome| {
        if matches!(outcome, TurnOutcome::Failed(_)) {
            failed += 1;
            bar.set_message(format!("({failed} failed)"));
        }
        bar.inc(1);
    });
    bar.finish();
    replay.report.cache = backend::cache_stats(engine.router());
    engine
        .shutdown(ShutdownMode::Drain)
        .map_err(|err| format!("shutdown: {err}"))?;
    Ok(replay)
}

/// The sink for `--trace FILE` (the caches-off pass of `--verify` writes `FILE.off`).
#[cfg(feature = "trace")]
fn trace_sink(args: &Args, label: &str) -> Result<Option<device_trace::TraceSink>, String> {
    let Some(path) = &args.trace else {
        return Ok(None);
    };
    let path = if label == "caches off" && args.verify {
        path.with_extension("off")
    } else {
        path.clone()
    };
    let file =
        std::fs::File::create(&path).map_err(|err| format!("--trace {}: {err}", path.display()))?;
    Ok(Some(device_trace::TraceSink::writer(
        std::io::BufWriter::new(file),
    )))
}

fn device(name: &str) -> Result<Device, String> {
    match name {
        "cpu" => Ok(Device::Cpu),
        #[cfg(feature = "cuda")]
        "cuda" => Ok(Device::Cuda),
        #[cfg(not(feature = "cuda"))]
        "cuda" => Err("--device cuda: this build has no `cuda` feature".to_string()),
        other => Err(format!("--device {other:?}: expected cpu or cuda")),
    }
}

fn print_report(title: &str, report: &ReplayReport) {
    println!("== {title}: workload {} ==", report.workload);
    println!(
        "requests            {} ({} completed, {} failed, {} skipped)",
        report.requests, report.completed, report.failed, report.skipped
    );
    println!(
        "tokens              {} input, {} output",
        report.input_tokens, report.output_tokens
    );
    println!(
        "prefill             {} computed, {} from cache (token hit rate {:.1}%)",
        report.prefill_tokens_computed,
        report.prefill_tokens_cached,
        100.0 * report.token_hit_rate
    );
    println!(
        "cache hits          {} requests served partly from cache (each restored a Marconi checkpoint on a hybrid model); {} MarconiCheckpoint effects after decode",
        report.prefix_hits, report.marconi_checkpoint_effects
    );
    if let Some(cache) = &report.cache {
        let alpha = cache
            .marconi_alpha
            .map_or("off (LRU)".to_string(), |a| format!("{a:.2}"));
        println!(
            "router cache        {} lookups, {} hit tokens, {} checkpoints held at the end, alpha {alpha}",
            cache.lookups, cache.hit_tokens, cache.checkpoints_held
        );
        println!(
            "marconi             {} checkpoints taken, {} hit, {} evicted, {} held at the end",
            cache.checkpoints_taken,
            cache.checkpoint_hits,
            cache.checkpoints_evicted,
            cache.checkpoints_held
        );
    }
    println!(
        "TTFT                p50 {:.1} ms, p95 {:.1} ms",
        report.ttft_p50_ms, report.ttft_p95_ms
    );
    println!(
        "TPOT                p50 {:.2} ms, p95 {:.2} ms",
        report.tpot_p50_ms, report.tpot_p95_ms
    );
    println!(
        "throughput          {:.0} output tok/s, {:.0} total tok/s over {:.1} s ({} steps, mean decode batch {:.1})",
        report.output_tokens_per_s,
        report.total_tokens_per_s,
        report.wall_s,
        report.steps,
        report.mean_decode_batch
    );
    println!(
        "preemption          {} preemptions ({} spills, {} restores, {} recomputes)",
        report.preemptions, report.spills, report.restores, report.recomputes
    );
}

fn run() -> Result<bool, String> {
    let Some(args) = parse_args()? else {
        println!("{USAGE}");
        return Ok(true);
    };
    if args.trace.is_some() && !cfg!(feature = "trace") {
        return Err(
            "--trace needs the `trace` feature (cargo run --features trace ...)".to_string(),
        );
    }
    let started = Instant::now();
    let model = match &args.model {
        Some(dir) => backend::load_model(dir).map_err(|err| err.to_string())?,
        None => backend::random_model(embedded_model_config(&args.embedded)?, args.seed)
            .map_err(|err| err.to_string())?,
    };
    let config = model.config();
    println!(
        "model: {} (pattern {}, hidden {}, vocab {}); built in {:.1} s",
        args.model.as_ref().map_or(
            format!("embedded {:?}, seeded random weights", args.embedded),
            |dir| dir.display().to_string()
        ),
        config.pattern(),
        config.hidden_size,
        config.vocab_size,
        started.elapsed().as_secs_f64()
    );
    let mut workload = Workload::resolve(&args.workload, config.vocab_size, args.seed)
        .map_err(|err| err.to_string())?;
    if let Some(n) = args.max_requests {
        workload.truncate(n);
    }
    println!(
        "workload: {} ({} turns, {} input and {} output tokens)",
        workload.name,
        workload.turns.len(),
        workload.input_tokens(),
        workload.output_tokens()
    );
    if !args.verify {
        let label = if args.prefix_cache {
            "caches on"
        } else {
            "caches off"
        };
        let replay = run_pass(&args, &model, &workload, args.prefix_cache, label, false)?;
        print_report(label, &replay.report);
        write_json(&args, &serde_json::json!(replay.report))?;
        return Ok(replay.report.failed == 0);
    }
    let on = run_pass(&args, &model, &workload, true, "caches on", true)?;
    let off = run_pass(&args, &model, &workload, false, "caches off", true)?;
    print_report("caches on", &on.report);
    print_report("caches off", &off.report);
    let mut mismatches = 0;
    let mut compared = 0;
    for (index, (a, b)) in on.digests().iter().zip(off.digests()).enumerate() {
        match (a, b) {
            (Some(a), Some(b)) if *a == b => compared += 1,
            (None, None)
                if matches!(on.outcomes[index], TurnOutcome::Skipped)
                    && matches!(off.outcomes[index], TurnOutcome::Skipped) => {}
            _ => {
                mismatches += 1;
                if mismatches <= 10 {
                    let turn = &workload.turns[index];
                    println!(
                        "MISMATCH session {} turn {}: caches on {:?} ({:?}), off {:?} ({:?})",
                        turn.session,
                        turn.turn,
                        a,
                        outcome_word(&on.outcomes[index]),
                        b,
                        outcome_word(&off.outcomes[index])
                    );
                }
            }
        }
    }
    let verified = mismatches == 0 && on.report.failed == 0 && off.report.failed == 0;
    println!(
        "verify: {compared} turns with identical logits digests, {mismatches} mismatched: {}",
        if verified { "OK" } else { "FAILED" }
    );
    write_json(
        &args,
        &serde_json::json!({
            "caches_on": on.report,
            "caches_off": off.report,
            "requests": on.report.requests,
            "token_hit_rate": on.report.token_hit_rate,
            "verified": verified,
            "mismatches": mismatches,
        }),
    )?;
    Ok(verified)
}

fn outcome_word(outcome: &TurnOutcome) -> &'static str {
    match outcome {
        TurnOutcome::Done { .. } => "done",
        TurnOutcome::Failed(_) => "failed",
        TurnOutcome::Skipped => "skipped",
    }
}

fn write_json(args: &Args, value: &serde_json::Value) -> Result<(), String> {
    let Some(path) = &args.json else {
        return Ok(());
    };
    let text = serde_json::to_string_pretty(value).map_err(|err| err.to_string())?;
    std::fs::write(path, text + "\n")
        .map_err(|err| format!("writing {}: {err}", path.display()))?;
    println!("report written to {}", path.display());
    Ok(())
}

fn main() -> ExitCode {
    // Warnings (a failed spill, a refused checkpoint) go to stderr; `REPLAY_LOG=debug` shows more.
    let level = match std::env::var("REPLAY_LOG").as_deref() {
        Ok("debug") => tracing::Level::DEBUG,
        Ok("info") => tracing::Level::INFO,
        _ => tracing::Level::WARN,
    };
    tracing_subscriber::fmt()
        .with_max_level(level)
        .with_writer(std::io::stderr)
        .init();
    match run() {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(message) => {
            eprintln!("replay: {message}");
            ExitCode::FAILURE
        }
    }
}
