//! Reading a shared-file-system disk tier that other hosts write (see "Shared file systems" in
//! [`super::disk`]).
//!
//! A writer is a [`super::KvStore`] whose [`super::DiskOptions::shared`] names a partition on a
//! shared mount; its blocks reach the files when they spill from DRAM or at
//! [`super::KvStore::flush_to_disk`]. A reader on any host opens the same partition with
//! [`SharedReader::open`] and reads a chain's leading blocks straight from the files, with
//! `O_DIRECT` into 4096-aligned buffers where the file system allows it (else buffered, counted
//! in [`SharedReader::direct_fallbacks`]). Every block is checked before it is delivered: the
//! header (magic, version, header checksum, namespace, key), the file size, the length the
//! caller expects, and the xxh3-64 of the data. Files appear only by rename, so a reader never
//! sees a partial block; a file that fails any check is a miss (never deleted by a reader: it is
//! the writer's).
//!
//! Thread-safety: [`SharedReader`] is `Send + Sync`; reads of different chains may run in
//! parallel.

use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use super::checksum;
use super::dirfd::DirFd;
use super::disk::{self, AlignedBuf, Miss, FILE_HEADER};
use super::key::{BlockKey, Namespace};
use crate::error::{Error, Result};

/// Result of [`SharedReader::get_to_host`]: the first `delivered` blocks are in their
/// destinations, byte-exact.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SharedGet {
    /// Leading blocks delivered.
    pub delivered: usize,
    /// Bytes delivered.
    pub bytes: u64,
    /// Why the read stopped before the end of the chain (`None` when every block came).
    pub stop: Option<Miss>,
}

/// A reader of one partition of a shared disk tier (see the module docs).
#[derive(Debug)]
pub struct SharedReader {
    /// The partition directory's path (for messages; files are reached through [`DirFd`]s).
    dir: PathBuf,
    root: PathBuf,
    ns_name: String,
    partition: String,
    ns: u128,
    direct: AtomicBool,
    fallbacks: AtomicU64,
    uid: u32,
}

impl SharedReader {
    /// Opens partition `partition` of namespace `ns` under the shared root `root` (the writers'
    /// [`super::DiskOptions::dir`]). The directory need not exist yet (every block is a miss
    /// until a writer creates it). `direct`: try `O_DIRECT`.
    ///
    /// Errors: [`Error::InvalidArgument`] for a bad partition name.
    pub fn open(
        root: impl AsRef<Path>,
        ns: &Namespace,
        partition: &str,
        direct: bool,
    ) -> Result<SharedReader> {
        disk::validate_component("partition", partition)?;
        let ns_name = format!("{:032x}", ns.id());
        Ok(SharedReader {
            dir: root.as_ref().join(&ns_name).join(partition),
            root: root.as_ref().to_path_buf(),
            ns_name,
            partition: partition.to_string(),
            ns: ns.id(),
            direct: AtomicBool::new(direct),
            fallbacks: AtomicU64::new(0),
            // SAFETY: geteuid has no preconditions.
            uid: unsafe { libc::geteuid() },
        })
    }

    /// The partition directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Whether files are still opened with `O_DIRECT`.
    pub fn direct(&self) -> bool {
        self.direct.load(Ordering::Relaxed)
    }

    /// Files opened buffered because the file system refused `O_DIRECT`.
    pub fn direct_fallbacks(&self) -> u64 {
        self.fallbacks.load(Ordering::Relaxed)
    }

    /// Opens the partition directory: the configured root, then the namespace and partition
    /// directories relative to it with `O_NOFOLLOW` (a symlink planted under either name by
    /// another writer is refused, and files are then opened through the descriptor).
    fn open_dir(&self) -> std::io::Result<DirFd> {
        DirFd::open(&self.root)?
            .subdir(&self.ns_name)?
            .subdir(&self.partition)
    }

