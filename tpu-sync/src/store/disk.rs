//! The disk tier: one file per block, written and read with `O_DIRECT` through io_uring (the
//! `io-uring` crate), or with `pwritev`/`preadv` where io_uring is unavailable.
//!
//! # Files
//!
//! Blocks of namespace `ns` live in `<dir>/<ns id, 32 hex digits>/`, one file per block named
//! `<key, 32 hex digits>.kvb`: a 4096-byte header, then the block's bytes padded with zeros to a
//! multiple of 4096 (so reads and writes are `O_DIRECT`-aligned). Header (little endian): magic
//! [`FILE_MAGIC`], version, namespace id, key, parent key, `has_parent`, length, xxh3-64 of the
//! data, tick, and at byte 120 an xxh3-64 of bytes 0..120. A block is written to a temporary file
//! (`.<key>.<pid>.<n>.tmp`) that is renamed into place once complete, so a reader never sees a
//! partial file under the final name; a crash leaves only a temporary file, removed at the next
//! open. A missing, short, oversized or corrupt file is a **miss** (logged and deleted), never an
//! error. Files are not fsync'ed: the tier is a cache, and whatever a power loss tears is caught
//! by the size, header and data checks.
//!
//! The namespace directory is created with mode 0700 and refused unless it is owned by this user
//! and not writable by others; block files owned by another user are never read (a checksum is
//! not a signature). The directory is locked (`flock` on `.lock`) by one store at a time. Below
//! the configured root, directories and files are created, opened, renamed and deleted relative
//! to open directory descriptors with `O_NOFOLLOW` (`super::dirfd`), so a symlink planted under
//! any name is refused and a directory swapped after its checks cannot redirect a write.
//!
//! # I/O paths
//!
//! * **io_uring** (default): one ring per tier; a batch of blocks is submitted as `Writev` /
//!   `Readv` operations (header buffer + the block's slot in the arena, which is page aligned)
//!   and reaped together.
//! * **Fallback**: `pwritev`/`preadv`, one block after another, used with a warning when
//!   `io_uring_setup` fails (EPERM under `kernel.io_uring_disabled`, ENOSYS, seccomp) or when
//!   [`DiskOptions::io_uring`] is false or `TPU_SYNC_STORE_IO_URING=0` is set.
//! * `O_DIRECT` is dropped (with a warning) on file systems that refuse it (tmpfs answers EINVAL).
//!
//! # Shared file systems
//!
//! With [`DiskOptions::shared`] the tier lives on a mount shared by several hosts (NFS, Lustre,
//! any POSIX file system): blocks go to `<dir>/<ns id>/<partition>/` where the partition names
//! the rank, `tp<N>_r<rank>` as Google's TPU Sync POSIX backend lays out
//! `<root>/<model>/tp<N>_r<rank>/...` ([`SharedFs::tp_rank`]). Several writers (one store each)
//! share a partition: each takes its own lock (`.lock.<writer>`), names its temporary files
//! `.<key>.<writer>.<pid>.<n>.tmp`, records its writer id in each file's header (bytes
//! 128..208, with their own xxh3-64), and at open restores, counts against its capacity and
//! cleans up only its own files; files of other writers are never deleted at open. Block keys
//! are content hashes, so two writers of one key write the same bytes; whichever rename comes
//! last wins, and a reader opens one whole file or the other. An eviction deletes the key's file
//! whoever wrote it last (a miss for the others, never wrong bytes). Other hosts read the files
//! with [`super::shared::SharedReader`], which checks header, size and checksum of every block.
//!
//! Thread-safety: [`DiskTier`] is `Send + Sync`; the ring is behind a mutex.

use std::fs::File;
use std::io::Read;
use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;

use crate::error::{Error, Result};
use crate::store::dirfd::DirFd;
use crate::store::key::{BlockKey, Namespace};

/// First 8 bytes of a block file.
pub const FILE_MAGIC: [u8; 8] = *b"TPUSKVB1";
/// Block file format version.
pub const FILE_VERSION: u32 = 1;
/// Header bytes (and the alignment of everything in a block file).
pub const FILE_HEADER: usize = 4096;
const ALIGN: usize = 4096;
const RING_ENTRIES: u32 = 64;

/// How to run the disk tier.
#[derive(Debug, Clone)]
pub struct DiskOptions {
    /// Root directory (created if missing); blocks go into a per-namespace subdirectory.
    pub dir: PathBuf,
    /// Bytes of block files allowed (headers and padding included).
    pub capacity_bytes: u64,
    /// Use io_uring when the kernel allows it (default true).
    pub io_uring: bool,
    /// Open files with `O_DIRECT` when the file system allows it (default true).
    pub direct: bool,
    /// Live on a shared file system as one of several writers (default `None`: this store is
    /// the directory's only user; see the module docs).
    pub shared: Option<SharedFs>,
}

