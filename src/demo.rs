//! `tpu-sync demo`: runs `tpu-sync prefill` and `tpu-sync decode` as two OS processes connected
//! only by the network, then prints what moved and whether every byte verified.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

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
    ];
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
    a
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
            println!("{l}");
        }
    }
    rep
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
    // Fail fast, before spawning anything, on bad presets, specs and transports.
    let m = kvproc::model(job)?;
    let ps = kvproc::prefill_spec(job)?;
    let ds = kvproc::decode_spec(job)?;
    tpu_sync::layout::ParallelLayout::new(m.clone(), ps, 1)?;
    tpu_sync::layout::ParallelLayout::new(m.clone(), ds, 1)?;
    if job.transport != "tcp" {
        return Err(Error::InvalidArgument(format!(
            "transport `{}` is not available in this build (available: tcp)",
            job.transport
        )));
    }
    let exe = std::env::current_exe().map_err(|e| Error::io("current_exe", e))?;
    println!(
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

    let mut prefill = Guard(Some(
        Command::new(&exe)
            .arg("prefill")
            .args(child_args(job))
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
                println!("{l}");
            }
            None => {
                let status = prefill.0.take().map(|mut c| c.wait());
                return Err(Error::PeerClosed(format!(
                    "prefill process exited before listening ({status:?})"
                )));
            }
        }
    };
    let prefill_lines = std::thread::spawn(move || read_report(lines));

    let decode = Command::new(&exe)
        .arg("decode")
        .args(child_args(job))
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

    let (Some(p), Some(d)) = (prep, drep) else {
        eprintln!(
            "demo FAILED: prefill exit {:?}, decode exit {:?} (a side did not report)",
            pstatus.map(|s| s.to_string()),
            dstatus.to_string()
        );
        return Ok(ExitCode::from(1));
    };
    println!("  PJRT {} plugin, API {}", p.platform, p.api_version);
    println!("  prefill: {}  ({} devices)", p.layout, p.devices);
    println!("  decode:  {}  ({} devices)", d.layout, d.devices);
    println!("  transport: {} via {addr}", job.transport);
    println!("  D2H path: {}", p.d2h_path);
    println!("  H2D path: {}", d.h2d_path);
    println!("  staging: prefill {}, decode {}", p.lock, d.lock);
    println!();
    println!(
        "  {:<9} {:>10} {:>22} {:>10} {:>8}",
        "phase", "bytes", "ops", "seconds", "GB/s"
    );
    println!(
        "  {:<9} {:>10} {:>22} {:>10.3} {:>8}",
        "D2H",
        fmt_bytes(p.device_bytes),
        format!("{} copies", p.device_ops),
        p.device_secs,
        gbps(p.device_bytes, p.device_secs)
    );
    println!(
        "  {:<9} {:>10} {:>22} {:>10.3} {:>8}",
        "network",
        fmt_bytes(d.net_bytes),
        format!("{} spans, {} pairs", d.net_spans, d.net_pairs),
        d.net_secs,
        gbps(d.net_bytes, d.net_secs)
    );
    println!(
        "  {:<9} {:>10} {:>22} {:>10.3} {:>8}",
        "H2D",
        fmt_bytes(d.device_bytes),
        format!("{} copies", d.device_ops),
        d.device_secs,
        gbps(d.device_bytes, d.device_secs)
    );
    println!(
        "  checked: {} of request KV element by element, {} outside the request unchanged",
        fmt_bytes(d.verified_request_bytes),
        fmt_bytes(d.verified_background_bytes)
    );
    println!("  wall time: {:.2} s", t0.elapsed().as_secs_f64());
    let ok = dstatus.success()
        && pstatus.map(|s| s.success()).unwrap_or(false)
        && d.mismatches == 0
        && d.verified_request_bytes > 0
        && d.verified_request_bytes == d.net_bytes;
    if ok {
        println!(
            "verified: {} bytes, {} blocks, {} layers: prefill {} -> decode {}",
            d.verified_request_bytes, d.request_blocks, d.layers, p.layout, d.layout
        );
        Ok(ExitCode::SUCCESS)
    } else {
        println!(
            "FAILED: {} mismatching elements (first: {}), decode exit {}, prefill exit {:?}",
            d.mismatches,
            d.first_mismatch.as_deref().unwrap_or("-"),
            dstatus,
            pstatus.map(|s| s.to_string())
        );
        Ok(ExitCode::from(1))
    }
}
