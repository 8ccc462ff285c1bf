//! Copy batches: one operation over many (buffer, offset, size, host address) copies, completed
//! through one [`CopyHandle`].

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::task::{Context, Poll, Waker};
use std::thread::Thread;
use std::time::{Duration, Instant};

use super::pacing::{host_copy, Counters, Pacer, PendingJob};
use super::CopyStats;
use crate::error::{Error, Result};
use crate::pjrt::ext::RawAlias;
use crate::pjrt::{Capabilities, DeviceBuffer, Event, ExternalRef, H2dPath, RawBufferExt};

/// Direction of a batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// Device to host (`PJRT_Buffer_CopyRawToHost`).
    D2h,
    /// Host to device, in place into existing buffers (the probed [`H2dPath`]).
    H2d,
}

/// The first error of a batch and the copy it happened in.
///
/// `op` is the index of the copy in the order it was [pushed](CopyBatch::push);
/// `offset..offset+len` the device byte range of the failing chunk (a part of that copy when it
/// was split) and `host` the chunk's host address. Converts into [`Error`] with the span prefixed to the
/// message.
#[derive(Debug)]
pub struct CopyError {
    /// Index of the failing copy in the batch.
    pub op: usize,
    /// Device byte offset of the failing chunk.
    pub offset: u64,
    /// Length of the failing chunk in bytes.
    pub len: u64,
    /// Host address of the failing chunk.
    pub host: usize,
    /// What went wrong.
    pub error: Error,
}

impl CopyError {
    /// `copy N (device bytes A..B, host 0x...)`.
    pub fn span(&self) -> String {
        format!(
            "copy {} (device bytes {}..{}, host {:#x})",
            self.op,
            self.offset,
            self.offset.saturating_add(self.len),
            self.host
        )
    }
}

impl std::fmt::Display for CopyError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.span(), self.error)
    }
}

impl std::error::Error for CopyError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.error)
    }
}

impl From<CopyError> for Error {
    /// The same error kind with the span prefixed to its message.
    fn from(c: CopyError) -> Error {
        let ctx = c.span();
        c.error.context(ctx)
    }
}

/// One copy as queued: index of its buffer in the batch, device offset, length, host address,
/// and which pushed copies it is made of (adjacent pushes are merged into one op: `parts` pushed
/// copies starting with pushed copy `first`).
#[derive(Debug, Clone, Copy)]
pub(crate) struct OpSpec {
    buf: usize,
    offset: u64,
    len: u64,
    host: usize,
    first: usize,
    parts: usize,
}

/// A chunk to issue: a piece of one op.
pub(crate) struct Chunk {
    pub(crate) op: usize,
    pub(crate) buf: usize,
    pub(crate) offset: u64,
    pub(crate) len: u64,
    pub(crate) host: usize,
}

/// A list of raw copies in one direction, submitted as one operation.
///
/// Build with [`CopyBatch::d2h`] or [`CopyBatch::h2d`], add copies with [`CopyBatch::push`]
/// (each validated at once against the buffer's on-device size), then
/// [`submit`](CopyBatch::submit) to a [`Pacer`]. `Send + Sync` (host addresses are kept as
/// integers; the submit contract says who may touch the memory behind them).
pub struct CopyBatch {
    dir: Direction,
    h2d: Option<H2dPath>,
    bufs: Vec<DeviceBuffer>,
    index: HashMap<usize, usize>,
    ops: Vec<OpSpec>,
    /// Length of every pushed copy, in push order (maps a chunk of a merged op back to the
    /// pushed copy it belongs to, for errors).
    pushed: Vec<u64>,
    bytes: u64,
    max_outstanding_chunks: usize,
}

impl std::fmt::Debug for CopyBatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CopyBatch")
            .field("dir", &self.dir)
            .field("ops", &self.ops.len())
            .field("bytes", &self.bytes)
            .finish()
    }
}

fn _assert_send_sync() {
    fn ok<T: Send + Sync>() {}
    ok::<CopyBatch>();
    ok::<CopyHandle>();
    ok::<CopyError>();
}

impl CopyBatch {
    /// Whether every buffer of the batch is host-addressable (`PJRT_Buffer_IsOnCpu`); `false`
    /// when that cannot be asked.
    fn all_on_cpu(&self) -> bool {
        !self.bufs.is_empty() && self.bufs.iter().all(|b| b.is_on_cpu().unwrap_or(false))
    }

