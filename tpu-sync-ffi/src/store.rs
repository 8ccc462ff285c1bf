//! The host KV tier over the C ABI (`tpu_sync::store::KvStore`): prefix-keyed blocks in pinned
//! host DRAM, optionally kept in `/dev/shm` across restarts and backed by a disk tier.

use std::ffi::{c_char, c_void};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use serde::Deserialize;
use tpu_sync::arena::{ArenaOptions, LockStatus};
use tpu_sync::store::{
    self, Attach, BlockKey, DeviceBlock, DeviceRange, DiskOptions, DmaStatus, GetReport, KvStore,
    Lease, Namespace, PutReport, StopReason, StoreConfig, TierState, DEFAULT_SHM_DIR,
};

use crate::api::{
    out, out_string, str_arg, tpu_sync_buffer, tpu_sync_client, BufferObj, ClientObj,
};
use crate::device::slice_arg;
use crate::handle::{self, tpu_sync_handle_kind as K};
use crate::status::{boundary, invalid, null, tpu_sync_status, Failure, FfiResult};

/// Opaque handle of a host KV store. Free with [`tpu_sync_store_free`]. Thread-safe: every
/// function may be called concurrently on the same store.
pub struct tpu_sync_store {
    _private: [u8; 0],
}

/// Opaque handle of a lease: leading blocks of a chain pinned in the store (never evicted while
/// it lives). Free (unpin) with [`tpu_sync_lease_free`]. Thread-safe.
pub struct tpu_sync_lease {
    _private: [u8; 0],
}

/// A block key: 16 bytes (a 128-bit hash, little endian), built by
/// [`tpu_sync_store_chain_keys`] or [`tpu_sync_store_engine_key`]. Keys of one store's namespace
/// mean nothing to a store of another namespace.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct tpu_sync_key {
    /// The key bytes.
    pub bytes: [u8; 16],
}

impl From<tpu_sync_key> for BlockKey {
    fn from(k: tpu_sync_key) -> BlockKey {
        BlockKey::from_bytes(k.bytes)
    }
}

impl From<BlockKey> for tpu_sync_key {
    fn from(k: BlockKey) -> tpu_sync_key {
        tpu_sync_key {
            bytes: k.to_bytes(),
        }
    }
}

/// Readiness of a store (values are stable).
#[repr(u32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum tpu_sync_tier_state {
    /// Memory is being mapped, faulted, locked or re-attached (background preparation).
    TPU_SYNC_STORE_PREPARING = 0,
    /// Serving.
    TPU_SYNC_STORE_READY = 1,
    /// Preparation failed; `tpu_sync_store_wait_ready` returns the reason. The store stays empty.
    TPU_SYNC_STORE_FAILED = 2,
}

/// Why a get stopped before the end of the chain (values are stable).
#[repr(u32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum tpu_sync_get_stop {
    /// Every block was delivered.
    TPU_SYNC_GET_COMPLETE = 0,
    /// The store is not ready yet.
    TPU_SYNC_GET_NOT_READY = 1,
    /// The next block is not in the store (never stored, evicted or removed).
    TPU_SYNC_GET_MISSING = 2,
    /// The next block is on disk but no DRAM slot could be freed to load it through.
    TPU_SYNC_GET_NO_SPACE = 3,
    /// The next block kept changing under the copy.
    TPU_SYNC_GET_RACED = 4,
    /// The next block's disk file was missing, truncated or corrupt (dropped).
    TPU_SYNC_GET_BAD_FILE = 5,
}

/// Result of a put.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct tpu_sync_put_result {
    /// Blocks written by this call.
    pub stored: usize,
    /// Blocks already present (or being stored by a concurrent call); not written again.
    pub present: usize,
    /// First chain position that could not be stored for lack of room (every DRAM slot pinned,
    /// in use, or protecting a later block of its chain); blocks from there on were not stored.
    /// `SIZE_MAX` when every block was stored or present.
    pub full_at: usize,
    /// The store is not ready yet; nothing was stored.
    pub not_ready: bool,
    /// Bytes written.
    pub bytes: u64,
}

/// Result of a get: the leading `delivered` blocks of the chain are in their destinations,
/// byte-exact; destinations from `delivered` on hold unspecified bytes.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct tpu_sync_get_result {
    /// Leading blocks delivered.
    pub delivered: usize,
    /// Of those, read from DRAM directly.
    pub from_dram: usize,
    /// Of those, loaded from disk through DRAM.
    pub from_disk: usize,
    /// Bytes delivered.
    pub bytes: u64,
    /// Copies redone because a block changed under them.
    pub retries: u32,
    /// Why the get stopped early: a `tpu_sync_get_stop` value.
    pub stop: u32,
}

/// A byte range of a device buffer: one piece of a store block on a device.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct tpu_sync_device_range {
    /// The buffer (borrowed for the call).
    pub buffer: *const tpu_sync_buffer,
    /// Byte offset into the buffer's on-device bytes.
    pub offset: u64,
    /// Bytes.
    pub len: u64,
}

pub(crate) struct StoreObj {
    pub(crate) store: KvStore,
    pub(crate) ns: Namespace,
}

