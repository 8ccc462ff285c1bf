//! `tpu-sync`: command-line front end of the tpu-sync library.
//!
//! Subcommands: `demo` (prefill and decode as two processes, verified end to end), `prefill` and
//! `decode` (the two halves, e.g. on two hosts), `info` (plugin, devices, capabilities),
//! `store-demo` (the host KV tier across a process restart), `shm` (list/remove its segments)
//! and `bench` (throughput and latency against same-run baselines).

/// `println!` that never panics: when stdout is closed (the `demo` parent is gone, `| head`),
/// the line is dropped. SIGPIPE stays ignored (Rust's default; network code relies on EPIPE errors), so a plain
/// `println!` would panic with "failed printing to stdout: Broken pipe". The line is formatted
/// first and written with one `write_all`, so lines of processes sharing a pipe (the demo's
/// prefill and decode) never interleave mid-line (a pipe write of at most `PIPE_BUF`, 4 KiB,
/// is atomic; `writeln!` on unbuffered stderr issues one write per formatted piece).
macro_rules! outln {
    () => {
        outln!("")
    };
    ($($t:tt)*) => {{
        use std::io::Write as _;
        let mut line = format!($($t)*);
        line.push('\n');
        let _ = std::io::stdout().lock().write_all(line.as_bytes());
    }};
}

/// `eprintln!` that never panics, one write per line (see [`outln!`]).
macro_rules! errln {
    () => {
        errln!("")
    };
    ($($t:tt)*) => {{
        use std::io::Write as _;
        let mut line = format!($($t)*);
        line.push('\n');
        let _ = std::io::stderr().lock().write_all(line.as_bytes());
    }};
}

mod bench;
mod demo;
mod kvproc;
mod kvproc_groups;
mod logging;
mod store_demo;
mod top;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::parser::ValueSource;
use clap::{Args, CommandFactory, FromArgMatches, Parser, Subcommand};

/// Move KV caches between PJRT devices, pinned host memory and the network, resharded.
#[derive(Parser, Debug)]
#[command(name = "tpu-sync", version, about)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
    /// Log format on stderr: `text` (env_logger lines, as always) or `json` (one JSON object per
    /// line from the `tracing` subscriber: log lines, and each span of a transfer (request,
    /// transfer, plan, stage_d2h, network, h2d, release; with the request id) when it closes,
    /// with its busy and idle time). The level comes from RUST_LOG (default `warn`; `info`
    /// shows the spans). Default: $TPU_SYNC_LOG_FORMAT, else text (`demo` passes it to its two
    /// processes).
    #[arg(long, global = true, value_enum)]
    log_format: Option<logging::LogFormat>,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Run prefill and decode as two OS processes connected by the network and verify every byte.
    Demo(JobArgs),
    /// Prefill half: fill device KV, stage it to pinned host memory, serve one request, exit.
    Prefill {
        #[command(flatten)]
        job: JobArgs,
        /// Address to listen on (e.g. 0.0.0.0:7700); default 127.0.0.1:<--port>.
        #[arg(long)]
        listen: Option<String>,
        /// Prefill ranks this process hosts (comma-separated global ranks; default: all), so the
        /// ranks of one prefill instance can live in several processes or hosts.
        #[arg(long, value_delimiter = ',')]
        ranks: Option<Vec<u32>>,
    },
    /// Decode half: pull the request from a prefill process, write it to device KV, verify.
    Decode {
        #[command(flatten)]
        job: JobArgs,
        /// Address of the prefill process (host:port), or one per prefill rank as
        /// `RANK=HOST:PORT,...` when the prefill ranks live in different processes.
        #[arg(long)]
        connect: String,
    },
    /// Print the PJRT plugin's API version, platform, devices, memory kinds and capabilities.
    Info {
        /// PJRT plugin shared library (default: $TPU_SYNC_PJRT_PLUGIN, else the one `make` installed).
        #[arg(long)]
        plugin: Option<PathBuf>,
        /// Number of CPU devices to ask the XLA CPU plugin for.
        #[arg(long)]
        devices: Option<i64>,
    },
    /// Host KV tier: put a prompt's KV from device blocks into the tier, kill the process, load it
    /// back in a new process into other device blocks, and verify every byte.
    StoreDemo(store_demo::StoreDemoArgs),
    /// List (`shm list`) or remove (`shm rm NAME`) the host KV tier's /dev/shm segments.
    Shm {
        #[command(subcommand)]
        cmd: store_demo::ShmCmd,
    },
    /// Measure D2H, H2D, network, resharding, latency and the host tier against baselines
    /// measured in the same run (memcpy, one raw TCP socket); `--quick` checks bytes only.
    Bench(bench::BenchArgs),
    /// Helper process of `bench` (the remote side of its network scenarios).
    #[command(hide = true)]
    BenchPeer(bench::PeerArgs),
    /// Live view of a running process's metrics from its HTTP endpoint (TPU_SYNC_METRICS_ADDR):
    /// throughput per direction, transfers in flight, peers, host-tier occupancy and hit rate.
    Top(top::TopArgs),
}

