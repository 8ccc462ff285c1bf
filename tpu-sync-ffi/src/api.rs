//! The exported functions, grouped by object.

use std::ffi::{c_char, c_void, CStr};
use std::sync::Arc;

use tpu_sync::pjrt::{Capabilities, Client, ClientOptions, DeviceBuffer, ElementType, Plugin};
use tpu_sync::plan::{Placement, Plan};

use crate::handle::{self, tpu_sync_handle_kind as K};
use crate::status::{boundary, invalid, null, tpu_sync_status, FfiResult};

// ---------------------------------------------------------------------------------------------
// Helpers

/// Reads a NUL-terminated UTF-8 string argument.
pub(crate) unsafe fn str_arg<'a>(p: *const c_char, name: &str) -> FfiResult<&'a str> {
    if p.is_null() {
        return Err(null(name));
    }
    // SAFETY: caller contract: a NUL-terminated string.
    unsafe { CStr::from_ptr(p) }
        .to_str()
        .map_err(|_| invalid(format!("`{name}` is not valid UTF-8")))
}

/// Writes `v` through an out-pointer.
pub(crate) unsafe fn out<T>(p: *mut T, v: T, name: &str) -> FfiResult {
    if p.is_null() {
        return Err(null(name));
    }
    // SAFETY: caller contract: NULL (checked) or writable.
    unsafe { p.write(v) };
    Ok(())
}

