//! Soak (`make soak`, `SOAK_SECONDS`, default 120; not part of `make test`): many concurrent
//! pulls and pushes over TCP, TLS and QUIC with random layouts, a random fault on a third of the
//! requests (fault-injecting transport, `tests/fault_util`), producers killed and restarted at
//! new addresses, and every received request stored into a small host KV tier under random gets,
//! failing gets and evictions.
//!
//! Checked throughout: every successful transfer is byte-exact, every request with a fatal fault
//! fails with an explicit error within its bound (a benign one succeeds), a failed pull is served
//! again by its producer (nothing stored lost), every block the store delivers is the block that
//! was put, a failing get loses nothing. Resources (RSS, fds, sockets, threads, locked memory,
//! mappings) are sampled and printed as a table; over the last half they must stay within fixed
//! slacks of the first half's maximum (see the bounds), and after shutdown return to the start
//! baseline.

mod fault_util;
mod net_util;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use fault_util::*;
use net_util::*;
use tpu_sync::layout::ModelKv;
use tpu_sync::net::{
    Endpoint, EndpointOptions, PeerMap, PullRequest, PushRequest, SinkRegistration,
    SourceRegistration, TransportKind,
};
use tpu_sync::pattern::mix64;
use tpu_sync::plan::Plan;
use tpu_sync::staging::Staging;
use tpu_sync::store::{BlockKey, KvStore, Namespace, StoreConfig};
use tpu_sync::Error;

/// Bound on one request's outcome (faults included; io_timeout is 1 s).
const BOUND: Duration = Duration::from_secs(10);
/// Concurrent request loops.
const WORKERS: usize = 8;
/// Store block size: received requests are stored in blocks of this many bytes.
const STORE_BLOCK: usize = 64 << 10;

/// Layout pairs requests are drawn from: (model, prefill spec, decode spec, decode DP ranks).
fn layouts() -> Vec<(ModelKv, &'static str, &'static str, u32)> {
    let llama = model(2);
    let mut mla = ModelKv::preset("deepseek-v3").unwrap();
    mla.num_layers = 2;
    vec![
        (llama.clone(), "tp=2,block=16", "tp=1,block=32,order=hnd", 1),
        (llama.clone(), "tp=1,block=16", "tp=2,block=16", 1),
        (llama.clone(), "pcp=2,block=16", "tp=1,block=64", 1),
        (
            llama.clone(),
            "tp=4,block=16",
            "tp=1,dp=2,block=16,order=hnd",
            2,
        ),
        (llama, "tp=2,pcp=2,block=32", "tp=2,block=16", 1),
        (mla, "tp=2,block=64", "tp=1,block=16,order=hnd", 1),
    ]
}

/// Faults drawn for a third of the requests: (name, on the producer?, rule for request `r` of a
/// pull or a push, fatal).
type MakeRule = fn(u64, bool) -> Rule;
fn faults() -> Vec<(&'static str, bool, MakeRule, bool)> {
    vec![
        (
            "corrupt",
            false,
            |r, _| Rule::nth(Point::Recv(FrameSel::data(r)), 1, Action::Corrupt),
            true,
        ),
        (
            "truncate",
            false,
            |r, _| Rule::once(Point::Recv(FrameSel::data(r)), Action::Truncate),
            true,
        ),
        (
            "drop lane",
            false,
            |r, _| Rule::nth(Point::Recv(FrameSel::data(r)), 1, Action::DropLane),
            true,
        ),
        (
            "stall",
            false,
            |r, _| Rule::once(Point::Recv(FrameSel::data(r)), Action::Stall),
            true,
        ),
        (
            "failed answer",
            true,
            |r, push| {
                if push {
                    Rule::once(
                        Point::Recv(FrameSel::msg_of("stream_ack", r)),
                        Action::ReplaceWithFailed,
                    )
                } else {
                    Rule::once(
                        Point::Send(FrameSel::msg_of("stream_done", r)),
                        Action::ReplaceWithFailed,
                    )
                }
            },
            true,
        ),
        (
            "failed submit",
            true,
            |r, push| {
                let m = if push { "push" } else { "stream_done" };
                Rule::once(Point::Send(FrameSel::msg_of(m, r)), Action::Fail)
            },
            true,
        ),
        (
            "delay",
            false,
            |r, _| {
                Rule::nth(
                    Point::Recv(FrameSel::data(r)),
                    1,
                    Action::Delay(Duration::from_millis(40)),
                )
            },
            false,
        ),
    ]
}

