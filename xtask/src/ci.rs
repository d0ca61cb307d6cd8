//! `cargo xtask ci`: exactly what CI runs, stage by stage, stopping at the first failure.
//!
//! Each stage prints the command it runs, then one line with its outcome and wall time; the
//! run ends with a summary of every stage's time. Stages, cheapest first so a mistake fails fast:
//! 1. `fmt`: `cargo fmt --all -- --check`;
//! 2. `tidy`: the checks of [`crate::tidy`] (module docs, unsafe code, router names, dependency
//!    invariants, workspace lints, test attributes); they are also `#[test]`s of xtask, so
//!    `cargo test` runs them too;
//! 3. `clippy`: `cargo clippy --workspace --all-targets -- -D warnings`;
//! 4. `test`: `cargo test --workspace`, then `test replay plot`: the replay's tests again with
//!    its `plot` feature (off by default), which only adds the plot module and plotters, and
//!    `test model region-timing`: the model's unit tests and examples with its `region-timing`
//!    feature (off by default: the per-region timing of `throughput --regions`);
//! 5. `check <crate>`: `cargo check -p <crate> --no-default-features` for each library crate
//!    in [`ALONE`], so a crate that compiles only thanks to features another crate turns on in
//!    the unified build is caught;
//! 6. `check replay cuda`: the main job with the engine's CUDA backend (`--features cuda`);
//! 7. `doc`: `RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps`;
//! 8. `readme example`: the README's library example checked in a scratch crate that depends on
//!    `scheduler` alone (see [`crate::readme`]), offline, reusing the target directory;
//! 9. `codegen`: `cargo xtask codegen --check`, run in this process (see [`crate::codegen`]).

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use crate::cmd::{self, Error};
use crate::codegen;
use crate::readme;
use crate::tidy;

/// The library crates checked one by one with no default features.
pub const ALONE: &[&str] = &[
    "device-io",
    "device-trace",
    "kv-cache",
    "workload-trace",
    "ssm-snapshot",
    "model",
    "router-book",
    "device-cpu",
    "device-cuda",
    "scheduler",
];

/// What a stage does.
#[derive(Debug)]
enum Action {
    /// Run a cargo command.
    Cargo(Command),
    /// Run the tidy checks in process.
    Tidy,
    /// Run `codegen --check` in process.
    CodegenCheck,
    /// Check the README's library example in a scratch crate.
    ReadmeExample,
}

/// One stage of the pipeline.
#[derive(Debug)]
struct Stage {
    name: String,
    action: Action,
}

impl Stage {
    fn cargo(name: &str, args: &[&str]) -> Self {
        Stage {
            name: name.to_owned(),
            action: Action::Cargo(cmd::cargo(args)),
        }
    }

    /// The command line this stage stands for.
    fn describe(&self) -> String {
        match &self.action {
            Action::Cargo(command) => cmd::display(command),
            Action::Tidy => "cargo xtask tidy".to_owned(),
            Action::CodegenCheck => "cargo xtask codegen --check".to_owned(),
            Action::ReadmeExample => {
                "cargo check --offline --manifest-path <target>/xtask/readme-example/Cargo.toml"
                    .to_owned()
            }
        }
    }

    fn run(&mut self, root: &Path) -> Result<(), Error> {
        match &mut self.action {
            Action::Cargo(command) => cmd::run(command),
            Action::Tidy => tidy::run(root),
            Action::CodegenCheck => codegen::run(root, codegen::Mode::Check, None),
            Action::ReadmeExample => readme::check(root),
        }
    }
}

