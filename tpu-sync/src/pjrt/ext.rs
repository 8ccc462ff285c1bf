//! The PJRT extensions this crate calls into: **RawBuffer** (in-place host-to-device writes into an
//! existing device buffer, as libtpu provides) and **Layouts** (a buffer's serialized on-device
//! memory layout).
//!
//! Extensions are not part of `pjrt_c_api.h`, so [`raw`] declares their structs by hand. Sources
//! (facts only: field order and types), from the OpenXLA repository:
//! * `xla/pjrt/c/pjrt_c_api_raw_buffer_extension.h` (`PJRT_API_RAW_BUFFER_EXTENSION_VERSION` 1, 2
//!   and 3 all share one append-only field order: CreateRawAliasOfBuffer, Destroy,
//!   GetOnDeviceSizeInBytes, GetMemorySpace, CopyRawHostToDevice, CopyRawDeviceToHost (v1 ends
//!   here), GetHostPointer (v2), DefineBuffer (v3)). libtpu 0.0.52 ships v2 (7 functions, struct
//!   size 80: `docs/plugins-and-engines.md`, "Extensions per plugin").
//! * `xla/pjrt/c/pjrt_c_api_layouts_extension.h` (version 1 has MemoryLayout_Destroy,
//!   MemoryLayout_Serialize, Client_GetDefaultLayout, Buffer_MemoryLayout; version 4 appends
//!   Topology_GetDefaultLayout, Executable_GetOutputLayouts, Executable_GetParameterLayouts). The
//!   XLA CPU plugin 0.0.1 ships it with 6 functions and serializes a dense 2-D layout as `{1,0}`.
//!
//! Because no installed plugin has the RawBuffer extension, its declarations cannot be checked
//! against a header by `tests/integration/pjrt_abi.rs`; the unit tests below pin every `STRUCT_SIZE` and
//! offset to the values those headers give, and exercise the struct-size guards with fake
//! extension tables.
//!
//! Every extension function is read only after checking that the extension's `struct_size`
//! covers it (`offset + 8 <= struct_size`) and that the pointer is not NULL; otherwise the call
//! is [`Error::Unsupported`] naming the plugin, the extension and the missing function.

use std::ffi::c_void;
use std::mem::{offset_of, size_of};
use std::sync::Arc;

use super::buffer::Event;
use super::{sys, Plugin};
use crate::error::{Error, Result};

/// Hand-written `#[repr(C)]` declarations of the RawBuffer and Layouts extension structs.
#[allow(non_camel_case_types, non_snake_case, missing_docs)]
pub mod raw {
    use std::ffi::{c_char, c_void};

    use super::super::sys::{
        pjrt_structs, PJRT_Buffer, PJRT_Client, PJRT_Event, PJRT_Extension_Base, PjrtFn, UnusedFn,
    };

    /// Opaque `PJRT_RawBuffer` (a raw alias of a buffer's device memory).
    #[repr(C)]
    pub struct PJRT_RawBuffer {
        _private: [u8; 0],
    }
    /// Opaque `PJRT_Layouts_MemoryLayout`.
    #[repr(C)]
    pub struct PJRT_Layouts_MemoryLayout {
        _private: [u8; 0],
    }
    /// Opaque `PJRT_Layouts_SerializedLayout`.
    #[repr(C)]
    pub struct PJRT_Layouts_SerializedLayout {
        _private: [u8; 0],
    }

