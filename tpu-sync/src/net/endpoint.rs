//! [`Endpoint`]: registrations, sessions, peers, lane pools, and the pull/push drivers.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::{mpsc, watch, Semaphore};
use tokio::task::JoinSet;

use super::framed::Framed;
use super::quic::QuicTransport;
use super::stream::{recv_stripe, send_stripe, Progress, Side, SpanCursor};
use super::tcp::TcpTransport;
use super::transport::{Acceptor, Connection, Lane, Transport, TransportKind, TransportTimeouts};
use super::{check_request_id, Counters, EndpointOptions, PeerMap, Signal, Stats};
use crate::error::{Error, ErrorKind, Result};
use crate::plan::{spans_digest, Placement, Plan, Span};
use crate::staging::Staging;
use crate::wire::{self, Control, FrameHeader, FrameKind, LaneRole, Stripe, HEADER_LEN};

/// A very long wait (an idle pooled lane waits for its next request indefinitely; liveness is
/// the control lane's business).
const FOREVER: Duration = Duration::from_secs(365 * 24 * 3600);

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

// ---------------------------------------------------------------------------------------------
// Public registration and transfer types
// ---------------------------------------------------------------------------------------------

/// A request's staged blocks offered for pulling ([`Endpoint::register_source`]).
#[derive(Debug, Clone)]
pub struct SourceRegistration {
    /// Request id, `1..=2^53-1`.
    pub request_id: u64,
    /// Tokens of the request.
    pub num_tokens: u32,
    /// Where the request's blocks are on this side (every rank of the replica that this endpoint
    /// hosts must be staged).
    pub placement: Placement,
    /// The staged blocks. The caller must not write them while registered (except layers not yet
    /// published, see `layers_ready`).
    pub staging: Arc<Staging>,
    /// Layers already in the staging (`None`: all). Later layers are announced with
    /// [`SourceHandle::publish_layers`]; a puller receives layer `l` only after it is published.
    pub layers_ready: Option<u32>,
    /// Number of consumers that must [`Endpoint::release`] it before it is dropped (>= 1; one per
    /// decode process that pulls it).
    pub expected_releases: u32,
}

/// How a source registration ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SourceOutcome {
    /// Every expected consumer released it.
    Released,
    /// No live consumer held a lease for [`EndpointOptions::lease_ttl`].
    Expired,
    /// A consumer holding a lease died (the message names it).
    PeerLost(String),
    /// [`Endpoint::unregister_source`] was called.
    Unregistered,
    /// The endpoint shut down.
    Shutdown,
}

/// The producer's handle of a source registration.
pub struct SourceHandle {
    reg: Arc<SourceReg>,
}

impl SourceHandle {
    /// The request id.
    pub fn request_id(&self) -> u64 {
        self.reg.request_id
    }

    /// Announces that the first `layers` layers are in the staging (monotone; smaller values are
    /// ignored). Pullers blocked on a later layer continue.
    pub fn publish_layers(&self, layers: u32) {
        let n = layers.min(self.reg.num_layers);
        self.reg.layers.send_if_modified(|v| {
            if n > *v {
                *v = n;
                true
            } else {
                false
            }
        });
    }

    /// How the registration ended, if it did.
    pub fn outcome(&self) -> Option<SourceOutcome> {
        lock(&self.reg.st).outcome.clone()
    }

    /// Waits until the registration ends or `timeout` passes ([`Error::Timeout`]). Returns the
    /// outcome; only [`SourceOutcome::Released`] means every consumer finished.
    pub async fn wait(&self, timeout: Duration) -> Result<SourceOutcome> {
        match tokio::time::timeout(timeout, self.reg.done.wait()).await {
            Ok(()) => Ok(self.outcome().unwrap_or(SourceOutcome::Shutdown)),
            Err(_) => Err(Error::Timeout(format!(
                "request {} was not released within {timeout:?}",
                self.reg.request_id
            ))),
        }
    }
}

/// A destination registered for pushes ([`Endpoint::expect_push`]).
#[derive(Debug, Clone)]
pub struct SinkRegistration {
    /// Request id, `1..=2^53-1`.
    pub request_id: u64,
    /// Tokens of the request.
    pub num_tokens: u32,
    /// Where the request's blocks go on this side.
    pub placement: Placement,
    /// Destination staging: must stage [`Plan::dst_ranges`] of every destination rank hosted here.
    pub staging: Arc<Staging>,
    /// Destination ranks hosted by this endpoint (`None`: every rank of `placement`'s replica that
    /// `staging` holds).
    pub dst_ranks: Option<Vec<u32>>,
    /// The senders' placement, if known now (else taken from the first push and then enforced).
    pub src: Option<Placement>,
    /// `Plan::build(src, &placement, num_tokens)` if the caller already has it (only with `src`).
    pub plan: Option<Arc<Plan>>,
}

/// A pull ([`Endpoint::pull`]).
#[derive(Debug, Clone)]
pub struct PullRequest {
    /// Request id.
    pub request_id: u64,
    /// Tokens of the request.
    pub num_tokens: u32,
    /// The source (prefill) placement.
    pub src: Placement,
    /// Which endpoint hosts each source rank.
    pub sources: PeerMap,
    /// This side's placement.
    pub dst: Placement,
    /// Destination staging (stages [`Plan::dst_ranges`] of each destination rank pulled).
    pub staging: Arc<Staging>,
    /// Destination ranks this call pulls for (`None`: every rank of the replica that `staging`
    /// holds). A rank with no bytes completes at once.
    pub dst_ranks: Option<Vec<u32>>,
    /// `Plan::build(&src, &dst, num_tokens)` if the caller already has it (`None`: planned here).
    /// A plan that differs from the sender's fails with [`Error::Mismatch`] (digest check).
    pub plan: Option<Arc<Plan>>,
}

/// A push ([`Endpoint::push`]).
#[derive(Debug, Clone)]
pub struct PushRequest {
    /// Request id.
    pub request_id: u64,
    /// Tokens of the request.
    pub num_tokens: u32,
    /// This side's (prefill) placement.
    pub src: Placement,
    /// The staged source blocks.
    pub staging: Arc<Staging>,
    /// Source ranks hosted by this endpoint (`None`: every rank of the replica that `staging`
    /// holds). Every one is declared finished to every destination endpoint, also those that
    /// contribute no bytes.
    pub src_ranks: Option<Vec<u32>>,
    /// The destination (decode) placement.
    pub dst: Placement,
    /// Which endpoint hosts each destination rank.
    pub targets: PeerMap,
    /// Layers already staged (`None`: all); announce more with [`Transfer::publish_layers`].
    pub layers_ready: Option<u32>,
    /// `Plan::build(&src, &dst, num_tokens)` if the caller already has it (`None`: planned here).
    /// The receiver plans on its own and refuses a stripe whose digest differs.
    pub plan: Option<Arc<Plan>>,
}

/// What a transfer is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TransferKind {
    /// This endpoint pulls.
    Pull,
    /// This endpoint pushes.
    Push,
    /// This endpoint receives pushes ([`Endpoint::expect_push`]).
    PushReceive,
}

impl TransferKind {
    /// The `direction` label of this kind's metrics: a push sends, a pull or a push reception
    /// receives.
    pub fn metrics_direction(self) -> crate::metrics::NetDirection {
        match self {
            TransferKind::Push => crate::metrics::NetDirection::Send,
            TransferKind::Pull | TransferKind::PushReceive => crate::metrics::NetDirection::Receive,
        }
    }
}

/// What a finished transfer moved.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TransferStats {
    /// Payload bytes moved by this endpoint (received for pulls and push receptions, sent for
    /// pushes).
    pub bytes: u64,
    /// Spans in the plan part handled here.
    pub spans: u64,
    /// `(source rank, destination rank)` pairs handled here.
    pub pairs: u64,
    /// Stripes (lane exchanges) used.
    pub stripes: u64,
    /// Wall time from submission to completion.
    pub elapsed: Duration,
}

pub(crate) struct TransferShared {
    id: u64,
    request_id: u64,
    kind: TransferKind,
    staged_bytes: u64,
    started: Instant,
    result: Mutex<Option<Result<TransferStats>>>,
    done: Signal,
    cancel: Signal,
    progress: Mutex<Option<Arc<Progress>>>,
    /// Fired once `progress` is set (a push reception learns its plan with the first push).
    planned: Signal,
    num_layers: u32,
    gate: Option<watch::Sender<u32>>,
    bytes: AtomicU64,
}

/// A submitted transfer: await it, poll it, watch its layers, or cancel it. `Send + Sync`;
/// dropping the handle does not cancel the transfer.
#[derive(Clone)]
pub struct Transfer {
    shared: Arc<TransferShared>,
    inner: std::sync::Weak<Inner>,
}

impl std::fmt::Debug for Transfer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Transfer")
            .field("id", &self.shared.id)
            .field("request_id", &self.shared.request_id)
            .field("kind", &self.shared.kind)
            .finish()
    }
}

impl Transfer {
    /// Endpoint-unique id of this transfer.
    pub fn id(&self) -> u64 {
        self.shared.id
    }

    /// The request.
    pub fn request_id(&self) -> u64 {
        self.shared.request_id
    }

    /// Pull, push or push reception.
    pub fn kind(&self) -> TransferKind {
        self.shared.kind
    }

    /// The result if finished: `Ok` only when every byte arrived and verified.
    pub fn poll(&self) -> Option<Result<TransferStats>> {
        lock(&self.shared.result).as_ref().map(|r| match r {
            Ok(s) => Ok(s.clone()),
            Err(e) => Err(e.clone()),
        })
    }

    /// Waits for the result.
    pub async fn wait(&self) -> Result<TransferStats> {
        self.shared.done.wait().await;
        self.poll()
            .unwrap_or_else(|| Err(Error::Cancelled("transfer vanished".into())))
    }

    /// Waits at most `timeout`; [`Error::Timeout`] leaves the transfer running.
    pub async fn wait_timeout(&self, timeout: Duration) -> Result<TransferStats> {
        match tokio::time::timeout(timeout, self.wait()).await {
            Ok(r) => r,
            Err(_) => Err(Error::Timeout(format!(
                "transfer of request {} not finished within {timeout:?}",
                self.shared.request_id
            ))),
        }
    }

    /// Cancels the transfer: it fails with [`Error::Cancelled`], its lanes are closed and its
    /// peers are told to stop. No effect on a finished transfer.
    pub fn cancel(&self) {
        if let Some(inner) = self.inner.upgrade() {
            inner.finish(
                &self.shared,
                Err(Error::Cancelled(format!(
                    "request {} cancelled by the caller",
                    self.shared.request_id
                ))),
            );
            inner.send_cancel(
                self.shared.request_id,
                self.shared.kind == TransferKind::Push,
            );
        }
        self.shared.cancel.fire("cancelled");
    }

    /// Leading layers received and verified on every pair so far (receiving transfers).
    pub fn layers_complete(&self) -> u32 {
        match lock(&self.shared.progress).as_ref() {
            Some(p) => p.layers_complete(),
            None => 0,
        }
    }

