//! `cargo xtask codegen [--check] [NAME]`: the registry of generators of checked-in files.
//!
//! Every generator writes its outputs in place, under folders it names. The driver snapshots
//! those folders, runs the generator, and compares:
//! - `cargo xtask codegen` keeps what was written and lists each file it updated, created or
//!   removed;
//! - `cargo xtask codegen --check` puts every file back as it was and fails when anything had
//!   changed, printing a diff per stale file and the command that regenerates them. It answers
//!   exactly "would `cargo xtask codegen` change the tree?", however each generator compares.
//!
//! Generators:
//! - `golden`: the golden files of tests that follow the bless protocol. A golden test compares
//!   its output with a checked-in file; when the environment variable `XTASK_BLESS` is `1` it
//!   writes its output to that file instead (creating it when missing) and passes. The packages
//!   holding such tests are found by the text `XTASK_BLESS` in their sources; the generator
//!   runs `cargo test -p <each>` with `XTASK_BLESS=1`. A test that fails for another reason fails
//!   the generator, and in `--check` mode the tree is restored all the same.
//!
//! A new generator (for example one emitting a `.rs` table that starts with
//! [`crate::tidy::GENERATED_HEADER`]) is one more entry in [`GENERATORS`].

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::cmd::{self, Error};
use crate::diff;
use crate::tidy;

/// Write the generated files, or check that they are up to date and leave the tree unchanged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Keep what the generators write.
    Write,
    /// Restore the tree afterwards and fail when anything had changed.
    Check,
}

/// One generator of checked-in files.
#[derive(Debug)]
pub struct Generator {
    /// Its name on the command line (`cargo xtask codegen golden`).
    pub name: &'static str,
    /// One line on what it generates.
    pub about: &'static str,
    /// The folders, relative to the workspace root, it may write to (snapshotted around a run).
    outputs: fn(&Path) -> Result<Vec<PathBuf>, Error>,
    /// Writes the generated files in place.
    generate: fn(&Path, &[PathBuf]) -> Result<(), Error>,
}

/// Every generator, in the order `cargo xtask codegen` runs them.
pub const GENERATORS: &[Generator] = &[Generator {
    name: "golden",
    about:
        "golden files of tests following the XTASK_BLESS protocol (cargo test with XTASK_BLESS=1)",
    outputs: golden_packages,
    generate: bless_golden,
}];

/// The environment variable of the bless protocol.
pub const BLESS_VAR: &str = "XTASK_BLESS";

/// The package folders whose sources mention [`BLESS_VAR`] (xtask itself excepted).
fn golden_packages(root: &Path) -> Result<Vec<PathBuf>, Error> {
    let mut packages: Vec<PathBuf> = tidy::source_files(root)?
        .iter()
        .filter(|f| f.text.contains(BLESS_VAR))
        .filter_map(|f| f.path.split('/').next().map(PathBuf::from))
        .filter(|dir| dir != Path::new("xtask") && root.join(dir).join("Cargo.toml").is_file())
        .collect();
    packages.dedup();
    Ok(packages)
}

/// Runs the tests of `packages` with `XTASK_BLESS=1`.
fn bless_golden(root: &Path, packages: &[PathBuf]) -> Result<(), Error> {
    if packages.is_empty() {
        return Ok(());
    }
    let mut command = cmd::cargo(&["test"]);
    command.current_dir(root).env(BLESS_VAR, "1");
    for package in packages {
        command.arg("-p").arg(package);
    }
    eprintln!("$ {}", cmd::display(&command));
    cmd::run(&mut command)
}

/// How one file differs after a generator ran.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Change {
    /// Path relative to the workspace root.
    pub path: String,
    /// Contents before the run; `None` when the generator created the file.
    pub before: Option<Vec<u8>>,
    /// Contents after the run; `None` when the generator removed the file.
    pub after: Option<Vec<u8>>,
}

