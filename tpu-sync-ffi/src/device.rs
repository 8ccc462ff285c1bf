//! The device layer over the C ABI: adopting a caller's PJRT objects, zero-copy views of
//! caller memory, buffer descriptions, asynchronous batched copies with completions, and DMA
//! pacing.

use std::ffi::{c_char, c_void};
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use tpu_sync::device::{CopyBatch, CopyHandle, Pacer, PacingConfig};
use tpu_sync::pjrt::{sys, Client, DeviceBuffer, Plugin, ViewReleased};

use crate::api::{
    element_type, out, out_string, str_arg, tpu_sync_buffer, tpu_sync_client, BufferObj, ClientObj,
};
use crate::completion::{self, tpu_sync_callback, Completion};
use crate::handle::{self, tpu_sync_handle_kind as K};
use crate::status::{boundary, invalid, null, tpu_sync_status, Failure, FfiResult};

/// Most entries accepted in one array argument (copies of a batch, keys of a chain, ...): a
/// guard against a garbage count, far above any real batch.
pub(crate) const MAX_ITEMS: usize = 1 << 24;

/// Checks an (array pointer, count) argument pair and returns the array as a slice.
///
/// # Safety
/// When `n > 0` and `p` is not NULL, `p` must point to `n` readable values.
pub(crate) unsafe fn slice_arg<'a, T>(p: *const T, n: usize, name: &str) -> FfiResult<&'a [T]> {
    if n == 0 {
        return Ok(&[]);
    }
    if p.is_null() {
        return Err(null(name));
    }
    if n > MAX_ITEMS {
        return Err(invalid(format!(
            "`{name}` has {n} entries (at most {MAX_ITEMS})"
        )));
    }
    // SAFETY: non-NULL, `n` readable values per the caller's contract.
    Ok(unsafe { std::slice::from_raw_parts(p, n) })
}

/// Index of the device a buffer lives on, among the client's addressable devices.
pub(crate) fn device_index_of(client: &Client, buffer: &DeviceBuffer) -> usize {
    client
        .addressable_devices()
        .iter()
        .position(|d| buffer.is_on(d))
        .unwrap_or(usize::MAX)
}

// ---------------------------------------------------------------------------------------------
// Adoption of caller-owned PJRT objects

/// Adopts a PJRT client that the caller created (e.g. the serving framework's own client) through
/// a `PJRT_Api` table the caller loaded (`GetPjrtApi()`), and probes its copy paths.
///
/// * `pjrt_api`: a `const PJRT_Api*`. Borrowed for the rest of the process: the table must stay
///   valid and unchanged (as `GetPjrtApi` guarantees). Nothing is loaded or initialised again.
/// * `pjrt_client`: a live `PJRT_Client*` created through `pjrt_api`. Borrowed: it is never
///   destroyed by this library, and the caller must keep it alive until this handle and every
///   buffer, copy, store and endpoint using it are freed.
/// * `client_out`: receives a new handle owned by the caller (free with `tpu_sync_client_free`,
///   which does not destroy the PJRT client).
///
/// Errors: `TPU_SYNC_NULL_POINTER`; `TPU_SYNC_PLUGIN_LOAD` for a table too small or of another
/// major version; `TPU_SYNC_PJRT` when the client does not answer.
///
/// # Safety
/// The pointers must be what the description says; a dangling one cannot be detected.
#[no_mangle]
pub unsafe extern "C" fn tpu_sync_client_adopt(
    pjrt_api: *const c_void,
    pjrt_client: *mut c_void,
    client_out: *mut *mut tpu_sync_client,
) -> tpu_sync_status {
    boundary("tpu_sync_client_adopt", || {
        if pjrt_api.is_null() {
            return Err(null("pjrt_api"));
        }
        if pjrt_client.is_null() {
            return Err(null("pjrt_client"));
        }
        if client_out.is_null() {
            return Err(null("client_out"));
        }
        // SAFETY: caller contract: a valid PJRT_Api table for the process lifetime.
        let plugin = unsafe { Plugin::adopt(pjrt_api as *const sys::PJRT_Api, "caller") }?;
        // SAFETY: caller contract: a live client of this API.
        let client = unsafe { Client::adopt(&plugin, pjrt_client as *mut sys::PJRT_Client) }?;
        let h = ClientObj::into_handle(client)?;
        // SAFETY: checked non-NULL.
        unsafe { out(client_out, h, "client_out") }
    })
}

