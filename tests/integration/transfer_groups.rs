//! KV cache groups through `tpu_sync::transfer` on the real XLA CPU plugin: two pipelines in one
//! process over loopback TCP, real device buffers shaped per group (so layers of different
//! groups have buffers of different shapes and block counts), filled with
//! `tpu_sync::pattern::GroupedContents`.
//!
//! * a producer offers a grouped placement (TP=2, 16-token NHD blocks); a consumer pulls it into
//!   TP=1 x PCP=2 with 8-token HND blocks: every byte of every consumer buffer checked (the
//!   request element by element, everything else unchanged), moved = needed per group;
//! * the same request pushed (producer -> consumer expecting the push): byte-exact, moved =
//!   needed per group; a consumer expecting other groups (another window) refuses the push with
//!   `Mismatch` before any byte is written;
//! * a buffer of another group's shape is refused per group, before anything is staged;
//! * a consumer whose groups differ (a group missing, another window, another state shape) and
//!   which believes the producer's differ the same way (so its own plan passes) is refused by
//!   the producer at the handshake, with `Mismatch`, before any byte moves; the same producer
//!   then serves the right consumer.

use crate::common;

use std::collections::BTreeMap;
use std::time::Duration;

use tpu_sync::layout::{
    DType, GroupKind, GroupLayout, HybridLayout, HybridModel, KvGroup, ParallelSpec, StateComponent,
};
use tpu_sync::net::{EndpointOptions, PeerMap};
use tpu_sync::pattern::GroupedContents;
use tpu_sync::pjrt::{Capabilities, Client, DeviceBuffer};
use tpu_sync::plan::{HybridPlacement, Placement, Plan};
use tpu_sync::transfer::{
    ExpectPush, KvBuffers, Offer, OfferState, Pipeline, PullInto, PushFrom, TransferOptions,
};
use tpu_sync::{ErrorKind, Result};

const SRC_SALT: u64 = 0x5352_4300;
const DST_SALT: u64 = 0x4453_5400;
const TOKENS: u32 = 50;

/// Sliding window (layers 0, 2), full attention (1, 3), a linear-attention state (4).
fn model() -> HybridModel {
    let attn = |window| GroupKind::Attention {
        num_kv_heads: 4,
        head_dim: 8,
        kv_planes: 2,
        dtype: DType::Bf16,
        sliding_window: window,
    };
    HybridModel {
        name: "toy-hybrid".into(),
        groups: vec![
            KvGroup::new("sliding", [0, 2], attn(Some(24))),
            KvGroup::new("full", [1, 3], attn(None)),
            KvGroup::new(
                "linear",
                [4],
                GroupKind::State {
                    components: vec![
                        StateComponent::new("conv", DType::Bf16, 3, &[(4, 8), (2, 8)]),
                        StateComponent::new("ssm", DType::F32, 1, &[(4, 32)]),
                    ],
                    replicated: false,
                },
            ),
        ],
    }
}

fn scattered(n: u32, take: usize, seed: u64) -> Vec<u32> {
    let mut ids: Vec<u32> = (0..n).collect();
    for i in (1..ids.len()).rev() {
        let j = (tpu_sync::pattern::mix64(seed ^ i as u64) % (i as u64 + 1)) as usize;
        ids.swap(i, j);
    }
    ids.truncate(take);
    ids
}

