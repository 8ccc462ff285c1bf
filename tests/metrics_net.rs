//! Network metrics read back through the library's HTTP endpoint (`GET /metrics`) and parsed with
//! the `prometheus-parse` text parser: bytes sent and received, transfers started, completed and
//! failed by transport, direction and error kind (unknown request, checksum, cancelled, peer
//! closed), transfer durations, network checksum failures, peer connections and losses, and the
//! gauges of a transfer held mid-way (in flight, peers, leases, staged bytes). Metrics are
//! process-wide and the tests of this file run one at a time, each comparing two scrapes.

mod net_util;

use std::collections::HashMap;
use std::io::{Read, Write};
use std::sync::Mutex;
use std::time::Duration;

use net_util::*;
use tpu_sync::net::{Endpoint, EndpointOptions, SourceRegistration, TransportKind};

static SERIAL: Mutex<()> = Mutex::new(());

type Samples = HashMap<(String, Vec<(String, String)>), f64>;

fn server() -> std::net::SocketAddr {
    tpu_sync::metrics::serve_global("127.0.0.1:0".parse().unwrap()).unwrap()
}

/// `GET /metrics` (HTTP/1.0, one connection), parsed by `prometheus-parse`.
fn scrape() -> Samples {
    let mut s = std::net::TcpStream::connect(server()).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.write_all(b"GET /metrics HTTP/1.0\r\nHost: test\r\n\r\n")
        .unwrap();
    let mut body = String::new();
    s.read_to_string(&mut body).unwrap();
    let (head, text) = body.split_once("\r\n\r\n").unwrap();
    assert!(
        head.starts_with("HTTP/1.0 200") || head.starts_with("HTTP/1.1 200"),
        "{head}"
    );
    assert!(head.contains("text/plain; version=0.0.4"), "{head}");
    let lines = text.lines().map(|l| Ok(l.to_string()));
    let parsed = prometheus_parse::Scrape::parse(lines).unwrap();
    let mut out = Samples::new();
    for s in parsed.samples {
        let mut labels: Vec<(String, String)> = s
            .labels
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        labels.sort();
        let v = match s.value {
            prometheus_parse::Value::Counter(v)
            | prometheus_parse::Value::Gauge(v)
            | prometheus_parse::Value::Untyped(v) => v,
            _ => continue,
        };
        out.insert((s.metric, labels), v);
    }
    // Histograms: prometheus-parse folds buckets into one value; take `_count` and `_sum` from
    // the text itself through the same parser's lines.
    for l in text.lines().filter(|l| !l.starts_with('#')) {
        if let Some((name_labels, val)) = l.rsplit_once(' ') {
            if name_labels.contains("_seconds_count") || name_labels.contains("_seconds_sum") {
                let (name, rest) = name_labels.split_once('{').unwrap_or((name_labels, ""));
                let mut labels: Vec<(String, String)> = rest
                    .trim_end_matches('}')
                    .split(',')
                    .filter(|p| !p.is_empty())
                    .map(|p| {
                        let (k, v) = p.split_once('=').unwrap();
                        (k.to_string(), v.trim_matches('"').to_string())
                    })
                    .collect();
                labels.sort();
                out.insert((name.to_string(), labels), val.parse().unwrap());
            }
        }
    }
    out
}

fn get(m: &Samples, name: &str, labels: &[(&str, &str)]) -> f64 {
    let mut l: Vec<(String, String)> = labels
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    l.sort();
    m.get(&(name.to_string(), l)).copied().unwrap_or(0.0)
}

fn d(a: &Samples, b: &Samples, name: &str, labels: &[(&str, &str)]) -> f64 {
    get(b, name, labels) - get(a, name, labels)
}

fn o(kind: TransportKind, pki: &Pki, name: &str, listen: bool) -> EndpointOptions {
    opts(kind, security(kind, pki, name), name, listen)
}

