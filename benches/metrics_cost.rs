//! What metrics recording costs: the same workloads with `tpu_sync::metrics` on and off, run
//! interleaved round-robin (on, off, off, on, ...) over several rounds in one process; each round
//! gives a ratio `throughput(on) / throughput(off)` and the bench prints min / median / max of
//! those ratios per workload (target: median >= 0.98, `docs/observability.md`).
//!
//! Workloads, each chosen to record as many metrics per byte as the library ever does:
//! * `store`: host-tier put of a 16-block chain of 16 KiB blocks from host memory (evicting the
//!   previous chain), lookup, get back (every call records lookups, puts, gets, evictions);
//! * `device`: one D2H and one H2D batch of 64 copies of 16 KiB through the XLA CPU plugin (a
//!   histogram observation and counters per batch, the pacer's gauges);
//! * `net`: a 4 MiB pull over loopback TCP with 64 KiB chunks (a byte counter per chunk, a
//!   transfer started/completed/duration per pull, spans per stripe).
//!
//! Run: `cargo bench --bench metrics_cost` (`TPU_SYNC_BENCH_ROUNDS`, default 7).

#[path = "../tests/net_util/mod.rs"]
mod net_util;

use std::hint::black_box;
use std::time::{Duration, Instant};

use tpu_sync::device::{self, RawCopy};
use tpu_sync::pattern::mix64;
use tpu_sync::pjrt::{Capabilities, Client, ClientOptions, ElementType, Plugin};
use tpu_sync::store::{KvStore, Namespace, StoreConfig};

const BLOCK: usize = 16 << 10;

fn time_for(budget: Duration, mut f: impl FnMut()) -> f64 {
    // Iterations per second over at least `budget`.
    let t0 = Instant::now();
    let mut n = 0u64;
    while t0.elapsed() < budget {
        f();
        n += 1;
    }
    n as f64 / t0.elapsed().as_secs_f64()
}

