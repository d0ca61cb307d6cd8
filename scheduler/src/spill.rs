//! The spill store: where preempted sequences' images wait until they are restored, and the
//! envelope that says exactly which spill an image is.
//!
//! # The envelope
//!
//! Every image the store keeps is the router's image (whatever `SaveSequenceState` wrote, in the
//! router's own format) behind an envelope the engine writes and checks (integers little-endian):
//!
//! | bytes | field |
//! |---|---|
//! | 8 | magic `b"SPILLENV"` |
//! | 4 | envelope version ([`ENVELOPE_VERSION`]) |
//! | 8 | the store's nonce (random, drawn when the store opens) |
//! | 8 | request id |
//! | 8 | generation: the store's spill counter, different for every spill |
//! | 8 | computed length: the positions whose KV and state the image holds |
//! | 8 | token digest: xxh3-64 of those positions' token ids (each `u32`, little-endian) |
//! | 8 | xxh3-64 of the 52 bytes before it |
//!
//! The engine records the tag (id, generation, computed length, token digest) of each
//! spill and, at restore, refuses an image whose envelope says anything else (an earlier image of
//! the same request, another store's image, a corrupt header) before the router sees a byte; after
//! the router restored it, it checks the sequence itself (length and token digest) the same way.
//! A refused image falls back to recompute.
//!
//! # The directory
//!
//! A directory store lives in a fresh directory it creates inside the one it is given, with an
//! unpredictable name and mode 0700 (`tempfile`); the directory given must exist, be a directory
//! and not be a symbolic link. Each image is a new file (`create_new`, mode 0600, never through a
//! symbolic link), named after its request and generation. The store opens only regular files it
//! created itself (no symbolic link is followed, nothing blocks: a FIFO in an image's place is
//! refused), and deletes only those files; at drop it removes the directory only when nothing
//! else is left in it. When the directory disappears (or is replaced) while the engine runs, the
//! next spill creates a fresh one the same way (a warning and
//! [`crate::Metrics::spill_directory_recreations`]); the images in the old one are lost and their
//! requests recompute.
//!
//! Invariants: at most one image per request id; an image is removed when it is restored or its
//! request ends; `files` names exactly the files this store created and has not removed.

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::hash::{BuildHasher as _, RandomState};
use std::io::{BufReader, BufWriter, Read, Write};
use std::path::{Path, PathBuf};

#[cfg(unix)]
use rustix::fs::OFlags;
use xxhash_rust::xxh3::{xxh3_64, Xxh3};

/// Where spilled images go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SpillTarget {
    /// Host memory.
    Memory,
    /// Files in a fresh private directory the engine creates inside this one (which must exist,
    /// be a directory and not be a symbolic link) and removes at shutdown.
    Directory(PathBuf),
}

/// Why the spill store could not open, write or read an image.
#[derive(Debug, thiserror::Error)]
pub enum SpillError {
    /// The directory given for spills cannot be used.
    #[error("spill directory {path}: {problem}")]
    Directory {
        /// The directory.
        path: PathBuf,
        /// What is wrong with it.
        problem: String,
    },
    /// A file operation failed.
    #[error("spill store: {what} {path}: {source}")]
    Io {
        /// What the store was doing.
        what: &'static str,
        /// The file or directory.
        path: PathBuf,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// The store holds no image of this request.
    #[error("no spilled image of request {id}")]
    Missing {
        /// The request.
        id: u64,
    },
    /// The image is not the one the engine spilled (stale, foreign, replaced or corrupt).
    #[error("spilled image of request {id} refused: {problem}")]
    Refused {
        /// The request.
        id: u64,
        /// What did not match.
        problem: String,
    },
}

/// The first eight bytes of every envelope.
pub const ENVELOPE_MAGIC: [u8; 8] = *b"SPILLENV";
/// The envelope version this crate writes and reads.
pub const ENVELOPE_VERSION: u32 = 1;
/// Bytes of an envelope.
pub const ENVELOPE_BYTES: usize = 8 + 4 + 8 * 6;

/// What one spill holds: written into its envelope, recorded by the engine, checked at restore.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ImageTag {
    pub id: u64,
    pub generation: u64,
    pub computed_len: u64,
    pub token_digest: u64,
}

