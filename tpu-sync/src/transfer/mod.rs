//! The transfer pipeline: the one place that turns "these device buffers hold this request in
//! this layout" into staged, DMA-mapped pinned memory, network transfers and in-place device
//! writes. The CLI, the C ABI (and through it the Python package and the engine connectors)
//! and the benchmarks call it; nothing else stages KV for the network.
//!
//! A [`Pipeline`] wraps one [`Endpoint`] with a staging [budget](crate::budget) and
//! [`TransferOptions`]:
//!
//! * **Producer side of a pull**: [`Pipeline::offer`] checks the buffers against the
//!   placement's layout, reserves staging from the budget, maps it for DMA with the buffers'
//!   client, copies the request's blocks D2H, and registers them. The device blocks may be
//!   reused as soon as it returns. [`Pipeline::offer_state`] tells how the registration ended.
//! * **Consumer side**: [`Pipeline::pull`] (decode-initiated) checks, plans, stages exactly the
//!   bytes the plan writes, pulls them, writes them in place into the device buffers (H2D),
//!   completes, and releases the request at the producers (a delivering release, off the
//!   critical path; [`Pipeline::shutdown`] waits for it); a failed pull
//!   sends a release that does not count as delivered, so a retry can still succeed, and
//!   [`Pipeline::reject`] tells the producers that this consumer will not pull the request.
//! * **Layer by layer**: [`Pipeline::offer_layers`] registers a request before its layers are
//!   computed (only the first `layers_ready` staged) and [`Pipeline::publish_layers`] stages
//!   (D2H) and announces each further layer as the model finishes it, so a consumer pulls layer
//!   `l` while layer `l + 1` is computed; [`Pipeline::pull_layerwise`] writes each layer into
//!   the device (H2D) as soon as it arrived and verified, and
//!   [`TransferHandle::wait_layers_written`] waits for a layer (a model that computes layer `l`
//!   while the later layers arrive).
//! * **Push**: [`Pipeline::push`] (producer-initiated: check, stage D2H, send) and
//!   [`Pipeline::expect_push`] (its consumer side: check, plan, stage, receive, H2D).
//!
//! Staging memory is reused: the pipeline's [`ArenaPool`] keeps the arenas of ended operations
//! (pre-faulted, locked, DMA-mapped) up to [`TransferOptions::staging_pool_bytes`] for later
//! operations of a similar size on the same PJRT client, and the endpoint's plan cache
//! ([`Endpoint::plan_cache`]) plans a repeated `(source, destination, tokens)` once. H2D copies of
//! at most [`INLINE_H2D_BYTES`] run on the runtime thread instead of the blocking pool.
//!
//! Every buffer of every rank and layer is checked against the layout before any byte moves
//! ([`check_rank_buffers`]: element type, dims, `PJRT_Buffer_OnDeviceSizeInBytes`, physical
//! layout); a disagreement is [`Error::Mismatch`] before staging or network traffic, and nothing
//! else on the endpoint is touched. Every operation reports the same [`Report`] (staged,
//! device and network bytes, spans, pairs, stripes, times, the DMA-map outcome).
//!
//! Threading: a [`Pipeline`] is `Send + Sync`. It must be created inside a tokio runtime (it
//! keeps that runtime's handle for its tasks); its methods may then be called from any thread.
//! [`Pipeline::offer`], [`Pipeline::push`] and the submissions of [`Pipeline::pull`] and
//! [`Pipeline::expect_push`] block the calling thread for device copies and, with
//! [`TransferOptions::staging_wait`], for budget; call them where blocking is allowed (not
//! from the only thread of a current-thread runtime).

mod check;

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use tokio::sync::watch;

pub use check::{
    check_group_buffers, check_rank_buffers, is_dense_row_major, rows_stay_contiguous, XlaLayout,
};

use crate::arena::{ArenaOptions, DmaRegistration, LockStatus};
use crate::budget::{BudgetStats, StagingBudget};
use crate::error::{Error, Result};
use crate::net::{
    self, Endpoint, EndpointOptions, PeerMap, PullRequest, PushRequest, SinkRegistration,
    SourceHandle, SourceOutcome, SourceRegistration, Transfer, TransferStats,
};
use crate::pjrt::{Capabilities, Client, DeviceBuffer};
use crate::plan::{ByteRange, Placement, Plan, PlanCacheStats};
use crate::staging::{ArenaPool, PoolStats, Staging, DEFAULT_POOL_BYTES};

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Most ended offers whose outcome a pipeline remembers (oldest forgotten first).
pub const MAX_ENDED_OFFERS: usize = 1 << 16;

/// H2D copies of at most this many bytes (per operation, or per layer step of a layer-wise
/// pull) run on the runtime thread that saw the bytes arrive instead of the blocking pool: at
/// memcpy speed that is tens of microseconds, less than the two thread hand-overs of
/// `spawn_blocking`; larger copies go to the blocking pool so the runtime keeps serving.
pub const INLINE_H2D_BYTES: u64 = 256 << 10;

/// Options of a [`Pipeline`], the same for every operation on it.
#[derive(Debug, Clone)]
pub struct TransferOptions {
    /// Memory of staging arenas (default: locked, huge pages, pre-faulted).
    pub arena: ArenaOptions,
    /// Map each staging arena for DMA with the buffers' PJRT client (`PJRT_Client_DmaMap`) so
    /// the device copies it directly (default true). Plugins without it (the XLA CPU plugin
    /// answers UNIMPLEMENTED) are skipped with a debug log: [`DmaOutcome::Skipped`].
    pub dma_map: bool,
    /// Byte budget of this pipeline's staging: `None` (default) shares the process-wide budget
    /// ([`StagingBudget::process`], limit [`crate::budget::default_limit`]); `Some(n)` gives the
    /// pipeline its own budget of `n` bytes.
    pub staging_budget_bytes: Option<u64>,
    /// How long an operation waits for budget before it fails with
    /// [`Error::StagingExhausted`] (`None`, default: it fails at once).
    pub staging_wait: Option<Duration>,
    /// Most D2H copies in flight per rank while staging (default 256).
    pub d2h_max_outstanding: usize,
    /// Cap in bytes of the pipeline's staging arena pool ([`ArenaPool`]; default
    /// [`DEFAULT_POOL_BYTES`], 256 MiB): the arenas of ended operations (pre-faulted, locked,
    /// DMA-mapped) are kept up to this many bytes and reused by later operations of a similar
    /// size on the same PJRT client, instead of mapping, zeroing and locking new ones. Idle
    /// arenas count against the staging budget and are freed when a reservation of that
    /// budget needs the room. 0 turns the pool off (every staging is freed when its operation
    /// ends).
    pub staging_pool_bytes: u64,
}

impl Default for TransferOptions {
    fn default() -> Self {
        TransferOptions {
            arena: ArenaOptions::default(),
            dma_map: true,
            staging_budget_bytes: None,
            staging_wait: None,
            d2h_max_outstanding: 256,
            staging_pool_bytes: DEFAULT_POOL_BYTES,
        }
    }
}

/// Whether an operation's staging was DMA-mapped with the buffers' client.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum DmaOutcome {
    /// `PJRT_Client_DmaMap` mapped the staging arena (unmapped when it is freed).
    Mapped,
    /// The plugin does not implement DMA mapping (its message); copies go through the plugin's
    /// own staging.
    Skipped(String),
    /// [`TransferOptions::dma_map`] is off.
    #[default]
    Disabled,
}

impl std::fmt::Display for DmaOutcome {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DmaOutcome::Mapped => f.write_str("DMA-mapped"),
            DmaOutcome::Skipped(why) => write!(
                f,
                "not DMA-mapped, the plugin has no DMA map ({why}): its own staging copies"
            ),
            DmaOutcome::Disabled => f.write_str("DMA map disabled"),
        }
    }
}

/// What one operation did (this side's part). Every field is zero where it does not apply.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Report {
    /// Pinned bytes staged for the operation (the arena's budget reservation: page-rounded, or
    /// the size class of a pooled arena, [`ArenaPool::class_bytes`]).
    pub staged_bytes: u64,
    /// Bytes copied between device buffers and staging: D2H for offers and pushes, H2D for
    /// pulls and expected pushes.
    pub device_bytes: u64,
    /// Device copies issued (adjacent blocks merged).
    pub device_ops: u64,
    /// Wall time of the device copies.
    pub device_time: Duration,
    /// Payload bytes moved over the network by this side (received or sent).
    pub net_bytes: u64,
    /// Plan spans handled.
    pub spans: u64,
    /// `(source rank, destination rank)` pairs handled.
    pub pairs: u64,
    /// Stripes (lane exchanges) used.
    pub stripes: u64,
    /// Wall time of the network part.
    pub net_time: Duration,
    /// Wall time from the call to completion, device copies included.
    pub elapsed: Duration,
    /// The DMA-map outcome of the staging.
    pub dma: DmaOutcome,
    /// Whether the staging is locked in RAM, or why not (`None` when nothing was staged).
    pub lock: Option<LockStatus>,
}