struct Producer {
    ep: Arc<Endpoint>,
    faults: Arc<Faults>,
    epoch: u64,
}

struct Side {
    kind: TransportKind,
    name: String,
    consumer: Arc<Endpoint>,
    consumer_faults: Arc<Faults>,
    producer: RwLock<Producer>,
}

#[derive(Default)]
struct Counts {
    ops: AtomicU64,
    ok: AtomicU64,
    failed_as_expected: AtomicU64,
    failed_by_restart: AtomicU64,
    retries_ok: AtomicU64,
    bytes_verified: AtomicU64,
    restarts: AtomicU64,
    store_puts: AtomicU64,
    store_gets: AtomicU64,
    store_blocks_checked: AtomicU64,
    store_failing_gets: AtomicU64,
    store_removes: AtomicU64,
}

struct World {
    pki: Pki,
    sides: Vec<Side>,
    store: KvStore,
    ns: Namespace,
    /// Length and checksum of every block key of the chains below.
    ledger: Mutex<HashMap<BlockKey, (usize, u64)>>,
    /// The last chains stored (for random gets and removes).
    chains: Mutex<std::collections::VecDeque<Vec<BlockKey>>>,
    counts: Counts,
    next_rid: AtomicU64,
    stop: AtomicBool,
}

fn options(kind: TransportKind, pki: &Pki, name: &str) -> EndpointOptions {
    let mut o = opts(kind, security(kind, pki, name), name, true);
    o.io_timeout = Duration::from_secs(1);
    o.heartbeat_timeout = Duration::from_secs(3);
    // A push registration whose sender died before reaching it fails after this.
    o.lease_ttl = Duration::from_secs(3);
    o.chunk_bytes = 32 << 10;
    o
}

struct Rng(u64);
impl Rng {
    fn next(&mut self, m: u64) -> u64 {
        self.0 = mix64(self.0);
        self.0 % m.max(1)
    }
}

/// The bytes of `st` (every staged range in order), i.e. what the request delivered.
fn staged(st: &Staging) -> Vec<u8> {
    let mut v = Vec::new();
    for r in st.ranks() {
        for s in st.ranges(r) {
            let p = st
                .resolve(r, s.range.buffer, s.range.offset, s.range.len)
                .unwrap();
            // SAFETY: the transfer finished; nothing writes the staging.
            v.extend_from_slice(unsafe { std::slice::from_raw_parts(p, s.range.len as usize) });
        }
    }
    v
}

