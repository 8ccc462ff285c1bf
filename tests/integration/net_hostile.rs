//! Issue 24, a peer the library does not control: raw frames from a TCP socket (as an outsider
//! would write them) against a producer over loopback, and two live endpoints that share a name.
//! Each test fails on the tree before the fix it names.
//!
//! - `Release{delivered: true}` from a session that never pulled the request is refused and
//!   changes nothing; a `Describe` then a disconnect ends nothing; the real consumer's pull and
//!   release still end the registration as released.
//! - Two live endpoints named alike (separate containers, same pid) pulling concurrently from
//!   one producer keep their own sessions: every pull arrives byte-exact.
//! - A reject reason of megabytes is kept to 1 KiB.
//! - A stranger's `Cancel{push: true}` of a push registration changes nothing.
//! - Idle data lanes are closed by the server after `lane_idle_timeout`.

use crate::net_util;

use std::time::Duration;

use net_util::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tpu_sync::net::{SourceOutcome, TransportKind};
use tpu_sync::wire::{Control, FrameHeader, LaneRole, HEADER_LEN, PROTOCOL_VERSION};

/// A hand-written peer on one lane.
struct Raw(TcpStream);

impl Raw {
    async fn open(addr: std::net::SocketAddr, name: &str, role: LaneRole) -> Raw {
        let mut r = Raw(TcpStream::connect(addr).await.unwrap());
        r.send(&Control::Hello {
            name: name.into(),
            protocol: PROTOCOL_VERSION,
            incarnation: 0x5eed,
            role,
            unhashed_aead: false,
        })
        .await;
        assert!(matches!(r.recv().await, Some(Control::HelloAck { .. })));
        r
    }

    async fn send(&mut self, m: &Control) {
        self.0.write_all(&m.to_frame(1).unwrap()).await.unwrap();
    }

    /// The next control message, or `None` when the producer closed the lane.
    async fn recv(&mut self) -> Option<Control> {
        let mut h = [0u8; HEADER_LEN];
        tokio::time::timeout(Duration::from_secs(5), self.0.read_exact(&mut h))
            .await
            .expect("the producer answers")
            .ok()?;
        let h = FrameHeader::decode(&h).unwrap();
        let mut b = vec![0u8; h.body_len as usize];
        self.0.read_exact(&mut b).await.ok()?;
        Some(Control::decode(&b).unwrap())
    }
}

/// How many of `silent` (connections that never sent a byte) the listener closed at once: a
/// read sees end of stream (or a reset) within 20 ms.
async fn closed_at_once<S: tokio::io::AsyncRead + Unpin>(silent: &mut [S]) -> usize {
    let mut closed = 0;
    for s in silent.iter_mut() {
        let mut b = [0u8; 64];
        match tokio::time::timeout(Duration::from_millis(20), s.read(&mut b)).await {
            Ok(Ok(0)) | Ok(Err(_)) => closed += 1,
            _ => {}
        }
    }
    closed
}

/// Registers request `rid` of `f` at `prefill`, pulls it with `decode` byte-exact, releases it,
/// and checks that the registration ends as released.
async fn pull_and_release(
    prefill: &tpu_sync::net::Endpoint,
    decode: &tpu_sync::net::Endpoint,
    f: &Fx,
    rid: u64,
) {
    let addr = prefill.local_addr().unwrap().to_string();
    let h = register_whole(prefill, &f.src, f.tokens, rid);
    let st = dest_staging(&f.plan, &f.dst, None);
    let t = pull_fx(decode, f, rid, &addr, st.clone());
    t.wait_timeout(Duration::from_secs(20)).await.unwrap();
    verify_dest(&f.dst, f.tokens, &st, None);
    decode.release(&addr, rid).await.unwrap();
    assert_eq!(
        h.wait(Duration::from_secs(5)).await.unwrap(),
        SourceOutcome::Released
    );
}

