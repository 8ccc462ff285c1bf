//! What `tpu-sync bench` reports: throughput and latency rows, the table on stdout, the JSON
//! file and the SVG plot (plotters, SVG backend: throughput against block size, one line per
//! system, one panel per scenario).

use std::path::Path;

use serde::{Deserialize, Serialize};
use tpu_sync::util::fmt_bytes;
use tpu_sync::{Error, Result};

/// One (scenario, system, size) throughput measurement: the time of one operation over the
/// measured rounds, and its throughput relative to the scenario's baseline at the same size.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Row {
    /// Scenario (`d2h`, `h2d`, `net`, `reshard`, `store`).
    pub scenario: String,
    /// The system measured (`memcpy`, `pull_tcp`, ...).
    pub system: String,
    /// The baseline system of the scenario.
    pub baseline: String,
    /// What the size is (`block` for piece sizes, `transfer` for request sizes, `tokens`).
    pub size_kind: String,
    /// The size (bytes, or tokens for `size_kind == "tokens"`): the plot's x axis.
    pub size: u64,
    /// The size as printed.
    pub size_label: String,
    /// Bytes one operation moves (the same for every system of a size).
    pub bytes: u64,
    /// Measured rounds (samples).
    pub rounds: usize,
    /// Operations per round (a round lasts at least `--round-ms`).
    pub reps: u32,
    /// Fastest, median and slowest round, seconds per operation.
    pub min_s: f64,
    /// Median round, seconds per operation.
    pub median_s: f64,
    /// Slowest round, seconds per operation.
    pub max_s: f64,
    /// Throughput of the median round, GB/s (1e9 bytes per second).
    pub gbps: f64,
    /// Throughput of the slowest round, GB/s.
    pub gbps_min: f64,
    /// Throughput of the fastest round, GB/s.
    pub gbps_max: f64,
    /// Median throughput / the baseline's median throughput in this run (1.00 = baseline).
    pub ratio: f64,
}

/// One latency measurement: percentiles of single operations, interleaved with the baseline.
#[derive(Debug, Clone, Serialize)]
pub struct LatRow {
    /// Scenario.
    pub scenario: String,
    /// The system measured.
    pub system: String,
    /// The baseline system (`None`: no baseline, e.g. store lookups).
    pub baseline: Option<String>,
    /// Bytes one operation moves.
    pub bytes: u64,
    /// Operations timed.
    pub samples: usize,
    /// Percentiles, microseconds.
    pub p50_us: f64,
    /// 99th percentile, microseconds.
    pub p99_us: f64,
    /// Fastest, microseconds.
    pub min_us: f64,
    /// Slowest, microseconds.
    pub max_us: f64,
    /// p50 / the baseline's p50 (`None` without a baseline).
    pub p50_ratio: Option<f64>,
}

/// A figure that is neither a throughput nor a latency (bytes on the wire per request byte,
/// pacer counters, paths used).
#[derive(Debug, Clone, Serialize)]
pub struct Note {
    /// Scenario.
    pub scenario: String,
    /// What it is.
    pub what: String,
    /// Its value, as printed.
    pub value: String,
}

/// The machine and the run.
#[derive(Debug, Clone, Serialize)]
pub struct Machine {
    /// CPU model (`/proc/cpuinfo`).
    pub cpu: String,
    /// CPUs this process may use.
    pub cpus: usize,
    /// Kernel release.
    pub kernel: String,
    /// Memory, bytes (`/proc/meminfo` MemTotal).
    pub mem_bytes: u64,
    /// Load average (1 min) at the start and the end of the run.
    pub load_start: f64,
    /// Load average (1 min) at the end.
    pub load_end: f64,
}

impl Machine {
    pub fn probe() -> Machine {
        let cpu = std::fs::read_to_string("/proc/cpuinfo")
            .ok()
            .and_then(|s| {
                s.lines()
                    .find(|l| l.starts_with("model name"))
                    .and_then(|l| l.split(':').nth(1))
                    .map(|s| s.trim().to_string())
            })
            .unwrap_or_else(|| "unknown".into());
        let mem_bytes = std::fs::read_to_string("/proc/meminfo")
            .ok()
            .and_then(|s| {
                s.lines()
                    .find(|l| l.starts_with("MemTotal:"))
                    .and_then(|l| l.split_whitespace().nth(1))
                    .and_then(|v| v.parse::<u64>().ok())
            })
            .unwrap_or(0)
            * 1024;
        Machine {
            cpu,
            cpus: std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1),
            kernel: std::fs::read_to_string("/proc/sys/kernel/osrelease")
                .map(|s| s.trim().to_string())
                .unwrap_or_default(),
            mem_bytes,
            load_start: loadavg(),
            load_end: 0.0,
        }
    }
}

