//! `tpu-sync store-demo`: the host KV tier shown end to end, across a real process restart, and
//! `tpu-sync shm list|rm`.
//!
//! The demo runs two child processes of this binary (hidden `--phase put` and `--phase get`):
//!
//! 1. **put**: a PJRT client holds one rank's KV cache (every layer, K and V) for a prompt at
//!    scattered device block ids, filled with [`RankContents`] values. The tier is opened (in the
//!    background; the time to ready is printed), the prompt's blocks are keyed by their token ids
//!    ([`Namespace::chain_keys`]) and stored from the device blocks ([`KvStore::put_from_device`]),
//!    and the device buffers are deleted. The process reports and is then **killed with SIGKILL**
//!    by the parent: nothing is shut down cleanly.
//! 2. **get**: a new process with a new PJRT client and fresh device buffers (background contents
//!    of another salt) opens the tier again, looks the prompt up, loads it into **different**
//!    device block ids ([`KvStore::get_to_device`]) and reads every device buffer back, checking
//!    every element of the prompt and that nothing else changed.
//!
//! Where the blocks survive the restart:
//!
//! * `--shm NAME`: in the `/dev/shm` segment `NAME` (kept after the demo; `tpu-sync shm rm NAME`).
//! * `--disk DIR` without `--shm`: DRAM is anonymous, so the put phase writes every block to the
//!   disk tier ([`KvStore::flush_to_disk`]) and the get phase loads them from disk through DRAM.
//! * both: DRAM holds half the prompt, so half of it spills to disk during the put; the get phase
//!   finds half in the re-attached segment and half on disk.
//! * neither: a per-run segment `store-demo-<pid>` is used and removed at the end.
//!
//! The last line starts with `verified:` and the exit code is 0 only when every byte verified.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use clap::{Args, Subcommand};
use serde::{Deserialize, Serialize};
use tpu_sync::arena::LockStatus;
use tpu_sync::layout::{KvLayout, ModelKv, ParallelLayout, ParallelSpec};
use tpu_sync::pattern::{mix64, LayerCheck, RankContents};
use tpu_sync::pjrt::{Capabilities, Client, ClientOptions, DeviceBuffer, Plugin};
use tpu_sync::plan::Placement;
use tpu_sync::store::{
    self, Attach, BlockKey, DeviceBlock, DiskOptions, DmaStatus, KvStore, Namespace, StopReason,
    StoreConfig,
};
use tpu_sync::util::fmt_bytes;
use tpu_sync::{Error, Result};

const PUT_SALT: u64 = 0x5354_4f52_4550_5554;
const GET_SALT: u64 = 0x5354_4f52_4547_4554;

/// Flags of `tpu-sync store-demo`.
#[derive(Args, Debug, Clone)]
pub struct StoreDemoArgs {
    /// Model KV geometry preset: llama-3.1-8b, qwen3-32b, llama-3.1-70b, deepseek-v3.
    #[arg(long, default_value = "llama-3.1-8b")]
    pub preset: String,
    /// Prompt length in tokens. Only full blocks are stored (as engines offload): a partial last
    /// block is left out, and the demo says so.
    #[arg(long, default_value_t = 2048)]
    pub tokens: u32,
    /// Keep the tier in this /dev/shm segment (kept after the demo).
    #[arg(long)]
    pub shm: Option<String>,
    /// Disk tier directory.
    #[arg(long)]
    pub disk: Option<PathBuf>,
    /// One rank's layout SPEC: comma-separated key=value among block and order (nhd|hnd). A SPEC
    /// replaces the whole default layout, not just the keys it names: keys not given take the
    /// defaults block=16, order=nhd.
    #[arg(long, value_name = "SPEC", default_value = "block=16,order=nhd")]
    pub layout: String,
    /// DRAM capacity of the tier in blocks, at least 1 (default: the whole prompt, or half of it
    /// with both --shm and --disk).
    #[arg(long)]
    pub capacity_blocks: Option<u64>,
    /// PJRT plugin shared library (default: $TPU_SYNC_PJRT_PLUGIN, else the one `make` installed).
    #[arg(long)]
    pub plugin: Option<PathBuf>,
    /// Use only the first N layers of the preset (smaller runs for tests).
    #[arg(long)]
    pub layers: Option<u32>,
    /// Byte budget of pinned memory the tier's DRAM is reserved from (default: the process-wide
    /// budget, a quarter of the memory this process may use capped by RLIMIT_MEMLOCK;
    /// $TPU_SYNC_STAGING_BUDGET_BYTES). A tier that does not fit is refused at once.
    #[arg(long, value_name = "BYTES")]
    pub staging_budget: Option<u64>,
    /// Internal: which half to run (put or get).
    #[arg(long, hide = true)]
    pub phase: Option<String>,
}

