//! PJRT device buffers, events and external references.

use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use super::client::{ClientInner, Device};
use super::{pjrt_call, sys, Plugin};
use crate::error::{Error, Result};

/// Element types this crate can size (byte-granular PJRT buffer types).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[allow(missing_docs)]
pub enum ElementType {
    Pred,
    S8,
    S16,
    S32,
    S64,
    U8,
    U16,
    U32,
    U64,
    F16,
    F32,
    F64,
    BF16,
    F8E5M2,
    F8E4M3FN,
}

impl ElementType {
    /// Size of one element in bytes.
    pub fn size(self) -> usize {
        use ElementType::*;
        match self {
            Pred | S8 | U8 | F8E5M2 | F8E4M3FN => 1,
            S16 | U16 | F16 | BF16 => 2,
            S32 | U32 | F32 => 4,
            S64 | U64 | F64 => 8,
        }
    }

    /// Lower-case name as in XLA (`bf16`, `f32`, ...).
    pub fn name(self) -> &'static str {
        use ElementType::*;
        match self {
            Pred => "pred",
            S8 => "s8",
            S16 => "s16",
            S32 => "s32",
            S64 => "s64",
            U8 => "u8",
            U16 => "u16",
            U32 => "u32",
            U64 => "u64",
            F16 => "f16",
            F32 => "f32",
            F64 => "f64",
            BF16 => "bf16",
            F8E5M2 => "f8e5m2",
            F8E4M3FN => "f8e4m3fn",
        }
    }

    /// The `PJRT_Buffer_Type` value.
    pub fn to_pjrt(self) -> sys::PJRT_Buffer_Type {
        use ElementType::*;
        match self {
            Pred => sys::PJRT_Buffer_Type_PRED,
            S8 => sys::PJRT_Buffer_Type_S8,
            S16 => sys::PJRT_Buffer_Type_S16,
            S32 => sys::PJRT_Buffer_Type_S32,
            S64 => sys::PJRT_Buffer_Type_S64,
            U8 => sys::PJRT_Buffer_Type_U8,
            U16 => sys::PJRT_Buffer_Type_U16,
            U32 => sys::PJRT_Buffer_Type_U32,
            U64 => sys::PJRT_Buffer_Type_U64,
            F16 => sys::PJRT_Buffer_Type_F16,
            F32 => sys::PJRT_Buffer_Type_F32,
            F64 => sys::PJRT_Buffer_Type_F64,
            BF16 => sys::PJRT_Buffer_Type_BF16,
            F8E5M2 => sys::PJRT_Buffer_Type_F8E5M2,
            F8E4M3FN => sys::PJRT_Buffer_Type_F8E4M3FN,
        }
    }

    /// The element type of a `PJRT_Buffer_Type` value, if byte-granular and known.
    pub fn from_pjrt(t: sys::PJRT_Buffer_Type) -> Option<ElementType> {
        use ElementType::*;
        Some(match t {
            sys::PJRT_Buffer_Type_PRED => Pred,
            sys::PJRT_Buffer_Type_S8 => S8,
            sys::PJRT_Buffer_Type_S16 => S16,
            sys::PJRT_Buffer_Type_S32 => S32,
            sys::PJRT_Buffer_Type_S64 => S64,
            sys::PJRT_Buffer_Type_U8 => U8,
            sys::PJRT_Buffer_Type_U16 => U16,
            sys::PJRT_Buffer_Type_U32 => U32,
            sys::PJRT_Buffer_Type_U64 => U64,
            sys::PJRT_Buffer_Type_F16 => F16,
            sys::PJRT_Buffer_Type_F32 => F32,
            sys::PJRT_Buffer_Type_F64 => F64,
            sys::PJRT_Buffer_Type_BF16 => BF16,
            sys::PJRT_Buffer_Type_F8E5M2 => F8E5M2,
            sys::PJRT_Buffer_Type_F8E4M3FN => F8E4M3FN,
            _ => return None,
        })
    }

    /// Dense byte size of a shape; errors on negative dims or overflow.
    pub fn shape_bytes(self, dims: &[i64]) -> Result<u64> {
        let mut n: u64 = self.size() as u64;
        for &d in dims {
            if d < 0 {
                return Err(Error::InvalidArgument(format!(
                    "negative dimension in {dims:?}"
                )));
            }
            n = n
                .checked_mul(d as u64)
                .ok_or_else(|| Error::InvalidArgument(format!("shape {dims:?} overflows")))?;
        }
        Ok(n)
    }
}

