//! Byte-exact KV transfers between in-process endpoints over TCP, TLS, QUIC and shm: pull and push for
//! many layout pairs, prefill ranks in separate endpoints, a rank with no bytes, layer
//! pipelining, request-id limits.

use crate::net_util;

use std::time::Duration;

use net_util::*;
use tpu_sync::net::{
    Endpoint, EndpointOptions, PeerMap, PullRequest, PushRequest, SourceOutcome,
    SourceRegistration, TransportKind,
};
use tpu_sync::plan::{Placement, Plan};

const LAYOUTS: &[(&str, &str, u32, u32)] = &[
    // (prefill spec, decode spec, tokens, decode DP rank)
    (
        "tp=2,pcp=2,block=64",
        "tp=1,dp=2,block=16,order=hnd",
        333,
        1,
    ),
    ("tp=4,block=16", "tp=1,block=16", 200, 0),
    ("pcp=4,block=32", "block=32,order=hnd", 500, 0),
    ("tp=1,block=48,order=hnd", "tp=2,block=20", 333, 0),
    ("tp=16,block=16", "tp=2,pcp=2,block=64,order=hnd", 100, 0),
    ("tp=2,block=16", "tp=8,block=16", 77, 0),
];

struct Case {
    src: Placement,
    dst: Placement,
    tokens: u32,
    plan: Plan,
}

fn case(m: &tpu_sync::layout::ModelKv, s: &str, d: &str, tokens: u32, dp: u32, seed: u64) -> Case {
    let src = placement(layout(m, s, tokens), 0, tokens, seed);
    let dst = placement(layout(m, d, tokens), dp, tokens, seed ^ 0xdead);
    let plan = Plan::build(&src, &dst, tokens).unwrap();
    Case {
        src,
        dst,
        tokens,
        plan,
    }
}

async fn pull_once(prefill: &Endpoint, decode: &Endpoint, c: &Case, rid: u64) -> u64 {
    let h = register_whole(prefill, &c.src, c.tokens, rid);
    let addr = prefill.local_addr().unwrap().to_string();
    let (p, n) = decode.describe(&addr, rid).await.unwrap();
    assert_eq!((p, n), (c.src.clone(), c.tokens));
    let dst_st = dest_staging(&c.plan, &c.dst, None);
    let t = decode
        .pull(PullRequest {
            request_id: rid,
            num_tokens: c.tokens,
            src: c.src.clone(),
            sources: PeerMap::single(addr.clone()),
            dst: c.dst.clone(),
            staging: dst_st.clone(),
            dst_ranks: None,
            plan: None,
            wait_for_registration: None,
        })
        .unwrap();
    let stats = t.wait().await.unwrap();
    assert_eq!(stats.bytes, c.plan.total_bytes());
    assert_eq!(t.layers_complete(), c.dst.layout.model.num_layers);
    assert_eq!(
        verify_dest(&c.dst, c.tokens, &dst_st, None),
        c.plan.total_bytes()
    );
    decode.release(&addr, rid).await.unwrap();
    assert_eq!(
        h.wait(Duration::from_secs(5)).await.unwrap(),
        SourceOutcome::Released
    );
    stats.bytes
}

async fn push_once(prefill: &Endpoint, decode: &Endpoint, c: &Case, rid: u64) -> u64 {
    let dst_st = dest_staging(&c.plan, &c.dst, None);
    let sink = decode
        .expect_push(sink_whole(&c.dst, c.tokens, rid, dst_st.clone(), None))
        .unwrap();
    let addr = decode.local_addr().unwrap().to_string();
    let (p, _) = prefill.describe_sink(&addr, rid).await.unwrap();
    assert_eq!(p, c.dst);
    let t = prefill
        .push(push_whole(
            &c.src,
            &c.dst,
            c.tokens,
            rid,
            None,
            PeerMap::single(addr),
        ))
        .unwrap();
    let sent = t.wait().await.unwrap();
    let got = sink.wait().await.unwrap();
    assert_eq!(sent.bytes, c.plan.total_bytes());
    assert_eq!(got.bytes, c.plan.total_bytes());
    assert_eq!(
        verify_dest(&c.dst, c.tokens, &dst_st, None),
        c.plan.total_bytes()
    );
    got.bytes
}