/// The client's raw PJRT objects: its `const PJRT_Api*` (`api_out`) and `PJRT_Client*`
/// (`client_out`); either out-pointer may be NULL. Both are borrowed: valid while the handle (or
/// anything created from it) lives; never destroy them. For handing this library's client to
/// other PJRT code, or adopting it again.
///
/// # Safety
/// Non-NULL out-pointers must be writable.
#[no_mangle]
pub unsafe extern "C" fn tpu_sync_client_pjrt(
    client: *const tpu_sync_client,
    api_out: *mut *const c_void,
    client_out: *mut *mut c_void,
) -> tpu_sync_status {
    boundary("tpu_sync_client_pjrt", || {
        let c: Arc<ClientObj> = handle::get(K::TPU_SYNC_HANDLE_CLIENT, client)?;
        if !api_out.is_null() {
            // SAFETY: non-NULL, writable per contract.
            unsafe { *api_out = c.client.plugin().raw_api() as *const c_void };
        }
        if !client_out.is_null() {
            // SAFETY: non-NULL, writable per contract.
            unsafe { *client_out = c.client.raw() as *mut c_void };
        }
        Ok(())
    })
}

/// Adopts a `PJRT_Buffer*` owned by the caller (e.g. one layer of a framework's KV cache) as a
/// buffer handle of `client`.
///
/// The PJRT buffer is never destroyed by this library; the caller keeps it alive until this
/// handle is freed and every copy using it has completed (while a copy runs, the library holds a
/// PJRT external reference on it). `buffer_out` receives a new handle owned by the caller.
///
/// Errors: `TPU_SYNC_NULL_POINTER`; `TPU_SYNC_INVALID_ARGUMENT` for a buffer on a device that is
/// not one of `client`'s (a buffer of another client) or of an element type that is not
/// byte-granular.
///
/// # Safety
/// `pjrt_buffer` must be a live `PJRT_Buffer*` of the same PJRT API as `client`.
#[no_mangle]
pub unsafe extern "C" fn tpu_sync_buffer_adopt(
    client: *const tpu_sync_client,
    pjrt_buffer: *mut c_void,
    buffer_out: *mut *mut tpu_sync_buffer,
) -> tpu_sync_status {
    boundary("tpu_sync_buffer_adopt", || {
        let c: Arc<ClientObj> = handle::get(K::TPU_SYNC_HANDLE_CLIENT, client)?;
        if pjrt_buffer.is_null() {
            return Err(null("pjrt_buffer"));
        }
        if buffer_out.is_null() {
            return Err(null("buffer_out"));
        }
        // SAFETY: caller contract: a live buffer of this API.
        let buffer =
            unsafe { DeviceBuffer::adopt(&c.client, pjrt_buffer as *mut sys::PJRT_Buffer) }?;
        let device = device_index_of(&c.client, &buffer);
        let h = handle::insert(
            K::TPU_SYNC_HANDLE_BUFFER,
            Arc::new(BufferObj {
                buffer,
                caps: c.caps.clone(),
                device,
                released: None,
            }),
        );
        // SAFETY: checked non-NULL.
        unsafe { out(buffer_out, h, "buffer_out") }
    })
}