    fn new(dir: Direction, h2d: Option<H2dPath>) -> CopyBatch {
        CopyBatch {
            dir,
            h2d,
            bufs: Vec::new(),
            index: HashMap::new(),
            ops: Vec::new(),
            pushed: Vec::new(),
            bytes: 0,
            max_outstanding_chunks: 0,
        }
    }

    /// An empty device-to-host batch (`PJRT_Buffer_CopyRawToHost` per chunk).
    pub fn d2h() -> CopyBatch {
        CopyBatch::new(Direction::D2h, None)
    }

    /// An empty in-place host-to-device batch using the path `caps` probed.
    ///
    /// Errors: [`Error::Unsupported`] naming the plugin and what is missing when the plugin has
    /// no in-place H2D path (e.g. the CUDA plugin: no RawBuffer extension, device memory not
    /// host-addressable).
    pub fn h2d(caps: &Capabilities) -> Result<CopyBatch> {
        let path = caps.require_h2d()?.clone();
        Ok(CopyBatch::new(Direction::H2d, Some(path)))
    }

    /// Limits how many chunks of this batch are in flight at once (0 = only the pacer's byte
    /// budget limits it).
    pub fn set_max_outstanding_chunks(&mut self, n: usize) {
        self.max_outstanding_chunks = n;
    }

    /// Direction of the batch.
    pub fn direction(&self) -> Direction {
        self.dir
    }

    /// Number of copies pushed.
    pub fn len(&self) -> usize {
        self.pushed.len()
    }

    /// Whether no copy was pushed.
    pub fn is_empty(&self) -> bool {
        self.pushed.is_empty()
    }

    /// Number of copies that will be issued: pushed copies adjacent to the previous one (same
    /// buffer, device bytes and host bytes both continuing it) are merged into one.
    pub fn merged_len(&self) -> usize {
        self.ops.len()
    }

    /// Total bytes of the pushed copies.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Adds a copy of `len` bytes between `buffer`'s on-device bytes at `offset` and host
    /// memory at `host` (destination for D2H, source for H2D). Zero-length copies are allowed
    /// and skipped. A copy that continues the previous one on both sides (same buffer, device
    /// offset and host address right after its end) is merged with it, so per-block pushes of
    /// adjacent blocks cost one plugin call; errors still name the pushed copy.
    ///
    /// Errors: [`Error::InvalidArgument`] (naming the copy's index) when the range is outside
    /// the buffer's `OnDeviceSizeInBytes`, overflows, or `host` is NULL. Nothing is issued
    /// before [`CopyBatch::submit`].
    pub fn push(
        &mut self,
        buffer: &DeviceBuffer,
        offset: u64,
        len: u64,
        host: *mut u8,
    ) -> Result<()> {
        let i = self.pushed.len();
        buffer
            .check_range(offset, len)
            .map_err(|e| Error::InvalidArgument(format!("copy {i}: {e}")))?;
        if host.is_null() {
            return Err(Error::InvalidArgument(format!(
                "copy {i}: NULL host address"
            )));
        }
        (host as usize).checked_add(len as usize).ok_or_else(|| {
            Error::InvalidArgument(format!("copy {i}: host range {host:p}+{len} wraps"))
        })?;
        let key = buffer.raw() as usize;
        let buf = match self.index.get(&key) {
            Some(&b) => b,
            None => {
                self.bufs.push(buffer.clone());
                self.index.insert(key, self.bufs.len() - 1);
                self.bufs.len() - 1
            }
        };
        self.pushed.push(len);
        self.bytes += len;
        if let Some(last) = self.ops.last_mut() {
            if last.buf == buf
                && last.offset + last.len == offset
                && last.host + last.len as usize == host as usize
                && last.first + last.parts == i
            {
                last.len += len;
                last.parts += 1;
                return Ok(());
            }
        }
        self.ops.push(OpSpec {
            buf,
            offset,
            len,
            host: host as usize,
            first: i,
            parts: 1,
        });
        Ok(())
    }

    /// Adds a copy of the buffer's whole raw contents: `OnDeviceSizeInBytes` bytes from offset
    /// 0 (which may exceed the logical size on tiled or padded layouts; raw bytes are only
    /// meaningful to a buffer of the same dtype, dims and
    /// [physical layout](DeviceBuffer::physical_layout)). Returns the size, so host staging is
    /// sized by the on-device size, never by the logical shape.
    ///
    /// Errors: as [`CopyBatch::push`].
    pub fn push_whole(&mut self, buffer: &DeviceBuffer, host: *mut u8) -> Result<u64> {
        let n = buffer.on_device_size();
        self.push(buffer, 0, n, host)?;
        Ok(n)
    }

