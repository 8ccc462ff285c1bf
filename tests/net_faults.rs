//! Faults: a peer killed before the first transfer, between transfers and mid-transfer (either
//! side), a hung peer noticed by heartbeats, a restart under the same name at a new address,
//! corrupt chunks, cancellation, lease expiry. Each ends in an explicit error within a bound,
//! and afterwards no registration, lease, staged byte, socket or fd is left behind.
//!
//! The tests share one process's fd table, so they run one at a time (a global lock).

mod net_util;

use std::sync::Mutex;
use std::time::{Duration, Instant};

use net_util::*;
use tpu_sync::net::{
    Endpoint, EndpointOptions, FaultHooks, PeerMap, Security, SinkRegistration, SourceOutcome,
    SourceRegistration, Transfer, TransportKind,
};
use tpu_sync::Error;

static SERIAL: Mutex<()> = Mutex::new(());

fn fx() -> Fx {
    reshard_fixture(4, 400, 1)
}

fn o(kind: TransportKind, pki: &Pki, name: &str, listen: bool) -> EndpointOptions {
    opts(kind, security(kind, pki, name), name, listen)
}

fn register(ep: &Endpoint, f: &Fx, rid: u64) -> tpu_sync::net::SourceHandle {
    register_whole(ep, &f.src, f.tokens, rid)
}

fn pull(
    ep: &Endpoint,
    f: &Fx,
    rid: u64,
    addr: &str,
) -> (Transfer, std::sync::Arc<tpu_sync::staging::Staging>) {
    let st = dest_staging(&f.plan, &f.dst, None);
    (pull_fx(ep, f, rid, addr, st.clone()), st)
}

/// Waits for `t` to fail within `limit`; returns the error.
async fn fails(t: &Transfer, limit: Duration) -> Error {
    let t0 = Instant::now();
    let r = t.wait_timeout(limit).await;
    let e = r.expect_err("the transfer must fail");
    assert!(
        !matches!(e, Error::Timeout(ref m) if m.contains("not finished within")),
        "no explicit failure of {:?} request {} within {limit:?}",
        t.kind(),
        t.request_id()
    );
    assert!(t0.elapsed() < limit);
    e
}

/// Nothing held: no registration, lease, staged byte, transfer, peer, session or lane.
async fn assert_clean(ep: &Endpoint, what: &str) {
    eventually(Duration::from_secs(5), what, || {
        let s = ep.stats();
        s.source_registrations == 0
            && s.sink_registrations == 0
            && s.leases == 0
            && s.staged_bytes == 0
            && s.transfers_in_flight == 0
    })
    .await;
}

