//! The host KV tier: a prefix-keyed store of KV blocks in pinned host DRAM, optionally kept in
//! `/dev/shm` across restarts and backed by a disk tier.
//!
//! This is the host-DRAM offload that vLLM's `OffloadingConnector` (CPU offloading spec) and
//! SGLang's HiCache L2/L3 do (`docs/plugins-and-engines.md`, "vLLM: block hashes and offload
//! keys" and "SGLang HiCache storage interface"): blocks evicted from
//! device memory are kept here, found again by prefix, and loaded back instead of recomputing the
//! prefill.
//!
//! # Keys
//!
//! A block is addressed by a [`BlockKey`]: the engine's chained block hash (the key of a block
//! covers its tokens and all tokens before it) inside a [`Namespace`] (model, dtype, layout), so
//! two models never share keys. Build keys from token ids with [`Namespace::chain_keys`] or wrap an
//! engine's own hashes with [`Namespace::engine_key`]. Batch operations take a **chain**: a slice
//! of keys where each key's block follows the previous one (SGLang passes up to 128 pages per
//! call; vLLM a request's blocks).
//!
//! # Operations
//!
//! | operation | what it does |
//! |---|---|
//! | [`KvStore::lookup`] | number of leading blocks of a chain present (DRAM or disk), like SGLang's `batch_exists`; updates recency |
//! | [`KvStore::put_from_host`], [`KvStore::put_from_device`] | store blocks (host memory, or PJRT device blocks through [`crate::device::d2h_batch`]) |
//! | [`KvStore::get_to_host`], [`KvStore::get_to_device`] | copy blocks out (host memory, or existing device blocks through [`crate::device::h2d_batch`]), loading disk blocks through DRAM; updates recency |
//! | [`KvStore::pin`] / [`KvStore::unpin`] | a [`Lease`] on the leading present blocks of a chain: never evicted while held |
//! | [`KvStore::remove`], [`KvStore::clear`], [`KvStore::flush_to_disk`] | maintenance |
//!
//! Every operation is a batch; single blocks are batches of one. The capacity (bytes of DRAM
//! slots, [`StoreConfig::capacity_bytes`]) is fixed at creation.
//!
//! # How the engines' interfaces map onto it
//!
//! * **SGLang HiCache storage** (`HiCacheStorage`, `docs/plugins-and-engines.md`, "SGLang
//!   HiCache storage interface"):
//!   `batch_exists(keys)` is [`KvStore::lookup`] of the page keys ([`Namespace::engine_key_str`]
//!   of each page hash string); `batch_set_v1(keys, host_indices)` is [`KvStore::put_from_host`]
//!   of the pages (with the last prefix key as `parent` when `prefix_keys` are passed);
//!   `batch_get_v1` is [`KvStore::get_to_host`], page `i` succeeding iff `i <
//!   GetReport::delivered`. Batches of up to 128 pages are single calls.
//! * **vLLM offloading** (`OffloadingManager` / `OffloadingWorker`, "vLLM: block hashes and
//!   offload keys" there): `lookup` is
//!   [`KvStore::lookup`] of [`Namespace::engine_key`]`(block_hash + group_idx)` keys;
//!   `prepare_load` takes a [`Lease`] ([`KvStore::pin`]), the worker's `submit_load` is
//!   [`KvStore::get_to_device`] and `complete_load` drops the lease; `prepare_store` /
//!   `submit_store` is [`KvStore::put_from_device`] ([`DeviceBlock::kv_block`] names a block of
//!   the registered per-layer KV buffers).
//!
//! A get delivers the chain's blocks already in DRAM first, then loads disk blocks through DRAM in
//! windows of a quarter of the slots; a put streams in windows of half the slots, so a chain
//! longer than DRAM passes through it to the disk tier (without a disk tier, the put reports
//! "full" where the chain no longer fits).
//!
//! # Guarantees
//!
//! * **Eviction keeps prefixes usable**: LRU, never a block whose later blocks stay, never a
//!   pinned block; a put that finds no such room reports [`PutReport::full_at`] (see
//!   [`index`] for the policy).
//! * **Reads never return the wrong bytes.** A get does not hold blocks while it copies them
//!   (unless the caller holds a lease): it remembers each slot's generation, copies, and checks the
//!   generation again afterwards ([`shm`] commit protocol); a block evicted or overwritten during
//!   the copy is re-read (up to 4 times) or reported missing, never delivered. Every block carries
//!   an xxh3-64 checksum computed at put and verified on get (unless
//!   [`StoreConfig::verify_checksums`] is off); a mismatch drops the block and its chain below it
//!   and fails the get with [`Error::Checksum`].
//! * **Warm restart**: with [`StoreConfig::shm_name`] the segment lives in `/dev/shm`; a restarted
//!   process re-attaches it and serves every block whose put had committed, even after SIGKILL
//!   mid-put ([`shm`]). The index (hash map, LRU order, chain counts) is rebuilt from the
//!   segment's slot table at attach, in O(slots); recency after a restart follows the order in
//!   which the blocks were stored (lookups are not written to shared memory). Leases die with
//!   their process.
//! * **Disk tier** ([`StoreConfig::disk`]): DRAM victims spill to block files (io_uring,
//!   `O_DIRECT`) and are loaded back through DRAM; a missing, truncated or corrupt file is a miss
//!   ([`disk`]).
//! * **Pinned memory**: the segment is `mlock`ed ([`TierInfo::lock`] says why not, if not),
//!   optionally on transparent huge pages, and DMA-mapped with `PJRT_Client_DmaMap` when a client
//!   is given and the plugin supports it ([`TierInfo::dma`]; the XLA CPU plugin answers
//!   UNIMPLEMENTED, which is logged and skipped). With [`StoreConfig::background`], mapping,
//!   faulting, locking and re-attaching happen on a thread: until [`KvStore::state`] is
//!   [`TierState::Ready`], lookups find nothing, puts report `not_ready` and gets deliver nothing.
//!
//! # Thread-safety
//!
//! [`KvStore`] is `Send + Sync` and cheap to clone (one shared store). All operations take `&self`
//! and may run concurrently from any threads: one mutex guards the index for short, O(blocks)
//! critical sections; block data is copied outside it, so copies of different blocks run in
//! parallel. One process at a time may use a named segment or a disk directory (file locks).

pub mod checksum;
mod dirfd;
pub mod disk;
pub mod groups;
pub mod index;
pub mod key;
pub mod observe;
pub mod shared;
pub mod shm;

use std::path::PathBuf;
use std::sync::{Arc, Condvar, Mutex, OnceLock, PoisonError};
use std::time::{Duration, Instant};

pub use disk::{DiskOptions, IoBackend, SharedFs};
pub use groups::{
    part_key, GroupGetReport, GroupHit, GroupPart, GroupPutReport, PartRole, StoreGroup,
    StoreGroups,
};
pub use key::{BlockKey, Namespace};
pub use observe::{ObservedBlock, ObserverId, StoreObserver};
pub use shm::{list_segments, remove_segment, Attach, Geometry, SegmentInfo, DEFAULT_SHM_DIR};

use crate::arena::{ArenaOptions, LockStatus};
use crate::budget::{Reservation, StagingBudget};
use crate::device::{self, RawCopy};
use crate::error::{Error, Result};
use crate::layout::KvLayout;
use crate::pjrt::{Capabilities, Client, DeviceBuffer};
use disk::{DiskTier, FileMeta, ReadItem, WriteItem};
use index::{Begin, Dram, EntryId, Index, Take, Victim, PENDING_SLOT};
use shm::{Segment, SlotMeta};

/// How often a get re-reads a block that changed under it before reporting it missing.
pub const MAX_RACE_RETRIES: u32 = 4;
/// How long a get waits for another caller's load of the same block from disk.
const FILL_WAIT: Duration = Duration::from_secs(10);
/// Device copies in flight at once in `put_from_device`.
const D2H_OUTSTANDING: usize = 256;

/// A test and fault-injection hook, called with the key of the block concerned.
pub type Hook = Arc<dyn Fn(BlockKey) + Send + Sync>;

/// Test and fault-injection hooks (all `None` in production).
#[doc(hidden)]
#[derive(Clone, Default)]
pub struct Hooks {
    /// Runs in the middle of a get's copy of a block out of its DRAM slot (host gets).
    pub mid_read: Option<Hook>,
    /// Runs in the middle of a put's copy into a slot, before the block is committed.
    pub mid_write: Option<Hook>,
    /// Runs at the start of preparing the tier (with a zero key).
    pub before_prepare: Option<Hook>,
}

impl std::fmt::Debug for Hooks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Hooks")
            .field("mid_read", &self.mid_read.is_some())
            .field("mid_write", &self.mid_write.is_some())
            .field("before_prepare", &self.before_prepare.is_some())
            .finish()
    }
}