    pjrt_structs! {
        pub struct PJRT_RawBuffer_CreateRawAliasOfBuffer_Args {
            pub struct_size: usize,
            pub extension_start: *mut PJRT_Extension_Base,
            pub buffer: *mut PJRT_Buffer,
            pub raw_buffer: *mut PJRT_RawBuffer,
        }
        pub struct PJRT_RawBuffer_Destroy_Args {
            pub struct_size: usize,
            pub extension_start: *mut PJRT_Extension_Base,
            pub buffer: *mut PJRT_RawBuffer,
        }
        pub struct PJRT_RawBuffer_GetOnDeviceSizeInBytes_Args {
            pub struct_size: usize,
            pub extension_start: *mut PJRT_Extension_Base,
            pub buffer: *mut PJRT_RawBuffer,
            pub on_device_size_in_bytes: usize,
        }
        pub struct PJRT_RawBuffer_CopyRawHostToDevice_Args {
            pub struct_size: usize,
            pub extension_start: *mut PJRT_Extension_Base,
            pub buffer: *mut PJRT_RawBuffer,
            pub src: *const c_void,
            pub offset: i64,
            pub transfer_size: i64,
            pub event: *mut PJRT_Event,
        }
        pub struct PJRT_RawBuffer_CopyRawDeviceToHost_Args {
            pub struct_size: usize,
            pub extension_start: *mut PJRT_Extension_Base,
            pub buffer: *mut PJRT_RawBuffer,
            pub dst: *mut c_void,
            pub offset: i64,
            pub transfer_size: i64,
            pub event: *mut PJRT_Event,
        }
        pub struct PJRT_Layouts_MemoryLayout_Destroy_Args {
            pub struct_size: usize,
            pub extension_start: *mut PJRT_Extension_Base,
            pub layout: *mut PJRT_Layouts_MemoryLayout,
        }
        pub struct PJRT_Layouts_MemoryLayout_Serialize_Args {
            pub struct_size: usize,
            pub extension_start: *mut PJRT_Extension_Base,
            pub layout: *mut PJRT_Layouts_MemoryLayout,
            pub serialized_bytes: *const c_char,
            pub serialized_bytes_size: usize,
            pub serialized_layout: *mut PJRT_Layouts_SerializedLayout,
            pub serialized_layout_deleter: Option<unsafe extern "C" fn(s_layout: *mut PJRT_Layouts_SerializedLayout)>,
        }
        pub struct PJRT_Layouts_PJRT_Buffer_MemoryLayout_Args {
            pub struct_size: usize,
            pub extension_start: *mut PJRT_Extension_Base,
            pub buffer: *mut PJRT_Buffer,
            pub layout: *mut PJRT_Layouts_MemoryLayout,
        }
        pub struct PJRT_Layouts_PJRT_Client_GetDefaultLayout_Args {
            pub struct_size: usize,
            pub extension_start: *mut PJRT_Extension_Base,
            pub client: *mut PJRT_Client,
            pub r#type: super::super::sys::PJRT_Buffer_Type,
            pub dims: *const i64,
            pub num_dims: usize,
            pub layout: *mut PJRT_Layouts_MemoryLayout,
        }
    }

    /// `PJRT_RawBuffer_Extension` (version 3 field order; v1 ends after
    /// `PJRT_RawBuffer_CopyRawDeviceToHost`, v2 after `PJRT_RawBuffer_GetHostPointer`).
    #[repr(C)]
    #[derive(Clone, Copy)]
    pub struct PJRT_RawBuffer_Extension {
        pub base: PJRT_Extension_Base,
        pub PJRT_RawBuffer_CreateRawAliasOfBuffer:
            PjrtFn<PJRT_RawBuffer_CreateRawAliasOfBuffer_Args>,
        pub PJRT_RawBuffer_Destroy: PjrtFn<PJRT_RawBuffer_Destroy_Args>,
        pub PJRT_RawBuffer_GetOnDeviceSizeInBytes:
            PjrtFn<PJRT_RawBuffer_GetOnDeviceSizeInBytes_Args>,
        pub PJRT_RawBuffer_GetMemorySpace: UnusedFn,
        pub PJRT_RawBuffer_CopyRawHostToDevice: PjrtFn<PJRT_RawBuffer_CopyRawHostToDevice_Args>,
        pub PJRT_RawBuffer_CopyRawDeviceToHost: PjrtFn<PJRT_RawBuffer_CopyRawDeviceToHost_Args>,
        pub PJRT_RawBuffer_GetHostPointer: UnusedFn,
        pub PJRT_Client_DefineBuffer: UnusedFn,
    }

    /// `PJRT_Layouts_Extension` (version 4 field order; version 1 ends after
    /// `PJRT_Layouts_PJRT_Buffer_MemoryLayout`).
    #[repr(C)]
    #[derive(Clone, Copy)]
    pub struct PJRT_Layouts_Extension {
        pub base: PJRT_Extension_Base,
        pub PJRT_Layouts_MemoryLayout_Destroy: PjrtFn<PJRT_Layouts_MemoryLayout_Destroy_Args>,
        pub PJRT_Layouts_MemoryLayout_Serialize: PjrtFn<PJRT_Layouts_MemoryLayout_Serialize_Args>,
        pub PJRT_Layouts_PJRT_Client_GetDefaultLayout:
            PjrtFn<PJRT_Layouts_PJRT_Client_GetDefaultLayout_Args>,
        pub PJRT_Layouts_PJRT_Buffer_MemoryLayout:
            PjrtFn<PJRT_Layouts_PJRT_Buffer_MemoryLayout_Args>,
        pub PJRT_Layouts_PJRT_Topology_GetDefaultLayout: UnusedFn,
        pub PJRT_Layouts_PJRT_Executable_GetOutputLayouts: UnusedFn,
        pub PJRT_Layouts_PJRT_Executable_GetParameterLayouts: UnusedFn,
    }
}

/// Reads one function pointer of an extension table after checking that the extension's
/// `struct_size` covers it. Evaluates to `Result<fn>`; `Err` is [`Error::Unsupported`].
macro_rules! ext_fn {
    ($ext:expr, $table:ty, $field:ident) => {{
        let ext = &$ext;
        let off = offset_of!($table, $field);
        if off + size_of::<usize>() > ext.struct_size {
            Err(ext.missing(stringify!($field), Some(off)))
        } else {
            // SAFETY: the extension struct is at least `struct_size` bytes long (the plugin
            // says so in its header) and the field lies inside it (checked above); the plugin
            // keeps its extension tables alive and immutable for the process lifetime.
            match unsafe { std::ptr::addr_of!((*(ext.ptr as *const $table)).$field).read() } {
                Some(f) => Ok(f),
                None => Err(ext.missing(stringify!($field), None)),
            }
        }
    }};
}

