//! DMA pacing and the copy engine that issues every chunk of every batch.
//!
//! A [`Pacer`] owns one issuer thread (`tpu-sync-dma`). Batches submitted to it
//! ([`CopyBatch::submit`](super::CopyBatch::submit)) queue in FIFO order; the issuer splits each
//! batch's copies into chunks of at most `chunk_bytes` and issues them in order while the bytes
//! in flight stay within `max_inflight_bytes`. A later batch starts only when every chunk of the
//! earlier ones has been issued (FIFO across callers). This is the pacing production TPU DMA
//! needs: Google's TPU Sync issues raw copies in 16 MiB pieces with at most 64 MiB outstanding
//! per process, FIFO, so that one large transfer does not flood the in-order DMA queue
//! (`set_dma_pacing`, `docs/plugins-and-engines.md`, "TPU DMA pacing defaults"). Those are the
//! defaults here.
//!
//! Completion arrives through `PJRT_Event_OnReady` callbacks, which run either inline (inside
//! the `OnReady` call on the issuer thread, when the event is already ready) or on a plugin
//! worker thread. A callback only updates atomics, records the first error under a lock that is
//! never held across a PJRT call, and unparks the issuer; it never blocks, never calls into the
//! plugin and never drops a PJRT object. Everything a batch holds (external references, raw
//! aliases, events, buffer handles) is released on the issuer thread, and only then is the
//! batch's handle completed, so an adopted buffer may be destroyed by its owner as soon as the
//! handle reports completion.
//!
//! In-place H2D and D2H on host-addressable device memory (the XLA CPU plugin) are a `memcpy`,
//! not a PJRT call: those chunks run on a small pool of `tpu-sync-h2d-N` threads under the same
//! pacing, handed over in groups of up to [`HOST_GROUP_BYTES`] (a hand-over wakes a thread, which
//! costs more than copying one 32 KiB block).
//!
//! Thread-safety: [`Pacer`] is `Send + Sync` and cheap to clone; [`Pacer::global`] is the
//! process-wide instance that the blocking helpers use.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::thread::{self, Thread};
use std::time::Duration;

use crossbeam_channel::{Receiver, Sender, TryRecvError};

use super::batch::{BatchShared, BufState, CopyError, Job, JobKind};
use crate::error::{Error, Result};
use crate::pjrt::Event;

/// Default largest chunk, in bytes (16 MiB, as TPU Sync's `set_dma_pacing` default).
pub const DEFAULT_CHUNK_BYTES: u64 = 16 << 20;
/// Default most bytes in flight per pacer, in bytes (64 MiB, as TPU Sync's default).
pub const DEFAULT_MAX_INFLIGHT_BYTES: u64 = 64 << 20;
/// Environment variable overriding the global pacer's chunk size (bytes; `<= 0` disables).
pub const ENV_CHUNK_BYTES: &str = "TPU_SYNC_DMA_CHUNK_BYTES";
/// Environment variable overriding the global pacer's in-flight limit (bytes; `<= 0` disables).
pub const ENV_MAX_INFLIGHT_BYTES: &str = "TPU_SYNC_DMA_MAX_INFLIGHT_BYTES";

/// How copies are paced.
///
/// `0` disables a limit. When both are set, chunks are never larger than `max_inflight_bytes`
/// (a larger `chunk_bytes` is clamped), so the in-flight bound always holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PacingConfig {
    /// Largest single copy issued to the plugin, in bytes (0 = copies are not split).
    pub chunk_bytes: u64,
    /// Most bytes issued but not yet completed at any time, per pacer (0 = unlimited).
    pub max_inflight_bytes: u64,
}

impl Default for PacingConfig {
    fn default() -> Self {
        PacingConfig {
            chunk_bytes: DEFAULT_CHUNK_BYTES,
            max_inflight_bytes: DEFAULT_MAX_INFLIGHT_BYTES,
        }
    }
}