/// The JSON configuration of `tpu_sync_store_new`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ConfigJson {
    namespace: String,
    block_bytes: u64,
    capacity_bytes: u64,
    shm_name: Option<String>,
    shm_dir: Option<String>,
    disk_dir: Option<String>,
    disk_capacity_bytes: Option<u64>,
    disk_io_uring: Option<bool>,
    disk_direct: Option<bool>,
    verify_checksums: Option<bool>,
    background: Option<bool>,
    lock_memory: Option<bool>,
    huge_pages: Option<bool>,
    populate: Option<bool>,
    staging_budget_bytes: Option<u64>,
    kv_events: Option<crate::kv_events::KvEventsJson>,
}

/// Creates a host KV store from a NUL-terminated JSON configuration (borrowed for the call):
///
/// ```text
/// {"namespace": "llama-3.1-8b bf16 tp=1 rank=0 block=16 NHD",  // model/dtype/layout; required
///  "block_bytes": 1048576,        // largest block, bytes; required
///  "capacity_bytes": 1073741824,  // DRAM bytes of block slots; required
///  "shm_name": "kv0",             // keep the segment in /dev/shm under this name (warm restart)
///  "shm_dir": "/dev/shm",         // directory of named segments
///  "disk_dir": "/var/cache/kv", "disk_capacity_bytes": 1e10,  // disk tier (both or neither)
///  "disk_io_uring": true, "disk_direct": true,
///  "verify_checksums": true,      // check each block's xxh3 on get
///  "background": false,           // prepare memory on a thread; see tpu_sync_store_state
///  "lock_memory": true, "huge_pages": true, "populate": true,
///  "staging_budget_bytes": 2147483648,  // the tier's own budget of pinned bytes (default: the
///                                 // process-wide budget shared with every endpoint's staging)
///  "kv_events": {"endpoint": "tcp://127.0.0.1:5557", "replay_endpoint": null, ...}}
///                                 // vLLM-format KV events over ZMQ (off when absent); keys in
///                                 // tpu_sync_store_kv_events' documentation
/// ```
///
/// `dma_client`: NULL, or a client whose plugin maps the DRAM slots for DMA
/// (`PJRT_Client_DmaMap`; refused by the XLA CPU plugin, which is reported in the info, not an
/// error). Borrowed for the call (the store keeps the client alive). `store_out` receives a new
/// handle owned by the caller. One process at a time may use a named segment or disk directory.
///
/// Errors: `TPU_SYNC_INVALID_ARGUMENT` (bad JSON, unknown keys, sizes, names);
/// `TPU_SYNC_STAGING_EXHAUSTED` (the segment does not fit in the pinned-memory budget);
/// `TPU_SYNC_HOST_MEMORY`, `TPU_SYNC_IO` (segment or directory unusable or in use; in the
/// foreground mode only).
///
/// # Safety
/// `config_json` NUL-terminated; `store_out` writable.
#[no_mangle]
pub unsafe extern "C" fn tpu_sync_store_new(
    config_json: *const c_char,
    dma_client: *const tpu_sync_client,
    store_out: *mut *mut tpu_sync_store,
) -> tpu_sync_status {
    boundary("tpu_sync_store_new", || {
        // SAFETY: caller contract.
        let text = unsafe { str_arg(config_json, "config_json") }?;
        if store_out.is_null() {
            return Err(null("store_out"));
        }
        let j: ConfigJson =
            serde_json::from_str(text).map_err(|e| invalid(format!("store configuration: {e}")))?;
        let ns = Namespace::new(j.namespace);
        let mut cfg = StoreConfig::new(ns.clone(), j.block_bytes, j.capacity_bytes);
        cfg.shm_name = j.shm_name;
        if let Some(d) = j.shm_dir {
            cfg.shm_dir = PathBuf::from(d);
        }
        match (j.disk_dir, j.disk_capacity_bytes) {
            (Some(dir), Some(cap)) => {
                let mut d = DiskOptions::new(dir, cap);
                d.io_uring = j.disk_io_uring.unwrap_or(true);
                d.direct = j.disk_direct.unwrap_or(true);
                cfg.disk = Some(d);
            }
            (None, None) => {}
            _ => {
                return Err(invalid(
                    "disk_dir and disk_capacity_bytes must be given together",
                ))
            }
        }
        cfg.verify_checksums = j.verify_checksums.unwrap_or(true);
        cfg.background = j.background.unwrap_or(false);
        let d = ArenaOptions::default();
        cfg.memory = ArenaOptions {
            lock: j.lock_memory.unwrap_or(d.lock),
            huge_pages: j.huge_pages.unwrap_or(d.huge_pages),
            populate: j.populate.unwrap_or(d.populate),
        };
        cfg.kv_events = j.kv_events.map(crate::kv_events::KvEventsJson::into_config);
        if !dma_client.is_null() {
            let c: Arc<ClientObj> = handle::get(K::TPU_SYNC_HANDLE_CLIENT, dma_client)?;
            cfg.dma_client = Some(c.client.clone());
        }
        cfg.staging_budget = j.staging_budget_bytes.map(|n| {
            tpu_sync::budget::StagingBudget::new(format!("host KV tier {}", ns.description()), n)
        });
        let store = KvStore::open(cfg)?;
        let h = handle::insert(K::TPU_SYNC_HANDLE_STORE, Arc::new(StoreObj { store, ns }));
        // SAFETY: checked non-NULL.
        unsafe { out(store_out, h, "store_out") }
    })
}

