//! Spill images and the spill directory under the engine with the host router: a stale image of
//! the right request is refused (the engine recomputes instead and the output does not change),
//! the directory is private and fresh, nothing outside it is touched, files the engine did not
//! create survive, and special files in it never block the engine.

use std::path::{Path, PathBuf};

use device_cpu::{CpuRouter, CpuRouterConfig};
use model::{Config, Model};
use scheduler::{Engine, EngineConfig, Preemption, Request, ShutdownMode, SpillTarget};

/// The host router of the stale-image case: blocks of 4 tokens, `num_blocks` of them, 4 slots,
/// both caches off, a context of 40 tokens.
fn router(model: &Model, num_blocks: usize) -> CpuRouter {
    let mut config = CpuRouterConfig::new(num_blocks, 4);
    config.block_size = 4;
    config.max_context = Some(40);
    config.prefix_cache = false;
    config.marconi = false;
    CpuRouter::new(model.clone(), config).unwrap()
}

fn engine(model: &Model, num_blocks: usize, preemption: Preemption) -> Engine<CpuRouter> {
    let config = EngineConfig {
        max_running: 4,
        preemption,
        ..EngineConfig::default()
    };
    Engine::new(router(model, num_blocks), config).unwrap()
}

/// Three greedy requests with 8-token prompts and 24 new tokens each.
fn requests() -> Vec<Request> {
    (0..3u32)
        .map(|i| Request::greedy((0..8).map(|t| (t * 5 + i * 17) % 256).collect(), 24))
        .collect()
}

/// The outputs of [`requests`] on a pool large enough that nothing is preempted (computed once:
/// every test here uses the same model).
fn unpreempted(model: &Model) -> Vec<Vec<u32>> {
    static OUTPUTS: std::sync::OnceLock<(u64, Vec<Vec<u32>>)> = std::sync::OnceLock::new();
    let (fingerprint, outputs) =
        OUTPUTS.get_or_init(|| (model.fingerprint(), serve_unpreempted(model)));
    assert_eq!(
        *fingerprint,
        model.fingerprint(),
        "the tests share one model"
    );
    outputs.clone()
}

fn serve_unpreempted(model: &Model) -> Vec<Vec<u32>> {
    let mut engine = engine(model, 64, Preemption::Recompute);
    let handles: Vec<_> = requests()
        .into_iter()
        .map(|r| engine.submit(r).unwrap())
        .collect();
    engine.run_until_idle();
    assert_eq!(engine.metrics().preemptions, 0);
    let outputs = handles
        .into_iter()
        .map(|h| h.wait().unwrap().tokens)
        .collect();
    engine.shutdown(ShutdownMode::Drain).unwrap();
    outputs
}

/// The image file of request `id` in `dir`, if one is there (named `<id>.seq` or
/// `<id>-<anything>.seq`).
fn image_of(dir: &Path, id: u64) -> Option<PathBuf> {
    let plain = format!("{id}.seq");
    let prefix = format!("{id}-");
    std::fs::read_dir(dir)
        .unwrap()
        .map(|entry| entry.unwrap())
        .find(|entry| {
            let name = entry.file_name().to_string_lossy().into_owned();
            name == plain || (name.starts_with(&prefix) && name.ends_with(".seq"))
        })
        .map(|entry| entry.path())
}

/// How the test puts an earlier image back.
#[derive(Debug, Clone, Copy)]
enum Swap {
    /// Overwrite the current file's bytes in place.
    Overwrite,
    /// Rename a copy of the earlier image over the current file.
    Replace,
    /// Keep the current envelope (the engine's header) but put the earlier image's body (the
    /// router's image, valid on its own) behind it.
    SpliceBody,
}