/// How to create a [`KvStore`].
#[derive(Debug, Clone)]
pub struct StoreConfig {
    /// What the blocks belong to; recorded in the segment and disk tier.
    pub namespace: Namespace,
    /// Largest block in bytes (e.g. one engine block of all layers, K and V, of one rank).
    pub block_bytes: u64,
    /// DRAM capacity: bytes of block slots (slots are `block_bytes` rounded up to 4096, see
    /// [`Geometry`]; the header and slot table, 4 KiB + 64 B per slot, come on top).
    pub capacity_bytes: u64,
    /// Keep the segment in `shm_dir` under this name, for warm restarts (see [`shm`]). `None`:
    /// anonymous memory, lost with the process.
    pub shm_name: Option<String>,
    /// Directory of named segments (default [`DEFAULT_SHM_DIR`]).
    pub shm_dir: PathBuf,
    /// The disk tier, if any.
    pub disk: Option<DiskOptions>,
    /// Locking, huge pages and pre-faulting of the segment (default: all on).
    pub memory: ArenaOptions,
    /// Verify each block's checksum on get (default true).
    pub verify_checksums: bool,
    /// Prepare the tier on a background thread; [`KvStore::open`] returns at once.
    pub background: bool,
    /// Map the DRAM slots for DMA with this PJRT client (`PJRT_Client_DmaMap`), if it supports it.
    pub dma_client: Option<Client>,
    /// Budget of pinned memory the segment's bytes are reserved from ([`KvStore::open`] fails
    /// with [`Error::StagingExhausted`] at once when they do not fit); `None` (default): the
    /// process-wide budget shared with every transfer pipeline
    /// ([`crate::budget::StagingBudget::process`]).
    pub staging_budget: Option<Arc<StagingBudget>>,
    /// Publish vLLM-format KV events of the tier over ZMQ ([`crate::kv_events`]); default off.
    pub kv_events: Option<crate::kv_events::KvEventsConfig>,
    /// Test hooks.
    #[doc(hidden)]
    pub hooks: Hooks,
}

impl StoreConfig {
    /// A configuration with defaults: anonymous memory, no disk tier, locked and pre-faulted
    /// memory on huge pages, checksums verified, prepared in the foreground, no DMA mapping.
    pub fn new(namespace: Namespace, block_bytes: u64, capacity_bytes: u64) -> StoreConfig {
        StoreConfig {
            namespace,
            block_bytes,
            capacity_bytes,
            shm_name: None,
            shm_dir: PathBuf::from(DEFAULT_SHM_DIR),
            disk: None,
            memory: ArenaOptions::default(),
            verify_checksums: true,
            background: false,
            dma_client: None,
            staging_budget: None,
            kv_events: None,
            hooks: Hooks::default(),
        }
    }
}

/// Whether the tier can serve yet.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TierState {
    /// Memory is being mapped, faulted, locked or re-attached.
    Preparing,
    /// Serving.
    Ready,
    /// Preparing failed; the error message. The store stays empty.
    Failed(String),
}

/// Whether the DRAM slots are DMA-mapped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DmaStatus {
    /// No client was given.
    NotRequested,
    /// `PJRT_Client_DmaMap` succeeded for this many bytes.
    Mapped(u64),
    /// The plugin refused (e.g. UNIMPLEMENTED on the XLA CPU plugin); its message.
    Unavailable(String),
}

/// How the tier was set up (fixed once ready).
#[derive(Debug, Clone)]
pub struct TierInfo {
    /// Anonymous, created, re-attached or reformatted.
    pub attach: Attach,
    /// Path of the named segment.
    pub segment: Option<PathBuf>,
    /// Sizes and offsets.
    pub geometry: Geometry,
    /// Whether the segment is locked in RAM, or why not.
    pub lock: LockStatus,
    /// Whether huge pages were requested (`MADV_HUGEPAGE`).
    pub huge_pages: bool,
    /// DMA mapping.
    pub dma: DmaStatus,
    /// Disk tier directory, I/O path, `O_DIRECT`, capacity in blocks.
    pub disk: Option<(PathBuf, IoBackend, bool, u64)>,
    /// Blocks found in the re-attached segment.
    pub restored_dram_blocks: u64,
    /// Blocks found in the disk tier at open.
    pub restored_disk_blocks: u64,
    /// Seconds spent preparing.
    pub prepare_secs: f64,
}

/// Counters since open, and current occupancy.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StoreStats {
    /// Blocks with a DRAM copy.
    pub dram_blocks: u64,
    /// Blocks with a disk copy.
    pub disk_blocks: u64,
    /// Free DRAM slots.
    pub free_slots: u64,
    /// Lookup calls.
    pub lookups: u64,
    /// Blocks asked for by lookups.
    pub lookup_blocks: u64,
    /// Blocks found by lookups.
    pub lookup_hits: u64,
    /// Blocks stored by puts.
    pub put_blocks: u64,
    /// Blocks a put found already present.
    pub put_present: u64,
    /// Blocks a put could not store for lack of room.
    pub put_full: u64,
    /// Blocks delivered by gets from DRAM.
    pub get_dram: u64,
    /// Blocks delivered by gets after loading them from disk.
    pub get_disk: u64,
    /// DRAM copies evicted.
    pub evictions: u64,
    /// Of those, written to disk first.
    pub spills: u64,
    /// Spills that failed (the block stayed in DRAM).
    pub spill_failures: u64,
    /// Copies that found their slot changed afterwards (and were retried).
    pub races: u64,
    /// Blocks whose DRAM copy failed its checksum (dropped).
    pub corrupt_blocks: u64,
    /// Disk files found missing, truncated or corrupt (dropped).
    pub bad_files: u64,
    /// Bytes stored.
    pub bytes_put: u64,
    /// Bytes delivered.
    pub bytes_got: u64,
}

#[derive(Default)]
struct Counters {
    lookups: std::sync::atomic::AtomicU64,
    lookup_blocks: std::sync::atomic::AtomicU64,
    lookup_hits: std::sync::atomic::AtomicU64,
    put_blocks: std::sync::atomic::AtomicU64,
    put_present: std::sync::atomic::AtomicU64,
    put_full: std::sync::atomic::AtomicU64,
    get_dram: std::sync::atomic::AtomicU64,
    get_disk: std::sync::atomic::AtomicU64,
    evictions: std::sync::atomic::AtomicU64,
    spills: std::sync::atomic::AtomicU64,
    spill_failures: std::sync::atomic::AtomicU64,
    races: std::sync::atomic::AtomicU64,
    corrupt_blocks: std::sync::atomic::AtomicU64,
    bad_files: std::sync::atomic::AtomicU64,
    bytes_put: std::sync::atomic::AtomicU64,
    bytes_got: std::sync::atomic::AtomicU64,
    /// Blocks pinned by live leases (a gauge, for metrics).
    leased: std::sync::atomic::AtomicU64,
}

fn add(c: &std::sync::atomic::AtomicU64, n: u64) {
    c.fetch_add(n, std::sync::atomic::Ordering::Relaxed);
}
fn rd(c: &std::sync::atomic::AtomicU64) -> u64 {
    c.load(std::sync::atomic::Ordering::Relaxed)
}

/// Result of a put.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PutReport {
    /// Blocks written by this call.
    pub stored: usize,
    /// Blocks already present, or being stored by a concurrent call (not written again).
    pub present: usize,
    /// The first chain position that could not be stored because every DRAM slot is pinned, in
    /// use, or protects a later block of its chain ("full"). Blocks from there on were not
    /// stored (a suffix without its prefix could never hit).
    pub full_at: Option<usize>,
    /// The tier is not ready yet; nothing was stored.
    pub not_ready: bool,
    /// Bytes written.
    pub bytes: u64,
}

impl PutReport {
    /// True when every block of the chain is now stored or was already present.
    pub fn complete(&self) -> bool {
        self.full_at.is_none() && !self.not_ready
    }
}

/// Why a get stopped before the end of the chain.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StopReason {
    /// The tier is not ready yet.
    NotReady,
    /// The block is not in the store (never stored, evicted, or removed).
    Missing,
    /// The block is on disk but no DRAM slot could be freed to load it through.
    NoSpace,
    /// The block kept changing under the copy ([`MAX_RACE_RETRIES`] times).
    Raced,
    /// The block's disk file was missing, truncated or corrupt (dropped, with its chain below).
    BadFile(String),
}

/// Result of a get: `delivered` leading blocks of the chain are in their destinations.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GetReport {
    /// Leading blocks delivered, byte-exact.
    pub delivered: usize,
    /// Of those, read from DRAM directly.
    pub from_dram: usize,
    /// Of those, loaded from disk through DRAM.
    pub from_disk: usize,
    /// Bytes delivered.
    pub bytes: u64,
    /// Copies redone because a block changed under them.
    pub retries: u32,
    /// Why the get stopped early (`None` when every block was delivered). Destinations of
    /// blocks from `delivered` on hold unspecified bytes.
    pub stop: Option<StopReason>,
}

/// One store block's bytes on a PJRT device: `pieces` concatenated in order (e.g. one engine
/// block's K and V rows of every layer).
#[derive(Debug, Clone)]
pub struct DeviceBlock<'a> {
    pieces: Vec<DeviceRange<'a>>,
    len: u64,
}

/// A byte range of a device buffer.
#[derive(Debug, Clone, Copy)]
pub struct DeviceRange<'a> {
    /// The buffer.
    pub buffer: &'a DeviceBuffer,
    /// Byte offset into its on-device bytes.
    pub offset: u64,
    /// Bytes.
    pub len: u64,
}

impl<'a> DeviceBlock<'a> {
    /// A block made of `pieces`, in order.
    pub fn new(pieces: Vec<DeviceRange<'a>>) -> DeviceBlock<'a> {
        let len = pieces.iter().map(|p| p.len).sum();
        DeviceBlock { pieces, len }
    }

    /// Engine block `block` of a rank's per-layer KV buffers `layers` in layout `kv`: for each
    /// layer in order, the block's bytes in each plane (K then V), `num_layers * kv_planes *
    /// kv.block_bytes()` bytes in all.
    ///
    /// Errors: [`Error::BlockRange`] for a block id outside the layout; [`Error::InvalidArgument`]
    /// when the number of buffers is not the layout's layer count.
    pub fn kv_block(
        kv: &KvLayout,
        layers: &'a [DeviceBuffer],
        block: u32,
    ) -> Result<DeviceBlock<'a>> {
        if block >= kv.num_blocks {
            return Err(Error::BlockRange(format!(
                "block {block} outside the layout's {} blocks",
                kv.num_blocks
            )));
        }
        if layers.len() != kv.num_layers as usize {
            return Err(Error::InvalidArgument(format!(
                "{} layer buffers for a layout of {} layers",
                layers.len(),
                kv.num_layers
            )));
        }
        let mut pieces = Vec::with_capacity(layers.len() * kv.kv_planes as usize);
        for b in layers {
            for plane in 0..kv.kv_planes {
                pieces.push(DeviceRange {
                    buffer: b,
                    offset: kv.block_offset(plane, block),
                    len: kv.block_bytes(),
                });
            }
        }
        Ok(DeviceBlock::new(pieces))
    }

