//! Helpers of the network tests: small model layouts, staged source contents from
//! `tpu_sync::pattern`, byte-exact verification of destination staging, endpoints, fd counts.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use tpu_sync::arena::ArenaOptions;
use tpu_sync::layout::{ModelKv, ParallelLayout, ParallelSpec};
use tpu_sync::net::tls::{generate_test_pki, TestPki};
use tpu_sync::net::{
    Endpoint, EndpointOptions, Security, SourceHandle, SourceRegistration, TransportKind,
};
use tpu_sync::pattern::{mix64, RankContents};
use tpu_sync::plan::{Placement, Plan};
use tpu_sync::staging::Staging;

pub const SALT: u64 = 0x5eed;

pub fn arena_opts() -> ArenaOptions {
    ArenaOptions {
        lock: false,
        huge_pages: false,
        populate: true,
    }
}

/// Llama-3.1-8B geometry cut to `layers` layers (8 KV heads x 128, bf16: 256-byte rows).
pub fn model(layers: u32) -> ModelKv {
    let mut m = ModelKv::preset("llama-3.1-8b").unwrap();
    m.num_layers = layers;
    m
}

pub fn layout(m: &ModelKv, spec: &str, tokens: u32) -> ParallelLayout {
    let spec = ParallelSpec::parse(spec).unwrap();
    let probe = ParallelLayout {
        model: m.clone(),
        spec,
        num_blocks: 1,
        physical_layout: None,
        block_format: None,
    };
    let per_rank = probe.pcp_chunk(tokens, 0).unwrap().len() as u32;
    ParallelLayout::new(m.clone(), spec, per_rank * 2 + 3).unwrap()
}

fn scattered(num_blocks: u32, n: usize, seed: u64) -> Vec<u32> {
    let mut ids: Vec<u32> = (0..num_blocks).collect();
    for i in (1..ids.len()).rev() {
        let j = (mix64(seed ^ i as u64) % (i as u64 + 1)) as usize;
        ids.swap(i, j);
    }
    ids.truncate(n);
    ids
}

pub fn placement(layout: ParallelLayout, dp_rank: u32, tokens: u32, seed: u64) -> Placement {
    let s = layout.spec;
    let block_ids = (0..s.ranks_per_replica())
        .map(|local| {
            let n = layout.pcp_chunk(tokens, local / s.tp).unwrap().len();
            scattered(layout.num_blocks, n, seed ^ ((local as u64) << 20))
        })
        .collect();
    Placement {
        first_token: 0,
        layout,
        dp_rank,
        block_ids,
        groups: None,
    }
}

/// Source staging of `ranks` (default: the whole replica) filled with the request's pattern.
pub fn source_staging(p: &Placement, tokens: u32, ranks: Option<&[u32]>) -> Arc<Staging> {
    source_staging_with(p, tokens, ranks, &arena_opts())
}

/// [`source_staging`] with the given arena options (e.g. locked memory, to count pinned bytes).
pub fn source_staging_with(
    p: &Placement,
    tokens: u32,
    ranks: Option<&[u32]>,
    opts: &ArenaOptions,
) -> Arc<Staging> {
    let all: Vec<u32> = (0..p.layout.spec.ranks_per_replica())
        .map(|l| p.global_rank(l))
        .collect();
    let ranks = ranks.map(|r| r.to_vec()).unwrap_or(all);
    let ranges: BTreeMap<u32, _> = ranks
        .iter()
        .map(|&r| (r, p.block_ranges(p.local_rank(r).unwrap())))
        .collect();
    let st = Staging::new(ranges, opts).unwrap();
    let kv = p.layout.rank_kv().unwrap();
    let mut buf = vec![0u8; kv.buffer_bytes() as usize];
    for &r in &ranks {
        let c = RankContents::new(p, r, tokens, SALT).unwrap();
        for layer in 0..kv.num_layers {
            c.fill_layer(layer, &mut buf).unwrap();
            for s in st.ranges(r).iter().filter(|s| s.range.buffer == layer) {
                let dst = st.resolve(r, layer, s.range.offset, s.range.len).unwrap();
                let src = &buf[s.range.offset as usize..(s.range.offset + s.range.len) as usize];
                // SAFETY: `dst` is a staged range of exactly `len` bytes, not shared yet.
                unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst, src.len()) };
            }
        }
    }
    Arc::new(st)
}

/// Registers request `rid` at `ep`: every rank of `p`'s replica staged with the request's
/// pattern in an arena with `opts`, every layer ready, one expected consumer.
pub fn register_whole_with(
    ep: &Endpoint,
    p: &Placement,
    tokens: u32,
    rid: u64,
    opts: &ArenaOptions,
) -> SourceHandle {
    ep.register_source(SourceRegistration {
        request_id: rid,
        num_tokens: tokens,
        placement: p.clone(),
        staging: source_staging_with(p, tokens, None, opts),
        layers_ready: None,
        expected_releases: 1,
    })
    .unwrap()
}

