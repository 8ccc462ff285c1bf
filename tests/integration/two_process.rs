//! The main job as a user runs it: `tpu-sync demo` (prefill and decode as two OS processes, each
//! with its own PJRT client, connected over loopback TCP) for several layout pairs, and the bad
//! inputs that must end in a clear error and a non-zero exit within a bounded time.

use crate::common;
use crate::port_util;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::Duration;

use common::{text, tpu_sync};

const LIMIT: Duration = Duration::from_secs(120);

/// A started `tpu-sync prefill` (stdout piped, stderr dropped), its listening address, and the
/// rest of its stdout.
struct Prefill {
    child: std::process::Child,
    addr: String,
    lines: std::io::Lines<BufReader<std::process::ChildStdout>>,
}

/// Starts `tpu-sync prefill ARGS...` and waits for its `LISTENING` line.
fn spawn_prefill<S: AsRef<std::ffi::OsStr>>(args: &[S]) -> Prefill {
    let mut child = Command::new(env!("CARGO_BIN_EXE_tpu-sync"))
        .arg("prefill")
        .args(args)
        .env("TPU_SYNC_PJRT_PLUGIN", common::plugin_path())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let addr = loop {
        let l = lines.next().expect("prefill output").unwrap();
        if let Some(a) = l.strip_prefix("LISTENING ") {
            break a.to_string();
        }
    };
    Prefill { child, addr, lines }
}

fn demo(extra: &[&str]) -> String {
    let mut args = vec!["demo", "--layers", "2"];
    if !extra.contains(&"--tokens") {
        args.extend_from_slice(&["--tokens", "333"]);
    }
    args.extend_from_slice(extra);
    let o = tpu_sync(&args, LIMIT);
    let t = text(&o);
    assert!(o.status.success(), "demo {extra:?} failed:\n{t}");
    let v = t
        .lines()
        .find(|l| l.starts_with("verified:"))
        .unwrap_or_else(|| panic!("no verified line:\n{t}"));
    assert!(!t.contains("panicked"), "{t}");
    v.to_string()
}

