//! `tpu_sync::transfer` end to end on the real XLA CPU plugin: two pipelines in one process over
//! loopback TCP, real device buffers filled with `tpu_sync::pattern` contents, every request
//! element verified after the H2D write (and every byte outside the request unchanged).
//!
//! * every kind of buffer/layout disagreement is refused with `Mismatch` before anything is
//!   staged or sent, on both sides; a correct transfer on the same pipelines is byte-exact;
//! * the DMA map is attempted for every staging (skipped on the CPU plugin) and reported;
//! * a registration past the staging budget fails with `StagingExhausted` while earlier ones
//!   still pull byte-exact, and the budget returns to zero when they end.
//! * the staging arena pool: pulls and pushes of different sizes and block orders through
//!   reused arenas are byte-exact, the pool's cap holds, the counters move, repeated
//!   placements plan once; a truncated transfer into an arena holding the very bytes it should
//!   receive still fails.

use crate::common;
use crate::fault_util;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use tpu_sync::layout::{DType, ModelKv, ParallelLayout, ParallelSpec};
use tpu_sync::net::{EndpointOptions, FaultHooks, PeerMap};
use tpu_sync::pattern::RankContents;
use tpu_sync::pjrt::{Capabilities, Client, DeviceBuffer, ElementType};
use tpu_sync::plan::Placement;
use tpu_sync::staging::DEFAULT_POOL_BYTES;
use tpu_sync::transfer::{
    DmaOutcome, ExpectPush, KvBuffers, Offer, OfferState, Pipeline, PullInto, PushFrom, Report,
    TransferOptions,
};
use tpu_sync::{ErrorKind, Result};

const SRC_SALT: u64 = 0x5352_4300;
const DST_SALT: u64 = 0x4453_5400;
const TOKENS: u32 = 100;

fn model() -> ModelKv {
    ModelKv {
        name: "toy".into(),
        num_layers: 2,
        num_kv_heads: 4,
        head_dim: 8,
        kv_planes: 2,
        dtype: DType::Bf16,
    }
}

/// Producer TP=2 (16-token NHD blocks), consumer TP=1 (32-token HND blocks): a reshard.
fn placements() -> (Placement, Placement) {
    let src = Placement {
        first_token: 0,
        layout: ParallelLayout::new(model(), ParallelSpec::parse("tp=2,block=16").unwrap(), 9)
            .unwrap(),
        dp_rank: 0,
        block_ids: vec![vec![7, 2, 5, 0, 3, 6, 1], vec![1, 4, 0, 6, 2, 8, 5]],
        groups: None,
    };
    let dst = Placement {
        first_token: 0,
        layout: ParallelLayout::new(
            model(),
            ParallelSpec::parse("tp=1,block=32,order=hnd").unwrap(),
            6,
        )
        .unwrap(),
        dp_rank: 0,
        block_ids: vec![vec![5, 1, 3, 0]],
        groups: None,
    };
    (src, dst)
}

struct Side {
    client: Client,
    caps: Capabilities,
}

fn side(devices: i64) -> Side {
    let client = common::client(devices);
    let caps = Capabilities::probe(&client).unwrap();
    Side { client, caps }
}

/// Per-layer buffers of `rank` holding `place`'s pattern contents (request or background).
fn buffers(s: &Side, place: &Placement, rank: u32, salt: u64) -> Vec<DeviceBuffer> {
    buffers_of(s, place, rank, TOKENS, salt)
}

/// [`buffers`] of a request of `tokens`.
fn buffers_of(s: &Side, place: &Placement, rank: u32, tokens: u32, salt: u64) -> Vec<DeviceBuffer> {
    let c = RankContents::new(place, rank, tokens, salt).unwrap();
    let kv = *c.kv();
    let dev = s.client.device(rank as usize).unwrap();
    let mut host = vec![0u8; kv.buffer_bytes() as usize];
    (0..kv.num_layers)
        .map(|l| {
            c.fill_layer(l, &mut host).unwrap();
            s.client
                .buffer_from_host(&host, kv.dtype.element_type(), &kv.dims(), &dev)
                .unwrap()
        })
        .collect()
}

fn kv(s: &Side, by_rank: Vec<(u32, Vec<DeviceBuffer>)>) -> KvBuffers {
    KvBuffers::new(&s.caps, by_rank.into_iter().collect::<BTreeMap<_, _>>()).unwrap()
}

/// Checks every element of the destination rank: the request's from the source pattern, the
/// rest unchanged background. Returns the request bytes checked.
fn verify(dst: &Placement, rank: u32, bufs: &[DeviceBuffer]) -> u64 {
    verify_of(dst, rank, bufs, TOKENS)
}

/// [`verify`] of a request of `tokens`.
fn verify_of(dst: &Placement, rank: u32, bufs: &[DeviceBuffer], tokens: u32) -> u64 {
    let c = RankContents::new(dst, rank, tokens, DST_SALT).unwrap();
    let mut host = vec![0u8; c.kv().buffer_bytes() as usize];
    let mut request = 0;
    for (l, b) in bufs.iter().enumerate() {
        b.to_host(&mut host).unwrap();
        let r = c.verify_layer(l as u32, &host).unwrap();
        assert_eq!(r.mismatches, 0, "layer {l}: {:?}", r.first_mismatch);
        request += r.request_bytes;
    }
    request
}

/// The destination rank's buffers before the pull: background only (its placement's request
/// blocks hold background until written).
fn background(s: &Side, dst: &Placement, rank: u32) -> Vec<DeviceBuffer> {
    let bg = Placement {
        first_token: 0,
        block_ids: vec![],
        dp_rank: u32::MAX,
        ..dst.clone()
    };
    buffers(s, &bg, rank, DST_SALT)
}

/// Both producer ranks' buffers of `src` (salt `SRC_SALT`).
fn src_kv(prod: &Side, src: &Placement) -> KvBuffers {
    kv(
        prod,
        (0..2)
            .map(|r| (r, buffers(prod, src, r, SRC_SALT)))
            .collect(),
    )
}

fn raw(s: &Side, ty: ElementType, dims: &[i64], fill: u8) -> DeviceBuffer {
    let n = ty.shape_bytes(dims).unwrap() as usize;
    s.client
        .buffer_from_host(&vec![fill; n], ty, dims, &s.client.device(0).unwrap())
        .unwrap()
}