/// The 1-minute load average (0 when unknown).
pub fn loadavg() -> f64 {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next().and_then(|v| v.parse().ok()))
        .unwrap_or(0.0)
}

/// Everything one run measured (the `--json` file).
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// `tpu-sync bench` and its version.
    pub tool: String,
    /// The command line's scenario.
    pub scenario: String,
    /// `--quick`.
    pub quick: bool,
    /// The machine.
    pub machine: Machine,
    /// What each scenario compares (scenario, description).
    pub scenarios: Vec<(String, String)>,
    /// Throughput rows.
    pub throughput: Vec<Row>,
    /// Latency rows.
    pub latency: Vec<LatRow>,
    /// Other figures.
    pub notes: Vec<Note>,
}

impl Report {
    pub fn new(scenario: &str, quick: bool) -> Report {
        Report {
            tool: format!("tpu-sync bench {}", env!("CARGO_PKG_VERSION")),
            scenario: scenario.into(),
            quick,
            machine: Machine::probe(),
            scenarios: Vec::new(),
            throughput: Vec::new(),
            latency: Vec::new(),
            notes: Vec::new(),
        }
    }

    pub fn note(&mut self, scenario: &str, what: impl Into<String>, value: impl Into<String>) {
        let n = Note {
            scenario: scenario.into(),
            what: what.into(),
            value: value.into(),
        };
        outln!("  {}: {}", n.what, n.value);
        self.notes.push(n);
    }

    /// Prints the throughput rows of `scenario` as a table (one line per size and system).
    pub fn print_throughput(&self, scenario: &str) {
        let rows: Vec<&Row> = self
            .throughput
            .iter()
            .filter(|r| r.scenario == scenario)
            .collect();
        let Some(first) = rows.first() else { return };
        let w = rows
            .iter()
            .map(|r| r.system.len())
            .max()
            .unwrap_or(6)
            .max(6);
        outln!(
            "  {:<10} {:<w$} {:>9} {:>9} {:>9}  {:>6}  {:>5} x {:<5}",
            first.size_kind,
            "system",
            "GB/s",
            "min",
            "max",
            "ratio",
            "rounds",
            "ops"
        );
        let mut last = u64::MAX;
        for r in rows {
            let label = if r.size != last {
                r.size_label.clone()
            } else {
                String::new()
            };
            last = r.size;
            let ratio = if r.system == r.baseline {
                "  base".to_string()
            } else {
                format!("{:6.2}", r.ratio)
            };
            outln!(
                "  {:<10} {:<w$} {:>9.3} {:>9.3} {:>9.3}  {}  {:>5} x {:<5}",
                label,
                r.system,
                r.gbps,
                r.gbps_min,
                r.gbps_max,
                ratio,
                r.rounds,
                r.reps
            );
        }
    }

    /// Prints the latency rows of `scenario`.
    pub fn print_latency(&self, scenario: &str) {
        let rows: Vec<&LatRow> = self
            .latency
            .iter()
            .filter(|r| r.scenario == scenario)
            .collect();
        if rows.is_empty() {
            return;
        }
        let w = rows
            .iter()
            .map(|r| r.system.len())
            .max()
            .unwrap_or(6)
            .max(6);
        outln!(
            "  {:<w$} {:>9} {:>10} {:>10} {:>10} {:>10}  {:>9}  {:>7}",
            "system",
            "bytes",
            "p50 us",
            "p99 us",
            "min us",
            "max us",
            "p50/base",
            "samples"
        );
        for r in rows {
            let ratio = match (&r.baseline, r.p50_ratio) {
                (Some(b), _) if *b == r.system => "     base".to_string(),
                (_, Some(x)) => format!("{x:9.2}"),
                _ => "        -".to_string(),
            };
            outln!(
                "  {:<w$} {:>9} {:>10.1} {:>10.1} {:>10.1} {:>10.1}  {}  {:>7}",
                r.system,
                fmt_bytes(r.bytes),
                r.p50_us,
                r.p99_us,
                r.min_us,
                r.max_us,
                ratio,
                r.samples
            );
        }
    }

    pub fn write_json(&self, path: &Path) -> Result<()> {
        let s = serde_json::to_string_pretty(self)
            .map_err(|e| Error::InvalidArgument(format!("report to JSON: {e}")))?;
        std::fs::write(path, s + "\n")
            .map_err(|e| Error::io(format!("write {}", path.display()), e))
    }

