//! The network scenarios of `tpu-sync bench` (`net`, `reshard`, `latency`) and their helper
//! process.
//!
//! The helper (`tpu-sync bench-peer`, hidden) is the remote side: it listens with one
//! `net::Endpoint` per transport and registers each case's source blocks (the bench process
//! pulls them) and push destinations (the bench process pushes into them), and it serves the
//! raw-socket baseline: one plain blocking TCP socket that answers `G <n>` with `n` bytes. The
//! bench process drives it over stdin/stdout, one JSON command and one answer per line
//! (`OK ...` or `ERR message`). Both sides build every case from the same [`CaseSpec`]
//! deterministically (placements, plan, source contents), so each side can compute the bytes the
//! other must have received.

use std::collections::{BTreeMap, HashMap};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, ChildStdout, Command, ExitCode, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use clap::Args;
use serde::{Deserialize, Serialize};
use tpu_sync::arena::ArenaOptions;
use tpu_sync::layout::{ModelKv, ParallelLayout, ParallelSpec};
use tpu_sync::net::{
    plan_staging, Endpoint, EndpointOptions, PeerMap, PullRequest, Security, SourceRegistration,
    TransportKind,
};
use tpu_sync::pattern::{mix64, RankContents};
use tpu_sync::pjrt::{Capabilities, Client, DeviceBuffer};
use tpu_sync::plan::{FanOut, Placement, Plan};
use tpu_sync::staging::Staging;
use tpu_sync::transfer::{
    ExpectPush, KvBuffers, Offer, Pipeline, PullInto, PushFrom, Report as PipeReport,
    TransferHandle, TransferOptions,
};
use tpu_sync::util::fmt_bytes;
use tpu_sync::{Error, Result};

use super::{fill_pattern, first_diff, Bench, BenchArgs, Size, System};

/// Background salt of source buffers (bytes outside the request; never staged).
const SRC_SALT: u64 = 0x6265_6e63_6800;
/// Seed of the raw socket's bytes.
const RAW_SEED: u64 = 0x7261_7700;
/// Request ids of pull sources: `SOURCE_RID + case`.
const SOURCE_RID: u64 = 1 << 40;

/// One transfer as both processes build it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub(crate) struct CaseSpec {
    /// Model preset.
    pub preset: String,
    /// Layers of the preset used.
    pub layers: u32,
    /// Tokens of the request.
    pub tokens: u32,
    /// Prefill (source) layout SPEC.
    pub src: String,
    /// Decode (destination) layout SPEC.
    pub dst: String,
    /// DP rank of the destination replica.
    pub dst_dp: u32,
    /// Whether both processes also hold the case in PJRT device buffers and move it through
    /// `transfer::Pipeline` (offer / pull / push / expect_push, as the engines do) instead of
    /// `net::Endpoint` on staging.
    #[serde(default)]
    pub device: bool,
}

impl CaseSpec {
    fn plain(preset: &str, layers: u32, tokens: u32) -> CaseSpec {
        CaseSpec {
            preset: preset.into(),
            layers,
            tokens,
            src: "tp=1,block=16".into(),
            dst: "tp=1,block=16".into(),
            dst_dp: 0,
            device: false,
        }
    }

    /// [`CaseSpec::plain`] held in device buffers, moved through the pipeline.
    fn device(preset: &str, layers: u32, tokens: u32) -> CaseSpec {
        CaseSpec {
            device: true,
            ..CaseSpec::plain(preset, layers, tokens)
        }
    }
}

/// A built case: both placements, the plan, source staging filled with the request's KV
/// (`tpu_sync::pattern`, a function of each element's logical coordinates, so TP replicas hold
/// the same bytes) and empty destination staging.
pub(crate) struct Case {
    pub src: Placement,
    pub dst: Placement,
    pub tokens: u32,
    pub plan: Arc<Plan>,
    pub src_st: Arc<Staging>,
    pub dst_st: Arc<Staging>,
    /// Bytes of the request's KV, counted once (the model's bytes per token x tokens).
    pub request_bytes: u64,
}

fn sized_placement(m: &ModelKv, spec: &str, dp: u32, tokens: u32, seed: u64) -> Result<Placement> {
    let spec = ParallelSpec::parse(spec)?;
    let probe = ParallelLayout {
        model: m.clone(),
        spec,
        num_blocks: 1,
        physical_layout: None,
        block_format: None,
    };
    let per_rank = probe.pcp_chunk(tokens, 0)?.len() as u32;
    let layout = ParallelLayout::new(m.clone(), spec, per_rank * 2 + 3)?;
    let block_ids = (0..spec.ranks_per_replica())
        .map(|local| {
            let n = layout.pcp_chunk(tokens, local / spec.tp)?.len() as u32;
            // Every other block, rotated per rank: scattered, never adjacent.
            let nb = layout.num_blocks;
            Ok((0..n)
                .map(|i| (i * 2 + 1 + 2 * (seed as u32 + local)) % nb)
                .collect())
        })
        .collect::<Result<Vec<Vec<u32>>>>()?;
    Ok(Placement {
        first_token: 0,
        layout,
        dp_rank: dp,
        block_ids,
        groups: None,
    })
}

fn arena() -> ArenaOptions {
    // Not mlocked: both processes of a benchmark hold several copies of up to 64 MiB.
    ArenaOptions {
        lock: false,
        huge_pages: true,
        populate: true,
    }
}

impl Case {
    pub fn build(s: &CaseSpec) -> Result<Case> {
        let mut m = ModelKv::preset(&s.preset)?;
        if s.layers == 0 || s.layers > m.num_layers {
            return Err(Error::InvalidArgument(format!(
                "{} has {} layers, not {}",
                s.preset, m.num_layers, s.layers
            )));
        }
        m.num_layers = s.layers;
        let src = sized_placement(&m, &s.src, 0, s.tokens, 0)?;
        let dst = sized_placement(&m, &s.dst, s.dst_dp, s.tokens, 1)?;
        let plan = Arc::new(Plan::build(&src, &dst, s.tokens)?);
        let ranges = (0..src.layout.spec.ranks_per_replica())
            .map(|l| (src.global_rank(l), src.block_ranges(l)))
            .collect();
        let src_st = Arc::new(Staging::new(ranges, &arena())?);
        let kv = src.layout.rank_kv()?;
        let mut layer = vec![0u8; kv.buffer_bytes() as usize];
        for rank in src_st.ranks().collect::<Vec<_>>() {
            let rc = RankContents::new(&src, rank, s.tokens, SRC_SALT)?;
            for l in 0..kv.num_layers {
                rc.fill_layer(l, &mut layer)?;
                for r in src_st.ranges(rank).iter().filter(|r| r.range.buffer == l) {
                    // SAFETY: setup, nobody else uses the staging yet; the region is in bounds.
                    let dst = unsafe { src_st.arena().slice_mut(r.region.offset, r.range.len)? };
                    let o = r.range.offset as usize;
                    dst.copy_from_slice(&layer[o..o + r.range.len as usize]);
                }
            }
        }
        drop(layer);
        let dst_st = Arc::new(Staging::new(plan_staging(&plan, &dst), &arena())?);
        Ok(Case {
            request_bytes: m.bytes_per_token() * s.tokens as u64,
            src,
            dst,
            tokens: s.tokens,
            plan,
            src_st,
            dst_st,
        })
    }

    /// The destination staging as the plan says it must end: every span's source bytes copied
    /// to its destination (indexed like the destination arena).
    fn expected(&self) -> Result<Vec<u8>> {
        let mut out = vec![0u8; self.dst_st.arena().len()];
        let base = self.dst_st.arena().base() as usize;
        for s in &self.plan.spans {
            for (so, d) in s.runs() {
                let from = self.src_st.resolve(s.src_rank, s.src_buffer, so, s.len)?;
                let to = self.dst_st.resolve(s.dst_rank, s.dst_buffer, d, s.len)? as usize - base;
                // SAFETY: `resolve` checked the source range lies in the source staging, which
                // nobody writes after setup.
                let src = unsafe { std::slice::from_raw_parts(from as *const u8, s.len as usize) };
                out[to..to + s.len as usize].copy_from_slice(src);
            }
        }
        Ok(out)
    }

