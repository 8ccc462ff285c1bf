//! `tpu-sync top`: a live view of running processes' metrics, read from their HTTP endpoints
//! (`TPU_SYNC_METRICS_ADDR`, `tpu_sync.serve_metrics`, the vLLM connector's `metrics_addr`):
//! throughput per direction (device copies D2H/H2D, network send/receive), transfers in flight,
//! started/completed/failed, peers, leases, staged and in-flight DMA bytes, host-tier occupancy
//! per tier and hit rate. Several `--url`s (one per rank) are added up. A plain refresh of the
//! terminal (no full-screen UI), or one report with `--once`.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use http_body_util::{BodyExt, Empty};
use hyper::body::Bytes;
use hyper_util::rt::TokioIo;
use tpu_sync::error::{Error, Result};

/// `tpu-sync top` flags.
#[derive(clap::Args, Debug, Clone)]
pub struct TopArgs {
    /// Metrics endpoint `HOST:PORT` (or `http://HOST:PORT/metrics`); repeat for several ranks.
    #[arg(long = "url", required = true)]
    pub urls: Vec<String>,
    /// Seconds between refreshes.
    #[arg(long, default_value_t = 1.0)]
    pub interval: f64,
    /// Print one report (rates over one interval) and exit.
    #[arg(long)]
    pub once: bool,
    /// Stop after this many refreshes (default: until interrupted).
    #[arg(long)]
    pub count: Option<u64>,
}

/// Samples of all endpoints summed: (name, sorted labels without `instance`) -> value.
type Samples = HashMap<(String, Vec<(String, String)>), f64>;

fn host_port(url: &str) -> Result<(String, String)> {
    let u = url.trim();
    let u = u.strip_prefix("http://").unwrap_or(u);
    let (hp, path) = match u.split_once('/') {
        Some((h, p)) => (h, format!("/{p}")),
        None => (u, "/metrics".to_string()),
    };
    if hp.is_empty() || !hp.contains(':') {
        return Err(Error::InvalidArgument(format!(
            "--url {url:?}: expected HOST:PORT or http://HOST:PORT/metrics"
        )));
    }
    Ok((hp.to_string(), path))
}

async fn fetch(url: &str) -> Result<String> {
    let (hp, path) = host_port(url)?;
    let io = |e: std::io::Error| Error::io(format!("metrics endpoint {hp}"), e);
    let stream = tokio::time::timeout(Duration::from_secs(5), tokio::net::TcpStream::connect(&hp))
        .await
        .map_err(|_| Error::Timeout(format!("connecting to {hp}")))?
        .map_err(io)?;
    let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| Error::Protocol(format!("{hp}: {e}")))?;
    tokio::spawn(async move {
        let _ = conn.await;
    });
    let req = hyper::Request::get(path.as_str())
        .header(hyper::header::HOST, hp.as_str())
        .body(Empty::<Bytes>::new())
        .map_err(|e| Error::InvalidArgument(format!("{url}: {e}")))?;
    let resp = tokio::time::timeout(Duration::from_secs(10), send.send_request(req))
        .await
        .map_err(|_| Error::Timeout(format!("GET {url}")))?
        .map_err(|e| Error::Protocol(format!("GET {url}: {e}")))?;
    if !resp.status().is_success() {
        return Err(Error::Protocol(format!("GET {url}: {}", resp.status())));
    }
    let body = resp
        .into_body()
        .collect()
        .await
        .map_err(|e| Error::Protocol(format!("GET {url}: {e}")))?
        .to_bytes();
    String::from_utf8(body.to_vec())
        .map_err(|_| Error::Protocol(format!("GET {url}: the body is not UTF-8")))
}

/// Parses Prometheus text with `prometheus-parse` into `out` (values of equal series added).
fn parse_into(text: &str, out: &mut Samples) -> Result<()> {
    let scrape = prometheus_parse::Scrape::parse(text.lines().map(|l| Ok(l.to_string())))
        .map_err(|e| Error::Protocol(format!("metrics text: {e}")))?;
    for s in scrape.samples {
        let v = match s.value {
            prometheus_parse::Value::Counter(v)
            | prometheus_parse::Value::Gauge(v)
            | prometheus_parse::Value::Untyped(v) => v,
            prometheus_parse::Value::Histogram(h) => {
                // `_count` is the last (`+Inf`) bucket.
                let n = h.last().map(|b| b.count).unwrap_or(0.0);
                *out.entry((format!("{}_count", s.metric), labels_of(&s.labels)))
                    .or_default() += n;
                continue;
            }
            _ => continue,
        };
        *out.entry((s.metric, labels_of(&s.labels))).or_default() += v;
    }
    Ok(())
}