impl PacingConfig {
    /// The defaults overridden by [`ENV_CHUNK_BYTES`] and [`ENV_MAX_INFLIGHT_BYTES`] when set.
    ///
    /// Errors: [`Error::InvalidArgument`] when a variable is set but not an integer.
    pub fn from_env() -> Result<PacingConfig> {
        let mut c = PacingConfig::default();
        let read = |name: &str| -> Result<Option<u64>> {
            match std::env::var(name) {
                Ok(v) if !v.trim().is_empty() => v
                    .trim()
                    .parse::<i64>()
                    .map(|n| Some(n.max(0) as u64))
                    .map_err(|_| {
                        Error::InvalidArgument(format!("{name}={v:?} is not an integer (bytes)"))
                    }),
                _ => Ok(None),
            }
        };
        if let Some(n) = read(ENV_CHUNK_BYTES)? {
            c.chunk_bytes = n;
        }
        if let Some(n) = read(ENV_MAX_INFLIGHT_BYTES)? {
            c.max_inflight_bytes = n;
        }
        Ok(c)
    }

    /// The chunk size actually used: `chunk_bytes`, unlimited when 0, never above a set
    /// `max_inflight_bytes`.
    pub fn effective_chunk_bytes(&self) -> u64 {
        let mut c = if self.chunk_bytes == 0 {
            u64::MAX
        } else {
            self.chunk_bytes
        };
        if self.max_inflight_bytes > 0 {
            c = c.min(self.max_inflight_bytes);
        }
        c
    }
}

/// Counters of one pacer since it was created (bytes and chunks count completed copies).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PacerStats {
    /// Bytes copied by chunks that completed without error.
    pub bytes: u64,
    /// Chunks that completed without error.
    pub chunks: u64,
    /// Batches completed (successfully or not).
    pub batches: u64,
    /// Batches that completed with an error or were cancelled.
    pub failed_batches: u64,
    /// Of `batches`: those copied on the submitting thread instead of the issuer's
    /// ([`crate::device::INLINE_COPY_BYTES`]).
    pub inline_batches: u64,
    /// Bytes issued and not yet completed right now.
    pub inflight_bytes: u64,
    /// The largest `inflight_bytes` seen since creation or [`Pacer::reset_peak`].
    pub peak_inflight_bytes: u64,
    /// The configuration now in force.
    pub config: PacingConfig,
}

/// Shared between the pacer handle, its issuer thread, and completion callbacks.
pub(crate) struct Counters {
    chunk_bytes: AtomicU64,
    max_inflight: AtomicU64,
    inflight: AtomicU64,
    peak: AtomicU64,
    bytes: AtomicU64,
    chunks: AtomicU64,
    batches: AtomicU64,
    failed: AtomicU64,
    /// While the issuer waits for budget: wake it only once `inflight` is at or below this
    /// (hysteresis, so it does not wake per completed chunk). `u64::MAX` when not waiting.
    wake_inflight_at: AtomicU64,
    /// Set by [`Pacer::pause`]: no chunk is issued until [`Pacer::resume`].
    paused: std::sync::atomic::AtomicBool,
    /// Batches submitted to the issuer and not yet dropped by it ([`PendingJob`]).
    pending_jobs: AtomicU64,
    inline: AtomicU64,
}

/// Counts one batch in [`Counters::pending_jobs`] for as long as the issuer holds it.
pub(crate) struct PendingJob(Arc<Counters>);

