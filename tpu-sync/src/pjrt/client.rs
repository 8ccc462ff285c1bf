//! PJRT clients, devices and memory spaces.

use std::ffi::c_char;
use std::sync::Arc;

use super::buffer::{on_view_deleted, DeviceBuffer, ElementType, View, ViewReleased};
use super::{c_str_len, pjrt_call, sys, Plugin};
use crate::error::{Error, Result};

/// Alignment in bytes that [`Client::view_of_device_memory`] requires of a device pointer: the
/// XLA CPU plugin aliases only 64-byte aligned memory and silently copies anything else
/// (`docs/plugins-and-engines.md`, "CPU plugin: zero-copy and alignment").
pub const VIEW_ALIGN: usize = 64;

/// Options for [`Client::create`], passed as `PJRT_NamedValue` create options.
///
/// Only options whose name and type the plugin is known to accept should be set: the measured CPU
/// plugins abort the process on a wrongly typed option (`docs/plugins-and-engines.md`, "CPU
/// plugin: inputs that crash it"), so typed fields are offered instead of free-form values.
#[derive(Debug, Clone, Default)]
pub struct ClientOptions {
    /// XLA CPU plugin only: number of CPU "devices" (`cpu_device_count`, kInt64). `None` leaves the
    /// plugin's default (4 on the XLA CPU plugin). Ignored (not sent) unless the plugin is CPU.
    pub cpu_device_count: Option<i64>,
}

pub(crate) struct ClientInner {
    pub(crate) plugin: Arc<Plugin>,
    pub(crate) raw: *mut sys::PJRT_Client,
    owned: bool,
    platform: String,
    platform_version: String,
    devices: Vec<*mut sys::PJRT_Device>,
}

impl ClientInner {
    /// Whether `device` is one of this client's addressable devices.
    pub(crate) fn has_device(&self, device: *mut sys::PJRT_Device) -> bool {
        !device.is_null() && self.devices.contains(&device)
    }

    /// `PJRT_Client_PlatformName`.
    pub(crate) fn platform(&self) -> &str {
        &self.platform
    }
}

// SAFETY: PJRT clients are thread-safe per the C API (XLA's PjRtClient is internally
// synchronised); the raw device pointers are owned by the client and immutable.
unsafe impl Send for ClientInner {}
// SAFETY: as above.
unsafe impl Sync for ClientInner {}

impl Drop for ClientInner {
    fn drop(&mut self) {
        if self.owned {
            let mut a = sys::PJRT_Client_Destroy_Args::new();
            a.client = self.raw;
            // SAFETY: we created this client and every object that borrows it holds an Arc to
            // this inner struct, so nothing uses it after this point.
            if let Err(e) = unsafe { pjrt_call!(&self.plugin, PJRT_Client_Destroy, &mut a) } {
                log::warn!("PJRT_Client_Destroy: {e}");
            }
        }
    }
}

/// A PJRT client: the handle to one runtime instance and its addressable devices.
///
/// Cloning is cheap (shared). The client is destroyed when the last clone, device, memory and
/// buffer obtained from it are dropped, and only if this crate created it (adopted clients are
/// never destroyed by us). `Send + Sync`.
#[derive(Clone)]
pub struct Client {
    pub(crate) inner: Arc<ClientInner>,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("platform", &self.inner.platform)
            .field("devices", &self.inner.devices.len())
            .field("owned", &self.inner.owned)
            .finish()
    }
}

impl Client {
    /// Creates a client with `PJRT_Client_Create`.
    ///
    /// For a CPU plugin, `opts.cpu_device_count` is honoured by creating the client once without
    /// options, checking the platform, and re-creating it with `cpu_device_count` (so that the
    /// CPU-only option is never sent to another platform, which may reject it).
    pub fn create(plugin: &Arc<Plugin>, opts: &ClientOptions) -> Result<Client> {
        let client = Self::create_raw(plugin, &[])?;
        match opts.cpu_device_count {
            Some(n) if client.platform_name() == "cpu" => {
                if n <= 0 || n > 1024 {
                    return Err(Error::InvalidArgument(format!(
                        "cpu_device_count must be in 1..=1024, got {n}"
                    )));
                }
                if client.addressable_devices().len() as i64 == n {
                    return Ok(client);
                }
                drop(client);
                let name = b"cpu_device_count";
                let mut nv = sys::PJRT_NamedValue::new();
                nv.name = name.as_ptr() as *const c_char;
                nv.name_size = name.len();
                nv.r#type = sys::PJRT_NamedValue_kInt64;
                nv.value = sys::PJRT_NamedValue_Value { int64_value: n };
                nv.value_size = 1;
                Self::create_raw(plugin, &[nv])
            }
            _ => Ok(client),
        }
    }

