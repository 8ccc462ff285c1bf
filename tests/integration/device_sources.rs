//! The three ways to get a device buffer (a client we create, handles adopted from a framework,
//! a view of existing device memory) feeding the same copy engine, against the real XLA CPU
//! plugin; adopted handles are never freed by the library; bad inputs are errors, not crashes.

use crate::common;

use std::ffi::{c_void, CString};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use tpu_sync::device::{CopyBatch, Pacer, PacingConfig};
use tpu_sync::pjrt::ext::raw as ext_raw;
use tpu_sync::pjrt::{
    sys, Capabilities, Client, DeviceBuffer, ElementType, H2dPath, Plugin, RawBufferExt,
};
use tpu_sync::Error;

/// Bound for every wait in these tests: a hang fails instead of blocking `make test`.
const LIMIT: Duration = Duration::from_secs(60);

/// Non-repeating, non-zero test bytes.
fn pattern(n: usize, seed: u64) -> Vec<u8> {
    (0..n as u64)
        .map(|i| (tpu_sync::pattern::mix64(i ^ (seed << 40)) as u8) | 1)
        .collect()
}

/// A zeroed 64-byte aligned host allocation: "device memory" on the CPU plugin.
struct Aligned {
    ptr: *mut u8,
    layout: std::alloc::Layout,
}

impl Aligned {
    fn new(len: usize) -> Aligned {
        let layout = std::alloc::Layout::from_size_align(len, 64).unwrap();
        // SAFETY: non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        assert!(!ptr.is_null());
        Aligned { ptr, layout }
    }
    fn bytes(&self) -> Vec<u8> {
        // SAFETY: in bounds of our allocation; callers read only while no copy runs.
        unsafe { std::slice::from_raw_parts(self.ptr, self.layout.size()) }.to_vec()
    }
    fn fill(&self, data: &[u8]) {
        assert_eq!(data.len(), self.layout.size());
        // SAFETY: as above, no copy runs.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), self.ptr, data.len()) };
    }
}

impl Drop for Aligned {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout.
        unsafe { std::alloc::dealloc(self.ptr, self.layout) };
    }
}

/// D2H of `ranges` of `buf` through `pacer`; returns the bytes read.
fn read(buf: &DeviceBuffer, ranges: &[(u64, u64)], pacer: &Pacer) -> Vec<u8> {
    let total: u64 = ranges.iter().map(|r| r.1).sum();
    let mut out = vec![0u8; total as usize];
    let mut b = CopyBatch::d2h();
    let mut at = 0usize;
    for &(off, len) in ranges {
        b.push(buf, off, len, out[at..].as_mut_ptr()).unwrap();
        at += len as usize;
    }
    // SAFETY: `out` outlives the wait below and nobody else touches it.
    let h = unsafe { b.submit(pacer) }.unwrap();
    assert!(h.wait_timeout(LIMIT), "D2H batch hung");
    let st = h.wait().unwrap();
    assert_eq!(st.bytes, total);
    out
}

/// In-place H2D of `data` at `offset` of `buf`.
fn write(caps: &Capabilities, buf: &DeviceBuffer, offset: u64, data: &[u8], pacer: &Pacer) {
    let mut b = CopyBatch::h2d(caps).unwrap();
    b.push(buf, offset, data.len() as u64, data.as_ptr() as *mut u8)
        .unwrap();
    // SAFETY: `data` outlives the wait and is not modified.
    let h = unsafe { b.submit(pacer) }.unwrap();
    assert!(h.wait_timeout(LIMIT), "H2D batch hung");
    h.wait().unwrap();
}

