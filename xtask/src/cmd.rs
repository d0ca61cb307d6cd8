//! Running commands: the workspace root, `cargo` itself, and a child process whose failure is a
//! typed error naming the command line.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus};

/// Why an xtask command failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A child process could not be started (missing program, bad working directory).
    #[error("could not start `{command}`: {source}")]
    Spawn {
        command: String,
        source: std::io::Error,
    },
    /// A child process ran and exited unsuccessfully.
    #[error("`{command}` failed ({status})")]
    Failed { command: String, status: ExitStatus },
    /// A file or directory could not be read or written.
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    /// `cargo metadata` printed something that is not the JSON it documents.
    #[error("`cargo metadata` output is not valid metadata JSON: {0}")]
    Metadata(#[from] serde_json::Error),
    /// The tidy checks found violations (each already printed with file and line).
    #[error("tidy: {count} violation(s)")]
    Tidy { count: usize },
    /// Generated files differ from what their generators produce now.
    #[error("codegen: {count} generated file(s) are stale; run `cargo xtask codegen` and commit the result")]
    Stale { count: usize },
    /// `cargo xtask gpu-check` could not check (no usable GPU) or some of its steps failed.
    #[error("gpu-check: {0}")]
    GpuCheck(String),
    /// The command line was not understood.
    #[error("{0} (see `cargo xtask --help`)")]
    Usage(String),
}

/// The workspace root: the parent of this crate's manifest directory.
pub fn workspace_root() -> PathBuf {
    let manifest_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    manifest_dir.parent().unwrap_or(manifest_dir).to_path_buf()
}

/// A `cargo` command run in the workspace root. Uses the `cargo` that started xtask (the `CARGO`
/// variable cargo sets for `cargo run` and `cargo test`), so nested calls use the same toolchain.
pub fn cargo(args: &[&str]) -> Command {
    let program = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut command = Command::new(program);
    command.args(args).current_dir(workspace_root());
    command
}

/// The command line of `command` as a person would type it, environment overrides first
/// (`RUSTDOCFLAGS=-D warnings cargo doc ...`). The program is shown by its file name.
pub fn display(command: &Command) -> String {
    let mut line = String::new();
    for (key, value) in command.get_envs() {
        if let Some(value) = value {
            let value = value.to_string_lossy();
            let quoted = if value.contains(' ') {
                format!("\"{value}\"")
            } else {
                value.into_owned()
            };
            let _ = write!(line, "{}={quoted} ", key.to_string_lossy());
        }
    }
    let program = Path::new(command.get_program());
    let name = program
        .file_name()
        .unwrap_or(program.as_os_str())
        .to_string_lossy();
    line.push_str(&name);
    for arg in command.get_args() {
        line.push(' ');
        line.push_str(&arg.to_string_lossy());
    }
    line
}

/// Runs `command` with inherited standard streams; an unsuccessful exit is an error.
pub fn run(command: &mut Command) -> Result<(), Error> {
    let status = command.status().map_err(|source| Error::Spawn {
        command: display(command),
        source,
    })?;
    if status.success() {
        Ok(())
    } else {
        Err(Error::Failed {
            command: display(command),
            status,
        })
    }
}

/// Runs `command` and returns its standard output; standard error passes through.
pub fn output(command: &mut Command) -> Result<Vec<u8>, Error> {
    command.stderr(std::process::Stdio::inherit());
    let out = command.output().map_err(|source| Error::Spawn {
        command: display(command),
        source,
    })?;
    if out.status.success() {
        Ok(out.stdout)
    } else {
        Err(Error::Failed {
            command: display(command),
            status: out.status,
        })
    }
}

/// Every regular file under `dirs`, skipping `target/` and hidden folders; a missing folder
/// contributes nothing. The order is unspecified: callers sort what they keep.
pub fn files_under(dirs: &[PathBuf]) -> Result<Vec<PathBuf>, Error> {
    let mut files = Vec::new();
    let mut pending: Vec<PathBuf> = dirs.to_vec();
    while let Some(dir) = pending.pop() {
        if !dir.is_dir() {
            continue;
        }
        let io = |path: &Path| {
            let path = path.to_path_buf();
            move |source| Error::Io { path, source }
        };
        for entry in std::fs::read_dir(&dir).map_err(io(&dir))? {
            let entry = entry.map_err(io(&dir))?;
            let path = entry.path();
            let file_type = entry.file_type().map_err(io(&path))?;
            let name = entry.file_name();
            let name = name.to_string_lossy();
            if file_type.is_dir() {
                if name != "target" && !name.starts_with('.') {
                    pending.push(path);
                }
            } else if file_type.is_file() {
                files.push(path);
            }
        }
    }
    Ok(files)
}

/// `path` relative to `root`, with `/` separators; `path` itself when it is not under `root`.
pub fn relative(root: &Path, path: &Path) -> String {
    let rel = path.strip_prefix(root).unwrap_or(path);
    rel.components()
        .map(|c| c.as_os_str().to_string_lossy())
        .collect::<Vec<_>>()
        .join("/")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn display_shows_environment_overrides_and_arguments() {
        let mut command = Command::new("/usr/bin/cargo");
        command
            .args(["doc", "--no-deps"])
            .env("RUSTDOCFLAGS", "-D warnings");
        assert_eq!(
            display(&command),
            "RUSTDOCFLAGS=\"-D warnings\" cargo doc --no-deps"
        );
    }

    #[test]
    fn workspace_root_holds_the_workspace_manifest() {
        let manifest = std::fs::read_to_string(workspace_root().join("Cargo.toml")).unwrap();
        assert!(
            manifest.contains("[workspace]"),
            "not a workspace manifest:\n{manifest}"
        );
    }
}
