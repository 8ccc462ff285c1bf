//! Directory file descriptors: every file of the disk tier is opened, renamed and deleted
//! relative to an open directory (`openat`, `renameat`, `unlinkat`), never through a path that
//! is looked up again, and every name is opened with `O_NOFOLLOW`.
//!
//! Why: the namespace directory of a shared disk tier is shared with other writers (other hosts,
//! perhaps other users). Once a directory is open and checked (owner, mode, not a symlink), a
//! co-tenant who renames it away or plants a symlink under its name or under a file's name cannot
//! redirect a write or a delete of ours: the descriptor keeps naming the directory we checked,
//! and a symlink in the last component fails with `ELOOP` instead of being followed.
//!
//! Thread-safety: [`DirFd`] is `Send + Sync` (a file descriptor; the calls are thread-safe).

use std::ffi::{CString, OsString};
use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::path::{Path, PathBuf};

/// An open directory (`O_DIRECTORY | O_CLOEXEC`, plus `O_NOFOLLOW` when opened under another
/// [`DirFd`]) and the path it was opened by, for messages only.
#[derive(Debug)]
pub(crate) struct DirFd {
    fd: OwnedFd,
    path: PathBuf,
}

fn cname(name: &str) -> std::io::Result<CString> {
    if name.is_empty() || name.contains('/') || name == "." || name == ".." {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("{name:?} is not a single file name"),
        ));
    }
    CString::new(name).map_err(|_| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("{name:?} holds a NUL byte"),
        )
    })
}

