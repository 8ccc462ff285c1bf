//! The host tier's vLLM-format KV events (`tpu_sync::kv_events`): the `"kv_events"` key of the
//! store configuration, block descriptions and the endpoints bound.

use std::ffi::c_char;

use serde::Deserialize;
use tpu_sync::kv_events::{BlockDesc, KvEventsConfig};

use crate::api::out_string;
use crate::device::slice_arg;
use crate::status::{boundary, invalid, tpu_sync_status};
use crate::store::{get_store, keys_arg, tpu_sync_key, tpu_sync_store};

/// The `"kv_events"` object of `tpu_sync_store_new`'s configuration; absent keys take the
/// defaults of `tpu_sync::kv_events::KvEventsConfig` (vLLM's `KVEventsConfig` defaults).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct KvEventsJson {
    endpoint: Option<String>,
    replay_endpoint: Option<String>,
    buffer_steps: Option<usize>,
    max_queue_size: Option<usize>,
    topic: Option<String>,
    data_parallel_rank: Option<u32>,
    dram_medium: Option<String>,
    disk_medium: Option<String>,
    int_hashes: Option<bool>,
    block_size: Option<u32>,
}

impl KvEventsJson {
    pub(crate) fn into_config(self) -> KvEventsConfig {
        let d = KvEventsConfig::default();
        KvEventsConfig {
            endpoint: self.endpoint.unwrap_or(d.endpoint),
            replay_endpoint: self.replay_endpoint.or(d.replay_endpoint),
            buffer_steps: self.buffer_steps.unwrap_or(d.buffer_steps),
            max_queue_size: self.max_queue_size.unwrap_or(d.max_queue_size),
            topic: self.topic.unwrap_or(d.topic),
            data_parallel_rank: self.data_parallel_rank.unwrap_or(d.data_parallel_rank),
            dram_medium: self.dram_medium.unwrap_or(d.dram_medium),
            disk_medium: self.disk_medium.unwrap_or(d.disk_medium),
            int_hashes: self.int_hashes.unwrap_or(d.int_hashes),
            block_size: self.block_size.unwrap_or(d.block_size),
        }
    }
}

/// Describes blocks for the store's KV events: block `keys[i]` is published under the engine
/// hash `hashes[i * hash_len .. (i + 1) * hash_len]` (e.g. vLLM's 32-byte `BlockHash`) and, when
/// `tokens_per_block` > 0, the token ids `tokens[i * tokens_per_block ..][..tokens_per_block]`,
/// in the events of its copies from now on. Call it before storing the blocks. Nothing happens
/// when the store publishes no events.
///
/// The `"kv_events"` configuration object of `tpu_sync_store_new` takes (all optional):
/// `endpoint` (PUB, `tcp://HOST:PORT`, `*` for every interface, port 0 picks one; default
/// `tcp://127.0.0.1:5557`), `replay_endpoint` (ROUTER for replays; default none),
/// `buffer_steps` (batches kept for replay; 10000), `max_queue_size` (batches queued before new
/// ones are dropped; 100000), `topic` (""), `data_parallel_rank` (0; added to both ports),
/// `dram_medium` ("CPU"), `disk_medium` ("STORAGE"), `int_hashes` (false: hashes as bytes; true:
/// the low 64 bits as an integer), `block_size` (tokens per block in `BlockStored`; 0). The wire
/// format is vLLM 0.32's (`docs/observability.md`).
///
/// Errors: `TPU_SYNC_INVALID_ARGUMENT` for `hash_len` 0 or NULL arrays with `n` > 0.
///
/// # Safety
/// `keys` holds `n` keys, `hashes` `n * hash_len` bytes, `tokens` `n * tokens_per_block` values
/// (or is NULL when `tokens_per_block` is 0); all borrowed for the call.
#[no_mangle]
pub unsafe extern "C" fn tpu_sync_store_describe_blocks(
    store: *const tpu_sync_store,
    keys: *const tpu_sync_key,
    n: usize,
    hashes: *const u8,
    hash_len: usize,
    tokens: *const u32,
    tokens_per_block: usize,
) -> tpu_sync_status {
    boundary("tpu_sync_store_describe_blocks", || {
        let s = get_store(store)?;
        if hash_len == 0 {
            return Err(invalid("hash_len must be > 0"));
        }
        // SAFETY: forwarded caller contract.
        let chain = unsafe { keys_arg(keys, n) }?;
        let total = n
            .checked_mul(hash_len)
            .ok_or_else(|| invalid("n * hash_len overflows"))?;
        // SAFETY: caller contract: `n * hash_len` readable bytes.
        let h = unsafe { slice_arg(hashes, total, "hashes") }?;
        let t: &[u32] = if tokens_per_block > 0 {
            let nt = n
                .checked_mul(tokens_per_block)
                .ok_or_else(|| invalid("n * tokens_per_block overflows"))?;
            // SAFETY: caller contract: `n * tokens_per_block` readable values.
            unsafe { slice_arg(tokens, nt, "tokens") }?
        } else {
            &[]
        };
        let descs: Vec<BlockDesc> = (0..n)
            .map(|i| BlockDesc {
                hash: h[i * hash_len..(i + 1) * hash_len].to_vec(),
                token_ids: if tokens_per_block > 0 {
                    t[i * tokens_per_block..(i + 1) * tokens_per_block].to_vec()
                } else {
                    Vec::new()
                },
            })
            .collect();
        s.store.describe_blocks(&chain, &descs)?;
        Ok(())
    })
}

/// Writes the store's KV events endpoints as JSON into `buf` (`buf`/`buf_len`/`len_out` as for
/// `tpu_sync_client_info`): `{"endpoint": "tcp://IP:PORT", "replay_endpoint": "tcp://IP:PORT"
/// | null}` with the ports bound, or `null` when the store publishes no events (or is not ready).
///
/// # Safety
/// `buf` NULL or writable for `buf_len` bytes; `len_out` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn tpu_sync_store_kv_events(
    store: *const tpu_sync_store,
    buf: *mut c_char,
    buf_len: usize,
    len_out: *mut usize,
) -> tpu_sync_status {
    boundary("tpu_sync_store_kv_events", || {
        let s = get_store(store)?;
        let v = match s.store.kv_events_endpoints() {
            None => serde_json::Value::Null,
            Some((e, r)) => serde_json::json!({"endpoint": e, "replay_endpoint": r}),
        };
        // SAFETY: forwarded caller contract.
        unsafe { out_string(&v.to_string(), buf, buf_len, len_out) }
    })
}
