//! Pinned host staging memory.
//!
//! A [`PinnedArena`] is one anonymous, page-aligned mapping (optionally on transparent huge pages),
//! pre-faulted and `mlock`ed when the `RLIMIT_MEMLOCK` limit allows, so DMA engines and the
//! network stack read and write it without page faults. It is carved into 64-byte aligned
//! [`Region`]s by a [`RegionAllocator`].
//!
//! DMA registration: [`PinnedArena::register_dma`] maps the whole arena for DMA with a PJRT
//! client (`PJRT_Client_DmaMap`; the CUDA plugin pins it with `cudaHostRegister`, libtpu maps it
//! for its DMA engines) so device copies read and write it directly. Plugins that answer
//! UNIMPLEMENTED (the XLA CPU plugin) are skipped with a debug log. Every mapping is undone
//! (`PJRT_Client_DmaUnmap`) when the arena drops, before its memory is unmapped.
//!
//! Thread-safety: the arena is `Send + Sync`. It hands out raw addresses; callers that write keep
//! their regions disjoint (the staging code guarantees this by construction: one region per
//! block, written by one transfer).

use std::ptr::NonNull;
use std::sync::Mutex;

use crate::error::{Error, Result};
use crate::pjrt::Client;

/// Alignment of every region handed out by [`RegionAllocator`] (bytes). 64 B is the alignment the
/// PJRT CPU plugin needs for zero-copy aliasing (`docs/plugins-and-engines.md`, "CPU plugin:
/// zero-copy and alignment").
pub const REGION_ALIGN: u64 = 64;

/// How to allocate an arena.
#[derive(Debug, Clone)]
pub struct ArenaOptions {
    /// Try to `mlock` the whole arena (raising the soft `RLIMIT_MEMLOCK` up to the hard limit
    /// when needed). Failure is reported in [`PinnedArena::lock_status`], not an error.
    pub lock: bool,
    /// Ask for transparent huge pages (`madvise(MADV_HUGEPAGE)`).
    pub huge_pages: bool,
    /// Pre-fault every page at creation (`MAP_POPULATE`).
    pub populate: bool,
}

impl Default for ArenaOptions {
    fn default() -> Self {
        ArenaOptions {
            lock: true,
            huge_pages: true,
            populate: true,
        }
    }
}

/// Whether the arena's pages are locked in RAM.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LockStatus {
    /// `mlock` succeeded: the pages cannot be swapped out.
    Locked,
    /// Locking was not requested.
    NotRequested,
    /// `mlock` failed; the message says why and how to allow it.
    Failed(String),
}

/// A page-aligned, optionally locked, anonymous host mapping.
pub struct PinnedArena {
    ptr: NonNull<u8>,
    len: usize,
    lock: LockStatus,
    /// Clients the arena is DMA-mapped with (unmapped in `Drop`, before `map` goes).
    dma: Mutex<Vec<Client>>,
    /// The memory; `None` only once `Drop` handed it to the unmap thread.
    map: Option<memmap2::MmapMut>,
}

/// Arenas at least this large (bytes) that are dropped on a tokio runtime thread are unmapped
/// (and DMA-unmapped) on the `tpu-sync-unmap` thread instead: `munmap` of tens of MiB of locked
/// pages, and a plugin's `DmaUnmap` (`cudaHostUnregister`), take milliseconds, which a runtime
/// worker that answers heartbeats must not spend (issue 23).
pub const UNMAP_OFF_RUNTIME_BYTES: usize = 1 << 20;

/// An arena's memory and DMA mappings on their way to being undone.
struct Unmap {
    ptr: *mut u8,
    dma: Vec<Client>,
    map: memmap2::MmapMut,
}

// SAFETY: `ptr` is the start of `map`, which the `Unmap` owns alone (its arena is gone); the
// clients are reference-counted PJRT handles usable from any thread.
unsafe impl Send for Unmap {}

