//! Staging of device byte ranges in a pinned arena.
//!
//! A [`Staging`] owns one [`PinnedArena`] and maps, for each rank, a sorted list of device byte
//! ranges (buffer = layer, offset, length) to regions of the arena. A sender stages the request's
//! blocks; a receiver stages exactly the bytes its plan writes. [`Staging::resolve`] translates a
//! device range to an arena address and refuses any range that is not entirely inside one staged
//! range, which is how a span named by a peer is checked against the local registration.
//!
//! An [`ArenaPool`] keeps the arenas of dropped stagings (pre-faulted, locked, DMA-mapped) for
//! later ones ([`Staging::new_pooled`]), so an operation does not pay `mmap`, the kernel's
//! zeroing of fresh (huge) pages, `mlock`, the DMA map and the unmap's TLB shootdowns again.

use std::collections::BTreeMap;
use std::mem::ManuallyDrop;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use crate::arena::{ArenaOptions, PinnedArena, Region, RegionAllocator};
use crate::budget::{Reclaim, Reservation, StagingBudget};
use crate::device::{self, CopyStats, RawCopy};
use crate::error::{Error, Result};
use crate::pjrt::{Capabilities, Client, DeviceBuffer};
use crate::plan::{ByteRange, FanOut};

/// One staged device range and its place in the arena.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StagedRange {
    /// The device range.
    pub range: ByteRange,
    /// Where it lives in the arena.
    pub region: Region,
}

/// Device ranges of several ranks staged in one pinned arena. `Send + Sync`.
///
/// A staging made by [`Staging::new_pooled`] gives its arena (with its budget reservation) back
/// to its [`ArenaPool`] when it drops; the others free it.
#[derive(Debug)]
pub struct Staging {
    /// Taken only in `Drop`.
    arena: ManuallyDrop<PinnedArena>,
    ranks: BTreeMap<u32, Vec<StagedRange>>,
    total: u64,
    /// The arena's bytes taken from a budget (returned when the staging drops, after the arena,
    /// or kept with the arena by its pool). Taken only in `Drop`.
    reservation: ManuallyDrop<Option<Reservation>>,
    /// The pool the arena returns to.
    home: Option<Weak<ArenaPool>>,
    /// Whether the arena came from a pool (it holds an earlier operation's bytes).
    reused: bool,
}

impl Drop for Staging {
    fn drop(&mut self) {
        // SAFETY: both fields are taken exactly once, here, and not used afterwards.
        let (arena, reservation) = unsafe {
            (
                ManuallyDrop::take(&mut self.arena),
                ManuallyDrop::take(&mut self.reservation),
            )
        };
        match (self.home.take().and_then(|w| w.upgrade()), reservation) {
            (Some(pool), Some(r)) => pool.put(arena, r),
            (_, r) => {
                drop(arena);
                drop(r);
            }
        }
    }
}

impl Staging {
    /// Allocates an arena big enough for every rank's ranges (merged and sorted by the caller or
    /// not; they are sorted here) and assigns each range a 64-byte aligned region.
    ///
    /// Errors: [`Error::InvalidArgument`] for overlapping ranges of one rank,
    /// [`Error::HostMemory`] if the arena cannot be mapped.
    pub fn new(ranges: BTreeMap<u32, Vec<ByteRange>>, opts: &ArenaOptions) -> Result<Staging> {
        Self::build(ranges, opts, None)
    }

    /// [`Staging::new`], with the arena's bytes (page-rounded) reserved from `budget` first:
    /// nothing is allocated when they do not fit. `what` names the request in the error; `wait`
    /// as for [`StagingBudget::reserve`]. The bytes return to the budget when the staging drops.
    ///
    /// Errors: [`Error::StagingExhausted`], and those of [`Staging::new`].
    pub fn new_in(
        ranges: BTreeMap<u32, Vec<ByteRange>>,
        opts: &ArenaOptions,
        budget: &Arc<StagingBudget>,
        what: &str,
        wait: Option<Duration>,
    ) -> Result<Staging> {
        Self::build(ranges, opts, Some((budget, what, wait)))
    }