fn labels_of(l: &prometheus_parse::Labels) -> Vec<(String, String)> {
    let mut v: Vec<(String, String)> = l
        .iter()
        .filter(|(k, _)| k.as_str() != "instance")
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    v.sort();
    v
}

/// Sum of the series of `name` whose labels include every pair of `want`.
fn sum(s: &Samples, name: &str, want: &[(&str, &str)]) -> f64 {
    s.iter()
        .filter(|((n, l), _)| {
            n == name
                && want
                    .iter()
                    .all(|(k, v)| l.iter().any(|(lk, lv)| lk == k && lv == v))
        })
        .map(|(_, v)| *v)
        .sum::<f64>()
        + 0.0 // an empty f64 sum is -0.0
}

fn rate(now: &Samples, before: &Samples, name: &str, want: &[(&str, &str)], dt: f64) -> f64 {
    ((sum(now, name, want) - sum(before, name, want)) / dt).max(0.0)
}

fn gbps(bytes_per_s: f64) -> String {
    format!("{:8.3} GB/s", bytes_per_s / 1e9)
}

fn mib(b: f64) -> String {
    format!("{:.1} MiB", b / (1 << 20) as f64)
}

fn hit_rate(hit: f64, miss: f64) -> String {
    if hit + miss > 0.0 {
        format!("{:5.1}%", 100.0 * hit / (hit + miss))
    } else {
        "    -".to_string()
    }
}

/// The report of one refresh.
fn render(urls: &[String], now: &Samples, before: &Samples, dt: f64, errors: &[String]) -> String {
    let mut o = String::new();
    let mut line = |s: String| {
        o.push_str(&s);
        o.push('\n');
    };
    line(format!(
        "tpu-sync top  {}  (every {dt:.1} s)",
        urls.join(", ")
    ));
    for e in errors {
        line(format!("  ! {e}"));
    }
    let dev = "tpu_sync_device_copy_bytes_total";
    let net = "tpu_sync_net_bytes_total";
    line("throughput".into());
    line(format!(
        "  D2H {}   H2D {}   (totals {} / {})",
        gbps(rate(now, before, dev, &[("direction", "d2h")], dt)),
        gbps(rate(now, before, dev, &[("direction", "h2d")], dt)),
        mib(sum(now, dev, &[("direction", "d2h")])),
        mib(sum(now, dev, &[("direction", "h2d")])),
    ));
    line(format!(
        "  net send {}   net receive {}",
        gbps(rate(now, before, net, &[("direction", "send")], dt)),
        gbps(rate(now, before, net, &[("direction", "receive")], dt))
    ));
    for t in ["tcp", "tls", "quic", "shm"] {
        let (s, r) = (
            sum(now, net, &[("transport", t), ("direction", "send")]),
            sum(now, net, &[("transport", t), ("direction", "receive")]),
        );
        if s + r > 0.0 {
            line(format!(
                "    {t:<4} total sent {}  received {}",
                mib(s),
                mib(r)
            ));
        }
    }
    line("transfers".into());
    let failed: f64 = sum(now, "tpu_sync_transfers_failed_total", &[]);
    line(format!(
        "  in flight {:.0}   started {:.0}   completed {:.0}   failed {:.0}   checksum failures {:.0}",
        sum(now, "tpu_sync_transfers_in_flight", &[]),
        sum(now, "tpu_sync_transfers_started_total", &[]),
        sum(now, "tpu_sync_transfers_completed_total", &[]),
        failed,
        sum(now, "tpu_sync_checksum_failures_total", &[]),
    ));
    let mut kinds: Vec<(String, f64)> = now
        .iter()
        .filter(|((n, _), v)| n == "tpu_sync_transfers_failed_total" && **v > 0.0)
        .flat_map(|((_, l), v)| {
            l.iter()
                .filter(|(k, _)| k == "kind")
                .map(move |(_, kind)| (kind.clone(), *v))
        })
        .collect();
    kinds.sort_by(|a, b| a.0.cmp(&b.0));
    if !kinds.is_empty() {
        let mut merged: Vec<(String, f64)> = Vec::new();
        for (k, v) in kinds {
            match merged.last_mut() {
                Some(m) if m.0 == k => m.1 += v,
                _ => merged.push((k, v)),
            }
        }
        let text: Vec<String> = merged.iter().map(|(k, v)| format!("{k} {v:.0}")).collect();
        line(format!("    failed by kind: {}", text.join(", ")));
    }
    line(format!(
        "  peers {:.0}   lost {:.0}   leases {:.0}   staged {}   DMA in flight {} of {}",
        sum(now, "tpu_sync_peers", &[]),
        sum(now, "tpu_sync_peers_lost_total", &[]),
        sum(now, "tpu_sync_leases", &[]),
        mib(sum(now, "tpu_sync_staged_bytes", &[])),
        mib(sum(now, "tpu_sync_dma_inflight_bytes", &[])),
        mib(sum(now, "tpu_sync_dma_inflight_limit_bytes", &[])),
    ));
    line("host tier".into());
    for t in ["dram", "disk"] {
        let cap = sum(now, "tpu_sync_store_capacity_blocks", &[("tier", t)]);
        let res = sum(now, "tpu_sync_store_blocks", &[("tier", t)]);
        let lk = "tpu_sync_store_lookup_blocks_total";
        let (h, m) = (
            sum(now, lk, &[("tier", t), ("result", "hit")]),
            sum(now, lk, &[("tier", t), ("result", "miss")]),
        );
        let (dh, dm) = (
            h - sum(before, lk, &[("tier", t), ("result", "hit")]),
            m - sum(before, lk, &[("tier", t), ("result", "miss")]),
        );
        if cap > 0.0 || h + m > 0.0 {
            let occ = if cap > 0.0 { 100.0 * res / cap } else { 0.0 };
            line(format!(
                "  {t:<4} {res:.0}/{cap:.0} blocks ({occ:5.1}%)   hit rate {} (now {})",
                hit_rate(h, m),
                hit_rate(dh, dm)
            ));
        }
    }
    line(format!(
        "  evictions {:.0}   spills {:.0}   puts {:.0}   gets {:.0}",
        sum(now, "tpu_sync_store_evictions_total", &[]),
        sum(now, "tpu_sync_store_disk_spills_total", &[("result", "ok")]),
        sum(
            now,
            "tpu_sync_store_put_blocks_total",
            &[("result", "stored")]
        ),
        sum(now, "tpu_sync_store_get_blocks_total", &[]),
    ));
    o
}

