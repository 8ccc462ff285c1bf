//! The network data plane over the C ABI: a thin translation of arguments, handles and errors
//! onto [`tpu_sync::transfer::Pipeline`] (one endpoint with its staging budget), which does all
//! checking, planning, staging, DMA mapping, device copies and releases.
//!
//! The endpoint runs on a process-wide tokio runtime owned by this library (started on first
//! use, two worker threads). Completions of transfers are delivered by the completion thread
//! ([`crate::completion`]); this module starts no tasks of its own.

use std::collections::BTreeMap;
use std::ffi::{c_char, c_void};
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use serde::Deserialize;
use tpu_sync::net::{self, EndpointOptions, PeerMap, Security, TransportKind};
use tpu_sync::pjrt::{Capabilities, DeviceBuffer};
use tpu_sync::plan::Placement;
use tpu_sync::transfer::{
    ExpectPush, KvBuffers, Offer, OfferState, Pipeline, PullInto, PushFrom, Report, TransferHandle,
    TransferOptions,
};

use crate::api::{out, out_string, str_arg, tpu_sync_buffer, BufferObj};
use crate::completion::{self, tpu_sync_callback, Completion};
use crate::device::slice_arg;
use crate::handle::{self, tpu_sync_handle_kind as K};
use crate::status::{boundary, invalid, null, tpu_sync_status, Failure, FfiResult};

fn runtime() -> FfiResult<&'static tokio::runtime::Runtime> {
    static RT: OnceLock<std::result::Result<tokio::runtime::Runtime, String>> = OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("tpu-sync-net")
            .enable_all()
            .build()
            .map_err(|e| e.to_string())
    })
    .as_ref()
    .map_err(|e| {
        Failure(
            tpu_sync_status::TPU_SYNC_IO,
            format!("cannot start the network runtime: {e}"),
        )
    })
}

/// Opaque handle of a network endpoint. Free with [`tpu_sync_endpoint_free`]. Thread-safe.
pub struct tpu_sync_endpoint {
    _private: [u8; 0],
}

/// Opaque handle of a network transfer (a pull, a push, or an expected push): an asynchronous
/// operation. Free with [`tpu_sync_transfer_free`]. Thread-safe.
pub struct tpu_sync_transfer {
    _private: [u8; 0],
}

/// What a completed transfer moved (this endpoint's part).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct tpu_sync_transfer_stats {
    /// Payload bytes moved over the network (received for pulls and expected pushes, sent for
    /// pushes).
    pub bytes: u64,
    /// Plan spans handled.
    pub spans: u64,
    /// `(source rank, destination rank)` pairs handled.
    pub pairs: u64,
    /// Stripes (lane exchanges) used.
    pub stripes: u64,
    /// Bytes written to device buffers (H2D) by the transfer (pulls and expected pushes).
    pub device_bytes: u64,
    /// Nanoseconds from submission to completion, device copies included.
    pub elapsed_ns: u64,
}

/// How a source registration ended (values are stable).
#[repr(u32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum tpu_sync_source_state {
    /// Registered and served.
    TPU_SYNC_SOURCE_ACTIVE = 0,
    /// Every expected consumer released it (the blocks were delivered).
    TPU_SYNC_SOURCE_RELEASED = 1,
    /// No live consumer held a lease for the lease time.
    TPU_SYNC_SOURCE_EXPIRED = 2,
    /// A consumer holding a lease died.
    TPU_SYNC_SOURCE_PEER_LOST = 3,
    /// Withdrawn with `tpu_sync_endpoint_unregister`.
    TPU_SYNC_SOURCE_UNREGISTERED = 4,
    /// The endpoint shut down.
    TPU_SYNC_SOURCE_SHUTDOWN = 5,
    /// The request id is not (or no longer) known to this endpoint.
    TPU_SYNC_SOURCE_UNKNOWN = 6,
    /// The consumers rejected it (`tpu_sync_endpoint_reject`: they will not pull it; the decode
    /// side refused or aborted the request), so its staging was freed at once.
    TPU_SYNC_SOURCE_REJECTED = 7,
}

struct EndpointObj {
    pipeline: Arc<Pipeline>,
    /// Default of `wait_for_registration` for pulls (`wait_for_registration_s`).
    wait_for_registration: Option<Duration>,
    closed: std::sync::atomic::AtomicBool,
}

impl EndpointObj {
    fn check_open(&self) -> FfiResult {
        if self.closed.load(std::sync::atomic::Ordering::Acquire) {
            return Err(invalid("the endpoint was shut down"));
        }
        Ok(())
    }
}

impl Drop for EndpointObj {
    fn drop(&mut self) {
        if !self.closed.load(std::sync::atomic::Ordering::Acquire) {
            if let Ok(rt) = runtime() {
                let p = self.pipeline.clone();
                // Cancel everything; never block a dropping thread on the network.
                rt.spawn(async move { p.shutdown(None).await });
            }
        }
    }
}