/// Frees a store handle. The store closes when no call and no lease uses it any more (its named
/// segment stays in `/dev/shm` for a warm restart; anonymous memory is returned).
#[no_mangle]
pub extern "C" fn tpu_sync_store_free(store: *mut tpu_sync_store) -> tpu_sync_status {
    boundary("tpu_sync_store_free", || {
        handle::remove(K::TPU_SYNC_HANDLE_STORE, store)?;
        Ok(())
    })
}

pub(crate) fn get_store(store: *const tpu_sync_store) -> FfiResult<Arc<StoreObj>> {
    handle::get(K::TPU_SYNC_HANDLE_STORE, store)
}

/// Writes the store's readiness (a `tpu_sync_tier_state` value) to `state_out`.
///
/// # Safety
/// `state_out` writable.
#[no_mangle]
pub unsafe extern "C" fn tpu_sync_store_state(
    store: *const tpu_sync_store,
    state_out: *mut u32,
) -> tpu_sync_status {
    boundary("tpu_sync_store_state", || {
        let s = get_store(store)?;
        let v = match s.store.state() {
            TierState::Preparing => tpu_sync_tier_state::TPU_SYNC_STORE_PREPARING,
            TierState::Ready => tpu_sync_tier_state::TPU_SYNC_STORE_READY,
            TierState::Failed(_) => tpu_sync_tier_state::TPU_SYNC_STORE_FAILED,
        };
        // SAFETY: forwarded caller contract.
        unsafe { out(state_out, v as u32, "state_out") }
    })
}

/// Waits up to `timeout_ms` milliseconds (negative: without limit) for the store to be ready.
/// Errors: `TPU_SYNC_TIMEOUT` when still preparing; `TPU_SYNC_HOST_MEMORY` with the reason when
/// preparation failed.
#[no_mangle]
pub extern "C" fn tpu_sync_store_wait_ready(
    store: *const tpu_sync_store,
    timeout_ms: i64,
) -> tpu_sync_status {
    boundary("tpu_sync_store_wait_ready", || {
        let s = get_store(store)?;
        match crate::completion::timeout_ms(timeout_ms) {
            Some(t) => Ok(s.store.wait_ready(t)?),
            None => loop {
                match s.store.wait_ready(Duration::from_secs(3600)) {
                    Err(tpu_sync::Error::Timeout(_)) => continue,
                    r => return Ok(r?),
                }
            },
        }
    })
}

fn lock_str(l: &LockStatus) -> String {
    match l {
        LockStatus::Locked => "locked".into(),
        LockStatus::NotRequested => "not requested".into(),
        LockStatus::Failed(m) => format!("failed: {m}"),
    }
}

/// Writes how the store was set up as JSON into `buf` (`buf`/`buf_len`/`len_out` as for
/// `tpu_sync_client_info`), or `null` while it is not ready: `{"namespace", "attach"
/// ("anonymous" | "created" | "attached" | "reformatted: why"), "segment" (path or null),
/// "block_bytes", "slot_bytes", "num_slots", "total_bytes", "lock", "huge_pages", "dma",
/// "disk" ({"dir", "io", "direct", "capacity_blocks"} or null), "restored_dram_blocks",
/// "restored_disk_blocks", "prepare_secs"}`.
///
/// # Safety
/// `buf` must have `buf_len` writable bytes (or be NULL with `buf_len` 0); `len_out` NULL or
/// writable.
#[no_mangle]
pub unsafe extern "C" fn tpu_sync_store_info(
    store: *const tpu_sync_store,
    buf: *mut c_char,
    buf_len: usize,
    len_out: *mut usize,
) -> tpu_sync_status {
    boundary("tpu_sync_store_info", || {
        let s = get_store(store)?;
        let v = match s.store.info() {
            None => serde_json::Value::Null,
            Some(i) => serde_json::json!({
                "namespace": s.ns.description(),
                "attach": match &i.attach {
                    Attach::Anonymous => "anonymous".to_string(),
                    Attach::Created => "created".to_string(),
                    Attach::Attached => "attached".to_string(),
                    Attach::Reformatted(w) => format!("reformatted: {w}"),
                },
                "segment": i.segment.as_ref().map(|p| p.display().to_string()),
                "block_bytes": i.geometry.block_bytes,
                "slot_bytes": i.geometry.slot_bytes,
                "num_slots": i.geometry.num_slots,
                "total_bytes": i.geometry.total_bytes,
                "lock": lock_str(&i.lock),
                "huge_pages": i.huge_pages,
                "dma": match &i.dma {
                    DmaStatus::NotRequested => "not requested".to_string(),
                    DmaStatus::Mapped(n) => format!("mapped {n} bytes"),
                    DmaStatus::Unavailable(m) => format!("unavailable: {m}"),
                },
                "disk": i.disk.as_ref().map(|(dir, io, direct, cap)| serde_json::json!({
                    "dir": dir.display().to_string(), "io": io.to_string(),
                    "direct": direct, "capacity_blocks": cap,
                })),
                "restored_dram_blocks": i.restored_dram_blocks,
                "restored_disk_blocks": i.restored_disk_blocks,
                "prepare_secs": i.prepare_secs,
            }),
        };
        // SAFETY: forwarded caller contract.
        unsafe { out_string(&v.to_string(), buf, buf_len, len_out) }
    })
}

