//! The cluster prefix directory against a real etcd (started by each test on a free loopback
//! port): publish on put, unpublish on evict/remove, longest prefix per host, namespaces kept
//! apart, leases (revoked on drop, expired after a crash), re-publication after etcd lost its
//! data, recovery after a restart that kept it, the publish stride, batching into transactions,
//! and authentication. Skipped with a message when no etcd binary is installed.

use crate::cluster_util;
use crate::store_util;

use std::time::{Duration, Instant};

use cluster_util::Etcd;
use tpu_sync::cluster::{ClusterConfig, Directory, HostRecord};
use tpu_sync::store::{BlockKey, KvStore, Namespace};
use tpu_sync::ErrorKind;

fn cfg(e: &Etcd, prefix: &str) -> ClusterConfig {
    let mut c = ClusterConfig::new(vec![e.endpoint()]);
    c.prefix = prefix.to_string();
    c.lease_ttl = Duration::from_secs(2);
    c.request_timeout = Duration::from_secs(2);
    c.connect_timeout = Duration::from_secs(1);
    c.batch_interval = Duration::from_millis(10);
    c
}

fn store(slots: u64) -> KvStore {
    KvStore::open(store_util::config(4096, slots)).expect("open store")
}

fn put(s: &KvStore, chain: &[BlockKey]) {
    let data: Vec<Vec<u8>> = chain
        .iter()
        .map(|&k| store_util::bytes_of(k, 4096))
        .collect();
    let refs: Vec<&[u8]> = data.iter().map(|v| v.as_slice()).collect();
    let r = s.put_from_host(None, chain, &refs).expect("put");
    assert!(r.complete(), "{r:?}");
}

/// (host id, blocks) of a lookup.
fn held(d: &Directory, ns: &Namespace, chain: &[BlockKey]) -> Vec<(String, usize)> {
    d.lookup(ns, chain)
        .expect("lookup")
        .into_iter()
        .map(|c| (c.host.id, c.blocks))
        .collect()
}

