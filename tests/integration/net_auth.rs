//! Authentication: with TLS or QUIC configured, a peer without valid credentials (wrong CA, no
//! client certificate, wrong pre-shared key, plain TCP) is refused in the handshake and can
//! neither read nor write a single block; the same operations succeed with valid credentials.

use crate::net_util;

use std::sync::Arc;
use std::time::Duration;

use net_util::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tpu_sync::net::{Endpoint, PeerMap, PullRequest, Security, TransportKind};
use tpu_sync::plan::{Placement, Plan};
use tpu_sync::wire::{Control, LaneRole, PROTOCOL_VERSION};

struct Fixture {
    src: Placement,
    dst: Placement,
    tokens: u32,
    plan: Plan,
}

fn fixture() -> Fixture {
    let m = model(2);
    let tokens = 120;
    let src = placement(layout(&m, "tp=2,block=16", tokens), 0, tokens, 1);
    let dst = placement(layout(&m, "tp=1,block=32", tokens), 0, tokens, 2);
    let plan = Plan::build(&src, &dst, tokens).unwrap();
    Fixture {
        src,
        dst,
        tokens,
        plan,
    }
}

/// A server endpoint with one pull source (request 1) and one push sink (request 2).
async fn server(
    kind: TransportKind,
    sec: Security,
    f: &Fixture,
) -> (
    Endpoint,
    Arc<tpu_sync::staging::Staging>,
    tpu_sync::net::Transfer,
) {
    let ep = Endpoint::bind(opts(kind, sec, "server", true))
        .await
        .unwrap();
    register_whole(&ep, &f.src, f.tokens, 1);
    let sink_st = dest_staging(&f.plan, &f.dst, None);
    let sink = ep
        .expect_push(sink_whole(&f.dst, f.tokens, 2, sink_st.clone(), None))
        .unwrap();
    (ep, sink_st, sink)
}

/// Tries to read (pull request 1) and write (push request 2) as `client`; returns whether each
/// succeeded, checking that a refused pull delivered nothing.
async fn attempt(client: &Endpoint, addr: &str, f: &Fixture) -> (bool, bool) {
    let dst_st = dest_staging(&f.plan, &f.dst, None);
    let pulled = match client.pull(PullRequest {
        request_id: 1,
        num_tokens: f.tokens,
        src: f.src.clone(),
        sources: PeerMap::single(addr),
        dst: f.dst.clone(),
        staging: dst_st.clone(),
        dst_ranks: None,
        plan: None,
        wait_for_registration: None,
    }) {
        Ok(t) => t.wait_timeout(Duration::from_secs(20)).await.is_ok(),
        Err(_) => false,
    };
    if pulled {
        verify_dest(&f.dst, f.tokens, &dst_st, None);
    } else {
        assert!(!any_nonzero(&dst_st), "a refused pull delivered bytes");
    }
    let pushed = match client.push(push_whole(
        &f.src,
        &f.dst,
        f.tokens,
        2,
        None,
        PeerMap::single(addr),
    )) {
        Ok(t) => t.wait_timeout(Duration::from_secs(20)).await.is_ok(),
        Err(_) => false,
    };
    (pulled, pushed)
}

fn assert_untouched(
    server: &Endpoint,
    sink_st: &tpu_sync::staging::Staging,
    sink: &tpu_sync::net::Transfer,
) {
    let s = server.stats();
    assert_eq!(s.bytes_sent, 0, "a block was read: {s:?}");
    assert_eq!(s.bytes_received, 0, "a block was written: {s:?}");
    assert_eq!(s.source_registrations, 1);
    assert_eq!(s.leases, 0, "an unauthenticated peer took a lease");
    assert!(sink.poll().is_none(), "the push registration was touched");
    assert!(
        !any_nonzero(sink_st),
        "bytes landed in the push registration"
    );
}

