//! The spill store: where preempted sequences' images wait until they are restored.
//!
//! Invariants: at most one image per request id; an image is removed when it is restored or its
//! request ends; a directory store owns its directory (it creates a fresh one and removes it,
//! with anything left in it, when dropped).

use std::collections::HashMap;
use std::fs::File;
use std::io::{BufReader, BufWriter, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// Where spilled images go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SpillTarget {
    /// Host memory.
    Memory,
    /// Files in a fresh directory the engine creates inside this one and removes at shutdown.
    Directory(PathBuf),
}

#[derive(Debug)]
pub(crate) enum SpillStore {
    Memory(HashMap<u64, Vec<u8>>),
    Directory(PathBuf),
}

static NEXT_DIR: AtomicU64 = AtomicU64::new(0);

impl SpillStore {
    pub(crate) fn open(target: &SpillTarget) -> std::io::Result<Self> {
        match target {
            SpillTarget::Memory => Ok(SpillStore::Memory(HashMap::new())),
            SpillTarget::Directory(parent) => {
                let name = format!(
                    "scheduler-spill-{}-{}",
                    std::process::id(),
                    NEXT_DIR.fetch_add(1, Ordering::Relaxed)
                );
                let dir = parent.join(name);
                std::fs::create_dir_all(&dir)?;
                Ok(SpillStore::Directory(dir))
            }
        }
    }

    fn file(dir: &Path, id: u64) -> PathBuf {
        dir.join(format!("{id}.seq"))
    }

    /// Writes request `id`'s image with `write`, replacing any older one.
    pub(crate) fn save<E>(
        &mut self,
        id: u64,
        write: impl FnOnce(&mut dyn Write) -> Result<(), E>,
    ) -> Result<Result<(), E>, std::io::Error> {
        match self {
            SpillStore::Memory(images) => {
                let mut image = Vec::new();
                let result = write(&mut image);
                if result.is_ok() {
                    images.insert(id, image);
                }
                Ok(result)
            }
            SpillStore::Directory(dir) => {
                let path = Self::file(dir, id);
                let mut writer = BufWriter::new(File::create(&path)?);
                let result = write(&mut writer);
                if result.is_ok() {
                    writer.flush()?;
                } else {
                    drop(writer);
                    std::fs::remove_file(&path)?;
                }
                Ok(result)
            }
        }
    }

    /// Reads request `id`'s image with `read`; the image stays until [`Self::remove`].
    pub(crate) fn load<T>(
        &self,
        id: u64,
        read: impl FnOnce(&mut dyn Read) -> T,
    ) -> Result<T, std::io::Error> {
        match self {
            SpillStore::Memory(images) => {
                let image = images.get(&id).ok_or_else(|| missing(id))?;
                Ok(read(&mut image.as_slice()))
            }
            SpillStore::Directory(dir) => {
                let mut reader = BufReader::new(File::open(Self::file(dir, id))?);
                Ok(read(&mut reader))
            }
        }
    }

    /// Forgets request `id`'s image (nothing when there is none).
    pub(crate) fn remove(&mut self, id: u64) {
        match self {
            SpillStore::Memory(images) => {
                images.remove(&id);
            }
            SpillStore::Directory(dir) => {
                let path = Self::file(dir, id);
                if let Err(err) = std::fs::remove_file(&path) {
                    if err.kind() != std::io::ErrorKind::NotFound {
                        tracing::warn!(path = %path.display(), %err, "could not remove spill file");
                    }
                }
            }
        }
    }

    /// The directory the store owns, if it is a directory store.
    pub(crate) fn directory(&self) -> Option<&Path> {
        match self {
            SpillStore::Memory(_) => None,
            SpillStore::Directory(dir) => Some(dir),
        }
    }
}

fn missing(id: u64) -> std::io::Error {
    std::io::Error::new(
        std::io::ErrorKind::NotFound,
        format!("no spilled image for request {id}"),
    )
}

impl Drop for SpillStore {
    fn drop(&mut self) {
        if let SpillStore::Directory(dir) = self {
            if let Err(err) = std::fs::remove_dir_all(&*dir) {
                tracing::warn!(path = %dir.display(), %err, "could not remove the spill directory");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn round_trip(target: SpillTarget) {
        let mut store = SpillStore::open(&target).unwrap();
        let saved: Result<(), std::io::Error> =
            store.save(7, |w| w.write_all(b"image seven")).unwrap();
        saved.unwrap();
        let failed: Result<(), &str> = store.save(8, |_| Err("refused")).unwrap();
        assert_eq!(failed, Err("refused"));
        let text = store
            .load(7, |r| {
                let mut s = String::new();
                r.read_to_string(&mut s).map(|_| s)
            })
            .unwrap()
            .unwrap();
        assert_eq!(text, "image seven");
        assert_eq!(
            store.load(8, |_| ()).unwrap_err().kind(),
            std::io::ErrorKind::NotFound
        );
        store.remove(7);
        assert!(store.load(7, |_| ()).is_err());
    }

    #[test]
    fn memory_store_round_trips() {
        round_trip(SpillTarget::Memory);
    }

    #[test]
    fn directory_store_round_trips_and_cleans_up() {
        let parent = std::env::temp_dir();
        let store = SpillStore::open(&SpillTarget::Directory(parent.clone())).unwrap();
        let dir = store.directory().unwrap().to_path_buf();
        assert!(dir.is_dir());
        drop(store);
        assert!(!dir.exists());
        round_trip(SpillTarget::Directory(parent));
    }
}