/// A PJRT event (`PJRT_Event*`), destroyed on drop. `Send`, not `Sync`.
pub struct Event {
    plugin: Arc<Plugin>,
    raw: *mut sys::PJRT_Event,
}

// SAFETY: PJRT events may be awaited or destroyed from any thread.
unsafe impl Send for Event {}

impl std::fmt::Debug for Event {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Event").field("raw", &self.raw).finish()
    }
}

impl Event {
    pub(crate) fn from_raw(plugin: Arc<Plugin>, raw: *mut sys::PJRT_Event) -> Event {
        Event { plugin, raw }
    }

    /// Blocks until the event is ready; returns its error, if any (`PJRT_Event_Await`).
    pub fn wait(self) -> Result<()> {
        let mut a = sys::PJRT_Event_Await_Args::new();
        a.event = self.raw;
        // SAFETY: live event owned by self.
        unsafe { pjrt_call!(&self.plugin, PJRT_Event_Await, &mut a) }
    }

    /// `PJRT_Event_IsReady`.
    pub fn is_ready(&self) -> Result<bool> {
        let mut a = sys::PJRT_Event_IsReady_Args::new();
        a.event = self.raw;
        // SAFETY: live event owned by self.
        unsafe { pjrt_call!(&self.plugin, PJRT_Event_IsReady, &mut a) }?;
        Ok(a.is_ready)
    }

    /// Runs `f` once the event is ready, with its result (`PJRT_Event_OnReady`).
    ///
    /// `f` may run inline on this thread, inside this call (when the event is already ready),
    /// or later on a plugin worker thread (`docs/plugins-and-engines.md`, "CPU plugin: callbacks
    /// and their threads"). It must not
    /// block and must not take a lock that the caller of `on_ready` holds. A panic in `f` is
    /// caught (it never unwinds into the plugin) and logged.
    ///
    /// The event is borrowed, not consumed: callers keep it alive until `f` has run and destroy
    /// it afterwards on their own thread, so no PJRT call (event destruction) happens from inside
    /// a callback. (XLA's implementation does not need the `PJRT_Event` to outlive the callback,
    /// but nothing in the C API promises it.)
    ///
    /// Errors: the plugin's error when the callback could not be registered; `f` is then dropped
    /// without being called.
    pub fn on_ready(&self, f: impl FnOnce(Result<()>) + Send + 'static) -> Result<()> {
        self.on_ready_boxed(Box::new(f)).map_err(|(e, _)| e)
    }

