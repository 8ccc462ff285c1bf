//! The CLI's observability: `--log-format json` prints the transfer's spans (request, transfer,
//! plan, stage_d2h, network per pair and stripe, h2d, serve_pull, release) as JSON lines with the
//! request id, from two real processes; `tpu-sync top --once` reads a live metrics endpoint.

use std::process::{Command, Stdio};
use std::time::Duration;

mod port_util;

fn exe() -> &'static str {
    env!("CARGO_BIN_EXE_tpu-sync")
}

/// The JSON lines of a stderr (the PJRT plugin writes its own plain-text lines there too).
fn json_lines(text: &str) -> Vec<serde_json::Value> {
    text.lines()
        .filter(|l| l.starts_with('{'))
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect()
}

/// Closed spans of `name` (FmtSpan::CLOSE events).
fn closed<'a>(lines: &'a [serde_json::Value], name: &str) -> Vec<&'a serde_json::Value> {
    lines
        .iter()
        .filter(|l| l["fields"]["message"] == "close" && l["span"]["name"] == name)
        .collect()
}

#[test]
fn json_logs_carry_the_spans_of_a_transfer_with_the_request_id() {
    // The prefill process binds the port itself: a reserved one (see port_util), not a released
    // ephemeral one that another socket may take first.
    let reserved = port_util::reserve();
    let port = reserved.port;
    let common = ["--tokens", "256", "--layers", "2", "--request-id", "777"];
    let prefill = Command::new(exe())
        .args([
            "prefill",
            "--log-format",
            "json",
            "--port",
            &port.to_string(),
        ])
        .args(common)
        .env("RUST_LOG", "info")
        .env_remove("TPU_SYNC_METRICS_ADDR")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Wait for the listener.
    let t0 = std::time::Instant::now();
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            t0.elapsed() < Duration::from_secs(120),
            "prefill never listened"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let decode = Command::new(exe())
        .args(["decode", "--connect", &format!("127.0.0.1:{port}")])
        .args(common)
        .env("RUST_LOG", "info")
        .env("TPU_SYNC_LOG_FORMAT", "json")
        .env_remove("TPU_SYNC_METRICS_ADDR")
        .output()
        .unwrap();
    let p = prefill.wait_with_output().unwrap();
    assert!(
        decode.status.success(),
        "{}",
        String::from_utf8_lossy(&decode.stderr)
    );
    assert!(p.status.success(), "{}", String::from_utf8_lossy(&p.stderr));
    let d = json_lines(&String::from_utf8(decode.stderr).unwrap());
    let pl = json_lines(&String::from_utf8(p.stderr).unwrap());

    let tr = closed(&d, "transfer");
    assert_eq!(tr.len(), 1, "{d:#?}");
    assert_eq!(tr[0]["span"]["request_id"], 777);
    assert_eq!(tr[0]["span"]["kind"], "pull");
    assert_eq!(tr[0]["span"]["transport"], "tcp");
    assert!(tr[0]["fields"]["time.busy"].is_string());
    assert_eq!(closed(&d, "plan").len(), 1);
    let net = closed(&d, "network");
    assert!(!net.is_empty());
    assert!(net.iter().all(|l| l["span"]["request_id"] == 777));
    let h2d = closed(&d, "h2d");
    assert!(!h2d.is_empty());
    // Synchronous phases name their request through the enclosing spans.
    assert!(h2d
        .iter()
        .all(|l| l["spans"][0]["name"] == "request" && l["spans"][0]["request_id"] == 777));
    assert_eq!(closed(&d, "release").len(), 1);
    assert_eq!(closed(&d, "request").len(), 1);

    let stage = closed(&pl, "stage_d2h");
    assert!(!stage.is_empty(), "{pl:#?}");
    assert!(stage.iter().all(|l| l["spans"][0]["request_id"] == 777));
    let serve = closed(&pl, "serve_pull");
    assert_eq!(
        serve.len(),
        net.len(),
        "one served stripe per pulled stripe"
    );
    assert!(serve.iter().all(|l| l["span"]["request_id"] == 777));
}

#[test]
fn top_once_reports_a_live_endpoint() {
    use tpu_sync::store::{KvStore, Namespace, StoreConfig};
    let addr = tpu_sync::metrics::serve_global("127.0.0.1:0".parse().unwrap()).unwrap();
    let ns = Namespace::new("top-test");
    let mut cfg = StoreConfig::new(ns.clone(), 4096, 16 * 4096);
    cfg.memory.lock = false;
    cfg.memory.populate = false;
    let s = KvStore::open(cfg).unwrap();
    let keys = ns.chain_keys(&(0..64).collect::<Vec<u32>>(), 16);
    let blocks: Vec<Vec<u8>> = (0..4u64)
        .map(|i| {
            (0..4096u64)
                .map(|j| (tpu_sync::pattern::mix64(i * 4096 + j) as u8) | 1)
                .collect()
        })
        .collect();
    let refs: Vec<&[u8]> = blocks.iter().map(|b| b.as_slice()).collect();
    assert_eq!(s.put_from_host(None, &keys, &refs).unwrap().stored, 4);
    assert_eq!(s.lookup(&keys), 4);
    let out = Command::new(exe())
        .args([
            "top",
            "--once",
            "--interval",
            "0.2",
            "--url",
            &addr.to_string(),
        ])
        .output()
        .unwrap();
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains("dram 4/16 blocks ( 25.0%)"), "{text}");
    assert!(text.contains("hit rate 100.0%"), "{text}");
    assert!(text.contains("puts 4"), "{text}");
    // An endpoint that does not answer: exit code 1 and the error named.
    let out = Command::new(exe())
        .args(["top", "--once", "--interval", "0.1", "--url", "127.0.0.1:1"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stdout).contains("127.0.0.1:1"));
    drop(s);
}