    /// The first pushed copy that uses buffer `b`.
    fn first_op_of(&self, b: usize) -> usize {
        self.ops
            .iter()
            .find(|o| o.buf == b)
            .map(|o| o.first)
            .unwrap_or(0)
    }

    fn check_overlaps(&self) -> Result<()> {
        let mut v: Vec<(usize, u64, u64, usize)> = self
            .ops
            .iter()
            .filter(|o| o.len > 0)
            .map(|o| match self.dir {
                // D2H: two chunks writing the same host bytes race inside the plugin.
                Direction::D2h => (0, o.host as u64, o.len, o.first),
                // H2D: two writes to the same device bytes race.
                Direction::H2d => (o.buf, o.offset, o.len, o.first),
            })
            .collect();
        v.sort_unstable();
        for w in v.windows(2) {
            if w[0].0 == w[1].0 && w[0].1 + w[0].2 > w[1].1 {
                let what = match self.dir {
                    Direction::D2h => "host destinations",
                    Direction::H2d => "device destinations",
                };
                return Err(Error::InvalidArgument(format!(
                    "copies {} and {} have overlapping {what}",
                    w[0].3.min(w[1].3),
                    w[0].3.max(w[1].3)
                )));
            }
        }
        Ok(())
    }

    /// Issues the batch through `pacer` and returns its handle; the copies run asynchronously.
    ///
    /// Before anything is issued: every buffer gets an external reference
    /// (`PJRT_Buffer_IncreaseExternalReferenceCount`, held until the batch completes, so an
    /// adopted buffer cannot be freed under a copy) and must not be deleted; D2H host ranges
    /// must not overlap each other, nor H2D device ranges; for H2D through the RawBuffer
    /// extension one raw alias per buffer is created, and for host-addressable H2D each buffer
    /// must report `PJRT_Buffer_IsOnCpu`. H2D chunks into a buffer start only after the buffer's
    /// ready event (no write races a pending computation that defines the buffer).
    ///
    /// Errors: [`Error::InvalidArgument`] for a deleted buffer or overlapping ranges,
    /// [`Error::Unsupported`] or [`Error::Pjrt`] when a path's resources cannot be set up. On
    /// error nothing was issued.
    ///
    /// # Safety
    /// Every host range must be valid (for writes for D2H, for reads for H2D) until the handle
    /// reports completion (its `wait` returns, its future resolves, `is_done` is true, or its
    /// drop returns), even if the handle is leaked; D2H destinations must not be read or
    /// written by anyone else, and H2D sources not written, meanwhile. No computation may use
    /// the H2D destination ranges concurrently (the caller owns those blocks, as a serving
    /// engine owns the blocks it allocated to a request).
    pub unsafe fn submit(self, pacer: &Pacer) -> Result<CopyHandle> {
        // SAFETY: forwarded caller contract.
        let h = unsafe { self.submit_with(pacer, false) }?;
        Ok(h.expect("a batch not limited to the inline path is always submitted"))
    }

    /// Runs the batch on the calling thread if it can run there without waiting
    /// ([`INLINE_COPY_BYTES`]: small, the copy engine idle, every buffer defined) and returns
    /// its completed handle; otherwise returns `None` and issues nothing (the caller then
    /// submits a new batch where blocking is allowed). For callers on an async runtime's worker
    /// threads, which must never wait for the copy engine.
    ///
    /// Errors: as [`CopyBatch::submit`].
    ///
    /// # Safety
    /// As [`CopyBatch::submit`]; when `None` is returned nothing was read or written.
    pub unsafe fn submit_inline_only(self, pacer: &Pacer) -> Result<Option<CopyHandle>> {
        // SAFETY: forwarded caller contract.
        unsafe { self.submit_with(pacer, true) }
    }

