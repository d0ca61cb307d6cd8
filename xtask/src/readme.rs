//! The README's library example, built the way a user would: in a new crate whose only
//! dependency is `scheduler` (default features), outside this workspace.
//!
//! The stage takes the first ```` ```rust ```` block after the `## Library example` heading,
//! wraps it in `fn main() -> Result<(), Box<dyn std::error::Error>>`, writes the crate under
//! `<target dir>/xtask/readme-example/` with a copy of the workspace's `Cargo.lock` (the same
//! versions, so `--offline` resolves), and runs `cargo check --offline` with the workspace's
//! target directory, so the dependencies compiled by the earlier stages are reused. The
//! crate-level doctest of `scheduler` runs the same code; this stage catches what a doctest
//! cannot: a name the example uses that is reachable only through a dev-dependency or another
//! workspace crate.

use std::path::{Path, PathBuf};

use crate::cmd::{self, Error};

/// The heading the example follows.
const HEADING: &str = "## Library example";

/// The example's code: the lines of the first `rust` fence after [`HEADING`].
pub fn example(readme: &str) -> Result<String, String> {
    let mut lines = readme.lines();
    lines
        .by_ref()
        .find(|line| line.trim_end() == HEADING)
        .ok_or_else(|| format!("README.md has no `{HEADING}` heading"))?;
    lines
        .by_ref()
        .find(|line| line.trim_end() == "```rust")
        .ok_or_else(|| format!("README.md has no ```rust block after `{HEADING}`"))?;
    let mut code = String::new();
    for line in lines {
        if line.trim_end() == "```" {
            return Ok(code);
        }
        code.push_str(line);
        code.push('\n');
    }
    Err(format!(
        "README.md: the ```rust block after `{HEADING}` is not closed"
    ))
}

/// The scratch crate's `Cargo.toml`, depending on the `scheduler` at `scheduler_dir`.
pub fn manifest(scheduler_dir: &Path) -> String {
    // TOML basic strings take the path with backslashes and quotes escaped.
    let path = scheduler_dir
        .display()
        .to_string()
        .replace('\\', "\\\\")
        .replace('"', "\\\"");
    format!(
        "[package]\nname = \"readme-example\"\nversion = \"0.0.0\"\nedition = \"2021\"\npublish = false\n\n\
         [dependencies]\nscheduler = {{ path = \"{path}\" }}\n\n\
         # Not a member of the engine's workspace: a user's crate of its own.\n[workspace]\n"
    )
}

/// The scratch crate's `src/main.rs`.
pub fn main_rs(code: &str) -> String {
    let body: String = code
        .lines()
        .map(|line| {
            if line.is_empty() {
                "\n".to_owned()
            } else {
                format!("    {line}\n")
            }
        })
        .collect();
    format!(
        "//! The README's library example, checked by `cargo xtask ci`.\n\n\
         fn main() -> Result<(), Box<dyn std::error::Error>> {{\n{body}    Ok(())\n}}\n"
    )
}

/// The target directory cargo uses for this workspace.
fn target_dir(root: &Path) -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join("target"))
}

/// Writes the scratch crate and checks it.
pub fn check(root: &Path) -> Result<(), Error> {
    let readme_path = root.join("README.md");
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| Error::Io { path, source }
    };
    let readme = std::fs::read_to_string(&readme_path).map_err(io(&readme_path))?;
    let code = example(&readme).map_err(Error::Usage)?;
    let target = target_dir(root);
    let dir = target.join("xtask").join("readme-example");
    let src = dir.join("src");
    std::fs::create_dir_all(&src).map_err(io(&src))?;
    let write = |path: PathBuf, text: String| std::fs::write(&path, text).map_err(io(&path));
    write(dir.join("Cargo.toml"), manifest(&root.join("scheduler")))?;
    write(src.join("main.rs"), main_rs(&code))?;
    let lock = root.join("Cargo.lock");
    std::fs::copy(&lock, dir.join("Cargo.lock")).map_err(io(&lock))?;
    let manifest_path = dir.join("Cargo.toml");
    let mut command = cmd::cargo(&[
        "check",
        "--offline",
        "--quiet",
        "--manifest-path",
        &manifest_path.to_string_lossy(),
    ]);
    command.env("CARGO_TARGET_DIR", &target);
    cmd::run(&mut command)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_example_is_the_first_rust_block_after_the_heading() {
        let readme = "# T\n```rust\nnot this\n```\n## Library example\n\nText.\n\n```rust\nlet a = 1;\n\nlet b = a;\n```\n```rust\nnor this\n```\n";
        assert_eq!(example(readme).unwrap(), "let a = 1;\n\nlet b = a;\n");
        assert_eq!(
            example("# T\n").unwrap_err(),
            "README.md has no `## Library example` heading"
        );
        assert_eq!(
            example("## Library example\n```rust\nlet a = 1;\n").unwrap_err(),
            "README.md: the ```rust block after `## Library example` is not closed"
        );
    }

    #[test]
    fn the_scratch_crate_depends_on_scheduler_alone() {
        let manifest = manifest(Path::new("/w/scheduler"));
        assert!(manifest.contains("[dependencies]\nscheduler = { path = \"/w/scheduler\" }\n\n#"));
        assert_eq!(manifest.matches(" = {").count(), 1, "{manifest}");
        assert_eq!(
            main_rs("let a = 1;\n\nprintln!(\"{a}\");\n"),
            "//! The README's library example, checked by `cargo xtask ci`.\n\n\
             fn main() -> Result<(), Box<dyn std::error::Error>> {\n    let a = 1;\n\n    \
             println!(\"{a}\");\n    Ok(())\n}\n"
        );
    }

    /// The README in this repository has an example to check.
    #[test]
    fn the_readme_has_a_library_example() {
        let readme = std::fs::read_to_string(cmd::workspace_root().join("README.md")).unwrap();
        let code = example(&readme).unwrap();
        assert!(code.contains("scheduler::"), "{code}");
    }
}
