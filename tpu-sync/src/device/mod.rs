//! Batched, asynchronous, paced raw copies between PJRT device buffers and host memory.
//!
//! A batch is a list of raw copies (device buffer, byte offset, length, host address), typically
//! one per (layer, K/V, block run) of a request, issued as one operation:
//!
//! ```no_run
//! # fn demo(buffers: &[tpu_sync::pjrt::DeviceBuffer], dst: &mut [u8]) -> tpu_sync::Result<()> {
//! use tpu_sync::device::{CopyBatch, Pacer};
//! let mut batch = CopyBatch::d2h();
//! for (i, b) in buffers.iter().enumerate() {
//!     batch.push(b, 0, 4096, dst[i * 4096..].as_mut_ptr())?;
//! }
//! // SAFETY: `dst` outlives the handle and nobody else touches it meanwhile.
//! let handle = unsafe { batch.submit(Pacer::global()) }?;
//! let stats = handle.wait()?; // or `handle.await`, or poll with `try_take`
//! # let _ = stats; Ok(()) }
//! ```
//!
//! * **D2H** is `PJRT_Buffer_CopyRawToHost(offset, size)` per chunk, every chunk issued before
//!   any is awaited, so the plugin runs them in parallel (16 concurrent chunks reach about twice
//!   single-thread `memcpy` on the CPU plugin: `docs/plugins-and-engines.md`, "CPU plugin: copy
//!   speed"). When every buffer of a batch is host-addressable (`PJRT_Buffer_IsOnCpu`: the XLA
//!   CPU plugin) it is a `memcpy` from the device memory on the copy engine's workers after the
//!   buffers' ready events instead ([`d2h_host_addressable`]). Adjacent copies (same buffer,
//!   device and host bytes continuing the previous copy) are merged into one.
//! * **In-place H2D** uses the path [`crate::pjrt::Capabilities`] probed: the
//!   RawBuffer extension (`CreateRawAliasOfBuffer` + `CopyRawHostToDevice`, libtpu), else
//!   host-addressable device memory (the XLA CPU plugin), else [`Error::Unsupported`](crate::Error::Unsupported) naming the
//!   plugin and what is missing (the CUDA plugin has neither).
//! * **Pacing** ([`Pacer`], [`PacingConfig`]): chunks of at most `chunk_bytes`, at most
//!   `max_inflight_bytes` outstanding per process, FIFO across callers; defaults 16 MiB / 64
//!   MiB as Google's TPU Sync; counters in [`PacerStats`].
//! * **Completion**: one [`CopyHandle`] per batch, a [`Future`](std::future::Future) that also
//!   blocks ([`CopyHandle::wait`]) or polls ([`CopyHandle::try_take`]), and reports the batch's
//!   first error with its span ([`CopyError`]).
//!
//! Errors found before anything is issued (a range outside a buffer's on-device size, a deleted
//! buffer, overlapping destinations, a missing path) fail the push or the submit and copy
//! nothing. A plugin error fails the batch after every chunk already issued has completed, so
//! host memory is never written after the handle completes.
//!
//! [`d2h_batch`] and [`h2d_batch`] are the blocking forms over [`Pacer::global`].

mod batch;
pub mod pacing;

use std::time::Duration;

pub use batch::{CopyBatch, CopyError, CopyHandle, Direction, INLINE_COPY_BYTES};
pub use pacing::{Pacer, PacerStats, PacingConfig};

use crate::error::Result;
use crate::pjrt::{Capabilities, DeviceBuffer};

/// One raw copy between `len` bytes of a device buffer at `offset` and host memory at `host`.
#[derive(Debug, Clone, Copy)]
pub struct RawCopy<'a> {
    /// The device buffer.
    pub buffer: &'a DeviceBuffer,
    /// Byte offset into the buffer's on-device bytes.
    pub offset: u64,
    /// Number of bytes.
    pub len: u64,
    /// Host address (source for H2D, destination for D2H).
    pub host: *mut u8,
}

/// What a batch moved and how long it took.
#[derive(Debug, Clone, Copy, Default)]
pub struct CopyStats {
    /// Bytes copied.
    pub bytes: u64,
    /// Copies in the batch (as pushed).
    pub ops: u64,
    /// Chunks issued to the plugin (copies split by the pacer's `chunk_bytes`).
    pub chunks: u64,
    /// Wall time from submission to completion.
    pub elapsed: Duration,
}

impl CopyStats {
    /// Throughput in GB/s (1e9 bytes per second).
    pub fn gbps(&self) -> f64 {
        let s = self.elapsed.as_secs_f64();
        if s > 0.0 {
            self.bytes as f64 / s / 1e9
        } else {
            0.0
        }
    }
}

