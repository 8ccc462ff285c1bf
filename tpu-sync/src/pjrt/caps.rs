//! Probed copy capabilities of a PJRT client: which D2H path, which in-place H2D path, and whether
//! host memory can be DMA-mapped.
//!
//! The strategy is explicit: [`Capabilities::probe`] decides once per client and every copy uses
//! the recorded path, or fails with [`Error::Unsupported`] naming the plugin and what is missing.
//! Sources for what each plugin has: `docs/plugins-and-engines.md`, "Extensions per plugin",
//! "CPU plugin: calls that work" and "CPU plugin compared with TPU and GPU" (libtpu ships the
//! RawBuffer extension; the CUDA and CPU plugins do not; only the CPU plugin's device memory is
//! host-addressable; DmaMap is UNIMPLEMENTED on CPU).

use std::fmt;

use super::buffer::ElementType;
use super::client::Client;
use super::ext::{LayoutsExt, RawBufferExt};
use super::sys;
use crate::error::{Error, Result};

/// How device-to-host raw copies are done.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum D2hPath {
    /// `PJRT_Buffer_CopyRawToHost(offset, size)`, asynchronous through a `PJRT_Event`.
    CopyRawToHost,
    /// The plugin has no raw D2H entry point.
    Unsupported(String),
}

/// How host-to-device writes into an *existing* device buffer at a byte offset are done.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum H2dPath {
    /// The RawBuffer extension (`PJRT_RawBuffer_CreateRawAliasOfBuffer` +
    /// `PJRT_RawBuffer_CopyRawHostToDevice`), as libtpu provides; chosen only when the
    /// extension's `struct_size` covers both functions (and `Destroy`) and none is NULL.
    RawBufferExtension(RawBufferExt),
    /// Device memory is host memory (XLA CPU plugin): write through
    /// `PJRT_Buffer_OpaqueDeviceMemoryDataPointer` after the buffer's ready event, holding an
    /// external reference for the duration of the write.
    HostAddressable,
    /// No in-place H2D path exists for this plugin; the reason names what is missing.
    Unsupported(String),
}

/// Whether `PJRT_Client_DmaMap` works on this client.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DmaMapSupport {
    /// A probe mapping succeeded (and was unmapped).
    Supported,
    /// The plugin answered with an error (e.g. UNIMPLEMENTED on the CPU plugin); its message.
    Unavailable(String),
}

/// Where a buffer's physical memory layout is read from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LayoutSource {
    /// The Layouts extension (`PJRT_Layouts_PJRT_Buffer_MemoryLayout` + `_Serialize`).
    LayoutsExtension {
        /// The extension's `struct_size` (bytes).
        struct_size: usize,
    },
    /// The deprecated `PJRT_Buffer_GetMemoryLayout`, formatted in XLA notation.
    GetMemoryLayout,
    /// Neither is available: layouts are unknown and not checked.
    Unavailable,
}

impl fmt::Display for LayoutSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LayoutSource::LayoutsExtension { struct_size } => write!(
                f,
                "Layouts extension (PJRT_Layouts_PJRT_Buffer_MemoryLayout + MemoryLayout_Serialize; struct_size {struct_size})"
            ),
            LayoutSource::GetMemoryLayout => {
                write!(f, "PJRT_Buffer_GetMemoryLayout (deprecated; XLA notation)")
            }
            LayoutSource::Unavailable => write!(f, "unavailable (layouts are not checked)"),
        }
    }
}

/// The probed capabilities of one client.
#[derive(Debug, Clone)]
pub struct Capabilities {
    /// The plugin's path (or adoption label), for error messages.
    pub plugin: String,
    /// `PJRT_Client_PlatformName`.
    pub platform: String,
    /// `(major, minor)` API version of the plugin.
    pub api_version: (i32, i32),
    /// Device-to-host path.
    pub d2h: D2hPath,
    /// In-place host-to-device path.
    pub h2d: H2dPath,
    /// DMA mapping of host memory.
    pub dma_map: DmaMapSupport,
    /// Whether `PJRT_Client_CreateViewOfDeviceBuffer` is in the plugin's table (views of
    /// existing device memory; the plugin may still refuse at run time, as libtpu does).
    pub view: bool,
    /// Where buffer layouts come from.
    pub layouts: LayoutSource,
    /// Physical layout and on-device size of a probe buffer `bf16[2,8,16]` on device 0, e.g.
    /// `{2,1,0}, 512 bytes`; `None` when the probe buffer could not be created.
    pub probe_layout: Option<String>,
    /// Names of the plugin's extensions, in chain order.
    pub extensions: Vec<String>,
}

impl fmt::Display for D2hPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            D2hPath::CopyRawToHost => write!(f, "PJRT_Buffer_CopyRawToHost (offset, size; async)"),
            D2hPath::Unsupported(r) => write!(f, "unsupported: {r}"),
        }
    }
}

impl fmt::Display for H2dPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            H2dPath::RawBufferExtension(ext) => write!(
                f,
                "RawBuffer extension CreateRawAliasOfBuffer + CopyRawHostToDevice (extension \
                 struct_size {}, {} functions)",
                ext.struct_size(),
                ext.function_count()
            ),
            H2dPath::HostAddressable => write!(
                f,
                "host-addressable device memory (write via OpaqueDeviceMemoryDataPointer under an external reference)"
            ),
            H2dPath::Unsupported(r) => write!(f, "unsupported: {r}"),
        }
    }
}