/// The buffer's raw `PJRT_Buffer*`, written to `pjrt_buffer_out`. Borrowed: valid while the
/// handle (or a copy using it) lives; never destroy it.
///
/// # Safety
/// `pjrt_buffer_out` must be writable.
#[no_mangle]
pub unsafe extern "C" fn tpu_sync_buffer_pjrt(
    buffer: *const tpu_sync_buffer,
    pjrt_buffer_out: *mut *mut c_void,
) -> tpu_sync_status {
    boundary("tpu_sync_buffer_pjrt", || {
        let b: Arc<BufferObj> = handle::get(K::TPU_SYNC_HANDLE_BUFFER, buffer)?;
        // SAFETY: forwarded caller contract.
        unsafe {
            out(
                pjrt_buffer_out,
                b.buffer.raw() as *mut c_void,
                "pjrt_buffer_out",
            )
        }
    })
}

/// Writes a JSON description of the buffer into `buf` (NUL-terminated; `buf`/`buf_len`/`len_out`
/// as for `tpu_sync_client_info`): `{"dims": [...], "dtype": "bf16", "on_device_size": bytes,
/// "logical_size": bytes, "physical_layout": "{2,1,0}" or null, "device": index, "owned": bool,
/// "view": bool, "platform": "cpu"}`. `physical_layout` is the plugin's serialization of the
/// buffer's memory layout (null when the plugin offers none): raw bytes of two buffers are
/// interchangeable only when dtype, dims and this layout are equal.
///
/// # Safety
/// `buf` must have `buf_len` writable bytes (or be NULL with `buf_len` 0); `len_out` NULL or
/// writable.
#[no_mangle]
pub unsafe extern "C" fn tpu_sync_buffer_info(
    buffer: *const tpu_sync_buffer,
    buf: *mut c_char,
    buf_len: usize,
    len_out: *mut usize,
) -> tpu_sync_status {
    boundary("tpu_sync_buffer_info", || {
        let b: Arc<BufferObj> = handle::get(K::TPU_SYNC_HANDLE_BUFFER, buffer)?;
        let v = serde_json::json!({
            "dims": b.buffer.dims(),
            "dtype": b.buffer.element_type().name(),
            "on_device_size": b.buffer.on_device_size(),
            "logical_size": b.buffer.logical_size(),
            "physical_layout": b.buffer.physical_layout(),
            "device": b.device,
            "owned": b.buffer.is_owned(),
            "view": b.released.is_some(),
            "platform": b.buffer.platform_name(),
        });
        // SAFETY: forwarded caller contract.
        unsafe { out_string(&v.to_string(), buf, buf_len, len_out) }
    })
}

// ---------------------------------------------------------------------------------------------
// Views of caller memory

/// Opaque handle telling when the plugin released the memory behind a view (see
/// [`tpu_sync_client_view`]). Outlives the view's buffer handle. Free with
/// [`tpu_sync_release_free`]. Thread-safe.
pub struct tpu_sync_release {
    _private: [u8; 0],
}

