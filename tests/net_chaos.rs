//! Faults injected deterministically through the transport seam (`tests/fault_util`): every
//! fault of the fault-injecting transport, on each transport (TCP, TLS, QUIC), in pulls and in
//! pushes, while a second request shares the connection; and a peer dying at every point (before
//! the first transfer, in the transport handshake, in the protocol hello, between transfers,
//! mid-transfer, either side) followed by a restart at a new address.
//!
//! Each fault must end in an explicit error for the affected request within its timeout, the
//! other request must arrive byte-exact, the producer must still serve the failed request
//! afterwards (nothing it stored is lost), and at the end no fd, socket, thread, locked byte,
//! mapping, lane, registration, lease or staged byte may be left. `tests/net_faults.rs` covers
//! the faults the endpoint's own test hooks inject (stalls, corrupt chunks, hung peers, leases).
//!
//! The tests share the process's fd table and threads, so they run one at a time.

mod fault_util;
mod net_util;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use fault_util::*;
use net_util::*;
use tpu_sync::arena::{ArenaOptions, LockStatus};
use tpu_sync::net::{
    Endpoint, EndpointOptions, PeerMap, PushRequest, SourceHandle, SourceOutcome, Transfer,
    TransferStats, TransportKind,
};
use tpu_sync::staging::Staging;
use tpu_sync::Error;

static SERIAL: Mutex<()> = Mutex::new(());

/// io_timeout of these tests: a stalled lane fails its request after this long.
const IO: Duration = Duration::from_millis(1000);
/// Bound on any single request's outcome (faults included).
const BOUND: Duration = Duration::from_secs(6);

fn fx() -> Fx {
    reshard_fixture(2, 256, 11)
}

/// Locked, pre-faulted staging (so pinned bytes show in `VmLck`).
fn locked() -> ArenaOptions {
    ArenaOptions {
        lock: true,
        huge_pages: false,
        populate: true,
    }
}

fn o(kind: TransportKind, pki: &Pki, name: &str, listen: bool) -> EndpointOptions {
    let mut o = opts(kind, security(kind, pki, name), name, listen);
    o.io_timeout = IO;
    o.connect_timeout = Duration::from_millis(800);
    o.handshake_timeout = Duration::from_millis(800);
    o.chunk_bytes = 32 << 10;
    // Deaths here are noticed by closed lanes, not by missed heartbeats (tests/net_faults.rs
    // covers those): a generous heartbeat timeout keeps a loaded machine from losing a peer.
    o.heartbeat_timeout = Duration::from_secs(3);
    o
}

async fn ep(kind: TransportKind, pki: &Pki, name: &str, listen: bool) -> (Endpoint, Arc<Faults>) {
    fault_endpoint(o(kind, pki, name, listen)).await
}

/// Waits (3 s at most) for `h` to end, and checks it ended `PeerLost`.
async fn ends_peer_lost(h: &SourceHandle, what: &str) {
    eventually(Duration::from_secs(3), what, || h.outcome().is_some()).await;
    assert!(
        matches!(h.outcome(), Some(SourceOutcome::PeerLost(_))),
        "{what}: {:?}",
        h.outcome()
    );
}

fn register(ep: &Endpoint, f: &Fx, rid: u64) -> SourceHandle {
    register_whole_with(ep, &f.src, f.tokens, rid, &locked())
}

fn pull(ep: &Endpoint, f: &Fx, rid: u64, addr: &str) -> (Transfer, Arc<Staging>) {
    let st = dest_staging_with(&f.plan, &f.dst, None, &locked());
    (pull_fx(ep, f, rid, addr, st.clone()), st)
}

fn expect(ep: &Endpoint, f: &Fx, rid: u64) -> (Transfer, Arc<Staging>) {
    let st = dest_staging_with(&f.plan, &f.dst, None, &locked());
    let t = ep
        .expect_push(sink_whole(&f.dst, f.tokens, rid, st.clone(), None))
        .unwrap();
    (t, st)
}

fn push(ep: &Endpoint, f: &Fx, rid: u64, addr: &str) -> Transfer {
    ep.push(PushRequest {
        request_id: rid,
        num_tokens: f.tokens,
        src: f.src.clone(),
        staging: source_staging_with(&f.src, f.tokens, None, &locked()),
        src_ranks: None,
        dst: f.dst.clone(),
        targets: PeerMap::single(addr),
        layers_ready: None,
        plan: None,
    })
    .unwrap()
}

/// The outcome of `t`, which must come within `limit` (a hang fails the test).
async fn outcome(t: &Transfer, limit: Duration, what: &str) -> Result<TransferStats, Error> {
    match tokio::time::timeout(limit, t.wait()).await {
        Ok(r) => r,
        Err(_) => panic!("{what}: no outcome within {limit:?}"),
    }
}

/// `t` succeeded and every byte of `st` is the pattern.
async fn arrives(f: &Fx, t: &Transfer, st: &Staging, what: &str) {
    let r = outcome(t, BOUND, what).await;
    assert!(r.is_ok(), "{what}: {r:?}");
    verify_dest(&f.dst, f.tokens, st, None);
}