impl Unmap {
    fn run(self) {
        for c in self.dma {
            // SAFETY: mapped by `register_dma` with this client; the arena was dropped, so no
            // transfer uses it any more, and `map` (the memory) is still mapped here.
            if let Err(e) = unsafe { c.dma_unmap(self.ptr) } {
                log::warn!("PJRT_Client_DmaUnmap of a pinned arena: {e}");
            }
        }
        drop(self.map);
    }
}

/// The unmap thread (`tpu-sync-unmap`, one per process, started with the first arena so that
/// it exists before any baseline a leak check takes): `None` when it could not be started (the
/// arenas are then unmapped where they drop).
fn unmapper() -> Option<&'static std::sync::mpsc::Sender<Unmap>> {
    static S: std::sync::OnceLock<Option<std::sync::mpsc::Sender<Unmap>>> =
        std::sync::OnceLock::new();
    S.get_or_init(|| {
        let (tx, rx) = std::sync::mpsc::channel::<Unmap>();
        match std::thread::Builder::new()
            .name("tpu-sync-unmap".into())
            .spawn(move || {
                while let Ok(u) = rx.recv() {
                    u.run();
                }
            }) {
            Ok(_) => Some(tx),
            Err(e) => {
                log::warn!("tpu-sync-unmap thread not started ({e}): arenas unmap where they drop");
                None
            }
        }
    })
    .as_ref()
}

/// Outcome of [`PinnedArena::register_dma`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DmaRegistration {
    /// `PJRT_Client_DmaMap` succeeded for the whole arena (or it was already mapped with this
    /// client); it is unmapped when the arena drops.
    Mapped,
    /// The plugin does not implement DMA mapping (UNIMPLEMENTED, or no `PJRT_Client_DmaMap` in
    /// its table); copies still work, through the plugin's own staging. The plugin's message.
    Skipped(String),
}

impl Drop for PinnedArena {
    /// Undoes the DMA mappings, then unmaps the memory: here, or on the `tpu-sync-unmap` thread
    /// when the arena is dropped on a tokio runtime thread and is at least
    /// [`UNMAP_OFF_RUNTIME_BYTES`] (the memory then goes a moment later, in drop order).
    fn drop(&mut self) {
        let dma = std::mem::take(&mut *self.dma.lock().unwrap_or_else(|p| p.into_inner()));
        let Some(map) = self.map.take() else { return };
        let u = Unmap {
            ptr: self.ptr.as_ptr(),
            dma,
            map,
        };
        let off_runtime =
            self.len >= UNMAP_OFF_RUNTIME_BYTES && tokio::runtime::Handle::try_current().is_ok();
        if off_runtime {
            if let Some(tx) = unmapper() {
                if let Err(std::sync::mpsc::SendError(u)) = tx.send(u) {
                    u.run();
                }
                return;
            }
        }
        u.run();
    }
}

// SAFETY: the arena is plain memory; concurrent access to disjoint regions is the documented
// contract of the raw-address API.
unsafe impl Send for PinnedArena {}
// SAFETY: as above.
unsafe impl Sync for PinnedArena {}

impl std::fmt::Debug for PinnedArena {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PinnedArena")
            .field("len", &self.len)
            .field("lock", &self.lock)
            .finish()
    }
}

fn memlock_limit() -> Option<(u64, u64)> {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes into the struct we pass.
    if unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut r) } == 0 {
        Some((r.rlim_cur, r.rlim_max))
    } else {
        None
    }
}

fn fmt_limit(v: u64) -> String {
    if v == libc::RLIM_INFINITY {
        "unlimited".into()
    } else {
        crate::util::fmt_bytes(v)
    }
}

