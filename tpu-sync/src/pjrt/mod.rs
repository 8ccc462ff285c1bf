//! PJRT C API access: loading a plugin, clients, devices, memories, buffers and events.
//!
//! This is our own FFI layer over the PJRT C API (the plugin ABI shared by XLA's TPU, GPU and CPU
//! runtimes). The `pjrt` crate on crates.io binds API 0.54 and cannot create a client on current
//! plugins (see `docs/architecture.md`), so [`sys`] declares the C structs by hand and the types
//! here wrap them with ownership, validation and error conversion.
//!
//! Entry points, one per way a serving stack hands us its PJRT objects:
//! * [`Plugin::load`] (a path, or [`default_plugin_path`]) then
//!   [`Client::create`](client::Client::create): the library owns the client (standalone use,
//!   tests, the CLI);
//! * [`Plugin::adopt`] (a `const PJRT_Api*` someone else loaded), [`Client::adopt`] and
//!   [`DeviceBuffer::adopt`]: the framework's own client and KV buffers, never destroyed here;
//! * [`Client::view_of_device_memory`]: a PJRT buffer over existing device memory given as
//!   (pointer, shape, dtype, device), e.g. a torch tensor's `data_ptr()` or a JAX array's
//!   `unsafe_buffer_pointer()`.
//!
//! All three yield [`DeviceBuffer`]s that feed the same copy engine ([`crate::device`]).
//!
//! Thread-safety: [`Plugin`] is immutable after load and `Send + Sync`. [`Client`], [`Device`],
//! [`Memory`] and [`DeviceBuffer`] are `Send + Sync`: the PJRT C API documents every call on these
//! handles as thread-safe (XLA's `PjRtClient`/`PjRtBuffer` are internally synchronised). An
//! [`Event`] is `Send` but not `Sync`.
//!
//! Inputs that the measured plugins abort, hang or crash on (`docs/plugins-and-engines.md`, "CPU
//! plugin: inputs that crash it")
//! are refused here with [`Error::InvalidArgument`] before any call is made, or cannot be
//! expressed through this API:
//!
//! | hazard on the XLA CPU plugin | guard |
//! |---|---|
//! | out-of-range device index | [`Client::device`] checks the index |
//! | raw copy or write past a buffer's end, negative offset | every range is checked against `OnDeviceSizeInBytes` ([`DeviceBuffer::check_range`]) before issue |
//! | `TransferData` past the end / bad `buffer_index` / kInt64 metadata (HANG, SEGV, ABORT) | the AsyncHostToDevice family is not exposed |
//! | a create option of the wrong type (ABORT) | options are typed ([`ClientOptions`]); `cpu_device_count` is only sent to a `cpu` client |
//! | NULL `on_delete_callback` on a view (ABORT at destroy) | every view gets one ([`Client::view_of_device_memory`]) |
//! | a view of memory that is not 64-byte aligned (silent copy) | refused; a view whose device address differs from the pointer is refused too |
//! | awaiting a zero-copy `done_with_host_buffer` before destroy (HANG) | zero-copy `BufferFromHostBuffer` is not exposed; views have no such event |
//! | `DecreaseExternalReferenceCount` without an increase | only through the RAII [`ExternalRef`] |
//! | `Buffer_Destroy` while an external reference is held (frees the memory anyway) | an [`ExternalRef`] keeps the buffer handle alive; owned buffers are destroyed only after the last one |
//! | `Increase`/`DecreaseExternalReferenceCount` on one buffer from two threads at once (the wrapper's list of references is unsynchronised; a lost reference ABORTs at `Buffer_Destroy`: "Non-zero type 1 hold on destruction") | calls are serialised per `PJRT_Buffer*` and counted ([`DeviceBuffer::external_ref`]) |
//! | a device, memory or buffer of another client | checked against the client's addressable devices and memories |
//! | an extension function past the extension's `struct_size` | refused ([`ext`]) |
//! | a host-address write into memory that is not host memory | host-addressable H2D requires `PJRT_Buffer_IsOnCpu` per buffer |

pub mod buffer;
pub mod caps;
pub mod client;
pub mod ext;
pub mod sys;

use std::collections::HashMap;
use std::ffi::c_char;
use std::mem::offset_of;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};