/// [`pull_once`] then [`push_once`] of `c` (request ids `rid + 1`, `rid + 2`; `rid` advanced),
/// each moving exactly the plan's bytes.
async fn pull_and_push(prefill: &Endpoint, decode: &Endpoint, c: &Case, rid: &mut u64) {
    *rid += 1;
    assert_eq!(
        pull_once(prefill, decode, c, *rid).await,
        c.plan.total_bytes()
    );
    *rid += 1;
    assert_eq!(
        push_once(prefill, decode, c, *rid).await,
        c.plan.total_bytes()
    );
}

#[test]
fn pull_and_push_many_layouts_over_every_transport() {
    run(Duration::from_secs(240), async {
        let pki = pki(&["prefill", "decode"]);
        let m = model(2);
        let mla = {
            let mut m = tpu_sync::layout::ModelKv::preset("deepseek-v3").unwrap();
            m.num_layers = 2;
            m
        };
        for kind in KINDS {
            let prefill = endpoint(kind, &pki, "prefill", true).await;
            let decode = endpoint(kind, &pki, "decode", true).await;
            let mut rid = 1000;
            let mut cases: Vec<Case> = LAYOUTS
                .iter()
                .enumerate()
                .map(|(i, (s, d, t, dp))| case(&m, s, d, *t, *dp, i as u64))
                .collect();
            cases.push(case(
                &mla,
                "tp=2,block=64",
                "tp=1,dp=2,block=16,order=hnd",
                150,
                1,
                9,
            ));
            for c in &cases {
                pull_and_push(&prefill, &decode, c, &mut rid).await;
            }
            // Everything released: nothing registered, leased or staged remains on either side.
            for ep in [&prefill, &decode] {
                let s = ep.stats();
                assert_eq!(
                    (
                        s.source_registrations,
                        s.sink_registrations,
                        s.leases,
                        s.staged_bytes
                    ),
                    (0, 0, 0, 0),
                    "{kind}: {s:?}"
                );
                assert_eq!(s.transfers_in_flight, 0, "{kind}");
                assert_eq!(s.checksum_failures, 0, "{kind}");
            }
            // Same host: every byte the decode received was copied straight out of the
            // prefill's staging (both directions: pulls and pushes land in the decode).
            let s = decode.stats();
            let by_ref = if kind == TransportKind::Shm {
                s.bytes_received
            } else {
                0
            };
            assert!(s.bytes_received > 0, "{kind}");
            assert_eq!(s.bytes_received_by_reference, by_ref, "{kind}: {s:?}");
            // Lanes were reused: at most one control lane and max_lanes_per_peer (8) data lanes
            // per direction, for 14 transfers of up to 12 stripes each.
            assert!(
                s.lanes_opened <= 2 * (8 + 1),
                "{kind}: {} lanes opened",
                s.lanes_opened
            );
            prefill.shutdown(None).await;
            decode.shutdown(None).await;
        }
    });
}

