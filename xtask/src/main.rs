//! Project automation, run as `cargo xtask <command>` (the alias is in `.cargo/config.toml`).
//!
//! - `cargo xtask ci` runs exactly what CI runs (`.ci/run` calls it): formatting, tidy checks,
//!   clippy with warnings denied, the whole test suite, each library crate checked alone with no
//!   default features, docs with warnings denied, and `codegen --check`. It stops at the first
//!   failing stage and prints one line per stage with its wall time. If it passes locally, CI is
//!   green. `cargo xtask ci --list` shows the stages and their commands.
//! - `cargo xtask tidy` runs only the tidy checks (see `tidy.rs`): every `.rs` file starts with
//!   `//!`; `unsafe` appears only in `device-cuda` (with `SAFETY` comments there) and every other
//!   library or binary root has `#![forbid(unsafe_code)]`; only `scheduler/src/backend.rs` names
//!   a concrete router; the dependency invariants of DESIGN.md hold in `cargo metadata`; every
//!   crate opts into the workspace lints; no `#[should_panic]` and no `#[ignore]` without a reason.
//! - `cargo xtask codegen [--check] [NAME]` regenerates checked-in files, or with `--check` fails
//!   when one is stale and leaves the tree as it was (see `codegen.rs`). The golden-file
//!   protocol: a golden test compares its output with a checked-in file, and with
//!   `XTASK_BLESS=1` in the environment it rewrites that file instead; `cargo xtask codegen`
//!   runs those tests with `XTASK_BLESS=1`, and `--check` does the same, diffs the result
//!   against what was there, and restores it.
//! - `cargo xtask bench [NAME] [-- ARGS]` runs the benchmarks of the workspace, of package
//!   `NAME`, or of bench target `NAME`, passing `ARGS` to the harness.
//!
//! xtask is a command-line tool, not a library: it prints, and it uses only std, `serde_json`
//! for `cargo metadata`, and `thiserror`.
#![forbid(unsafe_code)]

mod bench;
mod ci;
mod cmd;
mod codegen;
mod diff;
mod lex;
mod metadata;
mod tidy;

use std::process::ExitCode;

use cmd::Error;

/// The help text, also shown after a usage error.
pub const USAGE: &str = "\
usage: cargo xtask <command>

commands:
  ci [--list]                 run every CI stage, failing fast (--list: show the stages)
  tidy                        run the tidy checks only
  codegen [--check] [NAME]    regenerate checked-in files (--check: fail if any is stale)
  bench [NAME] [-- ARGS]      run benchmarks: all, one package, or one bench target
  help                        show this text";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match dispatch(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("xtask: {err}");
            ExitCode::FAILURE
        }
    }
}

/// Runs the command named by `args`.
fn dispatch(args: &[String]) -> Result<(), Error> {
    let root = cmd::workspace_root();
    let (command, rest) = match args.split_first() {
        Some((command, rest)) => (command.as_str(), rest),
        None => return Err(Error::Usage("no command given".to_owned())),
    };
    let rest: Vec<&str> = rest.iter().map(String::as_str).collect();
    match (command, rest.as_slice()) {
        ("ci", []) => ci::run(&root),
        ("ci", ["--list"]) => {
            ci::list();
            Ok(())
        }
        ("tidy", []) => tidy::run(&root),
        ("codegen", flags) => {
            let check = flags.contains(&"--check");
            let names: Vec<&str> = flags.iter().copied().filter(|f| *f != "--check").collect();
            if let Some(bad) = names.iter().find(|n| n.starts_with('-')) {
                return Err(Error::Usage(format!("unknown codegen flag `{bad}`")));
            }
            if names.len() > 1 {
                return Err(Error::Usage(format!(
                    "codegen takes one generator name, got {}",
                    names.join(" ")
                )));
            }
            let mode = if check {
                codegen::Mode::Check
            } else {
                codegen::Mode::Write
            };
            codegen::run(&root, mode, names.first().copied())
        }
        ("bench", rest) => {
            let (selection, harness) = match rest.iter().position(|a| *a == "--") {
                Some(i) => (&rest[..i], &rest[i + 1..]),
                None => (rest, &[][..]),
            };
            if selection.len() > 1 {
                return Err(Error::Usage(format!(
                    "bench takes one name, got {}",
                    selection.join(" ")
                )));
            }
            let harness: Vec<String> = harness.iter().map(|s| (*s).to_owned()).collect();
            bench::run(selection.first().copied(), &harness)
        }
        ("help" | "-h" | "--help", []) => {
            println!("{USAGE}");
            Ok(())
        }
        (command, rest) => {
            let line = std::iter::once(command)
                .chain(rest.iter().copied())
                .collect::<Vec<_>>()
                .join(" ");
            Err(Error::Usage(format!(
                "unknown command or arguments `{line}`"
            )))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The usage error `args` produce (these inputs never start any work).
    fn usage_error(args: &[&str]) -> String {
        let args: Vec<String> = args.iter().map(|a| (*a).to_owned()).collect();
        match dispatch(&args) {
            Err(Error::Usage(message)) => message,
            other => panic!("expected a usage error for {args:?}, got {other:?}"),
        }
    }

    #[test]
    fn bad_command_lines_are_usage_errors() {
        assert_eq!(usage_error(&[]), "no command given");
        assert_eq!(
            usage_error(&["deploy"]),
            "unknown command or arguments `deploy`"
        );
        assert_eq!(
            usage_error(&["ci", "--fast"]),
            "unknown command or arguments `ci --fast`"
        );
        assert_eq!(
            usage_error(&["tidy", "x"]),
            "unknown command or arguments `tidy x`"
        );
        assert_eq!(
            usage_error(&["codegen", "--force"]),
            "unknown codegen flag `--force`"
        );
        assert_eq!(
            usage_error(&["codegen", "a", "b"]),
            "codegen takes one generator name, got a b"
        );
        assert_eq!(
            usage_error(&["codegen", "--check", "nope"]),
            "unknown generator `nope`; generators: golden"
        );
        assert_eq!(
            usage_error(&["bench", "a", "b", "--", "--quick"]),
            "bench takes one name, got a b"
        );
    }

    #[test]
    fn usage_errors_show_the_help_text() {
        let shown = Error::Usage("no command given".to_owned()).to_string();
        assert_eq!(shown, format!("no command given\n\n{USAGE}"));
    }
}