/// Flags shared by `demo`, `prefill` and `decode`.
#[derive(Args, Debug, Clone)]
pub struct JobArgs {
    /// Model KV geometry preset: llama-3.1-8b, qwen3-32b, llama-3.1-70b, deepseek-v3, or a
    /// hybrid model's KV cache groups: qwen3-next-80b, qwen3.5-9b, gpt-oss-120b, gemma-3-27b,
    /// deepseek-v3.2, deepseek-v3.2-tpu (see docs/hybrid.md).
    #[arg(long, default_value = "llama-3.1-8b")]
    pub preset: String,
    /// Prompt length in tokens. `decode` takes the count from the prefill; given to `decode`, it
    /// must match the prefill's.
    #[arg(long, default_value_t = 2048)]
    pub tokens: u32,
    /// Prefill layout SPEC: comma-separated key=value among tp, pcp, dp, block, order
    /// (nhd|hnd|lbhnc, or rpa3|rpa3hd64|rpamla: the TPU engines' caches, docs/tpu.md). A SPEC replaces the whole default layout, not just the keys it names: keys not given take
    /// the single-rank defaults tp=1, pcp=1, dp=1, block=16, order=nhd (so `--prefill tp=4` is
    /// tp=4,pcp=1,dp=1,block=16,order=nhd). Ignored by decode (it learns the prefill's layout
    /// from the prefill).
    #[arg(
        long,
        value_name = "SPEC",
        default_value = "tp=2,pcp=2,block=64,order=nhd"
    )]
    pub prefill: String,
    /// Decode layout SPEC: comma-separated key=value among tp, pcp, dp, block, order
    /// (nhd|hnd|lbhnc, or rpa3|rpa3hd64|rpamla: the TPU engines' caches, docs/tpu.md). A SPEC replaces the whole default layout, not just the keys it names: keys not given take
    /// the single-rank defaults tp=1, pcp=1, dp=1, block=16, order=nhd.
    #[arg(
        long,
        value_name = "SPEC",
        default_value = "tp=1,dp=2,block=16,order=hnd"
    )]
    pub decode: String,
    /// DP rank of the decode instance that receives the request, below the decode layout's dp
    /// (default: 1, or 0 when DP=1).
    #[arg(long)]
    pub decode_dp_rank: Option<u32>,
    /// Transport between prefill and decode: tcp (plain, trusted networks only), tls (TLS 1.3
    /// over TCP), quic, or shm (same host: the decode copies the prefill's staged bytes once,
    /// out of its memory; plain TCP to other hosts; no authentication). tls and quic need --tls-cert/--tls-key/--tls-ca or --psk-file; `demo`
    /// generates an ephemeral CA and certificates for both sides when none are given.
    #[arg(long, default_value = "tcp")]
    pub transport: String,
    /// This side's certificate chain (PEM) for tls/quic.
    #[arg(long)]
    pub tls_cert: Option<PathBuf>,
    /// This side's private key (PEM) for tls/quic.
    #[arg(long)]
    pub tls_key: Option<PathBuf>,
    /// CA certificate(s) (PEM) that the peer's certificate must chain to.
    #[arg(long)]
    pub tls_ca: Option<PathBuf>,
    /// File holding a pre-shared key (>= 16 bytes, 32 random bytes recommended) used instead of
    /// certificates for tls/quic.
    #[arg(long)]
    pub psk_file: Option<PathBuf>,
    /// Parallel streams (lanes) per (prefill rank, decode rank) pair (1 to 1024).
    #[arg(long, default_value_t = 2)]
    pub streams: u32,
    /// Payload bytes per data frame (chunk), 1 to 64 MiB.
    #[arg(long, default_value_t = 1 << 20)]
    pub chunk_bytes: u64,
    /// PJRT plugin shared library (default: $TPU_SYNC_PJRT_PLUGIN, else the one `make` installed).
    #[arg(long)]
    pub plugin: Option<PathBuf>,
    /// TCP port of the prefill listener (0 = any free port). Prefill and demo only; ignored by
    /// decode.
    #[arg(long, default_value_t = 0)]
    pub port: u16,
    /// Use only the first N layers of the preset (smaller runs for tests).
    #[arg(long)]
    pub layers: Option<u32>,
    /// Request id (1 to 2^53 - 1).
    #[arg(long, default_value_t = 4242)]
    pub request_id: u64,
    /// Seconds a connect, a read or a write may stall before the transfer fails.
    #[arg(long, default_value_t = 30)]
    pub timeout: u64,
    /// Seconds the prefill side waits for the decode side to release the request, counted from
    /// when the prefill registered it (so including the decode side's startup). Prefill and demo
    /// only; ignored by decode.
    #[arg(long, default_value_t = 300)]
    pub serve_timeout: u64,
    /// Byte budget of pinned staging memory (default: a quarter of the memory this process may
    /// use, capped by RLIMIT_MEMLOCK; $TPU_SYNC_STAGING_BUDGET_BYTES). A request whose staging
    /// does not fit is refused with a staging-exhausted error before anything is copied.
    #[arg(long, value_name = "BYTES")]
    pub staging_budget: Option<u64>,
    /// Test hook: prefill closes its connection after this many payload bytes.
    #[arg(long, hide = true)]
    pub fault_close_after: Option<u64>,
    /// Test hook: prefill stops sending (sockets open) after this many payload bytes.
    #[arg(long, hide = true)]
    pub fault_stall_after: Option<u64>,
    /// Test hook: decode lists this block id for the request (checked against the layout).
    #[arg(long, hide = true)]
    pub fault_block_id: Option<u32>,
    /// Test hook (hybrid presets): decode's KV cache groups differ from the preset's and it
    /// believes the prefill's differ the same way: `window` (sliding windows + 16 tokens),
    /// `state` (one more row in the first state component) or `missing` (the last group
    /// dropped). The prefill must refuse the pull at the handshake.
    #[arg(long, hide = true)]
    pub fault_groups: Option<String>,
}