    /// As [`Event::on_ready`]; on failure the closure is handed back unrun with the error.
    #[allow(clippy::type_complexity)]
    pub(crate) fn on_ready_boxed(
        &self,
        f: Box<dyn FnOnce(Result<()>) + Send>,
    ) -> std::result::Result<(), (Error, Box<dyn FnOnce(Result<()>) + Send>)> {
        struct Ctx {
            plugin: Arc<Plugin>,
            f: Box<dyn FnOnce(Result<()>) + Send>,
            /// Set (release) before the context is handed to the plugin and read (acquire)
            /// first thing in the callback: the hand-off to the plugin's thread is then ordered
            /// by our own atomics, not only by the plugin's internal synchronization (which
            /// ThreadSanitizer cannot see in an uninstrumented plugin).
            published: AtomicBool,
        }
        unsafe extern "C" fn trampoline(err: *mut sys::PJRT_Error, user: *mut c_void) {
            // A panic must not unwind into the plugin's C++ frames.
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || {
                let ctx = user as *mut Ctx;
                // SAFETY: `user` is the live Box<Ctx> leaked below; `published` is an atomic,
                // read before anything else of the context.
                let published = unsafe { (*ctx).published.load(Ordering::Acquire) };
                debug_assert!(
                    published,
                    "PJRT_Event_OnReady context used before published"
                );
                // SAFETY: `user` is the Box<Ctx> leaked below; the plugin calls this exactly once.
                let ctx = unsafe { Box::from_raw(ctx) };
                // SAFETY: the callback owns `err` (NULL or a live error), per the C API.
                let r = unsafe { ctx.plugin.check(err, "PJRT_Event_OnReady callback") };
                (ctx.f)(r);
            }));
            if r.is_err() {
                log::error!("a PJRT_Event_OnReady callback panicked (caught)");
            }
        }
        let ctx = Box::new(Ctx {
            plugin: self.plugin.clone(),
            f,
            published: AtomicBool::new(false),
        });
        ctx.published.store(true, Ordering::Release);
        let ctx = Box::into_raw(ctx);
        let mut a = sys::PJRT_Event_OnReady_Args::new();
        a.event = self.raw;
        a.callback = Some(trampoline);
        a.user_arg = ctx as *mut c_void;
        // SAFETY: live event; ctx stays alive until the callback reclaims it.
        match unsafe { pjrt_call!(&self.plugin, PJRT_Event_OnReady, &mut a) } {
            Ok(()) => Ok(()),
            Err(e) => {
                // The callback was not registered: reclaim the context.
                // SAFETY: the plugin did not take ownership of ctx.
                let ctx = unsafe { Box::from_raw(ctx) };
                Err((e, ctx.f))
            }
        }
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        let mut a = sys::PJRT_Event_Destroy_Args::new();
        a.event = self.raw;
        // SAFETY: we own the event and destroy it exactly once.
        if let Err(e) = unsafe { pjrt_call!(&self.plugin, PJRT_Event_Destroy, &mut a) } {
            log::warn!("PJRT_Event_Destroy: {e}");
        }
    }
}

pub(crate) struct BufferInner {
    pub(crate) client: Arc<ClientInner>,
    pub(crate) raw: *mut sys::PJRT_Buffer,
    owned: bool,
    dims: Vec<i64>,
    ty: ElementType,
    on_device_size: u64,
    device: *mut sys::PJRT_Device,
    layout: Option<String>,
}

// SAFETY: PJRT buffers are thread-safe handles per the C API.
unsafe impl Send for BufferInner {}
// SAFETY: as above.
unsafe impl Sync for BufferInner {}

impl Drop for BufferInner {
    fn drop(&mut self) {
        if self.owned {
            let mut a = sys::PJRT_Buffer_Destroy_Args::new();
            a.buffer = self.raw;
            // SAFETY: we own the buffer; every ExternalRef and in-flight copy holds an Arc to this
            // struct, so none is outstanding here.
            if let Err(e) = unsafe { pjrt_call!(&self.client.plugin, PJRT_Buffer_Destroy, &mut a) }
            {
                log::warn!("PJRT_Buffer_Destroy: {e}");
            }
        }
    }
}

/// A PJRT device buffer (`PJRT_Buffer*`) with its shape, element type and on-device size.
///
/// Cloning is cheap and shares the handle. If this crate created the buffer it is destroyed when
/// the last clone (and the last [`ExternalRef`]) is dropped; adopted buffers are never destroyed.
/// `Send + Sync`.
#[derive(Clone)]
pub struct DeviceBuffer {
    pub(crate) inner: Arc<BufferInner>,
}

impl std::fmt::Debug for DeviceBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceBuffer")
            .field("dims", &self.inner.dims)
            .field("type", &self.inner.ty)
            .field("on_device_size", &self.inner.on_device_size)
            .field("layout", &self.inner.layout)
            .field("owned", &self.inner.owned)
            .finish()
    }
}