    /// Total bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// True when the block has no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The pieces.
    pub fn pieces(&self) -> &[DeviceRange<'a>] {
        &self.pieces
    }

    fn copies(&self, host: *mut u8) -> impl Iterator<Item = RawCopy<'a>> + '_ {
        let mut off = 0u64;
        self.pieces.iter().map(move |p| {
            // SAFETY: `host` points to a slot of at least `self.len` bytes (checked by callers).
            let h = unsafe { host.add(off as usize) };
            off += p.len;
            RawCopy {
                buffer: p.buffer,
                offset: p.offset,
                len: p.len,
                host: h,
            }
        })
    }
}

struct DmaGuard {
    client: Client,
    ptr: *mut u8,
}

// SAFETY: the pointer is only passed back to DmaUnmap; Client is Send + Sync.
unsafe impl Send for DmaGuard {}
// SAFETY: as above.
unsafe impl Sync for DmaGuard {}

impl Drop for DmaGuard {
    fn drop(&mut self) {
        // SAFETY: mapped by us in `Core::build`; the segment is dropped after this guard (field
        // order in `Core`), and no copy is in flight once the last store handle is gone.
        if let Err(e) = unsafe { self.client.dma_unmap(self.ptr) } {
            log::warn!("PJRT_Client_DmaUnmap of the store: {e}");
        }
    }
}

/// A block a get is about to copy out of DRAM.
#[derive(Debug, Clone, Copy)]
struct Item {
    pos: usize,
    id: EntryId,
    slot: u32,
    gen: u64,
    len: u64,
    checksum: u64,
    /// Loaded from disk by this get and pinned until copied.
    promoted: bool,
}

#[derive(Debug)]
enum Halt {
    Stop(StopReason),
    /// Another caller is loading the block from disk.
    Wait,
}

/// A put's block waiting to be written into its slot.
#[derive(Debug, Clone, Copy)]
struct Fill {
    pos: usize,
    id: EntryId,
    key: u128,
    parent: Option<u128>,
    slot: u32,
    tick: u64,
}

// Field order is drop order: unmap DMA before the segment goes.
struct Core {
    _dma: Option<DmaGuard>,
    seg: Segment,
    index: Mutex<Index>,
    disk: Option<DiskTier>,
    info: TierInfo,
    verify: bool,
    hooks: Hooks,
    c: Counters,
    namespace: Namespace,
    observers: observe::Observers,
    events: Option<crate::kv_events::StoreEvents>,
    /// The segment's bytes in the pinned-memory budget (returned after `seg` is unmapped).
    _budget: Option<Reservation>,
}

impl Core {
    fn build(cfg: &StoreConfig, budget: Option<Reservation>) -> Result<Core> {
        let t0 = Instant::now();
        if let Some(h) = &cfg.hooks.before_prepare {
            h(BlockKey(0));
        }
        let geo = Geometry::new(cfg.block_bytes, cfg.capacity_bytes)?;
        let ns = &cfg.namespace;
        if cfg.shm_name.is_none() {
            // A new anonymous segment is pre-faulted: a capacity the machine cannot hold is an
            // error here, not an OOM kill later. (A named segment may already exist in
            // /dev/shm and hold its bytes.)
            crate::budget::check_fits(geo.total_bytes, "the host tier's capacity")?;
        }
        let seg = match &cfg.shm_name {
            Some(n) => Segment::open_shm(&cfg.shm_dir, n, geo, ns, &cfg.memory)?,
            None => Segment::anonymous(geo, ns, &cfg.memory)?,
        };
        let dram = if *seg.attach() == Attach::Attached {
            seg.committed_slots()
        } else {
            Vec::new()
        };
        let (disk, files, disk_cap) = match &cfg.disk {
            Some(o) => {
                let per = disk::FILE_HEADER as u64 + disk::padded(geo.block_bytes);
                let cap = o.capacity_bytes / per;
                if cap == 0 {
                    return Err(Error::InvalidArgument(format!(
                        "disk tier capacity {} B holds no block file of {per} B",
                        o.capacity_bytes
                    )));
                }
                let (t, f) = DiskTier::open(o, ns)?;
                (Some(t), f, Some(cap))
            }
            None => (None, Vec::new(), None),
        };
        let (nd, nf) = (dram.len() as u64, files.len() as u64);
        let mut ix = Index::restore(
            geo.num_slots as u32,
            disk_cap,
            dram.iter()
                .map(|s| (s.slot, s.key, s.parent, s.gen, s.len, s.checksum, s.tick)),
            files
                .iter()
                .map(|f| (f.key, f.parent, f.len, f.checksum, f.tick)),
        );
        for s in ix.drain_invalidated() {
            seg.begin_write(s);
        }
        for k in ix.drain_unlink() {
            if let Some(d) = &disk {
                d.remove(k);
            }
        }
        let events = match &cfg.kv_events {
            None => None,
            Some(ec) => {
                let p = crate::kv_events::KvEventPublisher::start(ec)?;
                let ev =
                    crate::kv_events::StoreEvents::new(p, geo.num_slots + disk_cap.unwrap_or(0));
                // Subscribers learn that this tier starts over, then what it restored.
                ev.all_cleared();
                let restored: Vec<index::Change> = ix
                    .live_ids()
                    .flat_map(|id| {
                        let e = ix.entry(id);
                        let (key, parent) = (e.key, e.parent);
                        let dram = matches!(e.dram, Dram::Present { .. });
                        [(false, dram), (true, e.on_disk)]
                            .into_iter()
                            .filter(|(_, has)| *has)
                            .map(move |(disk, _)| index::Change {
                                key,
                                parent,
                                disk,
                                stored: true,
                            })
                    })
                    .collect();
                ev.publish(&restored);
                ix.record_changes(true);
                Some(ev)
            }
        };
        let (dma, dma_status) = match &cfg.dma_client {
            None => (None, DmaStatus::NotRequested),
            Some(client) => {
                let (p, len) = seg.data_range();
                // SAFETY: the data area stays mapped until the guard (dropped first) unmaps it.
                match unsafe { client.dma_map(p, len) } {
                    Ok(()) => (
                        Some(DmaGuard {
                            client: client.clone(),
                            ptr: p,
                        }),
                        DmaStatus::Mapped(len as u64),
                    ),
                    Err(e) => {
                        log::info!("store DMA map skipped: {e}");
                        (None, DmaStatus::Unavailable(e.to_string()))
                    }
                }
            }
        };
        let info = TierInfo {
            attach: seg.attach().clone(),
            segment: seg.path().map(|p| p.to_path_buf()),
            geometry: geo,
            lock: seg.lock_status().clone(),
            huge_pages: cfg.memory.huge_pages,
            dma: dma_status,
            disk: disk.as_ref().map(|d| {
                (
                    d.dir().to_path_buf(),
                    d.backend().clone(),
                    d.direct(),
                    disk_cap.unwrap_or(0),
                )
            }),
            restored_dram_blocks: ix.dram_blocks().min(nd),
            restored_disk_blocks: ix.disk_blocks().min(nf),
            prepare_secs: t0.elapsed().as_secs_f64(),
        };
        crate::metrics::store_opened(
            match info.attach {
                Attach::Anonymous => crate::metrics::AttachOutcome::Anonymous,
                Attach::Created => crate::metrics::AttachOutcome::Created,
                Attach::Attached => crate::metrics::AttachOutcome::Attached,
                Attach::Reformatted(_) => crate::metrics::AttachOutcome::Reformatted,
            },
            info.restored_dram_blocks,
            info.restored_disk_blocks,
        );
        Ok(Core {
            _dma: dma,
            seg,
            index: Mutex::new(ix),
            disk,
            info,
            verify: cfg.verify_checksums,
            hooks: cfg.hooks.clone(),
            c: Counters::default(),
            namespace: cfg.namespace.clone(),
            observers: observe::Observers::default(),
            events,
            _budget: budget,
        })
    }

    /// Runs `f` on the locked index, then applies what it queued: slots that lost their block are
    /// marked not committed, and dropped disk copies are deleted, before the lock is released.
    fn with_index<R>(&self, f: impl FnOnce(&mut Index) -> R) -> R {
        let mut ix = self.index.lock().unwrap_or_else(PoisonError::into_inner);
        let r = f(&mut ix);
        for s in ix.drain_invalidated() {
            self.seg.begin_write(s);
        }
        let gone = ix.drain_unlink();
        if let Some(d) = &self.disk {
            for k in gone {
                d.remove(k);
            }
        }
        if let Some(ev) = &self.events {
            // Under the index lock: batches leave in the order of the changes.
            ev.publish(&ix.drain_changes());
        }
        if self.observers.active() {
            // Under the index lock, so observers see changes in the order they happened.
            let left: Vec<BlockKey> = ix.drain_gone().into_iter().map(BlockKey).collect();
            self.observers.removed(&left);
        }
        r
    }

    fn slot_aligned(&self) -> bool {
        self.seg.geometry().slot_bytes % 4096 == 0
    }