#[test]
fn a_peer_that_never_pulled_cannot_end_a_request() {
    run(Duration::from_secs(60), async {
        let pki = pki(&["prefill", "decode"]);
        let f = reshard_fixture(2, 96, 41);
        let prefill = endpoint(TransportKind::Tcp, &pki, "prefill", true).await;
        let decode = endpoint(TransportKind::Tcp, &pki, "decode", false).await;
        let addr = prefill.local_addr().unwrap();
        let h = register_whole(&prefill, &f.src, f.tokens, 1);

        // A release that claims a delivery, from a session that was never served.
        let mut raw = Raw::open(addr, "stranger", LaneRole::Data).await;
        raw.send(&Control::Release {
            request_id: 1,
            delivered: true,
            attempt: 0,
        })
        .await;
        match raw.recv().await {
            Some(Control::Failed { message, .. }) => {
                assert!(message.contains("cannot release"), "{message}")
            }
            m => panic!("a stranger's release must be refused, got {m:?}"),
        }
        // A describe (which takes a lease), then the stranger disconnects.
        raw.send(&Control::Describe {
            request_id: 1,
            sink: false,
        })
        .await;
        assert!(matches!(
            raw.recv().await,
            Some(Control::Description { request_id: 1, .. })
        ));
        drop(raw);
        // A reject of megabytes for another (unregistered) request.
        let mut raw = Raw::open(addr, "stranger-2", LaneRole::Data).await;
        raw.send(&Control::Reject {
            request_id: 2,
            reason: "\u{e9}".repeat(4 << 20),
        })
        .await;
        assert!(matches!(
            raw.recv().await,
            Some(Control::Rejected {
                request_id: 2,
                known: false
            })
        ));
        drop(raw);
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(h.outcome(), None, "nothing the strangers did ended it");
        assert_eq!(prefill.stats().source_registrations, 1);

        // The real consumer gets every byte, and its release ends it as released.
        let st = dest_staging(&f.plan, &f.dst, None);
        let t = pull_fx(&decode, &f, 1, &addr.to_string(), st.clone());
        t.wait_timeout(Duration::from_secs(20)).await.unwrap();
        verify_dest(&f.dst, f.tokens, &st, None);
        decode.release(&addr.to_string(), 1).await.unwrap();
        assert_eq!(
            h.wait(Duration::from_secs(5)).await.unwrap(),
            SourceOutcome::Released
        );

        // Request 2, registered now, ends rejected at once with the reason cut to 1 KiB.
        let h2 = register_whole(&prefill, &f.src, f.tokens, 2);
        match h2.wait(Duration::from_secs(5)).await.unwrap() {
            SourceOutcome::Rejected(r) => {
                assert!(r.len() <= 1024 + 64, "reason kept whole: {} bytes", r.len());
                assert!(r.ends_with("..."), "{r}");
            }
            o => panic!("{o:?}"),
        }
    });
}

/// Issue 24, item 1: only a push's sender can cancel it. A stranger's `Cancel{push: true}` for a
/// push registration, sent as a raw frame on a control lane, changes nothing:
/// the registration stays open, and the real sender's push then arrives byte-exact.
#[test]
fn a_stranger_cannot_cancel_a_push() {
    run(Duration::from_secs(60), async {
        let pki = pki(&["prefill", "decode"]);
        let f = reshard_fixture(2, 96, 47);
        let prefill = endpoint(TransportKind::Tcp, &pki, "prefill", false).await;
        let decode = endpoint(TransportKind::Tcp, &pki, "decode", true).await;
        let addr = decode.local_addr().unwrap();
        let st = dest_staging(&f.plan, &f.dst, None);
        let sink = decode
            .expect_push(sink_whole(&f.dst, f.tokens, 5, st.clone(), None))
            .unwrap();
        let mut raw = Raw::open(addr, "stranger", LaneRole::Control).await;
        raw.send(&Control::Cancel {
            request_id: 5,
            push: true,
        })
        .await;
        // The control lane is read in order: the answer to a ping sent after the cancel proves
        // that the cancel was handled.
        raw.send(&Control::Ping { seq: 7 }).await;
        assert!(matches!(raw.recv().await, Some(Control::Pong { seq: 7 })));
        drop(raw);
        assert!(
            sink.poll().is_none(),
            "a stranger ended the push registration"
        );
        assert!(!any_nonzero(&st), "bytes landed before the push");
        let t = prefill
            .push(push_whole(
                &f.src,
                &f.dst,
                f.tokens,
                5,
                None,
                tpu_sync::net::PeerMap::single(addr.to_string()),
            ))
            .unwrap();
        t.wait_timeout(Duration::from_secs(20)).await.unwrap();
        sink.wait_timeout(Duration::from_secs(20)).await.unwrap();
        verify_dest(&f.dst, f.tokens, &st, None);
    });
}