impl Report {
    fn add_net(&mut self, s: &TransferStats) {
        self.net_bytes = s.bytes;
        self.spans = s.spans;
        self.pairs = s.pairs;
        self.stripes = s.stripes;
        self.net_time = s.elapsed;
    }
}

/// The device buffers of the ranks one call moves: global rank -> one buffer per layer, in
/// layer order, all of one PJRT client. Cheap to clone (buffers are shared handles).
#[derive(Debug, Clone)]
pub struct KvBuffers {
    caps: Capabilities,
    client: Client,
    by_rank: BTreeMap<u32, Vec<DeviceBuffer>>,
}

impl KvBuffers {
    /// Buffers of the client `caps` was probed on ([`Capabilities::probe`]).
    ///
    /// Errors: [`Error::InvalidArgument`] when no rank is given, a rank has no buffers, or the
    /// buffers belong to different clients or to a client of another platform than `caps`.
    pub fn new(caps: &Capabilities, by_rank: BTreeMap<u32, Vec<DeviceBuffer>>) -> Result<Self> {
        let first = by_rank
            .values()
            .flat_map(|v| v.first())
            .next()
            .ok_or_else(|| Error::InvalidArgument("no rank with KV buffers given".into()))?;
        let client = first.client();
        for (r, bufs) in &by_rank {
            if bufs.is_empty() {
                return Err(Error::InvalidArgument(format!(
                    "rank {r} has no layer buffers"
                )));
            }
            for (l, b) in bufs.iter().enumerate() {
                if b.client().raw() != client.raw() {
                    return Err(Error::InvalidArgument(format!(
                        "rank {r} layer {l}: a buffer of another PJRT client (all buffers of one \
                         call must share a client)"
                    )));
                }
            }
        }
        if client.platform_name() != caps.platform {
            return Err(Error::InvalidArgument(format!(
                "capabilities of a `{}` client given for buffers of a `{}` client",
                caps.platform,
                client.platform_name()
            )));
        }
        Ok(KvBuffers {
            caps: caps.clone(),
            client,
            by_rank,
        })
    }

    /// Buffers (layers) per rank (the same for every rank: [`KvBuffers::new`] checks it).
    pub fn num_layers(&self) -> u32 {
        self.by_rank.values().next().map_or(0, |v| v.len() as u32)
    }

    /// The global ranks, ascending.
    pub fn ranks(&self) -> Vec<u32> {
        self.by_rank.keys().copied().collect()
    }

    /// The buffers of `rank`, in layer order.
    pub fn get(&self, rank: u32) -> Option<&[DeviceBuffer]> {
        self.by_rank.get(&rank).map(Vec::as_slice)
    }

    /// The client's probed capabilities.
    pub fn caps(&self) -> &Capabilities {
        &self.caps
    }

    /// The buffers' client.
    pub fn client(&self) -> &Client {
        &self.client
    }

    /// Checks every rank against `placement`: in its DP replica, and every buffer against its
    /// layout ([`check_rank_buffers`]; for a placement with KV cache groups every cache layer's
    /// buffer against its own group, [`check_group_buffers`]).
    ///
    /// Errors: [`Error::InvalidArgument`] for a rank outside the replica; [`Error::Mismatch`]
    /// for a buffer that disagrees with the layout.
    pub fn check(&self, placement: &Placement, side: &str) -> Result<()> {
        for (&r, bufs) in &self.by_rank {
            if placement.local_rank(r).is_none() {
                return Err(Error::InvalidArgument(format!(
                    "rank {r} is not in the {side} placement's DP replica {} ({} ranks per \
                     replica)",
                    placement.dp_rank,
                    placement.layout.spec.ranks_per_replica()
                )));
            }
            match &placement.groups {
                Some(h) => check_group_buffers(r, &h.layout, bufs),
                None => check_rank_buffers(r, &placement.layout, bufs),
            }
            .map_err(|e| e.context(format!("{side} side")))?;
        }
        Ok(())
    }
}

/// A request's blocks offered for pulling ([`Pipeline::offer`]).
#[derive(Debug, Clone)]
pub struct Offer {
    /// Request id, `1..=2^53-1`.
    pub request_id: u64,
    /// Tokens of the request.
    pub num_tokens: u32,
    /// Where the request's blocks are on this side.
    pub placement: Placement,
    /// This side's ranks of the placement's replica, with their buffers.
    pub kv: KvBuffers,
    /// Consumers that must pull it (>= 1; one per decode rank that pulls from these ranks).
    pub expected_releases: u32,
}

/// A pull into this side's buffers ([`Pipeline::pull`]).
#[derive(Debug, Clone)]
pub struct PullInto {
    /// Request id.
    pub request_id: u64,
    /// Tokens of the request.
    pub num_tokens: u32,
    /// The producers' placement.
    pub src: Placement,
    /// Which endpoint hosts each source rank.
    pub sources: PeerMap,
    /// This side's placement.
    pub dst: Placement,
    /// This side's ranks pulled here, with their buffers (written in place).
    pub kv: KvBuffers,
    /// How long the producers may take to register the request (`None`: a producer that does
    /// not know it fails the pull with [`Error::UnknownRequest`] at once).
    pub wait_for_registration: Option<Duration>,
}

/// A push from this side's buffers ([`Pipeline::push`]).
#[derive(Debug, Clone)]
pub struct PushFrom {
    /// Request id.
    pub request_id: u64,
    /// Tokens of the request.
    pub num_tokens: u32,
    /// This side's placement.
    pub src: Placement,
    /// This side's ranks of `src`'s replica, with their buffers.
    pub kv: KvBuffers,
    /// The destination placement.
    pub dst: Placement,
    /// Which endpoint hosts each destination rank.
    pub targets: PeerMap,
}

/// A push expected into this side's buffers ([`Pipeline::expect_push`]).
#[derive(Debug, Clone)]
pub struct ExpectPush {
    /// Request id.
    pub request_id: u64,
    /// Tokens of the request.
    pub num_tokens: u32,
    /// The senders' placement.
    pub src: Placement,
    /// This side's placement.
    pub dst: Placement,
    /// This side's ranks that receive, with their buffers (written in place).
    pub kv: KvBuffers,
}

/// The state of an offered request ([`Pipeline::offer_state`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OfferState {
    /// Registered and served.
    Active,
    /// Every expected consumer released it after a complete pull.
    Released,
    /// The consumers rejected it (they will not pull it); the first reason.
    Rejected(String),
    /// No live consumer held a lease for the lease time.
    Expired,
    /// A consumer holding a lease died.
    PeerLost(String),
    /// Withdrawn ([`Pipeline::withdraw`]).
    Unregistered,
    /// The endpoint shut down.
    Shutdown,
    /// Never offered here, or forgotten (more than [`MAX_ENDED_OFFERS`] ended since).
    Unknown,
}

impl OfferState {
    fn of(o: SourceOutcome) -> OfferState {
        match o {
            SourceOutcome::Released => OfferState::Released,
            SourceOutcome::Rejected(why) => OfferState::Rejected(why),
            SourceOutcome::Expired => OfferState::Expired,
            SourceOutcome::PeerLost(w) => OfferState::PeerLost(w),
            SourceOutcome::Unregistered => OfferState::Unregistered,
            SourceOutcome::Shutdown => OfferState::Shutdown,
        }
    }

    /// `active`, `released`, `rejected`, `expired`, `peer_lost`, `unregistered`, `shutdown`,
    /// `unknown`.
    pub fn name(&self) -> &'static str {
        match self {
            OfferState::Active => "active",
            OfferState::Released => "released",
            OfferState::Rejected(_) => "rejected",
            OfferState::Expired => "expired",
            OfferState::PeerLost(_) => "peer_lost",
            OfferState::Unregistered => "unregistered",
            OfferState::Shutdown => "shutdown",
            OfferState::Unknown => "unknown",
        }
    }
}

struct OfferEntry {
    handle: SourceHandle,
    report: Report,
    /// Layers still to be staged ([`Pipeline::offer_layers`]); `None` once every layer is.
    layered: Mutex<Option<Layered>>,
}

/// What a layer-wise offer needs to stage its later layers.
struct Layered {
    staging: Arc<Staging>,
    kv: KvBuffers,
    num_layers: u32,
    /// Leading layers staged and published.
    staged: u32,
}