    /// Bytes [`Staging::new`] would map for `ranges` (64-byte aligned regions, whole pages).
    pub fn bytes_for(ranges: &BTreeMap<u32, Vec<ByteRange>>) -> u64 {
        let need = RegionAllocator::bytes_needed(ranges.values().flatten().map(|r| r.len)).max(1);
        need.div_ceil(4096) * 4096
    }

    /// [`Staging::new_in`] from `pool`: reuses an idle arena of the pool that fits (and is
    /// DMA-mapped with no client or with `client` only) with its reservation, or reserves from
    /// the pool's budget and maps a new arena of the request's size class
    /// ([`ArenaPool::class_bytes`]). The arena goes back to the pool when the staging drops.
    /// A reused arena holds an earlier operation's bytes: every staged range must be written
    /// (D2H, or received and verified) before it is read, as for a fresh arena (whose zeroes
    /// are no more the request's bytes than stale ones).
    ///
    /// Errors: as [`Staging::new_in`].
    pub fn new_pooled(
        ranges: BTreeMap<u32, Vec<ByteRange>>,
        pool: &Arc<ArenaPool>,
        client: Option<&Client>,
        what: &str,
        wait: Option<Duration>,
    ) -> Result<Staging> {
        let sorted = Self::sort(ranges)?;
        let need = Self::bytes_for(&sorted);
        let (arena, reservation, reused) = pool.acquire(need, client, what, wait)?;
        let mut s = Self::lay_out(sorted, arena, Some(reservation))?;
        s.home = Some(Arc::downgrade(pool));
        s.reused = reused;
        Ok(s)
    }

    /// Whether the arena came from an [`ArenaPool`] (it held an earlier operation's bytes).
    pub fn is_reused(&self) -> bool {
        self.reused
    }

    fn sort(ranges: BTreeMap<u32, Vec<ByteRange>>) -> Result<BTreeMap<u32, Vec<ByteRange>>> {
        let mut sorted = BTreeMap::new();
        for (rank, mut v) in ranges {
            v.sort_unstable();
            for w in v.windows(2) {
                if w[0].buffer == w[1].buffer && w[0].offset + w[0].len > w[1].offset {
                    return Err(Error::InvalidArgument(format!(
                        "overlapping staging ranges on rank {rank}: {:?} and {:?}",
                        w[0], w[1]
                    )));
                }
            }
            sorted.insert(rank, v);
        }
        Ok(sorted)
    }

    fn build(
        ranges: BTreeMap<u32, Vec<ByteRange>>,
        opts: &ArenaOptions,
        budget: Option<(&Arc<StagingBudget>, &str, Option<Duration>)>,
    ) -> Result<Staging> {
        let sorted = Self::sort(ranges)?;
        let need = RegionAllocator::bytes_needed(sorted.values().flatten().map(|r| r.len)).max(1);
        let reservation = match budget {
            Some((b, what, wait)) => Some(b.reserve(Self::bytes_for(&sorted), what, wait)?),
            None => None,
        };
        let arena = PinnedArena::new(need as usize, opts)?;
        Self::lay_out(sorted, arena, reservation)
    }

    fn lay_out(
        sorted: BTreeMap<u32, Vec<ByteRange>>,
        arena: PinnedArena,
        reservation: Option<Reservation>,
    ) -> Result<Staging> {
        let mut alloc = RegionAllocator::new(arena.len() as u64);
        let mut ranks = BTreeMap::new();
        let mut total = 0;
        for (rank, v) in sorted {
            let mut staged = Vec::with_capacity(v.len());
            for r in v {
                staged.push(StagedRange {
                    range: r,
                    region: alloc.alloc(r.len)?,
                });
                total += r.len;
            }
            ranks.insert(rank, staged);
        }
        Ok(Staging {
            arena: ManuallyDrop::new(arena),
            ranks,
            total,
            reservation: ManuallyDrop::new(reservation),
            home: None,
            reused: false,
        })
    }

    /// The arena.
    pub fn arena(&self) -> &PinnedArena {
        &self.arena
    }