/// fds and sockets back to the baseline (the endpoints are gone).
async fn assert_no_leak(base: (usize, usize), what: &str) {
    let t0 = Instant::now();
    loop {
        let now = fds();
        if now.0 <= base.0 && now.1 <= base.1 {
            return;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "{what}: {} fds / {} sockets, baseline {} / {}",
            now.0,
            now.1,
            base.0,
            base.1
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[test]
fn peer_killed_before_between_and_during_transfers() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    run(Duration::from_secs(180), async {
        let pki = pki(&["prefill", "decode", "pusher"]);
        let f = fx();
        for kind in KINDS {
            let base = fds();
            let decode = Endpoint::bind(o(kind, &pki, "decode", false))
                .await
                .unwrap();

            // Before the first transfer: the prefill is gone before anyone connects.
            let prefill = Endpoint::bind(o(kind, &pki, "prefill", true))
                .await
                .unwrap();
            let addr = prefill.local_addr().unwrap().to_string();
            drop(prefill);
            let (t, st) = pull(&decode, &f, 1, &addr);
            let e = fails(&t, Duration::from_secs(10)).await;
            assert!(
                e.is_peer_failure() || matches!(e, Error::Io { .. }),
                "{kind}: {e}"
            );
            assert!(!any_nonzero(&st));
            assert_clean(&decode, "after kill before first").await;

            // Between transfers: one pull works, then the prefill dies; the decode notices at
            // once (control lane closed), without a new transfer.
            let prefill = Endpoint::bind(o(kind, &pki, "prefill", true))
                .await
                .unwrap();
            let addr = prefill.local_addr().unwrap().to_string();
            register(&prefill, &f, 2);
            let (t, st) = pull(&decode, &f, 2, &addr);
            t.wait().await.unwrap();
            verify_dest(&f.dst, f.tokens, &st, None);
            decode.release(&addr, 2).await.unwrap();
            let lost = decode.stats().peers_lost;
            drop(prefill);
            eventually(Duration::from_secs(3), "death noticed", || {
                decode.stats().peers_lost > lost && decode.stats().peers == 0
            })
            .await;
            let (t, _) = pull(&decode, &f, 3, &addr);
            fails(&t, Duration::from_secs(10)).await;
            assert_clean(&decode, "after kill between").await;

            // Mid-transfer: the prefill stalls after 100 KB, then is killed.
            let mut po = o(kind, &pki, "prefill", true);
            po.faults = FaultHooks {
                stall_after_bytes: Some(100_000),
                ..Default::default()
            };
            let prefill = Endpoint::bind(po).await.unwrap();
            let addr = prefill.local_addr().unwrap().to_string();
            register(&prefill, &f, 4);
            let before = decode.stats().bytes_received;
            let (t, _) = pull(&decode, &f, 4, &addr);
            eventually(Duration::from_secs(5), "transfer started", || {
                decode.stats().bytes_received > before
            })
            .await;
            let t0 = Instant::now();
            drop(prefill);
            let e = fails(&t, Duration::from_secs(4)).await;
            // A stripe still opening its lane sees the connection refused.
            assert!(
                e.is_peer_failure() || matches!(e, Error::Io { .. }),
                "{kind}: {e}"
            );
            assert!(
                t0.elapsed() < Duration::from_secs(3),
                "{kind}: {:?}",
                t0.elapsed()
            );
            assert!(
                t.poll().unwrap().is_err(),
                "a failed receive is never reported done"
            );
            assert_clean(&decode, "after kill mid-transfer").await;

            // The consumer dies mid-pull: the producer releases the request at once.
            let mut po = o(kind, &pki, "prefill", true);
            po.faults.stall_after_bytes = Some(100_000);
            let prefill = Endpoint::bind(po).await.unwrap();
            let addr = prefill.local_addr().unwrap().to_string();
            let h = register(&prefill, &f, 5);
            let (t, _) = pull(&decode, &f, 5, &addr);
            eventually(Duration::from_secs(5), "lease taken", || {
                prefill.stats().leases == 1
            })
            .await;
            drop(decode);
            let outcome = h.wait(Duration::from_secs(3)).await.unwrap();
            assert!(
                matches!(outcome, SourceOutcome::PeerLost(_)),
                "{kind}: {outcome:?}"
            );
            assert!(t.poll().unwrap().is_err());
            assert_clean(&prefill, "producer after consumer death").await;

            // A sender dies mid-push: the receiver fails the request and drops the registration.
            let decode = Endpoint::bind(o(kind, &pki, "decode", true)).await.unwrap();
            let sink_st = dest_staging(&f.plan, &f.dst, None);
            let sink = decode
                .expect_push(sink_whole(&f.dst, f.tokens, 6, sink_st, None))
                .unwrap();
            let mut po = o(kind, &pki, "pusher", false);
            po.faults.stall_after_bytes = Some(100_000);
            let pusher = Endpoint::bind(po).await.unwrap();
            let _p = pusher
                .push(push_whole(
                    &f.src,
                    &f.dst,
                    f.tokens,
                    6,
                    None,
                    PeerMap::single(decode.local_addr().unwrap().to_string()),
                ))
                .unwrap();
            eventually(Duration::from_secs(5), "push started", || {
                decode.stats().bytes_received > 0
            })
            .await;
            drop(pusher);
            let e = fails(&sink, Duration::from_secs(4)).await;
            assert!(e.is_peer_failure(), "{kind}: {e}");
            assert_clean(&decode, "receiver after sender death").await;
            drop(decode);
            drop(prefill);
            drop(_p);
            assert_no_leak(base, &format!("{kind}")).await;
        }
    });
}

#[test]
fn hung_peer_is_noticed_by_heartbeats() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    run(Duration::from_secs(60), async {
        let pki = pki(&["prefill", "decode", "pusher"]);
        let f = fx();
        for kind in KINDS {
            // The producer stops sending and stops answering heartbeats, sockets open: the
            // consumer gives up after the heartbeat timeout (1 s), not the I/O timeout (5 s).
            let mut po = o(kind, &pki, "prefill", true);
            po.faults = FaultHooks {
                stall_after_bytes: Some(100_000),
                mute_heartbeats: true,
                ..Default::default()
            };
            let prefill = Endpoint::bind(po).await.unwrap();
            let addr = prefill.local_addr().unwrap().to_string();
            let decode = Endpoint::bind(o(kind, &pki, "decode", false))
                .await
                .unwrap();
            register(&prefill, &f, 1);
            let t0 = Instant::now();
            let (t, _) = pull(&decode, &f, 1, &addr);
            let e = fails(&t, Duration::from_secs(4)).await;
            assert!(
                e.to_string().contains("heartbeat"),
                "{kind}: expected a heartbeat failure, got {e}"
            );
            assert!(
                t0.elapsed() < Duration::from_millis(3000),
                "{kind}: {:?}",
                t0.elapsed()
            );
            assert_clean(&decode, "consumer after hung producer").await;
            // The producer, hearing no more heartbeats from the consumer either, releases.
            drop(decode);
            assert_clean(&prefill, "producer").await;
        }
    });
}

#[test]
fn restarted_peer_under_same_name_at_new_address() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    run(Duration::from_secs(60), async {
        let pki = pki(&["prefill", "decode", "pusher"]);
        let f = fx();
        for kind in KINDS {
            let decode = Endpoint::bind(o(kind, &pki, "decode", false))
                .await
                .unwrap();
            let prefill = Endpoint::bind(o(kind, &pki, "prefill", true))
                .await
                .unwrap();
            decode
                .add_peer("prefill", &prefill.local_addr().unwrap().to_string())
                .await
                .unwrap();
            register(&prefill, &f, 1);
            let (t, _) = pull(&decode, &f, 1, "prefill");
            t.wait().await.unwrap();
            decode.release("prefill", 1).await.unwrap();
            let old = prefill.local_addr().unwrap();
            drop(prefill);
            // Restart on another port, same name; the decode keeps running.
            let prefill = Endpoint::bind(o(kind, &pki, "prefill", true))
                .await
                .unwrap();
            assert_ne!(prefill.local_addr().unwrap(), old);
            decode
                .add_peer("prefill", &prefill.local_addr().unwrap().to_string())
                .await
                .unwrap();
            register(&prefill, &f, 2);
            let (t, st) = pull(&decode, &f, 2, "prefill");
            t.wait_timeout(Duration::from_secs(10)).await.unwrap();
            verify_dest(&f.dst, f.tokens, &st, None);
            decode.release("prefill", 2).await.unwrap();

            // The consumer restarts under its name: the producer drops the old session at the
            // new one's hello (no waiting for the heartbeat timeout).
            let mut so = o(kind, &pki, "decode", false);
            so.heartbeat_timeout = Duration::from_secs(30);
            let decode = {
                drop(decode);
                Endpoint::bind(so).await.unwrap()
            };
            register(&prefill, &f, 3);
            let (t, _) = pull(&decode, &f, 3, &prefill.local_addr().unwrap().to_string());
            t.wait().await.unwrap();
            eventually(Duration::from_secs(2), "one session", || {
                prefill.stats().sessions == 1
            })
            .await;
        }
    });
}