impl OfferEntry {
    /// Stages (D2H) layers `staged..layers` of every rank and publishes them; returns the
    /// layers published afterwards.
    fn publish(&self, layers: u32, max_outstanding: usize) -> Result<u32> {
        let mut g = lock(&self.layered);
        let Some(l) = g.as_mut() else {
            return Ok(self.handle_layers());
        };
        let upto = layers.min(l.num_layers);
        if upto > l.staged {
            for r in l.kv.ranks() {
                let bufs = l.kv.get(r).unwrap_or_default();
                l.staging
                    .fill_layers_from_device(r, bufs, l.staged..upto, max_outstanding)
                    .map_err(|e| {
                        e.context(format!(
                            "D2H of layers {}..{upto} of rank {r} of request {}",
                            l.staged,
                            self.handle.request_id()
                        ))
                    })?;
            }
            l.staged = upto;
            self.handle.publish_layers(upto);
        }
        let n = l.staged;
        if n >= l.num_layers {
            // Every layer is staged: the registration alone keeps the staging now.
            *g = None;
        }
        Ok(n)
    }

    fn handle_layers(&self) -> u32 {
        self.handle.layers_published()
    }
}

/// The producer's handle of an offered request. Holding it keeps the staging alive until the
/// registration ends; drop it to let the pipeline free the staging as soon as it does.
#[derive(Clone)]
pub struct OfferHandle {
    entry: Arc<OfferEntry>,
}

impl std::fmt::Debug for OfferHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OfferHandle")
            .field("request_id", &self.entry.handle.request_id())
            .finish()
    }
}

impl OfferHandle {
    /// The request id.
    pub fn request_id(&self) -> u64 {
        self.entry.handle.request_id()
    }

    /// What staging the request did.
    pub fn report(&self) -> &Report {
        &self.entry.report
    }

    /// How the registration ended, if it did.
    pub fn state(&self) -> OfferState {
        self.entry
            .handle
            .outcome()
            .map(OfferState::of)
            .unwrap_or(OfferState::Active)
    }

    /// Waits until the registration ends or `timeout` passes ([`Error::Timeout`]).
    pub async fn wait(&self, timeout: Duration) -> Result<OfferState> {
        self.entry.handle.wait(timeout).await.map(OfferState::of)
    }

    /// Leading layers staged and published so far (every layer for a whole-request offer).
    pub fn layers_published(&self) -> u32 {
        self.entry.handle_layers()
    }
}

#[derive(Default)]
struct Offers {
    live: HashMap<u64, Arc<OfferEntry>>,
    ended: HashMap<u64, OfferState>,
    order: VecDeque<u64>,
}

impl Offers {
    fn end(&mut self, id: u64, entry: &Arc<OfferEntry>, state: OfferState) {
        if !self.live.get(&id).is_some_and(|e| Arc::ptr_eq(e, entry)) {
            return;
        }
        self.live.remove(&id);
        if self.ended.insert(id, state).is_none() {
            self.order.push_back(id);
        }
        while self.order.len() > MAX_ENDED_OFFERS {
            if let Some(old) = self.order.pop_front() {
                self.ended.remove(&old);
            }
        }
    }

    /// Moves every ended registration from `live` to `ended` (for registrations whose watcher
    /// has not run yet).
    fn sweep(&mut self) {
        let done: Vec<(u64, Arc<OfferEntry>, SourceOutcome)> = self
            .live
            .iter()
            .filter_map(|(id, e)| e.handle.outcome().map(|o| (*id, e.clone(), o)))
            .collect();
        for (id, e, o) in done {
            self.end(id, &e, OfferState::of(o));
        }
    }
}

#[derive(Debug, Default)]
struct Counters {
    offers: AtomicU64,
    pulls: AtomicU64,
    pushes: AtomicU64,
    expected_pushes: AtomicU64,
    refused: AtomicU64,
    refusals: AtomicU64,
    rejects_sent: AtomicU64,
    dma_mapped: AtomicU64,
    dma_skipped: AtomicU64,
    dma_last: Mutex<Option<String>>,
}

/// A pipeline's counters ([`Pipeline::stats`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PipelineStats {
    /// The endpoint's counters.
    pub endpoint: net::Stats,
    /// The staging budget's counters.
    pub budget: BudgetStats,
    /// Gauge: offers registered and not ended.
    pub offers_live: u64,
    /// Totals: offers, pulls, pushes and expected pushes submitted.
    pub offers: u64,
    /// See `offers`.
    pub pulls: u64,
    /// See `offers`.
    pub pushes: u64,
    /// See `offers`.
    pub expected_pushes: u64,
    /// Total: operations refused before any byte moved (checks, plan, budget).
    pub refused: u64,
    /// Total: requests this producer refused ([`Pipeline::refuse`]: their consumers' pulls
    /// fail at once).
    pub refusals: u64,
    /// Total: rejects sent to producers.
    pub rejects_sent: u64,
    /// Total: staging arenas DMA-mapped with their client.
    pub dma_mapped: u64,
    /// Total: staging arenas whose DMA map the plugin does not implement.
    pub dma_skipped: u64,
    /// The last DMA-map outcome, as text (`None` before the first staging).
    pub dma_last: Option<String>,
    /// The staging arena pool's counters (hits, misses, idle bytes; [`TransferOptions::staging_pool_bytes`]).
    pub pool: PoolStats,
    /// The endpoint's plan cache's counters ([`Endpoint::plan_cache`]).
    pub plans: PlanCacheStats,
}

struct Job {
    request_id: u64,
    net: Transfer,
    result: watch::Sender<Option<Result<Report>>>,
    cancelled: AtomicBool,
    /// Layers of the destination buffers (0 for pushes).
    num_layers: u32,
    /// Leading layers written into the destination buffers (H2D) so far.
    written: watch::Sender<u32>,
    /// The job's task until a runtime worker or a caller of [`TransferHandle::wait`] runs it
    /// ([`Pipeline::drive_job`]).
    driver: crate::drive::DriverSlot,
}

impl Job {
    /// Sets the result once (later calls do nothing).
    fn complete(&self, r: Result<Report>) {
        self.result.send_if_modified(|v| {
            if v.is_none() {
                *v = Some(r);
                true
            } else {
                false
            }
        });
    }
}

/// Completes its job with [`Error::Cancelled`] if the task holding it ends (or is dropped with
/// its runtime) before setting a result, so that no waiter waits forever.
struct Completer(Arc<Job>);

impl Drop for Completer {
    fn drop(&mut self) {
        // A network transfer made unstarted for this task (`Endpoint::pull_unstarted`) that the
        // task never ran is cancelled: nothing will write its bytes into the device buffers.
        if self.0.net.unstarted() {
            self.0.net.cancel();
        }
        self.0.complete(Err(Error::Cancelled(format!(
            "request {}: the transfer task ended without a result (runtime shut down?)",
            self.0.request_id
        ))));
    }
}

/// A submitted pull, push or expected push: await, poll or cancel it. `Send + Sync`, cheap to
/// clone; dropping it does not cancel the operation.
#[derive(Clone)]
pub struct TransferHandle {
    job: Arc<Job>,
}

impl std::fmt::Debug for TransferHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TransferHandle")
            .field("request_id", &self.job.request_id)
            .field("net", &self.job.net)
            .finish()
    }
}

impl TransferHandle {
    /// The request.
    pub fn request_id(&self) -> u64 {
        self.job.request_id
    }

    /// The result once complete: `Ok` only when every byte arrived, verified and (for pulls and
    /// expected pushes) was written into the device buffers.
    pub fn poll(&self) -> Option<Result<Report>> {
        self.job.result.borrow().clone()
    }

    /// Whether it completed (successfully or not).
    pub fn is_done(&self) -> bool {
        self.job.result.borrow().is_some()
    }

    /// Waits for the result.
    pub async fn wait(&self) -> Result<Report> {
        let mut rx = self.job.result.subscribe();
        // A caller that gets here before a runtime worker started the transfer's task runs it
        // itself until the result is set (its remaining work, e.g. the delivering release,
        // then goes back to the runtime: `crate::drive::DriveHere`).
        let mut here = crate::drive::may_drive_here()
            .then(|| self.job.driver.take())
            .flatten()
            .map(|d| crate::drive::DriveHere::new(Some(d)));
        let r = loop {
            // The result first: once it is set the caller returns, and what the task does
            // after it (the delivering release) goes on on the runtime.
            tokio::select! {
                biased;
                v = rx.wait_for(Option::is_some) => break match v {
                    Ok(v) => v.clone(),
                    Err(_) => None,
                },
                _ = async { if let Some(h) = here.as_mut() { h.await } }, if here.is_some() => {
                    here = None;
                }
            }
        };
        drop(here);
        r.unwrap_or_else(|| Err(Error::Cancelled("transfer task ended".into())))
    }

