//! The network data plane over the C ABI (`tpu_sync::net::Endpoint`): a listener that serves
//! registered requests, pulls and pushes with a reshard plan, completions, stats, shutdown.
//!
//! The endpoint runs on a process-wide tokio runtime owned by this library (started on first
//! use, two worker threads). Device copies of a transfer (D2H staging on the producer, H2D
//! writes on the consumer) run on the runtime's blocking pool.

use std::collections::{BTreeMap, HashMap};
use std::ffi::{c_char, c_void};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use serde::Deserialize;
use tpu_sync::arena::ArenaOptions;
use tpu_sync::net::{
    self, Endpoint, EndpointOptions, PeerMap, PullRequest, PushRequest, Security, SinkRegistration,
    SourceHandle, SourceOutcome, SourceRegistration, Transfer, TransferStats, TransportKind,
};
use tpu_sync::pjrt::{Capabilities, DeviceBuffer};
use tpu_sync::plan::{Placement, Plan};
use tpu_sync::staging::Staging;

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
    /// Every expected consumer is accounted for and at least one rejected the request (it will
    /// not pull it: the decode side refused or aborted it).
    TPU_SYNC_SOURCE_REJECTED = 7,
}

struct EndpointObj {
    ep: Arc<Endpoint>,
    sources: Mutex<Sources>,
    closed: std::sync::atomic::AtomicBool,
}

/// Most ended registrations whose outcome is remembered (oldest forgotten first).
const MAX_ENDED: usize = 1 << 16;

/// This endpoint's registrations: live ones by handle (the handle holds the staging), ended ones
/// by outcome only, so that the staging of a finished request is freed at the next sweep.
#[derive(Default)]
struct Sources {
    live: HashMap<u64, SourceHandle>,
    ended: HashMap<u64, SourceOutcome>,
    ended_order: std::collections::VecDeque<u64>,
}

impl Sources {
    /// Moves ended registrations from `live` to `ended` (dropping their staging references).
    fn sweep(&mut self) {
        let done: Vec<(u64, SourceOutcome)> = self
            .live
            .iter()
            .filter_map(|(id, h)| h.outcome().map(|o| (*id, o)))
            .collect();
        for (id, o) in done {
            self.live.remove(&id);
            self.end(id, o);
        }
    }

    fn end(&mut self, id: u64, o: SourceOutcome) {
        if self.ended.insert(id, o).is_none() {
            self.ended_order.push_back(id);
        }
        while self.ended_order.len() > MAX_ENDED {
            if let Some(old) = self.ended_order.pop_front() {
                self.ended.remove(&old);
            }
        }
    }
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
                let ep = self.ep.clone();
                // Cancel everything; never block a dropping thread on the network.
                rt.spawn(async move { ep.shutdown(None).await });
            }
        }
    }
}

