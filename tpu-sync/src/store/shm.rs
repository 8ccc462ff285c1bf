//! The store's memory segment: a header, a slot table and the block slots, in one mapping that is
//! either anonymous (lost with the process) or a file in `/dev/shm` (kept across a restart, even
//! after SIGKILL).
//!
//! # Segment format (version [`FORMAT_VERSION`], all integers little endian)
//!
//! | offset | bytes | what |
//! |---|---|---|
//! | 0 | 4096 | header: [`MAGIC`], format version, header size, namespace id, geometry (block bytes, slot bytes, slots, table offset, data offset, total bytes), creation time, namespace description |
//! | 4096 | 64 x slots | slot table: one [`SlotMeta`] per slot |
//! | `data_off` (2 MiB aligned) | `slot_bytes` x slots | block slots |
//!
//! A slot's meta is 8 atomic 64-bit words: `seq`, key (2), parent key (2), `len | has_parent <<
//! 63`, checksum (xxh3-64), tick. **Commit protocol:** `seq` is 0 for a slot never used, odd while
//! the slot is being written or after its block left, and even (the block's *generation*) once the
//! block is committed. A writer makes `seq` odd (then a release fence) before it writes the first
//! byte, writes data and meta, and publishes the next even value with release ordering. So a slot
//! whose writer died mid-put (even by SIGKILL) stays odd and is never served after a restart, and
//! a reader that copied a slot without a lease can tell, by comparing `seq` after the copy
//! (acquire fence first) with the generation it started from, whether the slot changed under it.
//!
//! # Attaching
//!
//! A named segment lives at `<dir>/tpu-sync-kv.<name>` (`dir` is `/dev/shm` by default). It is
//! created with mode 0600 and opened with `O_NOFOLLOW`; a segment owned by another user is refused,
//! one readable or writable by others is reformatted (its contents are not trusted). The opener
//! takes an exclusive `flock` for as long as the segment is mapped, so two servers can never use
//! one name at once, and the kernel drops the lock when the owner dies. An existing segment is
//! re-attached only if magic, version, namespace and geometry all match; otherwise it is
//! reformatted and the reason logged. Reformatting never reuses the file: the name is unlinked
//! and a new file (a new inode, `O_EXCL`) created in its place, so a process that opened or
//! mapped the old one keeps only the old bytes and never sees a block of the new store. The
//! header's magic is written last, so a segment whose formatting was interrupted is reformatted
//! on the next attach.
//!
//! Thread-safety: [`Segment`] is `Send + Sync`; slot metas are atomics, slot data is accessed
//! through raw pointers under the store's slot ownership rules.

use std::fs::File;
use std::io::Read;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::ptr::NonNull;
use std::sync::atomic::{fence, AtomicU64, Ordering};

use crate::arena::{ArenaOptions, LockStatus, PinnedArena};
use crate::error::{Error, Result};
use crate::store::key::Namespace;

/// First 8 bytes of a segment.
pub const MAGIC: [u8; 8] = *b"TPUSKVS1";
/// Segment format version.
pub const FORMAT_VERSION: u32 = 1;
/// Bytes of the header.
pub const HEADER_BYTES: u64 = 4096;
/// Bytes of one slot's meta in the slot table.
pub const META_BYTES: u64 = 64;
/// Alignment of the data area (a 2 MiB huge page).
pub const DATA_ALIGN: u64 = 2 << 20;
/// File name prefix of segments in the shm directory.
pub const SHM_PREFIX: &str = "tpu-sync-kv.";
/// Default directory of named segments.
pub const DEFAULT_SHM_DIR: &str = "/dev/shm";

const OFF_VERSION: usize = 8;
const OFF_HEADER_BYTES: usize = 12;
const OFF_NS: usize = 16;
const OFF_BLOCK: usize = 32;
const OFF_SLOT: usize = 40;
const OFF_SLOTS: usize = 48;
const OFF_TABLE: usize = 56;
const OFF_DATA: usize = 64;
const OFF_TOTAL: usize = 72;
const OFF_CREATED: usize = 80;
const OFF_DESC_LEN: usize = 88;
const OFF_DESC: usize = 96;
const MAX_DESC: usize = 1024;

