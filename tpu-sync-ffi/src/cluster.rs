//! The cluster prefix directory (`tpu_sync::cluster`, etcd) and the remote tier
//! (`tpu_sync::cluster::remote`, and its device path `tpu_sync::cluster::load_to_device`) over
//! the C ABI.

use std::ffi::{c_char, c_void};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use serde::Deserialize;
use tpu_sync::budget::StagingBudget;
use tpu_sync::cluster::remote::{self, RemoteOptions, RemoteServer};
use tpu_sync::cluster::{
    load_to_device, ClusterConfig, Directory, EtcdTls, HostRecord, LoadOptions, Publisher,
    RemoteLoad, RemoteRank,
};
use tpu_sync::store::{BlockKey, Namespace};

use crate::api::{out, out_string, str_arg};
use crate::device::slice_arg;
use crate::handle::{self, tpu_sync_handle_kind as K};
use crate::status::{boundary, invalid, null, tpu_sync_status, FfiResult};
use crate::store::{get_store, keys_arg, tpu_sync_key, tpu_sync_store};

/// Opaque handle of a connection to the cluster prefix directory (etcd). Free with
/// [`tpu_sync_directory_free`]. Thread-safe.
pub struct tpu_sync_directory {
    _private: [u8; 0],
}

/// Opaque handle of a store published into the directory. Free with
/// [`tpu_sync_publisher_free`] (revokes its etcd lease: its entries disappear at once).
/// Thread-safe.
pub struct tpu_sync_publisher {
    _private: [u8; 0],
}

/// Opaque handle of a store served to other instances over TCP (the remote tier). Free with
/// [`tpu_sync_remote_server_free`] (stops listening). Thread-safe.
pub struct tpu_sync_remote_server {
    _private: [u8; 0],
}

struct DirObj(Directory);
struct PubObj(Mutex<Option<Publisher>>);
struct ServerObj(RemoteServer);

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct DirJson {
    endpoints: Vec<String>,
    prefix: Option<String>,
    lease_ttl_ms: Option<u64>,
    batch_interval_ms: Option<u64>,
    max_txn_ops: Option<usize>,
    max_ops_per_sec: Option<u32>,
    publish_stride: Option<u32>,
    request_timeout_ms: Option<u64>,
    connect_timeout_ms: Option<u64>,
    user: Option<String>,
    password: Option<String>,
    tls_ca_file: Option<String>,
    tls_cert_file: Option<String>,
    tls_key_file: Option<String>,
    tls_domain: Option<String>,
}

fn read_file(p: &Option<String>, what: &str) -> FfiResult<Option<Vec<u8>>> {
    match p {
        None => Ok(None),
        Some(p) => std::fs::read(p)
            .map(Some)
            .map_err(|e| invalid(format!("{what} {p}: {e}"))),
    }
}