/// Polls `f` until it holds or `limit` passes (the directory converges asynchronously; the
/// assertion is on the value, the limit only bounds a failing test).
fn eventually(limit: Duration, mut f: impl FnMut() -> bool) -> bool {
    let t0 = Instant::now();
    while t0.elapsed() < limit {
        if f() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    f()
}

#[test]
fn publish_lookup_evict_and_namespaces() {
    let Some(e) = Etcd::start("publish_lookup_evict_and_namespaces") else {
        return;
    };
    let d = Directory::connect(cfg(&e, "/t1")).unwrap();
    let chain = store_util::chain(12, 1);
    let ns = store_util::ns();
    let a = store(64);
    let b = store(64);
    // A holds the whole chain (stored before publishing: the snapshot path), B the first 5
    // (stored after: the observer path).
    put(&a, &chain);
    let pa = d
        .publish(&a, HostRecord::new("host-a", "10.0.0.1:7800"))
        .unwrap();
    let pb = d
        .publish(&b, HostRecord::new("host-b", "10.0.0.2:7800"))
        .unwrap();
    put(&b, &chain[..5]);
    pa.sync(Duration::from_secs(10)).unwrap();
    pb.sync(Duration::from_secs(10)).unwrap();
    assert_eq!(
        held(&d, &ns, &chain),
        vec![("host-a".to_string(), 12), ("host-b".to_string(), 5)]
    );
    let recs = d.lookup(&ns, &chain).unwrap();
    assert_eq!(recs[0].host.addr, "10.0.0.1:7800");
    assert_eq!(recs[1].host.addr, "10.0.0.2:7800");
    // A prefix of the chain, a chain that diverges after 3 blocks, an unknown chain.
    assert_eq!(
        held(&d, &ns, &chain[..3]),
        vec![("host-a".to_string(), 3), ("host-b".to_string(), 3)]
    );
    let other = store_util::chain(4, 99);
    let mut diverge = chain[..3].to_vec();
    diverge.extend_from_slice(&other);
    assert_eq!(
        held(&d, &ns, &diverge),
        vec![("host-a".to_string(), 3), ("host-b".to_string(), 3)]
    );
    assert!(held(&d, &ns, &other).is_empty());
    // Another namespace never sees these keys.
    assert!(held(&d, &Namespace::new("another model"), &chain).is_empty());
    // Remove from block 7 on in A: A now holds 7 blocks.
    assert_eq!(a.remove(&chain[7..8]), 5);
    pa.sync(Duration::from_secs(10)).unwrap();
    assert_eq!(
        held(&d, &ns, &chain),
        vec![("host-a".to_string(), 7), ("host-b".to_string(), 5)]
    );
    let st = pa.stats();
    assert_eq!(st.published, 12);
    assert_eq!(st.unpublished, 5);
    assert_eq!(st.live_entries, 7);
    assert_eq!(st.mirrored, 7);
    assert_eq!(
        d.hosts()
            .unwrap()
            .into_iter()
            .map(|h| h.id)
            .collect::<Vec<_>>(),
        vec!["host-a", "host-b"]
    );
    // Dropping a publisher revokes its lease: its entries go at once.
    drop(pb);
    assert_eq!(held(&d, &ns, &chain), vec![("host-a".to_string(), 7)]);
    assert_eq!(d.hosts().unwrap().len(), 1);
}

#[test]
fn eviction_by_capacity_unpublishes() {
    let Some(e) = Etcd::start("eviction_by_capacity_unpublishes") else {
        return;
    };
    let d = Directory::connect(cfg(&e, "/t2")).unwrap();
    let ns = store_util::ns();
    // 8 slots: a second chain of 8 evicts the first (LRU, no disk tier).
    let a = store(8);
    let p = d.publish(&a, HostRecord::new("a", "a:1")).unwrap();
    let c1 = store_util::chain(8, 10);
    let c2 = store_util::chain(8, 11);
    put(&a, &c1);
    p.sync(Duration::from_secs(10)).unwrap();
    assert_eq!(held(&d, &ns, &c1), vec![("a".to_string(), 8)]);
    put(&a, &c2);
    p.sync(Duration::from_secs(10)).unwrap();
    let present = a.lookup(&c1);
    assert_eq!(present, 0, "the first chain was evicted");
    assert!(held(&d, &ns, &c1).is_empty());
    assert_eq!(held(&d, &ns, &c2), vec![("a".to_string(), 8)]);
    assert_eq!(p.stats().live_entries, 8);
}

#[test]
fn crashed_host_expires_after_the_ttl() {
    let Some(e) = Etcd::start("crashed_host_expires_after_the_ttl") else {
        return;
    };
    let d = Directory::connect(cfg(&e, "/t3")).unwrap();
    let ns = store_util::ns();
    let chain = store_util::chain(6, 3);
    let a = store(16);
    put(&a, &chain);
    let p = d.publish(&a, HostRecord::new("a", "a:1")).unwrap();
    p.sync(Duration::from_secs(10)).unwrap();
    assert_eq!(held(&d, &ns, &chain), vec![("a".to_string(), 6)]);
    let t0 = Instant::now();
    p.abandon(); // no revoke, no more keep-alives
    assert_eq!(
        held(&d, &ns, &chain),
        vec![("a".to_string(), 6)],
        "entries outlive a crash until the TTL"
    );
    // The TTL is 2 s; etcd expires leases on its own clock (bounded wait, value asserted).
    assert!(eventually(Duration::from_secs(15), || held(
        &d, &ns, &chain
    )
    .is_empty()));
    eprintln!("entries gone {:?} after the crash", t0.elapsed());
    assert!(d.hosts().unwrap().is_empty());
}

#[test]
fn etcd_restart_with_and_without_its_data() {
    let Some(mut e) = Etcd::start("etcd_restart_with_and_without_its_data") else {
        return;
    };
    let d = Directory::connect(cfg(&e, "/t4")).unwrap();
    let ns = store_util::ns();
    let chain = store_util::chain(10, 4);
    let a = store(32);
    put(&a, &chain[..6]);
    let p = d.publish(&a, HostRecord::new("a", "a:1")).unwrap();
    p.sync(Duration::from_secs(10)).unwrap();
    assert_eq!(p.stats().leases, 1);

    // Restart keeping the data: the lease survives; a put made while etcd was down is
    // published once it is back.
    e.kill();
    assert_eq!(
        d.lookup(&ns, &chain).unwrap_err().kind(),
        ErrorKind::PeerClosed,
        "a lookup with etcd down fails cleanly"
    );
    put(&a, &chain[6..8]);
    e.restart(false);
    p.sync(Duration::from_secs(20)).unwrap();
    assert!(eventually(Duration::from_secs(20), || {
        d.lookup(&ns, &chain)
            .is_ok_and(|c| c.len() == 1 && c[0].blocks == 8)
    }));

    // Restart without the data: the lease is gone; the publisher notices, takes a new lease and
    // publishes the whole store again.
    e.restart(true);
    assert!(eventually(Duration::from_secs(30), || {
        d.lookup(&ns, &chain)
            .is_ok_and(|c| c.len() == 1 && c[0].blocks == 8)
    }));
    p.sync(Duration::from_secs(10)).unwrap();
    let st = p.stats();
    assert!(st.leases >= 2, "{st:?}");
    assert!(st.republishes >= 1, "{st:?}");
    assert_eq!(st.live_entries, 8);
    assert_eq!(held(&d, &ns, &chain), vec![("a".to_string(), 8)]);
}

#[test]
fn publish_stride_and_batching() {
    let Some(e) = Etcd::start("publish_stride_and_batching") else {
        return;
    };
    let mut c = cfg(&e, "/t5");
    c.publish_stride = 4;
    let d = Directory::connect(c).unwrap();
    let ns = store_util::ns();
    let chain = store_util::chain(10, 5);
    let a = store(16);
    let p = d.publish(&a, HostRecord::new("a", "a:1")).unwrap();
    put(&a, &chain);
    p.sync(Duration::from_secs(10)).unwrap();
    // Positions 3 and 7 published; the answer is rounded down to 8.
    assert_eq!(p.stats().published, 2);
    assert_eq!(p.stats().skipped_by_stride, 8);
    assert_eq!(held(&d, &ns, &chain), vec![("a".to_string(), 8)]);
    assert!(held(&d, &ns, &chain[..3]).is_empty());
    drop(p);

    // Batching: 1,000 blocks in one put go out in transactions of at most 128 operations.
    let mut c = cfg(&e, "/t6");
    c.max_txn_ops = 128;
    let d = Directory::connect(c).unwrap();
    let big = store(1024);
    let p = d.publish(&big, HostRecord::new("b", "b:1")).unwrap();
    let chain = store_util::chain(1000, 6);
    put(&big, &chain);
    p.sync(Duration::from_secs(30)).unwrap();
    let st = p.stats();
    assert_eq!(st.published, 1000);
    assert!(st.txns >= 8, "{st:?}");
    assert!(
        st.txns <= 40,
        "1000 changes should coalesce into few transactions: {st:?}"
    );
    assert_eq!(held(&d, &ns, &chain), vec![("b".to_string(), 1000)]);
}

#[test]
fn authentication() {
    let Some(e) = Etcd::start("authentication") else {
        return;
    };
    // Enable etcd auth with a root user through etcdctl-equivalent calls of the client.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let mut c = etcd_client::Client::connect([e.endpoint()], None)
            .await
            .unwrap();
        c.user_add("root", "s3cret", None).await.unwrap();
        c.user_grant_role("root", "root").await.unwrap();
        c.auth_enable().await.unwrap();
    });
    let mut good = cfg(&e, "/t7");
    good.auth = Some(("root".into(), "s3cret".into()));
    let d = Directory::connect(good).unwrap();
    let a = store(8);
    let chain = store_util::chain(3, 7);
    put(&a, &chain);
    let p = d.publish(&a, HostRecord::new("a", "a:1")).unwrap();
    p.sync(Duration::from_secs(10)).unwrap();
    assert_eq!(
        held(&d, &store_util::ns(), &chain),
        vec![("a".to_string(), 3)]
    );

    let mut bad = cfg(&e, "/t7");
    bad.auth = Some(("root".into(), "wrong".into()));
    assert!(
        Directory::connect(bad).is_err(),
        "a wrong password is refused"
    );
    // Without credentials the directory connects (lazily) but etcd refuses its requests.
    let anon = Directory::connect(cfg(&e, "/t7")).unwrap();
    assert!(anon.lookup(&store_util::ns(), &chain).is_err());
}

#[test]
fn bad_configuration_is_refused() {
    let mut c = ClusterConfig::new(vec![]);
    assert_eq!(
        Directory::connect(c.clone()).unwrap_err().kind(),
        ErrorKind::InvalidArgument
    );
    c.endpoints = vec!["127.0.0.1:1".into()];
    c.lease_ttl = Duration::from_millis(10);
    assert_eq!(
        Directory::connect(c).unwrap_err().kind(),
        ErrorKind::InvalidArgument
    );
    // Nothing listens on port 1: the lookup fails cleanly within the request timeout.
    let mut c = ClusterConfig::new(vec!["127.0.0.1:1".into()]);
    c.request_timeout = Duration::from_secs(1);
    c.connect_timeout = Duration::from_millis(300);
    let d = Directory::connect(c).unwrap();
    let k = d
        .lookup(&store_util::ns(), &store_util::chain(2, 1))
        .unwrap_err()
        .kind();
    assert!(
        matches!(k, ErrorKind::PeerClosed | ErrorKind::Timeout),
        "{k:?}"
    );
    let a = store(4);
    assert_eq!(
        d.publish(&a, HostRecord::new("a/b", "x"))
            .unwrap_err()
            .kind(),
        ErrorKind::InvalidArgument
    );
}