/// A placement of `m` under `spec` with per-group block counts (different per group).
fn placement(m: &HybridModel, spec: &str, seed: u64) -> HybridPlacement {
    let spec = ParallelSpec::parse(spec).unwrap();
    let groups = m
        .groups
        .iter()
        .enumerate()
        .map(|(g, grp)| {
            GroupLayout::new(if grp.kind.is_state() {
                3
            } else {
                9 + 2 * g as u32
            })
        })
        .collect();
    let layout = HybridLayout::new(m.clone(), spec, groups).unwrap();
    let block_ids = (0..layout.groups.len())
        .map(|g| {
            (0..spec.ranks_per_replica())
                .map(|local| {
                    let n = layout
                        .held_blocks(g, TOKENS, local / spec.tp)
                        .unwrap()
                        .len();
                    scattered(
                        layout.groups[g].num_blocks,
                        n,
                        seed ^ (local * 7 + g as u32) as u64,
                    )
                })
                .collect()
        })
        .collect();
    let p = HybridPlacement {
        layout,
        dp_rank: 0,
        block_ids,
        first_token: 0,
        next_token: None,
    };
    p.validate(TOKENS).unwrap();
    p
}

fn buffers(client: &Client, p: &HybridPlacement, rank: u32, salt: u64) -> Vec<DeviceBuffer> {
    let c = GroupedContents::new(p, rank, TOKENS, salt).unwrap();
    let dev = client.device(rank as usize).unwrap();
    (0..p.layout.num_layers())
        .map(|l| {
            let s = p.layout.layer_shape(l).unwrap();
            let mut host = vec![0u8; s.bytes as usize];
            c.fill_layer(l, &mut host).unwrap();
            client
                .buffer_from_host(&host, s.element_type, &s.dims, &dev)
                .unwrap()
        })
        .collect()
}

fn background(client: &Client, p: &HybridPlacement, rank: u32) -> Vec<DeviceBuffer> {
    let bg = HybridPlacement {
        dp_rank: u32::MAX,
        block_ids: vec![],
        first_token: 0,
        next_token: None,
        ..p.clone()
    };
    buffers(client, &bg, rank, DST_SALT)
}

fn host(bufs: &[DeviceBuffer]) -> Vec<Vec<u8>> {
    bufs.iter()
        .map(|b| {
            let mut v = vec![0u8; b.on_device_size() as usize];
            b.to_host(&mut v).unwrap();
            v
        })
        .collect()
}

fn kv(caps: &Capabilities, by_rank: Vec<(u32, Vec<DeviceBuffer>)>) -> KvBuffers {
    KvBuffers::new(caps, by_rank.into_iter().collect::<BTreeMap<_, _>>()).unwrap()
}

async fn pipeline(name: &str, listen: bool) -> Result<Pipeline> {
    Pipeline::bind(
        EndpointOptions {
            name: name.into(),
            listen: listen.then(|| "127.0.0.1:0".parse().unwrap()),
            io_timeout: Duration::from_secs(10),
            ..EndpointOptions::default()
        },
        TransferOptions {
            staging_budget_bytes: Some(1 << 30),
            ..TransferOptions::default()
        },
    )
    .await
}

/// The consumer's model, changed as `how` says.
fn mutated(how: &str) -> HybridModel {
    let mut m = model();
    match how {
        "missing" => {
            m.groups.pop();
        }
        "window" => {
            if let GroupKind::Attention { sliding_window, .. } = &mut m.groups[0].kind {
                *sliding_window = Some(32);
            }
        }
        "state" => {
            if let GroupKind::State { components, .. } = &mut m.groups[2].kind {
                components[1].segments[0].head_elems = 16;
            }
        }
        _ => unreachable!(),
    }
    m
}

/// The two sides of a test: a producer and a consumer client with two devices each, their
/// capabilities, and a runtime.
struct Sides {
    prod: Client,
    pcaps: Capabilities,
    cons: Client,
    ccaps: Capabilities,
    rt: tokio::runtime::Runtime,
}

fn sides() -> Sides {
    let prod = common::client(2);
    let cons = common::client(2);
    Sides {
        pcaps: Capabilities::probe(&prod).unwrap(),
        ccaps: Capabilities::probe(&cons).unwrap(),
        prod,
        cons,
        rt: tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap(),
    }
}