/// Connects to the directory from a NUL-terminated JSON configuration (borrowed for the call):
///
/// ```text
/// {"endpoints": ["http://10.0.0.5:2379"],  // etcd client URLs (or host:port); required
///  "prefix": "/tpu-sync/v1",              // key prefix of this fleet
///  "lease_ttl_ms": 10000, "batch_interval_ms": 50, "max_txn_ops": 128,
///  "max_ops_per_sec": 20000, "publish_stride": 1,
///  "request_timeout_ms": 5000, "connect_timeout_ms": 3000,
///  "user": "...", "password": "...",         // etcd authentication (both or neither)
///  "tls_ca_file": "ca.pem", "tls_cert_file": "c.pem", "tls_key_file": "c.key",
///  "tls_domain": "etcd.example"}              // TLS (https:// endpoints)
/// ```
///
/// `dir_out` receives a new handle owned by the caller. The connection is made lazily: an
/// unreachable etcd shows in the first lookup.
///
/// Errors: `TPU_SYNC_INVALID_ARGUMENT` (bad JSON or values, unreadable TLS files); with
/// authentication, the etcd errors (`TPU_SYNC_PEER_CLOSED`, `TPU_SYNC_TIMEOUT`,
/// `TPU_SYNC_REMOTE`).
///
/// # Safety
/// `config_json` NUL-terminated; `dir_out` writable.
#[no_mangle]
pub unsafe extern "C" fn tpu_sync_directory_new(
    config_json: *const c_char,
    dir_out: *mut *mut tpu_sync_directory,
) -> tpu_sync_status {
    boundary("tpu_sync_directory_new", || {
        // SAFETY: caller contract.
        let text = unsafe { str_arg(config_json, "config_json") }?;
        if dir_out.is_null() {
            return Err(null("dir_out"));
        }
        let j: DirJson = serde_json::from_str(text)
            .map_err(|e| invalid(format!("directory configuration: {e}")))?;
        let mut c = ClusterConfig::new(j.endpoints);
        if let Some(p) = j.prefix {
            c.prefix = p;
        }
        let ms = Duration::from_millis;
        if let Some(v) = j.lease_ttl_ms {
            c.lease_ttl = ms(v);
        }
        if let Some(v) = j.batch_interval_ms {
            c.batch_interval = ms(v);
        }
        if let Some(v) = j.max_txn_ops {
            c.max_txn_ops = v;
        }
        if let Some(v) = j.max_ops_per_sec {
            c.max_ops_per_sec = v;
        }
        if let Some(v) = j.publish_stride {
            c.publish_stride = v;
        }
        if let Some(v) = j.request_timeout_ms {
            c.request_timeout = ms(v);
        }
        if let Some(v) = j.connect_timeout_ms {
            c.connect_timeout = ms(v);
        }
        c.auth = match (j.user, j.password) {
            (Some(u), Some(p)) => Some((u, p)),
            (None, None) => None,
            _ => return Err(invalid("user and password must be given together")),
        };
        let ca = read_file(&j.tls_ca_file, "tls_ca_file")?;
        let cert = read_file(&j.tls_cert_file, "tls_cert_file")?;
        let key = read_file(&j.tls_key_file, "tls_key_file")?;
        if ca.is_some() || cert.is_some() || key.is_some() || j.tls_domain.is_some() {
            c.tls = Some(EtcdTls {
                ca_pem: ca,
                cert_pem: cert,
                key_pem: key,
                domain: j.tls_domain,
            });
        }
        let d = Directory::connect(c)?;
        let h = handle::insert(K::TPU_SYNC_HANDLE_DIRECTORY, Arc::new(DirObj(d)));
        // SAFETY: checked non-NULL.
        unsafe { out(dir_out, h, "dir_out") }
    })
}

/// Frees a directory handle (publishers made from it keep working until freed).
#[no_mangle]
pub extern "C" fn tpu_sync_directory_free(dir: *mut tpu_sync_directory) -> tpu_sync_status {
    boundary("tpu_sync_directory_free", || {
        handle::remove(K::TPU_SYNC_HANDLE_DIRECTORY, dir)?;
        Ok(())
    })
}

/// Looks up which hosts hold how much of a key chain of namespace `namespace` (NUL-terminated,
/// the store's namespace description) and writes the answer as JSON into `buf`
/// (`buf`/`buf_len`/`len_out` as for `tpu_sync_client_info`): `[{"id", "addr", "meta",
/// "blocks"}, ...]`, longest prefix first. A hint: a fetch may find less.
///
/// Errors: `TPU_SYNC_PEER_CLOSED` / `TPU_SYNC_TIMEOUT` (etcd unreachable), `TPU_SYNC_REMOTE`;
/// `TPU_SYNC_BUFFER_TOO_SMALL` with the needed length in `len_out`.
///
/// # Safety
/// `namespace` NUL-terminated; `keys` points to `num_keys` keys (or is NULL with 0); `buf` has
/// `buf_len` writable bytes; `len_out` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn tpu_sync_directory_lookup(
    dir: *const tpu_sync_directory,
    namespace: *const c_char,
    keys: *const tpu_sync_key,
    num_keys: usize,
    buf: *mut c_char,
    buf_len: usize,
    len_out: *mut usize,
) -> tpu_sync_status {
    boundary("tpu_sync_directory_lookup", || {
        let d: Arc<DirObj> = handle::get(K::TPU_SYNC_HANDLE_DIRECTORY, dir)?;
        // SAFETY: caller contract.
        let ns = Namespace::new(unsafe { str_arg(namespace, "namespace") }?);
        // SAFETY: caller contract.
        let keys = unsafe { keys_arg(keys, num_keys) }?;
        let c = d.0.lookup(&ns, &keys)?;
        let v: Vec<serde_json::Value> = c
            .into_iter()
            .map(|c| {
                serde_json::json!({"id": c.host.id, "addr": c.host.addr, "meta": c.host.meta,
                                   "blocks": c.blocks})
            })
            .collect();
        let s = serde_json::Value::Array(v).to_string();
        // SAFETY: forwarded caller contract.
        unsafe { out_string(&s, buf, buf_len, len_out) }
    })
}