struct TransferObj {
    transfer: Mutex<Option<Transfer>>,
    completion: Arc<Completion<tpu_sync_transfer_stats>>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct TlsJson {
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
    lease_ttl_s: Option<f64>,
    chunk_bytes: Option<u64>,
    streams_per_pair: Option<u32>,
    max_lanes_per_peer: Option<u32>,
    max_inbound_lanes: Option<u32>,
}

fn secs(v: f64, what: &str) -> FfiResult<Duration> {
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

fn options(j: EndpointJson) -> FfiResult<EndpointOptions> {
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
    o.security = match (j.tls, j.psk_hex, j.psk_file) {
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
    };
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
    Ok(o)
}

/// Creates a network endpoint from a NUL-terminated JSON configuration (borrowed for the call):
///
/// ```text
/// {"listen": "127.0.0.1:0",    // listen address (port 0: any free port); null: client only
///  "transport": "tcp",          // "tcp" (plain, trusted networks only) | "tls" | "quic"
///  "tls": {"cert": "a.pem", "key": "a.key", "ca": "ca.pem", "server_name": "..."},
///  "psk_hex": "00ff...",        // or "psk_file": path; tls and quic need tls or a psk
///  "name": "prefill-0",         // unique per live process (default tpu-sync-<pid>)
///  "timeout_s": 30,             // connect, handshake and I/O limits (or each *_timeout_s)
///  "heartbeat_interval_s": 1, "heartbeat_timeout_s": 5,
///  "lease_ttl_s": 120,          // how long an unreleased registration is kept without holders
///  "chunk_bytes": 1048576, "streams_per_pair": 2, "max_lanes_per_peer": 16,
///  "max_inbound_lanes": 4096}  // inbound sockets/streams served at once; more are closed
/// ```
///
/// Every key is optional. `endpoint_out` receives a new handle owned by the caller.
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
        let opts = options(j)?;
        let rt = runtime()?;
        let ep = rt.block_on(Endpoint::bind(opts))?;
        let h = handle::insert(
            K::TPU_SYNC_HANDLE_ENDPOINT,
            Arc::new(EndpointObj {
                ep: Arc::new(ep),
                sources: Mutex::new(Sources::default()),
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
        let a = e.ep.local_addr().map(|a| a.to_string()).unwrap_or_default();
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
        Ok(runtime()?.block_on(e.ep.add_peer(name, addr))?)
    })
}

/// The per-rank KV buffers of a call: `ranks[i]` (global rank) has `buffers[i * num_layers ..
/// (i + 1) * num_layers]` (one per layer, in layer order).
struct Kv {
    by_rank: BTreeMap<u32, Vec<DeviceBuffer>>,
    caps: Option<Capabilities>,
}

unsafe fn kv_arg(
    ranks: *const u32,
    num_ranks: usize,
    buffers: *const *const tpu_sync_buffer,
    num_layers: usize,
) -> FfiResult<Kv> {
    // SAFETY: caller contract.
    let ranks = unsafe { slice_arg(ranks, num_ranks, "ranks") }?;
    let n = num_ranks
        .checked_mul(num_layers)
        .ok_or_else(|| invalid("num_ranks * num_layers overflows"))?;
    // SAFETY: caller contract.
    let bufs = unsafe { slice_arg(buffers, n, "buffers") }?;
    let mut by_rank = BTreeMap::new();
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
    Ok(Kv { by_rank, caps })
}

unsafe fn placement_arg(p: *const c_char, name: &str) -> FfiResult<Placement> {
    // SAFETY: caller contract.
    let s = unsafe { str_arg(p, name) }?;
    serde_json::from_str(s).map_err(|e| invalid(format!("{name}: {e}")))
}

/// Stages (D2H, blocking) the request's blocks of `kv`'s ranks of `place`'s replica.
fn stage_source(place: &Placement, kv: &Kv) -> FfiResult<Arc<Staging>> {
    let mut ranges = BTreeMap::new();
    for &r in kv.by_rank.keys() {
        let local = place.local_rank(r).ok_or_else(|| {
            invalid(format!(
                "rank {r} is not in the placement's DP replica {}",
                place.dp_rank
            ))
        })?;
        ranges.insert(r, place.block_ranges(local));
    }
    let staging = Arc::new(Staging::new(ranges, &ArenaOptions::default())?);
    for (r, bufs) in &kv.by_rank {
        staging.fill_from_device(*r, bufs, 256)?;
    }
    Ok(staging)
}

/// Plans `src` -> `dst` for `num_tokens` tokens and allocates pinned staging for exactly the
/// spans the plan writes to `kv`'s ranks (each must be in `dst`'s DP replica). Fails with
/// `TPU_SYNC_UNSUPPORTED` before any allocation when the buffers have no in-place H2D path.
fn stage_destination(
    src: &Placement,
    dst: &Placement,
    num_tokens: u32,
    kv: &Kv,
) -> FfiResult<(Arc<Plan>, Arc<Staging>)> {
    let caps = kv.caps.as_ref().ok_or_else(|| invalid("no rank given"))?;
    caps.require_h2d()?;
    let plan = Arc::new(Plan::build(src, dst, num_tokens)?);
    let mut ranges = BTreeMap::new();
    for &r in kv.by_rank.keys() {
        if dst.local_rank(r).is_none() {
            return Err(invalid(format!(
                "rank {r} is not in the destination placement's DP replica {}",
                dst.dp_rank
            )));
        }
        ranges.insert(r, plan.dst_ranges(r));
    }
    let staging = Arc::new(Staging::new(ranges, &ArenaOptions::default())?);
    Ok((plan, staging))
}

/// Registers a request's blocks for pulling (producer side): copies (D2H, blocking) the
/// request's blocks of the given ranks' per-layer KV buffers into pinned staging and serves them
/// to pullers until `expected_releases` consumers released the request, the lease time passes
/// without a live consumer, or it is unregistered. The device blocks may be reused as soon as
/// this returns.
///
/// * `placement_json`: where the request's blocks are (NUL-terminated `Placement` JSON, as for
///   `tpu_sync_plan_new`); `num_tokens` its tokens; `request_id` in `1..2^53`.
/// * `ranks[0..num_ranks]`: the global ranks of the placement's replica hosted here;
///   `buffers[i * num_layers + l]`: rank `ranks[i]`'s KV buffer of layer `l` (borrowed).
/// * `expected_releases`: consumers that will pull it (>= 1).
///
/// Errors: `TPU_SYNC_INVALID_ARGUMENT` (id, duplicate registration, ranks), layout and block
/// errors of the placement, device copy errors.
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
        let e = get_ep(endpoint)?;
        e.check_open()?;
        net::check_request_id(request_id)?;
        // SAFETY: caller contract.
        let place = unsafe { placement_arg(placement_json, "placement_json") }?;
        // SAFETY: caller contract.
        let kv = unsafe { kv_arg(ranks, num_ranks, buffers, num_layers) }?;
        if kv.by_rank.is_empty() {
            return Err(invalid("no rank given"));
        }
        place.validate(num_tokens)?;
        let staging = stage_source(&place, &kv)?;
        let rt = runtime()?;
        let _g = rt.enter();
        let h = e.ep.register_source(SourceRegistration {
            request_id,
            num_tokens,
            placement: place,
            staging,
            layers_ready: None,
            expected_releases,
        })?;
        let mut m = e.sources.lock().unwrap_or_else(|p| p.into_inner());
        m.sweep();
        m.ended.remove(&request_id);
        m.live.insert(request_id, h);
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
        let existed = e.ep.unregister_source(request_id);
        let mut m = e.sources.lock().unwrap_or_else(|p| p.into_inner());
        m.sweep();
        if m.live.remove(&request_id).is_some() {
            m.end(request_id, SourceOutcome::Unregistered);
        }
        if !existed_out.is_null() {
            // SAFETY: non-NULL, writable per contract.
            unsafe { *existed_out = existed };
        }
        Ok(())
    })
}