/// The shm transport's fallbacks: lanes without cross-memory attach (payload inline on the Unix
/// socket), and an shm endpoint talking to a TCP-only endpoint (plain TCP), in both roles.
#[test]
fn shm_inline_fallback_and_tcp_peers() {
    use std::sync::Arc;
    use tpu_sync::net::shm::ShmTransport;
    use tpu_sync::net::transport::TransportTimeouts;
    run(Duration::from_secs(120), async {
        let pki = pki(&["prefill", "decode"]);
        let m = model(2);
        let c = case(&m, "tp=2,block=16", "tp=1,block=32,order=hnd", 333, 0, 5);
        let t = TransportTimeouts {
            connect: Duration::from_secs(3),
            handshake: Duration::from_secs(3),
        };
        let inline = |name: &str| {
            Endpoint::with_transport(
                opts(
                    TransportKind::Shm,
                    tpu_sync::net::Security::None,
                    name,
                    true,
                ),
                Arc::new(ShmTransport::inline_only(t)),
            )
        };
        // Inline on both sides, then one side inline and the other by reference.
        let pairs: Vec<(Endpoint, Endpoint, &str)> = vec![
            (
                inline("prefill").await.unwrap(),
                inline("decode").await.unwrap(),
                "inline",
            ),
            (
                endpoint(TransportKind::Shm, &pki, "prefill", true).await,
                inline("decode").await.unwrap(),
                "decode inline",
            ),
            (
                endpoint(TransportKind::Shm, &pki, "prefill", true).await,
                endpoint(TransportKind::Tcp, &pki, "decode", true).await,
                "shm prefill, tcp decode",
            ),
            (
                endpoint(TransportKind::Tcp, &pki, "prefill", true).await,
                endpoint(TransportKind::Shm, &pki, "decode", true).await,
                "tcp prefill, shm decode",
            ),
        ];
        let mut rid = 7000;
        for (prefill, decode, what) in pairs {
            pull_and_push(&prefill, &decode, &c, &mut rid).await;
            let s = decode.stats();
            assert_eq!(s.bytes_received, 2 * c.plan.total_bytes(), "{what}");
            assert_eq!(s.bytes_received_by_reference, 0, "{what}: {s:?}");
            assert_eq!(s.checksum_failures, 0, "{what}");
            prefill.shutdown(None).await;
            decode.shutdown(None).await;
        }
    });
}

#[test]
fn prefill_ranks_in_separate_endpoints_pull_and_push() {
    run(Duration::from_secs(120), async {
        let pki = pki(&["p0", "p1", "p2", "p3", "decode"]);
        for kind in [TransportKind::Tcp, TransportKind::Quic] {
            let m = model(2);
            let c = case(
                &m,
                "tp=2,pcp=2,block=32",
                "tp=2,block=16,order=hnd",
                250,
                0,
                5,
            );
            // One endpoint per prefill rank, each staging only its own rank.
            let mut prefills = Vec::new();
            for r in 0..4u32 {
                prefills.push(endpoint(kind, &pki, &format!("p{r}"), true).await);
            }
            let decode = endpoint(kind, &pki, "decode", true).await;
            let mut sources = PeerMap::default();
            let mut handles = Vec::new();
            for (r, ep) in prefills.iter().enumerate() {
                let r = r as u32;
                sources = sources.with(r, ep.local_addr().unwrap().to_string());
                handles.push(
                    ep.register_source(SourceRegistration {
                        request_id: 7,
                        num_tokens: c.tokens,
                        placement: c.src.clone(),
                        staging: source_staging(&c.src, c.tokens, Some(&[r])),
                        layers_ready: None,
                        expected_releases: 1,
                    })
                    .unwrap(),
                );
            }
            let dst_st = dest_staging(&c.plan, &c.dst, None);
            let t = decode
                .pull(PullRequest {
                    request_id: 7,
                    num_tokens: c.tokens,
                    src: c.src.clone(),
                    sources: sources.clone(),
                    dst: c.dst.clone(),
                    staging: dst_st.clone(),
                    dst_ranks: None,
                    plan: None,
                    wait_for_registration: None,
                })
                .unwrap();
            let st = t.wait().await.unwrap();
            assert_eq!(st.pairs, c.plan.pairs().len() as u64);
            assert_eq!(
                verify_dest(&c.dst, c.tokens, &dst_st, None),
                c.plan.total_bytes()
            );
            // Each prefill endpoint sent exactly its rank's bytes.
            for (r, ep) in prefills.iter().enumerate() {
                let want: u64 = c
                    .plan
                    .spans
                    .iter()
                    .filter(|s| s.src_rank == r as u32)
                    .map(|s| s.bytes())
                    .sum();
                assert_eq!(ep.stats().bytes_sent, want, "rank {r}");
            }
            for a in sources.addresses(0..4).unwrap() {
                decode.release(&a, 7).await.unwrap();
            }
            for h in &handles {
                assert_eq!(
                    h.wait(Duration::from_secs(5)).await.unwrap(),
                    SourceOutcome::Released
                );
            }

            // Push from the four endpoints into one decode endpoint: complete only after all.
            let dst_st = dest_staging(&c.plan, &c.dst, None);
            let sink = decode
                .expect_push(sink_whole(
                    &c.dst,
                    c.tokens,
                    8,
                    dst_st.clone(),
                    Some(&c.src),
                ))
                .unwrap();
            let target = PeerMap::single(decode.local_addr().unwrap().to_string());
            for (r, ep) in prefills.iter().enumerate() {
                let t = ep
                    .push(push_whole(
                        &c.src,
                        &c.dst,
                        c.tokens,
                        8,
                        Some(&[r as u32]),
                        target.clone(),
                    ))
                    .unwrap();
                t.wait().await.unwrap();
                if r < 3 {
                    assert!(
                        sink.poll().is_none(),
                        "complete before every sender finished"
                    );
                }
            }
            let got = sink.wait_timeout(Duration::from_secs(10)).await.unwrap();
            assert_eq!(got.bytes, c.plan.total_bytes());
            assert_eq!(
                verify_dest(&c.dst, c.tokens, &dst_st, None),
                c.plan.total_bytes()
            );
        }
    });
}

