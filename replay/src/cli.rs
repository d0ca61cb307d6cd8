//! The command line: every option with its default, parsed and range-checked by clap before any
//! work starts.

use std::path::PathBuf;

use clap::{Parser, ValueEnum};

/// What the long help says before the options.
const LONG_ABOUT: &str = "\
Replay a multi-turn workload through the engine on the host router and report what it took:
requests, prefix-cache token hit rate, Marconi checkpoints, TTFT/TPOT percentiles, throughput.

Each turn is a request whose recorded output is forced, so later turns share history exactly as
the workload says while the model still computes every step. By default an embedded NemotronH-
shaped model (seeded random weights, built in code) replays the built-in `chat` workload.";

/// `replay [OPTIONS]`.
#[derive(Debug, Parser)]
#[command(name = "replay", version, about, long_about = LONG_ABOUT)]
pub struct Args {
    /// A NemotronH checkpoint directory in Hugging Face layout (config.json and safetensors),
    /// for example model/tests/fixtures/nemotron-h-tiny/model [default: the embedded model]
    #[arg(long, value_name = "DIR", conflicts_with = "embedded")]
    pub model: Option<PathBuf>,

    /// The embedded model to build (seeded random weights) when no --model is given
    #[arg(long, value_enum, value_name = "NAME", default_value_t = Embedded::Small)]
    pub embedded: Embedded,

    /// A JSONL trace file in the Marconi artifact's format, or a built-in workload (chat,
    /// agentic)
    #[arg(long, value_name = "FILE|chat|agentic", default_value = "chat", value_parser = workload_spec)]
    pub workload: WorkloadSpec,

    /// Fold token ids at or above the model's vocabulary into it (id modulo vocabulary size)
    /// instead of refusing the trace
    #[arg(long)]
    pub fold_token_ids: bool,

    /// Replay only the first N turns, in arrival order [default: all]
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    pub max_requests: Option<u64>,

    /// Build the router without its prefix cache (no KV or SSM-checkpoint reuse)
    #[arg(long)]
    pub no_prefix_cache: bool,

    /// Evict SSM checkpoints by recency (SGLang's LRU) instead of Marconi's FLOP-aware policy
    /// with its tuner
    #[arg(long)]
    pub no_marconi: bool,

    /// Also write the report as JSON to FILE (checked writable before the replay starts)
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,

    /// Draw the TTFT and TPOT distributions and the prefix cache's hit rate over time to
    /// FILE.svg, every pass of --verify (needs `--features plot`)
    #[arg(long, value_name = "FILE.svg")]
    pub plot: Option<PathBuf>,

    /// Replay three times with logits digests: caches on and off at --depth, then caches on at
    /// the other depth; exit 1 unless every turn's digest matches in all three
    #[arg(long)]
    pub verify: bool,

    /// Speculative decoding with K drafts per step from the model's MTP head (1..=8; --model
    /// needs mtp.* tensors, the embedded model gets a seeded random head); with --verify a fourth
    /// pass without it must give the same digests. At --depth 2 the rows may speculate in two
    /// cohorts (see --spec-overlap)
    #[arg(long, value_name = "K", value_parser = clap::value_parser!(u64).range(1..=8))]
    pub mtp: Option<u64>,

    /// With --mtp at --depth 2: whether the rows speculate in two cohorts (one verifying while
    /// the other's verification is read). auto: cohorts unless the router computes on the host's
    /// own cores, where nothing overlaps and the half batches only cost (the cpu device)
    #[arg(long, value_enum, value_name = "WHEN", default_value_t = SpecOverlapMode::Auto)]
    pub spec_overlap: SpecOverlapMode,

    /// Pipelining depth: 1 reads each step before launching the next; 2 runs the router on a
    /// worker thread and keeps one decode step in flight while the host reads the previous one
    #[arg(long, value_name = "N", default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=2))]
    pub depth: u64,

    /// How a preempted turn comes back: recompute its prompt, or spill its state to a temporary
    /// directory and restore it
    #[arg(long, value_enum, value_name = "MODE", default_value_t = PreemptMode::Recompute)]
    pub preempt: PreemptMode,

