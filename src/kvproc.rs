//! The prefill and decode halves of the main job, and `info`.
//!
//! Each half owns its own PJRT client and devices (one device per rank; the XLA CPU plugin is
//! asked for as many devices as there are ranks). Both print one machine-readable line
//! `REPORT {json}` at the end, which `demo` collects.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tpu_sync::arena::LockStatus;
use tpu_sync::device::Pacer;
use tpu_sync::layout::{ModelKv, ParallelLayout, ParallelSpec};
use tpu_sync::net::{self, EndpointOptions, PeerMap, Security, TransportKind};
use tpu_sync::pattern::{mix64, LayerCheck, RankContents};
use tpu_sync::pjrt::{Capabilities, Client, ClientOptions, DeviceBuffer, Plugin};
use tpu_sync::plan::{Placement, Plan};
use tpu_sync::transfer::{
    KvBuffers, Offer, OfferState, Pipeline, PullInto, Report as TransferReport, TransferOptions,
};
use tpu_sync::util::fmt_bytes;
use tpu_sync::{wire, Error, Result};

use crate::JobArgs;

/// Background salt of prefill buffers.
pub(crate) const PREFILL_SALT: u64 = 0x5052_4546_494c_4c00;
/// Background salt of decode buffers.
pub(crate) const DECODE_SALT: u64 = 0x4445_434f_4445_0000;

/// What one half reports to `demo`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Report {
    pub role: String,
    pub platform: String,
    pub api_version: String,
    pub devices: u32,
    pub layout: String,
    pub d2h_path: String,
    pub h2d_path: String,
    pub lock: String,
    /// D2H (prefill) or H2D (decode) bytes, ops and seconds.
    pub device_bytes: u64,
    pub device_ops: u64,
    pub device_secs: f64,
    /// Network bytes, spans, pairs, seconds (decode only).
    pub net_bytes: u64,
    pub net_spans: u64,
    pub net_pairs: u64,
    pub net_stripes: u64,
    pub net_secs: f64,
    /// Transport and authentication (decode only).
    pub transport: String,
    /// Verification (decode only).
    pub verified_request_bytes: u64,
    pub verified_background_bytes: u64,
    pub mismatches: u64,
    pub first_mismatch: Option<String>,
    pub request_blocks: u64,
    pub layers: u32,
    pub num_tokens: u32,
    pub wall_secs: f64,
    /// Per KV cache group (grouped presets only, decode side).
    #[serde(default)]
    pub groups: Vec<crate::kvproc_groups::GroupReport>,
}

pub fn model(job: &JobArgs) -> Result<ModelKv> {
    let mut m = ModelKv::preset(&job.preset)?;
    if let Some(l) = job.layers {
        if l == 0 || l > m.num_layers {
            return Err(Error::Layout(format!(
                "--layers {l}: {} has {} layers",
                m.name, m.num_layers
            )));
        }
        m.num_layers = l;
    }
    Ok(m)
}

pub fn prefill_spec(job: &JobArgs) -> Result<ParallelSpec> {
    ParallelSpec::parse(&job.prefill)
}

pub fn decode_spec(job: &JobArgs) -> Result<ParallelSpec> {
    ParallelSpec::parse(&job.decode)
}

/// The decode side's DP rank: `--decode-dp-rank`, else 1 (0 when the decode layout has DP=1).
pub fn decode_dp_rank(job: &JobArgs, spec: &ParallelSpec) -> Result<u32> {
    let r = job
        .decode_dp_rank
        .unwrap_or(if spec.dp > 1 { 1 } else { 0 });
    if r >= spec.dp {
        return Err(Error::InvalidArgument(format!(
            "--decode-dp-rank {r}: the decode layout `{}` has DP={}, so the rank must be {}",
            job.decode,
            spec.dp,
            if spec.dp == 1 {
                "0".to_string()
            } else {
                format!("0 to {}", spec.dp - 1)
            }
        )));
    }
    Ok(r)
}

