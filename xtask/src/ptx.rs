//! The `ptx` generator: compiles every CUDA C kernel file `device-cuda/kernels/*.cu` with NVRTC to
//! PTX for `compute_80` (A100, H100 and H200 run it through the driver's JIT) and writes
//! `device-cuda/kernels/ptx/<module>.ptx`, which `CudaRuntime` loads at run time.
//!
//! NVRTC comes from the PyPI wheel pinned in `device-cuda/kernels/nvrtc-requirements.txt`,
//! installed into the virtual environment `.nvrtc-venv` at the workspace root (`.ci/run` does it
//! on CI; this generator does it on first use elsewhere). `NVRTC_LIB_DIR` may name another folder
//! holding `libnvrtc.so.12`. The library is loaded by `cudarc` at run time, found through
//! `LD_LIBRARY_PATH`, which must be set when the process starts: so the generator runs this same
//! xtask binary again as `xtask nvrtc-compile KERNELS OUT` with the folder added.
//!
//! The PTX is deterministic: the same NVRTC and the same sources give the same bytes, wherever the
//! workspace lives (the include path and file name leave no trace in it), which is what lets
//! `codegen --check` compare a fresh compile with the checked-in files.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::cmd::{self, Error};
use crate::codegen::GENERATED_MARK;

/// Where the kernels live, relative to the workspace root.
pub const KERNELS: &str = "device-cuda/kernels";
/// Where the PTX goes.
pub const PTX_DIR: &str = "device-cuda/kernels/ptx";
/// The virtual environment that holds the NVRTC wheel.
const VENV: &str = ".nvrtc-venv";
/// The architecture the PTX targets.
pub const ARCH: &str = "compute_80";

/// The first line of every PTX file (a PTX comment).
fn header() -> String {
    format!("// {GENERATED_MARK}, do not edit by hand (NVRTC, {ARCH}).\n")
}

fn other(message: String) -> Error {
    Error::Io {
        path: PathBuf::from(VENV),
        source: std::io::Error::other(message),
    }
}

/// The folder of `libnvrtc.so.12` inside a virtual environment, if the wheel is installed there.
fn venv_lib_dir(venv: &Path) -> Option<PathBuf> {
    let lib = venv.join("lib");
    let entries = std::fs::read_dir(&lib).ok()?;
    entries
        .filter_map(Result::ok)
        .map(|entry| entry.path().join("site-packages/nvidia/cuda_nvrtc/lib"))
        .find(|dir| dir.join("libnvrtc.so.12").is_file())
}

/// The folder holding NVRTC: `NVRTC_LIB_DIR`, or the workspace's virtual environment (created
/// and filled from the requirements file when missing).
fn nvrtc_lib_dir(root: &Path) -> Result<PathBuf, Error> {
    if let Some(dir) = std::env::var_os("NVRTC_LIB_DIR") {
        let dir = PathBuf::from(dir);
        if dir.join("libnvrtc.so.12").is_file() {
            return Ok(dir);
        }
        return Err(other(format!(
            "NVRTC_LIB_DIR={} holds no libnvrtc.so.12",
            dir.display()
        )));
    }
    let venv = root.join(VENV);
    if let Some(dir) = venv_lib_dir(&venv) {
        return Ok(dir);
    }
    eprintln!("codegen ptx: installing NVRTC into {VENV} (pip, {KERNELS}/nvrtc-requirements.txt)");
    let mut create = Command::new("python3");
    create.args(["-m", "venv"]).arg(&venv).current_dir(root);
    cmd::run(&mut create)?;
    let mut install = Command::new(venv.join("bin/pip"));
    install
        .args(["install", "--quiet", "--disable-pip-version-check", "-r"])
        .arg(root.join(KERNELS).join("nvrtc-requirements.txt"))
        .current_dir(root);
    cmd::run(&mut install)?;
    venv_lib_dir(&venv).ok_or_else(|| {
        other(format!(
            "the NVRTC wheel installed into {VENV} has no nvidia/cuda_nvrtc/lib/libnvrtc.so.12"
        ))
    })
}

/// The generator's entry: compile in a child process that can load NVRTC.
pub fn generate(root: &Path, _outputs: &[PathBuf]) -> Result<(), Error> {
    let lib_dir = nvrtc_lib_dir(root)?;
    let exe = std::env::current_exe().map_err(|source| Error::Io {
        path: PathBuf::from("xtask"),
        source,
    })?;
    let mut path = lib_dir.into_os_string();
    if let Some(old) = std::env::var_os("LD_LIBRARY_PATH") {
        path.push(":");
        path.push(old);
    }
    let mut child = Command::new(exe);
    child
        .arg("nvrtc-compile")
        .arg(root.join(KERNELS))
        .arg(root.join(PTX_DIR))
        .env("LD_LIBRARY_PATH", path)
        .current_dir(root);
    cmd::run(&mut child)
}

/// The `.cu` files of `kernels`, sorted.
fn kernel_files(kernels: &Path) -> Result<Vec<PathBuf>, Error> {
    let entries = std::fs::read_dir(kernels).map_err(|source| Error::Io {
        path: kernels.to_path_buf(),
        source,
    })?;
    let mut files: Vec<PathBuf> = entries
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "cu"))
        .collect();
    files.sort();
    Ok(files)
}

/// Compiles one kernel file to PTX text (with the generated-file header).
pub fn compile(kernels: &Path, file: &Path) -> Result<String, Error> {
    let source = std::fs::read_to_string(file).map_err(|source| Error::Io {
        path: file.to_path_buf(),
        source,
    })?;
    let name = file
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let options = cudarc::nvrtc::CompileOptions {
        arch: Some(ARCH),
        include_paths: vec![kernels.display().to_string()],
        options: vec!["--std=c++17".to_owned()],
        name: Some(name),
        ..Default::default()
    };
    let ptx = cudarc::nvrtc::compile_ptx_with_opts(&source, options).map_err(|err| Error::Io {
        path: file.to_path_buf(),
        source: std::io::Error::other(format!("NVRTC: {err:?}")),
    })?;
    Ok(format!("{}{}", header(), ptx.to_src()))
}

/// `xtask nvrtc-compile KERNELS OUT`: the child's work (NVRTC is loadable here). Writes one
/// `.ptx` per `.cu` and deletes PTX whose source is gone.
pub fn compile_all(kernels: &Path, out: &Path) -> Result<(), Error> {
    std::fs::create_dir_all(out).map_err(|source| Error::Io {
        path: out.to_path_buf(),
        source,
    })?;
    let files = kernel_files(kernels)?;
    let mut written = Vec::new();
    for file in &files {
        let text = compile(kernels, file)?;
        let stem = file
            .file_stem()
            .unwrap_or_default()
            .to_string_lossy()
            .into_owned();
        let target = out.join(format!("{stem}.ptx"));
        std::fs::write(&target, text).map_err(|source| Error::Io {
            path: target.clone(),
            source,
        })?;
        written.push(target);
    }
    let entries = std::fs::read_dir(out).map_err(|source| Error::Io {
        path: out.to_path_buf(),
        source,
    })?;
    for path in entries.filter_map(Result::ok).map(|e| e.path()) {
        if path.extension().is_some_and(|e| e == "ptx") && !written.contains(&path) {
            std::fs::remove_file(&path).map_err(|source| Error::Io {
                path: path.clone(),
                source,
            })?;
        }
    }
    Ok(())
}