/// A panic prints one line to stderr (ignoring a closed stderr) instead of a panic trace, unless
/// RUST_BACKTRACE asks for the standard report. The exit code stays non-zero (101).
fn quiet_panics() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        if std::env::var_os("RUST_BACKTRACE").is_some_and(|v| v != "0") {
            default(info);
            return;
        }
        let msg = info
            .payload()
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| info.payload().downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "unknown cause".into());
        let at = info
            .location()
            .map(|l| format!(" at {}:{}", l.file(), l.line()))
            .unwrap_or_default();
        errln!("error: internal error{at}: {msg}");
    }));
}

fn main() -> ExitCode {
    quiet_panics();
    let matches = Cli::command().get_matches();
    // `decode --tokens` counts only when given on the command line (the default is prefill's).
    let decode_tokens_given = matches
        .subcommand_matches("decode")
        .and_then(|m| m.value_source("tokens"))
        == Some(ValueSource::CommandLine);
    let cli = match Cli::from_arg_matches(&matches) {
        Ok(c) => c,
        Err(e) => e.exit(),
    };
    logging::init(cli.log_format);
    let r = match cli.cmd {
        Cmd::Demo(job) => demo::run(&job),
        Cmd::Prefill { job, listen, ranks } => {
            kvproc::prefill(&job, listen.as_deref(), ranks.as_deref())
        }
        Cmd::Decode { job, connect } => {
            kvproc::decode(&job, &connect, decode_tokens_given.then_some(job.tokens))
        }
        Cmd::Info { plugin, devices } => kvproc::info(plugin.as_deref(), devices),
        Cmd::StoreDemo(a) => store_demo::run(&a),
        Cmd::Shm { cmd } => store_demo::shm(&cmd),
        Cmd::Bench(a) => bench::run(&a),
        Cmd::BenchPeer(a) => bench::peer_main(&a),
        Cmd::Top(a) => top::run(&a),
    };
    match r {
        Ok(code) => code,
        Err(e) => {
            errln!("error: {e}");
            ExitCode::from(2)
        }
    }
}