    /// Zeroes every staged destination range.
    fn clear_dst(&self) {
        for r in self.dst_st.ranks().collect::<Vec<_>>() {
            for s in self.dst_st.ranges(r) {
                // SAFETY: inside the arena; no transfer into it runs now.
                unsafe {
                    std::ptr::write_bytes(
                        self.dst_st.arena().base().add(s.region.offset as usize),
                        0,
                        s.range.len as usize,
                    )
                }
            }
        }
    }

    /// Checks every staged destination byte against [`Case::expected`].
    fn verify_dst(&self) -> Result<()> {
        let want = self.expected()?;
        for r in self.dst_st.ranks().collect::<Vec<_>>() {
            for s in self.dst_st.ranges(r) {
                let o = s.region.offset as usize;
                // SAFETY: inside the arena; no transfer into it runs now.
                let got = unsafe { self.dst_st.arena().slice(s.region.offset, s.range.len)? };
                if let Some(i) = first_diff(got, &want[o..o + s.range.len as usize]) {
                    return Err(Error::Mismatch(format!(
                        "destination rank {r} layer {} device byte {}: got {:#04x}, the plan \
                         delivers {:#04x}",
                        s.range.buffer,
                        s.range.offset + i as u64,
                        got[i],
                        want[o + i]
                    )));
                }
            }
        }
        Ok(())
    }
}

/// Fills one layer buffer's host bytes: `(global rank, layer, bytes)`.
type LayerFill<'a> = dyn Fn(u32, u32, &mut [u8]) -> Result<()> + 'a;

/// The PJRT client (the plugin's first device) of a process's device cases.
pub(crate) struct Dev {
    client: Client,
    caps: Capabilities,
}

impl Dev {
    /// Opens the plugin (`--plugin`, else the default one) with one device; it must offer an
    /// in-place H2D path (pulls and pushes write into the destination buffers).
    fn open(plugin: Option<&std::path::Path>) -> Result<Dev> {
        let (client, caps) = crate::kvproc::open_client(plugin, Some(1))?;
        caps.require_h2d()?;
        Ok(Dev { client, caps })
    }
}

/// A case in PJRT device buffers, as an engine holds it: the source ranks' layer buffers
/// filled with the request's KV (the same contents as [`Case::src_st`]) and the destination
/// ranks' layer buffers, zero outside what the plan writes.
pub(crate) struct DevCase {
    src: KvBuffers,
    dst: KvBuffers,
}

impl DevCase {
    fn build(c: &Case, dev: &Dev) -> Result<DevCase> {
        let device = dev.client.device(0)?;
        let buffers = |p: &Placement, fill: &LayerFill| {
            let kv = p.layout.rank_kv()?;
            let mut host = vec![0u8; kv.buffer_bytes() as usize];
            let mut by_rank: BTreeMap<u32, Vec<DeviceBuffer>> = BTreeMap::new();
            for local in 0..p.layout.spec.ranks_per_replica() {
                let rank = p.global_rank(local);
                let bufs = (0..kv.num_layers)
                    .map(|l| {
                        fill(rank, l, &mut host)?;
                        dev.client.buffer_from_host(
                            &host,
                            kv.dtype.element_type(),
                            &kv.dims(),
                            &device,
                        )
                    })
                    .collect::<Result<Vec<_>>>()?;
                by_rank.insert(rank, bufs);
            }
            KvBuffers::new(&dev.caps, by_rank)
        };
        let src = buffers(&c.src, &|rank, l, host| {
            RankContents::new(&c.src, rank, c.tokens, SRC_SALT)?.fill_layer(l, host)
        })?;
        let dst = buffers(&c.dst, &|_, _, host| {
            host.fill(0);
            Ok(())
        })?;
        Ok(DevCase { src, dst })
    }

    /// Zeroes the request's destination blocks in the device buffers, in place (zeroed staging
    /// written through the plugin's H2D path).
    fn clear(&self, c: &Case) -> Result<()> {
        c.clear_dst();
        for r in self.dst.ranks() {
            if let Some(b) = self.dst.get(r) {
                c.dst_st.drain_to_device(self.dst.caps(), r, b)?;
            }
        }
        Ok(())
    }

    /// Reads every destination buffer back and checks each byte: the plan's spans carry the
    /// source's bytes, everything else is still zero.
    fn verify(&self, c: &Case) -> Result<()> {
        let skv = c.src.layout.rank_kv()?;
        let dkv = c.dst.layout.rank_kv()?;
        let mut src_layers: HashMap<(u32, u32), Vec<u8>> = HashMap::new();
        let mut want: BTreeMap<(u32, u32), Vec<u8>> = BTreeMap::new();
        for s in &c.plan.spans {
            let key = (s.src_rank, s.src_buffer);
            let from = match src_layers.entry(key) {
                std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
                std::collections::hash_map::Entry::Vacant(e) => {
                    let mut v = vec![0u8; skv.buffer_bytes() as usize];
                    RankContents::new(&c.src, s.src_rank, c.tokens, SRC_SALT)?
                        .fill_layer(s.src_buffer, &mut v)?;
                    e.insert(v)
                }
            };
            let to = want
                .entry((s.dst_rank, s.dst_buffer))
                .or_insert_with(|| vec![0u8; dkv.buffer_bytes() as usize]);
            let n = s.len as usize;
            for (so, d) in s.runs() {
                to[d as usize..d as usize + n].copy_from_slice(&from[so as usize..so as usize + n]);
            }
        }
        let mut got = vec![0u8; dkv.buffer_bytes() as usize];
        for r in self.dst.ranks() {
            for (l, b) in self.dst.get(r).unwrap_or_default().iter().enumerate() {
                b.to_host(&mut got)?;
                let zeros;
                let w = match want.get(&(r, l as u32)) {
                    Some(w) => w,
                    None => {
                        zeros = vec![0u8; got.len()];
                        &zeros
                    }
                };
                if let Some(i) = first_diff(&got, w) {
                    return Err(Error::Mismatch(format!(
                        "destination rank {r} layer {l} device buffer byte {i}: got {:#04x}, \
                         the plan delivers {:#04x}",
                        got[i], w[i]
                    )));
                }
            }
        }
        Ok(())
    }
}

/// A buffer of the same kind of memory as the staging (a populated arena on transparent huge
/// pages), so the raw socket copies from and to memory like the endpoints' (`fill`: the raw
/// socket's pattern, else zeros).
struct RawBuf(tpu_sync::arena::PinnedArena);

impl RawBuf {
    fn new(n: usize, fill: bool) -> Result<RawBuf> {
        let a = tpu_sync::arena::PinnedArena::new(n.max(1), &arena())?;
        if fill {
            // SAFETY: just created; nobody else references it.
            fill_pattern(unsafe { a.slice_mut(0, n as u64)? }, RAW_SEED);
        }
        Ok(RawBuf(a))
    }

    fn get(&self) -> &[u8] {
        // SAFETY: the arena lives as long as `self`; written only through `get_mut`.
        unsafe { std::slice::from_raw_parts(self.0.base(), self.0.len()) }
    }

    fn get_mut(&mut self) -> &mut [u8] {
        // SAFETY: as above; `&mut self` makes this the only reference.
        unsafe { std::slice::from_raw_parts_mut(self.0.base(), self.0.len()) }
    }
}

/// Commands from the bench process to its helper, one JSON object per line.
#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
enum PeerCmd {
    /// Build case `case` and register its source on every endpoint (request `SOURCE_RID + case`).
    Setup { case: u32, spec: CaseSpec },
    /// Expect pushes of requests `first_rid..` on `transport` into the case's destination
    /// staging, `window` registered ahead at any time (each completion registers the next).
    Expect {
        case: u32,
        transport: String,
        first_rid: u64,
        window: u32,
    },
    /// Zero the case's destination staging.
    Clear { case: u32 },
    /// Wait for push `rid` to complete, then check the destination staging.
    Verify {
        case: u32,
        transport: String,
        rid: u64,
    },
    /// Unregister and free case `case`.
    Drop { case: u32 },
    /// Exit.
    Quit,
}

