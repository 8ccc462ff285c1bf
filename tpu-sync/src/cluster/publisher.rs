//! Publishing one store's keys into the directory (see [`super`]).

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use etcd_client::{PutOptions, Txn, TxnOp};
use tokio::sync::Notify;

use super::{etcd_err, schema, Directory, HostRecord};
use crate::error::{Error, Result};
use crate::store::{BlockKey, KvStore, ObserverId, StoreObserver};

/// Counters of a [`Publisher`] since it started.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PublisherStats {
    /// Block entries written to etcd.
    pub published: u64,
    /// Block entries deleted from etcd.
    pub unpublished: u64,
    /// etcd transactions sent (block entries only).
    pub txns: u64,
    /// Leases granted (1 at start, then one per lost lease).
    pub leases: u64,
    /// Times the whole store was published again under a new lease.
    pub republishes: u64,
    /// etcd requests that failed (retried).
    pub errors: u64,
    /// Blocks the store holds that the publisher knows of.
    pub mirrored: u64,
    /// Block entries currently published (under the current lease).
    pub live_entries: u64,
    /// Changes waiting to be sent.
    pub pending: u64,
    /// Blocks not published because of the publish stride.
    pub skipped_by_stride: u64,
}

#[derive(Default)]
struct State {
    /// The store's blocks: key -> (parent, chain depth if known).
    mirror: HashMap<u128, (Option<u128>, Option<u32>)>,
    /// Keys whose published state must change: true = publish, false = unpublish.
    pending: HashMap<u128, bool>,
    /// Keys published under the current lease.
    published: HashSet<u128>,
    /// Operations taken out of `pending` and not yet acknowledged.
    inflight: usize,
}

struct Shared {
    state: Mutex<State>,
    wake: Notify,
    stop: Notify,
    stopping: AtomicBool,
    /// Stop without revoking the lease (a simulated crash, for tests).
    abandon: AtomicBool,
    stride: u32,
    c: Counters,
    /// The current lease id (0 while none).
    lease: AtomicI64,
    /// Set when the current lease is known to be good and everything up to it was published.
    ready: AtomicBool,
}

#[derive(Default)]
struct Counters {
    published: AtomicU64,
    unpublished: AtomicU64,
    txns: AtomicU64,
    leases: AtomicU64,
    republishes: AtomicU64,
    errors: AtomicU64,
    skipped: AtomicU64,
}

impl Shared {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

struct Observer(Arc<Shared>);

impl StoreObserver for Observer {
    fn stored(&self, blocks: &[(BlockKey, Option<BlockKey>)]) {
        let mut st = self.0.lock();
        for &(k, p) in blocks {
            let depth = match p {
                None => Some(0),
                Some(p) => st.mirror.get(&p.0).and_then(|&(_, d)| d).map(|d| d + 1),
            };
            st.mirror.insert(k.0, (p.map(|p| p.0), depth));
            if schema::published_at(depth, self.0.stride) {
                st.pending.insert(k.0, true);
            } else {
                self.0.c.skipped.fetch_add(1, Ordering::Relaxed);
            }
        }
        drop(st);
        self.0.wake.notify_one();
    }

    fn removed(&self, keys: &[BlockKey]) {
        let mut st = self.0.lock();
        let mut any = false;
        for k in keys {
            if st.mirror.remove(&k.0).is_some() {
                st.pending.insert(k.0, false);
                any = true;
            }
        }
        drop(st);
        if any {
            self.0.wake.notify_one();
        }
    }
}

/// Publishes one store's blocks into the directory as one host, under one etcd lease, until
/// dropped (see the module docs of [`super`]). Dropping it unregisters from the store and revokes
/// the lease, so its entries disappear at once (a host that dies instead loses them after the
/// TTL).
///
/// Thread-safety: `Send + Sync`; the work runs on the directory's runtime.
pub struct Publisher {
    shared: Arc<Shared>,
    dir: Directory,
    store: KvStore,
    observer: ObserverId,
    host: HostRecord,
    done: Option<std::sync::mpsc::Receiver<()>>,
}

impl std::fmt::Debug for Publisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Publisher")
            .field("host", &self.host)
            .field("stats", &self.stats())
            .finish()
    }
}