#[test]
fn a_client_we_create_feeds_the_engine_blocking_and_async() {
    let c = common::client(2);
    let caps = Capabilities::probe(&c).unwrap();
    let dev = c.device(1).unwrap();
    let n = 256 * 1024;
    let data = pattern(n, 11);
    let buf = c
        .buffer_from_host(&data, ElementType::U8, &[n as i64], &dev)
        .unwrap();
    assert!(buf.is_owned());
    assert_eq!(buf.physical_layout(), Some("{0}"));
    let pacer = Pacer::new(PacingConfig {
        chunk_bytes: 16 * 1024,
        max_inflight_bytes: 64 * 1024,
    })
    .unwrap();
    let got = read(&buf, &[(0, 100_000), (123_457, 50_001)], &pacer);
    assert_eq!(&got[..100_000], &data[..100_000]);
    assert_eq!(&got[100_000..], &data[123_457..173_458]);

    let patch = pattern(40_000, 12);
    write(&caps, &buf, 7, &patch, &pacer);
    let mut expect = data.clone();
    expect[7..40_007].copy_from_slice(&patch);
    let mut all = vec![0u8; n];
    buf.to_host(&mut all).unwrap();
    assert!(
        all == expect,
        "device contents after the in-place H2D batch"
    );

    // The same engine as a Future, staging the whole buffer sized by its on-device size.
    let mut out = vec![0u8; buf.on_device_size() as usize];
    let mut b = CopyBatch::d2h();
    assert_eq!(b.push_whole(&buf, out.as_mut_ptr()).unwrap(), n as u64);
    // SAFETY: `out` outlives the awaited handle.
    let h = unsafe { b.submit(&pacer) }.unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    let st = rt
        .block_on(async { tokio::time::timeout(LIMIT, h).await })
        .expect("awaited batch hung")
        .unwrap();
    assert_eq!(st.bytes, n as u64);
    assert_eq!(
        st.chunks,
        (n / (16 * 1024)) as u64,
        "split into 16 KiB chunks"
    );
    assert!(out == expect);
}

/// The framework's side of adoption: load the plugin and create objects through the raw C API,
/// as JAX or torch_xla would, without this library.
struct Framework {
    api: *const sys::PJRT_Api,
}