pub use buffer::{DeviceBuffer, ElementType, Event, ExternalRef, View, ViewReleased};
pub use caps::{Capabilities, D2hPath, DmaMapSupport, H2dPath, LayoutSource};
pub use client::{Client, ClientOptions, Device, Memory};
pub use ext::{LayoutsExt, RawBufferExt};

use crate::error::{pjrt_code_name, Error, Result};

/// Environment variable naming the PJRT plugin to load when no path is given.
pub const PLUGIN_ENV: &str = "TPU_SYNC_PJRT_PLUGIN";

/// Relative location, under the repository root, of the CPU plugin that `make plugin` installs.
pub const INSTALLED_PLUGIN_REL: &str =
    ".deps/xla-cpu-pjrt/xla_plugins/xla_cpu_pjrt/xla_cpu_pjrt.so";

/// Calls one `PJRT_Api` function by field name.
///
/// Expands to an expression of type [`Result<()>`]. It checks that the plugin's table is long
/// enough to contain the field (older plugins have shorter tables) and that the pointer is set,
/// calls it, and converts a returned `PJRT_Error*` into [`Error::Pjrt`] (destroying the C error).
///
/// Must be used inside `unsafe`: the caller guarantees that every pointer inside the args struct
/// is valid for the duration of the call as the C API documents.
macro_rules! pjrt_call {
    ($plugin:expr, $field:ident, $args:expr) => {{
        let plugin: &$crate::pjrt::Plugin = $plugin;
        let name = stringify!($field);
        if !plugin.has_field(std::mem::offset_of!($crate::pjrt::sys::PJRT_Api, $field)) {
            Err(plugin.missing(name))
        } else {
            match std::ptr::addr_of!((*plugin.raw_api()).$field).read() {
                None => Err(plugin.missing(name)),
                Some(f) => plugin.check(f($args), name),
            }
        }
    }};
}
pub(crate) use pjrt_call;

/// A PJRT plugin: its `PJRT_Api` function table, and the shared library when we loaded it.
///
/// Loaded once per path per process and never unloaded (function pointers handed to the plugin's
/// threads must stay valid for the life of the process). A plugin [adopted](Plugin::adopt) from
/// a framework was loaded by someone else and is never touched by the loader. `Send + Sync`.
pub struct Plugin {
    path: PathBuf,
    api: *const sys::PJRT_Api,
    api_struct_size: usize,
    version: (i32, i32),
    extensions: Vec<Extension>,
    adopted: bool,
    _lib: Option<libloading::Library>,
}

// SAFETY: the PJRT_Api table is immutable after GetPjrtApi returns and every PJRT entry point is
// documented as callable from any thread; the Library handle is only kept alive, never used.
unsafe impl Send for Plugin {}
// SAFETY: see `Send` above: shared access only reads the immutable table.
unsafe impl Sync for Plugin {}

impl std::fmt::Debug for Plugin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Plugin")
            .field("path", &self.path)
            .field("version", &self.version)
            .field("api_struct_size", &self.api_struct_size)
            .field("adopted", &self.adopted)
            .finish()
    }
}

/// One entry of the plugin's extension chain (`PJRT_Api.extension_start`).
#[derive(Debug, Clone)]
pub struct Extension {
    /// `PJRT_Extension_Type` value.
    pub type_id: i32,
    /// Human name of the type id (names for ids past 15 follow newer XLA headers).
    pub name: &'static str,
    /// The extension struct's `struct_size` in bytes (tells how many functions it has).
    pub struct_size: usize,
    /// Address of the extension struct (valid for the process lifetime).
    pub(crate) ptr: *const sys::PJRT_Extension_Base,
}

impl Extension {
    /// Address of the extension struct (valid for the process lifetime).
    pub fn raw(&self) -> *const sys::PJRT_Extension_Base {
        self.ptr
    }
}

// SAFETY: `ptr` points into the plugin's static, immutable extension tables.
unsafe impl Send for Extension {}
// SAFETY: as above; only read.
unsafe impl Sync for Extension {}

