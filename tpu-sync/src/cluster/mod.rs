//! The cluster prefix directory: which host tier holds which KV blocks, kept in etcd.
//!
//! A serving fleet runs many instances; a prompt prefix one instance stored in its host tier
//! ([`crate::store::KvStore`]) can be loaded by another instead of being recomputed. This module is
//! the *directory* that tells an instance where to look: each store publishes the keys of the
//! blocks it holds, per [`Namespace`], under an etcd lease, and a lookup of a key chain answers,
//! per candidate host, the longest leading prefix of the chain that host holds. The bytes travel
//! over the remote tier ([`remote`]: into pinned memory; [`load`]: resharded into device blocks
//! of another layout); the directory only says where to ask.
//!
//! It runs on an existing distributed store (etcd v3, through the maintained `etcd-client` crate
//! over gRPC, with TLS and user/password authentication as etcd supports them), not a registry
//! server of our own, as Mooncake Store keeps its metadata in etcd and Google's TPU Sync keeps a
//! `GlobalRegistry` with register/lookup/TTL/heartbeats.
//!
//! # Guarantees
//!
//! * **A hint, never the truth.** A lookup may name a host that no longer holds a block (evicted
//!   since, not yet unpublished) or miss one that does (not yet published, rate-bounded). A stale
//!   entry costs a miss when the bytes are fetched, never wrong bytes: the fetch asks the holder's
//!   store, which answers only what it holds and checksums every block.
//! * **Dead hosts vanish.** Every entry of a host is attached to one etcd lease of
//!   [`ClusterConfig::lease_ttl`]; the [`Publisher`] keeps it alive. A host that dies (or loses
//!   its network) stops refreshing it and etcd deletes all of its entries when the TTL runs out.
//! * **Re-publication.** When the lease is lost (expired during a partition, or etcd restarted
//!   without its data), the publisher takes a new lease and publishes the store's whole current
//!   contents again (it keeps a mirror of the store's keys, fed by a
//!   [`crate::store::StoreObserver`]).
//! * **Batched and rate-bounded.** Puts and evictions are coalesced per key over
//!   [`ClusterConfig::batch_interval`] (a block stored and evicted inside one window costs
//!   nothing), sent as etcd transactions of at most [`ClusterConfig::max_txn_ops`] operations,
//!   and at most [`ClusterConfig::max_ops_per_sec`] operations a second; what does not fit waits,
//!   still coalescing.
//!
//! # Layout in etcd
//!
//! Under [`ClusterConfig::prefix`] (default `/tpu-sync/v1`):
//!
//! | key | value | lease |
//! |---|---|---|
//! | `{prefix}/h/{host}` | JSON [`HostRecord`]: address to fetch from, free-form metadata | the host's |
//! | `{prefix}/b/{namespace id, 32 hex}/{block key, 32 hex}/{host}` | empty | the host's |
//!
//! One entry per (block, host): a lookup of position `i` of a chain is one prefix range over
//! `{prefix}/b/{ns}/{key_i}/`, and a chain is looked up in transactions of up to `max_txn_ops`
//! ranges, stopping at the first transaction after which no host still holds the whole prefix.
//! With [`ClusterConfig::publish_stride`] `k > 1` only every `k`-th block of a chain (chain
//! positions `k-1, 2k-1, ...`, where the position is known) is published and looked up, which
//! divides the directory's size and write rate by `k` at the cost of answering prefixes rounded
//! down to a multiple of `k` (`docs/scaling.md` measures both).
//!
//! # Thread-safety
//!
//! [`Directory`] is `Send + Sync` and cheap to clone; its calls block the calling thread (they run
//! on the directory's own tokio runtime, so they may be called from any thread, but a call from
//! inside an async task blocks that task's worker). [`Publisher`] runs on that runtime.

pub mod load;
mod publisher;
pub mod remote;

pub use load::{load_to_device, LoadOptions, LoadReport, RemoteLoad, RemoteRank, StoreSource};
pub use publisher::{Publisher, PublisherStats};

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use etcd_client::{GetOptions, Txn, TxnOp, TxnOpResponse};
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::store::{BlockKey, KvStore, Namespace};