/// Common part of the extension wrappers: where the table is, how long it is, whose it is.
#[derive(Clone)]
struct ExtTable {
    plugin: Arc<Plugin>,
    ptr: *const sys::PJRT_Extension_Base,
    struct_size: usize,
    name: &'static str,
}

// SAFETY: the table is immutable plugin data valid for the process lifetime; PJRT extension
// functions are callable from any thread like the rest of the C API.
unsafe impl Send for ExtTable {}
// SAFETY: as above; shared access only reads the table.
unsafe impl Sync for ExtTable {}

impl ExtTable {
    fn find(plugin: &Arc<Plugin>, type_id: i32) -> Option<ExtTable> {
        plugin.extension(type_id).map(|e| ExtTable {
            plugin: plugin.clone(),
            ptr: e.ptr,
            struct_size: e.struct_size,
            name: e.name,
        })
    }

    fn missing(&self, function: &str, offset: Option<usize>) -> Error {
        Error::Unsupported {
            plugin: self.plugin.path().display().to_string(),
            what: match offset {
                Some(off) => format!(
                    "{function} is not in this plugin's {} extension (extension struct_size {} \
                     bytes, the function needs {} bytes)",
                    self.name,
                    self.struct_size,
                    off + size_of::<usize>()
                ),
                None => format!(
                    "{function} is NULL in this plugin's {} extension (struct_size {})",
                    self.name, self.struct_size
                ),
            },
        }
    }
}

/// The RawBuffer extension of a plugin (`PJRT_Extension_Type_RawBuffer` = 8): raw aliases of a
/// buffer's device memory with in-place `CopyRawHostToDevice` at a byte offset.
///
/// Cloning is cheap. `Send + Sync`. Present on libtpu; absent on the XLA CPU and CUDA plugins
/// (`docs/plugins-and-engines.md`, "Extensions per plugin"), so on this machine it is only
/// exercised through fake tables in tests.
#[derive(Clone)]
pub struct RawBufferExt {
    table: ExtTable,
}

impl std::fmt::Debug for RawBufferExt {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RawBufferExt")
            .field("struct_size", &self.table.struct_size)
            .field("functions", &self.function_count())
            .finish()
    }
}

impl PartialEq for RawBufferExt {
    fn eq(&self, other: &Self) -> bool {
        self.table.ptr == other.table.ptr
    }
}
impl Eq for RawBufferExt {}

impl RawBufferExt {
    /// The plugin's RawBuffer extension, if its chain has one.
    pub fn find(plugin: &Arc<Plugin>) -> Option<RawBufferExt> {
        ExtTable::find(plugin, sys::PJRT_Extension_Type_RawBuffer)
            .map(|table| RawBufferExt { table })
    }

    /// The extension's `struct_size` in bytes.
    pub fn struct_size(&self) -> usize {
        self.table.struct_size
    }

    /// The plugin whose extension this is.
    pub fn plugin(&self) -> &Arc<Plugin> {
        &self.table.plugin
    }

    /// Wraps an extension table that is not (or not only) in a plugin's chain, e.g. a fake
    /// table in tests.
    ///
    /// # Safety
    /// `ptr` must point to a RawBuffer extension table at least `struct_size` bytes long whose
    /// functions follow the C API contract, valid for the process lifetime.
    #[doc(hidden)]
    pub unsafe fn from_raw(
        plugin: &Arc<Plugin>,
        ptr: *const raw::PJRT_RawBuffer_Extension,
        struct_size: usize,
    ) -> RawBufferExt {
        RawBufferExt {
            table: ExtTable {
                plugin: plugin.clone(),
                ptr: ptr as *const sys::PJRT_Extension_Base,
                struct_size,
                name: "RawBuffer",
            },
        }
    }

    /// Number of function slots the `struct_size` covers (7 for v2, as libtpu 0.0.52 ships).
    pub fn function_count(&self) -> usize {
        self.table
            .struct_size
            .saturating_sub(size_of::<sys::PJRT_Extension_Base>())
            / size_of::<usize>()
    }

    /// Checks that the three functions of an in-place H2D copy (`CreateRawAliasOfBuffer`,
    /// `Destroy`, `CopyRawHostToDevice`) are covered by `struct_size` and not NULL.
    ///
    /// Errors: [`Error::Unsupported`] naming the missing function.
    pub fn check_in_place_h2d(&self) -> Result<()> {
        ext_fn!(
            self.table,
            raw::PJRT_RawBuffer_Extension,
            PJRT_RawBuffer_CreateRawAliasOfBuffer
        )?;
        ext_fn!(
            self.table,
            raw::PJRT_RawBuffer_Extension,
            PJRT_RawBuffer_Destroy
        )?;
        ext_fn!(
            self.table,
            raw::PJRT_RawBuffer_Extension,
            PJRT_RawBuffer_CopyRawHostToDevice
        )?;
        Ok(())
    }