/// One buffer list per kind of disagreement with `layout`'s per-rank buffers.
fn bad_kinds(s: &Side, layout: &ParallelLayout) -> Vec<(&'static str, Vec<DeviceBuffer>)> {
    let kv = layout.rank_kv().unwrap();
    let d = kv.dims();
    let layers = kv.num_layers as usize;
    let many = |ty: ElementType, dims: &[i64]| -> Vec<DeviceBuffer> {
        (0..layers).map(|_| raw(s, ty, dims, 0xA5)).collect()
    };
    let mut more_blocks = d;
    more_blocks[1] += 2;
    let mut padded = d;
    padded[4] += 4;
    let mut fewer = d;
    fewer[1] -= 1;
    let mut f32_dims = d;
    f32_dims[4] /= 2;
    let flat = [kv.buffer_bytes() as i64 / 2];
    vec![
        ("more blocks", many(ElementType::BF16, &more_blocks)),
        ("padded block stride", many(ElementType::BF16, &padded)),
        ("f16 under bf16", many(ElementType::F16, &d)),
        ("f32 of the same size", many(ElementType::F32, &f32_dims)),
        ("fewer blocks", many(ElementType::BF16, &fewer)),
        ("flat", many(ElementType::BF16, &flat)),
        (
            "u8 bytes",
            many(ElementType::U8, &[kv.buffer_bytes() as i64]),
        ),
        ("a layer missing", many(ElementType::BF16, &d)[..1].to_vec()),
        (
            "a layer too many",
            many(ElementType::BF16, &d)
                .into_iter()
                .chain([raw(s, ElementType::BF16, &d, 1)])
                .collect(),
        ),
    ]
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

/// A pipeline with its own budget (1 GiB unless `opts` names one): the tests of this file run
/// in parallel and must not share the process-wide budget's counters.
async fn pipeline(name: &str, listen: bool, mut opts: TransferOptions) -> Result<Pipeline> {
    opts.staging_budget_bytes.get_or_insert(1 << 30);
    Pipeline::bind(
        EndpointOptions {
            name: name.into(),
            listen: listen.then(|| "127.0.0.1:0".parse().unwrap()),
            io_timeout: Duration::from_secs(10),
            ..EndpointOptions::default()
        },
        opts,
    )
    .await
}

fn addr(p: &Pipeline) -> String {
    p.endpoint().local_addr().unwrap().to_string()
}

/// Pulls request `id` (`TOKENS` tokens of `src`, offered at `sources`) through `c` into a fresh
/// background destination of `dst` (rank 0 of `cons`), checks every destination element (the
/// request byte-exact, the rest unchanged) and returns the pull's report.
async fn pull_exact(
    c: &Pipeline,
    sources: PeerMap,
    cons: &Side,
    (src, dst): (&Placement, &Placement),
    id: u64,
) -> Report {
    let dst_bufs = background(cons, dst, 0);
    let rep = c
        .pull(PullInto {
            request_id: id,
            num_tokens: TOKENS,
            src: src.clone(),
            sources,
            dst: dst.clone(),
            kv: kv(cons, vec![(0, dst_bufs.clone())]),
            wait_for_registration: None,
        })
        .unwrap()
        .wait()
        .await
        .unwrap();
    assert_eq!(
        verify(dst, 0, &dst_bufs),
        TOKENS as u64 * model().bytes_per_token()
    );
    rep
}

#[test]
fn every_disagreement_is_refused_before_any_byte_moves_then_a_pull_is_exact() {
    let (src, dst) = placements();
    let prod = side(2);
    let cons = side(1);
    let rt = rt();
    rt.block_on(async {
        let p = pipeline("val-prod", true, TransferOptions::default())
            .await
            .unwrap();
        let c = pipeline("val-cons", false, TransferOptions::default())
            .await
            .unwrap();
        let src_kv = src_kv(&prod, &src);
        let offered = p
            .offer(Offer {
                request_id: 5,
                num_tokens: TOKENS,
                placement: src.clone(),
                kv: src_kv.clone(),
                expected_releases: 1,
            })
            .unwrap();
        assert_eq!(
            offered.report().device_bytes,
            2 * 2 * 2 * 7 * 16 * 2 * 8 * 2
        );
        assert!(
            matches!(offered.report().dma, DmaOutcome::Skipped(_)),
            "CPU: UNIMPLEMENTED"
        );
        let staged = p.staging_in_use();
        assert!(staged >= offered.report().device_bytes);

        // Producer side: every disagreement refused, nothing staged, request 5 untouched.
        for (name, bad) in bad_kinds(&prod, &src.layout) {
            let e = p
                .offer(Offer {
                    request_id: 6,
                    num_tokens: TOKENS,
                    placement: src.clone(),
                    kv: kv(&prod, vec![(0, bad.clone())]),
                    expected_releases: 1,
                })
                .unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Mismatch, "{name}: {e}");
            assert!(e.to_string().contains("rank 0"), "{name}: {e}");
            let e = p
                .push(PushFrom {
                    request_id: 6,
                    num_tokens: TOKENS,
                    src: src.clone(),
                    kv: kv(&prod, vec![(0, bad)]),
                    dst: dst.clone(),
                    targets: PeerMap::single("127.0.0.1:9"),
                })
                .unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Mismatch, "{name}: {e}");
            assert_eq!(p.offer_state(6), OfferState::Unknown, "{name}");
            assert_eq!(p.staging_in_use(), staged, "{name}: nothing staged");
        }
        assert_eq!(p.offer_state(5), OfferState::Active);

        // Consumer side: every disagreement refused before anything is sent.
        for (name, bad) in bad_kinds(&cons, &dst.layout) {
            let before: Vec<Vec<u8>> = bad
                .iter()
                .map(|b| {
                    let mut v = vec![0u8; b.on_device_size() as usize];
                    b.to_host(&mut v).unwrap();
                    v
                })
                .collect();
            for expect in [false, true] {
                let k = kv(&cons, vec![(0, bad.clone())]);
                let e = if expect {
                    c.expect_push(ExpectPush {
                        request_id: 5,
                        num_tokens: TOKENS,
                        src: src.clone(),
                        dst: dst.clone(),
                        kv: k,
                    })
                    .unwrap_err()
                } else {
                    c.pull(PullInto {
                        request_id: 5,
                        num_tokens: TOKENS,
                        src: src.clone(),
                        sources: PeerMap::single(addr(&p)),
                        dst: dst.clone(),
                        kv: k,
                        wait_for_registration: None,
                    })
                    .unwrap_err()
                };
                assert_eq!(e.kind(), ErrorKind::Mismatch, "{name}: {e}");
                assert!(e.to_string().contains("layer"), "{name}: {e}");
            }
            for (b, want) in bad.iter().zip(before) {
                let mut v = vec![0u8; b.on_device_size() as usize];
                b.to_host(&mut v).unwrap();
                assert_eq!(v, want, "{name}: nothing written");
            }
        }
        let st = c.stats();
        assert_eq!(st.endpoint.bytes_received, 0);
        assert_eq!(c.staging_in_use(), 0);
        assert!(st.refused >= 18, "{st:?}");

        // A correct pull on the same pipelines is byte-exact, and releases request 5.
        let rep = pull_exact(&c, PeerMap::single(addr(&p)), &cons, (&src, &dst), 5).await;
        let want = TOKENS as u64 * model().bytes_per_token();
        assert_eq!((rep.net_bytes, rep.device_bytes), (want, want), "{rep:?}");
        assert!(matches!(rep.dma, DmaOutcome::Skipped(_)), "{rep:?}");
        assert_eq!(
            offered.wait(Duration::from_secs(10)).await.unwrap(),
            OfferState::Released
        );
        drop(offered);
        let st = c.stats();
        assert!(st.dma_skipped >= 1 && st.dma_last.is_some(), "{st:?}");
        assert_eq!(c.staging_in_use(), 0, "destination staging freed");
        // The producer's staging is freed once the registration ended.
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while p.staging_in_use() != 0 && std::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert_eq!(p.staging_in_use(), 0);
        assert_eq!(p.offer_state(5), OfferState::Released);
        p.shutdown(None).await;
        c.shutdown(None).await;
    });
}

