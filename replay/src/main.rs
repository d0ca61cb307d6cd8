//! The main job: replay a multi-turn workload through the engine on the host router and report
//! what it took (`cargo run --release -p replay -- --help` lists the options).
//!
//! The run checks everything it can before the work starts (the command line, the model's
//! `config.json`, the whole workload, that the `--json` file can be written), then builds the
//! model and the router, replays the workload once (or three times with `--verify`: caches on
//! and off at `--depth`, and caches on at the other depth), and prints what was configured and
//! what happened. Exit status: 0 when every turn completed (and, with `--verify`, every digest
//! matched), 1 otherwise, 2 for a bad command line.
#![forbid(unsafe_code)]

mod cli;
mod log;
#[cfg(feature = "plot")]
mod plot;
mod progress;
mod report;

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

use clap::Parser;
use scheduler::backend::{self, BackendOptions, Device, Model, ModelConfig};
use scheduler::replay::{self, Replay, ReplayOptions, ReplayReport, TurnOutcome};
use scheduler::workload::{TokenIds, Workload, WorkloadError};
use scheduler::workload_trace::{Problem, TraceError};
use scheduler::{
    EngineConfig, LoraCommand, Preemption, ShutdownMode, SpecOverlap, Speculation, SpillTarget,
};
use serde::Serialize;
use tracing::level_filters::LevelFilter;

use crate::cli::{Args, DeviceName, Embedded, PreemptMode, SpecOverlapMode, WorkloadSpec};
use crate::log::LineLog;
use crate::progress::Progress;
use crate::report::{Setup, Verdict};

/// Tokens per KV block.
const BLOCK_SIZE: usize = 16;
/// The label of `--verify --mtp`'s pass without speculation.
const MTP_OFF: &str = "MTP off, caches on";
/// Default KV blocks per in-flight turn (`--kv-blocks` unset).
const BLOCKS_PER_TURN: u64 = 48;

/// The embedded models (seeded random weights, built in code), by `--embedded` name.
///
/// - `small` (default): `ModelConfig::small_512()`, NemotronH-shaped: vocab 4096, hidden 512,
///   16 layers `MEM*MEM-MEM*MEM-` (8 Mamba2, 4 MoE, 2 attention, 2 MLP); Mamba2 16 heads of 64
///   with state 64 in 4 groups; attention 8 query / 2 KV heads of 64; MLP 2048; MoE 16 routed
///   experts of 256 (top 4) plus a shared expert of 512. About 43 M parameters. The default
///   replay takes about 25 s on two cores.
/// - `mini`: the same family at hidden 256 and 8 layers `MEM*MEM-` (about 7.6 M parameters),
///   for quick runs (about 6 s).
fn embedded_model_config(which: Embedded) -> ModelConfig {
    match which {
        Embedded::Small => ModelConfig::small_512(),
        Embedded::Mini => {
            let layer_kinds: Vec<backend::LayerKind> = "MEM*MEM-"
                .chars()
                .filter_map(backend::LayerKind::from_letter)
                .collect();
            ModelConfig {
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
                ..ModelConfig::small_512()
            }
        }
    }
}

/// A failure that ends the run, with the message the user sees.
#[derive(Debug)]
struct Failure(String);

/// The exit status of a run refused before any work started (clap uses it for its own errors).
const EXIT_REFUSED: u8 = 2;

impl<E: std::fmt::Display> From<E> for Failure {
    fn from(err: E) -> Self {
        Failure(err.to_string())
    }
}

/// An output file opened before the work starts, so an unwritable path fails in the first second.
/// If the run fails before writing it and the file did not exist before, it is removed again.
#[derive(Debug)]
struct OutputFile {
    path: PathBuf,
    file: Option<File>,
    created: bool,
}

impl OutputFile {
    fn open(flag: &str, path: &Path) -> Result<OutputFile, Failure> {
        let existed = path.exists();
        let file = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)
            .map_err(|err| {
                Failure(format!(
                    "{flag} {}: cannot write there: {err}",
                    path.display()
                ))
            })?;
        Ok(OutputFile {
            path: path.to_path_buf(),
            file: Some(file),
            created: !existed,
        })
    }

    fn write(mut self, flag: &str, text: &str) -> Result<(), Failure> {
        use std::io::Write;
        let Some(mut file) = self.file.take() else {
            return Ok(());
        };
        let path = self.path.clone();
        let written = file
            .set_len(0)
            .and_then(|()| file.write_all(text.as_bytes()))
            .and_then(|()| file.flush());
        // Written (or failed while writing): either way the file is no longer ours to remove.
        self.created = false;
        written.map_err(|err| Failure(format!("{flag} {}: {err}", path.display())))
    }
}

