//! The host KV tier against `memcpy` of the same bytes in the same run, and its lookup latency
//! with 1M resident blocks.
//!
//! * `store_copy`: one chain of 256 blocks of 256 KiB (64 MiB) per iteration. `memcpy` copies the
//!   256 blocks from a pinned arena (the memory the store's slots are made of) into the same host
//!   destination buffers the gets use; `put_host` stores a fresh chain (evicting the previous
//!   one, checksumming every block, committing every slot); `get_host` and `get_host_noverify`
//!   copy the resident chain out with and without checksum verification. The ratio (time /
//!   memcpy time) is printed at the end.
//! * `store_lookup_1m`: 1,048,576 resident blocks (8192 chains of 128, SGLang's batch size) of
//!   64 bytes; `lookup` of a whole 128-block chain, of its first block, and of a missing chain.
//!   Nanoseconds per call and per block are printed at the end.
//!
//! Run: `cargo bench --bench store` (or `make bench`).

use std::cell::Cell;
use std::hint::black_box;
use std::time::Duration;

use criterion::{criterion_group, Criterion, Throughput};
use tpu_sync::arena::{ArenaOptions, PinnedArena};
use tpu_sync::pattern::mix64;
use tpu_sync::store::{BlockKey, KvStore, Namespace, StoreConfig};

const BLOCK: usize = 256 << 10;
const BLOCKS: usize = 256;
const LOOKUP_CHAINS: u64 = 8192;
const CHAIN: usize = 128;

fn ns() -> Namespace {
    Namespace::new("bench llama-3.1-8b bf16 tp=1 block=16")
}

fn keys(seed: u64, n: usize) -> Vec<BlockKey> {
    let toks: Vec<u32> = (0..n as u64 * 16)
        .map(|i| mix64(seed << 32 ^ i) as u32)
        .collect();
    ns().chain_keys(&toks, 16)
}

fn bench_copy(c: &mut Criterion) {
    let mut cfg = StoreConfig::new(ns(), BLOCK as u64, (BLOCK * BLOCKS) as u64);
    cfg.memory = ArenaOptions::default();
    let store = KvStore::open(cfg).expect("store");
    let mut cfg = StoreConfig::new(ns(), BLOCK as u64, (BLOCK * BLOCKS) as u64);
    cfg.verify_checksums = false;
    let noverify = KvStore::open(cfg).expect("store");
    let src: Vec<Vec<u8>> = (0..BLOCKS)
        .map(|b| {
            (0..BLOCK)
                .map(|i| mix64((b * BLOCK + i) as u64) as u8)
                .collect()
        })
        .collect();
    let srcs: Vec<&[u8]> = src.iter().map(|v| v.as_slice()).collect();
    let mut dst: Vec<Vec<u8>> = (0..BLOCKS).map(|_| vec![1u8; BLOCK]).collect();
    let resident = keys(1, BLOCKS);
    assert!(store
        .put_from_host(None, &resident, &srcs)
        .unwrap()
        .complete());
    assert!(noverify
        .put_from_host(None, &resident, &srcs)
        .unwrap()
        .complete());

    let mut g = c.benchmark_group("store_copy");
    g.throughput(Throughput::Bytes((BLOCK * BLOCKS) as u64));
    g.sample_size(10);
    g.measurement_time(Duration::from_secs(4));
    g.warm_up_time(Duration::from_secs(1));
    // The baseline reads from the same kind of memory as the store's slots (a pinned arena, on
    // transparent huge pages where the kernel allows) into the same destinations.
    let arena = PinnedArena::new(BLOCK * BLOCKS, &ArenaOptions::default()).expect("arena");
    for (i, s) in src.iter().enumerate() {
        // SAFETY: exclusive access during setup; in bounds.
        unsafe { arena.slice_mut((i * BLOCK) as u64, BLOCK as u64) }
            .unwrap()
            .copy_from_slice(s);
    }
    g.bench_function("memcpy", |b| {
        b.iter(|| {
            for (i, d) in dst.iter_mut().enumerate() {
                // SAFETY: nobody writes the arena while the benchmark reads it.
                d.copy_from_slice(
                    unsafe { arena.slice((i * BLOCK) as u64, BLOCK as u64) }.unwrap(),
                );
            }
            black_box(&dst);
        })
    });
    let round = Cell::new(100u64);
    let scratch = {
        let mut cfg = StoreConfig::new(ns(), BLOCK as u64, (BLOCK * BLOCKS) as u64);
        cfg.memory = ArenaOptions::default();
        KvStore::open(cfg).expect("store")
    };
    g.bench_function("put_host", |b| {
        b.iter(|| {
            round.set(round.get() + 1);
            let k = keys(round.get(), BLOCKS);
            let r = scratch.put_from_host(None, &k, &srcs).unwrap();
            assert_eq!(r.stored, BLOCKS);
        })
    });
    g.bench_function("get_host", |b| {
        b.iter(|| {
            let mut d: Vec<&mut [u8]> = dst.iter_mut().map(|v| v.as_mut_slice()).collect();
            let r = store.get_to_host(&resident, &mut d).unwrap();
            assert_eq!(r.delivered, BLOCKS);
        })
    });
    g.bench_function("get_host_noverify", |b| {
        b.iter(|| {
            let mut d: Vec<&mut [u8]> = dst.iter_mut().map(|v| v.as_mut_slice()).collect();
            let r = noverify.get_to_host(&resident, &mut d).unwrap();
            assert_eq!(r.delivered, BLOCKS);
        })
    });
    g.finish();
    assert!(dst.iter().zip(&src).all(|(d, s)| d == s));
}