/// Environment variable: `0` makes D2H use `PJRT_Buffer_CopyRawToHost` even on host-addressable
/// device memory (see [`set_d2h_host_addressable`]).
pub const ENV_D2H_HOST_ADDRESSABLE: &str = "TPU_SYNC_D2H_HOST_ADDRESSABLE";

static D2H_HOST: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(0);

/// Whether D2H batches whose buffers are all host-addressable (`PJRT_Buffer_IsOnCpu`, the XLA
/// CPU plugin) copy with `memcpy` on the copy engine's worker threads after each buffer's ready
/// event, instead of one `PJRT_Buffer_CopyRawToHost` call, event and callback per chunk (which
/// on the CPU plugin costs several times the copy itself for KV-block-sized pieces). Default:
/// on, unless [`ENV_D2H_HOST_ADDRESSABLE`] is `0`. Buffers that are not host-addressable (TPU,
/// GPU) always use `CopyRawToHost`.
pub fn d2h_host_addressable() -> bool {
    use std::sync::atomic::Ordering;
    match D2H_HOST.load(Ordering::Relaxed) {
        1 => true,
        2 => false,
        _ => {
            let on = std::env::var(ENV_D2H_HOST_ADDRESSABLE)
                .map(|v| v.trim() != "0")
                .unwrap_or(true);
            D2H_HOST.store(if on { 1 } else { 2 }, Ordering::Relaxed);
            on
        }
    }
}

/// Turns the host-addressable D2H path on or off for batches submitted from now on (process
/// wide; see [`d2h_host_addressable`]). Thread-safe.
pub fn set_d2h_host_addressable(on: bool) {
    D2H_HOST.store(if on { 1 } else { 2 }, std::sync::atomic::Ordering::Relaxed);
}

fn batch_of(mut batch: CopyBatch, ops: &[RawCopy<'_>]) -> Result<CopyBatch> {
    for op in ops {
        batch.push(op.buffer, op.offset, op.len, op.host)?;
    }
    Ok(batch)
}

/// Device-to-host: copies every op's device range into its host address through
/// [`Pacer::global`]; returns when all are done.
///
/// At most `max_outstanding` chunks of this batch are in flight at once (0: only the pacer's
/// byte budget limits it).
///
/// Errors: as [`CopyBatch::push`] and [`CopyBatch::submit`], and the batch's first copy error
/// (converted with its span).
///
/// # Safety
/// Every `host..host+len` must be valid for writes and not accessed by anyone else until this
/// function returns.
pub unsafe fn d2h_batch(ops: &[RawCopy<'_>], max_outstanding: usize) -> Result<CopyStats> {
    let _span = tracing::info_span!(
        "stage_d2h",
        copies = ops.len(),
        bytes = ops.iter().map(|o| o.len).sum::<u64>()
    )
    .entered();
    let mut batch = batch_of(CopyBatch::d2h(), ops)?;
    batch.set_max_outstanding_chunks(max_outstanding);
    // SAFETY: forwarded caller contract; we wait for completion before returning.
    let handle = unsafe { batch.submit(Pacer::global()) }?;
    Ok(handle.wait()?)
}

/// Host-to-device in place: writes every op's host bytes into the existing device buffer range
/// through [`Pacer::global`], using the in-place path probed in `caps`.
///
/// Errors: [`crate::Error::Unsupported`] when the plugin has no in-place path; otherwise as
/// [`d2h_batch`].
///
/// # Safety
/// Every `host..host+len` must be valid for reads and not modified until this function returns.
/// No computation may be reading or writing the destination ranges concurrently (the caller owns
/// those blocks, as a serving engine owns blocks it allocated to a request).
pub unsafe fn h2d_batch(caps: &Capabilities, ops: &[RawCopy<'_>]) -> Result<CopyStats> {
    let _span = tracing::info_span!(
        "h2d",
        copies = ops.len(),
        bytes = ops.iter().map(|o| o.len).sum::<u64>()
    )
    .entered();
    let batch = batch_of(CopyBatch::h2d(caps)?, ops)?;
    // SAFETY: forwarded caller contract; we wait for completion before returning.
    let handle = unsafe { batch.submit(Pacer::global()) }?;
    Ok(handle.wait()?)
}

/// [`h2d_batch`] only if it can run on the calling thread without waiting (see
/// [`CopyBatch::submit_inline_only`]): `Ok(None)` when it cannot, and then nothing was copied.
/// For an async runtime's worker threads.
///
/// # Safety
/// As [`h2d_batch`].
pub unsafe fn try_h2d_batch_inline(
    caps: &Capabilities,
    ops: &[RawCopy<'_>],
) -> Result<Option<CopyStats>> {
    let batch = batch_of(CopyBatch::h2d(caps)?, ops)?;
    // SAFETY: forwarded caller contract; an inline batch is complete when this returns.
    match unsafe { batch.submit_inline_only(Pacer::global()) }? {
        Some(handle) => Ok(Some(handle.wait()?)),
        None => Ok(None),
    }
}