#[test]
fn corrupt_chunk_fails_the_request_not_the_connection() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    run(Duration::from_secs(60), async {
        let pki = pki(&["prefill", "decode", "pusher"]);
        let f = fx();
        // The fault corrupts a copy of a chunk after its checksum was taken, as a sender-side
        // memory error would: only an xxh3 can see it, so TLS and QUIC endpoints here hash
        // their frames too (by default their AEAD alone protects the bytes, which it cannot
        // when they were wrong before encryption).
        let o = |kind, pki: &Pki, name: &str, listen| EndpointOptions {
            hash_encrypted_frames: true,
            ..o(kind, pki, name, listen)
        };
        for kind in KINDS {
            // Pull: the producer corrupts one chunk of the first pull.
            let mut po = o(kind, &pki, "prefill", true);
            po.faults.corrupt_at_offset = Some(70_000);
            let prefill = Endpoint::bind(po).await.unwrap();
            let addr = prefill.local_addr().unwrap().to_string();
            let decode = Endpoint::bind(o(kind, &pki, "decode", true)).await.unwrap();
            register(&prefill, &f, 1);
            let (t, _) = pull(&decode, &f, 1, &addr);
            let e = t.wait().await.unwrap_err();
            assert!(matches!(e, Error::Checksum(_)), "{kind}: {e}");
            assert_eq!(decode.stats().checksum_failures, 1);
            // No lane was closed by the failure (every lane ever opened is still open), and
            // the same connection carries the next request.
            let s = decode.stats();
            assert_eq!(
                s.lanes_open, s.lanes_opened,
                "{kind}: a lane was closed: {s:?}"
            );
            let (t, st) = pull(&decode, &f, 1, &addr);
            t.wait().await.unwrap();
            verify_dest(&f.dst, f.tokens, &st, None);
            let s = decode.stats();
            assert_eq!(s.peers_lost, 0, "{kind}");
            assert_eq!(s.lanes_open, s.lanes_opened, "{kind}: {s:?}");

            // Push: the receiver fails the request, the sender learns it, the lane survives.
            let sink_st = dest_staging(&f.plan, &f.dst, None);
            let sink = decode
                .expect_push(sink_whole(&f.dst, f.tokens, 2, sink_st, None))
                .unwrap();
            let mut po = o(kind, &pki, "pusher", false);
            po.faults.corrupt_at_offset = Some(10);
            let pusher = Endpoint::bind(po).await.unwrap();
            let push = |rid| {
                pusher
                    .push(push_whole(
                        &f.src,
                        &f.dst,
                        f.tokens,
                        rid,
                        None,
                        PeerMap::single(decode.local_addr().unwrap().to_string()),
                    ))
                    .unwrap()
            };
            let e = push(2).wait().await.unwrap_err();
            assert!(e.to_string().contains("checksum"), "{kind}: {e}");
            let e = sink.wait().await.unwrap_err();
            assert!(matches!(e, Error::Checksum(_)), "{kind}: {e}");
            assert_eq!(decode.stats().sink_registrations, 0);
            let s = pusher.stats();
            assert_eq!(
                s.lanes_open, s.lanes_opened,
                "{kind}: a lane was closed: {s:?}"
            );
            let sink_st = dest_staging(&f.plan, &f.dst, None);
            let sink = decode
                .expect_push(sink_whole(&f.dst, f.tokens, 3, sink_st.clone(), None))
                .unwrap();
            push(3).wait().await.unwrap();
            sink.wait().await.unwrap();
            verify_dest(&f.dst, f.tokens, &sink_st, None);
            let s = pusher.stats();
            assert_eq!(s.lanes_open, s.lanes_opened, "{kind}: {s:?}");
            assert_eq!(s.peers_lost, 0);
        }
    });
}