/// Starts publishing `store`'s blocks into the directory as host `host_id` (1 to 64 of
/// `[A-Za-z0-9._-]`), fetchable at `addr` (e.g. its remote server's `host:port`), with free-form
/// `meta` (NULL: none). All strings NUL-terminated, borrowed for the call. `pub_out` receives a
/// new handle owned by the caller. etcd being unreachable is not an error: the publisher retries.
///
/// Errors: `TPU_SYNC_INVALID_ARGUMENT` (bad id, metadata over 4 KiB, store not ready).
///
/// # Safety
/// Strings NUL-terminated (`meta` may be NULL); `pub_out` writable.
#[no_mangle]
pub unsafe extern "C" fn tpu_sync_directory_publish(
    dir: *const tpu_sync_directory,
    store: *const tpu_sync_store,
    host_id: *const c_char,
    addr: *const c_char,
    meta: *const c_char,
    pub_out: *mut *mut tpu_sync_publisher,
) -> tpu_sync_status {
    boundary("tpu_sync_directory_publish", || {
        let d: Arc<DirObj> = handle::get(K::TPU_SYNC_HANDLE_DIRECTORY, dir)?;
        let s = get_store(store)?;
        // SAFETY: caller contract.
        let id = unsafe { str_arg(host_id, "host_id") }?;
        // SAFETY: caller contract.
        let addr = unsafe { str_arg(addr, "addr") }?;
        let meta = if meta.is_null() {
            String::new()
        } else {
            // SAFETY: caller contract.
            unsafe { str_arg(meta, "meta") }?.to_string()
        };
        if pub_out.is_null() {
            return Err(null("pub_out"));
        }
        let mut rec = HostRecord::new(id, addr);
        rec.meta = meta;
        let p = d.0.publish(&s.store, rec)?;
        let h = handle::insert(
            K::TPU_SYNC_HANDLE_PUBLISHER,
            Arc::new(PubObj(Mutex::new(Some(p)))),
        );
        // SAFETY: checked non-NULL.
        unsafe { out(pub_out, h, "pub_out") }
    })
}

/// Waits up to `timeout_ms` (negative: 1 hour) until every change made to the store before the
/// call is published under a live lease.
///
/// Errors: `TPU_SYNC_TIMEOUT`.
#[no_mangle]
pub extern "C" fn tpu_sync_publisher_sync(
    publisher: *const tpu_sync_publisher,
    timeout_ms: i64,
) -> tpu_sync_status {
    boundary("tpu_sync_publisher_sync", || {
        let p: Arc<PubObj> = handle::get(K::TPU_SYNC_HANDLE_PUBLISHER, publisher)?;
        let t = crate::completion::timeout_ms(timeout_ms).unwrap_or(Duration::from_secs(3600));
        let g = p.0.lock().unwrap_or_else(PoisonError::into_inner);
        match g.as_ref() {
            Some(p) => Ok(p.sync(t)?),
            None => Err(invalid("publisher already stopped")),
        }
    })
}