/// [`register_whole_with`] in the default test arena.
pub fn register_whole(ep: &Endpoint, p: &Placement, tokens: u32, rid: u64) -> SourceHandle {
    register_whole_with(ep, p, tokens, rid, &arena_opts())
}

/// Destination staging (zeroed) for the destination ranks `ranks` (default: all of the replica).
pub fn dest_staging(plan: &Plan, dst: &Placement, ranks: Option<&[u32]>) -> Arc<Staging> {
    dest_staging_with(plan, dst, ranks, &arena_opts())
}

/// [`dest_staging`] with the given arena options.
pub fn dest_staging_with(
    plan: &Plan,
    dst: &Placement,
    ranks: Option<&[u32]>,
    opts: &ArenaOptions,
) -> Arc<Staging> {
    let mut m = tpu_sync::net::plan_staging(plan, dst);
    if let Some(r) = ranks {
        m.retain(|k, _| r.contains(k));
    }
    Arc::new(Staging::new(m, opts).unwrap())
}

/// Checks every staged byte of `ranks` against the pattern; returns the bytes checked.
pub fn verify_dest(dst: &Placement, tokens: u32, st: &Staging, ranks: Option<&[u32]>) -> u64 {
    let kv = dst.layout.rank_kv().unwrap();
    let mut buf = vec![0u8; kv.buffer_bytes() as usize];
    let mut checked = 0;
    let all: Vec<u32> = st.ranks().collect();
    for r in ranks.map(|r| r.to_vec()).unwrap_or(all) {
        let c = RankContents::new(dst, r, tokens, SALT ^ 1).unwrap();
        for layer in 0..kv.num_layers {
            c.fill_layer(layer, &mut buf).unwrap();
            for s in st.ranges(r).iter().filter(|s| s.range.buffer == layer) {
                let p = st.resolve(r, layer, s.range.offset, s.range.len).unwrap();
                // SAFETY: the transfer finished; nothing writes the staging now.
                let got = unsafe { std::slice::from_raw_parts(p, s.range.len as usize) };
                let want = &buf[s.range.offset as usize..(s.range.offset + s.range.len) as usize];
                if got != want {
                    let i = got.iter().zip(want).position(|(a, b)| a != b).unwrap();
                    panic!(
                        "rank {r} layer {layer}: byte {} of range at offset {} differs ({} != {})",
                        i, s.range.offset, got[i], want[i]
                    );
                }
                checked += s.range.len;
            }
        }
    }
    checked
}

/// Whether any staged byte of `st` is non-zero (a refused peer must deliver nothing).
pub fn any_nonzero(st: &Staging) -> bool {
    for r in st.ranks() {
        for s in st.ranges(r) {
            let p = st
                .resolve(r, s.range.buffer, s.range.offset, s.range.len)
                .unwrap();
            // SAFETY: no transfer writes the staging now.
            let b = unsafe { std::slice::from_raw_parts(p, s.range.len as usize) };
            if b.iter().any(|&x| x != 0) {
                return true;
            }
        }
    }
    false
}

pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

/// Runs `f` on a fresh runtime, failing the test if it takes longer than `limit`.
pub fn run<F: std::future::Future<Output = ()>>(limit: Duration, f: F) {
    let _ = env_logger::builder().is_test(true).try_init();
    // Watchdog: if the runtime itself wedges (every worker blocked), the async timeout below
    // cannot fire; the process is then ended so a hang fails instead of blocking the suite.
    let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
    std::thread::spawn(move || {
        if let Err(std::sync::mpsc::RecvTimeoutError::Timeout) =
            done_rx.recv_timeout(limit + Duration::from_secs(15))
        {
            eprintln!("test wedged for {limit:?} + 15 s: aborting");
            std::process::abort();
        }
    });
    let _done = done_tx;
    let rt = runtime();
    rt.block_on(async {
        tokio::time::timeout(limit, f)
            .await
            .unwrap_or_else(|_| panic!("test did not finish within {limit:?} (hang)"))
    });
    rt.shutdown_timeout(Duration::from_secs(2));
}

/// A PKI for `names` in a fresh temporary directory (kept alive by the returned guard).
pub struct Pki {
    pub pki: TestPki,
    pub dir: std::path::PathBuf,
}