#[test]
fn cancellation_and_leases() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    run(Duration::from_secs(60), async {
        let pki = pki(&["prefill", "decode", "pusher"]);
        let f = fx();
        let kind = TransportKind::Quic;
        let mut po = o(kind, &pki, "prefill", true);
        po.lease_ttl = Duration::from_millis(300);
        let prefill = Endpoint::bind(po).await.unwrap();
        let addr = prefill.local_addr().unwrap().to_string();
        let decode = Endpoint::bind(o(kind, &pki, "decode", true)).await.unwrap();

        // Cancel a pull blocked on an unpublished layer.
        let h = prefill
            .register_source(SourceRegistration {
                request_id: 1,
                num_tokens: f.tokens,
                placement: f.src.clone(),
                staging: source_staging(&f.src, f.tokens, None),
                layers_ready: Some(1),
                expected_releases: 1,
            })
            .unwrap();
        let (t, _) = pull(&decode, &f, 1, &addr);
        t.wait_layers(1).await.unwrap();
        t.cancel();
        let e = t.wait_timeout(Duration::from_secs(1)).await.unwrap_err();
        assert!(matches!(e, Error::Cancelled(_)), "{e}");
        assert_clean(&decode, "after cancel").await;
        // The live consumer's lease keeps the registration past the TTL...
        tokio::time::sleep(Duration::from_millis(900)).await;
        assert_eq!(h.outcome(), None);
        assert_eq!(prefill.stats().leases, 1);
        // ...and a release after the cancelled pull is no delivery: the registration stays...
        decode.release(&addr, 1).await.unwrap();
        assert_eq!(h.outcome(), None);
        // ...for a retry, whose release ends it.
        h.publish_layers(f.src.layout.model.num_layers);
        let (t, st) = pull(&decode, &f, 1, &addr);
        t.wait().await.unwrap();
        assert_eq!(
            verify_dest(&f.dst, f.tokens, &st, None),
            f.plan.total_bytes()
        );
        decode.release(&addr, 1).await.unwrap();
        assert_eq!(
            h.wait(Duration::from_secs(2)).await.unwrap(),
            SourceOutcome::Released
        );

        // A registration nobody pulls expires after the TTL.
        let h = register(&prefill, &f, 2);
        let t0 = Instant::now();
        assert_eq!(
            h.wait(Duration::from_secs(3)).await.unwrap(),
            SourceOutcome::Expired
        );
        assert!(t0.elapsed() >= Duration::from_millis(250));
        assert_clean(&prefill, "after expiry").await;

        // Cancel a push reception: later pushes are refused.
        let sink = decode
            .expect_push(SinkRegistration {
                request_id: 3,
                num_tokens: f.tokens,
                placement: f.dst.clone(),
                staging: dest_staging(&f.plan, &f.dst, None),
                dst_ranks: None,
                src: None,
                plan: None,
            })
            .unwrap();
        sink.cancel();
        assert!(matches!(sink.wait().await, Err(Error::Cancelled(_))));
        let p = prefill
            .push(push_whole(
                &f.src,
                &f.dst,
                f.tokens,
                3,
                None,
                PeerMap::single(decode.local_addr().unwrap().to_string()),
            ))
            .unwrap();
        let e = p.wait().await.unwrap_err();
        assert!(e.to_string().contains("expects no push"), "{e}");
        assert_clean(&decode, "after sink cancel").await;

        // Shutdown with draining lets an in-flight transfer finish.
        let _h = register(&prefill, &f, 4);
        let (t, st) = pull(&decode, &f, 4, &addr);
        decode.shutdown(Some(Duration::from_secs(10))).await;
        t.wait().await.unwrap();
        verify_dest(&f.dst, f.tokens, &st, None);
        let _ = Security::None;
    });
}