struct TransferObj {
    transfer: TransferHandle,
    completion: Arc<Completion<tpu_sync_transfer_stats>>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(crate) struct TlsJson {
    cert: String,
    key: String,
    ca: String,
    server_name: Option<String>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct EndpointJson {
    listen: Option<String>,
    transport: Option<String>,
    tls: Option<TlsJson>,
    psk_hex: Option<String>,
    psk_file: Option<String>,
    name: Option<String>,
    timeout_s: Option<f64>,
    connect_timeout_s: Option<f64>,
    handshake_timeout_s: Option<f64>,
    io_timeout_s: Option<f64>,
    heartbeat_interval_s: Option<f64>,
    heartbeat_timeout_s: Option<f64>,
    lane_idle_timeout_s: Option<f64>,
    lease_ttl_s: Option<f64>,
    count_releases_by_rank: Option<bool>,
    chunk_bytes: Option<u64>,
    streams_per_pair: Option<u32>,
    max_lanes_per_peer: Option<u32>,
    max_inbound_lanes: Option<u32>,
    quic_connections_per_peer: Option<u32>,
    hash_encrypted_frames: Option<bool>,
    staging_budget_bytes: Option<u64>,
    staging_wait_s: Option<f64>,
    dma_map: Option<bool>,
    wait_for_registration_s: Option<f64>,
    staging_pool_bytes: Option<u64>,
}

pub(crate) fn secs(v: f64, what: &str) -> FfiResult<Duration> {
    Duration::try_from_secs_f64(v)
        .ok()
        .filter(|d| !d.is_zero())
        .ok_or_else(|| {
            invalid(format!(
                "{what} must be a positive number of seconds, got {v}"
            ))
        })
}

fn hex_bytes(s: &str) -> FfiResult<Vec<u8>> {
    let s = s.trim();
    if s.len() % 2 != 0 || !s.bytes().all(|c| c.is_ascii_hexdigit()) {
        return Err(invalid("psk_hex must be an even number of hex digits"));
    }
    Ok((0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("checked hex"))
        .collect())
}

/// The credentials of a configuration's `tls` / `psk_hex` / `psk_file` (at most one; none:
/// [`Security::None`]). Shared by endpoints and the remote tier.
pub(crate) fn security_of(
    tls: Option<TlsJson>,
    psk_hex: Option<String>,
    psk_file: Option<String>,
) -> FfiResult<Security> {
    Ok(match (tls, psk_hex, psk_file) {
        (None, None, None) => Security::None,
        (Some(t), None, None) => Security::from_pem_files(
            &PathBuf::from(t.cert),
            &PathBuf::from(t.key),
            &PathBuf::from(t.ca),
            t.server_name.as_deref(),
        )?,
        (None, Some(h), None) => Security::from_psk(&hex_bytes(&h)?)?,
        (None, None, Some(f)) => Security::from_psk_file(&PathBuf::from(f))?,
        _ => return Err(invalid("give at most one of tls, psk_hex and psk_file")),
    })
}

/// The endpoint, pipeline and pull options of a configuration.
struct Config {
    endpoint: EndpointOptions,
    transfer: TransferOptions,
    wait_for_registration: Option<Duration>,
}

fn options(j: EndpointJson) -> FfiResult<Config> {
    let mut t = TransferOptions {
        staging_budget_bytes: j.staging_budget_bytes,
        ..TransferOptions::default()
    };
    if let Some(w) = j.staging_wait_s {
        t.staging_wait = Some(secs(w, "staging_wait_s")?);
    }
    if let Some(d) = j.dma_map {
        t.dma_map = d;
    }
    if let Some(n) = j.staging_pool_bytes {
        t.staging_pool_bytes = n;
    }
    let wait_for_registration = match j.wait_for_registration_s {
        Some(w) => Some(secs(w, "wait_for_registration_s")?),
        None => None,
    };
    let mut o = EndpointOptions::default();
    if let Some(n) = j.name {
        o.name = n;
    }
    o.transport = TransportKind::parse(j.transport.as_deref().unwrap_or("tcp"))?;
    o.listen = match j.listen.as_deref() {
        None | Some("") => None,
        Some(a) => Some(
            a.parse()
                .map_err(|_| invalid(format!("listen `{a}` is not an IP:port address")))?,
        ),
    };
    o.security = security_of(j.tls, j.psk_hex, j.psk_file)?;
    if let Some(t) = j.timeout_s {
        let d = secs(t, "timeout_s")?;
        o.connect_timeout = d;
        o.handshake_timeout = d;
        o.io_timeout = d;
    }
    if let Some(t) = j.connect_timeout_s {
        o.connect_timeout = secs(t, "connect_timeout_s")?;
    }
    if let Some(t) = j.handshake_timeout_s {
        o.handshake_timeout = secs(t, "handshake_timeout_s")?;
    }
    if let Some(t) = j.io_timeout_s {
        o.io_timeout = secs(t, "io_timeout_s")?;
    }
    if let Some(t) = j.heartbeat_interval_s {
        o.heartbeat_interval = secs(t, "heartbeat_interval_s")?;
    }
    if let Some(t) = j.heartbeat_timeout_s {
        o.heartbeat_timeout = secs(t, "heartbeat_timeout_s")?;
    }
    if let Some(t) = j.lane_idle_timeout_s {
        o.lane_idle_timeout = secs(t, "lane_idle_timeout_s")?;
    }
    if let Some(b) = j.count_releases_by_rank {
        o.count_releases_by_rank = b;
    }
    if let Some(t) = j.lease_ttl_s {
        o.lease_ttl = secs(t, "lease_ttl_s")?;
    }
    if let Some(n) = j.chunk_bytes {
        o.chunk_bytes = n;
    }
    if let Some(n) = j.streams_per_pair {
        o.streams_per_pair = n;
    }
    if let Some(n) = j.max_lanes_per_peer {
        o.max_lanes_per_peer = n;
    }
    if let Some(n) = j.max_inbound_lanes {
        o.max_inbound_lanes = n;
    }
    if let Some(n) = j.quic_connections_per_peer {
        o.quic_connections_per_peer = n;
    }
    if let Some(b) = j.hash_encrypted_frames {
        o.hash_encrypted_frames = b;
    }
    Ok(Config {
        endpoint: o,
        transfer: t,
        wait_for_registration,
    })
}

/// Creates a network endpoint from a NUL-terminated JSON configuration (borrowed for the call):
///
/// ```text
/// {"listen": "127.0.0.1:0",    // listen address (port 0: any free port); null: client only
///  "transport": "tcp",          // "tcp" (plain, trusted networks only) | "tls" | "quic" | "shm" (same host: shared memory, plain TCP to other hosts)
///  "tls": {"cert": "a.pem", "key": "a.key", "ca": "ca.pem", "server_name": "..."},
///  "psk_hex": "00ff...",        // or "psk_file": path; tls and quic need tls or a psk
///  "name": "prefill-0",         // shown to peers (default tpu-sync-<host>-<pid>-<random>)
///  "timeout_s": 30,             // connect, handshake and I/O limits (or each *_timeout_s)
///  "heartbeat_interval_s": 1, "heartbeat_timeout_s": 5,
///  "lane_idle_timeout_s": 120,  // a served data lane idle this long is closed (give peers
///                               // the same value: clients reuse a pooled lane for half of it)
///  "lease_ttl_s": 120,          // how long an unreleased registration is kept without holders
///  "count_releases_by_rank": false, // expected_releases counts consumer TP ranks (a release
///                               // counts the destination ranks it was served; a reject ends
///                               // the registration) instead of consumer endpoints
///  "chunk_bytes": 1048576, "streams_per_pair": 2, "max_lanes_per_peer": 16,
///  "max_inbound_lanes": 4096,  // inbound sockets/streams served at once; more are closed
///  "quic_connections_per_peer": 2, // QUIC only: connections opened to each peer (>= 1)
///  "hash_encrypted_frames": false, // TLS and QUIC: also xxh3 every data frame (default
///                               // false: their AEAD authenticates every byte already)
///  "staging_budget_bytes": 1073741824, // this endpoint's own budget of pinned staging bytes
///                               // (default: the process-wide budget, a quarter of the memory
///                               // the process may use, capped by RLIMIT_MEMLOCK; env
///                               // TPU_SYNC_STAGING_BUDGET_BYTES)
///  "staging_wait_s": 1,         // wait this long for budget (default: fail at once with
///                               // TPU_SYNC_STAGING_EXHAUSTED)
///  "dma_map": true,             // DMA-map staging with the buffers' client (default true)
///  "staging_pool_bytes": 268435456, // keep up to this many bytes of ended operations'
///                               // staging arenas for reuse (default 256 MiB; 0: off)
///  "wait_for_registration_s": 5} // pulls wait this long for the producer to register a
///                               // request it does not know yet (default: no wait)
/// ```
///
/// Every key is optional; an unknown key is an error. `endpoint_out` receives a new handle
/// owned by the caller.
///
/// Errors: `TPU_SYNC_INVALID_ARGUMENT` (bad JSON or options: TLS/QUIC without credentials,
/// credentials with plain TCP, zero sizes), `TPU_SYNC_IO` (address in use, unreadable files).
///
/// # Safety
/// `config_json` NUL-terminated; `endpoint_out` writable.
#[no_mangle]
pub unsafe extern "C" fn tpu_sync_endpoint_new(
    config_json: *const c_char,
    endpoint_out: *mut *mut tpu_sync_endpoint,
) -> tpu_sync_status {
    boundary("tpu_sync_endpoint_new", || {
        // SAFETY: caller contract.
        let text = unsafe { str_arg(config_json, "config_json") }?;
        if endpoint_out.is_null() {
            return Err(null("endpoint_out"));
        }
        let j: EndpointJson = serde_json::from_str(text)
            .map_err(|e| invalid(format!("endpoint configuration: {e}")))?;
        let c = options(j)?;
        let rt = runtime()?;
        let pipeline = rt.block_on(Pipeline::bind(c.endpoint, c.transfer))?;
        let h = handle::insert(
            K::TPU_SYNC_HANDLE_ENDPOINT,
            Arc::new(EndpointObj {
                pipeline: Arc::new(pipeline),
                wait_for_registration: c.wait_for_registration,
                closed: Default::default(),
            }),
        );
        // SAFETY: checked non-NULL.
        unsafe { out(endpoint_out, h, "endpoint_out") }
    })
}

fn get_ep(ep: *const tpu_sync_endpoint) -> FfiResult<Arc<EndpointObj>> {
    handle::get(K::TPU_SYNC_HANDLE_ENDPOINT, ep)
}

/// Frees an endpoint handle. An endpoint not shut down is shut down without draining: its
/// transfers are cancelled and its registrations end (peers see the connections close).
#[no_mangle]
pub extern "C" fn tpu_sync_endpoint_free(endpoint: *mut tpu_sync_endpoint) -> tpu_sync_status {
    boundary("tpu_sync_endpoint_free", || {
        handle::remove(K::TPU_SYNC_HANDLE_ENDPOINT, endpoint)?;
        Ok(())
    })
}

/// Writes the endpoint's listening address (`"IP:PORT"`, the real port when 0 was asked for), or
/// an empty string for a client-only endpoint, into `buf` (`buf`/`buf_len`/`len_out` as for
/// `tpu_sync_client_info`).
///
/// # Safety
/// `buf` must have `buf_len` writable bytes (or be NULL with `buf_len` 0); `len_out` NULL or
/// writable.
#[no_mangle]
pub unsafe extern "C" fn tpu_sync_endpoint_address(
    endpoint: *const tpu_sync_endpoint,
    buf: *mut c_char,
    buf_len: usize,
    len_out: *mut usize,
) -> tpu_sync_status {
    boundary("tpu_sync_endpoint_address", || {
        let e = get_ep(endpoint)?;
        let a = e
            .pipeline
            .endpoint()
            .local_addr()
            .map(|a| a.to_string())
            .unwrap_or_default();
        // SAFETY: forwarded caller contract.
        unsafe { out_string(&a, buf, buf_len, len_out) }
    })
}

/// Gives the peer `name` (NUL-terminated) the address `addr` (NUL-terminated `host:port`), so
/// that peer maps may name it; re-adding a name with a new address (a restarted peer) makes the
/// next transfer connect to the new address. Blocks while the old connection is closed.
///
/// # Safety
/// Both strings NUL-terminated.
#[no_mangle]
pub unsafe extern "C" fn tpu_sync_endpoint_add_peer(
    endpoint: *const tpu_sync_endpoint,
    name: *const c_char,
    addr: *const c_char,
) -> tpu_sync_status {
    boundary("tpu_sync_endpoint_add_peer", || {
        let e = get_ep(endpoint)?;
        // SAFETY: caller contract.
        let (name, addr) = unsafe { (str_arg(name, "name")?, str_arg(addr, "addr")?) };
        Ok(runtime()?.block_on(e.pipeline.endpoint().add_peer(name, addr))?)
    })
}

/// The per-rank KV buffers of a call: `ranks[i]` (global rank) has `buffers[i * num_layers ..
/// (i + 1) * num_layers]` (one per layer, in layer order).
pub(crate) unsafe fn kv_arg(
    ranks: *const u32,
    num_ranks: usize,
    buffers: *const *const tpu_sync_buffer,
    num_layers: usize,
) -> FfiResult<KvBuffers> {
    // SAFETY: caller contract.
    let ranks = unsafe { slice_arg(ranks, num_ranks, "ranks") }?;
    let n = num_ranks
        .checked_mul(num_layers)
        .ok_or_else(|| invalid("num_ranks * num_layers overflows"))?;
    // SAFETY: caller contract.
    let bufs = unsafe { slice_arg(buffers, n, "buffers") }?;
    let mut by_rank: BTreeMap<u32, Vec<DeviceBuffer>> = BTreeMap::new();
    let mut caps: Option<Capabilities> = None;
    for (i, &r) in ranks.iter().enumerate() {
        let mut layers = Vec::with_capacity(num_layers);
        for l in 0..num_layers {
            let b: Arc<BufferObj> =
                handle::get(K::TPU_SYNC_HANDLE_BUFFER, bufs[i * num_layers + l])?;
            match &caps {
                Some(c) if c.plugin != b.caps.plugin => {
                    return Err(invalid(format!(
                        "rank {r} layer {l}: buffer of plugin {} among buffers of plugin {}",
                        b.caps.plugin, c.plugin
                    )))
                }
                Some(_) => {}
                None => caps = Some(b.caps.clone()),
            }
            layers.push(b.buffer.clone());
        }
        if by_rank.insert(r, layers).is_some() {
            return Err(invalid(format!("rank {r} given twice")));
        }
    }
    let caps = caps.ok_or_else(|| invalid("no rank given"))?;
    Ok(KvBuffers::new(&caps, by_rank)?)
}

pub(crate) unsafe fn placement_arg(p: *const c_char, name: &str) -> FfiResult<Placement> {
    // SAFETY: caller contract.
    let s = unsafe { str_arg(p, name) }?;
    serde_json::from_str(s).map_err(|e| invalid(format!("{name}: {e}")))
}

unsafe fn peers_arg(p: *const c_char, name: &str) -> FfiResult<PeerMap> {
    // SAFETY: caller contract.
    Ok(PeerMap::parse(unsafe { str_arg(p, name) }?)?)
}

/// Registers a request's blocks for pulling (producer side): checks every buffer against the
/// placement's layout, copies (D2H, blocking) the request's blocks of the given ranks'
/// per-layer KV buffers into pinned staging (reserved from the endpoint's staging budget and
/// DMA-mapped with the buffers' client where the plugin supports it), and serves them to
/// pullers until `expected_releases` consumers released or rejected the request, the lease
/// time passes without a live consumer, or it is unregistered. The device blocks may be reused
/// as soon as this returns; the staging is freed when the registration ends.
///
/// * `placement_json`: where the request's blocks are (NUL-terminated `Placement` JSON, as for
///   `tpu_sync_plan_new`; unknown keys are an error); `num_tokens` its tokens; `request_id` in
///   `1..2^53`.
/// * `ranks[0..num_ranks]`: the global ranks of the placement's replica hosted here;
///   `buffers[i * num_layers + l]`: rank `ranks[i]`'s KV buffer of layer `l` (borrowed for the
///   call). Each must match the layout exactly: element type, dims (leading 1s ignored),
///   on-device size, dense row-major physical layout.
/// * `expected_releases`: consumers that will pull it (>= 1).
///
/// Errors (nothing staged or registered; other registrations untouched):
/// `TPU_SYNC_INVALID_ARGUMENT` (id, duplicate registration, ranks, JSON), `TPU_SYNC_MISMATCH`
/// (a buffer disagrees with the layout: the message names rank, layer, buffer and the expected
/// shape), `TPU_SYNC_STAGING_EXHAUSTED` (the staging budget is used up), layout and block errors
/// of the placement, device copy errors.
///
/// # Safety
/// `placement_json` NUL-terminated; arrays of the given sizes.
#[no_mangle]
pub unsafe extern "C" fn tpu_sync_endpoint_register(
    endpoint: *const tpu_sync_endpoint,
    request_id: u64,
    placement_json: *const c_char,
    num_tokens: u32,
    ranks: *const u32,
    num_ranks: usize,
    buffers: *const *const tpu_sync_buffer,
    num_layers: usize,
    expected_releases: u32,
) -> tpu_sync_status {
    boundary("tpu_sync_endpoint_register", || {
        // SAFETY: forwarded caller contract.
        unsafe {
            register(
                endpoint,
                request_id,
                placement_json,
                num_tokens,
                (ranks, num_ranks),
                (buffers, num_layers),
                expected_releases,
                None,
            )
        }
    })
}

/// The offer behind `tpu_sync_endpoint_register` (`layers_ready` None: every layer staged now)
/// and `tpu_sync_endpoint_register_layers`.
///
/// # Safety
/// As `tpu_sync_endpoint_register`.
#[allow(clippy::too_many_arguments)]
unsafe fn register(
    endpoint: *const tpu_sync_endpoint,
    request_id: u64,
    placement_json: *const c_char,
    num_tokens: u32,
    (ranks, num_ranks): (*const u32, usize),
    (buffers, num_layers): (*const *const tpu_sync_buffer, usize),
    expected_releases: u32,
    layers_ready: Option<u32>,
) -> FfiResult {
    let e = get_ep(endpoint)?;
    e.check_open()?;
    net::check_request_id(request_id)?;
    // SAFETY: caller contract.
    let placement = unsafe { placement_arg(placement_json, "placement_json") }?;
    // SAFETY: caller contract.
    let kv = unsafe { kv_arg(ranks, num_ranks, buffers, num_layers) }?;
    let offer = Offer {
        request_id,
        num_tokens,
        placement,
        kv,
        expected_releases,
    };
    match layers_ready {
        None => drop(e.pipeline.offer(offer)?),
        Some(n) => drop(e.pipeline.offer_layers(offer, n)?),
    }
    Ok(())
}

/// `tpu_sync_endpoint_register` of a request whose later layers the model has not computed yet
/// (layer-wise P/D): checks the buffers, reserves and maps the staging of every layer, but copies
/// (D2H) only layers `0..layers_ready` (clamped to `num_layers`) before registering. Consumers may
/// pull at once; they receive layer `l` only after `tpu_sync_endpoint_publish_layers` staged and
/// published it, so the transfer of layer `l` overlaps the computation of layer `l + 1`.
///
/// Ownership: the buffer handles are borrowed for the call, and the registration keeps its own
/// references to them until every layer is published (or it ends); the device blocks of layers
/// not yet published must not be reused (or written by anything but the model computing them)
/// before they are. Arguments and errors as for `tpu_sync_endpoint_register`.
///
/// # Safety
/// As `tpu_sync_endpoint_register`.
#[no_mangle]
pub unsafe extern "C" fn tpu_sync_endpoint_register_layers(
    endpoint: *const tpu_sync_endpoint,
    request_id: u64,
    placement_json: *const c_char,
    num_tokens: u32,
    ranks: *const u32,
    num_ranks: usize,
    buffers: *const *const tpu_sync_buffer,
    num_layers: usize,
    expected_releases: u32,
    layers_ready: u32,
) -> tpu_sync_status {
    boundary("tpu_sync_endpoint_register_layers", || {
        // SAFETY: forwarded caller contract.
        unsafe {
            register(
                endpoint,
                request_id,
                placement_json,
                num_tokens,
                (ranks, num_ranks),
                (buffers, num_layers),
                expected_releases,
                Some(layers_ready),
            )
        }
    })
}

/// Stages (D2H, blocking) and publishes layers up to `layers` (exclusive, clamped to the layer
/// count; monotone: a smaller value than already published does nothing) of a request
/// registered with `tpu_sync_endpoint_register_layers`; its pullers receive them next. The
/// device blocks of those layers may be reused once this returns. `published_out` (may be
/// NULL) receives the number of leading layers published afterwards (every layer for a request
/// registered whole).
///
/// Errors: `TPU_SYNC_UNKNOWN_REQUEST` (not registered here, or its registration ended), device
/// copy errors (the layers before the failing copy stay published; unregister the request so
/// that its pullers fail instead of waiting).
///
/// # Safety
/// `published_out` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn tpu_sync_endpoint_publish_layers(
    endpoint: *const tpu_sync_endpoint,
    request_id: u64,
    layers: u32,
    published_out: *mut u32,
) -> tpu_sync_status {
    boundary("tpu_sync_endpoint_publish_layers", || {
        let e = get_ep(endpoint)?;
        e.check_open()?;
        net::check_request_id(request_id)?;
        let n = e.pipeline.publish_layers(request_id, layers)?;
        if !published_out.is_null() {
            // SAFETY: non-NULL, writable per contract.
            unsafe { *published_out = n };
        }
        Ok(())
    })
}

/// Withdraws a request's registration (pulls in progress fail). `existed_out` (may be NULL)
/// says whether it was still registered.
///
/// # Safety
/// `existed_out` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn tpu_sync_endpoint_unregister(
    endpoint: *const tpu_sync_endpoint,
    request_id: u64,
    existed_out: *mut bool,
) -> tpu_sync_status {
    boundary("tpu_sync_endpoint_unregister", || {
        let e = get_ep(endpoint)?;
        let existed = e.pipeline.withdraw(request_id);
        if !existed_out.is_null() {
            // SAFETY: non-NULL, writable per contract.
            unsafe { *existed_out = existed };
        }
        Ok(())
    })
}