impl Drop for PendingJob {
    fn drop(&mut self) {
        self.0.pending_jobs.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Counters {
    fn config(&self) -> PacingConfig {
        PacingConfig {
            chunk_bytes: self.chunk_bytes.load(Ordering::Relaxed),
            max_inflight_bytes: self.max_inflight.load(Ordering::Relaxed),
        }
    }

    /// Reserves `len` bytes of in-flight budget if the limit allows (always when nothing is in
    /// flight: chunks are never larger than the limit). Only the issuer thread calls this, so
    /// the check and the add cannot race with another reservation; releases only lower the
    /// count.
    fn admit(&self, len: u64) -> bool {
        let max = self.max_inflight.load(Ordering::Relaxed);
        let cur = self.inflight.load(Ordering::Acquire);
        if max == 0 || cur == 0 || cur.saturating_add(len) <= max {
            let now = self.inflight.fetch_add(len, Ordering::AcqRel) + len;
            self.peak.fetch_max(now, Ordering::AcqRel);
            true
        } else {
            false
        }
    }

    /// Counts the `len` bytes of a batch about to be copied on its submitting thread
    /// (`CopyBatch::try_inline`) as in flight (and in the peak) until [`Self::inline_done`]:
    /// they are DMA in progress like the issuer's chunks, and a batch queued meanwhile must see
    /// them. Succeeds only when nothing is in flight, atomically, so two threads never both copy
    /// inline past the in-flight limit; `false`: the batch goes through the issuer.
    pub(crate) fn inline_begin(&self, len: u64) -> bool {
        if self
            .inflight
            .compare_exchange(0, len, Ordering::AcqRel, Ordering::Acquire)
            .is_err()
        {
            return false;
        }
        self.peak.fetch_max(len, Ordering::AcqRel);
        true
    }

    /// Accounts the copies of a batch run on its submitting thread (`CopyBatch::try_inline`):
    /// `bytes` in `chunks` completed, and the batch itself; releases the `reserved` bytes of
    /// [`Self::inline_begin`]. Returns whether the issuer should be woken for budget (a batch
    /// queued during the copy may wait for it), as [`Self::completed`] does.
    pub(crate) fn inline_done(&self, reserved: u64, bytes: u64, chunks: u64, ok: bool) -> bool {
        let now = self.inflight.fetch_sub(reserved, Ordering::SeqCst) - reserved;
        let at = self.wake_inflight_at.load(Ordering::SeqCst);
        self.bytes.fetch_add(bytes, Ordering::Relaxed);
        self.chunks.fetch_add(chunks, Ordering::Relaxed);
        self.batches.fetch_add(1, Ordering::Relaxed);
        self.inline.fetch_add(1, Ordering::Relaxed);
        if !ok {
            self.failed.fetch_add(1, Ordering::Relaxed);
        }
        at != u64::MAX && now <= at
    }

    /// Accounts a completed chunk; returns whether the issuer should be woken for budget.
    pub(crate) fn completed(&self, len: u64, ok: bool) -> bool {
        if ok {
            self.bytes.fetch_add(len, Ordering::Relaxed);
            self.chunks.fetch_add(1, Ordering::Relaxed);
        }
        // SeqCst pairs with the issuer's store of `wake_inflight_at` and re-load of `inflight`
        // before it parks: either it sees this release or this sees its watermark.
        let now = self.inflight.fetch_sub(len, Ordering::SeqCst) - len;
        let at = self.wake_inflight_at.load(Ordering::SeqCst);
        at != u64::MAX && now <= at
    }

    /// Before parking for budget: wake when at most `at` bytes are in flight. Returns whether
    /// that already holds (then the issuer must not park).
    fn wait_inflight_at(&self, at: u64) -> bool {
        self.wake_inflight_at.store(at, Ordering::SeqCst);
        self.inflight.load(Ordering::SeqCst) <= at
    }

    pub(crate) fn batch_done(&self, ok: bool) {
        self.batches.fetch_add(1, Ordering::Relaxed);
        if !ok {
            self.failed.fetch_add(1, Ordering::Relaxed);
        }
    }
}

impl crate::metrics::Source for Counters {
    fn sample(&self, s: &mut crate::metrics::Sample) {
        s.dma_inflight_bytes += self.inflight.load(Ordering::Relaxed);
        s.dma_inflight_limit_bytes += self.max_inflight.load(Ordering::Relaxed);
        s.dma_inflight_peak_bytes += self.peak.load(Ordering::Relaxed);
    }
}

/// What a completion needs to account for one chunk: cheap to clone, holds no PJRT object.
#[derive(Clone)]
pub(crate) struct ChunkCtx {
    pub(crate) shared: Arc<BatchShared>,
    pub(crate) counters: Arc<Counters>,
    pub(crate) issuer: Thread,
    pub(crate) op: usize,
    pub(crate) offset: u64,
    pub(crate) len: u64,
    pub(crate) host: usize,
}

impl ChunkCtx {
    /// Accounts the chunk's result and wakes the issuer. Non-blocking apart from the batch's
    /// first-error lock, which nobody holds across a PJRT call; safe inside PJRT callbacks.
    pub(crate) fn complete(self, r: Result<()>) {
        let ok = r.is_ok();
        match r {
            Ok(()) => self.shared.chunk_ok(self.len),
            Err(error) => self.shared.fail(CopyError {
                op: self.op,
                offset: self.offset,
                len: self.len,
                host: self.host,
                error,
            }),
        }
        let budget = self.counters.completed(self.len, ok);
        let batch = self.shared.chunk_done();
        // Wake the issuer only when it can make progress: budget freed past its watermark, the
        // batch's own window reopened or emptied (it may be finished), or an error stops it.
        if budget || batch || !ok {
            self.issuer.unpark();
        }
    }
}

/// Chunks of host-addressable copies are handed to a worker in groups of at most this many
/// bytes (or `HOST_GROUP_CHUNKS` chunks).
pub const HOST_GROUP_BYTES: u64 = 1 << 20;
/// Most chunks in one worker group.
const HOST_GROUP_CHUNKS: usize = 256;

/// A host-memory chunk for the `memcpy` workers (host-addressable device memory).
struct HostChunk {
    ctx: ChunkCtx,
    buf: Arc<BufState>,
    /// D2H (device memory -> host) or H2D (host -> device memory).
    d2h: bool,
}

/// Chunks collected by the issuer for one hand-over to a worker.
#[derive(Default)]
struct HostGroup {
    chunks: Vec<HostChunk>,
    bytes: u64,
}

impl HostGroup {
    /// Hands the collected chunks to a worker (starting the pool on first use); on failure
    /// every chunk completes with an error.
    fn flush(&mut self, pool: &mut Option<HostPool>) {
        if self.chunks.is_empty() {
            return;
        }
        self.bytes = 0;
        let chunks = std::mem::take(&mut self.chunks);
        if pool.is_none() {
            *pool = spawn_host_workers();
        }
        let Some((t, _)) = pool.as_ref() else {
            for c in chunks {
                drop(c.buf);
                c.ctx.complete(Err(Error::Cancelled(
                    "no tpu-sync-h2d worker thread could be started".into(),
                )));
            }
            return;
        };
        if let Err(e) = t.send(chunks) {
            for c in e.into_inner() {
                drop(c.buf);
                c.ctx.complete(Err(Error::Cancelled(
                    "the tpu-sync-h2d workers stopped".into(),
                )));
            }
        }
    }
}

/// The host address of `buf`'s device memory (host-addressable buffers only), read once per
/// batch with `PJRT_Buffer_OpaqueDeviceMemoryDataPointer` and kept in `buf.base`.
pub(crate) fn host_base(buf: &BufState, d2h: bool) -> Result<usize> {
    buf.base
        .get_or_init(|| match buf.xref.opaque_device_ptr() {
            Ok(p) if !p.is_null() => Ok(p as usize),
            Ok(_) => Err(Error::Unsupported {
                plugin: buf.buffer.platform_name().to_string(),
                what: "OpaqueDeviceMemoryDataPointer returned NULL".into(),
            }),
            // A PJRT error (a buffer deleted after submit) keeps its kind and code.
            Err(e @ Error::Pjrt { .. }) => Err(e),
            Err(e) => Err(Error::Unsupported {
                plugin: buf.buffer.platform_name().to_string(),
                what: e.to_string(),
            }),
        })
        .clone()
        .map_err(|e| {
            e.context(format!(
                "{} through the device pointer",
                if d2h { "D2H" } else { "in-place H2D" }
            ))
        })
}

/// One host-addressable copy of `len` bytes between `buf`'s device memory at `offset` and the
/// host address `host`: device to host when `d2h`, else host to device.
///
/// # Safety
/// The range was validated against the buffer's on-device size (at push time); the device
/// memory is host-addressable (`PJRT_Buffer_IsOnCpu`, checked at submit) and kept alive by the
/// external reference in `buf`; the buffer was defined (its ready event) before the copy; the
/// host range is valid for the batch's life, a distinct allocation, and exclusively the batch's
/// when written (the submit contract).
pub(crate) unsafe fn host_copy(
    buf: &BufState,
    offset: u64,
    host: usize,
    len: u64,
    d2h: bool,
) -> Result<()> {
    let base = host_base(buf, d2h)?;
    if d2h {
        // SAFETY: the function's contract (reading the device range, writing the host range).
        unsafe {
            std::ptr::copy_nonoverlapping(
                (base as *const u8).add(offset as usize),
                host as *mut u8,
                len as usize,
            )
        };
    } else {
        // SAFETY: the function's contract (reading the host range, writing the device range).
        unsafe {
            std::ptr::copy_nonoverlapping(
                host as *const u8,
                (base as *mut u8).add(offset as usize),
                len as usize,
            )
        };
    }
    Ok(())
}

impl HostChunk {
    fn run(self) {
        let HostChunk { ctx, buf, d2h } = self;
        // SAFETY: the chunk lies in an op validated at push time; the batch's buffer state
        // (external reference) is held in `buf`, its ready event fired before the batch was
        // issued, and the host range is the batch's until it completes (submit contract).
        let r = unsafe { host_copy(&buf, ctx.offset, ctx.host, ctx.len, d2h) };
        // Release our hold on the buffer state before reporting completion: the issuer frees
        // it (on its own thread) once every chunk is complete.
        drop(buf);
        ctx.complete(r);
    }
}

struct PacerInner {
    tx: Sender<Job>,
    counters: Arc<Counters>,
    issuer: Thread,
}

/// A DMA pacer and copy engine: one FIFO of batches, one issuer thread, one in-flight budget.
///
/// Cloning shares the same engine. The issuer thread ends after the last clone is dropped and
/// every submitted batch has completed. `Send + Sync`.
#[derive(Clone)]
pub struct Pacer {
    inner: Arc<PacerInner>,
}

impl std::fmt::Debug for Pacer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pacer")
            .field("stats", &self.stats())
            .finish()
    }
}