#[test]
fn grouped_pull_is_byte_exact_and_mismatched_groups_are_refused_at_the_handshake() {
    let src = placement(&model(), "tp=2,block=16", 0x11);
    let dst = placement(&model(), "tp=1,pcp=2,block=8,order=hnd", 0x22);
    let Sides {
        prod,
        pcaps,
        cons,
        ccaps,
        rt,
    } = sides();
    rt.block_on(async {
        let p = pipeline("groups-prod", true).await.unwrap();
        let c = pipeline("groups-cons", false).await.unwrap();
        let addr = p.endpoint().local_addr().unwrap().to_string();
        let src_bufs: Vec<Vec<DeviceBuffer>> =
            (0..2).map(|r| buffers(&prod, &src, r, SRC_SALT)).collect();
        assert_ne!(
            src_bufs[0][0].on_device_size(),
            src_bufs[0][1].on_device_size(),
            "the sliding and full groups have buffers of different block counts"
        );
        let src_p = Placement::from_groups(src.clone()).unwrap();

        // A layer given another group's buffer (layers 0 and 1 swapped): refused per group.
        let mut swapped = src_bufs[0].clone();
        swapped.swap(0, 1);
        let e = p
            .offer(Offer {
                request_id: 9,
                num_tokens: TOKENS,
                placement: src_p.clone(),
                kv: kv(&pcaps, vec![(0, swapped)]),
                expected_releases: 1,
            })
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Mismatch, "{e}");
        let msg = e.to_string();
        assert!(
            msg.contains("rank 0 layer 0 (KV cache group 0 (`sliding`)"),
            "{msg}"
        );
        assert_eq!(p.staging_in_use(), 0, "nothing staged");

        let offered = p
            .offer(Offer {
                request_id: 7,
                num_tokens: TOKENS,
                placement: src_p.clone(),
                kv: kv(
                    &pcaps,
                    (0..2).map(|r| (r, src_bufs[r as usize].clone())).collect(),
                ),
                expected_releases: 1,
            })
            .unwrap();
        let staged: u64 = (0..2)
            .map(|l| {
                src.block_ranges(l)
                    .unwrap()
                    .iter()
                    .map(|r| r.len)
                    .sum::<u64>()
            })
            .sum();
        assert_eq!(offered.report().device_bytes, staged);

        // Mismatched groups: refused by the producer before any byte moves.
        for how in ["missing", "window", "state"] {
            let m = mutated(how);
            let bad_dst = placement(&m, "tp=1,pcp=2,block=8,order=hnd", 0x22);
            let believed = placement(&m, "tp=2,block=16", 0x11);
            let bad_dst_p = Placement::from_groups(bad_dst.clone()).unwrap();
            let believed_p = Placement::from_groups(believed).unwrap();
            // The consumer's own plan passes (it believes the producer has its groups) ...
            Plan::build(&believed_p, &bad_dst_p, TOKENS).unwrap();
            // ... but not against the producer's real groups.
            let local = Plan::build(&src_p, &bad_dst_p, TOKENS).unwrap_err();
            assert_eq!(local.kind(), ErrorKind::Mismatch, "{how}: {local}");
            let bufs: Vec<Vec<DeviceBuffer>> =
                (0..2).map(|r| background(&cons, &bad_dst, r)).collect();
            let before: Vec<_> = bufs.iter().map(|b| host(b)).collect();
            let e = c
                .pull(PullInto {
                    request_id: 7,
                    num_tokens: TOKENS,
                    src: believed_p,
                    sources: PeerMap::single(addr.clone()),
                    dst: bad_dst_p,
                    kv: kv(
                        &ccaps,
                        (0..2).map(|r| (r, bufs[r as usize].clone())).collect(),
                    ),
                    wait_for_registration: None,
                })
                .unwrap()
                .wait()
                .await
                .unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Mismatch, "{how}: {e}");
            assert!(e.to_string().contains("differ"), "{how}: {e}");
            for (b, want) in bufs.iter().zip(before) {
                assert_eq!(host(b), want, "{how}: nothing written");
            }
            assert_eq!(c.stats().endpoint.bytes_received, 0, "{how}: no byte moved");
            assert_eq!(p.offer_state(7), OfferState::Active, "{how}");
        }

        // The right consumer: byte-exact, every other byte unchanged, moved = needed per group.
        let dst_bufs: Vec<Vec<DeviceBuffer>> = (0..2).map(|r| background(&cons, &dst, r)).collect();
        let dst_p = Placement::from_groups(dst.clone()).unwrap();
        let plan = Plan::build(&src_p, &dst_p, TOKENS).unwrap();
        let rep = c
            .pull(PullInto {
                request_id: 7,
                num_tokens: TOKENS,
                src: src_p.clone(),
                sources: PeerMap::single(addr.clone()),
                dst: dst_p,
                kv: kv(
                    &ccaps,
                    (0..2).map(|r| (r, dst_bufs[r as usize].clone())).collect(),
                ),
                wait_for_registration: None,
            })
            .unwrap()
            .wait()
            .await
            .unwrap();
        let needed = dst.needed_bytes(TOKENS).unwrap();
        assert_eq!(plan.group_bytes(&dst.layout), needed);
        assert!(needed.iter().all(|&n| n > 0), "{needed:?}");
        assert_eq!(rep.net_bytes, needed.iter().sum::<u64>());
        assert_eq!(rep.device_bytes, rep.net_bytes);
        let checked = verify(&dst, &dst_bufs);
        assert_eq!(checked, rep.net_bytes);
        assert_eq!(
            offered.wait(Duration::from_secs(10)).await.unwrap(),
            OfferState::Released
        );
        p.shutdown(None).await;
        c.shutdown(None).await;
    });
}