    /// `PJRT_RawBuffer_CreateRawAliasOfBuffer`: a raw alias of `buffer`'s device memory,
    /// destroyed (`PJRT_RawBuffer_Destroy`) when the returned guard drops.
    ///
    /// # Safety
    /// `buffer` must be a live `PJRT_Buffer*` of a client of this extension's plugin, and stay
    /// alive until the alias is dropped.
    pub unsafe fn create_alias(&self, buffer: *mut sys::PJRT_Buffer) -> Result<RawAlias> {
        if buffer.is_null() {
            return Err(Error::InvalidArgument(
                "NULL PJRT_Buffer for a raw alias".into(),
            ));
        }
        // Resolve Destroy first so an alias is never created that could not be destroyed.
        ext_fn!(
            self.table,
            raw::PJRT_RawBuffer_Extension,
            PJRT_RawBuffer_Destroy
        )?;
        let f = ext_fn!(
            self.table,
            raw::PJRT_RawBuffer_Extension,
            PJRT_RawBuffer_CreateRawAliasOfBuffer
        )?;
        let mut a = raw::PJRT_RawBuffer_CreateRawAliasOfBuffer_Args::new();
        a.buffer = buffer;
        // SAFETY: valid args; `buffer` is live (caller contract).
        let err = unsafe { f(&mut a) };
        // SAFETY: `err` is NULL or an error returned by this plugin that we own.
        unsafe {
            self.table
                .plugin
                .check(err, "PJRT_RawBuffer_CreateRawAliasOfBuffer")
        }?;
        if a.raw_buffer.is_null() {
            return Err(Error::InvalidArgument(
                "PJRT_RawBuffer_CreateRawAliasOfBuffer returned a NULL raw buffer".into(),
            ));
        }
        Ok(RawAlias {
            ext: self.clone(),
            raw: a.raw_buffer,
        })
    }

    /// `PJRT_RawBuffer_CopyRawHostToDevice`: starts copying `len` bytes from `src` to byte
    /// `offset` of the aliased device memory. Returns the completion event (`None` when the
    /// plugin returned no event, meaning the copy completed inside the call).
    ///
    /// # Safety
    /// `src..src+len` must stay valid and unmodified until the event completes; the range
    /// `offset..offset+len` must lie inside the buffer's on-device size (the caller validated it).
    pub unsafe fn copy_host_to_device(
        &self,
        alias: &RawAlias,
        src: *const u8,
        offset: u64,
        len: u64,
    ) -> Result<Option<Event>> {
        if offset > i64::MAX as u64 || len > i64::MAX as u64 {
            return Err(Error::InvalidArgument(format!(
                "raw H2D range {offset}+{len} exceeds i64"
            )));
        }
        let f = ext_fn!(
            self.table,
            raw::PJRT_RawBuffer_Extension,
            PJRT_RawBuffer_CopyRawHostToDevice
        )?;
        let mut a = raw::PJRT_RawBuffer_CopyRawHostToDevice_Args::new();
        a.buffer = alias.raw;
        a.src = src as *const c_void;
        a.offset = offset as i64;
        a.transfer_size = len as i64;
        // SAFETY: live alias; range and source validity are the caller's contract.
        let err = unsafe { f(&mut a) };
        // SAFETY: `err` is NULL or an owned error of this plugin.
        unsafe {
            self.table
                .plugin
                .check(err, "PJRT_RawBuffer_CopyRawHostToDevice")
        }?;
        Ok((!a.event.is_null()).then(|| Event::from_raw(self.table.plugin.clone(), a.event)))
    }
}

/// A `PJRT_RawBuffer*` alias, destroyed on drop. `Send + Sync` (a PJRT handle).
pub struct RawAlias {
    ext: RawBufferExt,
    raw: *mut raw::PJRT_RawBuffer,
}

// SAFETY: PJRT handles may be used and destroyed from any thread.
unsafe impl Send for RawAlias {}
// SAFETY: as above; the copy call takes the handle by value.
unsafe impl Sync for RawAlias {}

impl RawAlias {
    /// The raw handle (borrowed).
    pub fn raw(&self) -> *mut raw::PJRT_RawBuffer {
        self.raw
    }
}

impl Drop for RawAlias {
    fn drop(&mut self) {
        match ext_fn!(
            self.ext.table,
            raw::PJRT_RawBuffer_Extension,
            PJRT_RawBuffer_Destroy
        ) {
            Ok(f) => {
                let mut a = raw::PJRT_RawBuffer_Destroy_Args::new();
                a.buffer = self.raw;
                // SAFETY: we own the alias and destroy it once.
                let err = unsafe { f(&mut a) };
                let plugin = &self.ext.table.plugin;
                // SAFETY: owned error or NULL.
                let r = unsafe { plugin.check(err, "PJRT_RawBuffer_Destroy") };
                if let Err(e) = r {
                    log::warn!("{e}");
                }
            }
            Err(e) => log::warn!("raw alias leaked: {e}"),
        }
    }
}