impl Publisher {
    pub(super) fn start(dir: Directory, store: &KvStore, host: HostRecord) -> Result<Publisher> {
        let ns = store
            .namespace()
            .ok_or_else(|| {
                Error::InvalidArgument("cluster publish: the store is not ready".into())
            })?
            .id();
        let shared = Arc::new(Shared {
            state: Mutex::new(State::default()),
            wake: Notify::new(),
            stop: Notify::new(),
            stopping: AtomicBool::new(false),
            abandon: AtomicBool::new(false),
            stride: dir.inner.cfg.publish_stride,
            c: Counters::default(),
            lease: AtomicI64::new(0),
            ready: AtomicBool::new(false),
        });
        let (id, snapshot) = store.observe(Arc::new(Observer(shared.clone())))?;
        {
            // The snapshot in chain order where parents are present, so depths are known.
            let mut st = shared.lock();
            let present: HashMap<u128, Option<u128>> = snapshot
                .iter()
                .map(|(k, p)| (k.0, p.map(|p| p.0)))
                .collect();
            for (k, _) in &snapshot {
                depth_of(k.0, &present, &mut st.mirror);
            }
            let keys: Vec<u128> = st.mirror.keys().copied().collect();
            for k in keys {
                let d = st.mirror[&k].1;
                if schema::published_at(d, shared.stride) {
                    st.pending.insert(k, true);
                } else {
                    shared.c.skipped.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        let task = Task {
            shared: shared.clone(),
            client: dir.inner.client.clone(),
            cfg: dir.inner.cfg.clone(),
            host: host.clone(),
            ns,
        };
        dir.handle().spawn(async move {
            task.run().await;
            let _ = tx.send(());
        });
        Ok(Publisher {
            shared,
            dir,
            store: store.clone(),
            observer: id,
            host,
            done: Some(rx),
        })
    }

    /// The host record published.
    pub fn host(&self) -> &HostRecord {
        &self.host
    }

    /// Counters and queue lengths.
    pub fn stats(&self) -> PublisherStats {
        let st = self.shared.lock();
        let c = &self.shared.c;
        PublisherStats {
            published: c.published.load(Ordering::Relaxed),
            unpublished: c.unpublished.load(Ordering::Relaxed),
            txns: c.txns.load(Ordering::Relaxed),
            leases: c.leases.load(Ordering::Relaxed),
            republishes: c.republishes.load(Ordering::Relaxed),
            errors: c.errors.load(Ordering::Relaxed),
            mirrored: st.mirror.len() as u64,
            live_entries: st.published.len() as u64,
            pending: (st.pending.len() + st.inflight) as u64,
            skipped_by_stride: c.skipped.load(Ordering::Relaxed),
        }
    }

    /// The etcd lease id in use (0 while none).
    pub fn lease_id(&self) -> i64 {
        self.shared.lease.load(Ordering::Relaxed)
    }

    /// Waits until every change made to the store before this call is published under a live
    /// lease (for tests and orderly hand-offs; the directory stays a hint).
    ///
    /// Errors: [`Error::Timeout`] when that has not happened within `timeout` (etcd unreachable,
    /// or changes arriving faster than the rate bound).
    pub fn sync(&self, timeout: Duration) -> Result<()> {
        let t0 = Instant::now();
        loop {
            let idle = {
                let st = self.shared.lock();
                st.pending.is_empty() && st.inflight == 0
            };
            if idle && self.shared.ready.load(Ordering::Acquire) {
                return Ok(());
            }
            if t0.elapsed() > timeout {
                return Err(Error::Timeout(format!(
                    "cluster publisher {}: {} changes still unpublished after {timeout:?}",
                    self.host.id,
                    self.stats().pending
                )));
            }
            self.shared.wake.notify_one();
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

impl Publisher {
    /// Stops publishing and refreshing the lease **without** revoking it, as a crashed host
    /// would: its entries stay until the TTL runs out. For tests of lease expiry.
    #[doc(hidden)]
    pub fn abandon(self) {
        self.shared.abandon.store(true, Ordering::Release);
        drop(self);
    }
}

impl Drop for Publisher {
    fn drop(&mut self) {
        self.store.unobserve(self.observer);
        self.shared.stopping.store(true, Ordering::Release);
        self.shared.stop.notify_one();
        self.shared.wake.notify_one();
        if let Some(rx) = self.done.take() {
            // Bounded: the task revokes the lease with the request timeout.
            let _ = rx.recv_timeout(self.dir.inner.cfg.request_timeout + Duration::from_secs(1));
        }
    }
}

/// Chain depth of `k` (0 = no parent), filling `mirror` on the way.
fn depth_of(
    k: u128,
    present: &HashMap<u128, Option<u128>>,
    mirror: &mut HashMap<u128, (Option<u128>, Option<u32>)>,
) -> Option<u32> {
    // Iterative walk up the chain, then back down.
    let mut path = Vec::new();
    let mut cur = k;
    let base: Option<u32> = loop {
        if let Some(&(_, d)) = mirror.get(&cur) {
            break d;
        }
        let Some(&p) = present.get(&cur) else {
            break None;
        };
        path.push((cur, p));
        match p {
            None => break Some(u32::MAX), // marker: the root's parent, depth -1
            Some(pp) => {
                if path.len() > present.len() {
                    break None; // a cycle in bad data: depth unknown
                }
                cur = pp;
            }
        }
    };
    let mut d = base;
    for &(key, parent) in path.iter().rev() {
        d = match (d, parent) {
            (_, None) => Some(0),
            (Some(u32::MAX), _) => Some(0),
            (Some(x), Some(_)) => Some(x + 1),
            (None, Some(_)) => None,
        };
        mirror.insert(key, (parent, d));
    }
    mirror.get(&k).and_then(|&(_, d)| d)
}

struct Task {
    shared: Arc<Shared>,
    client: etcd_client::Client,
    cfg: super::ClusterConfig,
    host: HostRecord,
    ns: u128,
}

enum Lost {
    /// The lease is gone (expired, revoked, or etcd lost its data): re-grant and re-publish.
    Lease,
    /// Stop requested.
    Stop,
}

impl Task {
    fn err(&self, what: &str, e: &Error) {
        self.shared.c.errors.fetch_add(1, Ordering::Relaxed);
        log::debug!("cluster publisher {}: {what}: {e}", self.host.id);
    }

    fn stopping(&self) -> bool {
        self.shared.stopping.load(Ordering::Acquire)
    }

    /// Sleeps `d` unless asked to stop; false when stopping.
    async fn pause(&self, d: Duration) -> bool {
        if self.stopping() {
            return false;
        }
        tokio::select! {
            _ = tokio::time::sleep(d) => !self.stopping(),
            _ = self.shared.stop.notified() => false,
        }
    }

    async fn run(self) {
        let mut backoff = Duration::from_millis(100);
        let mut first = true;
        loop {
            if self.stopping() {
                return;
            }
            let lease = match self.grant().await {
                Ok(l) => l,
                Err(e) => {
                    self.err("grant a lease", &e);
                    if !self.pause(backoff).await {
                        return;
                    }
                    backoff = (backoff * 2).min(self.cfg.lease_ttl / 2);
                    continue;
                }
            };
            backoff = Duration::from_millis(100);
            self.shared.c.leases.fetch_add(1, Ordering::Relaxed);
            self.shared.lease.store(lease, Ordering::Release);
            {
                // Everything the store holds is to be published under the new lease.
                let mut st = self.shared.lock();
                st.published.clear();
                let keys: Vec<(u128, Option<u32>)> =
                    st.mirror.iter().map(|(&k, &(_, d))| (k, d)).collect();
                st.pending.retain(|_, present| *present);
                for (k, d) in keys {
                    if schema::published_at(d, self.shared.stride) {
                        st.pending.insert(k, true);
                    }
                }
            }
            if !first {
                self.shared.c.republishes.fetch_add(1, Ordering::Relaxed);
                log::info!(
                    "cluster publisher {}: new lease {lease:x}, publishing the store again",
                    self.host.id
                );
            }
            first = false;
            match self.serve(lease).await {
                Lost::Stop => {
                    self.shared.ready.store(false, Ordering::Release);
                    if !self.shared.abandon.load(Ordering::Acquire) {
                        let mut l = self.client.lease_client();
                        let _ =
                            tokio::time::timeout(self.cfg.request_timeout, l.revoke(lease)).await;
                    }
                    self.shared.lease.store(0, Ordering::Release);
                    return;
                }
                Lost::Lease => {
                    self.shared.ready.store(false, Ordering::Release);
                    self.shared.lease.store(0, Ordering::Release);
                    // Best effort: the old lease's entries go now rather than after the TTL.
                    let mut l = self.client.lease_client();
                    let _ = tokio::time::timeout(self.cfg.request_timeout, l.revoke(lease)).await;
                }
            }
        }
    }

    async fn grant(&self) -> Result<i64> {
        let ttl = self.cfg.lease_ttl.as_secs().max(1) as i64;
        let mut l = self.client.lease_client();
        let g = tokio::time::timeout(self.cfg.request_timeout, l.grant(ttl, None))
            .await
            .map_err(|_| Error::Timeout("etcd lease grant".into()))?
            .map_err(|e| etcd_err("grant a lease", e))?;
        let lease = g.id();
        let rec = serde_json::to_vec(&self.host)
            .map_err(|e| Error::InvalidArgument(format!("host record: {e}")))?;
        let mut kv = self.client.kv_client();
        tokio::time::timeout(
            self.cfg.request_timeout,
            kv.put(
                schema::host_key(&self.cfg.prefix, &self.host.id),
                rec,
                Some(PutOptions::new().with_lease(lease)),
            ),
        )
        .await
        .map_err(|_| Error::Timeout("etcd put host record".into()))?
        .map_err(|e| etcd_err("put the host record", e))?;
        Ok(lease)
    }

    /// Keeps `lease` alive and publishes changes under it until it is lost or stop is asked.
    async fn serve(&self, lease: i64) -> Lost {
        let ka_every = (self.cfg.lease_ttl / 3).max(Duration::from_millis(300));
        let mut ka = tokio::time::interval(ka_every);
        ka.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut keeper: Option<(etcd_client::LeaseKeeper, etcd_client::LeaseKeepAliveStream)> =
            None;
        let mut last_ok = Instant::now();
        // Token bucket of operations.
        let rate = self.cfg.max_ops_per_sec as f64;
        let mut tokens = rate.min(self.cfg.max_txn_ops as f64 * 4.0).max(1.0);
        let mut refill = Instant::now();
        loop {
            if self.stopping() {
                return Lost::Stop;
            }
            // Publish what is pending, within the rate.
            let now = Instant::now();
            tokens = (tokens + now.duration_since(refill).as_secs_f64() * rate)
                .min(rate.max(self.cfg.max_txn_ops as f64));
            refill = now;
            let budget = tokens.floor() as usize;
            let ops = self.take(budget.min(self.cfg.max_txn_ops * 8));
            if !ops.is_empty() {
                tokens -= ops.len() as f64;
                match self.send(lease, &ops).await {
                    Ok(()) => {}
                    Err((e, lease_gone, sent)) => {
                        self.err("publish", &e);
                        self.requeue(&ops[sent..]);
                        if lease_gone {
                            return Lost::Lease;
                        }
                        if !self.pause(Duration::from_millis(200)).await {
                            return Lost::Stop;
                        }
                    }
                }
                continue;
            }
            {
                let st = self.shared.lock();
                let idle = st.pending.is_empty() && st.inflight == 0;
                drop(st);
                if idle && last_ok.elapsed() < self.cfg.lease_ttl {
                    self.shared.ready.store(true, Ordering::Release);
                }
            }
            let pending = !self.shared.lock().pending.is_empty();
            let wait = if pending {
                // Rate-bounded: wait for tokens.
                Duration::from_secs_f64((self.cfg.max_txn_ops.min(64) as f64 / rate).max(0.001))
            } else {
                ka_every
            };
            tokio::select! {
                _ = self.shared.stop.notified() => return Lost::Stop,
                _ = self.shared.wake.notified(), if !pending => {
                    // Coalesce for the batch window.
                    if !self.pause(self.cfg.batch_interval).await {
                        return Lost::Stop;
                    }
                }
                _ = tokio::time::sleep(wait), if pending => {}
                _ = ka.tick() => {
                    match self.keep_alive(lease, &mut keeper).await {
                        Ok(true) => last_ok = Instant::now(),
                        Ok(false) => return Lost::Lease,
                        Err(e) => {
                            self.err("keep the lease alive", &e);
                            keeper = None;
                            self.shared.ready.store(false, Ordering::Release);
                            if last_ok.elapsed() > self.cfg.lease_ttl {
                                // It has certainly expired by now.
                                return Lost::Lease;
                            }
                        }
                    }
                }
            }
        }
    }

    /// One keep-alive round trip. Ok(false): etcd says the lease no longer exists.
    async fn keep_alive(
        &self,
        lease: i64,
        keeper: &mut Option<(etcd_client::LeaseKeeper, etcd_client::LeaseKeepAliveStream)>,
    ) -> Result<bool> {
        let to = self.cfg.request_timeout;
        if keeper.is_none() {
            let mut l = self.client.lease_client();
            let k = tokio::time::timeout(to, l.keep_alive(lease))
                .await
                .map_err(|_| Error::Timeout("etcd lease keep-alive stream".into()))?
                .map_err(|e| etcd_err("open the keep-alive stream", e))?;
            *keeper = Some(k);
        }
        let (k, s) = keeper.as_mut().expect("just set");
        let r = tokio::time::timeout(to, async {
            k.keep_alive().await?;
            s.message().await
        })
        .await
        .map_err(|_| Error::Timeout("etcd lease keep-alive".into()))?
        .map_err(|e| etcd_err("keep-alive", e))?;
        match r {
            Some(resp) => Ok(resp.ttl() > 0),
            None => Err(Error::PeerClosed(
                "etcd closed the keep-alive stream".into(),
            )),
        }
    }

    /// Takes up to `n` pending changes (marking them in flight).
    fn take(&self, n: usize) -> Vec<(u128, bool)> {
        if n == 0 {
            return Vec::new();
        }
        let mut st = self.shared.lock();
        let mut ops = Vec::new();
        let keys: Vec<u128> = st.pending.keys().take(n * 2).copied().collect();
        for k in keys {
            if ops.len() == n {
                break;
            }
            let present = st.pending.remove(&k).expect("listed");
            // Skip no-ops: publishing what is published, unpublishing what is not.
            if present == st.published.contains(&k) {
                continue;
            }
            ops.push((k, present));
        }
        st.inflight += ops.len();
        ops
    }

    /// Puts failed operations back unless a newer change for the key arrived meanwhile.
    fn requeue(&self, ops: &[(u128, bool)]) {
        let mut st = self.shared.lock();
        st.inflight -= ops.len();
        for &(k, present) in ops {
            st.pending.entry(k).or_insert(present);
        }
    }

    /// Sends `ops` in transactions of at most `max_txn_ops`. On an error: the error, whether the
    /// lease is gone, and how many leading operations were applied (the rest are the caller's to
    /// requeue).
    async fn send(
        &self,
        lease: i64,
        ops: &[(u128, bool)],
    ) -> std::result::Result<(), (Error, bool, usize)> {
        let mut kv = self.client.kv_client();
        let mut done = 0;
        for chunk in ops.chunks(self.cfg.max_txn_ops) {
            let t: Vec<TxnOp> = chunk
                .iter()
                .map(|&(k, present)| {
                    let key =
                        schema::block_key(&self.cfg.prefix, self.ns, BlockKey(k), &self.host.id);
                    if present {
                        TxnOp::put(key, Vec::new(), Some(PutOptions::new().with_lease(lease)))
                    } else {
                        TxnOp::delete(key, None)
                    }
                })
                .collect();
            let r = tokio::time::timeout(self.cfg.request_timeout, kv.txn(Txn::new().and_then(t)))
                .await;
            match r {
                Err(_) => {
                    return Err((
                        Error::Timeout("etcd publish transaction".into()),
                        false,
                        done,
                    ))
                }
                Ok(Err(e)) => {
                    // A put under a lease etcd does not know fails with gRPC NotFound
                    // (rpctypes.ErrGRPCLeaseNotFound); no other op of ours can.
                    let gone = matches!(&e, etcd_client::Error::GRpcStatus(s)
                        if s.code() == tonic::Code::NotFound);
                    return Err((etcd_err("publish", e), gone, done));
                }
                Ok(Ok(_)) => {
                    self.shared.c.txns.fetch_add(1, Ordering::Relaxed);
                    let mut st = self.shared.lock();
                    st.inflight -= chunk.len();
                    for &(k, present) in chunk {
                        if present {
                            st.published.insert(k);
                            self.shared.c.published.fetch_add(1, Ordering::Relaxed);
                        } else {
                            st.published.remove(&k);
                            self.shared.c.unpublished.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                    done += chunk.len();
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn depths_from_a_snapshot() {
        // chain a -> b -> c, and d with an unknown parent x.
        let present: HashMap<u128, Option<u128>> =
            [(1, None), (2, Some(1)), (3, Some(2)), (4, Some(99))]
                .into_iter()
                .collect();
        let mut m = HashMap::new();
        assert_eq!(depth_of(3, &present, &mut m), Some(2));
        assert_eq!(depth_of(1, &present, &mut m), Some(0));
        assert_eq!(depth_of(2, &present, &mut m), Some(1));
        assert_eq!(depth_of(4, &present, &mut m), None);
        assert_eq!(m.len(), 4);
        // A cycle in bad data ends as unknown, not a hang.
        let cyc: HashMap<u128, Option<u128>> = [(7, Some(8)), (8, Some(7))].into_iter().collect();
        let mut m = HashMap::new();
        assert_eq!(depth_of(7, &cyc, &mut m), None);
    }
}