/// Nothing held by `ep`: registrations, leases, staged bytes, transfers.
async fn clean(ep: &Endpoint, what: &str) {
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

/// The process's resources after one clean pull on every transport (the allocator's arenas,
/// the runtime's threads and the TLS/QUIC statics exist from then on).
async fn warm_baseline(pki: &Pki, f: &Fx) -> Resources {
    for kind in KINDS {
        let (prefill, _) = ep(kind, pki, "prefill", true).await;
        let (decode, _) = ep(kind, pki, "decode", false).await;
        let addr = prefill.local_addr().unwrap().to_string();
        register(&prefill, f, 99);
        let (t, st) = pull(&decode, f, 99, &addr);
        arrives(f, &t, &st, "warm-up").await;
        decode.release(&addr, 99).await.unwrap();
        clean(&prefill, "warm-up").await;
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    Resources::sample()
}

type Check = fn(&Error) -> bool;

fn injected(e: &Error) -> bool {
    e.to_string().contains("injected")
}

// ---------------------------------------------------------------------------------------------
// Every fault, one request affected
// ---------------------------------------------------------------------------------------------

/// Which endpoint a rule goes on.
#[derive(Clone, Copy, Debug)]
enum On {
    /// The puller / push receiver (decode).
    Decode,
    /// The producer / pusher (prefill).
    Prefill,
}

struct Case {
    name: &'static str,
    on: On,
    rule: fn(u64) -> Rule,
    /// `None`: the affected request must still succeed (a delay within the timeouts).
    err: Option<Check>,
    /// Whether the fault takes the whole connection (so the other request may fail too, with an
    /// explicit error, and the consumer's session ends).
    whole_connection: bool,
}

fn pull_cases() -> Vec<Case> {
    vec![
        Case {
            name: "corrupt data frame",
            on: On::Decode,
            rule: |a| Rule::nth(Point::Recv(FrameSel::data(a)), 2, Action::Corrupt),
            err: Some(|e| matches!(e, Error::Checksum(_))),
            whole_connection: false,
        },
        Case {
            name: "truncated data frame",
            on: On::Decode,
            rule: |a| Rule::nth(Point::Recv(FrameSel::data(a)), 1, Action::Truncate),
            err: Some(|e| e.is_peer_failure()),
            whole_connection: false,
        },
        Case {
            name: "lane dropped mid-stream",
            on: On::Decode,
            rule: |a| Rule::nth(Point::Recv(FrameSel::data(a)), 3, Action::DropLane),
            err: Some(|e| e.is_peer_failure()),
            whole_connection: false,
        },
        Case {
            name: "sender's lane dropped",
            on: On::Prefill,
            rule: |a| Rule::nth(Point::Send(FrameSel::data(a)), 2, Action::DropLane),
            err: Some(|e| e.is_peer_failure()),
            whole_connection: false,
        },
        Case {
            name: "completed stripe turned into a failure",
            on: On::Decode,
            rule: |a| {
                Rule::once(
                    Point::Recv(FrameSel::msg_of("stream_done", a)),
                    Action::ReplaceWithFailed,
                )
            },
            err: Some(|e| matches!(e, Error::Remote(_)) && injected(e)),
            whole_connection: false,
        },
        Case {
            name: "failed submit of the pull",
            on: On::Decode,
            rule: |a| Rule::once(Point::Send(FrameSel::msg_of("pull", a)), Action::Fail),
            err: Some(injected),
            whole_connection: false,
        },
        Case {
            name: "delay within the timeout",
            on: On::Decode,
            rule: |a| {
                Rule::nth(
                    Point::Recv(FrameSel::data(a)),
                    1,
                    Action::Delay(Duration::from_millis(150)),
                )
            },
            err: None,
            whole_connection: false,
        },
        Case {
            name: "stalled lane (delay past the timeout)",
            on: On::Decode,
            rule: |a| Rule::nth(Point::Recv(FrameSel::data(a)), 1, Action::Stall),
            err: Some(|e| matches!(e, Error::Timeout(_))),
            whole_connection: false,
        },
        Case {
            name: "connection dropped",
            on: On::Decode,
            rule: |a| Rule::nth(Point::Recv(FrameSel::data(a)), 2, Action::DropConnection),
            err: Some(|e| e.is_peer_failure()),
            whole_connection: true,
        },
    ]
}

/// Pulls A and B at once over one connection with `case`'s fault aimed at A.
async fn pull_case(kind: TransportKind, pki: &Pki, f: &Fx, case: &Case) {
    let what = format!("{kind} pull: {}", case.name);
    let (prefill, pf) = ep(kind, pki, "prefill", true).await;
    let (decode, df) = ep(kind, pki, "decode", false).await;
    let addr = prefill.local_addr().unwrap().to_string();
    let (a, b) = (1, 2);
    let ha = register(&prefill, f, a);
    let hb = register(&prefill, f, b);
    // Connect first, so both requests share the peer's connection and lane pool.
    decode.describe(&addr, b).await.unwrap();
    match case.on {
        On::Decode => df.add((case.rule)(a)),
        On::Prefill => pf.add((case.rule)(a)),
    };
    let t0 = Instant::now();
    let (ta, sa) = pull(&decode, f, a, &addr);
    let (tb, sb) = pull(&decode, f, b, &addr);
    let ra = outcome(&ta, BOUND, &what).await;
    let took = t0.elapsed();
    match (case.err, &ra) {
        (None, Ok(_)) => {
            verify_dest(&f.dst, f.tokens, &sa, None);
        }
        (Some(check), Err(e)) => {
            assert!(check(e), "{what}: unexpected error {e}");
            assert!(
                ta.poll().unwrap().is_err(),
                "{what}: a failed transfer stays failed"
            );
        }
        (_, r) => panic!("{what}: unexpected outcome {r:?}"),
    }
    assert!(
        took < IO + Duration::from_secs(2),
        "{what}: the outcome took {took:?}"
    );
    let fired = [pf.fired(), df.fired()].concat();
    assert_eq!(
        fired.len(),
        1,
        "{what}: the fault must fire once: {fired:?}"
    );
    // The other request on the same connection is unaffected (or, when the whole connection
    // went, fails explicitly).
    let rb = outcome(&tb, BOUND, &what).await;
    let b_arrived = rb.is_ok();
    match rb {
        Ok(_) => {
            verify_dest(&f.dst, f.tokens, &sb, None);
        }
        // The consumer's session ended with its connection, and the producer released B: a
        // stripe of B that reaches it afterwards finds B unknown.
        Err(e) if case.whole_connection => assert!(
            e.is_peer_failure() || e.kind() == tpu_sync::ErrorKind::UnknownRequest,
            "{what}: B: {e}"
        ),
        Err(e) => panic!("{what}: the other request failed: {e}"),
    }
    // Nothing stored is lost: the producer still serves A (re-registered if the consumer's
    // session ended with the connection).
    let mut b_again = false;
    if case.whole_connection {
        // The consumer's session ended with its connection: A, which it was being served, ended
        // with it (`PeerLost`); B ended in the same step if the dead session was being served
        // B too, and stays registered if that session had only described it (a describe ends
        // nothing, issue 24). Either way nothing else ended.
        ends_peer_lost(&ha, &format!("{what}: A")).await;
        // The state machine ended A and B (when it did) in one locked step; the handles
        // hear of it one after the other. Its registration count says whether B ended, so
        // this does not depend on which handle was told first.
        if prefill.stats().source_registrations == 0 {
            ends_peer_lost(&hb, &format!("{what}: B")).await;
            b_again = true;
        } else {
            assert_eq!(hb.outcome(), None, "{what}: B");
        }
        register(&prefill, f, a);
        if b_again {
            register(&prefill, f, b);
        }
    } else {
        assert_eq!(ha.outcome(), None, "{what}");
    }
    let (ta, sa) = pull(&decode, f, a, &addr);
    arrives(f, &ta, &sa, &format!("{what}: retry of A")).await;
    decode.release(&addr, a).await.unwrap();
    if b_again {
        // B ended with the lost session, even if all its bytes had arrived (the producer
        // cannot tell), and its new registration is a new offer: this session never pulled
        // it, so it may not release it unpulled. It pulls it again, whole.
        let (tb2, sb2) = pull(&decode, f, b, &addr);
        arrives(f, &tb2, &sb2, &format!("{what}: retry of B")).await;
        decode.release(&addr, b).await.unwrap();
    } else if b_arrived {
        decode.release(&addr, b).await.unwrap();
    } else {
        // Its pull failed, so a release would not be a delivery: this consumer gives it up.
        decode.reject(&addr, b, "not retried").await.unwrap();
    }
    clean(&decode, &what).await;
    clean(&prefill, &what).await;
    drop(decode);
    drop(prefill);
    eventually(Duration::from_secs(5), &format!("{what}: lanes"), || {
        pf.live_lanes() + df.live_lanes() == 0
    })
    .await;
}

fn push_cases() -> Vec<Case> {
    vec![
        Case {
            name: "corrupt data frame",
            on: On::Decode,
            rule: |a| Rule::nth(Point::Recv(FrameSel::data(a)), 2, Action::Corrupt),
            err: Some(|e| e.to_string().contains("checksum")),
            whole_connection: false,
        },
        Case {
            name: "truncated data frame",
            on: On::Decode,
            rule: |a| Rule::nth(Point::Recv(FrameSel::data(a)), 1, Action::Truncate),
            err: Some(|e| e.is_peer_failure()),
            whole_connection: false,
        },
        Case {
            name: "acknowledged stripe turned into a failure",
            on: On::Prefill,
            rule: |a| {
                Rule::once(
                    Point::Recv(FrameSel::msg_of("stream_ack", a)),
                    Action::ReplaceWithFailed,
                )
            },
            err: Some(injected),
            whole_connection: false,
        },
        Case {
            name: "failed submit of the push",
            on: On::Prefill,
            rule: |a| Rule::once(Point::Send(FrameSel::msg_of("push", a)), Action::Fail),
            err: Some(injected),
            whole_connection: false,
        },
        Case {
            name: "stalled lane",
            on: On::Decode,
            rule: |a| Rule::nth(Point::Recv(FrameSel::data(a)), 1, Action::Stall),
            err: Some(|e| e.is_peer_failure() || matches!(e, Error::Cancelled(_))),
            whole_connection: false,
        },
        Case {
            name: "delay within the timeout",
            on: On::Prefill,
            rule: |a| {
                Rule::once(
                    Point::Send(FrameSel::msg_of("push_finish", a)),
                    Action::Delay(Duration::from_millis(150)),
                )
            },
            err: None,
            whole_connection: false,
        },
    ]
}

/// Pushes A and B at once over one connection with `case`'s fault aimed at A. Both ends of A
/// (the pusher's transfer and the receiver's registration) must end explicitly.
async fn push_case(kind: TransportKind, pki: &Pki, f: &Fx, case: &Case) {
    let what = format!("{kind} push: {}", case.name);
    // A sender whose first offer never left cannot cancel the receiver's registration (only a
    // sender of a push may, issue 24), so that registration ends at its lease of no activity:
    // short here, within the test's bound.
    let no_offer_reached = case.name == "failed submit of the push";
    let mut dopts = o(kind, pki, "decode", true);
    dopts.lease_ttl = Duration::from_secs(2);
    let (decode, df) = fault_endpoint(dopts).await;
    let (prefill, pf) = ep(kind, pki, "prefill", false).await;
    let addr = decode.local_addr().unwrap().to_string();
    let (a, b) = (1, 2);
    let (sink_a, sa) = expect(&decode, f, a);
    let (sink_b, sb) = expect(&decode, f, b);
    decode_connects(&prefill, &addr, f).await;
    match case.on {
        On::Decode => df.add((case.rule)(a)),
        On::Prefill => pf.add((case.rule)(a)),
    };
    let pa = push(&prefill, f, a, &addr);
    let pb = push(&prefill, f, b, &addr);
    let ra = outcome(&pa, BOUND, &what).await;
    let rs = outcome(&sink_a, BOUND, &format!("{what} (receiver)")).await;
    match case.err {
        None => {
            assert!(ra.is_ok() && rs.is_ok(), "{what}: {ra:?} {rs:?}");
            verify_dest(&f.dst, f.tokens, &sa, None);
        }
        Some(check) => {
            let e = ra.expect_err(&what);
            assert!(check(&e), "{what}: unexpected error {e}");
            let e = rs.expect_err(&format!("{what}: receiver"));
            assert!(
                e.is_peer_failure()
                    || matches!(e, Error::Checksum(_) | Error::Cancelled(_))
                    || (no_offer_reached && matches!(e, Error::Timeout(_))),
                "{what}: receiver: {e}"
            );
        }
    }
    let fired = [pf.fired(), df.fired()].concat();
    assert_eq!(
        fired.len(),
        1,
        "{what}: the fault must fire once: {fired:?}"
    );
    outcome(&pb, BOUND, &what).await.unwrap();
    arrives(f, &sink_b, &sb, &format!("{what}: B")).await;
    // The pusher still has A: a new registration receives it whole.
    if case.err.is_some() {
        let (sink, st) = expect(&decode, f, a);
        let p = push(&prefill, f, a, &addr);
        outcome(&p, BOUND, &what).await.unwrap();
        arrives(f, &sink, &st, &format!("{what}: retry of A")).await;
    }
    clean(&decode, &what).await;
    clean(&prefill, &what).await;
    drop(decode);
    drop(prefill);
    eventually(Duration::from_secs(5), &format!("{what}: lanes"), || {
        pf.live_lanes() + df.live_lanes() == 0
    })
    .await;
}

/// Opens the pusher's connection to the receiver before the faults are armed.
async fn decode_connects(prefill: &Endpoint, addr: &str, f: &Fx) {
    let e = prefill.describe_sink(addr, 1).await.unwrap();
    assert_eq!(e.1, f.tokens);
}

#[test]
fn every_fault_fails_only_its_request() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    run(Duration::from_secs(240), async {
        let pki = pki(&["prefill", "decode"]);
        let f = fx();
        let base = warm_baseline(&pki, &f).await;
        for kind in KINDS {
            for case in pull_cases() {
                pull_case(kind, &pki, &f, &case).await;
            }
            for case in push_cases() {
                push_case(kind, &pki, &f, &case).await;
            }
        }
        assert_back_to(&base, Duration::from_secs(5), "after every fault").await;
    });
}

// ---------------------------------------------------------------------------------------------
// Peer death at every point
// ---------------------------------------------------------------------------------------------

/// A peer that dies in the transport handshake: a TCP listener that reads a few bytes of the
/// client's first flight and closes (`hang`: never answers), or a UDP socket that never answers
/// (QUIC). Returns its address and the task serving it.
async fn dying_listener(kind: TransportKind, hang: bool) -> (String, tokio::task::JoinHandle<()>) {
    use tokio::io::AsyncReadExt;
    if kind == TransportKind::Quic {
        let u = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let addr = u.local_addr().unwrap().to_string();
        let task = tokio::spawn(async move {
            let mut b = [0u8; 2048];
            while u.recv_from(&mut b).await.is_ok() {}
        });
        return (addr, task);
    }
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let task = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((mut s, _)) = l.accept().await {
            if hang {
                held.push(s);
                continue;
            }
            let mut b = [0u8; 10];
            let _ = s.read_exact(&mut b).await;
            drop(s);
        }
    });
    (addr, task)
}

