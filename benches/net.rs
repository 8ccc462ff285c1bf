//! Network data plane over loopback against one raw TCP socket moving the same bytes in the same
//! run, both directions (decode-initiated pull and prefill-initiated push), TCP and QUIC.
//!
//! A "block" of N bytes is one request whose KV is N bytes: llama-3.1-8b geometry cut to one
//! layer (4 KiB per token: 2 planes x 8 KV heads x 128 x bf16), TP=1 on both sides, 16-token
//! blocks at scattered block ids, so a transfer is N / 64 KiB spans of 64 KiB (real KV pieces, not
//! one flat buffer). Sizes: 64 KiB, 1 MiB, 16 MiB, 64 MiB. Baseline `raw_tcp`: one connected
//! tokio socket pair (TCP_NODELAY), N bytes written from one buffer and read into another, then a
//! 1-byte acknowledgement (so both sides measure a completed transfer, as `Transfer::wait` does).
//!
//! Both sides plan before the timed loop (`plan: Some(..)`), as a serving engine plans once per
//! request: planning a 64 MiB single-layer block (16,384 tokens x 8 heads x 2 planes of rows)
//! takes ~36 ms on this machine, comparable to moving it, and is the planner's cost, not the
//! network's. The producer caches its plan per puller.
//!
//! `pipeline_tcp` is what an engine does per request through `tpu_sync::transfer`: a pull from
//! the producer's registered device blocks into the consumer's device buffers (check, plan,
//! pinned staging reserved from the budget and DMA-map attempt, the network, H2D in place, the
//! delivering release), device buffers of the XLA CPU plugin on both sides; the producer
//! registered (and staged, D2H) once, as `pull_tcp`'s does.
//!
//! At the end it prints, from criterion's estimates of this run: GB/s and the ratio to raw TCP
//! of every variant (1.00 = one raw socket's speed), pull/push ratios (the target: pull within
//! 10% of push), and the median latency of a 16 KiB block (no fixed per-transfer floor: compare
//! with the raw socket's round trip).
//!
//! Run: `make bench-net` or `cargo bench --bench net`; `TPU_SYNC_BENCH_STREAMS` (default 2) and
//! `TPU_SYNC_BENCH_CHUNK` (bytes, default 1 MiB) change the endpoints' stripes per pair and chunk
//! size.

use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{Criterion, Throughput};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tpu_sync::arena::ArenaOptions;
use tpu_sync::layout::{ModelKv, ParallelLayout, ParallelSpec};
use tpu_sync::net::tls::generate_test_pki;
use tpu_sync::net::{
    Endpoint, EndpointOptions, PeerMap, PullRequest, PushRequest, Security, SinkRegistration,
    SourceRegistration, TransportKind,
};
use tpu_sync::pjrt::{Capabilities, Client, ClientOptions, DeviceBuffer, Plugin};
use tpu_sync::plan::{Placement, Plan};
use tpu_sync::staging::Staging;
use tpu_sync::transfer::{KvBuffers, Offer, Pipeline, PullInto, TransferOptions};

const SIZES: &[(u64, &str)] = &[
    (64 << 10, "64KiB"),
    (1 << 20, "1MiB"),
    (16 << 20, "16MiB"),
    (64 << 20, "64MiB"),
];

fn arena() -> ArenaOptions {
    ArenaOptions {
        lock: false,
        huge_pages: true,
        populate: true,
    }
}

struct Case {
    src: Placement,
    dst: Placement,
    tokens: u32,
    src_st: Arc<Staging>,
    plan: Arc<Plan>,
}

fn case(bytes: u64) -> Case {
    let mut m = ModelKv::preset("llama-3.1-8b").unwrap();
    m.num_layers = 1;
    let tokens = (bytes / m.bytes_per_token()) as u32;
    let spec = ParallelSpec::parse("tp=1,block=16").unwrap();
    let blocks = tokens.div_ceil(16);
    let l = ParallelLayout::new(m, spec, blocks * 2 + 3).unwrap();
    let ids = |seed: u32| -> Vec<u32> {
        // Scattered: every other block, rotated.
        (0..blocks)
            .map(|i| (i * 2 + seed) % (blocks * 2 + 3))
            .collect()
    };
    let src = Placement {
        first_token: 0,
        layout: l.clone(),
        dp_rank: 0,
        block_ids: vec![ids(1)],
        groups: None,
    };
    let dst = Placement {
        first_token: 0,
        layout: l,
        dp_rank: 0,
        block_ids: vec![ids(2)],
        groups: None,
    };
    let ranges = [(0u32, src.block_ranges(0))].into_iter().collect();
    let src_st = Arc::new(Staging::new(ranges, &arena()).unwrap());
    let plan = Arc::new(Plan::build(&src, &dst, tokens).unwrap());
    assert_eq!(plan.total_bytes(), bytes);
    Case {
        src,
        dst,
        tokens,
        src_st,
        plan,
    }
}