/// Writes the store's counters (since it was opened) and occupancy as JSON into `buf`
/// (`buf`/`buf_len`/`len_out` as for `tpu_sync_client_info`): `{"dram_blocks", "disk_blocks",
/// "free_slots", "lookups", "lookup_blocks", "lookup_hits", "put_blocks", "put_present",
/// "put_full", "get_dram", "get_disk", "evictions", "spills", "spill_failures", "races",
/// "corrupt_blocks", "bad_files", "bytes_put", "bytes_got"}` (all integers; zeros until ready).
///
/// # Safety
/// As `tpu_sync_store_info`.
#[no_mangle]
pub unsafe extern "C" fn tpu_sync_store_stats(
    store: *const tpu_sync_store,
    buf: *mut c_char,
    buf_len: usize,
    len_out: *mut usize,
) -> tpu_sync_status {
    boundary("tpu_sync_store_stats", || {
        let s = get_store(store)?;
        let t = s.store.stats();
        let v = serde_json::json!({
            "dram_blocks": t.dram_blocks, "disk_blocks": t.disk_blocks,
            "free_slots": t.free_slots, "lookups": t.lookups,
            "lookup_blocks": t.lookup_blocks, "lookup_hits": t.lookup_hits,
            "put_blocks": t.put_blocks, "put_present": t.put_present, "put_full": t.put_full,
            "get_dram": t.get_dram, "get_disk": t.get_disk, "evictions": t.evictions,
            "spills": t.spills, "spill_failures": t.spill_failures, "races": t.races,
            "corrupt_blocks": t.corrupt_blocks, "bad_files": t.bad_files,
            "bytes_put": t.bytes_put, "bytes_got": t.bytes_got,
        });
        // SAFETY: forwarded caller contract.
        unsafe { out_string(&v.to_string(), buf, buf_len, len_out) }
    })
}

/// Keys of the full blocks of a token sequence cut into blocks of `block_tokens` tokens, each
/// chained on the one before it (the first on `parent`, or on nothing when `parent` is NULL), in
/// the store's namespace. `tokens[0..num_tokens]` are token ids. Writes `num_tokens /
/// block_tokens` keys to `keys_out` and their number to `len_out`; when `cap` is smaller, returns
/// `TPU_SYNC_BUFFER_TOO_SMALL` with the needed count in `len_out` and writes no key.
///
/// Errors: `TPU_SYNC_INVALID_ARGUMENT` for `block_tokens` 0.
///
/// # Safety
/// `tokens` holds `num_tokens` values; `parent` NULL or readable; `keys_out` room for `cap`
/// keys; `len_out` writable.
#[no_mangle]
pub unsafe extern "C" fn tpu_sync_store_chain_keys(
    store: *const tpu_sync_store,
    tokens: *const u32,
    num_tokens: usize,
    block_tokens: usize,
    parent: *const tpu_sync_key,
    keys_out: *mut tpu_sync_key,
    cap: usize,
    len_out: *mut usize,
) -> tpu_sync_status {
    boundary("tpu_sync_store_chain_keys", || {
        let s = get_store(store)?;
        if len_out.is_null() {
            return Err(null("len_out"));
        }
        if block_tokens == 0 {
            return Err(invalid("block_tokens must be at least 1"));
        }
        // SAFETY: caller contract.
        let tokens = unsafe { slice_arg(tokens, num_tokens, "tokens") }?;
        let n = tokens.len() / block_tokens;
        // SAFETY: checked non-NULL.
        unsafe { *len_out = n };
        if cap < n {
            return Err(Failure(
                tpu_sync_status::TPU_SYNC_BUFFER_TOO_SMALL,
                format!("{n} keys do not fit in {cap}"),
            ));
        }
        if n > 0 && keys_out.is_null() {
            return Err(null("keys_out"));
        }
        let mut prev = if parent.is_null() {
            None
        } else {
            // SAFETY: non-NULL, readable per contract.
            Some(BlockKey::from(unsafe { *parent }))
        };
        for (i, b) in tokens.chunks_exact(block_tokens).enumerate() {
            let k = s.ns.chain_key(prev, b);
            // SAFETY: i < n <= cap entries.
            unsafe { keys_out.add(i).write(k.into()) };
            prev = Some(k);
        }
        Ok(())
    })
}

/// Key of an engine-provided block hash (`hash[0..hash_len]`, opaque bytes already chained by
/// the engine, e.g. vLLM's block hash bytes, or SGLang's page hash string without NUL) in the
/// store's namespace, written to `key_out`.
///
/// # Safety
/// `hash` holds `hash_len` bytes (may be NULL when 0); `key_out` writable.
#[no_mangle]
pub unsafe extern "C" fn tpu_sync_store_engine_key(
    store: *const tpu_sync_store,
    hash: *const c_void,
    hash_len: usize,
    key_out: *mut tpu_sync_key,
) -> tpu_sync_status {
    boundary("tpu_sync_store_engine_key", || {
        let s = get_store(store)?;
        let bytes: &[u8] = if hash_len == 0 {
            &[]
        } else {
            if hash.is_null() {
                return Err(null("hash"));
            }
            // SAFETY: caller contract: `hash_len` readable bytes.
            unsafe { std::slice::from_raw_parts(hash as *const u8, hash_len) }
        };
        // SAFETY: forwarded caller contract.
        unsafe { out(key_out, s.ns.engine_key(bytes).into(), "key_out") }
    })
}

