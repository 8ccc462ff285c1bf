//! Multi-host on one machine: two network namespaces joined by a veth pair (10.77.0.1/24 and
//! 10.77.0.2/24), `tpu-sync prefill` in one and `tpu-sync decode` in the other, over TCP, TLS and
//! QUIC, every byte verified. The namespaces (and with them the veth pair) are removed afterwards,
//! also when the test fails. Skipped, with a message, when not root or `ip netns` is unavailable.

use crate::common;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn ip(args: &[&str]) -> bool {
    Command::new("ip")
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .map(|s| s.success())
        .unwrap_or(false)
}

/// Two namespaces and a veth pair; deleted on drop.
struct Netns {
    a: String,
    b: String,
}

impl Netns {
    fn create() -> Result<Netns, String> {
        let id = format!(
            "{}{}",
            std::process::id(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.subsec_nanos() % 1000)
                .unwrap_or(0)
        );
        let n = Netns {
            a: format!("tsync-{id}-p"),
            b: format!("tsync-{id}-d"),
        };
        let (va, vb) = (
            format!("tsv{}a", &id[id.len().saturating_sub(8)..]),
            format!("tsv{}b", &id[id.len().saturating_sub(8)..]),
        );
        let steps: Vec<Vec<&str>> = vec![
            vec!["netns", "add", &n.a],
            vec!["netns", "add", &n.b],
            vec!["link", "add", &va, "type", "veth", "peer", "name", &vb],
            vec!["link", "set", &va, "netns", &n.a],
            vec!["link", "set", &vb, "netns", &n.b],
            vec!["-n", &n.a, "addr", "add", "10.77.0.1/24", "dev", &va],
            vec!["-n", &n.b, "addr", "add", "10.77.0.2/24", "dev", &vb],
            vec!["-n", &n.a, "link", "set", &va, "up"],
            vec!["-n", &n.b, "link", "set", &vb, "up"],
            vec!["-n", &n.a, "link", "set", "lo", "up"],
            vec!["-n", &n.b, "link", "set", "lo", "up"],
        ];
        for s in steps {
            if !ip(&s) {
                return Err(format!("`ip {}` failed", s.join(" ")));
            }
        }
        Ok(n)
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        // Deleting a namespace deletes the veth end inside it (and so the pair).
        ip(&["netns", "del", &self.a]);
        ip(&["netns", "del", &self.b]);
    }
}

/// Kills a child on drop (so no process keeps a namespace alive after a failure).
struct Kill(std::process::Child);
impl Drop for Kill {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn skip_reason() -> Option<String> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Some("not root".into());
    }
    if !ip(&["netns", "list"]) {
        return Some("`ip netns` is unavailable".into());
    }
    None
}

fn run_pair(ns: &Netns, transport: &str, creds: &[(&str, String, String)], ca: &str) {
    let exe = env!("CARGO_BIN_EXE_tpu-sync");
    let plugin = common::plugin_path();
    let common_args = [
        "--layers",
        "2",
        "--tokens",
        "300",
        "--transport",
        transport,
        "--timeout",
        "10",
    ];
    let tls = |side: usize| -> Vec<String> {
        if transport == "tcp" {
            return vec![];
        }
        vec![
            "--tls-cert".into(),
            creds[side].1.clone(),
            "--tls-key".into(),
            creds[side].2.clone(),
            "--tls-ca".into(),
            ca.into(),
        ]
    };
    let mut p = Kill(
        Command::new("ip")
            .args([
                "netns",
                "exec",
                &ns.a,
                exe,
                "prefill",
                "--listen",
                "10.77.0.1:0",
                "--serve-timeout",
                "60",
            ])
            .args(common_args)
            .args(tls(0))
            .env("TPU_SYNC_PJRT_PLUGIN", &plugin)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let mut lines = BufReader::new(p.0.stdout.take().unwrap()).lines();
    let t0 = Instant::now();
    let addr = loop {
        let l = lines
            .next()
            .unwrap_or_else(|| panic!("{transport}: prefill exited before listening"))
            .unwrap();
        if let Some(a) = l.strip_prefix("LISTENING ") {
            break a.to_string();
        }
        assert!(t0.elapsed() < Duration::from_secs(60));
    };
    assert!(addr.starts_with("10.77.0.1:"), "{addr}");
    let mut cmd = Command::new("ip");
    cmd.args(["netns", "exec", &ns.b, exe, "decode", "--connect", &addr])
        .args(common_args)
        .args(tls(1))
        .env("TPU_SYNC_PJRT_PLUGIN", &plugin);
    let o = common::run_with_limit(cmd, Duration::from_secs(120));
    let t = common::text(&o);
    assert!(o.status.success(), "{transport}: decode failed:\n{t}");
    let rep: serde_json::Value = serde_json::from_str(
        t.lines()
            .find_map(|l| l.strip_prefix("REPORT "))
            .expect("report"),
    )
    .unwrap();
    assert_eq!(rep["mismatches"], 0);
    assert_eq!(rep["verified_request_bytes"], 300 * 2 * 2 * 8 * 128 * 2);
    assert!(
        rep["transport"].as_str().unwrap().starts_with(transport),
        "{rep}"
    );
    eprintln!(
        "{transport}: {} bytes from {addr} (namespace {}) to namespace {} over {}, verified",
        rep["verified_request_bytes"], ns.a, ns.b, rep["transport"]
    );
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Some(s) = p.0.try_wait().unwrap() {
            assert!(s.success(), "{transport}: prefill exit {s}");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{transport}: prefill did not exit"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn prefill_and_decode_in_separate_network_namespaces() {
    if let Some(why) = skip_reason() {
        eprintln!("SKIPPED prefill_and_decode_in_separate_network_namespaces: {why}");
        return;
    }
    let ns = match Netns::create() {
        Ok(n) => n,
        Err(e) => {
            eprintln!("SKIPPED prefill_and_decode_in_separate_network_namespaces: {e}");
            return;
        }
    };
    // The two namespaces reach each other only through the veth pair.
    assert!(ip(&[
        "netns",
        "exec",
        &ns.b,
        "ip",
        "route",
        "get",
        "10.77.0.1"
    ]));
    let dir = std::env::temp_dir().join(format!("tpu-sync-netns-{}", std::process::id()));
    let pki = tpu_sync::net::tls::generate_test_pki(&dir, &["prefill", "decode"]).unwrap();
    let creds: Vec<(&str, String, String)> = ["prefill", "decode"]
        .iter()
        .map(|n| {
            let (c, k) = pki.files(n).unwrap();
            (*n, c.display().to_string(), k.display().to_string())
        })
        .collect();
    let ca = pki.ca.display().to_string();
    for transport in ["tcp", "tls", "quic"] {
        run_pair(&ns, transport, &creds, &ca);
    }
    let _ = std::fs::remove_dir_all(&dir);
    let a = ns.a.clone();
    drop(ns);
    let out = Command::new("ip").args(["netns", "list"]).output().unwrap();
    assert!(
        !String::from_utf8_lossy(&out.stdout).contains(&a),
        "namespace {a} left behind"
    );
}