/// Sizes and offsets of a segment, derived from the block size and the capacity.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Geometry {
    /// Largest block the store accepts (bytes).
    pub block_bytes: u64,
    /// Bytes per slot: `block_bytes` rounded up to 4096 (blocks of 4 KiB or more, so slots are
    /// page aligned for `O_DIRECT` and DMA) or to 64 (smaller blocks).
    pub slot_bytes: u64,
    /// Number of slots: `capacity_bytes / slot_bytes`.
    pub num_slots: u64,
    /// Offset of the slot table.
    pub table_off: u64,
    /// Offset of slot 0's data (a multiple of [`DATA_ALIGN`]).
    pub data_off: u64,
    /// Bytes of the whole mapping.
    pub total_bytes: u64,
}

impl Geometry {
    /// Geometry for blocks of at most `block_bytes` and `capacity_bytes` of block slots
    /// (the header and slot table, 4 KiB + 64 B per slot, come on top).
    ///
    /// Errors: [`Error::InvalidArgument`] when the block size is 0, the capacity holds no slot,
    /// or the slot count exceeds 2^31.
    pub fn new(block_bytes: u64, capacity_bytes: u64) -> Result<Geometry> {
        if block_bytes == 0 {
            return Err(Error::InvalidArgument(
                "store block size must be > 0".into(),
            ));
        }
        let align = if block_bytes >= 4096 { 4096 } else { 64 };
        let slot_bytes = block_bytes
            .checked_next_multiple_of(align)
            .ok_or_else(|| Error::InvalidArgument("block size overflows".into()))?;
        let num_slots = capacity_bytes / slot_bytes;
        if num_slots == 0 {
            return Err(Error::InvalidArgument(format!(
                "store capacity {capacity_bytes} B holds no slot of {slot_bytes} B"
            )));
        }
        if num_slots > (1 << 31) {
            return Err(Error::InvalidArgument(format!(
                "{num_slots} slots: at most 2^31 blocks per store"
            )));
        }
        let table_off = HEADER_BYTES;
        let data_off = (table_off + num_slots * META_BYTES).next_multiple_of(DATA_ALIGN);
        let total_bytes = data_off + num_slots * slot_bytes;
        Ok(Geometry {
            block_bytes,
            slot_bytes,
            num_slots,
            table_off,
            data_off,
            total_bytes,
        })
    }
}

/// How a segment came to be.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Attach {
    /// Anonymous memory (no `--shm` name): empty, lost with the process.
    Anonymous,
    /// A new named segment.
    Created,
    /// An existing named segment with a matching header: its committed blocks are served.
    Attached,
    /// An existing named segment that could not be used; the reason, as logged.
    Reformatted(String),
}

/// A committed slot found when re-attaching.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CommittedSlot {
    /// Slot number.
    pub slot: u32,
    /// Block key.
    pub key: u128,
    /// Parent key, if recorded.
    pub parent: Option<u128>,
    /// Generation (the even `seq`).
    pub gen: u64,
    /// Stored length in bytes.
    pub len: u64,
    /// xxh3-64 of the stored bytes.
    pub checksum: u64,
    /// Logical time of the commit.
    pub tick: u64,
}

/// What a writer records when it commits a slot.
#[derive(Debug, Clone, Copy)]
pub struct SlotMeta {
    /// Block key.
    pub key: u128,
    /// Parent key.
    pub parent: Option<u128>,
    /// Stored length in bytes (at most the slot size).
    pub len: u64,
    /// xxh3-64 of the stored bytes.
    pub checksum: u64,
    /// Logical time of the commit.
    pub tick: u64,
}

enum Backing {
    Anon(#[allow(dead_code)] PinnedArena),
    Shm {
        map: memmap2::MmapMut,
        // Holds the exclusive flock for as long as the segment is mapped.
        _file: File,
        path: PathBuf,
    },
}

/// A mapped segment (see the module docs).
pub struct Segment {
    base: NonNull<u8>,
    geo: Geometry,
    backing: Backing,
    lock: LockStatus,
    attach: Attach,
}

// SAFETY: the mapping is plain shared memory; metas are accessed only through atomics and slot data
// through raw pointers under the store's ownership protocol (one writer per slot, readers validate).
unsafe impl Send for Segment {}
// SAFETY: as above.
unsafe impl Sync for Segment {}

impl std::fmt::Debug for Segment {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Segment")
            .field("geometry", &self.geo)
            .field("path", &self.path())
            .field("attach", &self.attach)
            .finish()
    }
}

