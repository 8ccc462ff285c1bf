//! Failure semantics the serving engines rely on: remote failures keep their kind, a pull that
//! fails before any byte arrived does not consume the producer's registration (a retry to the
//! right address succeeds), a release after a failed pull is not a delivery, a consumer can reject
//! a request (the producer's staging is freed at once and its outcome says `Rejected`), and a pull
//! can wait for a registration that has not happened yet. Every transfer is checked byte for byte
//! against the pattern.

use crate::fault_util;
use crate::net_util;

use std::sync::Arc;
use std::time::Duration;

use fault_util::{real_transport, Action, FaultTransport, Faults, FrameSel, Point, Rule};
use net_util::*;
use tpu_sync::net::{
    Endpoint, EndpointOptions, PeerMap, PullRequest, Security, SinkRegistration, SourceHandle,
    SourceOutcome, SourceRegistration, TransportKind,
};
use tpu_sync::ErrorKind;

const LIMIT: Duration = Duration::from_secs(60);

fn o(name: &str, listen: bool) -> EndpointOptions {
    opts(TransportKind::Tcp, Security::None, name, listen)
}

async fn ep(name: &str, listen: bool) -> Endpoint {
    Endpoint::bind(o(name, listen)).await.unwrap()
}

fn addr(e: &Endpoint) -> String {
    e.local_addr().unwrap().to_string()
}

/// A pull of `f`'s request `rid` with the given source map into fresh staging.
fn pull_with(
    decode: &Endpoint,
    f: &Fx,
    rid: u64,
    sources: PeerMap,
    wait: Option<Duration>,
) -> (tpu_sync::net::Transfer, Arc<tpu_sync::staging::Staging>) {
    let st = dest_staging(&f.plan, &f.dst, None);
    let t = decode
        .pull(PullRequest {
            request_id: rid,
            num_tokens: f.tokens,
            src: f.src.clone(),
            sources,
            dst: f.dst.clone(),
            staging: st.clone(),
            dst_ranks: None,
            plan: None,
            wait_for_registration: wait,
        })
        .unwrap();
    (t, st)
}

/// Registers source ranks `ranks` of `f`'s request at `e`.
fn register_ranks(e: &Endpoint, f: &Fx, rid: u64, ranks: &[u32], consumers: u32) -> SourceHandle {
    e.register_source(SourceRegistration {
        request_id: rid,
        num_tokens: f.tokens,
        placement: f.src.clone(),
        staging: source_staging(&f.src, f.tokens, Some(ranks)),
        layers_ready: None,
        expected_releases: consumers,
    })
    .unwrap()
}

async fn pull_exact(decode: &Endpoint, f: &Fx, rid: u64, sources: PeerMap) {
    let (t, st) = pull_with(decode, f, rid, sources, None);
    let stats = t.wait().await.unwrap();
    assert_eq!(stats.bytes, f.plan.total_bytes());
    assert_eq!(
        verify_dest(&f.dst, f.tokens, &st, None),
        f.plan.total_bytes()
    );
}

#[test]
fn remote_failures_keep_their_kind() {
    run(LIMIT, async {
        let f = reshard_fixture(2, 100, 11);
        let prefill = ep("prefill", true).await;
        let decode = ep("decode", false).await;
        let a = addr(&prefill);
        // Not registered: the producer's "unknown request", with its kind and the peer's text.
        let (t, _) = pull_with(&decode, &f, 5, PeerMap::single(&a), None);
        let e = t.wait().await.unwrap_err();
        assert_eq!(e.kind(), ErrorKind::UnknownRequest, "{e}");
        let text = e.to_string();
        assert!(
            text.contains("peer: ") && text.contains("request 5"),
            "{text}"
        );
        let e = decode.describe(&a, 5).await.unwrap_err();
        assert_eq!(e.kind(), ErrorKind::UnknownRequest, "{e}");
        // A rank the producer does not host: its block-range refusal, not a generic remote error.
        let _h = register_ranks(&prefill, &f, 6, &[0], 1);
        let (t, _) = pull_with(&decode, &f, 6, PeerMap::single(&a), None);
        let e = t.wait().await.unwrap_err();
        assert_eq!(e.kind(), ErrorKind::BlockRange, "{e}");
        assert!(e.to_string().contains("not hosted here"), "{e}");
        // A push to an endpoint that expects none.
        let p = prefill
            .push(push_whole(
                &f.src,
                &f.dst,
                f.tokens,
                7,
                None,
                PeerMap::single(addr(&prefill)),
            ))
            .unwrap();
        let e = p.wait().await.unwrap_err();
        assert_eq!(e.kind(), ErrorKind::UnknownRequest, "{e}");
    });
}