impl DeviceBuffer {
    /// Wraps a raw buffer, reading its element type, dims, on-device size and device.
    ///
    /// # Safety
    /// `raw` must be a live buffer of `client`.
    pub(crate) unsafe fn from_raw(
        client: Arc<ClientInner>,
        raw: *mut sys::PJRT_Buffer,
        owned: bool,
    ) -> Result<DeviceBuffer> {
        if raw.is_null() {
            return Err(Error::InvalidArgument("NULL PJRT_Buffer".into()));
        }
        let plugin = client.plugin.clone();
        let mut t = sys::PJRT_Buffer_ElementType_Args::new();
        t.buffer = raw;
        // SAFETY: live buffer (caller contract).
        unsafe { pjrt_call!(&plugin, PJRT_Buffer_ElementType, &mut t) }?;
        let ty = ElementType::from_pjrt(t.r#type).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "PJRT buffer element type {} is not byte-granular or not supported",
                t.r#type
            ))
        })?;
        let mut d = sys::PJRT_Buffer_Dimensions_Args::new();
        d.buffer = raw;
        // SAFETY: live buffer.
        unsafe { pjrt_call!(&plugin, PJRT_Buffer_Dimensions, &mut d) }?;
        let dims = if d.num_dims == 0 || d.dims.is_null() {
            Vec::new()
        } else {
            // SAFETY: `num_dims` values owned by the buffer.
            unsafe { std::slice::from_raw_parts(d.dims, d.num_dims) }.to_vec()
        };
        let mut s = sys::PJRT_Buffer_OnDeviceSizeInBytes_Args::new();
        s.buffer = raw;
        // SAFETY: live buffer.
        unsafe { pjrt_call!(&plugin, PJRT_Buffer_OnDeviceSizeInBytes, &mut s) }?;
        let mut dv = sys::PJRT_Buffer_Device_Args::new();
        dv.buffer = raw;
        // SAFETY: live buffer.
        unsafe { pjrt_call!(&plugin, PJRT_Buffer_Device, &mut dv) }?;
        if !client.has_device(dv.device) {
            return Err(Error::InvalidArgument(format!(
                "PJRT buffer lives on a device that is not addressable by this {} client \
                 (a buffer of another client?)",
                client.platform()
            )));
        }
        // SAFETY: live buffer of this plugin.
        let layout = match unsafe { super::ext::buffer_layout_string(&plugin, raw) } {
            Ok(l) => Some(l),
            Err(e) => {
                log::debug!("no memory layout for a PJRT buffer: {e}");
                None
            }
        };
        Ok(DeviceBuffer {
            inner: Arc::new(BufferInner {
                client,
                raw,
                owned,
                dims,
                ty,
                on_device_size: s.on_device_size_in_bytes as u64,
                device: dv.device,
                layout,
            }),
        })
    }

    /// Wraps a buffer owned by someone else (e.g. a serving framework's KV cache array). The
    /// buffer is never destroyed by this crate; the caller keeps it alive while this wrapper (or
    /// any copy issued on it) exists. While a copy is in flight the copy engine holds an
    /// external reference (`PJRT_Buffer_IncreaseExternalReferenceCount`) on it.
    ///
    /// Errors: [`Error::InvalidArgument`] for NULL, or for a buffer whose device is not one of
    /// `client`'s addressable devices.
    ///
    /// # Safety
    /// `raw` must be a live `PJRT_Buffer*` created by `client`.
    pub unsafe fn adopt(
        client: &super::Client,
        raw: *mut sys::PJRT_Buffer,
    ) -> Result<DeviceBuffer> {
        // SAFETY: forwarded from the caller's contract.
        unsafe { Self::from_raw(client.inner.clone(), raw, false) }
    }

    /// The plugin this buffer's client belongs to.
    pub(crate) fn plugin(&self) -> &Arc<Plugin> {
        &self.inner.client.plugin
    }

    /// The client that owns the buffer (a shared handle; an adopted client stays adopted).
    pub fn client(&self) -> super::Client {
        super::Client {
            inner: self.inner.client.clone(),
        }
    }

    /// The client's platform name (`cpu`, `cuda`, `tpu`, ...).
    pub fn platform_name(&self) -> &str {
        self.inner.client.platform()
    }

    /// The raw handle (borrowed).
    pub fn raw(&self) -> *mut sys::PJRT_Buffer {
        self.inner.raw
    }

    /// Logical dimensions.
    pub fn dims(&self) -> &[i64] {
        &self.inner.dims
    }

    /// Element type.
    pub fn element_type(&self) -> ElementType {
        self.inner.ty
    }

    /// `PJRT_Buffer_OnDeviceSizeInBytes`: the size of the buffer's device allocation in bytes
    /// (may exceed the logical size on tiled layouts). Raw copies address `0..on_device_size`.
    pub fn on_device_size(&self) -> u64 {
        self.inner.on_device_size
    }

    /// The buffer's physical memory layout as a string: the Layouts extension's serialization
    /// when the plugin has it (the XLA CPU plugin gives `{4,3,2,1,0}` for a dense 5-D buffer),
    /// else `PJRT_Buffer_GetMemoryLayout` in XLA notation (`{1,0:T(8,128)(2,1)}` for a tiled
    /// TPU layout); `None` when the plugin offers neither. Read once, when the buffer was
    /// wrapped. Raw bytes of two buffers are interchangeable only when their element type, dims
    /// and this layout are equal.
    pub fn physical_layout(&self) -> Option<&str> {
        self.inner.layout.as_deref()
    }

    /// Logical (dense) byte size: product of dims times element size.
    pub fn logical_size(&self) -> u64 {
        self.inner.ty.shape_bytes(&self.inner.dims).unwrap_or(0)
    }

    /// Whether the buffer lives on `device`.
    pub fn is_on(&self, device: &Device) -> bool {
        self.inner.device == device.raw
    }

    /// Whether this crate owns (and will destroy) the buffer.
    pub fn is_owned(&self) -> bool {
        self.inner.owned
    }

    /// `PJRT_Buffer_IsDeleted`.
    pub fn is_deleted(&self) -> Result<bool> {
        let mut a = sys::PJRT_Buffer_IsDeleted_Args::new();
        a.buffer = self.inner.raw;
        // SAFETY: live handle (deleted buffers stay valid handles until destroyed).
        unsafe { pjrt_call!(self.plugin(), PJRT_Buffer_IsDeleted, &mut a) }?;
        Ok(a.is_deleted)
    }

    /// `PJRT_Buffer_IsOnCpu`: whether the buffer's memory is host memory.
    pub fn is_on_cpu(&self) -> Result<bool> {
        let mut a = sys::PJRT_Buffer_IsOnCpu_Args::new();
        a.buffer = self.inner.raw;
        // SAFETY: live handle.
        unsafe { pjrt_call!(self.plugin(), PJRT_Buffer_IsOnCpu, &mut a) }?;
        Ok(a.is_on_cpu)
    }

    /// `PJRT_Buffer_Delete`: releases the device memory now (the handle stays valid and reports
    /// deleted). Later copies fail with an error.
    pub fn delete(&self) -> Result<()> {
        let mut a = sys::PJRT_Buffer_Delete_Args::new();
        a.buffer = self.inner.raw;
        // SAFETY: live handle.
        unsafe { pjrt_call!(self.plugin(), PJRT_Buffer_Delete, &mut a) }
    }

    /// Errors with [`Error::InvalidArgument`] if the buffer was deleted.
    pub fn check_live(&self) -> Result<()> {
        if self.is_deleted()? {
            return Err(Error::InvalidArgument(
                "PJRT buffer has been deleted".into(),
            ));
        }
        Ok(())
    }

    /// The buffer's ready event (`PJRT_Buffer_ReadyEvent`).
    pub fn ready_event(&self) -> Result<Event> {
        let mut a = sys::PJRT_Buffer_ReadyEvent_Args::new();
        a.buffer = self.inner.raw;
        // SAFETY: live handle.
        unsafe { pjrt_call!(self.plugin(), PJRT_Buffer_ReadyEvent, &mut a) }?;
        Ok(Event::from_raw(self.plugin().clone(), a.event))
    }

    /// Validates a raw byte range against the on-device size.
    pub fn check_range(&self, offset: u64, len: u64) -> Result<()> {
        let end = offset
            .checked_add(len)
            .ok_or_else(|| Error::InvalidArgument(format!("range {offset}+{len} overflows")))?;
        if end > self.inner.on_device_size {
            return Err(Error::InvalidArgument(format!(
                "byte range {offset}..{end} is outside the buffer's {} on-device bytes",
                self.inner.on_device_size
            )));
        }
        if offset > i64::MAX as u64 || len > i64::MAX as u64 {
            return Err(Error::InvalidArgument("range exceeds i64".into()));
        }
        Ok(())
    }

    /// Starts a raw device-to-host copy of `len` bytes at `offset` into `dst`
    /// (`PJRT_Buffer_CopyRawToHost`). Returns the completion event.
    ///
    /// # Safety
    /// `dst..dst+len` must be valid for writes and not accessed by anyone else until the returned
    /// event has completed (waited or callback run), even if the event is dropped earlier.
    pub unsafe fn copy_raw_to_host_async(
        &self,
        offset: u64,
        dst: *mut u8,
        len: u64,
    ) -> Result<Event> {
        // SAFETY: forwarded caller contract.
        match unsafe { self.copy_raw_to_host_start(offset, dst, len) }? {
            Some(ev) => Ok(ev),
            None => Err(Error::InvalidArgument(
                "PJRT_Buffer_CopyRawToHost returned no completion event".into(),
            )),
        }
    }

    /// As [`DeviceBuffer::copy_raw_to_host_async`], but `None` when the plugin returned no
    /// event (the copy then completed inside the call).
    ///
    /// # Safety
    /// As [`DeviceBuffer::copy_raw_to_host_async`].
    pub(crate) unsafe fn copy_raw_to_host_start(
        &self,
        offset: u64,
        dst: *mut u8,
        len: u64,
    ) -> Result<Option<Event>> {
        self.check_range(offset, len)?;
        if dst.is_null() {
            return Err(Error::InvalidArgument("NULL destination".into()));
        }
        let mut a = sys::PJRT_Buffer_CopyRawToHost_Args::new();
        a.buffer = self.inner.raw;
        a.dst = dst as *mut c_void;
        a.offset = offset as i64;
        a.transfer_size = len as i64;
        // SAFETY: range validated; dst validity is the caller's contract.
        unsafe { pjrt_call!(self.plugin(), PJRT_Buffer_CopyRawToHost, &mut a) }?;
        Ok((!a.event.is_null()).then(|| Event::from_raw(self.plugin().clone(), a.event)))
    }

    /// Blocking raw device-to-host copy of `dst.len()` bytes starting at `offset`.
    pub fn copy_raw_to_host(&self, offset: u64, dst: &mut [u8]) -> Result<()> {
        // SAFETY: `dst` is exclusively borrowed until we have waited on the event.
        let ev =
            unsafe { self.copy_raw_to_host_async(offset, dst.as_mut_ptr(), dst.len() as u64) }?;
        ev.wait()
    }

    /// Blocking logical copy of the whole buffer into `dst` (`PJRT_Buffer_ToHostBuffer`, dense
    /// row-major host layout). `dst.len()` must equal [`DeviceBuffer::logical_size`].
    pub fn to_host(&self, dst: &mut [u8]) -> Result<()> {
        if dst.len() as u64 != self.logical_size() {
            return Err(Error::InvalidArgument(format!(
                "destination is {} bytes, buffer holds {} logical bytes",
                dst.len(),
                self.logical_size()
            )));
        }
        let mut a = sys::PJRT_Buffer_ToHostBuffer_Args::new();
        a.src = self.inner.raw;
        a.dst = dst.as_mut_ptr() as *mut c_void;
        a.dst_size = dst.len();
        // SAFETY: dst is exclusively borrowed until the event is waited.
        unsafe { pjrt_call!(self.plugin(), PJRT_Buffer_ToHostBuffer, &mut a) }?;
        Event::from_raw(self.plugin().clone(), a.event).wait()
    }

    /// Takes an external reference (`PJRT_Buffer_IncreaseExternalReferenceCount`), released when
    /// the guard drops. While held, the runtime does not free or move the device memory.
    ///
    /// Thread-safe: any number of threads may take and drop references on one buffer (or on
    /// several [`DeviceBuffer`]s adopting the same `PJRT_Buffer*`) at once. The plugins' C API
    /// wrapper keeps a buffer's external references in an unsynchronised list, so this crate
    /// serialises its calls per handle and counts its own references: the plugin sees one
    /// reference while this process holds any (see [`ExternalRef`]).
    pub fn external_ref(&self) -> Result<ExternalRef> {
        let key = self.inner.raw as usize;
        let mut held = xrefs();
        let count = held.entry(key).or_insert(0);
        if *count == 0 {
            let mut a = sys::PJRT_Buffer_IncreaseExternalReferenceCount_Args::new();
            a.buffer = self.inner.raw;
            // SAFETY: live handle (`self.inner` owns or borrows it); calls on this handle are
            // serialised by the registry lock held here.
            let r = unsafe {
                pjrt_call!(
                    self.plugin(),
                    PJRT_Buffer_IncreaseExternalReferenceCount,
                    &mut a
                )
            };
            if let Err(e) = r {
                held.remove(&key);
                return Err(e);
            }
        }
        *count += 1;
        Ok(ExternalRef {
            buffer: self.inner.clone(),
        })
    }
}