pub(crate) unsafe fn keys_arg(keys: *const tpu_sync_key, n: usize) -> FfiResult<Vec<BlockKey>> {
    // SAFETY: forwarded caller contract.
    Ok(unsafe { slice_arg(keys, n, "keys") }?
        .iter()
        .map(|k| BlockKey::from(*k))
        .collect())
}

pub(crate) unsafe fn parent_arg(parent: *const tpu_sync_key) -> Option<BlockKey> {
    // SAFETY: caller contract: NULL or readable.
    (!parent.is_null()).then(|| BlockKey::from(unsafe { *parent }))
}

/// Number of leading blocks of the chain `keys[0..num_keys]` present in the store (DRAM or
/// disk), written to `hits_out`; of those, how many have a DRAM copy (`in_dram_out`) and how
/// many are on disk only (`disk_only_out`), both optional. Updates their recency. 0 while the
/// store is not ready.
///
/// # Safety
/// `keys` holds `num_keys` keys; `hits_out` writable; the others NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn tpu_sync_store_lookup(
    store: *const tpu_sync_store,
    keys: *const tpu_sync_key,
    num_keys: usize,
    hits_out: *mut usize,
    in_dram_out: *mut usize,
    disk_only_out: *mut usize,
) -> tpu_sync_status {
    boundary("tpu_sync_store_lookup", || {
        let s = get_store(store)?;
        if hits_out.is_null() {
            return Err(null("hits_out"));
        }
        // SAFETY: forwarded caller contract.
        let keys = unsafe { keys_arg(keys, num_keys) }?;
        let r = s.store.lookup_detail(&keys);
        // SAFETY: checked / caller contract for the optional ones.
        unsafe {
            *hits_out = r.hits;
            if !in_dram_out.is_null() {
                *in_dram_out = r.in_dram;
            }
            if !disk_only_out.is_null() {
                *disk_only_out = r.disk_only;
            }
        }
        Ok(())
    })
}

pub(crate) fn put_result(r: PutReport) -> tpu_sync_put_result {
    tpu_sync_put_result {
        stored: r.stored,
        present: r.present,
        full_at: r.full_at.unwrap_or(usize::MAX),
        not_ready: r.not_ready,
        bytes: r.bytes,
    }
}

pub(crate) fn get_result(r: GetReport) -> tpu_sync_get_result {
    use tpu_sync_get_stop::*;
    tpu_sync_get_result {
        delivered: r.delivered,
        from_dram: r.from_dram,
        from_disk: r.from_disk,
        bytes: r.bytes,
        retries: r.retries,
        stop: match r.stop {
            None => TPU_SYNC_GET_COMPLETE,
            Some(StopReason::NotReady) => TPU_SYNC_GET_NOT_READY,
            Some(StopReason::Missing) => TPU_SYNC_GET_MISSING,
            Some(StopReason::NoSpace) => TPU_SYNC_GET_NO_SPACE,
            Some(StopReason::Raced) => TPU_SYNC_GET_RACED,
            Some(StopReason::BadFile(_)) => TPU_SYNC_GET_BAD_FILE,
        } as u32,
    }
}

/// Stores a chain of blocks from host memory: block `i` (key `keys[i]`, whose parent is
/// `keys[i-1]`, and `parent` for block 0; `parent` NULL for a sequence's first block or when
/// unknown) is `lens[i]` bytes at `blocks[i]`, copied during the call (blocks borrowed for the
/// call). Blocks already present are not written again. A lack of room is not an error: see
/// `tpu_sync_put_result.full_at`. The result is written to `result_out`.
///
/// Errors: `TPU_SYNC_INVALID_ARGUMENT` for an empty block or one larger than `block_bytes`.
///
/// # Safety
/// `keys`, `blocks`, `lens` hold `num_blocks` entries; `blocks[i]` points to `lens[i]` readable
/// bytes; `parent` NULL or readable; `result_out` writable.
#[no_mangle]
pub unsafe extern "C" fn tpu_sync_store_put(
    store: *const tpu_sync_store,
    parent: *const tpu_sync_key,
    keys: *const tpu_sync_key,
    num_blocks: usize,
    blocks: *const *const c_void,
    lens: *const usize,
    result_out: *mut tpu_sync_put_result,
) -> tpu_sync_status {
    boundary("tpu_sync_store_put", || {
        let s = get_store(store)?;
        if result_out.is_null() {
            return Err(null("result_out"));
        }
        // SAFETY: forwarded caller contract (all three arrays hold `num_blocks` entries).
        let (keys, ptrs, lens) = unsafe {
            (
                keys_arg(keys, num_blocks)?,
                slice_arg(blocks, num_blocks, "blocks")?,
                slice_arg(lens, num_blocks, "lens")?,
            )
        };
        let mut srcs: Vec<&[u8]> = Vec::with_capacity(num_blocks);
        for (i, (&p, &l)) in ptrs.iter().zip(lens).enumerate() {
            if p.is_null() {
                return Err(null(&format!("blocks[{i}]")));
            }
            // SAFETY: caller contract: `lens[i]` readable bytes at `blocks[i]`.
            srcs.push(unsafe { std::slice::from_raw_parts(p as *const u8, l) });
        }
        // SAFETY: forwarded caller contract.
        let parent = unsafe { parent_arg(parent) };
        let r = s.store.put_from_host(parent, &keys, &srcs)?;
        // SAFETY: checked non-NULL.
        unsafe { *result_out = put_result(r) };
        Ok(())
    })
}