/// Issue 24, item 5: a data lane that carries no request for `lane_idle_timeout` is closed by the
/// server (a peer that opens lanes and leaves them does not keep them), and a client with the
/// same setting never reuses a pooled lane the server closed: pulls separated by more than the
/// timeout both arrive byte-exact.
#[test]
fn idle_data_lanes_are_closed_by_the_server() {
    run(Duration::from_secs(60), async {
        let f = reshard_fixture(2, 96, 59);
        let idle = Duration::from_millis(800);
        let mut po = opts(
            TransportKind::Tcp,
            tpu_sync::net::Security::None,
            "prefill",
            true,
        );
        po.lane_idle_timeout = idle;
        let prefill = tpu_sync::net::Endpoint::bind(po).await.unwrap();
        let addr = prefill.local_addr().unwrap();
        let before = prefill.stats().lanes_open;
        // The idler's session stays alive (its control lane pings every 100 ms, well within the
        // heartbeat timeout): its data lanes close because they are idle, not because it died.
        let mut ctl = Raw::open(addr, "idler", LaneRole::Control).await;
        let pinger = tokio::spawn(async move {
            for seq in 0.. {
                ctl.send(&Control::Ping { seq }).await;
                assert!(matches!(ctl.recv().await, Some(Control::Pong { .. })));
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        });
        let mut lanes = Vec::new();
        for _ in 0..8 {
            lanes.push(Raw::open(addr, "idler", LaneRole::Data).await);
        }
        assert_eq!(prefill.stats().lanes_open, before + 9);
        let t0 = std::time::Instant::now();
        for raw in lanes.iter_mut() {
            assert!(raw.recv().await.is_none(), "an idle lane got a message");
        }
        let waited = t0.elapsed();
        assert!(
            waited >= idle - Duration::from_millis(100),
            "closed after {waited:?}"
        );
        assert!(!pinger.is_finished(), "the idler's control lane failed");
        pinger.abort();
        eventually(Duration::from_secs(5), "idle lanes counted closed", || {
            prefill.stats().lanes_open == before
        })
        .await;

        let mut co = opts(
            TransportKind::Tcp,
            tpu_sync::net::Security::None,
            "decode",
            false,
        );
        co.lane_idle_timeout = idle;
        let decode = tpu_sync::net::Endpoint::bind(co).await.unwrap();
        for rid in [11, 12] {
            pull_and_release(&prefill, &decode, &f, rid).await;
            // Past the server's timeout: every lane of the first pull is closed by now.
            tokio::time::sleep(idle + Duration::from_millis(400)).await;
        }
    });
}

#[test]
fn two_live_endpoints_with_one_name_pull_concurrently() {
    run(Duration::from_secs(120), async {
        let pki = pki(&["prefill", "decode"]);
        let f = reshard_fixture(2, 96, 43);
        let prefill = endpoint(TransportKind::Tcp, &pki, "prefill", true).await;
        let addr = prefill.local_addr().unwrap().to_string();
        // Same name, separate endpoints (as two containers whose processes have the same pid).
        let a = endpoint(TransportKind::Tcp, &pki, "decode", false).await;
        let b = endpoint(TransportKind::Tcp, &pki, "decode", false).await;
        let n = 8u64;
        let handles: Vec<_> = (0..2 * n)
            .map(|rid| register_whole(&prefill, &f.src, f.tokens, 100 + rid))
            .collect();
        let mut pulls = Vec::new();
        for rid in 0..2 * n {
            let ep = if rid % 2 == 0 { &a } else { &b };
            let st = dest_staging(&f.plan, &f.dst, None);
            pulls.push((rid, pull_fx(ep, &f, 100 + rid, &addr, st.clone()), st));
        }
        for (rid, t, st) in &pulls {
            let r = t.wait_timeout(Duration::from_secs(30)).await;
            assert!(r.is_ok(), "pull {rid}: {r:?}");
            verify_dest(&f.dst, f.tokens, st, None);
        }
        for rid in 0..2 * n {
            let ep = if rid % 2 == 0 { &a } else { &b };
            ep.release(&addr, 100 + rid).await.unwrap();
        }
        for (rid, h) in handles.iter().enumerate() {
            assert_eq!(
                h.wait(Duration::from_secs(5)).await.unwrap(),
                SourceOutcome::Released,
                "request {rid}"
            );
        }
        assert_eq!(prefill.stats().sessions, 2, "one session per live endpoint");
    });
}

/// A squatter of another user holds the producer's abstract socket name `@tpu-sync-shm/<port>`
/// (abstract names have no permissions: whoever binds first owns them). The consumer, seeing
/// by `SO_PEERCRED` that the name is not held by its own user, never speaks to it (not a byte
/// of hello) and pulls over TCP instead, byte-exact. Needs root to run the squatter as
/// `nobody`; skipped (with a message) otherwise.
#[test]
fn a_squatted_shm_name_of_another_user_is_not_spoken_to() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("skipped: needs root to run a squatter as another user");
        return;
    }
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    // The squatter: binds the name as uid 65534, accepts, reports every byte it is sent.
    let script = format!(
        "import socket,sys\n\
         s=socket.socket(socket.AF_UNIX,socket.SOCK_STREAM)\n\
         s.bind('\\0tpu-sync-shm/{port}')\n\
         s.listen(16)\n\
         print('ready',flush=True)\n\
         s.settimeout(30)\n\
         n=0\n\
         try:\n\
         \x20while True:\n\
         \x20 c,_=s.accept()\n\
         \x20 c.settimeout(2)\n\
         \x20 try:\n\
         \x20  while True:\n\
         \x20   b=c.recv(4096)\n\
         \x20   if not b: break\n\
         \x20   n+=len(b)\n\
         \x20 except OSError: pass\n\
         \x20 print('got',n,flush=True)\n\
         except OSError: pass\n"
    );
    use std::io::BufRead;
    use std::os::unix::process::CommandExt;
    let mut squatter = std::process::Command::new("python3")
        .args(["-c", &script])
        .uid(65534)
        .gid(65534)
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = std::io::BufReader::new(squatter.stdout.take().unwrap());
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    assert_eq!(line.trim(), "ready", "the squatter bound the name");
    run(Duration::from_secs(60), async move {
        let pki = pki(&["prefill", "decode"]);
        let f = reshard_fixture(2, 96, 47);
        let mut po = opts(
            TransportKind::Shm,
            security(TransportKind::Shm, &pki, "prefill"),
            "prefill",
            true,
        );
        po.listen = Some(format!("127.0.0.1:{port}").parse().unwrap());
        let prefill = tpu_sync::net::Endpoint::bind(po).await.unwrap();
        let decode = endpoint(TransportKind::Shm, &pki, "decode", false).await;
        let addr = prefill.local_addr().unwrap().to_string();
        let h = register_whole(&prefill, &f.src, f.tokens, 5);
        let st = dest_staging(&f.plan, &f.dst, None);
        let t = pull_fx(&decode, &f, 5, &addr, st.clone());
        let r = t.wait_timeout(Duration::from_secs(20)).await;
        assert!(r.is_ok(), "the pull goes over TCP: {r:?}");
        verify_dest(&f.dst, f.tokens, &st, None);
        decode.release(&addr, 5).await.unwrap();
        assert_eq!(
            h.wait(Duration::from_secs(5)).await.unwrap(),
            SourceOutcome::Released
        );
    });
    let _ = squatter.kill();
    let _ = squatter.wait();
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut out, &mut rest).unwrap();
    for l in rest.lines() {
        assert_eq!(l.trim(), "got 0", "the squatter was sent bytes: {rest}");
    }
}

