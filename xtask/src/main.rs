//! Project automation, run as `cargo xtask <command>` (the alias is in `.cargo/config.toml`).
//!
//! - `cargo xtask ci` runs exactly what CI runs (`.ci/run` calls it): formatting, tidy checks,
//!   clippy with warnings denied, the whole test suite, each library crate checked alone with no
//!   default features, docs with warnings denied, the README's library example checked in a
//!   scratch crate that depends on `scheduler` alone, and `codegen --check`. It stops at the first
//!   failing stage and prints one line per stage with its wall time. If it passes locally, CI is
//!   green. `cargo xtask ci --list` shows the stages and their commands.
//! - `cargo xtask tidy` runs only the tidy checks (see `tidy.rs`): every `.rs` file starts with
//!   `//!`; `unsafe` appears only in `device-cuda` (with `SAFETY` comments there) and every other
//!   library or binary root has `#![forbid(unsafe_code)]`; only `scheduler/src/backend.rs` names
//!   a concrete router; the dependency invariants of ARCHITECTURE.md hold in `cargo metadata`; every
//!   crate opts into the workspace lints; no `#[should_panic]` and no `#[ignore]` without a reason.
//! - `cargo xtask codegen [--check] [NAME]` regenerates checked-in files, or with `--check` fails
//!   when one is stale and leaves the tree as it was (see `codegen.rs`). The golden-file
//!   protocol: a golden test compares its output with a checked-in file, and with
//!   `XTASK_BLESS=1` in the environment it rewrites that file instead; `cargo xtask codegen`
//!   runs those tests with `XTASK_BLESS=1`, and `--check` does the same, diffs the result
//!   against what was there, and restores it.
//! - `cargo xtask bench [NAME] [-- ARGS]` runs the benchmarks of the workspace, of package
//!   `NAME`, or of bench target `NAME`, passing `ARGS` to the harness.
//! - `cargo xtask soak [-- ARGS]` runs the full soak (not in CI): 2,000 requests from 8 client
//!   threads on the host router with the tiny fixture, the same under memory pressure (spill to
//!   memory, to a directory, recompute), and random faults on the scripted router; it prints one
//!   JSON object per run and, last, the totals, and fails when any failure count is not zero.
//!   `ARGS` go to the soak (`--requests`, `--clients`, `--seed`, ...; `-- --help` lists them),
//!   among them the features served under load: `--router host|cuda-sim`, `--depth 1|2`,
//!   `--mtp K` (with `--drafter head|perfect|adversarial`), `--sampled-percent P`, `--lora N`,
//!   `--followup-percent P` (later turns of conversations), `--stop-percent P`,
//!   `--router-fault-per-mille M` (launches, steps failed inside the router, effects) and
//!   `--runs load,pressure,faults`.
//!
//! xtask is a command-line tool, not a library: it prints, and it uses only std, `clap` for its
//! command line, `serde_json` for `cargo metadata`, `thiserror`, and `cudarc`'s NVRTC bindings
//! (loaded at run time) for the PTX generator.
#![forbid(unsafe_code)]

mod bench;
mod ci;
mod cmd;
mod codegen;
mod diff;
mod gpu;
mod lex;
mod metadata;
mod ptx;
mod readme;
mod tidy;

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use cmd::Error;

/// `cargo xtask <COMMAND>`.
#[derive(Debug, Parser)]
#[command(
    name = "xtask",
    bin_name = "cargo xtask",
    version,
    about = "Project automation: exactly what CI runs, tidy checks, generated files, benchmarks."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run every CI stage, failing fast, one line per stage with its wall time
    Ci {
        /// Show the stages and their commands instead of running them
        #[arg(long)]
        list: bool,
    },
    /// Run the tidy checks only, each violation as `file:line: message`
    Tidy,
    /// Regenerate checked-in generated files (golden traces, the PTX of the CUDA kernels)
    Codegen {
        /// Fail with a diff when a generated file is stale or orphaned; leave the tree unchanged
        #[arg(long)]
        check: bool,
        /// Run only this generator [default: all]
        #[arg(value_name = "NAME")]
        generator: Option<String>,
    },
    /// Run the full soak (release build; not in CI); its last line is one JSON object
    Soak {
        /// Arguments for the soak (--requests, --seed, --router, --depth, --mtp, --sampled-percent,
        /// --lora, ...), after `--`
        #[arg(last = true, value_name = "ARGS")]
        args: Vec<String>,
    },
    /// Run the benchmarks: all of them, one package's, or one bench target's
    Bench {
        /// A workspace package or a bench target [default: all]
        #[arg(value_name = "NAME")]
        name: Option<String>,
        /// Arguments for the benchmark harness (criterion), after `--`
        #[arg(last = true, value_name = "ARGS")]
        harness: Vec<String>,
    },
    /// Every check and figure that needs an NVIDIA GPU, in one run (no GPU: the reason, exit 1)
    GpuCheck,
    /// The child process of the `ptx` generator, started with NVRTC on LD_LIBRARY_PATH
    #[command(hide = true)]
    NvrtcCompile {
        /// The kernel folder (`device-cuda/kernels`)
        kernels: std::path::PathBuf,
        /// Where the PTX goes
        out: std::path::PathBuf,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match dispatch(cli.command) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("xtask: {err}");
            ExitCode::FAILURE
        }
    }
}