/// Checks a segment name: 1 to 100 characters from `[A-Za-z0-9._-]`, not starting with `.` or
/// `-`.
pub fn validate_name(name: &str) -> Result<()> {
    let ok = !name.is_empty()
        && name.len() <= 100
        && name
            .bytes()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'.' | b'_' | b'-'))
        && !name.starts_with(['.', '-']);
    if ok {
        Ok(())
    } else {
        Err(Error::InvalidArgument(format!(
            "shared-memory segment name `{name}`: use 1-100 characters from [A-Za-z0-9._-], not \
             starting with '.' or '-'"
        )))
    }
}

/// Path of segment `name` in `dir`.
pub fn segment_path(dir: &Path, name: &str) -> PathBuf {
    dir.join(format!("{SHM_PREFIX}{name}"))
}

fn euid() -> u32 {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() }
}

fn flock(f: &File, op: libc::c_int) -> std::io::Result<()> {
    // SAFETY: flock on an open descriptor we own.
    if unsafe { libc::flock(f.as_raw_fd(), op | libc::LOCK_NB) } == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// How long an exclusive lock is retried: `list_segments` holds a shared lock on each segment for
/// an instant to see whether it is in use, which must not make a starting server fail.
const LOCK_RETRY: std::time::Duration = std::time::Duration::from_millis(500);

/// `flock(LOCK_EX)`, retried for [`LOCK_RETRY`] while another descriptor holds the lock.
fn flock_exclusive(f: &File) -> std::io::Result<()> {
    let deadline = std::time::Instant::now() + LOCK_RETRY;
    loop {
        match flock(f, libc::LOCK_EX) {
            Err(e)
                if e.kind() == std::io::ErrorKind::WouldBlock
                    && std::time::Instant::now() < deadline =>
            {
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
            r => return r,
        }
    }
}

/// Unlinks the segment at `path` and creates a new, empty file (a new inode, mode 0600,
/// exclusively: `O_EXCL`, `O_NOFOLLOW`) under the same name, locked with an exclusive `flock`.
/// Errors: [`Error::Io`] when the name cannot be unlinked, another process created it meanwhile
/// (`AlreadyExists`), or the lock cannot be taken.
fn recreate(path: &Path, shown: &str) -> Result<File> {
    std::fs::remove_file(path)
        .map_err(|e| Error::io(format!("unlink untrusted segment {shown}"), e))?;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)
        .map_err(|e| Error::io(format!("create shared-memory segment {shown} anew"), e))?;
    flock_exclusive(&file)
        .map_err(|e| Error::io(format!("lock the new shared-memory segment {shown}"), e))?;
    Ok(file)
}

fn rd_u32(h: &[u8], off: usize) -> u32 {
    u32::from_le_bytes(h[off..off + 4].try_into().expect("4 bytes"))
}
fn rd_u64(h: &[u8], off: usize) -> u64 {
    u64::from_le_bytes(h[off..off + 8].try_into().expect("8 bytes"))
}
fn rd_u128(h: &[u8], off: usize) -> u128 {
    u128::from_le_bytes(h[off..off + 16].try_into().expect("16 bytes"))
}

fn header_description(h: &[u8]) -> String {
    let n = (rd_u32(h, OFF_DESC_LEN) as usize).min(MAX_DESC);
    String::from_utf8_lossy(&h[OFF_DESC..OFF_DESC + n]).into_owned()
}

fn header_geometry(h: &[u8]) -> Geometry {
    Geometry {
        block_bytes: rd_u64(h, OFF_BLOCK),
        slot_bytes: rd_u64(h, OFF_SLOT),
        num_slots: rd_u64(h, OFF_SLOTS),
        table_off: rd_u64(h, OFF_TABLE),
        data_off: rd_u64(h, OFF_DATA),
        total_bytes: rd_u64(h, OFF_TOTAL),
    }
}

/// Why an existing header cannot be used for `ns` and `geo`, or `None` if it can.
fn header_mismatch(h: &[u8], file_len: u64, ns: &Namespace, geo: &Geometry) -> Option<String> {
    if h[..8] != MAGIC {
        return Some(
            "no valid header (not a tpu-sync KV segment, or its formatting was interrupted)".into(),
        );
    }
    let v = rd_u32(h, OFF_VERSION);
    if v != FORMAT_VERSION {
        return Some(format!(
            "format version {v}, this build reads version {FORMAT_VERSION}"
        ));
    }
    if rd_u128(h, OFF_NS) != ns.id() {
        return Some(format!(
            "model/layout identity differs: segment holds \"{}\", this store is \"{}\"",
            header_description(h),
            ns.description()
        ));
    }
    let g = header_geometry(h);
    if g != *geo {
        return Some(format!(
            "geometry differs: segment has {} B blocks in {} slots of {} B, this store wants {} B \
             blocks in {} slots of {} B",
            g.block_bytes,
            g.num_slots,
            g.slot_bytes,
            geo.block_bytes,
            geo.num_slots,
            geo.slot_bytes
        ));
    }
    if file_len != geo.total_bytes {
        return Some(format!(
            "file is {file_len} B, its header says {} B (truncated or extended)",
            geo.total_bytes
        ));
    }
    None
}

/// `mlock`s a range, raising the soft `RLIMIT_MEMLOCK` towards the hard limit once if needed.
fn lock_range(p: *mut u8, len: usize) -> LockStatus {
    // SAFETY: locking pages of a mapping we own.
    if unsafe { libc::mlock(p as *const _, len) } == 0 {
        return LockStatus::Locked;
    }
    let first = std::io::Error::last_os_error();
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes into the struct we pass.
    if unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut r) } == 0 {
        let want = r.rlim_cur.saturating_add(len as u64).min(r.rlim_max);
        if want > r.rlim_cur {
            let nr = libc::rlimit {
                rlim_cur: want,
                rlim_max: r.rlim_max,
            };
            // SAFETY: setrlimit reads the struct; mlock as above.
            if unsafe { libc::setrlimit(libc::RLIMIT_MEMLOCK, &nr) } == 0
                // SAFETY: as above.
                && unsafe { libc::mlock(p as *const _, len) } == 0
            {
                return LockStatus::Locked;
            }
        }
        return LockStatus::Failed(format!(
            "mlock of {} failed ({first}); RLIMIT_MEMLOCK soft {} / hard {} bytes: raise it \
             (`ulimit -l`, systemd LimitMEMLOCK) or grant CAP_IPC_LOCK",
            crate::util::fmt_bytes(len as u64),
            r.rlim_cur,
            r.rlim_max
        ));
    }
    LockStatus::Failed(format!("mlock failed: {first}"))
}