/// Copies `s` into a caller buffer (NUL-terminated); `TPU_SYNC_BUFFER_TOO_SMALL` when it does not
/// fit, with the needed length (without NUL) in `len_out`.
pub(crate) unsafe fn out_string(
    s: &str,
    buf: *mut c_char,
    buf_len: usize,
    len_out: *mut usize,
) -> FfiResult {
    if !len_out.is_null() {
        // SAFETY: caller contract: NULL or writable.
        unsafe { *len_out = s.len() };
    }
    if buf_len < s.len() + 1 {
        return Err(crate::status::Failure(
            tpu_sync_status::TPU_SYNC_BUFFER_TOO_SMALL,
            format!(
                "output needs {} bytes plus NUL, buffer has {buf_len}",
                s.len()
            ),
        ));
    }
    if buf.is_null() {
        return Err(null("buf"));
    }
    // SAFETY: `buf` has `buf_len > s.len()` writable bytes (caller contract, checked length).
    unsafe {
        std::ptr::copy_nonoverlapping(s.as_ptr(), buf as *mut u8, s.len());
        *buf.add(s.len()) = 0;
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Version

/// ABI version of this header and library. Incremented on every incompatible change.
pub const TPU_SYNC_ABI_VERSION: u32 = 1;

/// Library version, e.g. `"0.1.0"`: a static NUL-terminated string; never NULL, never freed.
#[no_mangle]
pub extern "C" fn tpu_sync_version() -> *const c_char {
    concat!(env!("CARGO_PKG_VERSION"), "\0").as_ptr() as *const c_char
}

/// ABI version of the loaded library; compare with the header's `TPU_SYNC_ABI_VERSION`.
#[no_mangle]
pub extern "C" fn tpu_sync_abi_version() -> u32 {
    TPU_SYNC_ABI_VERSION
}

/// Test hook: panics inside the library. Returns `TPU_SYNC_PANIC`, proving that no panic crosses
/// the boundary. Has no other effect.
#[no_mangle]
pub extern "C" fn tpu_sync_debug_panic() -> tpu_sync_status {
    boundary("tpu_sync_debug_panic", || {
        panic!("requested by tpu_sync_debug_panic")
    })
}

// ---------------------------------------------------------------------------------------------
// Client

/// Opaque PJRT client handle (a client this library created, with its probed capabilities).
/// Free with [`tpu_sync_client_free`]. Thread-safe.
pub struct tpu_sync_client {
    _private: [u8; 0],
}

pub(crate) struct ClientObj {
    pub(crate) client: Client,
    pub(crate) caps: Capabilities,
}

impl ClientObj {
    /// Probes `client`'s copy paths and registers it as a new client handle (owned by the caller).
    pub(crate) fn into_handle(client: Client) -> FfiResult<*mut tpu_sync_client> {
        let caps = Capabilities::probe(&client)?;
        Ok(handle::insert(
            K::TPU_SYNC_HANDLE_CLIENT,
            Arc::new(ClientObj { client, caps }),
        ))
    }
}

/// Loads a PJRT plugin and creates a client.
///
/// * `plugin_path`: NUL-terminated path of the plugin shared library, or NULL for the default
///   (`$TPU_SYNC_PJRT_PLUGIN`, else the XLA CPU plugin installed by `make plugin`). Borrowed.
/// * `cpu_device_count`: number of devices to ask the XLA CPU plugin for; `<= 0` keeps the
///   plugin's default. Ignored by other platforms.
/// * `client_out`: receives a new handle owned by the caller (free with [`tpu_sync_client_free`]).
///
/// Errors: `TPU_SYNC_PLUGIN_LOAD`, `TPU_SYNC_PJRT`, `TPU_SYNC_NULL_POINTER`.
///
/// # Safety
/// `plugin_path` must be NULL or NUL-terminated; `client_out` must be writable.
#[no_mangle]
pub unsafe extern "C" fn tpu_sync_client_new(
    plugin_path: *const c_char,
    cpu_device_count: i64,
    client_out: *mut *mut tpu_sync_client,
) -> tpu_sync_status {
    boundary("tpu_sync_client_new", || {
        if client_out.is_null() {
            return Err(null("client_out"));
        }
        let plugin = if plugin_path.is_null() {
            Plugin::load_default()?
        } else {
            // SAFETY: non-NULL, NUL-terminated per contract.
            Plugin::load(std::path::Path::new(unsafe {
                str_arg(plugin_path, "plugin_path")
            }?))?
        };
        let client = Client::create(
            &plugin,
            &ClientOptions {
                cpu_device_count: (cpu_device_count > 0).then_some(cpu_device_count),
            },
        )?;
        let h = ClientObj::into_handle(client)?;
        // SAFETY: checked non-NULL.
        unsafe { out(client_out, h, "client_out") }
    })
}

/// Frees a client handle. Buffers created from it stay valid (they keep the client alive).
/// Freeing twice returns `TPU_SYNC_INVALID_HANDLE`.
#[no_mangle]
pub extern "C" fn tpu_sync_client_free(client: *mut tpu_sync_client) -> tpu_sync_status {
    boundary("tpu_sync_client_free", || {
        handle::remove(K::TPU_SYNC_HANDLE_CLIENT, client)?;
        Ok(())
    })
}

/// Writes a JSON description of the client (platform, API version, devices, memory kinds,
/// capabilities) into `buf` as a NUL-terminated string; see the conventions for `buf`/`len_out`.
///
/// # Safety
/// `buf` must have `buf_len` writable bytes (or be NULL with `buf_len` 0); `len_out` NULL or
/// writable.
#[no_mangle]
pub unsafe extern "C" fn tpu_sync_client_info(
    client: *const tpu_sync_client,
    buf: *mut c_char,
    buf_len: usize,
    len_out: *mut usize,
) -> tpu_sync_status {
    boundary("tpu_sync_client_info", || {
        let c: Arc<ClientObj> = handle::get(K::TPU_SYNC_HANDLE_CLIENT, client)?;
        let mut devices = Vec::new();
        for d in c.client.addressable_devices() {
            let kinds: Vec<String> = d.memories()?.iter().map(|m| m.kind().to_string()).collect();
            devices.push(serde_json::json!({
                "index": d.index(), "id": d.id()?, "kind": d.kind()?, "memory_kinds": kinds,
            }));
        }
        let v = serde_json::json!({
            "platform": c.client.platform_name(),
            "platform_version": c.client.platform_version(),
            "api_version": [c.caps.api_version.0, c.caps.api_version.1],
            "plugin": c.client.plugin().path().display().to_string(),
            "devices": devices,
            "d2h_path": c.caps.d2h.to_string(),
            "h2d_path": c.caps.h2d.to_string(),
            "dma_map": c.caps.dma_map.to_string(),
            "extensions": c.caps.extensions,
        });
        // SAFETY: forwarded caller contract.
        unsafe { out_string(&v.to_string(), buf, buf_len, len_out) }
    })
}

/// Number of addressable devices of the client, written to `count_out`.
///
/// # Safety
/// `count_out` must be writable.
#[no_mangle]
pub unsafe extern "C" fn tpu_sync_client_device_count(
    client: *const tpu_sync_client,
    count_out: *mut usize,
) -> tpu_sync_status {
    boundary("tpu_sync_client_device_count", || {
        let c: Arc<ClientObj> = handle::get(K::TPU_SYNC_HANDLE_CLIENT, client)?;
        // SAFETY: forwarded caller contract.
        unsafe { out(count_out, c.client.addressable_devices().len(), "count_out") }
    })
}

// ---------------------------------------------------------------------------------------------
// Buffers

/// Opaque PJRT device buffer handle. Free with [`tpu_sync_buffer_free`]. Thread-safe.
pub struct tpu_sync_buffer {
    _private: [u8; 0],
}

pub(crate) struct BufferObj {
    pub(crate) buffer: DeviceBuffer,
    pub(crate) caps: Capabilities,
    /// Index of the buffer's device among its client's addressable devices.
    pub(crate) device: usize,
    /// Set for views of caller memory: tells when the plugin released that memory.
    pub(crate) released: Option<tpu_sync::pjrt::ViewReleased>,
}

/// Element types of device buffers (values are stable).
#[repr(u32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum tpu_sync_dtype {
    /// unsigned 8-bit
    TPU_SYNC_DTYPE_U8 = 1,
    /// bfloat16
    TPU_SYNC_DTYPE_BF16 = 2,
    /// float16
    TPU_SYNC_DTYPE_F16 = 3,
    /// float32
    TPU_SYNC_DTYPE_F32 = 4,
    /// float8 e4m3fn
    TPU_SYNC_DTYPE_F8E4M3FN = 5,
    /// signed 8-bit
    TPU_SYNC_DTYPE_S8 = 6,
    /// signed 32-bit
    TPU_SYNC_DTYPE_S32 = 7,
}

pub(crate) fn element_type(dtype: u32) -> FfiResult<ElementType> {
    Ok(match dtype {
        1 => ElementType::U8,
        2 => ElementType::BF16,
        3 => ElementType::F16,
        4 => ElementType::F32,
        5 => ElementType::F8E4M3FN,
        6 => ElementType::S8,
        7 => ElementType::S32,
        d => return Err(invalid(format!("unknown dtype {d}"))),
    })
}

/// Creates a device buffer on device `device_index` holding a copy of `len` bytes at `data`, of
/// shape `dims[0..ndims]` and element type `dtype` (a [`tpu_sync_dtype`] value). `len` must equal
/// the shape's dense byte size. `data` is only read during the call. `buffer_out` receives a new
/// handle owned by the caller.
///
/// # Safety
/// `data` must point to `len` readable bytes; `dims` to `ndims` values; `buffer_out` writable.
#[no_mangle]
pub unsafe extern "C" fn tpu_sync_buffer_from_host(
    client: *const tpu_sync_client,
    device_index: usize,
    data: *const c_void,
    len: usize,
    dims: *const i64,
    ndims: usize,
    dtype: u32,
    buffer_out: *mut *mut tpu_sync_buffer,
) -> tpu_sync_status {
    boundary("tpu_sync_buffer_from_host", || {
        let c: Arc<ClientObj> = handle::get(K::TPU_SYNC_HANDLE_CLIENT, client)?;
        if buffer_out.is_null() {
            return Err(null("buffer_out"));
        }
        if data.is_null() && len > 0 {
            return Err(null("data"));
        }
        if dims.is_null() && ndims > 0 {
            return Err(null("dims"));
        }
        if ndims > 16 {
            return Err(invalid(format!("{ndims} dimensions (at most 16)")));
        }
        let ty = element_type(dtype)?;
        let dims = if ndims == 0 {
            &[][..]
        } else {
            // SAFETY: caller contract: `dims` has `ndims` values (non-NULL checked above).
            unsafe { std::slice::from_raw_parts(dims, ndims) }
        };
        let bytes = if len == 0 {
            &[][..]
        } else {
            // SAFETY: caller contract: `data` has `len` readable bytes (non-NULL checked above).
            unsafe { std::slice::from_raw_parts(data as *const u8, len) }
        };
        let dev = c.client.device(device_index)?;
        let buffer = c.client.buffer_from_host(bytes, ty, dims, &dev)?;
        let h = handle::insert(
            K::TPU_SYNC_HANDLE_BUFFER,
            Arc::new(BufferObj {
                buffer,
                caps: c.caps.clone(),
                device: device_index,
                released: None,
            }),
        );
        // SAFETY: checked non-NULL.
        unsafe { out(buffer_out, h, "buffer_out") }
    })
}

/// Frees a buffer handle (destroys the device buffer once no copy uses it).
#[no_mangle]
pub extern "C" fn tpu_sync_buffer_free(buffer: *mut tpu_sync_buffer) -> tpu_sync_status {
    boundary("tpu_sync_buffer_free", || {
        handle::remove(K::TPU_SYNC_HANDLE_BUFFER, buffer)?;
        Ok(())
    })
}

/// On-device size of the buffer in bytes (`PJRT_Buffer_OnDeviceSizeInBytes`), written to
/// `size_out`. Raw copies address bytes `0..size`.
///
/// # Safety
/// `size_out` must be writable.
#[no_mangle]
pub unsafe extern "C" fn tpu_sync_buffer_size(
    buffer: *const tpu_sync_buffer,
    size_out: *mut u64,
) -> tpu_sync_status {
    boundary("tpu_sync_buffer_size", || {
        let b: Arc<BufferObj> = handle::get(K::TPU_SYNC_HANDLE_BUFFER, buffer)?;
        // SAFETY: forwarded caller contract.
        unsafe { out(size_out, b.buffer.on_device_size(), "size_out") }
    })
}

/// D2H: copies `len` raw bytes at byte `offset` of the buffer into `dst` (blocking).
///
/// Errors: `TPU_SYNC_INVALID_ARGUMENT` when `offset + len` exceeds the buffer's size.
///
/// # Safety
/// `dst` must point to `len` writable bytes.
#[no_mangle]
pub unsafe extern "C" fn tpu_sync_buffer_read(
    buffer: *const tpu_sync_buffer,
    offset: u64,
    dst: *mut c_void,
    len: usize,
) -> tpu_sync_status {
    boundary("tpu_sync_buffer_read", || {
        let b: Arc<BufferObj> = handle::get(K::TPU_SYNC_HANDLE_BUFFER, buffer)?;
        if dst.is_null() && len > 0 {
            return Err(null("dst"));
        }
        if len == 0 {
            return Ok(b.buffer.check_range(offset, 0)?);
        }
        // SAFETY: caller contract: `dst` has `len` writable bytes.
        let d = unsafe { std::slice::from_raw_parts_mut(dst as *mut u8, len) };
        Ok(b.buffer.copy_raw_to_host(offset, d)?)
    })
}

/// H2D in place: writes `len` bytes from `src` at byte `offset` of the existing buffer (blocking),
/// by the in-place path the client's capabilities name.
///
/// Errors: `TPU_SYNC_INVALID_ARGUMENT` out of range; `TPU_SYNC_UNSUPPORTED` when the plugin has no
/// in-place H2D path.
///
/// # Safety
/// `src` must point to `len` readable bytes.
#[no_mangle]
pub unsafe extern "C" fn tpu_sync_buffer_write(
    buffer: *const tpu_sync_buffer,
    offset: u64,
    src: *const c_void,
    len: usize,
) -> tpu_sync_status {
    boundary("tpu_sync_buffer_write", || {
        let b: Arc<BufferObj> = handle::get(K::TPU_SYNC_HANDLE_BUFFER, buffer)?;
        if src.is_null() && len > 0 {
            return Err(null("src"));
        }
        let op = tpu_sync::device::RawCopy {
            buffer: &b.buffer,
            offset,
            len: len as u64,
            host: src as *mut u8,
        };
        if len == 0 {
            return Ok(b.buffer.check_range(offset, 0)?);
        }
        // SAFETY: caller contract: `src` has `len` readable bytes, unmodified during the call.
        unsafe { tpu_sync::device::h2d_batch(&b.caps, &[op]) }?;
        Ok(())
    })
}

// ---------------------------------------------------------------------------------------------
// Plans

/// Opaque transfer plan handle. Free with [`tpu_sync_plan_free`]. Immutable, thread-safe.
pub struct tpu_sync_plan {
    _private: [u8; 0],
}

/// One span of a plan: `count` runs of `len` bytes, run `i` from byte
/// `src_offset + i * src_stride` of source rank `src_rank`'s buffer `src_buffer` (= layer) to
/// `dst_offset + i * dst_stride` of destination rank `dst_rank`'s buffer `dst_buffer`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct tpu_sync_span {
    /// Global source rank.
    pub src_rank: u32,
    /// Source buffer (layer).
    pub src_buffer: u32,
    /// Source byte offset.
    pub src_offset: u64,
    /// Global destination rank.
    pub dst_rank: u32,
    /// Destination buffer (layer).
    pub dst_buffer: u32,
    /// Destination byte offset.
    pub dst_offset: u64,
    /// Bytes per run.
    pub len: u64,
    /// Number of runs (>= 1).
    pub count: u32,
    /// Reserved, 0.
    pub reserved: u32,
    /// Source distance between runs (bytes).
    pub src_stride: u64,
    /// Destination distance between runs (bytes).
    pub dst_stride: u64,
}