#[test]
fn a_rank_with_no_bytes_still_completes() {
    // MLA latent replicated over TP=2: only prefill rank 0 contributes to a TP=1 decode.
    run(Duration::from_secs(60), async {
        let pki = pki(&["a", "b", "decode"]);
        let kind = TransportKind::Tls;
        let mut m = tpu_sync::layout::ModelKv::preset("deepseek-v3").unwrap();
        m.num_layers = 2;
        let c = case(&m, "tp=2,block=16", "tp=1,block=32", 90, 0, 3);
        assert_eq!(
            c.plan.pairs().iter().map(|p| p.0).collect::<Vec<_>>(),
            vec![0],
            "only rank 0 has bytes"
        );
        let a = endpoint(kind, &pki, "a", false).await;
        let b = endpoint(kind, &pki, "b", false).await;
        let decode = endpoint(kind, &pki, "decode", true).await;
        let dst_st = dest_staging(&c.plan, &c.dst, None);
        let sink = decode
            .expect_push(sink_whole(&c.dst, c.tokens, 5, dst_st.clone(), None))
            .unwrap();
        let target = PeerMap::single(decode.local_addr().unwrap().to_string());
        let push = |ep: &Endpoint, r: u32| {
            ep.push(push_whole(
                &c.src,
                &c.dst,
                c.tokens,
                5,
                Some(&[r]),
                target.clone(),
            ))
            .unwrap()
        };
        let st = push(&a, 0).wait().await.unwrap();
        assert_eq!(st.bytes, c.plan.total_bytes());
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(
            sink.poll().is_none(),
            "rank 1 has not declared itself finished yet"
        );
        let st = push(&b, 1).wait().await.unwrap();
        assert_eq!((st.bytes, st.pairs), (0, 0));
        sink.wait_timeout(Duration::from_secs(5)).await.unwrap();
        assert_eq!(
            verify_dest(&c.dst, c.tokens, &dst_st, None),
            c.plan.total_bytes()
        );
        // Pull side: a destination rank list without bytes completes at once.
        let p = endpoint(kind, &pki, "a", true).await;
        register_whole(&p, &c.src, c.tokens, 6);
        let t = decode
            .pull(PullRequest {
                request_id: 6,
                num_tokens: c.tokens,
                src: c.src.clone(),
                sources: PeerMap::single(p.local_addr().unwrap().to_string()),
                dst: c.dst.clone(),
                staging: dest_staging(&c.plan, &c.dst, None),
                dst_ranks: Some(vec![]),
                plan: None,
                wait_for_registration: None,
            })
            .unwrap();
        let st = t.wait().await.unwrap();
        assert_eq!((st.bytes, st.pairs), (0, 0));
    });
}

/// Whether every staged byte of layer `layer` is still zero.
fn layer_untouched(st: &tpu_sync::staging::Staging, layer: u32) -> bool {
    st.ranks().all(|r| {
        st.ranges(r)
            .iter()
            .filter(|s| s.range.buffer == layer)
            .all(|s| {
                let p = st.resolve(r, layer, s.range.offset, s.range.len).unwrap();
                // SAFETY: the transfer is blocked before this layer; nothing writes it.
                unsafe { std::slice::from_raw_parts(p, s.range.len as usize) }
                    .iter()
                    .all(|&b| b == 0)
            })
    })
}