    /// DRAM slots for the filling entries `ids`, in order, evicting (and spilling) as needed.
    /// Returns `stop`: entries before it got a slot (assigned in the index); the caller must abort
    /// every entry from `stop` on.
    fn acquire_slots(&self, ids: &[EntryId]) -> usize {
        let mut stop = ids.len();
        let mut spills: Vec<(usize, Victim, FileMeta)> = Vec::new();
        self.with_index(|ix| {
            for (j, &id) in ids.iter().enumerate() {
                match ix.take_slot() {
                    Take::Slot { slot, evicted } => {
                        if evicted.is_some() {
                            add(&self.c.evictions, 1);
                            crate::metrics::store_evictions(1);
                        }
                        ix.assign_slot(id, slot);
                    }
                    Take::Spill(v) => {
                        let e = ix.entry(v.id);
                        let m = FileMeta {
                            key: e.key,
                            parent: e.parent,
                            len: e.len,
                            checksum: e.checksum,
                            tick: e.tick,
                        };
                        spills.push((j, v, m));
                    }
                    Take::NoSpace => {
                        stop = j;
                        break;
                    }
                }
            }
        });
        if spills.is_empty() {
            return stop;
        }
        let d = self
            .disk
            .as_ref()
            .expect("spills happen only with a disk tier");
        let items: Vec<WriteItem> = spills
            .iter()
            .map(|(_, v, m)| WriteItem {
                meta: *m,
                data: self.seg.slot_ptr(v.slot),
                aligned: self.slot_aligned(),
            })
            .collect();
        // SAFETY: victims are marked evicting, so no writer touches their slots until
        // `finish_spill` hands them over; slots are page aligned and zero padded when
        // `aligned`.
        let results = unsafe { d.write_blocks(&items) };
        self.with_index(|ix| {
            for ((j, v, _), r) in spills.iter().zip(results) {
                let ok = match r {
                    Ok(()) => {
                        add(&self.c.spills, 1);
                        true
                    }
                    Err(e) => {
                        log::warn!("spilling block {} to disk failed: {e}", BlockKey(v.key));
                        add(&self.c.spill_failures, 1);
                        false
                    }
                };
                crate::metrics::store_spill(ok);
                match ix.finish_spill(*v, ok) {
                    Some(slot) => {
                        add(&self.c.evictions, 1);
                        crate::metrics::store_evictions(1);
                        ix.assign_slot(ids[*j], slot);
                    }
                    None => stop = stop.min(*j),
                }
            }
        });
        stop
    }

    /// Reserves slots for the chain's new blocks. Returns the fills, the number present, the
    /// first full position, and the ids already present (for recency).
    fn reserve(
        &self,
        parent: Option<BlockKey>,
        keys: &[BlockKey],
        window: std::ops::Range<usize>,
    ) -> (Vec<Fill>, PutReport, Vec<(usize, EntryId)>) {
        let mut rep = PutReport::default();
        let mut fills = Vec::new();
        let mut present = Vec::new();
        self.with_index(|ix| {
            let mut p = match window.start {
                0 => parent.map(|k| k.0),
                s => Some(keys[s - 1].0),
            };
            for (pos, k) in keys.iter().enumerate().take(window.end).skip(window.start) {
                match ix.begin_put(k.0, p) {
                    Begin::Present(id) => {
                        rep.present += 1;
                        present.push((pos, id));
                    }
                    Begin::InFlight => rep.present += 1,
                    Begin::Started(id) => fills.push(Fill {
                        pos,
                        id,
                        key: k.0,
                        parent: p,
                        slot: PENDING_SLOT,
                        tick: ix.entry(id).tick,
                    }),
                }
                p = Some(k.0);
            }
        });
        if fills.is_empty() {
            return (fills, rep, present);
        }
        let ids: Vec<EntryId> = fills.iter().map(|f| f.id).collect();
        let stop = self.acquire_slots(&ids);
        self.with_index(|ix| {
            for f in &mut fills {
                if let Dram::Filling { slot } = ix.entry(f.id).dram {
                    f.slot = slot;
                }
            }
            if stop < fills.len() {
                rep.full_at = Some(fills[stop].pos);
                for f in &fills[stop..] {
                    ix.abort_fill(f.id);
                }
            }
        });
        fills.truncate(stop);
        for f in &fills {
            self.seg.begin_write(f.slot);
        }
        (fills, rep, present)
    }

    /// Publishes written fills (checksums in order) and updates recency.
    fn commit_fills(
        &self,
        keys: &[BlockKey],
        fills: &[Fill],
        lens: &[u64],
        sums: &[u64],
        present: &[(usize, EntryId)],
        rep: &mut PutReport,
    ) {
        let aligned = self.slot_aligned();
        let mut gens = Vec::with_capacity(fills.len());
        for (f, &sum) in fills.iter().zip(sums) {
            let len = lens[f.pos];
            if aligned {
                let pad = disk::padded(len) - len;
                // SAFETY: the slot is ours (filling) and holds `slot_bytes >= padded(len)` bytes.
                unsafe {
                    std::ptr::write_bytes(
                        self.seg.slot_ptr(f.slot).add(len as usize),
                        0,
                        pad as usize,
                    )
                };
            }
            gens.push(self.seg.commit(
                f.slot,
                &SlotMeta {
                    key: f.key,
                    parent: f.parent,
                    len,
                    checksum: sum,
                    tick: f.tick,
                },
            ));
        }
        self.with_index(|ix| {
            for ((f, &sum), gen) in fills.iter().zip(sums).zip(gens) {
                ix.commit_fill(f.id, gen, lens[f.pos], sum);
            }
            if self.observers.active() {
                let new: Vec<(BlockKey, Option<BlockKey>)> = fills
                    .iter()
                    .map(|f| (BlockKey(f.key), f.parent.map(BlockKey)))
                    .collect();
                self.observers.stored(&new);
            }
            // Recency in chain order (visible blocks only).
            let mut ids: Vec<(usize, EntryId)> = present
                .iter()
                .copied()
                .chain(fills.iter().map(|f| (f.pos, f.id)))
                .collect();
            ids.sort_unstable();
            let ids: Vec<EntryId> = ids
                .into_iter()
                .filter(|&(pos, id)| {
                    let e = ix.entry(id);
                    e.visible() && e.key == keys[pos].0
                })
                .map(|(_, id)| id)
                .collect();
            ix.touch(&ids);
        });
        rep.stored = fills.len();
        rep.bytes = fills.iter().map(|f| lens[f.pos]).sum();
    }

    /// A put of `chain` in windows of at most half the DRAM slots (so a chain longer than DRAM
    /// can stream through it to the disk tier): reserve slots, `fill` them (returning each
    /// block's checksum), commit. A fill error aborts the window's blocks (earlier windows stay
    /// stored) and is returned.
    fn put_chain(
        &self,
        parent: Option<BlockKey>,
        chain: &[BlockKey],
        lens: &[u64],
        mut fill: impl FnMut(&Core, &[Fill]) -> Result<Vec<u64>>,
    ) -> Result<PutReport> {
        let w = (self.seg.geometry().num_slots as usize / 2).max(1);
        let mut total = PutReport::default();
        let mut start = 0;
        let result = loop {
            if start >= chain.len() {
                break Ok(());
            }
            let end = (start + w).min(chain.len());
            let (fills, mut rep, present) = self.reserve(parent, chain, start..end);
            // A copy that panics (a device layer bug, a caller's callback) must not leave the
            // window's slots reserved and its keys "being stored" forever: abort on unwind.
            let guard = AbortFills {
                core: self,
                fills: &fills,
            };
            let r = fill(self, &fills);
            std::mem::forget(guard);
            let sums = match r {
                Ok(s) => s,
                Err(e) => {
                    self.abort_fills(&fills);
                    break Err(e);
                }
            };
            self.commit_fills(chain, &fills, lens, &sums, &present, &mut rep);
            total.stored += rep.stored;
            total.present += rep.present;
            total.bytes += rep.bytes;
            if rep.full_at.is_some() {
                total.full_at = rep.full_at;
                break Ok(());
            }
            start = end;
        };
        add(&self.c.put_blocks, total.stored as u64);
        add(&self.c.put_present, total.present as u64);
        add(&self.c.bytes_put, total.bytes);
        let full = total.full_at.map_or(0, |f| (chain.len() - f) as u64);
        add(&self.c.put_full, full);
        crate::metrics::store_put(total.stored as u64, total.present as u64, full, total.bytes);
        result.map(|()| total)
    }

    fn abort_fills(&self, fills: &[Fill]) {
        self.with_index(|ix| {
            for f in fills {
                ix.abort_fill(f.id);
            }
        });
    }