    /// Total staged bytes.
    pub fn total_bytes(&self) -> u64 {
        self.total
    }

    /// Bytes of the arena reserved from a budget (0 when made with [`Staging::new`]).
    pub fn reserved_bytes(&self) -> u64 {
        self.reservation.as_ref().map_or(0, Reservation::bytes)
    }

    /// Staged ranges of `rank` (sorted), empty if none.
    pub fn ranges(&self, rank: u32) -> &[StagedRange] {
        self.ranks.get(&rank).map(Vec::as_slice).unwrap_or(&[])
    }

    /// Ranks with staged ranges.
    pub fn ranks(&self) -> impl Iterator<Item = u32> + '_ {
        self.ranks.keys().copied()
    }

    /// Arena address of device bytes `offset..offset+len` of `buffer` on `rank`.
    ///
    /// Errors with [`Error::BlockRange`] unless the range lies entirely inside one staged range.
    pub fn resolve(&self, rank: u32, buffer: u32, offset: u64, len: u64) -> Result<*mut u8> {
        let v = self.ranges(rank);
        let key = (buffer, offset);
        // Last staged range starting at or before `offset`.
        let idx = v.partition_point(|s| (s.range.buffer, s.range.offset) <= key);
        let hit = idx.checked_sub(1).map(|i| v[i]).filter(|s| {
            s.range.buffer == buffer
                && offset
                    .checked_add(len)
                    .map(|end| end <= s.range.offset + s.range.len)
                    .unwrap_or(false)
        });
        match hit {
            Some(s) => self.arena.ptr_at(s.region.offset + (offset - s.range.offset), len),
            None => Err(Error::BlockRange(format!(
                "bytes {offset}..{} of layer {buffer} on rank {rank} are not staged for this request",
                offset.saturating_add(len)
            ))),
        }
    }

    /// Runs a [`FanOut`]'s local copies: gives each replica destination rank the bytes its
    /// pulled rank received (host `memcpy` between staged regions), so the replica can be
    /// drained to its device without its bytes crossing the network. Returns the bytes copied.
    ///
    /// The caller must not access the ranks' staged regions concurrently (run it after the pull
    /// of [`FanOut::pulled`] completed, before draining).
    ///
    /// Errors: [`Error::BlockRange`] (nothing copied) when a copy's source or destination is not
    /// staged here.
    pub fn apply_fan_out(&self, fan: &FanOut) -> Result<u64> {
        let mut ptrs = Vec::with_capacity(fan.copies.len());
        for c in &fan.copies {
            let from = self.resolve(c.from_rank, c.buffer, c.from_offset, c.len)?;
            let to = self.resolve(c.to_rank, c.buffer, c.to_offset, c.len)?;
            ptrs.push((from as *const u8, to, c.len as usize));
        }
        let mut n = 0;
        for (from, to, len) in ptrs {
            // SAFETY: both ranges were resolved inside this arena's staged regions; they belong
            // to different ranks, whose regions never overlap; exclusivity is the caller's
            // contract.
            unsafe { std::ptr::copy_nonoverlapping(from, to, len) };
            n += len as u64;
        }
        Ok(n)
    }

    fn copies<'a>(&self, rank: u32, buffers: &'a [DeviceBuffer]) -> Result<Vec<RawCopy<'a>>> {
        self.ranges(rank)
            .iter()
            .map(|s| {
                let buffer = buffers.get(s.range.buffer as usize).ok_or_else(|| {
                    Error::InvalidArgument(format!(
                        "rank {rank} has {} buffers, staging needs layer {}",
                        buffers.len(),
                        s.range.buffer
                    ))
                })?;
                Ok(RawCopy {
                    buffer,
                    offset: s.range.offset,
                    len: s.range.len,
                    host: self.arena.ptr_at(s.region.offset, s.region.len)?,
                })
            })
            .collect()
    }

    /// D2H: copies every staged range of `rank` from its device buffers (`buffers[layer]`).
    ///
    /// The caller must not read or write this rank's staged regions concurrently.
    pub fn fill_from_device(
        &self,
        rank: u32,
        buffers: &[DeviceBuffer],
        max_outstanding: usize,
    ) -> Result<CopyStats> {
        let ops = self.copies(rank, buffers)?;
        // SAFETY: each op's host address is a distinct arena region sized to the op (checked by
        // ptr_at); the arena outlives the call; exclusivity is the documented caller contract.
        unsafe { device::d2h_batch(&ops, max_outstanding) }
    }

    /// D2H of the staged ranges of `rank` whose layer (buffer index) is in `layers` only: a
    /// producer that stages a request layer by layer as the model computes it.
    ///
    /// The caller must not read or write these layers' staged regions concurrently.
    pub fn fill_layers_from_device(
        &self,
        rank: u32,
        buffers: &[DeviceBuffer],
        layers: std::ops::Range<u32>,
        max_outstanding: usize,
    ) -> Result<CopyStats> {
        let ops = self.layer_copies(rank, buffers, &layers)?;
        // SAFETY: as fill_from_device (a subset of its copies).
        unsafe { device::d2h_batch(&ops, max_outstanding) }
    }

    /// H2D of the staged ranges of `rank` whose layer is in `layers` only: a consumer that
    /// writes each layer into the device as soon as it arrived.
    ///
    /// The caller must not write these layers' staged regions concurrently.
    pub fn drain_layers_to_device(
        &self,
        caps: &Capabilities,
        rank: u32,
        buffers: &[DeviceBuffer],
        layers: std::ops::Range<u32>,
    ) -> Result<CopyStats> {
        let ops = self.layer_copies(rank, buffers, &layers)?;
        // SAFETY: as drain_to_device (a subset of its copies).
        unsafe { device::h2d_batch(caps, &ops) }
    }

    fn layer_copies<'a>(
        &self,
        rank: u32,
        buffers: &'a [DeviceBuffer],
        layers: &std::ops::Range<u32>,
    ) -> Result<Vec<RawCopy<'a>>> {
        let all = self.copies(rank, buffers)?;
        Ok(self
            .ranges(rank)
            .iter()
            .zip(all)
            .filter(|(s, _)| layers.contains(&s.range.buffer))
            .map(|(_, c)| c)
            .collect())
    }

    /// [`Staging::drain_to_device`] (every layer, `layers: None`) or
    /// [`Staging::drain_layers_to_device`], but only if the copies can run on the calling thread
    /// without waiting for the copy engine ([`device::try_h2d_batch_inline`]): `Ok(None)` when
    /// they cannot, and then nothing was copied. For an async runtime's worker threads.
    pub fn try_drain_inline(
        &self,
        caps: &Capabilities,
        rank: u32,
        buffers: &[DeviceBuffer],
        layers: Option<std::ops::Range<u32>>,
    ) -> Result<Option<CopyStats>> {
        let ops = match &layers {
            None => self.copies(rank, buffers)?,
            Some(l) => self.layer_copies(rank, buffers, l)?,
        };
        // SAFETY: as drain_to_device.
        unsafe { device::try_h2d_batch_inline(caps, &ops) }
    }

    /// H2D: writes every staged range of `rank` into its device buffers in place.
    ///
    /// The caller must not write this rank's staged regions concurrently.
    pub fn drain_to_device(
        &self,
        caps: &Capabilities,
        rank: u32,
        buffers: &[DeviceBuffer],
    ) -> Result<CopyStats> {
        let ops = self.copies(rank, buffers)?;
        // SAFETY: host sources are arena regions that stay valid and unmodified for the call.
        unsafe { device::h2d_batch(caps, &ops) }
    }
}