impl Change {
    fn verb(&self) -> &'static str {
        match (&self.before, &self.after) {
            (None, _) => "created",
            (_, None) => "removed",
            _ => "updated",
        }
    }
}

/// Every file under `dirs` (relative to `root`), skipping `target/` and hidden folders.
fn snapshot(root: &Path, dirs: &[PathBuf]) -> Result<BTreeMap<String, Vec<u8>>, Error> {
    let mut files = BTreeMap::new();
    let mut pending: Vec<PathBuf> = dirs.iter().map(|d| root.join(d)).collect();
    while let Some(dir) = pending.pop() {
        if !dir.is_dir() {
            continue;
        }
        let entries = std::fs::read_dir(&dir).map_err(|source| Error::Io {
            path: dir.clone(),
            source,
        })?;
        for entry in entries {
            let entry = entry.map_err(|source| Error::Io {
                path: dir.clone(),
                source,
            })?;
            let path = entry.path();
            let name = entry.file_name();
            let name = name.to_string_lossy();
            if path.is_dir() {
                if name != "target" && !name.starts_with('.') {
                    pending.push(path);
                }
            } else if path.is_file() {
                let bytes = std::fs::read(&path).map_err(|source| Error::Io {
                    path: path.clone(),
                    source,
                })?;
                let rel = path.strip_prefix(root).unwrap_or(&path);
                let rel = rel
                    .components()
                    .map(|c| c.as_os_str().to_string_lossy())
                    .collect::<Vec<_>>()
                    .join("/");
                files.insert(rel, bytes);
            }
        }
    }
    Ok(files)
}

/// The files that differ between two snapshots.
fn changes(before: &BTreeMap<String, Vec<u8>>, after: &BTreeMap<String, Vec<u8>>) -> Vec<Change> {
    let mut paths: Vec<&String> = before.keys().chain(after.keys()).collect();
    paths.sort();
    paths.dedup();
    paths
        .into_iter()
        .filter(|p| before.get(*p) != after.get(*p))
        .map(|p| Change {
            path: p.clone(),
            before: before.get(p).cloned(),
            after: after.get(p).cloned(),
        })
        .collect()
}

/// Puts every changed file back as it was before the run.
fn restore(root: &Path, changes: &[Change]) -> Result<(), Error> {
    for change in changes {
        let path = root.join(&change.path);
        let result = match &change.before {
            Some(bytes) => std::fs::write(&path, bytes),
            None => std::fs::remove_file(&path),
        };
        result.map_err(|source| Error::Io { path, source })?;
    }
    Ok(())
}

/// What a stale file looks like: a diff of its text, or a size note for binary contents.
fn describe(change: &Change) -> String {
    let text = |bytes: &Option<Vec<u8>>| {
        bytes
            .as_deref()
            .map(|b| std::str::from_utf8(b).map(str::to_owned))
    };
    match (text(&change.before), text(&change.after)) {
        (Some(Ok(before)), Some(Ok(after))) => diff::unified(&before, &after),
        (None, Some(Ok(after))) => diff::unified("", &after),
        (Some(Ok(before)), None) => diff::unified(&before, ""),
        _ => format!(
            "(binary contents: {} bytes before, {} after)\n",
            change.before.as_ref().map_or(0, Vec::len),
            change.after.as_ref().map_or(0, Vec::len)
        ),
    }
}