    /// Resolves the next window of a get from chain position `from`: the DRAM blocks to copy,
    /// loading disk blocks into DRAM first (pinned until the caller unpins them).
    fn resolve(&self, keys: &[BlockKey], from: usize, done: &[u8]) -> (Vec<Item>, Option<Halt>) {
        let max_promote = (self.seg.geometry().num_slots as usize / 4).max(1);
        let mut items: Vec<Item> = Vec::new();
        let mut halt = None;
        let mut promote: Vec<usize> = Vec::new();
        self.with_index(|ix| {
            let mut touched = Vec::new();
            for (pos, k) in keys.iter().enumerate().skip(from) {
                if done[pos] != 0 {
                    continue;
                }
                let Some(id) = ix.find(k.0) else {
                    halt = Some(Halt::Stop(StopReason::Missing));
                    break;
                };
                let e = ix.entry(id);
                if !e.visible() {
                    halt = Some(Halt::Stop(StopReason::Missing));
                    break;
                }
                let (len, checksum) = (e.len, e.checksum);
                match e.dram {
                    Dram::Present { slot, gen } => items.push(Item {
                        pos,
                        id,
                        slot,
                        gen,
                        len,
                        checksum,
                        promoted: false,
                    }),
                    Dram::Filling { .. } => {
                        halt = Some(Halt::Wait);
                        break;
                    }
                    Dram::Absent => {
                        if promote.len() == max_promote || !ix.begin_promote(id) {
                            break;
                        }
                        promote.push(items.len());
                        items.push(Item {
                            pos,
                            id,
                            slot: PENDING_SLOT,
                            gen: 0,
                            len,
                            checksum,
                            promoted: true,
                        });
                    }
                }
                touched.push(id);
            }
            ix.touch(&touched);
        });
        if promote.is_empty() {
            return (items, halt);
        }
        let ids: Vec<EntryId> = promote.iter().map(|&j| items[j].id).collect();
        let stop = self.acquire_slots(&ids);
        self.with_index(|ix| {
            for &j in &promote[..stop] {
                if let Dram::Filling { slot } = ix.entry(items[j].id).dram {
                    items[j].slot = slot;
                }
            }
        });
        let reads: Vec<ReadItem> = promote[..stop]
            .iter()
            .map(|&j| {
                let it = &items[j];
                self.seg.begin_write(it.slot);
                ReadItem {
                    key: keys[it.pos].0,
                    len: it.len,
                    checksum: it.checksum,
                    dst: self.seg.slot_ptr(it.slot),
                    aligned: self.slot_aligned(),
                }
            })
            .collect();
        let d = self
            .disk
            .as_ref()
            .expect("disk-only blocks exist only with a disk tier");
        // SAFETY: the slots are filling (ours alone to write) and hold `slot_bytes` bytes.
        let results = unsafe { d.read_blocks(&reads) };
        // Window end: the first promotion that failed (items after it are not delivered).
        let mut cut = items.len();
        self.with_index(|ix| {
            for (n, &j) in promote.iter().enumerate() {
                let it = &mut items[j];
                let r = if n < stop { Some(&results[n]) } else { None };
                match r {
                    Some(Ok(())) => {
                        let gen = self.seg.commit(
                            it.slot,
                            &SlotMeta {
                                key: keys[it.pos].0,
                                parent: ix.entry(it.id).parent,
                                len: it.len,
                                checksum: it.checksum,
                                tick: ix.entry(it.id).tick,
                            },
                        );
                        it.gen = gen;
                        if j < cut {
                            // Keep it until copied out.
                            ix.pin(it.id);
                        } else {
                            it.promoted = false;
                        }
                        ix.commit_fill(it.id, gen, it.len, it.checksum);
                    }
                    None => {
                        ix.abort_fill(it.id);
                        if j < cut {
                            cut = j;
                            halt = Some(Halt::Stop(StopReason::NoSpace));
                        }
                        it.promoted = false;
                    }
                    Some(Err(miss)) => {
                        add(&self.c.bad_files, 1);
                        ix.abort_fill(it.id);
                        ix.drop_entry(it.id);
                        if j < cut {
                            cut = j;
                            halt = Some(Halt::Stop(StopReason::BadFile(miss.to_string())));
                        }
                        it.promoted = false;
                    }
                }
            }
        });
        items.truncate(cut);
        (items, halt)
    }

    fn unpin_items(&self, items: &[Item]) {
        if items.iter().any(|i| i.promoted) {
            self.with_index(|ix| {
                for it in items.iter().filter(|i| i.promoted) {
                    ix.unpin(it.id);
                }
            });
        }
    }

    /// Drops a block whose DRAM copy failed its checksum; the error to return.
    fn corrupt(&self, keys: &[BlockKey], it: &Item, delivered: usize) -> Error {
        add(&self.c.corrupt_blocks, 1);
        crate::metrics::checksum_failure(crate::metrics::ChecksumSource::Store);
        self.with_index(|ix| {
            if ix.find(keys[it.pos].0) == Some(it.id) {
                ix.drop_entry(it.id);
            }
        });
        log::error!(
            "store block {} (chain position {}) failed its checksum; dropped",
            keys[it.pos],
            it.pos
        );
        Error::Checksum(format!(
            "stored block {} at chain position {} failed its xxh3 checksum and was dropped (with \
             its chain below it); {delivered} leading blocks were delivered",
            keys[it.pos], it.pos
        ))
    }

    /// The get loop shared by host and device destinations. `copy` delivers a set of items (all
    /// in DRAM) and returns how many leading ones are valid, and whether the next one changed
    /// under the copy.
    ///
    /// First every block of the chain's present prefix that is already in DRAM is delivered in
    /// one pass (before loading disk blocks through DRAM can push them out); then the rest, in
    /// windows, loading disk blocks first. The report counts the leading blocks delivered.
    fn get_loop(
        &self,
        keys: &[BlockKey],
        mut copy: impl FnMut(&Core, &[Item]) -> Result<(usize, bool)>,
    ) -> Result<GetReport> {
        let n = keys.len();
        let mut rep = GetReport::default();
        // Per position: 0 not delivered, 1 delivered from DRAM, 2 loaded from disk.
        let mut done = vec![0u8; n];
        let mut lens = vec![0u64; n];
        let mut stop: Option<(usize, StopReason)> = None;
        // The chain's present prefix becomes the most recently used, and its disk-only blocks are
        // pinned until delivered, so loading early blocks through DRAM cannot push later blocks
        // of the same chain out of the store. DRAM blocks are not pinned: they are read
        // optimistically (generation check) and re-read if they changed.
        let mut first: Vec<Item> = Vec::new();
        let mut held = DiskPins {
            core: self,
            ids: self.with_index(|ix| {
                let mut ids = Vec::new();
                let mut held = Vec::new();
                for (pos, k) in keys.iter().enumerate() {
                    match ix.find(k.0) {
                        Some(id) if ix.entry(id).visible() => {
                            ids.push(id);
                            let e = ix.entry(id);
                            match e.dram {
                                Dram::Present { slot, gen } => first.push(Item {
                                    pos,
                                    id,
                                    slot,
                                    gen,
                                    len: e.len,
                                    checksum: e.checksum,
                                    promoted: false,
                                }),
                                Dram::Absent => {
                                    ix.pin(id);
                                    held.push((pos, id));
                                }
                                Dram::Filling { .. } => {}
                            }
                        }
                        _ => break,
                    }
                }
                ix.touch(&ids);
                held
            }),
        };
        if !first.is_empty() {
            let (ok, raced) = copy(self, &first)?;
            for it in &first[..ok] {
                done[it.pos] = 1;
                lens[it.pos] = it.len;
            }
            if raced {
                add(&self.c.races, 1);
                rep.retries += 1;
            }
        }
        let mut retries_here = 0;
        let mut waited = Duration::ZERO;
        while let Some(from) = done.iter().position(|&d| d == 0) {
            // Blocks already delivered no longer need their pin (they may now leave DRAM).
            held.release_before(from);
            let (items, halt) = self.resolve(keys, from, &done);
            let r = if items.is_empty() {
                Ok((0, false))
            } else {
                // Promoted blocks are pinned until copied, also when the copy panics.
                let guard = UnpinItems {
                    core: self,
                    items: &items,
                };
                let r = copy(self, &items);
                std::mem::forget(guard);
                r
            };
            self.unpin_items(&items);
            let (ok, raced) = r?;
            for it in &items[..ok] {
                done[it.pos] = if it.promoted { 2 } else { 1 };
                lens[it.pos] = it.len;
            }
            if ok > 0 {
                retries_here = 0;
            }
            if raced {
                add(&self.c.races, 1);
                rep.retries += 1;
                retries_here += 1;
                if retries_here > MAX_RACE_RETRIES {
                    stop = Some((items[ok].pos, StopReason::Raced));
                    break;
                }
                continue;
            }
            // Where resolution stopped: the first position after the window not delivered.
            let at = done.iter().position(|&d| d == 0).unwrap_or(n);
            match halt {
                None if items.is_empty() => {
                    stop = Some((at, StopReason::NoSpace));
                    break;
                }
                None => {}
                Some(Halt::Stop(s)) => {
                    stop = Some((at, s));
                    break;
                }
                Some(Halt::Wait) if items.is_empty() => {
                    if waited > FILL_WAIT {
                        stop = Some((at, StopReason::Missing));
                        break;
                    }
                    let d = Duration::from_micros(200);
                    std::thread::sleep(d);
                    waited += d;
                }
                Some(Halt::Wait) => {}
            }
        }
        drop(held);
        rep.delivered = done.iter().position(|&d| d == 0).unwrap_or(n);
        for &d in &done[..rep.delivered] {
            if d == 2 {
                rep.from_disk += 1;
            } else {
                rep.from_dram += 1;
            }
        }
        rep.bytes = lens[..rep.delivered].iter().sum();
        if rep.delivered < n {
            rep.stop = Some(
                stop.filter(|(at, _)| *at <= rep.delivered)
                    .map(|(_, s)| s)
                    .unwrap_or(StopReason::Missing),
            );
        }
        add(&self.c.get_dram, rep.from_dram as u64);
        add(&self.c.get_disk, rep.from_disk as u64);
        add(&self.c.bytes_got, rep.bytes);
        crate::metrics::store_get(rep.from_dram as u64, rep.from_disk as u64, rep.bytes);
        Ok(rep)
    }
}

/// Aborts a put window's reserved slots if the copy into them unwinds.
struct AbortFills<'a> {
    core: &'a Core,
    fills: &'a [Fill],
}

impl Drop for AbortFills<'_> {
    fn drop(&mut self) {
        self.core.abort_fills(self.fills);
    }
}

/// Unpins a get window's promoted blocks if the copy out of them unwinds.
struct UnpinItems<'a> {
    core: &'a Core,
    items: &'a [Item],
}

impl Drop for UnpinItems<'_> {
    fn drop(&mut self) {
        self.core.unpin_items(self.items);
    }
}