/// The stages, in order.
fn stages() -> Vec<Stage> {
    let mut stages = vec![
        Stage::cargo("fmt", &["fmt", "--all", "--", "--check"]),
        Stage {
            name: "tidy".to_owned(),
            action: Action::Tidy,
        },
        Stage::cargo(
            "clippy",
            &[
                "clippy",
                "--workspace",
                "--all-targets",
                "--",
                "-D",
                "warnings",
            ],
        ),
        Stage::cargo("test", &["test", "--workspace"]),
        Stage::cargo(
            "test replay plot",
            &["test", "-p", "replay", "--features", "plot"],
        ),
        Stage::cargo(
            "test model region-timing",
            &[
                "test",
                "-p",
                "model",
                "--features",
                "region-timing",
                "--lib",
                "--examples",
            ],
        ),
    ];
    for krate in ALONE {
        stages.push(Stage::cargo(
            &format!("check {krate}"),
            &["check", "-p", krate, "--no-default-features"],
        ));
    }
    // The CUDA backend of the engine builds everywhere (the driver is loaded at run time).
    stages.push(Stage::cargo(
        "check replay cuda",
        &["check", "-p", "replay", "--features", "cuda"],
    ));
    let mut doc = Stage::cargo("doc", &["doc", "--workspace", "--no-deps"]);
    if let Action::Cargo(command) = &mut doc.action {
        command.env("RUSTDOCFLAGS", "-D warnings");
    }
    stages.push(doc);
    stages.push(Stage {
        name: "readme example".to_owned(),
        action: Action::ReadmeExample,
    });
    stages.push(Stage {
        name: "codegen".to_owned(),
        action: Action::CodegenCheck,
    });
    stages
}

/// `12.3s` under a minute, `4m05s` above.
pub fn format_duration(duration: Duration) -> String {
    let secs = duration.as_secs_f64();
    if secs < 60.0 {
        format!("{secs:.1}s")
    } else {
        let whole = duration.as_secs();
        format!("{}m{:02}s", whole / 60, whole % 60)
    }
}

/// `cargo xtask ci --list`: the stages and their commands.
pub fn list() {
    for stage in stages() {
        println!("{:<22} {}", stage.name, stage.describe());
    }
}

/// `cargo xtask ci`: runs every stage, stopping at the first failure.
pub fn run(root: &Path) -> Result<(), Error> {
    let started = Instant::now();
    let mut done: Vec<(String, Duration)> = Vec::new();
    for mut stage in stages() {
        eprintln!("ci: {} $ {}", stage.name, stage.describe());
        let stage_started = Instant::now();
        let result = stage.run(root);
        let elapsed = stage_started.elapsed();
        if let Err(err) = result {
            println!(
                "ci: {:<22} FAILED after {}",
                stage.name,
                format_duration(elapsed)
            );
            if stage.name == "fmt" {
                println!("ci: run `cargo fmt --all` to fix the formatting");
            }
            return Err(err);
        }
        println!("ci: {:<22} ok  {:>8}", stage.name, format_duration(elapsed));
        done.push((stage.name, elapsed));
    }
    println!(
        "ci: all {} stages passed in {}",
        done.len(),
        format_duration(started.elapsed())
    );
    for (name, elapsed) in &done {
        println!("    {name:<22} {:>8}", format_duration(*elapsed));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metadata::Metadata;

    #[test]
    fn durations() {
        assert_eq!(format_duration(Duration::from_millis(400)), "0.4s");
        assert_eq!(format_duration(Duration::from_millis(59_940)), "59.9s");
        assert_eq!(format_duration(Duration::from_secs(245)), "4m05s");
    }

    #[test]
    fn stages_in_order() {
        let names: Vec<String> = stages().into_iter().map(|s| s.name).collect();
        let mut expected: Vec<String> = [
            "fmt",
            "tidy",
            "clippy",
            "test",
            "test replay plot",
            "test model region-timing",
        ]
        .map(String::from)
        .to_vec();
        expected.extend(ALONE.iter().map(|c| format!("check {c}")));
        expected
            .extend(["check replay cuda", "doc", "readme example", "codegen"].map(String::from));
        assert_eq!(names, expected);
        let doc = stages().into_iter().find(|s| s.name == "doc").unwrap();
        assert_eq!(
            doc.describe(),
            "RUSTDOCFLAGS=\"-D warnings\" cargo doc --workspace --no-deps"
        );
    }

    /// Every library crate of the workspace except the test and tooling crates is checked alone,
    /// so a new crate cannot be forgotten here.
    #[test]
    fn every_library_crate_is_checked_alone() {
        let metadata = Metadata::load().unwrap();
        let libraries: Vec<&str> = metadata
            .members()
            .into_iter()
            .filter(|(name, p)| {
                !matches!(*name, "tests" | "xtask")
                    && p.targets.iter().any(|t| t.kind.iter().any(|k| k == "lib"))
            })
            .map(|(name, _)| name)
            .collect();
        let mut alone = ALONE.to_vec();
        alone.sort_unstable();
        assert_eq!(libraries, alone);
    }
}
