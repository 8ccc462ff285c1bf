//! Device copies that stall never stop the network runtime (issue 23): with every device copy of
//! the consumer's process stalled (the process-wide copy engine paused) for several heartbeat
//! timeouts while pulls wait for their H2D, the consumer's runtime keeps running its tasks on
//! time, heartbeats are answered, and neither side declares the other dead; once the copies
//! resume, every pull is byte-exact.
//!
//! Its own test binary: pausing `Pacer::global` stalls every device copy of the process.

mod common;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tpu_sync::device::Pacer;
use tpu_sync::layout::{DType, ModelKv, ParallelLayout, ParallelSpec};
use tpu_sync::net::{EndpointOptions, PeerMap};
use tpu_sync::pattern::RankContents;
use tpu_sync::pjrt::{Capabilities, Client, DeviceBuffer};
use tpu_sync::plan::Placement;
use tpu_sync::transfer::{KvBuffers, Offer, Pipeline, PullInto, TransferOptions};

const SRC_SALT: u64 = 0x5354_4c00;
const DST_SALT: u64 = 0x5354_4c01;
const TOKENS: u32 = 48;
const PULLS: u64 = 6;
const HB_INTERVAL: Duration = Duration::from_millis(250);
const HB_TIMEOUT: Duration = Duration::from_secs(1);

fn model() -> ModelKv {
    ModelKv {
        name: "toy".into(),
        num_layers: 2,
        num_kv_heads: 2,
        head_dim: 16,
        kv_planes: 2,
        dtype: DType::Bf16,
    }
}

fn place(spec: &str, blocks: u32, ids: Vec<u32>) -> Placement {
    Placement {
        first_token: 0,
        layout: ParallelLayout::new(model(), ParallelSpec::parse(spec).unwrap(), blocks).unwrap(),
        dp_rank: 0,
        block_ids: vec![ids],
        groups: None,
    }
}

fn buffers(client: &Client, p: &Placement, salt: u64) -> Vec<DeviceBuffer> {
    let c = RankContents::new(p, 0, TOKENS, salt).unwrap();
    let kv = *c.kv();
    let dev = client.device(0).unwrap();
    let mut host = vec![0u8; kv.buffer_bytes() as usize];
    (0..kv.num_layers)
        .map(|l| {
            c.fill_layer(l, &mut host).unwrap();
            client
                .buffer_from_host(&host, kv.dtype.element_type(), &kv.dims(), &dev)
                .unwrap()
        })
        .collect()
}