/// Issue 24, item 5, on the same-host transport: connections to the abstract socket
/// `@tpu-sync-shm/<port>` that never say hello hold at most `MAX_HANDSHAKES_IN_PROGRESS`
/// handshakes; the rest are closed at once and counted. Once their handshake timeout passed, a
/// consumer on this host pulls byte-exact over shm.
#[test]
fn shm_handshakes_before_the_hello_are_capped() {
    use std::os::linux::net::SocketAddrExt;
    use tpu_sync::net::transport::MAX_HANDSHAKES_IN_PROGRESS;
    run(Duration::from_secs(90), async {
        let f = reshard_fixture(2, 96, 61);
        let mut po = opts(
            TransportKind::Shm,
            tpu_sync::net::Security::None,
            "prefill",
            true,
        );
        po.handshake_timeout = Duration::from_secs(2);
        let prefill = tpu_sync::net::Endpoint::bind(po).await.unwrap();
        let addr = prefill.local_addr().unwrap();
        let name = std::os::unix::net::SocketAddr::from_abstract_name(format!(
            "tpu-sync-shm/{}",
            addr.port()
        ))
        .unwrap();
        let n = MAX_HANDSHAKES_IN_PROGRESS + 44;
        let mut silent = Vec::new();
        for _ in 0..n {
            let s = std::os::unix::net::UnixStream::connect_addr(&name).unwrap();
            s.set_nonblocking(true).unwrap();
            silent.push(tokio::net::UnixStream::from_std(s).unwrap());
        }
        // The ones past the cap are closed at once.
        let closed = closed_at_once(&mut silent).await;
        assert!(
            closed >= n - MAX_HANDSHAKES_IN_PROGRESS,
            "{closed} of {n} closed at once"
        );
        assert!(prefill.stats().handshake_failures >= (n - MAX_HANDSHAKES_IN_PROGRESS) as u64);
        drop(silent);
        tokio::time::sleep(Duration::from_millis(2500)).await;
        let decode = tpu_sync::net::Endpoint::bind(opts(
            TransportKind::Shm,
            tpu_sync::net::Security::None,
            "decode",
            false,
        ))
        .await
        .unwrap();
        pull_and_release(&prefill, &decode, &f, 9).await;
    });
}