/// Copies the leading blocks of the chain `keys[0..num_keys]` out of the store: block `i` into
/// `dsts[i]`, which has `lens[i]` bytes and must be exactly as long as the block was stored.
/// Disk-only blocks are loaded through DRAM. Stops at the first missing block; the result (how
/// many were delivered, and why it stopped) goes to `result_out`.
///
/// Errors: `TPU_SYNC_INVALID_ARGUMENT` when a destination has the wrong length;
/// `TPU_SYNC_CHECKSUM` when a block's stored bytes fail their checksum (the block and its chain
/// below it are dropped from the store).
///
/// # Safety
/// `keys`, `dsts`, `lens` hold `num_keys` entries; `dsts[i]` points to `lens[i]` writable bytes
/// not accessed by others during the call; `result_out` writable.
#[no_mangle]
pub unsafe extern "C" fn tpu_sync_store_get(
    store: *const tpu_sync_store,
    keys: *const tpu_sync_key,
    num_keys: usize,
    dsts: *const *mut c_void,
    lens: *const usize,
    result_out: *mut tpu_sync_get_result,
) -> tpu_sync_status {
    boundary("tpu_sync_store_get", || {
        let s = get_store(store)?;
        if result_out.is_null() {
            return Err(null("result_out"));
        }
        // SAFETY: forwarded caller contract.
        let (keys, ptrs, lens) = unsafe {
            (
                keys_arg(keys, num_keys)?,
                slice_arg(dsts, num_keys, "dsts")?,
                slice_arg(lens, num_keys, "lens")?,
            )
        };
        let mut outs: Vec<&mut [u8]> = Vec::with_capacity(num_keys);
        for (i, (&p, &l)) in ptrs.iter().zip(lens).enumerate() {
            if p.is_null() {
                return Err(null(&format!("dsts[{i}]")));
            }
            // SAFETY: caller contract: `lens[i]` writable bytes at `dsts[i]`, exclusively ours.
            outs.push(unsafe { std::slice::from_raw_parts_mut(p as *mut u8, l) });
        }
        let r = s.store.get_to_host(&keys, &mut outs)?;
        // SAFETY: checked non-NULL.
        unsafe { *result_out = get_result(r) };
        Ok(())
    })
}

/// Device pieces resolved: the buffer of each piece, its (offset, len), pieces per block.
pub(crate) type Pieces = (Vec<Arc<BufferObj>>, Vec<(u64, u64)>, Vec<usize>);

/// Resolves (pieces, pieces_per_block) into the buffers they use.
pub(crate) unsafe fn device_pieces(
    pieces: *const tpu_sync_device_range,
    num_pieces: usize,
    pieces_per_block: *const usize,
    num_blocks: usize,
) -> FfiResult<Pieces> {
    // SAFETY: forwarded caller contract.
    let (pieces, per) = unsafe {
        (
            slice_arg(pieces, num_pieces, "pieces")?,
            slice_arg(pieces_per_block, num_blocks, "pieces_per_block")?,
        )
    };
    let total = per
        .iter()
        .try_fold(0usize, |a, &n| a.checked_add(n))
        .ok_or_else(|| invalid("pieces_per_block overflows"))?;
    if total != pieces.len() {
        return Err(invalid(format!(
            "pieces_per_block adds up to {total} pieces, {} given",
            pieces.len()
        )));
    }
    let bufs = pieces
        .iter()
        .map(|p| handle::get::<BufferObj, _>(K::TPU_SYNC_HANDLE_BUFFER, p.buffer))
        .collect::<FfiResult<Vec<_>>>()?;
    let ranges = pieces.iter().map(|p| (p.offset, p.len)).collect();
    Ok((bufs, ranges, per.to_vec()))
}

pub(crate) fn device_blocks<'a>(
    bufs: &'a [Arc<BufferObj>],
    ranges: &[(u64, u64)],
    per: &[usize],
) -> Vec<DeviceBlock<'a>> {
    let mut at = 0;
    per.iter()
        .map(|&n| {
            let b = DeviceBlock::new(
                (at..at + n)
                    .map(|i| DeviceRange {
                        buffer: &bufs[i].buffer,
                        offset: ranges[i].0,
                        len: ranges[i].1,
                    })
                    .collect(),
            );
            at += n;
            b
        })
        .collect()
}

/// Stores a chain of blocks from PJRT device memory (D2H of every piece, issued together and
/// completed before the call returns): block `i` is the concatenation, in order, of the
/// `pieces_per_block[i]` next ranges of `pieces` (e.g. one engine block's K and V rows of every
/// layer). `parent`, keys and the result as for [`tpu_sync_store_put`].
///
/// Errors: as `tpu_sync_store_put`, plus the device layer's (`TPU_SYNC_INVALID_ARGUMENT` for a
/// range outside a buffer, `TPU_SYNC_PJRT`).
///
/// # Safety
/// `keys` and `pieces_per_block` hold `num_blocks` entries, `pieces` holds `num_pieces`;
/// `parent` NULL or readable; `result_out` writable.
#[no_mangle]
pub unsafe extern "C" fn tpu_sync_store_put_from_device(
    store: *const tpu_sync_store,
    parent: *const tpu_sync_key,
    keys: *const tpu_sync_key,
    num_blocks: usize,
    pieces: *const tpu_sync_device_range,
    num_pieces: usize,
    pieces_per_block: *const usize,
    result_out: *mut tpu_sync_put_result,
) -> tpu_sync_status {
    boundary("tpu_sync_store_put_from_device", || {
        let s = get_store(store)?;
        if result_out.is_null() {
            return Err(null("result_out"));
        }
        // SAFETY: forwarded caller contract.
        let keys = unsafe { keys_arg(keys, num_blocks) }?;
        // SAFETY: forwarded caller contract.
        let (bufs, ranges, per) =
            unsafe { device_pieces(pieces, num_pieces, pieces_per_block, num_blocks) }?;
        let blocks = device_blocks(&bufs, &ranges, &per);
        // SAFETY: forwarded caller contract.
        let parent = unsafe { parent_arg(parent) };
        let r = s.store.put_from_device(parent, &keys, &blocks)?;
        // SAFETY: checked non-NULL.
        unsafe { *result_out = put_result(r) };
        Ok(())
    })
}