impl Framework {
    fn load() -> Framework {
        let path = CString::new(common::plugin_path().to_str().unwrap()).unwrap();
        // SAFETY: loading the plugin as a framework does; never unloaded.
        let h = unsafe { libc::dlopen(path.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        assert!(!h.is_null(), "dlopen");
        // SAFETY: symbol lookup in the handle just opened.
        let sym = unsafe { libc::dlsym(h, c"GetPjrtApi".as_ptr()) };
        assert!(!sym.is_null(), "GetPjrtApi");
        // SAFETY: GetPjrtApi has this signature (PJRT plugin ABI).
        let get: extern "C" fn() -> *const sys::PJRT_Api = unsafe { std::mem::transmute(sym) };
        let api = get();
        let fw = Framework { api };
        let mut init = sys::PJRT_Plugin_Initialize_Args::new();
        // SAFETY: valid args.
        fw.ok(unsafe { (fw.table().PJRT_Plugin_Initialize.unwrap())(&mut init) });
        fw
    }
    fn table(&self) -> &sys::PJRT_Api {
        // SAFETY: the plugin's static table.
        unsafe { &*self.api }
    }
    fn ok(&self, e: *mut sys::PJRT_Error) {
        assert!(e.is_null(), "a raw PJRT call failed");
    }
    fn create_client(&self) -> *mut sys::PJRT_Client {
        let mut a = sys::PJRT_Client_Create_Args::new();
        // SAFETY: valid args, no options.
        self.ok(unsafe { (self.table().PJRT_Client_Create.unwrap())(&mut a) });
        a.client
    }
    fn device0(&self, client: *mut sys::PJRT_Client) -> *mut sys::PJRT_Device {
        let mut a = sys::PJRT_Client_AddressableDevices_Args::new();
        a.client = client;
        // SAFETY: live client.
        self.ok(unsafe { (self.table().PJRT_Client_AddressableDevices.unwrap())(&mut a) });
        // SAFETY: at least one device on the CPU plugin.
        unsafe { *a.addressable_devices }
    }
    /// A view of `mem` whose on_delete_callback counts into `deleted`.
    fn view(
        &self,
        client: *mut sys::PJRT_Client,
        mem: &Aligned,
        deleted: &'static AtomicUsize,
    ) -> *mut sys::PJRT_Buffer {
        unsafe extern "C" fn count(_p: *mut c_void, arg: *mut c_void) {
            // SAFETY: `arg` is the &'static AtomicUsize passed below.
            unsafe { &*(arg as *const AtomicUsize) }.fetch_add(1, Ordering::SeqCst);
        }
        let dims = [mem.layout.size() as i64];
        let mut a = sys::PJRT_Client_CreateViewOfDeviceBuffer_Args::new();
        a.client = client;
        a.device_buffer_ptr = mem.ptr as *mut c_void;
        a.dims = dims.as_ptr();
        a.num_dims = 1;
        a.element_type = sys::PJRT_Buffer_Type_U8;
        a.device = self.device0(client);
        a.on_delete_callback = Some(count);
        a.on_delete_callback_arg = deleted as *const AtomicUsize as *mut c_void;
        // SAFETY: `mem` outlives the view (the test destroys the view first).
        self.ok(unsafe { (self.table().PJRT_Client_CreateViewOfDeviceBuffer.unwrap())(&mut a) });
        a.buffer
    }
    fn destroy_buffer(&self, b: *mut sys::PJRT_Buffer) {
        let mut a = sys::PJRT_Buffer_Destroy_Args::new();
        a.buffer = b;
        // SAFETY: the framework owns the buffer and destroys it once.
        self.ok(unsafe { (self.table().PJRT_Buffer_Destroy.unwrap())(&mut a) });
    }
    /// Raw `PJRT_Buffer_{Increase,Decrease}ExternalReferenceCount`; whether it succeeded.
    fn external_ref(&self, b: *mut sys::PJRT_Buffer, increase: bool) -> bool {
        let e = if increase {
            let mut a = sys::PJRT_Buffer_IncreaseExternalReferenceCount_Args::new();
            a.buffer = b;
            // SAFETY: live buffer.
            unsafe {
                (self
                    .table()
                    .PJRT_Buffer_IncreaseExternalReferenceCount
                    .unwrap())(&mut a)
            }
        } else {
            let mut a = sys::PJRT_Buffer_DecreaseExternalReferenceCount_Args::new();
            a.buffer = b;
            // SAFETY: live buffer.
            unsafe {
                (self
                    .table()
                    .PJRT_Buffer_DecreaseExternalReferenceCount
                    .unwrap())(&mut a)
            }
        };
        if !e.is_null() {
            let mut d = sys::PJRT_Error_Destroy_Args::new();
            d.error = e;
            // SAFETY: destroys the error just returned to us.
            unsafe { (self.table().PJRT_Error_Destroy.unwrap())(&mut d) };
        }
        e.is_null()
    }
    fn client_alive(&self, c: *mut sys::PJRT_Client) -> bool {
        let mut a = sys::PJRT_Client_PlatformName_Args::new();
        a.client = c;
        // SAFETY: a live client answers; a destroyed one would be a use after free, which the
        // test relies on never being needed (it is only called on clients it has not destroyed).
        let e = unsafe { (self.table().PJRT_Client_PlatformName.unwrap())(&mut a) };
        e.is_null() && a.platform_name_size == 3
    }
    fn destroy_client(&self, c: *mut sys::PJRT_Client) {
        let mut a = sys::PJRT_Client_Destroy_Args::new();
        a.client = c;
        // SAFETY: the framework owns the client; all its buffers are destroyed.
        self.ok(unsafe { (self.table().PJRT_Client_Destroy.unwrap())(&mut a) });
    }
}

#[test]
fn adopted_plugin_client_and_buffer_are_used_but_never_freed() {
    let fw = Framework::load();
    let raw_client = fw.create_client();
    let n = 64 * 1024;
    let mem = Aligned::new(n);
    let data = pattern(n, 21);
    mem.fill(&data);
    let deleted: &'static AtomicUsize = Box::leak(Box::new(AtomicUsize::new(0)));
    let raw_buf = fw.view(raw_client, &mem, deleted);
    {
        // SAFETY: the framework's live table.
        let plugin = unsafe { Plugin::adopt(fw.api, "xla-cpu (framework)") }.unwrap();
        assert!(plugin.is_adopted());
        // SAFETY: live client created through this table; outlives the wrappers.
        let client = unsafe { Client::adopt(&plugin, raw_client) }.unwrap();
        assert!(!client.is_owned());
        // SAFETY: live buffer of that client; the framework destroys it after our wrappers.
        let buf = unsafe { DeviceBuffer::adopt(&client, raw_buf) }.unwrap();
        assert!(!buf.is_owned());
        let caps = Capabilities::probe(&client).unwrap();
        let pacer = Pacer::global();
        // D2H through the adopted handles reads the framework's memory.
        let got = read(&buf, &[(0, n as u64)], pacer);
        assert!(got == data);
        // In-place H2D lands in the framework's memory.
        let patch = pattern(1000, 22);
        write(&caps, &buf, 5000, &patch, pacer);
        let mut expect = data.clone();
        expect[5000..6000].copy_from_slice(&patch);
        assert!(mem.bytes() == expect, "H2D through an adopted view");
        // While a batch is in flight (here: queued on a paused pacer) the library holds an
        // external reference: the framework can take one away (a Decrease succeeds only when
        // the count is positive) ...
        let paused = Pacer::new(PacingConfig::default()).unwrap();
        paused.pause();
        let mut out = vec![0u8; 64];
        let mut b = CopyBatch::d2h();
        b.push(&buf, 0, 64, out.as_mut_ptr()).unwrap();
        // SAFETY: `out` outlives the wait.
        let h = unsafe { b.submit(&paused) }.unwrap();
        assert!(
            fw.external_ref(raw_buf, false),
            "no external reference during the copy"
        );
        assert!(fw.external_ref(raw_buf, true));
        paused.resume();
        assert!(h.wait_timeout(LIMIT));
        h.wait().unwrap();
        assert_eq!(out, expect[..64]);
        // ... and after completion the library holds none.
        assert!(
            !fw.external_ref(raw_buf, false),
            "an external reference leaked"
        );
        // Clones, batches and handles all dropped here.
    }
    // The release callback is asynchronous (up to ~100 ms after a destroy on this plugin): give
    // a wrongful destroy time to show.
    std::thread::sleep(Duration::from_millis(400));
    assert_eq!(
        deleted.load(Ordering::SeqCst),
        0,
        "the library destroyed an adopted buffer"
    );
    assert!(
        fw.client_alive(raw_client),
        "the adopted client is still usable"
    );
    // The framework destroys its buffer: the callback arrives (the count can fail).
    fw.destroy_buffer(raw_buf);
    let t = Instant::now();
    while deleted.load(Ordering::SeqCst) == 0 && t.elapsed() < LIMIT {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(deleted.load(Ordering::SeqCst), 1);
    fw.destroy_client(raw_client);
    drop(mem);
}

#[test]
fn adopting_null_or_foreign_handles_is_an_error() {
    // SAFETY: NULL is refused before any read.
    let e = unsafe { Plugin::adopt(std::ptr::null(), "null") }.unwrap_err();
    assert!(matches!(e, Error::PluginLoad { .. }), "{e}");
    // A table too short to hold the version, and an unknown major version: refused with the
    // same checks as a loaded plugin.
    let mut api = sys::PJRT_Api::new();
    api.struct_size = 16;
    // SAFETY: a readable table that outlives the call.
    let e = unsafe { Plugin::adopt(&api, "short") }.unwrap_err();
    assert!(e.to_string().contains("too small"), "{e}");
    let mut api = sys::PJRT_Api::new();
    api.pjrt_api_version = sys::PJRT_Api_Version::new();
    api.pjrt_api_version.major_version = 1;
    // SAFETY: as above.
    let e = unsafe { Plugin::adopt(&api, "v1") }.unwrap_err();
    assert!(e.to_string().contains("1.0 is not supported"), "{e}");
    let plugin = common::plugin();
    // SAFETY: NULL is refused before use.
    assert!(unsafe { Client::adopt(&plugin, std::ptr::null_mut()) }.is_err());
    let a = common::client(1);
    let b = common::client(1);
    // SAFETY: NULL is refused before use.
    assert!(unsafe { DeviceBuffer::adopt(&a, std::ptr::null_mut()) }.is_err());
    let buf = b
        .buffer_from_host(&[1, 2, 3, 4], ElementType::U8, &[4], &b.device(0).unwrap())
        .unwrap();
    // A live buffer of another client: its device is not one of `a`'s.
    // SAFETY: the handle is live (owned by `buf`); it is only inspected.
    let e = unsafe { DeviceBuffer::adopt(&a, buf.raw()) }.unwrap_err();
    assert!(e.to_string().contains("not addressable"), "{e}");
}

#[test]
fn views_alias_caller_memory_and_report_their_release() {
    let c = common::client(1);
    let caps = Capabilities::probe(&c).unwrap();
    assert!(caps.view);
    let dev = c.device(0).unwrap();
    let n = 32 * 1024;
    let mem = Aligned::new(n);
    let data = pattern(n, 31);
    mem.fill(&data);
    let pinned = dev
        .memories()
        .unwrap()
        .into_iter()
        .find(|m| m.kind() == "pinned_host")
        .unwrap();
    for memory in [None, Some(&pinned)] {
        // SAFETY: `mem` outlives the view: we wait for the release below.
        let view = unsafe {
            c.view_of_device_memory(mem.ptr, ElementType::BF16, &[(n / 2) as i64], &dev, memory)
        }
        .unwrap();
        assert_eq!(view.buffer.on_device_size(), n as u64);
        // D2H through the view reads caller memory.
        let got = read(&view.buffer, &[(100, 900), (0, 10)], Pacer::global());
        assert_eq!(&got[..900], &data[100..1000]);
        assert_eq!(&got[900..], &data[..10]);
        // Caller writes are visible through the view without any copy call.
        let tweak = pattern(64, 32);
        // SAFETY: no copy is running.
        unsafe { std::ptr::copy_nonoverlapping(tweak.as_ptr(), mem.ptr.add(4096), 64) };
        assert_eq!(read(&view.buffer, &[(4096, 64)], Pacer::global()), tweak);
        // SAFETY: restore, no copy is running.
        unsafe { std::ptr::copy_nonoverlapping(data[4096..].as_ptr(), mem.ptr.add(4096), 64) };
        assert!(
            !view.released.is_released(),
            "released while the view lives"
        );
        let released = view.released.clone();
        drop(view);
        assert!(released.wait(LIMIT), "the view's memory was never released");
    }
    // Misaligned: refused before the plugin could silently copy.
    // SAFETY: refused before use.
    let e = unsafe { c.view_of_device_memory(mem.ptr.add(16), ElementType::U8, &[64], &dev, None) }
        .unwrap_err();
    assert!(
        matches!(e, Error::InvalidArgument(ref m) if m.contains("64-byte aligned")),
        "{e}"
    );
    // SAFETY: refused before use.
    assert!(unsafe {
        c.view_of_device_memory(std::ptr::null_mut(), ElementType::U8, &[64], &dev, None)
    }
    .is_err());
    // A memory space of another client.
    let other = common::client(1);
    let foreign = other.device(0).unwrap().default_memory().unwrap();
    // SAFETY: refused before use.
    let e =
        unsafe { c.view_of_device_memory(mem.ptr, ElementType::U8, &[64], &dev, Some(&foreign)) }
            .unwrap_err();
    assert!(e.to_string().contains("another PJRT client"), "{e}");
    // A negative dimension.
    // SAFETY: refused before use.
    let r = unsafe { c.view_of_device_memory(mem.ptr, ElementType::U8, &[-1], &dev, None) };
    assert!(r.is_err());
}

#[test]
fn bad_spans_deleted_buffers_and_runtime_errors_are_reported_with_their_span() {
    let c = common::client(1);
    let caps = Capabilities::probe(&c).unwrap();
    let dev = c.device(0).unwrap();
    let n = 64 * 1024;
    let a = c
        .buffer_from_host(&pattern(n, 41), ElementType::U8, &[n as i64], &dev)
        .unwrap();
    let b = c
        .buffer_from_host(&pattern(n, 42), ElementType::U8, &[n as i64], &dev)
        .unwrap();
    let mut out = vec![0u8; 2 * n];

    // Out-of-range span: refused at push, naming the copy and the range.
    let mut batch = CopyBatch::d2h();
    batch.push(&a, 0, 16, out.as_mut_ptr()).unwrap();
    let e = batch
        .push(&a, n as u64 - 8, 16, out[16..].as_mut_ptr())
        .unwrap_err();
    assert!(
        matches!(e, Error::InvalidArgument(ref m) if m.contains("copy 1") && m.contains("65528..65544")),
        "{e}"
    );
    // NULL host address.
    assert!(batch.push(&a, 0, 1, std::ptr::null_mut()).is_err());
    // Overlapping D2H destinations race in the plugin: refused at submit.
    let mut batch = CopyBatch::d2h();
    batch.push(&a, 0, 100, out.as_mut_ptr()).unwrap();
    batch.push(&b, 0, 100, out[50..].as_mut_ptr()).unwrap();
    // SAFETY: refused before anything is issued.
    let e = unsafe { batch.submit(Pacer::global()) }.unwrap_err();
    assert!(e.to_string().contains("copies 0 and 1"), "{e}");
    // Overlapping H2D destinations too.
    let src = pattern(200, 43);
    let mut batch = CopyBatch::h2d(&caps).unwrap();
    batch.push(&a, 0, 100, src.as_ptr() as *mut u8).unwrap();
    batch
        .push(&a, 99, 100, src[100..].as_ptr() as *mut u8)
        .unwrap();
    // SAFETY: refused before anything is issued.
    assert!(unsafe { batch.submit(Pacer::global()) }.is_err());

    // A buffer deleted before submit: refused, nothing issued, naming its first copy.
    let d = c
        .buffer_from_host(&pattern(4096, 44), ElementType::U8, &[4096], &dev)
        .unwrap();
    d.delete().unwrap();
    let mut batch = CopyBatch::d2h();
    batch.push(&a, 0, 16, out.as_mut_ptr()).unwrap();
    batch.push(&d, 0, 16, out[16..].as_mut_ptr()).unwrap();
    // SAFETY: refused before anything is issued.
    let e = unsafe { batch.submit(Pacer::global()) }.unwrap_err();
    assert!(
        e.to_string().contains("copy 1") && e.to_string().contains("deleted"),
        "{e}"
    );
    assert!(out.iter().all(|&x| x == 0), "nothing was written");

    // A buffer deleted after submit, before its chunks run: the plugin fails those chunks; the
    // batch reports the first failing copy and chunk, after everything in flight completed.
    let pacer = Pacer::new(PacingConfig {
        chunk_bytes: 8192,
        max_inflight_bytes: 8192,
    })
    .unwrap();
    pacer.pause();
    let mut batch = CopyBatch::d2h();
    batch.push(&a, 0, n as u64, out.as_mut_ptr()).unwrap();
    batch.push(&b, 4096, 20_000, out[n..].as_mut_ptr()).unwrap();
    // SAFETY: `out` outlives the handle, which is waited on below.
    let h = unsafe { batch.submit(&pacer) }.unwrap();
    b.delete().unwrap();
    pacer.resume();
    assert!(h.wait_timeout(LIMIT), "batch hung");
    let e = h.wait().unwrap_err();
    assert_eq!(e.op, 1, "{e}");
    assert_eq!((e.offset, e.len), (4096, 8192), "{e}");
    assert!(
        matches!(
            e.error,
            Error::Pjrt {
                code_name: "INVALID_ARGUMENT",
                ..
            }
        ),
        "{e}"
    );
    assert!(
        e.to_string().contains("copy 1 (device bytes 4096..12288"),
        "{e}"
    );
    // Copy 0 (issued first, FIFO) completed in full before the failure.
    assert!(out[..n] == pattern(n, 41)[..]);
    let converted: Error = e.into();
    assert!(converted.to_string().contains("deleted"), "{converted}");
    let st = pacer.stats();
    assert_eq!(st.failed_batches, 1);
    assert_eq!(st.inflight_bytes, 0);

    // In-place H2D on a plugin without a path: Unsupported, naming the plugin and the missing
    // extension (as the CUDA plugin would answer).
    let mut no_h2d = caps.clone();
    no_h2d.h2d = H2dPath::Unsupported(
        "plugin `cuda` (xla_cuda_plugin.so) has no RawBuffer extension (PJRT_Extension_Type 8) \
         and its device memory is not host-addressable"
            .into(),
    );
    let e = CopyBatch::h2d(&no_h2d).unwrap_err();
    assert!(
        matches!(e, Error::Unsupported { ref what, .. } if what.contains("RawBuffer")),
        "{e}"
    );
}

// --- The RawBuffer path of the engine, through a fake extension table over real buffers. ---

/// Calls the fake RawBuffer functions saw: (buffer, offset, size, first byte) per copy, and
/// per buffer (aliases created, aliases destroyed).
static RAW_LOG: Mutex<Vec<(usize, i64, i64, u8)>> = Mutex::new(Vec::new());
static RAW_ALIASES: Mutex<Vec<(usize, i32)>> = Mutex::new(Vec::new());

unsafe extern "C" fn fake_alias(
    a: *mut ext_raw::PJRT_RawBuffer_CreateRawAliasOfBuffer_Args,
) -> *mut sys::PJRT_Error {
    // SAFETY: called by the library with valid args.
    let a = unsafe { &mut *a };
    RAW_ALIASES.lock().unwrap().push((a.buffer as usize, 1));
    // The fake raw buffer is the PJRT_Buffer pointer itself.
    a.raw_buffer = a.buffer as *mut ext_raw::PJRT_RawBuffer;
    std::ptr::null_mut()
}

unsafe extern "C" fn fake_destroy(
    a: *mut ext_raw::PJRT_RawBuffer_Destroy_Args,
) -> *mut sys::PJRT_Error {
    // SAFETY: as above.
    let a = unsafe { &*a };
    RAW_ALIASES.lock().unwrap().push((a.buffer as usize, -1));
    std::ptr::null_mut()
}

unsafe extern "C" fn fake_h2d(
    a: *mut ext_raw::PJRT_RawBuffer_CopyRawHostToDevice_Args,
) -> *mut sys::PJRT_Error {
    // SAFETY: as above.
    let a = unsafe { &mut *a };
    // SAFETY: `src` points to `transfer_size` > 0 readable bytes.
    let first = unsafe { *(a.src as *const u8) };
    RAW_LOG
        .lock()
        .unwrap()
        .push((a.buffer as usize, a.offset, a.transfer_size, first));
    a.event = std::ptr::null_mut(); // done inside the call
    std::ptr::null_mut()
}

#[test]
fn raw_buffer_h2d_path_issues_paced_chunks_through_the_extension() {
    let c = common::client(1);
    let mut caps = Capabilities::probe(&c).unwrap();
    // SAFETY: all-zero is a valid extension table (NULL pointers, None functions).
    let mut table: ext_raw::PJRT_RawBuffer_Extension = unsafe { std::mem::zeroed() };
    table.base.struct_size = 80; // v2, as libtpu ships
    table.base.r#type = sys::PJRT_Extension_Type_RawBuffer;
    table.PJRT_RawBuffer_CreateRawAliasOfBuffer = Some(fake_alias);
    table.PJRT_RawBuffer_Destroy = Some(fake_destroy);
    table.PJRT_RawBuffer_CopyRawHostToDevice = Some(fake_h2d);
    let table: &'static ext_raw::PJRT_RawBuffer_Extension = Box::leak(Box::new(table));
    // SAFETY: the fake table is leaked (process lifetime) and follows the C contract.
    let ext = unsafe { RawBufferExt::from_raw(c.plugin(), table, 80) };
    caps.h2d = H2dPath::RawBufferExtension(ext);
    let dev = c.device(0).unwrap();
    let bufs: Vec<DeviceBuffer> = (0..2)
        .map(|i| {
            c.buffer_from_host(&pattern(65536, 50 + i), ElementType::U8, &[65536], &dev)
                .unwrap()
        })
        .collect();
    let src = pattern(30_000, 52);
    let pacer = Pacer::new(PacingConfig {
        chunk_bytes: 4096,
        max_inflight_bytes: 8192,
    })
    .unwrap();
    let mut batch = CopyBatch::h2d(&caps).unwrap();
    batch
        .push(&bufs[0], 1000, 10_240, src.as_ptr() as *mut u8)
        .unwrap();
    batch
        .push(&bufs[1], 0, 5000, src[20_000..].as_ptr() as *mut u8)
        .unwrap();
    batch
        .push(&bufs[0], 40_000, 0, src.as_ptr() as *mut u8)
        .unwrap();
    // SAFETY: `src` outlives the wait.
    let h = unsafe { batch.submit(&pacer) }.unwrap();
    assert!(h.wait_timeout(LIMIT));
    let st = h.wait().unwrap();
    assert_eq!((st.bytes, st.ops, st.chunks), (15_240, 3, 5));
    let (b0, b1) = (bufs[0].raw() as usize, bufs[1].raw() as usize);
    let log: Vec<_> = RAW_LOG
        .lock()
        .unwrap()
        .iter()
        .filter(|l| l.0 == b0 || l.0 == b1)
        .copied()
        .collect();
    assert_eq!(
        log,
        vec![
            (b0, 1000, 4096, src[0]),
            (b0, 5096, 4096, src[4096]),
            (b0, 9192, 2048, src[8192]),
            (b1, 0, 4096, src[20_000]),
            (b1, 4096, 904, src[24_096]),
        ]
    );
    // One alias per buffer, destroyed before the handle completed.
    let aliases: Vec<_> = RAW_ALIASES
        .lock()
        .unwrap()
        .iter()
        .filter(|l| l.0 == b0 || l.0 == b1)
        .copied()
        .collect();
    assert_eq!(aliases.iter().filter(|a| a.1 == 1).count(), 2);
    assert_eq!(aliases.iter().map(|a| a.1).sum::<i32>(), 0, "{aliases:?}");
    // A table too short for CopyRawHostToDevice is not used at all.
    // SAFETY: as above.
    let short = unsafe { RawBufferExt::from_raw(c.plugin(), table, 56) };
    caps.h2d = H2dPath::RawBufferExtension(short);
    let mut batch = CopyBatch::h2d(&caps).unwrap();
    batch
        .push(&bufs[0], 0, 16, src.as_ptr() as *mut u8)
        .unwrap();
    // SAFETY: refused before anything is issued.
    let e = unsafe { batch.submit(&pacer) }.unwrap_err();
    assert!(e.to_string().contains("struct_size 56"), "{e}");
}

#[test]
fn arena_dma_registration_is_skipped_where_unimplemented() {
    use tpu_sync::arena::{ArenaOptions, DmaRegistration, PinnedArena};
    let c = common::client(1);
    let arena = PinnedArena::new(1 << 20, &ArenaOptions::default()).unwrap();
    match arena.register_dma(&c).unwrap() {
        DmaRegistration::Skipped(m) => assert!(m.contains("UNIMPLEMENTED"), "{m}"),
        DmaRegistration::Mapped => panic!("the XLA CPU plugin does not implement DmaMap"),
    }
    assert_eq!(arena.dma_mapped_clients(), 0);
    // The arena still works as a D2H destination.
    let data = pattern(4096, 60);
    let buf = c
        .buffer_from_host(&data, ElementType::U8, &[4096], &c.device(0).unwrap())
        .unwrap();
    let mut b = CopyBatch::d2h();
    b.push(&buf, 0, 4096, arena.base()).unwrap();
    // SAFETY: the arena outlives the wait; nobody else uses it.
    let h = unsafe { b.submit(Pacer::global()) }.unwrap();
    assert!(h.wait_timeout(LIMIT), "D2H into the arena hung");
    h.wait().unwrap();
    // SAFETY: no copy runs now.
    assert_eq!(unsafe { arena.slice(0, 4096) }.unwrap(), &data[..]);
}