impl Segment {
    /// An anonymous segment (see [`PinnedArena`] for locking, huge pages and pre-faulting).
    pub fn anonymous(geo: Geometry, ns: &Namespace, opts: &ArenaOptions) -> Result<Segment> {
        let arena = PinnedArena::new(geo.total_bytes as usize, opts)?;
        let base = NonNull::new(arena.base()).expect("arena base is non-null");
        let lock = arena.lock_status().clone();
        let seg = Segment {
            base,
            geo,
            backing: Backing::Anon(arena),
            lock,
            attach: Attach::Anonymous,
        };
        seg.write_header(ns);
        Ok(seg)
    }

    /// Opens (creating, re-attaching or reformatting) named segment `name` in `dir` for `ns` and
    /// `geo` (see the module docs for the checks).
    ///
    /// Errors: [`Error::InvalidArgument`] for a bad name; [`Error::Io`] when the file cannot be
    /// opened, is not a regular file, belongs to another user (`PermissionDenied`), is in use by
    /// another process (`WouldBlock`), or cannot be sized or mapped.
    pub fn open_shm(
        dir: &Path,
        name: &str,
        geo: Geometry,
        ns: &Namespace,
        opts: &ArenaOptions,
    ) -> Result<Segment> {
        validate_name(name)?;
        let path = segment_path(dir, name);
        let shown = path.display().to_string();
        let mut file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(&path)
            .map_err(|e| Error::io(format!("open shared-memory segment {shown}"), e))?;
        let md = file
            .metadata()
            .map_err(|e| Error::io(format!("fstat {shown}"), e))?;
        if !md.file_type().is_file() {
            return Err(Error::io(
                format!("shared-memory segment {shown}"),
                std::io::Error::new(std::io::ErrorKind::InvalidInput, "not a regular file"),
            ));
        }
        if md.uid() != euid() {
            return Err(Error::io(
                format!("shared-memory segment {shown}"),
                std::io::Error::new(
                    std::io::ErrorKind::PermissionDenied,
                    format!(
                        "owned by uid {}, this process runs as uid {}: refusing to attach",
                        md.uid(),
                        euid()
                    ),
                ),
            ));
        }
        flock_exclusive(&file).map_err(|e| {
            Error::io(
                format!(
                    "shared-memory segment {shown} is in use by another process (each server \
                     needs its own name)"
                ),
                e,
            )
        })?;
        let mode = md.permissions().mode() & 0o777;
        let len = md.len();
        let created = len == 0 && mode & 0o077 == 0;
        let reason = if mode & 0o077 != 0 {
            Some(format!(
                "mode was {mode:04o} (accessible to other users), contents not trusted"
            ))
        } else if created {
            None
        } else if len < HEADER_BYTES {
            Some(format!("file is only {len} B, shorter than a header"))
        } else {
            let mut h = vec![0u8; HEADER_BYTES as usize];
            file.read_exact(&mut h)
                .map_err(|e| Error::io(format!("read header of {shown}"), e))?;
            header_mismatch(&h, len, ns, &geo)
        };
        let reason = match reason {
            Some(r) => {
                // Whoever opened this inode earlier (while its mode let them, or a process that
                // wrote the contents we refuse) may still hold it or map it: formatting it in
                // place would hand them the new blocks. The name is unlinked and a new file (a
                // new inode) created in its place, exclusively, so nobody else holds it.
                file = recreate(&path, &shown)?;
                Some(format!("{r}; unlinked and created anew"))
            }
            None => None,
        };
        let fresh = created || reason.is_some();
        if fresh {
            // Drop every old page, then size the file; the new pages read as zero (empty slots).
            file.set_len(0)
                .and_then(|_| file.set_len(geo.total_bytes))
                .map_err(|e| {
                    Error::io(
                        format!(
                            "size shared-memory segment {shown} to {}",
                            crate::util::fmt_bytes(geo.total_bytes)
                        ),
                        e,
                    )
                })?;
        }
        let mut mo = memmap2::MmapOptions::new();
        mo.len(geo.total_bytes as usize);
        if opts.populate {
            mo.populate();
        }
        // SAFETY: we hold the exclusive flock, so no cooperating process maps the file; the file
        // has the mapped length (checked or just set). Bytes changed behind our back by someone
        // else are caught by the checksums, never trusted for memory safety.
        let mut map = unsafe { mo.map_mut(&file) }
            .map_err(|e| Error::io(format!("mmap shared-memory segment {shown}"), e))?;
        let base = NonNull::new(map.as_mut_ptr()).expect("mmap is non-null");
        if opts.huge_pages {
            // SAFETY: advising our own mapping; THP for shmem may be disabled, which is harmless.
            unsafe {
                libc::madvise(
                    base.as_ptr() as *mut _,
                    geo.total_bytes as usize,
                    libc::MADV_HUGEPAGE,
                )
            };
        }
        let lock = if opts.lock {
            lock_range(base.as_ptr(), geo.total_bytes as usize)
        } else {
            LockStatus::NotRequested
        };
        if let LockStatus::Failed(ref why) = lock {
            log::warn!("store segment {shown} is not locked: {why}");
        }
        let attach = match (created, reason) {
            (true, _) => {
                log::info!("store segment {shown}: created");
                Attach::Created
            }
            (false, Some(r)) => {
                log::warn!("store segment {shown}: {r}; reformatting (its blocks are dropped)");
                Attach::Reformatted(r)
            }
            (false, None) => Attach::Attached,
        };
        let seg = Segment {
            base,
            geo,
            backing: Backing::Shm {
                map,
                _file: file,
                path,
            },
            lock,
            attach,
        };
        if fresh {
            seg.write_header(ns);
        }
        Ok(seg)
    }