/// Plans a request of `num_tokens` tokens from the source placement to the destination placement,
/// both given as NUL-terminated JSON (the serde form of `tpu_sync::plan::Placement`:
/// `{"layout": {"model": {...}, "spec": {...}, "num_blocks": N}, "dp_rank": R, "block_ids": [[...], ...]}`,
/// with an optional `"first_token": T` (a block-aligned token range `T..num_tokens`: a destination
/// that already holds the first `T` tokens lists only the blocks from `T / block_size` on and
/// receives only the rest),
/// or for a hybrid model the KV cache groups form
/// `{"layout": {"model": {"name": ..., "groups": [...]}, "spec": {...}, "groups": [{"num_blocks": N}, ...]},
/// "dp_rank": R, "block_ids": [[[ids of rank 0], ...] of group 0, ...]}` with the same optional
/// `"first_token": T` (aligned to every paged group's block size; each group lists its held blocks
/// from `T` on, a state group its one slot, which moves whole) and an optional `"next_token": N`
/// (the first token the destination computes after the transfer, default `num_tokens`: a
/// sliding-window group then needs and lists the window of token `N`), see docs/hybrid.md; every
/// function taking placement JSON accepts both). Two sides whose groups differ are `TPU_SYNC_MISMATCH`.
/// `plan_out` receives a new handle owned by the caller (the caller frees it with `tpu_sync_plan_free`).
///
/// Errors: `TPU_SYNC_INVALID_ARGUMENT` (bad JSON), `TPU_SYNC_LAYOUT`, `TPU_SYNC_BLOCK_RANGE`,
/// `TPU_SYNC_MISMATCH`.
///
/// # Safety
/// Both strings NUL-terminated; `plan_out` writable.
#[no_mangle]
pub unsafe extern "C" fn tpu_sync_plan_new(
    src_placement_json: *const c_char,
    dst_placement_json: *const c_char,
    num_tokens: u32,
    plan_out: *mut *mut tpu_sync_plan,
) -> tpu_sync_status {
    boundary("tpu_sync_plan_new", || {
        // SAFETY: forwarded caller contract.
        let s = unsafe { str_arg(src_placement_json, "src_placement_json") }?;
        // SAFETY: forwarded caller contract.
        let d = unsafe { str_arg(dst_placement_json, "dst_placement_json") }?;
        if plan_out.is_null() {
            return Err(null("plan_out"));
        }
        let src: Placement =
            serde_json::from_str(s).map_err(|e| invalid(format!("source placement JSON: {e}")))?;
        let dst: Placement = serde_json::from_str(d)
            .map_err(|e| invalid(format!("destination placement JSON: {e}")))?;
        let plan = Plan::build(&src, &dst, num_tokens)?;
        let h = handle::insert(K::TPU_SYNC_HANDLE_PLAN, Arc::new(plan));
        // SAFETY: checked non-NULL.
        unsafe { out(plan_out, h, "plan_out") }
    })
}