fn rounds(name: &str, budget: Duration, mut f: impl FnMut()) -> (f64, f64, f64) {
    let n: usize = std::env::var("TPU_SYNC_BENCH_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(7);
    // Warm up both ways.
    for on in [true, false] {
        tpu_sync::metrics::set_enabled(on);
        time_for(budget / 4, &mut f);
    }
    let mut ratios = Vec::new();
    for r in 0..n {
        // Alternate which mode goes first, so drift does not favour one.
        let order = if r % 2 == 0 {
            [true, false]
        } else {
            [false, true]
        };
        let mut rate = [0.0; 2];
        for on in order {
            tpu_sync::metrics::set_enabled(on);
            rate[usize::from(on)] = time_for(budget, &mut f);
        }
        ratios.push(rate[1] / rate[0]);
    }
    tpu_sync::metrics::set_enabled(true);
    ratios.sort_by(|a, b| a.total_cmp(b));
    let (min, med, max) = (
        ratios[0],
        ratios[ratios.len() / 2],
        ratios[ratios.len() - 1],
    );
    println!(
        "metrics_cost {name:<7} on/off throughput ratio over {n} rounds: min {min:.3}  median {med:.3}  max {max:.3}"
    );
    (min, med, max)
}

fn store_workload() -> impl FnMut() {
    let ns = Namespace::new("bench metrics");
    let mut cfg = StoreConfig::new(ns.clone(), BLOCK as u64, (BLOCK * 32) as u64);
    cfg.memory.lock = false;
    let s = KvStore::open(cfg).expect("store");
    let src: Vec<Vec<u8>> = (0..16)
        .map(|b| {
            (0..BLOCK)
                .map(|i| mix64((b * BLOCK + i) as u64) as u8)
                .collect()
        })
        .collect();
    let mut dst: Vec<Vec<u8>> = (0..16).map(|_| vec![0u8; BLOCK]).collect();
    let mut round = 0u32;
    move || {
        round += 1;
        let toks: Vec<u32> = (0..256).map(|i| round.wrapping_mul(7919) ^ i).collect();
        let keys = ns.chain_keys(&toks, 16);
        let srcs: Vec<&[u8]> = src.iter().map(|v| v.as_slice()).collect();
        let p = s.put_from_host(None, &keys, &srcs).expect("put");
        black_box(p);
        black_box(s.lookup(&keys));
        let mut outs: Vec<&mut [u8]> = dst.iter_mut().map(|v| v.as_mut_slice()).collect();
        black_box(s.get_to_host(&keys, &mut outs).expect("get"));
    }
}

fn device_workload() -> impl FnMut() {
    let plugin =
        Plugin::load(&tpu_sync::pjrt::default_plugin_path().expect("make plugin")).expect("plugin");
    let client = Client::create(
        &plugin,
        &ClientOptions {
            cpu_device_count: Some(1),
        },
    )
    .expect("client");
    let caps = Capabilities::probe(&client).expect("caps");
    let n = 64 * BLOCK;
    let data: Vec<u8> = (0..n).map(|i| mix64(i as u64) as u8).collect();
    let dev = client.device(0).expect("device");
    let buf = client
        .buffer_from_host(&data, ElementType::U8, &[n as i64], &dev)
        .expect("buffer");
    let host = tpu_sync::arena::PinnedArena::new(n, &net_util::arena_opts()).expect("arena");
    let base = host.base();
    move || {
        let _keep = &host;
        let ops: Vec<RawCopy<'_>> = (0..64)
            .map(|i| RawCopy {
                buffer: &buf,
                offset: (i * BLOCK) as u64,
                len: BLOCK as u64,
                // SAFETY: inside the arena of `n` bytes.
                host: unsafe { base.add(i * BLOCK) },
            })
            .collect();
        // SAFETY: the arena outlives the calls and nothing else touches it.
        black_box(unsafe { device::d2h_batch(&ops, 0) }.expect("d2h"));
        // SAFETY: as above; nothing reads the buffer concurrently.
        black_box(unsafe { device::h2d_batch(&caps, &ops) }.expect("h2d"));
    }
}

fn main() {
    // `cargo bench` passes `--bench`; nothing to parse.
    let budget = Duration::from_millis(400);
    let results = [
        ("store", rounds("store", budget, store_workload())),
        ("device", rounds("device", budget, device_workload())),
        ("net", net_rounds(budget)),
    ];
    let worst = results.iter().map(|r| r.1 .1).fold(f64::INFINITY, f64::min);
    println!("metrics_cost worst median ratio {worst:.3} (target >= 0.98)");
}

fn net_rounds(budget: Duration) -> (f64, f64, f64) {
    use tpu_sync::net::{Endpoint, Security, TransportKind};
    let rt = net_util::runtime();
    let f = net_util::reshard_fixture(1, 1024, 9);
    let (prefill, decode, addr) = rt.block_on(async {
        let mut o = net_util::opts(TransportKind::Tcp, Security::None, "bench-prefill", true);
        o.chunk_bytes = 64 << 10;
        let prefill = Endpoint::bind(o).await.expect("bind");
        let mut o = net_util::opts(TransportKind::Tcp, Security::None, "bench-decode", false);
        o.chunk_bytes = 64 << 10;
        let decode = Endpoint::bind(o).await.expect("bind");
        let addr = prefill.local_addr().unwrap().to_string();
        (prefill, decode, addr)
    });
    let staging = net_util::dest_staging(&f.plan, &f.dst, None);
    let src_staging = net_util::source_staging(&f.src, f.tokens, None);
    let mut rid = 0u64;
    rounds("net", budget, || {
        rid += 1;
        rt.block_on(async {
            let _h = prefill
                .register_source(tpu_sync::net::SourceRegistration {
                    request_id: rid,
                    num_tokens: f.tokens,
                    placement: f.src.clone(),
                    staging: src_staging.clone(),
                    layers_ready: None,
                    expected_releases: 1,
                })
                .expect("register");
            let t = net_util::pull_fx(&decode, &f, rid, &addr, staging.clone());
            black_box(t.wait().await.expect("pull"));
            decode.release(&addr, rid).await.expect("release");
        });
    })
}