/// Client certificates and trust for an etcd cluster served over TLS (`https://` endpoints), as
/// etcd's `--cert-file`/`--key-file`/`--trusted-ca-file` and `--client-cert-auth` expect.
#[derive(Clone, Default)]
pub struct EtcdTls {
    /// PEM of the CA that signed the etcd servers' certificates (`None`: the system's roots are
    /// not loaded, so give one).
    pub ca_pem: Option<Vec<u8>>,
    /// PEM certificate chain of this client, for etcd's `--client-cert-auth` (with `key_pem`).
    pub cert_pem: Option<Vec<u8>>,
    /// PEM private key of `cert_pem`.
    pub key_pem: Option<Vec<u8>>,
    /// Server name to verify the servers' certificates against (default: the endpoint's host).
    pub domain: Option<String>,
}

impl std::fmt::Debug for EtcdTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdTls")
            .field("ca_pem", &self.ca_pem.is_some())
            .field("cert_pem", &self.cert_pem.is_some())
            .field("key_pem", &self.key_pem.is_some())
            .field("domain", &self.domain)
            .finish()
    }
}

/// How to reach etcd and how to publish. Every instance of a fleet must use the same `prefix`
/// and `publish_stride`.
#[derive(Clone)]
pub struct ClusterConfig {
    /// etcd client URLs (`http://127.0.0.1:2379`, `https://etcd-0:2379`, or `host:port`, taken as
    /// `http://`); requests are balanced over them and fail over between them.
    pub endpoints: Vec<String>,
    /// Key prefix of this fleet's directory (default `/tpu-sync/v1`); no trailing `/`.
    pub prefix: String,
    /// TLS to etcd (needed for `https://` endpoints).
    pub tls: Option<EtcdTls>,
    /// etcd user and password (etcd's `auth enable`); `None`: no authentication.
    pub auth: Option<(String, String)>,
    /// TTL of a host's lease (default 10 s; etcd rounds up to its minimum, about 2 s with its
    /// default election timeout). A dead host's entries vanish this long after its last
    /// keep-alive; the publisher refreshes the lease every third of it.
    pub lease_ttl: Duration,
    /// Coalescing window of puts and evictions before they are sent (default 50 ms).
    pub batch_interval: Duration,
    /// Most etcd operations per transaction (default 128, etcd's default `--max-txn-ops`).
    pub max_txn_ops: usize,
    /// Most publish/unpublish operations per second of one publisher (default 20,000).
    pub max_ops_per_sec: u32,
    /// Publish only every `k`-th block of a chain (default 1: every block; see the module docs).
    pub publish_stride: u32,
    /// Deadline of one etcd request (default 5 s).
    pub request_timeout: Duration,
    /// Deadline of connecting to an endpoint (default 3 s).
    pub connect_timeout: Duration,
}

impl std::fmt::Debug for ClusterConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClusterConfig")
            .field("endpoints", &self.endpoints)
            .field("prefix", &self.prefix)
            .field("tls", &self.tls)
            .field("auth", &self.auth.as_ref().map(|(u, _)| u))
            .field("lease_ttl", &self.lease_ttl)
            .field("batch_interval", &self.batch_interval)
            .field("max_txn_ops", &self.max_txn_ops)
            .field("max_ops_per_sec", &self.max_ops_per_sec)
            .field("publish_stride", &self.publish_stride)
            .field("request_timeout", &self.request_timeout)
            .field("connect_timeout", &self.connect_timeout)
            .finish()
    }
}

/// Default key prefix of the directory.
pub const DEFAULT_PREFIX: &str = "/tpu-sync/v1";

impl ClusterConfig {
    /// A configuration with the defaults documented on the fields.
    pub fn new(endpoints: Vec<String>) -> ClusterConfig {
        ClusterConfig {
            endpoints,
            prefix: DEFAULT_PREFIX.to_string(),
            tls: None,
            auth: None,
            lease_ttl: Duration::from_secs(10),
            batch_interval: Duration::from_millis(50),
            max_txn_ops: 128,
            max_ops_per_sec: 20_000,
            publish_stride: 1,
            request_timeout: Duration::from_secs(5),
            connect_timeout: Duration::from_secs(3),
        }
    }