async fn scrape_all(urls: &[String]) -> (Samples, Vec<String>) {
    let mut s = Samples::new();
    let mut errors = Vec::new();
    for u in urls {
        match fetch(u).await.and_then(|t| parse_into(&t, &mut s)) {
            Ok(()) => {}
            Err(e) => errors.push(format!("{u}: {e}")),
        }
    }
    (s, errors)
}

/// Runs `tpu-sync top`. Exit code 0; 1 when no endpoint answered at all (`--once`).
pub fn run(a: &TopArgs) -> Result<std::process::ExitCode> {
    if !(a.interval > 0.0 && a.interval.is_finite()) {
        return Err(Error::InvalidArgument("--interval must be > 0".into()));
    }
    for u in &a.urls {
        host_port(u)?;
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| Error::io("tokio runtime", e))?;
    rt.block_on(async {
        let interval = Duration::from_secs_f64(a.interval);
        let (mut before, _) = scrape_all(&a.urls).await;
        let mut t_before = Instant::now();
        let mut n = 0u64;
        loop {
            tokio::time::sleep(interval).await;
            let (now, errors) = scrape_all(&a.urls).await;
            let dt = t_before.elapsed().as_secs_f64();
            let report = render(&a.urls, &now, &before, dt, &errors);
            if a.once {
                outln!("{report}");
                let code = if errors.len() == a.urls.len() { 1 } else { 0 };
                return Ok(std::process::ExitCode::from(code));
            }
            // Clear the screen and home the cursor, then the report.
            outln!("\x1b[2J\x1b[H{report}");
            n += 1;
            if a.count.is_some_and(|c| n >= c) {
                return Ok(std::process::ExitCode::SUCCESS);
            }
            before = now;
            t_before = Instant::now();
        }
    })
}