impl fmt::Display for DmaMapSupport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DmaMapSupport::Supported => write!(f, "supported (PJRT_Client_DmaMap)"),
            DmaMapSupport::Unavailable(r) => write!(f, "not available: {r}"),
        }
    }
}

impl Capabilities {
    /// Probes `client`: reads the function table and extension chain, allocates one small device
    /// buffer on device 0 to test host addressability, and tries a DmaMap of one page.
    pub fn probe(client: &Client) -> Result<Capabilities> {
        let plugin = client.plugin();
        let platform = client.platform_name().to_string();
        let has = |off: usize| plugin.has_field(off);
        let d2h = if has(std::mem::offset_of!(
            sys::PJRT_Api,
            PJRT_Buffer_CopyRawToHost
        )) {
            D2hPath::CopyRawToHost
        } else {
            D2hPath::Unsupported(format!(
                "PJRT API {}.{} lacks PJRT_Buffer_CopyRawToHost",
                plugin.api_version().0,
                plugin.api_version().1
            ))
        };
        let mut why_not_raw = "no RawBuffer extension (PJRT_Extension_Type 8)".to_string();
        let mut h2d = None;
        if let Some(ext) = RawBufferExt::find(plugin) {
            match ext.check_in_place_h2d() {
                Ok(()) => h2d = Some(H2dPath::RawBufferExtension(ext)),
                Err(e) => why_not_raw = format!("RawBuffer extension unusable: {e}"),
            }
        }
        let h2d = match h2d {
            Some(p) => p,
            None => match Self::probe_host_addressable(client) {
                Ok(true) => H2dPath::HostAddressable,
                Ok(false) => H2dPath::Unsupported(format!(
                    "plugin `{platform}` ({}) has {why_not_raw} and its device memory is not \
                     host-addressable",
                    plugin.path().display()
                )),
                Err(e) => H2dPath::Unsupported(format!(
                    "plugin `{platform}` ({}) has {why_not_raw}; host-addressability probe \
                     failed: {e}",
                    plugin.path().display()
                )),
            },
        };
        let dma_map = Self::probe_dma_map(client);
        let layouts = match LayoutsExt::find(plugin) {
            Some(e) if e.struct_size() >= 56 => LayoutSource::LayoutsExtension {
                struct_size: e.struct_size(),
            },
            _ if has(std::mem::offset_of!(
                sys::PJRT_Api,
                PJRT_Buffer_GetMemoryLayout
            )) =>
            {
                LayoutSource::GetMemoryLayout
            }
            _ => LayoutSource::Unavailable,
        };
        let probe_layout = client
            .device(0)
            .and_then(|d| client.uninitialized_buffer(ElementType::BF16, &[2, 8, 16], &d))
            .ok()
            .map(|b| {
                format!(
                    "{}, {} bytes",
                    b.physical_layout().unwrap_or("unknown layout"),
                    b.on_device_size()
                )
            });
        Ok(Capabilities {
            plugin: plugin.path().display().to_string(),
            platform,
            api_version: plugin.api_version(),
            d2h,
            h2d,
            dma_map,
            view: has(std::mem::offset_of!(
                sys::PJRT_Api,
                PJRT_Client_CreateViewOfDeviceBuffer
            )),
            layouts,
            probe_layout,
            extensions: plugin
                .extensions()
                .iter()
                .map(|e| format!("{}({})", e.name, e.type_id))
                .collect(),
        })
    }

    fn probe_host_addressable(client: &Client) -> Result<bool> {
        if client.platform_name() != "cpu" {
            return Ok(false);
        }
        let dev = client.device(0)?;
        let buf = client.uninitialized_buffer(ElementType::U8, &[4096], &dev)?;
        buf.ready_event()?.wait()?;
        if !buf.is_on_cpu()? {
            return Ok(false);
        }
        let r = buf.external_ref()?;
        Ok(!r.opaque_device_ptr()?.is_null())
    }

    fn probe_dma_map(client: &Client) -> DmaMapSupport {
        let page = 4096usize;
        // SAFETY: anonymous private mapping of one page; unmapped below.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                page,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return DmaMapSupport::Unavailable("mmap of a probe page failed".into());
        }
        // SAFETY: the page stays mapped until after dma_unmap.
        let r = unsafe { client.dma_map(p as *mut u8, page) };
        let out = match r {
            Ok(()) => {
                // SAFETY: mapped just above, not used by any transfer.
                if let Err(e) = unsafe { client.dma_unmap(p as *mut u8) } {
                    log::warn!("PJRT_Client_DmaUnmap of the probe page: {e}");
                }
                DmaMapSupport::Supported
            }
            Err(Error::Pjrt {
                code_name, message, ..
            }) => {
                log::debug!("DmaMap unavailable: {code_name}: {message}");
                DmaMapSupport::Unavailable(format!("{code_name}: {message}"))
            }
            Err(e) => DmaMapSupport::Unavailable(e.to_string()),
        };
        // SAFETY: unmapping the probe page mapped above.
        unsafe { libc::munmap(p, page) };
        out
    }

    /// Errors with [`Error::Unsupported`] unless in-place H2D is available; returns the path.
    pub fn require_h2d(&self) -> Result<&H2dPath> {
        match &self.h2d {
            H2dPath::Unsupported(r) => Err(Error::Unsupported {
                plugin: self.plugin.clone(),
                what: format!("in-place host-to-device copy: {r}"),
            }),
            p => Ok(p),
        }
    }
}