/// xxh3-64 of token ids, each as four little-endian bytes.
pub(crate) fn token_digest(tokens: &[u32]) -> u64 {
    let mut hasher = Xxh3::new();
    for token in tokens {
        hasher.update(&token.to_le_bytes());
    }
    hasher.digest()
}

fn encode_envelope(nonce: u64, tag: &ImageTag) -> [u8; ENVELOPE_BYTES] {
    let mut out = [0u8; ENVELOPE_BYTES];
    out[..8].copy_from_slice(&ENVELOPE_MAGIC);
    out[8..12].copy_from_slice(&ENVELOPE_VERSION.to_le_bytes());
    let fields = [
        nonce,
        tag.id,
        tag.generation,
        tag.computed_len,
        tag.token_digest,
    ];
    for (i, field) in fields.iter().enumerate() {
        out[12 + 8 * i..20 + 8 * i].copy_from_slice(&field.to_le_bytes());
    }
    let checksum = xxh3_64(&out[..ENVELOPE_BYTES - 8]);
    out[ENVELOPE_BYTES - 8..].copy_from_slice(&checksum.to_le_bytes());
    out
}

/// Decodes an envelope: answers the store nonce and the tag, or what is wrong with the bytes.
pub(crate) fn decode_envelope(bytes: &[u8]) -> Result<(u64, ImageTag), String> {
    let Some(bytes) = bytes.get(..ENVELOPE_BYTES) else {
        return Err(format!(
            "truncated: the envelope needs {ENVELOPE_BYTES} bytes, the image has {}",
            bytes.len()
        ));
    };
    if bytes[..8] != ENVELOPE_MAGIC {
        return Err(format!(
            "envelope magic is {:02x?}, expected {ENVELOPE_MAGIC:02x?}",
            &bytes[..8]
        ));
    }
    let u64_at = |at: usize| {
        let mut field = [0u8; 8];
        field.copy_from_slice(&bytes[at..at + 8]);
        u64::from_le_bytes(field)
    };
    let mut version = [0u8; 4];
    version.copy_from_slice(&bytes[8..12]);
    let version = u32::from_le_bytes(version);
    if version != ENVELOPE_VERSION {
        return Err(format!(
            "envelope version {version} is not supported (this engine reads {ENVELOPE_VERSION})"
        ));
    }
    let stored = u64_at(ENVELOPE_BYTES - 8);
    let actual = xxh3_64(&bytes[..ENVELOPE_BYTES - 8]);
    if stored != actual {
        return Err(format!(
            "envelope checksum mismatch: stored {stored:#018x}, computed {actual:#018x}"
        ));
    }
    let tag = ImageTag {
        id: u64_at(20),
        generation: u64_at(28),
        computed_len: u64_at(36),
        token_digest: u64_at(44),
    };
    Ok((u64_at(12), tag))
}

/// Checks a decoded envelope against the nonce of this store and the tag the engine recorded.
fn check_envelope(bytes: &[u8], nonce: u64, expected: &ImageTag) -> Result<(), SpillError> {
    let refuse = |problem: String| SpillError::Refused {
        id: expected.id,
        problem,
    };
    let (found_nonce, tag) = decode_envelope(bytes).map_err(refuse)?;
    if found_nonce != nonce {
        return Err(refuse(format!(
            "written by another spill store (nonce {found_nonce:#018x}, this store's is {nonce:#018x})"
        )));
    }
    let fields = [
        ("request id", tag.id, expected.id),
        ("generation", tag.generation, expected.generation),
        ("computed length", tag.computed_len, expected.computed_len),
    ];
    for (field, found, want) in fields {
        if found != want {
            return Err(refuse(format!(
                "{field} is {found}, the engine spilled {want} (a stale or foreign image)"
            )));
        }
    }
    if tag.token_digest != expected.token_digest {
        return Err(refuse(format!(
            "token digest {:#018x} is not that of the tokens spilled ({:#018x})",
            tag.token_digest, expected.token_digest
        )));
    }
    Ok(())
}