/// TLS and QUIC lanes go without xxh3 where the receiving side does not ask for it
/// (`hash_encrypted_frames` off: their AEAD authenticates every byte), and a receiver that asks
/// gets and checks a checksum on every frame whatever the sender's own setting; plain TCP and
/// shm always verify.
#[test]
fn encrypted_lanes_hash_frames_only_for_a_receiver_that_asks() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    run(Duration::from_secs(60), async {
        let pki = pki(&["prefill", "decode"]);
        let f = fx();
        let mut rid = 0;
        for kind in KINDS {
            let encrypted = matches!(kind, TransportKind::Tls | TransportKind::Quic);
            for (prefill_hashes, decode_hashes) in [(false, false), (true, false), (false, true)] {
                let case =
                    format!("{kind:?}, prefill hashes {prefill_hashes}, decode {decode_hashes}");
                let mut po = o(kind, &pki, "prefill", true);
                po.hash_encrypted_frames = prefill_hashes;
                let prefill = Endpoint::bind(po).await.unwrap();
                let addr = prefill.local_addr().unwrap().to_string();
                let mut dopt = o(kind, &pki, "decode", false);
                dopt.hash_encrypted_frames = decode_hashes;
                let decode = Endpoint::bind(dopt).await.unwrap();
                // Every byte arrives exactly, checked or not.
                rid += 1;
                register(&prefill, &f, rid);
                let (t, st) = pull(&decode, &f, rid, &addr);
                t.wait().await.unwrap_or_else(|e| panic!("{case}: {e}"));
                let n = verify_dest(&f.dst, f.tokens, &st, None);
                let s = decode.stats();
                assert_eq!(s.bytes_received, n, "{case}");
                let unchecked = encrypted && !decode_hashes;
                assert_eq!(
                    s.bytes_received_unhashed,
                    if unchecked { n } else { 0 },
                    "{case}"
                );
                assert_eq!(s.checksum_failures, 0, "{case}");
                decode.release(&addr, rid).await.unwrap();
                // A receiver that asks for checksums gets them: a chunk corrupted after its
                // checksum was taken fails the request. (Where nobody hashes, only the AEAD
                // protects the bytes, from the sender's copy on: not this fault's case.)
                if !unchecked {
                    let mut po = o(kind, &pki, "prefill", true);
                    po.hash_encrypted_frames = prefill_hashes;
                    po.faults.corrupt_at_offset = Some(70_000);
                    let bad = Endpoint::bind(po).await.unwrap();
                    let bad_addr = bad.local_addr().unwrap().to_string();
                    rid += 1;
                    register(&bad, &f, rid);
                    let (t, _) = pull(&decode, &f, rid, &bad_addr);
                    let e = t.wait().await.unwrap_err();
                    assert!(matches!(e, Error::Checksum(_)), "{case}: {e}");
                }
            }
        }
    });
}