/// `tpu-sync shm` subcommands.
#[derive(Subcommand, Debug, Clone)]
pub enum ShmCmd {
    /// List the host KV tier's shared-memory segments.
    List {
        /// Directory of the segments.
        #[arg(long, default_value = store::DEFAULT_SHM_DIR)]
        dir: PathBuf,
    },
    /// Remove a segment (refused while a process uses it, unless --force).
    Rm {
        /// Segment name (as listed).
        name: String,
        /// Directory of the segments.
        #[arg(long, default_value = store::DEFAULT_SHM_DIR)]
        dir: PathBuf,
        /// Remove even if in use or owned by another user.
        #[arg(long)]
        force: bool,
    },
}

/// What one phase reports to the parent.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
struct PhaseReport {
    pid: u32,
    platform: String,
    attach: String,
    segment: Option<String>,
    lock: String,
    dma: String,
    disk: Option<String>,
    ready_ms: f64,
    restored_dram: u64,
    restored_disk: u64,
    blocks: u64,
    block_ids: Vec<u32>,
    lookup_hits: u64,
    lookup_dram: u64,
    lookup_disk: u64,
    // put
    stored: u64,
    present: u64,
    spilled: u64,
    flushed: u64,
    // get
    delivered: u64,
    from_dram: u64,
    from_disk: u64,
    stop: Option<String>,
    bytes: u64,
    secs: f64,
    verified_request_bytes: u64,
    verified_background_bytes: u64,
    mismatches: u64,
    first_mismatch: Option<String>,
}

struct Setup {
    model: ModelKv,
    kv: KvLayout,
    layout: ParallelLayout,
    /// Full blocks of the prompt (the ones stored).
    blocks: u32,
    /// Tokens of those blocks (`--tokens` rounded down to whole blocks).
    tokens: u32,
}

fn setup(a: &StoreDemoArgs) -> Result<Setup> {
    let mut model = ModelKv::preset(&a.preset)?;
    if let Some(l) = a.layers {
        if l == 0 || l > model.num_layers {
            return Err(Error::Layout(format!(
                "--layers {l}: {} has {} layers",
                model.name, model.num_layers
            )));
        }
        model.num_layers = l;
    }
    if a.capacity_blocks == Some(0) {
        return Err(Error::InvalidArgument(
            "--capacity-blocks 0: the tier's DRAM must hold at least one block".into(),
        ));
    }
    let spec = ParallelSpec::parse(&a.layout)?;
    if spec.num_ranks() != 1 {
        return Err(Error::InvalidArgument(format!(
            "--layout {}: the store demo runs one rank (use only block= and order=)",
            a.layout
        )));
    }
    if spec.block_size == 0 {
        return Err(Error::Layout(format!(
            "--layout {}: block must be > 0",
            a.layout
        )));
    }
    let blocks = a.tokens / spec.block_size;
    if blocks == 0 {
        return Err(Error::InvalidArgument(format!(
            "--tokens {}: fewer than one full block of {} tokens, so there is nothing to store \
             (engines offload full blocks only)",
            a.tokens, spec.block_size
        )));
    }
    let layout = ParallelLayout::new(model.clone(), spec, blocks * 2 + 5)?;
    let kv = layout.rank_kv()?;
    Ok(Setup {
        model,
        kv,
        layout,
        blocks,
        tokens: blocks * spec.block_size,
    })
}