/// Where a writer's files go on a shared file system, and who the writer is (see the module
/// docs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SharedFs {
    /// Subdirectory of the namespace directory, e.g. `tp2_r0` (1 to 64 of `[A-Za-z0-9_-]`).
    pub partition: String,
    /// This writer's id, unique among the writers of the partition (1 to 64 of
    /// `[A-Za-z0-9_-]`), e.g. the host name and process.
    pub writer: String,
}

impl SharedFs {
    /// The partition of rank `rank` of a TP degree `tp`: `tp<tp>_r<rank>`.
    pub fn tp_rank(tp: u32, rank: u32, writer: impl Into<String>) -> SharedFs {
        SharedFs {
            partition: format!("tp{tp}_r{rank}"),
            writer: writer.into(),
        }
    }

    /// Checks both names.
    ///
    /// Errors: [`Error::InvalidArgument`] naming the bad one.
    pub fn validate(&self) -> Result<()> {
        for (what, v) in [("partition", &self.partition), ("writer", &self.writer)] {
            validate_component(what, v)?;
        }
        Ok(())
    }
}

/// Checks a path component: 1 to 64 of `[A-Za-z0-9_-]`.
pub(crate) fn validate_component(what: &str, v: &str) -> Result<()> {
    let ok = !v.is_empty()
        && v.len() <= 64
        && v.bytes()
            .all(|c| c.is_ascii_alphanumeric() || c == b'_' || c == b'-');
    if ok {
        Ok(())
    } else {
        Err(Error::InvalidArgument(format!(
            "shared disk tier: {what} {v:?} must be 1 to 64 of [A-Za-z0-9_-]"
        )))
    }
}

impl DiskOptions {
    /// Options for `dir` with `capacity_bytes`, io_uring and `O_DIRECT` on.
    pub fn new(dir: impl Into<PathBuf>, capacity_bytes: u64) -> DiskOptions {
        DiskOptions {
            dir: dir.into(),
            capacity_bytes,
            io_uring: true,
            direct: true,
            shared: None,
        }
    }
}

/// The I/O path in use.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum IoBackend {
    /// io_uring.
    IoUring,
    /// `pwritev`/`preadv`; the reason io_uring is not used.
    Fallback(String),
}

impl std::fmt::Display for IoBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            IoBackend::IoUring => write!(f, "io_uring"),
            IoBackend::Fallback(r) => write!(f, "pwritev/preadv ({r})"),
        }
    }
}

/// What a block file records about its block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FileMeta {
    /// Block key.
    pub key: u128,
    /// Parent key.
    pub parent: Option<u128>,
    /// Length of the block's data in bytes.
    pub len: u64,
    /// xxh3-64 of the data.
    pub checksum: u64,
    /// Logical time of the write.
    pub tick: u64,
}

/// Why a block file could not be read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Miss {
    /// No such file.
    Missing,
    /// Wrong size or a short read.
    Truncated(String),
    /// Header or data checksum wrong, or a header naming another block or namespace.
    Corrupt(String),
    /// An I/O error.
    Io(String),
}

impl std::fmt::Display for Miss {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Miss::Missing => write!(f, "file missing"),
            Miss::Truncated(s) => write!(f, "truncated: {s}"),
            Miss::Corrupt(s) => write!(f, "corrupt: {s}"),
            Miss::Io(s) => write!(f, "i/o error: {s}"),
        }
    }
}

/// A block to write: its meta and its bytes (`meta.len` bytes at `data`, readable for
/// `padded(meta.len)` bytes when `aligned` is true).
#[derive(Debug, Clone, Copy)]
pub struct WriteItem {
    /// The block.
    pub meta: FileMeta,
    /// Its bytes.
    pub data: *const u8,
    /// `data` is 4096-aligned and readable (zero-padded) up to `padded(meta.len)`: written
    /// straight from there; otherwise through a bounce buffer.
    pub aligned: bool,
}

/// A block to read into `dst` (writable for `padded(len)` bytes if `aligned`, else `len` bytes),
/// expected to hold `key` with `len` bytes and `checksum`.
#[derive(Debug, Clone, Copy)]
pub struct ReadItem {
    /// The block.
    pub key: u128,
    /// Expected length.
    pub len: u64,
    /// Expected xxh3-64 of the data.
    pub checksum: u64,
    /// Destination.
    pub dst: *mut u8,
    /// `dst` is 4096-aligned and writable up to `padded(len)`.
    pub aligned: bool,
}

/// `len` rounded up to 4096.
pub fn padded(len: u64) -> u64 {
    len.next_multiple_of(ALIGN as u64)
}

/// A 4096-aligned heap buffer.
pub(crate) struct AlignedBuf {
    ptr: *mut u8,
    len: usize,
}