    fn validate(&self) -> Result<()> {
        if self.endpoints.is_empty() {
            return Err(Error::InvalidArgument(
                "cluster: no etcd endpoints given".into(),
            ));
        }
        if self.endpoints.iter().any(|e| e.trim().is_empty()) {
            return Err(Error::InvalidArgument(
                "cluster: an etcd endpoint is empty".into(),
            ));
        }
        if !self.prefix.starts_with('/') || self.prefix.ends_with('/') {
            return Err(Error::InvalidArgument(format!(
                "cluster: prefix {:?} must start with '/' and not end with one",
                self.prefix
            )));
        }
        if self.lease_ttl < Duration::from_secs(1) || self.lease_ttl > Duration::from_secs(3600) {
            return Err(Error::InvalidArgument(format!(
                "cluster: lease TTL {:?} outside 1 s ..= 1 h",
                self.lease_ttl
            )));
        }
        if self.max_txn_ops == 0 || self.max_txn_ops > 10_000 {
            return Err(Error::InvalidArgument(format!(
                "cluster: max_txn_ops {} outside 1 ..= 10000",
                self.max_txn_ops
            )));
        }
        if self.max_ops_per_sec == 0 {
            return Err(Error::InvalidArgument(
                "cluster: max_ops_per_sec must be at least 1".into(),
            ));
        }
        if self.publish_stride == 0 {
            return Err(Error::InvalidArgument(
                "cluster: publish_stride must be at least 1".into(),
            ));
        }
        if self.request_timeout.is_zero() || self.connect_timeout.is_zero() {
            return Err(Error::InvalidArgument(
                "cluster: timeouts must be positive".into(),
            ));
        }
        Ok(())
    }
}

/// Who a publishing host is: its id in the directory and where others fetch its blocks.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostRecord {
    /// Unique id of the host (instance) in the fleet: 1 to 64 of `[A-Za-z0-9._-]`.
    pub id: String,
    /// Address other instances fetch its blocks from (e.g. the remote tier endpoint's
    /// `host:port`); free-form for the directory.
    pub addr: String,
    /// Free-form metadata (e.g. the instance's layout), at most 4 KiB.
    #[serde(default)]
    pub meta: String,
}

impl HostRecord {
    /// A record with empty metadata.
    pub fn new(id: impl Into<String>, addr: impl Into<String>) -> HostRecord {
        HostRecord {
            id: id.into(),
            addr: addr.into(),
            meta: String::new(),
        }
    }

    fn validate(&self) -> Result<()> {
        validate_host_id(&self.id)?;
        if self.meta.len() > 4096 {
            return Err(Error::InvalidArgument(format!(
                "cluster: host metadata of {} B exceeds 4 KiB",
                self.meta.len()
            )));
        }
        Ok(())
    }
}

/// Checks a host id: 1 to 64 of `[A-Za-z0-9._-]`.
///
/// Errors: [`Error::InvalidArgument`] naming the id.
pub fn validate_host_id(id: &str) -> Result<()> {
    let ok = !id.is_empty()
        && id.len() <= 64
        && id
            .bytes()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'.' | b'_' | b'-'));
    if ok {
        Ok(())
    } else {
        Err(Error::InvalidArgument(format!(
            "cluster: host id {id:?} must be 1 to 64 of [A-Za-z0-9._-]"
        )))
    }
}

/// One answer of [`Directory::lookup`]: a host and how much of the chain it holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Candidate {
    /// The host's record.
    pub host: HostRecord,
    /// Leading blocks of the chain the directory says it holds (a hint; with a publish stride
    /// `k`, a multiple of `k` or the chain length).
    pub blocks: usize,
}

/// Key layout (pure functions; see the module docs).
pub(crate) mod schema {
    use super::*;

    pub fn host_key(prefix: &str, host: &str) -> String {
        format!("{prefix}/h/{host}")
    }

    pub fn hosts_prefix(prefix: &str) -> String {
        format!("{prefix}/h/")
    }