/// Runs the generators (all of them, or the one named `only`) in `mode`.
pub fn run(root: &Path, mode: Mode, only: Option<&str>) -> Result<(), Error> {
    let selected: Vec<&Generator> = GENERATORS
        .iter()
        .filter(|g| only.is_none_or(|name| g.name == name))
        .collect();
    if selected.is_empty() {
        let names: Vec<&str> = GENERATORS.iter().map(|g| g.name).collect();
        return Err(Error::Usage(format!(
            "unknown generator `{}`; generators: {}",
            only.unwrap_or(""),
            names.join(", ")
        )));
    }
    let mut stale = 0;
    for generator in selected {
        let outputs = (generator.outputs)(root)?;
        if outputs.is_empty() {
            eprintln!(
                "codegen {}: nothing to generate ({})",
                generator.name, generator.about
            );
            continue;
        }
        let before = snapshot(root, &outputs)?;
        let generated = (generator.generate)(root, &outputs);
        let after = snapshot(root, &outputs)?;
        let changed = changes(&before, &after);
        if mode == Mode::Check {
            restore(root, &changed)?;
        }
        generated?;
        for change in &changed {
            match mode {
                Mode::Write => eprintln!(
                    "codegen {}: {} {}",
                    generator.name,
                    change.verb(),
                    change.path
                ),
                Mode::Check => {
                    eprintln!(
                        "codegen {}: stale {} (regeneration {} it):",
                        generator.name,
                        change.path,
                        change.verb()
                    );
                    eprint!("{}", describe(change));
                }
            }
        }
        if changed.is_empty() {
            eprintln!("codegen {}: up to date", generator.name);
        }
        stale += changed.len();
    }
    if mode == Mode::Check && stale > 0 {
        return Err(Error::Stale { count: stale });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map(entries: &[(&str, &str)]) -> BTreeMap<String, Vec<u8>> {
        entries
            .iter()
            .map(|(p, c)| ((*p).to_owned(), c.as_bytes().to_vec()))
            .collect()
    }

    #[test]
    fn changes_list_updated_created_and_removed_files() {
        let before = map(&[
            ("t/a.trace", "x\n"),
            ("t/b.trace", "y\n"),
            ("t/c.trace", "z\n"),
        ]);
        let after = map(&[
            ("t/a.trace", "x\n"),
            ("t/b.trace", "Y\n"),
            ("t/d.trace", "w\n"),
        ]);
        let found: Vec<(String, &str)> = changes(&before, &after)
            .iter()
            .map(|c| (c.path.clone(), c.verb()))
            .collect();
        assert_eq!(
            found,
            vec![
                ("t/b.trace".to_owned(), "updated"),
                ("t/c.trace".to_owned(), "removed"),
                ("t/d.trace".to_owned(), "created"),
            ]
        );
    }

    #[test]
    fn restore_puts_the_snapshot_back() {
        let root =
            std::env::temp_dir().join(format!("xtask-codegen-restore-{}", std::process::id()));
        std::fs::create_dir_all(root.join("golden")).unwrap();
        std::fs::write(root.join("golden/kept.trace"), "old\n").unwrap();
        let dirs = [PathBuf::from("golden")];
        let before = snapshot(&root, &dirs).unwrap();
        std::fs::write(root.join("golden/kept.trace"), "new\n").unwrap();
        std::fs::write(root.join("golden/extra.trace"), "extra\n").unwrap();
        let after = snapshot(&root, &dirs).unwrap();
        let changed = changes(&before, &after);
        assert_eq!(changed.len(), 2);
        restore(&root, &changed).unwrap();
        assert_eq!(snapshot(&root, &dirs).unwrap(), before);
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn stale_text_files_are_described_by_a_diff() {
        let change = Change {
            path: "g".to_owned(),
            before: Some(b"a\nb\n".to_vec()),
            after: Some(b"a\nc\n".to_vec()),
        };
        assert_eq!(describe(&change), "@@ -1 +1 @@\n a\n-b\n+c\n");
        let binary = Change {
            path: "g".to_owned(),
            before: Some(vec![0xff]),
            after: None,
        };
        assert_eq!(
            describe(&binary),
            "(binary contents: 1 bytes before, 0 after)\n"
        );
    }

    #[test]
    fn unknown_generator_is_a_usage_error() {
        let err = run(Path::new("."), Mode::Check, Some("nope")).unwrap_err();
        assert!(
            matches!(&err, Error::Usage(m) if m == "unknown generator `nope`; generators: golden"),
            "{err:?}"
        );
    }
}