impl Drop for OutputFile {
    fn drop(&mut self) {
        if self.created {
            drop(self.file.take());
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// Everything decided before the replay starts.
#[derive(Debug)]
struct Plan {
    args: Args,
    model_config: ModelConfig,
    workload: Workload,
    kv_blocks: usize,
    max_context: usize,
    json: Option<OutputFile>,
    plot: Option<OutputFile>,
}

/// Checks the command line, the model's configuration and the workload, and opens the output
/// files, without building anything heavy.
fn plan(args: Args) -> Result<Plan, Failure> {
    if args.trace.is_some() && !cfg!(feature = "trace") {
        return Err(Failure(
            "--trace needs the `trace` feature (cargo run --release -p replay --features trace -- ...)"
                .into(),
        ));
    }
    if matches!(args.device, DeviceName::Cuda | DeviceName::CudaSim) && !cfg!(feature = "cuda") {
        let name = if args.device == DeviceName::Cuda {
            "cuda"
        } else {
            "cuda-sim"
        };
        return Err(Failure(format!(
            "--device {name}: this build has no `cuda` feature (build with `--features cuda`); use --device cpu"
        )));
    }
    if let Some(path) = &args.plot {
        if !cfg!(feature = "plot") {
            return Err(Failure(
                "--plot needs the `plot` feature (cargo run --release -p replay --features plot -- ...)"
                    .into(),
            ));
        }
        if path.extension().and_then(|e| e.to_str()) != Some("svg") {
            return Err(Failure(format!(
                "--plot {}: the plot is SVG; name the file FILE.svg",
                path.display()
            )));
        }
    }
    let json = args
        .json
        .as_deref()
        .map(|path| OutputFile::open("--json", path))
        .transpose()?;
    let plot = args
        .plot
        .as_deref()
        .map(|path| OutputFile::open("--plot", path))
        .transpose()?;
    let model_config = match &args.model {
        Some(dir) => ModelConfig::from_file(&dir.join("config.json"))
            .map_err(|err| Failure(format!("--model {}: {err}", dir.display())))?,
        None => {
            let mut config = embedded_model_config(args.embedded);
            if args.mtp.is_some() {
                // A seeded random MTP head (pattern `*E`) after the main stack's weights.
                config.num_nextn_predict_layers = 1;
                config.mtp = true;
            }
            config
        }
    };
    let vocab = model_config.vocab_size;
    let ids = if args.fold_token_ids {
        TokenIds::Fold
    } else {
        TokenIds::Refuse
    };
    let mut workload = match &args.workload {
        WorkloadSpec::Chat => Workload::resolve("chat", vocab, args.seed, ids)?,
        WorkloadSpec::Agentic => Workload::resolve("agentic", vocab, args.seed, ids)?,
        WorkloadSpec::File(path) => Workload::load(path, vocab, ids).map_err(|err| {
            let hint = match &err {
                WorkloadError::Trace(TraceError {
                    problem: Problem::OutOfVocabulary { .. },
                    ..
                }) => " (the model's vocabulary; --fold-token-ids folds such ids into it)",
                _ => "",
            };
            Failure(format!("--workload {err}{hint}"))
        })?,
    };
    if let Some(n) = args.max_requests {
        workload.truncate(usize::try_from(n).unwrap_or(usize::MAX));
    }
    note_skipped_turns(&workload);
    let longest = workload.longest_turn().max(1);
    let max_context = longest.div_ceil(BLOCK_SIZE) * BLOCK_SIZE;
    let needed = (max_context / BLOCK_SIZE) as u64;
    let kv_blocks = match args.kv_blocks {
        Some(given) if given < needed => {
            eprintln!(
                "note: --kv-blocks {given} raised to {needed}: the longest turn ({longest} tokens) needs {needed} blocks of {BLOCK_SIZE}"
            );
            needed
        }
        Some(given) => given,
        None => (BLOCKS_PER_TURN * args.max_in_flight).max(needed),
    };
    // Block ids are 32-bit; say which flag made the pool that large.
    let kv_blocks = usize::try_from(kv_blocks)
        .ok()
        .filter(|&blocks| u32::try_from(blocks).is_ok())
        .ok_or_else(|| {
            let cause = match args.kv_blocks {
                Some(given) => format!("--kv-blocks {given}"),
                None => format!(
                    "--max-in-flight {} (the pool defaults to {BLOCKS_PER_TURN} KV blocks per in-flight turn)",
                    args.max_in_flight
                ),
            };
            Failure(format!(
                "{cause}: {kv_blocks} KV blocks is more than block ids allow ({})",
                u32::MAX
            ))
        })?;
    Ok(Plan {
        args,
        model_config,
        workload,
        kv_blocks,
        max_context,
        json,
        plot,
    })
}

/// Says on stderr which turns will be skipped, and why, before the replay starts.
fn note_skipped_turns(workload: &Workload) {
    let lines: Vec<String> = workload
        .turns
        .iter()
        .filter(|turn| turn.output.is_empty())
        .map(|turn| match turn.source_line {
            Some(line) => format!("line {line}"),
            None => format!("session {} turn {}", turn.session, turn.turn),
        })
        .collect();
    if lines.is_empty() {
        return;
    }
    let shown: Vec<&str> = lines.iter().take(10).map(String::as_str).collect();
    let more = if lines.len() > shown.len() {
        format!(" and {} more", lines.len() - shown.len())
    } else {
        String::new()
    };
    eprintln!(
        "note: {} turn(s) record no output, so there is nothing to force and they are skipped: {}{more}",
        lines.len(),
        shown.join(", ")
    );
}

/// One replay pass with the caches, the depth and the speculation (`--mtp`, unless `plain`) as
/// given.
fn run_pass(
    plan: &Plan,
    model: &Model,
    prefix_cache: bool,
    depth: usize,
    label: &str,
    digests: bool,
    plain: bool,
) -> Result<Pass, Failure> {
    let args = &plan.args;
    let max_seqs = args.max_in_flight as usize;
    let speculation = match args.mtp {
        Some(k) if !plain => Some(Speculation {
            overlap: match args.spec_overlap {
                SpecOverlapMode::Auto => SpecOverlap::Auto,
                SpecOverlapMode::Off => SpecOverlap::Off,
                SpecOverlapMode::Cohorts => SpecOverlap::Cohorts,
            },
            ..Speculation::mtp(k as usize)
        }),
        _ => None,
    };
    let options = BackendOptions {
        snapshot_slots: speculation
            .as_ref()
            .map_or(backend::device_cpu::DEFAULT_SNAPSHOT_SLOTS, |spec| {
                max_seqs * spec.k
            }),
        #[cfg(feature = "trace")]
        trace: trace_sink(args, label)?,
        device: device(args.device),
        // Turns longer than the model's context are refused at submission, not the whole replay.
        max_context: Some(match plan.model_config.max_position_embeddings {
            Some(limit) => plan.max_context.min(limit),
            None => plan.max_context,
        }),
        prefix_cache,
        marconi: !args.no_marconi,
        max_depth: depth,
        threads: args
            .threads
            .map_or_else(backend::default_threads, |n| n as usize),
        expert_workers: args.expert_workers as usize,
        lora_slots: args
            .adapters
            .len()
            .max(backend::device_cpu::DEFAULT_LORA_SLOTS),
        ..BackendOptions::new(plan.kv_blocks, max_seqs)
    };
    let preemption = match args.preempt {
        PreemptMode::Spill => Preemption::Spill(SpillTarget::Directory(std::env::temp_dir())),
        PreemptMode::Recompute => Preemption::Recompute,
    };
    let config = EngineConfig {
        max_running: max_seqs,
        max_step_tokens: 512.max(max_seqs + 1),
        max_prefill_chunk: 256,
        preemption,
        speculation,
        ..EngineConfig::default()
    };
    let setup = Setup::new(plan, model.config(), &options, &config);
    let mut engine = backend::build_engine(model.clone(), options, config)
        .map_err(|err| Failure(allocation_hint(plan, err.to_string())))?;
    let mut adapters = Vec::with_capacity(args.adapters.len());
    for dir in &args.adapters {
        let adapter = adapter_id(plan, dir);
        let load = LoraCommand::Load {
            adapter,
            path: dir.clone(),
        };
        engine
            .lora(load)
            .map_err(|err| Failure(format!("--adapter {}: {err}", dir.display())))?;
        adapters.push(adapter);
    }
    let progress = Progress::start(label, plan.workload.turns.len() as u64, args.progress);
    let replay_options = ReplayOptions {
        max_in_flight: max_seqs,
        digests,
        pace: args.pace,
        adapters,
    };
    let mut series = PassSeries {
        label: label.to_string(),
        ..PassSeries::default()
    };
    let (mut cached, mut prompt) = (0usize, 0usize);
    let started = Instant::now();
    let mut replay = replay::replay(
        &mut engine,
        &plan.workload,
        &replay_options,
        &mut |_, outcome| match outcome {
            TurnOutcome::Done { usage, .. } => {
                progress.turn_done(usage.generated_tokens as u64, false);
                cached += usage.cached_tokens;
                prompt += usage.prompt_tokens;
                let rate = 100.0 * cached as f64 / prompt.max(1) as f64;
                series
                    .hit_rate
                    .push((started.elapsed().as_secs_f64(), rate));
                series.ttft_ms.extend(usage.time_to_first_token.map(ms));
                series.tpot_ms.extend(usage.time_per_output_token.map(ms));
            }
            TurnOutcome::Failed(_) => progress.turn_done(0, true),
            TurnOutcome::Skipped => progress.turn_done(0, false),
        },
    );
    progress.finish();
    replay.report.cache = backend::cache_stats(engine.router());
    engine
        .shutdown(ShutdownMode::Drain)
        .map_err(|err| Failure(format!("shutdown: {err}")))?;
    Ok(Pass {
        replay,
        setup,
        series,
    })
}

/// The id `--adapter DIR` is loaded under: its place on the command line, from 1.
fn adapter_id(plan: &Plan, dir: &Path) -> u32 {
    let index = plan
        .args
        .adapters
        .iter()
        .position(|d| d == dir)
        .unwrap_or_default();
    u32::try_from(index + 1).unwrap_or(u32::MAX)
}

fn ms(duration: std::time::Duration) -> f64 {
    duration.as_secs_f64() * 1e3
}

/// One finished pass.
#[derive(Debug)]
struct Pass {
    replay: Replay,
    setup: Setup,
    series: PassSeries,
}

/// What `--plot` draws of one pass.
#[derive(Debug, Default)]
// Without the `plot` feature nothing reads the series; collecting them costs a few pushes a turn.
#[cfg_attr(not(feature = "plot"), allow(dead_code))]
struct PassSeries {
    /// `caches on` or `caches off`.
    label: String,
    /// Each completed turn's time to first token, in milliseconds.
    ttft_ms: Vec<f64>,
    /// Each completed turn's mean time per output token, in milliseconds.
    tpot_ms: Vec<f64>,
    /// `(seconds into the pass, token hit rate so far in percent)` at each completed turn.
    hit_rate: Vec<(f64, f64)>,
}

/// The `--json` document: what was configured, the workload, each pass under its name, and
/// `--verify`'s verdicts.
#[derive(Debug, Serialize)]
struct JsonReport<'a> {
    setup: &'a Setup,
    workload: WorkloadFacts,
    #[serde(skip_serializing_if = "Option::is_none")]
    caches_on: Option<&'a ReplayReport>,
    #[serde(skip_serializing_if = "Option::is_none")]
    caches_off: Option<&'a ReplayReport>,
    /// `--verify`'s third pass, as `depth_N_caches_on` (N the depth other than `--depth`).
    #[serde(flatten)]
    other_depth: BTreeMap<String, &'a ReplayReport>,
    /// Caches on against off.
    #[serde(skip_serializing_if = "Option::is_none")]
    verify: Option<&'a Verdict>,
    /// One depth against the other, caches on.
    #[serde(skip_serializing_if = "Option::is_none")]
    verify_depth: Option<&'a Verdict>,
    /// `--verify --mtp`'s fourth pass: caches on at `--depth`, without speculation.
    #[serde(skip_serializing_if = "Option::is_none")]
    mtp_off: Option<&'a ReplayReport>,
    /// Speculation on against off (`--verify --mtp`).
    #[serde(skip_serializing_if = "Option::is_none")]
    verify_mtp: Option<&'a Verdict>,
}

/// The workload as replayed.
#[derive(Debug, Serialize)]
struct WorkloadFacts {
    name: String,
    turns: usize,
    input_tokens: usize,
    output_tokens: usize,
    /// Turns without recorded output (skipped: nothing to force).
    without_output: usize,
}

impl WorkloadFacts {
    fn of(workload: &Workload) -> WorkloadFacts {
        WorkloadFacts {
            name: workload.name.clone(),
            turns: workload.turns.len(),
            input_tokens: workload.input_tokens(),
            output_tokens: workload.output_tokens(),
            without_output: workload
                .turns
                .iter()
                .filter(|turn| turn.output.is_empty())
                .count(),
        }
    }
}

/// A router construction error, with the flag that sized what could not be built.
fn allocation_hint(plan: &Plan, message: String) -> String {
    let args = &plan.args;
    let sized_by = match args.kv_blocks {
        Some(blocks) => format!(
            "--kv-blocks {blocks} and --max-in-flight {}",
            args.max_in_flight
        ),
        None => format!(
            "--max-in-flight {} ({BLOCKS_PER_TURN} KV blocks per in-flight turn by default)",
            args.max_in_flight
        ),
    };
    format!("building the router for {sized_by}: {message}")
}

/// The sink for `--trace FILE` (the caches-off pass of `--verify` writes `FILE.off`).
#[cfg(feature = "trace")]
fn trace_sink(args: &Args, label: &str) -> Result<Option<backend::TraceSink>, Failure> {
    let Some(path) = &args.trace else {
        return Ok(None);
    };
    let path = match label {
        _ if !args.verify => path.clone(),
        "caches off" => path.with_extension("off"),
        MTP_OFF => path.with_extension("mtpoff"),
        label if label.starts_with("depth") => path.with_extension("depth"),
        _ => path.clone(),
    };
    let file =
        File::create(&path).map_err(|err| Failure(format!("--trace {}: {err}", path.display())))?;
    Ok(Some(backend::TraceSink::writer(std::io::BufWriter::new(
        file,
    ))))
}

fn device(name: DeviceName) -> Device {
    match name {
        DeviceName::Cpu => Device::Cpu,
        #[cfg(feature = "cuda")]
        DeviceName::Cuda => Device::Cuda,
        #[cfg(feature = "cuda")]
        DeviceName::CudaSim => Device::CudaSim,
        // Refused in `plan` before any work.
        #[cfg(not(feature = "cuda"))]
        DeviceName::Cuda | DeviceName::CudaSim => Device::Cpu,
    }
}

/// Runs the replay: `Ok(success)`, or the failure and the exit status to end with.
fn run(args: Args) -> Result<bool, (Failure, u8)> {
    let mut plan = plan(args).map_err(|failure| (failure, EXIT_REFUSED))?;
    work(&mut plan).map_err(|failure| (failure, 1))
}

fn work(plan: &mut Plan) -> Result<bool, Failure> {
    let started = Instant::now();
    let model = match &plan.args.model {
        Some(dir) => backend::load_model(dir)
            .map_err(|err| Failure(format!("--model {}: {err}", dir.display())))?,
        None => backend::random_model(plan.model_config.clone(), plan.args.seed)?,
    };
    if let Some(k) = plan.args.mtp {
        if !model.has_mtp() {
            return Err(Failure(format!(
                "--mtp {k}: the model has no MTP head (a checkpoint needs mtp.* tensors and \
                 num_nextn_predict_layers: 1)"
            )));
        }
    }
    let config = model.config();
    println!(
        "model: {} (pattern {}, hidden {}, vocab {}); built in {:.1} s",
        plan.args.model.as_ref().map_or(
            format!(
                "embedded {:?}, seeded random weights",
                plan.args.embedded.name()
            ),
            |dir| dir.display().to_string()
        ),
        config.pattern(),
        config.hidden_size,
        config.vocab_size,
        started.elapsed().as_secs_f64()
    );
    // Every adapter is checked against the model before any pass starts.
    for dir in &plan.args.adapters {
        let adapter = backend::model::LoraAdapter::load(dir, &model)
            .map_err(|err| Failure(format!("--adapter {}: {err}", dir.display())))?;
        println!(
            "adapter {}: {} (rank {}, scale {}, {} linear layers)",
            adapter_id(plan, dir),
            dir.display(),
            adapter.rank(),
            adapter.scale(),
            adapter.module_count()
        );
    }
    let workload = &plan.workload;
    println!(
        "workload: {} ({} turns, {} input and {} output tokens)",
        workload.name,
        workload.turns.len(),
        workload.input_tokens(),
        workload.output_tokens()
    );
    let json = plan.json.take();
    let plot = plan.plot.take();
    let depth = plan.args.depth as usize;
    let other = 3 - depth;
    let other_label = format!("depth {other}, caches on");
    let passes: Vec<Pass> = if plan.args.verify {
        let mut passes = vec![
            run_pass(plan, &model, true, depth, "caches on", true, false)?,
            run_pass(plan, &model, false, depth, "caches off", true, false)?,
            run_pass(plan, &model, true, other, &other_label, true, false)?,
        ];
        if plan.args.mtp.is_some() {
            passes.push(run_pass(plan, &model, true, depth, MTP_OFF, true, true)?);
        }
        passes
    } else {
        let prefix_cache = !plan.args.no_prefix_cache;
        let label = if prefix_cache {
            "caches on"
        } else {
            "caches off"
        };
        vec![run_pass(
            plan,
            &model,
            prefix_cache,
            depth,
            label,
            false,
            false,
        )?]
    };
    let setup = &passes[0].setup;
    setup.print();
    for pass in &passes {
        report::print(&pass.series.label, &pass.replay.report, &plan.args.adapters);
    }
    let mut verdicts: Vec<Verdict> = match passes.as_slice() {
        [on, off, other_on, ..] => vec![
            Verdict::compare(
                &plan.workload,
                format!("caches on vs off at depth {depth}"),
                &on.replay,
                &off.replay,
            ),
            Verdict::compare(
                &plan.workload,
                format!("depth {depth} vs depth {other}, caches on"),
                &on.replay,
                &other_on.replay,
            ),
        ],
        _ => Vec::new(),
    };
    if let [on, _, _, mtp_off] = passes.as_slice() {
        verdicts.push(Verdict::compare(
            &plan.workload,
            format!("MTP on vs off, caches on at depth {depth}"),
            &on.replay,
            &mtp_off.replay,
        ));
    }
    for verdict in &verdicts {
        verdict.print();
    }
    if let Some(plot) = plot {
        write_plot(plot, &plan.workload, &passes)?;
    }
    if let Some(json) = json {
        let by_label = |label: &str| {
            passes
                .iter()
                .find(|pass| pass.series.label == label)
                .map(|pass| &pass.replay.report)
        };
        let other_depth = by_label(&other_label)
            .map(|report| (format!("depth_{other}_caches_on"), report))
            .into_iter()
            .collect();
        let document = JsonReport {
            setup,
            workload: WorkloadFacts::of(&plan.workload),
            caches_on: by_label("caches on"),
            caches_off: by_label("caches off"),
            other_depth,
            mtp_off: by_label(MTP_OFF),
            verify: verdicts.first(),
            verify_depth: verdicts.get(1),
            verify_mtp: verdicts.get(2),
        };
        write_json(json, &document)?;
    }
    Ok(if verdicts.is_empty() {
        passes[0].replay.report.failed == 0
    } else {
        verdicts.iter().all(|verdict| verdict.verified)
    })
}

/// Draws `--plot` (feature `plot`).
#[cfg(feature = "plot")]
fn write_plot(file: OutputFile, workload: &Workload, passes: &[Pass]) -> Result<(), Failure> {
    let series: Vec<&PassSeries> = passes.iter().map(|pass| &pass.series).collect();
    let title = format!(
        "replay of {} ({} turns)",
        workload.name,
        workload.turns.len()
    );
    let svg = plot::render(&title, &series).map_err(Failure)?;
    let path = file.path.clone();
    file.write("--plot", &svg)?;
    println!("plot written to {}", path.display());
    Ok(())
}

/// `--plot` without the feature is refused in `plan`, before any work.
#[cfg(not(feature = "plot"))]
fn write_plot(_: OutputFile, _: &Workload, _: &[Pass]) -> Result<(), Failure> {
    Err(Failure("--plot needs the `plot` feature".into()))
}

fn write_json(file: OutputFile, value: &impl Serialize) -> Result<(), Failure> {
    let path = file.path.clone();
    let text = serde_json::to_string_pretty(value)?;
    file.write("--json", &(text + "\n"))?;
    println!("report written to {}", path.display());
    Ok(())
}

fn main() -> ExitCode {
    let args = Args::parse();
    // Warnings (a failed spill, a refused checkpoint) go to stderr; `REPLAY_LOG=debug` shows more.
    let level = match std::env::var("REPLAY_LOG").as_deref() {
        Ok("debug") => LevelFilter::DEBUG,
        Ok("info") => LevelFilter::INFO,
        _ => LevelFilter::WARN,
    };
    // The only place that sets a global subscriber, before anything can log: it cannot fail.
    let _ = tracing::subscriber::set_global_default(LineLog::stderr(level));
    match run(args) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err((Failure(message), status)) => {
            eprintln!("replay: {message}");
            ExitCode::from(status)
        }
    }
}