/// Pins a get holds on a chain's disk-only blocks `(chain position, entry)`, in chain order;
/// released as the get delivers them, and on drop (also on early returns).
struct DiskPins<'a> {
    core: &'a Core,
    ids: Vec<(usize, EntryId)>,
}

impl DiskPins<'_> {
    fn release_before(&mut self, pos: usize) {
        let n = self.ids.partition_point(|&(p, _)| p < pos);
        if n > 0 {
            let gone: Vec<(usize, EntryId)> = self.ids.drain(..n).collect();
            self.core.with_index(|ix| {
                for (_, id) in gone {
                    ix.unpin(id);
                }
            });
        }
    }
}

impl Drop for DiskPins<'_> {
    fn drop(&mut self) {
        self.release_before(usize::MAX);
    }
}

struct Shared {
    core: OnceLock<std::result::Result<Core, String>>,
    ready: (Mutex<()>, Condvar),
}

impl crate::metrics::Source for Shared {
    fn sample(&self, s: &mut crate::metrics::Sample) {
        let Some(Ok(c)) = self.core.get() else {
            return;
        };
        let (dram, disk) = c.with_index(|ix| (ix.dram_blocks(), ix.disk_blocks()));
        s.store_blocks[0] += dram;
        s.store_blocks[1] += disk;
        s.store_capacity_blocks[0] += c.seg.geometry().num_slots;
        s.store_capacity_blocks[1] += c.info.disk.as_ref().map_or(0, |d| d.3);
        s.store_leased_blocks += rd(&c.c.leased);
    }
}

/// The host KV tier (see the module docs). Cheap to clone; `Send + Sync`. When the last
/// handle drops, the tier (its DRAM segment, the segment's lock, its DMA mapping) goes with it,
/// on that thread: a metrics sample that holds the tier for a moment is waited for
/// (`Drop for KvStore`), so a restart right after finds the segment free.
#[derive(Clone)]
pub struct KvStore {
    shared: Arc<Shared>,
    /// Counts the user's handles (clones), apart from the metrics registry's short holds.
    handles: Arc<()>,
}

/// How long the last handle's drop waits for a metrics sample that holds the tier.
const DROP_WAIT_FOR_SAMPLERS: Duration = Duration::from_secs(1);

impl Drop for KvStore {
    fn drop(&mut self) {
        // The metrics registry upgrades its weak reference while it samples the gauges
        // (`metrics::sample`); if the last handle dropped then, the sampler's thread would
        // close the segment later, and a warm restart or `store list` meanwhile would find it
        // in use. So the last handle first takes the tier out of the registry (no sample can
        // reach it after that), then waits (microseconds; bounded) for a sample already holding
        // it to let go. Checking the count alone would leave a window: a sample could take the
        // tier between the check and the drop. Not for a tier still preparing: its thread holds
        // it until it is built.
        if Arc::strong_count(&self.handles) != 1 || self.shared.core.get().is_none() {
            return;
        }
        crate::metrics::unregister_source(Arc::as_ptr(&self.shared) as *const ());
        let until = std::time::Instant::now() + DROP_WAIT_FOR_SAMPLERS;
        while Arc::strong_count(&self.shared) > 1 && std::time::Instant::now() < until {
            std::thread::yield_now();
        }
    }
}

impl std::fmt::Debug for KvStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvStore")
            .field("state", &self.state())
            .finish()
    }
}

fn check_config(cfg: &StoreConfig) -> Result<()> {
    Geometry::new(cfg.block_bytes, cfg.capacity_bytes)?;
    if let Some(n) = &cfg.shm_name {
        shm::validate_name(n)?;
    }
    if let Some(d) = &cfg.disk {
        let per = disk::FILE_HEADER as u64 + disk::padded(cfg.block_bytes);
        if d.capacity_bytes < per {
            return Err(Error::InvalidArgument(format!(
                "disk tier capacity {} B holds no block file of {per} B",
                d.capacity_bytes
            )));
        }
    }
    Ok(())
}

impl KvStore {
    /// Creates the store. With [`StoreConfig::background`] it returns at once and prepares the
    /// tier on a thread (see [`KvStore::state`], [`KvStore::wait_ready`]); otherwise it returns
    /// when the tier is ready.
    ///
    /// Errors: [`Error::InvalidArgument`] for a bad configuration (checked before returning, even
    /// in the background mode); in the foreground mode also everything preparing can fail with:
    /// [`Error::HostMemory`] (mapping), [`Error::Io`] (segment or disk directory unusable, in
    /// use, or owned by someone else).
    pub fn open(cfg: StoreConfig) -> Result<KvStore> {
        check_config(&cfg)?;
        let geo = Geometry::new(cfg.block_bytes, cfg.capacity_bytes)?;
        let budget = cfg
            .staging_budget
            .as_ref()
            .unwrap_or(StagingBudget::process())
            .reserve(
                geo.total_bytes,
                &format!(
                    "host KV tier of {}",
                    crate::util::fmt_bytes(geo.total_bytes)
                ),
                None,
            )?;
        let shared = Arc::new(Shared {
            core: OnceLock::new(),
            ready: (Mutex::new(()), Condvar::new()),
        });
        let weak: std::sync::Weak<dyn crate::metrics::Source> = Arc::downgrade(&shared) as _;
        crate::metrics::register_source(weak);
        if cfg.background {
            let s = shared.clone();
            std::thread::Builder::new()
                .name("tpu-sync-store-prepare".into())
                .spawn(move || {
                    let r = Core::build(&cfg, Some(budget)).map_err(|e| {
                        log::error!("host KV tier failed to prepare: {e}");
                        e.to_string()
                    });
                    let _ = s.core.set(r);
                    let _g = s.ready.0.lock().unwrap_or_else(PoisonError::into_inner);
                    s.ready.1.notify_all();
                })
                .map_err(|e| Error::io("spawn the store preparation thread", e))?;
        } else {
            let core = Core::build(&cfg, Some(budget))?;
            let _ = shared.core.set(Ok(core));
        }
        Ok(KvStore {
            shared,
            handles: Arc::new(()),
        })
    }

    fn core(&self) -> Option<&Core> {
        self.shared.core.get().and_then(|r| r.as_ref().ok())
    }

    /// Whether the tier serves yet.
    pub fn state(&self) -> TierState {
        match self.shared.core.get() {
            None => TierState::Preparing,
            Some(Ok(_)) => TierState::Ready,
            Some(Err(e)) => TierState::Failed(e.clone()),
        }
    }

    /// Waits until the tier is ready.
    ///
    /// Errors: [`Error::Timeout`] after `timeout`; [`Error::HostMemory`] with the reason when
    /// preparing failed.
    pub fn wait_ready(&self, timeout: Duration) -> Result<()> {
        let (m, cv) = &self.shared.ready;
        let g = m.lock().unwrap_or_else(PoisonError::into_inner);
        let _g = cv
            .wait_timeout_while(g, timeout, |_| self.shared.core.get().is_none())
            .unwrap_or_else(PoisonError::into_inner);
        match self.state() {
            TierState::Ready => Ok(()),
            TierState::Preparing => Err(Error::Timeout(format!(
                "host KV tier not ready after {timeout:?}"
            ))),
            TierState::Failed(e) => Err(Error::HostMemory(format!(
                "host KV tier failed to prepare: {e}"
            ))),
        }
    }

    /// How the tier was set up; `None` until ready.
    pub fn info(&self) -> Option<TierInfo> {
        self.core().map(|c| {
            let mut i = c.info.clone();
            if let (Some(d), Some(t)) = (&c.disk, i.disk.as_mut()) {
                // O_DIRECT is dropped at the first file the file system refuses it for.
                t.2 = d.direct();
            }
            i
        })
    }

    /// Counters and occupancy (zeros until ready).
    pub fn stats(&self) -> StoreStats {
        let Some(c) = self.core() else {
            return StoreStats::default();
        };
        let (dram, disk, free) =
            c.with_index(|ix| (ix.dram_blocks(), ix.disk_blocks(), ix.free_slots() as u64));
        StoreStats {
            dram_blocks: dram,
            disk_blocks: disk,
            free_slots: free,
            lookups: rd(&c.c.lookups),
            lookup_blocks: rd(&c.c.lookup_blocks),
            lookup_hits: rd(&c.c.lookup_hits),
            put_blocks: rd(&c.c.put_blocks),
            put_present: rd(&c.c.put_present),
            put_full: rd(&c.c.put_full),
            get_dram: rd(&c.c.get_dram),
            get_disk: rd(&c.c.get_disk),
            evictions: rd(&c.c.evictions),
            spills: rd(&c.c.spills),
            spill_failures: rd(&c.c.spill_failures),
            races: rd(&c.c.races),
            corrupt_blocks: rd(&c.c.corrupt_blocks),
            bad_files: rd(&c.c.bad_files),
            bytes_put: rd(&c.c.bytes_put),
            bytes_got: rd(&c.c.bytes_got),
        }
    }

    /// Largest block in bytes.
    pub fn block_bytes(&self) -> Option<u64> {
        self.core().map(|c| c.seg.geometry().block_bytes)
    }

    /// Number of leading blocks of `chain` present in the store (DRAM or disk). Updates their
    /// recency. 0 while the tier is not ready.
    pub fn lookup(&self, chain: &[BlockKey]) -> usize {
        self.lookup_detail(chain).hits
    }

    /// Like [`KvStore::lookup`], also saying how many of the hits are in DRAM and how many on disk
    /// only.
    pub fn lookup_detail(&self, chain: &[BlockKey]) -> index::LookupCount {
        let Some(c) = self.core() else {
            return index::LookupCount::default();
        };
        let raw: Vec<u128> = chain.iter().map(|k| k.0).collect();
        let r = c.with_index(|ix| ix.lookup(&raw));
        add(&c.c.lookups, 1);
        add(&c.c.lookup_blocks, chain.len() as u64);
        add(&c.c.lookup_hits, r.hits as u64);
        crate::metrics::store_lookup(
            chain.len() as u64,
            r.in_dram as u64,
            r.disk_only as u64,
            c.disk.is_some(),
        );
        r
    }

