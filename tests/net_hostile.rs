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

mod net_util;

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