    fn create_raw(plugin: &Arc<Plugin>, options: &[sys::PJRT_NamedValue]) -> Result<Client> {
        let mut a = sys::PJRT_Client_Create_Args::new();
        a.create_options = options.as_ptr();
        a.num_options = options.len();
        // SAFETY: options (and the strings they point to) outlive the call.
        unsafe { pjrt_call!(plugin, PJRT_Client_Create, &mut a) }?;
        if a.client.is_null() {
            return Err(Error::InvalidArgument(
                "PJRT_Client_Create returned a NULL client".into(),
            ));
        }
        // SAFETY: we just created this client and own it.
        unsafe { Self::wrap(plugin.clone(), a.client, true) }
    }

    /// Adopts a client created by someone else (e.g. the serving framework).
    ///
    /// The client is never destroyed by this crate; the caller must keep it alive for as long as
    /// this [`Client`] or anything obtained from it (devices, buffers) exists.
    ///
    /// # Safety
    /// `raw` must be a live `PJRT_Client*` created through `plugin`'s `PJRT_Api`.
    pub unsafe fn adopt(plugin: &Arc<Plugin>, raw: *mut sys::PJRT_Client) -> Result<Client> {
        if raw.is_null() {
            return Err(Error::InvalidArgument("NULL PJRT_Client".into()));
        }
        // SAFETY: forwarded from the caller's contract.
        unsafe { Self::wrap(plugin.clone(), raw, false) }
    }

    unsafe fn wrap(plugin: Arc<Plugin>, raw: *mut sys::PJRT_Client, owned: bool) -> Result<Client> {
        let mut inner = ClientInner {
            plugin,
            raw,
            owned,
            platform: String::new(),
            platform_version: String::new(),
            devices: Vec::new(),
        };
        let p = inner.plugin.clone();
        let mut n = sys::PJRT_Client_PlatformName_Args::new();
        n.client = raw;
        // SAFETY: live client.
        unsafe { pjrt_call!(&p, PJRT_Client_PlatformName, &mut n) }?;
        // SAFETY: the plugin returns a string owned by the client.
        inner.platform = unsafe { c_str_len(n.platform_name, n.platform_name_size) };
        let mut v = sys::PJRT_Client_PlatformVersion_Args::new();
        v.client = raw;
        // SAFETY: live client.
        if unsafe { pjrt_call!(&p, PJRT_Client_PlatformVersion, &mut v) }.is_ok() {
            // SAFETY: string owned by the client.
            inner.platform_version =
                unsafe { c_str_len(v.platform_version, v.platform_version_size) };
        }
        let mut d = sys::PJRT_Client_AddressableDevices_Args::new();
        d.client = raw;
        // SAFETY: live client.
        unsafe { pjrt_call!(&p, PJRT_Client_AddressableDevices, &mut d) }?;
        if d.num_addressable_devices > 0 && !d.addressable_devices.is_null() {
            // SAFETY: the plugin returns an array of `num_addressable_devices` device pointers
            // owned by the client.
            inner.devices = unsafe {
                std::slice::from_raw_parts(d.addressable_devices, d.num_addressable_devices)
            }
            .to_vec();
        }
        Ok(Client {
            inner: Arc::new(inner),
        })
    }

    /// The plugin this client was created through.
    pub fn plugin(&self) -> &Arc<Plugin> {
        &self.inner.plugin
    }

    /// The raw `PJRT_Client*` (borrowed; valid while this client lives).
    pub fn raw(&self) -> *mut sys::PJRT_Client {
        self.inner.raw
    }

    /// Whether this crate created (and will destroy) the client.
    pub fn is_owned(&self) -> bool {
        self.inner.owned
    }

    /// `PJRT_Client_PlatformName`, e.g. `cpu`, `cuda`, `tpu`.
    pub fn platform_name(&self) -> &str {
        &self.inner.platform
    }