/// The Layouts extension of a plugin (`PJRT_Extension_Type_Layouts` = 4). `Send + Sync`.
#[derive(Clone)]
pub struct LayoutsExt {
    table: ExtTable,
}

impl std::fmt::Debug for LayoutsExt {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LayoutsExt")
            .field("struct_size", &self.table.struct_size)
            .finish()
    }
}

impl LayoutsExt {
    /// The plugin's Layouts extension, if its chain has one.
    pub fn find(plugin: &Arc<Plugin>) -> Option<LayoutsExt> {
        ExtTable::find(plugin, sys::PJRT_Extension_Type_Layouts).map(|table| LayoutsExt { table })
    }

    /// The extension's `struct_size` in bytes.
    pub fn struct_size(&self) -> usize {
        self.table.struct_size
    }

    /// The serialized memory layout of `buffer` (`PJRT_Layouts_PJRT_Buffer_MemoryLayout` +
    /// `PJRT_Layouts_MemoryLayout_Serialize`), e.g. `{4,3,2,1,0}` for a dense row-major 5-D
    /// buffer. Bytes that are not printable UTF-8 are returned as `hex:` + lower-case hex.
    ///
    /// # Safety
    /// `buffer` must be a live `PJRT_Buffer*` of this plugin.
    pub unsafe fn buffer_layout(&self, buffer: *mut sys::PJRT_Buffer) -> Result<String> {
        let t = &self.table;
        let get = ext_fn!(
            t,
            raw::PJRT_Layouts_Extension,
            PJRT_Layouts_PJRT_Buffer_MemoryLayout
        )?;
        let ser = ext_fn!(
            t,
            raw::PJRT_Layouts_Extension,
            PJRT_Layouts_MemoryLayout_Serialize
        )?;
        let destroy = ext_fn!(
            t,
            raw::PJRT_Layouts_Extension,
            PJRT_Layouts_MemoryLayout_Destroy
        )?;
        let mut g = raw::PJRT_Layouts_PJRT_Buffer_MemoryLayout_Args::new();
        g.buffer = buffer;
        // SAFETY: live buffer (caller contract); valid args.
        let err = unsafe { get(&mut g) };
        // SAFETY: owned error or NULL.
        unsafe { t.plugin.check(err, "PJRT_Layouts_PJRT_Buffer_MemoryLayout") }?;
        if g.layout.is_null() {
            return Err(Error::InvalidArgument(
                "PJRT_Layouts_PJRT_Buffer_MemoryLayout returned NULL".into(),
            ));
        }
        let mut s = raw::PJRT_Layouts_MemoryLayout_Serialize_Args::new();
        s.layout = g.layout;
        // SAFETY: the layout was just returned to us and is live.
        let err = unsafe { ser(&mut s) };
        // SAFETY: owned error or NULL.
        let r = unsafe { t.plugin.check(err, "PJRT_Layouts_MemoryLayout_Serialize") }.map(|()| {
            let bytes = if s.serialized_bytes.is_null() {
                &[][..]
            } else {
                // SAFETY: the plugin returned `serialized_bytes_size` bytes, alive until the
                // deleter runs below.
                unsafe {
                    std::slice::from_raw_parts(
                        s.serialized_bytes as *const u8,
                        s.serialized_bytes_size,
                    )
                }
            };
            layout_text(bytes)
        });
        if let Some(del) = s.serialized_layout_deleter {
            if !s.serialized_layout.is_null() {
                // SAFETY: called once on the serialized layout the plugin gave us.
                unsafe { del(s.serialized_layout) };
            }
        }
        let mut d = raw::PJRT_Layouts_MemoryLayout_Destroy_Args::new();
        d.layout = g.layout;
        // SAFETY: destroys the layout we own, once.
        let err = unsafe { destroy(&mut d) };
        // SAFETY: owned error or NULL.
        if let Err(e) = unsafe { t.plugin.check(err, "PJRT_Layouts_MemoryLayout_Destroy") } {
            log::warn!("{e}");
        }
        r
    }
}

fn layout_text(bytes: &[u8]) -> String {
    match std::str::from_utf8(bytes) {
        Ok(s) if s.chars().all(|c| !c.is_control()) => s.to_string(),
        _ => {
            let mut out = String::from("hex:");
            for b in bytes {
                out.push_str(&format!("{b:02x}"));
            }
            out
        }
    }
}