/// Refuses request `request_id` as its producer: this endpoint will not serve it (its
/// registration failed, or the producer gave the request up). A registration of it is
/// withdrawn as by `tpu_sync_endpoint_unregister`; then, for the endpoint's lease TTL or until
/// the id is registered again, consumers that pull or describe it are answered at once with
/// `TPU_SYNC_CANCELLED` carrying `reason`, instead of "unknown request", which they would ask
/// again until their pull's registration wait runs out. `reason`: NUL-terminated UTF-8 (at most
/// 1 KiB is kept: a longer one is cut at a character boundary and ends in "...") or NULL or
/// empty for none ("no reason given"); borrowed for the call. At most 4,096 refusals are kept
/// (past that the one expiring first is forgotten); counted in the stats' `refusals`.
/// `existed_out` (may be NULL) says whether a registration was withdrawn.
///
/// Errors: `TPU_SYNC_INVALID_ARGUMENT` (bad handle, request id, reason not UTF-8). Does not
/// block on the network; callable from any thread.
///
/// # Safety
/// `reason` NULL or NUL-terminated; `existed_out` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn tpu_sync_endpoint_refuse(
    endpoint: *const tpu_sync_endpoint,
    request_id: u64,
    reason: *const c_char,
    existed_out: *mut bool,
) -> tpu_sync_status {
    boundary("tpu_sync_endpoint_refuse", || {
        let e = get_ep(endpoint)?;
        let reason = if reason.is_null() {
            ""
        } else {
            // SAFETY: caller contract (non-NULL: NUL-terminated).
            unsafe { str_arg(reason, "reason") }?
        };
        let existed = e.pipeline.refuse(request_id, reason)?;
        if !existed_out.is_null() {
            // SAFETY: non-NULL, writable per contract.
            unsafe { *existed_out = existed };
        }
        Ok(())
    })
}