    /// Cancels it: it fails with [`Error::Cancelled`] unless already complete; nothing more is
    /// written into the device buffers once the network part was cancelled. Returns at once.
    pub fn cancel(&self) {
        self.job.cancelled.store(true, Ordering::SeqCst);
        self.job.net.cancel();
    }

    /// Leading layers received and verified so far (pulls and expected pushes).
    pub fn layers_complete(&self) -> u32 {
        self.job.net.layers_complete()
    }

    /// Layers of the destination buffers (pulls and expected pushes; 0 for pushes).
    pub fn num_layers(&self) -> u32 {
        self.job.num_layers
    }

    /// Leading layers written into the destination buffers (H2D) so far: layer by layer for
    /// [`Pipeline::pull_layerwise`], all at once at the end for the other receiving operations.
    /// A layer counted here holds its final bytes: the model may read it, also while the later
    /// layers still arrive.
    pub fn layers_written(&self) -> u32 {
        *self.job.written.borrow()
    }

    /// Waits until the first `layers` layers (at most [`TransferHandle::num_layers`]) are
    /// written into the destination buffers. Errors: the transfer's error when it fails first
    /// (layers written before the failure hold their final bytes; later ones are undefined).
    pub async fn wait_layers_written(&self, layers: u32) -> Result<()> {
        let want = layers.min(self.job.num_layers);
        let mut written = self.job.written.subscribe();
        let mut result = self.job.result.subscribe();
        loop {
            if *written.borrow_and_update() >= want {
                return Ok(());
            }
            match &*result.borrow_and_update() {
                Some(Err(e)) => return Err(e.clone()),
                Some(Ok(_)) => return Ok(()),
                None => {}
            }
            tokio::select! {
                r = written.changed() => { if r.is_err() { return Err(Error::Cancelled("transfer task ended".into())); } }
                r = result.changed() => { if r.is_err() { return Err(Error::Cancelled("transfer task ended".into())); } }
            }
        }
    }
}

/// One endpoint with its staging budget and options: the transfer pipeline. See the
/// [module docs](self).
pub struct Pipeline {
    ep: Arc<Endpoint>,
    rt: tokio::runtime::Handle,
    opts: TransferOptions,
    budget: Arc<StagingBudget>,
    pool: Arc<ArenaPool>,
    offers: Arc<Mutex<Offers>>,
    counters: Arc<Counters>,
    releases: Arc<PendingReleases>,
}

impl std::fmt::Debug for Pipeline {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pipeline")
            .field("endpoint", &self.ep)
            .field("budget", &self.budget)
            .finish()
    }
}

impl Pipeline {
    /// A pipeline over `endpoint`. Must be called inside a tokio runtime, whose handle the
    /// pipeline keeps for its tasks.
    ///
    /// Errors: [`Error::InvalidArgument`] outside a runtime or for `d2h_max_outstanding == 0`.
    pub fn new(endpoint: Arc<Endpoint>, opts: TransferOptions) -> Result<Pipeline> {
        let rt = tokio::runtime::Handle::try_current().map_err(|_| {
            Error::InvalidArgument(
                "a transfer pipeline must be created inside a tokio runtime".into(),
            )
        })?;
        if opts.d2h_max_outstanding == 0 {
            return Err(Error::InvalidArgument(
                "d2h_max_outstanding must be >= 1".into(),
            ));
        }
        let budget = match opts.staging_budget_bytes {
            Some(n) => StagingBudget::new(format!("endpoint {}", endpoint.name()), n),
            None => StagingBudget::process().clone(),
        };
        let pool = ArenaPool::new(opts.staging_pool_bytes, opts.arena.clone(), budget.clone());
        Ok(Pipeline {
            ep: endpoint,
            rt,
            opts,
            budget,
            pool,
            offers: Arc::default(),
            counters: Arc::default(),
            releases: Arc::default(),
        })
    }

    /// Binds an endpoint ([`Endpoint::bind`]) and wraps it.
    pub async fn bind(endpoint: EndpointOptions, opts: TransferOptions) -> Result<Pipeline> {
        let ep = Endpoint::bind(endpoint).await?;
        Pipeline::new(Arc::new(ep), opts)
    }

    /// The endpoint (addresses, peers, its own stats, shutdown).
    pub fn endpoint(&self) -> &Arc<Endpoint> {
        &self.ep
    }

    /// The staging budget.
    pub fn budget(&self) -> &Arc<StagingBudget> {
        &self.budget
    }

    /// The options.
    pub fn options(&self) -> &TransferOptions {
        &self.opts
    }

    /// The staging arena pool ([`TransferOptions::staging_pool_bytes`]).
    pub fn staging_pool(&self) -> &Arc<ArenaPool> {
        &self.pool
    }

    /// Bytes of the staging budget held by this pipeline's live operations and anyone else
    /// sharing the budget: the budget's use less the pool's idle arenas.
    pub fn staging_in_use(&self) -> u64 {
        self.budget
            .used()
            .saturating_sub(self.pool.stats().idle_bytes)
    }

    fn refused<T>(&self, r: Result<T>) -> Result<T> {
        if r.is_err() {
            self.counters.refused.fetch_add(1, Ordering::Relaxed);
        }
        r
    }

    /// Reserves and allocates staging for `ranges`, and DMA-maps it with `client`.
    fn stage(
        &self,
        ranges: BTreeMap<u32, Vec<ByteRange>>,
        client: &Client,
        what: &str,
    ) -> Result<(Arc<Staging>, DmaOutcome)> {
        let staging = Staging::new_pooled(
            ranges,
            &self.pool,
            self.opts.dma_map.then_some(client),
            what,
            self.opts.staging_wait,
        )?;
        let dma = if self.opts.dma_map {
            match staging.arena().register_dma(client)? {
                DmaRegistration::Mapped => {
                    self.counters.dma_mapped.fetch_add(1, Ordering::Relaxed);
                    DmaOutcome::Mapped
                }
                DmaRegistration::Skipped(why) => {
                    self.counters.dma_skipped.fetch_add(1, Ordering::Relaxed);
                    DmaOutcome::Skipped(why)
                }
            }
        } else {
            DmaOutcome::Disabled
        };
        *lock(&self.counters.dma_last) = Some(dma.to_string());
        Ok((Arc::new(staging), dma))
    }

    /// D2H of every rank of `kv` into `staging`; adds the copies to `report`.
    fn fill(&self, staging: &Staging, kv: &KvBuffers, report: &mut Report) -> Result<()> {
        let t = Instant::now();
        for r in kv.ranks() {
            let bufs = kv.get(r).unwrap_or_default();
            let s = staging
                .fill_from_device(r, bufs, self.opts.d2h_max_outstanding)
                .map_err(|e| e.context(format!("D2H of rank {r}")))?;
            report.device_bytes += s.bytes;
            report.device_ops += s.ops;
        }
        report.device_time = t.elapsed();
        Ok(())
    }

    /// D2H of layers `layers` of every rank of `kv` into `staging`; adds the copies to `report`.
    fn fill_layers(
        &self,
        staging: &Staging,
        kv: &KvBuffers,
        layers: std::ops::Range<u32>,
        report: &mut Report,
    ) -> Result<()> {
        let t = Instant::now();
        for r in kv.ranks() {
            let bufs = kv.get(r).unwrap_or_default();
            let s = staging
                .fill_layers_from_device(r, bufs, layers.clone(), self.opts.d2h_max_outstanding)
                .map_err(|e| e.context(format!("D2H of rank {r}")))?;
            report.device_bytes += s.bytes;
            report.device_ops += s.ops;
        }
        report.device_time = t.elapsed();
        Ok(())
    }

    /// Producer side of a pull: checks every buffer against the placement's layout, stages the
    /// request's blocks of `offer.kv`'s ranks (budget, DMA map, D2H) and registers them until
    /// `expected_releases` consumers released (or rejected) them, the lease passes without a
    /// live consumer, or [`Pipeline::withdraw`]. Blocks for the D2H copies; the device blocks
    /// may be reused as soon as it returns. The staging is freed when the registration ends.
    ///
    /// Errors (nothing staged or registered, other offers untouched): [`Error::InvalidArgument`]
    /// (id, ranks, `expected_releases == 0`, a duplicate id), the placement's errors,
    /// [`Error::Mismatch`] (a buffer disagrees with the layout), [`Error::StagingExhausted`],
    /// device copy errors.
    pub fn offer(&self, offer: Offer) -> Result<OfferHandle> {
        self.refused(self.offer_inner(offer, None))
    }