/// Name of a `PJRT_Extension_Type` id. Ids 0-15 are from the 0.81 header; 16-24 from newer XLA
/// headers (as listed in `docs/plugins-and-engines.md`, "Extension type ids").
pub fn extension_name(id: i32) -> &'static str {
    match id {
        0 => "Gpu_Custom_Call",
        1 => "Profiler",
        2 => "Custom_Partitioner",
        3 => "Stream",
        4 => "Layouts",
        5 => "FFI",
        6 => "MemoryDescriptions",
        7 => "Triton",
        8 => "RawBuffer",
        9 => "PhaseCompile",
        10 => "Example",
        11 => "Unknown",
        12 => "CrossHostTransfers",
        13 => "ExecutableMetadata",
        14 => "Callback",
        15 => "HostAllocator",
        16 => "TpuTopology",
        17 => "TpuExecutable",
        18 => "Megascale",
        19 => "Shardings",
        20 => "AbiVersion",
        21 => "Collectives",
        22 => "MultiSlice",
        23 => "HostMemoryAllocator",
        24 => "XlaTransform",
        _ => "unnamed",
    }
}

fn registry() -> &'static Mutex<HashMap<PathBuf, Arc<Plugin>>> {
    static REG: OnceLock<Mutex<HashMap<PathBuf, Arc<Plugin>>>> = OnceLock::new();
    REG.get_or_init(|| Mutex::new(HashMap::new()))
}

/// The plugin path to use when the caller gave none: `$TPU_SYNC_PJRT_PLUGIN`, else the CPU plugin
/// that `make plugin` installed under the repository's `.deps/` (looked up next to the running
/// executable's `target/` folder, then at the source checkout this crate was built from).
pub fn default_plugin_path() -> Result<PathBuf> {
    if let Some(p) = std::env::var_os(PLUGIN_ENV) {
        if !p.is_empty() {
            return Ok(PathBuf::from(p));
        }
    }
    let mut candidates = Vec::new();
    if let Ok(exe) = std::env::current_exe() {
        // target/<profile>/[deps/]exe -> repository root is the parent of `target`.
        for anc in exe.ancestors() {
            if anc.file_name().map(|n| n == "target").unwrap_or(false) {
                if let Some(root) = anc.parent() {
                    candidates.push(root.join(INSTALLED_PLUGIN_REL));
                }
                break;
            }
        }
    }
    candidates.push(
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("..")
            .join(INSTALLED_PLUGIN_REL),
    );
    for c in &candidates {
        if c.is_file() {
            return Ok(c.clone());
        }
    }
    Err(Error::PluginLoad {
        path: candidates.last().cloned().unwrap_or_default(),
        reason: format!(
            "no plugin given: pass --plugin PATH, set {PLUGIN_ENV}, or run `make plugin` to install \
             the XLA CPU plugin (looked in: {})",
            candidates
                .iter()
                .map(|c| c.display().to_string())
                .collect::<Vec<_>>()
                .join(", ")
        ),
    })
}

impl Plugin {
    /// Loads the plugin at `path` (or returns the already loaded one), calls `GetPjrtApi`, checks
    /// `PJRT_Api.struct_size` and the API version, and runs `PJRT_Plugin_Initialize`.
    ///
    /// Errors: [`Error::PluginLoad`] when the file cannot be opened, lacks `GetPjrtApi`, returns a
    /// NULL table, a table too small to hold the version, or a major version other than 0.
    pub fn load(path: &Path) -> Result<Arc<Plugin>> {
        let key = std::fs::canonicalize(path).map_err(|e| Error::PluginLoad {
            path: path.to_path_buf(),
            reason: e.to_string(),
        })?;
        let mut reg = registry().lock().unwrap_or_else(|p| p.into_inner());
        if let Some(p) = reg.get(&key) {
            return Ok(p.clone());
        }
        let plugin = Arc::new(Self::open(&key)?);
        reg.insert(key, plugin.clone());
        Ok(plugin)
    }

    /// Loads [`default_plugin_path`].
    pub fn load_default() -> Result<Arc<Plugin>> {
        Self::load(&default_plugin_path()?)
    }