#[derive(Debug)]
enum Kind {
    Memory(HashMap<u64, Vec<u8>>),
    Directory(SpillDir),
}

/// The spill store; see the module docs.
#[derive(Debug)]
pub(crate) struct SpillStore {
    nonce: u64,
    next_generation: u64,
    kind: Kind,
}

impl SpillStore {
    pub(crate) fn open(target: &SpillTarget) -> Result<Self, SpillError> {
        let kind = match target {
            SpillTarget::Memory => Kind::Memory(HashMap::new()),
            SpillTarget::Directory(parent) => Kind::Directory(SpillDir::new(parent)?),
        };
        Ok(SpillStore {
            // std's `RandomState` has keys from the operating system's entropy source, distinct
            // per instance; hashing nothing under them draws the nonce.
            nonce: RandomState::new().hash_one(()),
            next_generation: 1,
            kind,
        })
    }

    /// Writes the image of request `id`, whose sequence holds `covered.len()` computed positions
    /// of tokens `covered`: the envelope, then what `write` writes. Answers the image's tag, or
    /// `write`'s error (nothing is kept then); replaces an older image of the same request.
    pub(crate) fn save<E>(
        &mut self,
        id: u64,
        covered: &[u32],
        write: impl FnOnce(&mut dyn Write) -> Result<(), E>,
    ) -> Result<Result<ImageTag, E>, SpillError> {
        let tag = ImageTag {
            id,
            generation: self.next_generation,
            computed_len: covered.len() as u64,
            token_digest: token_digest(covered),
        };
        self.next_generation += 1;
        let envelope = encode_envelope(self.nonce, &tag);
        match &mut self.kind {
            Kind::Memory(images) => {
                let mut image = envelope.to_vec();
                let result = write(&mut image);
                if result.is_ok() {
                    images.insert(id, image);
                }
                Ok(result.map(|()| tag))
            }
            Kind::Directory(dir) => {
                dir.remove(id);
                let (file, path) = dir.create_image(id, tag.generation)?;
                let mut writer = BufWriter::new(file);
                let io = |source| SpillError::Io {
                    what: "writing",
                    path: path.clone(),
                    source,
                };
                let written = writer
                    .write_all(&envelope)
                    .map_err(io)
                    .map(|()| write(&mut writer));
                let flushed = match written {
                    Ok(Ok(())) => writer.flush().map_err(io).map(|()| Ok(tag)),
                    Ok(Err(err)) => Ok(Err(err)),
                    Err(err) => Err(err),
                };
                drop(writer);
                if !matches!(flushed, Ok(Ok(_))) {
                    dir.remove(id);
                }
                flushed
            }
        }
    }

    /// Reads the image `expected` names with `read`, after checking its envelope; the image stays
    /// until [`Self::remove`].
    pub(crate) fn load<T>(
        &mut self,
        expected: &ImageTag,
        read: impl FnOnce(&mut dyn Read) -> T,
    ) -> Result<T, SpillError> {
        let id = expected.id;
        match &mut self.kind {
            Kind::Memory(images) => {
                let image = images.get(&id).ok_or(SpillError::Missing { id })?;
                check_envelope(image, self.nonce, expected)?;
                Ok(read(&mut &image[ENVELOPE_BYTES..]))
            }
            Kind::Directory(dir) => {
                let (file, path) = dir.open(id)?;
                let mut reader = BufReader::new(file);
                let mut envelope = Vec::with_capacity(ENVELOPE_BYTES);
                (&mut reader)
                    .take(ENVELOPE_BYTES as u64)
                    .read_to_end(&mut envelope)
                    .map_err(|source| SpillError::Io {
                        what: "reading",
                        path,
                        source,
                    })?;
                check_envelope(&envelope, self.nonce, expected)?;
                Ok(read(&mut reader))
            }
        }
    }

    /// Forgets request `id`'s image (nothing when there is none).
    pub(crate) fn remove(&mut self, id: u64) {
        match &mut self.kind {
            Kind::Memory(images) => {
                images.remove(&id);
            }
            Kind::Directory(dir) => dir.remove(id),
        }
    }