impl Setup {
    fn block_bytes(&self) -> u64 {
        self.kv.num_layers as u64 * self.kv.kv_planes as u64 * self.kv.block_bytes()
    }

    /// A deterministic prompt: token ids from a hash, so both phases derive the same keys.
    fn keys(&self, ns: &Namespace, tokens: u32) -> Vec<BlockKey> {
        let toks: Vec<u32> = (0..tokens as u64)
            .map(|i| (mix64(i ^ 0x746f_6b65_6e73) % 128_000) as u32)
            .collect();
        ns.chain_keys(&toks, self.kv.block_size as usize)
    }

    /// Scattered, distinct block ids for the prompt.
    fn placement(&self, seed: u64) -> Placement {
        let mut ids: Vec<u32> = (0..self.kv.num_blocks).collect();
        for i in (1..ids.len()).rev() {
            let j = (mix64(seed ^ i as u64) % (i as u64 + 1)) as usize;
            ids.swap(i, j);
        }
        ids.truncate(self.blocks as usize);
        Placement {
            first_token: 0,
            layout: self.layout.clone(),
            dp_rank: 0,
            block_ids: vec![ids],
            groups: None,
        }
    }
}

fn open_client(plugin: Option<&Path>) -> Result<(Client, Capabilities)> {
    let plugin = match plugin {
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
    Ok((client, caps))
}

fn make_buffers(client: &Client, c: &RankContents) -> Result<Vec<DeviceBuffer>> {
    let kv = *c.kv();
    let dev = client.device(0)?;
    let mut host = vec![0u8; kv.buffer_bytes() as usize];
    (0..kv.num_layers)
        .map(|l| {
            c.fill_layer(l, &mut host)?;
            client.buffer_from_host(&host, kv.dtype.element_type(), &kv.dims(), &dev)
        })
        .collect()
}

fn namespace(s: &Setup, client: &Client, caps: &Capabilities) -> Namespace {
    let m = &s.model;
    Namespace::new(format!(
        "{} {} layers={} kv_heads={} head_dim={} planes={} block={} {} pjrt={} {}.{}",
        m.name,
        m.dtype.name(),
        m.num_layers,
        s.kv.num_heads,
        m.head_dim,
        m.kv_planes,
        s.kv.block_size,
        s.kv.order.name(),
        client.platform_name(),
        caps.api_version.0,
        caps.api_version.1
    ))
}

/// The store configuration both phases use (they must agree for the segment to re-attach).
fn store_config(a: &StoreDemoArgs, s: &Setup, ns: Namespace, client: &Client) -> StoreConfig {
    let bb = s.block_bytes();
    let slot = if bb >= 4096 {
        bb.next_multiple_of(4096)
    } else {
        bb.next_multiple_of(64)
    };
    let blocks = s.blocks as u64;
    let dram_blocks = a
        .capacity_blocks
        .unwrap_or(if a.shm.is_some() && a.disk.is_some() {
            blocks.div_ceil(2)
        } else {
            blocks
        });
    let mut c = StoreConfig::new(ns, bb, slot * dram_blocks);
    c.shm_name = a.shm.clone();
    c.disk = a.disk.as_ref().map(|d| {
        DiskOptions::new(
            d,
            2 * blocks * (store::disk::FILE_HEADER as u64 + store::disk::padded(bb)),
        )
    });
    c.background = true;
    c.dma_client = Some(client.clone());
    c.staging_budget = a
        .staging_budget
        .map(|n| tpu_sync::budget::StagingBudget::new("store-demo --staging-budget", n));
    c
}

fn lock_text(s: &LockStatus) -> String {
    match s {
        LockStatus::Locked => "mlocked".into(),
        LockStatus::NotRequested => "not locked (not requested)".into(),
        LockStatus::Failed(w) => format!("NOT locked: {w}"),
    }
}

fn open_store(cfg: StoreConfig, r: &mut PhaseReport) -> Result<KvStore> {
    let t = Instant::now();
    let st = KvStore::open(cfg)?;
    st.wait_ready(Duration::from_secs(120))?;
    r.ready_ms = t.elapsed().as_secs_f64() * 1e3;
    let info = st.info().expect("ready");
    r.attach = match &info.attach {
        Attach::Anonymous => "anonymous memory".into(),
        Attach::Created => "created".into(),
        Attach::Attached => "re-attached".into(),
        Attach::Reformatted(why) => format!("reformatted ({why})"),
    };
    r.segment = info.segment.as_ref().map(|p| p.display().to_string());
    r.lock = lock_text(&info.lock);
    r.dma = match &info.dma {
        DmaStatus::NotRequested => "not requested".into(),
        DmaStatus::Mapped(n) => format!("mapped ({})", fmt_bytes(*n)),
        DmaStatus::Unavailable(m) => format!("not available ({m})"),
    };
    r.disk = info.disk.as_ref().map(|(dir, backend, direct, cap)| {
        format!(
            "{} ({backend}, {}, {cap} blocks)",
            dir.display(),
            if *direct { "O_DIRECT" } else { "buffered" }
        )
    });
    r.restored_dram = info.restored_dram_blocks;
    r.restored_disk = info.restored_disk_blocks;
    Ok(st)
}

fn report(r: &PhaseReport) {
    outln!(
        "REPORT {}",
        serde_json::to_string(r).expect("report serialises")
    );
}

fn phase_put(a: &StoreDemoArgs) -> Result<ExitCode> {
    let s = setup(a)?;
    let (client, caps) = open_client(a.plugin.as_deref())?;
    let ns = namespace(&s, &client, &caps);
    let place = s.placement(0x0070_7574);
    let contents = RankContents::new(&place, 0, s.tokens, PUT_SALT)?;
    let buffers = make_buffers(&client, &contents)?;
    let mut r = PhaseReport {
        pid: std::process::id(),
        platform: client.platform_name().to_string(),
        blocks: s.blocks as u64,
        block_ids: place.block_ids[0].clone(),
        ..PhaseReport::default()
    };
    let st = open_store(store_config(a, &s, ns.clone(), &client), &mut r)?;
    let keys = s.keys(&ns, s.tokens);
    let before = st.lookup_detail(&keys);
    r.lookup_hits = before.hits as u64;
    let blocks = place.block_ids[0]
        .iter()
        .map(|&id| DeviceBlock::kv_block(&s.kv, &buffers, id))
        .collect::<Result<Vec<_>>>()?;
    let t = Instant::now();
    let put = st.put_from_device(None, &keys, &blocks)?;
    r.secs = t.elapsed().as_secs_f64();
    if put.not_ready {
        return Err(Error::HostMemory(
            "the tier was not ready for the put".into(),
        ));
    }
    if let Some(at) = put.full_at {
        let cap = match a.capacity_blocks {
            Some(n) => format!("--capacity-blocks {n}"),
            None => "the default DRAM capacity".into(),
        };
        return Err(Error::HostMemory(format!(
            "the tier is full: {at} of the prompt's {} blocks were stored, block {} and later did \
             not fit ({cap}{})",
            s.blocks,
            at + 1,
            if a.disk.is_some() {
                ", and no block could spill to disk"
            } else {
                "; give a larger --capacity-blocks or a --disk tier to spill to"
            }
        )));
    }
    r.stored = put.stored as u64;
    r.present = put.present as u64;
    r.bytes = put.bytes;
    r.spilled = st.stats().spills;
    if a.disk.is_some() && a.shm.is_none() {
        // Anonymous DRAM does not survive the restart: write it all to disk now.
        r.flushed = st.flush_to_disk()? as u64;
    }
    // Evict the device copy.
    for b in &buffers {
        b.delete()?;
    }
    drop(blocks);
    let stats = st.stats();
    r.lookup_dram = stats.dram_blocks;
    r.lookup_disk = stats.disk_blocks;
    report(&r);
    outln!("WAITING-FOR-SIGKILL");
    // The parent kills this process now; nothing below is meant to run.
    std::thread::sleep(Duration::from_secs(120));
    Err(Error::Timeout(
        "the demo parent never killed the put phase".into(),
    ))
}

fn phase_get(a: &StoreDemoArgs) -> Result<ExitCode> {
    let s = setup(a)?;
    let (client, caps) = open_client(a.plugin.as_deref())?;
    caps.require_h2d()?;
    let ns = namespace(&s, &client, &caps);
    // Fresh buffers, background only; the prompt goes to other block ids.
    let empty = Placement {
        first_token: 0,
        block_ids: vec![vec![]],
        ..s.placement(0)
    };
    let buffers = make_buffers(&client, &RankContents::new(&empty, 0, s.tokens, GET_SALT)?)?;
    let place = s.placement(0x0067_6574);
    let mut r = PhaseReport {
        pid: std::process::id(),
        platform: client.platform_name().to_string(),
        blocks: s.blocks as u64,
        block_ids: place.block_ids[0].clone(),
        ..PhaseReport::default()
    };
    let st = open_store(store_config(a, &s, ns.clone(), &client), &mut r)?;
    let keys = s.keys(&ns, s.tokens);
    let l = st.lookup_detail(&keys);
    r.lookup_hits = l.hits as u64;
    r.lookup_dram = l.in_dram as u64;
    r.lookup_disk = l.disk_only as u64;
    let dst = place.block_ids[0]
        .iter()
        .map(|&id| DeviceBlock::kv_block(&s.kv, &buffers, id))
        .collect::<Result<Vec<_>>>()?;
    let t = Instant::now();
    let g = st.get_to_device(&caps, &keys, &dst)?;
    r.secs = t.elapsed().as_secs_f64();
    r.delivered = g.delivered as u64;
    r.from_dram = g.from_dram as u64;
    r.from_disk = g.from_disk as u64;
    r.bytes = g.bytes;
    r.stop = g.stop.map(|s| match s {
        StopReason::NotReady => "the tier was not ready".to_string(),
        StopReason::Missing => "a block is not in the tier".to_string(),
        StopReason::NoSpace => "no DRAM slot could be freed to load a block from disk".to_string(),
        StopReason::Raced => "a block kept changing under the copy".to_string(),
        StopReason::BadFile(w) => format!("a block's disk file is bad ({w})"),
    });
    drop(dst);
    // Read every device buffer back and check every element.
    let c = RankContents::new(&place, 0, s.tokens, GET_SALT)?;
    let mut host = vec![0u8; s.kv.buffer_bytes() as usize];
    let mut check = LayerCheck::default();
    for (layer, b) in buffers.iter().enumerate() {
        b.to_host(&mut host)?;
        check.merge(c.verify_layer(layer as u32, &host)?);
    }
    r.verified_request_bytes = check.request_bytes;
    r.verified_background_bytes = check.background_bytes;
    r.mismatches = check.mismatches;
    r.first_mismatch = check.first_mismatch;
    report(&r);
    Ok(ExitCode::SUCCESS)
}

struct KillOnDrop(Option<Child>);
impl Drop for KillOnDrop {
    fn drop(&mut self) {
        if let Some(mut c) = self.0.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Removes the per-run segment at the end.
struct RemoveSegment(Option<String>);
impl Drop for RemoveSegment {
    fn drop(&mut self) {
        if let Some(n) = &self.0 {
            let _ = store::remove_segment(Path::new(store::DEFAULT_SHM_DIR), n, true);
        }
    }
}

fn child_args(a: &StoreDemoArgs, phase: &str) -> Vec<String> {
    let mut v = vec![
        "store-demo".to_string(),
        "--phase".into(),
        phase.into(),
        "--preset".into(),
        a.preset.clone(),
        "--tokens".into(),
        a.tokens.to_string(),
        "--layout".into(),
        a.layout.clone(),
    ];
    if let Some(s) = &a.shm {
        v.extend(["--shm".into(), s.clone()]);
    }
    if let Some(d) = &a.disk {
        v.extend(["--disk".into(), d.display().to_string()]);
    }
    if let Some(n) = a.capacity_blocks {
        v.extend(["--capacity-blocks".into(), n.to_string()]);
    }
    if let Some(p) = &a.plugin {
        v.extend(["--plugin".into(), p.display().to_string()]);
    }
    if let Some(l) = a.layers {
        v.extend(["--layers".into(), l.to_string()]);
    }
    if let Some(b) = a.staging_budget {
        v.extend(["--staging-budget".into(), b.to_string()]);
    }
    v
}

/// Runs one phase; returns its report once printed (the put phase keeps running until killed).
fn spawn_phase(a: &StoreDemoArgs, phase: &str) -> Result<(KillOnDrop, Option<PhaseReport>)> {
    let exe = std::env::current_exe().map_err(|e| Error::io("current_exe", e))?;
    let mut child = Command::new(exe)
        .args(child_args(a, phase))
        .stdout(Stdio::piped())
        .spawn()
        .map_err(|e| Error::io(format!("spawn the {phase} phase"), e))?;
    let out = child.stdout.take().expect("piped stdout");
    let guard = KillOnDrop(Some(child));
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for l in BufReader::new(out).lines().map_while(|l| l.ok()) {
            if tx.send(l).is_err() {
                break;
            }
        }
    });
    let deadline = Instant::now() + Duration::from_secs(600);
    let mut rep = None;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(l) => {
                if let Some(j) = l.strip_prefix("REPORT ") {
                    rep = serde_json::from_str(j).ok();
                    if phase == "get" {
                        continue;
                    }
                } else if l == "WAITING-FOR-SIGKILL" {
                    break;
                } else {
                    outln!("  [{phase}] {l}");
                }
            }
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => break,
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                return Err(Error::Timeout(format!("the {phase} phase took over 600 s")));
            }
        }
    }
    Ok((guard, rep))
}