/// This process's external references per `PJRT_Buffer*` (its address), taken through
/// [`DeviceBuffer::external_ref`].
///
/// Why: the C API wrapper of the XLA plugins (`pjrt_c_api_wrapper_impl.cc`) keeps a buffer's
/// external references in a plain `std::vector` that `IncreaseExternalReferenceCount` pushes to
/// and `DecreaseExternalReferenceCount` pops from, with no lock. Two threads doing so on one
/// buffer at once can lose a reference, and destroying the buffer then aborts the process
/// (`Check failed: holds_[i] == 0 ... Non-zero type 1 hold on destruction`): seen when a vLLM
/// worker saved one request's blocks while loading another's from the same layer buffer. The
/// lock is held only around the plugin call of the first take and the last release; the count
/// makes every other take and release a map update.
fn xrefs() -> std::sync::MutexGuard<'static, std::collections::HashMap<usize, usize>> {
    static XREFS: std::sync::LazyLock<Mutex<std::collections::HashMap<usize, usize>>> =
        std::sync::LazyLock::new(Default::default);
    // A panic cannot leave the map inconsistent (every update is a single insert or remove).
    XREFS.lock().unwrap_or_else(|p| p.into_inner())
}

/// An external reference on a device buffer; released on drop. Keeps the buffer handle alive.
///
/// References taken by this crate on one `PJRT_Buffer*` are counted together: the plugin's
/// count is raised on the first and lowered when the last is dropped, so another holder of the
/// handle (a framework) sees at most one reference from this process. `Send + Sync`.
pub struct ExternalRef {
    buffer: Arc<BufferInner>,
}