    /// Waits until the first `layers` layers are complete (or the transfer fails: its error).
    pub async fn wait_layers(&self, layers: u32) -> Result<()> {
        let layers = layers.min(self.shared.num_layers);
        loop {
            let rx = lock(&self.shared.progress).as_ref().map(|p| p.subscribe());
            match rx {
                Some(mut rx) => {
                    tokio::select! {
                        r = rx.wait_for(|&v| v >= layers) => {
                            if r.is_ok() { return Ok(()); }
                        }
                        _ = self.shared.done.wait() => {}
                    }
                    if let Some(Err(e)) = self.poll() {
                        return Err(e);
                    }
                    if self.layers_complete() >= layers {
                        return Ok(());
                    }
                    if self.shared.done.is_set() {
                        return Ok(());
                    }
                }
                None => {
                    // A push reception learns its plan with the first push.
                    tokio::select! {
                        _ = self.shared.done.wait() => {
                            return self.wait().await.map(|_| ());
                        }
                        _ = self.shared.planned.wait() => {}
                    }
                }
            }
        }
    }

    /// Push senders: announces that the first `layers` layers are staged.
    pub fn publish_layers(&self, layers: u32) {
        if let Some(g) = &self.shared.gate {
            let n = layers.min(self.shared.num_layers);
            g.send_if_modified(|v| {
                if n > *v {
                    *v = n;
                    true
                } else {
                    false
                }
            });
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Internal state
// ---------------------------------------------------------------------------------------------

type SessionKey = (String, u64);

struct SourceReg {
    request_id: u64,
    num_tokens: u32,
    num_layers: u32,
    placement: Placement,
    staging: Arc<Staging>,
    layers: watch::Sender<u32>,
    expected_releases: u32,
    st: Mutex<SourceState>,
    done: Signal,
    /// The last plan built for a puller's placement: every stripe of every pair of one pull uses
    /// the same plan, so it is built once per puller, not once per stripe.
    plans: Mutex<Option<(Placement, Arc<Plan>)>>,
}

impl SourceReg {
    fn plan_for(&self, dst: &Placement) -> Result<Arc<Plan>> {
        if let Some((p, plan)) = lock(&self.plans).as_ref() {
            if p == dst {
                return Ok(plan.clone());
            }
        }
        let plan = Arc::new(Plan::build(&self.placement, dst, self.num_tokens)?);
        *lock(&self.plans) = Some((dst.clone(), plan.clone()));
        Ok(plan)
    }
}

struct SourceState {
    releases: u32,
    holders: HashSet<SessionKey>,
    deadline: Instant,
    outcome: Option<SourceOutcome>,
}

struct PairSlot {
    idx: usize,
    cursor: Arc<SpanCursor>,
    digest: u64,
    count: u32,
    chunk: u64,
    started: Vec<bool>,
    done: Vec<bool>,
}

impl PairSlot {
    fn complete(&self) -> bool {
        self.count > 0 && self.done.iter().all(|&d| d)
    }
}

struct SinkReg {
    request_id: u64,
    num_tokens: u32,
    dst: Placement,
    staging: Arc<Staging>,
    dst_ranks: BTreeSet<u32>,
    transfer: Arc<TransferShared>,
    st: Mutex<SinkState>,
}

struct SinkState {
    src: Option<Placement>,
    slots: BTreeMap<(u32, u32), PairSlot>,
    progress: Option<Arc<Progress>>,
    finished_ranks: BTreeSet<u32>,
    senders: HashMap<u32, SessionKey>,
    stripes: u64,
    /// Stripes being received now.
    active: u32,
    /// Registration, or the last stripe start or end or `PushFinish`.
    last_activity: Instant,
}

/// Counts a stripe being received into a sink; on drop (every way out) it is done.
struct ActiveStripe(Arc<SinkReg>);

impl Drop for ActiveStripe {
    fn drop(&mut self) {
        let mut st = lock(&self.0.st);
        st.active = st.active.saturating_sub(1);
        st.last_activity = Instant::now();
    }
}

struct Session {
    key: SessionKey,
    last_seen: Mutex<Instant>,
    dead: Signal,
    leases: Mutex<HashSet<u64>>,
    pushing: Mutex<HashSet<u64>>,
}

impl Session {
    fn touch(&self) {
        *lock(&self.last_seen) = Instant::now();
    }
}

struct Peer {
    addr: SocketAddr,
    conn: Arc<dyn Connection>,
    idle: Mutex<Vec<CountedLane>>,
    permits: Arc<Semaphore>,
    dead: Signal,
    ctl: mpsc::UnboundedSender<Control>,
}

/// Counts an open lane for [`Stats::lanes_open`].
struct LaneCount(Arc<Counters>);

impl LaneCount {
    fn new(c: &Arc<Counters>) -> LaneCount {
        c.lanes_open.fetch_add(1, Ordering::Relaxed);
        c.lanes_opened.fetch_add(1, Ordering::Relaxed);
        LaneCount(c.clone())
    }
}

impl Drop for LaneCount {
    fn drop(&mut self) {
        self.0.lanes_open.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A framed lane plus its open-lane count.
struct CountedLane {
    f: Framed,
    _count: LaneCount,
}

pub(crate) struct Inner {
    /// One permit per inbound lane being served ([`EndpointOptions::max_inbound_lanes`]).
    inbound: Arc<Semaphore>,
    opts: EndpointOptions,
    transport: Arc<dyn Transport>,
    incarnation: u64,
    counters: Arc<Counters>,
    acceptor: Mutex<Option<Arc<dyn Acceptor>>>,
    local_addr: Option<SocketAddr>,
    sources: Mutex<HashMap<u64, Arc<SourceReg>>>,
    sinks: Mutex<HashMap<u64, Arc<SinkReg>>>,
    sessions: Mutex<HashMap<SessionKey, Arc<Session>>>,
    peers: Mutex<HashMap<SocketAddr, Arc<Peer>>>,
    connecting: Mutex<HashMap<SocketAddr, Arc<tokio::sync::Mutex<()>>>>,
    names: Mutex<HashMap<String, SocketAddr>>,
    transfers: Mutex<HashMap<u64, Arc<TransferShared>>>,
    next_transfer: AtomicU64,
    tasks: Mutex<JoinSet<()>>,
    shutdown: Signal,
    handshake_failures_seen: AtomicU64,
}

/// One process's network endpoint: listener (optional) + client side. See the [module
/// docs](super). `Send + Sync`; share it in an `Arc`. Dropping it aborts everything at once
/// (like a crash: peers see the connections close); [`Endpoint::shutdown`] ends it in order.
pub struct Endpoint {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Endpoint")
            .field("name", &self.inner.opts.name)
            .field("transport", &self.inner.transport.kind())
            .field("local_addr", &self.inner.local_addr)
            .finish()
    }
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        self.inner.abort_all("endpoint dropped");
    }
}

fn random_u64() -> u64 {
    let mut b = [0u8; 8];
    if ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut b).is_err() {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0);
        return crate::pattern::mix64(t ^ std::process::id() as u64);
    }
    u64::from_le_bytes(b) | 1
}

/// Builds the transport an [`EndpointOptions`] asks for.
pub(crate) fn make_transport(o: &EndpointOptions) -> Result<Arc<dyn Transport>> {
    let t = TransportTimeouts {
        connect: o.connect_timeout,
        handshake: o.handshake_timeout,
    };
    Ok(match o.transport {
        TransportKind::Tcp => {
            if o.security.is_authenticated() {
                return Err(Error::InvalidArgument(
                    "plain TCP cannot authenticate peers: use the tls or quic transport with \
                     credentials"
                        .into(),
                ));
            }
            Arc::new(TcpTransport::plain(t))
        }
        TransportKind::Tls => Arc::new(TcpTransport::tls(o.security.clone(), t)?),
        TransportKind::Quic => Arc::new(QuicTransport::new(o.security.clone(), t)?),
    })
}

impl Endpoint {
    /// Creates an endpoint and starts listening if `opts.listen` is set. Must be called inside a
    /// tokio runtime (multi-threaded recommended).
    ///
    /// Errors: [`Error::InvalidArgument`] for inconsistent options (TLS/QUIC without credentials,
    /// credentials with plain TCP, zero sizes), [`Error::Io`] when the address cannot be bound.
    pub async fn bind(opts: EndpointOptions) -> Result<Endpoint> {
        let transport = make_transport(&opts)?;
        Endpoint::with_transport(opts, transport).await
    }

    /// Like [`Endpoint::bind`] with a caller-provided transport (e.g. a fault-injecting
    /// decorator around one of the built-in transports).
    pub async fn with_transport(
        opts: EndpointOptions,
        transport: Arc<dyn Transport>,
    ) -> Result<Endpoint> {
        if opts.chunk_bytes == 0 || opts.chunk_bytes > wire::MAX_DATA_PAYLOAD as u64 {
            return Err(Error::InvalidArgument(format!(
                "chunk_bytes {} outside 1..={}",
                opts.chunk_bytes,
                wire::MAX_DATA_PAYLOAD
            )));
        }
        if opts.streams_per_pair == 0 || opts.max_lanes_per_peer == 0 || opts.max_inbound_lanes == 0
        {
            return Err(Error::InvalidArgument(
                "streams_per_pair, max_lanes_per_peer and max_inbound_lanes must be >= 1".into(),
            ));
        }
        if opts.streams_per_pair > wire::MAX_STRIPES {
            return Err(Error::InvalidArgument(format!(
                "streams_per_pair {} exceeds {}",
                opts.streams_per_pair,
                wire::MAX_STRIPES
            )));
        }
        if opts.heartbeat_interval.is_zero() || opts.heartbeat_timeout <= opts.heartbeat_interval {
            return Err(Error::InvalidArgument(
                "heartbeat_timeout must exceed a non-zero heartbeat_interval".into(),
            ));
        }
        let acceptor = match opts.listen {
            Some(a) => Some(transport.listen(a).await?),
            None => None,
        };
        let local_addr = acceptor.as_ref().map(|a| a.local_addr());
        let inbound = Arc::new(Semaphore::new(opts.max_inbound_lanes as usize));
        let counters = Arc::new(Counters::for_transport(transport.kind()));
        let inner = Arc::new(Inner {
            inbound,
            opts,
            transport,
            incarnation: random_u64() & super::MAX_REQUEST_ID,
            counters,
            acceptor: Mutex::new(acceptor.clone()),
            local_addr,
            sources: Mutex::new(HashMap::new()),
            sinks: Mutex::new(HashMap::new()),
            sessions: Mutex::new(HashMap::new()),
            peers: Mutex::new(HashMap::new()),
            connecting: Mutex::new(HashMap::new()),
            names: Mutex::new(HashMap::new()),
            transfers: Mutex::new(HashMap::new()),
            next_transfer: AtomicU64::new(1),
            tasks: Mutex::new(JoinSet::new()),
            shutdown: Signal::default(),
            handshake_failures_seen: AtomicU64::new(0),
        });
        if let Some(acc) = acceptor {
            let me = inner.clone();
            inner.spawn(async move { me.accept_loop(acc).await });
        }
        let me = inner.clone();
        inner.spawn(async move { me.housekeeping().await });
        let weak: std::sync::Weak<dyn crate::metrics::Source> = Arc::downgrade(&inner) as _;
        crate::metrics::register_source(weak);
        Ok(Endpoint { inner })
    }

    /// The listening address (`None` for a client-only endpoint).
    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.inner.local_addr
    }

    /// The endpoint's name.
    pub fn name(&self) -> &str {
        &self.inner.opts.name
    }

    /// The transport in use.
    pub fn transport_kind(&self) -> TransportKind {
        self.inner.transport.kind()
    }