/// Flags of the hidden `tpu-sync bench-peer` helper (started by `tpu-sync bench`).
#[derive(Args, Debug, Clone)]
pub struct PeerArgs {
    /// Transports to listen on.
    #[arg(long, value_delimiter = ',')]
    transports: Vec<String>,
    /// Pre-shared key file for tls/quic.
    #[arg(long)]
    psk_file: PathBuf,
    /// Streams per pair.
    #[arg(long)]
    streams: u32,
    /// Chunk bytes.
    #[arg(long)]
    chunk_bytes: u64,
    /// Largest raw-socket transfer.
    #[arg(long)]
    raw_bytes: u64,
    /// PJRT plugin of the device cases (default: the CPU plugin of `make plugin`).
    #[arg(long)]
    plugin: Option<PathBuf>,
}

fn options(
    name: String,
    kind: TransportKind,
    psk: &std::path::Path,
    listen: Option<std::net::SocketAddr>,
    streams: u32,
    chunk_bytes: u64,
    quic_connections: u32,
) -> Result<EndpointOptions> {
    Ok(EndpointOptions {
        name,
        transport: kind,
        security: if !kind.authenticates() {
            Security::None
        } else {
            Security::from_psk_file(psk)?
        },
        listen,
        lease_ttl: Duration::from_secs(3600),
        streams_per_pair: streams,
        chunk_bytes,
        quic_connections_per_peer: quic_connections,
        ..EndpointOptions::default()
    })
}

fn runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| Error::io("tokio runtime", e))
}

/// Serves the raw baseline on one accepted socket: `G` + u64 LE length -> that many bytes.
fn raw_serve(mut s: TcpStream, data: Arc<RawBuf>) {
    let data = data.get();
    let _ = s.set_nodelay(true);
    let mut hdr = [0u8; 9];
    loop {
        if s.read_exact(&mut hdr).is_err() {
            return;
        }
        let n =
            (u64::from_le_bytes(hdr[1..9].try_into().unwrap_or([0; 8])) as usize).min(data.len());
        if hdr[0] != b'G' || s.write_all(&data[..n]).is_err() {
            return;
        }
    }
}

/// A push destination pool of the helper: `window` registrations ahead of the pushes, each
/// an expected push of the pipeline into the case's device buffers.
struct Pool {
    done: Mutex<HashMap<u64, std::result::Result<(), String>>>,
    notify: tokio::sync::Notify,
    pending: Mutex<HashMap<u64, TransferHandle>>,
    stop: std::sync::atomic::AtomicBool,
}

struct PeerCase {
    case: Arc<Case>,
    /// The case in device buffers (device cases only).
    dev: Option<Arc<DevCase>>,
    pools: HashMap<String, Arc<Pool>>,
}

fn expect_one(
    pipe: &Arc<Pipeline>,
    case: &Arc<Case>,
    dev: &Arc<DevCase>,
    pool: &Arc<Pool>,
    rid: u64,
    window: u64,
) -> Result<()> {
    if pool.stop.load(std::sync::atomic::Ordering::Acquire) {
        return Ok(());
    }
    let t = pipe.expect_push(ExpectPush {
        request_id: rid,
        num_tokens: case.tokens,
        src: case.src.clone(),
        dst: case.dst.clone(),
        kv: dev.dst.clone(),
    })?;
    pool.pending
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .insert(rid, t.clone());
    let (pipe, case, dev, pool) = (pipe.clone(), case.clone(), dev.clone(), pool.clone());
    tokio::spawn(async move {
        let r = t.wait().await.map(|_| ()).map_err(|e| e.to_string());
        pool.pending
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&rid);
        pool.done
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(rid, r);
        pool.notify.notify_waiters();
        if let Err(e) = expect_one(&pipe, &case, &dev, &pool, rid + window, window) {
            log::warn!("bench-peer: expect push {}: {e}", rid + window);
        }
    });
    Ok(())
}

/// `tpu-sync bench-peer`: the remote side of the network scenarios (see the module docs).
pub fn peer_main(a: &PeerArgs) -> Result<ExitCode> {
    let rt = runtime()?;
    let _g = rt.enter();
    let mut eps: BTreeMap<String, Arc<Endpoint>> = BTreeMap::new();
    let mut pipes: BTreeMap<String, Arc<Pipeline>> = BTreeMap::new();
    let mut addrs: BTreeMap<String, String> = BTreeMap::new();
    for t in &a.transports {
        let kind = TransportKind::parse(t)?;
        let o = options(
            format!("bench-peer-{}-{t}", std::process::id()),
            kind,
            &a.psk_file,
            Some(([127, 0, 0, 1], 0).into()),
            a.streams,
            a.chunk_bytes,
            tpu_sync::net::quic::DEFAULT_CONNECTIONS_PER_PEER,
        )?;
        let ep = rt.block_on(Endpoint::bind(o))?;
        addrs.insert(
            t.clone(),
            ep.local_addr()
                .map(|x| x.to_string())
                .ok_or_else(|| Error::InvalidArgument("endpoint without a listener".into()))?,
        );
        let ep = Arc::new(ep);
        pipes.insert(
            t.clone(),
            Arc::new(Pipeline::new(ep.clone(), TransferOptions::default())?),
        );
        eps.insert(t.clone(), ep);
    }
    let dev = Dev::open(a.plugin.as_deref())?;
    let raw = TcpListener::bind("127.0.0.1:0").map_err(|e| Error::io("raw listener", e))?;
    addrs.insert(
        "raw".into(),
        raw.local_addr()
            .map_err(|e| Error::io("raw listener", e))?
            .to_string(),
    );
    let data = Arc::new(RawBuf::new(a.raw_bytes as usize, true)?);
    std::thread::spawn(move || {
        for s in raw.incoming().flatten() {
            let d = data.clone();
            std::thread::spawn(move || raw_serve(s, d));
        }
    });
    outln!(
        "READY {}",
        serde_json::to_string(&addrs).unwrap_or_default()
    );
    let mut cases: HashMap<u32, PeerCase> = HashMap::new();
    let stdin = std::io::stdin();
    for line in stdin.lock().lines() {
        let Ok(line) = line else { break };
        let cmd: PeerCmd = match serde_json::from_str(&line) {
            Ok(c) => c,
            Err(e) => {
                outln!("ERR bad command `{line}`: {e}");
                continue;
            }
        };
        if matches!(cmd, PeerCmd::Quit) {
            break;
        }
        let r = peer_command(&rt, &eps, &pipes, &dev, &mut cases, cmd);
        match r {
            Ok(()) => outln!("OK"),
            Err(e) => outln!("ERR {}", e.to_string().replace('\n', " ")),
        }
    }
    for pc in cases.values() {
        for p in pc.pools.values() {
            p.stop.store(true, std::sync::atomic::Ordering::Release);
        }
    }
    for (t, p) in &pipes {
        log::info!("bench-peer {t} staging pool: {:?}", p.stats().pool);
    }
    rt.block_on(async {
        for ep in eps.values() {
            ep.shutdown(Some(Duration::from_millis(200))).await;
        }
    });
    Ok(ExitCode::SUCCESS)
}