    /// KV blocks of 16 tokens in the pool; raised (with a note on stderr) when the longest turn
    /// needs more [default: 48 per in-flight turn]
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(2..))]
    pub kv_blocks: Option<u64>,

    /// Turns in flight at once (each from a different session; also the router's live slots)
    #[arg(long, value_name = "N", default_value_t = 16, value_parser = clap::value_parser!(u64).range(1..=MAX_IN_FLIGHT))]
    pub max_in_flight: u64,

    /// Seed of the built-in workloads and of the embedded model's weights
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub seed: u64,

    /// The device to run on (cuda and cuda-sim need the `cuda` feature; cuda says why it cannot
    /// open where there is no driver or device)
    #[arg(long, value_enum, value_name = "DEVICE", default_value_t = DeviceName::Cpu)]
    pub device: DeviceName,

    /// Threads of the model's forward pass (outputs are the same bits for every count)
    /// [default: every core the machine has]
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..=1024))]
    pub threads: Option<u64>,

    /// Expert-parallel worker threads for the MoE layers (outputs are the same bits for every
    /// count) [default: 0, the experts run on the forward pass's threads]
    #[arg(long, value_name = "N", default_value_t = 0, value_parser = clap::value_parser!(u64).range(0..=64))]
    pub expert_workers: u64,

    /// Hold each turn until its trace arrival time divided by SPEEDUP (1 is real time)
    /// [default: as fast as possible; a session's next turn always waits for its last]
    #[arg(long, value_name = "SPEEDUP", value_parser = positive_speedup, allow_negative_numbers = true)]
    pub pace: Option<f64>,

    /// Write every plan, effect and outcome to FILE (needs `--features trace`; the caches-off
    /// pass of --verify writes FILE with extension .off, the other-depth pass extension .depth)
    #[arg(long, value_name = "FILE")]
    pub trace: Option<PathBuf>,

    /// How to show progress: a bar on a terminal, otherwise a line on stderr every 10 s
    #[arg(long, value_enum, value_name = "WHEN", default_value_t = ProgressMode::Auto)]
    pub progress: ProgressMode,

    /// Serve with the PEFT LoRA adapter in DIR (adapter_config.json and
    /// adapter_model.safetensors, made for the model); repeat for several. Sessions take the
    /// adapters round-robin in order of their first turn, and the report gives each adapter's
    /// prefix-cache hit rate
    #[arg(long = "adapter", value_name = "DIR", value_parser = adapter_dir)]
    pub adapters: Vec<PathBuf>,
}

/// The most turns in flight `--max-in-flight` accepts: one live slot each, and the engine and
/// router index slots with 32-bit numbers.
pub const MAX_IN_FLIGHT: u64 = 1 << 20;

/// The embedded models (seeded random weights, built in code).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Embedded {
    /// NemotronH-shaped: vocab 4096, hidden 512, 16 layers (about 43 M parameters)
    Small,
    /// The same family at hidden 256 and 8 layers (about 7.6 M parameters), for quick runs
    Mini,
}

impl Embedded {
    /// The name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Embedded::Small => "small",
            Embedded::Mini => "mini",
        }
    }
}

/// `--spec-overlap`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum SpecOverlapMode {
    /// Cohorts on a router of depth 2 that does not compute on the host's cores
    Auto,
    /// Every row verifies in one launch, read before the next
    Off,
    /// Cohorts whenever the depth is 2
    Cohorts,
}

/// `--preempt`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum PreemptMode {
    /// Drop the victim's state and recompute its prompt when it is readmitted
    Recompute,
    /// Save the victim's KV and SSM state to a temporary directory and restore it
    Spill,
}

/// `--device`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum DeviceName {
    /// The host router
    Cpu,
    /// The CUDA router (needs the `cuda` feature)
    Cuda,
    /// The CUDA router on SimRuntime, its kernels run on the host (needs the `cuda` feature;
    /// slow: for small workloads)
    CudaSim,
}

/// `--progress`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ProgressMode {
    /// A bar when stderr is a terminal, otherwise a line every 10 s
    Auto,
    /// Always a bar (drawn only on a terminal)
    Bar,
    /// A line on stderr every 10 s
    Lines,
    /// Nothing until the report
    Off,
}

/// What `--workload` names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WorkloadSpec {
    /// The built-in `chat` generator.
    Chat,
    /// The built-in `agentic` generator.
    Agentic,
    /// A trace file (it existed when the command line was parsed).
    File(PathBuf),
}