    /// [`CopyBatch::submit`], or with `inline_only` [`CopyBatch::submit_inline_only`].
    ///
    /// # Safety
    /// As [`CopyBatch::submit`].
    unsafe fn submit_with(self, pacer: &Pacer, inline_only: bool) -> Result<Option<CopyHandle>> {
        self.check_overlaps()?;
        let kind = match (&self.dir, &self.h2d) {
            // Host-addressable device memory (probed per buffer, PJRT_Buffer_IsOnCpu): read it
            // with memcpy on the copy engine's workers instead of one CopyRawToHost call per
            // chunk; any other buffer takes PJRT_Buffer_CopyRawToHost.
            (Direction::D2h, _) if super::d2h_host_addressable() && self.all_on_cpu() => {
                JobKind::D2hHost
            }
            (Direction::D2h, _) => JobKind::D2h,
            (Direction::H2d, Some(H2dPath::RawBufferExtension(ext))) => {
                ext.check_in_place_h2d()?;
                JobKind::H2dRaw(ext.clone())
            }
            (Direction::H2d, Some(H2dPath::HostAddressable)) => JobKind::H2dHost,
            (Direction::H2d, Some(H2dPath::Unsupported(r))) => {
                // Unreachable through `CopyBatch::h2d`, which refuses this path up front.
                return Err(Error::Unsupported {
                    plugin: self
                        .bufs
                        .first()
                        .map(|b| b.platform_name().to_string())
                        .unwrap_or_default(),
                    what: format!("in-place host-to-device copy: {r}"),
                });
            }
            (Direction::H2d, None) => {
                return Err(Error::InvalidArgument("H2D batch without a path".into()))
            }
        };
        let mut states = Vec::with_capacity(self.bufs.len());
        for (b, buffer) in self.bufs.iter().enumerate() {
            let op = self.first_op_of(b);
            let ctx = |e: Error| Error::InvalidArgument(format!("copy {op}: {e}"));
            // Reference first, then check: a buffer deleted in between is caught, and one
            // deleted afterwards keeps its memory (the external reference survives Delete).
            let xref = buffer.external_ref().map_err(ctx)?;
            if buffer.is_deleted().map_err(ctx)? {
                return Err(Error::InvalidArgument(format!(
                    "copy {op}: PJRT buffer has been deleted"
                )));
            }
            let alias = match &kind {
                JobKind::H2dRaw(ext) => {
                    if !Arc::ptr_eq(ext.plugin(), buffer.plugin()) {
                        return Err(Error::InvalidArgument(format!(
                            "copy {op}: buffer belongs to another plugin than the RawBuffer \
                             extension"
                        )));
                    }
                    // SAFETY: live buffer of the extension's plugin; the alias is dropped
                    // before the external reference and the buffer handle (field order).
                    Some(unsafe { ext.create_alias(buffer.raw()) }?)
                }
                JobKind::H2dHost => {
                    if !buffer.is_on_cpu()? {
                        return Err(Error::Unsupported {
                            plugin: buffer.platform_name().to_string(),
                            what: format!(
                                "copy {op}: in-place H2D by host address needs host-addressable \
                                 device memory, and PJRT_Buffer_IsOnCpu is false"
                            ),
                        });
                    }
                    None
                }
                JobKind::D2h | JobKind::D2hHost => None,
            };
            states.push(Arc::new(BufState {
                alias,
                xref,
                buffer: buffer.clone(),
                base: OnceLock::new(),
            }));
        }
        if let Some(done) = self.try_inline(&kind, &states, pacer)? {
            return Ok(Some(done));
        }
        if inline_only {
            return Ok(None);
        }
        let shared = Arc::new(BatchShared::new(self.pushed.len()));
        let mut events = Vec::new();
        if self.dir == Direction::H2d || matches!(kind, JobKind::D2hHost) {
            // Gate the batch on every buffer being defined (H2D: no write races a pending
            // computation that defines it; host-addressable D2H: the bytes read are final, as
            // CopyRawToHost waits for them).
            let evs = self
                .bufs
                .iter()
                .map(|b| b.ready_event())
                .collect::<Result<Vec<Event>>>()?;
            shared.ready_pending.store(evs.len(), Ordering::Release);
            for (b, ev) in evs.into_iter().enumerate() {
                let sh = shared.clone();
                let issuer = pacer.issuer().clone();
                let op = self.first_op_of(b);
                let r = ev.on_ready(move |r| {
                    if let Err(error) = r {
                        sh.fail(CopyError {
                            op,
                            offset: 0,
                            len: 0,
                            host: 0,
                            error,
                        });
                    }
                    sh.ready_pending.fetch_sub(1, Ordering::AcqRel);
                    issuer.unpark();
                });
                match r {
                    Ok(()) => events.push(ev),
                    Err(_) => {
                        // Not registered: wait for it here instead.
                        let r = ev.wait();
                        if let Err(error) = r {
                            shared.fail(CopyError {
                                op,
                                offset: 0,
                                len: 0,
                                host: 0,
                                error,
                            });
                        }
                        shared.ready_pending.fetch_sub(1, Ordering::AcqRel);
                    }
                }
            }
        }
        let job = Job {
            shared: shared.clone(),
            kind,
            bufs: states,
            ops: self.ops,
            pushed: self.pushed,
            next_op: 0,
            next_off: 0,
            events,
            max_outstanding_chunks: self.max_outstanding_chunks,
            finished: false,
            _pending: pacer.pending_job(),
        };
        pacer.enqueue(job)?;
        Ok(Some(CopyHandle {
            shared,
            issuer: pacer.issuer().clone(),
            taken: false,
        }))
    }
}