impl Pacer {
    /// Starts a pacer with its own issuer thread.
    ///
    /// Errors: [`Error::Io`] when the thread cannot be spawned.
    pub fn new(config: PacingConfig) -> Result<Pacer> {
        let counters = Arc::new(Counters {
            chunk_bytes: AtomicU64::new(config.chunk_bytes),
            max_inflight: AtomicU64::new(config.max_inflight_bytes),
            inflight: AtomicU64::new(0),
            peak: AtomicU64::new(0),
            bytes: AtomicU64::new(0),
            chunks: AtomicU64::new(0),
            batches: AtomicU64::new(0),
            failed: AtomicU64::new(0),
            wake_inflight_at: AtomicU64::new(u64::MAX),
            paused: std::sync::atomic::AtomicBool::new(false),
            pending_jobs: AtomicU64::new(0),
            inline: AtomicU64::new(0),
        });
        let weak: std::sync::Weak<dyn crate::metrics::Source> = Arc::downgrade(&counters) as _;
        crate::metrics::register_source(weak);
        let (tx, rx) = crossbeam_channel::unbounded::<Job>();
        let c = counters.clone();
        let handle = thread::Builder::new()
            .name("tpu-sync-dma".into())
            .spawn(move || issuer_main(rx, c))
            .map_err(|e| Error::io("spawn the tpu-sync-dma issuer thread", e))?;
        Ok(Pacer {
            inner: Arc::new(PacerInner {
                tx,
                counters,
                issuer: handle.thread().clone(),
            }),
        })
    }