/// Writes the state of request `request_id`'s registration (a `tpu_sync_source_state`) to
/// `state_out`: active, or how it ended (released by its consumers after complete pulls,
/// rejected by them, expired, consumer lost, unregistered, shut down). The outcomes of the last
/// 65,536 ended registrations are remembered; their staging memory is freed as soon as they end.
///
/// # Safety
/// `state_out` writable.
#[no_mangle]
pub unsafe extern "C" fn tpu_sync_endpoint_source_state(
    endpoint: *const tpu_sync_endpoint,
    request_id: u64,
    state_out: *mut u32,
) -> tpu_sync_status {
    boundary("tpu_sync_endpoint_source_state", || {
        use tpu_sync_source_state::*;
        let e = get_ep(endpoint)?;
        let s = match e.pipeline.offer_state(request_id) {
            OfferState::Active => TPU_SYNC_SOURCE_ACTIVE,
            OfferState::Released => TPU_SYNC_SOURCE_RELEASED,
            OfferState::Rejected(_) => TPU_SYNC_SOURCE_REJECTED,
            OfferState::Expired => TPU_SYNC_SOURCE_EXPIRED,
            OfferState::PeerLost(_) => TPU_SYNC_SOURCE_PEER_LOST,
            OfferState::Unregistered => TPU_SYNC_SOURCE_UNREGISTERED,
            OfferState::Shutdown => TPU_SYNC_SOURCE_SHUTDOWN,
            OfferState::Unknown => TPU_SYNC_SOURCE_UNKNOWN,
        };
        // SAFETY: forwarded caller contract.
        unsafe { out(state_out, s as u32, "state_out") }
    })
}

/// Tells the producers that this consumer will not pull request `request_id` (the decode side
/// refused or aborted it before its pull): every endpoint in `peers` (NUL-terminated `ADDR` or
/// `RANK=ADDR,...`, as for `tpu_sync_endpoint_pull`; each distinct address is told once) ends
/// this consumer's part at once and, when no consumer remains, frees the request's staging and
/// reports it `TPU_SYNC_SOURCE_REJECTED` with `reason` (NUL-terminated UTF-8, at most 4 KiB are
/// kept; may be NULL for none) instead of keeping it for its lease. Cancel this consumer's
/// pulls of the request first. Blocks until every endpoint answered or failed.
///
/// Errors: `TPU_SYNC_INVALID_ARGUMENT` (id, empty peer map), connection errors, the producer's
/// errors with their kind (the first one; every endpoint is tried).
///
/// # Safety
/// `peers` NUL-terminated; `reason` NULL or NUL-terminated.
#[no_mangle]
pub unsafe extern "C" fn tpu_sync_endpoint_reject(
    endpoint: *const tpu_sync_endpoint,
    request_id: u64,
    peers: *const c_char,
    reason: *const c_char,
) -> tpu_sync_status {
    boundary("tpu_sync_endpoint_reject", || {
        let e = get_ep(endpoint)?;
        e.check_open()?;
        if completion::on_completion_thread() {
            return Err(invalid(
                "cannot reject inside a completion callback (it blocks on the network)",
            ));
        }
        net::check_request_id(request_id)?;
        // SAFETY: caller contract.
        let peers = unsafe { peers_arg(peers, "peers") }?;
        let reason = if reason.is_null() {
            ""
        } else {
            // SAFETY: caller contract (non-NULL: NUL-terminated).
            unsafe { str_arg(reason, "reason") }?
        };
        Ok(runtime()?.block_on(e.pipeline.reject(request_id, &peers, reason))?)
    })
}