/// Checks every flag of `demo` and `prefill` that needs neither a plugin nor a peer, so `demo`
/// fails before spawning anything and `prefill` before opening devices.
pub fn validate(job: &JobArgs) -> Result<()> {
    if crate::kvproc_groups::is_grouped(job) {
        crate::kvproc_groups::validate(job)?;
        return validate_decode(job);
    }
    let m = model(job)?;
    if job.tokens == 0 {
        return Err(Error::InvalidArgument(
            "--tokens 0: the prompt needs at least one token".into(),
        ));
    }
    let pre = sized_layout(&m, prefill_spec(job)?, job.tokens)?;
    let dec = sized_layout(&m, decode_spec(job)?, job.tokens)?;
    validate_decode(job)?;
    // Both halves' KV buffers, their staging and the host copies used to fill and verify
    // them live in this machine's memory (the CPU plugin's device memory is host memory): an
    // impossible size is refused here, before anything is spawned or allocated.
    let device = |l: &ParallelLayout| -> Result<u64> {
        let kv = l.rank_kv()?;
        Ok(kv
            .buffer_bytes()
            .saturating_mul(kv.num_layers as u64)
            .saturating_mul(l.num_ranks() as u64))
    };
    let request = m.bytes_per_token().saturating_mul(job.tokens as u64);
    let need = device(&pre)?
        .saturating_add(device(&dec)?)
        .saturating_add(request.saturating_mul(2));
    tpu_sync::budget::check_fits(
        need,
        &format!(
            "--tokens {} --layers {}: the prefill's and decode's KV buffers and staging",
            job.tokens, m.num_layers
        ),
    )
}

/// The checks of [`validate`] that apply to `decode` (whose token count and prefill layout come
/// from the prefill): run before connecting or opening devices.
pub fn validate_decode(job: &JobArgs) -> Result<()> {
    let spec = decode_spec(job)?;
    if crate::kvproc_groups::is_grouped(job) {
        crate::kvproc_groups::validate_decode(job, spec)?;
    } else {
        ParallelLayout::new(model(job)?, spec, 1)?;
    }
    decode_dp_rank(job, &spec)?;
    transport_kind(job)?;
    security(job)?;
    if job.streams == 0 || job.streams > wire::MAX_STRIPES {
        return Err(Error::InvalidArgument(format!(
            "--streams {}: must be 1 to {} (parallel lanes per prefill/decode rank pair)",
            job.streams,
            wire::MAX_STRIPES
        )));
    }
    if job.chunk_bytes == 0 || job.chunk_bytes > wire::MAX_DATA_PAYLOAD as u64 {
        return Err(Error::InvalidArgument(format!(
            "--chunk-bytes {}: must be 1 to {} ({})",
            job.chunk_bytes,
            wire::MAX_DATA_PAYLOAD,
            fmt_bytes(wire::MAX_DATA_PAYLOAD as u64)
        )));
    }
    net::check_request_id(job.request_id).map_err(|_| {
        Error::InvalidArgument(format!(
            "--request-id {}: must be 1 to 2^53 - 1 ({})",
            job.request_id,
            net::MAX_REQUEST_ID
        ))
    })?;
    Ok(())
}

/// The transport named by `--transport`.
pub fn transport_kind(job: &JobArgs) -> Result<TransportKind> {
    TransportKind::parse(&job.transport)
}

/// Peer authentication from `--tls-cert/--tls-key/--tls-ca` or `--psk-file`.
pub fn security(job: &JobArgs) -> Result<Security> {
    match (&job.tls_cert, &job.tls_key, &job.tls_ca, &job.psk_file) {
        (None, None, None, None) => Ok(Security::None),
        (Some(c), Some(k), Some(ca), None) => Security::from_pem_files(c, k, ca, None),
        (None, None, None, Some(p)) => Security::from_psk_file(p),
        _ => Err(Error::InvalidArgument(
            "give either all of --tls-cert, --tls-key and --tls-ca, or --psk-file".into(),
        )),
    }
}

/// A layout with room for the request on every rank plus spare blocks, so ids can be scattered.
fn sized_layout(m: &ModelKv, spec: ParallelSpec, tokens: u32) -> Result<ParallelLayout> {
    let probe = ParallelLayout {
        model: m.clone(),
        spec,
        num_blocks: 1,
        physical_layout: None,
        block_format: None,
    };
    let per_rank = probe.pcp_chunk(tokens, 0)?.len() as u32;
    ParallelLayout::new(m.clone(), spec, per_rank * 2 + 5)
}

/// Scattered, distinct, non-adjacent-in-order block ids for `n` request blocks: a deterministic
/// shuffle of `0..num_blocks`.
pub(crate) fn scattered_ids(num_blocks: u32, n: u32, seed: u64) -> Vec<u32> {
    let mut ids: Vec<u32> = (0..num_blocks).collect();
    for i in (1..ids.len()).rev() {
        let j = (mix64(seed ^ i as u64) % (i as u64 + 1)) as usize;
        ids.swap(i, j);
    }
    ids.truncate(n as usize);
    ids
}