impl PinnedArena {
    /// Maps `len` bytes (rounded up to a page).
    ///
    /// Errors: [`Error::HostMemory`] when `len` is 0 or the mapping fails.
    pub fn new(len: usize, opts: &ArenaOptions) -> Result<PinnedArena> {
        if len == 0 {
            return Err(Error::HostMemory("arena size must be > 0".into()));
        }
        let _ = unmapper();
        let page = 4096usize;
        let len = len.div_ceil(page) * page;
        let mut mo = memmap2::MmapOptions::new();
        mo.len(len);
        if opts.populate && !opts.huge_pages {
            mo.populate();
        }
        let mut map = mo.map_anon().map_err(|e| {
            Error::HostMemory(format!(
                "mmap of {} failed: {e}",
                crate::util::fmt_bytes(len as u64)
            ))
        })?;
        let ptr = NonNull::new(map.as_mut_ptr())
            .ok_or_else(|| Error::HostMemory("mmap returned NULL".into()))?;
        if opts.huge_pages {
            // SAFETY: advising our own fresh mapping; failure is harmless (THP may be disabled).
            unsafe { libc::madvise(ptr.as_ptr() as *mut _, len, libc::MADV_HUGEPAGE) };
            if opts.populate {
                // Touch one byte per page so the faults happen now, with huge pages where allowed.
                for off in (0..len).step_by(page) {
                    // SAFETY: in bounds of our mapping.
                    unsafe { ptr.as_ptr().add(off).write_volatile(0) };
                }
            }
        }
        let lock = if opts.lock {
            Self::try_lock(ptr.as_ptr(), len)
        } else {
            LockStatus::NotRequested
        };
        if let LockStatus::Failed(ref why) = lock {
            log::warn!("pinned arena is not locked: {why}");
        }
        Ok(PinnedArena {
            ptr,
            len,
            lock,
            dma: Mutex::new(Vec::new()),
            map: Some(map),
        })
    }

    fn try_lock(p: *mut u8, len: usize) -> LockStatus {
        // SAFETY: locking pages of our own mapping.
        if unsafe { libc::mlock(p as *const _, len) } == 0 {
            return LockStatus::Locked;
        }
        let first = std::io::Error::last_os_error();
        // Raise the soft limit towards the hard limit (always allowed), then retry once.
        if let Some((cur, max)) = memlock_limit() {
            let want = cur.saturating_add(len as u64).min(max);
            if want > cur {
                let r = libc::rlimit {
                    rlim_cur: want,
                    rlim_max: max,
                };
                // SAFETY: setrlimit reads the struct we pass.
                if unsafe { libc::setrlimit(libc::RLIMIT_MEMLOCK, &r) } == 0
                    // SAFETY: as above.
                    && unsafe { libc::mlock(p as *const _, len) } == 0
                {
                    return LockStatus::Locked;
                }
            }
            return LockStatus::Failed(format!(
                "mlock of {} failed ({first}); RLIMIT_MEMLOCK soft {} / hard {}: raise it \
                 (`ulimit -l`, systemd LimitMEMLOCK) or grant CAP_IPC_LOCK",
                crate::util::fmt_bytes(len as u64),
                fmt_limit(cur),
                fmt_limit(max)
            ));
        }
        LockStatus::Failed(format!("mlock failed: {first}"))
    }