    /// The process-wide pacer (created on first use from [`PacingConfig::from_env`]; an invalid
    /// environment value is logged and the defaults are used). The blocking helpers
    /// [`d2h_batch`](super::d2h_batch) and [`h2d_batch`](super::h2d_batch) use it, so all
    /// copies of a process share one budget.
    ///
    /// # Panics
    /// Only if the issuer thread cannot be spawned at all (the process is out of threads).
    pub fn global() -> &'static Pacer {
        static GLOBAL: OnceLock<Pacer> = OnceLock::new();
        GLOBAL.get_or_init(|| {
            let config = PacingConfig::from_env().unwrap_or_else(|e| {
                log::warn!("DMA pacing from the environment ignored: {e}");
                PacingConfig::default()
            });
            Pacer::new(config).expect("spawn the global tpu-sync-dma thread")
        })
    }

    /// The configuration in force.
    pub fn config(&self) -> PacingConfig {
        self.inner.counters.config()
    }

    /// Changes chunk size and in-flight limit; applies to chunks issued from now on (chunks in
    /// flight are not affected). Equivalent of TPU Sync's `set_dma_pacing`.
    pub fn set_config(&self, config: PacingConfig) {
        let c = &self.inner.counters;
        c.chunk_bytes.store(config.chunk_bytes, Ordering::Relaxed);
        c.max_inflight
            .store(config.max_inflight_bytes, Ordering::Relaxed);
        self.inner.issuer.unpark();
    }

    /// The counters (equivalent of TPU Sync's `get_dma_pacing`).
    pub fn stats(&self) -> PacerStats {
        let c = &self.inner.counters;
        PacerStats {
            bytes: c.bytes.load(Ordering::Relaxed),
            chunks: c.chunks.load(Ordering::Relaxed),
            batches: c.batches.load(Ordering::Relaxed),
            failed_batches: c.failed.load(Ordering::Relaxed),
            inline_batches: c.inline.load(Ordering::Relaxed),
            inflight_bytes: c.inflight.load(Ordering::Relaxed),
            peak_inflight_bytes: c.peak.load(Ordering::Relaxed),
            config: c.config(),
        }
    }

    /// Stops issuing chunks: batches submitted meanwhile queue up (in FIFO order), chunks
    /// already in flight complete, cancellations and completions are still processed. For
    /// quiescing device DMA around another operation.
    pub fn pause(&self) {
        self.inner.counters.paused.store(true, Ordering::Release);
    }

    /// Resumes issuing after [`Pacer::pause`].
    pub fn resume(&self) {
        self.inner.counters.paused.store(false, Ordering::Release);
        self.inner.issuer.unpark();
    }

    /// Resets the peak to the current in-flight bytes.
    pub fn reset_peak(&self) {
        let c = &self.inner.counters;
        c.peak
            .store(c.inflight.load(Ordering::Acquire), Ordering::Release);
    }

    pub(crate) fn issuer(&self) -> &Thread {
        &self.inner.issuer
    }

    /// Counts a batch about to be queued as pending until the returned guard drops (with its
    /// job).
    pub(crate) fn pending_job(&self) -> PendingJob {
        let c = self.inner.counters.clone();
        c.pending_jobs.fetch_add(1, Ordering::AcqRel);
        PendingJob(c)
    }

    /// The engine's counters (for batches run on the submitting thread).
    pub(crate) fn counters(&self) -> &Counters {
        &self.inner.counters
    }

    /// Most bytes a batch submitted now may copy on the submitting thread without reordering
    /// against the FIFO or escaping the pacing: 0 unless nothing is queued, waiting or in flight
    /// and the engine is not paused; then at most `limit` and one chunk of the configuration in
    /// force (so the batch is the one chunk per op the issuer would have issued).
    pub(crate) fn inline_room(&self, limit: u64) -> u64 {
        let c = &self.inner.counters;
        if c.paused.load(Ordering::Acquire)
            || c.pending_jobs.load(Ordering::Acquire) != 0
            || c.inflight.load(Ordering::Acquire) != 0
        {
            return 0;
        }
        limit.min(c.config().effective_chunk_bytes())
    }

    /// Queues a job; the issuer picks it up in FIFO order.
    pub(crate) fn enqueue(&self, job: Job) -> Result<()> {
        match self.inner.tx.send(job) {
            Ok(()) => {
                self.inner.issuer.unpark();
                Ok(())
            }
            Err(e) => {
                // The issuer is gone (it only stops when every sender is dropped, so this is
                // unreachable while `self` lives); the job holds nothing in flight.
                drop(e.into_inner());
                Err(Error::Cancelled(
                    "the tpu-sync-dma copy engine is not running".into(),
                ))
            }
        }
    }
}