/// Asks the producer endpoint at `addr` (NUL-terminated `host:port`, or a name given to
/// `tpu_sync_endpoint_add_peer`) how it registered request `request_id`, and writes
/// `{"placement": PLACEMENT, "num_tokens": N}` (NUL-terminated JSON; `PLACEMENT` as
/// `tpu_sync_endpoint_pull` takes it: the producer's layout and block ids) into `buf`. A
/// consumer that learns of a request before its producer allocated the request's blocks (a
/// router that sends a prompt to both at once) pulls with this placement. The producer counts
/// this endpoint as a live consumer of the request from then on (a lease, as a pull takes).
/// Blocks for one network round trip (at most the endpoint's I/O `timeout`).
///
/// Errors: `TPU_SYNC_UNKNOWN_REQUEST` (not registered there, yet or any more: ask again later
/// to wait for a registration), `TPU_SYNC_CANCELLED` (the producer refused it:
/// `tpu_sync_endpoint_refuse`; asking again will not help), `TPU_SYNC_INVALID_ARGUMENT` (id,
/// address, called inside a completion callback), connection errors, `TPU_SYNC_BUFFER_TOO_SMALL` (`len_out` receives the
/// length needed, without the NUL; calling again asks the producer again).
///
/// # Safety
/// `addr` NUL-terminated; `buf` must have `buf_len` writable bytes (or be NULL with `buf_len`
/// 0); `len_out` NULL or writable. The caller owns `buf`.
#[no_mangle]
pub unsafe extern "C" fn tpu_sync_endpoint_describe(
    endpoint: *const tpu_sync_endpoint,
    request_id: u64,
    addr: *const c_char,
    buf: *mut c_char,
    buf_len: usize,
    len_out: *mut usize,
) -> tpu_sync_status {
    boundary("tpu_sync_endpoint_describe", || {
        let e = get_ep(endpoint)?;
        e.check_open()?;
        if completion::on_completion_thread() {
            return Err(invalid(
                "cannot describe inside a completion callback (it blocks on the network)",
            ));
        }
        net::check_request_id(request_id)?;
        // SAFETY: caller contract.
        let addr = unsafe { str_arg(addr, "addr") }?;
        if addr.is_empty() {
            return Err(invalid("addr is empty"));
        }
        let ep = e.pipeline.endpoint().clone();
        let (placement, num_tokens) =
            runtime()?.block_on(async move { ep.describe(addr, request_id).await })?;
        let v = serde_json::json!({ "placement": placement, "num_tokens": num_tokens });
        // SAFETY: forwarded caller contract.
        unsafe { out_string(&v.to_string(), buf, buf_len, len_out) }
    })
}

fn transfer_stats(r: &Report) -> tpu_sync_transfer_stats {
    tpu_sync_transfer_stats {
        bytes: r.net_bytes,
        spans: r.spans,
        pairs: r.pairs,
        stripes: r.stripes,
        device_bytes: r.device_bytes,
        elapsed_ns: r.elapsed.as_nanos().min(u64::MAX as u128) as u64,
    }
}

/// Hands a pipeline transfer to the C caller: a handle whose completion the completion thread
/// sets from the transfer's result.
fn insert_transfer(t: TransferHandle, out_ptr: *mut *mut tpu_sync_transfer) -> FfiResult {
    let completion = Completion::new();
    let obj = Arc::new(TransferObj {
        transfer: t.clone(),
        completion: completion.clone(),
    });
    completion::drive(completion, async move {
        t.wait()
            .await
            .map(|r| transfer_stats(&r))
            .map_err(Failure::from)
    });
    let h = handle::insert(K::TPU_SYNC_HANDLE_TRANSFER, obj);
    // SAFETY: checked non-NULL by the callers.
    unsafe { out(out_ptr, h, "transfer_out") }
}

/// Pulls a request (consumer side) and writes it into this side's KV buffers in place.
///
/// Checks every buffer against `dst_placement_json`'s layout, plans the transfer from
/// `src_placement_json` (the producer's placement) to `dst_placement_json` (this side's) for
/// `num_tokens` tokens, stages exactly the bytes the plan writes (pinned, reserved from the
/// endpoint's staging budget, DMA-mapped with the buffers' client where the plugin supports
/// it), pulls from each producer rank exactly the spans each of this side's ranks needs,
/// verifies every chunk's checksum, writes the bytes in place into `buffers` (H2D), reports
/// success, and tells the producers it got the request (a delivering release, sent to every
/// producer at once after the transfer completed; `tpu_sync_endpoint_shutdown` waits for
/// releases still on their way, at least 2 s). After a failure or cancel, which is reported
/// at once, the release says the request was not delivered (the producers keep it for a retry
/// until their lease passes, or until `tpu_sync_endpoint_reject`); it names the failed pull, so
/// a producer ignores it once a retry from this endpoint began, and a retry made at once is
/// not undone by it. Returns at once with a transfer handle (owned by the caller); validation errors are returned here, network and
/// device errors through the transfer. A producer that does not know the request fails the
/// pull with `TPU_SYNC_UNKNOWN_REQUEST` unless the endpoint's `wait_for_registration_s` (or
/// `tpu_sync_endpoint_pull_wait`) lets it wait.
///
/// * `peers`: NUL-terminated `ADDR` (every producer rank there) or `RANK=ADDR,RANK=ADDR,...`
///   (addresses `host:port` or names given to `tpu_sync_endpoint_add_peer`).
/// * `ranks`, `buffers`, `num_layers`: this side's ranks pulled here and their per-layer KV
///   buffers, as for `tpu_sync_endpoint_register` (kept alive by the transfer). No computation
///   may use the request's destination blocks until the transfer completes.
///
/// Errors: `TPU_SYNC_INVALID_ARGUMENT`, `TPU_SYNC_LAYOUT`, `TPU_SYNC_BLOCK_RANGE`,
/// `TPU_SYNC_MISMATCH` (the layouts, or a buffer and its layout, disagree),
/// `TPU_SYNC_UNSUPPORTED` (no in-place H2D path), `TPU_SYNC_STAGING_EXHAUSTED`.
///
/// # Safety
/// Strings NUL-terminated; arrays of the given sizes; `transfer_out` writable.
#[no_mangle]
pub unsafe extern "C" fn tpu_sync_endpoint_pull(
    endpoint: *const tpu_sync_endpoint,
    request_id: u64,
    peers: *const c_char,
    src_placement_json: *const c_char,
    dst_placement_json: *const c_char,
    num_tokens: u32,
    ranks: *const u32,
    num_ranks: usize,
    buffers: *const *const tpu_sync_buffer,
    num_layers: usize,
    transfer_out: *mut *mut tpu_sync_transfer,
) -> tpu_sync_status {
    boundary("tpu_sync_endpoint_pull", || {
        // SAFETY: forwarded caller contract.
        unsafe {
            pull(
                endpoint,
                request_id,
                peers,
                src_placement_json,
                dst_placement_json,
                num_tokens,
                (ranks, num_ranks, buffers, num_layers),
                None,
                false,
                transfer_out,
            )
        }
    })
}