fn workload_spec(text: &str) -> Result<WorkloadSpec, String> {
    match text {
        "chat" => Ok(WorkloadSpec::Chat),
        "agentic" => Ok(WorkloadSpec::Agentic),
        path => {
            let path = PathBuf::from(path);
            match std::fs::metadata(&path) {
                Ok(meta) if meta.is_file() => Ok(WorkloadSpec::File(path)),
                Ok(_) => Err("not a file (expected a JSONL trace file, chat or agentic)".into()),
                Err(err) => Err(format!(
                    "no such built-in workload (chat, agentic), and no trace file there ({err})"
                )),
            }
        }
    }
}

fn adapter_dir(text: &str) -> Result<PathBuf, String> {
    let dir = PathBuf::from(text);
    let config = dir.join("adapter_config.json");
    match std::fs::metadata(&config) {
        Ok(meta) if meta.is_file() => Ok(dir),
        Ok(_) => Err(format!("{} is not a file", config.display())),
        Err(err) => Err(format!(
            "no PEFT adapter there ({}: {err})",
            config.display()
        )),
    }
}

fn positive_speedup(text: &str) -> Result<f64, String> {
    let speed: f64 = text.parse().map_err(|err| format!("{err}"))?;
    if speed.is_finite() && speed > 0.0 {
        Ok(speed)
    } else {
        Err("must be a positive, finite speed-up (1 is real time)".into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The error clap gives for `args`, as printed (first line).
    fn error(args: &[&str]) -> String {
        let err = Args::try_parse_from(std::iter::once("replay").chain(args.iter().copied()))
            .expect_err("expected a usage error");
        err.to_string()
            .lines()
            .next()
            .unwrap_or_default()
            .to_string()
    }

    #[test]
    fn meaningless_values_are_refused_naming_the_flag() {
        assert_eq!(
            error(&["--kv-blocks", "1"]),
            "error: invalid value '1' for '--kv-blocks <N>': 1 is not in 2..18446744073709551615"
        );
        assert_eq!(
            error(&["--max-requests", "0"]),
            "error: invalid value '0' for '--max-requests <N>': 0 is not in 1..18446744073709551615"
        );
        assert_eq!(
            error(&["--max-in-flight", "0"]),
            "error: invalid value '0' for '--max-in-flight <N>': 0 is not in 1..=1048576"
        );
        assert_eq!(
            error(&["--pace", "0"]),
            "error: invalid value '0' for '--pace <SPEEDUP>': must be a positive, finite speed-up (1 is real time)"
        );
        assert_eq!(
            error(&["--device", "tpu"]),
            "error: invalid value 'tpu' for '--device <DEVICE>'"
        );
        assert_eq!(
            error(&["--model", "m", "--embedded", "mini"]),
            "error: the argument '--model <DIR>' cannot be used with '--embedded <NAME>'"
        );
        assert!(error(&["--workload", "/no/such/trace.jsonl"]).starts_with(
            "error: invalid value '/no/such/trace.jsonl' for '--workload <FILE|chat|agentic>': \
             no such built-in workload (chat, agentic), and no trace file there"
        ));
        assert_eq!(
            error(&["--kv-block", "4"]),
            "error: unexpected argument '--kv-block' found"
        );
        assert_eq!(
            error(&["--depth", "3"]),
            "error: invalid value '3' for '--depth <N>': 3 is not in 1..=2"
        );
        assert_eq!(
            error(&["--adapter", "/no/such/adapter"]),
            "error: invalid value '/no/such/adapter' for '--adapter <DIR>': no PEFT adapter there \
             (/no/such/adapter/adapter_config.json: No such file or directory (os error 2))"
        );
    }

    #[test]
    fn defaults_parse() {
        let args = Args::try_parse_from(["replay"]).unwrap();
        assert_eq!(args.workload, WorkloadSpec::Chat);
        assert_eq!(args.embedded, Embedded::Small);
        assert_eq!(args.max_in_flight, 16);
        assert_eq!(args.preempt, PreemptMode::Recompute);
        assert_eq!(args.depth, 1);
        assert!(args.model.is_none() && args.kv_blocks.is_none() && !args.verify);
        // The embedded default does not conflict with --model.
        let args = Args::try_parse_from(["replay", "--model", "m"]).unwrap();
        assert_eq!(args.model, Some(PathBuf::from("m")));
    }

    #[test]
    fn clap_definition_is_consistent() {
        use clap::CommandFactory;
        Args::command().debug_assert();
    }
}