/// The first few block ids, comma-separated.
fn ids_text(ids: &[u32]) -> String {
    ids[..ids.len().min(6)]
        .iter()
        .map(|i| i.to_string())
        .collect::<Vec<_>>()
        .join(",")
}

fn gbps(bytes: u64, secs: f64) -> String {
    if secs > 0.0 {
        format!("{:.2}", bytes as f64 / secs / 1e9)
    } else {
        "-".into()
    }
}

fn pct(a: u64, b: u64) -> String {
    if b == 0 {
        "-".into()
    } else {
        format!("{:.1}%", a as f64 * 100.0 / b as f64)
    }
}

/// `tpu-sync store-demo`.
pub fn run(args: &StoreDemoArgs) -> Result<ExitCode> {
    match args.phase.as_deref() {
        Some("put") => return phase_put(args),
        Some("get") => return phase_get(args),
        Some(p) => {
            return Err(Error::InvalidArgument(format!("unknown --phase {p}")));
        }
        None => {}
    }
    let t0 = Instant::now();
    let s = setup(args)?;
    if let Some(n) = &args.shm {
        store::shm::validate_name(n)?;
    }
    let mut a = args.clone();
    let per_run = a.shm.is_none() && a.disk.is_none();
    if per_run {
        a.shm = Some(format!("store-demo-{}", std::process::id()));
    }
    let _cleanup = RemoveSegment(per_run.then(|| a.shm.clone()).flatten());
    let total = s.block_bytes() * s.blocks as u64;
    outln!(
        "tpu-sync store-demo: {} ({} layers, {} KV heads x {}, {} planes, {}), {} tokens = {} \
         of KV in {} blocks of {}",
        s.model.name,
        s.model.num_layers,
        s.model.num_kv_heads,
        s.model.head_dim,
        s.model.kv_planes,
        s.model.dtype.name(),
        s.tokens,
        fmt_bytes(total),
        s.blocks,
        fmt_bytes(s.block_bytes())
    );
    if s.tokens != a.tokens {
        outln!(
            "  note: --tokens {} is not a multiple of the block size {}: storing the {} full \
             blocks ({} tokens); the last {} tokens are not offloaded (an engine recomputes a \
             partial block)",
            a.tokens,
            s.layout.spec.block_size,
            s.blocks,
            s.tokens,
            a.tokens - s.tokens
        );
    }
    let survives = match (&a.shm, &a.disk) {
        (Some(n), None) if per_run => format!("per-run shm segment {n} (removed at the end)"),
        (Some(n), None) => format!("shm segment {n}"),
        (None, Some(d)) => format!("disk tier {} (DRAM is flushed to disk)", d.display()),
        (Some(n), Some(d)) => format!("shm segment {n} + disk tier {}", d.display()),
        (None, None) => unreachable!("a per-run segment is chosen"),
    };
    outln!("  the prompt survives the restart in: {survives}");

    let (mut put_proc, put) = spawn_phase(&a, "put")?;
    let Some(put) = put else {
        let how = match put_proc.0.take().map(|mut c| c.wait()) {
            Some(Ok(s)) => crate::demo::exit_text(&s),
            Some(Err(e)) => format!("with an unknown status ({e})"),
            None => "with an unknown status".into(),
        };
        errln!(
            "store-demo FAILED: the put phase exited {how} without reporting (its error is \
             printed above)"
        );
        return Ok(ExitCode::from(1));
    };
    // Restart for real: kill the put process without any shutdown.
    let mut child = put_proc.0.take().expect("put child");
    // SAFETY: signalling our own child process.
    unsafe { libc::kill(child.id() as i32, libc::SIGKILL) };
    let killed = child
        .wait()
        .map_err(|e| Error::io("wait for the put phase", e))?;

    let (mut get_proc, get) = spawn_phase(&a, "get")?;
    let gstatus = get_proc
        .0
        .take()
        .expect("get child")
        .wait()
        .map_err(|e| Error::io("wait for the get phase", e))?;
    let Some(get) = get else {
        errln!(
            "store-demo FAILED: the get phase exited {} without reporting (its error is printed \
             above)",
            crate::demo::exit_text(&gstatus)
        );
        return Ok(ExitCode::from(1));
    };

    outln!(
        "  PJRT {} plugin; DMA map of the tier: {}",
        put.platform,
        put.dma
    );
    outln!(
        "  process 1 (pid {}): tier {} after {:.0} ms (prepared in the background): {}{}",
        put.pid,
        put.attach,
        put.ready_ms,
        put.lock,
        put.disk
            .as_ref()
            .map(|d| format!(", disk {d}"))
            .unwrap_or_default()
    );
    outln!(
        "  process 1: put {} blocks from device block ids {}.. ({} new, {} already present, {} \
         spilled to disk, {} flushed to disk), then deleted the device buffers and was killed \
         ({killed})",
        put.blocks,
        ids_text(&put.block_ids),
        put.stored,
        put.present,
        put.spilled,
        put.flushed
    );
    outln!(
        "  process 2 (pid {}): tier {} after {:.0} ms: {} blocks found in DRAM, {} on disk",
        get.pid,
        get.attach,
        get.ready_ms,
        get.restored_dram,
        get.restored_disk
    );
    outln!(
        "  lookup: {}/{} blocks hit ({}): {} in DRAM, {} on disk",
        get.lookup_hits,
        get.blocks,
        pct(get.lookup_hits, get.blocks),
        get.lookup_dram,
        get.lookup_disk
    );
    outln!();
    outln!(
        "  {:<10} {:>8} {:>10} {:>10} {:>8}",
        "phase",
        "blocks",
        "bytes",
        "seconds",
        "GB/s"
    );
    outln!(
        "  {:<10} {:>8} {:>10} {:>10.4} {:>8}",
        "put (D2H)",
        put.stored,
        fmt_bytes(put.bytes),
        put.secs,
        gbps(put.bytes, put.secs)
    );
    outln!(
        "  {:<10} {:>8} {:>10} {:>10.4} {:>8}",
        "get (H2D)",
        get.delivered,
        fmt_bytes(get.bytes),
        get.secs,
        gbps(get.bytes, get.secs)
    );
    outln!(
        "  get: {} blocks from DRAM, {} loaded from disk through DRAM{}",
        get.from_dram,
        get.from_disk,
        get.stop
            .as_ref()
            .map(|s| format!(", stopped: {s}"))
            .unwrap_or_default()
    );
    outln!(
        "  checked: {} of prompt KV element by element in device blocks {}.., {} outside the \
         prompt unchanged",
        fmt_bytes(get.verified_request_bytes),
        ids_text(&get.block_ids),
        fmt_bytes(get.verified_background_bytes)
    );
    outln!("  wall time: {:.2} s", t0.elapsed().as_secs_f64());
    if !per_run {
        if let Some(n) = &a.shm {
            outln!("  segment {n} kept: `tpu-sync shm list`, `tpu-sync shm rm {n}`");
        }
    }
    let ok = gstatus.success()
        && get.mismatches == 0
        && get.delivered == s.blocks as u64
        && get.lookup_hits == s.blocks as u64
        && get.verified_request_bytes == total
        && get.bytes == total;
    if ok {
        outln!(
            "verified: {} bytes, {} blocks, {} layers: put from device blocks in process {}, \
             killed, reloaded into other device blocks in process {} ({} from DRAM, {} from disk)",
            total,
            s.blocks,
            s.model.num_layers,
            put.pid,
            get.pid,
            get.from_dram,
            get.from_disk
        );
        Ok(ExitCode::SUCCESS)
    } else {
        outln!(
            "FAILED: {} of {} blocks delivered, {} mismatching elements (first: {}), get phase \
             exited {}",
            get.delivered,
            s.blocks,
            get.mismatches,
            get.first_mismatch.as_deref().unwrap_or("-"),
            crate::demo::exit_text(&gstatus)
        );
        Ok(ExitCode::from(1))
    }
}