    /// Gives `name` the address `addr` (`host:port`). Transfers may then name the peer instead of
    /// an address. Re-adding a name with a new address (a restarted peer) drops the connection to
    /// the old address; the next transfer connects to the new one.
    pub async fn add_peer(&self, name: &str, addr: &str) -> Result<()> {
        let a = resolve_addr(addr).await?;
        let old = lock(&self.inner.names).insert(name.to_string(), a);
        if let Some(old) = old.filter(|o| *o != a) {
            let p = lock(&self.inner.peers).remove(&old);
            if let Some(p) = p {
                self.inner
                    .peer_died(&p, format!("peer {name} moved from {old} to {a}"), false);
            }
        }
        Ok(())
    }

    /// Counters and gauges.
    pub fn stats(&self) -> Stats {
        self.inner.stats()
    }

    /// Registers a request's staged blocks for pulling.
    ///
    /// Errors: [`Error::InvalidArgument`] for a bad id, an id already registered, or
    /// `expected_releases == 0`; the placement's validation errors; [`Error::BlockRange`] when a
    /// block of a rank present in `staging` is not staged.
    pub fn register_source(&self, reg: SourceRegistration) -> Result<SourceHandle> {
        check_request_id(reg.request_id)?;
        if reg.expected_releases == 0 {
            return Err(Error::InvalidArgument(
                "expected_releases must be >= 1".into(),
            ));
        }
        reg.placement.validate(reg.num_tokens)?;
        let mut any = false;
        for local in 0..reg.placement.layout.spec.ranks_per_replica() {
            let rank = reg.placement.global_rank(local);
            if reg.staging.ranges(rank).is_empty() {
                continue;
            }
            any = true;
            for r in reg.placement.block_ranges(local) {
                reg.staging.resolve(rank, r.buffer, r.offset, r.len)?;
            }
        }
        if !any {
            return Err(Error::BlockRange(format!(
                "request {}: the staging holds no rank of the placement's replica",
                reg.request_id
            )));
        }
        let num_layers = reg.placement.layout.model.num_layers;
        let ready = reg.layers_ready.unwrap_or(num_layers).min(num_layers);
        let (tx, _) = watch::channel(ready);
        let sr = Arc::new(SourceReg {
            request_id: reg.request_id,
            num_tokens: reg.num_tokens,
            num_layers,
            placement: reg.placement,
            staging: reg.staging,
            layers: tx,
            expected_releases: reg.expected_releases,
            st: Mutex::new(SourceState {
                releases: 0,
                holders: HashSet::new(),
                deadline: Instant::now() + self.inner.opts.lease_ttl,
                outcome: None,
            }),
            done: Signal::default(),
            plans: Mutex::new(None),
        });
        let mut m = lock(&self.inner.sources);
        if m.contains_key(&reg.request_id) {
            return Err(Error::InvalidArgument(format!(
                "request {} is already registered",
                reg.request_id
            )));
        }
        m.insert(reg.request_id, sr.clone());
        Ok(SourceHandle { reg: sr })
    }

    /// Withdraws a source registration (pulls in progress fail). Returns whether it existed.
    pub fn unregister_source(&self, request_id: u64) -> bool {
        self.inner
            .end_source(request_id, SourceOutcome::Unregistered)
    }

    /// Registers destination staging for pushes of a request. The returned transfer completes
    /// when every source rank of the senders' replica has declared itself finished and every
    /// planned pair for the destination ranks hosted here arrived and verified. It fails with
    /// [`Error::Timeout`] when no stripe is being received and nothing happened (registration,
    /// a stripe starting or ending, a sender declaring itself finished) for
    /// [`super::EndpointOptions::lease_ttl`]: a sender that never comes, or dies before its
    /// first stripe reaches this endpoint, does not keep the registration forever.
    ///
    /// Errors: as [`Endpoint::register_source`]; plan errors when `src` is given.
    pub fn expect_push(&self, reg: SinkRegistration) -> Result<Transfer> {
        check_request_id(reg.request_id)?;
        reg.placement.validate(reg.num_tokens)?;
        let dst_ranks: BTreeSet<u32> = match &reg.dst_ranks {
            Some(v) => v.iter().copied().collect(),
            None => (0..reg.placement.layout.spec.ranks_per_replica())
                .map(|l| reg.placement.global_rank(l))
                .filter(|r| !reg.staging.ranges(*r).is_empty())
                .collect(),
        };
        for r in &dst_ranks {
            if reg.placement.local_rank(*r).is_none() {
                return Err(Error::InvalidArgument(format!(
                    "destination rank {r} is not in the placement's DP replica"
                )));
            }
        }
        let shared = self.inner.new_transfer(
            reg.request_id,
            TransferKind::PushReceive,
            reg.staging.total_bytes(),
            reg.placement.layout.model.num_layers,
            None,
        );
        let sink = Arc::new(SinkReg {
            request_id: reg.request_id,
            num_tokens: reg.num_tokens,
            dst: reg.placement,
            staging: reg.staging,
            dst_ranks,
            transfer: shared.clone(),
            st: Mutex::new(SinkState {
                src: None,
                slots: BTreeMap::new(),
                progress: None,
                finished_ranks: BTreeSet::new(),
                senders: HashMap::new(),
                stripes: 0,
                active: 0,
                last_activity: Instant::now(),
            }),
        });
        if let Some(src) = &reg.src {
            let mut st = lock(&sink.st);
            let r = match &reg.plan {
                Some(p) => given_plan(Some(p), src, &sink.dst, reg.num_tokens)
                    .and_then(|p| sink_plan_with(&sink, &mut st, src, reg.num_tokens, Some(p))),
                None => sink_plan(&sink, &mut st, src, reg.num_tokens),
            };
            if let Err(e) = r {
                drop(st);
                self.inner.finish(&shared, Err(e.clone()));
                return Err(e);
            }
        }
        {
            let mut m = lock(&self.inner.sinks);
            if m.contains_key(&reg.request_id) {
                drop(m);
                self.inner.finish(
                    &shared,
                    Err(Error::InvalidArgument("duplicate registration".into())),
                );
                return Err(Error::InvalidArgument(format!(
                    "request {} already expects a push",
                    reg.request_id
                )));
            }
            m.insert(reg.request_id, sink);
        }
        Ok(Transfer {
            shared,
            inner: Arc::downgrade(&self.inner),
        })
    }

    /// Asks the endpoint at `addr` for a source registration's placement and token count (and
    /// takes a lease on it).
    pub async fn describe(&self, addr: &str, request_id: u64) -> Result<(Placement, u32)> {
        self.inner.describe(addr, request_id, false).await
    }

    /// Asks the endpoint at `addr` for a push registration's (destination) placement.
    pub async fn describe_sink(&self, addr: &str, request_id: u64) -> Result<(Placement, u32)> {
        self.inner.describe(addr, request_id, true).await
    }

    /// Tells the endpoint at `addr` that this consumer is done with `request_id` (its lease ends;
    /// the registration is dropped after its expected number of releases).
    pub async fn release(&self, addr: &str, request_id: u64) -> Result<()> {
        let span = tracing::info_span!("release", request_id);
        tracing::Instrument::instrument(self.release_inner(addr, request_id), span).await
    }

    async fn release_inner(&self, addr: &str, request_id: u64) -> Result<()> {
        let inner = &self.inner;
        let peer = inner.peer(addr).await?;
        let mut lane = inner.checkout(&peer).await?;
        lane.f
            .send(&Control::Release { request_id }, request_id)
            .await?;
        match lane.f.recv(inner.opts.io_timeout).await? {
            (_, Control::Released { .. }) => {
                inner.give_back(&peer, lane);
                Ok(())
            }
            (_, Control::Failed { message, .. }) => {
                inner.give_back(&peer, lane);
                Err(Error::Remote(message))
            }
            (_, m) => Err(Error::Protocol(format!("expected released, got {m:?}"))),
        }
    }

    /// Starts pulling a request. Validation (plan, staging coverage, peer map) happens before
    /// this returns; network errors surface through the returned [`Transfer`].
    pub fn pull(&self, req: PullRequest) -> Result<Transfer> {
        check_request_id(req.request_id)?;
        let span = tracing::info_span!(
            "transfer",
            request_id = req.request_id,
            kind = "pull",
            transport = self.inner.transport.kind().name()
        );
        let plan = span.in_scope(|| {
            tracing::info_span!("plan")
                .in_scope(|| given_plan(req.plan.as_ref(), &req.src, &req.dst, req.num_tokens))
        })?;
        let dst_ranks: BTreeSet<u32> = match &req.dst_ranks {
            Some(v) => v.iter().copied().collect(),
            None => (0..req.dst.layout.spec.ranks_per_replica())
                .map(|l| req.dst.global_rank(l))
                .filter(|r| !req.staging.ranges(*r).is_empty())
                .collect(),
        };
        let num_layers = req.dst.layout.model.num_layers;
        let mut pairs = Vec::new();
        for (s, d) in plan.pairs() {
            if !dst_ranks.contains(&d) {
                continue;
            }
            let cursor = Arc::new(SpanCursor::new(plan.pair_spans(s, d), num_layers));
            cursor.check_staged(&req.staging, d, Side::Dst)?;
            req.sources.get(s)?;
            pairs.push((s, d, cursor));
        }
        let shared = self.inner.new_transfer(
            req.request_id,
            TransferKind::Pull,
            req.staging.total_bytes(),
            num_layers,
            None,
        );
        let cursors: Vec<_> = pairs.iter().map(|p| p.2.clone()).collect();
        let progress = Arc::new(Progress::new(&cursors, num_layers));
        *lock(&shared.progress) = Some(progress.clone());
        shared.planned.fire("planned");
        let inner = self.inner.clone();
        let sh = shared.clone();
        self.inner.spawn(tracing::Instrument::instrument(
            async move {
                let r = inner.drive_pull(&sh, req, pairs, progress).await;
                inner.finish(&sh, r);
            },
            span,
        ));
        Ok(Transfer {
            shared,
            inner: Arc::downgrade(&self.inner),
        })
    }

    /// Starts pushing a request to the endpoints hosting the destination ranks.
    pub fn push(&self, req: PushRequest) -> Result<Transfer> {
        check_request_id(req.request_id)?;
        let span = tracing::info_span!(
            "transfer",
            request_id = req.request_id,
            kind = "push",
            transport = self.inner.transport.kind().name()
        );
        let plan = span.in_scope(|| {
            tracing::info_span!("plan")
                .in_scope(|| given_plan(req.plan.as_ref(), &req.src, &req.dst, req.num_tokens))
        })?;
        let src_ranks: Vec<u32> = match &req.src_ranks {
            Some(v) => v.clone(),
            None => (0..req.src.layout.spec.ranks_per_replica())
                .map(|l| req.src.global_rank(l))
                .filter(|r| !req.staging.ranges(*r).is_empty())
                .collect(),
        };
        if src_ranks.is_empty() {
            return Err(Error::InvalidArgument(
                "the push hosts no source rank of the placement".into(),
            ));
        }
        for r in &src_ranks {
            if req.src.local_rank(*r).is_none() {
                return Err(Error::InvalidArgument(format!(
                    "source rank {r} is not in the placement's DP replica"
                )));
            }
        }
        let num_layers = req.src.layout.model.num_layers;
        let mut pairs = Vec::new();
        for (s, d) in plan.pairs() {
            if !src_ranks.contains(&s) {
                continue;
            }
            let cursor = Arc::new(SpanCursor::new(plan.pair_spans(s, d), num_layers));
            cursor.check_staged(&req.staging, s, Side::Src)?;
            req.targets.get(d)?;
            pairs.push((s, d, cursor));
        }
        let all_dst: Vec<u32> = (0..req.dst.layout.spec.ranks_per_replica())
            .map(|l| req.dst.global_rank(l))
            .collect();
        let targets = req.targets.addresses(all_dst)?;
        let ready = req.layers_ready.unwrap_or(num_layers).min(num_layers);
        let gate = (ready < num_layers).then(|| watch::channel(ready).0);
        let shared = self.inner.new_transfer(
            req.request_id,
            TransferKind::Push,
            req.staging.total_bytes(),
            num_layers,
            gate,
        );
        let inner = self.inner.clone();
        let sh = shared.clone();
        self.inner.spawn(tracing::Instrument::instrument(
            async move {
                let r = inner.drive_push(&sh, req, src_ranks, pairs, targets).await;
                let failed = r.is_err();
                inner.finish(&sh, r);
                if failed {
                    // The receivers' registrations would otherwise wait for a `PushFinish` that never
                    // comes: tell them the push is over.
                    inner.send_cancel(sh.request_id, true);
                }
            },
            span,
        ));
        Ok(Transfer {
            shared,
            inner: Arc::downgrade(&self.inner),
        })
    }