fn placement(layout: ParallelLayout, dp_rank: u32, tokens: u32, seed: u64) -> Result<Placement> {
    let s = layout.spec;
    let block_ids = (0..s.ranks_per_replica())
        .map(|local| {
            let n = layout.pcp_chunk(tokens, local / s.tp)?.len() as u32;
            Ok(scattered_ids(
                layout.num_blocks,
                n,
                seed ^ (local as u64) << 20,
            ))
        })
        .collect::<Result<_>>()?;
    Ok(Placement {
        first_token: 0,
        layout,
        dp_rank,
        block_ids,
        groups: None,
    })
}

pub(crate) fn open_client(
    job_plugin: Option<&Path>,
    devices: Option<i64>,
) -> Result<(Client, Capabilities)> {
    let plugin = match job_plugin {
        Some(p) => Plugin::load(p)?,
        None => Plugin::load_default()?,
    };
    let client = Client::create(
        &plugin,
        &ClientOptions {
            cpu_device_count: devices,
        },
    )?;
    let caps = Capabilities::probe(&client)?;
    Ok((client, caps))
}

/// Allocates each rank's per-layer device buffers filled with `contents` (ranks in parallel).
fn make_buffers(client: &Client, contents: &[RankContents]) -> Result<Vec<Vec<DeviceBuffer>>> {
    let n = client.addressable_devices().len();
    if n < contents.len() {
        return Err(Error::InvalidArgument(format!(
            "the {} client has {n} devices, the layout needs {} ranks",
            client.platform_name(),
            contents.len()
        )));
    }
    let threads = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(2)
        .clamp(1, 8);
    // Device buffers (host memory on the CPU plugin) plus one host fill buffer per thread.
    let need = contents.iter().fold(0u64, |a, c| {
        let kv = c.kv();
        a.saturating_add(kv.buffer_bytes().saturating_mul(kv.num_layers as u64 + 1))
    });
    tpu_sync::budget::check_fits(need, &format!("KV buffers of {} ranks", contents.len()))?;
    let mut out: Vec<Option<Result<Vec<DeviceBuffer>>>> =
        (0..contents.len()).map(|_| None).collect();
    std::thread::scope(|sc| {
        let chunks: Vec<_> = out
            .chunks_mut(contents.len().div_ceil(threads).max(1))
            .collect();
        let mut first = 0;
        for chunk in chunks {
            let start = first;
            first += chunk.len();
            sc.spawn(move || {
                for (i, slot) in chunk.iter_mut().enumerate() {
                    let rank = start + i;
                    *slot = Some((|| {
                        let c = &contents[rank];
                        let kv = *c.kv();
                        let dev = client.device(rank)?;
                        let mut host = vec![0u8; kv.buffer_bytes() as usize];
                        (0..kv.num_layers)
                            .map(|l| {
                                c.fill_layer(l, &mut host)?;
                                client.buffer_from_host(
                                    &host,
                                    kv.dtype.element_type(),
                                    &kv.dims(),
                                    &dev,
                                )
                            })
                            .collect()
                    })());
                }
            });
        }
    });
    out.into_iter()
        .map(|o| o.expect("every rank filled"))
        .collect()
}

/// The physical layout the plugin reports for the KV buffers (the first one's; the transfer
/// pipeline checks every buffer against the layout before anything moves).
pub(crate) fn physical_layout(buffers: &[Vec<DeviceBuffer>]) -> Option<String> {
    buffers
        .iter()
        .flatten()
        .next()
        .and_then(|b| b.physical_layout())
        .map(str::to_string)
}

/// `text` followed by the layout's physical layout, when known.
fn with_physical(text: String, layout: &ParallelLayout) -> String {
    match &layout.physical_layout {
        Some(p) if tpu_sync::transfer::is_dense_row_major(p, 5) => {
            format!("{text}, physical layout {p} (dense row-major)")
        }
        Some(p) => format!("{text}, physical layout {p}"),
        None => text,
    }
}

/// The staging's lock and DMA-map outcome, for the report.
pub(crate) fn lock_and_dma(r: &TransferReport) -> String {
    let lock = r
        .lock
        .as_ref()
        .map(lock_text)
        .unwrap_or_else(|| "nothing staged".into());
    format!("{lock}, {}", r.dma)
}