    fn open(path: &Path) -> Result<Plugin> {
        let fail = |reason: String| Error::PluginLoad {
            path: path.to_path_buf(),
            reason,
        };
        // SAFETY: loading a shared library runs its initialisers; a PJRT plugin is designed to be
        // dlopen'ed by frameworks. RTLD_LOCAL keeps its symbols out of the global namespace.
        let lib = unsafe {
            libloading::os::unix::Library::open(Some(path), libc::RTLD_NOW | libc::RTLD_LOCAL)
        }
        .map_err(|e| fail(e.to_string()))?;
        let lib: libloading::Library = lib.into();
        type GetApi = unsafe extern "C" fn() -> *const sys::PJRT_Api;
        // SAFETY: `GetPjrtApi` is the documented PJRT plugin entry point with this signature.
        let get: libloading::Symbol<GetApi> = unsafe { lib.get(b"GetPjrtApi\0") }
            .map_err(|e| fail(format!("not a PJRT plugin (no GetPjrtApi): {e}")))?;
        // SAFETY: calling the plugin's entry point; it returns a pointer to a static table.
        let api = unsafe { get() };
        // SAFETY: `api` is what GetPjrtApi returned (checked for NULL inside).
        let mut plugin = unsafe { Self::from_api(api, path.to_path_buf(), false) }?;
        plugin._lib = Some(lib);
        let mut init = sys::PJRT_Plugin_Initialize_Args::new();
        // SAFETY: the args struct is valid and contains no pointers.
        let r = unsafe { pjrt_call!(&plugin, PJRT_Plugin_Initialize, &mut init) };
        if let Err(e) = r {
            // Older plugins lack the entry; a plugin that has it and fails is unusable.
            if !matches!(e, Error::Unsupported { .. }) {
                return Err(fail(format!("PJRT_Plugin_Initialize: {e}")));
            }
        }
        log::debug!(
            "loaded PJRT plugin {} (API {}.{}, {} extensions)",
            path.display(),
            plugin.version.0,
            plugin.version.1,
            plugin.extensions.len()
        );
        Ok(plugin)
    }

    /// Adopts a `PJRT_Api` table that someone else loaded (e.g. the serving framework's
    /// `GetPjrtApi()` result, as JAX or torch_xla hold it). Nothing is `dlopen`ed and nothing is
    /// ever unloaded; `PJRT_Plugin_Initialize` is not called again (the owner did). The same
    /// checks as [`Plugin::load`] apply: the table's `struct_size` must hold the API version,
    /// and the major version must be 0. `label` names the plugin in errors (e.g. `libtpu`).
    ///
    /// Every adoption returns a new [`Plugin`] (adoption is not cached by pointer).
    ///
    /// Errors: [`Error::PluginLoad`] for a NULL table, a too small `struct_size`, or an
    /// unsupported major version.
    ///
    /// # Safety
    /// `api` must be NULL or point to a `PJRT_Api` table that stays valid and unchanged for the
    /// rest of the process, as `GetPjrtApi` guarantees for the table it returns.
    pub unsafe fn adopt(api: *const sys::PJRT_Api, label: &str) -> Result<Arc<Plugin>> {
        let path = PathBuf::from(format!("<adopted {label} PJRT_Api at {api:p}>"));
        // SAFETY: forwarded caller contract.
        let plugin = unsafe { Self::from_api(api, path, true) }?;
        log::debug!(
            "adopted PJRT_Api {label} (API {}.{}, {} extensions)",
            plugin.version.0,
            plugin.version.1,
            plugin.extensions.len()
        );
        Ok(Arc::new(plugin))
    }

    /// Checks a table and reads its version and extension chain.
    ///
    /// # Safety
    /// `api` must be NULL or a valid `PJRT_Api` table for the process lifetime.
    unsafe fn from_api(api: *const sys::PJRT_Api, path: PathBuf, adopted: bool) -> Result<Plugin> {
        let fail = |reason: String| Error::PluginLoad {
            path: path.clone(),
            reason,
        };
        if api.is_null() {
            return Err(fail("GetPjrtApi returned NULL".into()));
        }
        // SAFETY: every PJRT_Api starts with `size_t struct_size`.
        let api_struct_size = unsafe { std::ptr::addr_of!((*api).struct_size).read() };
        let version_end = offset_of!(sys::PJRT_Api, pjrt_api_version) + size_of_val_version();
        if api_struct_size < version_end {
            return Err(fail(format!(
                "PJRT_Api.struct_size {api_struct_size} is too small to hold the API version \
                 ({version_end} bytes needed)"
            )));
        }
        // SAFETY: checked above that the table contains the version struct.
        let v = unsafe { std::ptr::addr_of!((*api).pjrt_api_version).read() };
        let version = (v.major_version, v.minor_version);
        if version.0 != 0 {
            return Err(fail(format!(
                "PJRT API version {}.{} is not supported (this build knows major version 0)",
                version.0, version.1
            )));
        }
        let mut plugin = Plugin {
            path: path.clone(),
            api,
            api_struct_size,
            version,
            extensions: Vec::new(),
            adopted,
            _lib: None,
        };
        plugin.extensions = plugin.walk_extensions();
        Ok(plugin)
    }