/// Writes the state of request `request_id`'s registration (a `tpu_sync_source_state`) to
/// `state_out`: active, or how it ended (released by its consumers, expired, consumer lost,
/// unregistered, shut down). The outcomes of the last 65,536 ended registrations are remembered;
/// their staging memory is freed at the next call that looks at registrations (register,
/// unregister, this one).
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
        let mut m = e.sources.lock().unwrap_or_else(|p| p.into_inner());
        m.sweep();
        let s = if m.live.contains_key(&request_id) {
            TPU_SYNC_SOURCE_ACTIVE
        } else {
            match m.ended.get(&request_id) {
                None => TPU_SYNC_SOURCE_UNKNOWN,
                Some(SourceOutcome::Released) => TPU_SYNC_SOURCE_RELEASED,
                Some(SourceOutcome::Rejected(_)) => TPU_SYNC_SOURCE_REJECTED,
                Some(SourceOutcome::Expired) => TPU_SYNC_SOURCE_EXPIRED,
                Some(SourceOutcome::PeerLost(_)) => TPU_SYNC_SOURCE_PEER_LOST,
                Some(SourceOutcome::Unregistered) => TPU_SYNC_SOURCE_UNREGISTERED,
                Some(SourceOutcome::Shutdown) => TPU_SYNC_SOURCE_SHUTDOWN,
            }
        };
        // SAFETY: forwarded caller contract.
        unsafe { out(state_out, s as u32, "state_out") }
    })
}