/// A batch of host-addressable copies (the XLA CPU plugin's buffers) of at most this many bytes
/// (and at most one chunk of the pacing configuration) runs on the submitting thread when the
/// copy engine is idle (nothing queued, waiting or in flight, not paused) and every buffer is
/// already defined, instead of through the issuer
/// thread: for small batches the two thread hand-overs (to the issuer and back) cost more than
/// the copies (docs/performance.md, 64 KiB pulls). Equal to the pipeline's inline H2D limit,
/// [`crate::transfer::INLINE_H2D_BYTES`]. Such a batch is still counted in [`Pacer::stats`], and
/// in the in-flight bytes (and their peak) while it copies; it runs inline only when it is the
/// one copy in flight.
pub const INLINE_COPY_BYTES: u64 = 256 << 10;

impl CopyBatch {
    /// Runs the batch's copies now on this thread when [`INLINE_COPY_BYTES`] allows (see
    /// there), returning its completed handle; `None` sends it through the issuer. A copy error
    /// fails the batch as the issuer would (its first failing op, nothing more copied).
    fn try_inline(
        &self,
        kind: &JobKind,
        states: &[Arc<BufState>],
        pacer: &Pacer,
    ) -> Result<Option<CopyHandle>> {
        let (d2h, dir) = match kind {
            JobKind::H2dHost => (false, Direction::H2d),
            JobKind::D2hHost => (true, Direction::D2h),
            _ => return Ok(None),
        };
        let bytes: u64 = self.ops.iter().map(|o| o.len).sum();
        if bytes > pacer.inline_room(INLINE_COPY_BYTES) {
            return Ok(None);
        }
        // Every buffer defined now and without error; otherwise the issuer waits on its event.
        for b in &self.bufs {
            let ev = b.ready_event()?;
            if !ev.is_ready()? || ev.wait().is_err() {
                return Ok(None);
            }
        }
        if !pacer.counters().inline_begin(bytes) {
            return Ok(None); // another copy got in first
        }
        let shared = Arc::new(BatchShared::new(self.pushed.len()));
        let mut failed = None;
        for op in &self.ops {
            // SAFETY: every op was validated against its buffer's on-device size by `push`;
            // `states` holds each buffer's external reference and was checked host-addressable
            // (PJRT_Buffer_IsOnCpu) by `submit`; every buffer is defined (its ready event is
            // ready without error, above); the host ranges are the caller's, valid and the
            // batch's alone until the handle completes (submit's contract), which is before
            // this returns.
            match unsafe { host_copy(&states[op.buf], op.offset, op.host, op.len, d2h) } {
                Ok(()) => shared.chunk_ok(op.len),
                Err(error) => {
                    failed = Some(CopyError {
                        op: op.first,
                        offset: op.offset,
                        len: op.len,
                        host: op.host,
                        error,
                    });
                    break;
                }
            }
        }
        let copied = shared.bytes_done.load(Ordering::Relaxed);
        let chunks = shared.chunks_done.load(Ordering::Relaxed);
        let r = match failed {
            Some(e) => Err(e),
            None => Ok(CopyStats {
                bytes: copied,
                ops: self.pushed.len() as u64,
                chunks,
                elapsed: shared.start.elapsed(),
            }),
        };
        if pacer
            .counters()
            .inline_done(bytes, copied, chunks, r.is_ok())
        {
            pacer.issuer().unpark();
        }
        crate::metrics::device_copy(dir, copied, shared.start.elapsed().as_secs_f64(), r.is_ok());
        shared.complete(r);
        Ok(Some(CopyHandle {
            shared,
            issuer: pacer.issuer().clone(),
            taken: false,
        }))
    }
}