    /// `PJRT_Client_PlatformVersion`.
    pub fn platform_version(&self) -> &str {
        &self.inner.platform_version
    }

    /// The client's addressable devices, in the plugin's order.
    pub fn addressable_devices(&self) -> Vec<Device> {
        (0..self.inner.devices.len())
            .map(|i| Device {
                client: self.inner.clone(),
                raw: self.inner.devices[i],
                index: i,
            })
            .collect()
    }

    /// Addressable device number `index` (0-based). Errors with [`Error::InvalidArgument`] when
    /// out of range.
    pub fn device(&self, index: usize) -> Result<Device> {
        let n = self.inner.devices.len();
        if index >= n {
            return Err(Error::InvalidArgument(format!(
                "device index {index} out of range: the {} client has {n} addressable devices",
                self.inner.platform
            )));
        }
        Ok(Device {
            client: self.inner.clone(),
            raw: self.inner.devices[index],
            index,
        })
    }

    /// Copies `data` into a new device buffer of shape `dims` and element type `ty` on `device`
    /// (`PJRT_Client_BufferFromHostBuffer`, copy completed inside the call).
    ///
    /// Errors: [`Error::InvalidArgument`] when `data.len()` differs from the shape's byte size.
    pub fn buffer_from_host(
        &self,
        data: &[u8],
        ty: ElementType,
        dims: &[i64],
        device: &Device,
    ) -> Result<DeviceBuffer> {
        let want = ty.shape_bytes(dims)?;
        if want != data.len() as u64 {
            return Err(Error::InvalidArgument(format!(
                "host data is {} bytes but shape {:?} of {} needs {want}",
                data.len(),
                dims,
                ty.name()
            )));
        }
        self.check_device(device)?;
        let mut a = sys::PJRT_Client_BufferFromHostBuffer_Args::new();
        a.client = self.inner.raw;
        a.data = data.as_ptr() as *const _;
        a.r#type = ty.to_pjrt();
        a.dims = dims.as_ptr();
        a.num_dims = dims.len();
        a.host_buffer_semantics = sys::PJRT_HostBufferSemantics_kImmutableOnlyDuringCall;
        a.device = device.raw;
        // SAFETY: `data` and `dims` outlive the call; with kImmutableOnlyDuringCall the plugin
        // copies the data before returning.
        unsafe { pjrt_call!(&self.inner.plugin, PJRT_Client_BufferFromHostBuffer, &mut a) }?;
        if !a.done_with_host_buffer.is_null() {
            let ev =
                super::buffer::Event::from_raw(self.inner.plugin.clone(), a.done_with_host_buffer);
            ev.wait()?;
        }
        // SAFETY: the plugin just returned this buffer and we own it.
        unsafe { DeviceBuffer::from_raw(self.inner.clone(), a.buffer, true) }
    }

    /// Allocates a device buffer without initialising it (`PJRT_Client_CreateUninitializedBuffer`).
    pub fn uninitialized_buffer(
        &self,
        ty: ElementType,
        dims: &[i64],
        device: &Device,
    ) -> Result<DeviceBuffer> {
        ty.shape_bytes(dims)?;
        self.check_device(device)?;
        let mut a = sys::PJRT_Client_CreateUninitializedBuffer_Args::new();
        a.client = self.inner.raw;
        a.shape_dims = dims.as_ptr();
        a.shape_num_dims = dims.len();
        a.shape_element_type = ty.to_pjrt();
        a.device = device.raw;
        // SAFETY: dims outlive the call.
        unsafe {
            pjrt_call!(
                &self.inner.plugin,
                PJRT_Client_CreateUninitializedBuffer,
                &mut a
            )
        }?;
        // SAFETY: freshly created buffer owned by us.
        unsafe { DeviceBuffer::from_raw(self.inner.clone(), a.buffer, true) }
    }