/// Default [`ArenaPool`] cap of a transfer pipeline
/// ([`crate::transfer::TransferOptions::staging_pool_bytes`]): 256 MiB of idle staging.
pub const DEFAULT_POOL_BYTES: u64 = 256 << 20;

/// Counters of an [`ArenaPool`] ([`ArenaPool::stats`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PoolStats {
    /// Most bytes of idle arenas kept (0: the pool is off, every arena is freed).
    pub cap_bytes: u64,
    /// Gauge: bytes of idle arenas now (they hold reservations of the pool's budget).
    pub idle_bytes: u64,
    /// Gauge: idle arenas now.
    pub idle_arenas: u64,
    /// Total: stagings that reused an idle arena.
    pub hits: u64,
    /// Total: stagings that mapped a new arena (with the pool on).
    pub misses: u64,
    /// Total: arenas given back and kept idle.
    pub returned: u64,
    /// Total: arenas freed instead of kept (over the cap, evicted, reclaimed by the budget, a
    /// reservation waiting for budget, the pool off).
    pub released: u64,
}

/// One idle arena and the budget bytes it holds.
#[derive(Debug)]
struct Idle {
    arena: PinnedArena,
    reservation: Reservation,
}

/// Idle staging arenas kept for reuse, by size: pre-faulted, locked and DMA-mapped once, used by
/// many operations ([`Staging::new_pooled`]).
///
/// * **Size classes.** A new arena is mapped at [`ArenaPool::class_bytes`] of the request (the
///   next power of two up to 2 MiB, then whole 2 MiB huge pages) when the budget has room, else
///   at the request's size. A staging reuses the smallest idle arena of at least its size and at
///   most [`ArenaPool::fit_limit`] (so a small request does not hold a large arena's budget).
/// * **Budget.** Idle arenas keep their reservation of the pool's [`StagingBudget`]: the pool's
///   bytes count against it. The pool registers with the budget as a [`Reclaim`]er: a
///   reservation that does not fit frees idle arenas (oldest first) before it fails or waits,
///   and no arena is kept idle while a reservation waits.
/// * **Cap.** At most `cap_bytes` of idle arenas; returning one past the cap frees the oldest
///   idle ones first (an arena larger than the cap is freed). `cap_bytes == 0` turns the pool
///   off: every arena is freed when its staging drops, as without a pool.
/// * **DMA maps.** An arena keeps its DMA maps (and with them its PJRT clients alive) while idle;
///   it is reused only for a staging of the same client, or one never mapped. Dropping the pool
///   (its pipeline) frees every idle arena.
/// * **Stale bytes.** A reused arena holds an earlier operation's bytes; the pipeline writes
///   every staged range before reading it (D2H fill, or network receive, whose per-chunk
///   checksums are computed over the staging after the bytes landed), so a chunk that did not
///   arrive fails its transfer whatever the arena held.
///
/// Thread-safety: `Send + Sync`; stagings may be made and dropped from any thread.
#[derive(Debug)]
pub struct ArenaPool {
    cap: u64,
    opts: ArenaOptions,
    budget: Arc<StagingBudget>,
    /// Idle arenas, oldest first.
    idle: Mutex<Vec<Idle>>,
    hits: AtomicU64,
    misses: AtomicU64,
    returned: AtomicU64,
    released: AtomicU64,
}