#[test]
fn layer_pipelining_pull_and_push() {
    run(Duration::from_secs(120), async {
        let pki = pki(&["prefill", "decode"]);
        for kind in KINDS {
            let m = model(3);
            let c = case(&m, "tp=2,block=16", "tp=1,block=32,order=hnd", 300, 0, 11);
            let prefill = endpoint(kind, &pki, "prefill", true).await;
            let decode = endpoint(kind, &pki, "decode", true).await;
            let addr = prefill.local_addr().unwrap().to_string();
            // Pull: the producer publishes layer by layer.
            let h = prefill
                .register_source(SourceRegistration {
                    request_id: 21,
                    num_tokens: c.tokens,
                    placement: c.src.clone(),
                    staging: source_staging(&c.src, c.tokens, None),
                    layers_ready: Some(0),
                    expected_releases: 1,
                })
                .unwrap();
            let dst_st = dest_staging(&c.plan, &c.dst, None);
            let t = decode
                .pull(PullRequest {
                    request_id: 21,
                    num_tokens: c.tokens,
                    src: c.src.clone(),
                    sources: PeerMap::single(addr.clone()),
                    dst: c.dst.clone(),
                    staging: dst_st.clone(),
                    dst_ranks: None,
                    plan: None,
                    wait_for_registration: None,
                })
                .unwrap();
            tokio::time::sleep(Duration::from_millis(150)).await;
            assert_eq!(t.layers_complete(), 0);
            assert!(t.poll().is_none());
            assert!(layer_untouched(&dst_st, 0));
            h.publish_layers(1);
            t.wait_layers(1).await.unwrap();
            // Layer 0 is usable while layer 1 does not exist yet.
            tokio::time::sleep(Duration::from_millis(100)).await;
            assert_eq!(t.layers_complete(), 1, "{kind}");
            assert!(t.poll().is_none());
            assert!(layer_untouched(&dst_st, 1) && layer_untouched(&dst_st, 2));
            h.publish_layers(3);
            t.wait().await.unwrap();
            assert_eq!(
                verify_dest(&c.dst, c.tokens, &dst_st, None),
                c.plan.total_bytes()
            );
            decode.release(&addr, 21).await.unwrap();

            // Push: the sender publishes layer by layer; the receiver sees layers complete.
            let dst_st = dest_staging(&c.plan, &c.dst, None);
            let sink = decode
                .expect_push(sink_whole(
                    &c.dst,
                    c.tokens,
                    22,
                    dst_st.clone(),
                    Some(&c.src),
                ))
                .unwrap();
            let p = prefill
                .push(PushRequest {
                    layers_ready: Some(0),
                    ..push_whole(
                        &c.src,
                        &c.dst,
                        c.tokens,
                        22,
                        None,
                        PeerMap::single(decode.local_addr().unwrap().to_string()),
                    )
                })
                .unwrap();
            tokio::time::sleep(Duration::from_millis(150)).await;
            assert_eq!(sink.layers_complete(), 0);
            p.publish_layers(2);
            sink.wait_layers(2).await.unwrap();
            tokio::time::sleep(Duration::from_millis(100)).await;
            assert_eq!(sink.layers_complete(), 2);
            assert!(sink.poll().is_none() && p.poll().is_none());
            assert!(layer_untouched(&dst_st, 2));
            p.publish_layers(3);
            p.wait().await.unwrap();
            sink.wait().await.unwrap();
            assert_eq!(
                verify_dest(&c.dst, c.tokens, &dst_st, None),
                c.plan.total_bytes()
            );
        }
    });
}