impl ExternalRef {
    /// `PJRT_Buffer_OpaqueDeviceMemoryDataPointer`: the device address of the buffer's memory.
    /// On the CPU plugin this is a dereferenceable host address; on TPU/GPU it is not.
    pub fn opaque_device_ptr(&self) -> Result<*mut u8> {
        let mut a = sys::PJRT_Buffer_OpaqueDeviceMemoryDataPointer_Args::new();
        a.buffer = self.buffer.raw;
        // SAFETY: live handle with an external reference held.
        unsafe {
            pjrt_call!(
                &self.buffer.client.plugin,
                PJRT_Buffer_OpaqueDeviceMemoryDataPointer,
                &mut a
            )
        }?;
        Ok(a.device_memory_ptr as *mut u8)
    }
}

impl Drop for ExternalRef {
    fn drop(&mut self) {
        let key = self.buffer.raw as usize;
        let mut held = xrefs();
        let Some(count) = held.get_mut(&key) else {
            log::warn!("external reference on {key:#x} released twice");
            return;
        };
        *count -= 1;
        if *count > 0 {
            return;
        }
        held.remove(&key);
        let mut a = sys::PJRT_Buffer_DecreaseExternalReferenceCount_Args::new();
        a.buffer = self.buffer.raw;
        // SAFETY: balances the increase made by the first of this process's references on the
        // handle, which is still alive (this guard holds its `BufferInner`); serialised by the
        // registry lock held here.
        if let Err(e) = unsafe {
            pjrt_call!(
                &self.buffer.client.plugin,
                PJRT_Buffer_DecreaseExternalReferenceCount,
                &mut a
            )
        } {
            log::warn!("PJRT_Buffer_DecreaseExternalReferenceCount: {e}");
        }
    }
}