/// Writes the publisher's counters as JSON into `buf` (as for `tpu_sync_client_info`):
/// `{"published", "unpublished", "txns", "leases", "republishes", "errors", "mirrored",
/// "live_entries", "pending", "skipped_by_stride", "lease_id"}`.
///
/// # Safety
/// `buf` has `buf_len` writable bytes; `len_out` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn tpu_sync_publisher_stats(
    publisher: *const tpu_sync_publisher,
    buf: *mut c_char,
    buf_len: usize,
    len_out: *mut usize,
) -> tpu_sync_status {
    boundary("tpu_sync_publisher_stats", || {
        let p: Arc<PubObj> = handle::get(K::TPU_SYNC_HANDLE_PUBLISHER, publisher)?;
        let g = p.0.lock().unwrap_or_else(PoisonError::into_inner);
        let Some(p) = g.as_ref() else {
            return Err(invalid("publisher already stopped"));
        };
        let s = p.stats();
        let v = serde_json::json!({
            "published": s.published, "unpublished": s.unpublished, "txns": s.txns,
            "leases": s.leases, "republishes": s.republishes, "errors": s.errors,
            "mirrored": s.mirrored, "live_entries": s.live_entries, "pending": s.pending,
            "skipped_by_stride": s.skipped_by_stride, "lease_id": p.lease_id(),
        });
        // SAFETY: forwarded caller contract.
        unsafe { out_string(&v.to_string(), buf, buf_len, len_out) }
    })
}

/// Stops publishing and revokes the lease (the entries disappear at once); frees the handle.
#[no_mangle]
pub extern "C" fn tpu_sync_publisher_free(publisher: *mut tpu_sync_publisher) -> tpu_sync_status {
    boundary("tpu_sync_publisher_free", || {
        let p: Arc<PubObj> = handle::get(K::TPU_SYNC_HANDLE_PUBLISHER, publisher)?;
        handle::remove(K::TPU_SYNC_HANDLE_PUBLISHER, publisher)?;
        drop(p.0.lock().unwrap_or_else(PoisonError::into_inner).take());
        Ok(())
    })
}

/// Options of the remote tier as JSON (every key optional; see `tpu_sync_remote_serve_with`).
#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RemoteJson {
    tls: Option<crate::endpoint::TlsJson>,
    psk_hex: Option<String>,
    psk_file: Option<String>,
    insecure: Option<bool>,
    timeout_s: Option<f64>,
    connect_timeout_s: Option<f64>,
    io_timeout_s: Option<f64>,
    workers: Option<usize>,
    max_queued: Option<usize>,
}

fn remote_options(j: Option<RemoteJson>) -> FfiResult<RemoteOptions> {
    let mut o = RemoteOptions::default();
    let Some(j) = j else {
        return Ok(o);
    };
    o.security = crate::endpoint::security_of(j.tls, j.psk_hex, j.psk_file)?;
    o.insecure = j.insecure.unwrap_or(false);
    if let Some(t) = j.timeout_s {
        o.io_timeout = crate::endpoint::secs(t, "timeout_s")?;
        o.connect_timeout = o.io_timeout;
    }
    if let Some(t) = j.connect_timeout_s {
        o.connect_timeout = crate::endpoint::secs(t, "connect_timeout_s")?;
    }
    if let Some(t) = j.io_timeout_s {
        o.io_timeout = crate::endpoint::secs(t, "io_timeout_s")?;
    }
    if let Some(n) = j.workers {
        if n == 0 || n > 1024 {
            return Err(invalid(format!("workers must be 1..=1024, got {n}")));
        }
        o.workers = n;
    }
    if let Some(n) = j.max_queued {
        if n > 65_536 {
            return Err(invalid(format!(
                "max_queued must be at most 65536, got {n}"
            )));
        }
        o.max_queued = n;
    }
    Ok(o)
}

/// Parses an optional options JSON argument (NULL or empty: defaults).
///
/// # Safety
/// `json` NULL or NUL-terminated.
unsafe fn remote_options_arg(json: *const c_char) -> FfiResult<RemoteOptions> {
    if json.is_null() {
        return remote_options(None);
    }
    // SAFETY: caller contract.
    let j = unsafe { str_arg(json, "options_json") }?;
    if j.trim().is_empty() {
        return remote_options(None);
    }
    let j: RemoteJson =
        serde_json::from_str(j).map_err(|e| invalid(format!("options_json: {e}")))?;
    remote_options(Some(j))
}