/// `tpu-sync shm list|rm`.
pub fn shm(cmd: &ShmCmd) -> Result<ExitCode> {
    match cmd {
        ShmCmd::List { dir } => {
            let l = store::list_segments(dir)?;
            if l.is_empty() {
                outln!("no tpu-sync KV segments in {}", dir.display());
                return Ok(ExitCode::SUCCESS);
            }
            outln!(
                "{:<28} {:>10} {:>6} {:>5} {:>7} {:>16}  namespace",
                "name",
                "size",
                "uid",
                "mode",
                "in use",
                "blocks/slots"
            );
            for s in l {
                let blocks = s
                    .blocks
                    .map(|(bb, slots, used)| format!("{used}/{slots} x {}", fmt_bytes(bb)))
                    .unwrap_or_else(|| "-".into());
                outln!(
                    "{:<28} {:>10} {:>6} {:>5o} {:>7} {:>16}  {}",
                    s.name,
                    fmt_bytes(s.bytes),
                    s.uid,
                    s.mode,
                    if s.in_use { "yes" } else { "no" },
                    blocks,
                    s.namespace.as_deref().unwrap_or("(no valid header)")
                );
            }
            Ok(ExitCode::SUCCESS)
        }
        ShmCmd::Rm { name, dir, force } => {
            store::remove_segment(dir, name, *force)?;
            outln!("removed {}", store::shm::segment_path(dir, name).display());
            Ok(ExitCode::SUCCESS)
        }
    }
}