/// `tpu_sync_endpoint_pull` that waits up to `wait_for_registration_ms` milliseconds for the
/// producers to register a request they do not know yet (a decode request that reaches the
/// producer before the producer's registration step waits and succeeds instead of failing with
/// `TPU_SYNC_UNKNOWN_REQUEST`). 0: no wait; negative: the endpoint's `wait_for_registration_s`.
///
/// # Safety
/// As `tpu_sync_endpoint_pull`.
#[no_mangle]
pub unsafe extern "C" fn tpu_sync_endpoint_pull_wait(
    endpoint: *const tpu_sync_endpoint,
    request_id: u64,
    peers: *const c_char,
    src_placement_json: *const c_char,
    dst_placement_json: *const c_char,
    num_tokens: u32,
    ranks: *const u32,
    num_ranks: usize,
    buffers: *const *const tpu_sync_buffer,
    num_layers: usize,
    wait_for_registration_ms: i64,
    transfer_out: *mut *mut tpu_sync_transfer,
) -> tpu_sync_status {
    boundary("tpu_sync_endpoint_pull_wait", || {
        // SAFETY: forwarded caller contract.
        unsafe {
            pull(
                endpoint,
                request_id,
                peers,
                src_placement_json,
                dst_placement_json,
                num_tokens,
                (ranks, num_ranks, buffers, num_layers),
                registration_wait(wait_for_registration_ms),
                false,
                transfer_out,
            )
        }
    })
}

/// `tpu_sync_endpoint_pull_wait` (`wait_for_registration_ms`: 0 no wait, negative the
/// endpoint's `wait_for_registration_s`) that writes each layer into `buffers` (H2D) as soon as it
/// arrived and verified from every producer rank, in layer order, instead of every layer after
/// the last byte: `tpu_sync_transfer_layers` and `tpu_sync_transfer_wait_layers` tell which
/// leading layers hold their final bytes (the model may read layer `l` while later layers still
/// arrive; it must not read or write a layer before that). Completion, release and errors as for
/// `tpu_sync_endpoint_pull`. With a producer that registered the request layer by layer
/// (`tpu_sync_endpoint_register_layers`), layer `l` arrives once the producer published it.
///
/// # Safety
/// As `tpu_sync_endpoint_pull`.
#[no_mangle]
pub unsafe extern "C" fn tpu_sync_endpoint_pull_layers(
    endpoint: *const tpu_sync_endpoint,
    request_id: u64,
    peers: *const c_char,
    src_placement_json: *const c_char,
    dst_placement_json: *const c_char,
    num_tokens: u32,
    ranks: *const u32,
    num_ranks: usize,
    buffers: *const *const tpu_sync_buffer,
    num_layers: usize,
    wait_for_registration_ms: i64,
    transfer_out: *mut *mut tpu_sync_transfer,
) -> tpu_sync_status {
    boundary("tpu_sync_endpoint_pull_layers", || {
        // SAFETY: forwarded caller contract.
        unsafe {
            pull(
                endpoint,
                request_id,
                peers,
                src_placement_json,
                dst_placement_json,
                num_tokens,
                (ranks, num_ranks, buffers, num_layers),
                registration_wait(wait_for_registration_ms),
                true,
                transfer_out,
            )
        }
    })
}

type KvArgs = (*const u32, usize, *const *const tpu_sync_buffer, usize);

/// A C `wait_for_registration_ms` as [`pull`]'s `wait`: negative is the endpoint's default
/// (`None`), otherwise that many milliseconds (0: fail at once on an unknown request).
fn registration_wait(ms: i64) -> Option<Option<Duration>> {
    u64::try_from(ms)
        .ok()
        .map(|ms| Some(Duration::from_millis(ms)))
}

/// `wait`: `None` for the endpoint's default, `Some(None)` for no wait.
#[allow(clippy::too_many_arguments)]
unsafe fn pull(
    endpoint: *const tpu_sync_endpoint,
    request_id: u64,
    peers: *const c_char,
    src_placement_json: *const c_char,
    dst_placement_json: *const c_char,
    num_tokens: u32,
    (ranks, num_ranks, buffers, num_layers): KvArgs,
    wait: Option<Option<Duration>>,
    layerwise: bool,
    transfer_out: *mut *mut tpu_sync_transfer,
) -> FfiResult {
    let e = get_ep(endpoint)?;
    e.check_open()?;
    if transfer_out.is_null() {
        return Err(null("transfer_out"));
    }
    // SAFETY: caller contract (strings and arrays).
    let (sources, src, dst, kv) = unsafe {
        (
            peers_arg(peers, "peers")?,
            placement_arg(src_placement_json, "src_placement_json")?,
            placement_arg(dst_placement_json, "dst_placement_json")?,
            kv_arg(ranks, num_ranks, buffers, num_layers)?,
        )
    };
    let p = PullInto {
        request_id,
        num_tokens,
        src,
        sources,
        dst,
        kv,
        wait_for_registration: wait.unwrap_or(e.wait_for_registration),
    };
    let t = if layerwise {
        e.pipeline.pull_layerwise(p)?
    } else {
        e.pipeline.pull(p)?
    };
    insert_transfer(t, transfer_out)
}

/// Pushes a request (producer side): checks every buffer against `src_placement_json`'s layout,
/// copies (D2H, blocking) the request's blocks of `ranks`' buffers into pinned staging (budget,
/// DMA map as for `tpu_sync_endpoint_register`), then sends each destination rank exactly its
/// spans. Returns at once with a transfer handle owned by the caller; the transfer completes
/// when every destination endpoint confirmed. The device blocks may be reused as soon as this
/// returns. `targets`: NUL-terminated `ADDR` or `RANK=ADDR,...` of the destination ranks'
/// endpoints; the placements, ranks and buffers as for `tpu_sync_endpoint_pull` (with this side
/// as the source).
///
/// # Safety
/// As `tpu_sync_endpoint_pull`.
#[no_mangle]
pub unsafe extern "C" fn tpu_sync_endpoint_push(
    endpoint: *const tpu_sync_endpoint,
    request_id: u64,
    targets: *const c_char,
    src_placement_json: *const c_char,
    dst_placement_json: *const c_char,
    num_tokens: u32,
    ranks: *const u32,
    num_ranks: usize,
    buffers: *const *const tpu_sync_buffer,
    num_layers: usize,
    transfer_out: *mut *mut tpu_sync_transfer,
) -> tpu_sync_status {
    boundary("tpu_sync_endpoint_push", || {
        let e = get_ep(endpoint)?;
        e.check_open()?;
        if transfer_out.is_null() {
            return Err(null("transfer_out"));
        }
        // SAFETY: caller contract (strings and arrays).
        let (targets, src, dst, kv) = unsafe {
            (
                peers_arg(targets, "targets")?,
                placement_arg(src_placement_json, "src_placement_json")?,
                placement_arg(dst_placement_json, "dst_placement_json")?,
                kv_arg(ranks, num_ranks, buffers, num_layers)?,
            )
        };
        let t = e.pipeline.push(PushFrom {
            request_id,
            num_tokens,
            src,
            kv,
            dst,
            targets,
        })?;
        insert_transfer(t, transfer_out)
    })
}

/// Expects a push of a request (consumer side of a push): checks every buffer against
/// `dst_placement_json`'s layout, registers pinned staging (budget, DMA map) for exactly the
/// spans the plan from `src_placement_json` (the senders' placement) to `dst_placement_json`
/// (this side's) writes to `ranks`, and returns a transfer handle (owned by the caller) that
/// completes once every sender finished, every chunk verified, and the bytes were written in
/// place into `buffers` (H2D). Arguments as for `tpu_sync_endpoint_pull`.
///
/// # Safety
/// As `tpu_sync_endpoint_pull`.
#[no_mangle]
pub unsafe extern "C" fn tpu_sync_endpoint_expect_push(
    endpoint: *const tpu_sync_endpoint,
    request_id: u64,
    src_placement_json: *const c_char,
    dst_placement_json: *const c_char,
    num_tokens: u32,
    ranks: *const u32,
    num_ranks: usize,
    buffers: *const *const tpu_sync_buffer,
    num_layers: usize,
    transfer_out: *mut *mut tpu_sync_transfer,
) -> tpu_sync_status {
    boundary("tpu_sync_endpoint_expect_push", || {
        let e = get_ep(endpoint)?;
        e.check_open()?;
        if transfer_out.is_null() {
            return Err(null("transfer_out"));
        }
        // SAFETY: caller contract (strings and arrays).
        let (src, dst, kv) = unsafe {
            (
                placement_arg(src_placement_json, "src_placement_json")?,
                placement_arg(dst_placement_json, "dst_placement_json")?,
                kv_arg(ranks, num_ranks, buffers, num_layers)?,
            )
        };
        let t = e.pipeline.expect_push(ExpectPush {
            request_id,
            num_tokens,
            src,
            dst,
            kv,
        })?;
        insert_transfer(t, transfer_out)
    })
}