    /// Wraps existing device memory as a PJRT buffer without copying
    /// (`PJRT_Client_CreateViewOfDeviceBuffer`): how a torch tensor's `data_ptr()` or a JAX
    /// array's `unsafe_buffer_pointer()` becomes a [`DeviceBuffer`] for the copy engine.
    ///
    /// `ptr` is a device address of `device` (on the XLA CPU plugin: a host address) holding a
    /// dense row-major array of shape `dims` and element type `ty`; `memory` optionally names
    /// the memory space (one of `device`'s; default: the device's default memory).
    ///
    /// Guards (`docs/plugins-and-engines.md`, "CPU plugin: inputs that crash it" and "CPU
    /// plugin: zero-copy and alignment"): the plugin is always given an
    /// `on_delete_callback` (a NULL one aborts the CPU plugin at destroy); `ptr` must be 64-byte
    /// aligned (the CPU plugin silently *copies* less aligned memory, which would break
    /// zero-copy without a word); where the plugin reports the buffer's device address it must
    /// equal `ptr`, otherwise the view is refused as a copy.
    ///
    /// The returned [`View`] owns the PJRT buffer (destroyed when its last clone is dropped);
    /// the memory stays the caller's. [`View::released`] turns true once the plugin has let go
    /// of the memory, which happens asynchronously after the buffer is destroyed.
    ///
    /// Errors: [`Error::InvalidArgument`] for NULL or misaligned `ptr`, a bad shape, a device or
    /// memory of another client, a memory `device` cannot address, or an alias that is not
    /// zero-copy; [`Error::Unsupported`] when the plugin lacks the call; [`Error::Pjrt`] when the
    /// plugin refuses (e.g. libtpu: "CreateViewOfDeviceBuffer is not implemented").
    ///
    /// # Safety
    /// `ptr..ptr + size` (size = `dims` x element size) must be device memory of `device` that
    /// stays valid, and is not freed or reused, until [`View::released`] reports the release.
    /// Writes through the view and through `ptr` alias each other.
    pub unsafe fn view_of_device_memory(
        &self,
        ptr: *mut u8,
        ty: ElementType,
        dims: &[i64],
        device: &Device,
        memory: Option<&Memory>,
    ) -> Result<View> {
        if ptr.is_null() {
            return Err(Error::InvalidArgument(
                "NULL device pointer for a view".into(),
            ));
        }
        if (ptr as usize) % VIEW_ALIGN != 0 {
            return Err(Error::InvalidArgument(format!(
                "device pointer {ptr:p} is not {VIEW_ALIGN}-byte aligned (off by {} bytes): the \
                 plugin would copy instead of aliasing; allocate with {VIEW_ALIGN}-byte alignment",
                ptr as usize % VIEW_ALIGN
            )));
        }
        ty.shape_bytes(dims)?;
        self.check_device(device)?;
        if let Some(m) = memory {
            if !Arc::ptr_eq(&m._client, &self.inner) {
                return Err(Error::InvalidArgument(
                    "memory space belongs to another PJRT client".into(),
                ));
            }
            if !device.memories()?.iter().any(|dm| dm.raw == m.raw) {
                return Err(Error::InvalidArgument(format!(
                    "memory space `{}` is not addressable by device {}",
                    m.kind(),
                    device.index()
                )));
            }
        }
        let released = ViewReleased::new();
        let mut a = sys::PJRT_Client_CreateViewOfDeviceBuffer_Args::new();
        a.client = self.inner.raw;
        a.device_buffer_ptr = ptr as *mut std::ffi::c_void;
        a.dims = dims.as_ptr();
        a.num_dims = dims.len();
        a.element_type = ty.to_pjrt();
        a.device = device.raw;
        a.memory = memory.map(|m| m.raw).unwrap_or(std::ptr::null_mut());
        a.on_delete_callback = Some(on_view_deleted);
        a.on_delete_callback_arg = released.callback_arg();
        // SAFETY: dims outlive the call; the callback context is leaked until the plugin calls
        // it (on an error return it is leaked for good: a few bytes, never a dangling pointer
        // the plugin might still call); memory validity is the caller's contract.
        unsafe {
            pjrt_call!(
                &self.inner.plugin,
                PJRT_Client_CreateViewOfDeviceBuffer,
                &mut a
            )
        }?;
        // SAFETY: the plugin just returned this buffer and we own it.
        let buffer = unsafe { DeviceBuffer::from_raw(self.inner.clone(), a.buffer, true) }?;
        if buffer.on_device_size() < ty.shape_bytes(dims)? {
            return Err(Error::InvalidArgument(format!(
                "view of shape {dims:?} {} has only {} on-device bytes",
                ty.name(),
                buffer.on_device_size()
            )));
        }
        // A zero-copy view reports `ptr` as its device address; anything else is a copy.
        match buffer.external_ref().and_then(|r| r.opaque_device_ptr()) {
            Ok(p) if p != ptr => {
                return Err(Error::InvalidArgument(format!(
                    "the plugin made a copy at {p:p} instead of aliasing {ptr:p}; refusing the view"
                )))
            }
            Ok(_) => {}
            Err(e) => log::debug!("view aliasing not verifiable on this plugin: {e}"),
        }
        Ok(View { buffer, released })
    }