#[test]
fn transfers_bytes_and_peers_per_transport() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    run(Duration::from_secs(120), async {
        let pki = pki(&["prefill", "decode"]);
        let f = reshard_fixture(4, 400, 3);
        for kind in KINDS {
            let t = kind.name();
            let b0 = scrape();
            let prefill = Endpoint::bind(o(kind, &pki, "prefill", true))
                .await
                .unwrap();
            let addr = prefill.local_addr().unwrap().to_string();
            let decode = Endpoint::bind(o(kind, &pki, "decode", false))
                .await
                .unwrap();
            register_whole(&prefill, &f.src, f.tokens, 1);
            let st = dest_staging(&f.plan, &f.dst, None);
            let x = pull_fx(&decode, &f, 1, &addr, st.clone());
            let stats = x.wait().await.unwrap();
            let bytes = verify_dest(&f.dst, f.tokens, &st, None);
            assert!(bytes > 0);
            decode.release(&addr, 1).await.unwrap();
            let b1 = scrape();
            let (send, recv) = (
                [("transport", t), ("direction", "send")],
                [("transport", t), ("direction", "receive")],
            );
            assert_eq!(
                d(&b0, &b1, "tpu_sync_net_bytes_total", &recv),
                stats.bytes as f64,
                "{t}"
            );
            assert_eq!(
                d(&b0, &b1, "tpu_sync_net_bytes_total", &send),
                stats.bytes as f64,
                "{t}"
            );
            assert_eq!(stats.bytes, bytes, "{t}");
            assert_eq!(
                d(&b0, &b1, "tpu_sync_transfers_started_total", &recv),
                1.0,
                "{t}"
            );
            assert_eq!(
                d(&b0, &b1, "tpu_sync_transfers_completed_total", &recv),
                1.0,
                "{t}"
            );
            assert_eq!(
                d(&b0, &b1, "tpu_sync_transfer_seconds_count", &recv),
                1.0,
                "{t}"
            );
            assert!(
                d(&b0, &b1, "tpu_sync_transfer_seconds_sum", &recv) > 0.0,
                "{t}"
            );
            // A client-side peer on the decode side and a session on the prefill side.
            assert_eq!(
                d(&b0, &b1, "tpu_sync_peer_connections_total", &[]),
                2.0,
                "{t}"
            );
            assert_eq!(get(&b1, "tpu_sync_peers", &[]), 2.0, "{t}");
            assert_eq!(get(&b1, "tpu_sync_transfers_in_flight", &[]), 0.0, "{t}");
            // One side goes: the other declares it lost.
            drop(decode);
            eventually(Duration::from_secs(20), "peer lost", || {
                d(&b1, &scrape(), "tpu_sync_peers_lost_total", &[]) >= 1.0
            })
            .await;
            prefill.shutdown(None).await;
        }
    });
}