/// Runs [`requests`] on 10 blocks with spill to a directory; after request 3 is spilled the
/// second time, puts its first image back in place of the second. Answers the outputs and the
/// engine's metrics.
fn run_with_stale_image(model: &Model, swap: Swap) -> (Vec<Vec<u32>>, scheduler::Metrics) {
    let parent = tempfile_dir();
    let mut engine = engine(
        model,
        10,
        Preemption::Spill(SpillTarget::Directory(parent.clone())),
    );
    let handles: Vec<_> = requests()
        .into_iter()
        .map(|r| engine.submit(r).unwrap())
        .collect();
    assert_eq!(handles[2].id(), 3);
    let dir = engine.spill_directory().unwrap().to_path_buf();
    let mut images: Vec<Vec<u8>> = Vec::new();
    let mut swapped = false;
    while !engine.is_idle() {
        engine.step();
        if swapped {
            continue;
        }
        let Some(path) = image_of(&dir, 3) else {
            continue;
        };
        let bytes = std::fs::read(&path).unwrap();
        if images.last() != Some(&bytes) {
            images.push(bytes);
        }
        if images.len() == 2 {
            match swap {
                Swap::Overwrite => std::fs::write(&path, &images[0]).unwrap(),
                Swap::Replace => {
                    let copy = parent.join("earlier.seq");
                    std::fs::write(&copy, &images[0]).unwrap();
                    std::fs::rename(&copy, &path).unwrap();
                }
                Swap::SpliceBody => {
                    let envelope = scheduler::spill::ENVELOPE_BYTES;
                    let mut spliced = images[1][..envelope].to_vec();
                    spliced.extend_from_slice(&images[0][envelope..]);
                    std::fs::write(&path, spliced).unwrap();
                }
            }
            swapped = true;
        }
    }
    assert!(swapped, "request 3 was not spilled twice");
    let outputs = handles
        .into_iter()
        .map(|h| h.wait().unwrap().tokens)
        .collect();
    let metrics = *engine.metrics();
    engine.shutdown(ShutdownMode::Drain).unwrap();
    std::fs::remove_dir_all(&parent).unwrap();
    (outputs, metrics)
}