    /// The directory the store owns, if it is a directory store.
    pub(crate) fn directory(&self) -> Option<&Path> {
        match &self.kind {
            Kind::Memory(_) => None,
            Kind::Directory(dir) => Some(&dir.path),
        }
    }

    /// How many times the store had to create its directory again because it had disappeared.
    pub(crate) fn directory_recreations(&self) -> u64 {
        match &self.kind {
            Kind::Memory(_) => 0,
            Kind::Directory(dir) => dir.recreations,
        }
    }
}

/// What identifies a file or directory while it exists (device and inode on Unix).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Identity(#[cfg(unix)] (u64, u64));

impl Identity {
    fn of(meta: &std::fs::Metadata) -> Self {
        #[cfg(unix)]
        {
            use std::os::unix::fs::MetadataExt;
            Identity((meta.dev(), meta.ino()))
        }
        #[cfg(not(unix))]
        {
            let _ = meta;
            Identity()
        }
    }
}

/// A file this store created.
#[derive(Debug)]
struct OwnFile {
    name: String,
    identity: Identity,
}

/// The private directory of a directory store; see the module docs.
#[derive(Debug)]
struct SpillDir {
    parent: PathBuf,
    path: PathBuf,
    identity: Identity,
    files: HashMap<u64, OwnFile>,
    recreations: u64,
}

fn io_error<'a>(
    what: &'static str,
    path: &'a Path,
) -> impl FnOnce(std::io::Error) -> SpillError + 'a {
    move |source| SpillError::Io {
        what,
        path: path.to_path_buf(),
        source,
    }
}

/// Creates a fresh private directory inside `parent`, which must be an existing directory and
/// not a symbolic link.
fn make_private_dir(parent: &Path) -> Result<(PathBuf, Identity), SpillError> {
    let problem = |problem: &str| SpillError::Directory {
        path: parent.to_path_buf(),
        problem: problem.to_string(),
    };
    match std::fs::symlink_metadata(parent) {
        Ok(meta) if meta.file_type().is_symlink() => {
            return Err(problem(
                "is a symbolic link; give the directory it points to",
            ))
        }
        Ok(meta) if !meta.is_dir() => return Err(problem("is not a directory")),
        Ok(_) => {}
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => {
            return Err(problem("does not exist"))
        }
        Err(err) => return Err(io_error("inspecting", parent)(err)),
    }
    let mut builder = tempfile::Builder::new();
    builder.prefix("scheduler-spill-");
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        builder.permissions(std::fs::Permissions::from_mode(0o700));
    }
    let path = builder
        .tempdir_in(parent)
        .map_err(io_error("creating a directory in", parent))?
        .keep();
    let meta = std::fs::symlink_metadata(&path).map_err(io_error("inspecting", &path))?;
    Ok((path.clone(), Identity::of(&meta)))
}

impl SpillDir {
    fn new(parent: &Path) -> Result<Self, SpillError> {
        let (path, identity) = make_private_dir(parent)?;
        Ok(SpillDir {
            parent: parent.to_path_buf(),
            path,
            identity,
            files: HashMap::new(),
            recreations: 0,
        })
    }

    /// Whether the directory is still the one this store created.
    fn intact(&self) -> bool {
        match std::fs::symlink_metadata(&self.path) {
            Ok(meta) => meta.is_dir() && Identity::of(&meta) == self.identity,
            Err(_) => false,
        }
    }

    /// Makes sure the directory is there before writing; creates a fresh one when it vanished or
    /// was replaced (the images in the old one are forgotten).
    fn ensure(&mut self) -> Result<(), SpillError> {
        if self.intact() {
            return Ok(());
        }
        let (path, identity) = make_private_dir(&self.parent)?;
        tracing::warn!(
            old = %self.path.display(),
            new = %path.display(),
            lost_images = self.files.len(),
            "the spill directory disappeared or was replaced; spilling to a fresh one"
        );
        self.files.clear();
        self.path = path;
        self.identity = identity;
        self.recreations += 1;
        Ok(())
    }