impl Drop for Pki {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

pub fn pki(names: &[&str]) -> Pki {
    static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let dir = std::env::temp_dir().join(format!(
        "tpu-sync-test-pki-{}-{}",
        std::process::id(),
        N.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    ));
    let pki = generate_test_pki(&dir, names).unwrap();
    Pki { pki, dir }
}

/// Options for tests: short timeouts, small chunks (many frames, several stripes).
pub fn opts(kind: TransportKind, security: Security, name: &str, listen: bool) -> EndpointOptions {
    EndpointOptions {
        name: name.to_string(),
        transport: kind,
        security,
        listen: listen.then(|| "127.0.0.1:0".parse().unwrap()),
        connect_timeout: Duration::from_secs(3),
        handshake_timeout: Duration::from_secs(3),
        io_timeout: Duration::from_secs(5),
        heartbeat_interval: Duration::from_millis(100),
        heartbeat_timeout: Duration::from_millis(1000),
        lease_ttl: Duration::from_secs(10),
        chunk_bytes: 64 << 10,
        streams_per_pair: 3,
        max_lanes_per_peer: 8,
        ..EndpointOptions::default()
    }
}

/// Security for `name` on `kind` (CA certificates for TLS/QUIC, none for TCP).
pub fn security(kind: TransportKind, pki: &Pki, name: &str) -> Security {
    match kind {
        TransportKind::Tcp | TransportKind::Shm => Security::None,
        _ => pki.pki.security(name).unwrap(),
    }
}

pub const KINDS: [TransportKind; 4] = [
    TransportKind::Tcp,
    TransportKind::Tls,
    TransportKind::Quic,
    TransportKind::Shm,
];

pub async fn endpoint(kind: TransportKind, pki: &Pki, name: &str, listen: bool) -> Endpoint {
    Endpoint::bind(opts(kind, security(kind, pki, name), name, listen))
        .await
        .unwrap()
}

/// Open file descriptors of this process, and how many of them are sockets.
pub fn fds() -> (usize, usize) {
    let mut n = 0;
    let mut sockets = 0;
    for e in std::fs::read_dir("/proc/self/fd").unwrap().flatten() {
        n += 1;
        if let Ok(t) = std::fs::read_link(e.path()) {
            if t.to_string_lossy().starts_with("socket:") {
                sockets += 1;
            }
        }
    }
    (n, sockets)
}

/// Waits (bounded) until `f` holds, polling every 10 ms.
pub async fn eventually(limit: Duration, what: &str, mut f: impl FnMut() -> bool) {
    let t0 = std::time::Instant::now();
    while !f() {
        assert!(t0.elapsed() < limit, "{what}: not reached within {limit:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A request's two placements and plan: `layers` layers of the small test model, `tokens`
/// tokens, a TP=2 NHD source with 16-token blocks and a TP=1 HND destination with 32-token blocks
/// (a reshard with a block-size and order change), block ids scattered by `seed` and `seed + 1`.
pub struct Fx {
    pub src: Placement,
    pub dst: Placement,
    pub tokens: u32,
    pub plan: Plan,
}

/// See [`Fx`].
pub fn reshard_fixture(layers: u32, tokens: u32, seed: u64) -> Fx {
    let m = model(layers);
    let src = placement(layout(&m, "tp=2,block=16", tokens), 0, tokens, seed);
    let dst = placement(
        layout(&m, "tp=1,block=32,order=hnd", tokens),
        0,
        tokens,
        seed + 1,
    );
    let plan = Plan::build(&src, &dst, tokens).unwrap();
    Fx {
        src,
        dst,
        tokens,
        plan,
    }
}

/// Starts pulling `f`'s request `rid` from the endpoint at `addr` into `staging` (all of `f`'s
/// destination ranks, the plan built by the endpoint).
pub fn pull_fx(
    ep: &Endpoint,
    f: &Fx,
    rid: u64,
    addr: &str,
    staging: Arc<Staging>,
) -> tpu_sync::net::Transfer {
    ep.pull(tpu_sync::net::PullRequest {
        request_id: rid,
        num_tokens: f.tokens,
        src: f.src.clone(),
        sources: tpu_sync::net::PeerMap::single(addr),
        dst: f.dst.clone(),
        staging,
        dst_ranks: None,
        plan: None,
        wait_for_registration: None,
    })
    .unwrap()
}

/// A push of request `rid` (`tokens` tokens, `src` -> `dst`) from the source ranks `ranks`
/// (None: all) of a freshly staged [`source_staging`] to `targets`, whole (every layer ready),
/// the plan built by the endpoint. Override fields with `PushRequest { .., ..push_whole(..) }`.
pub fn push_whole(
    src: &Placement,
    dst: &Placement,
    tokens: u32,
    rid: u64,
    ranks: Option<&[u32]>,
    targets: tpu_sync::net::PeerMap,
) -> tpu_sync::net::PushRequest {
    tpu_sync::net::PushRequest {
        request_id: rid,
        num_tokens: tokens,
        src: src.clone(),
        staging: source_staging(src, tokens, ranks),
        src_ranks: None,
        dst: dst.clone(),
        targets,
        layers_ready: None,
        plan: None,
    }
}

/// The expectation of a push of request `rid` (`tokens` tokens) into `staging` at `dst` (all
/// destination ranks, the plan built by the endpoint), from producers of layout `src` (None:
/// any, told by the pusher).
pub fn sink_whole(
    dst: &Placement,
    tokens: u32,
    rid: u64,
    staging: Arc<Staging>,
    src: Option<&Placement>,
) -> tpu_sync::net::SinkRegistration {
    tpu_sync::net::SinkRegistration {
        request_id: rid,
        num_tokens: tokens,
        placement: dst.clone(),
        staging,
        dst_ranks: None,
        src: src.cloned(),
        plan: None,
    }
}