#[allow(clippy::too_many_lines)]
fn peer_command(
    rt: &tokio::runtime::Runtime,
    eps: &BTreeMap<String, Arc<Endpoint>>,
    pipes: &BTreeMap<String, Arc<Pipeline>>,
    dev: &Dev,
    cases: &mut HashMap<u32, PeerCase>,
    cmd: PeerCmd,
) -> Result<()> {
    let pipe_of = |t: &str| {
        pipes
            .get(t)
            .cloned()
            .ok_or_else(|| Error::InvalidArgument(format!("no {t} endpoint")))
    };
    let case_of = |cases: &HashMap<u32, PeerCase>, c: u32| {
        cases
            .get(&c)
            .map(|p| p.case.clone())
            .ok_or_else(|| Error::InvalidArgument(format!("no case {c}")))
    };
    let dev_of = |cases: &HashMap<u32, PeerCase>, c: u32| cases.get(&c).and_then(|p| p.dev.clone());
    match cmd {
        PeerCmd::Setup { case, spec } => {
            let c = Arc::new(Case::build(&spec)?);
            let rid = SOURCE_RID + case as u64;
            let dc = if spec.device {
                // Offered through each pipeline from the device buffers (check, staging, D2H,
                // registration), pullable any number of times.
                let dc = Arc::new(DevCase::build(&c, dev)?);
                for p in pipes.values() {
                    p.offer(Offer {
                        request_id: rid,
                        num_tokens: c.tokens,
                        placement: c.src.clone(),
                        kv: dc.src.clone(),
                        expected_releases: u32::MAX,
                    })?;
                }
                Some(dc)
            } else {
                for ep in eps.values() {
                    ep.register_source(SourceRegistration {
                        request_id: rid,
                        num_tokens: c.tokens,
                        placement: c.src.clone(),
                        staging: c.src_st.clone(),
                        layers_ready: None,
                        expected_releases: 1,
                    })?;
                }
                None
            };
            cases.insert(
                case,
                PeerCase {
                    case: c,
                    dev: dc,
                    pools: HashMap::new(),
                },
            );
        }
        PeerCmd::Expect {
            case,
            transport,
            first_rid,
            window,
        } => {
            let c = case_of(cases, case)?;
            let dc = dev_of(cases, case).ok_or_else(|| {
                Error::InvalidArgument(format!("case {case} is not held in device buffers"))
            })?;
            let pipe = pipe_of(&transport)?;
            let pool = Arc::new(Pool {
                done: Mutex::new(HashMap::new()),
                notify: tokio::sync::Notify::new(),
                pending: Mutex::new(HashMap::new()),
                stop: false.into(),
            });
            let _g = rt.enter();
            for k in 0..window as u64 {
                expect_one(&pipe, &c, &dc, &pool, first_rid + k, window as u64)?;
            }
            if let Some(pc) = cases.get_mut(&case) {
                pc.pools.insert(transport, pool);
            }
        }
        PeerCmd::Clear { case } => {
            let c = case_of(cases, case)?;
            match dev_of(cases, case) {
                Some(dc) => dc.clear(&c)?,
                None => c.clear_dst(),
            }
        }
        PeerCmd::Verify {
            case,
            transport,
            rid,
        } => {
            let c = case_of(cases, case)?;
            let pool = cases
                .get(&case)
                .and_then(|p| p.pools.get(&transport))
                .cloned()
                .ok_or_else(|| Error::InvalidArgument(format!("no {transport} pushes expected")))?;
            let r = rt.block_on(async {
                tokio::time::timeout(Duration::from_secs(60), async {
                    loop {
                        let n = pool.notify.notified();
                        tokio::pin!(n);
                        n.as_mut().enable();
                        if let Some(r) = pool
                            .done
                            .lock()
                            .unwrap_or_else(|p| p.into_inner())
                            .remove(&rid)
                        {
                            return r;
                        }
                        n.await;
                    }
                })
                .await
            });
            match r {
                Err(_) => {
                    return Err(Error::Timeout(format!(
                        "push {rid} did not complete at the receiver"
                    )))
                }
                Ok(Err(e)) => return Err(Error::Remote(format!("push {rid} failed: {e}"))),
                Ok(Ok(())) => {}
            }
            match dev_of(cases, case) {
                Some(dc) => dc.verify(&c)?,
                None => c.verify_dst()?,
            }
        }
        PeerCmd::Drop { case } => {
            if let Some(pc) = cases.remove(&case) {
                for p in pc.pools.values() {
                    p.stop.store(true, std::sync::atomic::Ordering::Release);
                    for t in p
                        .pending
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .drain()
                        .map(|(_, t)| t)
                    {
                        t.cancel();
                    }
                }
                if pc.dev.is_some() {
                    for p in pipes.values() {
                        p.withdraw(SOURCE_RID + case as u64);
                    }
                } else {
                    for ep in eps.values() {
                        ep.unregister_source(SOURCE_RID + case as u64);
                    }
                }
            }
        }
        PeerCmd::Quit => {}
    }
    Ok(())
}

/// The bench process's handle on its helper, its own endpoints, and the raw socket.
pub(crate) struct Peer {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    addrs: BTreeMap<String, String>,
    raw: TcpStream,
    raw_buf: RawBuf,
    raw_want: RawBuf,
    rt: tokio::runtime::Runtime,
    eps: BTreeMap<String, Arc<Endpoint>>,
    /// One pipeline per transport over the endpoint of `eps` (device cases).
    pipes: BTreeMap<String, Pipeline>,
    dev: Dev,
    transports: Vec<String>,
    dir: PathBuf,
    next_case: u32,
}