#[test]
fn wrong_ca_wrong_psk_and_plain_tcp_are_refused() {
    run(Duration::from_secs(180), async {
        let f = fixture();
        let good = pki(&["server", "client"]);
        let evil = pki(&["server", "client"]);
        let psk_a = Security::from_psk(b"0123456789abcdef0123456789abcdef").unwrap();
        let psk_b = Security::from_psk(b"0123456789abcdef0123456789abcdeX").unwrap();
        assert!(Security::from_psk(b"short").is_err());
        for kind in [TransportKind::Tls, TransportKind::Quic] {
            // CA mode.
            let (srv, sink_st, sink) = server(kind, good.pki.security("server").unwrap(), &f).await;
            let addr = srv.local_addr().unwrap().to_string();
            for (what, sec) in [
                (
                    "certificate of another CA",
                    evil.pki.security("client").unwrap(),
                ),
                ("pre-shared key against a CA server", psk_a.clone()),
            ] {
                let c = Endpoint::bind(opts(kind, sec, "client", false))
                    .await
                    .unwrap();
                assert_eq!(
                    attempt(&c, &addr, &f).await,
                    (false, false),
                    "{kind}: {what}"
                );
                c.shutdown(None).await;
            }
            assert!(
                srv.stats().handshake_failures >= 2,
                "{kind}: {:?}",
                srv.stats()
            );
            assert_untouched(&srv, &sink_st, &sink);
            if kind == TransportKind::Tls {
                // Plain TCP to a TLS listener.
                let c = Endpoint::bind(opts(TransportKind::Tcp, Security::None, "client", false))
                    .await
                    .unwrap();
                assert_eq!(attempt(&c, &addr, &f).await, (false, false), "plain TCP");
                assert_untouched(&srv, &sink_st, &sink);
            }
            // The client also checks the server: a server of another CA is refused.
            let (rogue, _rs, _rk) = server(kind, evil.pki.security("server").unwrap(), &f).await;
            let c = Endpoint::bind(opts(
                kind,
                good.pki.security("client").unwrap(),
                "client",
                false,
            ))
            .await
            .unwrap();
            let raddr = rogue.local_addr().unwrap().to_string();
            assert_eq!(
                attempt(&c, &raddr, &f).await,
                (false, false),
                "{kind}: rogue server"
            );
            // Positive control: valid credentials read and write.
            assert_eq!(
                attempt(&c, &addr, &f).await,
                (true, true),
                "{kind}: valid certificate"
            );
            sink.wait_timeout(Duration::from_secs(5)).await.unwrap();
            verify_dest(&f.dst, f.tokens, &sink_st, None);
            srv.shutdown(None).await;

            // PSK mode.
            let (srv, sink_st, sink) = server(kind, psk_a.clone(), &f).await;
            let addr = srv.local_addr().unwrap().to_string();
            let c = Endpoint::bind(opts(kind, psk_b.clone(), "client", false))
                .await
                .unwrap();
            assert_eq!(
                attempt(&c, &addr, &f).await,
                (false, false),
                "{kind}: wrong PSK"
            );
            let c = Endpoint::bind(opts(
                kind,
                good.pki.security("client").unwrap(),
                "client",
                false,
            ))
            .await
            .unwrap();
            assert_eq!(
                attempt(&c, &addr, &f).await,
                (false, false),
                "{kind}: cert vs PSK server"
            );
            assert_untouched(&srv, &sink_st, &sink);
            let c = Endpoint::bind(opts(kind, psk_a.clone(), "client", false))
                .await
                .unwrap();
            assert_eq!(
                attempt(&c, &addr, &f).await,
                (true, true),
                "{kind}: right PSK"
            );
            sink.wait_timeout(Duration::from_secs(5)).await.unwrap();
        }
    });
}