    /// [`Pipeline::offer`] of a request whose later layers are not computed yet: checks,
    /// reserves and maps the staging of every layer as `offer` does, but copies (D2H) only the
    /// first `layers_ready` layers (clamped to the buffers' layer count) before registering.
    /// Pullers may connect at once; they receive layer `l` only once it is published with
    /// [`Pipeline::publish_layers`] (which stages it). The device blocks of unpublished layers
    /// must stay untouched by anything but the model computing them until they are published.
    ///
    /// Errors: as [`Pipeline::offer`].
    pub fn offer_layers(&self, offer: Offer, layers_ready: u32) -> Result<OfferHandle> {
        self.refused(self.offer_inner(offer, Some(layers_ready)))
    }

    /// Stages (D2H, blocking) and publishes the layers of a [layer-wise
    /// offer](Pipeline::offer_layers) up to `layers` (exclusive; monotone: a smaller value does
    /// nothing); returns the number of layers published afterwards. The device blocks of those
    /// layers may be reused once it returns. A whole-request offer answers its layer count.
    ///
    /// Errors: [`Error::UnknownRequest`] when `request_id` is not registered here (never, or
    /// ended); device copy errors (the layers before the failing one stay published; withdraw
    /// the offer, its pullers then fail).
    pub fn publish_layers(&self, request_id: u64, layers: u32) -> Result<u32> {
        let entry = {
            let mut m = lock(&self.offers);
            m.sweep();
            m.live.get(&request_id).cloned()
        };
        match entry {
            Some(e) => e.publish(layers, self.opts.d2h_max_outstanding),
            None => Err(Error::UnknownRequest(format!(
                "request {request_id} is not registered here ({})",
                self.offer_state(request_id).name()
            ))),
        }
    }

    fn offer_inner(&self, o: Offer, layers_ready: Option<u32>) -> Result<OfferHandle> {
        let t0 = Instant::now();
        net::check_request_id(o.request_id)?;
        if o.expected_releases == 0 {
            return Err(Error::InvalidArgument(
                "expected_releases must be >= 1".into(),
            ));
        }
        o.placement.validate(o.num_tokens)?;
        o.kv.check(&o.placement, "producer")?;
        if lock(&self.offers).live.contains_key(&o.request_id) {
            return Err(Error::InvalidArgument(format!(
                "request {} is already registered",
                o.request_id
            )));
        }
        let mut ranges = BTreeMap::new();
        for r in o.kv.ranks() {
            let local = o.placement.local_rank(r).unwrap_or_default();
            ranges.insert(r, o.placement.try_block_ranges(local)?);
        }
        let (staging, dma) = self.stage(
            ranges,
            o.kv.client(),
            &format!("staging of request {}", o.request_id),
        )?;
        let mut report = Report {
            staged_bytes: staging.reserved_bytes(),
            dma,
            lock: Some(staging.arena().lock_status().clone()),
            ..Report::default()
        };
        let num_layers = o.kv.num_layers();
        let ready = layers_ready.map(|n| n.min(num_layers));
        match ready {
            None => self.fill(&staging, &o.kv, &mut report)?,
            Some(n) => self.fill_layers(&staging, &o.kv, 0..n, &mut report)?,
        }
        let layered = match ready {
            Some(n) if n < num_layers => Some(Layered {
                staging: staging.clone(),
                kv: o.kv.clone(),
                num_layers,
                staged: n,
            }),
            _ => None,
        };
        let handle = {
            let _g = self.rt.enter();
            self.ep.register_source(SourceRegistration {
                request_id: o.request_id,
                num_tokens: o.num_tokens,
                placement: o.placement,
                staging,
                layers_ready: ready,
                expected_releases: o.expected_releases,
            })?
        };
        report.elapsed = t0.elapsed();
        let entry = Arc::new(OfferEntry {
            handle,
            report,
            layered: Mutex::new(layered),
        });
        {
            let mut m = lock(&self.offers);
            m.sweep();
            m.ended.remove(&o.request_id);
            m.live.insert(o.request_id, entry.clone());
        }
        self.counters.offers.fetch_add(1, Ordering::Relaxed);
        // Drop the registry's reference (and with it the staging) as soon as it ends.
        let weak: Weak<Mutex<Offers>> = Arc::downgrade(&self.offers);
        let e = entry.clone();
        let id = o.request_id;
        self.rt
            .spawn(tracing::Instrument::in_current_span(async move {
                let state = match e.handle.wait(Duration::from_secs(365 * 24 * 3600)).await {
                    Ok(o) => OfferState::of(o),
                    Err(_) => return,
                };
                if let Some(offers) = weak.upgrade() {
                    lock(&offers).end(id, &e, state);
                }
            }));
        Ok(OfferHandle { entry })
    }

    /// The state of an offered request: active, how it ended, or unknown.
    pub fn offer_state(&self, request_id: u64) -> OfferState {
        let mut m = lock(&self.offers);
        m.sweep();
        if m.live.contains_key(&request_id) {
            return OfferState::Active;
        }
        m.ended
            .get(&request_id)
            .cloned()
            .unwrap_or(OfferState::Unknown)
    }

    /// Withdraws an offer (pulls in progress fail). Returns whether it was still registered.
    pub fn withdraw(&self, request_id: u64) -> bool {
        let existed = self.ep.unregister_source(request_id);
        lock(&self.offers).sweep();
        existed
    }

    /// Refuses request `request_id` as its producer (its registration failed, or it was given
    /// up): an offer of it is withdrawn, and for the endpoint's lease TTL (or until it is
    /// offered again) its consumers' pulls fail at once with [`Error::Cancelled`] carrying
    /// `reason`, instead of waiting for a registration until their timeout
    /// ([`Endpoint::refuse_source`]). Returns whether an offer was withdrawn.
    ///
    /// Errors: [`Error::InvalidArgument`] for an invalid request id.
    pub fn refuse(&self, request_id: u64, reason: &str) -> Result<bool> {
        let existed = self.ep.refuse_source(request_id, reason)?;
        self.counters.refusals.fetch_add(1, Ordering::Relaxed);
        lock(&self.offers).sweep();
        Ok(existed)
    }

    /// Consumer side: checks, plans `src -> dst`, stages exactly the bytes the plan writes to
    /// `pull.kv`'s ranks (budget, DMA map), and starts pulling. Once every byte arrived and
    /// verified it is written in place into the buffers (H2D), the transfer is reported done
    /// and the request is released at the producers (a delivering release, sent to every
    /// producer endpoint at once; off the critical path, as NIXL's "done reading"
    /// notification is: the producers free their staging when it arrives, and
    /// [`Pipeline::shutdown`] waits for releases still on their way). A
    /// failed or cancelled pull releases without delivery (the producer keeps the request for
    /// a retry, until its lease passes or the consumer [rejects](Pipeline::reject) it), except
    /// when the failure is the producer's ([`Error::is_peer_failure`]: dead, unreachable); that
    /// release follows the failure and names the failed pull
    /// ([`Endpoint::release_pull`]), so a retry made at once is not undone by it.
    ///
    /// No computation may use the destination blocks until the transfer completes.
    ///
    /// Errors (before anything is sent): [`Error::InvalidArgument`], the placements' and the
    /// plan's errors, [`Error::Mismatch`], [`Error::Unsupported`] (no in-place H2D path),
    /// [`Error::StagingExhausted`]. Network and device errors come through the handle.
    pub fn pull(&self, pull: PullInto) -> Result<TransferHandle> {
        self.refused(self.pull_inner(pull, false))
    }

    /// [`Pipeline::pull`] that writes each layer into the device buffers (H2D) as soon as it
    /// arrived and verified on every pair, in layer order, instead of all layers after the
    /// last byte: [`TransferHandle::layers_written`] and
    /// [`TransferHandle::wait_layers_written`] say which layers the model may read. The
    /// release and the handle's completion are as for [`Pipeline::pull`]. A cancel stops the
    /// H2D copies before the next layer.
    ///
    /// Errors: as [`Pipeline::pull`].
    pub fn pull_layerwise(&self, pull: PullInto) -> Result<TransferHandle> {
        self.refused(self.pull_inner(pull, true))
    }