fn lock_text(s: &LockStatus) -> String {
    match s {
        LockStatus::Locked => "mlocked".into(),
        LockStatus::NotRequested => "not locked (not requested)".into(),
        LockStatus::Failed(w) => format!("NOT locked: {w}"),
    }
}

pub(crate) fn runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| Error::io("tokio runtime", e))
}

pub(crate) fn endpoint_options(
    job: &JobArgs,
    name: &str,
    listen: Option<std::net::SocketAddr>,
) -> Result<EndpointOptions> {
    let t = Duration::from_secs(job.timeout.max(1));
    Ok(EndpointOptions {
        name: format!("{name}-{}", std::process::id()),
        transport: transport_kind(job)?,
        security: security(job)?,
        listen,
        connect_timeout: t,
        handshake_timeout: t,
        io_timeout: t,
        streams_per_pair: job.streams,
        chunk_bytes: job.chunk_bytes,
        faults: net::FaultHooks {
            close_after_bytes: job.fault_close_after,
            stall_after_bytes: job.fault_stall_after,
            ..Default::default()
        },
        ..EndpointOptions::default()
    })
}

/// The pipeline options of `--staging-budget`.
pub(crate) fn transfer_options(job: &JobArgs) -> TransferOptions {
    TransferOptions {
        staging_budget_bytes: job.staging_budget,
        ..TransferOptions::default()
    }
}

pub(crate) fn print_report(r: &Report) {
    outln!(
        "REPORT {}",
        serde_json::to_string(r).expect("report serialises")
    );
}

/// `tpu-sync prefill`.
pub fn prefill(job: &JobArgs, listen: Option<&str>, ranks: Option<&[u32]>) -> Result<ExitCode> {
    let t0 = Instant::now();
    let _span =
        tracing::info_span!("request", request_id = job.request_id, side = "prefill").entered();
    if crate::kvproc_groups::is_grouped(job) {
        return crate::kvproc_groups::prefill(job, listen, ranks, t0);
    }
    // Validate everything (the decode side's spec too, so a bad pair fails on both sides).
    validate(job)?;
    let m = model(job)?;
    let spec = prefill_spec(job)?;
    let layout = sized_layout(&m, spec, job.tokens)?;
    let place = placement(layout.clone(), 0, job.tokens, 0x5052_4546)?;
    place.validate(job.tokens)?;
    // Before opening devices: a bad --ranks fails at once.
    if let Some(r) = ranks.and_then(|v| v.iter().find(|r| place.local_rank(**r).is_none())) {
        return Err(Error::InvalidArgument(format!(
            "--ranks: prefill rank {r} does not exist ({} ranks)",
            spec.ranks_per_replica()
        )));
    }
    let (client, caps) = open_client(job.plugin.as_deref(), Some(layout.num_ranks() as i64))?;
    let contents = (0..layout.num_ranks())
        .map(|r| RankContents::new(&place, r, job.tokens, PREFILL_SALT))
        .collect::<Result<Vec<_>>>()?;
    let buffers = make_buffers(&client, &contents)?;
    // The buffers' physical layout travels with the placement: the decode side refuses a
    // transfer between different layouts.
    let mut place = place;
    if let Some(p) = physical_layout(&buffers) {
        place.layout = place.layout.with_physical_layout(p);
    }
    let hosted: BTreeMap<u32, Vec<DeviceBuffer>> = (0..spec.ranks_per_replica())
        .map(|l| place.global_rank(l))
        .filter(|r| ranks.map(|v| v.contains(r)).unwrap_or(true))
        .map(|r| (r, buffers[r as usize].clone()))
        .collect();
    let kv = KvBuffers::new(&caps, hosted)?;
    let report = serve_offer(job, listen, ranks, &place, kv, &layout.describe())?;
    print_report(&Report {
        role: "prefill".into(),
        platform: client.platform_name().into(),
        api_version: format!("{}.{}", caps.api_version.0, caps.api_version.1),
        devices: client.addressable_devices().len() as u32,
        layout: with_physical(layout.describe(), &place.layout),
        d2h_path: caps.d2h.to_string(),
        h2d_path: caps.h2d.to_string(),
        lock: lock_and_dma(&report),
        device_bytes: report.device_bytes,
        device_ops: report.device_ops,
        device_secs: report.device_time.as_secs_f64(),
        layers: m.num_layers,
        num_tokens: job.tokens,
        wall_secs: t0.elapsed().as_secs_f64(),
        ..Report::default()
    });
    Ok(ExitCode::SUCCESS)
}