#[test]
fn grouped_placements_keep_their_form_on_the_wire() {
    let src = placement(&model(), "tp=2,block=16", 0x11);
    let p = Placement::from_groups(src.clone()).unwrap();
    let json = serde_json::to_string(&p).unwrap();
    let back: Placement = serde_json::from_str(&json).unwrap();
    assert_eq!(back, p);
    assert_eq!(back.to_groups(), src);
    back.validate(TOKENS).unwrap();
    // A peer cannot describe one thing in the uniform fields and another in the groups.
    let mut bad = p.clone();
    bad.layout.spec.tp = 1;
    assert_eq!(bad.validate(TOKENS).unwrap_err().kind(), ErrorKind::Layout);
    let mut bad = p.clone();
    bad.block_ids[0].push(0);
    assert_eq!(bad.validate(TOKENS).unwrap_err().kind(), ErrorKind::Layout);
    // Staged ranges are the groups' own.
    assert_eq!(p.try_block_ranges(1).unwrap(), src.block_ranges(1).unwrap());
    assert!(p.try_block_ranges(2).is_err());
    // A uniform placement is unchanged on the wire (no `groups` key).
    let u = tpu_sync::plan::Placement {
        first_token: 0,
        groups: None,
        ..p.clone()
    };
    assert!(!serde_json::to_string(&u).unwrap().contains("groups"));
}

/// Checks every consumer buffer: the request's bytes element by element, everything else
/// unchanged; returns the request bytes checked.
fn verify(dst: &HybridPlacement, dst_bufs: &[Vec<DeviceBuffer>]) -> u64 {
    let mut checked = 0;
    for (r, bufs) in dst_bufs.iter().enumerate() {
        let g = GroupedContents::new(dst, r as u32, TOKENS, DST_SALT).unwrap();
        for (l, data) in host(bufs).iter().enumerate() {
            let c = g.verify_layer(l as u32, data).unwrap();
            assert_eq!(
                c.mismatches, 0,
                "rank {r} layer {l}: {:?}",
                c.first_mismatch
            );
            checked += c.request_bytes;
        }
    }
    checked
}