impl Drop for Peer {
    fn drop(&mut self) {
        for (t, p) in &self.pipes {
            log::info!("bench {t} staging pool: {:?}", p.stats().pool);
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl Peer {
    /// Starts `tpu-sync bench-peer` and this process's endpoints (one per transport).
    pub fn spawn(a: &BenchArgs, raw_max: u64) -> Result<Peer> {
        let dir = std::env::temp_dir().join(format!("tpu-sync-bench-{}", std::process::id()));
        std::fs::create_dir_all(&dir).map_err(|e| Error::io("bench temp dir", e))?;
        let psk = dir.join("psk");
        let key: Vec<u8> = (0..32u64)
            .map(|i| (mix64(std::process::id() as u64 ^ i ^ 0x70736b) % 94 + 33) as u8)
            .collect();
        std::fs::write(&psk, &key).map_err(|e| Error::io("write bench psk", e))?;
        let exe = std::env::current_exe().map_err(|e| Error::io("current_exe", e))?;
        let mut child = Command::new(exe)
            .arg("bench-peer")
            .arg("--transports")
            .arg(a.transports.join(","))
            .arg("--psk-file")
            .arg(&psk)
            .arg("--streams")
            .arg(a.streams.to_string())
            .arg("--chunk-bytes")
            .arg(a.chunk_bytes.to_string())
            .arg("--raw-bytes")
            .arg(raw_max.max(16 << 10).to_string())
            .args(
                a.plugin
                    .iter()
                    .flat_map(|p| [std::ffi::OsStr::new("--plugin"), p.as_os_str()]),
            )
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|e| Error::io("spawn tpu-sync bench-peer", e))?;
        let stdin = child.stdin.take().expect("piped stdin");
        let mut stdout = BufReader::new(child.stdout.take().expect("piped stdout"));
        let mut line = String::new();
        stdout
            .read_line(&mut line)
            .map_err(|e| Error::io("read from bench-peer", e))?;
        let addrs: BTreeMap<String, String> = line
            .strip_prefix("READY ")
            .and_then(|j| serde_json::from_str(j.trim()).ok())
            .ok_or_else(|| {
                Error::PeerClosed(format!("bench-peer did not start (said `{}`)", line.trim()))
            })?;
        let raw = TcpStream::connect(&addrs["raw"]).map_err(|e| Error::io("connect raw", e))?;
        raw.set_nodelay(true)
            .map_err(|e| Error::io("TCP_NODELAY", e))?;
        let rt = runtime()?;
        let mut eps = BTreeMap::new();
        let mut pipes = BTreeMap::new();
        for t in &a.transports {
            let o = options(
                format!("bench-{}-{t}", std::process::id()),
                TransportKind::parse(t)?,
                &psk,
                None,
                a.streams,
                a.chunk_bytes,
                a.quic_connections,
            )?;
            let ep = Arc::new(rt.block_on(Endpoint::bind(o))?);
            let _g = rt.enter();
            pipes.insert(
                t.clone(),
                Pipeline::new(ep.clone(), TransferOptions::default())?,
            );
            eps.insert(t.clone(), ep);
        }
        let dev = Dev::open(a.plugin.as_deref())?;
        Ok(Peer {
            child,
            stdin,
            stdout,
            addrs,
            raw,
            raw_buf: RawBuf::new(raw_max.max(16 << 10) as usize, false)?,
            raw_want: RawBuf::new(raw_max.max(16 << 10) as usize, true)?,
            rt,
            eps,
            pipes,
            dev,
            transports: a.transports.clone(),
            dir,
            next_case: 0,
        })
    }

    fn cmd(&mut self, c: &PeerCmd) -> Result<()> {
        let line = serde_json::to_string(c).map_err(|e| Error::InvalidArgument(e.to_string()))?;
        writeln!(self.stdin, "{line}")
            .and_then(|_| self.stdin.flush())
            .map_err(|e| Error::io("write to bench-peer", e))?;
        let mut ans = String::new();
        self.stdout
            .read_line(&mut ans)
            .map_err(|e| Error::io("read from bench-peer", e))?;
        let ans = ans.trim();
        match ans.strip_prefix("ERR ") {
            _ if ans == "OK" => Ok(()),
            Some(m) => Err(Error::Remote(format!("bench-peer: {m}"))),
            None => Err(Error::PeerClosed(format!(
                "bench-peer answered `{ans}` to {line}"
            ))),
        }
    }

    /// Builds a case here and in the helper (which registers its source).
    fn setup(&mut self, spec: &CaseSpec) -> Result<(u32, Case)> {
        let id = self.next_case;
        self.next_case += 1;
        self.cmd(&PeerCmd::Setup {
            case: id,
            spec: spec.clone(),
        })?;
        Ok((id, Case::build(spec)?))
    }

    /// Builds a device case ([`CaseSpec::device`]) here and in the helper (which offers it).
    fn setup_dev(&mut self, spec: &CaseSpec) -> Result<DevEntry> {
        let (id, c) = self.setup(spec)?;
        let d = DevCase::build(&c, &self.dev)?;
        Ok((id, c, d))
    }

    pub fn quit(mut self) -> Result<()> {
        let quit = serde_json::to_string(&PeerCmd::Quit).unwrap_or_default();
        let _ = writeln!(self.stdin, "{quit}");
        let _ = self.stdin.flush();
        for _ in 0..100 {
            if let Ok(Some(_)) = self.child.try_wait() {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(())
    }

    /// One `memcpy` of `n` bytes between two buffers of this process (the bound of the
    /// same-host transport, which copies every byte once).
    fn memcpy(&mut self, n: usize, check: bool) -> Result<()> {
        if n > self.raw_buf.get().len() {
            return Err(Error::InvalidArgument(format!(
                "memcpy of {n} bytes: buffer too small"
            )));
        }
        if check {
            self.raw_buf.get_mut()[..n].fill(0);
        }
        let Peer {
            raw_buf, raw_want, ..
        } = self;
        raw_buf.get_mut()[..n].copy_from_slice(&raw_want.get()[..n]);
        if check {
            if let Some(i) = first_diff(&self.raw_buf.get()[..n], &self.raw_want.get()[..n]) {
                return Err(Error::Mismatch(format!("memcpy byte {i} differs")));
            }
        }
        Ok(())
    }

    /// One raw-socket transfer: ask for `n` bytes, read them.
    fn raw_get(&mut self, n: usize, check: bool) -> Result<()> {
        let mut hdr = [0u8; 9];
        hdr[0] = b'G';
        hdr[1..].copy_from_slice(&(n as u64).to_le_bytes());
        if check {
            self.raw_buf.get_mut()[..n].fill(0);
        }
        self.raw
            .write_all(&hdr)
            .and_then(|_| self.raw.read_exact(&mut self.raw_buf.get_mut()[..n]))
            .map_err(|e| Error::io("raw socket", e))?;
        if check {
            if let Some(i) = first_diff(&self.raw_buf.get()[..n], &self.raw_want.get()[..n]) {
                return Err(Error::Mismatch(format!("raw socket byte {i} differs")));
            }
        }
        Ok(())
    }

    fn bytes_received(&self, t: &str) -> u64 {
        self.eps
            .get(t)
            .map(|e| e.stats().bytes_received)
            .unwrap_or(0)
    }

    /// Pulls case `id` (all destination ranks, or `ranks`) over `t` and waits.
    fn pull(&self, t: &str, id: u32, c: &Case, ranks: Option<Vec<u32>>) -> Result<()> {
        let ep = &self.eps[t];
        let addr = self.addrs[t].clone();
        self.rt.block_on(async {
            let tr = ep.pull(PullRequest {
                request_id: SOURCE_RID + id as u64,
                num_tokens: c.tokens,
                src: c.src.clone(),
                sources: PeerMap::single(addr),
                dst: c.dst.clone(),
                staging: c.dst_st.clone(),
                dst_ranks: ranks,
                plan: Some(c.plan.clone()),
                wait_for_registration: None,
            })?;
            tr.wait().await.map(|_| ())
        })
    }

    /// Pulls device case `id` over `t` through the pipeline (plan, staging, pull, H2D into
    /// `d`'s destination buffers, release) and waits.
    fn pull_dev(&self, t: &str, id: u32, c: &Case, d: &DevCase) -> Result<PipeReport> {
        let p = &self.pipes[t];
        let req = PullInto {
            request_id: SOURCE_RID + id as u64,
            num_tokens: c.tokens,
            src: c.src.clone(),
            sources: PeerMap::single(self.addrs[t].clone()),
            dst: c.dst.clone(),
            kv: d.dst.clone(),
            wait_for_registration: None,
        };
        // Several layers: each is written as it arrives (H2D overlaps the network).
        let h = if d.dst.num_layers() > 1 {
            p.pull_layerwise(req)?
        } else {
            p.pull(req)?
        };
        self.rt.block_on(h.wait())
    }

    /// Pushes device case `c` from `d`'s source buffers as request `rid` over `t` through the
    /// pipeline (staging, D2H, push) and waits for the receiver's confirmation.
    fn push_dev(&self, t: &str, c: &Case, d: &DevCase, rid: u64) -> Result<PipeReport> {
        let p = &self.pipes[t];
        let h = {
            let _g = self.rt.enter();
            p.push(PushFrom {
                request_id: rid,
                num_tokens: c.tokens,
                src: c.src.clone(),
                kv: d.src.clone(),
                dst: c.dst.clone(),
                targets: PeerMap::single(self.addrs[t].clone()),
            })?
        };
        self.rt.block_on(h.wait())
    }
}

/// A device case: the helper's id, the case, its device buffers in this process.
type DevEntry = (u32, Case, DevCase);

/// Next push request id per transport and case.
struct Pushes {
    next: Vec<u64>,
}

/// Most bytes of expected-push staging the helper holds ahead per transport and case.
const PUSH_AHEAD_BYTES: u64 = 128 << 20;

fn push_rid_base(ti: usize, id: u32) -> u64 {
    (ti as u64 + 1) << 44 | (id as u64) << 24
}

/// Registers push pools in the helper for every case and transport: each case's window of
/// expected pushes (each one staged by the helper's pipeline) holds at most
/// [`PUSH_AHEAD_BYTES`], and at least 6 pushes (the helper registers push `rid + window` after
/// push `rid`'s H2D; with pooled staging this process can push three more before that H2D of a
/// 64 MiB case ends, and a push of an unregistered request fails).
fn expect_pushes(peer: &mut Peer, cases: &[DevEntry]) -> Result<Vec<Pushes>> {
    let ts = peer.transports.clone();
    let mut out = Vec::new();
    for (ti, t) in ts.iter().enumerate() {
        let mut next = Vec::new();
        for (id, c, _) in cases {
            let first = push_rid_base(ti, *id);
            let window = (PUSH_AHEAD_BYTES / c.plan.total_bytes().max(1)).clamp(6, 32) as u32;
            peer.cmd(&PeerCmd::Expect {
                case: *id,
                transport: t.clone(),
                first_rid: first,
                window,
            })?;
            next.push(first);
        }
        out.push(Pushes { next });
    }
    Ok(out)
}

/// One timed pipeline operation's phases (from its [`PipeReport`]).
struct Phase {
    system: String,
    size: usize,
    /// The network part (`Report::net_time`).
    net_s: f64,
    /// The device copies (`Report::device_time`: H2D for pulls, D2H for pushes).
    dev_s: f64,
    /// The whole operation (`Report::elapsed`).
    elapsed_s: f64,
}

/// Builds the systems of `net`/`latency`: the raw socket (baseline) and, per transport, pull
/// and push through the pipeline between device buffers of the two processes; every timed
/// operation's phases go to `phases`.
fn transfer_systems<'a>(
    peer: &'a std::cell::RefCell<&'a mut Peer>,
    cases: &'a [DevEntry],
    pushes: &'a std::cell::RefCell<Vec<Pushes>>,
    phases: &'a std::cell::RefCell<Vec<Phase>>,
) -> Vec<System<'a>> {
    let mut systems = vec![System::new("raw_tcp", move |i, check| {
        let n = cases[i].1.plan.total_bytes() as usize;
        peer.borrow_mut().raw_get(n, check)
    })];
    let record = move |system: &str, size: usize, r: &PipeReport| {
        phases.borrow_mut().push(Phase {
            system: system.to_string(),
            size,
            net_s: r.net_time.as_secs_f64(),
            dev_s: r.device_time.as_secs_f64(),
            elapsed_s: r.elapsed.as_secs_f64(),
        })
    };
    let ts = peer.borrow().transports.clone();
    for (ti, t) in ts.into_iter().enumerate() {
        let (pull_name, push_name) = (format!("pull_{t}"), format!("push_{t}"));
        let t2 = t.clone();
        systems.push(System::new(pull_name.clone(), move |i, check| {
            let (id, c, d) = &cases[i];
            if check {
                d.clear(c)?;
            }
            let r = peer.borrow().pull_dev(&t, *id, c, d)?;
            if check {
                check_report(&r, c, "pull")?;
                d.verify(c)?;
            } else {
                record(&pull_name, i, &r);
            }
            Ok(())
        }));
        systems.push(System::new(push_name.clone(), move |i, check| {
            let (id, c, d) = &cases[i];
            let rid = {
                let mut p = pushes.borrow_mut();
                let r = p[ti].next[i];
                p[ti].next[i] += 1;
                r
            };
            let mut p = peer.borrow_mut();
            if check {
                p.cmd(&PeerCmd::Clear { case: *id })?;
            }
            let r = p.push_dev(&t2, c, d, rid)?;
            if check {
                check_report(&r, c, "push")?;
                p.cmd(&PeerCmd::Verify {
                    case: *id,
                    transport: t2.clone(),
                    rid,
                })?;
            } else {
                record(&push_name, i, &r);
            }
            Ok(())
        }));
    }
    systems
}

/// The pipeline's own accounting of one operation: every planned byte crossed the network
/// and the device copies (H2D for a pull, D2H for a push) moved them all.
fn check_report(r: &PipeReport, c: &Case, what: &str) -> Result<()> {
    let want = c.plan.total_bytes();
    let device_ok = if what == "pull" {
        r.device_bytes == want
    } else {
        r.device_bytes >= want
    };
    if r.net_bytes != want || !device_ok {
        return Err(Error::Mismatch(format!(
            "{what}: the pipeline reports {} bytes over the network and {} through the device, \
             the plan moves {want}",
            r.net_bytes, r.device_bytes
        )));
    }
    Ok(())
}

fn drop_cases(peer: &mut Peer, ids: impl IntoIterator<Item = u32>) -> Result<()> {
    for id in ids {
        peer.cmd(&PeerCmd::Drop { case: id })?;
    }
    Ok(())
}

/// `net`: pull and push per transport through the pipeline vs one raw TCP socket, at every
/// size; also the network phase of each alone (the pipeline's per-phase timings).
pub(crate) fn net_scenario(
    b: &mut Bench,
    a: &BenchArgs,
    peer: &mut Peer,
    sizes: &[u64],
) -> Result<()> {
    b.describe(
        "net",
        &format!(
            "one request's KV (llama-3.1-8b, {} layer(s), TP=1 -> TP=1, 16-token blocks at \
             scattered ids: pieces of 32 KiB) in PJRT device buffers ({}) moved through \
             transfer::Pipeline as the engines do: pulled by this process (plan, staging, pull, \
             H2D, release; the other process offered it once) and pushed from it (staging, D2H, \
             push; the other process expects each push into its device buffers), {} stream(s) \
             per pair, {} chunks, over loopback, vs one raw TCP socket between the same two \
             processes moving the same bytes (request + response, blocking I/O)",
            a.layers.max(1),
            peer.dev.caps.platform,
            a.streams,
            fmt_bytes(a.chunk_bytes)
        ),
    );
    let layers = a.layers.max(1);
    let bpt = 2 * 8 * 128 * 2u64 * layers as u64;
    let mut cases = Vec::new();
    let mut sz = Vec::new();
    for &bytes in sizes {
        if bytes % bpt != 0 {
            return Err(Error::InvalidArgument(format!(
                "net size {bytes}: must be a multiple of {bpt} bytes (one token of {layers} \
                 layer(s))"
            )));
        }
        let spec = CaseSpec::device("llama-3.1-8b", layers, (bytes / bpt) as u32);
        cases.push(peer.setup_dev(&spec)?);
        sz.push(Size {
            bytes,
            x: bytes,
            label: fmt_bytes(bytes),
        });
    }
    let pushes = std::cell::RefCell::new(expect_pushes(peer, &cases)?);
    let phases = std::cell::RefCell::new(Vec::new());
    let r = {
        let cell = std::cell::RefCell::new(&mut *peer);
        let mut systems = transfer_systems(&cell, &cases, &pushes, &phases);
        // The same-host transport's bound: one memcpy of the same bytes in this process.
        let cell = &cell;
        let cases = &cases;
        systems.push(System::new("memcpy", move |i, check| {
            let n = cases[i].1.plan.total_bytes() as usize;
            cell.borrow_mut().memcpy(n, check)
        }));
        b.measure("net", "transfer", &sz, &mut systems, 0)
    };
    drop_cases(peer, cases.iter().map(|c| c.0))?;
    r?;
    // Pull/push ratios and the encrypted transports against plain TCP.
    let rows: Vec<_> = b
        .report
        .throughput
        .iter()
        .filter(|r| r.scenario == "net")
        .cloned()
        .collect();
    let gb = |sys: &str, size: u64| {
        rows.iter()
            .find(|r| r.system == sys && r.size == size)
            .map(|r| r.gbps)
    };
    let phases = phases.into_inner();
    for (si, &s) in sizes.iter().enumerate() {
        let mut parts = Vec::new();
        for t in &a.transports {
            if let (Some(pl), Some(pu)) = (gb(&format!("pull_{t}"), s), gb(&format!("push_{t}"), s))
            {
                parts.push(format!("pull/push {t} {:.2}", pl / pu));
            }
            if t == "shm" {
                for dir in ["pull", "push"] {
                    if let (Some(x), Some(m)) = (gb(&format!("{dir}_shm"), s), gb("memcpy", s)) {
                        parts.push(format!("{dir} shm/memcpy {:.2}", x / m));
                    }
                }
            }
            if t != "tcp" {
                for dir in ["pull", "push"] {
                    if let (Some(x), Some(tcp)) =
                        (gb(&format!("{dir}_{t}"), s), gb(&format!("{dir}_tcp"), s))
                    {
                        parts.push(format!("{dir} {t}/tcp {:.2}", x / tcp));
                    }
                }
            }
        }
        let line = parts.join(", ");
        b.report
            .note("net", format!("ratios at {}", fmt_bytes(s)), line);
        let raw = gb("raw_tcp", s);
        let mut parts = Vec::new();
        for t in &a.transports {
            for dir in ["pull", "push"] {
                let sys = format!("{dir}_{t}");
                let mut net: Vec<f64> = Vec::new();
                let mut dev: Vec<f64> = Vec::new();
                let mut all: Vec<f64> = Vec::new();
                for p in phases.iter().filter(|p| p.system == sys && p.size == si) {
                    net.push(p.net_s);
                    dev.push(p.dev_s);
                    all.push(p.elapsed_s);
                }
                if net.is_empty() {
                    continue;
                }
                for v in [&mut net, &mut dev, &mut all] {
                    v.sort_by(f64::total_cmp);
                }
                let g = s as f64 / 1e9;
                let med = super::report::median;
                let net_gb = g / med(&net);
                let share = |v: &[f64]| 100.0 * med(v) / med(&all).max(1e-12);
                parts.push(format!(
                    "{sys} {:.3} GB/s ({:.3}..{:.3}){}; of the elapsed: network {:.0}%, device \
                     copies {:.0}%, the rest (checks, plan, staging, release) {:.0}%",
                    net_gb,
                    g / net[net.len() - 1],
                    g / net[0],
                    raw.map(|r| format!(" = {:.2} x raw_tcp", net_gb / r))
                        .unwrap_or_default(),
                    share(&net),
                    share(&dev),
                    (100.0 - share(&net) - share(&dev)).max(0.0)
                ));
            }
        }
        b.report.note(
            "net",
            format!(
                "network phase alone at {} (Report::net_time, median (min..max) over ops)",
                fmt_bytes(s)
            ),
            parts.join("; "),
        );
    }
    Ok(())
}

/// `latency`: p50/p99 of one 16 KiB request, each transport, vs the raw socket's round trip.
pub(crate) fn latency_scenario(b: &mut Bench, _a: &BenchArgs, peer: &mut Peer) -> Result<()> {
    b.describe(
        "latency",
        "one 16 KiB request (llama-3.1-8b, 1 layer, 4 tokens: K and V of one partial block) in \
         PJRT device buffers, pulled/pushed through transfer::Pipeline from/to a separate \
         process, vs the raw socket's round trip of 16 KiB (request + response) between the \
         same processes; single operations, interleaved",
    );
    let spec = CaseSpec::device("llama-3.1-8b", 1, 4);
    let cases = vec![peer.setup_dev(&spec)?];
    // The same request between staging buffers through net::Endpoint alone (no device copy,
    // no pipeline): what of the pipeline's time is the network path's.
    let plain = vec![peer.setup(&CaseSpec::plain("llama-3.1-8b", 1, 4))?];
    let bytes = cases[0].1.plan.total_bytes();
    let pushes = std::cell::RefCell::new(expect_pushes(peer, &cases)?);
    let phases = std::cell::RefCell::new(Vec::new());
    let r = {
        let cell = std::cell::RefCell::new(&mut *peer);
        let mut systems = transfer_systems(&cell, &cases, &pushes, &phases);
        let ts = cell.borrow().transports.clone();
        let (cell, plain) = (&cell, &plain);
        for t in ts {
            systems.push(System::new(
                format!("endpoint_pull_{t}"),
                move |i, check| {
                    let (id, c) = &plain[i];
                    if check {
                        c.clear_dst();
                    }
                    cell.borrow().pull(&t, *id, c, None)?;
                    if check {
                        c.verify_dst()?;
                    }
                    Ok(())
                },
            ));
        }
        b.measure_latency("latency", bytes, &mut systems, Some(0))
    };
    drop_cases(peer, cases.iter().map(|c| c.0))?;
    drop_cases(peer, plain.iter().map(|c| c.0))?;
    r
}

/// Pulls `cases[i]` over `t` (bytes cleared before and checked after with `check`).
fn pull_system<'a>(name: &str, peer: &'a Peer, t: &'a str, cases: &'a [(u32, Case)]) -> System<'a> {
    System::new(name, move |i, check| {
        let (id, c) = &cases[i];
        if check {
            c.clear_dst();
        }
        peer.pull(t, *id, c, None)?;
        if check {
            c.verify_dst()?;
        }
        Ok(())
    })
}