/// Serves `store`'s blocks to other instances on TCP address `listen` (NUL-terminated; port 0
/// picks a free one, see [`tpu_sync_remote_server_addr`]) with default options: plain TCP,
/// which is refused on a non-loopback address (`TPU_SYNC_INVALID_ARGUMENT`); use
/// [`tpu_sync_remote_serve_with`] for credentials. `server_out` receives a new handle owned by
/// the caller.
///
/// Errors: `TPU_SYNC_INVALID_ARGUMENT`, `TPU_SYNC_IO` when the address cannot be bound.
///
/// # Safety
/// `listen` NUL-terminated; `server_out` writable.
#[no_mangle]
pub unsafe extern "C" fn tpu_sync_remote_serve(
    store: *const tpu_sync_store,
    listen: *const c_char,
    server_out: *mut *mut tpu_sync_remote_server,
) -> tpu_sync_status {
    // SAFETY: forwarded caller contract (NULL options: defaults).
    unsafe { tpu_sync_remote_serve_with(store, listen, std::ptr::null(), server_out) }
}

/// Serves `store`'s blocks to other instances on TCP address `listen` (NUL-terminated, e.g.
/// `0.0.0.0:7800`; port 0 picks a free one) with `options_json` (NUL-terminated, borrowed for
/// the call; NULL or empty: defaults), every key optional:
///
/// ```text
/// {"psk_hex": "00ff...",                 // or "psk_file": path, or "tls": {"cert": "a.pem",
///                                        //   "key": "a.key", "ca": "ca.pem", "server_name": ".."}
///  "insecure": false,                    // true: plain TCP allowed on a non-loopback address
///  "timeout_s": 10, "connect_timeout_s": 3, "io_timeout_s": 10,
///  "workers": 8,                         // connections served at once (threads, fixed)
///  "max_queued": 64}                     // accepted connections waiting; more are closed
/// ```
///
/// With credentials every connection is TLS 1.3 with mutual authentication: only clients with
/// the same credentials are served. Without them, a non-loopback `listen` is refused unless
/// `insecure` is true. `server_out` receives a new handle owned by the caller.
///
/// Errors: `TPU_SYNC_INVALID_ARGUMENT` (JSON, credentials, a non-loopback address without
/// credentials), `TPU_SYNC_IO` when the address cannot be bound or a credentials file read.
///
/// # Safety
/// `listen` NUL-terminated; `options_json` NULL or NUL-terminated; `server_out` writable.
#[no_mangle]
pub unsafe extern "C" fn tpu_sync_remote_serve_with(
    store: *const tpu_sync_store,
    listen: *const c_char,
    options_json: *const c_char,
    server_out: *mut *mut tpu_sync_remote_server,
) -> tpu_sync_status {
    boundary("tpu_sync_remote_serve_with", || {
        let s = get_store(store)?;
        // SAFETY: caller contract.
        let l = unsafe { str_arg(listen, "listen") }?;
        if server_out.is_null() {
            return Err(null("server_out"));
        }
        // SAFETY: caller contract.
        let o = unsafe { remote_options_arg(options_json) }?;
        let srv = RemoteServer::serve(s.store.clone(), l, o)?;
        let h = handle::insert(K::TPU_SYNC_HANDLE_REMOTE_SERVER, Arc::new(ServerObj(srv)));
        // SAFETY: checked non-NULL.
        unsafe { out(server_out, h, "server_out") }
    })
}

/// Writes the server's listening address (`ip:port`) into `buf` (as for
/// `tpu_sync_client_info`).
///
/// # Safety
/// `buf` has `buf_len` writable bytes; `len_out` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn tpu_sync_remote_server_addr(
    server: *const tpu_sync_remote_server,
    buf: *mut c_char,
    buf_len: usize,
    len_out: *mut usize,
) -> tpu_sync_status {
    boundary("tpu_sync_remote_server_addr", || {
        let s: Arc<ServerObj> = handle::get(K::TPU_SYNC_HANDLE_REMOTE_SERVER, server)?;
        // SAFETY: forwarded caller contract.
        unsafe { out_string(&s.0.local_addr().to_string(), buf, buf_len, len_out) }
    })
}

/// Stops serving and frees the handle.
#[no_mangle]
pub extern "C" fn tpu_sync_remote_server_free(
    server: *mut tpu_sync_remote_server,
) -> tpu_sync_status {
    boundary("tpu_sync_remote_server_free", || {
        handle::remove(K::TPU_SYNC_HANDLE_REMOTE_SERVER, server)?;
        Ok(())
    })
}