    fn write_header(&self, ns: &Namespace) {
        let mut h = vec![0u8; HEADER_BYTES as usize];
        h[OFF_VERSION..OFF_VERSION + 4].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
        h[OFF_HEADER_BYTES..OFF_HEADER_BYTES + 4]
            .copy_from_slice(&(HEADER_BYTES as u32).to_le_bytes());
        h[OFF_NS..OFF_NS + 16].copy_from_slice(&ns.id().to_le_bytes());
        let g = &self.geo;
        for (off, v) in [
            (OFF_BLOCK, g.block_bytes),
            (OFF_SLOT, g.slot_bytes),
            (OFF_SLOTS, g.num_slots),
            (OFF_TABLE, g.table_off),
            (OFF_DATA, g.data_off),
            (OFF_TOTAL, g.total_bytes),
        ] {
            h[off..off + 8].copy_from_slice(&v.to_le_bytes());
        }
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        h[OFF_CREATED..OFF_CREATED + 8].copy_from_slice(&now.to_le_bytes());
        let d = ns.description().as_bytes();
        let n = d.len().min(MAX_DESC);
        h[OFF_DESC_LEN..OFF_DESC_LEN + 4].copy_from_slice(&(n as u32).to_le_bytes());
        h[OFF_DESC..OFF_DESC + n].copy_from_slice(&d[..n]);
        // SAFETY: the header page is ours (exclusive flock / anonymous), in bounds of the mapping.
        unsafe {
            std::ptr::copy_nonoverlapping(h.as_ptr().add(8), self.base.as_ptr().add(8), h.len() - 8)
        };
        // Magic last: an interrupted format never looks valid.
        fence(Ordering::Release);
        // SAFETY: as above.
        unsafe { std::ptr::copy_nonoverlapping(MAGIC.as_ptr(), self.base.as_ptr(), 8) };
        if let Backing::Shm { map, .. } = &self.backing {
            let _ = map.flush_range(0, HEADER_BYTES as usize);
        }
    }