#[test]
fn wrong_address_then_right_one() {
    run(LIMIT, async {
        let f = reshard_fixture(3, 150, 21);
        let prefill = ep("prefill", true).await;
        let other = ep("other", true).await;
        let decode = ep("decode", false).await;
        let h = register_whole(&prefill, &f.src, f.tokens, 1);
        // Wrong address: an endpoint that does not have the request.
        let (t, st) = pull_with(&decode, &f, 1, PeerMap::single(addr(&other)), None);
        assert_eq!(
            t.wait().await.unwrap_err().kind(),
            ErrorKind::UnknownRequest
        );
        assert!(!any_nonzero(&st), "nothing arrived");
        // An engine that releases after a pull that never reached this producer is refused
        // (a session that neither pulled nor described a request cannot release it, issue 24;
        // the registration stays).
        let e = decode.release(&addr(&prefill), 1).await.unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
        assert_eq!(h.outcome(), None);
        assert_eq!(prefill.stats().source_registrations, 1);
        // The retry to the right address is byte-exact and its release ends the registration.
        pull_exact(&decode, &f, 1, PeerMap::single(addr(&prefill))).await;
        decode.release(&addr(&prefill), 1).await.unwrap();
        assert_eq!(h.wait(LIMIT).await.unwrap(), SourceOutcome::Released);
    });
}

#[test]
fn ranks_swapped_then_right_map() {
    run(LIMIT, async {
        let f = reshard_fixture(2, 130, 31);
        let a = ep("prefill-a", true).await;
        let b = ep("prefill-b", true).await;
        let decode = ep("decode", false).await;
        let ha = register_ranks(&a, &f, 9, &[0], 1);
        let hb = register_ranks(&b, &f, 9, &[1], 1);
        // Each rank asked of the endpoint that does not host it: refused before any byte.
        let swapped = PeerMap::default().with(0, addr(&b)).with(1, addr(&a));
        let (t, st) = pull_with(&decode, &f, 9, swapped, None);
        assert_eq!(t.wait().await.unwrap_err().kind(), ErrorKind::BlockRange);
        assert!(!any_nonzero(&st));
        // Even a consumer claiming delivery is not counted: the producer refused its pairs.
        decode.release_with(&addr(&a), 9, true).await.unwrap();
        decode.release_with(&addr(&b), 9, true).await.unwrap();
        assert_eq!((ha.outcome(), hb.outcome()), (None, None));
        // A refused pull takes no lease.
        assert_eq!(a.stats().leases + b.stats().leases, 0);
        let right = PeerMap::default().with(0, addr(&a)).with(1, addr(&b));
        pull_exact(&decode, &f, 9, right).await;
        decode.release(&addr(&a), 9).await.unwrap();
        decode.release(&addr(&b), 9).await.unwrap();
        assert_eq!(ha.wait(LIMIT).await.unwrap(), SourceOutcome::Released);
        assert_eq!(hb.wait(LIMIT).await.unwrap(), SourceOutcome::Released);
    });
}

#[test]
fn refused_handshake_then_a_valid_consumer() {
    run(LIMIT, async {
        let pki = pki(&["prefill", "decode"]);
        let f = reshard_fixture(2, 90, 41);
        let kind = TransportKind::Tls;
        let prefill = endpoint(kind, &pki, "prefill", true).await;
        let h = register_whole(&prefill, &f.src, f.tokens, 3);
        // Plain TCP against the TLS listener: refused in the handshake.
        let plain = ep("decode", false).await;
        let (t, st) = pull_with(&plain, &f, 3, PeerMap::single(addr(&prefill)), None);
        assert!(t.wait().await.is_err());
        assert!(!any_nonzero(&st));
        assert_eq!(h.outcome(), None);
        let decode = endpoint(kind, &pki, "decode", false).await;
        pull_exact(&decode, &f, 3, PeerMap::single(addr(&prefill))).await;
        decode.release(&addr(&prefill), 3).await.unwrap();
        assert_eq!(h.wait(LIMIT).await.unwrap(), SourceOutcome::Released);
    });
}