/// Copies the leading blocks of the chain into existing device blocks in place (H2D by the
/// buffers' client's probed path, completed before the call returns): block `i` goes to the
/// `pieces_per_block[i]` next ranges of `pieces`, which must add up to the block's stored
/// length. Result as for [`tpu_sync_store_get`].
///
/// Errors: as `tpu_sync_store_get`, plus `TPU_SYNC_UNSUPPORTED` (no in-place H2D path),
/// `TPU_SYNC_INVALID_ARGUMENT` (ranges outside a buffer, buffers of different plugins).
///
/// # Safety
/// `keys` and `pieces_per_block` hold `num_keys` entries, `pieces` holds `num_pieces`;
/// `result_out` writable. No computation may use the destination ranges during the call.
#[no_mangle]
pub unsafe extern "C" fn tpu_sync_store_get_to_device(
    store: *const tpu_sync_store,
    keys: *const tpu_sync_key,
    num_keys: usize,
    pieces: *const tpu_sync_device_range,
    num_pieces: usize,
    pieces_per_block: *const usize,
    result_out: *mut tpu_sync_get_result,
) -> tpu_sync_status {
    boundary("tpu_sync_store_get_to_device", || {
        let s = get_store(store)?;
        if result_out.is_null() {
            return Err(null("result_out"));
        }
        // SAFETY: forwarded caller contract.
        let keys = unsafe { keys_arg(keys, num_keys) }?;
        // SAFETY: forwarded caller contract.
        let (bufs, ranges, per) =
            unsafe { device_pieces(pieces, num_pieces, pieces_per_block, num_keys) }?;
        let Some(first) = bufs.first() else {
            if !keys.is_empty() {
                return Err(invalid(format!(
                    "{} keys but no device pieces to write them to",
                    keys.len()
                )));
            }
            // SAFETY: checked non-NULL.
            unsafe { *result_out = get_result(GetReport::default()) };
            return Ok(());
        };
        if let Some(i) = bufs.iter().position(|b| b.caps.plugin != first.caps.plugin) {
            return Err(invalid(format!(
                "piece {i}: buffer of plugin {} among buffers of plugin {}",
                bufs[i].caps.plugin, first.caps.plugin
            )));
        }
        let blocks = device_blocks(&bufs, &ranges, &per);
        let r = s.store.get_to_device(&first.caps, &keys, &blocks)?;
        // SAFETY: checked non-NULL.
        unsafe { *result_out = get_result(r) };
        Ok(())
    })
}

/// Pins the leading present blocks of the chain `keys[0..num_keys]` (never evicted while the
/// lease lives, so a get of them cannot miss) and updates their recency. `lease_out` receives a
/// new lease handle owned by the caller (it may pin 0 blocks: see `tpu_sync_lease_count`); free
/// it to unpin. The lease keeps the store alive.
///
/// # Safety
/// `keys` holds `num_keys` keys; `lease_out` writable.
#[no_mangle]
pub unsafe extern "C" fn tpu_sync_store_pin(
    store: *const tpu_sync_store,
    keys: *const tpu_sync_key,
    num_keys: usize,
    lease_out: *mut *mut tpu_sync_lease,
) -> tpu_sync_status {
    boundary("tpu_sync_store_pin", || {
        let s = get_store(store)?;
        if lease_out.is_null() {
            return Err(null("lease_out"));
        }
        // SAFETY: forwarded caller contract.
        let keys = unsafe { keys_arg(keys, num_keys) }?;
        let lease = s.store.pin(&keys);
        let h = handle::insert(K::TPU_SYNC_HANDLE_LEASE, Arc::new(lease));
        // SAFETY: checked non-NULL.
        unsafe { out(lease_out, h, "lease_out") }
    })
}

/// Number of leading blocks the lease pins, written to `count_out`.
///
/// # Safety
/// `count_out` writable.
#[no_mangle]
pub unsafe extern "C" fn tpu_sync_lease_count(
    lease: *const tpu_sync_lease,
    count_out: *mut usize,
) -> tpu_sync_status {
    boundary("tpu_sync_lease_count", || {
        let l: Arc<Lease> = handle::get(K::TPU_SYNC_HANDLE_LEASE, lease)?;
        // SAFETY: forwarded caller contract.
        unsafe { out(count_out, l.len(), "count_out") }
    })
}

/// Frees a lease: unpins its blocks.
#[no_mangle]
pub extern "C" fn tpu_sync_lease_free(lease: *mut tpu_sync_lease) -> tpu_sync_status {
    boundary("tpu_sync_lease_free", || {
        handle::remove(K::TPU_SYNC_HANDLE_LEASE, lease)?;
        Ok(())
    })
}

