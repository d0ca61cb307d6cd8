//! `cargo xtask bench [NAME] [-- ARGS]`: runs the workspace's benchmarks, or those of one package
//! or one bench target, passing `ARGS` on to the harness (criterion takes a filter, `--quick`...).

use crate::cmd::{self, Error};
use crate::metadata::Metadata;

/// What `NAME` selects, as `cargo bench` arguments.
fn selection(metadata: &Metadata, name: Option<&str>) -> Result<Vec<String>, Error> {
    let Some(name) = name else {
        return Ok(vec!["--workspace".to_owned()]);
    };
    let members = metadata.members();
    if members.contains_key(name) {
        return Ok(vec!["-p".to_owned(), name.to_owned()]);
    }
    let mut benches = Vec::new();
    for (package, manifest) in &members {
        for target in manifest
            .targets
            .iter()
            .filter(|t| t.kind.iter().any(|k| k == "bench"))
        {
            if target.name == name {
                return Ok(vec![
                    "-p".to_owned(),
                    (*package).to_owned(),
                    "--bench".to_owned(),
                    name.to_owned(),
                ]);
            }
            benches.push(format!("{package}/{}", target.name));
        }
    }
    Err(Error::Usage(format!(
        "`{name}` is neither a workspace package nor a bench target; bench targets: {}",
        if benches.is_empty() {
            "none yet".to_owned()
        } else {
            benches.join(", ")
        }
    )))
}

/// Runs `cargo bench` for the selection, then `-- harness_args` when there are any.
pub fn run(name: Option<&str>, harness_args: &[String]) -> Result<(), Error> {
    let metadata = Metadata::load()?;
    let mut command = cmd::cargo(&["bench"]);
    command.args(selection(&metadata, name)?);
    if !harness_args.is_empty() {
        command.arg("--").args(harness_args);
    }
    eprintln!("$ {}", cmd::display(&command));
    cmd::run(&mut command)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn metadata() -> Metadata {
        serde_json::from_str(
            r#"{
            "workspace_members": ["kv", "ds"],
            "packages": [
                {"id": "kv", "name": "kv-cache", "manifest_path": "/ws/kv-cache/Cargo.toml", "dependencies": [],
                 "targets": [{"name": "kv_cache", "kind": ["lib"], "src_path": "/ws/kv-cache/src/lib.rs"},
                             {"name": "pool", "kind": ["bench"], "src_path": "/ws/kv-cache/benches/pool.rs"}]},
                {"id": "ds", "name": "device-trace", "manifest_path": "/ws/device-trace/Cargo.toml", "dependencies": [],
                 "targets": [{"name": "overhead", "kind": ["bench"], "src_path": "/ws/device-trace/benches/overhead.rs"}]},
                {"id": "serde", "name": "serde", "manifest_path": "/reg/serde/Cargo.toml", "dependencies": [],
                 "targets": [{"name": "ser", "kind": ["bench"], "src_path": "/reg/serde/benches/ser.rs"}]}
            ],
            "resolve": null
        }"#,
        )
        .unwrap()
    }

    #[test]
    fn names_select_the_workspace_a_package_or_a_bench_target() {
        let metadata = metadata();
        let check = |name: Option<&str>, expected: &[&str]| {
            assert_eq!(
                selection(&metadata, name).unwrap(),
                expected,
                "name: {name:?}"
            );
        };
        check(None, &["--workspace"]);
        check(Some("kv-cache"), &["-p", "kv-cache"]);
        check(Some("pool"), &["-p", "kv-cache", "--bench", "pool"]);
        check(
            Some("overhead"),
            &["-p", "device-trace", "--bench", "overhead"],
        );
    }

    #[test]
    fn an_unknown_name_lists_the_bench_targets() {
        // `ser` belongs to a dependency, not to the workspace, so it is not offered.
        let err = selection(&metadata(), Some("ser")).unwrap_err();
        assert!(
            matches!(&err, Error::Usage(m) if m == "`ser` is neither a workspace package nor a bench target; \
                bench targets: device-trace/overhead, kv-cache/pool"),
            "{err:?}"
        );
    }
}