/// Wraps existing memory as a PJRT buffer **without copying** (`PJRT_Client_CreateViewOfDeviceBuffer`):
/// a host array on the XLA CPU plugin, or a device pointer (a torch tensor's `data_ptr()`, a JAX
/// array's `unsafe_buffer_pointer()`) on an accelerator plugin.
///
/// * `ptr`: address of a dense row-major array of shape `dims[0..ndims]` and element type `dtype`
///   (a `tpu_sync_dtype`) on device `device_index`; must be **64-byte aligned** (the CPU plugin
///   silently copies less aligned memory, so it is refused with `TPU_SYNC_INVALID_ARGUMENT`).
/// * `len`: bytes available at `ptr`; must be at least the shape's byte size.
/// * `memory_kind`: NUL-terminated memory space kind of the device (e.g. `"device"`,
///   `"pinned_host"`), or NULL for the device's default memory. Borrowed for the call.
/// * `buffer_out`: receives a new buffer handle owned by the caller. Reads and writes through it
///   and through `ptr` alias each other.
/// * `release_out`: NULL, or receives a new `tpu_sync_release` handle owned by the caller.
///
/// **Lifetime of the memory**: `ptr..ptr+len` stays owned by the caller but must remain valid
/// and not be reused until the plugin has released it, which happens after the buffer handle is
/// freed and every copy using it has completed, asynchronously (up to about 100 ms later on the
/// CPU plugin). [`tpu_sync_release_wait`] on `release_out` tells when; without a release handle
/// the memory must stay valid for the life of the process.
///
/// Errors: `TPU_SYNC_INVALID_ARGUMENT` (NULL or misaligned `ptr`, `len` too small, bad shape or
/// dtype, unknown device or memory kind, or a plugin that copied instead of aliasing);
/// `TPU_SYNC_UNSUPPORTED` / `TPU_SYNC_PJRT` when the plugin cannot make views (libtpu).
///
/// # Safety
/// `ptr` must be valid device memory as described; `dims` must hold `ndims` values;
/// `memory_kind` NULL or NUL-terminated; the out-pointers writable.
#[no_mangle]
pub unsafe extern "C" fn tpu_sync_client_view(
    client: *const tpu_sync_client,
    device_index: usize,
    ptr: *mut c_void,
    len: usize,
    dims: *const i64,
    ndims: usize,
    dtype: u32,
    memory_kind: *const c_char,
    buffer_out: *mut *mut tpu_sync_buffer,
    release_out: *mut *mut tpu_sync_release,
) -> tpu_sync_status {
    boundary("tpu_sync_client_view", || {
        let c: Arc<ClientObj> = handle::get(K::TPU_SYNC_HANDLE_CLIENT, client)?;
        if buffer_out.is_null() {
            return Err(null("buffer_out"));
        }
        if ptr.is_null() {
            return Err(null("ptr"));
        }
        if ndims > 16 {
            return Err(invalid(format!("{ndims} dimensions (at most 16)")));
        }
        // SAFETY: caller contract: `dims` has `ndims` values.
        let dims = unsafe { slice_arg(dims, ndims, "dims") }?;
        let ty = element_type(dtype)?;
        let need = ty.shape_bytes(dims)?;
        if (len as u64) < need {
            return Err(invalid(format!(
                "view of shape {dims:?} {} needs {need} bytes, {len} given",
                ty.name()
            )));
        }
        let dev = c.client.device(device_index)?;
        let memory = if memory_kind.is_null() {
            None
        } else {
            // SAFETY: caller contract: NUL-terminated.
            let kind = unsafe { str_arg(memory_kind, "memory_kind") }?;
            let mems = dev.memories()?;
            let kinds: Vec<String> = mems.iter().map(|m| m.kind().to_string()).collect();
            Some(mems.into_iter().find(|m| m.kind() == kind).ok_or_else(|| {
                invalid(format!(
                    "device {device_index} has no memory of kind `{kind}` (it has {kinds:?})"
                ))
            })?)
        };
        // SAFETY: caller contract: `ptr..ptr+len` is device memory of `dev` that stays valid
        // until the release handle reports the release.
        let view = unsafe {
            c.client
                .view_of_device_memory(ptr as *mut u8, ty, dims, &dev, memory.as_ref())
        }?;
        let rel = if release_out.is_null() {
            None
        } else {
            Some(handle::insert::<ViewReleased, tpu_sync_release>(
                K::TPU_SYNC_HANDLE_RELEASE,
                Arc::new(view.released.clone()),
            ))
        };
        let h = handle::insert(
            K::TPU_SYNC_HANDLE_BUFFER,
            Arc::new(BufferObj {
                buffer: view.buffer,
                caps: c.caps.clone(),
                device: device_index,
                released: Some(view.released),
            }),
        );
        // SAFETY: checked non-NULL.
        unsafe { out(buffer_out, h, "buffer_out") }?;
        if let Some(r) = rel {
            // SAFETY: checked non-NULL; caller contract says writable.
            unsafe { *release_out = r };
        }
        Ok(())
    })
}

