//! Staging of device byte ranges in a pinned arena.
//!
//! A [`Staging`] owns one [`PinnedArena`] and maps, for each rank, a sorted list of device byte
//! ranges (buffer = layer, offset, length) to regions of the arena. A sender stages the request's
//! blocks; a receiver stages exactly the bytes its plan writes. [`Staging::resolve`] translates a
//! device range to an arena address and refuses any range that is not entirely inside one staged
//! range, which is how a span named by a peer is checked against the local registration.

use std::collections::BTreeMap;

use std::sync::Arc;
use std::time::Duration;

use crate::arena::{ArenaOptions, PinnedArena, Region, RegionAllocator};
use crate::budget::{Reservation, StagingBudget};
use crate::device::{self, CopyStats, RawCopy};
use crate::error::{Error, Result};
use crate::pjrt::{Capabilities, DeviceBuffer};
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
#[derive(Debug)]
pub struct Staging {
    arena: PinnedArena,
    ranks: BTreeMap<u32, Vec<StagedRange>>,
    total: u64,
    /// The arena's bytes taken from a budget (returned when the staging drops, after the arena).
    reservation: Option<Reservation>,
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

    fn build(
        ranges: BTreeMap<u32, Vec<ByteRange>>,
        opts: &ArenaOptions,
        budget: Option<(&Arc<StagingBudget>, &str, Option<Duration>)>,
    ) -> Result<Staging> {
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
        let need = RegionAllocator::bytes_needed(sorted.values().flatten().map(|r| r.len)).max(1);
        let reservation = match budget {
            Some((b, what, wait)) => Some(b.reserve(Self::bytes_for(&sorted), what, wait)?),
            None => None,
        };
        let arena = PinnedArena::new(need as usize, opts)?;
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
            arena,
            ranks,
            total,
            reservation,
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
}