fn kv(caps: &Capabilities, bufs: Vec<DeviceBuffer>) -> KvBuffers {
    KvBuffers::new(caps, [(0u32, bufs)].into_iter().collect::<BTreeMap<_, _>>()).unwrap()
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

fn opts(name: &str, listen: bool) -> EndpointOptions {
    EndpointOptions {
        name: name.into(),
        listen: listen.then(|| "127.0.0.1:0".parse().unwrap()),
        io_timeout: Duration::from_secs(30),
        heartbeat_interval: HB_INTERVAL,
        heartbeat_timeout: HB_TIMEOUT,
        ..EndpointOptions::default()
    }
}

fn topts() -> TransferOptions {
    TransferOptions {
        staging_budget_bytes: Some(1 << 30),
        ..TransferOptions::default()
    }
}

#[test]
fn heartbeats_are_answered_while_every_device_copy_is_stalled() {
    let client = common::client(1);
    let caps = Capabilities::probe(&client).unwrap();
    let src = place("tp=1,block=16", 8, vec![5, 1, 6]);
    let dst = place("tp=1,block=8,order=hnd", 12, vec![9, 2, 7, 0, 11, 4]);
    // The producer: its own runtime (another process would have its own), offers staged first.
    let prt = runtime();
    let producer = prt
        .block_on(Pipeline::bind(opts("stall-prod", true), topts()))
        .unwrap();
    let offers: Vec<_> = (1..=PULLS)
        .map(|id| {
            let _g = prt.enter();
            producer
                .offer(Offer {
                    request_id: id,
                    num_tokens: TOKENS,
                    placement: src.clone(),
                    kv: kv(&caps, buffers(&client, &src, SRC_SALT ^ id)),
                    expected_releases: 1,
                })
                .unwrap()
        })
        .collect();
    let paddr = producer.endpoint().local_addr().unwrap().to_string();

    // The consumer: two runtime workers, as a process's endpoints share.
    let crt = runtime();
    let consumer = crt
        .block_on(Pipeline::bind(opts("stall-cons", false), topts()))
        .unwrap();
    let bg = Placement {
        first_token: 0,
        block_ids: vec![],
        dp_rank: u32::MAX,
        ..dst.clone()
    };
    let dsts: Vec<Vec<DeviceBuffer>> = (0..PULLS)
        .map(|_| buffers(&client, &bg, DST_SALT))
        .collect();

    // Every device copy of this process stalls from now on.
    Pacer::global().pause();
    let worst_late = Arc::new(AtomicU64::new(0));
    let (handles, probe) = crt.block_on(async {
        let handles: Vec<_> = (1..=PULLS)
            .map(|id| {
                consumer
                    .pull(PullInto {
                        request_id: id,
                        num_tokens: TOKENS,
                        src: src.clone(),
                        sources: PeerMap::parse(&format!("0={paddr}")).unwrap(),
                        dst: dst.clone(),
                        kv: kv(&caps, dsts[id as usize - 1].clone()),
                        wait_for_registration: None,
                    })
                    .unwrap()
            })
            .collect();
        // How late a timer of the consumer's runtime fires while the copies are stalled.
        let w = worst_late.clone();
        let probe = tokio::spawn(async move {
            let step = Duration::from_millis(20);
            let end = Instant::now() + HB_TIMEOUT * 3;
            while Instant::now() < end {
                let t = Instant::now();
                tokio::time::sleep(step).await;
                let late = t.elapsed().saturating_sub(step).as_micros() as u64;
                w.fetch_max(late, Ordering::Relaxed);
            }
        });
        (handles, probe)
    });
    // The test thread waits outside both runtimes (so a blocked runtime cannot hang the test).
    std::thread::sleep(HB_TIMEOUT * 3 + Duration::from_millis(100));

    // Three heartbeat timeouts later the H2D writes are still waiting, and nobody died.
    let stalled = handles.iter().filter(|h| h.poll().is_none()).count();
    let cs = consumer.endpoint().stats();
    let ps = producer.endpoint().stats();
    Pacer::global().resume();
    crt.block_on(probe).unwrap();
    assert_eq!(
        stalled, PULLS as usize,
        "every pull waits for its stalled H2D"
    );
    assert_eq!(
        cs.peers_lost, 0,
        "consumer declared its producer dead: {cs:?}"
    );
    assert_eq!(
        ps.peers_lost, 0,
        "producer declared its consumer dead: {ps:?}"
    );
    assert_eq!(ps.sessions, 1, "{ps:?}");
    let late = Duration::from_micros(worst_late.load(Ordering::Relaxed));
    assert!(
        late < HB_INTERVAL,
        "the consumer's runtime ran a timer {late:?} late while copies were stalled"
    );

    // Resumed: every pull completes byte-exact, every byte outside the request unchanged.
    crt.block_on(async {
        for h in &handles {
            h.wait().await.unwrap();
        }
    });
    let want = TOKENS as u64 * model().bytes_per_token();
    for (i, bufs) in dsts.iter().enumerate() {
        let id = i as u64 + 1;
        let c = RankContents::new(&dst, 0, TOKENS, DST_SALT).unwrap();
        let mut host = vec![0u8; c.kv().buffer_bytes() as usize];
        let mut request = 0;
        for (l, b) in bufs.iter().enumerate() {
            b.to_host(&mut host).unwrap();
            let r = c.verify_layer(l as u32, &host).unwrap();
            assert_eq!(
                r.mismatches, 0,
                "pull {id} layer {l}: {:?}",
                r.first_mismatch
            );
            request += r.request_bytes;
        }
        assert_eq!(request, want, "pull {id}");
    }
    for (i, o) in offers.iter().enumerate() {
        let st = prt
            .block_on(o.wait(Duration::from_secs(10)))
            .unwrap_or_else(|e| panic!("offer {}: {e}", i + 1));
        assert_eq!(
            st,
            tpu_sync::transfer::OfferState::Released,
            "offer {}",
            i + 1
        );
    }
    assert_eq!(consumer.endpoint().stats().peers_lost, 0);
    assert_eq!(producer.endpoint().stats().peers_lost, 0);
}