/// The serving half of `tpu-sync prefill`: binds the pipeline, offers the request (buffer
/// check, staging, D2H, registration), prints `LISTENING addr`, and waits until the decode side
/// released (or rejected) it. `what` describes the layout for the log line.
pub(crate) fn serve_offer(
    job: &JobArgs,
    listen: Option<&str>,
    ranks: Option<&[u32]>,
    place: &Placement,
    kv: KvBuffers,
    what: &str,
) -> Result<TransferReport> {
    let rt = runtime()?;
    let addr = listen
        .map(str::to_string)
        .unwrap_or_else(|| format!("127.0.0.1:{}", job.port));
    let listen: std::net::SocketAddr = addr
        .parse()
        .map_err(|_| Error::InvalidArgument(format!("--listen {addr}: not an IP:port address")))?;
    let opts = endpoint_options(job, "prefill", Some(listen))?;
    let served = rt.block_on(async {
        let p = Pipeline::bind(opts, transfer_options(job)).await?;
        let local = p.endpoint().local_addr().expect("listening");
        // Checks the buffers against the layout, stages (budget, DMA map, D2H), registers.
        let offer = p.offer(Offer {
            request_id: job.request_id,
            num_tokens: job.tokens,
            placement: place.clone(),
            kv,
            expected_releases: 1,
        })?;
        outln!("LISTENING {local}");
        errln!(
            "prefill: {} ranks {}, request {} ({} tokens, {} staged, {}) on {local} over {}",
            what,
            offer_ranks(ranks, place),
            job.request_id,
            job.tokens,
            fmt_bytes(offer.report().device_bytes),
            offer.report().dma,
            p.endpoint().transport_kind()
        );
        let report = offer.report().clone();
        let r = offer.wait(Duration::from_secs(job.serve_timeout)).await;
        p.shutdown(Some(Duration::from_secs(1))).await;
        let why = match r {
            Ok(OfferState::Released) => return Ok(report),
            // The decode side refused the request (its pull failed, or it gave up): the prefill
            // did its part; the decode side reports the failure.
            Ok(OfferState::Rejected(why)) => {
                errln!("prefill: request {}: {why}", job.request_id);
                return Ok(report);
            }
            Err(Error::Timeout(_)) => {
                return Err(Error::Timeout(format!(
                    "request {}: the decode side did not release the request within \
                     --serve-timeout {} s of registration (the timeout counts from when the \
                     prefill registered the request, including the decode side's startup)",
                    job.request_id, job.serve_timeout
                )))
            }
            Err(e) => return Err(e),
            Ok(OfferState::Expired) => {
                "no decode side held a lease on it for the lease time".to_string()
            }
            Ok(OfferState::PeerLost(w)) => format!("the decode side holding it was lost ({w})"),
            Ok(OfferState::Unregistered) => "it was unregistered".to_string(),
            Ok(OfferState::Shutdown) => "the endpoint shut down".to_string(),
            Ok(s @ (OfferState::Active | OfferState::Unknown)) => format!("state {}", s.name()),
        };
        Err(Error::PeerClosed(format!(
            "request {} ended without being released: {why}",
            job.request_id
        )))
    });
    rt.shutdown_timeout(Duration::from_secs(1));
    served
}

/// The hosted prefill ranks, for the log line.
fn offer_ranks(ranks: Option<&[u32]>, place: &Placement) -> String {
    (0..place.layout.spec.ranks_per_replica())
        .map(|l| place.global_rank(l))
        .filter(|r| ranks.map(|v| v.contains(r)).unwrap_or(true))
        .map(|r| r.to_string())
        .collect::<Vec<_>>()
        .join(",")
}

