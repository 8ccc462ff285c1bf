//! KV cache events of the host tier in vLLM's format, published over ZMQ, so that KV-aware
//! routers (Dynamo, llm-d, Mooncake Conductor, vLLM's own subscribers) can index which instance
//! holds which prefix in its host DRAM and disk tiers.
//!
//! # Wire format (vLLM 0.32, `vllm/distributed/kv_events.py`)
//!
//! * A **PUB** socket sends one three-frame message per batch: `topic` (UTF-8, default empty),
//!   the batch's sequence number (8 bytes, big-endian, from 0), and the payload.
//! * The **payload** is msgpack of `KVEventBatch` (a `msgspec` struct with `array_like=True`):
//!   `[ts (float, seconds since the epoch), [event, ...], data_parallel_rank (int)]`.
//! * Each **event** is a tagged `msgspec` struct (a map whose `"type"` names the class; fields
//!   with a default are omitted when at the default):
//!   * `{"type": "BlockStored", "block_hashes": [h, ...], "parent_block_hash": h | nil,
//!     "token_ids": [int, ...], "block_size": int, "lora_id": nil, "medium": str,
//!     "lora_name": nil}`: the blocks (a chain, the first one's parent given) now have a copy
//!     in `medium`;
//!   * `{"type": "BlockRemoved", "block_hashes": [h, ...], "medium": str}`: their copy in
//!     `medium` is gone;
//!   * `{"type": "AllBlocksCleared"}`: the publisher holds nothing (sent when a tier starts
//!     empty, and when a clear left it empty).
//! * A block hash `h` is vLLM's `ExternalBlockHash`: the engine's block hash bytes (msgpack
//!   `bin`), or with [`KvEventsConfig::int_hashes`] an integer, the low 64 bits of those bytes
//!   read big-endian (vLLM's `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`).
//! * A **ROUTER** replay socket ([`KvEventsConfig::replay_endpoint`]) answers a request
//!   `[identity, "", start_seq (8 bytes big-endian)]` (a REQ or DEALER client) with every
//!   buffered batch from `start_seq` on as `[identity, "", topic, seq, payload]`, then
//!   `[identity, "", "", -1 (8 bytes, signed big-endian), ""]`. The last
//!   [`KvEventsConfig::buffer_steps`] batches are kept.
//!
//! # Media
//!
//! DRAM copies are `"CPU"` (vLLM's `MEDIUM_CPU`), disk copies `"STORAGE"` (vLLM 0.32's
//! `MEDIUM_STORAGE`, which its own offloading connectors use for file tiers); both can be renamed
//! ([`KvEventsConfig::dram_medium`], [`KvEventsConfig::disk_medium`], e.g. `"DISK"`).
//!
//! # Hashes
//!
//! The store knows its 128-bit keys, not the engine's hashes. A caller that wants events to carry
//! the engine's hashes (the vLLM connector does) describes each block before storing it
//! ([`crate::store::KvStore::describe_blocks`]: hash bytes, optional token ids); a block never
//! described (or restored by a warm restart, whose segment keeps keys only) is published under its
//! 16 key bytes ([`crate::store::BlockKey::to_bytes`]) with no token ids, as vLLM publishes
//! placeholder events for blocks it has no metadata for.
//!
//! # Delivery
//!
//! The store hands events to a bounded queue ([`KvEventsConfig::max_queue_size`] batches) while it
//! holds its index lock, so their order is the order of the changes; it never blocks on it: a full
//! queue drops the batch (counted, logged). One thread (`tpu-sync-kv-events`, a single-threaded
//! tokio runtime with the pure-Rust `zeromq` crate) encodes and sends. The PUB socket delivers to
//! the subscribers connected at the time, like any ZMQ PUB; a subscriber that missed batches asks
//! the replay socket.
//!
//! The publisher is the cargo feature `kv-events` (on by default); without it the types and
//! [`encode_batch`] stay, and [`KvEventPublisher::start`] (so a store with
//! [`crate::store::StoreConfig::kv_events`] set) fails with an error that names the feature.

use std::collections::HashMap;
#[cfg(feature = "kv-events")]
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

#[cfg(feature = "kv-events")]
use bytes::Bytes;
#[cfg(feature = "kv-events")]
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

