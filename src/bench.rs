//! `tpu-sync bench SCENARIO`: throughput and latency of the library's data paths against a
//! baseline measured in the same run on the same machine.
//!
//! | scenario | systems | baseline |
//! |---|---|---|
//! | `d2h` | KV blocks from PJRT device buffers into pinned staging (`Staging::fill_from_device`, the engines' path) | `memcpy` of the same pieces between host buffers |
//! | `h2d` | staged KV blocks written into the device buffers in place (`Staging::drain_to_device`) | `memcpy` of the same pieces |
//! | `net` | a request pulled and pushed through `net::Endpoint` over TCP, TLS and QUIC, to and from a separate process | one raw TCP socket between the same two processes moving the same bytes |
//! | `reshard` | a prefill->decode resharding plan, an MLA cache to a TP=4 decode per rank and per host (fan-out), and the TPU engines' RPA v3 caches resharded (TPU TP changes, NHD -> RPA v3, head_dim 64; bytes moved / needed noted) | a plain transfer of the same bytes (TP=1 -> TP=1) |
//! | `latency` | p50/p99 of one 16 KiB block pulled/pushed | the raw socket's 16 KiB round trip |
//! | `store` | host KV tier put (copy + xxh3) and get (with and without verification), lookups | `memcpy` of the same blocks |
//!
//! Method (every scenario): the bytes every system moves are checked before anything is timed
//! (byte-exact against a pattern, a scenario fails on a mismatch); each system is warmed up and
//! calibrated so a round lasts at least `--round-ms`; then rounds are interleaved round-robin
//! over the systems (the starting system rotates), so load from other processes hits all of
//! them alike. Reported: min / median / max over rounds and the ratio of median throughput to
//! the baseline's (1.00 = the baseline's speed). Timings are never asserted: `--quick` (small
//! sizes, two rounds) is what `make test` runs, for the byte checks.
//!
//! The network scenarios run the remote side in a helper process (`tpu-sync bench-peer`,
//! hidden), which also serves the raw-socket baseline from a plain blocking socket.

mod net;
mod report;

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

/// Pause before each timed operation of a latency scenario, so that the background work of
/// the one before (a pull's release, a push's confirmation) has ended: without it, a system
/// was timed beside the tail of whichever system preceded it in the rotation.
pub const LATENCY_GAP: Duration = Duration::from_millis(1);

use clap::{Args, ValueEnum};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use tpu_sync::arena::{ArenaOptions, PinnedArena};
use tpu_sync::layout::{ModelKv, ParallelLayout, ParallelSpec};
use tpu_sync::pattern::mix64;
use tpu_sync::pjrt::{Capabilities, Client, ClientOptions, DeviceBuffer, Plugin};
use tpu_sync::plan::Placement;
use tpu_sync::staging::Staging;
use tpu_sync::store::{BlockKey, KvStore, Namespace, StoreConfig};
use tpu_sync::util::fmt_bytes;
use tpu_sync::{Error, Result};

pub use net::{peer_main, PeerArgs};
use report::{median, quantile, LatRow, Report, Row};

/// What `tpu-sync bench` measures.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Scenario {
    /// Device to host: KV blocks through the PJRT plugin vs memcpy of the same bytes.
    D2h,
    /// Host to device in place: KV blocks through the PJRT plugin vs memcpy.
    H2d,
    /// Network pull and push, each transport, vs one raw TCP socket (separate process).
    Net,
    /// A resharding plan and an MLA fan-out vs a plain transfer of the same bytes.
    Reshard,
    /// p50/p99 of a 16 KiB block vs the raw socket's round trip.
    Latency,
    /// Host KV tier put/get/lookup vs memcpy.
    Store,
    /// Every scenario above, in this order.
    All,
}

impl Scenario {
    fn name(self) -> &'static str {
        match self {
            Scenario::D2h => "d2h",
            Scenario::H2d => "h2d",
            Scenario::Net => "net",
            Scenario::Reshard => "reshard",
            Scenario::Latency => "latency",
            Scenario::Store => "store",
            Scenario::All => "all",
        }
    }
}