/// Waits up to `timeout_ms` milliseconds (0: just check; negative: without limit) for the plugin
/// to release a view's memory. Returns `TPU_SYNC_OK` once released (the memory may then be freed
/// or reused), `TPU_SYNC_PENDING` if not yet.
#[no_mangle]
pub extern "C" fn tpu_sync_release_wait(
    release: *const tpu_sync_release,
    timeout_ms: i64,
) -> tpu_sync_status {
    boundary("tpu_sync_release_wait", || {
        let r: Arc<ViewReleased> = handle::get(K::TPU_SYNC_HANDLE_RELEASE, release)?;
        let released = match crate::completion::timeout_ms(timeout_ms) {
            Some(t) => r.wait(t),
            None => loop {
                if r.wait(Duration::from_secs(3600)) {
                    break true;
                }
            },
        };
        if released {
            Ok(())
        } else {
            Err(Failure(
                tpu_sync_status::TPU_SYNC_PENDING,
                "the plugin has not released the view's memory yet (is the buffer handle, or a \
                 copy using it, still alive?)"
                    .into(),
            ))
        }
    })
}

/// Frees a release handle (the view and its memory are not affected).
#[no_mangle]
pub extern "C" fn tpu_sync_release_free(release: *mut tpu_sync_release) -> tpu_sync_status {
    boundary("tpu_sync_release_free", || {
        handle::remove(K::TPU_SYNC_HANDLE_RELEASE, release)?;
        Ok(())
    })
}

// ---------------------------------------------------------------------------------------------
// Asynchronous batched copies

/// Direction of a copy batch (values are stable).
#[repr(u32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum tpu_sync_direction {
    /// Device to host (`PJRT_Buffer_CopyRawToHost`).
    TPU_SYNC_D2H = 1,
    /// Host to device, in place into existing buffers (the client's probed H2D path).
    TPU_SYNC_H2D = 2,
}

/// One raw copy of a batch: `len` bytes at byte `offset` of `buffer`'s on-device bytes, to
/// (D2H) or from (H2D) host memory at `host`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct tpu_sync_copy_op {
    /// The device buffer (borrowed for the `tpu_sync_copy_submit` call; the batch keeps what it
    /// needs alive itself).
    pub buffer: *const tpu_sync_buffer,
    /// Byte offset into the buffer's on-device bytes.
    pub offset: u64,
    /// Bytes to copy.
    pub len: u64,
    /// Host address: destination (D2H) or source (H2D) of `len` bytes.
    pub host: *mut c_void,
}

/// What a completed copy batch moved.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct tpu_sync_copy_stats {
    /// Bytes copied.
    pub bytes: u64,
    /// Copies in the batch.
    pub ops: u64,
    /// Chunks issued to the plugin (copies split by the pacing chunk size).
    pub chunks: u64,
    /// Nanoseconds from submission to completion.
    pub elapsed_ns: u64,
}

/// Opaque handle of a submitted copy batch (an asynchronous operation). Free with
/// [`tpu_sync_copy_free`]. Thread-safe.
pub struct tpu_sync_copy {
    _private: [u8; 0],
}

pub(crate) struct CopyObj {
    handle: Arc<Mutex<CopyHandle>>,
    completion: Arc<Completion<tpu_sync_copy_stats>>,
}

struct CopyFuture {
    handle: Arc<Mutex<CopyHandle>>,
}

impl Future for CopyFuture {
    type Output = Result<tpu_sync_copy_stats, Failure>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut h = self.handle.lock().unwrap_or_else(|p| p.into_inner());
        match Pin::new(&mut *h).poll(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(Ok(s)) => Poll::Ready(Ok(tpu_sync_copy_stats {
                bytes: s.bytes,
                ops: s.ops,
                chunks: s.chunks,
                elapsed_ns: s.elapsed.as_nanos().min(u64::MAX as u128) as u64,
            })),
            Poll::Ready(Err(e)) => Poll::Ready(Err(Failure::from(tpu_sync::Error::from(e)))),
        }
    }
}