    fn create_image(&mut self, id: u64, generation: u64) -> Result<(File, PathBuf), SpillError> {
        self.ensure()?;
        let name = format!("{id}-{generation}.seq");
        let path = self.path.join(&name);
        let mut options = OpenOptions::new();
        options.write(true).create_new(true);
        #[cfg(unix)]
        {
            use std::os::unix::fs::OpenOptionsExt;
            options.mode(0o600).custom_flags(o_flags(OFlags::NOFOLLOW));
        }
        let file = options.open(&path).map_err(io_error("creating", &path))?;
        let meta = file.metadata().map_err(io_error("inspecting", &path))?;
        self.files.insert(
            id,
            OwnFile {
                name,
                identity: Identity::of(&meta),
            },
        );
        Ok((file, path))
    }

    /// Opens the image of request `id` for reading: only the regular file this store created.
    fn open(&mut self, id: u64) -> Result<(File, PathBuf), SpillError> {
        if !self.intact() {
            self.ensure()?;
        }
        let own = self.files.get(&id).ok_or(SpillError::Missing { id })?;
        let path = self.path.join(&own.name);
        let mut options = OpenOptions::new();
        options.read(true);
        #[cfg(unix)]
        {
            use std::os::unix::fs::OpenOptionsExt;
            // Never through a symbolic link, and never waiting for a FIFO's writer.
            options.custom_flags(o_flags(OFlags::NOFOLLOW | OFlags::NONBLOCK));
        }
        let file = options.open(&path).map_err(|source| SpillError::Refused {
            id,
            problem: format!(
                "{} cannot be opened as a regular file: {source}",
                path.display()
            ),
        })?;
        let meta = file.metadata().map_err(io_error("inspecting", &path))?;
        if !meta.is_file() {
            return Err(SpillError::Refused {
                id,
                problem: format!("{} is not a regular file", path.display()),
            });
        }
        if Identity::of(&meta) != own.identity {
            return Err(SpillError::Refused {
                id,
                problem: format!(
                    "{} was replaced by a file the engine did not write",
                    path.display()
                ),
            });
        }
        Ok((file, path))
    }

    /// Deletes the image file of request `id` if it is still the file this store created.
    fn remove(&mut self, id: u64) {
        let Some(own) = self.files.remove(&id) else {
            return;
        };
        self.delete_own(&own);
    }

    fn delete_own(&self, own: &OwnFile) {
        if !self.intact() {
            return;
        }
        let path = self.path.join(&own.name);
        match std::fs::symlink_metadata(&path) {
            Ok(meta) if meta.is_file() && Identity::of(&meta) == own.identity => {
                if let Err(err) = std::fs::remove_file(&path) {
                    tracing::warn!(path = %path.display(), %err, "could not remove a spill file");
                }
            }
            Ok(_) => tracing::warn!(
                path = %path.display(),
                "a spill file was replaced by something the engine did not create; left alone"
            ),
            Err(_) => {}
        }
    }
}

impl Drop for SpillDir {
    fn drop(&mut self) {
        for own in std::mem::take(&mut self.files).values() {
            self.delete_own(own);
        }
        if !self.intact() {
            return;
        }
        if let Err(err) = std::fs::remove_dir(&self.path) {
            tracing::warn!(
                path = %self.path.display(),
                %err,
                "the spill directory was left in place (it holds files the engine did not create)"
            );
        }
    }
}