/// Formats a `PJRT_Buffer_MemoryLayout` in XLA's notation: `{1,0}` (minor-to-major), with tiles
/// as `{1,0:T(8,128)(2,1)}`, or `strides[...]` for a strided layout.
///
/// # Safety
/// The pointers inside `l` must be valid for the lengths it states (as the plugin returns them).
pub(crate) unsafe fn format_memory_layout(l: &sys::PJRT_Buffer_MemoryLayout) -> String {
    // SAFETY: the union member read matches `type`, as the C API specifies, and each array is
    // as long as its count field says (caller contract).
    unsafe {
        if l.r#type == sys::PJRT_Buffer_MemoryLayout_Type_Strides {
            let s = l.layout.strides;
            let v = slice_or_empty(s.byte_strides, s.num_byte_strides);
            return format!("strides{v:?}");
        }
        let t = l.layout.tiled;
        let m2m = slice_or_empty(t.minor_to_major, t.minor_to_major_size);
        let mut out = String::from("{");
        out.push_str(
            &m2m.iter()
                .map(|d| d.to_string())
                .collect::<Vec<_>>()
                .join(","),
        );
        if t.num_tiles > 0 {
            out.push(':');
            let sizes = slice_or_empty(t.tile_dim_sizes, t.num_tiles);
            let total: usize = sizes.iter().sum();
            let dims = slice_or_empty(t.tile_dims, total);
            out.push('T');
            let mut at = 0;
            for &n in sizes {
                let end = (at + n).min(dims.len());
                let tile = dims[at..end]
                    .iter()
                    .map(|d| d.to_string())
                    .collect::<Vec<_>>()
                    .join(",");
                out.push_str(&format!("({tile})"));
                at = end;
            }
        }
        out.push('}');
        out
    }
}

/// # Safety
/// `p` must be NULL or valid for `n` reads.
unsafe fn slice_or_empty<'a, T>(p: *const T, n: usize) -> &'a [T] {
    if p.is_null() || n == 0 {
        &[]
    } else {
        // SAFETY: caller contract.
        unsafe { std::slice::from_raw_parts(p, n) }
    }
}

/// The deprecated `PJRT_Buffer_GetMemoryLayout`, formatted by [`format_memory_layout`].
///
/// # Safety
/// `buffer` must be a live `PJRT_Buffer*` of `plugin`.
pub(crate) unsafe fn deprecated_buffer_layout(
    plugin: &Plugin,
    buffer: *mut sys::PJRT_Buffer,
) -> Result<String> {
    let mut a = sys::PJRT_Buffer_GetMemoryLayout_Args::new();
    a.buffer = buffer;
    // SAFETY: live buffer; the layout's arrays are owned by the buffer.
    unsafe { super::pjrt_call!(plugin, PJRT_Buffer_GetMemoryLayout, &mut a) }?;
    // SAFETY: the plugin filled the layout with arrays owned by the live buffer.
    Ok(unsafe { format_memory_layout(&a.layout) })
}

/// The physical layout of `buffer` as a string: the Layouts extension's serialization when the
/// plugin has it, else the deprecated `PJRT_Buffer_GetMemoryLayout` in XLA notation.
///
/// # Safety
/// `buffer` must be a live `PJRT_Buffer*` of `plugin`.
pub(crate) unsafe fn buffer_layout_string(
    plugin: &Arc<Plugin>,
    buffer: *mut sys::PJRT_Buffer,
) -> Result<String> {
    if let Some(ext) = LayoutsExt::find(plugin) {
        // SAFETY: forwarded caller contract.
        match unsafe { ext.buffer_layout(buffer) } {
            Ok(s) => return Ok(s),
            Err(e) => log::debug!("Layouts extension failed, trying GetMemoryLayout: {e}"),
        }
    }
    // SAFETY: forwarded caller contract.
    unsafe { deprecated_buffer_layout(plugin, buffer) }
}

#[cfg(test)]
mod tests {
    use super::raw::*;
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Mutex;