#[test]
fn release_after_a_failed_pull_is_not_a_delivery() {
    run(LIMIT, async {
        let f = reshard_fixture(3, 200, 51);
        // The producer's transport drops the lane of its third data frame of request 4: one
        // stripe is not served completely.
        let faults = Faults::new();
        faults.add(Rule::nth(
            Point::Send(FrameSel::data(4)),
            2,
            Action::DropLane,
        ));
        let po = o("prefill", true);
        let t = Arc::new(FaultTransport::new(real_transport(&po), faults.clone()));
        let prefill = Endpoint::with_transport(po, t).await.unwrap();
        let decode = ep("decode", false).await;
        let h = register_whole(&prefill, &f.src, f.tokens, 4);
        let (t, _) = pull_with(&decode, &f, 4, PeerMap::single(addr(&prefill)), None);
        assert!(t.wait().await.is_err());
        assert_eq!(faults.fired().len(), 1, "{:?}", faults.fired());
        // The consumer claims delivery (a buggy engine): the producer, which did not serve
        // every stripe, does not count it.
        decode.release_with(&addr(&prefill), 4, true).await.unwrap();
        assert_eq!(h.outcome(), None);
        // A second consumer, which never pulled it, cannot release it at all (issue 24).
        let second = ep("decode-2", false).await;
        for delivered in [false, true] {
            let e = second
                .release_with(&addr(&prefill), 4, delivered)
                .await
                .unwrap_err();
            assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
        }
        assert_eq!(h.outcome(), None);
        // A retry is byte-exact and its release is the delivery.
        pull_exact(&decode, &f, 4, PeerMap::single(addr(&prefill))).await;
        decode.release(&addr(&prefill), 4).await.unwrap();
        assert_eq!(h.wait(LIMIT).await.unwrap(), SourceOutcome::Released);
        assert_eq!(prefill.stats().staged_bytes, 0);
    });
}

#[test]
fn cancelled_pull_then_release_keeps_the_registration() {
    run(LIMIT, async {
        let f = reshard_fixture(2, 120, 61);
        let prefill = ep("prefill", true).await;
        let decode = ep("decode", false).await;
        // Layer 1 not published: the pull blocks after layer 0, then the consumer cancels.
        let h = prefill
            .register_source(SourceRegistration {
                request_id: 8,
                num_tokens: f.tokens,
                placement: f.src.clone(),
                staging: source_staging(&f.src, f.tokens, None),
                layers_ready: Some(1),
                expected_releases: 1,
            })
            .unwrap();
        let (t, _) = pull_with(&decode, &f, 8, PeerMap::single(addr(&prefill)), None);
        t.wait_layers(1).await.unwrap();
        t.cancel();
        assert_eq!(t.wait().await.unwrap_err().kind(), ErrorKind::Cancelled);
        decode.release(&addr(&prefill), 8).await.unwrap();
        assert_eq!(h.outcome(), None, "a cancelled pull is not a delivery");
        h.publish_layers(2);
        pull_exact(&decode, &f, 8, PeerMap::single(addr(&prefill))).await;
        decode.release(&addr(&prefill), 8).await.unwrap();
        assert_eq!(h.wait(LIMIT).await.unwrap(), SourceOutcome::Released);
    });
}