/// Pushes request `rid` (`tokens` tokens of `src`, source ranks 0 and 1 of `prod` holding the
/// pattern contents) through a producer pipeline into a consumer pipeline's expected push of
/// `dst` (rank 0 of `cons`, background beforehand), both new (named `name`-prod/-cons) and shut
/// down afterwards. Returns the sender's and the receiver's reports and the destination
/// buffers.
async fn push_through(
    prod: &Side,
    cons: &Side,
    (src, dst): (&Placement, &Placement),
    tokens: u32,
    rid: u64,
    name: &str,
) -> (Report, Report, Vec<DeviceBuffer>) {
    let p = pipeline(&format!("{name}-prod"), false, TransferOptions::default())
        .await
        .unwrap();
    let c = pipeline(&format!("{name}-cons"), true, TransferOptions::default())
        .await
        .unwrap();
    let dst_bufs = background(cons, dst, 0);
    let rx = c
        .expect_push(ExpectPush {
            request_id: rid,
            num_tokens: tokens,
            src: src.clone(),
            dst: dst.clone(),
            kv: kv(cons, vec![(0, dst_bufs.clone())]),
        })
        .unwrap();
    let src_kv = kv(
        prod,
        (0..2)
            .map(|r| (r, buffers_of(prod, src, r, tokens, SRC_SALT)))
            .collect(),
    );
    let tx = p
        .push(PushFrom {
            request_id: rid,
            num_tokens: tokens,
            src: src.clone(),
            kv: src_kv,
            dst: dst.clone(),
            targets: PeerMap::single(addr(&c)),
        })
        .unwrap();
    let sent = tx.wait().await.unwrap();
    let got = rx.wait().await.unwrap();
    p.shutdown(None).await;
    c.shutdown(None).await;
    (sent, got, dst_bufs)
}

#[test]
fn push_through_the_pipeline_is_exact() {
    let (src, dst) = placements();
    let prod = side(2);
    let cons = side(1);
    rt().block_on(async {
        let (sent, got, dst_bufs) =
            push_through(&prod, &cons, (&src, &dst), TOKENS, 9, "push").await;
        let want = TOKENS as u64 * model().bytes_per_token();
        assert_eq!(
            (sent.net_bytes, got.net_bytes, got.device_bytes),
            (want, want, want)
        );
        assert!(sent.device_bytes > 0 && sent.device_ops > 0);
        assert_eq!(verify(&dst, 0, &dst_bufs), want);
    });
}

#[test]
fn a_registration_past_the_budget_fails_and_earlier_ones_still_pull_exact() {
    let (src, dst) = placements();
    let prod = side(2);
    let cons = side(1);
    let rt = rt();
    rt.block_on(async {
        let src_kv = src_kv(&prod, &src);
        let offer = |id| Offer {
            request_id: id,
            num_tokens: TOKENS,
            placement: src.clone(),
            kv: src_kv.clone(),
            expected_releases: 1,
        };
        // Room for exactly two registrations of this request.
        let probe = pipeline("budget-probe", true, TransferOptions::default())
            .await
            .unwrap();
        let one = probe.offer(offer(1)).unwrap().report().staged_bytes;
        probe.shutdown(None).await;
        let p = pipeline(
            "budget-prod",
            true,
            TransferOptions {
                staging_budget_bytes: Some(2 * one),
                ..TransferOptions::default()
            },
        )
        .await
        .unwrap();
        let c = pipeline("budget-cons", false, TransferOptions::default())
            .await
            .unwrap();
        let a = p.offer(offer(1)).unwrap();
        let b = p.offer(offer(2)).unwrap();
        let e = p.offer(offer(3)).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::StagingExhausted, "{e}");
        assert_eq!(p.offer_state(3), OfferState::Unknown);
        let st = p.stats();
        assert_eq!(
            (st.budget.used_bytes, st.budget.refused),
            (2 * one, 1),
            "{st:?}"
        );
        // The earlier registrations still pull byte-exact.
        for (id, h) in [(1u64, a), (2, b)] {
            pull_exact(&c, PeerMap::single(addr(&p)), &cons, (&src, &dst), id).await;
            assert_eq!(
                h.wait(Duration::from_secs(10)).await.unwrap(),
                OfferState::Released
            );
        }
        // Their staging went back to the budget: a third registration fits now.
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while p.staging_in_use() != 0 && std::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert_eq!(p.staging_in_use(), 0);
        p.offer(offer(3)).unwrap();
        // A registration that waits for budget gets it once an earlier one ends.
        let w = Arc::new(
            pipeline(
                "budget-wait",
                true,
                TransferOptions {
                    staging_budget_bytes: Some(one),
                    staging_wait: Some(Duration::from_secs(30)),
                    ..TransferOptions::default()
                },
            )
            .await
            .unwrap(),
        );
        w.offer(offer(1)).unwrap();
        let w2 = w.clone();
        let o2 = offer(2);
        let waiting = std::thread::spawn(move || w2.offer(o2).map(|h| h.report().staged_bytes));
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(w.withdraw(1));
        assert_eq!(waiting.join().unwrap().unwrap(), one);
        assert_eq!(w.budget().stats().waited, 1);
        p.shutdown(None).await;
        c.shutdown(None).await;
        w.shutdown(None).await;
    });
}