/// `reshard`: (1) a prefill->decode resharding plan (TP=2 x PCP=2, 64-token NHD blocks ->
/// TP=1 x DP=2, 16-token HND blocks, as `tpu-sync demo`) against a plain TP=1 -> TP=1 transfer
/// of the same bytes; (2) DeepSeek-V3's MLA latent cache (replicated over TP) to a TP=4 decode,
/// once per destination rank and once per destination host with a local fan-out, against a
/// plain transfer of the request's bytes; (3) the TPU layout pairs ([`tpu_pairs`]). All pulls
/// over TCP.
pub(crate) fn reshard_scenario(b: &mut Bench, _a: &BenchArgs, peer: &mut Peer) -> Result<()> {
    let q = b.cfg.quick;
    let layers = if q { 2 } else { 4 };
    let tokens: &[u32] = if q { &[64, 256] } else { &[256, 1024, 4096] };
    let t = if peer.transports.iter().any(|t| t == "tcp") {
        "tcp".to_string()
    } else {
        peer.transports[0].clone()
    };
    b.describe(
        "reshard",
        &format!(
            "pulls over {t}: llama-3.1-8b ({layers} layers) resharded TP=2xPCP=2 block 64 NHD -> \
             TP=1xDP=2 block 16 HND vs plain TP=1 -> TP=1 of the same bytes; x = tokens"
        ),
    );
    let mut plain = Vec::new();
    let mut resh = Vec::new();
    let mut sz = Vec::new();
    for &n in tokens {
        let p = CaseSpec::plain("llama-3.1-8b", layers, n);
        let r = CaseSpec {
            preset: "llama-3.1-8b".into(),
            layers,
            tokens: n,
            src: "tp=2,pcp=2,block=64,order=nhd".into(),
            dst: "tp=1,dp=2,block=16,order=hnd".into(),
            dst_dp: 1,
            device: false,
        };
        let pc = peer.setup(&p)?;
        let rc = peer.setup(&r)?;
        if pc.1.plan.total_bytes() != rc.1.plan.total_bytes() {
            return Err(Error::Mismatch(format!(
                "plain and resharded plans of {n} tokens move {} and {} bytes",
                pc.1.plan.total_bytes(),
                rc.1.plan.total_bytes()
            )));
        }
        sz.push(Size {
            bytes: pc.1.plan.total_bytes(),
            x: n as u64,
            label: format!("{n}"),
        });
        plain.push(pc);
        resh.push(rc);
    }
    let r = {
        let mut systems = vec![
            pull_system("plain tp=1 -> tp=1", peer, &t, &plain),
            pull_system("resharded", peer, &t, &resh),
        ];
        b.measure("reshard", "tokens", &sz, &mut systems, 0)
    };
    drop_cases(peer, plain.iter().map(|c| c.0))?;
    drop_cases(peer, resh.iter().map(|c| c.0))?;
    r?;

    // MLA: one latent "head" replicated on every decode TP rank.
    b.describe(
        "mla",
        &format!(
            "pulls over {t}: deepseek-v3 MLA latent cache ({layers} layers, replicated over TP) \
             from TP=1 to a TP=4 decode on one host, every rank pulled (4 copies on the wire) \
             vs one rank pulled + local fan-out (plan::FanOut), vs a plain TP=1 -> TP=1 transfer \
             of the request's bytes; GB/s of request bytes; x = tokens"
        ),
    );
    let mut base = Vec::new();
    let mut mla = Vec::new();
    let mut sz = Vec::new();
    for &n in tokens {
        let p = CaseSpec::plain("deepseek-v3", layers, n);
        let m = CaseSpec {
            preset: "deepseek-v3".into(),
            layers,
            tokens: n,
            src: "tp=1,block=64".into(),
            dst: "tp=4,block=16".into(),
            dst_dp: 0,
            device: false,
        };
        let pc = peer.setup(&p)?;
        let mc = peer.setup(&m)?;
        sz.push(Size {
            bytes: mc.1.request_bytes,
            x: n as u64,
            label: format!("{n}"),
        });
        base.push(pc);
        mla.push(mc);
    }
    // Every decode rank is on this host: one pulled rank per replica group.
    let fan: Vec<FanOut> = mla
        .iter()
        .map(|(_, c)| FanOut::build(&c.plan, &c.dst, |_| 0u32))
        .collect::<Result<_>>()?;
    let wire = std::cell::RefCell::new(BTreeMap::<(String, usize), u64>::new());
    let r = {
        let peer_ref = &*peer;
        let (base, mla, fans, wire, t) = (&base, &mla, &fan, &wire, &t);
        // One pull of `cases[i]` (of `ranks`, then fanned out with `fan`), counting the bytes
        // it received as `key`'s figure at the byte check.
        let sys = move |name: &str, key: &'static str, mla_case: bool, fan: bool| {
            let cases = if mla_case { mla } else { base };
            System::new(name, move |i, check| {
                let (id, c) = &cases[i];
                let f = fan.then(|| &fans[i]);
                let before = peer_ref.bytes_received(t);
                if check {
                    c.clear_dst();
                }
                peer_ref.pull(t, *id, c, f.map(|f| f.pulled.clone()))?;
                if let Some(f) = f {
                    c.dst_st.apply_fan_out(f)?;
                }
                if check {
                    c.verify_dst()?;
                    wire.borrow_mut()
                        .insert((key.into(), i), peer_ref.bytes_received(t) - before);
                }
                Ok(())
            })
        };
        let mut systems = vec![
            sys("plain tp=1 -> tp=1", "plain", false, false),
            sys("mla to tp=4, per rank", "per rank", true, false),
            sys("mla to tp=4, per host + fan-out", "per host", true, true),
        ];
        b.measure("mla", "tokens", &sz, &mut systems, 0)
    };
    for (i, &n) in tokens.iter().enumerate() {
        let req = mla[i].1.request_bytes as f64;
        let w = wire.borrow();
        let get = |k: &str| w.get(&(k.to_string(), i)).map(|&x| x as f64 / req);
        b.report.note(
            "mla",
            format!("bytes on the wire / bytes of the request, {n} tokens"),
            format!(
                "plain {:.2}, per rank {:.2}, per host + fan-out {:.2} (request {})",
                get("plain").unwrap_or(f64::NAN),
                get("per rank").unwrap_or(f64::NAN),
                get("per host").unwrap_or(f64::NAN),
                fmt_bytes(mla[i].1.request_bytes)
            ),
        );
    }
    drop_cases(peer, base.iter().map(|c| c.0))?;
    drop_cases(peer, mla.iter().map(|c| c.0))?;
    r?;
    tpu_pairs(b, peer, &t, layers, tokens)
}

