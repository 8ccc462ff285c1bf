//! Load test of the cluster prefix directory against a real etcd on this machine (the numbers in
//! `docs/scaling.md`). Starts its own etcd (Debian's, `scripts/install-etcd.sh`) on a loopback
//! port in a temp dir, then measures, over ROUNDS rounds (min/median/max):
//!
//! * publish rate: STORES publishers, each storing BLOCKS blocks and publishing them (etcd
//!   transactions of 128 puts under a lease), timed until every publisher has synced;
//! * lookup rate: THREADS threads looking up 32-block chains that one host holds;
//! * bytes per entry: etcd's database size growth per published entry (after a defragment);
//! * the same with a publish stride of 4.
//!
//! Run: `cargo bench --bench cluster` (env CLUSTER_STORES, CLUSTER_BLOCKS, CLUSTER_ROUNDS,
//! CLUSTER_LOOKUP_SECS). Not part of `make test`.

#[path = "../tests/cluster_util/mod.rs"]
mod cluster_util;
#[path = "../tests/store_util/mod.rs"]
mod store_util;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tpu_sync::cluster::{ClusterConfig, Directory, HostRecord};
use tpu_sync::store::{BlockKey, KvStore};

fn env(n: &str, d: u64) -> u64 {
    std::env::var(n)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(d)
}

fn stats(mut v: Vec<f64>) -> String {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    format!(
        "min {:.0} / median {:.0} / max {:.0}",
        v[0],
        v[v.len() / 2],
        v[v.len() - 1]
    )
}

fn cfg(e: &cluster_util::Etcd, prefix: &str, stride: u32) -> ClusterConfig {
    let mut c = ClusterConfig::new(vec![e.endpoint()]);
    c.prefix = prefix.into();
    c.max_ops_per_sec = 10_000_000;
    c.publish_stride = stride;
    c.batch_interval = Duration::from_millis(5);
    c
}

fn store(blocks: u64) -> KvStore {
    KvStore::open(store_util::config(64, blocks + 16)).unwrap()
}

fn fill(s: &KvStore, chains: &[Vec<BlockKey>]) {
    let data = vec![7u8; 64];
    for c in chains {
        let refs: Vec<&[u8]> = c.iter().map(|_| data.as_slice()).collect();
        assert!(s.put_from_host(None, c, &refs).unwrap().complete());
    }
}

fn defrag_size(e: &cluster_util::Etcd, d: &Directory) -> i64 {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let mut c = etcd_client::Client::connect([e.endpoint()], None)
            .await
            .unwrap();
        // A fresh revision, so that compaction drops the tombstones of earlier deletes too.
        let rev = c
            .put("/bench-bump", "x", None)
            .await
            .unwrap()
            .header()
            .unwrap()
            .revision();
        c.compact(
            rev,
            Some(etcd_client::CompactionOptions::new().with_physical()),
        )
        .await
        .unwrap();
        c.defragment().await.unwrap();
    });
    d.db_size().unwrap()
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let Some(e) = cluster_util::Etcd::start_with(
        "cluster bench",
        "127.0.0.1",
        None,
        &["--quota-backend-bytes", "4294967296"],
    ) else {
        return;
    };
    let stores = env("CLUSTER_STORES", 4);
    let blocks = env("CLUSTER_BLOCKS", 20_000);
    let rounds = env("CLUSTER_ROUNDS", 3);
    let lookup_secs = env("CLUSTER_LOOKUP_SECS", 3);
    let threads = env("CLUSTER_THREADS", 4);
    println!(
        "etcd {} on 127.0.0.1; {stores} publishers x {blocks} blocks, {rounds} rounds",
        e.endpoint()
    );
    for stride in [1u32, 4] {
        let mut pub_rates = Vec::new();
        let mut per_store = Vec::new();
        let mut lookup_rates = Vec::new();
        let mut bytes_per_entry = Vec::new();
        for round in 0..rounds {
            let prefix = format!("/bench/s{stride}r{round}");
            let d = Directory::connect(cfg(&e, &prefix, stride)).unwrap();
            let before = defrag_size(&e, &d);
            let sts: Vec<KvStore> = (0..stores).map(|_| store(blocks)).collect();
            let chains: Vec<Vec<Vec<BlockKey>>> = (0..stores)
                .map(|s| {
                    (0..blocks / 32)
                        .map(|c| store_util::chain(32, (round * 1000 + s) << 20 | c))
                        .collect()
                })
                .collect();
            let t0 = Instant::now();
            let pubs: Vec<_> = sts
                .iter()
                .enumerate()
                .map(|(i, s)| {
                    d.publish(
                        s,
                        HostRecord::new(format!("host-{i}"), format!("h{i}:7800")),
                    )
                    .unwrap()
                })
                .collect();
            std::thread::scope(|sc| {
                for (s, c) in sts.iter().zip(&chains) {
                    sc.spawn(move || fill(s, c));
                }
            });
            for p in &pubs {
                p.sync(Duration::from_secs(600)).unwrap();
            }
            let secs = t0.elapsed().as_secs_f64();
            let entries: u64 = pubs.iter().map(|p| p.stats().live_entries).sum();
            pub_rates.push(entries as f64 / secs);
            per_store.push(entries as f64 / secs / stores as f64);
            let after = defrag_size(&e, &d);
            bytes_per_entry.push((after - before) as f64 / entries as f64);
            // Lookups of chains host-0 holds, from several threads.
            let stop = Arc::new(AtomicBool::new(false));
            let n = Arc::new(AtomicU64::new(0));
            let ns = store_util::ns();
            let t1 = Instant::now();
            std::thread::scope(|sc| {
                for t in 0..threads {
                    let (stop, n, d, ns, c0) =
                        (stop.clone(), n.clone(), d.clone(), &ns, &chains[0]);
                    sc.spawn(move || {
                        let mut i = t as usize;
                        while !stop.load(Ordering::Relaxed) {
                            let r = d.lookup(ns, &c0[i % c0.len()]).unwrap();
                            assert_eq!(r.len(), 1);
                            assert_eq!(r[0].blocks, 32);
                            n.fetch_add(1, Ordering::Relaxed);
                            i += threads as usize;
                        }
                    });
                }
                std::thread::sleep(Duration::from_secs(lookup_secs));
                stop.store(true, Ordering::Relaxed);
            });
            lookup_rates.push(n.load(Ordering::Relaxed) as f64 / t1.elapsed().as_secs_f64());
            drop(pubs);
            let _ = d.wipe();
        }
        println!("stride {stride}:");
        println!("  publish, entries/s all publishers: {}", stats(pub_rates));
        println!("  publish, entries/s per publisher:  {}", stats(per_store));
        println!(
            "  lookups/s of 32-block chains ({threads} threads): {}",
            stats(lookup_rates)
        );
        println!(
            "  etcd db bytes per entry (defragmented): {}",
            stats(bytes_per_entry)
        );
    }
}