use crate::error::{Error, Result};

/// How to publish (vLLM's `KVEventsConfig` fields, same defaults where they apply).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvEventsConfig {
    /// PUB endpoint `tcp://HOST:PORT` (`*` for every interface; port 0 picks one, see
    /// [`KvEventPublisher::endpoint`]). Default `tcp://127.0.0.1:5557` (vLLM's port; vLLM binds
    /// `*`, this binds the loopback interface unless told otherwise).
    pub endpoint: String,
    /// ROUTER endpoint for replays (`None`: no replay). Default `None`, as vLLM.
    pub replay_endpoint: Option<String>,
    /// Batches kept for replay (vLLM default 10 000).
    pub buffer_steps: usize,
    /// Batches queued for the publisher thread before new ones are dropped (vLLM default
    /// 100 000).
    pub max_queue_size: usize,
    /// Topic frame (vLLM default empty).
    pub topic: String,
    /// The `data_parallel_rank` field of each batch; also added to both ports (as vLLM's
    /// `offset_endpoint_port`, port 0 excepted).
    pub data_parallel_rank: u32,
    /// Medium of DRAM copies (default `"CPU"`).
    pub dram_medium: String,
    /// Medium of disk copies (default `"STORAGE"`).
    pub disk_medium: String,
    /// Publish hashes as integers (the low 64 bits, big-endian) instead of bytes.
    pub int_hashes: bool,
    /// The `block_size` field of `BlockStored` (tokens per block; 0: unknown).
    pub block_size: u32,
}

impl Default for KvEventsConfig {
    fn default() -> Self {
        KvEventsConfig {
            endpoint: "tcp://127.0.0.1:5557".into(),
            replay_endpoint: None,
            buffer_steps: 10_000,
            max_queue_size: 100_000,
            topic: String::new(),
            data_parallel_rank: 0,
            dram_medium: "CPU".into(),
            disk_medium: "STORAGE".into(),
            int_hashes: false,
            block_size: 0,
        }
    }
}

/// One KV cache event (see the module docs for its encoding).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvEvent {
    /// Blocks (a chain) now have a copy in `medium`.
    BlockStored {
        /// The blocks' hashes, in chain order.
        block_hashes: Vec<Vec<u8>>,
        /// The hash of the block before the first one.
        parent_block_hash: Option<Vec<u8>>,
        /// The blocks' token ids (empty when unknown).
        token_ids: Vec<u32>,
        /// Where the copies are.
        medium: String,
    },
    /// The blocks' copies in `medium` are gone.
    BlockRemoved {
        /// The blocks' hashes.
        block_hashes: Vec<Vec<u8>>,
        /// Which copies.
        medium: String,
    },
    /// Nothing is held.
    AllBlocksCleared,
}

fn write_hash(buf: &mut Vec<u8>, h: &[u8], int: bool) {
    if int {
        let mut b = [0u8; 8];
        let n = h.len().min(8);
        b[8 - n..].copy_from_slice(&h[h.len() - n..]);
        let _ = rmp::encode::write_uint(buf, u64::from_be_bytes(b));
    } else {
        let _ = rmp::encode::write_bin(buf, h);
    }
}