    fn plan_destination(
        &self,
        src: &Placement,
        dst: &Placement,
        num_tokens: u32,
        kv: &KvBuffers,
        what: String,
    ) -> Result<(Arc<Plan>, Arc<Staging>, Report)> {
        let plan = self.ep.plan_cache().get_or_build(src, dst, num_tokens)?;
        kv.check(dst, "destination")?;
        kv.caps().require_h2d()?;
        let ranges = kv
            .ranks()
            .into_iter()
            .map(|r| (r, plan.dst_ranges(r)))
            .collect();
        let (staging, dma) = self.stage(ranges, kv.client(), &what)?;
        let report = Report {
            staged_bytes: staging.reserved_bytes(),
            dma,
            lock: Some(staging.arena().lock_status().clone()),
            ..Report::default()
        };
        Ok((plan, staging, report))
    }

    fn pull_inner(&self, p: PullInto, layerwise: bool) -> Result<TransferHandle> {
        let t0 = Instant::now();
        net::check_request_id(p.request_id)?;
        let (plan, staging, report) = self.plan_destination(
            &p.src,
            &p.dst,
            p.num_tokens,
            &p.kv,
            format!("destination staging of request {}", p.request_id),
        )?;
        let src_addrs = p
            .sources
            .addresses((0..p.src.layout.spec.ranks_per_replica()).map(|l| p.src.global_rank(l)))?;
        // The job's task runs the network transfer itself (`receive`'s wait), so no task of
        // its own is spawned for it (two thread wake-ups fewer per pull: `Start::OnWait`); a
        // layer-wise receive starts it, as it waits for layers instead.
        let t = {
            let _g = self.rt.enter();
            self.ep.pull_unstarted(PullRequest {
                request_id: p.request_id,
                num_tokens: p.num_tokens,
                src: p.src,
                sources: p.sources,
                dst: p.dst,
                staging: staging.clone(),
                dst_ranks: Some(p.kv.ranks()),
                plan: Some(plan),
                wait_for_registration: p.wait_for_registration,
            })?
        };
        self.counters.pulls.fetch_add(1, Ordering::Relaxed);
        let (handle, job) = self.job(p.request_id, t.clone(), p.kv.num_layers());
        let ep = self.ep.clone();
        let releases = self.releases.clone();
        let kv = p.kv;
        self.drive_job(
            &job,
            |job| {
                tracing::Instrument::in_current_span(async move {
                    let r = if layerwise {
                        t.start();
                        receive_layers(&job.0, &t, staging, kv, report, t0).await
                    } else {
                        receive(&job.0, &t, staging, kv, report, t0).await
                    };
                    let delivered = r.is_ok();
                    let pull = t.id();
                    if delivered {
                        // The bytes are in place: the pull is done now, and the delivering release
                        // (the producers free the request instead of holding it until its lease
                        // expires) leaves the critical path. Counted as pending before the caller
                        // can see "done", so a shutdown after it still sends it. The yield lets a
                        // caller that runs this task itself (`TransferHandle::wait`) return before
                        // the release is sent: the rest then runs on the runtime.
                        let _pending = releases.start();
                        job.0.complete(r);
                        tokio::task::yield_now().await;
                        release_all(&ep, &src_addrs, job.0.request_id, true, pull).await;
                    } else {
                        // A failed pull completes at once; its release (no delivery: the producers
                        // keep the request for a retry, this consumer's lease ends) follows and
                        // must not delay the failure (a producer that never answers would hold it
                        // for an I/O timeout). It names this pull, so a producer ignores it once a
                        // retry began pulling: a retry made at once keeps its lease whatever order
                        // the two reach the producer in. A producer that died or cannot be
                        // reached is not told.
                        let peer_gone = r.as_ref().err().is_some_and(Error::is_peer_failure);
                        job.0.complete(r);
                        if !peer_gone {
                            release_all(&ep, &src_addrs, job.0.request_id, false, pull).await;
                        }
                    }
                })
            },
            true,
        );
        Ok(handle)
    }

    /// Runs `job`'s task `fut` on whichever comes first: a task on the pipeline's runtime, or a
    /// caller of [`TransferHandle::wait`] on its own thread (`crate::drive`: saves a runtime
    /// worker's wake-up at each end of a small transfer).
    ///
    /// `inline`: the task is polled once on this thread instead (a pull's request leaves at
    /// once, and no runtime thread is woken until its answer arrives: `crate::drive`), where
    /// this thread may (`crate::drive::may_poll_first`).
    ///
    /// `task` gets the job's [`Completer`], made before the task's first poll: a task dropped
    /// unpolled (its runtime shut down) still completes the job and cancels its unstarted
    /// network transfer.
    fn drive_job<F, Fut>(&self, job: &Arc<Job>, task: F, inline: bool)
    where
        F: FnOnce(Completer) -> Fut,
        Fut: std::future::Future<Output = ()> + Send + 'static,
    {
        let fut = task(Completer(job.clone()));
        job.driver.put(fut, self.rt.clone());
        if inline && crate::drive::may_poll_first() {
            job.driver.poll_first();
        } else {
            self.rt
                .spawn(crate::drive::start(job.clone(), |j: &Job| &j.driver));
        }
    }

    fn job(&self, request_id: u64, net: Transfer, num_layers: u32) -> (TransferHandle, Arc<Job>) {
        let (tx, _) = watch::channel(None);
        let (written, _) = watch::channel(0);
        let job = Arc::new(Job {
            request_id,
            net,
            result: tx,
            cancelled: AtomicBool::new(false),
            num_layers,
            written,
            driver: Default::default(),
        });
        (TransferHandle { job: job.clone() }, job)
    }

    /// Producer-initiated: checks, stages (budget, DMA map, D2H; blocking) the request's blocks
    /// of `push.kv`'s ranks and sends each destination rank exactly its spans. The device
    /// blocks may be reused as soon as it returns; the transfer completes when every
    /// destination endpoint confirmed.
    ///
    /// The D2H of a multi-layer request of at least [`PUSH_PIPELINE_MIN_BYTES`] staged runs in
    /// up to [`PUSH_PIPELINE_GROUPS`] groups of layers: sending starts once the first group is
    /// staged, and each further group is published to the network as its D2H completes, so
    /// the copies overlap the transfer of the layers before them.
    ///
    /// Errors (before anything is sent): as [`Pipeline::pull`], plus device copy errors. A D2H
    /// error of a later group of layers cancels the push already started (its receivers are
    /// told, nothing past the published layers is sent) and is returned.
    pub fn push(&self, push: PushFrom) -> Result<TransferHandle> {
        self.refused(self.push_inner(push))
    }

    fn push_inner(&self, p: PushFrom) -> Result<TransferHandle> {
        let t0 = Instant::now();
        net::check_request_id(p.request_id)?;
        let plan = self
            .ep
            .plan_cache()
            .get_or_build(&p.src, &p.dst, p.num_tokens)?;
        p.kv.check(&p.src, "source")?;
        let mut ranges = BTreeMap::new();
        for r in p.kv.ranks() {
            let local = p.src.local_rank(r).unwrap_or_default();
            ranges.insert(r, p.src.try_block_ranges(local)?);
        }
        // Every destination rank needs an address before anything is staged.
        p.targets
            .addresses((0..p.dst.layout.spec.ranks_per_replica()).map(|l| p.dst.global_rank(l)))?;
        let (staging, dma) = self.stage(
            ranges,
            p.kv.client(),
            &format!("staging of request {}", p.request_id),
        )?;
        let mut report = Report {
            staged_bytes: staging.reserved_bytes(),
            dma,
            lock: Some(staging.arena().lock_status().clone()),
            ..Report::default()
        };
        // D2H overlaps the network by groups of layers: the push starts once the first group
        // is staged, and each further group is published as soon as its D2H completed (TPU
        // Sync pipelines D2H by layer the same way). This call still returns only after every
        // D2H, so the device blocks may be reused when it returns.
        let layers = p.kv.num_layers();
        let groups =
            push_layer_groups(layers, p.src.layout.model.num_layers, staging.total_bytes());
        let first = groups.first().cloned().unwrap_or(0..layers);
        self.fill_layers(&staging, &p.kv, first.clone(), &mut report)?;
        let mut device_time = report.device_time;
        // A small push in one group of layers: the job's task runs the network transfer itself
        // (its wait), polled once here (the data leaves from this thread, at most
        // INLINE_H2D_BYTES of it), as a pull's request does. Several groups: it must run while
        // this call stages the later groups. A larger one: its sends run on the runtime.
        let small = groups.len() <= 1 && staging.total_bytes() <= INLINE_H2D_BYTES;
        let t = {
            let _g = self.rt.enter();
            let req = PushRequest {
                request_id: p.request_id,
                num_tokens: p.num_tokens,
                src: p.src,
                staging: staging.clone(),
                src_ranks: Some(p.kv.ranks()),
                dst: p.dst,
                targets: p.targets,
                layers_ready: (first.end < layers).then_some(first.end),
                plan: Some(plan),
            };
            if small {
                self.ep.push_unstarted(req)?
            } else {
                self.ep.push(req)?
            }
        };
        for g in groups.iter().skip(1) {
            if let Err(e) = self.fill_layers(&staging, &p.kv, g.clone(), &mut report) {
                // Nothing past the layers already published is sent; the receivers are told.
                t.cancel();
                return Err(e.context(format!(
                    "D2H of layers {g:?} of request {} (push cancelled)",
                    p.request_id
                )));
            }
            device_time += report.device_time;
            t.publish_layers(g.end);
        }
        report.device_time = device_time;
        self.counters.pushes.fetch_add(1, Ordering::Relaxed);
        let (handle, job) = self.job(p.request_id, t.clone(), 0);
        self.drive_job(
            &job,
            |job| {
                tracing::Instrument::in_current_span(async move {
                    let r = t.wait().await.map(|s| {
                        let mut rep = report;
                        rep.add_net(&s);
                        rep.elapsed = t0.elapsed();
                        rep
                    });
                    job.0.complete(r);
                })
            },
            small,
        );
        Ok(handle)
    }