/// Flags of `tpu-sync bench`.
#[derive(Args, Debug, Clone)]
pub struct BenchArgs {
    /// d2h, h2d, net, reshard, latency, store or all.
    #[arg(value_enum)]
    pub scenario: Scenario,
    /// Small sizes and two rounds: checks every system's bytes quickly (what `make test` runs).
    #[arg(long)]
    pub quick: bool,
    /// Measured rounds per system and size (default 7; 2 with --quick).
    #[arg(long)]
    pub rounds: Option<u32>,
    /// Warm-up operations per system and size before measuring (default 2; 1 with --quick).
    #[arg(long)]
    pub warmup: Option<u32>,
    /// A round repeats the operation until it lasts at least this many milliseconds (default
    /// 100; 5 with --quick).
    #[arg(long)]
    pub round_ms: Option<u64>,
    /// Transfer sizes of `net` (bytes; suffixes KiB, MiB), comma-separated (default
    /// 64KiB,1MiB,16MiB,64MiB; 64KiB,1MiB with --quick).
    #[arg(long, value_delimiter = ',')]
    pub sizes: Option<Vec<String>>,
    /// Transports of `net` and `latency`, comma-separated among tcp, tls, quic, shm.
    #[arg(long, value_delimiter = ',', default_value = "tcp,tls,quic,shm")]
    pub transports: Vec<String>,
    /// Parallel streams (lanes) per (source rank, destination rank) pair, as `--streams` of the
    /// prefill/decode commands.
    #[arg(long, default_value_t = 2)]
    pub streams: u32,
    /// Payload bytes per data frame (chunk), as `--chunk-bytes` of the prefill/decode commands.
    #[arg(long, default_value_t = 1 << 20)]
    pub chunk_bytes: u64,
    /// Layers of the model (llama-3.1-8b's shapes) each `net` request spans (default 1: a size
    /// is that many bytes of one layer). With more, every size must be a multiple of 4 KiB x
    /// layers (one token of every layer), pulls write each layer as it arrives
    /// (`Pipeline::pull_layerwise`, as the engines' layer-wise loads) and pushes stage by groups
    /// of layers: device copies overlap the network.
    #[arg(long, default_value_t = 1)]
    pub layers: u32,
    /// QUIC connections this process opens to the other one (the connecting side of every pull
    /// and push), as `EndpointOptions::quic_connections_per_peer`.
    #[arg(long, default_value_t = tpu_sync::net::quic::DEFAULT_CONNECTIONS_PER_PEER)]
    pub quic_connections: u32,
    /// Operations timed by `latency` per system (default 1000; 20 with --quick).
    #[arg(long)]
    pub samples: Option<u32>,
    /// Also write every figure to this JSON file.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Also plot throughput against size, one line per system, to this SVG file.
    #[arg(long)]
    pub plot: Option<PathBuf>,
    /// PJRT plugin shared library for d2h/h2d (default: $TPU_SYNC_PJRT_PLUGIN, else the one
    /// `make` installed).
    #[arg(long)]
    pub plugin: Option<PathBuf>,
    /// No progress bar (it is also hidden when stderr is not a terminal).
    #[arg(long)]
    pub no_progress: bool,
    /// Measure nothing: draw `--plot` from the throughput rows of this JSON file (a `--json`
    /// report, or the one benches/peers/run.sh writes).
    #[arg(long, hide = true)]
    pub replot: Option<PathBuf>,
}

/// How one run measures (from the flags).
pub(crate) struct Cfg {
    pub quick: bool,
    pub rounds: usize,
    pub warmup: u32,
    pub round: Duration,
    pub samples: usize,
    pub progress: bool,
}

/// One system of a scenario: `op(size_index, check)` runs one operation at that size; with
/// `check` it first clears the destination and afterwards verifies every byte it moved.
pub(crate) struct System<'a> {
    pub name: String,
    pub op: Box<dyn FnMut(usize, bool) -> Result<()> + 'a>,
}

impl<'a> System<'a> {
    pub fn new(name: impl Into<String>, op: impl FnMut(usize, bool) -> Result<()> + 'a) -> Self {
        System {
            name: name.into(),
            op: Box::new(op),
        }
    }
}

/// A size of a scenario: bytes one operation moves, and the plot's x value.
pub(crate) struct Size {
    pub bytes: u64,
    pub x: u64,
    pub label: String,
}

pub(crate) struct Bench {
    pub cfg: Cfg,
    pub report: Report,
}

impl Bench {
    fn bar(&self, len: u64, what: &str) -> ProgressBar {
        let pb = if self.cfg.progress {
            ProgressBar::with_draw_target(Some(len), ProgressDrawTarget::stderr())
        } else {
            ProgressBar::hidden()
        };
        if let Ok(s) = ProgressStyle::with_template(
            "{prefix:>8} [{bar:30}] {pos}/{len} {msg} ({elapsed}, eta {eta})",
        ) {
            pb.set_style(s.progress_chars("=> "));
        }
        pb.set_prefix(what.to_string());
        pb
    }