/// A numeric setting from the environment (to compare stream counts and chunk sizes).
fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

struct Pair {
    prefill: Endpoint,
    decode: Endpoint,
}

async fn pair(kind: TransportKind, dir: &std::path::Path) -> Pair {
    let o = |name: &str| EndpointOptions {
        name: name.into(),
        transport: kind,
        security: Security::None,
        listen: Some("127.0.0.1:0".parse().unwrap()),
        lease_ttl: Duration::from_secs(3600),
        streams_per_pair: env_u64("TPU_SYNC_BENCH_STREAMS", 2) as u32,
        chunk_bytes: env_u64("TPU_SYNC_BENCH_CHUNK", 1 << 20),
        ..EndpointOptions::default()
    };
    // Both sides need certificates of the same CA: generate once, use for both.
    let (po, dopt) = if kind == TransportKind::Tcp {
        (o("prefill"), o("decode"))
    } else {
        let pki = generate_test_pki(&dir.join(kind.name()), &["prefill", "decode"]).unwrap();
        let mut a = o("prefill");
        let mut b = o("decode");
        a.security = pki.security("prefill").unwrap();
        b.security = pki.security("decode").unwrap();
        (a, b)
    };
    Pair {
        prefill: Endpoint::bind(po).await.unwrap(),
        decode: Endpoint::bind(dopt).await.unwrap(),
    }
}

async fn pull_once(p: &Pair, c: &Case, dst_st: &Arc<Staging>, rid: u64) {
    let t = p
        .decode
        .pull(PullRequest {
            request_id: rid,
            num_tokens: c.tokens,
            src: c.src.clone(),
            sources: PeerMap::single(p.prefill.local_addr().unwrap().to_string()),
            dst: c.dst.clone(),
            staging: dst_st.clone(),
            dst_ranks: None,
            plan: Some(c.plan.clone()),
            wait_for_registration: None,
        })
        .unwrap();
    t.wait().await.unwrap();
}

async fn push_once(p: &Pair, c: &Case, dst_st: &Arc<Staging>, rid: u64) {
    let sink = p
        .decode
        .expect_push(SinkRegistration {
            request_id: rid,
            num_tokens: c.tokens,
            placement: c.dst.clone(),
            staging: dst_st.clone(),
            dst_ranks: None,
            src: Some(c.src.clone()),
            plan: Some(c.plan.clone()),
        })
        .unwrap();
    let t = p
        .prefill
        .push(PushRequest {
            request_id: rid,
            num_tokens: c.tokens,
            src: c.src.clone(),
            staging: c.src_st.clone(),
            src_ranks: None,
            dst: c.dst.clone(),
            targets: PeerMap::single(p.decode.local_addr().unwrap().to_string()),
            layers_ready: None,
            plan: Some(c.plan.clone()),
        })
        .unwrap();
    t.wait().await.unwrap();
    sink.wait().await.unwrap();
}

struct Raw {
    tx: tokio::net::TcpStream,
    rx: tokio::net::TcpStream,
    send_buf: Vec<u8>,
    recv_buf: Vec<u8>,
}

async fn raw(max: usize) -> Raw {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let a = l.local_addr().unwrap();
    let (tx, rx) = tokio::join!(tokio::net::TcpStream::connect(a), l.accept());
    let (tx, rx) = (tx.unwrap(), rx.unwrap().0);
    tx.set_nodelay(true).unwrap();
    rx.set_nodelay(true).unwrap();
    Raw {
        tx,
        rx,
        send_buf: (0..max).map(|i| (i * 7 + 1) as u8).collect(),
        recv_buf: vec![0u8; max],
    }
}