/// `tpu-sync decode`.
///
/// `tokens`: `--tokens` when given on the command line; the count otherwise comes from the
/// prefill, and a given one must match it.
pub fn decode(job: &JobArgs, connect: &str, tokens: Option<u32>) -> Result<ExitCode> {
    let t0 = Instant::now();
    let _span =
        tracing::info_span!("request", request_id = job.request_id, side = "decode").entered();
    validate_decode(job)?;
    let grouped = crate::kvproc_groups::is_grouped(job);
    let m = if grouped { None } else { Some(model(job)?) };
    let spec = decode_spec(job)?;
    let dp_rank = decode_dp_rank(job, &spec)?;
    let sources = PeerMap::parse(connect)?;
    let opts = endpoint_options(job, "decode", None)?;
    let rt = runtime()?;
    let r = rt.block_on(async {
        let p = Pipeline::bind(opts, transfer_options(job)).await?;
        let first = sources
            .default
            .clone()
            .or_else(|| sources.by_rank.values().next().cloned())
            .expect("non-empty peer map");
        // A prefill listens before its request is staged and registered (the D2H runs after
        // the bind): a decode started beside it asks again until the registration appears,
        // within --timeout.
        let until = Instant::now() + Duration::from_secs(job.timeout);
        let mut pause = Duration::from_millis(10);
        let (src, num_tokens) = loop {
            match p.describe(&first, job.request_id).await {
                Err(e)
                    if e.kind() == tpu_sync::ErrorKind::UnknownRequest
                        && Instant::now() + pause < until =>
                {
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(Duration::from_millis(250));
                }
                r => break r?,
            }
        };
        let r = match tokens {
            Some(t) if t != num_tokens => Err(Error::InvalidArgument(format!(
                "--tokens {t}: the prefill at {first} serves request {} with {num_tokens} tokens \
                 (decode takes the count from the prefill: drop --tokens or pass \
                 --tokens {num_tokens})",
                job.request_id
            ))),
            _ => Ok(()),
        };
        let r = match r {
            Err(e) => Err(e),
            Ok(()) if grouped => {
                crate::kvproc_groups::decode_request(
                    job,
                    &p,
                    &sources,
                    spec,
                    dp_rank,
                    src.clone(),
                    num_tokens,
                    t0,
                )
                .await
            }
            Ok(()) => {
                decode_request(
                    job,
                    &p,
                    &sources,
                    m.clone().expect("uniform model"),
                    spec,
                    dp_rank,
                    src.clone(),
                    num_tokens,
                    t0,
                )
                .await
            }
        };
        // A successful pull released the request at the prefill (after the bytes were written
        // to the device). On failure this decode will not pull it again: reject it, so the
        // prefill frees it at once instead of at its lease expiry (not when the prefill itself
        // failed: dead or unreachable, it is not waited for). A reject that fails or takes more
        // than --timeout is only a warning: the prefill's lease frees the request.
        if let Some(e) = r.as_ref().err().filter(|e| !e.is_peer_failure()) {
            let why = format!("the decode failed: {e}");
            let limit = Duration::from_secs(job.timeout.max(1));
            match tokio::time::timeout(limit, p.reject(job.request_id, &sources, &why)).await {
                Ok(Ok(())) => {}
                Ok(Err(w)) => errln!("decode: warning: {w}"),
                Err(_) => errln!(
                    "decode: warning: the reject of request {} took over {limit:?}",
                    job.request_id
                ),
            }
        }
        p.shutdown(None).await;
        r
    });
    rt.shutdown_timeout(Duration::from_secs(1));
    r
}

/// Pulls the request from `sources` (where it lies as `src`) into the decode's buffers of the
/// replica that `dst` names (`buffers[global rank][layer]`, every rank of the instance): the
/// pipeline checks the buffers, plans, stages (budget, DMA map), pulls, writes H2D, releases.
pub(crate) async fn pull_replica(
    p: &Pipeline,
    job: &JobArgs,
    caps: &Capabilities,
    (src, sources): (&Placement, &PeerMap),
    dst: &Placement,
    buffers: &[Vec<DeviceBuffer>],
    num_tokens: u32,
) -> Result<tpu_sync::transfer::Report> {
    let replica: BTreeMap<u32, Vec<DeviceBuffer>> = (0..dst.layout.spec.ranks_per_replica())
        .map(|l| dst.global_rank(l))
        .map(|r| (r, buffers[r as usize].clone()))
        .collect();
    p.pull(PullInto {
        request_id: job.request_id,
        num_tokens,
        src: src.clone(),
        sources: sources.clone(),
        dst: dst.clone(),
        kv: KvBuffers::new(caps, replica)?,
        wait_for_registration: None,
    })?
    .wait()
    .await
}