const HUGE_PAGE: u64 = 2 << 20;

impl ArenaPool {
    /// A pool of at most `cap_bytes` idle arenas made with `opts`, holding reservations of
    /// `budget` (and registered with it as a reclaimer).
    pub fn new(cap_bytes: u64, opts: ArenaOptions, budget: Arc<StagingBudget>) -> Arc<ArenaPool> {
        let pool = Arc::new(ArenaPool {
            cap: cap_bytes,
            opts,
            budget,
            idle: Mutex::new(Vec::new()),
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
            returned: AtomicU64::new(0),
            released: AtomicU64::new(0),
        });
        let weak: Weak<dyn Reclaim> = Arc::downgrade(&pool) as Weak<dyn Reclaim>;
        pool.budget.add_reclaimer(weak);
        pool
    }

    /// The size class of a request of `bytes` (bytes): the next power of two (at least 64 KiB)
    /// up to 2 MiB, whole 2 MiB (huge) pages above.
    pub fn class_bytes(bytes: u64) -> u64 {
        let b = bytes.max(1);
        if b <= HUGE_PAGE {
            b.next_power_of_two().max(64 << 10)
        } else {
            b.div_ceil(HUGE_PAGE).saturating_mul(HUGE_PAGE)
        }
    }

    /// Largest idle arena (bytes) a request of `bytes` reuses: its class, or 1.25x the request
    /// where that is more.
    pub fn fit_limit(bytes: u64) -> u64 {
        Self::class_bytes(bytes).max(bytes.saturating_add(bytes / 4))
    }