fn get_transfer(t: *const tpu_sync_transfer) -> FfiResult<Arc<TransferObj>> {
    handle::get(K::TPU_SYNC_HANDLE_TRANSFER, t)
}

/// Non-blocking check: writes whether the transfer is complete (bytes in place, or failed) to
/// `done_out`, and the leading layers received and verified so far to `layers_out` (may be
/// NULL; receiving transfers only).
///
/// # Safety
/// `done_out` writable; `layers_out` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn tpu_sync_transfer_poll(
    transfer: *const tpu_sync_transfer,
    done_out: *mut bool,
    layers_out: *mut u32,
) -> tpu_sync_status {
    boundary("tpu_sync_transfer_poll", || {
        let t = get_transfer(transfer)?;
        if done_out.is_null() {
            return Err(null("done_out"));
        }
        if !layers_out.is_null() {
            let n = t.transfer.layers_complete();
            // SAFETY: non-NULL, writable per contract.
            unsafe { *layers_out = n };
        }
        // SAFETY: checked non-NULL.
        unsafe { *done_out = t.completion.is_done() };
        Ok(())
    })
}

/// Waits up to `timeout_ms` milliseconds (0: do not block; negative: without limit). Returns
/// `TPU_SYNC_PENDING` while the transfer runs; once complete `TPU_SYNC_OK` with its stats in
/// `stats_out` (may be NULL), or its error: `TPU_SYNC_PEER_CLOSED`, `TPU_SYNC_TIMEOUT`,
/// `TPU_SYNC_CHECKSUM`, `TPU_SYNC_REMOTE`, `TPU_SYNC_UNKNOWN_REQUEST`, `TPU_SYNC_CANCELLED`, ...
/// A failed transfer never reports `TPU_SYNC_OK`. Same rules as `tpu_sync_copy_wait` on the
/// completion thread.
///
/// # Safety
/// `stats_out` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn tpu_sync_transfer_wait(
    transfer: *const tpu_sync_transfer,
    timeout_ms: i64,
    stats_out: *mut tpu_sync_transfer_stats,
) -> tpu_sync_status {
    boundary("tpu_sync_transfer_wait", || {
        let t = get_transfer(transfer)?;
        let s = t.completion.wait(completion::timeout_ms(timeout_ms))?;
        if !stats_out.is_null() {
            // SAFETY: non-NULL, writable per contract.
            unsafe { *stats_out = s };
        }
        Ok(())
    })
}

/// Non-blocking: writes the leading layers received and verified so far to `received_out` and
/// the leading layers written into the destination buffers (H2D) to `written_out` (either may
/// be NULL). Layer by layer for `tpu_sync_endpoint_pull_layers`; the other receiving transfers
/// write every layer at the end; pushes write none.
///
/// # Safety
/// `received_out`, `written_out` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn tpu_sync_transfer_layers(
    transfer: *const tpu_sync_transfer,
    received_out: *mut u32,
    written_out: *mut u32,
) -> tpu_sync_status {
    boundary("tpu_sync_transfer_layers", || {
        let t = get_transfer(transfer)?;
        if !received_out.is_null() {
            // SAFETY: non-NULL, writable per contract.
            unsafe { *received_out = t.transfer.layers_complete() };
        }
        if !written_out.is_null() {
            // SAFETY: non-NULL, writable per contract.
            unsafe { *written_out = t.transfer.layers_written() };
        }
        Ok(())
    })
}

/// Waits up to `timeout_ms` milliseconds (0: do not block; negative: without limit) until the
/// first `layers` layers (clamped to the layer count) are written into the destination buffers.
/// Returns `TPU_SYNC_OK` once they are (or the transfer completed), `TPU_SYNC_PENDING` when the
/// time passed first (the transfer continues), or the transfer's error when it failed first
/// (layers written before the failure hold their final bytes). Must not be called on the
/// completion thread (it blocks): `TPU_SYNC_INVALID_ARGUMENT` there.
#[no_mangle]
pub extern "C" fn tpu_sync_transfer_wait_layers(
    transfer: *const tpu_sync_transfer,
    layers: u32,
    timeout_ms: i64,
) -> tpu_sync_status {
    boundary("tpu_sync_transfer_wait_layers", || {
        let t = get_transfer(transfer)?;
        let want = layers.min(t.transfer.num_layers());
        if t.transfer.layers_written() >= want {
            return Ok(());
        }
        if timeout_ms == 0 {
            return match t.transfer.poll() {
                Some(Err(e)) => Err(e.into()),
                Some(Ok(_)) => Ok(()),
                None => Err(Failure(tpu_sync_status::TPU_SYNC_PENDING, String::new())),
            };
        }
        if completion::on_completion_thread() {
            return Err(invalid(
                "cannot wait for layers inside a completion callback",
            ));
        }
        let h = t.transfer.clone();
        let fut = async move { h.wait_layers_written(want).await };
        let rt = runtime()?;
        if timeout_ms < 0 {
            return Ok(rt.block_on(fut)?);
        }
        // The timer must be created inside the runtime.
        let d = Duration::from_millis(timeout_ms as u64);
        match rt.block_on(async move { tokio::time::timeout(d, fut).await }) {
            Ok(r) => Ok(r?),
            Err(_) => Err(Failure(
                tpu_sync_status::TPU_SYNC_PENDING,
                format!("layers 0..{want} not written within {timeout_ms} ms"),
            )),
        }
    })
}

/// Cancels the transfer: it fails with `TPU_SYNC_CANCELLED` (unless already complete), its lanes
/// are closed and its peers told to stop. Returns at once.
#[no_mangle]
pub extern "C" fn tpu_sync_transfer_cancel(transfer: *const tpu_sync_transfer) -> tpu_sync_status {
    boundary("tpu_sync_transfer_cancel", || {
        let t = get_transfer(transfer)?;
        let _g = runtime()?.enter();
        t.transfer.cancel();
        Ok(())
    })
}

/// Registers `callback(user_data, status)` to run once when the transfer completes; as
/// `tpu_sync_copy_set_callback`.
#[no_mangle]
pub extern "C" fn tpu_sync_transfer_set_callback(
    transfer: *const tpu_sync_transfer,
    callback: tpu_sync_callback,
    user_data: *mut c_void,
) -> tpu_sync_status {
    boundary("tpu_sync_transfer_set_callback", || {
        let t = get_transfer(transfer)?;
        let Some(f) = callback else {
            return Err(null("callback"));
        };
        t.completion.set_callback(f, user_data)
    })
}

/// Frees a transfer handle. An unfinished transfer is cancelled and this call **blocks** until it
/// has completed (so nothing is written to its buffers afterwards); inside a callback, freeing
/// an unfinished transfer returns `TPU_SYNC_INVALID_ARGUMENT` and frees nothing.
#[no_mangle]
pub extern "C" fn tpu_sync_transfer_free(transfer: *mut tpu_sync_transfer) -> tpu_sync_status {
    boundary("tpu_sync_transfer_free", || {
        let t = get_transfer(transfer)?;
        if !t.completion.is_done() {
            if completion::on_completion_thread() {
                return Err(invalid(
                    "cannot free an unfinished transfer inside a completion callback",
                ));
            }
            {
                let _g = runtime()?.enter();
                t.transfer.cancel();
            }
            let _ = t.completion.wait(None);
        }
        handle::remove(K::TPU_SYNC_HANDLE_TRANSFER, transfer)?;
        Ok(())
    })
}