#[allow(clippy::too_many_arguments)]
async fn decode_request(
    job: &JobArgs,
    p: &Pipeline,
    sources: &PeerMap,
    m: ModelKv,
    spec: ParallelSpec,
    dp_rank: u32,
    src: Placement,
    num_tokens: u32,
    t0: Instant,
) -> Result<ExitCode> {
    let layout = sized_layout(&m, spec, num_tokens)?;
    let mut dst = placement(layout.clone(), dp_rank, num_tokens, 0x4445_434f)?;
    if let Some(id) = job.fault_block_id {
        if let Some(first) = dst.block_ids.iter_mut().find(|v| !v.is_empty()) {
            first[0] = id;
        }
    }
    // Plan before touching devices: bad layouts and block ids fail here, with a clear message.
    let plan = Plan::build(&src, &dst, num_tokens)?;
    let (client, caps) = open_client(job.plugin.as_deref(), Some(layout.num_ranks() as i64))?;
    caps.require_h2d()?;
    // Every rank starts with background contents; only the request's bytes may change.
    let background = Placement {
        first_token: 0,
        block_ids: vec![],
        dp_rank: u32::MAX,
        ..dst.clone()
    };
    let initial = (0..layout.num_ranks())
        .map(|r| RankContents::new(&background, r, num_tokens, DECODE_SALT))
        .collect::<Result<Vec<_>>>()?;
    let buffers = make_buffers(&client, &initial)?;
    // Record the real buffers' physical layout: a layout that differs from the prefill side's
    // fails closed in the pipeline's plan (and again on the prefill side, which re-plans too).
    if let Some(l) = physical_layout(&buffers) {
        dst.layout = dst.layout.with_physical_layout(l);
    }
    let pulled = pull_replica(p, job, &caps, (&src, sources), &dst, &buffers, num_tokens).await?;

    let check = verify(&dst, num_tokens, &buffers)?;

    let request_blocks: u64 = dst.block_ids.iter().map(|v| v.len() as u64).sum();
    let ok = check.mismatches == 0
        && check.request_bytes == pulled.net_bytes
        && pulled.net_bytes == plan.total_bytes()
        && pulled.device_bytes == pulled.net_bytes;
    print_report(&Report {
        role: "decode".into(),
        platform: client.platform_name().into(),
        api_version: format!("{}.{}", caps.api_version.0, caps.api_version.1),
        devices: client.addressable_devices().len() as u32,
        layout: with_physical(
            format!("{}, request on DP rank {dp_rank}", layout.describe()),
            &dst.layout,
        ),
        d2h_path: caps.d2h.to_string(),
        h2d_path: caps.h2d.to_string(),
        lock: lock_and_dma(&pulled),
        device_bytes: pulled.device_bytes,
        device_ops: pulled.device_ops,
        device_secs: pulled.device_time.as_secs_f64(),
        net_bytes: pulled.net_bytes,
        net_spans: pulled.spans,
        net_pairs: pulled.pairs,
        net_stripes: pulled.stripes,
        net_secs: pulled.net_time.as_secs_f64(),
        transport: format!(
            "{} ({})",
            p.endpoint().transport_kind(),
            security(job)?.describe()
        ),
        verified_request_bytes: check.request_bytes,
        verified_background_bytes: check.background_bytes,
        mismatches: check.mismatches,
        first_mismatch: check.first_mismatch.clone(),
        request_blocks,
        layers: m.num_layers,
        num_tokens,
        wall_secs: t0.elapsed().as_secs_f64(),
        groups: Vec::new(),
    });
    if !ok {
        errln!(
            "decode: verification FAILED: {} mismatching elements, {} request bytes checked, {} \
             received, {} written, {} planned; first: {}",
            check.mismatches,
            check.request_bytes,
            pulled.net_bytes,
            pulled.device_bytes,
            plan.total_bytes(),
            check.first_mismatch.as_deref().unwrap_or("-")
        );
        return Ok(ExitCode::from(1));
    }
    Ok(ExitCode::SUCCESS)
}