    /// The budget the pool's arenas are reserved from.
    pub fn budget(&self) -> &Arc<StagingBudget> {
        &self.budget
    }

    /// Counters.
    pub fn stats(&self) -> PoolStats {
        let (idle_bytes, idle_arenas) = {
            let g = self.idle.lock().unwrap_or_else(|p| p.into_inner());
            (
                g.iter().map(|i| i.reservation.bytes()).sum(),
                g.len() as u64,
            )
        };
        let rd = |a: &AtomicU64| a.load(Ordering::Relaxed);
        PoolStats {
            cap_bytes: self.cap,
            idle_bytes,
            idle_arenas,
            hits: rd(&self.hits),
            misses: rd(&self.misses),
            returned: rd(&self.returned),
            released: rd(&self.released),
        }
    }

    /// Frees every idle arena; returns the bytes given back to the budget.
    pub fn clear(&self) -> u64 {
        self.reclaim(u64::MAX)
    }

    /// An arena of at least `need` bytes for `client`: an idle one (hit) or a new one (miss),
    /// with its reservation, and whether it was reused.
    fn acquire(
        &self,
        need: u64,
        client: Option<&Client>,
        what: &str,
        wait: Option<Duration>,
    ) -> Result<(PinnedArena, Reservation, bool)> {
        let on = self.cap > 0 && need <= self.cap;
        if on {
            let limit = Self::fit_limit(need);
            let mut g = self.idle.lock().unwrap_or_else(|p| p.into_inner());
            let best = g
                .iter()
                .enumerate()
                .filter(|(_, i)| {
                    let len = i.arena.len() as u64;
                    len >= need && len <= limit && i.arena.dma_mapped_only_with(client)
                })
                .min_by_key(|(_, i)| i.arena.len())
                .map(|(n, _)| n);
            if let Some(n) = best {
                let i = g.remove(n);
                drop(g);
                self.hits.fetch_add(1, Ordering::Relaxed);
                return Ok((i.arena, i.reservation, true));
            }
            drop(g);
            self.misses.fetch_add(1, Ordering::Relaxed);
        }
        // The class size where the budget has room for it now (this pool's idle arenas count as
        // room: the reservation reclaims them), else the exact size where that fits now, else
        // the class size for a reservation that may wait for returned bytes (they come back
        // in classes), else the exact size (which fails as it did without a pool). A
        // heuristic: the budget may change before the reservation.
        let class = Self::class_bytes(need);
        let size = if !on || class > self.cap {
            need
        } else {
            let idle: u64 = {
                let g = self.idle.lock().unwrap_or_else(|p| p.into_inner());
                g.iter().map(|i| i.reservation.bytes()).sum()
            };
            let used = self.budget.used().saturating_sub(idle);
            let fits = |n: u64| used.saturating_add(n) <= self.budget.limit();
            if fits(class) {
                class
            } else if fits(need) {
                need
            } else if wait.is_some() && class <= self.budget.limit() {
                class
            } else {
                need
            }
        };
        let reservation = self.budget.reserve(size, what, wait)?;
        let arena = PinnedArena::new(size as usize, &self.opts)?;
        Ok((arena, reservation, false))
    }

    /// Takes an arena back from a dropped staging: kept idle, or freed (see the type's docs).
    fn put(&self, arena: PinnedArena, reservation: Reservation) {
        let len = reservation.bytes();
        let mut evicted = Vec::new();
        let mut g = self.idle.lock().unwrap_or_else(|p| p.into_inner());
        let keep = self.cap > 0
            && len <= self.cap
            && arena.len() as u64 >= len
            && Arc::ptr_eq(reservation.budget(), &self.budget)
            && !self.budget.has_waiters();
        if !keep {
            drop(g);
            self.released.fetch_add(1, Ordering::Relaxed);
            drop(arena);
            drop(reservation);
            return;
        }
        let mut held: u64 = g.iter().map(|i| i.reservation.bytes()).sum();
        while held + len > self.cap && !g.is_empty() {
            let old = g.remove(0);
            held -= old.reservation.bytes();
            evicted.push(old);
        }
        g.push(Idle { arena, reservation });
        drop(g);
        self.returned.fetch_add(1, Ordering::Relaxed);
        self.released
            .fetch_add(evicted.len() as u64, Ordering::Relaxed);
        drop(evicted);
    }
}

