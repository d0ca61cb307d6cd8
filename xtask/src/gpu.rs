//! `cargo xtask gpu-check`: every check and figure that needs an NVIDIA GPU, in one run (a few
//! minutes on an H200 once built; the builds come first and are timed apart).
//!
//! 1. Builds, in release: the device-cuda examples and `replay` with its `cuda` feature.
//! 2. Probes the device (`forward_bench --probe`, which opens `CudaRuntime`). Without a usable
//!    GPU it stops here with the runtime's typed reason (no driver, no device, a driver too old)
//!    and a non-zero exit: nothing was checked, and nothing is reported as passing.
//! 3. `forward_bench`: the forward step's parity on the GPU against the host model (both
//!    fixtures, f32 and bf16), then the NemotronH-8B-shape figures (decode tokens/s at batch 1,
//!    64 and 256 with a 1k context, prefill tokens/s of a 4k prompt, the fraction of the
//!    memory-bandwidth limit at batch 1, target 60%).
//! 4. `gpu_check`: every part-1 kernel on the GPU against `SimRuntime`, the model's head on both,
//!    router steps on both (prefill, decode, a speculative `Verify` with its `TruncateKv` and
//!    `SsmSnapshotRestore`), the router's effects on both bit for bit, and the effects' copy
//!    bandwidth.
//! 5. The device-cuda tests in release (on a GPU machine the `CudaRuntime` tests open the device).
//! 6. `replay --device cuda --embedded mini --verify`: the main job end to end on the CUDA router.
//! 7. `replay --device cuda --embedded mini --mtp 2 --verify`: speculative decoding with the MTP
//!    head on the CUDA router (`Draft`, `Verify` and the rewind), against plain decoding.
//!
//! Steps 3 to 7 all run even when one fails, so one run gives every figure; the summary names each
//! step's outcome and time, and the exit is non-zero when any failed.

use std::path::PathBuf;
use std::process::Command;
use std::time::Instant;

use crate::cmd::{self, Error};

/// The release target folder (where `cargo build --release` puts binaries).
fn release_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| cmd::workspace_root().join("target"))
        .join("release")
}

/// Runs every GPU check, printing each step's wall time and a summary.
pub fn run() -> Result<(), Error> {
    let started = Instant::now();
    for (what, args) in [
        (
            "build the device-cuda examples",
            vec!["build", "--release", "-p", "device-cuda", "--examples"],
        ),
        (
            "build replay with the cuda feature",
            vec!["build", "--release", "-p", "replay", "--features", "cuda"],
        ),
    ] {
        let step = Instant::now();
        eprintln!("gpu-check: {what}");
        cmd::run(&mut cmd::cargo(&args))?;
        eprintln!("gpu-check: {what}: {:.1}s", step.elapsed().as_secs_f64());
    }
    let examples = release_dir().join("examples");
    probe(&examples.join("forward_bench"))?;
    let checks_started = Instant::now();
    let mut replay = Command::new(release_dir().join("replay"));
    replay.args([
        "--device",
        "cuda",
        "--embedded",
        "mini",
        "--max-requests",
        "16",
        "--verify",
    ]);
    // Speculative decoding on the GPU: the MTP head's drafts (`Draft`) and their verification
    // (`Verify`, `TruncateKv`, `SsmSnapshotRestore`), against plain decoding.
    let mut replay_mtp = Command::new(release_dir().join("replay"));
    replay_mtp.args([
        "--device",
        "cuda",
        "--embedded",
        "mini",
        "--max-requests",
        "8",
        "--mtp",
        "2",
        "--verify",
    ]);
    let steps: Vec<(&str, Command)> = vec![
        (
            "forward parity and the 8B-shape figures (forward_bench)",
            Command::new(examples.join("forward_bench")),
        ),
        (
            "part-1 kernels, head, effects and bandwidth (gpu_check)",
            Command::new(examples.join("gpu_check")),
        ),
        (
            "device-cuda tests in release",
            cmd::cargo(&["test", "--release", "-p", "device-cuda"]),
        ),
        ("replay --device cuda --verify", replay),
        ("replay --device cuda --mtp 2 --verify", replay_mtp),
    ];
    let mut outcomes = Vec::new();
    for (what, mut command) in steps {
        let step = Instant::now();
        eprintln!("gpu-check: {what}: $ {}", cmd::display(&command));
        let outcome = cmd::run(&mut command);
        let seconds = step.elapsed().as_secs_f64();
        match &outcome {
            Ok(()) => eprintln!("gpu-check: {what}: ok in {seconds:.1}s"),
            Err(err) => eprintln!("gpu-check: {what}: FAILED in {seconds:.1}s: {err}"),
        }
        outcomes.push((what, outcome.is_ok(), seconds));
    }
    eprintln!("gpu-check: summary");
    for (what, ok, seconds) in &outcomes {
        let verdict = if *ok { "ok" } else { "FAILED" };
        eprintln!("gpu-check:   {verdict:>6} {seconds:>7.1}s  {what}");
    }
    eprintln!(
        "gpu-check: checks {:.1}s, all with builds {:.1}s",
        checks_started.elapsed().as_secs_f64(),
        started.elapsed().as_secs_f64()
    );
    let failed: Vec<String> = outcomes
        .iter()
        .filter(|(_, ok, _)| !ok)
        .map(|(what, _, _)| (*what).to_owned())
        .collect();
    if failed.is_empty() {
        Ok(())
    } else {
        Err(Error::GpuCheck(format!(
            "{} of {} steps failed: {}",
            failed.len(),
            outcomes.len(),
            failed.join("; ")
        )))
    }
}

/// Opens the device through `forward_bench --probe`; its refusal (the runtime's typed error,
/// printed on its standard output) becomes this command's error.
fn probe(forward_bench: &std::path::Path) -> Result<(), Error> {
    let mut command = Command::new(forward_bench);
    command.arg("--probe");
    let out = command.output().map_err(|source| Error::Spawn {
        command: cmd::display(&command),
        source,
    })?;
    let text = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    if out.status.success() {
        eprintln!("gpu-check: {text}");
        Ok(())
    } else {
        Err(Error::GpuCheck(format!(
            "no usable GPU, nothing was checked: {text}"
        )))
    }
}