/// Writes the KV geometry of a published model into `buf` as NUL-terminated JSON, the form that
/// every layout and placement JSON accepts as its `"model"`: for a uniform preset
/// (`llama-3.1-8b`, `qwen3-32b`, `llama-3.1-70b`, `deepseek-v3`) the `tpu_sync::layout::ModelKv`
/// form `{"name", "num_layers", "num_kv_heads", "head_dim", "kv_planes", "dtype"}`; for a hybrid
/// preset (`qwen3-next-80b`, `qwen3.5-9b`, `gpt-oss-120b`, `gemma-3-27b`, `deepseek-v3.2`,
/// `deepseek-v3.2-tpu`) the
/// KV cache groups form `{"name", "groups": [...]}` of `tpu_sync::layout::HybridModel`
/// (docs/hybrid.md). The numbers and the configs they come from are documented on
/// `HybridModel::preset` and `ModelKv::preset`. `tpu_sync_model_presets` lists the names.
/// `buf`/`buf_len`/`len_out` as for `tpu_sync_client_info` (`TPU_SYNC_BUFFER_TOO_SMALL` with the
/// needed length, without the NUL, in `len_out`).
///
/// Errors: `TPU_SYNC_LAYOUT` for an unknown name (the message lists the known ones),
/// `TPU_SYNC_NULL_POINTER` for a NULL `name`, `TPU_SYNC_INVALID_ARGUMENT` for non-UTF-8.
///
/// Thread-safety: any thread; a pure computation.
///
/// # Safety
/// `name` NUL-terminated; `buf` NULL or writable for `buf_len` bytes; `len_out` NULL or
/// writable. The library keeps no pointer.
#[no_mangle]
pub unsafe extern "C" fn tpu_sync_model_preset(
    name: *const c_char,
    buf: *mut c_char,
    buf_len: usize,
    len_out: *mut usize,
) -> tpu_sync_status {
    boundary("tpu_sync_model_preset", || {
        // SAFETY: forwarded caller contract.
        let n = unsafe { str_arg(name, "name") }?;
        let json = if tpu_sync::layout::PRESETS.contains(&n) {
            serde_json::to_string(&tpu_sync::layout::ModelKv::preset(n)?)
        } else {
            serde_json::to_string(&tpu_sync::layout::HybridModel::preset(n)?)
        }
        .map_err(|e| invalid(format!("preset JSON: {e}")))?;
        // SAFETY: forwarded caller contract.
        unsafe { out_string(&json, buf, buf_len, len_out) }
    })
}