#[test]
fn reject_frees_the_staging_at_once() {
    run(LIMIT, async {
        let f = reshard_fixture(2, 160, 71);
        let prefill = ep("prefill", true).await;
        let decode = ep("decode", false).await;
        let a = addr(&prefill);
        let h = register_whole(&prefill, &f.src, f.tokens, 10);
        assert!(prefill.stats().staged_bytes > 0);
        decode.describe(&a, 10).await.unwrap();
        assert_eq!(prefill.stats().leases, 1);
        decode
            .reject(&a, 10, "decode aborted request 10")
            .await
            .unwrap();
        // Freed by the time the reject is answered.
        let s = prefill.stats();
        assert_eq!(
            (s.staged_bytes, s.source_registrations, s.leases),
            (0, 0, 0)
        );
        match h.outcome() {
            Some(SourceOutcome::Rejected(why)) => {
                assert!(why.contains("decode aborted request 10"), "{why}");
                assert!(
                    why.contains("consumer decode "),
                    "names the consumer: {why}"
                );
            }
            o => panic!("expected rejected, got {o:?}"),
        }
        // Gone: a later pull is refused as unknown.
        let (t, _) = pull_with(&decode, &f, 10, PeerMap::single(&a), None);
        assert_eq!(
            t.wait().await.unwrap_err().kind(),
            ErrorKind::UnknownRequest
        );

        // Two consumers: one pulls and releases, the other rejects: every consumer is accounted
        // for, and the outcome says that one of them did not take the request.
        let h = register_ranks(&prefill, &f, 11, &[0, 1], 2);
        pull_exact(&decode, &f, 11, PeerMap::single(&a)).await;
        decode.release(&a, 11).await.unwrap();
        assert_eq!(h.outcome(), None, "one consumer still expected");
        let other = ep("decode-2", false).await;
        other.reject(&a, 11, "refused at admission").await.unwrap();
        assert!(matches!(h.outcome(), Some(SourceOutcome::Rejected(w)) if w.contains("admission")));
        assert_eq!(prefill.stats().staged_bytes, 0);

        // A reject that arrives before the registration is counted when it comes.
        decode.reject(&a, 12, "too late to wait").await.unwrap();
        let h = register_whole(&prefill, &f.src, f.tokens, 12);
        assert!(
            matches!(h.outcome(), Some(SourceOutcome::Rejected(w)) if w.contains("too late")),
            "{:?}",
            h.outcome()
        );
        assert_eq!(prefill.stats().staged_bytes, 0);
        assert!(decode.reject(&a, 0, "bad id").await.is_err());
    });
}

#[test]
fn pull_waits_for_a_late_registration() {
    run(LIMIT, async {
        let f = reshard_fixture(2, 140, 81);
        let prefill = ep("prefill", true).await;
        let decode = ep("decode", false).await;
        let a = addr(&prefill);
        // The decode request reaches the producer before its registration.
        let (t, st) = pull_with(
            &decode,
            &f,
            20,
            PeerMap::single(&a),
            Some(Duration::from_secs(30)),
        );
        tokio::time::sleep(Duration::from_millis(150)).await;
        assert!(t.poll().is_none(), "waits");
        let h = register_whole(&prefill, &f.src, f.tokens, 20);
        let stats = t.wait().await.unwrap();
        assert_eq!(stats.bytes, f.plan.total_bytes());
        assert_eq!(
            verify_dest(&f.dst, f.tokens, &st, None),
            f.plan.total_bytes()
        );
        decode.release(&a, 20).await.unwrap();
        assert_eq!(h.wait(LIMIT).await.unwrap(), SourceOutcome::Released);
        // Without the option the same situation fails at once; with a short one, at its end.
        let (t, _) = pull_with(&decode, &f, 21, PeerMap::single(&a), None);
        assert_eq!(
            t.wait().await.unwrap_err().kind(),
            ErrorKind::UnknownRequest
        );
        let (t, _) = pull_with(
            &decode,
            &f,
            22,
            PeerMap::single(&a),
            Some(Duration::from_millis(200)),
        );
        assert_eq!(
            t.wait().await.unwrap_err().kind(),
            ErrorKind::UnknownRequest
        );
        // Cancelling a waiting pull ends it.
        let (t, _) = pull_with(
            &decode,
            &f,
            23,
            PeerMap::single(&a),
            Some(Duration::from_secs(30)),
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
        t.cancel();
        assert_eq!(t.wait().await.unwrap_err().kind(), ErrorKind::Cancelled);
    });
}

#[test]
fn push_to_a_sink_fails_with_the_receivers_kind() {
    run(LIMIT, async {
        let f = reshard_fixture(2, 100, 91);
        let prefill = ep("prefill", true).await;
        let decode = ep("decode", true).await;
        // The receiver expects a different token count: a mismatch, as the receiver raised it.
        let _sink = decode
            .expect_push(SinkRegistration {
                request_id: 30,
                num_tokens: f.tokens + 1,
                placement: reshard_fixture(2, f.tokens + 1, 91).dst,
                staging: dest_staging(&f.plan, &f.dst, None),
                dst_ranks: None,
                src: None,
                plan: None,
            })
            .unwrap();
        let p = prefill
            .push(push_whole(
                &f.src,
                &f.dst,
                f.tokens,
                30,
                None,
                PeerMap::single(addr(&decode)),
            ))
            .unwrap();
        let e = p.wait().await.unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Mismatch, "{e}");
    });
}