    /// Consumer side of a push: checks, plans, stages exactly the bytes the plan writes to
    /// `expect.kv`'s ranks and registers them for the senders. The transfer completes once
    /// every sender finished, every chunk verified, and the bytes were written in place into
    /// the buffers (H2D).
    ///
    /// Errors: as [`Pipeline::pull`].
    pub fn expect_push(&self, expect: ExpectPush) -> Result<TransferHandle> {
        self.refused(self.expect_inner(expect))
    }

    fn expect_inner(&self, e: ExpectPush) -> Result<TransferHandle> {
        let t0 = Instant::now();
        net::check_request_id(e.request_id)?;
        let (plan, staging, report) = self.plan_destination(
            &e.src,
            &e.dst,
            e.num_tokens,
            &e.kv,
            format!("destination staging of request {}", e.request_id),
        )?;
        let t = {
            let _g = self.rt.enter();
            self.ep.expect_push(SinkRegistration {
                request_id: e.request_id,
                num_tokens: e.num_tokens,
                placement: e.dst,
                staging: staging.clone(),
                dst_ranks: Some(e.kv.ranks()),
                src: Some(e.src),
                plan: Some(plan),
            })?
        };
        self.counters
            .expected_pushes
            .fetch_add(1, Ordering::Relaxed);
        let (handle, job) = self.job(e.request_id, t.clone(), e.kv.num_layers());
        let kv = e.kv;
        self.drive_job(
            &job,
            |job| {
                tracing::Instrument::in_current_span(async move {
                    let r = receive(&job.0, &t, staging, kv, report, t0).await;
                    job.0.complete(r);
                })
            },
            true,
        );
        Ok(handle)
    }

    /// Tells every producer endpoint in `sources` (its default and per-rank addresses) that this
    /// consumer will not pull `request_id` (the decode side refused or aborted it): each frees
    /// this consumer's part at once and, when no consumer remains, ends the registration as
    /// rejected with `reason` (instead of waiting for the lease). Cancel this consumer's pulls
    /// of the request first.
    ///
    /// Errors: [`Error::InvalidArgument`] for a bad id or an empty peer map; the first
    /// endpoint's error (every endpoint is tried).
    pub async fn reject(&self, request_id: u64, sources: &PeerMap, reason: &str) -> Result<()> {
        net::check_request_id(request_id)?;
        let mut addrs: Vec<String> = sources.default.iter().cloned().collect();
        for a in sources.by_rank.values() {
            if !addrs.contains(a) {
                addrs.push(a.clone());
            }
        }
        if addrs.is_empty() {
            return Err(Error::InvalidArgument("empty peer map".into()));
        }
        let mut first = None;
        for a in &addrs {
            self.counters.rejects_sent.fetch_add(1, Ordering::Relaxed);
            if let Err(e) = reject_at(&self.ep, a, request_id, reason).await {
                first.get_or_insert(e.context(format!("reject of request {request_id} at {a}")));
            }
        }
        first.map_or(Ok(()), Err)
    }

    /// Asks the endpoint at `addr` for a registration's placement and token count (and takes a
    /// lease on it): a consumer that does not know the producer's placement yet.
    pub async fn describe(&self, addr: &str, request_id: u64) -> Result<(Placement, u32)> {
        self.ep.describe(addr, request_id).await
    }

    /// Counters of the pipeline, its budget and its endpoint.
    pub fn stats(&self) -> PipelineStats {
        let offers_live = {
            let mut m = lock(&self.offers);
            m.sweep();
            m.live.len() as u64
        };
        let c = &self.counters;
        let rd = |a: &AtomicU64| a.load(Ordering::Relaxed);
        PipelineStats {
            endpoint: self.ep.stats(),
            budget: self.budget.stats(),
            offers_live,
            offers: rd(&c.offers),
            pulls: rd(&c.pulls),
            pushes: rd(&c.pushes),
            expected_pushes: rd(&c.expected_pushes),
            refused: rd(&c.refused),
            refusals: rd(&c.refusals),
            rejects_sent: rd(&c.rejects_sent),
            dma_mapped: rd(&c.dma_mapped),
            dma_skipped: rd(&c.dma_skipped),
            dma_last: lock(&c.dma_last).clone(),
            pool: self.pool.stats(),
            plans: self.ep.plan_cache().stats(),
        }
    }

    /// Shuts the endpoint down ([`Endpoint::shutdown`]): it stops accepting, waits up to
    /// `drain` for transfers in flight, then waits for the delivering releases of completed
    /// pulls still on their way (until the drain's deadline, and at least [`RELEASE_FLUSH`]),
    /// and aborts what is left: every offer ends ([`OfferState::Shutdown`]) and its staging is
    /// freed.
    pub async fn shutdown(&self, drain: Option<Duration>) {
        let start = tokio::time::Instant::now();
        self.ep.stop_accepting();
        if let Some(d) = drain {
            self.ep.drain_until(start + d).await;
        }
        let flush = start + drain.unwrap_or_default().max(RELEASE_FLUSH);
        let left = self.releases.idle_by(flush).await;
        if left > 0 {
            log::warn!(
                "shutdown: {left} delivering release(s) unanswered after {:?}; those producers \
                 free the requests at their lease expiry",
                start.elapsed()
            );
        }
        self.ep.shutdown(None).await;
        lock(&self.offers).sweep();
    }
}

/// Fails with `Cancelled` when the caller cancelled the job before `what` (e.g. "layer 3 was")
/// written to the device.
/// A push's staged bytes below which its D2H is not split by layer (one batch costs more in
/// hand-overs than overlapping it with the network gains).
pub const PUSH_PIPELINE_MIN_BYTES: u64 = 2 << 20;

/// Most groups of layers a push's D2H is split into ([`Pipeline::push`]): each group is one D2H
/// batch per rank, published to the network when it completes.
pub const PUSH_PIPELINE_GROUPS: u32 = 8;

/// The groups of layers, in order, in which [`Pipeline::push`] stages `layers` layers of
/// `staged_bytes`: one group (no overlap) when the buffers' layers are not the model's
/// (`model_layers`), for a single layer, or below [`PUSH_PIPELINE_MIN_BYTES`]; else at most
/// [`PUSH_PIPELINE_GROUPS`] groups of equal numbers of layers (the last one smaller).
#[allow(clippy::single_range_in_vec_init)] // one group of layers, not the layers of a range
fn push_layer_groups(
    layers: u32,
    model_layers: u32,
    staged_bytes: u64,
) -> Vec<std::ops::Range<u32>> {
    if layers <= 1 || layers != model_layers || staged_bytes < PUSH_PIPELINE_MIN_BYTES {
        return vec![0..layers];
    }
    let per = layers.div_ceil(PUSH_PIPELINE_GROUPS);
    (0..layers)
        .step_by(per as usize)
        .map(|a| a..(a + per).min(layers))
        .collect()
}

fn check_cancelled(job: &Job, what: &str) -> Result<()> {
    if job.cancelled.load(Ordering::SeqCst) {
        return Err(Error::Cancelled(format!(
            "request {} cancelled by the caller before {what} written to the device",
            job.request_id
        )));
    }
    Ok(())
}