    /// Checks, warms up, calibrates and measures every system at every size, rounds
    /// interleaved round-robin; appends the rows and prints the scenario's table.
    pub fn measure(
        &mut self,
        scenario: &str,
        size_kind: &str,
        sizes: &[Size],
        systems: &mut [System<'_>],
        baseline: usize,
    ) -> Result<()> {
        let n = systems.len();
        let rounds = self.cfg.rounds;
        let pb = self.bar((sizes.len() * n * rounds) as u64, scenario);
        for (i, sz) in sizes.iter().enumerate() {
            for s in systems.iter_mut() {
                pb.set_message(format!("{} {}: checking bytes", s.name, sz.label));
                (s.op)(i, true).map_err(|e| {
                    e.context(format!(
                        "byte check of {scenario} {} at {}",
                        s.name, sz.label
                    ))
                })?;
            }
            let mut reps = vec![1u32; n];
            for (k, s) in systems.iter_mut().enumerate() {
                pb.set_message(format!("{} {}: warming up", s.name, sz.label));
                let mut best = f64::MAX;
                for _ in 0..self.cfg.warmup.max(1) {
                    let t = Instant::now();
                    (s.op)(i, false)
                        .map_err(|e| e.context(format!("{scenario} {} at {}", s.name, sz.label)))?;
                    best = best.min(t.elapsed().as_secs_f64());
                }
                reps[k] = (self.cfg.round.as_secs_f64() / best.max(1e-9))
                    .ceil()
                    .clamp(1.0, 100_000.0) as u32;
            }
            let mut samples: Vec<Vec<f64>> = vec![Vec::with_capacity(rounds); n];
            for r in 0..rounds {
                for j in 0..n {
                    let k = (j + r) % n;
                    let s = &mut systems[k];
                    pb.set_message(format!("{} {}", s.name, sz.label));
                    let t = Instant::now();
                    for _ in 0..reps[k] {
                        (s.op)(i, false).map_err(|e| {
                            e.context(format!("{scenario} {} at {}", s.name, sz.label))
                        })?;
                    }
                    samples[k].push(t.elapsed().as_secs_f64() / reps[k] as f64);
                    pb.inc(1);
                }
            }
            let mut med = vec![0.0; n];
            for (k, v) in samples.iter_mut().enumerate() {
                v.sort_by(f64::total_cmp);
                med[k] = median(v);
            }
            for (k, v) in samples.iter().enumerate() {
                let gb = sz.bytes as f64 / 1e9;
                self.report.throughput.push(Row {
                    scenario: scenario.into(),
                    system: systems[k].name.clone(),
                    baseline: systems[baseline].name.clone(),
                    size_kind: size_kind.into(),
                    size: sz.x,
                    size_label: sz.label.clone(),
                    bytes: sz.bytes,
                    rounds: v.len(),
                    reps: reps[k],
                    min_s: v[0],
                    median_s: med[k],
                    max_s: v[v.len() - 1],
                    gbps: gb / med[k],
                    gbps_min: gb / v[v.len() - 1],
                    gbps_max: gb / v[0],
                    ratio: med[baseline] / med[k],
                });
            }
        }
        pb.finish_and_clear();
        self.report.print_throughput(scenario);
        Ok(())
    }

    /// Times `samples` single operations per system, interleaved one by one (the systems' order
    /// rotated every round, [`LATENCY_GAP`] of quiet before each); appends p50/p99.
    pub fn measure_latency(
        &mut self,
        scenario: &str,
        bytes: u64,
        systems: &mut [System<'_>],
        baseline: Option<usize>,
    ) -> Result<()> {
        let n = systems.len();
        let samples = self.cfg.samples;
        for s in systems.iter_mut() {
            (s.op)(0, true)
                .map_err(|e| e.context(format!("byte check of {scenario} {}", s.name)))?;
            for _ in 0..self.cfg.warmup.max(1) * 10 {
                (s.op)(0, false)?;
            }
        }
        let pb = self.bar((samples * n) as u64, scenario);
        let mut t: Vec<Vec<f64>> = vec![Vec::with_capacity(samples); n];
        for r in 0..samples {
            for j in 0..n {
                let k = (j + r) % n;
                // Each operation starts on a quiet machine: what the previous one left running
                // (a pull's release, a push's confirmation in the other process) ends first,
                // so no system is timed beside another's tail.
                std::thread::sleep(LATENCY_GAP);
                let t0 = Instant::now();
                (systems[k].op)(0, false)
                    .map_err(|e| e.context(format!("{scenario} {}", systems[k].name)))?;
                t[k].push(t0.elapsed().as_secs_f64() * 1e6);
            }
            pb.inc(n as u64);
        }
        pb.finish_and_clear();
        for v in t.iter_mut() {
            v.sort_by(f64::total_cmp);
        }
        let base_p50 = baseline.map(|b| median(&t[b]));
        for (k, v) in t.iter().enumerate() {
            let p50 = median(v);
            self.report.latency.push(LatRow {
                scenario: scenario.into(),
                system: systems[k].name.clone(),
                baseline: baseline.map(|b| systems[b].name.clone()),
                bytes,
                samples: v.len(),
                p50_us: p50,
                p99_us: quantile(v, 0.99),
                min_us: v[0],
                max_us: v[v.len() - 1],
                p50_ratio: base_p50.map(|b| p50 / b),
            });
        }
        self.report.print_latency(scenario);
        Ok(())
    }

    fn describe(&mut self, scenario: &str, what: &str) {
        outln!("\n== {scenario}: {what}");
        self.report
            .scenarios
            .push((scenario.to_string(), what.to_string()));
    }
}

/// `tpu-sync bench`.
pub fn run(a: &BenchArgs) -> Result<ExitCode> {
    let q = a.quick;
    let cfg = Cfg {
        quick: q,
        rounds: a.rounds.unwrap_or(if q { 2 } else { 7 }).max(1) as usize,
        warmup: a.warmup.unwrap_or(if q { 1 } else { 2 }),
        round: Duration::from_millis(a.round_ms.unwrap_or(if q { 5 } else { 100 })),
        samples: a.samples.unwrap_or(if q { 20 } else { 1000 }).max(1) as usize,
        progress: !a.no_progress,
    };
    for t in &a.transports {
        tpu_sync::net::TransportKind::parse(t)?;
    }
    if a.layers == 0 || a.layers > 1024 {
        return Err(Error::InvalidArgument(format!(
            "--layers {}: must be 1 to 1024",
            a.layers
        )));
    }
    if a.streams == 0 || a.streams > tpu_sync::wire::MAX_STRIPES {
        return Err(Error::InvalidArgument(format!(
            "--streams {}: must be 1 to {}",
            a.streams,
            tpu_sync::wire::MAX_STRIPES
        )));
    }
    if a.chunk_bytes == 0 || a.chunk_bytes > tpu_sync::wire::MAX_DATA_PAYLOAD as u64 {
        return Err(Error::InvalidArgument(format!(
            "--chunk-bytes {}: must be 1 to {}",
            a.chunk_bytes,
            tpu_sync::wire::MAX_DATA_PAYLOAD
        )));
    }
    let net_sizes = match &a.sizes {
        Some(v) => v
            .iter()
            .map(|s| parse_size(s))
            .collect::<Result<Vec<u64>>>()?,
        None if q => vec![64 << 10, 1 << 20],
        None => vec![64 << 10, 1 << 20, 16 << 20, 64 << 20],
    };
    if let Some(p) = &a.json {
        check_writable(p, "--json")?;
    }
    if let Some(p) = &a.plot {
        check_writable(p, "--plot")?;
    }
    let mut b = Bench {
        cfg,
        report: Report::new(a.scenario.name(), q),
    };
    if let Some(j) = &a.replot {
        let text = std::fs::read_to_string(j)
            .map_err(|e| Error::io(format!("read {}", j.display()), e))?;
        let v: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| Error::InvalidArgument(format!("{}: {e}", j.display())))?;
        b.report.throughput = serde_json::from_value(v["throughput"].clone()).map_err(|e| {
            Error::InvalidArgument(format!("{}: throughput rows: {e}", j.display()))
        })?;
        b.report.scenarios = serde_json::from_value(v["scenarios"].clone()).unwrap_or_default();
        let Some(p) = &a.plot else {
            return Err(Error::InvalidArgument(
                "--replot needs --plot FILE.svg".into(),
            ));
        };
        b.report.write_svg(p)?;
        outln!("wrote {}", p.display());
        return Ok(ExitCode::SUCCESS);
    }
    let m = &b.report.machine;
    outln!(
        "tpu-sync bench {}{}: {} ({} CPUs), kernel {}, load {:.2}",
        a.scenario.name(),
        if q { " --quick" } else { "" },
        m.cpu,
        m.cpus,
        m.kernel,
        m.load_start
    );
    let all = a.scenario == Scenario::All;
    let t0 = Instant::now();
    if all || a.scenario == Scenario::D2h {
        device_scenario(&mut b, a, true)?;
    }
    if all || a.scenario == Scenario::H2d {
        device_scenario(&mut b, a, false)?;
    }
    if all
        || matches!(
            a.scenario,
            Scenario::Net | Scenario::Reshard | Scenario::Latency
        )
    {
        let mut peer = net::Peer::spawn(a, *net_sizes.iter().max().unwrap_or(&(1 << 20)))?;
        if all || a.scenario == Scenario::Net {
            net::net_scenario(&mut b, a, &mut peer, &net_sizes)?;
        }
        if all || a.scenario == Scenario::Reshard {
            net::reshard_scenario(&mut b, a, &mut peer)?;
        }
        if all || a.scenario == Scenario::Latency {
            net::latency_scenario(&mut b, a, &mut peer)?;
        }
        peer.quit()?;
    }
    if all || a.scenario == Scenario::Store {
        store_scenario(&mut b)?;
    }
    b.report.machine.load_end = report::loadavg();
    outln!(
        "\ndone in {:.1} s; load average {:.2} -> {:.2} (other processes share these CPUs: \
         compare ratios, not absolute GB/s)",
        t0.elapsed().as_secs_f64(),
        b.report.machine.load_start,
        b.report.machine.load_end
    );
    if let Some(p) = &a.json {
        b.report.write_json(p)?;
        outln!("wrote {}", p.display());
    }
    if let Some(p) = &a.plot {
        b.report.write_svg(p)?;
        outln!("wrote {}", p.display());
    }
    Ok(ExitCode::SUCCESS)
}

fn check_writable(p: &std::path::Path, flag: &str) -> Result<()> {
    let dir = p
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(std::path::Path::new("."));
    if !dir.is_dir() {
        return Err(Error::InvalidArgument(format!(
            "{flag} {}: directory {} does not exist",
            p.display(),
            dir.display()
        )));
    }
    Ok(())
}

/// Parses `65536`, `64KiB`, `64K`, `16MiB`, `1GiB`.
pub(crate) fn parse_size(s: &str) -> Result<u64> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: u64 = num
        .parse()
        .map_err(|_| Error::InvalidArgument(format!("size `{s}`: expected a number of bytes")))?;
    let mult = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kib" | "kb" => 1 << 10,
        "m" | "mib" | "mb" => 1 << 20,
        "g" | "gib" | "gb" => 1 << 30,
        u => {
            return Err(Error::InvalidArgument(format!(
                "size `{s}`: unknown unit `{u}` (B, KiB, MiB, GiB)"
            )))
        }
    };
    let v = n
        .checked_mul(mult)
        .filter(|&v| v > 0)
        .ok_or_else(|| Error::InvalidArgument(format!("size `{s}`: must be 1 byte to 2^64")))?;
    Ok(v)
}