    /// Whether this plugin was [adopted](Plugin::adopt) rather than loaded by us.
    pub fn is_adopted(&self) -> bool {
        self.adopted
    }

    fn walk_extensions(&self) -> Vec<Extension> {
        let mut out = Vec::new();
        if !self.has_field(offset_of!(sys::PJRT_Api, extension_start)) {
            return out;
        }
        // SAFETY: the field lies inside the table (checked above).
        let mut p = unsafe { std::ptr::addr_of!((*self.api).extension_start).read() }
            as *const sys::PJRT_Extension_Base;
        // A corrupt chain must not loop forever.
        let mut guard = 0;
        while !p.is_null() && guard < 64 {
            // SAFETY: each extension starts with PJRT_Extension_Base, which the plugin keeps alive
            // for its lifetime.
            let base = unsafe { p.read() };
            out.push(Extension {
                type_id: base.r#type,
                name: extension_name(base.r#type),
                struct_size: base.struct_size,
                ptr: p,
            });
            p = base.next;
            guard += 1;
        }
        out
    }

    /// Path the plugin was loaded from (canonical).
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// `(major, minor)` from `PJRT_Api.pjrt_api_version`.
    pub fn api_version(&self) -> (i32, i32) {
        self.version
    }

    /// `PJRT_Api.struct_size` as reported by the plugin (bytes).
    pub fn api_struct_size(&self) -> usize {
        self.api_struct_size
    }

    /// The extension chain, in order.
    pub fn extensions(&self) -> &[Extension] {
        &self.extensions
    }

    /// The extension of a given `PJRT_Extension_Type`, if the plugin has it.
    pub fn extension(&self, type_id: i32) -> Option<&Extension> {
        self.extensions.iter().find(|e| e.type_id == type_id)
    }

    /// `PJRT_Plugin_Attributes` as `(name, value)` strings.
    pub fn attributes(&self) -> Result<Vec<(String, String)>> {
        let mut a = sys::PJRT_Plugin_Attributes_Args::new();
        // SAFETY: valid args; outputs are written by the plugin.
        unsafe { pjrt_call!(self, PJRT_Plugin_Attributes, &mut a) }?;
        let mut out = Vec::new();
        for i in 0..a.num_attributes {
            // SAFETY: the plugin returned `num_attributes` entries that live as long as the plugin.
            let nv = unsafe { &*a.attributes.add(i) };
            out.push(named_value_to_strings(nv));
        }
        Ok(out)
    }

    /// True when the plugin's `PJRT_Api` table contains the field at `offset`.
    #[doc(hidden)]
    pub fn has_field(&self, offset: usize) -> bool {
        offset + std::mem::size_of::<usize>() <= self.api_struct_size
    }

    /// The raw `PJRT_Api` table. Read fields only after [`Plugin::has_field`].
    #[doc(hidden)]
    pub fn raw_api(&self) -> *const sys::PJRT_Api {
        self.api
    }

    #[doc(hidden)]
    pub fn missing(&self, name: &str) -> Error {
        Error::Unsupported {
            plugin: self.path.display().to_string(),
            what: format!(
                "{name} is not provided by this plugin (PJRT API {}.{})",
                self.version.0, self.version.1
            ),
        }
    }

    /// Converts a returned `PJRT_Error*` into a `Result`, destroying the C error.
    ///
    /// # Safety
    /// `err` must be NULL or an error returned by this plugin that nobody else destroys.
    #[doc(hidden)]
    pub unsafe fn check(&self, err: *mut sys::PJRT_Error, call: &'static str) -> Result<()> {
        if err.is_null() {
            return Ok(());
        }
        // SAFETY: `err` is a non-null error just returned by the plugin; we own it.
        let (code, message) = unsafe { self.take_error(err) };
        Err(Error::Pjrt {
            call,
            code,
            code_name: pjrt_code_name(code),
            message,
        })
    }

    /// Reads code and message of an owned `PJRT_Error` and destroys it.
    ///
    /// # Safety
    /// `err` must be a non-null error returned by this plugin and not yet destroyed.
    pub(crate) unsafe fn take_error(&self, err: *mut sys::PJRT_Error) -> (i32, String) {
        let mut code = 2; // UNKNOWN
        let mut message = String::from("(no message)");
        if self.has_field(offset_of!(sys::PJRT_Api, PJRT_Error_Message)) {
            // SAFETY: field inside the table.
            if let Some(f) = unsafe { std::ptr::addr_of!((*self.api).PJRT_Error_Message).read() } {
                let mut m = sys::PJRT_Error_Message_Args::new();
                m.error = err;
                // SAFETY: valid args with a live error.
                unsafe { f(&mut m) };
                if !m.message.is_null() {
                    // SAFETY: the plugin returns `message_size` bytes owned by the error.
                    let bytes = unsafe {
                        std::slice::from_raw_parts(m.message as *const u8, m.message_size)
                    };
                    message = String::from_utf8_lossy(bytes).into_owned();
                }
            }
        }
        let mut c = sys::PJRT_Error_GetCode_Args::new();
        c.error = err;
        // SAFETY: valid args with a live error.
        if unsafe { pjrt_call!(self, PJRT_Error_GetCode, &mut c) }.is_ok() {
            code = c.code;
        }
        if self.has_field(offset_of!(sys::PJRT_Api, PJRT_Error_Destroy)) {
            // SAFETY: field inside the table.
            if let Some(f) = unsafe { std::ptr::addr_of!((*self.api).PJRT_Error_Destroy).read() } {
                let mut d = sys::PJRT_Error_Destroy_Args::new();
                d.error = err;
                // SAFETY: destroys the error we own exactly once.
                unsafe { f(&mut d) };
            }
        }
        (code, message)
    }
}

fn size_of_val_version() -> usize {
    std::mem::size_of::<sys::PJRT_Api_Version>()
}

/// Copies a plugin-owned (pointer, length) string.
///
/// # Safety
/// `ptr` must point to `len` readable bytes, or be NULL.
pub(crate) unsafe fn c_str_len(ptr: *const c_char, len: usize) -> String {
    if ptr.is_null() {
        return String::new();
    }
    // SAFETY: guaranteed by the caller.
    let bytes = unsafe { std::slice::from_raw_parts(ptr as *const u8, len) };
    String::from_utf8_lossy(bytes).into_owned()
}

fn named_value_to_strings(nv: &sys::PJRT_NamedValue) -> (String, String) {
    // SAFETY: `name` is `name_size` bytes owned by the plugin.
    let name = unsafe { c_str_len(nv.name, nv.name_size) };
    // SAFETY: the union member read matches `type`, as the C API specifies; array values are
    // `value_size` elements long.
    let value = unsafe {
        match nv.r#type {
            sys::PJRT_NamedValue_kString => c_str_len(nv.value.string_value, nv.value_size),
            sys::PJRT_NamedValue_kInt64 => nv.value.int64_value.to_string(),
            sys::PJRT_NamedValue_kInt64List => {
                let p = nv.value.int64_array_value;
                if p.is_null() {
                    "[]".into()
                } else {
                    format!("{:?}", std::slice::from_raw_parts(p, nv.value_size))
                }
            }
            sys::PJRT_NamedValue_kFloat => nv.value.float_value.to_string(),
            sys::PJRT_NamedValue_kBool => nv.value.bool_value.to_string(),
            t => format!("<value of type {t}>"),
        }
    };
    (name, value)
}

/// Test support: gives `v` a `'static` home for fake plugin tables (an adopted `PJRT_Api` must
/// live for the process, as a real plugin's does). The allocation stays referenced from a static
/// list, so leak checkers (LeakSanitizer, valgrind) see it as reachable, not lost.
#[cfg(test)]
pub(crate) fn keep_for_process<T: 'static>(v: T) -> &'static mut T {
    static KEPT: Mutex<Vec<usize>> = Mutex::new(Vec::new());
    let p = Box::into_raw(Box::new(v));
    KEPT.lock()
        .unwrap_or_else(|e| e.into_inner())
        .push(p as usize);
    // SAFETY: `p` comes from `Box::into_raw` and is never freed, so the reference is valid for
    // the rest of the process; it is the only reference made from it.
    unsafe { &mut *p }
}