/// A TLS client that trusts the right CA but presents no certificate: the server refuses it and
/// answers no frame.
#[test]
fn tls_and_quic_without_client_certificate_are_refused() {
    run(Duration::from_secs(60), async {
        let f = fixture();
        let good = pki(&["server", "client"]);
        let mut roots = rustls::RootCertStore::empty();
        let ca = std::fs::read(&good.pki.ca).unwrap();
        for c in rustls::pki_types::pem::PemObject::pem_slice_iter(&ca) {
            let c: rustls::pki_types::CertificateDer<'static> = c.unwrap();
            roots.add(c).unwrap();
        }
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut cfg = rustls::ClientConfig::builder_with_provider(provider)
            .with_protocol_versions(&[&rustls::version::TLS13])
            .unwrap()
            .with_root_certificates(roots)
            .with_no_client_auth();
        cfg.alpn_protocols = vec![tpu_sync::net::tls::ALPN.to_vec()];
        let cfg = Arc::new(cfg);
        let hello = Control::Hello {
            name: "intruder".into(),
            protocol: PROTOCOL_VERSION,
            incarnation: 1,
            role: LaneRole::Data,
            unhashed_aead: false,
        }
        .to_frame(0)
        .unwrap();
        let describe = Control::Describe {
            request_id: 1,
            sink: false,
        }
        .to_frame(1)
        .unwrap();

        // TLS over TCP.
        let (srv, sink_st, sink) =
            server(TransportKind::Tls, good.pki.security("server").unwrap(), &f).await;
        let addr = srv.local_addr().unwrap();
        let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
        let conn = tokio_rustls::TlsConnector::from(cfg.clone());
        let name = rustls::pki_types::ServerName::try_from("tpu-sync").unwrap();
        let mut got = Vec::new();
        if let Ok(mut s) = conn.connect(name, tcp).await {
            let _ = s.write_all(&hello).await;
            let _ = s.write_all(&describe).await;
            let _ = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut got)).await;
        }
        assert!(
            got.is_empty(),
            "the server answered an unauthenticated client: {got:?}"
        );
        assert_untouched(&srv, &sink_st, &sink);
        srv.shutdown(None).await;

        // QUIC.
        let (srv, sink_st, sink) = server(
            TransportKind::Quic,
            good.pki.security("server").unwrap(),
            &f,
        )
        .await;
        let addr = srv.local_addr().unwrap();
        let qc = quinn::crypto::rustls::QuicClientConfig::try_from(cfg).unwrap();
        let mut ep = quinn::Endpoint::client("127.0.0.1:0".parse().unwrap()).unwrap();
        ep.set_default_client_config(quinn::ClientConfig::new(Arc::new(qc)));
        let mut got = Vec::new();
        if let Ok(Ok(c)) = tokio::time::timeout(
            Duration::from_secs(5),
            ep.connect(addr, "tpu-sync").unwrap(),
        )
        .await
        {
            if let Ok((mut tx, mut rx)) = c.open_bi().await {
                let _ = tx.write_all(&hello).await;
                let _ = tx.write_all(&describe).await;
                let _ = tokio::time::timeout(Duration::from_secs(5), async {
                    let mut b = [0u8; 4096];
                    while let Ok(Some(n)) = rx.read(&mut b).await {
                        got.extend_from_slice(&b[..n]);
                    }
                })
                .await;
            }
        }
        assert!(
            got.is_empty(),
            "the QUIC server answered an unauthenticated client"
        );
        assert_untouched(&srv, &sink_st, &sink);
        assert!(srv.stats().handshake_failures >= 1 || srv.stats().sessions == 0);
        ep.close(0u32.into(), b"");
    });
}

#[test]
fn credentials_are_checked_at_configuration() {
    run(Duration::from_secs(20), async {
        let good = pki(&["a"]);
        // TLS/QUIC without credentials, TCP with credentials: clear errors.
        for kind in [TransportKind::Tls, TransportKind::Quic] {
            let e = Endpoint::bind(opts(kind, Security::None, "x", true))
                .await
                .unwrap_err();
            assert!(e.to_string().contains("need credentials"), "{e}");
        }
        let e = Endpoint::bind(opts(
            TransportKind::Tcp,
            good.pki.security("a").unwrap(),
            "x",
            true,
        ))
        .await
        .unwrap_err();
        assert!(
            e.to_string().contains("plain TCP cannot authenticate"),
            "{e}"
        );
        let (c, k) = good.pki.files("a").unwrap();
        assert!(
            Security::from_pem_files(k, k, &good.pki.ca, None).is_err(),
            "key as certificate"
        );
        assert!(
            Security::from_pem_files(c, c, &good.pki.ca, None).is_err(),
            "certificate as key"
        );
        assert!(
            Security::from_pem_files(c, k, std::path::Path::new("/nonexistent"), None).is_err()
        );
    });
}