    fn check_device(&self, device: &Device) -> Result<()> {
        if !Arc::ptr_eq(&device.client, &self.inner) {
            return Err(Error::InvalidArgument(
                "device belongs to another PJRT client".into(),
            ));
        }
        Ok(())
    }

    /// `PJRT_Client_DmaMap`: registers host memory for DMA with the device.
    ///
    /// # Safety
    /// `ptr..ptr+len` must stay mapped until [`Client::dma_unmap`] is called on it.
    pub unsafe fn dma_map(&self, ptr: *mut u8, len: usize) -> Result<()> {
        let mut a = sys::PJRT_Client_DmaMap_Args::new();
        a.client = self.inner.raw;
        a.data = ptr as *mut _;
        a.size = len;
        // SAFETY: forwarded from the caller's contract.
        unsafe { pjrt_call!(&self.inner.plugin, PJRT_Client_DmaMap, &mut a) }
    }

    /// `PJRT_Client_DmaUnmap`.
    ///
    /// # Safety
    /// `ptr` must have been mapped with [`Client::dma_map`] and not be in use by a transfer.
    pub unsafe fn dma_unmap(&self, ptr: *mut u8) -> Result<()> {
        let mut a = sys::PJRT_Client_DmaUnmap_Args::new();
        a.client = self.inner.raw;
        a.data = ptr as *mut _;
        // SAFETY: forwarded from the caller's contract.
        unsafe { pjrt_call!(&self.inner.plugin, PJRT_Client_DmaUnmap, &mut a) }
    }
}

/// One addressable device of a [`Client`]. Keeps the client alive. `Send + Sync`.
#[derive(Clone)]
pub struct Device {
    pub(crate) client: Arc<ClientInner>,
    pub(crate) raw: *mut sys::PJRT_Device,
    index: usize,
}

// SAFETY: device handles are owned by the (thread-safe) client and immutable.
unsafe impl Send for Device {}
// SAFETY: as above.
unsafe impl Sync for Device {}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Device")
            .field("index", &self.index)
            .finish()
    }
}

impl Device {
    /// Position in the client's addressable-device list.
    pub fn index(&self) -> usize {
        self.index
    }

    /// The raw `PJRT_Device*` (borrowed from the client).
    pub fn raw(&self) -> *mut sys::PJRT_Device {
        self.raw
    }

    fn description(&self) -> Result<*mut sys::PJRT_DeviceDescription> {
        let mut a = sys::PJRT_Device_GetDescription_Args::new();
        a.device = self.raw;
        // SAFETY: live device.
        unsafe { pjrt_call!(&self.client.plugin, PJRT_Device_GetDescription, &mut a) }?;
        Ok(a.device_description)
    }

    /// `PJRT_DeviceDescription_Id`: the global device id.
    pub fn id(&self) -> Result<i32> {
        let mut a = sys::PJRT_DeviceDescription_Id_Args::new();
        a.device_description = self.description()?;
        // SAFETY: live description.
        unsafe { pjrt_call!(&self.client.plugin, PJRT_DeviceDescription_Id, &mut a) }?;
        Ok(a.id)
    }

    /// `PJRT_DeviceDescription_Kind`, e.g. `cpu`, `TPU v5 lite`, `NVIDIA H200`.
    pub fn kind(&self) -> Result<String> {
        let mut a = sys::PJRT_DeviceDescription_Kind_Args::new();
        a.device_description = self.description()?;
        // SAFETY: live description.
        unsafe { pjrt_call!(&self.client.plugin, PJRT_DeviceDescription_Kind, &mut a) }?;
        // SAFETY: string owned by the description.
        Ok(unsafe { c_str_len(a.device_kind, a.device_kind_size) })
    }