/// Removes blocks by key, each with every block of its chain below it (no suffix is left
/// without its prefix); a key whose chain below holds a pinned or in-flight block is left alone.
/// Writes the number of blocks removed to `removed_out` (may be NULL).
///
/// # Safety
/// `keys` holds `num_keys` keys; `removed_out` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn tpu_sync_store_remove(
    store: *const tpu_sync_store,
    keys: *const tpu_sync_key,
    num_keys: usize,
    removed_out: *mut usize,
) -> tpu_sync_status {
    boundary("tpu_sync_store_remove", || {
        let s = get_store(store)?;
        // SAFETY: forwarded caller contract.
        let keys = unsafe { keys_arg(keys, num_keys) }?;
        let n = s.store.remove(&keys);
        if !removed_out.is_null() {
            // SAFETY: non-NULL, writable per contract.
            unsafe { *removed_out = n };
        }
        Ok(())
    })
}

/// Removes every block that is not pinned, in flight, or a prefix of one; the number removed
/// goes to `removed_out` (may be NULL).
///
/// # Safety
/// `removed_out` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn tpu_sync_store_clear(
    store: *const tpu_sync_store,
    removed_out: *mut usize,
) -> tpu_sync_status {
    boundary("tpu_sync_store_clear", || {
        let s = get_store(store)?;
        let n = s.store.clear();
        if !removed_out.is_null() {
            // SAFETY: non-NULL, writable per contract.
            unsafe { *removed_out = n };
        }
        Ok(())
    })
}

/// Writes every DRAM block without a disk copy to the disk tier (e.g. before a shutdown without
/// a shm segment); the number written goes to `written_out` (may be NULL).
///
/// Errors: `TPU_SYNC_INVALID_ARGUMENT` without a disk tier; `TPU_SYNC_IO` for the first block that
/// could not be written (the others are still written).
///
/// # Safety
/// `written_out` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn tpu_sync_store_flush_to_disk(
    store: *const tpu_sync_store,
    written_out: *mut usize,
) -> tpu_sync_status {
    boundary("tpu_sync_store_flush_to_disk", || {
        let s = get_store(store)?;
        let n = s.store.flush_to_disk()?;
        if !written_out.is_null() {
            // SAFETY: non-NULL, writable per contract.
            unsafe { *written_out = n };
        }
        Ok(())
    })
}

fn shm_dir(dir: *const c_char) -> FfiResult<PathBuf> {
    if dir.is_null() {
        Ok(PathBuf::from(DEFAULT_SHM_DIR))
    } else {
        // SAFETY: caller contract: NUL-terminated.
        Ok(PathBuf::from(unsafe { str_arg(dir, "dir") }?))
    }
}

/// Lists the named store segments in directory `dir` (NUL-terminated, or NULL for `/dev/shm`) as
/// a JSON array into `buf` (`buf`/`buf_len`/`len_out` as for `tpu_sync_client_info`): `[{"name",
/// "path", "bytes", "uid", "mode", "in_use", "namespace" (or null), "block_bytes", "num_slots",
/// "committed_blocks" (null when the header is unreadable)}]`.
///
/// Errors: `TPU_SYNC_IO` when the directory cannot be read.
///
/// # Safety
/// `dir` NULL or NUL-terminated; `buf` must have `buf_len` writable bytes (or be NULL with
/// `buf_len` 0); `len_out` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn tpu_sync_shm_list(
    dir: *const c_char,
    buf: *mut c_char,
    buf_len: usize,
    len_out: *mut usize,
) -> tpu_sync_status {
    boundary("tpu_sync_shm_list", || {
        let segs = store::list_segments(&shm_dir(dir)?)?;
        let v: Vec<serde_json::Value> = segs
            .iter()
            .map(|s| {
                serde_json::json!({
                    "name": s.name, "path": s.path.display().to_string(), "bytes": s.bytes,
                    "uid": s.uid, "mode": s.mode, "in_use": s.in_use, "namespace": s.namespace,
                    "block_bytes": s.blocks.map(|b| b.0), "num_slots": s.blocks.map(|b| b.1),
                    "committed_blocks": s.blocks.map(|b| b.2),
                })
            })
            .collect();
        // SAFETY: forwarded caller contract.
        unsafe {
            out_string(
                &serde_json::Value::from(v).to_string(),
                buf,
                buf_len,
                len_out,
            )
        }
    })
}

/// Removes the named store segment `name` (NUL-terminated) from directory `dir` (NULL:
/// `/dev/shm`). Refuses a segment in use by a live process or owned by another user unless
/// `force`.
///
/// Errors: `TPU_SYNC_INVALID_ARGUMENT` for a bad name; `TPU_SYNC_IO` when it does not exist, is in
/// use, belongs to someone else, or cannot be removed.
///
/// # Safety
/// `dir` NULL or NUL-terminated; `name` NUL-terminated.
#[no_mangle]
pub unsafe extern "C" fn tpu_sync_shm_remove(
    dir: *const c_char,
    name: *const c_char,
    force: bool,
) -> tpu_sync_status {
    boundary("tpu_sync_shm_remove", || {
        // SAFETY: caller contract.
        let name = unsafe { str_arg(name, "name") }?;
        Ok(store::remove_segment(&shm_dir(dir)?, name, force)?)
    })
}
