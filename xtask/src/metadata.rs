//! The parts of `cargo metadata --format-version 1` the checks read, as typed structs.
//!
//! The graph is resolved with `--all-features`, so a dependency that only some feature turns on
//! is still seen: an invariant such as "device-io never reaches cudarc" must hold for every
//! feature combination, and the union of all features is the most a build can pull in.

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde::Deserialize;

use crate::cmd::{self, Error};

/// The workspace as cargo describes it.
#[derive(Debug, Deserialize)]
pub struct Metadata {
    /// Every package in the dependency graph, workspace members and third-party crates.
    pub packages: Vec<Package>,
    /// Package ids of the workspace members.
    pub workspace_members: Vec<String>,
    /// The resolved graph (`None` only with `--no-deps`, which this module never passes).
    pub resolve: Option<Resolve>,
}

/// One package.
#[derive(Debug, Deserialize)]
pub struct Package {
    /// Opaque package id; only compared, never parsed.
    pub id: String,
    /// The package name (`kv-cache`).
    pub name: String,
    /// Absolute path of its `Cargo.toml`.
    pub manifest_path: PathBuf,
    /// Dependencies as declared in the manifest (all kinds, optional ones included).
    pub dependencies: Vec<Dependency>,
    /// Its targets (lib, bins, tests, benches, examples, build script).
    pub targets: Vec<Target>,
}

/// One declared dependency.
#[derive(Debug, Deserialize)]
pub struct Dependency {
    /// The depended-on package's name (not its rename).
    pub name: String,
    /// `None` for a normal dependency, `Some("dev")` or `Some("build")` otherwise.
    pub kind: Option<String>,
    /// Declared `optional = true` (only turned on by a feature).
    pub optional: bool,
}

impl Dependency {
    /// True for normal and build dependencies: what a downstream user of the crate compiles.
    pub fn is_shipped(&self) -> bool {
        self.kind.as_deref() != Some("dev")
    }
}

/// One target of a package.
#[derive(Debug, Deserialize)]
pub struct Target {
    /// Target name (`xtask`, `replay`).
    pub name: String,
    /// Kinds: `lib`, `rlib`, `bin`, `test`, `bench`, `example`, `custom-build`, ...
    pub kind: Vec<String>,
    /// Absolute path of the target's root source file.
    pub src_path: PathBuf,
}

impl Target {
    /// True for the targets whose root must carry `#![forbid(unsafe_code)]`: libraries and
    /// binaries (tests, benches, examples and build scripts are scanned token by token instead).
    pub fn is_lib_or_bin(&self) -> bool {
        self.kind
            .iter()
            .any(|k| matches!(k.as_str(), "lib" | "rlib" | "proc-macro" | "bin"))
    }
}

/// The resolved dependency graph.
#[derive(Debug, Deserialize)]
pub struct Resolve {
    /// One node per package.
    pub nodes: Vec<Node>,
}

/// A package and the packages it resolved to depend on.
#[derive(Debug, Deserialize)]
pub struct Node {
    /// The package id.
    pub id: String,
    /// Its resolved dependencies.
    pub deps: Vec<NodeDep>,
}

/// One resolved edge.
#[derive(Debug, Deserialize)]
pub struct NodeDep {
    /// The depended-on package id.
    pub pkg: String,
    /// The kinds this edge has (a crate can be both a normal and a dev dependency).
    pub dep_kinds: Vec<DepKind>,
}

impl NodeDep {
    /// True when the edge is a normal or build dependency.
    pub fn is_shipped(&self) -> bool {
        self.dep_kinds
            .iter()
            .any(|k| k.kind.as_deref() != Some("dev"))
    }
}

/// The kind of a resolved edge.
#[derive(Debug, Deserialize)]
pub struct DepKind {
    /// `None` for normal, `Some("dev")`, `Some("build")`.
    pub kind: Option<String>,
}

impl Metadata {
    /// Runs `cargo metadata --format-version 1 --all-features` in the workspace root.
    pub fn load() -> Result<Self, Error> {
        let stdout = cmd::output(&mut cmd::cargo(&[
            "metadata",
            "--format-version",
            "1",
            "--all-features",
        ]))?;
        Ok(serde_json::from_slice(&stdout)?)
    }

    /// The workspace members, by name.
    pub fn members(&self) -> BTreeMap<&str, &Package> {
        self.packages
            .iter()
            .filter(|p| self.workspace_members.contains(&p.id))
            .map(|p| (p.name.as_str(), p))
            .collect()
    }

    /// The package with id `id`.
    pub fn package(&self, id: &str) -> Option<&Package> {
        self.packages.iter().find(|p| p.id == id)
    }
}