/// Submits a batch of raw copies in one direction (a `tpu_sync_direction`) through the
/// process-wide DMA pacer and returns at once; the copies run asynchronously (D2H chunks are all
/// issued before any is awaited).
///
/// * `ops[0..num_ops]`: the copies (borrowed for the call). Every range is checked against its
///   buffer's on-device size, D2H host destinations must not overlap each other, nor H2D device
///   destinations; H2D needs every buffer to come from the same plugin.
/// * `max_outstanding_chunks`: most chunks of this batch in flight at once (0: only the pacer's
///   byte budget limits it).
/// * `copy_out`: receives a new handle owned by the caller.
///
/// **Host memory**: every `host..host+len` must stay valid (writable for D2H, readable and
/// unmodified for H2D) and untouched by others until the batch is complete: `tpu_sync_copy_wait`
/// returned something other than `TPU_SYNC_PENDING`, `tpu_sync_copy_poll` reported done, the
/// callback ran, or `tpu_sync_copy_free` returned. No computation may use the H2D destination
/// ranges meanwhile.
///
/// Errors (nothing is issued): `TPU_SYNC_INVALID_ARGUMENT` (bad direction, range outside a
/// buffer, NULL host address, overlaps, deleted buffer, mixed plugins), `TPU_SYNC_UNSUPPORTED`
/// (no in-place H2D path), `TPU_SYNC_INVALID_HANDLE`.
///
/// # Safety
/// `ops` must hold `num_ops` entries; `copy_out` writable; the host memory contract above.
#[no_mangle]
pub unsafe extern "C" fn tpu_sync_copy_submit(
    direction: u32,
    ops: *const tpu_sync_copy_op,
    num_ops: usize,
    max_outstanding_chunks: usize,
    copy_out: *mut *mut tpu_sync_copy,
) -> tpu_sync_status {
    boundary("tpu_sync_copy_submit", || {
        if copy_out.is_null() {
            return Err(null("copy_out"));
        }
        // SAFETY: caller contract.
        let ops = unsafe { slice_arg(ops, num_ops, "ops") }?;
        let bufs: Vec<Arc<BufferObj>> = ops
            .iter()
            .map(|o| handle::get(K::TPU_SYNC_HANDLE_BUFFER, o.buffer))
            .collect::<FfiResult<_>>()?;
        let mut batch = match direction {
            1 => CopyBatch::d2h(),
            2 => {
                let Some(first) = bufs.first() else {
                    // An empty H2D batch needs no path.
                    return submit(CopyBatch::d2h(), copy_out);
                };
                if let Some(i) = bufs.iter().position(|b| b.caps.plugin != first.caps.plugin) {
                    return Err(invalid(format!(
                        "copy {i}: buffer of plugin {} in an H2D batch of plugin {}",
                        bufs[i].caps.plugin, first.caps.plugin
                    )));
                }
                CopyBatch::h2d(&first.caps)?
            }
            d => return Err(invalid(format!("unknown copy direction {d}"))),
        };
        batch.set_max_outstanding_chunks(max_outstanding_chunks);
        for (o, b) in ops.iter().zip(&bufs) {
            batch.push(&b.buffer, o.offset, o.len, o.host as *mut u8)?;
        }
        submit(batch, copy_out)
    })
}

fn submit(batch: CopyBatch, copy_out: *mut *mut tpu_sync_copy) -> FfiResult {
    // SAFETY: the host memory contract of tpu_sync_copy_submit is the caller's; the handle is
    // only dropped after completion (tpu_sync_copy_free waits).
    let h = unsafe { batch.submit(Pacer::global()) }?;
    let handle = Arc::new(Mutex::new(h));
    let completion = Completion::new();
    completion::drive(
        completion.clone(),
        CopyFuture {
            handle: handle.clone(),
        },
    );
    let tok = handle::insert(
        K::TPU_SYNC_HANDLE_COPY,
        Arc::new(CopyObj { handle, completion }),
    );
    // SAFETY: checked non-NULL by the caller of this helper.
    unsafe { out(copy_out, tok, "copy_out") }
}

