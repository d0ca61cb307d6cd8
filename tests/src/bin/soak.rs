//! `cargo xtask soak`: the full soak (see `tests::soak`). Prints one JSON object per run and,
//! last, one with the totals and the wall time; exits with failure when any failure count is
//! not zero.
#![forbid(unsafe_code)]

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use clap::{Parser, ValueEnum};
use scheduler::SpecOverlap;
use tests::soak::{
    self, DraftSource, PressureMode, RouterKind, RouterOptions, SoakReport, Submission,
    WorkloadOptions,
};

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
    /// Percent of launches, awaits and effects that fail in the scripted router's fault run
    #[arg(long, default_value_t = 1)]
    fault_percent: u32,
    /// Per mille of launches, steps (failed inside the router, as by a device error) and
    /// per-sequence effects that fail in the load and pressure runs, on the router they use
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u32).range(0..=1000))]
    router_fault_per_mille: u32,
    /// The router of the load and pressure runs
    #[arg(long, value_enum, default_value_t = RouterArg::Host)]
    router: RouterArg,
    /// Pipeline depth of the runs (1 or 2)
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=2))]
    depth: u16,
    /// Drafts per row and step of speculative decoding (0: off)
    #[arg(long, default_value_t = 0)]
    mtp: usize,
    /// Who drafts when --mtp is above 0
    #[arg(long, value_enum, default_value_t = DrafterArg::Head)]
    drafter: DrafterArg,
    /// Whether speculation at depth 2 runs by cohorts (auto: not on the host router)
    #[arg(long, value_enum, default_value_t = OverlapArg::Cohorts)]
    overlap: OverlapArg,
    /// Percent of requests that are a later turn of an earlier request's conversation (its
    /// prompt and output served alone, then new tokens; submitted by the same client after it)
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u32).range(0..=100))]
    followup_percent: u32,
    /// Percent of requests with four random stop tokens
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u32).range(0..=100))]
    stop_percent: u32,
    /// Percent of requests sampled at random (seeded; the rest greedy)
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u32).range(0..=100))]
    sampled_percent: u32,
    /// LoRA adapters loaded (ids 1..=N); requests name one of them or none, at random
    #[arg(long, default_value_t = 0)]
    lora: u32,
    /// Percent of requests that ask for a logits digest (compared bit for bit with the
    /// request's served alone)
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u32).range(0..=100))]
    digest_percent: u32,
    /// Every this many milliseconds while the clients run, clear the prefix cache or (host
    /// router) send a LoRA command, in turn (load and unload one more adapter, or list them;
    /// each drains a step in flight); 0: none
    #[arg(long, default_value_t = 0)]
    command_ms: u64,
    /// Submit every request (and drop the handles to drop) before the engine starts stepping;
    /// the clients then read and cancel the streams (with no later turns)
    #[arg(long)]
    queued: bool,
    /// How long into the abort run the engine is aborted (with requests waiting, running and
    /// in flight), in milliseconds
    #[arg(long, default_value_t = 1000)]
    abort_after_ms: u64,
    /// Which runs: load, pressure (spill to memory, to a directory, recompute), faults (the
    /// scripted router), abort (the load run, aborted after --abort-after-ms)
    #[arg(long, value_enum, value_delimiter = ',', default_values_t = [Run::Load, Run::Pressure, Run::Faults])]
    runs: Vec<Run>,
    /// The model folder (config.json and safetensors) [default: the tiny fixture, with its MTP
    /// layers when the MTP head drafts]
    #[arg(long)]
    model: Option<PathBuf>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum RouterArg {
    /// The host router
    Host,
    /// The CUDA router on its host runtime (slow)
    CudaSim,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum DrafterArg {
    /// The router's MTP head
    Head,
    /// Drafts from the reference output (all accepted)
    Perfect,
    /// Wrong drafts (all rejected)
    Adversarial,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum OverlapArg {
    Auto,
    Off,
    Cohorts,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Run {
    Load,
    Pressure,
    Faults,
    Abort,
}

fn main() -> ExitCode {
    let args = Args::parse();
    let start = Instant::now();
    let fixture =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../model/tests/fixtures/nemotron-h-tiny");
    let dir = args.model.clone().unwrap_or_else(|| {
        if args.mtp > 0 && args.drafter == DrafterArg::Head {
            fixture.join("mtp/model")
        } else {
            fixture.join("model")
        }
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
        sampled_percent: args.sampled_percent,
        adapters: args.lora,
        digest_percent: args.digest_percent,
        command_every_ms: args.command_ms,
        abort_after_ms: 0,
        followup_percent: args.followup_percent,
        stop_percent: args.stop_percent,
        submission: if args.queued {
            Submission::Queued
        } else {
            Submission::Clients
        },
        seed: args.seed,
    };
    let max_context = args.max_prompt + args.max_tokens;
    let router = RouterOptions {
        router: match args.router {
            RouterArg::Host => RouterKind::Host,
            RouterArg::CudaSim => RouterKind::CudaSim,
        },
        depth: usize::from(args.depth),
        mtp: args.mtp,
        drafter: match args.drafter {
            DrafterArg::Head => DraftSource::Head,
            DrafterArg::Perfect => DraftSource::Perfect,
            DrafterArg::Adversarial => DraftSource::Adversarial,
        },
        overlap: match args.overlap {
            OverlapArg::Auto => SpecOverlap::Auto,
            OverlapArg::Off => SpecOverlap::Off,
            OverlapArg::Cohorts => SpecOverlap::Cohorts,
        },
        fault_per_mille: args.router_fault_per_mille,
        ..RouterOptions::host(
            model,
            args.clients * max_context.div_ceil(16) * 2,
            args.clients,
            max_context,
        )
    };
    // Memory pressure: the same number of requests with shorter prompts and longer outputs, so
    // that many are admitted and then outgrow the small pool while decoding.
    let pressure = WorkloadOptions {
        prompt_len: 1..=(args.max_prompt / 4).max(1),
        max_tokens: (args.max_tokens / 2).max(1)..=args.max_tokens,
        seed: args.seed ^ 0x9E55,
        ..workload.clone()
    };
    let small = RouterOptions {
        kv_blocks: args.pressure_blocks,
        ..router.clone()
    };
    for (options, load) in [(&router, &workload), (&small, &pressure)] {
        if let Some(why) = options.refusal(load) {
            eprintln!("soak: cannot run {why}");
            return ExitCode::FAILURE;
        }
    }
    let mut reports = Vec::new();
    if args.runs.contains(&Run::Load) {
        let report = soak::soak_load(&workload, &router);
        print_json(&report);
        reports.push(report);
    }
    if args.runs.contains(&Run::Pressure) {
        let modes = [
            PressureMode::SpillMemory,
            PressureMode::SpillDirectory,
            PressureMode::Recompute,
        ];
        for report in soak::soak_pressure(&pressure, &small, &modes) {
            print_json(&report);
            reports.push(report);
        }
    }
    if args.runs.contains(&Run::Abort) {
        let aborted = WorkloadOptions {
            abort_after_ms: args.abort_after_ms.max(1),
            ..workload.clone()
        };
        let report = soak::soak_load(&aborted, &router);
        print_json(&report);
        reports.push(report);
    }
    if args.runs.contains(&Run::Faults) {
        let faults = WorkloadOptions {
            seed: args.seed ^ 0x5EED,
            ..workload
        };
        let fault_run = soak::soak_faults(
            &faults,
            usize::from(args.depth),
            (max_context.div_ceil(4) * 3, args.clients),
            args.fault_percent,
            scheduler::Preemption::Spill(scheduler::SpillTarget::Memory),
        );
        print_json(&fault_run);
        reports.push(fault_run);
    }
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