impl AlignedBuf {
    pub(crate) fn zeroed(len: usize) -> AlignedBuf {
        let len = len.max(ALIGN);
        let layout = std::alloc::Layout::from_size_align(len, ALIGN).expect("valid layout");
        // SAFETY: non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        if ptr.is_null() {
            std::alloc::handle_alloc_error(layout);
        }
        AlignedBuf { ptr, len }
    }
    pub(crate) fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: our allocation of `len` bytes.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        let layout = std::alloc::Layout::from_size_align(self.len, ALIGN).expect("valid layout");
        // SAFETY: allocated above with this layout.
        unsafe { std::alloc::dealloc(self.ptr, layout) };
    }
}

/// The disk tier of one store (see the module docs).
pub struct DiskTier {
    dir: PathBuf,
    /// The partition (or namespace) directory, opened once and checked: every file is reached
    /// through it (`openat` with `O_NOFOLLOW`, `renameat`, `unlinkat`; see [`super::dirfd`]).
    dirfd: DirFd,
    ns: u128,
    capacity_bytes: u64,
    /// `None` inside once the ring failed (never entered again, so nothing stale is submitted).
    ring: Option<Mutex<Option<io_uring::IoUring>>>,
    backend: IoBackend,
    direct: AtomicBool,
    tmp_counter: AtomicU64,
    uid: u32,
    /// The writer id on a shared file system.
    writer: Option<String>,
    direct_requested: bool,
    /// Files opened without `O_DIRECT` although it was asked for (the file system refused it).
    direct_fallbacks: AtomicU64,
    _lock: File,
}

// SAFETY: the ring is only used under its mutex; the other fields are plain data or atomics.
unsafe impl Sync for DiskTier {}

impl std::fmt::Debug for DiskTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DiskTier")
            .field("dir", &self.dir)
            .field("backend", &self.backend)
            .field("direct", &self.direct.load(Ordering::Relaxed))
            .finish()
    }
}

/// Header bytes 128..208: the writer id (length byte, up to 64 bytes) and an xxh3-64 of 128..193.
fn writer_bytes(writer: Option<&str>, out: &mut [u8]) {
    if let Some(w) = writer {
        let b = w.as_bytes();
        let n = b.len().min(64);
        out[128] = n as u8;
        out[129..129 + n].copy_from_slice(&b[..n]);
        let c = xxhash_rust::xxh3::xxh3_64(&out[128..193]);
        out[200..208].copy_from_slice(&c.to_le_bytes());
    }
}

/// The writer id recorded in a header, if any (and intact).
pub(crate) fn writer_of(h: &[u8]) -> Option<String> {
    let n = h[128] as usize;
    if n == 0 || n > 64 {
        return None;
    }
    let c = u64::from_le_bytes(h[200..208].try_into().expect("8 bytes"));
    if xxhash_rust::xxh3::xxh3_64(&h[128..193]) != c {
        return None;
    }
    std::str::from_utf8(&h[129..129 + n])
        .ok()
        .map(str::to_string)
}

fn header_bytes(ns: u128, m: &FileMeta, out: &mut [u8]) {
    out[..FILE_HEADER].fill(0);
    out[0..8].copy_from_slice(&FILE_MAGIC);
    out[8..12].copy_from_slice(&FILE_VERSION.to_le_bytes());
    out[16..32].copy_from_slice(&ns.to_le_bytes());
    out[32..48].copy_from_slice(&m.key.to_le_bytes());
    out[48..64].copy_from_slice(&m.parent.unwrap_or(0).to_le_bytes());
    out[64..72].copy_from_slice(&u64::from(m.parent.is_some()).to_le_bytes());
    out[72..80].copy_from_slice(&m.len.to_le_bytes());
    out[80..88].copy_from_slice(&m.checksum.to_le_bytes());
    out[88..96].copy_from_slice(&m.tick.to_le_bytes());
    let c = xxhash_rust::xxh3::xxh3_64(&out[..120]);
    out[120..128].copy_from_slice(&c.to_le_bytes());
}

pub(crate) fn parse_header(ns: u128, h: &[u8]) -> std::result::Result<FileMeta, Miss> {
    let u64_at = |o: usize| u64::from_le_bytes(h[o..o + 8].try_into().expect("8 bytes"));
    let u128_at = |o: usize| u128::from_le_bytes(h[o..o + 16].try_into().expect("16 bytes"));
    if h[0..8] != FILE_MAGIC {
        return Err(Miss::Corrupt("bad magic".into()));
    }
    if xxhash_rust::xxh3::xxh3_64(&h[..120]) != u64_at(120) {
        return Err(Miss::Corrupt("header checksum mismatch".into()));
    }
    let v = u32::from_le_bytes(h[8..12].try_into().expect("4 bytes"));
    if v != FILE_VERSION {
        return Err(Miss::Corrupt(format!("file version {v}")));
    }
    if u128_at(16) != ns {
        return Err(Miss::Corrupt("block of another namespace".into()));
    }
    Ok(FileMeta {
        key: u128_at(32),
        parent: (u64_at(64) == 1).then(|| u128_at(48)),
        len: u64_at(72),
        checksum: u64_at(80),
        tick: u64_at(88),
    })
}