#[test]
fn peer_death_at_every_point_leaks_nothing() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    run(Duration::from_secs(420), async {
        let pki = pki(&["prefill", "decode", "doomed", "receiver"]);
        let f = fx();
        let base = warm_baseline(&pki, &f).await;
        let mut peak_locked = 0;
        let mut locks = false;
        for kind in KINDS {
            let (decode, df) = ep(kind, &pki, "decode", false).await;

            // 1. Before the first transfer: the prefill is gone before anyone connects.
            let (prefill, pf) = ep(kind, &pki, "prefill", true).await;
            let addr = prefill.local_addr().unwrap().to_string();
            pf.kill();
            drop(prefill);
            let (t, st) = pull(&decode, &f, 1, &addr);
            let e = outcome(&t, BOUND, "kill before first").await.unwrap_err();
            assert!(
                e.is_peer_failure() || matches!(e, Error::Io { .. }),
                "{kind}: {e}"
            );
            assert!(
                !any_nonzero(&st),
                "{kind}: nothing arrives from a dead peer"
            );
            clean(&decode, "kill before first").await;

            // 2. In the transport handshake: the peer dies after the client's first bytes, or
            // hangs without answering (bounded by the handshake timeout).
            // (A QUIC peer that dies in the handshake looks like one that hangs: no answer.)
            let hangs: &[bool] = if kind == TransportKind::Quic {
                &[true]
            } else {
                &[false, true]
            };
            for &hang in hangs {
                let (addr, task) = dying_listener(kind, hang).await;
                let t0 = Instant::now();
                let (t, st) = pull(&decode, &f, 2, &addr);
                let e = outcome(&t, BOUND, "death in handshake").await.unwrap_err();
                assert!(
                    e.is_peer_failure() || matches!(e, Error::Io { .. }),
                    "{kind} hang={hang}: {e}"
                );
                assert!(
                    t0.elapsed() < Duration::from_millis(2500),
                    "{kind}: {:?}",
                    t0.elapsed()
                );
                assert!(!any_nonzero(&st));
                task.abort();
                clean(&decode, "death in handshake").await;
            }

            // 3. In the protocol hello: the prefill dies when the hello arrives.
            let (prefill, pf) = ep(kind, &pki, "prefill", true).await;
            let addr = prefill.local_addr().unwrap().to_string();
            register(&prefill, &f, 3);
            pf.add(Rule::once(
                Point::Recv(FrameSel::msg("hello")),
                Action::kill(&pf),
            ));
            let (t, _) = pull(&decode, &f, 3, &addr);
            let e = outcome(&t, BOUND, "death in hello").await.unwrap_err();
            assert!(
                e.is_peer_failure() || matches!(e, Error::Io { .. }),
                "{kind}: {e}"
            );
            assert_eq!(pf.fired().len(), 1);
            drop(prefill);
            clean(&decode, "death in hello").await;

            // 4. The consumer dies in its own hello (after the producer answered): the
            // producer's session ends at once.
            let (prefill, _pf) = ep(kind, &pki, "prefill", true).await;
            let addr = prefill.local_addr().unwrap().to_string();
            let (doomed, dd) = ep(kind, &pki, "doomed", false).await;
            dd.add(Rule::once(
                Point::Recv(FrameSel::msg("hello_ack")),
                Action::kill(&dd),
            ));
            let h = register(&prefill, &f, 4);
            let (t, _) = pull(&doomed, &f, 4, &addr);
            outcome(&t, BOUND, "consumer death in hello")
                .await
                .unwrap_err();
            eventually(Duration::from_secs(3), "session ended", || {
                prefill.stats().sessions == 0
            })
            .await;
            drop(doomed);
            eventually(Duration::from_secs(3), "doomed lanes closed", || {
                dd.live_lanes() == 0
            })
            .await;
            assert_eq!(
                h.outcome(),
                None,
                "no lease was taken, the registration stays"
            );
            prefill.unregister_source(4);

            // 5. Between transfers: one pull, then the producer dies; noticed without a new
            // transfer; the next pull fails explicitly.
            register(&prefill, &f, 5);
            let (t, st) = pull(&decode, &f, 5, &addr);
            arrives(&f, &t, &st, "before death").await;
            peak_locked = peak_locked.max(Resources::sample().locked_kib);
            decode.release(&addr, 5).await.unwrap();
            let lost = decode.stats().peers_lost;
            drop(prefill);
            drop(_pf);
            eventually(Duration::from_secs(3), "death noticed", || {
                decode.stats().peers_lost > lost && decode.stats().peers == 0
            })
            .await;
            let (t, _) = pull(&decode, &f, 6, &addr);
            outcome(&t, BOUND, "pull after death").await.unwrap_err();
            clean(&decode, "kill between").await;

            // 6. Mid-pull: the producer dies as it sends its 5th data frame.
            let (prefill, pf) = ep(kind, &pki, "prefill", true).await;
            let addr = prefill.local_addr().unwrap().to_string();
            register(&prefill, &f, 7);
            pf.add(Rule::nth(
                Point::Send(FrameSel::data(7)),
                4,
                Action::kill(&pf),
            ));
            let t0 = Instant::now();
            let (t, _) = pull(&decode, &f, 7, &addr);
            let e = outcome(&t, BOUND, "kill mid-pull").await.unwrap_err();
            assert!(
                e.is_peer_failure() || matches!(e, Error::Io { .. }),
                "{kind}: {e}"
            );
            assert!(
                t0.elapsed() < Duration::from_secs(3),
                "{kind}: {:?}",
                t0.elapsed()
            );
            assert!(t.poll().unwrap().is_err(), "never reported done");
            assert!(
                pf.fired().iter().any(|x| x.starts_with("kill")),
                "{:?}",
                pf.fired()
            );
            drop(prefill);
            clean(&decode, "kill mid-pull").await;

            // 7. Mid-push: the sender dies as it sends its 5th data frame.
            let (receiver, rf) = ep(kind, &pki, "receiver", true).await;
            let (pusher, pf) = ep(kind, &pki, "prefill", false).await;
            let raddr = receiver.local_addr().unwrap().to_string();
            let (sink, st) = expect(&receiver, &f, 8);
            pf.add(Rule::nth(
                Point::Send(FrameSel::data(8)),
                4,
                Action::kill(&pf),
            ));
            let p = push(&pusher, &f, 8, &raddr);
            let e = outcome(&sink, BOUND, "kill mid-push").await.unwrap_err();
            assert!(
                e.is_peer_failure() || matches!(e, Error::Cancelled(_)),
                "{kind}: {e}"
            );
            outcome(&p, BOUND, "pusher after its own death")
                .await
                .unwrap_err();
            drop(st);
            drop(pusher);
            clean(&receiver, "kill mid-push").await;

            // 7b. The sender dies before its first stripe reaches the receiver (its connect
            // fails): the receiver's registration fails after `lease_ttl` without activity. (On
            // QUIC the failed connect may be a data lane's after the control lane and other
            // stripes reached the receiver; the sender then resets those stripes and tells it
            // that it cancelled, and whichever of the two arrives first fails the registration:
            // a peer failure or `Cancelled`, explicit either way.)
            let mut ro = o(kind, &pki, "doomed", true);
            ro.lease_ttl = Duration::from_millis(500);
            let (idle_receiver, _) = fault_endpoint(ro).await;
            let iaddr = idle_receiver.local_addr().unwrap().to_string();
            let (pusher, pf) = ep(kind, &pki, "prefill", false).await;
            pf.add(Rule::once(Point::Connect, Action::Fail));
            let (sink, _st) = expect(&idle_receiver, &f, 12);
            let p = push(&pusher, &f, 12, &iaddr);
            let e = outcome(&p, BOUND, "pusher that cannot connect")
                .await
                .unwrap_err();
            assert!(injected(&e), "{kind}: {e}");
            let t0 = Instant::now();
            let e = outcome(&sink, BOUND, "receiver of a dead sender")
                .await
                .unwrap_err();
            assert!(
                matches!(e, Error::Timeout(_) | Error::Cancelled(_)) || e.is_peer_failure(),
                "{kind}: {e}"
            );
            assert!(
                t0.elapsed() < Duration::from_secs(2),
                "{kind}: {:?}",
                t0.elapsed()
            );
            clean(&idle_receiver, "idle receiver").await;
            drop((pusher, idle_receiver));

            // 8. The consumer dies mid-pull: the producer releases the request at once.
            let (doomed, dd) = ep(kind, &pki, "doomed", false).await;
            register(&receiver, &f, 9);
            dd.add(Rule::nth(
                Point::Recv(FrameSel::data(9)),
                2,
                Action::kill(&dd),
            ));
            let (t, _) = pull(&doomed, &f, 9, &raddr);
            outcome(&t, BOUND, "consumer killed").await.unwrap_err();
            eventually(Duration::from_secs(3), "producer released", || {
                receiver.stats().leases == 0 && receiver.stats().source_registrations == 0
            })
            .await;
            drop(doomed);
            clean(&receiver, "consumer death").await;

            // 9. Restart with new addresses: the producer comes back under its name on a new
            // port; the consumer is pointed at it and pulls every byte.
            drop(receiver);
            eventually(Duration::from_secs(3), "receiver's lanes closed", || {
                rf.live_lanes() == 0
            })
            .await;
            let (prefill, pf) = ep(kind, &pki, "prefill", true).await;
            let old = prefill.local_addr().unwrap();
            decode.add_peer("prefill", &old.to_string()).await.unwrap();
            register(&prefill, &f, 10);
            let (t, st) = pull(&decode, &f, 10, "prefill");
            arrives(&f, &t, &st, "before restart").await;
            pf.kill();
            drop(prefill);
            let (prefill, pf2) = ep(kind, &pki, "prefill", true).await;
            assert_ne!(prefill.local_addr().unwrap(), old);
            decode
                .add_peer("prefill", &prefill.local_addr().unwrap().to_string())
                .await
                .unwrap();
            let h = register(&prefill, &f, 11);
            let (t, st) = pull(&decode, &f, 11, "prefill");
            arrives(&f, &t, &st, "after restart").await;
            if let LockStatus::Locked = st.arena().lock_status() {
                locks = true;
            }
            decode.release("prefill", 11).await.unwrap();
            assert_eq!(h.wait(BOUND).await.unwrap(), SourceOutcome::Released);
            clean(&prefill, "restarted producer").await;
            clean(&decode, "consumer after restart").await;
            drop(prefill);
            drop(decode);
            eventually(Duration::from_secs(5), "no lane left", || {
                df.live_lanes() + pf.live_lanes() + pf2.live_lanes() == 0
            })
            .await;
        }
        if locks && !sanitized() {
            assert!(
                peak_locked > base.locked_kib,
                "pinned staging shows in VmLck"
            );
        }
        // Every connection closes with its endpoint (QUIC: within its drain period, about 3 s,
        // also when the peer died mid-setup; see the test below).
        assert_back_to(&base, Duration::from_secs(10), "after every death").await;
    });
}