    /// Writes the SVG: one panel per scenario with throughput rows, GB/s (median, with the
    /// min..max spread as a vertical bar) against size on a log2 axis, one line per system.
    pub fn write_svg(&self, path: &Path) -> Result<()> {
        plot(self, path)
            .map_err(|e| Error::InvalidArgument(format!("plot {}: {e}", path.display())))
    }
}

fn plot(r: &Report, path: &Path) -> std::result::Result<(), Box<dyn std::error::Error>> {
    use plotters::prelude::*;
    let mut scenarios: Vec<&str> = Vec::new();
    for row in &r.throughput {
        if !scenarios.contains(&row.scenario.as_str()) {
            scenarios.push(&row.scenario);
        }
    }
    if scenarios.is_empty() {
        return Err("no throughput rows to plot".into());
    }
    let panel_h = 420u32;
    let root = SVGBackend::new(path, (960, panel_h * scenarios.len() as u32)).into_drawing_area();
    root.fill(&WHITE)?;
    let panels = root.split_evenly((scenarios.len(), 1));
    for (scn, area) in scenarios.iter().zip(panels.iter()) {
        let rows: Vec<&Row> = r.throughput.iter().filter(|x| x.scenario == *scn).collect();
        // x: log2 of the size, labelled at powers of two.
        let lx = |v: u64| (v.max(1) as f64).log2();
        let xmin = rows.iter().map(|x| lx(x.size)).fold(f64::MAX, f64::min);
        let xmax = rows.iter().map(|x| lx(x.size)).fold(f64::MIN, f64::max);
        let (xmin, xmax) = (xmin.floor() - 0.3, xmax.ceil() + 0.3);
        let ymax = rows.iter().map(|x| x.gbps_max).fold(0.0f64, f64::max) * 1.1 + 1e-3;
        let kind = rows
            .first()
            .map(|x| x.size_kind.clone())
            .unwrap_or_default();
        let desc = r
            .scenarios
            .iter()
            .find(|(s, _)| s == scn)
            .map(|(_, d)| d.as_str())
            .unwrap_or("");
        let mut caption = format!("{scn}: {desc}");
        if caption.len() > 110 {
            caption.truncate(107);
            caption.push_str("...");
        }
        let mut chart = ChartBuilder::on(area)
            .caption(caption, ("sans-serif", 15))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(56)
            .build_cartesian_2d(xmin..xmax, 0.0..ymax)?;
        let kind2 = kind.clone();
        chart
            .configure_mesh()
            .x_labels(((xmax - xmin).ceil() as usize + 1).min(24))
            .x_desc(if kind == "tokens" {
                "tokens per request (log scale)".to_string()
            } else {
                format!("{kind} size (log scale)")
            })
            .y_desc("GB/s (median; bars: min..max)")
            .x_label_formatter(&move |v| {
                if (v - v.round()).abs() > 0.01 {
                    return String::new();
                }
                let n = 2f64.powf(v.round()) as u64;
                if kind2 == "tokens" {
                    format!("{n}")
                } else {
                    fmt_bytes(n)
                }
            })
            .draw()?;
        let mut systems: Vec<&str> = Vec::new();
        for row in &rows {
            if !systems.contains(&row.system.as_str()) {
                systems.push(&row.system);
            }
        }
        for (i, sys) in systems.iter().enumerate() {
            let color = Palette99::pick(i).to_rgba();
            let pts: Vec<&&Row> = rows.iter().filter(|x| x.system == *sys).collect();
            let line: Vec<(f64, f64)> = pts.iter().map(|x| (lx(x.size), x.gbps)).collect();
            let is_base = pts.first().map(|x| x.system == x.baseline).unwrap_or(false);
            let style = if is_base {
                ShapeStyle::from(&BLACK).stroke_width(3)
            } else {
                ShapeStyle::from(&color).stroke_width(2)
            };
            let label = if is_base {
                format!("{sys} (baseline)")
            } else {
                sys.to_string()
            };
            chart
                .draw_series(LineSeries::new(line.clone(), style))?
                .label(label)
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], style));
            chart.draw_series(line.iter().map(|&p| Circle::new(p, 3, style.filled())))?;
            chart.draw_series(pts.iter().map(|x| {
                PathElement::new(
                    vec![(lx(x.size), x.gbps_min), (lx(x.size), x.gbps_max)],
                    style,
                )
            }))?;
        }
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .position(SeriesLabelPosition::UpperLeft)
            .draw()?;
    }
    root.present()?;
    Ok(())
}

/// Median of sorted samples.
pub fn median(sorted: &[f64]) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let n = sorted.len();
    if n % 2 == 1 {
        sorted[n / 2]
    } else {
        (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0
    }
}

/// The `q` quantile (0..1) of sorted samples, nearest rank.
pub fn quantile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len()) - 1;
    sorted[i]
}