    /// `PJRT_DeviceDescription_ToString`.
    pub fn describe(&self) -> Result<String> {
        let mut a = sys::PJRT_DeviceDescription_ToString_Args::new();
        a.device_description = self.description()?;
        // SAFETY: live description.
        unsafe { pjrt_call!(&self.client.plugin, PJRT_DeviceDescription_ToString, &mut a) }?;
        // SAFETY: string owned by the description.
        Ok(unsafe { c_str_len(a.to_string, a.to_string_size) })
    }

    /// `PJRT_Device_LocalHardwareId`.
    pub fn local_hardware_id(&self) -> Result<i32> {
        let mut a = sys::PJRT_Device_LocalHardwareId_Args::new();
        a.device = self.raw;
        // SAFETY: live device.
        unsafe { pjrt_call!(&self.client.plugin, PJRT_Device_LocalHardwareId, &mut a) }?;
        Ok(a.local_hardware_id)
    }

    /// The device's addressable memory spaces (`PJRT_Device_AddressableMemories`).
    pub fn memories(&self) -> Result<Vec<Memory>> {
        let mut a = sys::PJRT_Device_AddressableMemories_Args::new();
        a.device = self.raw;
        // SAFETY: live device.
        unsafe { pjrt_call!(&self.client.plugin, PJRT_Device_AddressableMemories, &mut a) }?;
        if a.num_memories == 0 || a.memories.is_null() {
            return Ok(Vec::new());
        }
        // SAFETY: array of `num_memories` pointers owned by the client.
        let raws = unsafe { std::slice::from_raw_parts(a.memories, a.num_memories) }.to_vec();
        raws.into_iter()
            .map(|m| Memory::new(self.client.clone(), m))
            .collect()
    }

    /// The device's default memory space (`PJRT_Device_DefaultMemory`).
    pub fn default_memory(&self) -> Result<Memory> {
        let mut a = sys::PJRT_Device_DefaultMemory_Args::new();
        a.device = self.raw;
        // SAFETY: live device.
        unsafe { pjrt_call!(&self.client.plugin, PJRT_Device_DefaultMemory, &mut a) }?;
        Memory::new(self.client.clone(), a.memory)
    }
}

/// A PJRT memory space (`device`, `pinned_host`, `unpinned_host`, ...). `Send + Sync`.
#[derive(Clone)]
pub struct Memory {
    _client: Arc<ClientInner>,
    raw: *mut sys::PJRT_Memory,
    kind: String,
    id: i32,
}

// SAFETY: memory handles are owned by the thread-safe client and immutable.
unsafe impl Send for Memory {}
// SAFETY: as above.
unsafe impl Sync for Memory {}

impl std::fmt::Debug for Memory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Memory")
            .field("id", &self.id)
            .field("kind", &self.kind)
            .finish()
    }
}

impl Memory {
    fn new(client: Arc<ClientInner>, raw: *mut sys::PJRT_Memory) -> Result<Memory> {
        if raw.is_null() {
            return Err(Error::InvalidArgument(
                "plugin returned a NULL memory".into(),
            ));
        }
        let mut k = sys::PJRT_Memory_Kind_Args::new();
        k.memory = raw;
        // SAFETY: live memory.
        unsafe { pjrt_call!(&client.plugin, PJRT_Memory_Kind, &mut k) }?;
        // SAFETY: string owned by the memory.
        let kind = unsafe { c_str_len(k.kind, k.kind_size) };
        let mut i = sys::PJRT_Memory_Id_Args::new();
        i.memory = raw;
        // SAFETY: live memory.
        unsafe { pjrt_call!(&client.plugin, PJRT_Memory_Id, &mut i) }?;
        Ok(Memory {
            _client: client,
            raw,
            kind,
            id: i.id,
        })
    }

    /// `PJRT_Memory_Kind`, e.g. `device`, `pinned_host`, `unpinned_host`.
    pub fn kind(&self) -> &str {
        &self.kind
    }

    /// `PJRT_Memory_Id`.
    pub fn id(&self) -> i32 {
        self.id
    }

    /// The raw `PJRT_Memory*` (borrowed from the client).
    pub fn raw(&self) -> *mut sys::PJRT_Memory {
        self.raw
    }
}