/// What the issuer holds per buffer for the life of a batch. Field order is drop order: the raw
/// alias goes first, then the external reference, then the buffer handle.
pub(crate) struct BufState {
    pub(crate) alias: Option<RawAlias>,
    pub(crate) xref: ExternalRef,
    pub(crate) buffer: DeviceBuffer,
    /// Host-addressable device base address, read once by the first H2D worker chunk.
    pub(crate) base: OnceLock<std::result::Result<usize, Error>>,
}

pub(crate) enum JobKind {
    D2h,
    /// D2H by `memcpy` from host-addressable device memory (the XLA CPU plugin).
    D2hHost,
    H2dRaw(RawBufferExt),
    H2dHost,
}

struct DoneState {
    finished: bool,
    result: Option<std::result::Result<CopyStats, CopyError>>,
    waker: Option<Waker>,
}

/// The part of a batch that completion callbacks touch: atomics and two short locks, no PJRT
/// object.
pub(crate) struct BatchShared {
    pub(crate) outstanding: AtomicUsize,
    /// While the issuer waits for this batch's chunk window: wake it once `outstanding` is at
    /// or below this. `usize::MAX` when not waiting.
    pub(crate) wake_outstanding_at: AtomicUsize,
    pub(crate) ready_pending: AtomicUsize,
    stop: AtomicBool,
    cancelled: AtomicBool,
    first_error: Mutex<Option<CopyError>>,
    bytes_done: AtomicU64,
    chunks_done: AtomicU64,
    ops: usize,
    start: Instant,
    done: Mutex<DoneState>,
    cv: Condvar,
}

impl BatchShared {
    fn new(ops: usize) -> BatchShared {
        BatchShared {
            outstanding: AtomicUsize::new(0),
            wake_outstanding_at: AtomicUsize::new(usize::MAX),
            ready_pending: AtomicUsize::new(0),
            stop: AtomicBool::new(false),
            cancelled: AtomicBool::new(false),
            first_error: Mutex::new(None),
            bytes_done: AtomicU64::new(0),
            chunks_done: AtomicU64::new(0),
            ops,
            start: Instant::now(),
            done: Mutex::new(DoneState {
                finished: false,
                result: None,
                waker: None,
            }),
            cv: Condvar::new(),
        }
    }

    pub(crate) fn stopped(&self) -> bool {
        self.stop.load(Ordering::Acquire)
    }

    /// Counts a chunk as completed; returns whether the issuer should be woken for it (the
    /// batch emptied, which may let it finish, or its window reopened past the watermark).
    pub(crate) fn chunk_done(&self) -> bool {
        let now = self.outstanding.fetch_sub(1, Ordering::SeqCst) - 1;
        let at = self.wake_outstanding_at.load(Ordering::SeqCst);
        now == 0 || (at != usize::MAX && now <= at)
    }

    /// Before parking for this batch's window: wake at `at` outstanding chunks. Returns whether
    /// that already holds.
    pub(crate) fn wait_outstanding_at(&self, at: usize) -> bool {
        self.wake_outstanding_at.store(at, Ordering::SeqCst);
        self.outstanding.load(Ordering::SeqCst) <= at
    }

    pub(crate) fn chunk_ok(&self, len: u64) {
        self.bytes_done.fetch_add(len, Ordering::Relaxed);
        self.chunks_done.fetch_add(1, Ordering::Relaxed);
    }

    /// Records `e` if it is the batch's first error and stops further issuing.
    pub(crate) fn fail(&self, e: CopyError) {
        let mut g = self.first_error.lock().unwrap_or_else(|p| p.into_inner());
        if g.is_none() {
            *g = Some(e);
        }
        drop(g);
        self.stop.store(true, Ordering::Release);
    }

    fn lock_done(&self) -> std::sync::MutexGuard<'_, DoneState> {
        self.done.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn complete(&self, r: std::result::Result<CopyStats, CopyError>) {
        let mut g = self.lock_done();
        g.finished = true;
        g.result = Some(r);
        let w = g.waker.take();
        drop(g);
        self.cv.notify_all();
        if let Some(w) = w {
            w.wake();
        }
    }
}