/// The msgpack payload of one `KVEventBatch` (see the module docs), as vLLM's
/// `msgspec.msgpack.Encoder` writes it.
pub fn encode_batch(
    ts: f64,
    events: &[KvEvent],
    dp_rank: u32,
    int_hashes: bool,
    block_size: u32,
) -> Vec<u8> {
    use rmp::encode::*;
    // Writing into a Vec cannot fail.
    let mut b = Vec::with_capacity(64 + events.len() * 64);
    let _ = write_array_len(&mut b, 3);
    let _ = write_f64(&mut b, ts);
    let _ = write_array_len(&mut b, events.len() as u32);
    for e in events {
        match e {
            KvEvent::BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                medium,
            } => {
                let _ = write_map_len(&mut b, 8);
                let _ = write_str(&mut b, "type");
                let _ = write_str(&mut b, "BlockStored");
                let _ = write_str(&mut b, "block_hashes");
                let _ = write_array_len(&mut b, block_hashes.len() as u32);
                for h in block_hashes {
                    write_hash(&mut b, h, int_hashes);
                }
                let _ = write_str(&mut b, "parent_block_hash");
                match parent_block_hash {
                    Some(h) => write_hash(&mut b, h, int_hashes),
                    None => {
                        let _ = write_nil(&mut b);
                    }
                }
                let _ = write_str(&mut b, "token_ids");
                let _ = write_array_len(&mut b, token_ids.len() as u32);
                for t in token_ids {
                    let _ = write_uint(&mut b, u64::from(*t));
                }
                let _ = write_str(&mut b, "block_size");
                let _ = write_uint(&mut b, u64::from(block_size));
                let _ = write_str(&mut b, "lora_id");
                let _ = write_nil(&mut b);
                let _ = write_str(&mut b, "medium");
                let _ = write_str(&mut b, medium);
                let _ = write_str(&mut b, "lora_name");
                let _ = write_nil(&mut b);
            }
            KvEvent::BlockRemoved {
                block_hashes,
                medium,
            } => {
                let _ = write_map_len(&mut b, 3);
                let _ = write_str(&mut b, "type");
                let _ = write_str(&mut b, "BlockRemoved");
                let _ = write_str(&mut b, "block_hashes");
                let _ = write_array_len(&mut b, block_hashes.len() as u32);
                for h in block_hashes {
                    write_hash(&mut b, h, int_hashes);
                }
                let _ = write_str(&mut b, "medium");
                let _ = write_str(&mut b, medium);
            }
            KvEvent::AllBlocksCleared => {
                let _ = write_map_len(&mut b, 1);
                let _ = write_str(&mut b, "type");
                let _ = write_str(&mut b, "AllBlocksCleared");
            }
        }
    }
    let _ = write_uint(&mut b, u64::from(dp_rank));
    b
}

/// vLLM's end-of-replay sequence number: -1 as 8 signed big-endian bytes.
pub const END_SEQ: [u8; 8] = [0xff; 8];

fn endpoint_for(ep: &str, rank: u32) -> Result<String> {
    let bad = || {
        Error::InvalidArgument(format!(
            "KV events endpoint {ep:?}: expected tcp://HOST:PORT"
        ))
    };
    let rest = ep.strip_prefix("tcp://").ok_or_else(bad)?;
    let (host, port) = rest.rsplit_once(':').ok_or_else(bad)?;
    let port: u32 = port.parse().map_err(|_| bad())?;
    let port = if port == 0 { 0 } else { port + rank };
    if port > 65535 {
        return Err(bad());
    }
    let host = if host == "*" { "0.0.0.0" } else { host };
    Ok(format!("tcp://{host}:{port}"))
}

enum Msg {
    #[cfg_attr(not(feature = "kv-events"), allow(dead_code))]
    Batch(Vec<KvEvent>),
}

/// A running publisher (PUB socket, optional ROUTER replay socket, one thread). Dropping it
/// closes its queue; the thread sends what is queued and ends. `Send + Sync`.
#[derive(Debug)]
pub struct KvEventPublisher {
    tx: tokio::sync::mpsc::Sender<Msg>,
    endpoint: String,
    replay_endpoint: Option<String>,
    dropped: AtomicU64,
    cfg: KvEventsConfig,
}

impl std::fmt::Debug for Msg {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Msg")
    }
}

impl KvEventPublisher {
    /// Binds the sockets and starts the thread.
    ///
    /// Errors: [`Error::InvalidArgument`] for an endpoint that is not `tcp://HOST:PORT` or a
    /// zero `buffer_steps`/`max_queue_size`, or a build without the `kv-events` feature;
    /// [`Error::Io`] when a socket cannot be bound or the thread not started.
    pub fn start(cfg: &KvEventsConfig) -> Result<KvEventPublisher> {
        if cfg.buffer_steps == 0 || cfg.max_queue_size == 0 {
            return Err(Error::InvalidArgument(
                "KV events: buffer_steps and max_queue_size must be >= 1".into(),
            ));
        }
        let ep = endpoint_for(&cfg.endpoint, cfg.data_parallel_rank)?;
        let replay = cfg
            .replay_endpoint
            .as_deref()
            .map(|r| endpoint_for(r, cfg.data_parallel_rank))
            .transpose()?;
        #[cfg(not(feature = "kv-events"))]
        {
            let _ = (ep, replay);
            Err(Error::feature_missing("KV events publisher", "kv-events"))
        }
        #[cfg(feature = "kv-events")]
        Self::spawn(cfg, ep, replay)
    }