/// Writes the names `tpu_sync_model_preset` accepts into `buf` as a NUL-terminated JSON array of
/// strings, uniform presets first, then hybrid ones. `buf`/`buf_len`/`len_out` as for
/// `tpu_sync_model_preset`.
///
/// Thread-safety: any thread.
///
/// # Safety
/// `buf` NULL or writable for `buf_len` bytes; `len_out` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn tpu_sync_model_presets(
    buf: *mut c_char,
    buf_len: usize,
    len_out: *mut usize,
) -> tpu_sync_status {
    boundary("tpu_sync_model_presets", || {
        let names: Vec<&str> = tpu_sync::layout::PRESETS
            .iter()
            .chain(tpu_sync::layout::HYBRID_PRESETS)
            .copied()
            .collect();
        let json = serde_json::to_string(&names).map_err(|e| invalid(format!("{e}")))?;
        // SAFETY: forwarded caller contract.
        unsafe { out_string(&json, buf, buf_len, len_out) }
    })
}

/// Frees a plan handle.
#[no_mangle]
pub extern "C" fn tpu_sync_plan_free(plan: *mut tpu_sync_plan) -> tpu_sync_status {
    boundary("tpu_sync_plan_free", || {
        handle::remove(K::TPU_SYNC_HANDLE_PLAN, plan)?;
        Ok(())
    })
}