/// A submitted batch as the issuer thread holds it.
pub(crate) struct Job {
    pub(crate) shared: Arc<BatchShared>,
    pub(crate) kind: JobKind,
    pub(crate) bufs: Vec<Arc<BufState>>,
    pub(crate) ops: Vec<OpSpec>,
    pub(crate) pushed: Vec<u64>,
    pub(crate) next_op: usize,
    pub(crate) next_off: u64,
    pub(crate) events: Vec<Event>,
    pub(crate) max_outstanding_chunks: usize,
    pub(crate) finished: bool,
    /// Counts the job as pending in its pacer until dropped (after `Drop` below).
    pub(crate) _pending: PendingJob,
}

impl Job {
    /// The next chunk (at most `max` bytes) without consuming it; `None` when every op has been
    /// issued.
    pub(crate) fn peek_chunk(&mut self, max: u64) -> Option<Chunk> {
        while self.next_op < self.ops.len() && self.next_off >= self.ops[self.next_op].len {
            self.next_op += 1;
            self.next_off = 0;
        }
        let o = self.ops.get(self.next_op)?;
        let len = (o.len - self.next_off).min(max.max(1));
        Some(Chunk {
            op: self.pushed_index(self.next_op, self.next_off),
            buf: o.buf,
            offset: o.offset + self.next_off,
            len,
            host: o.host + self.next_off as usize,
        })
    }

    /// The pushed copy holding byte `off` of merged op `op`.
    fn pushed_index(&self, op: usize, off: u64) -> usize {
        let o = &self.ops[op];
        let mut at = 0;
        for k in 0..o.parts {
            at += self.pushed.get(o.first + k).copied().unwrap_or(0);
            if off < at {
                return o.first + k;
            }
        }
        o.first + o.parts.saturating_sub(1)
    }

    pub(crate) fn advance(&mut self, c: &Chunk) {
        self.next_off += c.len;
    }

    fn all_issued(&mut self) -> bool {
        self.peek_chunk(1).is_none()
    }

    pub(crate) fn can_finish(&self) -> bool {
        self.shared.outstanding.load(Ordering::Acquire) == 0
            && (self.shared.ready_pending.load(Ordering::Acquire) == 0 || self.shared.stopped())
    }

    /// Releases everything the batch holds (on the issuer thread), then completes its handle.
    pub(crate) fn finish(mut self, counters: &Counters) {
        self.events.clear();
        self.bufs.clear();
        let err = self
            .shared
            .first_error
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        let r = match err {
            Some(e) => Err(e),
            None if self.shared.cancelled.load(Ordering::Acquire) && !self.all_issued() => {
                let c = self.peek_chunk(u64::MAX);
                Err(CopyError {
                    op: c.as_ref().map(|c| c.op).unwrap_or(self.next_op),
                    offset: c.as_ref().map(|c| c.offset).unwrap_or(0),
                    len: c.as_ref().map(|c| c.len).unwrap_or(0),
                    host: c.as_ref().map(|c| c.host).unwrap_or(0),
                    error: Error::Cancelled(format!(
                        "batch cancelled after {} of {} copies were issued",
                        c.as_ref().map(|c| c.op).unwrap_or(self.next_op),
                        self.shared.ops
                    )),
                })
            }
            None => Ok(CopyStats {
                bytes: self.shared.bytes_done.load(Ordering::Relaxed),
                ops: self.shared.ops as u64,
                chunks: self.shared.chunks_done.load(Ordering::Relaxed),
                elapsed: self.shared.start.elapsed(),
            }),
        };
        counters.batch_done(r.is_ok());
        crate::metrics::device_copy(
            match self.kind {
                JobKind::D2h | JobKind::D2hHost => Direction::D2h,
                JobKind::H2dRaw(_) | JobKind::H2dHost => Direction::H2d,
            },
            self.shared.bytes_done.load(Ordering::Relaxed),
            self.shared.start.elapsed().as_secs_f64(),
            r.is_ok(),
        );
        self.finished = true;
        self.shared.complete(r);
    }
}