/// Non-blocking check: writes whether the batch is complete to `done_out` and, when
/// `bytes_done_out` is not NULL, the bytes of chunks completed so far.
///
/// # Safety
/// `done_out` writable; `bytes_done_out` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn tpu_sync_copy_poll(
    copy: *const tpu_sync_copy,
    done_out: *mut bool,
    bytes_done_out: *mut u64,
) -> tpu_sync_status {
    boundary("tpu_sync_copy_poll", || {
        let c: Arc<CopyObj> = handle::get(K::TPU_SYNC_HANDLE_COPY, copy)?;
        if done_out.is_null() {
            return Err(null("done_out"));
        }
        if !bytes_done_out.is_null() {
            let n = c
                .handle
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .bytes_done();
            // SAFETY: non-NULL, writable per contract.
            unsafe { *bytes_done_out = n };
        }
        // SAFETY: checked non-NULL.
        unsafe { *done_out = c.completion.is_done() };
        Ok(())
    })
}

/// Waits up to `timeout_ms` milliseconds (0: do not block; negative: without limit) for the
/// batch. Returns `TPU_SYNC_PENDING` while it runs; once complete, `TPU_SYNC_OK` with the stats
/// written to `stats_out` (may be NULL), or the batch's error (with the failing copy's span in
/// the message). May be called again after completion (same answer). On the completion thread
/// (inside a callback) a wait that would block returns `TPU_SYNC_INVALID_ARGUMENT`.
///
/// # Safety
/// `stats_out` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn tpu_sync_copy_wait(
    copy: *const tpu_sync_copy,
    timeout_ms: i64,
    stats_out: *mut tpu_sync_copy_stats,
) -> tpu_sync_status {
    boundary("tpu_sync_copy_wait", || {
        let c: Arc<CopyObj> = handle::get(K::TPU_SYNC_HANDLE_COPY, copy)?;
        let s = c.completion.wait(completion::timeout_ms(timeout_ms))?;
        if !stats_out.is_null() {
            // SAFETY: non-NULL, writable per contract.
            unsafe { *stats_out = s };
        }
        Ok(())
    })
}

/// Stops issuing the batch's remaining chunks (chunks in flight still complete). The batch then
/// completes with `TPU_SYNC_CANCELLED` unless every chunk had already been issued. Returns at once.
#[no_mangle]
pub extern "C" fn tpu_sync_copy_cancel(copy: *const tpu_sync_copy) -> tpu_sync_status {
    boundary("tpu_sync_copy_cancel", || {
        let c: Arc<CopyObj> = handle::get(K::TPU_SYNC_HANDLE_COPY, copy)?;
        c.handle.lock().unwrap_or_else(|p| p.into_inner()).cancel();
        Ok(())
    })
}

/// Registers `callback(user_data, status)` to run once when the batch completes (at once, on
/// the completion thread, if it already has). One callback per batch; a second registration
/// returns `TPU_SYNC_INVALID_ARGUMENT`. `user_data` is passed through untouched and must stay
/// valid until the call. See `tpu_sync_callback` for what a callback may do.
#[no_mangle]
pub extern "C" fn tpu_sync_copy_set_callback(
    copy: *const tpu_sync_copy,
    callback: tpu_sync_callback,
    user_data: *mut c_void,
) -> tpu_sync_status {
    boundary("tpu_sync_copy_set_callback", || {
        let c: Arc<CopyObj> = handle::get(K::TPU_SYNC_HANDLE_COPY, copy)?;
        let Some(f) = callback else {
            return Err(null("callback"));
        };
        c.completion.set_callback(f, user_data)
    })
}