#[test]
fn grouped_push_is_byte_exact_and_a_consumer_of_other_groups_refuses_it() {
    let src = placement(&model(), "tp=2,block=16", 0x31);
    let dst = placement(&model(), "tp=1,pcp=2,block=8,order=hnd", 0x42);
    let Sides {
        prod,
        pcaps,
        cons,
        ccaps,
        rt,
    } = sides();
    rt.block_on(async {
        let p = pipeline("groups-push-prod", false).await.unwrap();
        let c = pipeline("groups-push-cons", true).await.unwrap();
        let addr = c.endpoint().local_addr().unwrap().to_string();
        let src_bufs: Vec<Vec<DeviceBuffer>> =
            (0..2).map(|r| buffers(&prod, &src, r, SRC_SALT)).collect();
        let src_p = Placement::from_groups(src.clone()).unwrap();
        let dst_p = Placement::from_groups(dst.clone()).unwrap();
        let src_kv = || {
            kv(
                &pcaps,
                (0..2).map(|r| (r, src_bufs[r as usize].clone())).collect(),
            )
        };

        let consumer = |bufs: &[Vec<DeviceBuffer>]| {
            kv(
                &ccaps,
                (0..2).map(|r| (r, bufs[r as usize].clone())).collect(),
            )
        };
        // Expects request `id` on `c` (as `src -> dst` into `kv`), then pushes it from the
        // producer as it sees the request (`src_p -> dst_p`): the expectation and the push's
        // result.
        let push_pair =
            |id: u64, (c, src, dst, kv): (&Pipeline, &Placement, &Placement, KvBuffers)| {
                let expect = c
                    .expect_push(ExpectPush {
                        request_id: id,
                        num_tokens: TOKENS,
                        src: src.clone(),
                        dst: dst.clone(),
                        kv,
                    })
                    .unwrap();
                let push = p
                    .push(PushFrom {
                        request_id: id,
                        num_tokens: TOKENS,
                        src: src_p.clone(),
                        kv: src_kv(),
                        dst: dst_p.clone(),
                        targets: PeerMap::single(addr.clone()),
                    })
                    .unwrap();
                async move { (expect, push.wait().await) }
            };
        // A consumer that expects another sliding window (and believes the producer has it
        // too, so its own plan passes) refuses the producer's push: nothing is written.
        let m = mutated("window");
        let bad_dst = placement(&m, "tp=1,pcp=2,block=8,order=hnd", 0x42);
        let bad_bufs: Vec<Vec<DeviceBuffer>> =
            (0..2).map(|r| background(&cons, &bad_dst, r)).collect();
        let before: Vec<_> = bad_bufs.iter().map(|b| host(b)).collect();
        let bad_src = Placement::from_groups(placement(&m, "tp=2,block=16", 0x31)).unwrap();
        let bad_dst_p = Placement::from_groups(bad_dst.clone()).unwrap();
        let (expect, pushed) = push_pair(21, (&c, &bad_src, &bad_dst_p, consumer(&bad_bufs))).await;
        let e = pushed.unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Mismatch, "{e}");
        for (b, want) in bad_bufs.iter().zip(before) {
            assert_eq!(host(b), want, "nothing written");
        }
        expect.cancel();
        assert!(
            expect.wait().await.is_err(),
            "the refused expectation does not succeed"
        );

        // The right consumer: byte-exact, moved = needed per group.
        let dst_bufs: Vec<Vec<DeviceBuffer>> = (0..2).map(|r| background(&cons, &dst, r)).collect();
        let (expect, sent) = push_pair(22, (&c, &src_p, &dst_p, consumer(&dst_bufs))).await;
        let sent = sent.unwrap();
        let got = expect.wait().await.unwrap();
        let needed: u64 = dst.needed_bytes(TOKENS).unwrap().iter().sum();
        assert_eq!(sent.net_bytes, needed);
        assert_eq!(got.device_bytes, needed);
        assert_eq!(verify(&dst, &dst_bufs), needed);
        p.shutdown(None).await;
        c.shutdown(None).await;
    });
}