/// Fills `buf` with non-zero, non-repeating bytes derived from `seed` and the position.
pub(crate) fn fill_pattern(buf: &mut [u8], seed: u64) {
    for (i, c) in buf.chunks_mut(8).enumerate() {
        let v = mix64(seed ^ (i as u64).wrapping_mul(0x9E37_79B9)) | 1;
        c.copy_from_slice(&v.to_le_bytes()[..c.len()]);
    }
}

/// Where the first difference between `got` and `want` is (for error messages).
pub(crate) fn first_diff(got: &[u8], want: &[u8]) -> Option<usize> {
    if got == want {
        return None;
    }
    Some(
        got.iter()
            .zip(want)
            .position(|(a, b)| a != b)
            .unwrap_or(got.len().min(want.len())),
    )
}

fn arena_opts() -> ArenaOptions {
    ArenaOptions::default()
}

/// d2h or h2d: KV blocks of `layers` layers through the PJRT plugin between device buffers and a
/// pinned staging arena (the same `Staging` calls as the prefill/decode commands), against
/// `memcpy` of the same pieces between a host mirror of the buffers and the same arena.
fn device_scenario(b: &mut Bench, a: &BenchArgs, d2h: bool) -> Result<()> {
    let scn = if d2h { "d2h" } else { "h2d" };
    let q = b.cfg.quick;
    let plugin = match &a.plugin {
        Some(p) => Plugin::load(p)?,
        None => Plugin::load_default()?,
    };
    let client = Client::create(
        &plugin,
        &ClientOptions {
            cpu_device_count: Some(1),
        },
    )?;
    let caps = Capabilities::probe(&client)?;
    let (total, layers) = if q {
        (4u64 << 20, 2u32)
    } else {
        (64u64 << 20, 8u32)
    };
    let block_tokens: &[u32] = if q { &[16, 64] } else { &[4, 16, 64, 256] };
    let mut model = ModelKv::preset("llama-3.1-8b")?;
    model.num_layers = layers;
    let row = 8 * 128 * 2u64; // 8 KV heads x 128 x bf16: bytes per token per plane
    b.describe(
        scn,
        &format!(
            "{} of {} per op (llama-3.1-8b blocks, {layers} layers x K/V, every other block \
             of the buffer, so no two pieces are adjacent) through {} ({}), vs memcpy of the \
             same pieces; x = bytes per piece (one block of one plane)",
            if d2h {
                "D2H of KV blocks into pinned staging (Staging::fill_from_device)"
            } else {
                "in-place H2D of staged KV blocks (Staging::drain_to_device)"
            },
            fmt_bytes(total),
            caps.platform,
            if d2h {
                caps.d2h.to_string()
            } else {
                caps.h2d.to_string()
            }
        ),
    );
    let dev = client.device(0)?;
    struct DevCase {
        buffers: Vec<DeviceBuffer>,
        mirror: PinnedArena,
        staging: Staging,
        buf_bytes: u64,
    }
    let mut cases = Vec::new();
    let mut sizes = Vec::new();
    for &bt in block_tokens {
        let piece = bt as u64 * row;
        let req_blocks = (total / (layers as u64 * 2 * piece)).max(1) as u32;
        let num_blocks = req_blocks * 2 + 1;
        let spec = ParallelSpec::parse(&format!("tp=1,block={bt}"))?;
        let layout = ParallelLayout::new(model.clone(), spec, num_blocks)?;
        let kv = layout.rank_kv()?;
        // Every other block, in reverse order: scattered like a real request.
        let ids: Vec<u32> = (0..req_blocks).rev().map(|i| i * 2 + 1).collect();
        let place = Placement {
            first_token: 0,
            layout,
            dp_rank: 0,
            block_ids: vec![ids],
            groups: None,
        };
        let buf_bytes = kv.buffer_bytes();
        let mirror = PinnedArena::new((buf_bytes * layers as u64) as usize, &arena_opts())?;
        // SAFETY: the mirror was just created and nothing else references it.
        let m = unsafe { mirror.slice_mut(0, mirror.len() as u64) }?;
        fill_pattern(m, 0xd2 + bt as u64);
        let buffers = (0..layers as u64)
            .map(|l| {
                client.buffer_from_host(
                    &m[(l * buf_bytes) as usize..((l + 1) * buf_bytes) as usize],
                    kv.dtype.element_type(),
                    &kv.dims(),
                    &dev,
                )
            })
            .collect::<Result<Vec<_>>>()?;
        let ranges = [(0u32, place.block_ranges(0))].into_iter().collect();
        let staging = Staging::new(ranges, &arena_opts())?;
        let moved = staging.total_bytes();
        sizes.push(Size {
            bytes: moved,
            x: piece,
            label: fmt_bytes(piece),
        });
        cases.push(DevCase {
            buffers,
            mirror,
            staging,
            buf_bytes,
        });
    }
    let cases = &cases;
    // memcpy between the mirror (the device bytes' host copy) and the staging regions.
    let memcpy = |c: &DevCase, to_staging: bool| {
        for s in c.staging.ranges(0) {
            let m = c.buf_bytes * s.range.buffer as u64 + s.range.offset;
            // SAFETY: both ranges are inside their arenas (the staging was built from the
            // buffers' block ranges, and the mirror holds every layer buffer); distinct
            // mappings; no other thread touches them during the benchmark.
            unsafe {
                let st = c.staging.arena().base().add(s.region.offset as usize);
                let mi = c.mirror.base().add(m as usize);
                if to_staging {
                    std::ptr::copy_nonoverlapping(mi, st, s.range.len as usize);
                } else {
                    std::ptr::copy_nonoverlapping(st, mi, s.range.len as usize);
                }
            }
        }
    };
    // The staged regions must hold the mirror's bytes of their device ranges (XOR `flip`).
    let verify_staging = |c: &DevCase, flip: u8| -> Result<()> {
        for s in c.staging.ranges(0) {
            let m = c.buf_bytes * s.range.buffer as u64 + s.range.offset;
            // SAFETY: in bounds (as above); no copy runs now.
            let (got, want) = unsafe {
                (
                    c.staging.arena().slice(s.region.offset, s.range.len)?,
                    c.mirror.slice(m, s.range.len)?,
                )
            };
            if let Some(i) = got.iter().zip(want).position(|(g, w)| *g != *w ^ flip) {
                return Err(Error::Mismatch(format!(
                    "layer {} device byte {}: staged {:#04x}, expected {:#04x}",
                    s.range.buffer,
                    s.range.offset + i as u64,
                    got[i],
                    want[i] ^ flip
                )));
            }
        }
        Ok(())
    };
    let clear = |c: &DevCase, v: u8| {
        for s in c.staging.ranges(0) {
            // SAFETY: the region is inside the arena; no copy runs now.
            unsafe {
                std::ptr::write_bytes(
                    c.staging.arena().base().add(s.region.offset as usize),
                    v,
                    s.range.len as usize,
                )
            };
        }
    };
    let mut systems = Vec::new();
    if d2h {
        systems.push(System::new("memcpy", |i, check| {
            let c = &cases[i];
            if check {
                clear(c, 0);
            }
            memcpy(c, true);
            if check {
                verify_staging(c, 0)?;
            }
            Ok(())
        }));
        // Every D2H path the plugin offers: the probed default (host-addressable memory is
        // read with memcpy on the copy engine's workers), and PJRT_Buffer_CopyRawToHost.
        let host_path = tpu_sync::device::d2h_host_addressable();
        for (name, host) in [
            ("tpu-sync d2h", host_path),
            ("tpu-sync d2h (CopyRawToHost)", false),
        ] {
            if name != "tpu-sync d2h" && !host_path {
                continue;
            }
            systems.push(System::new(name, move |i, check| {
                let c = &cases[i];
                if check {
                    clear(c, 0);
                }
                tpu_sync::device::set_d2h_host_addressable(host);
                let r = c.staging.fill_from_device(0, &c.buffers, 256);
                tpu_sync::device::set_d2h_host_addressable(host_path);
                r?;
                if check {
                    verify_staging(c, 0)?;
                }
                Ok(())
            }));
        }
    } else {
        for c in cases {
            memcpy(c, true);
        }
        systems.push(System::new("memcpy", |i, _check| {
            // Writes the mirror with the bytes it already holds (checked by the d2h side).
            memcpy(&cases[i], false);
            Ok(())
        }));
        let caps = &caps;
        systems.push(System::new("tpu-sync h2d", move |i, check| {
            let c = &cases[i];
            if !check {
                c.staging.drain_to_device(caps, 0, &c.buffers)?;
                return Ok(());
            }
            // Write the complement of the staged bytes, read every buffer back whole, check
            // that exactly the staged ranges changed, then put the original bytes back.
            for s in c.staging.ranges(0) {
                // SAFETY: inside the arena; no copy runs now.
                let r = unsafe { c.staging.arena().slice_mut(s.region.offset, s.range.len)? };
                r.iter_mut().for_each(|x| *x = !*x);
            }
            c.staging.drain_to_device(caps, 0, &c.buffers)?;
            let back = PinnedArena::new(c.mirror.len(), &arena_opts())?;
            let ops = c
                .buffers
                .iter()
                .enumerate()
                .map(|(l, buf)| {
                    Ok(tpu_sync::device::RawCopy {
                        buffer: buf,
                        offset: 0,
                        len: c.buf_bytes,
                        host: back.ptr_at(l as u64 * c.buf_bytes, c.buf_bytes)?,
                    })
                })
                .collect::<Result<Vec<_>>>()?;
            // SAFETY: `back` outlives the call and nobody else touches it.
            unsafe { tpu_sync::device::d2h_batch(&ops, 0) }?;
            // SAFETY: no copy runs now; both arenas have the mirror's length.
            let (got, mirror) = unsafe {
                (
                    back.slice(0, back.len() as u64)?,
                    c.mirror.slice(0, c.mirror.len() as u64)?,
                )
            };
            let mut want = mirror.to_vec();
            for s in c.staging.ranges(0) {
                let m = (c.buf_bytes * s.range.buffer as u64 + s.range.offset) as usize;
                want[m..m + s.range.len as usize]
                    .iter_mut()
                    .for_each(|x| *x = !*x);
            }
            if let Some(i) = first_diff(got, &want) {
                return Err(Error::Mismatch(format!(
                    "after H2D, layer {} device byte {} is {:#04x}, expected {:#04x}",
                    i as u64 / c.buf_bytes,
                    i as u64 % c.buf_bytes,
                    got[i],
                    want[i]
                )));
            }
            memcpy(c, true);
            c.staging.drain_to_device(caps, 0, &c.buffers)?;
            Ok(())
        }));
    }
    let r = b.measure(scn, "block", &sizes, &mut systems, 0);
    drop(systems);
    r?;
    let st = tpu_sync::device::Pacer::global().stats();
    b.report.note(
        scn,
        "global pacer",
        format!(
            "{} chunks, {} batches, peak in flight {} (limit {}, chunk {})",
            st.chunks,
            st.batches,
            fmt_bytes(st.peak_inflight_bytes),
            fmt_bytes(st.config.max_inflight_bytes),
            fmt_bytes(st.config.chunk_bytes)
        ),
    );
    Ok(())
}