#[test]
fn a_failed_pull_leaves_the_request_for_a_retry_a_reject_frees_it_and_pulls_wait_for_registration()
{
    let (src, dst) = placements();
    let prod = side(2);
    let cons = side(1);
    let rt = rt();
    rt.block_on(async {
        let p = pipeline("retry-prod", true, TransferOptions::default())
            .await
            .unwrap();
        let other = pipeline("retry-other", true, TransferOptions::default())
            .await
            .unwrap();
        let c = pipeline("retry-cons", false, TransferOptions::default())
            .await
            .unwrap();
        let src_kv = src_kv(&prod, &src);
        let offer = |id| Offer {
            request_id: id,
            num_tokens: TOKENS,
            placement: src.clone(),
            kv: src_kv.clone(),
            expected_releases: 1,
        };
        let pull = |id, at: String, bufs: &[DeviceBuffer], wait| PullInto {
            request_id: id,
            num_tokens: TOKENS,
            src: src.clone(),
            sources: PeerMap::single(at),
            dst: dst.clone(),
            kv: kv(&cons, vec![(0, bufs.to_vec())]),
            wait_for_registration: wait,
        };
        let want = TOKENS as u64 * model().bytes_per_token();

        // Pulls to wrong addresses (nothing listening; an endpoint without the request) fail
        // and leave the registration; the retry to the right address is byte-exact.
        let h = p.offer(offer(11)).unwrap();
        let dst_bufs = background(&cons, &dst, 0);
        let e = c
            .pull(pull(11, "127.0.0.1:1".into(), &dst_bufs, None))
            .unwrap()
            .wait()
            .await
            .unwrap_err();
        assert!(e.is_peer_failure() || e.kind() == ErrorKind::Io, "{e}");
        let e = c
            .pull(pull(11, addr(&other), &dst_bufs, None))
            .unwrap()
            .wait()
            .await
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::UnknownRequest, "{e}");
        assert_eq!(p.offer_state(11), OfferState::Active);
        let rep = c
            .pull(pull(11, addr(&p), &dst_bufs, None))
            .unwrap()
            .wait()
            .await
            .unwrap();
        assert_eq!(rep.device_bytes, want);
        assert_eq!(verify(&dst, 0, &dst_bufs), want);
        assert_eq!(
            h.wait(Duration::from_secs(10)).await.unwrap(),
            OfferState::Released
        );
        drop(h);

        // A reject frees the producer's staging at once and says why: the producer drops the
        // registration's staging before it answers, so once the reject returned here, request
        // 12's bytes are out of `staging_in_use`. (Only decreases can happen meanwhile: request
        // 11's stripe task may still hold its staging a moment after its release, which is why
        // the check is against the count with request 12, not a baseline taken before it.)
        let h = p.offer(offer(12)).unwrap();
        let bytes12 = h.report().staged_bytes;
        let with12 = p.staging_in_use();
        assert!(bytes12 > 0 && with12 >= bytes12, "{bytes12} of {with12}");
        c.reject(12, &PeerMap::single(addr(&p)), "the decode side aborted it")
            .await
            .unwrap();
        let after = p.staging_in_use();
        assert!(
            after + bytes12 <= with12,
            "request 12's {bytes12} bytes of staging still held after the reject's answer \
             ({after} in use, {with12} with it)"
        );
        match p.offer_state(12) {
            OfferState::Rejected(why) => assert!(why.contains("aborted"), "{why}"),
            s => panic!("state after reject: {s:?}"),
        }
        assert_eq!(p.endpoint().stats().staged_bytes, 0);
        drop(h);
        assert_eq!(c.stats().rejects_sent, 1);

        // A pull that reaches the producer before the registration waits for it.
        let dst_bufs = background(&cons, &dst, 0);
        let t = c
            .pull(pull(13, addr(&p), &dst_bufs, Some(Duration::from_secs(30))))
            .unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!t.is_done());
        let h = p.offer(offer(13)).unwrap();
        let rep = t.wait().await.unwrap();
        assert_eq!(rep.device_bytes, want);
        assert_eq!(verify(&dst, 0, &dst_bufs), want);
        assert_eq!(
            h.wait(Duration::from_secs(10)).await.unwrap(),
            OfferState::Released
        );
        for x in [&p, &other, &c] {
            x.shutdown(None).await;
        }
    });
}

/// Layer-wise P/D: a request offered with only layer 0 staged is pulled layer by layer; the
/// consumer gets (and writes) layer 0 and not layer 1 until the producer publishes it; after
/// that every byte is exact and the registration is released.
#[test]
fn a_layerwise_offer_is_pulled_layer_by_layer_and_exact() {
    let (src, dst) = placements();
    let prod = side(2);
    let cons = side(1);
    let rt = rt();
    rt.block_on(async {
        let p = pipeline("lw-prod", true, TransferOptions::default())
            .await
            .unwrap();
        let c = pipeline("lw-cons", false, TransferOptions::default())
            .await
            .unwrap();
        let src_kv = src_kv(&prod, &src);
        let offered = p
            .offer_layers(
                Offer {
                    request_id: 21,
                    num_tokens: TOKENS,
                    placement: src.clone(),
                    kv: src_kv.clone(),
                    expected_releases: 1,
                },
                1,
            )
            .unwrap();
        assert_eq!(offered.layers_published(), 1);
        // Half the D2H of a whole offer (one of two layers).
        assert_eq!(offered.report().device_bytes, 2 * 2 * 7 * 16 * 2 * 8 * 2);
        let dst_bufs = background(&cons, &dst, 0);
        let t = c
            .pull_layerwise(PullInto {
                request_id: 21,
                num_tokens: TOKENS,
                src: src.clone(),
                sources: PeerMap::single(addr(&p)),
                dst: dst.clone(),
                kv: kv(&cons, vec![(0, dst_bufs.clone())]),
                wait_for_registration: None,
            })
            .unwrap();
        assert_eq!(t.num_layers(), 2);
        tokio::time::timeout(Duration::from_secs(20), t.wait_layers_written(1))
            .await
            .expect("layer 0 written")
            .unwrap();
        // Layer 1 is not published: it cannot have arrived.
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert_eq!(t.layers_written(), 1);
        assert!(!t.is_done());
        assert_eq!(p.publish_layers(21, 2).unwrap(), 2);
        assert_eq!(offered.layers_published(), 2);
        let got = t.wait().await.unwrap();
        let want = TOKENS as u64 * model().bytes_per_token();
        assert_eq!((got.net_bytes, got.device_bytes), (want, want));
        assert_eq!(t.layers_written(), 2);
        assert_eq!(verify(&dst, 0, &dst_bufs), want);
        assert_eq!(
            offered.wait(Duration::from_secs(10)).await.unwrap(),
            OfferState::Released
        );
        // Publishing an ended or unknown registration is refused with its kind.
        assert_eq!(
            p.publish_layers(21, 2).unwrap_err().kind(),
            ErrorKind::UnknownRequest
        );
        assert_eq!(
            p.publish_layers(99, 1).unwrap_err().kind(),
            ErrorKind::UnknownRequest
        );
        p.shutdown(None).await;
        c.shutdown(None).await;
    });
}