    pub fn block_prefix(prefix: &str, ns: u128, key: BlockKey) -> String {
        format!("{prefix}/b/{ns:032x}/{}/", key.hex())
    }

    pub fn block_key(prefix: &str, ns: u128, key: BlockKey, host: &str) -> String {
        format!("{}{host}", block_prefix(prefix, ns, key))
    }

    /// The host id at the end of a block entry's key under `block_prefix`.
    pub fn host_of<'a>(entry: &'a [u8], block_prefix: &str) -> Option<&'a str> {
        let rest = entry.strip_prefix(block_prefix.as_bytes())?;
        let s = std::str::from_utf8(rest).ok()?;
        super::validate_host_id(s).ok().map(|_| s)
    }

    /// Chain positions that are published and looked up with stride `k`: `k-1, 2k-1, ...`
    /// below `n` (every position for `k = 1`).
    pub fn probe_positions(n: usize, k: u32) -> Vec<usize> {
        let k = k.max(1) as usize;
        (0..n).filter(|i| (i + 1) % k == 0).collect()
    }

    /// Whether a block at chain depth `depth` (0 = first block; `None` = unknown) is published
    /// with stride `k`. Unknown depths are published (a hint too many costs a range entry).
    pub fn published_at(depth: Option<u32>, k: u32) -> bool {
        match depth {
            _ if k <= 1 => true,
            None => true,
            Some(d) => (d as u64 + 1) % k as u64 == 0,
        }
    }
}

pub(crate) fn etcd_err(what: &str, e: etcd_client::Error) -> Error {
    use etcd_client::Error as E;
    match e {
        E::InvalidArgs(m) => Error::InvalidArgument(format!("{what}: etcd: {m}")),
        E::InvalidUri(u) => Error::InvalidArgument(format!("{what}: etcd endpoint: {u}")),
        E::GRpcStatus(s) => match s.code() {
            tonic::Code::DeadlineExceeded => {
                Error::Timeout(format!("{what}: etcd: {}", s.message()))
            }
            tonic::Code::Unavailable | tonic::Code::Cancelled | tonic::Code::Aborted => {
                Error::PeerClosed(format!("{what}: etcd unavailable: {}", s.message()))
            }
            tonic::Code::InvalidArgument | tonic::Code::OutOfRange => {
                Error::InvalidArgument(format!("{what}: etcd: {}", s.message()))
            }
            c => Error::Remote(format!("{what}: etcd: {c:?}: {}", s.message())),
        },
        E::TransportError(t) => Error::PeerClosed(format!("{what}: etcd transport: {t}")),
        E::IoError(io) => Error::io(format!("{what}: etcd"), io),
        other => Error::Remote(format!("{what}: etcd: {other}")),
    }
}

pub(crate) struct Inner {
    pub(crate) rt: Option<tokio::runtime::Runtime>,
    pub(crate) client: etcd_client::Client,
    pub(crate) cfg: ClusterConfig,
}

impl Drop for Inner {
    fn drop(&mut self) {
        // The last handle may be dropped on a thread inside another runtime: never block there.
        if let Some(rt) = self.rt.take() {
            rt.shutdown_background();
        }
    }
}

/// A connection to the directory (see the module docs). Cheap to clone; `Send + Sync`.
#[derive(Clone)]
pub struct Directory {
    pub(crate) inner: Arc<Inner>,
}

impl std::fmt::Debug for Directory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Directory")
            .field("cfg", &self.inner.cfg)
            .finish()
    }
}

fn endpoint_url(e: &str, tls: bool) -> String {
    let e = e.trim();
    if e.contains("://") {
        e.to_string()
    } else if tls {
        format!("https://{e}")
    } else {
        format!("http://{e}")
    }
}

