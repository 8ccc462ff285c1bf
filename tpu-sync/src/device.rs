//! Batched raw block copies between PJRT device buffers and host memory.
//!
//! A batch is a list of [`RawCopy`] operations (device buffer, byte offset, length, host address),
//! typically one per (layer, K/V, block run). D2H issues every `PJRT_Buffer_CopyRawToHost` first
//! and then awaits the events, so the plugin can run them in parallel (on the CPU plugin 16
//! concurrent chunks reach about twice single-thread memcpy: `../shared/docs/pjrt-plugins.md` §2).
//! In-place H2D uses the path recorded in [`Capabilities`].
//!
//! Errors: a range outside a buffer's on-device size or a deleted buffer is
//! [`Error::InvalidArgument`] before any copy is issued; a plugin error is returned after every
//! copy already issued has completed, so host memory is never written after the call returns.

use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::pjrt::{Capabilities, DeviceBuffer, Event, H2dPath};

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
    /// Copy operations issued.
    pub ops: u64,
    /// Wall time from the first issue to the last completion.
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

fn validate(ops: &[RawCopy<'_>]) -> Result<()> {
    let mut checked: Vec<*mut crate::pjrt::sys::PJRT_Buffer> = Vec::new();
    for op in ops {
        op.buffer.check_range(op.offset, op.len)?;
        if op.host.is_null() {
            return Err(Error::InvalidArgument(
                "NULL host address in copy batch".into(),
            ));
        }
        let raw = op.buffer.raw();
        if !checked.contains(&raw) {
            op.buffer.check_live()?;
            checked.push(raw);
        }
    }
    Ok(())
}

/// Device-to-host: copies every op's device range into its host address; returns when all are
/// done.
///
/// At most `max_outstanding` copies are in flight at once (0 means unlimited).
///
/// # Safety
/// Every `host..host+len` must be valid for writes and not accessed by anyone else until this
/// function returns.
pub unsafe fn d2h_batch(ops: &[RawCopy<'_>], max_outstanding: usize) -> Result<CopyStats> {
    validate(ops)?;
    let start = Instant::now();
    let mut pending: std::collections::VecDeque<Event> = std::collections::VecDeque::new();
    let mut first_err: Option<Error> = None;
    let mut bytes = 0;
    for op in ops {
        if max_outstanding > 0 && pending.len() >= max_outstanding {
            if let Some(ev) = pending.pop_front() {
                if let Err(e) = ev.wait() {
                    first_err.get_or_insert(e);
                }
            }
        }
        if first_err.is_some() {
            break;
        }
        if op.len == 0 {
            continue;
        }
        // SAFETY: validity of the host range is the caller's contract; we wait on every event
        // before returning.
        match unsafe { op.buffer.copy_raw_to_host_async(op.offset, op.host, op.len) } {
            Ok(ev) => {
                pending.push_back(ev);
                bytes += op.len;
            }
            Err(e) => {
                first_err = Some(e);
                break;
            }
        }
    }
    for ev in pending {
        if let Err(e) = ev.wait() {
            first_err.get_or_insert(e);
        }
    }
    match first_err {
        Some(e) => Err(e),
        None => Ok(CopyStats {
            bytes,
            ops: ops.len() as u64,
            elapsed: start.elapsed(),
        }),
    }
}

/// Host-to-device in place: writes every op's host bytes into the existing device buffer range,
/// using the in-place path probed in `caps`.
///
/// Errors with [`Error::Unsupported`] when the plugin has no in-place path.
///
/// # Safety
/// Every `host..host+len` must be valid for reads and not modified until this function returns.
/// No computation may be reading or writing the destination ranges concurrently (the caller owns
/// those blocks, as a serving engine owns blocks it allocated to a request).
pub unsafe fn h2d_batch(caps: &Capabilities, ops: &[RawCopy<'_>]) -> Result<CopyStats> {
    validate(ops)?;
    let start = Instant::now();
    match caps.require_h2d()? {
        H2dPath::HostAddressable => {
            // Group by buffer so each buffer's ready event is awaited and referenced once.
            let mut order: Vec<usize> = (0..ops.len()).collect();
            order.sort_by_key(|&i| (ops[i].buffer.raw() as usize, ops[i].offset));
            let mut bytes = 0u64;
            let mut i = 0;
            while i < order.len() {
                let buf = ops[order[i]].buffer;
                buf.ready_event()?.wait()?;
                let guard = buf.external_ref()?;
                let base = guard.opaque_device_ptr()?;
                if base.is_null() {
                    return Err(Error::Unsupported {
                        plugin: caps.platform.clone(),
                        what: "OpaqueDeviceMemoryDataPointer returned NULL".into(),
                    });
                }
                while i < order.len() && ops[order[i]].buffer.raw() == buf.raw() {
                    let op = ops[order[i]];
                    // SAFETY: the range was validated against the on-device size; the device
                    // memory is host-addressable (probed) and kept alive by `guard`; the host
                    // source is valid per the caller's contract and does not overlap device
                    // memory (distinct allocations).
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            op.host as *const u8,
                            base.add(op.offset as usize),
                            op.len as usize,
                        )
                    };
                    bytes += op.len;
                    i += 1;
                }
                drop(guard);
            }
            Ok(CopyStats {
                bytes,
                ops: ops.len() as u64,
                elapsed: start.elapsed(),
            })
        }
        H2dPath::RawBufferExtension { .. } => Err(Error::Unsupported {
            plugin: caps.platform.clone(),
            what: "in-place H2D through the RawBuffer extension is not implemented in this build"
                .into(),
        }),
        H2dPath::Unsupported(r) => Err(Error::Unsupported {
            plugin: caps.platform.clone(),
            what: r.clone(),
        }),
    }
}