/// The TPU layout pairs of `reshard` (docs/tpu.md): the TPU engines' RPA v3 caches (padded,
/// K and V interleaved and packed) and tpu-inference's MLA cache resharded between TPU TP
/// degrees and from a GPU-style NHD prefill, pulled and checked byte-exact; for each, the bytes that crossed the wire against
/// the bytes the destination needs (real heads and tokens only, never padding), which must be
/// 1.00. The llama-3.1-8b pairs are also timed against a plain TP=1 -> TP=1 transfer.
fn tpu_pairs(b: &mut Bench, peer: &mut Peer, t: &str, layers: u32, tokens: &[u32]) -> Result<()> {
    // (name, preset, source spec, destination spec, destination DP rank, timed)
    let pairs: &[(&str, &str, &str, &str, u32, bool)] = &[
        (
            "vLLM-TorchTPU TP=2 -> tpu-inference TP=4 (rpa3)",
            "llama-3.1-8b",
            "tp=2,block=64,order=rpa3",
            "tp=4,block=32,order=rpa3",
            0,
            true,
        ),
        (
            "tpu-inference TP=4 -> TP=2 (rpa3)",
            "llama-3.1-8b",
            "tp=4,block=32,order=rpa3",
            "tp=2,block=64,order=rpa3",
            0,
            true,
        ),
        (
            "GPU prefill TP=2xPCP=2 NHD -> TPU decode TP=1xDP=2 (rpa3)",
            "llama-3.1-8b",
            "tp=2,pcp=2,block=64,order=nhd",
            "tp=1,dp=2,block=64,order=rpa3",
            1,
            true,
        ),
        (
            "head_dim 64: TP=2 -> TP=8 (rpa3hd64, a padded slot per token)",
            "llama-3.2-1b",
            "tp=2,block=64,order=rpa3hd64",
            "tp=8,block=64,order=rpa3hd64",
            0,
            false,
        ),
        (
            "head_dim 64 in the v3 kernel's layout: NHD TP=1 -> rpa3 TP=2 (half the lanes padding)",
            "llama-3.2-1b",
            "tp=1,block=16,order=nhd",
            "tp=2,block=64,order=rpa3",
            0,
            false,
        ),
        (
            "MLA: tpu-inference TP=4 -> TP=1 (rpamla, 576 of 640 lanes real, every TP rank a replica)",
            "deepseek-v3",
            "tp=4,block=64,order=rpamla",
            "tp=1,block=32,order=rpamla",
            0,
            false,
        ),
        (
            "MLA: GPU prefill NHD TP=2xPCP=2 -> tpu-inference TP=2 (rpamla)",
            "deepseek-v3",
            "tp=2,pcp=2,block=64,order=nhd",
            "tp=2,block=64,order=rpamla",
            0,
            false,
        ),
    ];
    b.describe(
        "tpu",
        &format!(
            "pulls over {t}: the TPU engines' RPA v3 and MLA KV caches resharded ({layers} \
             layers; llama-3.1-8b: 8 KV heads x 128, llama-3.2-1b: 8 x 64, deepseek-v3: MLA \
             576; bf16) vs a plain TP=1 -> TP=1 transfer of the same bytes; x = tokens; every \
             pair checked byte-exact, its wire bytes / needed bytes noted"
        ),
    );
    let mut plain = Vec::new();
    let mut cases: Vec<Vec<(u32, Case)>> = pairs.iter().map(|_| Vec::new()).collect();
    let mut sz = Vec::new();
    for &n in tokens {
        let pc = peer.setup(&CaseSpec::plain("llama-3.1-8b", layers, n))?;
        sz.push(Size {
            bytes: pc.1.plan.total_bytes(),
            x: n as u64,
            label: format!("{n}"),
        });
        plain.push(pc);
        for (k, &(_, preset, src, dst, dst_dp, _)) in pairs.iter().enumerate() {
            cases[k].push(peer.setup(&CaseSpec {
                preset: preset.into(),
                layers,
                tokens: n,
                src: src.into(),
                dst: dst.into(),
                dst_dp,
                device: false,
            })?);
        }
    }
    let wire = std::cell::RefCell::new(BTreeMap::<(usize, usize), u64>::new());
    let r = {
        let peer_ref = &*peer;
        let wire = &wire;
        let mut systems = vec![pull_system("plain tp=1 -> tp=1", peer_ref, t, &plain)];
        for (k, p) in pairs.iter().enumerate().filter(|(_, p)| p.5) {
            let cs = &cases[k];
            systems.push(System::new(p.0, move |i, check| {
                let (id, c) = &cs[i];
                let before = peer_ref.bytes_received(t);
                if check {
                    c.clear_dst();
                }
                peer_ref.pull(t, *id, c, None)?;
                if check {
                    c.verify_dst()?;
                    wire.borrow_mut()
                        .insert((k, i), peer_ref.bytes_received(t) - before);
                }
                Ok(())
            }));
        }
        b.measure("tpu", "tokens", &sz, &mut systems, 0)
    };
    // The untimed pairs: one checked pull each.
    for (k, _) in pairs.iter().enumerate().filter(|(_, p)| !p.5) {
        for (i, (id, c)) in cases[k].iter().enumerate() {
            let before = peer.bytes_received(t);
            c.clear_dst();
            peer.pull(t, *id, c, None)?;
            c.verify_dst()?;
            wire.borrow_mut()
                .insert((k, i), peer.bytes_received(t) - before);
        }
    }
    for (k, p) in pairs.iter().enumerate() {
        let w = wire.borrow();
        let ratios: Vec<String> = tokens
            .iter()
            .enumerate()
            .map(|(i, n)| {
                let c = &cases[k][i].1;
                let needed = c.request_bytes * c.dst.layout.head_replicas().unwrap_or(1) as u64;
                let moved = w.get(&(k, i)).copied().unwrap_or(0);
                format!(
                    "{n} tokens {:.2} (plan {:.2}, {} needed)",
                    moved as f64 / needed as f64,
                    c.plan.total_bytes() as f64 / needed as f64,
                    fmt_bytes(needed)
                )
            })
            .collect();
        b.report.note(
            "tpu",
            format!("{}: bytes moved / bytes needed", p.0),
            ratios.join(", "),
        );
    }
    drop(wire);
    drop_cases(peer, plain.iter().map(|c| c.0))?;
    for cs in &cases {
        drop_cases(peer, cs.iter().map(|c| c.0))?;
    }
    r
}