fn transfer_stats(
    s: &TransferStats,
    device_bytes: u64,
    elapsed: Duration,
) -> tpu_sync_transfer_stats {
    tpu_sync_transfer_stats {
        bytes: s.bytes,
        spans: s.spans,
        pairs: s.pairs,
        stripes: s.stripes,
        device_bytes,
        elapsed_ns: elapsed.as_nanos().min(u64::MAX as u128) as u64,
    }
}

fn new_transfer(t: Transfer) -> (Arc<TransferObj>, Arc<Completion<tpu_sync_transfer_stats>>) {
    let completion = Completion::new();
    (
        Arc::new(TransferObj {
            transfer: Mutex::new(Some(t)),
            completion: completion.clone(),
        }),
        completion,
    )
}

/// H2D of every staged rank, on the blocking pool.
async fn drain(staging: Arc<Staging>, kv: Kv) -> tpu_sync::Result<u64> {
    tokio::task::spawn_blocking(move || {
        let caps = kv
            .caps
            .as_ref()
            .ok_or_else(|| tpu_sync::Error::InvalidArgument("no destination buffers".into()))?;
        let mut bytes = 0;
        for r in staging.ranks().collect::<Vec<_>>() {
            if let Some(bufs) = kv.by_rank.get(&r) {
                bytes += staging.drain_to_device(caps, r, bufs)?.bytes;
            }
        }
        Ok(bytes)
    })
    .await
    .map_err(|e| tpu_sync::Error::Cancelled(format!("device copy task ended: {e}")))?
}

unsafe fn peers_arg(p: *const c_char, name: &str) -> FfiResult<PeerMap> {
    // SAFETY: caller contract.
    Ok(PeerMap::parse(unsafe { str_arg(p, name) }?)?)
}

fn insert_transfer(obj: Arc<TransferObj>, out_ptr: *mut *mut tpu_sync_transfer) -> FfiResult {
    let h = handle::insert(K::TPU_SYNC_HANDLE_TRANSFER, obj);
    // SAFETY: checked non-NULL by the callers.
    unsafe { out(out_ptr, h, "transfer_out") }
}