/// The workers' queue: the issuer sends groups, workers (and the issuer itself, before it
/// waits) take them.
type HostPool = (Sender<Vec<HostChunk>>, Receiver<Vec<HostChunk>>);

fn spawn_host_workers() -> Option<HostPool> {
    let n = thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(2)
        .clamp(1, 4);
    let (tx, rx) = crossbeam_channel::unbounded::<Vec<HostChunk>>();
    let mut spawned = 0;
    for i in 0..n {
        let rx: Receiver<Vec<HostChunk>> = rx.clone();
        match thread::Builder::new()
            .name(format!("tpu-sync-h2d-{i}"))
            .spawn(move || {
                for group in rx {
                    for chunk in group {
                        chunk.run();
                    }
                }
            }) {
            Ok(_) => spawned += 1,
            Err(e) => log::warn!("spawn tpu-sync-h2d-{i}: {e}"),
        }
    }
    (spawned > 0).then_some((tx, rx))
}

/// The issuer thread: receives jobs, issues chunks in FIFO order within the budget, retires
/// finished jobs. Ends when every [`Pacer`] clone is gone and no job is left.
fn issuer_main(rx: Receiver<Job>, counters: Arc<Counters>) {
    let me = thread::current();
    let mut queue: VecDeque<Job> = VecDeque::new();
    let mut draining: Vec<Job> = Vec::new();
    let mut host_pool: Option<HostPool> = None;
    let mut group = HostGroup::default();
    let mut disconnected = false;
    loop {
        let mut progress = false;
        if queue.is_empty() && draining.is_empty() {
            if disconnected {
                break;
            }
            match rx.recv() {
                Ok(j) => {
                    queue.push_back(j);
                    progress = true;
                }
                Err(_) => {
                    disconnected = true;
                    continue;
                }
            }
        }
        loop {
            match rx.try_recv() {
                Ok(j) => {
                    queue.push_back(j);
                    progress = true;
                }
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => {
                    disconnected = true;
                    break;
                }
            }
        }
        // Retire jobs whose chunks have all completed.
        let mut i = 0;
        while i < draining.len() {
            if draining[i].can_finish() {
                let job = draining.swap_remove(i);
                job.finish(&counters);
                progress = true;
            } else {
                i += 1;
            }
        }
        // Failed or cancelled batches leave the FIFO wherever they are: nothing more of them
        // is issued, and they finish once their chunks in flight complete.
        if queue.iter().any(|j| j.shared.stopped()) {
            let (stopped, kept): (VecDeque<Job>, VecDeque<Job>) =
                queue.drain(..).partition(|j| j.shared.stopped());
            queue = kept;
            draining.extend(stopped);
            progress = true;
        }
        // Issue from the head of the FIFO while the budget allows.
        while let Some(head) = queue.front_mut() {
            if counters.paused.load(Ordering::Acquire) {
                break;
            }
            if head.shared.stopped() {
                draining.extend(queue.pop_front());
                progress = true;
                continue;
            }
            if head.shared.ready_pending.load(Ordering::Acquire) > 0 {
                break;
            }
            let chunk_max = counters.config().effective_chunk_bytes();
            let Some(ch) = head.peek_chunk(chunk_max) else {
                draining.extend(queue.pop_front());
                progress = true;
                continue;
            };
            if head.max_outstanding_chunks > 0
                && head.shared.outstanding.load(Ordering::Acquire) >= head.max_outstanding_chunks
            {
                // Wake when half the batch's window is free again.
                if head
                    .shared
                    .wait_outstanding_at(head.max_outstanding_chunks / 2)
                {
                    continue;
                }
                break;
            }
            if !counters.admit(ch.len) {
                // Wake when the chunk fits and at least half the budget is free again.
                let max = counters.config().max_inflight_bytes;
                if counters.wait_inflight_at((max / 2).min(max.saturating_sub(ch.len))) {
                    continue;
                }
                break;
            }
            counters.wake_inflight_at.store(u64::MAX, Ordering::SeqCst);
            head.shared
                .wake_outstanding_at
                .store(usize::MAX, Ordering::SeqCst);
            head.advance(&ch);
            head.shared.outstanding.fetch_add(1, Ordering::AcqRel);
            let ctx = ChunkCtx {
                shared: head.shared.clone(),
                counters: counters.clone(),
                issuer: me.clone(),
                op: ch.op,
                offset: ch.offset,
                len: ch.len,
                host: ch.host,
            };
            issue(head, ch.buf, ctx, &mut group, &mut host_pool);
            progress = true;
        }
        // Hand over what was collected before waiting: the chunks' completions are what the
        // issuer waits for. Then copy queued groups here instead of waiting for a worker to be
        // scheduled (on a busy machine a wake-up costs more than the copy).
        group.flush(&mut host_pool);
        if let Some((_, rx)) = &host_pool {
            while let Ok(g) = rx.try_recv() {
                for c in g {
                    c.run();
                }
                progress = true;
            }
        }
        if !progress {
            // Woken by completions, submissions, cancellations and config changes; the timeout
            // is only a safety net.
            thread::park_timeout(Duration::from_millis(50));
        }
    }
}