    /// Stops accepting, waits up to `drain` for in-flight transfers to finish (`None`: no wait),
    /// then cancels what is left, ends every registration ([`SourceOutcome::Shutdown`]) and
    /// closes every connection.
    pub async fn shutdown(&self, drain: Option<Duration>) {
        lock(&self.inner.acceptor).take();
        if let Some(d) = drain {
            let deadline = tokio::time::Instant::now() + d;
            loop {
                let pending: Vec<_> = lock(&self.inner.transfers).values().cloned().collect();
                let Some(t) = pending.first() else { break };
                if tokio::time::timeout_at(deadline, t.done.wait())
                    .await
                    .is_err()
                {
                    break;
                }
            }
        }
        self.inner.abort_all("endpoint shut down");
    }
}

async fn resolve_addr(addr: &str) -> Result<SocketAddr> {
    if let Ok(a) = addr.parse::<SocketAddr>() {
        return Ok(a);
    }
    let mut it = tokio::net::lookup_host(addr)
        .await
        .map_err(|e| Error::io(format!("resolve {addr}"), e))?;
    it.next()
        .ok_or_else(|| Error::InvalidArgument(format!("{addr} resolves to no address")))
}

/// A caller-supplied plan (checked for the obvious) or a new one.
fn given_plan(
    plan: Option<&Arc<Plan>>,
    src: &Placement,
    dst: &Placement,
    num_tokens: u32,
) -> Result<Arc<Plan>> {
    match plan {
        Some(p) => {
            src.validate(num_tokens)?;
            dst.validate(num_tokens)?;
            if p.num_tokens != num_tokens {
                return Err(Error::Mismatch(format!(
                    "the given plan is for {} tokens, the request has {num_tokens}",
                    p.num_tokens
                )));
            }
            Ok(p.clone())
        }
        None => Ok(Arc::new(Plan::build(src, dst, num_tokens)?)),
    }
}

/// Plans a sink from the senders' placement (first push or the registration).
fn sink_plan(sink: &SinkReg, st: &mut SinkState, src: &Placement, num_tokens: u32) -> Result<()> {
    sink_plan_with(sink, st, src, num_tokens, None)
}

fn sink_plan_with(
    sink: &SinkReg,
    st: &mut SinkState,
    src: &Placement,
    num_tokens: u32,
    given: Option<Arc<Plan>>,
) -> Result<()> {
    if num_tokens != sink.num_tokens {
        return Err(Error::Mismatch(format!(
            "request {}: sender has {num_tokens} tokens, receiver {}",
            sink.request_id, sink.num_tokens
        )));
    }
    if let Some(known) = &st.src {
        if known != src {
            return Err(Error::Mismatch(format!(
                "request {}: a sender's placement differs from the one already in use",
                sink.request_id
            )));
        }
        return Ok(());
    }
    let plan = match given {
        Some(p) => p,
        None => Arc::new(Plan::build(src, &sink.dst, num_tokens)?),
    };
    let num_layers = sink.dst.layout.model.num_layers;
    let mut slots = BTreeMap::new();
    let mut cursors = Vec::new();
    for (s, d) in plan.pairs() {
        if !sink.dst_ranks.contains(&d) {
            continue;
        }
        let spans = plan.pair_spans(s, d);
        let digest = spans_digest(&spans);
        let cursor = Arc::new(SpanCursor::new(spans, num_layers));
        cursor.check_staged(&sink.staging, d, Side::Dst)?;
        cursors.push(cursor.clone());
        slots.insert(
            (s, d),
            PairSlot {
                idx: cursors.len() - 1,
                cursor,
                digest,
                count: 0,
                chunk: 0,
                started: Vec::new(),
                done: Vec::new(),
            },
        );
    }
    let progress = Arc::new(Progress::new(&cursors, num_layers));
    *lock(&sink.transfer.progress) = Some(progress.clone());
    sink.transfer.planned.fire("planned");
    st.progress = Some(progress);
    st.slots = slots;
    st.src = Some(src.clone());
    Ok(())
}

/// Joins a transfer's stripe tasks. A failure that leaves its lane in sync (a checksum mismatch,
/// an error answered by the peer) lets the other stripes finish, so their lanes stay reusable;
/// any other failure aborts them at once.
async fn join_stripes(set: &mut JoinSet<Result<u64>>) -> Result<u64> {
    let mut bytes = 0;
    let mut first: Option<Error> = None;
    while let Some(r) = set.join_next().await {
        match r {
            Ok(Ok(n)) => bytes += n,
            Ok(Err(e)) => {
                let soft = matches!(
                    e.kind(),
                    ErrorKind::Checksum
                        | ErrorKind::Remote
                        | ErrorKind::Mismatch
                        | ErrorKind::UnknownRequest
                );
                if !soft {
                    set.abort_all();
                    return Err(e);
                }
                // The most telling error wins: a corrupt chunk over its consequences (a
                // receiver that already dropped the failed request).
                let telling = e.kind() == ErrorKind::Checksum;
                match &first {
                    Some(f) if !telling || f.kind() == ErrorKind::Checksum => {}
                    _ => first = Some(e),
                }
            }
            Err(e) => {
                set.abort_all();
                return Err(Error::Cancelled(format!("transfer task ended: {e}")));
            }
        }
    }
    match first {
        Some(e) => Err(e),
        None => Ok(bytes),
    }
}

fn stripes_for(total: u64, chunk: u64, max: u32) -> u32 {
    (total.div_ceil(chunk.max(1)).max(1)).min(max as u64) as u32
}

// ---------------------------------------------------------------------------------------------
// Inner: bookkeeping
// ---------------------------------------------------------------------------------------------

impl crate::metrics::Source for Inner {
    fn sample(&self, s: &mut crate::metrics::Sample) {
        let st = self.stats();
        s.peers += st.peers + st.sessions;
        s.transfers_in_flight += st.transfers_in_flight;
        s.leases += st.leases;
        s.staged_bytes += st.staged_bytes;
    }
}

impl Inner {
    fn spawn<F>(&self, fut: F)
    where
        F: std::future::Future<Output = ()> + Send + 'static,
    {
        let mut t = lock(&self.tasks);
        while t.try_join_next().is_some() {}
        if self.shutdown.is_set() {
            return;
        }
        t.spawn(fut);
    }

    fn stats(&self) -> Stats {
        let c = &self.counters;
        let sources = lock(&self.sources);
        let leases = sources
            .values()
            .map(|r| lock(&r.st).holders.len() as u64)
            .sum();
        let mut staged: u64 = sources.values().map(|r| r.staging.total_bytes()).sum();
        let nsources = sources.len() as u64;
        drop(sources);
        let transfers = lock(&self.transfers);
        staged += transfers.values().map(|t| t.staged_bytes).sum::<u64>();
        let in_flight = transfers.len() as u64;
        drop(transfers);
        let hs = lock(&self.acceptor)
            .as_ref()
            .map(|a| a.handshake_failures())
            .unwrap_or(0)
            .max(self.handshake_failures_seen.load(Ordering::Relaxed));
        self.handshake_failures_seen.store(hs, Ordering::Relaxed);
        Stats {
            peers: lock(&self.peers).len() as u64,
            sessions: lock(&self.sessions).len() as u64,
            lanes_open: c.lanes_open.load(Ordering::Relaxed),
            lanes_opened: c.lanes_opened.load(Ordering::Relaxed),
            source_registrations: nsources,
            sink_registrations: lock(&self.sinks).len() as u64,
            leases,
            staged_bytes: staged,
            transfers_in_flight: in_flight,
            bytes_sent: c.bytes_sent.load(Ordering::Relaxed),
            bytes_received: c.bytes_received.load(Ordering::Relaxed),
            transfers_completed: c.transfers_completed.load(Ordering::Relaxed),
            transfers_failed: c.transfers_failed.load(Ordering::Relaxed),
            checksum_failures: c.checksum_failures.load(Ordering::Relaxed),
            peers_lost: c.peers_lost.load(Ordering::Relaxed),
            handshake_failures: hs,
            lanes_refused: c.lanes_refused.load(Ordering::Relaxed),
        }
    }

    fn new_transfer(
        &self,
        request_id: u64,
        kind: TransferKind,
        staged_bytes: u64,
        num_layers: u32,
        gate: Option<watch::Sender<u32>>,
    ) -> Arc<TransferShared> {
        let id = self.next_transfer.fetch_add(1, Ordering::Relaxed);
        let t = Arc::new(TransferShared {
            id,
            request_id,
            kind,
            staged_bytes,
            started: Instant::now(),
            result: Mutex::new(None),
            done: Signal::default(),
            cancel: Signal::default(),
            progress: Mutex::new(None),
            planned: Signal::default(),
            num_layers,
            gate,
            bytes: AtomicU64::new(0),
        });
        lock(&self.transfers).insert(id, t.clone());
        crate::metrics::transfer_started(self.counters.transport(), kind.metrics_direction());
        t
    }

    /// Records a transfer's result (the first one wins) and releases what it held.
    fn finish(&self, t: &Arc<TransferShared>, r: Result<TransferStats>) {
        {
            let mut g = lock(&t.result);
            if g.is_some() {
                return;
            }
            let (tk, dir) = (self.counters.transport(), t.kind.metrics_direction());
            match &r {
                Ok(_) => {
                    crate::metrics::transfer_completed(tk, dir, t.started.elapsed().as_secs_f64());
                    self.counters
                        .transfers_completed
                        .fetch_add(1, Ordering::Relaxed)
                }
                Err(e) => {
                    log::info!("{:?} of request {} failed: {e}", t.kind, t.request_id);
                    crate::metrics::transfer_failed(tk, dir, e.kind());
                    self.counters
                        .transfers_failed
                        .fetch_add(1, Ordering::Relaxed)
                }
            };
            *g = Some(r);
        }
        lock(&self.transfers).remove(&t.id);
        if t.kind == TransferKind::PushReceive {
            let mut sinks = lock(&self.sinks);
            if sinks
                .get(&t.request_id)
                .map(|s| Arc::ptr_eq(&s.transfer, t))
                .unwrap_or(false)
            {
                sinks.remove(&t.request_id);
            }
        }
        t.cancel.fire("finished");
        t.done.fire("finished");
    }