/// The name of `key`'s block file in the tier's directory.
fn file_name(key: u128) -> String {
    format!("{}.kvb", BlockKey(key).hex())
}

fn env_disables_uring() -> bool {
    matches!(
        std::env::var("TPU_SYNC_STORE_IO_URING").as_deref(),
        Ok("0") | Ok("off") | Ok("false")
    )
}

impl DiskTier {
    /// Opens the tier for namespace `ns` under `opts.dir` (creating the directories), takes its
    /// lock, removes temporary files and unreadable block files, and returns the tier with the
    /// metas of every valid block file found (for the index).
    ///
    /// Errors: [`Error::Io`] when the directory cannot be created or read, or is locked by another
    /// store (`WouldBlock`).
    pub fn open(opts: &DiskOptions, ns: &Namespace) -> Result<(DiskTier, Vec<FileMeta>)> {
        if let Some(s) = &opts.shared {
            s.validate()?;
        }
        let ns_name = format!("{:032x}", ns.id());
        let ns_dir = opts.dir.join(&ns_name);
        std::fs::create_dir_all(&opts.dir)
            .map_err(|e| Error::io(format!("create disk tier {}", opts.dir.display()), e))?;
        // Every directory below the configured root is created and opened relative to its
        // parent's descriptor with O_NOFOLLOW (the namespace directory may be shared with other
        // writers, even other users: a symlink planted under a name is refused, and a directory
        // renamed away after the checks below cannot redirect a later write or delete).
        let root = DirFd::open(&opts.dir)
            .map_err(|e| Error::io(format!("open disk tier {}", opts.dir.display()), e))?;
        let sub = |parent: &DirFd, name: &str| -> Result<DirFd> {
            let shown = parent.path().join(name);
            parent
                .mkdir(name, 0o700)
                .map_err(|e| Error::io(format!("create disk tier {}", shown.display()), e))?;
            parent.subdir(name).map_err(|e| {
                Error::io(
                    format!(
                        "open disk tier {} (a directory, never a symlink)",
                        shown.display()
                    ),
                    e,
                )
            })
        };
        let ns_fd = sub(&root, &ns_name)?;
        let dirfd = match &opts.shared {
            Some(s) => sub(&ns_fd, &s.partition)?,
            None => sub(&root, &ns_name)?,
        };
        let dir = dirfd.path().to_path_buf();
        let md = dirfd
            .metadata()
            .map_err(|e| Error::io(format!("stat {}", dir.display()), e))?;
        // SAFETY: geteuid has no preconditions.
        let me = unsafe { libc::geteuid() };
        if !md.is_dir() || md.uid() != me || md.mode() & 0o022 != 0 {
            return Err(Error::io(
                format!("disk tier {}", dir.display()),
                std::io::Error::new(
                    std::io::ErrorKind::PermissionDenied,
                    format!(
                        "must be a directory owned by uid {me} and writable only by it (found \
                         uid {}, mode {:o})",
                        md.uid(),
                        md.mode() & 0o7777
                    ),
                ),
            ));
        }
        // NAMESPACE (informational: which model/layout the directory holds), written through the
        // namespace directory's descriptor with O_NOFOLLOW, so a symlink a co-tenant planted
        // under that name is refused instead of written through.
        let nsf = ns_fd.open_file(
            "NAMESPACE",
            libc::O_WRONLY | libc::O_CREAT | libc::O_TRUNC,
            0o644,
        );
        match nsf.and_then(|mut f| {
            std::io::Write::write_all(&mut f, format!("{}\n", ns.description()).as_bytes())
        }) {
            Ok(()) => {}
            Err(e) => log::info!("disk tier {}: NAMESPACE not written: {e}", ns_dir.display()),
        }
        let writer = opts.shared.as_ref().map(|s| s.writer.clone());
        let lock_name = match &writer {
            Some(w) => format!(".lock.{w}"),
            None => ".lock".to_string(),
        };
        let lock = dirfd
            .open_file(&lock_name, libc::O_RDWR | libc::O_CREAT, 0o600)
            .map_err(|e| Error::io(format!("open {}/{lock_name}", dir.display()), e))?;
        // SAFETY: flock on our open descriptor.
        if unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
            return Err(Error::io(
                format!("disk tier {} is in use by another store", dir.display()),
                std::io::Error::last_os_error(),
            ));
        }
        let (ring, backend) = if !opts.io_uring {
            (
                None,
                IoBackend::Fallback("io_uring turned off by option".into()),
            )
        } else if env_disables_uring() {
            (
                None,
                IoBackend::Fallback("io_uring turned off by TPU_SYNC_STORE_IO_URING".into()),
            )
        } else {
            match io_uring::IoUring::new(RING_ENTRIES) {
                Ok(r) => (Some(Mutex::new(Some(r))), IoBackend::IoUring),
                Err(e) => {
                    log::warn!(
                        "disk tier {}: io_uring unavailable ({e}); using pwritev/preadv",
                        dir.display()
                    );
                    (
                        None,
                        IoBackend::Fallback(format!("io_uring_setup failed: {e}")),
                    )
                }
            }
        };
        let tier = DiskTier {
            dir,
            dirfd,
            ns: ns.id(),
            capacity_bytes: opts.capacity_bytes,
            ring,
            backend,
            direct: AtomicBool::new(opts.direct),
            tmp_counter: AtomicU64::new(0),
            uid: me,
            writer,
            direct_requested: opts.direct,
            direct_fallbacks: AtomicU64::new(0),
            _lock: lock,
        };
        let found = tier.scan()?;
        Ok((tier, found))
    }

    /// The I/O path in use.
    pub fn backend(&self) -> &IoBackend {
        &self.backend
    }

    /// Whether files are opened with `O_DIRECT`.
    pub fn direct(&self) -> bool {
        self.direct.load(Ordering::Relaxed)
    }

    /// The namespace directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Files opened buffered because the file system refused `O_DIRECT` (0 when it was never
    /// asked for or always granted).
    pub fn direct_fallbacks(&self) -> u64 {
        self.direct_fallbacks.load(Ordering::Relaxed)
    }

    /// The writer id on a shared file system.
    pub fn writer(&self) -> Option<&str> {
        self.writer.as_deref()
    }

    /// Bytes allowed.
    pub fn capacity_bytes(&self) -> u64 {
        self.capacity_bytes
    }

    /// Path of `key`'s block file.
    pub fn file_path(&self, key: u128) -> PathBuf {
        self.dir.join(file_name(key))
    }

    fn scan(&self) -> Result<Vec<FileMeta>> {
        let names = self
            .dirfd
            .entries()
            .map_err(|e| Error::io(format!("read {}", self.dir.display()), e))?;
        let mut out = Vec::new();
        for name in names {
            let Ok(name) = name.into_string() else {
                continue;
            };
            let path = self.dir.join(&name);
            if name.starts_with('.') && name.ends_with(".tmp") {
                // `.<key>.<writer>.<pid>.<n>.tmp` on a shared file system: only our own.
                let mine = match &self.writer {
                    None => true,
                    Some(w) => name.split('.').nth(2) == Some(w.as_str()),
                };
                if mine {
                    let _ = self.dirfd.unlink(&name);
                }
                continue;
            }
            let Some(key) = name.strip_suffix(".kvb").and_then(BlockKey::from_hex) else {
                continue;
            };
            match self.read_header_buffered(&name, key.0) {
                Ok((m, w)) => {
                    if self.writer.is_none() || w == self.writer {
                        out.push(m)
                    }
                }
                Err(_) if self.writer.is_some() => {
                    // Another writer's file, or one being replaced: not ours to delete.
                }
                Err(miss) => {
                    log::warn!("disk tier: dropping {}: {miss}", path.display());
                    let _ = self.dirfd.unlink(&name);
                }
            }
        }
        Ok(out)
    }

    fn read_header_buffered(
        &self,
        name: &str,
        key: u128,
    ) -> std::result::Result<(FileMeta, Option<String>), Miss> {
        let mut f = self
            .dirfd
            .open_file(name, libc::O_RDONLY, 0)
            .map_err(|e| Miss::Io(e.to_string()))?;
        let md = f.metadata().map_err(|e| Miss::Io(e.to_string()))?;
        if !md.is_file() || md.uid() != self.uid {
            return Err(Miss::Corrupt(format!(
                "not a regular file owned by uid {}",
                self.uid
            )));
        }
        let size = md.size();
        let mut h = vec![0u8; FILE_HEADER];
        f.read_exact(&mut h)
            .map_err(|_| Miss::Truncated(format!("{size} B, no full header")))?;
        let m = parse_header(self.ns, &h)?;
        if m.key != key {
            return Err(Miss::Corrupt("header names another block".into()));
        }
        let want = FILE_HEADER as u64 + padded(m.len);
        if size != want {
            return Err(Miss::Truncated(format!("{size} B, expected {want} B")));
        }
        Ok((m, writer_of(&h)))
    }

    /// Opens block or temporary file `name` of the tier's directory (through its descriptor,
    /// `O_NOFOLLOW`): for writing, a new file (`O_EXCL`, mode 0600); `O_DIRECT` while the file
    /// system accepts it.
    fn open_file(&self, name: &str, write: bool) -> std::io::Result<File> {
        let (flags, mode) = if write {
            (libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL, 0o600)
        } else {
            (libc::O_RDONLY, 0)
        };
        if self.direct.load(Ordering::Relaxed) {
            match self.dirfd.open_file(name, flags | libc::O_DIRECT, mode) {
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                    if self.direct.swap(false, Ordering::Relaxed) {
                        log::warn!(
                            "disk tier {}: O_DIRECT refused by the file system; using buffered I/O",
                            self.dir.display()
                        );
                    }
                }
                r => return r,
            }
        }
        if self.direct_requested {
            self.direct_fallbacks.fetch_add(1, Ordering::Relaxed);
        }
        self.dirfd.open_file(name, flags, mode)
    }

    /// Writes blocks to their files (batched through io_uring when available). Returns one result
    /// per item, in order. A failed item leaves no file behind.
    ///
    /// # Safety
    /// Each item's `data` must be readable as described on [`WriteItem`] and not written by anyone
    /// until this call returns.
    pub unsafe fn write_blocks(&self, items: &[WriteItem]) -> Vec<Result<()>> {
        let mut out: Vec<Result<()>> = Vec::with_capacity(items.len());
        for chunk in items.chunks(RING_ENTRIES as usize) {
            // SAFETY: forwarded.
            out.extend(unsafe { self.write_chunk(chunk) });
        }
        out
    }

    unsafe fn write_chunk(&self, items: &[WriteItem]) -> Vec<Result<()>> {
        struct Job {
            tmp: String,
            key: String,
            file: Option<File>,
            hdr: AlignedBuf,
            bounce: Option<AlignedBuf>,
            iov: [libc::iovec; 2],
            want: usize,
            res: Option<std::io::Result<usize>>,
        }
        let pid = std::process::id();
        let mut jobs: Vec<Job> = Vec::with_capacity(items.len());
        for it in items {
            let n = self.tmp_counter.fetch_add(1, Ordering::Relaxed);
            let key = BlockKey(it.meta.key).hex();
            let tmp = match &self.writer {
                Some(w) => format!(".{key}.{w}.{pid}.{n}.tmp"),
                None => format!(".{key}.{pid}.{n}.tmp"),
            };
            let mut hdr = AlignedBuf::zeroed(FILE_HEADER);
            header_bytes(self.ns, &it.meta, hdr.as_mut_slice());
            writer_bytes(self.writer.as_deref(), hdr.as_mut_slice());
            let plen = padded(it.meta.len) as usize;
            let (data_ptr, bounce) = if it.aligned && (it.data as usize) % ALIGN == 0 {
                (it.data as *mut u8, None)
            } else {
                let mut b = AlignedBuf::zeroed(plen);
                // SAFETY: `data` is readable for `len` bytes (caller's contract); `b` is ours.
                unsafe { std::ptr::copy_nonoverlapping(it.data, b.ptr, it.meta.len as usize) };
                let p = b.as_mut_slice().as_mut_ptr();
                (p, Some(b))
            };
            let iov = [
                libc::iovec {
                    iov_base: hdr.ptr as *mut _,
                    iov_len: FILE_HEADER,
                },
                libc::iovec {
                    iov_base: data_ptr as *mut _,
                    iov_len: plen,
                },
            ];
            let (file, res) = match self.open_file(&tmp, true) {
                Ok(f) => (Some(f), None),
                Err(e) => (None, Some(Err(e))),
            };
            jobs.push(Job {
                tmp,
                key,
                file,
                hdr,
                bounce,
                iov,
                want: FILE_HEADER + plen,
                res,
            });
        }
        let pending: Vec<usize> = (0..jobs.len()).filter(|&i| jobs[i].res.is_none()).collect();
        let ops: Vec<(i32, *const libc::iovec)> = pending
            .iter()
            .map(|&i| {
                (
                    jobs[i].file.as_ref().expect("open").as_raw_fd(),
                    jobs[i].iov.as_ptr(),
                )
            })
            .collect();
        // SAFETY: the iovecs point into `hdr`/`bounce` buffers owned by `jobs` or into caller
        // memory valid for the call; `jobs` is not moved until the I/O completes.
        let results = unsafe { self.vectored(&ops, true) };
        for (&i, r) in pending.iter().zip(results) {
            jobs[i].res = Some(r);
        }
        jobs.into_iter()
            .map(|j| {
                let _keep = (&j.hdr, &j.bounce);
                let r = match j.res.expect("every job has a result") {
                    Ok(n) if n == j.want => {
                        drop(j.file);
                        self.dirfd
                            .rename(&j.tmp, &format!("{}.kvb", j.key))
                            .map_err(|e| {
                                Error::io(format!("rename {}", self.dir.join(&j.tmp).display()), e)
                            })
                    }
                    Ok(n) => Err(Error::io(
                        format!("write {}", self.dir.join(&j.tmp).display()),
                        std::io::Error::new(
                            std::io::ErrorKind::WriteZero,
                            format!("short write: {n} of {} bytes", j.want),
                        ),
                    )),
                    Err(e) => Err(Error::io(
                        format!("write {}", self.dir.join(&j.tmp).display()),
                        e,
                    )),
                };
                if r.is_err() {
                    let _ = self.dirfd.unlink(&j.tmp);
                }
                r
            })
            .collect()
    }

    /// Reads blocks from their files into their destinations and checks header, size and data
    /// checksum. One result per item, in order; a bad file is deleted.
    ///
    /// # Safety
    /// Each item's `dst` must be writable as described on [`ReadItem`] and not accessed by anyone
    /// else until this call returns.
    pub unsafe fn read_blocks(&self, items: &[ReadItem]) -> Vec<std::result::Result<(), Miss>> {
        let mut out = Vec::with_capacity(items.len());
        for chunk in items.chunks(RING_ENTRIES as usize) {
            // SAFETY: forwarded.
            out.extend(unsafe { self.read_chunk(chunk) });
        }
        out
    }

    unsafe fn read_chunk(&self, items: &[ReadItem]) -> Vec<std::result::Result<(), Miss>> {
        struct Job {
            file: Option<File>,
            hdr: AlignedBuf,
            bounce: Option<AlignedBuf>,
            iov: [libc::iovec; 2],
            want: usize,
            res: Option<std::result::Result<(), Miss>>,
        }
        let mut jobs: Vec<Job> = Vec::with_capacity(items.len());
        for it in items {
            let hdr = AlignedBuf::zeroed(FILE_HEADER);
            let plen = padded(it.len) as usize;
            let want = FILE_HEADER + plen;
            let mut res = None;
            let file = match self.open_file(&file_name(it.key), false) {
                Ok(f) => match f.metadata() {
                    Ok(md) if md.uid() != self.uid => {
                        res = Some(Err(Miss::Corrupt(format!(
                            "owned by uid {}, not {}",
                            md.uid(),
                            self.uid
                        ))));
                        None
                    }
                    Ok(md) if md.size() == want as u64 => Some(f),
                    Ok(md) => {
                        res = Some(Err(Miss::Truncated(format!(
                            "{} B, expected {want} B",
                            md.size()
                        ))));
                        None
                    }
                    Err(e) => {
                        res = Some(Err(Miss::Io(e.to_string())));
                        None
                    }
                },
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                    res = Some(Err(Miss::Missing));
                    None
                }
                Err(e) => {
                    res = Some(Err(Miss::Io(e.to_string())));
                    None
                }
            };
            let (dst, bounce) = if it.aligned && (it.dst as usize) % ALIGN == 0 {
                (it.dst, None)
            } else {
                let mut b = AlignedBuf::zeroed(plen);
                let p = b.as_mut_slice().as_mut_ptr();
                (p, Some(b))
            };
            let iov = [
                libc::iovec {
                    iov_base: hdr.ptr as *mut _,
                    iov_len: FILE_HEADER,
                },
                libc::iovec {
                    iov_base: dst as *mut _,
                    iov_len: plen,
                },
            ];
            jobs.push(Job {
                file,
                hdr,
                bounce,
                iov,
                want,
                res,
            });
        }
        let pending: Vec<usize> = (0..jobs.len()).filter(|&i| jobs[i].res.is_none()).collect();
        let ops: Vec<(i32, *const libc::iovec)> = pending
            .iter()
            .map(|&i| {
                (
                    jobs[i].file.as_ref().expect("open").as_raw_fd(),
                    jobs[i].iov.as_ptr(),
                )
            })
            .collect();
        // SAFETY: the iovecs point into buffers owned by `jobs` or caller memory writable for the
        // call (contract); `jobs` is not moved until the I/O completes.
        let results = unsafe { self.vectored(&ops, false) };
        for (&i, r) in pending.iter().zip(results) {
            let want = jobs[i].want;
            jobs[i].res = Some(match r {
                Ok(n) if n == want => Ok(()),
                Ok(n) => Err(Miss::Truncated(format!("read {n} of {want} B"))),
                Err(e) => Err(Miss::Io(e.to_string())),
            });
        }
        let mut out = Vec::with_capacity(items.len());
        for (it, mut j) in items.iter().zip(jobs) {
            let mut r = j.res.take().expect("every job has a result");
            if r.is_ok() {
                r = (|| {
                    let m = parse_header(self.ns, j.hdr.as_mut_slice())?;
                    if m.key != it.key {
                        return Err(Miss::Corrupt("header names another block".into()));
                    }
                    if m.len != it.len || m.checksum != it.checksum {
                        return Err(Miss::Corrupt(
                            "header length/checksum differ from the index".into(),
                        ));
                    }
                    let data: &[u8] = match &mut j.bounce {
                        Some(b) => &b.as_mut_slice()[..it.len as usize],
                        // SAFETY: `dst` is exclusively ours for the call and was just filled.
                        None => unsafe { std::slice::from_raw_parts(it.dst, it.len as usize) },
                    };
                    if xxhash_rust::xxh3::xxh3_64(data) != it.checksum {
                        return Err(Miss::Corrupt("data checksum mismatch".into()));
                    }
                    if let Some(b) = &j.bounce {
                        // SAFETY: `dst` is writable for `len` bytes (contract).
                        unsafe { std::ptr::copy_nonoverlapping(b.ptr, it.dst, it.len as usize) };
                    }
                    Ok(())
                })();
            }
            if let Err(ref m) = r {
                if *m != Miss::Missing {
                    log::warn!(
                        "disk tier: block {} unreadable ({m}); dropping its file",
                        BlockKey(it.key)
                    );
                    let _ = self.dirfd.unlink(&file_name(it.key));
                }
            }
            out.push(r);
        }
        out
    }

    /// Deletes `key`'s block file (a missing file is fine).
    pub fn remove(&self, key: u128) {
        if let Err(e) = self.dirfd.unlink(&file_name(key)) {
            if e.kind() != std::io::ErrorKind::NotFound {
                log::warn!("disk tier: cannot delete block {}: {e}", BlockKey(key));
            }
        }
    }

    /// Runs one vectored write or read per `(fd, iovec[2])` at offset 0 and returns the byte
    /// counts, through io_uring when available.
    ///
    /// # Safety
    /// The fds must be open and every iovec's memory valid (readable for writes, writable and
    /// unaliased for reads) until this returns.
    unsafe fn vectored(
        &self,
        ops: &[(i32, *const libc::iovec)],
        write: bool,
    ) -> Vec<std::io::Result<usize>> {
        if ops.is_empty() {
            return Vec::new();
        }
        if let Some(ring) = &self.ring {
            let mut guard = ring.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(r) = guard.as_mut() {
                // SAFETY: forwarded.
                match unsafe { uring_batch(r, ops, write) } {
                    Ok(v) => return v,
                    Err(e) => {
                        log::warn!(
                            "disk tier: io_uring submission failed ({e}); using pwritev/preadv                              from now on"
                        );
                        // Nothing was submitted: dropping the ring discards the queued entries.
                        *guard = None;
                    }
                }
            }
        }
        ops.iter()
            .map(|&(fd, iov)| {
                // SAFETY: forwarded from the caller's contract; 2 iovecs at offset 0.
                let n = unsafe {
                    if write {
                        libc::pwritev(fd, iov, 2, 0)
                    } else {
                        libc::preadv(fd, iov, 2, 0)
                    }
                };
                if n < 0 {
                    Err(std::io::Error::last_os_error())
                } else {
                    Ok(n as usize)
                }
            })
            .collect()
    }
}