/// `flags` as [`std::os::unix::fs::OpenOptionsExt::custom_flags`] takes them: the same bits, as
/// a C `int`.
#[cfg(unix)]
fn o_flags(flags: OFlags) -> i32 {
    i32::from_ne_bytes(flags.bits().to_ne_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tag(id: u64, generation: u64) -> ImageTag {
        ImageTag {
            id,
            generation,
            computed_len: 3,
            token_digest: token_digest(&[1, 2, 3]),
        }
    }

    fn round_trip(target: SpillTarget) {
        let mut store = SpillStore::open(&target).unwrap();
        let saved: Result<ImageTag, std::io::Error> = store
            .save(7, &[1, 2, 3], |w| w.write_all(b"image seven"))
            .unwrap();
        let seven = saved.unwrap();
        assert_eq!(seven, tag(7, 1));
        let failed: Result<ImageTag, &str> = store.save(8, &[1, 2, 3], |_| Err("refused")).unwrap();
        assert_eq!(failed, Err("refused"));
        let text = store
            .load(&seven, |r| {
                let mut s = String::new();
                r.read_to_string(&mut s).map(|_| s)
            })
            .unwrap()
            .unwrap();
        assert_eq!(text, "image seven");
        assert!(matches!(
            store.load(&tag(8, 2), |_| ()),
            Err(SpillError::Missing { id: 8 })
        ));
        // A tag the store did not write: another generation, length or token digest.
        for wrong in [
            tag(7, 2),
            ImageTag {
                computed_len: 2,
                ..seven
            },
            ImageTag {
                token_digest: token_digest(&[1, 2, 4]),
                ..seven
            },
        ] {
            assert!(matches!(
                store.load(&wrong, |_| ()),
                Err(SpillError::Refused { id: 7, .. })
            ));
        }
        store.remove(7);
        assert!(store.load(&seven, |_| ()).is_err());
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

    #[test]
    fn an_image_of_another_store_is_refused() {
        let mut first = SpillStore::open(&SpillTarget::Memory).unwrap();
        let mut second = SpillStore::open(&SpillTarget::Memory).unwrap();
        let tag = first.save(1, &[5], |w| w.write_all(b"x")).unwrap().unwrap();
        let Kind::Memory(images) = &first.kind else {
            unreachable!()
        };
        let image = images[&1].clone();
        let Kind::Memory(others) = &mut second.kind else {
            unreachable!()
        };
        others.insert(1, image);
        let err = second.load(&tag, |_| ()).unwrap_err();
        assert!(err.to_string().contains("another spill store"), "{err}");
    }

    #[test]
    fn every_bad_envelope_is_named() {
        let good = encode_envelope(9, &tag(4, 2));
        assert_eq!(decode_envelope(&good), Ok((9, tag(4, 2))));
        let check = |bytes: &[u8], start: &str| {
            let err = decode_envelope(bytes).unwrap_err();
            assert!(
                err.starts_with(start),
                "{err:?} should start with {start:?}"
            );
        };
        check(
            &good[..10],
            "truncated: the envelope needs 60 bytes, the image has 10",
        );
        let mut magic = good;
        magic[0] = b'X';
        check(&magic, "envelope magic is");
        let mut version = good;
        version[8] = 7;
        check(&version, "envelope version 7");
        let mut flipped = good;
        flipped[30] ^= 1;
        check(&flipped, "envelope checksum mismatch");
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig {
            cases: 10_000,
            failure_persistence: None,
            ..proptest::prelude::ProptestConfig::default()
        })]

        /// Mutated envelopes (flipped, replaced, cut or extended bytes) decode to a value or an
        /// error, never a panic; only an intact one decodes to the tag it was written with.
        #[test]
        fn mutated_envelopes_never_panic(
            nonce: u64,
            id: u64,
            generation: u64,
            edits in proptest::collection::vec((0usize..80, proptest::prelude::any::<u8>()), 0..4),
            cut in 0usize..80,
        ) {
            let tag = ImageTag { id, generation, computed_len: 5, token_digest: 11 };
            let mut bytes = encode_envelope(nonce, &tag).to_vec();
            bytes.resize(ENVELOPE_BYTES + 20, 0xA5);
            for (at, value) in &edits {
                if let Some(byte) = bytes.get_mut(*at) {
                    *byte = *value;
                }
            }
            bytes.truncate(cut);
            let intact = cut >= ENVELOPE_BYTES
                && bytes[..ENVELOPE_BYTES] == encode_envelope(nonce, &tag)[..];
            match decode_envelope(&bytes) {
                Ok(decoded) if intact => proptest::prop_assert_eq!(decoded, (nonce, tag)),
                Ok(_) => {}
                Err(_) => proptest::prop_assert!(!intact),
            }
        }
    }
}