    #[test]
    fn struct_sizes_match_the_xla_headers() {
        // Values computed from the field lists of the XLA headers named in the module docs
        // (LP64: pointers, size_t and int64_t are 8 bytes; enums are 4 bytes, padded).
        assert_eq!(PJRT_RawBuffer_CreateRawAliasOfBuffer_Args::STRUCT_SIZE, 32);
        assert_eq!(PJRT_RawBuffer_Destroy_Args::STRUCT_SIZE, 24);
        assert_eq!(PJRT_RawBuffer_GetOnDeviceSizeInBytes_Args::STRUCT_SIZE, 32);
        assert_eq!(PJRT_RawBuffer_CopyRawHostToDevice_Args::STRUCT_SIZE, 56);
        assert_eq!(PJRT_RawBuffer_CopyRawDeviceToHost_Args::STRUCT_SIZE, 56);
        assert_eq!(PJRT_Layouts_MemoryLayout_Destroy_Args::STRUCT_SIZE, 24);
        assert_eq!(PJRT_Layouts_MemoryLayout_Serialize_Args::STRUCT_SIZE, 56);
        assert_eq!(PJRT_Layouts_PJRT_Buffer_MemoryLayout_Args::STRUCT_SIZE, 32);
        assert_eq!(
            PJRT_Layouts_PJRT_Client_GetDefaultLayout_Args::STRUCT_SIZE,
            56
        );
        assert_eq!(
            offset_of!(
                PJRT_RawBuffer_Extension,
                PJRT_RawBuffer_CreateRawAliasOfBuffer
            ),
            24
        );
        assert_eq!(
            offset_of!(PJRT_RawBuffer_Extension, PJRT_RawBuffer_CopyRawHostToDevice),
            56
        );
        assert_eq!(
            offset_of!(PJRT_RawBuffer_Extension, PJRT_RawBuffer_GetHostPointer),
            72
        );
        // v2 (7 functions, as libtpu 0.0.52 ships) is 80 bytes; v3 is 88.
        assert_eq!(
            offset_of!(PJRT_RawBuffer_Extension, PJRT_Client_DefineBuffer),
            80
        );
        assert_eq!(size_of::<PJRT_RawBuffer_Extension>(), 88);
        assert_eq!(
            offset_of!(PJRT_Layouts_Extension, PJRT_Layouts_MemoryLayout_Serialize),
            32
        );
        assert_eq!(
            offset_of!(
                PJRT_Layouts_Extension,
                PJRT_Layouts_PJRT_Buffer_MemoryLayout
            ),
            48
        );
        // The CPU plugin's 6-function Layouts extension is 24 + 6 * 8 = 72 bytes.
        assert_eq!(
            offset_of!(
                PJRT_Layouts_Extension,
                PJRT_Layouts_PJRT_Executable_GetOutputLayouts
            ),
            64
        );
    }

    /// What the fake RawBuffer functions saw. The fake "buffer" handed to `create_alias` is a
    /// pointer to one of these, so parallel tests do not share state.
    #[derive(Default)]
    struct FakeState {
        aliases: AtomicUsize,
        destroyed: AtomicUsize,
        copies: Mutex<Vec<(i64, i64, u8)>>,
    }

    unsafe extern "C" fn fake_alias(
        a: *mut PJRT_RawBuffer_CreateRawAliasOfBuffer_Args,
    ) -> *mut sys::PJRT_Error {
        // SAFETY: called by the code under test with valid args whose buffer is a FakeState.
        unsafe {
            let st = &*((*a).buffer as *const FakeState);
            st.aliases.fetch_add(1, Ordering::SeqCst);
            (*a).raw_buffer = (*a).buffer as *mut PJRT_RawBuffer;
        }
        std::ptr::null_mut()
    }
    unsafe extern "C" fn fake_destroy(a: *mut PJRT_RawBuffer_Destroy_Args) -> *mut sys::PJRT_Error {
        // SAFETY: as above.
        unsafe {
            let st = &*((*a).buffer as *const FakeState);
            st.destroyed.fetch_add(1, Ordering::SeqCst);
        }
        std::ptr::null_mut()
    }
    unsafe extern "C" fn fake_h2d(
        a: *mut PJRT_RawBuffer_CopyRawHostToDevice_Args,
    ) -> *mut sys::PJRT_Error {
        // SAFETY: as above; `src` points to at least one byte when transfer_size > 0.
        unsafe {
            let st = &*((*a).buffer as *const FakeState);
            let first = if (*a).transfer_size > 0 {
                *((*a).src as *const u8)
            } else {
                0
            };
            st.copies
                .lock()
                .unwrap()
                .push(((*a).offset, (*a).transfer_size, first));
            (*a).event = std::ptr::null_mut();
        }
        std::ptr::null_mut()
    }

    /// A fake plugin (a zeroed `PJRT_Api` table of API 0.81) whose extension chain is one fake
    /// RawBuffer extension of `struct_size` bytes.
    fn fake_plugin(struct_size: usize, with_h2d: bool) -> Arc<Plugin> {
        // SAFETY: all-zero is valid for this plain C struct (NULL pointers, None functions).
        let mut ext: PJRT_RawBuffer_Extension = unsafe { std::mem::zeroed() };
        ext.base.struct_size = struct_size;
        ext.base.r#type = sys::PJRT_Extension_Type_RawBuffer;
        ext.PJRT_RawBuffer_CreateRawAliasOfBuffer = Some(fake_alias);
        ext.PJRT_RawBuffer_Destroy = Some(fake_destroy);
        ext.PJRT_RawBuffer_CopyRawHostToDevice = if with_h2d { Some(fake_h2d) } else { None };
        let ext: &'static mut PJRT_RawBuffer_Extension = crate::pjrt::keep_for_process(ext);
        let mut api = sys::PJRT_Api::new();
        api.extension_start = ext as *mut _ as *mut sys::PJRT_Extension_Base;
        api.pjrt_api_version = sys::PJRT_Api_Version::new();
        api.pjrt_api_version.major_version = 0;
        api.pjrt_api_version.minor_version = 81;
        let api: &'static sys::PJRT_Api = crate::pjrt::keep_for_process(api);
        // SAFETY: the fake table is kept for the process (keep_for_process).
        unsafe { Plugin::adopt(api, "fake-rawbuffer") }.expect("adopt the fake plugin")
    }

