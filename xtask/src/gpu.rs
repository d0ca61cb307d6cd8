//! `cargo xtask gpu-check`: the checks that need an NVIDIA GPU, in one run (under five minutes on
//! an H200 with a cold build): the device-cuda tests in release mode (on a GPU machine the
//! `CudaRuntime` tests open the device instead of reporting the missing driver), then the
//! `gpu_check` example (every kernel on the GPU against `SimRuntime`, the model's head on both,
//! the router's effects on both compared bit for bit, and the copy bandwidth of the effects
//! against a plain device-to-device memcpy), then the `replay` binary (`-p replay --features
//! cuda`) with `--device cuda`, which must refuse with the CUDA router's reason, then the
//! `forward_bench` example (the forward step's parity on the GPU and the NemotronH-8B-shape
//! throughput figures).
//! Without a GPU every step still runs and says that it skipped the device.

use std::process::Command;
use std::time::Instant;

use crate::cmd::{self, Error};

/// Runs every GPU check, printing each step's wall time.
pub fn run() -> Result<(), Error> {
    let started = Instant::now();
    let steps: [(&str, Vec<&str>); 3] = [
        (
            "device-cuda tests",
            vec!["test", "--release", "-p", "device-cuda"],
        ),
        (
            "kernels, head, effects and bandwidth on the GPU",
            vec![
                "run",
                "--release",
                "-p",
                "device-cuda",
                "--example",
                "gpu_check",
            ],
        ),
        (
            "build replay with the cuda feature",
            vec!["build", "--release", "-p", "replay", "--features", "cuda"],
        ),
    ];
    for (what, args) in steps {
        let step = Instant::now();
        eprintln!("gpu-check: {what}");
        cmd::run(&mut cmd::cargo(&args))?;
        eprintln!(
            "gpu-check: {what}: ok in {:.1}s",
            step.elapsed().as_secs_f64()
        );
    }
    // The replay must refuse the CUDA device with a reason (the engine is not built on it yet).
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| cmd::workspace_root().join("target"));
    let mut replay = Command::new(target.join("release/replay"));
    replay.args([
        "--device",
        "cuda",
        "--embedded",
        "mini",
        "--max-requests",
        "2",
    ]);
    eprintln!("gpu-check: $ {}", cmd::display(&replay));
    match cmd::run(&mut replay) {
        Err(Error::Failed { .. }) => {
            eprintln!("gpu-check: replay --device cuda refused, as it must in part 1")
        }
        Ok(()) => {
            return Err(Error::Io {
                path: target.join("release/replay"),
                source: std::io::Error::other(
                    "replay --device cuda succeeded, but part 1 cannot serve on CUDA",
                ),
            })
        }
        Err(other) => return Err(other),
    }
    // The forward step on the GPU: parity with the host model on both fixtures, then NemotronH-8B's
    // shape with random bf16 weights (decode at batch 1, 64, 256; a 4k prefill; the fraction of
    // the bandwidth limit at batch 1).
    let step = Instant::now();
    eprintln!("gpu-check: forward parity and the 8B-shape bench");
    cmd::run(&mut cmd::cargo(&[
        "run",
        "--release",
        "-p",
        "device-cuda",
        "--example",
        "forward_bench",
    ]))?;
    eprintln!(
        "gpu-check: forward parity and the 8B-shape bench: ok in {:.1}s",
        step.elapsed().as_secs_f64()
    );
    eprintln!("gpu-check: done in {:.1}s", started.elapsed().as_secs_f64());
    Ok(())
}