/// Issues one chunk of `job`. Every path ends in exactly one `ctx.complete`.
fn issue(
    job: &mut Job,
    buf: usize,
    ctx: ChunkCtx,
    group: &mut HostGroup,
    host_pool: &mut Option<HostPool>,
) {
    let state = job.bufs[buf].clone();
    match &job.kind {
        JobKind::D2h => {
            // SAFETY: the range was validated at push time; the destination is valid until the
            // batch completes (submit contract); the external reference keeps the buffer alive.
            let r = unsafe {
                state
                    .buffer
                    .copy_raw_to_host_start(ctx.offset, ctx.host as *mut u8, ctx.len)
            };
            drop(state);
            match r {
                Ok(Some(ev)) => watch(job, ev, ctx),
                Ok(None) => ctx.complete(Ok(())),
                Err(e) => ctx.complete(Err(e)),
            }
        }
        JobKind::H2dRaw(ext) => {
            let r = match &state.alias {
                // SAFETY: as above; the alias was created for this buffer at submit and lives
                // until the batch is finished.
                Some(alias) => unsafe {
                    ext.copy_host_to_device(alias, ctx.host as *const u8, ctx.offset, ctx.len)
                },
                None => Err(Error::InvalidArgument(
                    "internal: no raw alias for a RawBuffer H2D chunk".into(),
                )),
            };
            drop(state);
            match r {
                Ok(Some(ev)) => watch(job, ev, ctx),
                Ok(None) => ctx.complete(Ok(())),
                Err(e) => ctx.complete(Err(e)),
            }
        }
        JobKind::H2dHost | JobKind::D2hHost => {
            let len = ctx.len;
            group.chunks.push(HostChunk {
                ctx,
                buf: state,
                d2h: matches!(job.kind, JobKind::D2hHost),
            });
            group.bytes += len;
            if group.bytes >= HOST_GROUP_BYTES || group.chunks.len() >= HOST_GROUP_CHUNKS {
                group.flush(host_pool);
            }
        }
    }
}

/// Registers the chunk's completion on `ev` and keeps the event until the job finishes.
fn watch(job: &mut Job, ev: Event, ctx: ChunkCtx) {
    match ev.on_ready_boxed(Box::new(move |r| ctx.complete(r))) {
        Ok(()) => job.events.push(ev),
        Err((e, f)) => {
            // Not registered: the copy may still be running, so wait for it here.
            log::warn!("PJRT_Event_OnReady failed ({e}); awaiting the chunk synchronously");
            f(ev.wait());
        }
    }
}