fn bench_lookup(c: &mut Criterion) {
    let n = LOOKUP_CHAINS as usize * CHAIN;
    let mut cfg = StoreConfig::new(ns(), 64, 64 * n as u64);
    cfg.memory = ArenaOptions {
        lock: false,
        huge_pages: true,
        populate: true,
    };
    let store = KvStore::open(cfg).expect("store");
    let data = vec![7u8; 64];
    let blocks: Vec<&[u8]> = (0..CHAIN).map(|_| data.as_slice()).collect();
    for ch in 0..LOOKUP_CHAINS {
        let k = keys(1_000_000 + ch, CHAIN);
        assert!(store.put_from_host(None, &k, &blocks).unwrap().complete());
    }
    assert_eq!(store.stats().dram_blocks, n as u64);
    let probe: Vec<Vec<BlockKey>> = (0..64)
        .map(|i| keys(1_000_000 + i * 97 % LOOKUP_CHAINS, CHAIN))
        .collect();
    let missing = keys(7, CHAIN);
    let mut g = c.benchmark_group("store_lookup_1m");
    g.sample_size(30);
    g.measurement_time(Duration::from_secs(3));
    let i = Cell::new(0usize);
    g.bench_function("chain_128", |b| {
        b.iter(|| {
            i.set((i.get() + 1) % probe.len());
            assert_eq!(store.lookup(black_box(&probe[i.get()])), CHAIN);
        })
    });
    g.bench_function("chain_1", |b| {
        b.iter(|| {
            i.set((i.get() + 1) % probe.len());
            assert_eq!(store.lookup(black_box(&probe[i.get()][..1])), 1);
        })
    });
    g.bench_function("miss", |b| {
        b.iter(|| assert_eq!(store.lookup(black_box(&missing)), 0))
    });
    g.finish();
}

fn estimate(group: &str, id: &str) -> Option<f64> {
    let dir = std::env::var("CARGO_TARGET_DIR")
        .unwrap_or_else(|_| format!("{}/target", env!("CARGO_MANIFEST_DIR")));
    let p = format!("{dir}/criterion/{group}/{id}/new/estimates.json");
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(p).ok()?).ok()?;
    v["mean"]["point_estimate"].as_f64()
}

fn report() {
    let gb = (BLOCK * BLOCKS) as f64 / 1e9;
    if let Some(m) = estimate("store_copy", "memcpy") {
        println!(
            "\nhost KV tier against memcpy of the same {} MiB in this run (time / memcpy time):",
            (BLOCK * BLOCKS) >> 20
        );
        println!("  memcpy                 {:6.2} GB/s", gb / (m * 1e-9));
        for (id, what) in [
            ("put_host", "put (copy + xxh3 + commit, evicting)"),
            ("get_host", "get (copy + xxh3 verify)"),
            ("get_host_noverify", "get (copy, generation check only)"),
        ] {
            if let Some(t) = estimate("store_copy", id) {
                println!(
                    "  {what:<38} {:6.2} GB/s  ratio {:.2}",
                    gb / (t * 1e-9),
                    t / m
                );
            }
        }
    }
    let n = LOOKUP_CHAINS as usize * CHAIN;
    println!("\nlookup latency with {n} resident blocks:");
    for (id, blocks) in [("chain_128", CHAIN), ("chain_1", 1), ("miss", 1)] {
        if let Some(t) = estimate("store_lookup_1m", id) {
            println!(
                "  {id:<10} {:8.0} ns per call, {:6.1} ns per block",
                t,
                t / blocks as f64
            );
        }
    }
}

criterion_group!(benches, bench_copy, bench_lookup);

fn main() {
    benches();
    Criterion::default().configure_from_args().final_summary();
    report();
}