impl Directory {
    /// Connects to etcd. The connection is made lazily by gRPC: this call fails only for a bad
    /// configuration, bad TLS material, or (with `auth`) failed authentication; an unreachable
    /// etcd shows in the first request (a clear [`Error::PeerClosed`] or [`Error::Timeout`]).
    ///
    /// Errors: [`Error::InvalidArgument`] for a bad configuration; the etcd errors mapped to
    /// [`Error::PeerClosed`], [`Error::Timeout`] or [`Error::Remote`].
    pub fn connect(cfg: ClusterConfig) -> Result<Directory> {
        cfg.validate()?;
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("tpu-sync-etcd")
            .enable_all()
            .build()
            .map_err(|e| Error::io("start the cluster directory's runtime", e))?;
        let mut opts = etcd_client::ConnectOptions::new()
            .with_timeout(cfg.request_timeout)
            .with_connect_timeout(cfg.connect_timeout)
            .with_keep_alive(Duration::from_secs(10), cfg.request_timeout)
            .with_keep_alive_while_idle(true);
        if let Some((u, p)) = &cfg.auth {
            opts = opts.with_user(u.clone(), p.clone());
        }
        if let Some(t) = &cfg.tls {
            let mut o = etcd_client::TlsOptions::new();
            if let Some(ca) = &t.ca_pem {
                o = o.ca_certificate(etcd_client::Certificate::from_pem(ca));
            }
            match (&t.cert_pem, &t.key_pem) {
                (Some(c), Some(k)) => o = o.identity(etcd_client::Identity::from_pem(c, k)),
                (None, None) => {}
                _ => {
                    return Err(Error::InvalidArgument(
                        "cluster TLS: a client certificate needs its key and the other way round"
                            .into(),
                    ))
                }
            }
            if let Some(d) = &t.domain {
                o = o.domain_name(d.clone());
            }
            opts = opts.with_tls(o);
        }
        let eps: Vec<String> = cfg
            .endpoints
            .iter()
            .map(|e| endpoint_url(e, cfg.tls.is_some()))
            .collect();
        let timeout = cfg.connect_timeout + cfg.request_timeout;
        let client = rt
            .block_on(async {
                tokio::time::timeout(timeout, etcd_client::Client::connect(eps, Some(opts))).await
            })
            .map_err(|_| Error::Timeout(format!("connecting to etcd took over {timeout:?}")))?
            .map_err(|e| etcd_err("connect to etcd", e))?;
        Ok(Directory {
            inner: Arc::new(Inner {
                rt: Some(rt),
                client,
                cfg,
            }),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &ClusterConfig {
        &self.inner.cfg
    }

    pub(crate) fn handle(&self) -> tokio::runtime::Handle {
        self.inner
            .rt
            .as_ref()
            .expect("the runtime lives as long as Inner")
            .handle()
            .clone()
    }

    /// Runs `f` on the directory's runtime and waits for it, bounded by the request timeout
    /// (twice, plus a second, for calls of several requests).
    pub(crate) fn run<T, F>(&self, what: &str, f: F) -> Result<T>
    where
        T: Send + 'static,
        F: std::future::Future<Output = Result<T>> + Send + 'static,
    {
        let deadline = self.inner.cfg.request_timeout * 2 + Duration::from_secs(1);
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        let what_s = what.to_string();
        self.handle().spawn(async move {
            let r = match tokio::time::timeout(deadline, f).await {
                Ok(r) => r,
                Err(_) => Err(Error::Timeout(format!(
                    "{what_s}: no answer from etcd within {deadline:?}"
                ))),
            };
            let _ = tx.send(r);
        });
        rx.recv_timeout(deadline + Duration::from_secs(1))
            .map_err(|_| Error::Timeout(format!("{what}: no answer within {deadline:?}")))?
    }

    /// Per candidate host, the longest leading prefix of `chain` (in namespace `ns`) the
    /// directory says it holds; hosts holding not even the first (probed) block are not listed.
    /// Sorted by `blocks`, longest first, then by host id. A hint (see the module docs).
    ///
    /// Cost: one etcd transaction per `max_txn_ops` probed positions, stopping early once no
    /// host holds the whole prefix so far, plus one for the host records.
    ///
    /// Errors: etcd unreachable or failing ([`Error::PeerClosed`], [`Error::Timeout`],
    /// [`Error::Remote`]).
    pub fn lookup(&self, ns: &Namespace, chain: &[BlockKey]) -> Result<Vec<Candidate>> {
        if chain.is_empty() {
            return Ok(Vec::new());
        }
        let client = self.inner.client.clone();
        let cfg = self.inner.cfg.clone();
        let ns = ns.id();
        let chain = chain.to_vec();
        self.run("cluster lookup", async move {
            lookup_async(client, &cfg, ns, &chain).await
        })
    }

    /// Every host with a live lease, by id.
    ///
    /// Errors: as [`Directory::lookup`].
    pub fn hosts(&self) -> Result<Vec<HostRecord>> {
        let mut kv = self.inner.client.kv_client();
        let p = schema::hosts_prefix(&self.inner.cfg.prefix);
        self.run("cluster hosts", async move {
            let r = kv
                .get(p, Some(GetOptions::new().with_prefix()))
                .await
                .map_err(|e| etcd_err("list hosts", e))?;
            let mut out: Vec<HostRecord> = r
                .kvs()
                .iter()
                .filter_map(|kv| serde_json::from_slice(kv.value()).ok())
                .collect();
            out.sort_by(|a: &HostRecord, b| a.id.cmp(&b.id));
            Ok(out)
        })
    }

    /// Starts publishing `store`'s blocks as host `host` (see [`Publisher`]). The store must be
    /// ready.
    ///
    /// Errors: [`Error::InvalidArgument`] for a bad host record or a store that is not ready.
    /// etcd being unreachable is not an error here: the publisher retries in the background.
    pub fn publish(&self, store: &KvStore, host: HostRecord) -> Result<Publisher> {
        host.validate()?;
        Publisher::start(self.clone(), store, host)
    }

    /// Deletes every entry under the prefix (test and maintenance helper; the live publishers
    /// re-publish only after their lease is lost).
    ///
    /// Errors: as [`Directory::lookup`].
    #[doc(hidden)]
    pub fn wipe(&self) -> Result<u64> {
        let mut kv = self.inner.client.kv_client();
        let p = format!("{}/", self.inner.cfg.prefix);
        self.run("cluster wipe", async move {
            let r = kv
                .delete(p, Some(etcd_client::DeleteOptions::new().with_prefix()))
                .await
                .map_err(|e| etcd_err("wipe", e))?;
            Ok(r.deleted() as u64)
        })
    }

    /// etcd's database size in bytes as its status reports it (the first endpoint answering),
    /// for load tests.
    ///
    /// Errors: as [`Directory::lookup`].
    pub fn db_size(&self) -> Result<i64> {
        let mut m = self.inner.client.maintenance_client();
        self.run("cluster status", async move {
            let s = m.status().await.map_err(|e| etcd_err("status", e))?;
            Ok(s.db_size())
        })
    }
}

async fn lookup_async(
    client: etcd_client::Client,
    cfg: &ClusterConfig,
    ns: u128,
    chain: &[BlockKey],
) -> Result<Vec<Candidate>> {
    let mut kv = client.kv_client();
    let positions = schema::probe_positions(chain.len(), cfg.publish_stride);
    // host -> leading probed positions held so far; `alive`: hosts whose run is unbroken.
    let mut runs: BTreeMap<String, usize> = BTreeMap::new();
    let mut alive: Option<Vec<String>> = None;
    let mut probed = 0usize;
    'chunks: for chunk in positions.chunks(cfg.max_txn_ops) {
        let prefixes: Vec<String> = chunk
            .iter()
            .map(|&p| schema::block_prefix(&cfg.prefix, ns, chain[p]))
            .collect();
        let ops: Vec<TxnOp> = prefixes
            .iter()
            .map(|p| {
                TxnOp::get(
                    p.clone(),
                    Some(GetOptions::new().with_prefix().with_keys_only()),
                )
            })
            .collect();
        let r = kv
            .txn(Txn::new().and_then(ops))
            .await
            .map_err(|e| etcd_err("lookup", e))?;
        for (resp, pre) in r.op_responses().into_iter().zip(&prefixes) {
            let TxnOpResponse::Get(g) = resp else {
                return Err(Error::Protocol(
                    "etcd answered a range with another op".into(),
                ));
            };
            let holders: Vec<String> = g
                .kvs()
                .iter()
                .filter_map(|kv| schema::host_of(kv.key(), pre).map(str::to_string))
                .collect();
            probed += 1;
            let next: Vec<String> = match alive.take() {
                None => holders,
                Some(a) => a.into_iter().filter(|h| holders.contains(h)).collect(),
            };
            for h in &next {
                *runs.entry(h.clone()).or_insert(0) += 1;
            }
            let empty = next.is_empty();
            alive = Some(next);
            if empty {
                break 'chunks;
            }
        }
    }
    let _ = probed;
    if runs.is_empty() {
        return Ok(Vec::new());
    }
    // Host records, one transaction.
    let ids: Vec<String> = runs.keys().cloned().collect();
    let mut records: HashMap<String, HostRecord> = HashMap::new();
    for chunk in ids.chunks(cfg.max_txn_ops) {
        let ops: Vec<TxnOp> = chunk
            .iter()
            .map(|h| TxnOp::get(schema::host_key(&cfg.prefix, h), None))
            .collect();
        let r = kv
            .txn(Txn::new().and_then(ops))
            .await
            .map_err(|e| etcd_err("lookup hosts", e))?;
        for resp in r.op_responses() {
            if let TxnOpResponse::Get(g) = resp {
                for kv in g.kvs() {
                    if let Ok(rec) = serde_json::from_slice::<HostRecord>(kv.value()) {
                        records.insert(rec.id.clone(), rec);
                    }
                }
            }
        }
    }
    let mut out: Vec<Candidate> = runs
        .into_iter()
        .filter_map(|(h, n)| {
            let host = records.remove(&h)?;
            // n probed positions held: the prefix ends after position positions[n - 1].
            let blocks = positions[n - 1] + 1;
            Some(Candidate { host, blocks })
        })
        .collect();
    out.sort_by(|a, b| b.blocks.cmp(&a.blocks).then(a.host.id.cmp(&b.host.id)));
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::schema::*;
    use super::*;

    #[test]
    fn keys_and_hosts() {
        let k = BlockKey(0x0123_4567_89ab_cdef_0011_2233_4455_6677);
        let p = block_prefix("/t", 5, k);
        assert_eq!(
            p,
            "/t/b/00000000000000000000000000000005/0123456789abcdef0011223344556677/"
        );
        let e = block_key("/t", 5, k, "host-a.1");
        assert_eq!(host_of(e.as_bytes(), &p), Some("host-a.1"));
        assert_eq!(host_of(b"/t/b/x", &p), None);
        assert_eq!(host_of(format!("{p}a/b").as_bytes(), &p), None);
        assert_eq!(host_key("/t", "h"), "/t/h/h");
    }

    #[test]
    fn stride_positions() {
        assert_eq!(probe_positions(4, 1), vec![0, 1, 2, 3]);
        assert_eq!(probe_positions(9, 4), vec![3, 7]);
        assert_eq!(probe_positions(3, 4), Vec::<usize>::new());
        assert!(published_at(Some(3), 4));
        assert!(!published_at(Some(2), 4));
        assert!(published_at(None, 4));
        assert!(published_at(Some(2), 1));
    }

    #[test]
    fn config_checks() {
        let mut c = ClusterConfig::new(vec![]);
        assert_eq!(
            c.validate().unwrap_err().kind(),
            crate::ErrorKind::InvalidArgument
        );
        c.endpoints = vec!["127.0.0.1:1".into()];
        c.validate().unwrap();
        c.prefix = "x/".into();
        assert!(c.validate().is_err());
        c.prefix = "/x".into();
        c.publish_stride = 0;
        assert!(c.validate().is_err());
        assert!(validate_host_id("a/b").is_err());
        assert!(validate_host_id("").is_err());
        assert!(validate_host_id(&"a".repeat(65)).is_err());
        validate_host_id("node-1.rank_0").unwrap();
        assert_eq!(endpoint_url("h:1", false), "http://h:1");
        assert_eq!(endpoint_url("h:1", true), "https://h:1");
        assert_eq!(endpoint_url("https://h:1", false), "https://h:1");
    }
}