fn store_ns() -> Namespace {
    Namespace::new("tpu-sync bench llama-3.1-8b bf16 tp=1")
}

fn chain(seed: u64, n: usize) -> Vec<BlockKey> {
    let toks: Vec<u32> = (0..n as u64 * 16)
        .map(|i| mix64((seed << 32) ^ i) as u32)
        .collect();
    store_ns().chain_keys(&toks, 16)
}

/// store: the host KV tier (pinned DRAM slots) put and get of whole chains against `memcpy` of
/// the same blocks from the same kind of memory, and lookup latency.
fn store_scenario(b: &mut Bench) -> Result<()> {
    let q = b.cfg.quick;
    let total: u64 = if q { 2 << 20 } else { 64 << 20 };
    let block_sizes: &[u64] = if q {
        &[64 << 10, 256 << 10]
    } else {
        &[16 << 10, 64 << 10, 256 << 10, 1 << 20]
    };
    b.describe(
        "store",
        &format!(
            "host KV tier, {} per op: put_from_host (copy + xxh3 + commit; evicting the previous \
             chain), get_to_host with and without checksum verification, vs memcpy of the same \
             blocks from pinned memory into the same destinations; x = block size",
            fmt_bytes(total)
        ),
    );
    struct StoreCase {
        n: usize,
        block: usize,
        src: Vec<Vec<u8>>,
        src_arena: PinnedArena,
        dst: std::cell::RefCell<Vec<Vec<u8>>>,
        verify: KvStore,
        noverify: KvStore,
        scratch: KvStore,
        resident: Vec<BlockKey>,
        round: std::cell::Cell<u64>,
    }
    let open = |block: u64, verify: bool| -> Result<KvStore> {
        let mut cfg = StoreConfig::new(store_ns(), block, total);
        cfg.memory = arena_opts();
        cfg.verify_checksums = verify;
        KvStore::open(cfg)
    };
    let mut cases = Vec::new();
    let mut sizes = Vec::new();
    for (ci, &bs) in block_sizes.iter().enumerate() {
        let n = (total / bs) as usize;
        let src: Vec<Vec<u8>> = (0..n)
            .map(|i| {
                let mut v = vec![0u8; bs as usize];
                fill_pattern(&mut v, (ci as u64) << 40 | i as u64);
                v
            })
            .collect();
        let src_arena = PinnedArena::new(total as usize, &arena_opts())?;
        for (i, s) in src.iter().enumerate() {
            // SAFETY: exclusive during setup; in bounds (n * bs == total).
            unsafe { src_arena.slice_mut(i as u64 * bs, bs)? }.copy_from_slice(s);
        }
        let verify = open(bs, true)?;
        let noverify = open(bs, false)?;
        let scratch = open(bs, true)?;
        let resident = chain(ci as u64 + 1, n);
        let refs: Vec<&[u8]> = src.iter().map(|v| v.as_slice()).collect();
        for s in [&verify, &noverify] {
            let r = s.put_from_host(None, &resident, &refs)?;
            if !r.complete() {
                return Err(Error::HostMemory(format!(
                    "store of {} did not take {n} blocks of {}: {r:?}",
                    fmt_bytes(total),
                    fmt_bytes(bs)
                )));
            }
        }
        sizes.push(Size {
            bytes: total,
            x: bs,
            label: fmt_bytes(bs),
        });
        cases.push(StoreCase {
            n,
            block: bs as usize,
            src,
            src_arena,
            dst: std::cell::RefCell::new((0..n).map(|_| vec![0u8; bs as usize]).collect()),
            verify,
            noverify,
            scratch,
            resident,
            round: std::cell::Cell::new(1000),
        });
    }
    let cases = &cases;
    let check_dst = |c: &StoreCase| -> Result<()> {
        for (i, (d, s)) in c.dst.borrow().iter().zip(&c.src).enumerate() {
            if let Some(at) = first_diff(d, s) {
                return Err(Error::Mismatch(format!(
                    "block {i} byte {at}: got {:#04x}, stored {:#04x}",
                    d[at], s[at]
                )));
            }
        }
        Ok(())
    };
    let clear_dst = |c: &StoreCase| c.dst.borrow_mut().iter_mut().for_each(|d| d.fill(0));
    let get = |c: &StoreCase, s: &KvStore, check: bool| -> Result<()> {
        if check {
            clear_dst(c);
        }
        let mut dst = c.dst.borrow_mut();
        let mut d: Vec<&mut [u8]> = dst.iter_mut().map(|v| v.as_mut_slice()).collect();
        let r = s.get_to_host(&c.resident, &mut d)?;
        drop(d);
        drop(dst);
        if r.delivered != c.n {
            return Err(Error::Mismatch(format!(
                "get delivered {} of {} blocks",
                r.delivered, c.n
            )));
        }
        if check {
            check_dst(c)?;
        }
        Ok(())
    };
    let mut systems = vec![
        System::new("memcpy", |i, check| {
            let c = &cases[i];
            if check {
                clear_dst(c);
            }
            for (k, d) in c.dst.borrow_mut().iter_mut().enumerate() {
                // SAFETY: nobody writes the source arena while the benchmark reads it.
                d.copy_from_slice(unsafe {
                    c.src_arena.slice((k * c.block) as u64, c.block as u64)?
                });
            }
            std::hint::black_box(&c.dst);
            if check {
                check_dst(c)?;
            }
            Ok(())
        }),
        System::new("put", |i, check| {
            let c = &cases[i];
            c.round.set(c.round.get() + 1);
            let keys = chain(c.round.get() << 8 | i as u64, c.n);
            let refs: Vec<&[u8]> = c.src.iter().map(|v| v.as_slice()).collect();
            let r = c.scratch.put_from_host(None, &keys, &refs)?;
            if r.stored != c.n {
                return Err(Error::Mismatch(format!(
                    "put stored {} of {} blocks ({r:?})",
                    r.stored, c.n
                )));
            }
            if check {
                clear_dst(c);
                let mut dst = c.dst.borrow_mut();
                let mut d: Vec<&mut [u8]> = dst.iter_mut().map(|v| v.as_mut_slice()).collect();
                let g = c.scratch.get_to_host(&keys, &mut d)?;
                drop(d);
                drop(dst);
                if g.delivered != c.n {
                    return Err(Error::Mismatch(format!(
                        "{} of {} blocks put could be read back",
                        g.delivered, c.n
                    )));
                }
                check_dst(c)?;
            }
            Ok(())
        }),
        System::new("get (verify xxh3)", |i, check| {
            get(&cases[i], &cases[i].verify, check)
        }),
        System::new("get (no verify)", |i, check| {
            get(&cases[i], &cases[i].noverify, check)
        }),
    ];
    b.measure("store", "block", &sizes, &mut systems, 0)?;
    drop(systems);

    // Lookups with many resident blocks.
    let chains: u64 = if q { 32 } else { 2048 };
    let per = 128usize;
    let mut cfg = StoreConfig::new(store_ns(), 64, 64 * chains * per as u64);
    cfg.memory = ArenaOptions {
        lock: false,
        huge_pages: true,
        populate: true,
    };
    let st = KvStore::open(cfg)?;
    let data = [7u8; 64];
    let blocks: Vec<&[u8]> = (0..per).map(|_| &data[..]).collect();
    for ch in 0..chains {
        let r = st.put_from_host(None, &chain(1_000_000 + ch, per), &blocks)?;
        if !r.complete() {
            return Err(Error::HostMemory(format!("lookup store: {r:?}")));
        }
    }
    let probe: Vec<Vec<BlockKey>> = (0..64)
        .map(|i| chain(1_000_000 + (i * 97) % chains, per))
        .collect();
    let missing = chain(7, per);
    let k = std::cell::Cell::new(0usize);
    let expect = |got: usize, want: usize| -> Result<()> {
        if got != want {
            return Err(Error::Mismatch(format!(
                "lookup found {got}, expected {want}"
            )));
        }
        Ok(())
    };
    let st = &st;
    let probe = &probe;
    let mut lsys = vec![
        System::new(format!("lookup chain of {per}"), |_, _| {
            k.set((k.get() + 1) % probe.len());
            expect(st.lookup(&probe[k.get()]), per)
        }),
        System::new("lookup first block", |_, _| {
            k.set((k.get() + 1) % probe.len());
            expect(st.lookup(&probe[k.get()][..1]), 1)
        }),
        System::new("lookup miss", |_, _| expect(st.lookup(&missing), 0)),
    ];
    outln!(
        "  lookups with {} resident blocks ({} chains of {per}):",
        chains * per as u64,
        chains
    );
    b.measure_latency("store", 0, &mut lsys, None)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse() {
        assert_eq!(parse_size("65536").unwrap(), 65536);
        assert_eq!(parse_size("64KiB").unwrap(), 64 << 10);
        assert_eq!(parse_size("16M").unwrap(), 16 << 20);
        assert!(parse_size("0").is_err());
        assert!(parse_size("12 parsecs").is_err());
        assert!(parse_size("").is_err());
    }
}