/// Frees a copy handle. If the batch is still running it is cancelled and this call **blocks**
/// until the chunks in flight complete, so host memory is never touched after it returns (a
/// registered callback still runs). Inside a callback, freeing an unfinished batch returns
/// `TPU_SYNC_INVALID_ARGUMENT` and frees nothing.
#[no_mangle]
pub extern "C" fn tpu_sync_copy_free(copy: *mut tpu_sync_copy) -> tpu_sync_status {
    boundary("tpu_sync_copy_free", || {
        let c: Arc<CopyObj> = handle::get(K::TPU_SYNC_HANDLE_COPY, copy)?;
        if !c.completion.is_done() {
            if completion::on_completion_thread() {
                return Err(invalid(
                    "cannot free an unfinished copy inside a completion callback",
                ));
            }
            c.handle.lock().unwrap_or_else(|p| p.into_inner()).cancel();
            let _ = c.completion.wait(None);
        }
        handle::remove(K::TPU_SYNC_HANDLE_COPY, copy)?;
        Ok(())
    })
}

// ---------------------------------------------------------------------------------------------
// DMA pacing

/// Sets the process-wide DMA pacing (TPU Sync's `set_dma_pacing`): copies are split into chunks
/// of at most `chunk_bytes` bytes (0: not split) and at most `max_inflight_bytes` bytes are in
/// flight at once (0: unlimited). Applies to chunks issued from now on. Defaults: 16 MiB and 64
/// MiB, or `$TPU_SYNC_DMA_CHUNK_BYTES` / `$TPU_SYNC_DMA_MAX_INFLIGHT_BYTES`.
#[no_mangle]
pub extern "C" fn tpu_sync_pacing_set(
    chunk_bytes: u64,
    max_inflight_bytes: u64,
) -> tpu_sync_status {
    boundary("tpu_sync_pacing_set", || {
        Pacer::global().set_config(PacingConfig {
            chunk_bytes,
            max_inflight_bytes,
        });
        Ok(())
    })
}

/// Pauses (`paused` true) or resumes the process-wide DMA pacer. While paused no new chunk is
/// issued: batches submitted meanwhile queue up in order, chunks already in flight complete,
/// cancellations are still processed. For quiescing device DMA around another operation.
#[no_mangle]
pub extern "C" fn tpu_sync_pacing_pause(paused: bool) -> tpu_sync_status {
    boundary("tpu_sync_pacing_pause", || {
        if paused {
            Pacer::global().pause();
        } else {
            Pacer::global().resume();
        }
        Ok(())
    })
}

/// Writes the process-wide pacer's configuration and counters as JSON into `buf` (`buf`/
/// `buf_len`/`len_out` as for `tpu_sync_client_info`): `{"chunk_bytes", "max_inflight_bytes",
/// "bytes", "chunks", "batches", "failed_batches", "inline_batches", "inflight_bytes",
/// "peak_inflight_bytes"}`
/// (bytes and chunks count completed copies since the process started).
///
/// # Safety
/// `buf` must have `buf_len` writable bytes (or be NULL with `buf_len` 0); `len_out` NULL or
/// writable.
#[no_mangle]
pub unsafe extern "C" fn tpu_sync_pacing_stats(
    buf: *mut c_char,
    buf_len: usize,
    len_out: *mut usize,
) -> tpu_sync_status {
    boundary("tpu_sync_pacing_stats", || {
        let s = Pacer::global().stats();
        let v = serde_json::json!({
            "chunk_bytes": s.config.chunk_bytes,
            "max_inflight_bytes": s.config.max_inflight_bytes,
            "bytes": s.bytes,
            "chunks": s.chunks,
            "batches": s.batches,
            "failed_batches": s.failed_batches,
            "inline_batches": s.inline_batches,
            "inflight_bytes": s.inflight_bytes,
            "peak_inflight_bytes": s.peak_inflight_bytes,
        });
        // SAFETY: forwarded caller contract.
        unsafe { out_string(&v.to_string(), buf, buf_len, len_out) }
    })
}