/// A fresh directory for one test under the system's temporary directory.
fn tempfile_dir() -> PathBuf {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let dir = std::env::temp_dir().join(format!(
        "spill-test-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    ));
    std::fs::create_dir(&dir).unwrap();
    dir
}

#[test]
fn a_stale_image_of_the_same_request_is_refused_and_the_output_does_not_change() {
    let model = Model::random(Config::tiny_demo(), 5).unwrap();
    let reference = unpreempted(&model);
    for swap in [Swap::Overwrite, Swap::Replace, Swap::SpliceBody] {
        let (outputs, metrics) = run_with_stale_image(&model, swap);
        assert_eq!(outputs, reference, "{swap:?}");
        assert!(metrics.spills >= 2, "{swap:?}: {metrics:?}");
        // Exactly the tampered image was refused, and its request recomputed.
        assert_eq!(metrics.spill_images_rejected, 1, "{swap:?}: {metrics:?}");
        assert_eq!(metrics.spill_fallbacks, 1, "{swap:?}: {metrics:?}");
        assert_eq!(
            metrics.restores + 1,
            metrics.spills,
            "{swap:?}: {metrics:?}"
        );
    }
}

/// Runs [`requests`] on 10 blocks with spill to `parent`, calling `tamper` with the engine's spill
/// directory before the first step and `after_step` after each; answers the outputs, the metrics
/// and the directory the engine used.
fn run_spilling(
    model: &Model,
    parent: &Path,
    tamper: impl FnOnce(&Path),
    mut after_step: impl FnMut(&Path),
) -> (Vec<Vec<u32>>, scheduler::Metrics, PathBuf) {
    let mut engine = engine(
        model,
        10,
        Preemption::Spill(SpillTarget::Directory(parent.to_path_buf())),
    );
    let dir = engine.spill_directory().unwrap().to_path_buf();
    tamper(&dir);
    let handles: Vec<_> = requests()
        .into_iter()
        .map(|r| engine.submit(r).unwrap())
        .collect();
    while !engine.is_idle() {
        engine.step();
        after_step(&dir);
    }
    let outputs = handles
        .into_iter()
        .map(|h| h.wait().unwrap().tokens)
        .collect();
    let metrics = *engine.metrics();
    engine.shutdown(ShutdownMode::Drain).unwrap();
    (outputs, metrics, dir)
}

#[cfg(unix)]
fn mode(path: &Path) -> u32 {
    use std::os::unix::fs::PermissionsExt;
    std::fs::symlink_metadata(path)
        .unwrap()
        .permissions()
        .mode()
        & 0o777
}

#[cfg(unix)]
#[test]
fn the_spill_directory_is_private_and_its_images_are_readable_by_the_owner_only() {
    let model = Model::random(Config::tiny_demo(), 5).unwrap();
    let parent = tempfile_dir();
    let mut dir_modes = Vec::new();
    let mut file_modes = Vec::new();
    let (_, metrics, _) = run_spilling(
        &model,
        &parent,
        |dir| dir_modes.push(mode(dir)),
        |dir| {
            for entry in std::fs::read_dir(dir).unwrap() {
                file_modes.push(mode(&entry.unwrap().path()));
            }
        },
    );
    assert!(metrics.spills > 0, "{metrics:?}");
    assert_eq!(dir_modes, vec![0o700]);
    assert!(!file_modes.is_empty());
    assert!(file_modes.iter().all(|&m| m == 0o600), "{file_modes:?}");
    std::fs::remove_dir_all(&parent).unwrap();
}

#[test]
fn an_existing_directory_is_never_adopted() {
    let model = Model::random(Config::tiny_demo(), 5).unwrap();
    let parent = tempfile_dir();
    // Every name the engine used to pick in this process, each already holding a file.
    for n in 0..256 {
        let squatted = parent.join(format!("scheduler-spill-{}-{n}", std::process::id()));
        std::fs::create_dir(&squatted).unwrap();
        std::fs::write(squatted.join("planted"), b"not the engine's").unwrap();
    }
    let mut first_listing = None;
    let (_, _, dir) = run_spilling(
        &model,
        &parent,
        |dir| first_listing = Some(std::fs::read_dir(dir).unwrap().count()),
        |_| {},
    );
    assert_eq!(first_listing, Some(0), "{} was adopted", dir.display());
    for n in 0..256 {
        let planted = parent
            .join(format!("scheduler-spill-{}-{n}", std::process::id()))
            .join("planted");
        assert_eq!(std::fs::read(&planted).unwrap(), b"not the engine's");
    }
    std::fs::remove_dir_all(&parent).unwrap();
}

#[cfg(unix)]
#[test]
fn symlinks_in_the_spill_directory_are_never_followed() {
    let model = Model::random(Config::tiny_demo(), 5).unwrap();
    let reference = unpreempted(&model);
    let parent = tempfile_dir();
    let victim = parent.join("victim.txt");
    std::fs::write(&victim, b"precious").unwrap();
    let plant = |dir: &Path| {
        // Every name an image of the three requests could get.
        for id in 1..=3 {
            let mut names = vec![format!("{id}.seq")];
            names.extend((0..64).map(|generation| format!("{id}-{generation}.seq")));
            for name in names {
                std::os::unix::fs::symlink(&victim, dir.join(name)).unwrap();
            }
        }
    };
    let (outputs, metrics, _) = run_spilling(&model, &parent, plant, |_| {});
    // Every spill met a link where its image would go and recomputed instead.
    assert_eq!(metrics.spills, 0, "{metrics:?}");
    assert_eq!(metrics.spill_fallbacks, metrics.preemptions, "{metrics:?}");
    let victim_bytes = std::fs::read(&victim).unwrap();
    assert!(
        victim_bytes == b"precious",
        "the file outside the spill directory was overwritten ({} bytes now)",
        victim_bytes.len()
    );
    assert_eq!(outputs, reference);
    assert!(metrics.preemptions > 0, "{metrics:?}");
    std::fs::remove_dir_all(&parent).unwrap();
}

#[test]
fn files_the_engine_did_not_create_survive_shutdown() {
    let model = Model::random(Config::tiny_demo(), 5).unwrap();
    let parent = tempfile_dir();
    let plant = |dir: &Path| {
        std::fs::write(dir.join("notes.txt"), b"mine").unwrap();
        std::fs::write(dir.join("7.seq"), b"also mine").unwrap();
    };
    let (_, metrics, dir) = run_spilling(&model, &parent, plant, |_| {});
    assert!(metrics.spills > 0, "{metrics:?}");
    assert_eq!(std::fs::read(dir.join("notes.txt")).unwrap(), b"mine");
    assert_eq!(std::fs::read(dir.join("7.seq")).unwrap(), b"also mine");
    // Only the planted files are left: the engine removed every image it wrote.
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 2);
    std::fs::remove_dir_all(&parent).unwrap();
}

#[test]
fn the_directory_given_must_exist_and_be_a_real_directory() {
    let model = Model::random(Config::tiny_demo(), 5).unwrap();
    let parent = tempfile_dir();
    let file = parent.join("a-file");
    std::fs::write(&file, b"").unwrap();
    let mut bad = vec![parent.join("missing"), file];
    #[cfg(unix)]
    {
        let link = parent.join("link");
        std::os::unix::fs::symlink(&parent, &link).unwrap();
        bad.push(link);
    }
    for path in bad {
        let config = EngineConfig {
            preemption: Preemption::Spill(SpillTarget::Directory(path.clone())),
            ..EngineConfig::default()
        };
        let err = Engine::new(router(&model, 10), config).unwrap_err();
        assert!(
            matches!(err, scheduler::EngineError::SpillDirectory(_)),
            "{}: {err}",
            path.display()
        );
        assert!(!parent.join("missing").exists());
    }
    std::fs::remove_dir_all(&parent).unwrap();
}

#[cfg(unix)]
#[test]
fn a_fifo_in_place_of_an_image_does_not_block_the_engine() {
    let model = Model::random(Config::tiny_demo(), 5).unwrap();
    let reference = unpreempted(&model);
    let parent = tempfile_dir();
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    let (fifo_tx, fifo_rx) = std::sync::mpsc::channel();
    let worker = {
        let (model, parent) = (model.clone(), parent.clone());
        std::thread::spawn(move || {
            let mut planted = false;
            let result = run_spilling(
                &model,
                &parent,
                |_| {},
                |dir| {
                    if planted {
                        return;
                    }
                    if let Some(path) = image_of(dir, 3) {
                        std::fs::remove_file(&path).unwrap();
                        let made = std::process::Command::new("mkfifo")
                            .arg(&path)
                            .status()
                            .unwrap();
                        assert!(made.success());
                        fifo_tx.send(path).unwrap();
                        planted = true;
                    }
                },
            );
            let _ = done_tx.send(result);
        })
    };
    let fifo = fifo_rx
        .recv_timeout(std::time::Duration::from_secs(120))
        .expect("request 3 was never spilled");
    // Generous: the run takes about a second; only a blocked engine thread waits this long.
    let outcome = done_rx.recv_timeout(std::time::Duration::from_secs(120));
    if outcome.is_err() {
        // Unblock the engine thread so the test ends, then fail.
        let _ = std::fs::OpenOptions::new().write(true).open(&fifo);
        worker.join().unwrap();
        panic!(
            "the engine thread blocked opening the FIFO {}",
            fifo.display()
        );
    }
    worker.join().unwrap();
    let (outputs, metrics, _) = outcome.unwrap();
    assert_eq!(outputs, reference);
    assert_eq!(metrics.spill_fallbacks, 1, "{metrics:?}");
    assert_eq!(metrics.spill_images_rejected, 1, "{metrics:?}");
    std::fs::remove_dir_all(&parent).unwrap();
}

#[test]
fn a_spill_directory_deleted_while_the_engine_runs_is_recreated() {
    let model = Model::random(Config::tiny_demo(), 5).unwrap();
    let reference = unpreempted(&model);
    let parent = tempfile_dir();
    let (outputs, metrics, dir) = run_spilling(
        &model,
        &parent,
        |dir| std::fs::remove_dir(dir).unwrap(),
        |_| {},
    );
    assert_eq!(outputs, reference);
    assert!(metrics.spills > 0, "{metrics:?}");
    assert_eq!(metrics.spills, metrics.restores, "{metrics:?}");
    assert_eq!(metrics.spill_directory_recreations, 1, "{metrics:?}");
    assert!(!dir.exists());
    // The engine removed the directory it made instead.
    assert_eq!(std::fs::read_dir(&parent).unwrap().count(), 0);
    std::fs::remove_dir_all(&parent).unwrap();
}