/// Fetches the leading blocks of a key chain (namespace `namespace`, NUL-terminated) from the
/// remote server at `addr` (`host:port`, NUL-terminated) into caller memory: block `i` goes to
/// `dsts[i]`, which has `lens[i]` writable bytes, exactly the block's length. Writes the number of
/// leading blocks delivered (length and xxh3-64 checked on arrival) to `delivered_out`; blocks
/// the server no longer holds are a miss (a smaller count), not an error. Every read and write
/// has a deadline of `timeout_ms` (negative: 10 s).
///
/// Errors: `TPU_SYNC_INVALID_ARGUMENT`, `TPU_SYNC_MISMATCH` (the server's store holds another
/// namespace), `TPU_SYNC_PEER_CLOSED` / `TPU_SYNC_TIMEOUT` (server unreachable, dead or
/// stalled), `TPU_SYNC_PROTOCOL`, `TPU_SYNC_CHECKSUM`.
///
/// # Safety
/// Strings NUL-terminated; `keys`, `dsts`, `lens` point to `num_keys` elements each (or NULL with
/// 0); each `dsts[i]` has `lens[i]` writable bytes not accessed by anyone else during the call;
/// `delivered_out` writable.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn tpu_sync_remote_fetch(
    addr: *const c_char,
    namespace: *const c_char,
    keys: *const tpu_sync_key,
    dsts: *const *mut c_void,
    lens: *const u64,
    num_keys: usize,
    timeout_ms: i64,
    delivered_out: *mut usize,
) -> tpu_sync_status {
    let options = || {
        let mut o = RemoteOptions::default();
        if let Some(t) = crate::completion::timeout_ms(timeout_ms) {
            o.io_timeout = t.max(Duration::from_millis(1));
            o.connect_timeout = o.io_timeout;
        }
        Ok(o)
    };
    // SAFETY: forwarded caller contract.
    unsafe {
        remote_fetch(
            "tpu_sync_remote_fetch",
            addr,
            namespace,
            keys,
            dsts,
            lens,
            num_keys,
            options,
            delivered_out,
        )
    }
}

/// As [`tpu_sync_remote_fetch`] (plain TCP, no credentials), with the options of
/// [`tpu_sync_remote_serve_with`] (`options_json`, NUL-terminated, borrowed for the call; NULL or
/// empty: defaults): with credentials the server must prove the same ones in a TLS 1.3
/// handshake before a byte is read from it (a server without them is `TPU_SYNC_PROTOCOL`,
/// `TPU_SYNC_PEER_CLOSED` or `TPU_SYNC_TIMEOUT`, never a source of bytes). `workers`,
/// `max_queued` and `insecure` are the server's and ignored here.
///
/// Errors: as [`tpu_sync_remote_fetch`]; `TPU_SYNC_INVALID_ARGUMENT` for bad options.
///
/// # Safety
/// As [`tpu_sync_remote_fetch`]; `options_json` NULL or NUL-terminated.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn tpu_sync_remote_fetch_with(
    addr: *const c_char,
    namespace: *const c_char,
    keys: *const tpu_sync_key,
    dsts: *const *mut c_void,
    lens: *const u64,
    num_keys: usize,
    options_json: *const c_char,
    delivered_out: *mut usize,
) -> tpu_sync_status {
    // SAFETY: caller contract (`options_json` NULL or NUL-terminated).
    let options = || unsafe { remote_options_arg(options_json) };
    // SAFETY: forwarded caller contract.
    unsafe {
        remote_fetch(
            "tpu_sync_remote_fetch_with",
            addr,
            namespace,
            keys,
            dsts,
            lens,
            num_keys,
            options,
            delivered_out,
        )
    }
}