    /// The geometry.
    pub fn geometry(&self) -> &Geometry {
        &self.geo
    }

    /// How the segment was obtained.
    pub fn attach(&self) -> &Attach {
        &self.attach
    }

    /// Whether the mapping is locked in RAM, or why not.
    pub fn lock_status(&self) -> &LockStatus {
        &self.lock
    }

    /// Path of a named segment.
    pub fn path(&self) -> Option<&Path> {
        match &self.backing {
            Backing::Shm { path, .. } => Some(path),
            Backing::Anon(_) => None,
        }
    }

    /// Start of the data area and its length (for DMA mapping).
    pub fn data_range(&self) -> (*mut u8, usize) {
        // SAFETY: data_off < total length.
        let p = unsafe { self.base.as_ptr().add(self.geo.data_off as usize) };
        (p, (self.geo.num_slots * self.geo.slot_bytes) as usize)
    }

    /// Base address of slot `slot`'s data (`slot_bytes` long). Panics on a slot out of range
    /// (slot numbers come from the index).
    pub fn slot_ptr(&self, slot: u32) -> *mut u8 {
        assert!(
            (slot as u64) < self.geo.num_slots,
            "slot {slot} out of range"
        );
        // SAFETY: in bounds of the mapping (checked above).
        unsafe {
            self.base
                .as_ptr()
                .add((self.geo.data_off + slot as u64 * self.geo.slot_bytes) as usize)
        }
    }

    /// Byte offset of slot `slot`'s data in the segment (and in its file).
    pub fn slot_offset(&self, slot: u32) -> u64 {
        self.geo.data_off + slot as u64 * self.geo.slot_bytes
    }

    fn meta(&self, slot: u32) -> &[AtomicU64; 8] {
        assert!(
            (slot as u64) < self.geo.num_slots,
            "slot {slot} out of range"
        );
        // SAFETY: the slot table lies inside the mapping, 64-byte aligned (4096 + 64 * slot);
        // AtomicU64 has the layout of u64, and the table is only accessed through atomics.
        unsafe {
            &*(self
                .base
                .as_ptr()
                .add((self.geo.table_off + slot as u64 * META_BYTES) as usize)
                as *const [AtomicU64; 8])
        }
    }

    /// Marks `slot` not committed (odd `seq`) before a writer touches its data, or when its block
    /// leaves. Idempotent.
    pub fn begin_write(&self, slot: u32) {
        let m = self.meta(slot);
        let s = m[0].load(Ordering::Relaxed);
        if s % 2 == 0 {
            m[0].store(s + 1, Ordering::Relaxed);
        }
        fence(Ordering::Release);
    }