    /// Size in bytes (a multiple of the page size).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false: arenas are never empty.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// Base address.
    pub fn base(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Registers the whole arena for DMA with `client` (`PJRT_Client_DmaMap`), so the device
    /// reads and writes it directly. Idempotent per client. The mapping is undone
    /// (`PJRT_Client_DmaUnmap`) when the arena drops, before the memory is unmapped; the client
    /// is kept alive until then.
    ///
    /// Errors: [`Error::Pjrt`] when the plugin implements DMA mapping but refuses this range.
    /// A plugin without it (UNIMPLEMENTED, as the XLA CPU plugin answers, or no entry point)
    /// is not an error: [`DmaRegistration::Skipped`], logged at debug level.
    pub fn register_dma(&self, client: &Client) -> Result<DmaRegistration> {
        let mut mapped = self.dma.lock().unwrap_or_else(|p| p.into_inner());
        if mapped.iter().any(|c| c.raw() == client.raw()) {
            return Ok(DmaRegistration::Mapped);
        }
        // SAFETY: the arena stays mapped until after the unmap in `Drop` (which runs before the
        // `map` field is dropped).
        match unsafe { client.dma_map(self.ptr.as_ptr(), self.len) } {
            Ok(()) => {
                mapped.push(client.clone());
                Ok(DmaRegistration::Mapped)
            }
            Err(Error::Pjrt {
                code,
                code_name,
                message,
                ..
            }) if code == crate::pjrt::sys::PJRT_Error_Code_UNIMPLEMENTED => {
                log::debug!(
                    "DMA map of a {} arena skipped on `{}`: {code_name}: {message}",
                    crate::util::fmt_bytes(self.len as u64),
                    client.platform_name()
                );
                Ok(DmaRegistration::Skipped(format!("{code_name}: {message}")))
            }
            Err(Error::Unsupported { what, .. }) => {
                log::debug!("DMA map skipped: {what}");
                Ok(DmaRegistration::Skipped(what))
            }
            Err(e) => Err(e),
        }
    }

    /// Number of clients the arena is DMA-mapped with.
    pub fn dma_mapped_clients(&self) -> usize {
        self.dma.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    /// Whether the arena is DMA-mapped with no client, or with `client` only: an arena that may
    /// be reused for `client`'s buffers without a mapping of another client on it (a pooled
    /// arena, [`crate::staging::ArenaPool`]). `client` `None`: mapped with no client.
    pub fn dma_mapped_only_with(&self, client: Option<&Client>) -> bool {
        let mapped = self.dma.lock().unwrap_or_else(|p| p.into_inner());
        match client {
            None => mapped.is_empty(),
            Some(c) => mapped.iter().all(|m| m.raw() == c.raw()),
        }
    }

    /// Whether the pages are locked, or why not.
    pub fn lock_status(&self) -> &LockStatus {
        &self.lock
    }

    /// Address of `offset`, after checking that `offset..offset+len` lies inside the arena.
    pub fn ptr_at(&self, offset: u64, len: u64) -> Result<*mut u8> {
        let end = offset
            .checked_add(len)
            .ok_or_else(|| Error::InvalidArgument("arena range overflows".into()))?;
        if end > self.len as u64 {
            return Err(Error::InvalidArgument(format!(
                "arena range {offset}..{end} outside the {}-byte arena",
                self.len
            )));
        }
        // SAFETY: offset <= len of our mapping.
        Ok(unsafe { self.ptr.as_ptr().add(offset as usize) })
    }

    /// Shared view of a range.
    ///
    /// # Safety
    /// No one may write the range while the returned slice lives.
    pub unsafe fn slice(&self, offset: u64, len: u64) -> Result<&[u8]> {
        let p = self.ptr_at(offset, len)?;
        // SAFETY: in bounds (checked); aliasing is the caller's contract.
        Ok(unsafe { std::slice::from_raw_parts(p, len as usize) })
    }

    /// Mutable view of a range.
    ///
    /// # Safety
    /// The caller must have exclusive access to the range while the returned slice lives.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn slice_mut(&self, offset: u64, len: u64) -> Result<&mut [u8]> {
        let p = self.ptr_at(offset, len)?;
        // SAFETY: in bounds (checked); exclusivity is the caller's contract.
        Ok(unsafe { std::slice::from_raw_parts_mut(p, len as usize) })
    }
}

/// A byte range of an arena: `offset..offset+len`, `offset` a multiple of [`REGION_ALIGN`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Region {
    /// Byte offset from the arena base.
    pub offset: u64,
    /// Length in bytes.
    pub len: u64,
}

/// Bump allocator of aligned regions inside an arena of a given size.
#[derive(Debug, Clone)]
pub struct RegionAllocator {
    capacity: u64,
    next: u64,
}

impl RegionAllocator {
    /// An allocator over `capacity` bytes.
    pub fn new(capacity: u64) -> Self {
        RegionAllocator { capacity, next: 0 }
    }

    /// Bytes needed to allocate regions of the given sizes in order (for sizing an arena).
    pub fn bytes_needed(sizes: impl IntoIterator<Item = u64>) -> u64 {
        let mut a = RegionAllocator::new(u64::MAX);
        for s in sizes {
            let _ = a.alloc(s);
        }
        a.next
    }