/// Writes the staging of every rank in `kv` into its device buffers (H2D) on the blocking pool,
/// under the caller's span (the request, so a trace names it): every layer, or only `layers`.
/// At most [`INLINE_H2D_BYTES`] are copied on the calling (runtime) thread instead.
/// Returns (bytes, copies, time).
async fn write_to_device(
    staging: Arc<Staging>,
    kv: KvBuffers,
    layers: Option<std::ops::Range<u32>>,
) -> Result<(u64, u64, Duration)> {
    let bytes: u64 = staging
        .ranks()
        .filter(|r| kv.get(*r).is_some())
        .flat_map(|r| staging.ranges(r))
        .filter(|s| layers.as_ref().is_none_or(|l| l.contains(&s.range.buffer)))
        .map(|s| s.range.len)
        .sum();
    if bytes <= INLINE_H2D_BYTES {
        // Only where it cannot wait: one rank's small copies with the copy engine idle run on
        // this (runtime) thread; anything else goes to the blocking pool below.
        if let Some(done) = h2d_inline(&staging, &kv, layers.as_ref())? {
            return Ok(done);
        }
    }
    let span = tracing::Span::current();
    tokio::task::spawn_blocking(move || -> Result<(u64, u64, Duration)> {
        let _span = span.entered();
        h2d_now(&staging, &kv, layers.as_ref())
    })
    .await
    .map_err(|e| Error::Cancelled(format!("device copy task ended: {e}")))?
}

/// The H2D copies of [`write_to_device`] on the calling thread if they need no wait: one rank
/// with staged bytes, copied inline ([`Staging::try_drain_inline`]); `Ok(None)` (nothing
/// copied) otherwise.
fn h2d_inline(
    staging: &Staging,
    kv: &KvBuffers,
    layers: Option<&std::ops::Range<u32>>,
) -> Result<Option<(u64, u64, Duration)>> {
    let t = Instant::now();
    let ranks: Vec<u32> = staging.ranks().filter(|r| kv.get(*r).is_some()).collect();
    let [r] = ranks[..] else {
        return Ok(None);
    };
    let Some(bufs) = kv.get(r) else {
        return Ok(None);
    };
    let s = staging
        .try_drain_inline(kv.caps(), r, bufs, layers.cloned())
        .map_err(|e| e.context(format!("H2D of rank {r}")))?;
    Ok(s.map(|s| (s.bytes, s.ops, t.elapsed())))
}

/// The H2D copies of [`write_to_device`] on the calling thread (blocking: the blocking pool).
fn h2d_now(
    staging: &Staging,
    kv: &KvBuffers,
    layers: Option<&std::ops::Range<u32>>,
) -> Result<(u64, u64, Duration)> {
    {
        let t = Instant::now();
        let (mut bytes, mut ops) = (0, 0);
        for r in staging.ranks().collect::<Vec<_>>() {
            let Some(bufs) = kv.get(r) else { continue };
            let s = match layers {
                None => staging
                    .drain_to_device(kv.caps(), r, bufs)
                    .map_err(|e| e.context(format!("H2D of rank {r}")))?,
                Some(range) => staging
                    .drain_layers_to_device(kv.caps(), r, bufs, range.clone())
                    .map_err(|e| e.context(format!("H2D of layers {range:?} of rank {r}")))?,
            };
            bytes += s.bytes;
            ops += s.ops;
        }
        Ok((bytes, ops, t.elapsed()))
    }
}

/// Waits for a receiving transfer, then writes its staging into the device buffers (H2D, on
/// the blocking pool) unless it was cancelled first.
async fn receive(
    job: &Job,
    t: &Transfer,
    staging: Arc<Staging>,
    kv: KvBuffers,
    mut report: Report,
    t0: Instant,
) -> Result<Report> {
    let s = t.wait().await?;
    report.add_net(&s);
    check_cancelled(job, "its bytes were")?;
    (report.device_bytes, report.device_ops, report.device_time) =
        write_to_device(staging, kv, None).await?;
    report.elapsed = t0.elapsed();
    job.written.send_replace(job.num_layers);
    Ok(report)
}

/// [`receive`] layer by layer: writes each layer's staging into the device buffers (H2D) as
/// soon as the transfer has it complete and verified on every pair, and counts it in the job's
/// `written`.
async fn receive_layers(
    job: &Job,
    t: &Transfer,
    staging: Arc<Staging>,
    kv: KvBuffers,
    mut report: Report,
    t0: Instant,
) -> Result<Report> {
    let n = job.num_layers;
    let mut done = 0u32;
    let (mut bytes, mut ops, mut time) = (0u64, 0u64, Duration::ZERO);
    while done < n {
        t.wait_layers(done + 1).await?;
        let avail = match t.poll() {
            Some(Ok(_)) => n,
            Some(Err(e)) => return Err(e),
            None => t.layers_complete().min(n),
        };
        if avail <= done {
            // Woken without progress (the transfer's plan arrived): wait again.
            continue;
        }
        check_cancelled(job, &format!("layer {done} was"))?;
        let dev = write_to_device(staging.clone(), kv.clone(), Some(done..avail)).await?;
        bytes += dev.0;
        ops += dev.1;
        time += dev.2;
        done = avail;
        job.written.send_replace(done);
    }
    let s = t.wait().await?;
    report.add_net(&s);
    report.device_bytes = bytes;
    report.device_ops = ops;
    report.device_time = time;
    report.elapsed = t0.elapsed();
    Ok(report)
}

/// Releases `request_id` at every producer endpoint in `addrs` (distinct), all at once (one
/// round trip for the request, not one per producer), saying whether it was `delivered` (only
/// a delivering release counts toward the producer's expected releases). Failures are logged
/// (the producers' leases end them).
async fn release_all(ep: &Endpoint, addrs: &[String], request_id: u64, delivered: bool, pull: u64) {
    let each = addrs.iter().map(|a| async move {
        if let Err(e) = ep.release_pull(a, request_id, delivered, pull).await {
            log::debug!("release (delivered: {delivered}) of request {request_id} at {a}: {e}");
        }
    });
    futures_util::future::join_all(each).await;
}

/// How long [`Pipeline::shutdown`] waits at least for the delivering releases of completed
/// pulls still on their way (each is one small control round trip; an unreachable producer
/// frees the request at its lease expiry instead).
pub const RELEASE_FLUSH: Duration = Duration::from_secs(2);

/// The delivering releases sent after their pulls completed and not yet answered
/// ([`Pipeline::pull`]), so that [`Pipeline::shutdown`] can wait for them.
#[derive(Default)]
struct PendingReleases {
    count: AtomicU64,
    idle: tokio::sync::Notify,
}

/// One pending release; dropping it ends it.
struct PendingRelease(Arc<PendingReleases>);

impl PendingReleases {
    fn start(self: &Arc<Self>) -> PendingRelease {
        self.count.fetch_add(1, Ordering::SeqCst);
        PendingRelease(self.clone())
    }

    /// Waits until no release is pending or `deadline` passed; returns how many still are.
    async fn idle_by(&self, deadline: tokio::time::Instant) -> u64 {
        loop {
            let idle = self.idle.notified();
            tokio::pin!(idle);
            // Registered before the check, so a release ending in between is not missed.
            idle.as_mut().enable();
            let n = self.count.load(Ordering::SeqCst);
            if n == 0 || tokio::time::timeout_at(deadline, idle).await.is_err() {
                return self.count.load(Ordering::SeqCst);
            }
        }
    }
}

impl Drop for PendingRelease {
    fn drop(&mut self) {
        if self.0.count.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.0.idle.notify_waiters();
        }
    }
}

async fn reject_at(ep: &Endpoint, addr: &str, request_id: u64, reason: &str) -> Result<()> {
    ep.reject(addr, request_id, reason).await
}

#[cfg(test)]
#[allow(clippy::single_range_in_vec_init)] // lists of groups of layers
mod push_groups_tests {
    use super::*;

    #[test]
    fn push_layer_groups_split_large_multi_layer_pushes() {
        let big = PUSH_PIPELINE_MIN_BYTES;
        assert_eq!(push_layer_groups(1, 1, big), vec![0..1]);
        assert_eq!(push_layer_groups(32, 32, big - 1), vec![0..32]);
        // Buffers that are not the model's layers (e.g. grouped KV): never split.
        assert_eq!(push_layer_groups(4, 32, big), vec![0..4]);
        let g = push_layer_groups(32, 32, big);
        assert_eq!(g.len(), 8);
        assert_eq!((g[0].clone(), g[7].clone()), (0..4, 28..32));
        let g = push_layer_groups(61, 61, big);
        assert_eq!(g.len(), 8);
        assert_eq!(g.last(), Some(&(56..61)));
        assert!(g.windows(2).all(|w| w[0].end == w[1].start));
        assert_eq!(push_layer_groups(3, 3, big), vec![0..1, 1..2, 2..3]);
    }
}