    /// Publishes a written slot: meta words, then the next even `seq` with release ordering.
    /// Returns the block's generation.
    pub fn commit(&self, slot: u32, meta: &SlotMeta) -> u64 {
        let m = self.meta(slot);
        let s = m[0].load(Ordering::Relaxed);
        debug_assert!(s % 2 == 1, "commit of a slot not begun");
        m[1].store(meta.key as u64, Ordering::Relaxed);
        m[2].store((meta.key >> 64) as u64, Ordering::Relaxed);
        let p = meta.parent.unwrap_or(0);
        m[3].store(p as u64, Ordering::Relaxed);
        m[4].store((p >> 64) as u64, Ordering::Relaxed);
        m[5].store(
            meta.len | (u64::from(meta.parent.is_some()) << 63),
            Ordering::Relaxed,
        );
        m[6].store(meta.checksum, Ordering::Relaxed);
        m[7].store(meta.tick, Ordering::Relaxed);
        let gen = (s | 1) + 1;
        m[0].store(gen, Ordering::Release);
        gen
    }

    /// The current `seq` of `slot` (acquire).
    pub fn seq(&self, slot: u32) -> u64 {
        self.meta(slot)[0].load(Ordering::Acquire)
    }

    /// After copying out of `slot`: true if it still holds generation `gen` (acquire fence, then
    /// the `seq` load), i.e. the bytes copied are the committed block's.
    pub fn still(&self, slot: u32, gen: u64) -> bool {
        fence(Ordering::Acquire);
        self.meta(slot)[0].load(Ordering::Relaxed) == gen
    }

    /// Every committed slot (even, non-zero `seq` and a length that fits). Slots with an odd
    /// `seq` (interrupted writes) or bad lengths are marked not committed.
    pub fn committed_slots(&self) -> Vec<CommittedSlot> {
        let mut out = Vec::new();
        for slot in 0..self.geo.num_slots as u32 {
            let m = self.meta(slot);
            let seq = m[0].load(Ordering::Acquire);
            if seq == 0 || seq % 2 == 1 {
                continue;
            }
            let w5 = m[5].load(Ordering::Relaxed);
            let len = w5 & ((1 << 48) - 1);
            if len == 0 || len > self.geo.block_bytes {
                self.begin_write(slot);
                continue;
            }
            let key =
                m[1].load(Ordering::Relaxed) as u128 | (m[2].load(Ordering::Relaxed) as u128) << 64;
            let parent = (w5 >> 63 == 1).then(|| {
                m[3].load(Ordering::Relaxed) as u128 | (m[4].load(Ordering::Relaxed) as u128) << 64
            });
            out.push(CommittedSlot {
                slot,
                key,
                parent,
                gen: seq,
                len,
                checksum: m[6].load(Ordering::Relaxed),
                tick: m[7].load(Ordering::Relaxed),
            });
        }
        out
    }
}

/// One named segment found by [`list_segments`].
#[derive(Debug, Clone)]
pub struct SegmentInfo {
    /// The name (without the prefix).
    pub name: String,
    /// Full path.
    pub path: PathBuf,
    /// File size in bytes.
    pub bytes: u64,
    /// Owner uid.
    pub uid: u32,
    /// Permission bits.
    pub mode: u32,
    /// Held by a live process (its flock is taken). The lock belongs to the open file
    /// description, which a process forked from the owner shares until it execs or exits: a
    /// child forked without `exec` keeps the segment in use (it also keeps the mapping), and
    /// one spawned with `exec` holds it for the instant between its fork and its exec.
    pub in_use: bool,
    /// Namespace description from the header, when the header is valid.
    pub namespace: Option<String>,
    /// Block size, slot count and committed blocks, when the header is valid.
    pub blocks: Option<(u64, u64, u64)>,
}