fn cvt(r: libc::c_int) -> std::io::Result<libc::c_int> {
    if r < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

impl DirFd {
    /// Opens the directory at `path` (a path the operator configured: symlinks in it are
    /// followed, as the operator's choice).
    pub(crate) fn open(path: &Path) -> std::io::Result<DirFd> {
        let c = CString::new(path.as_os_str().as_bytes()).map_err(|_| {
            std::io::Error::new(std::io::ErrorKind::InvalidInput, "path holds a NUL byte")
        })?;
        // SAFETY: `c` is a NUL-terminated path; the returned descriptor is owned below.
        let fd = cvt(unsafe {
            libc::open(
                c.as_ptr(),
                libc::O_RDONLY | libc::O_DIRECTORY | libc::O_CLOEXEC,
            )
        })?;
        Ok(DirFd {
            // SAFETY: `fd` was just opened and is owned by nobody else.
            fd: unsafe { OwnedFd::from_raw_fd(fd) },
            path: path.to_path_buf(),
        })
    }

    /// The path this directory was opened by (for messages; never used to reach a file).
    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    /// Creates subdirectory `name` with `mode` (an existing one is fine).
    pub(crate) fn mkdir(&self, name: &str, mode: u32) -> std::io::Result<()> {
        let c = cname(name)?;
        // SAFETY: valid directory descriptor and NUL-terminated name.
        match cvt(unsafe { libc::mkdirat(self.fd.as_raw_fd(), c.as_ptr(), mode as libc::mode_t) }) {
            Ok(_) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// Opens subdirectory `name` (`O_NOFOLLOW`: a symlink under that name is refused).
    pub(crate) fn subdir(&self, name: &str) -> std::io::Result<DirFd> {
        let c = cname(name)?;
        // SAFETY: valid directory descriptor and NUL-terminated name; the result is owned below.
        let fd = cvt(unsafe {
            libc::openat(
                self.fd.as_raw_fd(),
                c.as_ptr(),
                libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC,
            )
        })?;
        Ok(DirFd {
            // SAFETY: just opened, owned by nobody else.
            fd: unsafe { OwnedFd::from_raw_fd(fd) },
            path: self.path.join(name),
        })
    }

    /// The directory's own metadata (`fstat` of the descriptor).
    pub(crate) fn metadata(&self) -> std::io::Result<std::fs::Metadata> {
        File::from(self.fd.try_clone()?).metadata()
    }

    /// Opens regular file `name` with `flags` (`O_NOFOLLOW | O_CLOEXEC` are always added) and,
    /// when `O_CREAT` is among them, `mode`. The open itself never blocks (`O_NONBLOCK`, cleared
    /// again afterwards unless asked for), so a FIFO or device planted under the name is refused
    /// (`InvalidInput`, "not a regular file") instead of hanging the caller.
    pub(crate) fn open_file(
        &self,
        name: &str,
        flags: libc::c_int,
        mode: u32,
    ) -> std::io::Result<File> {
        let c = cname(name)?;
        // SAFETY: valid directory descriptor and NUL-terminated name; the result is owned below.
        let fd = cvt(unsafe {
            libc::openat(
                self.fd.as_raw_fd(),
                c.as_ptr(),
                flags | libc::O_NOFOLLOW | libc::O_CLOEXEC | libc::O_NONBLOCK,
                mode as libc::c_uint,
            )
        })?;
        // SAFETY: just opened, owned by nobody else.
        let f = unsafe { File::from_raw_fd(fd) };
        if !f.metadata()?.file_type().is_file() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("{}: not a regular file", self.path.join(name).display()),
            ));
        }
        if flags & libc::O_NONBLOCK == 0 {
            // SAFETY: `fd` is open; F_GETFL/F_SETFL only change its status flags.
            unsafe {
                let fl = cvt(libc::fcntl(fd, libc::F_GETFL))?;
                cvt(libc::fcntl(fd, libc::F_SETFL, fl & !libc::O_NONBLOCK))?;
            }
        }
        Ok(f)
    }

    /// Renames `from` to `to`, both in this directory (replacing `to` atomically).
    pub(crate) fn rename(&self, from: &str, to: &str) -> std::io::Result<()> {
        let (f, t) = (cname(from)?, cname(to)?);
        let d = self.fd.as_raw_fd();
        // SAFETY: valid directory descriptor and NUL-terminated names.
        cvt(unsafe { libc::renameat(d, f.as_ptr(), d, t.as_ptr()) }).map(|_| ())
    }

    /// Deletes file `name` of this directory (never follows a symlink: `unlinkat` removes the
    /// name itself).
    pub(crate) fn unlink(&self, name: &str) -> std::io::Result<()> {
        let c = cname(name)?;
        // SAFETY: valid directory descriptor and NUL-terminated name.
        cvt(unsafe { libc::unlinkat(self.fd.as_raw_fd(), c.as_ptr(), 0) }).map(|_| ())
    }

    /// The names in this directory (without `.` and `..`), read through the descriptor.
    pub(crate) fn entries(&self) -> std::io::Result<Vec<OsString>> {
        let dup = self.fd.try_clone()?;
        // fdopendir takes the descriptor over (closedir closes it).
        let raw = std::os::fd::IntoRawFd::into_raw_fd(dup);
        // SAFETY: `raw` is an open directory descriptor that we own and hand over.
        let dir = unsafe { libc::fdopendir(raw) };
        if dir.is_null() {
            let e = std::io::Error::last_os_error();
            // SAFETY: fdopendir failed, so `raw` is still ours to close.
            unsafe { libc::close(raw) };
            return Err(e);
        }
        // The duplicate shares the offset with `fd`: start from the beginning.
        // SAFETY: `dir` is a valid DIR stream.
        unsafe { libc::rewinddir(dir) };
        let mut out = Vec::new();
        loop {
            // SAFETY: `dir` is a valid DIR stream; errno is cleared first to tell the end of the
            // directory (NULL, errno 0) from an error.
            let ent = unsafe {
                *libc::__errno_location() = 0;
                libc::readdir(dir)
            };
            if ent.is_null() {
                // SAFETY: reading errno right after readdir.
                let errno = unsafe { *libc::__errno_location() };
                // SAFETY: `dir` is valid and closed once.
                unsafe { libc::closedir(dir) };
                if errno != 0 {
                    return Err(std::io::Error::from_raw_os_error(errno));
                }
                return Ok(out);
            }
            // SAFETY: `ent` points to a dirent valid until the next readdir on `dir`; d_name is
            // NUL-terminated.
            let name = unsafe { std::ffi::CStr::from_ptr((*ent).d_name.as_ptr()) };
            let b = name.to_bytes();
            if b != b"." && b != b".." {
                out.push(OsString::from_vec(b.to_vec()));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A directory under the temp dir, removed when dropped.
    struct Tmp(PathBuf);
    impl Tmp {
        fn new(tag: &str) -> Tmp {
            let p = std::env::temp_dir().join(format!(
                "tpu-sync-dirfd-{tag}-{}-{}",
                std::process::id(),
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .unwrap()
                    .as_nanos()
            ));
            std::fs::create_dir_all(&p).unwrap();
            Tmp(p)
        }
        fn path(&self) -> &Path {
            &self.0
        }
    }
    impl Drop for Tmp {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    #[test]
    fn files_are_reached_through_the_descriptor_and_symlinks_are_refused() {
        let root = Tmp::new("root");
        let d = DirFd::open(root.path()).unwrap();
        d.mkdir("a", 0o700).unwrap();
        d.mkdir("a", 0o700).unwrap();
        let a = d.subdir("a").unwrap();
        let mut f = a
            .open_file(
                "x.tmp",
                libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL,
                0o600,
            )
            .unwrap();
        std::io::Write::write_all(&mut f, b"kv bytes 0123").unwrap();
        drop(f);
        a.rename("x.tmp", "x.kvb").unwrap();
        assert_eq!(a.entries().unwrap(), vec![OsString::from("x.kvb")]);
        // The directory is renamed away and a symlink planted under its name: the descriptor
        // still reaches the real directory, and the symlink is never followed.
        std::fs::rename(root.path().join("a"), root.path().join("moved")).unwrap();
        let elsewhere = Tmp::new("elsewhere");
        std::os::unix::fs::symlink(elsewhere.path(), root.path().join("a")).unwrap();
        let g = a.open_file("x.kvb", libc::O_RDONLY, 0).unwrap();
        let mut s = String::new();
        std::io::Read::read_to_string(&mut &g, &mut s).unwrap();
        assert_eq!(s, "kv bytes 0123");
        let e = d.subdir("a").unwrap_err();
        assert!(
            matches!(e.raw_os_error(), Some(libc::ENOTDIR | libc::ELOOP)),
            "{e}"
        );
        // A symlink as a file name: refused (ELOOP), not followed.
        std::fs::write(elsewhere.path().join("secret"), b"not kv").unwrap();
        std::os::unix::fs::symlink(
            elsewhere.path().join("secret"),
            root.path().join("moved/y.kvb"),
        )
        .unwrap();
        let e = a.open_file("y.kvb", libc::O_RDONLY, 0).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::ELOOP), "{e}");
        let e = a
            .open_file("y.kvb", libc::O_WRONLY | libc::O_TRUNC, 0)
            .unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::ELOOP), "{e}");
        assert_eq!(
            std::fs::read(elsewhere.path().join("secret")).unwrap(),
            b"not kv"
        );
        // A FIFO under a block's name: refused at once, never waited on.
        let fifo = CString::new(root.path().join("moved/z.kvb").as_os_str().as_bytes()).unwrap();
        // SAFETY: NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o600) }, 0);
        let e = a.open_file("z.kvb", libc::O_RDONLY, 0).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::InvalidInput, "{e}");
        // unlink removes the symlink itself, never its target.
        a.unlink("y.kvb").unwrap();
        assert!(elsewhere.path().join("secret").exists());
        assert!(a.open_file("../x", libc::O_RDONLY, 0).is_err());
        assert!(elsewhere.path().join("x.kvb").metadata().is_err());
    }
}