    #[test]
    fn raw_buffer_calls_go_through_a_full_extension() {
        let p = fake_plugin(80, true);
        let ext = RawBufferExt::find(&p).expect("found in the chain");
        assert_eq!(ext.function_count(), 7);
        ext.check_in_place_h2d().unwrap();
        let st = Box::new(FakeState::default());
        let fake_buffer = &*st as *const FakeState as *mut sys::PJRT_Buffer;
        // SAFETY: the fake functions only touch the FakeState behind the pointer.
        let alias = unsafe { ext.create_alias(fake_buffer) }.unwrap();
        let src = [9u8, 8, 7];
        // SAFETY: `src` outlives the (synchronous) fake copy.
        let ev = unsafe { ext.copy_host_to_device(&alias, src.as_ptr(), 4096, 3) }.unwrap();
        assert!(ev.is_none(), "a NULL event means done inside the call");
        assert_eq!(*st.copies.lock().unwrap(), vec![(4096, 3, 9)]);
        assert_eq!(st.aliases.load(Ordering::SeqCst), 1);
        drop(alias);
        assert_eq!(st.destroyed.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn a_short_raw_buffer_extension_is_refused_before_any_call() {
        // v0-like table: 4 functions (struct_size 56) does not reach CopyRawHostToDevice at 56.
        let p = fake_plugin(56, true);
        let ext = RawBufferExt::find(&p).unwrap();
        let e = ext.check_in_place_h2d().unwrap_err();
        let msg = e.to_string();
        assert!(matches!(e, Error::Unsupported { .. }), "{e}");
        assert!(msg.contains("PJRT_RawBuffer_CopyRawHostToDevice"), "{msg}");
        assert!(msg.contains("struct_size 56"), "{msg}");
        let st = Box::new(FakeState::default());
        let fake_buffer = &*st as *const FakeState as *mut sys::PJRT_Buffer;
        // Alias creation itself is covered (offset 24) and works; the copy is refused.
        // SAFETY: fake functions only.
        let alias = unsafe { ext.create_alias(fake_buffer) }.unwrap();
        let src = [1u8];
        // SAFETY: as above.
        let e = unsafe { ext.copy_host_to_device(&alias, src.as_ptr(), 0, 1) }.unwrap_err();
        assert!(matches!(e, Error::Unsupported { .. }), "{e}");
        assert!(
            st.copies.lock().unwrap().is_empty(),
            "the fake copy was never called"
        );
        // A table too short even for Destroy refuses to create aliases (none could be freed).
        let p = fake_plugin(32, true);
        let ext = RawBufferExt::find(&p).unwrap();
        // SAFETY: as above.
        let e = unsafe { ext.create_alias(fake_buffer) }
            .err()
            .expect("refused");
        assert!(e.to_string().contains("PJRT_RawBuffer_Destroy"), "{e}");
        assert_eq!(
            st.aliases.load(Ordering::SeqCst),
            1,
            "no second alias was created"
        );
    }

    #[test]
    fn a_null_function_in_a_long_enough_table_is_refused() {
        let p = fake_plugin(80, false);
        let ext = RawBufferExt::find(&p).unwrap();
        let e = ext.check_in_place_h2d().unwrap_err();
        assert!(e.to_string().contains("is NULL"), "{e}");
    }

    #[test]
    fn memory_layouts_format_in_xla_notation() {
        let m2m = [1i64, 0];
        let tiles = [8i64, 128, 2, 1];
        let sizes = [2usize, 2];
        let mut l = sys::PJRT_Buffer_MemoryLayout::new();
        let mut t = sys::PJRT_Buffer_MemoryLayout_Tiled::new();
        t.minor_to_major = m2m.as_ptr();
        t.minor_to_major_size = 2;
        l.layout = sys::PJRT_Buffer_MemoryLayout_Union { tiled: t };
        l.r#type = sys::PJRT_Buffer_MemoryLayout_Type_Tiled;
        // SAFETY: the arrays above outlive the calls.
        assert_eq!(unsafe { format_memory_layout(&l) }, "{1,0}");
        t.tile_dims = tiles.as_ptr();
        t.tile_dim_sizes = sizes.as_ptr();
        t.num_tiles = 2;
        l.layout = sys::PJRT_Buffer_MemoryLayout_Union { tiled: t };
        // SAFETY: as above.
        assert_eq!(unsafe { format_memory_layout(&l) }, "{1,0:T(8,128)(2,1)}");
        assert_eq!(layout_text(b"{1,0}"), "{1,0}");
        assert_eq!(layout_text(&[0x08, 0x01]), "hex:0801");
    }
}