/// Lists the named segments in `dir` (default [`DEFAULT_SHM_DIR`]).
///
/// Errors: [`Error::Io`] when the directory cannot be read. Unreadable entries are listed with
/// what could be learned.
pub fn list_segments(dir: &Path) -> Result<Vec<SegmentInfo>> {
    let rd = std::fs::read_dir(dir).map_err(|e| Error::io(format!("read {}", dir.display()), e))?;
    let mut out = Vec::new();
    for ent in rd.flatten() {
        let fname = ent.file_name().to_string_lossy().into_owned();
        let Some(name) = fname.strip_prefix(SHM_PREFIX) else {
            continue;
        };
        let path = ent.path();
        let Ok(md) = std::fs::symlink_metadata(&path) else {
            continue;
        };
        let mut info = SegmentInfo {
            name: name.to_string(),
            path: path.clone(),
            bytes: md.len(),
            uid: md.uid(),
            mode: md.mode() & 0o7777,
            in_use: false,
            namespace: None,
            blocks: None,
        };
        if md.file_type().is_file() {
            if let Ok(mut f) = std::fs::OpenOptions::new()
                .read(true)
                .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
                .open(&path)
            {
                // Test the lock and let go at once, so a server opening the segment meanwhile
                // is not refused (it also retries for LOCK_RETRY).
                info.in_use = flock(&f, libc::LOCK_SH).is_err();
                if !info.in_use {
                    flock(&f, libc::LOCK_UN).ok();
                }
                let mut h = vec![0u8; HEADER_BYTES as usize];
                if f.read_exact(&mut h).is_ok() && h[..8] == MAGIC {
                    let g = header_geometry(&h);
                    info.namespace = Some(header_description(&h));
                    info.blocks = Some((g.block_bytes, g.num_slots, count_committed(&mut f, &g)));
                }
            }
        }
        out.push(info);
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(out)
}

fn count_committed(f: &mut File, g: &Geometry) -> u64 {
    use std::os::unix::fs::FileExt;
    if g.num_slots > (1 << 31) || g.table_off != HEADER_BYTES {
        return 0;
    }
    let mut n = 0;
    let mut buf = vec![0u8; 64 << 10];
    let total = g.num_slots * META_BYTES;
    let mut off = 0;
    while off < total {
        let len = (buf.len() as u64).min(total - off) as usize;
        if f.read_exact_at(&mut buf[..len], g.table_off + off).is_err() {
            break;
        }
        for m in buf[..len].chunks_exact(META_BYTES as usize) {
            let seq = rd_u64(m, 0);
            if seq != 0 && seq % 2 == 0 {
                n += 1;
            }
        }
        off += len as u64;
    }
    n
}

/// Removes named segment `name` from `dir`. Refuses a segment held by a live process or owned by
/// another user unless `force` (a process that has it mapped keeps its memory until it exits).
///
/// Errors: [`Error::InvalidArgument`] for a bad name; [`Error::Io`] when it does not exist, is in
/// use, belongs to someone else, or cannot be unlinked.
pub fn remove_segment(dir: &Path, name: &str, force: bool) -> Result<()> {
    validate_name(name)?;
    let path = segment_path(dir, name);
    let shown = path.display().to_string();
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(&path)
        .map_err(|e| Error::io(format!("open {shown}"), e))?;
    let md = f
        .metadata()
        .map_err(|e| Error::io(format!("fstat {shown}"), e))?;
    if !force {
        if md.uid() != euid() {
            return Err(Error::io(
                format!("remove {shown}"),
                std::io::Error::new(
                    std::io::ErrorKind::PermissionDenied,
                    format!("owned by uid {} (use --force)", md.uid()),
                ),
            ));
        }
        flock_exclusive(&f).map_err(|e| {
            Error::io(
                format!("remove {shown}: in use by a running process (use --force)"),
                e,
            )
        })?;
    }
    std::fs::remove_file(&path).map_err(|e| Error::io(format!("unlink {shown}"), e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn geometry_rounds_and_aligns() {
        let g = Geometry::new(10_000, 100_000).unwrap();
        assert_eq!(g.slot_bytes, 12288);
        assert_eq!(g.num_slots, 8);
        assert_eq!(g.data_off % DATA_ALIGN, 0);
        assert_eq!(g.total_bytes, g.data_off + 8 * 12288);
        let s = Geometry::new(100, 1000).unwrap();
        assert_eq!(s.slot_bytes, 128);
        assert!(Geometry::new(0, 10).is_err());
        assert!(Geometry::new(4096, 4095).is_err());
    }

    #[test]
    fn names_are_checked() {
        for ok in ["a", "srv-1.kv_cache", "A9"] {
            validate_name(ok).unwrap();
        }
        for bad in ["", ".x", "-x", "a/b", "../x", "a b", &"x".repeat(101)] {
            assert!(validate_name(bad).is_err(), "{bad}");
        }
    }
}
