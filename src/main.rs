//! `tpu-sync`: command-line front end of the tpu-sync library.
//!
//! Subcommands: `demo` (prefill and decode as two processes, verified end to end), `prefill` and
//! `decode` (the two halves, e.g. on two hosts), `info` (plugin, devices, capabilities),
//! `store-demo` (the host KV tier across a process restart) and `shm` (list/remove its segments).

mod demo;
mod kvproc;
mod store_demo;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};

/// Move KV caches between PJRT devices, pinned host memory and the network, resharded.
#[derive(Parser, Debug)]
#[command(name = "tpu-sync", version, about)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
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
}

/// Flags shared by `demo`, `prefill` and `decode`.
#[derive(Args, Debug, Clone)]
pub struct JobArgs {
    /// Model KV geometry preset: llama-3.1-8b, qwen3-32b, llama-3.1-70b, deepseek-v3.
    #[arg(long, default_value = "llama-3.1-8b")]
    pub preset: String,
    /// Prompt length in tokens.
    #[arg(long, default_value_t = 2048)]
    pub tokens: u32,
    /// Prefill layout: comma-separated key=value among tp, pcp, dp, block, order (nhd|hnd).
    #[arg(long, default_value = "tp=2,pcp=2,block=64,order=nhd")]
    pub prefill: String,
    /// Decode layout: comma-separated key=value among tp, pcp, dp, block, order (nhd|hnd).
    #[arg(long, default_value = "tp=1,dp=2,block=16,order=hnd")]
    pub decode: String,
    /// DP rank of the decode instance that receives the request (default: 1, or 0 when DP=1).
    #[arg(long)]
    pub decode_dp_rank: Option<u32>,
    /// Transport between prefill and decode: tcp (plain, trusted networks only), tls (TLS 1.3
    /// over TCP) or quic. tls and quic need --tls-cert/--tls-key/--tls-ca or --psk-file; `demo`
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
    /// Parallel streams (lanes) per (prefill rank, decode rank) pair.
    #[arg(long, default_value_t = 2)]
    pub streams: u32,
    /// Payload bytes per data frame (chunk).
    #[arg(long, default_value_t = 1 << 20)]
    pub chunk_bytes: u64,
    /// PJRT plugin shared library (default: $TPU_SYNC_PJRT_PLUGIN, else the one `make` installed).
    #[arg(long)]
    pub plugin: Option<PathBuf>,
    /// TCP port of the prefill listener (0 = any free port).
    #[arg(long, default_value_t = 0)]
    pub port: u16,
    /// Use only the first N layers of the preset (smaller runs for tests).
    #[arg(long)]
    pub layers: Option<u32>,
    /// Request id (below 2^53).
    #[arg(long, default_value_t = 4242)]
    pub request_id: u64,
    /// Seconds a connect, a read or a write may stall before the transfer fails.
    #[arg(long, default_value_t = 30)]
    pub timeout: u64,
    /// Seconds the prefill side waits for the decode side to release the request.
    #[arg(long, default_value_t = 300)]
    pub serve_timeout: u64,
    /// Test hook: prefill closes its connection after this many payload bytes.
    #[arg(long, hide = true)]
    pub fault_close_after: Option<u64>,
    /// Test hook: prefill stops sending (sockets open) after this many payload bytes.
    #[arg(long, hide = true)]
    pub fault_stall_after: Option<u64>,
    /// Test hook: decode lists this block id for the request (checked against the layout).
    #[arg(long, hide = true)]
    pub fault_block_id: Option<u32>,
}

fn main() -> ExitCode {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn")).init();
    let cli = Cli::parse();
    let r = match cli.cmd {
        Cmd::Demo(job) => demo::run(&job),
        Cmd::Prefill { job, listen, ranks } => {
            kvproc::prefill(&job, listen.as_deref(), ranks.as_deref())
        }
        Cmd::Decode { job, connect } => kvproc::decode(&job, &connect),
        Cmd::Info { plugin, devices } => kvproc::info(plugin.as_deref(), devices),
        Cmd::StoreDemo(a) => store_demo::run(&a),
        Cmd::Shm { cmd } => store_demo::shm(&cmd),
    };
    match r {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(2)
        }
    }
}