#[test]
fn a_lost_producer_that_cannot_be_reached_again_is_named_as_lost() {
    run(LIMIT, async {
        let f = reshard_fixture(1, 60, 97);
        let prefill = ep("prefill", true).await;
        let decode = ep("decode", false).await;
        let a = addr(&prefill);
        let _h = register_whole(&prefill, &f.src, f.tokens, 40);
        decode.describe(&a, 40).await.unwrap();
        // The producer dies (its sockets close); the consumer notices.
        drop(prefill);
        eventually(Duration::from_secs(10), "peer lost", || {
            decode.stats().peers == 0
        })
        .await;
        let (t, st) = pull_with(&decode, &f, 40, PeerMap::single(&a), None);
        let e = t.wait().await.unwrap_err();
        assert_eq!(e.kind(), ErrorKind::PeerClosed, "{e}");
        assert!(e.to_string().contains("was lost"), "{e}");
        assert!(!any_nonzero(&st));
        // An address never connected to fails with the connection's own error.
        let other = ep("other", true).await;
        let gone = addr(&other);
        drop(other);
        let (t, _) = pull_with(&decode, &f, 41, PeerMap::single(&gone), None);
        let e = t.wait().await.unwrap_err();
        assert!(!e.to_string().contains("was lost"), "{e}");
    });
}

/// `Transfer::wait` runs the transfer's driver on the waiting caller when it gets there before
/// the endpoint's runtime (a single-stripe pull then runs entirely on the caller's thread: no
/// thread wake-up in between); a wait given up midway (its timeout) hands the driver back to
/// the runtime, and the transfer goes on by itself: nobody waits for it again here, it is only
/// polled, and every byte arrives. The runtime has one worker, which a task keeps busy while the
/// caller waits, so the caller is the one that takes the driver.
#[test]
fn a_wait_given_up_midway_leaves_the_transfer_running() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        tokio::time::timeout(LIMIT, async {
            let m = model(2);
            let tokens = 40;
            let src = placement(layout(&m, "tp=1,block=16", tokens), 0, tokens, 5);
            let dst = placement(layout(&m, "tp=1,block=16", tokens), 0, tokens, 6);
            let plan = tpu_sync::plan::Plan::build(&src, &dst, tokens).unwrap();
            let f = Fx {
                src,
                dst,
                tokens,
                plan,
            };
            let prefill = ep("prefill", true).await;
            let decode = ep("decode", false).await;
            let a = addr(&prefill);
            // Registered first: the caller's wait runs the whole pull.
            let h = register_whole(&prefill, &f.src, f.tokens, 30);
            pull_exact(&decode, &f, 30, PeerMap::single(&a)).await;
            decode.release(&a, 30).await.unwrap();
            assert_eq!(h.wait(LIMIT).await.unwrap(), SourceOutcome::Released);
            // Not registered yet, and the runtime's only worker busy: the caller takes the
            // driver, which then waits for the registration; the wait gives up; the
            // registration comes later and the pull completes unawaited.
            let (busy_tx, busy_rx) = std::sync::mpsc::channel();
            let busy = tokio::spawn(async move {
                busy_tx.send(()).unwrap();
                std::thread::sleep(Duration::from_millis(400));
            });
            busy_rx.recv().unwrap();
            let (t, st) = pull_with(
                &decode,
                &f,
                31,
                PeerMap::single(&a),
                Some(Duration::from_secs(30)),
            );
            let e = t
                .wait_timeout(Duration::from_millis(200))
                .await
                .unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Timeout, "{e}");
            assert!(t.poll().is_none(), "still running");
            busy.await.unwrap();
            let h = register_whole(&prefill, &f.src, f.tokens, 31);
            eventually(Duration::from_secs(20), "the pull completes", || {
                t.poll().is_some()
            })
            .await;
            let stats = t.poll().unwrap().unwrap();
            assert_eq!(stats.bytes, f.plan.total_bytes());
            assert_eq!(
                verify_dest(&f.dst, f.tokens, &st, None),
                f.plan.total_bytes()
            );
            decode.release(&a, 31).await.unwrap();
            assert_eq!(h.wait(LIMIT).await.unwrap(), SourceOutcome::Released);
        })
        .await
        .expect("test hung");
    });
}