impl Drop for Job {
    /// A job dropped without [`Job::finish`] (the engine stopped): wait until no chunk is in
    /// flight, so host memory is never written after the handle completes, then fail it.
    fn drop(&mut self) {
        if self.finished {
            return;
        }
        self.shared.stop.store(true, Ordering::Release);
        let t = Instant::now();
        let mut warned = false;
        while self.shared.outstanding.load(Ordering::Acquire) > 0 {
            std::thread::sleep(Duration::from_millis(1));
            if !warned && t.elapsed() > Duration::from_secs(10) {
                log::warn!("still waiting for in-flight copies of a stopped batch");
                warned = true;
            }
        }
        self.events.clear();
        self.bufs.clear();
        self.shared.complete(Err(CopyError {
            op: self.next_op,
            offset: 0,
            len: 0,
            host: 0,
            error: Error::Cancelled("the copy engine stopped before the batch finished".into()),
        }));
    }
}

/// The handle of a submitted batch: `.await` it, [`wait`](CopyHandle::wait) on it, or poll it
/// with [`try_take`](CopyHandle::try_take).
///
/// It resolves once every chunk has completed and everything the batch held was released, to
/// [`CopyStats`] or to the batch's first [`CopyError`] (after which no further chunk is issued;
/// chunks already in flight are awaited first). Dropping a handle that has not completed
/// cancels the chunks not yet issued and **blocks** until those in flight complete, so host
/// memory is never written after the drop returns. `Send + Sync`; resolves once (a second poll
/// after the result was taken yields an error).
pub struct CopyHandle {
    shared: Arc<BatchShared>,
    issuer: Thread,
    taken: bool,
}

impl std::fmt::Debug for CopyHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CopyHandle")
            .field("done", &self.is_done())
            .field("bytes_done", &self.bytes_done())
            .finish()
    }
}

impl CopyHandle {
    /// Whether the batch has completed (result available or taken).
    pub fn is_done(&self) -> bool {
        self.shared.lock_done().finished
    }

    /// Bytes of chunks completed successfully so far.
    pub fn bytes_done(&self) -> u64 {
        self.shared.bytes_done.load(Ordering::Relaxed)
    }

    /// Stops issuing the batch's remaining chunks; chunks in flight still complete. The result
    /// is [`Error::Cancelled`] unless every chunk had already been issued.
    pub fn cancel(&self) {
        self.shared.cancelled.store(true, Ordering::Release);
        self.shared.stop.store(true, Ordering::Release);
        self.issuer.unpark();
    }

    /// Blocks up to `timeout` for completion; returns whether the batch is done.
    pub fn wait_timeout(&self, timeout: Duration) -> bool {
        let g = self.shared.lock_done();
        let (g, _) = self
            .shared
            .cv
            .wait_timeout_while(g, timeout, |d| !d.finished)
            .unwrap_or_else(|p| p.into_inner());
        g.finished
    }

    /// Blocks until the batch completes and returns its result.
    pub fn wait(mut self) -> std::result::Result<CopyStats, CopyError> {
        let mut g = self.shared.lock_done();
        while !g.finished {
            g = self.shared.cv.wait(g).unwrap_or_else(|p| p.into_inner());
        }
        let r = g.result.take();
        drop(g);
        self.taken = true;
        r.unwrap_or_else(|| Err(taken_error()))
    }

    /// The result if the batch has completed (non-blocking poll); `None` while it runs.
    pub fn try_take(&mut self) -> Option<std::result::Result<CopyStats, CopyError>> {
        let mut g = self.shared.lock_done();
        if !g.finished {
            return None;
        }
        let r = g.result.take();
        drop(g);
        if self.taken {
            return Some(Err(taken_error()));
        }
        self.taken = true;
        Some(r.unwrap_or_else(|| Err(taken_error())))
    }
}

fn taken_error() -> CopyError {
    CopyError {
        op: 0,
        offset: 0,
        len: 0,
        host: 0,
        error: Error::InvalidArgument("the batch's result was already taken".into()),
    }
}

impl Future for CopyHandle {
    type Output = std::result::Result<CopyStats, CopyError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        {
            let mut g = self.shared.lock_done();
            if !g.finished {
                match &g.waker {
                    Some(w) if w.will_wake(cx.waker()) => {}
                    _ => g.waker = Some(cx.waker().clone()),
                }
                return Poll::Pending;
            }
        }
        match self.try_take() {
            Some(r) => Poll::Ready(r),
            None => Poll::Ready(Err(taken_error())),
        }
    }
}

impl Drop for CopyHandle {
    fn drop(&mut self) {
        if self.is_done() {
            return;
        }
        self.cancel();
        let mut g = self.shared.lock_done();
        while !g.finished {
            g = self.shared.cv.wait(g).unwrap_or_else(|p| p.into_inner());
        }
    }
}
