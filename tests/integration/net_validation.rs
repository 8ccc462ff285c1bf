//! A receiver validates every push against its own registration and plan: a raw peer speaking
//! the wire protocol by hand tries a changed stream count, a duplicate stripe, over-delivery, a
//! chunk at the wrong offset, an out-of-range block id, a plan that differs, and a pair the
//! receiver does not host. Each is refused with a clear error, and a request that received bad
//! data is failed, never reported done.

use crate::net_util;

use std::time::Duration;

use net_util::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tpu_sync::net::{Endpoint, SinkRegistration, TransportKind};
use tpu_sync::plan::{spans_digest, Placement, Plan};
use tpu_sync::wire::{
    Control, DataHeader, FrameHeader, FrameKind, LaneRole, Stripe, HEADER_LEN, PROTOCOL_VERSION,
};
use tpu_sync::Error;

struct Raw(TcpStream);

impl Raw {
    async fn open(addr: std::net::SocketAddr) -> Raw {
        let mut r = Raw(TcpStream::connect(addr).await.unwrap());
        r.send(&Control::Hello {
            name: "raw".into(),
            protocol: PROTOCOL_VERSION,
            incarnation: 7,
            role: LaneRole::Data,
            unhashed_aead: false,
        })
        .await;
        assert!(matches!(r.recv().await, Some(Control::HelloAck { .. })));
        r
    }

    async fn send(&mut self, m: &Control) {
        self.0.write_all(&m.to_frame(1).unwrap()).await.unwrap();
    }

    async fn data(&mut self, offset: u64, payload: &[u8]) {
        let fh = FrameHeader {
            kind: FrameKind::Data,
            body_len: (16 + payload.len()) as u32,
            request_id: 1,
        };
        let dh = DataHeader {
            stream_offset: offset,
            checksum: tpu_sync::wire::checksum([payload]),
        };
        let _ = self.0.write_all(&fh.encode()).await;
        let _ = self.0.write_all(&dh.encode()).await;
        let _ = self.0.write_all(payload).await;
    }

    /// The next control message, or `None` when the receiver closed the lane.
    async fn recv(&mut self) -> Option<Control> {
        let mut h = [0u8; HEADER_LEN];
        tokio::time::timeout(Duration::from_secs(5), self.0.read_exact(&mut h))
            .await
            .expect("receiver answers")
            .ok()?;
        let h = FrameHeader::decode(&h).unwrap();
        let mut b = vec![0u8; h.body_len as usize];
        self.0.read_exact(&mut b).await.ok()?;
        Some(Control::decode(&b).unwrap())
    }
}

fn push(src: &Placement, plan: &Plan, s: u32, d: u32, stripe: Stripe, tokens: u32) -> Control {
    let spans = plan.pair_spans(s, d);
    Control::Push {
        request_id: 1,
        src_rank: s,
        dst_rank: d,
        src: src.clone(),
        num_tokens: tokens,
        digest: spans_digest(&spans),
        total_bytes: spans.iter().map(|x| x.bytes()).sum(),
        stripe,
    }
}

fn failed_with(m: Option<Control>, needle: &str) {
    match m {
        Some(Control::Failed { message, .. }) => {
            assert!(
                message.contains(needle),
                "expected `{needle}` in `{message}`"
            )
        }
        other => panic!("expected a refusal containing `{needle}`, got {other:?}"),
    }
}

