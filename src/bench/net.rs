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
    plan_staging, Endpoint, EndpointOptions, PeerMap, PullRequest, PushRequest, Security,
    SinkRegistration, SourceRegistration, Transfer, TransportKind,
};
use tpu_sync::pattern::{mix64, RankContents};
use tpu_sync::plan::{FanOut, Placement, Plan};
use tpu_sync::staging::Staging;
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
}

fn options(
    name: String,
    kind: TransportKind,
    psk: &std::path::Path,
    listen: Option<std::net::SocketAddr>,
    streams: u32,
    chunk_bytes: u64,
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

/// A push destination pool of the helper: `window` registrations ahead of the pushes.
struct Pool {
    done: Mutex<HashMap<u64, std::result::Result<(), String>>>,
    notify: tokio::sync::Notify,
    pending: Mutex<HashMap<u64, Transfer>>,
    stop: std::sync::atomic::AtomicBool,
}

struct PeerCase {
    case: Arc<Case>,
    pools: HashMap<String, Arc<Pool>>,
}

fn expect_one(
    ep: &Arc<Endpoint>,
    case: &Arc<Case>,
    pool: &Arc<Pool>,
    rid: u64,
    window: u64,
) -> Result<()> {
    if pool.stop.load(std::sync::atomic::Ordering::Acquire) {
        return Ok(());
    }
    let t = ep.expect_push(SinkRegistration {
        request_id: rid,
        num_tokens: case.tokens,
        placement: case.dst.clone(),
        staging: case.dst_st.clone(),
        dst_ranks: None,
        src: Some(case.src.clone()),
        plan: Some(case.plan.clone()),
    })?;
    pool.pending
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .insert(rid, t.clone());
    let (ep, case, pool) = (ep.clone(), case.clone(), pool.clone());
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
        if let Err(e) = expect_one(&ep, &case, &pool, rid + window, window) {
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
        )?;
        let ep = rt.block_on(Endpoint::bind(o))?;
        addrs.insert(
            t.clone(),
            ep.local_addr()
                .map(|x| x.to_string())
                .ok_or_else(|| Error::InvalidArgument("endpoint without a listener".into()))?,
        );
        eps.insert(t.clone(), Arc::new(ep));
    }
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
        let r = peer_command(&rt, &eps, &mut cases, cmd);
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
    rt.block_on(async {
        for ep in eps.values() {
            ep.shutdown(Some(Duration::from_millis(200))).await;
        }
    });
    Ok(ExitCode::SUCCESS)
}