/// One request on side `s`: a pull or a push with random layout and maybe a fault.
async fn one_request(w: &World, s: &Side, rng: &mut Rng) {
    let ls = layouts();
    let (m, ps, ds, dps) = &ls[rng.next(ls.len() as u64) as usize];
    let tokens = 32 + rng.next(400) as u32;
    let rid = w.next_rid.fetch_add(1, Ordering::Relaxed);
    let src = placement(layout(m, ps, tokens), 0, tokens, rid);
    let dst = placement(
        layout(m, ds, tokens),
        rng.next(*dps as u64) as u32,
        tokens,
        rid ^ 7,
    );
    let plan = Arc::new(Plan::build(&src, &dst, tokens).unwrap());
    let push = rng.next(2) == 1;
    let fs = faults();
    let fault = (rng.next(3) == 0).then(|| &fs[rng.next(fs.len() as u64) as usize]);
    let (prod, pf, epoch) = {
        let p = s.producer.read().unwrap();
        (p.ep.clone(), p.faults.clone(), p.epoch)
    };
    if let Some((_, on_producer, rule, _)) = fault {
        let target = if *on_producer {
            &pf
        } else {
            &s.consumer_faults
        };
        target.add(rule(rid, push));
    }
    let what = format!(
        "{} {} #{rid} {ps} -> {ds} ({tokens} tokens){}",
        s.kind,
        if push { "push" } else { "pull" },
        fault
            .map(|f| format!(", fault {}", f.0))
            .unwrap_or_default()
    );
    let dst_st = dest_staging(&plan, &dst, None);
    let src_st = source_staging(&src, tokens, None);
    let t0 = Instant::now();
    let result = if push {
        let sink = s
            .consumer
            .expect_push(SinkRegistration {
                request_id: rid,
                num_tokens: tokens,
                placement: dst.clone(),
                staging: dst_st.clone(),
                dst_ranks: None,
                src: Some(src.clone()),
                plan: Some(plan.clone()),
            })
            .unwrap();
        let p = prod
            .push(PushRequest {
                request_id: rid,
                num_tokens: tokens,
                src: src.clone(),
                staging: src_st.clone(),
                src_ranks: None,
                dst: dst.clone(),
                targets: PeerMap::single(s.consumer.local_addr().unwrap().to_string()),
                layers_ready: None,
                plan: Some(plan.clone()),
            })
            .unwrap();
        let rp = tokio::time::timeout(BOUND, p.wait()).await;
        let rs = tokio::time::timeout(BOUND, sink.wait()).await;
        match (rp, rs) {
            (Ok(Ok(_)), Ok(Ok(_))) => Ok(()),
            (Ok(a), Ok(b)) => Err(a.err().or(b.err()).unwrap()),
            (a, b) => panic!(
                "{what}: no outcome within {BOUND:?} (hang): pusher {:?}, receiver {:?}, \
                 producer restarted: {}",
                a.map(|r| r.map(|_| ())),
                b.map(|r| r.map(|_| ())),
                s.producer.read().unwrap().epoch != epoch
            ),
        }
    } else {
        prod.register_source(SourceRegistration {
            request_id: rid,
            num_tokens: tokens,
            placement: src.clone(),
            staging: src_st.clone(),
            layers_ready: None,
            expected_releases: 1,
        })
        .unwrap();
        let pull = |st: Arc<Staging>| {
            s.consumer
                .pull(PullRequest {
                    request_id: rid,
                    num_tokens: tokens,
                    src: src.clone(),
                    sources: PeerMap::single(s.name.clone()),
                    dst: dst.clone(),
                    staging: st,
                    dst_ranks: None,
                    plan: Some(plan.clone()),
                    wait_for_registration: None,
                })
                .unwrap()
        };
        let t = pull(dst_st.clone());
        let r = match tokio::time::timeout(BOUND, t.wait()).await {
            Ok(r) => r.map(|_| ()),
            Err(_) => panic!("{what}: no outcome within {BOUND:?} (hang)"),
        };
        if r.is_err() && s.producer.read().unwrap().epoch == epoch {
            // Nothing the producer stored is lost: the same registration serves a retry.
            let st = dest_staging(&plan, &dst, None);
            let t = pull(st.clone());
            match tokio::time::timeout(BOUND, t.wait()).await {
                Ok(Ok(_)) => {
                    verify_dest(&dst, tokens, &st, None);
                    w.counts.retries_ok.fetch_add(1, Ordering::Relaxed);
                }
                Ok(Err(e)) => {
                    assert!(
                        s.producer.read().unwrap().epoch != epoch,
                        "{what}: the retry failed without a restart: {e}"
                    );
                }
                Err(_) => panic!("{what}: retry hangs"),
            }
        }
        let _ = s.consumer.release(&s.name, rid).await;
        prod.unregister_source(rid);
        r
    };
    w.counts.ops.fetch_add(1, Ordering::Relaxed);
    let restarted = s.producer.read().unwrap().epoch != epoch;
    let fatal = fault.map(|f| f.3).unwrap_or(false);
    match result {
        Ok(()) => {
            assert!(
                !fatal,
                "{what}: a request with a fatal fault was reported done"
            );
            let n = verify_dest(&dst, tokens, &dst_st, None);
            w.counts.bytes_verified.fetch_add(n, Ordering::Relaxed);
            w.counts.ok.fetch_add(1, Ordering::Relaxed);
            store_request(w, rid, &dst_st, rng);
        }
        Err(e) => {
            assert!(t0.elapsed() < BOUND, "{what}");
            if fatal {
                w.counts.failed_as_expected.fetch_add(1, Ordering::Relaxed);
            } else {
                assert!(
                    restarted,
                    "{what}: failed without a fatal fault or a restart: {e}"
                );
                w.counts.failed_by_restart.fetch_add(1, Ordering::Relaxed);
            }
            drop::<Error>(e);
        }
    }
}