/// Issue 24: handshakes before authentication are capped per listener
/// (`MAX_HANDSHAKES_IN_PROGRESS`): 300 TCP connections to a TLS listener that never send a
/// byte hold at most that many handshakes; the rest are closed at once and counted. Once their
/// handshake timeout passed, an authenticated consumer connects and pulls byte-exact.
#[test]
fn handshakes_before_authentication_are_capped() {
    use tpu_sync::net::transport::MAX_HANDSHAKES_IN_PROGRESS;
    run(Duration::from_secs(90), async {
        let pki = pki(&["prefill", "decode"]);
        let f = reshard_fixture(2, 96, 53);
        let mut po = opts(
            TransportKind::Tls,
            security(TransportKind::Tls, &pki, "prefill"),
            "prefill",
            true,
        );
        po.handshake_timeout = Duration::from_secs(2);
        let prefill = tpu_sync::net::Endpoint::bind(po).await.unwrap();
        let addr = prefill.local_addr().unwrap();
        let n = MAX_HANDSHAKES_IN_PROGRESS + 44;
        let mut silent = Vec::new();
        for _ in 0..n {
            silent.push(TcpStream::connect(addr).await.unwrap());
        }
        // The ones past the cap are closed at once.
        let closed = closed_at_once(&mut silent).await;
        assert!(
            closed >= n - MAX_HANDSHAKES_IN_PROGRESS,
            "{closed} of {n} closed at once"
        );
        assert!(prefill.stats().handshake_failures >= (n - MAX_HANDSHAKES_IN_PROGRESS) as u64);
        drop(silent);
        tokio::time::sleep(Duration::from_millis(2500)).await;
        let decode = endpoint(TransportKind::Tls, &pki, "decode", false).await;
        pull_and_release(&prefill, &decode, &f, 9).await;
    });
}