/// Pulls a request (consumer side) and writes it into this side's KV buffers in place.
///
/// Plans the transfer from `src_placement_json` (the producer's placement) to
/// `dst_placement_json` (this side's) for `num_tokens` tokens, pulls from each producer rank
/// exactly the spans each of this side's ranks needs into pinned staging, verifies every chunk's
/// checksum, writes the bytes in place into `buffers` (H2D), and tells the producers to release
/// the request before reporting success (after a failure or cancel, the release is sent in the
/// background, best effort: the producers' leases expire otherwise). Returns at once with a transfer handle (owned by the
/// caller); validation errors (plan, ranks, peers) are returned here, network and device errors
/// through the transfer.
///
/// * `peers`: NUL-terminated `ADDR` (every producer rank there) or `RANK=ADDR,RANK=ADDR,...`
///   (addresses `host:port` or names given to `tpu_sync_endpoint_add_peer`).
/// * `ranks`, `buffers`, `num_layers`: this side's ranks pulled here and their per-layer KV
///   buffers, as for `tpu_sync_endpoint_register` (kept alive by the transfer). No computation
///   may use the request's destination blocks until the transfer completes.
///
/// Errors: `TPU_SYNC_INVALID_ARGUMENT`, `TPU_SYNC_LAYOUT`, `TPU_SYNC_BLOCK_RANGE`,
/// `TPU_SYNC_MISMATCH`, `TPU_SYNC_UNSUPPORTED` (no in-place H2D path).
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
        let (plan, staging) = stage_destination(&src, &dst, num_tokens, &kv)?;
        let src_addrs = sources
            .addresses((0..src.layout.spec.ranks_per_replica()).map(|l| src.global_rank(l)))?;
        let rt = runtime()?;
        let started = std::time::Instant::now();
        let t = {
            let _g = rt.enter();
            e.ep.pull(PullRequest {
                request_id,
                num_tokens,
                src,
                sources,
                dst,
                staging: staging.clone(),
                dst_ranks: Some(kv.by_rank.keys().copied().collect()),
                plan: Some(plan),
                wait_for_registration: None,
            })?
        };
        let (obj, completion) = new_transfer(t.clone());
        let ep = e.ep.clone();
        rt.spawn(async move {
            let r = match t.wait().await {
                Ok(s) => drain(staging, kv)
                    .await
                    .map(|dev| transfer_stats(&s, dev, started.elapsed())),
                Err(err) => Err(err),
            };
            let release = async move {
                for a in &src_addrs {
                    if let Err(err) = ep.release(a, request_id).await {
                        log::debug!("release of request {request_id} at {a}: {err}");
                    }
                }
            };
            if r.is_ok() {
                // The producers free the request now instead of at its lease expiry.
                release.await;
                completion.complete(r.map_err(Failure::from));
            } else {
                // A failed or cancelled pull completes at once; the release is best effort (a
                // dead or hung producer must not delay the failure).
                completion.complete(r.map_err(Failure::from));
                release.await;
            }
        });
        insert_transfer(obj, transfer_out)
    })
}

/// Pushes a request (producer side): copies (D2H, blocking) the request's blocks of `ranks`'
/// buffers into pinned staging, then sends each destination rank exactly its spans. Returns at
/// once with a transfer handle owned by the caller; the transfer completes when every
/// destination endpoint confirmed. The device blocks may be reused as soon as this returns.
/// `targets`: NUL-terminated `ADDR` or `RANK=ADDR,...` of the destination ranks' endpoints; the
/// placements, ranks and buffers as for `tpu_sync_endpoint_pull` (with this side as the source).
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
        net::check_request_id(request_id)?;
        // SAFETY: caller contract (strings and arrays).
        let (targets, src, dst, kv) = unsafe {
            (
                peers_arg(targets, "targets")?,
                placement_arg(src_placement_json, "src_placement_json")?,
                placement_arg(dst_placement_json, "dst_placement_json")?,
                kv_arg(ranks, num_ranks, buffers, num_layers)?,
            )
        };
        if kv.by_rank.is_empty() {
            return Err(invalid("no rank given"));
        }
        let plan = Arc::new(Plan::build(&src, &dst, num_tokens)?);
        let staging = stage_source(&src, &kv)?;
        let rt = runtime()?;
        let started = std::time::Instant::now();
        let t = {
            let _g = rt.enter();
            e.ep.push(PushRequest {
                request_id,
                num_tokens,
                src,
                staging,
                src_ranks: Some(kv.by_rank.keys().copied().collect()),
                dst,
                targets,
                layers_ready: None,
                plan: Some(plan),
            })?
        };
        let (obj, completion) = new_transfer(t.clone());
        rt.spawn(async move {
            let r = t
                .wait()
                .await
                .map(|s| transfer_stats(&s, 0, started.elapsed()));
            completion.complete(r.map_err(Failure::from));
        });
        insert_transfer(obj, transfer_out)
    })
}