    #[cfg(feature = "kv-events")]
    fn spawn(cfg: &KvEventsConfig, ep: String, replay: Option<String>) -> Result<KvEventPublisher> {
        let (tx, rx) = tokio::sync::mpsc::channel::<Msg>(cfg.max_queue_size);
        let (ready_tx, ready_rx) = std::sync::mpsc::channel::<Result<(String, Option<String>)>>();
        let c = cfg.clone();
        std::thread::Builder::new()
            .name("tpu-sync-kv-events".into())
            .spawn(move || publisher_thread(c, ep, replay, rx, ready_tx))
            .map_err(|e| Error::io("spawn the tpu-sync-kv-events thread", e))?;
        let (endpoint, replay_endpoint) = ready_rx.recv().map_err(|_| Error::Io {
            context: "KV events publisher thread ended before binding".into(),
            source: std::sync::Arc::new(std::io::Error::other("thread ended")),
        })??;
        log::info!(
            "KV events on {endpoint} (replay: {})",
            replay_endpoint.as_deref().unwrap_or("none")
        );
        Ok(KvEventPublisher {
            tx,
            endpoint,
            replay_endpoint,
            dropped: AtomicU64::new(0),
            cfg: cfg.clone(),
        })
    }

    /// The PUB endpoint bound (`tcp://IP:PORT`, the real port when 0 was asked for).
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// The ROUTER replay endpoint bound, if any.
    pub fn replay_endpoint(&self) -> Option<&str> {
        self.replay_endpoint.as_deref()
    }

    /// The configuration.
    pub fn config(&self) -> &KvEventsConfig {
        &self.cfg
    }

    /// Batches dropped because the queue was full.
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }

    /// Queues one batch (nothing for an empty one). Never blocks: a full queue drops it.
    pub fn publish(&self, events: Vec<KvEvent>) {
        if events.is_empty() {
            return;
        }
        if self.tx.try_send(Msg::Batch(events)).is_err() {
            let n = self.dropped.fetch_add(1, Ordering::Relaxed);
            if n == 0 || n.is_power_of_two() {
                log::warn!("KV events queue full or closed: {} batches dropped", n + 1);
            }
        }
    }
}

#[cfg(feature = "kv-events")]
fn io_err(what: &str, e: impl std::fmt::Display) -> Error {
    Error::Io {
        context: what.to_string(),
        source: std::sync::Arc::new(std::io::Error::other(e.to_string())),
    }
}