pub(crate) struct ReleaseInner {
    released: Mutex<bool>,
    cv: Condvar,
}

/// Tells when the plugin has let go of the memory behind a [`View`].
///
/// The plugin calls the view's `on_delete_callback` once the buffer is destroyed and no longer
/// uses the memory; on the XLA CPU plugin that happens asynchronously on a plugin thread, up to
/// about 100 ms after `PJRT_Buffer_Destroy` (`docs/plugins-and-engines.md`, "CPU plugin:
/// callbacks and their threads"). The memory
/// may be freed or reused only after [`ViewReleased::is_released`] is true. Cloning is cheap;
/// `Send + Sync`.
#[derive(Clone)]
pub struct ViewReleased {
    inner: Arc<ReleaseInner>,
}

impl std::fmt::Debug for ViewReleased {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ViewReleased")
            .field("released", &self.is_released())
            .finish()
    }
}

impl ViewReleased {
    pub(crate) fn new() -> ViewReleased {
        ViewReleased {
            inner: Arc::new(ReleaseInner {
                released: Mutex::new(false),
                cv: Condvar::new(),
            }),
        }
    }

    /// Whether the plugin's `on_delete_callback` has run.
    pub fn is_released(&self) -> bool {
        *self
            .inner
            .released
            .lock()
            .unwrap_or_else(|p| p.into_inner())
    }