/// A UDP relay between one QUIC client and `to`: forwards both ways until `cut` is set, then
/// drops every datagram (the client vanishes without any close reaching the listener).
async fn udp_relay(
    to: std::net::SocketAddr,
    cut: Arc<std::sync::atomic::AtomicBool>,
) -> (std::net::SocketAddr, tokio::task::JoinHandle<()>) {
    use std::sync::atomic::Ordering::Relaxed;
    let front = Arc::new(tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap());
    let back = Arc::new(tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap());
    back.connect(to).await.unwrap();
    let addr = front.local_addr().unwrap();
    let client = Arc::new(Mutex::new(None::<std::net::SocketAddr>));
    let (f2, b2, c2, cut2) = (front.clone(), back.clone(), client.clone(), cut.clone());
    let back_to_front = tokio::spawn(async move {
        let mut b = vec![0u8; 65536];
        while let Ok(n) = b2.recv(&mut b).await {
            let c = *c2.lock().unwrap();
            if let (false, Some(c)) = (cut2.load(Relaxed), c) {
                let _ = f2.send_to(&b[..n], c).await;
            }
        }
    });
    let task = tokio::spawn(async move {
        let _abort = AbortOnDrop(back_to_front);
        let mut b = vec![0u8; 65536];
        while let Ok((n, from)) = front.recv_from(&mut b).await {
            *client.lock().unwrap() = Some(from);
            if !cut.load(Relaxed) {
                let _ = back.send(&b[..n]).await;
            }
        }
    });
    (addr, task)
}

struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Issue 23 item 3: a QUIC client that vanishes while its lane is being set up (the QUIC
/// handshake done, its first bytes sent, then silence: no close ever reaches the listener) must
/// not keep the listener's connection, nor its UDP socket, alive after the listener is dropped,
/// even while a lane of that connection and the transport are still held (an endpoint's tasks
/// that are being aborted hold both):
/// the held lane's read ends within seconds, and once it is dropped every socket is gone within
/// QUIC's drain period. (Without the fix both waited for the 120 s idle timeout.)
#[test]
fn quic_peer_vanishing_mid_setup_releases_the_listener() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tpu_sync::net::quic::QuicTransport;
    use tpu_sync::net::transport::{Transport, TransportTimeouts};
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    run(Duration::from_secs(120), async {
        let pki = pki(&["prefill", "decode"]);
        let timeouts = TransportTimeouts {
            connect: Duration::from_secs(5),
            handshake: Duration::from_secs(5),
        };
        let quic = |name: &str| {
            QuicTransport::new(security(TransportKind::Quic, &pki, name), timeouts, 1).unwrap()
        };
        // Warm-up (QUIC and TLS statics, the runtime's threads), then the baseline.
        for _ in 0..2 {
            let server = quic("prefill");
            let acc = server.listen("127.0.0.1:0".parse().unwrap()).await.unwrap();
            let client = quic("decode");
            let conn = client.connect(acc.local_addr()).await.unwrap();
            let mut lane = conn.open_lane().await.unwrap();
            lane.write_all(b"warm").await.unwrap();
            let mut got = acc.accept().await.unwrap();
            let mut b = [0u8; 4];
            got.read_exact(&mut b).await.unwrap();
            assert_eq!(&b, b"warm");
            drop((lane, conn, client, got, acc, server));
        }
        tokio::time::sleep(Duration::from_secs(4)).await;
        let base = Resources::sample();

        let server = quic("prefill");
        let acc = server.listen("127.0.0.1:0".parse().unwrap()).await.unwrap();
        let cut = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (relay, relay_task) = udp_relay(acc.local_addr(), cut.clone()).await;
        let client = quic("decode");
        let conn = client.connect(relay).await.unwrap();
        let mut lane = conn.open_lane().await.unwrap();
        // A first frame's worth of bytes that differ from each other, then the client is gone.
        let hello: Vec<u8> = (0..64u8)
            .map(|i| i.wrapping_mul(37).wrapping_add(11))
            .collect();
        lane.write_all(&hello).await.unwrap();
        let mut held = acc.accept().await.unwrap();
        let mut b = vec![0u8; hello.len()];
        held.read_exact(&mut b).await.unwrap();
        assert_eq!(b, hello, "the bytes before the peer vanished arrive intact");
        cut.store(true, std::sync::atomic::Ordering::Relaxed);
        drop((lane, conn, client));
        // The listener goes while the lane is still held and while its transport lives on
        // (as when an endpoint's tasks, which hold both, are still being aborted).
        drop(acc);
        let t0 = Instant::now();
        let mut one = [0u8; 1];
        let r = tokio::time::timeout(Duration::from_secs(10), held.read(&mut one)).await;
        assert!(
            matches!(r, Ok(Err(_)) | Ok(Ok(0))),
            "the held lane of a dropped listener ends at once, got {r:?} after {:?}",
            t0.elapsed()
        );
        drop(held);
        drop(server);
        relay_task.abort();
        let _ = relay_task.await;
        assert_back_to(
            &base,
            Duration::from_secs(10),
            "after the listener was dropped",
        )
        .await;
    });
}