    fn check_put(&self, keys: usize, srcs: usize, lens: impl Iterator<Item = u64>) -> Result<()> {
        if keys != srcs {
            return Err(Error::InvalidArgument(format!(
                "{keys} keys but {srcs} blocks to store"
            )));
        }
        if let Some(c) = self.core() {
            let max = c.seg.geometry().block_bytes;
            for (i, l) in lens.enumerate() {
                if l == 0 || l > max {
                    return Err(Error::InvalidArgument(format!(
                        "block {i} is {l} bytes; blocks must be 1..={max} bytes"
                    )));
                }
            }
        }
        Ok(())
    }

    /// Stores a chain of blocks from host memory: `blocks[i]` is the block of `chain[i]`, whose
    /// parent is `chain[i-1]` (and `parent` for `chain[0]`; `None` for a chain's first block or
    /// when unknown). Blocks already present are not written again.
    ///
    /// Errors: [`Error::InvalidArgument`] when the counts differ or a block is empty or larger than
    /// the block size. A lack of room is not an error: see [`PutReport::full_at`].
    pub fn put_from_host(
        &self,
        parent: Option<BlockKey>,
        chain: &[BlockKey],
        blocks: &[&[u8]],
    ) -> Result<PutReport> {
        self.check_put(
            chain.len(),
            blocks.len(),
            blocks.iter().map(|b| b.len() as u64),
        )?;
        let Some(c) = self.core() else {
            return Ok(PutReport {
                not_ready: true,
                ..PutReport::default()
            });
        };
        let lens: Vec<u64> = blocks.iter().map(|b| b.len() as u64).collect();
        c.put_chain(parent, chain, &lens, |c, fills| {
            let mut sums = Vec::with_capacity(fills.len());
            for f in fills {
                let src = blocks[f.pos];
                let hook = c.hooks.mid_write.as_ref().map(|h| {
                    let h = h.clone();
                    let k = BlockKey(f.key);
                    move || h(k)
                });
                // SAFETY: the slot is ours (filling) and at least `block_bytes >= src.len()`
                // long; `src` is a live slice that cannot overlap our slot's mapping.
                let sum = unsafe {
                    checksum::copy_and_checksum(
                        src.as_ptr(),
                        c.seg.slot_ptr(f.slot),
                        src.len(),
                        hook.as_ref().map(|h| h as &(dyn Fn() + Send + Sync)),
                    )
                };
                sums.push(sum);
            }
            Ok(sums)
        })
    }