/// Runs `command`.
fn dispatch(command: Command) -> Result<(), Error> {
    let root = cmd::workspace_root();
    match command {
        Command::Ci { list: false } => ci::run(&root),
        Command::Ci { list: true } => {
            ci::list();
            Ok(())
        }
        Command::Tidy => tidy::run(&root),
        Command::Codegen { check, generator } => {
            let mode = if check {
                codegen::Mode::Check
            } else {
                codegen::Mode::Write
            };
            codegen::run(&root, mode, generator.as_deref())
        }
        Command::Bench { name, harness } => bench::run(name.as_deref(), &harness),
        Command::Soak { args } => {
            let mut command =
                cmd::cargo(&["run", "--release", "-p", "tests", "--bin", "soak", "--"]);
            command.args(&args);
            eprintln!("$ {}", cmd::display(&command));
            cmd::run(&mut command)
        }
        Command::GpuCheck => gpu::run(),
        Command::NvrtcCompile { kernels, out } => ptx::compile_all(&kernels, &out),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The first line of the error clap gives for `args`.
    fn parse_error(args: &[&str]) -> String {
        let err = Cli::try_parse_from(std::iter::once("xtask").chain(args.iter().copied()))
            .expect_err("expected a usage error");
        err.to_string()
            .lines()
            .next()
            .unwrap_or_default()
            .to_owned()
    }

    #[test]
    fn bad_command_lines_are_refused_naming_what_is_wrong() {
        assert_eq!(
            parse_error(&["deploy"]),
            "error: unrecognized subcommand 'deploy'"
        );
        assert_eq!(
            parse_error(&["ci", "--fast"]),
            "error: unexpected argument '--fast' found"
        );
        assert_eq!(
            parse_error(&["tidy", "x"]),
            "error: unexpected argument 'x' found"
        );
        assert_eq!(
            parse_error(&["codegen", "--force"]),
            "error: unexpected argument '--force' found"
        );
        assert_eq!(
            parse_error(&["codegen", "a", "b"]),
            "error: unexpected argument 'b' found"
        );
        assert_eq!(
            parse_error(&["bench", "a", "b", "--", "--quick"]),
            "error: unexpected argument 'b' found"
        );
        // With no command, clap prints the help (as an error, exit status 2).
        let err = Cli::try_parse_from(["xtask"]).unwrap_err();
        assert!(err.to_string().contains("Commands:"), "{err}");
    }

    #[test]
    fn good_command_lines_parse() {
        let parse = |args: &[&str]| {
            Cli::try_parse_from(std::iter::once("xtask").chain(args.iter().copied()))
                .unwrap()
                .command
        };
        assert!(matches!(
            parse(&["ci", "--list"]),
            Command::Ci { list: true }
        ));
        assert!(matches!(
            parse(&["codegen", "--check", "golden"]),
            Command::Codegen { check: true, generator: Some(g) } if g == "golden"
        ));
        let Command::Bench { name, harness } = parse(&["bench", "kv-cache", "--", "--quick"])
        else {
            panic!("expected bench");
        };
        assert_eq!(name.as_deref(), Some("kv-cache"));
        assert_eq!(harness, ["--quick"]);
    }

    #[test]
    fn an_unknown_generator_is_named_before_any_work() {
        let err = dispatch(Command::Codegen {
            check: true,
            generator: Some("nope".to_owned()),
        })
        .unwrap_err();
        assert_eq!(
            err.to_string(),
            "unknown generator `nope`; generators: golden, ptx (see `cargo xtask --help`)"
        );
    }

    #[test]
    fn clap_definition_is_consistent() {
        use clap::CommandFactory;
        Cli::command().debug_assert();
    }
}
