//! `tpu-sync demo`: runs `tpu-sync prefill` and `tpu-sync decode` as two OS processes connected
//! only by the network, then prints what moved and whether every byte verified.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, ExitCode, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use tpu_sync::net::tls::generate_test_pki;
use tpu_sync::util::fmt_bytes;
use tpu_sync::{Error, Result};

use crate::kvproc::{self, Report};
use crate::JobArgs;

fn child_args(job: &JobArgs) -> Vec<String> {
    let mut a = vec![
        "--preset".into(),
        job.preset.clone(),
        "--tokens".into(),
        job.tokens.to_string(),
        "--prefill".into(),
        job.prefill.clone(),
        "--decode".into(),
        job.decode.clone(),
        "--transport".into(),
        job.transport.clone(),
        "--request-id".into(),
        job.request_id.to_string(),
        "--timeout".into(),
        job.timeout.to_string(),
        "--serve-timeout".into(),
        job.serve_timeout.to_string(),
        "--streams".into(),
        job.streams.to_string(),
        "--chunk-bytes".into(),
        job.chunk_bytes.to_string(),
    ];
    if let Some(p) = &job.psk_file {
        a.extend(["--psk-file".into(), p.display().to_string()]);
    }
    if let Some(r) = job.decode_dp_rank {
        a.extend(["--decode-dp-rank".into(), r.to_string()]);
    }
    if let Some(p) = &job.plugin {
        a.extend(["--plugin".into(), p.display().to_string()]);
    }
    if let Some(l) = job.layers {
        a.extend(["--layers".into(), l.to_string()]);
    }
    if let Some(f) = job.fault_close_after {
        a.extend(["--fault-close-after".into(), f.to_string()]);
    }
    if let Some(b) = job.staging_budget {
        a.extend(["--staging-budget".into(), b.to_string()]);
    }
    if let Some(f) = &job.fault_groups {
        a.extend(["--fault-groups".into(), f.clone()]);
    }
    a
}