/// Puts a received request into the store as a chain of blocks; then random store traffic:
/// a get of an earlier chain (every delivered block byte-exact), a failing get of a pinned chain
/// (nothing lost), a removal (eviction).
fn store_request(w: &World, rid: u64, st: &Staging, rng: &mut Rng) {
    let bytes = staged(st);
    let blocks: Vec<&[u8]> = bytes.chunks(STORE_BLOCK).collect();
    let toks: Vec<u32> = (0..blocks.len() as u64 * 16)
        .map(|i| (mix64(rid << 20 ^ i) % 60_000) as u32)
        .collect();
    let keys = w.ns.chain_keys(&toks, 16);
    {
        let mut l = w.ledger.lock().unwrap();
        for (k, b) in keys.iter().zip(&blocks) {
            l.insert(*k, (b.len(), tpu_sync::wire::checksum([*b])));
        }
    }
    let r = w.store.put_from_host(None, &keys, &blocks).unwrap();
    assert!(r.stored + r.present <= keys.len());
    w.counts.store_puts.fetch_add(1, Ordering::Relaxed);
    let pick = {
        let mut c = w.chains.lock().unwrap();
        c.push_back(keys);
        if c.len() > 256 {
            // Forget the oldest chain (its blocks stay until evicted; no get asks for them).
            let old = c.pop_front().unwrap();
            let mut l = w.ledger.lock().unwrap();
            for k in old {
                l.remove(&k);
            }
        }
        c[rng.next(c.len() as u64) as usize].clone()
    };
    match rng.next(4) {
        0 | 1 => {
            let lens: Vec<usize> = {
                let l = w.ledger.lock().unwrap();
                pick.iter().map(|k| l[k].0).collect()
            };
            let mut bufs: Vec<Vec<u8>> = lens.iter().map(|&n| vec![0u8; n]).collect();
            let mut refs: Vec<&mut [u8]> = bufs.iter_mut().map(|b| b.as_mut_slice()).collect();
            let rep = w.store.get_to_host(&pick, &mut refs).expect("store get");
            let l = w.ledger.lock().unwrap();
            for (k, b) in pick.iter().zip(&bufs).take(rep.delivered) {
                assert_eq!(
                    tpu_sync::wire::checksum([&b[..]]),
                    l[k].1,
                    "the store delivered other bytes for {k}"
                );
            }
            w.counts
                .store_blocks_checked
                .fetch_add(rep.delivered as u64, Ordering::Relaxed);
            w.counts.store_gets.fetch_add(1, Ordering::Relaxed);
        }
        2 => {
            // A failing get of a pinned chain loses nothing.
            let lease = w.store.pin(&pick);
            let held = lease.len();
            let mut bufs: Vec<Vec<u8>> = pick.iter().map(|_| vec![0u8; 3]).collect();
            let mut refs: Vec<&mut [u8]> = bufs.iter_mut().map(|b| b.as_mut_slice()).collect();
            if held > 0 {
                assert!(w.store.get_to_host(&pick, &mut refs).is_err());
            }
            assert!(
                w.store.lookup(&pick) >= held,
                "a failing get lost pinned blocks"
            );
            w.store.unpin(lease);
            w.counts.store_failing_gets.fetch_add(1, Ordering::Relaxed);
        }
        _ => {
            w.store.remove(&pick);
            w.counts.store_removes.fetch_add(1, Ordering::Relaxed);
        }
    }
}

async fn restart(w: &World, i: usize) {
    let s = &w.sides[i];
    let (ep, faults) = fault_endpoint(options(s.kind, &w.pki, "prefill")).await;
    let addr = ep.local_addr().unwrap().to_string();
    let old = {
        let mut p = s.producer.write().unwrap();
        let epoch = p.epoch + 1;
        std::mem::replace(
            &mut *p,
            Producer {
                ep: Arc::new(ep),
                faults,
                epoch,
            },
        )
    };
    old.faults.kill();
    drop(old);
    s.consumer.add_peer(&s.name, &addr).await.unwrap();
    w.counts.restarts.fetch_add(1, Ordering::Relaxed);
}