/// Submits every op and waits for all completions. An error here means nothing is in flight
/// (submission failed before any op was accepted, or all were reaped).
///
/// # Safety
/// As for [`DiskTier::vectored`].
unsafe fn uring_batch(
    ring: &mut io_uring::IoUring,
    ops: &[(i32, *const libc::iovec)],
    write: bool,
) -> std::io::Result<Vec<std::io::Result<usize>>> {
    use io_uring::{opcode, types};
    debug_assert!(ops.len() <= RING_ENTRIES as usize);
    {
        let mut sq = ring.submission();
        for (i, &(fd, iov)) in ops.iter().enumerate() {
            let e = if write {
                opcode::Writev::new(types::Fd(fd), iov, 2).offset(0).build()
            } else {
                opcode::Readv::new(types::Fd(fd), iov, 2).offset(0).build()
            }
            .user_data(i as u64);
            // SAFETY: the entry's buffers outlive the completion (caller's contract; we reap
            // every completion below before returning).
            if unsafe { sq.push(&e) }.is_err() {
                return Err(std::io::Error::other("submission queue full"));
            }
        }
    }
    let mut results: Vec<Option<std::io::Result<usize>>> = (0..ops.len()).map(|_| None).collect();
    let mut done = 0;
    let mut submitted = false;
    while done < ops.len() {
        match ring.submit_and_wait(if submitted { 1 } else { ops.len() }) {
            Ok(_) => submitted = true,
            Err(e) if e.raw_os_error() == Some(libc::EINTR) => continue,
            Err(e) if !submitted => return Err(e),
            Err(e) => {
                // Completions are still owed; keep waiting rather than freeing live buffers.
                log::warn!("io_uring wait: {e}");
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
        }
        for cqe in ring.completion() {
            let i = cqe.user_data() as usize;
            if i < results.len() && results[i].is_none() {
                let r = cqe.result();
                results[i] = Some(if r < 0 {
                    Err(std::io::Error::from_raw_os_error(-r))
                } else {
                    Ok(r as usize)
                });
                done += 1;
            }
        }
    }
    Ok(results
        .into_iter()
        .map(|r| r.expect("every op completed"))
        .collect())
}