    /// Ends a source registration with `outcome`; false if it was not registered.
    fn end_source(&self, request_id: u64, outcome: SourceOutcome) -> bool {
        let Some(reg) = lock(&self.sources).remove(&request_id) else {
            return false;
        };
        let holders: Vec<SessionKey> = {
            let mut st = lock(&reg.st);
            st.outcome.get_or_insert(outcome);
            st.holders.drain().collect()
        };
        let sessions = lock(&self.sessions);
        for h in holders {
            if let Some(s) = sessions.get(&h) {
                lock(&s.leases).remove(&request_id);
            }
        }
        drop(sessions);
        reg.done.fire("ended");
        true
    }

    fn abort_all(&self, why: &str) {
        self.shutdown.fire(why);
        lock(&self.acceptor).take();
        let ts: Vec<_> = lock(&self.transfers).values().cloned().collect();
        for t in ts {
            self.finish(&t, Err(Error::Cancelled(why.to_string())));
        }
        let ids: Vec<u64> = lock(&self.sources).keys().copied().collect();
        for id in ids {
            self.end_source(id, SourceOutcome::Shutdown);
        }
        lock(&self.sinks).clear();
        let peers: Vec<_> = lock(&self.peers).drain().map(|(_, p)| p).collect();
        for p in peers {
            p.dead.fire(why.to_string());
            lock(&p.idle).clear();
            p.conn.close();
        }
        let sessions: Vec<_> = lock(&self.sessions).drain().map(|(_, s)| s).collect();
        for s in sessions {
            s.dead.fire(why.to_string());
        }
        lock(&self.tasks).abort_all();
    }