/// The body of [`tpu_sync_remote_fetch`] and [`tpu_sync_remote_fetch_with`].
///
/// # Safety
/// As theirs.
#[allow(clippy::too_many_arguments)]
unsafe fn remote_fetch(
    what: &'static str,
    addr: *const c_char,
    namespace: *const c_char,
    keys: *const tpu_sync_key,
    dsts: *const *mut c_void,
    lens: *const u64,
    num_keys: usize,
    options: impl FnOnce() -> FfiResult<RemoteOptions>,
    delivered_out: *mut usize,
) -> tpu_sync_status {
    boundary(what, || {
        // SAFETY: caller contract.
        let addr = unsafe { str_arg(addr, "addr") }?;
        // SAFETY: caller contract.
        let ns = Namespace::new(unsafe { str_arg(namespace, "namespace") }?);
        // SAFETY: caller contract.
        let keys = unsafe { keys_arg(keys, num_keys) }?;
        // SAFETY: caller contract.
        let ptrs = unsafe { slice_arg(dsts, num_keys, "dsts") }?;
        // SAFETY: caller contract.
        let lens = unsafe { slice_arg(lens, num_keys, "lens") }?;
        if delivered_out.is_null() {
            return Err(null("delivered_out"));
        }
        let mut dst: Vec<&mut [u8]> = Vec::with_capacity(num_keys);
        for (i, (&p, &l)) in ptrs.iter().zip(lens).enumerate() {
            if p.is_null() && l > 0 {
                return Err(null(&format!("dsts[{i}]")));
            }
            if l > remote::MAX_BLOCK {
                return Err(invalid(format!(
                    "lens[{i}] = {l} exceeds the largest block"
                )));
            }
            dst.push(if l == 0 {
                &mut []
            } else {
                // SAFETY: caller contract: `lens[i]` writable bytes, exclusively ours.
                unsafe { std::slice::from_raw_parts_mut(p as *mut u8, l as usize) }
            });
        }
        let o = options()?;
        let n = remote::fetch(addr, &ns, &keys, &mut dst, &o)?;
        // SAFETY: checked non-NULL.
        unsafe { out(delivered_out, n, "delivered_out") }
    })
}

