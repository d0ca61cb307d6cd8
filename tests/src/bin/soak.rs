//! `cargo xtask soak`: the full soak (see `tests::soak`). Prints one JSON object per run and,
//! last, one with the totals and the wall time; exits with failure when any failure count is
//! not zero.
#![forbid(unsafe_code)]

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use clap::Parser;
use tests::soak::{self, HostOptions, PressureMode, SoakReport, WorkloadOptions};

/// The soak's knobs; the defaults are the full run.
#[derive(Debug, Parser)]
#[command(
    name = "soak",
    about = "Load, memory-pressure and fault soak of the engine"
)]
struct Args {
    /// Requests per run
    #[arg(long, default_value_t = 2000)]
    requests: usize,
    /// Client threads
    #[arg(long, default_value_t = 8)]
    clients: usize,
    /// Seed of the workloads and of the faults
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Longest prompt
    #[arg(long, default_value_t = 300)]
    max_prompt: usize,
    /// Largest max_tokens
    #[arg(long, default_value_t = 32)]
    max_tokens: usize,
    /// KV blocks (of 16 tokens) of the pressure runs (at least one longest sequence)
    #[arg(long, default_value_t = 24)]
    pressure_blocks: usize,
    /// Percent of launches, awaits and effects that fail in the fault run
    #[arg(long, default_value_t = 1)]
    fault_percent: u32,
    /// The model folder (config.json and safetensors) [default: the tiny fixture]
    #[arg(long)]
    model: Option<PathBuf>,
}

fn main() -> ExitCode {
    let args = Args::parse();
    let start = Instant::now();
    let dir = args.model.clone().unwrap_or_else(|| {
        PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../model/tests/fixtures/nemotron-h-tiny/model")
    });
    let model = match model::Model::load(&dir) {
        Ok(model) => model,
        Err(err) => {
            eprintln!("soak: {}: {err}", dir.display());
            return ExitCode::FAILURE;
        }
    };
    let vocab_size = model.config().vocab_size as u32;
    let workload = WorkloadOptions {
        requests: args.requests,
        clients: args.clients,
        prompt_len: 1..=args.max_prompt,
        max_tokens: 1..=args.max_tokens,
        cancel_percent: 10,
        drop_percent: 5,
        prefixes: 8,
        vocab_size,
        seed: args.seed,
    };
    let max_context = args.max_prompt + args.max_tokens;
    let host = HostOptions {
        model,
        kv_blocks: args.clients * max_context.div_ceil(16) * 2,
        slots: args.clients,
        max_context,
    };
    let mut reports = vec![soak::soak_host(&workload, &host)];
    print_json(&reports[0]);
    // Memory pressure: the same number of requests with shorter prompts and longer outputs, so
    // that many are admitted and then outgrow the small pool while decoding.
    let pressure = WorkloadOptions {
        prompt_len: 1..=(args.max_prompt / 4).max(1),
        max_tokens: (args.max_tokens / 2).max(1)..=args.max_tokens,
        seed: args.seed ^ 0x9E55,
        ..workload.clone()
    };
    let small = HostOptions {
        kv_blocks: args.pressure_blocks,
        ..host.clone()
    };
    let modes = [
        PressureMode::SpillMemory,
        PressureMode::SpillDirectory,
        PressureMode::Recompute,
    ];
    for report in soak::soak_pressure(&pressure, &small, &modes) {
        print_json(&report);
        reports.push(report);
    }
    let faults = WorkloadOptions {
        seed: args.seed ^ 0x5EED,
        ..workload
    };
    let fault_run = soak::soak_faults(
        &faults,
        max_context.div_ceil(4) * 3,
        args.clients,
        args.fault_percent,
        scheduler::Preemption::Spill(scheduler::SpillTarget::Memory),
    );
    print_json(&fault_run);
    reports.push(fault_run);
    let mut total = SoakReport::total("total", &reports);
    total.wall_s = start.elapsed().as_secs_f64();
    print_json(&total);
    if total.clean() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

fn print_json(report: &SoakReport) {
    match serde_json::to_string(report) {
        Ok(line) => println!("{line}"),
        Err(err) => eprintln!("soak: {err}"),
    }
}