/// Reads back every layer buffer of every rank and checks each element.
fn verify(dst: &Placement, num_tokens: u32, buffers: &[Vec<DeviceBuffer>]) -> Result<LayerCheck> {
    let ranks = dst.layout.num_ranks();
    let results: Vec<Result<LayerCheck>> = std::thread::scope(|sc| {
        let handles: Vec<_> = (0..ranks)
            .map(|r| {
                sc.spawn(move || -> Result<LayerCheck> {
                    let c = RankContents::new(dst, r, num_tokens, DECODE_SALT)?;
                    let mut host = vec![0u8; c.kv().buffer_bytes() as usize];
                    let mut total = LayerCheck::default();
                    for (l, b) in buffers[r as usize].iter().enumerate() {
                        b.to_host(&mut host)?;
                        total.merge(c.verify_layer(l as u32, &host)?);
                    }
                    Ok(total)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(Error::Cancelled("verify thread panicked".into())))
            })
            .collect()
    });
    let mut total = LayerCheck::default();
    for r in results {
        total.merge(r?);
    }
    Ok(total)
}

/// `tpu-sync info`.
pub fn info(plugin: Option<&Path>, devices: Option<i64>) -> Result<ExitCode> {
    let (client, caps) = open_client(plugin, devices)?;
    let p = client.plugin();
    outln!("plugin:            {}", p.path().display());
    outln!(
        "PJRT API version:  {}.{} (PJRT_Api.struct_size {})",
        caps.api_version.0,
        caps.api_version.1,
        p.api_struct_size()
    );
    outln!(
        "platform:          {} ({})",
        client.platform_name(),
        client.platform_version()
    );
    if let Ok(attrs) = p.attributes() {
        for (k, v) in attrs {
            outln!("attribute:         {k} = {v}");
        }
    }
    outln!(
        "extensions:        {}",
        if caps.extensions.is_empty() {
            "none".into()
        } else {
            caps.extensions.join(", ")
        }
    );
    let devs = client.addressable_devices();
    outln!("devices:           {}", devs.len());
    for d in &devs {
        let kinds = d
            .memories()?
            .iter()
            .map(|m| m.kind().to_string())
            .collect::<Vec<_>>()
            .join(", ");
        let default = d
            .default_memory()
            .map(|m| m.kind().to_string())
            .unwrap_or_else(|_| "-".into());
        outln!(
            "  device {} (id {}, kind {}): memories [{kinds}], default {default}",
            d.index(),
            d.id()?,
            d.kind()?
        );
    }
    outln!("capabilities:");
    outln!("  D2H path:        {}", caps.d2h);
    outln!("  in-place H2D:    {}", caps.h2d);
    outln!(
        "  DMA map:         {} (tried for every staging arena)",
        caps.dma_map
    );
    let budget = tpu_sync::budget::StagingBudget::process();
    outln!(
        "  staging budget:  {} per process (a quarter of {} of memory{}; {} or \
         --staging-budget)",
        fmt_bytes(budget.limit()),
        fmt_bytes(tpu_sync::budget::process_memory()),
        match tpu_sync::budget::memlock_hard_limit() {
            Some(m) if m >= tpu_sync::budget::MIN_MEMLOCK_CAP => {
                format!(", capped by the hard RLIMIT_MEMLOCK {}", fmt_bytes(m))
            }
            Some(m) => format!(
                "; the hard RLIMIT_MEMLOCK {} is below {} and caps nothing",
                fmt_bytes(m),
                fmt_bytes(tpu_sync::budget::MIN_MEMLOCK_CAP)
            ),
            None => ", RLIMIT_MEMLOCK unlimited".into(),
        },
        tpu_sync::budget::ENV_STAGING_BUDGET
    );
    outln!(
        "  device views:    {}",
        if caps.view {
            "PJRT_Client_CreateViewOfDeviceBuffer (64-byte aligned pointers; on_delete_callback always set)"
        } else {
            "not in this plugin's API table"
        }
    );
    outln!("  buffer layouts:  {}", caps.layouts);
    outln!(
        "  probe buffer:    bf16[2,8,16] -> {}",
        caps.probe_layout
            .as_deref()
            .unwrap_or("could not be created")
    );
    let pacing = Pacer::global().config();
    let limit = |v: u64| {
        if v == 0 {
            "unlimited".to_string()
        } else {
            fmt_bytes(v)
        }
    };
    outln!(
        "  DMA pacing:      chunks of {}, at most {} in flight per process, FIFO ({} / {})",
        limit(pacing.chunk_bytes),
        limit(pacing.max_inflight_bytes),
        tpu_sync::device::pacing::ENV_CHUNK_BYTES,
        tpu_sync::device::pacing::ENV_MAX_INFLIGHT_BYTES
    );
    Ok(ExitCode::SUCCESS)
}