/// A QUIC client that gives up on its connect before sending its ClientHello (its first Initial
/// packet carries only a CONNECTION_CLOSE) must leave nothing behind on the listener: quinn-proto
/// 0.11 keeps the server side of such a connection in the draining state without a close timer,
/// so it lived for the 120 s idle timeout and held the listener's UDP socket after the listener
/// was dropped (`peer_death_at_every_point_leaks_nothing` failed in half of its runs when a
/// pusher's failed push dropped a data lane's connect). Now the listener validates addresses
/// with a stateless Retry before any connection exists, and a dropped endpoint closes its UDP
/// socket within `SOCKET_CLOSE_GRACE` whatever its connections do. Checked: the listener
/// still serves a real client byte-exact after the abandoned connects, and once dropped, its
/// exact address can be bound again within the grace.
#[test]
fn quic_connect_abandoned_before_its_hello_leaves_nothing() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tpu_sync::net::quic::{QuicTransport, SOCKET_CLOSE_GRACE};
    use tpu_sync::net::transport::{Transport, TransportTimeouts};
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    // One thread: a connect polled once has created its connection, but its driver task has
    // not run yet, so when the connect is dropped the first packet it sends is the close.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let pki = pki(&["prefill", "decode"]);
        let timeouts = TransportTimeouts {
            connect: Duration::from_secs(5),
            handshake: Duration::from_secs(5),
        };
        let quic = |name: &str| {
            QuicTransport::new(security(TransportKind::Quic, &pki, name), timeouts, 2).unwrap()
        };
        let server = quic("prefill");
        let acc = server.listen("127.0.0.1:0".parse().unwrap()).await.unwrap();
        let addr = acc.local_addr();
        for _ in 0..8 {
            let client = quic("decode");
            {
                // Polled once, without yielding to the runtime, then dropped.
                let mut connect = client.connect(addr);
                let done = std::future::poll_fn(|cx| {
                    std::task::Poll::Ready(connect.as_mut().poll(cx).is_ready())
                })
                .await;
                assert!(
                    !done,
                    "a QUIC connect cannot finish without running its driver"
                );
            }
            drop(client);
            // Let the dropped connections send their close.
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        // The listener still serves a real client.
        let client = quic("decode");
        let conn = client.connect(addr).await.unwrap();
        let mut lane = conn.open_lane().await.unwrap();
        let msg: Vec<u8> = (0..200u32).map(|i| (i * 89 + 7) as u8).collect();
        lane.write_all(&msg).await.unwrap();
        let mut got = acc.accept().await.unwrap();
        let mut b = vec![0u8; msg.len()];
        got.read_exact(&mut b).await.unwrap();
        assert_eq!(b, msg);
        drop((lane, got, conn, client));
        drop(acc);
        drop(server);
        let t0 = Instant::now();
        let limit = SOCKET_CLOSE_GRACE + Duration::from_secs(2);
        loop {
            match std::net::UdpSocket::bind(addr) {
                Ok(_) => break,
                Err(e) if t0.elapsed() < limit => {
                    assert_eq!(e.kind(), std::io::ErrorKind::AddrInUse, "{e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Err(e) => panic!(
                    "the dropped listener's UDP socket {addr} is still open after {:?}: {e}",
                    t0.elapsed()
                ),
            }
        }
    });
}