/// Writes what a completed transfer did as JSON into `buf` (`buf`/`buf_len`/`len_out` as for
/// `tpu_sync_client_info`): `staged_bytes` (pinned staging, page-rounded), `device_bytes`,
/// `device_ops`, `device_s` (H2D for receiving transfers, D2H for pushes), `net_bytes`,
/// `spans`, `pairs`, `stripes`, `net_s`, `elapsed_s` and `dma_map` (`"mapped"`, `"skipped:
/// <the plugin's reason>"` or `"disabled"`). Returns `TPU_SYNC_PENDING` while the transfer
/// runs, and the transfer's error status if it failed.
///
/// # Safety
/// `buf` must have `buf_len` writable bytes (or be NULL with `buf_len` 0); `len_out` NULL or
/// writable.
#[no_mangle]
pub unsafe extern "C" fn tpu_sync_transfer_report(
    transfer: *const tpu_sync_transfer,
    buf: *mut c_char,
    buf_len: usize,
    len_out: *mut usize,
) -> tpu_sync_status {
    boundary("tpu_sync_transfer_report", || {
        let t = get_transfer(transfer)?;
        let r = match t.transfer.poll() {
            None => {
                return Err(Failure(
                    tpu_sync_status::TPU_SYNC_PENDING,
                    "the transfer is still running".into(),
                ))
            }
            Some(r) => r?,
        };
        let v = report_json(&r);
        // SAFETY: forwarded caller contract.
        unsafe { out_string(&v.to_string(), buf, buf_len, len_out) }
    })
}

fn report_json(r: &Report) -> serde_json::Value {
    use tpu_sync::transfer::DmaOutcome;
    serde_json::json!({
        "staged_bytes": r.staged_bytes, "device_bytes": r.device_bytes,
        "device_ops": r.device_ops, "device_s": r.device_time.as_secs_f64(),
        "net_bytes": r.net_bytes, "spans": r.spans, "pairs": r.pairs, "stripes": r.stripes,
        "net_s": r.net_time.as_secs_f64(), "elapsed_s": r.elapsed.as_secs_f64(),
        "dma_map": match &r.dma {
            DmaOutcome::Mapped => "mapped".to_string(),
            DmaOutcome::Skipped(w) => format!("skipped: {w}"),
            DmaOutcome::Disabled => "disabled".to_string(),
        },
    })
}

/// Writes the endpoint's counters as JSON into `buf` (`buf`/`buf_len`/`len_out` as for
/// `tpu_sync_client_info`): gauges `peers`, `sessions`, `lanes_open`, `source_registrations`,
/// `sink_registrations`, `leases`, `staged_bytes`, `transfers_in_flight`; totals
/// `lanes_opened`, `bytes_sent`, `bytes_received`, `bytes_received_unhashed` (of those, bytes
/// a TLS or QUIC lane's AEAD authenticated without an xxh3 check: `hash_encrypted_frames`),
/// `transfers_completed`, `transfers_failed`, `checksum_failures`, `peers_lost`, `handshake_failures`, `lanes_refused`; the pipeline's
/// `offers_live` (gauge), `offers`, `pulls`, `pushes`, `expected_pushes`, `refused` (operations
/// refused before any byte moved: checks, plan, budget), `refusals` (requests this producer
/// refused: `tpu_sync_endpoint_refuse`), `rejects_sent`, `dma_mapped`,
/// `dma_skipped` (staging arenas whose DMA map the plugin does not implement, e.g. the XLA CPU
/// plugin), `dma_last` (the last outcome, text or null); `staging_budget` {`limit_bytes`,
/// `used_bytes`, `peak_bytes`, `reservations`, `refused`, `waited`}; `staging_pool`
/// {`cap_bytes`, `idle_bytes`, `idle_arenas` (gauges), `hits`, `misses`, `returned`,
/// `released` (totals): the reuse of staging arenas; idle bytes are part of the budget's
/// `used_bytes`}; `plan_cache` {`capacity`, `entries`, `hits`, `misses`}; and `address`,
/// `transport`, `name`.
///
/// # Safety
/// `buf` must have `buf_len` writable bytes (or be NULL with `buf_len` 0); `len_out` NULL or
/// writable.
#[no_mangle]
pub unsafe extern "C" fn tpu_sync_endpoint_stats(
    endpoint: *const tpu_sync_endpoint,
    buf: *mut c_char,
    buf_len: usize,
    len_out: *mut usize,
) -> tpu_sync_status {
    boundary("tpu_sync_endpoint_stats", || {
        let e = get_ep(endpoint)?;
        let p = e.pipeline.stats();
        let s = &p.endpoint;
        let b = &p.budget;
        let ep = e.pipeline.endpoint();
        let v = serde_json::json!({
            "peers": s.peers, "sessions": s.sessions, "lanes_open": s.lanes_open,
            "lanes_opened": s.lanes_opened, "source_registrations": s.source_registrations,
            "sink_registrations": s.sink_registrations, "leases": s.leases,
            "staged_bytes": s.staged_bytes, "transfers_in_flight": s.transfers_in_flight,
            "bytes_sent": s.bytes_sent, "bytes_received": s.bytes_received,
            "bytes_received_unhashed": s.bytes_received_unhashed,
            "transfers_completed": s.transfers_completed, "transfers_failed": s.transfers_failed,
            "checksum_failures": s.checksum_failures, "peers_lost": s.peers_lost,
            "handshake_failures": s.handshake_failures,
            "lanes_refused": s.lanes_refused,
            "offers_live": p.offers_live, "offers": p.offers, "pulls": p.pulls,
            "pushes": p.pushes, "expected_pushes": p.expected_pushes, "refused": p.refused,
            "refusals": p.refusals, "rejects_sent": p.rejects_sent, "dma_mapped": p.dma_mapped,
            "dma_skipped": p.dma_skipped, "dma_last": p.dma_last,
            "staging_budget": {
                "limit_bytes": b.limit_bytes, "used_bytes": b.used_bytes,
                "peak_bytes": b.peak_bytes, "reservations": b.reservations,
                "refused": b.refused, "waited": b.waited,
            },
            "staging_pool": {
                "cap_bytes": p.pool.cap_bytes, "idle_bytes": p.pool.idle_bytes,
                "idle_arenas": p.pool.idle_arenas, "hits": p.pool.hits,
                "misses": p.pool.misses, "returned": p.pool.returned,
                "released": p.pool.released,
            },
            "plan_cache": {
                "capacity": p.plans.capacity, "entries": p.plans.entries,
                "hits": p.plans.hits, "misses": p.plans.misses,
            },
            "address": ep.local_addr().map(|a| a.to_string()),
            "transport": ep.transport_kind().to_string(),
            "name": ep.name(),
        });
        // SAFETY: forwarded caller contract.
        unsafe { out_string(&v.to_string(), buf, buf_len, len_out) }
    })
}

/// Shuts the endpoint down (blocking): stops accepting, waits up to `drain_ms` milliseconds for
/// in-flight transfers to finish (0 or negative: none; they are cancelled at once), waits for
/// the delivering releases of completed pulls still on their way (until `drain_ms` passed, and
/// at least 2 s while any is unanswered), then cancels what is left, ends every registration
/// and closes every connection. Later registrations and
/// transfers on it return `TPU_SYNC_INVALID_ARGUMENT`; free the handle afterwards. Calling it
/// twice is harmless.
#[no_mangle]
pub extern "C" fn tpu_sync_endpoint_shutdown(
    endpoint: *const tpu_sync_endpoint,
    drain_ms: i64,
) -> tpu_sync_status {
    boundary("tpu_sync_endpoint_shutdown", || {
        let e = get_ep(endpoint)?;
        if completion::on_completion_thread() {
            return Err(invalid(
                "cannot shut an endpoint down inside a completion callback",
            ));
        }
        e.closed.store(true, std::sync::atomic::Ordering::Release);
        let drain = (drain_ms > 0).then(|| Duration::from_millis(drain_ms as u64));
        runtime()?.block_on(e.pipeline.shutdown(drain));
        Ok(())
    })
}