/// One pull per transport on throwaway endpoints, then the process's resources: the baseline the
/// process must return to (allocator arenas, runtime threads and TLS/QUIC statics exist by then).
async fn warm_up(pki: &Pki) -> Resources {
    let m = model(2);
    let tokens = 64;
    let src = placement(layout(&m, "tp=2,block=16", tokens), 0, tokens, 1);
    let dst = placement(layout(&m, "tp=1,block=16", tokens), 0, tokens, 2);
    let plan = Plan::build(&src, &dst, tokens).unwrap();
    for kind in KINDS {
        let (p, _) = fault_endpoint(options(kind, pki, "prefill")).await;
        let (c, _) = fault_endpoint(options(kind, pki, "decode")).await;
        register_whole(&p, &src, tokens, 1);
        let st = dest_staging(&plan, &dst, None);
        let addr = p.local_addr().unwrap().to_string();
        c.pull(PullRequest {
            request_id: 1,
            num_tokens: tokens,
            src: src.clone(),
            sources: PeerMap::single(addr.clone()),
            dst: dst.clone(),
            staging: st.clone(),
            dst_ranks: None,
            plan: None,
            wait_for_registration: None,
        })
        .unwrap()
        .wait()
        .await
        .unwrap();
        verify_dest(&dst, tokens, &st, None);
        c.release(&addr, 1).await.unwrap();
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    Resources::sample()
}

/// (what, the sampled value, absolute slack, relative slack in %).
type Bound = (&'static str, fn(&Sample) -> u64, u64, u64);

#[derive(Clone, Copy)]
struct Sample {
    t: f64,
    r: Resources,
    lanes: u64,
    ops: u64,
    dram_blocks: u64,
    evictions: u64,
}

fn row(s: &Sample) -> String {
    format!(
        "{:>6.0} {:>7} {:>8.1} {:>5} {:>7} {:>7} {:>8} {:>5} {:>6} {:>11} {:>9}",
        s.t,
        s.ops,
        s.r.rss_kib as f64 / 1024.0,
        s.r.fds,
        s.r.sockets,
        s.r.threads,
        s.r.locked_kib,
        s.r.maps,
        s.lanes,
        s.dram_blocks,
        s.evictions
    )
}

#[test]
#[ignore = "minutes: run with `make soak` (SOAK_SECONDS)"]
fn soak() {
    let secs: u64 = std::env::var("SOAK_SECONDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(120);
    let duration = Duration::from_secs(secs);
    run(duration + Duration::from_secs(120), async move {
        let pki = pki(&["prefill", "decode"]);
        let start = warm_up(&pki).await;
        let mut sides = Vec::new();
        for kind in KINDS {
            let (consumer, cf) = fault_endpoint(options(kind, &pki, "decode")).await;
            let (producer, pf) = fault_endpoint(options(kind, &pki, "prefill")).await;
            let name = format!("prefill-{kind}");
            consumer
                .add_peer(&name, &producer.local_addr().unwrap().to_string())
                .await
                .unwrap();
            sides.push(Side {
                kind,
                name,
                consumer: Arc::new(consumer),
                consumer_faults: cf,
                producer: RwLock::new(Producer {
                    ep: Arc::new(producer),
                    faults: pf,
                    epoch: 0,
                }),
            });
        }
        let ns = Namespace::new("soak");
        let mut cfg = StoreConfig::new(ns.clone(), STORE_BLOCK as u64, 256 * STORE_BLOCK as u64);
        cfg.memory.huge_pages = false;
        let w = Arc::new(World {
            pki,
            sides,
            store: KvStore::open(cfg).unwrap(),
            ns,
            ledger: Mutex::new(HashMap::new()),
            chains: Mutex::new(Default::default()),
            counts: Counts::default(),
            next_rid: AtomicU64::new(1),
            stop: AtomicBool::new(false),
        });
        let t0 = Instant::now();
        let mut tasks = Vec::new();
        for i in 0..WORKERS {
            let w = w.clone();
            tasks.push(tokio::spawn(async move {
                let mut rng = Rng(0x50a4 + i as u64);
                while !w.stop.load(Ordering::Relaxed) {
                    let s = &w.sides[rng.next(w.sides.len() as u64) as usize];
                    one_request(&w, s, &mut rng).await;
                }
            }));
        }
        let chaos = {
            let w = w.clone();
            tokio::spawn(async move {
                let mut rng = Rng(0xc4a05);
                while !w.stop.load(Ordering::Relaxed) {
                    tokio::time::sleep(Duration::from_millis(2000 + rng.next(3000))).await;
                    let i = rng.next(w.sides.len() as u64) as usize;
                    restart(&w, i).await;
                }
            })
        };
        // Samples: every 1/12 of the run (at least 2 s).
        let period = (duration / 12).max(Duration::from_secs(2));
        let mut samples: Vec<Sample> = Vec::new();
        let header = format!(
            "{:>6} {:>7} {:>8} {:>5} {:>7} {:>7} {:>8} {:>5} {:>6} {:>11} {:>9}",
            "t [s]",
            "ops",
            "RSS MiB",
            "fds",
            "sockets",
            "threads",
            "VmLck kB",
            "maps",
            "lanes",
            "store DRAM",
            "evictions"
        );
        println!("soak for {secs} s, {WORKERS} workers\n{header}");
        while t0.elapsed() < duration {
            tokio::time::sleep(period.min(duration.saturating_sub(t0.elapsed()))).await;
            let lanes = w
                .sides
                .iter()
                .map(|s| {
                    s.consumer.stats().lanes_open + s.producer.read().unwrap().ep.stats().lanes_open
                })
                .sum();
            let st = w.store.stats();
            let s = Sample {
                t: t0.elapsed().as_secs_f64(),
                r: Resources::sample(),
                lanes,
                ops: w.counts.ops.load(Ordering::Relaxed),
                dram_blocks: st.dram_blocks,
                evictions: st.evictions,
            };
            println!("{}", row(&s));
            samples.push(s);
        }
        w.stop.store(true, Ordering::Relaxed);
        for t in tasks {
            t.await.expect("a worker failed");
        }
        chaos.abort();
        let _ = chaos.await;
        let c = &w.counts;
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        println!(
            "requests {}: {} ok ({} MB verified), {} failed by their fault, {} by a restart, \
             {} failed pulls served again; {} producer restarts; store: {} puts, {} gets ({} \
             blocks checked), {} failing gets, {} removals, {} evictions",
            g(&c.ops),
            g(&c.ok),
            g(&c.bytes_verified) / 1_000_000,
            g(&c.failed_as_expected),
            g(&c.failed_by_restart),
            g(&c.retries_ok),
            g(&c.restarts),
            g(&c.store_puts),
            g(&c.store_gets),
            g(&c.store_blocks_checked),
            g(&c.store_failing_gets),
            g(&c.store_removes),
            w.store.stats().evictions
        );
        assert!(
            g(&c.ok) > 0 && g(&c.failed_as_expected) > 0,
            "the soak did work"
        );
        w.store.debug_check().unwrap();

        // Flat over the last half: its maximum stays within a fixed slack of the first half's
        // maximum (warm-up and settling). The slacks are far below what leaking one request's
        // staging (or one socket, fd, mapping) per request would add over the last half's
        // thousands of requests: 16 MiB of RSS is 1.3 KiB per request at the ~12,000 requests
        // of a 1,800 s run's last half (and 5 KiB at 300 s), 16 fds/sockets/maps, 1 thread.
        let warm_n = (samples.len() / 2).max(1);
        let (warm, rest) = samples.split_at(warm_n.min(samples.len()));
        let wmax = |f: fn(&Sample) -> u64| warm.iter().map(f).max().unwrap_or(0);
        let rmax = |f: fn(&Sample) -> u64| rest.iter().map(f).max().unwrap_or(0);
        let bounds: [Bound; 5] = [
            // (what, value, absolute slack, relative slack in %)
            ("RSS KiB", |s| s.r.rss_kib, 16 << 10, 0),
            ("fds", |s| s.r.fds as u64, 16, 0),
            ("sockets", |s| s.r.sockets as u64, 16, 0),
            ("threads", |s| s.r.threads as u64, 1, 0),
            ("maps", |s| s.r.maps as u64, 16, 0),
        ];
        for (what, f, abs, pct) in bounds {
            let (a, b) = (wmax(f), rmax(f));
            let limit = a + abs + a * pct / 100;
            println!("{what}: warm max {a}, later max {b}, bound {limit}");
            assert!(
                b <= limit,
                "{what} grew after warm-up: {a} -> {b} (bound {limit})"
            );
        }
        // Shutdown: everything back to the start.
        let w = Arc::try_unwrap(w).ok().expect("no task holds the world");
        drop(w);
        assert_back_to(&start, Duration::from_secs(10), "after the soak").await;
        println!(
            "after shutdown: {:?} (start {:?})",
            Resources::sample(),
            start
        );
    });
}