#[cfg(feature = "kv-events")]
fn publisher_thread(
    cfg: KvEventsConfig,
    ep: String,
    replay: Option<String>,
    mut rx: tokio::sync::mpsc::Receiver<Msg>,
    ready: std::sync::mpsc::Sender<Result<(String, Option<String>)>>,
) {
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            let _ = ready.send(Err(io_err("KV events: tokio runtime", e)));
            return;
        }
    };
    rt.block_on(async move {
        let mut pubs = zeromq::PubSocket::new();
        let bound = match pubs.bind(&ep).await {
            Ok(b) => b.to_string(),
            Err(e) => {
                let _ = ready.send(Err(io_err(&format!("bind the KV events PUB socket on {ep}"), e)));
                return;
            }
        };
        let mut router = None;
        let mut replay_bound = None;
        if let Some(r) = &replay {
            let mut s = zeromq::RouterSocket::new();
            match s.bind(r).await {
                Ok(b) => {
                    replay_bound = Some(b.to_string());
                    router = Some(s);
                }
                Err(e) => {
                    let _ = ready.send(Err(io_err(&format!("bind the KV events replay socket on {r}"), e)));
                    return;
                }
            }
        }
        let _ = ready.send(Ok((bound, replay_bound)));
        let topic = Bytes::from(cfg.topic.clone().into_bytes());
        let mut buffer: VecDeque<(u64, Bytes)> = VecDeque::new();
        let mut seq: u64 = 0;
        loop {
            let replay_req = async {
                match router.as_mut() {
                    Some(r) => r.recv().await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                m = rx.recv() => {
                    let Some(Msg::Batch(events)) = m else { break };
                    let ts = std::time::SystemTime::now()
                        .duration_since(std::time::UNIX_EPOCH)
                        .map(|d| d.as_secs_f64())
                        .unwrap_or(0.0);
                    let payload = Bytes::from(encode_batch(
                        ts,
                        &events,
                        cfg.data_parallel_rank,
                        cfg.int_hashes,
                        cfg.block_size,
                    ));
                    let frames = vec![topic.clone(), Bytes::copy_from_slice(&seq.to_be_bytes()), payload.clone()];
                    if let Ok(msg) = ZmqMessage::try_from(frames) {
                        if let Err(e) = pubs.send(msg).await {
                            log::warn!("KV events: publishing batch {seq} failed: {e}");
                        }
                    }
                    buffer.push_back((seq, payload));
                    while buffer.len() > cfg.buffer_steps {
                        buffer.pop_front();
                    }
                    seq += 1;
                }
                r = replay_req => {
                    let Ok(req) = r else { continue };
                    let frames = req.into_vec();
                    if frames.len() != 3 || frames[2].len() != 8 {
                        log::warn!("KV events: invalid replay request of {} frames", frames.len());
                        continue;
                    }
                    let mut b = [0u8; 8];
                    b.copy_from_slice(&frames[2]);
                    let start = u64::from_be_bytes(b);
                    let Some(r) = router.as_mut() else { continue };
                    let id = frames[0].clone();
                    for (s, p) in buffer.iter().filter(|(s, _)| *s >= start) {
                        let f = vec![id.clone(), Bytes::new(), topic.clone(), Bytes::copy_from_slice(&s.to_be_bytes()), p.clone()];
                        if let Ok(m) = ZmqMessage::try_from(f) {
                            if r.send(m).await.is_err() {
                                break;
                            }
                        }
                    }
                    let f = vec![id, Bytes::new(), Bytes::new(), Bytes::copy_from_slice(&END_SEQ), Bytes::new()];
                    if let Ok(m) = ZmqMessage::try_from(f) {
                        let _ = r.send(m).await;
                    }
                }
            }
        }
    });
}

/// What the store knows about a block for its events.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BlockDesc {
    /// The engine's block hash (e.g. vLLM's `BlockHash` bytes).
    pub hash: Vec<u8>,
    /// The block's token ids (may be empty).
    pub token_ids: Vec<u32>,
}

struct Known {
    desc: Option<BlockDesc>,
    /// Bit 0: a DRAM copy; bit 1: a disk copy.
    tiers: u8,
}

/// The host tier's side: turns index changes into events, remembering each block's description
/// while it has a copy.
pub(crate) struct StoreEvents {
    pub(crate) publisher: KvEventPublisher,
    known: Mutex<HashMap<u128, Known>>,
    cap: usize,
}

impl StoreEvents {
    pub(crate) fn new(publisher: KvEventPublisher, blocks: u64) -> StoreEvents {
        StoreEvents {
            publisher,
            known: Mutex::new(HashMap::new()),
            cap: (blocks as usize).saturating_mul(2).saturating_add(4096),
        }
    }

    pub(crate) fn describe(&self, keys: &[u128], descs: &[BlockDesc]) {
        let mut k = self.known.lock().unwrap_or_else(|p| p.into_inner());
        if k.len() + keys.len() > self.cap {
            // Descriptions of blocks never stored (a put that found no room): forget them.
            k.retain(|_, v| v.tiers != 0);
        }
        for (key, d) in keys.iter().zip(descs) {
            k.entry(*key)
                .or_insert(Known {
                    desc: None,
                    tiers: 0,
                })
                .desc = Some(d.clone());
        }
    }