/// What [`tpu_sync_remote_load`] did.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct tpu_sync_remote_load_stats {
    /// Tokens written into the destination blocks (0: a miss, nothing written).
    pub tokens: u32,
    /// Destination blocks per rank those tokens fill (the last one partial only when `tokens`
    /// is the whole request).
    pub dst_blocks: u32,
    /// Bytes of blocks fetched over the network.
    pub fetched_bytes: u64,
    /// Bytes written to device buffers (H2D).
    pub device_bytes: u64,
    /// Bytes reserved from the staging budget (fetched blocks and destination staging).
    pub staged_bytes: u64,
    /// Spans of the reshard plan.
    pub spans: u64,
    /// Nanoseconds of the whole call.
    pub elapsed_ns: u64,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct LoadSourceJson {
    addr: String,
    namespace: String,
    keys: Vec<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct LoadJson {
    src_layout: tpu_sync::layout::ParallelLayout,
    sources: Vec<LoadSourceJson>,
    staging_budget_bytes: Option<u64>,
    remote: Option<RemoteJson>,
}

/// Loads the present prefix of a prompt that other instances hold in their host tiers (served
/// by `tpu_sync_remote_serve`, one store per producer rank) into this side's device blocks,
/// resharded from the producer's layout to this side's (other TP split, block size, block
/// order), blocking until done (`tpu_sync::cluster::load_to_device`).
///
/// * `request_json` (NUL-terminated, borrowed): `{"src_layout": <the producer's layout JSON>,
///   "sources": [{"addr": "host:port", "namespace": "<store namespace description>", "keys":
///   ["<32 hex digits, BlockKey hex>", ...]}, ...], "staging_budget_bytes": N}` with one source
///   per rank of the producer's replica (index = its local rank `pcp * tp + tp_rank`), key `i` of a
///   source holding request block `i` of that rank (the producer's block size);
///   `staging_budget_bytes` (optional) bounds this call's pinned memory (default: the process
///   budget); `"remote": {...}` (optional): the fetches' credentials and timeouts, the options
///   of [`tpu_sync_remote_serve_with`] (with credentials, a source that cannot prove them is a
///   failed load, never a source of bytes); `timeout_ms` still sets the deadlines when given.
/// * `dst_placement_json`: this side's placement of `num_tokens` tokens (as for
///   `tpu_sync_endpoint_pull`); `ranks`, `buffers`, `num_layers`: this side's ranks and their
///   per-layer buffers (borrowed for the call), as for `tpu_sync_endpoint_pull`.
/// * `timeout_ms`: deadline of every network read and write (negative: 10 s).
/// * `stats_out`: what was loaded. Blocks a producer no longer holds (evicted since the
///   directory lookup, corrupt) shorten the prefix: fewer `tokens`, not an error.
///
/// Nothing is written to a device buffer unless every source's bytes arrived and verified: on
/// any error the destination blocks are untouched.
///
/// Errors: `TPU_SYNC_INVALID_ARGUMENT` (JSON, key, source count, a chain shorter than the
/// request), `TPU_SYNC_LAYOUT`, `TPU_SYNC_BLOCK_RANGE`, `TPU_SYNC_MISMATCH` (another model or a
/// buffer disagreeing with its layout, or a source's store of another namespace),
/// `TPU_SYNC_UNSUPPORTED` (consumer PCP > 1, no H2D path), `TPU_SYNC_STAGING_EXHAUSTED`,
/// `TPU_SYNC_PEER_CLOSED` / `TPU_SYNC_TIMEOUT` (a producer unreachable, dead or stalled),
/// `TPU_SYNC_PROTOCOL`, `TPU_SYNC_CHECKSUM`, device copy errors.
///
/// # Safety
/// Strings NUL-terminated; `ranks` has `num_ranks` elements and `buffers` `num_ranks *
/// num_layers` handles; `stats_out` writable.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn tpu_sync_remote_load(
    request_json: *const c_char,
    dst_placement_json: *const c_char,
    num_tokens: u32,
    ranks: *const u32,
    num_ranks: usize,
    buffers: *const *const crate::api::tpu_sync_buffer,
    num_layers: usize,
    timeout_ms: i64,
    stats_out: *mut tpu_sync_remote_load_stats,
) -> tpu_sync_status {
    boundary("tpu_sync_remote_load", || {
        let t0 = std::time::Instant::now();
        if stats_out.is_null() {
            return Err(null("stats_out"));
        }
        // SAFETY: caller contract.
        let j = unsafe { str_arg(request_json, "request_json") }?;
        let j: LoadJson =
            serde_json::from_str(j).map_err(|e| invalid(format!("request_json: {e}")))?;
        // SAFETY: caller contract.
        let dst =
            unsafe { crate::endpoint::placement_arg(dst_placement_json, "dst_placement_json") }?;
        // SAFETY: caller contract.
        let kv = unsafe { crate::endpoint::kv_arg(ranks, num_ranks, buffers, num_layers) }?;
        let mut sources = Vec::with_capacity(j.sources.len());
        for (r, s) in j.sources.into_iter().enumerate() {
            let chain = s
                .keys
                .iter()
                .map(|k| {
                    BlockKey::from_hex(k).ok_or_else(|| {
                        invalid(format!("sources[{r}]: key {k:?} is not 32 hex digits"))
                    })
                })
                .collect::<FfiResult<Vec<_>>>()?;
            sources.push(RemoteRank {
                addr: s.addr,
                namespace: Namespace::new(s.namespace),
                chain,
            });
        }
        let mut o = LoadOptions {
            remote: remote_options(j.remote)?,
            ..LoadOptions::default()
        };
        if let Some(t) = crate::completion::timeout_ms(timeout_ms) {
            o.remote.io_timeout = t.max(Duration::from_millis(1));
            o.remote.connect_timeout = o.remote.io_timeout;
        }
        let budget = match j.staging_budget_bytes {
            Some(b) => StagingBudget::new("remote load", b),
            None => StagingBudget::process().clone(),
        };
        let r = load_to_device(
            &RemoteLoad {
                src: j.src_layout,
                sources,
                dst,
                num_tokens,
                kv,
            },
            &budget,
            &o,
        )?;
        let s = tpu_sync_remote_load_stats {
            tokens: r.tokens,
            dst_blocks: r.dst_blocks,
            fetched_bytes: r.fetched_bytes,
            device_bytes: r.device_bytes,
            staged_bytes: r.staged_bytes,
            spans: r.spans as u64,
            elapsed_ns: t0.elapsed().as_nanos().min(u64::MAX as u128) as u64,
        };
        // SAFETY: checked non-NULL.
        unsafe { out(stats_out, s, "stats_out") }
    })
}