async fn raw_once(r: &mut Raw, n: usize) {
    let Raw {
        tx,
        rx,
        send_buf,
        recv_buf,
    } = r;
    let send = async {
        tx.write_all(&send_buf[..n]).await.unwrap();
        let mut ack = [0u8; 1];
        tx.read_exact(&mut ack).await.unwrap();
    };
    let recv = async {
        rx.read_exact(&mut recv_buf[..n]).await.unwrap();
        rx.write_all(&[1]).await.unwrap();
    };
    tokio::join!(send, recv);
}

fn estimate(group: &str, id: &str, stat: &str) -> Option<f64> {
    let dir = std::env::var("CARGO_TARGET_DIR").unwrap_or_else(|_| "target".into());
    let p = format!("{dir}/criterion/{group}/{id}/new/estimates.json");
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(p).ok()?).ok()?;
    v[stat]["point_estimate"].as_f64()
}

const VARIANTS: &[&str] = &[
    "raw_tcp",
    "pull_tcp",
    "push_tcp",
    "pull_quic",
    "push_quic",
    "pipeline_tcp",
];

/// Two pipelines over TCP and a two-device CPU client for `pipeline_tcp`.
struct Pipe {
    prefill: Pipeline,
    decode: Pipeline,
    client: Client,
    caps: Capabilities,
}

async fn pipe() -> Pipe {
    let o = |name: &str| EndpointOptions {
        name: name.into(),
        listen: Some("127.0.0.1:0".parse().unwrap()),
        lease_ttl: Duration::from_secs(3600),
        streams_per_pair: env_u64("TPU_SYNC_BENCH_STREAMS", 2) as u32,
        chunk_bytes: env_u64("TPU_SYNC_BENCH_CHUNK", 1 << 20),
        ..EndpointOptions::default()
    };
    let t = || TransferOptions {
        arena: arena(),
        staging_budget_bytes: Some(4 << 30),
        ..TransferOptions::default()
    };
    let plugin = Plugin::load_default().expect("PJRT plugin (run `make plugin`)");
    let client = Client::create(
        &plugin,
        &ClientOptions {
            cpu_device_count: Some(2),
        },
    )
    .unwrap();
    let caps = Capabilities::probe(&client).unwrap();
    Pipe {
        prefill: Pipeline::bind(o("pipe-prefill"), t()).await.unwrap(),
        decode: Pipeline::bind(o("pipe-decode"), t()).await.unwrap(),
        client,
        caps,
    }
}

/// One rank's layer buffers of `place`'s layout on `device`, filled with a byte pattern.
fn device_kv(p: &Pipe, place: &Placement, device: usize) -> KvBuffers {
    let kv = place.layout.rank_kv().unwrap();
    let host: Vec<u8> = (0..kv.buffer_bytes()).map(|i| (i * 7 + 1) as u8).collect();
    let dev = p.client.device(device).unwrap();
    let bufs: Vec<DeviceBuffer> = (0..kv.num_layers)
        .map(|_| {
            p.client
                .buffer_from_host(&host, kv.dtype.element_type(), &kv.dims(), &dev)
                .unwrap()
        })
        .collect();
    KvBuffers::new(&p.caps, [(0, bufs)].into_iter().collect()).unwrap()
}

async fn pipeline_once(p: &Pipe, c: &Case, dst: &KvBuffers, rid: u64) {
    p.decode
        .pull(PullInto {
            request_id: rid,
            num_tokens: c.tokens,
            src: c.src.clone(),
            sources: PeerMap::single(p.prefill.endpoint().local_addr().unwrap().to_string()),
            dst: c.dst.clone(),
            kv: dst.clone(),
            wait_for_registration: None,
        })
        .unwrap()
        .wait()
        .await
        .unwrap();
}

fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let dir = std::env::temp_dir().join(format!("tpu-sync-bench-net-{}", std::process::id()));
    let tcp = rt.block_on(pair(TransportKind::Tcp, &dir));
    let quic = rt.block_on(pair(TransportKind::Quic, &dir));
    let pipe = rt.block_on(pipe());
    let mut raw_pair = rt.block_on(raw(64 << 20));
    let mut c = Criterion::default().configure_from_args();
    let rid = std::cell::Cell::new(1u64);
    let next = || {
        rid.set(rid.get() + 1);
        rid.get()
    };
    let mut sizes: Vec<(u64, String)> = SIZES.iter().map(|(b, n)| (*b, n.to_string())).collect();
    sizes.push((16 << 10, "16KiB".into()));
    for (bytes, name) in &sizes {
        let cs = case(*bytes);
        let dst_st = Arc::new(
            Staging::new(tpu_sync::net::plan_staging(&cs.plan, &cs.dst), &arena()).unwrap(),
        );
        let reg = next();
        for p in [&tcp, &quic] {
            p.prefill
                .register_source(SourceRegistration {
                    request_id: reg,
                    num_tokens: cs.tokens,
                    placement: cs.src.clone(),
                    staging: cs.src_st.clone(),
                    layers_ready: None,
                    expected_releases: 1,
                })
                .unwrap();
        }
        // The pipeline's producer registers device blocks once; every pull releases (delivers)
        // it, so it expects as many releases as there can be iterations.
        let src_kv = device_kv(&pipe, &cs.src, 0);
        let dst_kv = device_kv(&pipe, &cs.dst, 1);
        {
            let _g = rt.enter();
            pipe.prefill
                .offer(Offer {
                    request_id: reg,
                    num_tokens: cs.tokens,
                    placement: cs.src.clone(),
                    kv: src_kv,
                    expected_releases: u32::MAX,
                })
                .unwrap();
        }
        let group = format!("net_{name}");
        let mut g = c.benchmark_group(&group);
        g.throughput(Throughput::Bytes(*bytes));
        let big = *bytes >= 16 << 20;
        g.sample_size(10);
        g.warm_up_time(Duration::from_millis(if big { 1000 } else { 300 }));
        g.measurement_time(Duration::from_secs(if big { 4 } else { 2 }));
        for v in VARIANTS {
            g.bench_function(*v, |b| {
                b.iter_custom(|iters| {
                    rt.block_on(async {
                        let t0 = Instant::now();
                        for _ in 0..iters {
                            match *v {
                                "raw_tcp" => raw_once(&mut raw_pair, *bytes as usize).await,
                                "pull_tcp" => pull_once(&tcp, &cs, &dst_st, reg).await,
                                "push_tcp" => push_once(&tcp, &cs, &dst_st, next()).await,
                                "pull_quic" => pull_once(&quic, &cs, &dst_st, reg).await,
                                "push_quic" => push_once(&quic, &cs, &dst_st, next()).await,
                                "pipeline_tcp" => pipeline_once(&pipe, &cs, &dst_kv, reg).await,
                                _ => unreachable!(),
                            }
                        }
                        t0.elapsed()
                    })
                })
            });
        }
        g.finish();
    }
    c.final_summary();
    let _ = std::fs::remove_dir_all(&dir);

    println!("\nthroughput, and ratio to one raw TCP socket moving the same bytes in this run (1.00 = raw socket speed):");
    println!(
        "  {:<7} {:>16} {:>16} {:>16} {:>16} {:>16} {:>16}   pull/push tcp  quic",
        "block", "raw_tcp", "pull_tcp", "push_tcp", "pull_quic", "push_quic", "pipeline_tcp"
    );
    for (bytes, name) in &sizes {
        let group = format!("net_{name}");
        let t: Vec<Option<f64>> = VARIANTS
            .iter()
            .map(|v| estimate(&group, v, "mean"))
            .collect();
        let Some(raw_ns) = t[0] else { continue };
        let cell = |x: Option<f64>| match x {
            Some(ns) => format!("{:.2} GB/s {:>4.2}", *bytes as f64 / ns, raw_ns / ns),
            None => "-".into(),
        };
        let pp = |a: Option<f64>, b: Option<f64>| match (a, b) {
            (Some(a), Some(b)) => format!("{:.2}", b / a),
            _ => "-".into(),
        };
        println!(
            "  {:<7} {:>16} {:>16} {:>16} {:>16} {:>16} {:>16}   {:>13} {:>5}",
            name,
            cell(t[0]),
            cell(t[1]),
            cell(t[2]),
            cell(t[3]),
            cell(t[4]),
            cell(t[5]),
            pp(t[1], t[2]),
            pp(t[3], t[4])
        );
    }
    println!("  (pull/push = pull throughput / push throughput; the target is >= 0.90)");
    println!("\nmedian latency of one 16 KiB block (no fixed per-transfer floor: compare with the raw round trip):");
    for v in VARIANTS {
        if let Some(ns) = estimate("net_16KiB", v, "median") {
            println!("  {v:<10} {:>8.1} us", ns / 1e3);
        }
    }
}