impl Reclaim for ArenaPool {
    fn reclaim(&self, bytes: u64) -> u64 {
        let mut freed = Vec::new();
        let mut got = 0u64;
        {
            let mut g = self.idle.lock().unwrap_or_else(|p| p.into_inner());
            while got < bytes && !g.is_empty() {
                let old = g.remove(0);
                got += old.reservation.bytes();
                freed.push(old);
            }
        }
        self.released
            .fetch_add(freed.len() as u64, Ordering::Relaxed);
        drop(freed);
        got
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn r(buffer: u32, offset: u64, len: u64) -> ByteRange {
        ByteRange {
            buffer,
            offset,
            len,
        }
    }

    #[test]
    fn resolve_only_inside_staged_ranges() {
        let mut m = BTreeMap::new();
        m.insert(3, vec![r(1, 1000, 100), r(0, 0, 64), r(1, 0, 10)]);
        let s = Staging::new(
            m,
            &ArenaOptions {
                lock: false,
                huge_pages: false,
                populate: true,
            },
        )
        .unwrap();
        assert_eq!(s.total_bytes(), 174);
        let base = s.arena().base() as usize;
        let a = s.resolve(3, 1, 1010, 90).unwrap() as usize - base;
        let b = s.resolve(3, 1, 1000, 1).unwrap() as usize - base;
        assert_eq!(a - b, 10);
        assert!(
            s.resolve(3, 1, 1010, 91).is_err(),
            "past the end of the staged range"
        );
        assert!(s.resolve(3, 1, 999, 2).is_err(), "starts before");
        assert!(s.resolve(3, 2, 1000, 1).is_err(), "other layer");
        assert!(s.resolve(4, 1, 1000, 1).is_err(), "other rank");
        assert!(s.resolve(3, 1, u64::MAX, 2).is_err(), "overflow");
        let mut m = BTreeMap::new();
        m.insert(0, vec![r(0, 0, 10), r(0, 5, 10)]);
        assert!(Staging::new(m, &ArenaOptions::default()).is_err());
    }

    /// Non-repeating bytes of `seed`.
    fn pattern(seed: u64, out: &mut [u8]) {
        for (i, c) in out.chunks_mut(8).enumerate() {
            let v = crate::pattern::mix64(seed ^ ((i as u64) << 8)).to_le_bytes();
            c.copy_from_slice(&v[..c.len()]);
        }
    }

    fn one(len: u64) -> BTreeMap<u32, Vec<ByteRange>> {
        BTreeMap::from([(0, vec![r(0, 0, len)])])
    }

    fn plain() -> ArenaOptions {
        ArenaOptions {
            lock: false,
            huge_pages: false,
            populate: true,
        }
    }

    #[test]
    fn size_classes() {
        assert_eq!(ArenaPool::class_bytes(1), 64 << 10);
        assert_eq!(ArenaPool::class_bytes(65 << 10), 128 << 10);
        assert_eq!(ArenaPool::class_bytes(2 << 20), 2 << 20);
        assert_eq!(ArenaPool::class_bytes((2 << 20) + 1), 4 << 20);
        assert_eq!(ArenaPool::class_bytes((16 << 20) + 4096), 18 << 20);
        assert_eq!(ArenaPool::fit_limit(10 << 10), 64 << 10);
        assert_eq!(ArenaPool::fit_limit(64 << 20), 80 << 20);
    }

    #[test]
    fn pooled_arenas_are_reused_by_size_and_fully_rewritten_byte_exact() {
        let budget = StagingBudget::new("pool-test", 64 << 20);
        let pool = ArenaPool::new(16 << 20, plain(), budget.clone());
        let fill = |s: &Staging, len: u64, seed: u64| {
            let p = s.resolve(0, 0, 0, len).unwrap();
            // SAFETY: the staging's one range, exclusive here.
            let v = unsafe { std::slice::from_raw_parts_mut(p, len as usize) };
            pattern(seed, v);
        };
        let read = |s: &Staging, len: u64| {
            let p = s.resolve(0, 0, 0, len).unwrap();
            // SAFETY: no writer now.
            unsafe { std::slice::from_raw_parts(p, len as usize) }.to_vec()
        };
        let a = Staging::new_pooled(one(100_000), &pool, None, "a", None).unwrap();
        assert!(!a.is_reused());
        assert_eq!(a.reserved_bytes(), 128 << 10, "class of 100 000 bytes");
        fill(&a, 100_000, 1);
        let base = a.arena().base() as usize;
        drop(a);
        assert_eq!(pool.stats().idle_bytes, 128 << 10);
        assert_eq!(
            budget.used(),
            128 << 10,
            "idle arenas keep their budget bytes"
        );
        // Smaller, same class: the same arena, holding the earlier bytes until overwritten.
        let b = Staging::new_pooled(one(70_000), &pool, None, "b", None).unwrap();
        assert!(b.is_reused());
        assert_eq!(b.arena().base() as usize, base);
        fill(&b, 70_000, 2);
        let mut want = vec![0u8; 70_000];
        pattern(2, &mut want);
        assert_eq!(read(&b, 70_000), want);
        // Too small for that arena (past its fit limit) and too big: new arenas.
        let c = Staging::new_pooled(one(1000), &pool, None, "c", None).unwrap();
        let d = Staging::new_pooled(one(3 << 20), &pool, None, "d", None).unwrap();
        assert!(!c.is_reused() && !d.is_reused());
        assert_eq!(d.reserved_bytes(), 4 << 20);
        drop((b, c, d));
        let st = pool.stats();
        assert_eq!(
            (st.hits, st.misses, st.returned, st.idle_arenas),
            (1, 3, 4, 3),
            "{st:?}"
        );
        assert_eq!(budget.used(), st.idle_bytes);
        assert_eq!(pool.clear(), (128 << 10) + (64 << 10) + (4 << 20));
        assert_eq!(budget.used(), 0);
    }

    #[test]
    fn the_cap_holds_and_the_budget_reclaims_idle_arenas() {
        let budget = StagingBudget::new("reclaim-test", 256 << 10);
        let pool = ArenaPool::new(128 << 10, plain(), budget.clone());
        let s: Vec<_> = (0..3)
            .map(|i| Staging::new_pooled(one(60_000), &pool, None, &format!("{i}"), None).unwrap())
            .collect();
        assert_eq!(budget.used(), 3 * (64 << 10));
        drop(s);
        let st = pool.stats();
        assert_eq!(
            (st.idle_bytes, st.returned, st.released),
            (128 << 10, 3, 1),
            "{st:?}"
        );
        // 200 KiB fit only once the budget takes the idle arenas back.
        let r = budget.reserve(200 << 10, "other", None).unwrap();
        assert_eq!(pool.stats().idle_bytes, 0);
        assert_eq!(budget.stats().refused, 0);
        // A pooled staging that does not fit fails as without a pool.
        let e = Staging::new_pooled(one(100_000), &pool, None, "big", None).unwrap_err();
        assert_eq!(e.kind(), crate::error::ErrorKind::StagingExhausted);
        drop(r);
        // A staging dropped while a reservation waits gives its bytes back instead of idling.
        let a = Staging::new_pooled(one(60_000), &pool, None, "a", None).unwrap();
        let b2 = budget.clone();
        let waiter = std::thread::spawn(move || {
            b2.reserve(200 << 10, "waiter", Some(Duration::from_secs(30)))
        });
        while !budget.has_waiters() {
            std::thread::sleep(Duration::from_millis(1));
        }
        drop(a);
        assert!(waiter.join().unwrap().is_ok());
        assert_eq!(pool.stats().idle_bytes, 0);
    }
}