fn peer_command(
    rt: &tokio::runtime::Runtime,
    eps: &BTreeMap<String, Arc<Endpoint>>,
    cases: &mut HashMap<u32, PeerCase>,
    cmd: PeerCmd,
) -> Result<()> {
    let ep_of = |t: &str| {
        eps.get(t)
            .cloned()
            .ok_or_else(|| Error::InvalidArgument(format!("no {t} endpoint")))
    };
    let case_of = |cases: &HashMap<u32, PeerCase>, c: u32| {
        cases
            .get(&c)
            .map(|p| p.case.clone())
            .ok_or_else(|| Error::InvalidArgument(format!("no case {c}")))
    };
    match cmd {
        PeerCmd::Setup { case, spec } => {
            let c = Arc::new(Case::build(&spec)?);
            for ep in eps.values() {
                ep.register_source(SourceRegistration {
                    request_id: SOURCE_RID + case as u64,
                    num_tokens: c.tokens,
                    placement: c.src.clone(),
                    staging: c.src_st.clone(),
                    layers_ready: None,
                    expected_releases: 1,
                })?;
            }
            cases.insert(
                case,
                PeerCase {
                    case: c,
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
            let ep = ep_of(&transport)?;
            let pool = Arc::new(Pool {
                done: Mutex::new(HashMap::new()),
                notify: tokio::sync::Notify::new(),
                pending: Mutex::new(HashMap::new()),
                stop: false.into(),
            });
            let _g = rt.enter();
            for k in 0..window as u64 {
                expect_one(&ep, &c, &pool, first_rid + k, window as u64)?;
            }
            if let Some(pc) = cases.get_mut(&case) {
                pc.pools.insert(transport, pool);
            }
        }
        PeerCmd::Clear { case } => case_of(cases, case)?.clear_dst(),
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
            c.verify_dst()?;
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
                for ep in eps.values() {
                    ep.unregister_source(SOURCE_RID + case as u64);
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
    eps: BTreeMap<String, Endpoint>,
    transports: Vec<String>,
    dir: PathBuf,
    next_case: u32,
}

impl Drop for Peer {
    fn drop(&mut self) {
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
        for t in &a.transports {
            let o = options(
                format!("bench-{}-{t}", std::process::id()),
                TransportKind::parse(t)?,
                &psk,
                None,
                a.streams,
                a.chunk_bytes,
            )?;
            eps.insert(t.clone(), rt.block_on(Endpoint::bind(o))?);
        }
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

    /// Pushes case `c` as request `rid` over `t` and waits.
    fn push(&self, t: &str, c: &Case, rid: u64) -> Result<()> {
        let ep = &self.eps[t];
        let addr = self.addrs[t].clone();
        self.rt.block_on(async {
            let tr = ep.push(PushRequest {
                request_id: rid,
                num_tokens: c.tokens,
                src: c.src.clone(),
                staging: c.src_st.clone(),
                src_ranks: None,
                dst: c.dst.clone(),
                targets: PeerMap::single(addr),
                layers_ready: None,
                plan: Some(c.plan.clone()),
            })?;
            tr.wait().await.map(|_| ())
        })
    }
}

/// Pull and push systems of one transport over cases `cases[i] = (helper id, case)`.
struct Pushes {
    next: Vec<u64>,
}

const PUSH_WINDOW: u32 = 32;

fn push_rid_base(ti: usize, id: u32) -> u64 {
    (ti as u64 + 1) << 44 | (id as u64) << 24
}

/// Registers push pools in the helper for every case and transport.
fn expect_pushes(peer: &mut Peer, ids: &[u32]) -> Result<Vec<Pushes>> {
    let ts = peer.transports.clone();
    let mut out = Vec::new();
    for (ti, t) in ts.iter().enumerate() {
        let mut next = Vec::new();
        for &id in ids {
            let first = push_rid_base(ti, id);
            peer.cmd(&PeerCmd::Expect {
                case: id,
                transport: t.clone(),
                first_rid: first,
                window: PUSH_WINDOW,
            })?;
            next.push(first);
        }
        out.push(Pushes { next });
    }
    Ok(out)
}

/// Builds the systems of `net`/`latency`: the raw socket (baseline) and pull/push per transport.
fn transfer_systems<'a>(
    peer: &'a std::cell::RefCell<&'a mut Peer>,
    cases: &'a [(u32, Case)],
    pushes: &'a std::cell::RefCell<Vec<Pushes>>,
) -> Vec<System<'a>> {
    let mut systems = vec![System::new("raw_tcp", move |i, check| {
        let n = cases[i].1.plan.total_bytes() as usize;
        peer.borrow_mut().raw_get(n, check)
    })];
    let ts = peer.borrow().transports.clone();
    for (ti, t) in ts.into_iter().enumerate() {
        let t2 = t.clone();
        systems.push(System::new(format!("pull_{t}"), move |i, check| {
            let (id, c) = &cases[i];
            if check {
                c.clear_dst();
            }
            peer.borrow().pull(&t, *id, c, None)?;
            if check {
                c.verify_dst()?;
            }
            Ok(())
        }));
        systems.push(System::new(format!("push_{t2}"), move |i, check| {
            let (id, c) = &cases[i];
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
            p.push(&t2, c, rid)?;
            if check {
                p.cmd(&PeerCmd::Verify {
                    case: *id,
                    transport: t2.clone(),
                    rid,
                })?;
            }
            Ok(())
        }));
    }
    systems
}

fn drop_cases(peer: &mut Peer, cases: &[(u32, Case)]) -> Result<()> {
    for (id, _) in cases {
        peer.cmd(&PeerCmd::Drop { case: *id })?;
    }
    Ok(())
}

/// `net`: pull and push per transport vs one raw TCP socket, at every size.
pub(crate) fn net_scenario(
    b: &mut Bench,
    a: &BenchArgs,
    peer: &mut Peer,
    sizes: &[u64],
) -> Result<()> {
    b.describe(
        "net",
        &format!(
            "one request's KV (llama-3.1-8b, 1 layer, TP=1 -> TP=1, 16-token blocks at scattered \
             ids: pieces of 32 KiB) pulled by and pushed from this process through net::Endpoint, \
             {} stream(s) per pair, {} chunks, to/from a separate process over loopback, vs one \
             raw TCP socket between the same two processes moving the same bytes \
             (request + response, blocking I/O)",
            a.streams,
            fmt_bytes(a.chunk_bytes)
        ),
    );
    let bpt = 2 * 8 * 128 * 2u64;
    let mut cases = Vec::new();
    let mut sz = Vec::new();
    for &bytes in sizes {
        if bytes % bpt != 0 {
            return Err(Error::InvalidArgument(format!(
                "net size {bytes}: must be a multiple of {bpt} bytes (one token of one layer)"
            )));
        }
        let spec = CaseSpec::plain("llama-3.1-8b", 1, (bytes / bpt) as u32);
        cases.push(peer.setup(&spec)?);
        sz.push(Size {
            bytes,
            x: bytes,
            label: fmt_bytes(bytes),
        });
    }
    let ids: Vec<u32> = cases.iter().map(|(id, _)| *id).collect();
    let pushes = std::cell::RefCell::new(expect_pushes(peer, &ids)?);
    let r = {
        let cell = std::cell::RefCell::new(&mut *peer);
        let mut systems = transfer_systems(&cell, &cases, &pushes);
        // The same-host transport's bound: one memcpy of the same bytes in this process.
        let cell = &cell;
        let cases = &cases;
        systems.push(System::new("memcpy", move |i, check| {
            let n = cases[i].1.plan.total_bytes() as usize;
            cell.borrow_mut().memcpy(n, check)
        }));
        b.measure("net", "transfer", &sz, &mut systems, 0)
    };
    drop_cases(peer, &cases)?;
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
    for &s in sizes {
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
    }
    Ok(())
}

/// `latency`: p50/p99 of one 16 KiB request, each transport, vs the raw socket's round trip.
pub(crate) fn latency_scenario(b: &mut Bench, _a: &BenchArgs, peer: &mut Peer) -> Result<()> {
    b.describe(
        "latency",
        "one 16 KiB request (llama-3.1-8b, 1 layer, 4 tokens: K and V of one partial block) \
         pulled/pushed through net::Endpoint from/to a separate process, vs the raw socket's \
         round trip of 16 KiB (request + response) between the same processes; single \
         operations, interleaved",
    );
    let spec = CaseSpec::plain("llama-3.1-8b", 1, 4);
    let cases = vec![peer.setup(&spec)?];
    let bytes = cases[0].1.plan.total_bytes();
    let ids = [cases[0].0];
    let pushes = std::cell::RefCell::new(expect_pushes(peer, &ids)?);
    let r = {
        let cell = std::cell::RefCell::new(&mut *peer);
        let mut systems = transfer_systems(&cell, &cases, &pushes);
        b.measure_latency("latency", bytes, &mut systems, Some(0))
    };
    drop_cases(peer, &cases)?;
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
/// plain transfer of the request's bytes. All pulls over TCP.
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
    drop_cases(peer, &plain)?;
    drop_cases(peer, &resh)?;
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
        let (base, mla, fan, wire, t) = (&base, &mla, &fan, &wire, &t);
        let mut systems = vec![
            System::new("plain tp=1 -> tp=1", move |i, check| {
                let (id, c) = &base[i];
                let before = peer_ref.bytes_received(t);
                if check {
                    c.clear_dst();
                }
                peer_ref.pull(t, *id, c, None)?;
                if check {
                    c.verify_dst()?;
                    wire.borrow_mut()
                        .insert(("plain".into(), i), peer_ref.bytes_received(t) - before);
                }
                Ok(())
            }),
            System::new("mla to tp=4, per rank", move |i, check| {
                let (id, c) = &mla[i];
                let before = peer_ref.bytes_received(t);
                if check {
                    c.clear_dst();
                }
                peer_ref.pull(t, *id, c, None)?;
                if check {
                    c.verify_dst()?;
                    wire.borrow_mut()
                        .insert(("per rank".into(), i), peer_ref.bytes_received(t) - before);
                }
                Ok(())
            }),
            System::new("mla to tp=4, per host + fan-out", move |i, check| {
                let (id, c) = &mla[i];
                let f = &fan[i];
                let before = peer_ref.bytes_received(t);
                if check {
                    c.clear_dst();
                }
                peer_ref.pull(t, *id, c, Some(f.pulled.clone()))?;
                c.dst_st.apply_fan_out(f)?;
                if check {
                    c.verify_dst()?;
                    wire.borrow_mut()
                        .insert(("per host".into(), i), peer_ref.bytes_received(t) - before);
                }
                Ok(())
            }),
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
    drop_cases(peer, &base)?;
    drop_cases(peer, &mla)?;
    r
}