/// `placements()` for a request of `tokens` (<= 112) whose block ids are rotated by `rot`: the
/// leading blocks of each rank, in another order, so the same arena offsets hold other tokens.
fn placements_of(tokens: u32, rot: usize) -> (Placement, Placement) {
    let (mut src, mut dst) = placements();
    for v in &mut src.block_ids {
        let n = v.len();
        v.rotate_left(rot % n);
        v.truncate(tokens.div_ceil(16) as usize);
    }
    for v in &mut dst.block_ids {
        let n = v.len();
        v.rotate_left(rot % n);
        v.truncate(tokens.div_ceil(32) as usize);
    }
    (src, dst)
}

/// Waits (up to 5 s) until `p`'s pool holds `n` idle arenas: the stagings of ended operations
/// are given back when their last holder (the endpoint's transfer or registration) drops them.
async fn idle_arenas(p: &Pipeline, n: u64) -> u64 {
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    loop {
        let idle = p.stats().pool.idle_arenas;
        if idle >= n || std::time::Instant::now() > deadline {
            return idle;
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// One pull (`push` false) or push of a request of `tokens` with block ids rotated by `rot`;
/// checks every element of the destination.
async fn one_op(
    (prod, cons): (&Side, &Side),
    (p, c): (&Pipeline, &Pipeline),
    id: u64,
    (tokens, rot, push): (u32, usize, bool),
) -> Result<()> {
    let (src, dst) = placements_of(tokens, rot);
    let src_kv = kv(
        prod,
        (0..2)
            .map(|r| (r, buffers_of(prod, &src, r, tokens, SRC_SALT)))
            .collect(),
    );
    let dst_bufs = background(cons, &dst, 0);
    let dst_kv = kv(cons, vec![(0, dst_bufs.clone())]);
    let want = tokens as u64 * model().bytes_per_token();
    if push {
        let rx = c.expect_push(ExpectPush {
            request_id: id,
            num_tokens: tokens,
            src: src.clone(),
            dst: dst.clone(),
            kv: dst_kv,
        })?;
        let tx = p.push(PushFrom {
            request_id: id,
            num_tokens: tokens,
            src,
            kv: src_kv,
            dst: dst.clone(),
            targets: PeerMap::single(addr(c)),
        })?;
        tx.wait().await?;
        assert_eq!(rx.wait().await?.device_bytes, want);
    } else {
        let h = p.offer(Offer {
            request_id: id,
            num_tokens: tokens,
            placement: src.clone(),
            kv: src_kv,
            expected_releases: 1,
        })?;
        let rep = c
            .pull(PullInto {
                request_id: id,
                num_tokens: tokens,
                src,
                sources: PeerMap::single(addr(p)),
                dst: dst.clone(),
                kv: dst_kv,
                wait_for_registration: None,
            })?
            .wait()
            .await?;
        assert_eq!(rep.device_bytes, want);
        assert_eq!(h.wait(Duration::from_secs(10)).await?, OfferState::Released);
    }
    assert_eq!(verify_of(&dst, 0, &dst_bufs, tokens), want, "request {id}");
    Ok(())
}

#[test]
fn pooled_staging_is_reused_across_operations_of_different_sizes_byte_exact() {
    let prod = side(2);
    let cons = side(1);
    let rt = rt();
    rt.block_on(async {
        let p = pipeline("pool-prod", true, TransferOptions::default())
            .await
            .unwrap();
        let c = pipeline("pool-cons", true, TransferOptions::default())
            .await
            .unwrap();
        assert_eq!(p.options().staging_pool_bytes, DEFAULT_POOL_BYTES);
        // (tokens, block rotation, push): sizes 100 / 40 / 17 tokens (25.6 / 10.2 / 4.4 KB of
        // destination staging) share the 64 KiB class; rotations put other tokens at the
        // same arena offsets, so a byte not written by the new operation would show.
        let ops = [
            (100, 0, false),
            (40, 1, false),
            (100, 0, false),
            (17, 2, true),
            (100, 3, true),
            (100, 0, false),
        ];
        for (i, op) in ops.into_iter().enumerate() {
            one_op((&prod, &cons), (&p, &c), 100 + i as u64, op)
                .await
                .unwrap();
            assert_eq!(idle_arenas(&p, 1).await, 1, "op {i}: producer staging back");
            assert_eq!(idle_arenas(&c, 1).await, 1, "op {i}: consumer staging back");
        }
        let n = ops.len() as u64;
        for (side, x) in [("producer", &p), ("consumer", &c)] {
            let st = x.stats().pool;
            assert_eq!((st.misses, st.hits), (1, n - 1), "{side}: {st:?}");
            assert_eq!((st.returned, st.released), (n, 0), "{side}: {st:?}");
            assert_eq!(st.idle_bytes, 64 << 10, "{side}: one 64 KiB class arena");
            // The idle arena still holds its budget bytes; no operation holds any.
            assert_eq!(x.budget().used(), st.idle_bytes, "{side}");
            assert_eq!(x.staging_in_use(), 0, "{side}");
        }
        // Plans: the consumer plans each pull and expected push, the producer each push and
        // each pull it serves; (100, rot 0) three times (two hits), the others once. (The
        // producer's two source ranks may both miss a new key at once, both building it.)
        let st = c.stats().plans;
        assert_eq!(
            (st.hits, st.misses, st.entries),
            (2, 4, 4),
            "consumer: {st:?}"
        );
        let st = p.stats().plans;
        assert!(
            st.hits >= 2 && st.misses >= 4 && st.entries == 4,
            "producer: {st:?}"
        );
        p.shutdown(None).await;
        c.shutdown(None).await;
    });
}

#[test]
fn the_pool_respects_its_cap_and_zero_turns_it_off() {
    let prod = side(2);
    let cons = side(1);
    let rt = rt();
    rt.block_on(async {
        // Off, and a cap below every staging of these requests (28 KiB): nothing is kept,
        // every arena is freed as without a pool.
        let off = TransferOptions {
            staging_pool_bytes: 0,
            ..TransferOptions::default()
        };
        let small = TransferOptions {
            staging_pool_bytes: 16 << 10,
            ..TransferOptions::default()
        };
        for (name, opts) in [("off", off), ("small", small)] {
            let p = pipeline(&format!("cap-{name}-p"), true, opts.clone())
                .await
                .unwrap();
            let c = pipeline(&format!("cap-{name}-c"), true, opts)
                .await
                .unwrap();
            for i in 0..3u64 {
                one_op((&prod, &cons), (&p, &c), 200 + i, (100, i as usize, i == 1))
                    .await
                    .unwrap();
                let deadline = std::time::Instant::now() + Duration::from_secs(5);
                while (p.budget().used(), c.budget().used()) != (0, 0)
                    && std::time::Instant::now() < deadline
                {
                    tokio::time::sleep(Duration::from_millis(2)).await;
                }
                assert_eq!((p.budget().used(), c.budget().used()), (0, 0), "{name}");
            }
            let st = c.stats().pool;
            assert_eq!(
                (st.hits, st.idle_arenas, st.idle_bytes),
                (0, 0, 0),
                "{name}: {st:?}"
            );
            assert_eq!(st.returned, 0, "{name}: {st:?}");
            assert_eq!((st.misses, st.released), (0, 3), "{name}: {st:?}");
            p.shutdown(None).await;
            c.shutdown(None).await;
        }
        // A cap of one class: one arena kept; an arena returned while another is idle evicts
        // the older one.
        let one = TransferOptions {
            staging_pool_bytes: 64 << 10,
            ..TransferOptions::default()
        };
        let p = pipeline("cap-one-p", true, one.clone()).await.unwrap();
        let c = pipeline("cap-one-c", true, one).await.unwrap();
        // Two registrations live at once: two producer arenas, one of which is kept.
        let (src, dst) = placements();
        let src_kv = src_kv(&prod, &src);
        let offers: Vec<_> = [301u64, 302]
            .iter()
            .map(|&id| {
                p.offer(Offer {
                    request_id: id,
                    num_tokens: TOKENS,
                    placement: src.clone(),
                    kv: src_kv.clone(),
                    expected_releases: 1,
                })
                .unwrap()
            })
            .collect();
        for (id, h) in [301u64, 302].into_iter().zip(offers) {
            pull_exact(&c, PeerMap::single(addr(&p)), &cons, (&src, &dst), id).await;
            h.wait(Duration::from_secs(10)).await.unwrap();
        }
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while p.stats().pool.returned + p.stats().pool.released < 2
            && std::time::Instant::now() < deadline
        {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        let st = p.stats().pool;
        assert_eq!((st.misses, st.hits), (2, 0), "{st:?}");
        assert_eq!((st.returned, st.released), (2, 1), "{st:?}");
        assert_eq!((st.idle_arenas, st.idle_bytes), (1, 64 << 10), "{st:?}");
        assert!(st.idle_bytes <= st.cap_bytes);
        p.shutdown(None).await;
        c.shutdown(None).await;
    });
}

#[test]
fn a_truncated_transfer_into_a_reused_arena_holding_its_very_bytes_still_fails() {
    use fault_util::{Action, FrameSel, Point, Rule};
    let (src, dst) = placements();
    let prod = side(2);
    let cons = side(1);
    let rt = rt();
    rt.block_on(async {
        let p = pipeline("stale-prod", true, TransferOptions::default())
            .await
            .unwrap();
        let (ep, faults) = fault_util::fault_endpoint(EndpointOptions {
            name: "stale-cons".into(),
            listen: None,
            io_timeout: Duration::from_secs(10),
            ..EndpointOptions::default()
        })
        .await;
        let c = Pipeline::new(
            Arc::new(ep),
            TransferOptions {
                staging_budget_bytes: Some(1 << 30),
                ..TransferOptions::default()
            },
        )
        .unwrap();
        let src_kv = src_kv(&prod, &src);
        let offer = |id| Offer {
            request_id: id,
            num_tokens: TOKENS,
            placement: src.clone(),
            kv: src_kv.clone(),
            expected_releases: 1,
        };
        let pull = |id, bufs: &Vec<DeviceBuffer>| PullInto {
            request_id: id,
            num_tokens: TOKENS,
            src: src.clone(),
            sources: PeerMap::single(addr(&p)),
            dst: dst.clone(),
            kv: kv(&cons, vec![(0, bufs.clone())]),
            wait_for_registration: None,
        };
        let want = TOKENS as u64 * model().bytes_per_token();
        // A complete pull: the consumer's arena goes back to the pool holding exactly the
        // bytes the same request will need again, at the same offsets.
        p.offer(offer(401)).unwrap();
        let first = background(&cons, &dst, 0);
        c.pull(pull(401, &first)).unwrap().wait().await.unwrap();
        assert_eq!(verify(&dst, 0, &first), want);
        assert_eq!(idle_arenas(&c, 1).await, 1);
        // The same request again, into that arena; its first data frame arrives half, then the
        // lane closes: the stale second half is byte for byte what should have arrived.
        faults.add(Rule::once(
            Point::Recv(FrameSel::data(402)),
            Action::Truncate,
        ));
        p.offer(offer(402)).unwrap();
        let cut = background(&cons, &dst, 0);
        let e = c.pull(pull(402, &cut)).unwrap().wait().await.unwrap_err();
        assert!(e.is_peer_failure(), "{e}");
        assert_eq!(faults.fired().len(), 1, "{:?}", faults.fired());
        let st = c.stats().pool;
        assert_eq!(
            (st.hits, st.misses),
            (1, 1),
            "the cut pull reused the arena: {st:?}"
        );
        // Nothing was written into the device for the failed pull.
        let bg = RankContents::new(
            &Placement {
                first_token: 0,
                block_ids: vec![],
                dp_rank: u32::MAX,
                ..dst.clone()
            },
            0,
            TOKENS,
            DST_SALT,
        )
        .unwrap();
        let mut host = vec![0u8; bg.kv().buffer_bytes() as usize];
        for (l, b) in cut.iter().enumerate() {
            b.to_host(&mut host).unwrap();
            assert_eq!(bg.verify_layer(l as u32, &host).unwrap().mismatches, 0);
        }
        // The producer kept the request: a retry (through the reused arena again) is exact.
        assert_eq!(idle_arenas(&c, 1).await, 1);
        let again = background(&cons, &dst, 0);
        c.pull(pull(402, &again)).unwrap().wait().await.unwrap();
        assert_eq!(verify(&dst, 0, &again), want);
        assert_eq!(c.stats().pool.hits, 2);
        p.shutdown(None).await;
        c.shutdown(None).await;
    });
}

/// A push large enough for its D2H to be split by groups of layers and overlapped with the
/// network (12 layers, 5 MiB staged on two source ranks: six groups of two layers, each
/// published as it is staged) arrives byte-exact and resharded, background untouched.
#[test]
fn a_large_multi_layer_push_staged_by_layer_groups_is_exact() {
    let m = ModelKv {
        name: "toy12".into(),
        num_layers: 12,
        num_kv_heads: 8,
        head_dim: 64,
        kv_planes: 2,
        dtype: DType::Bf16,
    };
    let tokens = 200;
    let src = Placement {
        first_token: 0,
        layout: ParallelLayout::new(m.clone(), ParallelSpec::parse("tp=2,block=16").unwrap(), 16)
            .unwrap(),
        dp_rank: 0,
        block_ids: vec![
            (0..13).rev().collect(),
            (0..13).map(|i| (i * 5 + 3) % 16).collect(),
        ],
        groups: None,
    };
    let dst = Placement {
        first_token: 0,
        layout: ParallelLayout::new(
            m.clone(),
            ParallelSpec::parse("tp=1,block=32,order=hnd").unwrap(),
            9,
        )
        .unwrap(),
        dp_rank: 0,
        block_ids: vec![vec![8, 3, 0, 6, 1, 7, 4]],
        groups: None,
    };
    let prod = side(2);
    let cons = side(1);
    rt().block_on(async {
        let (sent, got, dst_bufs) =
            push_through(&prod, &cons, (&src, &dst), tokens, 12, "push12").await;
        let want = tokens as u64 * m.bytes_per_token();
        assert!(
            sent.staged_bytes >= tpu_sync::transfer::PUSH_PIPELINE_MIN_BYTES,
            "{sent:?}"
        );
        assert_eq!(
            (sent.net_bytes, got.net_bytes, got.device_bytes),
            (want, want, want)
        );
        // Every layer's D2H ran: 13 whole blocks of 16 tokens on each of the two ranks, each
        // rank holding half of every token's bytes (TP=2 splits the heads).
        assert_eq!(sent.device_bytes, 2 * 13 * 16 * (m.bytes_per_token() / 2));
        assert_eq!(verify_of(&dst, 0, &dst_bufs, tokens), want);
    });
}

/// A pull from two producer endpoints (one per source rank) completes once its bytes are in
/// place; the delivering releases follow, to both producers at once, and a consumer that shuts
/// down right after the pull still delivers them: both offers end `Released`, not held until
/// their lease expires.
#[test]
fn releases_of_a_completed_pull_reach_every_producer_even_across_an_immediate_shutdown() {
    let (src, dst) = placements();
    let prod = side(2);
    let cons = side(1);
    rt().block_on(async {
        let want = TOKENS as u64 * model().bytes_per_token();
        for round in 0..3u64 {
            let id = 40 + round;
            let mut producers = Vec::new();
            let mut handles = Vec::new();
            for r in 0..2u32 {
                let p = pipeline(&format!("rel-prod{r}"), true, TransferOptions::default())
                    .await
                    .unwrap();
                let h = p
                    .offer(Offer {
                        request_id: id,
                        num_tokens: TOKENS,
                        placement: src.clone(),
                        kv: kv(&prod, vec![(r, buffers(&prod, &src, r, SRC_SALT))]),
                        expected_releases: 1,
                    })
                    .unwrap();
                handles.push(h);
                producers.push(p);
            }
            let c = pipeline("rel-cons", false, TransferOptions::default())
                .await
                .unwrap();
            let sources = PeerMap::parse(&format!(
                "0={},1={}",
                addr(&producers[0]),
                addr(&producers[1])
            ))
            .unwrap();
            let rep = pull_exact(&c, sources, &cons, (&src, &dst), id).await;
            assert_eq!((rep.net_bytes, rep.device_bytes), (want, want), "{rep:?}");
            // No drain: the releases still on their way are flushed before the abort.
            c.shutdown(None).await;
            for (r, h) in handles.iter().enumerate() {
                assert_eq!(
                    h.wait(Duration::from_secs(10)).await.unwrap(),
                    OfferState::Released,
                    "round {round}, producer of rank {r}"
                );
            }
            for p in &producers {
                assert_eq!(p.offer_state(id), OfferState::Released);
                p.shutdown(None).await;
            }
        }
    });
}

// ------------------------------------------------------------ the staging budget in a container

/// Memory limit of the test's memory cgroup: the "1.2 GiB container" of issue 24.
const CGROUP_LIMIT: u64 = 1200 << 20;
/// Environment of the child process: the `cgroup.procs` file to join (or `-` for the fallback
/// with a lowered budget instead of a cgroup).
const CGROUP_CHILD_ENV: &str = "TSYNC_TEST_CGROUP_PROCS";
const CGROUP_TEST: &str =
    "a_producer_in_a_memory_cgroup_refuses_registrations_instead_of_being_oom_killed";

/// A memory cgroup of its own (v1 `memory` controller or v2 with `memory` enabled), removed on
/// drop; `None` where this process cannot make one (not root, no writable cgroup filesystem).
struct MemoryCgroup {
    dir: std::path::PathBuf,
}

impl MemoryCgroup {
    fn create(limit: u64) -> Option<MemoryCgroup> {
        let name = format!("tpu-sync-test-{}", std::process::id());
        let tries = [
            ("/sys/fs/cgroup/memory", "memory.limit_in_bytes"),
            ("/sys/fs/cgroup", "memory.max"),
        ];
        for (root, file) in tries {
            let root = std::path::Path::new(root);
            if !root.join("cgroup.procs").exists() {
                continue;
            }
            let dir = root.join(&name);
            if std::fs::create_dir(&dir).is_err() {
                continue;
            }
            let cg = MemoryCgroup { dir };
            if std::fs::write(cg.dir.join(file), limit.to_string()).is_ok() {
                return Some(cg);
            }
        }
        None
    }
}

impl Drop for MemoryCgroup {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir(&self.dir);
    }
}

/// Issue 24, item 6: the staging budget follows the process's own memory cgroup. A producer in
/// a 1.2 GiB memory cgroup (a container; this test makes one where it may, as root) registers
/// 47 MiB requests until the budget (a quarter of the cgroup's limit, not of the host's memory)
/// refuses one with `StagingExhausted`; it is never OOM-killed, and its earlier registrations
/// stay. Before the fix the budget was a quarter of the host's memory, so the registrations
/// outgrew the cgroup and the kernel killed the producer. Where no cgroup can be made, the child
/// runs with the budget lowered to the same bytes instead (`TPU_SYNC_STAGING_BUDGET_BYTES`).
#[test]
fn a_producer_in_a_memory_cgroup_refuses_registrations_instead_of_being_oom_killed() {
    if let Some(procs) = std::env::var_os(CGROUP_CHILD_ENV) {
        return cgroup_child(procs);
    }
    let cg = MemoryCgroup::create(CGROUP_LIMIT);
    let mut cmd = std::process::Command::new(std::env::current_exe().unwrap());
    cmd.args([
        "--exact",
        &crate::test_name(module_path!(), CGROUP_TEST),
        "--nocapture",
        "--test-threads=1",
    ]);
    match &cg {
        Some(c) => {
            cmd.env(CGROUP_CHILD_ENV, c.dir.join("cgroup.procs"));
            cmd.env_remove("TPU_SYNC_STAGING_BUDGET_BYTES");
        }
        None => {
            eprintln!("no memory cgroup can be made here: the child runs with a lowered budget");
            cmd.env(CGROUP_CHILD_ENV, "-");
            cmd.env(
                "TPU_SYNC_STAGING_BUDGET_BYTES",
                (CGROUP_LIMIT / 4).to_string(),
            );
        }
    }
    let out = cmd.output().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    {
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(
            out.status.signal(),
            None,
            "the producer was killed (OOM?):\n{text}"
        );
    }
    assert!(out.status.success(), "{text}");
    let line = text
        .lines()
        .find_map(|l| l.split("CGROUP-CHILD registered ").nth(1))
        .unwrap_or_else(|| panic!("no result line:\n{text}"));
    let n: u64 = line.split_whitespace().next().unwrap().parse().unwrap();
    // A quarter of 1.2 GiB holds six 47 MiB stagings (each rounded up to whole pages).
    assert!((5..=6).contains(&n), "{n} registrations:\n{text}");
    drop(cg);
}

/// The child of the cgroup test: joins the cgroup, then registers until refused.
fn cgroup_child(procs: std::ffi::OsString) {
    if procs != "-" {
        std::fs::write(&procs, std::process::id().to_string()).unwrap();
        let (limit, _) = tpu_sync::budget::cgroup_memory().expect("the cgroup's limit is seen");
        assert_eq!(limit, CGROUP_LIMIT);
    }
    assert_eq!(
        tpu_sync::budget::StagingBudget::process().limit(),
        CGROUP_LIMIT / 4,
        "the process budget is a quarter of the cgroup's limit"
    );
    // 47 MiB of KV per request: 2 layers x 2 planes x 8 heads x 128 x bf16 = 8 KiB per token.
    let m = ModelKv {
        name: "toy-47mib".into(),
        num_layers: 2,
        num_kv_heads: 8,
        head_dim: 128,
        kv_planes: 2,
        dtype: DType::Bf16,
    };
    let tokens = 6016;
    let nb = tokens / 16;
    let src = Placement {
        first_token: 0,
        layout: ParallelLayout::new(m, ParallelSpec::parse("tp=1,block=16").unwrap(), nb).unwrap(),
        dp_rank: 0,
        block_ids: vec![(0..nb).collect()],
        groups: None,
    };
    let s = side(1);
    let kvl = src.layout.rank_kv().unwrap();
    let dev = s.client.device(0).unwrap();
    let zeros = vec![0u8; kvl.buffer_bytes() as usize];
    let bufs: Vec<DeviceBuffer> = (0..kvl.num_layers)
        .map(|_| {
            s.client
                .buffer_from_host(&zeros, kvl.dtype.element_type(), &kvl.dims(), &dev)
                .unwrap()
        })
        .collect();
    drop(zeros);
    let rt = rt();
    rt.block_on(async {
        let p = Pipeline::bind(
            EndpointOptions {
                name: "cgroup-prod".into(),
                listen: Some("127.0.0.1:0".parse().unwrap()),
                ..EndpointOptions::default()
            },
            TransferOptions::default(),
        )
        .await
        .unwrap();
        let kvb = kv(&s, vec![(0, bufs)]);
        let mut held = Vec::new();
        let err = loop {
            match p.offer(Offer {
                request_id: held.len() as u64 + 1,
                num_tokens: tokens,
                placement: src.clone(),
                kv: kvb.clone(),
                expected_releases: 1,
            }) {
                Ok(h) => held.push(h),
                Err(e) => break e,
            }
            assert!(held.len() < 64, "the budget never refused a registration");
        };
        assert_eq!(err.kind(), ErrorKind::StagingExhausted, "{err}");
        // The earlier registrations are still there.
        for id in 1..=held.len() as u64 {
            assert_eq!(p.offer_state(id), OfferState::Active);
        }
        println!("CGROUP-CHILD registered {} refused: {err}", held.len());
        p.shutdown(None).await;
    });
}

/// A failed pull's release names that pull, so a retry made at once is not undone by it. Every
/// release of the consumer is held 300 ms (a slow control path); the producer corrupts the
/// first chunk it sends, so the first pull fails with a checksum error; the immediate retry is
/// byte-exact, and the registration ends `Released` with the retry's release, although the
/// failed pull's non-delivering release reaches the producer after the retry's stripes. (When
/// releases did not name their pull, that late release ended the retry's lease at the producer,
/// which then refused the retry's delivering release and kept the request until its lease
/// expired.)
#[test]
fn a_retry_right_after_a_failed_pull_is_released() {
    let (src, dst) = placements();
    let prod = side(2);
    let cons = side(1);
    let rt = rt();
    rt.block_on(async {
        let bind = |name: &str, listen: bool, faults: FaultHooks| {
            Pipeline::bind(
                EndpointOptions {
                    name: name.into(),
                    listen: listen.then(|| "127.0.0.1:0".parse().unwrap()),
                    io_timeout: Duration::from_secs(10),
                    faults,
                    ..EndpointOptions::default()
                },
                TransferOptions {
                    staging_budget_bytes: Some(1 << 30),
                    ..TransferOptions::default()
                },
            )
        };
        let p = bind(
            "late-release-prod",
            true,
            FaultHooks {
                corrupt_at_offset: Some(10),
                ..FaultHooks::default()
            },
        )
        .await
        .unwrap();
        let c = bind(
            "late-release-cons",
            false,
            FaultHooks {
                delay_releases: Some(Duration::from_millis(300)),
                ..FaultHooks::default()
            },
        )
        .await
        .unwrap();
        let src_kv = src_kv(&prod, &src);
        let h = p
            .offer(Offer {
                request_id: 31,
                num_tokens: TOKENS,
                placement: src.clone(),
                kv: src_kv,
                expected_releases: 1,
            })
            .unwrap();
        let dst_bufs = background(&cons, &dst, 0);
        let pull = || PullInto {
            request_id: 31,
            num_tokens: TOKENS,
            src: src.clone(),
            sources: PeerMap::single(addr(&p)),
            dst: dst.clone(),
            kv: kv(&cons, vec![(0, dst_bufs.clone())]),
            wait_for_registration: None,
        };
        let e = c.pull(pull()).unwrap().wait().await.unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Checksum, "{e}");
        let want = TOKENS as u64 * model().bytes_per_token();
        let rep = c.pull(pull()).unwrap().wait().await.unwrap();
        assert_eq!(rep.device_bytes, want);
        assert_eq!(verify(&dst, 0, &dst_bufs), want);
        assert_eq!(
            h.wait(Duration::from_secs(5)).await.unwrap(),
            OfferState::Released
        );
        for x in [&p, &c] {
            x.shutdown(None).await;
        }
    });
}