#[test]
fn receiver_refuses_bad_pushes() {
    run(Duration::from_secs(60), async {
        let pki = pki(&["decode"]);
        let m = model(2);
        let tokens = 200;
        let src = placement(layout(&m, "tp=2,block=16", tokens), 0, tokens, 1);
        let dst = placement(layout(&m, "tp=1,block=32", tokens), 0, tokens, 2);
        let plan = Plan::build(&src, &dst, tokens).unwrap();
        let decode: Endpoint = endpoint(TransportKind::Tcp, &pki, "decode", true).await;
        let addr = decode.local_addr().unwrap();
        let expect = |rid: u64| {
            decode
                .expect_push(SinkRegistration {
                    request_id: rid,
                    num_tokens: tokens,
                    placement: dst.clone(),
                    staging: dest_staging(&plan, &dst, None),
                    dst_ranks: None,
                    src: None,
                    plan: None,
                })
                .unwrap()
        };
        let stripe = |index, count| Stripe {
            index,
            count,
            chunk_bytes: 64 << 10,
        };

        // A sender that changes its declared stream count, then repeats a stripe.
        let sink = expect(1);
        let mut a = Raw::open(addr).await;
        a.send(&push(&src, &plan, 0, 0, stripe(0, 2), tokens)).await;
        assert!(matches!(a.recv().await, Some(Control::Ready { .. })));
        let mut b = Raw::open(addr).await;
        b.send(&push(&src, &plan, 0, 0, stripe(1, 3), tokens)).await;
        failed_with(b.recv().await, "changed its declared stream count");
        let e = sink.wait_timeout(Duration::from_secs(5)).await.unwrap_err();
        assert!(matches!(e, Error::Protocol(_)), "{e}");
        drop((a, b));

        let sink = expect(1);
        let mut a = Raw::open(addr).await;
        a.send(&push(&src, &plan, 0, 0, stripe(0, 2), tokens)).await;
        assert!(matches!(a.recv().await, Some(Control::Ready { .. })));
        let mut b = Raw::open(addr).await;
        b.send(&push(&src, &plan, 0, 0, stripe(0, 2), tokens)).await;
        failed_with(b.recv().await, "delivered twice");
        assert!(sink.wait_timeout(Duration::from_secs(5)).await.is_err());
        drop((a, b));

        // Over-delivery: a frame larger than the planned chunk.
        let sink = expect(1);
        let mut a = Raw::open(addr).await;
        a.send(&push(&src, &plan, 0, 0, stripe(0, 1), tokens)).await;
        assert!(matches!(a.recv().await, Some(Control::Ready { .. })));
        a.data(0, &vec![7u8; (64 << 10) + 1]).await;
        let e = sink.wait_timeout(Duration::from_secs(5)).await.unwrap_err();
        assert!(e.to_string().contains("over-delivery"), "{e}");
        assert!(
            a.recv().await.is_none(),
            "the lane is closed after a framing violation"
        );

        // A chunk at the wrong offset.
        let sink = expect(1);
        let mut a = Raw::open(addr).await;
        a.send(&push(&src, &plan, 0, 0, stripe(0, 1), tokens)).await;
        assert!(matches!(a.recv().await, Some(Control::Ready { .. })));
        a.data(4096, &vec![7u8; 64 << 10]).await;
        let e = sink.wait_timeout(Duration::from_secs(5)).await.unwrap_err();
        assert!(e.to_string().contains("stream offset"), "{e}");

        // An out-of-range block id, a plan that differs, a pair not hosted here.
        let sink = expect(1);
        let mut bad = src.clone();
        bad.block_ids[0][0] = 99_999;
        let mut a = Raw::open(addr).await;
        let mut m = push(&src, &plan, 0, 0, stripe(0, 1), tokens);
        if let Control::Push { src, .. } = &mut m {
            *src = bad;
        }
        a.send(&m).await;
        failed_with(a.recv().await, "block id 99999");
        // A refused stripe delivered nothing; the registration waits for a valid sender.
        assert!(sink.poll().is_none());
        sink.cancel();
        let sink = expect(2);
        let mut m = push(&src, &plan, 0, 0, stripe(0, 1), tokens);
        if let Control::Push {
            digest, request_id, ..
        } = &mut m
        {
            *digest ^= 1;
            *request_id = 2;
        }
        a.send(&m).await;
        failed_with(a.recv().await, "differs");
        assert!(sink.wait_timeout(Duration::from_secs(5)).await.is_err());
        let _sink = expect(3);
        let mut m = push(&src, &plan, 0, 0, stripe(0, 1), tokens);
        if let Control::Push {
            dst_rank,
            request_id,
            ..
        } = &mut m
        {
            *dst_rank = 5;
            *request_id = 3;
        }
        a.send(&m).await;
        failed_with(a.recv().await, "no bytes planned");
        // Finishing without delivering fails the request.
        a.send(&Control::PushFinish {
            request_id: 3,
            src_ranks: vec![0],
            src: src.clone(),
            num_tokens: tokens,
        })
        .await;
        failed_with(a.recv().await, "without delivering");
        assert_eq!(decode.stats().sink_registrations, 0);
        assert_eq!(decode.stats().transfers_completed, 0);
    });
}