/// Expects a push of a request (consumer side of a push): registers pinned staging for exactly
/// the spans the plan from `src_placement_json` (the senders' placement) to
/// `dst_placement_json` (this side's) writes to `ranks`, and returns a transfer handle (owned by
/// the caller) that completes once every sender finished, every chunk verified, and the bytes
/// were written in place into `buffers` (H2D). Arguments as for `tpu_sync_endpoint_pull`.
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
        let (plan, staging) = stage_destination(&src, &dst, num_tokens, &kv)?;
        let rt = runtime()?;
        let started = std::time::Instant::now();
        let t = {
            let _g = rt.enter();
            e.ep.expect_push(SinkRegistration {
                request_id,
                num_tokens,
                placement: dst,
                staging: staging.clone(),
                dst_ranks: Some(kv.by_rank.keys().copied().collect()),
                src: Some(src),
                plan: Some(plan),
            })?
        };
        let (obj, completion) = new_transfer(t.clone());
        rt.spawn(async move {
            let r = match t.wait().await {
                Ok(s) => drain(staging, kv)
                    .await
                    .map(|dev| transfer_stats(&s, dev, started.elapsed())),
                Err(err) => Err(err),
            };
            completion.complete(r.map_err(Failure::from));
        });
        insert_transfer(obj, transfer_out)
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
            let n = t
                .transfer
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .as_ref()
                .map(|t| t.layers_complete())
                .unwrap_or(0);
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

/// Cancels the transfer: it fails with `TPU_SYNC_CANCELLED` (unless already complete), its lanes
/// are closed and its peers told to stop. Returns at once.
#[no_mangle]
pub extern "C" fn tpu_sync_transfer_cancel(transfer: *const tpu_sync_transfer) -> tpu_sync_status {
    boundary("tpu_sync_transfer_cancel", || {
        let t = get_transfer(transfer)?;
        if let Some(x) = t
            .transfer
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
        {
            let _g = runtime()?.enter();
            x.cancel();
        }
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
            if let Some(x) = t
                .transfer
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .as_ref()
            {
                let _g = runtime()?.enter();
                x.cancel();
            }
            let _ = t.completion.wait(None);
        }
        handle::remove(K::TPU_SYNC_HANDLE_TRANSFER, transfer)?;
        Ok(())
    })
}

/// Writes the endpoint's counters as JSON into `buf` (`buf`/`buf_len`/`len_out` as for
/// `tpu_sync_client_info`): gauges `peers`, `sessions`, `lanes_open`, `source_registrations`,
/// `sink_registrations`, `leases`, `staged_bytes`, `transfers_in_flight`; totals
/// `lanes_opened`, `bytes_sent`, `bytes_received`, `transfers_completed`, `transfers_failed`,
/// `checksum_failures`, `peers_lost`, `handshake_failures`, `lanes_refused`; and `address`, `transport`, `name`.
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
        let s = e.ep.stats();
        let v = serde_json::json!({
            "peers": s.peers, "sessions": s.sessions, "lanes_open": s.lanes_open,
            "lanes_opened": s.lanes_opened, "source_registrations": s.source_registrations,
            "sink_registrations": s.sink_registrations, "leases": s.leases,
            "staged_bytes": s.staged_bytes, "transfers_in_flight": s.transfers_in_flight,
            "bytes_sent": s.bytes_sent, "bytes_received": s.bytes_received,
            "transfers_completed": s.transfers_completed, "transfers_failed": s.transfers_failed,
            "checksum_failures": s.checksum_failures, "peers_lost": s.peers_lost,
            "handshake_failures": s.handshake_failures,
            "lanes_refused": s.lanes_refused,
            "address": e.ep.local_addr().map(|a| a.to_string()),
            "transport": e.ep.transport_kind().to_string(),
            "name": e.ep.name(),
        });
        // SAFETY: forwarded caller contract.
        unsafe { out_string(&v.to_string(), buf, buf_len, len_out) }
    })
}

/// Shuts the endpoint down (blocking): stops accepting, waits up to `drain_ms` milliseconds for
/// in-flight transfers to finish (0 or negative: none; they are cancelled at once), then cancels
/// what is left, ends every registration and closes every connection. Later registrations and
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
        runtime()?.block_on(e.ep.shutdown(drain));
        Ok(())
    })
}