    /// Stores a chain of blocks from PJRT device memory (`PJRT_Buffer_CopyRawToHost` of every
    /// piece, issued together): `blocks[i]` is the block of `chain[i]` (see
    /// [`KvStore::put_from_host`] for `parent` and the result).
    ///
    /// Errors: as [`KvStore::put_from_host`], plus the device layer's errors (ranges outside a
    /// buffer, deleted buffers, plugin errors). A chain longer than half the DRAM slots is stored
    /// in windows; on a device error the failing window's blocks are not stored (earlier
    /// windows' are).
    pub fn put_from_device(
        &self,
        parent: Option<BlockKey>,
        chain: &[BlockKey],
        blocks: &[DeviceBlock<'_>],
    ) -> Result<PutReport> {
        self.check_put(chain.len(), blocks.len(), blocks.iter().map(|b| b.len()))?;
        let Some(c) = self.core() else {
            return Ok(PutReport {
                not_ready: true,
                ..PutReport::default()
            });
        };
        let lens: Vec<u64> = blocks.iter().map(|b| b.len()).collect();
        c.put_chain(parent, chain, &lens, |c, fills| {
            let ops: Vec<RawCopy<'_>> = fills
                .iter()
                .flat_map(|f| blocks[f.pos].copies(c.seg.slot_ptr(f.slot)))
                .collect();
            // SAFETY: every op writes inside a slot we own (filling) of at least the block's
            // length; nobody else writes those slots until we commit or abort.
            unsafe { device::d2h_batch(&ops, D2H_OUTSTANDING) }?;
            let mut sums = Vec::with_capacity(fills.len());
            for f in fills {
                if let Some(h) = &c.hooks.mid_write {
                    h(BlockKey(f.key));
                }
                // SAFETY: our slot, just written by the device copies; `len` <= slot size.
                let data = unsafe {
                    std::slice::from_raw_parts(c.seg.slot_ptr(f.slot), lens[f.pos] as usize)
                };
                sums.push(checksum::checksum(data));
            }
            Ok(sums)
        })
    }

    /// Copies the leading blocks of `chain` into host memory: `dst[i]` receives block `chain[i]`
    /// and must be exactly as long as it was stored. Disk-only blocks are loaded into DRAM first.
    /// Stops at the first block that is missing (see [`GetReport::stop`]).
    ///
    /// Errors: [`Error::InvalidArgument`] when the counts differ or a destination has the wrong
    /// length; [`Error::Checksum`] when a block's stored bytes fail their checksum (the block and
    /// its chain below it are dropped).
    pub fn get_to_host(&self, chain: &[BlockKey], dst: &mut [&mut [u8]]) -> Result<GetReport> {
        if chain.len() != dst.len() {
            return Err(Error::InvalidArgument(format!(
                "{} keys but {} destinations",
                chain.len(),
                dst.len()
            )));
        }
        let Some(c) = self.core() else {
            return Ok(GetReport {
                stop: (!chain.is_empty()).then_some(StopReason::NotReady),
                ..GetReport::default()
            });
        };
        c.get_loop(chain, |c, items| {
            for (n, it) in items.iter().enumerate() {
                let d = &mut dst[it.pos];
                if d.len() as u64 != it.len {
                    return Err(Error::InvalidArgument(format!(
                        "destination {} is {} bytes, block {} holds {}",
                        it.pos,
                        d.len(),
                        chain[it.pos],
                        it.len
                    )));
                }
                let hook = c.hooks.mid_read.as_ref().map(|h| {
                    let h = h.clone();
                    let k = chain[it.pos];
                    move || h(k)
                });
                let copy = if c.verify {
                    checksum::copy_and_checksum
                } else {
                    checksum::copy_only
                };
                // SAFETY: the slot lies in the mapping; it may be rewritten concurrently (torn
                // bytes are caught by the generation check below); `d` is exclusively ours.
                let sum = unsafe {
                    copy(
                        c.seg.slot_ptr(it.slot),
                        d.as_mut_ptr(),
                        d.len(),
                        hook.as_ref().map(|h| h as &(dyn Fn() + Send + Sync)),
                    )
                };
                if !c.seg.still(it.slot, it.gen) {
                    return Ok((n, true));
                }
                if c.verify && sum != it.checksum {
                    return Err(c.corrupt(chain, it, it.pos));
                }
            }
            Ok((items.len(), false))
        })
    }

    /// Copies the leading blocks of `chain` into existing device blocks in place (by the path
    /// `caps` probed): `dst[i]` receives block `chain[i]` and must be exactly as long as it was
    /// stored. Checksums are verified on the DRAM copy before the device copy; a block that
    /// changed during the device copy is copied again. Stops at the first missing block.
    ///
    /// Errors: as [`KvStore::get_to_host`], plus the device layer's errors ([`Error::Unsupported`]
    /// without an in-place H2D path). On an error, destination blocks from the failing one on
    /// hold unspecified bytes.
    pub fn get_to_device(
        &self,
        caps: &Capabilities,
        chain: &[BlockKey],
        dst: &[DeviceBlock<'_>],
    ) -> Result<GetReport> {
        if chain.len() != dst.len() {
            return Err(Error::InvalidArgument(format!(
                "{} keys but {} destinations",
                chain.len(),
                dst.len()
            )));
        }
        caps.require_h2d()?;
        let Some(c) = self.core() else {
            return Ok(GetReport {
                stop: (!chain.is_empty()).then_some(StopReason::NotReady),
                ..GetReport::default()
            });
        };
        c.get_loop(chain, |c, items| {
            let mut n_ok = items.len();
            let mut raced = false;
            for (n, it) in items.iter().enumerate() {
                if dst[it.pos].len() != it.len {
                    return Err(Error::InvalidArgument(format!(
                        "destination {} is {} bytes, block {} holds {}",
                        it.pos,
                        dst[it.pos].len(),
                        chain[it.pos],
                        it.len
                    )));
                }
                if c.verify {
                    // SAFETY: inside the mapping; concurrent rewrites are caught below.
                    let sum =
                        unsafe { checksum::checksum_raw(c.seg.slot_ptr(it.slot), it.len as usize) };
                    if !c.seg.still(it.slot, it.gen) {
                        (n_ok, raced) = (n, true);
                        break;
                    }
                    if sum != it.checksum {
                        return Err(c.corrupt(chain, it, it.pos));
                    }
                }
            }
            let ops: Vec<RawCopy<'_>> = items[..n_ok]
                .iter()
                .flat_map(|it| dst[it.pos].copies(c.seg.slot_ptr(it.slot)))
                .collect();
            // SAFETY: sources are slots inside the mapping, at least the block length long; a
            // concurrent rewrite is detected by the generation check after the copy.
            unsafe { device::h2d_batch(caps, &ops) }?;
            if let Some(n) = items[..n_ok]
                .iter()
                .position(|it| !c.seg.still(it.slot, it.gen))
            {
                return Ok((n, true));
            }
            Ok((n_ok, raced))
        })
    }

    /// Pins the leading present blocks of `chain` (see [`Lease`]) and updates their recency.
    /// While the lease lives they are never evicted, so a get of them cannot race an eviction.
    /// Empty while the tier is not ready.
    pub fn pin(&self, chain: &[BlockKey]) -> Lease {
        let mut ids = Vec::new();
        if let Some(c) = self.core() {
            c.with_index(|ix| {
                for k in chain {
                    match ix.find(k.0) {
                        Some(id) if ix.entry(id).visible() => {
                            ix.pin(id);
                            ids.push(id);
                        }
                        _ => break,
                    }
                }
                ix.touch(&ids);
            });
            add(&c.c.leased, ids.len() as u64);
        }
        Lease {
            store: self.clone(),
            keys: chain[..ids.len()].to_vec(),
            ids,
        }
    }

    /// Releases a lease (the same as dropping it).
    pub fn unpin(&self, lease: Lease) {
        drop(lease);
    }

    /// Removes blocks by key, each with every block of its chain below it (so no suffix is left
    /// without its prefix). A key whose chain below it holds a pinned or in-flight block is left
    /// alone. Returns the number of blocks removed.
    pub fn remove(&self, chain: &[BlockKey]) -> usize {
        let Some(c) = self.core() else {
            return 0;
        };
        let raw: Vec<u128> = chain.iter().map(|k| k.0).collect();
        c.with_index(|ix| ix.remove(&raw)).keys.len()
    }

    /// Removes every block that is not pinned, in flight, or a prefix of one. Returns the number
    /// removed.
    pub fn clear(&self) -> usize {
        self.core()
            .map(|c| {
                c.with_index(|ix| {
                    let n = ix.clear().keys.len();
                    if ix.is_empty() {
                        if let Some(ev) = &c.events {
                            ev.publish(&ix.drain_changes());
                            ev.all_cleared();
                        }
                    }
                    n
                })
            })
            .unwrap_or(0)
    }

    /// Describes blocks for the tier's KV events ([`StoreConfig::kv_events`]): `descs[i]` (the
    /// engine's hash and token ids) is published for `chain[i]` in the events of its copies from
    /// now on. Call it before storing the blocks; a description is forgotten when the block has
    /// no copy left. Does nothing when events are off or the tier is not ready.
    ///
    /// Errors: [`Error::InvalidArgument`] when the counts differ.
    pub fn describe_blocks(
        &self,
        chain: &[BlockKey],
        descs: &[crate::kv_events::BlockDesc],
    ) -> Result<()> {
        if chain.len() != descs.len() {
            return Err(Error::InvalidArgument(format!(
                "{} keys but {} block descriptions",
                chain.len(),
                descs.len()
            )));
        }
        if let Some(ev) = self.core().and_then(|c| c.events.as_ref()) {
            let raw: Vec<u128> = chain.iter().map(|k| k.0).collect();
            ev.describe(&raw, descs);
        }
        Ok(())
    }

    /// The KV events PUB and replay endpoints bound (`tcp://IP:PORT`), when events are on and the
    /// tier is ready.
    pub fn kv_events_endpoints(&self) -> Option<(String, Option<String>)> {
        let ev = self.core()?.events.as_ref()?;
        Some((
            ev.publisher.endpoint().to_string(),
            ev.publisher.replay_endpoint().map(str::to_string),
        ))
    }

    /// Writes every DRAM block without a disk copy to the disk tier (e.g. before a shutdown
    /// without a shm segment). Returns the number written.
    ///
    /// Errors: [`Error::InvalidArgument`] without a disk tier; [`Error::Io`] for the first block
    /// that could not be written (the others are still written).
    pub fn flush_to_disk(&self) -> Result<usize> {
        let Some(c) = self.core() else {
            return Ok(0);
        };
        let Some(d) = &c.disk else {
            return Err(Error::InvalidArgument(
                "flush_to_disk: no disk tier configured".into(),
            ));
        };
        let mut todo: Vec<(EntryId, u32, FileMeta)> = Vec::new();
        c.with_index(|ix| {
            let ids: Vec<EntryId> = ix.live_ids().collect();
            for id in ids {
                let e = ix.entry(id);
                if let Dram::Present { slot, .. } = e.dram {
                    if !e.on_disk && !e.corrupt && !e.evicting {
                        let m = FileMeta {
                            key: e.key,
                            parent: e.parent,
                            len: e.len,
                            checksum: e.checksum,
                            tick: e.tick,
                        };
                        ix.pin(id);
                        todo.push((id, slot, m));
                    }
                }
            }
        });
        let items: Vec<WriteItem> = todo
            .iter()
            .map(|&(_, slot, meta)| WriteItem {
                meta,
                data: c.seg.slot_ptr(slot),
                aligned: c.slot_aligned(),
            })
            .collect();
        // SAFETY: the blocks are pinned, so their slots are not rewritten during the writes.
        let results = unsafe { d.write_blocks(&items) };
        let mut first_err = None;
        let mut written = 0;
        c.with_index(|ix| {
            for ((id, _, m), r) in todo.iter().zip(results) {
                match r {
                    Ok(()) => {
                        if ix.add_disk_copy(*id) {
                            written += 1;
                        } else {
                            d.remove(m.key);
                        }
                    }
                    Err(e) => {
                        first_err.get_or_insert(e);
                    }
                }
                ix.unpin(*id);
            }
        });
        match first_err {
            Some(e) => Err(e),
            None => Ok(written),
        }
    }

    /// Disk tier files opened buffered because the file system refused `O_DIRECT` (0 without a
    /// disk tier).
    pub fn disk_direct_fallbacks(&self) -> u64 {
        self.core()
            .and_then(|c| c.disk.as_ref().map(|d| d.direct_fallbacks()))
            .unwrap_or(0)
    }

    /// The namespace the store was opened with.
    pub fn namespace(&self) -> Option<&Namespace> {
        self.core().map(|c| &c.namespace)
    }

    /// Registers `observer` (see [`observe`]) and returns its id with a snapshot of the blocks
    /// present now, `(key, parent)` in no particular order: taken under the same lock as the
    /// registration, so snapshot plus later calls describe the store's contents exactly. The
    /// observer is called under the store's index lock: it must be quick and must not call into
    /// the store.
    ///
    /// Errors: [`Error::InvalidArgument`] while the tier is not ready (see [`KvStore::state`]).
    pub fn observe(
        &self,
        observer: std::sync::Arc<dyn StoreObserver>,
    ) -> Result<(ObserverId, Vec<ObservedBlock>)> {
        let Some(c) = self.core() else {
            return Err(Error::InvalidArgument(format!(
                "observe: the host KV tier is not ready ({:?})",
                self.state()
            )));
        };
        Ok(c.with_index(|ix| {
            ix.track_gone();
            let snap = ix
                .visible_keys()
                .into_iter()
                .map(|(k, p)| (BlockKey(k), p.map(BlockKey)))
                .collect();
            (c.observers.add(observer), snap)
        }))
    }

    /// Unregisters an observer; false when `id` was not registered. After it returns, the
    /// observer is not called again.
    pub fn unobserve(&self, id: ObserverId) -> bool {
        self.core().is_some_and(|c| c.observers.remove(id))
    }

    /// Byte offset of `key`'s DRAM copy in the segment (and in its `/dev/shm` file), for tests
    /// that corrupt a block on purpose.
    #[doc(hidden)]
    pub fn debug_slot_offset(&self, key: BlockKey) -> Option<u64> {
        let c = self.core()?;
        c.with_index(|ix| match ix.find(key.0).map(|id| ix.entry(id).dram) {
            Some(Dram::Present { slot, .. }) => Some(c.seg.slot_offset(slot)),
            _ => None,
        })
    }

    /// Address of `key`'s DRAM copy, for tests that corrupt a block on purpose.
    #[doc(hidden)]
    pub fn debug_slot_ptr(&self, key: BlockKey) -> Option<*mut u8> {
        let c = self.core()?;
        c.with_index(|ix| match ix.find(key.0).map(|id| ix.entry(id).dram) {
            Some(Dram::Present { slot, .. }) => Some(c.seg.slot_ptr(slot)),
            _ => None,
        })
    }

    /// Path of `key`'s disk file, for tests.
    #[doc(hidden)]
    pub fn debug_file_path(&self, key: BlockKey) -> Option<PathBuf> {
        let c = self.core()?;
        c.disk.as_ref().map(|d| d.file_path(key.0))
    }

    /// Checks the index's internal consistency, for tests.
    #[doc(hidden)]
    pub fn debug_check(&self) -> std::result::Result<(), String> {
        match self.core() {
            Some(c) => c.with_index(|ix| ix.check_invariants()),
            None => Ok(()),
        }
    }
}

/// A pin on leading blocks of a chain: they are never evicted while it lives. Released on drop
/// (or [`KvStore::unpin`]). `Send + Sync`.
pub struct Lease {
    store: KvStore,
    keys: Vec<BlockKey>,
    ids: Vec<EntryId>,
}

impl std::fmt::Debug for Lease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lease")
            .field("blocks", &self.ids.len())
            .finish()
    }
}

impl Lease {
    /// Number of leading blocks pinned.
    pub fn len(&self) -> usize {
        self.ids.len()
    }

    /// True when nothing is pinned.
    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }

    /// The pinned keys (a prefix of the chain given to [`KvStore::pin`]).
    pub fn keys(&self) -> &[BlockKey] {
        &self.keys
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        if self.ids.is_empty() {
            return;
        }
        if let Some(c) = self.store.core() {
            c.with_index(|ix| {
                for &id in &self.ids {
                    ix.unpin(id);
                }
            });
            c.c.leased
                .fetch_sub(self.ids.len() as u64, std::sync::atomic::Ordering::Relaxed);
        }
    }
}