/// What a peer declares cannot make the receiver allocate or loop without bound: a stripe count
/// of 2^32 - 1 (once allocated per stripe: an abort for lack of memory), more stripes than the
/// stream has chunks, and a first frame that announces megabytes before the peer said hello.
/// (Found in review of the receiver; the `endpoint_lane` fuzz target reproduces the stripe count
/// on the unfixed code in about 40 s: seed `fuzz/regressions/endpoint_lane/stripe-count-oom`,
/// an 8 GB allocation for 976,946,237 declared stripes.)
#[test]
fn receiver_bounds_what_a_peer_declares() {
    run(Duration::from_secs(60), async {
        let pki = pki(&["decode"]);
        let m = model(2);
        let tokens = 200;
        let src = placement(layout(&m, "tp=2,block=16", tokens), 0, tokens, 1);
        let dst = placement(layout(&m, "tp=1,block=32", tokens), 0, tokens, 2);
        let plan = Plan::build(&src, &dst, tokens).unwrap();
        let decode: Endpoint = endpoint(TransportKind::Tcp, &pki, "decode", true).await;
        let addr = decode.local_addr().unwrap();
        let expect = || {
            decode
                .expect_push(SinkRegistration {
                    request_id: 1,
                    num_tokens: tokens,
                    placement: dst.clone(),
                    staging: dest_staging(&plan, &dst, None),
                    dst_ranks: None,
                    src: None,
                    plan: None,
                })
                .unwrap()
        };
        let stripe = |index, count| Stripe {
            index,
            count,
            chunk_bytes: 64 << 10,
        };
        for (s, needle) in [
            (stripe(0, u32::MAX), "at most"),
            (stripe(u32::MAX - 1, u32::MAX), "at most"),
            (
                stripe(0, tpu_sync::wire::MAX_STRIPES),
                "stripes declared for a stream",
            ),
        ] {
            let sink = expect();
            let mut a = Raw::open(addr).await;
            a.send(&push(&src, &plan, 0, 0, s, tokens)).await;
            failed_with(a.recv().await, needle);
            let e = sink.wait_timeout(Duration::from_secs(5)).await.unwrap_err();
            assert!(matches!(e, Error::Protocol(_)), "{e}");
        }

        // Before its hello, a peer may not announce a large body (nor send data): the lane is
        // closed at once, without waiting for (or buffering) the announced bytes.
        for kind in [FrameKind::Control, FrameKind::Data] {
            let mut s = TcpStream::connect(addr).await.unwrap();
            let h = FrameHeader {
                kind,
                body_len: tpu_sync::wire::MAX_CONTROL_BODY,
                request_id: 0,
            };
            s.write_all(&h.encode()).await.unwrap();
            let mut b = [0u8; 1];
            let n = tokio::time::timeout(Duration::from_secs(2), s.read(&mut b))
                .await
                .expect("the lane is closed before the handshake timeout")
                .unwrap_or(0);
            assert_eq!(n, 0, "{kind:?}: nothing but a close");
        }

        // The receiver still works.
        let sink = expect();
        let mut a = Raw::open(addr).await;
        a.send(&push(&src, &plan, 0, 0, stripe(0, 1), tokens)).await;
        assert!(matches!(a.recv().await, Some(Control::Ready { .. })));
        sink.cancel();
    });
}

/// A flood of connections cannot exhaust the receiver: beyond `max_inbound_lanes` a lane is
/// closed as soon as it is accepted (counted in `lanes_refused`), the lanes already served keep
/// working, and once they close new lanes are served again.
#[test]
fn inbound_lanes_are_bounded() {
    run(Duration::from_secs(60), async {
        let pki = pki(&["decode"]);
        let mut o = opts(
            TransportKind::Tcp,
            security(TransportKind::Tcp, &pki, "decode"),
            "decode",
            true,
        );
        o.max_inbound_lanes = 2;
        let decode = Endpoint::bind(o).await.unwrap();
        let addr = decode.local_addr().unwrap();
        // Two lanes take both permits: one said hello, one is still silent.
        let mut served = Raw::open(addr).await;
        let silent = TcpStream::connect(addr).await.unwrap();
        eventually(Duration::from_secs(5), "two lanes open", || {
            decode.stats().lanes_open == 2
        })
        .await;
        // A third is closed at once, long before the handshake timeout.
        let mut third = TcpStream::connect(addr).await.unwrap();
        let mut b = [0u8; 1];
        let n = tokio::time::timeout(Duration::from_secs(2), third.read(&mut b))
            .await
            .expect("the refused lane is closed at once")
            .unwrap_or(0);
        assert_eq!(n, 0);
        assert_eq!(decode.stats().lanes_refused, 1);
        // The served lane still answers (an unknown request is refused, with a message).
        served
            .send(&Control::Describe {
                request_id: 0x5eed_0001,
                sink: false,
            })
            .await;
        failed_with(served.recv().await, "");
        // Freed permits serve new lanes.
        drop(silent);
        drop(served);
        eventually(Duration::from_secs(5), "lanes closed", || {
            decode.stats().lanes_open == 0
        })
        .await;
        let _again = Raw::open(addr).await;
        assert_eq!(decode.stats().lanes_refused, 1);
    });
}