    fn open_file(&self, d: &DirFd, name: &str) -> std::io::Result<std::fs::File> {
        if self.direct.load(Ordering::Relaxed) {
            match d.open_file(name, libc::O_RDONLY | libc::O_DIRECT, 0) {
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                    if self.direct.swap(false, Ordering::Relaxed) {
                        log::warn!(
                            "shared disk tier {}: O_DIRECT refused; reading buffered",
                            self.dir.display()
                        );
                    }
                    self.fallbacks.fetch_add(1, Ordering::Relaxed);
                }
                r => return r,
            }
        }
        d.open_file(name, libc::O_RDONLY, 0)
    }

    /// Reads and checks one block file; returns the data length and the aligned buffer holding
    /// header + data.
    fn read_one(&self, d: &DirFd, key: BlockKey) -> std::result::Result<(usize, AlignedBuf), Miss> {
        let f = match self.open_file(d, &format!("{}.kvb", key.hex())) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Err(Miss::Missing),
            Err(e) => return Err(Miss::Io(e.to_string())),
        };
        let md = f.metadata().map_err(|e| Miss::Io(e.to_string()))?;
        if !md.is_file() || md.uid() != self.uid {
            return Err(Miss::Corrupt(format!(
                "not a regular file owned by uid {}",
                self.uid
            )));
        }
        let size = md.size() as usize;
        if size < FILE_HEADER || size % 4096 != 0 || size > (1 << 40) {
            return Err(Miss::Truncated(format!("{size} B")));
        }
        let mut buf = AlignedBuf::zeroed(size);
        let b = buf.as_mut_slice();
        let mut got = 0;
        while got < size {
            match f.read_at(&mut b[got..size], got as u64) {
                Ok(0) => break,
                Ok(n) => got += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(Miss::Io(e.to_string())),
            }
        }
        if got != size {
            return Err(Miss::Truncated(format!("read {got} of {size} B")));
        }
        let m = disk::parse_header(self.ns, &b[..FILE_HEADER])?;
        if m.key != key.0 {
            return Err(Miss::Corrupt("header names another block".into()));
        }
        let want = FILE_HEADER as u64 + disk::padded(m.len);
        if size as u64 != want {
            return Err(Miss::Truncated(format!("{size} B, expected {want} B")));
        }
        let data = &b[FILE_HEADER..FILE_HEADER + m.len as usize];
        if checksum::checksum(data) != m.checksum {
            return Err(Miss::Corrupt("data checksum mismatch".into()));
        }
        Ok((m.len as usize, buf))
    }

    /// Number of leading blocks of `chain` whose files exist with a valid header and size (the
    /// data checksum is checked when the blocks are read).
    pub fn lookup(&self, chain: &[BlockKey]) -> usize {
        let Ok(d) = self.open_dir() else {
            return 0;
        };
        let mut n = 0;
        for &k in chain {
            let ok = d
                .open_file(&format!("{}.kvb", k.hex()), libc::O_RDONLY, 0)
                .and_then(|f| f.metadata())
                .map(|m| m.size() as usize >= FILE_HEADER && m.uid() == self.uid)
                .unwrap_or(false);
            if !ok {
                break;
            }
            n += 1;
        }
        n
    }

    /// Copies the leading blocks of `chain` into `dst` (`dst[i]` must be exactly as long as
    /// block `chain[i]`); stops at the first missing or bad block ([`SharedGet::stop`]).
    ///
    /// Errors: [`Error::InvalidArgument`] when the counts differ. A block whose length is not its
    /// destination's is a miss (`Corrupt`), not an error.
    pub fn get_to_host(&self, chain: &[BlockKey], dst: &mut [&mut [u8]]) -> Result<SharedGet> {
        if chain.len() != dst.len() {
            return Err(Error::InvalidArgument(format!(
                "{} keys but {} destinations",
                chain.len(),
                dst.len()
            )));
        }
        let mut r = SharedGet::default();
        let d = match self.open_dir() {
            Ok(d) => d,
            Err(e) => {
                if !chain.is_empty() {
                    r.stop = Some(match e.kind() {
                        std::io::ErrorKind::NotFound => Miss::Missing,
                        _ => Miss::Io(format!("open {}: {e}", self.dir.display())),
                    });
                }
                return Ok(r);
            }
        };
        for (i, &k) in chain.iter().enumerate() {
            match self.read_one(&d, k) {
                Ok((len, mut buf)) if len == dst[i].len() => {
                    dst[i].copy_from_slice(&buf.as_mut_slice()[FILE_HEADER..FILE_HEADER + len]);
                    r.delivered += 1;
                    r.bytes += len as u64;
                }
                Ok((len, _)) => {
                    r.stop = Some(Miss::Corrupt(format!(
                        "block {k} holds {len} B, destination {} B",
                        dst[i].len()
                    )));
                    break;
                }
                Err(m) => {
                    r.stop = Some(m);
                    break;
                }
            }
        }
        Ok(r)
    }
}