    /// Allocates `len` bytes aligned to [`REGION_ALIGN`]. Errors with [`Error::HostMemory`]
    /// when the arena is full.
    pub fn alloc(&mut self, len: u64) -> Result<Region> {
        let off = self.next.div_ceil(REGION_ALIGN) * REGION_ALIGN;
        let end = off
            .checked_add(len)
            .filter(|&e| e <= self.capacity)
            .ok_or_else(|| {
                Error::HostMemory(format!(
                    "staging arena full: need {len} more bytes at offset {off}, capacity {}",
                    self.capacity
                ))
            })?;
        self.next = end;
        Ok(Region { offset: off, len })
    }

    /// Bytes used so far (including alignment padding).
    pub fn used(&self) -> u64 {
        self.next
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pjrt::{sys, Plugin};
    use std::sync::atomic::{AtomicUsize, Ordering};

    // A fake plugin whose client implements DmaMap/DmaUnmap, to check that the arena unmaps
    // exactly what it mapped, while the memory is still mapped (the CPU plugin only answers
    // UNIMPLEMENTED; `tests/integration/device_sources.rs` covers that).
    static MAPS: Mutex<Vec<(usize, usize)>> = Mutex::new(Vec::new());
    static UNMAPS: Mutex<Vec<(usize, bool, String)>> = Mutex::new(Vec::new());
    static NAME_CALLS: AtomicUsize = AtomicUsize::new(0);

    unsafe extern "C" fn fake_name(
        a: *mut sys::PJRT_Client_PlatformName_Args,
    ) -> *mut sys::PJRT_Error {
        NAME_CALLS.fetch_add(1, Ordering::SeqCst);
        // SAFETY: valid args from the library.
        unsafe {
            (*a).platform_name = c"fake".as_ptr();
            (*a).platform_name_size = 4;
        }
        std::ptr::null_mut()
    }
    unsafe extern "C" fn fake_devices(
        _a: *mut sys::PJRT_Client_AddressableDevices_Args,
    ) -> *mut sys::PJRT_Error {
        std::ptr::null_mut() // zero devices
    }
    unsafe extern "C" fn fake_map(a: *mut sys::PJRT_Client_DmaMap_Args) -> *mut sys::PJRT_Error {
        // SAFETY: valid args.
        let a = unsafe { &*a };
        MAPS.lock().unwrap().push((a.data as usize, a.size));
        std::ptr::null_mut()
    }
    unsafe extern "C" fn fake_unmap(
        a: *mut sys::PJRT_Client_DmaUnmap_Args,
    ) -> *mut sys::PJRT_Error {
        // SAFETY: valid args.
        let a = unsafe { &*a };
        let mut vec = [0u8; 1];
        // SAFETY: mincore only inspects the mapping (ENOMEM when the page is not mapped).
        let mapped = unsafe { libc::mincore(a.data, 4096, vec.as_mut_ptr()) } == 0;
        let thread = std::thread::current().name().unwrap_or("").to_string();
        UNMAPS
            .lock()
            .unwrap()
            .push((a.data as usize, mapped, thread));
        std::ptr::null_mut()
    }

    #[test]
    fn dma_mappings_are_undone_before_the_memory_goes() {
        let mut api = sys::PJRT_Api::new();
        api.pjrt_api_version = sys::PJRT_Api_Version::new();
        api.pjrt_api_version.minor_version = 81;
        api.PJRT_Client_PlatformName = Some(fake_name);
        api.PJRT_Client_AddressableDevices = Some(fake_devices);
        api.PJRT_Client_DmaMap = Some(fake_map);
        api.PJRT_Client_DmaUnmap = Some(fake_unmap);
        let api: &'static sys::PJRT_Api = crate::pjrt::keep_for_process(api);
        // SAFETY: the fake table is kept for the process (keep_for_process).
        let plugin = unsafe { Plugin::adopt(api, "fake-dma") }.unwrap();
        let fake_client = 0x1000 as *mut sys::PJRT_Client; // never dereferenced by the fakes
                                                           // SAFETY: the fake functions never dereference the client.
        let client = unsafe { Client::adopt(&plugin, fake_client) }.unwrap();
        let arena = PinnedArena::new(3 * 4096, &ArenaOptions::default()).unwrap();
        let base = arena.base() as usize;
        assert_eq!(
            arena.register_dma(&client).unwrap(),
            DmaRegistration::Mapped
        );
        assert_eq!(
            arena.register_dma(&client).unwrap(),
            DmaRegistration::Mapped
        );
        assert_eq!(arena.dma_mapped_clients(), 1);
        assert!(arena.dma_mapped_only_with(Some(&client)));
        assert!(
            !arena.dma_mapped_only_with(None),
            "mapped: reusable for its client only"
        );
        let maps: Vec<_> = MAPS
            .lock()
            .unwrap()
            .iter()
            .filter(|m| m.0 == base)
            .copied()
            .collect();
        assert_eq!(maps, vec![(base, 3 * 4096)], "mapped once, whole arena");
        drop(arena);
        let unmaps: Vec<_> = UNMAPS
            .lock()
            .unwrap()
            .iter()
            .filter(|m| m.0 == base)
            .map(|m| (m.0, m.1))
            .collect();
        assert_eq!(
            unmaps,
            vec![(base, true)],
            "unmapped once, while still mapped"
        );

        // A large arena dropped on a tokio runtime thread is DMA-unmapped and unmapped on the
        // tpu-sync-unmap thread (in that order), not on the runtime's.
        let big =
            PinnedArena::new(UNMAP_OFF_RUNTIME_BYTES + 4096, &ArenaOptions::default()).unwrap();
        let bbase = big.base() as usize;
        big.register_dma(&client).unwrap();
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        rt.block_on(async move { drop(big) });
        // (The address itself may be reused at once by another test's mapping, so the check is
        // the fake plugin's record of the DMA unmap, which runs just before the munmap.)
        let t0 = std::time::Instant::now();
        let unmaps = loop {
            let u: Vec<_> = UNMAPS
                .lock()
                .unwrap()
                .iter()
                .filter(|m| m.0 == bbase)
                .cloned()
                .collect();
            if !u.is_empty() || t0.elapsed() > std::time::Duration::from_secs(10) {
                break u;
            }
            std::thread::sleep(std::time::Duration::from_millis(5));
        };
        assert_eq!(
            unmaps,
            vec![(bbase, true, "tpu-sync-unmap".to_string())],
            "DMA-unmapped once, off the runtime thread, while still mapped"
        );
    }

    #[test]
    fn regions_are_aligned_and_disjoint() {
        let mut a = RegionAllocator::new(1 << 20);
        let r1 = a.alloc(100).unwrap();
        let r2 = a.alloc(1).unwrap();
        let r3 = a.alloc(4096).unwrap();
        assert_eq!(r1.offset, 0);
        assert_eq!(r2.offset, 128);
        assert_eq!(r3.offset, 192);
        assert!(a.alloc(1 << 20).is_err());
    }

    #[test]
    fn arena_bounds_are_checked() {
        let arena = PinnedArena::new(10_000, &ArenaOptions::default()).unwrap();
        assert_eq!(arena.len(), 12288);
        assert_eq!(arena.base() as usize % 4096, 0);
        assert!(arena.ptr_at(12288, 1).is_err());
        assert!(arena.ptr_at(u64::MAX, 2).is_err());
        let p = arena.ptr_at(100, 10).unwrap();
        assert_eq!(p as usize - arena.base() as usize, 100);
        // SAFETY: exclusive in this test.
        let s = unsafe { arena.slice_mut(0, 16) }.unwrap();
        s.copy_from_slice(&[7u8; 16]);
        // SAFETY: no writer now.
        assert_eq!(unsafe { arena.slice(0, 16) }.unwrap(), &[7u8; 16]);
    }
}