    /// Housekeeping: silent sessions die, unheld leases expire.
    async fn housekeeping(self: Arc<Self>) {
        let o = &self.opts;
        let period = o
            .heartbeat_interval
            .min(o.lease_ttl / 4)
            .max(Duration::from_millis(10));
        let mut tick = tokio::time::interval(period);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let now = Instant::now();
            let silent: Vec<Arc<Session>> = lock(&self.sessions)
                .values()
                .filter(|s| now.duration_since(*lock(&s.last_seen)) > o.heartbeat_timeout)
                .cloned()
                .collect();
            for s in silent {
                self.session_died(
                    &s,
                    format!(
                        "peer {} sent no heartbeat for {:?}",
                        s.key.0, o.heartbeat_timeout
                    ),
                );
            }
            let expired: Vec<u64> = lock(&self.sources)
                .values()
                .filter(|r| {
                    let st = lock(&r.st);
                    st.holders.is_empty() && now > st.deadline
                })
                .map(|r| r.request_id)
                .collect();
            for id in expired {
                log::info!("lease of request {id} expired");
                self.end_source(id, SourceOutcome::Expired);
            }
            // A push registration nobody works on (its senders never came, or died before
            // reaching us) fails instead of waiting forever.
            let idle: Vec<Arc<SinkReg>> = lock(&self.sinks)
                .values()
                .filter(|k| {
                    let st = lock(&k.st);
                    st.active == 0 && now.duration_since(st.last_activity) > o.lease_ttl
                })
                .cloned()
                .collect();
            for k in idle {
                self.finish(
                    &k.transfer,
                    Err(Error::Timeout(format!(
                        "request {}: no push activity for {:?} (no sender came, or every \
                         sender died before reaching this endpoint)",
                        k.request_id, o.lease_ttl
                    ))),
                );
            }
        }
    }

    /// A consumer/sender session is gone: release everything held for it.
    fn session_died(&self, s: &Arc<Session>, why: String) {
        {
            let mut m = lock(&self.sessions);
            match m.get(&s.key) {
                Some(x) if Arc::ptr_eq(x, s) => {
                    m.remove(&s.key);
                }
                _ => {}
            }
        }
        if s.dead.is_set() {
            return;
        }
        s.dead.fire(why.clone());
        let leased: Vec<u64> = lock(&s.leases).drain().collect();
        let pushing: Vec<u64> = lock(&s.pushing).drain().collect();
        if !self.shutdown.is_set() {
            self.counters.peer_lost();
            // A warning only when the loss affects something (leases it held, pushes it was
            // sending); a peer that simply went away after its work is routine.
            if leased.is_empty() && pushing.is_empty() {
                log::info!("peer session {} lost (nothing in flight): {why}", s.key.0);
            } else {
                log::warn!(
                    "peer session {} lost with {} leased and {} pushed requests: {why}",
                    s.key.0,
                    leased.len(),
                    pushing.len()
                );
            }
        }
        for id in leased {
            self.end_source(id, SourceOutcome::PeerLost(why.clone()));
        }
        for id in pushing {
            let sink = lock(&self.sinks).get(&id).cloned();
            if let Some(sink) = sink {
                let unfinished = {
                    let st = lock(&sink.st);
                    st.senders
                        .iter()
                        .any(|(r, k)| *k == s.key && !st.finished_ranks.contains(r))
                };
                if unfinished {
                    self.finish(
                        &sink.transfer,
                        Err(Error::PeerClosed(format!(
                            "request {id}: sender {} died before finishing: {why}",
                            s.key.0
                        ))),
                    );
                }
            }
        }
    }

    fn peer_died(&self, p: &Arc<Peer>, why: String, count: bool) {
        {
            let mut m = lock(&self.peers);
            if let Some(x) = m.get(&p.addr) {
                if Arc::ptr_eq(x, p) {
                    m.remove(&p.addr);
                }
            }
        }
        if p.dead.is_set() {
            return;
        }
        if count && !self.shutdown.is_set() {
            self.counters.peer_lost();
            // A warning only when a transfer is unfinished on this endpoint (its stripes may have
            // used the peer; endpoint-wide, so conservative). A peer that closes after serving
            // everything (a prefill exiting after the release) is routine: info. Requests on
            // lanes still checked out (a describe or release awaiting its answer) fail with their
            // own error to their caller.
            let lanes_busy = (self.opts.max_lanes_per_peer as usize)
                .saturating_sub(p.permits.available_permits());
            let transfers = lock(&self.transfers).len();
            if transfers == 0 {
                log::info!(
                    "peer {} lost (no transfer in flight, {lanes_busy} lanes in use): {why}",
                    p.addr
                );
            } else {
                log::warn!(
                    "peer {} lost with {transfers} transfers unfinished and {lanes_busy} lanes \
                     in use: {why}",
                    p.addr
                );
            }
        }
        p.dead.fire(why);
        lock(&p.idle).clear();
        p.conn.close();
    }

    /// Tells every connected peer to stop work on `request_id` (`push`: we were pushing it, so
    /// its receivers fail their registrations).
    fn send_cancel(&self, request_id: u64, push: bool) {
        for p in lock(&self.peers).values() {
            let _ = p.ctl.send(Control::Cancel { request_id, push });
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Control-lane I/O on split halves (reads and writes run concurrently)
// ---------------------------------------------------------------------------------------------

async fn read_ctl<R: AsyncRead + Unpin>(r: &mut R) -> Result<Control> {
    let mut hb = [0u8; HEADER_LEN];
    r.read_exact(&mut hb)
        .await
        .map_err(|e| Error::PeerClosed(format!("control lane closed: {e}")))?;
    let h = FrameHeader::decode(&hb)?;
    if h.kind != FrameKind::Control {
        return Err(Error::Protocol("data frame on the control lane".into()));
    }
    // The caller bounds the whole read by the heartbeat timeout.
    let body = super::framed::read_body(r, h.body_len, FOREVER)
        .await
        .map_err(|e| Error::PeerClosed(format!("control lane closed: {e}")))?;
    Control::decode(&body)
}

async fn write_ctl<W: AsyncWrite + Unpin>(w: &mut W, m: &Control, t: Duration) -> Result<()> {
    let f = m.to_frame(0)?;
    match tokio::time::timeout(t, async {
        w.write_all(&f).await?;
        w.flush().await
    })
    .await
    {
        Err(_) => Err(Error::Timeout(format!("control lane blocked for {t:?}"))),
        Ok(Err(e)) => Err(Error::PeerClosed(format!("control lane closed: {e}"))),
        Ok(Ok(())) => Ok(()),
    }
}

// ---------------------------------------------------------------------------------------------
// Client side: peers, lanes
// ---------------------------------------------------------------------------------------------

impl Inner {
    fn hello(&self, role: LaneRole) -> Control {
        Control::Hello {
            name: self.opts.name.clone(),
            protocol: wire::PROTOCOL_VERSION,
            incarnation: self.incarnation,
            role,
        }
    }

    /// Opens a lane on `conn` and says hello.
    async fn open_lane(&self, conn: &Arc<dyn Connection>, role: LaneRole) -> Result<CountedLane> {
        let t = self.opts.handshake_timeout;
        let fut = async {
            let lane = conn.open_lane().await?;
            let mut f = Framed::new(lane, self.opts.io_timeout);
            let count = LaneCount::new(&self.counters);
            f.send(&self.hello(role), 0).await?;
            match f.recv_hello(t).await? {
                (_, Control::HelloAck { protocol, .. }) if protocol == wire::PROTOCOL_VERSION => {
                    Ok(CountedLane { f, _count: count })
                }
                (_, Control::Failed { message, .. }) => Err(Error::Remote(message)),
                (_, m) => Err(Error::Protocol(format!("expected hello-ack, got {m:?}"))),
            }
        };
        match tokio::time::timeout(t + self.opts.connect_timeout, fut).await {
            Ok(r) => r,
            Err(_) => Err(Error::Timeout(format!(
                "opening a lane to {} took longer than {t:?}",
                conn.remote_addr()
            ))),
        }
    }

    /// The live peer at `addr` (a name or `host:port`), connecting if needed.
    async fn peer(self: &Arc<Self>, addr: &str) -> Result<Arc<Peer>> {
        if self.shutdown.is_set() {
            return Err(Error::Cancelled("endpoint shut down".into()));
        }
        let named = lock(&self.names).get(addr).copied();
        let sa = match named {
            Some(a) => a,
            None => resolve_addr(addr).await?,
        };
        if let Some(p) = lock(&self.peers).get(&sa) {
            if !p.dead.is_set() {
                return Ok(p.clone());
            }
        }
        let gate = lock(&self.connecting).entry(sa).or_default().clone();
        let r = self.connect_peer(sa, &gate).await;
        // Forget the gate unless another caller is waiting on it (clones are made under the
        // map's lock), so addresses of peers that came and went do not accumulate.
        let mut m = lock(&self.connecting);
        if m.get(&sa).is_some_and(|g| Arc::ptr_eq(g, &gate)) && Arc::strong_count(&gate) == 2 {
            m.remove(&sa);
        }
        r
    }

    /// Connects to `sa` (one caller per address at a time: `gate`) unless a live peer is there.
    async fn connect_peer(
        self: &Arc<Self>,
        sa: SocketAddr,
        gate: &tokio::sync::Mutex<()>,
    ) -> Result<Arc<Peer>> {
        let _g = gate.lock().await;
        if let Some(p) = lock(&self.peers).get(&sa) {
            if !p.dead.is_set() {
                return Ok(p.clone());
            }
        }
        let conn = self.transport.connect(sa).await?;
        let ctl = match self.open_lane(&conn, LaneRole::Control).await {
            Ok(l) => l,
            Err(e) => {
                conn.close();
                return Err(e);
            }
        };
        let (tx, rx) = mpsc::unbounded_channel();
        let peer = Arc::new(Peer {
            addr: sa,
            conn,
            idle: Mutex::new(Vec::new()),
            permits: Arc::new(Semaphore::new(self.opts.max_lanes_per_peer as usize)),
            dead: Signal::default(),
            ctl: tx,
        });
        lock(&self.peers).insert(sa, peer.clone());
        crate::metrics::peer_connected();
        let me = self.clone();
        let p = peer.clone();
        self.spawn(async move { me.client_control(p, ctl, rx).await });
        Ok(peer)
    }

    /// Client side of a control lane: heartbeats out, answers in; death on silence or close.
    async fn client_control(
        self: Arc<Self>,
        peer: Arc<Peer>,
        lane: CountedLane,
        mut rx: mpsc::UnboundedReceiver<Control>,
    ) {
        let CountedLane { f, _count } = lane;
        let (mut r, mut w) = tokio::io::split(f.lane);
        let o = &self.opts;
        let mute = o.faults.mute_heartbeats;
        let reader = async {
            loop {
                match tokio::time::timeout(o.heartbeat_timeout, read_ctl(&mut r)).await {
                    Err(_) => {
                        return format!(
                            "no heartbeat answer from {} for {:?}",
                            peer.addr, o.heartbeat_timeout
                        )
                    }
                    Ok(Err(e)) => return format!("{e}"),
                    Ok(Ok(Control::Pong { seq })) => log::trace!("pong {seq} from {}", peer.addr),
                    Ok(Ok(m)) => log::debug!("control message from {}: {m:?}", peer.addr),
                }
            }
        };
        let writer = async {
            let mut tick = tokio::time::interval(o.heartbeat_interval);
            let mut seq = 0;
            loop {
                let msg = tokio::select! {
                    _ = tick.tick() => { seq += 1; Control::Ping { seq } }
                    m = rx.recv() => match m { Some(m) => m, None => return "closed".to_string() },
                };
                if mute && matches!(msg, Control::Ping { .. }) {
                    continue;
                }
                if let Err(e) = write_ctl(&mut w, &msg, o.io_timeout).await {
                    return format!("{e}");
                }
            }
        };
        let why = tokio::select! {
            w = reader => w,
            w = writer => w,
            _ = peer.dead.wait() => peer.dead.reason(),
            _ = self.shutdown.wait() => "endpoint shut down".to_string(),
        };
        self.peer_died(&peer, why, true);
    }

    async fn checkout(self: &Arc<Self>, peer: &Arc<Peer>) -> Result<LaneGuard> {
        let permit = tokio::select! {
            p = peer.permits.clone().acquire_owned() => p.map_err(|_| Error::PeerClosed("peer closed".into()))?,
            _ = peer.dead.wait() => return Err(Error::PeerClosed(format!("peer {}: {}", peer.addr, peer.dead.reason()))),
        };
        if let Some(f) = lock(&peer.idle).pop() {
            return Ok(LaneGuard {
                f: f.f,
                _count: f._count,
                _permit: permit,
            });
        }
        let l = tokio::select! {
            l = self.open_lane(&peer.conn, LaneRole::Data) => l?,
            _ = peer.dead.wait() => return Err(Error::PeerClosed(format!("peer {}: {}", peer.addr, peer.dead.reason()))),
        };
        Ok(LaneGuard {
            f: l.f,
            _count: l._count,
            _permit: permit,
        })
    }

    fn give_back(&self, peer: &Arc<Peer>, g: LaneGuard) {
        if peer.dead.is_set() || self.shutdown.is_set() {
            return;
        }
        lock(&peer.idle).push(CountedLane {
            f: g.f,
            _count: g._count,
        });
    }
}

/// A data lane checked out of a peer's pool.
struct LaneGuard {
    f: Framed,
    _count: LaneCount,
    _permit: tokio::sync::OwnedSemaphorePermit,
}

// ---------------------------------------------------------------------------------------------
// Client side: describe, pull, push
// ---------------------------------------------------------------------------------------------

impl Inner {
    async fn describe(
        self: &Arc<Self>,
        addr: &str,
        request_id: u64,
        sink: bool,
    ) -> Result<(Placement, u32)> {
        let peer = self.peer(addr).await?;
        let mut lane = self.checkout(&peer).await?;
        lane.f
            .send(&Control::Describe { request_id, sink }, request_id)
            .await?;
        let r = lane.f.recv(self.opts.io_timeout).await?;
        self.give_back(&peer, lane);
        match r {
            (
                _,
                Control::Description {
                    num_tokens,
                    placement,
                    ..
                },
            ) => Ok((placement, num_tokens)),
            (_, Control::Failed { message, .. }) => Err(Error::Remote(message)),
            (_, m) => Err(Error::Protocol(format!(
                "expected a description, got {m:?}"
            ))),
        }
    }

    /// Runs `fut` unless the transfer is cancelled or the peer dies first.
    async fn guarded<T>(
        t: &TransferShared,
        peer: &Peer,
        fut: impl std::future::Future<Output = Result<T>>,
    ) -> Result<T> {
        let died = || Error::PeerClosed(format!("peer {} died: {}", peer.addr, peer.dead.reason()));
        tokio::select! {
            r = fut => match r {
                // Closing the connection of a dead peer also fails its lanes: report the cause.
                Err(e) if peer.dead.is_set() && !matches!(e, Error::Checksum(_)) => {
                    log::debug!("{e} (peer dead)");
                    Err(died())
                }
                r => r,
            },
            _ = t.cancel.wait() => Err(Error::Cancelled(format!("request {} cancelled", t.request_id))),
            _ = peer.dead.wait() => Err(died()),
        }
    }

    async fn drive_pull(
        self: &Arc<Self>,
        t: &Arc<TransferShared>,
        req: PullRequest,
        pairs: Vec<(u32, u32, Arc<SpanCursor>)>,
        progress: Arc<Progress>,
    ) -> Result<TransferStats> {
        let mut set: JoinSet<Result<u64>> = JoinSet::new();
        let mut stripes_used = 0u64;
        let spans: u64 = pairs.iter().map(|p| p.2.spans().len() as u64).sum();
        for (i, (s, d, cursor)) in pairs.iter().enumerate() {
            let total = cursor.total();
            let count = stripes_for(total, self.opts.chunk_bytes, self.opts.streams_per_pair);
            let digest = spans_digest(cursor.spans());
            for k in 0..count {
                stripes_used += 1;
                let stripe = Stripe {
                    index: k,
                    count,
                    chunk_bytes: self.opts.chunk_bytes,
                };
                let (me, t, cursor, progress) =
                    (self.clone(), t.clone(), cursor.clone(), progress.clone());
                let (addr, dst, staging) = (
                    req.sources.get(*s)?.to_string(),
                    req.dst.clone(),
                    req.staging.clone(),
                );
                let (s, d, rid) = (*s, *d, req.request_id);
                set.spawn(tracing::Instrument::instrument(
                    async move {
                        let peer = me.peer(&addr).await?;
                        let mut lane = Self::guarded(&t, &peer, me.checkout(&peer)).await?;
                        let msg = Control::Pull {
                            request_id: rid,
                            src_rank: s,
                            dst_rank: d,
                            dst,
                            digest,
                            total_bytes: total,
                            stripe,
                        };
                        Self::guarded(&t, &peer, lane.f.send(&msg, rid)).await?;
                        let r = Self::guarded(&t, &peer, async {
                            Ok(recv_stripe(
                                &mut lane.f,
                                rid,
                                &staging,
                                d,
                                &cursor,
                                stripe,
                                &progress,
                                i,
                                &me.counters,
                            )
                            .await)
                        })
                        .await?;
                        match r {
                            Ok(n) => {
                                t.bytes.fetch_add(n, Ordering::Relaxed);
                                me.give_back(&peer, lane);
                                Ok(n)
                            }
                            Err(f) => {
                                if f.lane_ok {
                                    me.give_back(&peer, lane);
                                }
                                if peer.dead.is_set() && !matches!(f.error, Error::Checksum(_)) {
                                    return Err(Error::PeerClosed(format!(
                                        "peer {} died: {}",
                                        peer.addr,
                                        peer.dead.reason()
                                    )));
                                }
                                Err(f.error)
                            }
                        }
                    },
                    tracing::info_span!(
                        "network",
                        request_id = rid,
                        src_rank = s,
                        dst_rank = d,
                        stripe = k
                    ),
                ));
            }
        }
        let bytes = join_stripes(&mut set).await?;
        Ok(TransferStats {
            bytes,
            spans,
            pairs: pairs.len() as u64,
            stripes: stripes_used,
            elapsed: t.started.elapsed(),
        })
    }

    async fn drive_push(
        self: &Arc<Self>,
        t: &Arc<TransferShared>,
        req: PushRequest,
        src_ranks: Vec<u32>,
        pairs: Vec<(u32, u32, Arc<SpanCursor>)>,
        targets: Vec<String>,
    ) -> Result<TransferStats> {
        let mut set: JoinSet<Result<u64>> = JoinSet::new();
        let mut stripes_used = 0u64;
        let spans: u64 = pairs.iter().map(|p| p.2.spans().len() as u64).sum();
        for (s, d, cursor) in pairs.iter() {
            let total = cursor.total();
            let count = stripes_for(total, self.opts.chunk_bytes, self.opts.streams_per_pair);
            let digest = spans_digest(cursor.spans());
            for k in 0..count {
                stripes_used += 1;
                let stripe = Stripe {
                    index: k,
                    count,
                    chunk_bytes: self.opts.chunk_bytes,
                };
                let (me, t, cursor) = (self.clone(), t.clone(), cursor.clone());
                let (addr, src, staging) = (
                    req.targets.get(*d)?.to_string(),
                    req.src.clone(),
                    req.staging.clone(),
                );
                let (s, d, rid, n_tok) = (*s, *d, req.request_id, req.num_tokens);
                set.spawn(tracing::Instrument::instrument(
                    async move {
                        let peer = me.peer(&addr).await?;
                        let mut lane = Self::guarded(&t, &peer, me.checkout(&peer)).await?;
                        let msg = Control::Push {
                            request_id: rid,
                            src_rank: s,
                            dst_rank: d,
                            src,
                            num_tokens: n_tok,
                            digest,
                            total_bytes: total,
                            stripe,
                        };
                        let io = me.opts.io_timeout;
                        Self::guarded(&t, &peer, lane.f.send(&msg, rid)).await?;
                        match Self::guarded(&t, &peer, lane.f.recv(io)).await? {
                            (_, Control::Ready { .. }) => {}
                            (_, Control::Failed { message, .. }) => {
                                me.give_back(&peer, lane);
                                return Err(Error::Remote(message));
                            }
                            (_, m) => {
                                return Err(Error::Protocol(format!("expected ready, got {m:?}")))
                            }
                        }
                        let gate = t.gate.as_ref().map(|g| g.subscribe());
                        let n = Self::guarded(
                            &t,
                            &peer,
                            send_stripe(
                                &mut lane.f,
                                rid,
                                &staging,
                                s,
                                &cursor,
                                stripe,
                                gate,
                                &me.counters,
                                &me.opts.faults,
                            ),
                        )
                        .await?;
                        match Self::guarded(&t, &peer, lane.f.recv(io)).await? {
                            (_, Control::StreamAck { bytes, .. }) if bytes == n => {
                                t.bytes.fetch_add(n, Ordering::Relaxed);
                                me.give_back(&peer, lane);
                                Ok(n)
                            }
                            (_, Control::Failed { message, .. }) => {
                                me.give_back(&peer, lane);
                                Err(Error::Remote(message))
                            }
                            (_, m) => {
                                Err(Error::Protocol(format!("expected stream-ack, got {m:?}")))
                            }
                        }
                    },
                    tracing::info_span!(
                        "network",
                        request_id = rid,
                        src_rank = s,
                        dst_rank = d,
                        stripe = k
                    ),
                ));
            }
        }
        let bytes = join_stripes(&mut set).await?;
        // Every destination endpoint learns that our ranks are finished (also those that got
        // no bytes from us).
        for addr in targets {
            let peer = self.peer(&addr).await?;
            let mut lane = Self::guarded(t, &peer, self.checkout(&peer)).await?;
            let msg = Control::PushFinish {
                request_id: req.request_id,
                src_ranks: src_ranks.clone(),
                src: req.src.clone(),
                num_tokens: req.num_tokens,
            };
            Self::guarded(t, &peer, lane.f.send(&msg, req.request_id)).await?;
            match Self::guarded(t, &peer, lane.f.recv(self.opts.io_timeout)).await? {
                (_, Control::Finished { .. }) => self.give_back(&peer, lane),
                (_, Control::Failed { message, .. }) => {
                    self.give_back(&peer, lane);
                    return Err(Error::Remote(message));
                }
                (_, m) => return Err(Error::Protocol(format!("expected finished, got {m:?}"))),
            }
        }
        Ok(TransferStats {
            bytes,
            spans,
            pairs: pairs.len() as u64,
            stripes: stripes_used,
            elapsed: t.started.elapsed(),
        })
    }
}

// ---------------------------------------------------------------------------------------------
// Server side
// ---------------------------------------------------------------------------------------------

fn failed(request_id: u64, e: &Error) -> Control {
    Control::Failed {
        request_id,
        message: e.to_string(),
    }
}

/// What a handler step means for its lane.
enum Next {
    /// Keep serving this lane.
    Continue,
    /// Close the lane (frame sync lost, or the session ended).
    Close,
}

impl Inner {
    async fn accept_loop(self: Arc<Self>, acc: Arc<dyn Acceptor>) {
        loop {
            let lane = tokio::select! {
                l = acc.accept() => l,
                _ = self.shutdown.wait() => return,
            };
            match lane {
                Ok(lane) => {
                    let Ok(permit) = self.inbound.clone().try_acquire_owned() else {
                        let n = self.counters.lanes_refused.fetch_add(1, Ordering::Relaxed);
                        if n.is_power_of_two() || n == 0 {
                            log::warn!(
                                "refused an inbound lane from {}: {} lanes already served \
                                 (max_inbound_lanes; {} refused so far)",
                                lane.peer().addr,
                                self.opts.max_inbound_lanes,
                                n + 1
                            );
                        }
                        drop(lane);
                        continue;
                    };
                    let me = self.clone();
                    self.spawn(async move {
                        me.serve_lane(lane).await;
                        drop(permit);
                    });
                }
                Err(e) => {
                    log::info!("listener ended: {e}");
                    return;
                }
            }
        }
    }

    async fn serve_lane(self: Arc<Self>, lane: Box<dyn Lane>) {
        let count = LaneCount::new(&self.counters);
        let peer = lane.peer();
        let mut f = Framed::new(lane, self.opts.io_timeout);
        let (name, incarnation, role) = match f.recv_hello(self.opts.handshake_timeout).await {
            Ok((
                _,
                Control::Hello {
                    name,
                    protocol,
                    incarnation,
                    role,
                },
            )) if protocol == wire::PROTOCOL_VERSION => (name, incarnation, role),
            Ok((_, Control::Hello { protocol, .. })) => {
                let e = Error::Protocol(format!(
                    "peer speaks protocol {protocol}, this endpoint {}",
                    wire::PROTOCOL_VERSION
                ));
                let _ = f.send(&failed(0, &e), 0).await;
                return;
            }
            Ok((_, m)) => {
                log::warn!("lane from {}: expected hello, got {m:?}", peer.addr);
                return;
            }
            Err(e) => {
                log::info!("lane from {} ended before hello: {e}", peer.addr);
                return;
            }
        };
        let session = self.session(&name, incarnation);
        let ack = Control::HelloAck {
            name: self.opts.name.clone(),
            protocol: wire::PROTOCOL_VERSION,
            incarnation: self.incarnation,
        };
        if f.send(&ack, 0).await.is_err() {
            return;
        }
        match role {
            LaneRole::Control => self.server_control(session, f, count).await,
            LaneRole::Data => loop {
                let r = tokio::select! {
                    r = f.recv(FOREVER) => r,
                    _ = session.dead.wait() => return,
                    _ = self.shutdown.wait() => return,
                };
                let (rid, msg) = match r {
                    Ok(m) => m,
                    Err(Error::PeerClosed(_)) => return,
                    Err(e) => {
                        log::info!("data lane from {name}: {e}");
                        return;
                    }
                };
                session.touch();
                match self.handle(&session, &mut f, rid, msg).await {
                    Next::Continue => {}
                    Next::Close => return,
                }
            },
        }
    }

    /// The session of `(name, incarnation)`; a new incarnation of a known name replaces (and
    /// cleans up) the old one: that process restarted.
    fn session(&self, name: &str, incarnation: u64) -> Arc<Session> {
        let key = (name.to_string(), incarnation);
        let (s, stale) = {
            let mut m = lock(&self.sessions);
            let stale: Vec<Arc<Session>> = m
                .iter()
                .filter(|(k, _)| k.0 == name && k.1 != incarnation)
                .map(|(_, s)| s.clone())
                .collect();
            let s = m
                .entry(key.clone())
                .or_insert_with(|| {
                    crate::metrics::peer_connected();
                    Arc::new(Session {
                        key,
                        last_seen: Mutex::new(Instant::now()),
                        dead: Signal::default(),
                        leases: Mutex::new(HashSet::new()),
                        pushing: Mutex::new(HashSet::new()),
                    })
                })
                .clone();
            (s, stale)
        };
        for old in stale {
            self.session_died(&old, format!("peer {name} restarted (new incarnation)"));
        }
        s.touch();
        s
    }

    async fn server_control(self: Arc<Self>, s: Arc<Session>, f: Framed, _count: LaneCount) {
        let (mut r, mut w) = tokio::io::split(f.lane);
        let (tx, mut rx) = mpsc::unbounded_channel::<Control>();
        let o = &self.opts;
        let mute = o.faults.mute_heartbeats;
        let reader = async {
            loop {
                match tokio::time::timeout(o.heartbeat_timeout, read_ctl(&mut r)).await {
                    Err(_) => {
                        return format!(
                            "no heartbeat from {} for {:?}",
                            s.key.0, o.heartbeat_timeout
                        )
                    }
                    Ok(Err(e)) => return format!("{e}"),
                    Ok(Ok(Control::Ping { seq })) => {
                        s.touch();
                        if !mute {
                            let _ = tx.send(Control::Pong { seq });
                        }
                    }
                    Ok(Ok(Control::Cancel { request_id, push })) => {
                        s.touch();
                        self.remote_cancel(&s, request_id, push);
                    }
                    Ok(Ok(m)) => log::debug!("control message from {}: {m:?}", s.key.0),
                }
            }
        };
        let writer = async {
            while let Some(m) = rx.recv().await {
                if let Err(e) = write_ctl(&mut w, &m, o.io_timeout).await {
                    return format!("{e}");
                }
            }
            "closed".to_string()
        };
        let why = tokio::select! {
            w = reader => w,
            w = writer => w,
            _ = s.dead.wait() => return,
            _ = self.shutdown.wait() => return,
        };
        self.session_died(&s, why);
    }

    /// A peer cancelled a request: a push it was making into us fails here too, also when none of
    /// its stripes reached us yet (`push`; the request cannot complete without its ranks).
    fn remote_cancel(&self, s: &Arc<Session>, request_id: u64, push: bool) {
        if !push && !lock(&s.pushing).contains(&request_id) {
            return;
        }
        let sink = lock(&self.sinks).get(&request_id).cloned();
        if let Some(sink) = sink {
            self.finish(
                &sink.transfer,
                Err(Error::Cancelled(format!(
                    "request {request_id}: sender {} cancelled its push",
                    s.key.0
                ))),
            );
        }
    }

    fn take_lease(&self, s: &Arc<Session>, reg: &SourceReg) {
        lock(&reg.st).holders.insert(s.key.clone());
        lock(&s.leases).insert(reg.request_id);
    }

    async fn handle(&self, s: &Arc<Session>, f: &mut Framed, rid: u64, msg: Control) -> Next {
        async fn reply(f: &mut Framed, m: Control, rid: u64) -> Next {
            match f.send(&m, rid).await {
                Ok(()) => Next::Continue,
                Err(_) => Next::Close,
            }
        }
        match msg {
            Control::Describe { request_id, sink } => {
                let m = if sink {
                    match lock(&self.sinks).get(&request_id) {
                        Some(k) => Control::Description {
                            request_id,
                            num_tokens: k.num_tokens,
                            placement: k.dst.clone(),
                        },
                        None => failed(
                            request_id,
                            &Error::UnknownRequest(format!(
                                "request {request_id} expects no push here"
                            )),
                        ),
                    }
                } else {
                    let reg = lock(&self.sources).get(&request_id).cloned();
                    match reg {
                        Some(r) => {
                            self.take_lease(s, &r);
                            Control::Description {
                                request_id,
                                num_tokens: r.num_tokens,
                                placement: r.placement.clone(),
                            }
                        }
                        None => failed(
                            request_id,
                            &Error::UnknownRequest(format!(
                                "request {request_id} is not registered here"
                            )),
                        ),
                    }
                };
                reply(f, m, rid).await
            }
            Control::Release { request_id } => {
                let reg = lock(&self.sources).get(&request_id).cloned();
                let mut all = false;
                if let Some(reg) = reg {
                    all = {
                        let mut st = lock(&reg.st);
                        st.holders.remove(&s.key);
                        st.releases += 1;
                        st.deadline = Instant::now() + self.opts.lease_ttl;
                        st.releases >= reg.expected_releases
                    };
                    lock(&s.leases).remove(&request_id);
                }
                // Acknowledge before ending the registration: its owner may shut the endpoint down
                // as soon as it learns the request was released, and the acknowledgement must
                // already be on its way by then.
                let r = reply(f, Control::Released { request_id }, rid).await;
                if all {
                    self.end_source(request_id, SourceOutcome::Released);
                }
                r
            }
            Control::Pull {
                request_id,
                src_rank,
                dst_rank,
                dst,
                digest,
                total_bytes,
                stripe,
            } => {
                tracing::Instrument::instrument(
                    self.serve_pull(
                        s,
                        f,
                        request_id,
                        src_rank,
                        dst_rank,
                        &dst,
                        digest,
                        total_bytes,
                        stripe,
                    ),
                    tracing::info_span!("serve_pull", request_id, src_rank, dst_rank),
                )
                .await
            }
            Control::Push {
                request_id,
                src_rank,
                dst_rank,
                src,
                num_tokens,
                digest,
                total_bytes,
                stripe,
            } => {
                self.receive_push(
                    s,
                    f,
                    request_id,
                    src_rank,
                    dst_rank,
                    &src,
                    num_tokens,
                    digest,
                    total_bytes,
                    stripe,
                )
                .await
            }
            Control::PushFinish {
                request_id,
                src_ranks,
                src,
                num_tokens,
            } => {
                let m = match self.push_finish(s, request_id, &src_ranks, &src, num_tokens) {
                    Ok(complete) => Control::Finished {
                        request_id,
                        complete,
                    },
                    Err(e) => failed(request_id, &e),
                };
                reply(f, m, rid).await
            }
            other => {
                let e = Error::Protocol(format!("unexpected message on a data lane: {other:?}"));
                let _ = f.send(&failed(rid, &e), rid).await;
                Next::Close
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    async fn serve_pull(
        &self,
        s: &Arc<Session>,
        f: &mut Framed,
        request_id: u64,
        src_rank: u32,
        dst_rank: u32,
        dst: &Placement,
        digest: u64,
        total_bytes: u64,
        stripe: Stripe,
    ) -> Next {
        let prep = (|| -> Result<(Arc<SourceReg>, SpanCursor)> {
            stripe.validate()?;
            let reg = lock(&self.sources)
                .get(&request_id)
                .cloned()
                .ok_or_else(|| {
                    Error::UnknownRequest(format!("request {request_id} is not registered here"))
                })?;
            self.take_lease(s, &reg);
            if reg.staging.ranges(src_rank).is_empty() {
                return Err(Error::BlockRange(format!(
                    "source rank {src_rank} of request {request_id} is not hosted here"
                )));
            }
            let plan = reg.plan_for(dst)?;
            let spans = plan.pair_spans(src_rank, dst_rank);
            let mine = spans_digest(&spans);
            let bytes: u64 = spans.iter().map(Span::bytes).sum();
            if mine != digest || bytes != total_bytes {
                return Err(Error::Mismatch(format!(
                    "plan for ranks {src_rank}->{dst_rank} of request {request_id} differs: \
                     sender has {bytes} bytes (digest {mine:016x}), receiver expects \
                     {total_bytes} (digest {digest:016x})"
                )));
            }
            stripe.validate_for(bytes)?;
            let cursor = SpanCursor::new(spans, reg.num_layers);
            Ok((reg, cursor))
        })();
        let (reg, cursor) = match prep {
            Ok(x) => x,
            Err(e) => {
                return match f.send(&failed(request_id, &e), request_id).await {
                    Ok(()) => Next::Continue,
                    Err(_) => Next::Close,
                }
            }
        };
        let gate = (*reg.layers.borrow() < reg.num_layers).then(|| reg.layers.subscribe());
        let r = tokio::select! {
            r = send_stripe(f, request_id, &reg.staging, src_rank, &cursor, stripe, gate, &self.counters, &self.opts.faults) => r,
            _ = reg.done.wait() => Err(Error::Cancelled(format!("request {request_id} was withdrawn"))),
            _ = s.dead.wait() => Err(Error::PeerClosed("session ended".into())),
        };
        match r {
            Ok(_) => Next::Continue,
            Err(e) => {
                log::info!("pull of request {request_id} by {} ended: {e}", s.key.0);
                Next::Close
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    async fn receive_push(
        &self,
        s: &Arc<Session>,
        f: &mut Framed,
        request_id: u64,
        src_rank: u32,
        dst_rank: u32,
        src: &Placement,
        num_tokens: u32,
        digest: u64,
        total_bytes: u64,
        stripe: Stripe,
    ) -> Next {
        type Prepared = (Arc<SinkReg>, Arc<SpanCursor>, Arc<Progress>, usize);
        let prep = (|| -> Result<Prepared> {
            stripe.validate()?;
            let sink = lock(&self.sinks).get(&request_id).cloned().ok_or_else(|| {
                Error::UnknownRequest(format!("request {request_id} expects no push here"))
            })?;
            let mut st = lock(&sink.st);
            sink_plan(&sink, &mut st, src, num_tokens)?;
            if let Some(owner) = st.senders.get(&src_rank) {
                if *owner != s.key {
                    return Err(Error::Protocol(format!(
                        "source rank {src_rank} of request {request_id} is already pushed by {}",
                        owner.0
                    )));
                }
            }
            if st.finished_ranks.contains(&src_rank) {
                return Err(Error::Protocol(format!(
                    "source rank {src_rank} of request {request_id} already declared itself finished"
                )));
            }
            let progress = st.progress.clone().expect("planned");
            let slot = st.slots.get_mut(&(src_rank, dst_rank)).ok_or_else(|| {
                Error::BlockRange(format!(
                    "request {request_id}: no bytes planned from source rank {src_rank} to \
                     destination rank {dst_rank} on this endpoint"
                ))
            })?;
            if slot.digest != digest || slot.cursor.total() != total_bytes {
                return Err(Error::Mismatch(format!(
                    "plan for ranks {src_rank}->{dst_rank} of request {request_id} differs: \
                     receiver has {} bytes (digest {:016x}), sender {total_bytes} (digest \
                     {digest:016x})",
                    slot.cursor.total(),
                    slot.digest
                )));
            }
            stripe.validate_for(total_bytes)?;
            if slot.count == 0 {
                slot.count = stripe.count;
                slot.chunk = stripe.chunk_bytes;
                slot.started = vec![false; stripe.count as usize];
                slot.done = vec![false; stripe.count as usize];
            } else if slot.count != stripe.count || slot.chunk != stripe.chunk_bytes {
                return Err(Error::Protocol(format!(
                    "sender changed its declared stream count for ranks {src_rank}->{dst_rank} of \
                     request {request_id}: {} stripes of {} bytes, now {} of {}",
                    slot.count, slot.chunk, stripe.count, stripe.chunk_bytes
                )));
            }
            if std::mem::replace(&mut slot.started[stripe.index as usize], true) {
                return Err(Error::Protocol(format!(
                    "stripe {} of ranks {src_rank}->{dst_rank} of request {request_id} delivered \
                     twice (over-delivery)",
                    stripe.index
                )));
            }
            let (cursor, idx) = (slot.cursor.clone(), slot.idx);
            st.senders.insert(src_rank, s.key.clone());
            st.stripes += 1;
            st.active += 1;
            st.last_activity = Instant::now();
            drop(st);
            lock(&s.pushing).insert(request_id);
            Ok((sink, cursor, progress, idx))
        })();
        let (sink, cursor, progress, idx) = match prep {
            Ok(x) => (ActiveStripe(x.0.clone()), x.1, x.2, x.3),
            Err(e) => {
                // A protocol violation fails the request at the receiver as well.
                if matches!(e, Error::Protocol(_) | Error::Mismatch(_)) {
                    let k = lock(&self.sinks).get(&request_id).cloned();
                    if let Some(k) = k {
                        self.finish(&k.transfer, Err(e.clone()));
                    }
                }
                return match f.send(&failed(request_id, &e), request_id).await {
                    Ok(()) => Next::Continue,
                    Err(_) => Next::Close,
                };
            }
        };
        if f.send(&Control::Ready { request_id }, request_id)
            .await
            .is_err()
        {
            return Next::Close;
        }
        // A request failed by a corrupt chunk on another stripe keeps this stripe draining (its
        // lane stays in sync and reusable); a cancelled one stops at once.
        let r = {
            let recv = recv_stripe(
                f,
                request_id,
                &sink.0.staging,
                dst_rank,
                &cursor,
                stripe,
                &progress,
                idx,
                &self.counters,
            );
            tokio::pin!(recv);
            let mut draining = false;
            loop {
                tokio::select! {
                    r = &mut recv => break Some(r),
                    _ = sink.0.transfer.cancel.wait(), if !draining => {
                        let soft = matches!(
                            lock(&sink.0.transfer.result).as_ref(),
                            Some(Err(Error::Checksum(_)))
                        );
                        if soft {
                            draining = true;
                        } else {
                            break None;
                        }
                    }
                    _ = s.dead.wait() => break None,
                }
            }
        };
        match r {
            None => Next::Close,
            Some(Ok(n)) => {
                sink.0.transfer.bytes.fetch_add(n, Ordering::Relaxed);
                if let Some(slot) = lock(&sink.0.st).slots.get_mut(&(src_rank, dst_rank)) {
                    slot.done[stripe.index as usize] = true;
                }
                match f
                    .send(
                        &Control::StreamAck {
                            request_id,
                            bytes: n,
                        },
                        request_id,
                    )
                    .await
                {
                    Ok(()) => Next::Continue,
                    Err(_) => Next::Close,
                }
            }
            Some(Err(fail)) => {
                self.finish(&sink.0.transfer, Err(fail.error.clone()));
                if fail.lane_ok
                    && f.send(&failed(request_id, &fail.error), request_id)
                        .await
                        .is_ok()
                {
                    Next::Continue
                } else {
                    Next::Close
                }
            }
        }
    }

    fn push_finish(
        &self,
        s: &Arc<Session>,
        request_id: u64,
        src_ranks: &[u32],
        src: &Placement,
        num_tokens: u32,
    ) -> Result<bool> {
        let sink = lock(&self.sinks).get(&request_id).cloned().ok_or_else(|| {
            Error::UnknownRequest(format!("request {request_id} expects no push here"))
        })?;
        let mut st = lock(&sink.st);
        st.last_activity = Instant::now();
        if let Err(e) = sink_plan(&sink, &mut st, src, num_tokens) {
            drop(st);
            self.finish(&sink.transfer, Err(e.clone()));
            return Err(e);
        }
        for &r in src_ranks {
            if src.local_rank(r).is_none() {
                return Err(Error::Protocol(format!(
                    "source rank {r} is not in the senders' DP replica"
                )));
            }
            if let Some(owner) = st.senders.get(&r) {
                if *owner != s.key {
                    return Err(Error::Protocol(format!(
                        "source rank {r} is pushed by {}, not {}",
                        owner.0, s.key.0
                    )));
                }
            }
            let incomplete: Vec<u32> = st
                .slots
                .iter()
                .filter(|((sr, _), slot)| *sr == r && !slot.complete())
                .map(|((_, d), _)| *d)
                .collect();
            if !incomplete.is_empty() {
                let e = Error::Protocol(format!(
                    "request {request_id}: source rank {r} declared itself finished without \
                     delivering its bytes for destination ranks {incomplete:?}"
                ));
                drop(st);
                self.finish(&sink.transfer, Err(e.clone()));
                return Err(e);
            }
            st.senders.insert(r, s.key.clone());
            st.finished_ranks.insert(r);
        }
        lock(&s.pushing).insert(request_id);
        let all: Vec<u32> = (0..src.layout.spec.ranks_per_replica())
            .map(|l| src.global_rank(l))
            .collect();
        let complete = all.iter().all(|r| st.finished_ranks.contains(r))
            && st.slots.values().all(PairSlot::complete);
        if complete {
            let stats = TransferStats {
                bytes: sink.transfer.bytes.load(Ordering::Relaxed),
                spans: st
                    .slots
                    .values()
                    .map(|p| p.cursor.spans().len() as u64)
                    .sum(),
                pairs: st.slots.len() as u64,
                stripes: st.stripes,
                elapsed: sink.transfer.started.elapsed(),
            };
            drop(st);
            self.finish(&sink.transfer, Ok(stats));
        }
        Ok(complete)
    }
}