/// Removes a directory (the demo's ephemeral certificates) when dropped.
struct DirGuard(std::path::PathBuf);
impl Drop for DirGuard {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

struct Guard(Option<Child>);
impl Drop for Guard {
    fn drop(&mut self) {
        if let Some(mut c) = self.0.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn read_report(lines: impl Iterator<Item = String>) -> Option<Report> {
    let mut rep = None;
    for l in lines {
        if let Some(j) = l.strip_prefix("REPORT ") {
            rep = serde_json::from_str(j).ok();
        } else {
            outln!("{l}");
        }
    }
    rep
}

/// "with status 2", "on signal 9 (SIGKILL)": how a child process ended, for messages.
pub fn exit_text(s: &ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    if let Some(c) = s.code() {
        return format!("with status {c}");
    }
    match s.signal() {
        Some(sig) => {
            let name = match sig {
                libc::SIGINT => " (SIGINT)",
                libc::SIGTERM => " (SIGTERM)",
                libc::SIGKILL => " (SIGKILL)",
                libc::SIGSEGV => " (SIGSEGV)",
                libc::SIGABRT => " (SIGABRT)",
                libc::SIGPIPE => " (SIGPIPE)",
                _ => "",
            };
            format!("on signal {sig}{name}")
        }
        None => format!("({s})"),
    }
}

fn gbps(bytes: u64, secs: f64) -> String {
    if secs > 0.0 {
        format!("{:.2}", bytes as f64 / secs / 1e9)
    } else {
        "-".into()
    }
}

/// Runs the demo; exit code 0 only when every byte verified.
pub fn run(job: &JobArgs) -> Result<ExitCode> {
    let t0 = Instant::now();
    // Fail fast, before spawning anything, on bad presets, specs, ranks, streams and transports.
    kvproc::validate(job)?;
    let grouped = crate::kvproc_groups::is_grouped(job);
    let kind = kvproc::transport_kind(job)?;
    // tls/quic without credentials: an ephemeral CA and one certificate per side, in a private
    // temporary directory removed at the end.
    let pki_dir = std::env::temp_dir().join(format!("tpu-sync-demo-{}", std::process::id()));
    let mut _cleanup = None;
    if kind.authenticates() && job.tls_cert.is_none() && job.psk_file.is_none() {
        // A fresh 0700 directory: refuse one that already exists (it could belong to someone
        // else, or be a symlink) rather than write private keys into it.
        use std::os::unix::fs::DirBuilderExt;
        std::fs::DirBuilder::new()
            .mode(0o700)
            .create(&pki_dir)
            .map_err(|e| tpu_sync::Error::io(format!("create {}", pki_dir.display()), e))?;
        _cleanup = Some(DirGuard(pki_dir.clone()));
    }
    let mut creds: [Vec<String>; 2] = [Vec::new(), Vec::new()];
    let given = job.tls_cert.is_some() || job.psk_file.is_some();
    if kind.authenticates() && !given {
        let pki = generate_test_pki(&pki_dir, &["prefill", "decode"])?;
        for (i, side) in ["prefill", "decode"].iter().enumerate() {
            let (c, k) = pki.files(side).expect("generated");
            creds[i] = vec![
                "--tls-cert".into(),
                c.display().to_string(),
                "--tls-key".into(),
                k.display().to_string(),
                "--tls-ca".into(),
                pki.ca.display().to_string(),
            ];
        }
    } else if let (Some(c), Some(k), Some(ca)) = (&job.tls_cert, &job.tls_key, &job.tls_ca) {
        for side in creds.iter_mut() {
            *side = vec![
                "--tls-cert".into(),
                c.display().to_string(),
                "--tls-key".into(),
                k.display().to_string(),
                "--tls-ca".into(),
                ca.display().to_string(),
            ];
        }
    }
    let exe = std::env::current_exe().map_err(|e| Error::io("current_exe", e))?;
    if grouped {
        let m = tpu_sync::layout::HybridModel::preset(&job.preset)?;
        outln!(
            "tpu-sync demo: {} ({} cache layers in {} KV cache groups: {}), {} tokens",
            m.name,
            m.num_layers(),
            m.groups.len(),
            m.describe(),
            job.tokens
        );
    } else {
        let m = kvproc::model(job)?;
        outln!(
            "tpu-sync demo: {} ({} layers, {} KV heads x {}, {} planes, {}), {} tokens = {} of KV",
            m.name,
            m.num_layers,
            m.num_kv_heads,
            m.head_dim,
            m.kv_planes,
            m.dtype.name(),
            job.tokens,
            fmt_bytes(m.bytes_per_token() * job.tokens as u64)
        );
    }

    let mut prefill = Guard(Some(
        Command::new(&exe)
            .arg("prefill")
            .args(child_args(job))
            .args(&creds[0])
            .args(["--listen", &format!("127.0.0.1:{}", job.port)])
            .stdout(Stdio::piped())
            .spawn()
            .map_err(|e| Error::io("spawn prefill", e))?,
    ));
    let out = prefill
        .0
        .as_mut()
        .and_then(|c| c.stdout.take())
        .expect("piped stdout");
    let mut lines = BufReader::new(out).lines().map_while(|l| l.ok());
    let addr = loop {
        match lines.next() {
            Some(l) => {
                if let Some(a) = l.strip_prefix("LISTENING ") {
                    break a.trim().to_string();
                }
                outln!("{l}");
            }
            None => {
                let status = prefill.0.take().map(|mut c| c.wait());
                let how = match status {
                    Some(Ok(s)) => exit_text(&s),
                    Some(Err(e)) => format!("with an unknown status ({e})"),
                    None => "with an unknown status".into(),
                };
                errln!(
                    "error: the prefill process exited {how} before listening (its error is \
                     printed above)"
                );
                return Ok(ExitCode::from(2));
            }
        }
    };
    let prefill_lines = std::thread::spawn(move || read_report(lines));

    let decode = Command::new(&exe)
        .arg("decode")
        .args(child_args(job))
        .args(&creds[1])
        .args(["--connect", &addr])
        .stdout(Stdio::piped())
        .spawn()
        .map_err(|e| Error::io("spawn decode", e))?;
    let mut decode = Guard(Some(decode));
    let dout = decode
        .0
        .as_mut()
        .and_then(|c| c.stdout.take())
        .expect("piped stdout");
    let drep = read_report(BufReader::new(dout).lines().map_while(|l| l.ok()));
    let dstatus = decode
        .0
        .take()
        .expect("child")
        .wait()
        .map_err(|e| Error::io("wait decode", e))?;
    // The prefill exits once the decode released the request; bound the wait.
    let deadline = Instant::now() + Duration::from_secs(15);
    let pstatus = loop {
        let c = prefill.0.as_mut().expect("child");
        if let Some(s) = c.try_wait().map_err(|e| Error::io("wait prefill", e))? {
            prefill.0 = None;
            break Some(s);
        }
        if Instant::now() > deadline {
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    drop(prefill);
    let prep = prefill_lines.join().ok().flatten();
    let (prep_ok, drep_ok) = (prep.is_some(), drep.is_some());

    let (Some(p), Some(d)) = (prep, drep) else {
        let side = |name: &str, reported: bool, status: Option<String>| {
            format!(
                "the {name} process {} and exited {}",
                if reported {
                    "reported"
                } else {
                    "did not report"
                },
                status.unwrap_or_else(|| "(still running after 15 s, killed)".into())
            )
        };
        errln!(
            "demo FAILED: {}; {} (errors are printed above)",
            side("prefill", prep_ok, pstatus.as_ref().map(exit_text)),
            side("decode", drep_ok, Some(exit_text(&dstatus)))
        );
        return Ok(ExitCode::from(1));
    };
    outln!("  PJRT {} plugin, API {}", p.platform, p.api_version);
    outln!("  prefill: {}  ({} devices)", p.layout, p.devices);
    outln!("  decode:  {}  ({} devices)", d.layout, d.devices);
    outln!("  transport: {} via {addr}", d.transport);
    outln!("  D2H path: {}", p.d2h_path);
    outln!("  H2D path: {}", d.h2d_path);
    outln!("  staging: prefill {}, decode {}", p.lock, d.lock);
    outln!();
    outln!(
        "  {:<9} {:>10} {:>30} {:>10} {:>8}",
        "phase",
        "bytes",
        "ops",
        "seconds",
        "GB/s"
    );
    outln!(
        "  {:<9} {:>10} {:>30} {:>10.3} {:>8}",
        "D2H",
        fmt_bytes(p.device_bytes),
        format!("{} copies", p.device_ops),
        p.device_secs,
        gbps(p.device_bytes, p.device_secs)
    );
    outln!(
        "  {:<9} {:>10} {:>30} {:>10.3} {:>8}",
        format!("net/{kind}"),
        fmt_bytes(d.net_bytes),
        format!(
            "{} spans, {} pairs, {} stripes",
            d.net_spans, d.net_pairs, d.net_stripes
        ),
        d.net_secs,
        gbps(d.net_bytes, d.net_secs)
    );
    outln!(
        "  {:<9} {:>10} {:>30} {:>10.3} {:>8}",
        "H2D",
        fmt_bytes(d.device_bytes),
        format!("{} copies", d.device_ops),
        d.device_secs,
        gbps(d.device_bytes, d.device_secs)
    );
    outln!(
        "  checked: {} of request KV element by element, {} outside the request unchanged",
        fmt_bytes(d.verified_request_bytes),
        fmt_bytes(d.verified_background_bytes)
    );
    if !d.groups.is_empty() {
        outln!();
        outln!(
            "  {:<18} {:<15} {:>6} {:>7} {:>12} {:>12} {:>12} {:>12}",
            "group",
            "kind",
            "layers",
            "blocks",
            "moved",
            "needed",
            "verified",
            "moved/needed"
        );
        for g in &d.groups {
            outln!(
                "  {:<18} {:<15} {:>6} {:>7} {:>12} {:>12} {:>12} {:>12}",
                g.name,
                g.kind,
                g.layers,
                g.num_blocks,
                g.moved_bytes,
                g.needed_bytes,
                g.verified_bytes,
                if g.needed_bytes > 0 {
                    format!("{:.2}", g.moved_bytes as f64 / g.needed_bytes as f64)
                } else {
                    "-".into()
                }
            );
        }
    }
    outln!("  wall time: {:.2} s", t0.elapsed().as_secs_f64());
    let ok = dstatus.success()
        && pstatus.map(|s| s.success()).unwrap_or(false)
        && d.mismatches == 0
        && d.verified_request_bytes > 0
        && d.verified_request_bytes == d.net_bytes
        && d.groups
            .iter()
            .all(|g| g.moved_bytes == g.needed_bytes && g.mismatches == 0);
    if ok {
        outln!(
            "verified: {} bytes, {} blocks, {} layers: prefill {} -> decode {} over {}",
            d.verified_request_bytes,
            d.request_blocks,
            d.layers,
            p.layout,
            d.layout,
            kind
        );
        Ok(ExitCode::SUCCESS)
    } else {
        outln!(
            "FAILED: {} mismatching elements (first: {}), decode exited {}, prefill exited {}",
            d.mismatches,
            d.first_mismatch.as_deref().unwrap_or("-"),
            exit_text(&dstatus),
            pstatus
                .as_ref()
                .map(exit_text)
                .unwrap_or_else(|| "(still running after 15 s, killed)".into())
        );
        Ok(ExitCode::from(1))
    }
}