#[test]
fn failures_by_kind_and_gauges_mid_transfer() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    run(Duration::from_secs(120), async {
        let pki = pki(&["prefill", "decode", "bad"]);
        let f = reshard_fixture(4, 400, 5);
        let kind = TransportKind::Tcp;
        fn failed(kind_label: &str) -> [(&str, &str); 3] {
            [
                ("transport", "tcp"),
                ("direction", "receive"),
                ("kind", kind_label),
            ]
        }
        let prefill = Endpoint::bind(o(kind, &pki, "prefill", true))
            .await
            .unwrap();
        let addr = prefill.local_addr().unwrap().to_string();
        let decode = Endpoint::bind(o(kind, &pki, "decode", false))
            .await
            .unwrap();

        // Unknown request.
        let b0 = scrape();
        let st = dest_staging(&f.plan, &f.dst, None);
        let e = pull_fx(&decode, &f, 77, &addr, st)
            .wait()
            .await
            .unwrap_err();
        // Today's endpoint reports the producer's refusal as `remote` (the wire carries the
        // message); the label is whatever kind the error has.
        assert!(
            matches!(
                e.kind(),
                tpu_sync::ErrorKind::UnknownRequest | tpu_sync::ErrorKind::Remote
            ),
            "{e}"
        );
        let b1 = scrape();
        assert_eq!(
            d(
                &b0,
                &b1,
                "tpu_sync_transfers_failed_total",
                &failed(e.kind().as_str())
            ),
            1.0
        );
        assert_eq!(
            d(
                &b0,
                &b1,
                "tpu_sync_transfers_completed_total",
                &[("transport", "tcp"), ("direction", "receive")]
            ),
            0.0
        );

        // Held mid-way (layer 1 of 4 published): the gauges, then a cancel.
        let staging = source_staging(&f.src, f.tokens, None);
        let staged = staging.total_bytes() as f64;
        let _h = prefill
            .register_source(SourceRegistration {
                request_id: 2,
                num_tokens: f.tokens,
                placement: f.src.clone(),
                staging,
                layers_ready: Some(1),
                expected_releases: 1,
            })
            .unwrap();
        let st = dest_staging(&f.plan, &f.dst, None);
        let x = pull_fx(&decode, &f, 2, &addr, st.clone());
        x.wait_layers(1).await.unwrap();
        let mid = scrape();
        assert_eq!(get(&mid, "tpu_sync_transfers_in_flight", &[]), 1.0);
        assert_eq!(get(&mid, "tpu_sync_leases", &[]), 1.0);
        assert_eq!(get(&mid, "tpu_sync_peers", &[]), 2.0);
        assert!(get(&mid, "tpu_sync_staged_bytes", &[]) >= staged + st.total_bytes() as f64);
        x.cancel();
        let e = x.wait_timeout(Duration::from_secs(5)).await.unwrap_err();
        assert_eq!(e.kind(), tpu_sync::ErrorKind::Cancelled, "{e}");
        let b2 = scrape();
        assert_eq!(
            d(
                &b1,
                &b2,
                "tpu_sync_transfers_failed_total",
                &failed("cancelled")
            ),
            1.0
        );
        assert_eq!(get(&b2, "tpu_sync_transfers_in_flight", &[]), 0.0);
        decode.release(&addr, 2).await.unwrap();

        // A corrupt chunk: a checksum failure.
        let mut po = o(kind, &pki, "bad", true);
        po.faults.corrupt_at_offset = Some(70_000);
        let bad = Endpoint::bind(po).await.unwrap();
        let bad_addr = bad.local_addr().unwrap().to_string();
        register_whole(&bad, &f.src, f.tokens, 3);
        let st = dest_staging(&f.plan, &f.dst, None);
        let e = pull_fx(&decode, &f, 3, &bad_addr, st)
            .wait()
            .await
            .unwrap_err();
        assert_eq!(e.kind(), tpu_sync::ErrorKind::Checksum, "{e}");
        let b3 = scrape();
        assert_eq!(
            d(
                &b2,
                &b3,
                "tpu_sync_transfers_failed_total",
                &failed("checksum")
            ),
            1.0
        );
        assert_eq!(
            d(
                &b2,
                &b3,
                "tpu_sync_checksum_failures_total",
                &[("source", "network")]
            ),
            1.0
        );
        bad.shutdown(None).await;

        // The producer dies mid-transfer: peer closed.
        let mut po = o(kind, &pki, "bad", true);
        po.faults.close_after_bytes = Some(100_000);
        let bad = Endpoint::bind(po).await.unwrap();
        let bad_addr = bad.local_addr().unwrap().to_string();
        register_whole(&bad, &f.src, f.tokens, 4);
        let st = dest_staging(&f.plan, &f.dst, None);
        let e = pull_fx(&decode, &f, 4, &bad_addr, st)
            .wait()
            .await
            .unwrap_err();
        let b4 = scrape();
        assert_eq!(
            d(
                &b3,
                &b4,
                "tpu_sync_transfers_failed_total",
                &failed(e.kind().as_str())
            ),
            1.0,
            "{e}"
        );
        assert!(
            matches!(
                e.kind(),
                tpu_sync::ErrorKind::PeerClosed
                    | tpu_sync::ErrorKind::Protocol
                    | tpu_sync::ErrorKind::Io
            ),
            "{e}"
        );
        bad.shutdown(None).await;
        prefill.shutdown(None).await;
    });
}
