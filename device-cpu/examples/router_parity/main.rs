//! `cargo run --release -p device-cpu --example router_parity -- PATH`: checks a fixture folder of the
//! shared layout through the host router's `DeviceIo` interface only, each case twice with the
//! prefix cache on (the second run served from the cache), and exits non-zero on failure.

mod check;

use std::process::ExitCode;

/// The agreement asked of the host router (the fixture's README: a careful f32 port lands near 1e-5).
const TOLERANCE: f32 = 1e-4;

fn main() -> ExitCode {
    let Some(path) = std::env::args().nth(1) else {
        eprintln!(
            "usage: router_parity PATH (a fixture folder with model/, expected.safetensors, cases.json)"
        );
        return ExitCode::from(2);
    };
    let reports = match check::check_fixture(std::path::Path::new(&path)) {
        Ok(reports) => reports,
        Err(err) => {
            eprintln!("error: {err}");
            return ExitCode::from(2);
        }
    };
    let mut all_ok = true;
    for r in &reports {
        let ok = r.ok(TOLERANCE);
        all_ok &= ok;
        println!(
            "case {} run {}: prompt {:>4} tokens, cached {:>4}, max |diff| prompt {:.3e} decode {:.3e}, greedy {}, bits as run 1: {}  {}",
            r.case,
            r.run,
            r.prompt_len,
            r.cached,
            r.prompt_diff,
            r.decode_diff,
            if r.greedy_ok { "same" } else { "DIFFERENT" },
            if r.same_bits_as_first { "same" } else { "DIFFERENT" },
            if ok { "OK" } else { "FAIL" }
        );
    }
    println!("{}", if all_ok { "OK" } else { "FAIL" });
    if all_ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
