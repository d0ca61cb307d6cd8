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