/// Total bytes the plan moves (`bytes_out`) and its number of spans (`spans_out`); either pointer
/// may be NULL.
///
/// # Safety
/// Non-NULL out-pointers must be writable.
#[no_mangle]
pub unsafe extern "C" fn tpu_sync_plan_summary(
    plan: *const tpu_sync_plan,
    bytes_out: *mut u64,
    spans_out: *mut usize,
) -> tpu_sync_status {
    boundary("tpu_sync_plan_summary", || {
        let p: Arc<Plan> = handle::get(K::TPU_SYNC_HANDLE_PLAN, plan)?;
        if !bytes_out.is_null() {
            // SAFETY: non-NULL, writable per contract.
            unsafe { *bytes_out = p.total_bytes() };
        }
        if !spans_out.is_null() {
            // SAFETY: non-NULL, writable per contract.
            unsafe { *spans_out = p.spans.len() };
        }
        Ok(())
    })
}

/// Copies spans `first..first+cap` of the plan into `spans` and writes how many were copied to
/// `len_out` (fewer than `cap` at the end of the plan).
///
/// # Safety
/// `spans` must have room for `cap` entries; `len_out` writable.
#[no_mangle]
pub unsafe extern "C" fn tpu_sync_plan_spans(
    plan: *const tpu_sync_plan,
    first: usize,
    spans: *mut tpu_sync_span,
    cap: usize,
    len_out: *mut usize,
) -> tpu_sync_status {
    boundary("tpu_sync_plan_spans", || {
        let p: Arc<Plan> = handle::get(K::TPU_SYNC_HANDLE_PLAN, plan)?;
        if spans.is_null() && cap > 0 {
            return Err(null("spans"));
        }
        let src = p.spans.get(first.min(p.spans.len())..).unwrap_or(&[]);
        let n = src.len().min(cap);
        for (i, s) in src[..n].iter().enumerate() {
            // SAFETY: i < cap entries (caller contract).
            unsafe {
                spans.add(i).write(tpu_sync_span {
                    src_rank: s.src_rank,
                    src_buffer: s.src_buffer,
                    src_offset: s.src_offset,
                    dst_rank: s.dst_rank,
                    dst_buffer: s.dst_buffer,
                    dst_offset: s.dst_offset,
                    len: s.len,
                    count: s.count,
                    reserved: 0,
                    src_stride: s.src_stride,
                    dst_stride: s.dst_stride,
                })
            };
        }
        // SAFETY: forwarded caller contract.
        unsafe { out(len_out, n, "len_out") }
    })
}