#[test]
fn request_ids_must_survive_json() {
    run(Duration::from_secs(30), async {
        let pki = pki(&["x"]);
        let ep = endpoint(TransportKind::Tcp, &pki, "x", true).await;
        let m = model(1);
        let c = case(&m, "tp=1", "tp=1", 20, 0, 1);
        let reg = |id: u64| SourceRegistration {
            request_id: id,
            num_tokens: c.tokens,
            placement: c.src.clone(),
            staging: source_staging(&c.src, c.tokens, None),
            layers_ready: None,
            expected_releases: 1,
        };
        assert!(ep.register_source(reg(1 << 53)).is_err());
        assert!(ep.register_source(reg(0)).is_err());
        let max = (1u64 << 53) - 1;
        ep.register_source(reg(max)).unwrap();
        assert!(ep.register_source(reg(max)).is_err(), "duplicate id");
        let msg = tpu_sync::wire::Control::Release {
            request_id: max,
            delivered: true,
            attempt: 0,
        };
        let json = serde_json::to_string(&msg).unwrap();
        // A JSON number parsed as a double (as Python or JavaScript do) keeps the id.
        let v: serde_json::Value = serde_json::from_str(&json).unwrap();
        assert_eq!(v["request_id"].as_f64().unwrap() as u64, max);
    });
}

/// QUIC with one and with three connections per peer (lanes spread over them) moves every layout
/// byte-exactly both ways; zero connections is refused when the endpoint is made.
#[test]
fn quic_connections_per_peer() {
    run(Duration::from_secs(120), async {
        let pki = pki(&["prefill", "decode"]);
        let m = model(2);
        for n in [1, 3] {
            let mk = |name: &str| EndpointOptions {
                quic_connections_per_peer: n,
                ..opts(
                    TransportKind::Quic,
                    security(TransportKind::Quic, &pki, name),
                    name,
                    true,
                )
            };
            let prefill = Endpoint::bind(mk("prefill")).await.unwrap();
            let decode = Endpoint::bind(mk("decode")).await.unwrap();
            let mut rid = 7000 + 100 * n as u64;
            for (i, (s, d, t, dp)) in LAYOUTS.iter().enumerate().take(3) {
                let c = case(&m, s, d, *t, *dp, i as u64 + 40);
                pull_and_push(&prefill, &decode, &c, &mut rid).await;
            }
            assert_eq!(decode.stats().checksum_failures, 0);
            prefill.shutdown(None).await;
            decode.shutdown(None).await;
        }
        let zero = EndpointOptions {
            quic_connections_per_peer: 0,
            ..opts(
                TransportKind::Quic,
                security(TransportKind::Quic, &pki, "decode"),
                "decode",
                true,
            )
        };
        let Err(e) = Endpoint::bind(zero).await else {
            panic!("0 QUIC connections per peer accepted");
        };
        assert_eq!(e.kind(), tpu_sync::ErrorKind::InvalidArgument, "{e}");
    });
}

/// A push whose source has ranks with nothing for the request (TP=2 x PCP=2, 32-token blocks,
/// a request of one block: the second PCP rank holds no token) delivers every byte and ends on
/// both sides (the soak's `tcp push tp=2,pcp=2,block=32 -> tp=2,block=16 (32 tokens)` failed with
/// the receiver waiting for a sender).
#[test]
fn push_from_sources_that_hold_no_token_of_the_request() {
    run(Duration::from_secs(60), async {
        let m = model(2);
        let pki = pki(&["prefill", "decode"]);
        for kind in [
            TransportKind::Tcp,
            TransportKind::Tls,
            TransportKind::Quic,
            TransportKind::Shm,
        ] {
            let prefill = endpoint(kind, &pki, "prefill", false).await;
            let decode = endpoint(kind, &pki, "decode", true).await;
            let mut rid = 9000;
            for tokens in [1, 16, 31, 32, 33, 64, 65] {
                let c = case(
                    &m,
                    "tp=2,pcp=2,block=32",
                    "tp=2,block=16",
                    tokens,
                    0,
                    tokens as u64,
                );
                rid += 1;
                let got = tokio::time::timeout(
                    Duration::from_secs(10),
                    push_once(&prefill, &decode, &c, rid),
                )
                .await
                .unwrap_or_else(|_| panic!("{kind:?} push of {tokens} tokens hangs"));
                assert_eq!(got, c.plan.total_bytes(), "{tokens} tokens");
            }
        }
    });
}