/// Bytes named on the `verified:` line.
fn verified_bytes(line: &str) -> u64 {
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

#[test]
fn default_layouts_tp2_pcp2_to_tp1_dp2() {
    let v = demo(&[]);
    // 333 tokens x 2 layers x 2 planes x 8 heads x 128 dims x 2 bytes.
    assert_eq!(verified_bytes(&v), 333 * 2 * 2 * 8 * 128 * 2);
    assert!(v.contains("TP=2 x PCP=2") && v.contains("DP rank 1"), "{v}");
}

#[test]
fn tp4_to_tp1() {
    let v = demo(&[
        "--prefill",
        "tp=4,block=16,order=nhd",
        "--decode",
        "tp=1,block=16,order=nhd",
    ]);
    assert_eq!(verified_bytes(&v), 333 * 2 * 2 * 8 * 128 * 2);
}

#[test]
fn pcp4_to_pcp1_with_partial_last_block() {
    let v = demo(&[
        "--prefill",
        "pcp=4,block=32",
        "--decode",
        "block=32,order=hnd",
        "--tokens",
        "1000",
    ]);
    assert_eq!(verified_bytes(&v), 1000 * 2 * 2 * 8 * 128 * 2);
}

#[test]
fn different_block_sizes_and_hnd_to_nhd_with_tp_split() {
    let v = demo(&[
        "--prefill",
        "tp=1,block=48,order=hnd",
        "--decode",
        "tp=2,block=20,order=nhd",
    ]);
    assert_eq!(verified_bytes(&v), 333 * 2 * 2 * 8 * 128 * 2);
}

#[test]
fn mla_replicated_latent() {
    let v = demo(&[
        "--preset",
        "deepseek-v3",
        "--prefill",
        "tp=2,block=64",
        "--decode",
        "tp=1,dp=2,block=16,order=hnd",
    ]);
    // One 576-wide latent plane per token and layer.
    assert_eq!(verified_bytes(&v), 333 * 2 * 576 * 2);
}

#[test]
fn kv_heads_replicated_over_tp16_to_tp2_pcp2() {
    let v = demo(&[
        "--prefill",
        "tp=16,block=16",
        "--decode",
        "tp=2,pcp=2,block=64,order=hnd",
    ]);
    assert_eq!(verified_bytes(&v), 333 * 2 * 2 * 8 * 128 * 2);
}

fn fails(args: &[&str], needle: &str) {
    let o = tpu_sync(args, LIMIT);
    let t = text(&o);
    assert!(!o.status.success(), "{args:?} should fail:\n{t}");
    assert!(t.contains(needle), "{args:?}: expected `{needle}` in:\n{t}");
    assert!(
        !t.contains("panicked") && !t.contains("RUST_BACKTRACE"),
        "{args:?} panicked:\n{t}"
    );
    // Human messages: no Rust Debug output.
    assert!(
        !t.contains("Some(") && !t.contains("ExitStatus("),
        "{args:?}: Debug output in:\n{t}"
    );
}

#[test]
fn bad_inputs_are_clear_errors() {
    fails(
        &["demo", "--plugin", "/nonexistent/pjrt.so", "--layers", "1"],
        "cannot load PJRT plugin",
    );
    fails(
        &["demo", "--plugin", "/nonexistent/pjrt.so", "--layers", "1"],
        "prefill process exited with status 2 before listening",
    );
    fails(
        &["info", "--plugin", "/etc/hostname"],
        "cannot load PJRT plugin",
    );
    fails(&["demo", "--prefill", "tp=3"], "cannot be split over TP=3");
    fails(
        &["demo", "--decode", "tp=2,order=xyz"],
        "unknown block order `xyz` (known: nhd, hnd, lbhnc",
    );
    fails(&["demo", "--preset", "gpt-5"], "unknown model preset");
    // Staging past the budget is refused before anything is copied.
    fails(
        &[
            "demo",
            "--layers",
            "1",
            "--tokens",
            "64",
            "--staging-budget",
            "4096",
        ],
        "staging exhausted",
    );
    fails(&["demo", "--transport", "carrier-pigeon"], "not available");
    // Checked in the parent, before any child starts (so no prefill output).
    for (args, needle) in [
        (
            &["demo", "--decode-dp-rank", "5"][..],
            "--decode-dp-rank 5: the decode layout",
        ),
        (&["demo", "--streams", "0"][..], "--streams 0: must be 1 to"),
        (&["demo", "--chunk-bytes", "0"][..], "--chunk-bytes 0"),
        (&["demo", "--request-id", "0"][..], "--request-id 0"),
        // A zero layout field is an error, never a division by zero (it used to panic in
        // ParallelLayout::request_blocks).
        (
            &[
                "demo",
                "--prefill",
                "tp=2,block=0",
                "--decode",
                "tp=1,dp=2,block=16",
            ][..],
            "block (0)",
        ),
        (&["demo", "--decode", "tp=1,pcp=0"][..], "pcp (0)"),
        (&["demo", "--prefill", "tp=0"][..], "tp (0)"),
        (&["demo", "--staging-budget", "x"][..], "--staging-budget"),
        // A size the machine cannot hold is refused before anything is allocated (it used to
        // end with the prefill child killed by SIGABRT on a failed allocation).
        (
            &["demo", "--tokens", "4000000000", "--layers", "1"][..],
            "host memory: --tokens 4000000000 --layers 1",
        ),
        (
            &["prefill", "--tokens", "400000", "--layers", "32"][..],
            "this process can allocate at most",
        ),
        (
            &[
                "decode",
                "--connect",
                "127.0.0.1:1",
                "--decode-dp-rank",
                "2",
            ][..],
            "--decode-dp-rank 2",
        ),
    ] {
        let o = tpu_sync(args, LIMIT);
        let t = text(&o);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {t}");
        assert!(t.contains(needle), "{args:?}: expected `{needle}` in:\n{t}");
        assert!(!t.contains("LISTENING") && !t.contains("prefill:"), "{t}");
    }
}

#[test]
fn absent_peer_times_out() {
    // A port with nothing listening: connect fails fast (refused) or within the timeout.
    // A reserved port (port_util): nothing else binds it while it is held.
    let hole = port_util::reserve();
    let addr = hole.addr();
    let t0 = std::time::Instant::now();
    fails(
        &[
            "decode",
            "--connect",
            &addr,
            "--timeout",
            "3",
            "--layers",
            "1",
        ],
        "connect",
    );
    assert!(t0.elapsed() < Duration::from_secs(20));
}

#[test]
fn peer_closing_mid_transfer_fails_the_decode() {
    let t0 = std::time::Instant::now();
    fails(
        &[
            "demo",
            "--layers",
            "2",
            "--tokens",
            "512",
            "--timeout",
            "5",
            "--fault-close-after",
            "100000",
        ],
        "peer closed",
    );
    assert!(t0.elapsed() < Duration::from_secs(60));
}

#[test]
fn out_of_range_block_id_is_refused_and_prefill_released() {
    let Prefill {
        child: mut p,
        addr,
        lines: _lines,
    } = spawn_prefill(&[
        "--layers",
        "1",
        "--tokens",
        "100",
        "--listen",
        "127.0.0.1:0",
        "--serve-timeout",
        "60",
    ]);
    fails(
        &[
            "decode",
            "--connect",
            &addr,
            "--layers",
            "1",
            "--fault-block-id",
            "99999",
        ],
        "block id 99999",
    );
    // The failed decode released the request, so the prefill exits well before its 60 s timeout.
    let t0 = std::time::Instant::now();
    loop {
        if let Some(s) = p.try_wait().unwrap() {
            assert!(s.success());
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "prefill did not exit after release"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn info_reports_capabilities() {
    let o = tpu_sync(&["info"], LIMIT);
    let t = text(&o);
    assert!(o.status.success(), "{t}");
    for needle in [
        "PJRT API version:  0.",
        "platform:          cpu",
        "pinned_host",
        "D2H path:",
        "in-place H2D:",
        "DMA map:",
    ] {
        assert!(t.contains(needle), "missing `{needle}` in:\n{t}");
    }
}

#[test]
fn prefill_and_decode_as_separate_commands() {
    let Prefill {
        child: mut p,
        addr,
        lines: _lines,
    } = spawn_prefill(&[
        "--layers",
        "3",
        "--tokens",
        "200",
        "--listen",
        "127.0.0.1:0",
    ]);
    let o = tpu_sync(&["decode", "--connect", &addr, "--layers", "3"], LIMIT);
    let t = text(&o);
    assert!(o.status.success(), "{t}");
    let rep: serde_json::Value = serde_json::from_str(
        t.lines()
            .find_map(|l| l.strip_prefix("REPORT "))
            .expect("report"),
    )
    .unwrap();
    assert_eq!(rep["mismatches"], 0);
    assert_eq!(rep["verified_request_bytes"], 200 * 3 * 2 * 8 * 128 * 2);
    assert!(p.wait().unwrap().success());
}

#[test]
fn decode_tokens_given_must_match_the_prefill() {
    let Prefill {
        child: mut p,
        addr,
        lines: _lines,
    } = spawn_prefill(&[
        "--layers",
        "1",
        "--tokens",
        "200",
        "--listen",
        "127.0.0.1:0",
    ]);
    fails(
        &[
            "decode",
            "--connect",
            &addr,
            "--layers",
            "1",
            "--tokens",
            "300",
        ],
        "--tokens 300: the prefill at",
    );
    // The failed decode released the request: the prefill ends at once.
    assert!(p.wait().unwrap().success());
}

#[test]
fn demo_over_tls_and_quic_with_ephemeral_certificates() {
    for t in ["tls", "quic"] {
        let o = tpu_sync(
            &["demo", "--layers", "2", "--tokens", "333", "--transport", t],
            LIMIT,
        );
        let text = text(&o);
        assert!(o.status.success(), "demo over {t} failed:\n{text}");
        assert!(
            text.contains(&format!("transport: {t} (mutual TLS (CA))")),
            "{t}: table does not show the transport:\n{text}"
        );
        assert!(text.contains(&format!("net/{t}")), "{text}");
        let v = text.lines().find(|l| l.starts_with("verified:")).unwrap();
        assert_eq!(verified_bytes(v), 333 * 2 * 2 * 8 * 128 * 2);
        assert!(v.ends_with(&format!("over {t}")), "{v}");
    }
}

/// Prefill and decode as separate processes on one host over the shm transport: the decode
/// copies the prefill's staged bytes out of the prefill process (cross-memory attach, or the
/// inline fallback where the kernel refuses it) and verifies every byte.
#[test]
fn demo_over_shm() {
    let o = tpu_sync(
        &[
            "demo",
            "--layers",
            "2",
            "--tokens",
            "333",
            "--transport",
            "shm",
        ],
        LIMIT,
    );
    let text = text(&o);
    assert!(o.status.success(), "demo over shm failed:\n{text}");
    assert!(text.contains("net/shm"), "{text}");
    let v = text.lines().find(|l| l.starts_with("verified:")).unwrap();
    assert_eq!(verified_bytes(v), 333 * 2 * 2 * 8 * 128 * 2);
    assert!(v.ends_with("over shm"), "{v}");
}

#[test]
fn prefill_and_decode_with_a_pre_shared_key_and_a_wrong_one() {
    let dir = std::env::temp_dir().join(format!("tpu-sync-psk-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let good = dir.join("good.key");
    let bad = dir.join("bad.key");
    std::fs::write(&good, b"0123456789abcdef0123456789abcdef").unwrap();
    std::fs::write(&bad, b"fedcba9876543210fedcba9876543210").unwrap();
    let mut a: Vec<std::ffi::OsString> = [
        "--layers",
        "1",
        "--tokens",
        "100",
        "--listen",
        "127.0.0.1:0",
        "--transport",
        "quic",
        "--psk-file",
    ]
    .iter()
    .map(Into::into)
    .collect();
    a.push(good.clone().into());
    let Prefill {
        child: mut p,
        addr,
        lines: _lines,
    } = spawn_prefill(&a);
    let args = |key: &std::path::Path| {
        vec![
            "decode".to_string(),
            "--connect".into(),
            addr.clone(),
            "--layers".into(),
            "1".into(),
            "--transport".into(),
            "quic".into(),
            "--timeout".into(),
            "3".into(),
            "--psk-file".into(),
            key.display().to_string(),
        ]
    };
    let bad_args = args(&bad);
    let o = tpu_sync(
        &bad_args.iter().map(String::as_str).collect::<Vec<_>>(),
        LIMIT,
    );
    assert!(
        !o.status.success(),
        "a wrong PSK was accepted:\n{}",
        text(&o)
    );
    let good_args = args(&good);
    let o = tpu_sync(
        &good_args.iter().map(String::as_str).collect::<Vec<_>>(),
        LIMIT,
    );
    let t = text(&o);
    assert!(o.status.success(), "{t}");
    assert!(t.contains("\"transport\":\"quic (pre-shared key)\""), "{t}");
    assert!(p.wait().unwrap().success());
    let _ = std::fs::remove_dir_all(&dir);
}

/// Prefill ranks in different processes: ranks 0,1 of a TP=2 x PCP=2 prefill in one process and
/// ranks 2,3 in another; the decode pulls each rank's spans from the process that holds it.
#[test]
fn prefill_ranks_in_two_processes() {
    let spawn = |ranks: &str| {
        let mut a: Vec<std::ffi::OsString> = [
            "--layers",
            "2",
            "--tokens",
            "300",
            "--listen",
            "127.0.0.1:0",
            "--ranks",
            ranks,
            "--transport",
            "quic",
            "--psk-file",
        ]
        .iter()
        .map(Into::into)
        .collect();
        a.push(psk_path().into());
        let Prefill {
            child: p,
            addr,
            lines,
        } = spawn_prefill(&a);
        // Keep reading its stdout (its final REPORT line) so it never writes to a closed pipe.
        let drain = std::thread::spawn(move || lines.count());
        (p, addr, drain)
    };
    let (mut p01, a01, _d01) = spawn("0,1");
    let (mut p23, a23, _d23) = spawn("2,3");
    let map = format!("0={a01},1={a01},2={a23},3={a23}");
    let psk = psk_path().display().to_string();
    let o = tpu_sync(
        &[
            "decode",
            "--connect",
            &map,
            "--layers",
            "2",
            "--transport",
            "quic",
            "--psk-file",
            &psk,
        ],
        LIMIT,
    );
    let t = text(&o);
    assert!(o.status.success(), "{t}");
    let rep: serde_json::Value =
        serde_json::from_str(t.lines().find_map(|l| l.strip_prefix("REPORT ")).unwrap()).unwrap();
    assert_eq!(rep["mismatches"], 0);
    assert_eq!(rep["verified_request_bytes"], 300 * 2 * 2 * 8 * 128 * 2);
    assert_eq!(rep["net_pairs"], 4, "{rep}");
    assert!(p01.wait().unwrap().success());
    assert!(p23.wait().unwrap().success());
}

fn psk_path() -> std::path::PathBuf {
    let p = std::env::temp_dir().join(format!("tpu-sync-ranks-psk-{}", std::process::id()));
    if !p.exists() {
        std::fs::write(&p, b"a-pre-shared-key-of-32-bytes-ok!").unwrap();
    }
    p
}

/// The prefill process is killed (SIGKILL) while the decode works on the request (describing,
/// connecting or mid-transfer, depending on timing): the decode fails with an explicit error
/// within its configured limits (5 s), for each transport. QUIC has no reset a client could see, so
/// a decode that only connects after the kill waits for its connect + handshake timeouts.
#[test]
fn prefill_killed_mid_transfer_fails_the_decode() {
    for t in ["tcp", "quic", "shm"] {
        let psk = psk_path().display().to_string();
        let mut args = vec![
            "--layers",
            "4",
            "--tokens",
            "1000",
            "--listen",
            "127.0.0.1:0",
            "--fault-stall-after",
            "200000",
            "--transport",
            t,
        ];
        if t != "tcp" && t != "shm" {
            args.extend(["--psk-file", &psk]);
        }
        let Prefill {
            child: mut p,
            addr,
            lines,
        } = spawn_prefill(&args);
        let pid = p.id();
        // Kill the prefill once the decode is well into the transfer (the prefill stalls after
        // 200 KB, so the transfer is in flight when the kill lands).
        let killer = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(1500));
            // SAFETY: signalling our own child process by pid.
            unsafe { libc::kill(pid as i32, libc::SIGKILL) };
        });
        let mut dargs = vec![
            "decode",
            "--connect",
            &addr,
            "--layers",
            "4",
            "--timeout",
            "5",
            "--transport",
            t,
        ];
        if t != "tcp" && t != "shm" {
            dargs.extend(["--psk-file", &psk]);
        }
        let t0 = std::time::Instant::now();
        let o = tpu_sync(&dargs, LIMIT);
        let text = text(&o);
        killer.join().unwrap();
        let _ = p.wait();
        assert!(
            !o.status.success(),
            "{t}: decode succeeded after the prefill died:\n{text}"
        );
        assert!(text.contains("peer"), "{t}: {text}");
        assert!(!text.contains("panicked"), "{text}");
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "{t}: noticed after {:?} (timeouts 5 s)",
            t0.elapsed()
        );
        drop(lines);
    }
}