    /// Blocks up to `timeout` for the release; returns whether it happened.
    pub fn wait(&self, timeout: Duration) -> bool {
        let g = self
            .inner
            .released
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let (g, _) = self
            .inner
            .cv
            .wait_timeout_while(g, timeout, |r| !*r)
            .unwrap_or_else(|p| p.into_inner());
        *g
    }

    /// The context handed to the plugin as `on_delete_callback_arg` (leaked; reclaimed by
    /// [`on_view_deleted`] when the plugin calls it).
    pub(crate) fn callback_arg(&self) -> *mut c_void {
        Box::into_raw(Box::new(self.inner.clone())) as *mut c_void
    }
}

/// The `on_delete_callback` of every view this crate creates. Runs on a plugin thread (or
/// inline in `PJRT_Buffer_Destroy`); takes only the release flag's own lock, which nobody
/// holds across a PJRT call.
pub(crate) unsafe extern "C" fn on_view_deleted(_device_ptr: *mut c_void, user: *mut c_void) {
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        // SAFETY: `user` is the Box<Arc<ReleaseInner>> leaked by `callback_arg`; the
        // plugin calls this callback exactly once per view.
        let inner = unsafe { Box::from_raw(user as *mut Arc<ReleaseInner>) };
        let mut g = inner.released.lock().unwrap_or_else(|p| p.into_inner());
        *g = true;
        drop(g);
        inner.cv.notify_all();
    }));
    if r.is_err() {
        log::error!("view release callback panicked (caught)");
    }
}

/// A device buffer that aliases caller-owned device memory
/// ([`Client::view_of_device_memory`](super::Client::view_of_device_memory)), and the signal
/// that tells when the plugin has released that memory.
#[derive(Debug, Clone)]
pub struct View {
    /// The PJRT buffer over the memory. Owned by this crate: destroyed when its last clone (and
    /// every in-flight copy on it) is gone.
    pub buffer: DeviceBuffer,
    /// Set once the plugin no longer uses the memory (after the buffer is destroyed).
    pub released: ViewReleased,
}