    /// Publishes one batch for `changes` (in order; runs of stored blocks of one chain and one
    /// medium, and runs of removals of one medium, become one event each).
    pub(crate) fn publish(&self, changes: &[crate::store::index::Change]) {
        if changes.is_empty() {
            return;
        }
        let cfg = &self.publisher.cfg;
        let mut k = self.known.lock().unwrap_or_else(|p| p.into_inner());
        let hash_of = |k: &HashMap<u128, Known>, key: u128| -> Vec<u8> {
            k.get(&key)
                .and_then(|e| e.desc.as_ref())
                .map(|d| d.hash.clone())
                .unwrap_or_else(|| key.to_le_bytes().to_vec())
        };
        let mut out: Vec<KvEvent> = Vec::new();
        let mut last_key: Option<(u128, bool)> = None;
        for c in changes {
            let medium = if c.disk {
                &cfg.disk_medium
            } else {
                &cfg.dram_medium
            };
            let h = hash_of(&k, c.key);
            let bit = if c.disk { 2 } else { 1 };
            if c.stored {
                let tokens = k
                    .get(&c.key)
                    .and_then(|e| e.desc.as_ref())
                    .map(|d| d.token_ids.clone())
                    .unwrap_or_default();
                let extends = matches!((last_key, c.parent), (Some((lk, d)), Some(p)) if lk == p && d == c.disk);
                match out.last_mut() {
                    Some(KvEvent::BlockStored {
                        block_hashes,
                        token_ids,
                        medium: m,
                        ..
                    }) if extends && m == medium => {
                        block_hashes.push(h);
                        token_ids.extend(tokens);
                    }
                    _ => out.push(KvEvent::BlockStored {
                        block_hashes: vec![h],
                        parent_block_hash: c.parent.map(|p| hash_of(&k, p)),
                        token_ids: tokens,
                        medium: medium.clone(),
                    }),
                }
                k.entry(c.key)
                    .or_insert(Known {
                        desc: None,
                        tiers: 0,
                    })
                    .tiers |= bit;
                last_key = Some((c.key, c.disk));
            } else {
                match out.last_mut() {
                    Some(KvEvent::BlockRemoved {
                        block_hashes,
                        medium: m,
                    }) if m == medium => block_hashes.push(h),
                    _ => out.push(KvEvent::BlockRemoved {
                        block_hashes: vec![h],
                        medium: medium.clone(),
                    }),
                }
                if let Some(e) = k.get_mut(&c.key) {
                    e.tiers &= !bit;
                    if e.tiers == 0 {
                        k.remove(&c.key);
                    }
                }
                last_key = None;
            }
        }
        drop(k);
        self.publisher.publish(out);
    }

    pub(crate) fn all_cleared(&self) {
        self.known
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .retain(|_, v| v.tiers == 0);
        self.publisher.publish(vec![KvEvent::AllBlocksCleared]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints() {
        assert_eq!(
            endpoint_for("tcp://*:5557", 0).unwrap(),
            "tcp://0.0.0.0:5557"
        );
        assert_eq!(
            endpoint_for("tcp://127.0.0.1:5557", 2).unwrap(),
            "tcp://127.0.0.1:5559"
        );
        assert_eq!(
            endpoint_for("tcp://127.0.0.1:0", 2).unwrap(),
            "tcp://127.0.0.1:0"
        );
        assert!(endpoint_for("ipc:///tmp/x", 0).is_err());
        assert!(endpoint_for("tcp://h:65535", 1).is_err());
    }

    #[test]
    fn batch_layout() {
        let b = encode_batch(1.5, &[KvEvent::AllBlocksCleared], 3, false, 16);
        // [1.5, [{"type": "AllBlocksCleared"}], 3]
        let mut want = vec![0x93, 0xcb];
        want.extend(1.5f64.to_be_bytes());
        want.extend([0x91, 0x81, 0xa4]);
        want.extend(b"type");
        want.push(0xa0 | 16);
        want.extend(b"AllBlocksCleared");
        want.push(0x03);
        assert_eq!(b, want);
    }

    #[test]
    fn int_hashes_are_the_low_64_bits_big_endian() {
        let mut b = Vec::new();
        let h: Vec<u8> = (1..=32).collect();
        write_hash(&mut b, &h, true);
        let mut r = &b[..];
        let v: u64 = rmp::decode::read_int(&mut r).unwrap();
        assert_eq!(v, u64::from_be_bytes([25, 26, 27, 28, 29, 30, 31, 32]));
    }
}
